//! Resolving a `--model` argument: a zoo name, a HuggingFace `config.json`, an `.onnx` file or a
//! parallax graph JSON.

use crate::graph::{Graph, GraphError};
use crate::import::ImportError;
use crate::models::zoo::{self, ZooDef};
use crate::models::{
    BuildOptions, HybridConfig, MambaConfig, MlaConfig, Mlp, MoeConfig, Norm, Position, Router,
    SlidingWindow, TransformerConfig,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;
use thiserror::Error;

/// Schema tag of parallax graph files.
pub const GRAPH_SCHEMA: &str = "parallax-graph/1";

/// HuggingFace `model_type`s the importer understands.
pub const SUPPORTED_HF_TYPES: &[&str] = &[
    "gpt2",
    "bloom",
    "mpt",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "deepseek_v3",
    "kimi_k2",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "nemotron",
    "nemotron_h",
    "gpt_oss",
    "bert",
];

/// Why a model could not be loaded. Every message is one line naming the file or name.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error("unknown model '{name}': not a zoo name (see `parallax models`: {available}) and not a .json or .onnx file")]
    UnknownModel { name: String, available: String },
    #[error("{file}: cannot read: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: line {line} column {column}: {message}")]
    Json {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{file}: {field}: {message}")]
    Field {
        file: String,
        field: String,
        message: String,
    },
    #[error("{file}: model_type '{model_type}' is not supported (supported: {})", SUPPORTED_HF_TYPES.join(", "))]
    UnsupportedHfType { file: String, model_type: String },
    #[error("{file}: neither a HuggingFace config (no \"model_type\") nor a parallax graph (no \"schema\": \"{GRAPH_SCHEMA}\")")]
    NotAModel { file: String },
    #[error("{file}: {source}")]
    Graph {
        file: String,
        #[source]
        source: Box<GraphError>,
    },
    #[error(transparent)]
    Import(#[from] Box<ImportError>),
}

/// How a loaded model produces graphs.
#[derive(Clone, Debug)]
pub enum ModelKind {
    /// A transformer from its dimensions (zoo or HuggingFace config).
    Transformer(TransformerConfig),
    /// A fixed architecture built for a batch size.
    Batched(fn(u64) -> Result<Graph, GraphError>),
    /// A sequence model built for a batch size and sequence length.
    Sequence(fn(u64, u64) -> Result<Graph, GraphError>),
    /// A graph read from a file, at the batch it was saved with.
    Fixed(Graph),
    /// An ONNX model (the file's bytes), imported again for each batch size: its symbolic
    /// batch dimension takes the batch asked for.
    Onnx(std::sync::Arc<[u8]>),
}

/// A model ready to be turned into graphs.
#[derive(Clone, Debug)]
pub struct Model {
    /// Zoo name, or the file stem.
    pub name: String,
    /// Where it came from: `zoo`, or the path.
    pub origin: String,
    pub kind: ModelKind,
}

/// Default sequence length of sequence models that have no table limiting it (PTB-style BPTT).
const DEFAULT_RNN_SEQ: u64 = 35;

/// The longest sequence parallax models: 16 Mi tokens, beyond the longest contexts trained
/// (1–10 M tokens) and far below where token counts could overflow.
pub const MAX_SEQ: u64 = 1 << 24;

/// The largest global batch parallax models, in samples: 16 Mi, far beyond any published run
/// (tens of thousands of sequences), so that sample and token counts stay exact.
pub const MAX_GLOBAL_BATCH: u64 = 1 << 24;

impl Model {
    /// The transformer dimensions, when the model is one.
    pub fn transformer(&self) -> Option<&TransformerConfig> {
        match &self.kind {
            ModelKind::Transformer(c) => Some(c),
            _ => None,
        }
    }

    /// Sequence length used when none is given.
    pub fn default_seq(&self) -> u64 {
        match &self.kind {
            ModelKind::Transformer(c) => c.max_seq,
            ModelKind::Sequence(_) => DEFAULT_RNN_SEQ,
            _ => 1,
        }
    }

    /// The file (or zoo name) errors about this model name.
    fn shown(&self) -> &str {
        if self.origin == "zoo" {
            &self.name
        } else {
            &self.origin
        }
    }

    /// Whether the model can be trained on sequences of `seq` tokens: at least one, at most
    /// [`MAX_SEQ`], and no more than a transformer's learned positions.
    pub fn check_seq(&self, seq: u64) -> Result<(), ModelError> {
        let err = |message: String| ModelError::Field {
            file: self.shown().to_string(),
            field: "seq".into(),
            message,
        };
        if seq == 0 {
            return Err(err("must be at least 1".into()));
        }
        if seq > MAX_SEQ {
            return Err(err(format!(
                "{seq} is beyond the {MAX_SEQ} tokens parallax models"
            )));
        }
        if let ModelKind::Transformer(c) = &self.kind {
            if c.position == Position::Learned && seq > c.max_seq {
                return Err(err(format!(
                    "{seq} exceeds the model's {} learned positions",
                    c.max_seq
                )));
            }
        }
        Ok(())
    }

    /// The training graph for `batch` samples of `seq` tokens (`seq` is ignored by graph files,
    /// ONNX models and image models; `batch` by graph files).
    pub fn graph(&self, batch: u64, seq: u64, fused_attention: bool) -> Result<Graph, ModelError> {
        // Zoo models are named by their name, file models by their path.
        let file = &self.shown().to_string();
        let err = |field: &str, message: String| ModelError::Field {
            file: file.clone(),
            field: field.into(),
            message,
        };
        if batch == 0 {
            return Err(err("batch", "must be at least 1".into()));
        }
        self.check_seq(seq)?;
        let graph_err = |source| ModelError::Graph {
            file: file.clone(),
            source: Box::new(source),
        };
        match &self.kind {
            ModelKind::Transformer(c) => c
                .build(
                    &self.name,
                    BuildOptions {
                        batch,
                        seq,
                        fused_attention,
                    },
                )
                .map_err(graph_err),
            ModelKind::Batched(f) => f(batch).map_err(graph_err),
            ModelKind::Sequence(f) => f(batch, seq).map_err(graph_err),
            ModelKind::Fixed(g) => Ok(g.clone()),
            ModelKind::Onnx(bytes) => {
                crate::import::onnx::import_onnx_bytes(bytes, file, Some(batch))
                    .map_err(|e| ModelError::Import(Box::new(e)))
            }
        }
    }
}

/// Resolves `spec`: a zoo name, or a path to `.json` (HuggingFace config or parallax graph) or
/// `.onnx`.
pub fn load_model(spec: &str) -> Result<Model, ModelError> {
    if let Some(e) = zoo::find(spec) {
        let kind = match e.def {
            ZooDef::Transformer(c) => ModelKind::Transformer(c),
            ZooDef::Batched(f) => ModelKind::Batched(f),
            ZooDef::Sequence(f) => ModelKind::Sequence(f),
        };
        return Ok(Model {
            name: e.name.into(),
            origin: "zoo".into(),
            kind,
        });
    }
    let path = Path::new(spec);
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(spec)
        .to_string();
    match ext.as_deref() {
        Some("onnx") => {
            let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
                file: spec.into(),
                source,
            })?;
            // Imported once here so that a bad file fails at load, like every other model.
            crate::import::onnx::import_onnx_bytes(&bytes, spec, None).map_err(Box::new)?;
            Ok(Model {
                name,
                origin: spec.into(),
                kind: ModelKind::Onnx(bytes.into()),
            })
        }
        Some("json") => {
            let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
                file: spec.into(),
                source,
            })?;
            load_json(&text, spec, name)
        }
        _ => Err(ModelError::UnknownModel {
            name: spec.into(),
            available: zoo::names(),
        }),
    }
}

/// Parses a JSON model document (HuggingFace config or parallax graph); `file` names it in errors.
pub fn load_json(text: &str, file: &str, name: String) -> Result<Model, ModelError> {
    let v: Value = serde_json::from_str(text).map_err(|e| json_error(file, &e))?;
    if v.get("model_type").is_some() {
        let cfg = hf_config(&v, file)?;
        let name = if name == "config" {
            v.get("_name_or_path")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .unwrap_or(name)
        } else {
            name
        };
        return Ok(Model {
            name,
            origin: file.into(),
            kind: ModelKind::Transformer(cfg),
        });
    }
    match v.get("schema").and_then(Value::as_str) {
        Some(GRAPH_SCHEMA) => {
            let doc: GraphDoc = serde_json::from_str(text).map_err(|e| json_error(file, &e))?;
            let mut g = doc.graph;
            g.validate().map_err(|source| ModelError::Graph {
                file: file.into(),
                source: Box::new(source),
            })?;
            Ok(Model {
                name: g.name.clone(),
                origin: file.into(),
                kind: ModelKind::Fixed(g),
            })
        }
        Some(other) => Err(ModelError::Field {
            file: file.into(),
            field: "schema".into(),
            message: format!("expected \"{GRAPH_SCHEMA}\", found \"{other}\""),
        }),
        None => Err(ModelError::NotAModel { file: file.into() }),
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GraphDoc {
    schema: String,
    graph: Graph,
}

/// A graph as a parallax graph JSON document (import reproduces it exactly).
pub fn graph_to_json(g: &Graph) -> String {
    serde_json::to_string(&GraphDoc {
        schema: GRAPH_SCHEMA.into(),
        graph: g.clone(),
    })
    .unwrap_or_default()
}

fn json_error(file: &str, e: &serde_json::Error) -> ModelError {
    ModelError::Json {
        file: file.into(),
        line: e.line(),
        column: e.column(),
        message: crate::plan::json_message(e),
    }
}

/// Maps a HuggingFace `config.json` onto transformer dimensions.
pub fn hf_config(v: &Value, file: &str) -> Result<TransformerConfig, ModelError> {
    let field_err = |field: &str, message: String| ModelError::Field {
        file: file.into(),
        field: field.into(),
        message,
    };
    let model_type = v
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| field_err("model_type", "must be a string".into()))?;
    // A positive integer field; `alt` are older spellings.
    let int = |keys: &[&str], default: Option<u64>| -> Result<u64, ModelError> {
        for k in keys {
            match v.get(*k) {
                None | Some(Value::Null) => continue,
                Some(x) => {
                    return match x.as_u64() {
                        Some(0) => Err(field_err(k, "must be positive".into())),
                        // Far above any dimension; keeps products such as 4 × n_embd exact
                        // until TransformerConfig::validate bounds each dimension.
                        Some(n) if n > 1 << 32 => Err(field_err(k, format!("{n} is too large"))),
                        Some(n) => Ok(n),
                        None => Err(field_err(
                            k,
                            format!("expected a positive integer, found {x}"),
                        )),
                    };
                }
            }
        }
        default.ok_or_else(|| field_err(keys[0], "missing".into()))
    };
    let flag = |k: &str, default: bool| -> Result<bool, ModelError> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(x) => Err(field_err(k, format!("expected true or false, found {x}"))),
        }
    };
    let cfg = match model_type {
        "gpt2" => {
            let h = int(&["n_embd", "hidden_size"], None)?;
            let layers = int(&["n_layer", "num_hidden_layers"], None)?;
            let heads = int(&["n_head", "num_attention_heads"], None)?;
            let ffn = int(&["n_inner"], Some(4 * h))?;
            // GPT2Config's `activation_function`, `gelu_new` by default: HuggingFace's eight-op
            // tanh GeLU; `gelu_pytorch_tanh` and `gelu` are one kernel.
            let mlp = match v.get("activation_function").and_then(Value::as_str) {
                None | Some("gelu_new") => Mlp::GeluNew,
                Some("relu") => Mlp::Relu,
                Some(_) => Mlp::Gelu,
            };
            TransformerConfig {
                tied_embeddings: flag("tie_word_embeddings", true)?,
                mlp,
                ..TransformerConfig::gpt(
                    to_u32(layers, "n_layer", file)?,
                    h,
                    heads,
                    ffn,
                    int(&["vocab_size"], None)?,
                    int(
                        &["n_positions", "n_ctx", "max_position_embeddings"],
                        Some(1024),
                    )?,
                )
            }
        }
        // BigScience's BLOOM (transformers' BloomConfig): GPT-shaped with biases, a tied
        // head and ALiBi; its extra LayerNorm after the embedding is left out (one norm).
        "bloom" => {
            let h = int(&["hidden_size", "n_embed"], None)?;
            let mut c = TransformerConfig::gpt(
                to_u32(
                    int(&["n_layer", "num_hidden_layers"], None)?,
                    "n_layer",
                    file,
                )?,
                h,
                int(&["n_head", "num_attention_heads"], None)?,
                int(&["n_inner"], Some(4 * h))?,
                int(&["vocab_size"], None)?,
                int(&["seq_length"], Some(2048))?,
            );
            c.position = Position::Alibi;
            c
        }
        // MosaicML's MPT (llm-foundry's MPTConfig): `expansion_ratio` × `d_model` GeLU MLP,
        // no biases with `no_bias`, a tied head, ALiBi where `attn_config.alibi` says so
        // (every released MPT), else a learned table (`learned_pos_emb`, default on).
        "mpt" => {
            let h = int(&["d_model"], None)?;
            let mut c = TransformerConfig::gpt(
                to_u32(int(&["n_layers"], None)?, "n_layers", file)?,
                h,
                int(&["n_heads"], None)?,
                int(&["expansion_ratio"], Some(4))?.saturating_mul(h),
                int(&["vocab_size"], None)?,
                int(&["max_seq_len"], Some(2048))?,
            );
            c.bias = !flag("no_bias", false)?;
            let alibi = match v.get("attn_config").and_then(|a| a.get("alibi")) {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(x) => {
                    return Err(field_err(
                        "attn_config.alibi",
                        format!("expected true or false, found {x}"),
                    ))
                }
            };
            c.position = if alibi {
                Position::Alibi
            } else if flag("learned_pos_emb", true)? {
                Position::Learned
            } else {
                Position::None
            };
            c
        }
        "llama" | "mistral" | "mixtral" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_moe"
        | "deepseek_v3" | "kimi_k2" | "phi3" | "gemma" | "gemma2" | "gemma3_text" | "nemotron"
        | "gpt_oss" => {
            let h = int(&["hidden_size"], None)?;
            let heads = int(&["num_attention_heads"], None)?;
            let mut c = TransformerConfig::llama(
                to_u32(
                    int(&["num_hidden_layers"], None)?,
                    "num_hidden_layers",
                    file,
                )?,
                h,
                heads,
                int(&["num_key_value_heads"], Some(heads))?,
                int(&["intermediate_size"], None)?,
                int(&["vocab_size"], None)?,
                int(&["max_position_embeddings"], Some(4096))?,
            );
            c.head_dim = int(&["head_dim", "kv_channels"], Some(h / heads))?;
            c.rope_theta = match v.get("rope_theta") {
                None | Some(Value::Null) => c.rope_theta,
                Some(x) => match x.as_f64() {
                    Some(t) if t.is_finite() && (1.0..=1e12).contains(&t) => t.round() as u64,
                    _ => {
                        return Err(field_err(
                            "rope_theta",
                            format!("expected a number between 1 and 1e12, found {x}"),
                        ))
                    }
                },
            };
            // Gemma ties its LM head to the embedding unless told otherwise.
            let gemma = model_type.starts_with("gemma");
            c.tied_embeddings = flag("tie_word_embeddings", gemma)?;
            // Qwen2 has biases on the query, key and value projections only (its modelling
            // code, not a config field); the others say so in `attention_bias`.
            c.bias = flag("attention_bias", false)?;
            c.qkv_bias = !c.bias && matches!(model_type, "qwen2" | "qwen2_moe");
            let act = v
                .get("hidden_act")
                .or_else(|| v.get("hidden_activation"))
                .and_then(Value::as_str);
            c.mlp = match (model_type, act) {
                // Nemotron: an ungated squared-ReLU MLP and LayerNorm (`layernorm1p`).
                ("nemotron", _) | (_, Some("relu2")) => {
                    c.norm = Norm::LayerNorm;
                    Mlp::SquaredRelu
                }
                // Gemma's GeGLU has SwiGLU's three GEMMs and one pointwise gate.
                _ => Mlp::Swiglu,
            };
            c.sliding_window = sliding_window(v, model_type, c.layers, file)?;
            // Per-head query and key norms: Qwen3's and Gemma 3's modelling code (no key).
            c.qk_norm = matches!(model_type, "qwen3" | "qwen3_moe" | "gemma3_text");
            match model_type {
                "mixtral" => {
                    c.moe = Some(MoeConfig::routed(
                        int(&["num_local_experts"], None)?,
                        int(&["num_experts_per_tok"], Some(2))?,
                    ));
                }
                "gpt_oss" => {
                    // OpenAI's gpt-oss: `num_local_experts` experts `intermediate_size` wide,
                    // top-`experts_per_token`, biases on the attention projections (and on the
                    // experts, which are not counted: 0.03 % of the model).
                    c.moe = Some(MoeConfig::routed(
                        int(&["num_local_experts"], None)?,
                        int(&["num_experts_per_tok", "experts_per_token"], Some(4))?,
                    ));
                    c.bias = flag("attention_bias", true)?;
                    // GptOssAttention always has its per-head `sinks` (no config key).
                    c.attention_sinks = true;
                    // GptOssExperts' clamped gate, at the limit every release uses.
                    match v.get("swiglu_limit") {
                        None | Some(Value::Null) => c.clamped_swiglu = true,
                        Some(x) if x.as_f64() == Some(7.0) => c.clamped_swiglu = true,
                        Some(x) => {
                            return Err(field_err(
                                "swiglu_limit",
                                format!("parallax models GPT-OSS's clamp at 7.0, found {x}"),
                            ))
                        }
                    }
                }
                "deepseek_v3" | "kimi_k2" => {
                    // Latent attention, `first_k_dense_replace` dense layers, then every
                    // `moe_layer_freq`-th layer routed over `n_routed_experts` beside
                    // `n_shared_experts` (DeepSeek's modelling code), and
                    // `num_nextn_predict_layers` prediction modules.
                    let mla = MlaConfig {
                        q_lora_rank: int(&["q_lora_rank"], Some(0))?,
                        kv_lora_rank: int(&["kv_lora_rank"], None)?,
                        qk_nope_head_dim: int(&["qk_nope_head_dim"], None)?,
                        qk_rope_head_dim: int(&["qk_rope_head_dim"], None)?,
                        v_head_dim: int(&["v_head_dim"], None)?,
                    };
                    c.head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
                    c.kv_heads = c.heads;
                    c.mla = Some(mla);
                    let small = |k: &str, d: u64| -> Result<u32, ModelError> {
                        let v = int(&[k], Some(d))?;
                        u32::try_from(v)
                            .ok()
                            .filter(|&x| x <= c.layers)
                            .ok_or_else(|| {
                                field_err(k, format!("{v} is beyond the {} layers", c.layers))
                            })
                    };
                    let group_count = |k: &str| -> Result<u32, ModelError> {
                        let v = int(&[k], Some(0))?;
                        u32::try_from(v)
                            .map_err(|_| field_err(k, format!("{v} expert groups is too many")))
                    };
                    let expert = int(&["moe_intermediate_size"], None)?;
                    // DeepSeek-V3's router scores by sigmoid (`scoring_func`, whose default
                    // in its config class is sigmoid too).
                    let router = match v.get("scoring_func").and_then(Value::as_str) {
                        None => Router::Sigmoid,
                        Some(f) => f.parse().map_err(|e| field_err("scoring_func", e))?,
                    };
                    // `routed_scaling_factor` (2.5 in DeepSeek-V3's config class) scales
                    // the routed experts' weights, renormalised first (`norm_topk_prob`,
                    // true there).
                    let scale = match v.get("routed_scaling_factor") {
                        None | Some(Value::Null) => 2500,
                        Some(x) => match x.as_f64() {
                            Some(f) if f.is_finite() && (0.001..=1000.0).contains(&f) => {
                                (f * 1000.0).round() as u32
                            }
                            _ => {
                                return Err(field_err(
                                    "routed_scaling_factor",
                                    format!("expected a number between 0.001 and 1000, found {x}"),
                                ))
                            }
                        },
                    };
                    c.moe = Some(MoeConfig {
                        router,
                        norm_top_k: flag("norm_topk_prob", true)?,
                        routed_scale_permille: scale,
                        // Expert groups: counted against the experts by `validate`, not
                        // against the layers.
                        groups: group_count("n_group")?,
                        groups_per_token: group_count("topk_group")?,
                        // Saturating: a hostile count times a width is refused by
                        // `validate`'s bound, not overflowed here.
                        shared_ffn_hidden: int(&["n_shared_experts"], Some(0))?
                            .saturating_mul(expert),
                        dense_layers_first: small("first_k_dense_replace", 0)?,
                        every: small("moe_layer_freq", 1)?.max(1),
                        dense_ffn_hidden: c.ffn_hidden,
                        ..MoeConfig::routed(
                            int(&["n_routed_experts"], None)?,
                            int(&["num_experts_per_tok"], None)?,
                        )
                    });
                    c.ffn_hidden = expert;
                    c.mtp_layers = small("num_nextn_predict_layers", 0)?;
                }
                "qwen3_moe" | "qwen2_moe" => {
                    // Layer i is routed when (i + 1) is a multiple of decoder_sparse_step
                    // (Qwen's modelling code) over experts `moe_intermediate_size` wide; the
                    // others are dense, `intermediate_size` wide. Qwen2-MoE adds a shared
                    // expert (`shared_expert_intermediate_size`) to every MoE layer.
                    let step = int(&["decoder_sparse_step"], Some(1))?;
                    if v.get("mlp_only_layers")
                        .and_then(Value::as_array)
                        .is_some_and(|a| !a.is_empty())
                    {
                        return Err(field_err(
                            "mlp_only_layers",
                            "dense layers at listed positions are not modelled (only a leading run and a period)".into(),
                        ));
                    }
                    let every = u32::try_from(step)
                        .ok()
                        .filter(|&k| k >= 1 && k <= c.layers)
                        .ok_or_else(|| {
                            field_err(
                                "decoder_sparse_step",
                                format!("{step} must be between 1 and the {} layers", c.layers),
                            )
                        })?;
                    let shared = int(&["shared_expert_intermediate_size"], Some(0))?;
                    c.moe = Some(MoeConfig {
                        // The config classes default to unnormalised weights; the Qwen3-MoE
                        // checkpoints set `norm_topk_prob`.
                        norm_top_k: flag("norm_topk_prob", false)?,
                        shared_ffn_hidden: shared,
                        // Qwen2-MoE gates its shared expert (`shared_expert_gate`).
                        shared_gate: shared > 0,
                        dense_layers_first: every - 1,
                        every,
                        dense_ffn_hidden: if every > 1 { c.ffn_hidden } else { 0 },
                        ..MoeConfig::routed(
                            int(&["num_experts"], None)?,
                            int(&["num_experts_per_tok"], Some(8))?,
                        )
                    });
                    c.ffn_hidden = int(&["moe_intermediate_size"], None)?;
                }
                _ => {}
            }
            c
        }
        "nemotron_h" => {
            // NVIDIA's hybrid (HF `NemotronHConfig`): `hybrid_override_pattern` names each
            // layer; Mamba-2 mixers of `mamba_num_heads` × `mamba_head_dim` with
            // `ssm_state_size` per `n_groups`; MoE layers of `n_routed_experts`
            // `moe_intermediate_size` wide beside a shared expert; dense layers
            // `intermediate_size` wide; squared-ReLU MLPs, RMSNorm, no position embedding.
            let pattern = match v.get("hybrid_override_pattern") {
                Some(Value::String(p)) => p.clone(),
                Some(x) => {
                    return Err(field_err(
                        "hybrid_override_pattern",
                        format!("expected a string, found {x}"),
                    ))
                }
                None => return Err(field_err("hybrid_override_pattern", "missing".into())),
            };
            let layers = int(&["num_hidden_layers"], Some(pattern.len() as u64))?;
            let heads = int(&["num_attention_heads"], None)?;
            let h = int(&["hidden_size"], None)?;
            let dense = int(&["intermediate_size"], None)?;
            let mut c = TransformerConfig::llama(
                to_u32(layers, "num_hidden_layers", file)?,
                h,
                heads,
                int(&["num_key_value_heads"], Some(heads))?,
                dense,
                int(&["vocab_size"], None)?,
                int(&["max_position_embeddings"], Some(4096))?,
            );
            c.head_dim = int(&["head_dim", "attention_head_dim"], Some(h / heads))?;
            c.position = Position::None;
            c.mlp = match v.get("mlp_hidden_act").and_then(Value::as_str) {
                None | Some("relu2") => Mlp::SquaredRelu,
                Some(other) => {
                    return Err(field_err(
                        "mlp_hidden_act",
                        format!("'{other}' is not modelled (relu2)"),
                    ))
                }
            };
            c.tied_embeddings = flag("tie_word_embeddings", false)?;
            c.bias = flag("attention_bias", false)? || flag("mlp_bias", false)?;
            if pattern.contains('E') {
                let expert = int(&["moe_intermediate_size"], None)?;
                // Sigmoid scores with a correction bias (NemotronH's router).
                // LatentMoE (Nemotron 3 Super and Ultra): the experts' latent width.
                let w = int(&["moe_latent_size"], Some(h))?;
                let latent = MoeConfig::latent_of(w, h)
                    .ok_or_else(|| field_err("moe_latent_size", format!("{w} is too large")))?;
                c.moe = Some(MoeConfig {
                    router: Router::Sigmoid,
                    latent,
                    shared_ffn_hidden: int(&["moe_shared_expert_intermediate_size"], Some(0))?
                        .saturating_mul(int(&["n_shared_experts"], Some(1))?),
                    dense_ffn_hidden: if pattern.contains('-') { dense } else { 0 },
                    ..MoeConfig::routed(
                        int(&["n_routed_experts"], None)?,
                        int(&["num_experts_per_tok"], None)?,
                    )
                });
                c.ffn_hidden = expert;
            }
            c.hybrid = Some(HybridConfig {
                pattern,
                mamba: MambaConfig {
                    heads: int(&["mamba_num_heads"], None)?,
                    head_dim: int(&["mamba_head_dim"], None)?,
                    state: int(&["ssm_state_size", "mamba_state_dim"], None)?,
                    groups: int(&["n_groups", "mamba_n_groups"], Some(1))?,
                    conv_kernel: int(&["conv_kernel"], Some(4))?,
                    chunk: int(&["chunk_size"], Some(128))?,
                },
            });
            c
        }
        "bert" => {
            let h = int(&["hidden_size"], None)?;
            let mut c = TransformerConfig::gpt(
                to_u32(
                    int(&["num_hidden_layers"], None)?,
                    "num_hidden_layers",
                    file,
                )?,
                h,
                int(&["num_attention_heads"], None)?,
                int(&["intermediate_size"], Some(4 * h))?,
                int(&["vocab_size"], None)?,
                int(&["max_position_embeddings"], Some(512))?,
            );
            c.causal = false;
            c.bert = true;
            c.mlp = match v.get("hidden_act").and_then(Value::as_str) {
                Some("relu") => Mlp::Relu,
                _ => Mlp::Gelu,
            };
            c
        }
        other => {
            return Err(ModelError::UnsupportedHfType {
                file: file.into(),
                model_type: other.into(),
            })
        }
    };
    debug_assert!(cfg.norm == Norm::LayerNorm || cfg.norm == Norm::RmsNorm);
    cfg.validate().map_err(|m| field_err("config", m))?;
    if cfg.hidden % cfg.heads != 0 && v.get("head_dim").is_none() {
        return Err(field_err(
            "hidden_size",
            format!(
                "{} is not a multiple of the {} attention heads",
                cfg.hidden, cfg.heads
            ),
        ));
    }
    Ok(cfg)
}

/// A HuggingFace config's sliding-window attention: `sliding_window` keys on the layers
/// `layer_types` calls `sliding_attention` (full attention every k-th layer, the only
/// arrangement modelled), on every other layer for Gemma 2, on all but every
/// `sliding_window_pattern`-th for Gemma 3, on every layer for Mistral-style configs that set
/// a window (Qwen's only with `use_sliding_window`).
fn sliding_window(
    v: &Value,
    model_type: &str,
    layers: u32,
    file: &str,
) -> Result<Option<SlidingWindow>, ModelError> {
    let err = |field: &str, message: String| ModelError::Field {
        file: file.into(),
        field: field.into(),
        message,
    };
    let size = match v.get("sliding_window") {
        None | Some(Value::Null) => return Ok(None),
        Some(x) => match x.as_u64() {
            Some(n) if n > 0 => n,
            _ => {
                return Err(err(
                    "sliding_window",
                    format!("expected a positive integer, found {x}"),
                ))
            }
        },
    };
    if model_type.starts_with("qwen") && v.get("use_sliding_window") != Some(&Value::Bool(true)) {
        return Ok(None);
    }
    let full_every = match v.get("layer_types") {
        Some(Value::Array(types)) => {
            let full: Vec<bool> = types
                .iter()
                .map(|t| t.as_str() == Some("full_attention"))
                .collect();
            if full.len() != layers as usize {
                return Err(err(
                    "layer_types",
                    format!("{} entries for {layers} layers", full.len()),
                ));
            }
            // The period k with layer i full exactly when (i + 1) % k == 0 (0: none full).
            let k = full.iter().position(|f| *f).map_or(0, |i| i as u32 + 1);
            let fits = full
                .iter()
                .enumerate()
                .all(|(i, f)| *f == (k > 0 && (i as u32 + 1) % k == 0));
            if !fits {
                return Err(err(
                    "layer_types",
                    "only full attention every k-th layer is modelled".into(),
                ));
            }
            k
        }
        Some(x) => return Err(err("layer_types", format!("expected a list, found {x}"))),
        None => match model_type {
            "gemma2" => 2,
            "gemma3_text" => {
                let k = v
                    .get("sliding_window_pattern")
                    .and_then(Value::as_u64)
                    .unwrap_or(6);
                u32::try_from(k).unwrap_or(0)
            }
            _ => 0,
        },
    };
    Ok(Some(SlidingWindow { size, full_every }))
}

fn to_u32(n: u64, field: &str, file: &str) -> Result<u32, ModelError> {
    u32::try_from(n).map_err(|_| ModelError::Field {
        file: file.into(),
        field: field.into(),
        message: format!("{n} is too large"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Model, ModelError> {
        load_json(text, "config.json", "config".into())
    }

    /// GPT-2's GeLU as its config names it: `gelu_new` (GPT2Config's default) is the eight-op
    /// chain, `gelu_pytorch_tanh` and `gelu` one kernel.
    #[test]
    fn gpt2_activation_function_picks_its_gelu() {
        for (act, mlp) in [
            (None, Mlp::GeluNew),
            (Some("gelu_new"), Mlp::GeluNew),
            (Some("gelu_pytorch_tanh"), Mlp::Gelu),
            (Some("gelu"), Mlp::Gelu),
            (Some("relu"), Mlp::Relu),
        ] {
            let field = act.map_or(String::new(), |a| {
                format!(r#","activation_function":"{a}""#)
            });
            let text = format!(
                r#"{{"model_type":"gpt2","n_embd":64,"n_layer":2,"n_head":4,"vocab_size":100{field}}}"#
            );
            let m = load(&text).unwrap();
            assert_eq!(m.transformer().unwrap().mlp, mlp, "{act:?}");
        }
    }

    #[test]
    fn hf_configs_reproduce_the_zoo() {
        // Field values from the HuggingFace Hub config.json of each model.
        let cases = [
            (
                // The fields DeepSeek-V3's config.json sets (as in moe-zero-offload.json's
                // hf_config), quantization and rope scaling left out: they cost nothing here.
                r#"{"model_type":"deepseek_v3","hidden_size":7168,"num_hidden_layers":61,"num_attention_heads":128,"num_key_value_heads":128,"intermediate_size":18432,"moe_intermediate_size":2048,"n_routed_experts":256,"n_shared_experts":1,"num_experts_per_tok":8,"first_k_dense_replace":3,"moe_layer_freq":1,"q_lora_rank":1536,"kv_lora_rank":512,"qk_nope_head_dim":128,"qk_rope_head_dim":64,"v_head_dim":128,"num_nextn_predict_layers":1,"n_group":8,"topk_group":4,"vocab_size":129280,"max_position_embeddings":163840,"rope_theta":10000,"tie_word_embeddings":false,"attention_bias":false,"hidden_act":"silu"}"#,
                "deepseek-v3",
            ),
            (
                r#"{"model_type":"gpt2","n_embd":768,"n_layer":12,"n_head":12,"vocab_size":50257,"n_positions":1024,"n_inner":null}"#,
                "gpt2",
            ),
            (
                // gpt-oss-120b's config.json (rope scaling and quantization left out).
                r#"{"model_type":"gpt_oss","hidden_size":2880,"num_hidden_layers":36,"num_attention_heads":64,"num_key_value_heads":8,"head_dim":64,"intermediate_size":2880,"num_local_experts":128,"num_experts_per_tok":4,"experts_per_token":4,"vocab_size":201088,"max_position_embeddings":131072,"sliding_window":128,"layer_types":["sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention"],"rope_theta":150000,"attention_bias":true,"tie_word_embeddings":false,"hidden_act":"silu","swiglu_limit":7.0}"#,
                "gpt-oss-120b",
            ),
            (
                // The fields of Nemotron 3 Nano's NemotronHConfig that shape the model.
                r#"{"model_type":"nemotron_h","hidden_size":2688,"num_hidden_layers":52,"hybrid_override_pattern":"MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME","num_attention_heads":32,"num_key_value_heads":2,"head_dim":128,"intermediate_size":1856,"moe_intermediate_size":1856,"moe_shared_expert_intermediate_size":3712,"n_routed_experts":128,"num_experts_per_tok":6,"mamba_num_heads":64,"mamba_head_dim":64,"ssm_state_size":128,"n_groups":8,"conv_kernel":4,"chunk_size":128,"vocab_size":131072,"max_position_embeddings":262144,"tie_word_embeddings":false,"mlp_hidden_act":"relu2","attention_bias":false,"mlp_bias":false}"#,
                "nemotron-h",
            ),
            (
                r#"{"model_type":"llama","hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":128256,"max_position_embeddings":8192,"tie_word_embeddings":false,"rope_theta":500000.0}"#,
                "llama3-8b",
            ),
            (
                r#"{"model_type":"mixtral","hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":32000,"max_position_embeddings":32768,"num_local_experts":8,"num_experts_per_tok":2}"#,
                "mixtral-8x7b",
            ),
            (
                r#"{"model_type":"mixtral","hidden_size":6144,"num_hidden_layers":56,"num_attention_heads":48,"num_key_value_heads":8,"intermediate_size":16384,"vocab_size":32000,"max_position_embeddings":65536,"num_local_experts":8,"num_experts_per_tok":2,"rope_theta":1000000.0}"#,
                "mixtral-8x22b",
            ),
            (
                r#"{"model_type":"qwen3_moe","hidden_size":2048,"num_hidden_layers":48,"num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"intermediate_size":6144,"moe_intermediate_size":768,"num_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,"vocab_size":151936,"max_position_embeddings":40960,"rope_theta":1000000.0,"tie_word_embeddings":false,"decoder_sparse_step":1,"mlp_only_layers":[],"attention_bias":false,"hidden_act":"silu"}"#,
                "qwen3-30b-a3b",
            ),
            (
                r#"{"model_type":"qwen3_moe","hidden_size":4096,"num_hidden_layers":94,"num_attention_heads":64,"num_key_value_heads":4,"head_dim":128,"intermediate_size":12288,"moe_intermediate_size":1536,"num_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,"vocab_size":151936,"max_position_embeddings":40960,"rope_theta":1000000.0,"tie_word_embeddings":false,"decoder_sparse_step":1,"mlp_only_layers":[],"attention_bias":false,"hidden_act":"silu"}"#,
                "qwen3-235b-a22b",
            ),
            (
                r#"{"model_type":"bert","hidden_size":1024,"num_hidden_layers":24,"num_attention_heads":16,"intermediate_size":4096,"vocab_size":30522,"max_position_embeddings":512,"hidden_act":"gelu"}"#,
                "bert-large",
            ),
        ];
        for (text, zoo_name) in cases {
            let m = load(text).unwrap();
            let z = load_model(zoo_name).unwrap();
            assert_eq!(m.transformer(), z.transformer(), "{zoo_name}");
        }
        let mistral = load(r#"{"model_type":"mistral","hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":32000}"#).unwrap();
        let g = mistral.graph(1, 16, true).unwrap();
        assert_eq!(g.param_count(), 7_241_732_096); // Mistral-7B-v0.1, HF num_parameters()
    }

    /// BLOOM's and MPT's configs import with ALiBi and their published sizes (bigscience/bloom:
    /// 176,247,271,424 parameters; mosaicml/mpt-7b: 6.7B) and match the zoo's; an MPT without
    /// ALiBi keeps its learned table, and a malformed flag names its field.
    #[test]
    fn alibi_models_import_with_their_positions() {
        let cfg = |text: &str| load(text).unwrap().transformer().cloned().unwrap();
        let bloom = cfg(
            r#"{"model_type":"bloom","n_layer":70,"hidden_size":14336,"n_head":112,"vocab_size":250880,"apply_residual_connection_post_layernorm":false,"layer_norm_epsilon":1e-05}"#,
        );
        assert_eq!(bloom.position, Position::Alibi);
        let rel = |n: u64, published: f64| (n as f64 / published - 1.0).abs();
        assert!(
            rel(bloom.params(), 176_247_271_424.0) < 0.001,
            "{}",
            bloom.params()
        );
        let mpt = r#"{"model_type":"mpt","d_model":4096,"n_heads":32,"n_layers":32,"expansion_ratio":4,"max_seq_len":2048,"vocab_size":50432,"no_bias":true,"attn_config":{"alibi":true,"attn_impl":"triton"}}"#;
        let mpt7 = cfg(mpt);
        assert_eq!(mpt7.position, Position::Alibi);
        assert!(!mpt7.bias);
        assert!(rel(mpt7.params(), 6.7e9) < 0.01, "{}", mpt7.params());
        assert_eq!(
            Some(&bloom),
            load_model("bloom-176b").unwrap().transformer(),
            "bloom-176b"
        );
        assert_eq!(
            Some(&mpt7),
            load_model("mpt-7b").unwrap().transformer(),
            "mpt-7b"
        );
        // The graph holds no position table and marks its attention cores.
        let g = load(mpt).unwrap().graph(1, 16, true).unwrap();
        assert!(g.tensors.iter().all(|t| !t.name.contains("pos_embed")));
        assert!(g
            .nodes
            .iter()
            .any(|n| matches!(&n.op, crate::op::OpKind::Attention(a) if a.alibi)));
        let learned = cfg(&mpt.replace("\"alibi\":true", "\"alibi\":false"));
        assert_eq!(learned.position, Position::Learned);
        let e = load(&mpt.replace("\"alibi\":true", "\"alibi\":1")).unwrap_err();
        assert!(e.to_string().contains("attn_config.alibi"), "{e}");
    }

    /// A Nemotron-H config with `moe_latent_size` (Nemotron 3's LatentMoE) imports its
    /// experts' latent width; a latent as wide as the model is none.
    #[test]
    fn nemotron_h_reads_its_moe_latent_size() {
        let nano = r#"{"model_type":"nemotron_h","hidden_size":2688,"num_hidden_layers":4,"hybrid_override_pattern":"M*EM","num_attention_heads":32,"num_key_value_heads":2,"head_dim":128,"intermediate_size":1856,"moe_intermediate_size":1856,"moe_shared_expert_intermediate_size":3712,"n_routed_experts":128,"num_experts_per_tok":6,"mamba_num_heads":64,"mamba_head_dim":64,"ssm_state_size":128,"n_groups":8,"vocab_size":131072,"LATENT"}"#;
        let latent = |field: &str| {
            let text = nano.replace(",\"LATENT\"", field);
            load(&text)
                .unwrap()
                .transformer()
                .unwrap()
                .moe
                .unwrap()
                .latent
        };
        assert_eq!(latent(""), 0);
        assert_eq!(latent(",\"moe_latent_size\":1024"), 1024);
        assert_eq!(latent(",\"moe_latent_size\":2688"), 0);
    }

    /// Shared-expert widths multiplied out of hostile counts are refused by the bounds, not
    /// overflowed (a fuzzed DeepSeek-V3 and Nemotron-H config).
    #[test]
    fn hostile_shared_expert_counts_are_errors() {
        for text in [
            r#"{"model_type":"deepseek_v3","hidden_size":7168,"num_hidden_layers":61,"num_attention_heads":128,"num_key_value_heads":128,"intermediate_size":18432,"moe_intermediate_size":4294967296,"n_routed_experts":256,"n_shared_experts":4294967296,"num_experts_per_tok":8,"first_k_dense_replace":3,"q_lora_rank":1536,"kv_lora_rank":512,"qk_nope_head_dim":128,"qk_rope_head_dim":64,"v_head_dim":128,"vocab_size":129280}"#,
            r#"{"model_type":"nemotron_h","hidden_size":2688,"num_hidden_layers":4,"hybrid_override_pattern":"M*EM","num_attention_heads":32,"num_key_value_heads":2,"head_dim":128,"intermediate_size":1856,"moe_intermediate_size":1856,"moe_shared_expert_intermediate_size":4294967296,"n_shared_experts":4294967296,"n_routed_experts":128,"num_experts_per_tok":6,"mamba_num_heads":64,"mamba_head_dim":64,"ssm_state_size":128,"n_groups":8,"vocab_size":131072}"#,
        ] {
            assert!(load(text).is_err(), "{text}");
        }
    }

    /// Current open models import with their published parameter counts (HuggingFace
    /// `num_parameters()` of each model card's checkpoint; within 1 %).
    #[test]
    fn hf_configs_of_current_models_match_their_parameter_counts() {
        let cases: [(&str, f64); 6] = [
            (
                r#"{"model_type":"qwen2","hidden_size":3584,"intermediate_size":18944,"num_hidden_layers":28,"num_attention_heads":28,"num_key_value_heads":4,"vocab_size":152064,"max_position_embeddings":32768,"tie_word_embeddings":false}"#,
                7.6156e9, // Qwen2.5-7B
            ),
            (
                r#"{"model_type":"qwen3","hidden_size":4096,"intermediate_size":12288,"num_hidden_layers":36,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,"vocab_size":151936,"max_position_embeddings":40960,"tie_word_embeddings":false,"attention_bias":false}"#,
                8.1907e9, // Qwen3-8B
            ),
            (
                r#"{"model_type":"qwen3_moe","hidden_size":2048,"intermediate_size":6144,"moe_intermediate_size":768,"num_hidden_layers":48,"num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"num_experts":128,"num_experts_per_tok":8,"decoder_sparse_step":1,"mlp_only_layers":[],"vocab_size":151936,"max_position_embeddings":40960,"tie_word_embeddings":false}"#,
                30.532e9, // Qwen3-30B-A3B
            ),
            (
                r#"{"model_type":"qwen2_moe","hidden_size":2048,"intermediate_size":5632,"moe_intermediate_size":1408,"shared_expert_intermediate_size":5632,"num_hidden_layers":24,"num_attention_heads":16,"num_key_value_heads":16,"num_experts":60,"num_experts_per_tok":4,"decoder_sparse_step":1,"vocab_size":151936,"max_position_embeddings":8192,"tie_word_embeddings":false}"#,
                14.316e9, // Qwen1.5-MoE-A2.7B (model card: 14.3B total)
            ),
            (
                r#"{"model_type":"gemma2","hidden_size":3584,"intermediate_size":14336,"num_hidden_layers":42,"num_attention_heads":16,"num_key_value_heads":8,"head_dim":256,"vocab_size":256000,"max_position_embeddings":8192,"hidden_activation":"gelu_pytorch_tanh"}"#,
                9.2417e9, // Gemma-2-9B
            ),
            (
                r#"{"model_type":"phi3","hidden_size":3072,"intermediate_size":8192,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":32,"vocab_size":32064,"max_position_embeddings":4096,"tie_word_embeddings":false}"#,
                3.8211e9, // Phi-3-mini-4k-instruct
            ),
        ];
        for (text, published) in cases {
            let m = load(text).unwrap();
            let n = m.graph(1, 16, true).unwrap().param_count() as f64;
            assert!(
                (n / published - 1.0).abs() < 0.01,
                "{text}: {n} vs {published}"
            );
        }
        // Qwen2 biases q, k and v alone: Qwen2.5-7B's count is exact (7,615,616,512).
        let qwen2 = load(cases[0].0).unwrap();
        let t = qwen2.transformer().unwrap();
        assert!(t.qkv_bias && !t.bias);
        assert_eq!(
            qwen2.graph(1, 16, true).unwrap().param_count(),
            7_615_616_512
        );
        let nemotron = load(r#"{"model_type":"nemotron","hidden_size":4096,"intermediate_size":16384,"num_hidden_layers":32,"num_attention_heads":48,"num_key_value_heads":8,"head_dim":128,"vocab_size":256000,"hidden_act":"relu2"}"#).unwrap();
        let t = nemotron.transformer().unwrap();
        assert_eq!((t.mlp, t.norm), (Mlp::SquaredRelu, Norm::LayerNorm));
        // Every second layer routed ((i + 1) a multiple of the step): 1, 3, 5, …; the others
        // dense at intermediate_size.
        let sparse = load(r#"{"model_type":"qwen3_moe","hidden_size":2048,"intermediate_size":6144,"moe_intermediate_size":768,"num_hidden_layers":48,"num_attention_heads":32,"num_experts":128,"decoder_sparse_step":2,"vocab_size":151936}"#).unwrap();
        let t = sparse.transformer().unwrap();
        let routed: Vec<u32> = (0..6).filter(|&i| t.is_moe_layer(i)).collect();
        assert_eq!(
            (routed, t.dense_ffn(), t.ffn_hidden),
            (vec![1, 3, 5], 6144, 768)
        );
        let e = load(r#"{"model_type":"qwen3_moe","hidden_size":2048,"intermediate_size":6144,"moe_intermediate_size":768,"num_hidden_layers":48,"num_attention_heads":32,"num_experts":128,"mlp_only_layers":[0, 7],"vocab_size":151936}"#).unwrap_err();
        assert!(e.to_string().contains("mlp_only_layers"), "{e}");
    }

    #[test]
    fn hf_errors_name_file_and_field() {
        let e = load(r#"{"model_type":"t5","d_model":512}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json") && e.contains("'t5'") && e.contains("llama"),
            "{e}"
        );
        let e = load(r#"{"model_type":"llama","hidden_size":4096}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json: num_attention_heads: missing"),
            "{e}"
        );
        let e = load(r#"{"model_type":"gpt2","n_embd":-3,"n_layer":2,"n_head":2,"vocab_size":5}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("n_embd") && e.contains("positive"), "{e}");
        let e = load(r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":3,"intermediate_size":5,"vocab_size":5}"#).unwrap_err().to_string();
        assert!(e.contains("kv_heads"), "{e}");
        let e = load("{\"model_type\": ").unwrap_err().to_string();
        assert!(e.starts_with("config.json: line 1"), "{e}");
        let e = load("{}").unwrap_err().to_string();
        assert!(e.contains("neither"), "{e}");
        // GPT-OSS's clamp is modelled at the limit every release uses; another is named.
        let oss = |limit: &str| {
            load(&format!(
                r#"{{"model_type":"gpt_oss","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":64,"num_local_experts":4,"num_experts_per_tok":2,"vocab_size":50{limit}}}"#
            ))
        };
        let m = oss(r#","swiglu_limit":7.0"#).unwrap();
        assert!(m.transformer().is_some_and(|t| t.clamped_swiglu && t.bias));
        let e = oss(r#","swiglu_limit":8.5"#).unwrap_err().to_string();
        assert!(e.contains("swiglu_limit") && e.contains("8.5"), "{e}");
        // Window arrangements other than full attention every k-th layer are named.
        let e = load(r#"{"model_type":"mistral","hidden_size":64,"num_hidden_layers":3,"num_attention_heads":4,"intermediate_size":96,"vocab_size":50,"sliding_window":16,"layer_types":["full_attention","sliding_attention","sliding_attention"]}"#).unwrap_err().to_string();
        assert!(e.contains("layer_types") && e.contains("k-th"), "{e}");
        let e = load(r#"{"model_type":"mistral","hidden_size":64,"num_hidden_layers":3,"num_attention_heads":4,"intermediate_size":96,"vocab_size":50,"sliding_window":0}"#).unwrap_err().to_string();
        assert!(
            e.contains("sliding_window") && e.contains("positive"),
            "{e}"
        );
        // Mistral's window covers every layer; Gemma 2 alternates; Qwen's needs its switch.
        let window = |text: &str| load(text).unwrap().transformer().unwrap().sliding_window;
        let dims = r#""hidden_size":64,"num_hidden_layers":4,"num_attention_heads":4,"intermediate_size":96,"vocab_size":50,"sliding_window":16"#;
        assert_eq!(
            window(&format!(r#"{{"model_type":"mistral",{dims}}}"#)).map(|w| w.full_every),
            Some(0)
        );
        assert_eq!(
            window(&format!(r#"{{"model_type":"gemma2",{dims}}}"#)).map(|w| w.full_every),
            Some(2)
        );
        assert_eq!(window(&format!(r#"{{"model_type":"qwen2",{dims}}}"#)), None);
    }

    #[test]
    fn graph_json_round_trips_exactly() {
        let m = load_model("llama-tiny").unwrap();
        let g = m.graph(2, 16, true).unwrap();
        let text = graph_to_json(&g);
        let back = load_json(&text, "g.json", "g".into()).unwrap();
        match back.kind {
            ModelKind::Fixed(h) => {
                assert_eq!(h, g);
                assert_eq!(graph_to_json(&h), text);
            }
            _ => panic!("expected a fixed graph"),
        }
        // A corrupted graph is rejected with the node named.
        let bad = text.replacen("\"out_features\":256", "\"out_features\":255", 1);
        let e = load_json(&bad, "g.json", "g".into())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("g.json: node"), "{e}");
    }

    #[test]
    fn unknown_names_list_the_zoo() {
        let e = load_model("gpt-5").unwrap_err().to_string();
        assert!(e.contains("gpt-5") && e.contains("llama3-405b"), "{e}");
        let e = load_model("/nonexistent/config.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/nonexistent/config.json: cannot read"),
            "{e}"
        );
        let m = load_model("gpt2").unwrap();
        assert!(m
            .graph(1, 2048, true)
            .unwrap_err()
            .to_string()
            .contains("1024 learned positions"));
    }
}
