//! `parallax validate`: predictions against published measurements.

use crate::fmt::table;
use crate::user;
use clap::Args as ClapArgs;
use parallax_planner::{parse_cases, summarize, validate};
use serde_json::json;
use std::path::PathBuf;

/// Score predicted step time and memory against published runs.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// A case file (`parallax-validation-cases/1`), e.g. ../shared/ground-truth/public.json.
    cases: PathBuf,
    /// Only cases of this group (e.g. `core`, `fp8`).
    #[arg(long)]
    group: Option<String>,
    /// Print one JSON document.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let file = a.cases.display().to_string();
    let text =
        std::fs::read_to_string(&a.cases).map_err(|e| user(format!("{file}: cannot read: {e}")))?;
    let mut cf = parse_cases(&text, &file).map_err(user)?;
    if let Some(g) = &a.group {
        cf.cases.retain(|c| &c.group == g);
        if cf.cases.is_empty() {
            return Err(user(format!("{file}: no case has group '{g}'")));
        }
    }
    let (results, _) = validate(&cf.cases);
    let summary = summarize(&results);
    if a.json {
        let doc = json!({ "cases": results, "summary": summary });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
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
    println!(
        "\n{} cases: MAPE {:.2} %, median {:.2} %, max {:.2} %; peak memory MAPE {:.2} % over {} cases; {} skipped",
        summary.n,
        summary.mape * 100.0,
        summary.median_ape * 100.0,
        summary.max_ape * 100.0,
        summary.memory_mape * 100.0,
        summary.memory_n,
        summary.skipped
    );
    Ok(())
}
