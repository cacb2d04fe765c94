//! Simulator speed (issue 3 targets): a gpt3-175b plan on 1,024 A100s at ≥ 1,000 simulations
//! per second on one core; a llama3-405b plan on 16,384 H100s in < 50 ms.

use criterion::{criterion_group, criterion_main, Criterion};
use parallax_cost::Setup;
use parallax_hardware::preset;
use parallax_ir::models::zoo;
use parallax_ir::{Layout, Recompute, Schedule};
use parallax_sim::simulate_step;
use std::hint::black_box;

/// Megatron-style interleaved 1F1B (v = 2) with tp 8, ZeRO-1, selective recompute and SP.
fn layout(dp: u32, pp: u32) -> Layout {
    Layout {
        dp,
        tp: 8,
        pp,
        micro_batch: 1,
        zero_stage: 1,
        recompute: Recompute::Selective,
        sequence_parallel: true,
        schedule: Schedule::Interleaved1F1B,
        interleave: 2,
        ..Layout::default()
    }
}

fn bench(c: &mut Criterion) {
    let a100 = preset("dgx-a100-80gb").unwrap();
    let gpt3 = zoo::transformer("gpt3-175b").unwrap();
    let s = Setup::new(&gpt3, &a100, 1024, 2048, 1536);
    let l = layout(16, 8);
    c.bench_function("simulate gpt3-175b on 1024 A100 (tp8 pp8 v2 dp16)", |b| {
        b.iter(|| simulate_step(black_box(&s), black_box(&l)).unwrap())
    });

    let h100 = preset("dgx-h100-80gb").unwrap();
    let llama = zoo::transformer("llama3-405b").unwrap();
    let s = Setup::new(&llama, &h100, 16384, 8192, 2048);
    let l = layout(128, 16);
    c.bench_function(
        "simulate llama3-405b on 16384 H100 (tp8 pp16 v2 dp128)",
        |b| b.iter(|| simulate_step(black_box(&s), black_box(&l)).unwrap()),
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
