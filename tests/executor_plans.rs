//! Nothing the per-op search can choose is refused by the executor: every configuration the
//! SOAP search considers for every op of every zoo model that is not a GPT or Llama is
//! accepted by the general-graph trainer, and on the tiny models, plans that cycle through
//! those configurations op by op train as one device does.

use parallax_cost::soap::{Optimizer, ParallelConfig};
use parallax_executor::graph::{op_plan, run_graph_threads, GraphPrepared, GraphRunSpec};
use parallax_hardware::Cluster;
use parallax_ir::graph::NodeId;
use parallax_ir::models::zoo::{entries, ZooDef};
use parallax_ir::{load_model, Graph, Precision};
use parallax_planner::soap::{configurations, graph_costs};

/// Every op's candidate configurations on `gpus` devices of an A100 node.
fn candidates(g: &Graph, gpus: u32) -> Vec<Vec<ParallelConfig>> {
    let cluster = Cluster::parse(&format!("dgx-a100-80gb:gpus={gpus}")).unwrap();
    let costs = graph_costs(
        g,
        &cluster.profile,
        gpus,
        Precision::Bf16,
        Optimizer::Adam,
        false,
    )
    .unwrap();
    (0..g.nodes.len())
        .map(|n| configurations(&costs, NodeId(n as u32), gpus))
        .collect()
}

/// Plans whose op `i` takes candidate `k mod count` of its own, for every `k` up to the
/// longest list: together they cover every candidate of every op.
fn cycling_plans(g: &Graph, cands: &[Vec<ParallelConfig>]) -> Vec<parallax_sim::perop::OpPlan> {
    let longest = cands.iter().map(Vec::len).max().unwrap_or(1);
    (0..longest)
        .map(|k| op_plan(g, 1, |i| cands[i][k % cands[i].len()].clone()))
        .collect()
}

#[test]
fn the_executor_accepts_every_configuration_the_search_considers() {
    for e in entries() {
        let (ZooDef::Batched(_) | ZooDef::Sequence(_)) = e.def else {
            continue;
        };
        let model = load_model(e.name).unwrap();
        let g = model.graph(8, 8, true).unwrap();
        let cands = candidates(&g, 8);
        for (k, plan) in cycling_plans(&g, &cands).into_iter().enumerate() {
            if let Err(err) = GraphPrepared::new(&GraphRunSpec::new(g.clone(), plan, 1)) {
                panic!("{}: cycling plan {k}: {err}", e.name);
            }
        }
    }
}

#[test]
fn cycling_plans_of_the_tiny_models_train_as_one_device() {
    for name in ["resnet-tiny", "lstm-tiny", "vit-tiny"] {
        let g = load_model(name).unwrap().graph(8, 6, true).unwrap();
        let cands = candidates(&g, 4);
        for (k, plan) in cycling_plans(&g, &cands).into_iter().enumerate() {
            let mut spec = GraphRunSpec::new(g.clone(), plan, 2);
            spec.collect_state = true;
            let got = run_graph_threads(&spec).unwrap();
            let want = run_graph_threads(&spec.single_device()).unwrap();
            for (a, b) in got.losses.iter().zip(&want.losses) {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs(),
                    "{name} plan {k}: loss {a} vs {b}"
                );
            }
            let (d, worst) = got
                .state
                .unwrap()
                .max_relative_diff_where(want.state.as_ref().unwrap(), |n| {
                    !n.ends_with("attn.k.bias")
                });
            assert!(d <= 1e-4, "{name} plan {k}: {worst} differs by {d:e}");
        }
    }
}

/// The structured search's plans for the tiny transformers (dense, GQA, mixture of experts,
/// DeepSeek-V3's latent attention and routing), BERT-large and Nemotron-H's hybrid stack on
/// 8 and 16 GPUs, planned for the executor's own stack: the 100 best of each, and the 20 best
/// with each feature the trainer must also run forced (zero-bubble pipelines, context
/// parallelism but over Mamba layers, whose scan runs along the whole sequence, and expert
/// parallelism for the mixtures). The transformer trainer accepts every one.
#[test]
fn the_executor_accepts_the_structured_search_s_plans() {
    use parallax_cost::transformer::Setup;
    use parallax_executor::{Prepared, RunSpec};
    use parallax_ir::PartialLayout;
    use parallax_planner::search::{search, SearchOptions};
    let own = parallax_planner::framework::Framework::parse("parallax").unwrap();
    for name in [
        "gpt-tiny",
        "llama-tiny",
        "mixtral-tiny",
        "deepseek-tiny",
        "bert-large",
        "nemotron-h",
    ] {
        let model = parallax_ir::models::zoo::transformer(name).unwrap();
        let mut forced = vec![("", 100), ("schedule=zb-h1", 20)];
        if model.hybrid.is_none() {
            forced.push(("cp=2", 20));
        }
        if model.moe.is_some() {
            forced.push(("ep=2", 20));
        }
        for gpus in [8u32, 16] {
            let cluster = Cluster::parse(&format!("dgx-a100-80gb:gpus={gpus}")).unwrap();
            let (seq, batch) = (128, 64);
            let setup = Setup {
                runtime: own.runtime,
                ..Setup::new(&model, &cluster.profile, gpus, seq, batch)
            };
            for (force, top_k) in &forced {
                let opts = SearchOptions {
                    top_k: *top_k,
                    space: own.space.clone(),
                    force: PartialLayout::parse(force).unwrap(),
                    families: false,
                    ..SearchOptions::default()
                };
                let r = search(&setup, &opts).unwrap();
                assert!(!r.top.is_empty(), "{name} on {gpus}, {force:?}");
                let has = |l: &parallax_ir::Layout| match *force {
                    "schedule=zb-h1" => l.schedule == parallax_ir::Schedule::ZeroBubbleH1,
                    "cp=2" => l.cp == 2,
                    "ep=2" => l.ep == 2,
                    _ => true,
                };
                assert!(r.top.iter().all(|e| has(&e.layout)), "{name}: {force}");
                for e in &r.top {
                    let spec = RunSpec::new(model.clone(), e.layout.clone(), batch, seq, 1);
                    if let Err(err) = Prepared::new(&spec) {
                        panic!("{name} on {gpus} GPUs: {:?}: {err}", e.layout);
                    }
                }
            }
        }
    }
}
