//! What `parallax plan` tells a team: the best plan as a `parallax-plan/1` document, why it
//! wins (which limit binds, against the best plan of each alternative family), guidance
//! grounded in the numbers, a top-K table, and the same as JSON, Markdown and HTML.

use crate::framework::Framework;
use crate::search::{Evaluated, SearchResult};
use parallax_cost::band_range;
use parallax_cost::compute::{gemm_aligned, DeviceModel, GEMM_ALIGNMENT_ELEMS};
use parallax_cost::transformer::{Setup, TpOverlap};
use parallax_ir::plan::{ClusterRef, ModelRef, Prediction, Training};
use parallax_ir::{Layout, Plan, Precision, Recompute, Schedule, PLAN_SCHEMA};
use parallax_sim::StepPrediction;
use serde::Serialize;
use serde_json::{json, Value};

/// The plan at another GPU count (`--max-gpus`).
#[derive(Clone, Debug, Serialize)]
pub struct SweepPoint {
    pub gpus: u32,
    /// Best plan there, when one fits.
    pub best: Option<Evaluated>,
    /// Why none fits, when none does.
    pub note: Option<String>,
}

/// Everything a plan report needs.
#[derive(Clone, Copy, Debug)]
pub struct ReportInput<'a> {
    pub setup: &'a Setup<'a>,
    /// Model as the user named it (zoo name or path).
    pub model_name: &'a str,
    /// Cluster spec as the user gave it.
    pub cluster_spec: &'a str,
    pub result: &'a SearchResult,
    /// Relative half-width of the step-time band ([`parallax_cost::step_time_band`]: the
    /// calibration residuals of the profile).
    pub band: f64,
    pub sweep: &'a [SweepPoint],
    /// The software stack predicted (`name@version`).
    pub framework: &'a str,
}

/// The training settings of `s` as a plan document records them.
pub fn training_of(s: &Setup) -> Training {
    Training {
        global_batch: s.global_batch,
        seq_len: s.seq,
        precision: s.precision,
        fp8_recipe: (s.precision == Precision::Fp8).then_some(s.runtime.fp8_recipe),
        async_tp: s.runtime.tp_overlap == TpOverlap::MicroPipelined,
        compile: s.runtime.compiled,
        capacity_permille: s.model.moe.map_or(0, |m| m.capacity_permille),
        pad_to_capacity: s.model.moe.is_some_and(|m| m.pad_to_capacity),
    }
}

/// How the job of `setup` on `framework` differs from the one `plan` was made for, one line
/// per setting (batch and sequence, precision and fp8 recipe, asynchronous TP, token
/// dropping, the stack): `simulate --plan FILE` predicts the file's layout for the job its
/// flags name, and says where that is not the plan's own.
pub fn plan_job_differences(plan: &Plan, setup: &Setup, framework: &str) -> Vec<String> {
    let (was, now) = (&plan.training, training_of(setup));
    let mut notes = Vec::new();
    if (was.global_batch, was.seq_len) != (now.global_batch, now.seq_len) {
        notes.push(format!(
            "was made for global batch {} × seq {}; simulating its layout at {} × {}",
            was.global_batch, was.seq_len, now.global_batch, now.seq_len
        ));
    }
    let precision = |t: &Training| match t.fp8_recipe {
        Some(r) if t.precision == Precision::Fp8 => format!("fp8 ({r} scaling)"),
        _ => t.precision.name().to_string(),
    };
    if (was.precision, was.fp8_recipe) != (now.precision, now.fp8_recipe) {
        notes.push(format!(
            "was made for {} training; simulating {} (--precision, --fp8-recipe)",
            precision(was),
            precision(&now)
        ));
    }
    if was.async_tp != now.async_tp {
        let tp = |on: bool| if on { "asynchronous" } else { "blocking" };
        notes.push(format!(
            "was made with {} tensor-parallel collectives; simulating {} ones (--async-tp)",
            tp(was.async_tp),
            tp(now.async_tp)
        ));
    }
    if was.compile != now.compile {
        let code = |on: bool| if on { "compiled" } else { "the stack's own" };
        notes.push(format!(
            "was made with {} module code; simulating {} (--compile)",
            code(was.compile),
            code(now.compile)
        ));
    }
    if (was.capacity_permille, was.pad_to_capacity) != (now.capacity_permille, now.pad_to_capacity)
    {
        let capacity = |t: &Training| match t.capacity_permille {
            0 => "dropless experts".to_string(),
            c => format!(
                "capacity factor {}{}",
                f64::from(c) / 1000.0,
                if t.pad_to_capacity { ", padded" } else { "" }
            ),
        };
        notes.push(format!(
            "was made with {}; simulating {} (--capacity-factor, --pad-to-capacity)",
            capacity(was),
            capacity(&now)
        ));
    }
    if let Some(stack) = plan
        .prediction
        .as_ref()
        .and_then(|p| p.framework.as_deref())
    {
        // The run options a stack's name carries have notes of their own above.
        if Framework::stack_name(stack) != Framework::stack_name(framework) {
            notes.push(format!(
                "was predicted on {}; simulating on {framework} (--framework)",
                one_line(stack)
            ));
        }
    }
    notes
}

/// Text a file gave, safe to print inside one line: control characters escaped, at most 80
/// characters kept.
pub fn one_line(text: &str) -> String {
    const KEPT: usize = 80;
    let mut s: String = text.escape_debug().take(KEPT).collect();
    if text.escape_debug().nth(KEPT).is_some() {
        s.push('…');
    }
    s
}

/// The Plan document of one evaluated layout, with its prediction and band.
pub fn plan_document(input: &ReportInput, e: &Evaluated) -> Plan {
    let s = input.setup;
    let p = &e.prediction;
    let (low, high) = band_range(p.step_time_s, input.band);
    Plan {
        schema: PLAN_SCHEMA.into(),
        model: ModelRef {
            name: input.model_name.into(),
        },
        cluster: ClusterRef {
            spec: input.cluster_spec.into(),
            gpus: s.gpus,
        },
        training: training_of(s),
        layout: e.layout.clone(),
        op_configs: Vec::new(),
        micro_batches: None,
        prediction: Some(Prediction {
            step_time_s: p.step_time_s,
            step_time_s_low: low,
            step_time_s_high: high,
            tokens_per_s: p.tokens_per_s,
            mfu: p.mfu,
            peak_memory_gib: p.peak_memory_gib,
            reserved_memory_gib: p.reserved_memory_gib,
            fits: p.fits,
            framework: Some(input.framework.into()),
        }),
    }
}

/// A compact layout label: `tp8·pp8·dp16 v2 z1 mb1 sel sp`.
pub fn short_layout(l: &Layout) -> String {
    let mut s = format!("tp{}·pp{}·dp{}", l.tp, l.pp, l.dp);
    if l.cp > 1 {
        s.push_str(&format!("·cp{}", l.cp));
    }
    if l.ep > 1 {
        s.push_str(&format!(" ep{}", l.ep));
    }
    if l.expert_tp() != l.tp {
        s.push_str(&format!(" etp{}", l.expert_tp()));
    }
    if !l.dispatcher.is_all_to_all() {
        s.push_str(&format!(" {}", l.dispatcher));
    }
    if l.ep_overlap {
        s.push_str(" overlapped");
    }
    match l.schedule {
        Schedule::None => {}
        Schedule::Interleaved1F1B => s.push_str(&format!(" int-v{}", l.interleave)),
        other => s.push_str(&format!(" {other}")),
    }
    s.push_str(&format!(" z{} mb{}", l.zero_stage, l.micro_batch));
    s.push_str(&match l.recompute {
        Recompute::None => String::new(),
        Recompute::Selective => " sel".into(),
        Recompute::Modules(m) => format!(" sel:{m}"),
        Recompute::Full => " full".into(),
        Recompute::Every(k) => format!(" full/{k}"),
    });
    if l.sequence_parallel && l.tp > 1 {
        s.push_str(" sp");
    }
    if !l.stages.is_empty() {
        s.push_str(" bal");
    }
    s
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

fn pct(x: f64) -> String {
    format!("{:.0} %", x * 100.0)
}

/// Human name of a part of [`parallax_sim::Breakdown::parts`].
pub fn part_name(k: &str) -> &'static str {
    match k {
        "compute" => "compute (kernels, recomputation included)",
        "bubble" => "pipeline bubble",
        "optimizer" => "optimizer step",
        "tp" => "tensor-parallel communication",
        "cp" => "context-parallel key/value exchange",
        "ep" => "expert dispatch (all-to-all, expert-TP gathers)",
        "host" => "host work the GPU waits for (MoE dispatchers' host sync)",
        "dp" => "data-parallel gradient reduction and parameter gather",
        "zero" => "ZeRO-2/3 per-micro-batch gathers and reductions",
        _ => "other communication",
    }
}

/// Which limit binds the best plan, then how each alternative family compares.
pub fn explain(input: &ReportInput) -> Vec<String> {
    let r = input.result;
    let best = r.best();
    let p = &best.prediction;
    let step = p.step_time_s;
    let mut out = Vec::new();
    let mut shares: Vec<(&str, f64)> = best
        .prediction
        .breakdown
        .parts()
        .into_iter()
        .filter(|x| x.1 > 0.0)
        .collect();
    shares.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    let listed: Vec<String> = shares
        .iter()
        .map(|(k, x)| format!("{k} {x:.2} s ({})", pct(x / step)))
        .collect();
    out.push(format!("Step {step:.2} s: {}.", listed.join(", ")));
    let headroom = 1.0 - p.reserved_memory_gib / p.capacity_gib;
    let largest_loss = shares.iter().find(|(k, _)| *k != "compute");
    let binding = if headroom < 0.10 {
        format!(
            "Memory binds: the fullest stage reserves {:.1} of {:.0} GiB ({}); anything holding more per GPU does not fit",
            p.reserved_memory_gib,
            p.capacity_gib,
            pct(1.0 - headroom)
        )
    } else if let Some((k, x)) = largest_loss.filter(|(_, x)| x / step > 0.05) {
        format!(
            "The largest loss is {} ({x:.2} s, {} of the step); memory has {} headroom ({:.1} of {:.0} GiB)",
            part_name(k),
            pct(x / step),
            pct(headroom),
            p.reserved_memory_gib,
            p.capacity_gib
        )
    } else {
        format!(
            "Compute binds: {} of the step is kernels, MFU {}; memory {:.1} of {:.0} GiB",
            pct(p.breakdown.compute_s / step),
            pct(p.mfu),
            p.reserved_memory_gib,
            p.capacity_gib
        )
    };
    out.push(binding + ".");
    let mine = best.prediction.breakdown.parts();
    for f in &r.families {
        if f.family.contains(&best.layout) {
            continue;
        }
        match (&f.best, f.smallest_need_gib) {
            (Some(fb), _) => {
                let loss = fb.prediction.step_time_s / step - 1.0;
                let theirs = fb.prediction.breakdown.parts();
                let get = |v: &[(&str, f64)], k: &str| {
                    v.iter().find(|x| x.0 == k).map_or(0.0, |x| x.1)
                };
                let mut keys: Vec<&str> = mine.iter().chain(&theirs).map(|x| x.0).collect();
                keys.sort();
                keys.dedup();
                let worst = keys
                    .iter()
                    .map(|&k| (k, get(&theirs, k) - get(&mine, k)))
                    .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(a.0)));
                let why = match worst {
                    Some((k, d)) if d > 0.0 => format!(
                        "because its {} takes {:.2} s against {:.2} s here",
                        part_name(k),
                        get(&theirs, k),
                        get(&mine, k)
                    ),
                    _ => "with a similar breakdown".to_string(),
                };
                out.push(format!(
                    "{}: {} at {:.2} s is {} slower {why}.",
                    capitalize(f.family.describe()),
                    short_layout(&fb.layout),
                    fb.prediction.step_time_s,
                    pct(loss)
                ));
            }
            (None, Some(need)) => out.push(format!(
                "No plan {} fits: the smallest needs at least {need:.1} GiB per GPU against {:.0} GiB (memory binds).",
                f.family.describe(),
                p.capacity_gib
            )),
            (None, None) if f.candidates == 0 => {}
            (None, None) => out.push(format!(
                "No plan {} is valid here (its {} candidates are indivisible or unsupported).",
                f.family.describe(),
                f.candidates
            )),
        }
    }
    out
}

/// Guidance in the spirit of the HuggingFace multi-GPU guide, from this plan's numbers.
pub fn guidance(input: &ReportInput) -> Vec<String> {
    let s = input.setup;
    let r = input.result;
    let best = r.best();
    let l = &best.layout;
    let p = &best.prediction;
    let mut out = Vec::new();
    let node = &s.profile.node;
    if let Some(net) = &s.profile.network {
        if s.gpus > node.gpus_per_node {
            let inter =
                f64::from(net.nics_per_node) * net.nic_gbit / 8.0 / f64::from(node.gpus_per_node);
            let ratio = node.intra_gbps / inter.max(1e-9);
            out.push(format!(
                "TP kept inside a node: inter-node bandwidth per GPU is {ratio:.1}× lower ({inter:.1} GB/s over the network against {:.0} GB/s within a node); tp = {} here.",
                node.intra_gbps, l.tp
            ));
        }
    }
    if l.pp > 1 {
        out.push(format!(
            "PP {} with {} micro-batches per step ({} schedule{}): the bubble costs {} of the step; more micro-batches or more virtual stages shrink it, at the price of memory and transfers.",
            l.pp,
            p.micro_batches,
            l.schedule,
            if l.interleave > 1 { format!(", v = {}", l.interleave) } else { String::new() },
            pct(p.bubble_fraction)
        ));
    }
    if !l.stages.is_empty() {
        out.push(format!(
            "Stages are balanced by predicted time, embedding and LM head included: layers per stage {:?}.",
            p.stage_layers
        ));
    }
    let m = &p.memory;
    if l.zero_stage > 0 {
        out.push(format!(
            "ZeRO-{} shards {} over {} data×context-parallel ranks: model states take {:.1} GiB per GPU (weights {:.1}, gradients {:.1}, optimizer {:.1}).",
            l.zero_stage,
            match l.zero_stage {
                1 => "optimizer states",
                2 => "optimizer states and gradients",
                _ => "optimizer states, gradients and parameters",
            },
            l.dp * l.cp,
            m.params + m.grads + m.optimizer,
            m.params,
            m.grads,
            m.optimizer
        ));
    }
    if l.recompute != Recompute::None {
        out.push(format!(
            "{} recomputation keeps activations to {:.1} GiB per GPU; HFU {} against MFU {}.",
            if l.recompute == Recompute::Full {
                "Full"
            } else {
                "Selective"
            },
            m.activations,
            pct(p.hfu),
            pct(p.mfu)
        ));
    }
    if let Some(line) = alignment_note(s, l) {
        out.push(line);
    }
    out.push(format!(
        "No layout can beat {:.2} s per step (model FLOPs at the dense peak of all {} GPUs); this plan reaches {} of that ideal.",
        r.flops_bound_s,
        s.gpus,
        pct(r.flops_bound_s / p.step_time_s)
    ));
    if let Some(line) = envelope_note(s, p) {
        out.push(line);
    }
    if r.bounds_fell_back {
        out.push("Note: the simulator changed under the planner's tight bounds; the search fell back to pipeline-only bounds (exact, slower).".into());
    }
    out
}

/// The share of their aligned rate misaligned GEMMs run at under `s`, where the cost model
/// charges one ([`DeviceModel::misaligned_gemm_share`]).
fn misaligned_share(s: &Setup) -> Option<f64> {
    DeviceModel::new(s.profile, s.precision)
        .ok()?
        .misaligned_gemm_share()
}

/// The dimensions of `l`'s layer GEMMs, per rank, that a GEMM cannot run at full rate on the
/// device of `s` ([`gemm_aligned`]), by name: none where misalignment costs nothing there
/// ([`misaligned_share`]).
fn misaligned_dims(s: &Setup, l: &Layout) -> Vec<(String, u64)> {
    if misaligned_share(s).is_none() {
        return Vec::new();
    }
    let Some(shard) = s.rank_shard(l.tp) else {
        return Vec::new();
    };
    let rank = if l.tp > 1 { " a TP rank" } else { "" };
    [
        ("hidden size", "", s.model.hidden),
        ("query width", rank, shard.heads * shard.head_dim),
        ("key/value width", rank, shard.kv_heads * shard.head_dim),
        ("FFN width", rank, shard.ffn_hidden),
        ("vocabulary", rank, shard.vocab),
        (
            "tokens a micro-batch",
            "",
            l.micro_batch * s.seq / u64::from(l.cp.max(1)),
        ),
    ]
    .into_iter()
    .filter(|&(_, _, d)| d > 0 && !gemm_aligned(d))
    .map(|(what, per, d)| (format!("{what}{per}"), d))
    .collect()
}

/// Where the best plan's layer GEMMs have a misaligned dimension ([`misaligned_dims`]): which,
/// the share of their aligned rate such GEMMs run at on this device, and the padded size that
/// restores it.
fn alignment_note(s: &Setup, l: &Layout) -> Option<String> {
    let share = misaligned_share(s)?;
    let dims = misaligned_dims(s, l);
    if dims.is_empty() {
        return None;
    }
    let list = dims
        .iter()
        .map(|(what, d)| {
            format!(
                "{what} {d} (padded: {})",
                d.next_multiple_of(GEMM_ALIGNMENT_ELEMS)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Some(format!(
        "Misaligned GEMMs (a dimension not a multiple of {GEMM_ALIGNMENT_ELEMS}): {list}; on {} 16-bit GEMMs with such a dimension run at {} of their aligned rate (the profile's measured share); padding them to the sizes in brackets restores it.",
        s.profile.device.name,
        pct(share)
    ))
}

/// Where the best plan's MFU passes the best published run of its model's size on its GPU
/// generation ([`crate::envelope`]): that run, and the hardware rate published steps have
/// reached on the chip, so a team sees how far the plan reaches past practice.
fn envelope_note(s: &Setup, p: &StepPrediction) -> Option<String> {
    use crate::envelope::{chip_record, size_record};
    let device = &s.profile.device.name;
    let size = size_record(device, s.model.params() as f64)?;
    if p.mfu <= size.mfu {
        return None;
    }
    let chip = chip_record(device)?;
    let recomputed = if p.hfu > p.mfu * 1.001 {
        format!("this plan's recomputation brings its own to {}", pct(p.hfu))
    } else {
        format!("this plan recomputes nothing, so {} is its own", pct(p.mfu))
    };
    Some(format!(
        "MFU {} is above the best published run of a {}–{} B model on {}: {} ({}). The fastest published training step on this chip ran its hardware at {} ({}); {recomputed}.",
        pct(p.mfu),
        size.min_params,
        if size.max_params.is_finite() { format!("{}", size.max_params) } else { "…".into() },
        size.generation,
        pct(size.mfu),
        size.run,
        pct(chip.hfu),
        chip.run,
    ))
}

/// One row of the top-K table.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub rank: usize,
    pub id: u64,
    pub layout: String,
    pub layout_inline: String,
    pub step_time_s: f64,
    pub step_time_s_low: f64,
    pub step_time_s_high: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    /// Peak of the live tensors, GiB.
    pub peak_memory_gib: f64,
    /// Peak the caching allocator reserves, GiB: what must fit in `capacity_gib`.
    pub reserved_memory_gib: f64,
    pub capacity_gib: f64,
    pub bubble_fraction: f64,
    pub exposed_comm_s: f64,
}

/// The top-K rows.
pub fn rows(input: &ReportInput) -> Vec<Row> {
    input
        .result
        .top
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let p = &e.prediction;
            let (low, high) = band_range(p.step_time_s, input.band);
            Row {
                rank: i + 1,
                id: e.id,
                layout: short_layout(&e.layout),
                layout_inline: crate::complete::layout_string(&e.layout),
                step_time_s: p.step_time_s,
                step_time_s_low: low,
                step_time_s_high: high,
                tokens_per_s: p.tokens_per_s,
                mfu: p.mfu,
                peak_memory_gib: p.peak_memory_gib,
                reserved_memory_gib: p.reserved_memory_gib,
                capacity_gib: p.capacity_gib,
                bubble_fraction: p.bubble_fraction,
                exposed_comm_s: p.breakdown.exposed_comm(),
            }
        })
        .collect()
}

/// The top-K table as text cells (header, rows).
pub fn table_cells(input: &ReportInput) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let header = vec![
        "layout",
        "step s",
        "band s",
        "tokens/s",
        "MFU",
        "memory GiB",
        "bubble",
        "comm s",
    ];
    let body = rows(input)
        .iter()
        .map(|r| {
            vec![
                format!("{} {}", r.rank, r.layout),
                format!("{:.3}", r.step_time_s),
                format!("{:.2}–{:.2}", r.step_time_s_low, r.step_time_s_high),
                format!("{:.0}", r.tokens_per_s),
                pct(r.mfu),
                format!("{:.1} / {:.0}", r.reserved_memory_gib, r.capacity_gib),
                pct(r.bubble_fraction),
                format!("{:.2}", r.exposed_comm_s),
            ]
        })
        .collect();
    (header, body)
}

/// The keys every prediction document has (`simulate --json`, and `plan --json` for its best
/// plan): step time with its band, throughput, MFU/HFU, memory, fit, layout and breakdown.
pub fn prediction_json(p: &StepPrediction, layout: &Layout, band: f64) -> Value {
    let (low, high) = band_range(p.step_time_s, band);
    let mut doc = json!({
        "step_time_s": p.step_time_s,
        "step_time_s_low": low,
        "step_time_s_high": high,
        "tokens_per_s": p.tokens_per_s,
        "mfu": p.mfu,
        "hfu": p.hfu,
        "peak_memory_gib": p.peak_memory_gib,
        "reserved_memory_gib": p.reserved_memory_gib,
        "capacity_gib": p.capacity_gib,
        "fits": p.fits,
        "layout": layout,
        "layout_inline": crate::complete::layout_string(layout),
        "breakdown": p.breakdown,
        "memory": p.memory,
        "stage_memory_gib": p.stage_memory_gib,
        "stage_layers": p.stage_layers,
        "bubble_fraction": p.bubble_fraction,
        "micro_batches": p.micro_batches,
    });
    if !p.fits {
        doc["over_by_gib"] = json!(p.reserved_memory_gib - p.capacity_gib);
    }
    doc
}

/// Header and rows of the GPU-count sweep table (text and Markdown reports).
pub fn sweep_cells(sweep: &[SweepPoint]) -> ([&'static str; 5], Vec<Vec<String>>) {
    let rows = sweep
        .iter()
        .map(|p| match &p.best {
            Some(e) => vec![
                p.gpus.to_string(),
                short_layout(&e.layout),
                format!("{:.3}", e.prediction.step_time_s),
                format!("{:.0}", e.prediction.tokens_per_s),
                pct(e.prediction.mfu),
            ],
            None => vec![
                p.gpus.to_string(),
                p.note.clone().unwrap_or_default(),
                "-".into(),
                "-".into(),
                "-".into(),
            ],
        })
        .collect();
    (["GPUs", "best layout", "step s", "tokens/s", "MFU"], rows)
}

/// The `--json` document: `simulate`'s top-level keys for the best plan, plus `plan`,
/// `candidates` (top-K), `rejected` (counts by reason) and the explanation.
pub fn json_document(input: &ReportInput) -> Value {
    let r = input.result;
    let best = r.best();
    let plan = plan_document(input, best);
    let mut doc = prediction_json(&best.prediction, &best.layout, input.band);
    let extra = json!({
        "plan": plan,
        "candidates": rows(input),
        "rejected": r.counts.rejected,
        "counts": {
            "candidates": r.counts.candidates,
            "simulated": r.counts.simulated,
            "feasible": r.counts.feasible,
        },
        "summary": r.summary_line(),
        "framework": input.framework,
        "flops_bound_s": r.flops_bound_s,
        "band": input.band,
        "families": r.families.iter().map(|f| json!({
            "family": f.family,
            "description": f.family.describe(),
            "best_layout": f.best.as_ref().map(|e| crate::complete::layout_string(&e.layout)),
            "best_step_time_s": f.best.as_ref().map(|e| e.prediction.step_time_s),
            "smallest_need_gib": f.smallest_need_gib,
            "candidates": f.candidates,
        })).collect::<Vec<_>>(),
        "explanation": explain(input),
        "guidance": guidance(input),
        "sweep": input.sweep.iter().map(|s| json!({
            "gpus": s.gpus,
            "step_time_s": s.best.as_ref().map(|e| e.prediction.step_time_s),
            "tokens_per_s": s.best.as_ref().map(|e| e.prediction.tokens_per_s),
            "mfu": s.best.as_ref().map(|e| e.prediction.mfu),
            "layout": s.best.as_ref().map(|e| crate::complete::layout_string(&e.layout)),
            "note": s.note,
        })).collect::<Vec<_>>(),
    });
    if let (Some(d), Value::Object(x)) = (doc.as_object_mut(), extra) {
        d.extend(x);
    }
    doc
}

/// The heading lines shared by the text and Markdown reports.
pub fn headline(input: &ReportInput) -> Vec<String> {
    let s = input.setup;
    let best = input.result.best();
    let p = &best.prediction;
    let (low, high) = band_range(p.step_time_s, input.band);
    vec![
        format!(
            "{} on {} ({} GPUs), global batch {} × seq {}, {}",
            input.model_name, input.cluster_spec, s.gpus, s.global_batch, s.seq, s.precision
        ),
        format!("stack       {}", input.framework),
        format!(
            "best plan   {}",
            crate::complete::layout_string(&best.layout)
        ),
        format!(
            "step time   {:.3} s ({:.3}–{:.3} s, ±{:.0} %) · {:.0} tokens/s · MFU {} · HFU {}",
            p.step_time_s,
            low,
            high,
            input.band * 100.0,
            p.tokens_per_s,
            pct(p.mfu),
            pct(p.hfu)
        ),
        format!(
            "memory      {:.1} GiB reserved ({:.1} allocated) of {:.0} GiB per GPU ({} micro-batches, bubble {})",
            p.reserved_memory_gib,
            p.peak_memory_gib,
            p.capacity_gib,
            p.micro_batches,
            pct(p.bubble_fraction)
        ),
        format!("search      {}", input.result.summary_line()),
    ]
}

/// Header of the rejected-candidates table.
const REJECTED_HEADER: [&str; 2] = ["reason", "candidates"];

/// Rows of the rejected-candidates table: reason, count.
fn rejected_cells(input: &ReportInput) -> Vec<Vec<String>> {
    input
        .result
        .counts
        .rejected
        .iter()
        .map(|(k, v)| vec![k.clone(), crate::search::group_digits(*v)])
        .collect()
}

fn md_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut s = format!("| {} |\n", header.join(" | "));
    s.push_str(&format!(
        "|{}\n",
        header.iter().map(|_| "---|").collect::<String>()
    ));
    for r in rows {
        s.push_str(&format!("| {} |\n", r.join(" | ")));
    }
    s
}

/// SVG plots of a report, by file name.
pub type Svgs = Vec<(String, String)>;

/// `report.md`: the same content as the terminal, with the plots linked.
pub fn markdown(input: &ReportInput, svgs: &Svgs) -> String {
    let mut s = String::from("# parallax plan\n\n");
    for line in headline(input) {
        s.push_str(&format!("    {line}\n"));
    }
    s.push_str("\n## Why this plan wins\n\n");
    for l in explain(input) {
        s.push_str(&format!("- {l}\n"));
    }
    s.push_str("\n## Guidance\n\n");
    for l in guidance(input) {
        s.push_str(&format!("- {l}\n"));
    }
    s.push_str(&format!("\n## Top {} plans\n\n", input.result.top.len()));
    let (h, rows) = table_cells(input);
    s.push_str(&md_table(&h, &rows));
    s.push_str("\n## Rejected candidates\n\n");
    s.push_str(&md_table(&REJECTED_HEADER, &rejected_cells(input)));
    if !input.sweep.is_empty() {
        s.push_str("\n## GPU-count sweep\n\n");
        let (header, rows) = sweep_cells(input.sweep);
        s.push_str(&md_table(&header, &rows));
    }
    if !svgs.is_empty() {
        s.push_str("\n## Plots\n\n");
        for (name, _) in svgs {
            s.push_str(&format!("![{name}]({name})\n\n"));
        }
    }
    s.push_str("\nFiles: `plan.json` (parallax-plan/1), `trace.json` (open in https://ui.perfetto.dev or chrome://tracing), `report.html` (self-contained).\n");
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn html_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let row = |tag: &str, cells: &mut dyn Iterator<Item = &str>| {
        let cells: String = cells
            .map(|c| format!("<{tag}>{}</{tag}>", escape(c)))
            .collect();
        format!("<tr>{cells}</tr>\n")
    };
    let mut s = String::from("<table>\n");
    s.push_str(&row("th", &mut header.iter().copied()));
    for r in rows {
        s.push_str(&row("td", &mut r.iter().map(String::as_str)));
    }
    s.push_str("</table>\n");
    s
}

/// `report.html`: self-contained (styles and SVGs inline, no scripts, no external fetches).
pub fn html(input: &ReportInput, svgs: &Svgs) -> String {
    let mut s = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>parallax plan</title>\n<style>\nbody{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}\npre{background:#f6f6f6;padding:1em;overflow-x:auto}\ntable{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}\n.plot{margin:1.5em 0}\n</style></head><body>\n<h1>parallax plan</h1>\n<pre>",
    );
    for line in headline(input) {
        s.push_str(&escape(&line));
        s.push('\n');
    }
    s.push_str("</pre>\n<h2>Why this plan wins</h2>\n<ul>\n");
    for l in explain(input) {
        s.push_str(&format!("<li>{}</li>\n", escape(&l)));
    }
    s.push_str("</ul>\n<h2>Guidance</h2>\n<ul>\n");
    for l in guidance(input) {
        s.push_str(&format!("<li>{}</li>\n", escape(&l)));
    }
    s.push_str("</ul>\n<h2>Top plans</h2>\n");
    let (h, rows) = table_cells(input);
    s.push_str(&html_table(&h, &rows));
    s.push_str("<h2>Rejected candidates</h2>\n");
    s.push_str(&html_table(&REJECTED_HEADER, &rejected_cells(input)));
    if !input.sweep.is_empty() {
        s.push_str("<h2>GPU-count sweep</h2>\n");
        let (header, rows) = sweep_cells(input.sweep);
        s.push_str(&html_table(&header, &rows));
    }
    for (name, svg) in svgs {
        // Inline the SVG element itself (drop any XML prologue).
        let body = svg.find("<svg").map_or(svg.as_str(), |i| &svg[i..]);
        s.push_str(&format!(
            "<div class=\"plot\" id=\"{}\">\n{}\n</div>\n",
            escape(name),
            body
        ));
    }
    s.push_str("<p>Plan: <code>plan.json</code>. Timeline: <code>trace.json</code> (Perfetto / chrome://tracing).</p>\n</body></html>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plots::{breakdown_svg, gantt_svg, memory_svg, sweep_svg};
    use crate::search::{search, SearchOptions};
    use parallax_hardware::Cluster;
    use parallax_ir::models::zoo;

    /// A plan file simulated for another job is told apart setting by setting; the same job
    /// draws no note.
    #[test]
    fn a_plan_names_each_setting_its_job_differs_in() {
        let mut m = zoo::transformer("mixtral-8x7b").unwrap();
        let c = Cluster::parse("dgx-h100-80gb:gpus=64").unwrap();
        let made = Setup::new(&m, &c.profile, 64, 4096, 256);
        let plan = Plan {
            schema: PLAN_SCHEMA.into(),
            model: ModelRef {
                name: "mixtral-8x7b".into(),
            },
            cluster: ClusterRef {
                spec: "dgx-h100-80gb:gpus=64".into(),
                gpus: 64,
            },
            training: training_of(&made),
            layout: Layout::default(),
            op_configs: Vec::new(),
            micro_batches: None,
            prediction: Some(Prediction {
                framework: Some("current".into()),
                ..Prediction::default()
            }),
        };
        assert!(plan_job_differences(&plan, &made, "current").is_empty());
        // On the same stack, compiled: the compile note says it, not a second stack note.
        let mut compiled = made;
        compiled.runtime.compiled = true;
        let on_titan = Plan {
            prediction: Some(Prediction {
                framework: Some("torchtitan".into()),
                ..Prediction::default()
            }),
            ..plan.clone()
        };
        assert_eq!(
            plan_job_differences(&on_titan, &compiled, "torchtitan, compiled"),
            ["was made with the stack's own module code; simulating compiled (--compile)"]
        );

        let moe = m.moe.as_mut().unwrap();
        (moe.capacity_permille, moe.pad_to_capacity) = (1500, true);
        let mut now = Setup::new(&m, &c.profile, 64, 4096, 512);
        now.precision = Precision::Fp8;
        now.runtime.tp_overlap = TpOverlap::MicroPipelined;
        now.runtime.compiled = true;
        let notes = plan_job_differences(&plan, &now, "torchtitan");
        assert_eq!(one_line("a\nb"), "a\\nb");
        assert_eq!(one_line(&"x".repeat(100)).chars().count(), 81);
        assert_eq!(
            notes,
            [
                "was made for global batch 256 × seq 4096; simulating its layout at 512 × 4096",
                "was made for bf16 training; simulating fp8 (tensorwise scaling) (--precision, --fp8-recipe)",
                "was made with blocking tensor-parallel collectives; simulating asynchronous ones (--async-tp)",
                "was made with the stack's own module code; simulating compiled (--compile)",
                "was made with dropless experts; simulating capacity factor 1.5, padded (--capacity-factor, --pad-to-capacity)",
                "was predicted on current; simulating on torchtitan (--framework)",
            ]
        );
    }

    /// GPT-3 13B as its paper gives it (hidden 5,140) has every layer GEMM misaligned: on an
    /// H100, whose misaligned rate is measured, the guidance says which dimension, the share
    /// and the padded size; an aligned model, fp32, or a chip without the measurement draws
    /// no note; the stack's vocabulary padding aligns GPT-2's head.
    #[test]
    fn misaligned_gemm_dimensions_are_named_with_their_padding() {
        let h100 = Cluster::parse("dgx-h100-80gb:gpus=8").unwrap();
        let a100 = Cluster::parse("dgx-a100-80gb:gpus=8").unwrap();
        let gpt3 = zoo::transformer("gpt3-13b").unwrap();
        let l = Layout {
            tp: 2,
            dp: 4,
            micro_batch: 1,
            ..Layout::default()
        };
        let s = Setup::new(&gpt3, &h100.profile, 8, 2048, 64);
        let note = alignment_note(&s, &l).unwrap();
        assert!(
            note.starts_with(
                "Misaligned GEMMs (a dimension not a multiple of 8): hidden size 5140 (padded: 5144), vocabulary a TP rank 25129 (padded: 25136); on H100"
            ) && note.contains("at 18 % of their aligned rate"),
            "{note}"
        );
        assert_eq!(
            alignment_note(&Setup::new(&gpt3, &a100.profile, 8, 2048, 64), &l),
            None
        );
        let fp32 = Setup {
            precision: Precision::Fp32,
            ..s
        };
        assert_eq!(alignment_note(&fp32, &l), None);
        let llama = zoo::transformer("llama3-8b").unwrap();
        assert_eq!(
            alignment_note(&Setup::new(&llama, &h100.profile, 8, 2048, 64), &l),
            None
        );
        // GPT-2's 50,257 entries: misaligned as HuggingFace runs them (per rank at tp 1),
        // aligned under Megatron's padding to 128 a rank.
        let gpt2 = zoo::transformer("gpt2").unwrap();
        let one = Layout { tp: 1, dp: 8, ..l };
        let mut hf = Setup::new(&gpt2, &h100.profile, 8, 1024, 64);
        hf.runtime.vocab_multiple = 1;
        assert_eq!(
            misaligned_dims(&hf, &one),
            [("vocabulary".to_string(), 50257)]
        );
        hf.runtime.vocab_multiple = 128;
        assert!(misaligned_dims(&hf, &one).is_empty());
    }

    #[test]
    fn reports_have_every_key_and_stay_self_contained() {
        let m = zoo::transformer("gpt3-6.7b").unwrap();
        let c = Cluster::parse("dgx-a100-80gb:gpus=32").unwrap();
        let s = Setup::new(&m, &c.profile, 32, 2048, 64);
        let opts = SearchOptions {
            force: parallax_ir::PartialLayout::parse("pp=2").unwrap(),
            ..SearchOptions::default()
        };
        let r = search(&s, &opts).unwrap();
        let sweep = vec![SweepPoint {
            gpus: 32,
            best: Some(r.best().clone()),
            note: None,
        }];
        let input = ReportInput {
            setup: &s,
            model_name: "gpt3-6.7b",
            cluster_spec: "dgx-a100-80gb:gpus=32",
            result: &r,
            band: 0.1,
            sweep: &sweep,
            framework: "current",
        };
        let doc = json_document(&input);
        for key in [
            "step_time_s",
            "step_time_s_low",
            "step_time_s_high",
            "tokens_per_s",
            "mfu",
            "hfu",
            "peak_memory_gib",
            "reserved_memory_gib",
            "fits",
            "layout",
            "breakdown",
            "memory",
            "plan",
            "candidates",
            "rejected",
        ] {
            assert!(doc.get(key).is_some(), "{key}");
        }
        let best = r.best().prediction.step_time_s;
        assert_eq!(doc["step_time_s_low"].as_f64(), Some(best * 0.9));
        assert_eq!(doc["plan"]["schema"], "parallax-plan/1");
        assert_eq!(doc["plan"]["layout"]["pp"], 2);
        assert_eq!(doc["candidates"].as_array().unwrap().len(), r.top.len());
        let plan: Plan = serde_json::from_value(doc["plan"].clone()).unwrap();
        Plan::from_json(&plan.to_json(), "plan.json").unwrap();
        // 32 GPUs span 4 nodes: the TP advice names the chosen tp; pp = 2 was forced: the
        // pipeline advice names its micro-batches.
        let advice = guidance(&input);
        let (best_l, best_p) = (&r.best().layout, &r.best().prediction);
        assert!(
            advice.iter().any(|l| l.starts_with("TP kept inside a node")
                && l.contains(&format!("tp = {} here", best_l.tp))),
            "{advice:?}"
        );
        let pp_line = format!("PP 2 with {} micro-batches", best_p.micro_batches);
        assert!(advice.iter().any(|l| l.starts_with(&pp_line)), "{advice:?}");
        // Past the best published run of its size on its chip, a plan is told so, with the
        // chip's hardware record; within it, nothing is said.
        let mut fast = best_p.clone();
        (fast.mfu, fast.hfu) = (0.75, 1.0);
        let note = envelope_note(&s, &fast).unwrap();
        assert!(
            note.starts_with("MFU 75 % is above the best published run of a 1–10 B model on A100: 68 % (IBM fms-fsdp")
                && note.contains("ran its hardware at 79 %")
                && note.contains("recomputation brings its own to 100 %"),
            "{note}"
        );
        fast.mfu = 0.5;
        assert_eq!(envelope_note(&s, &fast), None);
        let why = explain(&input);
        assert!(
            why[0].starts_with("Step ") && why[0].contains("compute"),
            "{why:?}"
        );
        // The second line names what limits the plan: a binding resource or its largest loss.
        assert!(
            why[1].contains("binds") || why[1].starts_with("The largest loss is"),
            "{why:?}"
        );

        let labels: Vec<String> = r.top.iter().map(|e| short_layout(&e.layout)).collect();
        let step = parallax_sim::simulate_step(&s, &r.best().layout).unwrap();
        let svgs: Svgs = vec![
            (
                "breakdown.svg".into(),
                breakdown_svg(&r.top, &labels).unwrap(),
            ),
            (
                "memory.svg".into(),
                memory_svg(&r.best().prediction.stage_memory_gib, 80.0).unwrap(),
            ),
            (
                "timeline.svg".into(),
                gantt_svg(&step.graph, &step.resources, &step.trace).unwrap(),
            ),
            (
                "sweep.svg".into(),
                sweep_svg(&[(16, 1.0), (32, 1.9)]).unwrap(),
            ),
        ];
        for (name, svg) in &svgs {
            assert!(
                svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
                "{name}"
            );
            assert!(svg.contains("<rect"), "{name}");
        }
        let page = html(&input, &svgs);
        assert_eq!(page.matches("<svg").count(), svgs.len());
        // Self-contained: no scripts, no external stylesheets, images or fonts.
        for bad in ["<script", "<link", "src=", "@import", "url("] {
            assert!(!page.contains(bad), "{bad}");
        }
        assert!(page.contains("<h2>GPU-count sweep</h2>"));
        assert_eq!(page.matches("<table>").count(), 3);
        let md = markdown(&input, &svgs);
        assert!(md.contains("## Why this plan wins") && md.contains("](breakdown.svg)"));
        assert!(md.contains("## GPU-count sweep"));
    }
}
