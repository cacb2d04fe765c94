//! The general-graph trainer: runs the per-operator plans the SOAP search writes (any graph of
//! the IR whose ops have [`kernels`]) over a [`Collectives`] backend.
//!
//! Each op runs on the devices of its configuration's view; each device computes the region of
//! every output its coordinates give it (the layout convention of
//! [`parallax_cost::soap::TensorLayout`], the one the cost model prices), from the regions of
//! the inputs it needs: the input layout's region, widened to the receptive field of its
//! output region for convolutions and pooling over a spatial split. Between a producer and a
//! consumer the data moves by regions: each consumer device takes every block of the
//! producer's layout that meets its region, from the device of that block (itself if it holds
//! one), and adds the partial sums of a contracted split. The backward is the same movement
//! reversed: every consumer device sends the gradient of each part it read to the producer
//! device it read it from, and the producer adds them (replicated reads, halos and partial
//! sums all come out as sums; of an op replicated over a label none of its tensors carries,
//! each copy gets the gradient of what was read from it). Weights live on the devices of their op, each with the
//! region its coordinates give; after the step's micro-batches the devices holding the same
//! region all-reduce its gradient (a weight several ops read — tied embeddings — sums the
//! overlapping parts of every holder's gradient) and apply the same update, so every copy
//! stays identical.
//!
//! BatchNorm under a sample split is synchronised (statistics of the whole micro-batch, as
//! one device computes them) unless the plan says `batch_norm: local` (each device's own
//! samples, as `BatchNorm2d` under DDP); a cross-entropy over a vocabulary split reduces its row maxima
//! and sums over the split (Megatron's vocabulary-parallel loss). Micro-batches run
//! forward, all of them, then backward in reverse (GPipe's order; point-to-point sends never
//! wait for the receiver, so devices holding different ops overlap their micro-batches as a
//! pipeline); the plan's 1F1B schedule and recomputation change when memory is freed, not
//! the values, and are run in this order. Under a plan's ZeRO stage (`OpPlan::zero_stage`
//! ≥ 1) the replicas of a region read by one op split its optimizer step: each keeps the
//! moments of one shard, updates that shard after the gradient all-reduce and all-gathers the
//! updated weights (ZeRO-1's state sharding, run for every stage: gradients and weights stay
//! whole between steps, the values are those of the sharded run).

pub mod data;
pub mod kernels;

pub use data::{GraphData, ImageSet};

use crate::comm::{Collectives, CommError, Group};
use crate::engine::{AdamConfig, CheckpointHook, RankReport, Span, StepHook, StepStats};
use crate::error::ExecError;
use crate::state::{ModelState, TensorState};
use crate::{spawn_ranks, RunReport};
use kernels::{mix, Ctx, Reduce, Saved};
use parallax_cost::soap::{
    coordinate_axes, kernel_reduction_axes, ParallelConfig, Region, TensorLayout,
};
use parallax_ir::graph::{TensorId, TensorRole};
use parallax_ir::{AxesMapping, Graph, OpKind, Shape};
use parallax_sim::perop::OpPlan;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A device's part of a tensor: its region (global element indices) and values, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Local {
    pub region: Region,
    pub data: Vec<f32>,
}

/// The optimizer of a general-graph run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GraphOptimizer {
    /// SGD with (PyTorch-style) momentum: `b = μ·b + g; p -= lr·b`.
    Sgd {
        lr: f32,
        momentum: f32,
    },
    Adam(AdamConfig),
}

/// Everything a general-graph run needs.
#[derive(Clone)]
pub struct GraphRunSpec {
    /// The model at the micro-batch's size.
    pub graph: Graph,
    /// Configuration of every node, micro-batches per step.
    pub plan: OpPlan,
    pub steps: u64,
    pub seed: u64,
    pub optimizer: GraphOptimizer,
    /// How long a rank waits for a message before declaring the sender stalled.
    pub timeout: Duration,
    /// Gather the final parameters into the report (rank 0).
    pub collect_state: bool,
    /// Where the inputs come from.
    pub data: GraphData,
    /// Start from this state (parameters and optimizer moments, whole) instead of a fresh
    /// initialisation; its step counts on.
    pub resume: Option<Arc<ModelState>>,
    /// Call [`GraphRunSpec::on_checkpoint`] every this many steps (and after the last).
    pub checkpoint_every: Option<u64>,
    /// Receives the gathered state at checkpoints (rank 0).
    pub on_checkpoint: Option<CheckpointHook>,
    /// Receives per-step statistics (rank 0; `tokens_per_s` counts samples).
    pub on_step: Option<StepHook>,
    /// Record a timeline: every op's forward and backward per micro-batch, gradient
    /// synchronisation and the optimizer, per device.
    pub trace: bool,
}

impl std::fmt::Debug for GraphRunSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphRunSpec")
            .field("graph", &self.graph.name)
            .field("plan", &self.plan)
            .field("steps", &self.steps)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl GraphRunSpec {
    /// A spec with seed 0, SGD (lr 0.05, momentum 0.9) and a 120 s timeout.
    pub fn new(graph: Graph, plan: OpPlan, steps: u64) -> Self {
        GraphRunSpec {
            graph,
            plan,
            steps,
            seed: 0,
            optimizer: GraphOptimizer::Sgd {
                lr: 0.05,
                momentum: 0.9,
            },
            timeout: Duration::from_secs(120),
            collect_state: false,
            data: GraphData::Synthetic,
            resume: None,
            checkpoint_every: None,
            on_checkpoint: None,
            on_step: None,
            trace: false,
        }
    }

    /// Every op on device 0, the same micro-batches: the single-device run a plan must match.
    pub fn single_device(&self) -> Self {
        let mut s = self.clone();
        s.plan.configs = vec![ParallelConfig::single(0); self.graph.nodes.len()];
        s
    }
}

/// What the synthetic data of an input tensor is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Feed {
    /// Images whose pattern depends on the sample's class (`classes`).
    Images { classes: u64 },
    /// The class of each sample.
    Classes { classes: u64 },
    /// Token ids of a sequence.
    Tokens { vocab: u64 },
    /// The next token of each position.
    NextTokens { vocab: u64 },
    /// Zeros: a float input only added to (ViT's class-token slot, which broadcasts the token
    /// over the batch).
    Zeros,
    /// Uniform noise in [-1, 1): any other float input (an MLP's features).
    Noise,
}

/// How a consumer reads one input.
#[derive(Clone, Debug)]
enum Source {
    /// A weight held by this op's devices.
    Weight,
    /// Fed by the data.
    Data(Feed),
    /// Output `slot` of node `node`.
    Node { node: usize, slot: usize },
}

/// Per node, input and consumer position: the producer positions it exchanges data with and
/// the region of each.
type Routes = Vec<Vec<Vec<Vec<(u32, Region)>>>>;

/// What every rank computes the same way before running.
#[derive(Debug)]
pub struct GraphPrepared {
    world: usize,
    mappings: Vec<AxesMapping>,
    ins_full: Vec<Vec<Shape>>,
    outs_full: Vec<Vec<Shape>>,
    out_layouts: Vec<Vec<TensorLayout>>,
    in_layouts: Vec<Vec<TensorLayout>>,
    sources: Vec<Vec<Source>>,
    /// Per tensor, its consumers `(node, slot)`.
    consumers: Vec<Vec<(usize, usize)>>,
    /// Per node, input and position: the region it needs.
    need: Vec<Vec<Vec<Region>>>,
    /// Per node, input and position: the producer positions it reads and what of each; its
    /// input gradient goes back to the same positions (every partial-sum holder needs the
    /// whole gradient; of replicas, only the one read from computed what was read).
    fetch: Routes,
    /// Per node, whether an input gradient is needed for each input.
    needs_grad: Vec<Vec<bool>>,
    /// The scalar losses (their sum is minimised).
    losses: Vec<TensorId>,
    samples_per_step: u64,
}

fn intersect(a: &Region, b: &Region) -> Option<Region> {
    let r: Region = a
        .iter()
        .zip(b)
        .map(|((a0, a1), (b0, b1))| (*a0.max(b0), *a1.min(b1)))
        .collect();
    r.iter().all(|(x, y)| x < y).then_some(r)
}

/// Copies the part `sub` of `src` (held over `src_r`) out, row-major.
fn extract(src: &[f32], src_r: &Region, sub: &Region) -> Vec<f32> {
    let mut out = Vec::with_capacity(kernels::elems(sub));
    walk(src_r, sub, |off, n| {
        out.extend_from_slice(&src[off..off + n])
    });
    out
}

/// Adds `piece` (over `sub`) into `dst` (held over `dst_r`).
fn add_piece(dst: &mut [f32], dst_r: &Region, sub: &Region, piece: &[f32]) {
    let mut i = 0;
    walk(dst_r, sub, |off, n| {
        for (d, p) in dst[off..off + n].iter_mut().zip(&piece[i..i + n]) {
            *d += p;
        }
        i += n;
    });
}

/// Calls `f(offset in outer, run length)` for every contiguous run of `sub` inside `outer`.
fn walk(outer: &Region, sub: &Region, mut f: impl FnMut(usize, usize)) {
    let r = outer.len();
    if r == 0 {
        f(0, 1);
        return;
    }
    let od = kernels::dims(outer);
    let sd = kernels::dims(sub);
    if sd.contains(&0) {
        return;
    }
    // Trailing dimensions `sub` covers whole are contiguous with the one before them: one run.
    let mut k = r - 1;
    while k > 0 && sd[k] == od[k] {
        k -= 1;
    }
    let run: usize = sd[k..].iter().product();
    let mut strides = vec![1usize; r];
    for i in (0..r - 1).rev() {
        strides[i] = strides[i + 1] * od[i + 1];
    }
    let base: usize = (0..r)
        .map(|i| (sub[i].0 - outer[i].0) as usize * strides[i])
        .sum();
    // Counters over the dimensions before `k`.
    let mut c = vec![0usize; k];
    loop {
        let off = base + c.iter().zip(&strides).map(|(a, b)| a * b).sum::<usize>();
        f(off, run);
        let mut d = k;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            c[d] += 1;
            if c[d] < sd[d] {
                break;
            }
            c[d] = 0;
        }
    }
}

/// Tags of the general trainer's point-to-point messages (distinct from the transformer
/// engine's and from collectives').
const TAG_FWD: u64 = 4 << 48;
const TAG_BWD: u64 = 5 << 48;
const TAG_STATE: u64 = 6 << 48;
const TAG_WSYNC: u64 = 7 << 48;

fn tag(kind: u64, node: usize, slot: usize, mb: usize) -> u64 {
    kind | ((node as u64 & 0x7f_ffff) << 24) | ((slot as u64 & 0xff) << 16) | (mb as u64 & 0xffff)
}

impl GraphPrepared {
    /// Checks the plan against the graph and derives every region and route.
    pub fn new(spec: &GraphRunSpec) -> Result<Self, ExecError> {
        let g = &spec.graph;
        let plan = &spec.plan;
        let layout = |m: String| ExecError::Layout(m);
        if plan.configs.len() != g.nodes.len() {
            return Err(layout(format!(
                "{} op configurations for {} ops",
                plan.configs.len(),
                g.nodes.len()
            )));
        }
        if plan.micro_batches == 0 {
            return Err(layout("micro_batches must be at least 1".into()));
        }
        let nn = g.nodes.len();
        let mut producer: Vec<Option<(usize, usize)>> = vec![None; g.tensors.len()];
        let mut consumers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); g.tensors.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            kernels::supported(&n.op, &g.input_shapes(n))
                .map_err(|e| ExecError::Model(format!("op '{}': {e}", n.name)))?;
            for (k, t) in n.inputs.iter().enumerate() {
                if g.tensor(*t).role == TensorRole::Activation && producer[t.0 as usize].is_none() {
                    return Err(ExecError::Model(format!(
                        "op '{}' reads '{}' before it is produced (nodes must be in topological order)",
                        n.name,
                        g.tensor(*t).name
                    )));
                }
                consumers[t.0 as usize].push((i, k));
            }
            for (o, t) in n.outputs.iter().enumerate() {
                producer[t.0 as usize] = Some((i, o));
            }
        }
        if g.outputs.is_empty() || g.outputs.iter().any(|t| g.tensor(*t).shape.rank() != 0) {
            return Err(ExecError::Model(format!(
                "graph '{}' must end in scalar losses to be trained",
                g.name
            )));
        }
        let losses = g.outputs.clone();
        let world = plan
            .configs
            .iter()
            .map(|c| c.view.end() as usize)
            .max()
            .unwrap_or(1);
        if world > crate::engine::MAX_RANKS {
            return Err(layout(format!(
                "the plan spans {world} devices, beyond the executor's {} ranks",
                crate::engine::MAX_RANKS
            )));
        }
        let mut mappings = Vec::with_capacity(nn);
        let mut ins_full = Vec::with_capacity(nn);
        let mut outs_full = Vec::with_capacity(nn);
        let mut in_layouts = Vec::with_capacity(nn);
        let mut out_layouts = Vec::with_capacity(nn);
        for (i, n) in g.nodes.iter().enumerate() {
            let ins = g.input_shapes(n);
            let outs = g.output_shapes(n);
            let m = n.op.axes(&ins, &outs);
            let cfg = &plan.configs[i];
            check_config(&m, &ins, &outs, cfg)
                .map_err(|e| layout(format!("op '{}': {e}", n.name)))?;
            in_layouts.push(
                ins.iter()
                    .zip(&m.inputs)
                    .map(|(s, l)| TensorLayout::new(&m, l, s.dims(), cfg, false))
                    .collect::<Vec<_>>(),
            );
            out_layouts.push(
                outs.iter()
                    .zip(&m.outputs)
                    .map(|(s, l)| TensorLayout::new(&m, l, s.dims(), cfg, true))
                    .collect::<Vec<_>>(),
            );
            mappings.push(m);
            ins_full.push(ins);
            outs_full.push(outs);
        }
        let feeds = feeds(g, &consumers, &spec.data)?;
        let sources: Vec<Vec<Source>> = g
            .nodes
            .iter()
            .map(|n| {
                n.inputs
                    .iter()
                    .map(|t| match g.tensor(*t).role {
                        TensorRole::Weight => Source::Weight,
                        TensorRole::Input => Source::Data(feeds[t.0 as usize]),
                        TensorRole::Activation => {
                            let (node, slot) = producer[t.0 as usize].expect("checked above");
                            Source::Node { node, slot }
                        }
                    })
                    .collect()
            })
            .collect();
        let mut need = Vec::with_capacity(nn);
        for (i, n) in g.nodes.iter().enumerate() {
            let cfg = &plan.configs[i];
            let per_input: Vec<Vec<Region>> = (0..n.inputs.len())
                .map(|k| {
                    (0..cfg.view.size)
                        .map(|pos| {
                            let mut r = in_layouts[i][k].region(pos);
                            if k == 0 {
                                widen(
                                    &n.op,
                                    &ins_full[i][0],
                                    &out_layouts[i][0].region(pos),
                                    &mut r,
                                );
                            }
                            r
                        })
                        .collect()
                })
                .collect();
            need.push(per_input);
        }
        let device = |node: usize, pos: u32| plan.configs[node].view.device(pos);
        let mut fetch = Vec::with_capacity(nn);
        for i in 0..nn {
            let mut f_in = Vec::new();
            for (k, src) in sources[i].iter().enumerate() {
                let mut f_pos = Vec::new();
                for pos in 0..plan.configs[i].view.size {
                    let (mut f, mut s) = (Vec::new(), Vec::new());
                    if let Source::Node { node: p, slot } = src {
                        let lp = &out_layouts[*p][*slot];
                        let me = device(i, pos);
                        let mut chosen: HashMap<(Vec<u32>, Vec<u32>), u32> = HashMap::new();
                        for q in 0..plan.configs[*p].view.size {
                            if let Some(inter) = intersect(&lp.region(q), &need[i][k][pos as usize])
                            {
                                s.push((q, inter));
                                let key = (lp.block(q), lp.sum_coords(q));
                                let e = chosen.entry(key).or_insert(q);
                                if device(*p, q) == me && device(*p, *e) != me {
                                    *e = q;
                                }
                            }
                        }
                        let mut picks: Vec<u32> = chosen.into_values().collect();
                        picks.sort_unstable();
                        f = s
                            .iter()
                            .filter(|(q, _)| picks.contains(q))
                            .cloned()
                            .collect();
                    }
                    f_pos.push(f);
                }
                f_in.push(f_pos);
            }
            fetch.push(f_in);
        }
        let needs_grad = g
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                n.inputs
                    .iter()
                    .enumerate()
                    .map(|(k, t)| {
                        matches!(sources[i][k], Source::Node { .. } | Source::Weight)
                            && g.tensor(*t).dtype.is_float()
                    })
                    .collect()
            })
            .collect();
        if let Some(st) = &spec.resume {
            check_resume(g, st)?;
        }
        let batch = g
            .tensors
            .iter()
            .find(|t| t.role == TensorRole::Input)
            .and_then(|t| t.shape.0.first().copied())
            .unwrap_or(1);
        Ok(GraphPrepared {
            world,
            mappings,
            ins_full,
            outs_full,
            out_layouts,
            in_layouts,
            sources,
            consumers,
            need,
            fetch,
            needs_grad,
            losses,
            samples_per_step: batch * u64::from(plan.micro_batches),
        })
    }

    /// Ranks the plan uses.
    pub fn world(&self) -> usize {
        self.world
    }
}

/// The configuration of node `node` that splits the first splittable label `pick` accepts
/// (in label order, given its role) `degree` ways over devices `start..start + degree`; the
/// op alone on `start` when no label qualifies or `degree` is 1. Hand-made plans (tests,
/// examples) are built from it.
pub fn split_label(
    g: &Graph,
    node: usize,
    degree: u32,
    start: u32,
    pick: &dyn Fn(char, parallax_ir::AxisRole) -> bool,
) -> ParallelConfig {
    let n = &g.nodes[node];
    let (ins, outs) = (g.input_shapes(n), g.output_shapes(n));
    let m = n.op.axes(&ins, &outs);
    let size = |l: char| {
        m.inputs
            .iter()
            .zip(&ins)
            .chain(m.outputs.iter().zip(&outs))
            .flat_map(|(ls, s)| {
                ls.iter()
                    .zip(s.dims())
                    .filter(move |(c, _)| **c == l)
                    .map(|(_, z)| *z)
            })
            .min()
            .unwrap_or(0)
    };
    let label = m
        .axes
        .iter()
        .find(|(l, i)| i.splittable && pick(**l, i.role) && size(**l) >= u64::from(degree));
    match label {
        Some((l, _)) if degree > 1 => ParallelConfig {
            degrees: std::collections::BTreeMap::from([(*l, degree)]),
            view: parallax_cost::soap::MachineView::block(start, degree),
        },
        _ => ParallelConfig::single(start),
    }
}

/// A per-op plan of `g` with node `i` configured as `f(i)`, fed `micro_batches`
/// micro-batches in GPipe order.
pub fn op_plan(g: &Graph, micro_batches: u32, f: impl Fn(usize) -> ParallelConfig) -> OpPlan {
    OpPlan {
        zero_stage: 0,
        batch_norm: Default::default(),
        configs: (0..g.nodes.len()).map(f).collect(),
        micro_batches,
        schedule: if micro_batches > 1 {
            parallax_ir::Schedule::GPipe
        } else {
            parallax_ir::Schedule::None
        },
        recompute: false,
    }
}

/// A graph that ends in logits rather than a loss (an ONNX export of a classifier or a
/// language model is an inference graph) with a mean cross-entropy against synthetic labels
/// appended to each non-scalar output, and the plan with a configuration for each loss: the
/// sample split of the op producing the logits on the same devices where it has one, else
/// the first device of that op. `None` when every output is already a scalar loss.
pub fn with_training_loss(g: &Graph, plan: &OpPlan) -> Option<(Graph, OpPlan)> {
    use parallax_ir::graph::{Node, Segment, Tensor};
    if g.outputs.iter().all(|t| g.tensor(*t).shape.rank() == 0) {
        return None;
    }
    let mut g2 = g.clone();
    let mut plan2 = plan.clone();
    let mut outputs = Vec::new();
    for (j, &t) in g.outputs.iter().enumerate() {
        let out = g.tensor(t).clone();
        if out.shape.rank() == 0 || !out.dtype.is_float() {
            outputs.push(t);
            continue;
        }
        let lead = parallax_ir::Shape(out.shape.0[..out.shape.rank() - 1].to_vec());
        let labels = TensorId(g2.tensors.len() as u32);
        g2.tensors.push(Tensor {
            name: format!("{}.labels", out.name),
            shape: lead,
            dtype: parallax_ir::DType::I64,
            role: TensorRole::Input,
        });
        let loss = TensorId(g2.tensors.len() as u32);
        g2.tensors.push(Tensor {
            name: format!("{}.loss", out.name),
            shape: parallax_ir::Shape(Vec::new()),
            dtype: parallax_ir::DType::F32,
            role: TensorRole::Activation,
        });
        g2.nodes.push(Node {
            name: format!("loss{}", if j == 0 { String::new() } else { j.to_string() }),
            op: OpKind::CrossEntropy,
            inputs: vec![t, labels],
            outputs: vec![loss],
            segment: Segment::Post,
        });
        outputs.push(loss);
        let producer = g.nodes.iter().position(|n| n.outputs.contains(&t));
        let cfg = producer.map_or(ParallelConfig::single(0), |p| {
            let pc = &plan.configs[p];
            let n = &g.nodes[p];
            let m = n.op.axes(&g.input_shapes(n), &g.output_shapes(n));
            let slot = n.outputs.iter().position(|o| *o == t).unwrap_or(0);
            let d = m.outputs[slot].first().map_or(1, |l| pc.degree(*l));
            let node = g2.nodes.len() - 1;
            let split = split_label(&g2, node, d, pc.view.start, &|_, r| {
                r == parallax_ir::AxisRole::Sample
            });
            if d > 1 && d == pc.view.size && pc.view.stride == 1 {
                split
            } else {
                ParallelConfig::single(pc.view.start)
            }
        });
        plan2.configs.push(cfg);
    }
    g2.outputs = outputs;
    Some((g2, plan2))
}

/// A checkpoint resumes a run only if it holds exactly the graph's weights at their shapes,
/// each with its optimizer moments.
fn check_resume(g: &Graph, st: &ModelState) -> Result<(), ExecError> {
    let bad = |m: String| Err(ExecError::Resume(m));
    let weights: Vec<&parallax_ir::graph::Tensor> = g
        .tensors
        .iter()
        .filter(|t| t.role == TensorRole::Weight)
        .collect();
    for w in &weights {
        let shape: Vec<usize> = w.shape.dims().iter().map(|d| *d as usize).collect();
        match st.tensors.get(&w.name) {
            None => {
                return bad(format!(
                    "tensor {} is missing: not a checkpoint of {}",
                    w.name, g.name
                ))
            }
            Some(t) if t.shape != shape => {
                return bad(format!(
                    "tensor {} has shape {:?}, the model needs {shape:?}",
                    w.name, t.shape
                ))
            }
            Some(t) if t.param.len() != t.m.len() || t.param.len() != t.v.len() => {
                return bad(format!(
                    "tensor {}: optimizer moments of another size",
                    w.name
                ))
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = st
        .tensors
        .keys()
        .find(|n| !weights.iter().any(|w| &w.name == *n))
    {
        return bad(format!("tensor {extra} is not part of {}", g.name));
    }
    Ok(())
}

/// Checks that a configuration splits only splittable labels of its op, by degrees that fit,
/// over a view of as many devices.
fn check_config(
    m: &AxesMapping,
    ins: &[Shape],
    outs: &[Shape],
    cfg: &ParallelConfig,
) -> Result<(), String> {
    if cfg.total_degree() != cfg.view.size {
        return Err(format!(
            "degrees multiply to {} on a view of {} devices",
            cfg.total_degree(),
            cfg.view.size
        ));
    }
    for (l, d) in &cfg.degrees {
        if *d <= 1 {
            continue;
        }
        let info = m
            .axes
            .get(l)
            .ok_or_else(|| format!("label '{l}' is not an axis of the op"))?;
        if !info.splittable {
            return Err(format!("label '{l}' cannot be split"));
        }
        for (labels, shape) in m.inputs.iter().zip(ins).chain(m.outputs.iter().zip(outs)) {
            for (c, size) in labels.iter().zip(shape.dims()) {
                if c == l && u64::from(*d) > *size {
                    return Err(format!("label '{l}': degree {d} exceeds its size {size}"));
                }
            }
        }
    }
    Ok(())
}

/// Widens the region a convolution or pooling reads of its input to the receptive field of
/// the output region `out` (the halo of a spatial split).
fn widen(op: &OpKind, full: &Shape, out: &Region, r: &mut Region) {
    let (kernel, stride, pad, dil) = match op {
        OpKind::Conv2d(a) => (a.kernel, a.stride, a.padding, a.dilation),
        OpKind::Pool2d(a) => (a.kernel, a.stride, a.padding, [1, 1]),
        _ => return,
    };
    for i in 0..2 {
        r[2 + i] = kernels::receptive(
            out[2 + i],
            full.0[2 + i],
            kernel[i],
            stride[i],
            pad[i],
            dil[i],
        );
    }
}

/// What the synthetic data of each input tensor is, from how the graph reads it.
fn feeds(
    g: &Graph,
    consumers: &[Vec<(usize, usize)>],
    data: &GraphData,
) -> Result<Vec<Feed>, ExecError> {
    let mut classes = None;
    let mut vocab = None;
    for n in &g.nodes {
        match &n.op {
            OpKind::CrossEntropy => classes = Some(g.tensor(n.inputs[0]).shape.last()),
            OpKind::Embedding(a) => vocab = vocab.or(Some(a.vocab)),
            _ => {}
        }
    }
    let has_tokens = vocab.is_some();
    match data {
        GraphData::Synthetic => {}
        GraphData::Images(set) => {
            let image = g
                .tensors
                .iter()
                .find(|t| t.role == TensorRole::Input && t.dtype.is_float() && t.shape.rank() == 4);
            let Some(image) = image else {
                return Err(ExecError::Data(format!(
                    "an image set, but {} reads no images",
                    g.name
                )));
            };
            let want = &image.shape.0[1..];
            let have = [set.channels as u64, set.height as u64, set.width as u64];
            if want != have {
                return Err(ExecError::Data(format!(
                    "images of {}×{}×{}, but {} reads {}×{}×{}",
                    have[0], have[1], have[2], g.name, want[0], want[1], want[2]
                )));
            }
            if classes.is_some_and(|c| set.classes > c) {
                return Err(ExecError::Data(format!(
                    "{} classes, but {} tells {} apart",
                    set.classes,
                    g.name,
                    classes.unwrap_or(0)
                )));
            }
        }
        GraphData::Text(bytes) => {
            if vocab.is_none_or(|v| v < 256) {
                return Err(ExecError::Data(format!(
                    "text is read as bytes (256 tokens), but {} has {}",
                    g.name,
                    vocab.map_or("no token embedding".to_string(), |v| format!(
                        "a vocabulary of {v}"
                    ))
                )));
            }
            let seq = g
                .tensors
                .iter()
                .find(|t| t.role == TensorRole::Input && !t.dtype.is_float())
                .map_or(1, |t| t.shape.last());
            if (bytes.len() as u64) < seq + 2 {
                return Err(ExecError::Data(format!(
                    "{} bytes, fewer than a sequence of {seq} and its next token",
                    bytes.len()
                )));
            }
        }
    }
    g.tensors
        .iter()
        .enumerate()
        .map(|(t, tensor)| {
            if tensor.role != TensorRole::Input {
                return Ok(Feed::Zeros);
            }
            let read_by = |f: fn(&OpKind, usize) -> bool| {
                consumers[t]
                    .iter()
                    .any(|(n, k)| f(&g.nodes[*n].op, *k))
            };
            if tensor.dtype.is_float() {
                let slot = consumers[t]
                    .iter()
                    .all(|(n, _)| matches!(g.nodes[*n].op, OpKind::Add));
                return Ok(match classes {
                    Some(c) if tensor.shape.rank() == 4 => Feed::Images { classes: c },
                    _ if slot => Feed::Zeros,
                    _ => Feed::Noise,
                });
            }
            if read_by(|op, k| matches!(op, OpKind::CrossEntropy) && k == 1) {
                let c = classes.unwrap_or(1);
                return Ok(if has_tokens && tensor.shape.rank() >= 2 {
                    Feed::NextTokens { vocab: c }
                } else {
                    Feed::Classes { classes: c }
                });
            }
            if read_by(|op, k| matches!(op, OpKind::Embedding(_)) && k == 0) {
                return Ok(Feed::Tokens {
                    vocab: vocab.unwrap_or(1),
                });
            }
            Err(ExecError::Model(format!(
                "input '{}': the general-graph executor feeds images, class labels and token ids; it cannot tell what this integer input is",
                tensor.name
            )))
        })
        .collect()
}

/// A uniform number in [-1, 1) from a hash.
fn unit(h: u64) -> f32 {
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The class of global sample `s`.
fn class_of(seed: u64, s: u64, classes: u64) -> u64 {
    mix(seed ^ mix(s ^ 0xc1a5)) % classes.max(1)
}

/// Token `t` of global sample `s`: an arithmetic progression modulo the vocabulary whose
/// start and step depend on the sample (learnable from two tokens).
fn token(seed: u64, s: u64, t: u64, vocab: u64) -> u64 {
    let h = mix(seed ^ mix(s ^ 0x70c3));
    let v = vocab.max(1);
    let step = 1 + (h >> 32) % 7.min(v);
    (h % v + t * step) % v
}

/// The values of `region` of a data input for the micro-batch whose first global sample is
/// `first`.
fn feed_region(
    feed: Feed,
    data: &GraphData,
    shape: &Shape,
    region: &Region,
    seed: u64,
    first: u64,
) -> Vec<f32> {
    let d = kernels::dims(region);
    let mut out = Vec::with_capacity(d.iter().product());
    // (sample, class, direction) of the image being written.
    let mut cached = (u64::MAX, 0u64, 0.0f32, 0.0f32);
    kernels::for_each_index(&d, |c| {
        let at = |i: usize| region[i].0 + c[i] as u64;
        let sample = first + if d.is_empty() { 0 } else { at(0) };
        // The element's index within its sample: noise is a function of the sample, however
        // the step's samples are cut into micro-batches and devices.
        let inner = (1..c.len()).fold(0u64, |g, i| g * shape.0[i] + at(i));
        let v = match (feed, data) {
            (Feed::Images { .. }, GraphData::Images(set)) => set.pixel(
                (sample % set.count as u64) as usize,
                at(1) as usize,
                at(2) as usize,
                at(3) as usize,
            ),
            (Feed::Classes { .. }, GraphData::Images(set)) => {
                f32::from(set.labels[(sample % set.count as u64) as usize])
            }
            (Feed::Tokens { .. } | Feed::NextTokens { .. }, GraphData::Text(bytes)) => {
                let seq = shape.last();
                let span = bytes.len() as u64 - seq - 1;
                let off = mix(seed ^ mix(sample ^ 0x7e47)) % span.max(1);
                let next = u64::from(matches!(feed, Feed::NextTokens { .. }));
                f32::from(bytes[(off + at(1) + next) as usize])
            }
            (Feed::Images { classes }, _) => {
                // A class-specific oriented wave on one channel, plus noise.
                if cached.0 != sample {
                    let k = class_of(seed, sample, classes);
                    let angle = k as f32 * std::f32::consts::PI / classes.max(1) as f32;
                    cached = (sample, k, angle.sin(), angle.cos());
                }
                let (_, k, fy, fx) = cached;
                let (ch, y, x) = (at(1), at(2), at(3));
                let (h, w) = (shape.0[2].max(1), shape.0[3].max(1));
                let signal = if ch == k % shape.0[1].max(1) {
                    let phase = 6.0 * (fy * y as f32 / h as f32 + fx * x as f32 / w as f32);
                    phase.sin()
                } else {
                    0.0
                };
                signal + 0.5 * unit(mix(seed ^ mix(sample.wrapping_add(0x1111) ^ mix(inner))))
            }
            (Feed::Classes { classes }, _) => class_of(seed, sample, classes) as f32,
            (Feed::Tokens { vocab }, _) => token(seed, sample, at(1), vocab) as f32,
            (Feed::NextTokens { vocab }, _) => token(seed, sample, at(1) + 1, vocab) as f32,
            (Feed::Zeros, _) => 0.0,
            (Feed::Noise, _) => unit(mix(seed ^ mix(sample ^ mix(inner ^ 0x5eed)))),
        };
        out.push(v);
    });
    out
}

/// The initial value of a weight, whole: uniform ±1/√fan-in for matrices and convolution
/// kernels (PyTorch's default bound), ones and zeros for normalisation scales and shifts,
/// zeros for biases, uniform ±0.1 for embeddings; seeded by the weight's name.
fn init_weight(g: &Graph, node: usize, slot: usize, t: TensorId, seed: u64) -> Vec<f32> {
    let tensor = g.tensor(t);
    let n = tensor.shape.elems() as usize;
    let op = &g.nodes[node].op;
    // A stream per weight name (its bytes folded in), so inits do not depend on node order.
    let h = tensor
        .name
        .bytes()
        .fold(seed ^ 0x1417, |h, b| mix(h ^ u64::from(b)));
    let uniform = |bound: f32| -> Vec<f32> {
        (0..n as u64)
            .map(|i| bound * unit(mix(h ^ mix(i))))
            .collect()
    };
    match (op, slot) {
        (OpKind::BatchNorm | OpKind::LayerNorm | OpKind::RmsNorm, 1) => vec![1.0; n],
        (OpKind::BatchNorm | OpKind::LayerNorm, 2) => vec![0.0; n],
        (OpKind::Linear(_), 2) | (OpKind::Conv2d(_), 2) => vec![0.0; n],
        (OpKind::Lstm(_) | OpKind::Gru(_), 3) => vec![0.0; n],
        (OpKind::Embedding(_), _) => uniform(0.1),
        (OpKind::Lstm(a) | OpKind::Gru(a), _) => uniform(1.0 / (a.hidden as f32).sqrt()),
        (OpKind::Conv2d(_), 1) => {
            let d = tensor.shape.dims();
            let fan_in = d[1..].iter().product::<u64>().max(1);
            uniform(1.0 / (fan_in as f32).sqrt())
        }
        _ => {
            let fan_in = tensor.shape.0.first().copied().unwrap_or(1).max(1);
            uniform(1.0 / (fan_in as f32).sqrt())
        }
    }
}

/// One held weight region with its gradient and optimizer state.
struct Held {
    node: usize,
    slot: usize,
    local: Local,
    grad: Vec<f32>,
    /// Optimizer moments: of the whole region, or of this replica's shard under ZeRO.
    m: Vec<f32>,
    v: Vec<f32>,
    /// Under ZeRO (plan stage ≥ 1), where this device's replicas of the region split its
    /// update: each keeps the moments of one shard, updates it and all-gathers the weights.
    shard: Option<Shard>,
}

/// One replica's share of a region's update under ZeRO: the replicas in group order, this
/// replica's index among them, and the shard length (the region's length over the replicas,
/// rounded up; the last shard is padded).
struct Shard {
    group: Group,
    index: usize,
    piece: usize,
}

impl Shard {
    /// This replica's element range of a region of `len` elements.
    fn range(&self, len: usize) -> std::ops::Range<usize> {
        let lo = (self.index * self.piece).min(len);
        lo..(lo + self.piece).min(len)
    }
}

/// One rank of a general-graph run.
struct Rank<'a> {
    spec: &'a GraphRunSpec,
    prep: &'a GraphPrepared,
    comm: &'a mut dyn Collectives,
    me: usize,
    weights: Vec<Held>,
    /// (node, slot) → index into `weights`.
    weight_at: HashMap<(usize, usize), usize>,
    /// The measured timeline (when traced), from `epoch`.
    spans: Vec<Span>,
    epoch: Instant,
    step_idx: u64,
}

/// The devices holding the same region of weight `slot` of node `n` as device `me` (its
/// replicas, `me` included), in view order.
fn replicas(
    spec: &GraphRunSpec,
    prep: &GraphPrepared,
    n: usize,
    slot: usize,
    me: usize,
) -> Vec<usize> {
    let cfg = &spec.plan.configs[n];
    let layout = &prep.in_layouts[n][slot];
    let pos = cfg.view.position(me as u32).expect("held");
    let block = layout.block(pos);
    (0..cfg.view.size)
        .filter(|q| layout.block(*q) == block)
        .map(|q| cfg.view.device(q) as usize)
        .collect()
}

/// The region of `len` elements whose shards the replicas of `sh` hold, `mine` being this
/// replica's: every shard padded to the same length, all-gathered, the padding dropped.
fn all_gather_shards(
    comm: &mut dyn Collectives,
    sh: &Shard,
    mine: &[f32],
    len: usize,
) -> Result<Vec<f32>, CommError> {
    let mut padded = vec![0.0; sh.piece];
    padded[..mine.len()].copy_from_slice(mine);
    let mut all = vec![0.0; sh.piece * sh.group.size()];
    comm.all_gather(&sh.group, &padded, &mut all)?;
    all.truncate(len);
    Ok(all)
}

/// The inputs of node `n` as its kernel reads them: the held weights in place of `None`.
fn refs<'s>(
    weights: &'s [Held],
    weight_at: &HashMap<(usize, usize), usize>,
    n: usize,
    ins: &'s [Option<Local>],
) -> Vec<&'s Local> {
    ins.iter()
        .enumerate()
        .map(|(k, l)| match l {
            Some(l) => l,
            None => &weights[weight_at[&(n, k)]].local,
        })
        .collect()
}

/// Per micro-batch state of the forward kept for the backward.
#[derive(Default)]
struct Tape {
    /// Outputs this device produced, by tensor.
    outs: HashMap<TensorId, Local>,
    /// Inputs this device read, per node, and what the kernel saved.
    /// (Weights are not copied: `None` stands for the op's weight, held unchanged until the
    /// update.)
    ins: HashMap<usize, (Vec<Option<Local>>, Saved)>,
    /// Pieces a device sends itself: forward by (node, slot), backward by (consumer node,
    /// slot, producer node).
    local_fwd: HashMap<(usize, usize), Vec<f32>>,
    local_bwd: HashMap<(usize, usize), Vec<f32>>,
    /// The micro-batch's data inputs this device reads, by (node, slot), loaded before the
    /// step's clock starts ([`Rank::load`]).
    fed: HashMap<(usize, usize), Vec<f32>>,
    loss: f64,
    /// The step, which dropout masks mix in forward and backward alike.
    step: u64,
}

impl<'a> Rank<'a> {
    /// Records what ran from `t0` to now, when traced.
    fn record(&mut self, name: impl FnOnce() -> String, cat: &'static str, t0: Instant) {
        if self.spec.trace {
            self.spans.push(Span {
                rank: self.me,
                stage: 0,
                name: name(),
                cat,
                step: self.step_idx,
                start_s: t0.duration_since(self.epoch).as_secs_f64(),
                dur_s: t0.elapsed().as_secs_f64(),
            });
        }
    }

    fn pos(&self, node: usize) -> Option<u32> {
        self.spec.plan.configs[node].view.position(self.me as u32)
    }

    fn device(&self, node: usize, pos: u32) -> usize {
        self.spec.plan.configs[node].view.device(pos) as usize
    }

    /// The reduction group of node `n` for the device at `pos`: the devices that differ from
    /// it only in the labels the kernel reduces inside (BatchNorm's sample axis, a loss's
    /// vocabulary).
    fn reduce_group(&self, n: usize, pos: u32) -> Option<Group> {
        let cfg = &self.spec.plan.configs[n];
        let along = kernel_reduction_axes(
            &self.spec.graph.nodes[n].op,
            &self.prep.mappings[n],
            cfg,
            self.spec.plan.batch_norm,
        );
        if along.is_empty() {
            return None;
        }
        let layout = &self.prep.in_layouts[n][0];
        let ranks = layout
            .group_along(pos, &along)
            .into_iter()
            .map(|p| cfg.view.device(p) as usize)
            .collect();
        Some(Group::new(ranks))
    }

    fn init_weights(&mut self) {
        let g = &self.spec.graph;
        for (i, n) in g.nodes.iter().enumerate() {
            let Some(pos) = self.pos(i) else { continue };
            for (k, t) in n.inputs.iter().enumerate() {
                if !matches!(self.prep.sources[i][k], Source::Weight) {
                    continue;
                }
                // A weight shared by several ops starts as its first reader initialises it.
                let shape = &g.tensor(*t).shape;
                let whole: Region = shape.dims().iter().map(|d| (0, *d)).collect();
                let region = self.prep.need[i][k][pos as usize].clone();
                let saved = self
                    .spec
                    .resume
                    .as_ref()
                    .and_then(|r| r.tensors.get(&g.tensor(*t).name));
                let (data, m, v) = match saved {
                    Some(ts) => (
                        extract(&ts.param, &whole, &region),
                        extract(&ts.m, &whole, &region),
                        extract(&ts.v, &whole, &region),
                    ),
                    None => {
                        let (first, fk) = self.prep.consumers[t.0 as usize][0];
                        let full = init_weight(g, first, fk, *t, self.spec.seed);
                        let data = extract(&full, &whole, &region);
                        let n = data.len();
                        (data, vec![0.0; n], vec![0.0; n])
                    }
                };
                let len = data.len();
                // ZeRO: the replicas of a region read by one op split its optimizer state.
                let ranks = replicas(self.spec, self.prep, i, k, self.me);
                let single_reader = self.prep.consumers[t.0 as usize].len() == 1;
                let shard = (self.spec.plan.zero_stage >= 1 && ranks.len() > 1 && single_reader)
                    .then(|| Shard {
                        index: ranks.iter().position(|r| *r == self.me).expect("a replica"),
                        piece: len.div_ceil(ranks.len()),
                        group: Group::new(ranks),
                    });
                let (m, v) = match &shard {
                    Some(sh) => (m[sh.range(len)].to_vec(), v[sh.range(len)].to_vec()),
                    None => (m, v),
                };
                self.weight_at.insert((i, k), self.weights.len());
                self.weights.push(Held {
                    node: i,
                    slot: k,
                    local: Local { region, data },
                    grad: vec![0.0; len],
                    m,
                    v,
                    shard,
                });
            }
        }
    }

    /// The global index of micro-batch `mb`'s first sample in `step`.
    fn first_sample(&self, step: u64, mb: usize) -> u64 {
        let per_step = self.prep.samples_per_step;
        step * per_step + mb as u64 * (per_step / u64::from(self.spec.plan.micro_batches))
    }

    /// Loads the data inputs this device reads for micro-batch `mb` into its tape: a data
    /// loader's work, done before the step's clock starts as a framework's loader workers
    /// prefetch it (the synthetic images' waves cost a sine and three hashes a pixel: a
    /// tenth of a small CNN's step, which no training step pays).
    fn load(&mut self, step: u64, mb: usize, tape: &mut Tape) {
        let (spec, prep) = (self.spec, self.prep);
        let first = self.first_sample(step, mb);
        for (i, n) in spec.graph.nodes.iter().enumerate() {
            let Some(pos) = self.pos(i) else { continue };
            for (k, t) in n.inputs.iter().enumerate() {
                if let Source::Data(feed) = &prep.sources[i][k] {
                    let data = feed_region(
                        *feed,
                        &spec.data,
                        &spec.graph.tensor(*t).shape,
                        &prep.need[i][k][pos as usize],
                        spec.seed,
                        first,
                    );
                    tape.fed.insert((i, k), data);
                }
            }
        }
    }

    fn forward(&mut self, step: u64, mb: usize, tape: &mut Tape) -> Result<(), ExecError> {
        let g = &self.spec.graph;
        let prep = self.prep;
        for (i, n) in g.nodes.iter().enumerate() {
            // Send what this device holds of the inputs of node i to the devices that read it.
            for (k, src) in prep.sources[i].iter().enumerate() {
                let Source::Node { node: p, slot } = src else {
                    continue;
                };
                let Some(q) = self.pos(*p) else { continue };
                let held = &tape.outs[&n.inputs[k]];
                debug_assert_eq!(held.region, prep.out_layouts[*p][*slot].region(q));
                for c in 0..self.spec.plan.configs[i].view.size {
                    let Some((_, inter)) =
                        prep.fetch[i][k][c as usize].iter().find(|(s, _)| *s == q)
                    else {
                        continue;
                    };
                    let piece = extract(&held.data, &held.region, inter);
                    let to = self.device(i, c);
                    if to == self.me {
                        tape.local_fwd.insert((i, k), piece);
                    } else {
                        self.comm.send_owned(to, tag(TAG_FWD, i, k, mb), piece)?;
                    }
                }
            }
            let Some(pos) = self.pos(i) else { continue };
            let t0 = Instant::now();
            let mut ins = Vec::with_capacity(n.inputs.len());
            for k in 0..n.inputs.len() {
                let region = prep.need[i][k][pos as usize].clone();
                let local = match &prep.sources[i][k] {
                    Source::Weight => {
                        ins.push(None);
                        continue;
                    }
                    Source::Data(_) => {
                        let data = tape.fed.remove(&(i, k)).expect("loaded before the step");
                        Local { region, data }
                    }
                    Source::Node { node: p, .. } => {
                        let sources = &prep.fetch[i][k][pos as usize];
                        // One part covering the whole region (the common case of layouts that
                        // agree) is taken as it comes.
                        let whole = matches!(sources.as_slice(), [(_, r)] if *r == region);
                        let mut data = if whole {
                            Vec::new()
                        } else {
                            vec![0.0; kernels::elems(&region)]
                        };
                        for (q, inter) in sources {
                            let from = self.device(*p, *q);
                            let piece = if from == self.me {
                                tape.local_fwd.remove(&(i, k)).expect("local piece")
                            } else {
                                self.comm.recv_owned(
                                    from,
                                    tag(TAG_FWD, i, k, mb),
                                    kernels::elems(inter),
                                    "forward resharding",
                                )?
                            };
                            if whole {
                                data = piece;
                            } else {
                                add_piece(&mut data, &region, inter, &piece);
                            }
                        }
                        Local { region, data }
                    }
                };
                ins.push(Some(local));
            }
            let out_regions: Vec<Region> =
                prep.out_layouts[i].iter().map(|l| l.region(pos)).collect();
            let (outs, saved) =
                self.with_kernel(i, pos, (step, mb), &out_regions, &ins, |ctx, refs| {
                    kernels::forward(ctx, refs)
                })?;
            for ((t, data), region) in n.outputs.iter().zip(outs).zip(out_regions) {
                if prep.losses.contains(t) {
                    tape.loss += f64::from(data[0]);
                }
                tape.outs.insert(*t, Local { region, data });
            }
            tape.ins.insert(i, (ins, saved));
            self.record(|| format!("F {} mb{mb}", n.name), "forward", t0);
        }
        Ok(())
    }

    /// Runs `f` with node `i`'s kernel context on this device (position `pos`; dropout masks
    /// keyed by step and micro-batch) and its inputs, the held weights read in place.
    fn with_kernel<T>(
        &mut self,
        i: usize,
        pos: u32,
        (step, mb): (u64, usize),
        out_regions: &[Region],
        ins: &[Option<Local>],
        f: impl FnOnce(&mut Ctx<'_>, &[&Local]) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        let (spec, prep) = (self.spec, self.prep);
        let group = self.reduce_group(i, pos);
        let coords = self.coords_fn(i, pos);
        let key = mix(spec.seed ^ mix(step ^ mix(mb as u64 ^ mix(i as u64))));
        let comm = &mut *self.comm;
        let mut reduce = |buf: &mut [f32], op: Reduce| group_reduce(comm, group.as_ref(), buf, op);
        let mut ctx = Ctx {
            op: &spec.graph.nodes[i].op,
            ins_full: &prep.ins_full[i],
            outs_full: &prep.outs_full[i],
            out_regions,
            coord: &coords,
            key,
            reduce: &mut reduce,
            local_stats: !spec.plan.batch_norm.is_sync(),
        };
        let refs = refs(&self.weights, &self.weight_at, i, ins);
        f(&mut ctx, &refs)
    }

    fn coords_fn(&self, n: usize, pos: u32) -> impl Fn(char) -> (u32, u32) {
        let cfg = &self.spec.plan.configs[n];
        let axes = coordinate_axes(&self.prep.mappings[n], cfg);
        let c = self.prep.in_layouts[n]
            .first()
            .or(self.prep.out_layouts[n].first())
            .map(|l| l.coords(pos))
            .unwrap_or_default();
        move |l: char| {
            axes.iter()
                .position(|(a, _)| *a == l)
                .map_or((0, 1), |i| (c[i], axes[i].1))
        }
    }

    fn backward(&mut self, mb: usize, tape: &mut Tape) -> Result<(), ExecError> {
        let g = &self.spec.graph;
        let prep = self.prep;
        let scale = 1.0 / self.spec.plan.micro_batches as f32;
        for (i, n) in g.nodes.iter().enumerate().rev() {
            let Some(pos) = self.pos(i) else { continue };
            let t0 = Instant::now();
            let out_regions: Vec<Region> =
                prep.out_layouts[i].iter().map(|l| l.region(pos)).collect();
            let mut dys = Vec::with_capacity(n.outputs.len());
            for (t, region) in n.outputs.iter().zip(&out_regions) {
                let mut dy = vec![0.0; kernels::elems(region)];
                if prep.losses.contains(t) {
                    dy.fill(scale);
                }
                for (c, k) in &prep.consumers[t.0 as usize] {
                    for cpos in 0..self.spec.plan.configs[*c].view.size {
                        let Some((_, inter)) = prep.fetch[*c][*k][cpos as usize]
                            .iter()
                            .find(|(q, _)| *q == pos)
                        else {
                            continue;
                        };
                        let from = self.device(*c, cpos);
                        let piece = if from == self.me {
                            tape.local_bwd.remove(&(*c, *k)).expect("local gradient")
                        } else {
                            self.comm.recv_owned(
                                from,
                                tag(TAG_BWD, *c, *k, mb),
                                kernels::elems(inter),
                                "backward resharding",
                            )?
                        };
                        add_piece(&mut dy, region, inter, &piece);
                    }
                }
                dys.push(dy);
            }
            let (ins, saved) = tape.ins.remove(&i).expect("forward ran");
            let needs = &prep.needs_grad[i];
            let (grads, held) =
                self.with_kernel(i, pos, (tape.step, mb), &out_regions, &ins, |ctx, refs| {
                    let g = kernels::backward(ctx, refs, &saved, &dys, needs)?;
                    let held: Vec<(Region, usize)> = refs
                        .iter()
                        .map(|l| (l.region.clone(), l.data.len()))
                        .collect();
                    Ok((g, held))
                })?;
            for (k, gk) in grads.into_iter().enumerate() {
                if !prep.needs_grad[i][k] {
                    continue;
                }
                let gk = gk.unwrap_or_else(|| vec![0.0; held[k].1]);
                match &prep.sources[i][k] {
                    Source::Weight => {
                        let w = &mut self.weights[self.weight_at[&(i, k)]];
                        crate::tensor::add_into(&mut w.grad, &gk);
                    }
                    Source::Node { node: p, .. } => {
                        for (q, inter) in &prep.fetch[i][k][pos as usize] {
                            let piece = extract(&gk, &held[k].0, inter);
                            let to = self.device(*p, *q);
                            if to == self.me {
                                tape.local_bwd.insert((i, k), piece);
                            } else {
                                self.comm.send_owned(to, tag(TAG_BWD, i, k, mb), piece)?;
                            }
                        }
                    }
                    Source::Data(_) => {}
                }
            }
            self.record(|| format!("B {} mb{mb}", n.name), "backward", t0);
        }
        Ok(())
    }

    /// Sums each weight region's gradient over every device holding any of it: an all-reduce
    /// over the devices holding the same region where one op reads the weight, an exchange of
    /// the overlapping parts between every holder where several ops read it (tied weights).
    fn sync_grads(&mut self) -> Result<(), ExecError> {
        self.sync_shared()?;
        for w in &mut self.weights {
            if self.prep.consumers[self.spec.graph.nodes[w.node].inputs[w.slot].0 as usize].len()
                > 1
            {
                continue;
            }
            let ranks = replicas(self.spec, self.prep, w.node, w.slot, self.me);
            if ranks.len() > 1 {
                self.comm.all_reduce_sum(&Group::new(ranks), &mut w.grad)?;
            }
        }
        Ok(())
    }

    /// The gradient exchange of weights read by several ops: every holder (op, position) of
    /// the weight sends the part of its gradient that overlaps each other holder's region, and
    /// each holder sums every holder's part over its own region in holder order.
    fn sync_shared(&mut self) -> Result<(), ExecError> {
        let spec = self.spec;
        let g = &spec.graph;
        let prep = self.prep;
        for (t, cons) in prep.consumers.iter().enumerate() {
            if g.tensors[t].role != TensorRole::Weight || cons.len() < 2 {
                continue;
            }
            let holders: Vec<(usize, usize, usize, &Region)> = cons
                .iter()
                .flat_map(|&(n, k)| {
                    let view = spec.plan.configs[n].view;
                    (0..view.size)
                        .map(move |p| (n, k, view.device(p) as usize, &prep.need[n][k][p as usize]))
                })
                .collect();
            let mine: Vec<usize> = (0..holders.len())
                .filter(|h| holders[*h].2 == self.me)
                .collect();
            let mut local: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
            for (j, &(_, _, to, rj)) in holders.iter().enumerate() {
                for &h in &mine {
                    let (n, k, _, rh) = holders[h];
                    if h == j {
                        continue;
                    }
                    let Some(inter) = intersect(rh, rj) else {
                        continue;
                    };
                    let w = &self.weights[self.weight_at[&(n, k)]];
                    let piece = extract(&w.grad, &w.local.region, &inter);
                    if to == self.me {
                        local.insert((h, j), piece);
                    } else {
                        self.comm.send(to, tag(TAG_WSYNC, t, 0, j), &piece)?;
                    }
                }
            }
            let mut totals = Vec::with_capacity(mine.len());
            for &j in &mine {
                let (n, k, _, rj) = holders[j];
                let mut total = vec![0.0; kernels::elems(rj)];
                for (h, &(hn, hk, from, rh)) in holders.iter().enumerate() {
                    if h == j {
                        let w = &self.weights[self.weight_at[&(hn, hk)]];
                        crate::tensor::add_into(&mut total, &w.grad);
                        continue;
                    }
                    let Some(inter) = intersect(rh, rj) else {
                        continue;
                    };
                    let piece = if from == self.me {
                        local.remove(&(h, j)).expect("local gradient part")
                    } else {
                        let mut buf = vec![0.0; kernels::elems(&inter)];
                        self.comm.recv(
                            from,
                            tag(TAG_WSYNC, t, 0, j),
                            &mut buf,
                            "tied weight gradient",
                        )?;
                        buf
                    };
                    add_piece(&mut total, rj, &inter, &piece);
                }
                totals.push(((n, k), total));
            }
            for (at, total) in totals {
                let i = self.weight_at[&at];
                self.weights[i].grad = total;
            }
        }
        Ok(())
    }

    /// The optimizer step of every held region; under ZeRO each replica updates its shard
    /// and the replicas all-gather the updated weights.
    fn update(&mut self, step: u64) -> Result<(), ExecError> {
        for w in &mut self.weights {
            let len = w.local.data.len();
            let range = w.shard.as_ref().map_or(0..len, |sh| sh.range(len));
            let (p, g) = (&mut w.local.data[range.clone()], &w.grad[range.clone()]);
            match self.spec.optimizer {
                GraphOptimizer::Sgd { lr, momentum } => {
                    for ((p, g), b) in p.iter_mut().zip(g).zip(&mut w.m) {
                        *b = momentum * *b + g;
                        *p -= lr * *b;
                    }
                }
                GraphOptimizer::Adam(a) => {
                    let bc = a.bias_corrections(step + 1);
                    a.update(bc, p, g, &mut w.m, &mut w.v);
                }
            }
            w.grad.iter_mut().for_each(|g| *g = 0.0);
            if let Some(sh) = &w.shard {
                w.local.data = all_gather_shards(self.comm, sh, &w.local.data[range], len)?;
            }
        }
        Ok(())
    }

    /// A sharded region's optimizer moments whole, gathered from its replicas (ZeRO); `None`
    /// where this device holds them whole already.
    fn gathered_moments(&mut self, at: usize) -> Result<Option<[Vec<f32>; 2]>, ExecError> {
        let w = &self.weights[at];
        let Some(sh) = &w.shard else {
            return Ok(None);
        };
        let len = w.local.data.len();
        Ok(Some([
            all_gather_shards(self.comm, sh, &w.m, len)?,
            all_gather_shards(self.comm, sh, &w.v, len)?,
        ]))
    }

    /// Gathers every weight whole on rank 0 (each region from the lowest device holding it).
    fn gather_state(&mut self, step: u64) -> Result<Option<ModelState>, ExecError> {
        let g = &self.spec.graph;
        let mut state = ModelState {
            step,
            ..ModelState::default()
        };
        for (i, n) in g.nodes.iter().enumerate() {
            for (k, t) in n.inputs.iter().enumerate() {
                if !matches!(self.prep.sources[i][k], Source::Weight) {
                    continue;
                }
                let cfg = &self.spec.plan.configs[i];
                let layout = &self.prep.in_layouts[i][k];
                let shape = g.tensor(*t).shape.dims().to_vec();
                let whole: Region = shape.iter().map(|d| (0, *d)).collect();
                // Parameters and both optimizer moments, each region from the first device
                // holding it.
                let mut full = [
                    vec![0.0; kernels::elems(&whole)],
                    vec![0.0; kernels::elems(&whole)],
                    vec![0.0; kernels::elems(&whole)],
                ];
                // Every replica joins the gather of its sharded moments.
                let gathered = match self.weight_at.get(&(i, k)) {
                    Some(&at) => self.gathered_moments(at)?,
                    None => None,
                };
                let mut seen: Vec<Vec<u32>> = Vec::new();
                for q in 0..cfg.view.size {
                    let b = layout.block(q);
                    if seen.contains(&b) {
                        continue;
                    }
                    seen.push(b);
                    let holder = cfg.view.device(q) as usize;
                    let region = self.prep.need[i][k][q as usize].clone();
                    for (part, out) in full.iter_mut().enumerate() {
                        let tg = tag(TAG_STATE, i, k, part);
                        if holder == self.me {
                            let w = &self.weights[self.weight_at[&(i, k)]];
                            let (m, v) = gathered.as_ref().map_or((&w.m, &w.v), |[m, v]| (m, v));
                            let src = [&w.local.data, m, v][part];
                            if self.me == 0 {
                                add_piece(out, &whole, &region, src);
                            } else {
                                self.comm.send(0, tg, src)?;
                            }
                        } else if self.me == 0 {
                            let mut buf = vec![0.0; kernels::elems(&region)];
                            self.comm.recv(holder, tg, &mut buf, "state gather")?;
                            add_piece(out, &whole, &region, &buf);
                        }
                    }
                }
                let [param, m, v] = full;
                // Every reader of a shared weight holds a copy: they must agree bit for bit.
                let name = &g.tensor(*t).name;
                if let Some(first) = state.tensors.get(name).filter(|_| self.me == 0) {
                    if first.param != param {
                        return Err(ExecError::Rank {
                            rank: 0,
                            message: format!(
                                "weight '{name}': the copy op '{}' holds differs from its first reader's after step {step}",
                                n.name
                            ),
                        });
                    }
                    continue;
                }
                if self.me == 0 {
                    state.tensors.insert(
                        g.tensor(*t).name.clone(),
                        TensorState {
                            shape: shape.iter().map(|d| *d as usize).collect(),
                            param,
                            m,
                            v,
                        },
                    );
                }
            }
        }
        Ok((self.me == 0).then_some(state))
    }
}

fn group_reduce(
    comm: &mut dyn Collectives,
    group: Option<&Group>,
    buf: &mut [f32],
    op: Reduce,
) -> Result<(), CommError> {
    let Some(g) = group else { return Ok(()) };
    match op {
        Reduce::Sum => comm.all_reduce_sum(g, buf),
        Reduce::Max => {
            let mut all = vec![0.0; buf.len() * g.size()];
            comm.all_gather(g, buf, &mut all)?;
            for chunk in all.chunks_exact(buf.len().max(1)) {
                for (b, c) in buf.iter_mut().zip(chunk) {
                    *b = b.max(*c);
                }
            }
            Ok(())
        }
    }
}

/// Trains `spec` on this rank: every step runs the micro-batches forward then backward,
/// synchronises the gradients and updates; the loss is summed over every device.
pub fn run_graph_rank(
    spec: &GraphRunSpec,
    prep: &GraphPrepared,
    comm: &mut dyn Collectives,
    epoch: Instant,
) -> Result<RankReport, ExecError> {
    let me = comm.rank();
    let world = Group::new((0..prep.world).collect());
    let mut rank = Rank {
        spec,
        prep,
        comm,
        me,
        weights: Vec::new(),
        weight_at: HashMap::new(),
        spans: Vec::new(),
        epoch,
        step_idx: 0,
    };
    rank.init_weights();
    let mut report = RankReport::default();
    let m = spec.plan.micro_batches as usize;
    let start = spec.resume.as_ref().map_or(0, |r| r.step);
    for i in 0..spec.steps {
        let step = start + i;
        rank.step_idx = i;
        let ts = Instant::now();
        let mut tapes: Vec<Tape> = (0..m)
            .map(|_| Tape {
                step,
                ..Tape::default()
            })
            .collect();
        for (mb, tape) in tapes.iter_mut().enumerate() {
            rank.load(step, mb, tape);
        }
        rank.record(|| "data".into(), "data", ts);
        let t0 = Instant::now();
        for (mb, tape) in tapes.iter_mut().enumerate() {
            rank.forward(step, mb, tape)?;
        }
        for (mb, tape) in tapes.iter_mut().enumerate().rev() {
            rank.backward(mb, tape)?;
        }
        let ts = Instant::now();
        rank.sync_grads()?;
        rank.record(|| "grad-sync".into(), "comm", ts);
        let ts = Instant::now();
        rank.update(step)?;
        rank.record(|| "optimizer".into(), "optimizer", ts);
        let mut loss = [tapes.iter().map(|t| t.loss).sum::<f64>() as f32 / m as f32];
        rank.comm.all_reduce_sum(&world, &mut loss)?;
        let loss = f64::from(loss[0]);
        if !loss.is_finite() {
            return Err(ExecError::Diverged {
                step: step + 1,
                loss,
            });
        }
        let dt = t0.elapsed().as_secs_f64();
        report.losses.push(loss);
        report.step_times.push(dt);
        if me == 0 {
            if let Some(h) = &spec.on_step {
                h(&StepStats {
                    step: step + 1,
                    loss,
                    time_s: dt,
                    tokens_per_s: prep.samples_per_step as f64 / dt.max(1e-12),
                });
            }
        }
        let done = i + 1 == spec.steps;
        let ck_due = spec.on_checkpoint.is_some()
            && crate::engine::checkpoint_due(spec.checkpoint_every, i, spec.steps);
        if ck_due || (done && spec.collect_state) {
            let st = rank.gather_state(step + 1)?;
            if let (Some(st), Some(h), true) = (&st, &spec.on_checkpoint, ck_due) {
                h(st).map_err(|(path, reason)| ExecError::Checkpoint { path, reason })?;
            }
            if done && spec.collect_state {
                report.state = st;
            }
        }
    }
    report.spans = std::mem::take(&mut rank.spans);
    Ok(report)
}

/// Runs `spec` with one thread per device of its plan.
pub fn run_graph_threads(spec: &GraphRunSpec) -> Result<RunReport, ExecError> {
    let prep = GraphPrepared::new(spec)?;
    let epoch = Instant::now();
    spawn_ranks(prep.world(), spec.timeout, &|comm| {
        run_graph_rank(spec, &prep, comm, epoch)
    })
}

#[cfg(test)]
mod tests;
