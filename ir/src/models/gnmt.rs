//! GNMT v2 as a training graph: the MLPerf Training reference translation model (Wu et al. 2016
//! as modified in NVIDIA's DeepLearningExamples PyTorch GNMT v2 and MLPerf's `rnn_translator`).
//!
//! Node names follow the PyTorch module paths of that code (`encoder.rnn_layers.0`,
//! `decoder.att_rnn.attn.linear_q`, `decoder.classifier.classifier`). The graph is teacher-forced
//! training: the whole target sequence goes through each decoder layer at once, which GNMT v2
//! allows because only the first decoder layer feeds the attention (no per-step unrolling).

use super::rnn::lstm_layer;
use crate::dtype::DType;
use crate::graph::{Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{
    Activation, AxisAttrs, EmbeddingAttrs, MatMulAttrs, OpKind, ReshapeAttrs, SoftmaxAttrs,
};

/// Shared source/target vocabulary of 32,000 BPE merges as the reference pads it: 32,320 (the
/// embedding and classifier shapes in NVIDIA's MLPerf GNMT parameter list).
pub const GNMT_VOCAB: u64 = 32_320;

/// Hidden size of every LSTM layer, of the embeddings and of the attention.
const GNMT_HIDDEN: u64 = 1024;

/// Maximum source and target length in training: MLPerf v0.7 `rnn_translator` runs with
/// `--max-length-train 75` (DLE's default is 50). Batches are bucketed, so real steps are
/// shorter on average (about 28 tokens per side on WMT16 En-De).
pub const GNMT_MAX_SEQ: u64 = 75;

/// Dropout on the input of every LSTM layer (DLE README: "dropout is applied on input to all
/// LSTM layers, probability of dropout is set to 0.2"), per mille.
const GNMT_DROPOUT_PERMILLE: u32 = 200;

/// Encoder and decoder LSTM layers.
const GNMT_LAYERS: u32 = 4;

/// GNMT v2 on `batch` sentence pairs of `seq` source and `seq` target tokens: inputs `src`,
/// `tgt` (the shifted target, teacher forcing) and `labels`, all int64 `[batch, seq]`; one
/// scalar cross-entropy loss (the reference smooths labels by 0.1, which costs the same).
///
/// - Shared embedding 32320 × 1024 (`encoder.embedder` and `decoder.embedder` read one table).
/// - Encoder: a bidirectional LSTM(1024) (two `Lstm` ops, forward and reverse, over the same
///   input, concatenated to 2048: the op has no direction, and a reversed pass costs the
///   same), LSTM(2048 → 1024), then two LSTM(1024) with residual adds; dropout 0.2 before each.
/// - Decoder: `att_rnn` = LSTM(1024) whose output queries a normalized Bahdanau attention over
///   the encoder output, then three LSTM(2048 → 1024) whose inputs are the previous output
///   concatenated with the attention context (residual adds on the last two), and the
///   classifier Linear(1024 → 32320, bias).
///
/// The attention is built as the reference computes it (`BahdanauAttention.calc_score`):
/// `linear_q(query)` `[b, t, 1, n]` + (`linear_k(keys)` + `normalize_bias`) `[b, 1, s, n]`,
/// broadcast to `[b, t, s, n]`, tanh, a MatMul with `linear_att` `(n, 1)` scaled by
/// `normalize_scalar`, softmax over the source axis, and a batched MatMul of the weights with
/// the keys `[b, s, n]` for the context. Two simplifications, neither changing a parameter or
/// more than `b·t·s` FLOPs: `normalize_bias` is added to the projected keys before the
/// broadcast (the same sum), and the division of `linear_att` by its norm, an `n`-element
/// parameter-only computation, is left out. This unfused form keeps two `[b, t, s, 1024]`
/// tensors for backward (tanh's input and output), as the reference PyTorch code does; NVIDIA's
/// MLPerf submissions fuse the score computation into one kernel that keeps neither, which a
/// cost model may treat as a fusion of the add–tanh–matmul chain.
///
/// 160,634,433 parameters here; 160,671,297 as PyTorch counts them (NVIDIA's MLPerf GNMT code:
/// "MLPerf GNMT has 160671297 parameters"; MLBench's GNMT task: "160,671,297 trainable
/// parameters"): each of the nine `Lstm` ops has one 4096 bias where `nn.LSTM` keeps two
/// (9 × 4,096 = 36,864 fewer, 0.02 %).
///
/// Segments: the embeddings are `Pre`; encoder layers 0–3 are `Block(0..=3)`; the attention
/// LSTM and the attention `Block(4)`; decoder layers `Block(5..=7)`; the classifier and loss
/// `Post`.
pub fn gnmt_v2(batch: u64, seq: u64) -> Result<Graph, GraphError> {
    let h = GNMT_HIDDEN;
    let drop = GNMT_DROPOUT_PERMILLE;
    let mut g = GraphBuilder::new("gnmt_v2");
    let src = g.input("src", [batch, seq], DType::I64);
    let tgt = g.input("tgt", [batch, seq], DType::I64);
    let labels = g.input("labels", [batch, seq], DType::I64);

    let (src_emb, table) = g.embedding("encoder.embedder", src, GNMT_VOCAB, h)?;
    let tgt_emb = g.op1(
        "decoder.embedder",
        OpKind::Embedding(EmbeddingAttrs {
            vocab: GNMT_VOCAB,
            dim: h,
        }),
        &[tgt, table],
    )?;

    // Encoder.
    g.segment(Segment::Block(0));
    let x = g.dropout("encoder.dropout.0", src_emb, drop)?;
    let fwd = lstm_layer(&mut g, "encoder.rnn_layers.0", x, h)?;
    let rev = lstm_layer(&mut g, "encoder.rnn_layers.0.reverse", x, h)?;
    let mut x = concat(&mut g, "encoder.rnn_layers.0.cat", &[fwd, rev])?;
    for layer in 1..GNMT_LAYERS {
        g.segment(Segment::Block(layer));
        let residual = x;
        let y = g.dropout(&format!("encoder.dropout.{layer}"), x, drop)?;
        let y = lstm_layer(&mut g, &format!("encoder.rnn_layers.{layer}"), y, h)?;
        x = if layer >= 2 {
            g.op1(
                format!("encoder.residual.{layer}"),
                OpKind::Add,
                &[y, residual],
            )?
        } else {
            y
        };
    }
    let context = x;

    // Decoder: the attention LSTM and the attention.
    g.segment(Segment::Block(GNMT_LAYERS));
    let y = g.dropout("decoder.att_rnn.dropout", tgt_emb, drop)?;
    let y = lstm_layer(&mut g, "decoder.att_rnn.rnn", y, h)?;
    let attn = bahdanau(&mut g, "decoder.att_rnn.attn", y, context, batch, seq, seq)?;
    let mut x = y;
    for layer in 0..GNMT_LAYERS - 1 {
        g.segment(Segment::Block(GNMT_LAYERS + 1 + layer));
        let p = format!("decoder.rnn_layers.{layer}");
        let residual = x;
        let y = concat(&mut g, &format!("{p}.cat"), &[x, attn])?;
        let y = g.dropout(&format!("decoder.dropout.{layer}"), y, drop)?;
        let y = lstm_layer(&mut g, &p, y, h)?;
        x = if layer >= 1 {
            g.op1(
                format!("decoder.residual.{layer}"),
                OpKind::Add,
                &[y, residual],
            )?
        } else {
            y
        };
    }

    g.segment(Segment::Post);
    let logits = g.linear("decoder.classifier.classifier", x, GNMT_VOCAB, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

fn concat(g: &mut GraphBuilder, name: &str, xs: &[TensorId]) -> Result<TensorId, GraphError> {
    g.op1(name, OpKind::Concat(AxisAttrs { axis: 2 }), xs)
}

fn reshape(
    g: &mut GraphBuilder,
    name: String,
    x: TensorId,
    shape: Vec<u64>,
) -> Result<TensorId, GraphError> {
    g.op1(name, OpKind::Reshape(ReshapeAttrs { shape }), &[x])
}

/// Normalized Bahdanau attention of `query` `[b, t, n]` over `keys` `[b, s, n]`: returns the
/// context `[b, t, n]` (see [`gnmt_v2`] for the construction).
fn bahdanau(
    g: &mut GraphBuilder,
    p: &str,
    query: TensorId,
    keys: TensorId,
    b: u64,
    t: u64,
    s: u64,
) -> Result<TensorId, GraphError> {
    let n = GNMT_HIDDEN;
    let q = g.linear(&format!("{p}.linear_q"), query, n, false)?;
    let q = reshape(g, format!("{p}.linear_q.unsqueeze"), q, vec![b, t, 1, n])?;
    let k = g.linear(&format!("{p}.linear_k"), keys, n, false)?;
    let bias = g.weight(format!("{p}.normalize_bias"), [n]);
    let k = g.op1(format!("{p}.normalize_bias.add"), OpKind::Add, &[k, bias])?;
    let k = reshape(g, format!("{p}.linear_k.unsqueeze"), k, vec![b, 1, s, n])?;
    let sum = g.op1(format!("{p}.sum_qk"), OpKind::Add, &[q, k])?;
    let act = g.activation(&format!("{p}.tanh"), Activation::Tanh, sum)?;
    let v = g.weight(format!("{p}.linear_att"), [n, 1]);
    let scores = g.op1(
        format!("{p}.score"),
        OpKind::MatMul(MatMulAttrs { transpose_b: false }),
        &[act, v],
    )?;
    let scale = g.weight(format!("{p}.normalize_scalar"), [1]);
    let scores = g.op1(format!("{p}.score.scale"), OpKind::Mul, &[scores, scale])?;
    let scores = reshape(g, format!("{p}.score.squeeze"), scores, vec![b, t, s])?;
    let weights = g.op1(
        format!("{p}.softmax"),
        OpKind::Softmax(SoftmaxAttrs { axis: -1 }),
        &[scores],
    )?;
    g.op1(
        format!("{p}.context"),
        OpKind::MatMul(MatMulAttrs { transpose_b: false }),
        &[weights, keys],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cnn::tests::{
        assert_every_node_splits_on_batch, assert_linear_in_batch, assert_scalar_outputs,
        assert_valid, fwd_flops,
    };
    use crate::models::rnn::LSTM_GATES;
    use crate::shape::Shape;

    #[test]
    fn parameter_count_matches_mlperf() {
        let g = gnmt_v2(1, 8).unwrap();
        let nine_lstm_biases = 9 * LSTM_GATES * GNMT_HIDDEN;
        assert_eq!(g.param_count(), 160_634_433);
        assert_eq!(g.param_count() + nine_lstm_biases, 160_671_297);
        // The shared table counts once.
        assert_eq!(g.embedding_params(), GNMT_VOCAB * GNMT_HIDDEN);
        // Attention: linear_q, linear_k, normalize_bias, linear_att, normalize_scalar.
        let attn = g.params_where(|n| n.name.starts_with("decoder.att_rnn.attn."));
        assert_eq!(attn, 2 * 1024 * 1024 + 1024 + 1024 + 1);
    }

    #[test]
    fn shapes_and_segments() {
        let (b, s) = (2, 11);
        let g = gnmt_v2(b, s).unwrap();
        assert_scalar_outputs(&g);
        assert_valid(&g, b);
        assert_eq!(g.num_blocks(), 8);
        assert!(g.nodes.windows(2).all(|w| w[0].segment <= w[1].segment));
        let out = |name: &str| {
            let n = g.nodes.iter().find(|n| n.name == name).unwrap();
            g.tensor(n.outputs[0]).shape.clone()
        };
        assert_eq!(out("encoder.rnn_layers.0.cat"), Shape::new([b, s, 2048]));
        assert_eq!(
            out("decoder.att_rnn.attn.sum_qk"),
            Shape::new([b, s, s, 1024])
        );
        assert_eq!(
            out("decoder.att_rnn.attn.context"),
            Shape::new([b, s, 1024])
        );
        assert_eq!(out("decoder.rnn_layers.2.cat"), Shape::new([b, s, 2048]));
        assert_eq!(g.op_histogram()["lstm"], 9);
    }

    #[test]
    fn forward_flops_by_hand() {
        // Per token pair (t = s): 2 FLOPs per LSTM and classifier weight, plus the attention:
        // the projections (2 · 2n² per token), 7 FLOPs per element of the [t, s, n] score
        // tensor (add 1, tanh 4, MatMul with v 2) and 2n per (t, s) pair for the context.
        let (b, s) = (2u64, 16u64);
        let g = gnmt_v2(b, s).unwrap();
        let (h, v) = (1024.0, GNMT_VOCAB as f64);
        let lstm = |i: f64| 2.0 * (i + h) * 4.0 * h;
        let per_token = 2.0 * lstm(h) + lstm(2.0 * h) + 2.0 * lstm(h) // encoder
            + lstm(h) + 3.0 * lstm(2.0 * h) // decoder
            + 2.0 * h * v // classifier
            + 4.0 * h * h; // attention projections
        let per_pair = 7.0 * h + 2.0 * h;
        let dense = (b * s) as f64 * per_token + (b * s * s) as f64 * per_pair;
        let f = fwd_flops(&g);
        // The rest: gates, dropouts, residuals, softmax, biases and the loss (~1 %).
        assert!(f > dense && f < dense * 1.02, "{f} vs {dense}");
    }

    #[test]
    fn batch_scaling_and_splits() {
        let four = gnmt_v2(4, 9).unwrap();
        assert_linear_in_batch(&gnmt_v2(1, 9).unwrap(), &four);
        assert_every_node_splits_on_batch(&four);
    }
}
