//! The software stack as an input (`--framework NAME@VERSION`): what a training framework
//! release does at run time (attention kernels, overlap of gradient reduction, parameter
//! gathers, tensor-parallel and pipeline communication, the pipeline engine and its
//! schedules, the ZeRO stages it offers, the gradient reduction type) and the part of the
//! layout space it offers.
//!
//! [`STACKS`] is the table, one row per stack and era, each feature with the document that
//! states it. `plan`, `simulate`, `run`'s prediction and `validate` take a stack from it;
//! `--export ENGINE` implies the engine's current row ([`Framework::for_engine`]); the default
//! is a current stack ([`Framework::current`]), named in every report. `parallax frameworks`
//! prints the table. A DeepSpeed run's own `ds_config.json` refines its row
//! ([`Framework::with_ds_config`]).

use crate::ds_config::DsConfig;
use crate::export::Engine;
use crate::search::{PipelineDefaults, Space};
use parallax_cost::transformer::{
    CrossEntropy, HostOptimizer, OptimizerPasses, PipeMessages, PipeSends, Runtime, TpOverlap,
    WgradAccumulation, Zero3Engine, MEGATRON_VOCAB_MULTIPLE,
};
use parallax_ir::{Fp8Recipe, Offload, Recompute, Schedule};
use std::fmt::Write as _;
use thiserror::Error;

/// A software stack: its runtime behaviour and the layout options it offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Framework {
    /// `name@version` of the row (the version as the user gave it, where one was).
    pub name: String,
    pub runtime: Runtime,
    /// Values the stack offers for knobs a plan or a publication leaves open (sequence
    /// parallelism included).
    pub space: Space,
}

/// What [`Framework::with_ds_config`] appends to a stack's name, before the file's.
const DS_CONFIG: &str = ", ds_config ";

/// One runtime feature of a stack and the document that states it.
#[derive(Clone, Copy, Debug)]
pub struct Feature {
    pub what: &'static str,
    pub source: &'static str,
}

/// A row of the table.
#[derive(Debug)]
pub struct Stack {
    /// `name@era` as reports print it.
    pub name: &'static str,
    /// The `name@version` spellings the row answers to.
    pub covers: &'static str,
    /// The stack names (before `@`) the row answers to.
    pub names: &'static [&'static str],
    pub features: &'static [Feature],
    matches: fn(&str, &Version) -> bool,
    build: fn() -> Parts,
}

/// Runtime and space of a row.
#[derive(Debug)]
struct Parts {
    runtime: Runtime,
    space: Space,
}

/// Why a `--framework` value was refused.
#[derive(Debug, Error, PartialEq)]
pub enum FrameworkError {
    #[error("unknown stack '{0}' (`parallax frameworks` lists the known ones: {1})")]
    Unknown(String, String),
    #[error("'{0}': {1}")]
    Version(String, String),
    #[error("{0}")]
    Option(String),
}

/// A version as stacks number them: a year (`2022`) or a month (`2025-02`), a year-month
/// release (`24.07`, NGC and NeMo style), a semantic version (`0.3`, `v2.1`,
/// `core_r0.9.0`), or nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Version {
    year: Option<u32>,
    /// The month, where the version names one (`2025-02`, `24.07`).
    month: Option<u32>,
    semver: Option<(u32, u32)>,
}

impl Version {
    fn parse(v: &str) -> Version {
        let v = v
            .trim_start_matches("core_r")
            .trim_start_matches("core_v")
            .trim_start_matches('v');
        let mut nums = v
            .split(['.', '-', '_'])
            .map_while(|p| p.parse::<u32>().ok());
        let (a, b) = (nums.next(), nums.next());
        let month = b.filter(|m| (1..=12).contains(m));
        match a {
            Some(y) if (2015..2100).contains(&y) => Version {
                year: Some(y),
                month,
                semver: None,
            },
            // `24.07`, `25.09`, `26.04.01`: year-month releases.
            Some(y) if (19..100).contains(&y) && month.is_some() => Version {
                year: Some(2000 + y),
                month,
                semver: Some((y, b.unwrap_or(0))),
            },
            Some(major) => Version {
                year: None,
                month: None,
                semver: Some((major, b.unwrap_or(0))),
            },
            None => Version::default(),
        }
    }

    /// Whether the version is `year`-`month` or earlier (a bare year counts as its whole
    /// year: `2025` is not before `2025-04`).
    fn up_to(&self, year: u32, month: u32) -> bool {
        self.year
            .is_some_and(|y| y < year || (y == year && self.month.is_some_and(|m| m <= month)))
    }

    fn year_in(&self, lo: u32, hi: u32) -> bool {
        self.year.is_some_and(|y| (lo..=hi).contains(&y))
    }

    fn semver_in(&self, lo: (u32, u32), hi: (u32, u32)) -> bool {
        self.year.is_none() && self.semver.is_some_and(|v| v >= lo && v <= hi)
    }

    fn none(&self) -> bool {
        self.year.is_none() && self.semver.is_none()
    }
}

/// Attention, reduction and pipeline behaviour of stacks before FlashAttention (Dao et al.,
/// mid-2022): attention as batched GEMMs around a fused softmax, blocking pipeline sends.
fn pre_flash(overlap_grad_reduce: bool, grad_reduce_fp32: bool) -> Runtime {
    Runtime {
        fused_attention: false,
        overlap_grad_reduce,
        tp_overlap: TpOverlap::None,
        pipe_sends: PipeSends::Paired,
        grad_reduce_fp32,
        ..Runtime::default()
    }
}

/// `rt` with Megatron's vocab-parallel cross-entropy and padded vocabulary (every stack built
/// on Megatron-LM's model code).
fn megatron_loss(rt: Runtime) -> Runtime {
    Runtime {
        cross_entropy: CrossEntropy::VocabParallel,
        vocab_multiple: MEGATRON_VOCAB_MULTIPLE,
        ..rt
    }
}

/// A space offering `schedules`, ZeRO stages `zero` and `recompute`, with uneven stages,
/// sequence and model parallelism, as of its stack's era: no offload, no fp8 recipe and no
/// asynchronous TP unless its row adds them.
fn space(schedules: &[Schedule], zero: &[u8], recompute: &[Recompute]) -> Space {
    Space {
        schedules: schedules.to_vec(),
        zero_stages: zero.to_vec(),
        recompute: recompute.to_vec(),
        offload: Vec::new(),
        fp8_recipes: Vec::new(),
        async_tp: false,
        // A share of the layers recomputed whole is a knob of today's stacks, and so is
        // context parallelism (Megatron-Core's from late 2023).
        recompute_layers: false,
        context_parallel: false,
        ..Space::default()
    }
}

/// Transformer Engine 1.x, the fp8 of Megatron-LM 2023 and Megatron-Core 2024: delayed
/// scaling only (`DelayedScaling`; current scaling came with TE 2.2 in 2025).
const TE1_RECIPES: [Fp8Recipe; 1] = [Fp8Recipe::Delayed];

/// Megatron-LM's space: every stage holds the same number of layers; sequence parallelism
/// from 2022.
fn megatron_space(
    schedules: &[Schedule],
    zero: &[u8],
    recompute: &[Recompute],
    sequence_parallel: bool,
) -> Space {
    Space {
        uneven_stages: false,
        // DeepEP came to Megatron-Core in 2025 (the flex dispatcher), and the combined 1F1B
        // that overlaps the expert dispatch with it (core 0.14).
        deepep: false,
        ep_overlap: false,
        sequence_parallel,
        ..space(schedules, zero, recompute)
    }
}

/// `s` without tensor, context, expert or sequence parallelism.
fn data_parallel_only(s: Space) -> Space {
    Space {
        sequence_parallel: false,
        model_parallel: false,
        ..s
    }
}

const NO_OR_FULL: [Recompute; 2] = [Recompute::None, Recompute::Full];
const ONE_F_ONE_B: [Schedule; 1] = [Schedule::OneFOneB];
const MEGATRON_SCHEDULES: [Schedule; 2] = [Schedule::OneFOneB, Schedule::Interleaved1F1B];
const NO_PIPELINE: [Schedule; 1] = [Schedule::None];

const MEGATRON_2020: &[Feature] = &[
    Feature {
        what: "tensor parallelism, full activation checkpointing, 1F1B pipeline; no sequence parallelism, selective recompute, distributed optimizer or interleaving",
        source: "Megatron-LM v1.x README (2020); Shoeybi et al. 2019",
    },
    Feature {
        what: "attention as batched GEMMs with a fused scale-mask-softmax kernel",
        source: "megatron/model/fused_softmax.py (v1.x)",
    },
    Feature {
        what: "fp16 gradients all-reduced in fp16 after the backward (LocalDDP, no overlap)",
        source: "megatron/model/distributed.py (v1.x)",
    },
    Feature {
        what: "apex-style FP16_Optimizer: persistent fp32 master gradients beside the fp16 ones",
        source: "megatron/fp16/fp16util.py model_grads_to_master_grads (v1.x)",
    },
    Feature {
        what: "blocking pipeline sends",
        source: "megatron/p2p_communication.py (v2.0)",
    },
    Feature {
        what: "vocab-parallel cross-entropy in one fp32 buffer: softmax and its gradient computed in place (every Megatron-based stack below)",
        source: "megatron/mpu/cross_entropy.py (v1.x); megatron/core/tensor_parallel/cross_entropy.py",
    },
    Feature {
        what: "the vocabulary padded to a multiple of 128 entries per TP rank (every Megatron-based stack below): GPT-2's 50,257 runs as 50,304 at tp 1, its head GEMMs aligned",
        source: "--make-vocab-size-divisible-by (default 128), _vocab_size_with_padding in megatron/tokenizer (v1.x) and megatron/training/tokenizer/tokenizer.py",
    },
    Feature {
        what: "weight gradients accumulated over micro-batches by autograd in the fp16 model's .grad",
        source: "Megatron-LM v1.x megatron/fp16 (apex FP16_Optimizer: fp16 model gradients, copied to fp32 master gradients at the step)",
    },
];

const MEGATRON_2021: &[Feature] = &[
    Feature {
        what: "adds the interleaved 1F1B schedule; fp16 gradients accumulated in the parameters' .grad by autograd and all-reduced in fp16 after the backward (fp32 accumulation, --accumulate-allreduce-grads-in-fp32, was opt-in for fp16)",
        source: "Narayanan et al. 2021 (PTD-P), §2.2 and §4; Megatron-LM v2.5 arguments.py (--accumulate-allreduce-grads-in-fp32 and --use-contiguous-buffers-in-ddp store_true, forced only for bf16) and examples/pretrain_gpt3_175B.sh (--fp16 alone)",
    },
    Feature {
        what: "still batched-GEMM attention, blocking sends, no sequence parallelism",
        source: "Megatron-LM v2.x README",
    },
];

const MEGATRON_2022: &[Feature] = &[
    Feature {
        what: "adds sequence parallelism and selective recompute of the attention core",
        source: "Korthikanti et al. 2022, §4–5; Megatron-LM v3.0 --sequence-parallel, --recompute-activations",
    },
    Feature {
        what: "attention still unfused (FlashAttention appeared mid-2022 and came to Megatron-LM in 2023)",
        source: "Dao et al. 2022; Megatron-LM 23.04 --use-flash-attn",
    },
    Feature {
        what: "weight-gradient GEMMs accumulate into the fp32 main_grad buffer themselves (no pass of their own)",
        source: "Megatron-LM commit 83b1e42 (February 2022): --gradient-accumulation-fusion, on by default, fused_weight_gradient_dense",
    },
    ASYNC_COLUMN_BACKWARD,
];

/// Transformer Engine's fp8 linear layers and what they keep for backward.
const TE_FP8_SAVED: Feature = Feature {
    what: "Transformer Engine's fp8 linear layers keep the fp8 cast of their input for the weight gradient (one byte an element), not the 16-bit input",
    source: "Transformer Engine 1.x module/linear.py (saved_inputmat), layernorm_linear.py and layernorm_mlp.py (ln_out, gelu_out saved in fp8)",
};

const MEGATRON_2023: &[Feature] = &[
    Feature {
        what: "FlashAttention (--use-flash-attn) and the distributed optimizer (ZeRO-1, --use-distributed-optimizer)",
        source: "Megatron-LM 23.04–23.08 release notes",
    },
    Feature {
        what: "gradient reduction after the backward: --overlap-grad-reduce and --overlap-param-gather arrived with core_r0.4 (late 2023) and are off by default",
        source: "Megatron-LM core_r0.4.0 arguments.py",
    },
    Feature {
        what: "no TP communication overlap beyond the column-parallel layers' backward (Transformer Engine userbuffers, --tp-comm-overlap, opt-in)",
        source: "Jiang et al. 2024 (MegaScale) §6.1, the Megatron-LM baseline",
    },
    ASYNC_COLUMN_BACKWARD,
    Feature {
        what: "fp8 with delayed scaling: casts fused into the norm, activation and bias-gradient kernels",
        source: "Transformer Engine 1.x docs, recipe.DelayedScaling (the default recipe); LayerNormLinear / LayerNormMLP fp8 outputs",
    },
    TE_FP8_SAVED,
];

const MEGATRON_CORE_2024: &[Feature] = &[
    Feature {
        what: "MoE token dispatchers wait for the GPU before the expert-parallel exchange, or without one before the experts (the split sizes of the exchange and of the grouped GEMM are host values), so each MoE layer's router, dispatcher and permutation host work (2.9 ms a micro-batch on H100 hosts, fitted) runs with the GPU idle",
        source: "Megatron-Core megatron/core/transformer/moe/token_dispatcher.py (`_maybe_update_cuda_sync_point`), MoE README (\"CPU overhead\", CUDA graphs of moe_router / moe_preprocess)",
    },
    Feature {
        what: "Transformer Engine fused attention (cuDNN / FlashAttention)",
        source: "Megatron-LM README, H100 table (2024); Megatron-Core 0.5+ transformer_engine spec",
    },
    Feature {
        what: "distributed optimizer with overlapped gradient reduce-scatter and parameter all-gather",
        source: "Megatron-Core docs, distributed optimizer (--overlap-grad-reduce, --overlap-param-gather)",
    },
    Feature {
        what: "tensor-parallel communication overlapped with GEMMs (TE userbuffers), overlapped pipeline sends",
        source: "Megatron-Core --tp-comm-overlap, --overlap-p2p-communication; NeMo performance recipes",
    },
    Feature {
        what: "1F1B and interleaved schedules, equal stages; sequence and context parallelism; selective recompute",
        source: "Megatron-Core parallelism guide",
    },
    Feature {
        what: "fp8 with delayed scaling (--fp8-recipe delayed, the default), casts fused into the kernels that write the operands",
        source: "Megatron-Core arguments (--fp8-recipe); Transformer Engine 1.x recipe.DelayedScaling; NeMo 24.07 fp8 recipes",
    },
    TE_FP8_SAVED,
];

const NEMO_2407: &[Feature] = &[
    Feature {
        what: "everything of megatron-core@2024 (NeMo 24.07 trains on Megatron-Core with Transformer Engine)",
        source: "NeMo 24.07 release notes; NeMo-Framework-Launcher conf/training (mcore_gpt: true, transformer_engine: true)",
    },
    Feature {
        what: "gradients accumulated and reduced in bf16 (`grad_sync_dtype: bf16`): a 2-byte gradient buffer and half the data-parallel reduce-scatter volume of Megatron-Core's fp32 default",
        source: "NeMo-Framework-Launcher H100 performance scripts, examples/training/gpt/h100/{5b,175b}_fp8_*.sh and llama/h100/llama3_{8b,70b}_fp8.sh (+training.model.optim.grad_sync_dtype=bf16), conf/training/nemotron/nemotron_340b.yaml (grad_sync_dtype: bf16); NeMo megatron_gpt_model.py, setup_mcore_distributed_parallel (grad_reduce_in_fp32 = grad_sync_dtype == 'fp32', fp32 where unset)",
    },
];

const MEGATRON_CORE_2025: &[Feature] = &[
    Feature {
        what: "fp8 with per-tensor current scaling (Megatron-Bridge's fp8_cs recipes on Hopper): amax and cast passes of their own for every fp8 GEMM operand",
        source: "Megatron-Bridge performance recipes (precision fp8_cs); Transformer Engine 2.x recipe.Float8CurrentScaling",
    },
    Feature {
        what: "everything of megatron-core@2024, plus Megatron-FSDP (ZeRO-3 sharding of parameters, gradients and optimizer states)",
        source: "Megatron-Core 0.11+ release notes (--use-megatron-fsdp); Megatron-Bridge 25.x recipes",
    },
    Feature {
        what: "the distributed optimizer keeps full fp32 gradient buffers (ZeRO-1 in memory; no ZeRO-2 layout)",
        source: "Megatron-LM megatron/training/theoretical_memory_usage.py",
    },
    Feature {
        what: "attention in the chip's own fused kernels on Hopper (cuDNN 9's, which Transformer Engine 2 selects there), a FlashAttention-3-class kernel: the preset's native_attention_speedup over the FlashAttention-2-class kernels of earlier stacks",
        source: "Transformer Engine 2.x docs, attention backends (FusedAttention preferred on sm90); Shah et al. 2024 (FlashAttention-3), 1.5-2.0x FlashAttention-2 forward, 1.5-1.75x backward on H100",
    },
    TE_FP8_SAVED,
];

const MLPERF_31: &[Feature] = &[Feature {
    what: "NeMo on Megatron-Core with Transformer Engine fp8, userbuffer TP overlap, overlapped gradient reduce-scatter and parameter gather",
    source: "MLPerf Training v3.1 NVIDIA GPT-3 submission (NeMo 23.09, configs in its results repository)",
}];

const MEGASCALE: &[Feature] = &[
    Feature {
        what: "tensor-parallel all-gather / reduce-scatter fused with the adjacent GEMMs",
        source: "Jiang et al. 2024 (MegaScale, NSDI), §3.2",
    },
    Feature {
        what: "data-parallel all-gather prefetched and reduce-scatter overlapped; pipeline send/receive decoupled from compute",
        source: "Jiang et al. 2024, §3.2",
    },
    Feature {
        what: "FlashAttention-2 and fused LayerNorm / GeLU kernels",
        source: "Jiang et al. 2024, §3.3",
    },
];

const MEGATRON_DEEPSPEED_2021: &[Feature] = &[
    Feature {
        what: "Megatron tensor parallelism and DeepSpeed's pipeline engine (1F1B train schedule, no interleaving, blocking sends)",
        source: "Smith et al. 2022 (MT-NLG 530B), §2.3; deepspeed/runtime/pipe/schedule.py TrainSchedule",
    },
    Feature {
        what: "data-parallel gradient reduction after the pipeline flush (PipelineEngine._exec_reduce_grads), fp16 gradients; ZeRO-1 beside the pipeline",
        source: "deepspeed/runtime/pipe/engine.py (0.5)",
    },
    Feature {
        what: "no sequence parallelism; unfused attention; full activation checkpointing",
        source: "Megatron-DeepSpeed README (2021)",
    },
    Feature {
        what: "fp16 weight gradients accumulated over micro-batches by autograd in the parameters' .grad",
        source: "deepspeed/runtime/pipe/engine.py (0.5): backward with torch.autograd.backward, gradients reduced at the step boundary",
    },
    Feature {
        what: "pipeline messages under tensor parallelism: activations sent in 1/tp pieces and gathered, input gradients sent whole by every tensor-parallel rank; a stage gathers its own output again before its backward",
        source: "deepspeed/runtime/pipe/engine.py v0.3.0–v0.5.3 (is_grad_partitioned = False; _exec_recv_grads); partitioned from v0.5.4, October 2021 (#1407)",
    },
];

const MEGATRON_DEEPSPEED_2022: &[Feature] = &[
    Feature {
        what: "as megatron-deepspeed@2021, with bf16 and fp32 gradient accumulation and reduction (BF16_Optimizer)",
        source: "BigScience BLOOM training (Le Scao et al. 2022, §3.4); deepspeed/runtime/bf16_optimizer.py",
    },
    Feature {
        what: "ZeRO-1 with pipeline and tensor parallelism; no sequence parallelism or FlashAttention",
        source: "bigscience-workshop/Megatron-DeepSpeed tr11-176B-ml README",
    },
    Feature {
        what: "each micro-batch's bf16 weight gradients cast to fp32 in a copy of their own and added into fp32 gradient buffers by the BF16_Optimizer",
        source: "deepspeed/runtime/bf16_optimizer.py (v0.6.5 update_hp_grads: hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype)); pipe/engine.py calls it after each backward)",
    },
    Feature {
        what: "pipeline messages partitioned over tensor parallelism both ways, gathered on receipt; a stage gathers its own output again before its backward",
        source: "deepspeed/runtime/pipe/engine.py from v0.5.4 (is_grad_partitioned = is_model_parallel; _exec_backward_pass)",
    },
];

const DEEPSPEED_2020: &[Feature] = &[
    Feature {
        what:
            "ZeRO stages 1–2 (3 from 0.3.13) on Megatron-LM v1.1.5's GPT-2: batched-GEMM attention",
        source: "DeepSpeed Megatron tutorial (2020); DeepSpeedExamples Megatron-LM v1.1.5",
    },
    Feature {
        what: "that GPT-2 is Megatron-LM's 2019 module code, eager: the attention scores scaled, masked (a multiply and a subtraction) and soft-maxed as separate kernels, q, k and v permuted into the batched GEMMs' layout and the context back, bias gradients as autograd's reductions",
        source: "DeepSpeedExamples Megatron-LM/mpu/transformer.py (GPT2ParallelSelfAttention, September 2020)",
    },
    Feature {
        what: "fp16 gradients reduced in fp16 after the backward (overlap_comm off by default); ZeRO-2 all-reduces each bucket and keeps its partition (contiguous_gradients off by default), ZeRO-1 reduce-scatters",
        source: "DeepSpeed 0.3 config docs: zero_optimization.overlap_comm; zero/constants.py and stage2.py buffered_reduce_fallback / allreduce_bucket (v0.3.0)",
    },
    Feature {
        what: "the fp16 optimizers' passes: ZeRO-1 checks and norms every gradient of the model one tensor at a time (read back to the host) and copies them twice around its reduce-scatter; ZeRO-2 checks and norms (fp64) its partition's tensors likewise; both cast, unscale, update, cast down and copy the gathered weights out",
        source: "deepspeed/runtime/zero/stage1.py, stage2.py, fp16/fused_optimizer.py, utils.py CheckOverflow and get_grad_norm (v0.3.0)",
    },
    Feature {
        what: "ZeRO-Offload: optimizer states, fp32 master weights and the Adam step (DeepSpeedCPUAdam) on the host, ZeRO 1–2; fp32 gradients copied down on the compute stream as each bucket is reduced; the updated fp32 weights written into two pinned tiles of 2^30 elements that a device kernel reads across PCIe while the CPUs update the next",
        source: "Ren et al. 2021 (ZeRO-Offload, USENIX ATC), §4–5; DeepSpeed ZeRO-Offload tutorial (September 2020); stage2.py copy_grads_in_partition, csrc/adam/cpu_adam.cpp Step_8 and launch_param_update (v0.3.0)",
    },
    Feature {
        what: "with ZeRO-Offload, full recomputation's checkpoints in pageable host memory, copied down synchronously in forward and back before each recomputation (the examples' ZeRO-Offload configs set cpu_checkpointing)",
        source: "DeepSpeedExamples Megatron-LM/scripts/ds_zero-offload_config.json, ds_zero-offload_10B_config.json (ece5e0e0, September 2020); deepspeed/runtime/activation_checkpointing/checkpointing.py (v0.3.0)",
    },
    Feature {
        what: "fp16 weight gradients accumulated over micro-batches by autograd (ZeRO 0-1)",
        source: "deepspeed/runtime/engine.py (0.3): backward via the fp16 optimizer's loss scaling, gradients reduced at the boundary",
    },
    Feature {
        what: "pipeline engine: blocking sends; activations sent in 1/tp pieces and gathered, input gradients sent whole by every tensor-parallel rank",
        source: "deepspeed/runtime/pipe/engine.py and p2p.py (v0.3.0: is_grad_partitioned = False)",
    },
    Feature {
        what: "ZeRO-3 (from 0.3.13) as deepspeed-zero3@2021: submodule gathers that synchronise the device, gradients reduce-scattered a tensor at a time",
        source: "deepspeed/runtime/zero/stage3.py (v0.3.13–v0.5.x)",
    },
];

const DEEPSPEED_ZERO3_2021: &[Feature] = &[
    Feature {
        what: "ZeRO-3: parameters all-gathered per layer before forward and backward, gradients reduce-scattered, over the whole data-parallel world (ring collectives)",
        source: "Rajbhandari et al. 2021 (ZeRO-Infinity, SC21), §5–6; DeepSpeed 0.3.13 stage3.py",
    },
    Feature {
        what: "one all-gather per partitioned submodule weight (its pre-forward / pre-backward hook; norms and biases under stage3_param_persistence_threshold, 1e5 elements, stay whole), and the fetch synchronises the device: no gather overlaps compute",
        source: "deepspeed/runtime/zero/stage3.py _synchronize_communication (v0.3.13–v0.5.x: the gather stream, then torch.cuda.synchronize()); DeepSpeed PR #1188 (June 2021): \"the async version is not async at all, because each all_gather calls torch.cuda.synchronize()\"",
    },
    Feature {
        what: "each gradient tensor reduce-scattered on its own from a list of world-size views built in Python, which PyTorch's list reduce_scatter copies into one buffer a view at a time (host work linear in the data-parallel ranks); the next bucket waits for the previous one's reduction on the host",
        source: "deepspeed/runtime/zero/partition_parameters.py _reduce_scatter_gradient, stage3.py reduce_ipg_grads (v0.5.4); PyTorch ProcessGroupNCCL::reduce_scatter (flatten, one copy_ per input)",
    },
    Feature {
        what: "fp16 gradients reduced in fp16; no FlashAttention (2021)",
        source: "DeepSpeed 0.4 fp16 optimizer",
    },
    Feature {
        what: "ZeRO-Infinity offload: optimizer (offload_optimizer) and parameters (offload_param) in host memory or on NVMe (device \"nvme\"; optimizer states swapped in for the step and out after it, unpipelined: pipeline_read / pipeline_write default off)",
        source: "Rajbhandari et al. 2021 (ZeRO-Infinity, SC21), §5; DeepSpeed config docs, zero_optimization offload options",
    },
];

const DEEPSPEED_2022: &[Feature] = &[
    Feature {
        what: "ZeRO 0–3 as the current stack (pipeline engine with 1F1B only; optimizer and parameter offload; gradients reduced in the training type: ZeRO-3 asserts fp16 or bf16), without context parallelism (DeepSpeed-Ulysses came with 0.10, August 2023), with model code of its time: attention as batched GEMMs around a softmax",
        source: "DeepSpeed 0.6–0.9 docs; DeepSpeed on Azure (2022): PyTorch 1.10.2, DeepSpeed 0.6.2, NCCL 2.12.10; FlashAttention reached PyTorch's SDPA in 2.0 (March 2023) and Megatron-DeepSpeed as --use-flash-attn in 2023",
    },
    Feature {
        what: "ZeRO-3: one all-gather per partitioned submodule weight (norms and biases under stage3_param_persistence_threshold stay whole during the step, and are gathered again after it, one collective per tensor); under full recomputation a weight whose backward lies beyond stage3_max_reuse_distance (default 1e9 elements of other submodules) is released after its recomputed forward and gathered again; gradients bucketed, each large tensor reduce-scattered alone, each tensor sliced into world-size views in Python (reduce_scatter_coalesced)",
        source: "deepspeed/runtime/zero/partitioned_param_coordinator.py, stage3.py __reduce_and_partition_ipg_grads and step (persistent_parameters[0].all_gather), partition_parameters.py _allgather_params_coalesced, runtime/comm/coalesced_collectives.py (v0.6.2)",
    },
    Feature {
        what: "ZeRO-3's collectives do not overlap compute: step time grows with the micro-batch by its compute alone over a constant of the collectives' time",
        source: "DeepSpeed on Azure (docs/_posts/2022-07-26-deepspeed-azure.md, Figures 5–7: 175B at 128–1,024 A100s, micro-batches 1–32); DeepSpeed PR #3622 (May 2023): overlap_comm on and off within 1 % before it",
    },
];

const DEEPSPEED_CURRENT: &[Feature] = &[
    Feature {
        what: "ZeRO 0–3 with overlapped reduction, gradients reduced in the training type; pipeline engine with 1F1B only; full checkpointing; AutoTP without sequence parallelism; optimizer and parameter offload to the host or NVMe",
        source: "DeepSpeed 0.19 docs (config: zero_optimization offload_optimizer / offload_param, pipeline, AutoTP); runtime/engine.py communication_data_type (fp16 or bf16 unless set)",
    },
    Feature {
        what: "ZeRO-3: one all-gather per partitioned submodule weight, prefetched and overlapped; gradients bucketed and each tensor sliced into world-size views in Python before its reduce-scatter",
        source: "deepspeed/runtime/zero/partitioned_param_coordinator.py, runtime/comm/coalesced_collectives.py reduce_scatter_coalesced (v0.19.5); DeepSpeed issue #5047 (2024: ZeRO-3 gathers attention and MLP separately where FSDP gathers a layer)",
    },
    Feature {
        what: "attention as the model implements it (SDPA flash attention in current PyTorch)",
        source: "PyTorch 2.x scaled_dot_product_attention",
    },
    Feature {
        what: "pipeline sends block the stream (dist.send / dist.recv); messages partitioned over tensor parallelism both ways and gathered, the stage's own output gathered again before its backward",
        source: "deepspeed/runtime/pipe/p2p.py and engine.py (v0.19.5: async_op unsupported; pipeline.pipe_partitioned / grad_partitioned default true)",
    },
];

const TORCHTITAN: &[Feature] = &[
    Feature {
        what: "FSDP2, PyTorch SDPA flash attention, no userbuffer TP overlap",
        source: "torchtitan docs and Liang et al. 2024 (torchtitan), §3",
    },
    Feature {
        what: "a compiled run compiles the loss with the model: inductor fuses the upcast cross-entropy into reductions over the 16-bit logits and saves those, not fp32 log-probabilities (without loss_parallel)",
        source: "torchtitan components/loss.py build_cross_entropy_loss (bbb1b616, 2025-04-02: \"reduction of memory and slightly better throughput\")",
    },
    Feature {
        what: "the Llama module code runs eagerly unless compiled (--compile: RMSNorm's fp32 chain, rotary embedding and SwiGLU as pointwise kernels otherwise); float8 and asynchronous-TP runs are compiled",
        source: "torchtitan config_manager.py and train_configs/llama3_8b.toml at 9dec370 (training.compile = false); docs/float8.md (--training.compile \"required for competitive performance\"); benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP 5,762 vs FSDP + torch.compile 6,667 TPS/GPU)",
    },
    Feature {
        what: "float8 linears with tensorwise dynamic (current) scaling: each input and output gradient reduced for its amax, then cast, in passes of their own; TP gathers in float8 (Float8ColwiseParallel)",
        source: "torchao float8 README (Float8LinearConfig, tensorwise recipe); torchtitan float8 docs, parallelize.py (enable_float8_tensorwise_tp)",
    },
    Feature {
        what: "--fp8-recipe rowwise: each operand cast along both axes (two kernels), weights cast every pass after a 16-bit FSDP gather, backward GEMMs rescaled in kernels of their own; TP gathers stay 16-bit",
        source: "torchao torchao/testing/training/roofline_utils.py, float8/float8_ops.py (addmm_float8_unwrapped), pytorch/ao#2184",
    },
    Feature {
        what: "--async-tp: all-gathers fused with the matmuls that read them and matmuls with the reduce-scatter of their output (symmetric memory, copy engines); a block input's gradient reduce-scatter, a sum of matmuls, is not fused",
        source: "torchtitan parallelism.enable_async_tensor_parallel; torch/_inductor/fx_passes/micro_pipeline_tp.py; PyTorch forum 'Introducing Async Tensor Parallelism in PyTorch' (2024)",
    },
    Feature {
        what: "op-level selective activation checkpointing that saves alternate matmul outputs and the reduce-scatters' outputs but not the all-gathers': under sequence parallelism backward gathers each region's input again",
        source: "torchtitan models/llama3/parallelize.py, later distributed/activation_checkpoint.py (_save_list: mm every second, SDPA, reduce_scatter_tensor, max)",
    },
    Feature {
        what: "pipelined models keep FSDP parameters gathered across micro-batches (reshard_after_forward=False); GPipe, 1F1B and interleaved schedules, uneven split points",
        source: "torchtitan parallelize.py, pipeline_parallel.py",
    },
    Feature {
        what: "each pipeline stage (an FSDP root of its own) reduce-scatters its gradients and frees the unsharded ones after its own last backward: a rank's two looped stages with no more micro-batches than pipeline ranks run their backwards one after the other, so one holds whole gradients at a time",
        source: "torchtitan parallelisms/parallelize_llama.py at 9dec370 (fully_shard per stage model); torch/distributed/pipelining/stage.py after pytorch#134052 (set_requires_gradient_sync(False) on every backward, the stage's post-backward reduction on its last one)",
    },
    Feature {
        what: "tensor parallelism by DTensor: the loss runs under loss_parallel on the vocabulary-sharded logits (its backward holds four fp32 copies of them), and under sequence parallelism each column-parallel linear keeps its input as gathered (redistributed to Replicate() before the matmul), not the sequence-split one",
        source: "torchtitan parallelize.py (ColwiseParallel(output_layouts=Shard(-1)) on the output layer, PrepareModuleInput to Replicate()), train.py (loss_parallel_enabled when tp > 1); torch/distributed/tensor/parallel/loss.py (_nll_loss_and_log_softmax_backward)",
    },
    FSDP2_ACCUMULATION,
];

const TORCHTITAN_2024: &[Feature] = &[
    Feature {
        what: "everything of torchtitan, except that a pipelined run given no micro-batch count splits each data-parallel rank's batch into one micro-batch per pipeline rank (`pipeline_parallel_microbatches` defaults to the pipeline degree, for interleaved schedules too), and interleaved schedules hold two stages a rank",
        source: "torchtitan 9dec370 (2024-12-26, the commit of docs/performance.md's runs): torchtitan/parallelisms/pipelining_utils.py (build_pipeline_schedule, generate_split_points); replaced by pipeline_parallel_microbatch_size in 5e2033c (2025-04-07)",
    },
    Feature {
        what: "its PyTorch's pipeline schedules keep every micro-batch's output of the last stage (the logits) until the step ends, for the step's merged return value",
        source: "torchtitan docs/performance.md (torch 1963fc8, 2024-12-23); torch/distributed/pipelining/stage.py of that time (_PipelineStageBase.output_chunks, merged by schedules.py _step_microbatches / merge_chunks); torchtitan train.py at 9dec370 discards the merged value",
    },
    Feature {
        what: "the loss stays eager in a compiled run (PyTorch's cross-entropy on upcast fp32 logits)",
        source: "torchtitan train.py at 9dec370 (\"compiling loss function causes CUDA errors, turning off for now\"); compiled with the model from bbb1b616 (2025-04-02, components/loss.py build_cross_entropy_loss)",
    },
];

const LLAMA3: &[Feature] = &[
    Feature {
        what: "4D parallelism: TP with sequence parallelism, CP, PP with an interleaved schedule and a balanced first/last stage, FSDP",
        source: "Llama 3 Herd of Models (2024), §3.3.2",
    },
    Feature {
        what: "FSDP shards optimizer states and gradients; parameters are not resharded after forward (gathered across micro-batches)",
        source: "Llama 3 Herd of Models, §3.3.2",
    },
    Feature {
        what: "fused attention; overlapped data-parallel reduction; no userbuffer TP overlap stated",
        source: "Llama 3 Herd of Models, §3.3.2–3.3.3",
    },
];

const PYTORCH_FSDP: &[Feature] = &[
    Feature {
        what: "FSDP (1 or 2) ZeRO-3 sharding without tensor or pipeline parallelism",
        source: "PyTorch FSDP docs; Zhao et al. 2023 (PyTorch FSDP, VLDB)",
    },
    Feature {
        what: "CPU offload of parameters, gradients and the optimizer step (CPUOffload(offload_params=True); FSDP2 CPUOffloadPolicy): the step is torch.optim.AdamW on CPU tensors, one kernel per op per tensor (foreach and fused are CUDA defaults), clip_grad_norm_ on the host; the fp32 shard goes up before each forward and backward and is cast on the device",
        source: "PyTorch FSDP docs: torch.distributed.fsdp.CPUOffload, fully_shard(offload_policy=); torch/optim/adamw.py _single_tensor_adamw, _default_to_fused_or_foreach; torch/distributed/fsdp/_flat_param.py _use_low_precision_shard",
    },
    Feature {
        what: "SDPA flash attention (PyTorch ≥ 2.2 ships FlashAttention-2); gradient reduce-scatter overlapped, next all-gather prefetched (BACKWARD_PRE)",
        source: "PyTorch 2.2 release notes; FSDP backward_prefetch docs",
    },
    Feature {
        what: "the model's module code runs eagerly (torch.compile is opt-in): RMSNorm with its fp32 upcast, rotary embedding and SwiGLU as chains of pointwise kernels",
        source: "PyTorch blog 2024-03 'Maximizing training throughput using PyTorch FSDP' (57 % MFU, eager) and its follow-up 'Maximizing training throughput using PyTorch FSDP and torch.compile' (compile: +10–23 % MFU); HF LlamaRMSNorm / apply_rotary_pos_emb",
    },
    Feature {
        what: "--compile runs the module code under torch.compile; torchao's float8 layers are run compiled",
        source: "torchtitan docs/float8.md (torchao float8: --training.compile \"required for competitive performance\")",
    },
    FSDP2_ACCUMULATION,
];

/// DDP under the HuggingFace Trainer.
const HF_DDP: Feature = Feature {
    what: "PyTorch DDP under the HuggingFace Trainer: bucketed all-reduce overlapped with backward (25 MiB buckets)",
    source: "PyTorch DDP docs (bucket_cap_mb); HF 'Efficient training on multiple GPUs' guide",
};
/// HuggingFace's model code keeps the model's vocabulary.
const HF_VOCAB: Feature = Feature {
    what: "the model's own vocabulary, unpadded: GPT-2's 50,257-wide head runs on misaligned 16-bit GEMM kernels (where the chip's misaligned rate is measured)",
    source: "transformers GPT2LMHeadModel (vocab_size 50257); profiled on an H200 (HF GPT-2 bf16, 2026-11-26): align1 kernels, 30 of 110 ms a step",
};

/// The HuggingFace Trainer's mixed precision.
const HF_AUTOCAST: Feature = Feature {
    what: "16-bit training under torch.autocast over fp32 weights: the residual stream, LayerNorm / RMSNorm and softmax in fp32, each weight cast to a 16-bit copy every forward and kept for backward",
    source: "transformers TrainingArguments (bf16 / fp16: mixed precision through accelerate's torch.autocast); PyTorch's autocast op reference (the fp32 list: layer_norm, softmax, pow, …); measured on one H200 (transformers 5.17, 2026-11-29): with autocast a Llama-like 1B model kept 6.7 GiB more than cast to bf16, GPT-2 4.2 GiB",
};

const HF_TRAINER_DDP: &[Feature] = &[
    HF_DDP,
    HF_AUTOCAST,
    Feature {
        what: "eager attention (the models' own matmul + softmax): GPT-2's until 4.42",
        source:
            "transformers 4.x GPT2Attention; transformers#31172 (GPT-2's SDPA attention, v4.42.0)",
    },
    HF_VOCAB,
    EAGER_KERNELS,
    AUTOGRAD_ACCUMULATION,
];

const HF_TRAINER_SDPA: &[Feature] = &[
    HF_DDP,
    HF_AUTOCAST,
    Feature {
        what: "attention through PyTorch's scaled_dot_product_attention by default (FlashAttention-2 kernels from PyTorch 2.2): GPT-2 from 4.42, Llama-family models from 4.36",
        source: "transformers#31172 (GPT-2 SDPA, v4.42.0); transformers docs perf_infer_gpu_one ('SDPA is used by default for PyTorch v2.1.1. and greater'); measured on one H200 (transformers 5.17, PyTorch 2.11, GPT-2 in bf16 autocast, 16 × 1024 tokens, 2026-11-29): 110 ms and 23.6 GiB a step with sdpa, 172 ms and 38.8 GiB with attn_implementation=eager",
    },
    HF_VOCAB,
    EAGER_KERNELS,
    AUTOGRAD_ACCUMULATION,
];

/// Megatron-LM's asynchronous backward communication of its column-parallel layers.
const ASYNC_COLUMN_BACKWARD: Feature = Feature {
    what: "column-parallel layers' backward communication under their GEMMs: the input gradient's all-reduce under the weight-gradient GEMM; with sequence parallelism the input's re-gather under the input-gradient GEMM and the gradient's reduce-scatter under the weight-gradient GEMM",
    source: "Megatron-LM September 2021 (commits 16c9044, f3e57f6): --async-tensor-model-parallel-allreduce, on by default; LinearWithGradAccumulationAndAsyncCommunication in megatron/mpu/layers.py (May 2022)",
};
/// Weight gradients summed over micro-batches by PyTorch's autograd.
const AUTOGRAD_ACCUMULATION: Feature = Feature {
    what: "weight gradients accumulated over micro-batches by autograd in the parameters' .grad (DDP's no_sync)",
    source: "torch.nn.parallel.DistributedDataParallel docs (no_sync); PyTorch autograd AccumulateGrad",
};
/// FSDP2's fp32 accumulation of unsynchronised micro-batches.
const FSDP2_ACCUMULATION: Feature = Feature {
    what: "micro-batches without gradient sync (a pipelined stage's) add each bf16 weight gradient into an fp32 unsharded one",
    source: "torch/distributed/_composable/fsdp/_fsdp_param.py (accumulate_unsharded_grad_if_needed, reduce_dtype fp32)",
};
/// What eager PyTorch module code launches beyond a fused stack's kernels.
const EAGER_KERNELS: Feature = Feature {
    what: "eager module code: q, k, v and the attention context copied between the token and head layouts (four copies each way), bias gradients as separate reductions, LayerNorm weight gradients as their own pass",
    source: "transformers BertSelfAttention.transpose_for_scores / GPT2Attention._split_heads; DeepLearningExamples BERT modeling.py; PyTorch autograd (linear bias: grad.sum); profiled on an H100 (HF BERT-large fp16, 2026-11-26)",
};

const PYTORCH_DATAPARALLEL: &[Feature] = &[
    Feature {
        what: "one process drives every GPU from Python threads: each forward broadcasts the parameters from GPU 0 (replicate), scatters the inputs and gathers the outputs (an LM's logits) onto GPU 0",
        source: "PyTorch 1.8 torch/nn/parallel/data_parallel.py, replicate.py; HF 'Efficient training on multiple GPUs', DP vs DDP",
    },
    Feature {
        what: "each backward reduces the replicas' gradients onto GPU 0 once all are complete (ReduceAddCoalesced, the broadcast's backward); nothing overlaps computation",
        source: "PyTorch 1.8 torch/nn/parallel/_functions.py",
    },
    Feature {
        what: "one node, data parallelism only: no tensor or pipeline parallelism, no ZeRO",
        source: "PyTorch DataParallel docs",
    },
    EAGER_KERNELS,
];

const PYTORCH_DDP: &[Feature] = &[
    Feature {
        what: "PyTorch 1.x DDP (NGC 20.x–21.x): bucketed all-reduce overlapped with backward; eager attention (no SDPA before PyTorch 2.0)",
        source: "PyTorch DDP docs; PyTorch 2.0 release notes (SDPA)",
    },
    EAGER_KERNELS,
    AUTOGRAD_ACCUMULATION,
];

const APEX_DDP: &[Feature] = &[
    Feature {
        what: "apex DistributedDataParallel: all-reduce overlapped with backward; eager attention",
        source: "NVIDIA apex.parallel docs",
    },
    EAGER_KERNELS,
    AUTOGRAD_ACCUMULATION,
];

const TF_CNN_BENCHMARKS: &[Feature] = &[Feature {
    what: "TensorFlow 1.x tf_cnn_benchmarks: replicated variables with NCCL all-reduce, or parameter servers (its variable_update flag)",
    source: "tensorflow/benchmarks scripts/tf_cnn_benchmarks README",
}];

const TORCHGPIPE: &[Feature] = &[Feature {
    what: "GPipe schedule on one process (micro-batches through stages on CUDA streams), no data parallelism",
    source: "Kim et al. 2020 (torchgpipe)",
}];

const PARALLAX: &[Feature] = &[Feature {
    what: "parallax's own executor (`parallax run`): unfused fp32 attention, gradient reduction and TP collectives after the computation that produces them (not overlapped), non-blocking sends",
    source: "this repository, executor/",
}];

const CURRENT: &[Feature] = &[
    Feature {
        what: "a current stack: fused attention, overlapped gradient reduction and parameter gathers, TP communication overlap, overlapped sends, every schedule, ZeRO stage and recompute policy, optimizer and parameter offload (host memory, then NVMe) when nothing fits",
        source: "the union of the current Megatron-Core, DeepSpeed and torchtitan releases",
    },
    TE_FP8_SAVED,
];

fn megatron_2020() -> Parts {
    // Its apex-derived FP16_Optimizer checks and norms gradients one tensor at a time as
    // DeepSpeed 0.3 does ([`OptimizerPasses::DeepSpeed03`]); priced so, its README's A100 runs
    // come out 3–7 % slow (the fit's V100 runs improve), so the stack keeps the fused step.
    Parts {
        runtime: Runtime {
            master_grads_fp32: true,
            wgrad_accumulation: WgradAccumulation::Autograd,
            ..megatron_loss(pre_flash(false, false))
        },
        space: megatron_space(&ONE_F_ONE_B, &[0], &NO_OR_FULL, false),
    }
}

fn megatron_2021() -> Parts {
    Parts {
        runtime: Runtime {
            wgrad_accumulation: WgradAccumulation::Autograd,
            ..megatron_loss(pre_flash(false, false))
        },
        space: megatron_space(&MEGATRON_SCHEDULES, &[0], &NO_OR_FULL, false),
    }
}

fn megatron_2022() -> Parts {
    Parts {
        runtime: Runtime {
            tp_overlap: TpOverlap::AsyncBackward,
            ..megatron_loss(pre_flash(false, true))
        },
        space: megatron_space(&MEGATRON_SCHEDULES, &[0], &Recompute::ALL, true),
    }
}

fn megatron_2023() -> Parts {
    Parts {
        runtime: Runtime {
            // The flash-attn package's FlashAttention-2.
            fused_attention: true,
            fp8_recipe: Fp8Recipe::Delayed,
            te_linears: true,
            tp_overlap: TpOverlap::AsyncBackward,
            ..megatron_loss(pre_flash(false, true))
        },
        space: Space {
            fp8_recipes: TE1_RECIPES.to_vec(),
            ..megatron_space(&MEGATRON_SCHEDULES, &[0, 1], &Recompute::ALL, true)
        },
    }
}

fn megatron_core_2024() -> Parts {
    Parts {
        runtime: Runtime {
            fp8_recipe: Fp8Recipe::Delayed,
            te_linears: true,
            ..megatron_loss(Runtime::default())
        },
        space: Space {
            fp8_recipes: TE1_RECIPES.to_vec(),
            context_parallel: true,
            ..megatron_space(&MEGATRON_SCHEDULES, &[0, 1], &Recompute::ALL, true)
        },
    }
}

/// NeMo 24.07 as its launcher's performance recipes run it: Megatron-Core 2024 with gradients
/// kept and reduced in bf16.
fn nemo_2407() -> Parts {
    let Parts { runtime, space } = megatron_core_2024();
    Parts {
        runtime: Runtime {
            grad_reduce_fp32: false,
            ..runtime
        },
        space,
    }
}

/// A row that is an engine's current release: what `--export` to it plans with.
fn engine(e: Engine) -> Parts {
    Parts {
        runtime: e.runtime(),
        space: e.space(),
    }
}

fn torchtitan_2024() -> Parts {
    let Parts { runtime, space } = engine(Engine::Torchtitan);
    Parts {
        // Its loss stayed eager ("compiling loss function causes CUDA errors, turning off for
        // now", torchtitan/components/loss.py before bbb1b616).
        runtime: Runtime {
            compiles_loss: false,
            pipeline_keeps_outputs: true,
            ..runtime
        },
        space: Space {
            pipeline_defaults: Some(PipelineDefaults {
                microbatches_per_rank: 1,
                looped_stages_per_rank: 2,
            }),
            ..space
        },
    }
}

/// Megatron-DeepSpeed with its gradients reduced in fp32 (`grad_reduce_fp32`: the
/// BF16_Optimizer) or in fp16, on a DeepSpeed whose pipeline engine sends `pipe_messages` and
/// whose ZeRO-3 (its runs without a pipeline) is `zero3`.
fn megatron_deepspeed(
    grad_reduce_fp32: bool,
    pipe_messages: PipeMessages,
    zero3: Zero3Engine,
) -> Parts {
    Parts {
        runtime: Runtime {
            // DeepSpeed's fp16 engine accumulates in the parameters' `.grad`; its BF16_Optimizer
            // casts each micro-batch's bf16 gradients to fp32 and adds them into fp32 buffers.
            wgrad_accumulation: if grad_reduce_fp32 {
                WgradAccumulation::HookCast
            } else {
                WgradAccumulation::Autograd
            },
            pipe_sends: PipeSends::Separate,
            pipe_messages,
            zero3,
            ..megatron_loss(pre_flash(false, grad_reduce_fp32))
        },
        space: Space {
            sequence_parallel: false,
            // DeepSpeed's ZeRO-Offload (`--cpu-optimizer` and `offload_optimizer`), for the
            // runs without a pipeline that use ZeRO-2/3.
            offload: vec![Offload::Optimizer],
            ..space(&ONE_F_ONE_B, &[0, 1], &NO_OR_FULL)
        },
    }
}

fn deepspeed_2020() -> Parts {
    Parts {
        runtime: Runtime {
            zero3: Zero3Engine::DeepSpeed2021,
            eager_kernels: true,
            wgrad_accumulation: WgradAccumulation::Autograd,
            optimizer_passes: OptimizerPasses::DeepSpeed03,
            host_optimizer: HostOptimizer::DeepSpeedCpuAdam03,
            checkpoints_to_host_when_offloaded: true,
            pipe_sends: PipeSends::Separate,
            pipe_messages: PipeMessages::DeepSpeedWholeGrads,
            ..megatron_loss(pre_flash(false, false))
        },
        // ZeRO-Offload shipped in DeepSpeed 0.3 (September 2020): optimizer states only.
        space: Space {
            offload: vec![Offload::Optimizer],
            ..megatron_space(&ONE_F_ONE_B, &[0, 1, 2, 3], &NO_OR_FULL, false)
        },
    }
}

fn deepspeed_2022() -> Parts {
    let Parts { runtime, space } = engine(Engine::DeepSpeed);
    Parts {
        runtime: Runtime {
            zero3: Zero3Engine::DeepSpeed2022,
            // Before PyTorch 2.0's SDPA (March 2023) and Megatron-DeepSpeed's
            // --use-flash-attn (2023), model code ran attention as batched GEMMs around a softmax.
            fused_attention: false,
            ..runtime
        },
        // DeepSpeed-Ulysses, its sequence (context) parallelism, came with 0.10 (August 2023).
        space: Space {
            context_parallel: false,
            ..space
        },
    }
}

fn deepspeed_zero3_2021() -> Parts {
    Parts {
        runtime: Runtime {
            zero3: Zero3Engine::DeepSpeed2021,
            ..megatron_loss(pre_flash(true, false))
        },
        // ZeRO-Infinity (DeepSpeed 0.3.15, April 2021): optimizer and parameters to the host
        // or NVMe.
        space: Space {
            offload: Offload::ALL[1..].to_vec(),
            ..data_parallel_only(space(&NO_PIPELINE, &[3], &NO_OR_FULL))
        },
    }
}

fn llama3() -> Parts {
    Parts {
        runtime: Runtime {
            tp_overlap: TpOverlap::None,
            zero3_gathered_under_pp: true,
            ..Runtime::default()
        },
        // Llama 3 405B's long-context stage ran context parallelism (§3.3.2).
        space: Space {
            context_parallel: true,
            ..space(&MEGATRON_SCHEDULES, &[1, 2, 3], &Recompute::ALL)
        },
    }
}

fn pytorch_fsdp() -> Parts {
    Parts {
        runtime: Runtime {
            tp_overlap: TpOverlap::None,
            // The model's own module code, uncompiled: `torch.compile` is opt-in; torchao's
            // float8 layers are run compiled.
            eager_kernels: true,
            compiles_fp8: true,
            wgrad_accumulation: WgradAccumulation::Hook,
            host_optimizer: HostOptimizer::TorchSingleTensor,
            ..Runtime::default()
        },
        // `CPUOffload(offload_params=True)` moves parameters, gradients and the optimizer step
        // to the host together; the step is `torch.optim.AdamW` on CPU tensors.
        space: data_parallel_only(Space {
            schedules: NO_PIPELINE.to_vec(),
            offload: vec![Offload::Params],
            // torchao's float8 linear layers; no tensor parallelism to make asynchronous.
            fp8_recipes: vec![Fp8Recipe::Tensorwise, Fp8Recipe::Rowwise],
            async_tp: false,
            ..Space::default()
        }),
    }
}

/// `torch.nn.DataParallel`: one process, replicas on the GPUs of one node, nothing else.
fn pytorch_dataparallel() -> Parts {
    Parts {
        runtime: Runtime {
            single_process_dp: true,
            eager_kernels: true,
            ..pre_flash(false, true)
        },
        space: data_parallel_only(space(&NO_PIPELINE, &[0], &NO_OR_FULL)),
    }
}

/// The space of PyTorch 1.x stacks without a pipeline engine or ZeRO (DDP, apex DDP, the HF
/// Trainer on them, torchgpipe's single-process GPipe).
fn pytorch_1x_space() -> Space {
    Space {
        offload: Vec::new(),
        sequence_parallel: false,
        ..space(&[Schedule::GPipe], &[0], &Recompute::ALL)
    }
}

/// PyTorch 1.x data parallelism (DDP, apex DDP, the HF Trainer on them): eager attention,
/// overlapped bucketed all-reduce.
fn pytorch_ddp() -> Parts {
    Parts {
        runtime: Runtime {
            eager_kernels: true,
            wgrad_accumulation: WgradAccumulation::Autograd,
            ..pre_flash(true, true)
        },
        space: pytorch_1x_space(),
    }
}

/// The HuggingFace Trainer's DDP: [`pytorch_ddp`], its 16-bit precision under
/// `torch.autocast`.
fn hf_trainer() -> Parts {
    let mut parts = pytorch_ddp();
    parts.runtime.autocast = true;
    parts
}

/// The HuggingFace Trainer from transformers 4.42: [`hf_trainer`] with the models' attention
/// through PyTorch's fused `scaled_dot_product_attention`.
fn hf_trainer_sdpa() -> Parts {
    let mut parts = hf_trainer();
    parts.runtime.fused_attention = true;
    parts
}

fn single_process_pipeline() -> Parts {
    Parts {
        runtime: pre_flash(false, true),
        space: pytorch_1x_space(),
    }
}

fn parallax_executor() -> Parts {
    Parts {
        runtime: Runtime {
            fused_attention: false,
            overlap_grad_reduce: false,
            tp_overlap: TpOverlap::None,
            // Its expert exchange sizes are host values already: no device to wait for.
            moe_host_sync: false,
            ..Runtime::default()
        },
        // The executor keeps every state on its devices, and trains in fp32 and 16 bits.
        space: Space {
            offload: Vec::new(),
            fp8_recipes: Vec::new(),
            async_tp: false,
            ..Space::default()
        },
    }
}

fn current() -> Parts {
    Parts {
        runtime: Runtime {
            native_attention: true,
            // As Megatron-Core pads it (torchtitan's and Llama's vocabularies are aligned).
            vocab_multiple: MEGATRON_VOCAB_MULTIPLE,
            // Transformer Engine's layers (its userbuffers overlap TP communication).
            te_linears: true,
            ..Runtime::default()
        },
        space: Space::default(),
    }
}

/// The table of stacks, in the order `parallax frameworks` lists them.
pub const STACKS: &[Stack] = &[
    Stack {
        name: "current",
        covers: "current (the default)",
        names: &["current"],
        features: CURRENT,
        matches: |n, _| n == "current",
        build: current,
    },
    Stack {
        name: "megatron-lm@2020",
        covers: "megatron-lm@2019, @2020, @v1.x",
        names: &["megatron-lm"],
        features: MEGATRON_2020,
        matches: |n, v| n == "megatron-lm" && (v.year.is_some_and(|y| y <= 2020) || v.semver_in((1, 0), (1, 99))),
        build: megatron_2020,
    },
    Stack {
        name: "megatron-lm@2021",
        covers: "megatron-lm@2021, @v2.x",
        names: &["megatron-lm"],
        features: MEGATRON_2021,
        matches: |n, v| n == "megatron-lm" && (v.year_in(2021, 2021) || v.semver_in((2, 0), (2, 99))),
        build: megatron_2021,
    },
    Stack {
        name: "megatron-lm@2022",
        covers: "megatron-lm@2022, @v3.x",
        names: &["megatron-lm"],
        features: MEGATRON_2022,
        matches: |n, v| n == "megatron-lm" && (v.year_in(2022, 2022) || v.semver_in((3, 0), (3, 99))),
        build: megatron_2022,
    },
    Stack {
        name: "megatron-lm@2023",
        covers: "megatron-lm@2023 (23.xx), megatron-core@0.1–0.3, nemo@23.xx",
        names: &["megatron-lm", "megatron-core", "nemo"],
        features: MEGATRON_2023,
        matches: |n, v| match n {
            "megatron-lm" => v.year_in(2023, 2023),
            "megatron-core" => v.year_in(2023, 2023) || v.semver_in((0, 1), (0, 3)),
            "nemo" => v.year_in(2023, 2023) || v.semver_in((1, 0), (1, 99)),
            _ => false,
        },
        build: megatron_2023,
    },
    Stack {
        name: "megatron-core@2024",
        covers: "megatron-core@2024, @0.4–0.10, megatron-lm@2024",
        names: &["megatron-core", "megatron-lm"],
        features: MEGATRON_CORE_2024,
        matches: |n, v| match n {
            "megatron-core" => v.year_in(2024, 2024) || v.semver_in((0, 4), (0, 10)),
            "megatron-lm" => v.year_in(2024, 2024),
            _ => false,
        },
        build: megatron_core_2024,
    },
    Stack {
        name: "nemo@24.07",
        covers: "nemo@24.xx (the NeMo Framework Launcher's recipes)",
        names: &["nemo"],
        features: NEMO_2407,
        matches: |n, v| n == "nemo" && v.year_in(2024, 2024),
        build: nemo_2407,
    },
    Stack {
        name: "megatron-core@2025",
        covers: "megatron-core@2025+, @0.11+, megatron-lm@2025+, megatron-bridge (any), nemo@25.xx+ / 2.x; what --export megatron writes for",
        names: &["megatron-bridge", "megatron-core", "megatron-lm", "megatron", "nemo"],
        features: MEGATRON_CORE_2025,
        matches: |n, v| match n {
            "megatron-bridge" => true,
            "megatron-core" => v.none() || v.year.is_some_and(|y| y >= 2025) || v.semver_in((0, 11), (99, 0)),
            "megatron-lm" | "megatron" => v.none() || v.year.is_some_and(|y| y >= 2025),
            "nemo" => v.none() || v.year.is_some_and(|y| y >= 2025) || v.semver_in((2, 0), (9, 99)),
            _ => false,
        },
        build: || engine(Engine::Megatron),
    },
    Stack {
        name: "nvidia-mlperf@3.1",
        covers: "nvidia-mlperf@3.x–5.x (NVIDIA's GPT-3 / Llama submissions)",
        names: &["nvidia-mlperf"],
        features: MLPERF_31,
        matches: |n, _| n == "nvidia-mlperf",
        build: megatron_core_2024,
    },
    Stack {
        name: "megascale@2024",
        covers: "megascale@2024",
        names: &["megascale"],
        features: MEGASCALE,
        matches: |n, _| n == "megascale",
        // Megatron-Core's runtime and options; its parallel block and sliding-window attention
        // are model changes the case's dimensions carry.
        build: megatron_core_2024,
    },
    Stack {
        name: "megatron-deepspeed@2021",
        covers: "megatron-deepspeed@2021 and earlier",
        names: &["megatron-deepspeed"],
        features: MEGATRON_DEEPSPEED_2021,
        matches: |n, v| n == "megatron-deepspeed" && v.year.is_some_and(|y| y <= 2021),
        // DeepSpeed before 0.5.4 (October 2021) sent input gradients whole.
        build: || megatron_deepspeed(
            false,
            PipeMessages::DeepSpeedWholeGrads,
            Zero3Engine::DeepSpeed2021,
        ),
    },
    Stack {
        name: "megatron-deepspeed@2022",
        covers: "megatron-deepspeed@2022 and later",
        names: &["megatron-deepspeed"],
        features: MEGATRON_DEEPSPEED_2022,
        matches: |n, v| n == "megatron-deepspeed" && v.year.is_none_or(|y| y > 2021),
        build: || megatron_deepspeed(
            true,
            PipeMessages::DeepSpeedPartitioned,
            Zero3Engine::DeepSpeed2022,
        ),
    },
    Stack {
        name: "deepspeed@0.3",
        covers: "deepspeed@0.1–0.5 (with Megatron-LM v1's GPT-2)",
        names: &["deepspeed"],
        features: DEEPSPEED_2020,
        matches: |n, v| n == "deepspeed" && (v.semver_in((0, 0), (0, 5)) || v.year.is_some_and(|y| y <= 2020)),
        build: deepspeed_2020,
    },
    Stack {
        name: "deepspeed-zero3@2021",
        covers: "deepspeed-zero3@2021, deepspeed@2021",
        names: &["deepspeed-zero3", "deepspeed"],
        features: DEEPSPEED_ZERO3_2021,
        matches: |n, v| n == "deepspeed-zero3" || (n == "deepspeed" && v.year_in(2021, 2021)),
        build: deepspeed_zero3_2021,
    },
    Stack {
        name: "deepspeed@0.6",
        covers: "deepspeed@0.6–0.9 / 2022–2023",
        names: &["deepspeed"],
        features: DEEPSPEED_2022,
        matches: |n, v| n == "deepspeed" && (v.semver_in((0, 6), (0, 9)) || v.year_in(2022, 2023)),
        build: deepspeed_2022,
    },
    Stack {
        name: "deepspeed@0.19",
        covers: "deepspeed@0.10+ / 2024+; what --export deepspeed writes for",
        names: &["deepspeed"],
        features: DEEPSPEED_CURRENT,
        matches: |n, v| n == "deepspeed" && (v.none() || v.semver_in((0, 10), (99, 0)) || v.year.is_some_and(|y| y >= 2024)),
        build: || engine(Engine::DeepSpeed),
    },
    Stack {
        name: "torchtitan@2024",
        covers: "torchtitan@2024 to torchtitan@2025-03 (before April 2025)",
        names: &["torchtitan"],
        features: TORCHTITAN_2024,
        matches: |n, v| n == "torchtitan" && v.up_to(2025, 3),
        build: torchtitan_2024,
    },
    Stack {
        name: "torchtitan",
        covers: "torchtitan (2025 on, or no version); what --export torchtitan writes for",
        names: &["torchtitan"],
        features: TORCHTITAN,
        matches: |n, _| n == "torchtitan",
        build: || engine(Engine::Torchtitan),
    },
    Stack {
        name: "meta-llama3@2024",
        covers: "meta-llama3@2024",
        names: &["meta-llama3"],
        features: LLAMA3,
        matches: |n, _| n == "meta-llama3",
        build: llama3,
    },
    Stack {
        name: "pytorch-fsdp@2.x",
        covers: "pytorch-fsdp@2.x; llm-foundry and composer (MosaicML's trainer on PyTorch FSDP)",
        names: &["pytorch-fsdp", "llm-foundry", "composer"],
        features: PYTORCH_FSDP,
        matches: |n, _| matches!(n, "pytorch-fsdp" | "llm-foundry" | "composer"),
        build: pytorch_fsdp,
    },
    Stack {
        name: "hf-trainer-ddp@4.x",
        covers: "hf-trainer-ddp@4.0 to @4.41, hf-trainer likewise",
        names: &["hf-trainer-ddp", "hf-trainer"],
        features: HF_TRAINER_DDP,
        matches: |n, v| {
            matches!(n, "hf-trainer-ddp" | "hf-trainer") && v.semver_in((0, 0), (4, 41))
        },
        build: hf_trainer,
    },
    Stack {
        name: "hf-trainer-ddp@4.42",
        covers: "hf-trainer-ddp@4.42 on (5.x too) or no version, hf-trainer likewise",
        names: &["hf-trainer-ddp", "hf-trainer"],
        features: HF_TRAINER_SDPA,
        matches: |n, _| matches!(n, "hf-trainer-ddp" | "hf-trainer"),
        build: hf_trainer_sdpa,
    },
    Stack {
        name: "pytorch-dataparallel@1.8",
        covers: "pytorch-dataparallel (torch.nn.DataParallel, any version)",
        names: &["pytorch-dataparallel"],
        features: PYTORCH_DATAPARALLEL,
        matches: |n, _| n == "pytorch-dataparallel",
        build: pytorch_dataparallel,
    },
    Stack {
        name: "pytorch-ddp@1.x",
        covers: "pytorch-ddp (PyTorch 1.x, NGC 20.x–21.x)",
        names: &["pytorch-ddp"],
        features: PYTORCH_DDP,
        matches: |n, _| n == "pytorch-ddp",
        build: pytorch_ddp,
    },
    Stack {
        name: "pytorch-apex-ddp",
        covers: "pytorch-apex-ddp",
        names: &["pytorch-apex-ddp"],
        features: APEX_DDP,
        matches: |n, _| n == "pytorch-apex-ddp",
        build: pytorch_ddp,
    },
    Stack {
        name: "tensorflow-1.x/tf_cnn_benchmarks",
        covers: "tensorflow-1.x/tf_cnn_benchmarks",
        names: &["tensorflow-1.x/tf_cnn_benchmarks"],
        features: TF_CNN_BENCHMARKS,
        matches: |n, _| n == "tensorflow-1.x/tf_cnn_benchmarks",
        build: pytorch_ddp,
    },
    Stack {
        name: "torchgpipe",
        covers: "torchgpipe",
        names: &["torchgpipe"],
        features: TORCHGPIPE,
        matches: |n, _| n == "torchgpipe",
        build: single_process_pipeline,
    },
    Stack {
        name: "parallax",
        covers: "parallax (what `parallax run` executes)",
        names: &["parallax"],
        features: PARALLAX,
        matches: |n, _| n == "parallax",
        build: parallax_executor,
    },
];

/// The first word of a stack spec (`name@version`, then free wording), lower-cased.
fn spec_word(spec: &str) -> String {
    spec.split_whitespace()
        .next()
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// A spec word's stack name and version text. Megatron-LM tags its Megatron-Core releases
/// `core_r0.5.0`, `core_v0.8.0`: those name Megatron-Core's versions.
fn name_and_version(word: &str) -> (&str, &str) {
    match word.split_once('@').unwrap_or((word, "")) {
        ("megatron-lm", version) if version.starts_with("core_") => ("megatron-core", version),
        split => split,
    }
}

impl Framework {
    /// A current stack: fused attention, overlapped gradient reduction, every option. The
    /// default of `plan` and `simulate`.
    pub fn current() -> Framework {
        Framework::parse("current").expect("the table has a current stack")
    }

    /// The stack an export to `engine` runs on: its current release.
    pub fn for_engine(engine: Engine) -> Framework {
        let name = match engine {
            Engine::Megatron => "megatron-core",
            Engine::DeepSpeed => "deepspeed",
            Engine::Torchtitan => "torchtitan",
        };
        Framework::parse(name).expect("the table has every engine's stack")
    }

    /// The row of `spec`: `name@version`, optionally followed by free wording (`deepspeed@0.3
    /// (megatron-lm v1.1.5 gpt2 example)`); names are case-insensitive.
    pub fn parse(spec: &str) -> Result<Framework, FrameworkError> {
        let word = spec_word(spec);
        let (name, version) = name_and_version(&word);
        let v = Version::parse(version);
        let names = || {
            let mut all: Vec<&str> = Vec::new();
            for n in STACKS.iter().flat_map(|s| s.names) {
                if !all.contains(n) {
                    all.push(n);
                }
            }
            all.join(", ")
        };
        // What the user wrote, cut short for the one line that echoes it.
        let shown: String = spec.trim().chars().take(80).collect();
        let Some(row) = STACKS.iter().find(|s| (s.matches)(name, &v)) else {
            let rows: Vec<&str> = STACKS
                .iter()
                .filter(|s| s.names.contains(&name))
                .map(|s| s.covers)
                .collect();
            return Err(if rows.is_empty() {
                FrameworkError::Unknown(shown, names())
            } else {
                FrameworkError::Version(
                    shown,
                    format!(
                        "no row of the table covers this version ({})",
                        rows.join("; ")
                    ),
                )
            });
        };
        if !version.is_empty() && v.none() {
            return Err(FrameworkError::Version(
                shown,
                "cannot read the version (a year like 2022, a release like 24.07, or a version like 0.3)".into(),
            ));
        }
        let label = if word == row.name
            || (version.is_empty() && row.name.split('@').next() == Some(name))
        {
            row.name.to_string()
        } else {
            format!("{word} (as {})", row.name)
        };
        Ok(Framework::of_row(row, label))
    }

    /// The stack `row` builds, named `name`.
    fn of_row(row: &Stack, name: String) -> Framework {
        let parts = (row.build)();
        Framework {
            name,
            runtime: parts.runtime,
            space: parts.space,
        }
    }

    /// The stack with the fp8 recipe (`--fp8-recipe`) and the asynchronous tensor parallelism
    /// (`--async-tp`) the user chose, where the stack offers them: a refusal names what it
    /// offers instead.
    pub fn with_options(
        mut self,
        fp8_recipe: Option<Fp8Recipe>,
        async_tp: bool,
    ) -> Result<Framework, FrameworkError> {
        if let Some(r) = fp8_recipe {
            if !self.space.fp8_recipes.contains(&r) {
                let offered = match self.space.fp8_recipes.as_slice() {
                    [] => "none: it has no fp8 training".to_string(),
                    o => o.iter().map(|r| r.name()).collect::<Vec<_>>().join(", "),
                };
                return Err(FrameworkError::Option(format!(
                    "--fp8-recipe {r}: {} does not run it (its recipes: {offered})",
                    self.name
                )));
            }
            self.runtime.fp8_recipe = r;
            self.name = format!("{}, fp8 {r}", self.name);
        }
        if async_tp {
            if !self.space.async_tp {
                return Err(FrameworkError::Option(format!(
                    "--async-tp: {} has no asynchronous tensor parallelism (PyTorch's, in torchtitan and the current stack)",
                    self.name
                )));
            }
            self.runtime.tp_overlap = TpOverlap::MicroPipelined;
            self.name = format!("{}, async TP", self.name);
        }
        Ok(self)
    }

    /// The stack with its module code compiled (`--compile`) where the user asked for it: a
    /// stack whose code is eager by default (torchtitan, FSDP, the HuggingFace Trainer) runs
    /// it under `torch.compile`; one that runs fused kernels already refuses the flag.
    pub fn with_compile(mut self, compile: bool) -> Result<Framework, FrameworkError> {
        if compile {
            if !self.runtime.eager_kernels {
                return Err(FrameworkError::Option(format!(
                    "--compile: {} runs fused kernels already (its module code is not eager PyTorch)",
                    self.name
                )));
            }
            self.runtime.compiled = true;
            self.name = format!("{}, compiled", self.name);
        }
        Ok(self)
    }

    /// This DeepSpeed stack as a run's `ds_config.json` sets it up (`--ds-config`, read by
    /// [`DsConfig::parse`]; `origin` names the file): its gradient-reduction overlap and type
    /// and ZeRO's sizes. The layout knobs and the batch the file fixes are the caller's
    /// ([`DsConfig::fixes`]). A stack other than DeepSpeed's reads no `ds_config`.
    pub fn with_ds_config(
        mut self,
        c: &DsConfig,
        origin: &str,
    ) -> Result<Framework, FrameworkError> {
        // A stack whose ZeRO is DeepSpeed's runs DeepSpeed's engine, which reads the file.
        if !self.runtime.zero3.submodule_hooks() {
            return Err(FrameworkError::Option(format!(
                "{} reads no DeepSpeed config (DeepSpeed's stacks do: deepspeed, deepspeed@0.6, deepspeed-zero3@2021, megatron-deepspeed@2022, …)",
                Framework::stack_name(&self.name)
            )));
        }
        let r = &mut self.runtime;
        if let Some(overlap) = c.overlap_comm {
            r.overlap_grad_reduce = overlap;
        }
        if let Some(fp32) = c.reduce_fp32 {
            r.grad_reduce_fp32 = fp32;
        }
        if let Some(host) = c.cpu_checkpointing {
            r.checkpoints_to_host_when_offloaded = host;
        }
        r.zero_config = c.zero_config(r.zero_config);
        self.name = format!("{}{DS_CONFIG}{origin}", self.name);
        Ok(self)
    }

    /// The stack a decorated name names: `name` without the run options [`with_options`],
    /// [`with_compile`] and [`with_ds_config`] append to it (", fp8 RECIPE", ", async TP",
    /// ", compiled", ", ds_config FILE"), each of which a plan document records as a
    /// training setting of its own or a report names.
    ///
    /// [`with_options`]: Framework::with_options
    /// [`with_compile`]: Framework::with_compile
    /// [`with_ds_config`]: Framework::with_ds_config
    pub fn stack_name(name: &str) -> &str {
        let mut rest = name.split_once(DS_CONFIG).map_or(name, |(stack, _)| stack);
        for suffix in [", compiled", ", async TP"] {
            rest = rest.strip_suffix(suffix).unwrap_or(rest);
        }
        match rest.rsplit_once(", fp8 ") {
            Some((stack, r)) if Fp8Recipe::ALL.iter().any(|x| x.name() == r) => stack,
            _ => rest,
        }
    }

    /// The stack a published run names, or a current stack without framework-specific
    /// tricks (no TE TP-communication overlap; the 1F1B and interleaved schedules published
    /// runs use) where the table does not hold it, named so.
    pub fn for_case(spec: Option<&str>) -> Framework {
        match spec.map(Framework::parse) {
            Some(Ok(fw)) => fw,
            // A stack the table knows, at a version it cannot read or place (`torchtitan@main`,
            // `megatron-deepspeed@bigscience`): its row without a version.
            Some(Err(FrameworkError::Version(..))) => {
                let spec = spec.unwrap_or_default();
                let word = spec_word(spec);
                let (name, _) = name_and_version(&word);
                match STACKS
                    .iter()
                    .find(|r| (r.matches)(name, &Version::default()))
                {
                    Some(row) => Framework::of_row(
                        row,
                        format!("{word} (version not in the table: as {})", row.name),
                    ),
                    None => Framework::unknown(spec),
                }
            }
            _ => Framework::unknown(spec.unwrap_or("unnamed")),
        }
    }

    /// A current stack without framework-specific tricks, for a run whose stack the table
    /// does not hold, named so.
    fn unknown(spec: &str) -> Framework {
        Framework {
            name: format!("{spec} (unknown: as current)"),
            runtime: Runtime {
                tp_overlap: TpOverlap::None,
                ..Runtime::default()
            },
            space: Space {
                schedules: MEGATRON_SCHEDULES.to_vec(),
                ..Space::default()
            },
        }
    }
}

/// The table as `parallax frameworks` prints it.
pub fn table_text() -> String {
    let mut out = String::new();
    for s in STACKS {
        let p = (s.build)();
        let r = &p.runtime;
        let yes = |b: bool| if b { "yes" } else { "no" };
        let _ = writeln!(out, "{}  —  {}", s.name, s.covers);
        let _ = writeln!(
            out,
            "  module code {}{}, fused attention {}, DP reduce overlapped {}, TP comm overlap {}, sends overlapped {}, grads reduced in {}, weight grads accumulated {}, optimizer step {}{}, sequence parallel {}, context parallel {}, fp8 recipes {}",
            match (r.eager_kernels, r.compiles_fp8) {
                (true, true) => "eager (--compile; fp8 compiled)",
                (true, false) => "eager (--compile)",
                _ => "fused",
            },
            if r.autocast { ", 16 bits under autocast" } else { "" },
            match (r.fused_attention, r.native_attention) {
                (true, true) => "native (FlashAttention-3 class)",
                (true, false) => "yes",
                _ => "no",
            },
            yes(r.overlap_grad_reduce),
            match (r.tp_overlap, p.space.async_tp) {
                (TpOverlap::Userbuffers, true) => "userbuffers (async TP offered)",
                (TpOverlap::Userbuffers, false) => "userbuffers",
                (TpOverlap::MicroPipelined, _) => "async TP",
                (TpOverlap::AsyncBackward, _) => "column-parallel backward",
                (TpOverlap::None, true) => "no (async TP offered)",
                (TpOverlap::None, false) => "no",
            },
            match r.pipe_sends {
                PipeSends::Overlapped => "yes",
                PipeSends::Paired => "no (paired exchanges)",
                PipeSends::Separate => "no (sends and receives block apart)",
            },
            if r.grad_reduce_fp32 { "fp32" } else { "16-bit" },
            match r.wgrad_accumulation {
                WgradAccumulation::Fused => "in the GEMM",
                WgradAccumulation::Autograd => "by autograd",
                WgradAccumulation::Hook => "by a hook",
                WgradAccumulation::HookCast => "by a hook, cast first",
            },
            match r.optimizer_passes {
                OptimizerPasses::Fused => "fused",
                OptimizerPasses::DeepSpeed03 => "per tensor (host round trips)",
            },
            match (p.space.offload.is_empty(), r.host_optimizer) {
                (true, _) => "",
                (false, HostOptimizer::DeepSpeedCpuAdam) => "; offloaded: DeepSpeedCPUAdam",
                (false, HostOptimizer::DeepSpeedCpuAdam03) => {
                    "; offloaded: DeepSpeedCPUAdam (fp32 tiles up while it updates)"
                }
                (false, HostOptimizer::TorchSingleTensor) => "; offloaded: torch AdamW per tensor",
            },
            yes(p.space.sequence_parallel),
            yes(p.space.offers_context_parallel()),
            match p.space.fp8_recipes.as_slice() {
                [] => "none".to_string(),
                o => o
                    .iter()
                    .map(|x| {
                        if *x == r.fp8_recipe {
                            format!("{x} (default)")
                        } else {
                            x.to_string()
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            },
        );
        let _ = writeln!(
            out,
            "  schedules {}; ZeRO stages {:?}; recompute {}; uneven stages {}; offload {}",
            p.space
                .schedules
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            p.space.zero_stages,
            p.space
                .recompute
                .iter()
                .map(|r| r.to_string())
                .chain(p.space.recompute_modules.then(|| "modules:…".to_string()))
                .chain(p.space.recompute_layers.then(|| "every:K".to_string()))
                .collect::<Vec<_>>()
                .join(", "),
            yes(p.space.uneven_stages),
            match p.space.offload.as_slice() {
                [] => "none".to_string(),
                o => o
                    .iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            },
        );
        let zero3 = match r.zero3 {
            Zero3Engine::Units => None,
            Zero3Engine::DeepSpeed2021 => Some(
                "each submodule gathered and each gradient tensor reduce-scattered on its own, blocking compute",
            ),
            Zero3Engine::DeepSpeed2022 => {
                Some("each submodule gathered on its own, gradients bucketed, blocking compute")
            }
            Zero3Engine::DeepSpeed => Some(
                "each submodule gathered on its own, gradients bucketed, overlapped",
            ),
        };
        if let Some(z) = zero3 {
            let _ = writeln!(out, "  ZeRO-3: {z}");
        }
        let loss = match r.cross_entropy {
            CrossEntropy::Upcast => None,
            CrossEntropy::VocabParallel => Some("Megatron's in-place vocab-parallel cross-entropy"),
            CrossEntropy::TeFused => {
                Some("Transformer Engine's fused cross-entropy (gradient in the logits)")
            }
            CrossEntropy::LossParallel => {
                Some("PyTorch's DTensor loss_parallel on vocabulary-sharded logits (tp > 1)")
            }
            CrossEntropy::Compiled => Some("PyTorch's cross-entropy compiled by inductor"),
        };
        if let Some(loss) = loss {
            let _ = writeln!(out, "  loss: {loss}");
        }
        if r.compiles_loss {
            let _ = writeln!(out, "  a compiled run compiles the loss with the model");
        }
        if r.sp_keeps_gathered_inputs {
            let _ = writeln!(
                out,
                "  sequence parallelism keeps the gathered inputs of column-parallel linears"
            );
        }
        if r.single_process_dp {
            let _ = writeln!(out, "  one process drives every GPU (DataParallel)");
        }
        for f in s.features {
            let _ = writeln!(out, "  - {} [{}]", f.what, f.source);
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_ir::Precision;

    #[test]
    fn each_stack_accumulates_weight_gradients_as_its_code_does() {
        // Megatron-LM by autograd in fp16 (its 2020–2021 defaults), in the GEMM from its
        // February 2022 fusion on, as Megatron-Core; DeepSpeed's fp16 engines by autograd, its
        // BF16_Optimizer by a hook; DDP by autograd; FSDP2 stages kept gathered by its fp32
        // accumulation.
        let acc = |name: &str| Framework::parse(name).unwrap().runtime.wgrad_accumulation;
        use WgradAccumulation::{Autograd, Fused, Hook, HookCast};
        for (name, want) in [
            ("megatron-lm@2020", Autograd),
            ("megatron-lm@2021", Autograd),
            ("megatron-lm@2022", Fused),
            ("megatron-core@2024", Fused),
            ("megatron-deepspeed@2021", Autograd),
            ("megatron-deepspeed@2022", HookCast),
            ("deepspeed@0.3", Autograd),
            ("pytorch-ddp@1.8", Autograd),
            ("hf-trainer-ddp@4.36", Autograd),
            ("torchtitan@2024", Hook),
            ("pytorch-fsdp@2.2", Hook),
            ("current", Fused),
        ] {
            assert_eq!(acc(name), want, "{name}");
        }
    }

    #[test]
    fn each_pipeline_engine_sends_as_its_code_does() {
        // Megatron-LM before 2023 pairs its sends and receives in blocking exchanges and
        // scatters both messages over tp; Megatron-Core overlaps them. DeepSpeed's engine
        // blocks on each send and each receive apart; it sent input gradients whole until
        // 0.5.4 (October 2021) and partitions both ways since, gathering its own output again.
        let rt = |name: &str| {
            let r = Framework::parse(name).unwrap().runtime;
            (r.pipe_sends, r.pipe_messages)
        };
        use PipeMessages::{DeepSpeedPartitioned, DeepSpeedWholeGrads, Scattered};
        use PipeSends::{Overlapped, Paired, Separate};
        for (name, want) in [
            ("megatron-lm@2021", (Paired, Scattered)),
            ("megatron-lm@2022", (Paired, Scattered)),
            ("megatron-core@2025", (Overlapped, Scattered)),
            ("megatron-deepspeed@2021", (Separate, DeepSpeedWholeGrads)),
            ("megatron-deepspeed@2022", (Separate, DeepSpeedPartitioned)),
            ("deepspeed@0.3", (Separate, DeepSpeedWholeGrads)),
            ("deepspeed", (Separate, DeepSpeedPartitioned)),
            ("torchtitan", (Overlapped, Scattered)),
        ] {
            assert_eq!(rt(name), want, "{name}");
        }
    }

    #[test]
    fn a_stack_name_without_its_run_options_is_the_stack() {
        let fw = Framework::parse("torchtitan@2024").unwrap();
        let base = fw.name.clone();
        let decorated = fw
            .with_options(Some(Fp8Recipe::Rowwise), true)
            .unwrap()
            .with_compile(true)
            .unwrap();
        assert_eq!(
            decorated.name,
            format!("{base}, fp8 rowwise, async TP, compiled")
        );
        assert_eq!(Framework::stack_name(&decorated.name), base);
        assert_eq!(Framework::stack_name(&base), base);
        // A comma in a name that is no run option stays.
        assert_eq!(Framework::stack_name("x, fp8 y"), "x, fp8 y");
    }

    /// A run's ds_config refines a DeepSpeed stack: the overlap, reduce type and ZeRO sizes
    /// it sets, the rest of the row as it was; the name carries the file. Other stacks read
    /// none.
    #[test]
    fn a_ds_config_refines_deepspeed_stacks_only() {
        let c = DsConfig::parse(
            r#"{"communication_data_type": "fp32", "zero_optimization":
                {"stage": 2, "overlap_comm": true, "reduce_bucket_size": 5e7}}"#,
            "ds.json",
        )
        .unwrap();
        let base = Framework::parse("deepspeed@0.3").unwrap();
        assert!(!base.runtime.overlap_grad_reduce && !base.runtime.grad_reduce_fp32);
        let fw = base.clone().with_ds_config(&c, "ds.json").unwrap();
        assert_eq!(fw.name, "deepspeed@0.3, ds_config ds.json");
        assert_eq!(Framework::stack_name(&fw.name), base.name);
        assert!(fw.runtime.overlap_grad_reduce && fw.runtime.grad_reduce_fp32);
        assert_eq!(fw.runtime.zero_config.reduce_bucket, 50_000_000);
        assert_eq!(
            fw.runtime.zero_config.max_reuse_distance,
            base.runtime.zero_config.max_reuse_distance
        );
        let untouched = Runtime {
            overlap_grad_reduce: base.runtime.overlap_grad_reduce,
            grad_reduce_fp32: base.runtime.grad_reduce_fp32,
            zero_config: base.runtime.zero_config,
            ..fw.runtime
        };
        assert_eq!(untouched, base.runtime);
        // An empty file changes nothing but the name.
        let empty = base
            .clone()
            .with_ds_config(&DsConfig::default(), "e.json")
            .unwrap();
        assert_eq!(empty.runtime, base.runtime);
        for name in [
            "megatron-deepspeed@2022",
            "deepspeed-zero3@2021",
            "deepspeed",
        ] {
            assert!(
                Framework::parse(name)
                    .unwrap()
                    .with_ds_config(&c, "ds.json")
                    .is_ok(),
                "{name}"
            );
        }
        for name in ["megatron-lm@2022", "torchtitan", "current"] {
            let e = Framework::parse(name)
                .unwrap()
                .with_ds_config(&c, "ds.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains("reads no DeepSpeed config"), "{e}");
        }
    }

    #[test]
    fn every_row_has_sourced_features_and_answers_to_its_own_name() {
        for s in STACKS {
            assert!(!s.features.is_empty(), "{}", s.name);
            assert!(s
                .features
                .iter()
                .all(|f| !f.source.is_empty() && !f.what.is_empty()));
            assert!(
                s.names.contains(&s.name.split('@').next().unwrap()),
                "{}",
                s.name
            );
            let fw = Framework::parse(s.name).unwrap();
            assert!(
                fw.name.starts_with(s.name.split('@').next().unwrap()),
                "{} → {}",
                s.name,
                fw.name
            );
        }
        assert!(table_text().contains("megascale@2024"));
    }

    #[test]
    fn the_stacks_the_case_files_and_the_issue_name_resolve() {
        for spec in [
            "megatron-lm@2020",
            "megatron-lm@2021",
            "megatron-lm@2022",
            "megatron-lm@2023",
            "megatron-core@2024",
            "megatron-core@0.9",
            "torchtitan@2024-12",
            "hf-trainer-ddp@4.36",
            "pytorch-fsdp@2.2-nightly (ibm fms-fsdp, fsdp1)",
            "megatron-bridge@26.04.01",
            "megatron-bridge@25.09 (megatron-fsdp)",
            "deepspeed@0.3 (megatron-lm v1.1.5 gpt2 example)",
            "megatron-deepspeed@2021",
            "megatron-deepspeed@2022",
            "deepspeed-zero3@2021",
            "megascale@2024",
            "meta-llama3@2024",
            "nvidia-mlperf@3.1",
            "nemo@24.07",
            "tensorflow-1.x/tf_cnn_benchmarks (TensorFlow (git b1e174e))",
            "pytorch-ddp (PyTorch (NGC pytorch:21.11-py3))",
            "pytorch-apex-ddp (PyTorch (NGC 20.06))",
            "torchgpipe (PyTorch 1.3.0 + torchgpipe 0.0.5)",
        ] {
            assert!(Framework::parse(spec).is_ok(), "{spec}");
        }
    }

    #[test]
    fn eras_differ_where_their_releases_did() {
        let fw = |s| Framework::parse(s).unwrap();
        let (m20, m21, m22, m23) = (
            fw("megatron-lm@2020"),
            fw("megatron-lm@2021"),
            fw("megatron-lm@2022"),
            fw("megatron-lm@2023"),
        );
        // fp16 gradients until the 2022 fusion made fp32 accumulation the reason to keep it.
        assert!(!m20.runtime.grad_reduce_fp32 && !m21.runtime.grad_reduce_fp32);
        assert!(m22.runtime.grad_reduce_fp32);
        assert!(!m20.space.schedules.contains(&Schedule::Interleaved1F1B));
        assert!(m21.space.schedules.contains(&Schedule::Interleaved1F1B));
        assert!(!m21.space.sequence_parallel && m22.space.sequence_parallel);
        assert!(!m22.runtime.fused_attention && m23.runtime.fused_attention);
        // Megatron-LM's column-parallel backward overlap from September 2021 on, TE's
        // userbuffers opt-in.
        assert!(m21.runtime.tp_overlap == TpOverlap::None);
        assert!(m22.runtime.tp_overlap == TpOverlap::AsyncBackward);
        assert!(
            !m23.runtime.overlap_grad_reduce && m23.runtime.tp_overlap == TpOverlap::AsyncBackward
        );
        // MegaScale and its Megatron-LM baseline are different stacks.
        let ms = fw("megascale@2024");
        assert!(ms.runtime.tp_overlap == TpOverlap::Userbuffers && ms.runtime.overlap_grad_reduce);
        assert_ne!(ms.runtime, m23.runtime);
        let core = fw("nemo@24.07");
        assert_eq!(core.name, "nemo@24.07");
        // NeMo's launcher recipes keep and reduce gradients in bf16; Megatron-Core's own
        // default is fp32; otherwise the two runtimes are one.
        let mc24 = fw("megatron-core@2024");
        assert!(mc24.runtime.grad_reduce_fp32 && !core.runtime.grad_reduce_fp32);
        assert_eq!(
            Runtime {
                grad_reduce_fp32: true,
                ..core.runtime
            },
            mc24.runtime
        );
        assert_eq!(fw("nemo@24.03").name, "nemo@24.03 (as nemo@24.07)");
        assert!(
            core.runtime.tp_overlap == TpOverlap::Userbuffers
                && !core.space.zero_stages.contains(&3)
        );
        assert!(fw("megatron-bridge@25.09").space.zero_stages.contains(&3));
        let mds = fw("megatron-deepspeed@2022");
        assert!(!mds.runtime.overlap_grad_reduce && !mds.space.sequence_parallel);
        assert_eq!(mds.space.schedules, vec![Schedule::OneFOneB]);
        let z3 = fw("deepspeed-zero3@2021");
        assert_eq!(z3.space.zero_stages, vec![3]);
        assert!(!z3.runtime.fused_attention && !z3.runtime.grad_reduce_fp32);
        assert!(fw("meta-llama3@2024").runtime.zero3_gathered_under_pp);
        // Context parallelism came with Megatron-Core (late 2023), Llama 3 and torchtitan.
        assert!(!m22.space.context_parallel && !m23.space.context_parallel);
        assert!(!mds.space.context_parallel);
        for s in [
            "nemo@24.07",
            "meta-llama3@2024",
            "torchtitan@2024-12",
            "current",
        ] {
            assert!(fw(s).space.context_parallel, "{s}");
        }
        // torchtitan of 2024 is today's but for its eager loss and its pipelining's kept
        // outputs.
        assert_eq!(
            fw("torchtitan@2024-12").runtime,
            Runtime {
                compiles_loss: false,
                pipeline_keeps_outputs: true,
                ..Engine::Torchtitan.runtime()
            }
        );
        assert!(
            Engine::Torchtitan
                .runtime()
                .stage_grads_freed_after_own_backward
        );
        // torchtitan and FSDP run their module code eagerly (torch.compile is opt-in) but
        // their torchao float8 layers compiled; `--compile` compiles the rest, and is refused
        // where the code is fused already.
        for s in ["torchtitan@2024-12", "pytorch-fsdp@2.2"] {
            let r = fw(s).runtime;
            assert!(
                r.runs_eager(Precision::Bf16) && !r.runs_eager(Precision::Fp8),
                "{s}"
            );
            let c = fw(s).with_compile(true).unwrap();
            assert!(!c.runtime.runs_eager(Precision::Bf16), "{s}");
        }
        assert!(fw("megatron-core@2024").with_compile(true).is_err());
        // torchtitan of 2024 split a pipelined batch into one micro-batch per pipeline rank
        // where none was set; from April 2025 the default is micro-batches of one sequence.
        let titan24 = fw("torchtitan@2024-12");
        assert_eq!(titan24.name, "torchtitan@2024-12 (as torchtitan@2024)");
        assert_eq!(
            titan24.space.pipeline_defaults,
            Some(PipelineDefaults {
                microbatches_per_rank: 1,
                looped_stages_per_rank: 2
            })
        );
        assert_eq!(fw("torchtitan@2025").space.pipeline_defaults, None);
        assert_eq!(fw("torchtitan").space.pipeline_defaults, None);
    }

    /// The HuggingFace guide's DP vs DDP table (`shared/seeds/004_*`: 200 steps of GPT-2 on
    /// 2 TITAN RTX, per-device batch 4, fp32): DataParallel 110.6 s, DDP 101.9 s with NVLink,
    /// 131.4 s without. The DDP-without-NVLink row is predicted 14 % fast (its all-reduce over
    /// NCCL's shared-memory transport hides behind backward in the model, not in the run).
    #[test]
    fn the_hf_guide_dp_and_ddp_rows() {
        use parallax_cost::transformer::Setup;
        use parallax_hardware::Cluster;
        use parallax_ir::{Layout, Precision};
        let m = parallax_ir::models::zoo::transformer("gpt2").unwrap();
        let step = |stack: &str, cluster: &str| {
            let c = Cluster::parse(&format!("{cluster}:gpus=2")).unwrap();
            let setup = Setup {
                precision: Precision::Fp32,
                runtime: Framework::parse(stack).unwrap().runtime,
                ..Setup::new(&m, &c.profile, 2, 1024, 8)
            };
            let l = Layout {
                dp: 2,
                micro_batch: 4,
                ..Layout::default()
            };
            parallax_sim::simulate_step(&setup, &l)
                .unwrap()
                .prediction
                .step_time_s
        };
        let dp = step("pytorch-dataparallel@1.8", "titan-rtx-2x-nvlink");
        let ddp = step("hf-trainer-ddp@4.3", "titan-rtx-2x-nvlink");
        let ddp_pcie = step("hf-trainer-ddp@4.3", "titan-rtx-2x-pcie");
        let within = |p: f64, measured_total: f64| (p / (measured_total / 200.0) - 1.0).abs();
        assert!(within(dp, 110.5948) < 0.10, "DataParallel {dp}");
        assert!(within(ddp, 101.9003) < 0.10, "DDP with NVLink {ddp}");
        assert!(dp > ddp && ddp_pcie > ddp, "{dp} {ddp} {ddp_pcie}");
    }

    /// A left-out knob never takes a value the stack does not offer; a given one is kept.
    #[test]
    fn completions_stay_inside_the_stack() {
        use crate::complete::complete_within;
        use parallax_cost::transformer::Setup;
        use parallax_hardware::Cluster;
        use parallax_ir::PartialLayout;
        let m = parallax_ir::models::zoo::transformer("gpt3-6.7b").unwrap();
        let c = Cluster::parse("dgx-a100-80gb:gpus=16").unwrap();
        let done = |stack: &str, partial: &PartialLayout| {
            let fw = Framework::parse(stack).unwrap();
            let setup = Setup {
                runtime: fw.runtime,
                ..Setup::new(&m, &c.profile, 16, 2048, 64)
            };
            complete_within(&setup, partial, &fw.space).unwrap().layout
        };
        let tp4 = PartialLayout {
            tp: Some(4),
            ..PartialLayout::default()
        };
        assert!(!done("megatron-lm@2021", &tp4).sequence_parallel);
        assert!(done("megatron-lm@2022", &tp4).sequence_parallel);
        let fsdp = done("pytorch-fsdp@2.2", &PartialLayout::default());
        assert_eq!(
            (fsdp.tp, fsdp.pp, fsdp.cp, fsdp.dp),
            (1, 1, 1, 16),
            "{fsdp:?}"
        );
        // Published degrees stand even where the stack would not choose them.
        assert_eq!(done("pytorch-fsdp@2.2", &tp4).tp, 4);
    }

    /// DeepSpeed's ZeRO-3 of 2021 gathers each submodule with its own collective and waits
    /// for every one: its step falls behind the same model gathered a layer at a time and
    /// overlapped, and the more so the more ranks (each ring call's latency and the host's
    /// view of every rank's piece of every gradient tensor grow with them).
    #[test]
    fn deepspeed_zero3_of_2021_waits_for_its_collectives() {
        use parallax_cost::transformer::Setup;
        use parallax_hardware::Cluster;
        use parallax_ir::{Layout, Precision, Recompute};
        let m = parallax_ir::models::zoo::transformer("gpt3-13b").unwrap();
        let ds = Framework::parse("deepspeed-zero3@2021").unwrap().runtime;
        assert_eq!(ds.zero3, Zero3Engine::DeepSpeed2021);
        let step = |gpus: u32, runtime: Runtime| {
            let c = Cluster::parse(&format!("dgx2-v100-32gb:gpus={gpus}")).unwrap();
            let setup = Setup {
                precision: Precision::Fp16,
                runtime,
                ..Setup::new(&m, &c.profile, gpus, 1024, u64::from(gpus))
            };
            let l = Layout {
                dp: gpus,
                zero_stage: 3,
                recompute: Recompute::Full,
                ..Layout::default()
            };
            parallax_sim::simulate_step(&setup, &l)
                .unwrap()
                .prediction
                .step_time_s
        };
        let ratio = |gpus: u32| {
            let units = Runtime {
                zero3: Zero3Engine::Units,
                ..ds
            };
            step(gpus, ds) / step(gpus, units)
        };
        let (small, large) = (ratio(64), ratio(2048));
        assert!(small > 1.05, "64 ranks: {small}");
        assert!(large > 1.5 * small, "2048 ranks: {large} vs {small}");
    }

    /// The HuggingFace Trainer's models attend eagerly before transformers 4.42 (GPT-2's
    /// SDPA attention arrived there) and through PyTorch's fused SDPA from it on; the rest of
    /// the row is the same (eager module code under autocast, autograd's accumulation).
    #[test]
    fn hf_trainer_versions_pick_their_attention() {
        for (spec, name, fused) in [
            ("hf-trainer-ddp@4.36", "hf-trainer-ddp@4.x", false),
            ("hf-trainer@4.41", "hf-trainer-ddp@4.x", false),
            ("hf-trainer-ddp@4.42", "hf-trainer-ddp@4.42", true),
            ("hf-trainer@5.17", "hf-trainer-ddp@4.42", true),
            ("hf-trainer", "hf-trainer-ddp@4.42", true),
        ] {
            let f = Framework::parse(spec).unwrap();
            assert!(f.name.contains(name), "{spec}: {}", f.name);
            assert_eq!(f.runtime.fused_attention, fused, "{spec}");
            assert!(f.runtime.eager_kernels && f.runtime.autocast, "{spec}");
            assert_eq!(f.runtime.wgrad_accumulation, WgradAccumulation::Autograd);
        }
    }

    /// DeepSpeed versions map to the ZeRO-3 engine of their time.
    #[test]
    fn deepspeed_versions_pick_their_zero3_engine() {
        for (spec, engine) in [
            ("deepspeed@0.5", Zero3Engine::DeepSpeed2021),
            ("deepspeed-zero3@2021", Zero3Engine::DeepSpeed2021),
            ("deepspeed@0.6.2", Zero3Engine::DeepSpeed2022),
            ("deepspeed@2022", Zero3Engine::DeepSpeed2022),
            ("deepspeed@0.9", Zero3Engine::DeepSpeed2022),
            ("deepspeed@0.10", Zero3Engine::DeepSpeed),
            ("deepspeed", Zero3Engine::DeepSpeed),
            ("megatron-deepspeed@2022", Zero3Engine::DeepSpeed2022),
        ] {
            assert_eq!(
                Framework::parse(spec).unwrap().runtime.zero3,
                engine,
                "{spec}"
            );
        }
        // Context parallelism (DeepSpeed-Ulysses) is 0.10's.
        assert!(
            !Framework::parse("deepspeed@0.6")
                .unwrap()
                .space
                .context_parallel
        );
        assert!(
            Framework::parse("deepspeed")
                .unwrap()
                .space
                .context_parallel
        );
    }

    #[test]
    fn engines_imply_their_current_stack() {
        for e in Engine::ALL {
            let fw = Framework::for_engine(e);
            assert_eq!(fw.runtime, e.runtime(), "{e}");
            assert_eq!(fw.space, e.space(), "{e}");
        }
    }

    #[test]
    fn torchtitan_compiles_its_loss_from_april_2025() {
        // Versions by month: torchtitan's 2024 row (eager loss, one micro-batch per pipeline
        // rank) covers releases up to March 2025; later ones, and a bare year, are current.
        for (v, row, compiles_loss) in [
            ("torchtitan@2024-12", "torchtitan@2024", false),
            ("torchtitan@2025-02", "torchtitan@2024", false),
            ("torchtitan@2025-06", "torchtitan", true),
            ("torchtitan@2025", "torchtitan", true),
            ("torchtitan", "torchtitan", true),
        ] {
            let fw = Framework::parse(v).unwrap();
            assert!(
                fw.name == row || fw.name.ends_with(&format!("(as {row})")),
                "{v}: {}",
                fw.name
            );
            assert_eq!(fw.runtime.compiles_loss, compiles_loss, "{v}");
        }
        assert_eq!(
            Version::parse("2025-02"),
            Version {
                year: Some(2025),
                month: Some(2),
                semver: None
            }
        );
        assert!(Version::parse("24.07").up_to(2024, 7));
        assert!(!Version::parse("2025").up_to(2025, 3));
    }

    #[test]
    fn unknown_stacks_and_versions_are_named() {
        let e = Framework::parse("jax@0.4").unwrap_err();
        assert!(e.to_string().contains("unknown stack 'jax@0.4'"), "{e}");
        let e = Framework::parse("nemo@24.13").unwrap_err();
        assert!(e.to_string().contains("no row of the table covers"), "{e}");
        let long = "x".repeat(5000);
        assert!(Framework::parse(&long).unwrap_err().to_string().len() < 600);
        let e = Framework::parse("megatron-deepspeed@x").unwrap_err();
        assert!(e.to_string().contains("cannot read the version"), "{e}");
        assert_eq!(
            Framework::parse("megatron-core@0.9").unwrap().name,
            "megatron-core@0.9 (as megatron-core@2024)"
        );
        assert_eq!(Framework::parse("torchtitan").unwrap().name, "torchtitan");
        let fw = Framework::for_case(Some("another-lab@2025"));
        assert_eq!(fw.runtime.tp_overlap, TpOverlap::None);
        assert!(fw.name.contains("another-lab@2025 (unknown"), "{}", fw.name);
    }

    /// A case naming a stack the table holds at a version it cannot place is predicted on
    /// that stack's row without a version, not as an unknown stack; Megatron-LM's
    /// `core_r` / `core_v` tags name Megatron-Core releases; MosaicML's trainers are PyTorch
    /// FSDP.
    #[test]
    fn cases_keep_their_stack_when_the_version_is_unplaced() {
        let case = |s| Framework::for_case(Some(s));
        let fw = case("megatron-deepspeed@bigscience (BLOOM's fork)");
        assert_eq!(
            fw.name,
            "megatron-deepspeed@bigscience (version not in the table: as megatron-deepspeed@2022)"
        );
        assert_eq!(fw.runtime.pipe_sends, PipeSends::Separate);
        assert!(case("nemo@24.13").name.ends_with("as megatron-core@2025)"));
        assert!(case("torchtitan@main").name.ends_with("as torchtitan)"));
        let core = Framework::parse("megatron-lm@core_r0.5.0").unwrap();
        assert_eq!(core.name, "megatron-lm@core_r0.5.0 (as megatron-core@2024)");
        assert!(Framework::parse("megatron-lm@core_v0.12.0")
            .unwrap()
            .name
            .ends_with("(as megatron-core@2025)"));
        assert!(Framework::parse("llm-foundry@0.3")
            .unwrap()
            .name
            .ends_with("(as pytorch-fsdp@2.x)"));
        // The flag stays strict: a user naming a version the table lacks is told so.
        assert!(Framework::parse("torchtitan@main").is_err());
    }

    /// `--fp8-recipe` and `--async-tp` set the stack's runtime where it offers them and are
    /// refused in one line naming what it offers where it does not.
    #[test]
    fn recipes_and_async_tp_are_what_the_stack_offers() {
        let fw = |s| Framework::parse(s).unwrap();
        let titan = fw("torchtitan")
            .with_options(Some(Fp8Recipe::Rowwise), true)
            .unwrap();
        assert_eq!(titan.runtime.fp8_recipe, Fp8Recipe::Rowwise);
        assert_eq!(titan.runtime.tp_overlap, TpOverlap::MicroPipelined);
        // Reports name what was chosen with the stack.
        assert_eq!(titan.name, "torchtitan, fp8 rowwise, async TP");
        let core = fw("megatron-core@2025")
            .with_options(Some(Fp8Recipe::Blockwise), false)
            .unwrap();
        assert_eq!(core.runtime.fp8_recipe, Fp8Recipe::Blockwise);
        let e = fw("megatron-core@2025")
            .with_options(Some(Fp8Recipe::Rowwise), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("delayed, tensorwise, blockwise"), "{e}");
        let e = fw("megatron-core@2024")
            .with_options(None, true)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--async-tp: megatron-core@2024"), "{e}");
        let e = fw("megatron-lm@2021")
            .with_options(Some(Fp8Recipe::Tensorwise), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no fp8 training"), "{e}");
        // Nothing chosen, nothing changed.
        assert_eq!(
            fw("torchtitan").with_options(None, false).unwrap(),
            fw("torchtitan")
        );
    }
}
