//! `parallax simulate`: predict one training step of a layout.

use crate::fmt::{bytes, table};
use crate::job::{Job, JobArgs, Loaded};
use crate::user;
use clap::Args as ClapArgs;
use parallax_cost::{step_time_band, Setup};
use parallax_ir::{Layout, PartialLayout, GIB};
use parallax_planner::report::{one_line, part_name, plan_job_differences};
use parallax_planner::{complete_or_smallest, layout_string};
use parallax_sim::{simulate_step, SimulatedStep};
use std::path::PathBuf;

/// Predict step time, throughput, MFU and memory of one layout.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    job: JobArgs,
    /// A plan JSON file, or an inline layout `tp=8,pp=8,dp=16,zero=1,mb=1,recompute=selective,
    /// sp=true,schedule=interleaved-1f1b,v=2`; keys left out are chosen as the fastest that fits.
    #[arg(long)]
    plan: String,
    /// Write the predicted step as a Chrome / Perfetto trace to this file.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Overwrite the --trace file if it exists.
    #[arg(long)]
    force: bool,
    /// Print one JSON document.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if let Some(t) = &a.trace {
        crate::refuse_overwrite(t, a.force)?;
    }
    let job = match a.job.load()? {
        Loaded::Transformer(job) => job,
        Loaded::Graph(g) => {
            return crate::general::simulate(
                &g,
                &a.job.cluster,
                &a.plan,
                a.json,
                a.trace.as_deref(),
            )
        }
    };
    let setup = job.setup();
    let layout = resolve_layout(&a.plan, &job, &a.job.model)?;
    job.note_unpriced();
    let sim = simulate_step(&setup, &layout)
        .map_err(|e| user(format!("--plan {}: {e}", layout_string(&layout))))?;
    let band = step_time_band(&job.cluster.profile);
    if let Some(t) = &a.trace {
        let doc = sim.trace.to_chrome_trace(&sim.graph, &sim.resources);
        std::fs::write(t, serde_json::to_string(&doc)?)
            .map_err(|e| user(format!("{}: cannot write: {e}", t.display())))?;
    }
    if a.json {
        let mut doc = parallax_planner::report::prediction_json(&sim.prediction, &layout, band);
        doc["framework"] = job.framework.name.clone().into();
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        let title = format!("{} on {}", job.name, a.job.cluster);
        print_report(&title, &job.framework.name, &sim, &layout, band);
        print_layer_costs(&setup, &layout);
    }
    Ok(())
}

/// One micro-batch of each part of the model on one device of the layout: its passes, its
/// recomputation and the communication each waits on, before the pipeline schedule and the
/// overlap of expert dispatch with other micro-batches (`transformer_costs`).
pub(crate) fn print_layer_costs(setup: &Setup, layout: &Layout) {
    let Ok(c) = parallax_cost::transformer_costs(setup, layout) else {
        return;
    };
    let counts = setup.model.layer_kinds_in(0, setup.model.layers);
    let ms = |s: parallax_ir::Seconds| format!("{:.2}", s.0 * 1e3);
    let row = |name: String, n: String, p: &parallax_cost::PartCost| {
        vec![
            name,
            n,
            ms(p.compute.fwd),
            ms(p.compute.bwd_input),
            ms(p.compute.bwd_weight),
            ms(p.recompute),
            ms(p.tp_fwd + p.tp_bwd),
            ms(p.cp_fwd + p.cp_bwd),
            ms(p.ep_fwd + p.ep_bwd),
            bytes(p.saved.0 as f64),
        ]
    };
    let mut rows = vec![row("embedding".into(), "-".into(), &c.embedding)];
    rows.extend(
        c.layer_kinds_named()
            .map(|(k, p)| row(k.name().to_string(), counts[k.index()].to_string(), p)),
    );
    rows.push(row("head".into(), "-".into(), &c.head));
    println!();
    println!("one micro-batch on one device (ms), before the schedule and expert-dispatch overlap");
    print!(
        "{}",
        table(
            &[
                "part",
                "layers",
                "forward",
                "input grad",
                "weight grad",
                "recompute",
                "TP comm",
                "CP comm",
                "EP dispatch",
                "kept",
            ],
            &rows
        )
    );
}

/// The layout from a plan file or an inline spec (left-out keys completed by the search), with
/// the knobs a `--ds-config` fixes. A plan made for another model, or with knobs the ds_config
/// sets otherwise, is refused; one made for another job (batch, sequence, precision, fp8
/// recipe, asynchronous TP, token dropping, stack) is simulated as the flags say, with a note
/// for each difference.
fn resolve_layout(spec: &str, job: &Job, model: &str) -> anyhow::Result<Layout> {
    let setup = &job.setup();
    let (space, framework) = (&job.framework.space, job.framework.name.as_str());
    let path = std::path::Path::new(spec);
    if spec.ends_with(".json") || path.is_file() {
        let plan = crate::read_plan(path)?;
        if plan.model.name != model {
            return Err(user(format!(
                "--plan {spec}: made for model {}, not {model}",
                one_line(&plan.model.name)
            )));
        }
        job.fixes(&format!("--plan {spec}"), PartialLayout::from(&plan.layout))?;
        for note in plan_job_differences(&plan, setup, framework) {
            eprintln!("note: {spec} {note}");
        }
        return Ok(plan.layout);
    }
    let partial =
        PartialLayout::parse_transformer(spec).map_err(|e| user(format!("--plan: {e}")))?;
    let partial = job.fixes("--plan", partial)?;
    // Nothing fits: the completion that needs the least memory is simulated, and the report
    // says by how much it is over.
    complete_or_smallest(setup, &partial, space)
        .map(|(layout, _)| layout)
        .map_err(|e| user(format!("--plan {spec}: {e}")))
}

pub(crate) fn print_report(
    title: &str,
    stack: &str,
    sim: &SimulatedStep,
    layout: &Layout,
    band: f64,
) {
    let p = &sim.prediction;
    println!("{title}: {}", layout_string(layout));
    println!("stack       {stack}");
    let (low, high) = parallax_cost::band_range(p.step_time_s, band);
    println!(
        "step time   {:.3} s  (band {low:.3} – {high:.3} s)   {:.0} tokens/s   MFU {:.1} %   HFU {:.1} %",
        p.step_time_s,
        p.tokens_per_s,
        p.mfu * 100.0,
        p.hfu * 100.0
    );
    println!(
        "pipeline    {} micro-batches, layers per virtual stage {:?}, bubble {:.1} %",
        p.micro_batches,
        p.stage_layers,
        p.bubble_fraction * 100.0
    );
    let rows: Vec<Vec<String>> = p
        .breakdown
        .parts()
        .into_iter()
        .map(|(k, x)| vec![part_name(k).to_string(), format!("{x:.3}")])
        .collect();
    println!();
    print!(
        "{}",
        table(
            &["time on the busiest stage (communication: exposed)", "s"],
            &rows
        )
    );
    let m = &p.memory;
    let g = |x: f64| bytes(x * GIB);
    println!();
    println!(
        "memory      {} reserved of {} on the fullest stage ({} allocated): params {}, grads {}, optimizer {}, activations {}, buffers {}, allocator {}",
        g(m.total),
        g(p.capacity_gib),
        g(m.allocated),
        g(m.params),
        g(m.grads),
        g(m.optimizer),
        g(m.activations),
        g(m.buffers),
        g(m.allocator)
    );
    if !p.fits {
        println!(
            "DOES NOT FIT: {:.1} GiB over the {:.0} GiB of one device",
            p.reserved_memory_gib - p.capacity_gib,
            p.capacity_gib
        );
    }
}
