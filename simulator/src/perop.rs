//! One optimizer step of any graph under a per-op plan (FlexFlow's SOAP space): costs from
//! [`parallax_cost::soap`], tasks on the one event-driven [`engine`](crate::engine).
//!
//! **Device classes.** Devices that belong to exactly the same op views run exactly the same
//! tasks, so they are simulated once: each class gets one compute stream and one communication
//! stream. A plan that puts every op on all devices has a single class however many devices
//! there are; branches placed on disjoint devices get classes of their own and run at once.
//!
//! **One micro-batch.** Forward tasks in topological order, one per op per class of its view;
//! a resharding task on the consumer's communication stream where a tensor changes layout
//! (waiting for the producer on every class of its view: a collective or a send needs them
//! all); backward tasks in reverse order with the gradient resharding; gradient synchronisation
//! in buckets of [`DDP_BUCKET_BYTES`] as each bucket's weight gradients are done (overlapped
//! with the rest of backward, as PyTorch DDP and Horovod do); the optimizer on each class last.
//!
//! **Micro-batches.** Where the plan's views form a chain of disjoint device groups in
//! topological order and the plan feeds several micro-batches, the groups are pipeline stages:
//! each stage's forward and backward time per micro-batch (and the transfers between stages)
//! are read from the one-micro-batch simulation and run through the pipeline schedule
//! ([`crate::schedule`]), followed by each stage's gradient synchronisation and optimizer.
//! Otherwise several micro-batches are gradient accumulation: all but the last run forward and
//! backward without synchronising.
//!
//! **Delta simulation.** A [`DeltaSimulator`] keeps what each op and each edge cost under the
//! configurations earlier plans gave them; a plan re-prices only the ops and edges whose
//! configurations are new, then builds and runs the task graph. A one-op change of Inception-v3
//! on 64 devices takes 1.3 ms against 5.5 ms for a fresh simulation (pricing was ~90 % of it).

use crate::engine::{
    simulate, CommKind, ResourceId, Resources, SimError, Task, TaskGraph, TaskId, TaskKind, Trace,
};
use crate::schedule::{
    build_pipeline, PipelineCosts, PipelineSchedule, ScheduleError, ScheduleKind,
};
use crate::step::{Breakdown, MemoryGib};
use parallax_cost::comm::interference;
use parallax_cost::compute::OpTimes;
use parallax_cost::memory::Optimizer;
use parallax_cost::memory::{workspace_gib, MemoryBreakdown};
use parallax_cost::soap::{
    ConfigError, DataEdge, GradSync, MachineView, OpCosts, OpMemory, ParallelConfig,
};
use parallax_cost::Group;
use parallax_ir::graph::NodeId;
use parallax_ir::{BatchNormStats, Bytes, Schedule, Seconds};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use thiserror::Error;

/// Gradient bucket size: PyTorch DDP's `bucket_cap_mb` default (25 MiB).
pub const DDP_BUCKET_BYTES: u64 = 25 * 1024 * 1024;

/// A per-op plan of one graph: a configuration per node (in node order), how many
/// micro-batches one step feeds (the graph is built at the micro-batch's size), the pipeline
/// schedule where the placement forms stages, and whether stages recompute their forward in
/// backward (GPipe's checkpointing), and the ZeRO stage its replicated weights' states are
/// stored under (0: each replica keeps them whole; 1–3: optimizer states, then gradients,
/// then the weights themselves sharded over the replicas).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OpPlan {
    pub configs: Vec<ParallelConfig>,
    pub micro_batches: u32,
    pub schedule: Schedule,
    pub recompute: bool,
    #[serde(default)]
    pub zero_stage: u8,
    /// Whether BatchNorm under a sample split synchronises its statistics over the split
    /// (the default, as `parallax run` trains) or keeps each device's own.
    #[serde(default)]
    pub batch_norm: BatchNormStats,
}

impl OpPlan {
    /// Every node on the configuration `f` gives it, one micro-batch.
    pub fn uniform(n: usize, f: impl Fn(usize) -> ParallelConfig) -> Self {
        OpPlan {
            configs: (0..n).map(f).collect(),
            micro_batches: 1,
            schedule: Schedule::None,
            recompute: false,
            zero_stage: 0,
            batch_norm: BatchNormStats::Sync,
        }
    }
}

/// Why a per-op plan cannot be simulated.
#[derive(Debug, Error)]
pub enum OpStepError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Sim(#[from] SimError),
    #[error("zero stage {stage}: {why}")]
    Zero { stage: u8, why: &'static str },
}

/// The prediction for one step of a per-op plan.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OpStepPrediction {
    pub step_time_s: f64,
    /// Samples per second at the step's batch.
    pub samples_per_s: f64,
    pub mfu: f64,
    /// Where the step goes on the busiest device: compute, bubble, optimizer, and exposed
    /// communication (`reshard`: layout changes, collectives inside kernels such as synchronised
    /// BatchNorm, and waiting for other devices' parts; `dp`:
    /// gradient synchronisation left after backward).
    pub breakdown: Breakdown,
    /// Pipeline stages (1 without a pipeline).
    pub stages: u32,
    pub micro_batches: u32,
    /// Idle fraction of the busiest stage (0 without a pipeline).
    pub bubble_fraction: f64,
    /// Memory of the device with the highest peak.
    pub memory: MemoryGib,
    /// Peak memory every device reserves, GiB (0 for devices the plan leaves idle).
    pub device_memory_gib: Vec<f64>,
    /// Peak of the live tensors on the fullest device (`max_memory_allocated`), GiB.
    pub peak_memory_gib: f64,
    /// Peak the allocator reserves there (`max_memory_reserved`), GiB: what must fit.
    pub reserved_memory_gib: f64,
    pub capacity_gib: f64,
    /// The reserved peak fits in the device.
    pub fits: bool,
    /// Devices with at least one op.
    pub used_devices: u32,
}

/// A simulated step with its task graph and trace, for timelines.
#[derive(Debug)]
pub struct SimulatedOpStep {
    pub prediction: OpStepPrediction,
    pub graph: TaskGraph,
    pub resources: Resources,
    pub trace: Trace,
}

/// Devices grouped by the set of views they belong to.
#[derive(Debug)]
struct Classes {
    /// Devices of each class.
    members: Vec<Vec<u32>>,
    /// Classes of each node's view, in class order.
    of_node: Vec<Vec<usize>>,
}

fn classes(gpus: u32, configs: &[ParallelConfig]) -> Classes {
    let mut views: Vec<MachineView> = configs.iter().map(|c| c.view).collect();
    views.sort();
    views.dedup();
    let mut by_signature: BTreeMap<Vec<usize>, Vec<u32>> = BTreeMap::new();
    for d in 0..gpus {
        let sig: Vec<usize> = views
            .iter()
            .enumerate()
            .filter(|(_, v)| v.position(d).is_some())
            .map(|(i, _)| i)
            .collect();
        if !sig.is_empty() {
            by_signature.entry(sig).or_default().push(d);
        }
    }
    let members: Vec<Vec<u32>> = by_signature.into_values().collect();
    let of_view: HashMap<MachineView, Vec<usize>> = views
        .iter()
        .map(|v| {
            let cs = members
                .iter()
                .enumerate()
                .filter(|(_, m)| v.position(m[0]).is_some())
                .map(|(i, _)| i)
                .collect();
            (*v, cs)
        })
        .collect();
    Classes {
        of_node: configs.iter().map(|c| of_view[&c.view].clone()).collect(),
        members,
    }
}

/// The pipeline stage of each node, when the plan's views form a chain of disjoint device
/// groups in topological order.
fn pipeline_stages(configs: &[ParallelConfig], cls: &Classes) -> Option<Vec<u32>> {
    let mut order: Vec<MachineView> = Vec::new();
    let mut stage = Vec::with_capacity(configs.len());
    for c in configs {
        match order.iter().position(|v| *v == c.view) {
            Some(i) if i + 1 == order.len() => stage.push(i as u32),
            Some(_) => return None,
            None => {
                order.push(c.view);
                stage.push(order.len() as u32 - 1);
            }
        }
    }
    if order.len() < 2 {
        return None;
    }
    // Disjoint: no class belongs to two views.
    let mut seen = vec![false; cls.members.len()];
    for v in &order {
        let i = configs.iter().position(|c| c.view == *v)?;
        for &c in &cls.of_node[i] {
            if seen[c] {
                return None;
            }
            seen[c] = true;
        }
    }
    Some(stage)
}

/// A resharding between two nodes, forward and backward.
#[derive(Clone, Copy, Debug)]
struct EdgeCost {
    producer: usize,
    consumer: usize,
    fwd: Seconds,
    bwd: Seconds,
    /// Edges of one tensor to consumers that want the same layout share one id: the tensor is
    /// resharded once forward for all of them (Megatron gathers a norm's output once for the
    /// q, k and v projections) and their gradients are summed where they are, then resharded
    /// once backward.
    shared: usize,
}

/// What a node costs under one configuration: everything a step reads of it.
#[derive(Clone, Debug)]
struct NodePrice {
    cfg: ParallelConfig,
    /// Unique among the entries of one [`DeltaSimulator`]: edges are keyed by their ends' ids.
    id: u64,
    times: OpTimes,
    /// (bytes per device, group, time) of each replicated weight's gradient synchronisation.
    sync: Vec<(u64, Group, Seconds)>,
    /// ZeRO 3: (bytes, time) of the weight gather before each pass.
    gather: (f64, Seconds),
    /// Collectives inside the node's forward and backward kernels (synchronised BatchNorm,
    /// a vocabulary-parallel loss).
    collectives: (Seconds, Seconds),
    memory: OpMemory,
    /// Parameters one device of the view updates.
    updated: f64,
    /// Weight-gradient elements one device of the view accumulates over micro-batches.
    grad_elems: f64,
}

/// The resharding of one input of a node from its producer, forward and backward, and the
/// interned layout the consumer takes it in.
#[derive(Clone, Copy, Debug)]
struct EdgePrice {
    fwd: Seconds,
    bwd: Seconds,
    wanted: u32,
}

/// The configurations a node has had, priced, and the one the last plan gave it.
#[derive(Debug, Default)]
struct NodeSlot {
    current: usize,
    seen: Vec<NodePrice>,
}

/// One input of a node fed by another node: the prices met for pairs of its ends' entries,
/// the last plan's first.
#[derive(Debug)]
struct EdgeSlot {
    edge: DataEdge,
    seen: Vec<((u64, u64), EdgePrice)>,
}

impl EdgeSlot {
    /// The price for the plan last priced (kept first).
    fn current(&self) -> EdgePrice {
        self.seen[0].1
    }
}

/// How many node and edge prices a [`DeltaSimulator`] has computed (the rest it reused).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeltaCounts {
    pub simulations: u64,
    pub nodes_priced: u64,
    pub edges_priced: u64,
}

/// Simulates per-op plans of one graph one after another, re-pricing only what a plan changes
/// from those before it: the search's Markov chain moves one op at a time, so a proposal
/// re-prices that op (its shard compute, gradient synchronisation, ZeRO gathers, memory) and
/// the resharding on its edges, and takes every other op's and edge's price from the plans
/// already simulated (FlexFlow's delta simulation, at the depth where a simulation spends its
/// time: pricing is ~90 % of one, the event run of the task graph the rest, measured on
/// Inception-v3 over 64 devices). Each node keeps the prices of every configuration it has had,
/// so a rejected proposal costs nothing to undo. The prediction is exactly that of a fresh
/// [`simulate_op_plan`] (a test holds them equal bit for bit).
#[derive(Debug, Default)]
pub struct DeltaSimulator {
    /// What the prices were computed for: the graph (by address), devices, ZeRO stage,
    /// optimizer, gradient synchronisation and BatchNorm statistics of the [`OpCosts`]; any
    /// change starts afresh. Keep one simulator per `OpCosts`: what is fixed when the costs are
    /// made (profile, precision, memory format) is not checked.
    key: Option<(usize, u32, u8, Optimizer, GradSync, BatchNormStats)>,
    nodes: Vec<NodeSlot>,
    edges: Vec<EdgeSlot>,
    /// Edges of each node's inputs, in input order (indices into `edges`).
    inputs: Vec<Vec<usize>>,
    next_id: u64,
    /// Training FLOPs of one micro-batch of the graph.
    flops: f64,
    pub counts: DeltaCounts,
}

/// The prices of one plan, borrowed from the simulator: an entry per node, and the edge slots
/// (each with this plan's price first).
struct Prices<'a> {
    nodes: Vec<&'a NodePrice>,
    slots: &'a [EdgeSlot],
    inputs: &'a [Vec<usize>],
}

impl DeltaSimulator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Clears every price when `costs` is not what they were computed for.
    fn reset_for(&mut self, costs: &OpCosts) {
        let key = (
            costs.graph as *const _ as usize,
            costs.gpus,
            costs.zero_stage,
            costs.optimizer,
            costs.sync,
            costs.batch_norm,
        );
        if self.key == Some(key) {
            return;
        }
        let g = costs.graph;
        self.key = Some(key);
        self.nodes = (0..g.nodes.len()).map(|_| NodeSlot::default()).collect();
        self.edges.clear();
        self.inputs = vec![Vec::new(); g.nodes.len()];
        for edge in costs.data_edges() {
            self.inputs[edge.consumer].push(self.edges.len());
            self.edges.push(EdgeSlot {
                edge,
                seen: Vec::new(),
            });
        }
        self.flops = g.total_work(costs.float_bytes()).train_flops().0;
    }

    /// Prices every node and edge of `plan`, computing only those not met before.
    fn price(&mut self, costs: &mut OpCosts, plan: &OpPlan) -> Result<Prices<'_>, OpStepError> {
        for (i, cfg) in plan.configs.iter().enumerate() {
            let slot = &mut self.nodes[i];
            if slot.seen.get(slot.current).is_some_and(|p| p.cfg == *cfg) {
                continue;
            }
            if let Some(k) = slot.seen.iter().position(|p| p.cfg == *cfg) {
                slot.current = k;
                continue;
            }
            let n = NodeId(i as u32);
            costs.check(n, cfg)?;
            self.counts.nodes_priced += 1;
            slot.seen.push(NodePrice {
                cfg: cfg.clone(),
                id: self.next_id,
                times: costs.compute(n, cfg),
                sync: costs.grad_sync(n, cfg),
                gather: costs.param_gather(n, cfg),
                collectives: costs.kernel_collectives(n, cfg),
                memory: costs.memory(n, cfg),
                updated: costs.updated_params(n, cfg),
                grad_elems: costs.accumulated_grad_elems(n, cfg),
            });
            self.next_id += 1;
            slot.current = slot.seen.len() - 1;
        }
        let nodes: Vec<&NodePrice> = self.nodes.iter().map(|s| &s.seen[s.current]).collect();
        for slot in &mut self.edges {
            let e = slot.edge;
            let (p, c) = (nodes[e.producer], nodes[e.consumer]);
            let key = (p.id, c.id);
            let seen = &mut slot.seen;
            // The plan's pair goes first: `EdgeSlot::current` reads it there, and the next
            // simulation most likely meets it again.
            match seen.iter().position(|(k, _)| *k == key) {
                Some(0) => {}
                Some(k) => seen.swap(0, k),
                None => {
                    self.counts.edges_priced += 1;
                    let (f, b, wanted) = costs.edge(
                        e.tensor,
                        (NodeId(e.producer as u32), e.out, &p.cfg),
                        (NodeId(e.consumer as u32), e.input, &c.cfg),
                    );
                    let price = EdgePrice {
                        fwd: f.time,
                        bwd: b.time,
                        wanted,
                    };
                    seen.push((key, price));
                    let last = seen.len() - 1;
                    seen.swap(0, last);
                }
            }
        }
        Ok(Prices {
            nodes,
            slots: &self.edges,
            inputs: &self.inputs,
        })
    }
}

/// The one-micro-batch task graph.
struct MicroGraph {
    graph: TaskGraph,
    costs: Vec<Seconds>,
    resources: Resources,
    compute: Vec<ResourceId>,
    fwd: Vec<Vec<TaskId>>,
    bwd: Vec<Vec<TaskId>>,
    edges: Vec<EdgeCost>,
    /// Reshard tasks with the producer and a consumer of the tensor they move, and whether
    /// they move its gradient (backward).
    reshards: Vec<(TaskId, usize, usize, bool)>,
    /// Whether any pass waits for a ZeRO-3 weight gather.
    gathers: bool,
}

impl MicroGraph {
    fn add(&mut self, task: Task, cost: Seconds, deps: &[TaskId]) -> TaskId {
        self.costs.push(cost);
        let t = self.graph.add_task(task);
        for d in deps {
            self.graph.add_data(*d, t);
        }
        t
    }
}

fn build_micro(
    costs: &OpCosts,
    prices: &Prices,
    plan: &OpPlan,
    cls: &Classes,
    with_sync: bool,
) -> MicroGraph {
    let n = prices.nodes.len();
    let mut resources = Resources::new();
    let mut compute = Vec::new();
    let mut comm = Vec::new();
    // Gradient buckets go over their own communicator and stream (DDP's), beside the
    // resharding collectives the forward and backward wait on.
    let mut sync = Vec::new();
    for (c, m) in cls.members.iter().enumerate() {
        let what = if m.len() == 1 {
            format!("gpu {}", m[0])
        } else {
            format!("gpus {} (+{} alike)", m[0], m.len() - 1)
        };
        compute.push(resources.add_in_group(format!("{what} compute"), 1, c as u32));
        comm.push(resources.add_in_group(format!("{what} comm"), 1, c as u32));
        sync.push(resources.add_in_group(format!("{what} grad sync"), 1, c as u32));
    }
    let mut mg = MicroGraph {
        graph: TaskGraph::with_capacity(4 * n * cls.members.len(), 8 * n),
        costs: Vec::new(),
        resources,
        compute: compute.clone(),
        fwd: vec![Vec::new(); n],
        bwd: vec![Vec::new(); n],
        edges: Vec::new(),
        reshards: Vec::new(),
        gathers: false,
    };
    // ZeRO 3: each pass over an op gathers its weights on the gradient stream first, one op
    // ahead (FSDP's default prefetch): the gather for a class's k-th pass over a weighted op
    // (forward passes, then backward ones in reverse) waits for its (k−2)-th pass.
    let mut passed: Vec<Vec<TaskId>> = vec![Vec::new(); cls.members.len()];
    let gather = |mg: &mut MicroGraph,
                  passed: &[Vec<TaskId>],
                  i: usize,
                  c: usize,
                  deps: &mut Vec<TaskId>|
     -> bool {
        let time = prices.nodes[i].gather.1;
        if time.0 <= 0.0 {
            return false;
        }
        let after: Vec<TaskId> = passed[c].iter().rev().nth(1).copied().into_iter().collect();
        let task = Task::new(
            "param gather",
            TaskKind::Comm(CommKind::ZeroAllGather),
            sync[c],
        )
        .with_index(i as u32);
        deps.push(mg.add(task, time, &after));
        mg.gathers = true;
        true
    };
    // Each (tensor, layout a consumer wants) is resharded once: its id, and its forward task
    // per device class.
    let mut shared_ids: HashMap<(u32, u32), usize> = HashMap::new();
    let mut shared_tasks: HashMap<(usize, usize), TaskId> = HashMap::new();
    // Forward.
    for i in 0..n {
        let node_classes = &cls.of_node[i];
        let mut deps: Vec<Vec<TaskId>> = vec![Vec::new(); node_classes.len()];
        for &e in &prices.inputs[i] {
            let EdgePrice { fwd, bwd, wanted } = prices.slots[e].current();
            let pi = prices.slots[e].edge.producer;
            let next = shared_ids.len();
            let shared = *shared_ids
                .entry((prices.slots[e].edge.tensor.0, wanted))
                .or_insert(next);
            mg.edges.push(EdgeCost {
                producer: pi,
                consumer: i,
                fwd,
                bwd,
                shared,
            });
            let from = mg.fwd[pi].clone();
            for (ci, c) in node_classes.iter().enumerate() {
                if fwd.0 > 0.0 {
                    let r = match shared_tasks.get(&(shared, *c)) {
                        Some(r) => *r,
                        None => {
                            let task =
                                Task::new("reshard", TaskKind::Comm(CommKind::Reshard), comm[*c])
                                    .with_index(i as u32);
                            let r = mg.add(task, fwd, &from);
                            mg.reshards.push((r, pi, i, false));
                            shared_tasks.insert((shared, *c), r);
                            r
                        }
                    };
                    deps[ci].push(r);
                } else {
                    deps[ci].extend(same_class_or_all(&cls.of_node[pi], &from, *c));
                }
            }
        }
        for (ci, c) in node_classes.iter().enumerate() {
            let gathered = gather(&mut mg, &passed, i, *c, &mut deps[ci]);
            kernel_collective(&mut mg, compute[*c], i, false, prices, &mut deps[ci]);
            let task = Task::new("F", TaskKind::Forward, compute[*c]).with_index(i as u32);
            let f = mg.add(task, prices.nodes[i].times.fwd, &deps[ci]);
            mg.fwd[i].push(f);
            if gathered {
                passed[*c].push(f);
            }
        }
    }
    // Backward, in reverse topological order.
    let mut by_producer: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (e, ec) in mg.edges.iter().enumerate() {
        by_producer[ec.producer].push(e);
    }
    for i in (0..n).rev() {
        let node_classes = &cls.of_node[i];
        let mut deps: Vec<Vec<TaskId>> = mg.fwd[i].iter().map(|f| vec![*f]).collect();
        // One gradient reshard per shared id, after every consumer that feeds it.
        let mut grads: Vec<(usize, Seconds, Vec<TaskId>, usize)> = Vec::new();
        for &e in &by_producer[i] {
            let ec = mg.edges[e];
            let from = mg.bwd[ec.consumer].clone();
            if ec.bwd.0 > 0.0 {
                match grads.iter_mut().find(|g| g.0 == ec.shared) {
                    Some(g) => g.2.extend(from),
                    None => grads.push((ec.shared, ec.bwd, from, ec.consumer)),
                }
                continue;
            }
            for (ci, c) in node_classes.iter().enumerate() {
                deps[ci].extend(same_class_or_all(&cls.of_node[ec.consumer], &from, *c));
            }
        }
        for (_, time, from, consumer) in grads {
            for (ci, c) in node_classes.iter().enumerate() {
                let task = Task::new("reshard grad", TaskKind::Comm(CommKind::Reshard), comm[*c])
                    .with_index(i as u32);
                let r = mg.add(task, time, &from);
                mg.reshards.push((r, i, consumer, true));
                deps[ci].push(r);
            }
        }
        let t = prices.nodes[i].times;
        let recompute = if plan.recompute { t.fwd } else { Seconds(0.0) };
        // The weight gradients' sum into the accumulated ones, averaged over the micro-batches.
        let accumulate =
            costs.wgrad_accumulation_time(prices.nodes[i].grad_elems, plan.micro_batches);
        for (ci, c) in node_classes.iter().enumerate() {
            let gathered = gather(&mut mg, &passed, i, *c, &mut deps[ci]);
            kernel_collective(&mut mg, compute[*c], i, true, prices, &mut deps[ci]);
            let task = Task::new("B", TaskKind::BackwardInput, compute[*c]).with_index(i as u32);
            let b = mg.add(
                task,
                t.bwd_input + t.bwd_weight + recompute + accumulate,
                &deps[ci],
            );
            mg.bwd[i].push(b);
            if gathered {
                passed[*c].push(b);
            }
        }
    }
    if with_sync {
        add_sync_and_optimizer(costs, prices, plan, cls, &mut mg, &sync);
    }
    mg
}

/// The collectives inside node `i`'s forward (or backward) kernel, on the compute stream they
/// block, before the pass's task (which then waits for them); also counted where a pipeline
/// stage's time sums its resharding.
fn kernel_collective(
    mg: &mut MicroGraph,
    compute: ResourceId,
    i: usize,
    backward: bool,
    prices: &Prices,
    deps: &mut Vec<TaskId>,
) {
    let (fwd, bwd) = prices.nodes[i].collectives;
    let time = if backward { bwd } else { fwd };
    if time.0 <= 0.0 {
        return;
    }
    let task = Task::new(
        "kernel all-reduce",
        TaskKind::Comm(CommKind::Other),
        compute,
    )
    .with_index(i as u32);
    let t = mg.add(task, time, deps);
    mg.reshards.push((t, i, i, backward));
    *deps = vec![t];
}

/// Where a tensor keeps its layout, the consumer on class `c` waits for the producer on the
/// same class; if the producer does not run there, for all of it.
fn same_class_or_all(producer_classes: &[usize], tasks: &[TaskId], c: usize) -> Vec<TaskId> {
    match producer_classes.iter().position(|x| *x == c) {
        Some(i) => vec![tasks[i]],
        None => tasks.to_vec(),
    }
}

/// Gradient buckets (backward order, flushed at [`DDP_BUCKET_BYTES`] or when the group
/// changes) and the optimizer on every class.
fn add_sync_and_optimizer(
    costs: &OpCosts,
    prices: &Prices,
    plan: &OpPlan,
    cls: &Classes,
    mg: &mut MicroGraph,
    comm: &[ResourceId],
) {
    let n = plan.configs.len();
    let mut sync_tasks: Vec<Vec<TaskId>> = vec![Vec::new(); cls.members.len()];
    // Seconds of each class's bucket all-reduces, and of its last one (the bucket the final
    // backward op fills, which nothing is left to hide behind).
    let mut sync_time = vec![(Seconds(0.0), Seconds(0.0)); cls.members.len()];
    let mut bucket: Option<(MachineView, parallax_cost::Group, u64, Vec<usize>)> = None;
    let mut flush = |b: (MachineView, parallax_cost::Group, u64, Vec<usize>),
                     mg: &mut MicroGraph| {
        let (_, group, bytes, nodes) = b;
        let t = costs.sync_time(Bytes(bytes), group);
        let deps: Vec<TaskId> = nodes.iter().flat_map(|i| mg.bwd[*i].clone()).collect();
        for &c in &cls.of_node[nodes[0]] {
            let task = Task::new("grad sync", TaskKind::Comm(CommKind::DpAllReduce), comm[c])
                .with_index(nodes[0] as u32);
            let s = mg.add(task, t, &deps);
            sync_tasks[c].push(s);
            sync_time[c] = (sync_time[c].0 + t, t);
        }
    };
    for i in (0..n).rev() {
        let view = plan.configs[i].view;
        for &(bytes, group, _) in &prices.nodes[i].sync {
            match &mut bucket {
                Some((v, g, b, nodes)) if *v == view && *g == group && *b < DDP_BUCKET_BYTES => {
                    *b += bytes;
                    if nodes.last() != Some(&i) {
                        nodes.push(i);
                    }
                }
                _ => {
                    if let Some(b) = bucket.take() {
                        flush(b, mg);
                    }
                    bucket = Some((view, group, bytes, vec![i]));
                }
            }
        }
    }
    if let Some(b) = bucket.take() {
        flush(b, mg);
    }
    for (c, _) in cls.members.iter().enumerate() {
        let mut params = 0.0;
        let mut deps = sync_tasks[c].clone();
        for i in 0..n {
            if let Some(ci) = cls.of_node[i].iter().position(|x| *x == c) {
                params += prices.nodes[i].updated;
                deps.push(mg.bwd[i][ci]);
            }
        }
        // The all-reduces that ran beside the backward slowed it (NCCL kernels take SMs and
        // memory bandwidth): the interference the structured path charges in
        // `parallax_cost::exposed`, on the stream before the optimizer.
        let (all, last) = sync_time[c];
        let hidden = interference(Seconds((all - last).0.max(0.0)));
        if hidden.0 > 0.0 {
            let task = Task::new(
                "overlap interference",
                TaskKind::Comm(CommKind::DpAllReduce),
                mg.compute[c],
            );
            let t = mg.add(task, hidden, &deps);
            deps.push(t);
        }
        let task = Task::new("optimizer", TaskKind::Optimizer, mg.compute[c]);
        mg.add(task, costs.optimizer_time(params), &deps);
    }
}

/// Peak memory of each device class (its devices run the same ops): model states of every op
/// on it, what one micro-batch keeps for backward times the micro-batches in flight on its
/// stage, the workspace and the allocator's allowance. Replicas synchronise after the last of
/// several micro-batches, so until then each holds its gradients whole, whatever the ZeRO
/// stage (FSDP's `no_sync` accumulates unsharded gradients).
fn class_memory(
    costs: &OpCosts,
    prices: &Prices,
    plan: &OpPlan,
    cls: &Classes,
    in_flight: &[f64],
) -> Vec<MemoryGib> {
    let mut mem = vec![MemoryBreakdown::default(); cls.members.len()];
    // ZeRO 3: the weights of the op being run and of the one gathered ahead of it.
    let mut gathered = vec![0.0f64; cls.members.len()];
    for (i, price) in prices.nodes.iter().enumerate() {
        let g = price.gather.0;
        for &c in &cls.of_node[i] {
            gathered[c] = gathered[c].max(2.0 * g);
        }
        let m = price.memory;
        let grads = if plan.micro_batches > 1 {
            price.grad_elems * costs.grad_bytes()
        } else {
            m.grads
        };
        let saved = if plan.recompute {
            // Checkpointing keeps each stage's input per micro-batch and one micro-batch's
            // activations while it is recomputed: counted as one micro-batch here.
            m.saved
        } else {
            m.saved * in_flight[i]
        };
        for &c in &cls.of_node[i] {
            let x = &mut mem[c];
            x.params += Bytes(m.params as u64);
            x.grads += Bytes(grads as u64);
            x.optimizer += Bytes(m.optimizer as u64);
            x.activations += Bytes(saved as u64);
        }
    }
    mem.into_iter()
        .zip(gathered)
        .map(|(mut x, g)| {
            x.buffers = Bytes::from_gib(workspace_gib(costs.profile)) + Bytes(g as u64);
            MemoryGib::from(x.with_allocator())
        })
        .collect()
}

/// A simulated step before memory and throughput are added.
struct Simulated {
    step: f64,
    breakdown: Breakdown,
    /// Idle fraction of the busiest stage.
    bubble: f64,
    graph: TaskGraph,
    resources: Resources,
    trace: Trace,
    pp: u32,
    /// Micro-batches whose activations each node holds at its stage's peak.
    in_flight: Vec<f64>,
}

/// Simulates one optimizer step of `plan` on the graph of `costs` (built at one micro-batch's
/// size); `global_batch` is the samples one step trains on. A search that simulates many plans
/// of one graph keeps a [`DeltaSimulator`] instead.
pub fn simulate_op_plan(
    costs: &mut OpCosts,
    plan: &OpPlan,
    global_batch: u64,
) -> Result<SimulatedOpStep, OpStepError> {
    DeltaSimulator::new().simulate(costs, plan, global_batch)
}

impl DeltaSimulator {
    /// [`simulate_op_plan`], pricing only the nodes and edges whose configurations this
    /// simulator has not met before (with the same `costs`).
    pub fn simulate(
        &mut self,
        costs: &mut OpCosts,
        plan: &OpPlan,
        global_batch: u64,
    ) -> Result<SimulatedOpStep, OpStepError> {
        let n = costs.len();
        if plan.configs.len() != n {
            return Err(ConfigError::Count {
                configs: plan.configs.len(),
                nodes: n,
            }
            .into());
        }
        if plan.zero_stage > 3 {
            return Err(OpStepError::Zero {
                stage: plan.zero_stage,
                why: "must be 0, 1, 2 or 3",
            });
        }
        // The plan's stage prices its states (memory, gradient sync, gathers), and its
        // BatchNorm statistics its kernels' collectives.
        costs.zero_stage = plan.zero_stage;
        costs.batch_norm = plan.batch_norm;
        self.reset_for(costs);
        self.counts.simulations += 1;
        let flops = self.flops;
        let prices = self.price(costs, plan)?;
        step_of(costs, &prices, plan, global_batch, flops)
    }
}

/// The step of `plan` from its prices.
fn step_of(
    costs: &OpCosts,
    prices: &Prices,
    plan: &OpPlan,
    global_batch: u64,
    flops: f64,
) -> Result<SimulatedOpStep, OpStepError> {
    let n = prices.nodes.len();
    let m = plan.micro_batches.max(1);
    let cls = classes(costs.gpus, &plan.configs);
    let stages = if m > 1 || plan.schedule != Schedule::None {
        pipeline_stages(&plan.configs, &cls)
    } else {
        None
    };
    if stages.is_some() && costs.zero_stage >= 3 {
        return Err(OpStepError::Zero {
            stage: costs.zero_stage,
            why: "a per-op pipeline keeps its stages' weights gathered; use zero 0-2",
        });
    }
    let r = match stages {
        None => {
            let mg = build_micro(costs, prices, plan, &cls, true);
            let trace = simulate(&mg.graph, &mg.costs, &mg.resources)?;
            let (step, breakdown) = accumulation_breakdown(&mg, &trace, m);
            Simulated {
                step,
                breakdown,
                bubble: 0.0,
                graph: mg.graph,
                resources: mg.resources,
                trace,
                pp: 1,
                in_flight: vec![1.0; n],
            }
        }
        Some(stage) => {
            let mg = build_micro(costs, prices, plan, &cls, false);
            let micro = simulate(&mg.graph, &mg.costs, &mg.resources)?;
            pipeline_step(costs, prices, plan, &mg, &micro, &stage, m)?
        }
    };
    let mem = class_memory(costs, prices, plan, &cls, &r.in_flight);
    let memory = mem
        .iter()
        .copied()
        .max_by(|a, b| a.total.total_cmp(&b.total))
        .unwrap_or_default();
    let mut device_memory_gib = vec![0.0; costs.gpus as usize];
    for (c, devices) in cls.members.iter().enumerate() {
        for d in devices {
            device_memory_gib[*d as usize] = mem[c].total;
        }
    }
    let capacity_gib = costs.profile.device.hbm_gib;
    let flops = flops * f64::from(m);
    let peak = costs.device().gemm_peak() * f64::from(costs.gpus);
    let step = r.step;
    let prediction = OpStepPrediction {
        step_time_s: step,
        samples_per_s: if step > 0.0 {
            global_batch as f64 / step
        } else {
            0.0
        },
        mfu: if step > 0.0 {
            flops / (step * peak)
        } else {
            0.0
        },
        breakdown: r.breakdown,
        stages: r.pp,
        micro_batches: m,
        bubble_fraction: r.bubble,
        memory,
        device_memory_gib,
        peak_memory_gib: memory.allocated,
        reserved_memory_gib: memory.total,
        capacity_gib,
        fits: memory.total <= capacity_gib,
        used_devices: cls.members.iter().map(|m| m.len() as u32).sum(),
    };
    Ok(SimulatedOpStep {
        prediction,
        graph: r.graph,
        resources: r.resources,
        trace: r.trace,
    })
}

/// Step time and breakdown of `m` accumulated micro-batches from the simulation of the last
/// one: the earlier ones run forward and backward only.
fn accumulation_breakdown(mg: &MicroGraph, trace: &Trace, m: u32) -> (f64, Breakdown) {
    let mut busy = vec![0.0; mg.resources.len()];
    let mut opt = vec![0.0; mg.resources.len()];
    let mut fb_end: f64 = 0.0;
    for (s, t) in trace.spans.iter().zip(mg.graph.tasks()) {
        match t.kind {
            TaskKind::Forward | TaskKind::BackwardInput | TaskKind::BackwardWeight => {
                busy[s.resource.index()] += s.duration().0;
                fb_end = fb_end.max(s.end.0);
            }
            TaskKind::Optimizer => opt[s.resource.index()] += s.duration().0,
            _ => {}
        }
    }
    let r = mg
        .compute
        .iter()
        .copied()
        .max_by(|a, b| busy[a.index()].total_cmp(&busy[b.index()]))
        .map_or(0, |r| r.index());
    let mf = f64::from(m);
    let step = (mf - 1.0) * fb_end + trace.makespan.0;
    let compute = mf * busy[r];
    let waiting = mf * (fb_end - busy[r]).max(0.0);
    let gathering = if mg.gathers {
        (mf * gather_waits(mg, trace, r)).min(waiting)
    } else {
        0.0
    };
    let reshard = waiting - gathering;
    let optimizer = opt[r];
    let dp = (step - compute - reshard - optimizer).max(0.0);
    let mut exposed = BTreeMap::new();
    exposed.insert("reshard".to_string(), reshard);
    // Gradient synchronisation after backward and, under ZeRO 3, the weight gathers the passes
    // waited for.
    exposed.insert("dp".to_string(), dp);
    (
        step,
        Breakdown {
            compute_s: compute,
            bubble_s: 0.0,
            optimizer_s: optimizer,
            host_s: 0.0,
            exposed_comm_s: exposed,
        },
    )
}

/// Idle time of compute stream `r` in one micro-batch's forward and backward, before passes
/// whose last input to arrive was a ZeRO-3 weight gather (the rest of its idle time waits for
/// resharding).
fn gather_waits(mg: &MicroGraph, trace: &Trace, r: usize) -> f64 {
    let mut last_dep: Vec<Option<usize>> = vec![None; trace.spans.len()];
    for e in mg.graph.edges() {
        let (from, to) = (e.from.index(), e.to.index());
        if last_dep[to].is_none_or(|d| trace.spans[from].end.0 > trace.spans[d].end.0) {
            last_dep[to] = Some(from);
        }
    }
    let mut passes: Vec<usize> = (0..trace.spans.len())
        .filter(|&t| {
            trace.spans[t].resource.index() == r
                && matches!(
                    mg.graph.tasks()[t].kind,
                    TaskKind::Forward | TaskKind::BackwardInput | TaskKind::BackwardWeight
                )
        })
        .collect();
    passes.sort_by(|a, b| trace.spans[*a].start.0.total_cmp(&trace.spans[*b].start.0));
    let mut gathering = 0.0;
    let mut free = 0.0f64;
    for t in passes {
        let idle = (trace.spans[t].start.0 - free).max(0.0);
        let by_gather = last_dep[t]
            .is_some_and(|d| mg.graph.tasks()[d].kind == TaskKind::Comm(CommKind::ZeroAllGather));
        if by_gather {
            gathering += idle;
        }
        free = free.max(trace.spans[t].end.0);
    }
    gathering
}

/// The pipeline of the plan's stages fed `m` micro-batches: per-stage forward and backward
/// times from the one-micro-batch simulation, the schedule, then each stage's gradient sync and
/// optimizer.
fn pipeline_step(
    costs: &OpCosts,
    prices: &Prices,
    plan: &OpPlan,
    mg: &MicroGraph,
    micro: &Trace,
    stage: &[u32],
    m: u32,
) -> Result<Simulated, OpStepError> {
    let n = stage.len();
    let pp = stage.iter().max().map_or(1, |s| s + 1);
    // A stage's time per micro-batch: the busiest of its device classes, its ops' kernels
    // plus the resharding inside the stage, as if its inputs were there (what crosses from
    // other stages is the boundary's transfer below). Not the span of its tasks in the
    // one-micro-batch step: where a cut leaves a branch's input to arrive early, a stage
    // starts before the previous one ends, and the span would count both.
    let group = |t: &Task| mg.resources.get(t.resource).map_or(0, |r| r.group);
    let mut busy: BTreeMap<(u32, u32, bool), f64> = BTreeMap::new();
    for (sp, t) in micro.spans.iter().zip(mg.graph.tasks()) {
        let backward = match t.kind {
            TaskKind::Forward => false,
            TaskKind::BackwardInput | TaskKind::BackwardWeight => true,
            _ => continue,
        };
        *busy
            .entry((stage[t.index as usize], group(t), backward))
            .or_default() += sp.duration().0;
    }
    for &(task, producer, consumer, backward) in &mg.reshards {
        if stage[producer] != stage[consumer] {
            continue;
        }
        let t = mg.graph.task(task);
        *busy
            .entry((stage[consumer], group(t), backward))
            .or_default() += micro.span(task).duration().0;
    }
    let stage_time = |s: u32, backward: bool| -> Seconds {
        Seconds(
            busy.iter()
                .filter(|((st, _, b), _)| *st == s && *b == backward)
                .map(|(_, t)| *t)
                .fold(0.0, f64::max),
        )
    };
    let forward: Vec<Seconds> = (0..pp).map(|s| stage_time(s, false)).collect();
    let backward: Vec<Seconds> = (0..pp).map(|s| stage_time(s, true)).collect();
    // The boundary into a stage carries every tensor the stage reads from earlier stages,
    // once however many of its ops read it (a cut through a multi-branch cell sends each
    // branch's input); a skip connection goes straight to the stage that reads it, as
    // torchgpipe's `skippable` stash and pop do, so it loads that stage's boundary only.
    let mut sent: BTreeMap<(u32, usize), f64> = BTreeMap::new();
    for e in &mg.edges {
        let (from, to) = (stage[e.producer], stage[e.consumer]);
        if from < to {
            let t = sent.entry((to - 1, e.shared)).or_default();
            *t = t.max(e.fwd.0.max(e.bwd.0));
        }
    }
    let mut p2p_boundaries = vec![Seconds(0.0); pp.saturating_sub(1) as usize];
    for ((b, _), t) in sent {
        p2p_boundaries[b as usize] += Seconds(t);
    }
    let p2p = p2p_boundaries.iter().map(|t| t.0).fold(0.0, f64::max);
    let kind = ScheduleKind::of(plan.schedule, pp);
    let schedule = PipelineSchedule::generate(kind, pp, m, 1)?;
    let pc = PipelineCosts {
        forward,
        backward_input: backward,
        backward_weight: vec![Seconds(0.0); pp as usize],
        p2p: Seconds(p2p),
        p2p_gradient: Seconds(p2p),
        p2p_boundaries,
    };
    let mut pg = build_pipeline(&schedule, &pc)?;
    // Gradient sync and optimizer per stage, after its last backward.
    for s in 0..pp {
        let nodes: Vec<usize> = (0..n).filter(|i| stage[*i] == s).collect();
        let sync: f64 = nodes
            .iter()
            .flat_map(|i| prices.nodes[*i].sync.iter().map(|x| x.2 .0))
            .sum();
        let params: f64 = nodes.iter().map(|i| prices.nodes[*i].updated).sum();
        let last = pg.last_weight_grad(s, None);
        let link = pg.resources.add_in_group(format!("stage {s} dp"), 1, s);
        let t = pg.add_task(
            Task::new("grad sync", TaskKind::Comm(CommKind::DpAllReduce), link).at(s, 0, 0),
            Seconds(sync),
        );
        if let Some(l) = last {
            pg.graph.add_data(l, t);
        }
        let o = pg.add_task(
            Task::new("optimizer", TaskKind::Optimizer, pg.compute[s as usize]).at(s, 0, 0),
            costs.optimizer_time(params),
        );
        pg.graph.add_data(t, o);
        if let Some(l) = last {
            pg.graph.add_data(l, o);
        }
    }
    let trace = pg.simulate()?;
    let mut comp = vec![0.0; pp as usize];
    let mut opt = vec![0.0; pp as usize];
    let mut last_compute = vec![0.0f64; pp as usize];
    let mut sync_end = vec![0.0f64; pp as usize];
    for (sp, t) in trace.spans.iter().zip(pg.graph.tasks()) {
        let s = t.stage as usize;
        match t.kind {
            TaskKind::Forward | TaskKind::BackwardInput | TaskKind::BackwardWeight => {
                comp[s] += sp.duration().0;
                last_compute[s] = last_compute[s].max(sp.end.0);
            }
            TaskKind::Optimizer => opt[s] += sp.duration().0,
            TaskKind::Comm(CommKind::DpAllReduce) => sync_end[s] = sync_end[s].max(sp.end.0),
            _ => {}
        }
    }
    let s = (0..pp as usize)
        .max_by(|a, b| comp[*a].total_cmp(&comp[*b]))
        .unwrap_or(0);
    let step = trace.makespan.0;
    // The busiest stage waits for its own gradient sync after its last backward; the rest of
    // its idle time is waiting for other stages (the bubble).
    let dp = (sync_end[s] - last_compute[s]).max(0.0);
    let bubble = (step - comp[s] - opt[s] - dp).max(0.0);
    let mut exposed = BTreeMap::new();
    exposed.insert("dp".to_string(), dp);
    let bd = Breakdown {
        compute_s: comp[s],
        bubble_s: bubble,
        optimizer_s: opt[s],
        host_s: 0.0,
        exposed_comm_s: exposed,
    };
    Ok(Simulated {
        step,
        breakdown: bd,
        bubble: if step > 0.0 { bubble / step } else { 0.0 },
        graph: pg.graph,
        resources: pg.resources,
        trace,
        pp,
        in_flight: stage
            .iter()
            .map(|s| f64::from(schedule.max_in_flight(*s)))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_hardware::preset;
    use parallax_ir::{DType, Graph, GraphBuilder, OpKind, Precision};

    /// x[b, 1024] → linear 1024 → linear 1024 → loss.
    fn mlp(batch: u64) -> Graph {
        let mut g = GraphBuilder::new("mlp");
        let x = g.input("x", [batch, 1024], DType::F32);
        let labels = g.input("labels", [batch], DType::I64);
        let h = g.linear("fc1", x, 1024, false).unwrap();
        let y = g.linear("fc2", h, 1024, false).unwrap();
        let loss = g.op1("loss", OpKind::CrossEntropy, &[y, labels]).unwrap();
        g.finish(&[loss]).unwrap()
    }

    fn sample_split(n: usize, d: u32) -> OpPlan {
        OpPlan::uniform(n, |_| ParallelConfig {
            degrees: if d > 1 {
                BTreeMap::from([('a', d)])
            } else {
                BTreeMap::new()
            },
            view: MachineView::block(0, d),
        })
    }

    /// Every op of `c`'s graph split `d` ways along its Sample axis (the builder's leading
    /// label), on the `d` devices from `start(op)`.
    fn sample_split_over(c: &OpCosts, d: u32, start: impl Fn(usize) -> u32) -> OpPlan {
        OpPlan::uniform(c.len(), |i| {
            let m = c.mapping(NodeId(i as u32));
            let (label, _) = m
                .axes
                .iter()
                .find(|(_, a)| a.role == parallax_ir::AxisRole::Sample)
                .unwrap();
            ParallelConfig {
                degrees: BTreeMap::from([(*label, d)]),
                view: MachineView::block(start(i), d),
            }
        })
    }

    #[test]
    fn one_device_runs_forward_backward_and_optimizer_back_to_back() {
        let p = preset("dgx-a100-80gb").unwrap();
        let g = mlp(64);
        let mut c = OpCosts::new(&g, &p, 1, Precision::Fp32).unwrap();
        let plan = sample_split(g.nodes.len(), 1);
        let step = simulate_op_plan(&mut c, &plan, 64).unwrap();
        let mut expect = 0.0;
        let mut params = 0.0;
        for i in 0..g.nodes.len() {
            let id = NodeId(i as u32);
            expect += c.compute(id, &plan.configs[i]).total().0;
            params += c.updated_params(id, &plan.configs[i]);
        }
        expect += c.optimizer_time(params).0;
        let got = step.prediction.step_time_s;
        assert!((got - expect).abs() < 1e-12, "{got} vs {expect}");
        let parts: f64 = step.prediction.breakdown.parts().iter().map(|x| x.1).sum();
        assert!((parts - got).abs() < 1e-9, "{parts} vs {got}");
        assert_eq!(step.prediction.used_devices, 1);
    }

    /// Synchronised BatchNorm's statistics all-reduces block each device's compute stream:
    /// a data-parallel ResNet pays them in full (charged to `reshard`); local statistics do not.
    #[test]
    fn synchronised_batch_norm_pays_its_all_reduces() {
        let p = preset("dgx1-v100-16gb").unwrap();
        let g = parallax_ir::models::resnet::resnet_tiny(64).unwrap();
        let mut c = OpCosts::new(&g, &p, 8, Precision::Fp32).unwrap();
        let mut plan = sample_split_over(&c, 8, |_| 0);
        let sync = simulate_op_plan(&mut c, &plan, 64).unwrap().prediction;
        plan.batch_norm = BatchNormStats::Local;
        let local = simulate_op_plan(&mut c, &plan, 64).unwrap().prediction;
        c.batch_norm = BatchNormStats::Sync;
        let paid: f64 = (0..c.len())
            .map(|i| {
                let (f, b) = c.kernel_collectives(NodeId(i as u32), &plan.configs[i]);
                f.0 + b.0
            })
            .sum();
        assert!(paid > 0.0);
        let extra = sync.step_time_s - local.step_time_s;
        assert!((extra - paid).abs() < 1e-3 * paid, "{extra} vs {paid}");
        let reshard = |p: &OpStepPrediction| p.breakdown.exposed_comm_s["reshard"];
        assert!((reshard(&sync) - reshard(&local) - paid).abs() < 1e-3 * paid);
    }

    #[test]
    fn data_parallel_pays_the_gradient_all_reduce_after_backward() {
        let p = preset("dgx-a100-80gb").unwrap();
        let g = mlp(64);
        let mut c = OpCosts::new(&g, &p, 8, Precision::Fp32).unwrap();
        let plan = sample_split_over(&c, 8, |_| 0);
        let step = simulate_op_plan(&mut c, &plan, 64).unwrap();
        // One class: every device is alike (compute, resharding and gradient-sync streams).
        assert_eq!(step.resources.len(), 3);
        // fc2's and fc1's gradients (4 MiB each) share one bucket, all-reduced over 8 GPUs
        // once backward is done.
        let sync = c.sync_time(
            Bytes(2 * 1024 * 1024 * 4),
            parallax_cost::Group::strided(8, 1, 8),
        );
        let mut fb = 0.0;
        let mut params = 0.0;
        for i in 0..g.nodes.len() {
            let id = NodeId(i as u32);
            fb += c.compute(id, &plan.configs[i]).total().0;
            params += c.updated_params(id, &plan.configs[i]);
        }
        let expect = fb + sync.0 + c.optimizer_time(params).0;
        let got = step.prediction.step_time_s;
        assert!((got - expect).abs() < 1e-12, "{got} vs {expect}");
        assert!(step.prediction.breakdown.exposed_comm_s["dp"] > 0.0);
        // Four accumulated micro-batches run forward and backward four times, sync once; the
        // last three add their weight gradients into the first one's (autograd reads both and
        // writes the sum: 3 × 4 bytes an fp32 element, three times a step).
        let mut acc = plan.clone();
        acc.micro_batches = 4;
        let step4 = simulate_op_plan(&mut c, &acc, 256).unwrap();
        let mut sums = 0.0;
        for i in 0..g.nodes.len() {
            let e = c.accumulated_grad_elems(NodeId(i as u32), &plan.configs[i]);
            // Averaged over the four: 3 / 4 × 12 bytes an element each backward.
            let t = c.wgrad_accumulation_time(e, 4);
            assert_eq!(t, c.device().memory(9.0 * e));
            assert_eq!(c.wgrad_accumulation_time(e, 1).0, 0.0);
            sums += t.0;
        }
        assert!(sums > 0.0);
        let want = 4.0 * (fb + sums) + sync.0 + c.optimizer_time(params).0;
        assert!((step4.prediction.step_time_s - want).abs() < 1e-12);
    }

    /// ZeRO 3 under data parallelism, by hand: each pass over fc1 and fc2 first gathers the
    /// weight on the gradient stream, one op ahead; after backward the gradients are only
    /// reduce-scattered; each device keeps an eighth of the weights and two gathered ones.
    #[test]
    fn zero3_gathers_each_weight_one_pass_ahead_and_only_reduce_scatters() {
        let p = preset("dgx-a100-80gb").unwrap();
        let g = mlp(64);
        let mut c = OpCosts::new(&g, &p, 8, Precision::Fp32).unwrap();
        let plan = sample_split_over(&c, 8, |_| 0);
        let plain = simulate_op_plan(&mut c, &plan, 64).unwrap().prediction;
        let mut plan = plan;
        plan.zero_stage = 3;
        let step = simulate_op_plan(&mut c, &plan, 64).unwrap();
        let gathers = |s: &SimulatedOpStep| {
            s.graph
                .tasks()
                .iter()
                .filter(|t| t.kind == TaskKind::Comm(CommKind::ZeroAllGather))
                .count()
        };
        assert_eq!(gathers(&step), 4);
        let group = parallax_cost::Group::strided(8, 1, 8);
        let weight = Bytes(1024 * 1024 * 4);
        let net = parallax_cost::comm::Network::new(&p);
        let gt = net
            .collective(parallax_cost::Collective::AllGather, weight, group)
            .0;
        assert!((c.param_gather(NodeId(0), &plan.configs[0]).1 .0 - gt).abs() < 1e-15);
        let rs = net
            .collective(
                parallax_cost::Collective::ReduceScatter,
                Bytes(2 * weight.0),
                group,
            )
            .0;
        assert!((c.sync_time(Bytes(2 * weight.0), group).0 - rs).abs() < 1e-15);
        let t: Vec<_> = (0..3)
            .map(|i| c.compute(NodeId(i), &plan.configs[i as usize]))
            .collect();
        let (f1, f2, fl) = (t[0].fwd.0, t[1].fwd.0, t[2].fwd.0);
        // Backward of node i in a step of m micro-batches, with its share of the gradient sum.
        let b = |i: usize, m: u32| {
            let elems = c.accumulated_grad_elems(NodeId(i as u32), &plan.configs[i]);
            t[i].bwd_input.0 + t[i].bwd_weight.0 + c.wgrad_accumulation_time(elems, m).0
        };
        // Gradient stream: G(F1) [0, g], G(F2) [g, 2g], G(B2) after F1, G(B1) after F2.
        let end_of_backward = |m: u32| {
            let e2 = (gt + f1).max(2.0 * gt) + f2;
            let ebl = e2 + fl + b(2, m);
            let g3 = (gt + f1).max(2.0 * gt) + gt;
            let eb2 = ebl.max(g3) + b(1, m);
            let g4 = e2.max(g3) + gt;
            eb2.max(g4) + b(0, m)
        };
        let (eb1, eb1_of_two) = (end_of_backward(1), end_of_backward(2));
        let params: f64 = (0..3)
            .map(|i| c.updated_params(NodeId(i), &plan.configs[i as usize]))
            .sum();
        let expect = eb1 + rs + c.optimizer_time(params).0;
        let got = step.prediction.step_time_s;
        assert!((got - expect).abs() < 1e-12, "{got} vs {expect}");
        let parts: f64 = step.prediction.breakdown.parts().iter().map(|x| x.1).sum();
        assert!((parts - got).abs() < 1e-9, "{parts} vs {got}");
        // Memory: an eighth of fp32 weights, gradients and Adam moments; two gathered weights.
        let (m0, m3) = (plain.memory, step.prediction.memory);
        assert!(
            (m3.params * 8.0 - m0.params).abs() < 1e-9,
            "{m3:?} vs {m0:?}"
        );
        assert!((m3.optimizer * 8.0 - m0.optimizer).abs() < 1e-9);
        let two = 2.0 * weight.0 as f64 / (1u64 << 30) as f64;
        assert!(
            (m3.buffers - m0.buffers - two).abs() < 1e-9,
            "{m3:?} vs {m0:?}"
        );
        // A pipelined per-op plan keeps its weights: ZeRO 3 is refused there.
        let mut piped = sample_split_over(&c, 4, |i| if i == 0 { 0 } else { 4 });
        piped.micro_batches = 2;
        piped.schedule = Schedule::GPipe;
        piped.zero_stage = 3;
        let err = simulate_op_plan(&mut c, &piped, 128)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("zero stage 3: a per-op pipeline"), "{err}");
        // Accumulated micro-batches on the same devices gather again for each (FSDP frees
        // the weights after each pass) and sum whole gradients until the last one.
        let mut acc = plan.clone();
        acc.micro_batches = 2;
        let two = simulate_op_plan(&mut c, &acc, 128).unwrap();
        assert_eq!(gathers(&two), 4);
        let want = 2.0 * eb1_of_two + rs + c.optimizer_time(params).0;
        assert!((two.prediction.step_time_s - want).abs() < 1e-12);
        // Until the last micro-batch reduce-scatters them the gradients are held whole: eight
        // times ZeRO-3's shard, as much as plain data parallelism's.
        let g2 = two.prediction.memory.grads;
        assert!((g2 - m0.grads).abs() < 1e-9 && (g2 - 8.0 * m3.grads).abs() < 1e-9);
        plan.zero_stage = 4;
        assert!(simulate_op_plan(&mut c, &plan, 64).is_err());
    }

    #[test]
    fn disjoint_halves_in_a_chain_form_a_pipeline() {
        let p = preset("dgx-a100-80gb").unwrap();
        let g = mlp(16);
        let mut c = OpCosts::new(&g, &p, 2, Precision::Fp32).unwrap();
        let mut plan = OpPlan::uniform(g.nodes.len(), |i| ParallelConfig {
            degrees: BTreeMap::new(),
            view: MachineView::block(if i == 0 { 0 } else { 1 }, 1),
        });
        plan.micro_batches = 8;
        plan.schedule = Schedule::GPipe;
        let step = simulate_op_plan(&mut c, &plan, 128).unwrap();
        assert_eq!(step.prediction.stages, 2);
        assert!(step.prediction.bubble_fraction > 0.0);
        // Pipelined 8 micro-batches beat running them one after another on one device, and
        // cannot beat half of that.
        let single = {
            let mut c1 = OpCosts::new(&g, &p, 1, Precision::Fp32).unwrap();
            let mut s = sample_split(g.nodes.len(), 1);
            s.micro_batches = 8;
            simulate_op_plan(&mut c1, &s, 128)
                .unwrap()
                .prediction
                .step_time_s
        };
        let t = step.prediction.step_time_s;
        assert!(t < single && t > 0.45 * single, "{t} vs {single}");
        let parts: f64 = step.prediction.breakdown.parts().iter().map(|x| x.1).sum();
        assert!((parts - t).abs() < 1e-9, "{parts} vs {t}");
    }
}
