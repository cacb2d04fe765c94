//! The built-in model zoo: every entry with its published parameter count and where that count
//! was published.

use super::transformer::{
    HybridConfig, MambaConfig, MlaConfig, Mlp, MoeConfig, Position, Router, SlidingWindow,
    TransformerConfig,
};
use crate::graph::{Graph, GraphError};

/// How a zoo model is defined.
// A transformer's configuration (with a hybrid's pattern) is larger than a function pointer;
// the few entries are built per lookup, so boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum ZooDef {
    /// A transformer built from its dimensions at any batch and sequence length.
    Transformer(TransformerConfig),
    /// A fixed-architecture network built for a batch size (CNNs, ViT).
    Batched(fn(u64) -> Result<Graph, GraphError>),
    /// A sequence model built for a batch size and sequence length.
    Sequence(fn(u64, u64) -> Result<Graph, GraphError>),
}

/// One zoo entry.
#[derive(Clone, Debug)]
pub struct ZooEntry {
    pub name: &'static str,
    pub family: &'static str,
    /// Parameter count as published (rounded where the source rounds).
    pub published_params: f64,
    /// Relative precision of the published figure (0.05 / 1.3 for "1.3B").
    pub published_precision: f64,
    /// Where the published count comes from.
    pub source: &'static str,
    pub def: ZooDef,
}

/// A GPT with a 4·h MLP: GPT-2 (vocab 50257, 1024 positions), GPT-3 (Brown et al. 2020,
/// Table 2.1: vocab 50257, 2048 positions) and Megatron's weak-scaling family (Narayanan et al.
/// 2021, Table 1: vocab 51200, 2048 positions).
fn gpt(layers: u32, hidden: u64, heads: u64, vocab: u64, positions: u64) -> ZooDef {
    ZooDef::Transformer(TransformerConfig::gpt(
        layers,
        hidden,
        heads,
        4 * hidden,
        vocab,
        positions,
    ))
}

/// HuggingFace's GPT-2: its MLP's GeLU is `gelu_new` (`GPT2Config.activation_function`).
fn gpt2(layers: u32, hidden: u64, heads: u64) -> ZooDef {
    ZooDef::Transformer(TransformerConfig {
        mlp: Mlp::GeluNew,
        ..TransformerConfig::gpt(layers, hidden, heads, 4 * hidden, 50257, 1024)
    })
}

/// A GPT-shaped model with ALiBi instead of a position table (BLOOM, MPT): `bias` on its
/// linear layers and norms or not.
fn alibi_gpt(layers: u32, hidden: u64, heads: u64, vocab: u64, seq: u64, bias: bool) -> ZooDef {
    ZooDef::Transformer(TransformerConfig {
        position: Position::Alibi,
        bias,
        ..TransformerConfig::gpt(layers, hidden, heads, 4 * hidden, vocab, seq)
    })
}

fn gpt3(layers: u32, hidden: u64, heads: u64) -> ZooDef {
    gpt(layers, hidden, heads, 50257, 2048)
}

fn megatron(layers: u32, hidden: u64, heads: u64) -> ZooDef {
    gpt(layers, hidden, heads, 51200, 2048)
}

fn llama(layers: u32, hidden: u64, heads: u64, kv: u64, ffn: u64, vocab: u64, seq: u64) -> ZooDef {
    ZooDef::Transformer(TransformerConfig::llama(
        layers, hidden, heads, kv, ffn, vocab, seq,
    ))
}

/// Llama 3's shape: rotary base 500 000 (Llama Team 2024, §3.2; `rope_theta` of its HF config).
fn llama3(layers: u32, hidden: u64, heads: u64, ffn: u64) -> ZooDef {
    ZooDef::Transformer(TransformerConfig {
        rope_theta: 500_000,
        ..TransformerConfig::llama(layers, hidden, heads, 8, ffn, 128_256, 8192)
    })
}

/// Qwen3-MoE's shape (its HF configs): heads of 128 whatever the width, 4 KV heads, 128 experts
/// `ffn` wide with 8 per token, vocabulary 151,936, 40,960 positions, rotary base 10^6, untied,
/// query and key norms.
fn qwen3_moe(layers: u32, hidden: u64, heads: u64, ffn: u64) -> ZooDef {
    ZooDef::Transformer(TransformerConfig {
        head_dim: 128,
        qk_norm: true,
        moe: Some(MoeConfig::routed(128, 8)),
        rope_theta: 1_000_000,
        ..TransformerConfig::llama(layers, hidden, heads, 4, ffn, 151_936, 40960)
    })
}

/// DeepSeek-V3's shape (its HF config; Kimi K2 shares it): 61 layers of hidden 7168 with
/// multi-head latent attention (query latent 1536, key/value latent 512, heads of 128 + 64
/// rotary for queries and keys and 128 for values), `dense_first` dense layers 18432 wide, then
/// MoE layers of `experts` routed experts 2048 wide (top-8) beside one shared expert 2048 wide;
/// untied, `mtp` multi-token prediction modules, routing limited to some expert groups, the
/// routed experts' weights scaled by `scale_permille` thousandths (`routed_scaling_factor`).
#[allow(clippy::too_many_arguments)]
fn deepseek_v3(
    heads: u64,
    experts: u64,
    dense_first: u32,
    vocab: u64,
    mtp: u32,
    theta: u64,
    (groups, groups_per_token): (u32, u32),
    scale_permille: u32,
) -> ZooDef {
    ZooDef::Transformer(TransformerConfig {
        head_dim: 192,
        moe: Some(MoeConfig {
            router: Router::Sigmoid,
            groups,
            groups_per_token,
            routed_scale_permille: scale_permille,
            shared_ffn_hidden: 2048,
            dense_layers_first: dense_first,
            every: 1,
            dense_ffn_hidden: 18432,
            ..MoeConfig::routed(experts, 8)
        }),
        mla: Some(MlaConfig {
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        }),
        mtp_layers: mtp,
        rope_theta: theta,
        ..TransformerConfig::llama(61, 7168, heads, heads, 2048, vocab, 163_840)
    })
}

/// OpenAI's gpt-oss (its HF configs and model card): `layers` layers of hidden 2880, 64 query
/// heads of 64 and 8 key/value heads with biases, every other layer attending to a 128-token
/// window (the odd ones fully), `experts` SwiGLU experts 2880 wide, top-4, vocabulary 201,088,
/// untied, rotary base 150 000, a learned attention sink per head. The experts' biases and
/// the sinks' logits (0.03 % of the parameters) are not counted.
fn gpt_oss(layers: u32, experts: u64) -> ZooDef {
    ZooDef::Transformer(TransformerConfig {
        head_dim: 64,
        bias: true,
        moe: Some(MoeConfig::routed(experts, 4)),
        sliding_window: Some(SlidingWindow {
            size: 128,
            full_every: 2,
        }),
        rope_theta: 150_000,
        attention_sinks: true,
        clamped_swiglu: true,
        ..TransformerConfig::llama(layers, 2880, 64, 8, 2880, 201_088, 131_072)
    })
}

/// Nemotron 3 Nano 30B-A3B (NVIDIA 2025; its HF config and Megatron-Bridge recipe): a hybrid
/// stack of 23 Mamba-2 layers (64 heads of 64, state 128, 8 groups), 23 MoE layers (128
/// experts 1856 wide with squared ReLU, top-6, one shared expert 3712 wide) and 6 attention
/// layers (32 heads of 128, 2 KV heads, no position embedding); hidden 2688, RMSNorm,
/// vocabulary 131072, untied.
fn nemotron_3_nano() -> ZooDef {
    ZooDef::Transformer(TransformerConfig {
        head_dim: 128,
        mlp: Mlp::SquaredRelu,
        position: Position::None,
        moe: Some(MoeConfig {
            router: Router::Sigmoid,
            shared_ffn_hidden: 3712,
            ..MoeConfig::routed(128, 6)
        }),
        hybrid: Some(HybridConfig {
            pattern: "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME".into(),
            mamba: MambaConfig {
                heads: 64,
                head_dim: 64,
                state: 128,
                groups: 8,
                conv_kernel: 4,
                chunk: 128,
            },
        }),
        ..TransformerConfig::llama(52, 2688, 32, 2, 1856, 131_072, 262_144)
    })
}

/// Relative precision of a figure published to `digits` significant digits after the point
/// of its unit (e.g. 1.3B → 0.05 / 1.3).
fn rounded(value: f64, half_unit: f64) -> f64 {
    half_unit / value
}

const BROWN: &str = "Brown et al. 2020, GPT-3 paper, Table 2.1";
const NARAYANAN: &str = "Narayanan et al. 2021 (Megatron-LM PTD-P), Table 1";
const HF_GPT2: &str = "HuggingFace transformers GPT2LMHeadModel.num_parameters() (tied head), openai-community model cards";

/// Every built-in model.
pub fn entries() -> Vec<ZooEntry> {
    let e = |name, family, published_params: f64, precision: f64, source, def| ZooEntry {
        name,
        family,
        published_params,
        published_precision: precision,
        source,
        def,
    };
    let exact = 0.0;
    let b = 1e9;
    let mut v = vec![
        e("gpt2", "gpt2", 124_439_808.0, exact, HF_GPT2, gpt2(12, 768, 12)),
        e("gpt2-medium", "gpt2", 354_823_168.0, exact, HF_GPT2, gpt2(24, 1024, 16)),
        e("gpt2-large", "gpt2", 774_030_080.0, exact, HF_GPT2, gpt2(36, 1280, 20)),
        e("gpt2-xl", "gpt2", 1_557_611_200.0, exact, HF_GPT2, gpt2(48, 1600, 25)),
        e("gpt3-1.3b", "gpt3", 1.3 * b, rounded(1.3, 0.05), BROWN, gpt3(24, 2048, 16)),
        e("gpt3-6.7b", "gpt3", 6.7 * b, rounded(6.7, 0.05), BROWN, gpt3(32, 4096, 32)),
        e("gpt3-13b", "gpt3", 13.0 * b, rounded(13.0, 0.05), BROWN, gpt3(40, 5140, 40)),
        e("gpt3-175b", "gpt3", 175.0 * b, rounded(175.0, 0.05), BROWN, gpt3(96, 12288, 96)),
        e("megatron-1.7b", "megatron", 1.7 * b, rounded(1.7, 0.05), NARAYANAN, megatron(24, 2304, 24)),
        e("megatron-3.6b", "megatron", 3.6 * b, rounded(3.6, 0.05), NARAYANAN, megatron(30, 3072, 32)),
        e("megatron-7.5b", "megatron", 7.5 * b, rounded(7.5, 0.05), NARAYANAN, megatron(36, 4096, 32)),
        e("megatron-18.4b", "megatron", 18.4 * b, rounded(18.4, 0.05), NARAYANAN, megatron(40, 6144, 48)),
        e("megatron-39.1b", "megatron", 39.1 * b, rounded(39.1, 0.05), NARAYANAN, megatron(48, 8192, 64)),
        e("megatron-76.1b", "megatron", 76.1 * b, rounded(76.1, 0.05), NARAYANAN, megatron(60, 10240, 80)),
        e("megatron-145.6b", "megatron", 145.6 * b, rounded(145.6, 0.05), NARAYANAN, megatron(80, 12288, 96)),
        e("megatron-310.1b", "megatron", 310.1 * b, rounded(310.1, 0.05), NARAYANAN, megatron(96, 16384, 128)),
        e("megatron-529.6b", "megatron", 529.6 * b, rounded(529.6, 0.05), NARAYANAN, megatron(105, 20480, 128)),
        e("megatron-1t", "megatron", 1008.0 * b, rounded(1008.0, 0.05), NARAYANAN, megatron(128, 25600, 160)),
        e(
            "bloom-176b",
            "bloom",
            176_247_271_424.0,
            exact,
            "HuggingFace bigscience/bloom BloomForCausalLM.num_parameters() (70 layers, hidden 14336, 112 heads, vocab 250880, ALiBi, tied head; its embedding LayerNorm, 28,672 weights, omitted)",
            alibi_gpt(70, 14336, 112, 250_880, 2048, true),
        ),
        e(
            "mpt-7b",
            "mpt",
            6.7 * b,
            rounded(6.7, 0.05),
            "HuggingFace mosaicml/mpt-7b model card: 6.7B parameters; its config (32 layers, d_model 4096, 32 heads, vocab 50432, max_seq_len 2048, ALiBi, no_bias, tied head)",
            alibi_gpt(32, 4096, 32, 50_432, 2048, false),
        ),
        e(
            "mpt-30b",
            "mpt",
            30.0 * b,
            rounded(30.0, 0.5),
            "HuggingFace mosaicml/mpt-30b model card: 30B parameters; its config (48 layers, d_model 7168, 64 heads, vocab 50432, max_seq_len 8192, ALiBi, no_bias, tied head)",
            alibi_gpt(48, 7168, 64, 50_432, 8192, false),
        ),
        e(
            "llama2-7b",
            "llama2",
            6_738_415_616.0,
            exact,
            "HuggingFace meta-llama/Llama-2-7b-hf LlamaForCausalLM.num_parameters(); Touvron et al. 2023 round it to 7B",
            llama(32, 4096, 32, 32, 11008, 32000, 4096),
        ),
        e(
            "llama2-13b",
            "llama2",
            13_015_864_320.0,
            exact,
            "HuggingFace meta-llama/Llama-2-13b-hf LlamaForCausalLM.num_parameters()",
            llama(40, 5120, 40, 40, 13824, 32000, 4096),
        ),
        e(
            "llama2-70b",
            "llama2",
            68_976_648_192.0,
            exact,
            "HuggingFace meta-llama/Llama-2-70b-hf LlamaForCausalLM.num_parameters() (GQA, 8 KV heads)",
            llama(80, 8192, 64, 8, 28672, 32000, 4096),
        ),
        e(
            "llama3-8b",
            "llama3",
            8_030_261_248.0,
            exact,
            "HuggingFace meta-llama/Meta-Llama-3-8B model card (8.03B safetensors parameters)",
            llama3(32, 4096, 32, 14336),
        ),
        e(
            "llama3-70b",
            "llama3",
            70_553_706_496.0,
            exact,
            "HuggingFace meta-llama/Meta-Llama-3-70B model card (70.6B safetensors parameters)",
            llama3(80, 8192, 64, 28672),
        ),
        e(
            "llama3-405b",
            "llama3",
            405.0 * b,
            rounded(405.0, 0.5),
            "Llama Team 2024, 'The Llama 3 Herd of Models', Table 3 (405B: 126 layers, 16384 model dim, 53248 FFN dim, 128 heads, 8 KV heads)",
            llama3(126, 16384, 128, 53248),
        ),
        e(
            "mixtral-8x7b",
            "mixtral",
            46_702_792_704.0,
            exact,
            "HuggingFace mistralai/Mixtral-8x7B-v0.1 MixtralForCausalLM.num_parameters() (Jiang et al. 2024 quote 47B)",
            ZooDef::Transformer(TransformerConfig {
                moe: Some(MoeConfig::routed(8, 2)),
                ..TransformerConfig::llama(32, 4096, 32, 8, 14336, 32000, 32768)
            }),
        ),
        e(
            "mixtral-8x22b",
            "mixtral",
            141.0 * b,
            rounded(141.0, 0.5),
            "Mistral AI, 'Cheaper, Better, Faster, Stronger' (Mixtral 8x22B, April 2024): 141B total, 39B active; HuggingFace mistralai/Mixtral-8x22B-v0.1 config (56 layers, 6144 hidden, 48 heads, 8 KV heads, 16384 expert FFN, 8 experts top-2, vocab 32000, 65536 positions)",
            ZooDef::Transformer(TransformerConfig {
                moe: Some(MoeConfig::routed(8, 2)),
                rope_theta: 1_000_000,
                ..TransformerConfig::llama(56, 6144, 48, 8, 16384, 32000, 65536)
            }),
        ),
        e(
            "qwen3-30b-a3b",
            "qwen3-moe",
            30.5 * b,
            rounded(30.5, 0.05),
            "Qwen team, HuggingFace Qwen/Qwen3-30B-A3B model card: 30.5B total, 3.3B activated; its config (48 layers, 2048 hidden, 32 heads of 128, 4 KV heads, 128 experts of FFN 768, top-8, vocab 151936, 40960 positions, untied); q/k RMSNorms (256 weights a layer) omitted",
            qwen3_moe(48, 2048, 32, 768),
        ),
        e(
            "qwen3-235b-a22b",
            "qwen3-moe",
            235.0 * b,
            rounded(235.0, 0.5),
            "Qwen team, HuggingFace Qwen/Qwen3-235B-A22B model card: 235B total, 22B activated; its config (94 layers, 4096 hidden, 64 heads of 128, 4 KV heads, 128 experts of FFN 1536, top-8, vocab 151936, 40960 positions, untied); q/k RMSNorms omitted",
            qwen3_moe(94, 4096, 64, 1536),
        ),
        e(
            "deepseek-v3",
            "deepseek-v3",
            671.0 * b,
            rounded(671.0, 0.5),
            "DeepSeek-AI 2024, DeepSeek-V3 technical report §1 and its HF config: 671B total (685B on HF with the 14B multi-token prediction module, not counted here), 37B activated; 61 layers, hidden 7168, 128 heads of MLA (q latent 1536, kv latent 512, 128 + 64 rope, values 128), 3 dense layers of 18432, 256 routed experts of 2048 (top-8, routed_scaling_factor 2.5) and 1 shared, vocab 129280, 1 MTP module",
            deepseek_v3(128, 256, 3, 129_280, 1, 10_000, (8, 4), 2500),
        ),
        e(
            "kimi-k2",
            "deepseek-v3",
            1.0e3 * b,
            rounded(1.0, 0.05),
            "Moonshot AI, HF moonshotai/Kimi-K2-Instruct model card and config: 1T total, 32B activated (the tech report's 1.04T and 32.6B are 1.3 % and 1.2 % from this count); DeepSeek-V3's architecture with 64 heads, 384 routed experts (routed_scaling_factor 2.827), 1 leading dense layer, vocab 163840, rotary base 50000, no MTP",
            deepseek_v3(64, 384, 1, 163_840, 0, 50_000, (1, 1), 2827),
        ),
        e(
            "gpt-oss-20b",
            "gpt-oss",
            20.9 * b,
            rounded(20.9, 0.05),
            "OpenAI, gpt-oss-120b & gpt-oss-20b model card (2025), Table 1: 20.91B total, 3.61B active per token (unembedding counted, embedding not); HF openai/gpt-oss-20b config: 24 layers, hidden 2880, 64 heads of 64, 8 KV heads, 32 experts of 2880 top-4, sliding window 128 on alternate layers, vocab 201088",
            gpt_oss(24, 32),
        ),
        e(
            "gpt-oss-120b",
            "gpt-oss",
            116.8 * b,
            rounded(116.8, 0.05),
            "OpenAI, gpt-oss-120b & gpt-oss-20b model card (2025), Table 1: 116.83B total, 5.13B active per token (unembedding counted, embedding not); HF openai/gpt-oss-120b config: 36 layers, hidden 2880, 64 heads of 64, 8 KV heads, 128 experts of 2880 top-4, sliding window 128 on alternate layers, vocab 201088",
            gpt_oss(36, 128),
        ),
        e(
            "nemotron-h",
            "nemotron-h",
            31.6 * b,
            rounded(31.6, 0.05),
            "NVIDIA, HF nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 model card (31.6B total, 3.2B active, 3.6B with embeddings) and the shape of Megatron-LM's examples/post_training/modelopt/conf/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.sh and Megatron-Bridge's nemotron_3_nano recipe: 52 layers MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME (23 Mamba-2, 23 MoE, 6 attention), hidden 2688, Mamba 64 heads of 64 with state 128 in 8 groups, 128 experts of 1856 (squared ReLU, top-6) and a shared expert of 3712, attention 32 heads of 128 with 2 KV heads and no position embedding, vocab 131072, untied",
            nemotron_3_nano(),
        ),
        e(
            "bert-large",
            "bert",
            336_226_108.0,
            exact,
            "HuggingFace google-bert/bert-large-uncased BertForPreTraining.num_parameters(): BertModel 335,141,888 incl. pooler, MLM transform and output bias, NSP head (Devlin et al. 2019 round it to 340M)",
            ZooDef::Transformer(TransformerConfig {
                causal: false,
                bert: true,
                max_seq: 512,
                ..TransformerConfig::gpt(24, 1024, 16, 4096, 30522, 512)
            }),
        ),
        e(
            "gpt-tiny",
            "tiny",
            3_290_624.0,
            exact,
            "parallax's own CPU model: 12·l·h² + 13·l·h + (V + s)·h + 2h with l=4, h=256, V=256 (bytes), s=256",
            ZooDef::Transformer(TransformerConfig::gpt(4, 256, 4, 1024, 256, 256)),
        ),
        e(
            "mixtral-tiny",
            "tiny",
            1_838_208.0,
            exact,
            "parallax's own CPU mixture of experts: Mixtral's layout (Llama attention, 4 SwiGLU experts, top-2, untied) with l=4, h=128, 4 heads, 2 KV heads, expert FFN 256, V=256 (bytes)",
            ZooDef::Transformer(TransformerConfig {
                moe: Some(MoeConfig::routed(4, 2)),
                ..TransformerConfig::llama(4, 128, 4, 2, 256, 256, 256)
            }),
        ),
        e(
            "deepseek-tiny",
            "tiny",
            1_749_504.0,
            exact,
            "parallax's own CPU DeepSeek-V3: its layout (latent attention with a query latent 64 and a key/value latent 32 wide, heads of 32 + 16 rotary dimensions with values 32 wide; a leading dense layer 384 wide, then 8 SwiGLU experts 128 wide, top-2 by sigmoid score within the best 2 of 4 groups, scaled 2.5, beside a shared expert 128 wide; untied) with l=4, h=128, 4 heads, V=256 (bytes)",
            ZooDef::Transformer(TransformerConfig {
                head_dim: 48,
                moe: Some(MoeConfig {
                    router: Router::Sigmoid,
                    groups: 4,
                    groups_per_token: 2,
                    routed_scale_permille: 2500,
                    shared_ffn_hidden: 128,
                    dense_layers_first: 1,
                    dense_ffn_hidden: 384,
                    ..MoeConfig::routed(8, 2)
                }),
                mla: Some(MlaConfig {
                    q_lora_rank: 64,
                    kv_lora_rank: 32,
                    qk_nope_head_dim: 32,
                    qk_rope_head_dim: 16,
                    v_head_dim: 32,
                }),
                ..TransformerConfig::llama(4, 128, 4, 4, 128, 256, 256)
            }),
        ),
        e(
            "llama-tiny",
            "tiny",
            3_033_344.0,
            exact,
            "parallax's own CPU model: Llama layout with l=4, h=256, 8 heads, 4 KV heads, FFN 688, V=256 (bytes), untied",
            llama(4, 256, 8, 4, 688, 256, 256),
        ),
    ];
    v.extend(extra_entries());
    v
}

/// Non-transformer entries: CNNs, ViTs, recurrent models and a recommender.
fn extra_entries() -> Vec<ZooEntry> {
    use super::{amoebanet, classic, cnn, dlrm, gnmt, resnet, rnn, unet, vision};
    let e = |name, family, published_params: f64, source, def| ZooEntry {
        name,
        family,
        published_params,
        published_precision: 0.0,
        source,
        def,
    };
    // A figure the source rounds (precision as in `entries`).
    let r = |name, family, published_params: f64, precision: f64, source, def| ZooEntry {
        name,
        family,
        published_params,
        published_precision: precision,
        source,
        def,
    };
    vec![
        e("vit-b16", "vit", 86_567_656.0, "timm vit_base_patch16_224 (Dosovitskiy et al. 2021 round it to 86M)", ZooDef::Batched(vision::vit_b16)),
        e("vit-l16", "vit", 304_326_632.0, "timm vit_large_patch16_224 (Dosovitskiy et al. 2021 round it to 307M)", ZooDef::Batched(vision::vit_l16)),
        r(
            "vit-g14",
            "vit",
            1011e6,
            rounded(1011.0, 0.5),
            "Zhai et al. 2022, 'Scaling Vision Transformers', table 2 (ViT-g/14: width 1408, depth 40, MLP 6144, 16 heads, 1011M)",
            ZooDef::Batched(vision::vit_g14),
        ),
        e("alexnet", "alexnet", 61_100_840.0, "torchvision alexnet weights table (IMAGENET1K_V1)", ZooDef::Batched(classic::alexnet)),
        e("alexnet-tf", "alexnet", 61_838_248.0, "counted from tensorflow/benchmarks tf_cnn_benchmarks models/alexnet_model.py (no published count)", ZooDef::Batched(classic::alexnet_tf)),
        e("vgg16", "vgg", 138_357_544.0, "torchvision vgg16 weights table (IMAGENET1K_V1)", ZooDef::Batched(classic::vgg16)),
        e("resnet50", "resnet", 25_557_032.0, "torchvision resnet50 weights table (IMAGENET1K_V1)", ZooDef::Batched(resnet::resnet50)),
        e("resnet101", "resnet", 44_549_160.0, "torchvision resnet101 weights table (IMAGENET1K_V1)", ZooDef::Batched(resnet::resnet101)),
        e("resnet152", "resnet", 60_192_808.0, "torchvision resnet152 weights table (IMAGENET1K_V1)", ZooDef::Batched(resnet::resnet152)),
        e(
            "resnext101-32x4d",
            "resnext",
            44_177_704.0,
            "timm resnext101_32x4d (model card: 44.2 M params, 8.0 GMACs; Xie et al. 2017's ResNeXt-101 32x4d, as ported by pretrainedmodels); torchvision ships only 32x8d",
            ZooDef::Batched(resnet::resnext101_32x4d),
        ),
        e(
            "resnet-tiny",
            "tiny",
            5_266.0,
            "parallax's own CPU CNN: a CIFAR-style ResNet on 16x16x3 images (8-channel stem, two basic blocks of 8 and 16 channels, 10 classes), counted from its layer shapes",
            ZooDef::Batched(resnet::resnet_tiny),
        ),
        e(
            "vit-tiny",
            "tiny",
            19_626.0,
            "parallax's own CPU vision transformer: vit-b16's architecture on 16x16 images in 4x4 patches, width 32, 2 blocks of 4 heads, MLP 64, 10 classes, counted from its layer shapes",
            ZooDef::Batched(vision::vit_tiny),
        ),
        e(
            "lstm-tiny",
            "tiny",
            33_280.0,
            "parallax's own CPU language model: lstm-lm's architecture with a byte vocabulary (256), 2 x 32 LSTM, counted from its layer shapes",
            ZooDef::Sequence(rnn::lstm_tiny),
        ),
        e("inception-v3", "inception", 27_161_264.0, "torchvision inception_v3 weights table (with the auxiliary head)", ZooDef::Batched(cnn::inception_v3)),
        e(
            "lstm-lm",
            "lstm",
            37_275_408.0,
            "2 x 1024 LSTM on Penn Treebank words (vocab 10000): PyTorch's count 37,283,600 minus one of its two bias vectors per layer (8,192)",
            ZooDef::Sequence(rnn::lstm_lm),
        ),
        e(
            "lstm-lm-small",
            "lstm",
            4_651_600.0,
            "Zaremba et al. 2014 small PTB model (2 x 200, vocab 10000, unroll 20), counted as TensorFlow's ptb_word_lm.py SmallConfig builds it (one bias per layer; PyTorch's two make it 4,653,200); the paper prints no count",
            ZooDef::Sequence(rnn::lstm_lm_small),
        ),
        r(
            "lstm-lm-big",
            "lstm",
            66e6,
            rounded(66.0, 0.5),
            "Zaremba et al. 2014 large PTB model (2 x 1500, vocab 10000, unroll 35): 66M in Merity et al. 2017 (AWD-LSTM), table 1",
            ZooDef::Sequence(rnn::lstm_lm_big),
        ),
        e(
            "rnn-text-classifier",
            "lstm",
            52_788_226.0,
            "FlexFlow's RNNTC (Jia et al., SysML 2019: 4 recurrent layers + softmax, Movie Reviews); widths not published: 1024 hidden and Kim 2014's MR vocabulary 18,765 chosen here, count computed from that shape",
            ZooDef::Sequence(rnn::rnn_text_classifier),
        ),
        e(
            "gnmt-v2",
            "gnmt",
            160_671_297.0,
            "MLPerf Training GNMT v2 (NVIDIA DeepLearningExamples PyTorch GNMT v2 / MLPerf rnn_translator): NVIDIA's MLPerf GNMT optimizer tests state 'MLPerf GNMT has 160671297 parameters' and MLBench's GNMT task the same 160,671,297 (PyTorch's count, two biases per LSTM)",
            ZooDef::Sequence(gnmt::gnmt_v2),
        ),
        e(
            "dlrm",
            "dlrm",
            24_036_595_969.0,
            "MLPerf Training reference DLRM on Criteo Terabyte (facebookresearch/dlrm dlrm_s_pytorch.py with --max-ind-range=40000000: its 26 table sizes, 128-wide embeddings, bottom MLP 13-512-256-128, top MLP 479-1024-1024-512-256-1); count computed from those shapes",
            ZooDef::Batched(dlrm::dlrm_mlperf),
        ),
        e(
            "amoebanet-d-18-256",
            "amoebanet",
            122_470_120.0,
            "torchgpipe benchmarks/models/amoebanet amoebanetd(num_classes=1000, num_layers=18, num_filters=256), counted from the code (no published count for (18, 256)); the same builder reproduces torchgpipe's published (18, 208) 81.5M and (18, 416) 319.0M (docs/benchmarks.rst)",
            ZooDef::Batched(amoebanet::amoebanet_d_18_256),
        ),
        e(
            "unet-b5-c64",
            "unet",
            232_687_328.0,
            "torchgpipe benchmarks/models/unet unet(depth=5, num_convs=5, base_channels=64, input_channels=3, output_channels=1), conv weights counted from the code (no published count for (5, 64); 232,735,520 here with the InstanceNorm stand-ins' scales); the same builder reproduces torchgpipe's published (6, 72) 362.2M and (11, 128) 2.21B (docs/benchmarks.rst)",
            ZooDef::Batched(unet::unet_b5_c64),
        ),
    ]
}

/// The zoo entry called `name` (case-insensitive).
pub fn find(name: &str) -> Option<ZooEntry> {
    entries()
        .into_iter()
        .find(|e| e.name.eq_ignore_ascii_case(name))
}

/// The dimensions of the zoo transformer called `name`.
pub fn transformer(name: &str) -> Option<TransformerConfig> {
    match find(name)?.def {
        ZooDef::Transformer(c) => Some(c),
        _ => None,
    }
}

/// Names of all entries, comma-separated (for error messages).
pub fn names() -> String {
    entries()
        .iter()
        .map(|e| e.name)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::BuildOptions;

    /// Builds the entry's graph at batch 1 and a short sequence and counts its parameters.
    fn params(e: &ZooEntry) -> u64 {
        match &e.def {
            ZooDef::Transformer(cfg) => {
                // Closed form for the giants (a 405B graph is cheap, but 1T-scale tests stay
                // fast this way); checked against the graph for every model below 20B.
                let closed = cfg.params();
                if closed < 20_000_000_000 && !cfg.bert {
                    let g = cfg
                        .build(
                            e.name,
                            BuildOptions {
                                batch: 1,
                                seq: 8,
                                fused_attention: true,
                            },
                        )
                        .unwrap();
                    assert_eq!(g.param_count(), closed, "{}", e.name);
                }
                if cfg.bert {
                    let g = cfg
                        .build(
                            e.name,
                            BuildOptions {
                                batch: 1,
                                seq: 8,
                                fused_attention: true,
                            },
                        )
                        .unwrap();
                    return g.param_count();
                }
                closed
            }
            ZooDef::Batched(f) => f(1).unwrap().param_count(),
            ZooDef::Sequence(f) => f(1, 8).unwrap().param_count(),
        }
    }

    #[test]
    fn parameter_counts_match_published_within_one_percent() {
        let mut table = String::new();
        for e in entries() {
            let ours = params(&e) as f64;
            let err = (ours - e.published_params).abs() / e.published_params;
            // Within 1 %, or within the rounding of the published figure.
            let allowed = 0.01f64.max(e.published_precision);
            table.push_str(&format!(
                "{:<20} {:>18.0} {:>18.0} {:>7.3}%\n",
                e.name,
                ours,
                e.published_params,
                err * 100.0
            ));
            assert!(
                err <= allowed,
                "{}: {ours} vs published {} ({})",
                e.name,
                e.published_params,
                e.source
            );
        }
        println!("{table}");
    }

    /// Mixture-of-experts entries activate what their model cards say: every parameter but
    /// the experts a token does not reach (`(experts − top_k) / experts` of each layer's
    /// expert weights), within 1 % or the card's rounding.
    #[test]
    fn moe_entries_activate_the_published_share() {
        let published = [
            ("mixtral-8x7b", 12.9, 0.05, true),
            ("mixtral-8x22b", 39.0, 0.5, true),
            // The card's "3.3B" truncates: 3.35B by its config.
            ("qwen3-30b-a3b", 3.3, 0.1, true),
            ("qwen3-235b-a22b", 22.0, 0.5, true),
            // "37B" and "32B": this count (input embedding table counted active, as for the
            // others) gives 37.55B and 33.0B, 1.5 % and 3 % over; both cards round.
            ("deepseek-v3", 37.0, 0.6, true),
            ("kimi-k2", 32.0, 1.0, true),
            // With its embeddings, as the card counts them.
            ("nemotron-h", 3.6, 0.05, true),
            // OpenAI counts the unembedding active, not the input embedding.
            ("gpt-oss-20b", 3.61, 0.005, false),
            ("gpt-oss-120b", 5.13, 0.005, false),
        ];
        for (name, active_b, precision, embedding_active) in published {
            let e = find(name).unwrap();
            let ZooDef::Transformer(c) = &e.def else {
                panic!("{name} is a transformer")
            };
            let moe = c.moe.unwrap();
            let mats = if c.mlp == Mlp::Swiglu { 3 } else { 2 };
            let expert_weights_per_layer = moe.experts * mats * c.hidden * c.ffn_hidden;
            let moe_layers = (0..c.layers).filter(|&i| c.is_moe_layer(i)).count();
            let idle = (moe.experts - moe.top_k) as f64 / moe.experts as f64
                * expert_weights_per_layer as f64
                * moe_layers as f64;
            let embedding = if !embedding_active {
                (c.vocab * c.hidden) as f64
            } else {
                0.0
            };
            let active = params(&e) as f64 - idle - embedding;
            let err = (active / (active_b * 1e9) - 1.0).abs();
            let allowed = 0.01f64.max(rounded(active_b, precision));
            assert!(err <= allowed, "{name}: {active} active vs {active_b}B");
        }
    }

    #[test]
    fn names_are_unique_and_findable() {
        let all = entries();
        for e in &all {
            assert_eq!(all.iter().filter(|x| x.name == e.name).count(), 1);
            assert!(find(&e.name.to_uppercase()).is_some());
        }
        assert!(find("gpt5").is_none());
    }
}
