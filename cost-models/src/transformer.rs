//! Costs of a transformer under a structured layout (dp × tp × pp × cp × ep, ZeRO, recompute,
//! sequence parallelism): per layer, embedding and head, per micro-batch on one device.
//!
//! Work comes from the IR: one block, the embeddings and the head are built as graphs at the
//! shapes one tensor-parallel rank holds ([`TransformerConfig::tp_shard`]) and the sequence one
//! context-parallel rank holds, and every op's work is priced by the [`DeviceModel`]. What the
//! layout adds on top — tensor-parallel collectives, context-parallel KV exchange, the effect of
//! sequence parallelism and recomputation — is modelled here.

use crate::comm::{exposed, Collective, Group, Network};
use crate::compute::{DeviceModel, LinearCasts, OpTimes};
use crate::memory::{
    ADAM_BYTES_PER_PARAM, ADAM_UPDATE_BYTES as UPDATE, CAST_DOWN_BYTES as CAST_DOWN,
    CAST_UP_BYTES as CAST_UP, COPY_16_BYTES as COPY_16, COPY_32_BYTES as COPY_32,
    DEEPSPEED_BUCKET_ELEMENTS, FP32_WEIGHT_BYTES, GRAD_CHECK_FP32_BYTES as CHECK_FP32,
    GRAD_NORM_FP32_BYTES as NORM_FP32, GRAD_NORM_FP64_BYTES as NORM_FP64,
    HOST_GRAD_UNSCALE_BYTES_PER_PARAM, SCALE_32_BYTES as SCALE_32, TORCH_ADAMW_HOST_BYTES,
};
use parallax_hardware::ClusterProfile;
use parallax_ir::models::{
    BuildOptions, LayerKind, LayerStack, MoeConfig, Section, TransformerConfig,
};
use parallax_ir::op::{Activation, OpKind};
pub use parallax_ir::RecomputeModules;
use parallax_ir::{
    Bytes, ComputeClass, Dispatcher, Fp8Recipe, Graph, Layout, Precision, Recompute, Seconds,
    Shape, TensorRole,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use thiserror::Error;

/// Why a layout cannot run. Counted by kind in search reports.
#[derive(Clone, Debug, PartialEq, Error, Serialize, Deserialize)]
pub enum Infeasible {
    #[error("layout needs {need} devices, the cluster has {have}")]
    Devices { need: u64, have: u32 },
    #[error("{what}")]
    Indivisible { what: String },
    #[error("tp {tp} spans nodes of {gpus_per_node} devices")]
    TpAcrossNodes { tp: u32, gpus_per_node: u32 },
    #[error("needs {need_gib:.1} GiB per device on stage {stage}, has {have_gib:.1} GiB")]
    Memory {
        need_gib: f64,
        have_gib: f64,
        stage: u32,
    },
    #[error("{0}")]
    Unsupported(String),
}

impl Infeasible {
    /// Short reason name for counting rejections.
    pub fn kind(&self) -> &'static str {
        match self {
            Infeasible::Devices { .. } => "device count",
            Infeasible::Indivisible { .. } => "indivisible",
            Infeasible::TpAcrossNodes { .. } => "tp across nodes",
            Infeasible::Memory { .. } => "out of memory",
            Infeasible::Unsupported(_) => "unsupported",
        }
    }
}

/// Bytes per logit alive at the peak of the loss, in the backward of PyTorch's cross-entropy on
/// (upcast) fp32 logits: the log-probabilities `log_softmax` saved, the dense gradient
/// `nll_loss` hands back, and the input gradient `log_softmax`'s backward writes, 4 bytes each.
/// The 16-bit logits and their fp32 copy are dead by then: the linear saves its input, the
/// upcast and `log_softmax` save nothing of their inputs, and the training loop drops the
/// logits before backward (torchtitan's `del pred`). Forward holds at most 8 (the fp32 copy and
/// the log-probabilities).
const LOSS_BYTES_PER_LOGIT: u64 = 12;

/// Bytes per logit at the peak of Megatron's vocab-parallel cross-entropy
/// (`megatron/core/tensor_parallel/cross_entropy.py`): one fp32 copy of the logits, turned into
/// the softmax in place (`torch.exp(..., out=)`, `div_`), saved, and turned into the gradient in
/// place in backward (`grad_input = softmax; mul_`), plus the 16-bit logits or gradient beside
/// it while the cast runs.
const IN_PLACE_LOSS_BYTES_PER_LOGIT: u64 = 6;

/// Bytes per logit at the peak of PyTorch's DTensor `loss_parallel` on upcast fp32 logits
/// (`torch/distributed/tensor/parallel/loss.py`, which replaces `log_softmax` and `nll_loss`
/// on vocabulary-sharded logits with decompositions that all-reduce the row maximum and sum):
/// its backward (`_nll_loss_and_log_softmax_backward`) holds the saved log-probabilities `x`, a
/// zero-filled `grad_input`, `torch.exp(x)` and their sum before the product with the output
/// gradient, 4 bytes each. Its forward holds at most 14 (the fp32 copy, `x - max`,
/// `torch.exp` of it, and the 16-bit logits still referenced by the training loop).
const LOSS_PARALLEL_BYTES_PER_LOGIT: u64 = 16;

/// The cross-entropy a stack runs on the logits, by the memory it peaks at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CrossEntropy {
    /// PyTorch's on upcast fp32 logits: `LOSS_BYTES_PER_LOGIT`.
    #[default]
    Upcast,
    /// Megatron's vocab-parallel cross-entropy, one fp32 buffer for the softmax and its
    /// gradient: `IN_PLACE_LOSS_BYTES_PER_LOGIT`.
    VocabParallel,
    /// Transformer Engine's fused kernel (`parallel_cross_entropy`, Megatron's
    /// `--cross-entropy-fusion-impl te`): the softmax statistics in fp32 registers, the
    /// gradient written into the 16-bit logits in place (`triton/cross_entropy.py`), so the
    /// logits are all it holds.
    TeFused,
    /// PyTorch's DTensor `loss_parallel` where tensor parallelism shards the vocabulary
    /// (torchtitan: `ColwiseParallel(output_layouts=Shard(-1))` on the output layer and the
    /// loss under `loss_parallel()` whenever tp > 1, `training.disable_loss_parallel` off by
    /// default), [`CrossEntropy::Upcast`] where it does not:
    /// `LOSS_PARALLEL_BYTES_PER_LOGIT`.
    LossParallel,
    /// PyTorch's upcast cross-entropy compiled by inductor with the model (torchtitan since
    /// bbb1b616, 2025-04-02: `build_cross_entropy_loss` wraps it in `torch.compile` when the
    /// run compiles): the cast, the row statistics and the target's gather fuse into
    /// reductions over the 16-bit logits, which the partitioner saves (with each row's
    /// log-sum-exp) rather than fp32 log-probabilities, and backward writes the 16-bit
    /// gradient in one kernel. It holds the saved logits and their gradient.
    Compiled,
}

/// What a loss implementation moves per logit, and the kernels it launches, each way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossPasses {
    pub fwd_bytes: f64,
    pub bwd_bytes: f64,
    pub fwd_kernels: f64,
    pub bwd_kernels: f64,
}

impl CrossEntropy {
    /// Bytes each logit moves through device memory, with logits of `fb` bytes, counted from
    /// each implementation's code (the upcast of 16-bit logits: `fb` read, 4 written; none
    /// for fp32, where `.float()` is the tensor itself; its autograd cast back: 4 read, `fb`
    /// written):
    /// - [`CrossEntropy::Upcast`], `F.cross_entropy(logits.float(), y)`: the cast, then
    ///   `log_softmax` (PyTorch's row kernel for rows wider than 1,024 reads its row for the
    ///   maximum, again for the sum of exponentials, and a third time to write: 16) and
    ///   `nll_loss` (a gather); backward, `nll_loss`'s zero-filled gradient (4) with its
    ///   scatter, `log_softmax`'s backward (the gradient read for its row sum and again with
    ///   the output, written: 16) and the cast back. 3 and 4 launches.
    /// - [`CrossEntropy::VocabParallel`], Megatron's `_VocabParallelCrossEntropy`: the cast,
    ///   the row maximum (4), `logits -= max` (8), `torch.exp(.., out=)` (8), the row sum (4)
    ///   and `div_` (8) into the softmax it saves; backward, the target's `-= 1` (a scatter)
    ///   and `mul_(grad_output)` (8), then the cast back. 7 and 3 launches.
    /// - [`CrossEntropy::TeFused`], Transformer Engine's Triton kernel: the logits read twice
    ///   (online maximum and sum, then the loss) and the gradient written in place, one
    ///   launch; backward scales it by the output gradient in place (a read and a write).
    /// - [`CrossEntropy::LossParallel`], the decomposed `_log_softmax`: the cast, `amax` (4),
    ///   `x - max` (8), `torch.exp` (8), its sum (4), `shifted - logsumexp` (8), then
    ///   `nll_loss`'s gather; backward, `zeros_like` (4) with its scatter, `torch.exp(x)` (8),
    ///   the sum with `grad_input` (12) and the product with the output gradient (8), then the
    ///   cast back. 7 and 6 launches (the all-reduces of per-token statistics are the head's
    ///   TP communication).
    pub fn passes(self, fb: u64) -> LossPasses {
        let fb = fb as f64;
        // The upcast forward and the cast back in backward move the same bytes.
        let cast = if fb < 4.0 { fb + 4.0 } else { 0.0 };
        match self {
            CrossEntropy::Upcast => LossPasses {
                fwd_bytes: cast + 16.0,
                bwd_bytes: 4.0 + 16.0 + cast,
                fwd_kernels: 3.0,
                bwd_kernels: 4.0,
            },
            CrossEntropy::VocabParallel => LossPasses {
                fwd_bytes: cast + 32.0,
                bwd_bytes: 8.0 + cast,
                fwd_kernels: 7.0,
                bwd_kernels: 3.0,
            },
            CrossEntropy::TeFused => LossPasses {
                fwd_bytes: 3.0 * fb,
                bwd_bytes: 2.0 * fb,
                fwd_kernels: 1.0,
                bwd_kernels: 1.0,
            },
            CrossEntropy::LossParallel => LossPasses {
                fwd_bytes: cast + 32.0,
                bwd_bytes: 32.0 + cast,
                fwd_kernels: 7.0,
                bwd_kernels: 6.0,
            },
            // The logits read for the row maximum and again for the sum of exponentials (the
            // target's logit gathered on the way); backward reads them once and writes the
            // gradient.
            CrossEntropy::Compiled => LossPasses {
                fwd_bytes: 2.0 * fb,
                bwd_bytes: 2.0 * fb,
                fwd_kernels: 2.0,
                bwd_kernels: 1.0,
            },
        }
    }

    /// Bytes per logit alive at the loss's peak, with logits of `fb` bytes.
    fn bytes_per_logit(self, fb: u64) -> u64 {
        match self {
            CrossEntropy::Upcast => LOSS_BYTES_PER_LOGIT,
            CrossEntropy::VocabParallel => IN_PLACE_LOSS_BYTES_PER_LOGIT,
            CrossEntropy::TeFused => fb,
            CrossEntropy::LossParallel => LOSS_PARALLEL_BYTES_PER_LOGIT,
            CrossEntropy::Compiled => 2 * fb,
        }
    }
}

/// How a stack adds each micro-batch's weight gradients into the gradients it accumulates over
/// the step (whole gradients: ZeRO 0–1, or stages kept gathered under a pipeline).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WgradAccumulation {
    /// The weight-gradient GEMM accumulates into the buffer as it writes (Megatron-LM's
    /// `--gradient-accumulation-fusion`, on by default since February 2022, commit 83b1e42;
    /// Transformer Engine's `fuse_wgrad_accumulation` under Megatron-Core): no pass of its own.
    #[default]
    Fused,
    /// PyTorch's autograd (`AccumulateGrad`): the first micro-batch's gradient becomes the
    /// parameter's `.grad`, each later one is added to it in place, in the type gradients are
    /// kept and reduced in: the sum reads both and writes one ([`Setup::grad_reduce_bytes`]
    /// each), on every micro-batch after the first (DDP under `no_sync`, DeepSpeed's fp16
    /// engine and pipeline, Megatron-LM 2020–2021 in fp16 without contiguous buffers).
    Autograd,
    /// A backward hook adds each micro-batch's 16-bit gradient into a buffer of the reduce type,
    /// every micro-batch: it reads the gradient and reads and writes the buffer (Megatron-LM's
    /// local DDP with contiguous buffers, `param.main_grad.add_(param.grad.data)` in
    /// megatron/model/distributed.py at v2.5, where the weight-gradient GEMM does not
    /// accumulate itself; DeepSpeed's `BF16_Optimizer`, which adds each micro-batch's bf16
    /// gradient into its fp32 gradient buffer; FSDP2's fp32 accumulation of unsynchronised
    /// micro-batches).
    Hook,
    /// As [`WgradAccumulation::Hook`], the 16-bit gradient first cast to the buffer's type in
    /// a tensor of its own, which the sum then reads: DeepSpeed's `BF16_Optimizer`
    /// (`update_hp_grads`: `hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype))`, v0.6 on),
    /// which the pipeline engine calls after each micro-batch's backward.
    HookCast,
}

impl WgradAccumulation {
    /// Bytes each parameter's accumulation moves per micro-batch, averaged over `m`
    /// micro-batches, with gradients of `fb` bytes accumulated in `grb`-byte buffers.
    pub fn bytes_per_param(self, fb: u64, grb: u64, m: u64) -> f64 {
        let m = m.max(1) as f64;
        match self {
            WgradAccumulation::Fused => 0.0,
            WgradAccumulation::Autograd => 3.0 * grb as f64 * (m - 1.0) / m,
            WgradAccumulation::Hook => (fb + 2 * grb) as f64,
            // The cast reads the gradient and writes the copy; the sum reads both and writes.
            WgradAccumulation::HookCast => (fb + 4 * grb) as f64,
        }
    }
}

/// How a stack's mixed-precision optimizer walks the gradients and weights around the Adam
/// update on the device ([`OptimizerPasses::step`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerPasses {
    /// Multi-tensor or fused kernels over whole buffers (apex's and PyTorch's fused or
    /// foreach AdamW, Megatron-Core's distributed optimizer, DeepSpeed's current ZeRO): the
    /// update of [`ADAM_BYTES_PER_PARAM`], no host round trip per tensor.
    #[default]
    Fused,
    /// DeepSpeed 0.3's fp16 optimizers (deepspeed/runtime/fp16/fused_optimizer.py,
    /// zero/stage1.py, zero/stage2.py at v0.3.0): ZeRO 0 casts and flattens every gradient
    /// into one fp32 buffer; ZeRO-1 checks and norms every gradient of the model one tensor at
    /// a time (both read back to the host) before freeing those it does not update, and copies
    /// the gradients twice and scales all of them around its reduce-scatter; ZeRO-2 does the
    /// same checks on its partition (the norm in fp64) and flattens and casts it; both
    /// unscale, update, copy fp32 into fp16 and copy the gathered weights out of the
    /// all-gather's buffer. With the optimizer offloaded (ZeRO-Offload, stage2.py) the
    /// partition's tensors take the same two round trips each
    /// (`update_overflow_tracker_for_param_grad`, `complete_grad_norm_calculation_for_cpu_offload`).
    DeepSpeed03,
}

/// The optimizer a stack runs on the host's CPUs when the step is offloaded, in host-memory
/// traffic per parameter it updates, and how the weights it updates reach the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostOptimizer {
    /// DeepSpeedCPUAdam (csrc/adam/cpu_adam.cpp): one vectorised pass reads the fp32 weight,
    /// gradient and moments and writes the three back
    /// ([`ADAM_UPDATE_BYTES`](crate::memory::ADAM_UPDATE_BYTES)); the gradients were normed on
    /// the device and are unscaled and clipped by one `mul_` before it
    /// (`unscale_and_clip_grads`, stage2.py in 0.3 as stage_1_and_2.py today). After the
    /// update DeepSpeed casts the fp32 partition into a pinned 16-bit buffer on the host and
    /// copies that up (stage_1_and_2.py: `bit16_partition_buffer.data.copy_(fp32_partition)`).
    /// With the parameters offloaded (ZeRO-3) it writes their 16-bit copy in host memory.
    #[default]
    DeepSpeedCpuAdam,
    /// DeepSpeed 0.3's DeepSpeedCPUAdam: the same update, which writes each updated fp32
    /// weight into one of two pinned buffers of 2^30 elements that a device kernel reads
    /// across the link and casts while the CPUs update the next (cpu_adam.cpp `Step_8`,
    /// `TILE`, `_doubled_buffer`, `launch_param_update` at v0.3.0).
    #[serde(rename = "deepspeed-cpu-adam-0.3")]
    DeepSpeedCpuAdam03,
    /// PyTorch's `torch.optim.AdamW` over CPU tensors (FSDP's
    /// `CPUOffload(offload_params=True)`; its foreach and fused kernels are defaults on CUDA
    /// tensors only, so `_single_tensor_adamw` runs one kernel per op per tensor):
    /// [`TORCH_ADAMW_HOST_BYTES`], 80 bytes a parameter; `clip_grad_norm_` reads the
    /// gradients for their norm and scales them (4 + 8). The fp32 weights it updates are the
    /// ones forward fetches: nothing is written for the device.
    TorchSingleTensor,
}

impl HostOptimizer {
    /// Host-memory bytes per parameter of the update itself.
    pub fn update_bytes(self) -> f64 {
        match self {
            HostOptimizer::DeepSpeedCpuAdam | HostOptimizer::DeepSpeedCpuAdam03 => UPDATE,
            HostOptimizer::TorchSingleTensor => TORCH_ADAMW_HOST_BYTES,
        }
    }

    /// Host-memory bytes per parameter of the gradient pass before the update (unscale and
    /// clip).
    pub fn gradient_bytes(self) -> f64 {
        match self {
            HostOptimizer::DeepSpeedCpuAdam | HostOptimizer::DeepSpeedCpuAdam03 => {
                HOST_GRAD_UNSCALE_BYTES_PER_PARAM
            }
            HostOptimizer::TorchSingleTensor => NORM_FP32 + SCALE_32,
        }
    }

    /// How the updated weights reach the device. Where the parameters themselves live on the
    /// host (`params_on_host`), the copy the device fetches is written there and nothing
    /// crosses the link in the step: DeepSpeed's 16-bit copy (`wbytes` a weight), nothing for
    /// PyTorch, which updates the fp32 weights forward fetches.
    pub fn weights_up(self, params_on_host: bool, wbytes: f64) -> HostUpdate {
        let written = |copy_bytes| HostUpdate {
            copy_bytes,
            link_bytes: 0.0,
            tile: None,
        };
        match (self, params_on_host) {
            (HostOptimizer::TorchSingleTensor, true) => written(0.0),
            (_, true) => written(wbytes),
            (HostOptimizer::DeepSpeedCpuAdam03, false) => HostUpdate {
                copy_bytes: FP32_WEIGHT_BYTES,
                link_bytes: FP32_WEIGHT_BYTES,
                tile: Some(f64::from(1u32 << 30)),
            },
            (_, false) => HostUpdate {
                copy_bytes: CAST_DOWN,
                link_bytes: 2.0,
                tile: None,
            },
        }
    }

    /// Bytes per parameter the device fetches from the host before each forward and backward
    /// where the parameters live there: ZeRO-Infinity's `offload_param` keeps the 16-bit copy
    /// (`wbytes`); FSDP keeps the fp32 shard and copies it up before casting it on the device
    /// (`FlatParamHandle._use_low_precision_shard`: `_local_shard.to(device)`, then `copy_`
    /// into the low-precision shard).
    pub fn param_fetch_bytes(self, wbytes: f64) -> f64 {
        match self {
            HostOptimizer::DeepSpeedCpuAdam | HostOptimizer::DeepSpeedCpuAdam03 => wbytes,
            HostOptimizer::TorchSingleTensor => FP32_WEIGHT_BYTES,
        }
    }
}

/// How an offloaded optimizer step's updated weights reach the device
/// ([`HostOptimizer::weights_up`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostUpdate {
    /// Host-memory bytes per parameter written for the device beside the update's own.
    pub copy_bytes: f64,
    /// Bytes per parameter that cross the host link.
    pub link_bytes: f64,
    /// Parameters updated at a time before they go up while the next ones are updated; `None`:
    /// they go up after the whole update.
    pub tile: Option<f64>,
}

/// One device's optimizer step in device traffic and host round trips ([`OptimizerPasses`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPasses {
    /// Bytes per parameter the device updates (its ZeRO partition, or all it holds).
    pub per_updated: f64,
    /// Bytes per parameter the device holds, updated or not.
    pub per_held: f64,
    /// Host-synchronising checks per parameter tensor the device holds.
    pub syncs_per_held_tensor: f64,
    /// Host-synchronising checks per parameter tensor of the partition it updates.
    pub syncs_per_updated_tensor: f64,
}

impl OptimizerPasses {
    /// Bytes of the flat copies the optimizer makes of gradients and weights around the step
    /// and alive at once, with the optimizer on the device: `held` parameters on the device,
    /// `updated` of them in its partition, over `dp` ranks. A copy larger than `cached`, the
    /// largest block the forward's activations leave in the caching allocator, takes a segment
    /// of its own, which the allocator keeps: the reserve grows by those alive at once (a
    /// smaller one is served from the cache). DeepSpeed 0.3: ZeRO 0 flattens the gradients'
    /// fp32 casts into one buffer (4 bytes a parameter; the per-tensor casts fit the cache);
    /// ZeRO-1 flattens every rank's sub-partition of the gradients (2, in pieces of a
    /// partition or a bucket) and the reduce-scatter flattens its input list again (2, over at
    /// most a bucket a rank); ZeRO-2 flattens a bucket of gradients for each reduction, then
    /// its partition (2) cast to fp32 (4) for the step, then an all-gather's output (a
    /// bucket), one after the other; ZeRO-3 its partition's.
    /// `bucket` is the run's `reduce_bucket_size` ([`ZeroConfig`]).
    pub fn transient_bytes(
        self,
        zero: u8,
        (held, updated): (f64, f64),
        dp: u32,
        cached: f64,
        bucket: f64,
    ) -> f64 {
        let dp = f64::from(dp.max(1));
        let own = |bytes: f64| if bytes > cached { bytes } else { 0.0 };
        let partition_cast = own(2.0 * updated) + own(4.0 * updated);
        match (self, zero) {
            (OptimizerPasses::Fused, _) => 0.0,
            (OptimizerPasses::DeepSpeed03, 0) => own(4.0 * held),
            (OptimizerPasses::DeepSpeed03, 1) => {
                let piece = 2.0 * (held / dp).min(bucket);
                let pieces = if piece > cached { 2.0 * held } else { 0.0 };
                pieces + own(2.0 * held.min(dp * bucket))
            }
            (OptimizerPasses::DeepSpeed03, 2) => own(2.0 * held.min(bucket))
                .max(partition_cast)
                .max(own(2.0 * (updated * dp).min(bucket))),
            (OptimizerPasses::DeepSpeed03, _) => partition_cast,
        }
    }

    /// The collective that reduces the gradients under ZeRO stage `zero`: an all-reduce
    /// without ZeRO, a reduce-scatter with it; but DeepSpeed's stage 2 all-reduces every
    /// bucket and keeps its partition of the result where its gradients are not contiguous
    /// (`reduce_ipg_grads` → `buffered_reduce_fallback` → `allreduce_bucket`, which sets
    /// `rank = None` before it chooses between `dist.reduce` and `dist.all_reduce`) or its
    /// `reduce_scatter` is off (`average_tensor` → `gradient_reduction_w_predivide`):
    /// `contiguous_gradients` is off by default in 0.3 (zero/constants.py at v0.3.0), on in
    /// later releases; a run's `ds_config` may set either ([`ZeroConfig`]).
    pub fn gradient_reduction(self, zero: u8, run: &ZeroConfig) -> Collective {
        let contiguous = run
            .contiguous_gradients
            .unwrap_or(self != OptimizerPasses::DeepSpeed03);
        match zero {
            0 => Collective::AllReduce,
            2 if !contiguous || run.reduce_scatter == Some(false) => Collective::AllReduce,
            _ => Collective::ReduceScatter,
        }
    }

    /// The step's passes under ZeRO stage `zero`, the optimizer on the device.
    pub fn step(self, zero: u8) -> StepPasses {
        let fused = StepPasses {
            per_updated: ADAM_BYTES_PER_PARAM,
            per_held: 0.0,
            syncs_per_held_tensor: 0.0,
            syncs_per_updated_tensor: 0.0,
        };
        match (self, zero) {
            (OptimizerPasses::Fused, _) => fused,
            // Cast each gradient up and flatten the fp32 copies, norm the flat buffer (one
            // sync a step), unscale, update, copy down.
            (OptimizerPasses::DeepSpeed03, 0) => StepPasses {
                per_updated: CAST_UP + COPY_32 + NORM_FP32 + SCALE_32 + UPDATE + CAST_DOWN,
                ..fused
            },
            // Every held gradient: checked, normed (fp32 copy, as the check), flattened into
            // per-rank sub-partitions, flattened again by the reduce-scatter of a tensor list,
            // scaled (all ranks' sub-partitions, not only its own); the gathered weights copied
            // out of the all-gather's buffer. The partition: cast up and flattened, unscaled,
            // updated, cast down.
            (OptimizerPasses::DeepSpeed03, 1) => StepPasses {
                per_updated: CAST_UP + SCALE_32 + UPDATE + CAST_DOWN,
                per_held: 2.0 * CHECK_FP32 + 4.0 * COPY_16,
                syncs_per_held_tensor: 2.0,
                syncs_per_updated_tensor: 0.0,
            },
            // The partition's gradients checked and normed in fp64 one tensor at a time,
            // flattened and cast up, unscaled, updated, cast down; stage 2 copies the gathered
            // weights out of its all-gather's buffer (stage 3 gathers per layer instead).
            (OptimizerPasses::DeepSpeed03, z) => StepPasses {
                per_updated: CHECK_FP32
                    + NORM_FP64
                    + COPY_16
                    + CAST_UP
                    + SCALE_32
                    + UPDATE
                    + CAST_DOWN,
                per_held: if z == 2 { COPY_16 } else { 0.0 },
                syncs_per_held_tensor: 0.0,
                syncs_per_updated_tensor: 2.0,
            },
        }
    }
}

/// Framework behaviour that is not part of the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Runtime {
    /// Fused (flash) attention kernels.
    pub fused_attention: bool,
    /// Of those, the chip's architecture-native ones (FlashAttention-3; cuDNN 9's fused
    /// attention, which Transformer Engine 2 picks on Hopper) rather than FlashAttention-2's:
    /// see [`DeviceModel::with_native_attention`].
    pub native_attention: bool,
    /// Data-parallel gradient reduction overlapped with the last micro-batch's backward, and the
    /// distributed optimizer's parameter gather with the next step's first forward.
    pub overlap_grad_reduce: bool,
    /// How tensor-parallel all-gathers and reduce-scatters overlap the GEMMs next to them.
    pub tp_overlap: TpOverlap,
    /// How pipeline transfers meet the stages' compute streams.
    pub pipe_sends: PipeSends,
    /// Mixed-precision gradients are accumulated and reduced in fp32 (Megatron-LM since 2022,
    /// FSDP with an fp32 reduce dtype); otherwise in the 16-bit training type.
    pub grad_reduce_fp32: bool,
    /// Beside the gradients it reduces, the optimizer keeps an fp32 copy of every gradient
    /// (apex's `FP16_Optimizer`, which Megatron-LM used until its 2021 rewrite: fp16 model
    /// gradients plus persistent fp32 master gradients, `model_grads_to_master_grads`).
    pub master_grads_fp32: bool,
    /// Tensor-parallel groups may span nodes (their collectives then cross the network).
    pub allow_tp_across_nodes: bool,
    /// What the stack's selective recomputation ([`Recompute::Selective`]) redoes.
    pub selective: SelectivePolicy,
    /// Under pipeline parallelism, ZeRO-2/3 (FSDP) keeps a stage's parameters gathered and
    /// accumulates its gradients unsharded (in the reduce type) across the step's
    /// micro-batches, reducing them once after the last: torchtitan sets
    /// `reshard_after_forward=False` on pipelined models, and PyTorch's pipeline stages run
    /// every backward but the last without gradient sync. In time and memory that is the
    /// distributed optimizer's step (ZeRO-1); see [`Setup::zero_stage`].
    pub zero3_gathered_under_pp: bool,
    /// Under pipeline parallelism each stage (FSDP's root of a virtual stage) reduce-scatters
    /// its gradients and frees the unsharded ones after its own last backward (PyTorch's
    /// pipeline stages run the post-backward reduction on a stage's last micro-batch): where a
    /// rank's virtual stages run their backwards one after another (no more micro-batches than
    /// pipeline ranks), only one of them holds whole gradients at a time.
    #[serde(default)]
    pub stage_grads_freed_after_own_backward: bool,
    /// PyTorch's pipeline schedules of late 2024 keep every micro-batch's output of the last
    /// stage until the step ends (`_PipelineStageBase.output_chunks`, merged for the step's
    /// return value), so the last stage holds each micro-batch's logits beside the loss.
    #[serde(default)]
    pub pipeline_keeps_outputs: bool,
    /// A BERT pretraining head runs its masked-LM transform and decoder on the masked
    /// positions only (NVIDIA DeepLearningExamples' `dense_sequence_output`, MLPerf BERT),
    /// not on every token as HuggingFace's `BertForPreTraining` does.
    #[serde(default)]
    pub mlm_masked_only: bool,
    /// Single-process data parallelism (`torch.nn.DataParallel`): every forward replicates
    /// the module from the first GPU, scatters the inputs and gathers the outputs onto it;
    /// every backward reduces the replicas' gradients onto it. None of it overlaps compute.
    #[serde(default)]
    pub single_process_dp: bool,
    /// How ZeRO-3 gathers a layer's parameters and reduces its gradients ([`Zero3Engine`]).
    #[serde(default)]
    pub zero3: Zero3Engine,
    /// The kernels of the loss, which set the memory it peaks at.
    #[serde(default)]
    pub cross_entropy: CrossEntropy,
    /// Eager PyTorch module code runs the layer (HuggingFace and DeepLearningExamples BERT /
    /// GPT-2 blocks; torchtitan and FSDP, whose `torch.compile` is opt-in): see
    /// [`DeviceModel::with_eager`] for the kernels that adds, and [`Runtime::runs_eager`] for
    /// the runs that compile it anyway.
    #[serde(default)]
    pub eager_kernels: bool,
    /// 16-bit training runs under `torch.autocast` over fp32 parameters (the HuggingFace
    /// Trainer's `--bf16` / `--fp16`) rather than on a 16-bit model: the residual stream stays
    /// fp32 (the embeddings are fp32 parameters and each residual sum promotes), ops on
    /// autocast's fp32 list (`layer_norm`, `softmax`, `pow`, …) run in fp32, and every weight
    /// is cast to a 16-bit copy each forward that its layer keeps for backward. What that keeps
    /// beyond a 16-bit model: `autocast_kept`, where layers are priced.
    #[serde(default)]
    pub autocast: bool,
    /// The stack's fp8 layers are run under `torch.compile`, which fuses their scaling and
    /// casting kernels and the module code around them: torchao's float8 training, which
    /// torchtitan documents as needing `--training.compile` "for competitive performance".
    #[serde(default)]
    pub compiles_fp8: bool,
    /// The run compiles its module code (`--compile`: torchtitan's `--training.compile`,
    /// `torch.compile` around a model): nothing runs eagerly.
    #[serde(default)]
    pub compiled: bool,
    /// A compiled run compiles the loss too ([`CrossEntropy::Compiled`]; torchtitan since
    /// April 2025). Not under `loss_parallel`, whose DTensor decomposition it keeps.
    #[serde(default)]
    pub compiles_loss: bool,
    /// Every expert rank receives the same share of the routed tokens (a gate that deals
    /// tokens out in turn, or token dropping at capacity); otherwise the busiest expert rank
    /// receives the expected maximum of a random top-k routing ([`busiest_rank_load`]), which
    /// is also what Megatron's `--moe-router-force-load-balancing` gives: it routes on random
    /// logits.
    #[serde(default)]
    pub balanced_routing: bool,
    /// How fp8 training scales its casts ([`Fp8Recipe`]): per tensor from the current amax
    /// (the default of today's recipes), delayed, rowwise or blockwise.
    #[serde(default)]
    pub fp8_recipe: Fp8Recipe,
    /// The MoE dispatcher waits for the GPU for the sizes of its exchange and of the experts'
    /// GEMMs, and each MoE layer then costs each micro-batch [`MOE_HOST_S`] of host time with
    /// the GPU idle.
    pub moe_host_sync: bool,
    /// The stack pads the vocabulary to a multiple of this many entries per tensor-parallel
    /// rank ([`MEGATRON_VOCAB_MULTIPLE`] for Megatron-LM's model code): embedding, head and
    /// loss are that much larger, and the head's GEMMs aligned. 1: the model's own
    /// vocabulary, as HuggingFace and plain PyTorch module code run it.
    #[serde(default = "one")]
    pub vocab_multiple: u32,
    /// The linear layers are Transformer Engine's (`Linear`, `LayerNormLinear`,
    /// `LayerNormMLP`, the experts' `GroupedLinear`): under fp8 each keeps for its
    /// weight-gradient GEMM the fp8 cast of its input, not the 16-bit input (`saved_inputmat`,
    /// `ln_out`, `gelu_out` in TE's module/linear.py, layernorm_linear.py,
    /// layernorm_mlp.py: one byte an element where the 16-bit tensor is kept for nothing
    /// else). torchao's float8 linear layers keep the
    /// 16-bit input and cast again in backward (its rowwise recipe casts along the other
    /// axis there), as do 16-bit runs.
    #[serde(default)]
    pub te_linears: bool,
    /// Under sequence parallelism, a column-parallel linear layer keeps for its weight
    /// gradient the input as gathered over the TP group, not the sequence-split one: DTensor's
    /// `ColwiseParallel` / `PrepareModuleInput` redistribute the input to `Replicate()` before
    /// the matmul, whose autograd saves what it multiplied (torchtitan). Megatron keeps the
    /// split input and gathers it again in backward
    /// (`LinearWithGradAccumulationAndAsyncCommunication`, `sequence_parallel`). Applies where
    /// the linear's input is kept at all: not under full recomputation, nor under torchtitan's
    /// op-level policy, which runs the all-gathers again rather than save them.
    #[serde(default)]
    pub sp_keeps_gathered_inputs: bool,
    /// How each micro-batch's weight gradients join the step's accumulated gradients.
    #[serde(default)]
    pub wgrad_accumulation: WgradAccumulation,
    /// How the optimizer step walks gradients and weights on the device.
    #[serde(default)]
    pub optimizer_passes: OptimizerPasses,
    /// The optimizer the stack runs on the host's CPUs when the step is offloaded.
    #[serde(default)]
    pub host_optimizer: HostOptimizer,
    /// With the optimizer offloaded, full recomputation's layer checkpoints live in host memory:
    /// each is copied down synchronously in forward and back before its recomputation
    /// (DeepSpeed's `activation_checkpointing.cpu_checkpointing`, which every ZeRO-Offload
    /// config of DeepSpeedExamples' Megatron GPT-2 sets: ds_zero-offload_config.json and
    /// ds_zero-offload_10B_config.json at ece5e0e0, September 2020).
    #[serde(default)]
    pub checkpoints_to_host_when_offloaded: bool,
    /// What a pipeline stage sends its neighbour under tensor parallelism, and what it gathers
    /// around the send.
    #[serde(default)]
    pub pipe_messages: PipeMessages,
    /// DeepSpeed's ZeRO sizes: its defaults, or what a run's `ds_config.json` sets.
    #[serde(default)]
    pub zero_config: ZeroConfig,
}

/// DeepSpeed's ZeRO settings a run's `ds_config.json` may change (its `zero_optimization`
/// keys; `--ds-config`): the sizes it works in, in elements, and how stage 2 reduces, at
/// DeepSpeed's defaults unless the run sets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ZeroConfig {
    /// `reduce_bucket_size` ([`DEEPSPEED_BUCKET_ELEMENTS`] by default): the gradients ZeRO
    /// flattens for one reduction, and an offloading stack holds on the device before sending
    /// them to the host.
    pub reduce_bucket: u64,
    /// `stage3_param_persistence_threshold` ([`DEEPSPEED_PERSISTENCE_ELEMENTS`]).
    pub persistence_threshold: u64,
    /// `stage3_max_reuse_distance` ([`DEEPSPEED_MAX_REUSE_ELEMENTS`]).
    pub max_reuse_distance: u64,
    /// `contiguous_gradients` where a run sets it (`None`: its release's default), which with
    /// `reduce_scatter` chooses stage 2's collective ([`OptimizerPasses::gradient_reduction`]).
    pub contiguous_gradients: Option<bool>,
    /// `reduce_scatter` where a run sets it (`None`: on, DeepSpeed's default).
    pub reduce_scatter: Option<bool>,
}

impl Default for ZeroConfig {
    fn default() -> Self {
        ZeroConfig {
            reduce_bucket: DEEPSPEED_BUCKET_ELEMENTS,
            persistence_threshold: DEEPSPEED_PERSISTENCE_ELEMENTS,
            max_reuse_distance: DEEPSPEED_MAX_REUSE_ELEMENTS,
            contiguous_gradients: None,
            reduce_scatter: None,
        }
    }
}

/// DeepSpeed's `stage3_param_persistence_threshold` default (its config docs: "Do not
/// partition parameters smaller than this threshold", 1e5 elements): smaller parameter
/// tensors (norm scales, biases) stay whole on every rank through forward and backward, not
/// gathered by the layers' hooks (the optimizer step gathers them again after it updates
/// their shards).
pub const DEEPSPEED_PERSISTENCE_ELEMENTS: u64 = 100_000;

/// DeepSpeed's `stage3_max_reuse_distance` default (its config docs: "Do not release a
/// parameter if it will be reused within this threshold of parameters", 1e9 elements): a
/// gathered weight is released after use unless the parameters of the submodules run before
/// its next use add up to no more than this.
pub const DEEPSPEED_MAX_REUSE_ELEMENTS: u64 = 1_000_000_000;

/// How a stack runs ZeRO-3's per-layer collectives: what one all-gather fetches, how the
/// gradients are reduce-scattered, what the host does per rank around it, and whether the
/// compute stream waits for them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Zero3Engine {
    /// A layer is one unit (FSDP's wrapped block, Megatron FSDP's buckets): one all-gather of
    /// its parameters per pass and one reduce-scatter of its gradients, prefetched and
    /// overlapped with the layers beside them.
    #[default]
    Units,
    /// DeepSpeed 0.3.13–0.5 (2020–2021), stage3.py and partition_parameters.py: each
    /// parameterised submodule is gathered on its own hook, and the fetch synchronises the
    /// device before the submodule runs (`_synchronize_communication`: the gather stream,
    /// then `torch.cuda.synchronize()`; DeepSpeed PR #1188, June 2021: "the async version is
    /// not async at all, because each all_gather calls torch.cuda.synchronize()"), and
    /// `reduce_ipg_grads` waits for the previous bucket's reduction on the host: nothing
    /// overlaps compute. Each gradient tensor is reduce-scattered alone
    /// (`_reduce_scatter_gradient`) from a list of world-size views built in Python, which
    /// PyTorch's list `reduce_scatter` copies into one flat buffer a view at a time.
    DeepSpeed2021,
    /// DeepSpeed 0.6–0.9 (2022 to mid-2023): submodule gathers from the trace-driven
    /// coordinator; gradients bucketed (`reduce_bucket_size`) and reduce-scattered by
    /// `reduce_scatter_coalesced`, which slices each tensor into world-size views in Python;
    /// the collectives do not overlap compute: DeepSpeed on Azure (2022, DeepSpeed 0.6.2)
    /// measured step times that grow with the micro-batch by one micro-batch's compute per
    /// sample over a constant of the collectives' time at every scale from 128 to 1,024
    /// GPUs, and DeepSpeed PR #3622 (May 2023) measured `overlap_comm` on and off within 1 %.
    DeepSpeed2022,
    /// DeepSpeed from 0.10 (mid-2023 on): as 0.6–0.9 (submodule gathers, bucketed
    /// reduce-scatters sliced in Python), with the collectives prefetched and overlapped.
    DeepSpeed,
}

impl Zero3Engine {
    /// DeepSpeed's engines: each submodule's hooks gather and release its weight, tensors
    /// under the persistence threshold stay whole, and each whole gradient is divided by the
    /// ranks before it is reduced (`reduce_scatter_coalesced`'s pre-divide; `average_tensor`
    /// before 0.6).
    pub fn submodule_hooks(self) -> bool {
        self != Zero3Engine::Units
    }

    /// All-gathers of one layer's parameters per pass: one, or one per partitioned tensor
    /// (a submodule's weight; its bias and the norms persist whole).
    pub fn gathers(self, layer: &PartCost) -> u64 {
        if self.submodule_hooks() {
            layer.gathered_tensors.max(1)
        } else {
            1
        }
    }

    /// The weights of one layer gathered a third time in backward (count, elements): under
    /// full recomputation, those beyond DeepSpeed's reuse distance ([`PartCost::regathered`]).
    pub fn regathers(self, layer: &PartCost, recompute: Recompute) -> (u64, u64) {
        if self.submodule_hooks() && recompute == Recompute::Full {
            layer.regathered
        } else {
            (0, 0)
        }
    }

    /// Small collectives after each step: DeepSpeed gathers every tensor under its
    /// persistence threshold again, one call apiece (`_post_step`'s
    /// `persistent_parameters[0].all_gather`, `_allgather_params_coalesced` looping over them,
    /// v0.5 to v0.19).
    pub fn gathers_after_step(self, part: &PartCost) -> u64 {
        if self.submodule_hooks() {
            part.param_tensors.saturating_sub(part.gathered_tensors)
        } else {
            0
        }
    }

    /// Reduce-scatters of one layer's gradients: one; one per gradient tensor (DeepSpeed
    /// 2021); or DeepSpeed's buckets, where each partitioned tensor, larger than a bucket,
    /// goes alone and flushes the small tensors gathered before it, at most one run of them
    /// per partitioned tensor.
    pub fn reduce_scatters(self, layer: &PartCost) -> u64 {
        let large = layer.gathered_tensors;
        let small = layer.param_tensors.saturating_sub(large);
        match self {
            Zero3Engine::Units => 1,
            Zero3Engine::DeepSpeed2021 => layer.param_tensors.max(1),
            Zero3Engine::DeepSpeed2022 | Zero3Engine::DeepSpeed => {
                (large + small.min(large)).max(1)
            }
        }
    }

    /// Host dispatches per data-parallel rank for each gradient tensor of a layer, on the
    /// backward thread: DeepSpeed builds a view of every rank's piece in Python (and before
    /// 0.6 PyTorch's list reduce-scatter launches a copy of each into its flat buffer).
    pub fn host_dispatches_per_rank(self) -> f64 {
        match self {
            Zero3Engine::Units => 0.0,
            Zero3Engine::DeepSpeed2021 => 2.0,
            Zero3Engine::DeepSpeed2022 | Zero3Engine::DeepSpeed => 1.0,
        }
    }

    /// The compute stream waits for every gather and reduction (nothing overlaps).
    pub fn blocks_compute(self) -> bool {
        matches!(
            self,
            Zero3Engine::DeepSpeed2021 | Zero3Engine::DeepSpeed2022
        )
    }
}

/// How a stack's pipeline transfers meet the compute streams of the stages they join.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PipeSends {
    /// Sends and receives run beside compute and are waited for only where their data is
    /// needed (Megatron-Core's overlapped p2p since 2023, PyTorch's pipelining): only the link
    /// between the stages carries them.
    #[default]
    Overlapped,
    /// Each send is paired with the opposite receive in one blocking exchange (Megatron-LM
    /// before 2023: `send_forward_recv_backward` and its mirror, a `batch_isend_irecv` waited
    /// for at once): the sender's stream waits for each transfer.
    Paired,
    /// Each send and each receive is a blocking call of its own (DeepSpeed's pipeline
    /// engine: `dist.send` / `dist.recv` in runtime/pipe/p2p.py, async unsupported): both the
    /// sender's and the receiver's streams wait for each transfer, so a stage in the steady
    /// 1F1B state spends two of each message per micro-batch (a rendezvous simulation of its
    /// TrainSchedule gives 1.87–1.9 of them).
    Separate,
}

/// How a stack's pipeline engine moves a micro-batch's activation forward and its input
/// gradient backward between stages when each stage is split over tensor-parallel ranks
/// (without tensor parallelism every variant sends the whole tensor and gathers nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PipeMessages {
    /// Megatron-LM's scatter/gather (Narayanan et al. 2021 §4.1): each tensor-parallel rank
    /// sends 1/tp of the activation and, backward, of its gradient; the receiver all-gathers
    /// the pieces over the node's links.
    #[default]
    Scattered,
    /// DeepSpeed's pipeline engine from 0.5.4 (October 2021; `is_grad_partitioned =
    /// is_model_parallel` in runtime/pipe/engine.py, today behind `pipeline.grad_partitioned`,
    /// on by default): both directions partitioned as above, and the stage's own output, which
    /// it kept partitioned once sent, is gathered again before its backward
    /// (`PartitionedTensor.full()` in `_exec_backward_pass`): two gathers backward.
    #[serde(rename = "deepspeed-partitioned")]
    DeepSpeedPartitioned,
    /// DeepSpeed's pipeline engine before 0.5.4 (`is_grad_partitioned = False`, engine.py
    /// v0.3.0–v0.5.3): activations partitioned and gathered as above, input gradients sent
    /// whole by every tensor-parallel rank; the stage's own output is gathered again before
    /// its backward (`_exec_recv_grads`).
    #[serde(rename = "deepspeed-whole-grads")]
    DeepSpeedWholeGrads,
}

/// Megatron-LM's `--make-vocab-size-divisible-by` default: the vocabulary is padded to a
/// multiple of 128 entries per tensor-parallel rank (`_vocab_size_with_padding`,
/// megatron/training/tokenizer/tokenizer.py).
pub const MEGATRON_VOCAB_MULTIPLE: u32 = 128;

/// How a stack overlaps the tensor-parallel collectives of sequence parallelism (the
/// all-gather into a block's column-parallel linear layers, the reduce-scatter out of its
/// row-parallel one, and their mirrors in backward) with the GEMMs beside them. Without
/// sequence parallelism the all-reduces wait under all three.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TpOverlap {
    /// Every collective waits for the kernel before it and holds up the one after.
    None,
    /// Megatron-LM's asynchronous backward communication of the column-parallel layers
    /// (`--async-tensor-model-parallel-allreduce`, September 2021, on by default; its
    /// `LinearWithGradAccumulationAndAsyncCommunication` in megatron/mpu/layers.py): the
    /// input gradient's all-reduce runs under the weight-gradient GEMM; under sequence
    /// parallelism the input is gathered again under the input-gradient GEMM and the input
    /// gradient's reduce-scatter runs under the weight-gradient GEMM. Forward collectives and
    /// the row-parallel layers' backward gather wait.
    AsyncBackward,
    /// Transformer Engine's userbuffers (`--tp-comm-overlap`): each collective is a ring
    /// exchange pipelined with the GEMM it feeds or drains, in forward and backward; only
    /// what a block's GEMMs cannot hide stays exposed.
    #[default]
    Userbuffers,
    /// PyTorch's asynchronous tensor parallelism (torchtitan's
    /// `enable_async_tensor_parallel`, under `torch.compile`): inductor's micro-pipeline pass
    /// (`torch/_inductor/fx_passes/micro_pipeline_tp.py`) fuses an all-gather with the
    /// matmuls that read the gathered tensor, and a matmul with the reduce-scatter of its
    /// own output, into symmetric-memory kernels that split the matmul into tp row blocks
    /// and move each block with copy engines while the next one computes. What it cannot
    /// fuse waits as before: `async_tp_exposed` says which.
    MicroPipelined,
}

/// The expected load of the busiest of `ranks` expert-parallel ranks, relative to the mean,
/// when each of the `n` token copies it receives on average picks a rank uniformly at random
/// (balls into bins): a rank's load is Binomial(ranks · n, 1/ranks), mean n and variance
/// n (1 − 1/ranks); the largest of `ranks` such loads exceeds the mean by about
/// σ·√(2 ln ranks) (the Gaussian maximum; Raab & Steger 1998 for the bins regime). A router
/// trained with a load-balancing loss routes no better than at random on average; skewed
/// routing is worse, which this leaves out.
pub fn busiest_rank_load(ranks: u64, n: f64) -> f64 {
    if ranks <= 1 || n <= 0.0 {
        return 1.0;
    }
    let r = ranks as f64;
    1.0 + (2.0 * r.ln() * (1.0 - 1.0 / r) / n).sqrt()
}

fn one() -> u32 {
    1
}

/// Fraction of the tokens BERT masks for its masked-LM objective (Devlin et al. 2019, §3.1).
pub const MLM_MASKED_FRACTION: f64 = 0.15;

/// Tokens of a `seq`-token sequence the masked-LM head of `s` runs on.
fn head_tokens(s: &Setup, seq: u64) -> u64 {
    if s.model.bert && s.runtime.mlm_masked_only {
        ((seq as f64 * MLM_MASKED_FRACTION).ceil() as u64).clamp(1, seq)
    } else {
        seq
    }
}

/// What selective recomputation redoes in backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SelectivePolicy {
    /// The cheap ops: norms, pointwise ops and an unfused attention core (Megatron-LM's
    /// selective recompute, Korthikanti et al. 2022; the common op-level policy).
    #[default]
    CheapOps,
    /// The cheap ops and every second matrix multiply of a block (torchtitan's op-level
    /// selective activation checkpointing, which saves only alternate `mm` outputs). PyTorch's
    /// selective checkpointing replays the whole block in backward from its input, taking the
    /// saved ops' outputs from its cache: the block keeps its input and those outputs, nothing
    /// a recomputed op would have kept.
    CheapOpsAndAlternateMatmuls,
    /// The submodules Megatron-Core's `--recompute-modules` names: what a layout's
    /// [`Recompute::Modules`] redoes (a stack's own policy is one of the others).
    Modules(RecomputeModules),
}

impl SelectivePolicy {
    /// Whether backward replays the whole block from its input, keeping only the outputs of
    /// the ops it saves (PyTorch's selective checkpointing, which torchtitan's op-level policy
    /// is), rather than redoing each recomputed op from what it reads.
    pub fn replays_block(self) -> bool {
        self == SelectivePolicy::CheapOpsAndAlternateMatmuls
    }
}

impl Runtime {
    /// The collective that reduces the gradients under ZeRO stage `zero`: the optimizer's
    /// ([`OptimizerPasses::gradient_reduction`]) under the run's ZeRO settings.
    pub fn gradient_reduction(&self, zero: u8) -> Collective {
        self.optimizer_passes
            .gradient_reduction(zero, &self.zero_config)
    }

    /// Whether the layer's module code runs eagerly at `precision`: where the stack's code is
    /// eager, unless the run compiles it: asked to ([`Runtime::compiled`]), or as an fp8 run
    /// on a stack that [compiles its fp8 layers](Runtime::compiles_fp8) and an
    /// asynchronous-TP run (PyTorch's async TP is an inductor pass: torchtitan refuses it
    /// uncompiled) do.
    pub fn runs_eager(&self, precision: Precision) -> bool {
        self.eager_kernels
            && !self.compiled
            && !(precision == Precision::Fp8 && self.compiles_fp8)
            && self.tp_overlap != TpOverlap::MicroPipelined
    }

    /// The cross-entropy a run at `precision` runs on logits whose vocabulary `tp` ranks
    /// share: `loss_parallel` only on sharded logits; the compiled loss where the run
    /// compiles and the stack compiles its loss with the model.
    pub fn loss(&self, tp: u32, precision: Precision) -> CrossEntropy {
        let compiled = self.compiles_loss && self.eager_kernels && !self.runs_eager(precision);
        match self.cross_entropy {
            CrossEntropy::LossParallel if tp > 1 => CrossEntropy::LossParallel,
            CrossEntropy::LossParallel | CrossEntropy::Upcast if compiled => CrossEntropy::Compiled,
            CrossEntropy::LossParallel => CrossEntropy::Upcast,
            other => other,
        }
    }
}

impl Default for Runtime {
    fn default() -> Self {
        Runtime {
            fused_attention: true,
            // FlashAttention-2-class kernels unless a stack is known to run the chip's own.
            native_attention: false,
            overlap_grad_reduce: true,
            tp_overlap: TpOverlap::Userbuffers,
            pipe_sends: PipeSends::Overlapped,
            grad_reduce_fp32: true,
            master_grads_fp32: false,
            allow_tp_across_nodes: false,
            selective: SelectivePolicy::CheapOps,
            zero3_gathered_under_pp: false,
            stage_grads_freed_after_own_backward: false,
            pipeline_keeps_outputs: false,
            mlm_masked_only: false,
            single_process_dp: false,
            zero3: Zero3Engine::Units,
            cross_entropy: CrossEntropy::Upcast,
            eager_kernels: false,
            autocast: false,
            compiles_fp8: false,
            compiled: false,
            compiles_loss: false,
            balanced_routing: false,
            fp8_recipe: Fp8Recipe::Tensorwise,
            moe_host_sync: true,
            vocab_multiple: 1,
            te_linears: false,
            sp_keeps_gathered_inputs: false,
            wgrad_accumulation: WgradAccumulation::Fused,
            optimizer_passes: OptimizerPasses::Fused,
            host_optimizer: HostOptimizer::DeepSpeedCpuAdam,
            checkpoints_to_host_when_offloaded: false,
            pipe_messages: PipeMessages::Scattered,
            zero_config: ZeroConfig::default(),
        }
    }
}

/// What one device spends on one layer (or the embedding, or the head) for one micro-batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PartCost {
    /// Compute, by pass.
    pub compute: OpTimes,
    /// Extra forward compute in backward under recomputation.
    pub recompute: Seconds,
    /// Tensor-parallel collectives on the critical path, forward and backward (recomputed
    /// forward collectives included in backward).
    pub tp_fwd: Seconds,
    pub tp_bwd: Seconds,
    /// Context-parallel key/value exchange not hidden behind attention, forward and backward.
    pub cp_fwd: Seconds,
    pub cp_bwd: Seconds,
    /// Expert-parallel all-to-all, forward and backward.
    pub ep_fwd: Seconds,
    pub ep_bwd: Seconds,
    /// Host time the GPU waits for, forward and backward (an MoE layer's, after its
    /// dispatcher's host sync: [`Runtime::moe_host_sync`]).
    #[serde(default)]
    pub host_fwd: Seconds,
    #[serde(default)]
    pub host_bwd: Seconds,
    /// Bytes kept from forward to backward under the recompute policy.
    pub saved: Bytes,
    /// Transient bytes while this part's backward runs (recomputed activations, logits).
    pub working: Bytes,
    /// Parameters held by one device.
    pub params: u64,
    /// Parameter tensors those `params` come in as module code holds them (weights, biases,
    /// norm scales: each a `.grad` an optimizer that checks gradients one tensor at a time
    /// visits: the IR graph's weights, an attention's key and value counted in its query's).
    #[serde(default)]
    pub param_tensors: u64,
    /// Of `param_tensors`, those of at least the run's `stage3_param_persistence_threshold`
    /// ([`ZeroConfig`]) elements: the ones DeepSpeed's ZeRO-3 partitions and gathers
    /// ([`Zero3Engine::gathers`]).
    #[serde(default)]
    pub gathered_tensors: u64,
    /// Elements of the largest parameter tensor: what DeepSpeed's ZeRO-3 holds gathered at a
    /// time, and the largest gradient autograd hands its reduction.
    #[serde(default)]
    pub largest_tensor: u64,
    /// Of the gathered tensors, those DeepSpeed's ZeRO-3 gathers a third time under full
    /// recomputation (count, elements): after its recomputed forward a submodule's weight is
    /// used again by its backward, once the later submodules have run their recomputation and
    /// their backward; where their parameters add up to more than the run's
    /// `stage3_max_reuse_distance` ([`ZeroConfig`]) it is released between the two
    /// (`PartitionedParameterCoordinator.__params_to_release`).
    #[serde(default)]
    pub regathered: (u64, u64),
    /// Of `params`, the routed experts' (an MoE layer's experts are replicated over the
    /// expert-data-parallel group, dp × cp / ep ranks, not over all dp × cp: ZeRO shards
    /// their states that much less).
    pub expert_params: u64,
    /// Model FLOPs (no recomputation) of this part on one device.
    pub model_flops: f64,
    /// FLOPs actually executed (with recomputation) on one device.
    pub hardware_flops: f64,
}

/// Two parts run one after the other: their times, bytes kept, parameters and FLOPs add up;
/// the transient bytes are the larger part's.
impl std::ops::Add for PartCost {
    type Output = PartCost;
    fn add(self, o: PartCost) -> PartCost {
        PartCost {
            compute: self.compute + o.compute,
            recompute: self.recompute + o.recompute,
            tp_fwd: self.tp_fwd + o.tp_fwd,
            tp_bwd: self.tp_bwd + o.tp_bwd,
            cp_fwd: self.cp_fwd + o.cp_fwd,
            cp_bwd: self.cp_bwd + o.cp_bwd,
            ep_fwd: self.ep_fwd + o.ep_fwd,
            ep_bwd: self.ep_bwd + o.ep_bwd,
            host_fwd: self.host_fwd + o.host_fwd,
            host_bwd: self.host_bwd + o.host_bwd,
            saved: Bytes(self.saved.0 + o.saved.0),
            working: Bytes(self.working.0.max(o.working.0)),
            params: self.params + o.params,
            param_tensors: self.param_tensors + o.param_tensors,
            gathered_tensors: self.gathered_tensors + o.gathered_tensors,
            largest_tensor: self.largest_tensor.max(o.largest_tensor),
            regathered: (
                self.regathered.0 + o.regathered.0,
                self.regathered.1 + o.regathered.1,
            ),
            expert_params: self.expert_params + o.expert_params,
            model_flops: self.model_flops + o.model_flops,
            hardware_flops: self.hardware_flops + o.hardware_flops,
        }
    }
}

impl PartCost {
    /// Nothing: no time, bytes, parameters or FLOPs.
    pub const ZERO: PartCost = PartCost {
        compute: OpTimes {
            fwd: Seconds(0.0),
            bwd_input: Seconds(0.0),
            bwd_weight: Seconds(0.0),
        },
        recompute: Seconds(0.0),
        tp_fwd: Seconds(0.0),
        tp_bwd: Seconds(0.0),
        cp_fwd: Seconds(0.0),
        cp_bwd: Seconds(0.0),
        ep_fwd: Seconds(0.0),
        ep_bwd: Seconds(0.0),
        host_fwd: Seconds(0.0),
        host_bwd: Seconds(0.0),
        saved: Bytes(0),
        working: Bytes(0),
        params: 0,
        param_tensors: 0,
        gathered_tensors: 0,
        largest_tensor: 0,
        regathered: (0, 0),
        expert_params: 0,
        model_flops: 0.0,
        hardware_flops: 0.0,
    };

    /// This part as it runs when `paired` of its passes are merged with a pass of another
    /// micro-batch ([`Layout::ep_overlap`], Megatron-Core's combined 1F1B): a merged forward's
    /// dispatch and combine run beside the partner backward's kernels (input and weight
    /// gradients: `--delay-wgrad-compute` moves the latter there), a merged backward's beside
    /// the partner forward's, each priced as any overlap is ([`exposed`]: what does not fit,
    /// plus the interference of the communication kernels on what does). The partner is taken
    /// to be the same kind of layer. The passes left alone (warm-up forwards, cool-down
    /// backwards) pay the whole dispatch.
    pub fn ep_overlapped(&self, paired: f64) -> PartCost {
        let fwd_rest = self.fwd() - self.ep_fwd - self.host_fwd;
        let bwd_rest = self.bwd_input() - self.ep_bwd - self.host_bwd + self.bwd_weight();
        let mix = |alone: Seconds, merged: Seconds| alone * (1.0 - paired) + merged * paired;
        PartCost {
            ep_fwd: mix(self.ep_fwd, exposed(self.ep_fwd, bwd_rest)),
            ep_bwd: mix(self.ep_bwd, exposed(self.ep_bwd, fwd_rest)),
            ..*self
        }
    }

    /// Forward pass on the critical path.
    pub fn fwd(&self) -> Seconds {
        self.compute.fwd + self.tp_fwd + self.cp_fwd + self.ep_fwd + self.host_fwd
    }
    /// Input-gradient pass on the critical path (with recomputation).
    pub fn bwd_input(&self) -> Seconds {
        self.compute.bwd_input
            + self.recompute
            + self.tp_bwd
            + self.cp_bwd
            + self.ep_bwd
            + self.host_bwd
    }
    /// Weight-gradient pass.
    pub fn bwd_weight(&self) -> Seconds {
        self.compute.bwd_weight
    }
}

/// Costs of the three parts of a transformer under one layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransformerCosts {
    /// A layer of each kind the model has, by [`LayerKind::index`].
    pub kinds: [Option<PartCost>; LayerKind::COUNT],
    /// Which layer is which kind.
    pub stack: LayerStack,
    pub embedding: PartCost,
    pub head: PartCost,
    /// Tokens in one micro-batch on one device's sequence shard.
    pub tokens_per_microbatch: u64,
    /// Bytes of one activation message between pipeline stages.
    pub p2p_bytes: Bytes,
    /// One pipeline send of `p2p_bytes` (across nodes when stages are on different nodes)
    /// with the gather that rebuilds the activation: the forward message.
    pub p2p: Seconds,
    /// The backward message: one micro-batch's input gradient from a stage to the one
    /// before it, with the gathers the stack's engine runs around it ([`PipeMessages`]).
    pub p2p_backward: Seconds,
    /// Of `p2p` and `p2p_backward`, the transfers across the link alone (no gathers): what a
    /// separately blocking receive waits for again ([`PipeSends::Separate`]).
    pub p2p_transfers: (Seconds, Seconds),
    /// Parameters of the word-embedding table a rank holds twice over a pipeline, on the first
    /// stage and as the last stage's head when the model ties them (0 otherwise): the
    /// gradient the two stages sum after backward.
    #[serde(default)]
    pub tied_table: u64,
    /// The head's output of one micro-batch on one rank (its logits over the rank's vocabulary
    /// shard, at the training precision): what a pipeline schedule that keeps each
    /// micro-batch's output for the step's merged result holds on the last stage.
    #[serde(default)]
    pub head_output: Bytes,
}

impl TransformerCosts {
    /// These costs with `paired` of every layer's passes merged with another micro-batch's
    /// ([`PartCost::ep_overlapped`]; the simulator knows the fraction from the schedule).
    pub fn ep_overlapped(&self, paired: f64) -> TransformerCosts {
        let mut c = self.clone();
        for k in c.kinds.iter_mut().flatten() {
            *k = k.ep_overlapped(paired);
        }
        c
    }

    /// The cost of a layer of `kind` (a default, empty cost for a kind the model lacks).
    pub fn kind(&self, kind: LayerKind) -> &PartCost {
        const NONE: PartCost = PartCost::ZERO;
        self.kinds[kind.index()].as_ref().unwrap_or(&NONE)
    }

    /// The pipeline messages each way: an activation forward, an input gradient backward.
    pub fn p2p_messages(&self) -> (Seconds, Seconds) {
        (self.p2p, self.p2p_backward)
    }

    /// The layer with the most parameters on a device (a mixture's MoE layer): the unit in
    /// which ZeRO-3 gathers and reduces per layer.
    pub fn layer(&self) -> &PartCost {
        self.layer_kinds()
            .max_by_key(|l| l.params)
            .unwrap_or(self.kind(LayerKind::Block))
    }

    /// The cost of layer `i`.
    pub fn layer_at(&self, i: u32) -> &PartCost {
        LayerKind::of_one(self.stack.kinds_in(i, 1)).map_or_else(|| self.layer(), |k| self.kind(k))
    }

    /// Sum of `f` over layers `first .. first + n`.
    pub fn layers_sum<T>(&self, first: u32, n: u32, f: impl Fn(&PartCost) -> T) -> T
    where
        T: std::ops::Mul<f64, Output = T> + std::ops::Add<Output = T>,
    {
        let counts = self.stack.kinds_in(first, n);
        let mut kinds = self.present(counts);
        let (k, c) = kinds.next().unwrap_or((LayerKind::Block, 0));
        kinds.fold(f(self.kind(k)) * f64::from(c), |sum, (k, c)| {
            sum + f(self.kind(k)) * f64::from(c)
        })
    }

    /// Parameters (`f` of each kind, a count) over layers `first .. first + n`.
    pub fn layers_count(&self, first: u32, n: u32, f: impl Fn(&PartCost) -> u64) -> u64 {
        let counts = self.stack.kinds_in(first, n);
        self.present(counts)
            .map(|(k, c)| f(self.kind(k)) * u64::from(c))
            .sum()
    }

    /// Parameters of the whole model as priced under the layout (each rank's shard of them
    /// where tensor or expert parallelism splits them): its `layers` layers, the embedding and
    /// the head.
    pub fn model_params(&self, layers: u32) -> u64 {
        self.layers_count(0, layers, |l| l.params) + self.embedding.params + self.head.params
    }

    /// The kinds among `counts` that occur, with their counts.
    fn present(
        &self,
        counts: [u32; LayerKind::COUNT],
    ) -> impl Iterator<Item = (LayerKind, u32)> + '_ {
        LayerKind::ALL
            .into_iter()
            .map(move |k| (k, counts[k.index()]))
            .filter(|(_, c)| *c > 0)
    }

    /// The kinds of layer the model has (for maxima over its layers).
    pub fn layer_kinds(&self) -> impl Iterator<Item = &PartCost> {
        self.kinds.iter().flatten()
    }

    /// [`TransformerCosts::layer_kinds`] with the kind of each.
    pub fn layer_kinds_named(&self) -> impl Iterator<Item = (LayerKind, &PartCost)> {
        LayerKind::ALL
            .into_iter()
            .zip(&self.kinds)
            .filter_map(|(kind, p)| p.as_ref().map(|p| (kind, p)))
    }
}

/// The fixed inputs of a costing: model, hardware and training settings.
#[derive(Clone, Copy, Debug)]
pub struct Setup<'a> {
    pub model: &'a TransformerConfig,
    pub profile: &'a ClusterProfile,
    pub gpus: u32,
    pub precision: Precision,
    pub seq: u64,
    pub global_batch: u64,
    pub runtime: Runtime,
}

impl<'a> Setup<'a> {
    /// A bf16 step of `global_batch` sequences of `seq` tokens over `gpus` devices of
    /// `profile`, on a current stack ([`Runtime::default`]); other precisions and runtimes by
    /// struct update (`Setup { precision, ..Setup::new(…) }`).
    pub fn new(
        model: &'a TransformerConfig,
        profile: &'a ClusterProfile,
        gpus: u32,
        seq: u64,
        global_batch: u64,
    ) -> Self {
        Setup {
            model,
            profile,
            gpus,
            precision: Precision::Bf16,
            seq,
            global_batch,
            runtime: Runtime::default(),
        }
    }
}

impl Setup<'_> {
    /// Bytes of an activation element, and of a weight gradient as backward writes it.
    pub fn float_bytes(&self) -> u64 {
        self.precision.activation_dtype().size_bytes()
    }

    /// Whether linear layers keep the fp8 cast of their input for backward
    /// ([`Runtime::te_linears`]): fp8 training on Transformer Engine under one of its recipes.
    pub fn keeps_fp8_linear_inputs(&self) -> bool {
        self.precision == Precision::Fp8
            && self.runtime.te_linears
            && self.runtime.fp8_recipe != Fp8Recipe::Rowwise
    }

    /// The model as each of `tp` tensor-parallel ranks holds it, its vocabulary padded as the
    /// stack pads it ([`Runtime::vocab_multiple`]: Megatron's 128 entries a rank); `None`
    /// where `tp` does not divide the heads or the FFN.
    pub fn rank_shard(&self, tp: u32) -> Option<TransformerConfig> {
        let mut shard = self.model.tp_shard(u64::from(tp))?;
        shard.vocab = shard
            .vocab
            .next_multiple_of(u64::from(self.runtime.vocab_multiple.max(1)));
        Some(shard)
    }

    /// Whether attention runs as a fused kernel: the runtime has one and the device runs it.
    pub fn fused_attention(&self) -> bool {
        self.runtime.fused_attention && self.profile.device.has_fused_attention()
    }

    /// The ZeRO stage `l` runs as: its own, except ZeRO-2 and -3 under pipeline parallelism
    /// with a runtime that keeps stages gathered across micro-batches, which run as ZeRO-1
    /// (parameters and gradients whole on each device for the step, optimizer states sharded,
    /// gradients reduce-scattered after the last backward and parameters gathered before the
    /// first forward): PyTorch's pipeline schedules skip gradient sync on every backward but
    /// the last, so FSDP accumulates whole gradients whichever way it reshards parameters.
    pub fn zero_stage(&self, l: &Layout) -> u8 {
        if l.zero_stage >= 2 && l.pp > 1 && self.runtime.zero3_gathered_under_pp {
            1
        } else {
            l.zero_stage
        }
    }

    /// Bytes of gradient buffers per parameter under mixed precision: the buffer that is
    /// reduced (fp32, or the 16-bit training type where the stack accumulates and reduces in
    /// it), plus the optimizer's fp32 master gradients where it keeps them.
    pub fn grad_buffer_bytes(&self) -> u64 {
        self.grad_reduce_bytes() + if self.runtime.master_grads_fp32 { 4 } else { 0 }
    }

    /// Bytes per gradient element in data-parallel reductions.
    pub fn grad_reduce_bytes(&self) -> u64 {
        if self.precision.is_mixed() && !self.runtime.grad_reduce_fp32 {
            2
        } else {
            4
        }
    }
}

/// Model FLOPs of one optimizer step: the unsharded graph's forward and backward work for every
/// sequence of the global batch, without recomputation (the numerator of MFU).
pub fn model_flops_per_step(s: &Setup) -> Result<f64, Infeasible> {
    let per = |sec| {
        s.model
            .build_section(
                sec,
                BuildOptions {
                    batch: 1,
                    seq: s.seq,
                    fused_attention: true,
                },
            )
            .map(|g| g.total_work(2).train_flops().0)
            .map_err(|e| Infeasible::Unsupported(e.to_string()))
    };
    let layers = s.model.layers;
    let counts = s.model.layer_kinds_in(0, layers);
    let mut layers_work = 0.0;
    for kind in s.model.layer_kinds() {
        layers_work += f64::from(counts[kind.index()]) * per(Section::Layer(kind))?;
    }
    // Multi-token prediction: per module its input, a block like the last layer and a
    // pass through the head.
    let mtp = f64::from(s.model.mtp_layers);
    let mtp_work = if mtp > 0.0 {
        let last = Section::Layer(s.model.layer_kind(layers - 1));
        mtp * (per(Section::MtpInput)? + per(last)? + per(Section::Head)?)
    } else {
        0.0
    };
    let per_seq = layers_work + mtp_work + per(Section::Embedding)? + per(Section::Head)?;
    Ok(per_seq * s.global_batch as f64)
}

/// Checks that the layout's degrees fit the model and cluster (before any costing).
pub fn check_layout(s: &Setup, l: &Layout) -> Result<(), Infeasible> {
    let m = s.model;
    if l.devices() != u64::from(s.gpus) {
        return Err(Infeasible::Devices {
            need: l.devices(),
            have: s.gpus,
        });
    }
    let gpn = s.profile.node.gpus_per_node;
    if l.tp > gpn && s.gpus > gpn && !s.runtime.allow_tp_across_nodes {
        return Err(Infeasible::TpAcrossNodes {
            tp: l.tp,
            gpus_per_node: gpn,
        });
    }
    let ind = |what: String| Err(Infeasible::Indivisible { what });
    if m.tp_shard(u64::from(l.tp)).is_none() {
        return ind(format!(
            "tp {} must divide heads {}, ffn {} and kv heads {}{}",
            l.tp,
            m.heads,
            m.ffn_hidden,
            m.kv_heads,
            m.hybrid.as_ref().map_or(String::new(), |h| format!(
                ", Mamba heads {} and groups {}",
                h.mamba.heads, h.mamba.groups
            ))
        ));
    }
    if l.cp > 1 && s.model.layer_kinds().any(|k| k == LayerKind::Mamba) {
        return Err(Infeasible::Unsupported(format!(
            "cp {}: context parallelism over Mamba layers (their scan runs along the whole sequence) is not modelled",
            l.cp
        )));
    }
    if s.seq % u64::from(l.cp) != 0 || (l.cp > 1 && (s.seq / u64::from(l.cp)) % 2 != 0) {
        return ind(format!(
            "cp {} must divide sequence {} into even shards",
            l.cp, s.seq
        ));
    }
    if l.sequence_parallel && l.tp > 1 && (s.seq / u64::from(l.cp)) % u64::from(l.tp) != 0 {
        return ind(format!(
            "sequence parallelism: tp {} must divide the sequence shard",
            l.tp
        ));
    }
    if l.offload != parallax_ir::Offload::None {
        let node = &s.profile.node;
        if node.host_link_bandwidth().is_none()
            || node.host_memory_bandwidth().is_none()
            || node.host_memory_gib.is_none()
        {
            return Err(Infeasible::Unsupported(format!(
                "offload {}: the profile gives no host link, host memory bandwidth or host memory size (node.pcie_host_gbps, node.host_memory_gbps, node.host_memory_gib)",
                l.offload
            )));
        }
        if l.offload.nvme() && node.nvme.is_none() {
            return Err(Infeasible::Unsupported(format!(
                "offload {}: the profile describes no NVMe drives (node.nvme: `parallax calibrate --nvme DIR` measures them)",
                l.offload
            )));
        }
    }
    let etp = l.expert_tp();
    if let Some(moe) = m.moe {
        if moe.experts % u64::from(l.ep) != 0 {
            return ind(format!("ep {} must divide {} experts", l.ep, moe.experts));
        }
        if m.ffn_hidden % u64::from(etp) != 0 {
            return ind(format!(
                "etp {etp} must divide the experts' FFN width {}",
                m.ffn_hidden
            ));
        }
        if etp != l.tp && l.tp > 1 && !l.sequence_parallel {
            // Without sequence parallelism every TP rank holds all the tokens, and the MoE
            // layer is inside the tensor-parallel region (Megatron-Core requires sequence
            // parallelism for MoE with tp > 1).
            return ind(format!(
                "etp {etp} apart from tp {} needs sequence parallelism",
                l.tp
            ));
        }
    } else if l.ep > 1 || etp != l.tp || !l.dispatcher.is_all_to_all() {
        return ind(format!(
            "ep {} / etp {etp} / dispatcher {}: expert parallelism needs a mixture-of-experts model",
            l.ep, l.dispatcher
        ));
    }
    // Degrees against the batch and the layers (micro-batch ≥ 1, divisibility, stages).
    l.validate(s.global_batch, Some(m.layers))
        .map_err(|what| Infeasible::Indivisible { what })?;
    let m_count = l.micro_batches(s.global_batch);
    if l.interleave > 1 && m_count % u64::from(l.pp) != 0 {
        return ind(format!(
            "interleaved schedule: {m_count} micro-batches not a multiple of pp {}",
            l.pp
        ));
    }
    Ok(())
}

/// The section graphs of one model as tensor-parallel shards build them, kept for reuse: a
/// section's graph depends only on the TP degree, the micro-batch shape and the section, while
/// layouts differing in everything else (expert parallelism, recomputation, schedule…) price
/// the same graphs. One cache serves one model (a search's).
#[derive(Debug, Default)]
pub struct SectionGraphs {
    graphs: Mutex<HashMap<GraphKey, Arc<SectionGraph>>>,
}

/// A section graph's identity within one model: TP degree, float size, micro-batch shape,
/// section.
type GraphKey = (u64, u64, BuildOptions, Section);

/// What a section keeps depends on: sequence parallelism, the selective policy, how linear
/// layers keep their inputs ([`SectionGraph::saved`]).
type SavedKey = (bool, Option<SelectivePolicy>, LinearInputs);

/// A section graph with what pricing reads of it, computed once: each node's input shapes and
/// work, the nodes selective recomputation redoes, and the bytes it keeps for backward under
/// each sequence-parallel and recompute setting, as first asked.
#[derive(Debug)]
struct SectionGraph {
    graph: Graph,
    shapes: Vec<Vec<Shape>>,
    work: Vec<parallax_ir::Work>,
    /// Per node: a linear layer every TP rank holds whole ([`duplicated_over_tp`]).
    duplicated: Vec<bool>,
    /// Elements of its parameter tensors as module code holds them, in forward order
    /// ([`module_weights`]).
    weights: Vec<u64>,
    redo: Mutex<HashMap<SelectivePolicy, Arc<[bool]>>>,
    saved: Mutex<HashMap<SavedKey, f64>>,
}

impl std::ops::Deref for SectionGraph {
    type Target = Graph;
    fn deref(&self) -> &Graph {
        &self.graph
    }
}

impl SectionGraph {
    fn new(graph: Graph, fb: u64) -> Self {
        let shapes = graph.nodes.iter().map(|n| graph.input_shapes(n)).collect();
        let work = graph.nodes.iter().map(|n| graph.node_work(n, fb)).collect();
        let duplicated = graph.nodes.iter().map(duplicated_over_tp).collect();
        let weights = module_weights(&graph);
        SectionGraph {
            graph,
            shapes,
            work,
            duplicated,
            weights,
            redo: Mutex::default(),
            saved: Mutex::default(),
        }
    }

    /// The nodes selective recomputation under `policy` redoes.
    fn redo(&self, policy: SelectivePolicy) -> Arc<[bool]> {
        if let Some(r) = lock(&self.redo).get(&policy) {
            return Arc::clone(r);
        }
        let r: Arc<[bool]> = recomputed_nodes(&self.graph, policy).into();
        Arc::clone(lock(&self.redo).entry(policy).or_insert(r))
    }

    /// [`saved_bytes`] with sequence parallelism `sp`, where `selective` its policy's
    /// recomputed nodes, and linear layers keeping their inputs as `inputs` says (one setup's
    /// `fb`, `tp` and `hidden` per cache). A selective policy keeps no gathered input: the
    /// only stack that would (torchtitan) runs its all-gathers again.
    fn saved(
        &self,
        fb: u64,
        sp: bool,
        tp: u32,
        hidden: u64,
        selective: Option<SelectivePolicy>,
        inputs: LinearInputs,
    ) -> f64 {
        let inputs = LinearInputs {
            gathered: inputs.gathered && sp && selective.is_none(),
            ..inputs
        };
        let key = (sp, selective, inputs);
        if let Some(&b) = lock(&self.saved).get(&key) {
            return b;
        }
        let redo = selective.map(|p| Recomputed {
            nodes: self.redo(p),
            replayed: p.replays_block(),
        });
        let b = saved_bytes(&self.graph, fb, sp, tp, hidden, redo.as_ref(), inputs);
        lock(&self.saved).insert(key, b);
        b
    }
}

/// A cache's map: a panic while holding the lock leaves it consistent (one insert).
fn lock<K, V>(m: &Mutex<HashMap<K, V>>) -> MutexGuard<'_, HashMap<K, V>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SectionGraphs {
    /// `section` of the model's `tp`-way shard `shard` at `opts`, built once.
    fn get(
        &self,
        shard: &TransformerConfig,
        (tp, fb): (u64, u64),
        section: Section,
        opts: BuildOptions,
    ) -> Result<Arc<SectionGraph>, Infeasible> {
        let key = (tp, fb, opts, section);
        if let Some(g) = self.lock().get(&key) {
            return Ok(Arc::clone(g));
        }
        // Built outside the lock: two threads may build one graph, never wait for each other.
        let g = Arc::new(SectionGraph::new(
            shard
                .build_section(section, opts)
                .map_err(|e| Infeasible::Unsupported(e.to_string()))?,
            fb,
        ));
        self.lock().insert(key, Arc::clone(&g));
        Ok(g)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<GraphKey, Arc<SectionGraph>>> {
        // A panic while holding the lock leaves the map consistent (one insert).
        self.graphs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One layer's sequence-parallel collectives and the GEMMs beside them, for
/// [`async_tp_exposed`].
struct AsyncTp {
    /// An all-gather of a block input (or, in backward, of a row-parallel output gradient).
    gather: Seconds,
    /// A reduce-scatter of a row-parallel output (or a column-parallel input gradient).
    scatter: Seconds,
    /// The kernel that sums the tp partial blocks a fused reduce-scatter received.
    reduce: Seconds,
    /// All-gather / reduce-scatter pairs per layer (attention and MLP).
    regions: f64,
    tp: u32,
    /// The gathered tensor is what the matmuls read: not under torchao's rowwise fp8, whose
    /// tensor-parallel gathers are 16-bit and cast after ([`Fp8Recipe::gathers_fp8`]).
    gathers_into_matmuls: bool,
    /// The layer's column- and row-parallel linear layers.
    column: OpTimes,
    row: OpTimes,
}

/// Forward and backward tensor-parallel time one layer leaves exposed under PyTorch's
/// asynchronous TP ([`TpOverlap::MicroPipelined`]), by what inductor's micro-pipeline pass
/// fuses (`torch/_inductor/fx_passes/micro_pipeline_tp.py`, the symmetric-memory ops of
/// `torch/distributed/_symmetric_memory`):
/// - an all-gather whose result the matmuls read (forward into the column-parallel layers;
///   backward the row-parallel layers' output gradient into their input-gradient matmul):
///   the rank's own block computes first while the others arrive, so the gather hides behind
///   `(tp − 1)/tp` of those matmuls. Under rowwise fp8 the gathered tensor is cast before any
///   matmul reads it: no fusion, the gather waits.
/// - a matmul whose only user is a reduce-scatter (forward, out of the row-parallel layers):
///   its row blocks go to their ranks as they finish, so all but the last block's transfer
///   hides behind the matmul, and a kernel of its own then sums the tp blocks received.
/// - the backward reduce-scatter of a block input's gradient is not fused: the input feeds
///   several matmuls (torchtitan's separate `wq`, `wk`, `wv` and `w1`, `w3`), so its
///   gradient is their sum, not one matmul's output (the pass needs the reduce-scatter's
///   input to be a matmul with no other user).
///
/// The copies run on copy engines, so the matmuls keep their SMs. The row blocks are GEMMs
/// of `1/tp` the rows; at the sizes tensor parallelism is used for (a block of 8k tokens
/// or more) they run at the full GEMM's rate, which this keeps.
fn async_tp_exposed(a: &AsyncTp) -> (Seconds, Seconds) {
    let r = a.regions;
    let ahead = (f64::from(a.tp) - 1.0) / f64::from(a.tp);
    let hidden_gather = |behind: Seconds| {
        if a.gathers_into_matmuls {
            Seconds((a.gather.0 * r - behind.0 * ahead).max(0.0))
        } else {
            a.gather * r
        }
    };
    let last_block = a.scatter * (1.0 / (f64::from(a.tp) - 1.0).max(1.0));
    let fwd = hidden_gather(a.column.fwd)
        + Seconds((a.scatter.0 * r - a.row.fwd.0).max(0.0))
        + (last_block + a.reduce) * r;
    let bwd = hidden_gather(a.row.bwd_input) + a.scatter * r;
    (fwd, bwd)
}

/// Host time one MoE layer costs each micro-batch with the GPU idle, on the H100 hosts of
/// Megatron-Core's published MoE runs. Megatron's token dispatchers make the host wait for
/// the GPU before the expert-parallel exchange (the split sizes of the all-to-all and the
/// sizes DeepEP allocates for must be host values: `_maybe_update_cuda_sync_point`
/// ("before_ep_alltoall"), megatron/core/transformer/moe/token_dispatcher.py; without
/// expert or tensor parallelism "before_finish", since the experts' grouped GEMM takes its
/// split sizes from the host too), so the router's, the dispatcher's and the permutation's
/// Python and launches that follow cannot run ahead of the GPU; Megatron-Core's MoE guide names this "CPU overhead" and captures
/// `moe_router` and `moe_preprocess` in CUDA graphs against it. Fitted over the MoE group of
/// `moe-zero-offload.json` (ten Megatron-Bridge / Megatron-Core runs of six models on 16–1,024
/// H100s, the release the case file flags as regressed left out): what each run's step
/// misses per MoE layer and micro-batch is 2.3–3.6 ms for five of the six models (5.3–5.5 ms
/// for GPT-OSS, −1.5 for Mixtral), with no trend in the layer's size.
pub const MOE_HOST_S: f64 = 2.9e-3;

/// SMs Transformer Engine's userbuffers give each pipelined reduce-scatter and each bulk
/// collective (`num_sm` 16 for every method but the ring exchange, `initialize_ub`'s
/// defaults, transformer_engine/pytorch/module/base.py).
const USERBUFFERS_COMM_SMS: u32 = 16;

/// Pieces the pipelined reduce-scatter splits its GEMM into (`num_splits` 4, same defaults; the
/// ring exchange splits into tp).
const USERBUFFERS_PIPELINE_SPLITS: u32 = 4;

/// CUDA streams the pieces of a split GEMM are dealt round-robin to
/// (`NVTE_COMM_OVERLAP_MAX_STREAMS`, transformer_engine/common/include/transformer_engine/
/// comm_gemm_overlap.h).
const USERBUFFERS_STREAMS: u32 = 3;

/// SMs assumed where a profile does not give its chip's (`device.sm_count`): an H100 SXM5's.
const DEFAULT_SM_COUNT: u32 = 132;

/// One layer's sequence-parallel collectives and the GEMMs beside them, for
/// [`userbuffers_costs`].
struct Userbuffers<'a> {
    /// An all-gather of a block input (or, in backward, of an output gradient or the
    /// re-gathered input of a column-parallel weight gradient).
    gather: Seconds,
    /// A reduce-scatter of a row-parallel output (or a column-parallel input gradient).
    scatter: Seconds,
    /// All-gather / reduce-scatter pairs per layer (attention and MLP).
    regions: f64,
    tp: u32,
    /// The chip's streaming multiprocessors.
    sms: u32,
    column: &'a TpLinears,
    row: &'a TpLinears,
}

/// What Transformer Engine's userbuffers overlap ([`TpOverlap::Userbuffers`]) costs one layer:
/// the GEMM time it adds, and the forward and backward communication it leaves exposed. TE
/// runs each collective one of three ways (`initialize_ub`, transformer_engine/pytorch/module/
/// base.py):
/// - ring exchange (forward into the column-parallel layers, backward into the row-parallel
///   layers' input gradient): the GEMM runs as tp pieces of 1/tp of its rows, each on the
///   block that has arrived while copy engines pass the next one on; the rank's own block
///   goes first, so a step waits only where a transfer outlasts a piece.
/// - pipeline (the reduce-scatter out of the row-parallel layers): the GEMM runs as 4
///   pieces on the SMs the 16-SM reduce-scatter kernel leaves it, each piece's
///   reduce-scatter under the next piece; the last one's waits.
/// - bulk (backward of the column-parallel layers): the re-gather of their input under
///   the input-gradient GEMM and the reduce-scatter of that gradient under the
///   weight-gradient GEMM, each GEMM without the collective's SMs while it runs.
///
/// Pieces run three at a time at the efficiency of their summed size
/// ([`TpLinears::gemm_time`]). The pipelined GEMM runs on `sms − 16` SMs throughout
/// (`set_sm_margin`, on for it in TE 2's defaults and NeMo's tuned configurations), so
/// `sms / (sms − 16)` as long (its fp8 casts run before it, on every SM); a bulk collective's
/// GEMM loses 16 of `sms` SMs only while the collective runs (TE 1's defaults and NeMo's
/// configurations leave bulk overlaps without a margin).
fn userbuffers_costs(dev: &DeviceModel, u: &Userbuffers) -> (OpTimes, Seconds, Seconds) {
    let (r, tp) = (u.regions, f64::from(u.tp));
    let comm_sms = USERBUFFERS_COMM_SMS.min(u.sms.saturating_sub(1));
    let margin = f64::from(u.sms) / f64::from(u.sms - comm_sms);
    let (c, w) = (u.column.times, u.row.times);
    // A ring exchange over `r` regions hiding behind `gemm`, split into tp pieces.
    let step = u.gather / (tp - 1.0).max(1.0);
    let ring = |gemm: Seconds| Seconds(r * (tp - 1.0) * (step.0 - gemm.0 / (r * tp)).max(0.0));
    // A bulk collective of `r` regions under `gemm`.
    let bulk = |comm: Seconds, gemm: Seconds| Seconds(r * (comm.0 - gemm.0 / r).max(0.0));
    let splits = f64::from(USERBUFFERS_PIPELINE_SPLITS);
    let piece = u.scatter / splits;

    // Each side's GEMMs whole and split as each method splits them, priced once.
    let more = |split: Seconds, whole: Seconds| Seconds((split - whole).0.max(0.0));
    let (column_whole, row_whole) = (u.column.gemm_time(dev, 1, 1), u.row.gemm_time(dev, 1, 1));
    let row_pieces = u
        .row
        .gemm_time(dev, USERBUFFERS_PIPELINE_SPLITS, USERBUFFERS_STREAMS);

    let column_fwd = c.fwd
        + more(
            u.column.gemm_time(dev, u.tp, USERBUFFERS_STREAMS),
            column_whole,
        );
    let row_fwd = w.fwd + more(row_pieces, row_whole) + row_pieces * (margin - 1.0);
    let pipelined =
        Seconds(r * (piece.0 + (splits - 1.0) * (piece.0 - row_fwd.0 / (r * splits)).max(0.0)));
    let fwd = ring(column_fwd) + pipelined;

    let row_dgrad = w.bwd_input + more(u.row.gemm_time(dev, u.tp, USERBUFFERS_STREAMS), row_whole);
    // A bulk collective's SMs are the GEMM's again once it is done.
    let beside = |comm: Seconds, gemm: Seconds| {
        gemm + Seconds(comm.0.min(gemm.0) * f64::from(comm_sms) / f64::from(u.sms))
    };
    let column_dgrad = beside(u.gather, c.bwd_input);
    let column_wgrad = beside(u.scatter, c.bwd_weight);
    let bwd = ring(row_dgrad) + bulk(u.gather, column_dgrad) + bulk(u.scatter, column_wgrad);

    let extra = OpTimes {
        fwd: (column_fwd - c.fwd) + (row_fwd - w.fwd),
        bwd_input: (row_dgrad - w.bwd_input) + (column_dgrad - c.bwd_input),
        bwd_weight: column_wgrad - c.bwd_weight,
    };
    (extra, fwd, bwd)
}

/// Prices one layer, the embeddings and the head under `l`.
pub fn transformer_costs(s: &Setup, l: &Layout) -> Result<TransformerCosts, Infeasible> {
    transformer_costs_with(s, l, &SectionGraphs::default())
}

/// [`transformer_costs`] with the section graphs from (and into) `graphs`, a cache of the
/// setup's model.
pub fn transformer_costs_with(
    s: &Setup,
    l: &Layout,
    graphs: &SectionGraphs,
) -> Result<TransformerCosts, Infeasible> {
    check_layout(s, l)?;
    let loss = s.runtime.loss(l.tp, s.precision);
    let dev = DeviceModel::new(s.profile, s.precision)
        .map_err(|e| Infeasible::Unsupported(e.to_string()))?
        .with_eager(s.runtime.runs_eager(s.precision))
        .with_autocast(s.runtime.autocast)
        .with_fp8_recipe(s.runtime.fp8_recipe)
        .with_native_attention(s.runtime.native_attention)
        .with_cross_entropy(loss);
    let net = Network::new(s.profile);
    let gpn = s.profile.node.gpus_per_node;
    let fb = s.float_bytes();
    let (tp, cp) = (u64::from(l.tp), u64::from(l.cp));
    let shard = s
        .rank_shard(l.tp)
        .ok_or_else(|| Infeasible::Indivisible { what: "tp".into() })?;
    let opts = micro_batch_options(s, l);
    let seq_local = opts.seq;
    let build = |sec, opts| graphs.get(&shard, (tp, fb), sec, opts);
    let head_seq = head_tokens(s, seq_local);
    let (embed, head) = (
        build(Section::Embedding, opts)?,
        build(
            Section::Head,
            BuildOptions {
                seq: head_seq,
                ..opts
            },
        )?,
    );
    let sp = l.sequence_parallel && l.tp > 1;
    let hidden = s.model.hidden;
    let tp_group = Group::strided(l.tp, 1, gpn);
    let cp_group = Group::strided(l.cp, l.tp, gpn);
    let act = Bytes(l.micro_batch * seq_local * hidden * fb);

    // Tensor-parallel collectives per layer: 2 all-reduces forward (attention and MLP outputs)
    // and 2 backward (inputs of the column-parallel layers); with sequence parallelism each
    // becomes an all-gather plus a reduce-scatter of the same volume (Korthikanti et al. 2022).
    // FP8 training gathers the GEMM inputs (and, in backward, the output gradients) already
    // cast to 8 bits: Transformer Engine's layer-norm output and gradient gathers and torchao's
    // `Float8ColwiseParallel` / `Float8RowwiseParallel` cast before they all-gather; the
    // reduce-scatters of GEMM outputs stay 16-bit. Under torchao's rowwise recipe the gathers
    // stay 16-bit and the gathered tensor is cast before any matmul reads it
    // ([`Fp8Recipe::gathers_fp8`]).
    let (gathered, gathers_into_matmuls) = match (s.precision, s.runtime.fp8_recipe.gathers_fp8()) {
        (Precision::Fp8, true) => (Bytes(act.0 / fb), true),
        (Precision::Fp8, false) => (act, false),
        _ => (act, true),
    };
    let (tp_gather, tp_scatter) = (
        net.collective(Collective::AllGather, gathered, tp_group),
        net.collective(Collective::ReduceScatter, act, tp_group),
    );
    let tp_one = if sp {
        tp_gather + tp_scatter
    } else {
        net.collective(Collective::AllReduce, act, tp_group)
    };
    let inputs = LinearInputs {
        fp8: s.keeps_fp8_linear_inputs(),
        gathered: s.runtime.sp_keeps_gathered_inputs,
        gathered_fp8: s.precision == Precision::Fp8 && s.runtime.fp8_recipe.gathers_fp8(),
    };
    let zero = &s.runtime.zero_config;
    // One layer of `kind` as a device runs it, its MoE MLP under `experts`.
    let price_layer = |kind: LayerKind, block: &SectionGraph, experts: Option<ExpertRanks>| {
        let block_prices = NodePrices::new(&dev, block, fb, sp, l.tp, hidden, cp, experts);
        let mut layer = price(block, &block_prices, fb, sp, l.tp, hidden, inputs, zero);
        // The experts' activations as this rank keeps them (the graph's shard has them as
        // the TP region would: every token, the FFN split over tp).
        let experts_kept = |redo: Option<&[bool]>| {
            experts.map_or(0.0, |e| e.kept_beyond_graph(block, fb, redo, inputs.fp8))
        };
        // What autocast and eager `gelu_new` keep beyond the graph's tensors.
        let beyond = |redo: Option<&[bool]>| {
            let autocast = if s.runtime.autocast {
                autocast_kept(block, fb, sp, u64::from(l.tp), redo)
            } else {
                0.0
            };
            let eager = if s.runtime.runs_eager(s.precision) {
                gelu_new_kept(block, fb, s.runtime.autocast, redo)
            } else {
                0.0
            };
            autocast + eager
        };
        layer.saved =
            Bytes((layer.saved.0 as f64 + experts_kept(None) + beyond(None)).max(0.0) as u64);
        // Under sequence parallelism an MoE layer reads the sequence-split tokens directly: its
        // dispatcher replaces the MLP's gather and reduce-scatter over the TP group, so only the
        // attention's pair remains (none in a hybrid stack's MoE layer) — unless shared
        // experts, a tensor-parallel MLP, need them.
        let shared = s.model.moe.is_some_and(|m| m.shared_ffn_hidden > 0);
        let tp_regions = f64::from(kind.tp_regions())
            - if experts.is_some() && sp && !shared {
                1.0
            } else {
                0.0
            };
        let (tp_fwd, tp_bwd) = match s.runtime.tp_overlap {
            // Only the all-gather / reduce-scatter pairs of sequence parallelism are pipelined
            // this way (Megatron asserts sequence parallelism for `--tp-comm-overlap`);
            // all-reduces wait. Userbuffers are Transformer Engine's: before Ampere the
            // collectives wait as without them.
            TpOverlap::Userbuffers if l.tp > 1 && sp && dev.device().runs_transformer_engine() => {
                let (column, row) = block_prices.tp_linears(block, hidden);
                let (extra, fwd, bwd) = userbuffers_costs(
                    &dev,
                    &Userbuffers {
                        gather: tp_gather,
                        scatter: tp_scatter,
                        regions: tp_regions,
                        tp: l.tp,
                        sms: dev.device().sm_count.unwrap_or(DEFAULT_SM_COUNT),
                        column: &column,
                        row: &row,
                    },
                );
                layer.compute = layer.compute + extra;
                (fwd, bwd)
            }
            TpOverlap::MicroPipelined if l.tp > 1 && sp => {
                let (column, row) = block_prices.tp_linears(block, hidden);
                let (column, row) = (column.times, row.times);
                async_tp_exposed(&AsyncTp {
                    gather: tp_gather,
                    scatter: tp_scatter,
                    reduce: dev.memory(act.0 as f64 * (1.0 + 1.0 / tp as f64)),
                    regions: tp_regions,
                    tp: l.tp,
                    gathers_into_matmuls,
                    column,
                    row,
                })
            }
            TpOverlap::AsyncBackward if l.tp > 1 => {
                let c = block_prices.tp_linears(block, hidden).0.times;
                let bwd = if sp {
                    tp_gather * tp_regions
                        + exposed(tp_gather * tp_regions, c.bwd_input)
                        + exposed(tp_scatter * tp_regions, c.bwd_weight)
                } else {
                    exposed(tp_one * tp_regions, c.bwd_weight)
                };
                (tp_one * tp_regions, bwd)
            }
            _ => (tp_one * tp_regions, tp_one * tp_regions),
        };
        layer.tp_fwd = tp_fwd;
        layer.tp_bwd = tp_bwd;
        // Context parallelism: a ring passes K and V (cp − 1) times in forward, and K, V and their
        // gradients in backward; each step overlaps the attention of the previous block.
        if l.cp > 1 && kind.has_attention() {
            let kv = Bytes(2 * l.micro_batch * seq_local * shard.kv_heads * shard.head_dim * fb);
            let steps = (cp - 1) as f64;
            let attn = block_prices.time(block, |op| matches!(op, OpKind::Attention(_)));
            let fwd_comm = net.collective(Collective::AllGather, Bytes(kv.0 * cp), cp_group);
            layer.cp_fwd = exposed(fwd_comm, attn.fwd * (steps / cp as f64));
            layer.cp_bwd = exposed(fwd_comm * 2.0, attn.bwd_input * (steps / cp as f64));
        }
        // The MoE dispatcher (Megatron-Core's all-to-all dispatcher): each rank sends its routed
        // token copies to the ranks holding their experts and receives them back after the
        // experts (dispatch and combine, mirrored in backward); with the experts split over etp
        // ranks, the received tokens are gathered over those and the outputs reduce-scattered
        // back (top-k times the dense MLP's gather, which is why recipes fold etp to 1).
        if let Some(e) = experts {
            let routed = e.routed_bytes(fb);
            let mut one = dispatch(&net, l, &e, gpn, routed, l.dispatcher) * 2.0;
            if e.gathers_over_etp() {
                let etp_group = Group::strided(e.etp, 1, gpn);
                let gathered = Bytes(routed.0 * u64::from(e.etp));
                one += net.collective(Collective::AllGather, gathered, etp_group)
                    + net.collective(Collective::ReduceScatter, gathered, etp_group);
            }
            layer.ep_fwd = one;
            layer.ep_bwd = one;
            // Without expert parallelism the dispatcher still syncs, later ("before_finish"):
            // the grouped GEMM's split sizes are host values too.
            if s.runtime.moe_host_sync {
                layer.host_fwd = Seconds(MOE_HOST_S);
            }
            let sort = e.sort(&dev, l.dispatcher, fb);
            layer.compute.fwd += sort;
            layer.compute.bwd_input += sort;
            // Expert weights are spread over ep × etp ranks; the graph's shard split them over tp.
            let whole = e.moe.experts * e.mats * e.width * s.model.ffn_hidden;
            layer.params = layer.params - whole / tp + whole / u64::from(l.ep * e.etp);
            layer.expert_params = whole / u64::from(l.ep * e.etp);
        }
        // Recomputation. A layer's input is the residual stream, fp32 under autocast.
        let stream = if s.runtime.autocast {
            act.0 * 4 / fb
        } else {
            act.0
        };
        let layer_input = if sp { stream / tp } else { stream };
        match l.recompute {
            Recompute::None => {}
            Recompute::Selective | Recompute::Modules(_) => {
                // Recompute the cheap ops in backward and keep the expensive ones' outputs: the
                // attention core when unfused (Korthikanti et al. 2022 §5), norms and pointwise
                // ops (torchtitan's op-level selective checkpointing keeps matmul and attention
                // outputs). Flash attention recomputes its own scores anyway. Or the
                // submodules the layout names (Megatron-Core's `--recompute-modules`).
                let policy = match l.recompute {
                    Recompute::Modules(m) => SelectivePolicy::Modules(m),
                    _ => s.runtime.selective,
                };
                let redo = block.redo(policy);
                let kept = block.saved(fb, sp, l.tp, hidden, Some(policy), inputs)
                    + experts_kept(Some(&redo))
                    + beyond(Some(&redo));
                layer.saved = Bytes(kept.max(0.0) as u64);
                let (time, flops) = block_prices.recompute(Some(&redo));
                layer.recompute = time;
                layer.hardware_flops += flops;
                // torchtitan's op-level policy saves the reduce-scatters' outputs but not the
                // all-gathers' (its `_save_list`), whose outputs the matmuls' weight gradients
                // read: backward gathers each region's input again, exposed.
                if policy == SelectivePolicy::CheapOpsAndAlternateMatmuls && sp && l.tp > 1 {
                    layer.tp_bwd += tp_gather * tp_regions;
                }
                // Recomputing the MoE layer runs its dispatch and combine again.
                if matches!(policy, SelectivePolicy::Modules(m) if m.contains(RecomputeModules::MOE))
                {
                    layer.ep_bwd += layer.ep_fwd;
                    layer.host_bwd += layer.host_fwd;
                }
            }
            Recompute::Full | Recompute::Every(_) => {
                // A share of the layers (all, or every k-th) keeps only its input and runs its
                // forward again in backward; the per-layer figures are the mean over a stage's
                // layers, whose sums are what the schedule and the memory add up.
                let p = l.recompute.whole_layers();
                layer.recompute = layer.compute.fwd * p;
                // The recomputed forward repeats its collectives (and an MoE layer its dispatch).
                layer.tp_bwd += layer.tp_fwd * p;
                layer.ep_bwd += layer.ep_fwd * p;
                layer.host_bwd += layer.host_fwd * p;
                // A recomputed layer materialises its activations again during its backward.
                layer.working = layer.saved;
                layer.saved =
                    Bytes((layer_input as f64 * p + layer.saved.0 as f64 * (1.0 - p)) as u64);
                layer.hardware_flops += block_prices.recompute(None).1 * p;
            }
        }
        layer
    };
    let experts = s
        .model
        .moe
        .map(|moe| ExpertRanks::of(s.model, moe, l, &opts, s.runtime.balanced_routing));
    let mut kinds = [None; LayerKind::COUNT];
    for kind in s.model.layer_kinds() {
        let graph = build(Section::Layer(kind), opts)?;
        let routed = experts.filter(|_| kind.routes(true));
        kinds[kind.index()] = Some(price_layer(kind, &graph, routed));
    }

    // Embedding (vocab-parallel: an all-reduce of its output over TP) and head (vocab-parallel
    // cross-entropy: small all-reduces of per-token max and sum).
    // Both see only their own tokens (no attention): priced without the CP factor.
    let price_local = |g: &SectionGraph| {
        let prices = NodePrices::new(&dev, g, fb, sp, l.tp, hidden, 1, None);
        price(g, &prices, fb, sp, l.tp, hidden, inputs, zero)
    };
    let mut embedding = price_local(&embed);
    embedding.tp_fwd = if l.tp > 1 { tp_one } else { Seconds(0.0) };
    embedding.tp_bwd = Seconds(0.0);
    let mut head_cost = price_local(&head);
    head_cost.tp_fwd = if l.tp > 1 { tp_one } else { Seconds(0.0) };
    head_cost.tp_bwd = head_cost.tp_fwd;
    // The loss peaks at the start of backward (see `LOSS_BYTES_PER_LOGIT`); the logits are not
    // saved.
    let logits = l.micro_batch * head_seq * shard.vocab;
    head_cost.working = Bytes(logits * loss.bytes_per_logit(fb));
    head_cost.saved = Bytes(head_cost.saved.0.saturating_sub(logits * fb));
    if s.model.tied_embeddings && l.pp == 1 {
        // A single-stage tied model shares the table with the embedding; across stages the
        // last stage keeps a copy (Megatron-LM), as untied models keep their own head.
        head_cost.params = head_cost.params.saturating_sub(shard.vocab * hidden);
        head_cost.param_tensors = head_cost.param_tensors.saturating_sub(1);
    }
    // Multi-token prediction modules run on the last stage after the head (Megatron-Core
    // places them there): each its input (the next tokens' embedding from its own copy of
    // the table, two norms, the projection), a block like the last layer, and a second pass
    // through the head, whose table it shares.
    if s.model.mtp_layers > 0 {
        let input = price_local(&*build(Section::MtpInput, opts)?);
        let last = kinds[s.model.layer_kind(s.model.layers - 1).index()].unwrap_or_default();
        let head_pass = PartCost {
            params: head_cost.params.saturating_sub(shard.vocab * hidden),
            param_tensors: head_cost.param_tensors.saturating_sub(1),
            ..head_cost
        };
        let module = input + last + head_pass;
        for _ in 0..s.model.mtp_layers {
            head_cost = head_cost + module;
        }
    }

    // Pipeline messages ([`PipeMessages`]): a piece of 1/tp of the activation crosses to the
    // next stage and is all-gathered over the tensor-parallel group there; backward, the
    // input gradient as the stack's engine sends it.
    let p2p_bytes = Bytes(act.0 / tp);
    let stage_stride = l.tp * l.cp * l.dp;
    let cross_node = stage_stride >= gpn && s.gpus > gpn;
    let piece = net.p2p(p2p_bytes, cross_node);
    let gather = if l.tp > 1 {
        net.collective(Collective::AllGather, act, tp_group)
    } else {
        Seconds(0.0)
    };
    let (grad_transfer, grad_gathers) = match s.runtime.pipe_messages {
        PipeMessages::Scattered => (piece, gather),
        PipeMessages::DeepSpeedPartitioned => (piece, gather * 2.0),
        PipeMessages::DeepSpeedWholeGrads => (net.p2p(act, cross_node), gather),
    };
    let p2p = piece + gather;
    let p2p_backward = grad_transfer + grad_gathers;

    Ok(TransformerCosts {
        kinds,
        stack: s.model.stack(),
        embedding,
        head: head_cost,
        tokens_per_microbatch: l.micro_batch * seq_local,
        p2p_bytes,
        p2p,
        p2p_backward,
        p2p_transfers: (piece, grad_transfer),
        tied_table: if s.model.tied_embeddings && l.pp > 1 {
            shard.vocab * hidden
        } else {
            0
        },
        head_output: Bytes(logits * fb),
    })
}

/// One device's time and FLOPs for every node of a section graph, each node priced once.
/// Under sequence parallelism the tensors and kernels outside the tensor-parallel region
/// (those of hidden width: norms, dropout, residuals) are split over the TP group as well.
/// Attention under context parallelism sees keys and values of the whole sequence: its work on
/// the local shard graph is scaled by `cp` (see [`local_share`]).
struct NodePrices {
    /// Per node, already scaled by its local share: times, training FLOPs, forward FLOPs.
    times: Vec<OpTimes>,
    train_flops: Vec<f64>,
    fwd_flops: Vec<f64>,
}

impl NodePrices {
    /// Prices every node of `g`; an MoE layer is priced as its rank runs it under `experts`
    /// ([`ExpertRanks`]): `experts / ep` local experts, each `ffn / etp` wide, over the
    /// tokens routed to them from all `ep` ranks (gathered over `etp`).
    #[allow(clippy::too_many_arguments)]
    fn new(
        dev: &DeviceModel,
        g: &SectionGraph,
        fb: u64,
        sp: bool,
        tp: u32,
        hidden: u64,
        cp: u64,
        experts: Option<ExpertRanks>,
    ) -> Self {
        let mut p = NodePrices {
            times: Vec::with_capacity(g.nodes.len()),
            train_flops: Vec::with_capacity(g.nodes.len()),
            fwd_flops: Vec::with_capacity(g.nodes.len()),
        };
        for (i, n) in g.nodes.iter().enumerate() {
            let k = local_share(g, i, sp, tp, hidden, cp);
            let (time, w) = match (&n.op, experts) {
                (OpKind::Moe(_), Some(e)) => {
                    // The FLOPs of the mean rank's rows; the time of the busiest rank's, whose
                    // experts the step waits for.
                    let work = |busiest| {
                        let ins = e.rank_inputs(&g.shapes[i], busiest);
                        let outs = [Shape::new([e.expert_rows(busiest), e.width])];
                        let w = n.op.work(&ins, &outs, &g.weight_flags(n), fb);
                        (ins, w)
                    };
                    let (busy, busy_work) = work(true);
                    (dev.op(&n.op, &busy, &busy_work, fb), work(false).1)
                }
                // A context-parallel rank's attention: its queries against every rank's
                // block of keys (`local_share` counts the cp blocks' work).
                (OpKind::Attention(_), _) if cp > 1 => {
                    let t = dev.ring_attention(&n.op, &g.shapes[i], &g.work[i], fb, cp);
                    (t * (1.0 / cp as f64), g.work[i])
                }
                // Under sequence parallelism a linear layer casts what its rank holds: a
                // column-parallel layer's input before the all-gather, a row-parallel layer's
                // output gradient before its all-gather (fp8 moves over the TP group in
                // fp8), each the 1/tp of the tokens the graph's shard shows. Where the
                // recipe gathers 16 bits (rowwise), each rank casts the gathered whole.
                (OpKind::Linear(attrs), _)
                    if sp
                        && tp > 1
                        && dev.casts_linear_layers()
                        && dev.fp8_recipe().gathers_fp8() =>
                {
                    let shapes = &g.shapes[i];
                    let whole = DeviceModel::linear_cast_elems(shapes, attrs, &g.work[i], fb);
                    let split = |elems: f64, width: Option<u64>| {
                        if width == Some(hidden) {
                            elems / f64::from(tp)
                        } else {
                            elems
                        }
                    };
                    let output_width = n.outputs.first().map(|t| g.tensor(*t).shape.last());
                    let local = dev.fp8_linear_casts(LinearCasts {
                        input: split(whole.input, shapes.first().map(|x| x.last())),
                        output: split(whole.output, output_width),
                        weight: whole.weight,
                    });
                    let time =
                        dev.op(&n.op, shapes, &g.work[i], fb) - dev.fp8_linear_casts(whole) + local;
                    (time, g.work[i])
                }
                _ => (dev.op(&n.op, &g.shapes[i], &g.work[i], fb), g.work[i]),
            };
            p.times.push(time * k);
            p.train_flops.push(w.train_flops().0 * k);
            p.fwd_flops.push(w.fwd_flops.0 * k);
        }
        p
    }

    /// Summed times of the nodes `pick` selects.
    fn time(&self, g: &Graph, pick: impl Fn(&OpKind) -> bool) -> OpTimes {
        (0..self.times.len())
            .filter(|&i| pick(&g.nodes[i].op))
            .fold(OpTimes::default(), |a, i| a + self.times[i])
    }

    /// The tensor-parallel linear layers: the column-parallel ones, which read the
    /// `hidden`-wide (gathered) input, and the row-parallel ones, which write the
    /// `hidden`-wide output that is reduced.
    fn tp_linears(&self, g: &SectionGraph, hidden: u64) -> (TpLinears, TpLinears) {
        let (mut column, mut row) = (TpLinears::default(), TpLinears::default());
        for (i, n) in g.nodes.iter().enumerate() {
            if !matches!(n.op, OpKind::Linear(_)) || g.duplicated[i] {
                continue;
            }
            let side = if g.shapes[i].first().map(|x| x.last()) == Some(hidden) {
                &mut column
            } else if n.outputs.first().map(|t| g.tensor(*t).shape.last()) == Some(hidden) {
                &mut row
            } else {
                continue;
            };
            side.times = side.times + self.times[i];
            side.gemm_flops.push(self.fwd_flops[i]);
        }
        (column, row)
    }

    /// Forward time and FLOPs of the nodes marked in `redo` (every node with `None`).
    fn recompute(&self, redo: Option<&[bool]>) -> (Seconds, f64) {
        let picked = |i: &usize| redo.is_none_or(|r| r[*i]);
        let idx = (0..self.times.len()).filter(picked);
        let t = idx.clone().map(|i| self.times[i].fwd).sum();
        (t, idx.map(|i| self.fwd_flops[i]).sum())
    }
}

/// One side (column- or row-parallel) of a layer's tensor-parallel linear layers.
#[derive(Default)]
struct TpLinears {
    /// Their summed times.
    times: OpTimes,
    /// Each one's GEMM FLOPs in one pass (forward, input gradient and weight gradient each
    /// multiply the same three extents).
    gemm_flops: Vec<f64>,
}

impl TpLinears {
    /// Time of one pass's GEMMs, each run as `pieces` GEMMs of `1/pieces` of its rows,
    /// `streams` of them at a time (each on its own CUDA stream, filling one another's
    /// partial waves): every group of `streams` pieces runs at the efficiency of their summed
    /// size and pays one launch.
    fn gemm_time(&self, dev: &DeviceModel, pieces: u32, streams: u32) -> Seconds {
        let n = f64::from(pieces.max(1));
        let together = f64::from(streams.clamp(1, pieces.max(1)));
        self.gemm_flops
            .iter()
            .map(|&f| dev.gemm(f * together / n) * (n / together))
            .sum()
    }
}

/// One device's micro-batch of a layout: its sequences, its context-parallel shard of each.
fn micro_batch_options(s: &Setup, l: &Layout) -> BuildOptions {
    BuildOptions {
        batch: l.micro_batch,
        seq: s.seq / u64::from(l.cp.max(1)),
        fused_attention: s.fused_attention(),
    }
}

/// One dispatch (or combine) of `routed` bytes of token copies over the layout's
/// expert-parallel group by `dispatcher`.
fn dispatch(
    net: &Network,
    l: &Layout,
    e: &ExpertRanks,
    gpn: u32,
    routed: Bytes,
    dispatcher: Dispatcher,
) -> Seconds {
    if l.ep <= 1 {
        return Seconds(0.0);
    }
    let ep_group = Group::strided(l.ep, e.etp, gpn);
    match dispatcher {
        Dispatcher::AllToAll => net.collective(Collective::AllToAll, routed, ep_group),
        Dispatcher::DeepEp => {
            let cap = e.moe.nodes_per_token(ep_group.nodes());
            net.deduplicated_dispatch(routed, e.moe.top_k, ep_group, cap)
        }
    }
}

/// The dispatcher that moves layout `l`'s routed tokens faster (it changes nothing else of
/// a step): what a search picks where the stack has both.
pub fn faster_dispatcher(s: &Setup, l: &Layout) -> Dispatcher {
    let Some(moe) = s.model.moe else {
        return Dispatcher::AllToAll;
    };
    let opts = micro_batch_options(s, l);
    let e = ExpertRanks::of(s.model, moe, l, &opts, s.runtime.balanced_routing);
    let net = Network::new(s.profile);
    let gpn = s.profile.node.gpus_per_node;
    let fb = s.float_bytes();
    let routed = e.routed_bytes(fb);
    let dev = DeviceModel::new(s.profile, s.precision).ok();
    let time = |d| {
        dispatch(&net, l, &e, gpn, routed, d)
            + dev.as_ref().map_or(Seconds(0.0), |dev| e.sort(dev, d, fb))
    };
    if time(Dispatcher::DeepEp) < time(Dispatcher::AllToAll) {
        Dispatcher::DeepEp
    } else {
        Dispatcher::AllToAll
    }
}

/// How one rank runs an MoE layer under a layout's (ep, etp): Megatron-Core's folded expert
/// parallelism, where each stage's dp × cp × tp ranks are regrouped as etp × ep × edp.
#[derive(Clone, Copy, Debug)]
struct ExpertRanks {
    /// The mixture: experts, top-k, routing groups.
    moe: MoeConfig,
    /// Weight matrices per expert (3 gated, 2 plain).
    mats: u64,
    ep: u64,
    etp: u32,
    /// Every TP rank holds all the tokens (tp > 1 without sequence parallelism; the layout
    /// check then keeps etp = tp: the experts inside the TP region).
    replicated: bool,
    /// Tokens this rank routes per micro-batch: its sequence-parallel share, or all of them
    /// when replicated.
    tokens: u64,
    /// Expert FFN width.
    ffn: u64,
    /// The width the experts read and write (and the dispatch moves): the model's hidden
    /// width, or LatentMoE's latent ([`MoeConfig::expert_width`]).
    width: u64,
    /// The busiest rank's share of the routed tokens against the mean (1: balanced routing),
    /// capped by the mixture's capacity and set by a padded one ([`MoeConfig::capped_load`]).
    /// The mean rank's rows, which count the step's FLOPs, stay the routed copies: padding is
    /// no model work, and MFU counts a dropless mixture's.
    load: f64,
}

impl ExpertRanks {
    fn of(
        m: &TransformerConfig,
        moe: MoeConfig,
        l: &Layout,
        opts: &BuildOptions,
        balanced: bool,
    ) -> Self {
        let split = l.sequence_parallel && l.tp > 1;
        let tokens = opts.batch * opts.seq / if split { u64::from(l.tp) } else { 1 };
        let routed = if balanced {
            1.0
        } else {
            busiest_rank_load(u64::from(l.ep), (tokens * moe.top_k) as f64)
        };
        ExpertRanks {
            load: moe.capped_load(routed),
            moe,
            mats: if m.mlp == parallax_ir::models::Mlp::Swiglu {
                3
            } else {
                2
            },
            ep: u64::from(l.ep),
            etp: l.expert_tp(),
            replicated: l.tp > 1 && !split,
            tokens,
            ffn: m.ffn_hidden,
            width: moe.expert_width(m.hidden),
        }
    }

    /// Bytes of the routed token copies one dispatch moves for the busiest rank (the
    /// all-to-all ends when it has them), at `fb` bytes an element.
    fn routed_bytes(&self, fb: u64) -> Bytes {
        Bytes(self.busiest(self.tokens * self.moe.top_k * self.width * fb))
    }

    /// The busiest rank's share of `mean` (bytes or rows routed per rank).
    fn busiest(&self, mean: u64) -> u64 {
        (mean as f64 * self.load).ceil() as u64
    }

    /// Time `dispatcher` spends, each pass, putting the received rows in local-expert order:
    /// Megatron-Core's all-to-all dispatcher receives each source rank's tokens grouped by
    /// expert and sorts them after the dispatch and back before the combine
    /// (`sort_chunks_by_idxs`), a copy of every received row each way; DeepEP's and HybridEP's
    /// kernels write them in expert order, and one local expert needs no order.
    fn sort(&self, dev: &DeviceModel, dispatcher: Dispatcher, fb: u64) -> Seconds {
        if !dispatcher.is_all_to_all() || self.ep <= 1 || self.moe.experts / self.ep <= 1 {
            return Seconds(0.0);
        }
        let rows = (self.expert_rows(true) * self.moe.top_k * self.width * fb) as f64;
        dev.memory(2.0 * rows) * 2.0
    }

    /// Whether routed tokens are gathered over the etp ranks of an expert after dispatch:
    /// the expert is split and its ranks hold different tokens.
    fn gathers_over_etp(&self) -> bool {
        self.etp > 1 && !self.replicated
    }

    /// Rows of the local experts' input on this rank, over all of them: the top-k copies of
    /// the tokens routed here (from `ep` ranks, gathered over `etp` unless every TP rank
    /// already holds them) — `rows × top_k` expert visits, as the op counts them; on the
    /// `busiest` rank, or on the mean one.
    fn expert_rows(&self, busiest: bool) -> u64 {
        let rows = if self.replicated {
            self.tokens
        } else {
            self.tokens * u64::from(self.etp)
        };
        if busiest {
            self.busiest(rows)
        } else {
            rows
        }
    }

    /// Bytes the MoE ops of `g` keep for backward on the busiest rank beyond what the graph's
    /// shard counts: the graph runs every token of the micro-batch through experts split over
    /// tp (the TP region's view), while the rank keeps the activations of the rows it
    /// actually receives (its sequence-parallel share, gathered over etp) at the local expert
    /// width `ffn / etp` (negative where that is less). MoE ops `redo` marks are not kept.
    fn kept_beyond_graph(
        &self,
        g: &SectionGraph,
        fb: u64,
        redo: Option<&[bool]>,
        fp8_inputs: bool,
    ) -> f64 {
        g.nodes
            .iter()
            .enumerate()
            .filter(|(i, n)| matches!(n.op, OpKind::Moe(_)) && !redo.is_some_and(|r| r[*i]))
            .map(|(i, n)| {
                let weights = g.weight_flags(n);
                // Its GEMM inputs as fp8 casts where the stack keeps those (`saved_bytes`).
                let extra = |ins: &[Shape]| {
                    let s = n.op.saves(ins, &weights);
                    (s.extra_elems * fb - fp8_saving(s.gemm_input_elems, fb, fp8_inputs)) as f64
                };
                extra(&self.rank_inputs(&g.shapes[i], true)) - extra(&g.shapes[i])
            })
            .sum()
    }

    /// The MoE op's inputs as this rank runs it (`graph` are the inputs of the graph's op:
    /// tokens, router, expert weights): the expert rows, the whole router, `experts / ep`
    /// local experts each `ffn / etp` wide.
    fn rank_inputs(&self, graph: &[Shape], busiest: bool) -> Vec<Shape> {
        let (local, width) = (self.moe.experts / self.ep, self.ffn / u64::from(self.etp));
        graph
            .iter()
            .enumerate()
            .map(|(i, x)| match i {
                0 => Shape::new([self.expert_rows(busiest), x.last()]),
                1 => x.clone(),
                // The MoE op's weights: up `ehf`, down `efh`, gate `ehf` (`OpKind::Moe`).
                3 => Shape::new([local, width, self.width]),
                _ => Shape::new([local, self.width, width]),
            })
            .collect()
    }
}

/// Bytes a layer keeps for backward under `torch.autocast` ([`Runtime::autocast`]) beyond what
/// its graph counts at the 16-bit training precision (`fb`; nothing at fp32), over the nodes
/// `redo` does not recompute (the rank's share of a norm's rows under sequence parallelism):
/// - a norm's input is the fp32 residual stream, kept at 4 bytes an element;
/// - HuggingFace's RMSNorm (`LlamaRMSNorm`, eager) keeps its fp32 normalized input too, which
///   the weight multiplies: its cast back goes to the input's dtype, fp32 here (4 more);
/// - an unfused attention core's softmax runs in fp32 and keeps its fp32 output, besides the
///   16-bit copy the next batched GEMM reads (the graph's);
/// - each weight's 16-bit cast, which its layer keeps until its backward (per micro-batch:
///   autocast's cache lives for one forward).
///
/// Measured on one H200 (transformers 5.17, PyTorch 2.11, SDPA, 2026-11-29), each model with
/// and without autocast: a Llama-like 1B model (hidden 2048, 16 layers, 8 × 2048 tokens) kept
/// 6.7 GiB more under autocast, GPT-2 4.2 GiB (12 layers, 16 × 1024); GPT-2 with eager
/// attention kept 6.7 bytes a score more than with SDPA, where a 16-bit model keeps 5. GPT-2's
/// `gelu_new` chain under autocast is [`gelu_new_kept`]'s.
fn autocast_kept(g: &SectionGraph, fb: u64, sp: bool, tp: u64, redo: Option<&[bool]>) -> f64 {
    if fb >= 4 {
        return 0.0;
    }
    let wide = (4 - fb) as f64;
    let rank_rows = if sp { tp.max(1) as f64 } else { 1.0 };
    let nodes: f64 = kept_nodes(g, redo)
        .map(|(op, ins)| {
            let first = ins.first().map_or(0.0, |x| x.elems() as f64);
            match op {
                OpKind::LayerNorm => wide * first / rank_rows,
                OpKind::RmsNorm => (wide + 4.0) * first / rank_rows,
                OpKind::Attention(a) if !a.fused => match (ins.first(), ins.get(1)) {
                    (Some(q), Some(k)) if q.rank() == 4 && k.rank() == 4 => {
                        wide * (q.0[0] * q.0[2] * q.0[1] * k.0[1]) as f64
                    }
                    _ => 0.0,
                },
                _ => 0.0,
            }
        })
        .sum();
    nodes + (g.weights.iter().sum::<u64>() * fb) as f64
}

/// Bytes eager `gelu_new` ([`Activation::GeluNew`]) keeps beyond its input at `fb` bytes, over
/// the nodes `redo` does not recompute: `pow` keeps x (as an fp32 copy under `autocast`, where
/// it casts first), `tanh` its output, the final product its two factors — `1 + tanh(…)` and
/// `0.5 · x`, the latter in x's dtype: 3c more an element, c the intermediates' width (4 under
/// autocast, else `fb`). Measured on one H200 (HF GPT-2, bf16 autocast, 16 × 1024, 2026-11-29):
/// 6.75 GiB more after forward than with the one-kernel `gelu_pytorch_tanh`, 12 bytes an
/// element of its 12 × 16 × 1024 × 3072.
fn gelu_new_kept(g: &SectionGraph, fb: u64, autocast: bool, redo: Option<&[bool]>) -> f64 {
    let c = if autocast { 4.max(fb) } else { fb } as f64;
    kept_nodes(g, redo)
        .filter(|(op, _)| matches!(op, OpKind::Activation(a) if a.kind == Activation::GeluNew))
        .map(|(_, ins)| 3.0 * c * ins.first().map_or(0.0, |x| x.elems() as f64))
        .sum()
}

/// The ops of `g` that keep tensors for backward (those `redo` does not recompute), with their
/// input shapes.
fn kept_nodes<'a>(
    g: &'a SectionGraph,
    redo: Option<&'a [bool]>,
) -> impl Iterator<Item = (&'a OpKind, &'a [Shape])> + 'a {
    g.nodes
        .iter()
        .zip(&g.shapes)
        .enumerate()
        .filter(move |(i, _)| !redo.is_some_and(|r| r[*i]))
        .map(|(_, (n, ins))| (&n.op, ins.as_slice()))
}

/// How linear layers keep their inputs for backward, beyond the tensors themselves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct LinearInputs {
    /// As one-byte fp8 casts ([`Setup::keeps_fp8_linear_inputs`]).
    fp8: bool,
    /// Gathered over the TP group under sequence parallelism
    /// ([`Runtime::sp_keeps_gathered_inputs`]).
    gathered: bool,
    /// The gathers carry fp8 ([`Fp8Recipe::gathers_fp8`] under fp8 training: torchao's
    /// `PrepareFloat8ModuleInput` casts before it gathers), so a gathered input only linear
    /// layers keep is kept as its one-byte cast.
    gathered_fp8: bool,
}

/// Bytes saved by keeping `gemm_input_elems` elements a GEMM alone reads as one-byte fp8
/// casts instead of `fb`-byte ones, where the stack does ([`Runtime::te_linears`]).
fn fp8_saving(gemm_input_elems: u64, fb: u64, fp8_inputs: bool) -> u64 {
    if fp8_inputs {
        gemm_input_elems * fb.saturating_sub(1)
    } else {
        0
    }
}

/// The cost of a section from its node prices.
#[allow(clippy::too_many_arguments)]
fn price(
    g: &SectionGraph,
    prices: &NodePrices,
    fb: u64,
    sp: bool,
    tp: u32,
    hidden: u64,
    inputs: LinearInputs,
    zero: &ZeroConfig,
) -> PartCost {
    let model_flops = prices.train_flops.iter().sum();
    let tensors = ModuleTensors::of(&g.weights, zero);
    PartCost {
        compute: prices.time(g, |_| true),
        saved: Bytes(g.saved(fb, sp, tp, hidden, None, inputs) as u64),
        params: g.param_count(),
        param_tensors: tensors.count,
        gathered_tensors: tensors.gathered,
        largest_tensor: tensors.largest,
        regathered: tensors.regathered,
        model_flops,
        hardware_flops: model_flops,
        ..PartCost::default()
    }
}

/// A section's parameter tensors as module code holds them: the graph's weights, an
/// attention's key and value projections (and their biases) counted inside its query's, as
/// Megatron-LM's `query_key_value` and GPT-2's `c_attn` hold the three in one tensor. The
/// [`PartCost`] fields of the same names read them.
#[derive(Clone, Copy, Debug, Default)]
struct ModuleTensors {
    count: u64,
    /// Those of at least the run's persistence threshold ([`ZeroConfig`]).
    gathered: u64,
    largest: u64,
    /// Those beyond DeepSpeed's reuse distance under full recomputation (count, elements):
    /// each gathered weight whose later weights, run twice (recomputed forward, then backward)
    /// before its own backward, exceed the run's `stage3_max_reuse_distance`.
    regathered: (u64, u64),
}

impl ModuleTensors {
    /// Counts a section's module weights (elements, in forward order) under `zero`'s sizes.
    fn of(weights: &[u64], zero: &ZeroConfig) -> Self {
        let mut t = ModuleTensors {
            count: weights.len() as u64,
            largest: weights.iter().copied().max().unwrap_or(0),
            ..ModuleTensors::default()
        };
        let mut after = 0u64;
        for &e in weights.iter().rev() {
            if e >= zero.persistence_threshold {
                t.gathered += 1;
                if 2 * after > zero.max_reuse_distance {
                    t.regathered.0 += 1;
                    t.regathered.1 += e;
                }
            }
            after += e;
        }
        t
    }
}

/// Whether a graph weight is an attention's key or value projection (or bias), which module
/// code holds inside its query's tensor.
fn inside_query(name: &str) -> bool {
    [".attn.k.", ".attn.v."].iter().any(|p| name.contains(p))
}

/// Elements of a section's parameter tensors as module code holds them, in the order the
/// forward uses them (an attention's key and value weight inside its query's weight, their
/// biases inside its bias).
fn module_weights(g: &Graph) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::new();
    // Where the latest query weight and bias went.
    let mut query: [Option<usize>; 2] = [None, None];
    for t in g.tensors.iter().filter(|t| t.role == TensorRole::Weight) {
        let kind = usize::from(t.name.ends_with("bias"));
        match query[kind] {
            Some(q) if inside_query(&t.name) => out[q] += t.shape.elems(),
            _ => {
                if t.name.contains(".attn.q.") {
                    query[kind] = Some(out.len());
                }
                out.push(t.shape.elems());
            }
        }
    }
    out
}

/// Ops selective recomputation redoes in backward: everything bandwidth-bound, and an unfused
/// attention core (its scores are the largest state it would otherwise keep).
fn is_cheap(op: &OpKind) -> bool {
    match op.compute_class() {
        ComputeClass::MemoryBound => !matches!(op, OpKind::Dropout(_) | OpKind::CrossEntropy),
        ComputeClass::Attention => matches!(op, OpKind::Attention(a) if !a.fused),
        _ => false,
    }
}

/// The nodes selective recomputation redoes under `policy`.
fn recomputed_nodes(g: &Graph, policy: SelectivePolicy) -> Vec<bool> {
    if let SelectivePolicy::Modules(m) = policy {
        // `mla_up_proj` names nodes of multi-head latent attention only.
        let mla = g.nodes.iter().any(|n| n.name.ends_with("attn.kv_up"));
        let m = if mla {
            m
        } else {
            m.without(RecomputeModules::MLA_UP_PROJ)
        };
        return g.nodes.iter().map(|n| m.covers(&n.name)).collect();
    }
    let mut linear = 0;
    g.nodes
        .iter()
        .map(|n| {
            let alternate = matches!(n.op, OpKind::Linear(_)) && {
                linear += 1;
                linear % 2 == 0
            };
            is_cheap(&n.op) || (policy == SelectivePolicy::CheapOpsAndAlternateMatmuls && alternate)
        })
        .collect()
}

/// What one device does of a node of the local shard graph, relative to the node as built:
/// attention under context parallelism sees keys and values of the whole sequence (`cp`
/// times the local block's work), and under sequence parallelism the ops outside the
/// tensor-parallel region, and the linear layers every TP rank holds whole, run on the rank's
/// share of the tokens.
fn local_share(g: &SectionGraph, i: usize, sp: bool, tp: u32, hidden: u64, cp: u64) -> f64 {
    let n = &g.nodes[i];
    let mut k = 1.0;
    if matches!(n.op, OpKind::Attention(_)) {
        k *= cp as f64;
    }
    if sp && (outside_tp(g, n, hidden) || g.duplicated[i]) {
        k /= f64::from(tp);
    }
    k
}

/// Linear layers whose weights every TP rank holds whole and runs on its own tokens:
/// LatentMoE's projections (Megatron-Core's `fc1_latent_proj` / `fc2_latent_proj`,
/// `parallel_mode="duplicated"`), which under sequence parallelism see the rank's share of
/// the sequence and move nothing over the TP group.
fn duplicated_over_tp(n: &parallax_ir::Node) -> bool {
    matches!(n.op, OpKind::Linear(_))
        && (n.name.ends_with(".moe.latent_down") || n.name.ends_with(".moe.latent_up"))
}

/// Whether a node works on full-width (hidden) activations outside the tensor-parallel region.
fn outside_tp(g: &Graph, n: &parallax_ir::Node, hidden: u64) -> bool {
    // Only bandwidth-bound ops run replicated over the TP group; matmul-class ops (linear
    // layers, MoE experts, attention) are already split by the shard's shapes.
    n.op.compute_class() == ComputeClass::MemoryBound
        && n.outputs
            .first()
            .map(|t| g.tensor(*t).shape.last() == hidden)
            .unwrap_or(false)
}

/// What selective recomputation redoes of a section graph, and how.
struct Recomputed {
    /// The nodes redone in backward.
    nodes: Arc<[bool]>,
    /// The section is replayed from its inputs (PyTorch's selective checkpointing), the kept
    /// nodes' outputs taken from a cache: it keeps its inputs and those outputs only.
    /// Otherwise each recomputed op is redone from what it reads (Megatron's selective
    /// recomputation of the attention core), which the section keeps.
    replayed: bool,
}

/// Bytes a section keeps from forward to backward. Under sequence parallelism, full-width
/// tensors are split over the TP group. With `recomputed`, tensors produced by recomputed ops
/// are not kept; the inputs needed to recompute them (outputs of matmuls, attention or the
/// section's input) are kept instead, and recomputed ops' extra state is dropped, except
/// dropout masks; a replayed section keeps its inputs and its kept ops' outputs.
///
/// Where `inputs.fp8` ([`Runtime::te_linears`]), a tensor kept only as a linear layer's input
/// is kept as its one-byte fp8 cast; one another op also keeps is kept in 16 bits and as the
/// cast beside it (the attention output: the fused attention's backward reads it, the output
/// projection keeps its cast). Where `inputs.gathered`
/// ([`Runtime::sp_keeps_gathered_inputs`]), a hidden-sized tensor a linear layer keeps is
/// kept whole under sequence parallelism, as gathered for it (its one-byte cast where
/// `inputs.gathered_fp8` and only linear layers keep it).
fn saved_bytes(
    g: &Graph,
    fb: u64,
    sp: bool,
    tp: u32,
    hidden: u64,
    recomputed: Option<&Recomputed>,
    inputs: LinearInputs,
) -> f64 {
    let fp8_inputs = inputs.fp8;
    // Per kept root tensor: whether a linear layer keeps it, whether a GEMM against a weight
    // (a linear layer, or the head's product with the table) does, and whether another op does.
    #[derive(Clone, Copy, Default)]
    struct Keepers {
        linear: bool,
        weight_gemm: bool,
        other: bool,
    }
    let mut keepers: std::collections::HashMap<parallax_ir::TensorId, Keepers> = Default::default();
    if fp8_inputs || inputs.gathered {
        let roots = g.view_roots();
        for n in &g.nodes {
            let linear = matches!(n.op, OpKind::Linear(_));
            let weight_gemm =
                linear || (matches!(n.op, OpKind::MatMul(_)) && g.weight_flags(n).contains(&true));
            for t in g.node_saves(n).1 {
                let k = keepers.entry(roots[t.0 as usize]).or_default();
                k.linear |= linear;
                k.weight_gemm |= weight_gemm;
                k.other |= !linear;
            }
        }
    }
    let scale = |t: parallax_ir::TensorId| -> f64 {
        let elem = g.elem_bytes(t, fb);
        let kept_by = keepers.get(&t).copied().unwrap_or_default();
        let hidden_sized = g.tensor(t).shape.last() == hidden;
        let gathered = inputs.gathered && kept_by.weight_gemm && hidden_sized;
        let cast = fp8_inputs || (gathered && inputs.gathered_fp8);
        let per_elem = match (kept_by.linear, kept_by.other) {
            (true, false) if cast && g.tensor(t).dtype.is_float() => 1,
            (true, true) if fp8_inputs && g.tensor(t).dtype.is_float() => elem + 1,
            _ => elem,
        };
        let bytes = (g.tensor(t).shape.elems() * per_elem) as f64;
        if sp && hidden_sized && !gathered {
            bytes / f64::from(tp)
        } else {
            bytes
        }
    };
    let items = g.saved_items(fb, |_| true);
    // Extra state, its GEMM inputs as fp8 casts where the stack keeps those, split over the
    // TP group where its op runs outside the TP region under sequence parallelism.
    let extra = |i: &parallax_ir::SavedItem| {
        let bytes =
            i.bytes
                .saturating_sub(fp8_saving(i.gemm_input_elems, fb, fp8_inputs)) as f64;
        if sp && outside_tp(g, &g.nodes[i.node.0 as usize], hidden) {
            bytes / f64::from(tp)
        } else {
            bytes
        }
    };
    let Some(Recomputed {
        nodes: redo,
        replayed,
    }) = recomputed
    else {
        return items
            .iter()
            .map(|i| match i.tensor {
                Some(t) => scale(t),
                None => extra(i),
            })
            .sum();
    };
    // Producer of every tensor, looking through views.
    let mut producer: std::collections::HashMap<parallax_ir::TensorId, usize> = Default::default();
    for (i, n) in g.nodes.iter().enumerate() {
        for o in &n.outputs {
            producer.insert(*o, i);
        }
    }
    let root = |mut t: parallax_ir::TensorId| {
        while let Some(&p) = producer.get(&t) {
            let n = &g.nodes[p];
            if n.op.is_view() {
                t = n.inputs[0];
            } else {
                break;
            }
        }
        t
    };
    let mut kept = std::collections::HashSet::new();
    let mut total = 0.0;
    let mut keep = |t: parallax_ir::TensorId, total: &mut f64| {
        let r = root(t);
        if kept.insert(r) {
            *total += scale(r);
        }
    };
    if *replayed {
        // The section's inputs (what the replay starts from) and every kept op's outputs and
        // extra state (the attention's log-sum-exp), whether or not backward reads them.
        for n in &g.nodes {
            for &u in &n.inputs {
                let r = root(u);
                if !producer.contains_key(&r) && g.tensor(r).role != parallax_ir::TensorRole::Weight
                {
                    keep(r, &mut total);
                }
            }
        }
        for (i, n) in g.nodes.iter().enumerate() {
            if !redo[i] && !n.op.is_view() {
                for &o in &n.outputs {
                    keep(o, &mut total);
                }
            }
        }
        let state = items
            .iter()
            .filter(|i| i.tensor.is_none() && !redo[i.node.0 as usize]);
        return total + state.map(extra).sum::<f64>();
    }
    for item in &items {
        match item.tensor {
            Some(t) => {
                let r = root(t);
                match producer.get(&r).map(|&p| (p, &g.nodes[p])) {
                    Some((pi, p)) if redo[pi] => {
                        // Keep what recomputing it needs: its non-weight inputs, one level
                        // further back through chains of cheap ops.
                        for &u in &p.inputs {
                            let ru = root(u);
                            if g.tensor(ru).role == parallax_ir::TensorRole::Weight {
                                continue;
                            }
                            match producer.get(&ru).map(|&q| (q, &g.nodes[q])) {
                                Some((qi, q)) if redo[qi] => {
                                    for &w in &q.inputs {
                                        if g.tensor(root(w)).role != parallax_ir::TensorRole::Weight
                                        {
                                            keep(w, &mut total);
                                        }
                                    }
                                }
                                _ => keep(ru, &mut total),
                            }
                        }
                    }
                    _ => keep(r, &mut total),
                }
            }
            None if redo[item.node.0 as usize] => {}
            None => total += extra(item),
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_hardware::preset;
    use parallax_ir::models::zoo;
    use parallax_ir::Schedule;

    fn cfg(name: &str) -> TransformerConfig {
        zoo::transformer(name).unwrap()
    }

    /// Pipeline messages of GPT-3 175B on 8-GPU stages (tp 8, stages on different nodes):
    /// Megatron sends each way a 1/tp piece and gathers it; DeepSpeed since 0.5.4 gathers the
    /// stage's own output again before backward; before, every tensor-parallel rank sent the
    /// gradient whole. Without tensor parallelism every engine sends the whole activation.
    #[test]
    fn pipeline_messages_as_each_engine_sends_them() {
        let m = cfg("gpt3-175b");
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
        let costs = |messages: PipeMessages, l: &Layout| {
            let s = Setup {
                runtime: Runtime {
                    pipe_messages: messages,
                    ..Runtime::default()
                },
                ..Setup::new(&m, &p, l.dp * l.tp * l.pp, 2048, 64)
            };
            transformer_costs(&s, l).unwrap()
        };
        let net = Network::new(&p);
        let act = Bytes(2048 * m.hidden * 2);
        let piece = net.p2p(Bytes(act.0 / 8), true);
        let whole = net.p2p(act, true);
        let gather = net.collective(Collective::AllGather, act, Group::strided(8, 1, 8));
        let close = |a: Seconds, b: Seconds| (a.0 - b.0).abs() < 1e-12;

        let meg = costs(PipeMessages::Scattered, &l);
        assert!(close(meg.p2p, piece + gather) && close(meg.p2p_backward, meg.p2p));
        assert_eq!(meg.p2p_transfers, (piece, piece));
        let ds = costs(PipeMessages::DeepSpeedPartitioned, &l);
        assert!(close(ds.p2p, meg.p2p) && close(ds.p2p_backward, piece + gather * 2.0));
        let ds05 = costs(PipeMessages::DeepSpeedWholeGrads, &l);
        assert!(close(ds05.p2p, meg.p2p) && close(ds05.p2p_backward, whole + gather));
        assert_eq!(ds05.p2p_transfers, (piece, whole));
        assert!(whole.0 > 4.0 * piece.0, "{whole:?} vs {piece:?}");

        let no_tp = Layout { tp: 1, dp: 16, ..l };
        let one = costs(PipeMessages::Scattered, &no_tp);
        for messages in [
            PipeMessages::DeepSpeedPartitioned,
            PipeMessages::DeepSpeedWholeGrads,
        ] {
            let c = costs(messages, &no_tp);
            assert_eq!(
                (c.p2p, c.p2p_backward, c.p2p_transfers),
                (one.p2p, one.p2p, (one.p2p, one.p2p))
            );
        }
    }

    /// The fused step is the update alone at every stage; DeepSpeed 0.3's ZeRO 0 casts and
    /// flattens (6 + 8), norms (4), unscales (8), updates (28) and casts down (6) with no
    /// round trip per tensor; its ZeRO-3 checks its partition as stage 2 does but gathers per
    /// layer, so copies nothing out of a step-end all-gather.
    #[test]
    fn optimizer_passes_by_stack_and_stage() {
        for zero in 0..=3 {
            let f = OptimizerPasses::Fused.step(zero);
            assert_eq!(f.per_updated, ADAM_BYTES_PER_PARAM);
            assert_eq!(
                f.per_held + f.syncs_per_held_tensor + f.syncs_per_updated_tensor,
                0.0
            );
        }
        let z0 = OptimizerPasses::DeepSpeed03.step(0);
        assert_eq!((z0.per_updated, z0.per_held), (60.0, 0.0));
        assert_eq!(z0.syncs_per_held_tensor + z0.syncs_per_updated_tensor, 0.0);
        let (z2, z3) = (
            OptimizerPasses::DeepSpeed03.step(2),
            OptimizerPasses::DeepSpeed03.step(3),
        );
        assert_eq!((z2.per_updated, z2.per_held), (80.0, 4.0));
        assert_eq!((z3.per_updated, z3.per_held), (80.0, 0.0));
        assert_eq!(z3.syncs_per_updated_tensor, 2.0);
        // DeepSpeed 0.3's stage 2 all-reduces its buckets; every other ZeRO reduce-scatters.
        let default = ZeroConfig::default();
        for (passes, zero, kind) in [
            (OptimizerPasses::Fused, 0, Collective::AllReduce),
            (OptimizerPasses::Fused, 2, Collective::ReduceScatter),
            (OptimizerPasses::DeepSpeed03, 1, Collective::ReduceScatter),
            (OptimizerPasses::DeepSpeed03, 2, Collective::AllReduce),
            (OptimizerPasses::DeepSpeed03, 3, Collective::ReduceScatter),
        ] {
            assert_eq!(
                passes.gradient_reduction(zero, &default),
                kind,
                "{passes:?} zero {zero}"
            );
        }
        // Unless a run's ds_config says otherwise: the ZeRO tutorial's stage 2 with contiguous
        // gradients reduce-scatters; reduce_scatter off all-reduces on any release.
        let tutorial = ZeroConfig {
            contiguous_gradients: Some(true),
            reduce_scatter: Some(true),
            ..default
        };
        assert_eq!(
            OptimizerPasses::DeepSpeed03.gradient_reduction(2, &tutorial),
            Collective::ReduceScatter
        );
        let off = ZeroConfig {
            reduce_scatter: Some(false),
            ..default
        };
        assert_eq!(
            OptimizerPasses::Fused.gradient_reduction(2, &off),
            Collective::AllReduce
        );
        assert_eq!(
            OptimizerPasses::Fused.gradient_reduction(1, &off),
            Collective::ReduceScatter
        );
        // How each stack's offloaded step sends the weights up, and what its host update moves.
        assert_eq!(
            HostOptimizer::DeepSpeedCpuAdam03
                .weights_up(false, 2.0)
                .tile,
            Some(f64::from(1u32 << 30))
        );
        assert_eq!(
            HostOptimizer::DeepSpeedCpuAdam
                .weights_up(false, 2.0)
                .link_bytes,
            2.0
        );
        assert_eq!(HostOptimizer::DeepSpeedCpuAdam.update_bytes(), 28.0);
        assert_eq!(HostOptimizer::TorchSingleTensor.update_bytes(), 80.0);
        assert_eq!(
            HostOptimizer::TorchSingleTensor
                .weights_up(true, 2.0)
                .copy_bytes,
            0.0
        );
        assert_eq!(HostOptimizer::TorchSingleTensor.param_fetch_bytes(2.0), 4.0);
        assert_eq!(HostOptimizer::DeepSpeedCpuAdam.param_fetch_bytes(2.0), 2.0);
    }

    /// DeepSpeed's ZeRO-3 gathers the weights above its persistence threshold one at a time
    /// (GPT-2 XL's four linears of 2.6–6.6 M elements; its norms and biases of 1.6–6.4 k stay
    /// whole) and reduce-scatters each gradient tensor alone (2021) or in buckets where each
    /// weight goes alone after the small tensors before it (2022 on); a unit stack does one of
    /// each.
    #[test]
    fn zero3_engines_count_their_collectives() {
        let gpt = cfg("gpt2-xl");
        let llama = cfg("llama3-8b");
        for (m, tensors, large) in [(&gpt, 12, 4), (&llama, 7, 5)] {
            let p = preset("dgx-a100-80gb").unwrap();
            let s = setup(m, &p, 8, Runtime::default());
            let l = Layout {
                dp: 8,
                ..Layout::default()
            };
            let c = transformer_costs(&s, &l).unwrap();
            let layer = c.layer();
            assert_eq!(
                (layer.param_tensors, layer.gathered_tensors),
                (tensors, large),
                "{}",
                m.layers
            );
            assert_eq!(Zero3Engine::Units.gathers(layer), 1);
            assert_eq!(Zero3Engine::Units.reduce_scatters(layer), 1);
            assert_eq!(Zero3Engine::DeepSpeed2021.gathers(layer), large);
            assert_eq!(Zero3Engine::DeepSpeed2021.reduce_scatters(layer), tensors);
            let small = tensors - large;
            assert_eq!(
                Zero3Engine::DeepSpeed2022.reduce_scatters(layer),
                large + small.min(large)
            );
        }
        assert!(Zero3Engine::DeepSpeed2021.blocks_compute());
        assert!(Zero3Engine::DeepSpeed2022.blocks_compute());
        assert!(!Zero3Engine::DeepSpeed.blocks_compute() && !Zero3Engine::Units.blocks_compute());
        assert_eq!(Zero3Engine::Units.host_dispatches_per_rank(), 0.0);
    }

    /// Under full recomputation DeepSpeed keeps a submodule's weight from its recomputed
    /// forward to its backward only while the later submodules' parameters, run twice in
    /// between, stay within 1e9: GPT-3 175B's QKV (9h² after it, twice), projection (8h²) and
    /// first MLP linear (4h²) go and come back, its last linear stays; GPT-2 XL keeps all four.
    #[test]
    fn deepspeed_regathers_beyond_its_reuse_distance() {
        let big = cfg("gpt3-175b");
        let small = cfg("gpt2-xl");
        let p = preset("dgx-a100-80gb").unwrap();
        let l = Layout {
            dp: 8,
            ..Layout::default()
        };
        let layer = |m: &TransformerConfig, zero: ZeroConfig| {
            let rt = Runtime {
                zero_config: zero,
                ..Runtime::default()
            };
            *transformer_costs(&setup(m, &p, 8, rt), &l).unwrap().layer()
        };
        let h = big.hidden;
        let default = ZeroConfig::default();
        assert_eq!(layer(&big, default).regathered, (3, 8 * h * h));
        assert_eq!(layer(&small, default).regathered, (0, 0));
        // A run's own sizes (`ds_config.json`): the Azure recipes' 3e9 keeps a 175B layer's
        // weights from its recomputed forward to its backward (twice the 9h² after its QKV is
        // 2.7e9 elements); a persistence threshold above the 3h² QKV keeps it and the h²
        // projection whole, leaving the two 4h² MLP weights gathered.
        let recipe = ZeroConfig {
            max_reuse_distance: 3_000_000_000,
            ..default
        };
        assert_eq!(layer(&big, recipe).regathered, (0, 0));
        assert_eq!(layer(&big, default).gathered_tensors, 4);
        let coarse = ZeroConfig {
            persistence_threshold: 3 * h * h + 1,
            ..default
        };
        assert_eq!(layer(&big, coarse).gathered_tensors, 2);
    }

    /// Module code holds an attention's q, k and v in one tensor (Megatron's
    /// `query_key_value`): GPT-2 XL's block is 12 tensors (qkv, projection, two MLP linears,
    /// two LayerNorms, each with its bias), Llama's 7 (qkv, o, gate, up, down, two RMSNorm
    /// scales).
    #[test]
    fn parameter_tensors_as_module_code_holds_them() {
        let gpt = cfg("gpt2-xl");
        let llama = cfg("llama3-8b");
        for (m, per_layer) in [(&gpt, 12), (&llama, 7)] {
            let p = preset("dgx-a100-80gb").unwrap();
            let s = setup(m, &p, 8, Runtime::default());
            let c = transformer_costs(
                &s,
                &Layout {
                    dp: 8,
                    ..Layout::default()
                },
            )
            .unwrap();
            assert_eq!(c.layer().param_tensors, per_layer, "{}", m.layers);
        }
    }

    fn setup<'a>(
        m: &'a TransformerConfig,
        p: &'a ClusterProfile,
        gpus: u32,
        rt: Runtime,
    ) -> Setup<'a> {
        Setup {
            runtime: rt,
            ..Setup::new(m, p, gpus, 2048, 64)
        }
    }

    /// `setup` at 4096 tokens with routing balanced, as NVIDIA's MoE benchmarks run.
    fn balanced_4k<'a>(m: &'a TransformerConfig, p: &'a ClusterProfile, gpus: u32) -> Setup<'a> {
        Setup {
            seq: 4096,
            ..setup(
                m,
                p,
                gpus,
                Runtime {
                    balanced_routing: true,
                    ..Runtime::default()
                },
            )
        }
    }

    /// One layer of `m` as a device runs it at tp 8 (micro-batch 1, nothing recomputed) under
    /// `tp_overlap`, with sequence parallelism where `sp`.
    fn tp8_layer(
        m: &TransformerConfig,
        p: &ClusterProfile,
        tp_overlap: TpOverlap,
        sp: bool,
    ) -> PartCost {
        let runtime = Runtime {
            tp_overlap,
            ..Runtime::default()
        };
        *transformer_costs(&setup(m, p, 8, runtime), &layout(8, sp, Recompute::None))
            .unwrap()
            .layer()
    }

    fn layout(tp: u32, sp: bool, recompute: Recompute) -> Layout {
        Layout {
            tp,
            micro_batch: 1,
            sequence_parallel: sp,
            recompute,
            ..Layout::default()
        }
    }

    /// Under autocast a layer keeps its norms' inputs in fp32 (and HuggingFace's RMSNorm its
    /// fp32 normalized input), an unfused softmax's fp32 output, and a 16-bit copy of every
    /// weight; at fp32 nothing changes, and a fully recomputed layer keeps its input in fp32.
    #[test]
    fn autocast_keeps_fp32_norms_softmax_and_weight_copies() {
        let p = preset("hgx-h200-141gb").unwrap();
        // GPT-2 with a one-kernel GeLU (its `gelu_new` chain is `gelu_new_kept`'s).
        let gpt2 = || TransformerConfig {
            mlp: parallax_ir::models::Mlp::Gelu,
            ..cfg("gpt2")
        };
        let kept = |m: TransformerConfig, precision, fused_attention, autocast, recompute| {
            let s = Setup {
                precision,
                runtime: Runtime {
                    fused_attention,
                    eager_kernels: true,
                    autocast,
                    ..Runtime::default()
                },
                ..Setup::new(&m, &p, 1, 1024, 1)
            };
            let c = transformer_costs(&s, &layout(1, false, recompute)).unwrap();
            (c.layer().saved.0 as f64, c.layer().params as f64)
        };
        let tokens = 1024.0;
        // Llama: two RMSNorms, each 2 + 4 bytes an element more; the weights' copies.
        let h = cfg("llama3-8b").hidden as f64;
        let (plain, params) = kept(
            cfg("llama3-8b"),
            Precision::Bf16,
            true,
            false,
            Recompute::None,
        );
        let (cast, _) = kept(
            cfg("llama3-8b"),
            Precision::Bf16,
            true,
            true,
            Recompute::None,
        );
        assert_eq!(cast - plain, 2.0 * 6.0 * tokens * h + 2.0 * params);
        // GPT-2 with eager attention: two LayerNorms at 2 bytes more, the fp32 softmax.
        let g = cfg("gpt2");
        let scores = g.heads as f64 * tokens * tokens;
        let (plain, params) = kept(gpt2(), Precision::Bf16, false, false, Recompute::None);
        let (cast, _) = kept(gpt2(), Precision::Bf16, false, true, Recompute::None);
        let h = g.hidden as f64;
        assert_eq!(
            cast - plain,
            2.0 * 2.0 * tokens * h + 2.0 * scores + 2.0 * params
        );
        // fp32 training casts nothing.
        let fp32 = |autocast| kept(gpt2(), Precision::Fp32, false, autocast, Recompute::None).0;
        assert_eq!(fp32(true), fp32(false));
        // Full recomputation keeps the layer's input, the fp32 residual stream.
        let full = |autocast| kept(gpt2(), Precision::Bf16, true, autocast, Recompute::Full).0;
        assert_eq!(full(true), 2.0 * full(false));
    }

    /// HuggingFace's `gelu_new`, run eagerly, keeps x (fp32 under autocast), tanh's output and
    /// the final product's two factors — 3 intermediates more an element, 4 bytes each under
    /// autocast — and moves them through ~8 kernels each way; a stack that fuses or compiles
    /// its module code runs and keeps it as one GeLU.
    #[test]
    fn gelu_new_runs_as_eager_code_and_keeps_its_chain() {
        use parallax_ir::models::Mlp;
        let p = preset("hgx-h200-141gb").unwrap();
        let run = |mlp, eager_kernels, autocast| {
            let m = TransformerConfig { mlp, ..cfg("gpt2") };
            let s = Setup {
                precision: Precision::Bf16,
                runtime: Runtime {
                    eager_kernels,
                    autocast,
                    ..Runtime::default()
                },
                ..Setup::new(&m, &p, 1, 1024, 1)
            };
            *transformer_costs(&s, &layout(1, false, Recompute::None))
                .unwrap()
                .layer()
        };
        let g = cfg("gpt2");
        let elems = 1024.0 * g.ffn_hidden as f64;
        for (autocast, c) in [(false, 2.0), (true, 4.0)] {
            let (fused, chain) = (
                run(Mlp::Gelu, true, autocast),
                run(Mlp::GeluNew, true, autocast),
            );
            assert_eq!(chain.saved.0 as f64 - fused.saved.0 as f64, 3.0 * c * elems);
            assert!(chain.compute.fwd.0 > fused.compute.fwd.0, "{autocast}");
            assert!(
                chain.compute.bwd_input.0 > fused.compute.bwd_input.0,
                "{autocast}"
            );
        }
        // Under autocast its fp32 intermediates move more than a 16-bit chain's.
        let (half, wide) = (
            run(Mlp::GeluNew, true, false),
            run(Mlp::GeluNew, true, true),
        );
        assert!(wide.compute.fwd.0 > half.compute.fwd.0);
        // Fused module code: one GeLU.
        let (fused, chain) = (run(Mlp::Gelu, false, true), run(Mlp::GeluNew, false, true));
        assert_eq!((chain.saved, chain.compute), (fused.saved, fused.compute));
    }

    /// A BERT head on the masked positions only runs its transform and decoder on 15 % of
    /// the tokens: 20 of 128 (the `max_predictions_per_seq` BERT's phase 1 uses), and holds 20
    /// tokens' logits; the encoder layers are untouched.
    #[test]
    fn masked_lm_head_runs_on_the_masked_positions() {
        let m = cfg("bert-large");
        let p = preset("dgx-a100-80gb").unwrap();
        let costs = |mlm_masked_only| {
            let s = Setup {
                precision: Precision::Fp16,
                runtime: Runtime {
                    mlm_masked_only,
                    ..Runtime::default()
                },
                ..Setup::new(&m, &p, 1, 128, 64)
            };
            transformer_costs(&s, &Layout::default()).unwrap()
        };
        let (all, masked) = (costs(false), costs(true));
        assert_eq!(head_tokens(&Setup::new(&m, &p, 1, 128, 64), 128), 128);
        assert_eq!(all.layer(), masked.layer());
        assert_eq!(all.head.working.0, 128 * m.vocab * LOSS_BYTES_PER_LOGIT);
        assert_eq!(masked.head.working.0, 20 * m.vocab * LOSS_BYTES_PER_LOGIT);
        // 20 / 128 of the work (the pooler reads the first token either way); smaller GEMMs
        // run further down the efficiency curve, and at one sequence the decoder reads its
        // whole 30522 × 1024 weight for 20 rows (bound by memory), so the time falls less.
        let work = masked.head.hardware_flops / all.head.hardware_flops;
        assert!((0.15..0.17).contains(&work), "{work}");
        let time = masked.head.compute.total().0 / all.head.compute.total().0;
        assert!(time > work && time < 0.9, "{time}");
    }

    /// A Llama 3 8B layer on `tp` H100s, tp-way with sequence parallelism `sp`, under
    /// `selective` recomputation (TP communication not overlapped).
    fn llama_selective_layer(selective: SelectivePolicy, tp: u32, sp: bool) -> PartCost {
        let (m, p) = (cfg("llama3-8b"), preset("dgx-h100-80gb").unwrap());
        let rt = Runtime {
            tp_overlap: TpOverlap::None,
            selective,
            ..Runtime::default()
        };
        let s = setup(&m, &p, tp, rt);
        *transformer_costs(&s, &layout(tp, sp, Recompute::Selective))
            .unwrap()
            .layer()
    }

    /// torchtitan's op-level selective checkpointing saves reduce-scatter outputs but not
    /// all-gather outputs: under sequence parallelism its backward gathers each region's input
    /// again (one all-gather of the two a region runs forward, which cost the same), where
    /// the cheap-ops policy keeps the gathered input.
    #[test]
    fn op_level_checkpointing_gathers_again_in_backward() {
        let cheap = llama_selective_layer(SelectivePolicy::CheapOps, 8, true);
        let op_sac = llama_selective_layer(SelectivePolicy::CheapOpsAndAlternateMatmuls, 8, true);
        assert_eq!(cheap.tp_bwd, cheap.tp_fwd);
        let extra = op_sac.tp_bwd.0 - cheap.tp_bwd.0;
        assert!(
            (extra / (0.5 * cheap.tp_fwd.0) - 1.0).abs() < 1e-9,
            "{extra}"
        );
    }

    /// torchtitan's op-level checkpointing is PyTorch's selective checkpointing: backward
    /// replays the block from its input, taking the outputs of the ops it saves (every second
    /// matmul, the attention) from a cache. A Llama 3 8B block at tp 1 keeps exactly its input,
    /// `wq`'s, `wv`'s, `w1`'s and `w2`'s outputs and the attention's output and log-sum-exp:
    /// not the norms' outputs a per-op recomputation of `wk` and `w3` would read.
    #[test]
    fn op_level_checkpointing_keeps_the_block_input_and_the_saved_outputs() {
        let saved = llama_selective_layer(SelectivePolicy::CheapOpsAndAlternateMatmuls, 1, false)
            .saved
            .0 as f64;
        let tokens = 2048.0;
        let (h, kv, f, heads) = (4096.0, 1024.0, 14336.0, 32.0);
        let expected = tokens * (2.0 * (4.0 * h + kv + f) + 4.0 * heads);
        assert!(
            (saved / expected - 1.0).abs() < 1e-9,
            "{saved} vs {expected}"
        );
    }

    /// Transformer Engine's fp8 linear layers keep their inputs' fp8 casts: of a GPT block
    /// under sequence parallelism, both norms' outputs (s·b·h/t, 2 → 1 byte) and the GeLU
    /// output (4·s·b·h/t, 2 → 1) are kept for their linear layers alone, and the attention
    /// output, which the fused attention's backward reads in 16 bits, gains the projection's
    /// cast (+1): 5 bytes of s·b·h/t fewer. Nothing changes in 16 bits, without Transformer
    /// Engine, or under torchao's rowwise recipe.
    #[test]
    fn transformer_engine_keeps_fp8_linear_inputs() {
        let m = cfg("gpt3-175b");
        let p = preset("dgx-h100-80gb").unwrap();
        let kept = |precision, te_linears, fp8_recipe| {
            let s = Setup {
                precision,
                ..setup(
                    &m,
                    &p,
                    8,
                    Runtime {
                        te_linears,
                        fp8_recipe,
                        ..Runtime::default()
                    },
                )
            };
            let c = transformer_costs(&s, &layout(8, true, Recompute::None)).unwrap();
            c.layer().saved.0 as f64
        };
        let (sq, h, t) = (2048.0, 12288.0, 8.0);
        let hp = kept(Precision::Fp8, false, Fp8Recipe::Tensorwise);
        let te = kept(Precision::Fp8, true, Fp8Recipe::Tensorwise);
        assert_eq!(hp - te, 5.0 * sq * h / t, "{hp} vs {te}");
        assert_eq!(kept(Precision::Fp8, true, Fp8Recipe::Delayed), te);
        assert_eq!(kept(Precision::Fp8, true, Fp8Recipe::Rowwise), hp);
        assert_eq!(kept(Precision::Bf16, true, Fp8Recipe::Tensorwise), hp);

        // A Mixtral layer on one GPU: the experts' grouped GEMMs keep each routed token
        // copy (h) and its activation output (f) as casts, s·k·(h + f) bytes fewer; its
        // attention trades the QKV input (−s·h) for the projection's cast (+s·h).
        let m = cfg("mixtral-8x7b");
        let moe_kept = |te_linears| {
            let s = Setup {
                precision: Precision::Fp8,
                ..setup(
                    &m,
                    &p,
                    1,
                    Runtime {
                        te_linears,
                        ..Runtime::default()
                    },
                )
            };
            let c = transformer_costs(&s, &layout(1, false, Recompute::None)).unwrap();
            c.layer().saved.0 as f64
        };
        let (k, h, f) = (2.0, 4096.0, 14336.0);
        assert_eq!(moe_kept(false) - moe_kept(true), sq * k * (h + f));
    }

    #[test]
    fn dtensor_sequence_parallelism_keeps_the_gathered_linear_inputs() {
        // torchtitan's column-parallel linears multiply (and keep) their input as gathered
        // over the TP group: GPT-3 175B's two LayerNorm outputs, which the QKV and fc1 GEMMs
        // keep, are kept whole instead of split eight ways, and so is the final norm's output
        // the head keeps. Full recomputation keeps the layer input only; the op-level policy
        // gathers again.
        let m = cfg("gpt3-175b");
        let p = preset("dgx-a100-80gb").unwrap();
        let (sq, h, t) = (2048.0, 12288.0, 8.0);
        let whole = sq * h * 2.0 * (1.0 - 1.0 / t);
        let rt = |gathered: bool| Runtime {
            sp_keeps_gathered_inputs: gathered,
            ..Runtime::default()
        };
        let costs = |gathered: bool, recompute| {
            transformer_costs(&setup(&m, &p, 8, rt(gathered)), &layout(8, true, recompute)).unwrap()
        };
        let (split, gathered) = (costs(false, Recompute::None), costs(true, Recompute::None));
        let grew = |f: fn(&TransformerCosts) -> u64| (f(&gathered) - f(&split)) as f64;
        assert_eq!(grew(|c| c.layer().saved.0), 2.0 * whole);
        assert_eq!(grew(|c| c.head.saved.0), whole);
        for r in [Recompute::Full, Recompute::Selective] {
            assert_eq!(
                costs(true, r).layer().saved,
                costs(false, r).layer().saved,
                "{r:?}"
            );
        }
        // Under fp8 with float8 gathers (torchao's tensorwise recipe) the layers' gathered
        // inputs are kept as their one-byte casts; the head's product with the table is not
        // an fp8 linear and keeps 16 bits.
        let h100 = preset("dgx-h100-80gb").unwrap();
        let fp8 = |gathered: bool| {
            let s = Setup {
                precision: Precision::Fp8,
                ..setup(&m, &h100, 8, rt(gathered))
            };
            transformer_costs(&s, &layout(8, true, Recompute::None)).unwrap()
        };
        let (split, gathered) = (fp8(false), fp8(true));
        let grew = |f: fn(&TransformerCosts) -> u64| (f(&gathered) - f(&split)) as f64;
        assert_eq!(grew(|c| c.layer().saved.0), 2.0 * sq * h * (1.0 - 2.0 / t));
        assert_eq!(grew(|c| c.head.saved.0), whole);
        // Without sequence parallelism every rank holds the whole input anyway.
        let no_sp = |gathered: bool| {
            transformer_costs(
                &setup(&m, &p, 8, rt(gathered)),
                &layout(8, false, Recompute::None),
            )
            .unwrap()
            .layer()
            .saved
        };
        assert_eq!(no_sp(true), no_sp(false));
    }

    #[test]
    fn korthikanti_activation_memory_with_tp_and_sp() {
        // Korthikanti et al. 2022 Table 2: per layer, s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes with
        // tensor parallelism, s·b·h/t·(34 + 5·a·s/h) with sequence parallelism too (16-bit,
        // unfused attention). Ours adds fp32 LayerNorm statistics (16 bytes per token).
        let m = cfg("gpt3-175b");
        let p = preset("dgx-a100-80gb").unwrap();
        let rt = Runtime {
            fused_attention: false,
            ..Runtime::default()
        };
        let s = setup(&m, &p, 8, rt);
        let (sq, b, h, a, t) = (2048.0, 1.0, 12288.0, 96.0, 8.0);
        let tp_only = transformer_costs(&s, &layout(8, false, Recompute::None)).unwrap();
        let expect = sq * b * h * (10.0 + 24.0 / t + 5.0 * a * sq / (h * t)) + 16.0 * sq;
        let got = tp_only.layer().saved.0 as f64;
        assert!((got / expect - 1.0).abs() < 0.01, "{got} vs {expect}");
        let with_sp = transformer_costs(&s, &layout(8, true, Recompute::None)).unwrap();
        let expect = sq * b * h / t * (34.0 + 5.0 * a * sq / h) + 16.0 * sq / t;
        let got = with_sp.layer().saved.0 as f64;
        assert!((got / expect - 1.0).abs() < 0.01, "{got} vs {expect}");
        // Selective keeps no score-sized state and none of the cheap ops' outputs: at most the
        // paper's 34·s·b·h/t, and at least the matmul outputs it must keep (q, k, v, attention
        // output, fc1 output: 12 s·b·h/t bytes) plus the layer input.
        let sel = transformer_costs(&s, &layout(8, true, Recompute::Selective)).unwrap();
        let saved = sel.layer().saved.0 as f64;
        assert!(saved <= sq * b * h / t * 34.0, "{saved}");
        assert!(saved >= sq * b * h / t * 14.0, "{saved}");
        let full = transformer_costs(&s, &layout(8, true, Recompute::Full)).unwrap();
        assert_eq!(full.layer().saved.0 as f64, sq * b * h * 2.0 / t);
        // More recomputation never keeps more.
        assert!(
            full.layer().saved < sel.layer().saved && sel.layer().saved < with_sp.layer().saved
        );
        assert!(full.layer().recompute > sel.layer().recompute);
        // Every second layer recomputed whole: the mean layer keeps and redoes halfway between
        // keeping everything and full recomputation, and its backward's transient is a whole
        // layer's activations.
        let half = transformer_costs(&s, &layout(8, true, Recompute::Every(2))).unwrap();
        let (h, f, n) = (half.layer(), full.layer(), with_sp.layer());
        let mid = (f.saved.0 as f64 + n.saved.0 as f64) / 2.0;
        assert!((h.saved.0 as f64 / mid - 1.0).abs() < 1e-6, "{:?}", h.saved);
        assert!((h.recompute.0 / (0.5 * f.recompute.0) - 1.0).abs() < 1e-9);
        assert!((h.tp_bwd.0 - n.tp_bwd.0 - 0.5 * (f.tp_bwd.0 - n.tp_bwd.0)).abs() < 1e-12);
        assert_eq!(h.working, n.saved);
        let flops = |c: &PartCost| c.hardware_flops;
        assert!((flops(h) - flops(n) - 0.5 * (flops(f) - flops(n))).abs() <= 1e-6 * flops(f));
    }

    /// Megatron's model code pads GPT-2's 50,257-entry vocabulary to a multiple of 128 per TP
    /// rank (50,304 at tp 1, 25,216 a rank at tp 2); HuggingFace's does not, and on an H100
    /// its 16-bit head runs on misaligned GEMM kernels, several times slower. In fp32 the
    /// two heads cost the same but for the padding's extra columns.
    #[test]
    fn megatron_pads_the_vocabulary_and_an_unpadded_head_runs_misaligned() {
        let m = cfg("gpt2");
        assert_eq!(m.vocab, 50_257);
        let p = preset("dgx-h100-80gb").unwrap();
        let at = |precision, tp: u32, vocab_multiple| {
            let s = Setup {
                precision,
                ..setup(
                    &m,
                    &p,
                    tp,
                    Runtime {
                        vocab_multiple,
                        ..Runtime::default()
                    },
                )
            };
            transformer_costs(&s, &layout(tp, false, Recompute::None)).unwrap()
        };
        let padded = at(Precision::Bf16, 1, MEGATRON_VOCAB_MULTIPLE);
        let own = at(Precision::Bf16, 1, 1);
        let table = |c: &TransformerCosts| c.head.params + c.embedding.params;
        // One table: GPT-2 ties its head to the embedding.
        assert_eq!(table(&padded) - table(&own), (50_304 - 50_257) * m.hidden);
        assert_eq!(
            at(Precision::Bf16, 2, MEGATRON_VOCAB_MULTIPLE)
                .head
                .working
                .0,
            2048 * 25_216 * 12
        );
        let head = |c: &TransformerCosts| {
            let t = c.head.compute;
            t.fwd.0 + t.bwd_input.0 + t.bwd_weight.0
        };
        // The head's GEMMs several times slower; its loss, on the logits, is not a GEMM.
        let r = head(&own) / head(&padded);
        assert!((2.0..6.0).contains(&r), "{r}");
        let r32 = head(&at(Precision::Fp32, 1, 1)) / head(&at(Precision::Fp32, 1, 128));
        assert!((0.98..1.0).contains(&r32), "{r32}");
    }

    #[test]
    fn the_loss_holds_three_fp32_copies_of_the_local_logits_at_its_peak() {
        // Llama 3 8B, untied 128,256-entry vocabulary: the head saves no logits, and its
        // transient is 12 bytes per logit of this rank's vocabulary shard whatever the
        // activation type (the loss runs on fp32).
        let m = cfg("llama3-8b");
        let p = preset("dgx-h100-80gb").unwrap();
        for (precision, tp) in [
            (Precision::Bf16, 1),
            (Precision::Fp32, 1),
            (Precision::Bf16, 8),
        ] {
            let s = Setup {
                precision,
                ..setup(&m, &p, tp, Runtime::default())
            };
            let c = transformer_costs(&s, &layout(tp, false, Recompute::None)).unwrap();
            let logits = 2048 * m.vocab / u64::from(tp);
            assert_eq!(c.head.working.0, 12 * logits, "{precision:?} tp={tp}");
            // Megatron's vocab-parallel loss turns one fp32 copy into the softmax and its
            // gradient in place.
            let with = |cross_entropy| Setup {
                runtime: Runtime {
                    cross_entropy,
                    ..s.runtime
                },
                ..s
            };
            let c = transformer_costs(
                &with(CrossEntropy::VocabParallel),
                &layout(tp, false, Recompute::None),
            )
            .unwrap();
            assert_eq!(c.head.working.0, 6 * logits, "{precision:?} tp={tp}");
            // Transformer Engine's fused kernel writes the gradient into the logits.
            let te = transformer_costs(
                &with(CrossEntropy::TeFused),
                &layout(tp, false, Recompute::None),
            )
            .unwrap();
            let fb16 = if precision == Precision::Fp32 { 4 } else { 2 };
            assert_eq!(te.head.working.0, fb16 * logits, "{precision:?} tp={tp}");
            // DTensor's loss_parallel on sharded logits holds four fp32 copies in its backward;
            // on whole logits it is PyTorch's own.
            let dtensor = transformer_costs(
                &with(CrossEntropy::LossParallel),
                &layout(tp, false, Recompute::None),
            )
            .unwrap();
            let per_logit = if tp > 1 { 16 } else { 12 };
            assert_eq!(
                dtensor.head.working.0,
                per_logit * logits,
                "{precision:?} tp={tp}"
            );
            // Compiled with the model (torchtitan since April 2025), the loss holds the 16-bit
            // logits it saved and their gradient; sharded logits keep loss_parallel.
            let compiled = Setup {
                runtime: Runtime {
                    cross_entropy: CrossEntropy::LossParallel,
                    eager_kernels: true,
                    compiled: true,
                    compiles_loss: true,
                    ..s.runtime
                },
                ..s
            };
            let c = transformer_costs(&compiled, &layout(tp, false, Recompute::None)).unwrap();
            let per_logit = if tp > 1 { 16 } else { 2 * fb16 };
            assert_eq!(
                c.head.working.0,
                per_logit * logits,
                "{precision:?} tp={tp}"
            );
            // Run eagerly, the same stack's loss is PyTorch's own.
            let eager = Setup {
                runtime: Runtime {
                    compiled: false,
                    ..compiled.runtime
                },
                ..compiled
            };
            let c = transformer_costs(&eager, &layout(tp, false, Recompute::None)).unwrap();
            assert_eq!(
                c.head.working.0, dtensor.head.working.0,
                "{precision:?} tp={tp}"
            );
            // What the head saves is its input, the norm's output and statistics: nothing
            // vocabulary-sized.
            let fb = if precision == Precision::Fp32 { 4 } else { 2 };
            let hidden_sized = 2048 * (m.hidden * fb * 2 + 16);
            assert!(
                c.head.saved.0 <= hidden_sized,
                "{precision:?} tp={tp}: {}",
                c.head.saved.0
            );
        }
    }

    #[test]
    fn fp8_gathers_eight_bit_inputs_under_sequence_parallelism() {
        let m = cfg("llama3-70b");
        let p = preset("dgx-h100-80gb").unwrap();
        let no_overlap = Runtime {
            tp_overlap: TpOverlap::None,
            ..Runtime::default()
        };
        let tp_fwd = |precision, sp| {
            let s = Setup {
                precision,
                ..setup(&m, &p, 8, no_overlap)
            };
            transformer_costs(&s, &layout(8, sp, Recompute::None))
                .unwrap()
                .layer()
                .tp_fwd
                .0
        };
        // All-gathers halve, reduce-scatters keep 16 bits: between half and all of bf16's.
        let (bf16, fp8) = (tp_fwd(Precision::Bf16, true), tp_fwd(Precision::Fp8, true));
        assert!(fp8 < 0.8 * bf16 && fp8 > 0.5 * bf16, "{fp8} vs {bf16}");
        // Without sequence parallelism the all-reduces of 16-bit outputs are unchanged.
        assert_eq!(
            tp_fwd(Precision::Fp8, false),
            tp_fwd(Precision::Bf16, false)
        );
    }

    /// Asynchronous TP hides the collectives inductor fuses and leaves the rest: a block
    /// input's gradient reduce-scatter (a sum of matmuls) always, the gathers too where rowwise
    /// fp8 casts after gathering; the fused reduce-scatters keep their last block and the
    /// kernel that sums the blocks received.
    #[test]
    fn async_tp_hides_what_the_micro_pipeline_pass_fuses() {
        let (gather, scatter, reduce) = (Seconds(1.0), Seconds(1.0), Seconds(0.1));
        let big = OpTimes {
            fwd: Seconds(10.0),
            bwd_input: Seconds(10.0),
            bwd_weight: Seconds(10.0),
        };
        let a = AsyncTp {
            gather,
            scatter,
            reduce,
            regions: 2.0,
            tp: 8,
            gathers_into_matmuls: true,
            column: big,
            row: big,
        };
        let (fwd, bwd) = async_tp_exposed(&a);
        assert!((fwd.0 - 2.0 * (1.0 / 7.0 + 0.1)).abs() < 1e-12, "{fwd:?}");
        assert!((bwd.0 - 2.0).abs() < 1e-12, "{bwd:?}");
        let rowwise = async_tp_exposed(&AsyncTp {
            gathers_into_matmuls: false,
            ..a
        });
        assert!((rowwise.0 .0 - fwd.0 - 2.0).abs() < 1e-12);
        assert!((rowwise.1 .0 - bwd.0 - 2.0).abs() < 1e-12);
        // Matmuls too short to hide behind expose the rest of the transfer.
        let thin = async_tp_exposed(&AsyncTp {
            column: OpTimes::default(),
            row: OpTimes::default(),
            ..a
        });
        assert!((thin.0 .0 - (2.0 + 2.0 + 2.0 * (1.0 / 7.0 + 0.1))).abs() < 1e-12);

        // On a 70B layer at tp 8: less exposed than synchronous TP in both passes, the
        // backward keeping at least its reduce-scatters (half of bf16's collectives), and a
        // fully recomputed forward repeating the forward's exposure.
        let m = cfg("llama3-70b");
        let p = preset("dgx-h100-80gb").unwrap();
        let costs = |tp_overlap, precision, fp8_recipe, recompute| {
            let s = Setup {
                precision,
                ..setup(
                    &m,
                    &p,
                    8,
                    Runtime {
                        tp_overlap,
                        fp8_recipe,
                        ..Runtime::default()
                    },
                )
            };
            *transformer_costs(&s, &layout(8, true, recompute))
                .unwrap()
                .layer()
        };
        let bf16 = |o| costs(o, Precision::Bf16, Fp8Recipe::Tensorwise, Recompute::None);
        let (sync, asy) = (bf16(TpOverlap::None), bf16(TpOverlap::MicroPipelined));
        assert!(asy.tp_fwd.0 < 0.3 * sync.tp_fwd.0, "{asy:?} vs {sync:?}");
        assert!(asy.tp_bwd < sync.tp_bwd && asy.tp_bwd.0 > 0.45 * sync.tp_bwd.0);
        let full = costs(
            TpOverlap::MicroPipelined,
            Precision::Bf16,
            Fp8Recipe::Tensorwise,
            Recompute::Full,
        );
        assert!((full.tp_bwd.0 - asy.tp_bwd.0 - asy.tp_fwd.0).abs() < 1e-12);
        // Rowwise fp8 gathers 16 bits and fuses no gather; tensorwise gathers fp8, fused.
        let fp8 = |r| {
            costs(
                TpOverlap::MicroPipelined,
                Precision::Fp8,
                r,
                Recompute::None,
            )
        };
        let (tw, rw) = (fp8(Fp8Recipe::Tensorwise), fp8(Fp8Recipe::Rowwise));
        assert!(rw.tp_fwd.0 > 2.0 * tw.tp_fwd.0, "{rw:?} vs {tw:?}");
    }

    /// Transformer Engine's userbuffers hide the collectives behind split GEMMs and pay for it:
    /// the pipelined GEMM runs on the SMs its reduce-scatter leaves and the last piece's
    /// reduce-scatter waits; a bulk collective takes its SMs while it runs.
    #[test]
    fn userbuffers_hide_collectives_and_pay_in_sms() {
        let p = preset("dgx-a100-80gb").unwrap();
        let dev = DeviceModel::new(&p, Precision::Bf16).unwrap();
        let second = Seconds(1.0);
        let big = TpLinears {
            times: OpTimes {
                fwd: Seconds(10.0),
                bwd_input: Seconds(10.0),
                bwd_weight: Seconds(10.0),
            },
            gemm_flops: vec![1e12; 2],
        };
        let u = Userbuffers {
            gather: second,
            scatter: second,
            regions: 2.0,
            tp: 8,
            sms: 108,
            column: &big,
            row: &big,
        };
        let (extra, fwd, bwd) = userbuffers_costs(&dev, &u);
        // Forward: the gathers hide, the last of each reduce-scatter's four pieces waits.
        assert!((fwd.0 - 2.0 * 0.25).abs() < 1e-12, "{fwd:?}");
        assert_eq!(bwd.0, 0.0);
        // The row-parallel forward's GEMMs on 92 of 108 SMs; the pieces' launches on top.
        let pieces = big.gemm_time(&dev, 4, 3);
        assert!(pieces > big.gemm_time(&dev, 1, 1));
        assert!(extra.fwd.0 > pieces.0 * (108.0 / 92.0 - 1.0), "{extra:?}");
        // Each bulk collective holds 16 of 108 SMs for the second it runs.
        assert!(
            (extra.bwd_weight.0 - 16.0 / 108.0).abs() < 1e-12,
            "{extra:?}"
        );
        assert!(extra.bwd_input.0 > 16.0 / 108.0);
        // A chip with more SMs loses less of them.
        let h100 = userbuffers_costs(&dev, &Userbuffers { sms: 132, ..u }).0;
        assert!(h100.fwd < extra.fwd && h100.bwd_weight < extra.bwd_weight);
        // GEMMs too short to hide behind expose every transfer: forward the gathers and the
        // reduce-scatters, backward two gathers and a reduce-scatter per region.
        let thin = TpLinears::default();
        let (_, fwd, bwd) = userbuffers_costs(
            &dev,
            &Userbuffers {
                column: &thin,
                row: &thin,
                ..u
            },
        );
        assert!((fwd.0 - 4.0).abs() < 1e-12 && (bwd.0 - 6.0).abs() < 1e-12);

        // On GPT-3 175B's layer at tp 8 the overlap leaves a fraction of the collectives
        // exposed, runs longer kernels, and still wins.
        let m = cfg("gpt3-175b");
        let layer = |tp_overlap| tp8_layer(&m, &p, tp_overlap, true);
        let (sync, ub) = (layer(TpOverlap::None), layer(TpOverlap::Userbuffers));
        assert!(ub.tp_fwd.0 + ub.tp_bwd.0 < 0.2 * (sync.tp_fwd.0 + sync.tp_bwd.0));
        assert!(ub.compute.total() > sync.compute.total());
        let step = |c: &PartCost| c.compute.total().0 + c.tp_fwd.0 + c.tp_bwd.0;
        assert!(step(&ub) < step(&sync), "{ub:?} vs {sync:?}");

        // Transformer Engine runs from Ampere on: on a V100 its overlap does not exist and
        // the collectives wait as without it.
        let v100 = preset("dgx2-v100-32gb").unwrap();
        assert!(p.device.runs_transformer_engine() && !v100.device.runs_transformer_engine());
        let layer = |tp_overlap| {
            let s = Setup {
                precision: Precision::Fp16,
                ..setup(
                    &m,
                    &v100,
                    8,
                    Runtime {
                        tp_overlap,
                        ..Runtime::default()
                    },
                )
            };
            *transformer_costs(&s, &layout(8, true, Recompute::None))
                .unwrap()
                .layer()
        };
        assert_eq!(layer(TpOverlap::Userbuffers), layer(TpOverlap::None));
    }

    #[test]
    fn megatron_hides_the_column_parallel_backward_collectives_under_their_gemms() {
        // GPT-3 175B's layer at tp 8 on A100s. Forward waits as without overlap; backward
        // without sequence parallelism, each region's input-gradient all-reduce runs under the
        // column-parallel weight gradients; with it, the row side's gather still waits, the
        // column input's re-gather runs under the input-gradient GEMM and its gradient's
        // reduce-scatter under the weight-gradient GEMM.
        let (m, p) = (cfg("gpt3-175b"), preset("dgx-a100-80gb").unwrap());
        let layer = |tp_overlap, sp| tp8_layer(&m, &p, tp_overlap, sp);
        for sp in [false, true] {
            let (sync, overlapped) = (
                layer(TpOverlap::None, sp),
                layer(TpOverlap::AsyncBackward, sp),
            );
            assert_eq!(overlapped.tp_fwd, sync.tp_fwd);
            assert_eq!(overlapped.compute, sync.compute);
            assert!(overlapped.tp_bwd.0 < sync.tp_bwd.0, "sp {sp}");
        }
        // Without sequence parallelism the GEMMs are long enough to hide the all-reduces:
        // what is left is their interference.
        let (sync, overlapped) = (
            layer(TpOverlap::None, false),
            layer(TpOverlap::AsyncBackward, false),
        );
        let want = crate::comm::interference(sync.tp_bwd);
        assert!(
            (overlapped.tp_bwd.0 - want.0).abs() < 1e-12,
            "{overlapped:?}"
        );
    }

    #[test]
    fn tensor_parallelism_divides_compute_and_adds_collectives() {
        let m = cfg("gpt3-13b");
        let p = preset("dgx-a100-80gb").unwrap();
        let no_overlap = Runtime {
            tp_overlap: TpOverlap::None,
            ..Runtime::default()
        };
        let s1 = setup(&m, &p, 1, no_overlap);
        let s8 = setup(&m, &p, 8, no_overlap);
        let c1 = transformer_costs(&s1, &layout(1, false, Recompute::None)).unwrap();
        let c8 = transformer_costs(&s8, &layout(8, true, Recompute::None)).unwrap();
        let r = c1.layer().compute.fwd.0 / c8.layer().compute.fwd.0;
        assert!((4.0..8.5).contains(&r), "{r}");
        assert_eq!(c1.layer().tp_fwd.0, 0.0);
        assert!(c8.layer().tp_fwd.0 > 0.0);
        // Pipelining the collectives with their GEMMs hides them (Transformer Engine overlap).
        let s8o = setup(&m, &p, 8, Runtime::default());
        let c8o = transformer_costs(&s8o, &layout(8, true, Recompute::None)).unwrap();
        assert!(c8o.layer().tp_fwd < c8.layer().tp_fwd);
        // Replicated in TP: two LayerNorms (4h) and the two row-parallel biases (2h).
        assert_eq!(c8.layer().params * 8, c1.layer().params + 7 * 6 * 5140);
    }

    #[test]
    fn moe_experts_are_split_once_by_tensor_parallelism() {
        // Sequence parallelism splits the bandwidth-bound ops outside the TP region; the MoE
        // layer's GEMMs are already split by the shard's FFN width and must not be split again.
        let m = cfg("mixtral-8x7b");
        let p = preset("dgx-h100-80gb").unwrap();
        let s1 = Setup {
            seq: 4096,
            ..setup(&m, &p, 1, Runtime::default())
        };
        let s4 = Setup {
            seq: 4096,
            ..setup(&m, &p, 4, Runtime::default())
        };
        let c1 = transformer_costs(&s1, &layout(1, false, Recompute::None)).unwrap();
        let c4 = transformer_costs(&s4, &layout(4, true, Recompute::None)).unwrap();
        let r = c1.layer().compute.fwd.0 / c4.layer().compute.fwd.0;
        assert!((2.5..4.5).contains(&r), "{r}");
        assert!(c4.layer().model_flops * 4.0 > 0.95 * c1.layer().model_flops);
    }

    /// The MoE layer of `s`'s model on 16 data-parallel ranks, experts over `ep` of them,
    /// dispatched by `dispatcher`.
    fn moe_layer_at(s: &Setup, ep: u32, dispatcher: Dispatcher) -> PartCost {
        let l = Layout {
            ep,
            dp: 16,
            dispatcher,
            ..layout(1, false, Recompute::None)
        };
        *transformer_costs(s, &l).unwrap().layer()
    }

    /// LatentMoE (Qwen3-30B-A3B's mixture with a 512-wide latent in its 2,048-wide model): the
    /// dispatch moves latent rows, a quarter of the bytes; the experts' GEMMs shrink; the two
    /// projections are replicated over tensor parallelism, so under sequence parallelism each
    /// rank runs them on its own tokens and they join no TP collective.
    #[test]
    fn latent_experts_dispatch_and_compute_at_the_latent_width() {
        let base = cfg("qwen3-30b-a3b");
        let latent = TransformerConfig {
            moe: base.moe.map(|m| MoeConfig { latent: 512, ..m }),
            ..base.clone()
        };
        let p = preset("dgx-h100-80gb").unwrap();
        let at = |m: &TransformerConfig| {
            moe_layer_at(
                &setup(m, &p, 16, Runtime::default()),
                8,
                Dispatcher::AllToAll,
            )
        };
        let (plain, small) = (at(&base), at(&latent));
        assert!(small.compute.fwd < plain.compute.fwd, "{small:?}");
        // The routed rows are a quarter of the bytes; the exchange, latency and all, costs
        // between a quarter and a half of the hidden-wide one.
        let ranks = |m: &TransformerConfig| {
            let l = Layout {
                ep: 8,
                dp: 16,
                ..layout(1, false, Recompute::None)
            };
            let opts = BuildOptions {
                batch: 1,
                seq: 4096,
                fused_attention: true,
            };
            ExpertRanks::of(m, m.moe.unwrap(), &l, &opts, false).routed_bytes(2)
        };
        let bytes = ranks(&latent).0 as f64 / ranks(&base).0 as f64;
        assert!((bytes - 0.25).abs() < 1e-6, "{bytes}");
        let ratio = small.ep_fwd.0 / plain.ep_fwd.0;
        assert!((0.25..0.5).contains(&ratio), "{ratio}");
        // The projections under tp 2 with sequence parallelism: half the tokens each.
        let s = setup(&latent, &p, 16, Runtime::default());
        let l = Layout {
            ep: 8,
            dp: 8,
            ..layout(2, true, Recompute::None)
        };
        let graph = SectionGraphs::default()
            .get(
                &latent.tp_shard(2).unwrap(),
                (2, 2),
                Section::Layer(LayerKind::Block),
                BuildOptions {
                    batch: 1,
                    seq: 4096,
                    fused_attention: true,
                },
            )
            .unwrap();
        let dev = DeviceModel::new(&p, s.precision).unwrap();
        let prices = NodePrices::new(&dev, &graph, 2, true, 2, 2048, 1, None);
        for name in ["layers.0.moe.latent_down", "layers.0.moe.latent_up"] {
            let i = graph.nodes.iter().position(|n| n.name == name).unwrap();
            let whole = dev.op(&graph.nodes[i].op, &graph.shapes[i], &graph.work[i], 2);
            assert!(
                (prices.times[i].fwd.0 - whole.fwd.0 / 2.0).abs() < 1e-12,
                "{name}"
            );
        }
        let (column, row) = prices.tp_linears(&graph, 2048);
        let linears = graph
            .nodes
            .iter()
            .filter(|n| matches!(n.op, OpKind::Linear(_)));
        let tp = linears.filter(|n| !n.name.contains("latent")).count();
        assert_eq!(column.gemm_flops.len() + row.gemm_flops.len(), tp);
        transformer_costs(&s, &l).unwrap();
    }

    #[test]
    fn expert_parallel_ranks_read_fewer_expert_weights() {
        // Qwen3-30B-A3B (128 experts of 768, top-8): with 1,024 tokens a rank at ep 1 runs 128
        // experts of 64 rows, bound by reading every expert's weights; at ep 16 it runs 8
        // experts over the tokens of 16 ranks (1,024 rows each) and reads a sixteenth of them,
        // so the same FLOPs take less time. With 16 times the tokens (a 16k sequence) both are
        // bound by their arithmetic, which expert parallelism does not change (a grouped GEMM
        // runs at the efficiency of its whole FLOPs, as
        // `grouped_gemms_run_as_one_launch_on_an_h100` measured). The model FLOPs do not change.
        let m = cfg("qwen3-30b-a3b");
        let p = preset("dgx-h100-80gb").unwrap();
        let at = |seq: u64, ep: u32| {
            let s = Setup {
                seq,
                ..setup(&m, &p, 16, Runtime::default())
            };
            moe_layer_at(&s, ep, Dispatcher::AllToAll)
        };
        let (one, sixteen) = (at(1024, 1), at(1024, 16));
        assert!(
            sixteen.compute.fwd.0 < 0.8 * one.compute.fwd.0,
            "{:?} vs {:?}",
            sixteen.compute,
            one.compute
        );
        assert!((sixteen.model_flops / one.model_flops - 1.0).abs() < 1e-9);
        let (one, sixteen) = (at(16384, 1), at(16384, 16));
        let r = sixteen.compute.fwd.0 / one.compute.fwd.0;
        assert!((0.9..1.25).contains(&r), "{r}");
    }

    #[test]
    fn all_to_all_dispatch_sorts_received_rows_by_local_expert() {
        // Qwen3-30B-A3B at ep 8 (16 local experts): the all-to-all dispatcher copies every
        // received row into local-expert order after the dispatch and back before the combine,
        // forward and backward; DeepEP's kernels write them in order. One expert per rank has
        // nothing to sort.
        let m = cfg("qwen3-30b-a3b");
        let p = preset("dgx-h100-80gb").unwrap();
        let s = balanced_4k(&m, &p, 16);
        let (a2a, deepep) = (
            moe_layer_at(&s, 8, Dispatcher::AllToAll),
            moe_layer_at(&s, 8, Dispatcher::DeepEp),
        );
        let dev = DeviceModel::new(&p, Precision::Bf16).unwrap();
        let rows = (4096 * 8 * 2048 * 2) as f64;
        let sort = dev.memory(2.0 * rows).0 * 2.0;
        assert!(sort > 0.0);
        for (x, y) in [
            (a2a.compute.fwd, deepep.compute.fwd),
            (a2a.compute.bwd_input, deepep.compute.bwd_input),
        ] {
            assert!(((x - y).0 - sort).abs() < 1e-9, "{x:?} - {y:?} vs {sort}");
        }
        assert_eq!(a2a.compute.bwd_weight, deepep.compute.bwd_weight);
        let m1 = Setup {
            model: &cfg("mixtral-8x7b"),
            ..s
        };
        let one_expert = |d| moe_layer_at(&m1, 8, d).compute;
        assert_eq!(
            one_expert(Dispatcher::AllToAll),
            one_expert(Dispatcher::DeepEp)
        );
    }

    /// DeepSeek-V3 as Megatron-Bridge 25.09 runs it on 1024 H100s (tp 2 with sequence
    /// parallelism, pp 8, ep 64, dp 64, 4096 tokens), routing balanced, under `etp` and
    /// `recompute`, priced from the section graphs of `graphs`.
    fn dsv3_on_1024(etp: u32, recompute: Recompute, graphs: &SectionGraphs) -> TransformerCosts {
        let m = cfg("deepseek-v3");
        let p = preset("dgx-h100-80gb").unwrap();
        let s = balanced_4k(&m, &p, 1024);
        let l = Layout {
            dp: 64,
            pp: 8,
            ep: 64,
            etp: Some(etp),
            schedule: parallax_ir::Schedule::OneFOneB,
            ..layout(2, true, recompute)
        };
        transformer_costs_with(&s, &l, graphs).unwrap()
    }

    /// An MoE layer keeps the activations of the rows its rank receives at the local expert
    /// width: under tp 2 with sequence parallelism, etp 1 routes each rank's half of the
    /// tokens through whole experts, etp 2 gathers the pair's rows through half-wide ones —
    /// one hidden row more per visit (the gathered input), the expert-hidden rows the same.
    /// Redoing the MoE layer keeps none of them.
    #[test]
    fn experts_keep_the_rows_their_rank_receives() {
        let m = cfg("deepseek-v3");
        // The MoE layer (at etp 1 it holds fewer parameters than a dense one).
        let at = |etp, recompute| {
            dsv3_on_1024(etp, recompute, &SectionGraphs::default())
                .kind(LayerKind::Block)
                .saved
                .0 as f64
        };
        let moe = m.moe.unwrap();
        let (tokens, fb) = (4096 / 2, 2);
        let one_hidden_row_per_visit = (tokens * moe.top_k * m.hidden * fb) as f64;
        let none = |etp| at(etp, Recompute::None);
        assert_eq!(none(2) - none(1), one_hidden_row_per_visit);
        // etp 1 keeps per visit a hidden row and the expert's gate, up and activation rows.
        let redo = Recompute::Modules(RecomputeModules::parse(&["moe"]).unwrap());
        let without_experts = at(1, redo);
        let per_visit = (m.hidden + 3 * m.ffn_hidden) * fb;
        assert!(none(1) - without_experts >= (tokens * moe.top_k * per_visit) as f64);
    }

    /// Megatron-Core's `--recompute-modules`: `mla_up_proj` drops the up-projected queries,
    /// keys and values of multi-head latent attention (the attention core's saved inputs) and
    /// redoes the projections and the rotary embedding in backward; `moe` redoes the whole MoE
    /// layer, its dispatch and combine included; `mla_up_proj` names nothing in a GQA layer;
    /// an unknown module is refused.
    #[test]
    fn recompute_modules_redo_what_megatron_names() {
        let p = preset("dgx-h100-80gb").unwrap();
        let at = |recompute| *dsv3_on_1024(1, recompute, &SectionGraphs::default()).layer();
        let none = at(Recompute::None);
        let up = RecomputeModules::parse(&["mla_up_proj"]).unwrap();
        let mla = at(Recompute::Modules(up));
        // Per token, the up projections write 128 heads × (192 + 128 + 128) 16-bit values, a
        // half of them per rank under tp 2: most of that is no longer kept.
        let dropped = none.saved.0 as f64 - mla.saved.0 as f64;
        let up_bytes = (4096 * 128 * (192 + 128 + 128) * 2 / 2) as f64;
        assert!(
            dropped > 0.5 * up_bytes && dropped < 1.5 * up_bytes,
            "{dropped} vs {up_bytes}"
        );
        assert!(mla.recompute.0 > 0.0 && mla.recompute < none.compute.fwd * 0.5);
        assert_eq!(mla.ep_bwd, none.ep_bwd);
        let moe = RecomputeModules::parse(&["moe"]).unwrap();
        let redo_moe = at(Recompute::Modules(moe));
        assert!(redo_moe.ep_bwd > none.ep_bwd);
        assert!(redo_moe.saved < none.saved);
        // A GQA layer has no up projection to redo.
        let llama = cfg("llama3-8b");
        let s = Setup::new(&llama, &p, 8, 4096, 8);
        let l = Layout {
            dp: 8,
            ..layout(1, false, Recompute::Modules(up))
        };
        let gqa = *transformer_costs(&s, &l).unwrap().layer();
        assert_eq!(gqa.recompute, Seconds(0.0));
        assert!(RecomputeModules::parse(&["attention"]).is_err());
        // One search's cache serves layouts with different modules.
        let graphs = SectionGraphs::default();
        let with = |r| *dsv3_on_1024(1, r, &graphs).layer();
        assert_eq!(with(Recompute::Modules(up)).saved, mla.saved);
        assert_eq!(with(Recompute::Modules(moe)).saved, redo_moe.saved);
    }

    #[test]
    fn weight_gradient_accumulation_moves_what_each_stack_writes_and_reads() {
        // A fused GEMM accumulates as it writes; autograd's in-place sum reads two gradients
        // and writes one on every micro-batch but the first; a hook reads the 16-bit gradient
        // and reads and writes the fp32 buffer on every micro-batch.
        assert_eq!(WgradAccumulation::Fused.bytes_per_param(2, 4, 8), 0.0);
        assert_eq!(WgradAccumulation::Autograd.bytes_per_param(2, 2, 1), 0.0);
        assert_eq!(WgradAccumulation::Autograd.bytes_per_param(2, 2, 4), 4.5);
        assert_eq!(WgradAccumulation::Autograd.bytes_per_param(4, 4, 2), 6.0);
        assert_eq!(WgradAccumulation::Hook.bytes_per_param(2, 4, 1), 10.0);
        assert_eq!(WgradAccumulation::Hook.bytes_per_param(2, 4, 16), 10.0);
        assert_eq!(WgradAccumulation::HookCast.bytes_per_param(2, 4, 16), 18.0);
    }

    #[test]
    fn eager_module_code_unless_the_run_compiles_it() {
        // A stack whose module code is eager (torchtitan, FSDP) runs it compiled when asked,
        // in fp8 where its fp8 layers are compiled (torchao's float8), and under asynchronous
        // TP (an inductor pass); a fused stack never runs it eagerly.
        let eager = Runtime {
            eager_kernels: true,
            compiles_fp8: true,
            tp_overlap: TpOverlap::None,
            ..Runtime::default()
        };
        assert!(eager.runs_eager(Precision::Bf16));
        assert!(!eager.runs_eager(Precision::Fp8));
        let fp8_eager = Runtime {
            compiles_fp8: false,
            ..eager
        };
        assert!(fp8_eager.runs_eager(Precision::Fp8));
        for compiled in [
            Runtime {
                compiled: true,
                ..eager
            },
            Runtime {
                tp_overlap: TpOverlap::MicroPipelined,
                ..eager
            },
            Runtime::default(),
        ] {
            assert!(!compiled.runs_eager(Precision::Bf16), "{compiled:?}");
        }
        // What eager code costs a Llama 3 8B layer at 8k tokens: RMSNorm's fp32 chain, rotary
        // embedding and SwiGLU as pointwise kernels, only outside the GEMMs and attention.
        let (m, p) = (cfg("llama3-8b"), preset("grand-teton-h100-96gb").unwrap());
        let l = Layout {
            dp: 8,
            ..layout(1, false, Recompute::None)
        };
        let at = |rt: Runtime| {
            let s = Setup {
                runtime: rt,
                ..Setup::new(&m, &p, 8, 8192, 8)
            };
            *transformer_costs(&s, &l).unwrap().layer()
        };
        let (slow, fast) = (
            at(eager),
            at(Runtime {
                compiled: true,
                ..eager
            }),
        );
        let extra = slow.compute.total().0 / fast.compute.total().0 - 1.0;
        // torchtitan's 8B FSDP table: eager 5,762, compiled 6,667 tokens/s a GPU (13.6 % of
        // the eager step); the layer's share is of that order.
        assert!((0.08..0.25).contains(&extra), "{extra}");
        assert_eq!(slow.compute.bwd_weight, fast.compute.bwd_weight);
    }

    #[test]
    fn folded_experts_dispatch_sequence_split_tokens() {
        // Qwen3-235B-A22B as Megatron-Bridge runs it on 256 H100s: tp 2 with sequence
        // parallelism, ep 32 over the stage's dp × tp ranks, etp 1. Each rank routes its
        // half of a micro-batch's tokens (top-8 copies) over an all-to-all among 32 ranks
        // (four nodes), holds 4 whole experts, and pays the TP pair of the attention only.
        // (Balanced routing, as the recipe benchmarks it: the volumes are exact.)
        let m = cfg("qwen3-235b-a22b");
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup {
            precision: Precision::Bf16,
            ..balanced_4k(&m, &p, 256)
        };
        let at = |ep, etp| {
            let l = Layout {
                dp: 16,
                pp: 8,
                ep,
                etp: Some(etp),
                schedule: parallax_ir::Schedule::OneFOneB,
                ..layout(2, true, Recompute::None)
            };
            *transformer_costs(&s, &l).unwrap().layer()
        };
        let (folded, inside) = (at(32, 1), at(16, 2));
        let whole = 128 * 3 * 4096 * 1536;
        assert_eq!(folded.expert_params, whole / 32);
        assert_eq!(inside.expert_params, whole / 32);
        let net = Network::new(&p);
        let routed = Bytes(4096 / 2 * 8 * 4096 * 2);
        let a2a = |ep| net.collective(Collective::AllToAll, routed, Group::strided(ep, 32 / ep, 8));
        assert!((folded.ep_fwd.0 - 2.0 * a2a(32).0).abs() < 1e-12);
        // etp 2 gathers the received copies over its pair and reduce-scatters the outputs.
        let pair = Group::strided(2, 1, 8);
        let gathered = Bytes(routed.0 * 2);
        let etp_pair = net.collective(Collective::AllGather, gathered, pair)
            + net.collective(Collective::ReduceScatter, gathered, pair);
        assert!((inside.ep_fwd.0 - (2.0 * a2a(16).0 + etp_pair.0)).abs() < 1e-12);
        // Only the attention's all-gather / reduce-scatter over TP remains in either.
        let ep1 = transformer_costs(
            &s,
            &Layout {
                ep: 1,
                etp: None,
                ..Layout {
                    dp: 16,
                    pp: 8,
                    schedule: parallax_ir::Schedule::OneFOneB,
                    ..layout(2, true, Recompute::None)
                }
            },
        )
        .unwrap()
        .layer()
        .to_owned();
        assert!((folded.tp_fwd.0 - inside.tp_fwd.0).abs() < 1e-15);
        // Expert FLOPs per rank do not depend on how the experts fold, all experts on each
        // TP pair included (the router, run on the gathered rows under etp 2, differs by a
        // fraction of a percent).
        for other in [&inside, &ep1] {
            let r = folded.model_flops / other.model_flops;
            assert!((0.99..=1.0).contains(&r), "{r}");
        }
        // A fold that needs sequence-split tokens is refused without sequence parallelism.
        let e = transformer_costs(
            &s,
            &Layout {
                dp: 16,
                pp: 8,
                ep: 32,
                etp: Some(1),
                schedule: parallax_ir::Schedule::OneFOneB,
                ..layout(2, false, Recompute::None)
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("needs sequence parallelism"), "{e}");
    }

    #[test]
    fn dense_and_moe_layers_are_priced_each_as_they_are() {
        // GLM-4.5-Air's arrangement: one leading dense layer 10944 wide, then 45 MoE layers
        // of 128 experts 1408 wide (top-8) beside a shared expert 1408 wide.
        let moe = MoeConfig {
            shared_ffn_hidden: 1408,
            dense_layers_first: 1,
            every: 1,
            dense_ffn_hidden: 10944,
            ..MoeConfig::routed(128, 8)
        };
        let m = TransformerConfig {
            head_dim: 128,
            moe: Some(moe),
            ..TransformerConfig::llama(46, 4096, 96, 8, 1408, 151_552, 131_072)
        };
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup {
            seq: 4096,
            ..setup(&m, &p, 16, Runtime::default())
        };
        let at = |tp: u32, ep: u32| {
            let l = Layout {
                dp: 16 / tp,
                ep,
                ..layout(tp, tp > 1, Recompute::None)
            };
            transformer_costs(&s, &l).unwrap()
        };
        let c = at(1, 8);
        let dense = c.kinds[LayerKind::DenseBlock.index()].expect("a dense layer");
        let (block, dense_block) = (LayerKind::Block.index(), LayerKind::DenseBlock.index());
        let (all, later) = (c.stack.kinds_in(0, 46), c.stack.kinds_in(1, 10));
        assert_eq!(
            (
                all[block],
                all[dense_block],
                later[block],
                later[dense_block]
            ),
            (45, 1, 10, 0)
        );
        assert_eq!(c.layer_at(0), &dense);
        assert_eq!(c.layer_at(1), c.layer());
        assert_eq!((dense.expert_params, dense.ep_fwd), (0, Seconds(0.0)));
        // All layers' parameters are the model's blocks, the routed experts split over ep.
        let routed = 128 * 3 * 4096 * 1408 * 45;
        assert_eq!(
            c.layers_count(0, 46, |l| l.params) + routed * 7 / 8,
            m.blocks_params()
        );
        // The dense layer is the lighter per token (10944 wide against 8 × 1408 + 1408).
        assert!(dense.model_flops < c.layer().model_flops);
        // Under sequence parallelism the shared expert, a tensor-parallel MLP, keeps the MLP's
        // gather and reduce-scatter: an MoE layer pays the TP pair twice, as a dense one.
        let c2 = at(2, 8);
        assert_eq!(c2.layer().tp_fwd, c2.kind(LayerKind::DenseBlock).tp_fwd);
    }

    #[test]
    fn prediction_modules_run_on_the_last_stage_after_the_head() {
        // DeepSeek-V3's one prediction module: the head part pays a block like the last
        // layer (MoE, its experts over ep), a second head pass and its input projection;
        // model FLOPs count it once per sequence.
        let m = cfg("deepseek-v3");
        let without = TransformerConfig {
            mtp_layers: 0,
            ..m.clone()
        };
        let p = preset("dgx-h100-80gb").unwrap();
        let l = Layout {
            dp: 64,
            tp: 2,
            pp: 8,
            ep: 64,
            etp: Some(1),
            schedule: parallax_ir::Schedule::OneFOneB,
            ..layout(2, true, Recompute::None)
        };
        let costs = |m: &TransformerConfig| {
            let s = Setup {
                seq: 4096,
                ..setup(m, &p, 1024, Runtime::default())
            };
            (
                transformer_costs(&s, &l).unwrap(),
                model_flops_per_step(&s).unwrap(),
            )
        };
        let ((c, flops), (c0, flops0)) = (costs(&m), costs(&without));
        assert_eq!(c.layer(), c0.layer());
        assert_eq!(c.kinds, c0.kinds);
        assert!(c.head.fwd() > c0.head.fwd() + c.layer().fwd());
        assert_eq!(c.head.expert_params, c.layer().expert_params);
        // Its own copy of the table (vocab-parallel), the projection, the block's parameters.
        let table = 129_280 / 2 * 7168;
        assert!(c.head.params >= c0.head.params + c.layer().params + table);
        // One more block and head pass per sequence: 1–3 % of the 61 layers' FLOPs.
        let extra = flops / flops0 - 1.0;
        assert!((0.01..0.04).contains(&extra), "{extra}");
    }

    /// An MoE layer waits for its host work after the dispatcher's sync once per forward, with
    /// or without expert parallelism, and again where recomputation reruns it; other layers
    /// and a stack without the sync do not.
    #[test]
    fn moe_layers_wait_for_the_host_after_the_dispatcher_sync() {
        let m = cfg("nemotron-h");
        let p = preset("dgx-h100-80gb").unwrap();
        let costs = |moe_host_sync, ep, recompute| {
            let s = setup(
                &m,
                &p,
                16,
                Runtime {
                    moe_host_sync,
                    ..Runtime::default()
                },
            );
            let l = Layout {
                dp: 16,
                ep,
                ..layout(1, false, recompute)
            };
            transformer_costs(&s, &l).unwrap()
        };
        let host = |c: &PartCost| (c.host_fwd.0, c.host_bwd.0);
        let c = costs(true, 8, Recompute::None);
        assert_eq!(host(c.kind(LayerKind::Moe)), (MOE_HOST_S, 0.0));
        assert_eq!(host(c.kind(LayerKind::Mamba)), (0.0, 0.0));
        assert_eq!(host(c.kind(LayerKind::Attention)), (0.0, 0.0));
        let without = costs(false, 8, Recompute::None);
        let moe = |c: &TransformerCosts| *c.kind(LayerKind::Moe);
        assert!((moe(&c).fwd().0 - moe(&without).fwd().0 - MOE_HOST_S).abs() < 1e-12);
        // Without expert parallelism the split sizes of the experts' grouped GEMM still
        // make the host wait.
        assert_eq!(
            host(&moe(&costs(true, 1, Recompute::None))),
            (MOE_HOST_S, 0.0)
        );
        let full = costs(true, 8, Recompute::Full);
        assert_eq!(host(&moe(&full)), (MOE_HOST_S, MOE_HOST_S));
    }

    /// A hybrid stack prices each kind of layer on its own: only the MoE layers dispatch, only
    /// the attention layers pay context parallelism, each single-purpose layer opens one
    /// tensor-parallel region (none for an MoE layer under sequence parallelism without a
    /// shared expert), and the step sums the kinds at their counts.
    #[test]
    fn hybrid_layers_are_priced_by_kind() {
        let m = cfg("nemotron-h");
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup {
            seq: 8192,
            precision: Precision::Fp8,
            ..setup(&m, &p, 16, Runtime::default())
        };
        let l = Layout {
            dp: 16,
            ep: 8,
            ..layout(1, false, Recompute::None)
        };
        let c = transformer_costs(&s, &l).unwrap();
        let kind = |k| *c.kind(k);
        let (mamba, attn, moe) = (
            kind(LayerKind::Mamba),
            kind(LayerKind::Attention),
            kind(LayerKind::Moe),
        );
        assert!(c.kinds[LayerKind::Block.index()].is_none());
        assert!(moe.ep_fwd.0 > 0.0 && mamba.ep_fwd.0 == 0.0 && attn.ep_fwd.0 == 0.0);
        assert_eq!(c.layer(), &moe, "the heaviest layer");
        // 23 Mamba, 6 attention and 23 MoE layers.
        let all = c.layers_count(0, 52, |l| l.params);
        assert_eq!(all, 23 * mamba.params + 6 * attn.params + 23 * moe.params);
        assert_eq!(c.layer_at(5), &attn);
        assert_eq!(c.layer_at(51), &moe);
        // A Mamba layer's work is its projections' (6 FLOPs a parameter a token) and a few
        // percent for the scan; at 8k tokens an attention layer's quadratic part outweighs it.
        let projections = 6.0 * mamba.params as f64 * 8192.0;
        let r = mamba.model_flops / projections;
        assert!((1.0..1.1).contains(&r), "{r}");
        assert!(attn.model_flops > mamba.model_flops);
        // The model FLOPs: the attention layers' quadratic part and the projections of
        // every kind, 2 × (3.2 B parameters touched a token) × 3 passes and then some.
        let per_token = model_flops_per_step(&s).unwrap() / (s.global_batch as f64 * 8192.0);
        assert!((19e9..25e9).contains(&per_token), "{per_token:e}");
        // Tensor parallelism: a Mamba layer splits its heads and groups and opens one region.
        let tp2 = Layout {
            dp: 8,
            ..layout(2, true, Recompute::None)
        };
        // (Collectives not hidden behind GEMMs, to compare them.)
        let exposed = Setup {
            runtime: Runtime {
                tp_overlap: TpOverlap::None,
                ..Runtime::default()
            },
            ..s
        };
        let folded = Layout {
            ep: 8,
            etp: Some(1),
            ..tp2
        };
        let c2 = transformer_costs(&exposed, &folded).unwrap();
        let (m2, a2, e2) = (
            *c2.kind(LayerKind::Mamba),
            *c2.kind(LayerKind::Attention),
            *c2.kind(LayerKind::Moe),
        );
        assert!((m2.tp_fwd.0 - a2.tp_fwd.0).abs() < 1e-15 && m2.tp_fwd.0 > 0.0);
        // The MoE layer keeps its shared expert's region.
        assert!((e2.tp_fwd.0 - a2.tp_fwd.0).abs() < 1e-15);
        assert!(m2.params < mamba.params);
        // Context parallelism over Mamba layers is refused with its reason.
        let cp = Layout {
            dp: 8,
            cp: 2,
            ..layout(1, false, Recompute::None)
        };
        let err = transformer_costs(&s, &cp).unwrap_err().to_string();
        assert!(err.contains("Mamba"), "{err}");
    }

    /// Random top-k routing leaves the busiest expert rank σ·√(2 ln ep) above the mean: for
    /// DeepSeek-V3's 4096 tokens × 8 copies over 64 ranks, 1.6 %; an even deal none. The
    /// busiest rank's dispatch and expert rows grow by that share.
    #[test]
    fn the_busiest_expert_rank_receives_the_expected_maximum() {
        let n = 4096.0 * 8.0;
        let want = 1.0 + (2.0 * 64f64.ln() * (63.0 / 64.0) / n).sqrt();
        assert!((busiest_rank_load(64, n) - want).abs() < 1e-12);
        assert!((1.015..1.017).contains(&want), "{want}");
        assert_eq!(busiest_rank_load(1, n), 1.0);
        assert!(busiest_rank_load(8, 100.0) > busiest_rank_load(8, 10_000.0));
        let m = cfg("mixtral-8x7b");
        let p = preset("dgx-h100-80gb").unwrap();
        let l = Layout {
            dp: 8,
            ep: 8,
            ..layout(1, false, Recompute::None)
        };
        let at = |balanced_routing| {
            let s = setup(
                &m,
                &p,
                8,
                Runtime {
                    balanced_routing,
                    ..Runtime::default()
                },
            );
            *transformer_costs(&s, &l).unwrap().layer()
        };
        let (random, even) = (at(false), at(true));
        let load = busiest_rank_load(8, (2048 * 2) as f64);
        // The volume grows by the load; the all-to-all's latency does not.
        let r = random.ep_fwd.0 / even.ep_fwd.0;
        assert!(r > 1.0 && r <= load + 1e-9, "{r} vs {load}");
        assert!(random.compute.fwd > even.compute.fwd);

        // Token dropping at an even share (capacity factor 1) leaves no straggler: random
        // routing costs what even routing does; padding to 1.25 makes every rank compute and
        // receive 1.25 shares, more than random routing's busiest rank here.
        let with = |capacity_permille, pad_to_capacity| {
            let m = TransformerConfig {
                moe: m.moe.map(|x| MoeConfig {
                    capacity_permille,
                    pad_to_capacity,
                    ..x
                }),
                ..m.clone()
            };
            let s = setup(&m, &p, 8, Runtime::default());
            *transformer_costs(&s, &l).unwrap().layer()
        };
        let dropped = with(1000, false);
        assert!((dropped.ep_fwd.0 - even.ep_fwd.0).abs() < 1e-12 * even.ep_fwd.0);
        assert!((dropped.compute.fwd.0 - even.compute.fwd.0).abs() < 1e-12 * even.compute.fwd.0);
        let padded = with(1250, true);
        assert!(padded.ep_fwd > random.ep_fwd && padded.compute.fwd > random.compute.fwd);
        assert_eq!(padded.model_flops, random.model_flops);
    }

    #[test]
    fn a_node_deduplicating_dispatcher_is_faster_only_across_nodes() {
        // DeepSeek-V3's experts over 64 ranks (8 nodes): DeepEP's dispatch beats the
        // all-to-all and the layer pays less; over 8 ranks of one node they move the same
        // bytes, and DeepEP is ahead only by the all-to-all's sort of the received rows.
        let m = cfg("deepseek-v3");
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup {
            seq: 4096,
            ..setup(&m, &p, 1024, Runtime::default())
        };
        let at = |ep: u32, dispatcher: Dispatcher| Layout {
            dp: 64,
            tp: 2,
            pp: 8,
            ep,
            etp: Some(1),
            dispatcher,
            schedule: parallax_ir::Schedule::OneFOneB,
            ..layout(2, true, Recompute::None)
        };
        assert_eq!(
            faster_dispatcher(&s, &at(64, Dispatcher::AllToAll)),
            Dispatcher::DeepEp
        );
        let cost = |l: Layout| *transformer_costs(&s, &l).unwrap().layer();
        let (one_node, one_node_dedup) = (
            cost(at(8, Dispatcher::AllToAll)),
            cost(at(8, Dispatcher::DeepEp)),
        );
        assert_eq!(one_node.ep_fwd, one_node_dedup.ep_fwd);
        assert!(one_node_dedup.compute.fwd < one_node.compute.fwd);
        assert_eq!(
            faster_dispatcher(&s, &at(8, Dispatcher::AllToAll)),
            Dispatcher::DeepEp
        );
        let (plain, dedup) = (
            cost(at(64, Dispatcher::AllToAll)),
            cost(at(64, Dispatcher::DeepEp)),
        );
        assert!(dedup.ep_fwd < plain.ep_fwd);
        assert_eq!(dedup.params, plain.params);
        // A dense model has no dispatcher to choose.
        let dense = cfg("llama3-8b");
        let s = setup(&dense, &p, 8, Runtime::default());
        let l = Layout {
            dp: 8,
            dispatcher: Dispatcher::DeepEp,
            ..layout(1, false, Recompute::None)
        };
        assert!(transformer_costs(&s, &l).is_err());
    }

    #[test]
    fn an_overlapped_dispatch_hides_behind_the_partner_pass() {
        // By hand: a forward of 3 ms with 2 ms of dispatch, a backward of 6 ms (input and
        // weight gradients) with 2 ms. Merged, the forward's 2 ms run beside the backward's
        // 6 ms of kernels and the backward's beside the forward's 1 ms: 0.2 · 2 and
        // (2 − 1) + 0.2 · 1 remain. Half the passes merged: halfway between.
        let ms = |x: f64| Seconds(x * 1e-3);
        let part = PartCost {
            compute: OpTimes {
                fwd: ms(1.0),
                bwd_input: ms(2.0),
                bwd_weight: ms(2.0),
            },
            ep_fwd: ms(2.0),
            ep_bwd: ms(2.0),
            ..PartCost::ZERO
        };
        let close = |a: Seconds, b: Seconds| (a.0 - b.0).abs() < 1e-12;
        let all = part.ep_overlapped(1.0);
        let i = crate::comm::OVERLAP_INTERFERENCE;
        assert!(close(all.ep_fwd, ms(2.0 * i)), "{:?}", all.ep_fwd);
        assert!(close(all.ep_bwd, ms(1.0 + i)), "{:?}", all.ep_bwd);
        assert_eq!((all.compute, all.saved), (part.compute, part.saved));
        let half = part.ep_overlapped(0.5);
        assert!(close(half.ep_fwd, (part.ep_fwd + all.ep_fwd) * 0.5));
        assert_eq!(part.ep_overlapped(0.0), part);
        // A layer without a dispatch is unchanged.
        let dense = PartCost {
            ep_fwd: Seconds(0.0),
            ep_bwd: Seconds(0.0),
            ..part
        };
        assert_eq!(dense.ep_overlapped(1.0), dense);
    }

    #[test]
    fn recomputed_flops_scale_like_the_model_flops() {
        // Full recompute redoes the forward: a third of the training FLOPs of every op, on
        // one device as much as the layout gives it (attention × cp, SP-split ops ÷ tp).
        let m = cfg("llama3-8b");
        let p = preset("dgx-h100-80gb").unwrap();
        let extra = |gpus, l: Layout| {
            let s = Setup {
                seq: 8192,
                ..setup(&m, &p, gpus, Runtime::default())
            };
            let c = *transformer_costs(&s, &l).unwrap().layer();
            (c.hardware_flops - c.model_flops) / c.model_flops
        };
        let one = extra(1, layout(1, false, Recompute::Full));
        let split = extra(
            4,
            Layout {
                cp: 2,
                ..layout(2, true, Recompute::Full)
            },
        );
        assert!((one - split).abs() < 0.01, "{one} vs {split}");
        assert!((0.3..0.37).contains(&one), "{one}");
    }

    #[test]
    fn infeasible_layouts_say_why() {
        let m = cfg("gpt3-175b");
        let p = preset("dgx-a100-80gb").unwrap();
        let s = setup(&m, &p, 16, Runtime::default());
        let e = transformer_costs(&s, &layout(16, false, Recompute::None)).unwrap_err();
        assert_eq!(e.kind(), "tp across nodes");
        let s = setup(&m, &p, 5, Runtime::default());
        assert_eq!(
            transformer_costs(&s, &layout(5, false, Recompute::None))
                .unwrap_err()
                .kind(),
            "indivisible"
        );
        let s = setup(&m, &p, 8, Runtime::default());
        assert_eq!(
            transformer_costs(&s, &layout(1, false, Recompute::None))
                .unwrap_err()
                .kind(),
            "device count"
        );
        let l = Layout {
            pp: 2,
            tp: 4,
            schedule: Schedule::OneFOneB,
            micro_batch: 3,
            ..Layout::default()
        };
        assert_eq!(transformer_costs(&s, &l).unwrap_err().kind(), "indivisible");
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use parallax_hardware::preset;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// More recomputation never keeps more activations, and every cost is non-negative.
        #[test]
        fn recompute_is_monotone_and_costs_are_non_negative(
            layers in 2u32..6,
            heads_log in 1u32..4,
            kv_div in 0u32..2,
            head_dim in prop::sample::select(vec![32u64, 64]),
            tp_log in 0u32..3,
            mb in 1u64..4,
            seq in prop::sample::select(vec![64u64, 128, 256]),
            sp in any::<bool>(),
            fused in any::<bool>(),
            llama in any::<bool>(),
        ) {
            let heads = 1u64 << (heads_log + tp_log);
            let hidden = heads * head_dim;
            let kv = if llama { heads >> kv_div } else { heads };
            let m = if llama {
                TransformerConfig::llama(layers, hidden, heads, kv, 4 * hidden, 512, seq)
            } else {
                TransformerConfig::gpt(layers, hidden, heads, 4 * hidden, 512, seq)
            };
            let p = preset("dgx-a100-80gb").unwrap();
            let tp = 1u32 << tp_log;
            let s = Setup {
                runtime: Runtime { fused_attention: fused, ..Runtime::default() },
                ..Setup::new(&m, &p, tp, seq, mb)
            };
            let at = |r| {
                let l = Layout { tp, micro_batch: mb, recompute: r, sequence_parallel: sp, ..Layout::default() };
                transformer_costs(&s, &l).unwrap()
            };
            let (none, sel, full) = (at(Recompute::None), at(Recompute::Selective), at(Recompute::Full));
            prop_assert!(sel.layer().saved <= none.layer().saved);
            prop_assert!(full.layer().saved <= sel.layer().saved);
            prop_assert!(full.layer().recompute >= sel.layer().recompute);
            for c in [&none, &sel, &full] {
                for t in [c.layer().fwd(), c.layer().bwd_input(), c.layer().bwd_weight(), c.head.fwd(), c.embedding.fwd(), c.p2p] {
                    prop_assert!(t.0 >= 0.0 && t.0.is_finite());
                }
            }
        }
    }
}
