//! fp32 matmul of the executor (the `gemm` crate) against OpenBLAS, side by side, at
//! 1024 × 1024 × 1024, on one thread and on all cores.
//!
//! `cargo bench -p parallax-executor --bench matmul --features bench-openblas` (needs the system
//! OpenBLAS: `apt-get install libopenblas-dev`). Without the feature only the executor's matmul
//! is measured. Besides criterion's report it prints the ratio of the two throughputs.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use parallax_executor::tensor::{matmul, MatMut, MatRef, Threads};
use std::time::Instant;

const N: usize = 1024;

fn operands() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let a = (0..N * N).map(|i| (i % 7) as f32 * 0.1).collect();
    let b = (0..N * N).map(|i| (i % 5) as f32 * 0.1).collect();
    (a, b, vec![0.0; N * N])
}

fn ours(a: &[f32], b: &[f32], c: &mut [f32], threads: Threads) {
    matmul(
        MatMut::new(c, N, N),
        MatRef::new(a, N, N),
        MatRef::new(b, N, N),
        false,
        threads,
    );
}

#[cfg(feature = "bench-openblas")]
mod blas {
    // The system library (libopenblas-dev) provides both the CBLAS symbols and this setter.
    #[link(name = "openblas")]
    extern "C" {
        fn openblas_set_num_threads(n: i32);
    }

    /// Sets OpenBLAS's thread count.
    pub fn set_threads(n: usize) {
        // SAFETY: a plain setter exported by libopenblas, called between GEMMs.
        #[allow(unsafe_code)]
        unsafe {
            openblas_set_num_threads(n as i32)
        }
    }

    /// `c = a · b`, row-major `N × N`.
    pub fn sgemm(a: &[f32], b: &[f32], c: &mut [f32], n: usize) {
        assert!(a.len() >= n * n && b.len() >= n * n && c.len() >= n * n);
        let n = n as i32;
        // SAFETY: the three buffers hold n × n elements (asserted); leading dimensions are n.
        #[allow(unsafe_code)]
        unsafe {
            cblas_sys::cblas_sgemm(
                cblas_sys::CBLAS_LAYOUT::CblasRowMajor,
                cblas_sys::CBLAS_TRANSPOSE::CblasNoTrans,
                cblas_sys::CBLAS_TRANSPOSE::CblasNoTrans,
                n,
                n,
                n,
                1.0,
                a.as_ptr(),
                n,
                b.as_ptr(),
                n,
                0.0,
                c.as_mut_ptr(),
                n,
            )
        }
    }
}

/// Best GFLOP/s of `f` over a few repetitions (for the printed ratio).
fn gflops(mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t0 = Instant::now();
        f();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    2.0 * (N as f64).powi(3) / best / 1e9
}

fn bench(c: &mut Criterion) {
    let (a, b, mut out) = operands();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (label, threads) in [("1 thread", 1usize), ("all cores", cores)] {
        let t = if threads == 1 {
            Threads::One
        } else {
            Threads::Many(threads)
        };
        let mut g = c.benchmark_group(format!("sgemm 1024^3 {label}"));
        g.throughput(Throughput::Elements(2 * (N as u64).pow(3)));
        g.sample_size(10);
        g.bench_function("parallax (gemm crate)", |bch| {
            bch.iter(|| ours(&a, &b, &mut out, t))
        });
        let mine = gflops(|| ours(&a, &b, &mut out, t));
        #[cfg(feature = "bench-openblas")]
        {
            blas::set_threads(threads);
            g.bench_function("openblas", |bch| {
                bch.iter(|| blas::sgemm(&a, &b, &mut out, N))
            });
            let theirs = gflops(|| blas::sgemm(&a, &b, &mut out, N));
            println!(
                "sgemm 1024^3 {label}: parallax {mine:.1} GFLOP/s, OpenBLAS {theirs:.1} GFLOP/s: {:.0} % of OpenBLAS",
                100.0 * mine / theirs
            );
        }
        #[cfg(not(feature = "bench-openblas"))]
        println!(
            "sgemm 1024^3 {label}: parallax {mine:.1} GFLOP/s (OpenBLAS not compiled in: --features bench-openblas)"
        );
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
