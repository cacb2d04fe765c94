//! Convolutional image classifiers as training graphs: torchvision's Inception-v3, and the
//! pieces the other CNN builders share (conv + BatchNorm, pooling, the classifier tail, and the
//! tests' graph checks). The ResNet family is in [`super::resnet`].
//!
//! Node names follow torchvision's module paths (`Mixed_6e.branch7x7_2.bn`) so that a plan or a
//! profile can be read against the PyTorch model. Every graph reads an NCHW `images` input and
//! int64 `labels` of shape `[batch]` and ends in a scalar cross-entropy loss.

use crate::dtype::DType;
use crate::graph::{conv, Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{Activation, AxisAttrs, Conv2dAttrs, OpKind, Pool2dAttrs, PoolKind};

/// ImageNet-1k classes.
pub const IMAGENET_CLASSES: u64 = 1000;

/// Side of the square Inception-v3 input (Szegedy et al. 2016, torchvision).
pub const INCEPTION_IMAGE_SIZE: u64 = 299;

/// Dropout before Inception-v3's classifier (torchvision `Inception3(dropout=0.5)`), per mille.
const INCEPTION_DROPOUT_PERMILLE: u32 = 500;

/// Conv (no bias) → BatchNorm, and ReLU when `relu`: torchvision's `conv{1,2,3}` + `bn{1,2,3}`.
pub(crate) fn conv_bn(
    g: &mut GraphBuilder,
    conv_name: &str,
    bn_name: &str,
    x: TensorId,
    attrs: Conv2dAttrs,
    relu: Option<&str>,
) -> Result<TensorId, GraphError> {
    let y = g.conv2d(conv_name, x, attrs)?;
    let y = g.batch_norm(bn_name, y)?;
    match relu {
        Some(r) => g.activation(r, Activation::Relu, y),
        None => Ok(y),
    }
}

/// A square pooling window.
pub(crate) fn pool(kind: PoolKind, kernel: u64, stride: u64, padding: u64) -> OpKind {
    OpKind::Pool2d(Pool2dAttrs {
        kind,
        kernel: [kernel, kernel],
        stride: [stride, stride],
        padding: [padding, padding],
    })
}

/// Global average pool, flatten, fc and loss: the shared classifier tail.
pub(crate) fn classifier(
    g: &mut GraphBuilder,
    prefix: &str,
    x: TensorId,
    labels: TensorId,
    dropout_permille: Option<u32>,
    loss_name: &str,
) -> Result<TensorId, GraphError> {
    let x = g.op1(format!("{prefix}avgpool"), OpKind::GlobalAvgPool, &[x])?;
    let mut x = g.op1(
        format!("{prefix}flatten"),
        OpKind::Flatten(AxisAttrs { axis: 1 }),
        &[x],
    )?;
    if let Some(rate) = dropout_permille {
        x = g.dropout(&format!("{prefix}dropout"), x, rate)?;
    }
    let logits = g.linear(&format!("{prefix}fc"), x, IMAGENET_CLASSES, true)?;
    g.op1(loss_name, OpKind::CrossEntropy, &[logits, labels])
}

/// torchvision Inception-v3 (Szegedy et al. 2016) on 299×299×3 images in training mode: the
/// stem, Mixed_5b…Mixed_7c (one `Segment::Block` each, 11 in all), dropout 0.5 and fc, plus the
/// auxiliary classifier (`AuxLogits`) on Mixed_6e's output.
///
/// Outputs `[loss, aux_loss]`, both scalar cross-entropies against the same `labels`: torchvision
/// returns `InceptionOutputs(logits, aux_logits)` in training mode and the reference recipe
/// minimizes `loss + 0.4 · aux_loss` (the scalar weighting costs nothing and is left out). The
/// auxiliary head's nodes are built last, in `Segment::Post`, so segments stay in node order.
///
/// 27,161,264 trainable parameters: torchvision `inception_v3(aux_logits=True)` (its default, the
/// model as trained; `Inception_V3_Weights.IMAGENET1K_V1` lists the same `num_params`); without
/// the auxiliary head's 3,326,696 (`aux_logits=False`) it is 23,834,568. Every BasicConv2d is a conv without bias, BatchNorm
/// (eps 0.001; weight and bias) and ReLU. About 5.7 GMACs per image forward (torchvision: 5.71).
pub fn inception_v3(batch: u64) -> Result<Graph, GraphError> {
    let s = INCEPTION_IMAGE_SIZE;
    let mut g = GraphBuilder::new("inception_v3");
    let images = g.input("images", [batch, 3, s, s], DType::F32);
    let labels = g.input("labels", [batch], DType::I64);
    let x = basic(&mut g, "Conv2d_1a_3x3", images, conv(32, 3, 2, 0))?;
    let x = basic(&mut g, "Conv2d_2a_3x3", x, conv(32, 3, 1, 0))?;
    let x = basic(&mut g, "Conv2d_2b_3x3", x, conv(64, 3, 1, 1))?;
    let x = g.op1("maxpool1", pool(PoolKind::Max, 3, 2, 0), &[x])?;
    let x = basic(&mut g, "Conv2d_3b_1x1", x, conv(80, 1, 1, 0))?;
    let x = basic(&mut g, "Conv2d_4a_3x3", x, conv(192, 3, 1, 0))?;
    let mut x = g.op1("maxpool2", pool(PoolKind::Max, 3, 2, 0), &[x])?;

    let mut block = 0;
    let mut next = |g: &mut GraphBuilder| {
        g.segment(Segment::Block(block));
        block += 1;
    };
    for (name, pool_features) in [("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)] {
        next(&mut g);
        x = inception_a(&mut g, name, x, pool_features)?;
    }
    next(&mut g);
    x = inception_b(&mut g, "Mixed_6a", x)?;
    for (name, c7) in [
        ("Mixed_6b", 128),
        ("Mixed_6c", 160),
        ("Mixed_6d", 160),
        ("Mixed_6e", 192),
    ] {
        next(&mut g);
        x = inception_c(&mut g, name, x, c7)?;
    }
    let aux_in = x;
    next(&mut g);
    x = inception_d(&mut g, "Mixed_7a", x)?;
    for name in ["Mixed_7b", "Mixed_7c"] {
        next(&mut g);
        x = inception_e(&mut g, name, x)?;
    }

    g.segment(Segment::Post);
    let loss = classifier(
        &mut g,
        "",
        x,
        labels,
        Some(INCEPTION_DROPOUT_PERMILLE),
        "loss",
    )?;
    // InceptionAux: avg pool 5/3 (17 → 5), 1×1 conv to 128, 5×5 conv to 768 (5 → 1), fc.
    let a = g.op1(
        "AuxLogits.avgpool0",
        pool(PoolKind::Avg, 5, 3, 0),
        &[aux_in],
    )?;
    let a = basic(&mut g, "AuxLogits.conv0", a, conv(128, 1, 1, 0))?;
    let a = basic(&mut g, "AuxLogits.conv1", a, conv(768, 5, 1, 0))?;
    let aux_loss = classifier(&mut g, "AuxLogits.", a, labels, None, "aux_loss")?;
    g.finish(&[loss, aux_loss])
}

/// torchvision `BasicConv2d`: conv (no bias) `{p}.conv`, BatchNorm `{p}.bn`, ReLU `{p}.relu`.
fn basic(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    attrs: Conv2dAttrs,
) -> Result<TensorId, GraphError> {
    conv_bn(
        g,
        &format!("{p}.conv"),
        &format!("{p}.bn"),
        x,
        attrs,
        Some(&format!("{p}.relu")),
    )
}

/// A bias-free conv with a `[kh, kw]` kernel and `[ph, pw]` padding, stride 1 (the 1×7, 7×1,
/// 1×3 and 3×1 factorized convolutions).
fn conv_hw(out: u64, kernel: [u64; 2], padding: [u64; 2]) -> Conv2dAttrs {
    Conv2dAttrs {
        kernel,
        padding,
        ..conv(out, 1, 1, 0)
    }
}

fn concat(g: &mut GraphBuilder, name: &str, xs: &[TensorId]) -> Result<TensorId, GraphError> {
    g.op1(name, OpKind::Concat(AxisAttrs { axis: 1 }), xs)
}

/// `branch_pool` of InceptionA/C/E: avg pool 3×3 stride 1 pad 1, then a 1×1 BasicConv2d.
fn branch_pool(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    out: u64,
) -> Result<TensorId, GraphError> {
    let y = g.op1(
        format!("{p}.branch_pool.avgpool"),
        pool(PoolKind::Avg, 3, 1, 1),
        &[x],
    )?;
    basic(g, &format!("{p}.branch_pool"), y, conv(out, 1, 1, 0))
}

/// InceptionA (35×35): 1×1 / 5×5 / double 3×3 / pool branches, 224 + `pool_features` channels.
fn inception_a(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    pool_features: u64,
) -> Result<TensorId, GraphError> {
    let b1 = basic(g, &format!("{p}.branch1x1"), x, conv(64, 1, 1, 0))?;
    let b5 = basic(g, &format!("{p}.branch5x5_1"), x, conv(48, 1, 1, 0))?;
    let b5 = basic(g, &format!("{p}.branch5x5_2"), b5, conv(64, 5, 1, 2))?;
    let b3 = basic(g, &format!("{p}.branch3x3dbl_1"), x, conv(64, 1, 1, 0))?;
    let b3 = basic(g, &format!("{p}.branch3x3dbl_2"), b3, conv(96, 3, 1, 1))?;
    let b3 = basic(g, &format!("{p}.branch3x3dbl_3"), b3, conv(96, 3, 1, 1))?;
    let bp = branch_pool(g, p, x, pool_features)?;
    concat(g, &format!("{p}.cat"), &[b1, b5, b3, bp])
}

/// InceptionB (35 → 17): stride-2 3×3 / double 3×3 / max-pool branches.
fn inception_b(g: &mut GraphBuilder, p: &str, x: TensorId) -> Result<TensorId, GraphError> {
    let b3 = basic(g, &format!("{p}.branch3x3"), x, conv(384, 3, 2, 0))?;
    let bd = basic(g, &format!("{p}.branch3x3dbl_1"), x, conv(64, 1, 1, 0))?;
    let bd = basic(g, &format!("{p}.branch3x3dbl_2"), bd, conv(96, 3, 1, 1))?;
    let bd = basic(g, &format!("{p}.branch3x3dbl_3"), bd, conv(96, 3, 2, 0))?;
    let bp = g.op1(
        format!("{p}.branch_pool"),
        pool(PoolKind::Max, 3, 2, 0),
        &[x],
    )?;
    concat(g, &format!("{p}.cat"), &[b3, bd, bp])
}

/// InceptionC (17×17): 1×1 / 1×7-7×1 / double 7×1-1×7 / pool branches, 768 channels.
fn inception_c(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    c7: u64,
) -> Result<TensorId, GraphError> {
    let (row, col) = ([1, 7], [7, 1]);
    let (prow, pcol) = ([0, 3], [3, 0]);
    let b1 = basic(g, &format!("{p}.branch1x1"), x, conv(192, 1, 1, 0))?;
    let b7 = basic(g, &format!("{p}.branch7x7_1"), x, conv(c7, 1, 1, 0))?;
    let b7 = basic(g, &format!("{p}.branch7x7_2"), b7, conv_hw(c7, row, prow))?;
    let b7 = basic(g, &format!("{p}.branch7x7_3"), b7, conv_hw(192, col, pcol))?;
    let bd = basic(g, &format!("{p}.branch7x7dbl_1"), x, conv(c7, 1, 1, 0))?;
    let bd = basic(
        g,
        &format!("{p}.branch7x7dbl_2"),
        bd,
        conv_hw(c7, col, pcol),
    )?;
    let bd = basic(
        g,
        &format!("{p}.branch7x7dbl_3"),
        bd,
        conv_hw(c7, row, prow),
    )?;
    let bd = basic(
        g,
        &format!("{p}.branch7x7dbl_4"),
        bd,
        conv_hw(c7, col, pcol),
    )?;
    let bd = basic(
        g,
        &format!("{p}.branch7x7dbl_5"),
        bd,
        conv_hw(192, row, prow),
    )?;
    let bp = branch_pool(g, p, x, 192)?;
    concat(g, &format!("{p}.cat"), &[b1, b7, bd, bp])
}

/// InceptionD (17 → 8): 3×3 stride 2 / 1×7-7×1-3×3 stride 2 / max-pool branches.
fn inception_d(g: &mut GraphBuilder, p: &str, x: TensorId) -> Result<TensorId, GraphError> {
    let b3 = basic(g, &format!("{p}.branch3x3_1"), x, conv(192, 1, 1, 0))?;
    let b3 = basic(g, &format!("{p}.branch3x3_2"), b3, conv(320, 3, 2, 0))?;
    let b7 = basic(g, &format!("{p}.branch7x7x3_1"), x, conv(192, 1, 1, 0))?;
    let b7 = basic(
        g,
        &format!("{p}.branch7x7x3_2"),
        b7,
        conv_hw(192, [1, 7], [0, 3]),
    )?;
    let b7 = basic(
        g,
        &format!("{p}.branch7x7x3_3"),
        b7,
        conv_hw(192, [7, 1], [3, 0]),
    )?;
    let b7 = basic(g, &format!("{p}.branch7x7x3_4"), b7, conv(192, 3, 2, 0))?;
    let bp = g.op1(
        format!("{p}.branch_pool"),
        pool(PoolKind::Max, 3, 2, 0),
        &[x],
    )?;
    concat(g, &format!("{p}.cat"), &[b3, b7, bp])
}

/// InceptionE (8×8): 1×1 / 1×3‖3×1 / 3×3 then 1×3‖3×1 / pool branches, 2048 channels.
fn inception_e(g: &mut GraphBuilder, p: &str, x: TensorId) -> Result<TensorId, GraphError> {
    let (row, col) = ([1, 3], [3, 1]);
    let (prow, pcol) = ([0, 1], [1, 0]);
    let b1 = basic(g, &format!("{p}.branch1x1"), x, conv(320, 1, 1, 0))?;
    let b3 = basic(g, &format!("{p}.branch3x3_1"), x, conv(384, 1, 1, 0))?;
    let b3a = basic(g, &format!("{p}.branch3x3_2a"), b3, conv_hw(384, row, prow))?;
    let b3b = basic(g, &format!("{p}.branch3x3_2b"), b3, conv_hw(384, col, pcol))?;
    let b3 = concat(g, &format!("{p}.branch3x3.cat"), &[b3a, b3b])?;
    let bd = basic(g, &format!("{p}.branch3x3dbl_1"), x, conv(448, 1, 1, 0))?;
    let bd = basic(g, &format!("{p}.branch3x3dbl_2"), bd, conv(384, 3, 1, 1))?;
    let bda = basic(
        g,
        &format!("{p}.branch3x3dbl_3a"),
        bd,
        conv_hw(384, row, prow),
    )?;
    let bdb = basic(
        g,
        &format!("{p}.branch3x3dbl_3b"),
        bd,
        conv_hw(384, col, pcol),
    )?;
    let bd = concat(g, &format!("{p}.branch3x3dbl.cat"), &[bda, bdb])?;
    let bp = branch_pool(g, p, x, 192)?;
    concat(g, &format!("{p}.cat"), &[b1, b3, bd, bp])
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::axes::AxisRole;
    use crate::graph::TensorRole;
    use crate::shape::Shape;

    /// Forward FLOPs of a graph per sample, at batch 1.
    pub(crate) fn fwd_flops(g: &Graph) -> f64 {
        g.total_work(4).fwd_flops.0
    }

    /// Work at batch 4 is 4× work at batch 1 (forward and backward FLOPs).
    pub(crate) fn assert_linear_in_batch(one: &Graph, four: &Graph) {
        let (w1, w4) = (one.total_work(2), four.total_work(2));
        for (a, b) in [
            (w1.fwd_flops.0, w4.fwd_flops.0),
            (w1.train_flops().0, w4.train_flops().0),
        ] {
            assert!((b / (4.0 * a) - 1.0).abs() < 1e-12, "{b} vs 4 × {a}");
        }
        assert_eq!(one.param_count(), four.param_count());
    }

    /// Every output is a scalar loss.
    pub(crate) fn assert_scalar_outputs(g: &Graph) {
        assert!(!g.outputs.is_empty());
        for o in &g.outputs {
            assert_eq!(g.tensor(*o).shape, Shape::scalar(), "{}", g.tensor(*o).name);
        }
    }

    /// Every node of a batch-4 graph can stay whole and can be split 4 ways on the batch alone
    /// (data parallelism is always available).
    pub(crate) fn assert_every_node_splits_on_batch(g: &Graph) {
        for n in &g.nodes {
            let (ins, outs) = (g.input_shapes(n), g.output_shapes(n));
            let m = n.op.axes(&ins, &outs);
            let splits = m.legal_splits(&ins, &outs, 4);
            assert_eq!(
                splits.first().map(|s| s.total_degree()),
                Some(1),
                "{}: no unsplit split",
                n.name
            );
            let batch = splits.iter().any(|s| {
                s.total_degree() == 4
                    && s.degrees.len() == 1
                    && s.degrees.keys().all(|l| m.axes[l].role == AxisRole::Sample)
                    && s.inputs[0].shard.first() == Some(&4)
            });
            assert!(batch, "{}: no 4-way batch split", n.name);
        }
    }

    /// The graph validates again from scratch, its batch-shaped inputs have the batch leading.
    pub(crate) fn assert_valid(g: &Graph, batch: u64) {
        let mut c = g.clone();
        c.validate().unwrap();
        for t in g.tensors.iter().filter(|t| t.role == TensorRole::Input) {
            assert_eq!(t.shape.0.first(), Some(&batch), "{}", t.name);
        }
    }

    #[test]
    fn inception_parameter_count_matches_torchvision() {
        let g = inception_v3(1).unwrap();
        assert_eq!(g.param_count(), 27_161_264);
        let aux = g.params_where(|n| n.name.starts_with("AuxLogits."));
        assert_eq!(g.param_count() - aux, 23_834_568);
    }

    #[test]
    fn structure_and_segments() {
        let inc = inception_v3(1).unwrap();
        assert_eq!(inc.num_blocks(), 11);
        assert_scalar_outputs(&inc);
        assert_valid(&inc, 1);
        // Segments appear in node order: Pre, Block(0), Block(1), …, Post.
        assert!(inc.nodes.windows(2).all(|w| w[0].segment <= w[1].segment));
        assert_eq!(inc.outputs.len(), 2);
        let mixed = inc.nodes.iter().find(|n| n.name == "Mixed_7c.cat").unwrap();
        assert_eq!(
            inc.tensor(mixed.outputs[0]).shape,
            Shape::new([1, 2048, 8, 8])
        );
    }

    #[test]
    fn inception_forward_flops_match_the_published_count() {
        // torchvision: 5.71 GMACs per 299×299 image (eval mode, no aux head) → 11.4 GFLOPs, plus
        // BatchNorm / ReLU / pooling (~0.15 G) and the aux head (~5.7 M MACs).
        let f = fwd_flops(&inception_v3(1).unwrap());
        assert!((11.4e9..11.8e9).contains(&f), "{f}");
    }

    #[test]
    fn work_is_linear_in_batch_and_every_node_has_a_batch_split() {
        let four = inception_v3(4).unwrap();
        assert_linear_in_batch(&inception_v3(1).unwrap(), &four);
        assert_valid(&four, 4);
        assert_every_node_splits_on_batch(&four);
    }
}
