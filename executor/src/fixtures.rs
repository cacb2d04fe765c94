//! The tiny models the equivalence tests train, one definition of each for the threads
//! backend's unit tests and the MPI matrix (`tests/mpi_equivalence.rs`), so that both backends
//! are checked on the same models. Not part of the executor's interface.

use parallax_ir::models::TransformerConfig;
use parallax_ir::{Layout, Schedule};

pub fn gpt(layers: u32) -> TransformerConfig {
    TransformerConfig::gpt(layers, 32, 4, 64, 64, 16)
}

pub fn llama(layers: u32) -> TransformerConfig {
    TransformerConfig::llama(layers, 32, 4, 2, 64, 64, 16)
}

/// A Mixtral-shaped tiny model: Llama layers whose MLP is 4 SwiGLU experts, top-2.
pub fn mixtral(layers: u32) -> TransformerConfig {
    TransformerConfig {
        moe: Some(parallax_ir::models::MoeConfig::routed(4, 2)),
        ..llama(layers)
    }
}

/// A mixture whose first layer and every other one after it are dense (72 wide): DeepSeek's
/// leading dense layers and Qwen2-MoE's sparse step, small.
pub fn mixed_dense(layers: u32) -> TransformerConfig {
    TransformerConfig {
        moe: Some(parallax_ir::models::MoeConfig {
            dense_layers_first: 1,
            every: 2,
            dense_ffn_hidden: 72,
            ..parallax_ir::models::MoeConfig::routed(4, 2)
        }),
        ..llama(layers)
    }
}

/// DeepSeek-V3's mixture, small: a leading dense layer, then MoE layers of 8 experts (top-2)
/// scored by sigmoid, chosen within the best 2 of 4 groups, renormalised and scaled 2.5, beside
/// a shared expert 48 wide.
pub fn deepseek_moe(layers: u32) -> TransformerConfig {
    TransformerConfig {
        moe: Some(parallax_ir::models::MoeConfig {
            router: parallax_ir::models::Router::Sigmoid,
            groups: 4,
            groups_per_token: 2,
            routed_scale_permille: 2500,
            shared_ffn_hidden: 48,
            dense_layers_first: 1,
            dense_ffn_hidden: 72,
            ..parallax_ir::models::MoeConfig::routed(8, 2)
        }),
        ..llama(layers)
    }
}

/// DeepSeek-V3, small: its mixture beneath multi-head latent attention (a query latent 16
/// wide, a key/value latent 12 wide, heads of 4 position-free and 4 rotary dimensions with
/// values 6 wide; `q_lora_rank` 0 projects the queries directly, as DeepSeek-V2-Lite).
pub fn deepseek(layers: u32, q_lora_rank: u64) -> TransformerConfig {
    TransformerConfig {
        kv_heads: 4,
        mla: Some(parallax_ir::models::MlaConfig {
            q_lora_rank,
            kv_lora_rank: 12,
            qk_nope_head_dim: 4,
            qk_rope_head_dim: 4,
            v_head_dim: 6,
        }),
        ..deepseek_moe(layers)
    }
}

/// DeepSeek-V3 with `modules` multi-token prediction modules after its last block.
pub fn deepseek_mtp(layers: u32, modules: u32) -> TransformerConfig {
    TransformerConfig {
        mtp_layers: modules,
        ..deepseek(layers, 16)
    }
}

/// Qwen2-MoE's mixture, small: softmax scores taken as they are (no renormalisation) beside a
/// shared expert 40 wide whose output a per-token sigmoid gate scales; biases on the query,
/// key and value projections alone.
pub fn qwen2_moe(layers: u32) -> TransformerConfig {
    TransformerConfig {
        qkv_bias: true,
        moe: Some(parallax_ir::models::MoeConfig {
            norm_top_k: false,
            shared_ffn_hidden: 40,
            shared_gate: true,
            ..parallax_ir::models::MoeConfig::routed(4, 2)
        }),
        ..llama(layers)
    }
}

/// GPT-OSS, small: attention sinks on every layer, every other layer a sliding window of 4
/// keys, biases on the attention projections, the router and the experts, whose gate is
/// GPT-OSS's clamped one, 4 experts (top-2).
pub fn gpt_oss(layers: u32) -> TransformerConfig {
    TransformerConfig {
        attention_sinks: true,
        bias: true,
        clamped_swiglu: true,
        sliding_window: Some(parallax_ir::models::SlidingWindow {
            size: 4,
            full_every: 2,
        }),
        ..mixtral(layers)
    }
}

/// BERT, small: post-norm GPT-shaped blocks attending to every key, token types and an
/// embedding norm, the pooler and next-sentence head, the masked-LM transform and tied decoder;
/// byte-level, as it reads a text (see the tests' `spec`).
pub fn bert(layers: u32) -> TransformerConfig {
    TransformerConfig {
        bert: true,
        causal: false,
        ..TransformerConfig::gpt(layers, 32, 4, 64, 256, 16)
    }
}

/// Nemotron-H, small: a hybrid stack of Mamba-2 mixers (4 heads of 8 in 2 groups, state 4,
/// chunks of 8), attention without position embedding, an MoE layer (sigmoid router, 4
/// squared-ReLU experts, top-2, a shared expert) and a dense squared-ReLU MLP layer.
pub fn nemotron_h(pattern: &str) -> TransformerConfig {
    TransformerConfig {
        mlp: parallax_ir::models::Mlp::SquaredRelu,
        position: parallax_ir::models::Position::None,
        moe: Some(parallax_ir::models::MoeConfig {
            router: parallax_ir::models::Router::Sigmoid,
            shared_ffn_hidden: 48,
            ..parallax_ir::models::MoeConfig::routed(4, 2)
        }),
        hybrid: Some(parallax_ir::models::HybridConfig {
            pattern: pattern.into(),
            mamba: parallax_ir::models::MambaConfig {
                heads: 4,
                head_dim: 8,
                state: 4,
                groups: 2,
                conv_kernel: 4,
                chunk: 8,
            },
        }),
        ..llama(pattern.len() as u32)
    }
}

/// Nemotron-4's layout, small: Llama layers with LayerNorm and an ungated squared-ReLU MLP.
pub fn nemotron(layers: u32) -> TransformerConfig {
    TransformerConfig {
        mlp: parallax_ir::models::Mlp::SquaredRelu,
        norm: parallax_ir::models::Norm::LayerNorm,
        ..llama(layers)
    }
}

/// Qwen3's attention, small: RMSNorms over each query and key head before the rotary
/// embedding, 4 query heads sharing 2 key/value heads.
pub fn qwen3(layers: u32) -> TransformerConfig {
    TransformerConfig {
        qk_norm: true,
        ..llama(layers)
    }
}

/// Llama layers without position embeddings (NoPE), every other one attending to the 4
/// latest keys only (GPT-OSS's alternation).
pub fn windowed_nope(layers: u32) -> TransformerConfig {
    TransformerConfig {
        position: parallax_ir::models::Position::None,
        sliding_window: Some(parallax_ir::models::SlidingWindow {
            size: 4,
            full_every: 2,
        }),
        ..llama(layers)
    }
}

pub fn pp(stages: u32, schedule: Schedule) -> Layout {
    Layout {
        pp: stages,
        schedule,
        ..Layout::default()
    }
}
