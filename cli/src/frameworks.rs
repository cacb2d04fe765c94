//! `parallax frameworks`: the table of software stacks `--framework` takes.

use clap::Args as ClapArgs;
use parallax_planner::framework::{table_text, STACKS};
use serde_json::json;

/// List the software stacks, their runtime features and the documents that state them.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Print one JSON document instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.json {
        let rows: Vec<_> = STACKS
            .iter()
            .map(|s| {
                let fw = parallax_planner::Framework::parse(s.name)
                    .expect("every row answers to its own name");
                json!({
                    "name": s.name,
                    "covers": s.covers,
                    "runtime": fw.runtime,
                    "schedules": fw.space.schedules,
                    "zero_stages": fw.space.zero_stages,
                    "recompute": fw.space.recompute,
                    "recompute_modules": fw.space.recompute_modules,
                    "uneven_stages": fw.space.uneven_stages,
                    "sequence_parallel": fw.space.sequence_parallel,
                    "context_parallel": fw.space.offers_context_parallel(),
                    "fp8_recipes": fw.space.fp8_recipes,
                    "async_tp": fw.space.async_tp,
                    "features": s.features.iter().map(|f| json!({"what": f.what, "source": f.source})).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "frameworks": rows }))?
        );
    } else {
        print!("{}", table_text());
    }
    Ok(())
}
