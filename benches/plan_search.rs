//! Search time of `parallax plan` over the full structured space (criterion).
//!
//! - gpt3-175b on `dgx-a100-80gb:gpus=1024`, global batch 1536 (seq 2048): target < 1 s.
//! - llama3-405b on `dgx-h100-80gb:gpus=16384`, global batch 2048, seq 8192: target < 5 s.
//! - deepseek-v3 in fp8 on `dgx-h100-80gb:gpus=1024`, global batch 8192, seq 4096 (expert,
//!   expert-tensor and dispatcher choices on top): target ≤ 2 s.
//!
//! All run the search exactly as `parallax plan` does (top 5, family bests for the
//! explanation). `cargo bench -p parallax-planner --bench plan_search`.

use criterion::{criterion_group, criterion_main, Criterion};
use parallax_cost::transformer::Setup;
use parallax_hardware::Cluster;
use parallax_ir::models::TransformerConfig;
use parallax_ir::{load_model, Precision};
use parallax_planner::{search, SearchOptions};
use std::hint::black_box;
use std::time::Duration;

fn model(name: &str) -> TransformerConfig {
    load_model(name)
        .expect("zoo model")
        .transformer()
        .expect("a transformer")
        .clone()
}

fn bench_case(
    c: &mut Criterion,
    name: &str,
    spec: &str,
    (batch, seq): (u64, u64),
    precision: Precision,
) {
    let cfg = model(name);
    let cluster = Cluster::parse(spec).expect("cluster");
    let setup = Setup {
        precision,
        ..Setup::new(&cfg, &cluster.profile, cluster.gpus, seq, batch)
    };
    let opts = SearchOptions::default();
    let r = search(&setup, &opts).expect("a plan");
    eprintln!("{name} on {spec}: {}", r.summary_line());
    c.bench_function(
        &format!("plan {name} {spec} batch {batch} seq {seq} {precision}"),
        |b| b.iter(|| black_box(search(&setup, &opts).expect("a plan"))),
    );
}

fn plan_search(c: &mut Criterion) {
    let bf16 = Precision::Bf16;
    bench_case(
        c,
        "gpt3-175b",
        "dgx-a100-80gb:gpus=1024",
        (1536, 2048),
        bf16,
    );
    bench_case(
        c,
        "llama3-405b",
        "dgx-h100-80gb:gpus=16384",
        (2048, 8192),
        bf16,
    );
    let fp8 = Precision::Fp8;
    bench_case(
        c,
        "deepseek-v3",
        "dgx-h100-80gb:gpus=1024",
        (8192, 4096),
        fp8,
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(20));
    targets = plan_search
}
criterion_main!(benches);
