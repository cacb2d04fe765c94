//! Mamba-2's mixer (Dao & Gu 2024, "Transformers are SSMs") as Nemotron-H's Mamba layers run
//! it (Megatron-Core's `MambaMixer`, HF's `NemotronHMamba2Mixer`): input projections to the
//! gate `z`, the channels `x`, the per-group `B` and `C` and the per-head step `dt`; a causal
//! depthwise convolution with SiLU over `x`, `B` and `C`; the state-space scan per head,
//! `S_t = exp(dt_t·A)·S_{t−1} + dt_t·x_t·B_tᵀ`, `y_t = S_t·C_t + D·x_t` (`A = −exp(A_log)`,
//! `dt = softplus(dt + dt_bias)`); the output gated by `silu(z)`, RMS-normalised per group of
//! heads, and projected back. Under tensor parallelism each rank holds `heads / tp` heads and
//! `groups / tp` groups (the projections split by columns, the output projection by rows).
//!
//! The scan runs step by step; backward keeps the state at every `chunk`-th step and
//! recomputes the states within a chunk from it (memory of one state per chunk and head).

use crate::tensor::{bias_grad, mm, mm_nt, sigmoid, NORM_EPS};
use std::ops::Range;

/// A mixer's sizes on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mamba {
    /// This rank's heads and groups.
    pub heads: usize,
    pub groups: usize,
    pub head_dim: usize,
    pub state: usize,
    pub kernel: usize,
    /// Steps between the states backward keeps.
    pub chunk: usize,
}

impl Mamba {
    fn inner(&self) -> usize {
        self.heads * self.head_dim
    }
    fn bc(&self) -> usize {
        self.groups * self.state
    }
}

/// Where a mixer's tensors lie in its unit: the five input projections (`[hidden, width]`),
/// the convolutions of `x`, `B` and `C` (`[channels, kernel]`, with biases), the per-head
/// `dt_bias`, `A_log` and `D`, the gated norm's weight (`[inner]`) and the output projection
/// (`[inner, hidden]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MambaLayout {
    pub w_z: Range<usize>,
    pub w_x: Range<usize>,
    pub w_b: Range<usize>,
    pub w_c: Range<usize>,
    pub w_dt: Range<usize>,
    pub conv: [(Range<usize>, Range<usize>); 3],
    pub dt_bias: Range<usize>,
    pub a_log: Range<usize>,
    pub d: Range<usize>,
    pub norm: Range<usize>,
    pub out: Range<usize>,
}

/// What the mixer keeps for backward.
#[derive(Debug)]
pub struct MambaSaved {
    z: Vec<f32>,
    /// The projections before the convolution (`x`, `B`, `C`) and the convolutions' outputs
    /// before their SiLU.
    raw: [Vec<f32>; 3],
    pre: [Vec<f32>; 3],
    /// `dt` before the softplus (bias added) and after it.
    dt_pre: Vec<f32>,
    dt: Vec<f32>,
    y: Vec<f32>,
    /// The gated output before the norm, its per-group inverse RMS, and after the norm.
    gated: Vec<f32>,
    rstd: Vec<f32>,
    normed: Vec<f32>,
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Causal depthwise convolution of `x` (`batch·seq × ch`) with `w` (`[ch, k]`) and `b`: the
/// output at step `t` reads steps `t − k + 1 ..= t` of its own sequence.
fn conv_fwd(x: &[f32], w: &[f32], b: &[f32], seq: usize, ch: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    for (ys, xs) in y.chunks_exact_mut(seq * ch).zip(x.chunks_exact(seq * ch)) {
        for t in 0..seq {
            for c in 0..ch {
                let mut v = b[c];
                for j in 0..k {
                    if let Some(src) = (t + j).checked_sub(k - 1) {
                        v += w[c * k + j] * xs[src * ch + c];
                    }
                }
                ys[t * ch + c] = v;
            }
        }
    }
    y
}

/// Backward of [`conv_fwd`]: accumulates the weight and bias gradients, returns `dx`.
#[allow(clippy::too_many_arguments)]
fn conv_bwd(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    (dw, db): (&mut [f32], &mut [f32]),
    seq: usize,
    ch: usize,
    k: usize,
) -> Vec<f32> {
    let mut dx = vec![0.0; x.len()];
    bias_grad(db, dy);
    for ((dys, xs), dxs) in dy
        .chunks_exact(seq * ch)
        .zip(x.chunks_exact(seq * ch))
        .zip(dx.chunks_exact_mut(seq * ch))
    {
        for t in 0..seq {
            for c in 0..ch {
                let g = dys[t * ch + c];
                for j in 0..k {
                    if let Some(src) = (t + j).checked_sub(k - 1) {
                        dw[c * k + j] += g * xs[src * ch + c];
                        dxs[src * ch + c] += g * w[c * k + j];
                    }
                }
            }
        }
    }
    dx
}

/// The scan's inputs for one head of one sequence, read in place.
struct Scan<'a> {
    m: Mamba,
    seq: usize,
    x: &'a [f32],
    b: &'a [f32],
    c: &'a [f32],
    dt: &'a [f32],
}

impl Scan<'_> {
    /// Offsets of step `t` of sequence `s`, head `h`: into `x` (`p` wide), `B`/`C` (`n` wide),
    /// `dt`.
    fn at(&self, s: usize, t: usize, h: usize) -> (usize, usize, usize) {
        let m = self.m;
        let row = s * self.seq + t;
        let g = h / (m.heads / m.groups);
        (
            row * m.inner() + h * m.head_dim,
            row * m.bc() + g * m.state,
            row * m.heads + h,
        )
    }

    /// One step: `S ← a·S + dt·x·Bᵀ`.
    fn step(&self, st: &mut [f32], s: usize, t: usize, h: usize, a_coef: f32) {
        let (m, (xo, bo, to)) = (self.m, self.at(s, t, h));
        let decay = (self.dt[to] * a_coef).exp();
        for i in 0..m.head_dim {
            let xi = self.dt[to] * self.x[xo + i];
            let row = &mut st[i * m.state..(i + 1) * m.state];
            for (v, bj) in row.iter_mut().zip(&self.b[bo..bo + m.state]) {
                *v = decay * *v + xi * bj;
            }
        }
    }
}

/// Mixer forward on the rows `n` (`batch·seq × hidden`, whole sequences) with parameters `p`.
pub fn mamba_fwd(
    m: Mamba,
    l: &MambaLayout,
    p: &[f32],
    n: &[f32],
    h: usize,
    seq: usize,
) -> (Vec<f32>, MambaSaved) {
    let tt = n.len() / h;
    let proj = |w: &Range<usize>, width: usize| {
        let mut y = vec![0.0; tt * width];
        mm(&mut y, n, &p[w.clone()], tt, h, width, false);
        y
    };
    let (inner, bc, heads) = (m.inner(), m.bc(), m.heads);
    let z = proj(&l.w_z, inner);
    let raw = [proj(&l.w_x, inner), proj(&l.w_b, bc), proj(&l.w_c, bc)];
    let widths = [inner, bc, bc];
    let pre: [Vec<f32>; 3] = std::array::from_fn(|i| {
        let (w, b) = &l.conv[i];
        conv_fwd(
            &raw[i],
            &p[w.clone()],
            &p[b.clone()],
            seq,
            widths[i],
            m.kernel,
        )
    });
    let act = pre
        .clone()
        .map(|v| v.into_iter().map(silu).collect::<Vec<f32>>());
    let mut dt_pre = proj(&l.w_dt, heads);
    let dtb = &p[l.dt_bias.clone()];
    for row in dt_pre.chunks_exact_mut(heads) {
        row.iter_mut().zip(dtb).for_each(|(v, b)| *v += b);
    }
    let dt: Vec<f32> = dt_pre.iter().map(|v| softplus(*v)).collect();
    let (a_log, dd) = (&p[l.a_log.clone()], &p[l.d.clone()]);
    let scan = Scan {
        m,
        seq,
        x: &act[0],
        b: &act[1],
        c: &act[2],
        dt: &dt,
    };
    let mut y = vec![0.0; tt * inner];
    let mut st = vec![0.0; m.head_dim * m.state];
    for s in 0..tt / seq {
        for hh in 0..heads {
            st.fill(0.0);
            let a_coef = -a_log[hh].exp();
            for t in 0..seq {
                scan.step(&mut st, s, t, hh, a_coef);
                let (xo, bo, _) = scan.at(s, t, hh);
                let c = &scan.c[bo..bo + m.state];
                for i in 0..m.head_dim {
                    let row = &st[i * m.state..(i + 1) * m.state];
                    let v: f32 = row.iter().zip(c).map(|(a, b)| a * b).sum();
                    y[xo + i] = v + dd[hh] * scan.x[xo + i];
                }
            }
        }
    }
    // Gated by silu(z), RMS-normalised per group of heads.
    let gated: Vec<f32> = y.iter().zip(&z).map(|(a, b)| a * silu(*b)).collect();
    let gw = inner / m.groups;
    let w = &p[l.norm.clone()];
    let mut normed = vec![0.0; gated.len()];
    let mut rstd = Vec::with_capacity(gated.len() / gw);
    for (k, (o, v)) in normed
        .chunks_exact_mut(gw)
        .zip(gated.chunks_exact(gw))
        .enumerate()
    {
        let ms = v.iter().map(|x| x * x).sum::<f32>() / gw as f32;
        let r = 1.0 / (ms + NORM_EPS).sqrt();
        let w = &w[(k % m.groups) * gw..][..gw];
        for ((o, x), w) in o.iter_mut().zip(v).zip(w) {
            *o = x * r * w;
        }
        rstd.push(r);
    }
    let mut out = vec![0.0; tt * h];
    mm(&mut out, &normed, &p[l.out.clone()], tt, inner, h, false);
    (
        out,
        MambaSaved {
            z,
            raw,
            pre,
            dt_pre,
            dt,
            y,
            gated,
            rstd,
            normed,
        },
    )
}

/// Where a block's backward sends a weight gradient (`g`'s range, input, output gradient,
/// rows, in, out): accumulated now, or deferred to a zero-bubble W pass.
pub type WeightGradFn<'a> =
    dyn FnMut(&mut [f32], &Range<usize>, &[f32], &[f32], usize, usize, usize) + 'a;

/// Mixer backward: the parameter gradients into `g` (the projections' through `wgrad`) and
/// the gradient of the rows `n`.
#[allow(clippy::too_many_arguments)]
pub fn mamba_bwd(
    m: Mamba,
    l: &MambaLayout,
    (p, g): (&[f32], &mut [f32]),
    n: &[f32],
    s: &MambaSaved,
    dout: &[f32],
    (h, seq): (usize, usize),
    wgrad: &mut WeightGradFn<'_>,
) -> Vec<f32> {
    let tt = n.len() / h;
    let (inner, bc, heads) = (m.inner(), m.bc(), m.heads);
    // Output projection and the gated norm.
    wgrad(g, &l.out, &s.normed, dout, tt, inner, h);
    let mut dnormed = vec![0.0; tt * inner];
    mm_nt(&mut dnormed, dout, &p[l.out.clone()], tt, inner, h, false);
    let gw = inner / m.groups;
    let w = &p[l.norm.clone()];
    let mut dgated = vec![0.0; tt * inner];
    for (k, ((dg, dn), v)) in dgated
        .chunks_exact_mut(gw)
        .zip(dnormed.chunks_exact(gw))
        .zip(s.gated.chunks_exact(gw))
        .enumerate()
    {
        let r = s.rstd[k];
        let at = (k % m.groups) * gw;
        let dw = &mut g[l.norm.start + at..l.norm.start + at + gw];
        let mut dot = 0.0;
        for j in 0..gw {
            dw[j] += dn[j] * v[j] * r;
            dot += dn[j] * w[at + j] * v[j];
        }
        let c = dot * r * r * r / gw as f32;
        for j in 0..gw {
            dg[j] = dn[j] * w[at + j] * r - v[j] * c;
        }
    }
    let mut dz = vec![0.0; tt * inner];
    let mut dy = vec![0.0; tt * inner];
    for i in 0..tt * inner {
        dy[i] = dgated[i] * silu(s.z[i]);
        dz[i] = dgated[i] * s.y[i] * silu_grad(s.z[i]);
    }
    // The scan, backward, recomputing each chunk's states from the one kept at its start.
    let act = s
        .pre
        .clone()
        .map(|v| v.into_iter().map(silu).collect::<Vec<f32>>());
    let scan = Scan {
        m,
        seq,
        x: &act[0],
        b: &act[1],
        c: &act[2],
        dt: &s.dt,
    };
    let (a_log, dd) = (&p[l.a_log.clone()], &p[l.d.clone()]);
    let mut dact = [
        vec![0.0; tt * inner],
        vec![0.0; tt * bc],
        vec![0.0; tt * bc],
    ];
    let mut ddt = vec![0.0; tt * heads];
    let (mut da_log, mut d_d) = (vec![0.0; heads], vec![0.0; heads]);
    let ps = m.head_dim * m.state;
    let chunk = m.chunk.clamp(1, seq);
    for sq in 0..tt / seq {
        for hh in 0..heads {
            let a_coef = -a_log[hh].exp();
            // States at the start of every chunk.
            let starts: Vec<Vec<f32>> = {
                let mut st = vec![0.0; ps];
                let mut v = Vec::new();
                for t in 0..seq {
                    if t % chunk == 0 {
                        v.push(st.clone());
                    }
                    scan.step(&mut st, sq, t, hh, a_coef);
                }
                v
            };
            let mut gs = vec![0.0; ps];
            for (ci, start) in starts.iter().enumerate().rev() {
                let t0 = ci * chunk;
                let t1 = (t0 + chunk).min(seq);
                // states[j] = S_{t0 + j − 1} (states[0] the chunk's start).
                let mut states = vec![start.clone()];
                for t in t0..t1 {
                    let mut st = states[states.len() - 1].clone();
                    scan.step(&mut st, sq, t, hh, a_coef);
                    states.push(st);
                }
                for t in (t0..t1).rev() {
                    let (xo, bo, to) = scan.at(sq, t, hh);
                    let (cur, prev) = (&states[t - t0 + 1], &states[t - t0]);
                    let c = &scan.c[bo..bo + m.state];
                    let b = &scan.b[bo..bo + m.state];
                    let (dtv, x) = (scan.dt[to], &scan.x[xo..xo + m.head_dim]);
                    let decay = (dtv * a_coef).exp();
                    let mut through_decay = 0.0;
                    for i in 0..m.head_dim {
                        let dyi = dy[xo + i];
                        d_d[hh] += dyi * x[i];
                        dact[0][xo + i] += dd[hh] * dyi;
                        let grow = &mut gs[i * m.state..(i + 1) * m.state];
                        let srow = &cur[i * m.state..(i + 1) * m.state];
                        let prow = &prev[i * m.state..(i + 1) * m.state];
                        let mut gb = 0.0;
                        for j in 0..m.state {
                            // y_t = S_t·C_t
                            dact[2][bo + j] += srow[j] * dyi;
                            grow[j] += dyi * c[j];
                            // S_t = a·S_{t−1} + dt·x·Bᵀ
                            gb += grow[j] * b[j];
                            dact[1][bo + j] += dtv * grow[j] * x[i];
                            through_decay += grow[j] * prow[j];
                        }
                        dact[0][xo + i] += dtv * gb;
                        ddt[to] += x[i] * gb;
                        grow.iter_mut().for_each(|v| *v *= decay);
                    }
                    ddt[to] += through_decay * decay * a_coef;
                    da_log[hh] += through_decay * decay * dtv * a_coef;
                }
            }
        }
    }
    for (r, v) in [(&l.a_log, &da_log), (&l.d, &d_d)] {
        g[r.clone()]
            .iter_mut()
            .zip(v.iter())
            .for_each(|(a, b)| *a += b);
    }
    // dt: softplus and its bias.
    for (d, x) in ddt.iter_mut().zip(&s.dt_pre) {
        *d *= sigmoid(*x);
    }
    bias_grad(&mut g[l.dt_bias.clone()], &ddt);
    // The convolutions and their SiLU, then the input projections.
    let widths = [inner, bc, bc];
    let mut dn = vec![0.0; tt * h];
    let projs = [&l.w_x, &l.w_b, &l.w_c];
    for i in 0..3 {
        let mut du = std::mem::take(&mut dact[i]);
        for (d, x) in du.iter_mut().zip(&s.pre[i]) {
            *d *= silu_grad(*x);
        }
        let (w, b) = &l.conv[i];
        let (dw, db) = split_pair(g, w, b);
        let draw = conv_bwd(
            &du,
            &s.raw[i],
            &p[w.clone()],
            (dw, db),
            seq,
            widths[i],
            m.kernel,
        );
        wgrad(g, projs[i], n, &draw, tt, h, widths[i]);
        mm_nt(&mut dn, &draw, &p[projs[i].clone()], tt, h, widths[i], true);
    }
    wgrad(g, &l.w_z, n, &dz, tt, h, inner);
    mm_nt(&mut dn, &dz, &p[l.w_z.clone()], tt, h, inner, true);
    wgrad(g, &l.w_dt, n, &ddt, tt, h, heads);
    mm_nt(&mut dn, &ddt, &p[l.w_dt.clone()], tt, h, heads, true);
    dn
}

/// Two disjoint mutable ranges of `g`, `a` before `b`.
fn split_pair<'a>(
    g: &'a mut [f32],
    a: &Range<usize>,
    b: &Range<usize>,
) -> (&'a mut [f32], &'a mut [f32]) {
    let (left, right) = g.split_at_mut(b.start);
    (&mut left[a.clone()], &mut right[..b.len()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::mm_tn;
    use crate::testing::{check_grad, rand};

    /// The mixer's parameter and input gradients against central differences of
    /// `Σ r · mixer(n)`, with chunks shorter than the sequences (states recomputed from the
    /// chunk starts).
    #[test]
    fn mamba_gradients_match_finite_differences() {
        let m = Mamba {
            heads: 4,
            groups: 2,
            head_dim: 3,
            state: 2,
            kernel: 3,
            chunk: 2,
        };
        let (h, seq, batch) = (5, 5, 2);
        let (inner, bc) = (m.inner(), m.bc());
        let mut at = 0;
        let mut take = |n: usize| {
            at += n;
            at - n..at
        };
        let l = MambaLayout {
            w_z: take(h * inner),
            w_x: take(h * inner),
            w_b: take(h * bc),
            w_c: take(h * bc),
            w_dt: take(h * m.heads),
            conv: [
                (take(inner * m.kernel), take(inner)),
                (take(bc * m.kernel), take(bc)),
                (take(bc * m.kernel), take(bc)),
            ],
            dt_bias: take(m.heads),
            a_log: take(m.heads),
            d: take(m.heads),
            norm: take(inner),
            out: take(inner * h),
        };
        let mut p = rand(at, 1, 0.5);
        p[l.norm.clone()].iter_mut().for_each(|v| *v += 1.0);
        let n = rand(batch * seq * h, 2, 1.0);
        let r = rand(batch * seq * h, 3, 1.0);
        let objective = |p: &[f32], n: &[f32]| -> f64 {
            let (y, _) = mamba_fwd(m, &l, p, n, h, seq);
            y.iter().zip(&r).map(|(a, b)| f64::from(a * b)).sum()
        };
        let (_, saved) = mamba_fwd(m, &l, &p, &n, h, seq);
        let mut g = vec![0.0; p.len()];
        let mut wgrad = |g: &mut [f32], w: &Range<usize>, x: &[f32], dy: &[f32], rows, k, o| {
            mm_tn(&mut g[w.clone()], x, dy, rows, k, o, true);
        };
        let dn = mamba_bwd(m, &l, (&p, &mut g), &n, &saved, &r, (h, seq), &mut wgrad);
        // Steps of 1e-2 are too coarse for the scan's exponentials.
        let eps = 3e-3;
        check_grad("dn", &n, &dn, (0..n.len()).step_by(3), eps, |n| {
            objective(&p, n)
        });
        check_grad("dp", &p, &g, (0..p.len()).step_by(2), eps, |p| {
            objective(p, &n)
        });
    }
}
