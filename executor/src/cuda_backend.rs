//! The `cuda` backend (features `cuda`, `nccl`): one rank per GPU.
//!
//! Ranks are threads of this process, rank `r` on GPU `r` ([`run`]), or, under `mpirun` with
//! feature `mpi`, processes on any number of nodes, each on the GPU of its index among its
//! node's processes ([`run_mpi`]). The trainer is the executor's own (`engine.rs`,
//! host-resident fp32 parameters and activations); through the [`DeviceOffload`] hook every
//! GEMM of at least 4 MFLOP (smaller ones stay on the CPU) runs in cuBLAS on
//! the rank's GPU and the Adam update in an NVRTC kernel (operands are copied to the device
//! and the results back), and, with feature `nccl`, every collective runs in NCCL on
//! per-group communicators bootstrapped over the host backend ([`NcclCollectives`];
//! point-to-point pipeline messages stay on the host backend). Pointwise kernels and the
//! attention softmax run on the host. `calibrate --backend cuda` measures the GPUs
//! ([`calibrate`]): cuBLAS sgemm over sizes, device copy bandwidth, the NVRTC Adam kernel's
//! bandwidth, NCCL all-reduce.
//!
//! CUDA libraries are loaded at run time (cudarc `dynamic-loading`), so a build needs no CUDA
//! toolkit, and a machine without a GPU gets a typed error with a fix-it message instead of a
//! panic — tract's `is_culib_present` pattern. The column-major GEMM mapping is checked on
//! the host against an emulation of cuBLAS's `sgemm` (`tensor.rs` tests); everything that
//! needs a device skips its test with a message when none is found. CI has no GPU; the device
//! tests and `calibrate --backend cuda` first ran on one H200 on 2026-11-26 (README, Backends),
//! the two-GPU run and NCCL across GPUs have not run yet.

use crate::calibrate::{
    host_adam_params_per_s, AllReduceTimes, ComputeFigures, HostFigures, HostLink, MeasuredDevice,
    Measurements,
};
use crate::engine::{AdamConfig, RankReport};
use crate::error::ExecError;
use crate::tensor::{set_device_offload, span, ColMajorGemm, ColMajorOperand, DeviceOffload};
use crate::{run_threads_with, RunReport, RunSpec};
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
        // SAFETY: `Gpu::gemm_device` checks that each buffer holds at least the elements its
        // column-major matrix spans for the shapes, ops and leading dimensions in `cfg`, so
        // cuBLAS reads and writes only inside the three allocations.
        unsafe { blas.gemm(cfg, a, b, c) }
    }

    /// Column-major `c = a · b` in fp16 (fp32 accumulation, cublasGemmEx) on device buffers
    /// whose lengths the caller checked against the configuration.
    pub(super) fn hgemm(
        blas: &CudaBlas,
        cfg: GemmConfig<half::f16>,
        a: &CudaSlice<half::f16>,
        b: &CudaSlice<half::f16>,
        c: &mut CudaSlice<half::f16>,
    ) -> Result<(), cudarc::cublas::result::CublasError> {
        // SAFETY: `Gpu::hgemm_flops` allocates each buffer with exactly the elements of its
        // dense column-major matrix (leading dimension = rows, no transposes), so cuBLAS
        // reads and writes only inside the three allocations.
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
    /// Streaming multiprocessors.
    pub sm_count: u32,
}

/// A failure of this backend with `message`.
fn cuda_err(message: String) -> ExecError {
    ExecError::Backend {
        backend: "cuda",
        message,
    }
}

/// `x` as one of cuBLAS's 32-bit extents.
fn cublas_dim(x: usize) -> Result<i32, ExecError> {
    i32::try_from(x).map_err(|_| cuda_err(format!("{x} exceeds cuBLAS's 32-bit sizes")))
}

fn driver_err(what: &str, e: DriverError) -> ExecError {
    cuda_err(format!("{what}: {e:?}"))
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
    let (stem, what) = match lib {
        #[cfg(feature = "nccl")]
        Lib::Nccl => ("libnccl", "NCCL (packages libnccl2 and libnccl-dev)"),
        _ => LIBRARIES
            .iter()
            .find(|(l, _, _)| *l == lib)
            .map_or(("a CUDA library", "it"), |(_, n, w)| (*n, *w)),
    };
    let found = find_library(stem, &library_folders());
    Err(ExecError::Backend {
        backend: "cuda",
        message: missing_library_message(stem, what, &found),
    })
}

/// Folders where CUDA libraries are usually installed: `$CUDA_HOME`, `$CUDA_PATH`, each
/// `/usr/local/cuda*` toolkit, and the system library folders.
fn library_folders() -> Vec<std::path::PathBuf> {
    use std::path::PathBuf;
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .collect();
    if let Ok(dir) = std::fs::read_dir("/usr/local") {
        let mut toolkits: Vec<PathBuf> = dir
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda"))
            })
            .collect();
        toolkits.sort();
        roots.extend(toolkits);
    }
    let mut folders: Vec<PathBuf> = roots
        .iter()
        .flat_map(|r| {
            [
                r.join("lib64"),
                r.join("lib"),
                r.join("targets/x86_64-linux/lib"),
                r.join("targets/sbsa-linux/lib"),
            ]
        })
        .collect();
    folders.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        ]
        .map(PathBuf::from),
    );
    folders
}

/// Files named `{stem}.so` or `{stem}.so.N…` in `folders`, in folder order.
fn find_library(stem: &str, folders: &[std::path::PathBuf]) -> Vec<std::path::PathBuf> {
    let so = format!("{stem}.so");
    let mut found = Vec::new();
    for folder in folders {
        let Ok(dir) = std::fs::read_dir(folder) else {
            continue;
        };
        let mut here: Vec<_> = dir
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n == so || n.strip_prefix(&so).is_some_and(|v| v.starts_with('.'))
                })
            })
            .collect();
        here.sort();
        found.extend(here);
    }
    found
}

/// What to do when `stem` could not be loaded, given the copies of it `found` on disk: add the
/// folder of a loadable name to LD_LIBRARY_PATH, or link a version cudarc does not try as
/// `{stem}.so`.
fn missing_library_message(stem: &str, what: &str, found: &[std::path::PathBuf]) -> String {
    // The file names cudarc tries (`{stem}.so`, `.so.12`, …; not CUDA 13's `.so.13` nor
    // NCCL's `.so.2`, which load through a `{stem}.so` link).
    let names = cudarc::get_lib_name_candidates(stem.trim_start_matches("lib"));
    let loadable = |p: &std::path::Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| names.iter().any(|c| c == n))
    };
    let mut tried: Vec<&str> = Vec::new();
    for n in names
        .iter()
        .filter(|n| n.starts_with(&format!("{stem}.so")))
    {
        if !tried.contains(&n.as_str()) {
            tried.push(n);
        }
    }
    let tried = tried.join(", ");
    if let Some(p) = found.iter().find(|p| loadable(p)) {
        let folder = p.parent().unwrap_or(p).display();
        format!(
            "{stem} could not be loaded ({tried}); {} is installed: add {folder} to \
             LD_LIBRARY_PATH",
            p.display()
        )
    } else if let Some(p) = found.first() {
        format!(
            "{stem} could not be loaded ({tried}); {} is installed under another name: link \
             it, e.g. `mkdir -p ~/.parallax/lib && ln -s {} ~/.parallax/lib/{stem}.so`, and \
             add that folder to LD_LIBRARY_PATH",
            p.display(),
            p.display()
        )
    } else {
        format!(
            "{stem} could not be loaded ({tried}): install {what}, or add the folder that \
             holds it to LD_LIBRARY_PATH"
        )
    }
}

/// Finds the CUDA devices of this machine. Errors (typed, with a fix-it message) when the
/// driver library is missing or sees no device.
pub fn probe() -> Result<Vec<DeviceInfo>, ExecError> {
    (0..device_count()?)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtxCreate", e))?;
            device_info(ordinal, &ctx)
        })
        .collect()
}

/// The number of GPUs the driver sees (at least one, else an error saying how to fix it).
fn device_count() -> Result<usize, ExecError> {
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
    Ok(count as usize)
}

/// What the driver says of the device of `ctx`.
fn device_info(ordinal: usize, ctx: &CudaContext) -> Result<DeviceInfo, ExecError> {
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name().map_err(|e| driver_err("cuDeviceGetName", e))?,
        total_mem_bytes: ctx
            .total_mem()
            .map_err(|e| driver_err("cuDeviceTotalMem", e))? as u64,
        compute_capability: ctx
            .compute_capability()
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))?,
        sm_count: ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))?
            .max(0) as u32,
    })
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
        let count = device_count()?;
        if ordinal >= count {
            return Err(ExecError::Backend {
                backend: "cuda",
                message: format!("GPU {ordinal} does not exist (this machine has {count})"),
            });
        }
        require(Lib::Cublas)?;
        require(Lib::Nvrtc)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtxCreate", e))?;
        let info = device_info(ordinal, &ctx)?;
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

    /// The column-major call `plan` on device buffers holding exactly the operands' ranges;
    /// `beta` 1 accumulates into `c`, 0 overwrites the view's elements (and no others).
    fn gemm_device(
        &self,
        plan: &ColMajorGemm,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
        beta: f32,
    ) -> Result<(), ExecError> {
        // Elements the column-major `rows × cols` operand (stored transposed when `trans`)
        // spans: element (i, j) sits at i + j·ld, or at j + i·ld transposed.
        let stored = |o: &ColMajorOperand, rows: usize, cols: usize| {
            if o.trans {
                span(0, rows, cols, o.ld, 1)
            } else {
                span(0, rows, cols, 1, o.ld)
            }
        };
        let (m, n, k) = (plan.m, plan.n, plan.k);
        let need = [
            ("A", stored(&plan.a, m, k), a.len()),
            ("B", stored(&plan.b, k, n), b.len()),
            ("C", span(0, m, n, 1, plan.c.ld), c.len()),
        ];
        for (name, want, have) in need {
            if have < want {
                return Err(cuda_err(format!(
                    "sgemm {m}×{k}·{k}×{n}: operand {name} has {have} values, needs {want}"
                )));
            }
        }
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let cfg = GemmConfig {
            transa: op(plan.a.trans),
            transb: op(plan.b.trans),
            m: cublas_dim(m)?,
            n: cublas_dim(n)?,
            k: cublas_dim(k)?,
            alpha: 1.0f32,
            lda: cublas_dim(plan.a.ld)?,
            ldb: cublas_dim(plan.b.ld)?,
            beta,
            ldc: cublas_dim(plan.c.ld)?,
        };
        ffi::sgemm(&self.blas, cfg, a, b, c).map_err(|e| cuda_err(format!("cublasSgemm: {e:?}")))
    }

    /// Row-major `c[m×n] = a[m×k] · b[k×n]` on dense device buffers.
    fn sgemm_device(
        &self,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
        (m, k, n): (usize, usize, usize),
    ) -> Result<(), ExecError> {
        let operand = |len: usize, ld: usize| ColMajorOperand {
            range: 0..len,
            trans: false,
            ld: ld.max(1),
        };
        // cᵀ = bᵀ · aᵀ in column-major terms (see `tensor::ColMajorGemm`).
        let plan = ColMajorGemm {
            m: n,
            n: m,
            k,
            a: operand(k * n, n),
            b: operand(m * k, k),
            c: operand(m * n, n),
        };
        self.gemm_device(&plan, b, a, c, 0.0)
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
        let secs = self.timed(iters, || self.sgemm_device(&a, &b, &mut c, (m, k, n)))?;
        Ok(2.0 * (m * k * n) as f64 / secs)
    }

    /// Sustained fp16 tensor-core GEMM throughput in FLOP/s for `m×k·k×n` (cublasGemmEx,
    /// fp32 accumulation) on device-resident operands, timed as [`Gpu::sgemm_flops`]. The
    /// operands hold varied values, not zeros: a GEMM of zeros draws less power and runs at
    /// higher clocks (an H200 ran 8192³ in bf16 at 894 TFLOP/s on zeros, 788 on random data).
    pub fn hgemm_flops(&self, m: usize, k: usize, n: usize, iters: u32) -> Result<f64, ExecError> {
        let values = |len: usize| -> Vec<half::f16> {
            (0..len)
                .map(|i| half::f16::from_f32(((i * 7919) % 251) as f32 / 251.0 - 0.5))
                .collect()
        };
        let upload = |x: Vec<half::f16>| {
            self.stream
                .clone_htod(&x)
                .map_err(|e| driver_err("cuMemcpyHtoD", e))
        };
        let (a, b) = (upload(values(m * k))?, upload(values(k * n))?);
        let mut c = self
            .stream
            .alloc_zeros::<half::f16>(m * n)
            .map_err(|e| driver_err("cuMemAlloc", e))?;
        // Column-major m×k times k×n, each with its rows as leading dimension.
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: cublas_dim(m)?,
            n: cublas_dim(n)?,
            k: cublas_dim(k)?,
            alpha: half::f16::ONE,
            lda: cublas_dim(m)?,
            ldb: cublas_dim(k)?,
            beta: half::f16::ZERO,
            ldc: cublas_dim(m)?,
        };
        let secs = self.timed(iters, || {
            ffi::hgemm(&self.blas, cfg, &a, &b, &mut c)
                .map_err(|e| cuda_err(format!("cublasGemmEx (fp16): {e:?}")))
        })?;
        Ok(2.0 * (m * k * n) as f64 / secs)
    }

    /// Device-to-device copy bandwidth (bytes read + written per second) over `elems` floats.
    pub fn copy_bytes_per_s(&self, elems: usize, iters: u32) -> Result<f64, ExecError> {
        let src = self
            .stream
            .alloc_zeros::<f32>(elems)
            .map_err(|e| driver_err("cuMemAlloc", e))?;
        let mut dst = self
            .stream
            .alloc_zeros::<f32>(elems)
            .map_err(|e| driver_err("cuMemAlloc", e))?;
        let secs = self.timed(iters, || {
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| driver_err("cuMemcpyDtoD", e))
        })?;
        Ok((elems * 8) as f64 / secs)
    }

    /// Bandwidth of the NVRTC Adam kernel over `elems` device-resident values (28 bytes per
    /// element: parameters, gradients and both moments read, three written).
    pub fn adam_bytes_per_s(&self, elems: usize, iters: u32) -> Result<f64, ExecError> {
        let n = u32::try_from(elems).map_err(|_| ExecError::Backend {
            backend: "cuda",
            message: format!("adam: {elems} elements exceed one launch"),
        })?;
        let alloc = || {
            self.stream
                .alloc_zeros::<f32>(elems)
                .map_err(|e| driver_err("cuMemAlloc", e))
        };
        let (mut p, g, mut m, mut v) = (alloc()?, alloc()?, alloc()?, alloc()?);
        let hyper = [1e-3, 0.9, 0.95, 1e-8, 0.1, 0.05];
        let secs = self.timed(iters, || {
            ffi::launch_adam(
                &self.stream,
                &self.adam,
                &mut p,
                &g,
                &mut m,
                &mut v,
                hyper,
                n,
            )
            .map_err(|e| driver_err("cuLaunchKernel", e))
        })?;
        Ok((elems * 28) as f64 / secs)
    }

    /// Mean seconds of `f` over `iters` calls between two synchronisations, after one warm-up.
    fn timed(
        &self,
        iters: u32,
        f: impl FnMut() -> Result<(), ExecError>,
    ) -> Result<f64, ExecError> {
        timed_on(&self.stream, iters, f)
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
        self.adam_corrected(cfg, cfg.bias_corrections(t), p, g, m, v)
    }

    /// [`Gpu::adam_step`] with the bias corrections given.
    fn adam_corrected(
        &self,
        cfg: &AdamConfig,
        (bc1, bc2): (f32, f32),
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
        for (d, h) in [(&dp, p), (&dm, m), (&dv, v)] {
            self.stream
                .memcpy_dtoh(d, h)
                .map_err(|e| driver_err("cuMemcpyDtoH", e))?;
        }
        self.stream
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e))
    }
}

/// Smallest GEMM the GPU takes: each one uploads its operands, downloads the result and
/// synchronizes (tens of µs over PCIe), in which a CPU core runs a few MFLOP.
const GPU_MIN_FLOPS: usize = 1 << 22;

impl DeviceOffload for Gpu {
    fn min_flops(&self) -> usize {
        GPU_MIN_FLOPS
    }

    fn gemm(
        &self,
        plan: &ColMajorGemm,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<bool, String> {
        // `c` is uploaded when accumulating, and when its range holds elements outside the
        // view (a strided output), which must come back unchanged; else only allocated.
        let dense_c = plan.c.range.len() == plan.m * plan.n;
        let mut run = || -> Result<(), ExecError> {
            let dc = if accumulate || !dense_c {
                self.upload(c)?
            } else {
                self.stream
                    .alloc_zeros::<f32>(c.len())
                    .map_err(|e| driver_err("cuMemAlloc", e))?
            };
            let (da, db, mut dc) = (self.upload(a)?, self.upload(b)?, dc);
            self.gemm_device(plan, &da, &db, &mut dc, if accumulate { 1.0 } else { 0.0 })?;
            self.stream
                .memcpy_dtoh(&dc, c)
                .and_then(|()| self.stream.synchronize())
                .map_err(|e| driver_err("cuMemcpyDtoH", e))
        };
        run().map(|()| true).map_err(|e| e.to_string())
    }

    fn adam(
        &self,
        cfg: &AdamConfig,
        bc: (f32, f32),
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) -> Result<bool, String> {
        if p.is_empty() {
            return Ok(true);
        }
        self.adam_corrected(cfg, bc, p, g, m, v)
            .map(|()| true)
            .map_err(|e| e.to_string())
    }
}

/// Whether this machine has a GPU for each of the `world` ranks a `what` (layout or
/// plan) needs.
fn enough_gpus(world: usize, what: &str) -> Result<(), ExecError> {
    let gpus = device_count()?;
    if world > gpus {
        return Err(ExecError::Backend {
            backend: "cuda",
            message: format!(
                "the {what} needs {world} ranks, one GPU each, but this machine has {gpus}; use \
                 a smaller {what} or --backend threads|mpi"
            ),
        });
    }
    Ok(())
}

/// Runs `spec` with one thread per rank, rank `r` on GPU `r`: GEMMs on the GPU through
/// cuBLAS, collectives through NCCL (feature `nccl`; host channels without it). Needs as many
/// GPUs as the layout has ranks.
pub fn run(spec: &RunSpec) -> Result<RunReport, ExecError> {
    let world = spec.layout.devices() as usize;
    enough_gpus(world, "layout")?;
    run_threads_with(spec, &|spec, prep, comm, epoch| {
        let ordinal = crate::Collectives::rank(comm);
        train_on_gpu(ordinal, spec, prep, comm, epoch)
    })
}

/// One rank's training on GPU `ordinal`: its GEMMs and Adam through the GPU, its collectives
/// through NCCL bootstrapped over `comm` (over `comm` itself without feature `nccl`).
fn train_on_gpu<C: crate::Collectives>(
    ordinal: usize,
    spec: &RunSpec,
    prep: &crate::Prepared,
    comm: &mut C,
    epoch: Instant,
) -> Result<RankReport, ExecError> {
    on_gpu(ordinal, comm, spec.timeout, &mut |c| {
        crate::engine::run_rank(spec, prep, c, epoch)
    })
}

/// Runs `train` on GPU `ordinal`: every GEMM (and Adam) of this thread offloaded to it, the
/// collectives through NCCL bootstrapped over `comm` (`comm` itself without feature `nccl`).
fn on_gpu<C: crate::Collectives>(
    ordinal: usize,
    comm: &mut C,
    timeout: std::time::Duration,
    train: &mut dyn FnMut(&mut dyn crate::Collectives) -> Result<RankReport, ExecError>,
) -> Result<RankReport, ExecError> {
    #[cfg(feature = "nccl")]
    require(Lib::Nccl)?;
    let gpu = std::rc::Rc::new(Gpu::open(ordinal)?);
    set_device_offload(Some(gpu.clone()));
    let r = {
        #[cfg(feature = "nccl")]
        {
            let mut c = NcclCollectives::new(comm, gpu.stream.clone(), timeout);
            train(&mut c)
        }
        #[cfg(not(feature = "nccl"))]
        {
            let _ = timeout;
            train(comm)
        }
    };
    set_device_offload(None);
    r
}

/// Runs a per-op plan of any graph (the general-graph trainer) with one thread per device of
/// the plan, device `r` on GPU `r`: its GEMMs (convolutions as im2col GEMMs, recurrences,
/// attention, linear layers) through cuBLAS and its collectives through NCCL; the other
/// kernels on the host, as the transformer trainer's.
pub fn run_graph(spec: &crate::graph::GraphRunSpec) -> Result<RunReport, ExecError> {
    let prep = crate::graph::GraphPrepared::new(spec)?;
    let world = prep.world();
    enough_gpus(world, "plan")?;
    let epoch = Instant::now();
    crate::spawn_ranks(world, spec.timeout, &|comm| {
        let ordinal = crate::Collectives::rank(comm);
        on_gpu(ordinal, comm, spec.timeout, &mut |c| {
            crate::graph::run_graph_rank(spec, &prep, c, epoch)
        })
    })
}

/// Runs `spec` with this MPI process as its rank (`mpirun -np N parallax run … --backend
/// cuda`, on one or more nodes): the process drives the GPU of its index among the processes
/// of its node; NCCL communicators are bootstrapped over MPI, so groups span nodes.
#[cfg(feature = "mpi")]
pub fn run_mpi(
    rt: &mut crate::mpi_backend::MpiRuntime,
    spec: &RunSpec,
) -> Result<RunReport, ExecError> {
    let local = rt.local_rank();
    let gpus = device_count()?;
    if local >= gpus {
        return Err(ExecError::Backend {
            backend: "cuda",
            message: format!(
                "rank {} is process {local} on its node, which has {gpus} GPU(s): start at most \
                 one process per GPU on each node",
                rt.rank()
            ),
        });
    }
    rt.run_with(spec, &|spec, prep, comm, epoch| {
        train_on_gpu(local, spec, prep, comm, epoch)
    })
}

/// Calibrates this machine's GPUs: cuBLAS sgemm and fp16 tensor-core GEMM throughput over
/// sizes on GPU 0, its device copy bandwidth and the bandwidth of the NVRTC Adam kernel (the
/// pointwise figure), and, with feature `nccl` and two or more GPUs, NCCL all-reduce
/// bandwidth and latency across all of them (one thread per GPU).
pub fn calibrate(quick: bool) -> Result<Measurements, ExecError> {
    let n = device_count()?;
    let gpu = Gpu::open(0)?;
    let iters = if quick { 3 } else { 20 };
    let sizes: &[usize] = if quick {
        &[256, 1024, 2048]
    } else {
        &[256, 512, 1024, 2048, 4096, 8192]
    };
    let mut matmul = Vec::new();
    for &s in sizes {
        let flops = 2.0 * (s * s * s) as f64;
        matmul.push((flops, gpu.sgemm_flops(s, s, s, iters)?));
    }
    // Training runs its GEMMs on the tensor cores in 16 bits; a GPU without fp16 GEMMs in
    // cuBLAS (none since Pascal) leaves the curve to sgemm.
    let tensor_matmul = sizes
        .iter()
        .map(|&s| Ok((2.0 * (s * s * s) as f64, gpu.hgemm_flops(s, s, s, iters)?)))
        .collect::<Result<Vec<_>, ExecError>>()
        .unwrap_or_else(|e| {
            eprintln!("calibrate: no fp16 GEMM measured ({e}); the curve is sgemm's");
            Vec::new()
        });
    let elems: usize = if quick { 1 << 24 } else { 1 << 26 };
    let copy = gpu.copy_bytes_per_s(elems, iters)?;
    let pointwise = gpu.adam_bytes_per_s(elems, iters)?;
    let op_overhead = {
        // One tiny GEMM: launch and dispatch cost.
        let f = gpu.sgemm_flops(8, 8, 8, 100)?;
        2.0 * 512.0 / f
    };
    let intra = collective_times(n, quick)?.map(|t| t.fit(n));
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let host = HostFigures {
        cores,
        adam_params_per_s: host_adam_params_per_s(cores, quick),
        link: Some(host_link(n, quick)?),
    };
    Ok(Measurements {
        backend: "cuda",
        threads: n,
        compute: ComputeFigures {
            matmul,
            tensor_matmul,
            copy_bytes_per_s: copy,
            pointwise_bytes_per_s: pointwise,
            pointwise_curve: Vec::new(),
            graph_kernels: Vec::new(),
            transformer_kernels: Vec::new(),
            op_overhead_s: op_overhead,
            // Special-function units: pointwise kernels stay memory-bound on a GPU.
            transcendentals_per_s: None,
            tanh_per_s: None,
            // A GPU's op calls are its kernel launches (`op_overhead_s`).
            graph_call_s: 0.0,
        },
        intra,
        inter: None,
        device: Some(MeasuredDevice {
            name: gpu.info().name.clone(),
            mem_gib: gpu.info().total_mem_bytes as f64 / f64::from(1u32 << 30),
            sm_count: Some(gpu.info().sm_count),
        }),
        host: Some(host),
        nvme: None,
    })
}

/// Copy rates between each of the `n` GPUs and pinned host memory, every GPU copying the same
/// way at once (they share the host's root complexes and memory, as an offloaded step's
/// transfers do): the slowest GPU's, each direction.
fn host_link(n: usize, quick: bool) -> Result<HostLink, ExecError> {
    let bytes: usize = if quick { 64 << 20 } else { 512 << 20 };
    let iters = if quick { 3 } else { 10 };
    let barrier = std::sync::Barrier::new(n);
    let rates = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|ordinal| {
                let barrier = &barrier;
                s.spawn(move || one_host_link(ordinal, bytes, iters, barrier))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(cuda_err("a host-link timing thread panicked".into())))
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    let slowest = |f: fn(&(f64, f64)) -> f64| rates.iter().map(f).fold(f64::INFINITY, f64::min);
    Ok(HostLink {
        h2d_bytes_per_s: slowest(|r| r.0),
        d2h_bytes_per_s: slowest(|r| r.1),
    })
}

/// GPU `ordinal`'s copy rates of `bytes` to and from pinned host memory, (host to device,
/// device to host) bytes per second, each direction timed while the other GPUs copy the same
/// way: `barrier` holds them together, and this GPU reaches it twice whether or not its setup
/// worked, so none waits for ever.
fn one_host_link(
    ordinal: usize,
    bytes: usize,
    iters: u32,
    barrier: &std::sync::Barrier,
) -> Result<(f64, f64), ExecError> {
    let setup = || {
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtxCreate", e))?;
        let stream = ctx.default_stream();
        let len = bytes / 4;
        // SAFETY: the pinned buffer is never read on the host, only copied to and from by DMA
        // (its uninitialised bytes serve a timing as well as any).
        #[allow(unsafe_code)]
        let host = unsafe { ctx.alloc_pinned_with_flags::<f32>(len, 0) }
            .map_err(|e| driver_err("cuMemHostAlloc", e))?;
        let dev = stream
            .alloc_zeros::<f32>(len)
            .map_err(|e| driver_err("cuMemAlloc", e))?;
        Ok::<_, ExecError>((stream, host, dev))
    };
    let rate = |secs: f64| bytes as f64 / secs;
    let mut ready = setup();
    barrier.wait();
    let up = match &mut ready {
        Ok((stream, host, dev)) => timed_on(stream, iters, || {
            stream
                .memcpy_htod(&*host, dev)
                .map_err(|e| driver_err("cuMemcpyHtoD", e))
        })
        .map(rate),
        Err(_) => Ok(0.0),
    };
    barrier.wait();
    let down = match &mut ready {
        Ok((stream, host, dev)) => timed_on(stream, iters, || {
            stream
                .memcpy_dtoh(&*dev, host)
                .map_err(|e| driver_err("cuMemcpyDtoH", e))
        })
        .map(rate),
        Err(_) => Ok(0.0),
    };
    ready?;
    Ok((up?, down?))
}

/// Seconds one call of `f` (work queued on `stream`) takes: once to warm up, then `iters`
/// times between stream synchronisations.
fn timed_on(
    stream: &CudaStream,
    iters: u32,
    mut f: impl FnMut() -> Result<(), ExecError>,
) -> Result<f64, ExecError> {
    let sync = || {
        stream
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e))
    };
    f()?;
    sync()?;
    let t0 = Instant::now();
    for _ in 0..iters.max(1) {
        f()?;
    }
    sync()?;
    Ok((t0.elapsed().as_secs_f64() / f64::from(iters.max(1))).max(1e-12))
}

/// NCCL all-reduce times over all `n` GPUs (the slowest rank's), or `None` with one GPU or
/// without NCCL.
fn collective_times(n: usize, quick: bool) -> Result<Option<AllReduceTimes>, ExecError> {
    #[cfg(feature = "nccl")]
    if n > 1 {
        return nccl_impl::all_reduce_times(n, quick).map(Some);
    }
    let _ = (n, quick);
    Ok(None)
}

#[cfg(feature = "nccl")]
pub use nccl_impl::NcclCollectives;

#[cfg(feature = "nccl")]
mod nccl_impl {
    use super::{driver_err, require, AllReduceTimes, ExecError, Lib};
    use crate::comm::{expect_len, Collectives, CommError, Group};
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use cudarc::nccl::{Comm, Id, ReduceOp};
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// A rank's collectives over NCCL: one communicator per group, made when the group is
    /// first used and bootstrapped over the rank's host endpoint `inner` (the group's first
    /// member makes the NCCL unique id and broadcasts it: through shared memory with the
    /// threads backend, over MPI with the MPI backend, so communicators span nodes); host
    /// buffers are staged through the rank's GPU. Point-to-point messages, tags and failure
    /// checks go through `inner`.
    #[derive(Debug)]
    pub struct NcclCollectives<'a, C: Collectives + ?Sized> {
        inner: &'a mut C,
        stream: Arc<CudaStream>,
        comms: HashMap<Vec<usize>, Comm>,
        timeout: Duration,
    }

    // SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
    // overlap; `NcclCollectives` is owned by one rank and used through `&mut self` only, so
    // moving it to another thread cannot make calls overlap. The CUDA stream is `Send`, and
    // so is `inner` (`Collectives: Send`).
    #[allow(unsafe_code)]
    unsafe impl<C: Collectives + ?Sized> Send for NcclCollectives<'_, C> {}

    fn nccl_err(what: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> CommError + '_ {
        move |e| CommError::Backend(format!("{what}: {e:?}"))
    }

    fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> CommError + '_ {
        move |e| CommError::Backend(format!("{what}: {e:?}"))
    }

    impl<'a, C: Collectives + ?Sized> NcclCollectives<'a, C> {
        /// The collectives of the rank behind `inner`, on the GPU of `stream`.
        pub fn new(inner: &'a mut C, stream: Arc<CudaStream>, timeout: Duration) -> Self {
            NcclCollectives {
                inner,
                stream,
                comms: HashMap::new(),
                timeout,
            }
        }

        /// The NCCL unique id of `g`: made by its first member, broadcast over `inner` as
        /// one byte per value (exact in f32).
        fn group_id(&mut self, g: &Group) -> Result<Id, CommError> {
            let root = g.ranks()[0];
            let mut buf = [0f32; ID_BYTES];
            if self.inner.rank() == root {
                let id = Id::new().map_err(nccl_err("ncclGetUniqueId"))?;
                for (b, c) in buf.iter_mut().zip(id.internal()) {
                    *b = f32::from(*c as u8);
                }
            }
            self.inner.broadcast(g, root, &mut buf)?;
            let mut internal = [0 as std::ffi::c_char; ID_BYTES];
            for (c, b) in internal.iter_mut().zip(&buf) {
                *c = *b as u8 as std::ffi::c_char;
            }
            Ok(Id::uninit(internal))
        }

        /// This rank's communicator for `g` (every member calls this for its first collective
        /// on `g`; `ncclCommInitRank` returns once all have).
        fn comm(&mut self, g: &Group) -> Result<&Comm, CommError> {
            if !self.comms.contains_key(g.ranks()) {
                let me = g.index_of(self.inner.rank())?;
                let id = self.group_id(g)?;
                self.stream
                    .context()
                    .bind_to_thread()
                    .map_err(cuda_err("cuCtxSetCurrent"))?;
                let c = Comm::from_rank(self.stream.clone(), me, g.size(), id)
                    .map_err(nccl_err("ncclCommInitRank"))?;
                self.comms.insert(g.ranks().to_vec(), c);
            }
            Ok(&self.comms[g.ranks()])
        }

        fn upload(&self, x: &[f32]) -> Result<CudaSlice<f32>, CommError> {
            self.stream.clone_htod(x).map_err(cuda_err("cuMemcpyHtoD"))
        }

        fn alloc(&self, n: usize) -> Result<CudaSlice<f32>, CommError> {
            self.stream
                .alloc_zeros::<f32>(n)
                .map_err(cuda_err("cuMemAlloc"))
        }

        /// Waits for the stream (polling, so a failed peer or a stall past the timeout ends
        /// the wait instead of hanging) and copies `d` into `out`.
        fn finish(
            &mut self,
            d: &CudaSlice<f32>,
            out: &mut [f32],
            what: &str,
        ) -> Result<(), CommError> {
            let done = self
                .stream
                .record_event(None)
                .map_err(cuda_err("cuEventRecord"))?;
            let t0 = Instant::now();
            while !done.is_complete() {
                self.inner.check_peers()?;
                if t0.elapsed() > self.timeout {
                    return Err(CommError::Backend(format!(
                        "NCCL {what} on rank {} did not finish within {:.1} s",
                        self.inner.rank(),
                        self.timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_micros(20));
            }
            self.stream
                .memcpy_dtoh(d, out)
                .and_then(|()| self.stream.synchronize())
                .map_err(cuda_err("cuMemcpyDtoH"))
        }
    }

    impl<C: Collectives + ?Sized> Collectives for NcclCollectives<'_, C> {
        fn rank(&self) -> usize {
            self.inner.rank()
        }

        fn world(&self) -> usize {
            self.inner.world()
        }

        fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CommError> {
            self.inner.send(to, tag, data)
        }

        fn recv(
            &mut self,
            from: usize,
            tag: u64,
            out: &mut [f32],
            what: &str,
        ) -> Result<(), CommError> {
            self.inner.recv(from, tag, out, what)
        }

        // Handed to the inner runtime as they are, so its zero-copy hand-over stays.
        fn send_owned(&mut self, to: usize, tag: u64, data: Vec<f32>) -> Result<(), CommError> {
            self.inner.send_owned(to, tag, data)
        }

        fn recv_owned(
            &mut self,
            from: usize,
            tag: u64,
            len: usize,
            what: &str,
        ) -> Result<Vec<f32>, CommError> {
            self.inner.recv_owned(from, tag, len, what)
        }

        fn next_tag(&mut self, group: &Group) -> u64 {
            self.inner.next_tag(group)
        }

        fn check_peers(&mut self) -> Result<(), CommError> {
            self.inner.check_peers()
        }

        fn all_reduce_sum(&mut self, g: &Group, buf: &mut [f32]) -> Result<(), CommError> {
            g.index_of(self.rank())?;
            if g.size() == 1 || buf.is_empty() {
                return Ok(());
            }
            let mut d = self.upload(buf)?;
            self.comm(g)?
                .all_reduce_in_place(&mut d, &ReduceOp::Sum)
                .map_err(nccl_err("ncclAllReduce"))?;
            self.finish(&d, buf, "all_reduce")
        }

        fn reduce_scatter_sum(
            &mut self,
            g: &Group,
            input: &[f32],
            out: &mut [f32],
        ) -> Result<(), CommError> {
            expect_len("reduce_scatter", input.len(), out.len() * g.size())?;
            g.index_of(self.rank())?;
            if g.size() == 1 || out.is_empty() {
                out.copy_from_slice(input);
                return Ok(());
            }
            let din = self.upload(input)?;
            let mut dout = self.alloc(out.len())?;
            self.comm(g)?
                .reduce_scatter(&din, &mut dout, &ReduceOp::Sum)
                .map_err(nccl_err("ncclReduceScatter"))?;
            self.finish(&dout, out, "reduce_scatter")
        }

        fn all_gather(
            &mut self,
            g: &Group,
            input: &[f32],
            out: &mut [f32],
        ) -> Result<(), CommError> {
            expect_len("all_gather", out.len(), input.len() * g.size())?;
            g.index_of(self.rank())?;
            if g.size() == 1 || input.is_empty() {
                out.copy_from_slice(input);
                return Ok(());
            }
            let din = self.upload(input)?;
            let mut dout = self.alloc(out.len())?;
            self.comm(g)?
                .all_gather(&din, &mut dout)
                .map_err(nccl_err("ncclAllGather"))?;
            self.finish(&dout, out, "all_gather")
        }

        fn broadcast(&mut self, g: &Group, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
            let r = g.index_of(root)?;
            g.index_of(self.rank())?;
            if g.size() == 1 || buf.is_empty() {
                return Ok(());
            }
            let root = i32::try_from(r).map_err(|_| CommError::Backend("root index".into()))?;
            let mut d = self.upload(buf)?;
            self.comm(g)?
                .broadcast_in_place(&mut d, root)
                .map_err(nccl_err("ncclBroadcast"))?;
            self.finish(&d, buf, "broadcast")
        }
    }

    /// All-reduce times over `n` GPUs of this process with NCCL, one thread per GPU (the
    /// slowest thread's times).
    pub(super) fn all_reduce_times(n: usize, quick: bool) -> Result<AllReduceTimes, ExecError> {
        require(Lib::Nccl)?;
        let id = Id::new().map_err(|e| ExecError::Backend {
            backend: "cuda",
            message: format!("ncclGetUniqueId: {e:?}"),
        })?;
        let big: usize = if quick { 1 << 22 } else { 1 << 25 };
        let (reps_small, reps_big) = if quick { (50u32, 3u32) } else { (500, 20) };
        let per_gpu = |ordinal: usize| -> Result<AllReduceTimes, ExecError> {
            let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtxCreate", e))?;
            ctx.bind_to_thread()
                .map_err(|e| driver_err("cuCtxSetCurrent", e))?;
            let stream = ctx.default_stream();
            let err = |what: &'static str| {
                move |e: cudarc::nccl::result::NcclError| ExecError::Backend {
                    backend: "cuda",
                    message: format!("{what}: {e:?}"),
                }
            };
            let comm =
                Comm::from_rank(stream.clone(), ordinal, n, id).map_err(err("ncclCommInitRank"))?;
            let sync = || {
                stream
                    .synchronize()
                    .map_err(|e| driver_err("cuStreamSynchronize", e))
            };
            let time = |len: usize, reps: u32| -> Result<f64, ExecError> {
                let mut d = stream
                    .alloc_zeros::<f32>(len)
                    .map_err(|e| driver_err("cuMemAlloc", e))?;
                comm.all_reduce_in_place(&mut d, &ReduceOp::Sum)
                    .map_err(err("ncclAllReduce"))?;
                sync()?;
                let t0 = Instant::now();
                for _ in 0..reps {
                    comm.all_reduce_in_place(&mut d, &ReduceOp::Sum)
                        .map_err(err("ncclAllReduce"))?;
                    // Latency is per collective as the executor issues them: one at a time.
                    if len == 1 {
                        sync()?;
                    }
                }
                sync()?;
                Ok(t0.elapsed().as_secs_f64() / f64::from(reps))
            };
            Ok(AllReduceTimes {
                small_s: time(1, reps_small)?,
                large_s: time(big, reps_big)?,
                large_bytes: (big * 4) as f64,
            })
        };
        crate::calibrate::slowest_of((0..n).collect(), per_gpu, || ExecError::Backend {
            backend: "cuda",
            message: "an NCCL calibration thread panicked".into(),
        })
    }

    /// Bytes of an NCCL unique id.
    const ID_BYTES: usize = 128;
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
                Dev::Cpu => cfg.update(cfg.bias_corrections(t), p, g, m, v),
                Dev::Cuda(gpu) => gpu.adam_step(cfg, t, p, g, m, v).unwrap(),
            }
        }
    }

    /// The GPUs here, or `None` after printing why `test` is skipped. Only a missing driver or
    /// device skips: any later failure on a GPU fails the test.
    fn gpus_for(test: &str, need: usize) -> Option<usize> {
        match device_count() {
            Ok(n) if n >= need => Some(n),
            Ok(n) => {
                eprintln!("skipped {test}: needs {need} GPUs, this machine has {n}");
                None
            }
            Err(e) => {
                eprintln!("skipped {test}: no GPU ({e})");
                None
            }
        }
    }

    /// A `cpu` and a `cuda` variant of a device test; the `cuda` one prints why it is
    /// skipped when no GPU is present.
    macro_rules! test_device {
        ($($name:ident),* $(,)?) => {$(
            mod $name {
                #[test]
                fn cpu() {
                    super::$name(&super::Dev::Cpu);
                }
                #[test]
                fn cuda() {
                    if super::gpus_for(concat!(stringify!($name), "::cuda"), 1).is_some() {
                        let g = super::Gpu::open(0).unwrap();
                        super::$name(&super::Dev::Cuda(Box::new(g)));
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

    /// A CUDA 13 toolkit ships `libcublas.so.13` (and a `libcublas.so` link in the toolkit,
    /// not in pip wheels), NCCL's runtime package `libnccl.so.2`: names cudarc does not try.
    #[test]
    fn a_missing_library_message_says_which_folder_or_link_fixes_it() {
        let dir = std::env::temp_dir().join(format!("parallax-libs-{}", std::process::id()));
        let (toolkit, wheel) = (dir.join("toolkit"), dir.join("wheel"));
        std::fs::create_dir_all(&toolkit).unwrap();
        std::fs::create_dir_all(&wheel).unwrap();
        for f in ["libcublas.so", "libcublas.so.13", "libcublasLt.so.13"] {
            std::fs::write(toolkit.join(f), b"").unwrap();
        }
        std::fs::write(wheel.join("libnccl.so.2"), b"").unwrap();
        let folders = [dir.join("absent"), wheel.clone(), toolkit.clone()];

        let cublas = find_library("libcublas", &folders);
        assert_eq!(
            cublas,
            [
                toolkit.join("libcublas.so"),
                toolkit.join("libcublas.so.13")
            ]
        );
        let m = missing_library_message("libcublas", "cuBLAS", &cublas);
        assert!(
            m.contains(&format!("add {} to LD_LIBRARY_PATH", toolkit.display())),
            "{m}"
        );

        let nccl = find_library("libnccl", &folders);
        let m = missing_library_message("libnccl", "NCCL", &nccl);
        assert!(
            m.contains("under another name")
                && m.contains(&format!("ln -s {}", wheel.join("libnccl.so.2").display())),
            "{m}"
        );

        let m = missing_library_message("libnvrtc", "NVRTC (the CUDA toolkit)", &[]);
        assert!(
            m.contains("install NVRTC") && m.contains("libnvrtc.so.12"),
            "{m}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
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
    }

    /// The whole backend: a data- and tensor-parallel run on GPUs 0 and 1 against the threads
    /// backend (skipped without two GPUs).
    #[test]
    fn a_gpu_run_matches_the_threads_backend() {
        use parallax_ir::{models::TransformerConfig, Layout};
        if gpus_for("a_gpu_run_matches_the_threads_backend", 2).is_none() {
            return;
        }
        let model = TransformerConfig::gpt(2, 64, 4, 256, 96, 32);
        for layout in [
            Layout {
                dp: 2,
                ..Layout::default()
            },
            Layout {
                tp: 2,
                ..Layout::default()
            },
        ] {
            let spec = RunSpec::new(model.clone(), layout, 8, 32, 3);
            let gpu = run(&spec).unwrap();
            let cpu = crate::run_threads(&spec).unwrap();
            assert_eq!(gpu.losses.len(), cpu.losses.len());
            for (g, c) in gpu.losses.iter().zip(&cpu.losses) {
                assert!((g - c).abs() <= 1e-4 * c.abs(), "loss {g} vs {c}");
            }
        }
    }

    /// The general-graph trainer on GPUs 0 and 1: a CNN under a channel split and data
    /// parallelism against the threads backend (skipped without two GPUs).
    #[test]
    fn a_gpu_graph_run_matches_the_threads_backend() {
        use crate::graph::{op_plan, run_graph_threads, split_label, GraphRunSpec};
        use parallax_ir::AxisRole;
        if gpus_for("a_gpu_graph_run_matches_the_threads_backend", 2).is_none() {
            return;
        }
        let g = parallax_ir::models::resnet::resnet_tiny(8).unwrap();
        for role in [AxisRole::Sample, AxisRole::Parameter] {
            let plan = op_plan(&g, 1, |i| split_label(&g, i, 2, 0, &|_, r| r == role));
            let spec = GraphRunSpec::new(g.clone(), plan, 3);
            let gpu = run_graph(&spec).unwrap();
            let cpu = run_graph_threads(&spec).unwrap();
            for (a, b) in gpu.losses.iter().zip(&cpu.losses) {
                assert!((a - b).abs() <= 1e-4 * b.abs(), "{role:?}: loss {a} vs {b}");
            }
        }
    }

    #[test]
    fn calibration_gives_a_valid_profile_on_a_gpu() {
        if gpus_for("calibration_gives_a_valid_profile_on_a_gpu", 1).is_none() {
            return;
        }
        let m = calibrate(true).unwrap();
        let d = m.device.as_ref().unwrap();
        let base = parallax_hardware::preset_for_device(&d.name, d.mem_gib).unwrap_or("cpu-local");
        let p = crate::calibrate::to_profile(&m, &parallax_hardware::preset(base).unwrap(), base);
        p.validate().unwrap();
        // One GPU measures no collective: the node's links stay the preset's.
        if m.intra.is_none() {
            assert_eq!(
                p.node.intra_gbps,
                parallax_hardware::preset(base).unwrap().node.intra_gbps
            );
        }
        // The host side of offload: a PCIe link between 1 (PCIe 3.0 x1) and 130 GB/s (past any
        // PCIe 6.0 x16 or C2C link a host copy runs over today) each way, an Adam rate.
        let h = m.host.unwrap();
        let link = h.link.unwrap();
        for r in [link.h2d_bytes_per_s, link.d2h_bytes_per_s] {
            assert!((1e9..130e9).contains(&r), "host link {r} B/s");
        }
        assert_eq!(p.node.pcie_host_gbps, Some(link.bytes_per_s() / 1e9));
        assert!(h.adam_params_per_s > 1e6, "{h:?}");
        eprintln!("{}: {:?}; host {h:?}", p.device.name, m.compute.matmul);
    }

    #[test]
    fn sgemm_throughput_is_reported_on_a_gpu() {
        if gpus_for("sgemm_throughput_is_reported_on_a_gpu", 1).is_none() {
            return;
        }
        let gpu = Gpu::open(0).unwrap();
        let flops = gpu.sgemm_flops(1024, 1024, 1024, 10).unwrap();
        assert!(flops > 0.0);
        eprintln!(
            "{}: sgemm 1024^3 {:.1} TFLOP/s",
            gpu.info().name,
            flops / 1e12
        );
    }
}
