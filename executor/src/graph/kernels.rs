//! fp32 forward and backward kernels of the general-graph trainer, one per op of the IR that
//! CNNs and RNNs use. Every kernel works on a *region*: the box of global element indices a
//! device holds of each input (what the per-op plan gives it, convolution and pooling inputs
//! widened to the receptive field of the output region) and computes the region of each output
//! the plan gives it. The same kernel at the full region is single-device training, so the
//! equivalence of any plan with one device is a property of the data movement alone.
//!
//! Conventions (PyTorch's, so a user's model means the same thing): NCHW, convolution zero
//! padding, max pooling ignores padding, average pooling counts it (`count_include_pad=True`),
//! batch normalisation in training mode with biased variance and eps 1e-5, LSTM gates
//! `(i, f, g, o)` and GRU gates `(r, z, n)` with one bias per layer (the IR's), mean
//! cross-entropy over every label of the (micro-)batch. Where a split label is reduced inside an
//! op — batch statistics over a sample split (synchronised BatchNorm), the softmax of a
//! cross-entropy over a vocabulary split — the kernel reduces over its group through
//! [`Ctx::reduce`]; every other split needs no communication inside the op.

use super::Local;
use crate::comm::CommError;
pub(crate) use crate::rng::mix;
use crate::tensor::{gelu, gelu_grad, mm, mm_nt, mm_tn, sigmoid};
use parallax_cost::soap::Region;
use parallax_ir::op::{Activation, AttentionAttrs, Conv2dAttrs, PoolKind};
use parallax_ir::{OpKind, Shape};

/// BatchNorm epsilon (PyTorch's default).
pub const BN_EPS: f32 = 1e-5;
/// LayerNorm / RMSNorm epsilon.
pub const NORM_EPS: f32 = 1e-5;

/// A reduction over an op's group of devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
}

/// An all-reduce over the devices an op reduces a split label over.
pub type ReduceFn<'a> = dyn FnMut(&mut [f32], Reduce) -> Result<(), CommError> + 'a;

/// The input, scale and shift gradients of a BatchNorm.
type BnGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// What a kernel knows besides its inputs.
pub struct Ctx<'a> {
    pub op: &'a OpKind,
    /// Full shapes of the inputs and outputs (at the micro-batch).
    pub ins_full: &'a [Shape],
    pub outs_full: &'a [Shape],
    /// The region of each output this device computes.
    pub out_regions: &'a [Region],
    /// This device's coordinate and the degree of a split label (`(0, 1)` when unsplit).
    pub coord: &'a dyn Fn(char) -> (u32, u32),
    /// Mixes into dropout masks (seed, step, micro-batch, node).
    pub key: u64,
    /// Reduces a buffer over the devices that split the labels this op reduces inside
    /// (identity when they are not split).
    pub reduce: &'a mut ReduceFn<'a>,
    /// BatchNorm takes the statistics of this device's samples only (the plan's
    /// `batch_norm: local`); otherwise those of the whole micro-batch.
    pub local_stats: bool,
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("op", &self.op.name())
            .field("out_regions", &self.out_regions)
            .finish_non_exhaustive()
    }
}

/// What a forward pass keeps for its backward, besides its inputs.
#[derive(Debug, Default)]
pub struct Saved {
    pub f: Vec<Vec<f32>>,
    pub idx: Vec<u32>,
}

/// Sizes of a region.
pub fn dims(r: &Region) -> Vec<usize> {
    r.iter().map(|(a, b)| (b - a) as usize).collect()
}

/// Elements of a region.
pub fn elems(r: &Region) -> usize {
    r.iter().map(|(a, b)| (b - a) as usize).product()
}

fn lo(r: &Region, d: usize) -> usize {
    r[d].0 as usize
}

/// Whether this kernel can run `op`.
pub fn supported(op: &OpKind, ins: &[parallax_ir::Shape]) -> Result<(), String> {
    match op {
        OpKind::Moe(_) | OpKind::SwiGlu | OpKind::Rope | OpKind::Ssd(_) => Err(format!(
            "the general-graph executor has no kernel for op '{}' yet (transformers run on the transformer trainer)",
            op.name()
        )),
        OpKind::Attention(a) if a.window.is_some() => Err(
            "sliding-window attention has no kernel in the general-graph executor yet".into(),
        ),
        OpKind::Attention(_) if ins.len() == 3 && ins[2].last() != ins[0].last() => Err(
            "attention whose values have their own head size (latent attention) has no kernel in the general-graph executor yet".into(),
        ),
        _ => Ok(()),
    }
}

/// Forward of one op: the output regions' values and what the backward needs.
pub fn forward(ctx: &mut Ctx<'_>, ins: &[&Local]) -> Result<(Vec<Vec<f32>>, Saved), CommError> {
    let mut saved = Saved::default();
    let out0 = ctx.out_regions.first().map(elems).unwrap_or(0);
    let outs = match ctx.op {
        OpKind::Conv2d(a) => vec![conv_fwd(ctx, a, ins)],
        OpKind::Pool2d(a) => {
            let (y, idx) = pool_fwd(ctx, a.kind, a.kernel, a.stride, a.padding, ins[0]);
            saved.idx = idx;
            vec![y]
        }
        OpKind::GlobalAvgPool => {
            let d = dims(&ins[0].region);
            let hw_full = (ctx.ins_full[0].0[2] * ctx.ins_full[0].0[3]) as f32;
            let hw = d[2] * d[3];
            let y = ins[0]
                .data
                .chunks_exact(hw.max(1))
                .map(|c| c.iter().sum::<f32>() / hw_full)
                .collect::<Vec<_>>();
            vec![if hw == 0 { vec![0.0; out0] } else { y }]
        }
        OpKind::BatchNorm => {
            let (y, mean_rstd) = bn_fwd(ctx, ins)?;
            saved.f.push(mean_rstd);
            vec![y]
        }
        OpKind::Linear(a) => {
            let (rows, k, n) = mat_dims(ins[0], ins[1], false);
            let mut y = vec![0.0; rows * n];
            mm(&mut y, &ins[0].data, &ins[1].data, rows, k, n, false);
            if a.bias && (ctx.coord)('k').0 == 0 {
                crate::tensor::add_bias(&mut y, &ins[2].data);
            }
            vec![y]
        }
        OpKind::MatMul(a) => vec![matmul_fwd(ins, a.transpose_b)],
        OpKind::Embedding(_) => {
            let t = &ins[1];
            let (v0, v1) = t.region[0];
            let d = (t.region[1].1 - t.region[1].0) as usize;
            let mut y = vec![0.0; ins[0].data.len() * d];
            for (row, id) in y.chunks_exact_mut(d.max(1)).zip(&ins[0].data) {
                let id = *id as u64;
                if (v0..v1).contains(&id) {
                    let r = (id - v0) as usize;
                    row.copy_from_slice(&t.data[r * d..(r + 1) * d]);
                }
            }
            vec![y]
        }
        OpKind::Activation(a) => vec![ins[0].data.iter().map(|x| act(a.kind, *x)).collect()],
        OpKind::Add | OpKind::Mul => vec![broadcast_fwd(ctx, ins)],
        OpKind::Softmax(a) => {
            let (outer, n, inner) = axis_split(&ins[0].region, a.axis);
            let mut y = ins[0].data.clone();
            softmax_inplace(&mut y, outer, n, inner);
            saved.f.push(y.clone());
            vec![y]
        }
        OpKind::Dropout(a) => {
            let keep = dropout_mask(ctx, a.rate_permille, &ctx.out_regions[0]);
            vec![ins[0].data.iter().zip(&keep).map(|(x, k)| x * k).collect()]
        }
        OpKind::CrossEntropy => {
            let (loss, probs) = ce_fwd(ctx, ins)?;
            saved.f.push(probs);
            vec![vec![loss]]
        }
        OpKind::Concat(a) => {
            let r = ins[0].region.len();
            let ax = norm_axis(a.axis, r);
            let (outer, _, inner) = axis_split(&ins[0].region, ax as i64);
            let mut y = Vec::with_capacity(out0);
            for o in 0..outer {
                for x in ins {
                    let n = dims(&x.region)[ax] * inner;
                    y.extend_from_slice(&x.data[o * n..(o + 1) * n]);
                }
            }
            vec![y]
        }
        OpKind::Split(a) => {
            let r = ins[0].region.len();
            let ax = norm_axis(a.axis, r);
            let (outer, total, inner) = axis_split(&ins[0].region, ax as i64);
            let sizes: Vec<usize> = ctx.out_regions.iter().map(|r| dims(r)[ax]).collect();
            let mut outs: Vec<Vec<f32>> = sizes
                .iter()
                .map(|s| Vec::with_capacity(outer * s * inner))
                .collect();
            for o in 0..outer {
                let mut off = o * total * inner;
                for (y, s) in outs.iter_mut().zip(&sizes) {
                    y.extend_from_slice(&ins[0].data[off..off + s * inner]);
                    off += s * inner;
                }
            }
            outs
        }
        OpKind::Reshape(_) | OpKind::Flatten(_) => vec![ins[0].data.clone()],
        OpKind::Transpose(a) => vec![transpose(
            &ins[0].data,
            &dims(&ins[0].region),
            &a.perm,
            false,
        )],
        OpKind::Lstm(a) => {
            let (y, s) = lstm_fwd(ins, a.hidden as usize);
            saved = s;
            vec![y]
        }
        OpKind::Gru(a) => {
            let (y, s) = gru_fwd(ins, a.hidden as usize);
            saved = s;
            vec![y]
        }
        OpKind::LayerNorm | OpKind::RmsNorm => {
            let rms = matches!(ctx.op, OpKind::RmsNorm);
            let (y, stats) = norm_fwd(ins, rms);
            saved.f.push(stats);
            vec![y]
        }
        OpKind::Attention(a) => {
            let (y, probs) = attention_fwd(ctx, a, ins);
            saved.f.push(probs);
            vec![y]
        }
        OpKind::Moe(_) | OpKind::SwiGlu | OpKind::Rope | OpKind::Ssd(_) => {
            return Err(CommError::Backend(supported(ctx.op, &[]).unwrap_err()))
        }
    };
    Ok((outs, saved))
}

/// Backward of one op: the gradient of each input region (`None` for inputs that take none:
/// integer ids and labels, or where `need` is false).
pub fn backward(
    ctx: &mut Ctx<'_>,
    ins: &[&Local],
    saved: &Saved,
    dys: &[Vec<f32>],
    need: &[bool],
) -> Result<Vec<Option<Vec<f32>>>, CommError> {
    let mut g: Vec<Option<Vec<f32>>> = vec![None; ins.len()];
    let dy = &dys[0];
    match ctx.op {
        OpKind::Conv2d(a) => {
            let (dx, dw, db) = conv_bwd(ctx, a, ins, dy, need[0]);
            g[0] = dx;
            g[1] = Some(dw);
            if ins.len() > 2 {
                g[2] = Some(db);
            }
        }
        OpKind::Pool2d(a) => {
            g[0] = Some(pool_bwd(
                ctx, a.kind, a.kernel, a.stride, a.padding, ins[0], saved, dy,
            ));
        }
        OpKind::GlobalAvgPool => {
            let d = dims(&ins[0].region);
            let hw = d[2] * d[3];
            let hw_full = (ctx.ins_full[0].0[2] * ctx.ins_full[0].0[3]) as f32;
            let mut dx = vec![0.0; ins[0].data.len()];
            if hw > 0 {
                for (c, gy) in dx.chunks_exact_mut(hw).zip(dy) {
                    c.fill(gy / hw_full);
                }
            }
            g[0] = Some(dx);
        }
        OpKind::BatchNorm => {
            let (dx, dgamma, dbeta) = bn_bwd(ctx, ins, &saved.f[0], dy)?;
            g[0] = Some(dx);
            g[1] = Some(dgamma);
            g[2] = Some(dbeta);
        }
        OpKind::Linear(a) => {
            let (rows, k, n) = mat_dims(ins[0], ins[1], false);
            if need[0] {
                let mut dx = vec![0.0; rows * k];
                mm_nt(&mut dx, dy, &ins[1].data, rows, k, n, false);
                g[0] = Some(dx);
            }
            let mut dw = vec![0.0; k * n];
            mm_tn(&mut dw, &ins[0].data, dy, rows, k, n, false);
            g[1] = Some(dw);
            if a.bias {
                let mut db = vec![0.0; n];
                if (ctx.coord)('k').0 == 0 {
                    crate::tensor::bias_grad(&mut db, dy);
                }
                g[2] = Some(db);
            }
        }
        OpKind::MatMul(a) => {
            let (da, db) = matmul_bwd(ins, a.transpose_b, dy);
            g[0] = need[0].then_some(da);
            g[1] = Some(db);
        }
        OpKind::Embedding(_) => {
            let t = &ins[1];
            let (v0, v1) = t.region[0];
            let d = (t.region[1].1 - t.region[1].0) as usize;
            let mut dt = vec![0.0; t.data.len()];
            for (row, id) in dy.chunks_exact(d.max(1)).zip(&ins[0].data) {
                let id = *id as u64;
                if (v0..v1).contains(&id) {
                    let r = (id - v0) as usize;
                    for (a, b) in dt[r * d..(r + 1) * d].iter_mut().zip(row) {
                        *a += b;
                    }
                }
            }
            g[1] = Some(dt);
        }
        OpKind::Activation(a) => {
            g[0] = Some(
                ins[0]
                    .data
                    .iter()
                    .zip(dy)
                    .map(|(x, d)| d * act_grad(a.kind, *x))
                    .collect(),
            );
        }
        OpKind::Add | OpKind::Mul => return Ok(broadcast_bwd(ctx, ins, dy)),
        OpKind::Softmax(a) => {
            let y = &saved.f[0];
            let (outer, n, inner) = axis_split(&ins[0].region, a.axis);
            let mut dx = vec![0.0; y.len()];
            for o in 0..outer {
                for i in 0..inner {
                    let at = |j: usize| (o * n + j) * inner + i;
                    let dot: f32 = (0..n).map(|j| y[at(j)] * dy[at(j)]).sum();
                    for j in 0..n {
                        dx[at(j)] = y[at(j)] * (dy[at(j)] - dot);
                    }
                }
            }
            g[0] = Some(dx);
        }
        OpKind::Dropout(a) => {
            let keep = dropout_mask(ctx, a.rate_permille, &ctx.out_regions[0]);
            g[0] = Some(dy.iter().zip(&keep).map(|(d, k)| d * k).collect());
        }
        OpKind::CrossEntropy => {
            let n_full = ctx.ins_full[1].elems() as f32;
            let scale = dy[0] / n_full;
            let mut dl = saved.f[0].clone();
            let (v0, v1) = ins[0].region.last().copied().unwrap_or((0, 1));
            let vl = (v1 - v0) as usize;
            for (row, t) in dl.chunks_exact_mut(vl.max(1)).zip(&ins[1].data) {
                let t = *t as u64;
                if (v0..v1).contains(&t) {
                    row[(t - v0) as usize] -= 1.0;
                }
                for v in row.iter_mut() {
                    *v *= scale;
                }
            }
            g[0] = Some(dl);
        }
        OpKind::Concat(a) => {
            let ax = norm_axis(a.axis, ins[0].region.len());
            let (outer, _, inner) = axis_split(&ins[0].region, ax as i64);
            let mut parts: Vec<Vec<f32>> = ins
                .iter()
                .map(|x| Vec::with_capacity(x.data.len()))
                .collect();
            let mut off = 0;
            for _ in 0..outer {
                for (p, x) in parts.iter_mut().zip(ins) {
                    let n = dims(&x.region)[ax] * inner;
                    p.extend_from_slice(&dy[off..off + n]);
                    off += n;
                }
            }
            return Ok(parts.into_iter().map(Some).collect());
        }
        OpKind::Split(a) => {
            let ax = norm_axis(a.axis, ins[0].region.len());
            let (outer, _, inner) = axis_split(&ins[0].region, ax as i64);
            let sizes: Vec<usize> = ctx.out_regions.iter().map(|r| dims(r)[ax]).collect();
            let mut dx = Vec::with_capacity(ins[0].data.len());
            for o in 0..outer {
                for (d, s) in dys.iter().zip(&sizes) {
                    dx.extend_from_slice(&d[o * s * inner..(o + 1) * s * inner]);
                }
            }
            g[0] = Some(dx);
        }
        OpKind::Reshape(_) | OpKind::Flatten(_) => g[0] = Some(dy.clone()),
        OpKind::Transpose(a) => {
            g[0] = Some(transpose(dy, &dims(&ins[0].region), &a.perm, true));
        }
        OpKind::Lstm(a) => return Ok(lstm_bwd(ins, saved, dy, a.hidden as usize)),
        OpKind::Gru(a) => return Ok(gru_bwd(ins, saved, dy, a.hidden as usize)),
        OpKind::LayerNorm | OpKind::RmsNorm => {
            return Ok(norm_bwd(
                ins,
                &saved.f[0],
                dy,
                matches!(ctx.op, OpKind::RmsNorm),
            ))
        }
        OpKind::Attention(a) => return Ok(attention_bwd(ctx, a, ins, &saved.f[0], dy)),
        OpKind::Moe(_) | OpKind::SwiGlu | OpKind::Rope | OpKind::Ssd(_) => {
            return Err(CommError::Backend(supported(ctx.op, &[]).unwrap_err()))
        }
    }
    Ok(g)
}

fn norm_axis(axis: i64, rank: usize) -> usize {
    if axis < 0 {
        (rank as i64 + axis).max(0) as usize
    } else {
        (axis as usize).min(rank.saturating_sub(1))
    }
}

/// `(outer, size, inner)` of a region around `axis`.
fn axis_split(r: &Region, axis: i64) -> (usize, usize, usize) {
    let d = dims(r);
    let ax = norm_axis(axis, d.len());
    (
        d[..ax].iter().product(),
        d[ax],
        d[ax + 1..].iter().product(),
    )
}

/// `(rows, k, n)` of `x(..., k) · w(k, n)` (or `w(n, k)` when `transposed`).
fn mat_dims(x: &Local, w: &Local, transposed: bool) -> (usize, usize, usize) {
    let wd = dims(&w.region);
    let (k, n) = if transposed {
        (wd[1], wd[0])
    } else {
        (wd[0], wd[1])
    };
    let rows = x.data.len().checked_div(k).unwrap_or(0);
    (rows, k, n)
}

fn matmul_fwd(ins: &[&Local], tb: bool) -> Vec<f32> {
    use crate::tensor::{matmul, MatMut, MatRef, Threads};
    let (a, b) = (ins[0], ins[1]);
    let ad = dims(&a.region);
    let bd = dims(&b.region);
    let (m, k) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let n = if tb {
        bd[bd.len() - 2]
    } else {
        bd[bd.len() - 1]
    };
    if bd.len() == 2 {
        let rows = a.data.len() / k.max(1);
        let mut y = vec![0.0; rows * n];
        let bm = MatRef::new(&b.data, bd[0], bd[1]);
        matmul(
            MatMut::new(&mut y, rows, n),
            MatRef::new(&a.data, rows, k),
            if tb { bm.t() } else { bm },
            false,
            Threads::One,
        );
        return y;
    }
    let batches = a.data.len() / (m * k).max(1);
    let mut y = vec![0.0; batches * m * n];
    for l in 0..batches {
        let bs = &b.data[l * k * n..(l + 1) * k * n];
        let bm = if tb {
            MatRef::new(bs, n, k).t()
        } else {
            MatRef::new(bs, k, n)
        };
        matmul(
            MatMut::new(&mut y[l * m * n..(l + 1) * m * n], m, n),
            MatRef::new(&a.data[l * m * k..(l + 1) * m * k], m, k),
            bm,
            false,
            Threads::One,
        );
    }
    y
}

fn matmul_bwd(ins: &[&Local], tb: bool, dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    use crate::tensor::{matmul, MatMut, MatRef, Threads};
    let (a, b) = (ins[0], ins[1]);
    let ad = dims(&a.region);
    let bd = dims(&b.region);
    let k = ad[ad.len() - 1];
    let n = if tb {
        bd[bd.len() - 2]
    } else {
        bd[bd.len() - 1]
    };
    let (rows_per, batches) = if bd.len() == 2 {
        (a.data.len() / k.max(1), 1)
    } else {
        let m = ad[ad.len() - 2];
        (m, a.data.len() / (m * k).max(1))
    };
    let mut da = vec![0.0; a.data.len()];
    let mut db = vec![0.0; b.data.len()];
    for l in 0..batches {
        let (ao, bo, yo) = (
            l * rows_per * k,
            if bd.len() == 2 { 0 } else { l * k * n },
            l * rows_per * n,
        );
        let dyl = MatRef::new(&dy[yo..yo + rows_per * n], rows_per, n);
        let bs = &b.data[bo..bo + k * n];
        // da = dy · Bᵀ, with B the (k × n) operand.
        let bm = if tb {
            MatRef::new(bs, n, k).t()
        } else {
            MatRef::new(bs, k, n)
        };
        matmul(
            MatMut::new(&mut da[ao..ao + rows_per * k], rows_per, k),
            dyl,
            bm.t(),
            false,
            Threads::One,
        );
        let al = MatRef::new(&a.data[ao..ao + rows_per * k], rows_per, k);
        let acc = bd.len() == 2 && l > 0;
        let dbs = &mut db[bo..bo + k * n];
        if tb {
            // dBᵀ (n × k) = dyᵀ · a
            matmul(MatMut::new(dbs, n, k), dyl.t(), al, acc, Threads::One);
        } else {
            matmul(MatMut::new(dbs, k, n), al.t(), dyl, acc, Threads::One);
        }
    }
    (da, db)
}

fn act(kind: Activation, x: f32) -> f32 {
    match kind {
        Activation::Relu => x.max(0.0),
        Activation::SquaredRelu => {
            let r = x.max(0.0);
            r * r
        }
        Activation::Gelu | Activation::GeluNew => gelu(x),
        Activation::Silu => x * sigmoid(x),
        Activation::Sigmoid => sigmoid(x),
        Activation::Tanh => x.tanh(),
    }
}

fn act_grad(kind: Activation, x: f32) -> f32 {
    match kind {
        Activation::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Activation::SquaredRelu => 2.0 * x.max(0.0),
        Activation::Gelu | Activation::GeluNew => gelu_grad(x),
        Activation::Silu => {
            let s = sigmoid(x);
            s * (1.0 + x * (1.0 - s))
        }
        Activation::Sigmoid => {
            let s = sigmoid(x);
            s * (1.0 - s)
        }
        Activation::Tanh => 1.0 - x.tanh().powi(2),
    }
}

/// For each output element, the index of the element of input `x` it reads (numpy
/// broadcasting, aligned at the last dimension).
fn broadcast_index(out: &[usize], x: &[usize]) -> Vec<usize> {
    let r = out.len();
    let off = r - x.len();
    let mut strides = vec![0usize; r];
    let mut s = 1;
    for i in (0..x.len()).rev() {
        strides[off + i] = if x[i] == 1 && out[off + i] != 1 { 0 } else { s };
        s *= x[i];
    }
    let mut idx = Vec::with_capacity(out.iter().product());
    for_each_index(out, |c| {
        idx.push(c.iter().zip(&strides).map(|(a, b)| a * b).sum())
    });
    idx
}

fn broadcast_fwd(ctx: &Ctx<'_>, ins: &[&Local]) -> Vec<f32> {
    let out = dims(&ctx.out_regions[0]);
    let mul = matches!(ctx.op, OpKind::Mul);
    let total: usize = out.iter().product();
    let mut y = vec![if mul { 1.0 } else { 0.0 }; total];
    for x in ins {
        let xd = dims(&x.region);
        if xd == out {
            for (a, b) in y.iter_mut().zip(&x.data) {
                if mul {
                    *a *= b
                } else {
                    *a += b
                }
            }
        } else {
            for (a, i) in y.iter_mut().zip(broadcast_index(&out, &xd)) {
                if mul {
                    *a *= x.data[i]
                } else {
                    *a += x.data[i]
                }
            }
        }
    }
    y
}

fn broadcast_bwd(ctx: &Ctx<'_>, ins: &[&Local], dy: &[f32]) -> Vec<Option<Vec<f32>>> {
    let out = dims(&ctx.out_regions[0]);
    let mul = matches!(ctx.op, OpKind::Mul);
    if !mul && ins.iter().all(|x| dims(&x.region) == out) {
        return ins.iter().map(|_| Some(dy.to_vec())).collect();
    }
    let index: Vec<Vec<usize>> = ins
        .iter()
        .map(|x| broadcast_index(&out, &dims(&x.region)))
        .collect();
    ins.iter()
        .enumerate()
        .map(|(k, x)| {
            let mut dx = vec![0.0; x.data.len()];
            for (e, d) in dy.iter().enumerate() {
                let mut v = *d;
                if mul {
                    for (j, other) in ins.iter().enumerate() {
                        if j != k {
                            v *= other.data[index[j][e]];
                        }
                    }
                }
                dx[index[k][e]] += v;
            }
            Some(dx)
        })
        .collect()
}

fn softmax_inplace(y: &mut [f32], outer: usize, n: usize, inner: usize) {
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * n + j) * inner + i;
            let m = (0..n).map(|j| y[at(j)]).fold(f32::NEG_INFINITY, f32::max);
            let mut s = 0.0;
            for j in 0..n {
                let e = (y[at(j)] - m).exp();
                y[at(j)] = e;
                s += e;
            }
            for j in 0..n {
                y[at(j)] /= s;
            }
        }
    }
}

/// Row-major index in a tensor of dimensions `full` of the element at offsets `c` inside
/// `region`.
pub(crate) fn global_index(full: &[u64], region: &Region, c: &[usize]) -> u64 {
    c.iter()
        .enumerate()
        .fold(0, |g, (i, ci)| g * full[i] + region[i].0 + *ci as u64)
}

/// The dropout multipliers of `region` (0 or `1 / (1 − rate)`): a hash of the key and each
/// element's global index, so every split of the tensor drops the same elements.
fn dropout_mask(ctx: &Ctx<'_>, rate_permille: u32, region: &Region) -> Vec<f32> {
    let full = ctx.outs_full[0].dims();
    let scale = 1000.0 / (1000.0 - rate_permille.min(999) as f32);
    let d = dims(region);
    let mut out = Vec::with_capacity(d.iter().product());
    for_each_index(&d, |c| {
        let g = global_index(full, region, c);
        let keep = mix(ctx.key ^ mix(g)) % 1000 >= u64::from(rate_permille);
        out.push(if keep { scale } else { 0.0 });
    });
    out
}

/// Calls `f` with every index of a box of sizes `d`, row-major (once, with no index, for a
/// scalar).
pub(crate) fn for_each_index(d: &[usize], mut f: impl FnMut(&[usize])) {
    let total: usize = d.iter().product();
    let mut c = vec![0usize; d.len()];
    for _ in 0..total {
        f(&c);
        for i in (0..d.len()).rev() {
            c[i] += 1;
            if c[i] < d[i] {
                break;
            }
            c[i] = 0;
        }
    }
}

/// Mean cross-entropy's share of this device: `(Σ rows' losses / all labels, probabilities)`.
/// Under a vocabulary split the row maxima and sums are reduced over the vocabulary group and
/// only its first member reports the loss.
fn ce_fwd(ctx: &mut Ctx<'_>, ins: &[&Local]) -> Result<(f32, Vec<f32>), CommError> {
    let (v0, v1) = *ins[0].region.last().expect("logits have a vocabulary axis");
    let vl = (v1 - v0) as usize;
    let rows = ins[1].data.len();
    let logits = &ins[0].data;
    let mut max: Vec<f32> = (0..rows)
        .map(|r| {
            logits[r * vl..(r + 1) * vl]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    (ctx.reduce)(&mut max, Reduce::Max)?;
    let mut sums = vec![0.0f32; 2 * rows];
    let mut probs = vec![0.0; logits.len()];
    for r in 0..rows {
        let mut s = 0.0;
        for j in 0..vl {
            let e = (logits[r * vl + j] - max[r]).exp();
            probs[r * vl + j] = e;
            s += e;
        }
        sums[r] = s;
        let t = ins[1].data[r] as u64;
        if (v0..v1).contains(&t) {
            sums[rows + r] = logits[r * vl + (t - v0) as usize];
        }
    }
    (ctx.reduce)(&mut sums, Reduce::Sum)?;
    let n_full = ctx.ins_full[1].elems() as f64;
    let mut loss = 0.0f64;
    for r in 0..rows {
        for p in &mut probs[r * vl..(r + 1) * vl] {
            *p /= sums[r];
        }
        loss += f64::from(sums[r].ln() + max[r] - sums[rows + r]);
    }
    let first = (ctx.coord)('v').0 == 0;
    Ok((if first { (loss / n_full) as f32 } else { 0.0 }, probs))
}

/// Elements each BatchNorm statistic covers: the whole micro-batch's samples, or this
/// device's `n` under local statistics.
fn bn_count(ctx: &Ctx<'_>, n: usize, sp: usize) -> f32 {
    if ctx.local_stats {
        (n * sp) as f32
    } else {
        let full = ctx.ins_full[0].dims();
        (full[0] * full[2..].iter().product::<u64>()) as f32
    }
}

/// Per channel mean and 1/std over every device of the sample group (synchronised BatchNorm);
/// returns the output and `[mean…, rstd…]`.
fn bn_fwd(ctx: &mut Ctx<'_>, ins: &[&Local]) -> Result<(Vec<f32>, Vec<f32>), CommError> {
    let d = dims(&ins[0].region);
    let (n, c) = (d[0], d[1]);
    let sp: usize = d[2..].iter().product();
    let x = &ins[0].data;
    let count = bn_count(ctx, n, sp);
    let mut mean = vec![0.0f32; c];
    for i in 0..n {
        for (ch, m) in mean.iter_mut().enumerate() {
            let o = (i * c + ch) * sp;
            *m += x[o..o + sp].iter().map(|v| f64::from(*v)).sum::<f64>() as f32;
        }
    }
    (ctx.reduce)(&mut mean, Reduce::Sum)?;
    mean.iter_mut().for_each(|m| *m /= count);
    let mut var = vec![0.0f32; c];
    for i in 0..n {
        for (ch, v) in var.iter_mut().enumerate() {
            let o = (i * c + ch) * sp;
            *v += x[o..o + sp]
                .iter()
                .map(|a| f64::from(a - mean[ch]).powi(2))
                .sum::<f64>() as f32;
        }
    }
    (ctx.reduce)(&mut var, Reduce::Sum)?;
    let rstd: Vec<f32> = var
        .iter()
        .map(|v| 1.0 / (v / count + BN_EPS).sqrt())
        .collect();
    let (gamma, beta) = (&ins[1].data, &ins[2].data);
    let mut y = vec![0.0; x.len()];
    for i in 0..n {
        for ch in 0..c {
            let o = (i * c + ch) * sp;
            for j in o..o + sp {
                y[j] = (x[j] - mean[ch]) * rstd[ch] * gamma[ch] + beta[ch];
            }
        }
    }
    mean.extend(rstd);
    Ok((y, mean))
}

/// BatchNorm backward; the weight gradients are this device's share (the gradient
/// synchronisation sums the sample group), the input gradient uses the group's sums.
fn bn_bwd(
    ctx: &mut Ctx<'_>,
    ins: &[&Local],
    stats: &[f32],
    dy: &[f32],
) -> Result<BnGrads, CommError> {
    let d = dims(&ins[0].region);
    let (n, c) = (d[0], d[1]);
    let sp: usize = d[2..].iter().product();
    let x = &ins[0].data;
    let (mean, rstd) = stats.split_at(c);
    let count = bn_count(ctx, n, sp);
    let mut dbeta = vec![0.0f32; c];
    let mut dgamma = vec![0.0f32; c];
    for i in 0..n {
        for ch in 0..c {
            let o = (i * c + ch) * sp;
            let (mut a, mut b) = (0.0f64, 0.0f64);
            for j in o..o + sp {
                a += f64::from(dy[j]);
                b += f64::from(dy[j] * (x[j] - mean[ch]) * rstd[ch]);
            }
            dbeta[ch] += a as f32;
            dgamma[ch] += b as f32;
        }
    }
    let mut sums = [dbeta.clone(), dgamma.clone()].concat();
    (ctx.reduce)(&mut sums, Reduce::Sum)?;
    let (sdb, sdg) = sums.split_at(c);
    let gamma = &ins[1].data;
    let mut dx = vec![0.0; x.len()];
    for i in 0..n {
        for ch in 0..c {
            let o = (i * c + ch) * sp;
            let k = gamma[ch] * rstd[ch] / count;
            for j in o..o + sp {
                let xhat = (x[j] - mean[ch]) * rstd[ch];
                dx[j] = k * (count * dy[j] - sdb[ch] - xhat * sdg[ch]);
            }
        }
    }
    Ok((dx, dgamma, dbeta))
}

fn norm_fwd(ins: &[&Local], rms: bool) -> (Vec<f32>, Vec<f32>) {
    let c = dims(&ins[0].region).last().copied().unwrap_or(1).max(1);
    let x = &ins[0].data;
    let rows = x.len() / c;
    let mut y = vec![0.0; x.len()];
    let mut stats = Vec::with_capacity(2 * rows);
    for r in 0..rows {
        let row = &x[r * c..(r + 1) * c];
        let mean = if rms {
            0.0
        } else {
            row.iter().sum::<f32>() / c as f32
        };
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / c as f32;
        let rstd = 1.0 / (var + NORM_EPS).sqrt();
        for j in 0..c {
            let mut v = (row[j] - mean) * rstd * ins[1].data[j];
            if let Some(b) = ins.get(2) {
                v += b.data[j];
            }
            y[r * c + j] = v;
        }
        stats.push(mean);
        stats.push(rstd);
    }
    (y, stats)
}

fn norm_bwd(ins: &[&Local], stats: &[f32], dy: &[f32], rms: bool) -> Vec<Option<Vec<f32>>> {
    let c = dims(&ins[0].region).last().copied().unwrap_or(1).max(1);
    let x = &ins[0].data;
    let rows = x.len() / c;
    let w = &ins[1].data;
    let mut dx = vec![0.0; x.len()];
    let mut dw = vec![0.0; c];
    let mut db = vec![0.0; c];
    for r in 0..rows {
        let (mean, rstd) = (stats[2 * r], stats[2 * r + 1]);
        let (mut s1, mut s2) = (0.0f32, 0.0f32);
        for j in 0..c {
            let xh = (x[r * c + j] - mean) * rstd;
            let g = dy[r * c + j] * w[j];
            dw[j] += dy[r * c + j] * xh;
            db[j] += dy[r * c + j];
            s1 += g;
            s2 += g * xh;
        }
        for j in 0..c {
            let xh = (x[r * c + j] - mean) * rstd;
            let g = dy[r * c + j] * w[j];
            let centred = if rms { 0.0 } else { s1 / c as f32 };
            dx[r * c + j] = rstd * (g - centred - xh * s2 / c as f32);
        }
    }
    let mut out = vec![Some(dx), Some(dw)];
    if ins.len() > 2 {
        out.push(Some(db));
    }
    out
}

fn transpose(x: &[f32], in_dims: &[usize], perm: &[usize], inverse: bool) -> Vec<f32> {
    let r = in_dims.len();
    let out_dims: Vec<usize> = perm.iter().map(|p| in_dims[*p]).collect();
    let mut in_strides = vec![1usize; r];
    for i in (0..r.saturating_sub(1)).rev() {
        in_strides[i] = in_strides[i + 1] * in_dims[i + 1];
    }
    let mut y = vec![0.0; in_dims.iter().product()];
    let mut o = 0;
    for_each_index(&out_dims, |c| {
        let i: usize = c
            .iter()
            .enumerate()
            .map(|(k, ck)| ck * in_strides[perm[k]])
            .sum();
        if inverse {
            // `x` is laid out as the output: scatter it back to input order.
            y[i] = x[o];
        } else {
            y[o] = x[i];
        }
        o += 1;
    });
    y
}

/// The window geometry of a convolution or pooling on one spatial axis.
#[derive(Clone, Copy, Debug)]
struct Axis {
    /// Full input size.
    full: i64,
    /// First input index this device holds.
    in_lo: i64,
    /// Input extent this device holds.
    in_len: usize,
    /// First output index this device computes and how many.
    out_lo: i64,
    out_len: usize,
    kernel: usize,
    stride: i64,
    pad: i64,
    dilation: i64,
}

impl Axis {
    /// The local input index output `o` (local) reads with tap `k`, or `None` in the padding.
    fn at(&self, o: usize, k: usize) -> Option<usize> {
        let g = (self.out_lo + o as i64) * self.stride - self.pad + k as i64 * self.dilation;
        if g < 0 || g >= self.full {
            return None;
        }
        let l = g - self.in_lo;
        debug_assert!(
            l >= 0 && (l as usize) < self.in_len,
            "receptive field outside the held region"
        );
        Some(l as usize)
    }
}

/// The input rows (global, clipped) that outputs `[lo, hi)` read on one axis.
pub fn receptive(
    (lo, hi): (u64, u64),
    full: u64,
    kernel: u64,
    stride: u64,
    pad: u64,
    dilation: u64,
) -> (u64, u64) {
    if lo >= hi {
        return (0, 0);
    }
    let a = (lo * stride) as i64 - pad as i64;
    let b = ((hi - 1) * stride) as i64 - pad as i64 + ((kernel - 1) * dilation) as i64 + 1;
    (a.max(0) as u64, (b.max(0) as u64).min(full))
}

fn axes2(
    x: &Local,
    full: &Shape,
    out: &Region,
    kernel: [u64; 2],
    stride: [u64; 2],
    pad: [u64; 2],
    dil: [u64; 2],
) -> [Axis; 2] {
    let d = dims(&x.region);
    [0, 1].map(|i| Axis {
        full: full.0[2 + i] as i64,
        in_lo: lo(&x.region, 2 + i) as i64,
        in_len: d[2 + i],
        out_lo: out[2 + i].0 as i64,
        out_len: (out[2 + i].1 - out[2 + i].0) as usize,
        kernel: kernel[i] as usize,
        stride: stride[i] as i64,
        pad: pad[i] as i64,
        dilation: dil[i] as i64,
    })
}

/// For each output position `o` and tap `k` of an axis, the local input index read, or
/// `usize::MAX` in the padding (`out_len × kernel`, row-major).
fn taps(ax: &Axis) -> Vec<usize> {
    let mut t = Vec::with_capacity(ax.out_len * ax.kernel);
    for o in 0..ax.out_len {
        for k in 0..ax.kernel {
            t.push(ax.at(o, k).unwrap_or(usize::MAX));
        }
    }
    t
}

/// For each tap `j` of the width axis, the run of output columns that read inside the image
/// and the input column the first of them reads, when those columns are consecutive (stride
/// 1): `(first output, count, first input)`; `None` where the stride is larger.
fn contiguous_taps(ax: &Axis, taps: &[usize]) -> Option<Vec<(usize, usize, usize)>> {
    if ax.stride != 1 {
        return None;
    }
    Some(
        (0..ax.kernel)
            .map(|j| {
                let valid: Vec<usize> = (0..ax.out_len)
                    .filter(|o| taps[o * ax.kernel + j] != usize::MAX)
                    .collect();
                match (valid.first(), valid.last()) {
                    (Some(&a), Some(&b)) => (a, b + 1 - a, taps[a * ax.kernel + j]),
                    _ => (0, 0, 0),
                }
            })
            .collect(),
    )
}

/// One sample's im2col for the channels `chans` (local indices): `(chans · kh · kw) × (oh · ow)`.
fn im2col(x: &[f32], (h, w): (usize, usize), chans: &[usize], ax: &[Axis; 2]) -> Vec<f32> {
    let (kh, kw) = (ax[0].kernel, ax[1].kernel);
    let (oh, ow) = (ax[0].out_len, ax[1].out_len);
    let (ty, tx) = (taps(&ax[0]), taps(&ax[1]));
    let runs = contiguous_taps(&ax[1], &tx);
    let p = oh * ow;
    let mut cols = vec![0.0; chans.len() * kh * kw * p];
    for (ci, c) in chans.iter().enumerate() {
        let plane = &x[c * h * w..(c + 1) * h * w];
        for i in 0..kh {
            for j in 0..kw {
                let row = &mut cols[((ci * kh + i) * kw + j) * p..((ci * kh + i) * kw + j + 1) * p];
                for oy in 0..oh {
                    let iy = ty[oy * kh + i];
                    if iy == usize::MAX {
                        continue;
                    }
                    let src = &plane[iy * w..(iy + 1) * w];
                    let dst = &mut row[oy * ow..(oy + 1) * ow];
                    match &runs {
                        Some(r) => {
                            let (o, n, ix) = r[j];
                            dst[o..o + n].copy_from_slice(&src[ix..ix + n]);
                        }
                        None => {
                            for (ox, d) in dst.iter_mut().enumerate() {
                                let ix = tx[ox * kw + j];
                                if ix != usize::MAX {
                                    *d = src[ix];
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    cols
}

fn col2im(cols: &[f32], dx: &mut [f32], (h, w): (usize, usize), chans: &[usize], ax: &[Axis; 2]) {
    let (kh, kw) = (ax[0].kernel, ax[1].kernel);
    let (oh, ow) = (ax[0].out_len, ax[1].out_len);
    let (ty, tx) = (taps(&ax[0]), taps(&ax[1]));
    let runs = contiguous_taps(&ax[1], &tx);
    let p = oh * ow;
    for (ci, c) in chans.iter().enumerate() {
        let plane = &mut dx[c * h * w..(c + 1) * h * w];
        for i in 0..kh {
            for j in 0..kw {
                let row = &cols[((ci * kh + i) * kw + j) * p..((ci * kh + i) * kw + j + 1) * p];
                for oy in 0..oh {
                    let iy = ty[oy * kh + i];
                    if iy == usize::MAX {
                        continue;
                    }
                    let dst = &mut plane[iy * w..(iy + 1) * w];
                    let src = &row[oy * ow..(oy + 1) * ow];
                    match &runs {
                        Some(r) => {
                            let (o, n, ix) = r[j];
                            for (d, v) in dst[ix..ix + n].iter_mut().zip(&src[o..o + n]) {
                                *d += v;
                            }
                        }
                        None => {
                            for (ox, v) in src.iter().enumerate() {
                                let ix = tx[ox * kw + j];
                                if ix != usize::MAX {
                                    dst[ix] += v;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Runs of consecutive local output channels that read the same group of input channels:
/// `(first local out channel, count, local input channels)`.
fn conv_runs(
    a: &Conv2dAttrs,
    x: &Local,
    w: &Local,
    full_c: u64,
    out: &Region,
) -> Vec<(usize, usize, Vec<usize>)> {
    let (o0, o1) = out[1];
    let og = a.out_channels / a.groups;
    let cg = full_c / a.groups;
    let (c0, c1) = x.region[1];
    let (wc0, wc1) = w.region[1];
    let mut runs: Vec<(usize, usize, Vec<usize>)> = Vec::new();
    let mut o = o0;
    while o < o1 {
        let g = o / og;
        let end = ((g + 1) * og).min(o1);
        let chans: Vec<usize> = (wc0..wc1)
            .map(|j| g * cg + j)
            .map(|ic| {
                debug_assert!((c0..c1).contains(&ic), "input channel {ic} not held");
                (ic - c0) as usize
            })
            .collect();
        runs.push(((o - o0) as usize, (end - o) as usize, chans));
        o = end;
    }
    runs
}

/// A convolution's local geometry: output sizes, window axes, input sample shape
/// `(n, channels, h, w)`, output positions `p`, weight row length `kk` and the runs of output
/// channels sharing input channels.
struct ConvGeom {
    od: Vec<usize>,
    ax: [Axis; 2],
    x: (usize, usize, usize, usize),
    p: usize,
    kk: usize,
    runs: Vec<(usize, usize, Vec<usize>)>,
}

impl ConvGeom {
    fn new(ctx: &Ctx<'_>, a: &Conv2dAttrs, x: &Local, w: &Local) -> ConvGeom {
        let out = &ctx.out_regions[0];
        let od = dims(out);
        let ax = axes2(
            x,
            &ctx.ins_full[0],
            out,
            a.kernel,
            a.stride,
            a.padding,
            a.dilation,
        );
        let xd = dims(&x.region);
        let p = od[2] * od[3];
        let kk = (w.region[1].1 - w.region[1].0) as usize * ax[0].kernel * ax[1].kernel;
        ConvGeom {
            runs: conv_runs(a, x, w, ctx.ins_full[0].0[1], out),
            od,
            ax,
            x: (xd[0], xd[1], xd[2], xd[3]),
            p,
            kk,
        }
    }
}

fn conv_fwd(ctx: &Ctx<'_>, a: &Conv2dAttrs, ins: &[&Local]) -> Vec<f32> {
    let (x, w) = (ins[0], ins[1]);
    let ConvGeom {
        od,
        ax,
        x: (n, cl, h, wd),
        p,
        kk,
        runs,
    } = ConvGeom::new(ctx, a, x, w);
    let mut y = vec![0.0; od.iter().product()];
    for s in 0..n {
        let xs = &x.data[s * cl * h * wd..(s + 1) * cl * h * wd];
        for (oa, cnt, chans) in &runs {
            let cols = im2col(xs, (h, wd), chans, &ax);
            let ys = &mut y[(s * od[1] + oa) * p..(s * od[1] + oa + cnt) * p];
            mm(
                ys,
                &w.data[oa * kk..(oa + cnt) * kk],
                &cols,
                *cnt,
                kk,
                p,
                false,
            );
        }
    }
    if a.bias && (ctx.coord)('c').0 == 0 {
        let b = &ins[2].data;
        for (i, v) in y.iter_mut().enumerate() {
            *v += b[(i / p) % od[1]];
        }
    }
    y
}

fn conv_bwd(
    ctx: &Ctx<'_>,
    a: &Conv2dAttrs,
    ins: &[&Local],
    dy: &[f32],
    need_dx: bool,
) -> (Option<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let (x, w) = (ins[0], ins[1]);
    let ConvGeom {
        od,
        ax,
        x: (n, cl, h, wd),
        p,
        kk,
        runs,
    } = ConvGeom::new(ctx, a, x, w);
    let mut dx = need_dx.then(|| vec![0.0; x.data.len()]);
    let mut dw = vec![0.0; w.data.len()];
    for s in 0..n {
        let xs = &x.data[s * cl * h * wd..(s + 1) * cl * h * wd];
        for (oa, cnt, chans) in &runs {
            let cols = im2col(xs, (h, wd), chans, &ax);
            let dys = &dy[(s * od[1] + oa) * p..(s * od[1] + oa + cnt) * p];
            let wr = &w.data[oa * kk..(oa + cnt) * kk];
            // dW (cnt × kk) += dY (cnt × p) · colsᵀ (p × kk)
            crate::tensor::matmul(
                crate::tensor::MatMut::new(&mut dw[oa * kk..(oa + cnt) * kk], *cnt, kk),
                crate::tensor::MatRef::new(dys, *cnt, p),
                crate::tensor::MatRef::new(&cols, kk, p).t(),
                true,
                crate::tensor::Threads::One,
            );
            if let Some(dx) = dx.as_mut() {
                // dcols (kk × p) = Wᵀ (kk × cnt) · dY (cnt × p)
                let mut dcols = vec![0.0; kk * p];
                mm_tn(&mut dcols, wr, dys, *cnt, kk, p, false);
                let dxs = &mut dx[s * cl * h * wd..(s + 1) * cl * h * wd];
                col2im(&dcols, dxs, (h, wd), chans, &ax);
            }
        }
    }
    let mut db = vec![0.0; od[1]];
    if a.bias && (ctx.coord)('c').0 == 0 {
        for (i, v) in dy.iter().enumerate() {
            db[(i / p) % od[1]] += v;
        }
    }
    (dx, dw, db)
}

fn pool_fwd(
    ctx: &Ctx<'_>,
    kind: PoolKind,
    kernel: [u64; 2],
    stride: [u64; 2],
    pad: [u64; 2],
    x: &Local,
) -> (Vec<f32>, Vec<u32>) {
    let out = &ctx.out_regions[0];
    let od = dims(out);
    let ax = axes2(x, &ctx.ins_full[0], out, kernel, stride, pad, [1, 1]);
    let xd = dims(&x.region);
    let planes = xd[0] * xd[1];
    let (h, w) = (xd[2], xd[3]);
    let area = (kernel[0] * kernel[1]) as f32;
    let mut y = Vec::with_capacity(planes * od[2] * od[3]);
    let mut idx = Vec::new();
    for pl in 0..planes {
        let xs = &x.data[pl * h * w..(pl + 1) * h * w];
        for oy in 0..od[2] {
            for ox in 0..od[3] {
                let (mut best, mut arg, mut sum) = (f32::NEG_INFINITY, 0usize, 0.0f32);
                for i in 0..ax[0].kernel {
                    let Some(iy) = ax[0].at(oy, i) else { continue };
                    for j in 0..ax[1].kernel {
                        let Some(ix) = ax[1].at(ox, j) else { continue };
                        let v = xs[iy * w + ix];
                        sum += v;
                        if v > best {
                            best = v;
                            arg = iy * w + ix;
                        }
                    }
                }
                match kind {
                    PoolKind::Max => {
                        y.push(best);
                        idx.push((pl * h * w + arg) as u32);
                    }
                    PoolKind::Avg => y.push(sum / area),
                }
            }
        }
    }
    (y, idx)
}

#[allow(clippy::too_many_arguments)]
fn pool_bwd(
    ctx: &Ctx<'_>,
    kind: PoolKind,
    kernel: [u64; 2],
    stride: [u64; 2],
    pad: [u64; 2],
    x: &Local,
    saved: &Saved,
    dy: &[f32],
) -> Vec<f32> {
    let mut dx = vec![0.0; x.data.len()];
    match kind {
        PoolKind::Max => {
            for (i, d) in saved.idx.iter().zip(dy) {
                dx[*i as usize] += d;
            }
        }
        PoolKind::Avg => {
            let out = &ctx.out_regions[0];
            let od = dims(out);
            let ax = axes2(x, &ctx.ins_full[0], out, kernel, stride, pad, [1, 1]);
            let xd = dims(&x.region);
            let (h, w) = (xd[2], xd[3]);
            let area = (kernel[0] * kernel[1]) as f32;
            for pl in 0..xd[0] * xd[1] {
                for oy in 0..od[2] {
                    for ox in 0..od[3] {
                        let g = dy[(pl * od[2] + oy) * od[3] + ox] / area;
                        for i in 0..ax[0].kernel {
                            let Some(iy) = ax[0].at(oy, i) else { continue };
                            for j in 0..ax[1].kernel {
                                if let Some(ix) = ax[1].at(ox, j) {
                                    dx[pl * h * w + iy * w + ix] += g;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    dx
}

/// `(batch, steps, input width)` of a recurrent layer's local input.
fn rnn_dims(x: &Local) -> (usize, usize, usize) {
    let d = dims(&x.region);
    (d[0], d[1], d[2])
}

/// Input projections of every step at once: `x · W_ih + bias`, `(b · s) × gates`.
fn input_gates(x: &Local, w_ih: &[f32], bias: &[f32], gates: usize) -> Vec<f32> {
    let (b, s, i) = rnn_dims(x);
    let mut xg = vec![0.0; b * s * gates];
    mm(&mut xg, &x.data, w_ih, b * s, i, gates, false);
    crate::tensor::add_bias(&mut xg, bias);
    xg
}

/// LSTM forward; saves the activated gates `(b, s, 4h)` and cell states `(b, s, h)`.
fn lstm_fwd(ins: &[&Local], hd: usize) -> (Vec<f32>, Saved) {
    let (b, s, _) = rnn_dims(ins[0]);
    let g4 = 4 * hd;
    let mut gates = input_gates(ins[0], &ins[1].data, &ins[3].data, g4);
    let mut cs = vec![0.0; b * s * hd];
    let mut y = vec![0.0; b * s * hd];
    let mut h = vec![0.0; b * hd];
    let mut c = vec![0.0; b * hd];
    let mut hg = vec![0.0; b * g4];
    for t in 0..s {
        mm(&mut hg, &h, &ins[2].data, b, hd, g4, false);
        for n in 0..b {
            let gt = &mut gates[(n * s + t) * g4..(n * s + t + 1) * g4];
            for j in 0..g4 {
                gt[j] += hg[n * g4 + j];
            }
            for j in 0..hd {
                let (i, f, g, o) = (
                    sigmoid(gt[j]),
                    sigmoid(gt[hd + j]),
                    gt[2 * hd + j].tanh(),
                    sigmoid(gt[3 * hd + j]),
                );
                gt[j] = i;
                gt[hd + j] = f;
                gt[2 * hd + j] = g;
                gt[3 * hd + j] = o;
                let cn = f * c[n * hd + j] + i * g;
                c[n * hd + j] = cn;
                let hn = o * cn.tanh();
                h[n * hd + j] = hn;
                cs[(n * s + t) * hd + j] = cn;
                y[(n * s + t) * hd + j] = hn;
            }
        }
    }
    (
        y.clone(),
        Saved {
            f: vec![gates, cs, y],
            idx: Vec::new(),
        },
    )
}

/// Gradients of a recurrent layer's weights and input from the pre-activation gradients of
/// every step (`dxg`, `(b · s) × gates`).
fn rnn_input_grads(
    ins: &[&Local],
    dxg: &[f32],
    dw_hh: Vec<f32>,
    gates: usize,
) -> Vec<Option<Vec<f32>>> {
    let (b, s, i) = rnn_dims(ins[0]);
    let mut dx = vec![0.0; b * s * i];
    mm_nt(&mut dx, dxg, &ins[1].data, b * s, i, gates, false);
    let mut dw_ih = vec![0.0; i * gates];
    mm_tn(&mut dw_ih, &ins[0].data, dxg, b * s, i, gates, false);
    let mut db = vec![0.0; gates];
    crate::tensor::bias_grad(&mut db, dxg);
    vec![Some(dx), Some(dw_ih), Some(dw_hh), Some(db)]
}

fn lstm_bwd(ins: &[&Local], saved: &Saved, dy: &[f32], hd: usize) -> Vec<Option<Vec<f32>>> {
    let (b, s, _) = rnn_dims(ins[0]);
    let g4 = 4 * hd;
    let (gates, cs, ys) = (&saved.f[0], &saved.f[1], &saved.f[2]);
    let w_hh = &ins[2].data;
    let mut dxg = vec![0.0; b * s * g4];
    let mut dw_hh = vec![0.0; hd * g4];
    let mut dh = vec![0.0; b * hd];
    let mut dc = vec![0.0; b * hd];
    let mut dg = vec![0.0; b * g4];
    let mut hprev = vec![0.0; b * hd];
    for t in (0..s).rev() {
        for n in 0..b {
            let gt = &gates[(n * s + t) * g4..(n * s + t + 1) * g4];
            for j in 0..hd {
                let at = (n * s + t) * hd + j;
                let (i, f, g, o) = (gt[j], gt[hd + j], gt[2 * hd + j], gt[3 * hd + j]);
                let c = cs[at];
                let cprev = if t > 0 { cs[at - hd] } else { 0.0 };
                let tc = c.tanh();
                let dht = dy[at] + dh[n * hd + j];
                let dct = dht * o * (1.0 - tc * tc) + dc[n * hd + j];
                let d = &mut dg[n * g4..(n + 1) * g4];
                d[j] = dct * g * i * (1.0 - i);
                d[hd + j] = dct * cprev * f * (1.0 - f);
                d[2 * hd + j] = dct * i * (1.0 - g * g);
                d[3 * hd + j] = dht * tc * o * (1.0 - o);
                dc[n * hd + j] = dct * f;
                hprev[n * hd + j] = if t > 0 { ys[at - hd] } else { 0.0 };
            }
            dxg[(n * s + t) * g4..(n * s + t + 1) * g4].copy_from_slice(&dg[n * g4..(n + 1) * g4]);
        }
        mm_nt(&mut dh, &dg, w_hh, b, hd, g4, false);
        mm_tn(&mut dw_hh, &hprev, &dg, b, hd, g4, true);
    }
    rnn_input_grads(ins, &dxg, dw_hh, g4)
}

/// GRU forward (PyTorch's gates with the IR's single bias on the input side:
/// `n = tanh(x·W_in + b_n + r ⊙ (h·W_hn))`); saves `r, z, n` and `h·W_hn` `(b, s, ·)`.
fn gru_fwd(ins: &[&Local], hd: usize) -> (Vec<f32>, Saved) {
    let (b, s, _) = rnn_dims(ins[0]);
    let g3 = 3 * hd;
    let xg = input_gates(ins[0], &ins[1].data, &ins[3].data, g3);
    let mut act = vec![0.0; b * s * g3];
    let mut hn_all = vec![0.0; b * s * hd];
    let mut y = vec![0.0; b * s * hd];
    let mut h = vec![0.0; b * hd];
    let mut hg = vec![0.0; b * g3];
    for t in 0..s {
        mm(&mut hg, &h, &ins[2].data, b, hd, g3, false);
        for n in 0..b {
            let base = (n * s + t) * g3;
            for j in 0..hd {
                let r = sigmoid(xg[base + j] + hg[n * g3 + j]);
                let z = sigmoid(xg[base + hd + j] + hg[n * g3 + hd + j]);
                let hn = hg[n * g3 + 2 * hd + j];
                let nn = (xg[base + 2 * hd + j] + r * hn).tanh();
                let hp = h[n * hd + j];
                let hnew = (1.0 - z) * nn + z * hp;
                act[base + j] = r;
                act[base + hd + j] = z;
                act[base + 2 * hd + j] = nn;
                hn_all[(n * s + t) * hd + j] = hn;
                h[n * hd + j] = hnew;
                y[(n * s + t) * hd + j] = hnew;
            }
        }
    }
    (
        y.clone(),
        Saved {
            f: vec![act, hn_all, y],
            idx: Vec::new(),
        },
    )
}

fn gru_bwd(ins: &[&Local], saved: &Saved, dy: &[f32], hd: usize) -> Vec<Option<Vec<f32>>> {
    let (b, s, _) = rnn_dims(ins[0]);
    let g3 = 3 * hd;
    let (act, hn_all, ys) = (&saved.f[0], &saved.f[1], &saved.f[2]);
    let w_hh = &ins[2].data;
    let mut dxg = vec![0.0; b * s * g3];
    let mut dw_hh = vec![0.0; hd * g3];
    let mut dh = vec![0.0; b * hd];
    let mut dgh = vec![0.0; b * g3];
    let mut hprev = vec![0.0; b * hd];
    let mut direct = vec![0.0; b * hd];
    for t in (0..s).rev() {
        for n in 0..b {
            let base = (n * s + t) * g3;
            for j in 0..hd {
                let at = (n * s + t) * hd + j;
                let (r, z, nn) = (act[base + j], act[base + hd + j], act[base + 2 * hd + j]);
                let hp = if t > 0 { ys[at - hd] } else { 0.0 };
                let d = dy[at] + dh[n * hd + j];
                let dn = d * (1.0 - z) * (1.0 - nn * nn);
                let dz = d * (hp - nn) * z * (1.0 - z);
                let dr = dn * hn_all[at] * r * (1.0 - r);
                dxg[base + j] = dr;
                dxg[base + hd + j] = dz;
                dxg[base + 2 * hd + j] = dn;
                dgh[n * g3 + j] = dr;
                dgh[n * g3 + hd + j] = dz;
                dgh[n * g3 + 2 * hd + j] = dn * r;
                direct[n * hd + j] = d * z;
                hprev[n * hd + j] = hp;
            }
        }
        mm_nt(&mut dh, &dgh, w_hh, b, hd, g3, false);
        crate::tensor::add_into(&mut dh, &direct);
        mm_tn(&mut dw_hh, &hprev, &dgh, b, hd, g3, true);
    }
    rnn_input_grads(ins, &dxg, dw_hh, g3)
}

/// Geometry of an attention op's local regions: `(batch, query rows, query heads, head size,
/// key rows, key heads)`, the first query position and head, the first key head, and query
/// heads per key head.
struct AttnDims {
    b: usize,
    s: usize,
    h: usize,
    d: usize,
    t: usize,
    kv: usize,
    s0: u64,
    h0: u64,
    kv0: u64,
    group: u64,
}

impl AttnDims {
    fn new(ctx: &Ctx<'_>, ins: &[&Local]) -> AttnDims {
        let q = dims(&ins[0].region);
        let k = dims(&ins[1].region);
        let heads = ctx.ins_full[0].0[2];
        let kv_heads = ctx.ins_full[1].0[2].max(1);
        AttnDims {
            b: q[0],
            s: q[1],
            h: q[2],
            d: q[3],
            t: k[1],
            kv: k[2],
            s0: ins[0].region[1].0,
            h0: ins[0].region[2].0,
            kv0: ins[1].region[2].0,
            group: (heads / kv_heads).max(1),
        }
    }

    /// Local key head of local query head `hh`.
    fn kv_of(&self, hh: usize) -> usize {
        let g = (self.h0 + hh as u64) / self.group;
        debug_assert!(g >= self.kv0, "key head {g} not held");
        (g - self.kv0) as usize
    }

    /// Views of query-like (`heads` wide) and key-like rows of sample `b`, head `h`.
    fn q_off(&self, b: usize, h: usize) -> usize {
        (b * self.s * self.h + h) * self.d
    }
    fn k_off(&self, b: usize, kv: usize) -> usize {
        (b * self.t * self.kv + kv) * self.d
    }
}

/// The dropout multipliers of the attention probabilities of sample `b`, head `h` (local),
/// hashed from global indices so every split drops the same ones.
fn attn_dropout(
    ctx: &Ctx<'_>,
    a: &AttentionAttrs,
    dm: &AttnDims,
    b0: u64,
    b: usize,
    h: usize,
) -> Option<Vec<f32>> {
    if !a.dropout {
        return None;
    }
    const RATE_PERMILLE: u64 = 100;
    let heads = ctx.ins_full[0].0[2];
    let full_s = ctx.ins_full[0].0[1];
    let scale = 1000.0 / (1000 - RATE_PERMILLE) as f32;
    let mut m = Vec::with_capacity(dm.s * dm.t);
    for i in 0..dm.s {
        for j in 0..dm.t {
            let g = (((b0 + b as u64) * heads + dm.h0 + h as u64) * full_s + dm.s0 + i as u64)
                * dm.t as u64
                + j as u64;
            let keep = mix(ctx.key ^ mix(g ^ 0xa77)) % 1000 >= RATE_PERMILLE;
            m.push(if keep { scale } else { 0.0 });
        }
    }
    Some(m)
}

/// Softmax attention, unfused: saves the probabilities `(b, h, s, t)` for the backward.
/// Attention dropout, where the op has it, drops 10 % of the probabilities (the IR does not
/// carry a rate; BERT's and GPT-2's default).
fn attention_fwd(ctx: &Ctx<'_>, a: &AttentionAttrs, ins: &[&Local]) -> (Vec<f32>, Vec<f32>) {
    use crate::tensor::{matmul, MatMut, MatRef, Threads};
    let dm = AttnDims::new(ctx, ins);
    let (q, k, v) = (&ins[0].data, &ins[1].data, &ins[2].data);
    let scale = 1.0 / (dm.d as f32).sqrt();
    let mut y = vec![0.0; q.len()];
    let mut probs = vec![0.0; dm.b * dm.h * dm.s * dm.t];
    let b0 = ins[0].region[0].0;
    for b in 0..dm.b {
        for h in 0..dm.h {
            let kv = dm.kv_of(h);
            let p = &mut probs[((b * dm.h + h) * dm.s) * dm.t..((b * dm.h + h + 1) * dm.s) * dm.t];
            matmul(
                MatMut::new(p, dm.s, dm.t),
                MatRef::strided(q, dm.q_off(b, h), dm.s, dm.d, dm.h * dm.d, 1),
                MatRef::strided(k, dm.k_off(b, kv), dm.t, dm.d, dm.kv * dm.d, 1).t(),
                false,
                Threads::One,
            );
            for (i, row) in p.chunks_exact_mut(dm.t.max(1)).enumerate() {
                let pos = dm.s0 as usize + i;
                for (j, x) in row.iter_mut().enumerate() {
                    *x = if a.causal && j > pos {
                        f32::NEG_INFINITY
                    } else {
                        *x * scale
                    };
                }
            }
            softmax_inplace(p, dm.s, dm.t, 1);
            let dropped;
            let used: &[f32] = match attn_dropout(ctx, a, &dm, b0, b, h) {
                Some(m) => {
                    dropped = p.iter().zip(&m).map(|(x, k)| x * k).collect::<Vec<f32>>();
                    &dropped
                }
                None => p,
            };
            matmul(
                MatMut::strided(&mut y, dm.q_off(b, h), dm.s, dm.d, dm.h * dm.d, 1),
                MatRef::new(used, dm.s, dm.t),
                MatRef::strided(v, dm.k_off(b, kv), dm.t, dm.d, dm.kv * dm.d, 1),
                false,
                Threads::One,
            );
        }
    }
    (y, probs)
}

fn attention_bwd(
    ctx: &Ctx<'_>,
    a: &AttentionAttrs,
    ins: &[&Local],
    probs: &[f32],
    dy: &[f32],
) -> Vec<Option<Vec<f32>>> {
    use crate::tensor::{matmul, MatMut, MatRef, Threads};
    let dm = AttnDims::new(ctx, ins);
    let (q, k, v) = (&ins[0].data, &ins[1].data, &ins[2].data);
    let scale = 1.0 / (dm.d as f32).sqrt();
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    let b0 = ins[0].region[0].0;
    let mut dp = vec![0.0; dm.s * dm.t];
    for b in 0..dm.b {
        for h in 0..dm.h {
            let kv = dm.kv_of(h);
            let p = &probs[((b * dm.h + h) * dm.s) * dm.t..((b * dm.h + h + 1) * dm.s) * dm.t];
            let mask = attn_dropout(ctx, a, &dm, b0, b, h);
            let dropped: Option<Vec<f32>> = mask
                .as_ref()
                .map(|m| p.iter().zip(m).map(|(x, k)| x * k).collect());
            let used = dropped.as_deref().unwrap_or(p);
            // dV += Pᵀ · dO
            matmul(
                MatMut::strided(&mut dv, dm.k_off(b, kv), dm.t, dm.d, dm.kv * dm.d, 1),
                MatRef::new(used, dm.s, dm.t).t(),
                MatRef::strided(dy, dm.q_off(b, h), dm.s, dm.d, dm.h * dm.d, 1),
                true,
                Threads::One,
            );
            // dP = dO · Vᵀ (through the dropout mask)
            matmul(
                MatMut::new(&mut dp, dm.s, dm.t),
                MatRef::strided(dy, dm.q_off(b, h), dm.s, dm.d, dm.h * dm.d, 1),
                MatRef::strided(v, dm.k_off(b, kv), dm.t, dm.d, dm.kv * dm.d, 1).t(),
                false,
                Threads::One,
            );
            if let Some(m) = &mask {
                dp.iter_mut().zip(m).for_each(|(x, k)| *x *= k);
            }
            for (row, prow) in dp
                .chunks_exact_mut(dm.t.max(1))
                .zip(p.chunks_exact(dm.t.max(1)))
            {
                let dot: f32 = row.iter().zip(prow).map(|(a, b)| a * b).sum();
                for (x, pv) in row.iter_mut().zip(prow) {
                    *x = pv * (*x - dot) * scale;
                }
            }
            // dQ = dS · K, dK += dSᵀ · Q
            matmul(
                MatMut::strided(&mut dq, dm.q_off(b, h), dm.s, dm.d, dm.h * dm.d, 1),
                MatRef::new(&dp, dm.s, dm.t),
                MatRef::strided(k, dm.k_off(b, kv), dm.t, dm.d, dm.kv * dm.d, 1),
                false,
                Threads::One,
            );
            matmul(
                MatMut::strided(&mut dk, dm.k_off(b, kv), dm.t, dm.d, dm.kv * dm.d, 1),
                MatRef::new(&dp, dm.s, dm.t).t(),
                MatRef::strided(q, dm.q_off(b, h), dm.s, dm.d, dm.h * dm.d, 1),
                true,
                Threads::One,
            );
        }
    }
    vec![Some(dq), Some(dk), Some(dv)]
}
