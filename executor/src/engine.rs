//! One rank's training loop: builds its share of the model from the layout, runs the pipeline
//! schedule with point-to-point sends, reduces gradients (bucketed all-reduce or ZeRO
//! reduce-scatter), applies Adam and reports the loss. Backend-independent: everything goes
//! through [`Collectives`].

use crate::comm::{Collectives, CommError, Group};
use crate::data::{mask_for_mlm, micro_batch, mlm_targets, nsp_label, DataSource};
use crate::error::ExecError;
use crate::model::{
    bert_embed_bwd, bert_embed_fwd, block_bwd, block_fwd, build_wpe, build_wte, embed_bwd,
    embed_fwd, head_bwd, head_fwd, head_own_weight, head_weight_range, mtp_input_bwd,
    mtp_input_fwd, mtp_tokens, positions_bwd, positions_fwd, BertEmbed, BertEmbedSaved, BlockCache,
    BlockLayout, Dims, HeadCache, HeadLayout, Keep, MtpLayout, MtpSaved, Nsp, Part, Pass, Slot,
    SlotBuilder, Split, Tp, VocabParallel, VocabWindow, WeightGrad, MTP_LOSS_WEIGHT,
};
use crate::state::{ModelState, TensorState};
use crate::tensor::add_into;
use parallax_ir::models::TransformerConfig;
use parallax_ir::{Layout, Recompute, Schedule};
use parallax_sim::{Op, PipelineSchedule, ScheduleKind};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Adam hyper-parameters (Kingma & Ba 2015, with bias correction); no weight decay, no
/// gradient clipping.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
}

impl Default for AdamConfig {
    /// lr 1e-3, betas (0.9, 0.95) as GPT-3 (Brown et al. 2020, appendix B), eps 1e-8.
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
        }
    }
}

impl AdamConfig {
    /// The bias corrections `(1 − β₁ᵗ, 1 − β₂ᵗ)` of step `t` (1-based), computed in f64.
    pub fn bias_corrections(&self, t: u64) -> (f32, f32) {
        let c = |b: f32| (1.0 - f64::from(b).powf(t as f64)) as f32;
        (c(self.beta1), c(self.beta2))
    }

    /// One Adam update of `p` with gradients `g` and moments `m`, `v` (every backend's
    /// arithmetic, element by element; the NVRTC kernel does the same operations).
    pub fn update(
        &self,
        (bc1, bc2): (f32, f32),
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        for i in 0..p.len() {
            let gi = g[i];
            let mi = self.beta1 * m[i] + (1.0 - self.beta1) * gi;
            let vi = self.beta2 * v[i] + (1.0 - self.beta2) * gi * gi;
            m[i] = mi;
            v[i] = vi;
            p[i] -= self.lr * (mi / bc1) / ((vi / bc2).sqrt() + self.eps);
        }
    }
}

/// A deliberate failure, to exercise the fault path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The rank that fails.
    pub rank: usize,
    /// At the start of this step (0-based, counted within the run).
    pub step: u64,
    /// How it fails.
    pub kind: FaultKind,
}

/// How an injected fault behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The rank returns an error (as a crashed process would vanish).
    Die,
    /// The rank stops communicating until the others give up.
    Stall,
}

/// Statistics of one finished step (reported by rank 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Optimizer step number after this step (1-based, counting resumed steps).
    pub step: u64,
    /// Mean cross-entropy over the global batch.
    pub loss: f64,
    /// Wall time of the step on rank 0.
    pub time_s: f64,
    /// Tokens per second of the whole run.
    pub tokens_per_s: f64,
}

/// Called by rank 0 after every step.
pub type StepHook = Arc<dyn Fn(&StepStats) + Send + Sync>;
/// Called by rank 0 with the gathered state at checkpoints.
pub type CheckpointHook = Arc<dyn Fn(&ModelState) -> Result<(), (String, String)> + Send + Sync>;

/// Everything a run needs.
#[derive(Clone)]
pub struct RunSpec {
    /// The model.
    pub model: TransformerConfig,
    /// The parallel layout.
    pub layout: Layout,
    /// Sequences per optimizer step.
    pub global_batch: u64,
    /// Tokens per sequence.
    pub seq: u64,
    /// Steps to run.
    pub steps: u64,
    /// Seed of initialisation and data.
    pub seed: u64,
    /// Training data.
    pub data: DataSource,
    /// Optimizer.
    pub adam: AdamConfig,
    /// How long a rank waits for a message before declaring the sender stalled.
    pub timeout: Duration,
    /// Start from this state instead of a fresh initialisation.
    pub resume: Option<Arc<ModelState>>,
    /// Gather the final state into the report.
    pub collect_state: bool,
    /// Call [`RunSpec::on_checkpoint`] every this many steps (and after the last).
    pub checkpoint_every: Option<u64>,
    /// Receives gathered states at checkpoints.
    pub on_checkpoint: Option<CheckpointHook>,
    /// Receives per-step statistics.
    pub on_step: Option<StepHook>,
    /// Record a timeline of passes.
    pub trace: bool,
    /// An injected failure (tests of the fault path).
    pub fault: Option<Fault>,
}

impl std::fmt::Debug for RunSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunSpec")
            .field("layout", &self.layout)
            .field("global_batch", &self.global_batch)
            .field("seq", &self.seq)
            .field("steps", &self.steps)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl RunSpec {
    /// A spec with defaults: synthetic data, seed 0, default Adam, a 120 s timeout.
    pub fn new(
        model: TransformerConfig,
        layout: Layout,
        global_batch: u64,
        seq: u64,
        steps: u64,
    ) -> Self {
        RunSpec {
            model,
            layout,
            global_batch,
            seq,
            steps,
            seed: 0,
            data: DataSource::Synthetic,
            adam: AdamConfig::default(),
            timeout: Duration::from_secs(120),
            resume: None,
            collect_state: false,
            checkpoint_every: None,
            on_checkpoint: None,
            on_step: None,
            trace: false,
            fault: None,
        }
    }
}

/// Whether a run of `steps` steps that checkpoints every `every` steps (and after the last)
/// writes one after step `i` (0-based).
pub(crate) fn checkpoint_due(every: Option<u64>, i: u64, steps: u64) -> bool {
    i + 1 == steps || every.is_some_and(|k| k > 0 && (i + 1) % k == 0)
}

/// A timed pass on one rank, for the measured trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// The rank.
    pub rank: usize,
    /// Its pipeline stage.
    pub stage: usize,
    /// What ran (`F mb3 c0`, `BW mb3 c0`, `grad-sync`, `optimizer`).
    pub name: String,
    /// Category: forward, backward, comm, optimizer.
    pub cat: &'static str,
    /// Step (0-based within the run).
    pub step: u64,
    /// Start, seconds since the run began.
    pub start_s: f64,
    /// Duration in seconds.
    pub dur_s: f64,
}

/// What one rank returns.
#[derive(Debug, Default)]
pub struct RankReport {
    /// Loss per step (every rank knows it).
    pub losses: Vec<f64>,
    /// Step wall times on this rank.
    pub step_times: Vec<f64>,
    /// The gathered final state (rank 0, when asked).
    pub state: Option<ModelState>,
    /// Timeline (when asked).
    pub spans: Vec<Span>,
}

/// Degrees of the layout and the rank numbering: `rank = ((stage · dp) + d) · tp + t`
/// (tensor-parallel peers adjacent, then data-parallel replicas, then stages; Megatron-LM's
/// order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Data-parallel degree.
    pub dp: usize,
    /// Context-parallel degree: each data-parallel replica is `cp` ranks holding chunks of the
    /// same sequences. Ranks, gradients and ZeRO shards count `dp · cp` replicas (Megatron-LM
    /// reduces gradients over its data-and-context-parallel group).
    pub cp: usize,
    /// Expert-parallel degree: each group of `ep` consecutive expert indices
    /// ([`Topology::expert_index`]) splits every MoE layer's experts; the ranks with the same
    /// index modulo `ep` hold the same experts (expert data parallel).
    pub ep: usize,
    /// Experts folded over the tensor-parallel ranks too (etp 1 with tp > 1, Megatron-Core's
    /// MoE parallel folding): each TP rank routes its own sequence-parallel rows. Otherwise
    /// the TP ranks run the whole mixture on every row, redundantly.
    pub fold: bool,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Chunks per stage.
    pub v: usize,
}

impl Topology {
    /// Ranks in all.
    pub fn world(&self) -> usize {
        self.replicas() * self.tp * self.pp
    }
    /// Ranks of a stage's tensor-parallel position that hold the same parameters: the
    /// data-parallel replicas times the context-parallel ranks of each.
    pub fn replicas(&self) -> usize {
        self.dp * self.cp
    }
    /// The rank at `(r, stage, t)`, `r = d · cp + c` the replica (data-parallel index `d`,
    /// context-parallel index `c`): tensor-parallel peers adjacent, then context, data, stage.
    pub fn rank(&self, r: usize, s: usize, t: usize) -> usize {
        (s * self.replicas() + r) * self.tp + t
    }
    /// The tensor and expert parts replica `r`, tensor-parallel rank `t` holds.
    pub fn part(&self, r: usize, t: usize) -> Part {
        Part {
            t,
            tp: self.tp,
            e: self.expert_index(r, t) % self.ep,
            ep: self.ep,
        }
    }
    /// Position of replica `r`, tensor-parallel rank `t` among a stage's expert ranks:
    /// `r · tp + t` when experts fold over the TP ranks, else `r` (Megatron's order: TP
    /// innermost, then context, then data).
    pub fn expert_index(&self, r: usize, t: usize) -> usize {
        if self.fold {
            r * self.tp + t
        } else {
            r
        }
    }
    /// Ranks of a stage holding the same experts: the expert indices over `ep`.
    pub fn expert_replicas(&self) -> usize {
        self.replicas() * if self.fold { self.tp } else { 1 } / self.ep
    }
    /// The (replica, tensor-parallel rank) pairs of a stage whose expert index satisfies
    /// `keep`, in expert-index order; unfolded, only those at tensor-parallel rank `t`.
    fn expert_ranks(&self, t: usize, keep: impl Fn(usize) -> bool) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, (usize, usize))> = (0..self.replicas())
            .flat_map(|r| (0..self.tp).map(move |x| (r, x)))
            .filter(|&(_, x)| self.fold || x == t)
            .map(|(r, x)| (self.expert_index(r, x), (r, x)))
            .filter(|(i, _)| keep(*i))
            .collect();
        out.sort_unstable();
        out.into_iter().map(|x| x.1).collect()
    }
    /// `(r, stage, t)` of a rank.
    pub fn coords(&self, rank: usize) -> (usize, usize, usize) {
        let n = self.replicas();
        (rank / self.tp % n, rank / (self.tp * n), rank % self.tp)
    }
}

/// A validated run: dimensions, topology, layer split and schedule.
#[derive(Debug)]
pub struct Prepared {
    dims: Dims,
    topo: Topology,
    /// First layer of each virtual stage, and one past the last at the end.
    bounds: Vec<usize>,
    schedule: PipelineSchedule,
    micro: usize,
    mbs: usize,
    seq: usize,
    keep: Keep,
    /// `keep` applies to every this-many-th layer (from the first); the others keep everything
    /// (`recompute = every:k`; 1 otherwise).
    keep_every: usize,
    sp: bool,
    zero: u8,
}

impl Prepared {
    /// What layer `layer` (of the whole model) keeps for its backward.
    fn keep_of(&self, layer: usize) -> Keep {
        if layer % self.keep_every == 0 {
            self.keep
        } else {
            Keep::All
        }
    }
}

/// Upper bound on ranks, to catch a typo before thousands of threads start.
pub const MAX_RANKS: usize = 512;

impl Prepared {
    /// Checks a spec and works out everything that does not depend on the rank.
    pub fn new(spec: &RunSpec) -> Result<Prepared, ExecError> {
        let dims = Dims::from_config(&spec.model).map_err(ExecError::Model)?;
        let l = &spec.layout;
        l.validate(spec.global_batch, Some(spec.model.layers))
            .map_err(ExecError::Layout)?;
        let bad = |m: String| Err(ExecError::Layout(m));
        match dims.moe {
            None if l.ep != 1 => {
                return bad(format!(
                    "ep {} needs a mixture-of-experts model; this one has a dense MLP",
                    l.ep
                ))
            }
            Some((experts, _)) if experts % l.ep as usize != 0 => {
                return bad(format!("ep {} must divide the {experts} experts", l.ep));
            }
            _ => {}
        }
        // Experts are whole on every rank that holds them: replicated over the TP group
        // (etp = tp, each TP rank running the mixture on every row) or folded over it (etp 1,
        // each TP rank routing its own sequence-parallel rows).
        let fold = l.tp > 1 && l.expert_tp() == 1;
        if l.expert_tp() != l.tp && !fold {
            return bad(format!(
                "etp {} with tp {}: the executor runs experts split over all of the tensor-parallel group (etp = tp) or folded over it (etp 1)",
                l.expert_tp(),
                l.tp
            ));
        }
        if fold && !l.sequence_parallel {
            return bad(format!(
                "etp 1 with tp {} needs sequence parallelism: each tensor-parallel rank routes its own rows",
                l.tp
            ));
        }
        let kind = match (l.pp, l.schedule) {
            (1, _) => ScheduleKind::OneFOneB,
            (_, Schedule::GPipe) => ScheduleKind::GPipe,
            (_, Schedule::OneFOneB) => ScheduleKind::OneFOneB,
            (_, Schedule::Interleaved1F1B) => ScheduleKind::Interleaved1F1B,
            (_, Schedule::ZeroBubbleH1) => ScheduleKind::ZeroBubbleH1,
            (_, s) => {
                return bad(format!(
                    "schedule {s} is not supported by the executor (gpipe, 1f1b, interleaved-1f1b, zb-h1)"
                ))
            }
        };
        dims.check_tp(l.tp as usize).map_err(ExecError::Layout)?;
        let topo = Topology {
            dp: l.dp as usize,
            cp: l.cp as usize,
            ep: l.ep as usize,
            fold,
            tp: l.tp as usize,
            pp: l.pp as usize,
            v: l.interleave as usize,
        };
        if topo.world() > MAX_RANKS {
            return bad(format!(
                "{} ranks exceed the executor's limit of {MAX_RANKS}",
                topo.world()
            ));
        }
        let seq =
            usize::try_from(spec.seq).map_err(|_| ExecError::Layout("seq too large".into()))?;
        if seq == 0 {
            return bad("seq must be at least 1".into());
        }
        if dims.learned_positions && seq > dims.max_seq {
            return Err(ExecError::Model(format!(
                "seq {seq} exceeds the model's {} learned positions",
                dims.max_seq
            )));
        }
        if topo.cp > 1 && dims.hybrid.is_some() {
            return bad(
                "context parallelism over Mamba-2 layers is neither run by the executor nor planned (the scan runs along the whole sequence)"
                    .into(),
            );
        }
        if topo.cp > 1 && seq % (2 * topo.cp) != 0 {
            return bad(format!(
                "context parallelism splits each sequence into 2 × cp = {} chunks: seq {seq} is not a multiple",
                2 * topo.cp
            ));
        }
        let mbs = l.micro_batch as usize;
        let micro = l.micro_batches(spec.global_batch);
        let micro =
            u32::try_from(micro).map_err(|_| ExecError::Layout("too many micro-batches".into()))?;
        let sp = l.sequence_parallel && topo.tp > 1;
        if sp && (mbs * seq / topo.cp) % topo.tp != 0 {
            return bad(format!(
                "sequence parallelism needs micro_batch × seq / cp = {} to be a multiple of tp {}",
                mbs * seq / topo.cp,
                topo.tp
            ));
        }
        let schedule = PipelineSchedule::generate(kind, l.pp, micro, l.interleave)
            .map_err(|e| ExecError::Layout(e.to_string()))?;
        let counts = parallax_sim::stage_layers(spec.model.layers, l);
        let chunks = topo.pp * topo.v;
        for (i, s) in l.stages.iter().enumerate() {
            if s.embedding != (i == 0) || s.head != (i + 1 == chunks) {
                return bad(format!(
                    "layout.stages[{i}]: the executor places the embedding on the first and the head on the last virtual stage"
                ));
            }
        }
        let mut bounds = vec![0usize];
        for c in &counts {
            bounds.push(bounds[bounds.len() - 1] + *c as usize);
        }
        spec.data.check(dims.vocab, seq).map_err(ExecError::Data)?;
        let keep = match l.recompute {
            Recompute::None => Keep::All,
            Recompute::Selective => Keep::Selective,
            Recompute::Full | Recompute::Every(_) => Keep::Input,
            Recompute::Modules(m) => Keep::Modules(m),
        };
        let keep_every = l.recompute.whole_layer_period().unwrap_or(1) as usize;
        let prep = Prepared {
            dims,
            topo,
            bounds,
            schedule,
            micro: micro as usize,
            mbs,
            seq,
            keep,
            keep_every,
            sp,
            zero: if topo.replicas() > 1 { l.zero_stage } else { 0 },
        };
        if let Some(r) = &spec.resume {
            prep.check_state_matches(r)?;
        }
        Ok(prep)
    }

    /// The topology.
    pub fn topology(&self) -> Topology {
        self.topo
    }

    /// A checkpoint resumes this run only if it holds exactly the tensors the model has, at
    /// their shapes: a missing tensor would silently start from scratch, an extra one (a
    /// deeper model's layer) would silently be dropped.
    fn check_state_matches(&self, st: &ModelState) -> Result<(), ExecError> {
        let mut need = BTreeMap::new();
        // Units differ by stage only: data- and tensor-parallel peers name the same tensors at
        // the same global shapes.
        for stage in 0..self.topo.pp {
            for unit in self.plan_rank(self.topo.rank(0, stage, 0)).0 {
                for slot in unit.slots {
                    need.insert(slot.name, slot.global_shape);
                }
            }
        }
        let bad = |reason: String| Err(ExecError::Resume(reason));
        for (name, shape) in &need {
            match st.tensors.get(name) {
                Some(t) if t.shape == *shape => {}
                Some(t) => {
                    return bad(format!(
                        "tensor {name} has shape {:?}, the model needs {shape:?}",
                        t.shape
                    ))
                }
                None => {
                    return bad(format!(
                        "tensor {name} is missing ({} of the model's {} tensors present): not a checkpoint of this model",
                        need.keys().filter(|n| st.tensors.contains_key(*n)).count(),
                        need.len()
                    ))
                }
            }
        }
        if let Some(extra) = st.tensors.keys().find(|n| !need.contains_key(*n)) {
            return bad(format!(
                "tensor {extra} is not part of this model ({} tensors in the checkpoint, {} in the model)",
                st.tensors.len(),
                need.len()
            ));
        }
        Ok(())
    }

    /// The rank's units and chunks (deterministic; no parameters allocated).
    fn plan_rank(&self, rank: usize) -> (Vec<UnitPlan>, Vec<ChunkPlan>) {
        let (_, s, _) = self.topo.coords(rank);
        let d = &self.dims;
        let nv = self.topo.pp * self.topo.v;
        let mut units = Vec::new();
        let mut chunks = Vec::new();
        let builder = || SlotBuilder::with_experts(self.topo.tp, self.topo.ep, self.topo.fold);
        let mut push = |name: String, b: SlotBuilder, experts: bool| -> usize {
            let (slots, len) = b.finish();
            units.push(UnitPlan {
                name,
                slots,
                len,
                experts,
            });
            units.len() - 1
        };
        for c in 0..self.topo.v {
            let vs = c * self.topo.pp + s;
            let mut ch = ChunkPlan {
                vs,
                wte: None,
                wpe: None,
                bert_embed: None,
                blocks: Vec::new(),
                head: None,
                head_w: None,
                mtp: Vec::new(),
                mtp_wte: None,
            };
            if vs == 0 {
                let mut b = builder();
                build_wte(d, &mut b, false);
                ch.wte = Some(push("embed.wte".into(), b, false));
                if d.learned_positions {
                    let mut b = builder();
                    ch.bert_embed = build_wpe(d, &mut b).1;
                    ch.wpe = Some(push("embed.wpe".into(), b, false));
                }
            }
            for layer in self.bounds[vs]..self.bounds[vs + 1] {
                let (mut b, mut eb) = (builder(), builder());
                let lay = BlockLayout::build(d, layer, &mut b, &mut eb);
                let u = push(format!("layers.{layer}"), b, false);
                // A mixture of experts keeps its experts in a unit of their own.
                let eu = lay
                    .is_moe()
                    .then(|| push(format!("layers.{layer}.experts"), eb, true));
                ch.blocks.push((u, eu, lay));
            }
            if vs == nv - 1 {
                let mut b = builder();
                let lay = HeadLayout::build(d, &mut b);
                ch.head = Some((push("head".into(), b, false), lay));
                if d.tied {
                    ch.head_w = if vs == 0 {
                        ch.wte
                    } else {
                        let mut b = builder();
                        build_wte(d, &mut b, true);
                        Some(push("head.wte".into(), b, false))
                    };
                }
                // Multi-token prediction modules read the embedding table: the first stage's,
                // or the copy the last stage keeps (the tied head's), summed as a tied one.
                if d.mtp > 0 {
                    ch.mtp_wte = ch.head_w.or(ch.wte).or_else(|| {
                        let mut b = builder();
                        build_wte(d, &mut b, true);
                        Some(push("head.wte".into(), b, false))
                    });
                }
                for j in 0..d.mtp {
                    let (mut b, mut eb) = (builder(), builder());
                    let lay = MtpLayout::build(d, j, &mut b, &mut eb);
                    let u = push(format!("mtp.{j}"), b, false);
                    let eu = lay
                        .block
                        .is_moe()
                        .then(|| push(format!("mtp.{j}.experts"), eb, true));
                    ch.mtp.push((u, eu, lay));
                }
            }
            chunks.push(ch);
        }
        (units, chunks)
    }
}

#[derive(Clone, Debug)]
struct UnitPlan {
    name: String,
    slots: Vec<Slot>,
    len: usize,
    /// A mixture-of-experts layer's experts: reduced and sharded over the replicas holding
    /// the same experts, not all replicas.
    experts: bool,
}

#[derive(Clone, Debug)]
struct ChunkPlan {
    vs: usize,
    wte: Option<usize>,
    wpe: Option<usize>,
    /// BERT's token types and embedding norm, in the positions' unit.
    bert_embed: Option<BertEmbed>,
    /// Each block's unit, its experts' unit (mixture of experts) and layout.
    blocks: Vec<(usize, Option<usize>, BlockLayout)>,
    head: Option<(usize, HeadLayout)>,
    /// The unit holding the tied unembedding (the embedding itself, or the last stage's copy).
    head_w: Option<usize>,
    /// Multi-token prediction modules (last chunk): each one's unit, its block's experts'
    /// unit and layout.
    mtp: Vec<(usize, Option<usize>, MtpLayout)>,
    /// The unit holding the embedding table they read.
    mtp_wte: Option<usize>,
}

impl ChunkPlan {
    fn units(&self) -> Vec<usize> {
        let mut u: Vec<usize> = self.wte.iter().chain(self.wpe.iter()).copied().collect();
        for (b, e, _) in &self.blocks {
            u.push(*b);
            u.extend(e);
        }
        u.extend(self.head.iter().map(|h| h.0));
        for (m, e, _) in &self.mtp {
            u.push(*m);
            u.extend(e);
        }
        for w in self.head_w.iter().chain(&self.mtp_wte) {
            if !u.contains(w) {
                u.push(*w);
            }
        }
        u
    }
}

/// A unit at run time: parameters, gradients and Adam moments, full or sharded over the
/// data-parallel group as the ZeRO stage says.
#[derive(Debug)]
struct Unit {
    plan: UnitPlan,
    /// Length padded to a multiple of dp (ZeRO) so shards are equal.
    padded: usize,
    /// This rank's shard of the padded buffer.
    shard: Range<usize>,
    /// Full local parameters (padded); under ZeRO-3 only while gathered.
    params: Vec<f32>,
    /// ZeRO-3: this rank's parameter shard.
    pshard: Vec<f32>,
    /// Full local gradient accumulator (padded).
    grads: Vec<f32>,
    /// ZeRO >= 1: the reduced gradient shard.
    gshard: Vec<f32>,
    /// Adam moments: full (ZeRO-0) or the shard.
    m: Vec<f32>,
    v: Vec<f32>,
    /// Slots that every tensor-parallel rank holds whole (reduced over TP under SP).
    replicated: Vec<Range<usize>>,
    /// Ranges of tensors whose tensor-parallel part other ranks hold too (replicated key/value
    /// heads; query/key norms, which every head shares), each rank with part of the gradient:
    /// by the number of parts they are split into over the tensor-parallel ranks.
    shared: std::collections::BTreeMap<usize, Vec<Range<usize>>>,
    /// The replicas this unit's gradients are reduced and its state sharded over: every
    /// replica, or for experts those holding the same ones.
    group: Group,
}

impl Unit {
    /// A unit with nothing in it (the experts of a block that has none).
    fn empty() -> Unit {
        Unit {
            plan: UnitPlan {
                name: String::new(),
                slots: Vec::new(),
                len: 0,
                experts: false,
            },
            padded: 0,
            shard: 0..0,
            params: Vec::new(),
            pshard: Vec::new(),
            grads: Vec::new(),
            gshard: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            replicated: Vec::new(),
            shared: Default::default(),
            group: Group::new(Vec::new()),
        }
    }
}

/// Gradients are all-reduced in buckets of at most this many elements (PyTorch DDP's default
/// `bucket_cap_mb = 25`, in fp32 elements).
pub const BUCKET_ELEMS: usize = 25 * 1024 * 1024 / 4;

const TAG_ACT: u64 = 1 << 48;
const TAG_GRAD: u64 = 2 << 48;
const TAG_EXPORT: u64 = 3 << 48;

fn p2p_tag(kind: u64, vs: usize, mb: usize) -> u64 {
    kind | ((vs as u64) << 32) | mb as u64
}

struct ChunkCache {
    tokens: Vec<u32>,
    /// BERT's embedding norm's input and statistics.
    embed_norm: Option<BertEmbedSaved>,
    blocks: Vec<BlockCache>,
    head: Option<HeadCache>,
    mtp: Vec<MtpCache>,
}

/// What a multi-token prediction module keeps for backward: its tokens (this rank's part of
/// the micro-batch), its input's, block's and head's activations.
#[derive(Debug)]
struct MtpCache {
    tokens: Vec<u32>,
    input: MtpSaved,
    block: BlockCache,
    head: HeadCache,
}

/// The tensor-parallel context of a rank: its communicator, tensor-, context- and
/// expert-parallel groups, and whether sequence parallelism is on.
fn tp_ctx<'a>(
    comm: &'a mut dyn Collectives,
    (group, cp, ep): (&'a Group, Option<&'a Group>, Option<&'a Group>),
    prep: &Prepared,
) -> Tp<'a> {
    Tp {
        comm,
        group,
        sp: prep.sp,
        cp,
        ep,
        fold: prep.topo.fold,
    }
}

/// The weight gradients one `B` left: per unit, its deferred products.
type Deferred = Vec<(usize, Vec<WeightGrad>)>;

/// One rank's engine.
struct Engine<'a> {
    spec: &'a RunSpec,
    prep: &'a Prepared,
    rank: usize,
    coords: (usize, usize, usize),
    comm: &'a mut dyn Collectives,
    units: Vec<Unit>,
    /// Shared so that a pass holds its chunk's plan without copying it.
    chunks: std::rc::Rc<[ChunkPlan]>,
    dp_g: Group,
    tp_g: Group,
    /// The context-parallel group (ranks holding the other chunks of this rank's sequences).
    cp_g: Option<Group>,
    /// The expert-parallel group (in expert order).
    ep_g: Option<Group>,
    tied_g: Option<Group>,
    world_g: Group,
    caches: HashMap<(usize, usize), ChunkCache>,
    /// Weight gradients a split backward (`B`) left for its `W`, per (micro-batch, chunk):
    /// the unit and its deferred products.
    deferred: HashMap<(usize, usize), Deferred>,
    loss_part: f64,
    epoch: Instant,
    spans: Vec<Span>,
    step_idx: u64,
}

/// Runs `spec` as `comm`'s rank. `epoch` is the common start time for traces.
pub fn run_rank(
    spec: &RunSpec,
    prep: &Prepared,
    comm: &mut dyn Collectives,
    epoch: Instant,
) -> Result<RankReport, ExecError> {
    let topo = prep.topo;
    if comm.world() != topo.world() {
        return Err(ExecError::Layout(format!(
            "the layout needs {} ranks, the backend has {}",
            topo.world(),
            comm.world()
        )));
    }
    let rank = comm.rank();
    let (d, s, t) = topo.coords(rank);
    let (plans, chunks) = prep.plan_rank(rank);
    let dp_g = Group::new((0..topo.replicas()).map(|x| topo.rank(x, s, t)).collect());
    // The expert-parallel group (in expert order) and the ranks holding the same experts.
    let me = topo.expert_index(d, t);
    let expert_group = |keep: &dyn Fn(usize) -> bool| {
        Group::new(
            topo.expert_ranks(t, keep)
                .into_iter()
                .map(|(r, x)| topo.rank(r, s, x))
                .collect(),
        )
    };
    let ep_g = (topo.ep > 1).then(|| expert_group(&|i| i / topo.ep == me / topo.ep));
    let edp_g = (topo.ep > 1 || topo.fold).then(|| expert_group(&|i| i % topo.ep == me % topo.ep));
    let cp_g = (topo.cp > 1).then(|| {
        let first = d / topo.cp * topo.cp;
        Group::new((0..topo.cp).map(|c| topo.rank(first + c, s, t)).collect())
    });
    let tp_g = Group::new((0..topo.tp).map(|x| topo.rank(d, s, x)).collect());
    // The embedding table has a copy on the last stage where the head or the multi-token
    // prediction modules read it.
    let copied = prep.dims.tied || prep.dims.mtp > 0;
    let tied_g = (copied && topo.pp > 1 && (s == 0 || s == topo.pp - 1))
        .then(|| Group::new(vec![topo.rank(d, 0, t), topo.rank(d, topo.pp - 1, t)]));
    let world_g = Group::new((0..topo.world()).collect());
    let units = plans
        .into_iter()
        .map(|p| {
            let g = match (&edp_g, p.experts) {
                (Some(e), true) => e.clone(),
                _ => dp_g.clone(),
            };
            let me = g.index_of(rank).unwrap_or(0);
            init_unit(spec, prep, p, (d, t), (g, me))
        })
        .collect();
    let mut e = Engine {
        spec,
        prep,
        rank,
        coords: (d, s, t),
        comm,
        units,
        chunks: chunks.into(),
        dp_g,
        tp_g,
        cp_g,
        ep_g,
        tied_g,
        world_g,
        caches: HashMap::new(),
        deferred: HashMap::new(),
        loss_part: 0.0,
        epoch,
        spans: Vec::new(),
        step_idx: 0,
    };
    e.run()
}

/// A unit's parameters and optimizer state for the rank at replica `r`, tensor-parallel
/// rank `t`, sharded (ZeRO) over `group`, of which this rank is member `d`.
fn init_unit(
    spec: &RunSpec,
    prep: &Prepared,
    plan: UnitPlan,
    (r, t): (usize, usize),
    (group, d): (Group, usize),
) -> Unit {
    let dp = group.size();
    let tp = prep.topo.tp;
    let at = prep.topo.part(r, t);
    let zero = prep.zero;
    let padded = if zero > 0 {
        plan.len.div_ceil(dp) * dp
    } else {
        plan.len
    };
    let sz = padded / dp;
    let shard = if zero > 0 {
        d * sz..(d + 1) * sz
    } else {
        0..padded
    };
    let mut params = vec![0.0f32; padded];
    let mut m = vec![0.0f32; padded];
    let mut v = vec![0.0f32; padded];
    for slot in &plan.slots {
        let saved = spec.resume.as_ref().and_then(|r| r.tensors.get(&slot.name));
        // `check_state_matches` has seen every slot in a resumed checkpoint at its shape.
        match saved {
            Some(ts) => {
                params[slot.range.clone()].copy_from_slice(&slot.local_part(&ts.param, at));
                m[slot.range.clone()].copy_from_slice(&slot.local_part(&ts.m, at));
                v[slot.range.clone()].copy_from_slice(&slot.local_part(&ts.v, at));
            }
            None => {
                let full = slot.init_global(spec.seed);
                params[slot.range.clone()].copy_from_slice(&slot.local_part(&full, at));
            }
        }
    }
    let replicated = plan
        .slots
        .iter()
        .filter(|s| s.split == Split::Replicated)
        .map(|s| s.range.clone())
        .collect();
    let mut shared = std::collections::BTreeMap::<usize, Vec<Range<usize>>>::new();
    for s in &plan.slots {
        if let Split::Parts { parts, .. } = s.split {
            if parts < tp {
                shared.entry(parts).or_default().push(s.range.clone());
            }
        }
    }

    let (params, pshard) = if zero >= 3 {
        (Vec::new(), params[shard.clone()].to_vec())
    } else {
        (params, Vec::new())
    };
    if zero > 0 {
        m = m[shard.clone()].to_vec();
        v = v[shard.clone()].to_vec();
    }
    Unit {
        plan,
        padded,
        shard: shard.clone(),
        params,
        pshard,
        grads: vec![0.0; padded],
        gshard: if zero > 0 {
            vec![0.0; shard.len()]
        } else {
            Vec::new()
        },
        m,
        v,
        replicated,
        shared,
        group,
    }
}

/// Two distinct elements of a slice, mutably.
fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert_ne!(a, b, "two_mut needs distinct indices");
    if a < b {
        let (l, r) = v.split_at_mut(b);
        (&mut l[a], &mut r[0])
    } else {
        let (l, r) = v.split_at_mut(a);
        (&mut r[0], &mut l[b])
    }
}

impl Engine<'_> {
    fn run(&mut self) -> Result<RankReport, ExecError> {
        let mut report = RankReport::default();
        let start_step = self.spec.resume.as_ref().map_or(0, |r| r.step);
        let tokens = (self.spec.global_batch * self.spec.seq) as f64;
        for i in 0..self.spec.steps {
            self.step_idx = i;
            let t0 = Instant::now();
            self.inject_fault(i)?;
            let global_step = start_step + i;
            let loss = self.step(global_step)?;
            // Every rank holds the same all-reduced loss, so every rank stops here together.
            if !loss.is_finite() {
                return Err(ExecError::Diverged {
                    step: global_step + 1,
                    loss,
                });
            }
            let dt = t0.elapsed().as_secs_f64();
            report.losses.push(loss);
            report.step_times.push(dt);
            if self.rank == 0 {
                if let Some(h) = &self.spec.on_step {
                    h(&StepStats {
                        step: global_step + 1,
                        loss,
                        time_s: dt,
                        tokens_per_s: tokens / dt.max(1e-12),
                    });
                }
            }
            let done = i + 1 == self.spec.steps;
            let ck_due = self.spec.on_checkpoint.is_some()
                && checkpoint_due(self.spec.checkpoint_every, i, self.spec.steps);
            if ck_due || (done && self.spec.collect_state) {
                let st = self.export(global_step + 1)?;
                if let (Some(st), Some(h)) = (&st, &self.spec.on_checkpoint) {
                    if ck_due {
                        h(st).map_err(|(path, reason)| ExecError::Checkpoint { path, reason })?;
                    }
                }
                if done && self.spec.collect_state {
                    report.state = st;
                }
            }
        }
        report.spans = std::mem::take(&mut self.spans);
        Ok(report)
    }

    fn inject_fault(&mut self, step: u64) -> Result<(), ExecError> {
        let Some(f) = self.spec.fault else {
            return Ok(());
        };
        if f.rank != self.rank || f.step != step {
            return Ok(());
        }
        match f.kind {
            FaultKind::Die => Err(ExecError::Rank {
                rank: self.rank,
                message: format!("injected fault at step {step}"),
            }),
            FaultKind::Stall => {
                let t0 = Instant::now();
                while self.comm.check_peers().is_ok() && t0.elapsed() < self.spec.timeout * 4 {
                    std::thread::sleep(Duration::from_millis(5));
                }
                self.comm.check_peers()?;
                Err(ExecError::Rank {
                    rank: self.rank,
                    message: format!("injected stall at step {step} was not detected"),
                })
            }
        }
    }

    /// Records a span when tracing (`name` is only built then).
    fn record(&mut self, name: impl FnOnce() -> String, cat: &'static str, t0: Instant) {
        if self.spec.trace {
            let name = name();
            let start = t0.duration_since(self.epoch).as_secs_f64();
            self.spans.push(Span {
                rank: self.rank,
                stage: self.coords.1,
                name,
                cat,
                step: self.step_idx,
                start_s: start,
                dur_s: t0.elapsed().as_secs_f64(),
            });
        }
    }

    fn step(&mut self, global_step: u64) -> Result<f64, ExecError> {
        self.loss_part = 0.0;
        let prep = self.prep;
        for op in prep.schedule.stage_ops(self.coords.1 as u32) {
            self.comm.check_peers()?;
            let (mb, c) = (op.micro_batch as usize, op.chunk as usize);
            let t0 = Instant::now();
            match op.op {
                Op::F => {
                    self.forward(global_step, mb, c)?;
                    self.record(|| format!("F mb{mb} c{c}"), "forward", t0);
                }
                Op::BW => {
                    self.backward(mb, c, false)?;
                    self.record(|| format!("BW mb{mb} c{c}"), "backward", t0);
                }
                Op::B => {
                    self.backward(mb, c, true)?;
                    self.record(|| format!("B mb{mb} c{c}"), "backward", t0);
                }
                Op::W => {
                    self.weight_pass(mb, c)?;
                    self.record(|| format!("W mb{mb} c{c}"), "backward", t0);
                }
            }
        }
        let t0 = Instant::now();
        self.reduce_grads()?;
        self.record(|| "grad-sync".into(), "comm", t0);
        let t0 = Instant::now();
        self.adam(global_step + 1)?;
        self.record(|| "optimizer".into(), "optimizer", t0);
        let mut loss = [self.loss_part as f32];
        // Sum in f64 would be nicer; f32 keeps one collective type. Contributions are few.
        self.comm.all_reduce_sum(&self.world_g, &mut loss)?;
        Ok(f64::from(loss[0]))
    }

    /// Whether the embedding and the LM head are split by vocabulary over the tensor-parallel
    /// group (where it divides the vocabulary), and the token rows this rank holds.
    fn vocab_window(&self) -> (bool, VocabWindow) {
        let (v, tp) = (self.prep.dims.vocab, self.prep.topo.tp);
        if tp > 1 && v % tp == 0 {
            let t = self.coords.2;
            (true, t * (v / tp)..(t + 1) * (v / tp))
        } else {
            (false, 0..v)
        }
    }

    fn local_rows(&self) -> Range<usize> {
        let rows = self.prep.mbs * self.prep.seq / self.prep.topo.cp;
        if self.prep.sp {
            let r = rows / self.prep.topo.tp;
            let t = self.coords.2;
            t * r..(t + 1) * r
        } else {
            0..rows
        }
    }

    fn pass(&self) -> Pass {
        let cp = self.prep.topo.cp;
        Pass {
            batch: self.prep.mbs,
            seq: self.prep.seq,
            cp,
            c: self.coords.0 % cp,
        }
    }

    fn neighbour(&self, vs: usize) -> usize {
        let (d, _, t) = self.coords;
        self.prep.topo.rank(d, vs % self.prep.topo.pp, t)
    }

    fn gather(&mut self, u: usize) -> Result<(), CommError> {
        if self.prep.zero < 3 {
            return Ok(());
        }
        let unit = &mut self.units[u];
        if !unit.params.is_empty() {
            return Ok(());
        }
        unit.params = vec![0.0; unit.padded];
        self.comm
            .all_gather(&unit.group, &unit.pshard, &mut unit.params)
    }

    fn release(&mut self, u: usize) {
        if self.prep.zero >= 3 {
            self.units[u].params = Vec::new();
        }
    }

    /// The embedding of this rank's rows of `tokens` (the micro-batch's, every row of this
    /// rank's part of the sequences) from the table in unit `wu` (gathered): under a
    /// vocabulary-parallel table every row's partial lookup, summed over the group (scattered
    /// to the local rows under sequence parallelism).
    fn lookup(&mut self, wu: usize, tokens: &[u32]) -> Result<Vec<f32>, CommError> {
        let prep = self.prep;
        let d = &prep.dims;
        let (vp, window) = self.vocab_window();
        let wte = &self.units[wu].params[..window.len() * d.h];
        if !vp {
            return Ok(embed_fwd(d, wte, window, tokens, self.local_rows()));
        }
        let part = embed_fwd(d, wte, window, tokens, 0..tokens.len());
        let mut tp = tp_ctx(
            &mut *self.comm,
            (&self.tp_g, self.cp_g.as_ref(), self.ep_g.as_ref()),
            prep,
        );
        tp.reduce_rows(part)
    }

    /// Backward of [`Engine::lookup`]: the gradient `dx` of this rank's rows into the table's
    /// gradient in unit `wu` (a vocabulary-parallel table takes every row's for its own tokens).
    fn lookup_bwd(&mut self, wu: usize, tokens: &[u32], dx: Vec<f32>) -> Result<(), CommError> {
        let prep = self.prep;
        let d = &prep.dims;
        let (vp, window) = self.vocab_window();
        let (dx, rows) = if vp {
            let mut tp = tp_ctx(
                &mut *self.comm,
                (&self.tp_g, self.cp_g.as_ref(), self.ep_g.as_ref()),
                prep,
            );
            (tp.gather_rows(dx)?, 0..tokens.len())
        } else {
            (dx, self.local_rows())
        };
        let n = window.len() * d.h;
        embed_bwd(d, &mut self.units[wu].grads[..n], window, tokens, rows, &dx);
        Ok(())
    }

    /// This rank's rows (indices into its local rows) holding a sequence's first token, with
    /// that sequence's label: position 0 lies in the first context-parallel chunk, and under
    /// sequence parallelism in one tensor-parallel rank's slice.
    fn first_token_rows(&self, labels: &[u32]) -> Vec<(usize, u32)> {
        let pass = self.pass();
        if pass.position_of(pass.c, 0) != 0 {
            return Vec::new();
        }
        let (rows, lseq) = (self.local_rows(), pass.local_seq());
        labels
            .iter()
            .enumerate()
            .map(|(b, y)| (b * lseq, *y))
            .filter(|(r, _)| rows.contains(r))
            .map(|(r, y)| (r - rows.start, y))
            .collect()
    }

    /// A head's forward on this rank's rows `x`: its own tensors (a final norm, BERT's heads)
    /// in unit `own` laid out as `hl`, the LM head's weight the model's (the untied head's or
    /// the table), against the micro-batch's `targets` (a vocabulary-parallel head computes
    /// every row's loss on every rank of the group; otherwise the local rows', each rank its
    /// own under sequence parallelism). Gathers what it reads; the caller releases it.
    fn head_forward(
        &mut self,
        ch: &ChunkPlan,
        (own, hl): (usize, &HeadLayout),
        x: Vec<f32>,
        targets: &[u32],
        scale: f32,
        nsp: Option<&Nsp>,
    ) -> Result<(f64, f64, HeadCache), ExecError> {
        let prep = self.prep;
        let d = &prep.dims;
        let (vp, window) = self.vocab_window();
        let rows = self.local_rows();
        let Some((hu, main)) = &ch.head else {
            unreachable!("heads run on the last chunk")
        };
        for u in [Some(own), Some(*hu), ch.head_w].into_iter().flatten() {
            self.gather(u)?;
        }
        let w_out = match (head_own_weight(main, &self.units[*hu].params), ch.head_w) {
            (Some(w), _) => w,
            (None, Some(wu)) => &self.units[wu].params[..window.len() * d.h],
            (None, None) => unreachable!("a tied head has a weight unit"),
        };
        let mut tp = tp_ctx(
            &mut *self.comm,
            (&self.tp_g, self.cp_g.as_ref(), self.ep_g.as_ref()),
            prep,
        );
        let (targets, vp_head) = if vp {
            let vp_head = VocabParallel {
                tp: &mut tp,
                vocab: window.clone(),
            };
            (targets, Some(vp_head))
        } else {
            (&targets[rows], None)
        };
        let p = &self.units[own].params;
        Ok(head_fwd(d, hl, p, w_out, x, targets, scale, nsp, vp_head)?)
    }

    /// Backward of [`Engine::head_forward`]: the gradients of the head's own tensors (unit
    /// `own`, laid out as `hl`) and of the LM head's weight (the untied head's, in its unit
    /// beside its norm, or the table's), and of the head's input rows. Gathers what it reads;
    /// the caller releases it.
    fn head_backward(
        &mut self,
        ch: &ChunkPlan,
        (own, hl): (usize, &HeadLayout),
        cache: HeadCache,
    ) -> Result<Vec<f32>, ExecError> {
        let prep = self.prep;
        let d = &prep.dims;
        let (vp, window) = self.vocab_window();
        let Some((hu, main)) = &ch.head else {
            unreachable!("heads run on the last chunk")
        };
        let (wu, wr) = match (head_weight_range(main), ch.head_w) {
            (Some(r), _) => (*hu, r),
            (None, Some(w)) => (w, 0..window.len() * d.h),
            (None, None) => unreachable!("a tied head has a weight unit"),
        };
        self.gather(own)?;
        self.gather(wu)?;
        let mut tp = tp_ctx(
            &mut *self.comm,
            (&self.tp_g, self.cp_g.as_ref(), self.ep_g.as_ref()),
            prep,
        );
        let vp_head = vp.then_some(VocabParallel {
            tp: &mut tp,
            vocab: window,
        });
        let dx = if wu == own {
            // The untied main head: its weight beside its norm in one unit, read from `params`
            // while `grads` is written (no copy of the vocab × hidden weight).
            let h = &mut self.units[own];
            let w = head_own_weight(hl, &h.params).unwrap_or_default();
            head_bwd(d, hl, &h.params, &mut h.grads, w, None, cache, vp_head)?
        } else {
            let (m, w) = two_mut(&mut self.units, own, wu);
            let (wp, wg) = (&w.params[wr.clone()], &mut w.grads[wr]);
            head_bwd(d, hl, &m.params, &mut m.grads, wp, Some(wg), cache, vp_head)?
        };
        Ok(dx)
    }

    /// One block's forward on this rank's rows `x` (its units gathered under ZeRO-3; the
    /// caller releases them).
    fn block_forward(
        &mut self,
        (u, eu): (usize, Option<usize>),
        lay: &BlockLayout,
        x: Vec<f32>,
        keep: Keep,
    ) -> Result<(Vec<f32>, BlockCache), ExecError> {
        let prep = self.prep;
        let pass = self.pass();
        self.gather(u)?;
        if let Some(eu) = eu {
            self.gather(eu)?;
        }
        let mut tp = tp_ctx(
            &mut *self.comm,
            (&self.tp_g, self.cp_g.as_ref(), self.ep_g.as_ref()),
            prep,
        );
        let pe: &[f32] = eu.map_or(&[], |eu| &self.units[eu].params);
        let p = &self.units[u].params;
        Ok(block_fwd(&prep.dims, lay, p, pe, x, &mut tp, pass, keep)?)
    }

    /// One block's backward from the gradient `dy` of its output (its units gathered; the
    /// caller releases them); with `split` (a zero-bubble `B`) its weight gradients are left
    /// for the `W` pass of micro-batch `mb` on chunk `c`.
    fn block_backward(
        &mut self,
        (u, eu): (usize, Option<usize>),
        lay: &BlockLayout,
        cache: BlockCache,
        dy: Vec<f32>,
        (mb, c, split): (usize, usize, bool),
    ) -> Result<Vec<f32>, ExecError> {
        let prep = self.prep;
        let pass = self.pass();
        self.gather(u)?;
        if let Some(eu) = eu {
            self.gather(eu)?;
        }
        let mut none = Unit::empty();
        let (unit, experts) = match eu {
            Some(eu) => two_mut(&mut self.units, u, eu),
            None => (&mut self.units[u], &mut none),
        };
        let mut tp = tp_ctx(
            &mut *self.comm,
            (&self.tp_g, self.cp_g.as_ref(), self.ep_g.as_ref()),
            prep,
        );
        let mut later = Vec::new();
        let dx = block_bwd(
            &prep.dims,
            lay,
            (&unit.params, &mut unit.grads),
            (&experts.params, &mut experts.grads),
            cache,
            dy,
            &mut tp,
            pass,
            split.then_some(&mut later),
        )?;
        if split {
            self.deferred.entry((mb, c)).or_default().push((u, later));
        }
        Ok(dx)
    }

    /// Forward of the multi-token prediction modules on the last chunk from the main model's
    /// last hidden rows `hid`, with each module's tokens and targets (this rank's part).
    fn mtp_forward(
        &mut self,
        ch: &ChunkPlan,
        mut hid: Vec<f32>,
        ids: Vec<(Vec<u32>, Vec<u32>)>,
    ) -> Result<Vec<MtpCache>, ExecError> {
        let prep = self.prep;
        let d = &prep.dims;
        let (Some((hu, _)), Some(emb)) = (&ch.head, ch.mtp_wte) else {
            unreachable!("modules are planned on the last chunk, with a table")
        };
        let scale =
            MTP_LOSS_WEIGHT / (d.mtp as u64 * self.spec.global_batch * self.spec.seq) as f32;
        let mut out = Vec::with_capacity(ch.mtp.len());
        for ((u, eu, lay), (tokens, targets)) in ch.mtp.iter().zip(ids) {
            self.gather(emb)?;
            let e = self.lookup(emb, &tokens)?;
            self.release(emb);
            self.gather(*u)?;
            let (x, input) = mtp_input_fwd(d, lay, &self.units[*u].params, e, hid);
            // A prediction module is no layer of the stack: the policy's own choice.
            let (y, block) = self.block_forward((*u, *eu), &lay.block, x, prep.keep)?;
            let head_in = (*u, &lay.head);
            let (_, _, head) = self.head_forward(ch, head_in, y.clone(), &targets, scale, None)?;
            for unit in [Some(*u), *eu, Some(*hu), ch.head_w].into_iter().flatten() {
                self.release(unit);
            }
            hid = y;
            out.push(MtpCache {
                tokens,
                input,
                block,
                head,
            });
        }
        Ok(out)
    }

    /// Backward of the modules, the last first (ZB-H1's `B` with `split`: their blocks' weight
    /// gradients deferred): the gradient of the main model's last hidden rows they add.
    fn mtp_backward(
        &mut self,
        ch: &ChunkPlan,
        caches: Vec<MtpCache>,
        (mb, c, split): (usize, usize, bool),
    ) -> Result<Option<Vec<f32>>, ExecError> {
        let prep = self.prep;
        let d = &prep.dims;
        let (Some((hu, _)), Some(emb)) = (&ch.head, ch.mtp_wte) else {
            return Ok(None);
        };
        let mut dnext: Option<Vec<f32>> = None;
        for ((u, eu, lay), mc) in ch.mtp.iter().zip(caches).rev() {
            let mut dy = self.head_backward(ch, (*u, &lay.head), mc.head)?;
            for w in [Some(*hu), ch.head_w].into_iter().flatten() {
                self.release(w);
            }
            if let Some(dn) = dnext {
                add_into(&mut dy, &dn);
            }
            let dx = self.block_backward((*u, *eu), &lay.block, mc.block, dy, (mb, c, split))?;
            let unit = &mut self.units[*u];
            let (de, dhid) = mtp_input_bwd(d, lay, (&unit.params, &mut unit.grads), mc.input, &dx);
            self.lookup_bwd(emb, &mc.tokens, de)?;
            self.release(*u);
            if let Some(eu) = eu {
                self.release(*eu);
            }
            dnext = Some(dhid);
        }
        Ok(dnext)
    }

    fn forward(&mut self, step: u64, mb: usize, c: usize) -> Result<(), ExecError> {
        let chunks = self.chunks.clone();
        let ch = &chunks[c];
        let prep = self.prep;
        let d = &prep.dims;
        let nv = prep.topo.pp * prep.topo.v;
        let pass = self.pass();
        let rows = self.local_rows();
        let width = rows.len() * d.h;
        let needs_data = ch.vs == 0 || ch.vs == nv - 1;
        let mut nsp_labels: Vec<u32> = Vec::new();
        let (tokens, targets, mtp_ids) = if needs_data {
            // Context-parallel ranks of a replica read the same sequences, each its chunks.
            let sample = self.coords.0 / prep.topo.cp;
            let first = ((sample * prep.micro + mb) * prep.mbs) as u64;
            let (mut tokens, mut targets) = micro_batch(
                &self.spec.data,
                self.spec.seed,
                step,
                first,
                prep.mbs,
                prep.seq,
                d.vocab,
            );
            if d.bert {
                // Masked-LM inputs and targets in place of the next tokens.
                let key = (self.spec.seed, step, first);
                targets = mask_for_mlm(&mut tokens, key, prep.seq, d.vocab);
                nsp_labels = (0..prep.mbs as u64)
                    .map(|b| nsp_label(self.spec.seed, step, first + b))
                    .collect();
            }
            let mtp_ids: Vec<_> = (0..ch.mtp.len())
                .map(|j| mtp_tokens(&tokens, &targets, prep.seq, j))
                .collect();
            let pos = pass.positions();
            let pick = |all: Vec<u32>| -> Vec<u32> {
                if prep.topo.cp == 1 {
                    return all;
                }
                (0..prep.mbs)
                    .flat_map(|b| {
                        pos.iter()
                            .map(|p| all[b * prep.seq + p])
                            .collect::<Vec<_>>()
                    })
                    .collect()
            };
            let mtp_ids = mtp_ids
                .into_iter()
                .map(|(t, y)| (pick(t), pick(y)))
                .collect();
            (pick(tokens), pick(targets), mtp_ids)
        } else {
            (Vec::new(), Vec::new(), Vec::new())
        };
        let (vp, _) = self.vocab_window();
        let mut embed_norm = None;
        let mut x = if let Some(wu) = ch.wte {
            self.gather(wu)?;
            if let Some(pu) = ch.wpe {
                self.gather(pu)?;
            }
            let mut x = self.lookup(wu, &tokens)?;
            if let Some(pu) = ch.wpe {
                let wpe = &self.units[pu].params[..d.max_seq * d.h];
                positions_fwd(d, &mut x, wpe, rows.clone(), &pass);
                if let Some(e) = &ch.bert_embed {
                    let p = &self.units[pu].params;
                    let (y, saved) = bert_embed_fwd(d, e, p, x, rows.clone(), &pass);
                    x = y;
                    embed_norm = Some(saved);
                }
            }
            self.release(wu);
            if let Some(pu) = ch.wpe {
                self.release(pu);
            }
            x
        } else {
            let mut x = vec![0.0; width];
            let from = self.neighbour(ch.vs + nv - 1);
            self.comm.recv(
                from,
                p2p_tag(TAG_ACT, ch.vs, mb),
                &mut x,
                "pipeline activation",
            )?;
            x
        };
        let mut caches = Vec::with_capacity(ch.blocks.len());
        let first = self.prep.bounds[ch.vs];
        for (i, (u, eu, lay)) in ch.blocks.iter().enumerate() {
            let keep = self.prep.keep_of(first + i);
            let (y, cache) = self.block_forward((*u, *eu), lay, x, keep)?;
            self.release(*u);
            if let Some(eu) = eu {
                self.release(*eu);
            }
            x = y;
            caches.push(cache);
        }
        let mut mtp = Vec::new();
        let head = if let Some((hu, hl)) = &ch.head {
            // BERT's masked-LM loss is the mean over the batch's masked positions, its
            // next-sentence loss the mean over its sequences; a decoder's, over every token.
            let gb = self.spec.global_batch;
            let tokens_in_loss = if d.bert {
                mlm_targets(self.spec.seed, step, gb, prep.seq).max(1) as u64
            } else {
                gb * self.spec.seq
            };
            let scale = 1.0 / tokens_in_loss as f32;
            let nsp = d.bert.then(|| Nsp {
                rows: self.first_token_rows(&nsp_labels),
                scale: 1.0 / gb as f32,
            });
            let hid = (!ch.mtp.is_empty()).then(|| x.clone());
            let (loss, nsp_loss, hc) =
                self.head_forward(ch, (*hu, hl), x, &targets, scale, nsp.as_ref())?;
            if (prep.sp && !vp) || self.coords.2 == 0 {
                self.loss_part += loss * f64::from(scale);
            }
            // The next-sentence rows are this rank's own (all of them on every tensor-parallel
            // rank without sequence parallelism).
            if let Some(n) = nsp.filter(|_| prep.sp || self.coords.2 == 0) {
                self.loss_part += nsp_loss * f64::from(n.scale);
            }
            self.release(*hu);
            if let Some(w) = ch.head_w {
                self.release(w);
            }
            if let Some(hid) = hid {
                mtp = self.mtp_forward(ch, hid, mtp_ids)?;
            }
            Some(hc)
        } else {
            let to = self.neighbour(ch.vs + 1);
            self.comm
                .send_owned(to, p2p_tag(TAG_ACT, ch.vs + 1, mb), x)?;
            None
        };
        self.caches.insert(
            (mb, c),
            ChunkCache {
                tokens,
                blocks: caches,
                head,
                mtp,
                embed_norm,
            },
        );
        Ok(())
    }

    /// The backward of micro-batch `mb` on chunk `c`; with `split` (a zero-bubble `B`) the
    /// blocks' weight-gradient GEMMs are left for [`Engine::weight_pass`].
    fn backward(&mut self, mb: usize, c: usize, split: bool) -> Result<(), ExecError> {
        let chunks = self.chunks.clone();
        let ch = &chunks[c];
        let prep = self.prep;
        let d = &prep.dims;
        let nv = prep.topo.pp * prep.topo.v;
        let pass = self.pass();
        let rows = self.local_rows();
        let Some(cache) = self.caches.remove(&(mb, c)) else {
            return Err(ExecError::Rank {
                rank: self.rank,
                message: format!(
                    "schedule runs backward of micro-batch {mb} chunk {c} before its forward"
                ),
            });
        };
        let mut dx = match (cache.head, &ch.head) {
            (Some(hc), Some((hu, hl))) => {
                let dx = self.head_backward(ch, (*hu, hl), hc)?;
                for u in [Some(*hu), ch.head_w].into_iter().flatten() {
                    self.release(u);
                }
                let mut dx = dx;
                if let Some(dh) = self.mtp_backward(ch, cache.mtp, (mb, c, split))? {
                    add_into(&mut dx, &dh);
                }
                dx
            }
            _ => {
                let mut dx = vec![0.0; rows.len() * d.h];
                let from = self.neighbour(ch.vs + 1);
                self.comm.recv(
                    from,
                    p2p_tag(TAG_GRAD, ch.vs, mb),
                    &mut dx,
                    "pipeline gradient",
                )?;
                dx
            }
        };
        for ((u, eu, lay), bc) in ch.blocks.iter().zip(cache.blocks).rev() {
            dx = self.block_backward((*u, *eu), lay, bc, dx, (mb, c, split))?;
            self.release(*u);
            if let Some(eu) = eu {
                self.release(*eu);
            }
        }
        if let Some(wu) = ch.wte {
            if let Some(pu) = ch.wpe {
                if let (Some(e), Some(saved)) = (&ch.bert_embed, cache.embed_norm) {
                    // The embedding norm's weight (gathered again under ZeRO-3).
                    self.gather(pu)?;
                    let u = &mut self.units[pu];
                    let (p, g) = (&u.params, &mut u.grads);
                    dx = bert_embed_bwd(d, e, (p, g), saved, &dx, rows.clone(), &pass);
                    self.release(pu);
                }
                let dwpe = &mut self.units[pu].grads[..d.max_seq * d.h];
                positions_bwd(d, dwpe, rows.clone(), &pass, &dx);
            }
            self.lookup_bwd(wu, &cache.tokens, dx)?;
        } else {
            let to = self.neighbour(ch.vs + nv - 1);
            self.comm
                .send_owned(to, p2p_tag(TAG_GRAD, ch.vs - 1, mb), dx)?;
        }
        if prep.zero >= 2 && !split {
            for u in ch.units() {
                self.reduce_scatter_unit(u, true)?;
            }
        }
        Ok(())
    }

    /// The `W` of a zero-bubble schedule: the weight gradients `B` of micro-batch `mb` on
    /// chunk `c` left, then (ZeRO-2/3) the chunk's gradients reduce-scattered.
    fn weight_pass(&mut self, mb: usize, c: usize) -> Result<(), ExecError> {
        let Some(work) = self.deferred.remove(&(mb, c)) else {
            return Err(ExecError::Rank {
                rank: self.rank,
                message: format!("schedule runs W of micro-batch {mb} chunk {c} before its B"),
            });
        };
        for (u, list) in work {
            for wg in list {
                wg.apply(&mut self.units[u].grads);
            }
        }
        if self.prep.zero >= 2 {
            let chunk = self.chunks[c].clone();
            for u in chunk.units() {
                self.reduce_scatter_unit(u, true)?;
            }
        }
        Ok(())
    }

    /// Reduce-scatters a unit's gradient accumulator over the data-parallel group into its
    /// shard (added when `accumulate`), then clears the accumulator.
    fn reduce_scatter_unit(&mut self, u: usize, accumulate: bool) -> Result<(), CommError> {
        let unit = &mut self.units[u];
        let mut part = vec![0.0; unit.shard.len()];
        self.comm
            .reduce_scatter_sum(&unit.group, &unit.grads, &mut part)?;
        if accumulate {
            for (g, p) in unit.gshard.iter_mut().zip(&part) {
                *g += p;
            }
        } else {
            unit.gshard = part;
        }
        unit.grads.iter_mut().for_each(|g| *g = 0.0);
        Ok(())
    }

    /// The gradient this rank holds for unit `u` (full or its shard) and where it starts.
    fn held_grads(&mut self, u: usize) -> (&mut [f32], usize) {
        let zero = self.prep.zero;
        let unit = &mut self.units[u];
        if zero == 0 {
            (&mut unit.grads[..], 0)
        } else {
            (&mut unit.gshard[..], unit.shard.start)
        }
    }

    /// All-reduces over `g` the parts of unit `u`'s held gradient that lie in `ranges`.
    fn all_reduce_ranges(
        &mut self,
        u: usize,
        ranges: &[Range<usize>],
        g: &Group,
    ) -> Result<(), ExecError> {
        let (held, start) = self.held_grads(u);
        let n = held.len();
        let pieces: Vec<Range<usize>> = ranges
            .iter()
            .filter_map(|r| {
                let lo = r.start.max(start);
                let hi = r.end.min(start + n);
                (lo < hi).then(|| lo - start..hi - start)
            })
            .collect();
        let mut buf: Vec<f32> = pieces
            .iter()
            .flat_map(|r| held[r.clone()].to_vec())
            .collect();
        self.comm.all_reduce_sum(g, &mut buf)?;
        let (held, _) = self.held_grads(u);
        let mut at = 0;
        for r in pieces {
            held[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
            at += r.len();
        }
        Ok(())
    }

    fn reduce_grads(&mut self) -> Result<(), ExecError> {
        let prep = self.prep;
        // Data parallel.
        match prep.zero {
            // Folded experts have replicas over the tensor-parallel ranks even without
            // data parallelism.
            0 if prep.topo.replicas() > 1 || prep.topo.expert_replicas() > 1 => {
                self.bucketed_all_reduce()?
            }
            1 => {
                for u in 0..self.units.len() {
                    self.reduce_scatter_unit(u, false)?;
                }
            }
            _ => {}
        }
        // Sequence parallel: replicated tensors saw only this rank's tokens.
        if prep.sp {
            let tp_g = self.tp_g.clone();
            for u in 0..self.units.len() {
                let ranges = self.units[u].replicated.clone();
                self.all_reduce_ranges(u, &ranges, &tp_g)?;
            }
        }
        // Tensors split into fewer parts than tensor-parallel ranks (replicated key/value
        // heads; query/key norms, one part): each rank saw only its own query heads' use of
        // its part, summed over the ranks holding the same one.
        let (t, tp) = (self.coords.2, prep.topo.tp);
        for u in 0..self.units.len() {
            for (p, ranges) in self.units[u].shared.clone() {
                let ranks = self.tp_g.ranks();
                let g = Group::new(
                    (0..tp)
                        .filter(|o| o * p / tp == t * p / tp)
                        .map(|o| ranks[o])
                        .collect(),
                );
                self.all_reduce_ranges(u, &ranges, &g)?;
            }
        }
        // Tied embedding and LM head on the first and last stage.
        if let Some(g) = self.tied_g.clone() {
            let u = self
                .units
                .iter()
                .position(|u| u.plan.name == "embed.wte" || u.plan.name == "head.wte");
            if let Some(u) = u {
                let (held, _) = self.held_grads(u);
                let mut buf = held.to_vec();
                self.comm.all_reduce_sum(&g, &mut buf)?;
                let (held, _) = self.held_grads(u);
                held.copy_from_slice(&buf);
            }
        }
        Ok(())
    }

    fn bucketed_all_reduce(&mut self) -> Result<(), CommError> {
        // Experts reduce over the replicas holding them, one unit at a time.
        for u in 0..self.units.len() {
            if self.units[u].plan.experts {
                let g = self.units[u].group.clone();
                self.comm.all_reduce_sum(&g, &mut self.units[u].grads)?;
            }
        }
        let mut start = 0;
        while start < self.units.len() {
            if self.units[start].plan.experts {
                start += 1;
                continue;
            }
            let mut end = start + 1;
            let mut n = self.units[start].grads.len();
            while end < self.units.len()
                && !self.units[end].plan.experts
                && n + self.units[end].grads.len() <= BUCKET_ELEMS
            {
                n += self.units[end].grads.len();
                end += 1;
            }
            let mut bucket = Vec::with_capacity(n);
            for u in &self.units[start..end] {
                bucket.extend_from_slice(&u.grads);
            }
            self.comm.all_reduce_sum(&self.dp_g, &mut bucket)?;
            let mut at = 0;
            for u in &mut self.units[start..end] {
                let len = u.grads.len();
                u.grads.copy_from_slice(&bucket[at..at + len]);
                at += len;
            }
            start = end;
        }
        Ok(())
    }

    fn adam(&mut self, t: u64) -> Result<(), CommError> {
        let a = self.spec.adam;
        let bc = a.bias_corrections(t);
        let zero = self.prep.zero;
        for u in 0..self.units.len() {
            let unit = &mut self.units[u];
            let (p, g): (&mut [f32], &[f32]) = match zero {
                0 => (&mut unit.params[..], &unit.grads[..]),
                1 | 2 => (&mut unit.params[unit.shard.clone()], &unit.gshard[..]),
                _ => (&mut unit.pshard[..], &unit.gshard[..]),
            };
            let (um, uv) = (&mut unit.m[..], &mut unit.v[..]);
            if !crate::tensor::adam_offloaded(&a, bc, p, g, um, uv) {
                a.update(bc, p, g, um, uv);
            }
            if zero == 1 || zero == 2 {
                let mine = unit.params[unit.shard.clone()].to_vec();
                self.comm.all_gather(&unit.group, &mine, &mut unit.params)?;
            }
            let unit = &mut self.units[u];
            unit.grads.iter_mut().for_each(|x| *x = 0.0);
            unit.gshard.iter_mut().for_each(|x| *x = 0.0);
        }
        Ok(())
    }

    /// Gathers the whole state onto rank 0 (a collective: every rank takes part).
    fn export(&mut self, step: u64) -> Result<Option<ModelState>, ExecError> {
        let zero = self.prep.zero;
        let mut full: Vec<[Vec<f32>; 3]> = Vec::with_capacity(self.units.len());
        for u in 0..self.units.len() {
            let unit = &self.units[u];
            let gather = |comm: &mut dyn Collectives, dp_g: &Group, part: &[f32], padded: usize| {
                let mut out = vec![0.0; padded];
                comm.all_gather(dp_g, part, &mut out).map(|_| out)
            };
            let (p, m, v) = match zero {
                0 => (unit.params.clone(), unit.m.clone(), unit.v.clone()),
                _ => {
                    let p = if zero >= 3 {
                        gather(&mut *self.comm, &unit.group, &unit.pshard, unit.padded)?
                    } else {
                        unit.params.clone()
                    };
                    let m = gather(&mut *self.comm, &unit.group, &unit.m, unit.padded)?;
                    let v = gather(&mut *self.comm, &unit.group, &unit.v, unit.padded)?;
                    (p, m, v)
                }
            };
            full.push([p, m, v]);
        }
        let topo = self.prep.topo;
        // Replica 0 of every stage and tensor-parallel rank holds everything but the other
        // expert indices' experts: the first rank of each expert index sends too.
        let exports = |r: usize, x: usize| (r == 0, topo.expert_index(r, x) < topo.ep);
        let (d, _, t) = self.coords;
        if self.rank != 0 {
            if exports(d, t) != (false, false) {
                for (i, bufs) in full.iter().enumerate() {
                    for (k, b) in bufs.iter().enumerate() {
                        self.comm.send(0, TAG_EXPORT | (i * 3 + k) as u64, b)?;
                    }
                }
            }
            return Ok(None);
        }
        let mut tensors: BTreeMap<String, TensorState> = BTreeMap::new();
        for (s, x, r) in (0..topo.pp)
            .flat_map(|s| (0..topo.tp).map(move |x| (s, x)))
            .flat_map(|(s, x)| (0..topo.replicas()).map(move |r| (s, x, r)))
        {
            let (dense, experts) = exports(r, x);
            if !dense && !experts {
                continue;
            }
            let rank = topo.rank(r, s, x);
            let (plans, _) = self.prep.plan_rank(rank);
            for (i, plan) in plans.iter().enumerate() {
                let n = if plan.experts {
                    topo.expert_replicas()
                } else {
                    topo.replicas()
                };
                let padded = if zero > 0 {
                    plan.len.div_ceil(n) * n
                } else {
                    plan.len
                };
                let bufs: [Vec<f32>; 3] = if rank == 0 {
                    std::mem::take(&mut full[i])
                } else {
                    let mut out: [Vec<f32>; 3] = Default::default();
                    for (k, o) in out.iter_mut().enumerate() {
                        *o = vec![0.0; padded];
                        self.comm
                            .recv(rank, TAG_EXPORT | (i * 3 + k) as u64, o, "state export")?;
                    }
                    out
                };
                for slot in &plan.slots {
                    if slot.tied_copy {
                        continue;
                    }
                    let n: usize = slot.global_shape.iter().product();
                    let e = tensors
                        .entry(slot.name.clone())
                        .or_insert_with(|| TensorState {
                            shape: slot.global_shape.clone(),
                            param: vec![0.0; n],
                            m: vec![0.0; n],
                            v: vec![0.0; n],
                        });
                    let keep = match slot.split {
                        Split::Experts => experts,
                        Split::Replicated | Split::Whole => dense && x == 0,
                        _ => dense,
                    };
                    if !keep {
                        continue;
                    }
                    let at = topo.part(r, x);
                    slot.place(&mut e.param, &bufs[0][slot.range.clone()], at);
                    slot.place(&mut e.m, &bufs[1][slot.range.clone()], at);
                    slot.place(&mut e.v, &bufs[2][slot.range.clone()], at);
                }
            }
        }
        Ok(Some(ModelState { step, tensors }))
    }
}
