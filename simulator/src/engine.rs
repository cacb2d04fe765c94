//! The event-driven engine: a task graph, the resources its tasks run on, and [`simulate`].
//!
//! The engine is a pure function `(graph, costs, resources) -> trace`. Durations live outside the
//! graph (a `&[Seconds]` indexed by task id) so one graph can be re-costed and re-simulated
//! cheaply, e.g. by a planner trying several cost assumptions.
//!
//! Scheduling rule (list scheduling, event-driven): a task becomes *ready* when its last
//! predecessor finishes; it starts at `max(ready, a slot of its resource is free)`. When several
//! ready tasks wait for the same resource, the one that became ready first wins, then the one
//! with the smaller [`Task::priority`], then the smaller task id. Completions that happen at the
//! same instant are all processed before any task is dispatched at that instant, so the choice
//! does not depend on the order in which simultaneous events are popped. (A zero-duration task
//! started at an instant completes in a later round at the same instant, and what it releases
//! is dispatched then.)

use parallax_ir::Seconds;
use serde::Serialize;
use serde_json::{json, Value};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;
use thiserror::Error;

/// Index of a task in its [`TaskGraph`] (tasks are numbered in insertion order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct TaskId(pub u32);

impl TaskId {
    /// The id as an index into per-task slices (costs, spans).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Index of a resource in its [`Resources`] (numbered in insertion order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct ResourceId(pub u32);

impl ResourceId {
    /// The id as an index into per-resource slices.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a communication task moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum CommKind {
    /// Tensor-parallel all-reduce of partial activations / gradients.
    TpAllReduce,
    /// Tensor/sequence-parallel all-gather.
    TpAllGather,
    /// Tensor/sequence-parallel reduce-scatter.
    TpReduceScatter,
    /// Context-parallel exchange of key/value blocks (ring attention).
    CpKv,
    /// Data-parallel gradient all-reduce.
    DpAllReduce,
    /// Data-parallel gradient reduce-scatter (ZeRO-2/3, FSDP).
    DpReduceScatter,
    /// ZeRO-3 / FSDP parameter all-gather.
    ZeroAllGather,
    /// Pipeline point-to-point send of activations or gradients.
    PipelineP2p,
    /// Expert-parallel all-to-all (token dispatch / combine).
    AllToAll,
    /// Resharding a tensor between two per-op configurations (general graphs).
    Reshard,
    /// Any other communication.
    Other,
}

/// What a task does; used for per-kind totals and trace colouring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum TaskKind {
    /// Forward pass computation.
    Forward,
    /// Backward pass computing input (activation) gradients.
    BackwardInput,
    /// Backward pass computing weight gradients.
    BackwardWeight,
    /// Communication.
    Comm(CommKind),
    /// Optimizer step.
    Optimizer,
    /// Anything else.
    Other,
}

impl TaskKind {
    /// A short stable name (used as the Chrome-trace category).
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Forward => "forward",
            TaskKind::BackwardInput => "backward_input",
            TaskKind::BackwardWeight => "backward_weight",
            TaskKind::Comm(c) => match c {
                CommKind::TpAllReduce => "comm_tp_all_reduce",
                CommKind::TpAllGather => "comm_tp_all_gather",
                CommKind::TpReduceScatter => "comm_tp_reduce_scatter",
                CommKind::CpKv => "comm_cp_kv",
                CommKind::DpAllReduce => "comm_dp_all_reduce",
                CommKind::DpReduceScatter => "comm_dp_reduce_scatter",
                CommKind::ZeroAllGather => "comm_zero_all_gather",
                CommKind::PipelineP2p => "comm_pipeline_p2p",
                CommKind::AllToAll => "comm_all_to_all",
                CommKind::Reshard => "comm_reshard",
                CommKind::Other => "comm_other",
            },
            TaskKind::Optimizer => "optimizer",
            TaskKind::Other => "other",
        }
    }
}

/// Why an edge exists. Both kinds order tasks in the simulation; they differ for analysis
/// (a data-only critical path ignores the order a schedule imposed on a stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Dependency {
    /// The target consumes something the source produces.
    Data,
    /// The target is ordered after the source only by a schedule (stream order).
    Schedule,
}

/// One unit of work on one resource. Cheap to store: no heap allocation per task
/// (`label` is a static string; position is given by `stage`, `micro_batch`, `chunk`, `index`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Task {
    /// Short name shown in traces, e.g. `"F"`, `"attn"`, `"dp all-reduce"`.
    pub label: &'static str,
    /// What the task does.
    pub kind: TaskKind,
    /// The resource (stream, link) the task occupies while it runs.
    pub resource: ResourceId,
    /// Pipeline stage the task belongs to.
    pub stage: u32,
    /// Micro-batch the task belongs to.
    pub micro_batch: u32,
    /// Model chunk (virtual pipeline stage within the stage), 0 without interleaving.
    pub chunk: u32,
    /// Free sub-index within (stage, micro-batch, chunk): a layer number, a bucket, ...
    pub index: u32,
    /// Tie-break among tasks that became ready at the same time on the same resource:
    /// smaller runs first. Default 0.
    pub priority: i32,
}

impl Task {
    /// A task at stage 0, micro-batch 0, chunk 0, index 0, priority 0.
    pub fn new(label: &'static str, kind: TaskKind, resource: ResourceId) -> Self {
        Task {
            label,
            kind,
            resource,
            stage: 0,
            micro_batch: 0,
            chunk: 0,
            index: 0,
            priority: 0,
        }
    }
    /// Sets the pipeline position.
    pub fn at(mut self, stage: u32, micro_batch: u32, chunk: u32) -> Self {
        self.stage = stage;
        self.micro_batch = micro_batch;
        self.chunk = chunk;
        self
    }
    /// Sets the free sub-index.
    pub fn with_index(mut self, index: u32) -> Self {
        self.index = index;
        self
    }
    /// Sets the tie-break priority (smaller runs first).
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
}

/// A directed edge `from -> to`: `to` cannot start before `from` ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Edge {
    /// The task that must finish first.
    pub from: TaskId,
    /// The task that waits.
    pub to: TaskId,
    /// Why the edge exists.
    pub dependency: Dependency,
}

/// A DAG of tasks. Edge endpoints are checked by [`simulate`], not on insertion, so building a
/// graph is a sequence of pushes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskGraph {
    tasks: Vec<Task>,
    edges: Vec<Edge>,
}

impl TaskGraph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }
    /// An empty graph with room for `tasks` tasks and `edges` edges.
    pub fn with_capacity(tasks: usize, edges: usize) -> Self {
        TaskGraph {
            tasks: Vec::with_capacity(tasks),
            edges: Vec::with_capacity(edges),
        }
    }
    /// Adds a task and returns its id (ids are consecutive from 0).
    pub fn add_task(&mut self, task: Task) -> TaskId {
        let id = TaskId(self.tasks.len() as u32);
        self.tasks.push(task);
        id
    }
    /// Adds an edge `from -> to`.
    pub fn add_edge(&mut self, from: TaskId, to: TaskId, dependency: Dependency) {
        self.edges.push(Edge {
            from,
            to,
            dependency,
        });
    }
    /// Adds a [`Dependency::Data`] edge.
    pub fn add_data(&mut self, from: TaskId, to: TaskId) {
        self.add_edge(from, to, Dependency::Data);
    }
    /// Adds a [`Dependency::Schedule`] edge.
    pub fn add_schedule(&mut self, from: TaskId, to: TaskId) {
        self.add_edge(from, to, Dependency::Schedule);
    }
    /// All tasks, indexed by [`TaskId::index`].
    pub fn tasks(&self) -> &[Task] {
        &self.tasks
    }
    /// All edges in insertion order.
    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }
    /// The task with this id. Panics if the id is not from this graph.
    pub fn task(&self, id: TaskId) -> &Task {
        &self.tasks[id.index()]
    }
    /// Number of tasks.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }
    /// Whether the graph has no tasks.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Length of the longest path, weighting each task by its cost and ignoring resource
    /// contention. `edges` selects whether schedule-only edges count. A lower bound on the
    /// makespan of [`simulate`] either way.
    pub fn critical_path(&self, costs: &[Seconds], edges: EdgeFilter) -> Result<Seconds, SimError> {
        check_costs(self, costs)?;
        check_edges(self)?;
        let n = self.tasks.len();
        let adj = Csr::successors(self, edges);
        let mut indeg = adj.indegrees(n);
        let mut stack: Vec<u32> = (0..n as u32).filter(|&i| indeg[i as usize] == 0).collect();
        let mut earliest_start = vec![0.0f64; n];
        let mut longest = 0.0f64;
        let mut seen = 0usize;
        while let Some(t) = stack.pop() {
            seen += 1;
            let finish = earliest_start[t as usize] + costs[t as usize].0;
            longest = longest.max(finish);
            for &s in adj.of(t) {
                let s = s as usize;
                earliest_start[s] = earliest_start[s].max(finish);
                indeg[s] -= 1;
                if indeg[s] == 0 {
                    stack.push(s as u32);
                }
            }
        }
        if seen < n {
            return Err(cycle_error(self, &indeg, edges));
        }
        Ok(Seconds(longest))
    }

    fn task_ref(&self, id: u32) -> TaskRef {
        let t = &self.tasks[id as usize];
        TaskRef {
            id: TaskId(id),
            label: t.label,
            stage: t.stage,
            micro_batch: t.micro_batch,
            chunk: t.chunk,
        }
    }
}

/// Which edges a graph analysis follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EdgeFilter {
    /// Data and schedule edges (what the simulation obeys).
    All,
    /// Data edges only (the dependency structure without any schedule).
    DataOnly,
}

/// A resource tasks run on: a compute stream, a link, a copy engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Resource {
    /// Human-readable name (trace thread name), e.g. `"stage 3 compute"`.
    pub name: String,
    /// How many tasks may run on it at once (1 = one at a time).
    pub capacity: u32,
    /// Grouping for traces (Chrome `pid`), e.g. the device or stage the resource belongs to.
    pub group: u32,
}

/// The set of resources of a simulation, indexed by [`ResourceId`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    items: Vec<Resource>,
}

impl Resources {
    /// No resources.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds a resource in group 0 and returns its id.
    pub fn add(&mut self, name: impl Into<String>, capacity: u32) -> ResourceId {
        self.add_in_group(name, capacity, 0)
    }
    /// Adds a resource in a trace group (Chrome `pid`) and returns its id.
    pub fn add_in_group(
        &mut self,
        name: impl Into<String>,
        capacity: u32,
        group: u32,
    ) -> ResourceId {
        let id = ResourceId(self.items.len() as u32);
        self.items.push(Resource {
            name: name.into(),
            capacity,
            group,
        });
        id
    }
    /// The resource with this id, if any.
    pub fn get(&self, id: ResourceId) -> Option<&Resource> {
        self.items.get(id.index())
    }
    /// All resources, indexed by [`ResourceId::index`].
    pub fn as_slice(&self) -> &[Resource] {
        &self.items
    }
    /// Number of resources.
    pub fn len(&self) -> usize {
        self.items.len()
    }
    /// Whether there are no resources.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// A task named in an error: id plus what makes it recognisable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskRef {
    /// The task's id.
    pub id: TaskId,
    /// Its label.
    pub label: &'static str,
    /// Its stage.
    pub stage: u32,
    /// Its micro-batch.
    pub micro_batch: u32,
    /// Its chunk.
    pub chunk: u32,
}

impl fmt::Display for TaskRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "task {} `{}` (stage {}, micro-batch {}, chunk {})",
            self.id.0, self.label, self.stage, self.micro_batch, self.chunk
        )
    }
}

/// Why a graph cannot be simulated.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum SimError {
    /// `costs` does not have one entry per task.
    #[error("{costs} costs given for {tasks} tasks (need one per task)")]
    CostLengthMismatch {
        /// Number of tasks in the graph.
        tasks: usize,
        /// Number of costs given.
        costs: usize,
    },
    /// A task's cost is negative, NaN or infinite.
    #[error("{task} has invalid cost {cost} s (must be finite and >= 0)")]
    InvalidCost {
        /// The task.
        task: TaskRef,
        /// The offending value in seconds.
        cost: f64,
    },
    /// A task names a resource that does not exist.
    #[error("{task} runs on resource {resource} but only {resources} resources exist")]
    UnknownResource {
        /// The task.
        task: TaskRef,
        /// The resource index it names.
        resource: u32,
        /// How many resources there are.
        resources: usize,
    },
    /// A resource has capacity 0, so nothing could ever run on it.
    #[error("resource {resource} `{name}` has capacity 0")]
    ZeroCapacity {
        /// The resource index.
        resource: u32,
        /// Its name.
        name: String,
    },
    /// An edge names a task that does not exist.
    #[error("edge {from} -> {to} names a task that does not exist (graph has {tasks} tasks)")]
    UnknownTask {
        /// Source task index.
        from: u32,
        /// Target task index.
        to: u32,
        /// Number of tasks in the graph.
        tasks: usize,
    },
    /// The graph has a cycle; `task` lies on it.
    #[error("dependency cycle through {task}")]
    Cycle {
        /// A task on the cycle.
        task: TaskRef,
    },
}

/// When and where one task ran.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Span {
    /// The task.
    pub task: TaskId,
    /// The resource it ran on.
    pub resource: ResourceId,
    /// Which of the resource's concurrent slots it used (always 0 for capacity 1); used to draw
    /// concurrent tasks on separate trace rows.
    pub slot: u32,
    /// Start time.
    pub start: Seconds,
    /// End time.
    pub end: Seconds,
}

impl Span {
    /// `end - start`.
    pub fn duration(&self) -> Seconds {
        self.end - self.start
    }
}

/// Result of [`simulate`]: one span per task, indexed by task id.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Trace {
    /// `spans[i]` is the span of task `i`.
    pub spans: Vec<Span>,
    /// Time the last task ends (0 for an empty graph).
    pub makespan: Seconds,
}

impl Trace {
    /// The span of a task.
    pub fn span(&self, task: TaskId) -> &Span {
        &self.spans[task.index()]
    }

    /// Task-seconds spent on each resource (sum of span durations), indexed by resource id.
    /// For a capacity-`c` resource, divide by `c` for the time it would be fully busy.
    pub fn busy_time(&self, resources: &Resources) -> Vec<Seconds> {
        let n = self
            .spans
            .iter()
            .map(|s| s.resource.index() + 1)
            .max()
            .unwrap_or(0)
            .max(resources.len());
        let mut busy = vec![Seconds(0.0); n];
        for s in &self.spans {
            busy[s.resource.index()] += s.duration();
        }
        busy
    }

    /// Longest path through `graph` weighted by the simulated durations, ignoring resources
    /// (see [`TaskGraph::critical_path`]).
    pub fn critical_path(&self, graph: &TaskGraph, edges: EdgeFilter) -> Result<Seconds, SimError> {
        let durations: Vec<Seconds> = self.spans.iter().map(Span::duration).collect();
        graph.critical_path(&durations, edges)
    }

    /// Total duration per task kind, in kind order.
    pub fn per_kind_totals(&self, graph: &TaskGraph) -> BTreeMap<TaskKind, Seconds> {
        let mut totals = BTreeMap::new();
        for (span, task) in self.spans.iter().zip(graph.tasks()) {
            *totals.entry(task.kind).or_insert(Seconds(0.0)) += span.duration();
        }
        totals
    }

    /// The trace in Chrome / Perfetto trace-event format: one complete (`"ph": "X"`) event per
    /// task with times in microseconds, `pid` = the resource's group, one `tid` per resource
    /// slot, and `args` carrying stage, micro-batch, chunk, index and task id; plus
    /// `thread_name` metadata naming each row after its resource.
    pub fn to_chrome_trace(&self, graph: &TaskGraph, resources: &Resources) -> Value {
        // One row (tid) per (resource, slot) actually used, numbered densely in resource order.
        let nres = self
            .spans
            .iter()
            .map(|s| s.resource.index() + 1)
            .max()
            .unwrap_or(0)
            .max(resources.len());
        let mut slots_used = vec![0u32; nres];
        for s in &self.spans {
            let r = s.resource.index();
            slots_used[r] = slots_used[r].max(s.slot + 1);
        }
        let mut row_base = vec![0u32; nres];
        let mut next = 0u32;
        for r in 0..nres {
            row_base[r] = next;
            next += slots_used[r].max(1);
        }
        let group = |r: usize| resources.as_slice().get(r).map_or(0, |x| x.group);
        let mut events = Vec::with_capacity(self.spans.len() + nres);
        for r in 0..nres {
            let name = resources
                .as_slice()
                .get(r)
                .map_or_else(|| format!("resource {r}"), |x| x.name.clone());
            for slot in 0..slots_used[r].max(1) {
                let row = if slot == 0 {
                    name.clone()
                } else {
                    format!("{name} [{slot}]")
                };
                events.push(json!({
                    "name": "thread_name", "ph": "M", "pid": group(r),
                    "tid": row_base[r] + slot, "args": { "name": row },
                }));
            }
        }
        for (span, task) in self.spans.iter().zip(graph.tasks()) {
            let r = span.resource.index();
            events.push(json!({
                "name": format!("{} mb{}", task.label, task.micro_batch),
                "cat": task.kind.name(),
                "ph": "X",
                "ts": span.start.0 * 1e6,
                "dur": span.duration().0 * 1e6,
                "pid": group(r),
                "tid": row_base[r] + span.slot,
                "args": {
                    "task": span.task.0,
                    "stage": task.stage,
                    "micro_batch": task.micro_batch,
                    "chunk": task.chunk,
                    "index": task.index,
                },
            }));
        }
        json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }
}

/// Successor lists in compressed sparse row form.
struct Csr {
    offsets: Vec<u32>,
    targets: Vec<u32>,
}

impl Csr {
    /// Assumes edges were checked with [`check_edges`].
    fn successors(graph: &TaskGraph, filter: EdgeFilter) -> Csr {
        let n = graph.tasks.len();
        let keep = |e: &Edge| filter == EdgeFilter::All || e.dependency == Dependency::Data;
        let mut offsets = vec![0u32; n + 1];
        for e in graph.edges.iter().filter(|e| keep(e)) {
            offsets[e.from.index() + 1] += 1;
        }
        for i in 0..n {
            offsets[i + 1] += offsets[i];
        }
        let mut fill = offsets.clone();
        let mut targets = vec![0u32; offsets[n] as usize];
        for e in graph.edges.iter().filter(|e| keep(e)) {
            let slot = &mut fill[e.from.index()];
            targets[*slot as usize] = e.to.0;
            *slot += 1;
        }
        Csr { offsets, targets }
    }
    fn of(&self, t: u32) -> &[u32] {
        &self.targets[self.offsets[t as usize] as usize..self.offsets[t as usize + 1] as usize]
    }
    fn indegrees(&self, n: usize) -> Vec<u32> {
        let mut indeg = vec![0u32; n];
        for &t in &self.targets {
            indeg[t as usize] += 1;
        }
        indeg
    }
}

fn check_costs(graph: &TaskGraph, costs: &[Seconds]) -> Result<(), SimError> {
    if costs.len() != graph.tasks.len() {
        return Err(SimError::CostLengthMismatch {
            tasks: graph.tasks.len(),
            costs: costs.len(),
        });
    }
    if let Some(i) = costs.iter().position(|c| !(c.0.is_finite() && c.0 >= 0.0)) {
        return Err(SimError::InvalidCost {
            task: graph.task_ref(i as u32),
            cost: costs[i].0,
        });
    }
    Ok(())
}

fn check_edges(graph: &TaskGraph) -> Result<(), SimError> {
    let n = graph.tasks.len();
    match graph
        .edges
        .iter()
        .find(|e| e.from.index() >= n || e.to.index() >= n)
    {
        Some(e) => Err(SimError::UnknownTask {
            from: e.from.0,
            to: e.to.0,
            tasks: n,
        }),
        None => Ok(()),
    }
}

/// Names a task on a cycle, given the in-degrees left after Kahn's algorithm (or the event loop,
/// which is Kahn's algorithm in time order) stopped: every task with a non-zero count is stuck,
/// and each stuck task has a stuck predecessor, so walking stuck predecessors must revisit a task,
/// and the first revisited task lies on a cycle.
fn cycle_error(graph: &TaskGraph, remaining_indeg: &[u32], filter: EdgeFilter) -> SimError {
    let n = graph.tasks.len();
    let stuck = |i: usize| remaining_indeg[i] > 0;
    let mut pred = vec![u32::MAX; n];
    for e in graph.edges.iter() {
        if (filter == EdgeFilter::All || e.dependency == Dependency::Data)
            && stuck(e.from.index())
            && stuck(e.to.index())
        {
            pred[e.to.index()] = e.from.0;
        }
    }
    let start = (0..n).find(|&i| stuck(i)).unwrap_or(0);
    let mut visited = vec![false; n];
    let mut t = start;
    while !visited[t] {
        visited[t] = true;
        let p = pred[t];
        if p == u32::MAX {
            break; // cannot happen for a consistent in-degree vector
        }
        t = p as usize;
    }
    SimError::Cycle {
        task: graph.task_ref(t as u32),
    }
}

/// A task waiting for its resource. Ordered so that `BinaryHeap` (a max-heap) pops the earliest
/// ready time, then the smallest priority, then the smallest id.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    ready: f64,
    priority: i32,
    task: u32,
    /// The task's duration, carried along so dispatch needs no other lookup.
    cost: f64,
}

/// Per-task state the event loop touches, packed into 32 bytes (two per cache line).
#[derive(Clone, Copy, Debug)]
struct Hot {
    cost: f64,
    start: f64,
    resource: u32,
    priority: i32,
    /// Predecessors not yet finished.
    indeg: u32,
    /// Resource slot the task ran in.
    slot: u32,
}

impl Ord for Waiting {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .ready
            .total_cmp(&self.ready)
            .then(other.priority.cmp(&self.priority))
            .then(other.task.cmp(&self.task))
    }
}
impl PartialOrd for Waiting {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Waiting {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Waiting {}

/// A task finishing, with the resource slot it frees. Min-ordered by (time, task id) in a
/// max-heap.
#[derive(Clone, Copy, Debug)]
struct Finish {
    time: f64,
    task: u32,
    resource: u32,
    slot: u32,
}

impl Ord for Finish {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .time
            .total_cmp(&self.time)
            .then(other.task.cmp(&self.task))
    }
}
impl PartialOrd for Finish {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Finish {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Finish {}

/// Simulates `graph` with `costs[i]` the duration of task `i` on the given resources.
///
/// Checks first that costs match tasks (one finite, non-negative cost per task), that every task
/// names an existing resource with non-zero capacity, and that every edge names existing tasks.
/// A cycle is reported as [`SimError::Cycle`] naming a task on it; no partial trace is returned
/// (the event loop is Kahn's algorithm in time order, so a cycle shows up as tasks that never
/// become ready).
///
/// Cost: O((V + E) log V) time; allocations are made once up front (adjacency, per-resource
/// queues, the event heap), none per event beyond heap growth.
pub fn simulate(
    graph: &TaskGraph,
    costs: &[Seconds],
    resources: &Resources,
) -> Result<Trace, SimError> {
    check_costs(graph, costs)?;
    for (r, res) in resources.items.iter().enumerate() {
        if res.capacity == 0 {
            return Err(SimError::ZeroCapacity {
                resource: r as u32,
                name: res.name.clone(),
            });
        }
    }
    let nres = resources.items.len();
    let n = graph.tasks.len();
    // Hot per-task data in one compact array: the event loop visits tasks in time order, which
    // jumps around the graph, so each distinct cache line touched per task is a likely miss.
    // Built in the same pass that checks resource ids.
    let mut hot: Vec<Hot> = Vec::with_capacity(n);
    for (i, (t, c)) in graph.tasks.iter().zip(costs).enumerate() {
        if t.resource.index() >= nres {
            return Err(SimError::UnknownResource {
                task: graph.task_ref(i as u32),
                resource: t.resource.0,
                resources: nres,
            });
        }
        hot.push(Hot {
            cost: c.0,
            start: 0.0,
            resource: t.resource.0,
            priority: t.priority,
            indeg: 0,
            slot: 0,
        });
    }
    check_edges(graph)?;
    let adj = Csr::successors(graph, EdgeFilter::All);
    for &t in &adj.targets {
        hot[t as usize].indeg += 1;
    }
    let capacity: Vec<u32> = resources.items.iter().map(|r| r.capacity).collect();
    let mut running = vec![0u32; nres];
    let mut free_slots: Vec<Vec<u32>> = vec![Vec::new(); nres];
    let mut next_slot = vec![0u32; nres];
    let mut waiting: Vec<BinaryHeap<Waiting>> = vec![BinaryHeap::new(); nres];
    let mut finishes: BinaryHeap<Finish> = BinaryHeap::with_capacity(nres.max(16));
    let mut dirty: Vec<u32> = Vec::with_capacity(nres);
    let mut is_dirty = vec![false; nres];

    let make_ready = |hot: &[Hot],
                      t: u32,
                      now: f64,
                      waiting: &mut [BinaryHeap<Waiting>],
                      dirty: &mut Vec<u32>,
                      is_dirty: &mut [bool]| {
        let h = &hot[t as usize];
        let r = h.resource;
        waiting[r as usize].push(Waiting {
            ready: now,
            priority: h.priority,
            task: t,
            cost: h.cost,
        });
        if !is_dirty[r as usize] {
            is_dirty[r as usize] = true;
            dirty.push(r);
        }
    };

    for t in 0..n as u32 {
        if hot[t as usize].indeg == 0 {
            make_ready(&hot, t, 0.0, &mut waiting, &mut dirty, &mut is_dirty);
        }
    }

    let mut now = 0.0f64;
    let mut done = 0usize;
    loop {
        // Dispatch: start waiting tasks on every resource touched since the last dispatch.
        for &r in &dirty {
            let r = r as usize;
            is_dirty[r] = false;
            while running[r] < capacity[r] {
                let Some(w) = waiting[r].pop() else { break };
                running[r] += 1;
                let slot = free_slots[r].pop().unwrap_or_else(|| {
                    next_slot[r] += 1;
                    next_slot[r] - 1
                });
                let h = &mut hot[w.task as usize];
                h.start = now;
                h.slot = slot;
                finishes.push(Finish {
                    time: now + w.cost,
                    task: w.task,
                    resource: r as u32,
                    slot,
                });
            }
        }
        dirty.clear();

        // Complete every task finishing at the next event time before dispatching again.
        let Some(first) = finishes.pop() else { break };
        now = first.time;
        let mut event = Some(first);
        while let Some(f) = event {
            done += 1;
            let r = f.resource as usize;
            running[r] -= 1;
            free_slots[r].push(f.slot);
            if !is_dirty[r] {
                is_dirty[r] = true;
                dirty.push(f.resource);
            }
            for &s in adj.of(f.task) {
                hot[s as usize].indeg -= 1;
                if hot[s as usize].indeg == 0 {
                    make_ready(&hot, s, now, &mut waiting, &mut dirty, &mut is_dirty);
                }
            }
            event = match finishes.peek() {
                Some(next) if next.time == now => finishes.pop(),
                _ => None,
            };
        }
    }

    if done < n {
        let remaining: Vec<u32> = hot.iter().map(|h| h.indeg).collect();
        return Err(cycle_error(graph, &remaining, EdgeFilter::All));
    }
    let spans = (0..n)
        .map(|i| Span {
            task: TaskId(i as u32),
            resource: ResourceId(hot[i].resource),
            slot: hot[i].slot,
            start: Seconds(hot[i].start),
            // The same sum the event time was computed with, so `end` equals the event time.
            end: Seconds(hot[i].start + hot[i].cost),
        })
        .collect();
    Ok(Trace {
        spans,
        makespan: Seconds(now),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secs(xs: &[f64]) -> Vec<Seconds> {
        xs.iter().map(|&x| Seconds(x)).collect()
    }

    fn compute(r: ResourceId) -> Task {
        Task::new("op", TaskKind::Forward, r)
    }

    /// A -> B -> C -> D with costs 1, 10, 100, 1000 on four separate resources:
    /// nothing overlaps, so D ends at 1 + 10 + 100 + 1000 = 1111.
    #[test]
    fn chain_ends_at_sum_of_costs() {
        let mut res = Resources::new();
        let mut g = TaskGraph::new();
        let ids: Vec<TaskId> = (0..4)
            .map(|i| g.add_task(compute(res.add(format!("r{i}"), 1))))
            .collect();
        for w in ids.windows(2) {
            g.add_data(w[0], w[1]);
        }
        let costs = secs(&[1.0, 10.0, 100.0, 1000.0]);
        let t = simulate(&g, &costs, &res).unwrap();
        assert_eq!(t.makespan, Seconds(1111.0));
        let starts: Vec<f64> = t.spans.iter().map(|s| s.start.0).collect();
        assert_eq!(starts, vec![0.0, 1.0, 11.0, 111.0]);
        assert_eq!(
            g.critical_path(&costs, EdgeFilter::All).unwrap(),
            Seconds(1111.0)
        );
    }

    /// Diamond A->B, A->C, B->D, C->D with costs A=1, B=2, C=3, D=4.
    /// Separate resources: B and C run in parallel on [1,3] and [1,4]; D starts at
    /// max(3, 4) = 4 and ends at 8 (= critical path A-C-D).
    /// B and C sharing one capacity-1 resource: both ready at 1, tie broken by id, so B runs
    /// [1,3], C [3,6], D [6,10]. With capacity 2 the shared resource behaves like two.
    #[test]
    fn diamond_with_and_without_shared_resource() {
        let costs = secs(&[1.0, 2.0, 3.0, 4.0]);
        let build = |shared_cap: Option<u32>| {
            let mut res = Resources::new();
            let ra = res.add("a", 1);
            let (rb, rc) = match shared_cap {
                Some(c) => {
                    let r = res.add("bc", c);
                    (r, r)
                }
                None => (res.add("b", 1), res.add("c", 1)),
            };
            let rd = res.add("d", 1);
            let mut g = TaskGraph::new();
            let a = g.add_task(compute(ra));
            let b = g.add_task(compute(rb));
            let c = g.add_task(compute(rc));
            let d = g.add_task(compute(rd));
            g.add_data(a, b);
            g.add_data(a, c);
            g.add_data(b, d);
            g.add_data(c, d);
            (g, res)
        };
        let (g, res) = build(None);
        let t = simulate(&g, &costs, &res).unwrap();
        assert_eq!(t.makespan, Seconds(8.0));
        assert_eq!(t.spans[3].start, Seconds(4.0));
        assert_eq!(
            g.critical_path(&costs, EdgeFilter::All).unwrap(),
            Seconds(8.0)
        );

        let (g, res) = build(Some(1));
        let t = simulate(&g, &costs, &res).unwrap();
        assert_eq!(
            (t.spans[1].start, t.spans[1].end),
            (Seconds(1.0), Seconds(3.0))
        );
        assert_eq!(
            (t.spans[2].start, t.spans[2].end),
            (Seconds(3.0), Seconds(6.0))
        );
        assert_eq!(t.makespan, Seconds(10.0));
        assert_eq!(t.busy_time(&res)[1], Seconds(5.0));

        let (g, res) = build(Some(2));
        let t = simulate(&g, &costs, &res).unwrap();
        assert_eq!(t.makespan, Seconds(8.0));
        assert_ne!(t.spans[1].slot, t.spans[2].slot);
    }

    /// Three tasks ready at 0 on one capacity-1 resource: priority beats id, and a task that
    /// became ready earlier beats a higher-priority one that became ready later.
    #[test]
    fn tie_breaks_ready_time_then_priority_then_id() {
        let mut res = Resources::new();
        let r = res.add("r", 1);
        let other = res.add("other", 1);
        let mut g = TaskGraph::new();
        let a = g.add_task(compute(r).with_priority(5));
        let b = g.add_task(compute(r).with_priority(1));
        let c = g.add_task(compute(r).with_priority(5));
        // d: ready at 1 (after e), priority -100; runs after the tasks that were ready at 0.
        let e = g.add_task(compute(other));
        let d = g.add_task(compute(r).with_priority(-100));
        g.add_data(e, d);
        let costs = secs(&[1.0, 1.0, 1.0, 1.0, 1.0]);
        let t = simulate(&g, &costs, &res).unwrap();
        assert_eq!(t.span(b).start, Seconds(0.0));
        assert_eq!(t.span(a).start, Seconds(1.0));
        assert_eq!(t.span(c).start, Seconds(2.0));
        assert_eq!(t.span(d).start, Seconds(3.0));
        assert_eq!(t.span(e).start, Seconds(0.0));
    }

    /// Completions at the same instant are all processed before dispatching: p1 (id 0) and p2
    /// (id 1) both end at 2 and release y (priority 1) and z (priority 0) onto the idle resource
    /// r. Processing p1's completion alone first would start y at 2; batched, both are ready at
    /// 2 and z wins on priority: z [2,3], y [3,4].
    #[test]
    fn simultaneous_events_are_batched() {
        let mut res = Resources::new();
        let r = res.add("r", 1);
        let (o1, o2) = (res.add("o1", 1), res.add("o2", 1));
        let mut g = TaskGraph::new();
        let p1 = g.add_task(compute(o1));
        let p2 = g.add_task(compute(o2));
        let y = g.add_task(compute(r).with_priority(1));
        let z = g.add_task(compute(r).with_priority(0));
        g.add_data(p1, y);
        g.add_data(p2, z);
        let t = simulate(&g, &secs(&[2.0, 2.0, 1.0, 1.0]), &res).unwrap();
        assert_eq!(t.span(z).start, Seconds(2.0));
        assert_eq!(t.span(y).start, Seconds(3.0));
        assert_eq!(t.makespan, Seconds(4.0));
    }

    #[test]
    fn cycle_is_rejected_naming_a_task_on_it() {
        let mut res = Resources::new();
        let r = res.add("r", 1);
        let mut g = TaskGraph::new();
        // 0 -> 1 -> 2 -> 3 -> 1, plus 3 -> 4: the cycle is {1, 2, 3}.
        let t: Vec<TaskId> = (0..5).map(|i| g.add_task(compute(r).at(0, i, 0))).collect();
        g.add_data(t[0], t[1]);
        g.add_data(t[1], t[2]);
        g.add_schedule(t[2], t[3]);
        g.add_data(t[3], t[1]);
        g.add_data(t[3], t[4]);
        let costs = secs(&[1.0; 5]);
        let err = simulate(&g, &costs, &res).unwrap_err();
        let SimError::Cycle { task } = err else {
            panic!("expected a cycle, got {err:?}")
        };
        assert!([1, 2, 3].contains(&task.id.0), "{task}");
        assert!(err.to_string().contains("cycle through task"));
        // The data-only view still has the cycle 1 -> 2 ... no: 2 -> 3 is a schedule edge,
        // so without it the data edges are acyclic.
        assert!(g.critical_path(&costs, EdgeFilter::DataOnly).is_ok());
        assert!(matches!(
            g.critical_path(&costs, EdgeFilter::All),
            Err(SimError::Cycle { .. })
        ));
        // A self-loop is a cycle too.
        let mut g = TaskGraph::new();
        let a = g.add_task(compute(r));
        g.add_data(a, a);
        assert!(matches!(
            simulate(&g, &[Seconds(1.0)], &res),
            Err(SimError::Cycle { task }) if task.id == a
        ));
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let mut res = Resources::new();
        let r = res.add("r", 1);
        let mut g = TaskGraph::new();
        let a = g.add_task(compute(r));
        assert_eq!(
            simulate(&g, &[], &res),
            Err(SimError::CostLengthMismatch { tasks: 1, costs: 0 })
        );
        assert!(matches!(
            simulate(&g, &[Seconds(-1.0)], &res),
            Err(SimError::InvalidCost { cost, .. }) if cost == -1.0
        ));
        assert!(matches!(
            simulate(&g, &[Seconds(f64::NAN)], &res),
            Err(SimError::InvalidCost { .. })
        ));
        g.add_task(compute(ResourceId(7)));
        assert!(matches!(
            simulate(&g, &secs(&[1.0, 1.0]), &res),
            Err(SimError::UnknownResource {
                resource: 7,
                resources: 1,
                ..
            })
        ));
        let mut g = TaskGraph::new();
        g.add_task(compute(r));
        g.add_data(a, TaskId(9));
        assert_eq!(
            simulate(&g, &[Seconds(1.0)], &res),
            Err(SimError::UnknownTask {
                from: 0,
                to: 9,
                tasks: 1
            })
        );
        let mut res0 = Resources::new();
        res0.add("dead", 0);
        assert!(matches!(
            simulate(&TaskGraph::new(), &[], &res0),
            Err(SimError::ZeroCapacity { resource: 0, .. })
        ));
    }

    #[test]
    fn empty_graph_and_zero_costs() {
        let res = Resources::new();
        let t = simulate(&TaskGraph::new(), &[], &res).unwrap();
        assert_eq!(t.makespan, Seconds(0.0));
        let mut res = Resources::new();
        let r = res.add("r", 1);
        let mut g = TaskGraph::new();
        let a = g.add_task(compute(r));
        let b = g.add_task(compute(r));
        g.add_data(a, b);
        let t = simulate(&g, &secs(&[0.0, 0.0]), &res).unwrap();
        assert_eq!(t.makespan, Seconds(0.0));
    }

    /// Kind totals, busy time and the Chrome export on a two-resource example.
    #[test]
    fn helpers_and_chrome_trace() {
        let mut res = Resources::new();
        let gpu = res.add_in_group("gpu0 compute", 1, 0);
        let link = res.add_in_group("nic", 2, 1);
        let mut g = TaskGraph::new();
        let f = g.add_task(Task::new("F", TaskKind::Forward, gpu).at(0, 3, 1));
        let c1 = g.add_task(Task::new("ar", TaskKind::Comm(CommKind::DpAllReduce), link));
        let c2 = g.add_task(Task::new("ar", TaskKind::Comm(CommKind::DpAllReduce), link));
        g.add_data(f, c1);
        g.add_data(f, c2);
        let t = simulate(&g, &secs(&[1.5, 0.25, 0.5]), &res).unwrap();
        assert_eq!(t.makespan, Seconds(2.0));
        assert_eq!(t.busy_time(&res), secs(&[1.5, 0.75]));
        let totals = t.per_kind_totals(&g);
        assert_eq!(totals[&TaskKind::Forward], Seconds(1.5));
        assert_eq!(
            totals[&TaskKind::Comm(CommKind::DpAllReduce)],
            Seconds(0.75)
        );

        let v = t.to_chrome_trace(&g, &res);
        let events = v["traceEvents"].as_array().unwrap();
        let xs: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(xs.len(), 3);
        assert_eq!(xs[0]["name"], "F mb3");
        assert_eq!(xs[0]["cat"], "forward");
        assert_eq!(xs[0]["ts"], 0.0);
        assert_eq!(xs[0]["dur"], 1.5e6);
        assert_eq!(xs[0]["args"]["stage"], 0);
        assert_eq!(xs[0]["args"]["micro_batch"], 3);
        assert_eq!(xs[0]["args"]["chunk"], 1);
        assert_eq!(xs[1]["ts"], 1.5e6);
        assert_eq!(xs[1]["pid"], 1);
        // The two concurrent all-reduces are drawn on different rows.
        assert_ne!(xs[1]["tid"], xs[2]["tid"]);
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["ph"] == "M")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, vec!["gpu0 compute", "nic", "nic [1]"]);
    }

    /// A random DAG: `n` tasks, edges only from lower to higher ids (so acyclic), each task on
    /// one of `r` resources with capacities 1..=3, costs in [0, 10] with some exact zeros.
    fn random_case() -> impl Strategy<Value = (TaskGraph, Vec<Seconds>, Resources)> {
        (1usize..40, 1usize..5).prop_flat_map(|(n, r)| {
            (
                prop::collection::vec(1u32..=3, r),
                prop::collection::vec((0..r, prop_oneof![Just(0.0), 0.0f64..10.0]), n),
                prop::collection::vec((0..n, 0..n, any::<bool>()), 0..(3 * n)),
            )
                .prop_map(move |(caps, tasks, edges)| {
                    let mut res = Resources::new();
                    for (i, c) in caps.iter().enumerate() {
                        res.add(format!("r{i}"), *c);
                    }
                    let mut g = TaskGraph::new();
                    let mut costs = Vec::new();
                    for (i, (ri, cost)) in tasks.iter().enumerate() {
                        g.add_task(compute(ResourceId(*ri as u32)).with_priority((i % 3) as i32));
                        costs.push(Seconds(*cost));
                    }
                    for (a, b, data) in edges {
                        if a < b {
                            let dep = if data {
                                Dependency::Data
                            } else {
                                Dependency::Schedule
                            };
                            g.add_edge(TaskId(a as u32), TaskId(b as u32), dep);
                        }
                    }
                    (g, costs, res)
                })
        })
    }

    proptest! {
        #[test]
        fn simulation_invariants((g, costs, res) in random_case()) {
            let t = simulate(&g, &costs, &res).unwrap();
            let eps = 1e-9;
            let cp = g.critical_path(&costs, EdgeFilter::All).unwrap();
            let cp_data = g.critical_path(&costs, EdgeFilter::DataOnly).unwrap();
            prop_assert!(t.makespan.0 + eps >= cp.0);
            prop_assert!(cp.0 + eps >= cp_data.0);
            let total: f64 = costs.iter().map(|c| c.0).sum();
            prop_assert!(t.makespan.0 <= total + eps);
            for (busy, r) in t.busy_time(&res).iter().zip(res.as_slice()) {
                prop_assert!(t.makespan.0 + eps >= busy.0 / r.capacity as f64);
            }
            // Every span honours its edges and its cost.
            for (s, c) in t.spans.iter().zip(&costs) {
                prop_assert!((s.duration().0 - c.0).abs() <= eps);
            }
            for e in g.edges() {
                prop_assert!(t.span(e.to).start.0 + eps >= t.span(e.from).end.0);
            }
            // No resource ever runs more tasks than its capacity, and slots never overlap.
            for (ri, r) in res.as_slice().iter().enumerate() {
                let mut on: Vec<&Span> =
                    t.spans.iter().filter(|s| s.resource.index() == ri).collect();
                on.sort_by(|a, b| a.start.0.total_cmp(&b.start.0));
                for (i, a) in on.iter().enumerate() {
                    prop_assert!(a.slot < r.capacity);
                    if a.duration().0 == 0.0 {
                        continue; // occupies no time; may share an instant with anything
                    }
                    // Spans that started no later than `a` and still run when it starts.
                    let running: Vec<&&Span> =
                        on[..i].iter().filter(|b| b.end.0 > a.start.0).collect();
                    prop_assert!(running.len() < r.capacity as usize);
                    prop_assert!(running.iter().all(|b| b.slot != a.slot));
                }
            }
            // Deterministic: same inputs, same trace.
            prop_assert_eq!(&simulate(&g, &costs, &res).unwrap(), &t);
            prop_assert!((t.critical_path(&g, EdgeFilter::All).unwrap().0 - cp.0).abs() <= eps);
        }

        /// Work conservation: a task that starts after it became ready found its resource full
        /// until the moment it started.
        #[test]
        fn no_needless_idling((g, costs, res) in random_case()) {
            let t = simulate(&g, &costs, &res).unwrap();
            let mut ready = vec![0.0f64; g.len()];
            for e in g.edges() {
                ready[e.to.index()] = ready[e.to.index()].max(t.span(e.from).end.0);
            }
            for (i, s) in t.spans.iter().enumerate() {
                if s.start.0 > ready[i] {
                    let cap = res.as_slice()[s.resource.index()].capacity as usize;
                    let others: Vec<&Span> = t.spans.iter()
                        .filter(|o| o.resource == s.resource && o.task != s.task).collect();
                    // The resource's occupancy only drops when a task ends, so it suffices to
                    // check at the ready time and at every end inside [ready, start).
                    let mut times = vec![ready[i]];
                    times.extend(others.iter().map(|o| o.end.0)
                        .filter(|&e| e > ready[i] && e < s.start.0));
                    for tau in times {
                        let running = others.iter()
                            .filter(|o| o.start.0 <= tau && o.end.0 > tau).count();
                        prop_assert!(running >= cap, "task {} idled at {}", i, tau);
                    }
                }
            }
        }
    }
}
