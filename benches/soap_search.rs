//! Search time of the per-op (SOAP) planner, as `parallax plan` runs it on a graph (criterion):
//! the exact search on the whole batch, the MCMC refinement and the pipeline candidates.
//!
//! - inception-v3 on `dgx-a100-80gb:gpus=64`, global batch 2048: target ≤ 5 s.
//! - resnet101 and lstm-lm on 16 GPUs: target ≤ 2 s each.
//!
//! `cargo bench -p parallax-planner --bench soap_search`.

use criterion::{criterion_group, criterion_main, Criterion};
use parallax_cost::soap::Optimizer;
use parallax_hardware::Cluster;
use parallax_ir::{load_model, Graph, Precision};
use parallax_planner::soap::{plan_graph, GraphJob, SoapOptions};
use std::hint::black_box;
use std::time::Duration;

fn bench_case(c: &mut Criterion, name: &str, spec: &str, batch: u64, seq: u64) {
    let model = load_model(name).expect("zoo model");
    let cluster = Cluster::parse(spec).expect("cluster");
    let build =
        |b: u64| -> Result<Graph, String> { model.graph(b, seq, true).map_err(|e| e.to_string()) };
    let job = GraphJob {
        nchw: false,
        batch_norm: Default::default(),
        build: &build,
        profile: &cluster.profile,
        gpus: cluster.gpus,
        precision: Precision::Bf16,
        optimizer: Optimizer::SgdMomentum,
        global_batch: batch,
    };
    let opts = SoapOptions::default();
    let r = plan_graph(&job, &opts).expect("a plan");
    eprintln!(
        "{name} on {spec}: {:.4} s per step, {:.2}x data parallelism",
        r.prediction.step_time_s,
        r.data_parallel
            .as_ref()
            .map_or(f64::NAN, |d| d.step_time_s / r.prediction.step_time_s)
    );
    c.bench_function(&format!("soap plan {name} {spec} batch {batch}"), |b| {
        b.iter(|| black_box(plan_graph(&job, &opts).expect("a plan")))
    });
}

fn soap_search(c: &mut Criterion) {
    bench_case(c, "inception-v3", "dgx-a100-80gb:gpus=64", 2048, 1);
    bench_case(c, "resnet101", "dgx-a100-80gb:gpus=16", 512, 1);
    bench_case(c, "lstm-lm", "dgx-a100-80gb:gpus=16", 256, 35);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(20));
    targets = soap_search
}
criterion_main!(benches);
