//! `parallax calibrate`: measure this machine with the executor's kernels and collectives and
//! write a hardware profile (the `cpu-local` schema) for `plan`, `simulate` and `run`.

use crate::user;
use clap::Args as ClapArgs;
use parallax_executor::calibrate::{calibrate, to_profile, CalibrateOptions};
use parallax_executor::{Backend, ExecError};
use parallax_hardware::{preset, preset_for_device, CPU_LOCAL};
use std::path::{Path, PathBuf};

/// Measure matmul throughput, memory bandwidth and collective bandwidth/latency; write a profile.
///
/// With `--backend mpi`, start it under `mpirun -np N` (one process per core, on one or more
/// nodes); rank 0 writes the profile.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Backend to calibrate: threads (built in), mpi or cuda (cargo features).
    #[arg(long, default_value = "threads")]
    backend: String,
    /// Profile TOML to write.
    #[arg(long)]
    out: PathBuf,
    /// Overwrite --out if it exists.
    #[arg(long)]
    force: bool,
    /// Cores to measure at once (default: all available).
    #[arg(long)]
    threads: Option<usize>,
    /// Shorter measurements (seconds instead of about a minute).
    #[arg(long)]
    quick: bool,
    /// A folder on the node's NVMe drives: their write and read bandwidth and free space are
    /// measured there (files written, read back past the page cache and removed) for
    /// ZeRO-Infinity's NVMe offload, and `--export deepspeed` points it there.
    #[arg(long, value_name = "DIR")]
    nvme: Option<PathBuf>,
}

/// The `--nvme` folder as the profile records it: absolute, since `--export deepspeed` writes
/// it as DeepSpeed's `nvme_path`, which the run resolves from wherever it is launched.
fn nvme_folder(dir: &Path) -> anyhow::Result<PathBuf> {
    if !dir.is_dir() {
        return Err(user(format!("--nvme {}: not a folder", dir.display())));
    }
    dir.canonicalize()
        .map_err(|e| user(format!("--nvme {}: {e}", dir.display())))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let backend: Backend = a
        .backend
        .parse()
        .map_err(|e| user(format!("--backend: {e}")))?;
    crate::refuse_overwrite(&a.out, a.force)?;
    // Refused before the minute of measuring, not after.
    let nvme = a.nvme.as_deref().map(nvme_folder).transpose()?;
    let threads = match a.threads {
        Some(0) => return Err(user("--threads must be at least 1")),
        Some(n) if n > parallax_executor::engine::MAX_RANKS => {
            return Err(user(format!(
                "--threads {n} is more than {}",
                parallax_executor::engine::MAX_RANKS
            )))
        }
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let Some(mut m) = calibrate(
        backend,
        CalibrateOptions {
            threads,
            quick: a.quick,
        },
    )
    .map_err(|e| match e {
        ExecError::NotCompiled { .. } | ExecError::Backend { .. } => user(e),
        other => anyhow::Error::new(other),
    })?
    else {
        // An MPI rank other than 0: rank 0 writes the profile.
        return Ok(());
    };
    if let Some(dir) = &nvme {
        m.nvme = Some(
            parallax_executor::calibrate::measure_nvme(dir, a.quick)
                .map_err(|e| user(format!("--nvme {}: {e}", dir.display())))?,
        );
    }
    // A GPU's unmeasured fields (tensor-core peaks, fabric, network) come from the preset of
    // its model; CPU cores are `cpu-local`'s.
    let base_name = m
        .device
        .as_ref()
        .and_then(|d| preset_for_device(&d.name, d.mem_gib))
        .unwrap_or(CPU_LOCAL);
    let base = preset(base_name).map_err(user)?;
    let mut p = to_profile(&m, &base, base_name);
    let unit = if m.device.is_some() { "GPU" } else { "core" };
    p.name = a
        .out
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(CPU_LOCAL)
        .to_string();
    p.save(&a.out).map_err(user)?;
    let what = match &m.device {
        Some(d) => format!("{} x {}", m.threads, d.name),
        None => format!("{} {unit}s", m.threads),
    };
    match &m.inter {
        None => println!("calibrated {what} ({} backend):", m.backend),
        Some(x) => println!(
            "calibrated {} nodes x {what} ({} backend):",
            x.nodes, m.backend
        ),
    }
    for (f, r) in &m.compute.matmul {
        println!(
            "  matmul {:>9.3} GFLOP {:>8.2} GFLOP/s per {unit}",
            f / 1e9,
            r / 1e9
        );
    }
    for (f, r) in &m.compute.tensor_matmul {
        println!(
            "  fp16 matmul {:>9.3} GFLOP {:>10.2} GFLOP/s per {unit} (tensor cores)",
            f / 1e9,
            r / 1e9
        );
    }
    println!(
        "  copy bandwidth      {:>8.2} GB/s per {unit}",
        m.compute.copy_bytes_per_s / 1e9
    );
    for (bytes, r) in &m.compute.pointwise_curve {
        println!(
            "  pointwise {:>9.3} MB {:>8.2} GB/s per {unit}",
            bytes / 1e6,
            r / 1e9
        );
    }
    println!(
        "  pointwise kernels   {:>8.2} GB/s per {unit}",
        m.compute.pointwise_bytes_per_s / 1e9
    );
    if let (Some(e), Some(t)) = (m.compute.transcendentals_per_s, m.compute.tanh_per_s) {
        println!(
            "  exp / tanh          {:>8.1} / {:.1} M per s per {unit}",
            e / 1e6,
            t / 1e6
        );
    }
    println!(
        "  op overhead         {:>8.3} us",
        m.compute.op_overhead_s * 1e6
    );
    if let Some(h) = &m.host {
        println!(
            "  host Adam           {:>8.3} G parameters/s on {} cores",
            h.adam_params_per_s / 1e9,
            h.cores
        );
        if let Some(l) = &h.link {
            println!(
                "  host link           {:>8.2} GB/s up, {:.2} GB/s down per GPU (all at once, pinned)",
                l.h2d_bytes_per_s / 1e9,
                l.d2h_bytes_per_s / 1e9
            );
        }
    }
    if let Some(n) = &m.nvme {
        println!(
            "  NVMe                {:>8.2} GB/s write, {:.2} GB/s read, {:.0} GiB free at {}",
            n.write_bytes_per_s / 1e9,
            n.read_bytes_per_s / 1e9,
            n.free_bytes / f64::from(1u32 << 30),
            n.path.display()
        );
    }
    // The trainers' ops past their GEMM calls: the general-graph trainer's as it runs them in
    // training, the transformer trainer's kernels alone.
    if let Some(h) = &p.device.host_kernels {
        let both = [("graph", &h.graph), ("transformer", &h.transformer)];
        for (trainer, class, rates) in both
            .iter()
            .flat_map(|(t, table)| table.iter().map(move |(c, r)| (t, c, r)))
        {
            let line = rates
                .0
                .iter()
                .map(|[bytes, f, b]| {
                    format!("{:.0} KB {:.2} / {:.2}", bytes / 1e3, f / 1e9, b / 1e9)
                })
                .collect::<Vec<_>>()
                .join(", ");
            println!("  {trainer:<11} {class:<15} {line} GB/s (forward / backward) per {unit}");
        }
    }
    match &m.intra {
        Some(c) => {
            println!(
                "  all-reduce busbw    {:>8.2} GB/s",
                c.busbw_bytes_per_s / 1e9
            );
            println!("  collective step     {:>8.2} us", c.step_latency_s * 1e6);
        }
        None => println!(
            "  all-reduce          not measured (one {} per node); the node's links are {}'s",
            unit, base_name
        ),
    }
    if let Some(x) = &m.inter {
        println!(
            "  across nodes: all-reduce busbw {:.2} GB/s, step {:.2} us",
            x.fit.busbw_bytes_per_s / 1e9,
            x.fit.step_latency_s * 1e6
        );
    }
    println!("wrote {}", a.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nvme_folder_is_recorded_absolute() {
        let here = std::env::current_dir().unwrap();
        // `cargo test` runs in the crate's folder, which holds `src`.
        let got = nvme_folder(Path::new("src")).unwrap();
        assert!(got.is_absolute(), "{}", got.display());
        assert_eq!(got, here.join("src").canonicalize().unwrap());
        let e = nvme_folder(Path::new("no-such-folder")).unwrap_err();
        assert_eq!(e.to_string(), "--nvme no-such-folder: not a folder");
    }
}
