//! Per-device memory: model states under ZeRO, activations, buffers and the allocator's share.

use parallax_ir::{Bytes, Precision};
use serde::{Deserialize, Serialize};

/// Bytes of model state per parameter for mixed-precision Adam (Rajbhandari et al. 2020, ZeRO
/// §3.1): 16-bit working weights (2), fp32 gradient accumulation buffer (4, Megatron-LM's
/// `main_grad`; a stack's own buffers are `Setup::grad_buffer_bytes` of the transformer cost
/// model), fp32 master weights (4), Adam first and second moments (4 + 4).
pub const MIXED_WEIGHT_BYTES: f64 = 2.0;
pub const MIXED_GRAD_BYTES: f64 = 4.0;
pub const MIXED_OPTIMIZER_BYTES: f64 = 12.0;
/// fp32 / tf32 training: weights 4, gradients 4, Adam moments 8.
pub const FP32_WEIGHT_BYTES: f64 = 4.0;
pub const FP32_GRAD_BYTES: f64 = 4.0;
pub const FP32_OPTIMIZER_BYTES: f64 = 8.0;

/// The Adam update proper, per parameter: read the fp32 master weight, gradient and both
/// moments (16), write the three back (12).
pub const ADAM_UPDATE_BYTES: f64 = 28.0;

/// An fp32 gradient read for its norm (gradient clipping).
pub const GRAD_NORM_FP32_BYTES: f64 = 4.0;

/// Bytes an Adam step moves per parameter it updates: the update, the 16-bit working copy
/// written (2) and the gradient-norm read for clipping.
pub const ADAM_BYTES_PER_PARAM: f64 = ADAM_UPDATE_BYTES + 2.0 + GRAD_NORM_FP32_BYTES;

/// An fp16 gradient checked for inf/NaN on an fp32 copy (`float(x.float().sum())`, DeepSpeed's
/// `_has_inf_or_nan`): 2 read, 4 written, 4 read by the sum.
pub const GRAD_CHECK_FP32_BYTES: f64 = 10.0;

/// An fp16 gradient's norm taken in fp64 (`.double().norm(2)`): 2 read, 8 written, 8 read.
pub const GRAD_NORM_FP64_BYTES: f64 = 18.0;

/// A 16-bit tensor cast to fp32 (2 read, 4 written), or copied (2 read, 2 written); an fp32
/// tensor copied or scaled in place (4 read, 4 written), or cast to 16 bits (4 read, 2
/// written).
pub const CAST_UP_BYTES: f64 = 6.0;
pub const COPY_16_BYTES: f64 = 4.0;
pub const COPY_32_BYTES: f64 = 8.0;
pub const SCALE_32_BYTES: f64 = 8.0;
pub const CAST_DOWN_BYTES: f64 = 6.0;

/// Host-memory traffic of one parameter's Adam step on the CPU as `parallax calibrate` measures
/// it (`node.host_adam_gparams_per_s`): the update's read of the fp32 weight, gradient and both
/// moments and write of the three ([`ADAM_UPDATE_BYTES`]) and the 16-bit copy written (2). A
/// measured rate times this is the host's stream rate.
pub const HOST_ADAM_BYTES_PER_PARAM: f64 = ADAM_UPDATE_BYTES + 2.0;

/// Host-memory traffic of one parameter's step under PyTorch's `_single_tensor_adamw` over CPU
/// tensors, one kernel per op: `param.mul_` for the decoupled decay (8), `exp_avg.lerp_` (read
/// both, write one: 12), `exp_avg_sq.mul_` (8) and `.addcmul_(grad, grad)` (12),
/// `(exp_avg_sq.sqrt() / c).add_(eps)` (three passes of 8, two of them into temporaries),
/// `param.addcdiv_(exp_avg, denom)` (read three, write one: 16).
pub const TORCH_ADAMW_HOST_BYTES: f64 =
    SCALE_32_BYTES + 12.0 + SCALE_32_BYTES + 12.0 + 3.0 * COPY_32_BYTES + 16.0;

/// Host-memory traffic of one parameter's gradient unscale before an offloaded step: DeepSpeed
/// multiplies the host's fp32 gradient partition in place by the inverse of the loss scale and
/// clip factor (`unscale_and_clip_grads` on `single_partition_of_fp32_groups[i].grad`, a
/// `mul_` read and written, 8 bytes), in 0.3's stage2.py as in today's stage_1_and_2.py; its
/// `optimizer_gradients` timer (1.1 s of the ZeRO-Offload tutorial's 10B step) is that pass.
pub const HOST_GRAD_UNSCALE_BYTES_PER_PARAM: f64 = SCALE_32_BYTES;

/// DeepSpeed's `reduce_bucket_size` and `allgather_bucket_size` defaults, elements (5e8 in
/// zero/constants.py at v0.3.0 as today; ZeRO config docs): the gradients an offloading stack
/// holds on the device before sending them to the host, the gradients ZeRO-2 flattens for one
/// reduction, the parameters one of its all-gathers returns.
pub const DEEPSPEED_BUCKET_ELEMENTS: u64 = 500_000_000;

/// Device-memory traffic per gradient element of its partition that DeepSpeed's ZeRO-1/2 with
/// an offloaded optimizer spends on the device before the copy down (`copy_grads_in_partition`,
/// stage2.py in 0.3, stage_1_and_2.py today): the fp64 norm, the inf/NaN check on an fp32
/// copy and the fp32 cast the copy sends.
pub const OFFLOAD_GRAD_DEVICE_BYTES_PER_PARAM: f64 =
    GRAD_NORM_FP64_BYTES + GRAD_CHECK_FP32_BYTES + CAST_UP_BYTES;

/// Bytes ZeRO-Infinity's NVMe optimizer reads from the drives per parameter before the step:
/// the fp32 weight, momentum and variance it swapped out after the last one, and the fp32
/// gradient it swapped out during backward (`OptimizerSwapper`: `swap_in_optimizer_state`
/// brings the gradients in with the states; deepspeed/runtime/swap_tensor).
pub const NVME_SWAP_IN_BYTES_PER_PARAM: u64 = 16;

/// Bytes it writes back after the step: the three fp32 states (the gradient is not kept).
pub const NVME_SWAP_OUT_BYTES_PER_PARAM: u64 = 12;

/// Fraction of a server's DRAM peak (channels × rate × 8 bytes, all sockets) an offloaded
/// optimizer step sustains where `calibrate` has not measured the host. Not STREAM's 70–80 %:
/// DeepSpeedCPUAdam updated an 11.6B-parameter GPT-2 in 8.2 s (a DeepSpeed author in PR #735,
/// February 2021, host not stated): 1.41 G parameters a second, 40–45 GB/s (28 bytes a
/// parameter for the update, 32 with the fp32 copy DeepSpeed 0.3 writes for the device), 0.16–
/// 0.18 of a two-socket DDR4-2666 server's 256 GB/s; the ZeRO-Offload tutorial's DGX-2 (two
/// Xeon Platinum 8168, 256 GB/s) logs 6.2–6.5 s of `optimizer_step` for 10B (0.20).
/// DeepSpeed's fp32 states and pinned gradient buffer are first touched by one thread
/// (`pin_memory()`, `.float().cpu()`), so they live in one socket's memory, which the other
/// socket's OpenMP threads reach over UPI.
pub const HOST_STREAM_EFFICIENCY: f64 = 0.17;

/// Memory the caching allocator holds beyond live tensors (fragmentation and rounding of
/// blocks), as a fraction of live bytes. PyTorch's `max_memory_reserved` typically runs 5–10 %
/// above `max_memory_allocated` in large-model training (PyTorch CUDA caching allocator notes).
pub const ALLOCATOR_FRACTION: f64 = 0.07;

/// Device memory a process holds outside its caching allocator, GiB: the CUDA context and the
/// kernel images it loads (PyTorch, cuBLAS, cuDNN, NCCL). `nvidia-smi` counts it, the
/// allocator's statistics do not: one 4-byte tensor put on a GPU by a CUDA-10-era PyTorch shows
/// as 723 MiB (discuss.pytorch.org/t/73021, 2020).
pub const CUDA_CONTEXT_GIB: f64 = 723.0 / 1024.0;

/// Fixed workspace outside the model on a GPU: cuBLAS / cuDNN workspaces and NCCL buffers,
/// GiB.
pub const WORKSPACE_GIB: f64 = 1.0;

/// The fixed workspace of one device of `profile`: [`WORKSPACE_GIB`] on a GPU; nothing on
/// host cores (the CPU executor allocates no library workspaces or communication buffers
/// beyond the tensors it moves).
pub fn workspace_gib(profile: &parallax_hardware::ClusterProfile) -> f64 {
    if profile.node.devices_are_host_cores() {
        0.0
    } else {
        WORKSPACE_GIB
    }
}

/// Bytes an SGD-with-momentum step moves per fp32 parameter: read weight, gradient and momentum,
/// write weight and momentum (5 × 4), as `torch.optim.SGD(momentum=…)` and tf_cnn_benchmarks'
/// momentum optimizer do.
pub const SGD_MOMENTUM_BYTES_PER_PARAM: f64 = 20.0;

/// The fp32 master copy of a mixed-precision parameter, and one fp32 state buffer (a momentum).
const FP32_BUFFER_BYTES: f64 = 4.0;

/// Optimizer whose state and update are costed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    /// Adam(W): two fp32 moments per parameter (plus an fp32 master copy under mixed precision).
    #[default]
    Adam,
    /// SGD with momentum: one fp32 momentum buffer (plus the master copy under mixed precision).
    SgdMomentum,
}

impl Optimizer {
    /// What a model is trained with when nothing says: SGD with momentum for convolutional
    /// networks (every image benchmark they are known from), Adam for everything else.
    pub fn default_for(graph: &parallax_ir::Graph) -> Optimizer {
        if graph
            .nodes
            .iter()
            .any(|n| matches!(n.op, parallax_ir::OpKind::Conv2d(_)))
        {
            Optimizer::SgdMomentum
        } else {
            Optimizer::Adam
        }
    }

    /// Optimizer-state bytes per parameter, master copy included.
    pub fn state_bytes(self, precision: Precision) -> f64 {
        match (self, precision.is_mixed()) {
            (Optimizer::Adam, true) => MIXED_OPTIMIZER_BYTES,
            (Optimizer::Adam, false) => FP32_OPTIMIZER_BYTES,
            (Optimizer::SgdMomentum, true) => 2.0 * FP32_BUFFER_BYTES,
            (Optimizer::SgdMomentum, false) => FP32_BUFFER_BYTES,
        }
    }

    /// Bytes one update moves per parameter it updates.
    pub fn update_bytes(self) -> f64 {
        match self {
            Optimizer::Adam => ADAM_BYTES_PER_PARAM,
            Optimizer::SgdMomentum => SGD_MOMENTUM_BYTES_PER_PARAM,
        }
    }
}

/// Model-state bytes per parameter on one device under Adam: (weights, gradients, optimizer
/// states).
pub fn state_bytes_per_param(precision: Precision, zero_stage: u8, dp: u32) -> (f64, f64, f64) {
    state_bytes_per_param_for(Optimizer::Adam, precision, zero_stage, dp)
}

/// Model-state bytes per parameter on one device under `optimizer`: (weights, gradients,
/// optimizer states), sharded over `dp` ranks by the ZeRO stage.
pub fn state_bytes_per_param_for(
    optimizer: Optimizer,
    precision: Precision,
    zero_stage: u8,
    dp: u32,
) -> (f64, f64, f64) {
    let (w, g) = if precision.is_mixed() {
        (MIXED_WEIGHT_BYTES, MIXED_GRAD_BYTES)
    } else {
        (FP32_WEIGHT_BYTES, FP32_GRAD_BYTES)
    };
    let o = optimizer.state_bytes(precision);
    let d = f64::from(dp.max(1));
    match zero_stage {
        0 => (w, g, o),
        1 => (w, g, o / d),
        2 => (w, g / d, o / d),
        // ZeRO-3 / FSDP keeps no unsharded working copy; the sharded fp32 master serves as
        // the parameter and is cast per layer when gathered (counted as a gather buffer).
        _ if precision.is_mixed() => (0.0, g / d, o / d),
        _ => (w / d, g / d, o / d),
    }
}

/// Peak memory of one device, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    pub params: Bytes,
    pub grads: Bytes,
    pub optimizer: Bytes,
    pub activations: Bytes,
    /// Communication and gather buffers, logits, workspaces.
    pub buffers: Bytes,
    /// What the caching allocator reserves beyond the live tensors (fragmentation, block
    /// rounding).
    pub allocator: Bytes,
}

impl MemoryBreakdown {
    /// Everything the allocator reserves at the peak (PyTorch's `max_memory_reserved`): what
    /// must fit in the device.
    pub fn total(&self) -> Bytes {
        self.allocated() + self.allocator
    }

    /// The live tensors at the peak (PyTorch's `max_memory_allocated`).
    pub fn allocated(&self) -> Bytes {
        self.params + self.grads + self.optimizer + self.activations + self.buffers
    }

    /// Adds the allocator allowance on top of the live bytes.
    pub fn with_allocator(mut self) -> Self {
        self.allocator = Bytes((self.allocated().0 as f64 * ALLOCATOR_FRACTION) as u64);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_stages_shard_progressively() {
        let p = Precision::Bf16;
        let total = |z| {
            let (w, g, o) = state_bytes_per_param(p, z, 8);
            w + g + o
        };
        assert_eq!(total(0), 18.0);
        assert_eq!(total(1), 2.0 + 4.0 + 1.5);
        assert_eq!(total(2), 2.0 + 0.5 + 1.5);
        assert_eq!(total(3), 2.0);
        assert!(total(0) > total(1) && total(1) > total(2) && total(2) > total(3));
        assert_eq!(
            state_bytes_per_param(Precision::Fp32, 0, 8),
            (4.0, 4.0, 8.0)
        );
        // SGD with momentum keeps one buffer, and the master copy under mixed precision.
        let sgd = |p| state_bytes_per_param_for(Optimizer::SgdMomentum, p, 0, 1).2;
        assert_eq!(sgd(Precision::Fp32), 4.0);
        assert_eq!(sgd(Precision::Bf16), 8.0);
    }
}
