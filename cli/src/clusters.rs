//! `parallax clusters`: the built-in hardware presets.

use crate::fmt::table;
use crate::user;
use clap::Args as ClapArgs;
use parallax_hardware::{preset, presets, Cluster};
use parallax_ir::Precision;
use serde_json::json;

/// List the built-in hardware presets.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
    /// Resolve and validate one cluster (`PRESET:gpus=N` or a profile TOML path) and print it
    /// as a profile TOML.
    #[arg(long, value_name = "CLUSTER")]
    show: Option<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if let Some(spec) = &a.show {
        let c = Cluster::parse(spec).map_err(user)?;
        if a.json {
            let doc = json!({
                "spec": spec,
                "gpus": c.gpus,
                "nodes": c.nodes(),
                "gpus_per_node": c.gpus_per_node(),
                "profile": c.profile,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            println!("# {spec}: {} GPUs on {} node(s)", c.gpus, c.nodes());
            print!("{}", c.profile.to_toml_string().map_err(user)?);
        }
        return Ok(());
    }
    let mut rows = Vec::new();
    let mut docs = Vec::new();
    for (name, description) in presets() {
        let p = preset(name).map_err(user)?;
        let d = &p.device;
        let precision = d.default_precision();
        let best = d.peak_tflops(precision).map(|t| (precision, t));
        let net = p
            .network
            .as_ref()
            .map(|n| format!("{}×{} Gb/s", n.nics_per_node, n.nic_gbit))
            .unwrap_or_else(|| "-".into());
        rows.push(vec![
            name.to_string(),
            d.name.clone(),
            p.node.gpus_per_node.to_string(),
            format!("{:.0}", d.hbm_gib),
            best.map(|(x, t)| format!("{} {x}", sig3(t)))
                .unwrap_or_default(),
            format!("{:.0} GB/s {:?}", p.node.intra_gbps, p.node.intra_fabric),
            net,
        ]);
        docs.push(json!({
            "name": name,
            "description": description,
            "device": d.name,
            "gpus_per_node": p.node.gpus_per_node,
            "hbm_gib": d.hbm_gib,
            "hbm_gbps": d.hbm_gbps,
            "peak_tflops": Precision::ALL.iter().filter_map(|x| d.peak_tflops(*x).map(|t| (x.name(), t))).collect::<std::collections::BTreeMap<_, _>>(),
            "intra_fabric": p.node.intra_fabric,
            "intra_gbps": p.node.intra_gbps,
            "network": p.network,
        }));
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "clusters": docs }))?
        );
    } else {
        print!(
            "{}",
            table(
                &[
                    "preset",
                    "device",
                    "gpus/node",
                    "GiB",
                    "dense TFLOP/s",
                    "intra-node",
                    "network/node"
                ],
                &rows
            )
        );
        println!(
            "Select one with --cluster PRESET:gpus=N (N fills whole nodes) or a profile TOML path."
        );
    }
    Ok(())
}

/// Three significant digits without trailing noise: 989, 15.7, 0.096.
fn sig3(x: f64) -> String {
    let digits = if x >= 100.0 {
        0
    } else if x >= 10.0 {
        1
    } else if x >= 1.0 {
        2
    } else {
        3
    };
    format!("{x:.digits$}")
}
