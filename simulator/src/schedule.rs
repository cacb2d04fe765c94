//! Pipeline schedules as data, and their translation into a [`TaskGraph`].
//!
//! A [`PipelineSchedule`] lists, for every pipeline stage, the order in which that stage's
//! compute stream runs its passes: `(op, micro_batch, chunk)` with [`Op::F`] (forward),
//! [`Op::B`] (input gradient), [`Op::W`] (weight gradient) or [`Op::BW`] (one fused backward,
//! used by every schedule except zero-bubble ones).
//!
//! [`build_pipeline`] / [`build_pipeline_with`] turn a schedule into a [`PipelineGraph`]: one
//! compute resource per stage, stream order as [`Dependency::Schedule`] edges, and
//! [`Dependency::Data`] edges for `F(s) -> F(s+1)`, `B(s+1) -> B(s)` (each through a
//! point-to-point task on the link between the two stages), `F -> B` and `B -> W`.
//! The step simulator can expand each pass into several tasks (e.g. compute and an inline
//! tensor-parallel all-reduce) through the expander callback, and append further tasks (a
//! data-parallel gradient reduction after [`PipelineGraph::last_weight_grad`]) before simulating.
//!
//! Virtual stages: with `v` chunks per stage, chunk `c` of stage `s` is virtual stage
//! `c * pp + s` (Megatron-LM's layout: stage 0 holds chunks 0, pp, 2pp, ...), and per-op costs
//! are given per virtual stage.

use crate::engine::{
    simulate, CommKind, Dependency, ResourceId, Resources, SimError, Task, TaskGraph, TaskId,
    TaskKind, Trace,
};
use parallax_ir::Seconds;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use thiserror::Error;

/// Which pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al. 2019). Holds `m` micro-batches.
    GPipe,
    /// 1F1B / PipeDream-Flush (Narayanan et al. 2021), Megatron-LM's non-interleaved schedule.
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B with `v >= 2` model chunks per stage.
    Interleaved1F1B,
    /// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2.1): 1F1B's F/B order with
    /// backward split into B and W, W passes deferred to fill the tail bubble.
    ZeroBubbleH1,
    /// DualPipe (deepseek-ai/DualPipe): micro-batches enter from both ends; stage `s` holds
    /// virtual stages `s` and `pp - 1 - s` of a `pp`-stage split ([`stage_positions`]).
    DualPipe,
}

impl ScheduleKind {
    /// The schedule a layout's `schedule` runs over `pp` stages. One stage has no pipeline: every
    /// schedule is then a one-stage 1F1B (forward, backward, one micro-batch in flight).
    pub fn of(schedule: parallax_ir::Schedule, pp: u32) -> ScheduleKind {
        use parallax_ir::Schedule;
        match schedule {
            _ if pp <= 1 => ScheduleKind::OneFOneB,
            Schedule::GPipe => ScheduleKind::GPipe,
            Schedule::Interleaved1F1B => ScheduleKind::Interleaved1F1B,
            Schedule::ZeroBubbleH1 => ScheduleKind::ZeroBubbleH1,
            Schedule::DualPipe => ScheduleKind::DualPipe,
            Schedule::None | Schedule::OneFOneB => ScheduleKind::OneFOneB,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved-1f1b",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
            ScheduleKind::DualPipe => "dualpipe",
        })
    }
}

/// One pass of one micro-batch through one chunk of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Op {
    /// Forward.
    F,
    /// Backward for inputs (activation gradient), sent to the previous stage.
    B,
    /// Backward for weights; needed only by the optimizer.
    W,
    /// Fused backward (B then W as one pass; the input gradient leaves the stage when both are
    /// done, as with autograd computing a whole stage's backward before the send).
    BW,
}

/// An entry of a stage's op list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ScheduledOp {
    /// The pass.
    pub op: Op,
    /// The micro-batch.
    pub micro_batch: u32,
    /// The model chunk on this stage (0 without interleaving).
    pub chunk: u32,
}

impl ScheduledOp {
    fn new(op: Op, micro_batch: u32, chunk: u32) -> Self {
        ScheduledOp {
            op,
            micro_batch,
            chunk,
        }
    }
}

/// Why a schedule or pipeline graph cannot be built.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ScheduleError {
    /// `pp`, `m` or `v` is zero.
    #[error("{what} must be at least 1")]
    Zero {
        /// Which parameter.
        what: &'static str,
    },
    /// A non-interleaved schedule was asked for `v != 1` chunks per stage.
    #[error("schedule {kind} has one chunk per stage, got v = {v}")]
    ChunksNotSupported {
        /// The schedule.
        kind: ScheduleKind,
        /// The chunk count asked for.
        v: u32,
    },
    /// Interleaved 1F1B was asked for fewer than 2 chunks per stage.
    #[error("interleaved-1f1b needs v >= 2 chunks per stage, got v = {v}")]
    InterleavedNeedsChunks {
        /// The chunk count asked for.
        v: u32,
    },
    /// DualPipe needs an even number of stages and an even number of micro-batches, at least
    /// twice the stages (`DualPipe.step`'s assertions).
    #[error("dualpipe needs an even pp and an even number of micro-batches of at least 2 × pp; got pp = {pp}, m = {m}")]
    DualPipeSizes {
        /// Stages.
        pp: u32,
        /// Micro-batches.
        m: u32,
    },
    /// Megatron-LM's interleaved schedule needs the micro-batch count to be a multiple of the
    /// number of stages.
    #[error(
        "interleaved-1f1b needs micro-batches ({m}) to be a multiple of pipeline stages ({pp})"
    )]
    MicroBatchesNotMultipleOfStages {
        /// Micro-batches.
        m: u32,
        /// Stages.
        pp: u32,
    },
    /// A hand-written schedule lists a different number of stages than `pp`.
    #[error("schedule lists {got} stages, expected pp = {pp}")]
    StageCount {
        /// Stages listed.
        got: usize,
        /// Stages expected.
        pp: u32,
    },
    /// A stage index is out of range.
    #[error("stage {stage} out of range for {pp} stages")]
    StageOutOfRange {
        /// The stage asked for.
        stage: u32,
        /// Number of stages.
        pp: u32,
    },
    /// A per-virtual-stage cost vector has the wrong length.
    #[error("{what} has {got} entries, need one per virtual stage ({expected})")]
    CostLength {
        /// Which cost vector.
        what: &'static str,
        /// `pp * v`.
        expected: usize,
        /// Its length.
        got: usize,
    },
    /// A hand-written schedule does not run every pass exactly once.
    #[error(
        "invalid schedule at stage {stage}, micro-batch {micro_batch}, chunk {chunk}: {reason}"
    )]
    InvalidSchedule {
        /// The stage.
        stage: u32,
        /// The micro-batch.
        micro_batch: u32,
        /// The chunk.
        chunk: u32,
        /// What is wrong.
        reason: &'static str,
    },
    /// The built graph could not be simulated.
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// Per-stage op order of a pipeline schedule. Built by [`PipelineSchedule::generate`] or, for a
/// hand-written order, [`PipelineSchedule::from_stages`] (which checks it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PipelineSchedule {
    kind: Option<ScheduleKind>,
    pp: u32,
    m: u32,
    v: u32,
    stages: Vec<Vec<ScheduledOp>>,
}

fn check_sizes(pp: u32, m: u32, v: u32) -> Result<(), ScheduleError> {
    for (what, x) in [
        ("pp (stages)", pp),
        ("m (micro-batches)", m),
        ("v (chunks)", v),
    ] {
        if x == 0 {
            return Err(ScheduleError::Zero { what });
        }
    }
    Ok(())
}

fn check_kind(kind: ScheduleKind, pp: u32, m: u32, v: u32) -> Result<(), ScheduleError> {
    check_sizes(pp, m, v)?;
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::ZeroBubbleH1 => {
            if v != 1 {
                return Err(ScheduleError::ChunksNotSupported { kind, v });
            }
        }
        ScheduleKind::Interleaved1F1B => {
            if v < 2 {
                return Err(ScheduleError::InterleavedNeedsChunks { v });
            }
            if m % pp != 0 {
                return Err(ScheduleError::MicroBatchesNotMultipleOfStages { m, pp });
            }
        }
        ScheduleKind::DualPipe => {
            if v != 1 {
                return Err(ScheduleError::ChunksNotSupported { kind, v });
            }
            if pp % 2 != 0 || m % 2 != 0 || u64::from(m) < 2 * u64::from(pp) {
                return Err(ScheduleError::DualPipeSizes { pp, m });
            }
        }
    }
    Ok(())
}

/// The virtual stages (layer ranges, cost entries; `pp × v` of them, or `pp` for DualPipe)
/// stage `s` holds, by chunk: `c · pp + s` (Megatron-LM's interleaving), or under DualPipe its
/// own and its mirror's, the nearer the ends first (chunk 0 is `min(s, pp − 1 − s)`).
pub fn stage_positions(kind: ScheduleKind, pp: u32, v: u32, s: u32) -> Vec<u32> {
    let chunks = if kind == ScheduleKind::DualPipe { 2 } else { v };
    (0..chunks)
        .map(|c| chunk_position(kind, pp, s, c))
        .collect()
}

/// The virtual stage chunk `chunk` of stage `s` runs under `kind` ([`stage_positions`]).
fn chunk_position(kind: ScheduleKind, pp: u32, s: u32, chunk: u32) -> u32 {
    match kind {
        ScheduleKind::DualPipe => {
            let near = s.min(pp - 1 - s);
            if chunk == 0 {
                near
            } else {
                pp - 1 - near
            }
        }
        _ => chunk * pp + s,
    }
}

/// How many micro-batches pass each virtual stage on one device: all of them, or under
/// DualPipe the half entering from that copy's end.
pub fn passes_per_position(kind: ScheduleKind, m: u32) -> u32 {
    match kind {
        ScheduleKind::DualPipe => m / 2,
        _ => m,
    }
}

/// Forward passes a stage runs before its first backward in Megatron-LM's interleaved schedule
/// (`forward_backward_pipelining_with_interleaving`, microbatch group size = pp), before capping
/// at the total `m * v`: `2 (pp - stage - 1) + (v - 1) pp`.
fn interleaved_warmup(pp: u32, v: u32, stage: u32) -> u64 {
    2 * u64::from(pp - stage - 1) + u64::from(v - 1) * u64::from(pp)
}

/// Of each pass of the stage with the longest warm-up (stage 0), the fraction Megatron-Core's
/// combined 1F1B (`--overlap-moe-expert-parallel-comm`) runs merged with a pass of another
/// micro-batch: in the steady state every forward goes with a backward; the warm-up forwards
/// and as many cool-down backwards run alone. One stage pairs forward `i + 1` with backward
/// `i` (`m - 1` of `m`); with pp > 1 only the interleaved schedule merges, others never.
pub fn merged_fraction(kind: ScheduleKind, pp: u32, m: u32, v: u32) -> f64 {
    let passes = u64::from(m) * u64::from(v);
    if passes == 0 {
        return 0.0;
    }
    let alone = match kind {
        _ if pp <= 1 => 1,
        ScheduleKind::Interleaved1F1B if v >= 1 => interleaved_warmup(pp, v, 0).min(passes),
        // Stage 0 of `dualpipe`: `2 (m/2 − pp + 1)` merged pairs in its main step and
        // `pp/2 − 1` after it (minus the middle ranks' first, which DualPipe leaves apart).
        ScheduleKind::DualPipe if u64::from(m) >= 2 * u64::from(pp) && pp >= 2 => {
            let half = u64::from(pp / 2);
            let merged =
                2 * (u64::from(m / 2) + 1 - u64::from(pp)) + (half - 1) - u64::from(half == 1);
            passes - merged.min(passes)
        }
        _ => passes,
    };
    (passes - alone.min(passes)) as f64 / passes as f64
}

impl PipelineSchedule {
    /// The op order of `kind` for `pp` stages, `m` micro-batches and `v` chunks per stage.
    ///
    /// - GPipe: `F0..F(m-1)` then `BW0..BW(m-1)` (backwards in micro-batch order, as
    ///   `torch.distributed.pipelining.ScheduleGPipe`; the order does not change the makespan for
    ///   uniform costs).
    /// - 1F1B: `min(pp - s - 1, m)` warm-up forwards, then alternating `F`, `BW`, then the
    ///   remaining `BW`s.
    /// - Interleaved 1F1B (Megatron-LM): the k-th forward of a stage is micro-batch
    ///   `(k / (pp v)) pp + k % pp` of chunk `(k % (pp v)) / pp`; backwards use the same
    ///   micro-batch order with chunks reversed (`v - 1 - ...`); `min(2 (pp-s-1) + (v-1) pp, m v)`
    ///   warm-up forwards, then 1F1B. Needs `v >= 2` and `m % pp == 0`.
    /// - ZB-H1: 1F1B's F/B order with split backward; stage `s` runs `W` of micro-batch `i`
    ///   right after `B` of micro-batch `i + s`, and its last `s` W's after its final B (Qi et
    ///   al. 2023, Figure 3 top: the W start is shifted by the stage index, so every stage keeps
    ///   1F1B's `pp - s` in-flight micro-batches).
    pub fn generate(kind: ScheduleKind, pp: u32, m: u32, v: u32) -> Result<Self, ScheduleError> {
        check_kind(kind, pp, m, v)?;
        let stages = (0..pp)
            .map(|s| match kind {
                ScheduleKind::GPipe => gpipe(m),
                ScheduleKind::OneFOneB => one_f_one_b(pp, m, s),
                ScheduleKind::Interleaved1F1B => interleaved(pp, m, v, s),
                ScheduleKind::ZeroBubbleH1 => zb_h1(pp, m, s),
                ScheduleKind::DualPipe => dual_pipe(pp, m, s),
            })
            .collect();
        Ok(PipelineSchedule {
            kind: Some(kind),
            pp,
            m,
            // DualPipe's two chunks a stage are two of its `pp` virtual stages.
            v: if kind == ScheduleKind::DualPipe { 2 } else { v },
            stages,
        })
    }

    /// Virtual stages (cost entries) the schedule runs: `pp × v`, or `pp` for DualPipe.
    pub fn positions(&self) -> u32 {
        match self.kind {
            Some(ScheduleKind::DualPipe) => self.pp,
            _ => self.pp * self.v,
        }
    }

    /// The virtual stage chunk `chunk` of `stage` runs ([`stage_positions`]).
    pub fn position(&self, stage: u32, chunk: u32) -> u32 {
        // A hand-written schedule lays chunks out as Megatron-LM does.
        let kind = self.kind.unwrap_or(ScheduleKind::OneFOneB);
        chunk_position(kind, self.pp, stage, chunk)
    }

    /// The stage where micro-batch `mb` passes virtual stage `position`: its stage
    /// (`position % pp`), or under DualPipe the copy on its direction's path (the first half
    /// of the micro-batches enters at stage 0, the second at stage pp − 1).
    pub fn stage_at(&self, position: u32, mb: u32) -> u32 {
        match self.kind {
            Some(ScheduleKind::DualPipe) if mb >= self.m / 2 => self.pp - 1 - position,
            Some(ScheduleKind::DualPipe) => position,
            _ => position % self.pp,
        }
    }

    /// The chunk of [`PipelineSchedule::stage_at`] that holds `position`.
    pub fn chunk_at(&self, position: u32, mb: u32) -> u32 {
        let s = self.stage_at(position, mb);
        (0..self.v)
            .find(|&c| self.position(s, c) == position)
            .unwrap_or(0)
    }

    /// A hand-written schedule. Checks that every stage runs, for every micro-batch and chunk,
    /// exactly one `F` and either exactly one `BW` or exactly one `B` and one `W`. Whether the
    /// order can execute (no deadlock) is found when the built graph is simulated
    /// ([`SimError::Cycle`]).
    pub fn from_stages(
        pp: u32,
        m: u32,
        v: u32,
        stages: Vec<Vec<ScheduledOp>>,
    ) -> Result<Self, ScheduleError> {
        check_sizes(pp, m, v)?;
        if stages.len() != pp as usize {
            return Err(ScheduleError::StageCount {
                got: stages.len(),
                pp,
            });
        }
        for (s, ops) in stages.iter().enumerate() {
            let invalid = |op: &ScheduledOp, reason| ScheduleError::InvalidSchedule {
                stage: s as u32,
                micro_batch: op.micro_batch,
                chunk: op.chunk,
                reason,
            };
            // counts[(chunk * m + mb) * 4 + op]
            let mut counts = vec![0u8; (m * v) as usize * 4];
            for op in ops {
                if op.micro_batch >= m || op.chunk >= v {
                    return Err(invalid(op, "micro-batch or chunk out of range"));
                }
                let i = (op.chunk * m + op.micro_batch) as usize * 4 + op.op as usize;
                counts[i] = counts[i].saturating_add(1);
            }
            for chunk in 0..v {
                for mb in 0..m {
                    let c = &counts[(chunk * m + mb) as usize * 4..][..4];
                    let (f, b, w, bw) = (c[0], c[1], c[2], c[3]);
                    let ok =
                        f == 1 && ((bw == 1 && b == 0 && w == 0) || (bw == 0 && b == 1 && w == 1));
                    if !ok {
                        let op = ScheduledOp::new(Op::F, mb, chunk);
                        return Err(invalid(
                            &op,
                            "need exactly one F and either one BW or one B and one W",
                        ));
                    }
                }
            }
        }
        Ok(PipelineSchedule {
            kind: None,
            pp,
            m,
            v,
            stages,
        })
    }

    /// The schedule kind, or `None` for a hand-written schedule.
    pub fn kind(&self) -> Option<ScheduleKind> {
        self.kind
    }
    /// Number of pipeline stages.
    pub fn stages(&self) -> u32 {
        self.pp
    }
    /// Number of micro-batches.
    pub fn micro_batches(&self) -> u32 {
        self.m
    }
    /// Chunks (virtual stages) per stage.
    pub fn chunks(&self) -> u32 {
        self.v
    }
    /// The op order of one stage (empty if `stage` is out of range).
    pub fn stage_ops(&self, stage: u32) -> &[ScheduledOp] {
        self.stages.get(stage as usize).map_or(&[], Vec::as_slice)
    }
    /// The op orders of all stages.
    pub fn all_stage_ops(&self) -> &[Vec<ScheduledOp>] {
        &self.stages
    }

    /// Peak number of (micro-batch, chunk) forward activations a stage holds, measured by walking
    /// its op list: `F` stores one, `B` or `BW` releases it. (A pending `W` still holds a
    /// smaller set, ZB's `M_W`; that is not counted here.)
    pub fn max_in_flight(&self, stage: u32) -> u32 {
        let mut held = 0i64;
        let mut peak = 0i64;
        for op in self.stage_ops(stage) {
            match op.op {
                Op::F => held += 1,
                Op::B | Op::BW => held -= 1,
                Op::W => {}
            }
            peak = peak.max(held);
        }
        peak as u32
    }
}

fn gpipe(m: u32) -> Vec<ScheduledOp> {
    (0..m)
        .map(|i| ScheduledOp::new(Op::F, i, 0))
        .chain((0..m).map(|i| ScheduledOp::new(Op::BW, i, 0)))
        .collect()
}

fn one_f_one_b(pp: u32, m: u32, s: u32) -> Vec<ScheduledOp> {
    let warmup = (pp - s - 1).min(m);
    let mut ops = Vec::with_capacity(2 * m as usize);
    ops.extend((0..warmup).map(|i| ScheduledOp::new(Op::F, i, 0)));
    for i in 0..m - warmup {
        ops.push(ScheduledOp::new(Op::F, warmup + i, 0));
        ops.push(ScheduledOp::new(Op::BW, i, 0));
    }
    ops.extend((m - warmup..m).map(|i| ScheduledOp::new(Op::BW, i, 0)));
    ops
}

fn interleaved(pp: u32, m: u32, v: u32, s: u32) -> Vec<ScheduledOp> {
    let total = m * v;
    let group = pp * v;
    let micro_batch = |k: u32| (k / group) * pp + k % pp;
    let fwd = |k: u32| ScheduledOp::new(Op::F, micro_batch(k), (k % group) / pp);
    let bwd = |k: u32| ScheduledOp::new(Op::BW, micro_batch(k), v - 1 - (k % group) / pp);
    let warmup = interleaved_warmup(pp, v, s).min(u64::from(total)) as u32;
    let mut ops = Vec::with_capacity(2 * total as usize);
    ops.extend((0..warmup).map(fwd));
    for i in 0..total - warmup {
        ops.push(fwd(warmup + i));
        ops.push(bwd(i));
    }
    ops.extend((total - warmup..total).map(bwd));
    ops
}

/// Stage `s` of DualPipe, step by step as `DualPipe.step` runs it (deepseek-ai/DualPipe,
/// `dualpipe/dualpipe.py`): chunk 0 is the stage's nearer-the-ends virtual stage, chunk 1 its
/// mirror's. On the first half of the stages chunk 0 carries the micro-batches entering at
/// stage 0 (`0 .. m/2`) and chunk 1 those entering at the last stage (`m/2 .. m`); on the second
/// half the other way round. Each chunk runs its micro-batches in order; a zero-bubble backward
/// is a `B` whose `W` runs at the next weight step, first in first out. A merged forward and
/// backward (`_forward_backward_chunk`) is the `F` then the `BW`: the merge is priced by
/// [`merged_fraction`].
fn dual_pipe(pp: u32, m: u32, s: u32) -> Vec<ScheduledOp> {
    let half_ranks = pp / 2;
    let hr = s.min(pp - 1 - s);
    let half = m / 2;
    let first_half = s < half_ranks;
    // Micro-batch k of chunk c on this stage.
    let mb = |c: u32, k: u32| if (c == 0) == first_half { k } else { half + k };
    let mut next_f = [0u32; 2];
    let mut next_b = [0u32; 2];
    let mut weights = std::collections::VecDeque::new();
    let mut ops = Vec::with_capacity(3 * m as usize);
    let mut f = |ops: &mut Vec<ScheduledOp>, c: u32| {
        ops.push(ScheduledOp::new(Op::F, mb(c, next_f[c as usize]), c));
        next_f[c as usize] += 1;
    };
    let mut b = |ops: &mut Vec<ScheduledOp>,
                 w: &mut std::collections::VecDeque<(u32, u32)>,
                 c: u32,
                 zb: bool| {
        let i = mb(c, next_b[c as usize]);
        next_b[c as usize] += 1;
        if zb {
            ops.push(ScheduledOp::new(Op::B, i, c));
            w.push_back((i, c));
        } else {
            ops.push(ScheduledOp::new(Op::BW, i, c));
        }
    };
    let weight = |ops: &mut Vec<ScheduledOp>, w: &mut std::collections::VecDeque<(u32, u32)>| {
        if let Some((i, c)) = w.pop_front() {
            ops.push(ScheduledOp::new(Op::W, i, c));
        }
    };
    let rest = half_ranks - hr - 1;
    // 1: nF0.
    for _ in 0..2 * rest {
        f(&mut ops, 0);
    }
    // 2: nF0F1.
    for _ in 0..=hr {
        f(&mut ops, 0);
        f(&mut ops, 1);
    }
    // 3: nB1W1F1, zero bubble.
    for _ in 0..rest {
        b(&mut ops, &mut weights, 1, true);
        weight(&mut ops, &mut weights);
        f(&mut ops, 1);
    }
    // 4 (main): nF0B1F1B0, each forward merged with a backward.
    for _ in 0..(u64::from(half) + u64::from(hr) + 1).saturating_sub(u64::from(pp)) {
        f(&mut ops, 0);
        b(&mut ops, &mut weights, 1, false);
        f(&mut ops, 1);
        b(&mut ops, &mut weights, 0, false);
    }
    // 5: nB1F1B0.
    for _ in 0..rest {
        b(&mut ops, &mut weights, 1, false);
        f(&mut ops, 1);
        b(&mut ops, &mut weights, 0, false);
    }
    // 6: nB1B0, the second half zero bubble.
    // Python's `step_6 // 2` with step_6 = hr + 1.
    let switch = hr.div_ceil(2);
    let mut zb = false;
    for i in 0..=hr {
        if i == switch && hr % 2 == 1 {
            zb = true;
        }
        b(&mut ops, &mut weights, 1, zb);
        if i == switch && hr % 2 == 0 {
            zb = true;
        }
        b(&mut ops, &mut weights, 0, zb);
    }
    // 7: nWB0, zero bubble.
    for _ in 0..rest {
        weight(&mut ops, &mut weights);
        b(&mut ops, &mut weights, 0, true);
    }
    // 8: nW.
    while !weights.is_empty() {
        weight(&mut ops, &mut weights);
    }
    ops
}

fn zb_h1(pp: u32, m: u32, s: u32) -> Vec<ScheduledOp> {
    let warmup = (pp - s - 1).min(m);
    let shift = s; // W of micro-batch i follows B of micro-batch i + s.
    let mut ops = Vec::with_capacity(3 * m as usize);
    let b_then_w = |ops: &mut Vec<ScheduledOp>, i: u32| {
        ops.push(ScheduledOp::new(Op::B, i, 0));
        if i >= shift {
            ops.push(ScheduledOp::new(Op::W, i - shift, 0));
        }
    };
    ops.extend((0..warmup).map(|i| ScheduledOp::new(Op::F, i, 0)));
    for i in 0..m - warmup {
        ops.push(ScheduledOp::new(Op::F, warmup + i, 0));
        b_then_w(&mut ops, i);
    }
    for i in m - warmup..m {
        b_then_w(&mut ops, i);
    }
    ops.extend((m.saturating_sub(shift)..m).map(|i| ScheduledOp::new(Op::W, i, 0)));
    ops
}

/// Closed-form peak number of (micro-batch, chunk) forward activations held by `stage`
/// (divide by `v` for micro-batch equivalents, since a chunk holds `1/v` of the stage's layers):
///
/// - GPipe: `m`.
/// - 1F1B and ZB-H1: `min(m, pp - stage)` (ZB-H1 keeps 1F1B's count, Qi et al. 2023 §2.1).
/// - Interleaved 1F1B: `min(2 (pp - stage - 1) + (v - 1) pp + 1, m v)`: Megatron-LM's warm-up
///   forwards plus the first steady-state forward. For stage 0 that is `pp v + pp - 1` chunk
///   activations, i.e. `pp (1 + (pp - 1) / (pp v))` micro-batches, the figure in Korthikanti et
///   al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.2.3).
pub fn max_in_flight(
    kind: ScheduleKind,
    pp: u32,
    m: u32,
    v: u32,
    stage: u32,
) -> Result<u32, ScheduleError> {
    check_kind(kind, pp, m, v)?;
    if stage >= pp {
        return Err(ScheduleError::StageOutOfRange { stage, pp });
    }
    Ok(match kind {
        ScheduleKind::GPipe => m,
        ScheduleKind::OneFOneB | ScheduleKind::ZeroBubbleH1 => m.min(pp - stage),
        ScheduleKind::Interleaved1F1B => {
            (interleaved_warmup(pp, v, stage) + 1).min(u64::from(m) * u64::from(v)) as u32
        }
        // No closed form: its op list walked.
        ScheduleKind::DualPipe => PipelineSchedule::generate(kind, pp, m, v)?.max_in_flight(stage),
    })
}

/// Per-op durations of a pipeline, one entry per virtual stage (`chunk * pp + stage`; with
/// `v = 1` simply per stage).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PipelineCosts {
    /// Forward pass time of one micro-batch through the virtual stage.
    pub forward: Vec<Seconds>,
    /// Input-gradient backward time.
    pub backward_input: Vec<Seconds>,
    /// Weight-gradient backward time (for fused `BW` the backward is `backward_input +
    /// backward_weight`).
    pub backward_weight: Vec<Seconds>,
    /// Time of one point-to-point transfer of an activation from a stage to the next. Each
    /// transfer is a task on the link resource for its (source, destination) pair.
    pub p2p: Seconds,
    /// Time of one transfer of an input gradient back to the stage before: `p2p` unless the
    /// stack's engine sends gradients differently (DeepSpeed's before 0.5.4 sends them whole).
    pub p2p_gradient: Seconds,
    /// Where boundaries differ (a per-op pipeline cuts the graph where tensors of different
    /// sizes cross): entry `vs` is the transfer between virtual stages `vs` and `vs + 1`, each
    /// way; empty means `p2p` and `p2p_gradient` at every boundary.
    pub p2p_boundaries: Vec<Seconds>,
}

/// What a pipeline transfer carries: an activation forward or an input gradient backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Activation,
    Gradient,
}

impl PipelineCosts {
    /// The same costs on all `pp * v` virtual stages.
    pub fn uniform(pp: u32, v: u32, f: Seconds, b: Seconds, w: Seconds, p2p: Seconds) -> Self {
        let n = (pp * v) as usize;
        PipelineCosts {
            forward: vec![f; n],
            backward_input: vec![b; n],
            backward_weight: vec![w; n],
            p2p,
            p2p_gradient: p2p,
            p2p_boundaries: Vec::new(),
        }
    }

    /// The transfer of `flow` between virtual stages `vs` and `vs + 1`.
    pub fn p2p_at(&self, vs: u32, flow: Flow) -> Seconds {
        self.p2p_boundaries
            .get(vs as usize)
            .copied()
            .unwrap_or(match flow {
                Flow::Activation => self.p2p,
                Flow::Gradient => self.p2p_gradient,
            })
    }

    fn check(&self, n: usize) -> Result<(), ScheduleError> {
        for (what, xs) in [
            ("forward", &self.forward),
            ("backward_input", &self.backward_input),
            ("backward_weight", &self.backward_weight),
        ] {
            if xs.len() != n {
                return Err(ScheduleError::CostLength {
                    what,
                    expected: n,
                    got: xs.len(),
                });
            }
        }
        Ok(())
    }
}

/// What the expander of [`build_pipeline_with`] is asked to build: one pass (`F`, `B` or `W`;
/// a fused `BW` is asked for as `B` then `W`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpContext {
    /// `Op::F`, `Op::B` or `Op::W` (never `Op::BW`).
    pub op: Op,
    /// The stage.
    pub stage: u32,
    /// The chunk on the stage.
    pub chunk: u32,
    /// `chunk * pp + stage`.
    pub virtual_stage: u32,
    /// The micro-batch.
    pub micro_batch: u32,
    /// The stage's compute stream.
    pub compute: ResourceId,
}

/// The tasks a pass was expanded into: the builder wires incoming edges to `entry` and outgoing
/// edges from `exit` (the same task for a one-task pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpSpan {
    /// First task of the pass.
    pub entry: TaskId,
    /// Last task of the pass.
    pub exit: TaskId,
}

/// A scheduled op and the tasks it became.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpTasks {
    /// The op from the schedule.
    pub op: ScheduledOp,
    /// Its first task (for `BW`, the B part's entry).
    pub entry: TaskId,
    /// Its last task (for `BW`, the W part's exit).
    pub exit: TaskId,
}

/// A pipeline schedule as a task graph with its costs and resources, ready to be extended and
/// simulated.
#[derive(Clone, Debug)]
pub struct PipelineGraph {
    /// The tasks and edges.
    pub graph: TaskGraph,
    /// One cost per task.
    pub costs: Vec<Seconds>,
    /// Compute streams, links, and whatever the caller adds.
    pub resources: Resources,
    /// Compute stream of each stage.
    pub compute: Vec<ResourceId>,
    /// Point-to-point link resources as `(source stage, destination stage, resource)`.
    pub links: Vec<(u32, u32, ResourceId)>,
    /// `ops[s][i]` is the tasks of the `i`-th op of stage `s` in the schedule.
    pub ops: Vec<Vec<OpTasks>>,
}

impl PipelineGraph {
    /// Adds a task with its cost.
    pub fn add_task(&mut self, task: Task, cost: Seconds) -> TaskId {
        self.costs.push(cost);
        self.graph.add_task(task)
    }

    /// Simulates the graph.
    pub fn simulate(&self) -> Result<Trace, SimError> {
        simulate(&self.graph, &self.costs, &self.resources)
    }

    /// The last task of the last op on `stage`'s stream that computes weight gradients (`W` or
    /// `BW`), optionally only among ops of one chunk: where a data-parallel gradient reduction
    /// of that stage (or chunk) can start.
    pub fn last_weight_grad(&self, stage: u32, chunk: Option<u32>) -> Option<TaskId> {
        self.ops
            .get(stage as usize)?
            .iter()
            .rev()
            .find(|t| matches!(t.op.op, Op::W | Op::BW) && chunk.is_none_or(|c| t.op.chunk == c))
            .map(|t| t.exit)
    }

    /// Fraction of the makespan each stage's compute stream is idle.
    pub fn bubble_fraction(&self, trace: &Trace) -> Vec<f64> {
        let busy = trace.busy_time(&self.resources);
        self.compute
            .iter()
            .map(|r| {
                if trace.makespan.0 > 0.0 {
                    1.0 - busy[r.index()].0 / trace.makespan.0
                } else {
                    0.0
                }
            })
            .collect()
    }
}

/// Builds the graph of `schedule` with one task per pass costed by `costs`.
pub fn build_pipeline(
    schedule: &PipelineSchedule,
    costs: &PipelineCosts,
) -> Result<PipelineGraph, ScheduleError> {
    costs.check(schedule.positions() as usize)?;
    build_pipeline_with(schedule, &|vs, flow| costs.p2p_at(vs, flow), |pg, ctx| {
        let vs = ctx.virtual_stage as usize;
        let (label, kind, cost) = match ctx.op {
            Op::F => ("F", TaskKind::Forward, costs.forward[vs]),
            Op::B => ("B", TaskKind::BackwardInput, costs.backward_input[vs]),
            _ => ("W", TaskKind::BackwardWeight, costs.backward_weight[vs]),
        };
        let task = Task::new(label, kind, ctx.compute).at(ctx.stage, ctx.micro_batch, ctx.chunk);
        let t = pg.add_task(task, cost);
        Ok(OpSpan { entry: t, exit: t })
    })
}

/// Builds the graph of `schedule`, asking `expand` to create the task(s) of each pass.
///
/// Creates a capacity-1 compute resource per stage (group = stage) before the first call; the
/// expander may add tasks, edges and resources to the [`PipelineGraph`] it is given and returns
/// the entry and exit task of the pass. The builder then adds: stream order (a `Schedule` edge
/// from each op's exit to the next op's entry on the same stage), `F -> B` and `B -> W` of the
/// same (virtual stage, micro-batch), and the cross-stage `F(vs) -> F(vs+1)` and
/// `B(vs+1) -> B(vs)` through a p2p task of cost `p2p(vs, flow)` on the link resource of the
/// (source, destination) stage pair (a direct edge when both virtual stages are on one stage).
/// A fused `BW` is expanded as `B` then `W`, and its gradient leaves after the `W` part.
pub fn build_pipeline_with<E, X>(
    schedule: &PipelineSchedule,
    p2p: &dyn Fn(u32, Flow) -> Seconds,
    mut expand: X,
) -> Result<PipelineGraph, E>
where
    E: From<ScheduleError>,
    X: FnMut(&mut PipelineGraph, OpContext) -> Result<OpSpan, E>,
{
    let (pp, m) = (schedule.pp, schedule.m);
    let nv = schedule.positions() as usize;
    let passes = nv * m as usize;
    let mut pg = PipelineGraph {
        graph: TaskGraph::with_capacity(5 * passes, 8 * passes),
        costs: Vec::with_capacity(5 * passes),
        resources: Resources::new(),
        compute: Vec::with_capacity(pp as usize),
        links: Vec::new(),
        ops: Vec::with_capacity(pp as usize),
    };
    for s in 0..pp {
        let r = pg
            .resources
            .add_in_group(format!("stage {s} compute"), 1, s);
        pg.compute.push(r);
    }

    const NONE: TaskId = TaskId(u32::MAX);
    let at = |vs: u32, mb: u32| vs as usize * m as usize + mb as usize;
    let mut f_entry = vec![NONE; passes];
    let mut f_exit = vec![NONE; passes];
    let mut b_entry = vec![NONE; passes];
    // Where the input gradient leaves: B's exit, or W's exit for a fused BW.
    let mut grad_out = vec![NONE; passes];
    // Split backward only: B's exit and W's entry, joined by a data edge below.
    let mut split_b_exit = vec![NONE; passes];
    let mut w_entry = vec![NONE; passes];

    for (s, stage_ops) in schedule.stages.iter().enumerate() {
        let s = s as u32;
        let mut stream = Vec::with_capacity(stage_ops.len());
        let mut prev: Option<TaskId> = None;
        for &op in stage_ops {
            let vs = schedule.position(s, op.chunk);
            let i = at(vs, op.micro_batch);
            let compute = pg.compute[s as usize];
            let ctx = |o: Op| OpContext {
                op: o,
                stage: s,
                chunk: op.chunk,
                virtual_stage: vs,
                micro_batch: op.micro_batch,
                compute,
            };
            let (entry, exit) = match op.op {
                Op::F => {
                    let sp = expand(&mut pg, ctx(Op::F))?;
                    (f_entry[i], f_exit[i]) = (sp.entry, sp.exit);
                    (sp.entry, sp.exit)
                }
                Op::B => {
                    let sp = expand(&mut pg, ctx(Op::B))?;
                    (b_entry[i], grad_out[i], split_b_exit[i]) = (sp.entry, sp.exit, sp.exit);
                    (sp.entry, sp.exit)
                }
                Op::W => {
                    let sp = expand(&mut pg, ctx(Op::W))?;
                    w_entry[i] = sp.entry;
                    (sp.entry, sp.exit)
                }
                Op::BW => {
                    let b = expand(&mut pg, ctx(Op::B))?;
                    let w = expand(&mut pg, ctx(Op::W))?;
                    pg.graph.add_data(b.exit, w.entry);
                    (b_entry[i], grad_out[i]) = (b.entry, w.exit);
                    (b.entry, w.exit)
                }
            };
            if let Some(p) = prev {
                pg.graph.add_schedule(p, entry);
            }
            prev = Some(exit);
            stream.push(OpTasks { op, entry, exit });
        }
        pg.ops.push(stream);
    }

    let mut links: BTreeMap<(u32, u32), ResourceId> = BTreeMap::new();
    let mut connect = |pg: &mut PipelineGraph,
                       from: TaskId,
                       to: TaskId,
                       (src, dst): (u32, u32),
                       label: &'static str,
                       (mb, chunk): (u32, u32),
                       cost: Seconds| {
        if src == dst {
            pg.graph.add_data(from, to);
            return;
        }
        let link = *links.entry((src, dst)).or_insert_with(|| {
            let r = pg
                .resources
                .add_in_group(format!("p2p {src}->{dst}"), 1, src);
            pg.links.push((src, dst, r));
            r
        });
        let task = Task::new(label, TaskKind::Comm(CommKind::PipelineP2p), link).at(src, mb, chunk);
        let t = pg.add_task(task, cost);
        pg.graph.add_data(from, t);
        pg.graph.add_data(t, to);
    };
    for vs in 0..nv as u32 {
        for mb in 0..m {
            let i = at(vs, mb);
            pg.graph.add_edge(f_exit[i], b_entry[i], Dependency::Data);
            if w_entry[i] != NONE {
                pg.graph.add_data(split_b_exit[i], w_entry[i]);
            }
            if (vs as usize) + 1 < nv {
                let j = at(vs + 1, mb);
                let (here, next) = (schedule.stage_at(vs, mb), schedule.stage_at(vs + 1, mb));
                let chunk = |vs: u32| schedule.chunk_at(vs, mb);
                connect(
                    &mut pg,
                    f_exit[i],
                    f_entry[j],
                    (here, next),
                    "send act",
                    (mb, chunk(vs)),
                    p2p(vs, Flow::Activation),
                );
                connect(
                    &mut pg,
                    grad_out[j],
                    b_entry[i],
                    (next, here),
                    "send grad",
                    (mb, chunk(vs + 1)),
                    p2p(vs, Flow::Gradient),
                );
            }
        }
    }
    Ok(pg)
}

/// Generates `kind`'s schedule, builds it with `costs` and simulates it.
pub fn simulate_schedule(
    kind: ScheduleKind,
    pp: u32,
    m: u32,
    v: u32,
    costs: &PipelineCosts,
) -> Result<(PipelineGraph, Trace), ScheduleError> {
    let schedule = PipelineSchedule::generate(kind, pp, m, v)?;
    let pg = build_pipeline(&schedule, costs)?;
    let trace = pg.simulate()?;
    Ok((pg, trace))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EdgeFilter;

    const S0: Seconds = Seconds(0.0);

    fn s(x: f64) -> Seconds {
        Seconds(x)
    }

    fn ops_str(ops: &[ScheduledOp]) -> String {
        ops.iter()
            .map(|o| {
                let name = match o.op {
                    Op::F => "F",
                    Op::B => "B",
                    Op::W => "W",
                    Op::BW => "BW",
                };
                if o.chunk == 0 {
                    format!("{name}{}", o.micro_batch)
                } else {
                    format!("{name}{}.{}", o.micro_batch, o.chunk)
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// 2-stage 1F1B, 4 micro-batches, F = 1, fused backward BW = 2 (B = 1 + W = 1), free p2p.
    ///
    /// Orders: stage 0 (1 warm-up F): F0 F1 BW0 F2 BW1 F3 BW2 BW3;
    ///         stage 1 (no warm-up):  F0 BW0 F1 BW1 F2 BW2 F3 BW3.
    ///
    /// ```text
    /// s0: F0[0,1]  F1[1,2]
    /// s1: F0[1,2]  BW0[2,4]                      (needs s0.F0 at 1)
    /// s0: BW0[4,6]                               (needs s1.BW0 at 4)
    /// s1: F1[4,5]  BW1[5,7]                      (s1 free at 4; s0.F1 done at 2)
    /// s0: F2[6,7]  BW1[7,9]                      (needs s1.BW1 at 7)
    /// s1: F2[7,8]  BW2[8,10]                     (needs s0.F2 at 7)
    /// s0: F3[9,10] BW2[10,12]                    (needs s1.BW2 at 10)
    /// s1: F3[10,11] BW3[11,13]                   (needs s0.F3 at 10)
    /// s0: BW3[13,15]                             (needs s1.BW3 at 13)
    /// ```
    /// Makespan 15 = (m + p - 1)(F + B) = 5 * 3.
    #[test]
    fn one_f_one_b_two_stages_four_micro_batches_by_hand() {
        let sched = PipelineSchedule::generate(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
        assert_eq!(ops_str(sched.stage_ops(0)), "F0 F1 BW0 F2 BW1 F3 BW2 BW3");
        assert_eq!(ops_str(sched.stage_ops(1)), "F0 BW0 F1 BW1 F2 BW2 F3 BW3");
        let costs = PipelineCosts::uniform(2, 1, s(1.0), s(1.0), s(1.0), S0);
        let pg = build_pipeline(&sched, &costs).unwrap();
        let t = pg.simulate().unwrap();
        assert_eq!(t.makespan, s(15.0));
        let starts = |stage: usize| -> Vec<f64> {
            pg.ops[stage]
                .iter()
                .map(|o| t.span(o.entry).start.0)
                .collect()
        };
        assert_eq!(starts(0), vec![0.0, 1.0, 4.0, 6.0, 7.0, 9.0, 10.0, 13.0]);
        assert_eq!(starts(1), vec![1.0, 2.0, 4.0, 5.0, 7.0, 8.0, 10.0, 11.0]);
        assert_eq!(pg.bubble_fraction(&t), vec![1.0 - 12.0 / 15.0; 2]);
    }

    /// Same pipeline with a p2p latency of 0.5 per transfer, on one link per direction:
    /// ```text
    /// s0: F0[0,1] F1[1,2];          act0 [1,1.5], act1 [2,2.5]
    /// s1: F0[1.5,2.5] BW0[2.5,4.5]; grad0 [4.5,5]
    /// s1: F1[4.5,5.5] BW1[5.5,7.5]; grad1 [7.5,8]
    /// s0: BW0[5,7] BW1[8,10]
    /// ```
    /// (m = 2) makespan 10 = 9 without latency + one round trip 2 * 0.5.
    #[test]
    fn one_f_one_b_with_p2p_latency_by_hand() {
        let costs = PipelineCosts::uniform(2, 1, s(1.0), s(1.0), s(1.0), s(0.5));
        let (pg, t) = simulate_schedule(ScheduleKind::OneFOneB, 2, 2, 1, &costs).unwrap();
        assert_eq!(t.makespan, s(10.0));
        let starts: Vec<f64> = pg.ops[1].iter().map(|o| t.span(o.entry).start.0).collect();
        assert_eq!(starts, vec![1.5, 2.5, 4.5, 5.5]);
        assert_eq!(pg.links.len(), 2);
        let totals = t.per_kind_totals(&pg.graph);
        assert_eq!(totals[&TaskKind::Comm(CommKind::PipelineP2p)], s(4.0 * 0.5));
    }

    /// Uniform GPipe and 1F1B with free p2p and B = 2F: makespan (m + p - 1)(F + B) and every
    /// stage idle for (p - 1) / (m + p - 1) of it.
    #[test]
    fn gpipe_and_1f1b_bubble_fraction() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for p in [1u32, 2, 3, 4, 8] {
                for m in [1u32, 2, 3, 4, 7, 16] {
                    let costs = PipelineCosts::uniform(p, 1, s(1.0), s(1.5), s(0.5), S0);
                    let (pg, t) = simulate_schedule(kind, p, m, 1, &costs).unwrap();
                    assert_eq!(
                        t.makespan,
                        s(f64::from(m + p - 1) * 3.0),
                        "{kind} p={p} m={m}"
                    );
                    let expect = f64::from(p - 1) / f64::from(m + p - 1);
                    for b in pg.bubble_fraction(&t) {
                        assert!(
                            (b - expect).abs() < 1e-12,
                            "{kind} p={p} m={m}: {b} vs {expect}"
                        );
                    }
                }
            }
        }
    }

    /// Uniform interleaved 1F1B, per-chunk F = 1, BW = 2 (the stage's full F and B are v times
    /// that), free p2p. Narayanan et al. 2021 (§2.2.2): bubble time (p - 1)(t_f + t_b) / v, i.e.
    /// a bubble time fraction (p - 1) / (v m) of the ideal time m (t_f + t_b). The simulation
    /// reproduces it exactly: makespan = (v m + p - 1) chunk-(F + B), so the idle share of the
    /// makespan is (p - 1) / (v m + p - 1) and bubble / ideal = (p - 1) / (v m).
    #[test]
    fn interleaved_bubble_matches_narayanan() {
        for p in [2u32, 3, 4, 8] {
            for v in [2u32, 3, 4] {
                for m in [p, 2 * p, 4 * p] {
                    let costs = PipelineCosts::uniform(p, v, s(1.0), s(1.0), s(1.0), S0);
                    let (pg, t) =
                        simulate_schedule(ScheduleKind::Interleaved1F1B, p, m, v, &costs).unwrap();
                    let chunk_fb = 3.0;
                    let ideal = f64::from(v * m) * chunk_fb;
                    assert_eq!(
                        t.makespan,
                        s(ideal + f64::from(p - 1) * chunk_fb),
                        "p={p} v={v} m={m}"
                    );
                    let bubble_over_ideal = (t.makespan.0 - ideal) / ideal;
                    assert!(
                        (bubble_over_ideal - f64::from(p - 1) / f64::from(v * m)).abs() < 1e-12
                    );
                    let expect = f64::from(p - 1) / f64::from(v * m + p - 1);
                    for b in pg.bubble_fraction(&t) {
                        assert!(
                            (b - expect).abs() < 1e-12,
                            "p={p} v={v} m={m}: {b} vs {expect}"
                        );
                    }
                }
            }
        }
    }

    /// Megatron-LM's order for pp = 2, v = 2, m = 4 (k-th forward: micro-batch
    /// (k / 4) * 2 + k % 2, chunk (k % 4) / 2; backwards reversed chunks). Stage 0 warms up with
    /// 2 (2 - 0 - 1) + (2 - 1) 2 = 4 forwards, stage 1 with 2.
    #[test]
    fn interleaved_order_follows_megatron() {
        let sched = PipelineSchedule::generate(ScheduleKind::Interleaved1F1B, 2, 4, 2).unwrap();
        assert_eq!(
            ops_str(sched.stage_ops(0)),
            "F0 F1 F0.1 F1.1 F2 BW0.1 F3 BW1.1 F2.1 BW0 F3.1 BW1 BW2.1 BW3.1 BW2 BW3"
        );
        assert_eq!(
            ops_str(sched.stage_ops(1)),
            "F0 F1 F0.1 BW0.1 F1.1 BW1.1 F2 BW0 F3 BW1 F2.1 BW2.1 F3.1 BW3.1 BW2 BW3"
        );
    }

    #[test]
    fn dual_pipe_runs_each_pass_once_from_both_ends() {
        use ScheduleKind::*;
        for (pp, m) in [(2u32, 4u32), (4, 12), (8, 16), (8, 40)] {
            let sc = PipelineSchedule::generate(DualPipe, pp, m, 1).unwrap();
            assert_eq!((sc.positions(), sc.chunks()), (pp, 2));
            // Every (virtual stage, micro-batch) runs one forward, one backward (fused, or B
            // and W) on the stage its direction puts it on.
            let mut seen = vec![[0u32; 3]; (pp * m) as usize];
            for st in 0..pp {
                for op in sc.stage_ops(st) {
                    let vs = sc.position(st, op.chunk);
                    assert_eq!(sc.stage_at(vs, op.micro_batch), st, "{pp} {m} {op:?}");
                    assert_eq!(sc.chunk_at(vs, op.micro_batch), op.chunk);
                    let n = &mut seen[(vs * m + op.micro_batch) as usize];
                    match op.op {
                        Op::F => n[0] += 1,
                        Op::B => n[1] += 1,
                        Op::W => n[2] += 1,
                        Op::BW => {
                            n[1] += 1;
                            n[2] += 1;
                        }
                    }
                }
                // DeepSeek-V3 report, Table 2: pp + 1 micro-batches of activations a device.
                assert_eq!(sc.max_in_flight(st), pp + 1, "{pp} {m} stage {st}");
                assert_eq!(max_in_flight(DualPipe, pp, m, 1, st).unwrap(), pp + 1);
            }
            assert!(seen.iter().all(|n| *n == [1, 1, 1]), "{pp} {m}");
        }
        // Stage 1 of 4 holds virtual stages 1 and 2; micro-batch 0 enters at stage 0, the
        // last at stage 3.
        let four = PipelineSchedule::generate(DualPipe, 4, 8, 1).unwrap();
        assert_eq!((four.position(1, 0), four.position(1, 1)), (1, 2));
        assert_eq!((four.stage_at(0, 0), four.stage_at(0, 7)), (0, 3));
        assert_eq!(stage_positions(DualPipe, 4, 1, 3), vec![0, 3]);
        for (pp, m) in [(3, 12), (4, 6), (4, 9)] {
            assert!(matches!(
                PipelineSchedule::generate(DualPipe, pp, m, 1),
                Err(ScheduleError::DualPipeSizes { .. })
            ));
        }
        // Uniform passes: a smaller bubble than 1F1B's on the same stages, and no cycle.
        let costs = PipelineCosts::uniform(4, 1, s(1.0), s(1.0), s(1.0), s(0.0));
        let bubble = |kind| {
            let (pg, trace) = simulate_schedule(kind, 4, 16, 1, &costs).unwrap();
            pg.bubble_fraction(&trace)[0]
        };
        assert!(
            bubble(DualPipe) < bubble(OneFOneB) / 2.0,
            "{} vs {}",
            bubble(DualPipe),
            bubble(OneFOneB)
        );
        // Its merged pairs, by hand for stage 0 of 4 with 12: 2 · (6 − 4 + 1) + (2 − 1) = 7.
        assert_eq!(merged_fraction(DualPipe, 4, 12, 1), 7.0 / 12.0);
        // Two stages: both middle, the first pair of the main step apart: 2 · 3 − 1 of 8.
        assert_eq!(merged_fraction(DualPipe, 2, 8, 1), 5.0 / 8.0);
    }

    #[test]
    fn merged_passes_are_the_steady_state_of_stage_0() {
        use ScheduleKind::*;
        // Interleaved, pp 4, v 2, m 8: stage 0 runs 2·3 + 1·4 = 10 warm-up forwards of its 16,
        // and as many backwards alone at the end: 6 of 16 merged.
        assert_eq!(merged_fraction(Interleaved1F1B, 4, 8, 2), 6.0 / 16.0);
        let sched = PipelineSchedule::generate(Interleaved1F1B, 4, 8, 2).unwrap();
        let ops = sched.stage_ops(0);
        let lead = ops.iter().take_while(|o| o.op == Op::F).count();
        assert_eq!(
            lead,
            10 + 1,
            "warm-up, then the first steady forward before a backward"
        );
        // One stage: forward i + 1 with backward i, m − 1 of m.
        assert_eq!(merged_fraction(OneFOneB, 1, 4, 1), 0.75);
        // More warm-up than passes: nothing merges. Plain 1F1B over stages never merges.
        assert_eq!(merged_fraction(Interleaved1F1B, 8, 2, 2), 0.0);
        assert_eq!(merged_fraction(OneFOneB, 4, 16, 1), 0.0);
        assert_eq!(merged_fraction(GPipe, 4, 16, 1), 0.0);
    }

    /// ZB-H1 with T_F = T_B = T_W = 1 and free p2p. Qi et al. 2023, Table 2: bubble
    /// (p - 1)(T_F + T_B - T_W) against 1F1B's (p - 1)(T_F + T_B + T_W), so with m micro-batches
    /// the makespans are 3m + (p - 1) and 3m + 3(p - 1).
    #[test]
    fn zb_h1_bubble_is_a_third_of_1f1b() {
        for p in [2u32, 3, 4, 8] {
            for m in [p, p + 1, 2 * p, 3 * p + 1] {
                let costs = PipelineCosts::uniform(p, 1, s(1.0), s(1.0), s(1.0), S0);
                let (_, zb) =
                    simulate_schedule(ScheduleKind::ZeroBubbleH1, p, m, 1, &costs).unwrap();
                let (_, ob) = simulate_schedule(ScheduleKind::OneFOneB, p, m, 1, &costs).unwrap();
                assert_eq!(zb.makespan, s(f64::from(3 * m + (p - 1))), "p={p} m={m}");
                assert_eq!(
                    ob.makespan,
                    s(f64::from(3 * m + 3 * (p - 1))),
                    "p={p} m={m}"
                );
            }
        }
        // With the transformer ratios of the paper (T_W < T_F < T_B, T_B + T_W = 2 T_F) ZB-H1 is
        // still strictly faster than 1F1B.
        let costs = PipelineCosts::uniform(4, 1, s(1.0), s(1.25), s(0.75), S0);
        let (_, zb) = simulate_schedule(ScheduleKind::ZeroBubbleH1, 4, 8, 1, &costs).unwrap();
        let (_, ob) = simulate_schedule(ScheduleKind::OneFOneB, 4, 8, 1, &costs).unwrap();
        assert!(
            zb.makespan.0 < ob.makespan.0,
            "{} vs {}",
            zb.makespan,
            ob.makespan
        );
    }

    /// ZB-H1 order from the paper's Figure 3 (top), p = 4 (1-indexed there): device 1 runs
    /// "... B1 W1 F5 B2 W2", device 2 "... B2 W1 F5 B3 W2", device 4 "... B4 W1 F5 B5 W2".
    #[test]
    fn zb_h1_order_follows_the_paper() {
        let sched = PipelineSchedule::generate(ScheduleKind::ZeroBubbleH1, 4, 6, 1).unwrap();
        assert_eq!(
            ops_str(sched.stage_ops(0)),
            "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
        );
        assert_eq!(
            ops_str(sched.stage_ops(1)),
            "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5"
        );
        assert_eq!(
            ops_str(sched.stage_ops(3)),
            "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"
        );
    }

    #[test]
    fn in_flight_formula_matches_generated_schedules() {
        use ScheduleKind::*;
        for kind in [GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1] {
            for p in 1u32..=6 {
                for mult in 1u32..=4 {
                    for v in [1u32, 2, 3] {
                        let m = if kind == Interleaved1F1B {
                            p * mult
                        } else {
                            mult + p / 2
                        };
                        let Ok(sched) = PipelineSchedule::generate(kind, p, m, v) else {
                            continue;
                        };
                        for st in 0..p {
                            assert_eq!(
                                sched.max_in_flight(st),
                                max_in_flight(kind, p, m, v, st).unwrap(),
                                "{kind} p={p} m={m} v={v} stage={st}"
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(max_in_flight(GPipe, 4, 16, 1, 3), Ok(16));
        assert_eq!(max_in_flight(OneFOneB, 4, 16, 1, 0), Ok(4));
        assert_eq!(max_in_flight(OneFOneB, 4, 16, 1, 3), Ok(1));
        assert_eq!(max_in_flight(OneFOneB, 4, 2, 1, 0), Ok(2));
        assert_eq!(max_in_flight(ZeroBubbleH1, 4, 16, 1, 1), Ok(3));
        // Stage 0, pp = 4, v = 2: pp v + pp - 1 = 11 chunk activations = 5.5 micro-batches
        // = pp (1 + (pp - 1) / (pp v)) (Korthikanti et al. 2022).
        assert_eq!(max_in_flight(Interleaved1F1B, 4, 16, 2, 0), Ok(11));
        assert_eq!(max_in_flight(Interleaved1F1B, 4, 16, 2, 3), Ok(5));
        assert_eq!(
            max_in_flight(OneFOneB, 4, 16, 1, 4),
            Err(ScheduleError::StageOutOfRange { stage: 4, pp: 4 })
        );
    }

    #[test]
    fn schedule_errors() {
        use ScheduleKind::*;
        assert_eq!(
            PipelineSchedule::generate(Interleaved1F1B, 4, 6, 2),
            Err(ScheduleError::MicroBatchesNotMultipleOfStages { m: 6, pp: 4 })
        );
        assert_eq!(
            PipelineSchedule::generate(Interleaved1F1B, 4, 8, 1),
            Err(ScheduleError::InterleavedNeedsChunks { v: 1 })
        );
        assert_eq!(
            PipelineSchedule::generate(OneFOneB, 4, 8, 2),
            Err(ScheduleError::ChunksNotSupported {
                kind: OneFOneB,
                v: 2
            })
        );
        assert!(matches!(
            PipelineSchedule::generate(GPipe, 0, 8, 1),
            Err(ScheduleError::Zero { .. })
        ));
        let sched = PipelineSchedule::generate(OneFOneB, 2, 2, 1).unwrap();
        let short = PipelineCosts {
            forward: vec![s(1.0)],
            ..PipelineCosts::uniform(2, 1, s(1.0), s(1.0), s(1.0), S0)
        };
        assert_eq!(
            build_pipeline(&sched, &short).unwrap_err(),
            ScheduleError::CostLength {
                what: "forward",
                expected: 2,
                got: 1
            }
        );
    }

    /// Generated schedules pass the hand-written-schedule check; broken ones do not, and an
    /// order that deadlocks is caught as a cycle when simulated.
    #[test]
    fn hand_written_schedules_are_checked() {
        use ScheduleKind::*;
        for (kind, p, m, v) in [
            (GPipe, 3, 5, 1),
            (OneFOneB, 4, 3, 1),
            (Interleaved1F1B, 3, 6, 3),
            (ZeroBubbleH1, 4, 9, 1),
        ] {
            let g = PipelineSchedule::generate(kind, p, m, v).unwrap();
            let h = PipelineSchedule::from_stages(p, m, v, g.all_stage_ops().to_vec()).unwrap();
            assert_eq!(h.kind(), None);
            assert_eq!(h.all_stage_ops(), g.all_stage_ops());
        }
        let f = |mb| ScheduledOp::new(Op::F, mb, 0);
        let bw = |mb| ScheduledOp::new(Op::BW, mb, 0);
        let b = |mb| ScheduledOp::new(Op::B, mb, 0);
        // Missing BW of micro-batch 1 on stage 1.
        let err = PipelineSchedule::from_stages(
            2,
            2,
            1,
            vec![vec![f(0), f(1), bw(0), bw(1)], vec![f(0), f(1), bw(0)]],
        );
        assert!(matches!(
            err,
            Err(ScheduleError::InvalidSchedule {
                stage: 1,
                micro_batch: 1,
                ..
            })
        ));
        // B without W.
        let err = PipelineSchedule::from_stages(1, 1, 1, vec![vec![f(0), b(0)]]);
        assert!(matches!(
            err,
            Err(ScheduleError::InvalidSchedule {
                stage: 0,
                micro_batch: 0,
                ..
            })
        ));
        // Stage 0 wants BW1 before F1 reaches stage 1, while stage 1 runs F1 last: the order is
        // complete but impossible, and simulation says so.
        let sched = PipelineSchedule::from_stages(
            2,
            2,
            1,
            vec![
                vec![f(0), bw(1), f(1), bw(0)],
                vec![f(0), bw(0), f(1), bw(1)],
            ],
        )
        .unwrap();
        let pg = build_pipeline(
            &sched,
            &PipelineCosts::uniform(2, 1, s(1.0), s(1.0), s(1.0), S0),
        )
        .unwrap();
        assert!(matches!(pg.simulate(), Err(SimError::Cycle { .. })));
    }

    /// The step simulator's use: each forward is expanded into compute + an inline TP
    /// all-reduce on the compute stream, and each stage's DP all-reduce runs on its own link
    /// after the stage's last W. 1F1B, p = 2, m = 2, F = 1 + 0.5 (TP), BW = 2, DP = 3:
    /// ```text
    /// s0: F0[0,1.5] F1[1.5,3]
    /// s1: F0[1.5,3] BW0[3,5] F1[5,6.5] BW1[6.5,8.5] -> DP [8.5,11.5]
    /// s0: BW0[5,7] BW1[8.5,10.5]                    -> DP [10.5,13.5]
    /// ```
    #[test]
    fn expander_and_appended_dp_reduction() {
        let sched = PipelineSchedule::generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let mut pg = build_pipeline_with::<ScheduleError, _>(&sched, &|_, _| S0, |pg, ctx| {
            let at = |t: Task| t.at(ctx.stage, ctx.micro_batch, ctx.chunk);
            match ctx.op {
                Op::F => {
                    let c = pg.add_task(at(Task::new("F", TaskKind::Forward, ctx.compute)), s(1.0));
                    let ar = pg.add_task(
                        at(Task::new(
                            "tp ar",
                            TaskKind::Comm(CommKind::TpAllReduce),
                            ctx.compute,
                        )),
                        s(0.5),
                    );
                    pg.graph.add_data(c, ar);
                    Ok(OpSpan { entry: c, exit: ar })
                }
                Op::B => {
                    let t = pg.add_task(
                        at(Task::new("B", TaskKind::BackwardInput, ctx.compute)),
                        s(1.0),
                    );
                    Ok(OpSpan { entry: t, exit: t })
                }
                _ => {
                    let t = pg.add_task(
                        at(Task::new("W", TaskKind::BackwardWeight, ctx.compute)),
                        s(1.0),
                    );
                    Ok(OpSpan { entry: t, exit: t })
                }
            }
        })
        .unwrap();
        for stage in 0..2 {
            let last = pg.last_weight_grad(stage, None).unwrap();
            assert_eq!(pg.last_weight_grad(stage, Some(0)), Some(last));
            assert_eq!(pg.last_weight_grad(stage, Some(1)), None);
            let link = pg.resources.add_in_group(format!("dp {stage}"), 1, stage);
            let dp = pg.add_task(
                Task::new("dp ar", TaskKind::Comm(CommKind::DpAllReduce), link).at(stage, 0, 0),
                s(3.0),
            );
            pg.graph.add_data(last, dp);
        }
        let t = pg.simulate().unwrap();
        assert_eq!(t.makespan, s(13.5));
        let dp_ends: Vec<f64> = t
            .spans
            .iter()
            .zip(pg.graph.tasks())
            .filter(|(_, task)| task.label == "dp ar")
            .map(|(sp, _)| sp.end.0)
            .collect();
        assert_eq!(dp_ends, vec![13.5, 11.5]);
        assert!(t.critical_path(&pg.graph, EdgeFilter::DataOnly).unwrap().0 <= 13.5);
    }

    /// Schedules differ by stage: a slow last stage (F = 2, BW = 4) in 1F1B, p = 2, m = 2.
    /// ```text
    /// s0: F0[0,1] F1[1,2]
    /// s1: F0[1,3] BW0[3,7] F1[7,9] BW1[9,13]
    /// s0: BW0[7,9] BW1[13,15]
    /// ```
    #[test]
    fn per_stage_costs() {
        let costs = PipelineCosts {
            forward: vec![s(1.0), s(2.0)],
            backward_input: vec![s(1.0), s(2.0)],
            backward_weight: vec![s(1.0), s(2.0)],
            p2p: S0,
            p2p_gradient: S0,
            p2p_boundaries: Vec::new(),
        };
        let (_, t) = simulate_schedule(ScheduleKind::OneFOneB, 2, 2, 1, &costs).unwrap();
        assert_eq!(t.makespan, s(15.0));
    }

    #[test]
    fn pipeline_chrome_trace_has_every_task() {
        let costs = PipelineCosts::uniform(2, 2, s(1e-3), s(1e-3), s(1e-3), s(1e-4));
        let (pg, t) = simulate_schedule(ScheduleKind::Interleaved1F1B, 2, 4, 2, &costs).unwrap();
        let v = t.to_chrome_trace(&pg.graph, &pg.resources);
        let xs = v["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .count();
        assert_eq!(xs, pg.graph.len());
        // 2 stages x 2 chunks x 4 micro-batches x (F, B, W) + 3 boundaries x 4 x 2 transfers.
        assert_eq!(pg.graph.len(), 2 * 2 * 4 * 3 + 3 * 4 * 2);
    }

    /// 64 stages x 256 micro-batches x v = 2 interleaved: ~160k tasks. Checks the exact makespan
    /// (v m + p - 1) chunk-(F + B) and prints build and simulation time (run with
    /// `cargo test --release -p parallax-sim large -- --nocapture` to measure).
    #[test]
    fn large_interleaved_schedule() {
        let (p, m, v) = (64u32, 256u32, 2u32);
        let costs = PipelineCosts::uniform(p, v, s(1.0), s(1.0), s(1.0), S0);
        let t0 = std::time::Instant::now();
        let sched = PipelineSchedule::generate(ScheduleKind::Interleaved1F1B, p, m, v).unwrap();
        let pg = build_pipeline(&sched, &costs).unwrap();
        let t1 = std::time::Instant::now();
        let trace = pg.simulate().unwrap();
        let t2 = std::time::Instant::now();
        println!(
            "64x256 v=2 interleaved: {} tasks, {} edges; generate+build {:?}, simulate {:?}",
            pg.graph.len(),
            pg.graph.edges().len(),
            t1 - t0,
            t2 - t1
        );
        assert_eq!(trace.makespan, s(f64::from(v * m + p - 1) * 3.0));
    }
}
