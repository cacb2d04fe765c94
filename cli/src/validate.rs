//! `parallax validate`: predictions against published measurements.

use crate::fmt::table;
use crate::user;
use clap::Args as ClapArgs;
use parallax_cost::step_time_band;
use parallax_cost::transformer::Setup;
use parallax_ir::PartialLayout;
use parallax_planner::general_cases::GeneralInputs;
use parallax_planner::{complete_or_smallest, parse_cases, validate, MemoryKind, Space};
use parallax_sim::perop::simulate_op_plan;
use parallax_sim::simulate_step;
use serde_json::json;
use std::path::PathBuf;

/// Score predicted step time and memory against published runs.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Case files (`parallax-validation-cases/1`, `/1.1` or `/2`), e.g.
    /// ../shared/ground-truth/public.json, moe-zero-offload.json or general.json; each is
    /// scored on its own, and `--fit` fits every chip over the cases of all of them.
    #[arg(required = true, num_args = 1..)]
    cases: Vec<PathBuf>,
    /// Only cases of this group (e.g. `core`, `fp8`).
    #[arg(long)]
    group: Option<String>,
    /// Predict every transformer case as run on this stack (`NAME@VERSION`, `parallax
    /// frameworks`) instead of the one its `framework` field names.
    #[arg(long, value_name = "NAME@VERSION")]
    framework: Option<String>,
    /// Print one JSON document.
    #[arg(long)]
    json: bool,
    /// Fit each GPU chip's sustained and attention efficiency to the cases instead of scoring.
    #[arg(long)]
    fit: bool,
    /// With --fit: write the fitted values into the preset files in this folder
    /// (hardware-profiles/profiles), keeping their comments.
    #[arg(long, value_name = "DIR", requires = "fit")]
    write_presets: Option<PathBuf>,
    /// Print the prediction of the case with this id as `simulate` does (layout, breakdown,
    /// memory; a per-op graph's layout op by op) beside what was measured, instead of scoring
    /// every case.
    #[arg(long, value_name = "ID", conflicts_with_all = ["fit", "json"])]
    explain: Option<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut files = Vec::new();
    for path in &a.cases {
        let file = path.display().to_string();
        let cases = load(&a, path, &file)?;
        files.push((file, cases));
    }
    // `--group` keeps the files that have the group; none having it is the error.
    if let Some(g) = &a.group {
        files.retain(|(_, cases)| !cases.is_empty());
        if files.is_empty() {
            let names: Vec<String> = a.cases.iter().map(|p| p.display().to_string()).collect();
            return Err(user(format!(
                "{}: no case has group '{g}'",
                names.join(", ")
            )));
        }
    }
    if let Some(id) = &a.explain {
        return explain(id, &files);
    }
    if a.fit {
        let names: Vec<&str> = files.iter().map(|(f, _)| f.as_str()).collect();
        let all: Vec<parallax_planner::Case> =
            files.iter().flat_map(|(_, c)| c.iter().cloned()).collect();
        return fit(&a, &names.join(" "), &all);
    }
    let mut docs = Vec::new();
    for (i, (file, cases)) in files.iter().enumerate() {
        if files.len() > 1 && !a.json {
            println!("{}== {file}", if i > 0 { "\n" } else { "" });
        }
        docs.push(score(&a, file, cases)?);
    }
    if a.json {
        let doc = match docs.len() {
            1 => docs.remove(0),
            _ => json!({ "files": docs }),
        };
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}

/// `--explain ID`: the case's completed layout simulated and printed as `simulate` prints
/// it, with the measurement beside it.
fn explain(id: &str, files: &[(String, Vec<parallax_planner::Case>)]) -> anyhow::Result<()> {
    let Some((file, case)) = files
        .iter()
        .find_map(|(f, cases)| cases.iter().find(|c| c.id() == id).map(|c| (f, c)))
    else {
        let names: Vec<&str> = files.iter().map(|(f, _)| f.as_str()).collect();
        return Err(user(format!(
            "--explain: no case '{id}' in {}",
            names.join(", ")
        )));
    };
    let stack = case.stack();
    let measured = case.measured();
    let fail = |e: String| user(format!("--explain {id}: {e}"));
    let title = format!("{id} ({file})");
    // The prediction as scored: printed as `simulate` prints it, then its step time and peak
    // memory (before any scaling to the published global batch).
    let (predicted, scale) = match case {
        parallax_planner::Case::Transformer(t) => (
            t.with_setup(&|_| {}, |setup, partial, space| {
                explain_transformer(&title, &stack, setup, partial, space)
            })
            .map_err(fail)?
            .map_err(fail)?,
            1.0,
        ),
        parallax_planner::Case::General(g) => g
            .with_inputs(&|_| {}, |inputs| match inputs {
                GeneralInputs::Transformer(setup, partial, space) => {
                    explain_transformer(&title, &stack, setup, partial, space)
                }
                GeneralInputs::PerOp(costs, plan, ran) => {
                    let sim = simulate_op_plan(costs, plan, ran).map_err(|e| e.to_string())?;
                    let band = step_time_band(costs.profile);
                    println!("{title}: {}", crate::general::summary(costs, plan));
                    println!("stack       {stack}");
                    for l in crate::general::step_lines(costs.gpus, &sim.prediction, band) {
                        println!("{l}");
                    }
                    for l in crate::general::config_lines(costs, plan) {
                        println!("{l}");
                    }
                    let p = &sim.prediction;
                    Ok((p.step_time_s, p.peak_memory_gib, p.reserved_memory_gib))
                }
            })
            .map_err(fail)?,
    };
    let (step, allocated, reserved) = predicted;
    let err = |pred: f64, meas: f64| format!("{:+.1} %", (pred - meas) / meas * 100.0);
    println!();
    if (scale - 1.0).abs() > 5e-4 {
        println!(
            "scaled      {:.3} s: the published global batch is {scale:.3} times the step as run",
            step * scale
        );
    }
    println!(
        "measured    {:.3} s (prediction {})",
        measured.step_time_s,
        err(step * scale, measured.step_time_s)
    );
    if let Some(m) = measured.peak_memory_gib {
        let kind = MemoryKind::from_published(measured.memory_kind.as_deref());
        println!(
            "            {m:.2} GiB peak memory, {} (prediction {})",
            kind.name(),
            err(kind.read(allocated, reserved), m)
        );
    }
    Ok(())
}

/// A transformer step completed as validation completes it, simulated and printed as
/// `simulate` prints it; its step time and peak memory.
fn explain_transformer(
    title: &str,
    stack: &str,
    setup: &Setup,
    partial: &PartialLayout,
    space: &Space,
) -> Result<(f64, f64, f64), String> {
    let (layout, _) = complete_or_smallest(setup, partial, space).map_err(|e| e.to_string())?;
    let sim = simulate_step(setup, &layout).map_err(|e| e.to_string())?;
    let band = step_time_band(setup.profile);
    crate::simulate::print_report(title, stack, &sim, &layout, band);
    crate::simulate::print_layer_costs(setup, &layout);
    let p = &sim.prediction;
    Ok((p.step_time_s, p.peak_memory_gib, p.reserved_memory_gib))
}

/// The cases of one file, filtered by `--group` and re-stacked by `--framework`.
fn load(
    a: &Args,
    path: &std::path::Path,
    file: &str,
) -> anyhow::Result<Vec<parallax_planner::Case>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| user(format!("{file}: cannot read: {e}")))?;
    let mut cf = parse_cases(&text, file).map_err(user)?;
    if let Some(g) = &a.group {
        cf.cases.retain(|c| c.group() == g);
    }
    if let Some(spec) = &a.framework {
        parallax_planner::Framework::parse(spec).map_err(|e| user(format!("--framework: {e}")))?;
        for c in &mut cf.cases {
            c.set_framework(spec);
        }
    }
    Ok(cf.cases)
}

/// Scores the cases of one file: the table and summary, or (with `--json`) their document.
fn score(
    a: &Args,
    file: &str,
    cases: &[parallax_planner::Case],
) -> anyhow::Result<serde_json::Value> {
    let (results, summary) = validate(cases);
    if summary.n == 0 {
        let why = results.first().map(|r| r.status.as_str()).unwrap_or("");
        return Err(user(format!(
            "{file}: no case could be scored (the first: {why})"
        )));
    }
    if a.json {
        return Ok(json!({ "file": file, "cases": results, "summary": summary }));
    }
    let pct = |x: Option<f64>| {
        x.map(|v| format!("{:.1}", v * 100.0))
            .unwrap_or_else(|| "-".into())
    };
    let num =
        |x: Option<f64>, d: usize| x.map(|v| format!("{v:.d$}")).unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            vec![
                r.id.clone(),
                format!("{:.3}", r.measured_step_time_s),
                num(r.predicted_step_time_s, 3),
                pct(r.ape),
                num(r.measured_peak_memory_gib, 1),
                num(r.predicted_peak_memory_gib, 1),
                if r.status == "ok" {
                    r.layout.clone().unwrap_or_default()
                } else {
                    r.status.clone()
                },
            ]
        })
        .collect();
    print!(
        "{}",
        table(
            &[
                "case",
                "measured s",
                "predicted s",
                "err %",
                "mem GiB",
                "pred GiB",
                "layout"
            ],
            &rows
        )
    );
    // The stacks the cases were predicted on, in the order they first appear.
    let mut stacks: Vec<(&str, usize)> = Vec::new();
    for r in &results {
        match stacks.iter_mut().find(|(s, _)| *s == r.framework) {
            Some((_, n)) => *n += 1,
            None => stacks.push((&r.framework, 1)),
        }
    }
    println!(
        "\nstacks: {}",
        stacks
            .iter()
            .map(|(s, n)| format!("{s} ×{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // No measured memory is no score, not a perfect one.
    let memory = match summary.memory_n {
        0 => "no measured peak memory".to_string(),
        n => format!(
            "peak memory MAPE {:.2} % over {n} cases",
            summary.memory_mape * 100.0
        ),
    };
    println!(
        "\n{} cases: MAPE {:.2} %, median {:.2} %, max {:.2} %; {memory}; {} skipped",
        summary.n,
        summary.mape * 100.0,
        summary.median_ape * 100.0,
        summary.max_ape * 100.0,
        summary.skipped
    );
    Ok(serde_json::Value::Null)
}

fn fit(a: &Args, file: &str, cases: &[parallax_planner::Case]) -> anyhow::Result<()> {
    use parallax_hardware::edit::{set_values, Setting};
    let fits = parallax_planner::fit::fit(cases);
    if fits.is_empty() {
        return Err(user(format!(
            "{file}: --fit: no case runs on a chip with fitted parameters"
        )));
    }
    if let Some(dir) = &a.write_presets {
        for f in &fits {
            for name in &f.presets {
                let path = dir.join(format!("{name}.toml"));
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| user(format!("{}: cannot read: {e}", path.display())))?;
                let mut fields = vec!["device.sustained_efficiency".to_string()];
                let mut settings = vec![(
                    "device.sustained_efficiency",
                    Setting::Float(f.sustained_efficiency),
                )];
                if let Some(att) = f.attention_efficiency_scale {
                    fields.push("device.attention_efficiency_scale".into());
                    settings.push(("device.attention_efficiency_scale", Setting::Float(att)));
                }
                let provenance = format!(
                    "parallax validate {file} --fit: {} published runs on {} chips (MAPE {:.1} % -> {:.1} %)",
                    f.cases,
                    f.chip,
                    f.mape_before * 100.0,
                    f.mape_after * 100.0
                );
                settings.push(("calibration.provenance", Setting::Text(provenance)));
                settings.push(("calibration.fitted_fields", Setting::List(fields)));
                settings.push(("calibration.step_time_band", Setting::Float(f.band)));
                let new =
                    set_values(&text, &path.display().to_string(), &settings).map_err(user)?;
                std::fs::write(&path, new)
                    .map_err(|e| user(format!("{}: cannot write: {e}", path.display())))?;
            }
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "fits": fits }))?
        );
        return Ok(());
    }
    let rows: Vec<Vec<String>> = fits
        .iter()
        .map(|f| {
            vec![
                f.chip.clone(),
                f.cases.to_string(),
                format!("{:.3}", f.sustained_efficiency),
                f.attention_efficiency_scale
                    .map(|x| format!("{x:.3}"))
                    .unwrap_or_else(|| "-".into()),
                format!("{:.1}", f.mape_before * 100.0),
                format!("{:.1}", f.mape_after * 100.0),
                format!("{:.1}", f.band * 100.0),
                f.presets.join(" "),
            ]
        })
        .collect();
    print!(
        "{}",
        table(
            &[
                "chip",
                "cases",
                "sustained",
                "attention",
                "MAPE before %",
                "after %",
                "band %",
                "presets"
            ],
            &rows
        )
    );
    if a.write_presets.is_some() {
        println!("Preset files updated; rebuild (cargo build) for the new values to take effect.");
    }
    Ok(())
}
