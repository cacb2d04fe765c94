//! Recurrent models as training graphs: word-level LSTM language models on Penn Treebank (a
//! 2 × 1024 stack, and Zaremba et al. 2014's small and large models) and an LSTM text
//! classifier (FlexFlow's RNNTC).
//!
//! Every LSTM layer is one `Lstm` op over the whole sequence (no per-step unrolling); node
//! names follow PyTorch's `word_language_model` example (`encoder`, `rnn.l0`, `decoder`).

use crate::dtype::DType;
use crate::graph::{Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{OpKind, ReshapeAttrs, RnnAttrs, SplitAttrs};

/// Penn Treebank word-level vocabulary (Mikolov et al. 2010 preprocessing, as used by
/// Zaremba et al. 2014).
pub const PTB_VOCAB: u64 = 10_000;

/// Hidden units (and embedding width) of [`lstm_lm`].
const LSTM_LM_HIDDEN: u64 = 1024;

/// Stacked LSTM layers of [`lstm_lm`] and of both Zaremba et al. models.
const LSTM_LM_LAYERS: u32 = 2;

/// LSTM gates (input, forget, cell, output).
pub(crate) const LSTM_GATES: u64 = 4;

/// Hidden units (and embedding width) of Zaremba et al. 2014's small model (§4.1: two layers of
/// 200 units, unrolled for 20 steps, no dropout).
const ZAREMBA_SMALL_HIDDEN: u64 = 200;

/// Hidden units (and embedding width) of Zaremba et al. 2014's large model (§4.1: two layers of
/// 1500 units, unrolled for 35 steps, 65 % dropout on the non-recurrent connections).
const ZAREMBA_LARGE_HIDDEN: u64 = 1500;

/// Published unroll (sequence length) of the small model: 20 steps (Zaremba et al. 2014 §4.1;
/// TensorFlow's `ptb_word_lm.py` `SmallConfig.num_steps`).
pub const ZAREMBA_SMALL_UNROLL: u64 = 20;

/// Published unroll (sequence length) of the large model: 35 steps (Zaremba et al. 2014 §4.1;
/// `LargeConfig.num_steps`).
pub const ZAREMBA_LARGE_UNROLL: u64 = 35;

/// Dropout of the large model on the embedding output and each layer's output, per mille
/// (Zaremba et al. 2014 §4.1: 65 %; `LargeConfig.keep_prob = 0.35`). The small model has none.
const ZAREMBA_LARGE_DROPOUT_PERMILLE: u32 = 650;

/// One LSTM layer over the whole sequence: weights `{name}.weight_ih` (in, 4h), `{name}.weight_hh`
/// (h, 4h) and one bias `{name}.bias` (4h). PyTorch keeps two biases (`bias_ih`, `bias_hh`,
/// mathematically one); TensorFlow's `LSTMCell` and cuDNN's canonical form count one here.
pub(crate) fn lstm_layer(
    g: &mut GraphBuilder,
    name: &str,
    x: TensorId,
    hidden: u64,
) -> Result<TensorId, GraphError> {
    let i = g.shape(x).last();
    let w_ih = g.weight(format!("{name}.weight_ih"), [i, LSTM_GATES * hidden]);
    let w_hh = g.weight(format!("{name}.weight_hh"), [hidden, LSTM_GATES * hidden]);
    let bias = g.weight(format!("{name}.bias"), [LSTM_GATES * hidden]);
    g.op1(
        name,
        OpKind::Lstm(RnnAttrs { hidden }),
        &[x, w_ih, w_hh, bias],
    )
}

/// A 2-layer LSTM language model over the Penn Treebank vocabulary: embedding 10000 × 1024 →
/// LSTM(1024) → LSTM(1024) → Linear(1024 → 10000, bias) → cross-entropy against `labels`
/// `[batch, seq]` (next-token ids). The embedding is `Segment::Pre`, each LSTM layer a
/// `Segment::Block`, the head and loss `Segment::Post`.
///
/// Parameters, counted by hand from the layer shapes (`torch.nn.LSTM` documents its weights as
/// `weight_ih_l{k}` (4h, in), `weight_hh_l{k}` (4h, h), `bias_ih_l{k}` (4h), `bias_hh_l{k}` (4h)):
/// - embedding 10,000 × 1,024 = 10,240,000;
/// - per LSTM layer, here: 1,024 × 4,096 + 1,024 × 4,096 + 4,096 = 8,392,704. Our Lstm op has
///   a single 4h bias; PyTorch keeps two (`b_ih + b_hh`, mathematically one bias, but both
///   are trained parameters), 8,396,800 per layer;
/// - head 1,024 × 10,000 + 10,000 = 10,250,000.
///
/// Total 37,275,408 here; 37,283,600 as PyTorch counts it (8,192 more: the second bias of each
/// layer). No dropout: the brief's model is the bare stack.
pub fn lstm_lm(batch: u64, seq: u64) -> Result<Graph, GraphError> {
    ptb_lm("lstm_lm", batch, seq, LSTM_LM_HIDDEN, None)
}

/// Zaremba et al. 2014's small (non-regularized) Penn Treebank model: embedding 10000 × 200 →
/// LSTM(200) → LSTM(200) → Linear(200 → 10000, bias) → cross-entropy against `labels`
/// `[batch, seq]`; published unroll [`ZAREMBA_SMALL_UNROLL`] = 20.
///
/// 4,651,600 parameters with one 4h bias per layer, as TensorFlow's `ptb_word_lm.py` tutorial
/// (its `SmallConfig` reproduces the paper's small model) counts them: 2,000,000 embedding + 2 × 320,800 LSTM +
/// 2,010,000 head; PyTorch's two biases make it 4,653,200.
pub fn lstm_lm_small(batch: u64, seq: u64) -> Result<Graph, GraphError> {
    ptb_lm("lstm_lm_small", batch, seq, ZAREMBA_SMALL_HIDDEN, None)
}

/// Zaremba et al. 2014's large (regularized) Penn Treebank model: embedding 10000 × 1500 →
/// dropout → LSTM(1500) → dropout → LSTM(1500) → dropout → Linear(1500 → 10000, bias) →
/// cross-entropy; dropout 65 % on the non-recurrent connections, published unroll
/// [`ZAREMBA_LARGE_UNROLL`] = 35.
///
/// 66,022,000 parameters (one bias per layer: 15,000,000 embedding + 2 × 18,006,000 LSTM +
/// 15,010,000 head); the published figure is 66M (Merity et al. 2017, table 1, "Zaremba et al.
/// (2014) — LSTM (large)": 66M parameters, 78.4 test perplexity).
pub fn lstm_lm_big(batch: u64, seq: u64) -> Result<Graph, GraphError> {
    ptb_lm(
        "lstm_lm_big",
        batch,
        seq,
        ZAREMBA_LARGE_HIDDEN,
        Some(ZAREMBA_LARGE_DROPOUT_PERMILLE),
    )
}

/// A 2-layer PTB language model of width `hidden`, with dropout on the embedding and each
/// layer's output when `dropout` is given.
fn ptb_lm(
    name: &str,
    batch: u64,
    seq: u64,
    hidden: u64,
    dropout: Option<u32>,
) -> Result<Graph, GraphError> {
    let mut g = GraphBuilder::new(name);
    let tokens = g.input("tokens", [batch, seq], DType::I64);
    let labels = g.input("labels", [batch, seq], DType::I64);
    let (mut x, _) = g.embedding("encoder", tokens, PTB_VOCAB, hidden)?;
    if let Some(rate) = dropout {
        x = g.dropout("drop.encoder", x, rate)?;
    }
    for layer in 0..LSTM_LM_LAYERS {
        g.segment(Segment::Block(layer));
        x = lstm_layer(&mut g, &format!("rnn.l{layer}"), x, hidden)?;
        if let Some(rate) = dropout {
            x = g.dropout(&format!("drop.l{layer}"), x, rate)?;
        }
    }
    g.segment(Segment::Post);
    let logits = g.linear("decoder", x, PTB_VOCAB, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

/// Vocabulary of [`lstm_tiny`]: bytes, so it trains on any text file.
pub const LSTM_TINY_VOCAB: u64 = 256;

/// parallax's own CPU language model, [`lstm_lm`]'s architecture shrunk to run in a test and
/// read bytes: embedding 256 × 32 → LSTM(32) → LSTM(32) → Linear(32 → 256, bias) →
/// cross-entropy.
///
/// 33,280 parameters: embedding 8,192; per layer 32 × 128 + 32 × 128 + 128 = 8,320; head
/// 8,192 + 256.
pub fn lstm_tiny(batch: u64, seq: u64) -> Result<Graph, GraphError> {
    let mut g = GraphBuilder::new("lstm_tiny");
    let tokens = g.input("tokens", [batch, seq], DType::I64);
    let labels = g.input("labels", [batch, seq], DType::I64);
    let (mut x, _) = g.embedding("encoder", tokens, LSTM_TINY_VOCAB, 32)?;
    for layer in 0..LSTM_LM_LAYERS {
        g.segment(Segment::Block(layer));
        x = lstm_layer(&mut g, &format!("rnn.l{layer}"), x, 32)?;
    }
    g.segment(Segment::Post);
    let logits = g.linear("decoder", x, LSTM_TINY_VOCAB, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

/// Vocabulary of the Movie Reviews sentence-polarity dataset (Pang & Lee 2005) as Kim 2014
/// (table 1) preprocesses it: 18,765 words.
pub const MR_VOCAB: u64 = 18_765;

/// Average sentence length of Movie Reviews in words (Kim 2014, table 1): the documented
/// sequence length of [`rnn_text_classifier`].
pub const MR_SEQ: u64 = 20;

/// Movie Reviews classes (positive, negative).
const MR_CLASSES: u64 = 2;

/// LSTM layers of [`rnn_text_classifier`] (Jia et al. 2019's benchmark list: RNNTC, four
/// recurrent layers followed by a softmax layer, on Movie Reviews).
const RNNTC_LAYERS: u32 = 4;

/// Hidden units (and embedding width) of [`rnn_text_classifier`]: not published (see there).
const RNNTC_HIDDEN: u64 = 1024;

/// FlexFlow's RNN text classifier ("RNNTC" in Jia, Zaharia & Aiken, SysML 2019, whose benchmark
/// list gives four recurrent layers followed by a softmax layer, trained on Movie Reviews):
/// embedding 18765 × 1024 → 4 × LSTM(1024) → the last step's output → Linear(1024 → 2, bias) →
/// cross-entropy against `labels` `[batch]`.
///
/// The paper gives the layer count and the dataset, not the widths, and no RNNTC example turned
/// up in FlexFlow's repository (its legacy `nmt/` RNN example defaults to 2 layers of 2048
/// units, 2048-wide embeddings, a 20,480-word vocabulary and 20 steps). The choices here,
/// documented as choices: hidden and embedding width 1024, Kim 2014's Movie Reviews vocabulary
/// ([`MR_VOCAB`]) and average length ([`MR_SEQ`]), and the classifier on the final hidden
/// state. Parameters: 19,215,360 embedding + 4 × 8,392,704 LSTM (one bias per layer) + 2,050
/// head = 52,788,226; no published count exists to compare with.
pub fn rnn_text_classifier(batch: u64, seq: u64) -> Result<Graph, GraphError> {
    let h = RNNTC_HIDDEN;
    let mut g = GraphBuilder::new("rnn_text_classifier");
    let tokens = g.input("tokens", [batch, seq], DType::I64);
    let labels = g.input("labels", [batch], DType::I64);
    let (mut x, _) = g.embedding("embedding", tokens, MR_VOCAB, h)?;
    for layer in 0..RNNTC_LAYERS {
        g.segment(Segment::Block(layer));
        x = lstm_layer(&mut g, &format!("rnn.l{layer}"), x, h)?;
    }
    g.segment(Segment::Post);
    // The last time step: a split of the sequence axis (nothing to split off at length 1).
    let last = if seq > 1 {
        g.op(
            "last_step",
            OpKind::Split(SplitAttrs {
                axis: 1,
                sizes: vec![seq - 1, 1],
            }),
            &[x],
        )?[1]
    } else {
        x
    };
    let last = g.op1(
        "last_step.squeeze",
        OpKind::Reshape(ReshapeAttrs {
            shape: vec![batch, h],
        }),
        &[last],
    )?;
    let logits = g.linear("fc", last, MR_CLASSES, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cnn::tests::{
        assert_every_node_splits_on_batch, assert_linear_in_batch, assert_scalar_outputs,
        assert_valid, fwd_flops,
    };

    /// PyTorch's count adds one more 4h bias per layer.
    const PYTORCH_EXTRA_BIAS: u64 = LSTM_LM_LAYERS as u64 * LSTM_GATES * LSTM_LM_HIDDEN;

    #[test]
    fn parameter_count() {
        let g = lstm_lm(1, 35).unwrap();
        assert_eq!(g.param_count(), 37_275_408);
        assert_eq!(g.param_count() + PYTORCH_EXTRA_BIAS, 37_283_600);
        assert_eq!(g.embedding_params(), 10_240_000);
        assert_eq!(
            g.params_where(|n| n.segment == Segment::Block(1)),
            8_392_704
        );
        assert_eq!(g.num_blocks(), 2);
    }

    #[test]
    fn forward_flops_are_twice_the_dense_parameters_per_token() {
        // Kaplan et al. 2020: forward ≈ 2 FLOPs per non-embedding parameter per token (each
        // weight is one multiply-add per token); here 2 × 27.04 M = 54.1 MFLOPs per token, plus
        // ~10 FLOPs per hidden unit per step for the gates and the loss's 6 per logit.
        let (b, s) = (2, 35);
        let g = lstm_lm(b, s).unwrap();
        let per_token = fwd_flops(&g) / (b * s) as f64;
        let dense = (g.param_count() - g.embedding_params()) as f64;
        assert!(
            (per_token / (2.0 * dense) - 1.0).abs() < 0.002,
            "{per_token} vs {}",
            2.0 * dense
        );
    }

    #[test]
    fn zaremba_parameter_counts() {
        let small = lstm_lm_small(1, ZAREMBA_SMALL_UNROLL).unwrap();
        assert_eq!(small.param_count(), 4_651_600);
        assert_eq!(small.param_count() + 2 * LSTM_GATES * 200, 4_653_200);
        let big = lstm_lm_big(1, ZAREMBA_LARGE_UNROLL).unwrap();
        assert_eq!(big.param_count(), 66_022_000);
        assert!((big.param_count() as f64 / 66e6 - 1.0).abs() < 0.001);
        assert_eq!(big.op_histogram()["dropout"], 3);
        assert!(!small.op_histogram().contains_key("dropout"));
    }

    #[test]
    fn zaremba_flops_per_token_by_hand() {
        // Per token: 2 FLOPs per weight (not per bias) of the LSTMs and the head, the head's
        // bias (V), the loss (6 V), ~10 per hidden unit per layer for the gates, and one per
        // element for each dropout (three of width h in the large model).
        let v = PTB_VOCAB as f64;
        for (g, h, s, dropouts) in [
            (
                lstm_lm_small(2, ZAREMBA_SMALL_UNROLL).unwrap(),
                200.0,
                ZAREMBA_SMALL_UNROLL,
                0.0,
            ),
            (
                lstm_lm_big(2, ZAREMBA_LARGE_UNROLL).unwrap(),
                1500.0,
                ZAREMBA_LARGE_UNROLL,
                3.0,
            ),
        ] {
            let layers = f64::from(LSTM_LM_LAYERS);
            let lstm_weights = layers * 2.0 * h * 4.0 * h;
            let expected =
                2.0 * (lstm_weights + h * v) + 7.0 * v + 10.0 * h * layers + dropouts * h;
            let per_token = fwd_flops(&g) / (2 * s) as f64;
            assert!(
                (per_token / expected - 1.0).abs() < 1e-12,
                "{}: {per_token} vs {expected}",
                g.name
            );
        }
    }

    #[test]
    fn text_classifier_shapes_and_count() {
        let g = rnn_text_classifier(3, MR_SEQ).unwrap();
        assert_eq!(g.param_count(), 52_788_226);
        assert_eq!(g.num_blocks(), 4);
        let fc = g.nodes.iter().find(|n| n.name == "fc").unwrap();
        assert_eq!(g.input_shapes(fc)[0], crate::shape::Shape::new([3, 1024]));
        assert_scalar_outputs(&g);
        assert_valid(&g, 3);
        // A one-token sentence has no split to make.
        rnn_text_classifier(3, 1).unwrap();
    }

    #[test]
    fn structure_batch_scaling_and_splits() {
        for f in [lstm_lm_small, lstm_lm_big, rnn_text_classifier] {
            let four = f(4, 20).unwrap();
            assert_scalar_outputs(&four);
            assert_valid(&four, 4);
            assert_linear_in_batch(&f(1, 20).unwrap(), &four);
            assert_every_node_splits_on_batch(&four);
        }
        let one = lstm_lm(1, 35).unwrap();
        let four = lstm_lm(4, 35).unwrap();
        assert_scalar_outputs(&four);
        assert_valid(&four, 4);
        assert_linear_in_batch(&one, &four);
        assert_every_node_splits_on_batch(&four);
    }
}
