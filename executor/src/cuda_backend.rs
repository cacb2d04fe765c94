//! The `cuda` backend (features `cuda`, `nccl`), as far as it goes today.
//!
//! What exists: a run-time probe for the CUDA driver and its libraries (cudarc loads them
//! dynamically, so a build needs no CUDA toolkit and a machine without a GPU gets a typed
//! error with a fix-it message instead of a panic — tract's `is_culib_present` pattern); a
//! [`Gpu`] handle with a row-major cuBLAS `sgemm`, a timed device-resident sgemm for
//! calibration, and the executor's Adam update as an NVRTC-compiled kernel; and, with
//! feature `nccl`, NCCL communicators bootstrapped through a shared-file rendezvous
//! ([`nccl_rendezvous`]).
//!
//! What does not exist yet: the transformer trainer on the GPU (forward and backward kernels,
//! device-resident parameters) and a [`crate::Collectives`] implementation over NCCL, so
//! `parallax run --backend cuda` answers [`ExecError::Backend`] saying so, after the probe.
//!
//! None of this has run on a GPU in this repository's CI (it has none): the tests skip with
//! a message when no device is found.

use crate::engine::AdamConfig;
use crate::error::ExecError;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, GemmConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError};
use std::sync::Arc;
use std::time::Instant;

/// What to do when the driver is missing.
const FIX_DRIVER: &str = "no CUDA driver library (libcuda.so) could be loaded: install the \
    NVIDIA driver, or add the directory holding libcuda.so.1 to LD_LIBRARY_PATH; without a GPU \
    use --backend threads or --backend mpi";

/// The libraries loaded at run time besides the driver: file name stem and how to get it
/// (package names of NVIDIA's CUDA repository for Debian/Ubuntu).
const LIBRARIES: [(Lib, &str, &str); 2] = [
    (
        Lib::Cublas,
        "libcublas",
        "cuBLAS (package libcublas-12-x, or the CUDA toolkit)",
    ),
    (
        Lib::Nvrtc,
        "libnvrtc",
        "NVRTC (package cuda-nvrtc-12-x, or the CUDA toolkit)",
    ),
];

/// A library the backend needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lib {
    Driver,
    Cublas,
    Nvrtc,
    #[cfg(feature = "nccl")]
    Nccl,
}

/// The narrow unsafe part: probing and calling into the dynamically loaded libraries.
#[allow(unsafe_code)]
mod ffi {
    use super::Lib;
    use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
    use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

    /// Whether the shared library can be loaded.
    pub(super) fn present(lib: Lib) -> bool {
        // SAFETY: each call tries `dlopen` on the library's usual names and drops the handle;
        // loading runs the library's initialisers, which is what using the backend does
        // anyway, and touches no memory of ours.
        unsafe {
            match lib {
                Lib::Driver => cudarc::driver::sys::is_culib_present(),
                Lib::Cublas => cudarc::cublas::sys::is_culib_present(),
                Lib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                #[cfg(feature = "nccl")]
                Lib::Nccl => cudarc::nccl::sys::is_culib_present(),
            }
        }
    }

    /// Column-major `c = a · b` (cuBLAS conventions) on device buffers whose lengths the
    /// caller checked against the configuration.
    pub(super) fn sgemm(
        blas: &CudaBlas,
        cfg: GemmConfig<f32>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), cudarc::cublas::result::CublasError> {
        // SAFETY: `Gpu::sgemm_device` checks that `a` holds m·k, `b` k·n and `c` m·n values
        // for the non-transposed column-major shapes in `cfg` (leading dimensions m, k, m),
        // so cuBLAS reads and writes only inside the three allocations.
        unsafe { blas.gemm(cfg, a, b, c) }
    }

    /// Launches the Adam kernel over `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_adam(
        stream: &CudaStream,
        f: &CudaFunction,
        p: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        hyper: [f32; 6],
        n: u32,
    ) -> Result<(), cudarc::driver::DriverError> {
        let [lr, b1, b2, eps, bc1, bc2] = hyper;
        let mut launch = stream.launch_builder(f);
        launch
            .arg(p)
            .arg(g)
            .arg(m)
            .arg(v)
            .arg(&lr)
            .arg(&b1)
            .arg(&b2)
            .arg(&eps)
            .arg(&bc1)
            .arg(&bc2)
            .arg(&n);
        // SAFETY: the argument list matches the kernel's signature in `ADAM_KERNEL`
        // (four float pointers, six floats, one unsigned int); the four buffers hold at
        // least `n` values (checked by `Gpu::adam_step`) and the kernel touches index
        // `i < n` only.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.map(|_| ())
    }
}

/// One CUDA device as the probe sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Device memory in bytes.
    pub total_mem_bytes: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
}

fn driver_err(what: &str, e: DriverError) -> ExecError {
    ExecError::Backend {
        backend: "cuda",
        message: format!("{what}: {e:?}"),
    }
}

fn require(lib: Lib) -> Result<(), ExecError> {
    if ffi::present(lib) {
        return Ok(());
    }
    if lib == Lib::Driver {
        return Err(ExecError::Backend {
            backend: "cuda",
            message: FIX_DRIVER.into(),
        });
    }
    #[cfg(feature = "nccl")]
    if lib == Lib::Nccl {
        return Err(ExecError::Backend {
            backend: "cuda",
            message: "libnccl.so.2 could not be loaded: install NCCL (package libnccl2) or add \
                      its directory to LD_LIBRARY_PATH"
                .into(),
        });
    }
    let (name, what) = LIBRARIES
        .iter()
        .find(|(l, _, _)| *l == lib)
        .map_or(("a CUDA library", "it"), |(_, n, w)| (*n, *w));
    Err(ExecError::Backend {
        backend: "cuda",
        message: format!(
            "{name}.so could not be loaded: install {what}, or add its directory to \
             LD_LIBRARY_PATH"
        ),
    })
}

/// Finds the CUDA devices of this machine. Errors (typed, with a fix-it message) when the
/// driver library is missing or sees no device.
pub fn probe() -> Result<Vec<DeviceInfo>, ExecError> {
    require(Lib::Driver)?;
    let count = CudaContext::device_count().map_err(|e| driver_err("cuInit", e))?;
    if count <= 0 {
        return Err(ExecError::Backend {
            backend: "cuda",
            message: "the CUDA driver is installed but sees no GPU (check nvidia-smi and \
                      CUDA_VISIBLE_DEVICES)"
                .into(),
        });
    }
    (0..count as usize)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtxCreate", e))?;
            Ok(DeviceInfo {
                ordinal,
                name: ctx.name().map_err(|e| driver_err("cuDeviceGetName", e))?,
                total_mem_bytes: ctx
                    .total_mem()
                    .map_err(|e| driver_err("cuDeviceTotalMem", e))?
                    as u64,
                compute_capability: ctx
                    .compute_capability()
                    .map_err(|e| driver_err("cuDeviceGetAttribute", e))?,
            })
        })
        .collect()
}

/// The executor's Adam update (`engine.rs`), one thread per element, same operation order.
const ADAM_KERNEL: &str = r#"
extern "C" __global__ void adam(float* p, const float* g, float* m, float* v,
                                float lr, float b1, float b2, float eps,
                                float bc1, float bc2, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float gi = g[i];
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
    }
}
"#;

/// One GPU: a context, a stream, a cuBLAS handle and the NVRTC kernels.
pub struct Gpu {
    info: DeviceInfo,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    adam: CudaFunction,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens device `ordinal`: checks the driver, cuBLAS and NVRTC are loadable, creates a
    /// stream and a cuBLAS handle, and compiles the kernels with NVRTC.
    pub fn open(ordinal: usize) -> Result<Gpu, ExecError> {
        let devices = probe()?;
        let info = devices
            .get(ordinal)
            .cloned()
            .ok_or_else(|| ExecError::Backend {
                backend: "cuda",
                message: format!(
                    "GPU {ordinal} does not exist (this machine has {})",
                    devices.len()
                ),
            })?;
        require(Lib::Cublas)?;
        require(Lib::Nvrtc)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtxCreate", e))?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| ExecError::Backend {
            backend: "cuda",
            message: format!("cublasCreate: {e:?}"),
        })?;
        let ptx = cudarc::nvrtc::compile_ptx(ADAM_KERNEL).map_err(|e| ExecError::Backend {
            backend: "cuda",
            message: format!("NVRTC could not compile the Adam kernel: {e:?}"),
        })?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| driver_err("cuModuleLoadData", e))?;
        let adam = module
            .load_function("adam")
            .map_err(|e| driver_err("cuModuleGetFunction", e))?;
        Ok(Gpu {
            info,
            stream,
            blas,
            adam,
        })
    }

    /// The device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn upload(&self, x: &[f32]) -> Result<CudaSlice<f32>, ExecError> {
        self.stream
            .clone_htod(x)
            .map_err(|e| driver_err("cuMemcpyHtoD", e))
    }

    fn download(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>, ExecError> {
        self.stream
            .clone_dtoh(x)
            .map_err(|e| driver_err("cuMemcpyDtoH", e))
    }

    /// Row-major `c[m×n] = a[m×k] · b[k×n]` on device buffers: cuBLAS is column-major, so
    /// this computes `cᵀ = bᵀ · aᵀ`, which has the same memory layout.
    fn sgemm_device(
        &self,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
        (m, k, n): (usize, usize, usize),
    ) -> Result<(), ExecError> {
        let dim = |x: usize| {
            i32::try_from(x).map_err(|_| ExecError::Backend {
                backend: "cuda",
                message: format!("matrix dimension {x} exceeds cuBLAS's 32-bit sizes"),
            })
        };
        if a.len() != m * k || b.len() != k * n || c.len() != m * n {
            return Err(ExecError::Backend {
                backend: "cuda",
                message: format!(
                    "sgemm {m}×{k}·{k}×{n}: buffers of {}, {} and {} values",
                    a.len(),
                    b.len(),
                    c.len()
                ),
            });
        }
        let (cm, cn, ck) = (dim(n)?, dim(m)?, dim(k)?);
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: cm,
            n: cn,
            k: ck,
            alpha: 1.0f32,
            lda: cm,
            ldb: ck,
            beta: 0.0f32,
            ldc: cm,
        };
        // Column-major operands: bᵀ (n×k, leading dimension n) times aᵀ (k×m, leading k).
        ffi::sgemm(&self.blas, cfg, b, a, c).map_err(|e| ExecError::Backend {
            backend: "cuda",
            message: format!("cublasSgemm: {e:?}"),
        })
    }

    /// Row-major `a[m×k] · b[k×n]`, copying through the host (for tests and small calls).
    pub fn sgemm(
        &self,
        a: &[f32],
        b: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, ExecError> {
        let (da, db) = (self.upload(a)?, self.upload(b)?);
        let mut dc = self
            .stream
            .alloc_zeros::<f32>(m * n)
            .map_err(|e| driver_err("cuMemAlloc", e))?;
        self.sgemm_device(&da, &db, &mut dc, (m, k, n))?;
        self.download(&dc)
    }

    /// Sustained sgemm throughput in FLOP/s for `m×k·k×n` on device-resident operands: one
    /// warm-up call, then the mean of `iters` calls between two stream synchronisations.
    pub fn sgemm_flops(&self, m: usize, k: usize, n: usize, iters: u32) -> Result<f64, ExecError> {
        let a = self.upload(&vec![1.0f32; m * k])?;
        let b = self.upload(&vec![1.0f32; k * n])?;
        let mut c = self
            .stream
            .alloc_zeros::<f32>(m * n)
            .map_err(|e| driver_err("cuMemAlloc", e))?;
        self.sgemm_device(&a, &b, &mut c, (m, k, n))?;
        let sync = |s: &CudaStream| {
            s.synchronize()
                .map_err(|e| driver_err("cuStreamSynchronize", e))
        };
        sync(&self.stream)?;
        let t0 = Instant::now();
        for _ in 0..iters.max(1) {
            self.sgemm_device(&a, &b, &mut c, (m, k, n))?;
        }
        sync(&self.stream)?;
        let secs = t0.elapsed().as_secs_f64() / f64::from(iters.max(1));
        Ok(2.0 * (m * k * n) as f64 / secs.max(1e-12))
    }

    /// One Adam step (`t` is the 1-based step) on host arrays through the NVRTC kernel, with
    /// the executor's bias correction: the same arithmetic as the CPU update.
    pub fn adam_step(
        &self,
        cfg: &AdamConfig,
        t: u64,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), ExecError> {
        let n = p.len();
        if g.len() != n || m.len() != n || v.len() != n {
            return Err(ExecError::Backend {
                backend: "cuda",
                message: format!(
                    "adam: lengths {n}, {}, {}, {} differ",
                    g.len(),
                    m.len(),
                    v.len()
                ),
            });
        }
        let n32 = u32::try_from(n).map_err(|_| ExecError::Backend {
            backend: "cuda",
            message: format!("adam: {n} elements exceed one launch"),
        })?;
        let bc1 = (1.0 - f64::from(cfg.beta1).powf(t as f64)) as f32;
        let bc2 = (1.0 - f64::from(cfg.beta2).powf(t as f64)) as f32;
        let (mut dp, dg, mut dm, mut dv) = (
            self.upload(p)?,
            self.upload(g)?,
            self.upload(m)?,
            self.upload(v)?,
        );
        ffi::launch_adam(
            &self.stream,
            &self.adam,
            &mut dp,
            &dg,
            &mut dm,
            &mut dv,
            [cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, bc1, bc2],
            n32,
        )
        .map_err(|e| driver_err("cuLaunchKernel", e))?;
        p.copy_from_slice(&self.download(&dp)?);
        m.copy_from_slice(&self.download(&dm)?);
        v.copy_from_slice(&self.download(&dv)?);
        Ok(())
    }
}

/// Checks the backend can start (driver present, a device visible) and then says what is
/// missing: the GPU trainer itself. Called by [`crate::run`] for `Backend::Cuda`.
pub fn run_unavailable() -> ExecError {
    match probe() {
        Err(e) => e,
        Ok(devices) => ExecError::Backend {
            backend: "cuda",
            message: format!(
                "found {} GPU(s) ({}), but the GPU trainer is not implemented yet (device probe, \
                 cuBLAS sgemm, the NVRTC Adam kernel and NCCL rendezvous exist); use --backend \
                 threads or mpi",
                devices.len(),
                devices.first().map_or(String::new(), |d| d.name.clone())
            ),
        },
    }
}

#[cfg(feature = "nccl")]
pub use nccl_impl::nccl_rendezvous;

#[cfg(feature = "nccl")]
mod nccl_impl {
    use super::{require, ExecError, Lib};
    use cudarc::driver::CudaStream;
    use cudarc::nccl::{Comm, Id};
    use std::path::Path;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Bytes of an NCCL unique id.
    const ID_BYTES: usize = 128;

    /// Creates this rank's NCCL communicator over `world` ranks. Rank 0 makes the unique id
    /// and publishes it atomically (write to a temporary file, then rename) at `path`, which
    /// every rank can read (a shared file system across nodes); the others wait for the file
    /// up to `timeout` and fail naming rank 0 if it never appears. The caller removes the
    /// file after the run.
    pub fn nccl_rendezvous(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        path: &Path,
        timeout: Duration,
    ) -> Result<Comm, ExecError> {
        require(Lib::Nccl)?;
        let err = |message: String| ExecError::Backend {
            backend: "cuda",
            message,
        };
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| err(format!("ncclGetUniqueId: {e:?}")))?;
            let bytes: Vec<u8> = id.internal().iter().map(|c| *c as u8).collect();
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, &bytes)
                .and_then(|()| std::fs::rename(&tmp, path))
                .map_err(|e| {
                    err(format!(
                        "cannot publish the NCCL id at {}: {e}",
                        path.display()
                    ))
                })?;
            id
        } else {
            let t0 = Instant::now();
            loop {
                match std::fs::read(path) {
                    Ok(b) if b.len() == ID_BYTES => {
                        let mut internal = [0 as std::ffi::c_char; ID_BYTES];
                        for (d, s) in internal.iter_mut().zip(&b) {
                            *d = *s as std::ffi::c_char;
                        }
                        break Id::uninit(internal);
                    }
                    _ if t0.elapsed() >= timeout => {
                        return Err(ExecError::Rank {
                            rank: 0,
                            message: format!(
                                "stopped responding: rank {rank} waited {:.1} s for the NCCL id \
                                 at {}",
                                t0.elapsed().as_secs_f64(),
                                path.display()
                            ),
                        })
                    }
                    _ => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        };
        Comm::from_rank(stream, rank, world, id)
            .map_err(|e| err(format!("ncclCommInitRank: {e:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::mm;

    /// Where a device test runs (candle's `test_device!` pattern): the CPU kernels, or GPU 0.
    enum Dev {
        Cpu,
        Cuda(Box<Gpu>),
    }

    impl Dev {
        fn sgemm(&self, a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
            match self {
                Dev::Cpu => {
                    let mut c = vec![0.0f32; m * n];
                    mm(&mut c, a, b, m, k, n, false);
                    c
                }
                Dev::Cuda(g) => g.sgemm(a, b, m, k, n).unwrap(),
            }
        }

        #[allow(clippy::too_many_arguments)]
        fn adam(
            &self,
            cfg: &AdamConfig,
            t: u64,
            p: &mut [f32],
            g: &[f32],
            m: &mut [f32],
            v: &mut [f32],
        ) {
            match self {
                Dev::Cpu => {
                    // The executor's CPU update (engine.rs), element by element.
                    let bc1 = (1.0 - f64::from(cfg.beta1).powf(t as f64)) as f32;
                    let bc2 = (1.0 - f64::from(cfg.beta2).powf(t as f64)) as f32;
                    for i in 0..p.len() {
                        m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * g[i];
                        v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * g[i] * g[i];
                        p[i] -= cfg.lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + cfg.eps);
                    }
                }
                Dev::Cuda(gpu) => gpu.adam_step(cfg, t, p, g, m, v).unwrap(),
            }
        }
    }

    /// A `cpu` and a `cuda` variant of a device test; the `cuda` one prints why it is
    /// skipped when no GPU is usable.
    macro_rules! test_device {
        ($($name:ident),* $(,)?) => {$(
            mod $name {
                #[test]
                fn cpu() {
                    super::$name(&super::Dev::Cpu);
                }
                #[test]
                fn cuda() {
                    match super::Gpu::open(0) {
                        Ok(g) => super::$name(&super::Dev::Cuda(Box::new(g))),
                        Err(e) => eprintln!(
                            "skipped {}::cuda: no usable GPU ({e})",
                            stringify!($name)
                        ),
                    }
                }
            }
        )*};
    }

    test_device!(sgemm_matches_f64_reference, adam_matches_f64_reference);

    fn sgemm_matches_f64_reference(dev: &Dev) {
        let (m, k, n) = (37, 64, 29);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 5) % 11) as f32 * 0.1 - 0.5)
            .collect();
        let got = dev.sgemm(&a, &b, m, k, n);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|l| f64::from(a[i * k + l]) * f64::from(b[l * n + j]))
                    .sum();
                let x = f64::from(got[i * n + j]);
                assert!(
                    (x - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "({i},{j}): {x} vs {want}"
                );
            }
        }
    }

    fn adam_matches_f64_reference(dev: &Dev) {
        let cfg = AdamConfig::default();
        let n = 1000;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut p, mut m, mut v) = (vec![0.5f32; n], vec![0.01f32; n], vec![0.02f32; n]);
        dev.adam(&cfg, 3, &mut p, &g, &mut m, &mut v);
        let (b1, b2) = (f64::from(cfg.beta1), f64::from(cfg.beta2));
        for i in 0..n {
            let gi = f64::from(g[i]);
            let mi = b1 * 0.01 + (1.0 - b1) * gi;
            let vi = b2 * 0.02 + (1.0 - b2) * gi * gi;
            let step = f64::from(cfg.lr) * (mi / (1.0 - b1.powi(3)))
                / ((vi / (1.0 - b2.powi(3))).sqrt() + f64::from(cfg.eps));
            assert!(
                (f64::from(p[i]) - (0.5 - step)).abs() <= 1e-6,
                "{i}: {} vs {}",
                p[i],
                0.5 - step
            );
            assert!((f64::from(m[i]) - mi).abs() <= 1e-6 && (f64::from(v[i]) - vi).abs() <= 1e-6);
        }
    }

    #[test]
    fn probe_is_an_error_or_a_device_list_never_a_panic() {
        match probe() {
            Ok(devices) => assert!(!devices.is_empty()),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("cuda backend: "), "{msg}");
                eprintln!("no GPU here: {msg}");
            }
        }
        let e = run_unavailable().to_string();
        assert!(e.contains("cuda backend"), "{e}");
    }

    #[test]
    fn sgemm_throughput_is_reported_on_a_gpu() {
        match Gpu::open(0) {
            Ok(gpu) => {
                let flops = gpu.sgemm_flops(1024, 1024, 1024, 10).unwrap();
                assert!(flops > 0.0);
                eprintln!(
                    "{}: sgemm 1024^3 {:.1} TFLOP/s",
                    gpu.info().name,
                    flops / 1e12
                );
            }
            Err(e) => {
                eprintln!("skipped sgemm_throughput_is_reported_on_a_gpu: no usable GPU ({e})")
            }
        }
    }
}
