//! `parallax inspect`: what a model is made of.

use crate::fmt::{bytes, si, si_unit, table};
use crate::user;
use anyhow::Context;
use clap::Args as ClapArgs;
use parallax_ir::load::graph_to_json;
use parallax_ir::{load_model, Precision, Segment};
use serde_json::json;
use std::path::PathBuf;

/// Parameters, FLOPs per token, layers, op histogram and activation memory of a model.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Zoo name, HuggingFace config.json, .onnx file or parallax graph JSON.
    #[arg(long)]
    model: String,
    /// Sequence length (default: the model's maximum).
    #[arg(long)]
    seq: Option<u64>,
    /// Samples per batch the graph is built for.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// Precision for byte counts (fp32, tf32, fp16, bf16, fp8).
    #[arg(long, default_value = "bf16")]
    precision: Precision,
    /// Model attention as unfused kernels (scores kept in memory) instead of flash attention.
    #[arg(long)]
    unfused_attention: bool,
    /// Write the graph as parallax graph JSON to this file.
    #[arg(long)]
    save_graph: Option<PathBuf>,
    /// Overwrite the --save-graph file if it exists.
    #[arg(long)]
    force: bool,
    /// Print one JSON document.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let precision = a.precision;
    crate::job::check_batch("--batch", a.batch)?;
    let model = load_model(&a.model).map_err(user)?;
    let seq = a.seq.unwrap_or_else(|| model.default_seq());
    let g = model
        .graph(a.batch, seq, !a.unfused_attention)
        .map_err(user)?;
    let fb = precision.activation_dtype().size_bytes();
    let total = g.param_count();
    let emb = g.embedding_params();
    let work = g.total_work(fb);
    let tokens = (a.batch * seq) as f64;
    let per_sample = if model.transformer().is_some() || seq > 1 {
        tokens
    } else {
        a.batch as f64
    };
    let unit = if model.transformer().is_some() || seq > 1 {
        "token"
    } else {
        "sample"
    };
    let fwd = work.fwd_flops.0 / per_sample;
    let train = work.train_flops().0 / per_sample;
    let blocks = g.num_blocks();
    let act_block0 =
        g.activation_bytes(fb, |n| n.segment == Segment::Block(0)).0 as f64 / per_sample;
    let act_all = g.activation_bytes(fb, |_| true).0 as f64 / per_sample;
    let hist = g.op_histogram();
    // Narayanan et al. 2021 eq. 3 per token: 6·N + 12·l·h·s (transformers only).
    let reference = model
        .transformer()
        .map(|c| 6.0 * total as f64 + 12.0 * f64::from(c.layers) * c.hidden as f64 * seq as f64);

    if let Some(path) = &a.save_graph {
        crate::refuse_overwrite(path, a.force)?;
        std::fs::write(path, graph_to_json(&g))
            .with_context(|| format!("{}: cannot write", path.display()))
            .map_err(user)?;
    }

    if a.json {
        let doc = json!({
            "model": model.name,
            "origin": model.origin,
            "seq": seq,
            "batch": a.batch,
            "precision": precision.name(),
            "params_total": total,
            "params_embedding": emb,
            "params_non_embedding": total - emb,
            "layers": blocks,
            "nodes": g.nodes.len(),
            "flops_unit": unit,
            "fwd_flops_per_unit": fwd,
            "train_flops_per_unit": train,
            "reference_train_flops_per_token": reference,
            "activation_bytes_per_unit_per_layer": act_block0,
            "activation_bytes_per_unit": act_all,
            "op_histogram": hist,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!("model        {} ({})", model.name, model.origin);
    println!(
        "graph        {} nodes, {} blocks, batch {} × seq {}",
        g.nodes.len(),
        blocks,
        a.batch,
        seq
    );
    println!(
        "parameters   {} total · {} embedding · {} non-embedding",
        si(total as f64),
        si(emb as f64),
        si((total - emb) as f64)
    );
    println!(
        "FLOPs/{unit:<6} {}FLOP forward · {}FLOP training (fwd + bwd)",
        si(fwd),
        si(train)
    );
    if let Some(r) = reference {
        println!(
            "             6·N + 12·l·h·s = {} ({:+.2} %; ours adds norms, softmax, activations)",
            si_unit(r, "FLOP"),
            (train / r - 1.0) * 100.0
        );
    }
    let per_block = if blocks > 0 {
        format!("{} per {unit} per block (block 0), ", bytes(act_block0))
    } else {
        String::new()
    };
    let attention = match (hist.contains_key("attention"), a.unfused_attention) {
        (false, _) => "",
        (true, true) => ", unfused attention",
        (true, false) => ", flash attention",
    };
    println!(
        "activations  {per_block}{} per {unit} in all, {precision}{attention}, no recompute",
        bytes(act_all),
    );
    let rows: Vec<Vec<String>> = hist
        .iter()
        .map(|(k, v)| vec![k.to_string(), v.to_string()])
        .collect();
    println!();
    print!("{}", table(&["op", "count"], &rows));
    Ok(())
}
