//! The plain convolutional classifiers as training graphs: torchvision's AlexNet and VGG-16.
//!
//! Node names are torchvision's module paths (`features.0`, `classifier.6`): both models are an
//! `nn.Sequential` of `features`, an adaptive average pool and an `nn.Sequential` classifier.
//! Every graph reads NCHW `images` and int64 `labels` `[batch]` and ends in a scalar
//! cross-entropy loss. The first conv (with its ReLU and, for AlexNet, its pool) is
//! `Segment::Pre`; every later conv and every hidden fc layer is one `Segment::Block`; the last
//! fc and the loss are `Segment::Post`.
//!
//! Both classifiers start with `AdaptiveAvgPool2d` to a fixed grid (6×6 for AlexNet, 7×7 for
//! VGG). At the published 224×224 input the feature maps already have that size, so the pool is
//! the identity and is left out; at 224 it costs nothing in PyTorch either (it returns a copy).

use super::cnn::{pool, IMAGENET_CLASSES};
use crate::dtype::DType;
use crate::graph::{conv, Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{Activation, AxisAttrs, Conv2dAttrs, OpKind, PoolKind};

/// Side of the square input of AlexNet and VGG-16: torchvision's training crop, and the
/// size its weights tables report FLOPs at. (tf_cnn_benchmarks feeds AlexNet 227×227; the
/// adaptive pool makes the torchvision network accept either, at slightly different FLOPs.)
pub const CLASSIC_IMAGE_SIZE: u64 = 224;

/// Dropout before each hidden fc layer (torchvision `AlexNet(dropout=0.5)`, `VGG(dropout=0.5)`),
/// per mille.
const CLASSIFIER_DROPOUT_PERMILLE: u32 = 500;

/// Width of the two hidden fc layers of AlexNet and VGG.
const FC_WIDTH: u64 = 4096;

/// One AlexNet conv: output channels, kernel, stride, padding, and whether a 3×3 stride-2 max
/// pool follows (Krizhevsky 2014's "one weird trick" variant, as torchvision builds it).
const ALEXNET_CONVS: [(u64, u64, u64, u64, bool); 5] = [
    (64, 11, 4, 2, true),
    (192, 5, 1, 2, true),
    (384, 3, 1, 1, false),
    (256, 3, 1, 1, false),
    (256, 3, 1, 1, true),
];

/// VGG-16 ("configuration D", Simonyan & Zisserman 2015, table 1): 3×3 convs per stage, each
/// stage ending in a 2×2 max pool.
const VGG16_STAGES: [(u64, u32); 5] = [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)];

/// torchvision AlexNet on 224×224×3 images, 1000 classes: five convs with bias and ReLU (max
/// pools after the first, second and fifth), then dropout → fc 9216→4096 → ReLU → dropout → fc
/// 4096→4096 → ReLU → fc 4096→1000, and a cross-entropy loss against `labels` `[batch]`.
/// torchvision's AlexNet has no local response normalization (unlike Krizhevsky et al. 2012),
/// and neither does this graph.
///
/// 61,100,840 trainable parameters: torchvision's `alexnet()` count (`AlexNet_Weights`
/// table). About 0.71 GMACs per image forward (torchvision: 0.71 "GFLOPS").
pub fn alexnet(batch: u64) -> Result<Graph, GraphError> {
    alexnet_with("alexnet", batch, CLASSIC_IMAGE_SIZE, &ALEXNET_CONVS)
}

/// tf_cnn_benchmarks' AlexNet (`models/alexnet_model.py`, the model of TensorFlow's 2017
/// benchmarks page): 227×227×3 images, a VALID 11×11 stride-4 first conv, and 384 filters in
/// the fourth conv where torchvision has 256 (Krizhevsky 2014's layer widths); otherwise
/// torchvision's network. 0.84 GMACs per image forward against torchvision's 0.71.
///
/// 61,838,248 trainable parameters, counted from the layer list (convs 3,207,104 with
/// biases; fc 58,631,144).
pub fn alexnet_tf(batch: u64) -> Result<Graph, GraphError> {
    alexnet_with("alexnet-tf", batch, 227, &ALEXNET_TF_CONVS)
}

/// tf_cnn_benchmarks `AlexnetModel.add_inference`: conv(64, 11, 11, 4, 4, 'VALID'), mpool,
/// conv(192, 5, 5), mpool, conv(384, 3, 3), conv(384, 3, 3), conv(256, 3, 3), mpool (SAME
/// padding unless stated).
const ALEXNET_TF_CONVS: [(u64, u64, u64, u64, bool); 5] = [
    (64, 11, 4, 0, true),
    (192, 5, 1, 2, true),
    (384, 3, 1, 1, false),
    (384, 3, 1, 1, false),
    (256, 3, 1, 1, true),
];

fn alexnet_with(
    name: &str,
    batch: u64,
    s: u64,
    convs: &[(u64, u64, u64, u64, bool)],
) -> Result<Graph, GraphError> {
    let mut g = GraphBuilder::new(name);
    let mut x = g.input("images", [batch, 3, s, s], DType::F32);
    let labels = g.input("labels", [batch], DType::I64);
    // torchvision's `features` indices: conv, relu[, maxpool] per layer.
    let mut index = 0;
    for (i, &(out, kernel, stride, padding, pooled)) in convs.iter().enumerate() {
        if i > 0 {
            g.segment(Segment::Block(i as u32 - 1));
        }
        x = conv_relu(
            &mut g,
            index,
            x,
            conv_with_bias(out, kernel, stride, padding),
        )?;
        index += 2;
        if pooled {
            x = g.op1(
                format!("features.{index}"),
                pool(PoolKind::Max, 3, 2, 0),
                &[x],
            )?;
            index += 1;
        }
    }
    let x = g.op1("flatten", OpKind::Flatten(AxisAttrs { axis: 1 }), &[x])?;
    // classifier: 0 dropout, 1 fc, 2 relu, 3 dropout, 4 fc, 5 relu, 6 fc.
    let blocks = convs.len() as u32 - 1;
    g.segment(Segment::Block(blocks));
    let x = g.dropout("classifier.0", x, CLASSIFIER_DROPOUT_PERMILLE)?;
    let x = fc_relu(&mut g, "classifier.1", "classifier.2", x)?;
    g.segment(Segment::Block(blocks + 1));
    let x = g.dropout("classifier.3", x, CLASSIFIER_DROPOUT_PERMILLE)?;
    let x = fc_relu(&mut g, "classifier.4", "classifier.5", x)?;
    g.segment(Segment::Post);
    let logits = g.linear("classifier.6", x, IMAGENET_CLASSES, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

/// torchvision VGG-16 (configuration D, no BatchNorm) on 224×224×3 images, 1000 classes: 13
/// 3×3 convs with bias and ReLU in five stages, each followed by a 2×2 max pool, then fc
/// 25088→4096 → ReLU → dropout → fc 4096→4096 → ReLU → dropout → fc 4096→1000, and a
/// cross-entropy loss against `labels` `[batch]`.
///
/// 138,357,544 trainable parameters: torchvision's `vgg16()` count (`VGG16_Weights` table).
/// About 15.5 GMACs per image forward (torchvision: 15.47 "GFLOPS").
pub fn vgg16(batch: u64) -> Result<Graph, GraphError> {
    let s = CLASSIC_IMAGE_SIZE;
    let mut g = GraphBuilder::new("vgg16");
    let mut x = g.input("images", [batch, 3, s, s], DType::F32);
    let labels = g.input("labels", [batch], DType::I64);
    let mut index = 0;
    let mut layer = 0u32;
    for &(out, convs) in &VGG16_STAGES {
        for _ in 0..convs {
            if layer > 0 {
                g.segment(Segment::Block(layer - 1));
            }
            layer += 1;
            x = conv_relu(&mut g, index, x, conv_with_bias(out, 3, 1, 1))?;
            index += 2;
        }
        x = g.op1(
            format!("features.{index}"),
            pool(PoolKind::Max, 2, 2, 0),
            &[x],
        )?;
        index += 1;
    }
    let x = g.op1("flatten", OpKind::Flatten(AxisAttrs { axis: 1 }), &[x])?;
    // classifier: 0 fc, 1 relu, 2 dropout, 3 fc, 4 relu, 5 dropout, 6 fc.
    g.segment(Segment::Block(layer - 1));
    let x = fc_relu(&mut g, "classifier.0", "classifier.1", x)?;
    let x = g.dropout("classifier.2", x, CLASSIFIER_DROPOUT_PERMILLE)?;
    g.segment(Segment::Block(layer));
    let x = fc_relu(&mut g, "classifier.3", "classifier.4", x)?;
    let x = g.dropout("classifier.5", x, CLASSIFIER_DROPOUT_PERMILLE)?;
    g.segment(Segment::Post);
    let logits = g.linear("classifier.6", x, IMAGENET_CLASSES, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

/// A square conv with a bias (both torchvision models keep their conv biases).
fn conv_with_bias(out: u64, kernel: u64, stride: u64, padding: u64) -> Conv2dAttrs {
    Conv2dAttrs {
        bias: true,
        ..conv(out, kernel, stride, padding)
    }
}

/// `features.{index}` conv and `features.{index + 1}` ReLU.
fn conv_relu(
    g: &mut GraphBuilder,
    index: u32,
    x: TensorId,
    attrs: Conv2dAttrs,
) -> Result<TensorId, GraphError> {
    let y = g.conv2d(&format!("features.{index}"), x, attrs)?;
    g.activation(&format!("features.{}", index + 1), Activation::Relu, y)
}

/// A 4096-wide fc layer with bias and its ReLU.
fn fc_relu(
    g: &mut GraphBuilder,
    fc: &str,
    relu: &str,
    x: TensorId,
) -> Result<TensorId, GraphError> {
    let y = g.linear(fc, x, FC_WIDTH, true)?;
    g.activation(relu, Activation::Relu, y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cnn::tests::{
        assert_every_node_splits_on_batch, assert_linear_in_batch, assert_scalar_outputs,
        assert_valid,
    };
    use crate::shape::Shape;

    /// Multiply-adds of the convs and fc layers per image (what torchvision's tables count).
    fn macs(g: &Graph) -> f64 {
        g.nodes
            .iter()
            .filter(|n| matches!(n.op, OpKind::Conv2d(_) | OpKind::Linear(_)))
            .map(|n| g.node_work(n, 4).fwd_flops.0)
            .sum::<f64>()
            / 2.0
    }

    #[test]
    fn parameter_counts_match_torchvision() {
        assert_eq!(alexnet(1).unwrap().param_count(), 61_100_840);
        assert_eq!(vgg16(1).unwrap().param_count(), 138_357_544);
    }

    #[test]
    fn macs_match_torchvision() {
        // torchvision's weights tables: AlexNet 0.71, VGG-16 15.47 GMACs (labelled GFLOPS).
        // Biases add one FLOP per output element (half a MAC here), well under 0.5 %.
        let a = macs(&alexnet(1).unwrap());
        assert!((a / 0.71e9 - 1.0).abs() < 0.01, "{a}");
        let v = macs(&vgg16(1).unwrap());
        assert!((v / 15.47e9 - 1.0).abs() < 0.005, "{v}");
    }

    #[test]
    fn structure_names_and_segments() {
        let a = alexnet(2).unwrap();
        let v = vgg16(2).unwrap();
        // AlexNet: convs 2–5 and the two hidden fc layers; VGG: convs 2–13 and two fc layers.
        assert_eq!(a.num_blocks(), 6);
        assert_eq!(v.num_blocks(), 14);
        for g in [&a, &v] {
            assert_scalar_outputs(g);
            assert_valid(g, 2);
            assert!(g.nodes.windows(2).all(|w| w[0].segment <= w[1].segment));
        }
        let shape_of = |g: &Graph, name: &str| {
            let n = g.nodes.iter().find(|n| n.name == name).unwrap();
            g.tensor(n.outputs[0]).shape.clone()
        };
        // torchvision's indices: AlexNet's last pool is features.12, VGG-16's features.30.
        assert_eq!(shape_of(&a, "features.12"), Shape::new([2, 256, 6, 6]));
        assert_eq!(shape_of(&v, "features.30"), Shape::new([2, 512, 7, 7]));
        assert_eq!(shape_of(&a, "classifier.6"), Shape::new([2, 1000]));
        assert_eq!(shape_of(&v, "classifier.0"), Shape::new([2, 4096]));
    }

    #[test]
    fn work_is_linear_in_batch_and_every_node_splits_on_batch() {
        for f in [alexnet, vgg16] {
            let four = f(4).unwrap();
            assert_linear_in_batch(&f(1).unwrap(), &four);
            assert_every_node_splits_on_batch(&four);
        }
    }
}
