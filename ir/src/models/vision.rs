//! Vision transformers as training graphs: ViT-B/16 and ViT-L/16 (Dosovitskiy et al. 2021) as
//! timm's `vit_base_patch16_224` / `vit_large_patch16_224`, and ViT-g/14 (Zhai et al. 2022) as
//! timm's `vit_giant_patch14_224`, all from one builder over (layers, hidden, MLP, heads, patch,
//! image).
//!
//! Node names follow timm's module paths (`patch_embed.proj`, `blocks.3.attn`, `head`), except
//! that timm's fused `attn.qkv` Linear is three Linears `attn.q` / `attn.k` / `attn.v` (same
//! parameters and FLOPs) so that tensor parallelism can split each on its heads.

use crate::dtype::DType;
use crate::graph::{Graph, GraphBuilder, GraphError, Segment, TensorId};
use crate::op::{
    Activation, AttentionAttrs, AxisAttrs, Conv2dAttrs, OpKind, ReshapeAttrs, SplitAttrs,
    TransposeAttrs,
};

/// Dimensions of a ViT classifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct VitConfig {
    image: u64,
    patch: u64,
    hidden: u64,
    layers: u32,
    heads: u64,
    mlp: u64,
    classes: u64,
}

/// Side of the square input of every zoo ViT (the published 224×224 resolution).
pub const VIT_IMAGE_SIZE: u64 = 224;

/// ViT-B/16 (Dosovitskiy et al. 2021, table 1: 12 layers, hidden 768, MLP 3072, 12 heads) at
/// 224×224 with the ImageNet-1k head.
const VIT_B16: VitConfig = VitConfig {
    image: VIT_IMAGE_SIZE,
    patch: 16,
    hidden: 768,
    layers: 12,
    heads: 12,
    mlp: 3072,
    classes: 1000,
};

/// ViT-L/16 (Dosovitskiy et al. 2021, table 1: 24 layers, hidden 1024, MLP 4096, 16 heads) at
/// 224×224 with the ImageNet-1k head.
const VIT_L16: VitConfig = VitConfig {
    image: VIT_IMAGE_SIZE,
    patch: 16,
    hidden: 1024,
    layers: 24,
    heads: 16,
    mlp: 4096,
    classes: 1000,
};

/// ViT-g/14 (Zhai et al. 2022, "Scaling Vision Transformers", table 2: width 1408, depth 40, MLP
/// 6144, 16 heads; timm `vit_giant_patch14_224`: `embed_dim=1408, mlp_ratio=48/11, depth=40,
/// num_heads=16`) at 224×224 (16×16 patches of 14 pixels) with an ImageNet-1k head.
const VIT_G14: VitConfig = VitConfig {
    image: VIT_IMAGE_SIZE,
    patch: 14,
    hidden: 1408,
    layers: 40,
    heads: 16,
    mlp: 6144,
    classes: 1000,
};

/// ViT-Base/16 at 224×224 (timm `vit_base_patch16_224`), built as [`vit_l16`] with 12 blocks
/// of width 768, MLP 3072 and 12 heads.
///
/// 86,567,656 trainable parameters: timm's count for `vit_base_patch16_224` (model card 86.6 M;
/// Dosovitskiy et al. round it to 86M): 12 × 7,087,872 per block + patch embedding 590,592 +
/// class token 768 + position embedding 151,296 + final norm 1,536 + head 769,000. About 17.6
/// GMACs per image forward (timm / fvcore: 17.56).
pub fn vit_b16(batch: u64) -> Result<Graph, GraphError> {
    vit("vit_b16", batch, VIT_B16)
}

/// parallax's own CPU vision transformer, [`vit_b16`]'s architecture shrunk to run in a test:
/// 16×16 images in 4×4 patches (16 patches and the class token), width 32, 2 blocks of 4
/// heads, MLP 64, 10 classes.
///
/// 19,626 parameters: patch embedding 1,568, class token 32, position embedding 544, per
/// block 8,544, final norm 64, head 330.
pub fn vit_tiny(batch: u64) -> Result<Graph, GraphError> {
    vit(
        "vit_tiny",
        batch,
        VitConfig {
            image: 16,
            patch: 4,
            hidden: 32,
            layers: 2,
            heads: 4,
            mlp: 64,
            classes: 10,
        },
    )
}

/// ViT-giant/14 at 224×224, built as [`vit_l16`] with 40 blocks of width 1408, MLP 6144 and 16
/// heads: 257 tokens (256 patches and the class token).
///
/// 1,012,611,432 trainable parameters here; Zhai et al. 2022 (table 2) publish 1011M for
/// ViT-g/14 (the figure is rounded and its head is not spelled out; the paper also replaces the
/// class token by a pooling head). This graph keeps timm's layout: class token and a 1000-class
/// linear head (1.4 M of the total), so attention sees 257 tokens where a pooled model sees 256. About 267 GMACs per image forward: per block and token 4·h² + 2·h·MLP =
/// 25.2 M (259.4 G over 257 tokens and 40 blocks), attention 2·257²·h per block (7.4 G), patch
/// embedding 0.2 G.
pub fn vit_g14(batch: u64) -> Result<Graph, GraphError> {
    vit("vit_g14", batch, VIT_G14)
}

/// ViT-Large/16 at 224×224 (timm `vit_large_patch16_224`): a 16×16 stride-16 patch conv with
/// bias to 196 tokens of width 1024, a class token, a learned position embedding over 197
/// tokens, 24 pre-norm encoder blocks (LayerNorm, q/k/v/out Linears with bias, 16 non-causal
/// fused attention heads, GeLU MLP 4096, residuals), a final LayerNorm and a Linear head on the
/// class token, with a cross-entropy loss against `labels` `[batch]`.
///
/// The class token: our Concat needs equal batch dimensions, so the graph reads a `cls_slot`
/// input `[batch, 1, 1024]` (zeros) and adds the `[1, 1, 1024]` `cls_token` weight to it by
/// broadcasting before concatenating it in front of the patch tokens.
///
/// 304,326,632 trainable parameters: timm's count for `vit_large_patch16_224` (its model card
/// and `sum(p.numel())`): 24 × 12,596,224 per block + patch embedding 787,456 + class token
/// 1,024 + position embedding 201,728 + final norm 2,048 + head 1,025,000. About 61.6 GMACs per
/// image forward (timm / fvcore: 61.6).
pub fn vit_l16(batch: u64) -> Result<Graph, GraphError> {
    vit("vit_l16", batch, VIT_L16)
}

fn vit(name: &str, batch: u64, c: VitConfig) -> Result<Graph, GraphError> {
    let (b, h) = (batch, c.hidden);
    let side = c.image / c.patch;
    let patches = side * side;
    let tokens = patches + 1;
    let mut g = GraphBuilder::new(name);
    let images = g.input("images", [b, 3, c.image, c.image], DType::F32);
    let cls_slot = g.input("cls_slot", [b, 1, h], DType::F32);
    let labels = g.input("labels", [b], DType::I64);

    let x = g.conv2d(
        "patch_embed.proj",
        images,
        Conv2dAttrs {
            out_channels: h,
            kernel: [c.patch, c.patch],
            stride: [c.patch, c.patch],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            bias: true,
        },
    )?;
    let x = g.op1(
        "patch_embed.flatten",
        OpKind::Reshape(ReshapeAttrs {
            shape: vec![b, h, patches],
        }),
        &[x],
    )?;
    let x = g.op1(
        "patch_embed.transpose",
        OpKind::Transpose(TransposeAttrs {
            perm: vec![0, 2, 1],
        }),
        &[x],
    )?;
    let cls_w = g.weight("cls_token", [1, 1, h]);
    let cls = g.op1("cls_token.expand", OpKind::Add, &[cls_slot, cls_w])?;
    let x = g.op1(
        "cls_token.cat",
        OpKind::Concat(AxisAttrs { axis: 1 }),
        &[cls, x],
    )?;
    let pos = g.weight("pos_embed", [1, tokens, h]);
    let mut x = g.op1("pos_embed.add", OpKind::Add, &[x, pos])?;

    for i in 0..c.layers {
        g.segment(Segment::Block(i));
        x = encoder_block(&mut g, &format!("blocks.{i}"), x, b, tokens, c)?;
    }

    g.segment(Segment::Post);
    let x = g.layer_norm("norm", x)?;
    let parts = g.op(
        "cls_pool",
        OpKind::Split(SplitAttrs {
            axis: 1,
            sizes: vec![1, patches],
        }),
        &[x],
    )?;
    let cls = g.op1(
        "cls_pool.squeeze",
        OpKind::Reshape(ReshapeAttrs { shape: vec![b, h] }),
        &[parts[0]],
    )?;
    let logits = g.linear("head", cls, c.classes, true)?;
    let loss = g.op1("loss", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[loss])
}

/// timm `Block`: `x + proj(attn(norm1(x)))`, then `x + fc2(gelu(fc1(norm2(x))))`.
fn encoder_block(
    g: &mut GraphBuilder,
    p: &str,
    x: TensorId,
    b: u64,
    s: u64,
    c: VitConfig,
) -> Result<TensorId, GraphError> {
    let (h, heads) = (c.hidden, c.heads);
    let d = h / heads;
    let a = g.layer_norm(&format!("{p}.norm1"), x)?;
    let mut qkv = Vec::with_capacity(3);
    for which in ["q", "k", "v"] {
        let t = g.linear(&format!("{p}.attn.{which}"), a, h, true)?;
        qkv.push(g.op1(
            format!("{p}.attn.{which}_heads"),
            OpKind::Reshape(ReshapeAttrs {
                shape: vec![b, s, heads, d],
            }),
            &[t],
        )?);
    }
    let o = g.attention(
        &format!("{p}.attn.core"),
        qkv[0],
        qkv[1],
        qkv[2],
        AttentionAttrs {
            causal: false,
            // timm calls F.scaled_dot_product_attention, which dispatches to a fused kernel.
            fused: true,
            dropout: false,
            window: None,
            alibi: false,
        },
    )?;
    let o = g.op1(
        format!("{p}.attn.merge_heads"),
        OpKind::Reshape(ReshapeAttrs {
            shape: vec![b, s, h],
        }),
        &[o],
    )?;
    let o = g.linear(&format!("{p}.attn.proj"), o, h, true)?;
    let x = g.op1(format!("{p}.attn.residual"), OpKind::Add, &[x, o])?;
    let m = g.layer_norm(&format!("{p}.norm2"), x)?;
    let m = g.linear(&format!("{p}.mlp.fc1"), m, c.mlp, true)?;
    let m = g.activation(&format!("{p}.mlp.act"), Activation::Gelu, m)?;
    let m = g.linear(&format!("{p}.mlp.fc2"), m, h, true)?;
    g.op1(format!("{p}.mlp.residual"), OpKind::Add, &[x, m])
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
    fn parameter_count_matches_timm() {
        let g = vit_l16(1).unwrap();
        assert_eq!(g.param_count(), 304_326_632);
        assert_eq!(
            g.params_where(|n| n.segment == Segment::Block(0)),
            12_596_224
        );
        assert_eq!(g.num_blocks(), 24);
    }

    #[test]
    fn structure() {
        let g = vit_l16(2).unwrap();
        assert_scalar_outputs(&g);
        assert_valid(&g, 2);
        let x = g.nodes.iter().find(|n| n.name == "pos_embed.add").unwrap();
        assert_eq!(g.tensor(x.outputs[0]).shape, Shape::new([2, 197, 1024]));
        let head = g.nodes.iter().find(|n| n.name == "head").unwrap();
        assert_eq!(g.input_shapes(head)[0], Shape::new([2, 1024]));
    }

    #[test]
    fn forward_flops_match_the_published_count() {
        // Per image, 197 tokens: 24 blocks × (12·h² linear MACs per token · 197 + 2·197²·h
        // attention MACs) = 24 × (2.479 G + 0.0795 G) = 61.41 G; patch embedding 196·768·1024 =
        // 0.154 G; head 1.0 M; 61.57 GMACs in all (the published 61.6). At 2 FLOPs per MAC that
        // is 123.1 GFLOPs, plus LayerNorm, GeLU, softmax, residuals and biases (~0.5 G).
        let f = fwd_flops(&vit_l16(1).unwrap());
        assert!((123.1e9..124.2e9).contains(&f), "{f}");
    }

    #[test]
    fn base_and_giant_parameter_counts() {
        let b = vit_b16(1).unwrap();
        assert_eq!(b.param_count(), 86_567_656);
        assert_eq!(
            b.params_where(|n| n.segment == Segment::Block(0)),
            7_087_872
        );
        assert_eq!(b.num_blocks(), 12);
        let g = vit_g14(1).unwrap();
        assert_eq!(g.param_count(), 1_012_611_432);
        assert_eq!(g.num_blocks(), 40);
        // Zhai et al. 2022: 1011M.
        assert!((g.param_count() as f64 / 1011e6 - 1.0).abs() < 0.002);
    }

    #[test]
    fn base_and_giant_shapes() {
        let g = vit_g14(2).unwrap();
        assert_scalar_outputs(&g);
        assert_valid(&g, 2);
        let x = g.nodes.iter().find(|n| n.name == "pos_embed.add").unwrap();
        assert_eq!(g.tensor(x.outputs[0]).shape, Shape::new([2, 257, 1408]));
        let fc1 = g
            .nodes
            .iter()
            .find(|n| n.name == "blocks.39.mlp.fc1")
            .unwrap();
        assert_eq!(g.tensor(fc1.outputs[0]).shape, Shape::new([2, 257, 6144]));
        let b = vit_b16(2).unwrap();
        let q = b
            .nodes
            .iter()
            .find(|n| n.name == "blocks.0.attn.q_heads")
            .unwrap();
        assert_eq!(b.tensor(q.outputs[0]).shape, Shape::new([2, 197, 12, 64]));
    }

    #[test]
    fn base_and_giant_forward_flops() {
        // ViT-B/16, 197 tokens: 12 × (12·768²·197 + 2·197²·768) = 12 × (1.394 G + 0.0596 G) =
        // 17.45 G; patch embedding 0.116 G; head 0.8 M: 17.57 GMACs (timm / fvcore: 17.56), so
        // 35.1 GFLOPs plus LayerNorm, GeLU, softmax, residuals and biases (~0.2 G).
        let f = fwd_flops(&vit_b16(1).unwrap());
        assert!((35.1e9..35.5e9).contains(&f), "{f}");
        // ViT-g/14, 257 tokens: 267.0 GMACs (see `vit_g14`) → 534 GFLOPs, plus ~1.5 G of
        // elementwise work (GeLU alone is 8 FLOPs × 257 × 6144 × 40 = 0.5 G).
        let f = fwd_flops(&vit_g14(1).unwrap());
        assert!((534.0e9..536.5e9).contains(&f), "{f}");
    }

    #[test]
    fn work_is_linear_in_batch_and_every_node_splits_on_batch() {
        let four = vit_l16(4).unwrap();
        assert_linear_in_batch(&vit_l16(1).unwrap(), &four);
        assert_every_node_splits_on_batch(&four);
        assert_linear_in_batch(&vit_b16(1).unwrap(), &vit_b16(4).unwrap());
    }
}
