//! Quality of the search against published runs: for every case of
//! `shared/ground-truth/public.json` whose layout was published in full, the planner's best plan
//! for the same model, cluster, precision, batch and framework behaviour predicts a step time no
//! worse than the published layout's own predicted step time.

use parallax_cost::transformer::Setup;
use parallax_hardware::Cluster;
use parallax_ir::Layout;
use parallax_planner::{parse_cases, search, Case, SearchOptions, TransformerCase};
use parallax_sim::simulate_step;
use rayon::prelude::*;
use std::path::PathBuf;

fn cases_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/ground-truth/public.json")
}

/// The published layout when every knob was published.
fn published(c: &TransformerCase) -> Option<Layout> {
    let p = &c.plan;
    let schedule = p.schedule?;
    Some(Layout {
        dp: p.dp?,
        tp: p.tp?,
        pp: p.pp?,
        cp: p.cp?,
        ep: 1,
        etp: None,
        dispatcher: Default::default(),
        ep_overlap: false,
        zero_stage: p.zero_stage?,
        micro_batch: p.micro_batch?,
        recompute: p.recompute?,
        sequence_parallel: p.sequence_parallel?,
        schedule,
        interleave: p.interleave?,
        offload: parallax_ir::Offload::None,
        stages: Vec::new(),
        batch_norm: Default::default(),
    })
}

#[test]
fn the_planner_is_never_worse_than_a_published_layout() {
    let path = cases_file();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: the tests read the published runs from ../shared beside the clone, as CI has it",
            path.display()
        )
    });
    let file = parse_cases(&text, "public.json").unwrap();
    // (id, published step, published fits, planner step, planner layout), in parallel.
    let results: Vec<(String, f64, bool, f64, String)> = file
        .cases
        .par_iter()
        .filter_map(|case| {
            let Case::Transformer(case) = case else {
                return None;
            };
            let layout = published(case)?;
            let cfg = case.transformer().unwrap();
            let cluster = Cluster::parse(&format!(
                "{}:gpus={}",
                case.cluster.preset, case.cluster.gpus
            ))
            .unwrap();
            let fw = case.framework();
            let setup = Setup {
                precision: case.precision,
                runtime: fw.runtime,
                ..Setup::new(
                    &cfg,
                    &cluster.profile,
                    cluster.gpus,
                    case.model.seq_len,
                    case.plan.global_batch,
                )
            };
            let theirs = simulate_step(&setup, &layout).unwrap().prediction;
            let opts = SearchOptions {
                top_k: 1,
                families: false,
                ..SearchOptions::default()
            };
            let ours = search(&setup, &opts).unwrap();
            Some((
                case.id.clone(),
                theirs.step_time_s,
                theirs.fits,
                ours.best().prediction.step_time_s,
                parallax_planner::layout_string(&ours.best().layout),
            ))
        })
        .collect();
    let mut lines = Vec::new();
    for (id, theirs, fits, ours, layout) in &results {
        lines.push(format!(
            "{id:<40} published {theirs:>8.3} s{} planner {ours:>8.3} s ({:+.1} %)  {layout}",
            if *fits { "" } else { " (OOM)" },
            (ours / theirs - 1.0) * 100.0,
        ));
    }
    let checked = results.len();
    eprintln!("{}", lines.join("\n"));
    for (id, theirs, fits, ours, _) in &results {
        if *fits {
            assert!(
                *ours <= theirs * (1.0 + 1e-9),
                "{id}: planner {ours} s > published {theirs} s"
            );
        }
    }
    assert!(checked >= 15, "{checked} fully published cases");
}
