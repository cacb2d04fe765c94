//! AmoebaNet-D as a training graph, as torchgpipe's benchmarks build it
//! (`kakaobrain/torchgpipe`, `benchmarks/models/amoebanet`: `amoebanetd(num_classes, num_layers,
//! num_filters)`), the model of GPipe's (Huang et al. 2019) pipeline benchmarks.
//!
//! The network is an `nn.Sequential` of 24 layers for AmoebaNet-D (18, ·): `stem1` (ReLU, 3×3
//! stride-2 conv, BatchNorm), two reduction cells `stem2` / `stem3`, three groups of L/3 normal
//! cells separated by the reduction cells `cell2_reduction` and `cell4_reduction`, and
//! `classify` (7×7 average pool, fc). Node names are torchgpipe's module paths
//! (`cell1_normal1.operations.3.module.4`); the sums of operation pairs (`{cell}.add{k}`) and the
//! cell's output concatenation (`{cell}.cat`) are the `forward`'s tensor ops.
//!
//! Segments: `stem1` is `Pre`, each of the 22 cells one `Block`, `classify` and the loss `Post`,
//! so torchgpipe's `balance` (layers per partition) maps onto segments one to one: `[7, 17]` is
//! `Pre` + `Block(0..=5)` | `Block(6..=21)` + `Post`.
//!
//! Where torchgpipe's code differs from the paper, this follows the code: its genotype's
//! `max_pool_3x3` is an `AvgPool2d` (3×3, `count_include_pad=False`), and the normal cell
//! concatenates states `[0, 3, 4, 6]` (TensorFlow's reference AmoebaNet-D; with it torchgpipe
//! reproduces GPipe's parameter counts). Two deviations in the graph, neither changing a
//! parameter or a shape: pooling has no `count_include_pad` attribute (only the divisor at the
//! border differs), and `FactorizedReduce`'s second path reads its input shifted by one pixel
//! and zero-padded (`pad(x[:, :, 1:, 1:])`), which the graph feeds unshifted to the same
//! 1×1 stride-2 conv (the same work).

use super::cnn::{pool, IMAGENET_CLASSES};
use crate::dtype::DType;
use crate::graph::{conv, Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{Activation, AxisAttrs, Conv2dAttrs, OpKind, PoolKind};

/// Side of the square input: torchgpipe's speed benchmark feeds 3×224×224 tensors.
pub const AMOEBANET_IMAGE_SIZE: u64 = 224;

/// Cells L of the GPipe benchmark model AmoebaNet-D (18, 256) (torchgpipe
/// `benchmarks/amoebanetd-speed`, GPipe table 2): L/3 normal cells in each of three groups.
const AMOEBANET_D_LAYERS: u32 = 18;

/// Filters D of AmoebaNet-D (18, 256): the stem has D/4 channels, doubled by each reduction.
const AMOEBANET_D_FILTERS: u64 = 256;

/// One operation of a cell, named as in torchgpipe's genotype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CellOp {
    /// ReLU, 1×1 conv (carrying the stride), BatchNorm.
    Conv1x1,
    /// ReLU–1×1 to c/4–BN, ReLU–3×3 (stride)–BN, ReLU–1×1 back to c–BN.
    Conv3x3,
    /// ReLU–1×1 to c/4–BN, ReLU–1×7–BN, ReLU–7×1–BN (the stride split between them),
    /// ReLU–1×1 back to c–BN.
    Conv1x7x7x1,
    /// 2×2 max pool.
    MaxPool2x2,
    /// Named `max_pool_3x3`, built by torchgpipe as a 3×3 average pool with padding 1.
    MaxPool3x3,
    /// 3×3 average pool with padding 1.
    AvgPool3x3,
    /// `none`: the identity, or `FactorizedReduce` where it carries a stride.
    Identity,
}

use CellOp::*;

/// AmoebaNet-D's normal cell: (input state, operation) pairs, two per new state.
const NORMAL_OPERATIONS: [(usize, CellOp); 10] = [
    (1, Conv1x1),
    (1, MaxPool3x3),
    (1, Identity),
    (0, Conv1x7x7x1),
    (0, Conv1x1),
    (0, Conv1x7x7x1),
    (2, MaxPool3x3),
    (2, Identity),
    (1, AvgPool3x3),
    (5, Conv1x1),
];

/// States the normal cell concatenates.
const NORMAL_CONCAT: [usize; 4] = [0, 3, 4, 6];

/// AmoebaNet-D's reduction cell; operations reading state 0 or 1 carry stride 2.
const REDUCTION_OPERATIONS: [(usize, CellOp); 10] = [
    (0, MaxPool2x2),
    (0, MaxPool3x3),
    (2, Identity),
    (1, Conv3x3),
    (2, Conv1x7x7x1),
    (2, MaxPool3x3),
    (3, Identity),
    (1, MaxPool2x2),
    (2, AvgPool3x3),
    (3, Conv1x1),
];

/// States the reduction cell concatenates.
const REDUCTION_CONCAT: [usize; 3] = [4, 5, 6];

/// torchgpipe's AmoebaNet-D (18, 256) on 224×224×3 images, 1000 classes, with a cross-entropy
/// loss against `labels` `[batch]`: the model of torchgpipe's AmoebaNet-D speed benchmark
/// (GPipe, table 2).
///
/// 122,470,120 trainable parameters, counted from torchgpipe's code (no count is published
/// for (18, 256)); the same builder gives the counts torchgpipe publishes for its memory
/// benchmark (`docs/benchmarks.rst`): (18, 208) 81.5M and (18, 416) 319.0M (tested below).
pub fn amoebanet_d_18_256(batch: u64) -> Result<Graph, GraphError> {
    amoebanet_d(
        "amoebanet_d_18_256",
        batch,
        AMOEBANET_D_LAYERS,
        AMOEBANET_D_FILTERS,
    )
}

/// Channel bookkeeping of `amoebanetd()`: the two previous outputs' channels, this cell's
/// channel count and whether the previous cell reduced.
struct Chain {
    prev_prev: u64,
    prev: u64,
    channels: u64,
    reduction_prev: bool,
}

fn amoebanet_d(name: &str, batch: u64, layers: u32, filters: u64) -> Result<Graph, GraphError> {
    let s = AMOEBANET_IMAGE_SIZE;
    let mut g = GraphBuilder::new(name);
    let images = g.input("images", [batch, 3, s, s], DType::F32);
    let labels = g.input("labels", [batch], DType::I64);
    let c = filters / 4;
    let x = g.activation("stem1.relu", Activation::Relu, images)?;
    let x = g.conv2d("stem1.conv", x, conv(c, 3, 2, 1))?;
    let stem = g.batch_norm("stem1.bn", x)?;

    let repeat = layers / 3;
    let mut cells: Vec<(String, bool)> = vec![("stem2".into(), true), ("stem3".into(), true)];
    for group in 0..3 {
        if group > 0 {
            cells.push((format!("cell{}_reduction", 2 * group), true));
        }
        for i in 0..repeat {
            cells.push((format!("cell{}_normal{}", 2 * group + 1, i + 1), false));
        }
    }
    let mut chain = Chain {
        prev_prev: c,
        prev: c,
        channels: c,
        reduction_prev: false,
    };
    // The first cell reads the stem output as both of its states.
    let (mut s1, mut s2) = (stem, stem);
    for (i, (p, reduction)) in cells.iter().enumerate() {
        g.segment(Segment::Block(i as u32));
        if *reduction {
            chain.channels *= 2;
        }
        let out = cell(&mut g, p, s1, s2, &chain, *reduction)?;
        let concat = if *reduction {
            REDUCTION_CONCAT.len()
        } else {
            NORMAL_CONCAT.len()
        } as u64;
        chain.prev_prev = chain.prev;
        chain.prev = chain.channels * concat;
        chain.reduction_prev = *reduction;
        // The next cell reads (this output, this cell's first input).
        (s1, s2) = (out, s1);
    }

    g.segment(Segment::Post);
    let x = g.op1("classify.pool", pool(PoolKind::Avg, 7, 7, 0), &[s1])?;
    let x = g.op1(
        "classify.flat",
        OpKind::Flatten(AxisAttrs { axis: 1 }),
        &[x],
    )?;
    let logits = g.linear("classify.fc", x, IMAGENET_CLASSES, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

/// One cell: `reduce1` on the previous output, `reduce2` on the one before, five sums of
/// operation pairs, and the concatenation of the chosen states.
fn cell(
    g: &mut GraphBuilder,
    p: &str,
    s1: TensorId,
    s2: TensorId,
    chain: &Chain,
    reduction: bool,
) -> Result<TensorId, GraphError> {
    let c = chain.channels;
    let s1 = relu_conv_bn(g, &format!("{p}.reduce1"), s1, conv(c, 1, 1, 0))?;
    let s2 = if chain.reduction_prev {
        factorized_reduce(g, &format!("{p}.reduce2"), s2, c)?
    } else if chain.prev_prev != c {
        relu_conv_bn(g, &format!("{p}.reduce2"), s2, conv(c, 1, 1, 0))?
    } else {
        s2
    };
    let (ops, concat): (&[(usize, CellOp)], &[usize]) = if reduction {
        (&REDUCTION_OPERATIONS, &REDUCTION_CONCAT)
    } else {
        (&NORMAL_OPERATIONS, &NORMAL_CONCAT)
    };
    let mut states = vec![s1, s2];
    for (k, pair) in ops.chunks(2).enumerate() {
        let mut h = Vec::with_capacity(2);
        for (j, &(input, op)) in pair.iter().enumerate() {
            let stride = if reduction && input < 2 { 2 } else { 1 };
            let name = format!("{p}.operations.{}.module", 2 * k + j);
            h.push(operation(g, &name, states[input], op, c, stride)?);
        }
        states.push(g.op1(format!("{p}.add{k}"), OpKind::Add, &h)?);
    }
    let chosen: Vec<TensorId> = concat.iter().map(|&i| states[i]).collect();
    g.op1(
        format!("{p}.cat"),
        OpKind::Concat(AxisAttrs { axis: 1 }),
        &chosen,
    )
}

/// One operation at `c` channels; `p` is its module path (`….operations.{i}.module`).
fn operation(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    op: CellOp,
    c: u64,
    stride: u64,
) -> Result<TensorId, GraphError> {
    let q = c / 4;
    // A sequence of (ReLU, conv, BN) triples named `{p}.0`, `{p}.1`, `{p}.2`, `{p}.3`, ….
    let seq = |g: &mut GraphBuilder, x: TensorId, convs: &[Conv2dAttrs]| {
        let mut x = x;
        for (i, attrs) in convs.iter().enumerate() {
            x = g.activation(&format!("{p}.{}", 3 * i), Activation::Relu, x)?;
            x = g.conv2d(&format!("{p}.{}", 3 * i + 1), x, attrs.clone())?;
            x = g.batch_norm(&format!("{p}.{}", 3 * i + 2), x)?;
        }
        Ok::<TensorId, GraphError>(x)
    };
    match op {
        Conv1x1 => seq(g, x, &[conv(c, 1, stride, 0)]),
        Conv3x3 => seq(
            g,
            x,
            &[conv(q, 1, 1, 0), conv(q, 3, stride, 1), conv(c, 1, 1, 0)],
        ),
        Conv1x7x7x1 => seq(
            g,
            x,
            &[
                conv(q, 1, 1, 0),
                Conv2dAttrs {
                    kernel: [1, 7],
                    stride: [1, stride],
                    padding: [0, 3],
                    ..conv(q, 1, 1, 0)
                },
                Conv2dAttrs {
                    kernel: [7, 1],
                    stride: [stride, 1],
                    padding: [3, 0],
                    ..conv(q, 1, 1, 0)
                },
                conv(c, 1, 1, 0),
            ],
        ),
        MaxPool2x2 => g.op1(p, pool(PoolKind::Max, 2, stride, 0), &[x]),
        MaxPool3x3 | AvgPool3x3 => g.op1(p, pool(PoolKind::Avg, 3, stride, 1), &[x]),
        Identity if stride == 1 => Ok(x),
        Identity => factorized_reduce(g, p, x, c),
    }
}

/// `relu_conv_bn`: ReLU `{p}.0`, conv `{p}.1` (no bias), BatchNorm `{p}.2`.
fn relu_conv_bn(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    attrs: Conv2dAttrs,
) -> Result<TensorId, GraphError> {
    let x = g.activation(&format!("{p}.0"), Activation::Relu, x)?;
    let x = g.conv2d(&format!("{p}.1"), x, attrs)?;
    g.batch_norm(&format!("{p}.2"), x)
}

/// `FactorizedReduce`: ReLU, two 1×1 stride-2 convs to `out / 2` channels each (the second on
/// the input shifted by a pixel, see the module docs), concatenated, BatchNorm.
fn factorized_reduce(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    out: u64,
) -> Result<TensorId, GraphError> {
    let x = g.activation(&format!("{p}.relu"), Activation::Relu, x)?;
    let a = g.conv2d(&format!("{p}.conv1"), x, conv(out / 2, 1, 2, 0))?;
    let b = g.conv2d(&format!("{p}.conv2"), x, conv(out / 2, 1, 2, 0))?;
    let y = g.op1(
        format!("{p}.cat"),
        OpKind::Concat(AxisAttrs { axis: 1 }),
        &[a, b],
    )?;
    g.batch_norm(&format!("{p}.bn"), y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cnn::tests::{
        assert_every_node_splits_on_batch, assert_linear_in_batch, assert_scalar_outputs,
        assert_valid,
    };
    use crate::shape::Shape;

    #[test]
    fn parameter_counts_match_torchgpipe() {
        assert_eq!(amoebanet_d_18_256(1).unwrap().param_count(), 122_470_120);
        // torchgpipe docs/benchmarks.rst, AmoebaNet-D (L, D) memory benchmark: 81.5M, 319.0M.
        let small = amoebanet_d("a", 1, 18, 208).unwrap().param_count();
        assert_eq!(small, 81_505_540);
        let large = amoebanet_d("a", 1, 18, 416).unwrap().param_count();
        assert_eq!(large, 319_024_120);
    }

    #[test]
    fn cells_shapes_and_segments() {
        let g = amoebanet_d_18_256(2).unwrap();
        assert_scalar_outputs(&g);
        assert_valid(&g, 2);
        // 22 cells between stem1 and classify: torchgpipe's 24 layers.
        assert_eq!(g.num_blocks(), 22);
        assert!(g.nodes.windows(2).all(|w| w[0].segment <= w[1].segment));
        let out = |name: &str| {
            let n = g.nodes.iter().find(|n| n.name == name).unwrap();
            g.tensor(n.outputs[0]).shape.clone()
        };
        assert_eq!(out("stem1.bn"), Shape::new([2, 64, 112, 112]));
        assert_eq!(out("stem2.cat"), Shape::new([2, 384, 56, 56]));
        assert_eq!(out("stem3.cat"), Shape::new([2, 768, 28, 28]));
        assert_eq!(out("cell1_normal6.cat"), Shape::new([2, 1024, 28, 28]));
        assert_eq!(out("cell2_reduction.cat"), Shape::new([2, 1536, 14, 14]));
        assert_eq!(out("cell5_normal6.cat"), Shape::new([2, 4096, 7, 7]));
        assert_eq!(out("classify.pool"), Shape::new([2, 4096, 1, 1]));
        // The first normal cell after a reduction factorizes its skip input 56 → 28.
        assert_eq!(
            out("cell1_normal1.reduce2.bn"),
            Shape::new([2, 256, 28, 28])
        );
    }

    #[test]
    fn batch_scaling_and_splits() {
        let four = amoebanet_d_18_256(4).unwrap();
        assert_linear_in_batch(&amoebanet_d_18_256(1).unwrap(), &four);
        assert_every_node_splits_on_batch(&four);
    }
}
