//! Ring attention for context parallelism (Liu et al. 2023; Megatron-Core's
//! `context_parallel` p2p path): each of the `cp` ranks holds two load-balanced chunks of every
//! sequence (see [`Pass`]); its queries stay put while the keys and values travel around the
//! ring, one rank's block per step, and each step's scores are merged into a running softmax
//! (the row maximum, the sum of exponentials and the weighted values, rescaled as the maximum
//! grows). The backward recomputes each step's probabilities from the saved log-sum-exp and
//! sends the key/value gradients around the ring with their block, so that after `cp` steps
//! every rank holds the gradient of its own keys and values. Causal masking compares the
//! positions the chunks hold (a sliding window too: a key more than `window − 1` positions
//! behind a query is masked); a block entirely in a query row's future, or entirely behind its
//! window, contributes nothing. Attention sinks (GPT-OSS: a learned logit per head that holds
//! no value) join each row's normaliser once, when the ring's running softmax is finished.

use crate::comm::{Collectives, CommError, Group};
use crate::model::Pass;
use crate::tensor::{matmul, Mask, MatMut, MatRef, Threads};

/// Shapes of one rank's attention: sequences, local tokens per sequence, query and key/value
/// heads, head size.
#[derive(Clone, Copy, Debug)]
pub struct RingShape {
    pub batch: usize,
    pub lseq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    /// The keys a query sees.
    pub mask: Mask,
}

impl RingShape {
    fn qw(&self) -> usize {
        self.heads * self.hd
    }
    fn kw(&self) -> usize {
        self.kv_heads * self.hd
    }
}

/// Sends this step's block to the next rank of the ring and receives the previous rank's.
fn rotate(
    comm: &mut dyn Collectives,
    g: &Group,
    bufs: &mut [&mut Vec<f32>],
) -> Result<(), CommError> {
    let n = g.size();
    let me = g.index_of(comm.rank())?;
    let (next, prev) = (g.ranks()[(me + 1) % n], g.ranks()[(me + n - 1) % n]);
    let tag = comm.next_tag(g);
    // Blocks are handed over, not copied, where the backend can (threads).
    let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
    for b in bufs.iter_mut() {
        comm.send_owned(next, tag, std::mem::take(*b))?;
    }
    for (b, len) in bufs.iter_mut().zip(lens) {
        **b = comm.recv_owned(prev, tag, len, "ring attention")?;
    }
    Ok(())
}

/// Masked, scaled scores of queries `q` (rows at `q_pos`) against keys `k` (rows at `k_pos`)
/// of sequence `b`, head `h`, into `s` (`lseq × lseq`); `false` where every key is masked
/// for every query (nothing to do).
fn scores(
    s: &mut [f32],
    (q, k): (&[f32], &[f32]),
    (b, h): (usize, usize),
    (q_pos, k_pos): (&[usize], &[usize]),
    r: &RingShape,
) -> bool {
    let (Some(&q_lo), Some(&q_hi)) = (q_pos.iter().min(), q_pos.iter().max()) else {
        return false;
    };
    let (Some(&k_lo), Some(&k_hi)) = (k_pos.iter().min(), k_pos.iter().max()) else {
        return false;
    };
    let skipped = match r.mask {
        Mask::All => false,
        Mask::Causal(w) => q_hi < k_lo || w.is_some_and(|w| q_lo >= k_hi + w),
    };
    if skipped {
        return false;
    }
    let kvh = h / (r.heads / r.kv_heads);
    let n = r.lseq;
    matmul(
        MatMut::new(s, n, n),
        MatRef::strided(q, b * n * r.qw() + h * r.hd, n, r.hd, r.qw(), 1),
        MatRef::strided(k, b * n * r.kw() + kvh * r.hd, n, r.hd, r.kw(), 1).t(),
        false,
        Threads::One,
    );
    let scale = 1.0 / (r.hd as f32).sqrt();
    for (i, row) in s.chunks_exact_mut(n).enumerate() {
        for (j, x) in row.iter_mut().enumerate() {
            *x = if r.mask.sees(q_pos[i], k_pos[j]) {
                *x * scale
            } else {
                f32::NEG_INFINITY
            };
        }
    }
    true
}

/// Ring attention forward: the output of this rank's queries (`batch·lseq × heads·hd`) and
/// the log-sum-exp of every query row (`batch · heads · lseq`, the sink's term included),
/// which the backward needs; `sinks` holds this rank's heads' sink logits.
pub fn ring_fwd(
    comm: &mut dyn Collectives,
    g: &Group,
    (q, k, v): (&[f32], &[f32], &[f32]),
    sinks: Option<&[f32]>,
    pass: &Pass,
    r: &RingShape,
) -> Result<(Vec<f32>, Vec<f32>), CommError> {
    let n = r.lseq;
    let cp = g.size();
    let me = g.index_of(comm.rank())?;
    let q_pos = pass.positions();
    let rows = r.batch * r.heads * n;
    let (mut m, mut l) = (vec![f32::NEG_INFINITY; rows], vec![0.0f32; rows]);
    let mut o = vec![0.0; q.len()];
    let (mut kb, mut vb) = (k.to_vec(), v.to_vec());
    let mut s = vec![0.0; n * n];
    for step in 0..cp {
        let src = (me + cp - step) % cp;
        let k_pos: Vec<usize> = (0..n).map(|i| pass.position_of(src, i)).collect();
        for b in 0..r.batch {
            for h in 0..r.heads {
                if !scores(&mut s, (q, &kb), (b, h), (&q_pos, &k_pos), r) {
                    continue;
                }
                let base = (b * r.heads + h) * n;
                for (i, row) in s.chunks_exact_mut(n).enumerate() {
                    let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let at = base + i;
                    if mx == f32::NEG_INFINITY {
                        row.fill(0.0);
                        continue;
                    }
                    let m_new = m[at].max(mx);
                    let keep = (m[at] - m_new).exp();
                    let mut sum = 0.0;
                    // Masked scores (−∞) weigh nothing: no exponential for them.
                    for x in row.iter_mut() {
                        if *x > f32::NEG_INFINITY {
                            *x = (*x - m_new).exp();
                            sum += *x;
                        } else {
                            *x = 0.0;
                        }
                    }
                    l[at] = l[at] * keep + sum;
                    m[at] = m_new;
                    let oi = (b * n + i) * r.qw() + h * r.hd;
                    o[oi..oi + r.hd].iter_mut().for_each(|x| *x *= keep);
                }
                let kvh = h / (r.heads / r.kv_heads);
                matmul(
                    MatMut::strided(&mut o, b * n * r.qw() + h * r.hd, n, r.hd, r.qw(), 1),
                    MatRef::new(&s, n, n),
                    MatRef::strided(&vb, b * n * r.kw() + kvh * r.hd, n, r.hd, r.kw(), 1),
                    true,
                    Threads::One,
                );
            }
        }
        if step + 1 < cp {
            rotate(comm, g, &mut [&mut kb, &mut vb])?;
        }
    }
    let mut lse = vec![0.0; rows];
    for b in 0..r.batch {
        for h in 0..r.heads {
            for i in 0..n {
                let at = (b * r.heads + h) * n + i;
                let oi = (b * n + i) * r.qw() + h * r.hd;
                // The sink's exponential joins the normaliser at the row's final maximum.
                let (mx, sum) = match sinks.map(|s| s[h]) {
                    Some(sk) => {
                        let mx = m[at].max(sk);
                        (mx, l[at] * (m[at] - mx).exp() + (sk - mx).exp())
                    }
                    None => (m[at], l[at]),
                };
                let keep = (m[at] - mx).exp() / sum;
                o[oi..oi + r.hd].iter_mut().for_each(|x| *x *= keep);
                lse[at] = mx + sum.ln();
            }
        }
    }
    Ok((o, lse))
}

/// The gradients of a rank's queries, keys and values.
pub type QkvGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Ring attention backward: the gradients of this rank's queries, keys and values, and with
/// sinks their gradient into `dsinks`: a row's sink, holding no value, takes
/// `−p_sink · (dO · O)` (this rank's rows; the other context-parallel ranks add theirs).
#[allow(clippy::too_many_arguments)]
pub fn ring_bwd(
    comm: &mut dyn Collectives,
    g: &Group,
    d_o: &[f32],
    (q, k, v): (&[f32], &[f32], &[f32]),
    (o, lse): (&[f32], &[f32]),
    (sinks, dsinks): (Option<&[f32]>, Option<&mut [f32]>),
    pass: &Pass,
    r: &RingShape,
) -> Result<QkvGrads, CommError> {
    let n = r.lseq;
    let cp = g.size();
    let me = g.index_of(comm.rank())?;
    let q_pos = pass.positions();
    let scale = 1.0 / (r.hd as f32).sqrt();
    // D_i = dO_i · O_i per query row and head.
    let mut dsum = vec![0.0f32; r.batch * r.heads * n];
    for b in 0..r.batch {
        for h in 0..r.heads {
            for i in 0..n {
                let oi = (b * n + i) * r.qw() + h * r.hd;
                dsum[(b * r.heads + h) * n + i] = d_o[oi..oi + r.hd]
                    .iter()
                    .zip(&o[oi..oi + r.hd])
                    .map(|(a, b)| a * b)
                    .sum();
            }
        }
    }
    if let (Some(sk), Some(ds)) = (sinks, dsinks) {
        for b in 0..r.batch {
            for (h, d) in ds.iter_mut().enumerate() {
                let base = (b * r.heads + h) * n;
                for i in 0..n {
                    *d -= (sk[h] - lse[base + i]).exp() * dsum[base + i];
                }
            }
        }
    }
    let mut dq = vec![0.0; q.len()];
    let (mut kb, mut vb) = (k.to_vec(), v.to_vec());
    let (mut dkb, mut dvb) = (vec![0.0; k.len()], vec![0.0; v.len()]);
    let (mut s, mut dp) = (vec![0.0; n * n], vec![0.0; n * n]);
    for step in 0..cp {
        let src = (me + cp - step) % cp;
        let k_pos: Vec<usize> = (0..n).map(|i| pass.position_of(src, i)).collect();
        for b in 0..r.batch {
            for h in 0..r.heads {
                if !scores(&mut s, (q, &kb), (b, h), (&q_pos, &k_pos), r) {
                    continue;
                }
                let base = (b * r.heads + h) * n;
                for (i, row) in s.chunks_exact_mut(n).enumerate() {
                    for x in row.iter_mut() {
                        *x = if *x > f32::NEG_INFINITY {
                            (*x - lse[base + i]).exp()
                        } else {
                            0.0
                        };
                    }
                }
                let kvh = h / (r.heads / r.kv_heads);
                let (qo, ko) = (b * n * r.qw() + h * r.hd, b * n * r.kw() + kvh * r.hd);
                // dV += Pᵀ dO; dP = dO Vᵀ
                matmul(
                    MatMut::strided(&mut dvb, ko, n, r.hd, r.kw(), 1),
                    MatRef::new(&s, n, n).t(),
                    MatRef::strided(d_o, qo, n, r.hd, r.qw(), 1),
                    true,
                    Threads::One,
                );
                matmul(
                    MatMut::new(&mut dp, n, n),
                    MatRef::strided(d_o, qo, n, r.hd, r.qw(), 1),
                    MatRef::strided(&vb, ko, n, r.hd, r.kw(), 1).t(),
                    false,
                    Threads::One,
                );
                for (i, (drow, prow)) in dp.chunks_exact_mut(n).zip(s.chunks_exact(n)).enumerate() {
                    for (d, p) in drow.iter_mut().zip(prow) {
                        *d = p * (*d - dsum[base + i]) * scale;
                    }
                }
                // dQ += dS K; dK += dSᵀ Q
                matmul(
                    MatMut::strided(&mut dq, qo, n, r.hd, r.qw(), 1),
                    MatRef::new(&dp, n, n),
                    MatRef::strided(&kb, ko, n, r.hd, r.kw(), 1),
                    true,
                    Threads::One,
                );
                matmul(
                    MatMut::strided(&mut dkb, ko, n, r.hd, r.kw(), 1),
                    MatRef::new(&dp, n, n).t(),
                    MatRef::strided(q, qo, n, r.hd, r.qw(), 1),
                    true,
                    Threads::One,
                );
            }
        }
        // The block and its gradients move on; after cp moves each rank holds its own again.
        rotate(comm, g, &mut [&mut kb, &mut vb, &mut dkb, &mut dvb])?;
    }
    Ok((dq, dkb, dvb))
}
