//! Calibration micro-benchmarks: GEMM throughput over sizes, memory bandwidth, the bandwidth of
//! the executor's own streaming kernels by size, exponential and tangent rates, per-op overhead,
//! the general-graph trainer's op classes as a training run of a calibration graph times them,
//! and collective bandwidth and latency across ranks — turned into a `cpu-local`-schema profile
//! (`parallax calibrate --backend threads|mpi --out PROFILE.toml`).
//!
//! Every compute benchmark runs on all ranks at once, as a training run loads every core: the
//! numbers are what one core achieves while the others work too. The collectives are timed
//! through the [`Collectives`] interface of the backend being calibrated (threads here, MPI in
//! `mpi_backend`), inside one node and, when the ranks span several nodes, across them.

use crate::comm::{Collectives, Group, ThreadComm};
use crate::engine::AdamConfig;
use crate::error::ExecError;
use crate::tensor::{add_into, mm, mm_nt, mm_tn, norm_fwd, sigmoid};
use parallax_cost::DeviceModel;
use parallax_hardware::{
    Calibration as Provenance, ClusterProfile, EfficiencyCurve, HostKernels, KernelRates,
};
use parallax_ir::{Graph, OpKind, Precision};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CalibrateOptions {
    /// Ranks (one per core); at least 2 are used for collectives.
    pub threads: usize,
    /// Smaller sizes and shorter repetitions (a few seconds instead of about a minute).
    pub quick: bool,
}

/// Measured figures, per core.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurements {
    /// The backend measured (`threads` or `mpi`).
    pub backend: &'static str,
    /// Ranks per node measured at once (one per core, or per GPU).
    pub threads: usize,
    /// GEMM curve, copy and pointwise bandwidth, per-op overhead of one rank.
    pub compute: ComputeFigures,
    /// All-reduce across the ranks of one node; `None` when a node has one rank (one GPU, or
    /// one MPI process per node): nothing inside the node was measured.
    pub intra: Option<CollectiveFit>,
    /// Across nodes, when the ranks span several.
    pub inter: Option<InterNode>,
    /// The accelerator measured, when the ranks are GPUs (`cuda`); `None` for CPU cores.
    pub device: Option<MeasuredDevice>,
    /// The host side of offload: its CPUs' Adam step and, with GPUs, each one's link to host
    /// memory. `None` where it was not measured (MPI, one process per core).
    pub host: Option<HostFigures>,
    /// The node's NVMe, where a folder on it was given ([`measure_nvme`]).
    pub nvme: Option<NvmeFigures>,
}

/// A node's NVMe as ZeRO-Infinity's offload streams it.
#[derive(Clone, Debug, PartialEq)]
pub struct NvmeFigures {
    /// The folder measured.
    pub path: std::path::PathBuf,
    /// Sequential write bandwidth, bytes per second, flushed to the drives.
    pub write_bytes_per_s: f64,
    /// Sequential read bandwidth from the drives (not the page cache).
    pub read_bytes_per_s: f64,
    /// Space free there, bytes.
    pub free_bytes: f64,
}

/// Files written and read at once: ZeRO-Infinity's swapper keeps several requests in flight
/// (`aio.queue_depth`, `thread_count`), which a striped set of drives needs to reach its rate.
const NVME_STREAMS: usize = 4;

/// Measures the drive holding `dir`: `NVME_STREAMS` (4) files written at once in 8 MiB writes
/// and flushed (`fsync`), dropped from the page cache, read back at once, and removed — 512 MiB
/// in all (`quick`) or 4 GiB, at most a quarter of the free space. A folder in memory (tmpfs,
/// ramfs) is refused: it would time the host's DRAM.
pub fn measure_nvme(dir: &std::path::Path, quick: bool) -> Result<NvmeFigures, String> {
    #[cfg(target_os = "linux")]
    {
        nvme::measure(dir, quick)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (dir, quick);
        Err("measuring NVMe needs Linux (posix_fadvise to read past the page cache)".into())
    }
}

#[cfg(target_os = "linux")]
mod nvme {
    use super::{NvmeFigures, NVME_STREAMS};
    use std::io::{Read, Write};
    use std::path::{Path, PathBuf};
    use std::time::Instant;

    /// File systems whose files live in memory (`statfs` magic numbers, linux/magic.h).
    const IN_MEMORY: [(u64, &str); 2] = [(0x0102_1994, "tmpfs"), (0x8584_58f6, "ramfs")];

    const CHUNK: usize = 8 << 20;

    /// The probe files, removed however the measurement ends.
    struct Probes(Vec<PathBuf>);

    impl Drop for Probes {
        fn drop(&mut self) {
            for p in &self.0 {
                let _ = std::fs::remove_file(p);
            }
        }
    }

    /// Runs `f` on every probe at once; the seconds from the first start to the last end.
    fn at_once(
        probes: &[PathBuf],
        f: impl Fn(&Path) -> std::io::Result<()> + Sync,
    ) -> Result<f64, String> {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            let handles: Vec<_> = probes.iter().map(|p| s.spawn(|| f(p))).collect();
            for (h, p) in handles.into_iter().zip(probes) {
                h.join()
                    .map_err(|_| format!("{}: the I/O thread panicked", p.display()))?
                    .map_err(|e| format!("{}: {e}", p.display()))?;
            }
            Ok::<_, String>(())
        })?;
        Ok(t0.elapsed().as_secs_f64().max(1e-9))
    }

    pub(super) fn measure(dir: &Path, quick: bool) -> Result<NvmeFigures, String> {
        let fs = rustix::fs::statfs(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        if let Some((_, kind)) = IN_MEMORY.iter().find(|(m, _)| *m == fs.f_type as u64) {
            return Err(format!(
                "{} is on {kind}, in memory, not on a drive",
                dir.display()
            ));
        }
        let vfs = rustix::fs::statvfs(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let free = vfs.f_bavail.saturating_mul(vfs.f_frsize);
        let want: u64 = if quick { 512 << 20 } else { 4 << 30 };
        let per = (want.min(free / 4) / NVME_STREAMS as u64) / CHUNK as u64 * CHUNK as u64;
        if per == 0 {
            return Err(format!(
                "{}: {} MiB free, too little to measure",
                dir.display(),
                free >> 20
            ));
        }
        let names: Vec<PathBuf> = (0..NVME_STREAMS)
            .map(|i| dir.join(format!(".parallax-nvme-probe-{}-{i}", std::process::id())))
            .collect();
        // Only files this measurement creates are removed after it.
        if let Some(p) = names.iter().find(|p| p.exists()) {
            return Err(format!("{} exists already; it is left alone", p.display()));
        }
        let probes = Probes(names);
        let bytes = (per * NVME_STREAMS as u64) as f64;
        let write = at_once(&probes.0, |p| {
            // `create_new`: never overwrite a file of the user's.
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(p)?;
            let chunk: Vec<u8> = (0..CHUNK).map(|i| (i % 251) as u8).collect();
            for _ in 0..per / CHUNK as u64 {
                f.write_all(&chunk)?;
            }
            f.sync_all()?;
            // Clean now: the kernel may drop its pages, and the read comes from the drive.
            rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)?;
            Ok(())
        })?;
        let read = at_once(&probes.0, |p| {
            let mut f = std::fs::File::open(p)?;
            let mut chunk = vec![0u8; CHUNK];
            while f.read(&mut chunk)? > 0 {}
            Ok(())
        })?;
        Ok(NvmeFigures {
            path: dir.to_path_buf(),
            write_bytes_per_s: bytes / write,
            read_bytes_per_s: bytes / read,
            free_bytes: free as f64,
        })
    }
}

/// What an offloaded optimizer step runs at on this machine's host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostFigures {
    /// Cores the host's Adam step ran on at once.
    pub cores: usize,
    /// Parameters per second it updated ([`host_adam_params_per_s`]).
    pub adam_params_per_s: f64,
    /// Copies between each GPU and pinned host memory, every GPU copying at once (the
    /// slowest GPU's); `None` for CPU cores.
    pub link: Option<HostLink>,
}

/// Copy rates between a GPU and pinned host memory, bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostLink {
    /// Host to device (an offloaded step's updated weights going up).
    pub h2d_bytes_per_s: f64,
    /// Device to host (its gradients going down).
    pub d2h_bytes_per_s: f64,
}

impl HostLink {
    /// The slower direction, which an offloaded step pays both ways.
    pub fn bytes_per_s(&self) -> f64 {
        self.h2d_bytes_per_s.min(self.d2h_bytes_per_s)
    }
}

/// Parameters of the host Adam benchmark in all (18 bytes each held: 150 MB quick, 1.2 GB
/// otherwise, beyond any last-level cache) and the steps timed.
fn host_adam_size(quick: bool) -> (usize, usize) {
    if quick {
        (1 << 23, 2)
    } else {
        (1 << 26, 5)
    }
}

/// One worker's share of the host Adam benchmark: fp32 weights, gradients and moments, and the
/// 16-bit copy of the weights.
struct AdamSlice {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    half: Vec<u16>,
}

impl AdamSlice {
    const BLOCK: usize = 4096;

    fn new(params: usize) -> AdamSlice {
        let n = params.max(Self::BLOCK);
        AdamSlice {
            p: vec![0.1; n],
            g: vec![0.01; n],
            m: vec![0.0; n],
            v: vec![0.0; n],
            half: vec![0; n],
        }
    }

    fn len(&self) -> usize {
        self.p.len()
    }

    /// One step over the slice, block by block, each block's 16-bit copy written as it is done.
    fn step(&mut self, cfg: &AdamConfig) {
        let b = Self::BLOCK;
        for ((((p, g), m), v), h) in self
            .p
            .chunks_mut(b)
            .zip(self.g.chunks(b))
            .zip(self.m.chunks_mut(b))
            .zip(self.v.chunks_mut(b))
            .zip(self.half.chunks_mut(b))
        {
            cfg.update((0.1, 0.05), p, g, m, v);
            // bf16 by truncation: the block is still in cache.
            for (h, x) in h.iter_mut().zip(p.iter()) {
                *h = (x.to_bits() >> 16) as u16;
            }
        }
        std::hint::black_box(&self.half);
    }
}

/// Parameters per second an offloaded optimizer step updates on `cores` host cores at once:
/// the trainer's Adam over fp32 weights, gradients and moments far larger than the caches, each
/// cache-sized block's 16-bit copy written as it is done (what ZeRO-Offload's
/// `DeepSpeedCPUAdam` does for the weights it sends back to the device: 30 bytes of DRAM
/// traffic a parameter). The cores share the host's memory bandwidth, as the devices of a node
/// stepping at once do.
pub fn host_adam_params_per_s(cores: usize, quick: bool) -> f64 {
    let cores = cores.max(1);
    let (total, iters) = host_adam_size(quick);
    let cfg = AdamConfig::default();
    let barrier = std::sync::Barrier::new(cores + 1);
    let mut per = 0;
    let start = std::thread::scope(|s| {
        let mut workers = Vec::with_capacity(cores);
        for _ in 0..cores {
            workers.push(s.spawn(|| {
                let mut slice = AdamSlice::new(total / cores);
                // First touch of every page, outside the timing.
                slice.step(&cfg);
                barrier.wait();
                for _ in 0..iters {
                    slice.step(&cfg);
                }
                slice.len()
            }));
        }
        barrier.wait();
        let start = Instant::now();
        per = workers.into_iter().map(|w| w.join().unwrap_or(0)).sum();
        start
    });
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    (per * iters) as f64 / secs
}

/// Parameters per second this process's share of the host Adam benchmark updates while the
/// other `ranks - 1` processes of its node run theirs (call it on every rank of the node at
/// once, after a barrier): under MPI each rank holds one core, and a node's offloaded step runs
/// on all of them. The node's rate is `ranks` times the slowest rank's.
pub fn host_adam_rank_params_per_s(ranks: usize, quick: bool) -> f64 {
    let (total, iters) = host_adam_size(quick);
    let cfg = AdamConfig::default();
    let mut slice = AdamSlice::new(total / ranks.max(1));
    slice.step(&cfg);
    let start = Instant::now();
    for _ in 0..iters {
        slice.step(&cfg);
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    (slice.len() * iters) as f64 / secs
}

/// The accelerator a calibration measured.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredDevice {
    /// Its name as the driver reports it.
    pub name: String,
    /// Its memory, GiB.
    pub mem_gib: f64,
    /// Its streaming multiprocessors, where the driver says.
    pub sm_count: Option<u32>,
}

/// Collective figures fitted to all-reduce times.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CollectiveFit {
    /// Achieved bus bandwidth of large all-reduces, bytes per second.
    pub busbw_bytes_per_s: f64,
    /// Latency of one collective algorithm step, seconds.
    pub step_latency_s: f64,
}

/// Collective figures across nodes (one rank per node).
#[derive(Clone, Debug, PartialEq)]
pub struct InterNode {
    /// Nodes in the job.
    pub nodes: usize,
    /// All-reduce across the nodes.
    pub fit: CollectiveFit,
}

/// The compute figures of one rank while every rank runs the same benchmarks.
#[derive(Clone, Debug, PartialEq)]
pub struct ComputeFigures {
    /// `(FLOPs of one GEMM, achieved FLOP/s)` over training-shaped GEMMs (forward, input- and
    /// weight-gradient forms), by increasing FLOPs.
    pub matmul: Vec<(f64, f64)>,
    /// The same of fp16 tensor-core GEMMs (GPUs: cublasGemmEx, fp32 accumulation), the rate
    /// training's 16-bit GEMMs run at; empty on host cores.
    pub tensor_matmul: Vec<(f64, f64)>,
    /// Copy bandwidth (bytes read + written per second).
    pub copy_bytes_per_s: f64,
    /// Bandwidth of the executor's pointwise kernels (norm, residual add, Adam) on tensors
    /// far larger than the caches.
    pub pointwise_bytes_per_s: f64,
    /// The same by the bytes one kernel touches, `(bytes, bytes per second)` by increasing
    /// size (host cores: the caches serve small tensors faster); empty for GPUs.
    pub pointwise_curve: Vec<(f64, f64)>,
    /// Fixed cost of one small op, seconds.
    pub op_overhead_s: f64,
    /// Exponentials (exp, a sigmoid) the executor's elementwise kernels evaluate per second,
    /// cache-resident; `None` where the ranks are GPUs.
    pub transcendentals_per_s: Option<f64>,
    /// Hyperbolic tangents per second, likewise.
    pub tanh_per_s: Option<f64>,
    /// Forward and backward seconds of the general-graph trainer's kernel of each case of
    /// `graph_kernel_cases` (host cores; empty for GPUs).
    pub graph_kernels: Vec<(f64, f64)>,
    /// The same of the transformer trainer's kernels, each case of
    /// `transformer_kernel_cases`.
    pub transformer_kernels: Vec<(f64, f64)>,
    /// The general-graph trainer's fixed cost of one op call, seconds: the median call of the
    /// calibration graphs' view ops (0 for GPUs).
    pub graph_call_s: f64,
}

impl ComputeFigures {
    /// The figures as one flat vector (for averaging over ranks with a collective): each
    /// curve's length, then its points, then the scalars.
    pub fn to_vec(&self) -> Vec<f64> {
        let mut v = Vec::new();
        for curve in [
            &self.matmul,
            &self.pointwise_curve,
            &self.graph_kernels,
            &self.transformer_kernels,
            &self.tensor_matmul,
        ] {
            v.push(curve.len() as f64);
            v.extend(curve.iter().flat_map(|(f, r)| [*f, *r]));
        }
        v.extend([
            self.copy_bytes_per_s,
            self.pointwise_bytes_per_s,
            self.op_overhead_s,
            self.transcendentals_per_s.unwrap_or(0.0),
            self.tanh_per_s.unwrap_or(0.0),
            self.graph_call_s,
        ]);
        v
    }

    /// The inverse of [`ComputeFigures::to_vec`].
    pub fn from_vec(v: &[f64]) -> ComputeFigures {
        let mut at = 0;
        let mut curve = || {
            let n = v.get(at).map_or(0, |n| *n as usize);
            let points = v.get(at + 1..at + 1 + 2 * n).unwrap_or(&[]);
            at += 1 + 2 * n;
            points
                .chunks_exact(2)
                .map(|p| (p[0], p[1]))
                .collect::<Vec<_>>()
        };
        let (matmul, pointwise_curve, graph_kernels, transformer_kernels, tensor_matmul) =
            (curve(), curve(), curve(), curve(), curve());
        let rest = v.get(at..).unwrap_or(&[]);
        let positive = |i: usize| rest.get(i).copied().filter(|r| *r > 0.0);
        ComputeFigures {
            matmul,
            tensor_matmul,
            pointwise_curve,
            copy_bytes_per_s: rest.first().copied().unwrap_or(0.0),
            pointwise_bytes_per_s: rest.get(1).copied().unwrap_or(0.0),
            op_overhead_s: rest.get(2).copied().unwrap_or(0.0),
            transcendentals_per_s: positive(3),
            tanh_per_s: positive(4),
            graph_kernels,
            transformer_kernels,
            graph_call_s: rest.get(5).copied().unwrap_or(0.0),
        }
    }
}

fn time_best(min_time: Duration, mut f: impl FnMut()) -> f64 {
    // Repeat until min_time has passed, keep the best of three such rounds.
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        let mut n = 0u64;
        while t0.elapsed() < min_time || n == 0 {
            f();
            n += 1;
        }
        best = best.min(t0.elapsed().as_secs_f64() / n as f64);
    }
    best
}

/// Runs `f` on `threads` threads at once and returns the mean of their results.
fn concurrently(threads: usize, f: impl Fn() -> f64 + Sync) -> f64 {
    let results: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads).map(|_| s.spawn(&f)).collect();
        hs.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    results.iter().sum::<f64>() / results.len().max(1) as f64
}

/// Times all-reduces with `time` on a thread per item, all at once, and keeps the slowest
/// figures; a thread that panics gives `panicked()`.
pub(crate) fn slowest_of<T: Send>(
    items: Vec<T>,
    time: impl Fn(T) -> Result<AllReduceTimes, ExecError> + Sync,
    panicked: impl Fn() -> ExecError,
) -> Result<AllReduceTimes, ExecError> {
    let time = &time;
    let results: Vec<Result<AllReduceTimes, ExecError>> = std::thread::scope(|s| {
        let hs: Vec<_> = items
            .into_iter()
            .map(|item| s.spawn(move || time(item)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(panicked())))
            .collect()
    });
    let mut slowest = AllReduceTimes::default();
    for r in results {
        slowest = slowest.max(&r?);
    }
    Ok(slowest)
}

/// Which operand a training GEMM reads transposed: forward `x·W`, input gradient `dy·Wᵀ`,
/// weight gradient `xᵀ·dy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKind {
    /// `x · W`.
    Forward,
    /// `dy · Wᵀ`.
    InputGrad,
    /// `xᵀ · dy`.
    WeightGrad,
}

/// Achieved FLOP/s of one `m × k · k × n` fp32 GEMM of `kind` on the calling thread.
pub fn gemm_flops(m: usize, k: usize, n: usize, kind: GemmKind, min_time: Duration) -> f64 {
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut c = vec![0.0f32; m * n];
    // The trainer's own GEMM calls, so calibration times what training runs.
    let t = time_best(min_time, || {
        match kind {
            GemmKind::Forward => mm(&mut c, &a, &b, m, k, n, false),
            GemmKind::InputGrad => mm_nt(&mut c, &a, &b, m, n, k, false),
            GemmKind::WeightGrad => mm_tn(&mut c, &a, &b, k, m, n, true),
        }
        std::hint::black_box(&mut c);
    });
    2.0 * (m * k * n) as f64 / t
}

/// Training-shaped GEMMs `(rows, k, n)`: a hidden size `h` against `h` and `4h` projections at
/// a number of tokens (down to a context-parallel rank's 64: a 64-row GEMM runs at 70 GFLOP/s
/// where one of 128 rows and the same FLOPs runs at 90 on an EPYC core), and per-head attention
/// products (`s × d · d × s`). Each is timed in its forward, input-gradient and weight-gradient
/// form.
fn training_shapes(quick: bool) -> Vec<(usize, usize, usize)> {
    let mut v = Vec::new();
    let hs: &[usize] = if quick {
        &[32, 128]
    } else {
        &[32, 64, 128, 256, 512]
    };
    let toks: &[usize] = if quick { &[256] } else { &[64, 128, 512, 2048] };
    for &h in hs {
        for &t in toks {
            v.push((t, h, h));
            v.push((t, h, 4 * h));
        }
    }
    // The small GEMMs host kernels call one at a time: a convolution's per sample (output
    // channels × channels·window × pixels), a recurrent layer's per step (batch × hidden ×
    // gates), down to tens of kFLOP.
    if !quick {
        for &rows in &[8, 32] {
            for &(k, n) in &[(32, 128), (96, 256)] {
                v.push((rows, k, n));
            }
        }
        v.push((16, 16, 64));
    }
    for &s in if quick {
        &[64usize][..]
    } else {
        &[64, 128, 256][..]
    } {
        v.push((s, 64, s));
        v.push((s, s, 64));
    }
    v
}

/// Time-weighted mean rate of points with nearly equal FLOPs, at their mean FLOPs.
fn merge(g: &[(f64, f64)]) -> (f64, f64) {
    let flops: f64 = g.iter().map(|p| p.0).sum();
    let time: f64 = g.iter().map(|p| p.0 / p.1).sum();
    (flops / g.len() as f64, flops / time)
}

/// Calibrates with `backend`: the threads backend in this process, the MPI backend with every
/// process of the `mpirun` job (MPI is initialised and finalised here). Returns the figures
/// on the rank that should write the profile (always for threads; rank 0 for MPI) and `None`
/// on the others.
pub fn calibrate(
    backend: crate::Backend,
    opts: CalibrateOptions,
) -> Result<Option<Measurements>, ExecError> {
    match backend {
        crate::Backend::Threads => measure(opts).map(Some),
        #[cfg(feature = "mpi")]
        crate::Backend::Mpi => crate::mpi_backend::MpiRuntime::init()?.calibrate(opts.quick),
        #[cfg(not(feature = "mpi"))]
        crate::Backend::Mpi => Err(ExecError::NotCompiled {
            backend: "mpi",
            feature: "mpi",
        }),
        #[cfg(feature = "cuda")]
        crate::Backend::Cuda => crate::cuda_backend::calibrate(opts.quick).map(Some),
        #[cfg(not(feature = "cuda"))]
        crate::Backend::Cuda => Err(ExecError::NotCompiled {
            backend: "cuda",
            feature: "cuda,nccl",
        }),
    }
}

/// Measures this machine with the threads backend: compute on `opts.threads` cores at once,
/// collectives over as many threads (at least 2).
pub fn measure(opts: CalibrateOptions) -> Result<Measurements, ExecError> {
    let threads = opts.threads.max(1);
    let compute = measure_compute(threads, opts.quick);
    let n = threads.max(2);
    let (comms, _) = ThreadComm::create(n, Duration::from_secs(60));
    let slowest = slowest_of(
        comms,
        |mut comm| {
            let g = Group::new((0..comm.world()).collect());
            time_all_reduce(&mut comm, &g, opts.quick)
        },
        || ExecError::Rank {
            rank: 0,
            message: "calibration thread panicked".into(),
        },
    )?;
    Ok(Measurements {
        backend: "threads",
        threads,
        compute,
        intra: Some(slowest.fit(n)),
        inter: None,
        device: None,
        host: Some(HostFigures {
            cores: threads,
            adam_params_per_s: host_adam_params_per_s(threads, opts.quick),
            link: None,
        }),
        nvme: None,
    })
}

/// The compute benchmarks on the calling rank, run on `threads` threads at once (1 under MPI,
/// where the other processes load the other cores).
pub fn measure_compute(threads: usize, quick: bool) -> ComputeFigures {
    let threads = threads.max(1);
    let min_time = Duration::from_millis(if quick { 30 } else { 250 });
    // (FLOPs, FLOP/s) of every shape and form, then merged into a curve by FLOPs.
    let mut points: Vec<(f64, f64)> = Vec::new();
    for (m, k, n) in training_shapes(quick) {
        let flops = 2.0 * (m * k * n) as f64;
        let mut time = 0.0;
        for kind in [GemmKind::Forward, GemmKind::InputGrad, GemmKind::WeightGrad] {
            time += flops / concurrently(threads, || gemm_flops(m, k, n, kind, min_time));
        }
        points.push((flops, 3.0 * flops / time));
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut curve: Vec<(f64, f64)> = Vec::new();
    let mut group: Vec<(f64, f64)> = Vec::new();
    for p in points {
        // Shapes within 10 % of each other's FLOPs share a point (time-weighted mean rate).
        if group.first().is_some_and(|g| p.0 > g.0 * 1.1) {
            curve.push(merge(&group));
            group.clear();
        }
        group.push(p);
    }
    if !group.is_empty() {
        curve.push(merge(&group));
    }
    let elems = if quick { 1 << 21 } else { 1 << 23 };
    let copy = concurrently(threads, || {
        let src = vec![1.0f32; elems];
        let mut dst = vec![0.0f32; elems];
        let t = time_best(min_time, || {
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
        });
        (elems * 8) as f64 / t
    });
    // The executor's bandwidth-bound kernels without transcendentals (their exponentials and
    // tangents are timed below and priced apart): a LayerNorm (read + write), a residual add
    // (two reads, one write) and an Adam update (parameters, gradients and two moments read,
    // three written), counted in the bytes the cost model charges for them; from tensors the
    // caches hold to tensors far beyond them, keyed by the bytes of the mean kernel.
    let mix = |elems: usize| {
        concurrently(threads, || {
            const ROW: usize = 256;
            let x: Vec<f32> = (0..elems).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
            let mut y = vec![0.0f32; elems];
            let (w, b) = (vec![1.0f32; ROW], vec![0.0f32; ROW]);
            let (mut p, mut m, mut v) = (x.clone(), vec![0.0f32; elems], vec![0.0f32; elems]);
            let t = time_best(min_time, || {
                norm_fwd(&mut y, &x, &w, Some(&b), false);
                add_into(&mut y, &x);
                AdamConfig::default().update((0.1, 0.05), &mut p, &y, &mut m, &mut v);
                std::hint::black_box((&mut y, &mut p, &mut m, &mut v));
            });
            (elems * MIX_BYTES) as f64 / t
        })
    };
    let sizes: &[usize] = if quick {
        &[1 << 12, 1 << 16, 1 << 21]
    } else {
        &[1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 23]
    };
    let pointwise_curve: Vec<(f64, f64)> = sizes
        .iter()
        .map(|&n| ((n * MIX_BYTES / 3) as f64, mix(n)))
        .collect();
    let pointwise = pointwise_curve.last().map_or(0.0, |p| p.1);
    let op_overhead = concurrently(threads, || {
        let (a, b) = (vec![1.0f32; 4], vec![1.0f32; 4]);
        let mut c = vec![0.0f32; 4];
        time_best(min_time, || {
            mm(&mut c, &a, &b, 2, 2, 2, false);
            std::hint::black_box(&mut c);
        })
    });
    // The executor's exponentials (sigmoids, a softmax's exp) and tangents on a cache-resident
    // buffer, apart: libm's tanhf takes several times an expf.
    let rate = |f: fn(f32) -> f32| {
        concurrently(threads, || {
            let x: Vec<f32> = (0..4000).map(|i| (i % 17) as f32 * 0.25 - 2.0).collect();
            let mut y = vec![0.0f32; x.len()];
            let t = time_best(min_time, || {
                for (o, v) in y.iter_mut().zip(&x) {
                    *o = f(*v);
                }
                std::hint::black_box(&mut y);
            });
            x.len() as f64 / t
        })
    };
    let exps = rate(|v| if v < 0.5 { sigmoid(v) } else { v.exp() });
    // The general-graph trainer's kernel of every op class, whole on one device.
    let (graph_kernels, graph_call_s) = measure_graph_kernels(threads, quick);
    let kernel_time = Duration::from_millis(if quick { 2 } else { 40 });
    let transformer_kernels = transformer_kernel_cases(quick)
        .iter()
        .map(|c| {
            let t: Vec<(f64, f64)> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads)
                    .map(|_| s.spawn(|| time_transformer_case(c, kernel_time)))
                    .collect();
                hs.into_iter().filter_map(|h| h.join().ok()).collect()
            });
            let n = t.len().max(1) as f64;
            t.iter()
                .fold((0.0, 0.0), |a, t| (a.0 + t.0 / n, a.1 + t.1 / n))
        })
        .collect();
    let tanh = rate(f32::tanh);
    ComputeFigures {
        matmul: curve,
        tensor_matmul: Vec::new(),
        copy_bytes_per_s: copy,
        pointwise_bytes_per_s: pointwise,
        pointwise_curve,
        op_overhead_s: op_overhead,
        transcendentals_per_s: Some(exps),
        tanh_per_s: Some(tanh),
        graph_call_s,
        graph_kernels,
        transformer_kernels,
    }
}

/// Times of one small and one large all-reduce on a rank, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AllReduceTimes {
    /// One all-reduce of a single value (latency-bound).
    pub small_s: f64,
    /// One all-reduce of `large_bytes` (bandwidth-bound).
    pub large_s: f64,
    /// Bytes of the large all-reduce.
    pub large_bytes: f64,
}

impl AllReduceTimes {
    /// The slower of two ranks' times (a collective ends when its slowest member does).
    pub fn max(&self, o: &AllReduceTimes) -> AllReduceTimes {
        AllReduceTimes {
            small_s: self.small_s.max(o.small_s),
            large_s: self.large_s.max(o.large_s),
            large_bytes: self.large_bytes.max(o.large_bytes),
        }
    }

    /// Bus bandwidth (bytes/s) and per-step latency (s) over `n` ranks, fitted to the cost
    /// model's ring all-reduce `t = 2(n−1)/n · S / busbw + 2(n−1) · step`.
    pub fn fit(&self, n: usize) -> CollectiveFit {
        let nf = n.max(2) as f64;
        let steps = 2.0 * (nf - 1.0);
        let step = self.small_s / steps;
        let busbw =
            2.0 * (nf - 1.0) / nf * self.large_bytes / (self.large_s - steps * step).max(1e-9);
        CollectiveFit {
            busbw_bytes_per_s: busbw,
            step_latency_s: step,
        }
    }
}

/// Times small and large all-reduces over `g` through `comm` (every member of `g` calls this
/// at once; others must not).
pub fn time_all_reduce(
    comm: &mut dyn Collectives,
    g: &Group,
    quick: bool,
) -> Result<AllReduceTimes, ExecError> {
    let big = if quick { 1 << 20 } else { 1 << 23 };
    let reps_small = if quick { 200 } else { 2000 };
    let reps_big = if quick { 3 } else { 10 };
    let mut x = [1.0f32];
    comm.barrier(g)?;
    let t0 = Instant::now();
    for _ in 0..reps_small {
        comm.all_reduce_sum(g, &mut x)?;
    }
    let small_s = t0.elapsed().as_secs_f64() / f64::from(reps_small);
    let mut buf = vec![1.0f32; big];
    comm.all_reduce_sum(g, &mut buf)?;
    comm.barrier(g)?;
    let t0 = Instant::now();
    for _ in 0..reps_big {
        comm.all_reduce_sum(g, &mut buf)?;
    }
    let large_s = t0.elapsed().as_secs_f64() / f64::from(reps_big);
    Ok(AllReduceTimes {
        small_s,
        large_s,
        large_bytes: (big * 4) as f64,
    })
}

/// Bytes the pointwise mix charges per element: a norm's 8, an add's 12, Adam's 28.
const MIX_BYTES: usize = 8 + 12 + 28;

/// The rates of the general-graph trainer's kernels from their measured times on `p` (the
/// profile with this calibration's GEMM curve): per case, what is not the GEMM calls the cost
/// model prices on that curve (`DeviceModel::host_split`), as the class's bytes per second,
/// by size. `None` without measured kernels (GPUs).
fn host_kernel_rates(m: &ComputeFigures, p: &ClusterProfile) -> Option<HostKernels> {
    let n = m.graph_kernels.len();
    // The case list is fixed by the mode the kernels were measured in: its length says which.
    let cases = [false, true]
        .into_iter()
        .map(graph_kernel_cases)
        .find(|c| c.len() == n && n > 0)?;
    let model = DeviceModel::new(p, Precision::Fp32)
        .ok()?
        .with_host_graph_trainer(true);
    let mut table: BTreeMap<String, Vec<[f64; 3]>> = BTreeMap::new();
    for ((g, i), &(tf, tb)) in cases.iter().zip(&m.graph_kernels) {
        let node = &g.nodes[*i];
        let (ins, w) = (g.input_shapes(node), g.node_work(node, 4));
        let split = model.host_split(&node.op, &ins, &w, 4);
        add_rates(&mut table, split, (tf, tb), m.graph_call_s);
    }
    // The transformer trainer's kernels, timed alone.
    let model = DeviceModel::new(p, Precision::Fp32).ok()?;
    let mut transformer: BTreeMap<String, Vec<[f64; 3]>> = BTreeMap::new();
    let n = m.transformer_kernels.len();
    if let Some(cases) = [false, true]
        .into_iter()
        .map(transformer_kernel_cases)
        .find(|c| c.len() == n)
    {
        for (c, &(tf, tb)) in cases.iter().zip(&m.transformer_kernels) {
            add_rates(&mut transformer, c.split(&model, &c.work()), (tf, tb), 0.0);
        }
    }
    Some(HostKernels {
        graph: curves(table),
        transformer: curves(transformer),
        graph_call_us: (m.graph_call_s > 0.0).then_some(m.graph_call_s * 1e6),
    })
}

/// Each class's points sorted by size, one per size.
fn curves(table: BTreeMap<String, Vec<[f64; 3]>>) -> BTreeMap<String, KernelRates> {
    table
        .into_iter()
        .map(|(class, mut pts)| {
            pts.sort_by(|a, b| a[0].total_cmp(&b[0]));
            pts.dedup_by(|b, a| b[0] <= a[0]);
            (class, KernelRates(pts))
        })
        .collect()
}

/// Adds to `table` the rates of an op that took `(tf, tb)` seconds: what is not the GEMM calls
/// the cost model prices of it on the calibrated curve (`split`) nor the trainer's `call` of
/// the op each way, as the class's bytes per second, at the size of one call of its inner loop (at least a twentieth of the kernel, where
/// the curve prices its GEMM calls slower than they ran).
fn add_rates(
    table: &mut BTreeMap<String, Vec<[f64; 3]>>,
    split: Option<parallax_cost::compute::HostSplit>,
    (tf, tb): (f64, f64),
    call: f64,
) {
    let Some(split) = split else {
        return;
    };
    if !(tf > 0.0 && tb > 0.0 && split.bytes > 0.0) {
        return;
    }
    let rest_f = (tf - split.gemm.fwd.0 - call).max(0.05 * tf);
    let rest_b = (tb - split.gemm.bwd_input.0 - split.gemm.bwd_weight.0 - call).max(0.05 * tb);
    table.entry(split.class.to_string()).or_default().push([
        split.key,
        split.bytes / rest_f,
        split.bytes / rest_b,
    ]);
}

/// Lowest efficiency written to a curve (validation needs a positive value).
const MIN_EFFICIENCY: f64 = 1e-3;

/// A profile of `base` (the preset named `base_name`: `cpu-local` for CPU cores, the GPU's
/// model for GPUs) with the measured values in place of its nominal ones, and a
/// `[calibration]` table saying which.
pub fn to_profile(m: &Measurements, base: &ClusterProfile, base_name: &str) -> ClusterProfile {
    let mut p = base.clone();
    let best = m.compute.matmul.iter().map(|x| x.1).fold(0.0, f64::max);
    // The peak is the nominal FMA peak unless this machine's best GEMM beats it.
    let peak = (base.device.peak_tflops_fp32 * 1e12).max(best);
    p.device.peak_tflops_fp32 = peak / 1e12;
    let curve = |points: &[(f64, f64)], peak: f64| {
        EfficiencyCurve(
            points
                .iter()
                .map(|(f, r)| (*f, (r / peak).clamp(MIN_EFFICIENCY, 1.0)))
                .collect(),
        )
    };
    // A GPU's curve is its tensor cores' (training's GEMMs run there, and they reach their
    // rate only at larger sizes than sgemm does) against the nominal fp16 peak, which the
    // 16-bit precisions scale from; without them, sgemm's against the fp32 peak.
    let tensor_peak = base
        .device
        .peak_tflops_fp16
        .filter(|_| !m.compute.tensor_matmul.is_empty());
    p.device.matmul_efficiency = match tensor_peak {
        Some(t) => curve(&m.compute.tensor_matmul, t * 1e12),
        None => curve(&m.compute.matmul, peak),
    };
    p.device.hbm_gbps = m.compute.copy_bytes_per_s / 1e9;
    let efficiency = |rate: f64| (rate / m.compute.copy_bytes_per_s).clamp(MIN_EFFICIENCY, 1.0);
    p.device.memory_efficiency = efficiency(m.compute.pointwise_bytes_per_s);
    // Relative to the copy rate of tensors beyond the caches, and capped at it.
    p.device.memory_efficiency_curve = (!m.compute.pointwise_curve.is_empty()).then(|| {
        EfficiencyCurve(
            m.compute
                .pointwise_curve
                .iter()
                .map(|(b, r)| (*b, efficiency(*r)))
                .collect(),
        )
    });
    p.device.kernel_overhead_us = m.compute.op_overhead_s * 1e6;
    p.node.gpus_per_node = u32::try_from(m.threads).unwrap_or(u32::MAX).max(1);
    let mut fields = vec![
        "device.peak_tflops_fp32",
        "device.matmul_efficiency",
        "device.hbm_gbps",
        "device.memory_efficiency",
        "device.kernel_overhead_us",
        "node.gpus_per_node",
    ];
    if p.device.memory_efficiency_curve.is_some() {
        fields.push("device.memory_efficiency_curve");
    }
    if let Some(r) = m.compute.transcendentals_per_s {
        p.device.transcendentals_per_s = Some(r);
        fields.push("device.transcendentals_per_s");
    }
    if let Some(r) = m.compute.tanh_per_s {
        p.device.tanh_per_s = Some(r);
        fields.push("device.tanh_per_s");
    }
    if let Some(h) = host_kernel_rates(&m.compute, &p) {
        p.device.host_kernels = Some(h);
        fields.push("device.host_kernels");
    }
    if let Some(h) = &m.host {
        p.node.host_adam_gparams_per_s = Some(h.adam_params_per_s / 1e9);
        fields.push("node.host_adam_gparams_per_s");
        if let Some(l) = &h.link {
            p.node.pcie_host_gbps = Some(l.bytes_per_s() / 1e9);
            fields.push("node.pcie_host_gbps");
        }
    }
    if let Some(n) = &m.nvme {
        p.node.nvme = Some(parallax_hardware::NvmeSpec {
            read_gbps: n.read_bytes_per_s / 1e9,
            write_gbps: n.write_bytes_per_s / 1e9,
            gib: n.free_bytes / f64::from(1u32 << 30),
            path: Some(n.path.display().to_string()),
        });
        fields.push("node.nvme");
    }
    if let Some(d) = &m.device {
        p.device.name = d.name.clone();
        p.device.hbm_gib = d.mem_gib;
        fields.extend(["device.name", "device.hbm_gib"]);
        if let Some(n) = d.sm_count {
            p.device.sm_count = Some(n);
            fields.push("device.sm_count");
        }
    }
    // With one rank per node nothing inside a node was measured: the base's fabric stays.
    if let Some(c) = &m.intra {
        if m.device.is_some() {
            // The link between the GPUs is not named by the driver; a bus bandwidth above
            // what a PCIe 5.0 x16 link carries (63 GB/s) means NVLink.
            p.node.intra_fabric = if c.busbw_bytes_per_s > 63e9 {
                parallax_hardware::FabricKind::NvlinkMesh
            } else {
                parallax_hardware::FabricKind::Pcie
            };
            // The line rate is not measured apart from what collectives achieve over it.
            p.node.intra_gbps = c.busbw_bytes_per_s / 1e9;
            p.collectives.intra_busbw_efficiency = 1.0;
            fields.push("node.intra_fabric");
        } else {
            // Cores share the host's memory: its copy bandwidth is the line rate.
            p.node.intra_gbps = m.compute.copy_bytes_per_s / 1e9;
            p.collectives.intra_busbw_efficiency =
                (c.busbw_bytes_per_s / m.compute.copy_bytes_per_s).clamp(MIN_EFFICIENCY, 1.0);
        }
        p.node.intra_latency_us = c.step_latency_s * 1e6;
        fields.extend([
            "node.intra_gbps",
            "node.intra_latency_us",
            "collectives.intra_busbw_efficiency",
        ]);
    }
    let mut across = String::new();
    if let Some(x) = &m.inter {
        // One "NIC" per node whose line rate is the measured bus bandwidth: the network path
        // between nodes (NIC, switches, MPI transport) is measured as a whole, not split.
        p.network = Some(parallax_hardware::NetworkSpec {
            nics_per_node: 1,
            nic_gbit: x.fit.busbw_bytes_per_s * 8.0 / 1e9,
            latency_us: x.fit.step_latency_s * 1e6,
            topology: parallax_hardware::Topology::FatTree,
            oversubscription: 1.0,
            nodes_per_leaf: None,
        });
        p.collectives.inter_busbw_efficiency = Some(1.0);
        fields.extend(["network.nic_gbit", "network.latency_us"]);
        across = format!(", all-reduce across {} nodes", x.nodes);
    }
    p.description = if m.device.is_some() {
        format!(
            "{} GPUs of this machine ({} executor: cuBLAS, NCCL), calibrated; fields not \
             measured are preset {base_name}'s",
            m.threads, m.backend
        )
    } else if let Some(x) = &m.inter {
        format!(
            "{} nodes of {} CPU cores as devices ({} executor), calibrated",
            x.nodes, m.threads, m.backend
        )
    } else {
        format!(
            "This machine's CPU cores as devices ({} executor), calibrated on {} cores",
            m.backend, m.threads
        )
    };
    // Built from JSON so that optional fields added to the table later keep their defaults.
    p.calibration = serde_json::from_value::<Provenance>(serde_json::json!({
        "provenance": format!(
            "parallax calibrate --backend {}: {} concurrent ranks per node; {}{}{}{}{across}; other fields from preset {base_name}",
            m.backend,
            m.threads,
            if tensor_peak.is_some() {
                "cuBLAS sgemm and fp16 tensor-core GEMMs over square sizes (the GEMM curve is the tensor cores', against the nominal fp16 peak), device copy and Adam-kernel bandwidth"
            } else if m.device.is_some() {
                "cuBLAS sgemm over square sizes, device copy and Adam-kernel bandwidth"
            } else {
                "training-shaped fp32 GEMMs (forward, input- and weight-gradient forms, down to a convolution's per-sample and a recurrent step's), a copy stream, the streaming kernels of a layer (norm, add, Adam) by size, exp and tanh rates, the transformer trainer's kernels timed alone (its context-parallel ring and mixture of experts included), and every op class of the general-graph trainer timed in a training run of a calibration graph"
            },
            if m.intra.is_some() {
                ", all-reduce over the ranks of one node"
            } else {
                ""
            },
            match &m.host {
                Some(HostFigures { link: Some(_), .. }) => {
                    ", the host's Adam step on all its cores and each GPU's copies to and from pinned host memory"
                }
                Some(_) => ", the host's Adam step on all measured cores",
                None => "",
            },
            match &m.nvme {
                Some(n) => format!(", NVMe write and read at {}", n.path.display()),
                None => String::new(),
            }
        ),
        "fitted_fields": fields,
    }))
    .ok();
    p
}

/// One op of the transformer trainer's kernels, timed alone: its IR op and input shapes (what
/// the cost model prices) and the kernel calls that run it.
struct TransformerCase {
    op: parallax_ir::OpKind,
    ins: Vec<parallax_ir::Shape>,
    /// Attention run as the context-parallel ring (`ring_attention`, here over one rank)
    /// instead of the whole-sequence kernel.
    ring: bool,
}

impl TransformerCase {
    /// What the cost model prices of this case apart from its class's rate.
    fn split(
        &self,
        model: &DeviceModel,
        w: &parallax_ir::Work,
    ) -> Option<parallax_cost::compute::HostSplit> {
        if self.ring {
            model.host_ring_split(&self.op, &self.ins, w, 4, 1)
        } else {
            model.host_split(&self.op, &self.ins, w, 4)
        }
    }

    /// The case's work (a norm's scale and shift, the router and experts are weights).
    fn work(&self) -> parallax_ir::Work {
        let outs = self.op.infer(&self.ins).unwrap_or_default();
        let weights = matches!(
            self.op,
            OpKind::RmsNorm | OpKind::LayerNorm | OpKind::Moe(_)
        );
        let flags: Vec<bool> = (0..self.ins.len()).map(|k| k > 0 && weights).collect();
        self.op.work(&self.ins, &outs, &flags, 4)
    }
}

/// The transformer trainer's op classes at two sizes (tokens × width; the first alone in
/// `quick` mode): norms, activations, the rotary embedding, causal attention (whole-sequence
/// and as the context-parallel ring), the residual add and the loss, in shapes of their own.
fn transformer_kernel_cases(quick: bool) -> Vec<TransformerCase> {
    use parallax_ir::op::{Activation, ActivationAttrs, AttentionAttrs, MoeAttrs};
    use parallax_ir::{OpKind, Shape};
    // (sequence, heads, head size, vocabulary)
    let sizes: &[(u64, u64, u64, u64)] = if quick {
        &[(32, 2, 16, 200)]
    } else {
        &[(32, 2, 16, 200), (192, 6, 32, 600)]
    };
    let mut cases = Vec::new();
    for &(s, heads, hd, vocab) in sizes {
        let h = heads * hd;
        let rows = Shape::new([s, h]);
        let per_head = Shape::new([1, s, heads, hd]);
        let case = |op, ins: Vec<Shape>| TransformerCase {
            op,
            ins,
            ring: false,
        };
        let causal = OpKind::Attention(AttentionAttrs {
            causal: true,
            fused: false,
            dropout: false,
            window: None,
            alibi: false,
        });
        let qkv = vec![per_head.clone(), per_head.clone(), per_head.clone()];
        cases.extend([
            case(OpKind::RmsNorm, vec![rows.clone(), Shape::new([h])]),
            case(
                OpKind::LayerNorm,
                vec![rows.clone(), Shape::new([h]), Shape::new([h])],
            ),
            case(OpKind::Add, vec![rows.clone(), rows.clone()]),
            case(OpKind::SwiGlu, vec![rows.clone(), rows.clone()]),
            case(
                OpKind::Activation(ActivationAttrs {
                    kind: Activation::Gelu,
                }),
                vec![rows.clone()],
            ),
            case(OpKind::Rope, vec![per_head.clone()]),
            case(causal.clone(), qkv.clone()),
            TransformerCase {
                op: causal,
                ins: qkv,
                ring: true,
            },
            case(
                OpKind::CrossEntropy,
                vec![Shape::new([s, vocab]), Shape::new([s])],
            ),
        ]);
        // A mixture of four SwiGLU experts, top-2, as wide as the layer's heads (twice that
        // in each expert), on every expert of one rank.
        let (experts, f) = (4, 2 * h);
        let moe = OpKind::Moe(MoeAttrs {
            experts,
            top_k: 2,
            ffn_hidden: f,
            gated: true,
        });
        let up = Shape::new([experts, h, f]);
        cases.push(case(
            moe,
            vec![
                rows.clone(),
                Shape::new([h, experts]),
                up.clone(),
                Shape::new([experts, f, h]),
                up,
            ],
        ));
    }
    cases
}

/// Forward and backward seconds of `c` by the transformer trainer's kernels on the calling
/// thread, over copies of its inputs beyond the core's caches (as a training step finds
/// them); a loss computed with its gradient in one pass counts half each way.
fn time_transformer_case(c: &TransformerCase, min_time: Duration) -> (f64, f64) {
    use crate::tensor::{
        attention_bwd, attention_fwd, cross_entropy, norm_bwd, norm_fwd, rope, Act, AttnShape, Mask,
    };
    use parallax_ir::OpKind;
    const COLD_BYTES: usize = 4 << 20;
    let elems = |k: usize| c.ins.get(k).map_or(0, |s| s.elems() as usize);
    let (n, width) = (elems(0), c.ins[0].last() as usize);
    let copies = COLD_BYTES.div_ceil(4 * n.max(1)).clamp(1, 64);
    let data = |k: usize, salt: usize| -> Vec<f32> {
        (0..elems(k))
            .map(|j| (((j + salt) * 37) % 101) as f32 / 50.0 - 1.0)
            .collect()
    };
    let xs: Vec<Vec<f32>> = (0..copies).map(|i| data(0, i)).collect();
    // A second operand, or an output gradient, shaped as the first input.
    let ys: Vec<Vec<f32>> = (0..copies).map(|i| data(0, i + 7)).collect();
    let ones = vec![1.0f32; width];
    let mut at = 0;
    let mut next = || {
        at = (at + 1) % copies;
        at
    };
    match &c.op {
        OpKind::RmsNorm | OpKind::LayerNorm => {
            let rms = matches!(c.op, OpKind::RmsNorm);
            let bias = (!rms).then_some(ones.as_slice());
            let mut y = vec![0.0; n];
            let stats = norm_fwd(&mut y, &xs[0], &ones, bias, rms);
            let fwd = time_best(min_time, || {
                let i = next();
                std::hint::black_box(norm_fwd(&mut y, &xs[i], &ones, bias, rms));
            });
            let (mut dx, mut dw, mut db) = (vec![0.0; n], vec![0.0; width], vec![0.0; width]);
            let bwd = time_best(min_time, || {
                let i = next();
                let db = (!rms).then_some(db.as_mut_slice());
                norm_bwd(
                    &mut dx, &ys[i], &xs[i], &stats, &ones, &mut dw, db, rms, false,
                );
                std::hint::black_box(&mut dx);
            });
            (fwd, bwd)
        }
        OpKind::Add => {
            let mut y = vec![0.0; n];
            let t = time_best(min_time, || {
                let i = next();
                y.copy_from_slice(&xs[i]);
                crate::tensor::add_into(&mut y, &ys[i]);
                std::hint::black_box(&mut y);
            });
            (t, t)
        }
        OpKind::SwiGlu | OpKind::Activation(_) => {
            let (act, gated) = match c.op {
                OpKind::SwiGlu => (Act::Swiglu, true),
                _ => (Act::Gelu, false),
            };
            let fwd = time_best(min_time, || {
                let i = next();
                std::hint::black_box(act.fwd(&xs[i], gated.then_some(&ys[i])));
            });
            let mut da = vec![0.0; n];
            let bwd = time_best(min_time, || {
                let i = next();
                da.copy_from_slice(&ys[i]);
                std::hint::black_box(act.bwd(&mut da, &xs[i], gated.then_some(&xs[i])));
            });
            (fwd, bwd)
        }
        OpKind::Rope => {
            let d = c.ins[0].dims();
            let (heads, hd, s) = (d[2] as usize, d[3] as usize, d[1] as usize);
            let mut xs = xs;
            let mut pass = |inverse| {
                time_best(min_time, || {
                    let i = next();
                    rope(&mut xs[i], heads, hd, 10_000.0, |t| t % s, inverse);
                })
            };
            (pass(false), pass(true))
        }
        OpKind::Moe(a) => {
            use crate::comm::ThreadComm;
            use crate::moe::{moe_bwd, moe_fwd, Ep, MoeLayout, Routing};
            let (h, f, e) = (width, a.ffn_hidden as usize, a.experts as usize);
            let per = h * f;
            // The router, then each expert's gate, up and down projections.
            let router = 0..h * e;
            let l = MoeLayout {
                router: router.clone(),
                w_in: 0..e * per,
                w_up: Some(e * per..2 * e * per),
                w_out: 2 * e * per..3 * e * per,
                router_bias: None,
                b_in: None,
                b_up: None,
                b_out: None,
                act: Act::Swiglu,
                experts: e,
                top_k: a.top_k as usize,
                routing: Routing::default(),
            };
            let p: Vec<f32> = (0..router.len())
                .map(|j| ((j * 13) % 29) as f32 / 29.0 - 0.5)
                .collect();
            let pe: Vec<f32> = (0..3 * e * per)
                .map(|j| ((j * 7) % 31) as f32 / 310.0 - 0.05)
                .collect();
            let (mut g, mut ge) = (vec![0.0; p.len()], vec![0.0; pe.len()]);
            let (mut comms, _shared) = ThreadComm::create(1, Duration::from_secs(60));
            let mut ep = Ep {
                comm: &mut comms[0],
                group: None,
            };
            let local = "one rank's experts need no peer";
            let fwd = time_best(min_time, || {
                let i = next();
                let out = moe_fwd(&l, &p, &pe, &xs[i], h, f, &mut ep).expect(local);
                std::hint::black_box(out);
            });
            // Backward consumes what its forward saved: timed with it, less the forward.
            let both = time_best(min_time, || {
                let i = next();
                let (_, saved) = moe_fwd(&l, &p, &pe, &xs[i], h, f, &mut ep).expect(local);
                let dx = moe_bwd(
                    &l,
                    (&p, &mut g),
                    (&pe, &mut ge),
                    &xs[i],
                    saved,
                    &ys[i],
                    h,
                    f,
                    &mut ep,
                );
                std::hint::black_box(dx.expect(local));
            });
            (fwd, (both - fwd).max(0.05 * both))
        }
        OpKind::Attention(_) if c.ring => {
            use crate::comm::{Group, ThreadComm};
            use crate::model::Pass;
            use crate::ring::{ring_bwd, ring_fwd, RingShape};
            let d = c.ins[0].dims();
            let (s, heads, hd) = (d[1] as usize, d[2] as usize, d[3] as usize);
            let (mut comms, _shared) = ThreadComm::create(1, Duration::from_secs(60));
            let comm = &mut comms[0];
            let g = Group::new(vec![0]);
            let pass = Pass {
                batch: 1,
                seq: s,
                cp: 1,
                c: 0,
            };
            let r = RingShape {
                batch: 1,
                lseq: s,
                heads,
                kv_heads: heads,
                hd,
                mask: Mask::Causal(None),
            };
            let ring = "a one-rank ring cannot fail";
            let (o, lse) =
                ring_fwd(comm, &g, (&xs[0], &ys[0], &xs[0]), None, &pass, &r).expect(ring);
            let fwd = time_best(min_time, || {
                let i = next();
                let out = ring_fwd(comm, &g, (&xs[i], &ys[i], &xs[i]), None, &pass, &r);
                std::hint::black_box(out.expect(ring));
            });
            let bwd = time_best(min_time, || {
                let i = next();
                let qkv = (&xs[i][..], &ys[i][..], &xs[i][..]);
                let out = ring_bwd(comm, &g, &ys[i], qkv, (&o, &lse), (None, None), &pass, &r);
                std::hint::black_box(out.expect(ring));
            });
            (fwd, bwd)
        }
        OpKind::Attention(_) => {
            let d = c.ins[0].dims();
            let (s, heads, hd) = (d[1] as usize, d[2] as usize, d[3] as usize);
            let pos: Vec<usize> = (0..s).collect();
            let shape = AttnShape {
                batch: 1,
                q_pos: &pos,
                sk: s,
                heads,
                kv_heads: heads,
                hd,
                mask: Mask::Causal(None),
            };
            let mut o = vec![0.0; n];
            let probs = attention_fwd(&mut o, &xs[0], &ys[0], &xs[0], &shape, None, true);
            let fwd = time_best(min_time, || {
                let i = next();
                let o = attention_fwd(&mut o, &xs[i], &ys[i], &xs[i], &shape, None, true);
                std::hint::black_box(o);
            });
            let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let bwd = time_best(min_time, || {
                let i = next();
                attention_bwd(
                    &mut dq,
                    &mut dk,
                    &mut dv,
                    &ys[i],
                    &xs[i],
                    &ys[i],
                    &xs[i],
                    probs.as_deref(),
                    &shape,
                    None,
                    None,
                );
                std::hint::black_box(&mut dq);
            });
            (fwd, bwd)
        }
        OpKind::CrossEntropy => {
            let rows = c.ins[1].elems() as usize;
            let targets: Vec<u32> = (0..rows).map(|r| ((r * 7919) % width) as u32).collect();
            let mut logits = xs;
            let t = time_best(min_time, || {
                let i = next();
                std::hint::black_box(cross_entropy(&mut logits[i], &targets, width, 1.0));
            });
            (t / 2.0, t / 2.0)
        }
        _ => (0.0, 0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_calibration_gives_a_valid_profile() {
        let m = measure(CalibrateOptions {
            threads: 2,
            quick: true,
        })
        .unwrap();
        assert_eq!(m.backend, "threads");
        assert!(m.compute.matmul.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(m.compute.matmul.iter().all(|x| x.1 > 0.0));
        let c = m.intra.unwrap();
        assert!(c.busbw_bytes_per_s > 0.0 && c.step_latency_s > 0.0);
        assert!(m.compute.transcendentals_per_s.is_some_and(|r| r > 0.0));
        assert!(m.compute.tanh_per_s.is_some_and(|r| r > 0.0));
        // The host's Adam step on both cores: streaming 30 bytes a parameter, it cannot beat
        // the cores' copy bandwidth by much (the arrays are far beyond the caches).
        let h = m.host.unwrap();
        assert_eq!((h.cores, h.link), (2, None));
        let streamed = h.adam_params_per_s * 30.0;
        assert!(
            h.adam_params_per_s > 1e6 && streamed < 3.0 * 2.0 * m.compute.copy_bytes_per_s,
            "{} params/s against {} B/s copies a core",
            h.adam_params_per_s,
            m.compute.copy_bytes_per_s
        );
        // One MPI rank's share of the same step (half the parameters, one core) runs at no
        // more than one core's share of the pair's rate would allow alone, within the noise
        // of this shared machine.
        let one = host_adam_rank_params_per_s(2, true);
        assert!(
            one > 1e6 && one < 4.0 * h.adam_params_per_s,
            "{one} params/s on one rank's share against {} on both cores",
            h.adam_params_per_s
        );
        assert!(m
            .compute
            .pointwise_curve
            .windows(2)
            .all(|w| w[0].0 < w[1].0));
        let base = parallax_hardware::preset("cpu-local").unwrap();
        let p = to_profile(&m, &base, "cpu-local");
        p.validate().unwrap();
        assert_eq!(
            p.node.host_adam_gparams_per_s,
            Some(h.adam_params_per_s / 1e9)
        );
        // The pointwise curve ends at the rate of tensors beyond the caches.
        let curve = p.device.memory_efficiency_curve.as_ref().unwrap();
        assert_eq!(curve.0.last().unwrap().1, p.device.memory_efficiency);
        // Every class of the calibration graph was timed in training, and its rates make the
        // cost model give back each measured time at the measured size.
        let cases = graph_kernel_cases(true);
        assert_eq!(m.compute.graph_kernels.len(), cases.len());
        assert!(m
            .compute
            .graph_kernels
            .iter()
            .all(|t| t.0 > 0.0 && t.1 > 0.0));
        let table = p.device.host_kernels.as_ref().unwrap();
        // The trainer's call of an op, from the graph's view ops: microseconds, not nothing.
        assert!(
            (1e-8..1e-3).contains(&m.compute.graph_call_s),
            "{}",
            m.compute.graph_call_s
        );
        assert_eq!(table.graph_call_us, Some(m.compute.graph_call_s * 1e6));
        let model = DeviceModel::new(&p, Precision::Fp32)
            .unwrap()
            .with_host_graph_trainer(true);
        let mut sizes = std::collections::HashSet::new();
        for ((g, i), (tf, tb)) in cases.iter().zip(&m.compute.graph_kernels) {
            let n = &g.nodes[*i];
            let (ins, w) = (g.input_shapes(n), g.node_work(n, 4));
            let (t, split) = (
                model.op(&n.op, &ins, &w, 4),
                model.host_split(&n.op, &ins, &w, 4).unwrap(),
            );
            let class = split.class;
            assert!(table.graph.contains_key(class), "{class}");
            // A class's curve keeps the first case of each size.
            if !sizes.insert((class, split.key.to_bits())) {
                continue;
            }
            // The measured time, or the GEMM calls, the trainer's call of the op and the
            // floor of a twentieth where those price it slower than it ran.
            let call = m.compute.graph_call_s;
            let (gf, gb) = (
                split.gemm.fwd.0 + call,
                split.gemm.bwd_input.0 + split.gemm.bwd_weight.0 + call,
            );
            let close = |got: f64, want: f64| (got - want).abs() <= 1e-9 * want;
            assert!(
                close(t.fwd.0, tf.max(gf + 0.05 * tf)),
                "{}: {t:?} vs {tf}",
                n.name
            );
            let back = t.bwd_input.0 + t.bwd_weight.0;
            assert!(
                close(back, tb.max(gb + 0.05 * tb)),
                "{}: {back} vs {tb}",
                n.name
            );
        }
        // The transformer trainer's kernels alike, read by a transformer's ops.
        let model = DeviceModel::new(&p, Precision::Fp32).unwrap();
        let cases = transformer_kernel_cases(true);
        assert_eq!(m.compute.transformer_kernels.len(), cases.len());
        for (c, (tf, tb)) in cases.iter().zip(&m.compute.transformer_kernels) {
            let w = c.work();
            let split = c.split(&model, &w).unwrap();
            let class = split.class;
            assert!(table.transformer.contains_key(class), "{class}");
            let t = if c.ring {
                model.ring_attention(&c.op, &c.ins, &w, 4, 1)
            } else {
                model.op(&c.op, &c.ins, &w, 4)
            };
            let close = |got: f64, want: f64| (got - want).abs() <= 1e-9 * want;
            assert!(
                close(t.fwd.0, tf.max(split.gemm.fwd.0 + 0.05 * tf)),
                "{class}: {t:?} vs {tf}"
            );
            let gb = split.gemm.bwd_input.0 + split.gemm.bwd_weight.0;
            let back = t.bwd_input.0 + t.bwd_weight.0;
            assert!(
                close(back, tb.max(gb + 0.05 * tb)),
                "{class}: {back} vs {tb}"
            );
        }
        let text = p.to_toml_string().unwrap();
        let back = ClusterProfile::from_toml_str(&text, "calibrated").unwrap();
        assert_eq!(back.node.gpus_per_node, 2);
        assert!(back.calibration.is_some());
        assert_eq!(back.device.host_kernels, p.device.host_kernels);
    }

    #[test]
    fn compute_figures_survive_the_flat_vector() {
        let c = ComputeFigures {
            matmul: vec![(1e6, 2e10), (1e8, 4e10)],
            tensor_matmul: vec![(3.4e7, 2e12), (1.1e12, 7e14)],
            copy_bytes_per_s: 1e10,
            pointwise_bytes_per_s: 5e9,
            pointwise_curve: vec![(6.4e4, 9e9), (1e6, 8e9), (1e8, 5e9)],
            op_overhead_s: 1e-7,
            transcendentals_per_s: Some(2e8),
            tanh_per_s: Some(6e7),
            graph_kernels: vec![(1e-5, 2e-5), (3e-5, 5e-5)],
            transformer_kernels: vec![(4e-6, 8e-6)],
            graph_call_s: 1.5e-6,
        };
        assert_eq!(ComputeFigures::from_vec(&c.to_vec()), c);
        let gpu = ComputeFigures {
            transcendentals_per_s: None,
            tanh_per_s: None,
            pointwise_curve: Vec::new(),
            graph_kernels: Vec::new(),
            transformer_kernels: Vec::new(),
            graph_call_s: 0.0,
            ..c
        };
        assert_eq!(ComputeFigures::from_vec(&gpu.to_vec()), gpu);
    }

    #[test]
    fn all_reduce_fit_recovers_bandwidth_and_latency() {
        // 4 ranks, 1 us per step, 10 GB/s busbw: t = 6 steps + 1.5 · S / busbw.
        let (n, step, busbw, bytes) = (4usize, 1e-6, 1e10, 4e6);
        let t = AllReduceTimes {
            small_s: 6.0 * step,
            large_s: 6.0 * step + 1.5 * bytes / busbw,
            large_bytes: bytes,
        };
        let f = t.fit(n);
        assert!((f.busbw_bytes_per_s / busbw - 1.0).abs() < 1e-9);
        assert!((f.step_latency_s / step - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_multi_node_calibration_writes_a_valid_network() {
        let m = Measurements {
            backend: "mpi",
            threads: 4,
            compute: ComputeFigures {
                matmul: vec![(1e6, 2e10), (1e8, 4e10)],
                tensor_matmul: Vec::new(),
                copy_bytes_per_s: 1e10,
                pointwise_bytes_per_s: 5e9,
                pointwise_curve: vec![(6.4e4, 9e9), (1e8, 5e9)],
                op_overhead_s: 1e-7,
                transcendentals_per_s: Some(2e8),
                tanh_per_s: Some(6e7),
                graph_kernels: Vec::new(),
                transformer_kernels: Vec::new(),
                graph_call_s: 0.0,
            },
            intra: Some(CollectiveFit {
                busbw_bytes_per_s: 4e9,
                step_latency_s: 2e-6,
            }),
            inter: Some(InterNode {
                nodes: 2,
                fit: CollectiveFit {
                    busbw_bytes_per_s: 1.25e9,
                    step_latency_s: 2e-5,
                },
            }),
            device: None,
            host: None,
            nvme: None,
        };
        let p = to_profile(
            &m,
            &parallax_hardware::preset("cpu-local").unwrap(),
            "cpu-local",
        );
        p.validate().unwrap();
        let net = p.network.as_ref().unwrap();
        assert!((net.nic_gbit - 10.0).abs() < 1e-9 && (net.latency_us - 20.0).abs() < 1e-9);
        assert_eq!(p.node.gpus_per_node, 4);
        assert!(p.calibration.unwrap().provenance.contains("across 2 nodes"));
    }

    /// One GPU measures no collective: the profile keeps the matched preset's fabric and
    /// tensor-core peaks and claims only what was measured.
    #[test]
    fn a_one_gpu_calibration_keeps_its_presets_links() {
        let m = Measurements {
            backend: "cuda",
            threads: 1,
            compute: ComputeFigures {
                matmul: vec![(3.4e7, 2.4e12), (1.1e12, 5.1e13)],
                // One H100's fp16 GEMMs, 256³ and 8192³ (`calibrate --backend cuda`).
                tensor_matmul: vec![(3.4e7, 1.6e12), (1.1e12, 6.9e14)],
                copy_bytes_per_s: 4.1e12,
                pointwise_bytes_per_s: 2.8e12,
                pointwise_curve: Vec::new(),
                graph_kernels: Vec::new(),
                transformer_kernels: Vec::new(),
                op_overhead_s: 6.8e-6,
                transcendentals_per_s: None,
                tanh_per_s: None,
                graph_call_s: 0.0,
            },
            intra: None,
            inter: None,
            device: Some(MeasuredDevice {
                name: "NVIDIA H200".into(),
                mem_gib: 139.8,
                sm_count: Some(132),
            }),
            // Illustrative: 2.5 G parameters a second on the host's cores, a PCIe 5.0 x16
            // link slower down than up.
            host: Some(HostFigures {
                cores: 96,
                adam_params_per_s: 2.5e9,
                link: Some(HostLink {
                    h2d_bytes_per_s: 53e9,
                    d2h_bytes_per_s: 48e9,
                }),
            }),
            nvme: Some(NvmeFigures {
                path: "/raid".into(),
                write_bytes_per_s: 20e9,
                read_bytes_per_s: 25e9,
                free_bytes: 15e12,
            }),
        };
        let name = parallax_hardware::preset_for_device("NVIDIA H200", 139.8).unwrap();
        let base = parallax_hardware::preset(name).unwrap();
        let p = to_profile(&m, &base, name);
        p.validate().unwrap();
        assert_eq!(p.node.intra_gbps, base.node.intra_gbps);
        assert_eq!(p.node.intra_fabric, base.node.intra_fabric);
        assert_eq!(p.device.peak_tflops_bf16, base.device.peak_tflops_bf16);
        assert_eq!(p.node.gpus_per_node, 1);
        assert_eq!(p.device.sm_count, Some(132));
        // The curve is the tensor cores' against the fp16 peak, not sgemm's against fp32.
        let fp16 = base.device.peak_tflops_fp16.unwrap() * 1e12;
        assert!((p.device.matmul_efficiency.at(1.1e12) - 6.9e14 / fp16).abs() < 1e-9);
        assert!((p.device.matmul_efficiency.at(3.4e7) - 1.6e12 / fp16).abs() < 1e-9);
        let c = p.calibration.unwrap();
        assert!(c.fitted_fields.iter().any(|f| f == "device.sm_count"));
        assert!(!c.fitted_fields.iter().any(|f| f.starts_with("node.intra")));
        assert!(c.provenance.contains(name) && !c.provenance.contains("all-reduce"));
        assert!(c.provenance.contains("tensor-core"), "{}", c.provenance);
        // The host side offload is priced with: the slower direction of the link, the Adam rate.
        assert_eq!(p.node.pcie_host_gbps, Some(48.0));
        assert_eq!(p.node.host_adam_gparams_per_s, Some(2.5));
        for f in ["node.pcie_host_gbps", "node.host_adam_gparams_per_s"] {
            assert!(c.fitted_fields.iter().any(|x| x == f), "{f}");
        }
        assert!(c.provenance.contains("host"), "{}", c.provenance);
        // The drives measured, where the DeepSpeed export will point ZeRO-Infinity.
        let nvme = p.node.nvme.as_ref().unwrap();
        assert_eq!((nvme.read_gbps, nvme.write_gbps), (25.0, 20.0));
        assert_eq!(nvme.path.as_deref(), Some("/raid"));
        assert!((nvme.gib - 15e12 / f64::from(1u32 << 30)).abs() < 1e-6);
        assert!(c.provenance.contains("NVMe write and read at /raid"));
    }

    /// A folder on a drive is measured and left as it was; one in memory or missing is
    /// refused by name.
    #[cfg(target_os = "linux")]
    #[test]
    fn nvme_is_measured_on_a_drive_and_refused_elsewhere() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let listing = || {
            let mut v: Vec<_> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            v.sort();
            v
        };
        let before = listing();
        match measure_nvme(dir, true) {
            Ok(n) => {
                assert!(
                    n.read_bytes_per_s > 1e6 && n.write_bytes_per_s > 1e6,
                    "{n:?}"
                );
                assert!(n.free_bytes > 0.0);
                assert_eq!(listing(), before);
            }
            Err(e) if e.contains("in memory") => {
                eprintln!("skipped the drive measurement: {e}");
            }
            Err(e) => panic!("{e}"),
        }
        let shm = std::path::Path::new("/dev/shm");
        if shm.is_dir() {
            let e = measure_nvme(shm, true).unwrap_err();
            assert!(e.contains("tmpfs, in memory"), "{e}");
        }
        let e = measure_nvme(&dir.join("no-such-folder"), true).unwrap_err();
        assert!(e.contains("no-such-folder"), "{e}");
    }
}

/// Samples of the calibration graph each device runs.
const CALIBRATION_BATCH: u64 = 16;

/// Sizes of the calibration graph: each class at two sizes of the unit its loops run over
/// (a sample's image, a step's rows), a few hundred KiB and a few MiB of activations a
/// device (the first alone in `quick` mode).
fn calibration_sizes(quick: bool) -> &'static [CalibrationSize] {
    const SIZES: [CalibrationSize; 2] = [
        CalibrationSize {
            channels: 4,
            image: 8,
            width: 16,
            seq: 8,
        },
        CalibrationSize {
            channels: 16,
            image: 28,
            width: 96,
            seq: 32,
        },
    ];
    if quick {
        &SIZES[..1]
    } else {
        &SIZES
    }
}

/// The shape of one calibration graph.
#[derive(Clone, Copy, Debug)]
struct CalibrationSize {
    /// Channels and side of the images.
    channels: u64,
    image: u64,
    /// Width of the sequence ops (embedding, recurrent layers, norm, attention) and their
    /// positions.
    width: u64,
    seq: u64,
}

/// One op of every class the general-graph trainer runs, at batch `b`, in shapes of their
/// own (not those of any zoo model): a 3×3 convolution over images and the CNN ops after it,
/// an embedding, LSTM, GRU, norm and attention over a sequence, a linear layer to 300 classes
/// and its loss.
fn calibration_graph(size: CalibrationSize, b: u64) -> Result<Graph, parallax_ir::GraphError> {
    use parallax_ir::op::{
        Activation, AttentionAttrs, AxisAttrs, Pool2dAttrs, PoolKind, ReshapeAttrs, RnnAttrs,
        TransposeAttrs,
    };
    use parallax_ir::{graph::conv, DType, GraphBuilder, OpKind};
    let CalibrationSize {
        channels: c,
        image: side,
        width,
        seq,
    } = size;
    let mut g = GraphBuilder::new("calibration");
    let images = g.input("images", [b, c, side, side], DType::F32);
    // A stem reading the images, then one of each op on activations: ops on data inputs
    // compute no input gradient, and are not timed.
    let stem = g.conv2d("stem", images, conv(c, 3, 1, 1))?;
    let x = g.batch_norm("batch_norm", stem)?;
    let x = g.activation("relu", Activation::Relu, x)?;
    let x = g.conv2d("conv2d", x, conv(c, 3, 1, 1))?;
    let x = g.op1("add", OpKind::Add, &[x, stem])?;
    let x = g.op1("mul", OpKind::Mul, &[x, stem])?;
    // A per-channel shift and scale broadcast over the images.
    let channel = g.weight("channel_shift", [1, c, 1, 1]);
    let x = g.op1("broadcast_add", OpKind::Add, &[x, channel])?;
    let channel = g.weight("channel_scale", [1, c, 1, 1]);
    let x = g.op1("broadcast_mul", OpKind::Mul, &[x, channel])?;
    let x = g.activation("gelu", Activation::Gelu, x)?;
    let x = g.activation("sigmoid", Activation::Sigmoid, x)?;
    let x = g.activation("tanh", Activation::Tanh, x)?;
    let x = g.dropout("dropout", x, 100)?;
    let pool = |kind, kernel, stride, pad| {
        OpKind::Pool2d(Pool2dAttrs {
            kind,
            kernel: [kernel; 2],
            stride: [stride; 2],
            padding: [pad; 2],
        })
    };
    // Channels last and back: a layout change (the second, alike, is not a case of its own).
    let perm = |perm: Vec<usize>| OpKind::Transpose(TransposeAttrs { perm });
    let x = g.op1("transpose", perm(vec![0, 2, 3, 1]), &[x])?;
    let x = g.op1("transpose_back", perm(vec![0, 3, 1, 2]), &[x])?;
    let x = g.op1("max_pool", pool(PoolKind::Max, 3, 2, 1), &[x])?;
    let x = g.op1("avg_pool", pool(PoolKind::Avg, 2, 2, 0), &[x])?;
    let x = g.op1("concat", OpKind::Concat(AxisAttrs { axis: 1 }), &[x, x])?;
    let pooled = g.op1("global_avg_pool", OpKind::GlobalAvgPool, &[x])?;
    let image_labels = g.input("image_labels", [b], DType::I64);
    let pooled = g.op1("flatten", OpKind::Flatten(AxisAttrs { axis: 1 }), &[pooled])?;
    let image_logits = g.linear("classifier", pooled, 10, true)?;
    let image_loss = g.op1(
        "classifier_loss",
        OpKind::CrossEntropy,
        &[image_logits, image_labels],
    )?;

    let classes = 300;
    let tokens = g.input("tokens", [b, seq], DType::I64);
    let labels = g.input("labels", [b * seq], DType::I64);
    let (x, _) = g.embedding("embedding", tokens, classes, width)?;
    let rnn = |g: &mut GraphBuilder, name: &str, x, gates: u64, op: OpKind| {
        let w_ih = g.weight(format!("{name}.weight_ih"), [width, gates * width]);
        let w_hh = g.weight(format!("{name}.weight_hh"), [width, gates * width]);
        let bias = g.weight(format!("{name}.bias"), [gates * width]);
        g.op1(name, op, &[x, w_ih, w_hh, bias])
    };
    let hidden = RnnAttrs { hidden: width };
    let x = rnn(&mut g, "lstm", x, 4, OpKind::Lstm(hidden.clone()))?;
    let x = rnn(&mut g, "gru", x, 3, OpKind::Gru(hidden))?;
    let x = g.layer_norm("layer_norm", x)?;
    let heads = |g: &mut GraphBuilder, name: &str, t| {
        g.op1(
            name,
            OpKind::Reshape(ReshapeAttrs {
                shape: vec![b, seq, 4, width / 4],
            }),
            &[t],
        )
    };
    let (q, k, v) = (
        heads(&mut g, "q", x)?,
        heads(&mut g, "k", x)?,
        heads(&mut g, "v", x)?,
    );
    let attrs = AttentionAttrs {
        causal: true,
        fused: false,
        dropout: false,
        window: None,
        alibi: false,
    };
    let x = g.attention("attention", q, k, v, attrs)?;
    let x = g.op1(
        "rows",
        OpKind::Reshape(ReshapeAttrs {
            shape: vec![b * seq, width],
        }),
        &[x],
    )?;
    let logits = g.linear("linear", x, classes, true)?;
    let loss = g.op1("cross_entropy", OpKind::CrossEntropy, &[logits, labels])?;
    g.finish(&[image_loss, loss])
}

/// Forward and backward seconds of every node of `g` (one device's share of it) as the
/// general-graph trainer runs them in training: `g` at `threads` times its batch, every op
/// sample-split over `threads` devices (BatchNorm's statistics local: no communication inside
/// an op), `steps` steps on the threads backend; per node the median over the steps past the
/// first quarter and the devices of its forward and backward spans. A span holds what the trainer
/// does for the op — its inputs gathered from the ops that made them, the kernel, its output
/// gradient summed from its consumers' pieces — so the rates derived from it price an op as
/// training runs it, not a kernel alone. `None` for nodes the trainer has no kernel for (the
/// whole graph then), or when the run fails.
pub fn time_graph_nodes(
    g_of: &dyn Fn(u64) -> Result<Graph, parallax_ir::GraphError>,
    batch: u64,
    threads: usize,
    steps: u64,
) -> Option<NodeTimes> {
    use crate::graph::{op_plan, split_label, GraphRunSpec};
    use parallax_ir::{AxisRole, BatchNormStats};
    let devices = threads.max(1) as u32;
    let whole = g_of(batch * u64::from(devices)).ok()?;
    let mut plan = op_plan(&whole, 1, |i| {
        split_label(&whole, i, devices, 0, &|_, r| r == AxisRole::Sample)
    });
    plan.batch_norm = BatchNormStats::Local;
    let mut spec = GraphRunSpec::new(whole.clone(), plan, steps.max(2));
    spec.trace = true;
    let report = crate::graph::run_graph_threads(&spec).ok()?;
    // Steps past the first quarter (at least the first): allocator pools, page tables and
    // caches settle over several steps.
    let warm = (spec.steps / 4).max(1);
    let median = |name: String| {
        let mut t: Vec<f64> = report
            .spans
            .iter()
            .filter(|s| s.step >= warm && s.name == name)
            .map(|s| s.dur_s)
            .collect();
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(0.0)
    };
    Some(
        whole
            .nodes
            .iter()
            .map(|n| {
                (
                    median(format!("F {} mb0", n.name)),
                    median(format!("B {} mb0", n.name)),
                )
            })
            .collect(),
    )
}

/// Whether node `i` of `g` is a timed case: its op has a class and its first input is
/// another op's output (an op on a data input computes no input gradient; an embedding
/// never does).
fn timed(g: &Graph, i: usize) -> bool {
    let n = &g.nodes[i];
    let on_data = n
        .inputs
        .first()
        .is_some_and(|t| g.tensor(*t).role == parallax_ir::TensorRole::Input);
    parallax_cost::compute::host_class(&n.op).is_some()
        && (!on_data || matches!(n.op, parallax_ir::OpKind::Embedding(_)))
}

/// The timed cases: every [`timed`] node of the calibration graphs (one device's share), in
/// order.
fn graph_kernel_cases(quick: bool) -> Vec<(Graph, usize)> {
    let mut cases = Vec::new();
    for &size in calibration_sizes(quick) {
        let Ok(g) = calibration_graph(size, CALIBRATION_BATCH) else {
            continue;
        };
        let nodes: Vec<usize> = (0..g.nodes.len()).filter(|&i| timed(&g, i)).collect();
        cases.extend(nodes.into_iter().map(|i| (g.clone(), i)));
    }
    cases
}

/// Forward and backward seconds of every node of a graph.
type NodeTimes = Vec<(f64, f64)>;

/// Forward and backward seconds of every case of [`graph_kernel_cases`], measured in
/// training on `threads` cores at once (`(0, 0)` for a case that did not run), and the median
/// call of the graphs' view ops, forward and backward: what the trainer spends on an op
/// whatever its size.
fn measure_graph_kernels(threads: usize, quick: bool) -> (Vec<(f64, f64)>, f64) {
    let steps = if quick { 3 } else { 24 };
    // Runs of every size in turn, the median of each op over them: a host's speed drifts
    // over seconds (1.5x on the VM this was built on), and one run would fix one moment.
    let rounds = if quick { 1 } else { 3 };
    let sizes = calibration_sizes(quick);
    let mut runs: Vec<Vec<Option<NodeTimes>>> = vec![Vec::new(); sizes.len()];
    for _ in 0..rounds {
        for (s, &size) in sizes.iter().enumerate() {
            runs[s].push(time_graph_nodes(
                &|b| calibration_graph(size, b),
                CALIBRATION_BATCH,
                threads,
                steps,
            ));
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let mut times = Vec::new();
    let mut calls = Vec::new();
    for (s, &size) in sizes.iter().enumerate() {
        let Ok(g) = calibration_graph(size, CALIBRATION_BATCH) else {
            continue;
        };
        for i in (0..g.nodes.len()).filter(|&i| timed(&g, i)) {
            let of = |pass: fn(&(f64, f64)) -> f64| {
                median(runs[s].iter().flatten().map(|m| pass(&m[i])).collect())
            };
            times.push((of(|t| t.0), of(|t| t.1)));
        }
        for i in (0..g.nodes.len()).filter(|&i| g.nodes[i].op.is_view()) {
            calls.extend(runs[s].iter().flatten().flat_map(|m| [m[i].0, m[i].1]));
        }
    }
    calls.retain(|t| *t > 0.0);
    (times, median(calls))
}
