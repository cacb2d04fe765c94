//! `parallax run`: train a model under a layout with the executor, and compare the measured
//! step time with the simulator's prediction for the same layout.

use crate::general::{self, GraphModel};
use crate::user;
use clap::Args as ClapArgs;
use parallax_cost::transformer::Setup;
use parallax_executor::graph::{
    with_training_loss, GraphData, GraphOptimizer, GraphRunSpec, ImageSet,
};
use parallax_executor::{
    run as exec_run, state, Backend, DataSource, ExecError, ModelState, RunReport, RunSpec, Span,
    StepStats,
};
use parallax_hardware::{preset, Cluster, CPU_LOCAL};
use parallax_ir::models::TransformerConfig;
use parallax_ir::{load_model, Layout, PartialLayout, Precision, Schedule};
use parallax_planner::Framework;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Train a model under a layout (a plan file, or --model/--plan/--global-batch) and measure it.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// A plan file (`parallax-plan/1`) to run.
    plan_file: Option<PathBuf>,
    /// Zoo name or HuggingFace config.json of a GPT or Llama model (instead of a plan file).
    #[arg(long)]
    model: Option<String>,
    /// Inline layout (`dp=2,tp=2,pp=2,zero=1,mb=1,recompute=selective,sp=true,schedule=1f1b,v=1`)
    /// or a plan file; keys left out default to 1 / off (dp fills --cluster's devices).
    #[arg(long)]
    plan: Option<String>,
    /// Sequences per optimizer step.
    #[arg(long)]
    global_batch: Option<u64>,
    /// Tokens per sequence (default: the plan's, else the model's maximum).
    #[arg(long)]
    seq: Option<u64>,
    /// Cluster whose profile predicts the step time: `PRESET:gpus=N` or a profile TOML
    /// (default: cpu-local with as many devices as the layout needs).
    #[arg(long)]
    cluster: Option<String>,
    /// Backend: threads (built in), mpi or cuda (cargo features).
    #[arg(long, default_value = "threads")]
    backend: String,
    /// Optimizer steps to run.
    #[arg(long, default_value_t = 10)]
    steps: u64,
    /// Seed of initialisation and data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train on this text file, byte-level (vocabulary 256), instead of synthetic tokens.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Write a checkpoint to this folder at the end (atomically: temp + rename).
    #[arg(long)]
    save: Option<PathBuf>,
    /// With --save: also every this many steps.
    #[arg(long, requires = "save")]
    save_every: Option<u64>,
    /// Continue from the newest checkpoint in this folder.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f32,
    /// Seconds a rank waits for another before the run is ended with an error naming it.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// The stack the prediction beside the measurement models, `NAME@VERSION` (`parallax
    /// frameworks`); default: parallax's own executor, the one that runs.
    #[arg(long, value_name = "NAME@VERSION")]
    framework: Option<String>,
    /// Print one JSON document.
    #[arg(long)]
    json: bool,
    /// Write the measured timeline as a Chrome / Perfetto trace to this file.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Overwrite an existing --trace file, and save into a --save folder that holds other
    /// files or another run's checkpoints.
    #[arg(long)]
    force: bool,
}

/// What to run, resolved from a plan file or flags.
struct Job {
    model_name: String,
    model: TransformerConfig,
    layout: Layout,
    global_batch: u64,
    seq: u64,
    cluster: Option<String>,
}

/// The transformer `name` and the sequence length to train it at (`seq`, else its maximum),
/// checked against what it can take.
fn transformer(name: &str, seq: Option<u64>) -> anyhow::Result<(TransformerConfig, u64)> {
    let m = load_model(name).map_err(user)?;
    let t = m.transformer().cloned().ok_or_else(|| {
        user(format!(
            "--model {name}: the executor trains GPT and Llama transformers; this model is not one"
        ))
    })?;
    let seq = seq.unwrap_or(t.max_seq);
    m.check_seq(seq).map_err(user)?;
    Ok((t, seq))
}

fn resolve(a: &Args) -> anyhow::Result<Job> {
    let plan_path = match (&a.plan_file, &a.plan) {
        (Some(p), None) => Some(p.clone()),
        (None, Some(p)) if p.ends_with(".json") => Some(PathBuf::from(p)),
        (Some(_), Some(_)) => {
            return Err(user("give either a plan file or --plan, not both"));
        }
        _ => None,
    };
    if let (Some(path), Some(m)) = (&plan_path, &a.model) {
        return Err(user(format!(
            "--model {m}: {} names its model; give either a plan file or --model, not both",
            path.display()
        )));
    }
    if let Some(path) = plan_path {
        let plan = crate::read_plan(&path)?;
        let (model, seq) = transformer(
            &plan.model.name,
            Some(a.seq.unwrap_or(plan.training.seq_len)),
        )?;
        let global_batch = a.global_batch.unwrap_or(plan.training.global_batch);
        crate::job::check_batch("--global-batch", global_batch)?;
        return Ok(Job {
            model_name: plan.model.name.clone(),
            model,
            layout: plan.layout,
            global_batch,
            seq,
            cluster: a.cluster.clone().or(Some(plan.cluster.spec)),
        });
    }
    let (Some(name), Some(inline), Some(gb)) = (&a.model, &a.plan, a.global_batch) else {
        return Err(user(
            "give a plan file, or --model, --plan and --global-batch (see --help)",
        ));
    };
    let (model, seq) = transformer(name, a.seq)?;
    crate::job::check_batch("--global-batch", gb)?;
    let p = PartialLayout::parse_transformer(inline).map_err(|e| user(format!("--plan: {e}")))?;
    let (tp, pp, cp) = (p.tp.unwrap_or(1), p.pp.unwrap_or(1), p.cp.unwrap_or(1));
    let dp = match (p.dp, &a.cluster) {
        (Some(dp), _) => dp,
        (None, Some(c)) => {
            let cl = Cluster::parse(c).map_err(user)?;
            (cl.gpus / tp.saturating_mul(pp).saturating_mul(cp).max(1)).max(1)
        }
        (None, None) => 1,
    };
    let interleave = p.interleave.unwrap_or(1);
    let schedule = p.schedule.unwrap_or(match (pp, interleave) {
        (1, _) => Schedule::None,
        (_, 1) => Schedule::OneFOneB,
        _ => Schedule::Interleaved1F1B,
    });
    let layout = Layout {
        dp,
        tp,
        pp,
        cp,
        ep: p.ep.unwrap_or(1),
        etp: p.etp,
        dispatcher: p.dispatcher.unwrap_or_default(),
        // The executor trains it as written (same arithmetic); its dispatch is not overlapped.
        ep_overlap: p.ep_overlap.unwrap_or(false),
        zero_stage: p.zero_stage.unwrap_or(0),
        micro_batch: p.micro_batch.unwrap_or(1),
        recompute: p.recompute.unwrap_or_default(),
        sequence_parallel: p.sequence_parallel.unwrap_or(false),
        schedule,
        interleave,
        offload: p.offload.unwrap_or_default(),
        batch_norm: Default::default(),
        stages: Vec::new(),
    };
    Ok(Job {
        model_name: name.clone(),
        model,
        layout,
        global_batch: gb,
        seq,
        cluster: a.cluster.clone(),
    })
}

/// The longest `--timeout` accepted (about 31 years).
const MAX_TIMEOUT_S: f64 = 1e9;

/// `--trace FILE` is written after training: refuse, before the first step, a file that
/// exists (unless `force`) or a folder that does not.
fn check_trace_path(path: &std::path::Path, force: bool) -> anyhow::Result<()> {
    if path.is_dir() {
        return Err(user(format!("--trace {}: is a folder", path.display())));
    }
    crate::refuse_overwrite(path, force)?;
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !parent.is_dir() {
        return Err(user(format!(
            "--trace {}: folder {} does not exist",
            path.display(),
            parent.display()
        )));
    }
    Ok(())
}

/// `--save DIR` must be a folder that can be written and that holds nothing but checkpoints of
/// this run: a user's files, another run's checkpoints (unless `DIR` holds the one resumed)
/// and a checkpoint this run would replace (a resumed run writes steps `start+1 ..= start+steps`,
/// every `every` steps and the last) are only written over with `force`. Created here, before
/// the first step.
fn check_save_dir(
    dir: &std::path::Path,
    resume: Option<&std::path::Path>,
    (start, steps, every): (u64, u64, Option<u64>),
    force: bool,
) -> anyhow::Result<()> {
    let shown = dir.display();
    if dir.exists() && !dir.is_dir() {
        return Err(user(format!("--save {shown}: exists and is not a folder")));
    }
    if dir.is_dir() && !force {
        let resuming_here = resume.is_some_and(|r| {
            let canon = |p: &std::path::Path| std::fs::canonicalize(p).ok();
            canon(r).is_some_and(|r| canon(dir).is_some_and(|d| r == d || r.starts_with(&d)))
        });
        let end = start.saturating_add(steps);
        let entries = std::fs::read_dir(dir)
            .map_err(|e| user(format!("--save {shown}: cannot read: {e}")))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let step = name
                .strip_prefix("step-")
                .and_then(|n| n.parse::<u64>().ok())
                .filter(|_| entry.path().join("state.json").is_file());
            // Checkpoints, LATEST, and the temporary names saves and these checks use (another
            // MPI rank's probe included).
            let ours = step.is_some()
                || name == "LATEST"
                || name == SAVE_LOCK
                || [".step-", ".LATEST.tmp-", ".parallax-probe-"]
                    .iter()
                    .any(|p| name.starts_with(p));
            if !ours {
                return Err(user(format!(
                    "--save {shown}: holds {name}, which is not a checkpoint; pass --force to save beside it"
                )));
            }
            let Some(n) = step else { continue };
            if !resuming_here {
                return Err(user(format!(
                    "--save {shown}: holds another run's checkpoint {name}; pass --resume {shown} to continue it, or --force to save beside it"
                )));
            }
            let written =
                n > start && n <= end && (n == end || every.is_some_and(|k| (n - start) % k == 0));
            if written {
                return Err(user(format!(
                    "--save {shown}: this run would replace the checkpoint {name}; pass --force to replace it, or save elsewhere"
                )));
            }
        }
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| user(format!("--save {shown}: cannot create: {e}")))?;
    let probe = dir.join(format!(".parallax-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| user(format!("--save {shown}: cannot write: {e}")))
}

/// The file a run holds in its `--save` folder while it may write checkpoints there.
const SAVE_LOCK: &str = ".parallax-lock";

/// Held while a run may save into its `--save` folder: two runs saving into one folder at
/// once would interleave their checkpoints and `LATEST`. The file names the holder's process;
/// a lock whose process is gone (a killed run) is taken over, and `--force` takes over any.
/// Under MPI only rank 0 takes it (it alone writes checkpoints).
struct SaveLock(std::path::PathBuf);

impl SaveLock {
    fn take(dir: &std::path::Path, force: bool) -> anyhow::Result<Option<SaveLock>> {
        let rank = ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
            .iter()
            .find_map(|v| std::env::var(v).ok());
        if rank.is_some_and(|r| r != "0") {
            return Ok(None);
        }
        let path = dir.join(SAVE_LOCK);
        let me = std::process::id();
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    use std::io::Write;
                    f.write_all(me.to_string().as_bytes()).map_err(|e| {
                        user(format!("--save {}: cannot write: {e}", dir.display()))
                    })?;
                    return Ok(Some(SaveLock(path)));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder = std::fs::read_to_string(&path)
                        .ok()
                        .and_then(|t| t.trim().parse::<u32>().ok());
                    let alive = holder.is_some_and(|pid| pid != me && !state::process_gone(pid));
                    if alive && !force {
                        return Err(user(format!(
                            "--save {}: another run (process {}) is saving here; wait for it to end, save elsewhere, or pass --force if it is gone",
                            dir.display(),
                            holder.unwrap_or_default()
                        )));
                    }
                    std::fs::remove_file(&path).ok();
                }
                Err(e) => return Err(user(format!("--save {}: cannot write: {e}", dir.display()))),
            }
        }
        Err(user(format!(
            "--save {}: another run took the folder at the same moment; save elsewhere",
            dir.display()
        )))
    }
}

impl Drop for SaveLock {
    fn drop(&mut self) {
        let mine = std::fs::read_to_string(&self.0)
            .is_ok_and(|t| t.trim() == std::process::id().to_string());
        if mine {
            std::fs::remove_file(&self.0).ok();
        }
    }
}

/// The cluster for the prediction when none is given: cpu-local with one core per rank (a
/// copy with more cores per node when the layout needs more ranks than this machine has).
fn cpu_local_cluster(devices: u32) -> anyhow::Result<Cluster> {
    let mut p = preset(CPU_LOCAL).map_err(user)?;
    if p.node.gpus_per_node < devices {
        p.node.gpus_per_node = devices;
    }
    Cluster::new(p, devices).map_err(user)
}

/// Why a cuda run is not predicted on this machine's CPU cores: they are not what it computes
/// on, and its GPU path is not what the simulator models (measured on an H200: gpt2 8.8 s a
/// step against 0.09 s predicted for a device-resident run; on an H100, the general trainer's
/// resnet50 at batch 8 spends as long in its host-side layers as the threads backend).
const CUDA_NOT_PREDICTED: &str = "the cuda backend keeps weights and activations in host memory and moves them over PCIe around every GEMM, which the simulator does not model; pass --cluster to see what a device-resident run of this layout takes";

/// What the simulator predicts for the executor's run.
struct Predicted {
    step_time_s: f64,
    /// Peak memory of the fullest rank, GiB.
    peak_gib: f64,
    /// The cluster it was predicted on.
    cluster: String,
    /// The stack it was predicted on.
    framework: String,
}

/// The run predicted on `stack` (the executor's own: fp32, unfused attention, gradient
/// reduction and tensor-parallel collectives not overlapped, non-blocking sends).
fn predict(
    job: &Job,
    given: Option<&Cluster>,
    backend: Backend,
    stack: &Framework,
) -> Result<Predicted, String> {
    let cluster = match given {
        Some(c) => c.clone(),
        None if backend == Backend::Cuda => return Err(CUDA_NOT_PREDICTED.into()),
        None => {
            let devices =
                u32::try_from(job.layout.devices()).map_err(|_| "too many devices".to_string())?;
            cpu_local_cluster(devices).map_err(|e| e.to_string())?
        }
    };
    let setup = Setup {
        model: &job.model,
        profile: &cluster.profile,
        gpus: cluster.gpus,
        precision: Precision::Fp32,
        seq: job.seq,
        global_batch: job.global_batch,
        runtime: stack.runtime,
    };
    let sim = parallax_sim::simulate_step(&setup, &job.layout).map_err(|e| e.to_string())?;
    Ok(Predicted {
        step_time_s: sim.prediction.step_time_s,
        peak_gib: sim.prediction.peak_memory_gib,
        cluster: cluster.to_string(),
        framework: stack.name.clone(),
    })
}

/// Memory this machine can still give, GiB (`MemAvailable`), where the system says.
fn host_available_gib() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / (1024.0 * 1024.0))
}

/// Ranks on this host hold their parameters, gradients, Adam state and activations in host
/// memory: refuse, before allocating, a run the memory model says cannot fit.
fn check_host_memory(job: &Job, predicted: &Predicted) -> anyhow::Result<()> {
    let ranks = job.layout.devices() as f64;
    let need = predicted.peak_gib * ranks;
    match host_available_gib() {
        Some(have) if need > have => Err(user(format!(
            "--model {}: the CPU executor needs ~{need:.1} GiB ({ranks} ranks × {:.2} GiB of fp32 parameters, gradients, Adam state and activations); this machine has {have:.1} GiB available",
            job.model_name, predicted.peak_gib
        ))),
        _ => Ok(()),
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    v[v.len() / 2]
}

/// The state `--resume` names, checked to continue for `--steps`.
fn load_resume(a: &Args) -> anyhow::Result<Option<Arc<ModelState>>> {
    let Some(dir) = &a.resume else {
        return Ok(None);
    };
    let st = state::load(dir).map_err(|(p, r)| user(format!("--resume {p}: {r}")))?;
    if st.step.checked_add(a.steps).is_none() {
        return Err(user(format!(
            "--resume {}: step {} cannot be continued by {} steps",
            dir.display(),
            st.step,
            a.steps
        )));
    }
    Ok(Some(Arc::new(st)))
}

/// Checks and locks the `--save` folder before the first step; returns the lock and the
/// folder when this run created it (removed again if the run fails before saving).
fn prepare_save(
    a: &Args,
    resume: Option<&ModelState>,
) -> anyhow::Result<(Option<SaveLock>, Option<PathBuf>)> {
    let Some(dir) = &a.save else {
        return Ok((None, None));
    };
    let created = (!dir.exists()).then(|| dir.clone());
    let start = resume.map_or(0, |r| r.step);
    check_save_dir(
        dir,
        a.resume.as_deref(),
        (start, a.steps, a.save_every),
        a.force,
    )?;
    Ok((SaveLock::take(dir, a.force)?, created))
}

/// With `--save DIR`: writes each checkpoint into `DIR` with `about` (what was run) and the
/// seed and learning rate in its header.
fn checkpoint_hook(
    a: &Args,
    mut about: Value,
) -> Option<parallax_executor::engine::CheckpointHook> {
    let dir = a.save.clone()?;
    about["seed"] = json!(a.seed);
    about["lr"] = json!(a.lr);
    Some(Arc::new(move |st: &ModelState| {
        state::save(&dir, st, about.clone()).map(|_| ())
    }))
}

/// Prints a line per step (to stderr under `--json`); a reader that goes away (`| head -n 1`)
/// must not end the run: the lines stop and training goes on to its last step and checkpoint.
fn step_printer(quiet: bool, unit: &'static str) -> parallax_executor::engine::StepHook {
    let printing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    Arc::new(move |s: &StepStats| {
        use std::io::Write;
        use std::sync::atomic::Ordering;
        let line = format!(
            "step {:>5}  loss {:.4}  time {:.3} s  {:.0} {unit}",
            s.step, s.loss, s.time_s, s.tokens_per_s
        );
        if !printing.load(Ordering::Relaxed) {
            return;
        }
        let written = if quiet {
            writeln!(std::io::stderr(), "{line}")
        } else {
            writeln!(std::io::stdout(), "{line}")
        };
        if written.is_err() {
            printing.store(false, Ordering::Relaxed);
        }
    })
}

/// A finished run as the command reports it: on failure the save folder this run created
/// is removed again (a folder made for checkpoints stays only if one was written into it),
/// and the error becomes one line naming the flag at fault — `rest` names the model or plan
/// for the errors that differ between the two trainers.
fn settle(
    a: &Args,
    report: Result<RunReport, ExecError>,
    (lock, created): (&mut Option<SaveLock>, &Option<PathBuf>),
    rest: &dyn Fn(ExecError) -> anyhow::Error,
) -> anyhow::Result<RunReport> {
    if let (Err(_), Some(dir)) = (&report, created) {
        drop(lock.take());
        let _ = std::fs::remove_dir(dir);
    }
    report.map_err(|e| match e {
        ExecError::Rank { .. }
        | ExecError::Comm(_)
        | ExecError::Diverged { .. }
        | ExecError::Checkpoint { .. } => anyhow::Error::new(e),
        ExecError::Resume(why) => user(format!(
            "--resume {}: {why}",
            a.resume
                .as_deref()
                .unwrap_or(std::path::Path::new(""))
                .display()
        )),
        ExecError::Data(why) => match &a.data {
            Some(path) => user(format!("--data {}: {why}", path.display())),
            None => user(format!("data: {why}")),
        },
        other => rest(other),
    })
}

/// Writes `--trace` and returns the median step time of the steps past the warm-up — the
/// first quarter, at least the first step (all of them when there is one) — with those step
/// times. Allocator pools, page tables and caches settle over several steps: on a 2-core VM
/// the first ten steps of a small CNN ran at twice the time of the rest.
fn write_trace_and_measure<'r>(
    a: &Args,
    report: &'r RunReport,
) -> anyhow::Result<(f64, &'r [f64])> {
    if let Some(path) = &a.trace {
        let doc = chrome_trace(&report.spans);
        std::fs::write(path, serde_json::to_string(&doc)?)
            .map_err(|e| user(format!("--trace {}: cannot write: {e}", path.display())))?;
    }
    let n = report.step_times.len();
    let warm_up = (n / 4).max(1).min(n.saturating_sub(1));
    let times = &report.step_times[warm_up..];
    Ok((median(times), times))
}

/// A run of a model that is not a transformer: its per-op job and the plan (`--plan` inline
/// layout or a plan file), or `None` for a transformer.
fn general_job(a: &Args) -> anyhow::Result<Option<(GraphModel, String)>> {
    let file = match (&a.plan_file, &a.plan) {
        (Some(p), None) => Some(p.clone()),
        (None, Some(p)) if p.ends_with(".json") => Some(PathBuf::from(p)),
        _ => None,
    };
    // A plan file and --model together: the transformer path's check says which to drop.
    if file.is_some() && a.model.is_some() {
        return Ok(None);
    }
    let plan = match &file {
        Some(path) => Some(crate::read_plan(path)?),
        None => None,
    };
    let name = match (&plan, &a.model) {
        (Some(p), _) => p.model.name.clone(),
        (None, Some(m)) => m.clone(),
        (None, None) => return Ok(None),
    };
    let model = load_model(&name).map_err(user)?;
    if model.transformer().is_some() {
        return Ok(None);
    }
    if a.framework.is_some() {
        return Err(user(format!(
            "--framework: {name} is not a transformer; its per-op plans are costed op by op, not by a stack's transformer kernels"
        )));
    }
    let spec = match (&file, &a.plan) {
        (Some(f), _) => f.display().to_string(),
        (None, Some(p)) => p.clone(),
        (None, None) => {
            return Err(user(format!(
                "--model {name}: give --plan (an inline layout such as dp=2, or a plan file) and --global-batch"
            )))
        }
    };
    let global_batch = match (a.global_batch, &plan) {
        (Some(b), _) => b,
        (None, Some(p)) => p.training.global_batch,
        (None, None) => return Err(user(format!("--model {name}: give --global-batch"))),
    };
    crate::job::check_batch("--global-batch", global_batch)?;
    let seq = a
        .seq
        .or(plan.as_ref().map(|p| p.training.seq_len))
        .unwrap_or(model.default_seq());
    model.check_seq(seq).map_err(user)?;
    let cluster = match (&a.cluster, &plan) {
        (Some(c), _) => Cluster::parse(c).map_err(user)?,
        (None, Some(p)) => Cluster::parse(&p.cluster.spec).map_err(user)?,
        (None, None) => {
            let l = PartialLayout::parse(&spec).map_err(|e| user(format!("--plan: {e}")))?;
            let devices = u64::from(l.dp.unwrap_or(1))
                * u64::from(l.tp.unwrap_or(1))
                * u64::from(l.pp.unwrap_or(1));
            let devices = u32::try_from(devices)
                .map_err(|_| user(format!("--plan {spec}: too many devices")))?;
            cpu_local_cluster(devices)?
        }
    };
    let job = GraphModel::new(model, cluster, seq, global_batch, Precision::Fp32, true)?;
    Ok(Some((job, spec)))
}

/// `parallax run` of a per-op plan: trains the graph with the general-graph trainer and
/// compares its step time with the per-op simulator's prediction of the same plan.
fn run_general(a: &Args, job: GraphModel, plan_spec: &str, backend: Backend) -> anyhow::Result<()> {
    let (graph, plan) = general::op_plan(&job, plan_spec)?;
    // The executor shards the optimizer state of a ZeRO plan (stage 1) and keeps gradients and
    // weights whole between steps: it is predicted as it runs.
    let as_run = parallax_sim::perop::OpPlan {
        zero_stage: plan.zero_stage.min(1),
        ..plan.clone()
    };
    let predicted = if backend == Backend::Cuda && job.cluster.profile.node.devices_are_host_cores()
    {
        Err(anyhow::anyhow!(CUDA_NOT_PREDICTED))
    } else {
        general::predict(&job, &graph, &as_run)
    };
    // An inference graph (an ONNX classifier) trains against a cross-entropy on its logits.
    let (graph, plan) = with_training_loss(&graph, &plan).unwrap_or((graph, plan));
    let ranks = plan
        .configs
        .iter()
        .map(|c| u64::from(c.view.end()))
        .max()
        .unwrap_or(1);
    if let (Ok(p), Backend::Threads, Some(have)) = (&predicted, backend, host_available_gib()) {
        let peak = p.peak_memory_gib;
        let need = peak * ranks as f64;
        if need > have {
            return Err(user(format!(
                "--model {}: the CPU executor needs ~{need:.1} GiB ({ranks} ranks × {peak:.2} GiB of fp32 weights, gradients, optimizer state and activations); this machine has {have:.1} GiB available",
                job.name
            )));
        }
    }
    if let Some(path) = &a.trace {
        check_trace_path(path, a.force)?;
    }
    let resume = load_resume(a)?;
    let (mut save_lock, created_save_dir) = prepare_save(a, resume.as_deref())?;
    let mut spec = GraphRunSpec::new(graph, plan, a.steps);
    spec.trace = a.trace.is_some();
    spec.resume = resume;
    spec.checkpoint_every = a.save_every;
    spec.on_checkpoint = checkpoint_hook(
        a,
        json!({"model": job.name, "plan": plan_spec, "global_batch": job.global_batch, "seq": job.seq}),
    );
    spec.on_step = Some(step_printer(a.json, "samples/s"));
    spec.seed = a.seed;
    spec.optimizer = GraphOptimizer::Adam(parallax_executor::AdamConfig {
        lr: a.lr,
        ..Default::default()
    });
    spec.timeout = Duration::from_secs_f64(a.timeout);
    if let Some(path) = &a.data {
        let bytes = std::fs::read(path)
            .map_err(|e| user(format!("--data {}: cannot read: {e}", path.display())))?;
        spec.data = if bytes.starts_with(&parallax_executor::graph::data::IMAGES_MAGIC[..6]) {
            let set = ImageSet::parse(&bytes)
                .map_err(|e| user(format!("--data {}: {e}", path.display())))?;
            GraphData::Images(Arc::new(set))
        } else {
            GraphData::Text(Arc::new(bytes))
        };
    }
    let report = parallax_executor::run_graph(&spec, backend);
    let report = settle(
        a,
        report,
        (&mut save_lock, &created_save_dir),
        &|e| match e {
            ExecError::Model(why) | ExecError::Layout(why) => {
                user(format!("--plan {plan_spec}: {why}"))
            }
            other => user(other),
        },
    )?;
    // Under MPI every process runs this command; rank 0 speaks for the run.
    if report.rank != 0 {
        return Ok(());
    }
    let (measured, times) = write_trace_and_measure(a, &report)?;
    let samples = job.global_batch as f64;
    if a.json {
        let (pred, peak, err) = match &predicted {
            Ok(p) => (json!(p.step_time_s), json!(p.peak_memory_gib), Value::Null),
            Err(e) => (Value::Null, Value::Null, json!(e.to_string())),
        };
        let doc = json!({
            "model": job.name,
            "backend": backend.name(),
            "ranks": report.ranks,
            "global_batch": job.global_batch,
            "seq": job.seq,
            "micro_batches": spec.plan.micro_batches,
            "losses": report.losses,
            "step_times_s": report.step_times,
            "measured_step_time_s": measured,
            "measured_step_time_min_s": times.iter().copied().fold(f64::INFINITY, f64::min),
            "samples_per_s": samples / measured.max(1e-12),
            "predicted_step_time_s": pred,
            "predicted_peak_memory_gib": peak,
            "prediction_cluster": job.cluster.to_string(),
            "prediction_error": err,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!(
        "measured step time {measured:.4} s (median of steps past the first quarter), {:.0} samples/s, {} ranks",
        samples / measured.max(1e-12),
        report.ranks
    );
    match &predicted {
        Ok(p) => println!(
            "predicted step time {:.4} s on {} ({:+.1} % vs measured)",
            p.step_time_s,
            job.cluster,
            (p.step_time_s / measured - 1.0) * 100.0
        ),
        Err(e) => println!("no prediction: {e}"),
    }
    Ok(())
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let backend: Backend = a
        .backend
        .parse()
        .map_err(|e| user(format!("--backend: {e}")))?;
    if a.steps == 0 {
        return Err(user("--steps must be at least 1"));
    }
    if !(a.timeout.is_finite() && a.timeout > 0.0 && a.timeout <= MAX_TIMEOUT_S) {
        return Err(user(format!(
            "--timeout {}: must be a positive number of seconds, at most {MAX_TIMEOUT_S:e}",
            a.timeout
        )));
    }
    if a.save_every == Some(0) {
        return Err(user("--save-every: must be at least 1"));
    }
    if !(a.lr.is_finite() && a.lr > 0.0) {
        return Err(user("--lr must be a positive number"));
    }
    if let Some((job, spec)) = general_job(&a)? {
        return run_general(&a, job, &spec, backend);
    }
    let job = resolve(&a)?;
    if job.layout.offload != parallax_ir::Offload::None {
        // The executor keeps every state where it trains; offload is planned, simulated and
        // exported (DeepSpeed), not run.
        return Err(user(format!(
            "offload {}: the executor keeps parameters and optimizer states on its devices; plan or export this layout, or run it without offload",
            job.layout.offload
        )));
    }
    let own = Framework::parse("parallax").map_err(user)?;
    let stack = match &a.framework {
        Some(s) => Some(Framework::parse(s).map_err(|e| user(format!("--framework: {e}")))?),
        None => None,
    };
    // The cluster the run is predicted on, checked before anything runs.
    let given_cluster = match &job.cluster {
        Some(spec) => {
            let c = Cluster::parse(spec).map_err(user)?;
            if u64::from(c.gpus) != job.layout.devices() {
                return Err(user(format!(
                    "--cluster {spec}: has {} devices, the layout runs {} ranks",
                    c.gpus,
                    job.layout.devices()
                )));
            }
            Some(c)
        }
        None => None,
    };
    // Output paths are checked before the first step, not after the last.
    if let Some(path) = &a.trace {
        check_trace_path(path, a.force)?;
    }
    let data = match &a.data {
        None => DataSource::Synthetic,
        Some(p) => {
            let bytes = std::fs::read(p)
                .map_err(|e| user(format!("--data {}: cannot read: {e}", p.display())))?;
            DataSource::Bytes(Arc::new(bytes))
        }
    };
    let resume = load_resume(&a)?;
    let (mut save_lock, created_save_dir) = prepare_save(&a, resume.as_deref())?;
    let mut spec = RunSpec::new(
        job.model.clone(),
        job.layout.clone(),
        job.global_batch,
        job.seq,
        a.steps,
    );
    spec.seed = a.seed;
    spec.data = data;
    spec.adam.lr = a.lr;
    spec.timeout = Duration::from_secs_f64(a.timeout);
    spec.resume = resume;
    spec.trace = a.trace.is_some();
    spec.checkpoint_every = a.save_every;
    spec.on_checkpoint = checkpoint_hook(
        &a,
        json!({"model": job.model_name, "layout": job.layout, "global_batch": job.global_batch, "seq": job.seq}),
    );
    spec.on_step = Some(step_printer(a.json, "tokens/s"));
    // Host memory is what the executor itself will allocate, whatever stack is predicted.
    let own_prediction = predict(&job, given_cluster.as_ref(), backend, &own);
    if let (Ok(p), Backend::Threads) = (&own_prediction, backend) {
        check_host_memory(&job, p)?;
    }
    let predicted = match &stack {
        Some(s) => predict(&job, given_cluster.as_ref(), backend, s),
        None => own_prediction,
    };
    let report = exec_run(&spec, backend);
    let report = settle(
        &a,
        report,
        (&mut save_lock, &created_save_dir),
        &|e| match e {
            ExecError::Model(why) => user(format!("--model {}: {why}", job.model_name)),
            other => user(other),
        },
    )?;
    // Under MPI every process runs this command; rank 0 speaks for the run.
    if report.rank != 0 {
        return Ok(());
    }
    let (measured, times) = write_trace_and_measure(&a, &report)?;
    let tokens = (job.global_batch * job.seq) as f64;
    if a.json {
        let (pred, pred_err, cluster, framework) = match &predicted {
            Ok(p) => (
                json!(p.step_time_s),
                Value::Null,
                json!(p.cluster),
                json!(p.framework),
            ),
            Err(e) => (Value::Null, json!(e), Value::Null, Value::Null),
        };
        let doc = json!({
            "model": job.model_name,
            "backend": backend.name(),
            "ranks": report.ranks,
            "global_batch": job.global_batch,
            "seq": job.seq,
            "layout": job.layout,
            "losses": report.losses,
            "step_times_s": report.step_times,
            "measured_step_time_s": measured,
            "measured_step_time_min_s": times.iter().copied().fold(f64::INFINITY, f64::min),
            "tokens_per_s": tokens / measured.max(1e-12),
            "predicted_step_time_s": pred,
            "prediction_cluster": cluster,
            "prediction_framework": framework,
            "prediction_error": pred_err,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        summary(&report, measured, &predicted, tokens);
    }
    Ok(())
}

fn summary(r: &RunReport, measured: f64, predicted: &Result<Predicted, String>, tokens: f64) {
    println!(
        "measured step time {measured:.4} s (median of steps past the first quarter), {:.0} tokens/s, {} ranks",
        tokens / measured.max(1e-12),
        r.ranks
    );
    match predicted {
        Ok(p) => println!(
            "predicted step time {:.4} s on {} as {} ({:+.1} % vs measured)",
            p.step_time_s,
            p.cluster,
            p.framework,
            (p.step_time_s / measured - 1.0) * 100.0
        ),
        Err(e) => println!("no prediction: {e}"),
    }
}

/// The measured timeline in the simulator's Chrome trace layout: one process per pipeline
/// stage, one row per rank.
fn chrome_trace(spans: &[Span]) -> Value {
    let mut events = Vec::new();
    let mut ranks: Vec<(usize, usize)> = spans.iter().map(|s| (s.rank, s.stage)).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for (rank, stage) in &ranks {
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": stage, "tid": rank,
            "args": {"name": format!("rank {rank}")}}),
        );
    }
    for s in spans {
        events.push(json!({
            "name": s.name, "cat": s.cat, "ph": "X",
            "ts": s.start_s * 1e6, "dur": s.dur_s * 1e6,
            "pid": s.stage, "tid": s.rank,
            "args": {"step": s.step, "rank": s.rank},
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(model: Option<&str>, plan: Option<&str>, gb: Option<u64>) -> Args {
        Args {
            plan_file: None,
            model: model.map(String::from),
            plan: plan.map(String::from),
            global_batch: gb,
            seq: None,
            cluster: None,
            backend: "threads".into(),
            steps: 1,
            seed: 0,
            data: None,
            save: None,
            save_every: None,
            resume: None,
            lr: 1e-3,
            timeout: 1.0,
            framework: None,
            json: false,
            trace: None,
            force: false,
        }
    }

    #[test]
    fn inline_layouts_default_missing_keys() {
        let j = resolve(&args(Some("gpt-tiny"), Some("pp=2,v=2"), Some(4))).unwrap();
        assert_eq!(j.layout.schedule, Schedule::Interleaved1F1B);
        assert_eq!((j.layout.dp, j.layout.tp), (1, 1));
        assert_eq!(j.seq, 256);
        assert!(resolve(&args(Some("gpt-tiny"), None, Some(4))).is_err());
        assert!(resolve(&args(Some("resnet50"), Some("dp=1"), Some(4))).is_err());
        assert!(resolve(&args(Some("gpt-tiny"), Some("tp=x"), Some(4))).is_err());
    }

    /// A GPU run is not predicted on CPU cores: without --cluster it says why, with one it
    /// is the device-resident prediction on that cluster.
    #[test]
    fn a_cuda_run_is_predicted_only_on_a_given_cluster() {
        let job = Job {
            model_name: "gpt-tiny".into(),
            model: parallax_ir::models::zoo::transformer("gpt-tiny").unwrap(),
            layout: Layout::default(),
            global_batch: 8,
            seq: 64,
            cluster: None,
        };
        let own = Framework::parse("parallax").unwrap();
        let e = predict(&job, None, Backend::Cuda, &own).err().unwrap();
        assert!(e.contains("--cluster") && e.contains("PCIe"), "{e}");
        assert!(predict(&job, None, Backend::Threads, &own).is_ok());
        let c = Cluster::parse("hgx-h200-141gb:gpus=1").unwrap();
        let p = predict(&job, Some(&c), Backend::Cuda, &own).unwrap();
        assert!(p.cluster.starts_with("hgx-h200-141gb"), "{}", p.cluster);
        assert_eq!(p.framework, "parallax");
    }

    #[test]
    fn prediction_cluster_grows_cpu_local_to_the_layout() {
        let c = cpu_local_cluster(64).unwrap();
        assert_eq!(c.gpus, 64);
        assert_eq!(c.nodes(), 1);
    }

    #[test]
    fn trace_has_one_row_per_rank() {
        let spans = vec![
            Span {
                rank: 1,
                stage: 0,
                name: "F mb0 c0".into(),
                cat: "forward",
                step: 0,
                start_s: 0.5,
                dur_s: 0.25,
            },
            Span {
                rank: 0,
                stage: 0,
                name: "F mb0 c0".into(),
                cat: "forward",
                step: 0,
                start_s: 0.0,
                dur_s: 0.5,
            },
        ];
        let t = chrome_trace(&spans);
        let ev = t["traceEvents"].as_array().unwrap();
        assert_eq!(ev.iter().filter(|e| e["ph"] == "M").count(), 2);
        assert_eq!(ev.iter().filter(|e| e["ph"] == "X").count(), 2);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }
}
