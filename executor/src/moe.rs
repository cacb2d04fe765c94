//! A mixture-of-experts MLP with expert parallelism: a linear router scoring the experts, the
//! top-k of each token kept, its hidden state sent to those k experts and their outputs summed
//! with the weights the router gives them (Mixtral, Jiang et al. 2024: softmax scores, the k
//! renormalised to sum to one; DeepSeek-V3, 2024: sigmoid scores, the k chosen within the best
//! expert groups, renormalised and scaled; Qwen2-MoE: softmax scores as they are). Dropless:
//! every token reaches its experts, however many pick one.
//!
//! Under expert parallelism the `ep` ranks of an expert-parallel group each hold `E / ep`
//! experts; tokens travel to the rank of their expert and back in two all-to-alls (dispatch,
//! combine), and again in the backward. No auxiliary load-balancing loss is added (the
//! executor trains the model's main loss only), and DeepSeek-V3's balancing bias, which only
//! steers the choice and is moved by a rule outside the gradient, stays at zero: the choice is
//! by score alone.

use crate::comm::{Collectives, CommError, Group};
use crate::tensor::{add_bias, bias_grad, mm, mm_nt, mm_tn, sigmoid, Act};
use std::ops::Range;

/// Where a block's mixture-of-experts tensors lie: the router in the block's unit buffer, the
/// experts in the experts' unit buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeLayout {
    /// `[hidden, experts]`, whole on every rank.
    pub router: Range<usize>,
    /// This rank's experts' `[local, hidden, ffn]` gate (or first) projection.
    pub w_in: Range<usize>,
    /// SwiGLU's up projection, `[local, hidden, ffn]`.
    pub w_up: Option<Range<usize>>,
    /// `[local, ffn, hidden]`.
    pub w_out: Range<usize>,
    /// Biases (GPT-OSS): the router's `[experts]` beside it, the experts' `[local, ffn]` on
    /// the gate (or first) and up projections and `[local, hidden]` on the output, beside
    /// their weights.
    pub router_bias: Option<Range<usize>>,
    pub b_in: Option<Range<usize>>,
    pub b_up: Option<Range<usize>>,
    pub b_out: Option<Range<usize>>,
    /// The experts' activation.
    pub act: Act,
    /// Experts in all, and top-k.
    pub experts: usize,
    pub top_k: usize,
    /// How the router's logits become each token's experts and weights.
    pub routing: Routing,
}

/// How a router turns a token's logits into its k experts and their weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routing {
    /// Sigmoid scores, one per expert (else a softmax over the experts).
    pub sigmoid: bool,
    /// Group-limited routing: the experts form `groups` contiguous groups and a token's k come
    /// from its best `groups_per_token` of them (no limit where either is 0 or it keeps all).
    pub groups: usize,
    pub groups_per_token: usize,
    /// The k chosen scores renormalised to sum to one.
    pub normalize: bool,
    /// A factor on the weights.
    pub scale: f32,
}

impl Default for Routing {
    /// Mixtral's: softmax, the k renormalised.
    fn default() -> Self {
        Routing {
            sigmoid: false,
            groups: 0,
            groups_per_token: 0,
            normalize: true,
            scale: 1.0,
        }
    }
}

impl Routing {
    /// The routing of the model's mixture.
    pub fn of(m: &parallax_ir::models::MoeConfig) -> Routing {
        Routing {
            sigmoid: m.router == parallax_ir::models::Router::Sigmoid,
            groups: m.groups as usize,
            groups_per_token: m.groups_per_token as usize,
            normalize: m.norm_top_k,
            scale: m.routed_scale() as f32,
        }
    }

    /// Scores `row` (a token's logits) in place and appends its k (expert, weight) picks.
    /// Under a group limit a group's score is, for sigmoid scores, the sum of its best two
    /// (DeepSeek-V3's `noaux_tc`) and, for softmax scores, its best one (DeepSeek-V2's
    /// group-limited greedy choice); the k are the best scores of the kept groups. Ties go
    /// to the lower index.
    fn route(&self, row: &mut [f32], k: usize, picks: &mut Vec<(usize, f32)>) {
        let e = row.len();
        if self.sigmoid {
            row.iter_mut().for_each(|v| *v = sigmoid(*v));
        } else {
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut s = 0.0;
            for v in row.iter_mut() {
                *v = (*v - mx).exp();
                s += *v;
            }
            row.iter_mut().for_each(|v| *v /= s);
        }
        let by_score = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
        let mut allowed: Vec<usize> = (0..e).collect();
        let (g, keep) = (self.groups, self.groups_per_token);
        if g > 1 && keep > 0 && keep < g && e % g == 0 {
            let per = e / g;
            let group_score = |j: usize| -> f32 {
                let mut m: Vec<f32> = row[j * per..(j + 1) * per].to_vec();
                m.sort_by(|a, b| b.total_cmp(a));
                let best = if self.sigmoid { 2.min(per) } else { 1 };
                m[..best].iter().sum()
            };
            let scores: Vec<f32> = (0..g).map(group_score).collect();
            let mut groups: Vec<usize> = (0..g).collect();
            groups.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b)));
            let mut kept = groups[..keep].to_vec();
            kept.sort_unstable();
            allowed = kept.iter().flat_map(|j| j * per..(j + 1) * per).collect();
        }
        allowed.sort_by(by_score);
        let chosen = &allowed[..k.min(allowed.len())];
        let sum: f32 = chosen.iter().map(|i| row[*i]).sum();
        let norm = if self.normalize { sum } else { 1.0 };
        picks.extend(chosen.iter().map(|i| (*i, self.scale * row[*i] / norm)));
    }

    /// The gradient of a token's logits from its scores `pr`, its picks and the gradients
    /// `dw` of their weights.
    fn route_bwd(&self, pr: &[f32], chosen: &[(usize, f32)], dw: &[f32], dlogits: &mut [f32]) {
        let e = pr.len();
        let sum: f32 = chosen.iter().map(|(i, _)| pr[*i]).sum();
        let mut ds = vec![0.0f32; e];
        if self.normalize {
            let dot: f32 = chosen.iter().zip(dw).map(|((i, _), d)| d * pr[*i]).sum();
            for ((i, _), d) in chosen.iter().zip(dw) {
                ds[*i] = self.scale * (d / sum - dot / (sum * sum));
            }
        } else {
            for ((i, _), d) in chosen.iter().zip(dw) {
                ds[*i] = self.scale * d;
            }
        }
        if self.sigmoid {
            for i in 0..e {
                dlogits[i] = ds[i] * pr[i] * (1.0 - pr[i]);
            }
        } else {
            let inner: f32 = ds.iter().zip(pr).map(|(a, b)| a * b).sum();
            for i in 0..e {
                dlogits[i] = pr[i] * (ds[i] - inner);
            }
        }
    }
}

/// What the forward keeps for the backward.
#[derive(Debug)]
pub struct MoeSaved {
    /// Router probabilities, `tokens × experts`.
    probs: Vec<f32>,
    /// Per token, its k experts (global index) and their normalised weights.
    picks: Vec<(usize, f32)>,
    /// Per destination rank, the (token, pick) pairs sent there, in order.
    routes: Vec<Vec<(usize, usize)>>,
    /// Per source rank, the (local expert, row in that expert's batch) of each row received.
    arrivals: Vec<Vec<(usize, usize)>>,
    /// Per local expert: its input rows, pre-activation(s) and activation.
    x: Vec<Vec<f32>>,
    gate: Vec<Vec<f32>>,
    up: Vec<Vec<f32>>,
    act: Vec<Vec<f32>>,
    /// Each (token, pick)'s expert output, `tokens·k × hidden`.
    y: Vec<f32>,
}

impl MoeSaved {
    /// Leaves out the experts' activations, which [`moe_bwd`] recomputes from their
    /// pre-activations (Megatron-Core's `moe_act` recomputation).
    pub fn drop_activations(&mut self) {
        self.act.iter_mut().for_each(|a| *a = Vec::new());
    }
}

/// The expert-parallel context: the group (in expert order) when `ep > 1`.
pub struct Ep<'a> {
    pub comm: &'a mut dyn Collectives,
    pub group: Option<&'a Group>,
}

impl std::fmt::Debug for Ep<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ep").field("group", &self.group).finish()
    }
}

impl Ep<'_> {
    fn size(&self) -> usize {
        self.group.map_or(1, Group::size)
    }

    /// Sends `rows[k]` (rows of `width`) to member `k` and returns what each member sent
    /// here: the row counts first, then the rows.
    fn all_to_all(
        &mut self,
        rows: Vec<Vec<f32>>,
        width: usize,
    ) -> Result<Vec<Vec<f32>>, CommError> {
        let Some(g) = self.group else {
            return Ok(rows);
        };
        let me = g.index_of(self.comm.rank())?;
        let tag = self.comm.next_tag(g);
        for (k, r) in g.ranks().iter().enumerate() {
            if k != me {
                self.comm
                    .send(*r, tag, &[(rows[k].len() / width.max(1)) as f32])?;
                self.comm.send(*r, tag, &rows[k])?;
            }
        }
        let mut out = Vec::with_capacity(g.size());
        for (k, r) in g.ranks().iter().enumerate() {
            if k == me {
                out.push(rows[me].clone());
                continue;
            }
            let mut n = [0.0f32];
            self.comm.recv(*r, tag, &mut n, "expert all-to-all")?;
            let mut buf = vec![0.0; n[0] as usize * width];
            self.comm.recv(*r, tag, &mut buf, "expert all-to-all")?;
            out.push(buf);
        }
        Ok(out)
    }
}

/// Local expert `j`'s part of the expert tensor at `r` (`per` elements an expert).
fn part(r: &Range<usize>, j: usize, per: usize) -> Range<usize> {
    r.start + j * per..r.start + (j + 1) * per
}

/// Mixture-of-experts forward of `x` (`tokens × hidden`) with the router in `p` and this
/// rank's experts in `pe`.
pub fn moe_fwd(
    l: &MoeLayout,
    p: &[f32],
    pe: &[f32],
    x: &[f32],
    h: usize,
    f: usize,
    ep: &mut Ep<'_>,
) -> Result<(Vec<f32>, MoeSaved), CommError> {
    let (e, k) = (l.experts, l.top_k);
    let tokens = x.len() / h;
    let n = ep.size();
    let per = e / n;
    // Router: each token's scores, its k experts and their weights.
    let mut probs = vec![0.0; tokens * e];
    mm(&mut probs, x, &p[l.router.clone()], tokens, h, e, false);
    if let Some(b) = &l.router_bias {
        add_bias(&mut probs, &p[b.clone()]);
    }
    let mut picks = Vec::with_capacity(tokens * k);
    for row in probs.chunks_exact_mut(e) {
        l.routing.route(row, k, &mut picks);
    }
    // Dispatch: each (token, pick) to the rank of its expert, the expert's local index first.
    let mut routes = vec![Vec::new(); n];
    let mut sends = vec![Vec::new(); n];
    for (i, (expert, _)) in picks.iter().enumerate() {
        let dst = expert / per;
        routes[dst].push((i / k, i % k));
        sends[dst].push((expert % per) as f32);
        sends[dst].extend_from_slice(&x[(i / k) * h..(i / k + 1) * h]);
    }
    let got = ep.all_to_all(sends, h + 1)?;
    let mut xs: Vec<Vec<f32>> = vec![Vec::new(); per];
    let mut arrivals = Vec::with_capacity(n);
    for rows in &got {
        let mut here = Vec::with_capacity(rows.len() / (h + 1));
        for row in rows.chunks_exact(h + 1) {
            let j = row[0] as usize;
            here.push((j, xs[j].len() / h));
            xs[j].extend_from_slice(&row[1..]);
        }
        arrivals.push(here);
    }
    // Each local expert on its batch of rows.
    let (mut gate, mut up, mut act, mut ys) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (j, xj) in xs.iter().enumerate() {
        let rows = xj.len() / h;
        let proj = |w: &Range<usize>, b: &Option<Range<usize>>| {
            let mut y = vec![0.0; rows * f];
            mm(&mut y, xj, &pe[part(w, j, h * f)], rows, h, f, false);
            if let Some(b) = b {
                add_bias(&mut y, &pe[part(b, j, f)]);
            }
            y
        };
        let g = proj(&l.w_in, &l.b_in);
        let u = l.w_up.as_ref().map(|w| proj(w, &l.b_up));
        let a = l.act.fwd(&g, u.as_deref());
        let mut y = vec![0.0; rows * h];
        mm(&mut y, &a, &pe[part(&l.w_out, j, f * h)], rows, f, h, false);
        if let Some(b) = &l.b_out {
            add_bias(&mut y, &pe[part(b, j, h)]);
        }
        gate.push(g);
        up.push(u.unwrap_or_default());
        act.push(a);
        ys.push(y);
    }
    // Combine: outputs back in the order they came, weighted into their tokens.
    let back: Vec<Vec<f32>> = arrivals
        .iter()
        .map(|rows| {
            rows.iter()
                .flat_map(|(j, r)| ys[*j][r * h..(r + 1) * h].iter().copied())
                .collect()
        })
        .collect();
    let returned = ep.all_to_all(back, h)?;
    let mut out = vec![0.0; tokens * h];
    let mut y = vec![0.0; tokens * k * h];
    for (dst, list) in routes.iter().enumerate() {
        for (m, (t, j)) in list.iter().enumerate() {
            let row = &returned[dst][m * h..(m + 1) * h];
            let w = picks[t * k + j].1;
            y[(t * k + j) * h..(t * k + j + 1) * h].copy_from_slice(row);
            for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(row) {
                *o += w * v;
            }
        }
    }
    Ok((
        out,
        MoeSaved {
            probs,
            picks,
            routes,
            arrivals,
            x: xs,
            gate,
            up,
            act,
            y,
        },
    ))
}

/// Mixture-of-experts backward: accumulates the router's gradient into `g` and this rank's
/// experts' into `ge`, and returns the input gradient.
#[allow(clippy::too_many_arguments)]
pub fn moe_bwd(
    l: &MoeLayout,
    (p, g): (&[f32], &mut [f32]),
    (pe, ge): (&[f32], &mut [f32]),
    x: &[f32],
    s: MoeSaved,
    dout: &[f32],
    h: usize,
    f: usize,
    ep: &mut Ep<'_>,
) -> Result<Vec<f32>, CommError> {
    let (e, k) = (l.experts, l.top_k);
    let tokens = x.len() / h;
    let n = ep.size();
    let per = e / n;
    // Gradients of the expert outputs (weighted) and of the weights.
    let mut dw = vec![0.0f32; tokens * k];
    let mut sends = vec![Vec::new(); n];
    for (dst, list) in s.routes.iter().enumerate() {
        for (t, j) in list {
            let d = &dout[t * h..(t + 1) * h];
            let w = s.picks[t * k + j].1;
            dw[t * k + j] = d
                .iter()
                .zip(&s.y[(t * k + j) * h..(t * k + j + 1) * h])
                .map(|(a, b)| a * b)
                .sum();
            sends[dst].extend(d.iter().map(|v| w * v));
        }
    }
    let got = ep.all_to_all(sends, h)?;
    let mut dys: Vec<Vec<f32>> = s.x.iter().map(|xj| vec![0.0; xj.len()]).collect();
    for (src, rows) in s.arrivals.iter().enumerate() {
        for (m, (j, r)) in rows.iter().enumerate() {
            dys[*j][r * h..(r + 1) * h].copy_from_slice(&got[src][m * h..(m + 1) * h]);
        }
    }
    let mut dxs = Vec::with_capacity(per);
    for (j, dy) in dys.iter().enumerate() {
        let rows = s.x[j].len() / h;
        let (wi, wo) = (part(&l.w_in, j, h * f), part(&l.w_out, j, f * h));
        if let Some(b) = &l.b_out {
            bias_grad(&mut ge[part(b, j, h)], dy);
        }
        let up = l.w_up.as_ref().map(|_| &s.up[j][..]);
        let act = if s.act[j].is_empty() {
            std::borrow::Cow::Owned(l.act.fwd(&s.gate[j], up))
        } else {
            std::borrow::Cow::Borrowed(&s.act[j][..])
        };
        mm_tn(&mut ge[wo.clone()], &act, dy, rows, f, h, true);
        drop(act);
        let mut da = vec![0.0; rows * f];
        mm_nt(&mut da, dy, &pe[wo], rows, f, h, false);
        let mut dx = vec![0.0; rows * h];
        if let (Some(du), Some(wu)) = (l.act.bwd(&mut da, &s.gate[j], up), &l.w_up) {
            let wu = part(wu, j, h * f);
            if let Some(b) = &l.b_up {
                bias_grad(&mut ge[part(b, j, f)], &du);
            }
            mm_tn(&mut ge[wu.clone()], &s.x[j], &du, rows, h, f, true);
            mm_nt(&mut dx, &du, &pe[wu], rows, h, f, false);
        }
        if let Some(b) = &l.b_in {
            bias_grad(&mut ge[part(b, j, f)], &da);
        }
        mm_tn(&mut ge[wi.clone()], &s.x[j], &da, rows, h, f, true);
        mm_nt(&mut dx, &da, &pe[wi], rows, h, f, true);
        dxs.push(dx);
    }
    let back: Vec<Vec<f32>> = s
        .arrivals
        .iter()
        .map(|rows| {
            rows.iter()
                .flat_map(|(j, r)| dxs[*j][r * h..(r + 1) * h].iter().copied())
                .collect()
        })
        .collect();
    let returned = ep.all_to_all(back, h)?;
    let mut dx = vec![0.0; tokens * h];
    for (dst, list) in s.routes.iter().enumerate() {
        for (m, (t, _)) in list.iter().enumerate() {
            for (o, v) in dx[t * h..(t + 1) * h]
                .iter_mut()
                .zip(&returned[dst][m * h..(m + 1) * h])
            {
                *o += v;
            }
        }
    }
    // Router: through the weights and the scores.
    let mut dlogits = vec![0.0; tokens * e];
    for t in 0..tokens {
        l.routing.route_bwd(
            &s.probs[t * e..(t + 1) * e],
            &s.picks[t * k..(t + 1) * k],
            &dw[t * k..(t + 1) * k],
            &mut dlogits[t * e..(t + 1) * e],
        );
    }
    if let Some(b) = &l.router_bias {
        bias_grad(&mut g[b.clone()], &dlogits);
    }
    mm_tn(&mut g[l.router.clone()], x, &dlogits, tokens, h, e, true);
    mm_nt(&mut dx, &dlogits, &p[l.router.clone()], tokens, h, e, true);
    Ok(dx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ThreadComm;
    use crate::testing::check_grad;

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        crate::testing::rand(n, seed, 0.5)
    }

    /// Router, experts and input gradients of the layer against central differences of
    /// `Σ r · out`, SwiGLU and GeLU experts, under each routing: Mixtral's, Qwen2-MoE's
    /// unnormalised softmax, DeepSeek-V3's scaled sigmoid within the best of two groups, and
    /// unnormalised sigmoid scores.
    #[test]
    fn moe_gradients_match_finite_differences() {
        let routings = [
            Routing::default(),
            Routing {
                normalize: false,
                ..Routing::default()
            },
            Routing {
                sigmoid: true,
                groups: 2,
                groups_per_token: 1,
                scale: 2.5,
                ..Routing::default()
            },
            Routing {
                sigmoid: true,
                normalize: false,
                ..Routing::default()
            },
        ];
        // GPT-OSS's experts: biases everywhere and the clamped gate.
        let acts = [
            (Act::Swiglu, false),
            (Act::Gelu, false),
            (Act::ClampedSwiglu, true),
        ];
        for ((act, biased), routing) in acts
            .into_iter()
            .flat_map(|a| routings.iter().map(move |r| (a, *r)))
        {
            let swiglu = act != Act::Gelu;
            let (tokens, h, f, e, k) = (5, 4, 3, 4, 2);
            // Router and experts in one vector for the test, one tensor after another.
            let mut end = 0;
            let mut take = |on: bool, n: usize| {
                on.then(|| {
                    end += n;
                    end - n..end
                })
            };
            let router = take(true, h * e).unwrap_or_default();
            let router_bias = take(biased, e);
            let w_in = take(true, e * h * f).unwrap_or_default();
            let b_in = take(biased, e * f);
            let w_up = take(swiglu, e * h * f);
            let b_up = take(swiglu && biased, e * f);
            let w_out = take(true, e * f * h).unwrap_or_default();
            let b_out = take(biased, e * h);
            let l = MoeLayout {
                router,
                w_in,
                w_up,
                w_out,
                router_bias,
                b_in,
                b_up,
                b_out,
                act,
                experts: e,
                top_k: k,
                routing,
            };
            let p = rand(end, 1);
            let x = rand(tokens * h, 2);
            let r = rand(tokens * h, 3);
            let (mut comms, _) = ThreadComm::create(1, std::time::Duration::from_secs(5));
            let comm = &mut comms[0];
            let objective = |p: &[f32], x: &[f32], comm: &mut ThreadComm| -> f64 {
                let mut ep = Ep { comm, group: None };
                let (y, _) = moe_fwd(&l, p, p, x, h, f, &mut ep).unwrap();
                y.iter().zip(&r).map(|(a, b)| f64::from(a * b)).sum()
            };
            let mut ep = Ep {
                comm: &mut *comm,
                group: None,
            };
            let (_, saved) = moe_fwd(&l, &p, &p, &x, h, f, &mut ep).unwrap();
            let mut g = vec![0.0; p.len()];
            let mut ge = vec![0.0; p.len()];
            let dx = moe_bwd(
                &l,
                (&p, &mut g),
                (&p, &mut ge),
                &x,
                saved,
                &r,
                h,
                f,
                &mut ep,
            )
            .unwrap();
            crate::tensor::add_into(&mut g, &ge);
            let what = format!("({act:?}, biases {biased}, {routing:?})");
            check_grad(
                &format!("dx {what}"),
                &x,
                &dx,
                (0..x.len()).step_by(3),
                1e-2,
                |x| objective(&p, x, comm),
            );
            check_grad(
                &format!("dp {what}"),
                &p,
                &g,
                (0..p.len()).step_by(5),
                1e-2,
                |p| objective(p, &x, comm),
            );
        }
    }
}
