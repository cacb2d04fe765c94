//! The equivalence matrix on the MPI backend (feature `mpi`; needs OpenMPI's `mpirun`):
//! the transformer trainer's layouts and the general-graph trainer's per-op plans.
//!
//! `cargo test -p parallax-executor --features mpi --test mpi_equivalence` starts this binary
//! under `mpirun --oversubscribe -np N` for N = 2, 4 and 8. Each MPI job runs the layouts of
//! the matrix that need N ranks, one after the other in the same processes, and rank 0 checks
//! every loss of 5 steps and every parameter after them against the single-rank run (within
//! 1e-4 relative) and against the same layout on the threads backend (bit for bit: the MPI
//! backend reduces in the same fixed order). Two more jobs inject a stalled and a dying rank
//! and must end within a bounded time with an error naming it. The launcher prints one line
//! per case and `N passed, M failed`, and fails when anything does.
//!
//! Environment: `PARALLAX_MPIRUN` replaces `mpirun` (e.g. a full path); `--allow-run-as-root`
//! is passed through OpenMPI's environment variables so CI can run as root.

use parallax_cost::soap::ParallelConfig;
use parallax_executor::fixtures::{
    bert, deepseek_mtp, gpt, gpt_oss, llama, mixtral, nemotron_h, pp, qwen2_moe, qwen3,
};
use parallax_executor::graph::{
    op_plan, run_graph_threads, split_label, GraphOptimizer, GraphPrepared, GraphRunSpec,
};
use parallax_executor::mpi_backend::MpiRuntime;
use parallax_executor::{run_threads, AdamConfig, Fault, FaultKind, RunSpec};
use parallax_ir::models::{
    resnet::resnet_tiny, rnn::lstm_tiny, vision::vit_tiny, TransformerConfig,
};
use parallax_ir::{AxisRole, Layout, OpKind, Recompute, Schedule};
use std::io::Read;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const STEPS: u64 = 5;
const GLOBAL_BATCH: u64 = 8;
const SEQ: u64 = 16;
/// Relative tolerance of losses and parameters against the single-rank run.
const TOL: f64 = 1e-4;
/// The longest one MPI job of the matrix may take before the launcher kills it.
const JOB_LIMIT: Duration = Duration::from_secs(600);
/// Receive timeout of the fault cases: a stall must be detected within a few of these.
const FAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a fault case may take from `mpirun` to the end of the job.
const FAULT_LIMIT: Duration = Duration::from_secs(60);

/// The matrix: the layouts of the threads backend's equivalence tests.
fn matrix() -> Vec<(&'static str, TransformerConfig, Layout)> {
    let d = Layout::default;
    vec![
        ("dp2", gpt(4), Layout { dp: 2, ..d() }),
        ("tp2", gpt(4), Layout { tp: 2, ..d() }),
        ("pp2_gpipe", gpt(4), pp(2, Schedule::GPipe)),
        ("pp2_1f1b", gpt(4), pp(2, Schedule::OneFOneB)),
        ("pp2_zb_h1", gpt(4), pp(2, Schedule::ZeroBubbleH1)),
        ("cp2", gpt(4), Layout { cp: 2, ..d() }),
        (
            "moe_dp2_ep2",
            mixtral(2),
            Layout {
                dp: 2,
                ep: 2,
                ..d()
            },
        ),
        (
            "moe_dp4_ep2",
            mixtral(2),
            Layout {
                dp: 4,
                ep: 2,
                ..d()
            },
        ),
        (
            "moe_dp2_tp2_sp_ep4_etp1",
            mixtral(2),
            Layout {
                dp: 2,
                tp: 2,
                sequence_parallel: true,
                ep: 4,
                etp: Some(1),
                ..d()
            },
        ),
        (
            "deepseek_mla_mtp_tp2_sp_ep2_etp1",
            deepseek_mtp(2, 1),
            Layout {
                tp: 2,
                sequence_parallel: true,
                ep: 2,
                etp: Some(1),
                ..d()
            },
        ),
        (
            "gpt_oss_tp2_sp_ep2_etp1",
            gpt_oss(2),
            Layout {
                tp: 2,
                sequence_parallel: true,
                ep: 2,
                etp: Some(1),
                ..d()
            },
        ),
        (
            // BERT's pre-training: attention to every key around the ring, the next-sentence
            // head on the first context-parallel rank's first tokens.
            "bert_cp2",
            bert(2),
            Layout { cp: 2, ..d() },
        ),
        (
            // Nemotron-H's hybrid stack: Mamba-2 mixers split by heads and groups, an
            // attention, an MoE and an MLP layer.
            "nemotron_h_tp2_sp",
            nemotron_h("ME*M-"),
            Layout {
                tp: 2,
                sequence_parallel: true,
                ..d()
            },
        ),
        (
            "qwen3_tp2_sp_qk_norm",
            qwen3(2),
            Layout {
                tp: 2,
                sequence_parallel: true,
                ..d()
            },
        ),
        (
            "qwen2_moe_dp2_ep2",
            qwen2_moe(2),
            Layout {
                dp: 2,
                ep: 2,
                ..d()
            },
        ),
        (
            "llama_cp2_tp2_sp",
            llama(4),
            Layout {
                cp: 2,
                tp: 2,
                sequence_parallel: true,
                ..d()
            },
        ),
        (
            "dp2_zero1",
            gpt(4),
            Layout {
                dp: 2,
                zero_stage: 1,
                ..d()
            },
        ),
        (
            "dp2_zero2",
            gpt(4),
            Layout {
                dp: 2,
                zero_stage: 2,
                ..d()
            },
        ),
        (
            "dp2_zero3",
            gpt(4),
            Layout {
                dp: 2,
                zero_stage: 3,
                ..d()
            },
        ),
        (
            "recompute_full_tp2",
            gpt(4),
            Layout {
                tp: 2,
                recompute: Recompute::Full,
                ..d()
            },
        ),
        (
            "recompute_selective_pp2",
            gpt(4),
            Layout {
                recompute: Recompute::Selective,
                ..pp(2, Schedule::GPipe)
            },
        ),
        (
            "dp2_tp2",
            gpt(4),
            Layout {
                dp: 2,
                tp: 2,
                ..d()
            },
        ),
        (
            "tp2_pp2_sp",
            gpt(4),
            Layout {
                tp: 2,
                sequence_parallel: true,
                ..pp(2, Schedule::OneFOneB)
            },
        ),
        (
            "pp4_interleaved_v2",
            gpt(8),
            Layout {
                interleave: 2,
                ..pp(4, Schedule::Interleaved1F1B)
            },
        ),
        (
            "llama_dp2_pp2_zero3_interleaved",
            llama(4),
            Layout {
                dp: 2,
                zero_stage: 3,
                interleave: 2,
                ..pp(2, Schedule::Interleaved1F1B)
            },
        ),
        (
            "llama_dp2_tp2_sp_zero2_selective",
            llama(4),
            Layout {
                dp: 2,
                tp: 2,
                sequence_parallel: true,
                zero_stage: 2,
                recompute: Recompute::Selective,
                ..d()
            },
        ),
        (
            "llama_tp4_replicated_kv_sp",
            llama(4),
            Layout {
                tp: 4,
                sequence_parallel: true,
                ..d()
            },
        ),
        (
            "dp2_tp2_pp2",
            gpt(4),
            Layout {
                dp: 2,
                tp: 2,
                ..pp(2, Schedule::OneFOneB)
            },
        ),
    ]
}

/// The general-graph matrix: a small ResNet with BatchNorm and an LSTM language model under
/// the per-op plans of the threads backend's equivalence tests.
fn graph_matrix() -> Vec<(&'static str, GraphRunSpec)> {
    let sample = |_: char, r: AxisRole| r == AxisRole::Sample;
    let cnn = resnet_tiny(4).unwrap();
    let lstm = lstm_tiny(4, 6).unwrap();
    let spec = |g: &parallax_ir::Graph, m: u32, f: &dyn Fn(usize) -> ParallelConfig| {
        let mut s = GraphRunSpec::new(g.clone(), op_plan(g, m, f), STEPS);
        s.seed = 42;
        s.collect_state = true;
        s.timeout = Duration::from_secs(60);
        s
    };
    let vit = vit_tiny(4).unwrap();
    let half = cnn.nodes.len() / 2;
    let mut lstm_dp = spec(&lstm, 1, &|i| split_label(&lstm, i, 2, 0, &sample));
    lstm_dp.optimizer = GraphOptimizer::Adam(AdamConfig::default());
    // ZeRO: four replicas split every region's Adam step and all-gather the weights.
    let mut cnn_zero = spec(&cnn, 1, &|i| split_label(&cnn, i, 4, 0, &sample));
    cnn_zero.plan.zero_stage = 1;
    cnn_zero.optimizer = GraphOptimizer::Adam(AdamConfig::default());
    vec![
        (
            "resnet_dp2",
            spec(&cnn, 1, &|i| split_label(&cnn, i, 2, 0, &sample)),
        ),
        (
            "resnet_channels2",
            spec(&cnn, 1, &|i| {
                split_label(&cnn, i, 2, 0, &|l, r| {
                    r == AxisRole::Parameter && l != 'c'
                        || matches!(
                            cnn.nodes[i].op,
                            OpKind::BatchNorm | OpKind::Pool2d(_) | OpKind::GlobalAvgPool
                        ) && l == 'c'
                })
            }),
        ),
        (
            "resnet_rows2",
            spec(&cnn, 1, &|i| split_label(&cnn, i, 2, 0, &|l, _| l == 'h')),
        ),
        (
            "resnet_pipeline2",
            spec(&cnn, 2, &|i| ParallelConfig::single(u32::from(i >= half))),
        ),
        (
            "resnet_mixed4",
            spec(&cnn, 1, &|i| match i % 4 {
                0 => split_label(&cnn, i, 4, 0, &sample),
                1 => split_label(&cnn, i, 2, 2, &|l, r| r == AxisRole::Parameter && l != 'c'),
                2 => split_label(&cnn, i, 2, 1, &|l, _| l == 'h'),
                _ => ParallelConfig::single((i % 3) as u32),
            }),
        ),
        ("lstm_dp2", lstm_dp),
        ("resnet_dp4_zero1", cnn_zero),
        (
            "vit_heads2",
            spec(&vit, 1, &|i| {
                split_label(&vit, i, 2, 0, &|l, r| {
                    r == AxisRole::Parameter && matches!(l, 'h' | 'n' | 'o')
                })
            }),
        ),
        (
            "lstm_pipeline2",
            spec(&lstm, 2, &|i| ParallelConfig::single(u32::from(i >= 2))),
        ),
        (
            "lstm_vocab2",
            spec(&lstm, 1, &|i| {
                split_label(&lstm, i, 2, 0, &|l, _| matches!(l, 'v' | 'n'))
            }),
        ),
    ]
}

fn graph_ranks(s: &GraphRunSpec) -> usize {
    GraphPrepared::new(s).map_or(0, |p| p.world())
}

/// The largest relative difference of `losses` from the `reference` run's (named `what`), or
/// the first step beyond the tolerance.
fn worst_loss(losses: &[f64], reference: &[f64], what: &str) -> Result<f64, String> {
    if losses.len() != reference.len() {
        return Err(format!(
            "{} losses, expected {}",
            losses.len(),
            reference.len()
        ));
    }
    let mut worst: f64 = 0.0;
    for (i, (a, b)) in losses.iter().zip(reference).enumerate() {
        let rel = (a - b).abs() / b.abs();
        if rel.is_nan() || rel > TOL {
            return Err(format!("step {i}: loss {a} vs {what} {b} (rel {rel:e})"));
        }
        worst = worst.max(rel);
    }
    Ok(worst)
}

/// Compares a finished MPI run of a graph (rank 0) with the single-device and the threads
/// runs of the same spec.
fn compare_graph(
    spec: &GraphRunSpec,
    losses: &[f64],
    state: &parallax_executor::ModelState,
) -> Result<(f64, f64), String> {
    let one = run_graph_threads(&spec.single_device()).map_err(|e| e.to_string())?;
    let one_state = one.state.ok_or("the single-device run returned no state")?;
    let worst_loss = worst_loss(losses, &one.losses, "single-device")?;
    // An attention key bias has an identically zero gradient: it starts at zero and moves by
    // rounding noise only, so it is checked to stay near zero rather than compared.
    let key_bias = |n: &str| n.ends_with("attn.k.bias");
    let (d, name) = state.max_relative_diff_where(&one_state, |n| !key_bias(n));
    if d.is_nan() || d > TOL {
        return Err(format!("parameter {name} differs by {d:e} (relative)"));
    }
    for (n, t) in state.tensors.iter().filter(|(n, _)| key_bias(n)) {
        let max = t.param.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        if max > 1e-5 {
            return Err(format!("{n}: {max}"));
        }
    }
    let threads = run_graph_threads(spec).map_err(|e| e.to_string())?;
    if threads.losses != losses || threads.state.as_ref() != Some(state) {
        return Err("not bit-identical to the same plan on the threads backend".into());
    }
    Ok((worst_loss, d))
}

fn ranks(l: &Layout) -> usize {
    l.devices() as usize
}

fn spec(model: TransformerConfig, layout: Layout) -> RunSpec {
    let bert = model.bert;
    let mut s = RunSpec::new(model, layout, GLOBAL_BATCH, SEQ, STEPS);
    if bert {
        // A repetitive text, whose masked bytes their neighbours give away (the masked-LM loss
        // over 15 % of the positions moves too slowly on the synthetic tokens in five steps).
        let text = "parallax plans, simulates and trains models. ".repeat(40);
        s.data = parallax_executor::DataSource::Bytes(std::sync::Arc::new(text.into_bytes()));
    }
    s.seed = 42;
    s.collect_state = true;
    s.timeout = Duration::from_secs(60);
    s
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--worker") {
        Some(i) => worker(args.get(i + 1).map_or("", String::as_str)),
        None => launcher(),
    }
}

/// Compares a finished MPI run (on rank 0) with the single-rank and the threads runs.
/// Returns the worst relative error against the single-rank run, or what is wrong.
fn compare(
    model: &TransformerConfig,
    layout: &Layout,
    losses: &[f64],
    state: &parallax_executor::ModelState,
) -> Result<(f64, f64), String> {
    let one = run_threads(&spec(model.clone(), Layout::default())).map_err(|e| e.to_string())?;
    let one_state = one.state.ok_or("the single-rank run returned no state")?;
    let worst_loss = worst_loss(losses, &one.losses, "single-rank")?;
    if one.losses[STEPS as usize - 1] >= one.losses[0] - 0.05 {
        return Err(format!("the loss does not fall: {:?}", one.losses));
    }
    // The key bias has an identically zero gradient, so Adam moves it by rounding noise
    // scaled to at most lr per step: check it stays that small (as the threads tests do).
    let (d, name) = state.max_relative_diff_where(&one_state, |n| !n.ends_with("attn.bk"));
    if d.is_nan() || d > TOL {
        return Err(format!("parameter {name} differs by {d:e} (relative)"));
    }
    let lr = f64::from(AdamConfig::default().lr);
    for (n, t) in state.tensors.iter().filter(|(n, _)| n.ends_with("attn.bk")) {
        let max = t
            .param
            .iter()
            .fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
        if max > 1.01 * lr * STEPS as f64 {
            return Err(format!("{n}: {max}"));
        }
    }
    let threads = run_threads(&spec(model.clone(), layout.clone())).map_err(|e| e.to_string())?;
    if threads.losses != losses || threads.state.as_ref() != Some(state) {
        return Err("not bit-identical to the same layout on the threads backend".into());
    }
    Ok((worst_loss, d))
}

/// One MPI process: `matrix` runs the layouts that need as many ranks as the job has;
/// `stall` and `die` inject a fault and must not return.
fn worker(mode: &str) -> ExitCode {
    let mut rt = match MpiRuntime::init() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let world = rt.world();
    let root = rt.rank() == 0;
    let mut failed = 0;
    match mode {
        "matrix" => {
            for (name, model, layout) in matrix() {
                if ranks(&layout) != world {
                    continue;
                }
                let t0 = Instant::now();
                let r = rt.run(&spec(model.clone(), layout.clone()));
                let secs = t0.elapsed().as_secs_f64();
                if !root {
                    if let Err(e) = r {
                        eprintln!("error: rank {}: {name}: {e}", rt.rank());
                    }
                    continue;
                }
                let outcome = r.map_err(|e| e.to_string()).and_then(|r| {
                    let state = r.state.ok_or("rank 0 got no state")?;
                    compare(&model, &layout, &r.losses, &state)
                });
                match outcome {
                    Ok((l, p)) => println!(
                        "CASE ok {name} ({world} ranks, {secs:.2} s): max relative error \
                         loss {l:.2e}, params {p:.2e}; bit-identical to threads"
                    ),
                    Err(e) => {
                        failed += 1;
                        println!("CASE FAILED {name} ({world} ranks): {e}");
                    }
                }
            }
            for (name, spec) in graph_matrix() {
                if graph_ranks(&spec) != world {
                    continue;
                }
                let t0 = Instant::now();
                let r = rt.run_graph(&spec);
                let secs = t0.elapsed().as_secs_f64();
                if !root {
                    if let Err(e) = r {
                        eprintln!("error: rank {}: {name}: {e}", rt.rank());
                    }
                    continue;
                }
                let outcome = r.map_err(|e| e.to_string()).and_then(|r| {
                    let state = r.state.ok_or("rank 0 got no state")?;
                    compare_graph(&spec, &r.losses, &state)
                });
                match outcome {
                    Ok((l, p)) => println!(
                        "CASE ok {name} ({world} ranks, {secs:.2} s): max relative error \
                         loss {l:.2e}, params {p:.2e}; bit-identical to threads"
                    ),
                    Err(e) => {
                        failed += 1;
                        println!("CASE FAILED {name} ({world} ranks): {e}");
                    }
                }
            }
        }
        "stall" | "die" => {
            let mut s = spec(
                gpt(2),
                Layout {
                    dp: 2,
                    ..pp(2, Schedule::OneFOneB)
                },
            );
            s.collect_state = false;
            s.timeout = FAULT_TIMEOUT;
            s.fault = Some(if mode == "stall" {
                Fault {
                    rank: 2,
                    step: 1,
                    kind: FaultKind::Stall,
                }
            } else {
                Fault {
                    rank: 3,
                    step: 1,
                    kind: FaultKind::Die,
                }
            });
            let r = rt.run(&s);
            eprintln!(
                "rank {}: the {mode} fault was not detected: {r:?}",
                rt.rank()
            );
            failed += 1;
        }
        other => {
            eprintln!("unknown worker mode '{other}'");
            failed += 1;
        }
    }
    drop(rt);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Output and exit status of one MPI job, killed after `limit`.
struct Job {
    ok: bool,
    out: String,
    err: String,
    secs: f64,
    timed_out: bool,
}

fn mpirun(np: usize, mode: &str, limit: Duration) -> Result<Job, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this test binary: {e}"))?;
    let launcher = std::env::var("PARALLAX_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let t0 = Instant::now();
    let mut child = Command::new(&launcher)
        .args(["--oversubscribe", "-np", &np.to_string()])
        .arg(&exe)
        .args(["--worker", mode])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start `{launcher}` (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev): {e}"))?;
    let mut pipes = (child.stdout.take(), child.stderr.take());
    let readers = [
        pipes.0.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
        pipes.1.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
    ]
    .map(|p| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut p) = p {
                let _ = p.read_to_string(&mut s);
            }
            s
        })
    });
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if t0.elapsed() > limit => {
                timed_out = true;
                let _ = child.kill();
                break child.wait().ok();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for mpirun: {e}")),
        }
    };
    let [out, err] = readers.map(|h| h.join().unwrap_or_default());
    Ok(Job {
        ok: status.is_some_and(|s| s.success()),
        out,
        err,
        secs: t0.elapsed().as_secs_f64(),
        timed_out,
    })
}

fn launcher() -> ExitCode {
    let (mut passed, mut failed) = (0usize, 0usize);
    let graphs: Vec<usize> = graph_matrix().iter().map(|(_, s)| graph_ranks(s)).collect();
    let mut sizes: Vec<usize> = matrix().iter().map(|(_, _, l)| ranks(l)).collect();
    sizes.extend(&graphs);
    sizes.sort_unstable();
    sizes.dedup();
    for np in sizes {
        let expected = matrix().iter().filter(|(_, _, l)| ranks(l) == np).count()
            + graphs.iter().filter(|g| **g == np).count();
        let job = match mpirun(np, "matrix", JOB_LIMIT) {
            Ok(j) => j,
            Err(e) => {
                println!("mpi equivalence: {e}");
                println!("0 passed, 1 failed");
                return ExitCode::FAILURE;
            }
        };
        let ok_lines = job
            .out
            .lines()
            .filter(|l| l.starts_with("CASE ok "))
            .count();
        for l in job.out.lines().filter(|l| l.starts_with("CASE ")) {
            println!("mpi {}", &l[5..]);
        }
        passed += ok_lines;
        failed += expected - ok_lines.min(expected);
        if !job.ok || ok_lines != expected {
            println!(
                "mpirun -np {np}: {} after {:.1} s, {ok_lines} of {expected} cases passed; its \
                 stderr:\n{}",
                if job.timed_out { "killed" } else { "failed" },
                job.secs,
                job.err
            );
        } else {
            println!("mpirun -np {np}: {expected} cases in {:.1} s", job.secs);
        }
    }
    for (mode, want) in [
        ("stall", "rank 2 failed: stopped responding"),
        ("die", "rank 3 failed: injected fault"),
    ] {
        match mpirun(4, mode, FAULT_LIMIT) {
            Ok(job) if !job.ok && !job.timed_out && job.err.contains(want) => {
                passed += 1;
                let line = job.err.lines().find(|l| l.contains(want)).unwrap_or(want);
                println!("mpi fault {mode}: job ended in {:.1} s: {line}", job.secs);
            }
            Ok(job) => {
                failed += 1;
                println!(
                    "mpi fault {mode}: expected a failed job naming '{want}' within {} s; got \
                     success={} timed_out={} after {:.1} s; stderr:\n{}",
                    FAULT_LIMIT.as_secs(),
                    job.ok,
                    job.timed_out,
                    job.secs,
                    job.err
                );
            }
            Err(e) => {
                failed += 1;
                println!("mpi fault {mode}: {e}");
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
