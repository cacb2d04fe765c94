//! The structured search: every layout of a transformer on a cluster (dp × tp × pp × cp, ep for
//! mixture-of-experts models, micro-batch, ZeRO stage, recomputation, sequence parallelism,
//! pipeline schedule with every valid interleave, and stage partitioning), pruned by cheap
//! analytic bounds, the survivors simulated in parallel.
//!
//! The search is a best-first branch and bound. Every candidate gets a memory bound and a
//! step-time bound ([`crate::bounds`]); those over memory are rejected, the rest are sorted by
//! (bound, id) and simulated in fixed-size batches in that order. Once the next candidate's
//! bound is no better than the K-th best simulated step time (and no better than the best of any
//! alternative family it belongs to, see [`Family`]), it and everything after it are pruned.
//! Batches have a fixed size and results are merged in order, so the outcome does not depend on
//! the number of threads; ties go to the lower step time, then the lower candidate id (its
//! position in the enumeration).

use crate::bounds::{balanced_layers, extras, memory_gib, pass_times, ScheduleSummary};
use crate::export::Engine;
use parallax_cost::compute::DeviceModel;
use parallax_cost::transformer::{
    faster_dispatcher, model_flops_per_step, transformer_costs_with, Infeasible, SectionGraphs,
    Setup, TransformerCosts,
};
use parallax_ir::models::TransformerConfig;
use parallax_ir::{
    Dispatcher, Fp8Recipe, Layout, Offload, PartialLayout, Recompute, RecomputeModules, Schedule,
    StageRange,
};
use parallax_sim::{simulate_priced, stage_layers, ScheduleKind, StepError, StepPrediction};
use rayon::prelude::*;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use thiserror::Error;

/// Largest micro-batch (sequences) the search tries by default. Beyond 64 sequences per
/// micro-batch no published large-model run goes, and GEMMs are long saturated.
pub const DEFAULT_MAX_MICRO_BATCH: u64 = 64;

/// How many plans the search returns by default.
pub const DEFAULT_TOP_K: usize = 5;

/// Candidates simulated per batch of the branch and bound. Fixed (not the thread count) so the
/// set of simulated candidates, and so the rejection counts, do not depend on the machine.
pub const BATCH: usize = 8;

/// Options of [`search`]. Every field has a default ([`SearchOptions::default`]); the `force_*`
/// knobs exist for ablations.
#[derive(Clone, Debug)]
pub struct SearchOptions {
    /// Plans to return, best first.
    pub top_k: usize,
    /// Largest micro-batch tried.
    pub max_micro_batch: u64,
    /// Values the knobs `force` leaves out may take. Interleaved 1F1B is tried with every
    /// valid number of virtual stages (see `schedule_options`).
    pub space: Space,
    /// Knobs forced to a value; `None` leaves a knob to the search.
    pub force: PartialLayout,
    /// Only the even stage split ([`parallax_sim::stage_layers`]), no balanced partitions.
    pub force_even_stages: bool,
    /// Simulate every well-formed candidate: no memory or step-time pruning (the brute-force
    /// reference the pruned search is tested against).
    pub force_exhaustive: bool,
    /// Track the best plan of each [`Family`] (for explanations); costs extra simulations.
    pub families: bool,
    /// Only layouts this engine can run ([`Engine::supports`]), for a plan meant for export.
    pub engine: Option<Engine>,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            top_k: DEFAULT_TOP_K,
            max_micro_batch: DEFAULT_MAX_MICRO_BATCH,
            space: Space::default(),
            force: PartialLayout::default(),
            force_even_stages: false,
            force_exhaustive: false,
            families: true,
            engine: None,
        }
    }
}

/// Values a left-out knob may take (a framework's capabilities), for the search and for
/// completion alike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Space {
    /// Pipeline schedules.
    pub schedules: Vec<Schedule>,
    /// ZeRO stages (when data parallel).
    pub zero_stages: Vec<u8>,
    /// Recompute policies.
    pub recompute: Vec<Recompute>,
    /// Named submodules may be recomputed ([`Recompute::Modules`], Megatron-Core's
    /// `--recompute-modules`, core 0.13+): given in a layout, or the sets recipes name for
    /// the model (`recompute_options`).
    pub recompute_modules: bool,
    /// Every k-th layer may be recomputed whole ([`Recompute::Every`]: Megatron-Core's
    /// `--recompute-method block`, torchtitan's layer-level selective checkpointing, FSDP's
    /// `apply_activation_checkpointing` on a share of the blocks): given in a layout.
    pub recompute_layers: bool,
    /// (Virtual) pipeline stages may hold unequal layer counts (torchtitan's split points,
    /// DeepSpeed's uniform partition; the default); otherwise (Megatron-LM) every stage holds
    /// the same number, and an interleave left out must divide the layers evenly.
    pub uneven_stages: bool,
    /// Where stages are otherwise even: the embedding and the loss may each count as one
    /// layer of the split (Megatron-Core's `--account-for-embedding-in-pipeline-split` and
    /// `--account-for-loss-in-pipeline-split`), so layers + 2 split evenly over the (virtual)
    /// stages, the first and the last one layer short (Qwen3-235B's 94 layers over 32).
    pub embedding_and_loss_as_layers: bool,
    /// An MoE layer's tokens may be dispatched node-deduplicated (DeepEP) where the expert
    /// group spans nodes.
    pub deepep: bool,
    /// The expert dispatch may run beside another micro-batch's compute
    /// ([`Layout::ep_overlap`]).
    pub ep_overlap: bool,
    /// Megatron-style sequence parallelism may be chosen with tensor parallelism.
    pub sequence_parallel: bool,
    /// Tensor, context and expert parallelism may be chosen (data-parallel-only stacks such
    /// as `torch.nn.DataParallel` or plain FSDP have none).
    pub model_parallel: bool,
    /// Context parallelism may be chosen (ring attention over the sequence: Megatron-Core
    /// from late 2023, DeepSpeed-Ulysses, torchtitan, Llama 3's); stacks of before have none.
    pub context_parallel: bool,
    /// What may be offloaded to host memory, tried in this order when nothing fits without
    /// it (offload is slower wherever the states fit on the device).
    pub offload: Vec<Offload>,
    /// The fp8 recipes the stack runs (`--fp8-recipe`); none before fp8 training existed.
    pub fp8_recipes: Vec<Fp8Recipe>,
    /// Tensor-parallel collectives may be micro-pipelined with their matmuls (`--async-tp`,
    /// PyTorch's asynchronous TP).
    pub async_tp: bool,
    /// What the stack runs where a pipelined run sets no micro-batch count or no stages per
    /// rank, when that is not the fastest choice: applied by [`crate::complete`] to the knobs
    /// a publication leaves open. The search itself tries every count (the knob is the
    /// user's). `None`: whatever is fastest.
    pub pipeline_defaults: Option<PipelineDefaults>,
}

/// A stack's pipeline defaults ([`Space::pipeline_defaults`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineDefaults {
    /// Micro-batches per step and data-parallel rank, per pipeline rank.
    pub microbatches_per_rank: u64,
    /// Model chunks a pipeline rank holds under an interleaved (looped) schedule.
    pub looped_stages_per_rank: u32,
}

impl Space {
    /// Whether the stack offers context parallelism: model parallelism, and ring attention
    /// among it ([`Space::context_parallel`]).
    pub fn offers_context_parallel(&self) -> bool {
        self.context_parallel && self.model_parallel
    }

    /// Whether the stack can run recompute policy `r`.
    pub fn allows_recompute(&self, r: Recompute) -> bool {
        match r {
            Recompute::Modules(_) => self.recompute_modules,
            Recompute::Every(_) => self.recompute_layers,
            r => self.recompute.contains(&r),
        }
    }
}

impl Default for Space {
    fn default() -> Self {
        Space {
            // DualPipe is understood (simulated, validated) but not proposed: no engine the
            // export writes for runs it.
            schedules: Schedule::ALL
                .into_iter()
                .filter(|s| !matches!(s, Schedule::None | Schedule::DualPipe))
                .collect(),
            zero_stages: vec![0, 1, 2, 3],
            recompute: Recompute::ALL.to_vec(),
            recompute_modules: false,
            recompute_layers: true,
            uneven_stages: true,
            embedding_and_loss_as_layers: false,
            deepep: true,
            ep_overlap: true,
            sequence_parallel: true,
            model_parallel: true,
            context_parallel: true,
            offload: Offload::ALL[1..].to_vec(),
            fp8_recipes: Fp8Recipe::ALL.to_vec(),
            async_tp: true,
            pipeline_defaults: None,
        }
    }
}

impl Space {
    /// Whether the stack splits `layers` over `chunks` (virtual) stages: unevenly, or evenly
    /// counting the embedding, the loss and `mtp` prediction modules as layers where it may
    /// (see [`Space::embedding_and_loss_as_layers`] and [`parallax_sim::accounted_layers`]).
    pub fn splits(&self, layers: u32, chunks: u32, mtp: u32) -> bool {
        self.uneven_stages
            || (layers % chunks == 0 && mtp == 0)
            || (self.embedding_and_loss_as_layers
                && parallax_sim::accounted_layers(layers, chunks, mtp).is_some())
    }
}

/// ZeRO stages a completion with `dp` data-parallel ranks may take.
pub(crate) fn zero_options(fixed: &PartialLayout, space: &Space, dp: u32) -> Vec<u8> {
    let offload = fixed.offload.unwrap_or_default();
    match fixed.zero_stage {
        Some(z) => vec![z],
        // Offload runs on one device too: the stages it works with.
        None if offload != Offload::None => space
            .zero_stages
            .iter()
            .copied()
            .filter(|z| offload.conflict(*z).is_none())
            .collect(),
        None if dp > 1 => space.zero_stages.clone(),
        None => vec![0],
    }
}

/// Recompute policies a completion may take: the space's, and where it recomputes named
/// submodules, the sets NVIDIA's Megatron-Bridge recipes name for a model like `model`
/// ([`module_recipes`]).
pub(crate) fn recompute_options(
    fixed: &PartialLayout,
    space: &Space,
    model: &TransformerConfig,
) -> Vec<Recompute> {
    match fixed.recompute {
        Some(r) => vec![r],
        None if space.recompute_modules => {
            let mut v = space.recompute.clone();
            v.extend(module_recipes(model));
            v
        }
        None => space.recompute.clone(),
    }
}

/// The `--recompute-modules` sets Megatron-Bridge's H100 performance recipes run
/// ([`crate::validate::BRIDGE_MOE_RECIPES`]), each once, for a model that has every part a set
/// names: latent attention for `mla_up_proj`, experts for `moe`, `moe_act` and
/// `shared_experts`.
fn module_recipes(model: &TransformerConfig) -> Vec<Recompute> {
    let has_parts = |m: RecomputeModules| {
        let experts = [
            RecomputeModules::MOE,
            RecomputeModules::MOE_ACT,
            RecomputeModules::SHARED_EXPERTS,
        ];
        (model.mla.is_some() || !m.contains(RecomputeModules::MLA_UP_PROJ))
            && (model.moe.is_some() || !experts.iter().any(|&e| m.contains(e)))
    };
    let mut sets: Vec<Recompute> = Vec::new();
    for r in crate::validate::BRIDGE_MOE_RECIPES {
        if r.recompute_modules.is_empty() {
            continue;
        }
        let m = RecomputeModules::parse(r.recompute_modules).expect("Megatron-Core's names");
        if has_parts(m) && !sets.contains(&Recompute::Modules(m)) {
            sets.push(Recompute::Modules(m));
        }
    }
    sets
}

/// The (schedule, interleave) pairs a completion with `pp` stages and `m` micro-batches may
/// take: without a pipeline none; else each schedule of `space` (or the given one), interleaved
/// 1F1B with the given v or every `2 ≤ v ≤ layers / pp` (splitting the layers evenly unless
/// the space allows uneven splits) when `m` is a multiple of `pp`. What rules a schedule out
/// goes to `reject` as (reason kind, what is wrong).
pub(crate) fn schedule_options(
    setup: &Setup,
    fixed: &PartialLayout,
    space: &Space,
    pp: u32,
    m: u64,
    reject: &mut dyn FnMut(&'static str, String),
) -> Vec<(Schedule, u32)> {
    if pp == 1 {
        return match fixed.schedule {
            Some(s) if s != Schedule::None => {
                reject("indivisible", format!("schedule {s} needs pp > 1"));
                Vec::new()
            }
            _ => vec![(Schedule::None, 1)],
        };
    }
    let layers = setup.model.layers;
    let scheds = fixed
        .schedule
        .map_or_else(|| space.schedules.clone(), |s| vec![s]);
    let mut out = Vec::new();
    for s in scheds {
        match s {
            Schedule::Interleaved1F1B => {
                // pp × v, where it fits a u32 (a hostile interleave may not).
                let chunks = |v: u32| pp.checked_mul(v);
                let even = |v: u32| {
                    chunks(v).is_some_and(|n| space.splits(layers, n, setup.model.mtp_layers))
                };
                // The interleaves that split the layers: what rules them all out is said first,
                // as no batch or micro-batch size fixes it.
                let vs = match fixed.interleave {
                    Some(v) if v < 2 || chunks(v).is_none_or(|n| n > layers) => Err(format!(
                        "interleaved-1f1b: v = {v} must be at least 2, and pp × v = {} at most \
                         the {layers} layers",
                        u64::from(pp) * u64::from(v)
                    )),
                    Some(v) if !even(v) => Err(format!(
                        "interleaved-1f1b: pp × v = {} does not divide the {layers} layers",
                        u64::from(pp) * u64::from(v)
                    )),
                    Some(v) => Ok(vec![v]),
                    None => {
                        let vs: Vec<u32> = (2..=layers / pp).filter(|&v| even(v)).collect();
                        if vs.is_empty() {
                            Err(format!(
                                "interleaved-1f1b: no interleave splits the {layers} layers \
                                 evenly over {pp} pipeline stages; give one"
                            ))
                        } else {
                            Ok(vs)
                        }
                    }
                };
                match vs {
                    Err(why) => reject("indivisible", why),
                    Ok(_) if m % u64::from(pp) != 0 => reject(
                        "indivisible",
                        format!("interleaved-1f1b: {m} micro-batches not a multiple of pp {pp}"),
                    ),
                    Ok(vs) => out.extend(vs.into_iter().map(|v| (s, v))),
                }
            }
            Schedule::None => {}
            Schedule::DualPipe if pp % 2 != 0 || m % 2 != 0 || m < 2 * u64::from(pp) => reject(
                "indivisible",
                format!(
                    "dualpipe needs an even pp and an even number of micro-batches, at least 2 × pp = {}; this batch gives {m}",
                    2 * u64::from(pp)
                ),
            ),
            s if fixed.interleave.is_none_or(|v| v == 1) => out.push((s, 1)),
            s => reject("indivisible", format!("{s} has no virtual stages (v = 1)")),
        }
    }
    out
}

/// Rejection reason of a tensor-parallel group wider than a node.
pub(crate) const TP_ACROSS_NODES: &str = "tp across nodes";

/// How many [`Family`] values there are.
const FAMILIES: usize = 5;

/// Families of layouts the best plan is compared against to explain why it wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// pp = 1.
    NoPipeline,
    /// tp = 1.
    NoTensor,
    /// ZeRO stage 3 (FSDP).
    Zero3,
    /// tp = pp = cp = 1: data parallelism only (with any ZeRO stage).
    DataOnly,
    /// No activation recomputation.
    NoRecompute,
}

impl Family {
    /// All families.
    pub const ALL: [Family; FAMILIES] = [
        Family::NoPipeline,
        Family::NoTensor,
        Family::Zero3,
        Family::DataOnly,
        Family::NoRecompute,
    ];

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Family::NoPipeline => "no PP",
            Family::NoTensor => "no TP",
            Family::Zero3 => "ZeRO-3",
            Family::DataOnly => "DP only",
            Family::NoRecompute => "no recompute",
        }
    }

    /// What the family holds, for sentences.
    pub fn describe(self) -> &'static str {
        match self {
            Family::NoPipeline => "without pipeline parallelism (pp = 1)",
            Family::NoTensor => "without tensor parallelism (tp = 1)",
            Family::Zero3 => "with ZeRO-3 / FSDP",
            Family::DataOnly => "with data parallelism only (tp = pp = cp = 1)",
            Family::NoRecompute => "without activation recomputation",
        }
    }

    /// Whether `l` belongs to the family.
    pub fn contains(self, l: &Layout) -> bool {
        match self {
            Family::NoPipeline => l.pp == 1,
            Family::NoTensor => l.tp == 1,
            Family::Zero3 => l.zero_stage >= 3,
            Family::DataOnly => l.tp == 1 && l.pp == 1 && l.cp == 1,
            Family::NoRecompute => l.recompute == Recompute::None,
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }

    fn mask(l: &Layout) -> u8 {
        Family::ALL
            .iter()
            .filter(|f| f.contains(l))
            .fold(0, |m, f| m | f.bit())
    }
}

/// A simulated candidate.
#[derive(Clone, Debug, Serialize)]
pub struct Evaluated {
    /// Position in the enumeration (stable across runs and machines).
    pub id: u64,
    pub layout: Layout,
    pub prediction: StepPrediction,
}

/// The best of one family, or why it has none.
#[derive(Clone, Debug, Serialize)]
pub struct FamilyResult {
    pub family: Family,
    /// Its fastest layout that fits.
    pub best: Option<Evaluated>,
    /// When none fits: the least memory any member needs (GiB), and that member.
    pub smallest_need_gib: Option<f64>,
    pub smallest_layout: Option<Layout>,
    /// Candidates in the family (before any pruning).
    pub candidates: u64,
}

impl FamilyResult {
    /// This family over two searches, `other`'s layouts renumbered by `renumber`: the faster
    /// best, or where neither fits the smaller need.
    fn merge(&mut self, other: FamilyResult, renumber: impl Fn(Evaluated) -> Evaluated) {
        self.candidates += other.candidates;
        match (&self.best, other.best) {
            (Some(a), Some(b)) if !better(&b, a) => {}
            (_, Some(b)) => {
                self.best = Some(renumber(b));
                (self.smallest_need_gib, self.smallest_layout) = (None, None);
            }
            (Some(_), None) => {}
            (None, None) => {
                // Options order `None` first: compare only needs that exist.
                let smaller = other
                    .smallest_need_gib
                    .is_some_and(|b| self.smallest_need_gib.is_none_or(|a| b < a));
                if smaller {
                    (self.smallest_need_gib, self.smallest_layout) =
                        (other.smallest_need_gib, other.smallest_layout);
                }
            }
        }
    }
}

/// How many candidates the search saw and what became of them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Candidates enumerated. A degree tuple rejected before its other knobs are enumerated
    /// (tp across nodes, tp not dividing the heads, …) counts once.
    pub candidates: u64,
    /// Candidates simulated.
    pub simulated: u64,
    /// Simulated candidates that fit.
    pub feasible: u64,
    /// Candidates rejected, by reason: `out of memory` (by bound or simulation), `indivisible`,
    /// `tp across nodes`, `pruned by step-time bound`, …
    pub rejected: BTreeMap<String, u64>,
    /// The first rejection's whole reason, of the most telling kind met (see
    /// `why_rank`): what an error says when nothing is left.
    #[serde(skip)]
    pub why: Option<String>,
    #[serde(skip)]
    why_rank: u8,
}

/// How telling a rejection reason is when no layout is left: that the export's engine cannot
/// run a layout (every candidate of a plan meant for export meets it) over any other, and a
/// tensor-parallel group too wide for a node (every search of several nodes meets one) only
/// when there is nothing else.
fn why_rank(reason: &str) -> u8 {
    if reason == TP_ACROSS_NODES {
        0
    } else if reason.starts_with(NOT_SUPPORTED_BY) {
        2
    } else {
        1
    }
}

/// Prefix of the rejection reason of a layout the export's engine cannot run.
const NOT_SUPPORTED_BY: &str = "not supported by ";

impl Counts {
    fn reject(&mut self, reason: &str, n: u64) {
        if n > 0 {
            *self.rejected.entry(reason.to_string()).or_default() += n;
        }
    }

    /// [`Counts::reject`] of one candidate, keeping its whole reason (`why` is only
    /// formatted when it is kept: rejections are counted on the search's hot path).
    fn reject_because(&mut self, reason: &str, why: impl FnOnce() -> String) {
        self.reject(reason, 1);
        let rank = why_rank(reason);
        if self.keeps_why(rank) {
            self.why = Some(why());
            self.why_rank = rank;
        }
    }

    /// Whether a reason of `rank` replaces the kept one.
    fn keeps_why(&self, rank: u8) -> bool {
        self.why.is_none() || rank > self.why_rank
    }

    fn merge(&mut self, o: &Counts) {
        self.candidates += o.candidates;
        self.simulated += o.simulated;
        self.feasible += o.feasible;
        for (k, v) in &o.rejected {
            *self.rejected.entry(k.clone()).or_default() += v;
        }
        if let Some(why) = o.why.as_ref().filter(|_| self.keeps_why(o.why_rank)) {
            self.why = Some(why.clone());
            self.why_rank = o.why_rank;
        }
    }
}

/// Rejection reason of candidates pruned by the step-time bound.
pub const PRUNED: &str = "pruned by step-time bound";
/// Rejection reason of candidates over memory.
pub const OUT_OF_MEMORY: &str = "out of memory";

/// What [`search`] found.
#[derive(Clone, Debug, Serialize)]
pub struct SearchResult {
    /// The best plans that fit, fastest first (at most `top_k`).
    pub top: Vec<Evaluated>,
    /// The best of each family (empty unless [`SearchOptions::families`]).
    pub families: Vec<FamilyResult>,
    pub counts: Counts,
    /// Model FLOPs of one step over (GPUs × dense peak): no layout can be faster.
    pub flops_bound_s: f64,
    /// A simulated step beat its tight time or memory bound (the simulator's model changed under
    /// the mirrored terms), so the search ran again with pipeline-only time bounds and
    /// states-only memory bounds: slower, and exact unless the looser bounds are off too. A sign
    /// that [`crate::bounds`] needs updating.
    pub bounds_fell_back: bool,
}

impl SearchResult {
    /// The best plan.
    pub fn best(&self) -> &Evaluated {
        &self.top[0]
    }

    /// The family result of `f`, when tracked.
    pub fn family(&self, f: Family) -> Option<&FamilyResult> {
        self.families.iter().find(|r| r.family == f)
    }

    /// "41 210 candidates: 3 120 simulated; 30 455 out of memory, 7 635 indivisible".
    pub fn summary_line(&self) -> String {
        let c = &self.counts;
        let mut reasons: Vec<(&String, &u64)> = c.rejected.iter().collect();
        reasons.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let rest: Vec<String> = reasons
            .iter()
            .map(|(k, v)| format!("{} {k}", group_digits(**v)))
            .collect();
        format!(
            "{} candidates: {} simulated ({} fit){}{}",
            group_digits(c.candidates),
            group_digits(c.simulated),
            group_digits(c.feasible),
            if rest.is_empty() { "" } else { "; " },
            rest.join(", ")
        )
    }
}

/// `41210` → `41 210`.
pub fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(ch);
    }
    out
}

/// Why the search found nothing.
#[derive(Debug, Error)]
pub enum SearchError {
    #[error("{0}")]
    Unsupported(String),
    #[error("no layout of {gpus} GPUs fits in memory: the smallest needs at least {need_gib:.1} GiB per GPU, a GPU has {have_gib:.1} GiB ({layout}); {summary}")]
    DoesNotFit {
        gpus: u32,
        need_gib: f64,
        have_gib: f64,
        layout: String,
        /// The layout that needs the least memory.
        smallest: Box<Layout>,
        summary: String,
    },
    #[error("no layout of {gpus} GPUs is valid: {summary}")]
    NoCandidate { gpus: u32, summary: String },
}

/// Progress of a running search: candidates decided so far out of those the branch and bound
/// will consider.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

pub(crate) fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n % d == 0 {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// A degree tuple with a micro-batch, recompute policy and sequence parallelism: the unit the
/// cost model prices.
#[derive(Clone, Debug)]
struct Group {
    index: u64,
    base: Layout,
}

/// A candidate that passed the memory bound.
#[derive(Clone, Debug)]
struct Candidate {
    id: u64,
    /// Position of its group in the enumeration.
    group: usize,
    layout: Layout,
    bound: f64,
    /// Memory bound, GiB (0 when not computed).
    memory: f64,
    families: u8,
}

/// What expanding one group produced.
#[derive(Debug, Default)]
struct Expanded {
    candidates: Vec<Candidate>,
    counts: Counts,
    /// Per family: candidates, and the smallest memory need among those over memory.
    family_members: [u64; FAMILIES],
    family_smallest: [Option<(f64, u64, Layout)>; TRACKED],
}

/// Memory is tracked per family and, in the last slot, over every layout (many belong to no
/// family): the smallest need is what an error says when nothing fits.
const TRACKED: usize = FAMILIES + 1;
/// The bit of that last slot, set for every candidate.
const ANY_LAYOUT: u8 = 1 << FAMILIES;

/// Searches the structured space of `setup`'s model and cluster.
pub fn search(setup: &Setup, opts: &SearchOptions) -> Result<SearchResult, SearchError> {
    search_with_progress(setup, opts, &|_| {})
}

/// [`search`], reporting progress to `progress` after every batch of simulations.
///
/// Where the best plan recomputes every layer and the stack recomputes a share of its layers
/// too ([`Space::recompute_layers`]), half the layers recomputed ([`Recompute::Every`] 2) is
/// searched as well: it keeps more than full recomputation and redoes half as much, so it can
/// only win where memory forced full recomputation (where keeping everything, or the
/// selective policy, fits, either is the faster), and trying it only then keeps the search
/// as fast as before everywhere else.
pub fn search_with_progress(
    setup: &Setup,
    opts: &SearchOptions,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<SearchResult, SearchError> {
    let mut r = search_offloads(setup, opts, progress)?;
    let full = r.best().layout.recompute == Recompute::Full;
    if !(full && opts.force.recompute.is_none() && opts.space.recompute_layers) {
        return Ok(r);
    }
    let half = SearchOptions {
        force: PartialLayout {
            recompute: Some(Recompute::Every(2)),
            ..opts.force.clone()
        },
        ..opts.clone()
    };
    if let Ok(h) = search_offloads(setup, &half, progress) {
        // Ids follow on from the first search's enumeration.
        let offset = r.counts.candidates;
        let renumber = |e: Evaluated| Evaluated {
            id: e.id + offset,
            ..e
        };
        r.counts.merge(&h.counts);
        r.top.extend(h.top.into_iter().map(renumber));
        r.top.sort_by(rank);
        r.top.truncate(opts.top_k.max(1));
        // Each family's best over both searches (the same families, in the same order).
        for (f, g) in r.families.iter_mut().zip(h.families) {
            f.merge(g, renumber);
        }
    }
    Ok(r)
}

/// One search of each offload the stack has, in turn, until a layout fits (offload is tried
/// only when memory binds).
fn search_offloads(
    setup: &Setup,
    opts: &SearchOptions,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<SearchResult, SearchError> {
    // Offload is tried when memory binds: first everything on the device, then each offload
    // the stack has, until a layout fits.
    let tries: Vec<Option<Offload>> = match opts.force.offload {
        Some(o) => vec![Some(o)],
        // NVMe only where the profile describes the node's drives.
        None => std::iter::once(Some(Offload::None))
            .chain(
                opts.space
                    .offload
                    .iter()
                    .filter(|o| !o.nvme() || setup.profile.node.nvme.is_some())
                    .map(|o| Some(*o)),
            )
            .collect(),
    };
    let mut first_error = None;
    let mut offload_notes = Vec::new();
    for (i, o) in tries.into_iter().enumerate() {
        let o_opts = SearchOptions {
            force: PartialLayout {
                offload: o,
                ..opts.force.clone()
            },
            ..opts.clone()
        };
        let r = match run(setup, &o_opts, progress, true) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => run(setup, &o_opts, progress, false).map(|r| {
                let mut r = r.expect("pipeline-only bounds are never violated");
                r.bounds_fell_back = true;
                r
            }),
            Err(e) => Err(e),
        };
        match r {
            Ok(r) => return Ok(r),
            // Only memory sends the search on to offload.
            Err(e @ SearchError::DoesNotFit { .. }) if i == 0 => first_error = Some(e),
            Err(e) if i == 0 => return Err(e),
            Err(e) => offload_notes.push(format!(
                "with offload {}: {}",
                o.unwrap_or_default(),
                match e {
                    SearchError::DoesNotFit { need_gib, .. } => {
                        format!("still {need_gib:.1} GiB per GPU")
                    }
                    SearchError::NoCandidate { summary, .. } => summary,
                    SearchError::Unsupported(why) => why,
                }
            )),
        }
    }
    match first_error.expect("at least one try") {
        SearchError::DoesNotFit {
            gpus,
            need_gib,
            have_gib,
            layout,
            smallest,
            summary,
        } if !offload_notes.is_empty() => Err(SearchError::DoesNotFit {
            gpus,
            need_gib,
            have_gib,
            layout,
            smallest,
            summary: format!("{summary}; {}", offload_notes.join("; ")),
        }),
        e => Err(e),
    }
}

/// One branch and bound; `tight` adds the mirrored simulator terms ([`crate::bounds::Extras`])
/// to the step-time bounds and counts activations and buffers in the memory bounds. `Ok(None)`
/// when a simulated step beat its tight time or memory bound.
fn run(
    setup: &Setup,
    opts: &SearchOptions,
    progress: &(dyn Fn(Progress) + Sync),
    tight: bool,
) -> Result<Option<SearchResult>, SearchError> {
    let dev = DeviceModel::new(setup.profile, setup.precision)
        .map_err(|e| SearchError::Unsupported(e.to_string()))?;
    let model_flops =
        model_flops_per_step(setup).map_err(|e| SearchError::Unsupported(e.to_string()))?;
    let flops_bound_s = model_flops / (f64::from(setup.gpus) * dev.gemm_peak());
    let mut counts = Counts::default();
    let groups = enumerate_groups(setup, opts, &mut counts);

    // Price each distinct cost key once (the expensive cost-model call), in parallel.
    let keys: Vec<CostKey> = groups.iter().map(|g| CostKey::of(setup, &g.base)).collect();
    let mut first: BTreeMap<CostKey, usize> = BTreeMap::new();
    for (i, k) in keys.iter().enumerate() {
        first.entry(*k).or_insert(i);
    }
    let first: Vec<(CostKey, usize)> = first.into_iter().collect();
    // Layouts of one TP degree and micro-batch shape share their section graphs.
    let graphs = SectionGraphs::default();
    let prices: HashMap<CostKey, Result<TransformerCosts, Infeasible>> = first
        .par_iter()
        .map(|(k, i)| (*k, transformer_costs_with(setup, &groups[*i].base, &graphs)))
        .collect();
    let price_of: Vec<&Result<TransformerCosts, Infeasible>> =
        keys.iter().map(|k| &prices[k]).collect();

    // Groups in the order of their bound: the busiest stage does at least the average work.
    let mut live: Vec<(f64, usize)> = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        match price_of[i] {
            Ok(c) => live.push((group_bound(setup, &g.base, c), i)),
            Err(e) => {
                counts.candidates += 1;
                counts.reject_because(e.kind(), || e.to_string());
            }
        }
    }
    live.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));

    let k = opts.top_k.max(1);
    let tracked = if opts.families {
        Family::ALL.iter().fold(0u8, |m, f| m | f.bit())
    } else {
        0
    };
    let mut top: Vec<Evaluated> = Vec::new();
    let mut fam_best: [Option<Evaluated>; FAMILIES] = Default::default();
    let mut family_members = [0u64; FAMILIES];
    let mut family_smallest: [Option<(f64, u64, Layout)>; TRACKED] = Default::default();
    let mut summaries: HashMap<SummaryKey, ScheduleSummary> = HashMap::new();
    let mut cands: Vec<Candidate> = Vec::new();
    let mut heap: BinaryHeap<Reverse<Queued>> = BinaryHeap::new();
    let mut gnext = 0usize;
    let total = live.len() as u64;
    progress(Progress { done: 0, total });

    let thresholds = |top: &[Evaluated], fam_best: &[Option<Evaluated>; FAMILIES]| {
        let global = if top.len() < k {
            f64::INFINITY
        } else {
            top[k - 1].prediction.step_time_s
        };
        let fam: [f64; FAMILIES] = std::array::from_fn(|i| {
            fam_best[i]
                .as_ref()
                .map_or(f64::INFINITY, |e| e.prediction.step_time_s)
        });
        (global, fam)
    };
    let wanted = |bound: f64, mask: u8, global: f64, fam: &[f64; FAMILIES]| {
        opts.force_exhaustive
            || bound <= global
            || (0..FAMILIES).any(|i| mask & tracked & (1 << i) != 0 && bound <= fam[i])
    };

    loop {
        let (global, fam) = thresholds(&top, &fam_best);
        let g_lb = live.get(gnext).map(|x| x.0);
        let c_lb = heap.peek().map(|q| q.0.bound);
        if g_lb.is_none() && c_lb.is_none() {
            break;
        }
        if g_lb.is_some_and(|g| c_lb.is_none_or(|c| g <= c)) {
            // Expand the next groups that may still hold a wanted candidate.
            let mut batch = Vec::with_capacity(GROUP_BATCH);
            while gnext < live.len() && batch.len() < GROUP_BATCH {
                let (lb, gi) = live[gnext];
                gnext += 1;
                let g = &groups[gi];
                let c = price_of[gi].as_ref().expect("priced");
                if wanted(lb, group_families(opts, &g.base), global, &fam) {
                    batch.push(gi);
                } else {
                    let (n, members) = group_size(setup, opts, g, c);
                    counts.candidates += n;
                    counts.reject(PRUNED, n);
                    for (a, b) in family_members.iter_mut().zip(members) {
                        *a += b;
                    }
                }
            }
            let mut need: Vec<SummaryKey> = Vec::new();
            for &gi in &batch {
                let base = &groups[gi].base;
                let m = base.micro_batches(setup.global_batch) as u32;
                for (s, v) in schedules_of(setup, opts, base) {
                    let key = (ScheduleKind::of(s, base.pp), base.pp, m, v);
                    if !summaries.contains_key(&key) {
                        need.push(key);
                    }
                }
            }
            need.sort_by_key(|k| (k.0 as u8, k.1, k.2, k.3));
            need.dedup();
            let fresh: Vec<(SummaryKey, ScheduleSummary)> = need
                .par_iter()
                .filter_map(|k| {
                    ScheduleSummary::new(k.0, k.1, k.2, k.3)
                        .ok()
                        .map(|s| (*k, s))
                })
                .collect();
            summaries.extend(fresh);
            let expanded: Vec<Expanded> = batch
                .par_iter()
                .map(|&gi| {
                    let c = price_of[gi].as_ref().expect("priced");
                    expand(setup, opts, tight, &groups[gi], c, &summaries)
                })
                .collect();
            for x in expanded {
                counts.merge(&x.counts);
                for (a, b) in family_members.iter_mut().zip(x.family_members) {
                    *a += b;
                }
                for (mine, theirs) in family_smallest.iter_mut().zip(x.family_smallest) {
                    if let Some(s) = theirs {
                        if mine.as_ref().is_none_or(|b| (s.0, s.1) < (b.0, b.1)) {
                            *mine = Some(s);
                        }
                    }
                }
                for c in x.candidates {
                    heap.push(Reverse(Queued {
                        bound: c.bound,
                        id: c.id,
                        index: cands.len(),
                    }));
                    cands.push(c);
                }
            }
            progress(Progress {
                done: gnext as u64,
                total,
            });
            continue;
        }
        // Simulate the next candidates that can still enter the top or a family's best.
        let limit = g_lb.unwrap_or(f64::INFINITY);
        let mut batch = Vec::with_capacity(BATCH);
        while batch.len() < BATCH {
            let Some(q) = heap.peek() else { break };
            if q.0.bound > limit {
                break;
            }
            let i = q.0.index;
            heap.pop();
            let c = &cands[i];
            if wanted(c.bound, c.families, global, &fam) {
                batch.push(i);
            } else {
                counts.reject(PRUNED, 1);
            }
        }
        let results: Vec<Result<StepPrediction, StepError>> = batch
            .par_iter()
            .map(|&i| {
                let c = price_of[cands[i].group].as_ref().expect("priced");
                simulate_priced(setup, &cands[i].layout, c, model_flops).map(|s| s.prediction)
            })
            .collect();
        for (&i, r) in batch.iter().zip(results) {
            let c = &cands[i];
            counts.simulated += 1;
            if let Ok(p) = &r {
                if tight && (p.step_time_s < c.bound || p.reserved_memory_gib < c.memory) {
                    return Ok(None);
                }
            }
            match r {
                Ok(p) if p.fits => {
                    counts.feasible += 1;
                    let e = Evaluated {
                        id: c.id,
                        layout: c.layout.clone(),
                        prediction: p,
                    };
                    for (f, best) in fam_best.iter_mut().enumerate() {
                        if c.families & (1 << f) != 0 && best.as_ref().is_none_or(|b| better(&e, b))
                        {
                            *best = Some(e.clone());
                        }
                    }
                    let pos = top.partition_point(|t| better(t, &e));
                    if pos < k {
                        top.insert(pos, e);
                        top.truncate(k);
                    }
                }
                Ok(p) => {
                    counts.reject(OUT_OF_MEMORY, 1);
                    for (f, s) in family_smallest.iter_mut().enumerate() {
                        if c.families & (1 << f) != 0
                            && s.as_ref()
                                .is_none_or(|b| (p.reserved_memory_gib, c.id) < (b.0, b.1))
                        {
                            *s = Some((p.reserved_memory_gib, c.id, c.layout.clone()));
                        }
                    }
                }
                Err(StepError::Infeasible(e)) => counts.reject_because(e.kind(), || e.to_string()),
                Err(e) => counts.reject(&format!("simulation error: {e}"), 1),
            }
        }
    }
    progress(Progress { done: total, total });

    if top.is_empty() {
        let summary = SearchResult {
            top: Vec::new(),
            families: Vec::new(),
            counts: counts.clone(),
            flops_bound_s,
            bounds_fell_back: false,
        }
        .summary_line();
        return Err(match &family_smallest[FAMILIES] {
            Some((need, _, l)) => SearchError::DoesNotFit {
                gpus: setup.gpus,
                need_gib: *need,
                have_gib: setup.profile.device.hbm_gib,
                layout: crate::complete::layout_string(l),
                smallest: Box::new(l.clone()),
                summary,
            },
            None => SearchError::NoCandidate {
                gpus: setup.gpus,
                summary: match (&counts.why, counts.candidates) {
                    (Some(why), _) => format!("{why} ({summary})"),
                    (None, 0) => format!(
                        "the given degrees ({}) do not divide {} GPUs",
                        crate::complete::partial_string(&opts.force),
                        setup.gpus
                    ),
                    (None, _) => summary,
                },
            },
        });
    }
    let families = if opts.families {
        Family::ALL
            .iter()
            .enumerate()
            .map(|(i, &family)| {
                let best = fam_best[i].clone();
                let smallest = if best.is_none() {
                    family_smallest[i].clone()
                } else {
                    None
                };
                FamilyResult {
                    family,
                    best,
                    smallest_need_gib: smallest.as_ref().map(|s| s.0),
                    smallest_layout: smallest.map(|s| s.2),
                    candidates: family_members[i],
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(Some(SearchResult {
        top,
        families,
        counts,
        flops_bound_s,
        bounds_fell_back: false,
    }))
}

/// Groups expanded per parallel batch. Fixed, like [`BATCH`], for determinism.
const GROUP_BATCH: usize = 16;

/// Which schedule summary: (schedule, pp, micro-batches, v).
type SummaryKey = (ScheduleKind, u32, u32, u32);

/// A candidate waiting in the branch and bound, ordered by (bound, id).
#[derive(Clone, Copy, Debug)]
struct Queued {
    bound: f64,
    id: u64,
    index: usize,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o).is_eq()
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.bound.total_cmp(&o.bound).then(self.id.cmp(&o.id))
    }
}

/// What [`transformer_costs`] reads from a layout besides the model and cluster: the degrees
/// that shape one device's work (tp, cp, ep, micro-batch, recompute, sequence parallelism),
/// whether there is a pipeline (a tied head shares the embedding only without one), and
/// whether pipeline neighbours sit on different nodes. Groups that agree on it share one
/// pricing, and so do their candidates: bounds and simulations read the shared price (the test
/// `bounds_and_shared_prices_agree_with_the_simulation` holds the key to that).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct CostKey {
    tp: u32,
    cp: u32,
    ep: u32,
    etp: u32,
    dispatcher: Dispatcher,
    micro_batch: u64,
    recompute: Recompute,
    sequence_parallel: bool,
    pipelined: bool,
    cross_node_stages: bool,
}

impl CostKey {
    fn of(setup: &Setup, l: &Layout) -> Self {
        let gpn = setup.profile.node.gpus_per_node;
        CostKey {
            tp: l.tp,
            cp: l.cp,
            ep: l.ep,
            etp: l.expert_tp(),
            dispatcher: l.dispatcher,
            micro_batch: l.micro_batch,
            recompute: l.recompute,
            sequence_parallel: l.sequence_parallel,
            pipelined: l.pp > 1,
            cross_node_stages: l.tp * l.cp * l.dp >= gpn && setup.gpus > gpn,
        }
    }
}

/// A bound below every candidate of a group: the busiest stage runs at least the average
/// stage's passes for every micro-batch.
fn group_bound(setup: &Setup, l: &Layout, c: &TransformerCosts) -> f64 {
    let m = l.micro_batches(setup.global_batch) as f64;
    let pass =
        |p: &parallax_cost::transformer::PartCost| (p.fwd() + p.bwd_input() + p.bwd_weight()).0;
    let work = c.layers_sum(0, setup.model.layers, pass) + pass(&c.embedding) + pass(&c.head);
    m * work / f64::from(l.pp) * (1.0 - 4.0 * crate::bounds::BOUND_SLACK)
}

/// Zero stages tried for a group.
fn zeros_of(opts: &SearchOptions, base: &Layout) -> Vec<u8> {
    zero_options(&opts.force, &opts.space, base.dp)
}

/// Families any candidate of a group may belong to.
fn group_families(opts: &SearchOptions, base: &Layout) -> u8 {
    zeros_of(opts, base).into_iter().fold(0, |m, z| {
        m | Family::mask(&Layout {
            zero_stage: z,
            ..base.clone()
        })
    })
}

/// [`partitions`] of a group's layouts for each interleave its schedules take (they depend
/// on nothing else the schedules change).
fn partitions_by_interleave(
    setup: &Setup,
    opts: &SearchOptions,
    base: &Layout,
    c: &TransformerCosts,
    scheds: &[(Schedule, u32)],
) -> HashMap<u32, Vec<(Vec<u32>, bool)>> {
    let mut parts_of = HashMap::new();
    for &(_, v) in scheds {
        parts_of.entry(v).or_insert_with(|| {
            let l = Layout {
                interleave: v,
                ..base.clone()
            };
            partitions(setup, opts, &l, c)
        });
    }
    parts_of
}

/// Layer counts per virtual stage tried for `v`: the even split, and the balanced one when it
/// differs.
fn partitions(
    setup: &Setup,
    opts: &SearchOptions,
    l: &Layout,
    c: &TransformerCosts,
) -> Vec<(Vec<u32>, bool)> {
    // Where the stack counts the embedding, loss and prediction modules as layers and the
    // plain split is not even, its split is explicit.
    let plain = stage_layers(setup.model.layers, l);
    let chunks = l.pp * l.interleave;
    let accounted = (opts.space.embedding_and_loss_as_layers
        && l.stages.is_empty()
        && (setup.model.layers % chunks != 0 || setup.model.mtp_layers > 0))
        .then(|| parallax_sim::accounted_layers(setup.model.layers, chunks, setup.model.mtp_layers))
        .flatten()
        .filter(|a| *a != plain);
    let even = accounted.clone().unwrap_or(plain);
    let mut parts = vec![(even.clone(), accounted.is_some())];
    if !opts.force_even_stages && opts.engine.is_none() && l.pp > 1 {
        let pass =
            |p: &parallax_cost::transformer::PartCost| (p.fwd() + p.bwd_input() + p.bwd_weight()).0;
        let bal = balanced_layers(
            setup.model.layers,
            l.pp * l.interleave,
            // A mixture's dense and MoE layers balanced at their mean.
            c.layers_sum(0, setup.model.layers, pass) / f64::from(setup.model.layers.max(1)),
            pass(&c.embedding),
            pass(&c.head),
        );
        if bal != even {
            parts.push((bal, true));
        }
    }
    parts
}

/// Candidates of a group, and how many fall in each family, without bounding them.
fn group_size(
    setup: &Setup,
    opts: &SearchOptions,
    g: &Group,
    c: &TransformerCosts,
) -> (u64, [u64; FAMILIES]) {
    let scheds = schedules_of(setup, opts, &g.base);
    if scheds.is_empty() {
        return (1, [0; FAMILIES]);
    }
    let parts_of = partitions_by_interleave(setup, opts, &g.base, c, &scheds);
    let per_zero: u64 = scheds.iter().map(|(_, v)| parts_of[v].len() as u64).sum();
    let mut members = [0u64; FAMILIES];
    let zeros = zeros_of(opts, &g.base);
    for &z in &zeros {
        let mask = Family::mask(&Layout {
            zero_stage: z,
            ..g.base.clone()
        });
        for (i, n) in members.iter_mut().enumerate() {
            if mask & (1 << i) != 0 {
                *n += per_zero;
            }
        }
    }
    (per_zero * zeros.len() as u64, members)
}

/// How `a` ranks against `b`: lower step time first, then lower id.
fn rank(a: &Evaluated, b: &Evaluated) -> std::cmp::Ordering {
    a.prediction
        .step_time_s
        .total_cmp(&b.prediction.step_time_s)
        .then(a.id.cmp(&b.id))
}

/// `a` ranks before `b` ([`rank`]).
fn better(a: &Evaluated, b: &Evaluated) -> bool {
    rank(a, b).is_lt()
}

/// The parallel degrees of a layout: what a group shares besides micro-batch, recompute and
/// sequence parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Degrees {
    pub tp: u32,
    pub cp: u32,
    pub pp: u32,
    pub dp: u32,
    pub ep: u32,
    /// Expert tensor parallelism (tp where the layout leaves it out).
    pub etp: u32,
}

/// Every (tp, cp, pp, dp, ep, etp) of `setup`'s devices that agrees with the degrees `fixed` gives,
/// in a fixed order, with the micro-batch sizes each may take (`fixed`'s, or every divisor of
/// the per-replica batch up to `max_micro_batch`). A combination rejected outright goes to
/// `reject` as (reason kind, what is wrong): a tensor-parallel group across nodes (unless the
/// runtime allows it), heads or FFN width that tp does not divide, a sequence that cp does
/// not split into halves per rank (load-balanced causal attention), more stages than layers,
/// a batch that dp or the micro-batch does not divide. Search and completion both walk this.
pub(crate) fn degree_tuples(
    setup: &Setup,
    fixed: &PartialLayout,
    max_micro_batch: u64,
    reject: &mut dyn FnMut(&'static str, String),
) -> Vec<(Degrees, Vec<u64>)> {
    let gpus = u64::from(setup.gpus);
    let gpn = u64::from(setup.profile.node.gpus_per_node);
    let model = setup.model;
    let keep = |given: Option<u32>, x: u64| given.is_none_or(|v| u64::from(v) == x);
    // A framework's context parallelism is ring attention over fused kernels that return each
    // block's log-sum-exp for the merge (Transformer Engine's in Megatron-Core, SDPA's flash /
    // efficient ones in torchtitan): none on a device without them. (parallax's own trainer
    // merges unfused blocks itself.)
    let ring_attention = !setup.runtime.fused_attention || setup.fused_attention();
    let mut out = Vec::new();
    for tp in divisors(gpus).into_iter().filter(|&t| keep(fixed.tp, t)) {
        if tp > gpn && gpus > gpn && !setup.runtime.allow_tp_across_nodes {
            reject(
                TP_ACROSS_NODES,
                format!("tp={tp} spans nodes of {gpn} GPUs"),
            );
            continue;
        }
        if model.tp_shard(tp).is_none() {
            reject(
                "indivisible",
                format!(
                    "tp={tp} does not divide the {} heads ({} KV) and FFN width {}",
                    model.heads, model.kv_heads, model.ffn_hidden
                ),
            );
            continue;
        }
        for cp in divisors(gpus / tp)
            .into_iter()
            .filter(|&c| keep(fixed.cp, c))
        {
            if cp > 1 && !ring_attention {
                reject(
                    "cp without fused attention",
                    format!(
                        "cp={cp} needs fused attention kernels, which {} has none of",
                        setup.profile.device.name
                    ),
                );
                continue;
            }
            if setup.seq % cp != 0 || (cp > 1 && (setup.seq / cp) % 2 != 0) {
                reject(
                    "indivisible",
                    format!(
                        "cp={cp} does not split seq {} into halves per rank",
                        setup.seq
                    ),
                );
                continue;
            }
            for pp in divisors(gpus / (tp * cp))
                .into_iter()
                .filter(|&p| keep(fixed.pp, p))
            {
                let dp = gpus / (tp * cp * pp);
                if !keep(fixed.dp, dp) {
                    continue;
                }
                if pp > u64::from(model.layers) {
                    reject(
                        "indivisible",
                        format!("pp={pp} exceeds the {} layers", model.layers),
                    );
                    continue;
                }
                if setup.global_batch % dp != 0 {
                    reject(
                        "indivisible",
                        format!(
                            "dp={dp} does not divide the global batch {}",
                            setup.global_batch
                        ),
                    );
                    continue;
                }
                let per_dp = setup.global_batch / dp;
                let mbs: Vec<u64> = match fixed.micro_batch {
                    Some(mb) if mb > 0 && per_dp % mb == 0 => vec![mb],
                    Some(mb) => {
                        reject(
                            "indivisible",
                            format!(
                                "micro-batch {mb} does not divide the {per_dp} sequences per \
                                 data-parallel replica"
                            ),
                        );
                        continue;
                    }
                    None => divisors(per_dp)
                        .into_iter()
                        .filter(|&m| m <= max_micro_batch)
                        .collect(),
                };
                // Experts are carved out of the stage's dp × cp × tp ranks: each expert's
                // width split over etp of them — all the TP ranks (the experts inside the
                // tensor-parallel region) or one (folded over them, as Megatron-Core's recipes
                // run fine-grained experts) — spread over ep. A given etp is kept as given.
                let ranks = dp * cp * tp;
                let etps = match (model.moe, fixed.etp) {
                    (Some(_), Some(e)) => vec![u64::from(e)],
                    (Some(_), None) if tp > 1 => vec![tp, 1],
                    (Some(_), None) => vec![1],
                    // A dense model has no experts: a given etp other than tp is refused
                    // by the costs, with the reason.
                    (None, _) => vec![fixed.etp.map_or(tp, u64::from)],
                };
                for etp in etps.into_iter().filter(|&e| keep(fixed.etp, e)) {
                    let eps: Vec<u64> = match model.moe {
                        Some(moe) => divisors(ranks / etp)
                            .into_iter()
                            .filter(|e| moe.experts % e == 0)
                            .collect(),
                        None => vec![1],
                    };
                    for ep in eps.into_iter().filter(|&e| keep(fixed.ep, e)) {
                        let d = Degrees {
                            tp: tp as u32,
                            cp: cp as u32,
                            pp: pp as u32,
                            dp: dp as u32,
                            ep: ep as u32,
                            etp: etp as u32,
                        };
                        out.push((d, mbs.clone()));
                    }
                }
            }
        }
    }
    out
}

/// Every (degrees, micro-batch, recompute, sequence parallelism) group, in a fixed order;
/// degree tuples rejected outright are counted in `counts`.
fn enumerate_groups(setup: &Setup, opts: &SearchOptions, counts: &mut Counts) -> Vec<Group> {
    let f = &opts.force;
    let mut reject = |kind: &'static str, why: String| {
        counts.candidates += 1;
        counts.reject_because(kind, || why);
    };
    let mut groups = Vec::new();
    let recomputes = recompute_options(f, &opts.space, setup.model);
    for (d, mbs) in degree_tuples(setup, f, opts.max_micro_batch, &mut reject) {
        let unforced = |degree: u32, fixed: Option<u32>| degree > 1 && fixed.is_none();
        if !opts.space.model_parallel
            && (unforced(d.tp, f.tp) || unforced(d.cp, f.cp) || unforced(d.ep, f.ep))
        {
            reject(
                "stack",
                format!(
                    "tp {} × cp {} × ep {}: the stack has no tensor, context or expert parallelism",
                    d.tp, d.cp, d.ep
                ),
            );
            continue;
        }
        if !opts.space.context_parallel && unforced(d.cp, f.cp) {
            reject(
                "stack",
                format!("cp {}: the stack has no context parallelism", d.cp),
            );
            continue;
        }
        if let Some(o) = f.offload.filter(|o| *o != Offload::None) {
            if !opts.space.offload.contains(&o) {
                reject("stack", format!("the stack has no {o} offload"));
                continue;
            }
        }
        let sps = if opts.space.sequence_parallel || f.sequence_parallel.is_some() {
            f.sequence_parallel_options(d.tp)
        } else {
            vec![false]
        };
        for &mb in &mbs {
            for &recompute in &recomputes {
                for &sp in &sps {
                    let mut base = Layout {
                        dp: d.dp,
                        tp: d.tp,
                        pp: d.pp,
                        cp: d.cp,
                        ep: d.ep,
                        etp: (d.etp != d.tp).then_some(d.etp),
                        dispatcher: f.dispatcher.unwrap_or_default(),
                        // Chosen per schedule (`expand`).
                        ep_overlap: false,
                        zero_stage: 0,
                        micro_batch: mb,
                        recompute,
                        sequence_parallel: sp,
                        schedule: if d.pp > 1 {
                            Schedule::OneFOneB
                        } else {
                            Schedule::None
                        },
                        interleave: 1,
                        offload: f.offload.unwrap_or_default(),
                        stages: Vec::new(),
                        batch_norm: Default::default(),
                    };
                    // The dispatcher changes only the dispatch's time: the faster one, where
                    // the stack has both and none is given.
                    if f.dispatcher.is_none() && opts.space.deepep {
                        base.dispatcher = faster_dispatcher(setup, &base);
                    }
                    groups.push(Group {
                        index: groups.len() as u64,
                        base,
                    });
                }
            }
        }
    }
    groups
}

/// The (schedule, interleave) pairs tried for a group.
fn schedules_of(setup: &Setup, opts: &SearchOptions, base: &Layout) -> Vec<(Schedule, u32)> {
    let m = base.micro_batches(setup.global_batch);
    schedule_options(setup, &opts.force, &opts.space, base.pp, m, &mut |_, _| {})
}

/// Stage ranges for per-virtual-stage layer counts.
pub fn stage_ranges(counts: &[u32]) -> Vec<StageRange> {
    let n = counts.len();
    let mut first = 0;
    counts
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let r = StageRange {
                first_layer: first,
                end_layer: first + c,
                embedding: i == 0,
                head: i + 1 == n,
            };
            first += c;
            r
        })
        .collect()
}

fn expand(
    setup: &Setup,
    opts: &SearchOptions,
    tight: bool,
    g: &Group,
    c: &TransformerCosts,
    summaries: &HashMap<SummaryKey, ScheduleSummary>,
) -> Expanded {
    let mut x = Expanded::default();
    let base = &g.base;
    let m = base.micro_batches(setup.global_batch) as u32;
    let zeros = zeros_of(opts, base);
    let mut why = None;
    let scheds = schedule_options(
        setup,
        &opts.force,
        &opts.space,
        base.pp,
        u64::from(m),
        &mut |_, w| {
            why.get_or_insert(w);
        },
    );
    if scheds.is_empty() {
        x.counts.candidates += 1;
        x.counts.reject_because("indivisible", || {
            why.unwrap_or_else(|| "no pipeline schedule applies".into())
        });
        return x;
    }
    let capacity = setup.profile.device.hbm_gib;
    // The engine's space, why it cannot train this job at all (asked once), and the label of
    // its rejections.
    let engine = opts.engine.map(|e| {
        (
            e,
            e.space(),
            e.supports_job(setup.model, setup.precision),
            format!("{NOT_SUPPORTED_BY}{e}"),
        )
    });
    let mut local = 0u64;
    let parts_of = partitions_by_interleave(setup, opts, base, c, &scheds);
    for &zero in &zeros {
        for &(schedule, v) in &scheds {
            let mut l = Layout {
                zero_stage: zero,
                schedule,
                interleave: v,
                ..base.clone()
            };
            // Where the stack has it, the dispatch overlaps whenever the layout allows (it only
            // hides time; memory is checked below): a forced overlap there or nowhere.
            l.ep_overlap = opts
                .force
                .ep_overlap
                .unwrap_or(opts.space.ep_overlap && l.ep > 1);
            let overlap_conflict = l.ep_overlap.then(|| l.ep_overlap_conflict()).flatten();
            if let Some(why) = overlap_conflict {
                if opts.force.ep_overlap == Some(true) {
                    let n = parts_of[&v].len() as u64;
                    x.counts.candidates += n;
                    x.counts.reject_because("stack", || why);
                    x.counts.reject("stack", n.saturating_sub(1));
                    continue;
                }
                l.ep_overlap = false;
            }
            let overlapped = l.merges_passes().then(|| {
                let kind = ScheduleKind::of(schedule, l.pp);
                c.ep_overlapped(parallax_sim::merged_fraction(kind, l.pp, m, v))
            });
            let overlap = l.ep_overlap;
            let summary = summaries.get(&(ScheduleKind::of(schedule, l.pp), l.pp, m, v));
            for (layers, explicit) in &parts_of[&v] {
                let id = (g.index << 20) | local;
                local += 1;
                // The memory check below may turn the overlap off for one partition only.
                l.ep_overlap = overlap;
                l.stages = if *explicit {
                    stage_ranges(layers)
                } else {
                    Vec::new()
                };
                let fam = Family::mask(&l) | ANY_LAYOUT;
                x.counts.candidates += 1;
                for (i, n) in x.family_members.iter_mut().enumerate() {
                    if fam & (1 << i) != 0 {
                        *n += 1;
                    }
                }
                let Some(summary) = summary else {
                    x.counts.reject("indivisible", 1);
                    continue;
                };
                if let Some((e, space, job_why, label)) = &engine {
                    if let Some(why) = job_why {
                        x.counts.reject_because(label, || why.clone());
                        continue;
                    }
                    if let Some(why) = e.supports_within(space, &l, setup.model) {
                        x.counts.reject_because(label, || why);
                        continue;
                    }
                }
                let mut memory = 0.0;
                if !opts.force_exhaustive {
                    let mut mem = memory_gib(setup, &l, c, layers, m, tight);
                    // The overlap holds one more forward's activations: without it, where
                    // only that fits (unless the overlap was asked for).
                    if l.ep_overlap
                        && opts.force.ep_overlap.is_none()
                        && mem.as_ref().is_ok_and(|&g| g > capacity)
                    {
                        l.ep_overlap = false;
                        mem = memory_gib(setup, &l, c, layers, m, tight);
                    }
                    let mem = match mem {
                        Ok(mem) => mem,
                        Err(_) => {
                            x.counts.reject("indivisible", 1);
                            continue;
                        }
                    };
                    if mem > capacity {
                        x.counts.reject(OUT_OF_MEMORY, 1);
                        for (i, s) in x.family_smallest.iter_mut().enumerate() {
                            if fam & (1 << i) != 0
                                && s.as_ref().is_none_or(|b| (mem, id) < (b.0, b.1))
                            {
                                *s = Some((mem, id, l.clone()));
                            }
                        }
                        continue;
                    }
                    memory = mem;
                }
                let c = match &overlapped {
                    Some(o) if l.merges_passes() => o,
                    _ => c,
                };
                let mut t = pass_times(c, layers);
                let bound = if tight {
                    let e = extras(setup, &l, c, layers);
                    e.apply(&mut t, layers);
                    summary.step_bound(&t, Some(&e))
                } else {
                    summary.step_bound(&t, None)
                };
                x.candidates.push(Candidate {
                    id,
                    group: g.index as usize,
                    layout: l.clone(),
                    bound,
                    memory,
                    families: fam,
                });
            }
        }
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bounds::{extras, memory_gib, pass_times, ScheduleSummary};
    use parallax_cost::transformer::{
        transformer_costs, PipeMessages, PipeSends, Runtime, TpOverlap,
    };
    use parallax_hardware::Cluster;
    use parallax_ir::models::{zoo, TransformerConfig};

    fn model(name: &str) -> TransformerConfig {
        zoo::transformer(name).unwrap()
    }

    /// A stack with `--recompute-modules` tries the sets recipes name for the model's parts
    /// (a mixture's and latent attention's), nothing more for a dense model; other stacks
    /// only their own policies; a given policy is the only one.
    #[test]
    fn megatron_stacks_try_the_recipes_recompute_modules() {
        let megatron = Engine::Megatron.space();
        let open = PartialLayout::default();
        let names = |m: &TransformerConfig, space: &Space| -> Vec<String> {
            recompute_options(&open, space, m)
                .iter()
                .map(|r| r.to_string())
                .collect()
        };
        let moe = names(&zoo::transformer("qwen3-30b-a3b").unwrap(), &megatron);
        assert!(
            moe.contains(&"modules:layernorm+moe_act".to_string()),
            "{moe:?}"
        );
        assert!(!moe.iter().any(|r| r.contains("mla_up_proj")), "{moe:?}");
        let mla = names(&zoo::transformer("deepseek-v3").unwrap(), &megatron);
        assert!(
            mla.contains(&"modules:mla_up_proj+mlp".to_string()),
            "{mla:?}"
        );
        let dense = zoo::transformer("llama3-8b").unwrap();
        assert_eq!(names(&dense, &megatron), ["none", "selective", "full"]);
        let qwen = zoo::transformer("qwen3-30b-a3b").unwrap();
        assert_eq!(
            names(&qwen, &Space::default()),
            ["none", "selective", "full"]
        );
        let given = PartialLayout::parse("recompute=full").unwrap();
        assert_eq!(
            recompute_options(&given, &megatron, &qwen),
            [Recompute::Full]
        );
    }
    #[test]
    fn divisors_and_digits() {
        assert_eq!(divisors(12), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(1), vec![1]);
        assert_eq!(group_digits(41210), "41 210");
        assert_eq!(group_digits(120), "120");
        assert_eq!(group_digits(1_000_000), "1 000 000");
    }

    /// Over every well-formed layout of a small space (all schedules, interleaves, ZeRO
    /// stages, recompute policies, balanced partitions) under several framework behaviours:
    /// the step-time bounds stay below what the simulator predicts, the memory figure is the
    /// simulator's, and the group's shared price is what pricing the candidate itself gives
    /// (the search simulates candidates with it). If a bound fails, the simulator changed
    /// under `bounds::extras`; the search would still fall back to pipeline-only bounds, but
    /// slower. If the price differs, `CostKey` misses something `transformer_costs` reads.
    #[test]
    fn bounds_and_shared_prices_agree_with_the_simulation() {
        let m = model("gpt3-1.3b");
        let c = Cluster::parse("dgx-a100-80gb:gpus=16").unwrap();
        for runtime in [
            Runtime::default(),
            Runtime {
                overlap_grad_reduce: false,
                pipe_sends: PipeSends::Paired,
                tp_overlap: TpOverlap::None,
                ..Runtime::default()
            },
            // DeepSpeed's engine before 0.5.4: blocking sends and receives apart, whole
            // input gradients.
            Runtime {
                overlap_grad_reduce: false,
                pipe_sends: PipeSends::Separate,
                pipe_messages: PipeMessages::DeepSpeedWholeGrads,
                tp_overlap: TpOverlap::None,
                ..Runtime::default()
            },
            Runtime {
                zero3_gathered_under_pp: true,
                ..Runtime::default()
            },
        ] {
            let s = Setup {
                runtime,
                ..Setup::new(&m, &c.profile, 16, 2048, 32)
            };
            let opts = SearchOptions {
                max_micro_batch: 4,
                ..SearchOptions::default()
            };
            let mut counts = Counts::default();
            let groups = enumerate_groups(&s, &opts, &mut counts);
            let mut checked = 0;
            let mut shared: HashMap<CostKey, TransformerCosts> = HashMap::new();
            for (gi, g) in groups.iter().enumerate() {
                let Ok(costs) = transformer_costs(&s, &g.base) else {
                    continue;
                };
                // The search prices each key once, with the first group that has it.
                let price = shared
                    .entry(CostKey::of(&s, &g.base))
                    .or_insert_with(|| costs.clone())
                    .clone();
                let gb = group_bound(&s, &g.base, &costs);
                let mbatch = g.base.micro_batches(s.global_batch) as u32;
                for (schedule, v) in schedules_of(&s, &opts, &g.base) {
                    for zero in zeros_of(&opts, &g.base) {
                        let mut l = Layout {
                            zero_stage: zero,
                            schedule,
                            interleave: v,
                            ..g.base.clone()
                        };
                        for (layers, explicit) in partitions(&s, &opts, &l, &costs) {
                            // Every third candidate keeps the test quick.
                            if (gi + checked) % 3 != 0 {
                                checked += 1;
                                continue;
                            }
                            l.stages = if explicit {
                                stage_ranges(&layers)
                            } else {
                                Vec::new()
                            };
                            let what = crate::layout_string(&l);
                            assert_eq!(
                                transformer_costs(&s, &l).as_ref(),
                                Ok(&price),
                                "{what}: the group's price is not the candidate's"
                            );
                            let sim = parallax_sim::simulate_step(&s, &l).unwrap().prediction;
                            let summary = ScheduleSummary::new(
                                ScheduleKind::of(schedule, l.pp),
                                l.pp,
                                mbatch,
                                v,
                            )
                            .unwrap();
                            let mut t = pass_times(&costs, &layers);
                            let loose = summary.step_bound(&t, None);
                            let e = extras(&s, &l, &costs, &layers);
                            e.apply(&mut t, &layers);
                            let tight = summary.step_bound(&t, Some(&e));
                            let mem = memory_gib(&s, &l, &costs, &layers, mbatch, true).unwrap();
                            let states =
                                memory_gib(&s, &l, &costs, &layers, mbatch, false).unwrap();
                            assert!(
                                gb <= loose && loose <= tight,
                                "{what}: {gb} {loose} {tight}"
                            );
                            assert!(
                                tight <= sim.step_time_s,
                                "{what}: {tight} > {}",
                                sim.step_time_s
                            );
                            assert_eq!(mem, sim.reserved_memory_gib, "{what}");
                            assert!(states <= mem, "{what}: {states} > {mem}");
                            checked += 1;
                        }
                    }
                }
            }
            assert!(checked > 500, "{checked}");
        }
    }

    /// On a space small enough to simulate whole, the pruned search returns exactly what
    /// simulating everything returns: the same plans in the same order, and the same family
    /// bests.
    #[test]
    fn search_returns_the_brute_force_optimum() {
        for (name, spec, batch, seq) in [
            ("gpt3-1.3b", "dgx-a100-80gb:gpus=16", 32, 2048),
            ("gpt3-6.7b", "dgx-a100-40gb:gpus=8", 16, 2048),
        ] {
            let m = model(name);
            let c = Cluster::parse(spec).unwrap();
            let s = Setup::new(&m, &c.profile, c.gpus, seq, batch);
            let opts = SearchOptions {
                max_micro_batch: 4,
                top_k: 3,
                ..SearchOptions::default()
            };
            let fast = search(&s, &opts).unwrap();
            let brute = search(
                &s,
                &SearchOptions {
                    force_exhaustive: true,
                    ..opts.clone()
                },
            )
            .unwrap();
            assert!(!fast.bounds_fell_back);
            assert!(
                fast.counts.simulated * 5 < brute.counts.simulated,
                "{} vs {}",
                fast.summary_line(),
                brute.summary_line()
            );
            assert_eq!(fast.counts.candidates, brute.counts.candidates);
            let ids = |r: &SearchResult| r.top.iter().map(|e| e.id).collect::<Vec<_>>();
            assert_eq!(ids(&fast), ids(&brute), "{name}");
            // The fallback (pipeline-only, states-only bounds) is exact too.
            let loose = run(&s, &opts, &|_| {}, false).unwrap().unwrap();
            assert_eq!(ids(&loose), ids(&brute), "{name}");
            assert!(loose.counts.simulated >= fast.counts.simulated);
            for (a, b) in fast.families.iter().zip(&brute.families) {
                assert_eq!(
                    a.best.as_ref().map(|e| e.id),
                    b.best.as_ref().map(|e| e.id),
                    "{:?}",
                    a.family
                );
                assert_eq!(a.candidates, b.candidates);
            }
        }
    }

    #[test]
    fn search_is_deterministic_and_counts_add_up() {
        let m = model("gpt3-13b");
        let c = Cluster::parse("dgx-a100-80gb:gpus=64").unwrap();
        let s = Setup::new(&m, &c.profile, 64, 2048, 128);
        let a = search(&s, &SearchOptions::default()).unwrap();
        let b = search(&s, &SearchOptions::default()).unwrap();
        assert_eq!(a.counts, b.counts);
        let ids = |r: &SearchResult| r.top.iter().map(|e| e.id).collect::<Vec<_>>();
        assert_eq!(ids(&a), ids(&b));
        let c = &a.counts;
        let rejected: u64 = c.rejected.values().sum();
        // Every candidate is either simulated and fits, or rejected for one reason.
        assert_eq!(c.feasible + rejected, c.candidates, "{}", a.summary_line());
        assert!(a
            .top
            .windows(2)
            .all(|w| w[0].prediction.step_time_s <= w[1].prediction.step_time_s));
        assert!(a.top.iter().all(|e| e.prediction.fits));
        assert!(a.best().prediction.step_time_s >= a.flops_bound_s);
    }

    #[test]
    fn forced_knobs_are_respected_and_tp_stays_in_a_node() {
        let m = model("gpt3-13b");
        let c = Cluster::parse("dgx-a100-80gb:gpus=32").unwrap();
        let s = Setup::new(&m, &c.profile, 32, 2048, 64);
        let opts = SearchOptions {
            force: PartialLayout::parse("pp=2,zero=1").unwrap(),
            top_k: 10,
            ..SearchOptions::default()
        };
        let r = search(&s, &opts).unwrap();
        assert!(r
            .top
            .iter()
            .all(|e| e.layout.pp == 2 && e.layout.zero_stage == 1));
        assert!(r.top.iter().all(|e| e.layout.tp <= 8));
        assert!(r.counts.rejected.contains_key("tp across nodes"));
    }

    #[test]
    fn a_model_that_fits_nowhere_says_how_much_it_needs() {
        let m = model("gpt3-175b");
        let c = Cluster::parse("dgx-a100-80gb:gpus=8").unwrap();
        let s = Setup::new(&m, &c.profile, 8, 2048, 8);
        match search(&s, &SearchOptions::default()) {
            Err(SearchError::DoesNotFit {
                need_gib, have_gib, ..
            }) => {
                assert!(need_gib > have_gib);
            }
            other => panic!("{other:?}"),
        }
    }

    /// Offload is tried when memory binds, and only then: Llama-3 8B (fp16 states 16 bytes a
    /// parameter, ~120 GiB) on one 32 GiB V100 fits only with the optimizer on the host; on
    /// an 80 GiB A100 at 8 GPUs, where ZeRO fits it, nothing is offloaded; a stack without
    /// offload says nothing fits.
    #[test]
    fn offload_is_tried_when_nothing_fits_on_the_device() {
        let m = parallax_ir::models::zoo::transformer("llama3-8b").unwrap();
        let v100 = parallax_hardware::preset("dgx2-v100-32gb").unwrap();
        let s = Setup {
            precision: parallax_ir::Precision::Fp16,
            ..Setup::new(&m, &v100, 1, 1024, 8)
        };
        let opts = SearchOptions {
            top_k: 1,
            ..SearchOptions::default()
        };
        let best = search(&s, &opts).unwrap().best().layout.clone();
        assert_ne!(best.offload, Offload::None, "{best:?}");
        let a100 = parallax_hardware::preset("dgx-a100-80gb").unwrap();
        let roomy = Setup::new(&m, &a100, 8, 1024, 64);
        let best = search(&roomy, &opts).unwrap().best().layout.clone();
        assert_eq!(best.offload, Offload::None, "{best:?}");
        let no_offload = SearchOptions {
            space: Space {
                offload: Vec::new(),
                ..Space::default()
            },
            ..opts
        };
        assert!(matches!(
            search(&s, &no_offload),
            Err(SearchError::DoesNotFit { .. })
        ));
    }

    /// Context parallelism is ring attention over fused kernels: a V100, which has none, is
    /// never given cp, and a forced cp there says why.
    #[test]
    fn context_parallelism_needs_fused_attention() {
        let m = model("llama3-8b");
        let v100 = parallax_hardware::preset("dgx2-v100-32gb").unwrap();
        let s = Setup {
            precision: parallax_ir::Precision::Fp16,
            ..Setup::new(&m, &v100, 64, 8192, 64)
        };
        let opts = SearchOptions {
            top_k: 50,
            ..SearchOptions::default()
        };
        let r = search(&s, &opts).unwrap();
        assert!(r.top.iter().all(|p| p.layout.cp == 1));
        assert!(r.counts.rejected.contains_key("cp without fused attention"));
        let forced = SearchOptions {
            force: PartialLayout::parse("cp=2").unwrap(),
            ..opts.clone()
        };
        match search(&s, &forced) {
            Err(SearchError::NoCandidate { summary, .. }) => {
                assert!(summary.contains("V100"), "{summary}")
            }
            other => panic!("{other:?}"),
        }
        // On an A100 the same search may split the sequence, unless its stack has no
        // context parallelism; a run that had it (a forced cp) is still simulated.
        let a100 = parallax_hardware::preset("dgx-a100-80gb").unwrap();
        let s = Setup::new(&m, &a100, 64, 8192, 64);
        assert!(search(&s, &forced).is_ok());
        let old_stack = SearchOptions {
            space: Space {
                context_parallel: false,
                ..Space::default()
            },
            ..opts
        };
        let r = search(&s, &old_stack).unwrap();
        assert!(r.top.iter().all(|p| p.layout.cp == 1));
        assert!(r.top.len() > 1 && r.counts.rejected.contains_key("stack"));
        let forced_old = SearchOptions {
            force: PartialLayout::parse("cp=2").unwrap(),
            ..old_stack
        };
        assert!(search(&s, &forced_old).is_ok());
    }

    /// Two searches' results for one family: where neither fits, the smaller existing need
    /// wins and a family without one never erases another's.
    #[test]
    fn family_results_merge_to_the_smaller_need() {
        let none = |need: Option<f64>| FamilyResult {
            family: Family::NoPipeline,
            best: None,
            smallest_need_gib: need,
            smallest_layout: need.map(|_| Layout::default()),
            candidates: 3,
        };
        let same = |e: Evaluated| e;
        let mut f = none(Some(90.0));
        f.merge(none(None), same);
        assert_eq!((f.smallest_need_gib, f.candidates), (Some(90.0), 6));
        f.merge(none(Some(85.0)), same);
        assert_eq!(f.smallest_need_gib, Some(85.0));
        f.merge(none(Some(95.0)), same);
        assert_eq!(f.smallest_need_gib, Some(85.0));
        let mut g = none(None);
        g.merge(none(Some(95.0)), same);
        assert_eq!(g.smallest_need_gib, Some(95.0));
    }

    /// Half the layers recomputed is tried where the best plan recomputes all of them: Llama-3
    /// 70B at 8k tokens on 16 H100s recomputes everything without it. Every second layer
    /// fits there only with the optimizer offloaded, whose host step (4.4B parameters a GPU,
    /// eight GPUs to a host) costs more than the recomputation saves, so full recomputation
    /// stays best; the second search adds its candidates and never a slower best.
    #[test]
    fn half_recomputation_is_tried_where_memory_forces_full() {
        let m = parallax_ir::models::zoo::transformer("llama3-70b").unwrap();
        let p = parallax_hardware::preset("dgx-h100-80gb").unwrap();
        let s = Setup::new(&m, &p, 16, 8192, 64);
        let run = |layers: bool| {
            let opts = SearchOptions {
                top_k: 3,
                space: Space {
                    recompute_layers: layers,
                    ..Space::default()
                },
                ..SearchOptions::default()
            };
            search(&s, &opts).unwrap()
        };
        let without = run(false);
        assert_eq!(without.best().layout.recompute, Recompute::Full);
        let with = run(true);
        assert_eq!(with.best().layout.recompute, Recompute::Full);
        let t = |r: &SearchResult| r.best().prediction.step_time_s;
        assert!(t(&with) <= t(&without), "{} vs {}", t(&with), t(&without));
        assert!(with.top.len() <= 3);
        assert!(with
            .top
            .windows(2)
            .all(|w| w[0].prediction.step_time_s <= w[1].prediction.step_time_s));
        assert!(with.counts.candidates > without.counts.candidates);
        // The families "why it wins" compares take both searches' layouts: the family of
        // the best plan has it as its best.
        let best = &with.best().layout;
        for f in with.families.iter().filter(|f| f.family.contains(best)) {
            let fb = f.best.as_ref().expect("the best plan's family has a best");
            assert_eq!(&fb.layout, best, "{:?}", f.family);
        }
    }

    /// NVMe comes after host memory, and only where the profile describes the drives: Llama-3
    /// 70B on one A100 needs ~1.2 TiB of offloaded states, more than a host of 256 GiB holds;
    /// with 8 TiB of NVMe the search puts them there, without it nothing fits (and says
    /// why host memory did not do).
    #[test]
    fn nvme_takes_what_host_memory_cannot_hold() {
        let m = parallax_ir::models::zoo::transformer("llama3-70b").unwrap();
        let mut p = parallax_hardware::preset("dgx-a100-80gb").unwrap();
        p.node.host_memory_gib = Some(256.0);
        let opts = SearchOptions {
            top_k: 1,
            ..SearchOptions::default()
        };
        let e = search(&Setup::new(&m, &p, 1, 1024, 1), &opts)
            .unwrap_err()
            .to_string();
        assert!(e.contains("GiB of host memory per node needed"), "{e}");
        p.node.nvme = Some(parallax_hardware::NvmeSpec {
            read_gbps: 25.0,
            write_gbps: 20.0,
            gib: 8192.0,
            path: None,
        });
        let best = search(&Setup::new(&m, &p, 1, 1024, 1), &opts)
            .unwrap()
            .best()
            .clone();
        assert!(best.layout.offload.nvme(), "{:?}", best.layout);
        // The step pays the states' trip through the drives: 28 bytes a parameter at the
        // drives' rates, at least.
        let params = 70.55e9;
        assert!(best.prediction.breakdown.optimizer_s > params * (16.0 / 25e9 + 12.0 / 20e9));
    }
}
