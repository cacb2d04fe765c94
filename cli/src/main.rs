//! `parallax`: plan, simulate, validate and run parallel training layouts.

mod calibrate;
mod clusters;
mod fmt;
mod frameworks;
mod general;
mod inspect;
mod job;
mod models;
mod plan;
mod run;
mod simulate;
mod validate;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// The executor's tensors are short-lived buffers of a few hundred KiB to MiBs, freed and
/// allocated again every step by every rank thread. glibc's malloc returns such blocks to the
/// kernel (`mmap` above its threshold, heap trimming) and takes them back through page faults
/// that serialise on the process's memory map: 20 % of a two-rank LSTM step on CPU cores, and
/// step times that swing with whatever else the machine does. mimalloc keeps freed pages per
/// thread for reuse, as PyTorch users preload jemalloc or tcmalloc for the same reason.
/// `calibrate` runs under the same allocator, so what it measures is what training sees.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay`: its index in `mi_option_e` of the mimalloc 3 header
/// libmimalloc-sys builds, which the crate leaves out of its constants (a test checks it reads
/// the option's default in `options.c`, 1000 ms).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed pages for reuse: mimalloc hands freed pages back to the kernel after a delay,
/// and training steps then fault them in again, zeroed (58,000 page faults and a fifth of the
/// CPU time of eight two-rank llama-tiny steps; 400 faults without purging).
fn keep_freed_pages() {
    // SAFETY: `mi_option_set` stores one option value of the allocator and has no
    // preconditions; the option index is checked by `purge_delay_is_the_option_it_names`.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
    }
}

/// An automatic parallelization planner and simulator for distributed deep-learning training.
#[derive(Debug, Parser)]
#[command(name = "parallax", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the built-in model zoo.
    #[command(allow_negative_numbers = true)]
    Models(models::Args),
    /// List the built-in hardware presets.
    #[command(allow_negative_numbers = true)]
    Clusters(clusters::Args),
    /// List the software stacks `--framework` takes, their features and sources.
    Frameworks(frameworks::Args),
    /// Parameters, FLOPs per token, layers, op histogram and activation memory of a model.
    #[command(allow_negative_numbers = true)]
    Inspect(inspect::Args),
    /// Predict one training step of a layout: time, throughput, MFU, memory, breakdown.
    #[command(allow_negative_numbers = true)]
    Simulate(simulate::Args),
    /// Search every layout of a model on a cluster: the best plans, why they win, exports.
    #[command(allow_negative_numbers = true)]
    Plan(plan::Args),
    /// Score predictions against published measurements of real training runs.
    #[command(allow_negative_numbers = true)]
    Validate(validate::Args),
    /// Train a model under a layout with the executor; measured against predicted step time.
    #[command(allow_negative_numbers = true)]
    Run(run::Args),
    /// Measure this machine with the executor and write a hardware profile.
    #[command(allow_negative_numbers = true)]
    Calibrate(calibrate::Args),
}

/// An error caused by what the user gave us (exit status 2).
#[derive(Debug)]
pub struct UserError(pub String);

impl std::fmt::Display for UserError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UserError {}

/// Wraps any displayable error as a user error.
pub fn user(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::new(UserError(e.to_string()))
}

/// Refuses to overwrite `path` unless `force` (nothing a user wrote is lost without asking).
pub fn refuse_overwrite(path: &std::path::Path, force: bool) -> anyhow::Result<()> {
    if path.exists() && !force {
        return Err(user(format!(
            "{}: already exists; pass --force to overwrite it",
            path.display()
        )));
    }
    Ok(())
}

/// Makes `dir` ready for a report: refuses to overwrite any of `names` there without `force`
/// (nothing a user wrote is lost without asking), creates the folder.
pub fn prepare_out<'a>(
    dir: &std::path::Path,
    names: impl IntoIterator<Item = &'a str>,
    force: bool,
) -> anyhow::Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(user(format!(
            "--out {}: exists and is not a folder",
            dir.display()
        )));
    }
    if dir.is_dir() && !force {
        for name in names {
            if dir.join(name).exists() {
                return Err(user(format!(
                    "--out {}: {name} already exists (use --force to overwrite)",
                    dir.display()
                )));
            }
        }
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| user(format!("--out {}: cannot create: {e}", dir.display())))
}

/// Reads a plan JSON file, one line naming the file on error.
pub fn read_plan(path: &std::path::Path) -> anyhow::Result<parallax_ir::Plan> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|e| user(format!("{shown}: cannot read: {e}")))?;
    parallax_ir::Plan::from_json(&text, &shown).map_err(user)
}

/// The searches and simulations run on rayon's pool. Where threads are scarce (`ulimit -u`,
/// a pids cgroup) the pool cannot start its workers: fall back to running on this thread
/// alone rather than fail later inside a search.
fn start_thread_pool() {
    if rayon::ThreadPoolBuilder::new().build_global().is_err() {
        let alone = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .use_current_thread()
            .build_global();
        if let Err(e) = alone {
            tracing::warn!("no thread pool ({e}); parallel work may fail");
        } else {
            tracing::warn!("cannot start worker threads: running on one thread");
        }
    }
}

fn main() -> ExitCode {
    keep_freed_pages();
    // Never show a backtrace to a user: one line, and a non-zero status distinct from 2.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        // `println!` panics when stdout fails. A closed stdout (`parallax models | head`) is not
        // an error: the reader has what it wanted (`run` prints its steps without panicking, so
        // training never ends this way). Any other write failure (`> /dev/full`) is one.
        if let Some(why) = msg.strip_prefix("failed printing to stdout: ") {
            if why.contains("Broken pipe") {
                std::process::exit(0);
            }
            let why = why.split(" (os error").next().unwrap_or(why);
            eprintln!("error: cannot write to stdout: {why}");
            std::process::exit(1);
        }
        eprintln!("error: internal error (please report): {msg}");
    }));
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PARALLAX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    start_thread_pool();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    return ExitCode::SUCCESS;
                }
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    return ExitCode::from(2);
                }
                _ => {}
            }
            // clap's lines before the usage block say what is wrong; join them into one.
            let text = e.render().to_string();
            let what: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| {
                    !l.starts_with("Usage:")
                        && !l.starts_with("tip:")
                        && !l.starts_with("For more information")
                })
                .filter(|l| !l.is_empty())
                .collect();
            eprintln!("{} (see --help)", what.join(" "));
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Models(a) => models::run(a),
        Command::Clusters(a) => clusters::run(a),
        Command::Frameworks(a) => frameworks::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Simulate(a) => simulate::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Validate(a) => validate::run(a),
        Command::Run(a) => run::run(a),
        Command::Calibrate(a) => calibrate::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let line = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {line}");
            if e.downcast_ref::<UserError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

#[cfg(test)]
mod allocator_tests {
    /// The option index names mimalloc's purge delay: its default is 1000 ms (-1 once `main`
    /// has set it).
    #[test]
    fn purge_delay_is_the_option_it_names() {
        #[allow(unsafe_code)]
        // SAFETY: `mi_option_get` reads one option value and has no preconditions.
        let delay = unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        assert!(delay == 1000 || delay == -1, "{delay}");
    }
}
