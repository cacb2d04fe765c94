//! `parallax models`: the built-in zoo.

use crate::fmt::{si, table};
use clap::Args as ClapArgs;
use parallax_ir::models::zoo::{self, ZooDef};
use serde_json::json;

/// List the built-in model zoo.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let mut docs = Vec::new();
    for e in zoo::entries() {
        let (kind, layers, hidden) = match &e.def {
            ZooDef::Transformer(c) => {
                let kind = if c.moe.is_some() {
                    "moe-transformer"
                } else {
                    "transformer"
                };
                (kind, Some(c.layers), Some(c.hidden))
            }
            // DLRM takes dense features and categorical indices, not images.
            ZooDef::Batched(_) if e.family == "dlrm" => ("recommender", None, None),
            ZooDef::Batched(_) => ("vision", None, None),
            ZooDef::Sequence(_) => ("rnn", None, None),
        };
        rows.push(vec![
            e.name.to_string(),
            e.family.to_string(),
            kind.to_string(),
            layers.map(|l| l.to_string()).unwrap_or_default(),
            hidden.map(|h| h.to_string()).unwrap_or_default(),
            si(e.published_params),
        ]);
        docs.push(json!({
            "name": e.name,
            "family": e.family,
            "kind": kind,
            "layers": layers,
            "hidden": hidden,
            "published_params": e.published_params,
            "source": e.source,
        }));
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "models": docs }))?
        );
    } else {
        print!(
            "{}",
            table(
                &["model", "family", "kind", "layers", "hidden", "params"],
                &rows
            )
        );
    }
    Ok(())
}
