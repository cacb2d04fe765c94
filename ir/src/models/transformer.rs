//! Decoder and encoder transformers as graphs: GPT (LayerNorm, GeLU, learned positions), Llama
//! (RMSNorm, SwiGLU, RoPE, GQA), Mixtral (Llama with MoE MLPs), DeepSeek-V3 (latent attention,
//! shared experts, dense layers, multi-token prediction), BERT (post-norm encoder), and hybrid
//! stacks of Mamba-2, attention and MLP layers (Nemotron-H).

use crate::dtype::DType;
use crate::graph::{Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{
    Activation, AttentionAttrs, MatMulAttrs, MoeAttrs, OpKind, ReshapeAttrs, SplitAttrs, SsdAttrs,
};
use serde::{Deserialize, Serialize};

/// MLP kind of a transformer block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mlp {
    /// `fc(h→f) → GeLU → fc(f→h)`.
    Gelu,
    /// `fc(h→f) → GeLU → fc(f→h)`, its GeLU the tanh approximation written as eight pointwise
    /// ops (HuggingFace's `gelu_new`, `NewGELUActivation`: GPT-2, GPT-J, GPT-Neo, Phi):
    /// [`Activation::GeluNew`].
    GeluNew,
    /// `fc(h→f) → ReLU → fc(f→h)`.
    Relu,
    /// `fc(h→f) → ReLU² → fc(f→h)` (Primer, Nemotron).
    SquaredRelu,
    /// `down(silu(gate(x)) · up(x))` (Llama).
    Swiglu,
}

/// Normalization of a transformer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Norm {
    LayerNorm,
    RmsNorm,
}

/// How positions are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Position {
    /// A learned `(max_seq, hidden)` table added to the token embeddings.
    Learned,
    /// Rotary embeddings applied to queries and keys.
    Rope,
    /// None: order comes from causal masking alone (NoPE), or from the recurrent layers of a
    /// hybrid stack (Nemotron-H's attention layers have no position embedding).
    None,
    /// ALiBi (Press et al. 2022; BLOOM, MPT): no parameters; each head adds a fixed bias,
    /// its slope times the query-key distance, to its attention scores (see
    /// [`AttentionAttrs::alibi`](crate::op::AttentionAttrs::alibi)).
    Alibi,
}

/// Mixture-of-experts MLP settings: routed experts (each `ffn_hidden` of the model wide),
/// shared experts beside them, and which layers are MoE layers at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    pub experts: u64,
    pub top_k: u64,
    /// Width of the shared experts together (0: none): a dense MLP every token passes
    /// through beside the routed experts, in every MoE layer (DeepSeek-V2/V3, Qwen2-MoE,
    /// Llama 4; Megatron's `--moe-shared-expert-intermediate-size`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_ffn_hidden: u64,
    /// The shared experts' output scaled by a per-token sigmoid gate (Qwen2-MoE's
    /// `shared_expert_gate`, a `hidden → 1` linear); DeepSeek's are added as they are.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_gate: bool,
    /// Leading layers with a dense MLP instead (DeepSeek-V3: 3).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dense_layers_first: u32,
    /// From the first MoE layer on, every `every`-th layer is an MoE layer, the others dense
    /// (1: all of them).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub every: u32,
    /// MLP width of the dense layers (needed where there are any).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dense_ffn_hidden: u64,
    /// Group-limited routing (DeepSeek's `n_group` / `topk_group`): the experts form
    /// `groups` contiguous groups and a token's top-k come from at most `groups_per_token`
    /// of them (0: no limit).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub groups: u32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub groups_per_token: u32,
    /// How the router scores the experts (its top-k are the same either way; an engine must
    /// be told which to train the same model).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub router: Router,
    /// The k chosen scores renormalised to sum to one before they weight the experts'
    /// outputs (HuggingFace's `norm_topk_prob`: Mixtral and GPT-OSS by construction,
    /// DeepSeek-V3 and the Qwen3-MoE checkpoints); otherwise the scores as they are
    /// (Qwen2-MoE).
    #[serde(default = "yes", skip_serializing_if = "is_yes")]
    pub norm_top_k: bool,
    /// A factor on the routed experts' weights, in thousandths (DeepSeek-V3's
    /// `routed_scaling_factor` 2.5 is 2500).
    #[serde(default = "thousand", skip_serializing_if = "is_thousand")]
    pub routed_scale_permille: u32,
    /// Token dropping: each expert takes at most this many thousandths of its even share of
    /// the step's routed token copies (`capacity = factor × tokens × top_k / experts`,
    /// Megatron-Core's `--moe-expert-capacity-factor`, DeepSpeed-MoE's and GShard's
    /// `capacity_factor`); the copies beyond it are dropped (their expert output is zero and
    /// the token passes on through the residual). 0: dropless, every copy is computed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub capacity_permille: u32,
    /// Under a capacity, every expert's input is padded to it, so each computes and receives
    /// exactly `capacity` rows, however many were routed to it (Megatron's
    /// `--moe-pad-expert-input-to-capacity`; DeepSpeed-MoE and GShard's fixed-shape dispatch).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pad_to_capacity: bool,
    /// LatentMoE (NVIDIA's Nemotron 3; Megatron-Core `--moe-latent-size`): the routed experts
    /// work on a `latent`-wide projection of each token. The router scores the whole hidden
    /// state; a linear layer projects it down before the dispatch and another projects the
    /// combined expert output back up (Megatron-Core's `fc1_latent_proj`, `fc2_latent_proj`,
    /// replicated over tensor parallelism), so the dispatch moves latent-wide rows and each
    /// expert's weights are `latent × ffn`. 0: the experts work on the hidden state.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub latent: u32,
}

fn yes() -> bool {
    true
}

fn is_yes(b: &bool) -> bool {
    *b
}

fn thousand() -> u32 {
    1000
}

fn is_thousand(x: &u32) -> bool {
    *x == 1000
}

/// A router's score function.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Router {
    /// Softmax over the experts' logits (Mixtral, Qwen, GPT-OSS).
    #[default]
    Softmax,
    /// An independent sigmoid per expert, with a bias steering the top-k toward balance
    /// (DeepSeek-V3's auxiliary-loss-free balancing; Kimi K2, Nemotron 3).
    Sigmoid,
}

impl std::str::FromStr for Router {
    type Err = String;
    /// `softmax` or `sigmoid`, as HuggingFace's `scoring_func` and the case files spell them.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "softmax" => Ok(Router::Softmax),
            "sigmoid" => Ok(Router::Sigmoid),
            other => Err(format!("'{other}' is neither softmax nor sigmoid")),
        }
    }
}

pub(crate) fn is_zero<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

fn one() -> u32 {
    1
}

fn is_one(x: &u32) -> bool {
    *x == 1
}

impl MoeConfig {
    /// Every layer routed over `experts`, `top_k` each, nothing shared.
    pub fn routed(experts: u64, top_k: u64) -> Self {
        MoeConfig {
            experts,
            top_k,
            shared_ffn_hidden: 0,
            shared_gate: false,
            dense_layers_first: 0,
            every: 1,
            dense_ffn_hidden: 0,
            groups: 0,
            groups_per_token: 0,
            router: Router::Softmax,
            norm_top_k: true,
            routed_scale_permille: 1000,
            capacity_permille: 0,
            pad_to_capacity: false,
            latent: 0,
        }
    }

    /// [`MoeConfig::latent`] of a published latent width in a model `hidden` wide: 0 for a
    /// latent as wide as the model (no projection), `None` for one too wide to hold.
    pub fn latent_of(width: u64, hidden: u64) -> Option<u32> {
        if width == hidden {
            Some(0)
        } else {
            u32::try_from(width).ok()
        }
    }

    /// The width the routed experts work at for a model `hidden` wide: the latent width under
    /// LatentMoE, else the hidden width.
    pub fn expert_width(&self, hidden: u64) -> u64 {
        if self.latent > 0 {
            u64::from(self.latent)
        } else {
            hidden
        }
    }

    /// The factor on the routed experts' weights.
    pub fn routed_scale(&self) -> f64 {
        f64::from(self.routed_scale_permille) / 1000.0
    }

    /// [`MoeConfig::capacity_permille`] of a capacity factor: `None` for one that is not a
    /// finite number of at least 0.001 (0.0005 rounds up).
    pub fn capacity_permille_of(factor: f64) -> Option<u32> {
        let p = (factor * 1000.0).round();
        (factor.is_finite() && (1.0..=f64::from(u32::MAX)).contains(&p)).then_some(p as u32)
    }

    /// The capacity factor, where tokens beyond it are dropped; `None`: dropless.
    pub fn capacity_factor(&self) -> Option<f64> {
        (self.capacity_permille > 0).then(|| f64::from(self.capacity_permille) / 1000.0)
    }

    /// The load of the busiest expert rank relative to an even share of the routed copies,
    /// given what routing alone would give it (`routed`, from [`MoeConfig`]'s router: 1 when
    /// tokens are dealt out evenly, above 1 when drawn at random): a capacity caps it, and a
    /// padded one sets it.
    pub fn capped_load(&self, routed: f64) -> f64 {
        match self.capacity_factor() {
            None => routed,
            Some(c) if self.pad_to_capacity => c,
            Some(c) => routed.min(c),
        }
    }

    /// The most nodes a token's experts sit on when the experts are laid out contiguously over
    /// `nodes` nodes, under group-limited routing; `None` without a limit.
    pub fn nodes_per_token(&self, nodes: u32) -> Option<u32> {
        if self.groups <= 1 || self.groups_per_token == 0 || self.groups_per_token >= self.groups {
            return None;
        }
        // A group spans nodes / groups nodes (at least part of one).
        let per_group = nodes.div_ceil(self.groups).max(1);
        Some((self.groups_per_token * per_group).min(nodes))
    }

    /// Whether layer `i` (from 0) is an MoE layer.
    pub fn is_moe_layer(&self, i: u32) -> bool {
        self.moe_layers_in(i, 1) == 1
    }

    /// How many of layers `first .. first + n` are MoE layers (`dense_layers_first`,
    /// `dense_layers_first + every`, …), in closed form.
    pub fn moe_layers_in(&self, first: u32, n: u32) -> u32 {
        let (lead, every) = (self.dense_layers_first, self.every.max(1));
        let (lo, hi) = (first.max(lead), first.saturating_add(n));
        if lo >= hi {
            0
        } else {
            (hi - 1 - lead) / every + 1 - (lo - lead).div_ceil(every)
        }
    }

    /// Whether some layers have a dense MLP.
    pub fn has_dense_layers(&self) -> bool {
        self.dense_layers_first > 0 || self.every > 1
    }
}

/// Dimensions and flavour of a transformer language model.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformerConfig {
    pub layers: u32,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ffn_hidden: u64,
    pub vocab: u64,
    /// Longest sequence the model is built for (learned-position table size).
    pub max_seq: u64,
    pub mlp: Mlp,
    pub norm: Norm,
    pub position: Position,
    /// Biases on linear layers.
    pub bias: bool,
    /// Biases on the query, key and value projections only, where `bias` is off (Qwen2's
    /// modelling code: `q_proj`, `k_proj` and `v_proj` biased, `o_proj` and the MLP not).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub qkv_bias: bool,
    /// LM head shares the embedding table.
    pub tied_embeddings: bool,
    /// Dropout after attention and MLP (and on attention probabilities when unfused).
    pub dropout: bool,
    /// Causal (decoder) attention; false for encoders.
    pub causal: bool,
    /// Post-norm blocks with an embedding norm and pooler / MLM head (BERT).
    pub bert: bool,
    pub moe: Option<MoeConfig>,
    /// Base of the rotary frequencies (θ of RoFormer: 10 000; Llama 3: 500 000). It costs
    /// nothing; engines need it to build the same model.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: u64,
    /// Multi-head latent attention in place of q/k/v projections (DeepSeek-V2/V3, Kimi K2);
    /// `head_dim` is then the query/key head size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaConfig>,
    /// Multi-token prediction modules after the last layer (DeepSeek-V3: 1), each a block
    /// like the last and a second pass through the shared head.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_layers: u32,
    /// A hybrid stack: which layer is a Mamba-2 mixer, an attention, an MoE or a dense MLP
    /// layer (each alone with its norm and residual) instead of `layers` transformer blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<HybridConfig>,
    /// Sliding-window attention on some layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<SlidingWindow>,
    /// A learned attention-sink logit per head joins every softmax (gpt-oss; Megatron's
    /// `--softmax-type learnable`, "attention is off by one"): a head may attend to nothing.
    /// One scalar per head and layer and one more score per row: it costs nothing the model
    /// counts, but an engine must be told to train the same model.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attention_sinks: bool,
    /// RMSNorm on each head's queries and keys before the rotary embedding (Qwen3, Gemma 3,
    /// OLMo 2; Megatron's `--qk-layernorm`): two norm kernels over every head's vector, each
    /// with a `head_dim` weight shared by the heads; an engine must be told to train the same
    /// model. (Latent attention's norms of its compressed queries and keys belong to `mla`.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
    /// GPT-OSS's gated unit in place of SwiGLU's `silu(gate) · up`: `(clamp(up, −7, 7) + 1) ·
    /// g · σ(1.702 g)` with `g = min(gate, 7)` (HF's `GptOssExperts`, `swiglu_limit` 7.0;
    /// Megatron's quick GeGLU with `glu_linear_offset` 1 and `activation_func_clamp_value` 7).
    /// The same GEMMs and one pointwise kernel: priced as SwiGLU; an engine must be told to
    /// train the same model.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub clamped_swiglu: bool,
}

/// Sliding-window attention (Mistral 7B on every layer; GPT-OSS and Gemma 2 alternating with
/// full attention): a windowed layer's queries attend to the `size` latest keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlidingWindow {
    pub size: u64,
    /// Every `full_every`-th layer (the 2nd, 4th… for 2; Megatron's `window_attn_skip_freq`,
    /// HF's `layer_types`) attends to all keys; 0: none does.
    #[serde(default)]
    pub full_every: u32,
}

impl SlidingWindow {
    /// How many of layers `first .. first + n` attend fully.
    pub fn full_layers_in(&self, first: u32, n: u32) -> u32 {
        match self.full_every {
            0 => 0,
            k => (first + n) / k - first / k,
        }
    }
}

/// A hybrid stack of single-purpose layers (Nemotron-H; Megatron-LM's `MambaModel`): layer `i`
/// is `pattern[i]` of Megatron's `--hybrid-override-pattern` — `M` a Mamba-2 mixer, `*`
/// self-attention, `E` a mixture-of-experts MLP (the model's `moe`), `-` a dense MLP.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HybridConfig {
    pub pattern: String,
    pub mamba: MambaConfig,
}

/// A Mamba-2 mixer (Dao & Gu 2024): an input projection to the gate z, the convolved x, B and
/// C and the step sizes dt; the state-space scan over `heads` heads of `head_dim` channels with
/// a state of `state` per group of heads sharing B and C; a gated RMSNorm and an output
/// projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MambaConfig {
    pub heads: u64,
    pub head_dim: u64,
    pub state: u64,
    pub groups: u64,
    /// Width of the causal depthwise convolution (`d_conv`: 4 in every released model).
    #[serde(default = "default_conv_kernel")]
    pub conv_kernel: u64,
    /// Chunk length of the scan (Megatron-Core's `MambaMixer`: 128).
    #[serde(default = "default_chunk")]
    pub chunk: u64,
}

fn default_conv_kernel() -> u64 {
    4
}

fn default_chunk() -> u64 {
    128
}

impl MambaConfig {
    /// Channels of the scan: heads × head size.
    pub fn inner(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// The mixer's convolution-and-scan op.
    pub fn ssd(&self) -> SsdAttrs {
        SsdAttrs {
            heads: self.heads,
            head_dim: self.head_dim,
            state: self.state,
            groups: self.groups,
            conv_kernel: self.conv_kernel,
            chunk: self.chunk,
        }
    }
}

/// Which kind each layer of a model is ([`TransformerConfig::stack`]), for those that price
/// layers by kind.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerStack {
    pub layers: u32,
    pub moe: Option<MoeConfig>,
    /// A hybrid stack's pattern.
    pub pattern: Option<String>,
    pub window: Option<SlidingWindow>,
}

impl LayerStack {
    /// How many of layers `first .. first + n` are of each kind
    /// ([`TransformerConfig::layer_kinds_in`]).
    pub fn kinds_in(&self, first: u32, n: u32) -> [u32; LayerKind::COUNT] {
        kinds_in(
            self.layers,
            self.moe,
            self.pattern.as_deref().map(str::as_bytes),
            self.window,
            first,
            n,
        )
    }
}

/// Layers `first .. first + n` (of `layers`) counted by kind: a hybrid `pattern`'s symbols, a
/// mixture's MoE and dense blocks in closed form, sliding-window and full blocks in closed
/// form, else all blocks.
fn kinds_in(
    layers: u32,
    moe: Option<MoeConfig>,
    pattern: Option<&[u8]>,
    window: Option<SlidingWindow>,
    first: u32,
    n: u32,
) -> [u32; LayerKind::COUNT] {
    let mut counts = [0; LayerKind::COUNT];
    let end = first.saturating_add(n).min(layers);
    let n = end.saturating_sub(first);
    match (pattern, moe) {
        (Some(symbols), _) => {
            for &c in symbols.get(first as usize..end as usize).unwrap_or(&[]) {
                if let Some(k) = LayerKind::of_symbol(c) {
                    counts[k.index()] += 1;
                }
            }
        }
        (None, Some(m)) if m.has_dense_layers() => {
            let routed = m.moe_layers_in(first, n);
            counts[LayerKind::Block.index()] = routed;
            counts[LayerKind::DenseBlock.index()] = n - routed;
        }
        (None, _) => match window {
            Some(w) => {
                let full = w.full_layers_in(first, n);
                counts[LayerKind::Block.index()] = full;
                counts[LayerKind::WindowBlock.index()] = n - full;
            }
            None => counts[LayerKind::Block.index()] = n,
        },
    }
    counts
}

/// Attention input `t` of layer `p` reshaped to `[batch, seq, heads, head size]` (`shape`),
/// named after `name`.
fn split_heads(
    g: &mut GraphBuilder,
    p: &str,
    name: &str,
    t: TensorId,
    shape: [u64; 4],
) -> Result<TensorId, GraphError> {
    g.op1(
        format!("{p}.attn.{name}_heads"),
        OpKind::Reshape(ReshapeAttrs {
            shape: shape.to_vec(),
        }),
        &[t],
    )
}

/// The kinds of layer a stack is built of; each is priced by a section graph of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// A transformer block as most layers are: attention and MLP, the MLP routed over the
    /// experts in a mixture-of-experts model.
    Block,
    /// A block with a dense MLP among a mixture's MoE blocks (leading or in between).
    DenseBlock,
    /// A block whose attention is a sliding window (its MLP as a `Block`'s).
    WindowBlock,
    /// The layers of a hybrid stack: one Mamba-2 mixer, one attention, one MoE MLP or one
    /// dense MLP, each with its pre-norm and residual.
    Mamba,
    Attention,
    Moe,
    Mlp,
}

impl LayerKind {
    pub const COUNT: usize = 7;
    pub const ALL: [LayerKind; LayerKind::COUNT] = [
        LayerKind::Block,
        LayerKind::DenseBlock,
        LayerKind::WindowBlock,
        LayerKind::Mamba,
        LayerKind::Attention,
        LayerKind::Moe,
        LayerKind::Mlp,
    ];

    /// Position in [`LayerKind::ALL`] (and in per-kind arrays).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The kind as reports name it.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Block => "block",
            LayerKind::DenseBlock => "dense block",
            LayerKind::WindowBlock => "window block",
            LayerKind::Mamba => "mamba",
            LayerKind::Attention => "attention",
            LayerKind::Moe => "moe",
            LayerKind::Mlp => "mlp",
        }
    }

    /// The kind counted in the counts of one layer.
    pub fn of_one(counts: [u32; LayerKind::COUNT]) -> Option<LayerKind> {
        LayerKind::ALL.into_iter().find(|k| counts[k.index()] == 1)
    }

    /// The kind a hybrid pattern's symbol names.
    pub fn of_symbol(c: u8) -> Option<LayerKind> {
        match c {
            b'M' => Some(LayerKind::Mamba),
            b'*' => Some(LayerKind::Attention),
            b'E' => Some(LayerKind::Moe),
            b'-' => Some(LayerKind::Mlp),
            _ => None,
        }
    }

    /// Whether the layer has an attention (and with it context parallelism's exchange).
    pub fn has_attention(self) -> bool {
        matches!(
            self,
            LayerKind::Block
                | LayerKind::DenseBlock
                | LayerKind::WindowBlock
                | LayerKind::Attention
        )
    }

    /// Whether the layer's MLP routes over the experts, in a model that has them (`mixture`).
    pub fn routes(self, mixture: bool) -> bool {
        match self {
            LayerKind::Block | LayerKind::WindowBlock => mixture,
            LayerKind::Moe => true,
            _ => false,
        }
    }

    /// Tensor-parallel regions (a column- then a row-parallel projection, entered by an
    /// all-reduce or a gather and left by a reduce-scatter) of a dense layer of this kind:
    /// attention and MLP in a block, one in the others.
    pub fn tp_regions(self) -> u32 {
        match self {
            LayerKind::Block | LayerKind::DenseBlock | LayerKind::WindowBlock => 2,
            _ => 1,
        }
    }
}

/// Multi-head latent attention (DeepSeek-V2, Liu et al. 2024): queries from a low-rank latent,
/// keys and values up-projected from a shared latent per token, and a rotary part of every
/// key shared by all heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaConfig {
    /// Query latent width (0: queries projected directly, as DeepSeek-V2-Lite).
    pub q_lora_rank: u64,
    /// Key/value latent width.
    pub kv_lora_rank: u64,
    /// Per head: the query/key part without and with rotary embedding, and the value size.
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

/// RoFormer's rotary base (Su et al. 2021), every engine's default.
pub const DEFAULT_ROPE_THETA: u64 = 10_000;

fn default_rope_theta() -> u64 {
    DEFAULT_ROPE_THETA
}

/// A part of a transformer, for [`TransformerConfig::build_section`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Section {
    Embedding,
    /// One layer of the given kind.
    Layer(LayerKind),
    Head,
    /// What a multi-token prediction module adds before its block: the next tokens'
    /// embedding (its own copy of the table, as a pipeline's last stage keeps one), the two
    /// norms and the projection of their concatenation (its block and its pass through the
    /// head are priced as those).
    MtpInput,
}

/// Options for building a transformer graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BuildOptions {
    pub batch: u64,
    pub seq: u64,
    /// Use a fused (flash) attention kernel.
    pub fused_attention: bool,
}

/// The most parameters a model may have: 10^15, a thousand times the largest trained.
const MAX_PARAMS: f64 = 1e15;

impl TransformerConfig {
    /// A GPT-style model (LayerNorm, GeLU, learned positions, biases, tied head, dropout).
    pub fn gpt(
        layers: u32,
        hidden: u64,
        heads: u64,
        ffn_hidden: u64,
        vocab: u64,
        max_seq: u64,
    ) -> Self {
        TransformerConfig {
            layers,
            hidden,
            heads,
            kv_heads: heads,
            // 0 heads leave head_dim 0, which `validate` reports (no division by zero here).
            head_dim: hidden.checked_div(heads).unwrap_or(0),
            ffn_hidden,
            vocab,
            max_seq,
            mlp: Mlp::Gelu,
            norm: Norm::LayerNorm,
            position: Position::Learned,
            bias: true,
            qkv_bias: false,
            tied_embeddings: true,
            dropout: true,
            causal: true,
            bert: false,
            moe: None,
            rope_theta: DEFAULT_ROPE_THETA,
            mla: None,
            mtp_layers: 0,
            hybrid: None,
            sliding_window: None,
            attention_sinks: false,
            qk_norm: false,
            clamped_swiglu: false,
        }
    }

    /// A Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied head, no dropout).
    pub fn llama(
        layers: u32,
        hidden: u64,
        heads: u64,
        kv_heads: u64,
        ffn_hidden: u64,
        vocab: u64,
        max_seq: u64,
    ) -> Self {
        TransformerConfig {
            layers,
            hidden,
            heads,
            kv_heads,
            // 0 heads leave head_dim 0, which `validate` reports (no division by zero here).
            head_dim: hidden.checked_div(heads).unwrap_or(0),
            ffn_hidden,
            vocab,
            max_seq,
            mlp: Mlp::Swiglu,
            norm: Norm::RmsNorm,
            position: Position::Rope,
            bias: false,
            qkv_bias: false,
            tied_embeddings: false,
            dropout: false,
            causal: true,
            bert: false,
            moe: None,
            rope_theta: DEFAULT_ROPE_THETA,
            mla: None,
            mtp_layers: 0,
            hybrid: None,
            sliding_window: None,
            attention_sinks: false,
            qk_norm: false,
            clamped_swiglu: false,
        }
    }

    /// Checks the dimensions: one line per problem, naming the field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("layers", u64::from(self.layers)),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("ffn_hidden", self.ffn_hidden),
            ("vocab", self.vocab),
            ("max_seq", self.max_seq),
        ];
        if let Some((k, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{k} must be positive"));
        }
        // Bounds far above any published model (the deepest have ~100 layers, the widest a
        // hidden size of ~25 k, the largest vocabularies ~256 k) that keep every count exact.
        let at_most = [
            ("layers", u64::from(self.layers), 1u64 << 14),
            ("hidden", self.hidden, 1 << 20),
            ("heads", self.heads, 1 << 16),
            ("kv_heads", self.kv_heads, 1 << 16),
            ("head_dim", self.head_dim, 1 << 16),
            ("ffn_hidden", self.ffn_hidden, 1 << 22),
            ("vocab", self.vocab, 1 << 24),
            ("max_seq", self.max_seq, crate::load::MAX_SEQ),
            ("moe.experts", self.moe.map_or(1, |m| m.experts), 1 << 16),
            (
                "moe.latent",
                self.moe.map_or(0, |m| u64::from(m.latent)),
                1 << 20,
            ),
        ];
        if let Some((k, v, max)) = at_most.iter().find(|(_, v, max)| v > max) {
            return Err(format!("{k} {v} is beyond the {max} parallax models"));
        }
        // One block's count fits u64 under the bounds above (< 2^62); the whole model, summed
        // in f64, may not.
        if let Some(m) = self.hybrid.as_ref().map(|h| h.mamba) {
            // Checked before any layer's count is taken.
            let dims = [
                ("hybrid.mamba.heads", m.heads, 1u64 << 16),
                ("hybrid.mamba.head_dim", m.head_dim, 1 << 16),
                ("hybrid.mamba.state", m.state, 1 << 16),
                ("hybrid.mamba.groups", m.groups, 1 << 16),
                ("hybrid.mamba.conv_kernel", m.conv_kernel, 1 << 8),
                ("hybrid.mamba.chunk", m.chunk, 1 << 16),
            ];
            if let Some((k, v, max)) = dims.iter().find(|(_, v, max)| *v == 0 || v > max) {
                return Err(format!("{k} {v} must be between 1 and {max}"));
            }
            if m.heads % m.groups != 0 {
                return Err(format!(
                    "hybrid.mamba: groups ({}) must divide heads ({})",
                    m.groups, m.heads
                ));
            }
        }
        if let Some(h) = &self.hybrid {
            if h.pattern.len() != self.layers as usize {
                return Err(format!(
                    "hybrid.pattern has {} symbols for {} layers",
                    h.pattern.len(),
                    self.layers
                ));
            }
            if let Some(c) = h.pattern.chars().find(|c| {
                u8::try_from(*c)
                    .ok()
                    .and_then(LayerKind::of_symbol)
                    .is_none()
            }) {
                return Err(format!(
                    "hybrid.pattern: '{c}' is none of M (Mamba-2), * (attention), E (mixture of experts), - (MLP)"
                ));
            }
            match self.moe {
                None if h.pattern.contains('E') => {
                    return Err("hybrid.pattern: E layers need a moe section".into())
                }
                Some(m) if m.has_dense_layers() => {
                    return Err(
                        "hybrid: dense layers are '-' in the pattern, not moe.dense_layers_first or moe.every"
                            .into(),
                    )
                }
                _ => {}
            }
            if self.bert || self.mla.is_some() || self.sliding_window.is_some() {
                return Err(
                    "hybrid: a hybrid stack has neither BERT blocks, latent attention nor sliding windows"
                        .into(),
                );
            }
        }
        if let Some(w) = self.sliding_window {
            if w.size == 0 || !self.causal {
                return Err("sliding_window: a causal model's window of at least one key".into());
            }
            if self.moe.is_some_and(|m| m.has_dense_layers()) {
                return Err(
                    "sliding_window: windows beside a mixture's dense layers are not modelled"
                        .into(),
                );
            }
        }
        if self.heads % self.kv_heads != 0 {
            return Err(format!(
                "heads ({}) must be a multiple of kv_heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if let Some(m) = self.moe {
            if m.experts == 0 || m.top_k == 0 || m.top_k > m.experts {
                return Err(format!(
                    "moe: top_k ({}) must be between 1 and experts ({})",
                    m.top_k, m.experts
                ));
            }
            if m.every == 0 || m.dense_layers_first >= self.layers {
                return Err(format!(
                    "moe: every ({}) must be at least 1 and dense_layers_first ({}) below the {} layers",
                    m.every, m.dense_layers_first, self.layers
                ));
            }
            if m.has_dense_layers() && m.dense_ffn_hidden == 0 {
                return Err("moe: dense layers need dense_ffn_hidden".into());
            }
            // A capacity of at most every copy on one expert (experts / top_k even shares).
            let most = (m.experts / m.top_k).max(1);
            if u64::from(m.capacity_permille) > most * 1000 {
                return Err(format!(
                    "moe: capacity factor {} is beyond {most} (experts / top_k), where one expert would take every routed copy",
                    f64::from(m.capacity_permille) / 1000.0
                ));
            }
            if m.pad_to_capacity && m.capacity_permille == 0 {
                return Err("moe: pad_to_capacity needs a capacity factor".into());
            }
            // Group-limited routing: equal groups, and enough experts in the kept ones for
            // the top-k (DeepSeek's `n_group` / `topk_group`).
            if m.groups > 1 && m.groups_per_token > 0 {
                let (g, keep) = (u64::from(m.groups), u64::from(m.groups_per_token));
                if m.experts % g != 0 || keep > g || keep * (m.experts / g) < m.top_k {
                    return Err(format!(
                        "moe: groups ({g}) must divide experts ({}), and groups_per_token ({keep}) be at most groups and hold the top_k ({}) experts",
                        m.experts, m.top_k
                    ));
                }
            }
            let wide = [
                ("moe.shared_ffn_hidden", m.shared_ffn_hidden),
                ("moe.dense_ffn_hidden", m.dense_ffn_hidden),
            ];
            if let Some((k, v)) = wide.iter().find(|(_, v)| *v > 1 << 22) {
                return Err(format!(
                    "{k} {v} is beyond the {} parallax models",
                    1u64 << 22
                ));
            }
        }
        if let Some(a) = self.mla {
            if self.bias || self.qkv_bias || self.kv_heads != self.heads {
                return Err(
                    "mla: latent attention has no biases and one key/value head per query head"
                        .into(),
                );
            }
            if a.qk_nope_head_dim.checked_add(a.qk_rope_head_dim) != Some(self.head_dim)
                || a.kv_lora_rank == 0
                || a.v_head_dim == 0
                || a.qk_rope_head_dim % 2 != 0
            {
                return Err(format!(
                    "mla: qk_nope_head_dim ({}) + qk_rope_head_dim ({}, even) must be head_dim ({}); kv_lora_rank and v_head_dim positive",
                    a.qk_nope_head_dim, a.qk_rope_head_dim, self.head_dim
                ));
            }
            let wide = [a.q_lora_rank, a.kv_lora_rank, a.v_head_dim];
            if wide.iter().any(|&v| v > 1 << 20) {
                return Err("mla: a dimension is beyond the 2^20 parallax models".into());
            }
        }
        if self.clamped_swiglu && self.mlp != Mlp::Swiglu {
            return Err(format!(
                "clamped_swiglu: GPT-OSS's clamped gate is a SwiGLU variant; the MLP is {:?}",
                self.mlp
            ));
        }
        if self.position == Position::Rope && self.head_dim % 2 != 0 {
            return Err(format!(
                "head_dim ({}) must be even for rotary embeddings",
                self.head_dim
            ));
        }
        // Counted last: every width a layer's count multiplies is bounded by now.
        let widest = LayerKind::ALL
            .iter()
            .map(|k| self.layer_params(*k))
            .max()
            .unwrap_or(0);
        let params =
            f64::from(self.layers) * widest as f64 + (self.vocab as f64) * (self.hidden as f64);
        if params > MAX_PARAMS {
            return Err(format!(
                "{params:.3e} parameters is beyond the {MAX_PARAMS:e} parallax models"
            ));
        }
        Ok(())
    }

    /// Parameters of the model in closed form (the graph's count): the token embedding and
    /// learned positions, an untied head, the final norm and every layer. Multi-token
    /// prediction modules are not counted (published totals leave them out), nor BERT's
    /// pooler and masked-LM transform.
    pub fn params(&self) -> u64 {
        let positions = if self.position == Position::Learned {
            self.max_seq * self.hidden
        } else {
            0
        };
        let head = if self.tied_embeddings {
            0
        } else {
            self.vocab * self.hidden
        };
        let final_norm = if self.norm == Norm::LayerNorm { 2 } else { 1 } * self.hidden;
        self.vocab * self.hidden + positions + head + final_norm + self.blocks_params()
    }

    /// Parameters of all layers, each kind at its count.
    pub fn blocks_params(&self) -> u64 {
        let counts = self.layer_kinds_in(0, self.layers);
        LayerKind::ALL
            .iter()
            .map(|k| u64::from(counts[k.index()]) * self.layer_params(*k))
            .sum()
    }

    /// Parameters of one layer of `kind`, in closed form (equals the graph's count; 0 for a
    /// kind whose parts the model lacks, such as a Mamba layer of a model without one).
    pub fn layer_params(&self, kind: LayerKind) -> u64 {
        let norm = if self.norm == Norm::LayerNorm {
            2 * self.hidden
        } else {
            self.hidden
        };
        match kind {
            LayerKind::Block | LayerKind::WindowBlock => {
                self.attention_params() + self.mlp_params(self.moe.is_some()) + 2 * norm
            }
            LayerKind::DenseBlock => self.attention_params() + self.mlp_params(false) + 2 * norm,
            LayerKind::Attention => self.attention_params() + norm,
            LayerKind::Moe => self.mlp_params(true) + norm,
            LayerKind::Mlp => self.mlp_params(false) + norm,
            LayerKind::Mamba => match &self.hybrid {
                Some(hy) => {
                    let (m, h, b) = (hy.mamba, self.hidden, u64::from(self.bias));
                    let (inner, conv) = (m.inner(), m.ssd().conv_channels());
                    let proj = inner + conv + m.heads;
                    h * proj
                        + b * proj
                        + conv * (m.conv_kernel + 1)
                        + 3 * m.heads
                        + inner
                        + inner * h
                        + b * h
                        + norm
                }
                None => 0,
            },
        }
    }

    /// Parameters of the attention with its output projection.
    fn attention_params(&self) -> u64 {
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        let (b, bqkv) = (u64::from(self.bias), u64::from(self.bias || self.qkv_bias));
        match self.mla {
            Some(a) => {
                let (heads, dqk) = (self.heads, a.qk_nope_head_dim + a.qk_rope_head_dim);
                let query = match a.q_lora_rank {
                    0 => h * heads * dqk,
                    r => h * r + r + r * heads * dqk,
                };
                let kv = h * (a.kv_lora_rank + a.qk_rope_head_dim)
                    + a.kv_lora_rank
                    + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim);
                query + kv + heads * a.v_head_dim * h
            }
            None => {
                let qk_norm = if self.qk_norm { 2 * self.head_dim } else { 0 };
                h * (q + 2 * kv) + q * h + bqkv * (q + 2 * kv) + b * h + qk_norm
            }
        }
    }

    /// Parameters of the MLP: routed over the experts (with the shared ones) where `moe` and
    /// the model has experts, else dense at [`Self::dense_ffn`].
    fn mlp_params(&self, moe: bool) -> u64 {
        let (h, b) = (self.hidden, u64::from(self.bias));
        let mats = if self.mlp == Mlp::Swiglu { 3 } else { 2 };
        // A gated MLP's gate and up projections each carry a bias where the model has them.
        let dense = |f: u64| mats * h * f + b * ((mats - 1) * f + h);
        match self.moe {
            Some(m) if moe => {
                let shared = if m.shared_ffn_hidden > 0 {
                    dense(m.shared_ffn_hidden)
                } else {
                    0
                };
                let w = m.expert_width(h);
                // LatentMoE's projections down and back up.
                let latent = if m.latent > 0 {
                    2 * h * w + b * (w + h)
                } else {
                    0
                };
                w * m.experts + m.experts * mats * w * self.ffn_hidden + shared + latent
            }
            _ => dense(self.dense_ffn()),
        }
    }

    /// Whether layer `i` (from 0) routes over experts.
    pub fn is_moe_layer(&self, i: u32) -> bool {
        self.layer_kind(i).routes(self.moe.is_some())
    }

    /// The kind of layer `i` (from 0).
    pub fn layer_kind(&self, i: u32) -> LayerKind {
        LayerKind::of_one(self.layer_kinds_in(i, 1)).unwrap_or(LayerKind::Block)
    }

    /// How many of layers `first .. first + n` are of each kind (indexed by
    /// [`LayerKind::index`]): a mixture's MoE and dense blocks in closed form, a hybrid
    /// pattern's symbols counted.
    pub fn layer_kinds_in(&self, first: u32, n: u32) -> [u32; LayerKind::COUNT] {
        kinds_in(
            self.layers,
            self.moe,
            self.hybrid.as_ref().map(|h| h.pattern.as_bytes()),
            self.sliding_window,
            first,
            n,
        )
    }

    /// Which layer is which kind, apart from the rest of the model.
    pub fn stack(&self) -> LayerStack {
        LayerStack {
            layers: self.layers,
            moe: self.moe,
            pattern: self.hybrid.as_ref().map(|h| h.pattern.clone()),
            window: self.sliding_window,
        }
    }

    /// The kinds of layer the model has, in [`LayerKind::ALL`]'s order.
    pub fn layer_kinds(&self) -> impl Iterator<Item = LayerKind> {
        let counts = self.layer_kinds_in(0, self.layers);
        LayerKind::ALL
            .into_iter()
            .filter(move |k| counts[k.index()] > 0)
    }

    /// MLP width of a dense layer: the model's, or its dense layers' in a mixture of experts.
    pub fn dense_ffn(&self) -> u64 {
        match self.moe {
            Some(m) if m.dense_ffn_hidden > 0 => m.dense_ffn_hidden,
            _ => self.ffn_hidden,
        }
    }

    /// Builds the training graph for `opts.batch` sequences of `opts.seq` tokens, ending in the
    /// loss. Blocks are `Segment::Block(i)`; embeddings `Pre`; final norm, head and loss `Post`.
    pub fn build(&self, name: &str, opts: BuildOptions) -> Result<Graph, GraphError> {
        let mut g = GraphBuilder::new(name);
        let (mut x, table) = self.embed(&mut g, opts)?;
        for i in 0..self.layers {
            g.segment(Segment::Block(i));
            x = self.layer(&mut g, &format!("layers.{i}"), x, opts, self.layer_kind(i))?;
        }
        g.segment(Segment::Post);
        let main = self.norm_for_head(&mut g, "final_norm", x)?;
        let head_table = self.head_table(&mut g, self.head_reads_table().then_some(table));
        let mut loss = self.head(&mut g, main, head_table, opts, None)?;
        // Multi-token prediction: module j predicts token t + j + 1 from the previous
        // module's hidden state and token t + j's embedding (DeepSeek-V3 §2.2), through a
        // block like the last layer and the same head; its loss adds to the main one.
        let mut h_prev = x;
        for j in 0..self.mtp_layers {
            let p = format!("mtp.{j}");
            let proj = self.mtp_input(&mut g, &p, h_prev, table, opts)?;
            h_prev = self.layer(&mut g, &p, proj, opts, self.layer_kind(self.layers - 1))?;
            let out = self.norm_for_head(&mut g, &format!("{p}.final_norm"), h_prev)?;
            let extra = self.head(&mut g, out, head_table, opts, Some(&p))?;
            loss = g.op1(format!("{p}.loss_sum"), OpKind::Add, &[loss, extra])?;
        }
        g.finish(&[loss])
    }

    /// A multi-token prediction module's input from the previous hidden state `x`: the next
    /// tokens' embedding from `table` and `x`, each normalized, concatenated and projected back
    /// to the hidden width.
    fn mtp_input(
        &self,
        g: &mut GraphBuilder,
        p: &str,
        x: TensorId,
        table: TensorId,
        opts: BuildOptions,
    ) -> Result<TensorId, GraphError> {
        let h = self.hidden;
        let ids = g.input(format!("{p}.tokens"), [opts.batch, opts.seq], DType::I64);
        let e = g.op1(
            format!("{p}.embed"),
            OpKind::Embedding(crate::op::EmbeddingAttrs {
                vocab: self.vocab,
                dim: h,
            }),
            &[ids, table],
        )?;
        let e = self.norm(g, &format!("{p}.enorm"), e)?;
        let x = self.norm(g, &format!("{p}.hnorm"), x)?;
        let both = g.op1(
            format!("{p}.concat"),
            OpKind::Concat(crate::op::AxisAttrs { axis: 2 }),
            &[e, x],
        )?;
        g.linear(&format!("{p}.proj"), both, h, false)
    }

    /// One section of the model as a graph of its own: the embeddings (ending in the first
    /// block's input), one block (from an input `x` of shape `[batch, seq, hidden]`), or the head
    /// (from `x` to the loss; it owns a copy of the table when embeddings are tied, as the last
    /// pipeline stage does in Megatron-LM). Cost models price a layout from these.
    pub fn build_section(&self, section: Section, opts: BuildOptions) -> Result<Graph, GraphError> {
        let mut g = GraphBuilder::new(format!("{section:?}"));
        let x_in =
            |g: &mut GraphBuilder| g.input("x", [opts.batch, opts.seq, self.hidden], DType::F32);
        let out = match section {
            Section::Embedding => self.embed(&mut g, opts)?.0,
            Section::Layer(kind) => {
                g.segment(Segment::Block(0));
                let x = x_in(&mut g);
                self.layer(&mut g, "layers.0", x, opts, kind)?
            }
            Section::Head => {
                g.segment(Segment::Post);
                let x = x_in(&mut g);
                let table = self
                    .head_reads_table()
                    .then(|| g.weight("embed.weight", [self.vocab, self.hidden]));
                let x = self.norm_for_head(&mut g, "final_norm", x)?;
                let table = self.head_table(&mut g, table);
                self.head(&mut g, x, table, opts, None)?
            }
            Section::MtpInput => {
                g.segment(Segment::Post);
                let x = x_in(&mut g);
                let table = g.weight("mtp.embed.weight", [self.vocab, self.hidden]);
                self.mtp_input(&mut g, "mtp.0", x, table, opts)?
            }
        };
        g.finish(&[out])
    }

    /// The dimensions one tensor-parallel rank holds (Megatron-LM splits): heads, KV heads,
    /// FFN width, Mamba heads and groups, and vocabulary divided by `tp` (KV heads are
    /// replicated when fewer than `tp`; the vocabulary is padded up to a multiple of `tp`).
    /// `None` when heads or the FFN width do not divide.
    pub fn tp_shard(&self, tp: u64) -> Option<TransformerConfig> {
        if tp == 0 || self.heads % tp != 0 || self.ffn_hidden % tp != 0 {
            return None;
        }
        if self.kv_heads >= tp && self.kv_heads % tp != 0 {
            return None;
        }
        let moe = match self.moe {
            Some(m) if m.shared_ffn_hidden % tp != 0 || m.dense_ffn_hidden % tp != 0 => {
                return None
            }
            Some(m) => Some(MoeConfig {
                shared_ffn_hidden: m.shared_ffn_hidden / tp,
                dense_ffn_hidden: m.dense_ffn_hidden / tp,
                ..m
            }),
            None => None,
        };
        let hybrid = match &self.hybrid {
            Some(h) if h.mamba.heads % tp != 0 || h.mamba.groups % tp != 0 => return None,
            Some(h) => Some(HybridConfig {
                mamba: MambaConfig {
                    heads: h.mamba.heads / tp,
                    groups: h.mamba.groups / tp,
                    ..h.mamba
                },
                pattern: h.pattern.clone(),
            }),
            None => None,
        };
        Some(TransformerConfig {
            heads: self.heads / tp,
            kv_heads: (self.kv_heads / tp).max(1),
            ffn_hidden: self.ffn_hidden / tp,
            vocab: self.vocab.div_ceil(tp),
            moe,
            hybrid,
            ..self.clone()
        })
    }

    fn embed(
        &self,
        g: &mut GraphBuilder,
        opts: BuildOptions,
    ) -> Result<(TensorId, TensorId), GraphError> {
        let (bsz, s, h) = (opts.batch, opts.seq, self.hidden);
        let ids = g.input("tokens", [bsz, s], DType::I64);
        let (mut x, table) = g.embedding("embed", ids, self.vocab, h)?;
        if self.position == Position::Learned {
            let pos = g.input("positions", [bsz, s], DType::I64);
            let (p, _) = g.embedding("pos_embed", pos, self.max_seq, h)?;
            x = g.op1("embed_add", OpKind::Add, &[x, p])?;
        }
        if self.bert {
            let tt = g.input("token_types", [bsz, s], DType::I64);
            let (t, _) = g.embedding("type_embed", tt, 2, h)?;
            x = g.op1("embed_add_type", OpKind::Add, &[x, t])?;
            x = g.layer_norm("embed_norm", x)?;
        }
        if self.dropout {
            x = g.dropout("embed_drop", x, 100)?;
        }
        Ok((x, table))
    }

    /// Whether the head reads the embedding table (tied embeddings, BERT's decoder).
    fn head_reads_table(&self) -> bool {
        self.bert || self.tied_embeddings
    }

    /// The LM head's table: the embedding's where [`Self::head_reads_table`] (`table`), else
    /// its own projection.
    fn head_table(&self, g: &mut GraphBuilder, table: Option<TensorId>) -> TensorId {
        table.unwrap_or_else(|| g.weight("lm_head.weight", [self.vocab, self.hidden]))
    }

    /// The final norm before a decoder's head (BERT's head has its own transform instead).
    fn norm_for_head(
        &self,
        g: &mut GraphBuilder,
        name: &str,
        x: TensorId,
    ) -> Result<TensorId, GraphError> {
        if self.bert {
            Ok(x)
        } else {
            self.norm(g, name, x)
        }
    }

    /// The head from the (finally normalized) `x` to the loss through `head_table`; a
    /// multi-token prediction module's names its labels, logits and loss after `mtp`.
    fn head(
        &self,
        g: &mut GraphBuilder,
        x: TensorId,
        head_table: TensorId,
        opts: BuildOptions,
        mtp: Option<&str>,
    ) -> Result<TensorId, GraphError> {
        let named = |n: &str| mtp.map_or_else(|| n.to_string(), |p| format!("{p}.{n}"));
        let (bsz, s, h) = (opts.batch, opts.seq, self.hidden);
        let labels = g.input(named("labels"), [bsz, s], DType::I64);
        let logits_in = if self.bert {
            // Pooler (dense + tanh) and next-sentence head read the first token only.
            let first = if s > 1 {
                g.op(
                    "first_token",
                    OpKind::Split(SplitAttrs {
                        axis: 1,
                        sizes: vec![1, s - 1],
                    }),
                    &[x],
                )?[0]
            } else {
                x
            };
            let pooled = g.linear("pooler", first, h, true)?;
            let pooled = g.activation("pooler_act", Activation::Tanh, pooled)?;
            let _nsp = g.linear("nsp_head", pooled, 2, true)?;
            // MLM transform: dense + GeLU + LayerNorm, then the tied decoder.
            let t = g.linear("mlm.dense", x, h, true)?;
            let t = g.activation("mlm.act", Activation::Gelu, t)?;
            g.layer_norm("mlm.norm", t)?
        } else {
            x
        };
        let mut logits = g.op1(
            named("lm_head"),
            OpKind::MatMul(MatMulAttrs { transpose_b: true }),
            &[logits_in, head_table],
        )?;
        if self.bert {
            let bias = g.weight("mlm.bias", [self.vocab]);
            logits = g.op1("mlm.bias_add", OpKind::Add, &[logits, bias])?;
        }
        g.op1(named("loss"), OpKind::CrossEntropy, &[logits, labels])
    }

    fn norm(&self, g: &mut GraphBuilder, name: &str, x: TensorId) -> Result<TensorId, GraphError> {
        match self.norm {
            Norm::LayerNorm => g.layer_norm(name, x),
            Norm::RmsNorm => g.rms_norm(name, x),
        }
    }

    /// One layer of `kind` from its input `x`.
    fn layer(
        &self,
        g: &mut GraphBuilder,
        p: &str,
        x: TensorId,
        opts: BuildOptions,
        kind: LayerKind,
    ) -> Result<TensorId, GraphError> {
        match kind {
            LayerKind::Block | LayerKind::DenseBlock | LayerKind::WindowBlock => {
                let window = match kind {
                    LayerKind::WindowBlock => self.sliding_window.map(|w| w.size),
                    _ => None,
                };
                let x = self.attention_part(g, p, x, opts, window)?;
                self.mlp_part(g, p, x, kind.routes(self.moe.is_some()))
            }
            LayerKind::Attention => self.attention_part(g, p, x, opts, None),
            LayerKind::Moe => self.mlp_part(g, p, x, true),
            LayerKind::Mlp => self.mlp_part(g, p, x, false),
            LayerKind::Mamba => match &self.hybrid {
                Some(h) => self.mamba_part(g, p, x, h.mamba),
                None => Err(GraphError::Shape {
                    node: p.to_string(),
                    source: crate::op::ShapeError::Invalid {
                        op: "mamba",
                        reason: "a Mamba layer needs the model's hybrid.mamba settings".into(),
                    },
                }),
            },
        }
    }

    /// The attention half of a block: its norm, the attention (over a sliding `window` of
    /// keys where given) with its output projection, dropout and the residual.
    fn attention_part(
        &self,
        g: &mut GraphBuilder,
        p: &str,
        x: TensorId,
        opts: BuildOptions,
        window: Option<u64>,
    ) -> Result<TensorId, GraphError> {
        let (bsz, s, d) = (opts.batch, opts.seq, self.head_dim);
        let pre = !self.bert;
        let a_in = if pre {
            self.norm(g, &format!("{p}.attn_norm"), x)?
        } else {
            x
        };
        let o = match self.mla {
            Some(a) => self.latent_attention(g, p, a_in, opts, a, window)?,
            None => {
                let qkv_bias = self.bias || self.qkv_bias;
                let q = g.linear(&format!("{p}.attn.q"), a_in, self.heads * d, qkv_bias)?;
                let k = g.linear(&format!("{p}.attn.k"), a_in, self.kv_heads * d, qkv_bias)?;
                let v = g.linear(&format!("{p}.attn.v"), a_in, self.kv_heads * d, qkv_bias)?;
                let mut q = split_heads(g, p, "q", q, [bsz, s, self.heads, d])?;
                let mut k = split_heads(g, p, "k", k, [bsz, s, self.kv_heads, d])?;
                let v = split_heads(g, p, "v", v, [bsz, s, self.kv_heads, d])?;
                if self.qk_norm {
                    q = g.rms_norm(&format!("{p}.attn.q_norm"), q)?;
                    k = g.rms_norm(&format!("{p}.attn.k_norm"), k)?;
                }
                if self.position == Position::Rope {
                    q = g.op1(format!("{p}.attn.q_rope"), OpKind::Rope, &[q])?;
                    k = g.op1(format!("{p}.attn.k_rope"), OpKind::Rope, &[k])?;
                }
                self.attention_core(g, p, [q, k, v], opts, self.heads * d, window)?
            }
        };
        let mut o = g.linear(&format!("{p}.attn.out"), o, self.hidden, self.bias)?;
        if self.dropout {
            o = g.dropout(&format!("{p}.attn.drop"), o, 100)?;
        }
        let x = g.op1(format!("{p}.attn.residual"), OpKind::Add, &[x, o])?;
        if pre {
            Ok(x)
        } else {
            self.norm(g, &format!("{p}.attn_norm"), x)
        }
    }

    /// The MLP half of a block: its norm, the MLP (routed where `moe`, with the shared
    /// experts beside), dropout and the residual.
    fn mlp_part(
        &self,
        g: &mut GraphBuilder,
        p: &str,
        x: TensorId,
        moe: bool,
    ) -> Result<TensorId, GraphError> {
        let (h, pre) = (self.hidden, !self.bert);
        let m_in = if pre {
            self.norm(g, &format!("{p}.mlp_norm"), x)?
        } else {
            x
        };
        let mut m = match self.moe.filter(|_| moe) {
            Some(moe) => {
                let gated = self.mlp == Mlp::Swiglu;
                // Under LatentMoE the experts (and, here, the router: its `latent × experts`
                // scores stand in for Megatron-Core's `hidden × experts`, a few hundredths of a
                // percent of the layer) read the token projected down to the latent width.
                let w = moe.expert_width(h);
                let e_in = if moe.latent > 0 {
                    g.linear(&format!("{p}.moe.latent_down"), m_in, w, self.bias)?
                } else {
                    m_in
                };
                let router = g.weight(format!("{p}.moe.router"), [w, moe.experts]);
                let w_in = g.weight(format!("{p}.moe.w_in"), [moe.experts, w, self.ffn_hidden]);
                let w_out = g.weight(format!("{p}.moe.w_out"), [moe.experts, self.ffn_hidden, w]);
                let mut ins = vec![e_in, router, w_in, w_out];
                if gated {
                    ins.push(
                        g.weight(format!("{p}.moe.w_gate"), [moe.experts, w, self.ffn_hidden]),
                    );
                }
                let routed = g.op1(
                    format!("{p}.moe"),
                    OpKind::Moe(MoeAttrs {
                        experts: moe.experts,
                        top_k: moe.top_k,
                        ffn_hidden: self.ffn_hidden,
                        gated,
                    }),
                    &ins,
                )?;
                let routed = if moe.latent > 0 {
                    g.linear(&format!("{p}.moe.latent_up"), routed, h, self.bias)?
                } else {
                    routed
                };
                if moe.shared_ffn_hidden > 0 {
                    let shared =
                        self.mlp(g, &format!("{p}.shared"), m_in, moe.shared_ffn_hidden)?;
                    g.op1(format!("{p}.moe.sum"), OpKind::Add, &[routed, shared])?
                } else {
                    routed
                }
            }
            None => self.mlp(g, p, m_in, self.dense_ffn())?,
        };
        if self.dropout {
            m = g.dropout(&format!("{p}.mlp.drop"), m, 100)?;
        }
        let mut x = g.op1(format!("{p}.mlp.residual"), OpKind::Add, &[x, m])?;
        if !pre {
            x = self.norm(g, &format!("{p}.mlp_norm"), x)?;
        }
        Ok(x)
    }

    /// A Mamba-2 layer: its norm, the input projection to the gate z, the convolved x, B, C
    /// and the step sizes dt; the convolution and scan ([`SsdAttrs`]); the gated RMSNorm
    /// `norm(y · silu(z))` (Mamba-2's `RMSNormGated`, per group: a tensor-parallel shard
    /// normalizes its own groups); the output projection and the residual.
    fn mamba_part(
        &self,
        g: &mut GraphBuilder,
        p: &str,
        x: TensorId,
        m: MambaConfig,
    ) -> Result<TensorId, GraphError> {
        let a = m.ssd();
        let (inner, conv) = (m.inner(), a.conv_channels());
        let a_in = self.norm(g, &format!("{p}.mixer_norm"), x)?;
        let proj = g.linear(
            &format!("{p}.mamba.in_proj"),
            a_in,
            inner + conv + m.heads,
            self.bias,
        )?;
        let parts = g.op(
            format!("{p}.mamba.split"),
            OpKind::Split(SplitAttrs {
                axis: 2,
                sizes: vec![inner, conv, m.heads],
            }),
            &[proj],
        )?;
        let weights = [
            g.weight(format!("{p}.mamba.conv.weight"), [conv, m.conv_kernel]),
            g.weight(format!("{p}.mamba.conv.bias"), [conv]),
            g.weight(format!("{p}.mamba.A_log"), [m.heads]),
            g.weight(format!("{p}.mamba.D"), [m.heads]),
            g.weight(format!("{p}.mamba.dt_bias"), [m.heads]),
        ];
        let mut ins = vec![parts[1], parts[2]];
        ins.extend(weights);
        let y = g.op1(format!("{p}.mamba.ssd"), OpKind::Ssd(a), &ins)?;
        let z = g.activation(&format!("{p}.mamba.gate"), Activation::Silu, parts[0])?;
        let y = g.op1(format!("{p}.mamba.gated"), OpKind::Mul, &[y, z])?;
        let y = g.rms_norm(&format!("{p}.mamba.norm"), y)?;
        let o = g.linear(&format!("{p}.mamba.out_proj"), y, self.hidden, self.bias)?;
        g.op1(format!("{p}.mamba.residual"), OpKind::Add, &[x, o])
    }

    /// Multi-head latent attention from the normalized input `x`, to the merged heads
    /// (`[b, s, heads × v_head_dim]`): queries through their latent (when it has one), keys'
    /// and values' latent and shared rotary key from one down-projection, each head's key
    /// the up-projected part beside the shared rotary part (broadcast over the heads as
    /// `x · 1`, the copy implementations make).
    fn latent_attention(
        &self,
        g: &mut GraphBuilder,
        p: &str,
        x: TensorId,
        opts: BuildOptions,
        a: MlaConfig,
        window: Option<u64>,
    ) -> Result<TensorId, GraphError> {
        let (bsz, s, heads) = (opts.batch, opts.seq, self.heads);
        let (nope, rope, dv) = (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim);
        let dqk = nope + rope;
        let q = match a.q_lora_rank {
            0 => g.linear(&format!("{p}.attn.q"), x, heads * dqk, false)?,
            r => {
                let c = g.linear(&format!("{p}.attn.q_down"), x, r, false)?;
                let c = g.rms_norm(&format!("{p}.attn.q_norm"), c)?;
                g.linear(&format!("{p}.attn.q_up"), c, heads * dqk, false)?
            }
        };
        let q = split_heads(g, p, "q", q, [bsz, s, heads, dqk])?;
        let q = g.op1(format!("{p}.attn.q_rope"), OpKind::Rope, &[q])?;
        let down = g.linear(
            &format!("{p}.attn.kv_down"),
            x,
            a.kv_lora_rank + rope,
            false,
        )?;
        let parts = g.op(
            format!("{p}.attn.kv_split"),
            OpKind::Split(SplitAttrs {
                axis: 2,
                sizes: vec![a.kv_lora_rank, rope],
            }),
            &[down],
        )?;
        let c = g.rms_norm(&format!("{p}.attn.kv_norm"), parts[0])?;
        let kv = g.linear(&format!("{p}.attn.kv_up"), c, heads * (nope + dv), false)?;
        let kv = g.op(
            format!("{p}.attn.kv_heads_split"),
            OpKind::Split(SplitAttrs {
                axis: 2,
                sizes: vec![heads * nope, heads * dv],
            }),
            &[kv],
        )?;
        let k_nope = split_heads(g, p, "k_nope", kv[0], [bsz, s, heads, nope])?;
        let v = split_heads(g, p, "v", kv[1], [bsz, s, heads, dv])?;
        let k_rope = split_heads(g, p, "k_rope", parts[1], [bsz, s, 1, rope])?;
        let k_rope = g.op1(format!("{p}.attn.k_rope"), OpKind::Rope, &[k_rope])?;
        let ones = g.input(
            format!("{p}.attn.k_rope_heads"),
            [1, 1, heads, 1],
            DType::F32,
        );
        let k_rope = g.op1(
            format!("{p}.attn.k_rope_broadcast"),
            OpKind::Mul,
            &[k_rope, ones],
        )?;
        let k = g.op1(
            format!("{p}.attn.k"),
            OpKind::Concat(crate::op::AxisAttrs { axis: 3 }),
            &[k_nope, k_rope],
        )?;
        self.attention_core(g, p, [q, k, v], opts, heads * dv, window)
    }

    /// The attention core over `q`, `k`, `v` (`[b, s, heads, d]`), its heads merged back to
    /// `width` per token.
    fn attention_core(
        &self,
        g: &mut GraphBuilder,
        p: &str,
        [q, k, v]: [TensorId; 3],
        opts: BuildOptions,
        width: u64,
        window: Option<u64>,
    ) -> Result<TensorId, GraphError> {
        let o = g.attention(
            &format!("{p}.attn.core"),
            q,
            k,
            v,
            AttentionAttrs {
                causal: self.causal,
                fused: opts.fused_attention,
                dropout: self.dropout && !opts.fused_attention,
                window,
                alibi: self.position == Position::Alibi,
            },
        )?;
        g.op1(
            format!("{p}.attn.merge_heads"),
            OpKind::Reshape(ReshapeAttrs {
                shape: vec![opts.batch, opts.seq, width],
            }),
            &[o],
        )
    }

    /// A dense MLP `f` wide.
    fn mlp(
        &self,
        g: &mut GraphBuilder,
        p: &str,
        x: TensorId,
        f: u64,
    ) -> Result<TensorId, GraphError> {
        let h = self.hidden;
        let act = match self.mlp {
            Mlp::Swiglu => {
                let gate = g.linear(&format!("{p}.mlp.gate"), x, f, self.bias)?;
                let up = g.linear(&format!("{p}.mlp.up"), x, f, self.bias)?;
                g.op1(format!("{p}.mlp.swiglu"), OpKind::SwiGlu, &[gate, up])?
            }
            kind => {
                let up = g.linear(&format!("{p}.mlp.up"), x, f, self.bias)?;
                let a = match kind {
                    Mlp::Relu => Activation::Relu,
                    Mlp::SquaredRelu => Activation::SquaredRelu,
                    Mlp::GeluNew => Activation::GeluNew,
                    _ => Activation::Gelu,
                };
                g.activation(&format!("{p}.mlp.act"), a, up)?
            }
        };
        g.linear(&format!("{p}.mlp.down"), act, h, self.bias)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A capacity caps the busiest expert rank's load and a padded one sets every rank's;
    /// dropless leaves routing's; a capacity past every copy on one expert, or padding
    /// without one, is refused; the JSON of a dropless mixture is as before.
    #[test]
    fn a_capacity_caps_or_sets_the_expert_load() {
        let dropless = MoeConfig::routed(8, 2);
        assert_eq!(dropless.capacity_factor(), None);
        assert_eq!(dropless.capped_load(1.3), 1.3);
        let capped = MoeConfig {
            capacity_permille: 1250,
            ..dropless
        };
        assert_eq!(capped.capacity_factor(), Some(1.25));
        assert_eq!(MoeConfig::capacity_permille_of(1.25), Some(1250));
        for bad in [0.0, 0.0004, -1.0, f64::NAN, f64::INFINITY, 1e10] {
            assert_eq!(MoeConfig::capacity_permille_of(bad), None, "{bad}");
        }
        assert_eq!(
            (capped.capped_load(1.3), capped.capped_load(1.1)),
            (1.25, 1.1)
        );
        let padded = MoeConfig {
            pad_to_capacity: true,
            ..capped
        };
        assert_eq!(
            (padded.capped_load(1.0), padded.capped_load(1.4)),
            (1.25, 1.25)
        );
        let model = |moe| TransformerConfig {
            moe: Some(moe),
            ..TransformerConfig::llama(2, 64, 8, 2, 96, 100, 32)
        };
        assert!(model(padded).validate().is_ok());
        let err = model(MoeConfig {
            capacity_permille: 4001,
            ..dropless
        })
        .validate()
        .unwrap_err();
        assert!(err.contains("capacity factor 4.001 is beyond 4"), "{err}");
        let err = model(MoeConfig {
            pad_to_capacity: true,
            ..dropless
        })
        .validate()
        .unwrap_err();
        assert!(err.contains("needs a capacity factor"), "{err}");
        let json = serde_json::to_string(&dropless).unwrap();
        assert!(
            !json.contains("capacity") && !json.contains("pad"),
            "{json}"
        );
        let back: MoeConfig =
            serde_json::from_str(&serde_json::to_string(&padded).unwrap()).unwrap();
        assert_eq!(back, padded);
    }

    fn opts(seq: u64) -> BuildOptions {
        BuildOptions {
            batch: 1,
            seq,
            fused_attention: true,
        }
    }

    /// LatentMoE: the experts read and write the latent width, between a projection down
    /// and one back up; without a latent the experts read the hidden state.
    #[test]
    fn latent_moe_experts_work_at_the_latent_width() {
        let cfg = TransformerConfig {
            moe: Some(MoeConfig {
                latent: 16,
                ..MoeConfig::routed(8, 2)
            }),
            ..TransformerConfig::llama(1, 64, 8, 2, 96, 100, 32)
        };
        let g = cfg.build("t", opts(16)).unwrap();
        let shape = |name: &str| {
            g.tensors
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.shape.dims().to_vec())
        };
        assert_eq!(shape("layers.0.moe.w_in"), Some(vec![8, 16, 96]));
        assert_eq!(shape("layers.0.moe.w_out"), Some(vec![8, 96, 16]));
        assert_eq!(shape("layers.0.moe.latent_down.weight"), Some(vec![64, 16]));
        assert_eq!(shape("layers.0.moe.latent_up.weight"), Some(vec![16, 64]));
        let plain = TransformerConfig {
            moe: Some(MoeConfig::routed(8, 2)),
            ..cfg.clone()
        };
        let g = plain.build("t", opts(16)).unwrap();
        assert!(g.tensors.iter().all(|t| !t.name.contains("latent")));
        assert_eq!(plain.moe.unwrap().expert_width(64), 64);
        assert!(TransformerConfig {
            moe: Some(MoeConfig {
                latent: 1 << 21,
                ..MoeConfig::routed(8, 2)
            }),
            ..cfg
        }
        .validate()
        .is_err());
    }

    #[test]
    fn graph_params_equal_the_closed_form() {
        for cfg in [
            TransformerConfig::gpt(2, 64, 4, 256, 100, 32),
            TransformerConfig::llama(2, 64, 8, 2, 160, 100, 32),
            // Qwen3's norms of each head's query and key.
            TransformerConfig {
                qk_norm: true,
                ..TransformerConfig::llama(2, 64, 8, 2, 160, 100, 32)
            },
            TransformerConfig {
                moe: Some(MoeConfig::routed(4, 2)),
                ..TransformerConfig::llama(2, 64, 8, 2, 96, 100, 32)
            },
            // DeepSeek's arrangement: a leading dense layer 160 wide, then MoE layers with a
            // shared expert 48 wide, every other one dense again.
            TransformerConfig {
                moe: Some(MoeConfig {
                    shared_ffn_hidden: 48,
                    dense_layers_first: 1,
                    every: 2,
                    dense_ffn_hidden: 160,
                    ..MoeConfig::routed(4, 2)
                }),
                ..TransformerConfig::llama(6, 64, 8, 2, 96, 100, 32)
            },
            // LatentMoE: experts 16 wide in a 64-wide model, a shared expert beside, biases.
            TransformerConfig {
                moe: Some(MoeConfig {
                    latent: 16,
                    shared_ffn_hidden: 48,
                    ..MoeConfig::routed(8, 2)
                }),
                bias: true,
                ..TransformerConfig::llama(2, 64, 8, 2, 96, 100, 32)
            },
            // Latent attention, with and without a query latent.
            TransformerConfig {
                head_dim: 24,
                mla: Some(MlaConfig {
                    q_lora_rank: 32,
                    kv_lora_rank: 16,
                    qk_nope_head_dim: 16,
                    qk_rope_head_dim: 8,
                    v_head_dim: 12,
                }),
                ..TransformerConfig::llama(2, 64, 4, 4, 96, 100, 32)
            },
            TransformerConfig {
                head_dim: 24,
                mla: Some(MlaConfig {
                    q_lora_rank: 0,
                    kv_lora_rank: 16,
                    qk_nope_head_dim: 16,
                    qk_rope_head_dim: 8,
                    v_head_dim: 12,
                }),
                ..TransformerConfig::llama(2, 64, 4, 4, 96, 100, 32)
            },
        ] {
            let g = cfg.build("t", opts(16)).unwrap();
            assert_eq!(g.param_count(), cfg.params(), "{cfg:?}");
            assert_eq!(g.num_blocks(), cfg.layers);
            // Each section graph holds one block of its kind.
            for kind in [LayerKind::Block, LayerKind::DenseBlock] {
                let b = cfg.build_section(Section::Layer(kind), opts(16)).unwrap();
                assert_eq!(b.param_count(), cfg.layer_params(kind), "{kind:?} {cfg:?}");
            }
        }
        // A multi-token prediction module adds a block like the last, its projection of
        // [embedding; hidden] (2h × h) and three norms; it shares the table and the head.
        let base = TransformerConfig {
            moe: Some(MoeConfig::routed(4, 2)),
            ..TransformerConfig::llama(2, 64, 8, 2, 96, 100, 32)
        };
        let with = TransformerConfig {
            mtp_layers: 1,
            ..base.clone()
        };
        let count = |c: &TransformerConfig| c.build("t", opts(16)).unwrap().param_count();
        assert_eq!(
            count(&with) - count(&base),
            base.layer_params(LayerKind::Block) + 2 * 64 * 64 + 3 * 64
        );
        // The costing section holds the projection, two norms and a copy of the table.
        let input = with.build_section(Section::MtpInput, opts(16)).unwrap();
        assert_eq!(input.param_count(), 2 * 64 * 64 + 2 * 64 + 100 * 64);
        // DeepSeek-V3's routing: 8 groups, 4 a token. Over 8 nodes a group is a node: at most
        // 4 nodes; over 16 each group spans 2: at most 8; over 4 nodes no limit bites.
        let ds = MoeConfig {
            groups: 8,
            groups_per_token: 4,
            ..MoeConfig::routed(256, 8)
        };
        assert_eq!(
            [8, 16, 4].map(|n| ds.nodes_per_token(n)),
            [Some(4), Some(8), Some(4)]
        );
        assert_eq!(MoeConfig::routed(256, 8).nodes_per_token(8), None);
        // Layers 0 (leading), 2 and 4 are dense; 1, 3 and 5 route.
        let m = MoeConfig {
            dense_layers_first: 1,
            every: 2,
            ..MoeConfig::routed(4, 2)
        };
        let moe: Vec<bool> = (0..6).map(|i| m.is_moe_layer(i)).collect();
        assert_eq!(moe, [false, true, false, true, false, true]);
    }

    /// A small Nemotron-H-shaped stack: Mamba-2, MoE with a shared expert, attention without
    /// position embedding, a dense MLP.
    fn hybrid_tiny() -> TransformerConfig {
        TransformerConfig {
            mlp: Mlp::SquaredRelu,
            position: Position::None,
            head_dim: 16,
            moe: Some(MoeConfig {
                shared_ffn_hidden: 48,
                ..MoeConfig::routed(4, 2)
            }),
            hybrid: Some(HybridConfig {
                pattern: "ME*M-E".into(),
                mamba: MambaConfig {
                    heads: 8,
                    head_dim: 16,
                    state: 8,
                    groups: 2,
                    conv_kernel: 4,
                    chunk: 8,
                },
            }),
            ..TransformerConfig::llama(6, 64, 8, 2, 96, 100, 32)
        }
    }

    #[test]
    fn hybrid_stacks_build_each_layer_by_its_symbol() {
        let cfg = hybrid_tiny();
        cfg.validate().unwrap();
        let g = cfg.build("t", opts(16)).unwrap();
        assert_eq!(g.num_blocks(), 6);
        assert_eq!(
            g.param_count(),
            2 * 100 * 64 + 64 + cfg.blocks_params(),
            "untied head, final norm and the layers"
        );
        // A Mamba layer by hand: in_proj 64 → z (128), x·B·C (128 + 2·2·8 = 160), dt (8);
        // the convolution's weights and bias (160 × 5); A, D and dt bias (3 × 8); the gated
        // norm (128); out_proj 128 → 64; the pre-norm (64).
        let mamba = 64 * (128 + 160 + 8) + 160 * 5 + 3 * 8 + 128 + 128 * 64 + 64;
        assert_eq!(cfg.layer_params(LayerKind::Mamba), mamba);
        // Attention without rotary embedding: q (64 → 128), k and v (64 → 32 each), out.
        assert_eq!(
            cfg.layer_params(LayerKind::Attention),
            64 * 128 + 2 * 64 * 32 + 128 * 64 + 64
        );
        for kind in cfg.layer_kinds() {
            let b = cfg.build_section(Section::Layer(kind), opts(16)).unwrap();
            assert_eq!(b.param_count(), cfg.layer_params(kind), "{kind:?}");
        }
        let kinds: Vec<LayerKind> = cfg.layer_kinds().collect();
        assert_eq!(
            kinds,
            [
                LayerKind::Mamba,
                LayerKind::Attention,
                LayerKind::Moe,
                LayerKind::Mlp
            ]
        );
        let c = cfg.layer_kinds_in(1, 4); // E * M -
        assert_eq!(
            [
                LayerKind::Mamba,
                LayerKind::Attention,
                LayerKind::Moe,
                LayerKind::Mlp
            ]
            .map(|k| c[k.index()]),
            [1, 1, 1, 1]
        );
        assert!(cfg.is_moe_layer(1) && cfg.is_moe_layer(5) && !cfg.is_moe_layer(0));
        assert_eq!(cfg.layer_kind(4), LayerKind::Mlp);
        // A tensor-parallel shard holds half the Mamba heads and groups (the norm's, conv's
        // and projections' widths with them); tp 4 would split 2 groups unevenly.
        let half = cfg.tp_shard(2).unwrap();
        let m = half.hybrid.as_ref().unwrap().mamba;
        assert_eq!((m.heads, m.groups), (4, 1));
        assert!(cfg.tp_shard(4).is_none());
        half.build("t", opts(16)).unwrap();
    }

    #[test]
    fn sliding_window_layers_attend_to_their_window() {
        // GPT-OSS's arrangement: layers 0 and 2 windowed (4 keys), 1 and 3 full.
        let cfg = TransformerConfig {
            sliding_window: Some(SlidingWindow {
                size: 4,
                full_every: 2,
            }),
            ..TransformerConfig::llama(4, 64, 8, 2, 96, 100, 32)
        };
        cfg.validate().unwrap();
        let c = cfg.layer_kinds_in(0, 4);
        assert_eq!(
            (
                c[LayerKind::Block.index()],
                c[LayerKind::WindowBlock.index()]
            ),
            (2, 2)
        );
        assert_eq!(
            (0..4).map(|i| cfg.layer_kind(i)).collect::<Vec<_>>(),
            [
                LayerKind::WindowBlock,
                LayerKind::Block,
                LayerKind::WindowBlock,
                LayerKind::Block
            ]
        );
        assert_eq!(
            cfg.layer_params(LayerKind::WindowBlock),
            cfg.layer_params(LayerKind::Block)
        );
        // At 16 tokens a windowed layer's attention counts 4 keys a query, a full one 16.
        let attn_flops = |kind| {
            let g = cfg.build_section(Section::Layer(kind), opts(16)).unwrap();
            let n = g
                .nodes
                .iter()
                .find(|n| matches!(n.op, OpKind::Attention(_)))
                .unwrap();
            g.node_work(n, 2).fwd_flops.0
        };
        let (w, f) = (
            attn_flops(LayerKind::WindowBlock),
            attn_flops(LayerKind::Block),
        );
        assert!((w / f - 0.25).abs() < 1e-12, "{w} {f}");
        let whole = cfg.build("t", opts(16)).unwrap();
        let windows: Vec<Option<u64>> = whole
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                OpKind::Attention(a) => Some(a.window),
                _ => None,
            })
            .collect();
        assert_eq!(windows, [Some(4), None, Some(4), None]);
    }

    #[test]
    fn hybrid_patterns_are_checked() {
        let mut c = hybrid_tiny();
        c.hybrid.as_mut().unwrap().pattern = "ME*M-".into();
        assert!(c.validate().unwrap_err().contains("5 symbols for 6 layers"));
        c.hybrid.as_mut().unwrap().pattern = "ME*MXE".into();
        assert!(c.validate().unwrap_err().contains("'X'"));
        c = hybrid_tiny();
        c.moe = None;
        assert!(c.validate().unwrap_err().contains("moe section"));
        c = hybrid_tiny();
        c.hybrid.as_mut().unwrap().mamba.groups = 3;
        assert!(c.validate().unwrap_err().contains("groups"));
        c.hybrid.as_mut().unwrap().mamba.groups = 0;
        assert!(c.validate().unwrap_err().contains("hybrid.mamba.groups 0"));
    }

    /// Group-limited routing needs equal groups and enough experts in the kept ones.
    #[test]
    fn routing_groups_must_divide_the_experts_and_hold_the_top_k() {
        let with = |groups, groups_per_token, top_k| TransformerConfig {
            moe: Some(MoeConfig {
                groups,
                groups_per_token,
                ..MoeConfig::routed(8, top_k)
            }),
            ..TransformerConfig::llama(2, 32, 4, 4, 64, 64, 16)
        };
        assert!(with(4, 2, 2).validate().is_ok());
        assert!(with(4, 1, 2).validate().is_ok());
        for (g, keep, k) in [(3, 1, 2), (4, 5, 2), (4, 1, 3)] {
            let e = with(g, keep, k).validate().unwrap_err();
            assert!(e.contains("moe: groups"), "{e}");
        }
        // Without a limit the groups are not checked.
        assert!(with(3, 0, 2).validate().is_ok());
    }

    #[test]
    fn the_scan_is_a_small_part_of_a_mamba_layer() {
        // Nemotron 3 Nano's mixer at 8k tokens: the projections are 2·h·(2·inner + 2·g·N +
        // heads) + 2·inner·h FLOPs a token (77.4 M); the convolution and SSD scan add 2.9 M
        // (Megatron-LM's estimate for the scan, 7·inner·N, is 3.7 M).
        let nano = crate::models::zoo::transformer("nemotron-h").unwrap();
        let a = nano.hybrid.unwrap().mamba.ssd();
        let per_token = a.flops_per_token(8192);
        let conv = 2.0 * 4.0 * (4096.0 + 2048.0);
        let scan = 8.0 * 2.0 * 128.0 * 128.0 + 64.0 * (128.0 * 64.0 + 4.0 * 128.0 * 64.0);
        assert_eq!(per_token, conv + scan);
        assert!((2.5e6..3.7e6).contains(&per_token), "{per_token}");
    }

    #[test]
    fn korthikanti_activation_memory_per_layer() {
        // Korthikanti et al. 2022 eq. 1: a GPT layer keeps s·b·h·(34 + 5·a·s/h) bytes in 16-bit
        // without recompute (unfused attention with dropout). Ours also keeps fp32 LayerNorm
        // statistics (2 × 8 bytes per token), which the paper leaves out.
        let cfg = TransformerConfig::gpt(1, 256, 8, 1024, 100, 64);
        let (s, b, h, a) = (64u64, 1u64, 256u64, 8u64);
        let g = cfg
            .build(
                "t",
                BuildOptions {
                    batch: b,
                    seq: s,
                    fused_attention: false,
                },
            )
            .unwrap();
        let got = g.activation_bytes(2, |n| n.segment == Segment::Block(0)).0;
        let paper = s * b * h * 34 + 5 * a * s * s * b;
        assert_eq!(got, paper + 2 * 8 * s * b);
    }

    #[test]
    fn training_flops_match_6n_plus_attention() {
        // Narayanan et al. 2021: per token, 6·N + 12·l·h·s (full attention matrix, no causal
        // discount) counts matmuls only; elementwise work adds well under 1 %.
        let cfg = TransformerConfig::gpt(4, 512, 8, 2048, 1000, 256);
        let g = cfg.build("t", opts(256)).unwrap();
        let per_token = g.total_work(2).train_flops().0 / 256.0;
        let n = g.param_count() as f64;
        let expect = 6.0 * n + 12.0 * 4.0 * 512.0 * 256.0;
        assert!(
            (per_token / expect - 1.0).abs() < 0.02,
            "{per_token} vs {expect}"
        );
    }

    #[test]
    fn sections_add_up_to_the_model() {
        let cfg = TransformerConfig::llama(3, 64, 8, 2, 160, 100, 32);
        let o = opts(16);
        let full = cfg.build("t", o).unwrap().total_work(2);
        let part = |s| cfg.build_section(s, o).unwrap().total_work(2);
        let sum = part(Section::Embedding).fwd_flops.0
            + 3.0 * part(Section::Layer(LayerKind::Block)).fwd_flops.0
            + part(Section::Head).fwd_flops.0;
        assert!((sum - full.fwd_flops.0).abs() < 1e-6 * full.fwd_flops.0);
        // Parameters too: an untied head owns its projection and nothing of the embedding.
        let params = |s| cfg.build_section(s, o).unwrap().param_count();
        let whole = cfg.build("t", o).unwrap().param_count();
        assert!(!cfg.tied_embeddings);
        assert_eq!(
            params(Section::Embedding)
                + 3 * params(Section::Layer(LayerKind::Block))
                + params(Section::Head),
            whole
        );
        // A TP shard holds 1/tp of the block's matmul work.
        let shard = cfg.tp_shard(2).unwrap();
        let b1 = cfg
            .build_section(Section::Layer(LayerKind::Block), o)
            .unwrap();
        let b2 = shard
            .build_section(Section::Layer(LayerKind::Block), o)
            .unwrap();
        assert_eq!(b2.param_count() * 2 - 64 * 2 * 2, b1.param_count() - 64 * 2);
        assert!(cfg.tp_shard(3).is_none());
    }

    #[test]
    fn invalid_dimensions_name_the_field() {
        let mut c = TransformerConfig::llama(2, 64, 8, 3, 96, 100, 32);
        assert!(c.validate().unwrap_err().contains("kv_heads"));
        c.kv_heads = 2;
        c.vocab = 0;
        assert!(c.validate().unwrap_err().contains("vocab"));
        // Latent ranks of 2^32 (a fuzzed DeepSeek-V3 config) and head widths whose sum
        // overflows are refused, not multiplied out: layers are counted after every bound.
        let mut dsv3 = crate::models::zoo::transformer("deepseek-v3").unwrap();
        if let Some(a) = dsv3.mla.as_mut() {
            a.q_lora_rank = 1 << 32;
            a.kv_lora_rank = 1 << 32;
        }
        assert!(dsv3.validate().unwrap_err().contains("mla"));
        // GPT-OSS's clamped gate belongs to a SwiGLU MLP.
        let clamped_gelu = TransformerConfig {
            clamped_swiglu: true,
            ..TransformerConfig::gpt(2, 64, 4, 256, 100, 32)
        };
        assert!(clamped_gelu
            .validate()
            .unwrap_err()
            .contains("clamped_swiglu"));
        if let Some(a) = dsv3.mla.as_mut() {
            (a.q_lora_rank, a.kv_lora_rank) = (1536, 512);
            a.qk_nope_head_dim = u64::MAX;
        }
        assert!(dsv3.validate().unwrap_err().contains("qk_nope_head_dim"));
    }
}
