//! Residual networks as training graphs: torchvision's ResNet-50 / -101 / -152 (v1.5) and
//! ResNeXt-101 32×4d (Xie et al. 2017), which is a ResNet whose bottleneck 3×3 conv is grouped.
//!
//! Node names follow torchvision's module paths (`layer1.0.conv1`, `layer2.0.downsample.0`);
//! every graph reads NCHW `images` and int64 `labels` `[batch]` and ends in a scalar
//! cross-entropy loss. The stem is `Segment::Pre`, each bottleneck one `Segment::Block`, the
//! pool, fc and loss `Segment::Post`.

use super::cnn::{classifier, conv_bn, pool};
use crate::dtype::DType;
use crate::graph::{conv, Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{Activation, AxisAttrs, Conv2dAttrs, OpKind, PoolKind};

/// Side of the square ResNet input (torchvision's reference training crop).
pub const RESNET_IMAGE_SIZE: u64 = 224;

/// Bottleneck blocks per stage of ResNet-50 (He et al. 2016, table 1).
const RESNET50_LAYERS: [u32; 4] = [3, 4, 6, 3];

/// Bottleneck blocks per stage of ResNet-101 (He et al. 2016, table 1).
const RESNET101_LAYERS: [u32; 4] = [3, 4, 23, 3];

/// Bottleneck blocks per stage of ResNet-152 (He et al. 2016, table 1).
const RESNET152_LAYERS: [u32; 4] = [3, 8, 36, 3];

/// Output channels of a bottleneck are `planes × 4`.
const BOTTLENECK_EXPANSION: u64 = 4;

/// How wide a bottleneck's inner 3×3 conv is: torchvision's `groups` and `width_per_group`
/// (`width = planes · width_per_group / 64 · groups`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cardinality {
    groups: u64,
    width_per_group: u64,
}

/// A plain ResNet: one group of width 64 per 64 planes.
const RESNET: Cardinality = Cardinality {
    groups: 1,
    width_per_group: 64,
};

/// ResNeXt 32×4d (Xie et al. 2017, table 1): 32 groups of 4 channels per 64 planes, so the
/// inner width is twice ResNet's (128 in `layer1`) and the 3×3 conv is grouped 32 ways.
const RESNEXT_32X4D: Cardinality = Cardinality {
    groups: 32,
    width_per_group: 4,
};

/// torchvision ResNet-50 v1.5 (the stride of a down-sampling bottleneck sits on its 3×3 conv) on
/// 224×224×3 images, 1000 classes, with a cross-entropy loss against `labels` `[batch]`.
///
/// 25,557,032 trainable parameters: torchvision's `resnet50()` count
/// (`sum(p.numel() for p in m.parameters())`, also in its model-weights table): conv weights
/// (no conv biases), BatchNorm weight and bias, fc weight and bias. About 4.1 GMACs per image
/// forward (torchvision reports 4.09 "GFLOPS", which are multiply-adds).
pub fn resnet50(batch: u64) -> Result<Graph, GraphError> {
    resnet("resnet50", batch, RESNET50_LAYERS, RESNET)
}

/// torchvision ResNet-101 v1.5, otherwise as [`resnet50`].
///
/// 44,549,160 trainable parameters (torchvision `resnet101()`); about 7.8 GMACs per image
/// forward (torchvision: 7.80).
pub fn resnet101(batch: u64) -> Result<Graph, GraphError> {
    resnet("resnet101", batch, RESNET101_LAYERS, RESNET)
}

/// torchvision ResNet-152 v1.5, otherwise as [`resnet50`].
///
/// 60,192,808 trainable parameters (torchvision `resnet152()`, `ResNet152_Weights` table);
/// about 11.5 GMACs per image forward (torchvision: 11.51).
pub fn resnet152(batch: u64) -> Result<Graph, GraphError> {
    resnet("resnet152", batch, RESNET152_LAYERS, RESNET)
}

/// ResNeXt-101 32×4d (Xie et al. 2017) on 224×224×3 images, as torchvision would build it
/// (`ResNet(Bottleneck, [3, 4, 23, 3], groups=32, width_per_group=4)`; torchvision itself ships
/// only 32×8d and 64×4d weights): ResNet-101 with 32-way grouped 3×3 convs of twice the width.
///
/// 44,177,704 trainable parameters: timm's `resnext101_32x4d` (model card: 44.2 M, 8.0 GMACs;
/// the same network as Cadene's `pretrainedmodels` port of Xie et al.'s Torch model). The
/// architecture check: the same builder with 32×8d gives torchvision's `resnext101_32x8d`
/// count, 88,791,336 (tested below).
pub fn resnext101_32x4d(batch: u64) -> Result<Graph, GraphError> {
    resnet("resnext101_32x4d", batch, RESNET101_LAYERS, RESNEXT_32X4D)
}

/// Side of [`resnet_tiny`]'s square input.
pub const RESNET_TINY_IMAGE_SIZE: u64 = 16;

/// Classes of [`resnet_tiny`].
pub const RESNET_TINY_CLASSES: u64 = 10;

/// parallax's own CPU CNN, a CIFAR-style ResNet (He et al. 2016, §4.2) shrunk to run in a test:
/// 16×16×3 images, a 3×3 conv of 8 channels with BatchNorm and ReLU, a max pool, two basic
/// blocks (the second doubles the width with stride 2 and a 1×1 projection shortcut), global
/// average pooling and a 10-class fc; every op of the ResNet family (conv with and without
/// stride, BatchNorm, ReLU, max pooling, residual add, global pooling, flatten, fc, loss).
///
/// 5,266 parameters: stem conv 216 + BatchNorm 16; block 1 2 × (576 + 16); block 2
/// 1,152 + 32 + 2,304 + 32 and its projection 128 + 32; fc 160 + 10.
pub fn resnet_tiny(batch: u64) -> Result<Graph, GraphError> {
    let s = RESNET_TINY_IMAGE_SIZE;
    let mut g = GraphBuilder::new("resnet_tiny");
    let images = g.input("images", [batch, 3, s, s], DType::F32);
    let labels = g.input("labels", [batch], DType::I64);
    let x = conv_bn(
        &mut g,
        "conv1",
        "bn1",
        images,
        conv(8, 3, 1, 1),
        Some("relu"),
    )?;
    let mut x = g.op1("maxpool", pool(PoolKind::Max, 2, 2, 0), &[x])?;
    for (i, (planes, stride)) in [(8, 1), (16, 2)].into_iter().enumerate() {
        g.segment(Segment::Block(i as u32));
        let p = format!("layer{}.0", i + 1);
        let inplanes = g.shape(x).0[1];
        let y = conv_bn(
            &mut g,
            &format!("{p}.conv1"),
            &format!("{p}.bn1"),
            x,
            conv(planes, 3, stride, 1),
            Some(&format!("{p}.relu1")),
        )?;
        let y = conv_bn(
            &mut g,
            &format!("{p}.conv2"),
            &format!("{p}.bn2"),
            y,
            conv(planes, 3, 1, 1),
            None,
        )?;
        let shortcut = if stride != 1 || inplanes != planes {
            conv_bn(
                &mut g,
                &format!("{p}.downsample.0"),
                &format!("{p}.downsample.1"),
                x,
                conv(planes, 1, stride, 0),
                None,
            )?
        } else {
            x
        };
        let sum = g.op1(format!("{p}.add"), OpKind::Add, &[y, shortcut])?;
        x = g.activation(&format!("{p}.relu"), Activation::Relu, sum)?;
    }
    g.segment(Segment::Post);
    let x = g.op1("avgpool", OpKind::GlobalAvgPool, &[x])?;
    let x = g.op1("flatten", OpKind::Flatten(AxisAttrs { axis: 1 }), &[x])?;
    let logits = g.linear("fc", x, RESNET_TINY_CLASSES, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

fn resnet(
    name: &str,
    batch: u64,
    layers: [u32; 4],
    card: Cardinality,
) -> Result<Graph, GraphError> {
    let s = RESNET_IMAGE_SIZE;
    let mut g = GraphBuilder::new(name);
    let images = g.input("images", [batch, 3, s, s], DType::F32);
    let labels = g.input("labels", [batch], DType::I64);
    let x = conv_bn(
        &mut g,
        "conv1",
        "bn1",
        images,
        conv(64, 7, 2, 3),
        Some("relu"),
    )?;
    let mut x = g.op1("maxpool", pool(PoolKind::Max, 3, 2, 1), &[x])?;
    let mut block = 0;
    let mut inplanes = 64;
    for (stage, &blocks) in layers.iter().enumerate() {
        let planes = 64 << stage;
        for i in 0..blocks {
            g.segment(Segment::Block(block));
            block += 1;
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            x = bottleneck(
                &mut g,
                &format!("layer{}.{i}", stage + 1),
                x,
                inplanes,
                planes,
                stride,
                card,
            )?;
            inplanes = planes * BOTTLENECK_EXPANSION;
        }
    }
    g.segment(Segment::Post);
    let loss = classifier(&mut g, "", x, labels, None, "loss")?;
    g.finish(&[loss])
}

/// torchvision `Bottleneck`: 1×1 → 3×3 (carrying the stride and the groups) → 1×1 ×4, a
/// projection shortcut where the shape changes, residual add and ReLU.
fn bottleneck(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    inplanes: u64,
    planes: u64,
    stride: u64,
    card: Cardinality,
) -> Result<TensorId, GraphError> {
    let out = planes * BOTTLENECK_EXPANSION;
    let width = planes * card.width_per_group / 64 * card.groups;
    let y = conv_bn(
        g,
        &format!("{p}.conv1"),
        &format!("{p}.bn1"),
        x,
        conv(width, 1, 1, 0),
        Some(&format!("{p}.relu1")),
    )?;
    let y = conv_bn(
        g,
        &format!("{p}.conv2"),
        &format!("{p}.bn2"),
        y,
        Conv2dAttrs {
            groups: card.groups,
            ..conv(width, 3, stride, 1)
        },
        Some(&format!("{p}.relu2")),
    )?;
    let y = conv_bn(
        g,
        &format!("{p}.conv3"),
        &format!("{p}.bn3"),
        y,
        conv(out, 1, 1, 0),
        None,
    )?;
    let identity = if stride != 1 || inplanes != out {
        conv_bn(
            g,
            &format!("{p}.downsample.0"),
            &format!("{p}.downsample.1"),
            x,
            conv(out, 1, stride, 0),
            None,
        )?
    } else {
        x
    };
    let y = g.op1(format!("{p}.add"), OpKind::Add, &[y, identity])?;
    g.activation(&format!("{p}.relu3"), Activation::Relu, y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cnn::tests::{
        assert_every_node_splits_on_batch, assert_linear_in_batch, assert_scalar_outputs,
        assert_valid, fwd_flops,
    };
    use crate::shape::Shape;

    /// Forward FLOPs of the convs and the fc alone, per image (2 per multiply-add).
    fn conv_fc_flops(g: &Graph) -> f64 {
        g.nodes
            .iter()
            .filter(|n| matches!(n.op, OpKind::Conv2d(_) | OpKind::Linear(_)))
            .map(|n| g.node_work(n, 4).fwd_flops.0)
            .sum()
    }

    #[test]
    fn parameter_counts_match_torchvision_and_timm() {
        assert_eq!(resnet50(1).unwrap().param_count(), 25_557_032);
        assert_eq!(resnet101(1).unwrap().param_count(), 44_549_160);
        assert_eq!(resnet152(1).unwrap().param_count(), 60_192_808);
        assert_eq!(resnext101_32x4d(1).unwrap().param_count(), 44_177_704);
        // torchvision resnext101_32x8d: the grouped bottleneck matches torchvision's.
        let x8d = resnet(
            "resnext101_32x8d",
            1,
            RESNET101_LAYERS,
            Cardinality {
                groups: 32,
                width_per_group: 8,
            },
        )
        .unwrap();
        assert_eq!(x8d.param_count(), 88_791_336);
    }

    #[test]
    fn structure_and_segments() {
        let r50 = resnet50(1).unwrap();
        assert_eq!(r50.num_blocks(), 16);
        assert_eq!(resnet101(1).unwrap().num_blocks(), 33);
        let r152 = resnet152(1).unwrap();
        assert_eq!(r152.num_blocks(), 50);
        let rx = resnext101_32x4d(1).unwrap();
        assert_eq!(rx.num_blocks(), 33);
        for g in [&r50, &r152, &rx] {
            assert_scalar_outputs(g);
            assert_valid(g, 1);
            // Segments appear in node order: Pre, Block(0), Block(1), …, Post.
            assert!(g.nodes.windows(2).all(|w| w[0].segment <= w[1].segment));
        }
        let names: Vec<&str> = r50.nodes.iter().map(|n| n.name.as_str()).collect();
        for want in [
            "conv1",
            "layer1.0.conv1",
            "layer4.2.bn3",
            "layer2.0.downsample.0",
            "fc",
        ] {
            assert!(names.contains(&want), "{want}");
        }
        // ResNeXt's layer1 3×3 conv: 128 channels in 32 groups of 4.
        let c2 = rx
            .nodes
            .iter()
            .find(|n| n.name == "layer1.0.conv2")
            .unwrap();
        assert!(matches!(&c2.op, OpKind::Conv2d(a) if a.groups == 32));
        assert_eq!(rx.tensor(c2.inputs[1]).shape, Shape::new([128, 4, 3, 3]));
    }

    #[test]
    fn resnet50_forward_flops_match_the_published_count() {
        // torchvision: 4.09 GMACs per 224×224 image (convs and fc). We count 2 FLOPs per
        // multiply-add, so 8.18 GFLOPs, plus BatchNorm (8 FLOPs per element), ReLU, pooling,
        // residual adds and the loss: ~11 M conv-output elements per image add ~0.13 GFLOPs.
        let g = resnet50(1).unwrap();
        let conv_fc = conv_fc_flops(&g);
        assert!((conv_fc / 2.0 / 4.09e9 - 1.0).abs() < 0.01, "{conv_fc}");
        let f = fwd_flops(&g);
        assert!((8.2e9..8.5e9).contains(&f), "{f}");
    }

    #[test]
    fn resnet101_forward_flops_match_the_published_count() {
        // torchvision: 7.80 GMACs → 15.6 GFLOPs of convs and fc, plus ~0.25 G elementwise.
        let f = fwd_flops(&resnet101(1).unwrap());
        assert!((15.6e9..16.1e9).contains(&f), "{f}");
    }

    #[test]
    fn resnet152_and_resnext_macs_match_the_published_counts() {
        // torchvision ResNet-152: 11.51 GMACs; timm resnext101_32x4d: 8.0 GMACs (rounded to
        // 0.1 G); both count convs and the fc.
        let macs = conv_fc_flops(&resnet152(1).unwrap()) / 2.0;
        assert!((macs / 11.51e9 - 1.0).abs() < 0.01, "{macs}");
        let macs = conv_fc_flops(&resnext101_32x4d(1).unwrap()) / 2.0;
        assert!((7.95e9..8.05e9).contains(&macs), "{macs}");
    }

    #[test]
    fn work_is_linear_in_batch_and_every_node_splits_on_batch() {
        for f in [resnet50, resnet101, resnext101_32x4d] {
            let four = f(4).unwrap();
            assert_linear_in_batch(&f(1).unwrap(), &four);
            assert_valid(&four, 4);
            assert_every_node_splits_on_batch(&four);
        }
    }
}
