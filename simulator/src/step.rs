//! One optimizer step of a transformer under a structured layout: costs from
//! [`parallax_cost`], the pipeline schedule as a task graph, data-parallel gradient reduction
//! and the optimizer appended, simulated event by event.
//!
//! Identical data-parallel replicas and tensor/context-parallel peers are simulated once: the
//! graph holds one pipeline (pp stages), so a 16,384-GPU plan costs what its pipeline costs.

use crate::engine::Resources;
use crate::engine::{CommKind, SimError, Task, TaskGraph, TaskKind, Trace};
use crate::schedule::{
    build_pipeline, max_in_flight, merged_fraction, passes_per_position, stage_positions,
    PipelineCosts, PipelineSchedule, ScheduleError, ScheduleKind,
};
use parallax_cost::comm::{exposed, Collective, Group, Network};
use parallax_cost::compute::DeviceModel;
use parallax_cost::memory::{
    state_bytes_per_param, workspace_gib, MemoryBreakdown, FP32_GRAD_BYTES,
    HOST_ADAM_BYTES_PER_PARAM, HOST_STREAM_EFFICIENCY, MIXED_GRAD_BYTES, MIXED_WEIGHT_BYTES,
    NVME_SWAP_IN_BYTES_PER_PARAM, NVME_SWAP_OUT_BYTES_PER_PARAM,
    OFFLOAD_GRAD_DEVICE_BYTES_PER_PARAM,
};
use parallax_cost::transformer::{
    check_layout, model_flops_per_step, transformer_costs, HostUpdate, Infeasible, PartCost,
    PipeSends, Setup, TransformerCosts,
};
use parallax_ir::{Bytes, Layout, Offload, Recompute, Seconds, GIB};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use thiserror::Error;

/// Why a step could not be simulated.
#[derive(Debug, Error)]
pub enum StepError {
    #[error(transparent)]
    Infeasible(#[from] Infeasible),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// Time of one step by where it goes, on the busiest stage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// Forward, backward and recomputation kernels.
    pub compute_s: f64,
    /// Pipeline idle time on the busiest stage.
    pub bubble_s: f64,
    /// The optimizer update.
    pub optimizer_s: f64,
    /// Host work the GPU waits for (each MoE layer's after its dispatcher's host sync).
    #[serde(default)]
    pub host_s: f64,
    /// Communication on the critical path, by kind (`tp`, `cp`, `ep`, `dp`, `zero`).
    pub exposed_comm_s: BTreeMap<String, f64>,
}

/// The kinds of exposed communication a [`Breakdown`] names (its parts list them in key order).
const COMM_KINDS: [&str; 5] = ["tp", "cp", "ep", "zero", "dp"];

impl Breakdown {
    /// Where the step goes, in a fixed order: `compute`, `bubble`, `optimizer`, `host` where
    /// there is any, then exposed communication by kind (the keys of
    /// [`Breakdown::exposed_comm_s`]).
    pub fn parts(&self) -> Vec<(&str, f64)> {
        let mut v = vec![
            ("compute", self.compute_s),
            ("bubble", self.bubble_s),
            ("optimizer", self.optimizer_s),
        ];
        if self.host_s > 0.0 {
            v.push(("host", self.host_s));
        }
        v.extend(self.exposed_comm_s.iter().map(|(k, x)| (k.as_str(), *x)));
        v
    }

    /// Exposed communication of every kind, seconds.
    pub fn exposed_comm(&self) -> f64 {
        self.exposed_comm_s.values().sum()
    }
}

/// Peak memory of one device, GiB by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryGib {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub buffers: f64,
    pub allocator: f64,
    /// The live tensors (PyTorch's `max_memory_allocated`).
    #[serde(default)]
    pub allocated: f64,
    /// What the caching allocator reserves (`max_memory_reserved`): the live tensors and the
    /// allocator's share.
    pub total: f64,
}

impl From<MemoryBreakdown> for MemoryGib {
    fn from(m: MemoryBreakdown) -> Self {
        MemoryGib {
            params: m.params.gib(),
            grads: m.grads.gib(),
            optimizer: m.optimizer.gib(),
            activations: m.activations.gib(),
            buffers: m.buffers.gib(),
            allocator: m.allocator.gib(),
            allocated: m.allocated().gib(),
            total: m.total().gib(),
        }
    }
}

/// The prediction for one step.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepPrediction {
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub hfu: f64,
    /// Idle fraction of the busiest stage's compute stream.
    pub bubble_fraction: f64,
    pub micro_batches: u64,
    /// Layers of each virtual stage, in pipeline order.
    pub stage_layers: Vec<u32>,
    pub breakdown: Breakdown,
    /// Memory of the stage with the highest peak.
    pub memory: MemoryGib,
    /// Peak memory each pipeline stage reserves, GiB.
    pub stage_memory_gib: Vec<f64>,
    /// Peak of the live tensors on the fullest stage (PyTorch's `max_memory_allocated`), GiB.
    pub peak_memory_gib: f64,
    /// Peak the caching allocator reserves there (`max_memory_reserved`), GiB: what must fit.
    pub reserved_memory_gib: f64,
    pub capacity_gib: f64,
    /// The reserved peak fits in the device.
    pub fits: bool,
}

/// A simulated step with its task graph and trace, for timelines.
#[derive(Debug)]
pub struct SimulatedStep {
    pub prediction: StepPrediction,
    pub graph: TaskGraph,
    pub resources: Resources,
    pub trace: Trace,
    /// GiB each pipeline stage holds all step long: model states and buffers.
    stage_static_gib: Vec<f64>,
    /// GiB one micro-batch keeps from the forward of each stage's chunks to its weight
    /// gradients, by stage and chunk.
    saved_gib: Vec<Vec<f64>>,
}

impl SimulatedStep {
    /// Memory of each stage over the step, `(seconds, GiB)` at every change: model states and
    /// buffers, plus each micro-batch's activations from the end of its forward to the end of
    /// its weight-gradient pass (allocator allowance not included). Built on demand from the
    /// trace: the search never needs it.
    pub fn memory_timeline(&self) -> Vec<Vec<(f64, f64)>> {
        let pp = self.stage_static_gib.len();
        let mut events: Vec<Vec<(f64, f64)>> = vec![Vec::new(); pp];
        for span in &self.trace.spans {
            let t = self.graph.task(span.task);
            let saved = self.saved_gib[t.stage as usize][t.chunk as usize];
            let delta = match t.kind {
                TaskKind::Forward => saved,
                TaskKind::BackwardWeight => -saved,
                _ => continue,
            };
            events[t.stage as usize].push((span.end.0, delta));
        }
        events
            .into_iter()
            .zip(&self.stage_static_gib)
            .map(|(mut ev, base)| {
                ev.sort_by(|a, b| a.0.total_cmp(&b.0));
                let mut level = *base;
                let mut out = vec![(0.0, level)];
                for (t, d) in ev {
                    level += d;
                    out.push((t, level.max(0.0)));
                }
                out
            })
            .collect()
    }
}

/// Layers of each of `chunks` virtual stages: the explicit ranges of the layout, else an even
/// split with the remainder given to the middle chunks first (the first holds the embedding,
/// the last the head).
pub fn stage_layers(layers: u32, l: &Layout) -> Vec<u32> {
    let chunks = l.pp * l.interleave;
    if !l.stages.is_empty() {
        return l
            .stages
            .iter()
            .map(|s| s.end_layer - s.first_layer)
            .collect();
    }
    let base = layers / chunks;
    let mut out = vec![base; chunks as usize];
    let mut extra = layers % chunks;
    let order = (1..chunks.saturating_sub(1)).chain([0, chunks - 1]);
    for vs in order {
        if extra == 0 {
            break;
        }
        out[vs as usize] += 1;
        extra -= 1;
    }
    out
}

/// Megatron-Core's split of `layers` over `chunks` (virtual) stages with the embedding, the
/// loss and `mtp` multi-token prediction modules each counted as a layer (its
/// `--account-for-embedding/loss-in-pipeline-split`, and the recipes' pipeline layouts that
/// put the modules before the loss): `per` = (layers + 2 + mtp) / chunks each, the first
/// chunk one layer short, the last `1 + mtp` short (possibly empty). `None` where that does
/// not divide or leaves the first chunk no layer.
pub fn accounted_layers(layers: u32, chunks: u32, mtp: u32) -> Option<Vec<u32>> {
    let total = layers + 2 + mtp;
    if chunks < 2 || total % chunks != 0 || total / chunks < 2.max(1 + mtp) {
        return None;
    }
    let per = total / chunks;
    let mut out = vec![per; chunks as usize];
    out[0] = per - 1;
    out[chunks as usize - 1] = per - 1 - mtp;
    Some(out)
}

/// The first layer of virtual stage `vs` (stages hold consecutive layers in order).
pub fn first_layer(layers: &[u32], vs: usize) -> u32 {
    layers[..vs].iter().sum()
}

/// The count `f` of virtual stage `vs` of `layers.len()`: of its layers, the embedding on the
/// first and the head on the last.
fn virtual_stage_count(
    c: &TransformerCosts,
    layers: &[u32],
    vs: usize,
    f: impl Fn(&PartCost) -> u64,
) -> u64 {
    let mut n = c.layers_count(first_layer(layers, vs), layers[vs], &f);
    if vs == 0 {
        n += f(&c.embedding);
    }
    if vs + 1 == layers.len() {
        n += f(&c.head);
    }
    n
}

/// The experts' parameters one device holds for virtual stage `vs` (the head's multi-token
/// prediction blocks hold experts too).
fn virtual_stage_experts(c: &TransformerCosts, layers: &[u32], vs: usize) -> u64 {
    virtual_stage_count(c, layers, vs, |p| p.expert_params)
}

/// Parameters one device holds for virtual stage `vs` of `layers.len()`.
pub fn virtual_stage_params(c: &TransformerCosts, layers: &[u32], vs: usize) -> u64 {
    virtual_stage_count(c, layers, vs, |p| p.params)
}

/// Pass costs of every virtual stage from the per-part costs: `layers[vs]` layers, the
/// embedding on the first and the head on the last, plus `per_layer` (fwd, bwd) added to each
/// layer and `per_pass` (fwd, bwd) added to each forward and input-gradient pass.
pub fn pass_costs(
    c: &TransformerCosts,
    layers: &[u32],
    per_layer: (Seconds, Seconds),
    per_pass: (Seconds, Seconds),
    (p2p, p2p_gradient): (Seconds, Seconds),
) -> PipelineCosts {
    let nv = layers.len();
    let mut costs = PipelineCosts {
        forward: vec![Seconds(0.0); nv],
        backward_input: vec![Seconds(0.0); nv],
        backward_weight: vec![Seconds(0.0); nv],
        p2p,
        p2p_gradient,
        p2p_boundaries: Vec::new(),
    };
    let mut first = 0;
    for (vs, &nl) in layers.iter().enumerate() {
        let n = f64::from(nl);
        let mut f = c.layers_sum(first, nl, PartCost::fwd) + per_layer.0 * n + per_pass.0;
        let mut b = c.layers_sum(first, nl, PartCost::bwd_input) + per_layer.1 * n + per_pass.1;
        let mut w = c.layers_sum(first, nl, PartCost::bwd_weight);
        first += nl;
        if vs == 0 {
            f += c.embedding.fwd();
            b += c.embedding.bwd_input();
            w += c.embedding.bwd_weight();
        }
        if vs + 1 == nv {
            f += c.head.fwd();
            b += c.head.bwd_input();
            w += c.head.bwd_weight();
        }
        costs.forward[vs] = f;
        costs.backward_input[vs] = b;
        costs.backward_weight[vs] = w;
    }
    costs
}

/// The virtual stages stage `s` holds under layout `l`, by chunk ([`stage_positions`]).
fn positions_of(l: &Layout, s: u32) -> Vec<usize> {
    stage_positions(ScheduleKind::of(l.schedule, l.pp), l.pp, l.interleave, s)
        .into_iter()
        .map(|vs| vs as usize)
        .collect()
}

/// Bytes one micro-batch keeps from virtual stage `vs`'s forward to its weight gradients.
fn virtual_stage_saved(c: &TransformerCosts, layers: &[u32], vs: usize) -> f64 {
    let mut b = layers_saved(c, layers, vs);
    if vs == 0 {
        b += c.embedding.saved.0 as f64;
    }
    if vs + 1 == layers.len() {
        b += c.head.saved.0 as f64;
    }
    b
}

/// Bytes the layers of virtual stage `vs` keep per micro-batch for backward (under full
/// recomputation, their checkpoints).
fn layers_saved(c: &TransformerCosts, layers: &[u32], vs: usize) -> f64 {
    c.layers_sum(first_layer(layers, vs), layers[vs], |l| l.saved.0 as f64)
}

/// Whether the stack keeps `l`'s layer checkpoints in host memory
/// ([`Runtime::checkpoints_to_host_when_offloaded`]: offloaded, under full recomputation).
fn checkpoints_on_host(setup: &Setup, l: &Layout) -> bool {
    setup.runtime.checkpoints_to_host_when_offloaded
        && l.offload != Offload::None
        && l.recompute == Recompute::Full
}

/// What of [`virtual_stage_saved`] stays on the device: all of it, but the layers'
/// checkpoints where they go to the host ([`checkpoints_on_host`]).
fn device_saved(setup: &Setup, l: &Layout, c: &TransformerCosts, layers: &[u32], vs: usize) -> f64 {
    let host = if checkpoints_on_host(setup, l) {
        layers_saved(c, layers, vs)
    } else {
        0.0
    };
    virtual_stage_saved(c, layers, vs) - host
}

/// Whether a rank's `chunks` virtual stages hold their whole gradients one after another: an
/// FSDP stack that keeps pipelined stages gathered and frees each stage's unsharded gradients
/// after its own last backward, where the schedule runs each virtual stage's backwards
/// together (interleaved 1F1B with no more micro-batches than pipeline ranks: every backward
/// of the later virtual stage comes before the earlier one's first).
fn chunks_release_grads_in_turn(setup: &Setup, l: &Layout, chunks: usize, m: u32) -> bool {
    let r = &setup.runtime;
    r.stage_grads_freed_after_own_backward
        && r.zero3_gathered_under_pp
        && l.zero_stage >= 2
        && chunks > 1
        && m <= l.pp
}

/// Peak memory of pipeline stage `s` of `l` with `layers` per virtual stage and `m`
/// micro-batches: its model states (sharded over data × context parallel ranks as ZeRO says),
/// the activations of its most micro-batches in flight, the workspace, the working buffers of
/// a layer (and of the loss on the last stage), ZeRO-3 gather buffers, and the allocator's
/// share of all that.
pub fn stage_memory_of(
    setup: &Setup,
    l: &Layout,
    c: &TransformerCosts,
    layers: &[u32],
    m: u32,
    s: u32,
) -> Result<MemoryBreakdown, ScheduleError> {
    let (pp, v) = (l.pp, l.interleave);
    let nv = (pp * v) as usize;
    let zero = setup.zero_stage(l);
    // ZeRO-3 serves its parameters from the sharded fp32 master; with that master offloaded
    // the device keeps the 16-bit shard instead (DeepSpeed's fp16 partitions).
    let states_of = |ranks: u32| {
        let (w, g, o) = state_bytes_per_param(setup.precision, zero, ranks);
        // The gradient buffers the stack keeps (`Setup::grad_buffer_bytes`).
        let g = if setup.precision.is_mixed() {
            g * setup.grad_buffer_bytes() as f64 / MIXED_GRAD_BYTES
        } else {
            g
        };
        match l.offload {
            Offload::Optimizer | Offload::OptimizerNvme
                if zero >= 3 && setup.precision.is_mixed() =>
            {
                (MIXED_WEIGHT_BYTES / f64::from(ranks.max(1)), g, o)
            }
            _ => (w, g, o),
        }
    };
    let (wb, gb, ob) = states_of(l.dp * l.cp);
    // Routed experts are replicated over their expert-data-parallel ranks only (dp × cp × tp
    // / (ep × etp), Megatron's expert data parallel group): ZeRO shards their states over
    // those.
    let (ewb, egb, eob) = states_of(l.expert_dp());
    let chunks = positions_of(l, s);
    // Each virtual stage's (dense, routed-expert) parameters, and the stage's together.
    let split = |vs: usize| {
        let e = virtual_stage_experts(c, layers, vs);
        (virtual_stage_params(c, layers, vs) - e, e)
    };
    let bytes = |(dense, experts): (u64, u64), dense_b: f64, expert_b: f64| {
        dense as f64 * dense_b + experts as f64 * expert_b
    };
    let whole = chunks.iter().fold((0, 0), |(d, e), &vs| {
        let (dv, ev) = split(vs);
        (d + dv, e + ev)
    });
    let states = |dense_b: f64, expert_b: f64| bytes(whole, dense_b, expert_b);
    let saved_per_chunk = chunks
        .iter()
        .map(|&vs| device_saved(setup, l, c, layers, vs))
        .sum::<f64>()
        / chunks.len() as f64;
    // The combined 1F1B of an overlapped expert dispatch runs one more forward ahead (DualPipe's
    // own order has it already).
    let kind = ScheduleKind::of(l.schedule, pp);
    let in_flight = (max_in_flight(kind, pp, m, v, s)?
        + u32::from(l.ep_overlap && kind != ScheduleKind::DualPipe))
    .min(m.saturating_mul(chunks.len() as u32));
    // The largest layer's transient buffers (the kinds differ in a mixture with dense layers).
    let largest = |f: &dyn Fn(&PartCost) -> u64| c.layer_kinds().map(f).max().unwrap_or(0);
    let working = largest(&|l| l.working.0);
    let mut buffers = Bytes::from_gib(workspace_gib(setup.profile)).0 as f64 + working as f64;
    if chunks.contains(&(nv - 1)) {
        buffers += c.head.working.0 as f64;
        if setup.runtime.pipeline_keeps_outputs && pp > 1 {
            // The earlier micro-batches' logits, kept for the step's merged output (the
            // current one's are in the loss's working buffers).
            buffers += f64::from(m.saturating_sub(1)) * c.head_output.0 as f64;
        }
    }
    if zero >= 3 {
        let wbytes = if setup.precision.is_mixed() { 2.0 } else { 4.0 };
        buffers += if setup.runtime.zero3.submodule_hooks() {
            // DeepSpeed gathers a submodule's weight at a time (the current one and the one
            // prefetched) and reduces each gradient as autograd hands it over, through a
            // bucket of `reduce_bucket_size` elements in the reduce type.
            let t = largest(&|l| l.largest_tensor) as f64;
            let grad = setup.grad_reduce_bytes() as f64;
            let bucket = setup.runtime.zero_config.reduce_bucket as f64;
            2.0 * t * wbytes + (t + bucket) * grad
        } else {
            // Two layers gathered (current and prefetched) plus one layer's unsharded gradient.
            let p = largest(&|l| l.params) as f64;
            2.0 * p * wbytes + p * 4.0
        };
    }
    // The flat copies the stack's optimizer makes around the step, on the device.
    if l.offload == Offload::None {
        let (dense, experts) = (whole.0 as f64, whole.1 as f64);
        // The partition it updates: ZeRO shards dense states over dp × cp, experts' over their
        // expert-data-parallel ranks (as the step's `opt_params`).
        let updated = if zero >= 1 {
            dense / f64::from((l.dp * l.cp).max(1)) + experts / f64::from(l.expert_dp().max(1))
        } else {
            dense + experts
        };
        // The largest block the forward's activations leave cached: no larger than a layer's
        // or the loss's working set.
        let cached = working.max(c.head.working.0) as f64;
        buffers += setup.runtime.optimizer_passes.transient_bytes(
            zero,
            (dense + experts, updated),
            l.dp * l.cp,
            cached,
            setup.runtime.zero_config.reduce_bucket as f64,
        );
    }
    // Offloaded states live in host memory: the optimizer's and the gradients, which go down
    // bucket by bucket as backward produces them (ZeRO-Offload), so the device holds one
    // bucket; with the parameters offloaded those too.
    let on_device = |b: f64, kept: bool| if kept { b } else { 0.0 };
    let (keep_params, keep_rest) = (!l.offload.params(), l.offload == Offload::None);
    let grads = if !keep_rest {
        let bucket =
            setup.runtime.zero_config.reduce_bucket as f64 * setup.grad_reduce_bytes() as f64;
        states(gb, egb).min(bucket)
    } else if chunks_release_grads_in_turn(setup, l, chunks.len(), m) {
        // One virtual stage's gradients at a time: the largest.
        chunks
            .iter()
            .map(|&vs| bytes(split(vs), gb, egb))
            .fold(0.0, f64::max)
    } else {
        states(gb, egb)
    };
    Ok(MemoryBreakdown {
        params: Bytes(states(on_device(wb, keep_params), on_device(ewb, keep_params)) as u64),
        grads: Bytes(grads as u64),
        optimizer: Bytes(states(on_device(ob, keep_rest), on_device(eob, keep_rest)) as u64),
        activations: Bytes((saved_per_chunk * f64::from(in_flight)) as u64),
        buffers: Bytes(buffers as u64),
        allocator: Bytes(0),
    }
    .with_allocator())
}

/// Everything a step adds to the bare pipeline for a layout: the pass costs with ZeRO-3 gathers
/// and blocking sends folded in, the exposed data-parallel gradient reduction of each virtual
/// stage (after its last weight gradient), and each stage's optimizer (Adam plus the
/// distributed optimizer's exposed parameter gather).
#[derive(Clone, Debug, PartialEq)]
pub struct StepTerms {
    pub costs: PipelineCosts,
    /// ZeRO-3 gathers (and ZeRO-2's per-micro-batch reduce-scatters) not hidden behind each
    /// layer's forward and backward.
    pub zero3: (Seconds, Seconds),
    /// Single-process DataParallel's per-micro-batch replication (forward: parameters
    /// broadcast and outputs gathered; backward: gradients reduced), on the compute stream.
    pub replicate: (Seconds, Seconds),
    /// Per virtual stage, what follows its last weight gradient before the optimizer: the
    /// data-parallel gradient reduction, and on the first and last stage the sum of a tied
    /// table's two gradients.
    pub dp: Vec<Seconds>,
    pub adam: Vec<Seconds>,
    pub param_gather: Vec<Seconds>,
}

/// Whether `l` reduce-scatters its gradients after every micro-batch rather than once a
/// step: ZeRO-2 (it keeps only a shard of the gradients) with more than one micro-batch.
fn reduces_per_micro_batch(setup: &Setup, l: &Layout) -> bool {
    let m = l.micro_batches(setup.global_batch);
    setup.zero_stage(l) == 2 && l.dp * l.cp > 1 && m > 1
}

/// Whether each virtual stage reduces its gradients over data × context parallel ranks (and
/// its experts' over their replicas) once, after its last backward: not without replicas,
/// not under ZeRO-3 or ZeRO-2 with accumulation (per layer and micro-batch instead), not
/// single-process DataParallel (onto one GPU every micro-batch).
fn reduces_at_step_end(setup: &Setup, l: &Layout) -> bool {
    (l.dp * l.cp > 1 || l.expert_dp() > 1)
        && setup.zero_stage(l) < 3
        && !setup.runtime.single_process_dp
        && !reduces_per_micro_batch(setup, l)
}

/// Devices of a node the job uses (they share the node's host).
fn devices_per_node(setup: &Setup) -> f64 {
    f64::from(setup.profile.node.gpus_per_node.min(setup.gpus).max(1))
}

/// The host side of an offloaded layout: each device's PCIe link to host memory, and its share
/// of the host's CPUs for the optimizer step (the devices of a node step at once, on the same
/// cores and through the same memory).
struct HostOffload {
    link: f64,
    /// Bytes per second the device's share of the host streams through its memory (what
    /// the host's Adam and gradient unscale are bound by).
    stream_share: f64,
    /// The device's share of the node's NVMe, read and write bytes per second, where the
    /// states live there.
    nvme: Option<(f64, f64)>,
}

impl HostOffload {
    /// `None` without offload (or on a profile without the host's figures, which
    /// `check_layout` refuses).
    fn of(setup: &Setup, l: &Layout) -> Option<HostOffload> {
        if l.offload == Offload::None {
            return None;
        }
        let node = &setup.profile.node;
        // The rate `calibrate` measured where there is one (its Adam's bytes a parameter at
        // that rate are the host's stream rate); else the host's DRAM bandwidth.
        let stream = match node.host_adam_gparams_per_s {
            Some(g) => g * 1e9 * HOST_ADAM_BYTES_PER_PARAM,
            None => node.host_memory_bandwidth()?.0 * HOST_STREAM_EFFICIENCY,
        };
        let share = devices_per_node(setup);
        let nvme = match &node.nvme {
            Some(n) if l.offload.nvme() => {
                Some((n.read_gbps * 1e9 / share, n.write_gbps * 1e9 / share))
            }
            // `check_layout` has refused NVMe offload on a profile without the node's drives.
            _ => None,
        };
        Some(HostOffload {
            link: node.host_link_bandwidth()?.0,
            stream_share: stream / share,
            nvme,
        })
    }

    /// Reading `bytes` from the device's share of the NVMe (nothing without NVMe offload).
    fn nvme_read(&self, bytes: u64) -> Seconds {
        Seconds(self.nvme.map_or(0.0, |(r, _)| bytes as f64 / r))
    }

    /// Writing `bytes` to it.
    fn nvme_write(&self, bytes: u64) -> Seconds {
        Seconds(self.nvme.map_or(0.0, |(_, w)| bytes as f64 / w))
    }

    /// Moving `bytes` over the device's host link.
    fn link(&self, bytes: u64) -> Seconds {
        Seconds(bytes as f64 / self.link)
    }

    /// Adam over `params` on the device's share of the host's CPUs, `update_bytes` a
    /// parameter, and their updated weights sent up as `up` says: where the update goes in
    /// tiles, each tile crosses the link while the next is updated (a two-stage pipeline:
    /// the slower stage throughout, the faster once).
    fn adam(&self, params: u64, update_bytes: f64, up: HostUpdate) -> Seconds {
        let update = self.stream(params, update_bytes + up.copy_bytes);
        let link = Seconds(params as f64 * up.link_bytes / self.link);
        match up.tile {
            Some(tile) => {
                let tiles = (params as f64 / tile).ceil().max(1.0);
                Seconds(update.0.max(link.0) + update.0.min(link.0) / tiles)
            }
            None => update + link,
        }
    }

    /// Streaming `bytes_per_param` of each of `params` parameters through the device's share
    /// of the host's memory.
    fn stream(&self, params: u64, bytes_per_param: f64) -> Seconds {
        Seconds(params as f64 * bytes_per_param / self.stream_share)
    }
}

/// The [`StepTerms`] of `l` with `layers` per virtual stage.
pub fn step_terms(
    setup: &Setup,
    l: &Layout,
    c: &TransformerCosts,
    layers: &[u32],
) -> Result<StepTerms, StepError> {
    let pp = l.pp;
    let net = Network::new(setup.profile);
    let dev = DeviceModel::new(setup.profile, setup.precision)
        .map_err(|e| Infeasible::Unsupported(e.to_string()))?;
    let precision = setup.precision;
    // Gradients are reduced, and ZeRO shards states, over data × context parallel ranks: they
    // hold the same parameters and see different tokens (Megatron-LM's and torchtitan's
    // data-parallel-with-CP group).
    let shard = l.dp * l.cp;
    let zero = setup.zero_stage(l);
    let dp_group = Group::strided(shard, l.tp, setup.profile.node.gpus_per_node);
    // Expert weights are replicated over the expert-data-parallel group instead: ranks etp × ep
    // apart (Megatron's expert rank order: etp, ep, edp).
    let edp = l.expert_dp();
    let edp_group = Group::strided(edp, l.ep * l.expert_tp(), setup.profile.node.gpus_per_node);
    // A collective over the dense parameters' group and one over the experts' (where the
    // experts have replicas), for `dense` and `expert` parameters' worth of `bytes_per`.
    let over_both = |kind: Collective, dense: u64, expert: u64, bytes_per: u64| {
        let mut t = net.collective(kind, Bytes(dense * bytes_per), dp_group);
        if expert > 0 && edp > 1 {
            t += net.collective(kind, Bytes(expert * bytes_per), edp_group);
        }
        t
    };
    let wbytes = if precision.is_mixed() { 2 } else { 4 };

    // ZeRO-3 gathers each layer's parameters before its forward and backward and
    // reduce-scatters its gradients, per micro-batch, prefetched behind the previous layer.
    let host = HostOffload::of(setup, l);
    // Per-layer terms below are the heaviest kind of layer's (an MoE layer's where a mixture
    // has dense layers too; ZeRO-3 and per-micro-batch ZeRO-2 are rare with experts: Megatron
    // runs FSDP without).
    let layer = c.layer();
    // Offloaded parameters: each layer's shard comes up from the host before its forward and
    // again before its backward, and its gradient shard goes down after (ZeRO-Infinity
    // prefetches them behind the previous layer, as ZeRO-3 does its gathers).
    // From NVMe a shard is read into a host buffer before it goes up. The shard goes up in
    // the precision the stack keeps it in on the host ([`HostOptimizer::param_fetch_bytes`]).
    let (fetch_fwd, fetch_bwd) = match &host {
        Some(h) if l.offload.params() => {
            let shard_params = layer.params / u64::from(shard);
            let fetched = setup
                .runtime
                .host_optimizer
                .param_fetch_bytes(wbytes as f64);
            let fetched = (shard_params as f64 * fetched) as u64;
            let up = h.nvme_read(fetched) + h.link(fetched);
            (up, up + h.link(shard_params * setup.grad_reduce_bytes()))
        }
        _ => (Seconds(0.0), Seconds(0.0)),
    };
    let zero3 = if zero >= 3 && (shard > 1 || l.offload.params()) {
        let p = layer.params;
        let engine = setup.runtime.zero3;
        // Each call moves its share of the layer and pays the collective's latency, which at
        // thousands of ranks is milliseconds.
        let calls = |kind: Collective, n: u64, bytes: u64| {
            net.collective(kind, Bytes(bytes / n), dp_group) * n as f64
        };
        let ag = calls(Collective::AllGather, engine.gathers(layer), p * wbytes);
        // Under full recomputation DeepSpeed gathers a submodule's weight for the recomputed
        // forward and keeps it for the backward only within its reuse distance.
        let regather = match engine.regathers(layer, l.recompute) {
            (0, _) => Seconds(0.0),
            (n, elems) => calls(Collective::AllGather, n, elems * wbytes),
        };
        let rs = calls(
            Collective::ReduceScatter,
            engine.reduce_scatters(layer),
            p * setup.grad_reduce_bytes(),
        );
        // The host's views of every rank's piece of every gradient tensor, on the thread that
        // launches the backward.
        let host = setup.profile.device.kernel_overhead()
            * (engine.host_dispatches_per_rank() * layer.param_tensors as f64 * f64::from(shard));
        // DeepSpeed divides each whole gradient by the ranks before reducing it: a pass over
        // the layer's gradients.
        let predivide = if engine.submodule_hooks() {
            dev.memory(2.0 * (p * setup.grad_reduce_bytes()) as f64)
        } else {
            Seconds(0.0)
        };
        let (ag, ag_bwd, rs, host) = if shard > 1 {
            (ag, ag + regather, rs, host + predivide)
        } else {
            (Seconds(0.0), Seconds(0.0), Seconds(0.0), Seconds(0.0))
        };
        if engine.blocks_compute() {
            // The gathers and reductions hold the stream; the offloaded shards' reads from the
            // host or NVMe run ahead on their own threads (ZeRO-Infinity's prefetch, §6.3).
            (
                ag + exposed(fetch_fwd, layer.fwd()),
                ag_bwd + rs + host + exposed(fetch_bwd, layer.bwd_input() + layer.bwd_weight()),
            )
        } else {
            (
                exposed(ag + fetch_fwd, layer.fwd()),
                exposed(
                    ag_bwd + rs + fetch_bwd,
                    layer.bwd_input() + layer.bwd_weight(),
                ) + host,
            )
        }
    } else if reduces_per_micro_batch(setup, l) {
        // ZeRO-2 keeps only its shard of the gradients, so it cannot accumulate whole
        // gradients over micro-batches: each micro-batch's are reduce-scattered as its
        // backward produces them (DeepSpeed stage 2 reduces every micro-step into the
        // partitioned buffer; FSDP without resharding after forward reduces every backward),
        // hidden behind the layers' backward where they can be. With one micro-batch this is
        // the end-of-step reduction below.
        let rs = net.collective(
            setup.runtime.gradient_reduction(zero),
            Bytes(layer.params * setup.grad_reduce_bytes()),
            dp_group,
        );
        (
            Seconds(0.0),
            exposed(rs, layer.bwd_input() + layer.bwd_weight()),
        )
    } else {
        (Seconds(0.0), Seconds(0.0))
    };
    // A blocking send holds the sender's stream, a separately blocking receive the
    // receiver's too ([`PipeSends`]); an overlapped one holds only its link. Forward passes
    // move activations, backward passes input gradients.
    let messages = c.p2p_messages();
    let none = (Seconds(0.0), Seconds(0.0));
    let sends = if pp == 1 {
        PipeSends::Overlapped
    } else {
        setup.runtime.pipe_sends
    };
    let (p2p_link, p2p_stream) = match sends {
        PipeSends::Overlapped => (messages, none),
        PipeSends::Paired => (none, messages),
        PipeSends::Separate => (
            none,
            (
                messages.0 + c.p2p_transfers.0,
                messages.1 + c.p2p_transfers.1,
            ),
        ),
    };
    // Single-process DataParallel (PyTorch `nn.DataParallel`, `parallel/data_parallel.py`):
    // each forward call broadcasts the module's parameters from the first GPU to the replicas
    // (`replicate` → `Broadcast`) and gathers the replicas' outputs onto it (for a language
    // model its logits); the backward of that broadcast reduces every replica's gradients onto
    // the first GPU (`ReduceAddCoalesced`) once they are all complete. Each stands between
    // computations: nothing overlaps.
    // Each virtual stage's parameters, which the replication, the accumulation pass, the
    // reductions and the optimizer below all read.
    let vs_params: Vec<u64> = (0..layers.len())
        .map(|vs| virtual_stage_params(c, layers, vs))
        .collect();
    let single_process = setup.runtime.single_process_dp && shard > 1;
    let replicate = if single_process {
        let params: u64 = vs_params.iter().sum();
        let outputs = l.micro_batch * setup.seq * setup.model.vocab * wbytes * u64::from(shard);
        let broadcast = net.collective(Collective::Broadcast, Bytes(params * wbytes), dp_group);
        let gather = net.collective(Collective::AllGather, Bytes(outputs), dp_group);
        // A reduce to one rank is the broadcast's chain run backwards: the same time.
        let reduce = net.collective(
            Collective::Broadcast,
            Bytes(params * setup.grad_reduce_bytes()),
            dp_group,
        );
        (broadcast + gather, reduce)
    } else {
        (Seconds(0.0), Seconds(0.0))
    };
    let mut costs = pass_costs(
        c,
        layers,
        zero3,
        (p2p_stream.0 + replicate.0, p2p_stream.1 + replicate.1),
        p2p_link,
    );
    // Checkpoints in host memory: each layer's goes down synchronously in forward (the stream
    // waits for the copy into pageable memory: DeepSpeed's `contiguous_data_buffers` on the
    // CPU) and comes back before its recomputation in backward (`get_full_inputs`), at no more
    // than the host link's rate (a pageable copy is slower still: not priced).
    if let Some(h) = host.as_ref().filter(|_| checkpoints_on_host(setup, l)) {
        for vs in 0..layers.len() {
            let copy = h.link(layers_saved(c, layers, vs) as u64);
            costs.forward[vs] += copy;
            costs.backward_input[vs] += copy;
        }
    }
    // Each micro-batch's weight gradients join the step's whole gradients (ZeRO 0–1; ZeRO 2–3
    // shard them as they are produced): a pass over every parameter of the virtual stage after
    // its weight gradients, where the stack does not fuse it into the weight-gradient GEMMs.
    let per_param = setup.runtime.wgrad_accumulation.bytes_per_param(
        setup.float_bytes(),
        setup.grad_reduce_bytes(),
        l.micro_batches(setup.global_batch),
    );
    if zero <= 1 && per_param > 0.0 {
        for (w, &p) in costs.backward_weight.iter_mut().zip(&vs_params) {
            *w += dev.memory(p as f64 * per_param);
        }
    }

    let step_end_reduction = reduces_at_step_end(setup, l);
    // ZeRO-Offload: each gradient of the rank's partition leaves for the host's fp32 buffer as
    // its bucket is reduced, cast to fp32 on the device after ZeRO-1/2's checks
    // (`copy_grads_in_partition` → `async_inplace_copy_grad_to_fp32_buffer_from_gpu`, stage2.py
    // in 0.3 as stage_1_and_2.py today; stage 3 copies its reduce-scattered partition): on the
    // reduction's stream, behind the backward only where the stack overlaps the reduction.
    // With the parameters offloaded the gradients go down layer by layer instead (above).
    let grads_to_host = host.is_some() && !l.offload.params();
    let grads_down = |params: u64, experts: u64| match &host {
        Some(h) if grads_to_host => {
            let part = (params - experts) / u64::from(shard) + experts / u64::from(edp);
            let checks = if zero < 3 {
                dev.memory(part as f64 * OFFLOAD_GRAD_DEVICE_BYTES_PER_PARAM)
            } else {
                Seconds(0.0)
            };
            checks + h.link(part * FP32_GRAD_BYTES as u64)
        }
        _ => Seconds(0.0),
    };
    let mut dp = vec![Seconds(0.0); layers.len()];
    let mut adam = vec![Seconds(0.0); pp as usize];
    let mut param_gather = vec![Seconds(0.0); pp as usize];
    for s in 0..pp {
        let (mut stage_params, mut stage_experts) = (0u64, 0u64);
        for vs in positions_of(l, s) {
            let p = vs_params[vs];
            let experts = virtual_stage_experts(c, layers, vs);
            stage_params += p;
            stage_experts += experts;
            if !step_end_reduction && !grads_to_host {
                continue;
            }
            // Of `params`, `experts` are the experts' (reduced over their own replicas).
            let reduce = |params: u64, experts: u64| {
                let kind = setup.runtime.gradient_reduction(zero);
                let collective = if step_end_reduction {
                    over_both(kind, params - experts, experts, setup.grad_reduce_bytes())
                } else {
                    Seconds(0.0)
                };
                collective + grads_down(params, experts)
            };
            dp[vs] = if setup.runtime.overlap_grad_reduce {
                // Gradients become ready in reverse layer order. The last bucket holds the
                // chunk's first layer and, on the first stage, the embedding table, whose
                // gradient is complete only after the final op of backward (a tied table
                // also collects the head's share first): that bucket cannot hide. The rest
                // hides behind the remaining layers' backward, with interference.
                let n = f64::from(layers[vs].max(1));
                let window =
                    (costs.backward_input[vs] + costs.backward_weight[vs]) * ((n - 1.0) / n);
                let (mut last, last_experts) = if layers[vs] > 0 {
                    let l = c.layer_at(first_layer(layers, vs));
                    (l.params, l.expert_params)
                } else {
                    (0, 0)
                };
                if vs == 0 {
                    last += c.embedding.params;
                }
                exposed(reduce(p - last, experts - last_experts), window)
                    + reduce(last, last_experts)
            } else {
                reduce(p, experts)
            };
        }
        let stage_dense = stage_params - stage_experts;
        let opt_params = if zero >= 1 {
            stage_dense / u64::from(shard) + stage_experts / u64::from(edp)
        } else {
            stage_params
        };
        // The stack's optimizer walks the gradients ([`OptimizerPasses`]): its per-tensor
        // checks read back to the host, on the device wherever the states live.
        let passes = setup.runtime.optimizer_passes.step(zero);
        let syncs = if passes.syncs_per_held_tensor + passes.syncs_per_updated_tensor > 0.0 {
            let tensors: u64 = positions_of(l, s)
                .into_iter()
                .map(|vs| virtual_stage_count(c, layers, vs, |p| p.param_tensors))
                .sum();
            let updated = tensors as f64 * opt_params as f64 / stage_params.max(1) as f64;
            dev.host_synced(
                tensors as f64 * passes.syncs_per_held_tensor
                    + updated * passes.syncs_per_updated_tensor,
            )
        } else {
            Seconds(0.0)
        };
        adam[s as usize] = syncs
            + match &host {
                // ZeRO-Offload: the fp32 gradient partition, down since the reduction, is
                // unscaled in host memory, the CPUs step and the updated weights go up as the
                // stack sends them ([`HostOptimizer::weights_up`]); with the parameters
                // offloaded the copy the device fetches is written where they live (back to NVMe
                // where they live on it). ZeRO-Infinity's NVMe optimizer swaps the states and
                // the gradient in before the step and the states out after it, one after the
                // other.
                Some(h) => {
                    let cpu = setup.runtime.host_optimizer;
                    let up = cpu.weights_up(l.offload.params(), wbytes as f64);
                    let write_back = if l.offload == Offload::ParamsNvme {
                        h.nvme_write(opt_params * wbytes)
                    } else {
                        Seconds(0.0)
                    };
                    let swap = h.nvme_read(opt_params * NVME_SWAP_IN_BYTES_PER_PARAM)
                        + h.nvme_write(opt_params * NVME_SWAP_OUT_BYTES_PER_PARAM);
                    swap + h.stream(opt_params, cpu.gradient_bytes())
                        + h.adam(opt_params, cpu.update_bytes(), up)
                        + write_back
                }
                // On the device: the update of its partition and what the optimizer does to
                // every gradient it holds.
                None => dev.memory(
                    opt_params as f64 * passes.per_updated + stage_params as f64 * passes.per_held,
                ),
            };
        if (1..3).contains(&zero) && (shard > 1 || edp > 1) {
            // Distributed optimizer: gather the updated 16-bit parameters. With overlapped
            // gathers (Megatron-Core `--overlap-param-gather`) each bucket is fetched just
            // before the next step's first forward needs it.
            let ag = over_both(Collective::AllGather, stage_dense, stage_experts, wbytes);
            let first_forward: Seconds = positions_of(l, s)
                .into_iter()
                .map(|vs| costs.forward[vs])
                .sum();
            param_gather[s as usize] = if setup.runtime.overlap_grad_reduce {
                exposed(ag, first_forward)
            } else {
                ag
            };
        }
        if zero >= 3 && shard > 1 {
            // The small collectives the stack runs after its step
            // ([`Zero3Engine::gathers_after_step`]): a hidden-wide buffer each, at the ring's
            // latency.
            let engine = setup.runtime.zero3;
            let small: u64 = positions_of(l, s)
                .into_iter()
                .map(|vs| virtual_stage_count(c, layers, vs, |p| engine.gathers_after_step(p)))
                .sum();
            if small > 0 {
                let one = net.collective(
                    Collective::AllGather,
                    Bytes(setup.model.hidden * wbytes),
                    dp_group,
                );
                param_gather[s as usize] += one * small as f64;
            }
        }
    }
    // A tied table lives on the first stage (the embedding) and the last (the head's copy):
    // after backward, before the optimizer, each pair of ranks holding it sums their two
    // gradients of the word table (Megatron-LM's embedding group,
    // `_allreduce_word_embedding_grads`, after the data-parallel reduction; DeepSpeed's
    // pipeline engine, `_exec_reduce_tied_grads`). Nothing overlaps it, and the two stages
    // usually sit on different nodes.
    if c.tied_table > 0 {
        let stage_stride = l.tp * l.cp * l.dp;
        let pair = Group::strided(2, stage_stride * (pp - 1), setup.profile.node.gpus_per_node);
        let sync = net.collective(
            Collective::AllReduce,
            Bytes(c.tied_table * setup.grad_reduce_bytes()),
            pair,
        );
        let last = layers.len() - 1;
        dp[0] += sync;
        dp[last] += sync;
    }
    Ok(StepTerms {
        costs,
        zero3,
        replicate,
        dp,
        adam,
        param_gather,
    })
}

/// Simulates one step of `setup`'s model under `layout`.
pub fn simulate_step(setup: &Setup, layout: &Layout) -> Result<SimulatedStep, StepError> {
    simulate_step_with_flops(setup, layout, model_flops_per_step(setup)?)
}

/// [`simulate_step`] with the model FLOPs of one step ([`model_flops_per_step`], which does not
/// depend on the layout) given, for callers that simulate many layouts of one setup.
pub fn simulate_step_with_flops(
    setup: &Setup,
    layout: &Layout,
    model_flops: f64,
) -> Result<SimulatedStep, StepError> {
    // `transformer_costs` checks the layout.
    simulate_costed(
        setup,
        layout,
        &transformer_costs(setup, layout)?,
        model_flops,
    )
}

/// [`simulate_step_with_flops`] with the layout's costs given: `c` must be what
/// [`transformer_costs`] returns for `layout` (the search prices each group of layouts that
/// share them once). The layout is still checked against the setup.
pub fn simulate_priced(
    setup: &Setup,
    layout: &Layout,
    c: &TransformerCosts,
    model_flops: f64,
) -> Result<SimulatedStep, StepError> {
    check_layout(setup, layout)?;
    simulate_costed(setup, layout, c, model_flops)
}

/// Offloaded states must fit where they go, the node's host memory or its NVMe: per device,
/// its shard's optimizer states and fp32 gradient buffer (and with the parameters offloaded,
/// their 16-bit copy), times the node's devices.
fn check_host_memory(setup: &Setup, l: &Layout, c: &TransformerCosts) -> Result<(), StepError> {
    if l.offload == Offload::None {
        return Ok(());
    }
    let node = &setup.profile.node;
    // `check_layout` has refused offload on a profile without the host's figures or drives.
    let (have_gib, place) = if l.offload.nvme() {
        (node.nvme.as_ref().map(|n| n.gib), "NVMe space")
    } else {
        (node.host_memory_gib, "host memory")
    };
    let Some(have_gib) = have_gib else {
        return Ok(());
    };
    let params = c.model_params(setup.model.layers) as f64 / f64::from(l.pp);
    let shard = if setup.zero_stage(l) >= 1 {
        f64::from((l.dp * l.cp).max(1))
    } else {
        1.0
    };
    let (w, _, o) = state_bytes_per_param(setup.precision, 0, 1);
    let mut per_param = o + FP32_GRAD_BYTES;
    if l.offload.params() {
        per_param += w;
    }
    let need_gib = params / shard * per_param * devices_per_node(setup) / GIB;
    if need_gib > have_gib {
        return Err(Infeasible::Unsupported(format!(
            "offload {}: {need_gib:.0} GiB of {place} per node needed, the node has {have_gib:.0} GiB",
            l.offload
        ))
        .into());
    }
    Ok(())
}

/// [`simulate_priced`] of a layout already checked.
fn simulate_costed(
    setup: &Setup,
    layout: &Layout,
    c: &TransformerCosts,
    model_flops: f64,
) -> Result<SimulatedStep, StepError> {
    if let Some(why) = layout.offload.conflict(setup.zero_stage(layout)) {
        return Err(Infeasible::Unsupported(why).into());
    }
    check_host_memory(setup, layout, c)?;
    let l = layout;
    let (pp, v) = (l.pp, l.interleave);
    let m = l.micro_batches(setup.global_batch) as u32;
    if let Some(why) = l.ep_overlap.then(|| l.ep_overlap_conflict()).flatten() {
        return Err(Infeasible::Unsupported(why).into());
    }
    let overlapped;
    let c = if l.merges_passes() {
        overlapped = c.ep_overlapped(merged_fraction(ScheduleKind::of(l.schedule, pp), pp, m, v));
        &overlapped
    } else {
        c
    };
    let layers = stage_layers(setup.model.layers, l);
    let precision = setup.precision;
    let zero = setup.zero_stage(l);
    let terms = step_terms(setup, l, c, &layers)?;
    let (z3_fwd, z3_bwd) = terms.zero3;
    let kind = ScheduleKind::of(l.schedule, l.pp);
    let schedule = PipelineSchedule::generate(kind, pp, m, v)?;
    let mut pg = build_pipeline(&schedule, &terms.costs)?;

    // Data-parallel gradient reduction per chunk, then the optimizer, per stage.
    let mut opt_task = vec![Seconds(0.0); pp as usize];
    // Each stage's optimizer, and its last backward task.
    let mut opt_ids = Vec::with_capacity(pp as usize);
    let step_end_reduction = reduces_at_step_end(setup, l);
    let adam_time = &terms.adam;
    for s in 0..pp {
        let comm = pg
            .resources
            .add_in_group(format!("stage {s} dp comm"), 1, s);
        let mut last = Vec::new();
        // A stack that reduces after the step's backward, not overlapped with it (Megatron-LM
        // before `--overlap-grad-reduce`: `allreduce_gradients` once the pipeline schedule has
        // returned), starts every chunk's reduction after the stage's last backward; one that
        // overlaps starts a chunk's once its own last backward is done.
        let stage_end = pg.last_weight_grad(s, None);
        let after_stage = step_end_reduction && !setup.runtime.overlap_grad_reduce;
        for (chunk, vs) in positions_of(l, s).into_iter().enumerate() {
            let chunk = chunk as u32;
            let Some(chunk_end) = pg.last_weight_grad(s, Some(chunk)) else {
                continue;
            };
            let after = match stage_end {
                Some(end) if after_stage => end,
                _ => chunk_end,
            };
            // Without a step-end reduction a chunk may still sum a tied table's gradient with
            // another stage's ([`step_terms`]).
            if !step_end_reduction && terms.dp[vs].0 <= 0.0 {
                last.push(after);
                continue;
            }
            let t = pg.add_task(
                Task::new(
                    "dp-grad",
                    TaskKind::Comm(
                        if !step_end_reduction
                            || setup.runtime.gradient_reduction(zero) == Collective::AllReduce
                        {
                            CommKind::DpAllReduce
                        } else {
                            CommKind::DpReduceScatter
                        },
                    ),
                    comm,
                )
                .at(s, m.saturating_sub(1), chunk),
                terms.dp[vs],
            );
            pg.graph.add_data(after, t);
            last.push(t);
        }
        let opt = terms.adam[s as usize] + terms.param_gather[s as usize];
        opt_task[s as usize] = opt;
        let t = pg.add_task(
            Task::new("optimizer", TaskKind::Optimizer, pg.compute[s as usize]).at(s, 0, 0),
            opt,
        );
        for a in last {
            pg.graph.add_data(a, t);
        }
        let last_backward = pg.last_weight_grad(s, None);
        if let Some(after) = last_backward {
            pg.graph.add_schedule(after, t);
        }
        opt_ids.push((t, last_backward));
    }
    let trace = pg.simulate()?;
    let step = trace.makespan.0;

    // Busiest stage and its breakdown.
    let busy = trace.busy_time(&pg.resources);
    let (bs, b_busy) = pg
        .compute
        .iter()
        .enumerate()
        .map(|(s, r)| (s, busy[r.index()].0 - opt_task[s].0))
        .fold((0, f64::MIN), |a, b| if b.1 > a.1 { b } else { a });
    let passes = f64::from(passes_per_position(kind, m));
    let per_mb_stage = |f: &dyn Fn(usize) -> f64| -> f64 {
        positions_of(l, bs as u32).into_iter().map(f).sum::<f64>() * passes
    };
    // The sum of `f` over virtual stage `vs`'s layers.
    let over = |vs: usize, f: &dyn Fn(&PartCost) -> f64| {
        c.layers_sum(first_layer(&layers, vs), layers[vs], f)
    };
    let nl = |vs: usize| f64::from(layers[vs]);
    // The stage's compute stream waits for its gradient reductions between its last backward
    // and its optimizer (the reductions of earlier chunks ran beside later compute): that
    // wait is the exposed data-parallel time; the distributed optimizer's parameter gather is
    // part of the optimizer task and counted with it.
    let (opt_id, last_backward) = opt_ids[bs];
    let last_compute_end = last_backward.map_or(0.0, |t| trace.span(t).end.0);
    let dp_wait = (trace.span(opt_id).start.0 - last_compute_end).max(0.0);
    let dp_exposed = dp_wait + terms.param_gather[bs].0;
    let mut exposed = BTreeMap::new();
    let tp = per_mb_stage(&|vs| over(vs, &|l| (l.tp_fwd + l.tp_bwd).0))
        + if bs == 0 {
            f64::from(m) * (c.embedding.tp_fwd + c.embedding.tp_bwd).0
        } else {
            0.0
        }
        + if bs == pp as usize - 1 {
            f64::from(m) * (c.head.tp_fwd + c.head.tp_bwd).0
        } else {
            0.0
        };
    let cp = per_mb_stage(&|vs| over(vs, &|l| (l.cp_fwd + l.cp_bwd).0));
    let ep = per_mb_stage(&|vs| over(vs, &|l| (l.ep_fwd + l.ep_bwd).0));
    let host = per_mb_stage(&|vs| over(vs, &|l| (l.host_fwd + l.host_bwd).0));
    let z3 = per_mb_stage(&|vs| nl(vs) * (z3_fwd + z3_bwd).0);
    let replicate = per_mb_stage(&|_| (terms.replicate.0 + terms.replicate.1).0);
    for (k, x) in COMM_KINDS
        .into_iter()
        .zip([tp, cp, ep, z3, dp_exposed + replicate])
    {
        if x > 0.0 {
            exposed.insert(k.to_string(), x);
        }
    }
    let compute = b_busy - tp - cp - ep - z3 - replicate - host;
    // Whatever else the stage's compute stream spends idle is pipeline bubble (warm-up,
    // cool-down, waiting for other stages). Clamp rounding noise of the subtraction to zero.
    let bubble = match step - b_busy - opt_task[bs].0 - dp_wait {
        x if x > 1e-9 * step => x,
        _ => 0.0,
    };

    let layers_all = setup.model.layers;
    let recompute_share = c.layers_sum(0, layers_all, |l| l.hardware_flops)
        / c.layers_sum(0, layers_all, |l| l.model_flops).max(1.0);
    let gpus = f64::from(setup.gpus);
    let peak = setup
        .profile
        .peak_flops(precision)
        .map_err(|e| Infeasible::Unsupported(e.to_string()))?;
    let mfu = model_flops / (step * gpus * peak);
    let hfu = mfu * recompute_share;

    // Memory per stage.
    let mut stage_memory = Vec::with_capacity(pp as usize);
    let mut stage_static = Vec::with_capacity(pp as usize);
    let mut worst = MemoryBreakdown::default();
    for s in 0..pp {
        let mem = stage_memory_of(setup, l, c, &layers, m, s)?;
        stage_static.push((mem.params + mem.grads + mem.optimizer + mem.buffers).gib());
        if mem.total() > worst.total() {
            worst = mem;
        }
        stage_memory.push(mem.total().gib());
    }
    let capacity = setup.profile.device.hbm_gib;
    let reserved_gib = worst.total().gib();
    let tokens = setup.global_batch as f64 * setup.seq as f64;
    let prediction = StepPrediction {
        step_time_s: step,
        tokens_per_s: tokens / step,
        mfu,
        hfu,
        bubble_fraction: if step > 0.0 { bubble / step } else { 0.0 },
        micro_batches: u64::from(m),
        stage_layers: layers.clone(),
        breakdown: Breakdown {
            compute_s: compute,
            bubble_s: bubble,
            optimizer_s: adam_time[bs].0,
            host_s: host,
            exposed_comm_s: exposed,
        },
        memory: worst.into(),
        stage_memory_gib: stage_memory,
        peak_memory_gib: worst.allocated().gib(),
        reserved_memory_gib: reserved_gib,
        capacity_gib: capacity,
        fits: reserved_gib <= capacity,
    };
    Ok(SimulatedStep {
        prediction,
        graph: pg.graph,
        resources: pg.resources,
        trace,
        stage_static_gib: stage_static,
        saved_gib: (0..pp)
            .map(|s| {
                positions_of(l, s)
                    .into_iter()
                    .map(|vs| device_saved(setup, l, c, &layers, vs) / GIB)
                    .collect()
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_cost::transformer::{
        CrossEntropy, HostOptimizer, OptimizerPasses, PipeMessages, Runtime, WgradAccumulation,
        Zero3Engine, ZeroConfig,
    };
    use parallax_hardware::{preset, ClusterProfile};
    use parallax_ir::models::{zoo, TransformerConfig};
    use parallax_ir::Schedule;
    use parallax_ir::{Precision, Recompute};

    fn gpt3() -> TransformerConfig {
        zoo::transformer("gpt3-175b").unwrap()
    }

    fn setup<'a>(
        m: &'a TransformerConfig,
        p: &'a ClusterProfile,
        gpus: u32,
        batch: u64,
    ) -> Setup<'a> {
        Setup::new(m, p, gpus, 2048, batch)
    }

    /// `base` under ZeRO-3 engine `zero3`.
    fn with_zero3(base: Setup, zero3: Zero3Engine) -> Setup {
        Setup {
            runtime: Runtime {
                zero3,
                ..base.runtime
            },
            ..base
        }
    }

    /// `base` under a stack whose FSDP keeps pipelined stages gathered (torchtitan's).
    fn gathered_under_pp(base: Setup) -> Setup {
        Setup {
            runtime: Runtime {
                zero3_gathered_under_pp: true,
                ..Runtime::default()
            },
            ..base
        }
    }

    fn megatron_175b(schedule: Schedule, v: u32) -> Layout {
        Layout {
            dp: 16,
            tp: 8,
            pp: 8,
            micro_batch: 1,
            zero_stage: 1,
            recompute: Recompute::Selective,
            sequence_parallel: true,
            schedule,
            interleave: v,
            ..Layout::default()
        }
    }

    /// The breakdown describes the busiest stage's step: its parts add up to the step time
    /// for any layout (interleaved, ZeRO, overlapped or not), and a pipeline has a bubble.
    #[test]
    fn the_breakdown_adds_up_to_the_step() {
        use proptest::prelude::*;
        let m = zoo::transformer("llama3-8b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let layouts = (
            prop::sample::select(vec![1u32, 2, 4]),
            prop::sample::select(vec![1u32, 2, 4]),
            prop::sample::select(vec![1u32, 2, 4]),
            0u8..4,
            prop::sample::select(vec![1u32, 2, 4, 8]),
            any::<bool>(),
            prop::sample::select(vec![Recompute::None, Recompute::Selective, Recompute::Full]),
        );
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        runner
            .run(&layouts, |(tp, pp, v, zero, m_per, overlap, recompute)| {
                let dp = 64 / (tp * pp);
                let l = Layout {
                    dp,
                    tp,
                    pp,
                    micro_batch: 1,
                    zero_stage: zero,
                    recompute,
                    sequence_parallel: tp > 1,
                    schedule: match (pp, v) {
                        (1, _) => Schedule::None,
                        (_, 1) => Schedule::OneFOneB,
                        _ => Schedule::Interleaved1F1B,
                    },
                    interleave: if pp > 1 { v } else { 1 },
                    ..Layout::default()
                };
                let batch = u64::from(dp) * u64::from(pp * m_per);
                let s = Setup {
                    runtime: Runtime {
                        overlap_grad_reduce: overlap,
                        ..Runtime::default()
                    },
                    ..Setup::new(&m, &p, 64, 4096, batch)
                };
                let Ok(r) = simulate_step(&s, &l) else {
                    return Ok(());
                };
                let pr = &r.prediction;
                let sum: f64 = pr.breakdown.parts().iter().map(|(_, x)| x).sum();
                prop_assert!(
                    (sum - pr.step_time_s).abs() <= 1e-6 * pr.step_time_s,
                    "{l:?}: parts {:?} sum {sum} vs step {}",
                    pr.breakdown.parts(),
                    pr.step_time_s
                );
                prop_assert!(pr.breakdown.parts().iter().all(|(_, x)| *x >= 0.0));
                if pp > 1 {
                    prop_assert!(pr.breakdown.bubble_s > 0.0, "{l:?}: no bubble");
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn gpt3_175b_on_1024_a100_is_plausible() {
        let (m, p) = (gpt3(), preset("dgx-a100-80gb").unwrap());
        let s = setup(&m, &p, 1024, 1536);
        let r = simulate_step(&s, &megatron_175b(Schedule::Interleaved1F1B, 2)).unwrap();
        let pr = &r.prediction;
        assert!(pr.fits, "{pr:?}");
        assert!((0.3..0.8).contains(&pr.mfu), "MFU {}", pr.mfu);
        assert_eq!(pr.micro_batches, 96);
        assert_eq!(pr.stage_layers, vec![6; 16]);
        // Every time category is non-negative and the parts never exceed the step.
        let b = &pr.breakdown;
        let parts =
            b.compute_s + b.bubble_s + b.optimizer_s + b.exposed_comm_s.values().sum::<f64>();
        assert!(b.compute_s > 0.0 && b.bubble_s >= 0.0 && b.optimizer_s >= 0.0);
        assert!(
            parts <= pr.step_time_s * 1.0001,
            "{parts} > {}",
            pr.step_time_s
        );
        assert!(pr.memory.total >= pr.memory.params + pr.memory.activations);
        // The allocator reserves more than the live tensors; the reserve is what must fit.
        assert_eq!(pr.peak_memory_gib, pr.memory.allocated);
        assert_eq!(pr.reserved_memory_gib, pr.memory.total);
        assert!(pr.peak_memory_gib < pr.reserved_memory_gib);
        assert!(pr.reserved_memory_gib <= pr.capacity_gib);
    }

    #[test]
    fn memory_over_time_rises_with_forwards_and_returns() {
        let (m, p) = (gpt3(), preset("dgx-a100-80gb").unwrap());
        let s = setup(&m, &p, 1024, 1536);
        let r = simulate_step(&s, &megatron_175b(Schedule::OneFOneB, 1)).unwrap();
        let timeline = r.memory_timeline();
        assert_eq!(timeline.len(), 8);
        for (stage, tl) in timeline.iter().enumerate() {
            let start = tl[0].1;
            let peak = tl.iter().map(|x| x.1).fold(0.0, f64::max);
            let end = tl.last().unwrap().1;
            assert!(
                (end - start).abs() < 1e-6,
                "stage {stage} ends at {end}, started {start}"
            );
            assert!(peak > start);
            // The timeline's peak is the live part of the reported peak (allocator excluded).
            let reported = r.prediction.stage_memory_gib[stage];
            assert!(peak <= reported + 1e-6, "{peak} > {reported}");
            assert!(tl.windows(2).all(|w| w[0].0 <= w[1].0));
        }
        // 1F1B: stage 0 holds pp micro-batches at its peak, the last stage one.
        let rise =
            |s: usize| timeline[s].iter().map(|x| x.1).fold(0.0, f64::max) - timeline[s][0].1;
        assert!(rise(0) > 7.5 * rise(7), "{} vs {}", rise(0), rise(7));
    }

    #[test]
    fn schedules_order_as_their_bubbles_say() {
        let (m, p) = (gpt3(), preset("dgx-a100-80gb").unwrap());
        let s = setup(&m, &p, 1024, 1536);
        let t = |sch, v| {
            simulate_step(&s, &megatron_175b(sch, v))
                .unwrap()
                .prediction
        };
        let (gpipe, ofob, inter, zb) = (
            t(Schedule::GPipe, 1),
            t(Schedule::OneFOneB, 1),
            t(Schedule::Interleaved1F1B, 2),
            t(Schedule::ZeroBubbleH1, 1),
        );
        // GPipe and 1F1B share the bubble; 1F1B holds fewer activations.
        assert!((gpipe.step_time_s - ofob.step_time_s).abs() < 0.01 * ofob.step_time_s);
        assert!(gpipe.peak_memory_gib > ofob.peak_memory_gib);
        assert!(inter.bubble_fraction < ofob.bubble_fraction);
        assert!(zb.step_time_s < ofob.step_time_s);
        // Bubble of 1F1B ≈ (p − 1) / (m + p − 1) when communication is cheap.
        let expect = 7.0 / (96.0 + 7.0);
        assert!(
            (ofob.bubble_fraction - expect).abs() < 0.03,
            "{} vs {expect}",
            ofob.bubble_fraction
        );
    }

    #[test]
    fn more_recompute_keeps_less_and_costs_more() {
        let (m, p) = (gpt3(), preset("dgx-a100-80gb").unwrap());
        let s = setup(&m, &p, 1024, 1536);
        let run = |r| {
            let l = Layout {
                recompute: r,
                ..megatron_175b(Schedule::OneFOneB, 1)
            };
            simulate_step(&s, &l).unwrap().prediction
        };
        let (none, sel, full) = (
            run(Recompute::None),
            run(Recompute::Selective),
            run(Recompute::Full),
        );
        assert!(none.memory.activations >= sel.memory.activations);
        assert!(sel.memory.activations >= full.memory.activations);
        assert!(full.step_time_s > sel.step_time_s && sel.step_time_s >= none.step_time_s);
        assert!(full.hfu > full.mfu);
    }

    /// torchtitan's pipelined FSDP (late 2024): each looped stage frees its unsharded gradients
    /// after its own last backward, so with no more micro-batches than pipeline ranks a rank's
    /// two stages hold whole gradients one at a time; and the last stage keeps every
    /// micro-batch's logits for the step's merged output.
    #[test]
    fn looped_stages_free_their_gradients_in_turn_and_the_last_keeps_its_outputs() {
        let (m, p) = (gpt3(), preset("dgx-a100-80gb").unwrap());
        let base = setup(&m, &p, 1024, 1536);
        let kept = gathered_under_pp(base);
        let titan = Setup {
            runtime: Runtime {
                stage_grads_freed_after_own_backward: true,
                pipeline_keeps_outputs: true,
                ..kept.runtime
            },
            ..base
        };
        let l = Layout {
            zero_stage: 3,
            ..megatron_175b(Schedule::Interleaved1F1B, 2)
        };
        let layers = vec![6; 16];
        let mem = |s: &Setup, micro: u32, stage: u32| {
            let c = transformer_costs(s, &l).unwrap();
            stage_memory_of(s, &l, &c, &layers, micro, stage).unwrap()
        };
        // A middle rank's two stages of six layers: one stage's gradients at m = pp; both once
        // the backwards of the two interleave (m = 2 pp) or under a stack that reduces at the end.
        let (whole, in_turn) = (mem(&kept, 8, 3).grads.0, mem(&titan, 8, 3).grads.0);
        assert!(in_turn > 0 && whole == 2 * in_turn, "{whole} vs {in_turn}");
        assert_eq!(mem(&titan, 16, 3).grads.0, mem(&kept, 16, 3).grads.0);
        // The last rank keeps seven earlier micro-batches' logits (the eighth's are the loss's).
        let out = transformer_costs(&titan, &l).unwrap().head_output.0;
        // One sequence of 2,048 tokens over an eighth of the vocabulary, in 16 bits.
        let per_token = out / 2 / 2048;
        assert_eq!(out, 2 * 2048 * per_token);
        assert!(
            (50257 / 8..50257 / 8 + 128).contains(&per_token),
            "{per_token}"
        );
        let extra = mem(&titan, 8, 7).buffers.0 - mem(&kept, 8, 7).buffers.0;
        assert_eq!(extra, 7 * out);
        assert_eq!(mem(&titan, 8, 3).buffers, mem(&kept, 8, 3).buffers);
    }

    #[test]
    fn zero3_kept_gathered_under_pp_runs_as_the_distributed_optimizer() {
        // torchtitan's FSDP on a pipelined model: parameters stay gathered and gradients
        // accumulate unsharded across micro-batches, so the stage holds whole 16-bit weights
        // and fp32 gradients, shards only the optimizer, and gathers nothing per micro-batch.
        let (m, p) = (gpt3(), preset("dgx-a100-80gb").unwrap());
        let base = setup(&m, &p, 1024, 1536);
        let kept = gathered_under_pp(base);
        let with_zero = |z| Layout {
            zero_stage: z,
            ..megatron_175b(Schedule::OneFOneB, 1)
        };
        let run = |s: &Setup, z| simulate_step(s, &with_zero(z)).unwrap().prediction;
        let (sharded, gathered, zero1) = (run(&base, 3), run(&kept, 3), run(&base, 1));
        assert_eq!(gathered.memory, zero1.memory);
        assert_eq!(gathered.step_time_s, zero1.step_time_s);
        assert!(gathered.memory.params > 0.0 && sharded.memory.params == 0.0);
        assert!(gathered.peak_memory_gib > sharded.peak_memory_gib);
        // ZeRO-3 reduces every micro-batch: after the last backward only the tied table's
        // sum between the first and the last stage remains (no more than its all-reduce).
        let table = transformer_costs(&base, &with_zero(3)).unwrap().tied_table;
        let l = with_zero(3);
        let pair = Group::strided(2, l.tp * l.dp * (l.pp - 1), 8);
        let sync = Network::new(&p).collective(
            Collective::AllReduce,
            Bytes(table * base.grad_reduce_bytes()),
            pair,
        );
        let tail = sharded
            .breakdown
            .exposed_comm_s
            .get("dp")
            .copied()
            .unwrap_or(0.0);
        assert!(
            tail > 0.0 && tail <= sync.0 * (1.0 + 1e-9),
            "{tail} vs {sync:?}"
        );
        // Without pipeline parallelism the runtime flag changes nothing.
        let flat = Layout {
            pp: 1,
            dp: 128,
            schedule: Schedule::None,
            ..with_zero(3)
        };
        let t = |s: &Setup| simulate_step(s, &flat).unwrap().prediction;
        assert_eq!(t(&base).step_time_s, t(&kept).step_time_s);
        assert_eq!(t(&base).memory, t(&kept).memory);
    }

    #[test]
    fn an_unfused_gradient_accumulation_costs_a_pass_over_the_parameters_a_micro_batch() {
        // GPT-3 1.3B on one A100, 8 micro-batches of one sequence, ZeRO 0: a stack whose hook
        // adds each 16-bit weight gradient into an fp32 buffer (Megatron-LM 2021) moves
        // 2 + 4 + 4 bytes a parameter every micro-batch; autograd's in-place sum (16-bit
        // buffers) 3 × 2 on every micro-batch but the first; a fused GEMM nothing. Nothing
        // overlaps a single stage's compute, so the step grows by exactly that traffic.
        let m = zoo::transformer("gpt3-1.3b").unwrap();
        let p = preset("dgx-a100-80gb").unwrap();
        let l = Layout {
            micro_batch: 1,
            recompute: Recompute::None,
            ..Layout::default()
        };
        let with = |a: WgradAccumulation, grad_reduce_fp32: bool| Setup {
            runtime: Runtime {
                wgrad_accumulation: a,
                grad_reduce_fp32,
                ..Runtime::default()
            },
            ..setup(&m, &p, 1, 8)
        };
        let step = |s: &Setup| simulate_step(s, &l).unwrap().prediction.step_time_s;
        let fused = with(WgradAccumulation::Fused, true);
        let c = parallax_cost::transformer::transformer_costs(&fused, &l).unwrap();
        let params = c.model_params(m.layers) as f64;
        let dev = DeviceModel::new(&p, Precision::Bf16).unwrap();
        let hook = step(&with(WgradAccumulation::Hook, true)) - step(&fused);
        assert!(
            (hook - 8.0 * dev.memory(params * 10.0).0).abs() < 1e-9,
            "{hook}"
        );
        let autograd = step(&with(WgradAccumulation::Autograd, false))
            - step(&with(WgradAccumulation::Fused, false));
        // Priced as the mean micro-batch's pass: 7/8 of it on each of the 8.
        let expected = 8.0 * dev.memory(params * 6.0 * 7.0 / 8.0).0;
        assert!(
            (autograd - expected).abs() < 1e-9,
            "{autograd} vs {expected}"
        );
        // ZeRO-2 shards the gradients as they are produced: nothing is accumulated whole.
        let z2 = Layout {
            zero_stage: 2,
            dp: 8,
            ..l.clone()
        };
        let step2 = |s: &Setup| {
            simulate_step(&Setup { gpus: 8, ..*s }, &z2)
                .unwrap()
                .prediction
                .step_time_s
        };
        assert_eq!(step2(&with(WgradAccumulation::Hook, true)), step2(&fused));
    }

    #[test]
    fn an_overlapped_dispatch_shortens_the_step_and_holds_one_more_forward() {
        // Qwen3-30B's experts over the 16 ranks (2 nodes) of each stage: the combined 1F1B
        // hides most of the all-to-all; compute is unchanged, and one more forward's
        // activations are kept.
        let m = zoo::transformer("qwen3-30b-a3b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup::new(&m, &p, 64, 4096, 256);
        let plain = Layout {
            dp: 16,
            pp: 4,
            ep: 16,
            zero_stage: 1,
            schedule: Schedule::Interleaved1F1B,
            interleave: 2,
            ..Layout::default()
        };
        let overlapped = Layout {
            ep_overlap: true,
            ..plain.clone()
        };
        let (a, b) = (
            simulate_step(&s, &plain).unwrap().prediction,
            simulate_step(&s, &overlapped).unwrap().prediction,
        );
        let ep = |p: &StepPrediction| p.breakdown.exposed_comm_s["ep"];
        assert!(ep(&b) < 0.6 * ep(&a), "{} vs {}", ep(&b), ep(&a));
        assert!(b.step_time_s < a.step_time_s);
        assert!((b.breakdown.compute_s - a.breakdown.compute_s).abs() < 1e-6 * a.step_time_s);
        assert!(b.memory.activations > a.memory.activations);
        // Plain 1F1B over stages has no combined schedule: refused with the reason.
        let one_f_one_b = Layout {
            schedule: Schedule::OneFOneB,
            interleave: 1,
            ..overlapped
        };
        let e = simulate_step(&s, &one_f_one_b).unwrap_err().to_string();
        assert!(e.contains("interleaved-1f1b"), "{e}");
    }

    #[test]
    fn dual_pipe_holds_a_stage_and_its_mirror() {
        // Llama 3 8B over 4 stages: each device holds two quarters of the layers (twice 1F1B's
        // parameters), 5 micro-batches of activations, and splits the embedding and head
        // between the end stages, which also shortens the busiest one.
        let m = zoo::transformer("llama3-8b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup::new(&m, &p, 32, 4096, 256);
        let one = Layout {
            dp: 8,
            pp: 4,
            zero_stage: 1,
            recompute: Recompute::Selective,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let dual = Layout {
            schedule: Schedule::DualPipe,
            ..one.clone()
        };
        let (a, b) = (
            simulate_step(&s, &one).unwrap().prediction,
            simulate_step(&s, &dual).unwrap().prediction,
        );
        let ratio = b.memory.params / a.memory.params;
        assert!((1.9..2.1).contains(&ratio), "{ratio}");
        let c = transformer_costs(&s, &one).unwrap();
        // (The fullest stage holds the ends, whose passes keep a little more than a middle's.)
        let saved = virtual_stage_saved(&c, &[8, 8, 8, 8], 1) / GIB;
        let acts = b.memory.activations;
        assert!(
            (acts - 5.0 * saved).abs() < 0.03 * acts,
            "{acts} vs 5 × {saved}"
        );
        assert!(b.step_time_s < a.step_time_s && b.bubble_fraction < a.bubble_fraction);
        // Its memory timeline returns to the model states.
        let t = simulate_step(&s, &dual).unwrap().memory_timeline();
        assert_eq!(t.len(), 4);
        // An odd pp is refused with its reason.
        let odd = Layout {
            pp: 2,
            dp: 16,
            ..dual.clone()
        };
        simulate_step(&s, &odd).unwrap();
        let e = simulate_step(
            &s,
            &Layout {
                pp: 8,
                dp: 4,
                micro_batch: 16,
                ..dual
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("dualpipe"), "{e}");
    }

    /// Under the distributed optimizer an MoE layer's experts are replicated over dp / ep
    /// ranks only (Megatron's expert data parallel group, with etp = tp), so their optimizer
    /// states shard ep times less than the dense parameters'.
    #[test]
    fn expert_states_shard_over_the_expert_data_parallel_group() {
        let m = zoo::transformer("mixtral-8x7b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup::new(&m, &p, 64, 4096, 256);
        let l = Layout {
            dp: 64,
            ep: 8,
            zero_stage: 1,
            micro_batch: 1,
            recompute: Recompute::Full,
            ..Layout::default()
        };
        let c = parallax_cost::transformer::transformer_costs(&s, &l).unwrap();
        let (layers, e) = (u64::from(m.layers), c.layer().expert_params);
        assert!(e > 0 && e < c.layer().params);
        let params = virtual_stage_params(&c, &[m.layers], 0);
        let mem = stage_memory_of(&s, &l, &c, &[m.layers], 1, 0).unwrap();
        let (_, _, dense_ob) = state_bytes_per_param(s.precision, 1, 64);
        let (_, _, expert_ob) = state_bytes_per_param(s.precision, 1, 8);
        let want = (params - e * layers) as f64 * dense_ob + (e * layers) as f64 * expert_ob;
        assert!(
            (mem.optimizer.0 as f64 - want).abs() <= 2.0,
            "{mem:?} vs {want}"
        );
        assert!(expert_ob == 8.0 * dense_ob);
    }

    /// The gradient buffers follow the stack: fp32 `main_grad` (4 bytes a parameter), bf16
    /// where it accumulates and reduces in bf16 (Megatron-Bridge's performance scripts: 2),
    /// and apex's fp16 gradients beside fp32 master ones (Megatron-LM 2020: 6).
    #[test]
    fn gradient_buffers_hold_what_the_stack_keeps() {
        let m = zoo::transformer("llama3-8b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let l = Layout {
            dp: 8,
            micro_batch: 1,
            recompute: Recompute::Full,
            ..Layout::default()
        };
        let grads = |grad_reduce_fp32, master_grads_fp32| {
            let s = Setup {
                runtime: parallax_cost::transformer::Runtime {
                    grad_reduce_fp32,
                    master_grads_fp32,
                    ..Default::default()
                },
                ..Setup::new(&m, &p, 8, 4096, 64)
            };
            let c = parallax_cost::transformer::transformer_costs(&s, &l).unwrap();
            let params = virtual_stage_params(&c, &[m.layers], 0) as f64;
            let mem = stage_memory_of(&s, &l, &c, &[m.layers], 8, 0).unwrap();
            mem.grads.0 as f64 / params
        };
        assert_eq!(grads(true, false), 4.0);
        assert_eq!(grads(false, false), 2.0);
        assert_eq!(grads(false, true), 6.0);
    }

    /// Folded over dp × tp (Qwen3-30B-A3B on 16 H100s: tp 2, dp 8, ep 16, etp 1) every
    /// rank holds its own experts: their gradients are not reduced at all, their optimizer
    /// states are not sharded, and the updated weights are not gathered; the dense
    /// parameters reduce, shard and gather over dp as ever.
    #[test]
    fn experts_without_replicas_neither_reduce_nor_shard() {
        let m = zoo::transformer("qwen3-30b-a3b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup {
            runtime: Runtime {
                overlap_grad_reduce: false,
                ..Runtime::default()
            },
            ..Setup::new(&m, &p, 16, 4096, 64)
        };
        let l = Layout {
            dp: 8,
            tp: 2,
            ep: 16,
            etp: Some(1),
            zero_stage: 1,
            sequence_parallel: true,
            ..Layout::default()
        };
        assert_eq!(l.expert_dp(), 1);
        let c = parallax_cost::transformer::transformer_costs(&s, &l).unwrap();
        let layers = [m.layers];
        let (params, experts) = (
            virtual_stage_params(&c, &layers, 0),
            c.layer().expert_params * u64::from(m.layers),
        );
        let dense = params - experts;
        let terms = step_terms(&s, &l, &c, &layers).unwrap();
        let net = Network::new(&p);
        let dp_group = Group::strided(8, 2, 8);
        let rs = net.collective(
            Collective::ReduceScatter,
            Bytes(dense * s.grad_reduce_bytes()),
            dp_group,
        );
        assert!(
            (terms.dp[0].0 - rs.0).abs() < 1e-12,
            "{:?} vs {rs:?}",
            terms.dp
        );
        let ag = net.collective(Collective::AllGather, Bytes(dense * 2), dp_group);
        assert!((terms.param_gather[0].0 - ag.0).abs() < 1e-12);
        let mem = stage_memory_of(&s, &l, &c, &layers, 1, 0).unwrap();
        let (_, _, dense_ob) = state_bytes_per_param(s.precision, 1, 8);
        let (_, _, expert_ob) = state_bytes_per_param(s.precision, 1, 1);
        let want = dense as f64 * dense_ob + experts as f64 * expert_ob;
        assert!(
            (mem.optimizer.0 as f64 - want).abs() <= 2.0,
            "{mem:?} vs {want}"
        );
    }

    /// A mixture whose leading layer is dense: the first stage holds it and pays its own
    /// costs, parameters and stored activations; every later stage only MoE layers.
    #[test]
    fn a_stage_holds_its_own_layers_kinds() {
        use parallax_ir::models::MoeConfig;
        let m = TransformerConfig {
            moe: Some(MoeConfig {
                shared_ffn_hidden: 1408,
                dense_layers_first: 1,
                every: 1,
                dense_ffn_hidden: 10944,
                ..MoeConfig::routed(64, 6)
            }),
            ..TransformerConfig::llama(8, 2048, 16, 16, 1408, 102_400, 4096)
        };
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup::new(&m, &p, 16, 4096, 64);
        let l = Layout {
            dp: 8,
            pp: 2,
            ep: 8,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let c = parallax_cost::transformer::transformer_costs(&s, &l).unwrap();
        let dense = c.kinds[parallax_ir::models::LayerKind::DenseBlock.index()].unwrap();
        let layers = [4, 4];
        assert_eq!(
            virtual_stage_params(&c, &layers, 0),
            c.embedding.params + dense.params + 3 * c.layer().params
        );
        assert_eq!(
            virtual_stage_params(&c, &layers, 1),
            c.head.params + 4 * c.layer().params
        );
        let z = (Seconds(0.0), Seconds(0.0));
        let costs = pass_costs(&c, &layers, z, z, c.p2p_messages());
        let want = c.embedding.fwd() + dense.fwd() + c.layer().fwd() * 3.0;
        assert!((costs.forward[0].0 - want.0).abs() < 1e-12);
        assert_eq!(
            virtual_stage_saved(&c, &layers, 0),
            (c.embedding.saved.0 + dense.saved.0 + 3 * c.layer().saved.0) as f64
        );
        // The whole step simulates, and its MFU counts the dense layer's FLOPs once.
        let r = simulate_step(&s, &l).unwrap().prediction;
        assert!(r.step_time_s > 0.0 && r.mfu > 0.0 && r.mfu < 1.0, "{r:?}");
    }

    #[test]
    fn the_embedding_bucket_reduces_after_backward() {
        // GPT-2 small in fp32 DDP over PCIe: the tied 50257 × 768 table is a third of the
        // gradient and is complete only when backward ends, so its all-reduce (with the first
        // layer's) is exposed in full; the rest hides behind backward.
        let m = zoo::transformer("gpt2").unwrap();
        let p = preset("titan-rtx-2x-pcie").unwrap();
        let s = Setup {
            precision: Precision::Fp32,
            seq: 1024,
            runtime: Runtime {
                fused_attention: false,
                ..Runtime::default()
            },
            ..setup(&m, &p, 2, 8)
        };
        let l = Layout {
            dp: 2,
            micro_batch: 4,
            ..Layout::default()
        };
        let c = transformer_costs(&s, &l).unwrap();
        let layers = stage_layers(m.layers, &l);
        let terms = step_terms(&s, &l, &c, &layers).unwrap();
        let net = Network::new(&p);
        let group = Group::strided(2, 1, 2);
        let reduce = |params: u64| net.collective(Collective::AllReduce, Bytes(params * 4), group);
        let last = reduce(c.embedding.params + c.layer().params);
        let all = reduce(virtual_stage_params(&c, &layers, 0));
        assert!(c.embedding.params > c.layer().params * 5, "{c:?}");
        assert!(terms.dp[0].0 >= last.0, "{:?} < {last:?}", terms.dp[0]);
        assert!(terms.dp[0].0 < all.0, "{:?} >= {all:?}", terms.dp[0]);
    }

    /// Under interleaving, a stack that reduces gradients only after the pipeline schedule
    /// (Megatron-LM before `--overlap-grad-reduce`) waits for every chunk's reduction after
    /// the stage's last backward; one that overlaps reduces each chunk once its own last
    /// backward is done, behind the other chunks' cooldown.
    #[test]
    fn unoverlapped_reductions_wait_for_the_whole_stage_under_interleaving() {
        let m = gpt3();
        let p = preset("dgx-a100-80gb").unwrap();
        let l = Layout {
            dp: 16,
            tp: 8,
            pp: 8,
            micro_batch: 1,
            recompute: Recompute::Full,
            schedule: Schedule::Interleaved1F1B,
            interleave: 6,
            ..Layout::default()
        };
        let run = |overlap_grad_reduce: bool| {
            let s = Setup {
                runtime: Runtime {
                    overlap_grad_reduce,
                    ..Runtime::default()
                },
                ..setup(&m, &p, 1024, 768)
            };
            let c = transformer_costs(&s, &l).unwrap();
            let layers = stage_layers(m.layers, &l);
            let terms = step_terms(&s, &l, &c, &layers).unwrap();
            let r = simulate_step(&s, &l).unwrap().prediction;
            (terms, r)
        };
        let (terms, after) = run(false);
        let (_, overlapped) = run(true);
        // The breakdown's stage waits for its six chunks' reductions, one after another on
        // its link once its backward is over: at least the least any stage reduces.
        let least = (0..l.pp)
            .map(|s| {
                positions_of(&l, s)
                    .into_iter()
                    .map(|vs| terms.dp[vs].0)
                    .sum::<f64>()
            })
            .fold(f64::INFINITY, f64::min);
        let exposed = after.breakdown.exposed_comm_s["dp"];
        assert!(exposed >= least * (1.0 - 1e-9), "{exposed} < {least}");
        assert!(
            overlapped.breakdown.exposed_comm_s["dp"] < 0.5 * exposed,
            "{overlapped:?}"
        );
        assert!(overlapped.step_time_s < after.step_time_s);
    }

    /// A ZeRO-3 whose collectives wait for compute ([`Zero3Engine::blocks_compute`]) adds
    /// them to the step whatever the micro-batch: the step less its compute is one constant,
    /// where the same collectives overlapped hide behind the layers.
    #[test]
    fn blocking_zero3_collectives_add_to_the_step() {
        let m = gpt3();
        let p = preset("dgx-a100-80gb").unwrap();
        let run = |zero3: Zero3Engine, micro_batch: u64| {
            let s = with_zero3(setup(&m, &p, 256, 256 * micro_batch), zero3);
            let l = Layout {
                dp: 256,
                zero_stage: 3,
                micro_batch,
                recompute: Recompute::Full,
                ..Layout::default()
            };
            let r = simulate_step(&s, &l).unwrap().prediction;
            r.step_time_s - r.breakdown.compute_s
        };
        let (one, eight) = (
            run(Zero3Engine::DeepSpeed2022, 1),
            run(Zero3Engine::DeepSpeed2022, 8),
        );
        assert!((one - eight).abs() < 0.02 * one, "{one} vs {eight}");
        // Overlapped, the same gathers and reductions (three passes over 350 GB at ~190 GB/s
        // a rank) hide behind the layers: only the host's views of the gradients remain.
        let overlapped = run(Zero3Engine::DeepSpeed, 8);
        assert!(eight - overlapped > 4.0, "{eight} vs {overlapped}");
    }

    /// DeepSpeed gathers every tensor under its persistence threshold again after each step,
    /// one small collective apiece: GPT-3's eight norms and biases a layer on 96 layers, plus
    /// the final norm's; a unit stack gathers nothing after its step.
    #[test]
    fn deepspeed_gathers_its_persistent_tensors_after_every_step() {
        let m = gpt3();
        let p = preset("dgx-a100-80gb").unwrap();
        let l = Layout {
            dp: 1024,
            zero_stage: 3,
            recompute: Recompute::Full,
            ..Layout::default()
        };
        let terms = |zero3: Zero3Engine| {
            let s = with_zero3(setup(&m, &p, 1024, 1024), zero3);
            let c = transformer_costs(&s, &l).unwrap();
            let layers = stage_layers(m.layers, &l);
            step_terms(&s, &l, &c, &layers).unwrap().param_gather[0]
        };
        assert_eq!(terms(Zero3Engine::Units).0, 0.0);
        let net = Network::new(&p);
        let one = net.collective(
            Collective::AllGather,
            Bytes(m.hidden * 2),
            Group::strided(1024, 1, 8),
        );
        let c = transformer_costs(&setup(&m, &p, 1024, 1024), &l).unwrap();
        let small = |p: &PartCost| (p.param_tensors - p.gathered_tensors) as f64;
        assert_eq!(small(c.layer()), 8.0);
        let want = 96.0 * 8.0 + small(&c.embedding) + small(&c.head);
        let tensors = terms(Zero3Engine::DeepSpeed2022).0 / one.0;
        assert!((tensors - want).abs() < 1e-6, "{tensors} vs {want}");
    }

    /// A unit ZeRO-3 holds two layers gathered and one layer's fp32 gradient; DeepSpeed's
    /// holds two submodule weights (GPT-3's MLP linears, a third of a layer each) and one
    /// such gradient beside its reduce bucket.
    #[test]
    fn deepspeed_zero3_holds_submodules_gathered_not_layers() {
        let m = gpt3();
        let p = preset("dgx-a100-80gb").unwrap();
        let l = Layout {
            dp: 256,
            zero_stage: 3,
            recompute: Recompute::Full,
            ..Layout::default()
        };
        let buffers = |zero3: Zero3Engine| {
            let s = with_zero3(setup(&m, &p, 256, 256), zero3);
            simulate_step(&s, &l).unwrap().prediction.memory.buffers
        };
        let c = transformer_costs(&setup(&m, &p, 256, 256), &l).unwrap();
        let (layer, t) = (c.layer().params as f64, c.layer().largest_tensor as f64);
        assert_eq!(t, 4.0 * 12288.0 * 12288.0);
        let grad = setup(&m, &p, 256, 256).grad_reduce_bytes() as f64;
        let expected = (2.0 * layer * 2.0 + layer * 4.0)
            - (2.0 * t * 2.0 + (t + ZeroConfig::default().reduce_bucket as f64) * grad);
        let saved = (buffers(Zero3Engine::Units) - buffers(Zero3Engine::DeepSpeed)) * GIB;
        assert!(
            (saved - expected).abs() < 1e-6 * expected,
            "{saved} vs {expected}"
        );
        // A run's `reduce_bucket_size` (the Azure recipes' 9e7) is the bucket it holds.
        let mut small = with_zero3(setup(&m, &p, 256, 256), Zero3Engine::DeepSpeed);
        small.runtime.zero_config.reduce_bucket = 90_000_000;
        let smaller = buffers(Zero3Engine::DeepSpeed)
            - simulate_step(&small, &l).unwrap().prediction.memory.buffers;
        let bucket = (ZeroConfig::default().reduce_bucket - 90_000_000) as f64 * grad;
        assert!((smaller * GIB - bucket).abs() < 1e-6 * bucket, "{smaller}");
    }

    /// How pipeline transfers meet the streams ([`PipeSends`]): overlapped, they are tasks on
    /// the link alone; Megatron-LM's paired exchange holds the sending pass for its message;
    /// DeepSpeed's separate blocking send and receive hold it for the transfer once more (the
    /// receiver's wait), its gathers once. Each costs the step more than the one before.
    #[test]
    fn separate_blocking_receives_hold_the_receiving_stage_too() {
        let m = gpt3();
        let p = preset("dgx-a100-80gb").unwrap();
        let l = Layout {
            dp: 2,
            tp: 8,
            pp: 8,
            micro_batch: 1,
            zero_stage: 1,
            recompute: Recompute::Full,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let run = |sends: PipeSends| {
            let s = Setup {
                runtime: Runtime {
                    pipe_sends: sends,
                    pipe_messages: PipeMessages::DeepSpeedWholeGrads,
                    ..Runtime::default()
                },
                ..setup(&m, &p, 128, 64)
            };
            let c = transformer_costs(&s, &l).unwrap();
            let layers = stage_layers(m.layers, &l);
            let terms = step_terms(&s, &l, &c, &layers).unwrap();
            let step = simulate_step(&s, &l).unwrap().prediction.step_time_s;
            (c, terms.costs, step)
        };
        let (c, open, t_open) = run(PipeSends::Overlapped);
        let (_, paired, t_paired) = run(PipeSends::Paired);
        let (_, separate, t_separate) = run(PipeSends::Separate);
        let close = |a: Seconds, b: Seconds| (a.0 - b.0).abs() < 1e-12;
        assert_eq!((open.p2p, open.p2p_gradient), c.p2p_messages());
        assert!(c.p2p_backward.0 > c.p2p.0, "{c:?}");
        for vs in 0..8 {
            assert!(close(paired.forward[vs], open.forward[vs] + c.p2p));
            assert!(close(
                paired.backward_input[vs],
                open.backward_input[vs] + c.p2p_backward
            ));
            assert!(close(
                separate.forward[vs],
                paired.forward[vs] + c.p2p_transfers.0
            ));
            assert!(close(
                separate.backward_input[vs],
                paired.backward_input[vs] + c.p2p_transfers.1
            ));
        }
        assert_eq!(
            (paired.p2p, separate.p2p_gradient),
            (Seconds(0.0), Seconds(0.0))
        );
        assert!(
            t_open < t_paired && t_paired < t_separate,
            "{t_open} {t_paired} {t_separate}"
        );
    }

    /// BLOOM-like 250k vocabulary, tied, over 12 stages: the first and the last stage each
    /// sum their copy of the table's gradient with the other's (an all-reduce of two ranks,
    /// one stage stride × 11 apart, across nodes) after backward, exposed; the stages between
    /// pay nothing of the kind, and neither does an untied model (its head is its own).
    #[test]
    fn a_tied_table_split_over_stages_syncs_its_gradient() {
        let p = preset("dgx-a100-80gb").unwrap();
        let mut m = gpt3();
        m.vocab = 250_880;
        assert!(m.tied_embeddings);
        let s = setup(&m, &p, 384, 1536);
        let l = Layout {
            dp: 4,
            tp: 8,
            pp: 12,
            micro_batch: 1,
            zero_stage: 1,
            recompute: Recompute::Full,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let terms = |m: &TransformerConfig, l: &Layout| {
            let s = Setup { model: m, ..s };
            let c = transformer_costs(&s, l).unwrap();
            let layers = stage_layers(m.layers, l);
            (c.tied_table, step_terms(&s, l, &c, &layers).unwrap().dp)
        };
        let untied = TransformerConfig {
            tied_embeddings: false,
            ..m.clone()
        };
        let ((table, tied), (none, apart)) = (terms(&m, &l), terms(&untied, &l));
        // The word table alone (learned positions stay on the first stage), a rank's share.
        assert_eq!((table, none), (250_880 / 8 * 12_288, 0));
        let net = Network::new(&p);
        let pair = Group::strided(2, 32 * 11, 8);
        let sync = net.collective(
            Collective::AllReduce,
            Bytes(table * s.grad_reduce_bytes()),
            pair,
        );
        for vs in [0, 11] {
            assert!(((tied[vs] - apart[vs]).0 - sync.0).abs() < 1e-12, "{vs}");
        }
        assert!((1..11).all(|vs| tied[vs] == apart[vs]));
        // 250,880 × 12,288 / 8 fp32 gradients over a 25 GB/s NIC: about 60 ms.
        assert!(sync.0 > 0.03 && sync.0 < 0.2, "{sync:?}");
    }

    #[test]
    fn a_16384_gpu_plan_simulates_one_pipeline() {
        let m = zoo::transformer("llama3-405b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup {
            seq: 8192,
            ..setup(&m, &p, 16384, 2048)
        };
        let l = Layout {
            dp: 128,
            tp: 8,
            pp: 16,
            micro_batch: 1,
            zero_stage: 1,
            recompute: Recompute::Selective,
            sequence_parallel: true,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let r = simulate_step(&s, &l).unwrap();
        // One pipeline of 16 stages and 16 micro-batches, not 16,384 devices.
        assert_eq!(r.prediction.micro_batches, 16);
        assert!(r.graph.len() < 2_000, "{} tasks", r.graph.len());
        assert!(r.prediction.step_time_s > 0.0);
    }

    #[test]
    fn a_layout_that_does_not_fit_says_by_how_much() {
        let (m, p) = (gpt3(), preset("dgx-a100-80gb").unwrap());
        let s = setup(&m, &p, 8, 8);
        let l = Layout {
            tp: 8,
            micro_batch: 1,
            ..Layout::default()
        };
        let r = simulate_step(&s, &l).unwrap().prediction;
        assert!(!r.fits);
        assert!(r.reserved_memory_gib > 3.0 * r.capacity_gib);
    }

    /// ZeRO-Offload by hand: Llama-3 8B on one DGX-2 V100 slot (fp16, ZeRO-2, one device)
    /// keeps no optimizer state and one gradient bucket on the device. Its gradients go down
    /// the 15.75 GB/s link as they are reduced (in fp32, as DeepSpeed casts them before the
    /// copy, after its fp64 norm and inf/NaN check on the device: 34 bytes a parameter through
    /// device memory), exposed without overlapped reduction; its optimizer step is the unscale
    /// (8 bytes a parameter) and Adam (28, and 6 for today's host cast to 16 bits) streaming
    /// through the host's 255.9 GB/s at 17 % (the one device training has the host to
    /// itself), then the 16-bit weights' trip up.
    /// Parameter offload (ZeRO-3) leaves no parameter on the device either and steps on the
    /// host alone; a stage it cannot go with is refused by name.
    #[test]
    fn an_offloaded_optimizer_lives_on_the_host_and_pays_the_trip() {
        let m = zoo::transformer("llama3-8b").unwrap();
        let p = preset("dgx2-v100-32gb").unwrap();
        let s = Setup {
            precision: parallax_ir::Precision::Fp16,
            ..Setup::new(&m, &p, 1, 1024, 4)
        };
        let base = Layout {
            zero_stage: 2,
            micro_batch: 1,
            recompute: Recompute::Full,
            ..Layout::default()
        };
        let off = Layout {
            offload: Offload::Optimizer,
            ..base.clone()
        };
        let on_device = simulate_step(&s, &base).unwrap().prediction;
        let host = simulate_step(&s, &off).unwrap().prediction;
        assert!(host.memory.optimizer < 1e-9, "{:?}", host.memory);
        assert!(on_device.memory.optimizer > 80.0, "{:?}", on_device.memory);
        let gbytes = s.grad_reduce_bytes() as f64;
        assert!((host.memory.grads - 5e8 * gbytes / GIB).abs() < 1e-6);
        let n = transformer_costs(&s, &off).unwrap().model_params(m.layers) as f64;
        let link = 15.75e9;
        let cpu = 255.9e9 * 0.17;
        let dev = DeviceModel::new(&p, parallax_ir::Precision::Fp16).unwrap();
        let checks = dev.memory(n * 34.0).0;
        let expect = n * (8.0 + 28.0 + 6.0) / cpu + n * 2.0 / link;
        let got = host.breakdown.optimizer_s;
        assert!((got / expect - 1.0).abs() < 0.02, "{got} vs {expect}");
        // Overlapped with the last micro-batch's backward (today's stacks), as much of it
        // hides as that backward lasts; a stack that reduces after the backward (DeepSpeed
        // 0.3's default) waits for all of it.
        let down = host.breakdown.exposed_comm_s["dp"];
        let expect = n * 4.0 / link + checks;
        let micro_batch = host.breakdown.compute_s / 4.0;
        assert!(
            down < expect - 0.1 && down > expect - micro_batch,
            "{down} vs {expect}"
        );
        let after = Setup {
            runtime: Runtime {
                overlap_grad_reduce: false,
                ..s.runtime
            },
            ..s
        };
        let down = simulate_step(&after, &off)
            .unwrap()
            .prediction
            .breakdown
            .exposed_comm_s["dp"];
        assert!((down / expect - 1.0).abs() < 0.02, "{down} vs {expect}");
        assert!(!on_device.breakdown.exposed_comm_s.contains_key("dp"));
        assert!(host.step_time_s > on_device.step_time_s);
        // Parameters offloaded too: nothing of the model's states stays but buffers.
        let params_off = Layout {
            zero_stage: 3,
            offload: Offload::Params,
            ..base.clone()
        };
        let h = simulate_step(&s, &params_off).unwrap().prediction;
        assert!(
            h.memory.params < 1e-9 && h.memory.optimizer < 1e-9,
            "{:?}",
            h.memory
        );
        assert!((h.breakdown.optimizer_s / (n * (8.0 + 28.0 + 2.0) / cpu) - 1.0).abs() < 0.02);
        // FSDP's CPU offload steps with PyTorch's per-tensor AdamW (80 bytes a parameter) after
        // `clip_grad_norm_` (12), and writes nothing for the device: 2.4 times DeepSpeed's.
        let torch = Setup {
            runtime: Runtime {
                host_optimizer: HostOptimizer::TorchSingleTensor,
                ..s.runtime
            },
            ..s
        };
        let t = simulate_step(&torch, &params_off).unwrap().prediction;
        let ratio = t.breakdown.optimizer_s / h.breakdown.optimizer_s;
        assert!((ratio - 92.0 / 38.0).abs() < 0.05, "{ratio}");
        // FSDP fetches its fp32 shard where ZeRO-Infinity fetches the 16-bit copy: each
        // layer's trip up takes twice as long, and it is what the gathers expose here.
        let fetch = |p: &StepPrediction| p.breakdown.exposed_comm_s["zero"];
        assert!(
            fetch(&t) > 1.5 * fetch(&h),
            "{} vs {}",
            fetch(&t),
            fetch(&h)
        );
        let e = simulate_step(
            &s,
            &Layout {
                zero_stage: 2,
                ..params_off
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("needs zero 3"), "{e}");
    }

    /// DeepSpeed 0.3's ZeRO optimizers by hand, against the fused step on the same layout.
    /// ZeRO-1 checks and norms every gradient the device holds one tensor at a time, each read
    /// back to the host (two round trips a tensor: GPT-2 XL's 48 layers of 12 tensors and its
    /// 4 others), copies and scales all of them around the reduce-scatter and copies the
    /// gathered weights out (36 bytes a held parameter), and steps on its eighth (48 bytes a
    /// parameter against the fused 34). ZeRO-2 does its checks on the partition (80 bytes a
    /// parameter, two round trips a tensor of it) and copies the gathered weights out. Both
    /// reserve their flat copies of gradients and weights beside the rest.
    #[test]
    fn deepspeed_03_checks_gradients_one_tensor_at_a_time() {
        let m = zoo::transformer("gpt2-xl").unwrap();
        let p = preset("dgx2-v100-32gb").unwrap();
        // Megatron's in-place loss, as DeepSpeed 0.3 ran GPT-2: its working set (6 bytes a
        // logit, 309 MB) is the largest block the forward leaves cached.
        let fused = Setup {
            precision: Precision::Fp16,
            runtime: Runtime {
                cross_entropy: CrossEntropy::VocabParallel,
                ..Runtime::default()
            },
            ..Setup::new(&m, &p, 8, 1024, 8)
        };
        let ds = Setup {
            runtime: Runtime {
                optimizer_passes: OptimizerPasses::DeepSpeed03,
                host_optimizer: HostOptimizer::DeepSpeedCpuAdam03,
                ..fused.runtime
            },
            ..fused
        };
        let dev = DeviceModel::new(&p, Precision::Fp16).unwrap();
        let optimizer_s = |s: &Setup, l: &Layout| {
            simulate_step(s, l)
                .unwrap()
                .prediction
                .breakdown
                .optimizer_s
        };
        // GPT-2 small's copies (31 MB sub-partitions, a 249 MB flat input) fit that cache.
        let small = zoo::transformer("gpt2").unwrap();
        let z1 = Layout {
            dp: 8,
            zero_stage: 1,
            micro_batch: 1,
            ..Layout::default()
        };
        let small_buffers = |rt: Runtime| {
            let s = Setup {
                precision: Precision::Fp16,
                runtime: rt,
                ..Setup::new(&small, &p, 8, 1024, 8)
            };
            simulate_step(&s, &z1).unwrap().prediction.memory.buffers
        };
        assert_eq!(small_buffers(ds.runtime), small_buffers(fused.runtime));
        for zero in [1u8, 2] {
            let l = Layout {
                dp: 8,
                zero_stage: zero,
                micro_batch: 1,
                ..Layout::default()
            };
            let c = transformer_costs(&ds, &l).unwrap();
            let tensors = c.layers_count(0, m.layers, |p| p.param_tensors)
                + c.embedding.param_tensors
                + c.head.param_tensors;
            assert_eq!(tensors, 12 * u64::from(m.layers) + 4, "zero {zero}");
            let held = c.model_params(m.layers) as f64;
            let updated = held / 8.0;
            let expect = if zero == 1 {
                dev.memory(updated * 48.0 + held * 36.0) + dev.host_synced(2.0 * tensors as f64)
            } else {
                dev.memory(updated * 80.0 + held * 4.0)
                    + dev.host_synced(2.0 * tensors as f64 / 8.0)
            };
            // Stage 2's default path all-reduces each bucket where the fused stacks
            // reduce-scatter: twice a ring's bytes (the reductions after the backward).
            let reduction = |s: &Setup| {
                let s = Setup {
                    runtime: Runtime {
                        overlap_grad_reduce: false,
                        ..s.runtime
                    },
                    ..*s
                };
                let c = transformer_costs(&s, &l).unwrap();
                step_terms(&s, &l, &c, &[m.layers]).unwrap().dp[0].0
            };
            let ratio = reduction(&ds) / reduction(&fused);
            let twice = if zero == 2 { 2.0 } else { 1.0 };
            assert!((ratio - twice).abs() < 0.02, "zero {zero}: {ratio}");
            let (got, base) = (optimizer_s(&ds, &l), optimizer_s(&fused, &l));
            let gather = base - dev.memory(updated * 34.0).0;
            assert!(
                (got - gather - expect.0).abs() < 1e-9,
                "zero {zero}: {got} vs {} + {gather}",
                expect.0
            );
            assert!(got > base, "zero {zero}");
            // The flat copies around the step, in segments of their own: ZeRO-1 every rank's
            // sub-partition and the reduce-scatter's flattened input (2 + 2 bytes a held
            // parameter, GPT-2 XL under a bucket a rank); ZeRO-2 the largest of a bucket's
            // flattened gradients (5e8 × 2), the partition flattened and cast (2 + 4) and an
            // all-gather's bucket (5e8 × 2).
            let transient = if zero == 1 {
                4.0 * held
            } else {
                (2.0 * 5e8_f64).max(6.0 * updated)
            };
            let buffers = |s: &Setup| simulate_step(s, &l).unwrap().prediction.memory.buffers;
            let extra = (buffers(&ds) - buffers(&fused)) * GIB;
            assert!(
                (extra / transient - 1.0).abs() < 1e-6,
                "zero {zero}: {extra} vs {transient}"
            );
            // Offloaded, the device checks are every stack's; DeepSpeed 0.3 adds its round
            // trips, and its CPU Adam writes the fp32 weights for the device (4 bytes a
            // parameter, not today's separate cast to 16 bits: 6), which cross the link in
            // fp32 (4, not 2) while the host updates the next tile; GPT-2 XL's partition is
            // one tile, so the two follow each other. Eight devices share the host.
            let off = Layout {
                offload: Offload::Optimizer,
                ..l
            };
            let (ds_off, fused_off) = (optimizer_s(&ds, &off), optimizer_s(&fused, &off));
            let trips = if zero == 1 {
                2.0 * tensors as f64
            } else {
                2.0 * tensors as f64 / 8.0
            };
            let (cpu, link) = (255.9e9 * 0.17 / 8.0, 15.75e9);
            let copies = updated * (4.0 - 6.0) / cpu + updated * (4.0 - 2.0) / link;
            assert!(
                (ds_off - fused_off - dev.host_synced(trips).0 - copies).abs() < 1e-9,
                "zero {zero}: {ds_off} - {fused_off}"
            );
        }
    }

    /// DeepSpeed 0.3's ZeRO-Offload recipe keeps full recomputation's checkpoints in host
    /// memory: they leave the device's activations, and each layer's crosses the host link in
    /// forward and again in backward; not on the device, nor without full recomputation.
    #[test]
    fn offloaded_checkpoints_leave_the_device_and_cross_the_link_twice() {
        let m = zoo::transformer("llama3-8b").unwrap();
        let p = preset("dgx2-v100-32gb").unwrap();
        let base = Setup {
            precision: Precision::Fp16,
            ..Setup::new(&m, &p, 1, 1024, 1)
        };
        let host = Setup {
            runtime: Runtime {
                checkpoints_to_host_when_offloaded: true,
                ..base.runtime
            },
            ..base
        };
        let l = Layout {
            zero_stage: 2,
            micro_batch: 1,
            recompute: Recompute::Full,
            offload: Offload::Optimizer,
            ..Layout::default()
        };
        let run = |s: &Setup, l: &Layout| simulate_step(s, l).unwrap().prediction;
        let (kept, moved) = (run(&base, &l), run(&host, &l));
        let c = transformer_costs(&base, &l).unwrap();
        let ckpt = layers_saved(&c, &[m.layers], 0);
        assert!(ckpt > 0.0);
        let freed = (kept.memory.activations - moved.memory.activations) * GIB;
        assert!((freed / ckpt - 1.0).abs() < 1e-6, "{freed} vs {ckpt}");
        let copies = moved.breakdown.compute_s - kept.breakdown.compute_s;
        assert!(
            (copies / (2.0 * ckpt / 15.75e9) - 1.0).abs() < 0.01,
            "{copies}"
        );
        for other in [
            Layout {
                offload: Offload::None,
                ..l.clone()
            },
            Layout {
                recompute: Recompute::Selective,
                ..l.clone()
            },
        ] {
            let (a, b) = (run(&base, &other), run(&host, &other));
            assert_eq!(a.step_time_s, b.step_time_s, "{other:?}");
            assert_eq!(a.memory.activations, b.memory.activations, "{other:?}");
        }
    }

    /// A tiled host update sends each tile up while the next is updated: the slower of the
    /// two runs throughout, the faster once more for the last tile (or the first); untiled,
    /// the trip up follows the whole update.
    #[test]
    fn a_tiled_host_update_overlaps_its_trip_up() {
        // 1 GB/s of host traffic, 1 GB/s of link: 32 bytes of update and 4 up a parameter.
        let h = HostOffload {
            link: 1e9,
            stream_share: 1e9,
            nvme: None,
        };
        let up = |tile| HostUpdate {
            copy_bytes: 4.0,
            link_bytes: 4.0,
            tile,
        };
        let n = 1_000_000_000u64;
        let (update, link) = (32.0, 4.0);
        assert!((h.adam(n, 28.0, up(None)).0 - (update + link)).abs() < 1e-9);
        // Ten tiles: the update throughout, one tile's trip after it.
        let tiled = h.adam(n, 28.0, up(Some(1e8))).0;
        assert!((tiled - (update + link / 10.0)).abs() < 1e-9, "{tiled}");
        // One tile: nothing to overlap.
        assert!((h.adam(n, 28.0, up(Some(2e9))).0 - (update + link)).abs() < 1e-9);
    }

    /// ZeRO-Infinity's NVMe tier by hand: the optimizer on NVMe adds to ZeRO-Offload's step the
    /// states' and gradient's swap in (16 bytes a parameter) and the states' swap out (12),
    /// at the node's drive rates; the parameters there too replace the weights' trip up with
    /// their write back (2 bytes) and read each layer's shard from the drives before it goes
    /// up. A profile without drives refuses both by name, and the states must fit on them.
    #[test]
    fn nvme_offload_swaps_the_states_through_the_drives() {
        let m = zoo::transformer("llama3-8b").unwrap();
        let mut p = preset("dgx2-v100-32gb").unwrap();
        let layout = |offload| Layout {
            zero_stage: 3,
            micro_batch: 1,
            recompute: Recompute::Full,
            offload,
            ..Layout::default()
        };
        let run = |p: &ClusterProfile, offload| {
            let s = Setup {
                precision: parallax_ir::Precision::Fp16,
                ..Setup::new(&m, p, 1, 1024, 4)
            };
            simulate_step(&s, &layout(offload)).map(|r| r.prediction)
        };
        let e = run(&p, Offload::OptimizerNvme).unwrap_err().to_string();
        assert!(e.contains("node.nvme"), "{e}");
        p.node.nvme = Some(parallax_hardware::NvmeSpec {
            read_gbps: 25.0,
            write_gbps: 20.0,
            gib: 1024.0,
            path: None,
        });
        let s = Setup {
            precision: parallax_ir::Precision::Fp16,
            ..Setup::new(&m, &p, 1, 1024, 4)
        };
        let c = transformer_costs(&s, &layout(Offload::Optimizer)).unwrap();
        let n = c.model_params(m.layers) as f64;
        let swap = n * (16.0 / 25e9 + 12.0 / 20e9);
        let host = run(&p, Offload::Optimizer).unwrap();
        let nvme = run(&p, Offload::OptimizerNvme).unwrap();
        let extra = nvme.breakdown.optimizer_s - host.breakdown.optimizer_s;
        assert!((extra / swap - 1.0).abs() < 0.02, "{extra} vs {swap}");
        assert_eq!(nvme.memory.optimizer, host.memory.optimizer);
        // Parameters on the drives: the write back replaces the trip up, and the forward's
        // fetches read the drives first.
        let (hp, np) = (
            run(&p, Offload::Params).unwrap(),
            run(&p, Offload::ParamsNvme).unwrap(),
        );
        let extra = np.breakdown.optimizer_s - hp.breakdown.optimizer_s;
        assert!(
            (extra / (swap + n * 2.0 / 20e9) - 1.0).abs() < 0.02,
            "{extra}"
        );
        assert!(
            np.step_time_s - np.breakdown.optimizer_s > hp.step_time_s - hp.breakdown.optimizer_s
        );
        // 8B parameters × 30 bytes (states, gradient, weights) do not fit on 100 GiB.
        p.node.nvme.as_mut().unwrap().gib = 100.0;
        let e = run(&p, Offload::ParamsNvme).unwrap_err().to_string();
        assert!(e.contains("GiB of NVMe space per node needed"), "{e}");
    }

    /// A host Adam rate `calibrate` measured replaces the DRAM estimate (the gradient unscale
    /// streams at the rate that Adam's 30 bytes a parameter sustained), and the devices of a
    /// node share it: parameters offloaded on eight GPUs of one host (ZeRO-3, each updating
    /// its shard of an eighth) step as long as one GPU's whole model on the host alone.
    #[test]
    fn a_measured_host_adam_rate_prices_the_offloaded_step() {
        let m = zoo::transformer("llama3-8b").unwrap();
        let mut p = preset("dgx2-v100-32gb").unwrap();
        p.node.host_adam_gparams_per_s = Some(2.5);
        let layout = |dp: u32| Layout {
            dp,
            zero_stage: 3,
            micro_batch: 1,
            recompute: Recompute::Full,
            offload: Offload::Params,
            ..Layout::default()
        };
        let step = |gpus: u32| {
            let s = Setup {
                precision: parallax_ir::Precision::Fp16,
                ..Setup::new(&m, &p, gpus, 1024, u64::from(gpus))
            };
            let c = transformer_costs(&s, &layout(gpus)).unwrap();
            let n = c.model_params(m.layers) as f64;
            let got = simulate_step(&s, &layout(gpus)).unwrap().prediction;
            (got.breakdown.optimizer_s, n)
        };
        let (one, n) = step(1);
        let expect = n / 2.5e9 * (1.0 + 8.0 / 30.0);
        assert!((one / expect - 1.0).abs() < 0.02, "{one} vs {expect}");
        let (eight, _) = step(8);
        assert!((eight / one - 1.0).abs() < 0.02, "{eight} vs {one}");
    }
}
