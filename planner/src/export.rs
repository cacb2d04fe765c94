//! Exports of a plan to the training engines teams run: Megatron-LM (`pretrain_gpt.py`, or
//! `pretrain_hybrid.py` for a hybrid stack, arguments), DeepSpeed (`ds_config.json`) and
//! torchtitan (its TOML job config).
//!
//! Each engine offers only part of the layout space; [`Engine::supports`] says which part, so
//! the planner can search inside it (`parallax plan --export ENGINE`) and an export never
//! silently drops a knob: [`export`] refuses a layout the engine cannot express.

use crate::search::Space;
use parallax_cost::transformer::{
    CrossEntropy, PipeMessages, PipeSends, Runtime, SelectivePolicy, TpOverlap, WgradAccumulation,
    Zero3Engine, MEGATRON_VOCAB_MULTIPLE,
};
use parallax_ir::models::{Mlp, Norm, Position, TransformerConfig};
use parallax_ir::{Fp8Recipe, Layout, Offload, Plan, Precision, Recompute, Schedule};
use serde_json::json;
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// A training engine a plan can be exported to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Engine {
    /// Megatron-LM / Megatron-Core `pretrain_gpt.py`.
    Megatron,
    /// DeepSpeed (ZeRO, pipeline engine, AutoTP).
    DeepSpeed,
    /// torchtitan (FSDP2, TP, PP, CP).
    Torchtitan,
}

impl Engine {
    /// All engines.
    pub const ALL: [Engine; 3] = [Engine::Megatron, Engine::DeepSpeed, Engine::Torchtitan];

    /// Name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Megatron => "megatron",
            Engine::DeepSpeed => "deepspeed",
            Engine::Torchtitan => "torchtitan",
        }
    }

    /// File the export is written to.
    pub fn file_name(self) -> &'static str {
        match self {
            Engine::Megatron => "megatron_args.sh",
            Engine::DeepSpeed => "ds_config.json",
            Engine::Torchtitan => "torchtitan.toml",
        }
    }

    /// How the engine behaves beyond the layout, for predicting the plans it will run:
    /// torchtitan is plain FSDP2 + SDPA (no userbuffer overlap of TP collectives; op-level
    /// selective checkpointing that saves only every second matmul output; pipelined models
    /// kept gathered across micro-batches; its Llama module code eager unless compiled, which
    /// its float8 runs are); the others run the current default stack.
    pub fn runtime(self) -> Runtime {
        match self {
            Engine::Torchtitan => Runtime {
                tp_overlap: TpOverlap::None,
                selective: SelectivePolicy::CheapOpsAndAlternateMatmuls,
                zero3_gathered_under_pp: true,
                stage_grads_freed_after_own_backward: true,
                // `training.compile = false` by default (config_manager.py and
                // train_configs/llama3_8b.toml at 9dec370, `compile.enable` later); float8
                // "requires `--training.compile` for competitive performance" (docs/float8.md).
                eager_kernels: true,
                compiles_fp8: true,
                // FSDP2 without gradient sync (a pipelined stage's micro-batches) adds each
                // bf16 gradient into an fp32 one (`FSDPParam.accumulate_unsharded_grad_if_needed`).
                wgrad_accumulation: WgradAccumulation::Hook,
                // `loss_parallel` on the vocabulary-sharded logits when tp > 1
                // (`parallel_dims.loss_parallel_enabled`, train.py).
                cross_entropy: CrossEntropy::LossParallel,
                // DTensor's sequence parallelism: a column-parallel linear keeps its gathered
                // input (`ColwiseParallel` / `PrepareModuleInput` to `Replicate()`).
                sp_keeps_gathered_inputs: true,
                // `training.compile` (`compile.enable` later) compiles the loss with the model
                // (components/loss.py `build_cross_entropy_loss`, since bbb1b616, 2025-04-02).
                compiles_loss: true,
                ..Runtime::default()
            },
            // Megatron's vocab-parallel cross-entropy works in one fp32 buffer; Transformer
            // Engine 2 runs cuDNN 9's fused attention on Hopper.
            Engine::Megatron => Runtime {
                cross_entropy: CrossEntropy::VocabParallel,
                native_attention: true,
                vocab_multiple: MEGATRON_VOCAB_MULTIPLE,
                te_linears: true,
                ..Runtime::default()
            },
            // Its pipeline engine sends with blocking `dist.send` / `dist.recv`
            // (runtime/pipe/p2p.py: "Doesn't support async_op true") and partitions both
            // messages over tensor parallelism (`pipeline.pipe_partitioned` and
            // `grad_partitioned` on by default), gathering its own output again before backward.
            Engine::DeepSpeed => Runtime {
                pipe_sends: PipeSends::Separate,
                pipe_messages: PipeMessages::DeepSpeedPartitioned,
                // Stage 3 gathers each submodule's weight on its own hook and slices every
                // gradient into world-size views before its reduce-scatter.
                zero3: Zero3Engine::DeepSpeed,
                // Gradients are reduced in the training type (`communication_data_type`
                // defaults to fp16 or bf16 as the run trains: runtime/engine.py).
                grad_reduce_fp32: false,
                ..Runtime::default()
            },
        }
    }

    /// The part of the layout space the engine offers that a [`Space`] can say: its pipeline
    /// schedules, ZeRO stages and recompute policies, and whether its stages may be uneven.
    /// The search stays inside it for a plan meant for export; [`Engine::supports`] adds what
    /// depends on the layout.
    pub fn space(self) -> Space {
        match self {
            Engine::Megatron => Space {
                schedules: vec![Schedule::OneFOneB, Schedule::Interleaved1F1B],
                // The distributed optimizer shards optimizer states only: every rank keeps the
                // full fp32 gradient buffer (ZeRO-1 in memory, as Megatron's own estimator
                // counts it), so ZeRO-2 is not a Megatron layout.
                zero_stages: vec![0, 1, 3],
                uneven_stages: false,
                embedding_and_loss_as_layers: true,
                // `--recompute-modules` (core 0.13+).
                recompute_modules: true,
                offload: Vec::new(),
                // `--fp8-recipe` (delayed, tensorwise, blockwise; mxfp8 is Blackwell's).
                fp8_recipes: vec![
                    Fp8Recipe::Delayed,
                    Fp8Recipe::Tensorwise,
                    Fp8Recipe::Blockwise,
                ],
                async_tp: false,
                ..Space::default()
            },
            Engine::DeepSpeed => Space {
                schedules: vec![Schedule::OneFOneB],
                recompute: vec![Recompute::None, Recompute::Full],
                // AutoTP shards weights only: DeepSpeed has no sequence parallelism.
                sequence_parallel: false,
                fp8_recipes: Vec::new(),
                async_tp: false,
                ..Space::default()
            },
            Engine::Torchtitan => Space {
                schedules: vec![
                    Schedule::GPipe,
                    Schedule::OneFOneB,
                    Schedule::Interleaved1F1B,
                ],
                zero_stages: vec![0, 2, 3],
                offload: Vec::new(),
                // torchao's float8 recipes (`rowwise_with_gw_hp` is not modelled) and
                // `enable_async_tensor_parallel`.
                fp8_recipes: vec![Fp8Recipe::Tensorwise, Fp8Recipe::Rowwise],
                async_tp: true,
                ..Space::default()
            },
        }
    }

    /// Why the engine cannot run `l`, or `None` when it can. No engine takes the planner's
    /// balanced stage ranges; beyond that:
    ///
    /// - Megatron-LM: 1F1B and interleaved 1F1B only; ZeRO 0 (DDP), 1 (distributed
    ///   optimizer) or 3 (`--use-torch-fsdp2`: pp = 1, ep = 1 and untied embeddings there);
    ///   every (virtual) stage holds the same number of layers.
    /// - DeepSpeed: its pipeline engine runs 1F1B with ZeRO 0–1 only; no context parallelism;
    ///   recompute none or full (activation checkpointing); its `uniform` partition.
    /// - torchtitan: GPipe, 1F1B, interleaved 1F1B; DDP (ZeRO 0), FSDP with or without
    ///   resharding after forward (ZeRO 3 and 2; FSDP shards gradients too, so no ZeRO-1);
    ///   its own split points, uneven where the layers do not divide.
    pub fn supports(
        self,
        l: &Layout,
        model: &TransformerConfig,
        precision: Precision,
    ) -> Option<String> {
        self.supports_job(model, precision)
            .or_else(|| self.supports_within(&self.space(), l, model))
    }

    /// Why the engine cannot train `model` at `precision` under any layout, or `None` (asked
    /// once, before a search).
    pub fn supports_job(self, model: &TransformerConfig, precision: Precision) -> Option<String> {
        match (self, precision) {
            (Engine::DeepSpeed, Precision::Fp8) => {
                Some("deepspeed's config has no fp8 training".into())
            }
            (Engine::Torchtitan, Precision::Fp16) => Some(
                "torchtitan's mixed precision is bf16 (mixed_precision_param takes bfloat16 or \
                 float32)"
                    .into(),
            ),
            (Engine::DeepSpeed | Engine::Torchtitan, _) if model.hybrid.is_some() => Some(format!(
                "{self} export does not cover hybrid Mamba-2 stacks (megatron's pretrain_hybrid.py does)"
            )),
            // Megatron's `--position-embedding-type` is learned_absolute, rope, relative (T5)
            // or none; torchtitan's Llama applies rotary embeddings. ALiBi is BLOOM's
            // Megatron-DeepSpeed fork's (and MPT's llm-foundry's).
            (Engine::Megatron | Engine::Torchtitan, _) if model.position == Position::Alibi => {
                Some(format!(
                    "{self} has no ALiBi position embedding (Megatron-DeepSpeed's fork and llm-foundry do)"
                ))
            }
            // LatentMoE is Megatron-Core's (`--moe-latent-size`); DeepSpeed's config carries no
            // model code, torchtitan's MoE models have no latent projections.
            (Engine::Torchtitan, _) if model.moe.is_some_and(|m| m.latent > 0) => {
                Some("torchtitan has no LatentMoE (Megatron-Core's --moe-latent-size)".into())
            }
            (Engine::Torchtitan, _) if torchtitan_flavor(model).is_none() => Some(
                "torchtitan has no model of these dimensions (its llama3 flavors: 8B, 70B, 405B)"
                    .into(),
            ),
            _ => None,
        }
    }

    /// Why the engine cannot run layout `l` of `model` (what depends on the layout; see
    /// [`Engine::supports_job`] for the rest), with the engine's [`Engine::space`] built once
    /// by the caller (the search asks for every candidate).
    pub(crate) fn supports_within(
        self,
        space: &Space,
        l: &Layout,
        model: &TransformerConfig,
    ) -> Option<String> {
        let name = self.name();
        let layers = model.layers;
        let chunks = l.pp * l.interleave.max(1);
        // Megatron places a hybrid stack's stages where its layer pattern has `|`: any split.
        let any_split = self == Engine::Megatron && model.hybrid.is_some();
        // Explicit stages are only Megatron's own accounted split.
        let accounted = space
            .embedding_and_loss_as_layers
            .then(|| parallax_sim::accounted_layers(layers, chunks, model.mtp_layers))
            .flatten();
        if !any_split
            && !l.stages.is_empty()
            && accounted != Some(parallax_sim::stage_layers(layers, l))
        {
            return Some(format!("{name} splits stages evenly"));
        }
        if l.schedule != Schedule::None && !space.schedules.contains(&l.schedule) {
            return Some(format!("{name} has no {} schedule", l.schedule));
        }
        if !space.allows_recompute(l.recompute) {
            return Some(format!("{name} has no {} recomputation", l.recompute));
        }
        if !space.zero_stages.contains(&l.zero_stage) {
            return Some(format!("{name} has no ZeRO-{}", l.zero_stage));
        }
        if l.ep_overlap && !space.ep_overlap {
            return Some(format!(
                "{name} has no overlapped expert dispatch (ep_overlap)"
            ));
        }
        if l.offload != Offload::None && !space.offload.contains(&l.offload) {
            return Some(format!("{name} export has no {} offload", l.offload));
        }
        if !any_split && !space.splits(layers, chunks, model.mtp_layers) {
            return Some(if space.embedding_and_loss_as_layers {
                format!(
                    "{name} splits the {layers} layers (or {} with the embedding and loss) evenly over pp × v = {chunks} stages",
                    layers + 2
                )
            } else {
                format!("{name} splits the {layers} layers evenly over pp × v = {chunks} stages")
            });
        }
        match self {
            Engine::Megatron
                if matches!(l.recompute, Recompute::Every(_))
                    && (layers % chunks != 0
                        || (layers / chunks) % l.recompute.whole_layer_period().unwrap_or(1)
                            != 0) =>
            {
                Some(format!(
                    "megatron's block recomputation redoes the same count of each chunk's layers: recompute {} needs the {layers} layers to split into {chunks} chunks of a multiple of its k",
                    l.recompute
                ))
            }
            Engine::Megatron if l.zero_stage == 3 && l.pp > 1 => {
                Some("megatron runs FSDP (ZeRO-3) without pipeline parallelism only".into())
            }
            Engine::Megatron if l.zero_stage == 3 && l.ep > 1 => {
                Some("megatron runs FSDP (ZeRO-3) without expert parallelism only".into())
            }
            Engine::Megatron if l.zero_stage == 3 && model.tied_embeddings => Some(
                "megatron's FSDP (ZeRO-3) needs untied embeddings; this model ties them".into(),
            ),
            Engine::DeepSpeed
                if l.ep > 1 || l.expert_tp() != l.tp || !l.dispatcher.is_all_to_all() =>
            {
                Some("deepspeed export does not cover expert parallelism".into())
            }
            Engine::DeepSpeed if l.pp > 1 && l.zero_stage >= 2 => {
                Some("deepspeed's pipeline engine supports ZeRO 0 and 1 only".into())
            }
            Engine::DeepSpeed if l.cp > 1 => Some("deepspeed has no context parallelism".into()),
            Engine::DeepSpeed if l.tp > 1 && l.pp > 1 => Some(
                "deepspeed's AutoTP is for tensor + data parallelism with ZeRO: it builds its \
                 tensor-parallel groups over all ranks, ignoring pipeline stages"
                    .into(),
            ),
            Engine::DeepSpeed if l.tp > 1 && l.sequence_parallel => Some(
                "deepspeed's AutoTP has no sequence parallelism (activations stay replicated \
                 over the tensor-parallel group)"
                    .into(),
            ),
            Engine::Torchtitan
                if l.ep > 1 || l.expert_tp() != l.tp || !l.dispatcher.is_all_to_all() =>
            {
                Some("torchtitan export does not cover expert parallelism".into())
            }
            Engine::Torchtitan if l.zero_stage == 0 && (l.tp > 1 || l.pp > 1 || l.cp > 1) => Some(
                "torchtitan's DDP (ZeRO-0) runs without tensor, pipeline or context \
                     parallelism"
                    .into(),
            ),
            _ => None,
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Engine {
    type Err = String;
    /// `megatron`, `deepspeed` or `torchtitan`, the last optionally `@VERSION`: torchtitan
    /// read TOML job configs up to v0.2.2 (what the export writes); later releases take Python
    /// config modules (`--module … --config …`), which are not written yet.
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        let (name, version) = match lower.split_once('@') {
            Some((n, v)) => (n, Some(v)),
            None => (lower.as_str(), None),
        };
        let engine = Engine::ALL
            .into_iter()
            .find(|e| e.name() == name)
            .ok_or_else(|| {
                format!("unknown engine '{s}' (expected megatron, deepspeed or torchtitan)")
            })?;
        match (engine, version) {
            (_, None) => Ok(engine),
            (Engine::Torchtitan, Some(v)) => {
                let v = v.trim_start_matches('v');
                let mut parts = v.split('.').map(str::parse::<u32>);
                let release = match (parts.next(), parts.next(), parts.next()) {
                    (Some(Ok(major)), Some(Ok(minor)), patch) => {
                        patch.unwrap_or(Ok(0)).ok().map(|p| (major, minor, p))
                    }
                    _ => None,
                };
                match release {
                    Some(r) if r <= (0, 2, 2) => Ok(engine),
                    _ => Err(format!(
                        "'{s}': torchtitan after v0.2.2 reads Python config modules (--module, \
                         --config), which parallax does not write yet; torchtitan@0.2.2 (the \
                         last TOML release) is what --export torchtitan writes"
                    )),
                }
            }
            (_, Some(_)) => Err(format!(
                "'{s}': {name} exports are written for its current release; name it without a version"
            )),
        }
    }
}

/// Why a plan could not be exported.
#[derive(Debug, Error, PartialEq)]
pub enum ExportError {
    #[error("cannot export to {engine}: {reason}")]
    Unsupported { engine: Engine, reason: String },
}

/// Gradient accumulation steps (micro-batches per step per data-parallel rank).
fn accumulation(plan: &Plan) -> u64 {
    plan.layout.micro_batches(plan.training.global_batch)
}

/// The engine's configuration for `plan` of `model`.
pub fn export(
    engine: Engine,
    plan: &Plan,
    model: &TransformerConfig,
) -> Result<String, ExportError> {
    export_onto(engine, plan, model, None)
}

/// [`export`], written onto the run's own `ds_config.json` where it has one (`--ds-config`,
/// [`crate::ds_config::DsConfig::document`]; read by the DeepSpeed export alone): the plan's
/// batch, layout and precision replace the file's, and every other key the file sets stays.
pub fn export_onto(
    engine: Engine,
    plan: &Plan,
    model: &TransformerConfig,
    ds_config: Option<&serde_json::Value>,
) -> Result<String, ExportError> {
    if let Some(reason) = engine.supports(&plan.layout, model, plan.training.precision) {
        return Err(ExportError::Unsupported { engine, reason });
    }
    let t = &plan.training;
    let space = engine.space();
    let reason = match t.fp8_recipe {
        Some(r) if t.precision == Precision::Fp8 && !space.fp8_recipes.contains(&r) => {
            Some(format!("{engine} has no {r} fp8 recipe"))
        }
        _ if t.async_tp && !space.async_tp => {
            Some(format!("{engine} has no asynchronous tensor parallelism"))
        }
        _ => None,
    };
    if let Some(reason) = reason {
        return Err(ExportError::Unsupported { engine, reason });
    }
    Ok(match engine {
        Engine::Megatron => megatron(plan, model),
        Engine::DeepSpeed => deepspeed(plan, ds_config),
        Engine::Torchtitan => torchtitan(plan, model),
    })
}

/// `pretrain_gpt.py` arguments, one per line, as a shell script.
fn megatron(plan: &Plan, m: &TransformerConfig) -> String {
    let l = &plan.layout;
    let t = &plan.training;
    let mut a: Vec<String> = vec![
        format!("--num-layers {}", m.layers),
        format!("--hidden-size {}", m.hidden),
        format!("--num-attention-heads {}", m.heads),
        format!("--ffn-hidden-size {}", m.dense_ffn()),
        format!("--seq-length {}", t.seq_len),
        format!("--max-position-embeddings {}", m.max_seq.max(t.seq_len)),
    ];
    if m.kv_heads != m.heads {
        a.push("--group-query-attention".into());
        a.push(format!("--num-query-groups {}", m.kv_heads));
    }
    if m.mla.is_none() && m.head_dim * m.heads != m.hidden {
        // Megatron's head size is hidden / heads unless given (Qwen3, Nemotron-H).
        a.push(format!("--kv-channels {}", m.head_dim));
    }
    match m.mlp {
        // GPT-OSS's clamped gate is Megatron's quick GeGLU (`x·σ(1.702x)`); its offset of 1
        // and clamp at 7 are fields of the model's config class (Megatron-Bridge's GPT-OSS
        // provider), which no command-line flag sets.
        Mlp::Swiglu if m.clamped_swiglu => a.push("--quick-geglu".into()),
        Mlp::Swiglu => a.push("--swiglu".into()),
        Mlp::SquaredRelu => a.push("--squared-relu".into()),
        Mlp::Gelu | Mlp::GeluNew | Mlp::Relu => {}
    }
    if m.norm == Norm::RmsNorm {
        a.push("--normalization RMSNorm".into());
    }
    match m.position {
        Position::Rope => {
            a.push("--position-embedding-type rope".into());
            a.push(format!("--rotary-base {}", m.rope_theta));
        }
        Position::None => a.push("--position-embedding-type none".into()),
        // ALiBi was refused before (`Engine::supports_job`).
        Position::Learned | Position::Alibi => {}
    }
    if !m.tied_embeddings {
        a.push("--untie-embeddings-and-output-weights".into());
    }
    if !m.bias {
        a.push("--disable-bias-linear".into());
        if m.qkv_bias {
            // Qwen2: biases on the query, key and value projections alone.
            a.push("--add-qkv-bias".into());
        }
    }
    if let Some(moe) = m.moe {
        a.push(format!("--num-experts {}", moe.experts));
        a.push(format!("--moe-router-topk {}", moe.top_k));
        if moe.latent > 0 {
            // LatentMoE (TransformerConfig.moe_latent_size, a flag of its own through
            // ArgumentGroupFactory).
            a.push(format!("--moe-latent-size {}", moe.latent));
        }
        if moe.router == parallax_ir::models::Router::Sigmoid {
            // Sigmoid scores with DeepSeek's balancing bias on them.
            a.push("--moe-router-score-function sigmoid".into());
            a.push("--moe-router-enable-expert-bias".into());
        }
        if !moe.norm_top_k && moe.router == parallax_ir::models::Router::Softmax {
            // Softmax over every expert, the top-k taken as they are (Qwen2-MoE); Megatron's
            // default is a softmax over the k chosen logits, which sums to one.
            a.push("--moe-router-pre-softmax".into());
        }
        if moe.routed_scale_permille != 1000 {
            a.push(format!(
                "--moe-router-topk-scaling-factor {}",
                moe.routed_scale()
            ));
        }
        if let Some(c) = moe.capacity_factor() {
            // Token dropping (Megatron's default drop policy, the lowest-probability copies);
            // capacity needs an aux-loss-style balancing type, Megatron's default aux_loss.
            a.push(format!("--moe-expert-capacity-factor {c}"));
            if moe.pad_to_capacity {
                a.push("--moe-pad-expert-input-to-capacity".into());
            }
        }
        if moe.groups > 1 && moe.groups_per_token > 0 {
            a.push(format!("--moe-router-num-groups {}", moe.groups));
            a.push(format!("--moe-router-group-topk {}", moe.groups_per_token));
        }
        if moe.shared_ffn_hidden > 0 {
            a.push(format!(
                "--moe-shared-expert-intermediate-size {}",
                moe.shared_ffn_hidden
            ));
            if moe.shared_gate {
                // Qwen2-MoE's per-token sigmoid gate (TransformerConfig.moe_shared_expert_gate).
                a.push("--moe-shared-expert-gate".into());
            }
        }
        if moe.has_dense_layers() {
            // Megatron's --ffn-hidden-size is the dense layers' width, the experts' their own;
            // which layers route, as the Python list --moe-layer-freq evaluates.
            a.push(format!("--moe-ffn-hidden-size {}", m.ffn_hidden));
            let pattern: Vec<&str> = (0..m.layers)
                .map(|i| if moe.is_moe_layer(i) { "1" } else { "0" })
                .collect();
            a.push(format!("--moe-layer-freq \"[{}]\"", pattern.join(",")));
        }
        a.push(format!("--expert-model-parallel-size {}", l.ep));
        a.push(format!("--expert-tensor-parallel-size {}", l.expert_tp()));
        // Megatron's default dispatcher all-gathers; the plan's is written out.
        match l.dispatcher {
            parallax_ir::Dispatcher::AllToAll => {
                a.push("--moe-token-dispatcher-type alltoall".into())
            }
            parallax_ir::Dispatcher::DeepEp => {
                a.push("--moe-token-dispatcher-type flex".into());
                a.push("--moe-flex-dispatcher-backend deepep".into());
            }
        }
        if l.ep_overlap {
            // The combined 1F1B; weight gradients deferred so they too hide the dispatch.
            a.push("--overlap-moe-expert-parallel-comm".into());
            a.push("--delay-wgrad-compute".into());
        }
    }
    a.push(format!("--tensor-model-parallel-size {}", l.tp));
    a.push(format!("--pipeline-model-parallel-size {}", l.pp));
    a.push(format!("--context-parallel-size {}", l.cp));
    if let Some(mla) = m.mla {
        a.push("--multi-latent-attention".into());
        if mla.q_lora_rank > 0 {
            a.push(format!("--q-lora-rank {}", mla.q_lora_rank));
        }
        a.push(format!("--kv-lora-rank {}", mla.kv_lora_rank));
        a.push(format!("--qk-head-dim {}", mla.qk_nope_head_dim));
        a.push(format!("--qk-pos-emb-head-dim {}", mla.qk_rope_head_dim));
        a.push(format!("--v-head-dim {}", mla.v_head_dim));
    }
    if m.mtp_layers > 0 {
        a.push(format!("--mtp-num-layers {}", m.mtp_layers));
    }
    if m.qk_norm || m.mla.is_some() {
        // Per-head query/key norms, or latent attention's norms of its compressed queries and
        // keys (DeepSeek's q_a_layernorm and kv_a_layernorm): Megatron's one flag for both.
        a.push("--qk-layernorm".into());
    }
    if m.attention_sinks {
        // A learned logit per head in every softmax (TE's fused attention supports it).
        a.push("--softmax-type learnable".into());
    }
    if let Some(w) = m.sliding_window {
        // (left, right): the window behind each query, nothing ahead (causal).
        a.push(format!("--window-size {},0", w.size));
        if w.full_every > 0 {
            a.push(format!("--window-attn-skip-freq {}", w.full_every));
        }
    }
    // Layers that do not split evenly split with the embedding and the loss counted as
    // layers (the only uneven split the Megatron space plans, `Space::splits`); with
    // prediction modules, as the layout that places them before the loss on the last stage.
    let chunks = l.pp * l.interleave.max(1);
    let split = parallax_sim::stage_layers(m.layers, l);
    let mut split_layers = m.layers;
    let mut layout_given = false;
    if let Some(h) = &m.hybrid {
        // `pretrain_hybrid.py` builds the layers of its pattern; `|` ends a pipeline stage
        // (pp × v segments: the virtual stages follow from their count).
        let mut pattern = String::new();
        let mut at = 0usize;
        for (i, &n) in split.iter().enumerate() {
            if i > 0 && l.pp > 1 {
                pattern.push('|');
            }
            pattern.push_str(&h.pattern[at..at + n as usize]);
            at += n as usize;
        }
        a.push(format!("--hybrid-layer-pattern \"{pattern}\""));
        a.push(format!("--mamba-num-heads {}", h.mamba.heads));
        a.push(format!("--mamba-head-dim {}", h.mamba.head_dim));
        a.push(format!("--mamba-state-dim {}", h.mamba.state));
        a.push(format!("--mamba-num-groups {}", h.mamba.groups));
        layout_given = true;
    } else if l.pp > 1 && (m.layers % chunks != 0 || m.mtp_layers > 0) {
        if m.mtp_layers == 0 {
            a.push("--account-for-embedding-in-pipeline-split".into());
            a.push("--account-for-loss-in-pipeline-split".into());
            split_layers += 2;
        } else {
            let last = split.len() - 1;
            let stages: Vec<String> = split
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let mut c = if i == 0 {
                        "E".to_string()
                    } else {
                        String::new()
                    };
                    c.push_str(&"t".repeat(n as usize));
                    if i == last {
                        c.push_str(&"m".repeat(m.mtp_layers as usize));
                        c.push('L');
                    }
                    c
                })
                .collect();
            a.push(format!(
                "--pipeline-model-parallel-layout \"{}\"",
                stages.join("|")
            ));
            layout_given = true;
        }
    }
    if l.schedule == Schedule::Interleaved1F1B && !layout_given {
        a.push(format!(
            "--num-layers-per-virtual-pipeline-stage {}",
            split_layers / chunks
        ));
    }
    a.push(format!("--micro-batch-size {}", l.micro_batch));
    a.push(format!("--global-batch-size {}", t.global_batch));
    if l.sequence_parallel && l.tp > 1 {
        a.push("--sequence-parallel".into());
    }
    match l.recompute {
        Recompute::None => {}
        Recompute::Selective => a.push("--recompute-granularity selective".into()),
        Recompute::Modules(m) => {
            a.push("--recompute-granularity selective".into());
            let names: Vec<&str> = m.names().collect();
            a.push(format!("--recompute-modules {}", names.join(" ")));
        }
        Recompute::Full => {
            a.push("--recompute-granularity full".into());
            a.push("--recompute-method uniform".into());
            a.push("--recompute-num-layers 1".into());
        }
        // The first layers of each chunk, a k-th of them (`supports` has checked they divide).
        Recompute::Every(_) => {
            let period = l.recompute.whole_layer_period().unwrap_or(1);
            a.push("--recompute-granularity full".into());
            a.push("--recompute-method block".into());
            a.push(format!(
                "--recompute-num-layers {}",
                m.layers / chunks / period
            ));
        }
    }
    // The overlap the prediction assumes (`Engine::runtime`): gradient reduction behind the
    // backward and, with the distributed optimizer, the parameter gather behind the next
    // forward; tensor-parallel collectives pipelined with their GEMMs (Transformer Engine
    // userbuffers, which need sequence parallelism).
    if l.zero_stage <= 1 && l.dp * l.cp > 1 {
        a.push("--overlap-grad-reduce".into());
        if l.zero_stage == 1 {
            a.push("--overlap-param-gather".into());
        }
    }
    if l.tp > 1 && l.sequence_parallel {
        a.push("--tp-comm-overlap".into());
    }
    match l.zero_stage {
        0 => {}
        1 => a.push("--use-distributed-optimizer".into()),
        _ => {
            // FSDP2 cannot fuse gradient accumulation into the weight-gradient GEMMs.
            a.push("--use-torch-fsdp2".into());
            a.push("--no-gradient-accumulation-fusion".into());
        }
    }
    match t.precision {
        Precision::Bf16 => a.push("--bf16".into()),
        Precision::Fp16 => a.push("--fp16".into()),
        Precision::Fp8 => {
            a.push("--bf16".into());
            a.push("--fp8-format hybrid".into());
            // The recipe the plan was priced with (Megatron's own default is delayed).
            a.push(format!(
                "--fp8-recipe {}",
                t.fp8_recipe.unwrap_or(Fp8Recipe::Tensorwise)
            ));
        }
        Precision::Fp32 | Precision::Tf32 => {}
    }
    // What the plan does not say but Megatron needs to start: synthetic data through its
    // null tokenizer at the model's vocabulary (the plan's step, measurable as pasted), a run
    // length and a learning rate. Later arguments win: pass `--data-path PREFIX
    // --tokenizer-type HuggingFaceTokenizer --tokenizer-model NAME` (and drop `--mock-data`
    // by editing) to train on real data.
    a.extend([
        "--mock-data".to_string(),
        "--tokenizer-type NullTokenizer".to_string(),
        format!("--vocab-size {}", m.vocab),
        "--train-iters 100".to_string(),
        "--lr 3e-4".to_string(),
        "--lr-decay-style cosine".to_string(),
        "--lr-warmup-iters 10".to_string(),
        "--min-lr 3e-5".to_string(),
        "--weight-decay 0.1".to_string(),
        "--clip-grad 1.0".to_string(),
    ]);
    let per_node = plan.cluster.gpus.min(gpus_per_node_hint(plan)).max(1);
    let nodes = plan.cluster.gpus.div_ceil(per_node);
    let script = if m.hybrid.is_some() {
        "pretrain_hybrid.py"
    } else {
        "pretrain_gpt.py"
    };
    let mut s = format!(
        "#!/bin/sh\n# parallax plan: {} on {} ({} GPUs), dp {} (implied by the world size)\n\
         # Megatron-LM derives dp = world / (tp × pp × cp). As written it trains on synthetic\n\
         # data (--mock-data, the null tokenizer at the model's vocabulary) for 100 steps: the\n\
         # plan's step time, measurable as pasted. Arguments after the script's name are passed\n\
         # through and override these (e.g. --train-iters, --lr); for real data replace\n\
         # --mock-data and the tokenizer with --data-path PREFIX --tokenizer-type\n\
         # HuggingFaceTokenizer --tokenizer-model NAME.\n",
        plan.model.name, plan.cluster.spec, plan.cluster.gpus, l.dp,
    );
    if l.zero_stage == 3 {
        s.push_str(
            "# Megatron's FSDP overlaps its collectives on several CUDA streams.\n\
             unset CUDA_DEVICE_MAX_CONNECTIONS\n",
        );
    } else if l.tp > 1 || l.cp > 1 {
        s.push_str(
            "# Megatron orders tensor/context-parallel communication before compute on one\n\
             # hardware queue; it refuses tp or cp > 1 without this.\n\
             export CUDA_DEVICE_MAX_CONNECTIONS=1\n",
        );
    }
    if nodes > 1 {
        // Every node runs this script (e.g. `srun --ntasks-per-node=1 sh megatron_args.sh`
        // in an sbatch job); torchrun's rendezvous forms the one world of all nodes.
        s.push_str(&format!(
            "# Run on each of the {nodes} nodes (e.g. srun --nodes={nodes} --ntasks-per-node=1 sh \
             megatron_args.sh)\n\
             # with MASTER_ADDR set to the first node's address.\n\
             torchrun --nproc-per-node {per_node} --nnodes {nodes} \\\n    \
             --rdzv-backend c10d --rdzv-endpoint \"${{MASTER_ADDR:?set MASTER_ADDR to the first \
             node}}:${{MASTER_PORT:-29500}}\" \\\n    \
             --rdzv-id \"${{SLURM_JOB_ID:-parallax}}\" {script} \\\n"
        ));
    } else {
        s.push_str(&format!(
            "torchrun --nproc-per-node {per_node} {script} \\\n"
        ));
    }
    let n = a.len();
    for (i, arg) in a.iter().enumerate() {
        s.push_str("    ");
        s.push_str(arg);
        s.push_str(if i + 1 < n {
            " \\\n"
        } else {
            " \\\n    \"$@\"\n"
        });
    }
    s
}

/// Devices per node for the launcher line: the plan's cluster's, when its spec resolves (a
/// preset or a readable profile); else at least tp (the tensor-parallel group sits in a node)
/// and 8, the common node size.
fn gpus_per_node_hint(plan: &Plan) -> u32 {
    plan_node(plan).map_or(plan.layout.tp.max(8), |n| n.gpus_per_node)
}

/// The node of the plan's cluster, when its spec resolves (a preset or a readable profile).
fn plan_node(plan: &Plan) -> Option<parallax_hardware::NodeSpec> {
    parallax_hardware::Cluster::parse(&plan.cluster.spec)
        .ok()
        .map(|c| c.profile.node)
}

/// Where ZeRO-Infinity's NVMe offload writes when the cluster's profile names no folder on
/// the drives (DeepSpeed's configuration docs use it in their examples).
const DEFAULT_NVME_PATH: &str = "/local_nvme";

/// The object at `key` of `doc` (an object), made one where the file has none or another
/// value there.
fn section<'a>(doc: &'a mut serde_json::Value, key: &str) -> &'a mut serde_json::Value {
    let v = &mut doc[key];
    if !v.is_object() {
        *v = json!({});
    }
    v
}

/// Sets `key` of the object `doc` to `value` where the file leaves it to the tool (absent,
/// `null` or `"auto"`): the stack's defaults under the user's own values.
fn default(doc: &mut serde_json::Value, key: &str, value: serde_json::Value) {
    if doc.get(key).is_none_or(crate::ds_config::is_unset) {
        doc[key] = value;
    }
}

/// DeepSpeed's `zero_optimization` block (`z`, the file's where it has one): the stage, and
/// what goes to host memory or NVMe (`offload_optimizer` — ZeRO-Offload, with DeepSpeed's CPU
/// Adam — and `offload_param` — ZeRO-Infinity, stage 3 only), pinned for the transfers unless
/// the file says otherwise; NVMe at the file's folder, else the one the cluster's profile
/// measured (`node.nvme.path`). DeepSpeed 0.3–0.4's `cpu_offload` flags give way to the
/// blocks that replaced them.
fn zero_optimization(plan: &Plan, z: &mut serde_json::Value) {
    let l = &plan.layout;
    z["stage"] = json!(l.zero_stage);
    if let Some(o) = z.as_object_mut() {
        for legacy in [
            "cpu_offload",
            "cpu_offload_params",
            "cpu_offload_use_pin_memory",
        ] {
            o.remove(legacy);
        }
    }
    let nvme = || {
        plan_node(plan)
            .and_then(|n| n.nvme?.path)
            .unwrap_or_else(|| DEFAULT_NVME_PATH.into())
    };
    for (key, on) in [
        ("offload_optimizer", l.offload != Offload::None),
        ("offload_param", l.offload.params()),
    ] {
        if !on {
            // A block the file has says "none"; none is written where it has none.
            if z.get(key).is_some() {
                section(z, key)["device"] = json!("none");
            }
            continue;
        }
        let d = section(z, key);
        if l.offload.nvme() {
            d["device"] = json!("nvme");
            default(d, "nvme_path", json!(nvme()));
        } else {
            d["device"] = json!("cpu");
        }
        default(d, "pin_memory", json!(true));
    }
}

/// A DeepSpeed `ds_config.json`, onto the run's own (`onto`) where it has one: what the plan
/// decides (batch, micro-batch, accumulation, ZeRO stage and offload, precision, AutoTP, the
/// pipeline's checkpointing) replaces the file's values; the stack's defaults (clipping,
/// activation checkpointing's options) fill in only what the file leaves out; every other key
/// (optimizer, scheduler, loss scaling, bucket sizes, logging) stays as written.
fn deepspeed(plan: &Plan, onto: Option<&serde_json::Value>) -> String {
    let l = &plan.layout;
    let t = &plan.training;
    let mut doc = match onto {
        Some(v) if v.is_object() => v.clone(),
        _ => json!({}),
    };
    doc["train_batch_size"] = json!(t.global_batch);
    doc["train_micro_batch_size_per_gpu"] = json!(l.micro_batch);
    doc["gradient_accumulation_steps"] = json!(accumulation(plan));
    zero_optimization(plan, section(&mut doc, "zero_optimization"));
    let bf16 = matches!(t.precision, Precision::Bf16 | Precision::Fp8);
    let fp16 = t.precision == Precision::Fp16;
    // apex's `amp` is fp16 too, and DeepSpeed refuses it beside `fp16`: a file that trains
    // with it keeps it where the plan is fp16.
    let amp = doc.pointer("/amp/enabled") == Some(&json!(true));
    if amp && !fp16 {
        doc["amp"]["enabled"] = json!(false);
    }
    for (key, on) in [("bf16", bf16), ("fp16", fp16 && !amp)] {
        section(&mut doc, key)["enabled"] = json!(on);
    }
    // bf16's older key, where the file uses it, says the same.
    if doc.get("bfloat16").is_some() {
        section(&mut doc, "bfloat16")["enabled"] = json!(bf16);
    }
    if l.pp > 1 {
        // DeepSpeed's pipeline engine reads only these keys here; the stages and their
        // partition are `PipelineModule(layers, num_stages=pp, partition_method="uniform")`
        // in the training script (the plan's split is uniform).
        // The file's own interval stands where it checkpoints too (every k layers is full
        // recomputation, coarser).
        let p = section(&mut doc, "pipeline");
        let key = "activation_checkpoint_interval";
        let every = p
            .get(key)
            .and_then(serde_json::Value::as_u64)
            .filter(|&k| k > 0);
        p[key] = match (l.recompute == Recompute::Full, every) {
            (true, Some(k)) => json!(k),
            (true, None) => json!(1),
            (false, _) => json!(0),
        };
    }
    if l.tp > 1 || doc.get("tensor_parallel").is_some() {
        section(&mut doc, "tensor_parallel")["autotp_size"] = json!(l.tp);
    }
    default(&mut doc, "gradient_clipping", json!(1.0));
    default(&mut doc, "wall_clock_breakdown", json!(false));
    if l.recompute == Recompute::Full {
        let a = section(&mut doc, "activation_checkpointing");
        default(a, "partition_activations", json!(l.tp > 1));
        default(a, "contiguous_memory_optimization", json!(false));
        default(a, "cpu_checkpointing", json!(false));
    }
    serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
}

/// The torchtitan `llama3` flavor whose dimensions `m` has (`torchtitan/models/llama3`:
/// 8B, 70B, 405B, the zoo's `llama3-*`).
fn torchtitan_flavor(m: &TransformerConfig) -> Option<&'static str> {
    type Dims = (u32, u64, u64, u64, u64, u64);
    let dims = |z: &TransformerConfig| -> Dims {
        (
            z.layers,
            z.hidden,
            z.heads,
            z.kv_heads,
            z.ffn_hidden,
            z.vocab,
        )
    };
    // Built once: the search asks for every candidate layout.
    static FLAVORS: std::sync::OnceLock<Vec<(&'static str, Dims)>> = std::sync::OnceLock::new();
    let flavors = FLAVORS.get_or_init(|| {
        [
            ("8B", "llama3-8b"),
            ("70B", "llama3-70b"),
            ("405B", "llama3-405b"),
        ]
        .into_iter()
        .filter_map(|(flavor, zoo_name)| {
            parallax_ir::models::zoo::transformer(zoo_name).map(|z| (flavor, dims(&z)))
        })
        .collect()
    });
    let want = dims(m);
    flavors
        .iter()
        .find(|(_, d)| *d == want)
        .map(|(flavor, _)| *flavor)
}

/// The modules of each model chunk torchtitan pipelines (`module_fqns_per_model_part`): the
/// plan's layers per virtual stage, the token embedding on the first, the final norm and
/// output projection on the last.
fn torchtitan_model_parts(layers: u32, l: &Layout) -> Vec<Vec<String>> {
    let counts = parallax_sim::stage_layers(layers, l);
    let last = counts.len() - 1;
    let mut next = 0;
    counts
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut part: Vec<String> = Vec::new();
            if i == 0 {
                part.push("tok_embeddings".into());
            }
            part.extend((next..next + n).map(|k| format!("layers.{k}")));
            next += n;
            if i == last {
                part.push("norm".into());
                part.push("output".into());
            }
            part
        })
        .collect()
}

/// torchtitan's `[parallelism]`, `[training]` and `[activation_checkpoint]` sections.
fn torchtitan(plan: &Plan, m: &TransformerConfig) -> String {
    let l = &plan.layout;
    let t = &plan.training;
    let (replicate, shard) = if l.zero_stage == 0 {
        (l.dp, 1)
    } else {
        (1, l.dp)
    };
    let mut p = toml::Table::new();
    p.insert(
        "data_parallel_replicate_degree".into(),
        i64::from(replicate).into(),
    );
    p.insert("data_parallel_shard_degree".into(), i64::from(shard).into());
    p.insert(
        "fsdp_reshard_after_forward".into(),
        (if l.zero_stage == 2 {
            "never"
        } else {
            "default"
        })
        .into(),
    );
    p.insert("tensor_parallel_degree".into(), i64::from(l.tp).into());
    p.insert("enable_async_tensor_parallel".into(), t.async_tp.into());
    p.insert("pipeline_parallel_degree".into(), i64::from(l.pp).into());
    p.insert("context_parallel_degree".into(), i64::from(l.cp).into());
    // torchtitan's sequence parallelism is always on with TP (its TP plan shards norms).
    if l.pp > 1 {
        let sched = match l.schedule {
            Schedule::GPipe => "GPipe",
            Schedule::Interleaved1F1B => "Interleaved1F1B",
            _ => "1F1B",
        };
        p.insert("pipeline_parallel_schedule".into(), sched.into());
        p.insert(
            "pipeline_parallel_microbatch_size".into(),
            (l.micro_batch as i64).into(),
        );
        // torchtitan counts the embedding and the output as layers when it splits by
        // `pipeline_parallel_layers_per_stage`; the plan's split is written module by module.
        let parts: Vec<toml::Value> = torchtitan_model_parts(m.layers, l)
            .into_iter()
            .map(|part| toml::Value::Array(part.into_iter().map(Into::into).collect()))
            .collect();
        p.insert(
            "module_fqns_per_model_part".into(),
            toml::Value::Array(parts),
        );
    }
    let mut tr = toml::Table::new();
    // Per data-parallel rank: the whole share with a pipeline (split into micro-batches), one
    // micro-batch without (torchtitan accumulates gradients up to the global batch).
    let local = if l.pp > 1 {
        t.global_batch / u64::from(l.dp)
    } else {
        l.micro_batch
    };
    tr.insert("local_batch_size".into(), (local as i64).into());
    tr.insert("global_batch_size".into(), (t.global_batch as i64).into());
    tr.insert("seq_len".into(), (t.seq_len as i64).into());
    tr.insert(
        "mixed_precision_param".into(),
        (match t.precision {
            Precision::Fp16 => "float16",
            Precision::Fp32 | Precision::Tf32 => "float32",
            _ => "bfloat16",
        })
        .into(),
    );
    tr.insert("mixed_precision_reduce".into(), "float32".into());
    let mut ac = toml::Table::new();
    ac.insert(
        "mode".into(),
        (match l.recompute {
            Recompute::None => "none",
            // Named modules are Megatron's: the space check refuses them first.
            Recompute::Selective | Recompute::Modules(_) | Recompute::Every(_) => "selective",
            Recompute::Full => "full",
        })
        .into(),
    );
    match l.recompute {
        Recompute::Selective => {
            ac.insert("selective_ac_option".into(), "op".into());
        }
        // Layer-level selective checkpointing: every k-th block wrapped.
        Recompute::Every(k) => {
            ac.insert("selective_ac_option".into(), k.to_string().into());
        }
        _ => {}
    }
    let mut model = toml::Table::new();
    model.insert("name".into(), "llama3".into());
    model.insert(
        "flavor".into(),
        torchtitan_flavor(m).unwrap_or("debugmodel").into(),
    );
    let mut doc = toml::Table::new();
    doc.insert("parallelism".into(), p.into());
    doc.insert("training".into(), tr.into());
    doc.insert("activation_checkpoint".into(), ac.into());
    // Compiled where the plan was priced compiled on torchtitan (`Runtime::runs_eager`): asked
    // for, or implied by asynchronous TP (an inductor pass: torchtitan refuses it uncompiled)
    // or float8 (whose casts compile fuses).
    let priced = Runtime {
        compiled: t.compile,
        tp_overlap: if t.async_tp {
            TpOverlap::MicroPipelined
        } else {
            TpOverlap::None
        },
        ..Engine::Torchtitan.runtime()
    };
    if !priced.runs_eager(t.precision) {
        let mut c = toml::Table::new();
        c.insert("enable".into(), true.into());
        c.insert(
            "components".into(),
            toml::Value::Array(vec!["model".into(), "loss".into()]),
        );
        doc.insert("compile".into(), c.into());
    }
    if t.precision == Precision::Fp8 {
        // torchao's float8 linear layers with the recipe the plan was priced with; under
        // FSDP a tensorwise recipe gathers the weights already cast (torchao's float8
        // all-gather is tensorwise only).
        let recipe = t.fp8_recipe.unwrap_or(Fp8Recipe::Tensorwise);
        let sharded = l.zero_stage >= 2 && recipe == Fp8Recipe::Tensorwise;
        let mut f = toml::Table::new();
        f.insert("recipe_name".into(), recipe.name().into());
        f.insert("enable_fsdp_float8_all_gather".into(), sharded.into());
        f.insert(
            "precompute_float8_dynamic_scale_for_fsdp".into(),
            sharded.into(),
        );
        let mut linear = toml::Table::new();
        linear.insert("float8".into(), f.into());
        let mut quantize = toml::Table::new();
        quantize.insert("linear".into(), linear.into());
        model.insert(
            "converters".into(),
            toml::Value::Array(vec!["quantize.linear.float8".into()]),
        );
        doc.insert("quantize".into(), quantize.into());
    }
    doc.insert("model".into(), model.into());
    format!(
        "# parallax plan: {} on {} ({} GPUs)\n{}",
        plan.model.name,
        plan.cluster.spec,
        plan.cluster.gpus,
        toml::to_string(&doc).unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_ir::models::zoo;
    use parallax_ir::plan::{ClusterRef, ModelRef, Prediction, Training};
    use parallax_ir::PLAN_SCHEMA;

    fn model(name: &str) -> TransformerConfig {
        zoo::transformer(name).unwrap()
    }

    fn plan(l: Layout, precision: Precision) -> Plan {
        Plan {
            schema: PLAN_SCHEMA.into(),
            model: ModelRef {
                name: "llama3-70b".into(),
            },
            cluster: ClusterRef {
                spec: "dgx-h100-80gb:gpus=512".into(),
                gpus: l.devices() as u32,
            },
            training: Training {
                global_batch: 1024,
                seq_len: 8192,
                precision,
                fp8_recipe: None,
                async_tp: false,
                compile: false,
                capacity_permille: 0,
                pad_to_capacity: false,
            },
            layout: l,
            op_configs: Vec::new(),
            micro_batches: None,
            prediction: Some(Prediction::default()),
        }
    }

    /// The value after `flag` in a Megatron argument script.
    fn arg<'a>(s: &'a str, flag: &str) -> Option<&'a str> {
        s.lines().map(str::trim).find_map(|line| {
            let line = line.trim_end_matches(" \\");
            let rest = line.strip_prefix(flag)?;
            if rest.is_empty() {
                Some("")
            } else {
                rest.strip_prefix(' ')
            }
        })
    }

    #[test]
    fn the_launcher_starts_one_process_per_gpu_of_the_clusters_nodes() {
        let m = model("gpt3-1.3b");
        let l = Layout {
            dp: 32,
            ..Layout::default()
        };
        let nproc = |spec: &str| {
            let mut p = plan(l.clone(), Precision::Fp16);
            p.cluster.spec = spec.into();
            let s = export(Engine::Megatron, &p, &m).unwrap();
            s.split("--nproc-per-node ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(nproc("dgx2-v100-32gb:gpus=32"), "16");
        assert_eq!(nproc("jean-zay-v100-32gb:gpus=32"), "4");
        assert_eq!(nproc("dgx-a100-80gb:gpus=32"), "8");
    }

    #[test]
    fn megatron_arguments_carry_every_knob() {
        let m = model("llama3-70b");
        let l = Layout {
            dp: 8,
            tp: 8,
            pp: 4,
            cp: 2,
            zero_stage: 1,
            micro_batch: 2,
            recompute: Recompute::Full,
            sequence_parallel: true,
            schedule: Schedule::Interleaved1F1B,
            interleave: 5,
            ..Layout::default()
        };
        let p = plan(l.clone(), Precision::Bf16);
        let s = export(Engine::Megatron, &p, &m).unwrap();
        assert_eq!(arg(&s, "--tensor-model-parallel-size"), Some("8"));
        assert_eq!(arg(&s, "--pipeline-model-parallel-size"), Some("4"));
        assert_eq!(arg(&s, "--context-parallel-size"), Some("2"));
        assert_eq!(
            arg(&s, "--num-layers-per-virtual-pipeline-stage"),
            Some("4")
        );
        assert_eq!(arg(&s, "--micro-batch-size"), Some("2"));
        assert_eq!(arg(&s, "--global-batch-size"), Some("1024"));
        assert_eq!(arg(&s, "--sequence-parallel"), Some(""));
        assert_eq!(arg(&s, "--recompute-granularity"), Some("full"));
        assert_eq!(arg(&s, "--recompute-method"), Some("uniform"));
        // Every second layer: the block method over half of each chunk's 4 layers; every
        // third cannot take the same count of each chunk's 4.
        let every = |k| Layout {
            recompute: Recompute::Every(k),
            ..l.clone()
        };
        let s2 = export(Engine::Megatron, &plan(every(2), Precision::Bf16), &m).unwrap();
        assert_eq!(arg(&s2, "--recompute-granularity"), Some("full"));
        assert_eq!(arg(&s2, "--recompute-method"), Some("block"));
        assert_eq!(arg(&s2, "--recompute-num-layers"), Some("2"));
        let e = export(Engine::Megatron, &plan(every(3), Precision::Bf16), &m)
            .unwrap_err()
            .to_string();
        assert!(e.contains("recompute every:3"), "{e}");
        assert_eq!(arg(&s, "--use-distributed-optimizer"), Some(""));
        assert_eq!(arg(&s, "--bf16"), Some(""));
        assert_eq!(arg(&s, "--fp16"), None);
        assert_eq!(arg(&s, "--num-layers"), Some("80"));
        assert_eq!(arg(&s, "--hidden-size"), Some("8192"));
        assert_eq!(arg(&s, "--num-attention-heads"), Some("64"));
        assert_eq!(arg(&s, "--num-query-groups"), Some("8"));
        assert_eq!(arg(&s, "--ffn-hidden-size"), Some("28672"));
        assert_eq!(arg(&s, "--seq-length"), Some("8192"));
        assert_eq!(arg(&s, "--swiglu"), Some(""));
        assert_eq!(arg(&s, "--rotary-base"), Some("500000"));
        // It starts as pasted: synthetic data at the model's vocabulary, a length and a rate.
        assert_eq!(arg(&s, "--mock-data"), Some(""));
        assert_eq!(arg(&s, "--vocab-size"), Some("128256"));
        assert!(arg(&s, "--train-iters").is_some() && arg(&s, "--lr").is_some());
        // The overlap the prediction assumes is switched on.
        for flag in [
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--tp-comm-overlap",
        ] {
            assert_eq!(arg(&s, flag), Some(""), "{flag}");
        }
        // Megatron-LM takes dp from the world size (world / (tp × pp × cp)): the script
        // starts a node's GPUs on each of the 64 nodes, joined by one rendezvous, and names
        // the dp it implies; tp > 1 needs one hardware queue.
        assert!(
            s.contains("torchrun --nproc-per-node 8 --nnodes 64 \\\n    --rdzv-backend c10d"),
            "{s}"
        );
        assert!(
            s.contains("\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n"),
            "{s}"
        );
        assert!(s.contains("(512 GPUs), dp 8 (implied"), "{s}");

        let plain = Layout {
            zero_stage: 0,
            recompute: Recompute::Selective,
            sequence_parallel: false,
            schedule: Schedule::OneFOneB,
            interleave: 1,
            ..l
        };
        let s = export(Engine::Megatron, &plan(plain, Precision::Fp16), &m).unwrap();
        assert_eq!(arg(&s, "--recompute-granularity"), Some("selective"));
        assert_eq!(arg(&s, "--use-distributed-optimizer"), None);
        assert_eq!(arg(&s, "--sequence-parallel"), None);
        assert_eq!(arg(&s, "--num-layers-per-virtual-pipeline-stage"), None);
        assert_eq!(arg(&s, "--fp16"), Some(""));

        // ZeRO-3 is FSDP2: no fused gradient accumulation, several CUDA streams, one node
        // needs no rendezvous. ZeRO-2 is not Megatron's (its distributed optimizer keeps
        // whole gradients), nor FSDP with tied embeddings or experts.
        let fsdp = Layout {
            dp: 8,
            tp: 1,
            pp: 1,
            cp: 1,
            zero_stage: 3,
            micro_batch: 1,
            recompute: Recompute::None,
            sequence_parallel: false,
            schedule: Schedule::None,
            interleave: 1,
            ..Layout::default()
        };
        let mut p8 = plan(fsdp.clone(), Precision::Bf16);
        p8.cluster = ClusterRef {
            spec: "dgx-h100-80gb:gpus=8".into(),
            gpus: 8,
        };
        let s = export(Engine::Megatron, &p8, &m).unwrap();
        assert_eq!(arg(&s, "--use-torch-fsdp2"), Some(""));
        assert_eq!(arg(&s, "--no-gradient-accumulation-fusion"), Some(""));
        assert!(s.contains("\nunset CUDA_DEVICE_MAX_CONNECTIONS\n"), "{s}");
        assert!(
            s.contains("torchrun --nproc-per-node 8 pretrain_gpt.py"),
            "{s}"
        );
        let zero2 = Layout {
            zero_stage: 2,
            ..fsdp.clone()
        };
        assert!(export(Engine::Megatron, &plan(zero2, Precision::Bf16), &m)
            .unwrap_err()
            .to_string()
            .contains("ZeRO-2"));
        let tied = model("gpt3-1.3b");
        assert!(export(
            Engine::Megatron,
            &plan(fsdp.clone(), Precision::Bf16),
            &tied
        )
        .unwrap_err()
        .to_string()
        .contains("untied embeddings"));
        // Offload is DeepSpeed's: ZeRO-Offload's `offload_optimizer`, ZeRO-Infinity's
        // `offload_param` beside it; Megatron and torchtitan exports refuse it by name.
        let offload = |o: Offload, zero: u8| Layout {
            zero_stage: zero,
            offload: o,
            ..fsdp.clone()
        };
        let ds = |l: Layout| -> serde_json::Value {
            serde_json::from_str(&export(Engine::DeepSpeed, &plan(l, Precision::Bf16), &m).unwrap())
                .unwrap()
        };
        let z = &ds(offload(Offload::Optimizer, 2))["zero_optimization"];
        assert_eq!(z["stage"], 2);
        assert_eq!(z["offload_optimizer"]["device"], "cpu");
        assert!(z.get("offload_param").is_none(), "{z}");
        let z = &ds(offload(Offload::Params, 3))["zero_optimization"];
        assert_eq!(z["offload_param"]["device"], "cpu");
        assert_eq!(z["offload_optimizer"]["device"], "cpu");
        // ZeRO-Infinity's NVMe: the preset names no folder on its drives, DeepSpeed's example
        // one is written.
        let z = &ds(offload(Offload::OptimizerNvme, 3))["zero_optimization"];
        assert_eq!(z["offload_optimizer"]["device"], "nvme");
        assert_eq!(z["offload_optimizer"]["nvme_path"], DEFAULT_NVME_PATH);
        assert!(z.get("offload_param").is_none(), "{z}");
        let z = &ds(offload(Offload::ParamsNvme, 3))["zero_optimization"];
        for k in ["offload_param", "offload_optimizer"] {
            assert_eq!(z[k]["device"], "nvme", "{z}");
        }
        assert!(ds(fsdp.clone())["zero_optimization"]
            .get("offload_optimizer")
            .is_none());
        for e in [Engine::Megatron, Engine::Torchtitan] {
            let err = export(
                e,
                &plan(offload(Offload::Optimizer, 3), Precision::Bf16),
                &m,
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("no optimizer offload"), "{err}");
        }
    }

    #[test]
    fn deepspeed_config_carries_every_knob() {
        let m = model("llama3-70b");
        let l = Layout {
            dp: 64,
            tp: 1,
            pp: 8,
            zero_stage: 1,
            micro_batch: 4,
            recompute: Recompute::Full,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let p = plan(l, Precision::Bf16);
        let s = export(Engine::DeepSpeed, &p, &m).unwrap();
        // It reads back (`--ds-config`) as the plan it came from, every key priced.
        let back = crate::ds_config::DsConfig::parse(&s, "ds_config.json").unwrap();
        let f = &back.fixes;
        assert_eq!(
            (f.zero_stage, f.micro_batch, f.dp, f.recompute),
            (Some(1), Some(4), Some(64), Some(Recompute::Full))
        );
        assert_eq!(back.precision, Some(Precision::Bf16));
        assert_eq!(back.train_batch, Some(1024));
        assert!(back.unpriced.is_empty(), "{:?}", back.unpriced);
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["train_batch_size"], 1024);
        assert_eq!(v["train_micro_batch_size_per_gpu"], 4);
        assert_eq!(v["gradient_accumulation_steps"], 1024 / (64 * 4));
        assert_eq!(v["zero_optimization"]["stage"], 1);
        assert_eq!(v["bf16"]["enabled"], true);
        assert_eq!(v["fp16"]["enabled"], false);
        // The pipeline engine reads only its checkpoint interval here: the stages are
        // PipelineModule's, in the training script.
        assert_eq!(v["pipeline"]["activation_checkpoint_interval"], 1);
        assert!(v["pipeline"].get("stages").is_none());
        assert!(v.get("tensor_parallel").is_none());
        // AutoTP neither spans pipeline stages nor shards activations (no sp), nor is there
        // an fp8 knob.
        let tp_pp = Layout {
            dp: 16,
            tp: 4,
            ..p.layout.clone()
        };
        assert!(export(Engine::DeepSpeed, &plan(tp_pp, Precision::Bf16), &m)
            .unwrap_err()
            .to_string()
            .contains("ignoring pipeline stages"));
        let tp_sp = Layout {
            dp: 128,
            tp: 4,
            pp: 1,
            sequence_parallel: true,
            schedule: Schedule::None,
            ..p.layout.clone()
        };
        assert!(
            export(Engine::DeepSpeed, &plan(tp_sp.clone(), Precision::Bf16), &m)
                .unwrap_err()
                .to_string()
                .contains("no sequence parallelism")
        );
        let tp_only = Layout {
            sequence_parallel: false,
            ..tp_sp
        };
        let v: serde_json::Value = serde_json::from_str(
            &export(
                Engine::DeepSpeed,
                &plan(tp_only.clone(), Precision::Bf16),
                &m,
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(v["tensor_parallel"]["autotp_size"], 4);
        assert!(
            export(Engine::DeepSpeed, &plan(tp_only, Precision::Fp8), &m)
                .unwrap_err()
                .to_string()
                .contains("fp8")
        );

        // ZeRO-3 only without a pipeline; no context parallelism; no selective recompute.
        let bad = Layout {
            zero_stage: 3,
            ..p.layout.clone()
        };
        assert!(export(Engine::DeepSpeed, &plan(bad, Precision::Bf16), &m).is_err());
        let z3 = Layout {
            dp: 128,
            tp: 4,
            pp: 1,
            zero_stage: 3,
            micro_batch: 1,
            schedule: Schedule::None,
            ..Layout::default()
        };
        let v: serde_json::Value = serde_json::from_str(
            &export(Engine::DeepSpeed, &plan(z3, Precision::Fp16), &m).unwrap(),
        )
        .unwrap();
        assert_eq!(v["zero_optimization"]["stage"], 3);
        assert_eq!(v["fp16"]["enabled"], true);
        assert!(v.get("pipeline").is_none());
        assert_eq!(v["gradient_accumulation_steps"], 8);
    }

    /// Written onto a run's own ds_config, the plan's keys replace the file's and the rest
    /// stays: loss scaling, the scheduler, the ZeRO options, the user's checkpointing choice;
    /// 0.3's `cpu_offload` flag gives way to the block, apex's `amp` stays where the plan is
    /// fp16 and is turned off where it is not.
    #[test]
    fn a_deepspeed_export_keeps_the_runs_own_keys() {
        let m = model("llama3-70b");
        let l = Layout {
            dp: 128,
            tp: 1,
            pp: 4,
            zero_stage: 1,
            offload: Offload::Optimizer,
            micro_batch: 2,
            recompute: Recompute::Full,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let user = json!({
            "train_micro_batch_size_per_gpu": "auto",
            "fp16": { "enabled": "auto", "loss_scale_window": 500 },
            "zero_optimization": {
                "stage": 2, "cpu_offload": true, "overlap_comm": true, "reduce_bucket_size": 2e8
            },
            "activation_checkpointing": { "cpu_checkpointing": true },
            "pipeline": { "activation_checkpoint_interval": 2 },
            "scheduler": { "type": "WarmupLR" },
            "gradient_clipping": 0.3,
        });
        let p = plan(l, Precision::Fp16);
        let s = export_onto(Engine::DeepSpeed, &p, &m, Some(&user)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["train_micro_batch_size_per_gpu"], 2);
        assert_eq!(
            v["fp16"],
            json!({ "enabled": true, "loss_scale_window": 500 })
        );
        assert_eq!(v["bf16"]["enabled"], false);
        assert_eq!(
            v["zero_optimization"],
            json!({
                "stage": 1, "overlap_comm": true, "reduce_bucket_size": 2e8,
                "offload_optimizer": { "device": "cpu", "pin_memory": true }
            })
        );
        assert_eq!(
            v["activation_checkpointing"],
            json!({
                "cpu_checkpointing": true, "partition_activations": false,
                "contiguous_memory_optimization": false
            })
        );
        assert_eq!(v["scheduler"], user["scheduler"]);
        assert_eq!(v["gradient_clipping"], 0.3);
        assert_eq!(v["pipeline"]["activation_checkpoint_interval"], 2);
        // It reads back as the plan, with the file's priced options.
        let back = crate::ds_config::DsConfig::parse(&s, "ds_config.json").unwrap();
        assert_eq!(
            (back.fixes.zero_stage, back.fixes.offload, back.fixes.dp),
            (Some(1), Some(Offload::Optimizer), Some(128))
        );
        assert_eq!(
            (back.cpu_checkpointing, back.reduce_bucket, back.precision),
            (Some(true), Some(200_000_000), Some(Precision::Fp16))
        );
        // Without an offload the file's block says none; no block is made up.
        let plain = Layout {
            offload: Offload::None,
            ..p.layout.clone()
        };
        let offloading =
            json!({ "zero_optimization": { "offload_optimizer": { "device": "cpu" } } });
        let v: serde_json::Value = serde_json::from_str(
            &export_onto(
                Engine::DeepSpeed,
                &plan(plain.clone(), Precision::Bf16),
                &m,
                Some(&offloading),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            v["zero_optimization"]["offload_optimizer"]["device"],
            "none"
        );
        assert!(v["zero_optimization"].get("offload_param").is_none());
        // apex's amp: kept for an fp16 plan (DeepSpeed refuses it beside fp16), off otherwise.
        let amp = json!({ "amp": { "enabled": true, "opt_level": "O1" } });
        for (precision, amp_on, fp16_on) in [
            (Precision::Fp16, true, false),
            (Precision::Bf16, false, false),
        ] {
            let s = export_onto(
                Engine::DeepSpeed,
                &plan(plain.clone(), precision),
                &m,
                Some(&amp),
            )
            .unwrap();
            let v: serde_json::Value = serde_json::from_str(&s).unwrap();
            assert_eq!(v["amp"]["enabled"], amp_on, "{precision:?}");
            assert_eq!(v["amp"]["opt_level"], "O1");
            assert_eq!(v["fp16"]["enabled"], fp16_on, "{precision:?}");
            let back = crate::ds_config::DsConfig::parse(&s, "ds_config.json").unwrap();
            assert_eq!(back.precision, Some(precision));
        }
    }

    #[test]
    fn torchtitan_config_carries_every_knob() {
        let m = model("llama3-70b");
        let l = Layout {
            dp: 8,
            tp: 8,
            pp: 4,
            cp: 2,
            zero_stage: 3,
            micro_batch: 2,
            recompute: Recompute::Selective,
            sequence_parallel: true,
            schedule: Schedule::Interleaved1F1B,
            interleave: 2,
            ..Layout::default()
        };
        let p = plan(l, Precision::Bf16);
        let s = export(Engine::Torchtitan, &p, &m).unwrap();
        let v: toml::Table = s.parse().unwrap();
        let par = v["parallelism"].as_table().unwrap();
        assert_eq!(par["data_parallel_shard_degree"].as_integer(), Some(8));
        assert_eq!(par["data_parallel_replicate_degree"].as_integer(), Some(1));
        assert_eq!(par["tensor_parallel_degree"].as_integer(), Some(8));
        assert_eq!(par["pipeline_parallel_degree"].as_integer(), Some(4));
        assert_eq!(par["context_parallel_degree"].as_integer(), Some(2));
        assert_eq!(
            par["pipeline_parallel_schedule"].as_str(),
            Some("Interleaved1F1B")
        );
        assert_eq!(
            par["pipeline_parallel_microbatch_size"].as_integer(),
            Some(2)
        );
        assert_eq!(par["fsdp_reshard_after_forward"].as_str(), Some("default"));
        // 8 model parts of 10 layers, the embedding on the first, norm and output on the last.
        let parts = par["module_fqns_per_model_part"].as_array().unwrap();
        assert_eq!(parts.len(), 8);
        let names = |i: usize| -> Vec<&str> {
            parts[i]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap())
                .collect()
        };
        assert_eq!(names(0)[..2], ["tok_embeddings", "layers.0"]);
        assert_eq!(names(0).len(), 11);
        assert_eq!(names(1)[0], "layers.10");
        assert_eq!(names(7)[9..], ["layers.79", "norm", "output"]);
        assert_eq!(v["model"]["name"].as_str(), Some("llama3"));
        assert_eq!(v["model"]["flavor"].as_str(), Some("70B"));
        let tr = v["training"].as_table().unwrap();
        assert_eq!(tr["global_batch_size"].as_integer(), Some(1024));
        assert_eq!(tr["local_batch_size"].as_integer(), Some(1024 / 8));
        assert_eq!(tr["seq_len"].as_integer(), Some(8192));
        assert_eq!(tr["mixed_precision_param"].as_str(), Some("bfloat16"));
        assert_eq!(
            v["activation_checkpoint"]["mode"].as_str(),
            Some("selective")
        );
        // Every second layer: torchtitan's layer-level selective checkpointing.
        let every = plan(
            Layout {
                recompute: Recompute::Every(2),
                ..p.layout.clone()
            },
            Precision::Bf16,
        );
        let v: toml::Table = export(Engine::Torchtitan, &every, &m)
            .unwrap()
            .parse()
            .unwrap();
        let ac = v["activation_checkpoint"].as_table().unwrap();
        assert_eq!(ac["mode"].as_str(), Some("selective"));
        assert_eq!(ac["selective_ac_option"].as_str(), Some("2"));

        let ddp = Layout {
            dp: 512,
            tp: 1,
            pp: 1,
            cp: 1,
            zero_stage: 0,
            micro_batch: 1,
            recompute: Recompute::None,
            schedule: Schedule::None,
            interleave: 1,
            ..Layout::default()
        };
        let v: toml::Table = export(Engine::Torchtitan, &plan(ddp.clone(), Precision::Bf16), &m)
            .unwrap()
            .parse()
            .unwrap();
        let par = v["parallelism"].as_table().unwrap();
        assert_eq!(
            par["data_parallel_replicate_degree"].as_integer(),
            Some(512)
        );
        assert_eq!(par["data_parallel_shard_degree"].as_integer(), Some(1));
        assert!(par.get("pipeline_parallel_schedule").is_none());
        assert_eq!(v["training"]["local_batch_size"].as_integer(), Some(1));
        assert_eq!(v["activation_checkpoint"]["mode"].as_str(), Some("none"));
        // DDP is one-dimensional in torchtitan; fp8 is torchao's float8 linear converter.
        let ddp_tp = Layout {
            dp: 64,
            tp: 8,
            ..ddp
        };
        assert!(
            export(Engine::Torchtitan, &plan(ddp_tp, Precision::Bf16), &m)
                .unwrap_err()
                .to_string()
                .contains("DDP")
        );
        let v: toml::Table = export(Engine::Torchtitan, &p_fp8(), &m)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            v["model"]["converters"].as_array().unwrap()[0].as_str(),
            Some("quantize.linear.float8")
        );
        assert_eq!(
            v["quantize"]["linear"]["float8"]["recipe_name"].as_str(),
            Some("tensorwise")
        );
        // Models torchtitan has no flavor of, and fp16, are not torchtitan's.
        assert!(export(Engine::Torchtitan, &p_fp8(), &model("gpt3-1.3b"))
            .unwrap_err()
            .to_string()
            .contains("no model of these dimensions"));
        let mut fp16 = p_fp8();
        fp16.training.precision = Precision::Fp16;
        assert!(export(Engine::Torchtitan, &fp16, &m).is_err());
    }

    /// The plan's fp8 recipe and asynchronous TP reach the engine that runs them, and an
    /// engine without them refuses the plan in a line naming what it lacks.
    #[test]
    fn recipes_and_async_tp_are_exported_where_the_engine_has_them() {
        let m = model("llama3-70b");
        let with = |recipe: Fp8Recipe, async_tp: bool| {
            let mut p = p_fp8();
            p.training.fp8_recipe = Some(recipe);
            p.training.async_tp = async_tp;
            p
        };
        let args = export(Engine::Megatron, &with(Fp8Recipe::Blockwise, false), &m).unwrap();
        assert!(args.contains("--fp8-recipe blockwise"), "{args}");
        let e = export(Engine::Megatron, &with(Fp8Recipe::Rowwise, false), &m).unwrap_err();
        assert!(e.to_string().contains("no rowwise fp8 recipe"), "{e}");
        let e = export(Engine::Megatron, &with(Fp8Recipe::Tensorwise, true), &m).unwrap_err();
        assert!(
            e.to_string().contains("asynchronous tensor parallelism"),
            "{e}"
        );
        let v: toml::Table = export(Engine::Torchtitan, &with(Fp8Recipe::Rowwise, true), &m)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            v["parallelism"]["enable_async_tensor_parallel"].as_bool(),
            Some(true)
        );
        assert_eq!(v["compile"]["enable"].as_bool(), Some(true));
        let f = &v["quantize"]["linear"]["float8"];
        assert_eq!(f["recipe_name"].as_str(), Some("rowwise"));
        assert_eq!(f["enable_fsdp_float8_all_gather"].as_bool(), Some(false));
    }

    /// A torchtitan export compiles the model where its plan was priced compiled: float8
    /// (whose casts compile fuses), asynchronous TP, or `--compile`; a bf16 plan priced with
    /// torchtitan's eager default stays uncompiled.
    #[test]
    fn torchtitan_exports_compile_where_the_plan_was_priced_compiled() {
        let m = model("llama3-70b");
        let compiled = |p: &Plan| {
            let v: toml::Table = export(Engine::Torchtitan, p, &m).unwrap().parse().unwrap();
            v.get("compile")
                .and_then(|c| c["enable"].as_bool())
                .unwrap_or(false)
        };
        let mut p = p_fp8();
        assert!(compiled(&p), "float8");
        p.training.precision = Precision::Bf16;
        p.training.fp8_recipe = None;
        assert!(!compiled(&p), "eager bf16");
        p.training.compile = true;
        assert!(compiled(&p), "--compile");
    }

    /// An FSDP llama3-70b plan in fp8.
    fn p_fp8() -> Plan {
        plan(
            Layout {
                dp: 512,
                zero_stage: 3,
                ..Layout::default()
            },
            Precision::Fp8,
        )
    }

    /// A search inside an engine's space returns what a search over every option returns
    /// once the engine refuses what it cannot run: the space only keeps out, before pricing,
    /// layouts the engine would refuse.
    #[test]
    fn an_engines_space_keeps_out_only_what_it_refuses() {
        use crate::search::{search, SearchOptions};
        use parallax_cost::transformer::Setup;
        let m = model("llama3-8b");
        let c = parallax_hardware::Cluster::parse("dgx-a100-80gb:gpus=16").unwrap();
        for e in Engine::ALL {
            let s = Setup {
                runtime: e.runtime(),
                ..Setup::new(&m, &c.profile, 16, 2048, 64)
            };
            let run = |space| {
                let opts = SearchOptions {
                    top_k: 8,
                    families: false,
                    space,
                    engine: Some(e),
                    ..SearchOptions::default()
                };
                search(&s, &opts).unwrap()
            };
            let (inside, everywhere) = (run(e.space()), run(Default::default()));
            let layouts = |r: &crate::search::SearchResult| -> Vec<Layout> {
                r.top.iter().map(|p| p.layout.clone()).collect()
            };
            assert_eq!(layouts(&inside), layouts(&everywhere), "{e}");
            for p in &inside.top {
                assert_eq!(
                    e.supports(&p.layout, &m, s.precision),
                    None,
                    "{e}: {:?}",
                    p.layout
                );
            }
            let refused = |r: &crate::search::SearchResult| {
                r.counts
                    .rejected
                    .get(&format!("not supported by {e}"))
                    .copied()
                    .unwrap_or(0)
            };
            assert!(refused(&inside) < refused(&everywhere), "{e}");
        }
    }

    #[test]
    fn megatron_folds_experts_and_counts_the_embedding_and_loss_as_layers() {
        // Megatron-Bridge's Qwen3-235B-A22B layout: 94 layers over pp 8 × v 4 split as 96
        // with the embedding and the loss counted (Megatron-Core's
        // get_num_layers_to_build): 3 a chunk, the first and last 2 — the split the
        // simulator gives these layers — and experts folded over dp × tp (ep 32, etp 1).
        let m = model("qwen3-235b-a22b");
        let l = Layout {
            dp: 16,
            tp: 2,
            pp: 8,
            ep: 32,
            etp: Some(1),
            zero_stage: 1,
            sequence_parallel: true,
            schedule: Schedule::Interleaved1F1B,
            interleave: 4,
            ..Layout::default()
        };
        let mut split = vec![3; 32];
        split[0] = 2;
        split[31] = 2;
        assert_eq!(parallax_sim::stage_layers(94, &l), split);
        let s = export(Engine::Megatron, &plan(l.clone(), Precision::Bf16), &m).unwrap();
        assert_eq!(arg(&s, "--expert-model-parallel-size"), Some("32"));
        // Qwen3's per-head query and key norms.
        assert_eq!(arg(&s, "--qk-layernorm"), Some(""));
        assert_eq!(arg(&s, "--expert-tensor-parallel-size"), Some("1"));
        // Megatron's default dispatcher all-gathers: the plan's all-to-all is written out.
        assert_eq!(arg(&s, "--moe-token-dispatcher-type"), Some("alltoall"));
        let deepep = Layout {
            dispatcher: parallax_ir::Dispatcher::DeepEp,
            ..l.clone()
        };
        let t = export(Engine::Megatron, &plan(deepep, Precision::Bf16), &m).unwrap();
        assert_eq!(arg(&t, "--moe-token-dispatcher-type"), Some("flex"));
        assert_eq!(arg(&t, "--moe-flex-dispatcher-backend"), Some("deepep"));
        // Dropless writes no capacity; token dropping writes its factor, padding its flag.
        assert_eq!(arg(&s, "--moe-expert-capacity-factor"), None);
        let dropping = |capacity_permille, pad_to_capacity| TransformerConfig {
            moe: m.moe.map(|x| parallax_ir::models::MoeConfig {
                capacity_permille,
                pad_to_capacity,
                ..x
            }),
            ..m.clone()
        };
        let args = |capacity_permille, pad_to_capacity| {
            let m = dropping(capacity_permille, pad_to_capacity);
            export(Engine::Megatron, &plan(l.clone(), Precision::Bf16), &m).unwrap()
        };
        let c = args(1250, false);
        assert_eq!(arg(&c, "--moe-expert-capacity-factor"), Some("1.25"));
        assert_eq!(arg(&c, "--moe-pad-expert-input-to-capacity"), None);
        let c = args(1000, true);
        assert_eq!(arg(&c, "--moe-expert-capacity-factor"), Some("1"));
        assert_eq!(arg(&c, "--moe-pad-expert-input-to-capacity"), Some(""));
        // The overlapped dispatch: the combined 1F1B with weight gradients deferred; only
        // where the plan has it.
        assert_eq!(arg(&s, "--overlap-moe-expert-parallel-comm"), None);
        let overlapped = Layout {
            ep_overlap: true,
            ..l.clone()
        };
        let o = export(
            Engine::Megatron,
            &plan(overlapped.clone(), Precision::Bf16),
            &m,
        )
        .unwrap();
        assert_eq!(arg(&o, "--overlap-moe-expert-parallel-comm"), Some(""));
        assert_eq!(arg(&o, "--delay-wgrad-compute"), Some(""));
        // A stack without it (Megatron-Core before 0.14) refuses it by name.
        let older = Space {
            ep_overlap: false,
            ..Engine::Megatron.space()
        };
        let e = Engine::Megatron
            .supports_within(&older, &overlapped, &m)
            .unwrap();
        assert!(e.contains("no overlapped expert dispatch"), "{e}");
        assert_eq!(
            arg(&s, "--account-for-embedding-in-pipeline-split"),
            Some("")
        );
        assert_eq!(arg(&s, "--account-for-loss-in-pipeline-split"), Some(""));
        assert_eq!(
            arg(&s, "--num-layers-per-virtual-pipeline-stage"),
            Some("3")
        );
        // An even split needs neither flag; 94 layers over 20 chunks split neither way.
        let even = Layout {
            pp: 2,
            interleave: 1,
            schedule: Schedule::OneFOneB,
            dp: 64,
            ..l.clone()
        };
        let s = export(Engine::Megatron, &plan(even, Precision::Bf16), &m).unwrap();
        assert_eq!(arg(&s, "--account-for-loss-in-pipeline-split"), None);
        let twenty = Layout {
            pp: 4,
            interleave: 5,
            dp: 32,
            ..l.clone()
        };
        let err = export(Engine::Megatron, &plan(twenty, Precision::Bf16), &m).unwrap_err();
        assert!(
            err.to_string()
                .contains("(or 96 with the embedding and loss)"),
            "{err}"
        );
        // An export without expert parallelism refuses a fold even without ep.
        let ep1 = Layout {
            ep: 1,
            pp: 1,
            dp: 128,
            zero_stage: 3,
            interleave: 1,
            schedule: Schedule::None,
            ..l
        };
        for e in [Engine::DeepSpeed, Engine::Torchtitan] {
            let why = e.supports_within(&e.space(), &ep1, &m).unwrap();
            assert!(why.contains("expert parallelism"), "{e}: {why}");
        }
    }

    #[test]
    fn megatron_arguments_carry_shared_experts_and_dense_layers() {
        // One leading dense layer 10944 wide, then MoE layers of 1408-wide experts with a
        // shared expert: Megatron's --ffn-hidden-size is the dense width, the experts' their
        // own, and --moe-layer-freq lists which layers route.
        let m = TransformerConfig {
            moe: Some(parallax_ir::models::MoeConfig {
                shared_ffn_hidden: 1408,
                dense_layers_first: 1,
                every: 1,
                dense_ffn_hidden: 10944,
                ..parallax_ir::models::MoeConfig::routed(128, 8)
            }),
            ..TransformerConfig::llama(6, 4096, 32, 8, 1408, 151_552, 4096)
        };
        let l = Layout {
            dp: 64,
            ep: 8,
            zero_stage: 1,
            ..Layout::default()
        };
        let s = export(Engine::Megatron, &plan(l.clone(), Precision::Bf16), &m).unwrap();
        assert_eq!(arg(&s, "--ffn-hidden-size"), Some("10944"));
        assert_eq!(arg(&s, "--moe-ffn-hidden-size"), Some("1408"));
        assert_eq!(
            arg(&s, "--moe-shared-expert-intermediate-size"),
            Some("1408")
        );
        assert_eq!(arg(&s, "--moe-layer-freq"), Some("\"[0,1,1,1,1,1]\""));
        assert_eq!(arg(&s, "--moe-shared-expert-gate"), None);
        assert_eq!(arg(&s, "--moe-latent-size"), None);
        // LatentMoE: Megatron-Core's --moe-latent-size; torchtitan has none.
        let latent = TransformerConfig {
            moe: m
                .moe
                .map(|x| parallax_ir::models::MoeConfig { latent: 1024, ..x }),
            ..m.clone()
        };
        let s = export(Engine::Megatron, &plan(l.clone(), Precision::Bf16), &latent).unwrap();
        assert_eq!(arg(&s, "--moe-latent-size"), Some("1024"));
        let e = Engine::Torchtitan
            .supports_job(&latent, Precision::Bf16)
            .unwrap();
        assert!(e.contains("LatentMoE"), "{e}");
        // Qwen2-MoE's: a gated shared expert, the top-k weights as the softmax gives them.
        let q = TransformerConfig {
            moe: m.moe.map(|x| parallax_ir::models::MoeConfig {
                shared_gate: true,
                norm_top_k: false,
                ..x
            }),
            ..m.clone()
        };
        let s = export(Engine::Megatron, &plan(l.clone(), Precision::Bf16), &q).unwrap();
        assert_eq!(arg(&s, "--moe-shared-expert-gate"), Some(""));
        assert_eq!(arg(&s, "--add-qkv-bias"), None);
        let q = TransformerConfig {
            qkv_bias: true,
            ..q
        };
        let s = export(Engine::Megatron, &plan(l, Precision::Bf16), &q).unwrap();
        assert_eq!(arg(&s, "--add-qkv-bias"), Some(""));
        assert_eq!(arg(&s, "--disable-bias-linear"), Some(""));
        assert_eq!(arg(&s, "--moe-router-pre-softmax"), Some(""));
    }

    #[test]
    fn megatron_arguments_carry_latent_attention_and_prediction_modules() {
        // DeepSeek-V3 as Megatron-Bridge lays it out on 1024 H100s: 61 layers over pp 8 × v 4
        // with the embedding, the prediction module and the loss each counted as a layer —
        // "Et|tt|…|tt|mL" — the recipe's pipeline layout.
        let m = model("deepseek-v3");
        let mut l = Layout {
            dp: 64,
            tp: 2,
            pp: 8,
            ep: 64,
            etp: Some(1),
            zero_stage: 1,
            sequence_parallel: true,
            schedule: Schedule::Interleaved1F1B,
            interleave: 4,
            ..Layout::default()
        };
        let split = parallax_sim::accounted_layers(61, 32, 1).unwrap();
        assert_eq!((split[0], split[1], split[30], split[31]), (1, 2, 2, 0));
        l.stages = crate::search::stage_ranges(&split);
        l.validate(8192, Some(61)).unwrap();
        assert!(Engine::Megatron.supports(&l, &m, Precision::Bf16).is_none());
        let s = export(Engine::Megatron, &plan(l, Precision::Bf16), &m).unwrap();
        assert_eq!(arg(&s, "--multi-latent-attention"), Some(""));
        assert_eq!(arg(&s, "--q-lora-rank"), Some("1536"));
        assert_eq!(arg(&s, "--kv-lora-rank"), Some("512"));
        assert_eq!(arg(&s, "--qk-head-dim"), Some("128"));
        assert_eq!(arg(&s, "--qk-pos-emb-head-dim"), Some("64"));
        assert_eq!(arg(&s, "--v-head-dim"), Some("128"));
        // DeepSeek's norms of the compressed queries and keys (q_a_ and kv_a_layernorm).
        assert_eq!(arg(&s, "--qk-layernorm"), Some(""));
        assert_eq!(arg(&s, "--mtp-num-layers"), Some("1"));
        // Sigmoid scores with the balancing bias, a token's experts from 4 of 8 groups.
        assert_eq!(arg(&s, "--moe-router-score-function"), Some("sigmoid"));
        assert_eq!(arg(&s, "--moe-router-enable-expert-bias"), Some(""));
        assert_eq!(arg(&s, "--moe-router-num-groups"), Some("8"));
        assert_eq!(arg(&s, "--moe-router-group-topk"), Some("4"));
        assert_eq!(arg(&s, "--moe-router-topk-scaling-factor"), Some("2.5"));
        assert_eq!(arg(&s, "--moe-router-pre-softmax"), None);
        assert_eq!(
            arg(&s, "--moe-layer-freq").map(|f| f.matches('0').count()),
            Some(3)
        );
        let want = format!("\"Et|{}mL\"", "tt|".repeat(30));
        assert_eq!(
            arg(&s, "--pipeline-model-parallel-layout"),
            Some(want.as_str())
        );
        assert_eq!(arg(&s, "--num-layers-per-virtual-pipeline-stage"), None);
        assert_eq!(arg(&s, "--ffn-hidden-size"), Some("18432"));
    }

    #[test]
    fn megatron_runs_a_hybrid_stack_with_its_pattern_split_at_the_stages() {
        // Nemotron 3 Nano over two uneven pipeline stages: the pattern's `|` places them.
        let m = model("nemotron-h");
        let mut l = Layout {
            dp: 8,
            pp: 2,
            ep: 8,
            zero_stage: 1,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        l.stages = crate::search::stage_ranges(&[27, 25]);
        l.validate(1024, Some(52)).unwrap();
        assert!(Engine::Megatron.supports(&l, &m, Precision::Bf16).is_none());
        let s = export(Engine::Megatron, &plan(l.clone(), Precision::Bf16), &m).unwrap();
        assert!(s.contains(" pretrain_hybrid.py \\\n"), "{s}");
        let pattern = &m.hybrid.as_ref().unwrap().pattern;
        let want = format!("\"{}|{}\"", &pattern[..27], &pattern[27..]);
        assert_eq!(arg(&s, "--hybrid-layer-pattern"), Some(want.as_str()));
        for (flag, value) in [
            ("--mamba-num-heads", "64"),
            ("--mamba-head-dim", "64"),
            ("--mamba-state-dim", "128"),
            ("--mamba-num-groups", "8"),
            ("--position-embedding-type", "none"),
            ("--kv-channels", "128"),
            ("--squared-relu", ""),
            ("--moe-shared-expert-intermediate-size", "3712"),
        ] {
            assert_eq!(arg(&s, flag), Some(value), "{flag}");
        }
        // Megatron refuses these beside a hybrid pattern.
        for flag in [
            "--account-for-embedding-in-pipeline-split",
            "--pipeline-model-parallel-layout",
            "--num-layers-per-virtual-pipeline-stage",
        ] {
            assert_eq!(arg(&s, flag), None, "{flag}");
        }
        for engine in [Engine::DeepSpeed, Engine::Torchtitan] {
            let why = engine.supports(&l, &m, Precision::Bf16).unwrap();
            assert!(why.contains("hybrid"), "{why}");
        }
    }

    #[test]
    fn megatron_arguments_carry_sliding_windows_and_attention_biases() {
        // gpt-oss-120b: a 128-token window on every other layer, full attention on the rest.
        let m = model("gpt-oss-120b");
        let l = Layout {
            dp: 16,
            pp: 4,
            ep: 8,
            zero_stage: 1,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let s = export(Engine::Megatron, &plan(l, Precision::Bf16), &m).unwrap();
        assert_eq!(arg(&s, "--window-size"), Some("128,0"));
        assert_eq!(arg(&s, "--window-attn-skip-freq"), Some("2"));
        assert_eq!(arg(&s, "--kv-channels"), Some("64"));
        assert_eq!(arg(&s, "--disable-bias-linear"), None);
        // Its attention sinks: Megatron's learnable softmax offset; none for other models.
        assert_eq!(arg(&s, "--softmax-type"), Some("learnable"));
        // Its clamped gate: Megatron's quick GeGLU, not SwiGLU.
        assert!(
            s.contains("--quick-geglu") && !s.contains("--swiglu"),
            "{s}"
        );
        let llama = export(
            Engine::Megatron,
            &plan(
                Layout {
                    dp: 8,
                    ..Layout::default()
                },
                Precision::Bf16,
            ),
            &model("llama3-8b"),
        )
        .unwrap();
        assert_eq!(arg(&llama, "--softmax-type"), None);
        assert_eq!(arg(&llama, "--qk-layernorm"), None);
    }

    #[test]
    fn engines_refuse_what_they_cannot_run() {
        let m = model("llama3-70b");
        // Named submodules are Megatron-Core's `--recompute-modules`; the others refuse them.
        let modules = Layout {
            dp: 16,
            tp: 8,
            pp: 4,
            sequence_parallel: true,
            schedule: Schedule::OneFOneB,
            recompute: "modules:moe_act+layernorm".parse().unwrap(),
            ..Layout::default()
        };
        let args = export(
            Engine::Megatron,
            &plan(modules.clone(), Precision::Bf16),
            &m,
        )
        .unwrap();
        assert!(
            args.contains("--recompute-granularity selective")
                && args.contains("--recompute-modules layernorm moe_act"),
            "{args}"
        );
        for e in [Engine::DeepSpeed, Engine::Torchtitan] {
            let err = export(e, &plan(modules.clone(), Precision::Bf16), &m).unwrap_err();
            assert!(
                err.to_string().contains("modules:layernorm+moe_act"),
                "{e}: {err}"
            );
        }
        // ALiBi (BLOOM's) is neither Megatron's nor torchtitan's; DeepSpeed's config carries
        // no model code.
        let alibi = TransformerConfig {
            position: Position::Alibi,
            ..m.clone()
        };
        let tp8 = Layout {
            dp: 16,
            tp: 8,
            ..Layout::default()
        };
        for e in [Engine::Megatron, Engine::Torchtitan] {
            let err = export(e, &plan(tp8.clone(), Precision::Bf16), &alibi).unwrap_err();
            assert!(err.to_string().contains("no ALiBi"), "{e}: {err}");
        }
        export(Engine::DeepSpeed, &plan(tp8, Precision::Bf16), &alibi).unwrap();
        let zb = Layout {
            dp: 16,
            tp: 8,
            pp: 4,
            schedule: Schedule::ZeroBubbleH1,
            ..Layout::default()
        };
        for e in Engine::ALL {
            let err = export(e, &plan(zb.clone(), Precision::Bf16), &m).unwrap_err();
            assert!(err.to_string().contains("zb-h1"), "{err}");
        }
        // 80 layers over 4 stages of 3 virtual stages each: torchtitan splits them unevenly,
        // Megatron-LM cannot.
        let uneven = Layout {
            dp: 16,
            tp: 8,
            pp: 4,
            zero_stage: 3,
            schedule: Schedule::Interleaved1F1B,
            interleave: 3,
            ..Layout::default()
        };
        let err = export(Engine::Megatron, &plan(uneven.clone(), Precision::Bf16), &m).unwrap_err();
        assert!(err.to_string().contains("evenly over pp × v = 12"), "{err}");
        // torchtitan is told the simulated split module by module: 6 layers a chunk, the 8 left
        // over to middle chunks (the first and last hold the embedding and the head).
        let v: toml::Table = export(
            Engine::Torchtitan,
            &plan(uneven.clone(), Precision::Bf16),
            &m,
        )
        .unwrap()
        .parse()
        .unwrap();
        let parts = v["parallelism"]["module_fqns_per_model_part"]
            .as_array()
            .unwrap();
        let layers_in = |i: usize| {
            parts[i]
                .as_array()
                .unwrap()
                .iter()
                .filter(|x| x.as_str().unwrap().starts_with("layers."))
                .count() as u32
        };
        let counts: Vec<u32> = (0..parts.len()).map(layers_in).collect();
        assert_eq!(counts, parallax_sim::stage_layers(80, &uneven));
        assert_eq!(counts.iter().sum::<u32>(), 80);
        assert_eq!("DeepSpeed".parse::<Engine>(), Ok(Engine::DeepSpeed));
        assert!("jax".parse::<Engine>().is_err());
        assert_eq!(
            "torchtitan@v0.2.2".parse::<Engine>(),
            Ok(Engine::Torchtitan)
        );
        assert_eq!("torchtitan@0.1.0".parse::<Engine>(), Ok(Engine::Torchtitan));
        for newer in [
            "torchtitan@0.2.3",
            "torchtitan@0.3.0",
            "torchtitan@head",
            "torchtitan@1.0",
        ] {
            let e = newer.parse::<Engine>().unwrap_err();
            assert!(e.contains("Python config modules"), "{e}");
        }
        assert!("megatron@0.9".parse::<Engine>().is_err());
    }
}
