//! Costs of per-operator parallel configurations (FlexFlow's SOAP space) for any graph.
//!
//! A [`ParallelConfig`] gives one op a degree for each label of its axes mapping (Sample,
//! Attribute, Parameter; a contracted label leaves partial sums) and a [`MachineView`]: the
//! devices it runs on. Everything else is derived:
//!
//! - **Device coordinates.** A device's position in the view is split into one coordinate per
//!   split label, Sample labels slowest and Parameter labels fastest (so a parameter split
//!   lands on neighbouring devices, inside a node, as Megatron orders tensor parallelism
//!   innermost). From its coordinates, each tensor's region on the device follows: a dimension
//!   whose label is split holds the slice of that coordinate; an output's contracted labels
//!   index partial sums; labels absent from a tensor replicate it.
//! - **Compute** of one shard: the op's own work at the shard's shapes, priced by the one
//!   [`DeviceModel`]; memoized by (op, shard shapes), never by which devices.
//! - **Resharding** between a producer's output layout and a consumer's input layout: partial
//!   sums are reduced first (all-reduce where every member needs the whole region, else
//!   reduce-scatter); then the bytes each device lacks are found by intersecting regions, and
//!   priced as the collective that moves them where the views coincide (all-gather when each
//!   device only gains, all-to-all otherwise) or as point-to-point transfers over the tiers
//!   they cross when the placement changes. The backward transfer is the same function with
//!   the roles swapped: the consumer's input gradient is a partial sum over the labels that
//!   replicated the input, and every partial-sum holder of the producer needs the whole
//!   gradient.
//! - **Gradient synchronisation** of each weight: all-reduce over its replicas (reduce-scatter
//!   plus all-gather under ZeRO 2/3, the same bytes in two collectives).
//! - **Memory** per device: weight, gradient and optimizer-state shards (sharded over the
//!   replicas under ZeRO) and the tensors each op keeps for backward at their shard shapes.

use crate::comm::{Collective, Group, Network};
use crate::compute::{DeviceModel, OpTimes};
pub use crate::memory::Optimizer;
use crate::memory::{state_bytes_per_param_for, FP32_WEIGHT_BYTES, MIXED_WEIGHT_BYTES};
use crate::transformer::WgradAccumulation;
use parallax_hardware::{ClusterProfile, HwError};
use parallax_ir::graph::{Node, NodeId, TensorId, TensorRole};
use parallax_ir::{
    AxesMapping, AxisRole, BatchNormStats, Bytes, Graph, OpKind, Precision, Seconds, Shape,
};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// Largest number of receiving devices a resharding cost inspects; wider views are sampled
/// evenly (their devices differ only by position, and regular layouts repeat every few).
const RESHARD_SAMPLE: u32 = 128;

/// The devices an op runs on: `size` devices `start, start + stride, …`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MachineView {
    pub start: u32,
    pub size: u32,
    pub stride: u32,
}

impl MachineView {
    /// `size` consecutive devices from `start`.
    pub fn block(start: u32, size: u32) -> Self {
        MachineView {
            start,
            size: size.max(1),
            stride: 1,
        }
    }
    /// The device at position `i` of the view.
    pub fn device(&self, i: u32) -> u32 {
        self.start + i * self.stride
    }
    /// The view's devices in position order.
    pub fn devices(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.size).map(|i| self.device(i))
    }
    /// Position of `device` in the view, if it belongs to it.
    pub fn position(&self, device: u32) -> Option<u32> {
        let off = device.checked_sub(self.start)?;
        (off % self.stride == 0 && off / self.stride < self.size).then_some(off / self.stride)
    }
    /// One past the highest device of the view.
    pub fn end(&self) -> u32 {
        self.start + (self.size - 1) * self.stride + 1
    }
}

impl fmt::Display for MachineView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.size == 1 {
            write!(f, "gpu {}", self.start)
        } else if self.stride == 1 {
            write!(f, "gpus {}-{}", self.start, self.end() - 1)
        } else {
            write!(
                f,
                "gpus {}-{} step {}",
                self.start,
                self.end() - 1,
                self.stride
            )
        }
    }
}

/// One op's parallel configuration: split degrees by label and the devices it runs on; the
/// product of the degrees equals the view's size.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ParallelConfig {
    /// Labels split more than once, with their degrees, in label order.
    pub degrees: BTreeMap<char, u32>,
    pub view: MachineView,
}

impl ParallelConfig {
    /// The unsplit op on one device.
    pub fn single(device: u32) -> Self {
        ParallelConfig {
            degrees: BTreeMap::new(),
            view: MachineView::block(device, 1),
        }
    }
    /// Devices the split needs (product of the degrees).
    pub fn total_degree(&self) -> u32 {
        self.degrees.values().product()
    }
    /// Degree of `label` (1 when not split).
    pub fn degree(&self, label: char) -> u32 {
        self.degrees.get(&label).copied().unwrap_or(1)
    }
}

fn role_rank(r: AxisRole) -> u8 {
    match r {
        AxisRole::Sample => 0,
        AxisRole::Attribute => 1,
        AxisRole::Parameter => 2,
    }
}

/// The split labels of `cfg` in coordinate order (slowest first): Sample, Attribute,
/// Parameter, then by label. A device's position in the view is the mixed-radix number of its
/// coordinates on these axes.
pub fn coordinate_axes(mapping: &AxesMapping, cfg: &ParallelConfig) -> Vec<(char, u32)> {
    let mut axes: Vec<(u8, char, u32)> = cfg
        .degrees
        .iter()
        .filter(|(_, d)| **d > 1)
        .map(|(l, d)| {
            let role = mapping.axes.get(l).map_or(AxisRole::Parameter, |i| i.role);
            (role_rank(role), *l, *d)
        })
        .collect();
    axes.sort();
    axes.into_iter().map(|(_, l, d)| (l, d)).collect()
}

/// How one tensor is laid out over the devices of a view: which coordinate axis shards each
/// dimension, which axes index partial sums, the rest replicate it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorLayout {
    /// Full dimensions.
    pub dims: Vec<u64>,
    /// Degrees of the coordinate axes, slowest first.
    radix: Vec<u32>,
    /// For each dimension, the coordinate axis that shards it.
    dim_axis: Vec<Option<u8>>,
    /// Coordinate axes whose value indexes a partial sum.
    sum_axes: Vec<u8>,
    pub view: MachineView,
}

/// A half-open box of element indices, one range per dimension.
pub type Region = Vec<(u64, u64)>;

fn region_elems(r: &Region) -> u64 {
    r.iter().map(|(a, b)| b - a).product()
}

fn intersect(a: &Region, b: &Region) -> u64 {
    a.iter()
        .zip(b)
        .map(|((a0, a1), (b0, b1))| a1.min(b1).saturating_sub(*a0.max(b0)))
        .product()
}

impl TensorLayout {
    /// The layout of a tensor whose dimensions carry `labels`, under `cfg` of an op with
    /// `mapping`; `partial` marks an output whose contracted labels leave partial sums.
    pub fn new(
        mapping: &AxesMapping,
        labels: &[char],
        dims: &[u64],
        cfg: &ParallelConfig,
        partial: bool,
    ) -> Self {
        let axes = coordinate_axes(mapping, cfg);
        let radix = axes.iter().map(|(_, d)| *d).collect();
        let dim_axis = labels
            .iter()
            .map(|l| axes.iter().position(|(a, _)| a == l).map(|i| i as u8))
            .collect();
        let sum_axes = if partial {
            axes.iter()
                .enumerate()
                .filter(|(_, (l, _))| {
                    !labels.contains(l) && mapping.inputs.iter().any(|i| i.contains(l))
                })
                .map(|(i, _)| i as u8)
                .collect()
        } else {
            Vec::new()
        };
        TensorLayout {
            dims: dims.to_vec(),
            radix,
            dim_axis,
            sum_axes,
            view: cfg.view,
        }
    }

    /// The coordinates of the device at `pos` of the view on the coordinate axes (slowest
    /// first, see [`coordinate_axes`]).
    pub fn coords(&self, pos: u32) -> Vec<u32> {
        let mut c = vec![0; self.radix.len()];
        let mut p = pos;
        for (i, r) in self.radix.iter().enumerate().rev() {
            c[i] = p % r;
            p /= r;
        }
        c
    }

    /// The region held by the device at `pos` of the view (empty ranges where a padded split
    /// leaves it no real elements).
    pub fn region(&self, pos: u32) -> Region {
        let c = self.coords(pos);
        self.dims
            .iter()
            .zip(&self.dim_axis)
            .map(|(d, a)| match a {
                Some(a) => {
                    // Shards of ceil(d / k): a padded split's last shards hold fewer (or no)
                    // real elements.
                    let k = u64::from(self.radix[*a as usize]);
                    let w = d.div_ceil(k);
                    let lo = (u64::from(c[*a as usize]) * w).min(*d);
                    (lo, (lo + w).min(*d))
                }
                None => (0, *d),
            })
            .collect()
    }

    /// The region's block index in the grid of distinct regions.
    pub fn block(&self, pos: u32) -> Vec<u32> {
        let c = self.coords(pos);
        self.dim_axis
            .iter()
            .map(|a| a.map_or(0, |a| c[a as usize]))
            .collect()
    }

    /// Elements of one device's region.
    pub fn shard_elems(&self) -> u64 {
        self.dims
            .iter()
            .zip(&self.dim_axis)
            .map(|(d, a)| a.map_or(*d, |a| d.div_ceil(u64::from(self.radix[a as usize]))))
            .product()
    }

    /// Which partial sum the device at `pos` holds: its coordinates on the partial-sum axes
    /// (empty when the value is complete).
    pub fn sum_coords(&self, pos: u32) -> Vec<u32> {
        let c = self.coords(pos);
        self.sum_axes.iter().map(|a| c[*a as usize]).collect()
    }

    /// Number of partial sums (1 when the value is complete).
    pub fn sum_degree(&self) -> u32 {
        self.sum_axes
            .iter()
            .map(|a| self.radix[*a as usize])
            .product()
    }

    /// Number of devices holding each region (replicas × partial sums).
    #[cfg(test)]
    fn copies(&self) -> u32 {
        let sharded: u32 = self
            .dim_axis
            .iter()
            .flatten()
            .map(|a| self.radix[*a as usize])
            .product();
        self.view.size / sharded.max(1)
    }

    /// The same layout with partial sums complete.
    pub fn summed(&self) -> Self {
        TensorLayout {
            sum_axes: Vec::new(),
            ..self.clone()
        }
    }

    /// The gradient's layout when this is a consumer's input: every replica computed a partial
    /// gradient, so the replicating axes index partial sums.
    pub fn as_gradient_source(&self) -> Self {
        let used: Vec<u8> = self.dim_axis.iter().flatten().copied().collect();
        TensorLayout {
            sum_axes: (0..self.radix.len() as u8)
                .filter(|a| !used.contains(a) && self.radix[*a as usize] > 1)
                .collect(),
            ..self.clone()
        }
    }

    /// Positions of the view that share the device at `pos`'s coordinates on every axis but
    /// `axes` (its group along `axes`), in position order.
    pub fn group_along(&self, pos: u32, axes: &[u8]) -> Vec<u32> {
        let me = self.coords(pos);
        (0..self.view.size)
            .filter(|p| {
                let c = self.coords(*p);
                c.iter()
                    .zip(&me)
                    .enumerate()
                    .all(|(i, (a, b))| a == b || axes.contains(&(i as u8)))
            })
            .collect()
    }
}

/// The collective group formed by `devices` on nodes of `gpus_per_node`.
fn group_of(devices: &[u32], gpus_per_node: u32) -> Group {
    let size = devices.len().max(1) as u32;
    let node = |d: u32| d / gpus_per_node.max(1);
    let first = devices.first().copied().unwrap_or(0);
    let per_node = devices.iter().filter(|d| node(**d) == node(first)).count() as u32;
    Group {
        size,
        per_node: per_node.max(1),
    }
}

/// What implements a resharding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferKind {
    /// Nothing moves: every device already holds what it needs.
    None,
    AllReduce,
    ReduceScatter,
    AllGather,
    AllToAll,
    /// A change of placement: point-to-point sends.
    P2p,
}

/// The cost of moving a tensor from one layout to another.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Transfer {
    pub time: Seconds,
    /// Bytes the busiest device receives.
    pub bytes: u64,
    /// The reduction of partial sums, if any, then the data movement.
    pub reduce: Option<TransferKind>,
    pub movement: Option<TransferKind>,
}

/// Prices resharding between two layouts of a tensor of `elem_bytes` elements.
pub fn reshard(
    net: &Network,
    gpus_per_node: u32,
    src: &TensorLayout,
    dst: &TensorLayout,
    elem_bytes: u64,
) -> Transfer {
    let mut out = Transfer::default();
    let mut src = src.clone();
    if src.sum_degree() > 1 {
        let group = src.group_along(0, &src.sum_axes);
        let devices: Vec<u32> = group.iter().map(|p| src.view.device(*p)).collect();
        let g = group_of(&devices, gpus_per_node);
        let bytes = Bytes(src.shard_elems() * elem_bytes);
        // Where every consumer device of the same view needs the whole partial region, the
        // sums are all-reduced; otherwise each member keeps one part (reduce-scatter) and the
        // parts move on from there.
        let whole = src.view == dst.view
            && (0..dst.view.size).all(|p| {
                let need = dst.region(p);
                intersect(&need, &src.region(p)) == region_elems(&src.region(p))
            });
        let (kind, c) = if whole {
            (TransferKind::AllReduce, Collective::AllReduce)
        } else {
            (TransferKind::ReduceScatter, Collective::ReduceScatter)
        };
        out.time += net.collective(c, bytes, g);
        out.bytes = bytes.0;
        out.reduce = Some(kind);
        src = src.summed();
    }
    let movement = movement(net, gpus_per_node, &src, dst, elem_bytes);
    out.time += movement.time;
    out.bytes = out.bytes.max(movement.bytes);
    out.movement = movement.movement;
    out
}

/// Data movement between layouts without partial sums.
fn movement(
    net: &Network,
    gpus_per_node: u32,
    src: &TensorLayout,
    dst: &TensorLayout,
    elem_bytes: u64,
) -> Transfer {
    if src == dst {
        return Transfer::default();
    }
    let node = |d: u32| d / gpus_per_node.max(1);
    // Holders of each distinct source region.
    let mut holders: HashMap<Vec<u32>, Vec<u32>> = HashMap::new();
    for p in 0..src.view.size {
        holders
            .entry(src.block(p))
            .or_default()
            .push(src.view.device(p));
    }
    let mut blocks: Vec<(&Vec<u32>, &Vec<u32>)> = holders.iter().collect();
    blocks.sort();
    let blocks: Vec<(Region, &Vec<u32>)> = blocks
        .into_iter()
        .map(|(_, devs)| {
            let pos = src.view.position(devs[0]).unwrap_or(0);
            (src.region(pos), devs)
        })
        .collect();
    let step = (dst.view.size / RESHARD_SAMPLE).max(1);
    let mut worst_recv = 0u64;
    let mut worst_time = Seconds(0.0);
    let mut gather_only = true;
    let mut a2a_group = 0u32;
    let mut a2a_local = 1u32;
    let mut sent: HashMap<u32, (u64, u64)> = HashMap::new();
    let mut recv: Vec<(u32, u64, u64)> = Vec::new();
    for p in (0..dst.view.size).step_by(step as usize) {
        let dev = dst.view.device(p);
        let need = dst.region(p);
        let held = src.view.position(dev).map(|sp| src.region(sp));
        let local = held.as_ref().map_or(0, |h| intersect(&need, h));
        if let Some(h) = &held {
            if local < region_elems(h) && local < region_elems(&need) {
                gather_only = false;
            }
        } else {
            gather_only = false;
        }
        let (mut intra, mut inter) = (0u64, 0u64);
        let mut peers = 0u32;
        let mut peers_local = 1u32;
        for (region, devs) in &blocks {
            if held.as_ref() == Some(region) {
                continue;
            }
            let n = intersect(&need, region);
            if n == 0 {
                continue;
            }
            let from = devs
                .iter()
                .copied()
                .find(|d| node(*d) == node(dev))
                .unwrap_or(devs[(p as usize) % devs.len()]);
            let b = n * elem_bytes;
            let e = sent.entry(from).or_default();
            peers += 1;
            if node(from) == node(dev) {
                intra += b;
                e.0 += b;
                peers_local += 1;
            } else {
                inter += b;
                e.1 += b;
            }
        }
        worst_recv = worst_recv.max(intra + inter);
        if peers + 1 > a2a_group {
            a2a_group = peers + 1;
            a2a_local = peers_local;
        }
        recv.push((dev, intra, inter));
    }
    if worst_recv == 0 {
        return Transfer::default();
    }
    let same_view = src.view == dst.view;
    if same_view {
        let need_bytes = dst.shard_elems() * elem_bytes;
        let g = Group {
            size: a2a_group.max(2),
            per_node: a2a_local.clamp(1, a2a_group.max(2)),
        };
        if gather_only {
            // Every device keeps what it has and gains the rest: an all-gather of the region
            // it needs over the devices that hold its parts.
            return Transfer {
                time: net.collective(Collective::AllGather, Bytes(need_bytes), g),
                bytes: worst_recv,
                reduce: None,
                movement: Some(TransferKind::AllGather),
            };
        }
        let n = f64::from(g.size);
        let send_buffer = (worst_recv as f64 * n / (n - 1.0)) as u64;
        return Transfer {
            time: net.collective(Collective::AllToAll, Bytes(send_buffer), g),
            bytes: worst_recv,
            reduce: None,
            movement: Some(TransferKind::AllToAll),
        };
    }
    // A change of placement: each device's sends and receives, inside its node and across
    // nodes, run on separate links; the busiest device sets the time.
    for (dev, intra, inter) in &recv {
        let (si, se) = sent.get(dev).copied().unwrap_or((0, 0));
        let t = net
            .p2p(Bytes((*intra).max(si)), false)
            .0
            .max(net.p2p(Bytes((*inter).max(se)), true).0);
        worst_time = Seconds(worst_time.0.max(t));
    }
    for (dev, (si, se)) in &sent {
        if recv.iter().any(|(d, _, _)| d == dev) {
            continue;
        }
        let t = net
            .p2p(Bytes(*si), false)
            .0
            .max(net.p2p(Bytes(*se), true).0);
        worst_time = Seconds(worst_time.0.max(t));
    }
    Transfer {
        time: worst_time,
        bytes: worst_recv,
        reduce: None,
        movement: Some(TransferKind::P2p),
    }
}

/// Why a per-op configuration is illegal for its op.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("node '{node}': {source}")]
    Split {
        node: String,
        #[source]
        source: parallax_ir::SplitError,
    },
    #[error("node '{node}': split over {degree} devices on a view of {view}")]
    ViewSize {
        node: String,
        degree: u32,
        view: u32,
    },
    #[error("node '{node}': view {view} reaches past the cluster's {gpus} devices")]
    OutOfRange {
        node: String,
        view: MachineView,
        gpus: u32,
    },
    #[error("plan has {configs} configurations for {nodes} nodes")]
    Count { configs: usize, nodes: usize },
}

/// The per-op cost model of one graph on one cluster: op shapes and mappings computed once,
/// shard compute and resharding memoized by value.
#[derive(Debug)]
pub struct OpCosts<'a> {
    pub graph: &'a Graph,
    pub profile: &'a ClusterProfile,
    pub gpus: u32,
    pub precision: Precision,
    pub optimizer: Optimizer,
    /// The ZeRO stage being priced (0: weights replicated; 1–3: optimizer states, gradients,
    /// weights sharded over replicas); the simulator sets it from the plan it simulates.
    pub zero_stage: u8,
    /// How replicas combine their gradients.
    pub sync: GradSync,
    /// Whether BatchNorm under a sample split synchronises its statistics (the simulator
    /// sets it from the plan it simulates).
    pub batch_norm: BatchNormStats,
    device: DeviceModel<'a>,
    net: Network<'a>,
    float_bytes: u64,
    ins: Vec<Vec<Shape>>,
    outs: Vec<Vec<Shape>>,
    weights: Vec<Vec<bool>>,
    /// Whether a node's backward must produce an input gradient (some activation input comes
    /// from another node).
    needs_input_grad: Vec<bool>,
    mappings: Vec<AxesMapping>,
    /// Consumers of each tensor: (node, input index).
    consumers: Vec<Vec<(NodeId, usize)>>,
    /// Producer of each tensor.
    producer: Vec<Option<NodeId>>,
    /// Per node, the tensors (view roots) whose saved copy it holds: a tensor kept for
    /// backward by several nodes (a ReLU's output and the next convolution's input) is one
    /// buffer, held by the first of them.
    holds: Vec<Vec<TensorId>>,
    /// The view root of every tensor.
    roots: Vec<TensorId>,
    compute_memo: FxHashMap<(OpKind, Vec<Shape>, Vec<Shape>), OpTimes>,
    /// Per node, the splits already priced (a front to `compute_memo`).
    node_compute: Vec<Vec<(BTreeMap<char, u32>, OpTimes)>>,
    /// Every tensor layout met, interned: the resharding memo is keyed by their ids, so a
    /// lookup neither clones nor hashes layouts.
    layout_ids: FxHashMap<TensorLayout, u32>,
    layouts: Vec<TensorLayout>,
    reshard_memo: FxHashMap<(u32, u32, u64), Transfer>,
}

/// How data-parallel replicas combine their gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradSync {
    /// A collective among the replicas (NCCL all-reduce; reduce-scatter plus all-gather under
    /// ZeRO 2/3). Parameter servers sharded over the nodes move the same bytes through each
    /// NIC as a ring all-reduce (push one gradient, pull one copy of the weights, serve 1/N of
    /// the variables to N workers), so TensorFlow's `distributed_replicated` is priced as this
    /// over the network the profile describes.
    #[default]
    AllReduce,
    /// Variables on the host CPU (TensorFlow `parameter_server` with
    /// `local_parameter_device=cpu`): every device pushes its gradient to host memory and pulls
    /// the updated weights back over its PCIe link.
    HostParameterServer,
}

/// The indices (into [`coordinate_axes`] of `cfg`) of the axes along which `op`'s kernel
/// reduces across the devices that split them: synchronised BatchNorm its sample axis, a
/// cross-entropy its vocabulary; empty for every other op and where those axes are unsplit.
pub fn kernel_reduction_axes(
    op: &OpKind,
    m: &AxesMapping,
    cfg: &ParallelConfig,
    batch_norm: BatchNormStats,
) -> Vec<u8> {
    let reduced = match op {
        OpKind::BatchNorm if batch_norm == BatchNormStats::Sync => 'n',
        OpKind::CrossEntropy => 'v',
        _ => return Vec::new(),
    };
    coordinate_axes(m, cfg)
        .iter()
        .enumerate()
        .filter(|(_, (l, _))| *l == reduced)
        .map(|(i, _)| i as u8)
        .collect()
}

/// A tensor from the node that produces it to one input of a node that reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataEdge {
    pub tensor: TensorId,
    pub producer: usize,
    /// Which output of the producer the tensor is.
    pub out: usize,
    pub consumer: usize,
    /// Input index at the consumer.
    pub input: usize,
}

/// Per-device memory of a configuration of one op, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OpMemory {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
    /// Tensors kept for backward (one micro-batch).
    pub saved: f64,
}

impl<'a> OpCosts<'a> {
    pub fn new(
        graph: &'a Graph,
        profile: &'a ClusterProfile,
        gpus: u32,
        precision: Precision,
    ) -> Result<Self, HwError> {
        // Host cores run the CPU executor's general-graph trainer (im2col + GEMM convolutions,
        // its kernels' measured rates).
        let device = DeviceModel::new(profile, precision)?
            .with_host_graph_trainer(profile.node.devices_are_host_cores());
        let ins: Vec<Vec<Shape>> = graph.nodes.iter().map(|n| graph.input_shapes(n)).collect();
        let outs: Vec<Vec<Shape>> = graph.nodes.iter().map(|n| graph.output_shapes(n)).collect();
        let weights: Vec<Vec<bool>> = graph.nodes.iter().map(|n| graph.weight_flags(n)).collect();
        let mappings = graph
            .nodes
            .iter()
            .zip(ins.iter().zip(&outs))
            .map(|(n, (i, o))| n.op.axes(i, o))
            .collect();
        let mut consumers = vec![Vec::new(); graph.tensors.len()];
        let mut producer = vec![None; graph.tensors.len()];
        for (i, n) in graph.nodes.iter().enumerate() {
            for (k, t) in n.inputs.iter().enumerate() {
                consumers[t.0 as usize].push((NodeId(i as u32), k));
            }
            for t in &n.outputs {
                producer[t.0 as usize] = Some(NodeId(i as u32));
            }
        }
        let needs_input_grad = graph
            .nodes
            .iter()
            .zip(&weights)
            .map(|(n, w)| {
                n.inputs.iter().enumerate().any(|(k, t)| {
                    !w.get(k).copied().unwrap_or(false) && producer[t.0 as usize].is_some()
                })
            })
            .collect();
        let mut holds = vec![Vec::new(); graph.nodes.len()];
        for item in graph.saved_items(1, |_| true) {
            if let Some(t) = item.tensor {
                holds[item.node.0 as usize].push(t);
            }
        }
        Ok(OpCosts {
            graph,
            needs_input_grad,
            holds,
            roots: graph.view_roots(),
            profile,
            gpus,
            precision,
            optimizer: Optimizer::Adam,
            zero_stage: 0,
            sync: GradSync::AllReduce,
            batch_norm: BatchNormStats::Sync,
            device,
            net: Network::new(profile),
            float_bytes: precision.activation_dtype().size_bytes(),
            ins,
            outs,
            weights,
            mappings,
            consumers,
            producer,
            compute_memo: FxHashMap::default(),
            node_compute: vec![Vec::new(); graph.nodes.len()],
            layout_ids: FxHashMap::default(),
            layouts: Vec::new(),
            reshard_memo: FxHashMap::default(),
        })
    }

    /// Activations stored NCHW rather than channels-last ([`DeviceModel::with_nchw`]); set
    /// before anything is priced (the compute memo is cleared).
    pub fn set_nchw(&mut self, nchw: bool) {
        self.device = self.device.with_nchw(nchw);
        self.compute_memo.clear();
        for n in &mut self.node_compute {
            n.clear();
        }
    }

    /// Size of an activation element at the training precision.
    pub fn float_bytes(&self) -> u64 {
        self.float_bytes
    }

    /// The device model.
    pub fn device(&self) -> &DeviceModel<'a> {
        &self.device
    }

    fn node(&self, n: NodeId) -> &'a Node {
        &self.graph.nodes[n.0 as usize]
    }

    /// The axes mapping of a node.
    pub fn mapping(&self, n: NodeId) -> &AxesMapping {
        &self.mappings[n.0 as usize]
    }

    /// Input and output shapes of a node.
    pub fn shapes(&self, n: NodeId) -> (&[Shape], &[Shape]) {
        (&self.ins[n.0 as usize], &self.outs[n.0 as usize])
    }

    /// Consumers of a tensor: (node, input index).
    pub fn consumers(&self, t: TensorId) -> &[(NodeId, usize)] {
        &self.consumers[t.0 as usize]
    }

    /// The node producing a tensor (none for inputs and weights).
    pub fn producer(&self, t: TensorId) -> Option<NodeId> {
        self.producer[t.0 as usize]
    }

    /// Checks a configuration against its node: the split is legal, its degree is the view's
    /// size, and the view lies inside the cluster.
    pub fn check(&self, n: NodeId, cfg: &ParallelConfig) -> Result<(), ConfigError> {
        let node = self.node(n);
        let (i, o) = self.shapes(n);
        self.mapping(n)
            .derive_split(i, o, &cfg.degrees)
            .map_err(|source| ConfigError::Split {
                node: node.name.clone(),
                source,
            })?;
        if cfg.total_degree() != cfg.view.size {
            return Err(ConfigError::ViewSize {
                node: node.name.clone(),
                degree: cfg.total_degree(),
                view: cfg.view.size,
            });
        }
        if cfg.view.stride == 0 || cfg.view.end() > self.gpus {
            return Err(ConfigError::OutOfRange {
                node: node.name.clone(),
                view: cfg.view,
                gpus: self.gpus,
            });
        }
        Ok(())
    }

    /// Shard shapes of a node's inputs and outputs under `degrees` (unsplit where illegal).
    fn shard_shapes(&self, n: NodeId, degrees: &BTreeMap<char, u32>) -> (Vec<Shape>, Vec<Shape>) {
        let (i, o) = self.shapes(n);
        match self.mapping(n).derive_split(i, o, degrees) {
            Ok(s) => (
                i.iter()
                    .zip(&s.inputs)
                    .map(|(sh, d)| d.shard_shape(sh))
                    .collect(),
                o.iter()
                    .zip(&s.outputs)
                    .map(|(sh, d)| d.shard_shape(sh))
                    .collect(),
            ),
            Err(_) => (i.to_vec(), o.to_vec()),
        }
    }

    /// Forward, input-gradient and weight-gradient time of one shard of a node. A node whose
    /// activation inputs are all graph inputs (the data) computes no input gradient: autograd
    /// never asks for it (the first convolution of a CNN, whose 3-channel input gradient would
    /// otherwise cost as much as a wide layer).
    pub fn compute(&mut self, n: NodeId, cfg: &ParallelConfig) -> OpTimes {
        // The search and every simulation ask each node for the same few splits again and
        // again: answer those from the node's own list before building the value key.
        let seen = &self.node_compute[n.0 as usize];
        if let Some((_, t)) = seen.iter().find(|(d, _)| *d == cfg.degrees) {
            return *t;
        }
        let (si, so) = self.shard_shapes(n, &cfg.degrees);
        let key = (self.node(n).op.clone(), si, so);
        let mut t = match self.compute_memo.get(&key) {
            Some(t) => *t,
            None => {
                let w = key.0.work(
                    &key.1,
                    &key.2,
                    &self.weights[n.0 as usize],
                    self.float_bytes,
                );
                let t = self.device.op(&key.0, &key.1, &w, self.float_bytes);
                self.compute_memo.insert(key, t);
                t
            }
        };
        if !self.needs_input_grad[n.0 as usize] {
            t.bwd_input = Seconds(0.0);
        }
        self.node_compute[n.0 as usize].push((cfg.degrees.clone(), t));
        t
    }

    /// Layout of input `k` of a node under `cfg`.
    pub fn input_layout(&self, n: NodeId, k: usize, cfg: &ParallelConfig) -> TensorLayout {
        let m = self.mapping(n);
        TensorLayout::new(
            m,
            &m.inputs[k],
            self.ins[n.0 as usize][k].dims(),
            cfg,
            false,
        )
    }

    /// Layout of output `k` of a node under `cfg` (with its partial sums).
    pub fn output_layout(&self, n: NodeId, k: usize, cfg: &ParallelConfig) -> TensorLayout {
        let m = self.mapping(n);
        TensorLayout::new(
            m,
            &m.outputs[k],
            self.outs[n.0 as usize][k].dims(),
            cfg,
            true,
        )
    }

    /// The id of `l`, interned on first sight.
    fn intern(&mut self, l: TensorLayout) -> u32 {
        if let Some(&id) = self.layout_ids.get(&l) {
            return id;
        }
        let id = self.layouts.len() as u32;
        self.layouts.push(l.clone());
        self.layout_ids.insert(l, id);
        id
    }

    /// Moving `elem`-byte elements from layout `src` to layout `dst` (interned ids), memoized.
    fn priced(&mut self, src: u32, dst: u32, elem: u64) -> Transfer {
        let key = (src, dst, elem);
        if let Some(t) = self.reshard_memo.get(&key) {
            return *t;
        }
        let t = reshard(
            &self.net,
            self.profile.node.gpus_per_node,
            &self.layouts[src as usize],
            &self.layouts[dst as usize],
            elem,
        );
        self.reshard_memo.insert(key, t);
        t
    }

    /// Interned layouts of one side of an edge under each of `configs`: `layout`'s, and the
    /// one its gradient takes (`gradient`).
    fn interned(
        &mut self,
        configs: &[ParallelConfig],
        layout: impl Fn(&Self, &ParallelConfig) -> TensorLayout,
        gradient: fn(&TensorLayout) -> TensorLayout,
    ) -> Vec<(u32, u32)> {
        configs
            .iter()
            .map(|cfg| {
                let l = layout(self, cfg);
                let g = gradient(&l);
                (self.intern(l), self.intern(g))
            })
            .collect()
    }

    /// (forward source, backward destination) of output `out` of `p` under each of `configs`:
    /// the backward destination has no partial sums (every partial-sum holder of the producer
    /// needs the whole gradient).
    fn producer_layouts(
        &mut self,
        p: NodeId,
        out: usize,
        configs: &[ParallelConfig],
    ) -> Vec<(u32, u32)> {
        self.interned(
            configs,
            |c, cfg| c.output_layout(p, out, cfg),
            TensorLayout::summed,
        )
    }

    /// (forward destination, backward source) of input `k` of `c` under each of `configs`.
    fn consumer_layouts(
        &mut self,
        c: NodeId,
        k: usize,
        configs: &[ParallelConfig],
    ) -> Vec<(u32, u32)> {
        self.interned(
            configs,
            |s, cfg| s.input_layout(c, k, cfg),
            TensorLayout::as_gradient_source,
        )
    }

    /// Forward and backward transfers between interned producer and consumer layouts.
    fn transfers(
        &mut self,
        t: TensorId,
        (src, summed): (u32, u32),
        (dst, grad): (u32, u32),
    ) -> (Transfer, Transfer) {
        let elem = self.graph.elem_bytes(t, self.float_bytes);
        let fwd = self.priced(src, dst, elem);
        let bwd = if self.graph.tensor(t).dtype.is_float() {
            self.priced(grad, summed, self.float_bytes)
        } else {
            Transfer::default()
        };
        (fwd, bwd)
    }

    /// [`OpCosts::edge`] for every pair of `pcs` × `ccs`: seconds of both directions, row-major
    /// (`[a * ccs.len() + b]`). Each configuration's layouts are built once.
    pub fn edge_table(
        &mut self,
        t: TensorId,
        (p, out, pcs): (NodeId, usize, &[ParallelConfig]),
        (c, k, ccs): (NodeId, usize, &[ParallelConfig]),
    ) -> Vec<f64> {
        let src = self.producer_layouts(p, out, pcs);
        let dst = self.consumer_layouts(c, k, ccs);
        let mut table = Vec::with_capacity(src.len() * dst.len());
        for &s in &src {
            for &d in &dst {
                let (f, b) = self.transfers(t, s, d);
                table.push(f.time.0 + b.time.0);
            }
        }
        table
    }

    /// Every data edge of the graph: each input of each node that another node produces, in
    /// node and input order.
    pub fn data_edges(&self) -> impl Iterator<Item = DataEdge> + '_ {
        let g = self.graph;
        g.nodes.iter().enumerate().flat_map(move |(c, node)| {
            node.inputs
                .iter()
                .enumerate()
                .filter_map(move |(input, t)| {
                    let p = self.producer(*t)?;
                    let out = g.nodes[p.0 as usize]
                        .outputs
                        .iter()
                        .position(|x| x == t)
                        .unwrap_or(0);
                    Some(DataEdge {
                        tensor: *t,
                        producer: p.0 as usize,
                        out,
                        consumer: c,
                        input,
                    })
                })
        })
    }

    /// Forward and backward resharding of tensor `t` from its producer (output `out` of node
    /// `p` under `pc`) to input `k` of node `c` under `cc`, and the interned id of the layout
    /// the consumer takes it in (consumers wanting the same layout have the same id).
    pub fn edge(
        &mut self,
        t: TensorId,
        (p, out, pc): (NodeId, usize, &ParallelConfig),
        (c, k, cc): (NodeId, usize, &ParallelConfig),
    ) -> (Transfer, Transfer, u32) {
        let src = self.producer_layouts(p, out, std::slice::from_ref(pc))[0];
        let dst = self.consumer_layouts(c, k, std::slice::from_ref(cc))[0];
        let (f, b) = self.transfers(t, src, dst);
        (f, b, dst.0)
    }

    /// The weights a node reads first (a weight shared by several nodes is synchronised once,
    /// where first read).
    pub fn owned_weights(&self, n: NodeId) -> Vec<usize> {
        let node = self.node(n);
        node.inputs
            .iter()
            .enumerate()
            .filter(|(_, t)| {
                self.graph.tensor(**t).role == TensorRole::Weight
                    && self.consumers(**t).first().map(|c| c.0) == Some(n)
            })
            .map(|(k, _)| k)
            .collect()
    }

    /// The layout of each weight a node owns under `cfg`, with the layout of its gradient
    /// (a partial sum over the weight's replicas).
    fn weight_layouts(
        &self,
        n: NodeId,
        cfg: &ParallelConfig,
    ) -> impl Iterator<Item = (TensorLayout, TensorLayout)> + '_ {
        let cfg = cfg.clone();
        self.owned_weights(n).into_iter().map(move |k| {
            let layout = self.input_layout(n, k, &cfg);
            let grad = layout.as_gradient_source();
            (layout, grad)
        })
    }

    /// Bytes of one gradient element as gradients are accumulated and reduced (an fp32 main
    /// gradient under mixed precision).
    pub fn grad_bytes(&self) -> f64 {
        self.state_bytes(1).1
    }

    /// Model-state bytes per parameter under the ZeRO stage, sharded over `replicas`.
    fn state_bytes(&self, replicas: u32) -> (f64, f64, f64) {
        state_bytes_per_param_for(self.optimizer, self.precision, self.zero_stage, replicas)
    }

    /// Gradient synchronisation of the weights a node owns: one collective per weight over its
    /// replicas, as `(bytes per device, group, time)`; empty when nothing is replicated.
    pub fn grad_sync(&self, n: NodeId, cfg: &ParallelConfig) -> Vec<(u64, Group, Seconds)> {
        let grad_bytes = self.grad_bytes() as u64;
        self.replicated_weights(n, cfg)
            .map(|(layout, g)| {
                let bytes = Bytes(layout.shard_elems() * grad_bytes);
                (bytes.0, g, self.sync_time(bytes, g))
            })
            .collect()
    }

    /// The weights a node owns that several devices hold alike under `cfg`, each with the group
    /// of its replicas (who sum its gradient, and under ZeRO share its states).
    fn replicated_weights(
        &self,
        n: NodeId,
        cfg: &ParallelConfig,
    ) -> impl Iterator<Item = (TensorLayout, Group)> + '_ {
        self.weight_layouts(n, cfg)
            .filter(|(_, grad)| grad.sum_degree() > 1)
            .map(move |(layout, grad)| {
                let group = self.group_along(&grad, &grad.sum_axes);
                (layout, group)
            })
    }

    /// The collective group of the devices of `layout`'s view that differ from its first
    /// device only along `axes` (its coordinate axes' indices).
    fn group_along(&self, layout: &TensorLayout, axes: &[u8]) -> Group {
        let devices: Vec<u32> = layout
            .group_along(0, axes)
            .iter()
            .map(|p| layout.view.device(*p))
            .collect();
        group_of(&devices, self.profile.node.gpus_per_node)
    }

    /// Time to synchronise `bytes` of gradient over `g`: an all-reduce; under ZeRO 2 a
    /// reduce-scatter plus the all-gather of the updated parameters (the same bytes moved);
    /// under ZeRO 3 the reduce-scatter alone (the next step gathers the weights where they are
    /// used, [`OpCosts::param_gather`]); with a host parameter server, a push of the gradient
    /// and a pull of the updated weights over each device's share of its host link.
    pub fn sync_time(&self, bytes: Bytes, g: Group) -> Seconds {
        if self.sync == GradSync::HostParameterServer {
            let node = &self.profile.node;
            let link = node
                .host_link_bandwidth()
                .unwrap_or_else(|| node.intra_bandwidth());
            return Seconds(2.0 * bytes.0 as f64 / link.0) + node.intra_latency() * 2.0;
        }
        if self.zero_stage >= 3 {
            self.net.collective(Collective::ReduceScatter, bytes, g)
        } else if self.zero_stage == 2 {
            self.net.collective(Collective::ReduceScatter, bytes, g)
                + self.net.collective(Collective::AllGather, bytes, g)
        } else {
            self.net.collective(Collective::AllReduce, bytes, g)
        }
    }

    /// The collectives a node's kernels run inside themselves over the devices that split what
    /// they reduce, forward and backward seconds: synchronised BatchNorm under a sample split
    /// all-reduces its per-channel sums and then its squared deviations forward (two passes, as
    /// the executor computes mean then variance) and the two per-channel gradient sums backward;
    /// a cross-entropy under a vocabulary split all-reduces each row's maximum, then its sum of
    /// exponentials with the target's logit (Megatron's vocabulary-parallel loss). Statistics
    /// are fp32. `(0, 0)` where the node reduces nothing across devices.
    pub fn kernel_collectives(&self, n: NodeId, cfg: &ParallelConfig) -> (Seconds, Seconds) {
        let none = (Seconds(0.0), Seconds(0.0));
        let op = &self.node(n).op;
        let along = kernel_reduction_axes(op, self.mapping(n), cfg, self.batch_norm);
        if along.is_empty() {
            return none;
        }
        let group = self.group_along(&self.input_layout(n, 0, cfg), &along);
        if group.size < 2 {
            return none;
        }
        let (ins, _) = self.shard_shapes(n, &cfg.degrees);
        let x = ins[0].dims();
        let all_reduce = |elems: u64| {
            self.net
                .collective(Collective::AllReduce, Bytes(4 * elems), group)
        };
        if matches!(op, OpKind::BatchNorm) {
            let channels = x.get(1).copied().unwrap_or(1);
            (all_reduce(channels) * 2.0, all_reduce(2 * channels))
        } else {
            let rows: u64 = x[..x.len().saturating_sub(1)].iter().product();
            (all_reduce(rows) + all_reduce(2 * rows), Seconds(0.0))
        }
    }

    /// Under ZeRO 3, the all-gather of the weights a node owns before each pass over it: the
    /// bytes of its replicated weight shards in the training type (what the pass reads) and
    /// the time to gather them from their replicas; `(0, 0)` where nothing is sharded.
    pub fn param_gather(&self, n: NodeId, cfg: &ParallelConfig) -> (f64, Seconds) {
        if self.zero_stage < 3 {
            return (0.0, Seconds(0.0));
        }
        let w = if self.precision.is_mixed() {
            MIXED_WEIGHT_BYTES
        } else {
            FP32_WEIGHT_BYTES
        };
        self.replicated_weights(n, cfg)
            .fold((0.0, Seconds(0.0)), |(b, t), (layout, g)| {
                let bytes = layout.shard_elems() as f64 * w;
                let time = self
                    .net
                    .collective(Collective::AllGather, Bytes(bytes as u64), g);
                (b + bytes, t + time)
            })
    }

    /// Per-device memory of one node under `cfg`: the weights it owns (states sharded over
    /// their replicas under ZeRO) and what it keeps for backward at shard shapes.
    pub fn memory(&self, n: NodeId, cfg: &ParallelConfig) -> OpMemory {
        let node = self.node(n);
        let (si, so) = self.shard_shapes(n, &cfg.degrees);
        let mut m = OpMemory::default();
        for (layout, grad) in self.weight_layouts(n, cfg) {
            let (w, g, o) = self.state_bytes(grad.sum_degree());
            let elems = layout.shard_elems() as f64;
            m.params += w * elems;
            m.grads += g * elems;
            m.optimizer += o * elems;
        }
        let s = node.op.saves(&si, &self.weights[n.0 as usize]);
        let fb = self.float_bytes;
        let holds = &self.holds[n.0 as usize];
        let bytes_of = |shape: &Shape, t: TensorId| {
            if holds.contains(&self.roots[t.0 as usize]) {
                shape.elems() * self.graph.elem_bytes(t, fb)
            } else {
                0
            }
        };
        for &i in &s.inputs {
            m.saved += bytes_of(&si[i], node.inputs[i]) as f64;
        }
        for &o in &s.outputs {
            m.saved += bytes_of(&so[o], node.outputs[o]) as f64;
        }
        m.saved += (s.extra_elems * fb + s.extra_bytes) as f64;
        m
    }

    /// Gradient elements one device of the node's view holds whole while micro-batches
    /// accumulate: the shards of the weights it owns (replicas synchronise only after the last
    /// micro-batch, whatever the ZeRO stage).
    pub fn accumulated_grad_elems(&self, n: NodeId, cfg: &ParallelConfig) -> f64 {
        self.weight_layouts(n, cfg)
            .map(|(layout, _)| layout.shard_elems() as f64)
            .sum()
    }

    /// Time one micro-batch's backward spends adding `elems` weight-gradient elements into the
    /// gradients accumulated over `m` micro-batches, averaged over them: PyTorch's autograd
    /// (`AccumulateGrad`, as under DDP's `no_sync`) keeps the first micro-batch's gradient and
    /// adds each later one in place, at the size gradients are reduced in
    /// ([`WgradAccumulation::Autograd`], the transformer model's rule). Nothing for one
    /// micro-batch.
    pub fn wgrad_accumulation_time(&self, elems: f64, m: u32) -> Seconds {
        let per_elem = WgradAccumulation::Autograd.bytes_per_param(
            self.float_bytes,
            self.grad_bytes() as u64,
            m.into(),
        );
        self.device.memory(per_elem * elems)
    }

    /// Time of the optimizer update of `params` parameters on one device.
    pub fn optimizer_time(&self, params: f64) -> Seconds {
        if params <= 0.0 {
            return Seconds(0.0);
        }
        self.device.memory(self.optimizer.update_bytes() * params)
    }

    /// Parameters one device of the node's view updates: the shards of the weights it owns,
    /// split further over their replicas under ZeRO 1–3.
    pub fn updated_params(&self, n: NodeId, cfg: &ParallelConfig) -> f64 {
        self.weight_layouts(n, cfg)
            .map(|(layout, grad)| {
                let elems = layout.shard_elems() as f64;
                if self.zero_stage >= 1 {
                    elems / f64::from(grad.sum_degree())
                } else {
                    elems
                }
            })
            .sum()
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.graph.nodes.len()
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.graph.nodes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_hardware::preset;
    use parallax_ir::AxesMapping;

    fn linear() -> AxesMapping {
        AxesMapping::parse(
            "bk,kn->bn",
            &[
                ('b', AxisRole::Sample, true),
                ('k', AxisRole::Parameter, true),
                ('n', AxisRole::Parameter, true),
            ],
        )
    }

    fn cfg(d: &[(char, u32)], start: u32) -> ParallelConfig {
        let degrees: BTreeMap<char, u32> = d.iter().copied().collect();
        let size = degrees.values().product();
        ParallelConfig {
            degrees,
            view: MachineView::block(start, size),
        }
    }

    fn resnet50() -> Graph {
        parallax_ir::load_model("resnet50")
            .unwrap()
            .graph(8, 1, false)
            .unwrap()
    }

    #[test]
    fn the_first_layer_computes_no_input_gradient() {
        let g = resnet50();
        let p = preset("dgx1-p100-16gb").unwrap();
        let mut c = OpCosts::new(&g, &p, 1, Precision::Fp32).unwrap();
        let one = ParallelConfig::single(0);
        let first = c.compute(NodeId(0), &one);
        assert!(matches!(g.nodes[0].op, OpKind::Conv2d(_)));
        assert_eq!(first.bwd_input.0, 0.0);
        assert!(first.bwd_weight.0 > 0.0);
        // The next conv's input comes from a node: its gradient is computed.
        let next = (1..g.nodes.len())
            .find(|i| matches!(g.nodes[*i].op, OpKind::Conv2d(_)))
            .unwrap();
        assert!(c.compute(NodeId(next as u32), &one).bwd_input.0 > 0.0);
    }

    /// Unsplit, the nodes' saved tensors add up to the graph's activation memory: a ReLU's
    /// output that the next convolution keeps too is one buffer, and the max pool keeps its
    /// 8-byte argmax indices.
    #[test]
    fn a_tensor_kept_by_two_nodes_is_counted_once() {
        let g = resnet50();
        let p = preset("dgx1-p100-16gb").unwrap();
        let c = OpCosts::new(&g, &p, 1, Precision::Fp32).unwrap();
        let one = ParallelConfig::single(0);
        let saved: f64 = (0..g.nodes.len())
            .map(|i| c.memory(NodeId(i as u32), &one).saved)
            .sum();
        let graph = g.activation_bytes(4, |_| true).0 as f64;
        assert!((saved - graph).abs() < 1.0, "{saved} vs {graph}");
        // conv → batch norm → in-place ReLU → conv keeps the convolution output and the ReLU
        // output only: a convolution fed by a ReLU holds nothing of its own.
        let fed_by_relu = g
            .nodes
            .iter()
            .position(|n| {
                matches!(n.op, OpKind::Conv2d(_))
                    && g.nodes.iter().any(|m| {
                        matches!(m.op, OpKind::Activation(_)) && m.outputs[0] == n.inputs[0]
                    })
            })
            .unwrap();
        assert_eq!(c.memory(NodeId(fed_by_relu as u32), &one).saved, 0.0);
        // The stem's max pool reads the ReLU output (held there) and keeps its indices.
        let pool = g
            .nodes
            .iter()
            .position(|n| matches!(n.op, OpKind::Pool2d(_)))
            .unwrap();
        let y = &g.output_shapes(&g.nodes[pool])[0];
        assert_eq!(
            c.memory(NodeId(pool as u32), &one).saved,
            (y.elems() * 8) as f64
        );
    }

    #[test]
    fn a_host_parameter_server_moves_the_gradient_and_the_weights_over_pcie() {
        let g = resnet50();
        let p = preset("dgx1-p100-16gb").unwrap();
        let mut c = OpCosts::new(&g, &p, 8, Precision::Fp32).unwrap();
        let group = Group {
            size: 8,
            per_node: 8,
        };
        let bytes = Bytes(100 << 20);
        let ring = c.sync_time(bytes, group);
        c.sync = GradSync::HostParameterServer;
        let ps = c.sync_time(bytes, group);
        // Push and pull at 7.875 GB/s each (half of a PCIe 3.0 x16 switch uplink).
        let expect = 2.0 * (100u64 << 20) as f64 / 7.875e9;
        assert!((ps.0 - expect).abs() / expect < 0.01, "{ps:?}");
        assert!(ps.0 > ring.0);
    }

    #[test]
    fn parameter_axes_are_innermost_and_regions_follow_coordinates() {
        let m = linear();
        let c = cfg(&[('b', 2), ('n', 4)], 0);
        let out = TensorLayout::new(&m, &['b', 'n'], &[8, 64], &c, true);
        // Position 5 = b-coordinate 1, n-coordinate 1.
        assert_eq!(out.region(5), vec![(4, 8), (16, 32)]);
        let x = TensorLayout::new(&m, &['b', 'k'], &[8, 32], &c, false);
        assert_eq!(x.copies(), 4);
        assert_eq!(x.region(5), vec![(4, 8), (0, 32)]);
    }

    #[test]
    fn resharding_volumes_match_hand_computation() {
        let p = preset("dgx-a100-80gb").unwrap();
        let net = Network::new(&p);
        let m = linear();
        let dims = [64u64, 1024];
        let lay = |d: &[(char, u32)], start: u32, labels: &[char], partial| {
            TensorLayout::new(&m, labels, &dims, &cfg(d, start), partial)
        };
        // Sample split over 8 → replicated on the same 8: each device gains 7/8 of the tensor
        // (all-gather, 7 × 8 rows × 1024 × 2 bytes).
        let src = lay(&[('b', 8)], 0, &['b', 'n'], true);
        let dst = lay(&[('n', 8)], 0, &['b', 'k'], false);
        let t = reshard(&net, 8, &src, &dst, 2);
        assert_eq!(t.movement, Some(TransferKind::AllGather));
        assert_eq!(t.bytes, 7 * 8 * 1024 * 2);
        let ag = net.collective(
            Collective::AllGather,
            Bytes(64 * 1024 * 2),
            Group::strided(8, 1, 8),
        );
        assert!((t.time.0 - ag.0).abs() < 1e-12);
        // Sample split → column split on the same devices: each keeps 1/64 and receives 7/64 of
        // the tensor (all-to-all).
        let col = lay(&[('b', 8)], 0, &['b', 'k'], false);
        let split_n = TensorLayout::new(
            &AxesMapping::parse(
                "bn->bn",
                &[
                    ('b', AxisRole::Sample, true),
                    ('n', AxisRole::Parameter, true),
                ],
            ),
            &['b', 'n'],
            &dims,
            &cfg(&[('n', 8)], 0),
            false,
        );
        let t = reshard(&net, 8, &col, &split_n, 2);
        assert_eq!(t.movement, Some(TransferKind::AllToAll));
        assert_eq!(t.bytes, 7 * (64 * 1024 / 64) * 2);
        // Row-parallel partial sums into a replicated consumer: all-reduce of the whole tensor.
        let rows = lay(&[('k', 4)], 0, &['b', 'n'], true);
        assert_eq!(rows.sum_degree(), 4);
        let repl = lay(&[('n', 4)], 0, &['b', 'k'], false);
        let t = reshard(&net, 8, &rows, &repl, 2);
        assert_eq!(t.reduce, Some(TransferKind::AllReduce));
        assert_eq!(t.movement, None);
        assert_eq!(t.bytes, 64 * 1024 * 2);
        // Same layout, same devices: nothing moves.
        let t = reshard(&net, 8, &col, &col, 2);
        assert_eq!(t.time.0, 0.0);
        // A change of placement (gpus 0-3 → gpus 4-7, same split): each device sends its
        // quarter point to point.
        let a = lay(&[('b', 4)], 0, &['b', 'k'], false);
        let b = lay(&[('b', 4)], 4, &['b', 'k'], false);
        let t = reshard(&net, 8, &a, &b, 2);
        assert_eq!(t.movement, Some(TransferKind::P2p));
        assert_eq!(t.bytes, 16 * 1024 * 2);
        assert!((t.time.0 - net.p2p(Bytes(16 * 1024 * 2), false).0).abs() < 1e-12);
        // The same move across nodes (nodes of 4) is slower.
        let slow = reshard(&net, 4, &a, &b, 2);
        assert!(slow.time.0 > t.time.0);
    }

    #[test]
    fn gradients_of_replicated_inputs_are_partial_sums() {
        let m = linear();
        // Column-parallel: x replicated over n → its gradient is a partial sum over n.
        let x = TensorLayout::new(&m, &['b', 'k'], &[8, 32], &cfg(&[('n', 4)], 0), false);
        assert_eq!(x.as_gradient_source().sum_degree(), 4);
        // Sample split: x sharded, nothing to sum.
        let x = TensorLayout::new(&m, &['b', 'k'], &[8, 32], &cfg(&[('b', 4)], 0), false);
        assert_eq!(x.as_gradient_source().sum_degree(), 1);
    }

    /// Synchronised BatchNorm under a sample split all-reduces its per-channel statistics
    /// (two C-float all-reduces forward, one of 2C backward) over the split; local statistics,
    /// an unsplit BatchNorm and a channel split pay nothing; a vocabulary-split loss
    /// all-reduces each row's maximum and (sum, target logit).
    #[test]
    fn kernel_collectives_of_batch_norm_and_a_vocabulary_split_loss() {
        let mut b = parallax_ir::GraphBuilder::new("bn");
        let x = b.input("x", [16, 32, 8, 8], parallax_ir::DType::F32);
        let y = b.batch_norm("bn", x).unwrap();
        let logits = b.input("logits", [16, 1000], parallax_ir::DType::F32);
        let labels = b.input("labels", [16], parallax_ir::DType::I64);
        let loss = b
            .op1("loss", OpKind::CrossEntropy, &[logits, labels])
            .unwrap();
        let g = b.finish(&[y, loss]).unwrap();
        let p = preset("dgx-a100-80gb").unwrap();
        let mut c = OpCosts::new(&g, &p, 8, Precision::Fp32).unwrap();
        let bn = NodeId(0);
        let group = Group::strided(8, 1, 8);
        let ar = |floats: u64| {
            c.net
                .collective(Collective::AllReduce, Bytes(4 * floats), group)
        };
        let (f, bw) = c.kernel_collectives(bn, &cfg(&[('n', 8)], 0));
        assert_eq!(f, ar(32) * 2.0);
        assert_eq!(bw, ar(64));
        assert!(f.0 > 0.0);
        // Channel split: each device has whole channels' statistics.
        assert_eq!(
            c.kernel_collectives(bn, &cfg(&[('c', 8)], 0)).0,
            Seconds(0.0)
        );
        // Sample × channel: the sample group of 2 reduces a quarter of the channels.
        let (f2, _) = c.kernel_collectives(bn, &cfg(&[('n', 2), ('c', 4)], 0));
        assert_eq!(
            f2,
            c.net
                .collective(Collective::AllReduce, Bytes(4 * 8), Group::strided(2, 4, 8))
                * 2.0
        );
        assert_eq!(
            c.kernel_collectives(bn, &ParallelConfig::single(0)).0,
            Seconds(0.0)
        );
        c.batch_norm = BatchNormStats::Local;
        assert_eq!(
            c.kernel_collectives(bn, &cfg(&[('n', 8)], 0)).0,
            Seconds(0.0)
        );
        // The loss over a vocabulary split of 4: 16 maxima, then 32 sums, forward only.
        let (f, bw) = c.kernel_collectives(NodeId(1), &cfg(&[('v', 4)], 0));
        let g4 = Group::strided(4, 1, 8);
        let ar4 = |floats: u64| {
            c.net
                .collective(Collective::AllReduce, Bytes(4 * floats), g4)
        };
        assert_eq!(f, ar4(16) + ar4(32));
        assert_eq!(bw, Seconds(0.0));
    }
}
