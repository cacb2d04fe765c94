//! Property-based fuzzing of every input format parallax reads: HuggingFace configs and graph
//! JSON (model files), plan JSON, validation case files, cluster-profile TOML, ONNX and
//! checkpoints. Each target starts from a valid document and mutates it (bytes flipped,
//! inserted or cut; JSON leaves replaced by hostile values); every parse must return — a value
//! or an error — without panicking, and an accepted model must build its graph. CI runs a
//! short, seeded pass (the same inputs every time); a long fuzzing run sets `PROPTEST_CASES`
//! and a random `PROPTEST_RNG_SEED`, e.g. `PROPTEST_CASES=20000 PROPTEST_RNG_SEED=$RANDOM
//! cargo test -p parallax --release --test fuzz_inputs`.

use parallax_hardware::ClusterProfile;
use parallax_ir::load::load_json;
use parallax_ir::Plan;
use proptest::prelude::*;
use serde_json::Value;
use std::path::Path;

/// `default` cases from a fixed seed, unless `PROPTEST_CASES` / `PROPTEST_RNG_SEED` say
/// otherwise (a long fuzzing run).
fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    let rng_seed = match std::env::var("PROPTEST_RNG_SEED") {
        Ok(_) => ProptestConfig::default().rng_seed,
        Err(_) => proptest::test_runner::RngSeed::Fixed(0x5eed_2026),
    };
    ProptestConfig {
        cases,
        rng_seed,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ir/tests/fixtures")
            .join(name),
    )
    .unwrap()
}

/// A byte-level mutation of `seed`.
#[derive(Debug, Clone)]
enum ByteEdit {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Cut(usize, usize),
}

fn byte_edits() -> impl Strategy<Value = Vec<ByteEdit>> {
    let edit = prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| ByteEdit::Flip(i, b)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, v)| ByteEdit::Insert(i, v)),
        (any::<usize>(), 1usize..64).prop_map(|(i, n)| ByteEdit::Cut(i, n)),
    ];
    prop::collection::vec(edit, 1..6)
}

fn apply(seed: &[u8], edits: &[ByteEdit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % (len + 1) };
        match e {
            ByteEdit::Flip(i, x) if !b.is_empty() => {
                let n = b.len();
                b[i % n] ^= x | 1;
            }
            ByteEdit::Flip(..) => {}
            ByteEdit::Insert(i, v) => {
                let p = at(*i, b.len());
                b.splice(p..p, v.iter().copied());
            }
            ByteEdit::Cut(i, n) => {
                let p = at(*i, b.len());
                let end = (p + n).min(b.len());
                b.drain(p..end);
            }
        }
    }
    b
}

/// Values a careless or hostile user puts where a number or string belongs.
fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(Value::Bool(true)),
        Just(serde_json::json!(0)),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(1)),
        Just(serde_json::json!(3)),
        Just(serde_json::json!(u64::MAX)),
        Just(serde_json::json!(i64::MIN)),
        Just(serde_json::json!(1u64 << 32)),
        Just(serde_json::json!(1u64 << 62)),
        Just(serde_json::json!(1e308)),
        Just(serde_json::json!(-0.5)),
        Just(serde_json::json!(1e-300)),
        Just(serde_json::json!("")),
        Just(serde_json::json!("NaN")),
        Just(serde_json::json!("\u{1b}[31m\n")),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        any::<u32>().prop_map(|n| serde_json::json!(n)),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
    ]
}

/// Every leaf and container of `v`, by its path of keys and indices.
fn paths(v: &Value, here: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(here.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                here.push(Value::String(k.clone()));
                paths(x, here, out);
                here.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                here.push(serde_json::json!(i));
                paths(x, here, out);
                here.pop();
            }
        }
        _ => {}
    }
}

fn at_path<'v>(v: &'v mut Value, path: &[Value]) -> &'v mut Value {
    path.iter().fold(v, |v, k| match k {
        Value::String(s) => &mut v[s.as_str()],
        other => &mut v[other.as_u64().unwrap() as usize],
    })
}

/// `seed` with `n` of its values (chosen by `picks`) replaced by `values`; a pick of a key
/// removes it instead when `remove` says so.
fn json_mutation(seed: &Value, picks: &[(usize, bool)], values: &[Value]) -> Value {
    let mut v = seed.clone();
    for ((pick, remove), value) in picks.iter().zip(values) {
        let mut all = Vec::new();
        paths(&v, &mut Vec::new(), &mut all);
        let path = &all[pick % all.len()];
        match path.split_last() {
            Some((Value::String(k), parent)) if *remove => {
                if let Some(m) = at_path(&mut v, parent).as_object_mut() {
                    m.remove(k);
                }
            }
            _ => *at_path(&mut v, path) = value.clone(),
        }
    }
    v
}

fn json_edits() -> impl Strategy<Value = (Vec<(usize, bool)>, Vec<Value>)> {
    (
        prop::collection::vec((any::<usize>(), prop::bool::weighted(0.2)), 1..4),
        prop::collection::vec(hostile_value(), 4),
    )
}

/// Loads a model file's text and, when accepted, builds its graph and counts it.
fn model_text(text: &str) {
    if let Ok(m) = load_json(text, "fuzz.json", "fuzz".into()) {
        let seq = m.default_seq().min(64);
        if let Ok(g) = m.graph(2, seq, true) {
            let _ = g.param_count();
        }
    }
}

const HF_LLAMA: &str = r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":4,"intermediate_size":128,"vocab_size":100,"max_position_embeddings":128,"rope_theta":10000.0,"tie_word_embeddings":false}"#;
const HF_MIXTRAL: &str = r#"{"model_type":"mixtral","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":8,"intermediate_size":128,"vocab_size":100,"num_local_experts":4,"num_experts_per_tok":2}"#;
const HF_GPT2: &str = r#"{"model_type":"gpt2","n_embd":64,"n_layer":2,"n_head":8,"vocab_size":100,"n_positions":128}"#;
const HF_BERT: &str = r#"{"model_type":"bert","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":8,"intermediate_size":128,"vocab_size":100,"max_position_embeddings":128}"#;
const HF_DEEPSEEK: &str = r#"{"model_type":"deepseek_v3","hidden_size":64,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":4,"intermediate_size":128,"moe_intermediate_size":32,"n_routed_experts":8,"n_shared_experts":1,"num_experts_per_tok":2,"first_k_dense_replace":1,"moe_layer_freq":1,"q_lora_rank":32,"kv_lora_rank":16,"qk_nope_head_dim":16,"qk_rope_head_dim":8,"v_head_dim":16,"num_nextn_predict_layers":1,"n_group":4,"topk_group":2,"norm_topk_prob":true,"routed_scaling_factor":2.5,"scoring_func":"sigmoid","vocab_size":100,"max_position_embeddings":128}"#;
const HF_NEMOTRON_H: &str = r#"{"model_type":"nemotron_h","hidden_size":64,"num_hidden_layers":5,"hybrid_override_pattern":"ME*M-","num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":96,"moe_intermediate_size":32,"moe_shared_expert_intermediate_size":48,"n_routed_experts":8,"num_experts_per_tok":2,"mamba_num_heads":8,"mamba_head_dim":16,"ssm_state_size":8,"n_groups":2,"chunk_size":8,"vocab_size":100}"#;
const HF_GPT_OSS: &str = r#"{"model_type":"gpt_oss","hidden_size":64,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":32,"num_local_experts":8,"num_experts_per_tok":2,"vocab_size":100,"sliding_window":8,"layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"],"attention_bias":true}"#;
const HF_QWEN2_MOE: &str = r#"{"model_type":"qwen2_moe","hidden_size":64,"num_hidden_layers":4,"num_attention_heads":8,"num_key_value_heads":8,"intermediate_size":128,"moe_intermediate_size":32,"shared_expert_intermediate_size":64,"num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":false,"decoder_sparse_step":2,"vocab_size":100}"#;

fn graph_json() -> String {
    let m = parallax_ir::load_model("resnet50").unwrap();
    parallax_ir::load::graph_to_json(&m.graph(2, 1, true).unwrap())
}

/// Plan seeds: a 3D layout, an MoE one with its dispatch overlapped, and a DualPipe one.
fn plan_json(seed: usize) -> String {
    use parallax_ir::{Layout, Schedule};
    let (model, spec, gpus, batch, layout) = match seed % 3 {
        0 => (
            "gpt3-1.3b",
            "dgx-a100-80gb:gpus=8",
            8,
            16,
            Layout {
                dp: 2,
                tp: 2,
                pp: 2,
                schedule: Schedule::OneFOneB,
                ..Layout::default()
            },
        ),
        1 => (
            "mixtral-8x7b",
            "dgx-h100-80gb:gpus=64",
            64,
            256,
            Layout {
                dp: 16,
                pp: 4,
                ep: 8,
                ep_overlap: true,
                schedule: Schedule::Interleaved1F1B,
                interleave: 2,
                ..Layout::default()
            },
        ),
        _ => (
            "gpt3-1.3b",
            "dgx-a100-80gb:gpus=8",
            8,
            16,
            Layout {
                dp: 2,
                pp: 4,
                schedule: Schedule::DualPipe,
                ..Layout::default()
            },
        ),
    };
    let plan: Value = serde_json::json!({
        "schema": "parallax-plan/1",
        "model": {"name": model},
        "cluster": {"spec": spec, "gpus": gpus},
        "training": {"global_batch": batch, "seq_len": 2048, "precision": "bf16"},
        "layout": layout
    });
    plan.to_string()
}

/// Every HuggingFace seed the config target mutates.
const HF_SEEDS: [&str; 8] = [
    HF_LLAMA,
    HF_MIXTRAL,
    HF_GPT2,
    HF_BERT,
    HF_DEEPSEEK,
    HF_QWEN2_MOE,
    HF_NEMOTRON_H,
    HF_GPT_OSS,
];

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn hf_configs_never_panic(seed in 0usize..HF_SEEDS.len(), (picks, values) in json_edits(), edits in byte_edits(), bytes_too in any::<bool>()) {
        let seed: Value = serde_json::from_str(HF_SEEDS[seed]).unwrap();
        let text = json_mutation(&seed, &picks, &values).to_string();
        model_text(&text);
        if bytes_too {
            model_text(&String::from_utf8_lossy(&apply(text.as_bytes(), &edits)));
        }
    }

    #[test]
    fn graph_json_never_panics((picks, values) in json_edits(), edits in byte_edits()) {
        let text = graph_json();
        let seed: Value = serde_json::from_str(&text).unwrap();
        model_text(&json_mutation(&seed, &picks, &values).to_string());
        model_text(&String::from_utf8_lossy(&apply(text.as_bytes(), &edits)));
    }

    #[test]
    fn plan_json_never_panics(seed in 0usize..3, (picks, values) in json_edits(), edits in byte_edits()) {
        let text = plan_json(seed);
        prop_assert!(Plan::from_json(&text, "plan.json").is_ok());
        let seed: Value = serde_json::from_str(&text).unwrap();
        let _ = Plan::from_json(&json_mutation(&seed, &picks, &values).to_string(), "plan.json");
        let _ = Plan::from_json(&String::from_utf8_lossy(&apply(text.as_bytes(), &edits)), "plan.json");
    }

    #[test]
    fn case_files_never_panic((picks, values) in json_edits(), edits in byte_edits()) {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../validation/held-out.json"),
        )
        .unwrap();
        let seed: Value = serde_json::from_str(&text).unwrap();
        let mutated = json_mutation(&seed, &picks, &values).to_string();
        if let Ok(cases) = parallax_planner::validate::parse_cases(&mutated, "cases.json") {
            let _ = parallax_planner::validate::validate(&cases.cases);
        }
        let _ = parallax_planner::validate::parse_cases(
            &String::from_utf8_lossy(&apply(text.as_bytes(), &edits)),
            "cases.json",
        );
    }

    #[test]
    fn profile_toml_never_panics(edits in byte_edits(), line in any::<usize>(), value in prop_oneof![
        Just("nan"), Just("inf"), Just("-inf"), Just("-1.0"), Just("0"), Just("1e308"),
        Just("\"x\""), Just("[]"), Just("{}"), Just("18446744073709551615"), Just("true"),
    ]) {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../hardware-profiles/profiles/dgx-a100-80gb.toml"),
        )
        .unwrap();
        // Replace the value of one `key = value` line.
        let lines: Vec<&str> = text.lines().collect();
        let keyed: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].contains(" = ")).collect();
        let i = keyed[line % keyed.len()];
        let key = lines[i].split(" = ").next().unwrap();
        let mut edited: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        edited[i] = format!("{key} = {value}");
        if let Ok(p) = ClusterProfile::from_toml_str(&edited.join("\n"), "p.toml") {
            // An accepted profile prices and simulates a step without panicking.
            let m = parallax_ir::load_model("gpt-tiny").unwrap();
            let m = m.transformer().unwrap();
            let setup = parallax_cost::transformer::Setup::new(m, &p, 8, 64, 8);
            let _ = parallax_planner::complete_layout(&setup, &parallax_ir::PartialLayout::default());
        }
        let _ = ClusterProfile::from_toml_str(&String::from_utf8_lossy(&apply(text.as_bytes(), &edits)), "p.toml");
    }

    #[test]
    fn onnx_never_panics(seed in 0usize..3, edits in byte_edits()) {
        let bytes = fixture(["mlp.onnx", "lstm_lm.onnx", "resnet50.onnx"][seed]);
        let _ = parallax_ir::import::onnx::import_onnx_bytes(&apply(&bytes, &edits), "m.onnx", Some(2));
    }
}

proptest! {
    // Each case writes a checkpoint to disk: fewer of them.
    #![proptest_config(config(64))]

    #[test]
    fn checkpoints_never_panic((picks, values) in json_edits(), edits in byte_edits(), which in any::<bool>()) {
        use parallax_executor::state;
        let dir = std::env::temp_dir().join(format!("parallax-fuzz-ck-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = parallax_executor::ModelState { step: 2, ..Default::default() };
        for name in ["a", "b"] {
            s.tensors.insert(name.into(), parallax_executor::TensorState {
                shape: vec![2, 3],
                param: vec![0.5; 6],
                m: vec![0.0; 6],
                v: vec![0.0; 6],
            });
        }
        let ck = state::save(&dir, &s, serde_json::json!({"model": "fuzz"})).unwrap();
        let header = std::fs::read_to_string(ck.join("state.json")).unwrap();
        if which {
            let seed: Value = serde_json::from_str(&header).unwrap();
            std::fs::write(ck.join("state.json"), json_mutation(&seed, &picks, &values).to_string()).unwrap();
        } else {
            let bin = std::fs::read(ck.join("tensors.bin")).unwrap();
            std::fs::write(ck.join("tensors.bin"), apply(&bin, &edits)).unwrap();
        }
        if let Ok(loaded) = state::load(&dir) {
            // Whatever is accepted is finite and whole.
            for t in loaded.tensors.values() {
                prop_assert!(t.param.iter().chain(&t.m).chain(&t.v).all(|x| x.is_finite()));
                prop_assert_eq!(t.param.len(), t.shape.iter().product::<usize>());
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

proptest! {
    #![proptest_config(config(48))]

    /// Whatever job is asked, a prediction is physical: MFU and HFU at most 100 %, a positive
    /// finite step time, and a plan that "fits" needs no more memory than a device has.
    #[test]
    fn predictions_are_physical(
        model in prop::sample::select(vec![
            "gpt-tiny", "gpt3-1.3b", "llama3-8b", "mixtral-8x7b", "bert-large",
            "qwen3-30b-a3b", "gpt-oss-20b", "nemotron-h", "deepseek-v3",
        ]),
        cluster in prop::sample::select(vec!["dgx-a100-80gb", "dgx-h100-80gb", "dgx1-v100-16gb"]),
        gpus_log2 in 0u32..7,
        batch_log2 in 0u32..12,
        seq_log2 in 4u32..14,
        // Knobs a user may force: each completion path (schedules, the overlapped dispatch,
        // offload) is asked for, not only the ones the search prefers.
        forced in prop::sample::select(vec![
            "", "schedule=1f1b", "schedule=interleaved-1f1b", "schedule=zb-h1",
            "schedule=dualpipe", "ep_overlap=true", "dispatcher=deepep", "zero=3",
            "offload=optimizer", "recompute=full", "cp=2",
        ]),
    ) {
        let Ok(m) = parallax_ir::load_model(model) else { return Ok(()) };
        let Some(t) = m.transformer() else { return Ok(()) };
        let seq = (1u64 << seq_log2).min(t.max_seq);
        let Ok(c) = parallax_hardware::Cluster::parse(&format!("{cluster}:gpus={}", 1u32 << gpus_log2)) else {
            return Ok(());
        };
        let mut setup = parallax_cost::transformer::Setup::new(t, &c.profile, c.gpus, seq, 1 << batch_log2);
        if c.profile.device.peak_tflops(setup.precision).is_none() {
            setup.precision = parallax_ir::Precision::Fp16;
        }
        let partial = parallax_ir::PartialLayout::parse_transformer(forced).unwrap();
        match parallax_planner::complete_layout(&setup, &partial) {
            Ok(done) => {
                let p = &done.prediction;
                prop_assert!(p.step_time_s.is_finite() && p.step_time_s > 0.0, "{p:?}");
                prop_assert!(p.mfu <= 1.0 && p.hfu <= 1.0, "{p:?}");
                prop_assert!(p.fits && p.peak_memory_gib <= p.capacity_gib, "{p:?}");
            }
            Err(parallax_planner::CompleteError::DoesNotFit { need_gib, have_gib, .. }) => {
                prop_assert!(need_gib > have_gib);
            }
            Err(_) => {}
        }
    }
}

/// Every HuggingFace seed is a valid model that builds: a fuzz target starting from a refused
/// document would only test the first error.
#[test]
fn hf_seeds_load_and_build() {
    for text in HF_SEEDS {
        let m = load_json(text, "seed.json", "seed".into()).unwrap();
        assert!(m.graph(2, 16, true).unwrap().param_count() > 0, "{text}");
    }
}
