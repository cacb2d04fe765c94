//! `plan` and `simulate` for any graph (CNNs, RNNs, ViT, ONNX, graph JSON): the per-op (SOAP)
//! path. Transformers from the zoo or a HuggingFace config take the structured path instead.

use crate::fmt::{bytes, table};
use crate::user;
use parallax_cost::soap::{MachineView, OpCosts, Optimizer, ParallelConfig};
use parallax_cost::{band_range, step_time_band};
use parallax_hardware::Cluster;
use parallax_ir::graph::NodeId;
use parallax_ir::plan::{ClusterRef, ModelRef, OpConfig, Prediction, Training};
use parallax_ir::{
    AxisRole, BatchNormStats, Graph, Layout, Model, OpKind, PartialLayout, Plan, Recompute,
    Schedule, GIB, PLAN_SCHEMA,
};
use parallax_planner::plots::{device_memory_svg, gantt_svg};
use parallax_planner::soap::{
    graph_costs, layout_plan, plan_graph, GraphJob, GraphPlan, SoapOptions,
};
use parallax_sim::perop::{simulate_op_plan, OpPlan, OpStepPrediction, SimulatedOpStep};
use serde_json::json;
use std::path::Path;

/// Per-device batch below which BatchNorm statistics get noisy enough to hurt convergence:
/// the SageMaker distributed-training guide (shared/seeds) warns that splitting a batch of 64
/// over 32 GPUs (2 per GPU) "will likely break the convergence", and Wu & He (2018, "Group
/// Normalization", Fig. 1) measure ResNet-50's ImageNet error rising once BatchNorm sees fewer
/// than 16 images per GPU.
pub const BATCHNORM_MIN_PER_DEVICE: u64 = 16;

/// A non-transformer job: the model (built per batch), cluster and training settings.
pub struct GraphModel {
    pub name: String,
    pub model: Model,
    pub cluster: Cluster,
    pub seq: u64,
    pub global_batch: u64,
    pub precision: parallax_ir::Precision,
    pub optimizer: Optimizer,
    /// Activations stored NCHW rather than channels-last.
    pub nchw: bool,
    /// BatchNorm statistics of the plans `plan` searches (`--fix bn=local`).
    pub batch_norm: BatchNormStats,
}

impl GraphModel {
    /// The job of a model that is not a transformer, on `cluster`.
    pub fn new(
        model: Model,
        cluster: Cluster,
        seq: u64,
        global_batch: u64,
        precision: parallax_ir::Precision,
        nchw: bool,
    ) -> anyhow::Result<GraphModel> {
        let probe = model.graph(1, seq.min(8), true).map_err(user)?;
        Ok(GraphModel {
            name: model.name.clone(),
            model,
            cluster,
            seq,
            global_batch,
            precision,
            optimizer: Optimizer::default_for(&probe),
            nchw,
            batch_norm: BatchNormStats::Sync,
        })
    }

    fn build(&self, batch: u64) -> Result<Graph, String> {
        self.model
            .graph(batch, self.seq, true)
            .map_err(|e| e.to_string())
    }

    fn costs<'a>(&'a self, g: &'a Graph) -> anyhow::Result<OpCosts<'a>> {
        graph_costs(
            g,
            &self.cluster.profile,
            self.cluster.gpus,
            self.precision,
            self.optimizer,
            self.nchw,
        )
        .map_err(|e| user(format!("--precision: {e}")))
    }

    /// The planner's view of this job, its graphs built by `build`.
    fn job<'a>(&'a self, build: &'a dyn Fn(u64) -> Result<Graph, String>) -> GraphJob<'a> {
        GraphJob {
            build,
            profile: &self.cluster.profile,
            gpus: self.cluster.gpus,
            precision: self.precision,
            optimizer: self.optimizer,
            global_batch: self.global_batch,
            nchw: self.nchw,
            batch_norm: self.batch_norm,
        }
    }
}

/// `parallax plan` for a graph.
pub fn plan(
    job: &GraphModel,
    cluster_spec: &str,
    json_out: bool,
    out: Option<&Path>,
    force: bool,
    budget: Option<std::time::Duration>,
) -> anyhow::Result<()> {
    if let Some(dir) = out {
        crate::prepare_out(dir, OUT_FILES, force)?;
    }
    let build = |b: u64| job.build(b);
    let gj = job.job(&build);
    let opts = SoapOptions {
        mcmc_budget: budget,
        ..SoapOptions::default()
    };
    let r = plan_graph(&gj, &opts).map_err(|e| {
        user(format!(
            "--model {} on --cluster {cluster_spec}: {e}",
            job.name
        ))
    })?;
    let g = job.build(r.micro_batch).map_err(user)?;
    let mut costs = job.costs(&g)?;
    let sim = simulate_op_plan(&mut costs, &r.plan, job.global_batch).map_err(user)?;
    let band = step_time_band(&job.cluster.profile);
    let plan_doc = plan_document(job, cluster_spec, &costs, &r.plan, &sim.prediction, band);
    let report = report_lines(job, cluster_spec, &costs, &r, &sim.prediction, band);
    if let Some(dir) = out {
        write_out(dir, &plan_doc, &sim, &report)?;
    }
    if json_out {
        let mut doc = prediction_json(job, &costs, &r.plan, &sim.prediction, band);
        doc["plan"] = serde_json::to_value(&plan_doc)?;
        doc["search"] = serde_json::to_value(&r.counts)?;
        doc["data_parallel_step_time_s"] = json!(r.data_parallel.as_ref().map(|p| p.step_time_s));
        doc["speedup_over_data_parallel"] = json!(r
            .data_parallel
            .as_ref()
            .map(|p| p.step_time_s / sim.prediction.step_time_s));
        doc["best_uniform"] = json!(r.best_uniform.as_ref().map(|(n, p)| json!({
            "pattern": n, "step_time_s": p.step_time_s,
        })));
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        for l in report {
            println!("{l}");
        }
    }
    Ok(())
}

/// `parallax simulate` for a graph: a plan JSON with per-op configurations, or an inline
/// layout (`dp`, `tp`, `pp`, `mb`, `schedule`, `recompute=full`).
pub fn simulate(
    job: &GraphModel,
    cluster_spec: &str,
    spec: &str,
    json_out: bool,
    trace: Option<&Path>,
) -> anyhow::Result<()> {
    let (g, plan) = op_plan(job, spec)?;
    let mut costs = job.costs(&g)?;
    let sim = simulate_op_plan(&mut costs, &plan, job.global_batch)
        .map_err(|e| user(format!("--plan {spec}: {e}")))?;
    let band = step_time_band(&job.cluster.profile);
    if let Some(t) = trace {
        let doc = sim.trace.to_chrome_trace(&sim.graph, &sim.resources);
        std::fs::write(t, serde_json::to_string(&doc)?)
            .map_err(|e| user(format!("{}: cannot write: {e}", t.display())))?;
    }
    if json_out {
        let doc = prediction_json(job, &costs, &plan, &sim.prediction, band);
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        let p = &sim.prediction;
        println!("{} on {cluster_spec}: {}", job.name, summary(&costs, &plan));
        for l in step_lines(job.cluster.gpus, p, band) {
            println!("{l}");
        }
        for l in config_lines(&costs, &plan) {
            println!("{l}");
        }
    }
    Ok(())
}

/// The graph at the micro-batch's size and the per-op plan that `spec` gives: a plan file
/// with per-op configurations, or an inline layout (`dp`, `tp`, `pp`, `mb`, `schedule`,
/// `recompute=full`) laid out op by op.
pub fn op_plan(job: &GraphModel, spec: &str) -> anyhow::Result<(Graph, OpPlan)> {
    let path = Path::new(spec);
    let (source, micro_batch) = if spec.ends_with(".json") || path.is_file() {
        let p = crate::read_plan(path)?;
        let m = u64::from(p.micro_batches.unwrap_or(1));
        (Source::File(Box::new(p)), job.global_batch / m)
    } else {
        let l = Inline::parse(job, spec)?;
        let per_step = l.samples_per_micro_batch;
        (Source::Inline(l), per_step)
    };
    let g = job.build(micro_batch).map_err(user)?;
    let plan = {
        let mut costs = job.costs(&g)?;
        match &source {
            Source::File(p) => from_plan(&costs, p, spec)?,
            Source::Inline(l) => {
                let mut p = layout_plan(&mut costs, l.dp, l.tp, l.pp);
                p.micro_batches = l.micro_batches;
                if let Some(s) = l.schedule {
                    p.schedule = s;
                }
                p.recompute = l.recompute;
                p.zero_stage = l.zero_stage;
                p.batch_norm = l.batch_norm;
                p
            }
        }
    };
    Ok((g, plan))
}

/// The prediction of `plan` (of graph `g`) for `job`.
pub fn predict(job: &GraphModel, g: &Graph, plan: &OpPlan) -> anyhow::Result<OpStepPrediction> {
    let mut costs = job.costs(g)?;
    Ok(simulate_op_plan(&mut costs, plan, job.global_batch)
        .map_err(user)?
        .prediction)
}

/// Where `simulate --plan` takes the per-op plan from.
enum Source {
    File(Box<Plan>),
    Inline(Inline),
}

/// An inline layout of a graph: `dp` sample splits by `tp` parameter splits on each of `pp`
/// stages, fed `micro_batches` micro-batches.
struct Inline {
    dp: u32,
    tp: u32,
    pp: u32,
    micro_batches: u32,
    samples_per_micro_batch: u64,
    schedule: Option<Schedule>,
    recompute: bool,
    zero_stage: u8,
    batch_norm: BatchNormStats,
}

impl Inline {
    /// Parses and checks `dp`, `tp`, `pp`, `mb`, `schedule`, `recompute`, `zero` and `bn` against
    /// the job.
    fn parse(job: &GraphModel, spec: &str) -> anyhow::Result<Inline> {
        let gpus = u64::from(job.cluster.gpus);
        let l = PartialLayout::parse(spec).map_err(|e| user(format!("--plan: {e}")))?;
        for (k, v) in [("cp", l.cp), ("ep", l.ep), ("interleave", l.interleave)] {
            if v.is_some_and(|v| v > 1) {
                return Err(user(format!(
                    "--plan: {k}: {} is a transformer knob; per-op plans of this model take dp, tp, pp, zero, mb, schedule, recompute and bn",
                    job.name
                )));
            }
        }
        if let Some(r) = l
            .recompute
            .filter(|r| !matches!(r, Recompute::None | Recompute::Full))
        {
            return Err(user(format!(
                "--plan: recompute {r} is a transformer policy; a per-op plan of {} recomputes its stages whole (full) or not at all (none)",
                job.name
            )));
        }
        let tp = l.tp.unwrap_or(1);
        let pp = l.pp.unwrap_or(1);
        let dp = match l.dp {
            Some(d) => d,
            None => u32::try_from(gpus / (u64::from(tp) * u64::from(pp))).unwrap_or(0),
        };
        let devices = u64::from(dp) * u64::from(tp) * u64::from(pp);
        if devices != gpus {
            return Err(user(format!(
                "--plan: dp × tp × pp = {devices} but the cluster has {gpus} devices"
            )));
        }
        let mb = l.micro_batch.unwrap_or(job.global_batch / u64::from(dp));
        let per_step = u64::from(dp).saturating_mul(mb);
        if mb == 0 || job.global_batch % per_step != 0 {
            return Err(user(format!(
                "--plan: global batch {} is not a multiple of dp × mb = {per_step}",
                job.global_batch
            )));
        }
        let micro_batches = u32::try_from(job.global_batch / per_step).map_err(|_| {
            user(format!(
                "--plan: {} micro-batches per step are too many",
                job.global_batch / per_step
            ))
        })?;
        Ok(Inline {
            dp,
            tp,
            pp,
            micro_batches,
            samples_per_micro_batch: per_step,
            schedule: l.schedule,
            recompute: l.recompute == Some(Recompute::Full),
            zero_stage: l.zero_stage.unwrap_or(0),
            batch_norm: l.batch_norm.unwrap_or_default(),
        })
    }
}

/// Reads a plan's per-op configurations back; every node must be named, in order.
fn from_plan(costs: &OpCosts, p: &Plan, origin: &str) -> anyhow::Result<OpPlan> {
    let g = costs.graph;
    if p.op_configs.len() != g.nodes.len() {
        return Err(user(format!(
            "{origin}: op_configs: {} entries, the model has {} ops",
            p.op_configs.len(),
            g.nodes.len()
        )));
    }
    let mut configs = Vec::with_capacity(g.nodes.len());
    for (i, (oc, node)) in p.op_configs.iter().zip(&g.nodes).enumerate() {
        let at = format!("{origin}: op_configs[{i}]");
        if oc.node != node.name {
            return Err(user(format!(
                "{at}: node '{}' where the model has '{}'",
                oc.node, node.name
            )));
        }
        let labels: Vec<char> = costs
            .mapping(NodeId(i as u32))
            .labels()
            .map(|(l, _)| l)
            .collect();
        if oc.degrees.len() != labels.len() {
            return Err(user(format!(
                "{at}.degrees: {} values, op '{}' has {} axes",
                oc.degrees.len(),
                node.name,
                labels.len()
            )));
        }
        let degrees = labels
            .iter()
            .zip(&oc.degrees)
            .filter(|(_, d)| **d != 1)
            .map(|(l, d)| (*l, *d))
            .collect();
        let view = view_of(&oc.devices).ok_or_else(|| {
            user(format!(
                "{at}.devices: must be a non-empty run with a constant positive step"
            ))
        })?;
        let cfg = ParallelConfig { degrees, view };
        costs
            .check(NodeId(i as u32), &cfg)
            .map_err(|e| user(format!("{at}: {e}")))?;
        configs.push(cfg);
    }
    Ok(OpPlan {
        configs,
        micro_batches: p.micro_batches.unwrap_or(1),
        schedule: p.layout.schedule,
        recompute: p.layout.recompute == Recompute::Full,
        zero_stage: p.layout.zero_stage,
        batch_norm: p.layout.batch_norm,
    })
}

fn view_of(devices: &[u32]) -> Option<MachineView> {
    let start = *devices.first()?;
    let stride = match devices.get(1) {
        Some(d) => d.checked_sub(start).filter(|s| *s > 0)?,
        None => 1,
    };
    let ok = devices
        .iter()
        .enumerate()
        .all(|(i, d)| u64::from(*d) == u64::from(start) + i as u64 * u64::from(stride));
    ok.then_some(MachineView {
        start,
        size: devices.len() as u32,
        stride,
    })
}

/// The plan as `parallax-plan/1`.
fn plan_document(
    job: &GraphModel,
    cluster_spec: &str,
    costs: &OpCosts,
    plan: &OpPlan,
    p: &OpStepPrediction,
    band: f64,
) -> Plan {
    let g = costs.graph;
    let op_configs = g
        .nodes
        .iter()
        .zip(&plan.configs)
        .enumerate()
        .map(|(i, (n, c))| OpConfig {
            node: n.name.clone(),
            degrees: costs
                .mapping(NodeId(i as u32))
                .labels()
                .map(|(l, _)| c.degree(l))
                .collect(),
            devices: c.view.devices().collect(),
        })
        .collect();
    let (low, high) = band_range(p.step_time_s, band);
    let pp = p.stages.max(1);
    Plan {
        schema: PLAN_SCHEMA.into(),
        // A model read from a file is named by its path, so the plan re-loads it.
        model: ModelRef {
            name: if job.model.origin == "zoo" {
                job.name.clone()
            } else {
                job.model.origin.clone()
            },
        },
        cluster: ClusterRef {
            spec: cluster_spec.to_string(),
            gpus: job.cluster.gpus,
        },
        training: Training {
            global_batch: job.global_batch,
            seq_len: job.seq,
            precision: job.precision,
            fp8_recipe: None,
            async_tp: false,
            compile: false,
            capacity_permille: 0,
            pad_to_capacity: false,
        },
        layout: Layout {
            dp: job.cluster.gpus / pp,
            pp,
            recompute: if plan.recompute {
                Recompute::Full
            } else {
                Recompute::None
            },
            schedule: if pp > 1 {
                plan.schedule
            } else {
                Schedule::None
            },
            zero_stage: plan.zero_stage,
            batch_norm: plan.batch_norm,
            ..Layout::default()
        },
        op_configs,
        micro_batches: Some(plan.micro_batches),
        prediction: Some(Prediction {
            step_time_s: p.step_time_s,
            step_time_s_low: low,
            step_time_s_high: high,
            tokens_per_s: p.samples_per_s,
            mfu: p.mfu,
            peak_memory_gib: p.peak_memory_gib,
            reserved_memory_gib: p.reserved_memory_gib,
            fits: p.fits,
            framework: None,
        }),
    }
}

/// The `simulate --json` keys, for a graph.
fn prediction_json(
    job: &GraphModel,
    costs: &OpCosts,
    plan: &OpPlan,
    p: &OpStepPrediction,
    band: f64,
) -> serde_json::Value {
    let (low, high) = band_range(p.step_time_s, band);
    json!({
        "model": job.name,
        "step_time_s": p.step_time_s,
        "step_time_s_low": low,
        "step_time_s_high": high,
        "samples_per_s": p.samples_per_s,
        "tokens_per_s": p.samples_per_s * job.seq as f64,
        "mfu": p.mfu,
        "peak_memory_gib": p.peak_memory_gib,
        "reserved_memory_gib": p.reserved_memory_gib,
        "capacity_gib": p.capacity_gib,
        "fits": p.fits,
        "layout": summary(costs, plan),
        "stages": p.stages,
        "micro_batches": p.micro_batches,
        "bubble_fraction": p.bubble_fraction,
        "breakdown": p.breakdown,
        "memory": p.memory,
        "device_memory_gib": p.device_memory_gib,
        "used_devices": p.used_devices,
    })
}

/// How one op is split, by role: `sample 8 · parameter(o) 2 @ gpus 0-15`.
fn describe(costs: &OpCosts, i: usize, c: &ParallelConfig) -> String {
    let m = costs.mapping(NodeId(i as u32));
    let parts: Vec<String> = c
        .degrees
        .iter()
        .map(|(l, d)| {
            // Generated labels (views, concatenations) are private-use characters: name them
            // by their dimension of the first tensor that has them.
            let name = if l.is_alphanumeric() {
                l.to_string()
            } else {
                m.outputs
                    .iter()
                    .chain(&m.inputs)
                    .find_map(|t| t.iter().position(|c| c == l))
                    .map_or_else(|| "?".to_string(), |d| format!("dim {d}"))
            };
            let role = match m.axes.get(l).map(|a| a.role) {
                Some(AxisRole::Sample) => "sample".to_string(),
                Some(AxisRole::Attribute) => format!("attribute({name})"),
                _ => format!("parameter({name})"),
            };
            format!("{role} {d}")
        })
        .collect();
    let split = if parts.is_empty() {
        "unsplit".to_string()
    } else {
        parts.join(" · ")
    };
    format!("{split} @ {}", c.view)
}

/// Every op's configuration, described, in node order.
fn descriptions(costs: &OpCosts, plan: &OpPlan) -> Vec<String> {
    (0..plan.configs.len())
        .map(|i| describe(costs, i, &plan.configs[i]))
        .collect()
}

/// One line naming the plan's shape.
pub(crate) fn summary(costs: &OpCosts, plan: &OpPlan) -> String {
    let mut kinds = descriptions(costs, plan);
    kinds.sort();
    kinds.dedup();
    let stages: std::collections::BTreeSet<MachineView> =
        plan.configs.iter().map(|c| c.view).collect();
    let batch_norm = costs
        .graph
        .nodes
        .iter()
        .any(|n| matches!(n.op, OpKind::BatchNorm));
    format!(
        "per-op plan: {} distinct configurations on {} device groups, {} micro-batch{}{}{}",
        kinds.len(),
        stages.len(),
        plan.micro_batches,
        if plan.micro_batches == 1 { "" } else { "es" },
        match plan.zero_stage {
            0 => String::new(),
            z => format!(", ZeRO-{z} over each weight's replicas"),
        },
        match (batch_norm, plan.batch_norm) {
            (false, _) => "",
            (true, BatchNormStats::Sync) => ", synchronised BatchNorm",
            (true, BatchNormStats::Local) => ", per-device BatchNorm statistics",
        }
    )
}

/// Runs of consecutive ops sharing a configuration, one line each.
pub(crate) fn config_lines(costs: &OpCosts, plan: &OpPlan) -> Vec<String> {
    let g = costs.graph;
    let described = descriptions(costs, plan);
    let mut rows: Vec<Vec<String>> = Vec::new();
    let mut i = 0;
    for run in described.chunk_by(|a, b| a == b) {
        let j = i + run.len();
        let ops = if run.len() == 1 {
            g.nodes[i].name.clone()
        } else {
            format!(
                "{} … {} ({} ops)",
                g.nodes[i].name,
                g.nodes[j - 1].name,
                run.len()
            )
        };
        rows.push(vec![ops, run[0].clone()]);
        i = j;
    }
    let mut out = vec![String::new()];
    out.extend(
        table(&["ops", "configuration"], &rows)
            .lines()
            .map(String::from),
    );
    out
}

pub(crate) fn step_lines(gpus: u32, p: &OpStepPrediction, band: f64) -> Vec<String> {
    let (low, high) = band_range(p.step_time_s, band);
    // MFU counts a convolution's direct FLOPs; Winograd and FFT kernels do fewer.
    let fewer_flops = if p.mfu > 1.0 {
        " (over 100 %: Winograd / FFT convolutions do fewer FLOPs than the direct count)"
    } else {
        ""
    };
    let mut v = vec![
        format!(
            "step time   {:.4} s ({low:.4}–{high:.4} s) · {:.1} samples/s · MFU {:.1} %{fewer_flops}",
            p.step_time_s,
            p.samples_per_s,
            p.mfu * 100.0
        ),
        format!(
            "memory      {} reserved ({} allocated) of {} per GPU ({} of {} GPUs used, {} stage{}, {} micro-batch{}, bubble {:.0} %)",
            bytes(p.reserved_memory_gib * GIB),
            bytes(p.peak_memory_gib * GIB),
            bytes(p.capacity_gib * GIB),
            p.used_devices,
            gpus,
            p.stages,
            if p.stages == 1 { "" } else { "s" },
            p.micro_batches,
            if p.micro_batches == 1 { "" } else { "es" },
            p.bubble_fraction * 100.0
        ),
    ];
    let parts: Vec<String> = p
        .breakdown
        .parts()
        .into_iter()
        .filter(|(_, x)| *x > 0.0)
        .map(|(k, x)| format!("{k} {x:.4} s"))
        .collect();
    v.push(format!("where       {}", parts.join(", ")));
    if !p.fits {
        v.push(format!(
            "does not fit: {:.1} GiB needed on the fullest GPU, {:.1} GiB there",
            p.reserved_memory_gib, p.capacity_gib
        ));
    }
    v
}

fn report_lines(
    job: &GraphModel,
    cluster_spec: &str,
    costs: &OpCosts,
    r: &GraphPlan,
    p: &OpStepPrediction,
    band: f64,
) -> Vec<String> {
    let mut v = vec![
        format!(
            "{} on {cluster_spec} ({} GPUs), global batch {}{}, {}",
            job.name,
            job.cluster.gpus,
            job.global_batch,
            if job.seq > 1 {
                format!(" × seq {}", job.seq)
            } else {
                String::new()
            },
            job.precision.name()
        ),
        format!("best plan   {}", summary(costs, &r.plan)),
    ];
    v.extend(step_lines(job.cluster.gpus, p, band));
    if let Some(dp) = &r.data_parallel {
        v.push(format!(
            "vs DP       {:.2}× the speed of data parallelism ({:.4} s per step)",
            dp.step_time_s / p.step_time_s,
            dp.step_time_s
        ));
    }
    if let Some((name, u)) = &r.best_uniform {
        v.push(format!(
            "vs uniform  {:.2}× the best uniform pattern ({name}, {:.4} s)",
            u.step_time_s / p.step_time_s,
            u.step_time_s
        ));
    }
    let rejected: Vec<String> = r
        .counts
        .rejected
        .iter()
        .map(|(k, n)| format!("{n} {k}"))
        .collect();
    v.push(format!(
        "search      {} candidate op configurations; {} plans simulated{}; {} MCMC moves accepted; sequential optimum {}",
        r.counts.candidates,
        r.counts.simulated,
        if rejected.is_empty() {
            String::new()
        } else {
            format!(" ({} rejected)", rejected.join(", "))
        },
        r.counts.accepted,
        if r.counts.exact { "exact (graph reduced)" } else { "approximate (graph did not reduce)" }
    ));
    if let Some(w) = batchnorm_warning(costs, &r.plan) {
        v.push(format!("warning     {w}"));
    }
    v.extend(config_lines(costs, &r.plan));
    v
}

/// A warning when BatchNorm's statistics cover too few samples: a micro-batch's under
/// synchronised statistics, each device's share of it under local ones.
fn batchnorm_warning(costs: &OpCosts, plan: &OpPlan) -> Option<String> {
    let local = plan.batch_norm == BatchNormStats::Local;
    let g = costs.graph;
    let smallest = g
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| matches!(n.op, OpKind::BatchNorm))
        .map(|(i, _)| {
            let (ins, _) = costs.shapes(NodeId(i as u32));
            let m = costs.mapping(NodeId(i as u32));
            let n = ins[0].dims().first().copied().unwrap_or(1);
            if !local {
                return n;
            }
            let split = m
                .labels()
                .filter(|(_, a)| a.role == AxisRole::Sample)
                .map(|(l, _)| u64::from(plan.configs[i].degree(l)))
                .product::<u64>();
            n / split.max(1)
        })
        .min()?;
    (smallest < BATCHNORM_MIN_PER_DEVICE).then(|| {
        format!(
            "BatchNorm's statistics cover {smallest} samples{} (below {BATCHNORM_MIN_PER_DEVICE}): they get noisy and convergence can suffer; use {}GroupNorm, or a larger batch",
            if local { " per device" } else { " per micro-batch" },
            if local { "synchronised BatchNorm (drop bn=local), " } else { "fewer micro-batches, " }
        )
    })
}

const OUT_FILES: [&str; 5] = [
    "plan.json",
    "report.md",
    "trace.json",
    "timeline.svg",
    "memory.svg",
];

fn write_out(
    dir: &Path,
    plan: &Plan,
    sim: &SimulatedOpStep,
    report: &[String],
) -> anyhow::Result<()> {
    let write = |name: &str, text: String| {
        std::fs::write(dir.join(name), text)
            .map_err(|e| user(format!("--out {}: cannot write {name}: {e}", dir.display())))
    };
    write("plan.json", plan.to_json())?;
    let timeline = gantt_svg(&sim.graph, &sim.resources, &sim.trace).map_err(user)?;
    let p = &sim.prediction;
    let memory = device_memory_svg(&p.device_memory_gib, p.capacity_gib).map_err(user)?;
    write("timeline.svg", timeline)?;
    write("memory.svg", memory)?;
    let mut md = String::from("# parallax plan\n\n```\n");
    for l in report {
        md.push_str(l);
        md.push('\n');
    }
    md.push_str(
        "```\n\n![predicted timeline](timeline.svg)\n\n![peak memory per device](memory.svg)\n",
    );
    write("report.md", md)?;
    let trace = sim.trace.to_chrome_trace(&sim.graph, &sim.resources);
    write("trace.json", serde_json::to_string(&trace)?)?;
    Ok(())
}
