//! The transformer the executor trains: GPT (LayerNorm, GeLU, learned positions, biases, tied
//! head) and Llama (RMSNorm, SwiGLU, RoPE, GQA, untied head) and their descendants (mixtures of
//! experts, DeepSeek's latent attention, sinks, query/key norms, windows) and BERT, built from a
//! [`TransformerConfig`], with Megatron-style tensor-parallel shards and hand-written backward
//! passes.
//!
//! Dropout is off: the executor trains deterministically so that every layout can be checked
//! against single-rank training (a `dropout: true` config runs without it).
//!
//! Tensor parallelism (Shoeybi et al. 2019): query/key/value and the first MLP matrices are
//! split by columns (heads, FFN width), the attention output and second MLP matrices by rows,
//! with an all-reduce after each row-parallel matmul in forward and before each column-parallel
//! one in backward. Sequence parallelism (Korthikanti et al. 2022) replaces those all-reduces by
//! reduce-scatter / all-gather pairs and keeps the norms, residuals, embedding and head on a
//! `1/tp` slice of the tokens. Embeddings and the LM head are split by vocabulary over the
//! tensor-parallel ranks where `tp` divides it, else replicated across them.

use crate::comm::{Collectives, CommError, Group};
use crate::mamba::{mamba_bwd, mamba_fwd, Mamba, MambaLayout, MambaSaved, WeightGradFn};
use crate::moe::{moe_bwd, moe_fwd, Ep, MoeLayout, MoeSaved, Routing};
use crate::ring::{ring_bwd, ring_fwd, RingShape};
use crate::rng::SplitMix64;
use crate::tensor::{
    add_bias, add_into, attention_bwd, attention_fwd, bias_grad, cross_entropy, mm, mm_nt, mm_tn,
    norm_bwd, norm_fwd, rope, sigmoid, Act, AttnShape, Mask, IGNORE,
};
use parallax_ir::models::{
    LayerKind, MambaConfig, Mlp, MoeConfig, Norm, Position, SlidingWindow, TransformerConfig,
};
use parallax_ir::RecomputeModules;
use std::ops::Range;

/// Standard deviation of weight initialisation (GPT-2, Radford et al. 2019).
pub const INIT_STD: f64 = 0.02;

/// Model dimensions checked for what the executor supports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub h: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head size.
    pub hd: usize,
    /// MLP width.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Learned-position table size.
    pub max_seq: usize,
    /// RMSNorm (else LayerNorm).
    pub rms: bool,
    /// The MLP's kind.
    pub mlp: Mlp,
    /// Rotary positions.
    pub rope: bool,
    /// Their base (the model's `rope_theta`, an integer as configs write it).
    pub rope_theta: u64,
    /// A learned position table (GPT); neither this nor `rope`: no position embedding (NoPE,
    /// the causal mask alone orders the tokens).
    pub learned_positions: bool,
    /// Sliding-window attention on the layers [`SlidingWindow::full_layers_in`] leaves out.
    pub window: Option<SlidingWindow>,
    /// Biases on linear layers.
    pub bias: bool,
    /// Biases on the query, key and value projections only (Qwen2).
    pub qkv_bias: bool,
    /// LM head shares the embedding table.
    pub tied: bool,
    /// Mixture-of-experts MLPs: (experts, top-k).
    pub moe: Option<(usize, usize)>,
    /// The mixture, for which of its layers route ([`MoeConfig::is_moe_layer`]: DeepSeek's
    /// leading dense layers, Qwen2-MoE's `decoder_sparse_step`).
    pub mixture: Option<MoeConfig>,
    /// Width of a dense layer's MLP ([`TransformerConfig::dense_ffn`]).
    pub dense_ffn: usize,
    /// A learned sink logit per head in every attention softmax (GPT-OSS).
    pub sinks: bool,
    /// RMSNorms over each query and key head before the rotary embedding (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Multi-head latent attention (DeepSeek-V2, V3) in place of separate query, key and value
    /// projections; `hd` is then its query/key head width.
    pub mla: Option<Latent>,
    /// Multi-token prediction modules after the last block (DeepSeek-V3).
    pub mtp: usize,
    /// BERT, the one encoder run: attention to every key, post-norm blocks (the sum of each
    /// sublayer's input and output normalised), an embedding norm, token types, and the
    /// pooler, next-sentence and masked-LM heads. Every other model is a causal decoder.
    pub bert: bool,
    /// GPT-OSS's clamped gate in place of SwiGLU's.
    pub clamped_swiglu: bool,
    /// A hybrid stack (Nemotron-H): each layer's kind, and the Mamba-2 mixers' sizes.
    pub hybrid: Option<(Vec<LayerKind>, MambaConfig)>,
}

/// Multi-head latent attention's sizes (DeepSeek-V2, Liu et al. 2024): queries projected through
/// a low-rank latent (`q_rank`, RMS-normalised; 0: projected directly, DeepSeek-V2-Lite), keys
/// and values through a shared one (`kv_rank`, RMS-normalised); each head's query and key are a
/// part without position (`nope`) and a rotary part (`rope`, the key's shared by every head and
/// projected from the input beside the latent), its value `v` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Latent {
    pub q_rank: usize,
    pub kv_rank: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
}

impl Latent {
    /// A query's (and key's) width per head.
    fn qk(&self) -> usize {
        self.nope + self.rope
    }

    /// The head width attention runs at: queries, keys and values zero-padded to the wider of
    /// the query/key and value widths (zeros add nothing to a score or an output).
    fn width(&self) -> usize {
        self.qk().max(self.v)
    }
}

impl Dims {
    /// Checks that the executor can train `c`; errors name the unsupported feature.
    pub fn from_config(c: &TransformerConfig) -> Result<Dims, String> {
        c.validate()?;
        if c.position == Position::Alibi {
            return Err(
                "ALiBi positions are not run by the executor (learned, rotary or none)".into(),
            );
        }
        if !c.causal && !c.bert {
            return Err(
                "encoders other than BERT are not run by the executor (causal decoders and BERT)"
                    .into(),
            );
        }
        let unlike_bert = c.causal
            || c.position != Position::Learned
            || c.norm != Norm::LayerNorm
            || c.moe.is_some()
            || c.mla.is_some()
            || c.mtp_layers > 0
            || c.sliding_window.is_some()
            || c.attention_sinks
            || c.qk_norm;
        if c.bert && unlike_bert {
            return Err(
                "a BERT with causal attention, rotary positions, RMSNorm, experts, latent attention, prediction modules, windows, sinks or query/key norms is not a model the executor runs"
                    .into(),
            );
        }
        if let Some(latent) = c.moe.map(|m| m.latent).filter(|&w| w > 0) {
            return Err(format!(
                "moe latent {latent}: the executor's experts work on the hidden state (no LatentMoE projections)"
            ));
        }
        if let Some(cap) = c.moe.and_then(|m| m.capacity_factor()) {
            return Err(format!(
                "moe capacity factor {cap}: the executor's experts are dropless (every routed copy computed); train it without token dropping"
            ));
        }
        let us = |x: u64| usize::try_from(x).map_err(|_| format!("dimension {x} is too large"));
        let mla = match c.mla {
            Some(a) => {
                if c.qk_norm || c.attention_sinks || a.qk_rope_head_dim == 0 {
                    return Err(
                        "latent attention with query/key norms, attention sinks or no rotary part is not a model the executor runs"
                            .into(),
                    );
                }
                Some(Latent {
                    q_rank: us(a.q_lora_rank)?,
                    kv_rank: us(a.kv_lora_rank)?,
                    nope: us(a.qk_nope_head_dim)?,
                    rope: us(a.qk_rope_head_dim)?,
                    v: us(a.v_head_dim)?,
                })
            }
            None => None,
        };
        Ok(Dims {
            layers: c.layers as usize,
            h: us(c.hidden)?,
            heads: us(c.heads)?,
            kv_heads: us(c.kv_heads)?,
            hd: us(c.head_dim)?,
            ffn: us(c.ffn_hidden)?,
            vocab: us(c.vocab)?,
            max_seq: us(c.max_seq)?,
            rms: c.norm == Norm::RmsNorm,
            mlp: c.mlp,
            rope: c.position == Position::Rope,
            rope_theta: c.rope_theta,
            learned_positions: c.position == Position::Learned,
            window: match c.sliding_window {
                // Its size is a key count on this machine.
                Some(w) => us(w.size).map(|_| Some(w))?,
                None => None,
            },
            bias: c.bias,
            qkv_bias: c.qkv_bias,
            // BERT's masked-LM decoder reads the embedding table.
            tied: c.tied_embeddings || c.bert,
            moe: match &c.moe {
                Some(m) => Some((us(m.experts)?, us(m.top_k)?)),
                None => None,
            },
            dense_ffn: us(c.dense_ffn())?,
            // Checked here, read through `Dims::shared_ffn`.
            mixture: c
                .moe
                .map(|m| us(m.shared_ffn_hidden).map(|_| m))
                .transpose()?,
            sinks: c.attention_sinks,
            qk_norm: c.qk_norm,
            mla,
            mtp: c.mtp_layers as usize,
            bert: c.bert,
            hybrid: match &c.hybrid {
                Some(hy) => {
                    let kinds = (0..c.layers).map(|i| c.layer_kind(i)).collect();
                    us(hy.mamba.heads * hy.mamba.head_dim * hy.mamba.state)?;
                    Some((kinds, hy.mamba))
                }
                None => None,
            },
            clamped_swiglu: c.clamped_swiglu,
        })
    }

    /// Whether the MLPs are gated (SwiGLU: gate and up projections).
    pub fn gated(&self) -> bool {
        self.mlp == Mlp::Swiglu
    }

    /// The MLPs' activation.
    pub fn act(&self) -> Act {
        match self.mlp {
            Mlp::Swiglu if self.clamped_swiglu => Act::ClampedSwiglu,
            Mlp::Swiglu => Act::Swiglu,
            Mlp::Gelu | Mlp::GeluNew => Act::Gelu,
            Mlp::Relu => Act::Relu,
            Mlp::SquaredRelu => Act::SquaredRelu,
        }
    }

    /// Width of an MoE layer's shared experts together (0: none), a dense MLP beside the
    /// routed experts whose output is added to theirs.
    pub fn shared_ffn(&self) -> usize {
        self.mixture.map_or(0, |m| m.shared_ffn_hidden as usize)
    }

    /// The routed experts of layer `layer`, where it is an MoE layer: (experts, top-k).
    pub fn experts_at(&self, layer: usize) -> Option<(usize, usize)> {
        if self.hybrid.is_some() {
            return self.moe.filter(|_| self.kind_at(layer) == LayerKind::Moe);
        }
        let layer = u32::try_from(layer).unwrap_or(u32::MAX);
        self.moe
            .filter(|_| self.mixture.is_some_and(|m| m.is_moe_layer(layer)))
    }

    /// What layer `layer` is: a block of attention and MLP, or one part of a hybrid stack.
    pub fn kind_at(&self, layer: usize) -> LayerKind {
        match &self.hybrid {
            Some((kinds, _)) => kinds.get(layer).copied().unwrap_or(LayerKind::Block),
            None => LayerKind::Block,
        }
    }

    /// Checks that `tp` divides heads and the MLP width, and divides or is a multiple of the
    /// key/value heads (more ranks than key/value heads replicate each over `tp / kv_heads`
    /// ranks, as Megatron-LM does).
    pub fn check_tp(&self, tp: usize) -> Result<(), String> {
        let kv_ok = self.kv_heads % tp == 0 || tp % self.kv_heads == 0;
        let mamba_ok = self
            .hybrid
            .as_ref()
            .is_none_or(|(_, m)| m.heads as usize % tp == 0 && m.groups as usize % tp == 0);
        if self.heads % tp != 0
            || !kv_ok
            || !mamba_ok
            || self.ffn % tp != 0
            || self.dense_ffn % tp != 0
            || self.shared_ffn() % tp != 0
        {
            return Err(format!(
                "tp {tp} must divide heads {} and ffn {} (dense layers {}, shared experts {}, Mamba heads and groups {:?}), and divide or be a multiple of kv heads {}",
                self.heads, self.ffn, self.dense_ffn, self.shared_ffn(),
                self.hybrid.as_ref().map(|(_, m)| (m.heads, m.groups)), self.kv_heads
            ));
        }
        Ok(())
    }

    /// The head width attention runs at (latent attention's zero-padded width, else `hd`).
    fn att_hd(&self) -> usize {
        self.mla.map_or(self.hd, |m| m.width())
    }

    /// A value head's width (the attention output's, per head).
    fn v_hd(&self) -> usize {
        self.mla.map_or(self.hd, |m| m.v)
    }

    /// Key/value heads a tensor-parallel rank holds (one, replicated, where `tp` exceeds them).
    pub fn local_kv_heads(&self, tp: usize) -> usize {
        (self.kv_heads / tp).max(1)
    }

    /// How key/value projections split over `tp` ranks: into `tp` parts, or into one part per
    /// head, each held by `tp / kv_heads` ranks.
    fn kv_split(&self, tp: usize) -> Split {
        if self.kv_heads % tp == 0 {
            Split::Dim(1)
        } else {
            Split::Parts {
                dim: 1,
                parts: self.kv_heads,
            }
        }
    }
}

/// How a tensor is split over tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it.
    Replicated,
    /// Split along this dimension into `tp` equal parts.
    Dim(usize),
    /// Split along `dim` into `parts` (dividing `tp`) equal parts, rank `t` holding part
    /// `t · parts / tp`: replicated key/value heads.
    Parts { dim: usize, parts: usize },
    /// Split along dimension 0 (experts) over the expert-parallel ranks.
    Experts,
    /// Whole on every rank and computed from every token on each (a mixture-of-experts
    /// router, which the tensor-parallel ranks run redundantly): never reduced over them.
    Whole,
}

/// Which part of a tensor a rank holds: its tensor- and expert-parallel positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    pub t: usize,
    pub tp: usize,
    pub e: usize,
    pub ep: usize,
}

impl Split {
    /// The dimension split, the number of parts and which part the rank at `at` holds.
    fn part(self, at: Part) -> Option<(usize, usize, usize)> {
        match self {
            Split::Replicated | Split::Whole => None,
            Split::Dim(d) => Some((d, at.tp, at.t)),
            Split::Parts { dim, parts } => Some((dim, parts, at.t * parts / at.tp)),
            Split::Experts => Some((0, at.ep, at.e)),
        }
    }
}

/// How a tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with this standard deviation.
    Normal(f64),
    /// All ones (norm weights).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// One parameter tensor as held by one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    /// Global name (`layers.3.attn.wq`); tied copies carry the name of the original.
    pub name: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// Tensor-parallel split.
    pub split: Split,
    /// Initialisation.
    pub init: Init,
    /// Elements in this rank's unit buffer.
    pub range: Range<usize>,
    /// A second copy of a tied tensor (the LM head's view of the embedding on the last stage).
    pub tied_copy: bool,
}

impl Slot {
    /// The part of the global tensor `full` the rank at `at` holds.
    pub fn local_part(&self, full: &[f32], at: Part) -> Vec<f32> {
        match self.split.part(at) {
            None => full.to_vec(),
            Some((d, parts, k)) => {
                let (outer, dim, inner) = dims3(&self.global_shape, d);
                let part = dim / parts;
                let mut out = Vec::with_capacity(outer * part * inner);
                for o in 0..outer {
                    let at = (o * dim + k * part) * inner;
                    out.extend_from_slice(&full[at..at + part * inner]);
                }
                out
            }
        }
    }

    /// Writes the part `local` the rank at `at` holds into the global tensor `full`.
    pub fn place(&self, full: &mut [f32], local: &[f32], at: Part) {
        match self.split.part(at) {
            None => full.copy_from_slice(local),
            Some((d, parts, k)) => {
                let (outer, dim, inner) = dims3(&self.global_shape, d);
                let part = dim / parts;
                for o in 0..outer {
                    let at = (o * dim + k * part) * inner;
                    full[at..at + part * inner]
                        .copy_from_slice(&local[o * part * inner..(o + 1) * part * inner]);
                }
            }
        }
    }

    /// The initial value of the whole tensor under `seed` (independent of layout).
    pub fn init_global(&self, seed: u64) -> Vec<f32> {
        let n: usize = self.global_shape.iter().product();
        match self.init {
            Init::Ones => vec![1.0; n],
            Init::Zeros => vec![0.0; n],
            Init::Normal(std) => {
                let mut g = SplitMix64::for_stream(seed, &self.name);
                (0..n).map(|_| (g.normal() * std) as f32).collect()
            }
        }
    }
}

fn dims3(shape: &[usize], d: usize) -> (usize, usize, usize) {
    (
        shape[..d].iter().product(),
        shape[d],
        shape[d + 1..].iter().product(),
    )
}

/// Builds the slot list of one unit (a flat buffer of parameters sharded together).
#[derive(Debug, Default)]
pub struct SlotBuilder {
    slots: Vec<Slot>,
    len: usize,
    tp: usize,
    ep: usize,
    /// Experts folded over the tensor-parallel ranks (see `Topology::fold`).
    fold: bool,
}

impl SlotBuilder {
    /// A builder for tensor-parallel degree `tp`.
    pub fn new(tp: usize) -> Self {
        SlotBuilder::with_ep(tp, 1)
    }

    /// A builder for tensor-parallel degree `tp` and expert-parallel degree `ep`.
    pub fn with_ep(tp: usize, ep: usize) -> Self {
        SlotBuilder::with_experts(tp, ep, false)
    }

    /// A builder for tensor-parallel degree `tp`, expert-parallel degree `ep`, with the
    /// experts folded over the tensor-parallel ranks or not.
    pub fn with_experts(tp: usize, ep: usize, fold: bool) -> Self {
        SlotBuilder {
            slots: Vec::new(),
            len: 0,
            tp,
            ep,
            fold,
        }
    }

    /// Adds a tensor and returns its range in the unit buffer.
    pub fn add(&mut self, name: String, shape: &[usize], split: Split, init: Init) -> Range<usize> {
        let mut local = shape.to_vec();
        match split {
            Split::Replicated | Split::Whole => {}
            Split::Dim(d) => local[d] /= self.tp,
            Split::Parts { dim, parts } => local[dim] /= parts,
            Split::Experts => local[0] /= self.ep,
        }
        let n: usize = local.iter().product();
        let range = self.len..self.len + n;
        self.len += n;
        self.slots.push(Slot {
            name,
            global_shape: shape.to_vec(),
            split,
            init,
            range: range.clone(),
            tied_copy: false,
        });
        range
    }

    /// How a `[vocab, hidden]` table splits: by vocabulary rows over the tensor-parallel
    /// ranks where they divide it (Megatron's vocabulary-parallel embedding and LM head), else
    /// replicated.
    pub fn vocab_split(&self, vocab: usize) -> Split {
        if self.tp > 1 && vocab % self.tp == 0 {
            Split::Dim(0)
        } else {
            Split::Replicated
        }
    }

    /// Marks the last slot added as a tied copy.
    pub fn mark_tied_copy(&mut self) {
        if let Some(s) = self.slots.last_mut() {
            s.tied_copy = true;
        }
    }

    /// The slots and total length.
    pub fn finish(self) -> (Vec<Slot>, usize) {
        (self.slots, self.len)
    }
}

/// Where one block's tensors lie in its unit buffer (local, tensor-parallel shards).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockLayout {
    ln1_w: Range<usize>,
    ln1_b: Option<Range<usize>>,
    wq: Range<usize>,
    bq: Option<Range<usize>>,
    wk: Range<usize>,
    bk: Option<Range<usize>>,
    wv: Range<usize>,
    bv: Option<Range<usize>>,
    wo: Range<usize>,
    bo: Option<Range<usize>>,
    ln2_w: Range<usize>,
    ln2_b: Option<Range<usize>>,
    w_in: Range<usize>,
    b_in: Option<Range<usize>>,
    w_up: Option<Range<usize>>,
    w_out: Range<usize>,
    b_out: Option<Range<usize>>,
    /// Qwen2-MoE's gate on the shared experts, `[hidden, 1]`: their output scaled per token by
    /// the sigmoid of this projection of the MLP's input.
    shared_gate: Option<Range<usize>>,
    /// The mixture-of-experts MLP, in place of the dense one.
    moe: Option<MoeLayout>,
    /// The keys this layer's queries see: all up to their own, or a sliding window of them.
    window: Option<usize>,
    /// GPT-OSS's attention sinks, one learned logit per query head (split with the heads).
    sinks: Option<Range<usize>>,
    /// Qwen3's query and key norms, `[head_dim]` each, shared by every head: whole on every
    /// tensor-parallel rank, each of which sees only its own heads' share of the gradient.
    q_norm: Option<Range<usize>>,
    k_norm: Option<Range<usize>>,
    /// Latent attention's projections, in place of `wq`, `wk`, `wv` (empty then).
    mla: Option<MlaLayout>,
    /// A hybrid stack's Mamba-2 mixer, the layer's only part.
    mamba: Option<MambaBlock>,
    /// Whether the layer attends (a hybrid stack's MLP and Mamba layers do not).
    attn: bool,
    /// Width of its dense MLP: a dense layer's, or an MoE layer's shared experts (0: none;
    /// the routed experts are `Dims::ffn` wide).
    ffn: usize,
}

/// A Mamba-2 mixer's sizes on one rank and where its tensors lie.
#[derive(Clone, Debug, PartialEq, Eq)]
struct MambaBlock {
    m: Mamba,
    l: MambaLayout,
}

impl MambaBlock {
    /// Adds a mixer's tensors to `b`: split by heads (and groups for `B` and `C`) over the
    /// tensor-parallel ranks, the output projection by rows. Initialised as `A = −1`
    /// (`A_log` 0), `D = 1` and `dt_bias` 0 (Mamba-2 draws `A` in [1, 16] and `dt` in
    /// [0.001, 0.1]; any start trains the same on every layout).
    fn build(d: &Dims, c: &MambaConfig, b: &mut SlotBuilder, p: impl Fn(&str) -> String) -> Self {
        let (h, tp) = (d.h, b.tp);
        let (heads, groups) = (c.heads as usize, c.groups as usize);
        let (pd, n, k) = (
            c.head_dim as usize,
            c.state as usize,
            c.conv_kernel as usize,
        );
        let (inner, bc) = (heads * pd, groups * n);
        let w = Init::Normal(INIT_STD);
        let out_std = INIT_STD / (2.0 * d.layers as f64).sqrt();
        let mut proj = |name: &str, width: usize| b.add(p(name), &[h, width], Split::Dim(1), w);
        let (w_z, w_x, w_b, w_c, w_dt) = (
            proj("mamba.w_z", inner),
            proj("mamba.w_x", inner),
            proj("mamba.w_b", bc),
            proj("mamba.w_c", bc),
            proj("mamba.w_dt", heads),
        );
        let mut conv = |name: &str, ch: usize| {
            (
                b.add(p(&format!("{name}.weight")), &[ch, k], Split::Dim(0), w),
                b.add(
                    p(&format!("{name}.bias")),
                    &[ch],
                    Split::Dim(0),
                    Init::Zeros,
                ),
            )
        };
        let conv = [
            conv("mamba.conv_x", inner),
            conv("mamba.conv_b", bc),
            conv("mamba.conv_c", bc),
        ];
        let l = MambaLayout {
            w_z,
            w_x,
            w_b,
            w_c,
            w_dt,
            conv,
            dt_bias: b.add(p("mamba.dt_bias"), &[heads], Split::Dim(0), Init::Zeros),
            a_log: b.add(p("mamba.A_log"), &[heads], Split::Dim(0), Init::Zeros),
            d: b.add(p("mamba.D"), &[heads], Split::Dim(0), Init::Ones),
            norm: b.add(p("mamba.norm.weight"), &[inner], Split::Dim(0), Init::Ones),
            out: b.add(
                p("mamba.out"),
                &[inner, h],
                Split::Dim(0),
                Init::Normal(out_std),
            ),
        };
        let m = Mamba {
            heads: heads / tp,
            groups: groups / tp,
            head_dim: pd,
            state: n,
            kernel: k,
            chunk: c.chunk as usize,
        };
        MambaBlock { m, l }
    }
}

/// Where latent attention's tensors lie in the unit buffer. The down projections and the
/// latents' norms are whole on every tensor-parallel rank, which computes them from every row
/// and sees only its own heads' share of their gradients (summed over the ranks, as Qwen3's
/// query/key norms'); the up projections are split by heads.
#[derive(Clone, Debug, PartialEq)]
struct MlaLayout {
    /// The query latent's down projection `[hidden, q_rank]` and its norm (none when queries
    /// are projected directly).
    q_down: Option<(Range<usize>, Range<usize>)>,
    /// The queries, `[q_rank or hidden, heads · (nope + rope)]`.
    q_up: Range<usize>,
    /// The key/value latent beside the shared rotary key, `[hidden, kv_rank + rope]`, and the
    /// latent's norm.
    kv_down: Range<usize>,
    kv_norm: Range<usize>,
    /// Each head's position-free key and value from the latent, `[kv_rank, heads · (nope + v)]`.
    kv_up: Range<usize>,
}

impl MlaLayout {
    fn build(d: &Dims, m: Latent, b: &mut SlotBuilder, p: impl Fn(&str) -> String) -> MlaLayout {
        let (h, w, shared) = (
            d.h,
            Init::Normal(INIT_STD),
            Split::Parts { dim: 0, parts: 1 },
        );
        let q_down = (m.q_rank > 0).then(|| {
            (
                b.add(p("attn.wq_down"), &[h, m.q_rank], shared, w),
                b.add(p("attn.q_down_norm"), &[m.q_rank], shared, Init::Ones),
            )
        });
        let (q_name, q_in) = match q_down {
            Some(_) => ("attn.wq_up", m.q_rank),
            None => ("attn.wq", h),
        };
        MlaLayout {
            q_down,
            q_up: b.add(p(q_name), &[q_in, d.heads * m.qk()], Split::Dim(1), w),
            kv_down: b.add(p("attn.wkv_down"), &[h, m.kv_rank + m.rope], shared, w),
            kv_norm: b.add(p("attn.kv_down_norm"), &[m.kv_rank], shared, Init::Ones),
            kv_up: b.add(
                p("attn.wkv_up"),
                &[m.kv_rank, d.heads * (m.nope + m.v)],
                Split::Dim(1),
                w,
            ),
        }
    }
}

impl BlockLayout {
    /// Adds block `layer`'s tensors to `b`, a mixture-of-experts MLP's experts to `eb` (their
    /// own unit: they are reduced and sharded over the replicas holding the same experts).
    pub fn build(d: &Dims, layer: usize, b: &mut SlotBuilder, eb: &mut SlotBuilder) -> BlockLayout {
        Self::build_named(d, layer, &format!("layers.{layer}"), b, eb)
    }

    /// [`BlockLayout::build`] of a block shaped as layer `layer` whose tensors are named
    /// `{prefix}.…` (a multi-token prediction module's block).
    pub fn build_named(
        d: &Dims,
        layer: usize,
        prefix: &str,
        b: &mut SlotBuilder,
        eb: &mut SlotBuilder,
    ) -> BlockLayout {
        let p = |s: &str| format!("{prefix}.{s}");
        let experts = d.experts_at(layer);
        // A hybrid stack's layer is one part: a Mamba-2 mixer, an attention, or an MLP.
        let kind = d.kind_at(layer);
        let attn = !matches!(kind, LayerKind::Mamba | LayerKind::Moe | LayerKind::Mlp);
        let has_mlp = !matches!(kind, LayerKind::Mamba | LayerKind::Attention);
        // A dense layer has its own width (a mixture's may differ); the experts theirs, and
        // the shared experts beside them theirs.
        let f = if experts.is_some() {
            d.ffn
        } else {
            d.dense_ffn
        };
        let dense_f = match (has_mlp, experts) {
            (false, _) => 0,
            (true, Some(_)) => d.shared_ffn(),
            (true, None) => d.dense_ffn,
        };
        let (h, qw, kw) = (d.h, d.heads * d.hd, d.kv_heads * d.hd);
        let out_std = INIT_STD / (2.0 * d.layers as f64).sqrt();
        let w = Init::Normal(INIT_STD);
        let opt = |b: &mut SlotBuilder, on: bool, name: &str, shape: &[usize], split| {
            on.then(|| b.add(p(name), shape, split, Init::Zeros))
        };
        let (ln1_w, ln1_b) = if has_mlp && !attn {
            (0..0, None)
        } else {
            build_norm(d, b, &p("ln1"))
        };
        let mamba = match (&d.hybrid, kind) {
            (Some((_, m)), LayerKind::Mamba) => Some(MambaBlock::build(d, m, b, p)),
            _ => None,
        };
        let (wq, bq, wk, bk, wv, bv, mla, wo, sinks, q_norm, k_norm, bo) = if !attn {
            (
                0..0,
                None,
                0..0,
                None,
                0..0,
                None,
                None,
                0..0,
                None,
                None,
                None,
                None,
            )
        } else {
            let (wq, bq, wk, bk, wv, bv, mla);
            if let Some(m) = d.mla {
                mla = Some(MlaLayout::build(d, m, b, p));
                (wq, bq, wk, bk, wv, bv) = (0..0, None, 0..0, None, 0..0, None);
            } else {
                mla = None;
                wq = b.add(p("attn.wq"), &[h, qw], Split::Dim(1), w);
                // Qwen2 biases the query, key and value projections alone.
                let qkv_bias = d.bias || d.qkv_bias;
                bq = opt(b, qkv_bias, "attn.bq", &[qw], Split::Dim(0));
                let kv = d.kv_split(b.tp);
                let kv_bias = match kv {
                    Split::Parts { parts, .. } => Split::Parts { dim: 0, parts },
                    _ => Split::Dim(0),
                };
                wk = b.add(p("attn.wk"), &[h, kw], kv, w);
                bk = opt(b, qkv_bias, "attn.bk", &[kw], kv_bias);
                wv = b.add(p("attn.wv"), &[h, kw], kv, w);
                bv = opt(b, qkv_bias, "attn.bv", &[kw], kv_bias);
            }
            let wo = b.add(
                p("attn.wo"),
                &[d.heads * d.v_hd(), h],
                Split::Dim(0),
                Init::Normal(out_std),
            );
            let sinks = opt(b, d.sinks, "attn.sinks", &[d.heads], Split::Dim(0));
            let shared_by_heads = Split::Parts { dim: 0, parts: 1 };
            let (q_norm, k_norm) = if d.qk_norm {
                (
                    Some(b.add(p("attn.q_norm"), &[d.hd], shared_by_heads, Init::Ones)),
                    Some(b.add(p("attn.k_norm"), &[d.hd], shared_by_heads, Init::Ones)),
                )
            } else {
                (None, None)
            };
            let bo = opt(b, d.bias, "attn.bo", &[h], Split::Replicated);
            (wq, bq, wk, bk, wv, bv, mla, wo, sinks, q_norm, k_norm, bo)
        };
        let (ln2_w, ln2_b) = if has_mlp {
            build_norm(d, b, &p("ln2"))
        } else {
            (0..0, None)
        };
        let (w_in, b_in, w_up, w_out, b_out);
        let mut moe = None;
        if let Some((experts, top_k)) = experts {
            // Folded, each TP rank routes its own rows: the router's gradient is summed
            // over them like any replicated weight's under sequence parallelism.
            let router_split = if b.fold {
                Split::Replicated
            } else {
                Split::Whole
            };
            let router = b.add(p("mlp.router"), &[h, experts], router_split, w);
            // GPT-OSS biases its router and its experts' projections.
            let router_bias = opt(b, d.bias, "mlp.router_bias", &[experts], router_split);
            let ((gi, gb), (go, ob)) = if d.gated() {
                (
                    ("mlp.experts.wg", "mlp.experts.bg"),
                    ("mlp.experts.wd", "mlp.experts.bd"),
                )
            } else {
                (
                    ("mlp.experts.w1", "mlp.experts.b1"),
                    ("mlp.experts.w2", "mlp.experts.b2"),
                )
            };
            let wi = eb.add(p(gi), &[experts, h, f], Split::Experts, w);
            let bi = opt(eb, d.bias, gb, &[experts, f], Split::Experts);
            let (wu, bu) = if d.gated() {
                let wu = eb.add(p("mlp.experts.wu"), &[experts, h, f], Split::Experts, w);
                (
                    Some(wu),
                    opt(eb, d.bias, "mlp.experts.bu", &[experts, f], Split::Experts),
                )
            } else {
                (None, None)
            };
            let wo = eb.add(
                p(go),
                &[experts, f, h],
                Split::Experts,
                Init::Normal(out_std),
            );
            let bo = opt(eb, d.bias, ob, &[experts, h], Split::Experts);
            moe = Some(MoeLayout {
                router,
                w_in: wi,
                w_up: wu,
                w_out: wo,
                router_bias,
                b_in: bi,
                b_up: bu,
                b_out: bo,
                act: d.act(),
                experts,
                top_k,
                routing: d.mixture.map(|m| Routing::of(&m)).unwrap_or_default(),
            });
        }
        // The dense MLP: a dense layer's, or an MoE layer's shared experts (split over the
        // tensor-parallel ranks as a dense MLP is, Megatron-Core's shared experts).
        // On the rows of this rank, as the norms before it.
        let shared_gate =
            (experts.is_some() && dense_f > 0 && d.mixture.is_some_and(|m| m.shared_gate))
                .then(|| b.add(p("mlp.shared_gate"), &[h, 1], Split::Replicated, w));
        let m = if experts.is_some() {
            "mlp.shared"
        } else {
            "mlp"
        };
        let m = |s: &str| format!("{m}.{s}");
        if dense_f == 0 {
            (w_in, b_in, w_up, w_out, b_out) = (0..0, None, None, 0..0, None);
        } else if d.gated() {
            w_in = b.add(p(&m("wg")), &[h, dense_f], Split::Dim(1), w);
            b_in = opt(b, d.bias, &m("bg"), &[dense_f], Split::Dim(0));
            w_up = Some(b.add(p(&m("wu")), &[h, dense_f], Split::Dim(1), w));
            w_out = b.add(
                p(&m("wd")),
                &[dense_f, h],
                Split::Dim(0),
                Init::Normal(out_std),
            );
            b_out = opt(b, d.bias, &m("bd"), &[h], Split::Replicated);
        } else {
            w_in = b.add(p(&m("w1")), &[h, dense_f], Split::Dim(1), w);
            b_in = opt(b, d.bias, &m("b1"), &[dense_f], Split::Dim(0));
            w_up = None;
            w_out = b.add(
                p(&m("w2")),
                &[dense_f, h],
                Split::Dim(0),
                Init::Normal(out_std),
            );
            b_out = opt(b, d.bias, &m("b2"), &[h], Split::Replicated);
        }
        BlockLayout {
            ln1_w,
            ln1_b,
            wq,
            bq,
            wk,
            bk,
            wv,
            bv,
            wo,
            bo,
            ln2_w,
            ln2_b,
            w_in,
            b_in,
            w_up,
            w_out,
            b_out,
            shared_gate,
            sinks,
            q_norm,
            k_norm,
            mla,
            mamba,
            attn,
            moe,
            ffn: dense_f,
            // The model's rule for which layers attend to all keys.
            window: d
                .window
                .filter(|w| w.full_layers_in(layer as u32, 1) == 0)
                .map(|w| w.size as usize),
        }
    }

    /// The keys a query of this layer sees.
    fn mask(&self, d: &Dims) -> Mask {
        if d.bert {
            Mask::All
        } else {
            Mask::Causal(self.window)
        }
    }

    /// Whether the MLP is a mixture of experts.
    pub fn is_moe(&self) -> bool {
        self.moe.is_some()
    }

    /// Whether the layer has an MLP (a hybrid stack's attention and Mamba layers do not).
    fn has_mlp(&self) -> bool {
        self.moe.is_some() || self.has_dense_mlp()
    }

    /// Whether the layer has a dense MLP: a dense layer, or an MoE layer's shared experts.
    fn has_dense_mlp(&self) -> bool {
        !self.w_out.is_empty()
    }
}

/// A norm's weight and (LayerNorm) bias, named `{name}.weight` and `{name}.bias`, replicated.
fn build_norm(d: &Dims, b: &mut SlotBuilder, name: &str) -> (Range<usize>, Option<Range<usize>>) {
    let w = b.add(
        format!("{name}.weight"),
        &[d.h],
        Split::Replicated,
        Init::Ones,
    );
    let bias = (!d.rms).then(|| {
        b.add(
            format!("{name}.bias"),
            &[d.h],
            Split::Replicated,
            Init::Zeros,
        )
    });
    (w, bias)
}

/// Where the head's tensors lie in its unit: the final norm and, when untied, the LM head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadLayout {
    norm_w: Range<usize>,
    norm_b: Option<Range<usize>>,
    /// The untied LM head `[vocab, hidden]`.
    lm_head: Option<Range<usize>>,
    /// BERT's heads in place of the final norm.
    bert: Option<BertHead>,
}

/// BERT's heads (`BertForPreTraining`): the pooler (dense + tanh over each sequence's first
/// token) and next-sentence classifier, and the masked-LM transform (dense + GeLU +
/// LayerNorm) before the tied decoder, whose bias is split as the table is. Each `(weight
/// `[in, out]`, bias)`; replicated but the decoder bias.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BertHead {
    pooler: (Range<usize>, Range<usize>),
    nsp: (Range<usize>, Range<usize>),
    dense: (Range<usize>, Range<usize>),
    norm: (Range<usize>, Option<Range<usize>>),
    bias: Range<usize>,
}

impl HeadLayout {
    /// Adds the head's own tensors to `b`.
    pub fn build(d: &Dims, b: &mut SlotBuilder) -> HeadLayout {
        if d.bert {
            let h = d.h;
            let dense = |b: &mut SlotBuilder, name: &str, out: usize| {
                let w = b.add(
                    format!("{name}.weight"),
                    &[h, out],
                    Split::Replicated,
                    Init::Normal(INIT_STD),
                );
                let bias = b.add(
                    format!("{name}.bias"),
                    &[out],
                    Split::Replicated,
                    Init::Zeros,
                );
                (w, bias)
            };
            let pooler = dense(b, "pooler", h);
            let nsp = dense(b, "nsp", 2);
            let transform = dense(b, "mlm.dense", h);
            let norm = build_norm(d, b, "mlm.norm");
            let split = b.vocab_split(d.vocab);
            let bias = b.add("mlm.bias".into(), &[d.vocab], split, Init::Zeros);
            return HeadLayout {
                norm_w: 0..0,
                norm_b: None,
                lm_head: None,
                bert: Some(BertHead {
                    pooler,
                    nsp,
                    dense: transform,
                    norm,
                    bias,
                }),
            };
        }
        let (norm_w, norm_b) = build_norm(d, b, "final_norm");
        let lm_head = (!d.tied).then(|| {
            b.add(
                "lm_head".into(),
                &[d.vocab, d.h],
                b.vocab_split(d.vocab),
                Init::Normal(INIT_STD),
            )
        });
        HeadLayout {
            norm_w,
            norm_b,
            lm_head,
            bert: None,
        }
    }
}

/// Adds the embedding table (`embed.wte`, `[vocab, hidden]`) to `b`; `copy` marks the last
/// stage's copy of a tied table.
pub fn build_wte(d: &Dims, b: &mut SlotBuilder, copy: bool) -> Range<usize> {
    let r = b.add(
        "embed.wte".into(),
        &[d.vocab, d.h],
        b.vocab_split(d.vocab),
        Init::Normal(INIT_STD),
    );
    if copy {
        b.mark_tied_copy();
    }
    r
}

/// Adds the learned position table (`embed.wpe`) to `b`.
pub fn build_wpe(d: &Dims, b: &mut SlotBuilder) -> (Range<usize>, Option<BertEmbed>) {
    let wpe = b.add(
        "embed.wpe".into(),
        &[d.max_seq, d.h],
        Split::Replicated,
        Init::Normal(INIT_STD / 2.0),
    );
    let bert = d.bert.then(|| BertEmbed {
        types: b.add(
            "embed.token_type".into(),
            &[2, d.h],
            Split::Replicated,
            Init::Normal(INIT_STD),
        ),
        norm: build_norm(d, b, "embed.norm"),
    });
    (wpe, bert)
}

/// BERT's token-type table (segment A, then B) and embedding norm, beside the positions.
#[derive(Clone, Debug, PartialEq)]
pub struct BertEmbed {
    types: Range<usize>,
    norm: (Range<usize>, Option<Range<usize>>),
}

/// What BERT's embedding norm keeps for backward: its input and statistics.
#[derive(Debug)]
pub struct BertEmbedSaved {
    x: Vec<f32>,
    st: Vec<[f32; 2]>,
}

/// A position's token type: the first half of a sequence is segment A, the rest B (the
/// sentence pair of BERT's pre-training input).
fn token_type(pos: usize, seq: usize) -> usize {
    usize::from(2 * pos >= seq)
}

/// BERT's token types added to the embedded rows `x` (this rank's `rows` of the micro-batch),
/// then its embedding norm; `p` is the positions' unit.
pub fn bert_embed_fwd(
    d: &Dims,
    e: &BertEmbed,
    p: &[f32],
    mut x: Vec<f32>,
    rows: Range<usize>,
    pass: &Pass,
) -> (Vec<f32>, BertEmbedSaved) {
    let (h, lseq) = (d.h, pass.local_seq());
    let types = &p[e.types.clone()];
    for (i, r) in rows.enumerate() {
        let t = token_type(pass.position_of(pass.c, r % lseq), pass.seq);
        add_into(&mut x[i * h..(i + 1) * h], &types[t * h..(t + 1) * h]);
    }
    let (y, st) = normed(p, (&e.norm.0, &e.norm.1), &x, d.rms);
    (y, BertEmbedSaved { x, st })
}

/// Backward of [`bert_embed_fwd`]: the gradient of the embedded rows.
pub fn bert_embed_bwd(
    d: &Dims,
    e: &BertEmbed,
    (p, g): (&[f32], &mut [f32]),
    s: BertEmbedSaved,
    dy: &[f32],
    rows: Range<usize>,
    pass: &Pass,
) -> Vec<f32> {
    let (h, lseq) = (d.h, pass.local_seq());
    let mut dx = vec![0.0; dy.len()];
    let norm = (&e.norm.0, &e.norm.1);
    normed_bwd((p, &mut *g), norm, &mut dx, dy, &s.x, &s.st, d.rms, false);
    let dtypes = &mut g[e.types.clone()];
    for (i, r) in rows.enumerate() {
        let t = token_type(pass.position_of(pass.c, r % lseq), pass.seq);
        add_into(&mut dtypes[t * h..(t + 1) * h], &dx[i * h..(i + 1) * h]);
    }
    dx
}

/// The tensor-parallel context of one rank: its group and whether sequence parallelism is on.
/// Implements Megatron's conjugate operators around the tensor-parallel region.
#[derive(Debug)]
pub struct Tp<'a> {
    /// The communicator.
    pub comm: &'a mut dyn Collectives,
    /// The tensor-parallel group.
    pub group: &'a Group,
    /// Sequence parallelism.
    pub sp: bool,
    /// The context-parallel group (ranks holding other chunks of the same sequences, in
    /// chunk order), when context parallelism is on.
    pub cp: Option<&'a Group>,
    /// The expert-parallel group (in expert order), when expert parallelism is on.
    pub ep: Option<&'a Group>,
    /// Experts folded over the tensor-parallel ranks: the mixture runs on this rank's own
    /// (sequence-parallel) rows, not on all of them.
    pub fold: bool,
}

impl Tp<'_> {
    fn size(&self) -> usize {
        self.group.size()
    }

    /// Rows after [`Tp::gather_rows`] of `rows` rows.
    fn gathered(&self, rows: usize) -> usize {
        if self.sp {
            rows * self.size()
        } else {
            rows
        }
    }

    /// All-gather of row slices (sequence parallel), else identity.
    pub(crate) fn gather_rows(&mut self, x: Vec<f32>) -> Result<Vec<f32>, CommError> {
        if !self.sp || self.size() == 1 {
            return Ok(x);
        }
        let mut out = vec![0.0; x.len() * self.size()];
        self.comm.all_gather(self.group, &x, &mut out)?;
        Ok(out)
    }

    /// Sum of partial results: reduce-scatter over rows (sequence parallel), else all-reduce.
    pub(crate) fn reduce_rows(&mut self, mut x: Vec<f32>) -> Result<Vec<f32>, CommError> {
        let n = self.size();
        if n == 1 {
            return Ok(x);
        }
        if self.sp {
            let mut out = vec![0.0; x.len() / n];
            self.comm.reduce_scatter_sum(self.group, &x, &mut out)?;
            Ok(out)
        } else {
            self.comm.all_reduce_sum(self.group, &mut x)?;
            Ok(x)
        }
    }

    /// This rank's rows of a whole result every rank computed (sequence parallel), else all.
    pub(crate) fn own_rows(&self, x: Vec<f32>) -> Result<Vec<f32>, CommError> {
        let n = self.size();
        if !self.sp || n == 1 {
            return Ok(x);
        }
        let me = self.group.index_of(self.comm.rank())?;
        let r = x.len() / n;
        Ok(x[me * r..(me + 1) * r].to_vec())
    }

    /// Entering the tensor-parallel region, forward (`f` / `ḡ`).
    fn enter_fwd(&mut self, x: Vec<f32>) -> Result<Vec<f32>, CommError> {
        self.gather_rows(x)
    }

    /// Entering the tensor-parallel region, backward.
    fn enter_bwd(&mut self, dx: Vec<f32>) -> Result<Vec<f32>, CommError> {
        self.reduce_rows(dx)
    }

    /// Leaving the tensor-parallel region, forward (`g` / `g̅`).
    fn exit_fwd(&mut self, x: Vec<f32>) -> Result<Vec<f32>, CommError> {
        self.reduce_rows(x)
    }

    /// Leaving the tensor-parallel region, backward.
    fn exit_bwd(&mut self, dx: Vec<f32>) -> Result<Vec<f32>, CommError> {
        self.gather_rows(dx)
    }
}

/// What a block keeps from forward for backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Every activation.
    All,
    /// Everything but the attention probabilities and the MLP activation output, which backward
    /// recomputes (selective recomputation).
    Selective,
    /// Only the block input; backward reruns the forward (full recomputation).
    Input,
    /// Everything but what the named submodules compute (Megatron-Core's
    /// `--recompute-modules`), which backward recomputes from their kept inputs before it
    /// needs them (`restore`): the attention probabilities (`core_attn`), the norms'
    /// outputs (`layernorm`, gathered again under sequence parallelism), latent attention's
    /// up projections (`mla_up_proj`), a dense layer's MLP (`mlp`) or an MoE layer's shared
    /// experts (`shared_experts`) from their input, the whole mixture of experts (`moe`,
    /// dispatched again) or the experts' activations (`moe_act`).
    Modules(RecomputeModules),
}

impl Keep {
    /// Whether the attention probabilities are kept.
    fn probs(self) -> bool {
        match self {
            Keep::All => true,
            Keep::Modules(m) => !m.contains(RecomputeModules::CORE_ATTN),
            Keep::Selective | Keep::Input => false,
        }
    }

    /// Whether the dense MLP's activation output is kept (where its input and
    /// pre-activations are).
    fn act(self) -> bool {
        matches!(self, Keep::All | Keep::Modules(_))
    }
}

/// Leaves out of `s` what the submodules `m` of layer `l` compute ([`Keep::Modules`]).
fn drop_modules(s: &mut BlockSaved, m: RecomputeModules, d: &Dims, l: &BlockLayout) {
    // A Mamba layer names none of these modules; its scan keeps what its backward reads.
    if l.mamba.is_some() {
        return;
    }
    // Post-norm blocks (BERT) read their input unnormalised: nothing to recompute there.
    if m.contains(RecomputeModules::LAYERNORM) && !d.bert {
        s.n1 = Vec::new();
        s.n2 = Vec::new();
        s.shared_n2 = None;
    }
    if m.contains(RecomputeModules::MLA_UP_PROJ) && l.mla.is_some() {
        (s.q, s.k, s.v) = (Vec::new(), Vec::new(), Vec::new());
    }
    let (moe, whole_moe) = (l.moe.is_some(), m.contains(RecomputeModules::MOE));
    let dense = if moe {
        whole_moe || m.contains(RecomputeModules::SHARED_EXPERTS)
    } else {
        m.contains(RecomputeModules::MLP)
    };
    if dense {
        (s.u, s.up, s.act) = (Vec::new(), None, None);
    }
    if moe && whole_moe {
        s.moe = None;
    } else if let (true, Some(ms)) = (m.contains(RecomputeModules::MOE_ACT), &mut s.moe) {
        ms.drop_activations();
    }
}

/// Recomputes what [`drop_modules`] left out of `s`, as the forward computed it from the
/// block input `x` and what `s` kept: the norms first (their outputs feed the rest), then
/// latent attention's up projections, the mixture of experts and the dense MLP's
/// pre-activations. Every rank of a tensor- or expert-parallel group runs the same
/// collectives, in the same order.
#[allow(clippy::too_many_arguments)]
fn restore(
    d: &Dims,
    l: &BlockLayout,
    p: &[f32],
    pe: &[f32],
    x: &[f32],
    s: &mut BlockSaved,
    tp: &mut Tp<'_>,
    pass: Pass,
) -> Result<(), CommError> {
    let (h, t) = (d.h, tp.size());
    if l.attn && !d.bert && s.n1.is_empty() {
        s.n1 = tp.enter_fwd(normed(p, (&l.ln1_w, &l.ln1_b), x, d.rms).0)?;
    }
    if l.has_mlp() && !d.bert && s.n2.is_empty() {
        let n2 = normed(p, (&l.ln2_w, &l.ln2_b), &s.x2, d.rms).0;
        (s.n2, s.shared_n2) = mlp_inputs(l, tp, n2)?;
    }
    if let (Some(m), Some(ml), true) = (d.mla, &l.mla, l.attn && s.q.is_empty()) {
        let pos = pass.positions();
        let theta = d.rope_theta as f64;
        (s.q, s.k, s.v, _) = mla_fwd(m, ml, p, &s.n1, h, d.heads / t, theta, &pos);
    }
    if let (Some(ml), None) = (&l.moe, &s.moe) {
        let mut ep = Ep {
            comm: &mut *tp.comm,
            group: tp.ep,
        };
        s.moe = Some(moe_fwd(ml, p, pe, &s.n2, h, d.ffn, &mut ep)?.1);
    }
    if l.has_dense_mlp() && s.u.is_empty() {
        let n2 = s.shared_n2.as_ref().unwrap_or(&s.n2);
        (s.u, s.up) = mlp_pre(l, p, n2, h, l.ffn / t);
    }
    Ok(())
}

/// The MLP's inputs from the second norm's output `n2` (this rank's rows): the rows the
/// mixture of experts and the dense MLP (or shared experts) read — gathered over the
/// tensor-parallel ranks, except the mixture's under folding, which runs on this rank's own
/// rows while its shared experts read the gathered ones.
fn mlp_inputs(
    l: &BlockLayout,
    tp: &mut Tp<'_>,
    n2: Vec<f32>,
) -> Result<(Vec<f32>, Option<Vec<f32>>), CommError> {
    let folded = l.moe.is_some() && tp.fold;
    Ok(match (folded, l.has_dense_mlp()) {
        (true, true) => {
            let gathered = tp.enter_fwd(n2.clone())?;
            (n2, Some(gathered))
        }
        (true, false) => (n2, None),
        (false, _) => (tp.enter_fwd(n2)?, None),
    })
}

/// The dense MLP's pre-activations from its (gathered) input `n2`, `f` wide on this rank:
/// the input projection (with its bias) and, gated, the up projection.
fn mlp_pre(
    l: &BlockLayout,
    p: &[f32],
    n2: &[f32],
    h: usize,
    f: usize,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let tt = n2.len() / h;
    let mut u = vec![0.0; tt * f];
    mm(&mut u, n2, &p[l.w_in.clone()], tt, h, f, false);
    if let Some(b) = slice(p, &l.b_in) {
        add_bias(&mut u, b);
    }
    let up = l.w_up.as_ref().map(|w| {
        let mut y = vec![0.0; tt * f];
        mm(&mut y, n2, &p[w.clone()], tt, h, f, false);
        y
    });
    (u, up)
}

/// Sizes of one micro-batch pass.
#[derive(Clone, Copy, Debug)]
pub struct Pass {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence (the whole sequence, whatever part a rank holds).
    pub seq: usize,
    /// Context-parallel degree and this rank's index in its group: the rank holds chunks `c`
    /// and `2·cp − 1 − c` of the `2·cp` equal chunks of each sequence, so that every rank has
    /// as much causal attention to compute (Megatron-LM's load balancing).
    pub cp: usize,
    pub c: usize,
}

/// The ring attention shape of a pass with `heads`, `kv_heads` of size `hd` on this rank.
fn ring_shape(pass: &Pass, heads: usize, kv_heads: usize, hd: usize, mask: Mask) -> RingShape {
    RingShape {
        mask,
        batch: pass.batch,
        lseq: pass.local_seq(),
        heads,
        kv_heads,
        hd,
    }
}

impl Pass {
    /// The shape of this pass's attention over the query rows at positions `q_pos` of every
    /// sequence against all of its keys: `(heads, kv_heads, head size)` and the keys a query
    /// sees.
    fn attention<'a>(
        &self,
        q_pos: &'a [usize],
        (heads, kv_heads, hd): (usize, usize, usize),
        mask: Mask,
    ) -> AttnShape<'a> {
        AttnShape {
            batch: self.batch,
            q_pos,
            sk: self.seq,
            heads,
            kv_heads,
            hd,
            mask,
        }
    }

    /// Tokens of each sequence this rank holds.
    pub fn local_seq(&self) -> usize {
        self.seq / self.cp
    }

    /// Position in the sequence of local token `i` on context-parallel rank `c`.
    pub fn position_of(&self, c: usize, i: usize) -> usize {
        if self.cp == 1 {
            return i;
        }
        let chunk = self.seq / (2 * self.cp);
        if i < chunk {
            c * chunk + i
        } else {
            (2 * self.cp - 1 - c) * chunk + (i - chunk)
        }
    }

    /// Positions of this rank's tokens of one sequence.
    pub fn positions(&self) -> Vec<usize> {
        (0..self.local_seq())
            .map(|i| self.position_of(self.c, i))
            .collect()
    }
}

/// Activations of one block kept for backward.
#[derive(Debug)]
pub struct BlockCache {
    x: Vec<f32>,
    inner: Option<BlockSaved>,
}

#[derive(Debug, Default)]
struct BlockSaved {
    /// Post-norm: the sums the two norms read (input + attention, then + MLP).
    post: Option<(Vec<f32>, Vec<f32>)>,
    n1: Vec<f32>,
    st1: Vec<[f32; 2]>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    probs: Option<Vec<f32>>,
    /// Ring attention's log-sum-exp per query row (context parallelism).
    lse: Option<Vec<f32>>,
    o: Vec<f32>,
    x2: Vec<f32>,
    n2: Vec<f32>,
    /// The shared experts' input, gathered over the tensor-parallel ranks, where the mixture
    /// beside them runs on this rank's own rows (folded experts).
    shared_n2: Option<Vec<f32>>,
    /// The shared experts' gate per row of this rank, and their output before it.
    gate: Option<Vec<f32>>,
    shared_out: Option<Vec<f32>>,
    /// Queries and keys before their norms, with the norms' statistics.
    qk_pre: Option<QkPre>,
    /// Latent attention's latents.
    latent: Option<LatentSaved>,
    /// A Mamba-2 layer's mixer activations.
    mamba: Option<MambaSaved>,
    st2: Vec<[f32; 2]>,
    u: Vec<f32>,
    up: Option<Vec<f32>>,
    act: Option<Vec<f32>>,
    moe: Option<MoeSaved>,
}

/// Queries and keys before the query/key norms, and the norms' per-head statistics.
#[derive(Debug)]
struct QkPre {
    q: Vec<f32>,
    k: Vec<f32>,
    sq: Vec<[f32; 2]>,
    sk: Vec<[f32; 2]>,
}

/// A latent before its norm, the norm's statistics, and the latent after it.
type Normed = (Vec<f32>, Vec<[f32; 2]>, Vec<f32>);

/// Latent attention's latents (the query one where queries have one).
#[derive(Debug)]
struct LatentSaved {
    q: Option<Normed>,
    kv: Normed,
}

/// Heads of width `from` (rows of heads side by side) cut or zero-padded to width `to`.
fn head_widths(x: &[f32], from: usize, to: usize) -> std::borrow::Cow<'_, [f32]> {
    if from == to {
        return x.into();
    }
    let mut y = vec![0.0; x.len() / from * to];
    let w = from.min(to);
    for (yh, xh) in y.chunks_exact_mut(to).zip(x.chunks_exact(from)) {
        yh[..w].copy_from_slice(&xh[..w]);
    }
    y.into()
}

/// Latent attention's forward on the rows `n1` (`tt × h`): the queries, keys and values of
/// this rank's `nh` heads, each zero-padded to [`Latent::width`] for the attention kernel
/// (queries scaled so that its `1/√width` is the model's `1/√(nope + rope)`), and the latents
/// for backward. The rotary part of the queries and the key's shared one turn by position.
#[allow(clippy::too_many_arguments)]
fn mla_fwd(
    m: Latent,
    ml: &MlaLayout,
    p: &[f32],
    n1: &[f32],
    h: usize,
    nh: usize,
    theta: f64,
    pos: &[usize],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, LatentSaved) {
    let tt = n1.len() / h;
    let (qk, aw, kvw, lseq) = (m.qk(), m.width(), m.nope + m.v, pos.len());
    let proj = |x: &[f32], w: &Range<usize>, k: usize, n: usize| {
        let mut y = vec![0.0; tt * n];
        mm(&mut y, x, &p[w.clone()], tt, k, n, false);
        y
    };
    let norm = |x: Vec<f32>, w: &Range<usize>| {
        let (y, st) = normed(p, (w, &None), &x, true);
        (x, st, y)
    };
    let cq = ml
        .q_down
        .as_ref()
        .map(|(wd, wn)| norm(proj(n1, wd, h, m.q_rank), wn));
    let q_raw = match &cq {
        Some((_, _, c)) => proj(c, &ml.q_up, m.q_rank, nh * qk),
        None => proj(n1, &ml.q_up, h, nh * qk),
    };
    let down = proj(n1, &ml.kv_down, h, m.kv_rank + m.rope);
    let (ckv, mut kpe) = split_columns(&down, m.kv_rank, m.rope);
    let ckv = norm(ckv, &ml.kv_norm);
    let kv = proj(&ckv.2, &ml.kv_up, m.kv_rank, nh * kvw);
    let mut qpe = vec![0.0; tt * nh * m.rope];
    for (qp, qr) in qpe.chunks_exact_mut(m.rope).zip(q_raw.chunks_exact(qk)) {
        qp.copy_from_slice(&qr[m.nope..]);
    }
    rope(&mut qpe, nh, m.rope, theta, |r| pos[r % lseq], false);
    rope(&mut kpe, 1, m.rope, theta, |r| pos[r % lseq], false);
    let qs = (aw as f32 / qk as f32).sqrt();
    let (mut q, mut k, mut v) = (
        vec![0.0; tt * nh * aw],
        vec![0.0; tt * nh * aw],
        vec![0.0; tt * nh * aw],
    );
    for (i, ((qh, kh), vh)) in q
        .chunks_exact_mut(aw)
        .zip(k.chunks_exact_mut(aw))
        .zip(v.chunks_exact_mut(aw))
        .enumerate()
    {
        let (r, nope) = (i / nh, m.nope);
        let (qr, kvr) = (&q_raw[i * qk..], &kv[i * kvw..]);
        for j in 0..nope {
            qh[j] = qr[j] * qs;
        }
        for (j, x) in qpe[i * m.rope..(i + 1) * m.rope].iter().enumerate() {
            qh[nope + j] = x * qs;
        }
        kh[..nope].copy_from_slice(&kvr[..nope]);
        kh[nope..qk].copy_from_slice(&kpe[r * m.rope..(r + 1) * m.rope]);
        vh[..m.v].copy_from_slice(&kvr[nope..kvw]);
    }
    (q, k, v, LatentSaved { q: cq, kv: ckv })
}

/// Backward of [`mla_fwd`] from the gradients of the padded queries, keys and values:
/// accumulates the parameter gradients (the projections' through `wgrad`, which may defer
/// them) and returns the gradient of the rows `n1`.
#[allow(clippy::too_many_arguments)]
fn mla_bwd(
    m: Latent,
    ml: &MlaLayout,
    (p, g): (&[f32], &mut [f32]),
    n1: &[f32],
    saved: &LatentSaved,
    (dq, dk, dv): (&[f32], &[f32], &[f32]),
    (h, nh, theta, pos): (usize, usize, f64, &[usize]),
    wgrad: &mut WeightGradFn<'_>,
) -> Vec<f32> {
    let tt = n1.len() / h;
    let (qk, aw, kvw, lseq, nope) = (m.qk(), m.width(), m.nope + m.v, pos.len(), m.nope);
    let qs = (aw as f32 / qk as f32).sqrt();
    let mut dq_raw = vec![0.0; tt * nh * qk];
    let mut dqpe = vec![0.0; tt * nh * m.rope];
    let mut dkv = vec![0.0; tt * nh * kvw];
    let mut dkpe = vec![0.0; tt * m.rope];
    for i in 0..tt * nh {
        let r = i / nh;
        let (qh, kh, vh) = (&dq[i * aw..], &dk[i * aw..], &dv[i * aw..]);
        for j in 0..nope {
            dq_raw[i * qk + j] = qh[j] * qs;
        }
        for j in 0..m.rope {
            dqpe[i * m.rope + j] = qh[nope + j] * qs;
            // The rotary key is every head's: its gradient is their sum.
            dkpe[r * m.rope + j] += kh[nope + j];
        }
        dkv[i * kvw..i * kvw + nope].copy_from_slice(&kh[..nope]);
        dkv[i * kvw + nope..(i + 1) * kvw].copy_from_slice(&vh[..m.v]);
    }
    rope(&mut dqpe, nh, m.rope, theta, |r| pos[r % lseq], true);
    rope(&mut dkpe, 1, m.rope, theta, |r| pos[r % lseq], true);
    for (dr, dp) in dq_raw.chunks_exact_mut(qk).zip(dqpe.chunks_exact(m.rope)) {
        dr[nope..].copy_from_slice(dp);
    }
    // Through a latent's norm: the gradient of its input from its output's.
    let norm_bwd_of = |g: &mut [f32], dy: &[f32], (x, st, _): &Normed, w: &Range<usize>| {
        let mut dx = vec![0.0; dy.len()];
        normed_bwd((p, g), (w, &None), &mut dx, dy, x, st, true, false);
        dx
    };
    // Keys and values.
    let kv = &saved.kv;
    wgrad(g, &ml.kv_up, &kv.2, &dkv, tt, m.kv_rank, nh * kvw);
    let mut dc = vec![0.0; tt * m.kv_rank];
    mm_nt(
        &mut dc,
        &dkv,
        &p[ml.kv_up.clone()],
        tt,
        m.kv_rank,
        nh * kvw,
        false,
    );
    let dc = norm_bwd_of(g, &dc, kv, &ml.kv_norm);
    let ddown = join_columns(&dc, &dkpe, m.kv_rank, m.rope);
    let down = m.kv_rank + m.rope;
    wgrad(g, &ml.kv_down, n1, &ddown, tt, h, down);
    let mut dn1 = vec![0.0; tt * h];
    mm_nt(&mut dn1, &ddown, &p[ml.kv_down.clone()], tt, h, down, false);
    // Queries.
    match (&ml.q_down, &saved.q) {
        (Some((wd, wn)), Some(cq)) => {
            wgrad(g, &ml.q_up, &cq.2, &dq_raw, tt, m.q_rank, nh * qk);
            let mut dc = vec![0.0; tt * m.q_rank];
            mm_nt(
                &mut dc,
                &dq_raw,
                &p[ml.q_up.clone()],
                tt,
                m.q_rank,
                nh * qk,
                false,
            );
            let dc = norm_bwd_of(g, &dc, cq, wn);
            wgrad(g, wd, n1, &dc, tt, h, m.q_rank);
            mm_nt(&mut dn1, &dc, &p[wd.clone()], tt, h, m.q_rank, true);
        }
        _ => {
            wgrad(g, &ml.q_up, n1, &dq_raw, tt, h, nh * qk);
            mm_nt(&mut dn1, &dq_raw, &p[ml.q_up.clone()], tt, h, nh * qk, true);
        }
    }
    dn1
}

/// The rows `at` of `x` (rows `h` wide), one after another.
fn gather_rows_at(x: &[f32], at: &[usize], h: usize) -> Vec<f32> {
    at.iter()
        .flat_map(|r| x[r * h..(r + 1) * h].iter().copied())
        .collect()
}

/// Rows of `x` (`a + b` wide) as their first `a` columns and their last `b`.
fn split_columns(x: &[f32], a: usize, b: usize) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / (a + b);
    let (mut left, mut right) = (Vec::with_capacity(rows * a), Vec::with_capacity(rows * b));
    for row in x.chunks_exact(a + b) {
        left.extend_from_slice(&row[..a]);
        right.extend_from_slice(&row[a..]);
    }
    (left, right)
}

/// Rows of `left` (`a` wide) and of `right` (`b` wide) side by side.
fn join_columns(left: &[f32], right: &[f32], a: usize, b: usize) -> Vec<f32> {
    let mut y = Vec::with_capacity(left.len() + right.len());
    for (l, r) in left.chunks_exact(a).zip(right.chunks_exact(b)) {
        y.extend_from_slice(l);
        y.extend_from_slice(r);
    }
    y
}

fn slice<'a>(p: &'a [f32], r: &Option<Range<usize>>) -> Option<&'a [f32]> {
    r.as_ref().map(|r| &p[r.clone()])
}

/// Where a norm's weight and (LayerNorm) bias lie in a unit buffer.
type NormAt<'a> = (&'a Range<usize>, &'a Option<Range<usize>>);

/// The rows `x` through the norm at `(w, b)` of `p` (`rms`: RMSNorm, else LayerNorm), with
/// the per-row statistics its backward needs.
fn normed(p: &[f32], (w, b): NormAt<'_>, x: &[f32], rms: bool) -> (Vec<f32>, Vec<[f32; 2]>) {
    let mut y = vec![0.0; x.len()];
    let st = norm_fwd(&mut y, x, &p[w.clone()], slice(p, b), rms);
    (y, st)
}

/// Backward of [`normed`]: the weight's and bias's gradients into `g` and the input's into
/// `dx` (added to it with `acc`, in its place otherwise).
#[allow(clippy::too_many_arguments)]
fn normed_bwd(
    (p, g): (&[f32], &mut [f32]),
    (w, b): NormAt<'_>,
    dx: &mut [f32],
    dy: &[f32],
    x: &[f32],
    st: &[[f32; 2]],
    rms: bool,
    acc: bool,
) {
    let (lo, hi) = split_two(g, w, b);
    norm_bwd(dx, dy, x, st, &p[w.clone()], lo, hi, rms, acc);
}

/// Forward of one block on local rows `x` with (local) parameters `p` (and experts `pe`).
#[allow(clippy::too_many_arguments)]
pub fn block_fwd(
    d: &Dims,
    l: &BlockLayout,
    p: &[f32],
    pe: &[f32],
    x: Vec<f32>,
    tp: &mut Tp<'_>,
    pass: Pass,
    keep: Keep,
) -> Result<(Vec<f32>, BlockCache), CommError> {
    let (y, mut saved) = block_fwd_inner(d, l, p, pe, &x, tp, pass, keep)?;
    if let (Keep::Modules(m), Some(s)) = (keep, saved.as_mut()) {
        drop_modules(s, m, d, l);
    }
    Ok((y, BlockCache { x, inner: saved }))
}

#[allow(clippy::too_many_arguments)]
fn block_fwd_inner(
    d: &Dims,
    l: &BlockLayout,
    p: &[f32],
    pe: &[f32],
    x: &[f32],
    tp: &mut Tp<'_>,
    pass: Pass,
    keep: Keep,
) -> Result<(Vec<f32>, Option<BlockSaved>), CommError> {
    let t = tp.size();
    let (h, hd, aw) = (d.h, d.hd, d.att_hd());
    let (nh, nkv, f) = (d.heads / t, d.local_kv_heads(t), l.ffn / t);
    let (qw, kw) = (nh * hd, nkv * hd);
    let rows = x.len() / h;
    let (ln1, ln2) = ((&l.ln1_w, &l.ln1_b), (&l.ln2_w, &l.ln2_b));
    let tt = tp.gathered(rows);
    if let Some(mb) = &l.mamba {
        return mamba_layer_fwd(d, l, mb, p, x, tp, pass, keep);
    }
    // A hybrid stack's MLP layers have no attention: the MLP reads the layer's input.
    let (x2, r1, n1, st1, q, k, v, probs, lse, o, qk_pre, latent) = if l.attn {
        // Pre-norm: each sublayer reads its input normalised; post-norm (BERT): the sum of a
        // sublayer's input and output is normalised.
        let (n1, mut st1) = if d.bert {
            (x.to_vec(), Vec::new())
        } else {
            normed(p, ln1, x, d.rms)
        };
        let n1 = tp.enter_fwd(n1)?;
        let lin = |x: &[f32], w: &Range<usize>, b: &Option<Range<usize>>, n: usize| {
            let mut y = vec![0.0; tt * n];
            mm(&mut y, x, &p[w.clone()], tt, h, n, false);
            if let Some(b) = slice(p, b) {
                add_bias(&mut y, b);
            }
            y
        };
        let pos = pass.positions();
        let lseq = pos.len();
        let (q, k, v, qk_pre, latent) = match (d.mla, &l.mla) {
            (Some(m), Some(ml)) => {
                let (q, k, v, saved) = mla_fwd(m, ml, p, &n1, h, nh, d.rope_theta as f64, &pos);
                (q, k, v, None, Some(saved))
            }
            _ => {
                let mut q = lin(&n1, &l.wq, &l.bq, qw);
                let mut k = lin(&n1, &l.wk, &l.bk, kw);
                let v = lin(&n1, &l.wv, &l.bv, kw);
                // Query and key norms: each head's vector RMS-normalised, before the rotary
                // embedding.
                let qk_pre = match (&l.q_norm, &l.k_norm) {
                    (Some(qn), Some(kn)) => {
                        let (q_normed, sq) = normed(p, (qn, &None), &q, true);
                        let (k_normed, sk) = normed(p, (kn, &None), &k, true);
                        let pre = QkPre { q, k, sq, sk };
                        (q, k) = (q_normed, k_normed);
                        Some(pre)
                    }
                    _ => None,
                };
                if d.rope {
                    let theta = d.rope_theta as f64;
                    rope(&mut q, nh, hd, theta, |r| pos[r % lseq], false);
                    rope(&mut k, nkv, hd, theta, |r| pos[r % lseq], false);
                }
                (q, k, v, qk_pre, None)
            }
        };
        // Under context parallelism the keys and values travel the ring of context-parallel ranks.
        let (o, probs, lse) = match tp.cp {
            Some(g) => {
                let r = ring_shape(&pass, nh, nkv, aw, l.mask(d));
                let sinks = slice(p, &l.sinks);
                let (o, lse) = ring_fwd(&mut *tp.comm, g, (&q, &k, &v), sinks, &pass, &r)?;
                (o, None, Some(lse))
            }
            None => {
                let mut o = vec![0.0; tt * nh * aw];
                let probs = attention_fwd(
                    &mut o,
                    &q,
                    &k,
                    &v,
                    &pass.attention(&pos, (nh, nkv, aw), l.mask(d)),
                    slice(p, &l.sinks),
                    keep.probs(),
                );
                (o, probs, None)
            }
        };
        let mut a = vec![0.0; tt * h];
        let vw = nh * d.v_hd();
        mm(
            &mut a,
            &head_widths(&o, aw, d.v_hd()),
            &p[l.wo.clone()],
            tt,
            vw,
            h,
            false,
        );
        let mut a = tp.exit_fwd(a)?;
        if let Some(b) = slice(p, &l.bo) {
            add_bias(&mut a, b);
        }
        add_into(&mut a, x);
        let (x2, r1) = if d.bert {
            let x2;
            (x2, st1) = normed(p, ln1, &a, d.rms);
            (x2, Some(a))
        } else {
            (a, None)
        };
        (x2, r1, n1, st1, q, k, v, probs, lse, o, qk_pre, latent)
    } else {
        let none = Vec::new;
        let st: Vec<[f32; 2]> = Vec::new();
        (
            x.to_vec(),
            None,
            none(),
            st,
            none(),
            none(),
            none(),
            None,
            None,
            none(),
            None,
            None,
        )
    };
    // A hybrid stack's attention layers have no MLP.
    if !l.has_mlp() {
        let saved = (keep != Keep::Input).then(|| BlockSaved {
            n1,
            st1,
            q,
            k,
            v,
            probs,
            lse,
            o,
            qk_pre,
            latent,
            ..BlockSaved::default()
        });
        return Ok((x2, saved));
    }
    let (n2, mut st2) = if d.bert {
        (x2.clone(), Vec::new())
    } else {
        normed(p, ln2, &x2, d.rms)
    };
    let folded = l.moe.is_some() && tp.fold;
    // The shared experts' gate, per row of this rank.
    let gate = l.shared_gate.as_ref().map(|r| {
        let mut z = vec![0.0; rows];
        mm(&mut z, &n2, &p[r.clone()], rows, h, 1, false);
        z.iter().map(|v| sigmoid(*v)).collect::<Vec<f32>>()
    });
    let (n2, shared_n2) = mlp_inputs(l, tp, n2)?;
    // The MLP: the routed experts' output (and what their backward needs), plus the dense
    // MLP's (a dense layer's, or the shared experts') with its pre-activations and activation.
    let (routed, moe) = match &l.moe {
        Some(ml) => {
            // Folded, the mixture runs on this rank's own rows; otherwise every
            // tensor-parallel rank runs it on every row (experts replicated over them): its
            // output needs no reduction, only this rank's rows.
            let mut ep = Ep {
                comm: &mut *tp.comm,
                group: tp.ep,
            };
            let (m, ms) = moe_fwd(ml, p, pe, &n2, h, d.ffn, &mut ep)?;
            let m = if folded { m } else { tp.own_rows(m)? };
            (Some(m), Some(ms))
        }
        None => (None, None),
    };
    let (dense, u, up, act) = if l.has_dense_mlp() {
        let (u, up) = mlp_pre(l, p, shared_n2.as_ref().unwrap_or(&n2), h, f);
        let act = d.act().fwd(&u, up.as_deref());
        let mut m = vec![0.0; tt * h];
        mm(&mut m, &act, &p[l.w_out.clone()], tt, f, h, false);
        let mut m = tp.exit_fwd(m)?;
        if let Some(b) = slice(p, &l.b_out) {
            add_bias(&mut m, b);
        }
        (Some(m), u, up, Some(act))
    } else {
        (None, Vec::new(), None, None)
    };
    // Gated, the shared experts' output is kept as it was for the gate's gradient.
    let (dense, shared_out) = match (dense, &gate) {
        (Some(m), Some(g)) => (Some(scale_rows(m.clone(), g)), Some(m)),
        (dense, _) => (dense, None),
    };
    let mut m = sum_parts(routed, dense);
    add_into(&mut m, &x2);
    let (m, post) = match r1 {
        Some(r1) => {
            let y;
            (y, st2) = normed(p, ln2, &m, d.rms);
            (y, Some((r1, m)))
        }
        None => (m, None),
    };
    let saved = (keep != Keep::Input).then(|| BlockSaved {
        post,
        n1,
        st1,
        q,
        k,
        v,
        probs,
        lse,
        o,
        x2,
        n2,
        shared_n2,
        gate,
        shared_out,
        qk_pre,
        latent,
        st2,
        u,
        up,
        act: act.filter(|_| keep.act()),
        moe,
        mamba: None,
    });
    Ok((m, saved))
}

/// A hybrid stack's Mamba-2 layer: `x + mixer(norm(x))`, the mixer on the gathered rows
/// (whole sequences) split by heads over the tensor-parallel ranks.
#[allow(clippy::too_many_arguments)]
fn mamba_layer_fwd(
    d: &Dims,
    l: &BlockLayout,
    mb: &MambaBlock,
    p: &[f32],
    x: &[f32],
    tp: &mut Tp<'_>,
    pass: Pass,
    keep: Keep,
) -> Result<(Vec<f32>, Option<BlockSaved>), CommError> {
    let (n1, st1) = normed(p, (&l.ln1_w, &l.ln1_b), x, d.rms);
    let n1 = tp.enter_fwd(n1)?;
    let (o, ms) = mamba_fwd(mb.m, &mb.l, p, &n1, d.h, pass.seq);
    let mut y = tp.exit_fwd(o)?;
    add_into(&mut y, x);
    let saved = (keep != Keep::Input).then(|| BlockSaved {
        n1,
        st1,
        mamba: Some(ms),
        ..BlockSaved::default()
    });
    Ok((y, saved))
}

/// Backward of [`mamba_layer_fwd`] from the output gradient `dy`.
#[allow(clippy::too_many_arguments)]
fn mamba_layer_bwd(
    d: &Dims,
    l: &BlockLayout,
    mb: &MambaBlock,
    (p, g): (&[f32], &mut [f32]),
    x: &[f32],
    s: &BlockSaved,
    dy: Vec<f32>,
    tp: &mut Tp<'_>,
    pass: Pass,
    wgrad: &mut WeightGradFn<'_>,
) -> Result<Vec<f32>, CommError> {
    let Some(ms) = &s.mamba else {
        unreachable!("a Mamba layer saves its mixer")
    };
    let dout = tp.exit_bwd(dy.clone())?;
    let dn1 = mamba_bwd(
        mb.m,
        &mb.l,
        (p, g),
        &s.n1,
        ms,
        &dout,
        (d.h, pass.seq),
        wgrad,
    );
    finish_attention_bwd(d, l, (p, g), tp, x, &s.st1, dn1, dy)
}

/// `x` (rows of equal width) with row `i` scaled by `by[i]`.
fn scale_rows(mut x: Vec<f32>, by: &[f32]) -> Vec<f32> {
    let width = x.len() / by.len().max(1);
    for (row, k) in x.chunks_exact_mut(width.max(1)).zip(by) {
        row.iter_mut().for_each(|v| *v *= k);
    }
    x
}

/// The MLP's output (or input gradient): the routed experts' part plus the dense MLP's.
fn sum_parts(routed: Option<Vec<f32>>, dense: Option<Vec<f32>>) -> Vec<f32> {
    match (routed, dense) {
        (Some(mut a), Some(b)) => {
            add_into(&mut a, &b);
            a
        }
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => unreachable!("a block has routed experts or a dense MLP"),
    }
}

/// Backward of one block: accumulates parameter gradients into `g` (the unit's gradient
/// buffer) and returns the input gradient. Full recomputation reruns the forward first.
#[allow(clippy::too_many_arguments)]
pub fn block_bwd(
    d: &Dims,
    l: &BlockLayout,
    (p, g): (&[f32], &mut [f32]),
    (pe, ge): (&[f32], &mut [f32]),
    cache: BlockCache,
    dy: Vec<f32>,
    tp: &mut Tp<'_>,
    pass: Pass,
    mut defer: Option<&mut Vec<WeightGrad>>,
) -> Result<Vec<f32>, CommError> {
    let mut wgrad = |g: &mut [f32], r: &Range<usize>, x: &[f32], dy: &[f32], rows, k, n| match defer
        .as_deref_mut()
    {
        Some(list) => list.push(WeightGrad {
            range: r.clone(),
            x: x.to_vec(),
            dy: dy.to_vec(),
            rows,
            k,
            n,
        }),
        None => mm_tn(&mut g[r.clone()], x, dy, rows, k, n, true),
    };
    let x = cache.x;
    let s = match cache.inner {
        Some(mut s) => {
            restore(d, l, p, pe, &x, &mut s, tp, pass)?;
            s
        }
        None => match block_fwd_inner(d, l, p, pe, &x, tp, pass, Keep::All)?.1 {
            Some(s) => s,
            None => unreachable!("Keep::All saves activations"),
        },
    };
    let t = tp.size();
    let (h, hd, aw, vd) = (d.h, d.hd, d.att_hd(), d.v_hd());
    let (nh, nkv, f) = (d.heads / t, d.local_kv_heads(t), l.ffn / t);
    let (qw, kw) = (nh * hd, nkv * hd);
    let tt = tp.gathered(x.len() / h);
    if let Some(mb) = &l.mamba {
        return mamba_layer_bwd(d, l, mb, (p, g), &x, &s, dy, tp, pass, &mut wgrad);
    }

    // A hybrid stack's attention layers have no MLP: the gradient passes to the attention.
    let dx2 = if !l.has_mlp() {
        dy
    } else {
        // MLP.
        // Through a norm (the layer's first or second): the gradient of its input, fresh or
        // added to `dx`.
        let norm_back = |g: &mut [f32], dx: &mut [f32], dy: &[f32], x: &[f32], st, w, b, acc| {
            normed_bwd((p, g), (w, b), dx, dy, x, st, d.rms, acc);
        };
        // Post-norm: the block's output is the second norm of the MLP's input plus its output.
        let mut dx2 = match &s.post {
            Some((_, r2)) => {
                let mut dr2 = vec![0.0; dy.len()];
                norm_back(g, &mut dr2, &dy, r2, &s.st2, &l.ln2_w, &l.ln2_b, false);
                dr2
            }
            None => dy,
        };
        let routed = if let (Some(ml), Some(ms)) = (&l.moe, s.moe) {
            let folded = tp.fold;
            let dm = if folded {
                dx2.clone()
            } else {
                tp.gather_rows(dx2.clone())?
            };
            let mut ep = Ep {
                comm: &mut *tp.comm,
                group: tp.ep,
            };
            let dn2 = moe_bwd(ml, (p, g), (pe, ge), &s.n2, ms, &dm, h, d.ffn, &mut ep)?;
            // Folded, the input gradient is this rank's rows already; otherwise it is whole on
            // every rank: no reduction, this rank's rows.
            Some(if folded { dn2 } else { tp.own_rows(dn2)? })
        } else {
            None
        };
        // Through the shared experts' gate: their output's gradient is scaled by it, and its
        // logit's is the row's dot product with their output through the sigmoid.
        let mut dgate = None;
        if let (Some(r), Some(gv), Some(out)) = (&l.shared_gate, &s.gate, &s.shared_out) {
            let rows = gv.len();
            let dz: Vec<f32> = (0..rows)
                .map(|i| {
                    let dot: f32 = dx2[i * h..(i + 1) * h]
                        .iter()
                        .zip(&out[i * h..(i + 1) * h])
                        .map(|(a, b)| a * b)
                        .sum();
                    dot * gv[i] * (1.0 - gv[i])
                })
                .collect();
            // This rank's rows of the MLP's input: gathered unless the mixture is folded.
            let local = if tp.fold {
                s.n2.clone()
            } else {
                tp.own_rows(s.n2.clone())?
            };
            wgrad(g, r, &local, &dz, rows, h, 1);
            let mut dn = vec![0.0; rows * h];
            mm_nt(&mut dn, &dz, &p[r.clone()], rows, h, 1, false);
            dgate = Some(dn);
        }
        let dense = if l.has_dense_mlp() {
            let n2 = s.shared_n2.as_ref().unwrap_or(&s.n2);
            let dx2 = match &s.gate {
                Some(gv) => scale_rows(dx2.clone(), gv),
                None => dx2.clone(),
            };
            if let Some(r) = &l.b_out {
                bias_grad(&mut g[r.clone()], &dx2);
            }
            let dm = tp.exit_bwd(dx2.clone())?;
            let act = match s.act {
                Some(a) => a,
                None => d.act().fwd(&s.u, s.up.as_deref()),
            };
            wgrad(g, &l.w_out, &act, &dm, tt, f, h);
            drop(act);
            let mut dact = vec![0.0; tt * f];
            mm_nt(&mut dact, &dm, &p[l.w_out.clone()], tt, f, h, false);
            let mut dn2 = vec![0.0; tt * h];
            let dup = d.act().bwd(&mut dact, &s.u, s.up.as_deref());
            if let (Some(dup), Some(w_up)) = (dup, &l.w_up) {
                wgrad(g, w_up, n2, &dup, tt, h, f);
                mm_nt(&mut dn2, &dup, &p[w_up.clone()], tt, h, f, false);
            }
            let du = dact;
            if let Some(r) = &l.b_in {
                bias_grad(&mut g[r.clone()], &du);
            }
            wgrad(g, &l.w_in, n2, &du, tt, h, f);
            mm_nt(&mut dn2, &du, &p[l.w_in.clone()], tt, h, f, true);
            Some(tp.enter_bwd(dn2)?)
        } else {
            None
        };
        let mut dn2 = sum_parts(routed, dense);
        if let Some(d) = dgate {
            add_into(&mut dn2, &d);
        }
        match &s.post {
            // The MLP read the first norm's output, which the attention's sum went into.
            Some((r1, _)) => {
                add_into(&mut dx2, &dn2);
                let dx1 = std::mem::take(&mut dx2);
                dx2 = vec![0.0; dx1.len()];
                norm_back(g, &mut dx2, &dx1, r1, &s.st1, &l.ln1_w, &l.ln1_b, false);
            }
            None => norm_back(g, &mut dx2, &dn2, &s.x2, &s.st2, &l.ln2_w, &l.ln2_b, true),
        }
        dx2
    };
    // A hybrid stack's MLP layers have no attention: the MLP read the layer's input.
    if !l.attn {
        return Ok(dx2);
    }

    // Attention.
    if let Some(r) = &l.bo {
        bias_grad(&mut g[r.clone()], &dx2);
    }
    let da = tp.exit_bwd(dx2.clone())?;
    wgrad(g, &l.wo, &head_widths(&s.o, aw, vd), &da, tt, nh * vd, h);
    let mut d_o = vec![0.0; tt * nh * vd];
    mm_nt(&mut d_o, &da, &p[l.wo.clone()], tt, nh * vd, h, false);
    let d_o = head_widths(&d_o, vd, aw);
    let pos = pass.positions();
    let lseq = pos.len();
    let (mut dq, mut dk, dv) = match (tp.cp, &s.lse) {
        (Some(cp), Some(lse)) => {
            let r = ring_shape(&pass, nh, nkv, aw, l.mask(d));
            ring_bwd(
                &mut *tp.comm,
                cp,
                &d_o,
                (&s.q, &s.k, &s.v),
                (&s.o, lse),
                (
                    slice(p, &l.sinks),
                    l.sinks.as_ref().map(|r| &mut g[r.clone()]),
                ),
                &pass,
                &r,
            )?
        }
        _ => {
            let (mut dq, mut dk, mut dv) = (
                vec![0.0; tt * nh * aw],
                vec![0.0; tt * nkv * aw],
                vec![0.0; tt * nkv * aw],
            );
            attention_bwd(
                &mut dq,
                &mut dk,
                &mut dv,
                &d_o,
                &s.q,
                &s.k,
                &s.v,
                s.probs.as_deref(),
                &pass.attention(&pos, (nh, nkv, aw), l.mask(d)),
                slice(p, &l.sinks),
                l.sinks.as_ref().map(|r| &mut g[r.clone()]),
            );
            (dq, dk, dv)
        }
    };
    let theta = d.rope_theta as f64;
    if let (Some(m), Some(ml), Some(lat)) = (d.mla, &l.mla, &s.latent) {
        let dn1 = mla_bwd(
            m,
            ml,
            (p, g),
            &s.n1,
            lat,
            (&dq, &dk, &dv),
            (h, nh, theta, &pos),
            &mut wgrad,
        );
        return finish_attention_bwd(d, l, (p, g), tp, &x, &s.st1, dn1, dx2);
    }
    if d.rope {
        rope(&mut dq, nh, hd, theta, |r| pos[r % lseq], true);
        rope(&mut dk, nkv, hd, theta, |r| pos[r % lseq], true);
    }
    // Through the query and key norms (their weights' gradients summed over the heads here;
    // over the tensor-parallel ranks by the gradient sync).
    if let (Some(pre), Some(qn), Some(kn)) = (&s.qk_pre, &l.q_norm, &l.k_norm) {
        for (dz, x, st, r) in [
            (&mut dq, &pre.q, &pre.sq, qn),
            (&mut dk, &pre.k, &pre.sk, kn),
        ] {
            let dy = std::mem::take(dz);
            let mut dx = vec![0.0; dy.len()];
            normed_bwd((p, &mut *g), (r, &None), &mut dx, &dy, x, st, true, false);
            *dz = dx;
        }
    }
    let mut dn1 = vec![0.0; tt * h];
    for (dz, w, b, n) in [
        (&dq, &l.wq, &l.bq, qw),
        (&dk, &l.wk, &l.bk, kw),
        (&dv, &l.wv, &l.bv, kw),
    ] {
        if let Some(r) = b {
            bias_grad(&mut g[r.clone()], dz);
        }
        wgrad(g, w, &s.n1, dz, tt, h, n);
        mm_nt(&mut dn1, dz, &p[w.clone()], tt, h, n, true);
    }
    finish_attention_bwd(d, l, (p, g), tp, &x, &s.st1, dn1, dx2)
}

/// The end of a block's backward: the gradient `dn1` of the attention's (gathered) input rows
/// reduced over the tensor-parallel ranks and taken through the first norm into the residual
/// stream's gradient `dx`.
#[allow(clippy::too_many_arguments)]
fn finish_attention_bwd(
    d: &Dims,
    l: &BlockLayout,
    (p, g): (&[f32], &mut [f32]),
    tp: &mut Tp<'_>,
    x: &[f32],
    st1: &[[f32; 2]],
    dn1: Vec<f32>,
    mut dx: Vec<f32>,
) -> Result<Vec<f32>, CommError> {
    let dn1 = tp.enter_bwd(dn1)?;
    debug_assert_eq!(dx.len(), x.len());
    if d.bert {
        // The attention read the block's input itself.
        add_into(&mut dx, &dn1);
        return Ok(dx);
    }
    normed_bwd(
        (p, g),
        (&l.ln1_w, &l.ln1_b),
        &mut dx,
        &dn1,
        x,
        st1,
        d.rms,
        true,
    );
    Ok(dx)
}

/// Two disjoint mutable ranges of `g` (the second optional; it must follow the first).
fn split_two<'a>(
    g: &'a mut [f32],
    a: &Range<usize>,
    b: &Option<Range<usize>>,
) -> (&'a mut [f32], Option<&'a mut [f32]>) {
    match b {
        None => (&mut g[a.clone()], None),
        Some(b) => {
            assert!(a.end <= b.start, "ranges out of order");
            let (left, right) = g.split_at_mut(b.start);
            (&mut left[a.clone()], Some(&mut right[..b.len()]))
        }
    }
}

/// The rows `vocab.start..vocab.end` of the token table a rank holds (all of them unless the
/// table is split by vocabulary).
pub type VocabWindow = Range<usize>;

/// Token embedding of rows `rows` of a micro-batch (`tokens` are the micro-batch's, all
/// rows) from the part `wte` of the table holding tokens `vocab`: rows whose token lies
/// outside it stay zero (partial sums of a vocabulary-parallel table, summed over the
/// tensor-parallel group by the caller).
pub fn embed_fwd(
    d: &Dims,
    wte: &[f32],
    vocab: VocabWindow,
    tokens: &[u32],
    rows: Range<usize>,
) -> Vec<f32> {
    let h = d.h;
    let mut x = vec![0.0; rows.len() * h];
    for (i, r) in rows.enumerate() {
        let t = tokens[r] as usize;
        if vocab.contains(&t) {
            let t = t - vocab.start;
            x[i * h..(i + 1) * h].copy_from_slice(&wte[t * h..(t + 1) * h]);
        }
    }
    x
}

/// Adds learned positions to rows `rows` of this rank's tokens of a micro-batch (row `r` is
/// token `r mod local_seq` of its sequence, at the position `pass` gives it).
pub fn positions_fwd(d: &Dims, x: &mut [f32], wpe: &[f32], rows: Range<usize>, pass: &Pass) {
    let h = d.h;
    let lseq = pass.local_seq();
    for (i, r) in rows.enumerate() {
        let pos = pass.position_of(pass.c, r % lseq);
        add_into(&mut x[i * h..(i + 1) * h], &wpe[pos * h..(pos + 1) * h]);
    }
}

/// Token embedding backward: scatter-adds `dx` (rows `rows`) into the gradient of the part
/// of the table holding tokens `vocab`.
pub fn embed_bwd(
    d: &Dims,
    dwte: &mut [f32],
    vocab: VocabWindow,
    tokens: &[u32],
    rows: Range<usize>,
    dx: &[f32],
) {
    let h = d.h;
    for (i, r) in rows.enumerate() {
        let t = tokens[r] as usize;
        if vocab.contains(&t) {
            let t = t - vocab.start;
            add_into(&mut dwte[t * h..(t + 1) * h], &dx[i * h..(i + 1) * h]);
        }
    }
}

/// Learned positions backward.
pub fn positions_bwd(d: &Dims, dwpe: &mut [f32], rows: Range<usize>, pass: &Pass, dx: &[f32]) {
    let h = d.h;
    let lseq = pass.local_seq();
    for (i, r) in rows.enumerate() {
        let pos = pass.position_of(pass.c, r % lseq);
        add_into(&mut dwpe[pos * h..(pos + 1) * h], &dx[i * h..(i + 1) * h]);
    }
}

/// A weight gradient a split backward leaves for later (zero-bubble schedules run the input
/// gradient, `B`, as soon as it can and these, `W`, where the pipeline would idle):
/// `g[range] += xᵀ · dy` with `x` of `rows × k` and `dy` of `rows × n`.
#[derive(Debug)]
pub struct WeightGrad {
    pub range: Range<usize>,
    x: Vec<f32>,
    dy: Vec<f32>,
    rows: usize,
    k: usize,
    n: usize,
}

impl WeightGrad {
    /// Adds the gradient into the unit's gradient buffer `g`.
    pub fn apply(self, g: &mut [f32]) {
        mm_tn(
            &mut g[self.range],
            &self.x,
            &self.dy,
            self.rows,
            self.k,
            self.n,
            true,
        );
    }
}

/// What the head keeps for backward.
#[derive(Debug)]
pub struct HeadCache {
    x: Vec<f32>,
    /// The normalised rows the logits were computed from (every row of the micro-batch under a
    /// vocabulary-parallel head with sequence parallelism).
    hf: Vec<f32>,
    st: Vec<[f32; 2]>,
    dlogits: Vec<f32>,
    /// BERT's heads' activations.
    bert: Option<BertHeadSaved>,
}

/// The vocabulary split of a head: the tensor-parallel group over which the logits' columns
/// are split and the columns this rank holds.
#[derive(Debug)]
pub struct VocabParallel<'a, 'b> {
    pub tp: &'a mut Tp<'b>,
    pub vocab: VocabWindow,
}

/// BERT's next sentence prediction on a micro-batch: the local rows holding a sequence's
/// first token with its label, and the loss's scale.
#[derive(Clone, Debug)]
pub struct Nsp {
    pub rows: Vec<(usize, u32)>,
    pub scale: f32,
}

/// Head forward on local rows: final norm (BERT: its masked-LM transform, dense + GeLU +
/// LayerNorm), logits against `w_out` (`[vocab, hidden]`, or its rows `vp.vocab` when the head
/// is vocabulary-parallel: the embedding when tied; BERT adds its decoder bias),
/// cross-entropy against `targets` (the local rows', or every row of the micro-batch when
/// vocabulary-parallel). Returns the summed loss (of every row when vocabulary-parallel: each
/// rank of the group has it) and BERT's summed next-sentence loss over `nsp`'s rows; the
/// gradients of the losses times their scales are kept for backward.
#[allow(clippy::too_many_arguments)]
pub fn head_fwd(
    d: &Dims,
    l: &HeadLayout,
    p: &[f32],
    w_out: &[f32],
    x: Vec<f32>,
    targets: &[u32],
    scale: f32,
    nsp: Option<&Nsp>,
    vp: Option<VocabParallel<'_, '_>>,
) -> Result<(f64, f64, HeadCache), CommError> {
    let h = d.h;
    let rows = x.len() / h;
    let (hf, st, mut bert) = match &l.bert {
        Some(bh) => {
            let mut u = vec![0.0; rows * h];
            mm(&mut u, &x, &p[bh.dense.0.clone()], rows, h, h, false);
            add_bias(&mut u, &p[bh.dense.1.clone()]);
            let a = Act::Gelu.fwd(&u, None);
            let (hf, st) = normed(p, (&bh.norm.0, &bh.norm.1), &a, d.rms);
            let saved = BertHeadSaved {
                u,
                a,
                cls: Vec::new(),
                pooled: Vec::new(),
                dz: Vec::new(),
            };
            (hf, st, Some(saved))
        }
        None => {
            let (hf, st) = normed(p, (&l.norm_w, &l.norm_b), &x, d.rms);
            (hf, st, None)
        }
    };
    let decoder_bias = |logits: &mut [f32], vocab: &Range<usize>| {
        if let Some(bh) = &l.bert {
            add_bias(logits, &p[bh.bias.clone()][..vocab.len()]);
        }
    };
    let (hf, loss, logits) = match vp {
        None => {
            let v = d.vocab;
            let mut logits = vec![0.0; rows * v];
            mm_nt(&mut logits, &hf, w_out, rows, v, h, false);
            decoder_bias(&mut logits, &(0..v));
            let loss = cross_entropy(&mut logits, targets, v, scale);
            (hf, loss, logits)
        }
        Some(vp) => {
            let hf = vp.tp.gather_rows(hf)?;
            let all = hf.len() / h;
            let lv = vp.vocab.len();
            let mut logits = vec![0.0; all * lv];
            mm_nt(&mut logits, &hf, w_out, all, lv, h, false);
            decoder_bias(&mut logits, &vp.vocab);
            let loss = vocab_parallel_cross_entropy(vp.tp, &mut logits, targets, vp.vocab, scale)?;
            (hf, loss, logits)
        }
    };
    // Next sentence prediction: the pooler (dense + tanh) of each first token, two logits.
    let mut nsp_loss = 0.0;
    if let (Some(bh), Some(bs), Some(nsp)) = (&l.bert, bert.as_mut(), nsp) {
        let n = nsp.rows.len();
        bs.cls = nsp.rows.iter().map(|(r, _)| *r).collect();
        let first = gather_rows_at(&x, &bs.cls, h);
        let mut pooled = vec![0.0; n * h];
        mm(&mut pooled, &first, &p[bh.pooler.0.clone()], n, h, h, false);
        add_bias(&mut pooled, &p[bh.pooler.1.clone()]);
        pooled.iter_mut().for_each(|v| *v = v.tanh());
        let mut z = vec![0.0; n * 2];
        mm(&mut z, &pooled, &p[bh.nsp.0.clone()], n, h, 2, false);
        add_bias(&mut z, &p[bh.nsp.1.clone()]);
        let labels: Vec<u32> = nsp.rows.iter().map(|(_, y)| *y).collect();
        nsp_loss = cross_entropy(&mut z, &labels, 2, nsp.scale);
        bs.pooled = pooled;
        bs.dz = z;
    }
    Ok((
        loss,
        nsp_loss,
        HeadCache {
            x,
            hf,
            st,
            dlogits: logits,
            bert,
        },
    ))
}

/// Megatron's vocabulary-parallel cross-entropy (`tensor_parallel/cross_entropy.py`): each
/// rank holds the columns `vocab` of every row's logits; the row maxima, the sums of
/// exponentials and the target logits are reduced over the tensor-parallel group, so every
/// rank ends with the loss of every row and the gradient of `scale · loss` for its columns (in
/// `logits`, in place).
fn vocab_parallel_cross_entropy(
    tp: &mut Tp<'_>,
    logits: &mut [f32],
    targets: &[u32],
    vocab: VocabWindow,
    scale: f32,
) -> Result<f64, CommError> {
    let lv = vocab.len();
    let rows = targets.len();
    let n = tp.size();
    // Row maxima over the group: every rank's maxima gathered, the largest taken.
    let local_max: Vec<f32> = logits
        .chunks_exact(lv)
        .map(|r| r.iter().copied().fold(f32::NEG_INFINITY, f32::max))
        .collect();
    let mut all = vec![0.0; rows * n];
    tp.comm.all_gather(tp.group, &local_max, &mut all)?;
    let max: Vec<f32> = (0..rows)
        .map(|r| {
            (0..n)
                .map(|k| all[k * rows + r])
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    // Σ exp and the target logit of every row.
    let mut sums = vec![0.0f32; 2 * rows];
    for (r, row) in logits.chunks_exact_mut(lv).enumerate() {
        let t = targets[r] as usize;
        if vocab.contains(&t) {
            sums[rows + r] = row[t - vocab.start] - max[r];
        }
        for x in row.iter_mut() {
            *x = (*x - max[r]).exp();
            sums[r] += *x;
        }
    }
    tp.comm.all_reduce_sum(tp.group, &mut sums)?;
    let mut total = 0.0f64;
    for (r, row) in logits.chunks_exact_mut(lv).enumerate() {
        if targets[r] == IGNORE {
            row.fill(0.0);
            continue;
        }
        let (sum, target) = (sums[r], sums[rows + r]);
        total += f64::from(sum.ln() - target);
        for x in row.iter_mut() {
            *x *= scale / sum;
        }
        let t = targets[r] as usize;
        if vocab.contains(&t) {
            row[t - vocab.start] -= scale;
        }
    }
    Ok(total)
}

/// Weight of the multi-token prediction losses against the main one, shared by the modules:
/// Megatron-LM's `--mtp-loss-scaling-factor` default (DeepSeek-V3 trained with 0.3 for its
/// first 10T tokens, then 0.1), divided by the number of modules as both do.
pub const MTP_LOSS_WEIGHT: f32 = 0.1;

/// One multi-token prediction module (DeepSeek-V3 §2.2, Megatron-LM's
/// `MultiTokenPredictionLayer`): module `j` predicts the token `j + 2` ahead from the previous
/// module's (or the main model's last block's) hidden state and the embedding of the token
/// `j + 1` ahead — each normalised, concatenated `[embedding; hidden]` and projected back to
/// the hidden width — through a block shaped as the last layer, its own final norm and the
/// model's LM head. The embedding table and the head are the main model's.
#[derive(Clone, Debug, PartialEq)]
pub struct MtpLayout {
    enorm: (Range<usize>, Option<Range<usize>>),
    hnorm: (Range<usize>, Option<Range<usize>>),
    /// `[2 · hidden, hidden]`, whole on every tensor-parallel rank (computed on its own rows).
    proj: Range<usize>,
    pub block: BlockLayout,
    /// Its final norm (the LM head is the model's).
    pub head: HeadLayout,
}

impl MtpLayout {
    /// Adds module `j`'s tensors (`mtp.{j}.…`) to `b`, its block's experts to `eb`.
    pub fn build(d: &Dims, j: usize, b: &mut SlotBuilder, eb: &mut SlotBuilder) -> MtpLayout {
        let p = format!("mtp.{j}");
        let enorm = build_norm(d, b, &format!("{p}.enorm"));
        let hnorm = build_norm(d, b, &format!("{p}.hnorm"));
        let proj = b.add(
            format!("{p}.proj"),
            &[2 * d.h, d.h],
            Split::Replicated,
            Init::Normal(INIT_STD),
        );
        let block = BlockLayout::build_named(d, d.layers - 1, &p, b, eb);
        let (norm_w, norm_b) = build_norm(d, b, &format!("{p}.final_norm"));
        MtpLayout {
            enorm,
            hnorm,
            proj,
            block,
            head: HeadLayout {
                norm_w,
                norm_b,
                lm_head: None,
                bert: None,
            },
        }
    }
}

/// What a module's input keeps for backward: the embedding and hidden rows before their norms
/// with the norms' statistics, and the concatenation the projection read.
#[derive(Debug)]
pub struct MtpSaved {
    e: Vec<f32>,
    st_e: Vec<[f32; 2]>,
    hid: Vec<f32>,
    st_h: Vec<[f32; 2]>,
    both: Vec<f32>,
}

/// A module's block input from the embedded next tokens `e` and the previous hidden rows `hid`.
pub fn mtp_input_fwd(
    d: &Dims,
    l: &MtpLayout,
    p: &[f32],
    e: Vec<f32>,
    hid: Vec<f32>,
) -> (Vec<f32>, MtpSaved) {
    let h = d.h;
    let rows = e.len() / h;
    let (en, st_e) = normed(p, (&l.enorm.0, &l.enorm.1), &e, d.rms);
    let (hn, st_h) = normed(p, (&l.hnorm.0, &l.hnorm.1), &hid, d.rms);
    let both = join_columns(&en, &hn, h, h);
    let mut y = vec![0.0; rows * h];
    mm(&mut y, &both, &p[l.proj.clone()], rows, 2 * h, h, false);
    (
        y,
        MtpSaved {
            e,
            st_e,
            hid,
            st_h,
            both,
        },
    )
}

/// Backward of [`mtp_input_fwd`]: the gradients of the embedded tokens and of the previous
/// hidden rows.
pub fn mtp_input_bwd(
    d: &Dims,
    l: &MtpLayout,
    (p, g): (&[f32], &mut [f32]),
    s: MtpSaved,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let h = d.h;
    let rows = dy.len() / h;
    mm_tn(&mut g[l.proj.clone()], &s.both, dy, rows, 2 * h, h, true);
    let mut dboth = vec![0.0; rows * 2 * h];
    mm_nt(&mut dboth, dy, &p[l.proj.clone()], rows, 2 * h, h, false);
    let (den, dhn) = split_columns(&dboth, h, h);
    let mut norm_bwd_of =
        |dy: &[f32], x: &[f32], st: &[[f32; 2]], (w, b): &(Range<usize>, Option<Range<usize>>)| {
            let mut dx = vec![0.0; dy.len()];
            normed_bwd((p, &mut *g), (w, b), &mut dx, dy, x, st, d.rms, false);
            dx
        };
    let de = norm_bwd_of(&den, &s.e, &s.st_e, &l.enorm);
    let dhid = norm_bwd_of(&dhn, &s.hid, &s.st_h, &l.hnorm);
    (de, dhid)
}

/// The tokens and targets of multi-token prediction module `j` for a micro-batch of
/// `tokens` / `targets` (`batch × seq`, whole sequences): each position's token `j + 1` ahead
/// and its target, the last `j + 1` positions of a sequence having none (token 0, target
/// [`IGNORE`]).
pub fn mtp_tokens(tokens: &[u32], targets: &[u32], seq: usize, j: usize) -> (Vec<u32>, Vec<u32>) {
    let k = j + 1;
    let mut t = Vec::with_capacity(tokens.len());
    let mut y = Vec::with_capacity(tokens.len());
    for (ts, ys) in tokens.chunks_exact(seq).zip(targets.chunks_exact(seq)) {
        for i in 0..seq {
            let (tok, tgt) = ts
                .get(i + k)
                .zip(ys.get(i + k))
                .map_or((0, IGNORE), |(a, b)| (*a, *b));
            t.push(tok);
            y.push(tgt);
        }
    }
    (t, y)
}

/// The range of the untied LM head in its unit (none: the head reads the embedding table).
pub fn head_weight_range(l: &HeadLayout) -> Option<Range<usize>> {
    l.lm_head.clone()
}

/// The head's unembedding weight: the untied LM head in `p`, else `None` (use the embedding).
pub fn head_own_weight<'a>(l: &HeadLayout, p: &'a [f32]) -> Option<&'a [f32]> {
    slice(p, &l.lm_head)
}

/// What BERT's heads keep for backward: the masked-LM transform's dense output and its GeLU,
/// and the next-sentence rows, their pooled vectors and logit gradients.
#[derive(Debug)]
struct BertHeadSaved {
    u: Vec<f32>,
    a: Vec<f32>,
    cls: Vec<usize>,
    pooled: Vec<f32>,
    dz: Vec<f32>,
}

/// Backward of [`head_fwd`]: the head's gradients into `g` (the LM head's or, tied, into
/// `tied_dw`) and the gradient of the head's input rows.
#[allow(clippy::too_many_arguments)]
pub fn head_bwd(
    d: &Dims,
    l: &HeadLayout,
    p: &[f32],
    g: &mut [f32],
    w_out: &[f32],
    tied_dw: Option<&mut [f32]>,
    c: HeadCache,
    vp: Option<VocabParallel<'_, '_>>,
) -> Result<Vec<f32>, CommError> {
    let h = d.h;
    let v = vp.as_ref().map_or(d.vocab, |vp| vp.vocab.len());
    let all = c.hf.len() / h;
    let rows = c.x.len() / h;
    let (gn, dw) = match &l.lm_head {
        Some(r) => {
            let (a, b) = g.split_at_mut(r.start);
            (a, Some(&mut b[..r.len()]))
        }
        None => (g, tied_dw),
    };
    if let Some(dw) = dw {
        mm_tn(dw, &c.dlogits, &c.hf, all, v, h, true);
    }
    if let Some(bh) = &l.bert {
        bias_grad(&mut gn[bh.bias.clone()][..v], &c.dlogits);
    }
    let mut dhf = vec![0.0; all * h];
    mm(&mut dhf, &c.dlogits, w_out, all, v, h, false);
    // Each rank's columns give a partial input gradient: summed over the group (scattered
    // back to the local rows under sequence parallelism).
    if let Some(vp) = vp {
        dhf = vp.tp.reduce_rows(dhf)?;
    }
    let mut dx = vec![0.0; rows * h];
    match (&l.bert, c.bert) {
        (Some(bh), Some(bs)) => {
            // The masked-LM transform: LayerNorm, GeLU, dense.
            let mut da = vec![0.0; rows * h];
            let norm = (&bh.norm.0, &bh.norm.1);
            normed_bwd(
                (p, &mut *gn),
                norm,
                &mut da,
                &dhf,
                &bs.a,
                &c.st,
                d.rms,
                false,
            );
            Act::Gelu.bwd(&mut da, &bs.u, None);
            bias_grad(&mut gn[bh.dense.1.clone()], &da);
            mm_tn(&mut gn[bh.dense.0.clone()], &c.x, &da, rows, h, h, true);
            mm_nt(&mut dx, &da, &p[bh.dense.0.clone()], rows, h, h, false);
            // Next sentence prediction: the logits, the pooler's tanh, its dense layer.
            let n = bs.cls.len();
            if n > 0 {
                bias_grad(&mut gn[bh.nsp.1.clone()], &bs.dz);
                mm_tn(&mut gn[bh.nsp.0.clone()], &bs.pooled, &bs.dz, n, h, 2, true);
                let mut dpool = vec![0.0; n * h];
                mm_nt(&mut dpool, &bs.dz, &p[bh.nsp.0.clone()], n, h, 2, false);
                for (dp, y) in dpool.iter_mut().zip(&bs.pooled) {
                    *dp *= 1.0 - y * y;
                }
                let first = gather_rows_at(&c.x, &bs.cls, h);
                bias_grad(&mut gn[bh.pooler.1.clone()], &dpool);
                mm_tn(&mut gn[bh.pooler.0.clone()], &first, &dpool, n, h, h, true);
                let mut dfirst = vec![0.0; n * h];
                mm_nt(&mut dfirst, &dpool, &p[bh.pooler.0.clone()], n, h, h, false);
                for (k, r) in bs.cls.iter().enumerate() {
                    add_into(&mut dx[r * h..(r + 1) * h], &dfirst[k * h..(k + 1) * h]);
                }
            }
        }
        _ => {
            let norm = (&l.norm_w, &l.norm_b);
            normed_bwd((p, gn), norm, &mut dx, &dhf, &c.x, &c.st, d.rms, false);
        }
    }
    Ok(dx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ThreadComm;
    use crate::testing::{check_grad, rand};
    use parallax_ir::models::{zoo, MlaConfig};

    /// The pass the block tests run: two sequences of five tokens.
    const PASS: Pass = Pass {
        batch: 2,
        seq: 5,
        cp: 1,
        c: 0,
    };

    /// A block's parallel context on a single rank.
    fn one_rank<'a>(comm: &'a mut dyn Collectives, group: &'a crate::comm::Group) -> Tp<'a> {
        Tp {
            comm,
            group,
            sp: false,
            cp: None,
            ep: None,
            fold: false,
        }
    }

    /// One block's forward on `x` and backward from the output gradient `r` on a single rank,
    /// keeping `keep`: the input gradient and the gradients of the parameters `p` and of the
    /// experts `pe`.
    #[allow(clippy::too_many_arguments)]
    fn block_grads(
        d: &Dims,
        l: &BlockLayout,
        (p, pe): (&[f32], &[f32]),
        x: &[f32],
        r: &[f32],
        tp: &mut Tp<'_>,
        keep: Keep,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (_, cache) = block_fwd(d, l, p, pe, x.to_vec(), tp, PASS, keep).unwrap();
        let (mut g, mut ge) = (vec![0.0; p.len()], vec![0.0; pe.len()]);
        let dx = block_bwd(
            d,
            l,
            (p, &mut g),
            (pe, &mut ge),
            cache,
            r.to_vec(),
            tp,
            PASS,
            None,
        )
        .unwrap();
        (dx, g, ge)
    }

    /// One block of `c` on one rank: the gradients of its parameters and input against
    /// central differences of `Σ r · block(x)` (every few elements of each).
    fn check_block_gradients(c: &TransformerConfig, what: &str) {
        let d = Dims::from_config(c).unwrap();
        let (mut b, mut eb) = (SlotBuilder::new(1), SlotBuilder::new(1));
        let l = BlockLayout::build(&d, 0, &mut b, &mut eb);
        let (slots, n) = b.finish();
        let mut p = rand(n, 1, 0.3);
        // Norm weights near one, as trained ones are.
        for s in slots.iter().filter(|s| s.init == Init::Ones) {
            p[s.range.clone()].iter_mut().for_each(|v| *v += 1.0);
        }
        let pass = PASS;
        let rows = pass.batch * pass.seq;
        let x = rand(rows * d.h, 2, 1.0);
        let r = rand(rows * d.h, 3, 1.0);
        let (mut comms, _) = ThreadComm::create(1, std::time::Duration::from_secs(5));
        let group = crate::comm::Group::new(vec![0]);
        let mut tp = one_rank(&mut comms[0], &group);
        let (dx, g, _) = block_grads(&d, &l, (&p, &[]), &x, &r, &mut tp, Keep::All);
        let mut objective = |p: &[f32], x: &[f32]| -> f64 {
            let (y, _) = block_fwd(&d, &l, p, &[], x.to_vec(), &mut tp, pass, Keep::All).unwrap();
            y.iter().zip(&r).map(|(a, b)| f64::from(a * b)).sum()
        };
        let at = (0..x.len()).step_by(7);
        check_grad(&format!("{what}: x"), &x, &dx, at, 1e-2, |x| {
            objective(&p, x)
        });
        for s in &slots {
            let at = s.range.clone().step_by(s.range.len() / 5 + 1);
            let name = format!("{what}: {}", s.name);
            check_grad(&name, &p, &g, at, 1e-2, |p| objective(p, &x));
        }
    }

    /// Named-module recomputation redoes, in backward, exactly what the forward computed: a
    /// block's gradients under each module (and all of them) are those of keeping every
    /// activation, to the bit, for plain, latent-attention and mixture-of-experts blocks.
    #[test]
    fn recomputed_modules_give_the_kept_gradients() {
        let plain = TransformerConfig::llama(1, 16, 4, 2, 24, 100, 16);
        let latent = TransformerConfig {
            kv_heads: 4,
            head_dim: 8,
            mla: Some(MlaConfig {
                q_lora_rank: 8,
                kv_lora_rank: 6,
                qk_nope_head_dim: 4,
                qk_rope_head_dim: 4,
                v_head_dim: 6,
            }),
            moe: Some(MoeConfig {
                shared_ffn_hidden: 12,
                ..MoeConfig::routed(4, 2)
            }),
            ..plain.clone()
        };
        for (c, what) in [(&plain, "llama"), (&latent, "latent attention, experts")] {
            let d = Dims::from_config(c).unwrap();
            let (mut b, mut eb) = (SlotBuilder::new(1), SlotBuilder::new(1));
            let l = BlockLayout::build(&d, 0, &mut b, &mut eb);
            let ((_, n), (_, en)) = (b.finish(), eb.finish());
            let (p, pe) = (rand(n, 1, 0.3), rand(en, 4, 0.3));
            let pass = PASS;
            let rows = pass.batch * pass.seq;
            let (x, r) = (rand(rows * d.h, 2, 1.0), rand(rows * d.h, 3, 1.0));
            let (mut comms, _) = ThreadComm::create(1, std::time::Duration::from_secs(5));
            let group = crate::comm::Group::new(vec![0]);
            let mut tp = one_rank(&mut comms[0], &group);
            let mut grads = |keep: Keep| block_grads(&d, &l, (&p, &pe), &x, &r, &mut tp, keep);
            let kept = grads(Keep::All);
            let all = [
                "core_attn",
                "layernorm",
                "mla_up_proj",
                "mlp",
                "moe",
                "shared_experts",
                "moe_act",
            ];
            for names in all.iter().map(|n| vec![*n]).chain([all.to_vec()]) {
                let m = RecomputeModules::parse(&names).unwrap();
                assert!(grads(Keep::Modules(m)) == kept, "{what}: {names:?}");
            }
            // What forward keeps shrinks by the named modules' tensors: all of them named,
            // none of these is kept (plain heads' queries, keys and values are the attention
            // core's inputs, kept).
            let mut saved = |keep: Keep| {
                let (_, cache) =
                    block_fwd(&d, &l, &p, &pe, x.clone(), &mut tp, pass, keep).unwrap();
                let s = cache.inner.unwrap();
                let opt = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, Vec::len);
                let qkv = if l.mla.is_some() {
                    s.q.len() + s.k.len() + s.v.len()
                } else {
                    0
                };
                s.n1.len()
                    + s.n2.len()
                    + qkv
                    + s.u.len()
                    + opt(&s.up)
                    + opt(&s.act)
                    + opt(&s.probs)
                    + usize::from(s.moe.is_some())
            };
            assert!(saved(Keep::All) > 0, "{what}");
            let every = Keep::Modules(RecomputeModules::parse(&all).unwrap());
            assert_eq!(saved(every), 0, "{what}: every named tensor recomputed");
        }
    }

    /// Latent attention's backward (queries through a latent or directly; values narrower and
    /// wider than the queries and keys), and the plain heads' for comparison.
    #[test]
    fn block_gradients_match_finite_differences() {
        let plain = TransformerConfig::llama(1, 16, 4, 2, 24, 100, 16);
        let latent = |q_lora_rank, nope, rope, v| TransformerConfig {
            kv_heads: 4,
            head_dim: nope + rope,
            mla: Some(MlaConfig {
                q_lora_rank,
                kv_lora_rank: 6,
                qk_nope_head_dim: nope,
                qk_rope_head_dim: rope,
                v_head_dim: v,
            }),
            ..plain.clone()
        };
        check_block_gradients(&plain, "llama");
        // BERT's post-norm block attending to every key.
        let encoder = TransformerConfig {
            bert: true,
            causal: false,
            ..TransformerConfig::gpt(1, 16, 4, 24, 100, 16)
        };
        check_block_gradients(&encoder, "post-norm encoder");
        check_block_gradients(&latent(8, 4, 4, 6), "latent queries");
        check_block_gradients(&latent(0, 2, 4, 10), "direct queries, wide values");
    }

    /// A multi-token prediction module's input (both norms, LayerNorm and RMSNorm, and the
    /// projection of their concatenation) against central differences of `Σ r · input(e, h)`.
    #[test]
    fn mtp_input_gradients_match_finite_differences() {
        for c in [
            TransformerConfig::llama(1, 8, 2, 2, 16, 50, 16),
            TransformerConfig::gpt(1, 8, 2, 16, 50, 16),
        ] {
            let d = Dims::from_config(&c).unwrap();
            let (mut b, mut eb) = (SlotBuilder::new(1), SlotBuilder::new(1));
            let l = MtpLayout::build(&d, 0, &mut b, &mut eb);
            let (slots, n) = b.finish();
            let mut p = rand(n, 4, 0.3);
            for s in slots.iter().filter(|s| s.init == Init::Ones) {
                p[s.range.clone()].iter_mut().for_each(|v| *v += 1.0);
            }
            let rows = 6;
            let (e, hid, r) = (
                rand(rows * d.h, 5, 1.0),
                rand(rows * d.h, 6, 1.0),
                rand(rows * d.h, 7, 1.0),
            );
            let objective = |p: &[f32], e: &[f32], hid: &[f32]| -> f64 {
                let (y, _) = mtp_input_fwd(&d, &l, p, e.to_vec(), hid.to_vec());
                y.iter().zip(&r).map(|(a, b)| f64::from(a * b)).sum()
            };
            let (_, saved) = mtp_input_fwd(&d, &l, &p, e.clone(), hid.clone());
            let mut g = vec![0.0; n];
            let (de, dhid) = mtp_input_bwd(&d, &l, (&p, &mut g), saved, &r);
            let at = || (0..e.len()).step_by(5);
            check_grad("de", &e, &de, at(), 1e-2, |e| objective(&p, e, &hid));
            check_grad("dhid", &hid, &dhid, at(), 1e-2, |h| objective(&p, &e, h));
            // The module's own tensors before its block: the norms and the projection.
            for s in slots
                .iter()
                .filter(|s| s.name.contains("norm.") || s.name.ends_with("proj"))
            {
                let at = s.range.clone().step_by(7);
                check_grad(&s.name, &p, &g, at, 1e-2, |p| objective(p, &e, &hid));
            }
        }
    }

    /// BERT's heads (masked-LM transform, biased tied decoder, pooler and next-sentence
    /// classifier) against central differences of their scaled losses.
    #[test]
    fn bert_head_gradients_match_finite_differences() {
        let c = TransformerConfig {
            bert: true,
            causal: false,
            ..TransformerConfig::gpt(1, 8, 2, 16, 12, 16)
        };
        let d = Dims::from_config(&c).unwrap();
        let mut b = SlotBuilder::new(1);
        let l = HeadLayout::build(&d, &mut b);
        let (slots, n) = b.finish();
        let mut p = rand(n, 8, 0.3);
        for s in slots.iter().filter(|s| s.init == Init::Ones) {
            p[s.range.clone()].iter_mut().for_each(|v| *v += 1.0);
        }
        let rows = 6;
        let x = rand(rows * d.h, 9, 1.0);
        let table = rand(d.vocab * d.h, 10, 0.5);
        let targets = [3, IGNORE, 7, IGNORE, IGNORE, 11];
        let nsp = Nsp {
            rows: vec![(0, 1), (3, 0)],
            scale: 0.5,
        };
        let scale = 1.0 / 3.0;
        let objective = |p: &[f32], x: &[f32], table: &[f32]| -> f64 {
            let (a, b, _) = head_fwd(
                &d,
                &l,
                p,
                table,
                x.to_vec(),
                &targets,
                scale,
                Some(&nsp),
                None,
            )
            .unwrap();
            a * f64::from(scale) + b * f64::from(nsp.scale)
        };
        let (_, _, cache) = head_fwd(
            &d,
            &l,
            &p,
            &table,
            x.clone(),
            &targets,
            scale,
            Some(&nsp),
            None,
        )
        .unwrap();
        let (mut g, mut dtable) = (vec![0.0; n], vec![0.0; table.len()]);
        let dx = head_bwd(&d, &l, &p, &mut g, &table, Some(&mut dtable), cache, None).unwrap();
        check_grad("dx", &x, &dx, (0..x.len()).step_by(3), 1e-2, |x| {
            objective(&p, x, &table)
        });
        let at = (0..table.len()).step_by(5);
        check_grad("dtable", &table, &dtable, at, 1e-2, |t| {
            objective(&p, &x, t)
        });
        for s in &slots {
            let at = s.range.clone().step_by(s.range.len() / 6 + 1);
            check_grad(&s.name, &p, &g, at, 1e-2, |p| objective(p, &x, &table));
        }
    }

    /// What the executor does not train is refused by name, never run as a different model.
    #[test]
    fn models_the_executor_cannot_train_are_refused_by_feature() {
        let tiny = TransformerConfig::llama(2, 64, 4, 4, 96, 100, 32);
        assert!(Dims::from_config(&tiny).is_ok());
        let latent = TransformerConfig {
            head_dim: 24,
            mla: Some(MlaConfig {
                q_lora_rank: 0,
                kv_lora_rank: 16,
                qk_nope_head_dim: 16,
                qk_rope_head_dim: 8,
                v_head_dim: 12,
            }),
            ..tiny.clone()
        };
        let nope = TransformerConfig {
            position: Position::None,
            ..tiny.clone()
        };
        let mtp = TransformerConfig {
            mtp_layers: 1,
            ..tiny.clone()
        };
        let hybrid = zoo::transformer("nemotron-h").unwrap();
        let windowed = TransformerConfig {
            sliding_window: Some(parallax_ir::models::SlidingWindow {
                size: 8,
                full_every: 2,
            }),
            ..tiny.clone()
        };
        let sigmoid = TransformerConfig {
            moe: Some(parallax_ir::models::MoeConfig {
                router: parallax_ir::models::Router::Sigmoid,
                ..parallax_ir::models::MoeConfig::routed(4, 2)
            }),
            ..tiny.clone()
        };
        // Windows and NoPE are run: the window alternates with full attention as planned.
        let w = Dims::from_config(&windowed).unwrap();
        assert_eq!(w.window.map(|w| (w.size, w.full_every)), Some((8, 2)));
        let mut b = SlotBuilder::new(1);
        let mut eb = SlotBuilder::new(1);
        let windows: Vec<_> = (0..4)
            .map(|i| BlockLayout::build(&w, i, &mut b, &mut eb).window)
            .collect();
        assert_eq!(windows, [Some(8), None, Some(8), None]);
        let n = Dims::from_config(&nope).unwrap();
        assert!(!n.rope && !n.learned_positions);
        // Token dropping is not trained: the executor's experts compute every routed copy.
        let dropping = TransformerConfig {
            moe: Some(parallax_ir::models::MoeConfig {
                capacity_permille: 1250,
                ..parallax_ir::models::MoeConfig::routed(4, 2)
            }),
            ..tiny.clone()
        };
        let e = Dims::from_config(&dropping).unwrap_err();
        assert!(
            e.contains("capacity factor 1.25") && e.contains("dropless"),
            "{e}"
        );
        // A mixture with a leading dense layer, then every other layer routed: the dense ones
        // get a dense MLP of their own width, the routed ones none (no shared experts).
        let mixed = TransformerConfig {
            moe: Some(parallax_ir::models::MoeConfig {
                dense_layers_first: 1,
                every: 2,
                dense_ffn_hidden: 128,
                ..parallax_ir::models::MoeConfig::routed(4, 2)
            }),
            ..tiny.clone()
        };
        let md = Dims::from_config(&mixed).unwrap();
        let layers: Vec<_> = (0..5)
            .map(|i| {
                let l = BlockLayout::build(&md, i, &mut b, &mut eb);
                (l.is_moe(), l.ffn)
            })
            .collect();
        assert_eq!(
            layers,
            [
                (false, 128),
                (true, 0),
                (false, 128),
                (true, 0),
                (false, 128)
            ]
        );
        // The rotary base is the model's (Llama 3's 500 000), not RoFormer's 10 000.
        let l3 = Dims::from_config(&zoo::transformer("llama3-8b").unwrap()).unwrap();
        assert_eq!(
            (l3.rope_theta, Dims::from_config(&tiny).unwrap().rope_theta),
            (500_000, 10_000)
        );
        let grouped = TransformerConfig {
            moe: Some(parallax_ir::models::MoeConfig {
                groups: 2,
                groups_per_token: 1,
                ..parallax_ir::models::MoeConfig::routed(4, 2)
            }),
            ..tiny.clone()
        };
        let sinks = TransformerConfig {
            attention_sinks: true,
            ..tiny.clone()
        };
        // GPT-OSS's sinks: one logit per head, split with the heads.
        let ds = Dims::from_config(&sinks).unwrap();
        let mut tb = SlotBuilder::new(2);
        let l = BlockLayout::build(&ds, 0, &mut tb, &mut eb);
        assert_eq!(l.sinks.map(|r| r.len()), Some(ds.heads / 2));
        // Qwen3's query and key norms: one weight of a head's width each, whole on every rank.
        let qk = TransformerConfig {
            qk_norm: true,
            ..tiny.clone()
        };
        let dq = Dims::from_config(&qk).unwrap();
        let l = BlockLayout::build(&dq, 0, &mut tb, &mut eb);
        assert_eq!(
            (l.q_norm.map(|r| r.len()), l.k_norm.map(|r| r.len())),
            (Some(dq.hd), Some(dq.hd))
        );
        // DeepSeek-V3's routing is run: sigmoid scores, chosen within the best groups,
        // scaled; the routed layers carry it.
        for (c, want) in [
            (
                &sigmoid,
                Routing {
                    sigmoid: true,
                    ..Routing::default()
                },
            ),
            (
                &grouped,
                Routing {
                    groups: 2,
                    groups_per_token: 1,
                    ..Routing::default()
                },
            ),
        ] {
            let d = Dims::from_config(c).unwrap();
            let l = BlockLayout::build(&d, 0, &mut b, &mut eb);
            assert_eq!(l.moe.map(|m| m.routing), Some(want));
        }
        // Qwen2-MoE's gated shared expert: a gate weight beside its MLP.
        let shared = TransformerConfig {
            moe: Some(parallax_ir::models::MoeConfig {
                shared_ffn_hidden: 64,
                shared_gate: true,
                ..parallax_ir::models::MoeConfig::routed(4, 2)
            }),
            ..tiny.clone()
        };
        let d = Dims::from_config(&shared).unwrap();
        let l = BlockLayout::build(&d, 0, &mut b, &mut eb);
        assert_eq!((l.ffn, l.shared_gate.map(|r| r.len())), (64, Some(d.h)));
        // DeepSeek's latent attention is run: its projections in place of the heads' own.
        let dl = Dims::from_config(&latent).unwrap();
        let l = BlockLayout::build(&dl, 0, &mut tb, &mut eb);
        assert!(l.wq.is_empty() && l.mla.is_some());
        let e = Dims::from_config(&TransformerConfig {
            qk_norm: true,
            ..latent.clone()
        })
        .unwrap_err();
        assert!(e.contains("latent attention with query/key norms"), "{e}");
        let mut no_rope = latent.clone();
        if let Some(m) = no_rope.mla.as_mut() {
            (m.qk_nope_head_dim, m.qk_rope_head_dim) = (24, 0);
        }
        assert!(Dims::from_config(&no_rope)
            .unwrap_err()
            .contains("no rotary part"));
        // Multi-token prediction is run: one module after the last block.
        assert_eq!(Dims::from_config(&mtp).unwrap().mtp, 1);
        // Nemotron-H's hybrid stack is run: each layer its kind.
        let dh = Dims::from_config(&hybrid).unwrap();
        assert_eq!(
            (dh.kind_at(0), dh.kind_at(1), dh.kind_at(5)),
            (LayerKind::Mamba, LayerKind::Moe, LayerKind::Attention)
        );
        // An encoder other than BERT is not: refused by name.
        let encoder = TransformerConfig {
            causal: false,
            ..tiny.clone()
        };
        let e = Dims::from_config(&encoder).unwrap_err();
        assert!(e.contains("encoders other than BERT"), "{e}");
        // Nor are ALiBi's distance biases, which it has no kernel for.
        let alibi = TransformerConfig {
            position: Position::Alibi,
            ..tiny.clone()
        };
        let e = Dims::from_config(&alibi).unwrap_err();
        assert!(e.contains("ALiBi"), "{e}");
        // Nor LatentMoE's projections.
        let latent = TransformerConfig {
            moe: Some(MoeConfig {
                latent: 16,
                ..MoeConfig::routed(4, 2)
            }),
            ..tiny.clone()
        };
        let e = Dims::from_config(&latent).unwrap_err();
        assert!(e.contains("LatentMoE"), "{e}");
    }
}
