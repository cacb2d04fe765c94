//! DLRM as a training graph: the MLPerf Training reference recommendation model on Criteo
//! Terabyte (Naumov et al. 2019; `facebookresearch/dlrm`, `dlrm_s_pytorch.py` with
//! `--max-ind-range=40000000`).
//!
//! Node names follow `DLRM_Net`'s modules: `bot_l.{i}` / `top_l.{i}` (the bottom and top MLPs,
//! an `nn.Sequential` of Linear and activation layers) and `emb_l.{k}` (one table per sparse
//! feature).

use crate::dtype::DType;
use crate::graph::{Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{Activation, AxisAttrs, MatMulAttrs, OpKind, ReshapeAttrs, SplitAttrs};

/// Rows of the 26 embedding tables: the Criteo Terabyte category counts with indices hashed
/// into 40 M (`--max-ind-range=40000000`), as the DLRM reference code lists them for the MLPerf
/// configuration (HugeCTR's MLPerf config and Google's TPU DLRM config repeat them).
pub const CRITEO_TB_TABLE_ROWS: [u64; 26] = [
    39_884_406, 39_043, 17_289, 7_420, 20_263, 3, 7_120, 1_543, 63, 38_532_951, 2_953_546, 403_346,
    10, 2_208, 11_938, 155, 4, 976, 14, 39_979_771, 25_641_295, 39_664_984, 585_935, 12_972, 108,
    36,
];

/// Dense (numerical) features of a Criteo sample.
pub const CRITEO_DENSE_FEATURES: u64 = 13;

/// Width of every embedding and of the bottom MLP's output (`--arch-sparse-feature-size=128`).
const EMBEDDING_DIM: u64 = 128;

/// Bottom MLP widths after the 13 dense inputs (`--arch-mlp-bot=13-512-256-128`).
const BOTTOM_MLP: [u64; 3] = [512, 256, 128];

/// Top MLP widths after the interaction (`--arch-mlp-top=1024-1024-512-256-1`).
const TOP_MLP: [u64; 5] = [1024, 1024, 512, 256, 1];

/// DLRM for MLPerf on Criteo Terabyte: int64 `sparse.{k}` `[batch, 1]` (one index per feature)
/// for the 26 tables of 128-wide embeddings, f32 `dense` `[batch, 13]` through the bottom MLP
/// 13→512→256→128 (ReLU after each), the dot interaction, the top MLP 479→1024→1024→512→256→1
/// (ReLU after all but the last) and a scalar loss against `labels` `[batch]`.
///
/// The dot interaction (`interact_features`, `arch_interaction_op="dot"`): the bottom MLP
/// output and the 26 embeddings are concatenated into `T` `[batch, 27, 128]`, `Z = T·Tᵀ`
/// `[batch, 27, 27]` (a batched MatMul of `T` with itself), and the 351 entries strictly below
/// the diagonal are concatenated with the bottom MLP output into the top MLP's 479 inputs.
/// Selecting the lower triangle is a gather our op set lacks; a Split that keeps 351 of the
/// 729 flattened entries stands in for it: the same shapes and the published 479-wide first
/// top layer, and neither op does arithmetic (the gather's copy of 351 values is ignored).
///
/// The loss: the reference ends in a sigmoid and binary cross-entropy on the single logit;
/// `CrossEntropy` on the `[batch, 1]` logits stands in for it (a few FLOPs per sample either
/// way).
///
/// 24,036,595,969 parameters: 187,767,399 table rows × 128 (24.03 B) plus 2,368,897 in the two
/// MLPs, counted from the reference's shapes (the reference prints no total). Segments: the 26 lookups are
/// `Pre`, the bottom MLP `Block(0)`, the interaction `Block(1)`, the four hidden top layers
/// `Block(2..=5)`, the last layer and the loss `Post`.
pub fn dlrm_mlperf(batch: u64) -> Result<Graph, GraphError> {
    let d = EMBEDDING_DIM;
    let tables = CRITEO_TB_TABLE_ROWS.len() as u64;
    let mut g = GraphBuilder::new("dlrm");
    let dense = g.input("dense", [batch, CRITEO_DENSE_FEATURES], DType::F32);
    let sparse: Vec<TensorId> = (0..tables)
        .map(|k| g.input(format!("sparse.{k}"), [batch, 1], DType::I64))
        .collect();
    let labels = g.input("labels", [batch], DType::I64);

    let mut embedded = Vec::with_capacity(sparse.len());
    for (k, (&ids, &rows)) in sparse.iter().zip(&CRITEO_TB_TABLE_ROWS).enumerate() {
        embedded.push(g.embedding(&format!("emb_l.{k}"), ids, rows, d)?.0);
    }

    g.segment(Segment::Block(0));
    let mut x = dense;
    for (i, &width) in BOTTOM_MLP.iter().enumerate() {
        x = g.linear(&format!("bot_l.{}", 2 * i), x, width, true)?;
        x = g.activation(&format!("bot_l.{}", 2 * i + 1), Activation::Relu, x)?;
    }

    g.segment(Segment::Block(1));
    let features = tables + 1;
    let pairs = features * (features - 1) / 2;
    let row = g.op1(
        "interact.dense_view",
        OpKind::Reshape(ReshapeAttrs {
            shape: vec![batch, 1, d],
        }),
        &[x],
    )?;
    let mut all = vec![row];
    all.extend(embedded);
    let t = g.op1("interact.cat", OpKind::Concat(AxisAttrs { axis: 1 }), &all)?;
    let z = g.op1(
        "interact.bmm",
        OpKind::MatMul(MatMulAttrs { transpose_b: true }),
        &[t, t],
    )?;
    let z = g.op1(
        "interact.flatten",
        OpKind::Flatten(AxisAttrs { axis: 1 }),
        &[z],
    )?;
    let lower = g.op(
        "interact.tril",
        OpKind::Split(SplitAttrs {
            axis: 1,
            sizes: vec![pairs, features * features - pairs],
        }),
        &[z],
    )?[0];
    let mut x = g.op1(
        "interact.out",
        OpKind::Concat(AxisAttrs { axis: 1 }),
        &[x, lower],
    )?;

    let (last, hidden) = TOP_MLP.split_last().expect("the top MLP has layers");
    for (i, &width) in hidden.iter().enumerate() {
        g.segment(Segment::Block(2 + i as u32));
        x = g.linear(&format!("top_l.{}", 2 * i), x, width, true)?;
        x = g.activation(&format!("top_l.{}", 2 * i + 1), Activation::Relu, x)?;
    }
    g.segment(Segment::Post);
    let logits = g.linear(&format!("top_l.{}", 2 * hidden.len()), x, *last, true)?;
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
    use crate::shape::Shape;

    #[test]
    fn parameter_count_from_the_reference_shapes() {
        let g = dlrm_mlperf(1).unwrap();
        let rows: u64 = CRITEO_TB_TABLE_ROWS.iter().sum();
        assert_eq!(rows, 187_767_399);
        assert_eq!(g.embedding_params(), rows * EMBEDDING_DIM);
        assert_eq!(g.param_count() - g.embedding_params(), 2_368_897);
        assert_eq!(g.param_count(), 24_036_595_969);
    }

    #[test]
    fn interaction_shapes() {
        let g = dlrm_mlperf(3).unwrap();
        assert_scalar_outputs(&g);
        assert_valid(&g, 3);
        assert!(g.nodes.windows(2).all(|w| w[0].segment <= w[1].segment));
        let out = |name: &str| {
            let n = g.nodes.iter().find(|n| n.name == name).unwrap();
            g.tensor(n.outputs[0]).shape.clone()
        };
        assert_eq!(out("interact.cat"), Shape::new([3, 27, 128]));
        assert_eq!(out("interact.bmm"), Shape::new([3, 27, 27]));
        assert_eq!(out("interact.out"), Shape::new([3, 479]));
        assert_eq!(out("top_l.8"), Shape::new([3, 1]));
        assert_eq!(g.op_histogram()["embedding"], 26);
        assert_eq!(g.num_blocks(), 6);
    }

    #[test]
    fn forward_flops_by_hand() {
        // Per sample: 2 per MLP weight plus biases, the interaction 2·27·27·128, ReLUs and the
        // loss; lookups cost no FLOPs.
        let g = dlrm_mlperf(1).unwrap();
        let mlp = |dims: &[u64]| -> f64 {
            dims.windows(2)
                .map(|w| (2 * w[0] * w[1] + w[1]) as f64)
                .sum()
        };
        let bottom = mlp(&[13, 512, 256, 128]);
        let top = mlp(&[479, 1024, 1024, 512, 256, 1]);
        let relus = (512 + 256 + 128 + 1024 + 1024 + 512 + 256) as f64;
        let interaction = 2.0 * 27.0 * 27.0 * 128.0;
        let expected = bottom + top + relus + interaction + 6.0;
        assert_eq!(fwd_flops(&g), expected);
    }

    #[test]
    fn batch_scaling_and_splits() {
        let four = dlrm_mlperf(4).unwrap();
        assert_linear_in_batch(&dlrm_mlperf(1).unwrap(), &four);
        assert_every_node_splits_on_batch(&four);
    }
}
