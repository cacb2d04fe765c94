//! `parallax plan`: the best layouts of a model on a cluster, why they win, and the files to
//! run them.

use crate::fmt::table;
use crate::job::{JobArgs, Loaded};
use crate::user;
use anyhow::Context;
use clap::Args as ClapArgs;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use parallax_cost::transformer::Setup;
use parallax_hardware::Cluster;
use parallax_ir::PartialLayout;
use parallax_planner::export::{export_onto, Engine};
use parallax_planner::plots::{breakdown_svg, gantt_svg, memory_svg, sweep_svg};
use parallax_planner::report::{
    explain, guidance, headline, html, json_document, markdown, plan_document, short_layout,
    sweep_cells, table_cells, ReportInput, Svgs, SweepPoint,
};
use parallax_planner::search;
use parallax_planner::search::{
    search_with_progress, Progress, SearchError, SearchOptions, SearchResult,
};
use parallax_planner::Framework;
use parallax_sim::simulate_step;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Search every layout of a model on a cluster and explain the best.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    job: JobArgs,
    /// Plans to list.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Print one JSON document.
    #[arg(long)]
    json: bool,
    /// Write plan.json, report.md, report.html, SVG plots and trace.json into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Overwrite files of an earlier report in --out.
    #[arg(long)]
    force: bool,
    /// Also write the plan for this engine (megatron, deepspeed, torchtitan); the search then
    /// stays within what the engine can run.
    #[arg(long)]
    export: Option<String>,
    /// Also plan for whole-node GPU counts doubling up to N, and plot throughput against count.
    #[arg(long)]
    max_gpus: Option<u32>,
    /// Let tensor parallelism span nodes.
    #[arg(long)]
    allow_tp_across_nodes: bool,
    /// Fix knobs, inline (e.g. `tp=8,zero=1`); the rest are searched.
    #[arg(long)]
    fix: Option<String>,
    /// Only even stage splits (no balanced partitions).
    #[arg(long)]
    even_stages: bool,
    /// Per-op plans of non-transformer graphs: refine by MCMC for this many seconds instead of
    /// the default 200 proposals (more proposals, but the plan then depends on the machine's
    /// speed).
    #[arg(long, value_name = "SECONDS")]
    search_seconds: Option<f64>,
}

/// Files `--out` writes.
const OUT_FILES: [&str; 8] = [
    "plan.json",
    "report.md",
    "report.html",
    "trace.json",
    "breakdown.svg",
    "memory.svg",
    "timeline.svg",
    "sweep.svg",
];

/// A progress bar on stderr that appears once a search has run for a second.
struct Bar {
    bar: ProgressBar,
    start: Instant,
    enabled: bool,
}

impl Bar {
    fn new(enabled: bool) -> Bar {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::hidden());
        if let Ok(style) =
            ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} groups ({elapsed})")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        Bar {
            bar,
            start: Instant::now(),
            enabled,
        }
    }

    fn update(&self, p: Progress, msg: &str) {
        if !self.enabled {
            return;
        }
        self.bar.set_length(p.total);
        self.bar.set_position(p.done);
        if self.bar.is_hidden() && self.start.elapsed() > Duration::from_secs(1) {
            self.bar.set_message(msg.to_string());
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let engine: Option<Engine> = a
        .export
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(|e| user(format!("--export: {e}")))?;
    if a.top == 0 {
        return Err(user("--top: must be at least 1"));
    }
    let fix = match &a.fix {
        Some(s) => PartialLayout::parse(s).map_err(|e| user(format!("--fix: {e}")))?,
        None => PartialLayout::default(),
    };
    let budget = match a.search_seconds {
        Some(x) if !(x.is_finite() && x > 0.0 && x <= 86_400.0) => {
            return Err(user(format!(
                "--search-seconds {x}: must be a number of seconds in (0, 86400]"
            )))
        }
        x => x.map(std::time::Duration::from_secs_f64),
    };
    let mut job = match a.job.load()? {
        Loaded::Transformer(job) => {
            fix.check_transformer()
                .map_err(|e| user(format!("--fix: {e}")))?;
            if budget.is_some() {
                return Err(user(format!(
                    "--model {}: --search-seconds applies to per-op plans of other graphs; the transformer search is exhaustive (pruned), not timed",
                    a.job.model
                )));
            }
            job
        }
        Loaded::Graph(mut g) => {
            if engine.is_some() || a.max_gpus.is_some() {
                return Err(user(format!(
                    "--model {}: --export and --max-gpus apply to transformers; per-op plans of other graphs take --top, --json, --out and --fix bn=…",
                    a.job.model
                )));
            }
            if fix
                != (PartialLayout {
                    batch_norm: fix.batch_norm,
                    ..PartialLayout::default()
                })
            {
                return Err(user(format!(
                    "--fix: per-op plans of {} fix only bn (sync or local); their splits are searched op by op",
                    a.job.model
                )));
            }
            g.batch_norm = fix.batch_norm.unwrap_or_default();
            return crate::general::plan(
                &g,
                &a.job.cluster,
                a.json,
                a.out.as_deref(),
                a.force,
                budget,
            );
        }
    };
    if let Some(why) = engine.and_then(|e| e.supports_job(&job.model, job.precision)) {
        return Err(user(format!(
            "--export {}: {why}",
            a.export.as_deref().unwrap_or("")
        )));
    }
    let cluster = &job.cluster;
    if let Some(n) = a.max_gpus {
        if n == 0 {
            return Err(user("--max-gpus: must be at least 1"));
        }
    }
    if let Some(dir) = &a.out {
        let names = OUT_FILES.into_iter().chain(engine.map(|e| e.file_name()));
        crate::prepare_out(dir, names, a.force)?;
    }
    // Predict what the engine the plan is exported to will run: `--export E` is E's current
    // stack, and a `--framework` beside it must be that stack.
    if let Some(e) = engine {
        // The engine's stack with the options chosen, which a named stack must equal.
        let stack = a
            .job
            .with_options(Framework::for_engine(e), job.fp8_recipe)?;
        let stack = crate::job::with_ds_config(stack, job.ds_config.as_deref())?;
        let same = |f: &Framework| f.runtime == stack.runtime && f.space == stack.space;
        if a.job.framework.is_some() && !same(&job.framework) {
            return Err(user(format!(
                "--framework {}: --export {e} plans for {e}'s current stack ({}); leave --framework out",
                job.framework.name, stack.name
            )));
        }
        job.framework = stack;
    }
    let mut setup = job.setup();
    setup.runtime.allow_tp_across_nodes = a.allow_tp_across_nodes;
    let force = job.fixes("--fix", fix.clone())?;
    let sweep_force = job.fixes_at_any_count("--fix", fix)?;
    job.note_unpriced();
    let opts = SearchOptions {
        top_k: a.top,
        force,
        force_even_stages: a.even_stages,
        space: job.framework.space.clone(),
        engine,
        ..SearchOptions::default()
    };
    let bar = Bar::new(!a.json && std::io::stderr().is_terminal());
    let result = search_with_progress(&setup, &opts, &|p| {
        bar.update(p, &format!("searching {} GPUs", cluster.gpus))
    })
    .map_err(user)?;

    let sweep = match a.max_gpus {
        Some(n) => sweep_counts(cluster, n)
            .into_iter()
            .map(|gpus| {
                bar.update(
                    Progress { done: 0, total: 1 },
                    &format!("sweep: {gpus} GPUs"),
                );
                let o = SearchOptions {
                    force: sweep_force.clone(),
                    ..opts.clone()
                };
                sweep_point(&setup, &o, cluster, gpus, &result)
            })
            .collect(),
        None => Vec::new(),
    };
    bar.finish();

    let input = ReportInput {
        setup: &setup,
        model_name: &a.job.model,
        cluster_spec: &a.job.cluster,
        result: &result,
        band: parallax_cost::step_time_band(&cluster.profile),
        sweep: &sweep,
        framework: &job.framework.name,
    };
    let best = result.best();
    let plan = plan_document(&input, best);
    // A DeepSpeed export is written onto the run's own ds_config, its other keys kept.
    let onto = job.ds_config.as_deref().map(|(c, _)| &c.document);
    let exported = match engine {
        Some(e) => Some((e, export_onto(e, &plan, &job.model, onto).map_err(user)?)),
        None => None,
    };

    if let Some(dir) = &a.out {
        write_out(dir, &input, &setup, best, &plan, exported.as_ref())?;
    }

    if a.json {
        let mut doc = json_document(&input);
        if let Some((e, text)) = &exported {
            doc["export"] =
                serde_json::json!({ "engine": e.name(), "file": e.file_name(), "text": text });
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    for line in headline(&input) {
        println!("{line}");
    }
    println!("\nwhy it wins");
    for line in explain(&input) {
        println!("  - {line}");
    }
    println!("\nguidance");
    for line in guidance(&input) {
        println!("  - {line}");
    }
    println!("\ntop {} plans", result.top.len());
    let (h, rows) = table_cells(&input);
    print!("{}", table(&h, &rows));
    if !sweep.is_empty() {
        println!("\nGPU-count sweep");
        let (header, rows) = sweep_cells(&sweep);
        print!("{}", table(&header, &rows));
    }
    if let Some(dir) = &a.out {
        println!("\nwrote {}", dir.display());
    }
    if let Some((e, text)) = &exported {
        match &a.out {
            Some(dir) => println!("{} config: {}", e, dir.join(e.file_name()).display()),
            None => {
                println!("\n{} ({})", e, e.file_name());
                print!("{text}");
            }
        }
    }
    Ok(())
}

/// GPU counts of a `--max-gpus` sweep: whole nodes doubling from one node up to `max`, plus
/// the cluster's own count and `max` when they are whole nodes.
fn sweep_counts(cluster: &Cluster, max: u32) -> Vec<u32> {
    let gpn = cluster.profile.node.gpus_per_node.max(1);
    let mut v = Vec::new();
    let mut n = gpn.min(max);
    while n <= max {
        v.push(n);
        match n.checked_mul(2) {
            Some(x) => n = x,
            None => break,
        }
    }
    for extra in [cluster.gpus, max] {
        if extra <= max && (extra % gpn == 0 || extra < gpn) {
            v.push(extra);
        }
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// The best plan at `gpus` (the main result when it is the cluster's count).
fn sweep_point(
    setup: &Setup,
    opts: &SearchOptions,
    cluster: &Cluster,
    gpus: u32,
    main: &SearchResult,
) -> SweepPoint {
    if gpus == cluster.gpus {
        return SweepPoint {
            gpus,
            best: Some(main.best().clone()),
            note: None,
        };
    }
    let s = Setup { gpus, ..*setup };
    let o = SearchOptions {
        top_k: 1,
        families: false,
        ..opts.clone()
    };
    match search(&s, &o) {
        Ok(r) => SweepPoint {
            gpus,
            best: Some(r.best().clone()),
            note: None,
        },
        Err(SearchError::DoesNotFit { need_gib, .. }) => SweepPoint {
            gpus,
            best: None,
            note: Some(format!("nothing fits (needs {need_gib:.0} GiB per GPU)")),
        },
        Err(e) => SweepPoint {
            gpus,
            best: None,
            note: Some(short_reason(&e.to_string())),
        },
    }
}

fn short_reason(s: &str) -> String {
    let first = s.split(';').next().unwrap_or(s);
    first.split(" (").next().unwrap_or(first).to_string()
}

fn write_out(
    dir: &Path,
    input: &ReportInput,
    setup: &Setup,
    best: &parallax_planner::Evaluated,
    plan: &parallax_ir::Plan,
    exported: Option<&(Engine, String)>,
) -> anyhow::Result<()> {
    let write = |name: &str, text: &str| -> anyhow::Result<()> {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
    };
    let step = simulate_step(setup, &best.layout)
        .with_context(|| "re-simulating the best plan for its timeline")?;
    let labels: Vec<String> = input
        .result
        .top
        .iter()
        .enumerate()
        .map(|(i, e)| format!("{} {}", i + 1, short_layout(&e.layout)))
        .collect();
    let mut svgs: Svgs = vec![
        (
            "breakdown.svg".into(),
            breakdown_svg(&input.result.top, &labels)?,
        ),
        (
            "memory.svg".into(),
            memory_svg(
                &best.prediction.stage_memory_gib,
                best.prediction.capacity_gib,
            )?,
        ),
        (
            "timeline.svg".into(),
            gantt_svg(&step.graph, &step.resources, &step.trace)?,
        ),
    ];
    let points: Vec<(u32, f64)> = input
        .sweep
        .iter()
        .filter_map(|p| p.best.as_ref().map(|e| (p.gpus, e.prediction.tokens_per_s)))
        .collect();
    if points.len() >= 2 {
        svgs.push(("sweep.svg".into(), sweep_svg(&points)?));
    }
    write("plan.json", &(plan.to_json() + "\n"))?;
    let trace = step.trace.to_chrome_trace(&step.graph, &step.resources);
    write("trace.json", &serde_json::to_string(&trace)?)?;
    for (name, svg) in &svgs {
        write(name, svg)?;
    }
    write("report.md", &markdown(input, &svgs))?;
    write("report.html", &html(input, &svgs))?;
    if let Some((e, text)) = exported {
        write(e.file_name(), text)?;
    }
    Ok(())
}
