//! Kernel gradients against finite differences, and per-op plans against one device.

use super::kernels::{self, Ctx, Reduce};
use super::*;
use parallax_cost::soap::MachineView;
use parallax_ir::graph::{conv, GraphBuilder};
use parallax_ir::models::{resnet::resnet_tiny, rnn::lstm_tiny, vision::vit_tiny};
use parallax_ir::op::{
    Activation, AttentionAttrs, AxisAttrs, Conv2dAttrs, Pool2dAttrs, PoolKind, RnnAttrs,
    SoftmaxAttrs, SplitAttrs, TransposeAttrs,
};
use parallax_ir::{AxisRole, BatchNormStats, DType};
use std::collections::BTreeMap;

fn full(s: &Shape) -> Region {
    s.dims().iter().map(|d| (0, *d)).collect()
}

/// Largest relative error of the analytic gradients of node `node` of `g` (at full regions,
/// one device) against central differences of `Σ r · y` for a random `r`.
fn grad_error(g: &Graph, node: usize) -> f64 {
    let n = &g.nodes[node];
    let ins_full = g.input_shapes(n);
    let outs_full = g.output_shapes(n);
    let out_regions: Vec<Region> = outs_full.iter().map(full).collect();
    let ints: Vec<Option<u64>> = n
        .inputs
        .iter()
        .map(|t| {
            (!g.tensor(*t).dtype.is_float()).then(|| match &n.op {
                OpKind::Embedding(a) => a.vocab,
                _ => ins_full[0].last(),
            })
        })
        .collect();
    let ins: Vec<Local> = ins_full
        .iter()
        .zip(&ints)
        .enumerate()
        .map(|(k, (s, int))| Local {
            region: full(s),
            data: (0..s.elems())
                .map(|i| {
                    let h = mix(mix(k as u64 * 7919 + i));
                    match int {
                        Some(v) => (h % v) as f32,
                        None => unit(h),
                    }
                })
                .collect(),
        })
        .collect();
    let coord = |_: char| (0u32, 1u32);
    let run = |ins: &[Local]| -> (Vec<Vec<f32>>, kernels::Saved) {
        let mut reduce = |_: &mut [f32], _: Reduce| Ok(());
        let mut ctx = Ctx {
            op: &n.op,
            ins_full: &ins_full,
            outs_full: &outs_full,
            out_regions: &out_regions,
            coord: &coord,
            key: 7,
            reduce: &mut reduce,
            local_stats: false,
        };
        let refs: Vec<&Local> = ins.iter().collect();
        kernels::forward(&mut ctx, &refs).unwrap()
    };
    let (outs, saved) = run(&ins);
    let r: Vec<Vec<f32>> = outs
        .iter()
        .enumerate()
        .map(|(o, y)| {
            (0..y.len())
                .map(|i| unit(mix(99 + o as u64 * 31 + i as u64)))
                .collect()
        })
        .collect();
    let objective = |outs: &[Vec<f32>]| -> f64 {
        outs.iter()
            .zip(&r)
            .map(|(y, r)| y.iter().zip(r).map(|(a, b)| f64::from(a * b)).sum::<f64>())
            .sum()
    };
    let need: Vec<bool> = ints.iter().map(|i| i.is_none()).collect();
    let grads = {
        let mut reduce = |_: &mut [f32], _: Reduce| Ok(());
        let mut ctx = Ctx {
            op: &n.op,
            ins_full: &ins_full,
            outs_full: &outs_full,
            out_regions: &out_regions,
            coord: &coord,
            key: 7,
            reduce: &mut reduce,
            local_stats: false,
        };
        let refs: Vec<&Local> = ins.iter().collect();
        kernels::backward(&mut ctx, &refs, &saved, &r, &need).unwrap()
    };
    let mut worst = 0.0f64;
    for (k, gk) in grads.iter().enumerate() {
        let Some(gk) = gk else {
            assert!(!need[k], "{}: input {k} got no gradient", n.name);
            continue;
        };
        assert_eq!(gk.len(), ins[k].data.len(), "{}: input {k}", n.name);
        let len = gk.len();
        for j in (0..len).step_by((len / 23).max(1)) {
            let eps = 1e-2f32;
            let mut plus = ins.clone();
            plus[k].data[j] += eps;
            let mut minus = ins.clone();
            minus[k].data[j] -= eps;
            let num =
                (objective(&run(&plus).0) - objective(&run(&minus).0)) / (2.0 * f64::from(eps));
            let err =
                (num - f64::from(gk[j])).abs() / (num.abs().max(f64::from(gk[j]).abs()).max(0.1));
            if err > worst {
                worst = err;
            }
        }
    }
    worst
}

fn one_op(build: impl FnOnce(&mut GraphBuilder) -> TensorId) -> Graph {
    let mut b = GraphBuilder::new("op");
    let y = build(&mut b);
    let mut g = b.finish(&[y]).unwrap();
    g.outputs.clear();
    g
}

#[test]
fn every_kernel_matches_finite_differences() {
    let x4 = |b: &mut GraphBuilder| b.input("x", [2, 4, 7, 6], DType::F32);
    let cases: Vec<(&str, Graph)> = vec![
        (
            "conv stride 2 pad 1 bias",
            one_op(|b| {
                let x = x4(b);
                let mut a = conv(6, 3, 2, 1);
                a.bias = true;
                b.conv2d("c", x, a).unwrap()
            }),
        ),
        (
            "grouped conv dilated",
            one_op(|b| {
                let x = x4(b);
                let a = Conv2dAttrs {
                    groups: 2,
                    dilation: [2, 1],
                    ..conv(4, 3, 1, 2)
                };
                b.conv2d("c", x, a).unwrap()
            }),
        ),
        (
            "max pool",
            one_op(|b| {
                let x = x4(b);
                b.op1(
                    "p",
                    OpKind::Pool2d(Pool2dAttrs {
                        kind: PoolKind::Max,
                        kernel: [3, 3],
                        stride: [2, 2],
                        padding: [1, 1],
                    }),
                    &[x],
                )
                .unwrap()
            }),
        ),
        (
            "avg pool",
            one_op(|b| {
                let x = x4(b);
                b.op1(
                    "p",
                    OpKind::Pool2d(Pool2dAttrs {
                        kind: PoolKind::Avg,
                        kernel: [3, 2],
                        stride: [1, 2],
                        padding: [1, 0],
                    }),
                    &[x],
                )
                .unwrap()
            }),
        ),
        (
            "global avg pool",
            one_op(|b| {
                let x = x4(b);
                b.op1("p", OpKind::GlobalAvgPool, &[x]).unwrap()
            }),
        ),
        (
            "batch norm",
            one_op(|b| {
                let x = x4(b);
                b.batch_norm("bn", x).unwrap()
            }),
        ),
        (
            "linear",
            one_op(|b| {
                let x = b.input("x", [3, 2, 5], DType::F32);
                b.linear("l", x, 4, true).unwrap()
            }),
        ),
        (
            "embedding",
            one_op(|b| {
                let x = b.input("ids", [3, 4], DType::I64);
                b.embedding("e", x, 9, 5).unwrap().0
            }),
        ),
        (
            "gelu",
            one_op(|b| {
                let x = b.input("x", [3, 5], DType::F32);
                b.activation("a", Activation::Gelu, x).unwrap()
            }),
        ),
        (
            "tanh",
            one_op(|b| {
                let x = b.input("x", [3, 5], DType::F32);
                b.activation("a", Activation::Tanh, x).unwrap()
            }),
        ),
        (
            "add broadcast",
            one_op(|b| {
                let x = b.input("x", [3, 4, 5], DType::F32);
                let y = b.input("y", [4, 1], DType::F32);
                b.op1("a", OpKind::Add, &[x, y]).unwrap()
            }),
        ),
        (
            "mul",
            one_op(|b| {
                let x = b.input("x", [3, 4], DType::F32);
                let y = b.input("y", [3, 4], DType::F32);
                b.op1("m", OpKind::Mul, &[x, y]).unwrap()
            }),
        ),
        (
            "softmax",
            one_op(|b| {
                let x = b.input("x", [3, 4, 5], DType::F32);
                b.op1("s", OpKind::Softmax(SoftmaxAttrs { axis: 1 }), &[x])
                    .unwrap()
            }),
        ),
        (
            "cross-entropy",
            one_op(|b| {
                let x = b.input("x", [3, 4, 6], DType::F32);
                let l = b.input("labels", [3, 4], DType::I64);
                b.op1("ce", OpKind::CrossEntropy, &[x, l]).unwrap()
            }),
        ),
        (
            "concat",
            one_op(|b| {
                let x = b.input("x", [2, 3, 4], DType::F32);
                let y = b.input("y", [2, 2, 4], DType::F32);
                b.op1("c", OpKind::Concat(AxisAttrs { axis: 1 }), &[x, y])
                    .unwrap()
            }),
        ),
        (
            "split",
            one_op(|b| {
                let x = b.input("x", [2, 5, 3], DType::F32);
                b.op(
                    "s",
                    OpKind::Split(SplitAttrs {
                        axis: 1,
                        sizes: vec![2, 3],
                    }),
                    &[x],
                )
                .unwrap()[1]
            }),
        ),
        (
            "transpose",
            one_op(|b| {
                let x = b.input("x", [2, 3, 4], DType::F32);
                b.op1(
                    "t",
                    OpKind::Transpose(TransposeAttrs {
                        perm: vec![2, 0, 1],
                    }),
                    &[x],
                )
                .unwrap()
            }),
        ),
        (
            "layer norm",
            one_op(|b| {
                let x = b.input("x", [3, 6], DType::F32);
                b.layer_norm("ln", x).unwrap()
            }),
        ),
        (
            "lstm",
            one_op(|b| {
                let x = b.input("x", [2, 4, 3], DType::F32);
                let w = b.weight("w_ih", [3, 20]);
                let u = b.weight("w_hh", [5, 20]);
                let c = b.weight("b", [20]);
                b.op1("lstm", OpKind::Lstm(RnnAttrs { hidden: 5 }), &[x, w, u, c])
                    .unwrap()
            }),
        ),
        (
            "causal grouped-query attention with dropout",
            one_op(|b| {
                let q = b.input("q", [2, 5, 4, 3], DType::F32);
                let k = b.input("k", [2, 5, 2, 3], DType::F32);
                let v = b.input("v", [2, 5, 2, 3], DType::F32);
                let a = AttentionAttrs {
                    causal: true,
                    fused: false,
                    dropout: true,
                    window: None,
                    alibi: false,
                };
                b.attention("attn", q, k, v, a).unwrap()
            }),
        ),
        (
            "gru",
            one_op(|b| {
                let x = b.input("x", [2, 4, 3], DType::F32);
                let w = b.weight("w_ih", [3, 15]);
                let u = b.weight("w_hh", [5, 15]);
                let c = b.weight("b", [15]);
                b.op1("gru", OpKind::Gru(RnnAttrs { hidden: 5 }), &[x, w, u, c])
                    .unwrap()
            }),
        ),
    ];
    for (what, g) in cases {
        let node = g.nodes.len() - 1;
        let e = grad_error(&g, node);
        assert!(e < 2e-2, "{what}: relative gradient error {e:.2e}");
    }
}

/// Runs `plan` and the same run on one device for 5 steps; returns the largest relative
/// loss and parameter differences.
fn against_one_device(g: Graph, plan: OpPlan, opt: GraphOptimizer) -> (f64, f64) {
    let mut spec = GraphRunSpec::new(g, plan, 5);
    spec.optimizer = opt;
    spec.collect_state = true;
    spec.timeout = Duration::from_secs(60);
    let got = run_graph_threads(&spec).unwrap();
    let want = run_graph_threads(&spec.single_device()).unwrap();
    let loss = got
        .losses
        .iter()
        .zip(&want.losses)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
        .fold(0.0, f64::max);
    // An attention key bias has an identically zero gradient (softmax ignores a constant per
    // row), so Adam moves it by rounding noise scaled to at most lr a step: it is checked to
    // stay that small instead.
    let key_bias = |n: &str| n.ends_with("attn.k.bias");
    let state = got.state.unwrap();
    let (params, worst) =
        state.max_relative_diff_where(want.state.as_ref().unwrap(), |n| !key_bias(n));
    if let GraphOptimizer::Adam(a) = opt {
        for (n, t) in state.tensors.iter().filter(|(n, _)| key_bias(n)) {
            let max = t.param.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            assert!(max <= 1.01 * a.lr * 5.0, "{n}: {max}");
        }
    }
    assert!(
        want.losses.iter().all(|l| l.is_finite()),
        "single-device losses {:?}",
        want.losses
    );
    eprintln!("loss {loss:.2e} params {params:.2e} (worst {worst})");
    (loss, params)
}

const SGD: GraphOptimizer = GraphOptimizer::Sgd {
    lr: 0.05,
    momentum: 0.9,
};

fn assert_equivalent(what: &str, (loss, params): (f64, f64)) {
    assert!(
        loss < 1e-4 && params < 1e-4,
        "{what}: loss {loss:.2e}, params {params:.2e}"
    );
}

#[test]
fn resnet_tiny_under_data_parallelism_matches_one_device() {
    let g = resnet_tiny(4).unwrap();
    let plan = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|_, r| r == AxisRole::Sample)
    });
    assert_equivalent("dp2", against_one_device(g, plan, SGD));
}

/// Local BatchNorm statistics under a sample split are each device's own: dp2 over a batch
/// of 4 trains as one device accumulating two micro-batches of 2 (each normalised by itself),
/// and differs from the synchronised run.
#[test]
fn local_batch_norm_normalises_each_devices_samples() {
    let run = |g: Graph, mut plan: OpPlan, bn: BatchNormStats| {
        plan.batch_norm = bn;
        let mut spec = GraphRunSpec::new(g, plan, 5);
        spec.optimizer = SGD;
        spec.collect_state = true;
        spec.timeout = Duration::from_secs(60);
        run_graph_threads(&spec).unwrap()
    };
    let g4 = resnet_tiny(4).unwrap();
    let dp2 = op_plan(&g4, 1, |i| {
        split_label(&g4, i, 2, 0, &|_, r| r == AxisRole::Sample)
    });
    let local = run(g4.clone(), dp2.clone(), BatchNormStats::Local);
    let sync = run(g4, dp2, BatchNormStats::Sync);
    let g2 = resnet_tiny(2).unwrap();
    let accumulated = op_plan(&g2, 2, |_| ParallelConfig::single(0));
    let one = run(g2, accumulated, BatchNormStats::Sync);
    let rel = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
            .fold(0.0, f64::max)
    };
    assert!(
        rel(&local.losses, &one.losses) < 1e-4,
        "{:?} vs {:?}",
        local.losses,
        one.losses
    );
    let (params, worst) = local
        .state
        .as_ref()
        .unwrap()
        .max_relative_diff_where(one.state.as_ref().unwrap(), |_| true);
    assert!(params < 1e-4, "{params:.2e} at {worst}");
    assert!(
        rel(&local.losses, &sync.losses) > 1e-3,
        "{:?} vs {:?}",
        local.losses,
        sync.losses
    );
}

/// Norm-relative difference of the Adam moments of two states, worst tensor.
fn moments_diff(a: &ModelState, b: &ModelState) -> (f64, String) {
    let rel = |x: &[f32], y: &[f32]| {
        let num: f64 = x.iter().zip(y).map(|(p, q)| f64::from(p - q).powi(2)).sum();
        let den: f64 = y.iter().map(|q| f64::from(*q).powi(2)).sum();
        (num / den.max(1e-30)).sqrt()
    };
    b.tensors
        .iter()
        .map(|(n, t)| {
            let o = &a.tensors[n];
            (rel(&o.m, &t.m).max(rel(&o.v, &t.v)), n.clone())
        })
        .fold((0.0, String::new()), |w, x| if x.0 > w.0 { x } else { w })
}

/// ZeRO in the general trainer: four replicas of every region split its Adam step (shards of
/// uneven length, padded, included) and all-gather the weights; the run matches one device
/// in losses, parameters and both moments, and a checkpoint taken under ZeRO resumes on one
/// device where the sharded run goes on.
#[test]
fn zero_shards_the_optimizer_step_over_replicas_and_matches_one_device() {
    use std::sync::Arc;
    let g = resnet_tiny(8).unwrap();
    let mut plan = op_plan(&g, 1, |i| {
        split_label(&g, i, 4, 0, &|_, r| r == AxisRole::Sample)
    });
    plan.zero_stage = 1;
    let adam = GraphOptimizer::Adam(AdamConfig::default());
    assert_equivalent(
        "dp4 zero1",
        against_one_device(g.clone(), plan.clone(), adam),
    );
    let mut spec = GraphRunSpec::new(g.clone(), plan.clone(), 4);
    spec.optimizer = adam;
    spec.collect_state = true;
    let whole = run_graph_threads(&spec).unwrap();
    let one = run_graph_threads(&spec.single_device()).unwrap();
    let (d, worst) = moments_diff(whole.state.as_ref().unwrap(), one.state.as_ref().unwrap());
    assert!(d < 1e-4, "moments of {worst} differ by {d:e}");
    // Two steps under ZeRO, checkpointed, then two on one device.
    let (a, st) = run_and_checkpoint(&g, &plan, 2, adam);
    let mut second = GraphRunSpec::new(g, plan, 2).single_device();
    second.optimizer = adam;
    second.collect_state = true;
    second.resume = Some(Arc::new(st));
    let b = run_graph_threads(&second).unwrap();
    for (x, y) in a.losses.iter().chain(&b.losses).zip(&whole.losses) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{x} vs {y}");
    }
    let (d, worst) = moments_diff(b.state.as_ref().unwrap(), whole.state.as_ref().unwrap());
    assert!(d < 1e-4, "resumed moments of {worst} differ by {d:e}");
}

#[test]
fn resnet_tiny_under_channel_and_spatial_splits_matches_one_device() {
    let g = resnet_tiny(2).unwrap();
    // Output channels of convolutions and fc columns, BatchNorm and pooling channels.
    let channels = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|l, r| {
            r == AxisRole::Parameter && l != 'c'
                || matches!(
                    g.nodes[i].op,
                    OpKind::BatchNorm | OpKind::Pool2d(_) | OpKind::GlobalAvgPool
                ) && l == 'c'
        })
    });
    assert_equivalent(
        "channel split",
        against_one_device(g.clone(), channels, SGD),
    );
    // Input channels: partial sums reduced by the consumer.
    let partial = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|l, _| {
            matches!(g.nodes[i].op, OpKind::Conv2d(_)) && l == 'c'
        })
    });
    assert_equivalent(
        "contracted split",
        against_one_device(g.clone(), partial, SGD),
    );
    // Image rows: halos for convolution and pooling windows, partial sums of the global pool.
    let spatial = op_plan(&g, 1, |i| split_label(&g, i, 2, 0, &|l, _| l == 'h'));
    assert_equivalent("spatial split", against_one_device(g, spatial, SGD));
}

#[test]
fn resnet_tiny_as_a_pipeline_and_a_mixed_plan_matches_one_device() {
    let g = resnet_tiny(4).unwrap();
    let half = g.nodes.len() / 2;
    let pipeline = op_plan(&g, 2, |i| ParallelConfig::single(u32::from(i >= half)));
    assert_equivalent(
        "2-stage pipeline",
        against_one_device(g.clone(), pipeline, SGD),
    );
    // Every op its own choice: sample splits over 0..4, channel splits over 2..4, a row split
    // over 1..3 and single devices, so data crosses between views of different shapes.
    let mixed = op_plan(&g, 1, |i| match i % 4 {
        0 => split_label(&g, i, 4, 0, &|_, r| r == AxisRole::Sample),
        1 => split_label(&g, i, 2, 2, &|l, r| r == AxisRole::Parameter && l != 'c'),
        2 => split_label(&g, i, 2, 1, &|l, _| l == 'h'),
        _ => ParallelConfig::single((i % 3) as u32),
    });
    assert_equivalent("mixed", against_one_device(g, mixed, SGD));
}

#[test]
fn lstm_tiny_under_data_parallelism_pipeline_and_vocabulary_split_matches_one_device() {
    let adam = GraphOptimizer::Adam(AdamConfig::default());
    let g = lstm_tiny(4, 6).unwrap();
    let dp = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|_, r| r == AxisRole::Sample)
    });
    assert_equivalent("lstm dp2", against_one_device(g.clone(), dp, adam));
    let pipeline = op_plan(&g, 2, |i| ParallelConfig::single(u32::from(i >= 2)));
    assert_equivalent(
        "lstm pipeline",
        against_one_device(g.clone(), pipeline, adam),
    );
    // The embedding's and decoder's vocabulary over two devices: partial-sum lookups and the
    // vocabulary-parallel loss.
    let vocab = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|l, _| matches!(l, 'v' | 'n'))
    });
    assert_equivalent("lstm vocabulary split", against_one_device(g, vocab, adam));
}

#[test]
fn the_tiny_cnn_learns_its_synthetic_images() {
    let g = resnet_tiny(16).unwrap();
    let plan = op_plan(&g, 1, |_| ParallelConfig::single(0));
    let mut spec = GraphRunSpec::new(g, plan, 40);
    spec.optimizer = GraphOptimizer::Adam(AdamConfig {
        lr: 3e-3,
        ..AdamConfig::default()
    });
    let r = run_graph_threads(&spec).unwrap();
    let first: f64 = r.losses[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = r.losses[35..].iter().sum::<f64>() / 5.0;
    assert!(last < 0.8 * first, "loss {first:.3} → {last:.3}");
}

#[test]
fn plans_the_executor_cannot_run_are_refused_with_the_op_named() {
    let g = resnet_tiny(2).unwrap();
    let mut plan = op_plan(&g, 1, |_| ParallelConfig::single(0));
    plan.configs[0] = ParallelConfig {
        degrees: BTreeMap::from([('n', 4)]),
        view: MachineView::block(0, 2),
    };
    let e = GraphPrepared::new(&GraphRunSpec::new(g.clone(), plan, 1)).unwrap_err();
    assert!(e.to_string().contains("op 'conv1'"), "{e}");
    plan = op_plan(&g, 1, |_| ParallelConfig::single(0));
    plan.configs.pop();
    assert!(GraphPrepared::new(&GraphRunSpec::new(g.clone(), plan, 1)).is_err());
    // A plan over more devices than the executor starts threads for.
    let far = op_plan(&g, 1, |_| ParallelConfig::single(100_000));
    let e = GraphPrepared::new(&GraphRunSpec::new(g, far, 1)).unwrap_err();
    assert!(e.to_string().contains("100001 devices"), "{e}");
}

#[test]
fn vit_tiny_under_data_head_and_sequence_splits_matches_one_device() {
    let adam = GraphOptimizer::Adam(AdamConfig::default());
    let g = vit_tiny(4).unwrap();
    let dp = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|_, r| r == AxisRole::Sample)
    });
    assert_equivalent("vit dp2", against_one_device(g.clone(), dp, adam));
    // Megatron's tensor parallelism op by op: attention heads, linear output columns.
    let heads = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|l, r| {
            r == AxisRole::Parameter && matches!(l, 'h' | 'n' | 'o')
        })
    });
    assert_equivalent("vit heads", against_one_device(g.clone(), heads, adam));
    // Query positions of attention (keys and values whole on each device), token rows of
    // the rest.
    let rows = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|l, r| {
            r == AxisRole::Attribute && l != 'h' && l != 'w'
        })
    });
    assert_equivalent("vit sequence", against_one_device(g, rows, adam));
}

#[test]
fn a_tied_embedding_and_head_under_different_splits_matches_one_device() {
    let mut b = GraphBuilder::new("tied");
    let tokens = b.input("tokens", [4, 5], DType::I64);
    let labels = b.input("labels", [4, 5], DType::I64);
    let (x, table) = b.embedding("wte", tokens, 12, 8).unwrap();
    let x = b.linear("mix", x, 8, true).unwrap();
    let logits = b
        .op1(
            "head",
            OpKind::MatMul(parallax_ir::op::MatMulAttrs { transpose_b: true }),
            &[x, table],
        )
        .unwrap();
    let loss = b
        .op1("loss", OpKind::CrossEntropy, &[logits, labels])
        .unwrap();
    let g = b.finish(&[loss]).unwrap();
    // The table split by rows for the lookup on devices 0-1, by columns of the logits for the
    // head on devices 1-2, the rest split by samples over 0-3.
    let plan = op_plan(&g, 1, |i| match g.nodes[i].name.as_str() {
        "wte" => split_label(&g, i, 2, 0, &|l, _| l == 'v'),
        "head" => split_label(&g, i, 2, 1, &|l, _| l == 'n'),
        _ => split_label(&g, i, 4, 0, &|_, r| r == AxisRole::Sample),
    });
    assert!(plan.configs.iter().all(|c| c.view.size > 1));
    assert_equivalent("tied", against_one_device(g, plan, SGD));
}

#[test]
fn an_inference_graph_gets_a_loss_on_its_logits_split_as_they_are() {
    let mut b = GraphBuilder::new("mlp");
    let x = b.input("x", [4, 6], DType::F32);
    let h = b.linear("fc1", x, 8, true).unwrap();
    let h = b.activation("relu", Activation::Relu, h).unwrap();
    let logits = b.linear("fc2", h, 5, true).unwrap();
    let g = b.finish(&[logits]).unwrap();
    let plan = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|_, r| r == AxisRole::Sample)
    });
    let (g2, plan2) = with_training_loss(&g, &plan).unwrap();
    assert_eq!(g2.nodes.len(), 4);
    assert_eq!(plan2.configs[3].view.size, 2, "{:?}", plan2.configs[3]);
    assert!(with_training_loss(&g2, &plan2).is_none());
    assert_equivalent("mlp", against_one_device(g2, plan2, SGD));
}

#[test]
fn image_sets_parse_and_refuse_what_is_wrong() {
    let mut bytes = data::IMAGES_MAGIC.to_vec();
    for v in [2u32, 1, 2, 2, 3] {
        bytes.extend(v.to_le_bytes());
    }
    bytes.extend([1, 0, 255, 128, 64]);
    bytes.extend([2, 10, 20, 30, 40]);
    let set = ImageSet::parse(&bytes).unwrap();
    assert_eq!((set.count, set.classes), (2, 3));
    assert_eq!(set.labels, vec![1, 2]);
    assert_eq!(set.pixel(0, 0, 0, 0), -2.0);
    assert_eq!(set.pixel(0, 0, 0, 1), 2.0);
    let mut bad_label = bytes.clone();
    bad_label[28 + 5] = 3;
    assert!(ImageSet::parse(&bad_label)
        .unwrap_err()
        .contains("image 1: label 3"));
    assert!(ImageSet::parse(&bytes[..bytes.len() - 1])
        .unwrap_err()
        .contains("needs 38"));
    assert!(ImageSet::parse(b"hello")
        .unwrap_err()
        .contains("parallax-images/1"));
    // An image set of the wrong size for the model is refused before training.
    let g = resnet_tiny(2).unwrap();
    let mut spec = GraphRunSpec::new(g.clone(), op_plan(&g, 1, |_| ParallelConfig::single(0)), 1);
    spec.data = GraphData::Images(std::sync::Arc::new(set));
    let e = GraphPrepared::new(&spec).unwrap_err().to_string();
    assert!(e.contains("images of 1×2×2"), "{e}");
}

#[test]
fn regions_copy_out_and_add_back_exactly() {
    // Every sub-box of a 3 × 4 × 5 box, copied out and added back into zeros, lands where it
    // came from and nowhere else.
    let outer: Region = vec![(2, 5), (0, 4), (10, 15)];
    let n = kernels::elems(&outer);
    let src: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
    let ranges = |(a, b): (u64, u64)| {
        (a..b)
            .flat_map(move |x| (x + 1..=b).map(move |y| (x, y)))
            .collect::<Vec<_>>()
    };
    for r0 in ranges(outer[0]) {
        for r1 in ranges(outer[1]) {
            for r2 in ranges(outer[2]).into_iter().step_by(3) {
                let sub: Region = vec![r0, r1, r2];
                let piece = extract(&src, &outer, &sub);
                assert_eq!(piece.len(), kernels::elems(&sub));
                let mut back = vec![0.0; n];
                add_piece(&mut back, &outer, &sub, &piece);
                for (i, (b, s)) in back.iter().zip(&src).enumerate() {
                    let (z, y, x) = (i / 20, i / 5 % 4, i % 5);
                    let inside = (r0.0..r0.1).contains(&(z as u64 + 2))
                        && (r1.0..r1.1).contains(&(y as u64))
                        && (r2.0..r2.1).contains(&(x as u64 + 10));
                    assert_eq!(*b, if inside { *s } else { 0.0 }, "{sub:?} at {i}");
                }
            }
        }
    }
}

#[test]
fn a_resumed_run_continues_exactly_where_it_stopped() {
    use std::sync::Arc;
    let g = resnet_tiny(4).unwrap();
    // A split that shards every weight differently across devices: channel splits.
    let plan = op_plan(&g, 1, |i| {
        split_label(&g, i, 2, 0, &|l, r| r == AxisRole::Parameter && l != 'c')
    });
    let adam = GraphOptimizer::Adam(AdamConfig::default());
    let mut whole = GraphRunSpec::new(g.clone(), plan.clone(), 4);
    whole.optimizer = adam;
    whole.collect_state = true;
    let uninterrupted = run_graph_threads(&whole).unwrap();
    let (a, st) = run_and_checkpoint(&g, &plan, 2, adam);
    assert_eq!(st.step, 2);
    // Resumed on one device: the state is layout-independent.
    let mut second = GraphRunSpec::new(g, plan, 2).single_device();
    second.optimizer = adam;
    second.collect_state = true;
    second.resume = Some(Arc::new(st));
    let b = run_graph_threads(&second).unwrap();
    let losses: Vec<f64> = a.losses.iter().chain(&b.losses).copied().collect();
    for (x, y) in losses.iter().zip(&uninterrupted.losses) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{losses:?} vs {:?}",
            uninterrupted.losses
        );
    }
    let (d, worst) = b
        .state
        .unwrap()
        .max_relative_diff_where(uninterrupted.state.as_ref().unwrap(), |_| true);
    assert!(d < 1e-4, "{worst} differs by {d:e}");
    // A checkpoint of another model is refused naming the tensor.
    let mut other = GraphRunSpec::new(
        lstm_tiny(2, 4).unwrap(),
        op_plan(&lstm_tiny(2, 4).unwrap(), 1, |_| ParallelConfig::single(0)),
        1,
    );
    other.resume = Some(Arc::new(saved_state_of_resnet()));
    let e = GraphPrepared::new(&other).unwrap_err().to_string();
    assert!(e.contains("resume:") && e.contains("missing"), "{e}");
}

/// Runs `plan` for `steps` steps under `opt` and returns the run and its last checkpoint.
fn run_and_checkpoint(
    g: &Graph,
    plan: &OpPlan,
    steps: u64,
    opt: GraphOptimizer,
) -> (RunReport, ModelState) {
    use std::sync::{Arc, Mutex};
    let saved: Arc<Mutex<Vec<ModelState>>> = Arc::default();
    let mut spec = GraphRunSpec::new(g.clone(), plan.clone(), steps);
    spec.optimizer = opt;
    let sink = saved.clone();
    spec.on_checkpoint = Some(Arc::new(move |st: &ModelState| {
        sink.lock().unwrap().push(st.clone());
        Ok(())
    }));
    let run = run_graph_threads(&spec).unwrap();
    let st = saved.lock().unwrap().pop().unwrap();
    (run, st)
}

fn saved_state_of_resnet() -> ModelState {
    let g = resnet_tiny(2).unwrap();
    let mut s = GraphRunSpec::new(g.clone(), op_plan(&g, 1, |_| ParallelConfig::single(0)), 1);
    s.collect_state = true;
    run_graph_threads(&s).unwrap().state.unwrap()
}
