//! Recurrent models as training graphs: a 2-layer LSTM word-level language model.

use crate::dtype::DType;
use crate::graph::{Graph, GraphBuilder, GraphError, Segment};
use crate::op::{OpKind, RnnAttrs};

/// Penn Treebank word-level vocabulary (Mikolov et al. 2010 preprocessing, as used by
/// Zaremba et al. 2014).
pub const PTB_VOCAB: u64 = 10_000;

/// Hidden units (and embedding width) of [`lstm_lm`].
const LSTM_LM_HIDDEN: u64 = 1024;

/// Stacked LSTM layers of [`lstm_lm`].
const LSTM_LM_LAYERS: u32 = 2;

/// LSTM gates (input, forget, cell, output).
const LSTM_GATES: u64 = 4;

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
    let h = LSTM_LM_HIDDEN;
    let mut g = GraphBuilder::new("lstm_lm");
    let tokens = g.input("tokens", [batch, seq], DType::I64);
    let labels = g.input("labels", [batch, seq], DType::I64);
    let (mut x, _) = g.embedding("encoder", tokens, PTB_VOCAB, h)?;
    for layer in 0..LSTM_LM_LAYERS {
        g.segment(Segment::Block(layer));
        let name = format!("rnn.l{layer}");
        let i = g.shape(x).last();
        let w_ih = g.weight(format!("{name}.weight_ih"), [i, LSTM_GATES * h]);
        let w_hh = g.weight(format!("{name}.weight_hh"), [h, LSTM_GATES * h]);
        let bias = g.weight(format!("{name}.bias"), [LSTM_GATES * h]);
        x = g.op1(
            name,
            OpKind::Lstm(RnnAttrs { hidden: h }),
            &[x, w_ih, w_hh, bias],
        )?;
    }
    g.segment(Segment::Post);
    let logits = g.linear("decoder", x, PTB_VOCAB, true)?;
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
    fn structure_batch_scaling_and_splits() {
        let one = lstm_lm(1, 35).unwrap();
        let four = lstm_lm(4, 35).unwrap();
        assert_scalar_outputs(&four);
        assert_valid(&four, 4);
        assert_linear_in_batch(&one, &four);
        assert_every_node_splits_on_batch(&four);
    }
}
