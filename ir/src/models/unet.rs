//! torchgpipe's simplified U-Net as a training graph (`kakaobrain/torchgpipe`,
//! `benchmarks/models/unet`: `unet(depth, num_convs, base_channels, input_channels,
//! output_channels)`), the model of its U-Net (B, C) benchmarks, with long skip connections
//! from each encoder level to the decoder level of the same resolution.
//!
//! The network is an `nn.Sequential` flattened by torchgpipe's `flatten_sequential`; node names
//! are its flattened names (`encoder_0_encode_0_conv`, `bottleneck_0_4_relu`, `decoder_2_up`,
//! `segment`). Each level is a stack of B units "conv 3×3 (no bias) → Dropout2d(0.1) →
//! InstanceNorm2d → LeakyReLU(0.01)"; encoder levels end in a 2×2 max pool, decoder levels
//! start with a nearest ×2 upsampling and the concatenation of the stashed encoder output.
//!
//! Ops the closed op set lacks, built from others (each documented where built):
//! - `InstanceNorm2d` (no affine parameters in torchgpipe's model) is a `BatchNorm`: the same
//!   per-element work, but our BatchNorm owns a scale and shift per channel, 2·C extra
//!   parameters per unit (48,192 in all for (5, 64), 0.02 %).
//! - `LeakyReLU` is a ReLU (one FLOP per element either way).
//! - `Dropout2d` is a `Dropout`; PyTorch's mask is per channel, ours per element (a slight
//!   overestimate of the kept mask).
//! - Nearest ×2 upsampling is a reshape to `[n, c, h, 1, w, 1]`, two self-concatenations
//!   (width, then height) and a reshape to `[n, c, 2h, 2w]`: a copy, no arithmetic.
//! - The loss, `binary_cross_entropy_with_logits` against a `[n, 1, h, w]` target, is a
//!   `CrossEntropy` on the logits viewed as `[n, h, w, 1]` against `labels` `[n, h, w]` (a few
//!   FLOPs per pixel either way).
//!
//! Segments: one `Block` per conv unit (B per level, 11 levels: 55 for B = 5); an encoder
//! level's pool belongs to its last unit, a decoder level's upsampling and concatenation to its
//! first; the final 1×1 conv and the loss are `Post`. A torchgpipe `balance` counts the 241
//! flattened layers (4 per unit, plus `skip` and `down` or `up` and `skip` per level, plus
//! `segment`), so its partition points fall on or within a unit of a block boundary.

use crate::dtype::DType;
use crate::graph::{conv, Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{Activation, AxisAttrs, OpKind, Pool2dAttrs, PoolKind, ReshapeAttrs};

/// Side of the square input of torchgpipe's U-Net speed benchmark (`torch.rand(batch, 3, 192,
/// 192)` in `benchmarks/unet-speed/main.py`).
pub const UNET_IMAGE_SIZE: u64 = 192;

/// Input channels of the benchmark model (`input_channels=3`).
const UNET_IN_CHANNELS: u64 = 3;

/// Output channels of the benchmark model (`output_channels=1`: one logit per pixel).
const UNET_OUT_CHANNELS: u64 = 1;

/// Encoder (and decoder) levels of every torchgpipe U-Net benchmark (`depth=5`).
const UNET_DEPTH: u32 = 5;

/// Convolution units per level, B, of U-Net (5, 64).
const UNET_B5_CONVS: u32 = 5;

/// Base channels, C, of U-Net (5, 64): level i of the encoder has C·2^i channels.
const UNET_C64_CHANNELS: u64 = 64;

/// `Dropout2d(p=0.1)` after every conv, per mille.
const UNET_DROPOUT_PERMILLE: u32 = 100;

/// torchgpipe's U-Net (B=5, C=64) on 3×192×192 inputs with a 1-channel 192×192 output and a
/// per-pixel loss against `labels` `[batch, 192, 192]`: the model of torchgpipe's U-Net speed
/// benchmark.
///
/// 232,687,328 trainable parameters in torchgpipe's model (conv weights only, counted from its
/// code; no count is published for (5, 64)); 232,735,520 here with the BatchNorm stand-ins'
/// scales and shifts. The same builder gives the conv-weight counts torchgpipe publishes for
/// its memory benchmark (`docs/benchmarks.rst`): (6, 72) 362.2M and (11, 128) 2.21B (tested
/// below).
pub fn unet_b5_c64(batch: u64) -> Result<Graph, GraphError> {
    unet("unet_b5_c64", batch, UNET_B5_CONVS, UNET_C64_CHANNELS)
}

/// Channels of one level's stack after its first conv (`mid`) and at its output; its input
/// channels are whatever it is fed.
#[derive(Clone, Copy)]
struct Level {
    mid: u64,
    out: u64,
}

fn unet(name: &str, batch: u64, convs: u32, c: u64) -> Result<Graph, GraphError> {
    let s = UNET_IMAGE_SIZE;
    let depth = UNET_DEPTH;
    let mut g = GraphBuilder::new(name);
    let mut x = g.input("images", [batch, UNET_IN_CHANNELS, s, s], DType::F32);
    let labels = g.input("labels", [batch, s, s], DType::I64);
    let mut block = 0;
    let mut next = |g: &mut GraphBuilder| {
        g.segment(Segment::Block(block));
        block += 1;
    };

    // Encoder: stacks at C·2^i channels, stashed for the decoder, then pooled.
    let mut stashed = Vec::with_capacity(depth as usize);
    for i in 0..depth {
        let level = Level {
            mid: c << i,
            out: c << i,
        };
        x = stack(
            &mut g,
            &format!("encoder_{i}_encode"),
            x,
            level,
            convs,
            &mut next,
            false,
        )?;
        stashed.push(x);
        x = g.op1(
            format!("encoder_{i}_down"),
            OpKind::Pool2d(Pool2dAttrs {
                kind: PoolKind::Max,
                kernel: [2, 2],
                stride: [2, 2],
                padding: [0, 0],
            }),
            &[x],
        )?;
    }

    let bottleneck = Level {
        mid: c << depth,
        out: c << (depth - 1),
    };
    x = stack(
        &mut g,
        "bottleneck_0",
        x,
        bottleneck,
        convs,
        &mut next,
        false,
    )?;

    // Decoder, deepest level first: upsample, concatenate the stash, stack.
    for (k, i) in (0..depth).rev().enumerate() {
        next(&mut g);
        let p = format!("decoder_{k}");
        let up = upsample(&mut g, &format!("{p}_up"), x)?;
        let cat = g.op1(
            format!("{p}_skip"),
            OpKind::Concat(AxisAttrs { axis: 1 }),
            &[up, stashed[i as usize]],
        )?;
        // torchgpipe: `int(base_channels * 2 ** (i - 1))` (C/2 at level 0).
        let width = (c << (i + 1)) / 4;
        let level = Level {
            mid: width,
            out: width,
        };
        x = stack(
            &mut g,
            &format!("{p}_decode"),
            cat,
            level,
            convs,
            &mut next,
            true,
        )?;
    }

    g.segment(Segment::Post);
    let y = g.conv2d("segment", x, conv(UNET_OUT_CHANNELS, 1, 1, 0))?;
    // binary_cross_entropy_with_logits, as a cross-entropy over the pixel's single logit.
    let y = g.op1(
        "loss.view",
        OpKind::Reshape(ReshapeAttrs {
            shape: vec![batch, s, s, UNET_OUT_CHANNELS],
        }),
        &[y],
    )?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[y, labels])?;
    g.finish(&[loss])
}

/// `stacked_convs`: `convs` units `{p}_{j}_{conv,dropout,norm,relu}`, the first to `mid`
/// channels, the last to `out`. `next` opens each unit's segment, except the first unit's when
/// the caller has opened it (`first_opened`: a decoder level's upsampling belongs to it).
fn stack(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    level: Level,
    convs: u32,
    next: &mut dyn FnMut(&mut GraphBuilder),
    first_opened: bool,
) -> Result<TensorId, GraphError> {
    let mut x = x;
    for j in 0..convs {
        let out = if j + 1 == convs { level.out } else { level.mid };
        if j > 0 || !first_opened {
            next(g);
        }
        let u = format!("{p}_{j}");
        x = g.conv2d(&format!("{u}_conv"), x, conv(out, 3, 1, 1))?;
        x = g.dropout(&format!("{u}_dropout"), x, UNET_DROPOUT_PERMILLE)?;
        // InstanceNorm2d, as a BatchNorm (see the module docs).
        x = g.batch_norm(&format!("{u}_norm"), x)?;
        // LeakyReLU(0.01), as a ReLU.
        x = g.activation(&format!("{u}_relu"), Activation::Relu, x)?;
    }
    Ok(x)
}

/// Nearest-neighbour ×2 upsampling of `[n, c, h, w]` from views and self-concatenations.
fn upsample(g: &mut GraphBuilder, p: &str, x: TensorId) -> Result<TensorId, GraphError> {
    let d = g.shape(x).0.clone();
    let (n, c, h, w) = (d[0], d[1], d[2], d[3]);
    let v = g.op1(
        format!("{p}.view"),
        OpKind::Reshape(ReshapeAttrs {
            shape: vec![n, c, h, 1, w, 1],
        }),
        &[x],
    )?;
    let v = g.op1(
        format!("{p}.repeat_w"),
        OpKind::Concat(AxisAttrs { axis: 5 }),
        &[v, v],
    )?;
    let v = g.op1(
        format!("{p}.repeat_h"),
        OpKind::Concat(AxisAttrs { axis: 3 }),
        &[v, v],
    )?;
    g.op1(
        p,
        OpKind::Reshape(ReshapeAttrs {
            shape: vec![n, c, 2 * h, 2 * w],
        }),
        &[v],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cnn::tests::{
        assert_every_node_splits_on_batch, assert_linear_in_batch, assert_scalar_outputs,
        assert_valid,
    };
    use crate::shape::Shape;

    /// Conv weights: torchgpipe's model has no other parameters.
    fn conv_params(g: &Graph) -> u64 {
        g.params_where(|n| matches!(n.op, OpKind::Conv2d(_)))
    }

    #[test]
    fn parameter_counts_match_torchgpipe() {
        let g = unet_b5_c64(1).unwrap();
        assert_eq!(conv_params(&g), 232_687_328);
        assert_eq!(g.param_count(), 232_735_520);
        // torchgpipe docs/benchmarks.rst, U-Net (B, C) memory benchmark: 362.2M and 2.21B.
        let b6 = conv_params(&unet("u", 1, 6, 72).unwrap());
        assert_eq!(b6, 362_157_516);
        let b11 = conv_params(&unet("u", 1, 11, 128).unwrap());
        assert!((b11 as f64 / 2.21e9 - 1.0).abs() < 0.005 / 2.21, "{b11}");
    }

    #[test]
    fn shapes_skips_and_segments() {
        let g = unet_b5_c64(2).unwrap();
        assert_scalar_outputs(&g);
        assert_valid(&g, 2);
        assert_eq!(g.num_blocks(), 55);
        assert!(g.nodes.windows(2).all(|w| w[0].segment <= w[1].segment));
        let out = |name: &str| {
            let n = g.nodes.iter().find(|n| n.name == name).unwrap();
            g.tensor(n.outputs[0]).shape.clone()
        };
        assert_eq!(
            out("encoder_0_encode_4_relu"),
            Shape::new([2, 64, 192, 192])
        );
        assert_eq!(out("encoder_4_down"), Shape::new([2, 1024, 6, 6]));
        assert_eq!(out("bottleneck_0_0_conv"), Shape::new([2, 2048, 6, 6]));
        assert_eq!(out("decoder_0_up"), Shape::new([2, 1024, 12, 12]));
        assert_eq!(out("decoder_0_skip"), Shape::new([2, 2048, 12, 12]));
        assert_eq!(out("decoder_4_skip"), Shape::new([2, 128, 192, 192]));
        assert_eq!(
            out("decoder_4_decode_4_relu"),
            Shape::new([2, 32, 192, 192])
        );
        assert_eq!(out("segment"), Shape::new([2, 1, 192, 192]));
        // The upsampling is a copy: no FLOPs.
        let up: f64 = g
            .nodes
            .iter()
            .filter(|n| n.name.starts_with("decoder_0_up"))
            .map(|n| g.node_work(n, 4).fwd_flops.0)
            .sum();
        assert_eq!(up, 0.0);
    }

    #[test]
    fn batch_scaling_and_splits() {
        let four = unet_b5_c64(4).unwrap();
        assert_linear_in_batch(&unet_b5_c64(1).unwrap(), &four);
        assert_every_node_splits_on_batch(&four);
    }
}
