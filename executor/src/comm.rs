//! The collective interface every backend implements, and the `threads` backend: one thread
//! per rank, messages over channels, a deadline on every receive and barrier.
//!
//! The portable collectives are built from point-to-point messages with a fixed reduction
//! order (the contributions to each element are summed in group order on exactly one rank and
//! then distributed), so every member of a group ends with bitwise-identical results and a run
//! is reproducible bit for bit. Bandwidth per rank is that of a ring: `(n−1)/n` of the buffer
//! out and in per reduce-scatter or all-gather. The threads backend replaces all-reduce,
//! reduce-scatter and all-gather with versions over buffers its group shares (reused from
//! call to call, no allocation per message) that sum in the same order, so they give the same
//! bits; on this 2-core machine that took a 16 MiB all-reduce from 0.46 to 2.0 GB/s bus
//! bandwidth on 2 threads (0.30 to 1.5 GB/s on 4) and a 1-element one from 26 to 6 µs on 4
//! (`all_reduce_bandwidth`, an ignored test).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Why a communication failed. Every message names the rank at fault.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum CommError {
    /// A receive waited past the deadline.
    #[error("rank {culprit} stalled: rank {rank} waited {secs:.1} s for it in {what} (timeout)")]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// The rank found to be stuck (the end of the chain of waiting ranks).
        culprit: usize,
        /// What the waiting rank was doing.
        what: String,
        /// How long it waited.
        secs: f64,
    },
    /// Another rank failed and the run is being torn down.
    #[error("rank {peer} failed: {reason}")]
    PeerFailed {
        /// The failed rank.
        peer: usize,
        /// Its error.
        reason: String,
    },
    /// A peer's endpoint is gone without a report.
    #[error("rank {peer} is gone (its connection closed)")]
    Disconnected {
        /// The rank.
        peer: usize,
    },
    /// A buffer has the wrong length for a collective.
    #[error("{what}: buffer of {got} elements, expected {expected}")]
    Size {
        /// The collective.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length needed.
        expected: usize,
    },
    /// The calling rank is not a member of the group it used.
    #[error("rank {rank} is not in group {group:?}")]
    NotInGroup {
        /// The rank.
        rank: usize,
        /// The group's members.
        group: Vec<usize>,
    },
    /// The backend cannot do this (e.g. not compiled in).
    #[error("{0}")]
    Backend(String),
}

/// An ordered set of global ranks that take part in a collective together.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    ranks: Vec<usize>,
    id: u32,
}

impl Group {
    /// A group of these ranks (in this order). The id is a hash of the members, so every
    /// process computes the same one.
    pub fn new(ranks: Vec<usize>) -> Self {
        let mut h: u32 = 0x811c_9dc5;
        for r in &ranks {
            for b in (*r as u32).to_le_bytes() {
                h ^= u32::from(b);
                h = h.wrapping_mul(0x0100_0193);
            }
        }
        Group {
            ranks,
            id: h & 0x7fff_ffff,
        }
    }

    /// The members.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// The 31-bit id (a hash of the members; every process computes the same one).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Position of `rank` in the group.
    pub fn index_of(&self, rank: usize) -> Result<usize, CommError> {
        self.ranks
            .iter()
            .position(|r| *r == rank)
            .ok_or_else(|| CommError::NotInGroup {
                rank,
                group: self.ranks.clone(),
            })
    }
}

/// Message tags at or above this are reserved for collectives.
pub const COLLECTIVE_TAG: u64 = 1 << 63;

/// The tag of the next collective on group `id`, counted in `seq` (one counter per group, so
/// every member numbers the group's collectives alike): point-to-point tags stay below
/// [`COLLECTIVE_TAG`].
pub(crate) fn collective_tag(seq: &mut HashMap<u32, u64>, id: u32) -> u64 {
    let s = seq.entry(id).or_insert(0);
    *s += 1;
    COLLECTIVE_TAG | (u64::from(id) << 32) | (*s & 0xffff_ffff)
}

/// The collective interface. Backends implement `send`, `recv` and `next_tag`; the collectives
/// have portable default implementations over them, which a backend may replace with native
/// ones that produce the same values.
pub trait Collectives: Send + std::fmt::Debug {
    /// This process's global rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Sends `data` to `to` with a tag (never blocks on the receiver).
    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CommError>;
    /// Receives exactly `out.len()` elements from `from` with `tag`, or fails after the
    /// backend's timeout naming the rank that holds things up.
    fn recv(&mut self, from: usize, tag: u64, out: &mut [f32], what: &str)
        -> Result<(), CommError>;
    /// A fresh tag for the next collective on `group` (all members call collectives on a group
    /// in the same order, so they agree on it).
    fn next_tag(&mut self, group: &Group) -> u64;
    /// [`Collectives::send`] of a buffer the caller gives up (a backend may hand it over
    /// without a copy).
    fn send_owned(&mut self, to: usize, tag: u64, data: Vec<f32>) -> Result<(), CommError> {
        self.send(to, tag, &data)
    }
    /// [`Collectives::recv`] of `len` elements into a buffer of its own (a backend may hand
    /// over the one it received without a copy).
    fn recv_owned(
        &mut self,
        from: usize,
        tag: u64,
        len: usize,
        what: &str,
    ) -> Result<Vec<f32>, CommError> {
        let mut out = vec![0.0; len];
        self.recv(from, tag, &mut out, what)?;
        Ok(out)
    }
    /// Checks whether another rank has failed (cheap; called between passes).
    fn check_peers(&mut self) -> Result<(), CommError> {
        Ok(())
    }

    /// Sum of `buf` over the group, in place on every member.
    fn all_reduce_sum(&mut self, g: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        let n = g.size();
        if n == 1 {
            return Ok(());
        }
        let chunk = buf.len().div_ceil(n);
        let mut padded = vec![0.0f32; chunk * n];
        padded[..buf.len()].copy_from_slice(buf);
        let mut mine = vec![0.0f32; chunk];
        self.reduce_scatter_sum(g, &padded, &mut mine)?;
        self.all_gather(g, &mine, &mut padded)?;
        buf.copy_from_slice(&padded[..buf.len()]);
        Ok(())
    }

    /// `input` is `n` equal chunks; member `i` receives the sum over members of chunk `i`.
    fn reduce_scatter_sum(
        &mut self,
        g: &Group,
        input: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let n = g.size();
        let c = out.len();
        expect_len("reduce_scatter", input.len(), c * n)?;
        let me = g.index_of(self.rank())?;
        if n == 1 {
            out.copy_from_slice(input);
            return Ok(());
        }
        let tag = self.next_tag(g);
        for (i, r) in g.ranks().iter().enumerate() {
            if i != me {
                self.send(*r, tag, &input[i * c..(i + 1) * c])?;
            }
        }
        let mut parts = vec![0.0f32; c * n];
        for (i, r) in g.ranks().iter().enumerate() {
            if i == me {
                parts[i * c..(i + 1) * c].copy_from_slice(&input[me * c..(me + 1) * c]);
            } else {
                self.recv(*r, tag, &mut parts[i * c..(i + 1) * c], "reduce_scatter")?;
            }
        }
        out.copy_from_slice(&parts[..c]);
        for i in 1..n {
            for (o, p) in out.iter_mut().zip(&parts[i * c..(i + 1) * c]) {
                *o += p;
            }
        }
        Ok(())
    }

    /// Concatenation of every member's `input` (in group order) into `out` on every member.
    fn all_gather(&mut self, g: &Group, input: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let n = g.size();
        let c = input.len();
        expect_len("all_gather", out.len(), c * n)?;
        let me = g.index_of(self.rank())?;
        if n == 1 {
            out.copy_from_slice(input);
            return Ok(());
        }
        let tag = self.next_tag(g);
        for (i, r) in g.ranks().iter().enumerate() {
            if i != me {
                self.send(*r, tag, input)?;
            }
        }
        for (i, r) in g.ranks().iter().enumerate() {
            if i == me {
                out[i * c..(i + 1) * c].copy_from_slice(input);
            } else {
                self.recv(*r, tag, &mut out[i * c..(i + 1) * c], "all_gather")?;
            }
        }
        Ok(())
    }

    /// `buf` of the member `root` (a global rank) copied to every member.
    fn broadcast(&mut self, g: &Group, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        g.index_of(root)?;
        g.index_of(self.rank())?;
        if g.size() == 1 {
            return Ok(());
        }
        let tag = self.next_tag(g);
        if self.rank() == root {
            for r in g.ranks() {
                if *r != root {
                    self.send(*r, tag, buf)?;
                }
            }
            Ok(())
        } else {
            self.recv(root, tag, buf, "broadcast")
        }
    }

    /// Returns once every member has entered the barrier.
    fn barrier(&mut self, g: &Group) -> Result<(), CommError> {
        let mut x = [0.0f32];
        self.all_reduce_sum(g, &mut x)
    }
}

/// A message between threads.
#[derive(Debug)]
struct Msg {
    from: usize,
    tag: u64,
    data: Vec<f32>,
}

/// "Not waiting" marker in [`Shared::waiting_on`].
const NOT_WAITING: usize = usize::MAX;

/// State shared by the ranks of one threads-backend run.
#[derive(Debug)]
pub struct Shared {
    aborted: AtomicBool,
    failure: Mutex<Option<(usize, String)>>,
    /// For each rank, the rank it is blocked receiving from (or [`NOT_WAITING`]).
    waiting_on: Vec<AtomicUsize>,
    /// Shared buffers of the groups used so far, by members.
    groups: Mutex<HashMap<Vec<usize>, Arc<GroupBuffers>>>,
}

/// Arrival counts of a group's barrier.
#[derive(Debug)]
struct BarrierState {
    /// Barriers completed.
    generation: u64,
    /// Members arrived at the current one.
    count: usize,
    /// For each member, the generation of the last barrier it arrived at, plus one.
    arrived: Vec<u64>,
}

/// Buffers one group's members share for collectives, reused from call to call (no
/// allocation after the first call of a size). Two sets, used alternately: a collective
/// writes set `k % 2`, and set `k % 2` is written again only by collective `k + 2`, which no
/// member starts before every member has passed the first barrier of `k + 1`, so after it has
/// finished reading the results of `k`.
#[derive(Debug)]
struct GroupBuffers {
    /// Each member's contribution.
    inputs: [Vec<RwLock<Vec<f32>>>; 2],
    /// Each member's reduced chunk (all-reduce).
    sums: [Vec<RwLock<Vec<f32>>>; 2],
    state: Mutex<BarrierState>,
    cv: Condvar,
    /// `state.generation`, readable without the lock (for the short spin before sleeping).
    generation: AtomicU64,
}

impl GroupBuffers {
    fn new(n: usize) -> GroupBuffers {
        let set = || (0..n).map(|_| RwLock::new(Vec::new())).collect();
        GroupBuffers {
            inputs: [set(), set()],
            sums: [set(), set()],
            state: Mutex::new(BarrierState {
                generation: 0,
                count: 0,
                arrived: vec![0; n],
            }),
            cv: Condvar::new(),
            generation: AtomicU64::new(0),
        }
    }
}

/// A size error unless `got == expected`.
pub(crate) fn expect_len(what: &'static str, got: usize, expected: usize) -> Result<(), CommError> {
    if got == expected {
        Ok(())
    } else {
        Err(CommError::Size {
            what,
            got,
            expected,
        })
    }
}

/// `out = Σ inputs[i][range]`, summed in member order (every backend sums in this order, so
/// results are bitwise equal across backends).
fn sum_in_order(inputs: &[RwLock<Vec<f32>>], range: std::ops::Range<usize>, out: &mut [f32]) {
    out.copy_from_slice(&read(&inputs[0])[range.clone()]);
    for x in &inputs[1..] {
        for (o, v) in out.iter_mut().zip(&read(x)[range.clone()]) {
            *o += v;
        }
    }
}

/// Reads a buffer, ignoring poisoning (a panicking rank fails the run anyway).
fn read(l: &RwLock<Vec<f32>>) -> RwLockReadGuard<'_, Vec<f32>> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

/// Writes a buffer, ignoring poisoning.
fn write(l: &RwLock<Vec<f32>>) -> RwLockWriteGuard<'_, Vec<f32>> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Records the first failure and tells every rank to stop.
    pub fn fail(&self, rank: usize, reason: String) {
        if let Ok(mut f) = self.failure.lock() {
            if f.is_none() {
                *f = Some((rank, reason));
            }
        }
        self.aborted.store(true, Ordering::SeqCst);
    }

    /// The first failure recorded, if any.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.failure.lock().ok().and_then(|f| f.clone())
    }

    /// Follows the chain of waiting ranks from `start` to the first one that is not blocked
    /// in a receive: the one holding everybody up.
    fn culprit(&self, start: usize) -> usize {
        let mut r = start;
        for _ in 0..self.waiting_on.len() {
            let next = self.waiting_on[r].load(Ordering::SeqCst);
            if next == NOT_WAITING || next >= self.waiting_on.len() {
                return r;
            }
            r = next;
        }
        start
    }
}

/// One rank's endpoint of the threads backend.
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    peers: Vec<Sender<Msg>>,
    rx: Receiver<Msg>,
    pending: HashMap<(usize, u64), VecDeque<Vec<f32>>>,
    seq: HashMap<u32, u64>,
    /// This rank's handles on the shared buffers of its groups, by group id.
    groups: HashMap<u32, (Vec<usize>, Arc<GroupBuffers>)>,
    shared: Arc<Shared>,
    timeout: Duration,
}

/// Ranks of every live [`ThreadComm`] in this process (concurrent runs, as tests make, share
/// the cores).
static LIVE_RANKS: AtomicUsize = AtomicUsize::new(0);

impl Drop for ThreadComm {
    fn drop(&mut self) {
        LIVE_RANKS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long a receive polls for its message before it sleeps, where every rank has a core.
const SPIN: Duration = Duration::from_micros(500);

/// Yields of a rank waiting at a group barrier before it sleeps on the condition variable.
const BARRIER_SPINS: u32 = 200;

/// How often a blocked receive wakes up to check for failed peers.
const POLL: Duration = Duration::from_millis(20);

impl ThreadComm {
    /// Endpoints for `world` ranks with a receive `timeout`, and their shared failure state.
    pub fn create(world: usize, timeout: Duration) -> (Vec<ThreadComm>, Arc<Shared>) {
        let shared = Arc::new(Shared {
            aborted: AtomicBool::new(false),
            failure: Mutex::new(None),
            waiting_on: (0..world).map(|_| AtomicUsize::new(NOT_WAITING)).collect(),
            groups: Mutex::new(HashMap::new()),
        });
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..world).map(|_| channel()).unzip();
        LIVE_RANKS.fetch_add(world, Ordering::SeqCst);
        let comms = rxs
            .into_iter()
            .enumerate()
            .map(|(rank, rx)| ThreadComm {
                rank,
                peers: txs.clone(),
                rx,
                pending: HashMap::new(),
                seq: HashMap::new(),
                groups: HashMap::new(),
                shared: shared.clone(),
                timeout,
            })
            .collect();
        (comms, shared)
    }

    /// The shared buffers of `g`, this rank's index in it, and which buffer set the next
    /// collective on it uses.
    fn group_buffers(&mut self, g: &Group) -> Result<(Arc<GroupBuffers>, usize, usize), CommError> {
        let me = g.index_of(self.rank)?;
        let parity = (self.next_tag(g) & 1) as usize;
        if let Some((members, b)) = self.groups.get(&g.id()) {
            if members == g.ranks() {
                return Ok((b.clone(), me, parity));
            }
        }
        let b = self
            .shared
            .groups
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(g.ranks().to_vec())
            .or_insert_with(|| Arc::new(GroupBuffers::new(g.size())))
            .clone();
        self.groups.insert(g.id(), (g.ranks().to_vec(), b.clone()));
        Ok((b, me, parity))
    }

    /// Copies this member's `data` into the group's shared buffers and waits for every member
    /// to do the same; returns the buffers, this member's index and the buffer parity.
    fn publish(
        &mut self,
        g: &Group,
        data: &[f32],
        what: &'static str,
    ) -> Result<(Arc<GroupBuffers>, usize, usize), CommError> {
        let (b, me, p) = self.group_buffers(g)?;
        {
            let mut mine = write(&b.inputs[p][me]);
            mine.clear();
            mine.extend_from_slice(data);
        }
        self.arrive(g, &b, me, what)?;
        Self::same_lengths(&b.inputs[p], data.len(), what)?;
        Ok((b, me, p))
    }

    /// Waits until every member of `g` has arrived, or fails after the timeout naming the
    /// rank holding things up (the first missing member, or whom it is waiting for).
    fn arrive(&self, g: &Group, b: &GroupBuffers, me: usize, what: &str) -> Result<(), CommError> {
        let start = Instant::now();
        let mut st = b.state.lock().unwrap_or_else(PoisonError::into_inner);
        let gen = st.generation;
        st.arrived[me] = gen + 1;
        st.count += 1;
        if st.count == g.size() {
            st.count = 0;
            st.generation += 1;
            b.generation.store(st.generation, Ordering::Release);
            b.cv.notify_all();
            return Ok(());
        }
        // Most barriers complete within microseconds: yield for a moment before sleeping on
        // the condition variable, whose wake-up costs tens of microseconds.
        drop(st);
        for _ in 0..BARRIER_SPINS {
            if b.generation.load(Ordering::Acquire) != gen {
                return Ok(());
            }
            std::thread::yield_now();
        }
        let mut st = b.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.generation != gen {
            return Ok(());
        }
        let result = loop {
            let missing = st.arrived.iter().position(|a| *a <= gen).unwrap_or(me);
            let missing_rank = g.ranks()[missing];
            self.shared.waiting_on[self.rank].store(missing_rank, Ordering::SeqCst);
            if let Some(e) = self.peer_failure() {
                break Err(e);
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                break Err(CommError::Timeout {
                    rank: self.rank,
                    culprit: self.shared.culprit(missing_rank),
                    what: format!("{what} (waiting for rank {missing_rank})"),
                    secs: waited.as_secs_f64(),
                });
            }
            st =
                b.cv.wait_timeout(st, POLL.min(self.timeout - waited))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            if st.generation != gen {
                break Ok(());
            }
        };
        self.shared.waiting_on[self.rank].store(NOT_WAITING, Ordering::SeqCst);
        result
    }

    /// Checks every member contributed `len` values.
    fn same_lengths(
        inputs: &[RwLock<Vec<f32>>],
        len: usize,
        what: &'static str,
    ) -> Result<(), CommError> {
        match inputs.iter().map(|x| read(x).len()).find(|l| *l != len) {
            Some(got) => Err(CommError::Size {
                what,
                got,
                expected: len,
            }),
            None => Ok(()),
        }
    }

    fn peer_failure(&self) -> Option<CommError> {
        if !self.shared.aborted.load(Ordering::SeqCst) {
            return None;
        }
        let (peer, reason) = self
            .shared
            .failure()
            .unwrap_or((self.rank, "aborted".into()));
        Some(CommError::PeerFailed { peer, reason })
    }
}

impl ThreadComm {
    /// A message that arrives within [`SPIN`], polled without sleeping, where every rank of the
    /// process has a core of its own: a parked thread wakes tens of microseconds after the
    /// message that wakes it (a futex wake and a schedule), on every pipeline hand-off (10 % of
    /// resnet-tiny's step under dp2 and pp2 on two cores). With more ranks than cores the
    /// spinning would take the core from the rank that is to send: `None` at once.
    fn spin_for_message(&mut self) -> Option<Msg> {
        static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let cores =
            *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if LIVE_RANKS.load(Ordering::Relaxed) > cores {
            return None;
        }
        let start = Instant::now();
        while start.elapsed() < SPIN {
            match self.rx.try_recv() {
                Ok(m) => return Some(m),
                Err(_) => std::hint::spin_loop(),
            }
        }
        None
    }
}

impl Collectives for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.peers.len()
    }

    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CommError> {
        self.send_owned(to, tag, data.to_vec())
    }

    fn recv(
        &mut self,
        from: usize,
        tag: u64,
        out: &mut [f32],
        what: &str,
    ) -> Result<(), CommError> {
        let data = self.recv_owned(from, tag, out.len(), what)?;
        out.copy_from_slice(&data);
        Ok(())
    }

    fn send_owned(&mut self, to: usize, tag: u64, data: Vec<f32>) -> Result<(), CommError> {
        let tx = self
            .peers
            .get(to)
            .ok_or(CommError::Disconnected { peer: to })?;
        tx.send(Msg {
            from: self.rank,
            tag,
            data,
        })
        .map_err(|_| CommError::Disconnected { peer: to })
    }

    fn recv_owned(
        &mut self,
        from: usize,
        tag: u64,
        len: usize,
        what: &str,
    ) -> Result<Vec<f32>, CommError> {
        let start = Instant::now();
        let result = loop {
            if let Some(q) = self.pending.get_mut(&(from, tag)) {
                if let Some(data) = q.pop_front() {
                    if q.is_empty() {
                        self.pending.remove(&(from, tag));
                    }
                    break if data.len() == len {
                        Ok(data)
                    } else {
                        Err(CommError::Size {
                            what: "recv",
                            got: data.len(),
                            expected: len,
                        })
                    };
                }
            }
            if let Some(e) = self.peer_failure() {
                break Err(e);
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                let culprit = self.shared.culprit(from);
                break Err(CommError::Timeout {
                    rank: self.rank,
                    culprit,
                    what: format!("{what} (receiving from rank {from})"),
                    secs: waited.as_secs_f64(),
                });
            }
            self.shared.waiting_on[self.rank].store(from, Ordering::SeqCst);
            if let Some(m) = self.spin_for_message() {
                self.pending
                    .entry((m.from, m.tag))
                    .or_default()
                    .push_back(m.data);
                continue;
            }
            match self.rx.recv_timeout(POLL.min(self.timeout - waited)) {
                Ok(m) => self
                    .pending
                    .entry((m.from, m.tag))
                    .or_default()
                    .push_back(m.data),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    break Err(CommError::Disconnected { peer: from });
                }
            }
        };
        self.shared.waiting_on[self.rank].store(NOT_WAITING, Ordering::SeqCst);
        result
    }

    fn next_tag(&mut self, group: &Group) -> u64 {
        collective_tag(&mut self.seq, group.id)
    }

    /// Shared-buffer all-reduce: every member copies its buffer in, sums its chunk of all
    /// contributions in group order (the order of the portable implementation, so results
    /// are bitwise the same on every backend), and copies the sums out. Two barriers.
    fn all_reduce_sum(&mut self, g: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        let n = g.size();
        if n == 1 {
            g.index_of(self.rank)?;
            return Ok(());
        }
        let (b, me, p) = self.publish(g, buf, "all_reduce")?;
        let chunk = buf.len().div_ceil(n);
        let range = (me * chunk).min(buf.len())..((me + 1) * chunk).min(buf.len());
        {
            let mut sum = write(&b.sums[p][me]);
            sum.clear();
            sum.resize(range.len(), 0.0);
            sum_in_order(&b.inputs[p], range, &mut sum);
        }
        self.arrive(g, &b, me, "all_reduce")?;
        for (i, sum) in b.sums[p].iter().enumerate() {
            let lo = (i * chunk).min(buf.len());
            let sum = read(sum);
            buf[lo..lo + sum.len()].copy_from_slice(&sum);
        }
        Ok(())
    }

    /// Shared-buffer reduce-scatter (sums in group order, one barrier).
    fn reduce_scatter_sum(
        &mut self,
        g: &Group,
        input: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let n = g.size();
        let c = out.len();
        expect_len("reduce_scatter", input.len(), c * n)?;
        if n == 1 {
            g.index_of(self.rank)?;
            out.copy_from_slice(input);
            return Ok(());
        }
        let (b, me, p) = self.publish(g, input, "reduce_scatter")?;
        sum_in_order(&b.inputs[p], me * c..(me + 1) * c, out);
        Ok(())
    }

    /// Shared-buffer all-gather (one barrier).
    fn all_gather(&mut self, g: &Group, input: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let n = g.size();
        let c = input.len();
        expect_len("all_gather", out.len(), c * n)?;
        if n == 1 {
            g.index_of(self.rank)?;
            out.copy_from_slice(input);
            return Ok(());
        }
        let (b, _, p) = self.publish(g, input, "all_gather")?;
        for (i, x) in b.inputs[p].iter().enumerate() {
            out[i * c..(i + 1) * c].copy_from_slice(&read(x));
        }
        Ok(())
    }

    fn check_peers(&mut self) -> Result<(), CommError> {
        match self.peer_failure() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_threads<T: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(&mut ThreadComm) -> Result<T, CommError> + Sync,
    ) -> Vec<Result<T, CommError>> {
        let (comms, shared) = ThreadComm::create(world, timeout);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    let (f, shared) = (&f, shared.clone());
                    s.spawn(move || {
                        let r = f(&mut c);
                        if let Err(e) = &r {
                            shared.fail(c.rank(), e.to_string());
                        }
                        r
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_agree_bitwise_and_are_correct() {
        let out = on_threads(4, Duration::from_secs(20), |c| {
            let r = c.rank() as f32;
            let world = Group::new(vec![0, 1, 2, 3]);
            let pair = Group::new(if c.rank() < 2 { vec![0, 1] } else { vec![2, 3] });
            let mut a: Vec<f32> = (0..7).map(|i| 0.1 * i as f32 + r).collect();
            c.all_reduce_sum(&world, &mut a)?;
            let mut g = vec![0.0; 4];
            c.all_gather(&pair, &[r, r * 10.0], &mut g)?;
            let mut rs = vec![0.0; 2];
            c.reduce_scatter_sum(&pair, &[1.0, 2.0, r, r], &mut rs)?;
            let mut b = vec![r; 3];
            c.broadcast(&world, 2, &mut b)?;
            c.barrier(&world)?;
            // Point to point, out of order tags.
            let peer = c.rank() ^ 1;
            c.send(peer, 5, &[r])?;
            c.send(peer, 6, &[r + 100.0])?;
            let mut x = [0.0];
            c.recv(peer, 6, &mut x, "test")?;
            let mut y = [0.0];
            c.recv(peer, 5, &mut y, "test")?;
            Ok((a, g, rs, b, x[0], y[0]))
        });
        let vals: Vec<_> = out.into_iter().map(Result::unwrap).collect();
        for (i, (a, g, rs, b, x, y)) in vals.iter().enumerate() {
            assert_eq!(a, &vals[0].0, "bitwise identical all-reduce");
            assert!((a[3] - (0.3 * 4.0 + 6.0)).abs() < 1e-5);
            let base = (i / 2 * 2) as f32;
            assert_eq!(g, &vec![base, base * 10.0, base + 1.0, (base + 1.0) * 10.0]);
            let s = 2.0 * base + 1.0;
            assert_eq!(
                rs,
                &if i % 2 == 0 {
                    vec![2.0, 4.0]
                } else {
                    vec![s, s]
                }
            );
            assert_eq!(b, &vec![2.0; 3]);
            assert_eq!(*y, (i ^ 1) as f32);
            assert_eq!(*x, (i ^ 1) as f32 + 100.0);
        }
    }

    /// The threads backend with only its point-to-point part: the trait's portable
    /// collectives, which the MPI backend uses.
    #[derive(Debug)]
    struct Portable(ThreadComm);

    impl Collectives for Portable {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world(&self) -> usize {
            self.0.world()
        }
        fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CommError> {
            self.0.send(to, tag, data)
        }
        fn recv(&mut self, f: usize, t: u64, o: &mut [f32], w: &str) -> Result<(), CommError> {
            self.0.recv(f, t, o, w)
        }
        fn next_tag(&mut self, group: &Group) -> u64 {
            self.0.next_tag(group)
        }
    }

    #[test]
    fn shared_buffer_collectives_equal_the_portable_ones_bitwise() {
        let out = on_threads(3, Duration::from_secs(20), |c| {
            let world = Group::new(vec![0, 1, 2]);
            let r = c.rank() as f32;
            // Odd lengths: uneven all-reduce chunks, one of them empty for 2 elements.
            let data = |len: usize| -> Vec<f32> {
                (0..len)
                    .map(|i| ((i as f32 + 1.0) * 0.37 + r).sin() * 1e3)
                    .collect()
            };
            let mut fast = Vec::new();
            let mut slow = Vec::new();
            let mut p = Portable(ThreadComm::create(1, Duration::from_secs(1)).0.remove(0));
            std::mem::swap(&mut p.0, c);
            for len in [2usize, 7, 1000] {
                let mut a = data(len);
                p.all_reduce_sum(&world, &mut a)?;
                let mut rs = vec![0.0; len];
                p.reduce_scatter_sum(&world, &data(3 * len), &mut rs)?;
                let mut ag = vec![0.0; 3 * len];
                p.all_gather(&world, &data(len), &mut ag)?;
                slow.push((a, rs, ag));
            }
            std::mem::swap(&mut p.0, c);
            for len in [2usize, 7, 1000] {
                let mut a = data(len);
                c.all_reduce_sum(&world, &mut a)?;
                let mut rs = vec![0.0; len];
                c.reduce_scatter_sum(&world, &data(3 * len), &mut rs)?;
                let mut ag = vec![0.0; 3 * len];
                c.all_gather(&world, &data(len), &mut ag)?;
                fast.push((a, rs, ag));
            }
            Ok((fast, slow))
        });
        for r in out {
            let (fast, slow) = r.unwrap();
            assert_eq!(fast, slow);
        }
    }

    /// All-reduce bus bandwidth of the threads backend (`cargo test --release -p
    /// parallax-executor -- --ignored all_reduce_bandwidth --nocapture`).
    #[test]
    #[ignore]
    fn all_reduce_bandwidth() {
        for (n, len) in [(2usize, 1usize << 22), (4, 1 << 22), (4, 1)] {
            let reps = if len == 1 { 2000 } else { 10 };
            let out = on_threads(n, Duration::from_secs(60), |c| {
                let g = Group::new((0..c.world()).collect());
                let mut buf = vec![1.0f32; len];
                c.all_reduce_sum(&g, &mut buf)?;
                c.barrier(&g)?;
                let t0 = Instant::now();
                for _ in 0..reps {
                    c.all_reduce_sum(&g, &mut buf)?;
                }
                Ok(t0.elapsed().as_secs_f64() / f64::from(reps))
            });
            let t = out.into_iter().map(Result::unwrap).fold(0.0f64, f64::max);
            let busbw = 2.0 * (n as f64 - 1.0) / n as f64 * (len * 4) as f64 / t;
            eprintln!(
                "all-reduce {n} threads, {} floats: {:.1} us, busbw {:.2} GB/s",
                len,
                t * 1e6,
                busbw / 1e9
            );
        }
    }

    #[test]
    fn a_stalled_rank_is_named_within_the_timeout() {
        let t0 = Instant::now();
        let out = on_threads(3, Duration::from_millis(300), |c| {
            let world = Group::new(vec![0, 1, 2]);
            if c.rank() == 2 {
                // Stalls: never joins the collective, waits until the others give up.
                while c.check_peers().is_ok() && t0.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                return Ok(());
            }
            let mut x = [1.0];
            c.all_reduce_sum(&world, &mut x)
        });
        assert!(t0.elapsed() < Duration::from_secs(5));
        let msg = out[0].as_ref().unwrap_err().to_string();
        assert!(msg.contains("rank 2"), "{msg}");
    }
}
