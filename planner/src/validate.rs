//! Scoring predictions against published measurements of real training runs: transformers
//! with their dimensions (`parallax-validation-cases/1`, see `shared/ground-truth/README.md`)
//! and any zoo model with its published software stack (`parallax-validation-cases/2`,
//! [`crate::general_cases`]).

use crate::complete::{complete_or_smallest, layout_string};
use crate::ds_config::DsConfig;
pub use crate::framework::Framework;
pub use crate::general_cases::{GeneralCase, GENERAL_CASES_SCHEMA};
use crate::search::Space;
use parallax_cost::memory::CUDA_CONTEXT_GIB;
use parallax_cost::transformer::{CrossEntropy, RecomputeModules, Runtime, Setup, TpOverlap};
use parallax_hardware::{Cluster, ClusterProfile};
use parallax_ir::models::{
    HybridConfig, MambaConfig, MlaConfig, Mlp, MoeConfig, Position, Router, SlidingWindow,
    TransformerConfig,
};
use parallax_ir::{Fp8Recipe, PartialLayout, Precision, Recompute, Schedule};
use rayon::prelude::*;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Schema tag of case files.
pub const CASES_SCHEMA: &str = "parallax-validation-cases/1";

/// Schema `/1` extended with what MoE, ZeRO/FSDP and offload runs publish (attention and MoE
/// shape, expert parallelism, FSDP, offload, the fp8 recipe, the stack as `name@version`):
/// read into the same cases, each extension either modelled or named when a case is skipped.
pub const CASES_SCHEMA_1_1: &str = "parallax-validation-cases/1.1";

/// A case file of either schema.
#[derive(Clone, Debug)]
pub struct CaseFile {
    pub schema: String,
    pub cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Head {
    schema: String,
}

#[derive(Deserialize)]
struct Cases<C> {
    cases: Vec<C>,
}

/// One published run of either schema.
#[derive(Clone, Debug)]
pub enum Case {
    Transformer(TransformerCase),
    General(GeneralCase),
}

/// What both schemas record of a run.
struct Shared<'a> {
    id: &'a str,
    group: &'a str,
    source: &'a str,
    measured: &'a Measured,
    cluster: &'a CaseCluster,
}

impl Case {
    fn shared(&self) -> Shared<'_> {
        macro_rules! shared {
            ($c:expr) => {
                Shared {
                    id: &$c.id,
                    group: &$c.group,
                    source: &$c.source,
                    measured: &$c.measured,
                    cluster: &$c.cluster,
                }
            };
        }
        match self {
            Case::Transformer(c) => shared!(c),
            Case::General(c) => shared!(c),
        }
    }

    pub fn id(&self) -> &str {
        self.shared().id
    }

    pub fn group(&self) -> &str {
        self.shared().group
    }

    /// The publication.
    pub fn source(&self) -> &str {
        self.shared().source
    }

    /// The stack the case is predicted on: the row of the table its `framework` field names
    /// (as `name@version (as row)` where they differ), or the fallback for one the table does
    /// not hold.
    pub fn stack(&self) -> String {
        match self {
            Case::Transformer(c) => c.framework().name,
            Case::General(c) => c.framework().name,
        }
    }

    /// Predicts a transformer case as run on `spec` instead of the stack it names
    /// (`validate --framework`); a case of any other model keeps its own, which also names
    /// the model variant it ran.
    pub fn set_framework(&mut self, spec: &str) {
        if let Case::Transformer(c) = self {
            c.framework = Some(spec.to_string());
        }
    }

    /// Whether the run's attention was a fused kernel (what the attention efficiency scale
    /// is fitted to).
    pub fn fused_attention(&self) -> bool {
        match self {
            Case::Transformer(c) => c.framework().runtime.fused_attention,
            Case::General(c) => c.fused_attention(),
        }
    }

    /// What was measured.
    pub fn measured(&self) -> &Measured {
        self.shared().measured
    }

    /// Refuses what no run can have measured: a non-positive time or memory, no GPUs, a
    /// preset parallax does not know (a case out of the model's reach is skipped instead).
    fn check(&self, file: &str) -> Result<(), CaseError> {
        let err = |field, problem: String| CaseError::Field {
            file: file.into(),
            id: self.id().into(),
            field,
            problem,
        };
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let m = self.measured();
        if !positive(m.step_time_s) {
            return Err(err(
                "measured.step_time_s",
                format!("must be a positive number, got {}", m.step_time_s),
            ));
        }
        if let Some(g) = m.peak_memory_gib.filter(|g| !positive(*g)) {
            return Err(err(
                "measured.peak_memory_gib",
                format!("must be a positive number, got {g}"),
            ));
        }
        if self.shared().cluster.gpus == 0 {
            return Err(err("cluster.gpus", "must be at least 1".into()));
        }
        if let Err(e) = parallax_hardware::preset(self.preset()) {
            return Err(err("cluster.preset", e.to_string()));
        }
        if let Case::Transformer(c) = self {
            // A model or layout no run can have had is refused; a well-formed one out of the
            // planner's reach is skipped when scored.
            if c.unmodelled().is_none() {
                c.transformer().map_err(|e| err("model", e))?;
            }
            let p = &c.plan;
            c.try_framework().map_err(|e| err(CASE_DS_CONFIG, e))?;
            if let Some(z) = p.zero_stage.filter(|z| *z > 3) {
                return Err(err("plan.zero_stage", format!("{z} must be 0, 1, 2 or 3")));
            }
            if p.global_batch == 0 {
                return Err(err("plan.global_batch", "must be at least 1".into()));
            }
            let degrees = [("tp", p.tp), ("pp", p.pp), ("dp", p.dp), ("cp", p.cp)];
            let mut product = 1u64;
            for (k, d) in degrees {
                match d {
                    Some(0) => return Err(err("plan", format!("{k} must be at least 1"))),
                    Some(d) => product = product.saturating_mul(u64::from(d)),
                    None => {}
                }
            }
            let gpus = u64::from(c.cluster.gpus);
            if gpus % product != 0 || (degrees.iter().all(|(_, d)| d.is_some()) && product != gpus)
            {
                return Err(err(
                    "plan",
                    format!("the published degrees (product {product}) do not make up {gpus} GPUs"),
                ));
            }
        }
        Ok(())
    }

    /// The hardware preset it ran on.
    pub fn preset(&self) -> &str {
        &self.shared().cluster.preset
    }

    /// Predicts the case.
    pub fn run(&self) -> CaseResult {
        self.run_with(&|_| {})
    }

    /// [`Case::run`] on a profile changed by `adjust` first (for fitting parameters).
    pub fn run_with(&self, adjust: &(dyn Fn(&mut ClusterProfile) + Sync)) -> CaseResult {
        let prediction = match self {
            Case::Transformer(c) => c.predict(adjust),
            Case::General(c) => c.predict(adjust),
        };
        CaseResult::scored(self, prediction)
    }
}

/// One published transformer run with its dimensions (schema `/1` and `/1.1`).
#[derive(Clone, Debug, Deserialize)]
pub struct TransformerCase {
    pub id: String,
    #[serde(default)]
    pub source: String,
    /// The stack that ran it, `name@version (detail)` (`/1.1`).
    #[serde(default)]
    pub framework: Option<String>,
    pub cluster: CaseCluster,
    pub precision: Precision,
    pub model: CaseModel,
    pub plan: CasePlan,
    pub measured: Measured,
    /// What the source published beside the step time (`/1.1`): its utilisation figures.
    #[serde(default)]
    pub published: Option<Box<Published>>,
    #[serde(default)]
    pub group: String,
}

/// A case's published utilisation, where given: model FLOPs (MFU) and hardware FLOPs (HFU,
/// recomputation counted) over the peak.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Published {
    #[serde(default)]
    pub mfu: Option<f64>,
    #[serde(default)]
    pub hfu: Option<f64>,
}

/// The cluster of a case.
#[derive(Clone, Debug, Deserialize)]
pub struct CaseCluster {
    pub preset: String,
    pub gpus: u32,
}

/// The model dimensions of a case. Unknown keys are refused: a misspelt optional key
/// (`kv_head`) would otherwise silently change the prediction.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseModel {
    #[serde(default)]
    pub name: String,
    pub arch: String,
    pub layers: u32,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: Option<u64>,
    pub ffn_hidden: u64,
    pub seq_len: u64,
    pub vocab: u64,
    pub mlp: Option<String>,
    /// `/1.1`: attention shape; `head_dim` where heads × head_dim ≠ hidden.
    #[serde(default)]
    pub attention: Option<Box<CaseAttention>>,
    /// `/1.1`: mixture-of-experts shape.
    #[serde(default)]
    pub moe: Option<Box<CaseMoe>>,
    /// `/1.1`: a Mamba/attention hybrid's layer pattern.
    #[serde(default)]
    pub hybrid: Option<Box<CaseHybrid>>,
    /// `/1.1`: multi-token prediction modules trained in the run.
    #[serde(default)]
    pub mtp: Option<CaseMtp>,
    /// `/1.1`, informational: parameter counts and where the shape comes from.
    #[serde(default)]
    pub params_b: Option<f64>,
    #[serde(default)]
    pub active_params_b: Option<f64>,
    #[serde(default)]
    pub shape_source: Option<IgnoredAny>,
    #[serde(default)]
    pub hf_config: Option<IgnoredAny>,
    #[serde(default)]
    pub hf_config_source: Option<IgnoredAny>,
    #[serde(default)]
    pub hf_config_note: Option<IgnoredAny>,
}

/// A Mamba/attention hybrid of a `/1.1` case: its layer pattern (Megatron's
/// `--hybrid-override-pattern` symbols) and its Mamba-2 mixers.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseHybrid {
    pub pattern: String,
    pub mamba: CaseMamba,
    /// Informational: what the symbols mean and how many of each there are.
    #[serde(default)]
    pub legend: Option<IgnoredAny>,
    #[serde(default)]
    pub counts: Option<IgnoredAny>,
}

/// The Mamba-2 mixers of a hybrid case.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseMamba {
    pub heads: u64,
    pub head_dim: u64,
    pub state_dim: u64,
    pub groups: u64,
    #[serde(default)]
    pub conv_kernel: Option<u64>,
    #[serde(default)]
    pub chunk_size: Option<u64>,
}

/// The multi-token prediction of a `/1.1` case.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseMtp {
    pub layers: u32,
    #[serde(default)]
    pub note: Option<IgnoredAny>,
}

/// The attention of a `/1.1` case.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseAttention {
    /// `mha`, `gqa` or `mla`.
    pub kind: String,
    pub head_dim: Option<u64>,
    /// Multi-head latent attention's ranks and head widths (DeepSeek-V2/V3).
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: Option<u64>,
    pub qk_nope_head_dim: Option<u64>,
    pub qk_rope_head_dim: Option<u64>,
    pub v_head_dim: Option<u64>,
    pub qk_norm: Option<bool>,
    pub bias: Option<bool>,
    pub sinks: Option<bool>,
    pub sliding_window: Option<CaseWindow>,
    pub position_embedding: Option<String>,
}

/// A `/1.1` case's sliding-window attention: the window and, in words, which layers use it
/// (`all`, or `alternating…`: every other layer, the second of each pair attending fully).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseWindow {
    pub size: u64,
    pub layers: String,
}

/// The mixture of experts of a `/1.1` case.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseMoe {
    pub experts: u64,
    pub top_k: u64,
    pub expert_ffn_hidden: Option<u64>,
    pub shared_experts: Option<u64>,
    pub shared_expert_ffn_hidden: Option<u64>,
    pub dense_layers_first: Option<u32>,
    pub dense_ffn_hidden: Option<u64>,
    pub moe_layer_frequency: Option<u32>,
    pub router: Option<String>,
    pub router_detail: Option<IgnoredAny>,
    pub dropless: Option<bool>,
    pub capacity_factor: Option<f64>,
    pub min_capacity: Option<u64>,
    pub routing: Option<String>,
    pub expert_activation: Option<String>,
    pub latent_size: Option<u64>,
}

/// What a `/1.1` run offloaded to the host or NVMe.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseOffload {
    pub optimizer: Option<String>,
    pub params: Option<String>,
    pub optimizer_step: Option<String>,
}

/// The published layout; `None` where the source did not say. Unknown keys are refused.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CasePlan {
    pub tp: Option<u32>,
    pub pp: Option<u32>,
    pub dp: Option<u32>,
    pub cp: Option<u32>,
    pub zero_stage: Option<u8>,
    pub micro_batch: Option<u64>,
    pub global_batch: u64,
    pub recompute: Option<Recompute>,
    pub sequence_parallel: Option<bool>,
    pub interleave: Option<u32>,
    pub schedule: Option<Schedule>,
    /// `/1.1`: expert parallelism and expert tensor parallelism.
    #[serde(default)]
    pub ep: Option<u32>,
    #[serde(default)]
    pub etp: Option<u32>,
    /// `/1.1`: FSDP (parameters, gradients and optimizer states sharded: ZeRO-3).
    #[serde(default)]
    pub fsdp: Option<bool>,
    /// `/1.1`: micro-batches per optimizer step (follows from the batch sizes).
    #[serde(default)]
    pub grad_accum: Option<u64>,
    #[serde(default)]
    pub recompute_detail: Option<String>,
    /// `/1.1`: what was offloaded (not modelled yet: such a case is skipped).
    #[serde(default)]
    pub offload: Option<Box<CaseOffload>>,
    /// `/1.1`: fp8 scaling recipe, as published (free text: [`Fp8Recipe::from_published`]
    /// reads the recipe it names; the stack's own where it names none).
    #[serde(default)]
    pub fp8_recipe: Option<String>,
    /// Tensor parallelism was asynchronous (PyTorch's micro-pipelined TP; parallax's own
    /// field, absent from the shared schema: false).
    #[serde(default)]
    pub async_tp: Option<bool>,
    /// The module code ran under `torch.compile` (parallax's own field, absent from the shared
    /// schema: the stack's default, e.g. eager torchtitan unless fp8 or asynchronous TP).
    #[serde(default)]
    pub compile: Option<bool>,
    /// The keys of the run's DeepSpeed config that set its stack up (parallax's own field,
    /// absent from the shared schema: DeepSpeed's defaults): read as `--ds-config` reads a
    /// file, its overlap, reduce type and ZeRO sizes applied to the case's DeepSpeed stack
    /// ([`Framework::with_ds_config`]); the layout stays the plan's.
    #[serde(default)]
    pub ds_config: Option<Box<serde_json::Value>>,
}

/// Where a case's `plan.ds_config` is named in errors and stack names.
const CASE_DS_CONFIG: &str = "plan.ds_config";

/// What was measured.
#[derive(Clone, Debug, Deserialize)]
pub struct Measured {
    pub step_time_s: f64,
    pub peak_memory_gib: Option<f64>,
    /// What the memory figure counts, in the source's words (the schema's `memory_kind`);
    /// absent: what the allocator reserved, the case files' documented default.
    #[serde(default)]
    pub memory_kind: Option<String>,
}

/// What a published peak-memory figure counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryKind {
    /// The live tensors: PyTorch's `max_memory_allocated`.
    Allocated,
    /// What the caching allocator reserved: `max_memory_reserved` (torchtitan's and the case
    /// files' `peak_memory_gib`).
    #[default]
    Reserved,
    /// What `nvidia-smi` shows as used: the reserve plus the CUDA context
    /// ([`CUDA_CONTEXT_GIB`]).
    DeviceUsed,
}

impl MemoryKind {
    /// The kind a case's `memory_kind` text names ("nvidia-smi used (allocator reserve + CUDA
    /// context)", "torch.cuda.max_memory_allocated", …); none: reserved.
    pub fn from_published(text: Option<&str>) -> MemoryKind {
        let t = text.unwrap_or("").to_ascii_lowercase();
        if t.contains("nvidia-smi") {
            MemoryKind::DeviceUsed
        } else if t.contains("allocated") {
            MemoryKind::Allocated
        } else {
            MemoryKind::Reserved
        }
    }

    /// The kind in words.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Allocated => "allocated",
            MemoryKind::Reserved => "reserved",
            MemoryKind::DeviceUsed => "nvidia-smi used",
        }
    }

    /// What this kind would read of a predicted peak: `allocated` live tensors, `reserved` by
    /// the allocator (GiB).
    pub fn read(self, allocated: f64, reserved: f64) -> f64 {
        match self {
            MemoryKind::Allocated => allocated,
            MemoryKind::Reserved => reserved,
            MemoryKind::DeviceUsed => reserved + CUDA_CONTEXT_GIB,
        }
    }
}

/// Why a case file could not be read.
#[derive(Debug, Error)]
pub enum CaseError {
    #[error("{file}: line {line} column {column}: {message}")]
    Json {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{file}: case '{id}': {field}: {problem}")]
    Field {
        file: String,
        id: String,
        field: &'static str,
        problem: String,
    },
    #[error("{file}: cases: the list is empty")]
    Empty { file: String },
    #[error("{file}: schema: expected \"{CASES_SCHEMA}\", \"{CASES_SCHEMA_1_1}\" or \"{GENERAL_CASES_SCHEMA}\" (or a later minor revision of one), found \"{found}\"")]
    Schema { file: String, found: String },
}

/// Parses a case file of either schema; `file` names it in errors.
pub fn parse_cases(text: &str, file: &str) -> Result<CaseFile, CaseError> {
    fn parse<T: serde::de::DeserializeOwned>(text: &str, file: &str) -> Result<T, CaseError> {
        serde_json::from_str(text).map_err(|e| CaseError::Json {
            file: file.into(),
            line: e.line(),
            column: e.column(),
            message: parallax_ir::plan::json_message(&e),
        })
    }
    let schema = parse::<Head>(text, file)?.schema;
    // A later minor revision of a schema (`/1.2`, `/2.1`) is read by its major's reader: its
    // additions are values the reader knows or fields it refuses by name.
    let major = schema
        .strip_prefix("parallax-validation-cases/")
        .and_then(|v| {
            let (major, minor) = v.split_once('.').unwrap_or((v, "0"));
            minor.parse::<u32>().ok().map(|_| major)
        });
    let cases: Vec<Case> = match major {
        Some("1") => parse::<Cases<TransformerCase>>(text, file)?
            .cases
            .into_iter()
            .map(Case::Transformer)
            .collect(),
        Some("2") => parse::<Cases<GeneralCase>>(text, file)?
            .cases
            .into_iter()
            .map(Case::General)
            .collect(),
        _ => {
            return Err(CaseError::Schema {
                file: file.into(),
                found: schema,
            })
        }
    };
    if cases.is_empty() {
        return Err(CaseError::Empty { file: file.into() });
    }
    for c in &cases {
        c.check(file)?;
    }
    Ok(CaseFile { schema, cases })
}

/// The outcome of one case.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CaseResult {
    pub id: String,
    pub group: String,
    pub measured_step_time_s: f64,
    pub predicted_step_time_s: Option<f64>,
    pub ape: Option<f64>,
    pub measured_peak_memory_gib: Option<f64>,
    /// The prediction of what the source measured ([`MemoryKind`]).
    pub predicted_peak_memory_gib: Option<f64>,
    pub memory_ape: Option<f64>,
    /// What the measured memory counts.
    pub memory_kind: MemoryKind,
    /// `ok`, or `skipped: reason`.
    pub status: String,
    /// The layout used (published knobs plus the chosen ones).
    pub layout: Option<String>,
    /// The stack it was predicted on ([`Case::stack`]).
    pub framework: String,
}

/// Summary over cases (errors as fractions).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub n: usize,
    pub mape: f64,
    pub median_ape: f64,
    pub max_ape: f64,
    pub memory_n: usize,
    pub memory_mape: f64,
    pub skipped: usize,
}

impl TransformerCase {
    /// Why the published run is out of the model's reach, naming the field: an MoE, attention,
    /// hybrid or offload feature parallax does not model yet. Such a case is skipped with
    /// this reason (not refused: the run is real).
    pub fn unmodelled(&self) -> Option<String> {
        let m = &self.model;
        if m.arch == "nemotron-h" && m.hybrid.is_none() {
            return Some("model.hybrid: a nemotron-h case needs its layer pattern".into());
        }
        None
    }

    /// The model the case describes.
    pub fn transformer(&self) -> Result<TransformerConfig, String> {
        let m = &self.model;
        let kv = m.kv_heads.unwrap_or(m.heads);
        let mut cfg = match m.arch.as_str() {
            "gpt" => TransformerConfig::gpt(
                m.layers,
                m.hidden,
                m.heads,
                m.ffn_hidden,
                m.vocab,
                m.seq_len,
            ),
            // A hybrid's attention, MLP and MoE layers are Llama-shaped (RMSNorm, no biases,
            // untied); its MLP kind, position embedding and pattern follow.
            "llama" | "nemotron-h" => TransformerConfig::llama(
                m.layers,
                m.hidden,
                m.heads,
                kv,
                m.ffn_hidden,
                m.vocab,
                m.seq_len,
            ),
            other => {
                return Err(format!(
                    "model.arch '{other}' is not gpt, llama or nemotron-h"
                ))
            }
        };
        cfg.kv_heads = kv;
        cfg.mlp = match m.mlp.as_deref() {
            Some("gelu") | None => cfg.mlp,
            // HuggingFace's eight-op tanh GeLU (GPT2Config's `activation_function`).
            Some("gelu_new") => Mlp::GeluNew,
            Some("swiglu") => Mlp::Swiglu,
            Some("relu") => Mlp::Relu,
            // Nemotron's squared ReLU, as Megatron-Core (`squared_relu`) and HuggingFace's
            // Nemotron config (`hidden_act: "relu2"`) spell it.
            Some("squared_relu" | "squared-relu" | "relu2") => Mlp::SquaredRelu,
            // A gated GeLU (Gemma) has SwiGLU's three GEMMs and one pointwise gate.
            Some("geglu") => Mlp::Swiglu,
            Some(other) => return Err(format!("model.mlp '{other}' is not supported")),
        };
        if let Some(d) = m.attention.as_ref().and_then(|a| a.head_dim) {
            cfg.head_dim = d;
        }
        match m
            .attention
            .as_ref()
            .and_then(|a| a.position_embedding.as_deref())
        {
            None => {}
            Some("none") => cfg.position = Position::None,
            Some("rope") => cfg.position = Position::Rope,
            Some("learned") => cfg.position = Position::Learned,
            Some("alibi") => cfg.position = Position::Alibi,
            Some(other) => {
                return Err(format!(
                    "model.attention.position_embedding '{other}' is none of rope, learned, alibi, none"
                ))
            }
        }
        if let Some(a) = &m.attention {
            if let Some(b) = a.bias {
                cfg.bias = b;
            }
            if let Some(sinks) = a.sinks {
                cfg.attention_sinks = sinks;
            }
            if let Some(qk) = a.qk_norm {
                // Latent attention's own norms are `mla`'s.
                cfg.qk_norm = qk && a.kind != "mla";
            }
            if let Some(w) = &a.sliding_window {
                let full_every = if w.layers.starts_with("alternating") {
                    2
                } else if w.layers == "all" {
                    0
                } else {
                    return Err(format!(
                        "model.attention.sliding_window.layers '{}' is neither 'all' nor 'alternating…'",
                        w.layers
                    ));
                };
                cfg.sliding_window = Some(SlidingWindow {
                    size: w.size,
                    full_every,
                });
            }
        }
        if let Some(h) = &m.hybrid {
            let mamba = &h.mamba;
            cfg.hybrid = Some(HybridConfig {
                pattern: h.pattern.clone(),
                mamba: MambaConfig {
                    heads: mamba.heads,
                    head_dim: mamba.head_dim,
                    state: mamba.state_dim,
                    groups: mamba.groups,
                    conv_kernel: mamba.conv_kernel.unwrap_or(4),
                    // Megatron-Core's `MambaMixer` default.
                    chunk: mamba.chunk_size.unwrap_or(128),
                },
            });
        }
        if let Some(a) = m.attention.as_ref().filter(|a| a.kind == "mla") {
            let need = |k: &str, v: Option<u64>| {
                v.ok_or_else(|| format!("model.attention.{k}: latent attention needs it"))
            };
            let mla = MlaConfig {
                q_lora_rank: a.q_lora_rank.unwrap_or(0),
                kv_lora_rank: need("kv_lora_rank", a.kv_lora_rank)?,
                qk_nope_head_dim: need("qk_nope_head_dim", a.qk_nope_head_dim)?,
                qk_rope_head_dim: need("qk_rope_head_dim", a.qk_rope_head_dim)?,
                v_head_dim: need("v_head_dim", a.v_head_dim)?,
            };
            cfg.head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
            cfg.kv_heads = cfg.heads;
            cfg.mla = Some(mla);
        }
        cfg.mtp_layers = m.mtp.as_ref().map_or(0, |t| t.layers);
        if let Some(moe) = &m.moe {
            // MoE layers route over the experts, each `expert_ffn_hidden` wide (`ffn_hidden`
            // of a model without dense layers), beside their shared experts; the leading and
            // in-between dense layers are `dense_ffn_hidden` wide.
            let shared = moe.shared_experts.unwrap_or(0);
            let expert = moe.expert_ffn_hidden.unwrap_or(m.ffn_hidden);
            let (first, every) = (
                moe.dense_layers_first.unwrap_or(0),
                moe.moe_layer_frequency.unwrap_or(1),
            );
            let dense = first > 0
                || every > 1
                || m.hybrid.as_ref().is_some_and(|h| h.pattern.contains('-'));
            let router = match moe.router.as_deref() {
                None => Router::Softmax,
                Some(r) => r.parse().map_err(|e| format!("model.moe.router {e}"))?,
            };
            // Token dropping: at the published capacity factor, or at 1 (Megatron-Core's
            // drop-and-pad recipes and DeepSpeed-MoE's default) where a run dropped tokens
            // without publishing it.
            let routing = moe.routing.as_deref().unwrap_or("");
            let capacity = match (moe.dropless, moe.capacity_factor) {
                (Some(true), _) => None,
                (_, Some(c)) => MoeConfig::capacity_permille_of(c),
                _ if routing.starts_with("token-drop") => Some(1000),
                _ => None,
            };
            cfg.moe = Some(MoeConfig {
                router,
                capacity_permille: capacity.unwrap_or(0),
                shared_ffn_hidden: shared * moe.shared_expert_ffn_hidden.unwrap_or(expert),
                dense_layers_first: first,
                every,
                dense_ffn_hidden: if dense {
                    moe.dense_ffn_hidden.unwrap_or(m.ffn_hidden)
                } else {
                    0
                },
                // LatentMoE: the experts' width (a latent as wide as the model is none).
                latent: match moe.latent_size {
                    None => 0,
                    Some(w) => MoeConfig::latent_of(w, m.hidden)
                        .ok_or_else(|| format!("model.moe.latent_size {w} is too large"))?,
                },
                ..MoeConfig::routed(moe.experts, moe.top_k)
            });
            cfg.ffn_hidden = expert;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// The published layout, with unpublished knobs left open (the stack's space limits them).
    pub fn partial_layout(&self) -> PartialLayout {
        let p = &self.plan;
        let recipe = self.moe_recipe();
        PartialLayout {
            dp: p.dp,
            tp: p.tp,
            pp: p.pp,
            cp: p.cp,
            // A dense model has no experts to split; an MoE run that did not publish its
            // expert parallelism leaves it open.
            ep: if self.model.moe.is_some() {
                p.ep
            } else {
                Some(1)
            },
            // Megatron-Core's default is tp; a run that did not publish it may have set it
            // lower (the folded layouts of the Qwen3 recipes need etp 1): left open.
            etp: if self.model.moe.is_some() {
                p.etp
            } else {
                None
            },
            // Not case fields: what the recipe behind the run set ([`MoeRecipe`]).
            dispatcher: Some(recipe.dispatcher),
            ep_overlap: Some(recipe.ep_overlap),
            zero_stage: if p.fsdp == Some(true) {
                Some(3)
            } else {
                p.zero_stage
            },
            micro_batch: p
                .micro_batch
                .or_else(|| self.bridge_recipe().and_then(|b| b.micro_batch)),
            recompute: self
                .recompute_modules()
                .map(Recompute::Modules)
                .or_else(|| self.block_recompute())
                .or(p.recompute),
            sequence_parallel: p.sequence_parallel,
            schedule: p.schedule,
            interleave: p.interleave,
            offload: Some(self.offload()),
            batch_norm: None,
        }
    }

    /// The token dispatcher and expert-parallel overlap the run used: those of its release's
    /// Megatron-Bridge performance recipe where [`BRIDGE_MOE_RECIPES`] has one for the model,
    /// Megatron-Core's defaults otherwise.
    fn moe_recipe(&self) -> MoeRecipe {
        self.bridge_recipe()
            .map_or(MoeRecipe::MEGATRON_DEFAULT, |b| b.recipe)
    }

    /// The Megatron-Bridge release that ran the case (`megatron-bridge@RELEASE`), if one did.
    fn bridge_release(&self) -> Option<&str> {
        self.framework
            .as_deref()
            .and_then(|f| f.strip_prefix("megatron-bridge@"))
    }

    /// The row of [`BRIDGE_MOE_RECIPES`] for the run's release and model, if any.
    fn bridge_recipe(&self) -> Option<&'static BridgeMoeRecipe> {
        let release = self.bridge_release()?;
        BRIDGE_MOE_RECIPES
            .iter()
            .find(|b| release.starts_with(b.release) && self.model.name.starts_with(b.model))
    }

    /// Whether Megatron-Bridge's performance scripts ran the case (its performance-summary
    /// runs): they accumulate and reduce gradients in bf16 (`grad_reduce_in_fp32: false` in
    /// every model's `scripts/performance/configs` at v0.1.0rc4 = 25.09;
    /// `cfg.ddp.grad_reduce_in_fp32 = False` at v0.2.1 = 25.11 and v0.4.2 = 26.04.01), where
    /// Megatron-Core keeps fp32 `main_grad` buffers for bf16 by default; and they run
    /// Transformer Engine's fused cross-entropy (`cross_entropy_fusion_impl: "te"` in the
    /// same configs at v0.1.0rc4, `utils/helpers.py` at v0.2.1, `utils/overrides.py` at
    /// v0.4.2, with `GPTModelProvider.cross_entropy_loss_fusion = True`).
    fn bridge_performance_run(&self) -> bool {
        self.bridge_release().is_some()
    }

    /// A selective policy that checkpoints whole blocks (IBM fms-fsdp's
    /// `selective_checkpointing`, a share of the blocks; the case's `recompute_detail` says
    /// so) recomputes every k-th layer, k from the published HFU over MFU: a recomputed block
    /// runs its forward again, a third of its training FLOPs, so the share is 3 · (HFU/MFU −
    /// 1). `None` where the case says otherwise or publishes no such pair.
    fn block_recompute(&self) -> Option<Recompute> {
        let whole_blocks = self.plan.recompute == Some(Recompute::Selective)
            && self
                .plan
                .recompute_detail
                .as_deref()
                .is_some_and(|d| d.to_ascii_lowercase().contains("block"));
        let p = self.published.as_ref()?;
        let (mfu, hfu) = (p.mfu?, p.hfu?);
        let share = 3.0 * (hfu / mfu - 1.0);
        (whole_blocks && mfu > 0.0 && share > 0.0).then(|| {
            match (1.0 / share.min(1.0)).round() as u32 {
                0 | 1 => Recompute::Full,
                k => Recompute::Every(k),
            }
        })
    }

    /// The submodules the run's recipe recomputes, where it names some and the case publishes
    /// no other recomputation: its selective recomputation is those.
    fn recompute_modules(&self) -> Option<RecomputeModules> {
        let names = self.bridge_recipe()?.recompute_modules;
        let open = matches!(self.plan.recompute, None | Some(Recompute::Selective));
        (open && !names.is_empty()).then(|| {
            RecomputeModules::parse(names).expect("BRIDGE_MOE_RECIPES names Megatron's modules")
        })
    }

    /// What the run offloaded: parameters (with the optimizer), the optimizer, or nothing;
    /// to NVMe where the case names it for what it offloaded (parameters in host memory with
    /// the optimizer on NVMe are taken as both in host memory).
    fn offload(&self) -> parallax_ir::Offload {
        use parallax_ir::Offload;
        fn on(d: &Option<String>) -> Option<&str> {
            d.as_deref().filter(|d| *d != "none")
        }
        let Some(o) = self.plan.offload.as_deref() else {
            return Offload::None;
        };
        let nvme = |d: &str| d.to_ascii_lowercase().contains("nvme");
        match (on(&o.params), on(&o.optimizer)) {
            (Some(p), _) if nvme(p) => Offload::ParamsNvme,
            (Some(_), _) => Offload::Params,
            (None, Some(d)) if nvme(d) => Offload::OptimizerNvme,
            (None, Some(_)) => Offload::Optimizer,
            (None, None) => Offload::None,
        }
    }

    /// Whether the benchmark spread tokens evenly over the experts (a fake-balanced gate that
    /// deals tokens out in turn): then no rank is a straggler. (A run that dropped tokens
    /// carries its capacity in the model: [`MoeConfig::capacity_permille`].) Megatron's forced
    /// load balancing (`--moe-router-force-load-balancing`, the "forced-balanced" of
    /// NVIDIA's tables) is not even: it routes on random logits (`apply_random_logits`,
    /// `moe_utils.py`), so each rank's load is a multinomial draw and the busiest rank
    /// receives its expected maximum like any random top-k routing.
    fn balanced_routing(&self) -> bool {
        self.model.moe.as_ref().is_some_and(|m| {
            m.routing
                .as_deref()
                .is_some_and(|r| r.starts_with("fake-balanced"))
        })
    }

    /// The stack that ran it: the row of [`crate::framework::STACKS`] its `framework` field
    /// names, or a current stack without framework-specific tricks where the table has none.
    pub fn framework(&self) -> Framework {
        // Checked when the file was read ([`Case::check`]).
        self.try_framework()
            .unwrap_or_else(|_| Framework::for_case(self.framework.as_deref()))
    }

    /// The stack with the case's `plan.ds_config` applied, read as `--ds-config` reads a file;
    /// a bad key, or a stack that reads no DeepSpeed config, is the error.
    fn try_framework(&self) -> Result<Framework, String> {
        let fw = Framework::for_case(self.framework.as_deref());
        match &self.plan.ds_config {
            Some(v) => fw
                .with_ds_config(&DsConfig::from_value(v)?, CASE_DS_CONFIG)
                .map_err(|e| e.to_string()),
            None => Ok(fw),
        }
    }

    /// Predicts the case on a profile changed by `adjust` first: null knobs are chosen as the
    /// fastest feasible values.
    fn predict(&self, adjust: &(dyn Fn(&mut ClusterProfile) + Sync)) -> Result<Predicted, String> {
        self.with_setup(adjust, |setup, partial, space| {
            complete_predicted(setup, partial, space)
        })?
    }

    /// Calls `f` with the step the case describes (its model, cluster, precision, stack and
    /// routing), its published knobs and the stack's options: what `TransformerCase::predict`
    /// completes and scores, and what `validate --explain` prints.
    pub fn with_setup<R>(
        &self,
        adjust: &(dyn Fn(&mut ClusterProfile) + Sync),
        f: impl FnOnce(&Setup, &PartialLayout, &Space) -> R,
    ) -> Result<R, String> {
        if let Some(why) = self.unmodelled() {
            return Err(why);
        }
        let fw = self.framework();
        let cfg = self.transformer()?;
        let cluster = self.cluster.build(adjust)?;
        let published = self.plan.fp8_recipe.as_deref();
        let setup = Setup {
            precision: self.precision,
            runtime: Runtime {
                fp8_recipe: published
                    .and_then(Fp8Recipe::from_published)
                    .unwrap_or(fw.runtime.fp8_recipe),
                tp_overlap: if self.plan.async_tp == Some(true) {
                    TpOverlap::MicroPipelined
                } else {
                    fw.runtime.tp_overlap
                },
                balanced_routing: self.balanced_routing(),
                compiled: fw.runtime.compiled || self.plan.compile == Some(true),
                grad_reduce_fp32: fw.runtime.grad_reduce_fp32 && !self.bridge_performance_run(),
                cross_entropy: if self.bridge_performance_run() {
                    CrossEntropy::TeFused
                } else {
                    fw.runtime.cross_entropy
                },
                ..fw.runtime
            },
            ..Setup::new(
                &cfg,
                &cluster.profile,
                cluster.gpus,
                self.model.seq_len,
                self.plan.global_batch,
            )
        };
        Ok(f(&setup, &self.partial_layout(), &fw.space))
    }
}

/// How an MoE run moved its tokens between expert-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeRecipe {
    pub dispatcher: parallax_ir::Dispatcher,
    /// Dispatch and combine overlapped with another micro-batch's computation
    /// (`overlap_moe_expert_parallel_comm`, Megatron-Core's combined 1F1B).
    pub ep_overlap: bool,
}

impl MoeRecipe {
    /// Megatron-Core's defaults: the all-to-all dispatcher
    /// (`moe_token_dispatcher_type = "alltoall"`), no combined-1F1B overlap.
    pub const MEGATRON_DEFAULT: MoeRecipe = MoeRecipe {
        dispatcher: parallax_ir::Dispatcher::AllToAll,
        ep_overlap: false,
    };
}

/// A Megatron-Bridge release's H100 performance recipe for one model family, where its token
/// dispatch departs from [`MoeRecipe::MEGATRON_DEFAULT`] or it names modules to recompute. The
/// published tables give the layout, not these settings; the release's scripts set them per
/// model (`NVIDIA-NeMo/Megatron-Bridge` at the tag
/// whose `docs/performance-summary.md` first carries the release's table).
#[derive(Debug)]
pub struct BridgeMoeRecipe {
    /// The NeMo container release (`megatron-bridge@RELEASE`, matched as a prefix).
    pub release: &'static str,
    /// The case's `model.name` starts with this.
    pub model: &'static str,
    pub recipe: MoeRecipe,
    /// The submodules the recipe recomputes (`recompute_modules`, Megatron-Core's names);
    /// empty where it sets none.
    pub recompute_modules: &'static [&'static str],
    /// The recipe's micro-batch size, where the case does not publish one.
    pub micro_batch: Option<u64>,
    pub source: &'static str,
}

/// The recipes that depart from Megatron-Core's defaults. Every other MoE run of these
/// releases dispatched with them: Qwen3 in 25.09 (`run_script.py` sets DeepEP and the overlap
/// for DeepSeek-V3 only; its Qwen3 configs recompute nothing), and so do GPT-OSS in 25.11 and
/// 26.04.01 (`moe_token_dispatcher_type = "alltoall"`, no `moe_a2a_overlap` in its H100
/// preset) and Nemotron 3 Nano in 26.04.01 (no flex backend in its H100 preset), whose rows
/// carry their recomputed modules only.
pub const BRIDGE_MOE_RECIPES: &[BridgeMoeRecipe] = &[
    BridgeMoeRecipe {
        release: "25.09",
        model: "DeepSeek-V3",
        recipe: MoeRecipe {
            dispatcher: parallax_ir::Dispatcher::DeepEp,
            ep_overlap: true,
        },
        recompute_modules: &["mla_up_proj", "mlp"],
        micro_batch: None,
        source: "scripts/performance/run_script.py @v0.1.0rc4: enable_deepep and A2A_1F1B \
                 (overlap_moe_expert_parallel_comm, delay_wgrad_compute) on h100",
    },
    BridgeMoeRecipe {
        release: "25.11",
        model: "Qwen3",
        recipe: MoeRecipe {
            dispatcher: parallax_ir::Dispatcher::AllToAll,
            ep_overlap: true,
        },
        recompute_modules: &[],
        micro_batch: None,
        source: "scripts/performance/configs/qwen3/workload_base_configs.py @v0.2.1: \
                 QWEN3_{30B_A3B,235B_A22B}_H100_FP8_CS_BASE_CONFIG moe_a2a_overlap=True",
    },
    BridgeMoeRecipe {
        release: "26.04",
        model: "Qwen3-235B",
        recipe: MoeRecipe {
            dispatcher: parallax_ir::Dispatcher::AllToAll,
            ep_overlap: true,
        },
        recompute_modules: &[],
        micro_batch: None,
        source: "scripts/performance/configs/qwen/qwen3_workload_base_configs.py @v0.4.2: \
                 QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2 moe_a2a_overlap=True; \
                 qwen3_llm_pretrain.py moe_token_dispatcher_type = \"alltoall\"",
    },
    BridgeMoeRecipe {
        release: "26.04",
        model: "Qwen3-30B",
        recipe: MoeRecipe {
            // HybridEP: a token crosses to each remote node its experts sit on once, then
            // fans out over NVLink, as DeepEP's inter-node kernels do.
            dispatcher: parallax_ir::Dispatcher::DeepEp,
            ep_overlap: false,
        },
        recompute_modules: &[],
        micro_batch: None,
        source: "scripts/performance/configs/qwen/qwen3_workload_base_configs.py @v0.4.2: \
                 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 moe_flex_dispatcher_backend=\"hybridep\", \
                 moe_a2a_overlap=False; qwen3_llm_pretrain.py moe_token_dispatcher_type = \"flex\"",
    },
    BridgeMoeRecipe {
        release: "25.11",
        model: "GPT-OSS",
        recipe: MoeRecipe::MEGATRON_DEFAULT,
        recompute_modules: &["layernorm", "moe_act"],
        micro_batch: Some(1),
        source: "scripts/performance/configs/gpt_oss/workload_base_configs.py @v0.2.1: \
                 GPT_OSS_120B_H100_BF16_BASE_CONFIG recompute_modules, \
                 BASE_GPT_OSS_120B_CONFIG micro_batch_size=1",
    },
    BridgeMoeRecipe {
        release: "26.04",
        model: "GPT-OSS",
        recipe: MoeRecipe::MEGATRON_DEFAULT,
        recompute_modules: &["layernorm", "moe_act"],
        micro_batch: None,
        source: "scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py @v0.4.2: \
                 GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2 recompute_modules",
    },
    BridgeMoeRecipe {
        release: "26.04",
        model: "Nemotron 3 Nano",
        recipe: MoeRecipe::MEGATRON_DEFAULT,
        recompute_modules: &["moe", "layernorm", "core_attn", "moe_act"],
        micro_batch: None,
        source: "scripts/performance/configs/nemotronh/nemotron_3_workload_base_configs.py \
                 @v0.4.2: NEMOTRON_3_NANO_PRETRAIN_CONFIG_H100_FP8_CS_V1 recompute_modules",
    },
];

/// A case's prediction.
pub(crate) struct Predicted {
    pub step_time_s: f64,
    /// Peak of the live tensors, GiB.
    pub peak_memory_gib: f64,
    /// Peak the caching allocator reserves, GiB.
    pub reserved_memory_gib: f64,
    /// The layout used (published knobs plus the chosen ones).
    pub layout: String,
}

/// The structured path's prediction of a transformer run: the fastest completion of `partial`
/// within the framework's options.
pub(crate) fn complete_predicted(
    setup: &Setup,
    partial: &PartialLayout,
    space: &Space,
) -> Result<Predicted, String> {
    // The run happened, so it fit: where the memory model says no completion does, the one it
    // finds smallest is predicted anyway, and the overshoot shows as the memory error rather
    // than hiding the step time.
    let (layout, chosen) =
        complete_or_smallest(setup, partial, space).map_err(|e| e.to_string())?;
    let (p, shown) = match chosen {
        Some(p) => (p, layout_string(&layout)),
        None => (
            parallax_sim::simulate_step(setup, &layout)
                .map_err(|e| e.to_string())?
                .prediction,
            format!("{} (over memory)", layout_string(&layout)),
        ),
    };
    Ok(Predicted {
        step_time_s: p.step_time_s,
        peak_memory_gib: p.peak_memory_gib,
        reserved_memory_gib: p.reserved_memory_gib,
        layout: shown,
    })
}

impl CaseCluster {
    /// The cluster of the case, its profile changed by `adjust`.
    pub(crate) fn build(
        &self,
        adjust: &(dyn Fn(&mut ClusterProfile) + Sync),
    ) -> Result<Cluster, String> {
        let mut c = Cluster::parse(&format!("{}:gpus={}", self.preset, self.gpus))
            .map_err(|e| e.to_string())?;
        adjust(&mut c.profile);
        Ok(c)
    }
}

impl CaseResult {
    /// The score of a prediction against what was measured; a prediction that failed is
    /// `skipped` with its reason.
    fn scored(case: &Case, prediction: Result<Predicted, String>) -> CaseResult {
        let m = case.measured();
        let mut r = CaseResult {
            id: case.id().into(),
            group: case.group().into(),
            measured_step_time_s: m.step_time_s,
            measured_peak_memory_gib: m.peak_memory_gib,
            memory_kind: MemoryKind::from_published(m.memory_kind.as_deref()),
            framework: case.stack(),
            ..CaseResult::default()
        };
        match prediction {
            Ok(p) => {
                r.predicted_step_time_s = Some(p.step_time_s);
                r.ape = Some((p.step_time_s - m.step_time_s).abs() / m.step_time_s);
                let predicted = r.memory_kind.read(p.peak_memory_gib, p.reserved_memory_gib);
                r.predicted_peak_memory_gib = Some(predicted);
                r.memory_ape = m.peak_memory_gib.map(|g| (predicted - g).abs() / g);
                r.layout = Some(p.layout);
                r.status = "ok".into();
            }
            Err(e) => r.status = format!("skipped: {e}"),
        }
        r
    }
}

/// Runs every case (in parallel) and summarizes.
pub fn validate(cases: &[Case]) -> (Vec<CaseResult>, Summary) {
    let results: Vec<CaseResult> = cases.par_iter().map(Case::run).collect();
    let summary = summarize(&results);
    (results, summary)
}

/// Summary statistics; skipped cases are counted, not scored.
pub fn summarize(results: &[CaseResult]) -> Summary {
    let mut apes: Vec<f64> = results.iter().filter_map(|r| r.ape).collect();
    apes.sort_by(f64::total_cmp);
    let mem: Vec<f64> = results.iter().filter_map(|r| r.memory_ape).collect();
    let n = apes.len();
    let median = match n {
        0 => 0.0,
        _ if n % 2 == 1 => apes[n / 2],
        _ => (apes[n / 2 - 1] + apes[n / 2]) / 2.0,
    };
    Summary {
        n,
        mape: if n > 0 {
            apes.iter().sum::<f64>() / n as f64
        } else {
            0.0
        },
        median_ape: median,
        max_ape: apes.last().copied().unwrap_or(0.0),
        memory_n: mem.len(),
        memory_mape: if mem.is_empty() {
            0.0
        } else {
            mem.iter().sum::<f64>() / mem.len() as f64
        },
        skipped: results.iter().filter(|r| r.ape.is_none()).count(),
    }
}

/// The text of `../shared/ground-truth/<name>` (beside the clone, as CI has it).
#[cfg(test)]
pub(crate) fn ground_truth_text(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/ground-truth")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: the tests read the published runs from ../shared beside the clone, as CI has it",
            path.display()
        )
    })
}

/// The published runs of `../shared/ground-truth/<name>`.
#[cfg(test)]
pub(crate) fn ground_truth(name: &str) -> Vec<Case> {
    parse_cases(&ground_truth_text(name), name).unwrap().cases
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A published memory figure is predicted as what it counts: the live tensors, the
    /// allocator's reserve (the default), or nvidia-smi's used memory, which adds the CUDA
    /// context the allocator does not see.
    #[test]
    fn memory_is_scored_as_the_source_measured_it() {
        let kind = |t: &str| MemoryKind::from_published(Some(t));
        assert_eq!(
            kind("nvidia-smi used (allocator reserve + CUDA context), MiB/1024"),
            MemoryKind::DeviceUsed
        );
        assert_eq!(
            kind("torch.cuda.max_memory_allocated()"),
            MemoryKind::Allocated
        );
        assert_eq!(kind("max_memory_reserved"), MemoryKind::Reserved);
        assert_eq!(MemoryKind::from_published(None), MemoryKind::Reserved);
        let (allocated, reserved) = (40.0, 43.0);
        assert_eq!(MemoryKind::Allocated.read(allocated, reserved), 40.0);
        assert_eq!(MemoryKind::Reserved.read(allocated, reserved), 43.0);
        let used = MemoryKind::DeviceUsed.read(allocated, reserved);
        assert!((used - 43.0 - CUDA_CONTEXT_GIB).abs() < 1e-12 && CUDA_CONTEXT_GIB > 0.5);
    }

    #[test]
    fn case_files_of_both_schemas_parse_and_others_are_refused() {
        let v1 = r#"{"schema": "parallax-validation-cases/1", "cases": []}"#;
        assert_eq!(
            parse_cases(v1, "a.json").unwrap_err().to_string(),
            "a.json: cases: the list is empty"
        );
        let case = |time: f64, preset: &str| {
            format!(
                r#"{{"schema": "parallax-validation-cases/2", "note": "", "fields": {{}}, "cases": [{{
                "id": "x", "framework": "pytorch-ddp", "model": {{"name": "resnet50"}},
                "cluster": {{"preset": "{preset}", "gpus": 1}}, "precision": "fp32",
                "plan": {{"dp": 1, "tp": 1, "pp": 1, "micro_batch": 32, "grad_accumulation": 1,
                          "global_batch": 32, "pipeline": null, "gradient_sync": null}},
                "measured": {{"step_time_s": {time}}}}}]}}"#
            )
        };
        let f = parse_cases(&case(0.1, "dgx1-v100-16gb"), "b.json").unwrap();
        assert_eq!(f.schema, GENERAL_CASES_SCHEMA);
        assert_eq!(f.cases[0].run().status, "ok");
        let e = parse_cases(&case(-1.4, "dgx1-v100-16gb"), "b.json").unwrap_err();
        assert_eq!(
            e.to_string(),
            "b.json: case 'x': measured.step_time_s: must be a positive number, got -1.4"
        );
        let e = parse_cases(&case(0.1, "dgx-z900"), "b.json").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("b.json: case 'x': cluster.preset: "),
            "{e}"
        );
        let e = parse_cases(r#"{"schema": "x/9", "cases": []}"#, "c.json")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("c.json: schema:") && e.contains("/2"), "{e}");
        // A later minor revision is read by its major's reader; another major, or a revision
        // that is not a number, is refused.
        let minor = case(0.1, "dgx1-v100-16gb").replace("cases/2\"", "cases/2.1\"");
        assert_eq!(parse_cases(&minor, "b.json").unwrap().cases.len(), 1);
        for bad in [
            "parallax-validation-cases/3",
            "parallax-validation-cases/2.x",
        ] {
            let text = case(0.1, "dgx1-v100-16gb").replace("parallax-validation-cases/2", bad);
            let e = parse_cases(&text, "c.json").unwrap_err().to_string();
            assert!(e.starts_with("c.json: schema:"), "{e}");
        }
        let e = parse_cases(
            r#"{"schema": "parallax-validation-cases/2", "cases": [{}]}"#,
            "d.json",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("d.json: line 1"), "{e}");
    }

    /// A case's `plan.ds_config` sets up its DeepSpeed stack as `--ds-config` would; a bad
    /// key, or a stack that reads none, is one line naming the case and the field.
    #[test]
    fn a_case_ds_config_sets_up_its_deepspeed_stack() {
        let case = |framework: &str, ds: &str| {
            format!(
                r#"{{"schema": "parallax-validation-cases/1", "cases": [{{
                "id": "x", "source": "s", "framework": "{framework}",
                "cluster": {{"preset": "dgx-a100-80gb", "gpus": 128}}, "precision": "fp16",
                "model": {{"name": "m", "arch": "gpt", "layers": 96, "hidden": 12288, "heads": 96,
                           "kv_heads": 96, "ffn_hidden": 49152, "vocab": 50257, "mlp": "gelu",
                           "seq_len": 1024}},
                "plan": {{"tp": 1, "pp": 1, "dp": 128, "cp": 1, "zero_stage": 3, "micro_batch": 1,
                          "global_batch": 128, "recompute": "full", "sequence_parallel": false,
                          "interleave": 1, "schedule": "none", "ds_config": {ds}}},
                "measured": {{"step_time_s": 10.0}}}}]}}"#
            )
        };
        let ok = case(
            "deepspeed@0.6.2",
            r#"{"zero_optimization": {"stage3_max_reuse_distance": 3e9}}"#,
        );
        let f = parse_cases(&ok, "f.json").unwrap();
        let Case::Transformer(t) = &f.cases[0] else {
            panic!()
        };
        let fw = t.framework();
        assert_eq!(fw.runtime.zero_config.max_reuse_distance, 3_000_000_000);
        assert!(
            fw.name.ends_with(", ds_config plan.ds_config"),
            "{}",
            fw.name
        );
        let predicted = t.predict(&|_| {}).unwrap().step_time_s;
        let at_default = case("deepspeed@0.6.2", "{}");
        let Case::Transformer(d) = &parse_cases(&at_default, "f.json").unwrap().cases[0] else {
            panic!()
        };
        // The recipe's reuse distance spares the 175B layers their third gather.
        assert!(predicted < d.predict(&|_| {}).unwrap().step_time_s);
        for (framework, ds, want) in [
            (
                "deepspeed@0.6.2",
                r#"{"zero_optimization": {"stage3_max_reuse_distance": "far"}}"#,
                "f.json: case 'x': plan.ds_config: zero_optimization.stage3_max_reuse_distance: expected a number",
            ),
            (
                "megatron-lm@2022",
                r#"{"zero_optimization": {"reduce_bucket_size": 5e7}}"#,
                "f.json: case 'x': plan.ds_config: megatron-lm@2022 reads no DeepSpeed config",
            ),
        ] {
            let e = parse_cases(&case(framework, ds), "f.json").unwrap_err().to_string();
            assert!(e.starts_with(want), "{e}");
        }
    }

    /// Each Megatron-Bridge MoE run is completed with its release's recipe: DeepSeek-V3's 25.09
    /// recipe runs DeepEP with the combined-1F1B overlap, the Qwen3 recipes overlap from 25.11,
    /// 26.04's Qwen3-30B dispatches through HybridEP; the rest keep Megatron-Core's defaults.
    #[test]
    fn megatron_bridge_moe_runs_use_their_release_recipe() {
        use parallax_ir::Dispatcher::{AllToAll, DeepEp};
        let cases = ground_truth("moe-zero-offload.json");
        let t = |id: &str| {
            let Some(Case::Transformer(t)) = cases.iter().find(|c| c.id() == id) else {
                panic!("{id}")
            };
            t
        };
        let recipe = |id: &str| {
            let p = t(id).partial_layout();
            (p.dispatcher.unwrap(), p.ep_overlap.unwrap())
        };
        assert_eq!(recipe("mb2509-dsv3-1024xh100-fp8"), (DeepEp, true));
        assert_eq!(recipe("mb2509-qwen3-30b-16xh100-fp8"), (AllToAll, false));
        assert_eq!(recipe("mb2511-qwen3-235b-256xh100-fp8cs"), (AllToAll, true));
        assert_eq!(recipe("mb2511-qwen3-30b-16xh100-fp8cs"), (AllToAll, true));
        assert_eq!(recipe("mb2511-gptoss-120b-64xh100-bf16"), (AllToAll, false));
        assert_eq!(recipe("mb260401-qwen3-235b-256xh100-fp8"), (AllToAll, true));
        assert_eq!(recipe("mb260401-qwen3-30b-16xh100-fp8"), (DeepEp, false));
        assert_eq!(
            recipe("mb260401-nemotron3nano-16xh100-fp8"),
            (AllToAll, false)
        );
        assert_eq!(
            recipe("mcore-moe-readme-mixtral8x7b-64xh100-bf16"),
            (AllToAll, false)
        );
        for r in BRIDGE_MOE_RECIPES {
            assert!(r.source.contains(" @v0."), "{r:?}");
            assert!(
                RecomputeModules::parse(r.recompute_modules).is_ok(),
                "{r:?}"
            );
        }
        // The recomputation a recipe names is the run's: its modules.
        let recompute = |id: &str| t(id).partial_layout().recompute;
        let modules =
            |names: &[&str]| Some(Recompute::Modules(RecomputeModules::parse(names).unwrap()));
        assert_eq!(
            recompute("mb2509-dsv3-1024xh100-fp8"),
            modules(&["mla_up_proj", "mlp"])
        );
        assert_eq!(
            recompute("mb2511-gptoss-120b-64xh100-bf16"),
            modules(&["layernorm", "moe_act"])
        );
        assert_eq!(
            recompute("mb2509-qwen3-30b-16xh100-fp8"),
            Some(Recompute::None)
        );
        // A recipe's micro-batch where the case leaves it out; bf16 gradients in every
        // performance-script run, fp32 ones (Megatron-Core's default for bf16) elsewhere.
        assert_eq!(
            t("mb2511-gptoss-120b-64xh100-bf16")
                .partial_layout()
                .micro_batch,
            Some(1)
        );
        let fp32_grads = |id: &str| {
            t(id)
                .with_setup(&|_| {}, |s, _, _| s.runtime.grad_reduce_fp32)
                .unwrap()
        };
        assert!(!fp32_grads("mb2509-dsv3-1024xh100-fp8"));
        let loss = |id: &str| {
            t(id)
                .with_setup(&|_| {}, |s, _, _| s.runtime.cross_entropy)
                .unwrap()
        };
        assert_eq!(loss("mb2509-qwen3-30b-16xh100-fp8"), CrossEntropy::TeFused);
        assert_eq!(
            loss("mcore-moe-readme-mixtral8x7b-64xh100-bf16"),
            CrossEntropy::VocabParallel
        );
        assert!(!fp32_grads("mb2511-llama3-8b-fsdp8-8xh100"));
        assert!(fp32_grads("mcore-moe-readme-mixtral8x7b-64xh100-bf16"));
    }

    /// The MoE, ZeRO and offload file (`/1.1`) is read whole: its runs are predicted or
    /// skipped with the field that is out of reach named, never refused.
    #[test]
    fn the_moe_zero_offload_file_is_read_and_every_case_predicted_or_named() {
        let cases = ground_truth("moe-zero-offload.json");
        assert_eq!(cases.len(), 24);
        let results: Vec<CaseResult> = cases.iter().map(Case::run).collect();
        for r in &results {
            assert!(
                r.status == "ok"
                    || ["model.", "plan.", "no layout", "no completion fits"]
                        .iter()
                        .any(|p| r.status.starts_with(&format!("skipped: {p}"))),
                "{}: {}",
                r.id,
                r.status
            );
        }
        let by_id = |id: &str| results.iter().find(|r| r.id == id).unwrap();
        // ZeRO-Offload's run is predicted with its optimizer on the host.
        let offload = by_id("ds-tut-zero-offload-gpt2-10b-1xv100");
        assert!(
            offload
                .layout
                .as_deref()
                .unwrap()
                .contains("zero=2,mb=10,recompute=full")
                && offload
                    .layout
                    .as_deref()
                    .unwrap()
                    .contains("offload=optimizer"),
            "{offload:?}"
        );
        // IBM fms-fsdp's "selective" checkpointing of whole blocks: HFU/MFU 0.59/0.51 on A100
        // and 0.40/0.35 on H100 say about half of the 13B's blocks recompute; the 34B's
        // 0.64/0.47 says all, as its plan states.
        for id in [
            "ibm-fsdp-llama2-13b-128xa100",
            "ibm-fsdp-llama2-13b-96xh100",
        ] {
            let l = by_id(id).layout.clone().unwrap();
            assert!(l.contains("recompute=every:2"), "{id}: {l}");
        }
        let l = by_id("ibm-fsdp-llama2-34b-128xa100")
            .layout
            .clone()
            .unwrap();
        assert!(l.contains("recompute=full"), "{l}");
        // Nemotron 3 Nano, a hybrid of Mamba-2, MoE and attention layers, with the published
        // expert parallelism and no attention position embedding.
        let nano = by_id("mb260401-nemotron3nano-16xh100-fp8");
        assert!(
            nano.status == "ok" && nano.layout.as_deref().unwrap().contains("ep=8"),
            "{nano:?}"
        );
        let hybrid = cases
            .iter()
            .find(|c| c.id() == "mb260401-nemotron3nano-16xh100-fp8")
            .unwrap();
        let Case::Transformer(t) = hybrid else {
            panic!("a transformer case")
        };
        let m = t.transformer().unwrap();
        assert_eq!(m.position, Position::None);
        assert_eq!(
            m.layer_kinds().collect::<Vec<_>>(),
            [
                parallax_ir::models::LayerKind::Mamba,
                parallax_ir::models::LayerKind::Attention,
                parallax_ir::models::LayerKind::Moe
            ]
        );
        // GPT-OSS: a 128-token window on alternate layers, biased attention.
        let Some(Case::Transformer(oss)) = cases
            .iter()
            .find(|c| c.id() == "mb2511-gptoss-120b-64xh100-bf16")
        else {
            panic!("the gpt-oss case")
        };
        let oss = oss.transformer().unwrap();
        assert_eq!(
            (oss.sliding_window, oss.bias),
            (
                Some(SlidingWindow {
                    size: 128,
                    full_every: 2
                }),
                true
            )
        );
        // The case's shape is the zoo's Nemotron 3 Nano but for the sequence it ran.
        let zoo = parallax_ir::models::zoo::transformer("nemotron-h").unwrap();
        assert_eq!(
            TransformerConfig {
                max_seq: zoo.max_seq,
                ..m
            },
            zoo
        );
        // FSDP runs are ZeRO-3 and dense; Mixtral is routed over its 8 experts with the
        // published expert parallelism.
        let fsdp = by_id("ibm-fsdp-llama2-70b-128xa100");
        assert!(
            fsdp.layout.as_deref().unwrap().contains("zero=3"),
            "{fsdp:?}"
        );
        let mixtral = by_id("mcore-moe-readme-mixtral8x7b-64xh100-bf16");
        assert!(
            mixtral.layout.as_deref().unwrap().contains("ep=8"),
            "{mixtral:?}"
        );
        let zero: Vec<_> = results.iter().filter(|r| r.group == "zero").collect();
        assert!(zero.iter().all(|r| r.status == "ok"));
        // DeepSeek-V3: latent attention, dense and shared-expert layers, a prediction module,
        // laid out as Megatron counts them (61 layers, embedding, module and loss over 32).
        let dsv3 = by_id("mb2509-dsv3-1024xh100-fp8");
        assert_eq!(dsv3.status, "ok", "{dsv3:?}");
        assert!(
            dsv3.layout.as_deref().unwrap().contains("v=4,etp=1"),
            "{dsv3:?}"
        );
    }

    /// The MoE, ZeRO and offload file as JSON with only case `id` left in it.
    fn moe_zero_offload_case(id: &str) -> serde_json::Value {
        let mut doc: serde_json::Value =
            serde_json::from_str(&ground_truth_text("moe-zero-offload.json")).unwrap();
        doc["cases"]
            .as_array_mut()
            .unwrap()
            .retain(|c| c["id"] == id);
        doc
    }

    /// A published DualPipe layout (the schema's `schedule: dualpipe`, `interleave: null`)
    /// is simulated as DualPipe: DeepSeek-V3's own training layout, pp 16 × ep 64.
    #[test]
    fn a_dualpipe_case_is_simulated_as_dualpipe() {
        let mut doc = moe_zero_offload_case("mb2509-dsv3-1024xh100-fp8");
        let cases = doc["cases"].as_array_mut().unwrap();
        let plan = &mut cases[0]["plan"];
        for (k, v) in [
            ("schedule", serde_json::json!("dualpipe")),
            ("interleave", serde_json::Value::Null),
            ("tp", serde_json::json!(1)),
            ("pp", serde_json::json!(16)),
            ("dp", serde_json::json!(64)),
            ("sequence_parallel", serde_json::json!(false)),
            ("global_batch", serde_json::json!(15360)),
            ("grad_accum", serde_json::Value::Null),
        ] {
            plan[k] = v;
        }
        let text = doc.to_string();
        let cases = parse_cases(&text, "dualpipe.json").unwrap().cases;
        let r = cases[0].run();
        assert_eq!(r.status, "ok", "{r:?}");
        assert!(r.layout.as_deref().unwrap().contains("pp=16"), "{r:?}");
        assert!(
            r.layout.as_deref().unwrap().contains("schedule=dualpipe"),
            "{r:?}"
        );
    }

    /// A LatentMoE run (`model.moe.latent_size`, the schema's field: Nemotron 3's latent
    /// experts) is predicted, not skipped: Nemotron 3 Nano's published layout with its experts
    /// moved into a 1,024-wide latent runs its experts and dispatch narrower, faster than the
    /// same run at the hidden width; a latent as wide as the model is none.
    #[test]
    fn latent_moe_cases_are_predicted() {
        let mut doc = moe_zero_offload_case("mb260401-nemotron3nano-16xh100-fp8");
        let cases = doc["cases"].as_array_mut().unwrap();
        let plain = cases[0].clone();
        let mut wide = cases[0].clone();
        wide["model"]["moe"]["latent_size"] = wide["model"]["hidden"].clone();
        wide["id"] = "wide".into();
        cases[0]["model"]["moe"]["latent_size"] = 1024.into();
        cases.push(plain);
        cases.push(wide);
        let cases = parse_cases(&doc.to_string(), "latent.json").unwrap().cases;
        let moe = |c: &Case| match c {
            Case::Transformer(t) => t.transformer().unwrap().moe.unwrap(),
            Case::General(_) => panic!("a transformer case"),
        };
        assert_eq!(moe(&cases[0]).latent, 1024);
        assert_eq!(moe(&cases[2]).latent, 0);
        let (latent, plain) = (cases[0].run(), cases[1].run());
        assert_eq!(latent.status, "ok", "{latent:?}");
        assert!(
            latent.predicted_step_time_s.unwrap() < plain.predicted_step_time_s.unwrap(),
            "{latent:?} {plain:?}"
        );
    }

    /// A run with ALiBi (`position_embedding: "alibi"`, the schema's spelling: BLOOM, MPT) is
    /// predicted, not skipped: BLOOM 176B on Megatron-DeepSpeed's unfused attention pays the
    /// bias broadcast into its scores, a little slower than the same run without it.
    #[test]
    fn alibi_cases_are_predicted() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../validation/megatron-deepspeed.json");
        let mut doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = doc["cases"].as_array_mut().unwrap();
        cases.retain(|c| c["id"] == "bloom-176b-384gpu-tp4pp12dp8");
        assert_eq!(
            cases[0]["model"]["attention"]["position_embedding"],
            "alibi"
        );
        let mut plain = cases[0].clone();
        plain["model"].as_object_mut().unwrap().remove("attention");
        cases.push(plain);
        let cases = parse_cases(&doc.to_string(), "bloom.json").unwrap().cases;
        let Case::Transformer(t) = &cases[0] else {
            panic!("a transformer case")
        };
        assert_eq!(t.transformer().unwrap().position, Position::Alibi);
        let (alibi, plain) = (cases[0].run(), cases[1].run());
        assert_eq!(alibi.status, "ok", "{alibi:?}");
        let (a, p) = (
            alibi.predicted_step_time_s.unwrap(),
            plain.predicted_step_time_s.unwrap(),
        );
        assert!(a > p && a < 1.05 * p, "{a} {p}");
    }

    /// A case's `hf_config`, where it has one, imports to the model its dimension fields
    /// describe.
    #[test]
    fn published_hf_configs_import_to_the_case_model() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/ground-truth/moe-zero-offload.json");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = ground_truth("moe-zero-offload.json");
        let mut checked = 0;
        for (raw, case) in doc["cases"].as_array().unwrap().iter().zip(&cases) {
            let hf = &raw["model"]["hf_config"];
            let Case::Transformer(c) = case else { continue };
            if !hf.is_object() {
                continue;
            }
            let imported = parallax_ir::load::hf_config(hf, "hf_config").unwrap();
            let described = c.transformer().unwrap();
            let key = |m: &TransformerConfig| {
                (
                    m.layers,
                    m.hidden,
                    m.heads,
                    m.kv_heads,
                    m.head_dim,
                    m.ffn_hidden,
                    m.vocab,
                )
            };
            assert_eq!(key(&imported), key(&described), "{}", c.id);
            // Routing groups and how the router weighs the chosen experts are not case fields
            // (the router_detail text says them); they change no cost.
            let ungrouped = |m: &TransformerConfig| {
                m.moe.map(|x| MoeConfig {
                    groups: 0,
                    groups_per_token: 0,
                    norm_top_k: true,
                    routed_scale_permille: 1000,
                    ..x
                })
            };
            assert_eq!(ungrouped(&imported), ungrouped(&described), "{}", c.id);
            assert_eq!(imported.mla, described.mla, "{}", c.id);
            assert_eq!(imported.mtp_layers, described.mtp_layers, "{}", c.id);
            checked += 1;
        }
        assert!(checked >= 1);
    }

    /// Nemotron's squared ReLU under each of its spellings predicts as `squared_relu`.
    #[test]
    fn relu2_is_squared_relu() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/ground-truth/public.json");
        let mut doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = doc["cases"].as_array_mut().unwrap();
        cases.truncate(1);
        let time = |mlp: &str, doc: &mut serde_json::Value| {
            doc["cases"][0]["model"]["mlp"] = mlp.into();
            let cf = parse_cases(&doc.to_string(), "t.json").unwrap();
            let r = cf.cases[0].run();
            assert_eq!(r.status, "ok", "{mlp}: {r:?}");
            r.predicted_step_time_s.unwrap()
        };
        let reference = time("squared_relu", &mut doc);
        assert_eq!(time("relu2", &mut doc), reference);
        assert_eq!(time("squared-relu", &mut doc), reference);
    }

    #[test]
    fn every_case_file_names_a_stack_the_table_holds() {
        for f in ["public.json", "moe-zero-offload.json", "general.json"] {
            let path = format!(
                "{}/../../shared/ground-truth/{f}",
                env!("CARGO_MANIFEST_DIR")
            );
            let Ok(text) = std::fs::read_to_string(&path) else {
                eprintln!("skipping: {path} not found");
                continue;
            };
            let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
            for c in doc["cases"].as_array().unwrap() {
                let spec = c["framework"].as_str().unwrap();
                assert!(Framework::parse(spec).is_ok(), "{f}: {spec}");
            }
        }
    }
}
