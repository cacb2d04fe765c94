//! The `mpi` backend (cargo feature `mpi`): one MPI process per rank, started by
//! `mpirun -np N`; works within a node and across nodes.
//!
//! The collectives are the portable ones of [`Collectives`] over point-to-point messages, so
//! they reduce in the same fixed order as the `threads` backend: an MPI run gives bit-for-bit
//! the losses and parameters of the same layout on threads, every member of a group ends with
//! identical values, and every wait has a deadline (a blocking `MPI_Allreduce` could not time
//! out).
//!
//! Messages: each [`Collectives::send`] copies the data into an owned buffer with its 64-bit
//! tag in front and starts an `MPI_Isend` (never blocks on the receiver); receives poll with
//! `MPI_Improbe`, keep messages that arrive early in a table by `(source, tag)`, and back off
//! from spinning to sleeping while they wait, which matters when ranks outnumber cores.
//!
//! Faults: a rank that waits past the timeout asks the rank it waits for whom *it* waits for
//! (every rank answers such queries while it polls), follows the chain to the rank that is not
//! waiting or does not answer, and names that one. Any failure of a rank (error, panic,
//! timeout) is printed on stderr as one `error: rank R failed: …` line and then `MPI_Abort`
//! ends every process of the job, so a run never hangs.

use crate::calibrate::{
    host_adam_rank_params_per_s, measure_compute, time_all_reduce, AllReduceTimes, ComputeFigures,
    HostFigures, InterNode, Measurements,
};
use crate::comm::{Collectives, CommError, Group};
use crate::engine::{run_rank, Prepared, RankReport, RunSpec, Span};
use crate::error::ExecError;
use crate::graph::{run_graph_rank, GraphPrepared, GraphRunSpec};
use crate::RunReport;
use mpi::collective::CommunicatorCollectives;
use mpi::environment::Universe;
use mpi::point_to_point::{MatchedReceiveVec, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Figures each rank contributes to rank 0's calibration: the slowest all-reduce times it saw
/// inside its node (small, large) and across nodes (small, large), and its host Adam rate.
const FIGURES: usize = 5;

/// MPI tag of "whom are you waiting for?" queries (fault diagnosis).
const MPI_TAG_QUERY: i32 = 1;
/// MPI tag of the answers to [`MPI_TAG_QUERY`].
const MPI_TAG_REPLY: i32 = 2;
/// MPI tag of the first run's data messages; run `k` uses `MPI_TAG_DATA + k % DATA_TAGS`, so
/// that a rank still finishing run `k` leaves the messages of faster ranks already in run
/// `k + 1` queued for its next communicator.
const MPI_TAG_DATA: i32 = 16;
/// Distinct data tags. MPI guarantees tags up to 32 767 (`MPI_TAG_UB` is at least that).
const DATA_TAGS: u32 = 16_000;
/// Words before the payload of a data message: the 64-bit tag, low word first.
const HEADER: usize = 2;
/// "Not waiting for anyone" in answers to queries.
const NOT_WAITING: u32 = u32::MAX;
/// Longest a timed-out rank waits for the answer to one diagnosis query.
const QUERY_WAIT: Duration = Duration::from_secs(2);
/// Polls that spin before a waiting rank starts yielding its core.
const SPIN_POLLS: u32 = 64;
/// Polls that yield before a waiting rank starts sleeping between polls.
const YIELD_POLLS: u32 = 1024;
/// Sleep between polls of a rank that has waited a while: short against a pipeline pass,
/// long enough to leave the core to the ranks that are computing.
const IDLE_SLEEP: Duration = Duration::from_micros(50);

/// The narrow FFI part: non-blocking sends from buffers this module owns.
#[allow(unsafe_code)]
mod raw {
    use mpi::datatype::Equivalence;
    use mpi::ffi;
    use mpi::raw::AsRaw;
    use mpi::topology::SimpleCommunicator;
    use std::mem::MaybeUninit;
    use std::os::raw::{c_int, c_void};

    /// An `MPI_Isend` in flight together with the buffer MPI reads from.
    pub(super) struct PendingSend {
        req: ffi::MPI_Request,
        buf: Vec<u32>,
        done: bool,
    }

    impl std::fmt::Debug for PendingSend {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("PendingSend")
                .field("words", &self.buf.len())
                .field("done", &self.done)
                .finish()
        }
    }

    // SAFETY: the request is an opaque handle owned by this value; MPI is initialised with
    // at least MPI_THREAD_SERIALIZED (checked in `MpiRuntime::init`), which allows MPI calls
    // from any thread as long as they do not overlap, and the handle is only used through
    // `&mut self` of the one communicator endpoint of the process.
    unsafe impl Send for PendingSend {}

    impl PendingSend {
        /// Starts sending `buf` to `dest` with `tag` on the world communicator. `None` when
        /// the message is too long for an MPI count.
        pub(super) fn start(dest: i32, tag: i32, buf: Vec<u32>) -> Option<PendingSend> {
            let count = c_int::try_from(buf.len()).ok()?;
            let world = SimpleCommunicator::world();
            let mut req = MaybeUninit::<ffi::MPI_Request>::uninit();
            // SAFETY: `buf` is a live allocation of `count` u32 values described by the u32
            // datatype; it is moved into the returned value, whose heap storage does not move
            // and is not freed before MPI_Test reports completion (see `Drop`). `req` is
            // written by MPI_Isend before it returns (errors abort: MPI_ERRORS_ARE_FATAL).
            let req = unsafe {
                ffi::MPI_Isend(
                    buf.as_ptr().cast::<c_void>(),
                    count,
                    u32::equivalent_datatype().as_raw(),
                    dest,
                    tag,
                    world.as_raw(),
                    req.as_mut_ptr(),
                );
                req.assume_init()
            };
            Some(PendingSend {
                req,
                buf,
                done: false,
            })
        }

        /// Whether the send has completed (the buffer is free again).
        pub(super) fn test(&mut self) -> bool {
            if self.done {
                return true;
            }
            let mut flag: c_int = 0;
            let mut status = MaybeUninit::<ffi::MPI_Status>::uninit();
            // SAFETY: `req` is the active request started in `start` (MPI_Test sets it to
            // MPI_REQUEST_NULL on completion and is never called again after that, because
            // `done` is set); `flag` and `status` are valid for writes.
            unsafe {
                ffi::MPI_Test(&mut self.req, &mut flag, status.as_mut_ptr());
            }
            self.done = flag != 0;
            self.done
        }
    }

    impl Drop for PendingSend {
        fn drop(&mut self) {
            if self.done || self.test() {
                return;
            }
            // Still in flight (only on a failure path: a finished run waits for its sends).
            // MPI may read the buffer until the transfer ends, so release the request and
            // leak the buffer rather than block here or free memory MPI still reads.
            // SAFETY: `req` is an active request; MPI_Request_free lets it complete in the
            // background and sets the handle to MPI_REQUEST_NULL.
            unsafe {
                ffi::MPI_Request_free(&mut self.req);
            }
            std::mem::forget(std::mem::take(&mut self.buf));
        }
    }
}

use raw::PendingSend;

/// One process's endpoint of the MPI backend. Made by [`MpiRuntime`] for each run.
#[derive(Debug)]
pub struct MpiComm {
    rank: usize,
    world: usize,
    data_tag: i32,
    timeout: Duration,
    /// Data messages that arrived before anyone asked for them, whole (header included).
    pending: HashMap<(usize, u64), VecDeque<Vec<u32>>>,
    seq: HashMap<u32, u64>,
    sends: Vec<PendingSend>,
    /// The rank this one is blocked receiving from, for answers to queries.
    waiting_on: Option<usize>,
    /// Answers to this rank's queries, by the rank that answered.
    replies: HashMap<usize, u32>,
}

impl MpiComm {
    fn new(rank: usize, world: usize, data_tag: i32, timeout: Duration) -> MpiComm {
        MpiComm {
            rank,
            world,
            data_tag,
            timeout,
            pending: HashMap::new(),
            seq: HashMap::new(),
            sends: Vec::new(),
            waiting_on: None,
            replies: HashMap::new(),
        }
    }

    fn start_send(&mut self, to: usize, tag: i32, buf: Vec<u32>) -> Result<(), CommError> {
        let dest = i32::try_from(to).map_err(|_| CommError::Disconnected { peer: to })?;
        let words = buf.len();
        let s = PendingSend::start(dest, tag, buf).ok_or_else(|| {
            CommError::Backend(format!(
                "message of {words} words to rank {to} is too long for one MPI send"
            ))
        })?;
        self.sends.push(s);
        Ok(())
    }

    /// Frees the buffers of completed sends.
    fn reap_sends(&mut self) {
        self.sends.retain_mut(|s| !s.test());
    }

    /// Takes in every message that has arrived: stores data, answers queries, records
    /// replies. Returns whether anything arrived.
    fn poll(&mut self) -> Result<bool, CommError> {
        let world = SimpleCommunicator::world();
        let mut any = false;
        // Only this run's data tag: a faster rank may already be sending data of the next
        // run, which must stay queued in MPI for this process's next communicator.
        for mpi_tag in [self.data_tag, MPI_TAG_QUERY, MPI_TAG_REPLY] {
            while let Some(probed) = world
                .any_process()
                .immediate_matched_probe_with_tag(mpi_tag)
            {
                any = true;
                let (words, status): (Vec<u32>, _) = probed.matched_receive_vec();
                let from = usize::try_from(status.source_rank()).unwrap_or(usize::MAX);
                match mpi_tag {
                    MPI_TAG_QUERY => {
                        let answer = self
                            .waiting_on
                            .and_then(|r| u32::try_from(r).ok())
                            .unwrap_or(NOT_WAITING);
                        self.start_send(from, MPI_TAG_REPLY, vec![answer])?;
                    }
                    MPI_TAG_REPLY => {
                        if let Some(a) = words.first() {
                            self.replies.insert(from, *a);
                        }
                    }
                    _ if words.len() >= HEADER => {
                        let tag = u64::from(words[0]) | (u64::from(words[1]) << 32);
                        self.pending
                            .entry((from, tag))
                            .or_default()
                            .push_back(words);
                    }
                    _ => {
                        return Err(CommError::Backend(format!(
                            "rank {from} sent a malformed message of {} words",
                            words.len()
                        )))
                    }
                }
            }
        }
        self.reap_sends();
        Ok(any)
    }

    /// Waits between polls: spins briefly, then yields the core, then sleeps.
    fn back_off(idle: u32) {
        if idle < SPIN_POLLS {
            std::hint::spin_loop();
        } else if idle < YIELD_POLLS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(IDLE_SLEEP);
        }
    }

    /// The rank holding things up when this one has waited too long for `from`: follows
    /// "whom are you waiting for?" from `from` until a rank that waits for nobody, does not
    /// answer, or closes a cycle.
    fn culprit(&mut self, from: usize) -> Result<usize, CommError> {
        let wait = QUERY_WAIT.min(self.timeout.max(Duration::from_millis(100)));
        let mut cur = from;
        for _ in 0..self.world {
            self.replies.remove(&cur);
            self.start_send(cur, MPI_TAG_QUERY, vec![0])?;
            let t0 = Instant::now();
            let mut idle = 0;
            let answer = loop {
                if let Some(a) = self.replies.remove(&cur) {
                    break Some(a);
                }
                if t0.elapsed() >= wait {
                    break None;
                }
                if self.poll()? {
                    idle = 0;
                } else {
                    Self::back_off(idle);
                    idle += 1;
                }
            };
            match answer.map(|a| a as usize) {
                Some(next) if next < self.world && next != self.rank && next != cur => {
                    cur = next;
                }
                _ => return Ok(cur),
            }
        }
        Ok(cur)
    }

    /// Waits until every send of this rank has been delivered.
    fn flush(&mut self, what: &str) -> Result<(), CommError> {
        let t0 = Instant::now();
        let mut idle = 0;
        while !self.sends.is_empty() {
            if t0.elapsed() >= self.timeout {
                return Err(CommError::Backend(format!(
                    "rank {}: {} sends still undelivered after {:.1} s in {what}",
                    self.rank,
                    self.sends.len(),
                    t0.elapsed().as_secs_f64()
                )));
            }
            if self.poll()? {
                idle = 0;
            } else {
                Self::back_off(idle);
                idle += 1;
            }
        }
        Ok(())
    }
}

impl Collectives for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CommError> {
        if to >= self.world {
            return Err(CommError::Disconnected { peer: to });
        }
        let mut buf = Vec::with_capacity(HEADER + data.len());
        buf.push(tag as u32);
        buf.push((tag >> 32) as u32);
        buf.extend(data.iter().map(|x| x.to_bits()));
        self.start_send(to, self.data_tag, buf)
    }

    fn recv(
        &mut self,
        from: usize,
        tag: u64,
        out: &mut [f32],
        what: &str,
    ) -> Result<(), CommError> {
        let start = Instant::now();
        let mut idle = 0;
        let result = loop {
            if let Some(q) = self.pending.get_mut(&(from, tag)) {
                if let Some(words) = q.pop_front() {
                    if q.is_empty() {
                        self.pending.remove(&(from, tag));
                    }
                    let payload = &words[HEADER..];
                    break if payload.len() == out.len() {
                        for (o, w) in out.iter_mut().zip(payload) {
                            *o = f32::from_bits(*w);
                        }
                        Ok(())
                    } else {
                        Err(CommError::Size {
                            what: "recv",
                            got: payload.len(),
                            expected: out.len(),
                        })
                    };
                }
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                self.waiting_on = Some(from);
                let culprit = self.culprit(from)?;
                break Err(CommError::Timeout {
                    rank: self.rank,
                    culprit,
                    what: format!("{what} (receiving from rank {from})"),
                    secs: waited.as_secs_f64(),
                });
            }
            self.waiting_on = Some(from);
            if self.poll()? {
                idle = 0;
            } else {
                Self::back_off(idle);
                idle += 1;
            }
        };
        self.waiting_on = None;
        result
    }

    fn next_tag(&mut self, group: &Group) -> u64 {
        crate::comm::collective_tag(&mut self.seq, group.id())
    }

    fn check_peers(&mut self) -> Result<(), CommError> {
        // Answers queries and moves sends along between passes; a failed peer ends the job
        // through MPI_Abort, so there is nothing else to learn here.
        self.poll().map(|_| ())
    }
}

/// How one MPI rank trains, given its endpoint (see [`MpiRuntime::run_with`]).
pub type MpiRankMain<'a> = dyn Fn(&RunSpec, &Prepared, &mut MpiComm, Instant) -> Result<crate::engine::RankReport, ExecError>
    + 'a;

/// Whether this process was started by an MPI launcher (`mpirun`, `srun` with PMI/PMIx):
/// the environment variables OpenMPI, MPICH/PMI and PMIx set for every process.
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// MPI for this process: initialised once, finalised when dropped. Runs any number of
/// layouts one after the other, each on all the processes of the job.
pub struct MpiRuntime {
    // Finalises MPI when dropped.
    _universe: Universe,
    rank: usize,
    world: usize,
    runs: u32,
}

impl std::fmt::Debug for MpiRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiRuntime")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("runs", &self.runs)
            .finish_non_exhaustive()
    }
}

impl MpiRuntime {
    /// Initialises MPI (at least `MPI_THREAD_SERIALIZED`). Fails if MPI is already
    /// initialised in this process or the library lacks that thread level.
    pub fn init() -> Result<MpiRuntime, ExecError> {
        let (universe, level) =
            mpi::initialize_with_threading(Threading::Serialized).ok_or_else(|| {
                ExecError::Backend {
                    backend: "mpi",
                    message: "MPI is already initialised in this process (one MpiRuntime per \
                              process)"
                        .into(),
                }
            })?;
        if level < Threading::Serialized {
            return Err(ExecError::Backend {
                backend: "mpi",
                message: format!(
                    "the MPI library provides thread level {level:?}; parallax needs Serialized \
                     (OpenMPI does)"
                ),
            });
        }
        let world = universe.world();
        Ok(MpiRuntime {
            _universe: universe,
            rank: usize::try_from(world.rank()).unwrap_or(0),
            world: usize::try_from(world.size()).unwrap_or(1),
            runs: 0,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes in the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Runs `spec` with this process as its rank. Input errors (a layout that needs another
    /// number of processes, a bad model) are returned on every rank alike. A failure while
    /// running prints `error: rank R failed: …` on stderr and aborts the whole MPI job
    /// (`MPI_Abort`), so the other ranks do not wait out their timeouts. Rank 0's report has
    /// the step times, the gathered state and every rank's spans; the others have the losses.
    pub fn run(&mut self, spec: &RunSpec) -> Result<RunReport, ExecError> {
        self.run_with(spec, &|spec, prep, comm, epoch| {
            run_rank(spec, prep, comm, epoch)
        })
    }

    /// [`MpiRuntime::run`] with this process's rank running `rank_main` (which prepares the
    /// process, e.g. its GPU, and then trains over `comm` or collectives built on it).
    pub fn run_with(
        &mut self,
        spec: &RunSpec,
        rank_main: &MpiRankMain<'_>,
    ) -> Result<RunReport, ExecError> {
        let prep = Prepared::new(spec)?;
        let epoch = Instant::now();
        self.drive(
            prep.topology().world(),
            spec.timeout,
            spec.trace,
            &|comm: &mut MpiComm| rank_main(spec, &prep, comm, epoch),
        )
    }

    /// Runs a per-op plan of any graph (the general-graph trainer) with every process of
    /// the job as one device of the plan.
    pub fn run_graph(&mut self, spec: &GraphRunSpec) -> Result<RunReport, ExecError> {
        let prep = GraphPrepared::new(spec)?;
        let epoch = Instant::now();
        self.drive(
            prep.world(),
            spec.timeout,
            spec.trace,
            &|comm: &mut MpiComm| run_graph_rank(spec, &prep, comm, epoch),
        )
    }

    /// Checks the job has the `need` processes a run takes, then runs `rank_main` on this
    /// process's endpoint between barriers, gathering every rank's spans when `trace`.
    fn drive(
        &mut self,
        need: usize,
        timeout: Duration,
        trace: bool,
        rank_main: &dyn Fn(&mut MpiComm) -> Result<RankReport, ExecError>,
    ) -> Result<RunReport, ExecError> {
        if need != self.world {
            return Err(ExecError::Layout(format!(
                "the layout needs {need} ranks but the MPI job has {} processes (start it with \
                 `mpirun -np {need}`)",
                self.world
            )));
        }
        self.runs += 1;
        let data_tag = MPI_TAG_DATA + (self.runs % DATA_TAGS) as i32;
        let mut comm = MpiComm::new(self.rank, self.world, data_tag, timeout);
        let all = Group::new((0..self.world).collect());
        if let Err(e) = comm.barrier(&all) {
            self.abort(e.into());
        }
        let result = crate::caught(self.rank, || rank_main(&mut comm));
        let report = match result {
            Ok(r) => r,
            Err(e) => self.abort(e),
        };
        let spans = if trace {
            match gather_spans(&mut comm, &all, report.spans) {
                Ok(s) => s,
                Err(e) => self.abort(e.into()),
            }
        } else {
            Vec::new()
        };
        if let Err(e) = comm
            .flush("the end of the run")
            .and_then(|()| comm.barrier(&all))
            .and_then(|()| comm.flush("the end of the run"))
        {
            self.abort(e.into());
        }
        Ok(RunReport {
            losses: report.losses,
            step_times: report.step_times,
            state: report.state,
            spans,
            ranks: self.world,
            rank: self.rank,
        })
    }

    /// Every rank's host, as a key that is equal for ranks on one node (a collective: every
    /// process calls it, with no message of ours in flight).
    pub fn hosts(&self) -> Vec<u64> {
        let world = SimpleCommunicator::world();
        let name = mpi::environment::processor_name().unwrap_or_default();
        let mut hosts = vec![0u64; self.world];
        world.all_gather_into(&host_key(&name), &mut hosts[..]);
        hosts
    }

    /// This process's index among the processes on its node (a collective, as
    /// [`MpiRuntime::hosts`]): the GPU it takes when each process drives one.
    pub fn local_rank(&self) -> usize {
        let hosts = self.hosts();
        hosts[..self.rank]
            .iter()
            .filter(|h| **h == hosts[self.rank])
            .count()
    }

    /// Calibrates with every process of the job (`mpirun -np N parallax calibrate --backend
    /// mpi`): all ranks run the compute benchmarks at once (one core each), the ranks on rank
    /// 0's node time all-reduces among themselves, and, when the job spans several nodes, one
    /// rank per node times all-reduces across nodes. Rank 0 gets the figures (compute figures
    /// averaged over the ranks of its node, and the host's Adam step that all of its node's
    /// ranks run at once); the other ranks get `None`.
    pub fn calibrate(&mut self, quick: bool) -> Result<Option<Measurements>, ExecError> {
        let hosts = self.hosts();
        self.runs += 1;
        let data_tag = MPI_TAG_DATA + (self.runs % DATA_TAGS) as i32;
        let mut comm = MpiComm::new(self.rank, self.world, data_tag, Duration::from_secs(120));
        let all = Group::new((0..self.world).collect());
        let result = (|| -> Result<Option<Measurements>, ExecError> {
            let local = Group::new(
                (0..self.world)
                    .filter(|&r| hosts[r] == hosts[0])
                    .collect::<Vec<_>>(),
            );
            let mut leaders: Vec<usize> = Vec::new();
            for r in 0..self.world {
                if !leaders.iter().any(|&l| hosts[l] == hosts[r]) {
                    leaders.push(r);
                }
            }
            let leaders = Group::new(leaders);
            comm.barrier(&all)?;
            let mine = measure_compute(1, quick);
            // The mean over the ranks of rank 0's node (every rank measures the same shapes,
            // so the vectors line up).
            let mut v: Vec<f32> = mine.to_vec().iter().map(|x| *x as f32).collect();
            if local.ranks().contains(&self.rank) {
                comm.all_reduce_sum(&local, &mut v)?;
            }
            comm.barrier(&all)?;
            let intra = if local.size() > 1 && local.ranks().contains(&self.rank) {
                Some(time_all_reduce(&mut comm, &local, quick)?)
            } else {
                None
            };
            comm.barrier(&all)?;
            let inter = if leaders.size() > 1 && leaders.ranks().contains(&self.rank) {
                Some(time_all_reduce(&mut comm, &leaders, quick)?)
            } else {
                None
            };
            // The host's Adam step as an offloaded optimizer runs it: every rank of a node at
            // once, each on its own core and its share of the parameters, all through the
            // node's memory.
            let ranks_here = (0..self.world)
                .filter(|&r| hosts[r] == hosts[self.rank])
                .count();
            comm.barrier(&all)?;
            let adam = host_adam_rank_params_per_s(ranks_here, quick);
            // Rank 0 needs the slowest member's times of each group, and the Adam rates of
            // its node's ranks.
            let mut mine = [0f32; FIGURES];
            if let Some(t) = intra {
                mine[0] = t.small_s as f32;
                mine[1] = t.large_s as f32;
            }
            if let Some(t) = inter {
                mine[2] = t.small_s as f32;
                mine[3] = t.large_s as f32;
            }
            mine[4] = adam as f32;
            let mut all_figures = vec![0f32; FIGURES * self.world];
            comm.all_gather(&all, &mine, &mut all_figures)?;
            comm.barrier(&all)?;
            if self.rank != 0 {
                return Ok(None);
            }
            let slowest_adam = local
                .ranks()
                .iter()
                .map(|&r| f64::from(all_figures[FIGURES * r + 4]))
                .fold(f64::INFINITY, f64::min);
            let times = |i: usize, bytes: f64| {
                all_figures
                    .chunks_exact(FIGURES)
                    .fold(AllReduceTimes::default(), |acc, t| {
                        acc.max(&AllReduceTimes {
                            small_s: f64::from(t[i]),
                            large_s: f64::from(t[i + 1]),
                            large_bytes: bytes,
                        })
                    })
            };
            let bytes = intra.or(inter).map_or(0.0, |t| t.large_bytes);
            let n = local.size() as f64;
            let mean: Vec<f64> = v.iter().map(|x| f64::from(*x) / n).collect();
            let c = ComputeFigures::from_vec(&mean);
            Ok(Some(Measurements {
                backend: "mpi",
                threads: local.size(),
                compute: c,
                // One rank per node: nothing to measure inside a node.
                intra: (local.size() > 1).then(|| times(0, bytes).fit(local.size())),
                inter: (leaders.size() > 1).then(|| InterNode {
                    nodes: leaders.size(),
                    fit: times(2, bytes).fit(leaders.size()),
                }),
                device: None,
                host: Some(HostFigures {
                    cores: local.size(),
                    adam_params_per_s: slowest_adam * local.size() as f64,
                    link: None,
                }),
                nvme: None,
            }))
        })();
        match result {
            Ok(m) => {
                if let Err(e) = comm.flush("the end of calibration") {
                    self.abort(e.into());
                }
                Ok(m)
            }
            Err(e) => self.abort(e),
        }
    }

    /// Prints the failure as one line naming the rank at fault, then ends the MPI job.
    fn abort(&self, e: ExecError) -> ! {
        let (who, why) = crate::blame(self.rank, &e);
        let e = ExecError::Rank {
            rank: who,
            message: why,
        };
        // One write, so that the lines of ranks failing together do not interleave.
        let line = format!(
            "error: {e} (reported by rank {}; aborting the MPI job)\n",
            self.rank
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        SimpleCommunicator::world().abort(1)
    }
}

/// A key of a host name: ranks with equal keys share a node.
fn host_key(name: &str) -> u64 {
    crate::rng::fnv1a64(name.as_bytes())
}

/// Span categories as sent between ranks.
const CATS: [&str; 4] = ["forward", "backward", "comm", "optimizer"];

/// Sends every rank's spans to rank 0; returns them all there (and nothing elsewhere).
fn gather_spans(comm: &mut MpiComm, all: &Group, mine: Vec<Span>) -> Result<Vec<Span>, CommError> {
    let tag = comm.next_tag(all);
    if comm.rank() != 0 {
        let words = encode_spans(&mine);
        let as_f32 = |w: &[u32]| w.iter().map(|x| f32::from_bits(*x)).collect::<Vec<_>>();
        comm.send(0, tag, &as_f32(&[words.len() as u32]))?;
        comm.send(0, tag | 1 << 31, &as_f32(&words))?;
        return Ok(Vec::new());
    }
    let mut spans = mine;
    for r in 1..comm.world() {
        let mut len = [0.0f32];
        comm.recv(r, tag, &mut len, "trace gathering")?;
        let mut buf = vec![0.0f32; len[0].to_bits() as usize];
        comm.recv(r, tag | 1 << 31, &mut buf, "trace gathering")?;
        let words: Vec<u32> = buf.iter().map(|x| x.to_bits()).collect();
        spans.extend(
            decode_spans(&words)
                .ok_or_else(|| CommError::Backend(format!("rank {r} sent a malformed trace")))?,
        );
    }
    Ok(spans)
}

fn encode_spans(spans: &[Span]) -> Vec<u32> {
    let mut w = Vec::new();
    for s in spans {
        let cat = CATS.iter().position(|c| *c == s.cat).unwrap_or(CATS.len()) as u32;
        w.extend([s.rank as u32, s.stage as u32, cat]);
        for x in [s.step, s.start_s.to_bits(), s.dur_s.to_bits()] {
            w.extend([x as u32, (x >> 32) as u32]);
        }
        let name = s.name.as_bytes();
        w.push(name.len() as u32);
        w.extend(name.chunks(4).map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        }));
    }
    w
}

fn decode_spans(mut w: &[u32]) -> Option<Vec<Span>> {
    let mut out = Vec::new();
    while !w.is_empty() {
        let fixed = w.get(..10)?;
        let u64_at = |i: usize| u64::from(fixed[i]) | (u64::from(fixed[i + 1]) << 32);
        let len = fixed[9] as usize;
        let name_words = len.div_ceil(4);
        let bytes: Vec<u8> = w
            .get(10..10 + name_words)?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .take(len)
            .collect();
        out.push(Span {
            rank: fixed[0] as usize,
            stage: fixed[1] as usize,
            cat: CATS.get(fixed[2] as usize).copied().unwrap_or("other"),
            step: u64_at(3),
            start_s: f64::from_bits(u64_at(5)),
            dur_s: f64::from_bits(u64_at(7)),
            name: String::from_utf8(bytes).ok()?,
        });
        w = &w[10 + name_words..];
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_survive_the_wire() {
        let spans = vec![
            Span {
                rank: 3,
                stage: 1,
                name: "F mb12 c0".into(),
                cat: "forward",
                step: 4,
                start_s: 0.125,
                dur_s: 1e-3,
            },
            Span {
                rank: 1,
                stage: 0,
                name: "grad-sync".into(),
                cat: "comm",
                step: 0,
                start_s: 2.5,
                dur_s: 0.0,
            },
        ];
        assert_eq!(decode_spans(&encode_spans(&spans)), Some(spans));
        assert_eq!(decode_spans(&[1, 2, 3]), None);
    }
}
