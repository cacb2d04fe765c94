//! Cheap analytic lower bounds on a layout's step time and peak memory, used by the search to
//! reject candidates before simulating them.
//!
//! Both bounds are assembled from the cost model's per-part costs the way
//! [`parallax_sim::simulate_step`] assembles them, keeping only terms every layout pays, so
//! that refinements of the simulator's extra terms cannot make them exceed the simulation:
//!
//! - **Step time.** Each stage's compute stream runs its passes one at a time and cannot start
//!   before the first micro-batch's forward reaches it. The last micro-batch's input gradient
//!   then travels back through every virtual stage, and each stage still owes whatever its op
//!   list holds after that backward. The bound is the longest such chain over the schedule's
//!   real op lists ([`ScheduleSummary`]); for uniform 1F1B it equals the makespan,
//!   `(m + pp - 1)(F + B + W)` plus transfers. Gradient reduction, the optimizer and ZeRO-3
//!   gathers only add to it and are left out.
//! - **Memory.** The simulator's own per-stage memory ([`parallax_sim::stage_memory_of`]): it
//!   is analytic, so the search knows it exactly before simulating.
//!
//! The test `bounds_and_shared_prices_agree_with_the_simulation` checks both against the
//! simulator over many layouts, so a change to the simulator that would make pruning unsound
//! fails loudly.

use parallax_cost::transformer::{Setup, TransformerCosts};
use parallax_ir::{Bytes, Layout, Seconds};
use parallax_sim::{
    pass_costs, stage_memory_of, step_terms, Op, PipelineSchedule, ScheduleError, ScheduleKind,
};

/// Relative slack taken off the step-time bound so that summing the same terms in another order
/// than the simulator (floating-point rounding) never makes a tight bound exceed the makespan.
pub const BOUND_SLACK: f64 = 1e-9;

/// Per-virtual-stage pass times of one layout, in seconds: the parts of the simulator's pass
/// costs that every layout pays. What the simulator adds on top for some layouts (ZeRO-3
/// parameter gathers, a blocking send on the stream) and after the last pass (gradient
/// reduction, optimizer) is left out, so the bound stays a bound when those models change.
#[derive(Clone, Debug, PartialEq)]
pub struct PassTimes {
    /// Forward of one micro-batch through each virtual stage.
    pub f: Vec<f64>,
    /// Input-gradient backward.
    pub b: Vec<f64>,
    /// Weight-gradient backward.
    pub w: Vec<f64>,
    /// One pipeline transfer between stages (on the link, or on the sender's stream): an
    /// activation's, which no gradient's undercuts ([`TransformerCosts::p2p_backward`]).
    pub p2p: f64,
}

/// Pass times with `layers` per virtual stage: the simulator's pass costs without the terms
/// only some layouts pay.
pub fn pass_times(c: &TransformerCosts, layers: &[u32]) -> PassTimes {
    let zero = Seconds(0.0);
    let costs = pass_costs(c, layers, (zero, zero), (zero, zero), c.p2p_messages());
    let secs = |xs: &[Seconds]| xs.iter().map(|x| x.0).collect();
    PassTimes {
        f: secs(&costs.forward),
        b: secs(&costs.backward_input),
        w: secs(&costs.backward_weight),
        p2p: c.p2p.0,
    }
}

/// What the step simulator adds to the pipeline for some layouts ([`parallax_sim::step_terms`],
/// the very terms the simulator uses): ZeRO-3 gathers and ZeRO-2's per-micro-batch
/// reductions on every layer's passes, the exposed data-parallel gradient reduction of each
/// virtual stage, and each stage's optimizer task. They tighten the step bound a lot (they separate ZeRO stages and data-parallel sizes);
/// the search still checks every simulated candidate against its bound and, on any violation,
/// searches again without them.
#[derive(Clone, Debug, PartialEq)]
pub struct Extras {
    /// Added to each layer's forward (ZeRO-3 gathers not hidden behind compute).
    pub z3_fwd: f64,
    /// Added to each layer's input-gradient backward.
    pub z3_bwd: f64,
    /// Exposed gradient reduction of each virtual stage, after its last weight gradient.
    pub dp: Vec<f64>,
    /// Optimizer task of each stage.
    pub opt: Vec<f64>,
}

impl Extras {
    /// Adds the ZeRO-3 gathers to the passes of `t` (`layers` per virtual stage).
    pub fn apply(&self, t: &mut PassTimes, layers: &[u32]) {
        for (vs, &n) in layers.iter().enumerate() {
            t.f[vs] += self.z3_fwd * f64::from(n);
            t.b[vs] += self.z3_bwd * f64::from(n);
        }
    }
}

/// The simulator's extra terms for `l` with `layers` per virtual stage (none when the terms
/// cannot be computed: the simulation will report why).
pub fn extras(setup: &Setup, l: &Layout, c: &TransformerCosts, layers: &[u32]) -> Extras {
    match step_terms(setup, l, c, layers) {
        Ok(t) => Extras {
            z3_fwd: t.zero3.0 .0,
            z3_bwd: t.zero3.1 .0,
            dp: t.dp.iter().map(|x| x.0).collect(),
            opt: t
                .adam
                .iter()
                .zip(&t.param_gather)
                .map(|(a, g)| a.0 + g.0)
                .collect(),
        },
        Err(_) => Extras {
            z3_fwd: 0.0,
            z3_bwd: 0.0,
            dp: vec![0.0; layers.len()],
            opt: vec![0.0; l.pp as usize],
        },
    }
}

/// The peak memory of the fullest stage, GiB, as the simulator computes it
/// ([`stage_memory_of`]: memory is analytic, so this is exact, not a bound).
///
/// With `tight` false only the model states count: a bound that holds whatever the simulator's
/// activation and buffer terms become, for the search's fallback when a simulation ever comes
/// in under the tight figure.
pub fn memory_gib(
    setup: &Setup,
    l: &Layout,
    c: &TransformerCosts,
    layers: &[u32],
    m: u32,
    tight: bool,
) -> Result<f64, ScheduleError> {
    let mut worst = Bytes(0);
    for s in 0..l.pp {
        let mem = stage_memory_of(setup, l, c, layers, m, s)?;
        let counted = if tight {
            mem.total()
        } else {
            mem.params + mem.grads + mem.optimizer
        };
        worst = worst.max(counted);
    }
    Ok(worst.gib())
}

/// Counts of passes (forward, input-gradient, weight-gradient) per chunk.
type Counts = Vec<[u32; 3]>;

/// What the step bound needs from a schedule's op lists: where each virtual stage's backward of
/// the last micro-batch sits in its stage's list, what comes before it, and how each stage
/// starts and ends.
#[derive(Clone, Debug)]
pub struct ScheduleSummary {
    pp: u32,
    v: u32,
    /// Per stage: passes per chunk in the whole list.
    totals: Vec<Counts>,
    /// Per virtual stage: passes per chunk on its stage before the backward of the last
    /// micro-batch, and whether that backward is fused (the gradient leaves after W).
    chain: Vec<(Counts, bool)>,
    /// Per stage: the virtual stage of its first pass when that is a forward.
    first_forward: Vec<Option<u32>>,
    /// Per stage: the chunk of its last weight-gradient pass.
    last_w_chunk: Vec<u32>,
    /// Per stage: the virtual stage of each of its chunks.
    positions: Vec<Vec<usize>>,
    /// Micro-batches enter from both ends (DualPipe): a virtual stage runs on two stages, so
    /// only each stage's own work bounds the step.
    dual: bool,
}

impl ScheduleSummary {
    /// Summarizes the schedule the simulator would generate.
    pub fn new(kind: ScheduleKind, pp: u32, m: u32, v: u32) -> Result<Self, ScheduleError> {
        let sched = PipelineSchedule::generate(kind, pp, m, v)?;
        let dual = kind == ScheduleKind::DualPipe;
        let v = sched.chunks();
        let last = m - 1;
        let nv = sched.positions() as usize;
        let positions: Vec<Vec<usize>> = (0..pp)
            .map(|s| (0..v).map(|c| sched.position(s, c) as usize).collect())
            .collect();
        let mut totals = Vec::with_capacity(pp as usize);
        let mut chain = vec![(Vec::new(), false); nv];
        let mut first_forward = Vec::with_capacity(pp as usize);
        let mut last_w_chunk = Vec::with_capacity(pp as usize);
        for s in 0..pp {
            let ops = sched.stage_ops(s);
            let mut counts: Counts = vec![[0; 3]; v as usize];
            first_forward.push(
                ops.first()
                    .filter(|o| o.op == Op::F)
                    .map(|o| sched.position(s, o.chunk)),
            );
            last_w_chunk.push(
                ops.iter()
                    .rev()
                    .find(|o| matches!(o.op, Op::W | Op::BW))
                    .map_or(0, |o| o.chunk),
            );
            for o in ops {
                if !dual && o.micro_batch == last && matches!(o.op, Op::B | Op::BW) {
                    chain[sched.position(s, o.chunk) as usize] = (counts.clone(), o.op == Op::BW);
                }
                let c = &mut counts[o.chunk as usize];
                match o.op {
                    Op::F => c[0] += 1,
                    Op::B => c[1] += 1,
                    Op::W => c[2] += 1,
                    Op::BW => {
                        c[1] += 1;
                        c[2] += 1;
                    }
                }
            }
            totals.push(counts);
        }
        Ok(ScheduleSummary {
            pp,
            v,
            totals,
            chain,
            first_forward,
            last_w_chunk,
            positions,
            dual,
        })
    }

    fn cost(&self, t: &PassTimes, s: u32, counts: &[[u32; 3]]) -> f64 {
        counts
            .iter()
            .enumerate()
            .map(|(c, n)| {
                let vs = self.positions[s as usize][c];
                f64::from(n[0]) * t.f[vs] + f64::from(n[1]) * t.b[vs] + f64::from(n[2]) * t.w[vs]
            })
            .sum()
    }

    /// A lower bound on the makespan of one step with pass times `t`, and the simulator's extra
    /// terms `x` when given (already applied to `t` with [`Extras::apply`]).
    pub fn step_bound(&self, t: &PassTimes, x: Option<&Extras>) -> f64 {
        let pp = self.pp;
        let nv = (pp * self.v) as usize;
        let cross = |a: usize, b: usize| {
            if (a as u32) % pp != (b as u32) % pp {
                t.p2p
            } else {
                0.0
            }
        };
        // After a stage's last weight gradient: its chunk's gradient reduction, then the
        // optimizer.
        let tail: Vec<f64> = (0..pp)
            .map(|s| match x {
                Some(x) => {
                    let vs = self.positions[s as usize][self.last_w_chunk[s as usize] as usize];
                    x.dp[vs] + x.opt[s as usize]
                }
                None => 0.0,
            })
            .collect();
        if self.dual {
            let busiest = (0..pp)
                .map(|s| self.cost(t, s, &self.totals[s as usize]) + tail[s as usize])
                .fold(0.0, f64::max);
            return busiest * (1.0 - BOUND_SLACK);
        }
        // Earliest start of each stage: the first forward's micro-batch must cross every
        // virtual stage before it.
        let mut reach = vec![0.0; nv];
        for vs in 1..nv {
            reach[vs] = reach[vs - 1] + t.f[vs - 1] + cross(vs - 1, vs);
        }
        let head: Vec<f64> = (0..pp as usize)
            .map(|s| self.first_forward[s].map_or(0.0, |vs| reach[vs as usize]))
            .collect();
        let mut bound = 0.0f64;
        let mut arrival = 0.0f64;
        for vs in (0..nv).rev() {
            let s = (vs as u32) % pp;
            let (before, fused) = &self.chain[vs];
            let total = &self.totals[s as usize];
            let after: Counts = total
                .iter()
                .zip(before)
                .map(|(a, b)| [a[0] - b[0], a[1] - b[1], a[2] - b[2]])
                .collect();
            let start = (head[s as usize] + self.cost(t, s, before)).max(arrival);
            bound = bound.max(start + self.cost(t, s, &after) + tail[s as usize]);
            let leaves = start + t.b[vs] + if *fused { t.w[vs] } else { 0.0 };
            if vs > 0 {
                arrival = leaves + cross(vs, vs - 1);
            }
        }
        bound * (1.0 - BOUND_SLACK)
    }
}

/// Layers per virtual stage that minimize the largest virtual-stage time, where a layer costs
/// `layer`, the first stage also runs the embedding (`first`) and the last the head (`last`).
/// Every stage keeps at least one layer; ties go to stages without the embedding or head.
pub fn balanced_layers(layers: u32, chunks: u32, layer: f64, first: f64, last: f64) -> Vec<u32> {
    let n = chunks as usize;
    let extra = |c: usize| {
        let mut e = 0.0;
        if c == 0 {
            e += first;
        }
        if c == n - 1 {
            e += last;
        }
        e
    };
    // Start from every stage at or under the average load (each at least one layer), then add
    // the remaining layers one at a time where they raise the maximum least.
    let avg = (f64::from(layers) * layer + first + last) / f64::from(chunks);
    let mut counts: Vec<u32> = (0..n)
        .map(|c| {
            if layer > 0.0 {
                (((avg - extra(c)) / layer).floor().max(1.0) as u32).min(layers)
            } else {
                1
            }
        })
        .collect();
    if counts.iter().sum::<u32>() > layers {
        counts = vec![1; n];
    }
    // Greedy: each remaining layer goes to the stage whose load with it is least, ties to
    // stages without the embedding or head, then the earlier. The middle stages start equal
    // and take layers in rounds, in index order, so the stages form three classes: the
    // first, the middle ones (`bumped` of them one layer ahead), the last.
    if n == 1 {
        return vec![layers];
    }
    let key = |k: u32, c: usize| (f64::from(k + 1) * layer + extra(c), extra(c) > 0.0, c);
    let less = |a: (f64, bool, usize), b: (f64, bool, usize)| {
        a.0.total_cmp(&b.0)
            .then((a.1, a.2).cmp(&(b.1, b.2)))
            .is_lt()
    };
    let middle = n - 2;
    let (mut first_k, mut last_k, mut mid_k) = (counts[0], counts[n - 1], counts[1 % n]);
    let mut bumped = 0usize;
    for _ in counts.iter().sum::<u32>()..layers {
        if middle > 0 && bumped == middle {
            mid_k += 1;
            bumped = 0;
        }
        let mut best = (key(first_k, 0), 0u8);
        if middle > 0 {
            let m = key(mid_k, 1 + bumped);
            if less(m, best.0) {
                best = (m, 1);
            }
        }
        let l = key(last_k, n - 1);
        if less(l, best.0) {
            best = (l, 2);
        }
        match best.1 {
            0 => first_k += 1,
            1 => bumped += 1,
            _ => last_k += 1,
        }
    }
    counts[0] = first_k;
    counts[n - 1] = last_k;
    for (i, c) in counts.iter_mut().enumerate().take(n - 1).skip(1) {
        *c = if i <= bumped { mid_k + 1 } else { mid_k };
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The greedy as first written: one scan over the stages per layer.
    fn balanced_by_scan(layers: u32, chunks: u32, layer: f64, first: f64, last: f64) -> Vec<u32> {
        let n = chunks as usize;
        let extra = |c: usize| {
            let mut e = 0.0;
            if c == 0 {
                e += first;
            }
            if c == n - 1 {
                e += last;
            }
            e
        };
        let avg = (f64::from(layers) * layer + first + last) / f64::from(chunks);
        let mut counts: Vec<u32> = (0..n)
            .map(|c| (((avg - extra(c)) / layer).floor().max(1.0) as u32).min(layers))
            .collect();
        if counts.iter().sum::<u32>() > layers {
            counts = vec![1; n];
        }
        for _ in counts.iter().sum::<u32>()..layers {
            let mut best = 0usize;
            let mut best_key = (f64::INFINITY, true, usize::MAX);
            for (c, &k) in counts.iter().enumerate() {
                let key = (f64::from(k + 1) * layer + extra(c), extra(c) > 0.0, c);
                if key.0 < best_key.0
                    || (key.0 == best_key.0 && (key.1, key.2) < (best_key.1, best_key.2))
                {
                    best = c;
                    best_key = key;
                }
            }
            counts[best] += 1;
        }
        counts
    }

    #[test]
    fn balancing_by_classes_matches_the_scan() {
        for layers in [1u32, 2, 5, 30, 61, 94, 126] {
            for chunks in (1..=layers.min(40)).chain([layers]) {
                for (first, last) in [(0.0, 0.0), (0.3, 2.7), (1.0, 1.0), (5.0, 0.0), (0.0, 9.5)] {
                    assert_eq!(
                        balanced_layers(layers, chunks, 1.0, first, last),
                        balanced_by_scan(layers, chunks, 1.0, first, last),
                        "{layers} layers, {chunks} chunks, ends {first} / {last}"
                    );
                }
            }
        }
    }

    #[test]
    fn balancing_moves_layers_off_the_embedding_and_head_stages() {
        // 8 layers on 4 stages, a layer costs 1, embedding 0.5, head 1.5: the head stage keeps
        // one layer, the embedding stage two, the middle ones the rest.
        let c = balanced_layers(8, 4, 1.0, 0.5, 1.5);
        assert_eq!(c.iter().sum::<u32>(), 8);
        assert_eq!(c, vec![2, 3, 2, 1]);
        // Free embedding and head: an even split.
        assert_eq!(balanced_layers(8, 4, 1.0, 0.0, 0.0), vec![2, 2, 2, 2]);
        // Each stage keeps a layer even when the head alone is slower than the rest.
        assert_eq!(balanced_layers(4, 4, 1.0, 0.0, 100.0), vec![1, 1, 1, 1]);
    }

    #[test]
    fn uniform_one_f_one_b_bound_is_the_textbook_makespan() {
        // pp = 4, m = 8, F = 1, B = 1, W = 1, free transfers: (m + pp - 1)(F + B + W) = 33.
        let s = ScheduleSummary::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
        let t = PassTimes {
            f: vec![1.0; 4],
            b: vec![1.0; 4],
            w: vec![1.0; 4],
            p2p: 0.0,
        };
        let b = s.step_bound(&t, None);
        assert!((b - 33.0).abs() < 1e-6, "{b}");
    }
}
