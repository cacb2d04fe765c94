//! The `Plan`: a parallel layout of one model on one cluster, as JSON (`parallax-plan/1`).

use crate::dtype::{Fp8Recipe, Precision};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Schema tag of plan files.
pub const PLAN_SCHEMA: &str = "parallax-plan/1";

/// Activation recomputation policy.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(into = "String", try_from = "String")]
pub enum Recompute {
    /// Keep every activation.
    #[default]
    None,
    /// The stack's selective recomputation: the attention core and the cheap ops
    /// (Korthikanti et al. 2022), or the stack's own op-level policy (torchtitan's).
    Selective,
    /// Recompute the submodules Megatron-Core's `--recompute-modules` names (its selective
    /// granularity with an explicit list): `modules:moe_act+layernorm` inline.
    Modules(RecomputeModules),
    /// Keep only each layer's input; recompute the whole layer in backward.
    Full,
    /// [`Recompute::Full`] for every k-th layer (k ≥ 2), the others keeping everything: a 1/k
    /// share of full recomputation, `every:k` inline (torchtitan's layer-level selective
    /// checkpointing `selective_ac_option = k`, IBM fms-fsdp's `selective_checkpointing = 1/k`,
    /// Megatron's `--recompute-method block` over a k-th of each stage's layers).
    Every(u32),
}

impl Recompute {
    /// The policies every stack offers in some form, least recomputation first (named
    /// modules are Megatron-Core's).
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    /// Every how many-th layer is recomputed whole: 1 for full, k for every k-th (at least
    /// 1 however the variant was built), `None` where no layer is.
    pub fn whole_layer_period(self) -> Option<u32> {
        match self {
            Recompute::Full => Some(1),
            Recompute::Every(k) => Some(k.max(1)),
            _ => None,
        }
    }

    /// The share of layers recomputed whole: 1 for full, 1/k for every k-th, else 0.
    pub fn whole_layers(self) -> f64 {
        self.whole_layer_period()
            .map_or(0.0, |k| 1.0 / f64::from(k))
    }
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recompute::None => f.write_str("none"),
            Recompute::Selective => f.write_str("selective"),
            Recompute::Modules(m) => write!(f, "modules:{m}"),
            Recompute::Full => f.write_str("full"),
            Recompute::Every(k) => write!(f, "every:{k}"),
        }
    }
}

impl FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        if let Some(list) = lower.strip_prefix("modules:") {
            return list.parse().map(Recompute::Modules);
        }
        if let Some(k) = lower.strip_prefix("every:") {
            return match k.trim().parse::<u32>() {
                Ok(1) => Ok(Recompute::Full),
                Ok(k) if k >= 2 => Ok(Recompute::Every(k)),
                _ => Err(format!(
                    "recompute '{s}': every:K recomputes every K-th layer, K a whole number of at least 1"
                )),
            };
        }
        match lower.as_str() {
            "none" | "no" | "off" => Ok(Recompute::None),
            "selective" => Ok(Recompute::Selective),
            "full" => Ok(Recompute::Full),
            _ => Err(format!(
                "unknown recompute '{s}' (expected none, selective, full, every:K or modules:NAME+NAME…)"
            )),
        }
    }
}

/// `From<T> for String` and `TryFrom<String> for T` through `Display` and `FromStr`: what
/// `#[serde(into = "String", try_from = "String")]` needs of a type written as its text.
macro_rules! serde_as_text {
    ($t:ty) => {
        impl From<$t> for String {
            fn from(x: $t) -> String {
                x.to_string()
            }
        }

        impl TryFrom<String> for $t {
            type Error = String;
            fn try_from(s: String) -> Result<Self, String> {
                s.parse()
            }
        }
    };
}

serde_as_text!(Recompute);
serde_as_text!(RecomputeModules);

/// Pipeline schedule.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Schedule {
    /// No pipeline (pp = 1).
    #[default]
    #[serde(rename = "none")]
    None,
    /// All forwards, then all backwards (Huang et al. 2019).
    #[serde(rename = "gpipe")]
    GPipe,
    /// One-forward-one-backward (PipeDream-Flush, Narayanan et al. 2021).
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B over `interleave` virtual stages per device (Narayanan et al. 2021).
    #[serde(rename = "interleaved-1f1b")]
    Interleaved1F1B,
    /// Zero-bubble ZB-H1 (Qi et al. 2023): weight gradients fill the bubbles.
    #[serde(rename = "zb-h1")]
    ZeroBubbleH1,
    /// DualPipe (DeepSeek-AI 2024, DeepSeek-V3 report §3.2.1; deepseek-ai/DualPipe): half the
    /// micro-batches enter at each end of the pipeline, so every device holds two stages (its
    /// own and its mirror's: twice the parameters) and runs a forward of one direction merged
    /// with a backward of the other, their communication hidden behind each other's kernels.
    /// Needs an even pp and at least 2 × pp micro-batches, an even number.
    #[serde(rename = "dualpipe")]
    DualPipe,
}

impl Schedule {
    /// All schedules.
    pub const ALL: [Schedule; 6] = [
        Schedule::None,
        Schedule::GPipe,
        Schedule::OneFOneB,
        Schedule::Interleaved1F1B,
        Schedule::ZeroBubbleH1,
        Schedule::DualPipe,
    ];
    /// Name as written in plans and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::None => "none",
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved1F1B => "interleaved-1f1b",
            Schedule::ZeroBubbleH1 => "zb-h1",
            Schedule::DualPipe => "dualpipe",
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.to_ascii_lowercase();
        Schedule::ALL
            .into_iter()
            .find(|x| x.name() == s || (s == "interleaved" && *x == Schedule::Interleaved1F1B) || (s == "zero-bubble" && *x == Schedule::ZeroBubbleH1))
            .ok_or_else(|| format!("unknown schedule '{s}' (expected none, gpipe, 1f1b, interleaved-1f1b, zb-h1 or dualpipe)"))
    }
}

/// A set of Megatron-Core's recomputable submodules (`--recompute-modules`,
/// `megatron/core/transformer/transformer_config.py`), each matched to the nodes of a layer's
/// graph it covers. Written as the names joined by `+` (`moe_act+layernorm`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(into = "String", try_from = "String")]
pub struct RecomputeModules(u8);

impl RecomputeModules {
    /// The attention core (`core_attn`).
    pub const CORE_ATTN: RecomputeModules = RecomputeModules(1);
    /// The two norms of a layer, before attention and before the MLP (`layernorm`).
    pub const LAYERNORM: RecomputeModules = RecomputeModules(2);
    /// Multi-head latent attention's up projections and the rotary embedding applied after
    /// them (`mla_up_proj`).
    pub const MLA_UP_PROJ: RecomputeModules = RecomputeModules(4);
    /// A dense layer's MLP (`mlp`).
    pub const MLP: RecomputeModules = RecomputeModules(8);
    /// The whole MoE layer: router, dispatch, experts, combine, shared experts (`moe`).
    pub const MOE: RecomputeModules = RecomputeModules(16);
    /// The shared experts of an MoE layer (`shared_experts`).
    pub const SHARED_EXPERTS: RecomputeModules = RecomputeModules(32);
    /// The experts' activation (`moe_act`): inside the MoE op of the graph, whose saved
    /// activations it does not split; named so recipes read as written, priced as nothing.
    pub const MOE_ACT: RecomputeModules = RecomputeModules(64);

    const NAMES: [(&'static str, RecomputeModules); 7] = [
        ("core_attn", Self::CORE_ATTN),
        ("layernorm", Self::LAYERNORM),
        ("mla_up_proj", Self::MLA_UP_PROJ),
        ("mlp", Self::MLP),
        ("moe", Self::MOE),
        ("shared_experts", Self::SHARED_EXPERTS),
        ("moe_act", Self::MOE_ACT),
    ];

    /// The set of `names` as Megatron-Core spells them; an unknown name is the error.
    pub fn parse(names: &[&str]) -> Result<RecomputeModules, String> {
        names.iter().try_fold(RecomputeModules(0), |set, n| {
            Self::NAMES
                .iter()
                .find(|(name, _)| name == n)
                .map(|(_, m)| set | *m)
                .ok_or_else(|| {
                    let known: Vec<&str> = Self::NAMES.iter().map(|(n, _)| *n).collect();
                    format!(
                        "unknown recompute module '{n}' (known: {})",
                        known.join(", ")
                    )
                })
        })
    }

    /// The names of the set, in Megatron-Core's order.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        Self::NAMES
            .into_iter()
            .filter(move |(_, m)| self.contains(*m))
            .map(|(n, _)| n)
    }

    /// The set without `m`.
    pub fn without(self, m: RecomputeModules) -> RecomputeModules {
        RecomputeModules(self.0 & !m.0)
    }

    pub fn contains(self, m: RecomputeModules) -> bool {
        self.0 & m.0 == m.0 && m.0 != 0
    }

    /// Whether node `name` of a layer (`layers.N.…`, as [`crate::models`] names them)
    /// belongs to a module of the set.
    pub fn covers(self, name: &str) -> bool {
        let part = name.splitn(3, '.').nth(2).unwrap_or(name);
        let attn = part.strip_prefix("attn.");
        (self.contains(Self::CORE_ATTN) && part == "attn.core")
            || (self.contains(Self::LAYERNORM) && (part == "attn_norm" || part == "mlp_norm"))
            || (self.contains(Self::MLA_UP_PROJ)
                && attn.is_some_and(|a| {
                    a.starts_with("q_up")
                        || a.starts_with("kv_up")
                        || a.starts_with("q_heads")
                        || a.contains("rope")
                        || a.starts_with("kv_heads")
                        || a.starts_with("k_nope")
                        || a.starts_with("v_heads")
                        || a == "k"
                }))
            || (self.contains(Self::MLP) && part.starts_with("mlp.") && part != "mlp.residual")
            || (self.contains(Self::MOE) && (part == "moe" || part.starts_with("moe.")))
            || ((self.contains(Self::MOE) || self.contains(Self::SHARED_EXPERTS))
                && part.starts_with("shared."))
    }
}

impl std::ops::BitOr for RecomputeModules {
    type Output = RecomputeModules;
    fn bitor(self, o: RecomputeModules) -> RecomputeModules {
        RecomputeModules(self.0 | o.0)
    }
}

impl fmt::Display for RecomputeModules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.names().collect();
        f.write_str(&names.join("+"))
    }
}

impl FromStr for RecomputeModules {
    type Err = String;
    /// `name+name…` (commas would split an inline plan); at least one name.
    fn from_str(s: &str) -> Result<Self, String> {
        let names: Vec<&str> = s
            .split('+')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            return Err("modules: name at least one of Megatron-Core's recompute modules".into());
        }
        RecomputeModules::parse(&names)
    }
}

/// What lives in host memory rather than on the device (ZeRO-Offload, ZeRO-Infinity, FSDP CPU
/// offload).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// Everything on the device.
    #[default]
    None,
    /// Optimizer states and fp32 master weights on the host, the optimizer step on its CPUs
    /// (ZeRO-Offload, Ren et al. 2021: gradients go down, updated 16-bit weights come back).
    Optimizer,
    /// Optimizer offload plus the 16-bit parameters themselves, fetched layer by layer for
    /// forward and backward (ZeRO-Infinity's `offload_param`, FSDP `CPUOffload(params)`);
    /// needs ZeRO-3.
    Params,
    /// As [`Offload::Optimizer`], the optimizer states kept on the node's NVMe instead of in
    /// host memory: swapped in for the step on the host's CPUs and out after it
    /// (ZeRO-Infinity, Rajbhandari et al. 2021: `offload_optimizer.device = "nvme"`, which
    /// DeepSpeed's stage-3 optimizer alone implements); needs ZeRO-3.
    #[serde(rename = "optimizer-nvme")]
    OptimizerNvme,
    /// As [`Offload::Params`], optimizer states and 16-bit parameters on the node's NVMe: each
    /// layer's parameters read from it before forward and backward, written back after the
    /// step (ZeRO-Infinity: `offload_param.device = "nvme"`); needs ZeRO-3.
    #[serde(rename = "params-nvme")]
    ParamsNvme,
}

impl Offload {
    /// All settings, none first, then in the order the search tries them when memory binds:
    /// host memory before NVMe, the optimizer before the parameters.
    pub const ALL: [Offload; 5] = [
        Offload::None,
        Offload::Optimizer,
        Offload::Params,
        Offload::OptimizerNvme,
        Offload::ParamsNvme,
    ];

    /// Whether the 16-bit parameters leave the device (fetched layer by layer).
    pub fn params(self) -> bool {
        matches!(self, Offload::Params | Offload::ParamsNvme)
    }

    /// Whether the offloaded states live on NVMe rather than in host memory.
    pub fn nvme(self) -> bool {
        matches!(self, Offload::OptimizerNvme | Offload::ParamsNvme)
    }

    /// Why this offload cannot go with ZeRO stage `zero`, if it cannot: ZeRO-Offload
    /// partitions what it offloads (stage 1 or more), and parameters are fetched like ZeRO-3's
    /// gathers.
    pub fn conflict(self, zero: u8) -> Option<String> {
        match self {
            Offload::Optimizer if zero == 0 => Some(format!(
                "offload {self} needs zero 1, 2 or 3 (ZeRO-Offload partitions what it offloads)"
            )),
            Offload::OptimizerNvme if zero != 3 => Some(format!(
                "offload {self} needs zero 3 (DeepSpeed swaps optimizer states to NVMe in its stage-3 optimizer only), not zero {zero}"
            )),
            Offload::Params | Offload::ParamsNvme if zero != 3 => Some(format!(
                "offload {self} needs zero 3 (parameters are fetched like ZeRO-3's gathers), not zero {zero}"
            )),
            _ => None,
        }
    }

    /// Name as written in plans and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Params => "params",
            Offload::OptimizerNvme => "optimizer-nvme",
            Offload::ParamsNvme => "params-nvme",
        }
    }

    fn is_none(&self) -> bool {
        *self == Offload::None
    }
}

/// Where BatchNorm under a sample split takes its statistics from (per-op plans).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum BatchNormStats {
    /// The whole micro-batch's, as one device computes them: the devices of the sample split
    /// all-reduce per-channel sums (synchronised BatchNorm, PyTorch's `SyncBatchNorm`): what
    /// `parallax run` does unless told otherwise, so a split plan trains as one device does.
    #[default]
    Sync,
    /// Each device's own samples' (PyTorch's `BatchNorm2d` under DDP, TensorFlow's per-tower
    /// batch norm): no communication, statistics of the per-device batch.
    Local,
}

impl BatchNormStats {
    /// Name as written in plans and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            BatchNormStats::Sync => "sync",
            BatchNormStats::Local => "local",
        }
    }

    pub fn is_sync(&self) -> bool {
        *self == BatchNormStats::Sync
    }
}

impl fmt::Display for BatchNormStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BatchNormStats {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "sync" | "synchronised" | "synchronized" | "global" => Ok(BatchNormStats::Sync),
            "local" => Ok(BatchNormStats::Local),
            other => Err(format!(
                "unknown batch-norm statistics '{other}' (expected sync or local)"
            )),
        }
    }
}

/// How an MoE layer's dispatcher moves routed tokens between expert-parallel ranks.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Dispatcher {
    /// One all-to-all of every routed copy (Megatron-Core's `alltoall` dispatcher).
    #[default]
    AllToAll,
    /// Node-deduplicated (DeepEP, Megatron-Core's `flex` dispatcher): a token crosses the
    /// network once per remote node its experts sit on, then fans out over NVLink.
    DeepEp,
}

impl Dispatcher {
    /// Name as written in plans and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Dispatcher::AllToAll => "alltoall",
            Dispatcher::DeepEp => "deepep",
        }
    }

    pub fn is_all_to_all(&self) -> bool {
        *self == Dispatcher::AllToAll
    }
}

impl fmt::Display for Dispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dispatcher {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "alltoall" | "all-to-all" | "a2a" => Ok(Dispatcher::AllToAll),
            "deepep" | "flex" => Ok(Dispatcher::DeepEp),
            other => Err(format!(
                "unknown dispatcher '{other}' (expected alltoall or deepep)"
            )),
        }
    }
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Offload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.to_ascii_lowercase();
        Offload::ALL
            .into_iter()
            .find(|x| x.name() == s || (s == "cpu" && *x == Offload::Optimizer))
            .ok_or_else(|| {
                format!(
                    "unknown offload '{s}' (expected none, optimizer, params, optimizer-nvme or params-nvme)"
                )
            })
    }
}

/// Layers held by one pipeline stage (per virtual chunk when interleaved, in order).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageRange {
    /// First block index.
    pub first_layer: u32,
    /// One past the last block index.
    pub end_layer: u32,
    /// Holds the embeddings.
    #[serde(default)]
    pub embedding: bool,
    /// Holds the final norm, LM head and loss.
    #[serde(default)]
    pub head: bool,
}

/// A parallel layout: degrees and settings of the structured (transformer) space.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    pub dp: u32,
    pub tp: u32,
    pub pp: u32,
    pub cp: u32,
    /// Expert parallelism: the ranks an MoE layer's experts are spread over. With
    /// [`Layout::etp`] it is carved out of each stage's dp × cp × tp ranks (Megatron-Core's
    /// MoE parallel folding): ep × etp divides dp × cp × tp, and the rest of those ranks
    /// replicate the experts (the expert-data-parallel group, [`Layout::expert_dp`]).
    pub ep: u32,
    /// Expert tensor parallelism: how many ranks split each expert's FFN width. Absent: tp
    /// (Megatron-Core's default), which keeps the experts inside the tensor-parallel region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etp: Option<u32>,
    /// The MoE token dispatcher (absent in a plan file: all-to-all).
    #[serde(default, skip_serializing_if = "Dispatcher::is_all_to_all")]
    pub dispatcher: Dispatcher,
    /// The expert-parallel dispatch of one micro-batch runs beside the computation of another:
    /// each steady-state forward is merged with a backward, the dispatch and combine of one
    /// hidden behind the other's kernels (Megatron-Core's `--overlap-moe-expert-parallel-comm`
    /// with `--delay-wgrad-compute`, the combined 1F1B schedule; DeepSeek-V3's overlap).
    /// Needs ep > 1, no full recompute, and with pp > 1 the interleaved schedule
    /// ([`Layout::ep_overlap_conflict`]). Absent in a plan file: off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ep_overlap: bool,
    /// 0 plain data parallel, 1 optimizer states sharded, 2 + gradients, 3 + parameters.
    pub zero_stage: u8,
    /// Sequences per micro-batch per data-parallel rank.
    pub micro_batch: u64,
    pub recompute: Recompute,
    pub sequence_parallel: bool,
    pub schedule: Schedule,
    /// Virtual stages per device (interleaved 1F1B); 1 otherwise.
    pub interleave: u32,
    /// Model states kept in host memory (absent in a plan file: none).
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
    /// Stage → layer ranges; `pp × interleave` entries in pipeline order, or empty for an even
    /// split chosen by the tool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageRange>,
    /// BatchNorm statistics under sample splits (per-op plans; absent in a plan file: sync).
    #[serde(default, skip_serializing_if = "BatchNormStats::is_sync")]
    pub batch_norm: BatchNormStats,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
            etp: None,
            dispatcher: Dispatcher::AllToAll,
            ep_overlap: false,
            zero_stage: 0,
            micro_batch: 1,
            recompute: Recompute::None,
            sequence_parallel: false,
            schedule: Schedule::None,
            interleave: 1,
            offload: Offload::None,
            stages: Vec::new(),
            batch_norm: BatchNormStats::Sync,
        }
    }
}

/// The most micro-batches one optimizer step of a replica may have: each is simulated, and
/// published runs use at most a few hundred.
pub const MAX_MICRO_BATCHES: u64 = 1 << 16;

impl Layout {
    /// Devices the layout occupies: dp × tp × pp × cp.
    pub fn devices(&self) -> u64 {
        // Saturating: degrees read from a file may be anything up to u32::MAX each.
        [self.tp, self.pp, self.cp]
            .iter()
            .fold(u64::from(self.dp), |n, &d| n.saturating_mul(u64::from(d)))
    }

    /// Expert tensor parallelism: [`Layout::etp`], or tp where it is not given.
    pub fn expert_tp(&self) -> u32 {
        self.etp.unwrap_or(self.tp)
    }

    /// Ranks of a stage that hold the same experts (Megatron's expert-data-parallel group):
    /// dp × cp × tp / (ep × etp). Gradients of expert weights are reduced, and ZeRO shards
    /// their states, over these.
    pub fn expert_dp(&self) -> u32 {
        // In u128: three degrees read from a file may each be up to u32::MAX.
        let ranks = u128::from(self.dp) * u128::from(self.cp) * u128::from(self.tp);
        let experts = u128::from(self.ep) * u128::from(self.expert_tp());
        u32::try_from(ranks / experts.max(1))
            .unwrap_or(u32::MAX)
            .max(1)
    }

    /// Why [`Layout::ep_overlap`] cannot be on in this layout (Megatron-Core's checks in
    /// `TransformerConfig.__post_init__`), or `None` when it can.
    pub fn ep_overlap_conflict(&self) -> Option<String> {
        if self.ep <= 1 {
            Some("ep_overlap needs expert parallelism (ep > 1)".into())
        } else if self.recompute.whole_layers() > 0.0 {
            Some("ep_overlap cannot be combined with full recompute".into())
        } else if self.pp > 1
            && !matches!(
                self.schedule,
                Schedule::Interleaved1F1B | Schedule::DualPipe
            )
        {
            Some(format!(
                "ep_overlap with pp > 1 needs the interleaved-1f1b (or dualpipe) schedule, not {}",
                self.schedule
            ))
        } else {
            None
        }
    }

    /// Whether a forward and a backward of different micro-batches run merged, each hiding
    /// the other's expert dispatch: asked for ([`Layout::ep_overlap`]), or DualPipe's way.
    pub fn merges_passes(&self) -> bool {
        self.ep_overlap || self.schedule == Schedule::DualPipe
    }

    /// Micro-batches per step per pipeline for a global batch.
    pub fn micro_batches(&self, global_batch: u64) -> u64 {
        global_batch / u64::from(self.dp).saturating_mul(self.micro_batch.max(1))
    }

    /// Checks internal consistency for a global batch; one line naming the field.
    pub fn validate(&self, global_batch: u64, layers: Option<u32>) -> Result<(), String> {
        for (k, v) in [
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("etp", self.expert_tp()),
            ("interleave", self.interleave),
        ] {
            if v == 0 {
                return Err(format!("layout.{k} must be at least 1"));
            }
        }
        if self.micro_batch == 0 {
            return Err("layout.micro_batch must be at least 1".into());
        }
        if self.zero_stage > 3 {
            return Err(format!(
                "layout.zero_stage {} must be 0..=3",
                self.zero_stage
            ));
        }
        // In u128, as in `expert_dp`.
        let ranks = u128::from(self.dp) * u128::from(self.cp) * u128::from(self.tp);
        let experts = u128::from(self.ep) * u128::from(self.expert_tp());
        if ranks % experts != 0 {
            return Err(format!(
                "layout.ep {} × etp {} must divide dp × cp × tp = {ranks}",
                self.ep,
                self.expert_tp()
            ));
        }
        let per_step = u64::from(self.dp).saturating_mul(self.micro_batch);
        if global_batch % per_step != 0 {
            return Err(format!(
                "global batch {global_batch} is not a multiple of dp × micro_batch = {per_step}"
            ));
        }
        let m = global_batch / per_step;
        if m > MAX_MICRO_BATCHES {
            return Err(format!(
                "{m} micro-batches per data-parallel replica is beyond what is simulated (at most {MAX_MICRO_BATCHES}): raise the micro-batch size"
            ));
        }
        if self.pp == 1 && !matches!(self.schedule, Schedule::None) && self.interleave > 1 {
            return Err("layout.interleave > 1 needs pp > 1".into());
        }
        if self.pp > 1 && self.schedule == Schedule::None {
            return Err("layout.schedule must name a pipeline schedule when pp > 1".into());
        }
        if self.schedule == Schedule::DualPipe && self.pp > 1 {
            if self.pp % 2 != 0 {
                return Err(format!(
                    "layout.schedule dualpipe needs an even pp, not {}",
                    self.pp
                ));
            }
            if m % 2 != 0 || m < 2 * u64::from(self.pp) {
                return Err(format!(
                    "layout.schedule dualpipe needs an even number of micro-batches, at least 2 × pp = {}; this batch gives {m}",
                    2 * u64::from(self.pp)
                ));
            }
        }
        if self.interleave > 1 && self.schedule != Schedule::Interleaved1F1B {
            return Err(format!(
                "layout.interleave {} needs schedule interleaved-1f1b, not {}",
                self.interleave, self.schedule
            ));
        }
        if self.ep_overlap {
            if let Some(why) = self.ep_overlap_conflict() {
                return Err(format!("layout.{why}"));
            }
        }
        if let Some(l) = layers {
            // In u64: degrees read from a file may be anything up to u32::MAX each.
            let chunks = u64::from(self.pp) * u64::from(self.interleave);
            if chunks > u64::from(l) {
                return Err(format!(
                    "pp × interleave = {chunks} exceeds the model's {l} layers"
                ));
            }
            let chunks = chunks as u32;
            if !self.stages.is_empty() {
                if self.stages.len() as u32 != chunks {
                    return Err(format!(
                        "layout.stages has {} entries, pp × interleave = {chunks}",
                        self.stages.len()
                    ));
                }
                let mut next = 0;
                let last = self.stages.len() - 1;
                for (i, s) in self.stages.iter().enumerate() {
                    // The last may be empty: the head and prediction modules alone (Megatron's
                    // layouts for DeepSeek-V3).
                    let empty_ok = i == last && i > 0;
                    if s.first_layer != next
                        || s.end_layer < s.first_layer
                        || (s.end_layer == s.first_layer && !empty_ok)
                    {
                        return Err(format!(
                            "layout.stages[{i}] covers {}..{}, expected to start at {next} and be non-empty",
                            s.first_layer, s.end_layer
                        ));
                    }
                    next = s.end_layer;
                }
                if next != l {
                    return Err(format!(
                        "layout.stages end at layer {next}, the model has {l}"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Per-op configuration for general (non-transformer) graphs: one degree per label of the op's
/// axes mapping, in label order (1 for a label not split), and the devices it runs on, in the
/// order of its view's positions (a start and a constant stride).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpConfig {
    pub node: String,
    pub degrees: Vec<u32>,
    pub devices: Vec<u32>,
}

/// Which model a plan is for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRef {
    /// A zoo name, or the path of the file the model was read from.
    pub name: String,
}

/// Which cluster a plan is for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterRef {
    /// `PRESET:gpus=N` or a profile path.
    pub spec: String,
    pub gpus: u32,
}

/// Training settings.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Training {
    /// Sequences per optimizer step.
    pub global_batch: u64,
    pub seq_len: u64,
    pub precision: Precision,
    /// How fp8 casts are scaled (fp8 only; absent: the stack's own recipe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_recipe: Option<Fp8Recipe>,
    /// Tensor-parallel collectives micro-pipelined with their GEMMs (PyTorch's asynchronous
    /// TP, torchtitan's `enable_async_tensor_parallel`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub async_tp: bool,
    /// The module code compiled (`torch.compile`; `--compile`) on a stack whose code is
    /// otherwise eager.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compile: bool,
    /// A mixture's token dropping, as the plan was made with it
    /// ([`crate::models::MoeConfig::capacity_permille`]; absent: dropless).
    #[serde(default, skip_serializing_if = "crate::models::transformer::is_zero")]
    pub capacity_permille: u32,
    /// Experts padded to their capacity ([`crate::models::MoeConfig::pad_to_capacity`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pad_to_capacity: bool,
}

/// A prediction attached to a plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prediction {
    pub step_time_s: f64,
    pub step_time_s_low: f64,
    pub step_time_s_high: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    /// Peak of the live tensors per device (PyTorch's `max_memory_allocated`), GiB.
    pub peak_memory_gib: f64,
    /// Peak the caching allocator reserves (`max_memory_reserved`), GiB: what must fit. Plans
    /// written before it was reported read 0.
    #[serde(default)]
    pub reserved_memory_gib: f64,
    /// The reserved peak fits in the device.
    pub fits: bool,
    /// The software stack the prediction models (`name@version`, see `parallax frameworks`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framework: Option<String>,
}

/// A complete plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub schema: String,
    pub model: ModelRef,
    pub cluster: ClusterRef,
    pub training: Training,
    pub layout: Layout,
    /// Per-op configurations of a general graph, one per node in node order; empty for the
    /// structured (transformer) layouts. With them, `layout` summarises: `pp` pipeline stages,
    /// `dp` the devices of one stage, `recompute = full` for stages that recompute their
    /// forward, `schedule` the pipeline schedule.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub op_configs: Vec<OpConfig>,
    /// Micro-batches per step of a per-op plan (its graph is built at `global_batch /
    /// micro_batches` samples).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batches: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prediction: Option<Prediction>,
}

impl Plan {
    /// Parses a plan document; `origin` names the file in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Plan, String> {
        let plan: Plan = serde_json::from_str(text).map_err(|e| {
            format!(
                "{origin}: line {} column {}: {}",
                e.line(),
                e.column(),
                json_message(&e)
            )
        })?;
        if plan.schema != PLAN_SCHEMA {
            return Err(format!(
                "{origin}: schema: expected \"{PLAN_SCHEMA}\", found \"{}\"",
                plan.schema
            ));
        }
        let t = &plan.training;
        if !(1..=crate::load::MAX_GLOBAL_BATCH).contains(&t.global_batch) {
            return Err(format!(
                "{origin}: training.global_batch: {} is not in 1..={}",
                t.global_batch,
                crate::load::MAX_GLOBAL_BATCH
            ));
        }
        if !(1..=crate::load::MAX_SEQ).contains(&t.seq_len) {
            return Err(format!(
                "{origin}: training.seq_len: {} is not in 1..={}",
                t.seq_len,
                crate::load::MAX_SEQ
            ));
        }
        if plan.op_configs.is_empty() {
            plan.layout
                .validate(plan.training.global_batch, None)
                .map_err(|e| format!("{origin}: {e}"))?;
        } else if let Some(m) = plan.micro_batches {
            if m == 0 || plan.training.global_batch % u64::from(m) != 0 {
                return Err(format!(
                    "{origin}: micro_batches: {m} does not divide global_batch {}",
                    plan.training.global_batch
                ));
            }
        }
        if plan.layout.devices() != u64::from(plan.cluster.gpus) {
            return Err(format!(
                "{origin}: layout uses dp×tp×pp×cp = {} devices but cluster.gpus is {}",
                plan.layout.devices(),
                plan.cluster.gpus
            ));
        }
        Ok(plan)
    }

    /// Pretty JSON; deterministic (fields in declaration order).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// A serde_json error's message without the " at line L column C" it appends: callers print
/// the position themselves, after the file name.
pub fn json_message(e: &serde_json::Error) -> String {
    let msg = e.to_string();
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg,
    }
}

/// A layout given inline (`tp=8,pp=8,dp=16,zero=1,mb=1,recompute=selective,sp=true,
/// schedule=interleaved-1f1b,v=2`); keys left out are `None`, for the tool to choose.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartialLayout {
    pub dp: Option<u32>,
    pub tp: Option<u32>,
    pub pp: Option<u32>,
    pub cp: Option<u32>,
    pub ep: Option<u32>,
    /// Expert tensor parallelism; open: the tool chooses (tp or less).
    pub etp: Option<u32>,
    /// The MoE token dispatcher; open: the tool chooses.
    pub dispatcher: Option<Dispatcher>,
    /// Expert-parallel dispatch overlapped with another micro-batch's compute; open: the
    /// tool chooses.
    pub ep_overlap: Option<bool>,
    pub zero_stage: Option<u8>,
    pub micro_batch: Option<u64>,
    pub recompute: Option<Recompute>,
    pub sequence_parallel: Option<bool>,
    pub schedule: Option<Schedule>,
    pub interleave: Option<u32>,
    pub offload: Option<Offload>,
    /// BatchNorm statistics (per-op plans only).
    pub batch_norm: Option<BatchNormStats>,
}

/// A complete layout as a partial one with every knob fixed (its stages are the completion's
/// to derive).
impl From<&Layout> for PartialLayout {
    fn from(l: &Layout) -> Self {
        PartialLayout {
            dp: Some(l.dp),
            tp: Some(l.tp),
            pp: Some(l.pp),
            cp: Some(l.cp),
            ep: Some(l.ep),
            etp: l.etp,
            dispatcher: Some(l.dispatcher),
            ep_overlap: Some(l.ep_overlap),
            zero_stage: Some(l.zero_stage),
            micro_batch: Some(l.micro_batch),
            recompute: Some(l.recompute),
            sequence_parallel: Some(l.sequence_parallel),
            schedule: Some(l.schedule),
            interleave: Some(l.interleave),
            offload: Some(l.offload),
            batch_norm: Some(l.batch_norm),
        }
    }
}

impl PartialLayout {
    /// The sequence-parallel settings a completion with `tp` may take: the given one, or both
    /// where tensor parallelism is on (without it there is nothing to split).
    pub fn sequence_parallel_options(&self, tp: u32) -> Vec<bool> {
        match self.sequence_parallel {
            Some(s) => vec![s],
            None if tp > 1 => vec![true, false],
            None => vec![false],
        }
    }

    /// Refuses the keys of per-op plans only, for a transformer's structured layout.
    pub fn check_transformer(&self) -> Result<(), String> {
        match self.batch_norm {
            Some(_) => Err("bn: BatchNorm statistics are a knob of per-op plans; a transformer layout has no BatchNorm".into()),
            None => Ok(()),
        }
    }

    /// [`PartialLayout::parse`] of a transformer's layout: per-op keys refused.
    pub fn parse_transformer(s: &str) -> Result<Self, String> {
        let p = Self::parse(s)?;
        p.check_transformer()?;
        Ok(p)
    }

    /// Parses the inline form. Errors name the key.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut p = PartialLayout::default();
        let mut seen: Vec<String> = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("'{item}' is not key=value"))?;
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            let canonical = match k.as_str() {
                "interleave" | "vp" => "v",
                "micro_batch" => "mb",
                "zero_stage" => "zero",
                "sequence_parallel" => "sp",
                "batch_norm" => "bn",
                "a2a_overlap" => "ep_overlap",
                other => other,
            }
            .to_string();
            if seen.contains(&canonical) {
                return Err(format!("{canonical} given twice"));
            }
            let num = |what: &str| -> Result<u64, String> {
                let n: u64 = v
                    .parse()
                    .map_err(|_| format!("{what}: '{v}' is not a positive integer"))?;
                if n == 0 {
                    return Err(format!("{what}: must be at least 1"));
                }
                Ok(n)
            };
            let small = |what: &str| -> Result<u32, String> {
                u32::try_from(num(what)?).map_err(|_| format!("{what}: '{v}' is too large"))
            };
            let flag = |what: &str| -> Result<bool, String> {
                match v.to_ascii_lowercase().as_str() {
                    "true" | "1" | "yes" | "on" => Ok(true),
                    "false" | "0" | "no" | "off" => Ok(false),
                    _ => Err(format!("{what}: '{v}' is not true or false")),
                }
            };
            match k.as_str() {
                "dp" => p.dp = Some(small("dp")?),
                "tp" => p.tp = Some(small("tp")?),
                "pp" => p.pp = Some(small("pp")?),
                "cp" => p.cp = Some(small("cp")?),
                "ep" => p.ep = Some(small("ep")?),
                "etp" => p.etp = Some(small("etp")?),
                "dispatcher" => {
                    p.dispatcher = Some(v.parse().map_err(|e| format!("dispatcher: {e}"))?)
                }
                "v" | "interleave" | "vp" => p.interleave = Some(small("interleave")?),
                "mb" | "micro_batch" => p.micro_batch = Some(num("micro_batch")?),
                "zero" | "zero_stage" => {
                    let z: u8 = v
                        .parse()
                        .ok()
                        .filter(|z| *z <= 3)
                        .ok_or_else(|| format!("zero: '{v}' must be 0, 1, 2 or 3"))?;
                    p.zero_stage = Some(z);
                }
                "recompute" => p.recompute = Some(v.parse()?),
                "sp" | "sequence_parallel" => p.sequence_parallel = Some(flag("sp")?),
                "ep_overlap" | "a2a_overlap" => p.ep_overlap = Some(flag("ep_overlap")?),
                "schedule" => p.schedule = Some(v.parse()?),
                "offload" => p.offload = Some(v.parse()?),
                "bn" | "batch_norm" => p.batch_norm = Some(v.parse().map_err(|e| format!("bn: {e}"))?),
                _ => {
                    return Err(format!(
                        "unknown key '{k}' (expected dp, tp, pp, cp, ep, etp, dispatcher, ep_overlap, zero, mb, recompute, sp, schedule, v, offload, bn)"
                    ))
                }
            }
            seen.push(canonical);
        }
        if let Some(v) = p.interleave.filter(|&v| v > 1) {
            if p.pp.unwrap_or(1) == 1 {
                return Err(format!("v={v} needs pp > 1 (give pp too)"));
            }
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        Plan {
            schema: PLAN_SCHEMA.into(),
            model: ModelRef {
                name: "gpt3-175b".into(),
            },
            cluster: ClusterRef {
                spec: "dgx-a100-80gb:gpus=1024".into(),
                gpus: 1024,
            },
            training: Training {
                global_batch: 1536,
                seq_len: 2048,
                precision: Precision::Bf16,
                fp8_recipe: None,
                async_tp: false,
                compile: false,
                capacity_permille: 0,
                pad_to_capacity: false,
            },
            layout: Layout {
                dp: 16,
                tp: 8,
                pp: 8,
                micro_batch: 1,
                recompute: Recompute::Selective,
                sequence_parallel: true,
                schedule: Schedule::Interleaved1F1B,
                interleave: 2,
                stages: (0..16)
                    .map(|i| StageRange {
                        first_layer: i * 6,
                        end_layer: i * 6 + 6,
                        embedding: i == 0,
                        head: i == 15,
                    })
                    .collect(),
                ..Layout::default()
            },
            op_configs: vec![OpConfig {
                node: "fc1".into(),
                degrees: vec![2, 1, 4],
                devices: (0..8).collect(),
            }],
            micro_batches: None,
            prediction: Some(Prediction {
                step_time_s: 12.5,
                step_time_s_low: 12.0,
                step_time_s_high: 13.1,
                tokens_per_s: 251_658.24,
                mfu: 0.52,
                peak_memory_gib: 61.2,
                reserved_memory_gib: 65.5,
                fits: true,
                framework: None,
            }),
        }
    }

    #[test]
    fn left_out_sequence_parallelism_opens_both_where_tp_splits() {
        let open = PartialLayout::default();
        assert_eq!(open.sequence_parallel_options(1), vec![false]);
        assert_eq!(open.sequence_parallel_options(8), vec![true, false]);
        let given = PartialLayout::parse("sp=false").unwrap();
        assert_eq!(given.sequence_parallel_options(8), vec![false]);
    }

    #[test]
    fn plan_round_trips_through_json() {
        let p = plan();
        let text = p.to_json();
        assert!(text.contains("\"schema\": \"parallax-plan/1\""));
        assert!(text.contains("\"schedule\": \"interleaved-1f1b\""));
        let back = Plan::from_json(&text, "p.json").unwrap();
        assert_eq!(back, p);
        assert_eq!(back.to_json(), text);
        back.layout.validate(1536, Some(96)).unwrap();
    }

    #[test]
    fn bad_plans_name_the_problem() {
        let mut p = plan();
        p.schema = "other/2".into();
        assert!(Plan::from_json(&p.to_json(), "x.json")
            .unwrap_err()
            .contains("schema"));
        let mut p = plan();
        p.cluster.gpus = 512;
        assert!(Plan::from_json(&p.to_json(), "x.json")
            .unwrap_err()
            .contains("cluster.gpus"));
        let text = plan()
            .to_json()
            .replace("\"tp\": 8", "\"tp\": 8, \"tensor\": 2");
        let e = Plan::from_json(&text, "x.json").unwrap_err();
        assert!(e.starts_with("x.json: line") && e.contains("tensor"), "{e}");
        let mut l = plan().layout;
        l.stages[3].end_layer += 1;
        assert!(l
            .validate(1536, Some(96))
            .unwrap_err()
            .contains("stages[4]"));
        assert!(l.validate(1000, None).unwrap_err().contains("multiple"));
    }

    /// A complete layout fixes every knob of a partial one: the same as its inline form
    /// parses to, where that names them.
    #[test]
    fn a_layout_fixes_every_knob() {
        let p = PartialLayout::parse(
            "dp=4,tp=8,pp=4,cp=2,ep=2,zero=1,mb=2,recompute=full,sp=true,schedule=interleaved-1f1b,v=2,offload=optimizer",
        )
        .unwrap();
        let l = Layout {
            dp: 4,
            tp: 8,
            pp: 4,
            cp: 2,
            ep: 2,
            zero_stage: 1,
            micro_batch: 2,
            recompute: Recompute::Full,
            sequence_parallel: true,
            schedule: Schedule::Interleaved1F1B,
            interleave: 2,
            offload: Offload::Optimizer,
            ..Layout::default()
        };
        let fixed = PartialLayout::from(&l);
        assert_eq!(
            PartialLayout {
                etp: None,
                dispatcher: None,
                ep_overlap: None,
                batch_norm: None,
                ..fixed.clone()
            },
            p
        );
        assert_eq!(fixed.dispatcher, Some(l.dispatcher));
        assert_eq!(fixed.batch_norm, Some(l.batch_norm));
    }

    #[test]
    fn inline_layouts_parse_and_reject_nonsense() {
        let p = PartialLayout::parse("tp=8,pp=8,dp=16,cp=1,zero=1,mb=1,recompute=selective,sp=true,schedule=interleaved-1f1b,v=2").unwrap();
        assert_eq!(p.tp, Some(8));
        assert_eq!(p.schedule, Some(Schedule::Interleaved1F1B));
        assert_eq!(p.interleave, Some(2));
        assert_eq!(p.ep, None);
        let dual = PartialLayout::parse("pp=16,schedule=dualpipe").unwrap();
        assert_eq!(dual.schedule, Some(Schedule::DualPipe));
        let l = Layout {
            dp: 4,
            pp: 16,
            schedule: Schedule::DualPipe,
            ..Layout::default()
        };
        l.validate(128, Some(64)).unwrap();
        let e = l.validate(64, Some(64)).unwrap_err();
        assert!(e.contains("at least 2 × pp = 32"), "{e}");
        let e = Layout { pp: 5, ..l.clone() }
            .validate(240, Some(60))
            .unwrap_err();
        assert!(e.contains("dualpipe needs an even pp, not 5"), "{e}");
        // Degrees near u32::MAX are errors, not overflows (fuzzing found both).
        let huge = Layout {
            pp: u32::MAX - 1,
            ..l
        };
        assert!(huge
            .validate(128, Some(64))
            .unwrap_err()
            .contains("dualpipe"));
        let interleaved = Layout {
            pp: 1 << 20,
            interleave: 1 << 20,
            schedule: Schedule::Interleaved1F1B,
            ..Layout::default()
        };
        let e = interleaved.validate(1 << 16, Some(64)).unwrap_err();
        assert!(e.contains("exceeds the model's 64 layers"), "{e}");
        // dp × cp × tp beyond u64 (a fuzzed plan file): an error naming ep, not an overflow.
        let wide = Layout {
            dp: u32::MAX,
            cp: u32::MAX,
            tp: u32::MAX,
            ep: 2,
            etp: Some(1),
            ..Layout::default()
        };
        let e = wide.validate(128, Some(64)).unwrap_err();
        assert!(e.contains("layout.ep 2 × etp 1 must divide"), "{e}");
        assert_eq!(wide.expert_dp(), u32::MAX);
        for bad in [
            "tp=0",
            "tp=x",
            "zero=4",
            "foo=1",
            "tp",
            "sp=maybe",
            "schedule=fast",
            "recompute=half",
        ] {
            assert!(PartialLayout::parse(bad).is_err(), "{bad}");
        }
    }

    /// Every k-th layer: `every:k` inline and in plan files, `every:1` is full, a share of
    /// 1/k; nothing else.
    #[test]
    fn recompute_every_kth_layer_parses_and_round_trips() {
        let p = PartialLayout::parse("dp=8,recompute=every:2").unwrap();
        assert_eq!(p.recompute, Some(Recompute::Every(2)));
        assert_eq!(Recompute::Every(3).to_string(), "every:3");
        assert_eq!("every:1".parse::<Recompute>().unwrap(), Recompute::Full);
        assert_eq!(Recompute::Every(4).whole_layers(), 0.25);
        assert_eq!(Recompute::Full.whole_layers(), 1.0);
        assert_eq!(Recompute::Selective.whole_layers(), 0.0);
        assert_eq!(Recompute::Every(0).whole_layer_period(), Some(1));
        let l = Layout {
            recompute: Recompute::Every(2),
            ..Layout::default()
        };
        let json = serde_json::to_string(&l).unwrap();
        assert!(json.contains(r#""recompute":"every:2""#), "{json}");
        assert_eq!(serde_json::from_str::<Layout>(&json).unwrap(), l);
        for bad in ["every:0", "every:", "every:two", "every:-1"] {
            let e = bad.parse::<Recompute>().unwrap_err();
            assert!(e.contains("every:K"), "{bad}: {e}");
        }
    }

    /// Megatron-Core's named submodules: `recompute=modules:a+b` inline, the same string in a
    /// plan file, printed in Megatron's order; an unknown or missing name is refused.
    #[test]
    fn recompute_modules_parse_print_and_round_trip() {
        let p = PartialLayout::parse("dp=8,recompute=modules:moe_act+layernorm").unwrap();
        let m = RecomputeModules::parse(&["layernorm", "moe_act"]).unwrap();
        assert_eq!(p.recompute, Some(Recompute::Modules(m)));
        assert_eq!(
            Recompute::Modules(m).to_string(),
            "modules:layernorm+moe_act"
        );
        let l = Layout {
            recompute: Recompute::Modules(m),
            ..Layout::default()
        };
        let json = serde_json::to_string(&l).unwrap();
        assert!(
            json.contains(r#""recompute":"modules:layernorm+moe_act""#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Layout>(&json).unwrap(), l);
        assert_eq!(
            serde_json::from_str::<Recompute>(r#""selective""#).unwrap(),
            Recompute::Selective
        );
        for bad in [
            "recompute=modules:",
            "recompute=modules:attention",
            "recompute=moe_act",
        ] {
            let e = PartialLayout::parse(bad).unwrap_err();
            assert!(
                e.contains("recompute") || e.contains("module"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn offload_parses_round_trips_and_names_its_zero_stage() {
        let p = PartialLayout::parse("dp=4,zero=2,offload=optimizer").unwrap();
        assert_eq!(p.offload, Some(Offload::Optimizer));
        assert_eq!(
            PartialLayout::parse("offload=cpu").unwrap().offload,
            Some(Offload::Optimizer)
        );
        let e = PartialLayout::parse("offload=disk").unwrap_err();
        assert!(e.contains("unknown offload 'disk'"), "{e}");
        // Absent in a plan file is none; none is not written.
        let mut pl = plan();
        assert!(!pl.to_json().contains("offload"));
        pl.layout.zero_stage = 3;
        pl.layout.offload = Offload::Params;
        let text = pl.to_json();
        assert!(text.contains("\"offload\": \"params\""), "{text}");
        assert_eq!(
            Plan::from_json(&text, "p.json").unwrap().layout.offload,
            Offload::Params
        );
        assert!(Offload::Optimizer
            .conflict(0)
            .unwrap()
            .contains("zero 1, 2 or 3"));
        assert!(Offload::Optimizer.conflict(1).is_none());
        assert!(Offload::Params
            .conflict(2)
            .unwrap()
            .contains("needs zero 3"));
        assert!(Offload::Params.conflict(3).is_none() && Offload::None.conflict(0).is_none());
        // ZeRO-Infinity's NVMe tier: written as on the command line, stage 3 only.
        for (name, o) in [
            ("optimizer-nvme", Offload::OptimizerNvme),
            ("params-nvme", Offload::ParamsNvme),
        ] {
            let parsed = PartialLayout::parse(&format!("offload={name}")).unwrap();
            assert_eq!(parsed.offload, Some(o));
            pl.layout.offload = o;
            let text = pl.to_json();
            assert!(text.contains(&format!("\"offload\": \"{name}\"")), "{text}");
            assert_eq!(Plan::from_json(&text, "p.json").unwrap().layout.offload, o);
            assert!(o.conflict(2).unwrap().contains("needs zero 3"));
            assert!(o.conflict(3).is_none() && o.nvme());
        }
        assert!(Offload::ParamsNvme.params() && !Offload::OptimizerNvme.params());
    }

    #[test]
    fn experts_fold_over_data_context_and_tensor_ranks() {
        // Qwen3-235B's Megatron-Bridge layout: tp 2, dp 16, ep 32, etp 1 — the 32 ranks of a
        // stage's dp × tp hold one expert slice each, no expert replicas.
        let p = PartialLayout::parse("tp=2,dp=16,pp=8,ep=32,etp=1").unwrap();
        assert_eq!((p.ep, p.etp), (Some(32), Some(1)));
        let l = Layout {
            dp: 16,
            tp: 2,
            pp: 8,
            ep: 32,
            etp: Some(1),
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        l.validate(2048, Some(94)).unwrap();
        assert_eq!((l.expert_tp(), l.expert_dp()), (1, 1));
        // Left out, etp is tp (Megatron-Core's default): then ep must divide dp × cp.
        let default = Layout {
            etp: None,
            ep: 8,
            ..l.clone()
        };
        assert_eq!((default.expert_tp(), default.expert_dp()), (2, 2));
        let e = Layout { ep: 32, ..default }
            .validate(2048, Some(94))
            .unwrap_err();
        assert!(
            e.contains("ep 32 × etp 2 must divide dp × cp × tp = 32"),
            "{e}"
        );
        // A plan file without etp reads as tp; an etp apart from tp is written.
        let mut pl = plan();
        assert!(!pl.to_json().contains("etp"));
        pl.layout.etp = Some(1);
        let text = pl.to_json();
        assert!(text.contains("\"etp\": 1"), "{text}");
        assert_eq!(
            Plan::from_json(&text, "p.json").unwrap().layout.etp,
            Some(1)
        );
    }

    #[test]
    fn an_overlapped_dispatch_needs_experts_and_megatrons_combined_schedule() {
        let p = PartialLayout::parse("ep=32,a2a_overlap=on").unwrap();
        assert_eq!(p.ep_overlap, Some(true));
        assert_eq!(
            PartialLayout::parse("ep_overlap=false").unwrap().ep_overlap,
            Some(false)
        );
        let e = PartialLayout::parse("ep_overlap=maybe").unwrap_err();
        assert!(
            e.contains("ep_overlap: 'maybe' is not true or false"),
            "{e}"
        );
        let l = Layout {
            dp: 16,
            tp: 2,
            pp: 8,
            ep: 32,
            etp: Some(1),
            ep_overlap: true,
            schedule: Schedule::Interleaved1F1B,
            interleave: 4,
            ..Layout::default()
        };
        l.validate(2048, Some(94)).unwrap();
        for (bad, why) in [
            (
                Layout {
                    ep: 1,
                    etp: None,
                    ..l.clone()
                },
                "needs expert parallelism",
            ),
            (
                Layout {
                    recompute: Recompute::Full,
                    ..l.clone()
                },
                "full recompute",
            ),
            (
                Layout {
                    schedule: Schedule::OneFOneB,
                    interleave: 1,
                    ..l.clone()
                },
                "needs the interleaved-1f1b (or dualpipe) schedule, not 1f1b",
            ),
        ] {
            let e = bad.validate(2048, Some(94)).unwrap_err();
            assert!(e.starts_with("layout.ep_overlap") && e.contains(why), "{e}");
        }
        // One stage merges without interleaving.
        Layout {
            pp: 1,
            dp: 128,
            schedule: Schedule::None,
            interleave: 1,
            ..l.clone()
        }
        .validate(2048, Some(94))
        .unwrap();
        // Off is not written to a plan file; on is, and reads back.
        let mut pl = plan();
        assert!(!pl.to_json().contains("ep_overlap"));
        pl.layout = Layout { dp: 64, ..l };
        let text = pl.to_json();
        assert!(text.contains("\"ep_overlap\": true"), "{text}");
        assert!(Plan::from_json(&text, "p.json").unwrap().layout.ep_overlap);
    }
}
