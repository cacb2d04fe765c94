//! The closed set of ops, their shape rules, axes mappings and work.
//!
//! Every op sees its inputs in a fixed order: data inputs first, then its weights (created as
//! separate weight tensors by the graph builder, so tied weights are simply shared tensors).
//! Work is computed from shapes alone, so the work of a shard is the op's work on the shard's
//! shapes: that is what lets the planner cost any split the axes mapping derives.
//!
//! FLOP conventions: a multiply-add is 2 FLOPs; attention counts the full `s × t` score matrix
//! even when causal (the "model FLOPs" convention of Megatron-LM and PaLM, which MFU uses; a cost
//! model may discount the masked half of a fused causal kernel); backward of a matmul is twice its
//! forward, split into input-gradient and weight-gradient halves.

use crate::axes::{AxesMapping, AxisRole};
use crate::shape::Shape;
use crate::units::{Bytes, Flops};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Embedding lookup: `[ids(...), table(vocab, dim)] -> [..., dim]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingAttrs {
    pub vocab: u64,
    pub dim: u64,
}

/// Fully connected layer: `[x(..., in), w(in, out), bias(out)?] -> [..., out]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearAttrs {
    pub out_features: u64,
    pub bias: bool,
}

/// Matrix product: `[a(..., m, k), b(k, n) | b(..., k, n)] -> [..., m, n]`; with `transpose_b`
/// the second operand is `(n, k)` (a tied LM head reads the `(vocab, hidden)` embedding table).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatMulAttrs {
    pub transpose_b: bool,
}

/// Scaled dot-product attention core: `[q(b, s, heads, d), k(b, t, kv_heads, d),
/// v(b, t, kv_heads, d)] -> [b, s, heads, d]`. `heads == kv_heads` is MHA, `kv_heads == 1` MQA,
/// anything dividing `heads` GQA. Projections are separate Linear ops.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionAttrs {
    pub causal: bool,
    /// A fused (flash) kernel: scores are never materialized, backward recomputes them.
    pub fused: bool,
    /// Dropout on the attention probabilities (unfused kernels keep its mask for backward).
    pub dropout: bool,
    /// Sliding-window attention: each query attends to the `window` latest keys (itself
    /// included) instead of all (Mistral; GPT-OSS's and Gemma 2's local layers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<u64>,
    /// ALiBi's per-head distance bias on the scores ([`Position::Alibi`]): a fused kernel
    /// computes it from each head's slope (FlashAttention-2's `alibi_slopes`, MPT's Triton
    /// kernel); unfused code adds the bias tensor as the score GEMM's `beta` input, which
    /// `baddbmm` first broadcasts into the whole scores buffer (BLOOM in HuggingFace and
    /// Megatron-DeepSpeed).
    ///
    /// [`Position::Alibi`]: crate::models::Position::Alibi
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub alibi: bool,
}

impl AttentionAttrs {
    /// Keys each query attends to, as the work counts them: `t` or the window.
    pub fn keys(&self, t: u64) -> u64 {
        self.window.map_or(t, |w| w.min(t))
    }

    /// Fraction of the `s × s` scores of a sequence that its queries see: all of them in an
    /// encoder; under a causal mask the triangle with its diagonal, `w·s − w(w − 1)/2` of the
    /// `s²` under a window of `w` keys.
    pub fn seen_fraction(&self, s: u64) -> f64 {
        if !self.causal || s == 0 {
            return 1.0;
        }
        let (s, w) = (s as f64, self.keys(s) as f64);
        ((w * s - w * (w - 1.0) / 2.0) / (s * s)).clamp(0.0, 1.0)
    }
}

/// Elementwise nonlinearity kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Gelu,
    /// GeLU's tanh approximation as HuggingFace's `NewGELUActivation` writes it,
    /// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`, eight pointwise ops in eager
    /// module code (one kernel where the stack fuses or compiles it).
    GeluNew,
    Relu,
    SquaredRelu,
    Silu,
    Sigmoid,
    Tanh,
}

/// An elementwise nonlinearity: `[x] -> [x]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActivationAttrs {
    pub kind: Activation,
}

/// Softmax over one axis (negative counts from the end).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SoftmaxAttrs {
    pub axis: i64,
}

/// Dropout with rate `rate_permille / 1000`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DropoutAttrs {
    pub rate_permille: u32,
}

/// Mixture of experts layer (router + experts, top-k routing):
/// `[x(..., h), router(h, E), w_in(E, h, f), w_out(E, f, h), w_gate(E, h, f)?] -> [..., h]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeAttrs {
    pub experts: u64,
    pub top_k: u64,
    pub ffn_hidden: u64,
    /// Gated (SwiGLU) experts, with a third weight.
    pub gated: bool,
}

impl MoeAttrs {
    /// Expert visits the op runs at input shapes `ins`: each row's `top_k` visits spread
    /// evenly over the experts, of which a shard scoring `ins[1].last()` of them (its slice of
    /// the router) sees that share.
    pub fn visits(&self, ins: &[Shape]) -> f64 {
        match (ins.first(), ins.get(1)) {
            (Some(x), Some(r)) => {
                x.leading_elems() as f64 * self.top_k as f64 * r.last() as f64
                    / self.experts.max(1) as f64
            }
            _ => 0.0,
        }
    }
}

/// 2-D convolution, NCHW: `[x(n, c, h, w), w(o, c/groups, kh, kw), bias(o)?] -> [n, o, oh, ow]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conv2dAttrs {
    pub out_channels: u64,
    pub kernel: [u64; 2],
    pub stride: [u64; 2],
    pub padding: [u64; 2],
    pub dilation: [u64; 2],
    pub groups: u64,
    pub bias: bool,
}

/// Pooling kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    Max,
    Avg,
}

/// Windowed 2-D pooling, NCHW.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool2dAttrs {
    pub kind: PoolKind,
    pub kernel: [u64; 2],
    pub stride: [u64; 2],
    pub padding: [u64; 2],
}

/// An axis argument (negative counts from the end).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AxisAttrs {
    pub axis: i64,
}

/// Split one axis into pieces of the given sizes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitAttrs {
    pub axis: i64,
    pub sizes: Vec<u64>,
}

/// Reshape to a fixed shape with the same element count.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReshapeAttrs {
    pub shape: Vec<u64>,
}

/// Permute dimensions: output dim `i` is input dim `perm[i]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransposeAttrs {
    pub perm: Vec<usize>,
}

/// One recurrent layer, batch first: `[x(b, s, i), w_ih(i, G·h), w_hh(h, G·h), bias(G·h)] ->
/// [b, s, h]` with G = 4 gates for LSTM and 3 for GRU.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RnnAttrs {
    pub hidden: u64,
}

/// A Mamba-2 mixer's core (Dao & Gu 2024, "Transformers are SSMs"): the causal depthwise
/// convolution of x, B and C with its SiLU, then the selective state-space scan as the
/// chunked state-space-duality algorithm (`mamba_chunk_scan_combined`):
/// `[xbc(b, s, heads·head_dim + 2·groups·state), dt(b, s, heads), conv_w(c, kernel),
/// conv_b(c), a_log(heads), d(heads), dt_bias(heads)] -> [b, s, heads·head_dim]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SsdAttrs {
    pub heads: u64,
    pub head_dim: u64,
    /// State size N per group.
    pub state: u64,
    /// Groups sharing B and C (as key/value heads are shared in grouped-query attention).
    pub groups: u64,
    pub conv_kernel: u64,
    /// Chunk length of the scan (Megatron-Core's `MambaMixer`: 128).
    pub chunk: u64,
}

impl SsdAttrs {
    /// Width of the convolved input: x, B and C.
    pub fn conv_channels(&self) -> u64 {
        self.heads * self.head_dim + 2 * self.groups * self.state
    }

    /// Forward FLOPs per token over a sequence of `seq`: the convolution (2·kernel per
    /// channel) and the scan as SSD computes it with chunks of `q = min(chunk, seq)` tokens —
    /// per group the chunk's `C·Bᵀ` (2·q·N a token), per head the masked intra-chunk product
    /// with x (q·P a token: the kernel skips the blocks above the diagonal), the chunk states
    /// (`Bᵀ·x`, 2·N·P) and the output from the states entering the chunk (`C·h`, 2·N·P).
    pub fn flops_per_token(&self, seq: u64) -> f64 {
        let q = self.chunk.min(seq).max(1) as f64;
        let (n, p) = (self.state as f64, self.head_dim as f64);
        2.0 * (self.conv_kernel * self.conv_channels()) as f64
            + self.groups as f64 * 2.0 * q * n
            + self.heads as f64 * (q * p + 4.0 * n * p)
    }
}

/// The closed set of ops.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum OpKind {
    Embedding(EmbeddingAttrs),
    Linear(LinearAttrs),
    MatMul(MatMulAttrs),
    Attention(AttentionAttrs),
    /// `[x(..., c), gamma(c), beta(c)] -> [x]`.
    LayerNorm,
    /// `[x(..., c), gamma(c)] -> [x]`.
    RmsNorm,
    Activation(ActivationAttrs),
    /// Gated linear unit with SiLU: `[gate, up] -> [silu(gate) · up]`.
    SwiGlu,
    /// Elementwise sum with numpy broadcasting (residual connections).
    Add,
    /// Elementwise product with numpy broadcasting.
    Mul,
    Softmax(SoftmaxAttrs),
    Dropout(DropoutAttrs),
    /// Mean token cross-entropy: `[logits(..., vocab), labels(...)] -> []`.
    CrossEntropy,
    Moe(MoeAttrs),
    Conv2d(Conv2dAttrs),
    /// `[x(n, c, ...), gamma(c), beta(c)] -> [x]`.
    BatchNorm,
    Pool2d(Pool2dAttrs),
    /// `[x(n, c, h, w)] -> [n, c, 1, 1]`.
    GlobalAvgPool,
    Concat(AxisAttrs),
    Split(SplitAttrs),
    Reshape(ReshapeAttrs),
    Transpose(TransposeAttrs),
    /// Flatten to 2-D at `axis`: `[d0..da, da..] -> [prod(d0..da), prod(da..)]`.
    Flatten(AxisAttrs),
    Lstm(RnnAttrs),
    Gru(RnnAttrs),
    /// Rotary position embedding on `[b, s, heads, d]`.
    Rope,
    Ssd(SsdAttrs),
}

/// How an op's time is best estimated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComputeClass {
    /// Dense matrix products on tensor cores.
    Gemm,
    /// Attention core (fused or a chain of batched matmuls and a softmax).
    Attention,
    /// Bandwidth-bound elementwise / normalization / reduction kernels.
    MemoryBound,
    /// Metadata-only (reshape, flatten): no kernel.
    View,
}

/// Hardware-independent work of one op.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Work {
    pub fwd_flops: Flops,
    /// FLOPs to compute the gradient of the inputs.
    pub bwd_input_flops: Flops,
    /// FLOPs to compute the gradient of the weights.
    pub bwd_weight_flops: Flops,
    /// Bytes read by the forward kernel(s).
    pub bytes_read: Bytes,
    /// Bytes written by the forward kernel(s).
    pub bytes_written: Bytes,
}

impl Work {
    /// Forward plus backward FLOPs.
    pub fn train_flops(&self) -> Flops {
        self.fwd_flops + self.bwd_input_flops + self.bwd_weight_flops
    }

    /// Bytes the forward moves through memory: its inputs read and outputs written once.
    pub fn traffic(&self) -> Bytes {
        self.bytes_read + self.bytes_written
    }
}

impl std::ops::Add for Work {
    type Output = Work;
    fn add(self, o: Work) -> Work {
        Work {
            fwd_flops: self.fwd_flops + o.fwd_flops,
            bwd_input_flops: self.bwd_input_flops + o.bwd_input_flops,
            bwd_weight_flops: self.bwd_weight_flops + o.bwd_weight_flops,
            bytes_read: self.bytes_read + o.bytes_read,
            bytes_written: self.bytes_written + o.bytes_written,
        }
    }
}

/// What an op keeps for backward: whole tensors (inputs / outputs by index) and extra state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
    /// Extra floating-point elements (statistics, gates, probabilities) at activation precision.
    pub extra_elems: u64,
    /// Extra bytes of fixed size (dropout masks, fp32 statistics, routing indices).
    pub extra_bytes: u64,
    /// Of `extra_elems`, those kept only as inputs of the op's own GEMMs (the experts'
    /// dispatched token copies and their activation outputs): a stack whose GEMMs keep their
    /// inputs as fp8 casts (Transformer Engine's fp8 layers) keeps these at one byte.
    pub gemm_input_elems: u64,
}

/// A shape rule violation.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ShapeError {
    #[error("{op} takes {expected} inputs, got {got}")]
    Arity {
        op: &'static str,
        expected: String,
        got: usize,
    },
    #[error("{op}: input {input} must have rank {expected}, got {got}")]
    Rank {
        op: &'static str,
        input: usize,
        expected: String,
        got: Shape,
    },
    #[error("{op}: {what}: {lhs} vs {rhs}")]
    Mismatch {
        op: &'static str,
        what: &'static str,
        lhs: Shape,
        rhs: Shape,
    },
    #[error("{op}: {reason}")]
    Invalid { op: &'static str, reason: String },
}

fn arity(op: &'static str, ins: &[Shape], lo: usize, hi: usize) -> Result<(), ShapeError> {
    if ins.len() < lo || ins.len() > hi {
        return Err(ShapeError::Arity {
            op,
            expected: if lo == hi {
                lo.to_string()
            } else {
                format!("{lo} to {hi}")
            },
            got: ins.len(),
        });
    }
    Ok(())
}

fn rank(op: &'static str, ins: &[Shape], i: usize, r: usize) -> Result<(), ShapeError> {
    if ins[i].rank() != r {
        return Err(ShapeError::Rank {
            op,
            input: i,
            expected: r.to_string(),
            got: ins[i].clone(),
        });
    }
    Ok(())
}

fn min_rank(op: &'static str, ins: &[Shape], i: usize, r: usize) -> Result<(), ShapeError> {
    if ins[i].rank() < r {
        return Err(ShapeError::Rank {
            op,
            input: i,
            expected: format!("at least {r}"),
            got: ins[i].clone(),
        });
    }
    Ok(())
}

fn same(op: &'static str, what: &'static str, a: &Shape, b: &Shape) -> Result<(), ShapeError> {
    if a != b {
        return Err(ShapeError::Mismatch {
            op,
            what,
            lhs: a.clone(),
            rhs: b.clone(),
        });
    }
    Ok(())
}

fn invalid(op: &'static str, reason: impl Into<String>) -> ShapeError {
    ShapeError::Invalid {
        op,
        reason: reason.into(),
    }
}

fn norm_axis(op: &'static str, axis: i64, r: usize) -> Result<usize, ShapeError> {
    let a = if axis < 0 { axis + r as i64 } else { axis };
    if a < 0 || a >= r as i64 {
        return Err(invalid(
            op,
            format!("axis {axis} out of range for rank {r}"),
        ));
    }
    Ok(a as usize)
}

/// Output size of a windowed op along one spatial dimension.
fn window_out(
    op: &'static str,
    size: u64,
    kernel: u64,
    stride: u64,
    pad: u64,
    dilation: u64,
) -> Result<u64, ShapeError> {
    if kernel == 0 || stride == 0 || dilation == 0 {
        return Err(invalid(op, "kernel, stride and dilation must be positive"));
    }
    let too_large = || invalid(op, "kernel, dilation or padding too large");
    let span = dilation
        .checked_mul(kernel - 1)
        .and_then(|s| s.checked_add(1))
        .ok_or_else(too_large)?;
    let padded = pad
        .checked_mul(2)
        .and_then(|p| p.checked_add(size))
        .ok_or_else(too_large)?;
    if padded < span {
        return Err(invalid(
            op,
            format!("window {span} larger than padded input {padded}"),
        ));
    }
    Ok((padded - span) / stride + 1)
}

/// Numpy broadcasting of two shapes.
fn broadcast(op: &'static str, a: &Shape, b: &Shape) -> Result<Shape, ShapeError> {
    let r = a.rank().max(b.rank());
    let mut out = vec![0; r];
    for (i, o) in out.iter_mut().enumerate() {
        let da = if i + a.rank() >= r {
            a.0[i + a.rank() - r]
        } else {
            1
        };
        let db = if i + b.rank() >= r {
            b.0[i + b.rank() - r]
        } else {
            1
        };
        *o = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(ShapeError::Mismatch {
                    op,
                    what: "shapes do not broadcast",
                    lhs: a.clone(),
                    rhs: b.clone(),
                })
            }
        };
    }
    Ok(Shape(out))
}

/// FLOPs per element of an activation's forward and backward.
fn activation_flops(kind: Activation) -> (f64, f64) {
    match kind {
        Activation::Relu => (1.0, 1.0),
        Activation::SquaredRelu => (2.0, 2.0),
        // tanh-approximate GeLU: ~8 arithmetic ops forward, ~2x backward.
        Activation::Gelu | Activation::GeluNew => (8.0, 16.0),
        Activation::Silu | Activation::Sigmoid | Activation::Tanh => (4.0, 8.0),
    }
}

/// Transcendental evaluations of an op, `(forward, backward)` of each kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Transcendentals {
    /// Exponentials (an exp, a sigmoid, a softplus each).
    pub exp: (f64, f64),
    /// Hyperbolic tangents.
    pub tanh: (f64, f64),
}

impl OpKind {
    /// Short name of the op kind (histograms, errors).
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::Embedding(_) => "embedding",
            OpKind::Linear(_) => "linear",
            OpKind::MatMul(_) => "matmul",
            OpKind::Attention(_) => "attention",
            OpKind::LayerNorm => "layer_norm",
            OpKind::RmsNorm => "rms_norm",
            OpKind::Activation(a) => match a.kind {
                Activation::Gelu => "gelu",
                Activation::GeluNew => "gelu_new",
                Activation::Relu => "relu",
                Activation::SquaredRelu => "squared_relu",
                Activation::Silu => "silu",
                Activation::Sigmoid => "sigmoid",
                Activation::Tanh => "tanh",
            },
            OpKind::SwiGlu => "swiglu",
            OpKind::Add => "add",
            OpKind::Mul => "mul",
            OpKind::Softmax(_) => "softmax",
            OpKind::Dropout(_) => "dropout",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::Moe(_) => "moe",
            OpKind::Conv2d(_) => "conv2d",
            OpKind::BatchNorm => "batch_norm",
            OpKind::Pool2d(p) => match p.kind {
                PoolKind::Max => "max_pool2d",
                PoolKind::Avg => "avg_pool2d",
            },
            OpKind::GlobalAvgPool => "global_avg_pool",
            OpKind::Concat(_) => "concat",
            OpKind::Split(_) => "split",
            OpKind::Reshape(_) => "reshape",
            OpKind::Transpose(_) => "transpose",
            OpKind::Flatten(_) => "flatten",
            OpKind::Lstm(_) => "lstm",
            OpKind::Gru(_) => "gru",
            OpKind::Rope => "rope",
            OpKind::Ssd(_) => "ssd",
        }
    }

    /// How the op's time is best estimated.
    pub fn compute_class(&self) -> ComputeClass {
        match self {
            OpKind::Linear(_)
            | OpKind::MatMul(_)
            | OpKind::Moe(_)
            | OpKind::Conv2d(_)
            | OpKind::Lstm(_)
            | OpKind::Gru(_)
            | OpKind::Ssd(_) => ComputeClass::Gemm,
            OpKind::Attention(_) => ComputeClass::Attention,
            OpKind::Reshape(_) | OpKind::Flatten(_) => ComputeClass::View,
            _ => ComputeClass::MemoryBound,
        }
    }

    /// Whether the output aliases the input (no copy, nothing extra to save).
    pub fn is_view(&self) -> bool {
        self.compute_class() == ComputeClass::View
    }

    /// Output shapes for the given input shapes.
    pub fn infer(&self, ins: &[Shape]) -> Result<Vec<Shape>, ShapeError> {
        let op = self.name();
        match self {
            OpKind::Embedding(a) => {
                arity(op, ins, 2, 2)?;
                same(op, "table", &ins[1], &Shape::new([a.vocab, a.dim]))?;
                let mut d = ins[0].0.clone();
                d.push(a.dim);
                Ok(vec![Shape(d)])
            }
            OpKind::Linear(a) => {
                arity(op, ins, 2, 3)?;
                min_rank(op, ins, 0, 1)?;
                rank(op, ins, 1, 2)?;
                let k = ins[0].last();
                same(op, "weight", &ins[1], &Shape::new([k, a.out_features]))?;
                if a.bias != (ins.len() == 3) {
                    return Err(invalid(op, "bias flag and inputs disagree"));
                }
                if a.bias {
                    same(op, "bias", &ins[2], &Shape::new([a.out_features]))?;
                }
                Ok(vec![ins[0].with_last(a.out_features)])
            }
            OpKind::MatMul(a) => {
                arity(op, ins, 2, 2)?;
                min_rank(op, ins, 0, 2)?;
                min_rank(op, ins, 1, 2)?;
                let (x, y) = (&ins[0], &ins[1]);
                let yr = y.rank();
                let (k2, n) = if a.transpose_b {
                    (y.0[yr - 1], y.0[yr - 2])
                } else {
                    (y.0[yr - 2], y.0[yr - 1])
                };
                if x.last() != k2 {
                    return Err(ShapeError::Mismatch {
                        op,
                        what: "contracted dimensions differ",
                        lhs: x.clone(),
                        rhs: y.clone(),
                    });
                }
                if yr > 2 && (yr != x.rank() || x.0[..yr - 2] != y.0[..yr - 2]) {
                    return Err(ShapeError::Mismatch {
                        op,
                        what: "batch dimensions differ",
                        lhs: x.clone(),
                        rhs: y.clone(),
                    });
                }
                Ok(vec![x.with_last(n)])
            }
            OpKind::Attention(a) => {
                arity(op, ins, 3, 3)?;
                for i in 0..3 {
                    rank(op, ins, i, 4)?;
                }
                if a.window == Some(0) {
                    return Err(invalid(op, "a sliding window holds at least one key"));
                }
                let (q, k, v) = (&ins[0], &ins[1], &ins[2]);
                // Values may have their own head size (multi-head latent attention: 128
                // against queries' and keys' 192); the output has theirs.
                if k.0[..3] != v.0[..3] {
                    return Err(ShapeError::Mismatch {
                        op,
                        what: "batch, length or heads of key and value",
                        lhs: k.clone(),
                        rhs: v.clone(),
                    });
                }
                if q.0[0] != k.0[0] || q.0[3] != k.0[3] {
                    return Err(ShapeError::Mismatch {
                        op,
                        what: "batch or head size of query and key",
                        lhs: q.clone(),
                        rhs: k.clone(),
                    });
                }
                if k.0[2] == 0 || q.0[2] % k.0[2] != 0 {
                    return Err(invalid(
                        op,
                        format!(
                            "{} query heads are not a multiple of {} key/value heads",
                            q.0[2], k.0[2]
                        ),
                    ));
                }
                Ok(vec![q.with_last(v.last())])
            }
            OpKind::LayerNorm | OpKind::RmsNorm => {
                let n = if matches!(self, OpKind::LayerNorm) {
                    3
                } else {
                    2
                };
                arity(op, ins, n, n)?;
                min_rank(op, ins, 0, 1)?;
                let c = Shape::new([ins[0].last()]);
                for w in &ins[1..] {
                    same(op, "scale/shift", w, &c)?;
                }
                Ok(vec![ins[0].clone()])
            }
            OpKind::Activation(_) | OpKind::Dropout(_) => {
                arity(op, ins, 1, 1)?;
                Ok(vec![ins[0].clone()])
            }
            OpKind::Softmax(a) => {
                arity(op, ins, 1, 1)?;
                norm_axis(op, a.axis, ins[0].rank())?;
                Ok(vec![ins[0].clone()])
            }
            OpKind::SwiGlu => {
                arity(op, ins, 2, 2)?;
                same(op, "gate and up", &ins[0], &ins[1])?;
                Ok(vec![ins[0].clone()])
            }
            OpKind::Add | OpKind::Mul => {
                arity(op, ins, 2, 2)?;
                Ok(vec![broadcast(op, &ins[0], &ins[1])?])
            }
            OpKind::CrossEntropy => {
                arity(op, ins, 2, 2)?;
                min_rank(op, ins, 0, 1)?;
                let lead = Shape(ins[0].0[..ins[0].rank() - 1].to_vec());
                same(op, "labels", &ins[1], &lead)?;
                Ok(vec![Shape::scalar()])
            }
            OpKind::Moe(a) => {
                let n = if a.gated { 5 } else { 4 };
                arity(op, ins, n, n)?;
                min_rank(op, ins, 0, 1)?;
                let h = ins[0].last();
                if a.top_k == 0 || a.top_k > a.experts {
                    return Err(invalid(
                        op,
                        format!("top_k {} must be in 1..={}", a.top_k, a.experts),
                    ));
                }
                same(op, "router", &ins[1], &Shape::new([h, a.experts]))?;
                let up = Shape::new([a.experts, h, a.ffn_hidden]);
                same(op, "w_in", &ins[2], &up)?;
                same(
                    op,
                    "w_out",
                    &ins[3],
                    &Shape::new([a.experts, a.ffn_hidden, h]),
                )?;
                if a.gated {
                    same(op, "w_gate", &ins[4], &up)?;
                }
                Ok(vec![ins[0].clone()])
            }
            OpKind::Conv2d(a) => {
                arity(op, ins, 2, 3)?;
                rank(op, ins, 0, 4)?;
                let x = &ins[0];
                let c = x.0[1];
                if a.groups == 0 || c % a.groups != 0 || a.out_channels % a.groups != 0 {
                    return Err(invalid(
                        op,
                        format!(
                            "groups {} must divide in channels {c} and out channels {}",
                            a.groups, a.out_channels
                        ),
                    ));
                }
                same(
                    op,
                    "weight",
                    &ins[1],
                    &Shape::new([a.out_channels, c / a.groups, a.kernel[0], a.kernel[1]]),
                )?;
                if a.bias != (ins.len() == 3) {
                    return Err(invalid(op, "bias flag and inputs disagree"));
                }
                if a.bias {
                    same(op, "bias", &ins[2], &Shape::new([a.out_channels]))?;
                }
                let oh = window_out(
                    op,
                    x.0[2],
                    a.kernel[0],
                    a.stride[0],
                    a.padding[0],
                    a.dilation[0],
                )?;
                let ow = window_out(
                    op,
                    x.0[3],
                    a.kernel[1],
                    a.stride[1],
                    a.padding[1],
                    a.dilation[1],
                )?;
                Ok(vec![Shape::new([x.0[0], a.out_channels, oh, ow])])
            }
            OpKind::BatchNorm => {
                arity(op, ins, 3, 3)?;
                min_rank(op, ins, 0, 2)?;
                let c = Shape::new([ins[0].0[1]]);
                same(op, "scale", &ins[1], &c)?;
                same(op, "shift", &ins[2], &c)?;
                Ok(vec![ins[0].clone()])
            }
            OpKind::Pool2d(a) => {
                arity(op, ins, 1, 1)?;
                rank(op, ins, 0, 4)?;
                let x = &ins[0];
                let oh = window_out(op, x.0[2], a.kernel[0], a.stride[0], a.padding[0], 1)?;
                let ow = window_out(op, x.0[3], a.kernel[1], a.stride[1], a.padding[1], 1)?;
                Ok(vec![Shape::new([x.0[0], x.0[1], oh, ow])])
            }
            OpKind::GlobalAvgPool => {
                arity(op, ins, 1, 1)?;
                rank(op, ins, 0, 4)?;
                Ok(vec![Shape::new([ins[0].0[0], ins[0].0[1], 1, 1])])
            }
            OpKind::Concat(a) => {
                if ins.is_empty() {
                    return Err(invalid(op, "needs at least one input"));
                }
                let ax = norm_axis(op, a.axis, ins[0].rank())?;
                let mut out = ins[0].clone();
                for s in &ins[1..] {
                    if s.rank() != out.rank()
                        || s.0
                            .iter()
                            .enumerate()
                            .any(|(i, d)| i != ax && *d != out.0[i])
                    {
                        return Err(ShapeError::Mismatch {
                            op,
                            what: "inputs differ off the concat axis",
                            lhs: ins[0].clone(),
                            rhs: s.clone(),
                        });
                    }
                    out.0[ax] += s.0[ax];
                }
                Ok(vec![out])
            }
            OpKind::Split(a) => {
                arity(op, ins, 1, 1)?;
                let ax = norm_axis(op, a.axis, ins[0].rank())?;
                if a.sizes.iter().sum::<u64>() != ins[0].0[ax] || a.sizes.contains(&0) {
                    return Err(invalid(
                        op,
                        format!(
                            "sizes {:?} do not partition dimension {} of size {}",
                            a.sizes, ax, ins[0].0[ax]
                        ),
                    ));
                }
                Ok(a.sizes
                    .iter()
                    .map(|s| {
                        let mut d = ins[0].0.clone();
                        d[ax] = *s;
                        Shape(d)
                    })
                    .collect())
            }
            OpKind::Reshape(a) => {
                arity(op, ins, 1, 1)?;
                let to = Shape(a.shape.clone());
                if to.elems() != ins[0].elems() {
                    return Err(ShapeError::Mismatch {
                        op,
                        what: "element counts differ",
                        lhs: ins[0].clone(),
                        rhs: to,
                    });
                }
                Ok(vec![to])
            }
            OpKind::Transpose(a) => {
                arity(op, ins, 1, 1)?;
                let r = ins[0].rank();
                let mut seen = vec![false; r];
                if a.perm.len() != r
                    || a.perm
                        .iter()
                        .any(|&p| p >= r || std::mem::replace(&mut seen[p], true))
                {
                    return Err(invalid(
                        op,
                        format!("{:?} is not a permutation of rank {r}", a.perm),
                    ));
                }
                Ok(vec![Shape(a.perm.iter().map(|&p| ins[0].0[p]).collect())])
            }
            OpKind::Flatten(a) => {
                arity(op, ins, 1, 1)?;
                let r = ins[0].rank();
                let ax = if a.axis == r as i64 {
                    r
                } else {
                    norm_axis(op, a.axis, r)?
                };
                let d = &ins[0].0;
                Ok(vec![Shape::new([
                    d[..ax].iter().product::<u64>(),
                    d[ax..].iter().product::<u64>(),
                ])])
            }
            OpKind::Lstm(a) | OpKind::Gru(a) => {
                arity(op, ins, 4, 4)?;
                rank(op, ins, 0, 3)?;
                let g = self.rnn_gates() * a.hidden;
                let i = ins[0].0[2];
                same(op, "input weight", &ins[1], &Shape::new([i, g]))?;
                same(op, "recurrent weight", &ins[2], &Shape::new([a.hidden, g]))?;
                same(op, "bias", &ins[3], &Shape::new([g]))?;
                Ok(vec![Shape::new([ins[0].0[0], ins[0].0[1], a.hidden])])
            }
            OpKind::Rope => {
                arity(op, ins, 1, 1)?;
                rank(op, ins, 0, 4)?;
                if ins[0].0[3] % 2 != 0 {
                    return Err(invalid(op, "head size must be even"));
                }
                Ok(vec![ins[0].clone()])
            }
            OpKind::Ssd(a) => {
                arity(op, ins, 7, 7)?;
                rank(op, ins, 0, 3)?;
                rank(op, ins, 1, 3)?;
                let (b, s) = (ins[0].0[0], ins[0].0[1]);
                let c = a.conv_channels();
                same(op, "x, B and C", &ins[0], &Shape::new([b, s, c]))?;
                same(op, "dt", &ins[1], &Shape::new([b, s, a.heads]))?;
                same(op, "conv weight", &ins[2], &Shape::new([c, a.conv_kernel]))?;
                same(op, "conv bias", &ins[3], &Shape::new([c]))?;
                for (i, what) in [(4, "A"), (5, "D"), (6, "dt bias")] {
                    same(op, what, &ins[i], &Shape::new([a.heads]))?;
                }
                if a.groups == 0 || a.heads % a.groups != 0 || a.chunk == 0 {
                    return Err(invalid(
                        op,
                        "groups must divide heads and the chunk be positive",
                    ));
                }
                Ok(vec![Shape::new([b, s, a.heads * a.head_dim])])
            }
        }
    }

    /// Elementwise transcendental evaluations of one forward and one backward pass at input
    /// shapes `ins`, by kind (exponentials, sigmoids among them, and hyperbolic tangents: a
    /// host core's libm takes several times longer for a tanh), as a framework's elementwise
    /// kernels evaluate them: an LSTM cell three sigmoids and two tanh per hidden unit and step
    /// forward, the tanh of its cell state again backward; a GRU cell two sigmoids and a tanh
    /// forward (backward reads the saved gates); a smooth activation one per element each way
    /// (its gradient re-evaluates it from the input: GeLU's tanh approximation, SiLU's and a
    /// SwiGLU gate's sigmoid); a softmax or a cross-entropy an exp per element forward. Zero
    /// for the rest.
    pub fn transcendentals(&self, ins: &[Shape]) -> Transcendentals {
        let elems = ins.first().map_or(0.0, |x| x.elems() as f64);
        let exp = |fwd, bwd| Transcendentals {
            exp: (fwd, bwd),
            ..Transcendentals::default()
        };
        match self {
            OpKind::Lstm(a) | OpKind::Gru(a) => {
                let units = ins.first().map_or(0.0, |x| {
                    (x.dim(0).unwrap_or(1) * x.dim(1).unwrap_or(1) * a.hidden) as f64
                });
                if matches!(self, OpKind::Lstm(_)) {
                    Transcendentals {
                        exp: (3.0 * units, 0.0),
                        tanh: (2.0 * units, units),
                    }
                } else {
                    Transcendentals {
                        exp: (2.0 * units, 0.0),
                        tanh: (units, 0.0),
                    }
                }
            }
            OpKind::Activation(a) => match a.kind {
                Activation::Relu | Activation::SquaredRelu => Transcendentals::default(),
                Activation::Gelu | Activation::GeluNew | Activation::Tanh => Transcendentals {
                    tanh: (elems, elems),
                    ..Transcendentals::default()
                },
                Activation::Silu | Activation::Sigmoid => exp(elems, elems),
            },
            // silu(gate) · up: the gate's sigmoid, again in backward.
            OpKind::SwiGlu => exp(elems, elems),
            OpKind::Softmax(_) | OpKind::CrossEntropy => exp(elems, 0.0),
            // The convolution's SiLU per channel; per head the softplus of dt and the decay
            // exp(dt·A), each way.
            OpKind::Ssd(a) => {
                let tokens = ins.first().map_or(0.0, |x| x.leading_elems() as f64);
                let n = tokens * (a.conv_channels() + 2 * a.heads) as f64;
                exp(n, n)
            }
            _ => Transcendentals::default(),
        }
    }

    pub fn rnn_gates(&self) -> u64 {
        match self {
            OpKind::Gru(_) => 3,
            _ => 4,
        }
    }

    /// The einsum-style axes mapping of this op for these shapes.
    pub fn axes(&self, ins: &[Shape], outs: &[Shape]) -> AxesMapping {
        use AxisRole::*;
        let mut b = MappingBuilder::default();
        match self {
            OpKind::Embedding(_) => {
                let lead = b.lead(ins[0].rank());
                b.padded_param('v').param('d', true);
                b.input(&lead).input("vd").output_with(&lead, "d");
            }
            OpKind::Linear(a) => {
                let lead = b.lead(ins[0].rank() - 1);
                b.param('k', true).padded_param('n');
                b.input_with(&lead, "k").input("kn");
                if a.bias {
                    b.input("n");
                }
                b.output_with(&lead, "n");
            }
            OpKind::MatMul(a) => {
                let wb = if a.transpose_b { "nk" } else { "kn" };
                b.param('k', true).padded_param('n');
                if ins[1].rank() == 2 {
                    let lead = b.lead(ins[0].rank() - 1);
                    b.input_with(&lead, "k").input(wb).output_with(&lead, "n");
                } else {
                    let lead = b.lead(ins[0].rank() - 2);
                    b.axis('m', Attribute, true);
                    b.input_with(&lead, "mk")
                        .input_with(&lead, wb)
                        .output_with(&lead, "mn");
                }
            }
            OpKind::Attention(_) => {
                b.axis('b', Sample, true)
                    .axis('s', Attribute, true)
                    .axis('t', Attribute, false)
                    .param('h', true)
                    .param('d', false);
                if ins[2].last() == ins[0].last() {
                    b.input("bshd").input("bthd").input("bthd").output("bshd");
                } else {
                    // Values of their own head size `e`.
                    b.param('e', false);
                    b.input("bshd").input("bthd").input("bthe").output("bshe");
                }
            }
            OpKind::LayerNorm | OpKind::RmsNorm => {
                let lead = b.lead(ins[0].rank() - 1);
                b.param('c', false);
                b.input_with(&lead, "c");
                for _ in 1..ins.len() {
                    b.input("c");
                }
                b.output_with(&lead, "c");
            }
            OpKind::Activation(_) | OpKind::Dropout(_) | OpKind::SwiGlu | OpKind::Rope => {
                let r = ins[0].rank();
                let lead = b.lead(r.saturating_sub(1));
                let last = if matches!(self, OpKind::Rope) {
                    b.param('d', false);
                    "d"
                } else {
                    b.param('c', true);
                    "c"
                };
                let labels = if r == 0 {
                    String::new()
                } else {
                    format!("{lead}{last}")
                };
                for _ in ins {
                    b.input(&labels);
                }
                b.output(&labels);
            }
            OpKind::Softmax(a) => {
                let r = ins[0].rank();
                let ax = norm_axis("softmax", a.axis, r).unwrap_or(r.saturating_sub(1));
                let lead: Vec<char> = b.lead(r).chars().collect();
                let labels: String = lead
                    .iter()
                    .enumerate()
                    .map(|(i, c)| if i == ax { 'c' } else { *c })
                    .collect();
                b.param('c', false);
                b.input(&labels).output(&labels);
            }
            OpKind::Add | OpKind::Mul => {
                let out = &outs[0];
                let labels: Vec<char> = b.lead(out.rank()).chars().collect();
                for s in ins {
                    let off = out.rank() - s.rank();
                    let l: String =
                        s.0.iter()
                            .enumerate()
                            .map(|(i, d)| {
                                if *d == out.0[off + i] {
                                    labels[off + i]
                                } else {
                                    b.fresh_fixed()
                                }
                            })
                            .collect();
                    b.input(&l);
                }
                b.output(&labels.iter().collect::<String>());
            }
            OpKind::CrossEntropy => {
                let lead = b.lead(ins[0].rank() - 1);
                b.padded_param('v');
                b.input_with(&lead, "v").input(&lead).output("");
            }
            OpKind::Moe(a) => {
                let lead = b.lead(ins[0].rank() - 1);
                b.param('h', false).param('e', true).param('f', true);
                b.input_with(&lead, "h")
                    .input("he")
                    .input("ehf")
                    .input("efh");
                if a.gated {
                    b.input("ehf");
                }
                b.output_with(&lead, "h");
            }
            OpKind::Conv2d(a) => {
                let c = ins[0].0[1];
                let depthwise = a.groups > 1 && a.groups == c && a.out_channels == c;
                b.axis('n', Sample, true)
                    .axis('h', Attribute, true)
                    .axis('w', Attribute, true)
                    .param('o', true)
                    .param('i', false)
                    .param('j', false);
                if depthwise {
                    let one = b.fresh_fixed();
                    b.input("nohw").input(&format!("o{one}ij"));
                } else {
                    b.param('c', a.groups == 1);
                    b.input("nchw").input("ocij");
                }
                if a.bias {
                    b.input("o");
                }
                b.output("nohw");
            }
            OpKind::BatchNorm => {
                let r = ins[0].rank();
                b.axis('n', Sample, true).param('c', true);
                let spatial: String = (0..r - 2).map(|_| b.fresh_fixed()).collect();
                b.input(&format!("nc{spatial}")).input("c").input("c");
                b.output(&format!("nc{spatial}"));
            }
            OpKind::Pool2d(_) => {
                b.axis('n', Sample, true)
                    .param('c', true)
                    .axis('h', Attribute, true)
                    .axis('w', Attribute, true);
                b.input("nchw").output("nchw");
            }
            OpKind::GlobalAvgPool => {
                b.axis('n', Sample, true)
                    .param('c', true)
                    .axis('h', Attribute, true)
                    .axis('w', Attribute, true);
                let (x, y) = (b.fresh_fixed(), b.fresh_fixed());
                b.input("nchw").output(&format!("nc{x}{y}"));
            }
            OpKind::Concat(a) => {
                let r = ins[0].rank();
                let ax = norm_axis("concat", a.axis, r).unwrap_or(0);
                let lead: Vec<char> = b.lead(r).chars().collect();
                for _ in ins {
                    let own = b.fresh_fixed();
                    b.input(&with_at(&lead, ax, own));
                }
                let own = b.fresh_fixed();
                b.output(&with_at(&lead, ax, own));
            }
            OpKind::Split(a) => {
                let r = ins[0].rank();
                let ax = norm_axis("split", a.axis, r).unwrap_or(0);
                let lead: Vec<char> = b.lead(r).chars().collect();
                let own = b.fresh_fixed();
                b.input(&with_at(&lead, ax, own));
                for _ in outs {
                    let own = b.fresh_fixed();
                    b.output(&with_at(&lead, ax, own));
                }
            }
            OpKind::Transpose(a) => {
                let lead: Vec<char> = b.lead(ins[0].rank()).chars().collect();
                b.input(&lead.iter().collect::<String>());
                b.output(&a.perm.iter().map(|&p| lead[p]).collect::<String>());
            }
            OpKind::Reshape(_) | OpKind::Flatten(_) => {
                let (x, y) = reshape_labels(&mut b, &ins[0], &outs[0]);
                b.input(&x).output(&y);
            }
            OpKind::Lstm(_) | OpKind::Gru(_) => {
                b.axis('b', Sample, true)
                    .axis('s', Attribute, false)
                    .param('i', false)
                    .param('h', false)
                    .param('g', false);
                b.input("bsi")
                    .input("ig")
                    .input("hg")
                    .input("g")
                    .output("bsh");
            }
            OpKind::Ssd(_) => {
                // The batch splits; the scan runs along the sequence, and x, B and C share
                // one channel axis laid out [x | B | C]: neither splits in this mapping (the
                // transformer path shards heads and groups by tensor parallelism instead).
                b.axis('b', Sample, true)
                    .axis('s', Attribute, false)
                    .param('c', false)
                    .param('k', false)
                    .param('n', false)
                    .param('y', false);
                b.input("bsc")
                    .input("bsn")
                    .input("ck")
                    .input("c")
                    .input("n")
                    .input("n")
                    .input("n")
                    .output("bsy");
            }
        }
        b.build()
    }

    /// Work of the op for these shapes; `float_bytes` is the size of a floating-point element
    /// at the training precision, `weights` flags which inputs are weights.
    pub fn work(&self, ins: &[Shape], outs: &[Shape], weights: &[bool], float_bytes: u64) -> Work {
        let is_w = |i: usize| weights.get(i).copied().unwrap_or(false);
        let elems_out: f64 = outs.iter().map(|s| s.elems() as f64).sum();
        let elems_in0 = ins.first().map(|s| s.elems() as f64).unwrap_or(0.0);
        // (forward, input-gradient, weight-gradient) FLOPs.
        let (f, bi, bw) = match self {
            OpKind::Embedding(_) => (0.0, 0.0, elems_out),
            OpKind::Linear(a) => {
                // `n` from the weight `(in, out)`, not the attrs: a shard split on `n` holds
                // `out / D` columns, and its work must be the work of that shard.
                let (m, k, n) = (
                    ins[0].leading_elems() as f64,
                    ins[0].last() as f64,
                    ins[1].last() as f64,
                );
                let bias = if a.bias { m * n } else { 0.0 };
                (
                    2.0 * m * k * n + bias,
                    2.0 * m * k * n,
                    2.0 * m * k * n + bias,
                )
            }
            OpKind::MatMul(_) => {
                let k = ins[0].last() as f64;
                let mm = 2.0 * elems_out * k;
                match (is_w(0), is_w(1)) {
                    (false, true) | (true, false) => (mm, mm, mm),
                    (true, true) => (mm, 0.0, 2.0 * mm),
                    (false, false) => (mm, 2.0 * mm, 0.0),
                }
            }
            OpKind::Attention(a) => {
                let (q, k) = (&ins[0], &ins[1]);
                let (b, s, h, d, t) = (
                    q.0[0] as f64,
                    q.0[1] as f64,
                    q.0[2] as f64,
                    q.0[3] as f64,
                    a.keys(k.0[1]) as f64,
                );
                let e = ins[2].last() as f64;
                let scores = b * h * s * t;
                // QK^T (2·d FLOPs per score) and PV (2·e, the values' head size); softmax ~5
                // FLOPs per score; backward twice the matmuls.
                (
                    2.0 * scores * (d + e) + 5.0 * scores,
                    4.0 * scores * (d + e) + 5.0 * scores,
                    0.0,
                )
            }
            OpKind::LayerNorm => (8.0 * elems_in0, 16.0 * elems_in0, 2.0 * elems_in0),
            OpKind::RmsNorm => (5.0 * elems_in0, 10.0 * elems_in0, elems_in0),
            OpKind::BatchNorm => (8.0 * elems_in0, 16.0 * elems_in0, 2.0 * elems_in0),
            OpKind::Activation(a) => {
                let (fw, bwd) = activation_flops(a.kind);
                (fw * elems_in0, bwd * elems_in0, 0.0)
            }
            OpKind::SwiGlu => (5.0 * elems_out, 10.0 * elems_out, 0.0),
            OpKind::Add => (elems_out, 0.0, 0.0),
            OpKind::Mul => (elems_out, 2.0 * elems_out, 0.0),
            OpKind::Softmax(_) => (5.0 * elems_in0, 4.0 * elems_in0, 0.0),
            OpKind::Dropout(_) => (elems_in0, elems_in0, 0.0),
            OpKind::CrossEntropy => (6.0 * elems_in0, 2.0 * elems_in0, 0.0),
            OpKind::Rope => (3.0 * elems_in0, 3.0 * elems_in0, 0.0),
            OpKind::Moe(a) => {
                let (t, h, e, fh) = (
                    ins[0].leading_elems() as f64,
                    ins[0].last() as f64,
                    ins[1].last() as f64,
                    ins[2].last() as f64,
                );
                let visits = a.visits(ins);
                let mats = if a.gated { 3.0 } else { 2.0 };
                let expert = 2.0 * visits * h * fh * mats;
                let router = 2.0 * t * h * e;
                (expert + router, expert + router, expert + router)
            }
            OpKind::Conv2d(a) => {
                let w = &ins[1];
                let mm = 2.0 * elems_out * (w.0[1] * w.0[2] * w.0[3]) as f64;
                let bias = if a.bias { elems_out } else { 0.0 };
                (mm + bias, mm, mm + bias)
            }
            OpKind::Pool2d(a) => {
                let win = (a.kernel[0] * a.kernel[1]) as f64;
                (win * elems_out, elems_in0, 0.0)
            }
            OpKind::GlobalAvgPool => (elems_in0, elems_in0, 0.0),
            OpKind::Concat(_)
            | OpKind::Split(_)
            | OpKind::Reshape(_)
            | OpKind::Transpose(_)
            | OpKind::Flatten(_) => (0.0, 0.0, 0.0),
            OpKind::Lstm(a) | OpKind::Gru(a) => {
                let x = &ins[0];
                let (bs, i, h, g) = (
                    (x.0[0] * x.0[1]) as f64,
                    x.0[2] as f64,
                    a.hidden as f64,
                    self.rnn_gates() as f64,
                );
                let mm = 2.0 * bs * (i + h) * g * h;
                // Gate nonlinearities and state updates: ~10 FLOPs per hidden unit per step.
                let ew = 10.0 * bs * h;
                (mm + ew, mm + 2.0 * ew, mm)
            }
            OpKind::Ssd(a) => {
                let (tokens, seq) = (ins[0].leading_elems() as f64, ins[0].0[1]);
                let conv = 2.0 * tokens * (a.conv_kernel * a.conv_channels()) as f64;
                let scan = tokens * a.flops_per_token(seq) - conv;
                // Backward: the scan's products twice (gradients of x, B, C and dt), the
                // convolution's input gradient; its weight gradient apart.
                (conv + scan, conv + 2.0 * scan, conv)
            }
        };
        let tensor_bytes = |s: &Shape| s.elems() * float_bytes;
        let (read, written) = if self.is_view() {
            (0, 0)
        } else if let OpKind::Ssd(a) = self {
            // Beyond its operands the scan writes each chunk's final state (fp32, N·P per
            // head), which the state passing reads and rewrites and the output kernel reads;
            // the convolution's output is written and read back by the scan.
            // Saturating: a hostile model's dimensions may not fit the count.
            let (b, s) = (ins[0].0[0], ins[0].0[1]);
            let states = [s.div_ceil(a.chunk), a.heads, a.head_dim, a.state, 4]
                .iter()
                .fold(b, |acc, x| acc.saturating_mul(*x));
            let conv = ins[0].elems().saturating_mul(float_bytes);
            let extra = states.saturating_mul(2).saturating_add(conv);
            (
                ins.iter()
                    .map(tensor_bytes)
                    .fold(extra, u64::saturating_add),
                outs.iter()
                    .map(tensor_bytes)
                    .fold(extra, u64::saturating_add),
            )
        } else {
            (
                ins.iter().map(tensor_bytes).sum::<u64>(),
                outs.iter().map(tensor_bytes).sum::<u64>(),
            )
        };
        Work {
            fwd_flops: Flops(f),
            bwd_input_flops: Flops(bi),
            bwd_weight_flops: Flops(bw),
            bytes_read: Bytes(read),
            bytes_written: Bytes(written),
        }
    }

    /// What the op keeps for its backward pass (weights are never listed: they are parameters).
    pub fn saves(&self, ins: &[Shape], weights: &[bool]) -> Saved {
        let data = |idx: &[usize]| -> Vec<usize> {
            idx.iter()
                .copied()
                .filter(|i| *i < ins.len() && !weights.get(*i).copied().unwrap_or(false))
                .collect()
        };
        let rows = |s: &Shape| s.leading_elems();
        match self {
            OpKind::Embedding(_) => Saved {
                // Token ids, kept as 8-byte integers.
                extra_bytes: ins[0].elems() * 8,
                ..Saved::default()
            },
            OpKind::Linear(_) | OpKind::Conv2d(_) => Saved {
                inputs: data(&[0]),
                ..Saved::default()
            },
            OpKind::MatMul(_) | OpKind::SwiGlu | OpKind::Mul => Saved {
                inputs: data(&[0, 1]),
                ..Saved::default()
            },
            OpKind::Attention(a) => {
                let (q, k) = (&ins[0], &ins[1]);
                let scores = q.0[0] * q.0[2] * q.0[1] * k.0[1];
                if a.fused {
                    // Flash attention keeps q, k, v, the output and an fp32 log-sum-exp per row.
                    Saved {
                        inputs: data(&[0, 1, 2]),
                        outputs: vec![0],
                        extra_bytes: q.0[0] * q.0[2] * q.0[1] * 4,
                        ..Saved::default()
                    }
                } else {
                    // Korthikanti et al. 2022 §4.1: softmax output, and with dropout its mask
                    // (1 byte) and output.
                    Saved {
                        inputs: data(&[0, 1, 2]),
                        extra_elems: scores * if a.dropout { 2 } else { 1 },
                        extra_bytes: if a.dropout { scores } else { 0 },
                        ..Saved::default()
                    }
                }
            }
            OpKind::LayerNorm | OpKind::RmsNorm | OpKind::BatchNorm => Saved {
                inputs: data(&[0]),
                // fp32 mean and reciprocal std per normalized row (per channel for BatchNorm).
                extra_bytes: 8 * if matches!(self, OpKind::BatchNorm) {
                    ins[0].0.get(1).copied().unwrap_or(1)
                } else {
                    rows(&ins[0])
                },
                ..Saved::default()
            },
            // ReLU, sigmoid and tanh differentiate from their output (PyTorch saves the result:
            // `threshold_backward(grad, result)`, `sigmoid_backward(grad, result)`), so an
            // in-place ReLU after a batch norm keeps one tensor, not the norm's output and its
            // own; the others need their input.
            OpKind::Activation(a)
                if matches!(
                    a.kind,
                    Activation::Relu | Activation::Sigmoid | Activation::Tanh
                ) =>
            {
                Saved {
                    outputs: vec![0],
                    ..Saved::default()
                }
            }
            OpKind::Activation(_) => Saved {
                inputs: data(&[0]),
                ..Saved::default()
            },
            OpKind::Softmax(_) => Saved {
                outputs: vec![0],
                ..Saved::default()
            },
            OpKind::Dropout(d) if d.rate_permille > 0 => Saved {
                extra_bytes: ins[0].elems(),
                ..Saved::default()
            },
            OpKind::CrossEntropy => Saved {
                inputs: data(&[0]),
                ..Saved::default()
            },
            OpKind::Moe(a) => {
                let t = ins[0].leading_elems();
                let visits = a.visits(ins) as u64;
                // The local expert width (`w_in` is `(E, h, f)`): a shard split on `f` keeps
                // `f / D` of each visit's hidden activations.
                let per_visit = ins[0].last() + ins[2].last() * if a.gated { 3 } else { 2 };
                Saved {
                    inputs: data(&[0]),
                    extra_elems: visits * per_visit,
                    // The token copy the first GEMM reads and the activation output the
                    // second reads; the first GEMM's output is the activation's input.
                    gemm_input_elems: visits * (ins[0].last() + ins[2].last()),
                    // Routing: expert index (8 B) and gate weight (4 B) per visit.
                    extra_bytes: t * a.top_k * 12,
                    ..Saved::default()
                }
            }
            // The input and the argmax of every output element as an 8-byte index
            // (`max_pool2d_with_indices`).
            OpKind::Pool2d(p) if p.kind == PoolKind::Max => Saved {
                inputs: data(&[0]),
                extra_bytes: self
                    .infer(ins)
                    .ok()
                    .and_then(|o| o.first().map(|y| y.elems() * 8))
                    .unwrap_or(0),
                ..Saved::default()
            },
            OpKind::Lstm(a) | OpKind::Gru(a) => {
                let bs = ins[0].0[0] * ins[0].0[1];
                Saved {
                    inputs: data(&[0]),
                    // Gate activations plus hidden and cell state for every step.
                    extra_elems: bs * a.hidden * (self.rnn_gates() + 2),
                    ..Saved::default()
                }
            }
            // `mamba_chunk_scan_combined` keeps its inputs, its output and the cumulative
            // decays (fp32, per token and head); the chunk states are recomputed.
            OpKind::Ssd(a) => Saved {
                inputs: data(&[0, 1]),
                outputs: vec![0],
                extra_bytes: rows(&ins[0]).saturating_mul(a.heads).saturating_mul(4),
                ..Saved::default()
            },
            _ => Saved::default(),
        }
    }
}

fn with_at(lead: &[char], at: usize, c: char) -> String {
    lead.iter()
        .enumerate()
        .map(|(i, l)| if i == at { c } else { *l })
        .collect()
}

/// Labels for a reshape: dimensions are grouped into runs with equal products; within a group the
/// outermost input and output dimensions share a splittable label (splitting a merged dimension
/// in blocks is splitting its outermost factor), the rest are fixed.
fn reshape_labels(b: &mut MappingBuilder, x: &Shape, y: &Shape) -> (String, String) {
    let (mut lx, mut ly) = (String::new(), String::new());
    let (mut i, mut j) = (0, 0);
    let mut first = true;
    while i < x.rank() || j < y.rank() {
        // Size-1 dimensions stand alone.
        if i < x.rank() && x.0[i] == 1 {
            lx.push(b.fresh_fixed());
            i += 1;
            continue;
        }
        if j < y.rank() && y.0[j] == 1 {
            ly.push(b.fresh_fixed());
            j += 1;
            continue;
        }
        if i >= x.rank() || j >= y.rank() {
            // Element counts agree, so only size-1 dims can be left; guard anyway.
            while i < x.rank() {
                lx.push(b.fresh_fixed());
                i += 1;
            }
            while j < y.rank() {
                ly.push(b.fresh_fixed());
                j += 1;
            }
            break;
        }
        let (gi, gj) = (i, j);
        let (mut px, mut py) = (x.0[i], y.0[j]);
        i += 1;
        j += 1;
        while px != py {
            if px < py && i < x.rank() {
                px *= x.0[i];
                i += 1;
            } else if j < y.rank() {
                py *= y.0[j];
                j += 1;
            } else {
                break;
            }
        }
        let role = if first {
            AxisRole::Sample
        } else {
            AxisRole::Attribute
        };
        first = false;
        let shared = b.fresh(role, true);
        lx.push(shared);
        ly.push(shared);
        for _ in gi + 1..i {
            lx.push(b.fresh_fixed());
        }
        for _ in gj + 1..j {
            ly.push(b.fresh_fixed());
        }
    }
    (lx, ly)
}

/// Assembles an [`AxesMapping`] with generated labels for variable-rank ops.
#[derive(Default)]
struct MappingBuilder {
    m: AxesMapping,
    next: u32,
}

impl MappingBuilder {
    fn axis(&mut self, c: char, role: AxisRole, splittable: bool) -> &mut Self {
        self.m
            .axes
            .insert(c, crate::axes::AxisInfo::new(role, splittable));
        self
    }
    /// A parameter axis split unevenly by padding its last shard (vocabularies, output
    /// features).
    fn padded_param(&mut self, c: char) -> &mut Self {
        self.m.axes.insert(
            c,
            crate::axes::AxisInfo {
                paddable: true,
                ..crate::axes::AxisInfo::new(AxisRole::Parameter, true)
            },
        );
        self
    }
    fn param(&mut self, c: char, splittable: bool) -> &mut Self {
        self.axis(c, AxisRole::Parameter, splittable)
    }
    /// A fresh label; private-use code points never clash with the letters ops use by name.
    fn fresh(&mut self, role: AxisRole, splittable: bool) -> char {
        let c = char::from_u32(0xE000 + self.next).unwrap_or('?');
        self.next += 1;
        self.axis(c, role, splittable);
        c
    }
    /// A fresh label that may not be split.
    fn fresh_fixed(&mut self) -> char {
        self.fresh(AxisRole::Attribute, false)
    }
    /// Labels for `n` leading dimensions: the first is the batch, the rest positions.
    fn lead(&mut self, n: usize) -> String {
        (0..n)
            .map(|i| {
                let role = if i == 0 {
                    AxisRole::Sample
                } else {
                    AxisRole::Attribute
                };
                self.fresh(role, true)
            })
            .collect()
    }
    fn input(&mut self, l: &str) -> &mut Self {
        self.m.inputs.push(l.chars().collect());
        self
    }
    fn input_with(&mut self, lead: &str, tail: &str) -> &mut Self {
        self.input(&format!("{lead}{tail}"))
    }
    fn output(&mut self, l: &str) -> &mut Self {
        self.m.outputs.push(l.chars().collect());
        self
    }
    fn output_with(&mut self, lead: &str, tail: &str) -> &mut Self {
        self.output(&format!("{lead}{tail}"))
    }
    fn build(self) -> AxesMapping {
        self.m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_values_may_have_their_own_head_size() {
        // Latent attention's heads: queries and keys 192 wide, values 128.
        let op = OpKind::Attention(AttentionAttrs {
            causal: true,
            fused: true,
            dropout: false,
            window: None,
            alibi: false,
        });
        let (q, v) = (Shape::new([2, 64, 8, 192]), Shape::new([2, 64, 8, 128]));
        let ins = [q.clone(), q.clone(), v];
        let out = op.infer(&ins).unwrap();
        assert_eq!(out, vec![Shape::new([2, 64, 8, 128])]);
        let w = op.work(&ins, &out, &[false; 3], 2);
        let scores = (2 * 8 * 64 * 64) as f64;
        assert_eq!(w.fwd_flops.0, 2.0 * scores * (192.0 + 128.0) + 5.0 * scores);
        // Keys and values must agree on batch, length and heads.
        let bad = [q.clone(), q, Shape::new([2, 32, 8, 128])];
        assert!(op.infer(&bad).is_err());
    }
}
