//! parallax-executor: runs a plan for real. A from-scratch fp32 trainer for the zoo's GPT and
//! Llama transformers (forward, hand-written backward, cross-entropy, Adam) that executes any
//! structured layout the planner emits — data parallel with bucketed all-reduce, ZeRO-1/2/3,
//! Megatron tensor parallel, sequence parallel, pipeline parallel under GPipe, 1F1B and
//! interleaved 1F1B with real point-to-point sends, micro-batching with gradient accumulation,
//! full and selective recomputation — over a [`Collectives`] backend.
//!
//! Backends: `threads` (one thread per rank, always built), `mpi` (feature `mpi`: one
//! process per rank under `mpirun`, see `mpi_backend`) and `cuda` (features `cuda`, `nccl`:
//! one rank per GPU — threads, or processes under `mpirun` — with GEMMs in cuBLAS, Adam in an
//! NVRTC kernel and collectives in NCCL, see `cuda_backend`). Asking for a backend this build
//! lacks answers [`ExecError::NotCompiled`], so callers need no `cfg`. Dropout is off in the
//! executor (see [`model`]).
//!
//! ```
//! use parallax_executor::{run_threads, RunSpec};
//! use parallax_ir::{models::TransformerConfig, Layout};
//!
//! let model = TransformerConfig::gpt(2, 16, 2, 32, 32, 8);
//! let layout = Layout { dp: 2, ..Layout::default() };
//! let report = run_threads(&RunSpec::new(model, layout, 4, 8, 2)).unwrap();
//! assert_eq!(report.losses.len(), 2);
//! ```

pub mod calibrate;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda_backend;
pub mod data;
pub mod engine;
pub mod error;
#[doc(hidden)]
pub mod fixtures;
pub mod graph;
pub mod mamba;
pub mod model;
pub mod moe;
#[cfg(feature = "mpi")]
pub mod mpi_backend;
pub mod ring;
pub mod rng;
pub mod state;
pub mod tensor;
#[cfg(test)]
mod testing;

pub use comm::{Collectives, CommError, Group, ThreadComm};
pub use data::DataSource;
pub use engine::{
    AdamConfig, Fault, FaultKind, Prepared, RankReport, RunSpec, Span, StepStats, Topology,
};
pub use error::ExecError;
pub use state::{ModelState, TensorState};

use std::panic::AssertUnwindSafe;
use std::str::FromStr;
use std::time::Instant;

/// Which backend runs the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// One thread per rank in this process.
    Threads,
    /// One MPI process per rank (feature `mpi`).
    Mpi,
    /// One GPU per rank with NCCL collectives (features `cuda`, `nccl`).
    Cuda,
}

impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "threads" => Ok(Backend::Threads),
            "mpi" => Ok(Backend::Mpi),
            "cuda" | "nccl" => Ok(Backend::Cuda),
            _ => Err(format!(
                "unknown backend '{s}' (expected threads, mpi or cuda)"
            )),
        }
    }
}

impl Backend {
    /// Name as typed on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Threads => "threads",
            Backend::Mpi => "mpi",
            Backend::Cuda => "cuda",
        }
    }
}

/// What a run produced.
#[derive(Debug, Default)]
pub struct RunReport {
    /// Mean loss over the global batch, per step.
    pub losses: Vec<f64>,
    /// Wall time per step (rank 0).
    pub step_times: Vec<f64>,
    /// The final state, when [`RunSpec::collect_state`] was set.
    pub state: Option<ModelState>,
    /// Measured timeline of every rank, when [`RunSpec::trace`] was set.
    pub spans: Vec<Span>,
    /// Ranks used.
    pub ranks: usize,
    /// The rank whose view this is: 0 for threads (the report covers every rank); this
    /// process's rank for MPI, where only rank 0 has the step times of rank 0, the state and
    /// every rank's spans, and should print.
    pub rank: usize,
}

/// Runs `spec` on `backend`: the threads backend here; the others when compiled in. The MPI
/// backend initialises and finalises MPI around this one run (use
/// `mpi_backend::MpiRuntime` for several runs in one process).
pub fn run(spec: &RunSpec, backend: Backend) -> Result<RunReport, ExecError> {
    match backend {
        Backend::Threads => run_threads(spec),
        #[cfg(feature = "mpi")]
        Backend::Mpi => mpi_backend::MpiRuntime::init()?.run(spec),
        #[cfg(not(feature = "mpi"))]
        Backend::Mpi => Err(ExecError::NotCompiled {
            backend: "mpi",
            feature: "mpi",
        }),
        // Under `mpirun` (with feature `mpi`): one process per GPU, across nodes; otherwise
        // one thread per GPU of this machine.
        #[cfg(all(feature = "cuda", feature = "mpi"))]
        Backend::Cuda if mpi_backend::launched_by_mpirun() => {
            cuda_backend::run_mpi(&mut mpi_backend::MpiRuntime::init()?, spec)
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda_backend::run(spec),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => Err(ExecError::NotCompiled {
            backend: "cuda",
            feature: "cuda,nccl",
        }),
    }
}

/// Runs a per-op plan of any graph on `backend`: threads, MPI, or one GPU per device of this
/// machine (GEMMs through cuBLAS) when compiled in.
pub fn run_graph(spec: &graph::GraphRunSpec, backend: Backend) -> Result<RunReport, ExecError> {
    match backend {
        Backend::Threads => graph::run_graph_threads(spec),
        #[cfg(feature = "mpi")]
        Backend::Mpi => mpi_backend::MpiRuntime::init()?.run_graph(spec),
        #[cfg(not(feature = "mpi"))]
        Backend::Mpi => Err(ExecError::NotCompiled {
            backend: "mpi",
            feature: "mpi",
        }),
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda_backend::run_graph(spec),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => Err(ExecError::NotCompiled {
            backend: "cuda",
            feature: "cuda,nccl",
        }),
    }
}

/// Runs `spec` with one thread per rank. A failing rank (error, panic, or a stall past
/// `spec.timeout`) ends the whole run with an error naming it.
pub fn run_threads(spec: &RunSpec) -> Result<RunReport, ExecError> {
    run_threads_with(spec, &|spec, prep, comm, epoch| {
        engine::run_rank(spec, prep, comm, epoch)
    })
}

/// How one rank's thread trains, given its thread endpoint: [`engine::run_rank`] as it is, or
/// after preparing the thread (a GPU, other collectives).
pub(crate) type RankMain<'a> = dyn Fn(&RunSpec, &Prepared, &mut ThreadComm, Instant) -> Result<RankReport, ExecError>
    + Sync
    + 'a;

/// [`run_threads`] with each rank's thread running `rank_main`.
pub(crate) fn run_threads_with(
    spec: &RunSpec,
    rank_main: &RankMain<'_>,
) -> Result<RunReport, ExecError> {
    let prep = Prepared::new(spec)?;
    let epoch = Instant::now();
    spawn_ranks(prep.topology().world(), spec.timeout, &|comm| {
        rank_main(spec, &prep, comm, epoch)
    })
}

/// Runs `world` ranks, one thread each, every one calling `rank_main` with its endpoint; the
/// report holds rank 0's losses, step times and state and every rank's spans. A failing rank
/// (error, panic, or a stall past `timeout`) ends the whole run with an error naming it.
pub(crate) fn spawn_ranks(
    world: usize,
    timeout: std::time::Duration,
    rank_main: &(dyn Fn(&mut ThreadComm) -> Result<RankReport, ExecError> + Sync),
) -> Result<RunReport, ExecError> {
    let (comms, shared) = ThreadComm::create(world, timeout);
    let results: Vec<Result<RankReport, ExecError>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let rank_shared = shared.clone();
                let rank = comm.rank();
                let h = std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let r = caught(rank, || rank_main(&mut comm));
                        if let Err(e) = &r {
                            let (who, why) = blame(rank, e);
                            rank_shared.fail(who, why);
                        }
                        r
                    });
                // The ranks already started would otherwise wait the whole timeout for it.
                if let Err(e) = &h {
                    shared.fail(rank, thread_start_failure(world, e));
                }
                h
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(ExecError::Rank {
                        rank,
                        message: "thread died".into(),
                    })
                }),
                Err(e) => Err(ExecError::Rank {
                    rank,
                    message: thread_start_failure(world, &e),
                }),
            })
            .collect()
    });
    // A diverged loss is the same on every rank: no rank is to blame.
    for r in &results {
        if let Err(ExecError::Diverged { step, loss }) = r {
            return Err(ExecError::Diverged {
                step: *step,
                loss: *loss,
            });
        }
    }
    if let Some((rank, message)) = shared.failure() {
        return Err(ExecError::Rank { rank, message });
    }
    let mut reports = Vec::with_capacity(world);
    for r in results {
        reports.push(r?);
    }
    let mut out = RunReport {
        ranks: world,
        ..RunReport::default()
    };
    for (i, r) in reports.into_iter().enumerate() {
        if i == 0 {
            out.losses = r.losses;
            out.step_times = r.step_times;
            out.state = r.state;
        }
        out.spans.extend(r.spans);
    }
    Ok(out)
}

fn thread_start_failure(world: usize, e: &std::io::Error) -> String {
    format!("cannot start {world} rank threads: {e} (check ulimit -u / the pids limit)")
}

/// Runs rank `rank`'s work, turning a panic into that rank's error.
pub(crate) fn caught<T>(
    rank: usize,
    f: impl FnOnce() -> Result<T, ExecError>,
) -> Result<T, ExecError> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        Err(ExecError::Rank {
            rank,
            message: format!("panicked: {msg}"),
        })
    })
}

/// The rank to blame for an error rank `rank` met, and why: the stalled or failed peer it
/// names, else `rank` itself.
fn blame(rank: usize, e: &ExecError) -> (usize, String) {
    match e {
        ExecError::Comm(CommError::Timeout {
            rank: waiter,
            culprit,
            what,
            secs,
        }) => (
            *culprit,
            format!("stopped responding: rank {waiter} waited {secs:.1} s for it in {what}"),
        ),
        ExecError::Comm(CommError::PeerFailed { peer, reason }) => (*peer, reason.clone()),
        ExecError::Rank { rank, message } => (*rank, message.clone()),
        other => (rank, other.to_string()),
    }
}

#[cfg(test)]
mod tests;
