//! `plan` and `simulate` on graphs that are not transformers (the per-op path), end to end: the
//! plan a search writes re-loads into `simulate` with the same prediction, inline layouts work,
//! data parallelism is never beaten by the chosen plan's prediction of it, and a broken plan
//! file is one line with status 2.

mod common;

use common::{json_of as json, parallax};

const JOB: [&str; 6] = [
    "--model",
    "resnet50",
    "--cluster",
    "dgx-a100-80gb:gpus=8",
    "--global-batch",
    "128",
];

#[test]
fn a_cnn_plans_and_its_plan_reloads_with_the_same_prediction() {
    let dir = std::env::temp_dir().join(format!("parallax-graph-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    let mut args = vec!["plan"];
    args.extend(JOB);
    args.extend(["--json", "--out", &d]);
    let doc = json(&parallax(&args));
    let step = doc["step_time_s"].as_f64().unwrap();
    assert!(step > 0.0);
    assert!(doc["mfu"].as_f64().unwrap() < 1.0);
    assert!(doc["speedup_over_data_parallel"].as_f64().unwrap() >= 1.0 - 1e-9);
    assert!(doc["search"]["exact"].as_bool().unwrap());
    // The ZeRO stage the search settled on is written with the plan and named in its summary.
    let zero = doc["plan"]["layout"]["zero_stage"].as_u64().unwrap();
    let layout = doc["layout"].as_str().unwrap();
    assert_eq!(
        layout.contains(&format!("ZeRO-{zero}")),
        zero > 0,
        "{layout}"
    );
    let ops = doc["plan"]["op_configs"].as_array().unwrap();
    assert!(ops.len() > 100, "{}", ops.len());
    for f in [
        "plan.json",
        "report.md",
        "trace.json",
        "timeline.svg",
        "memory.svg",
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    let memory = std::fs::read_to_string(dir.join("memory.svg")).unwrap();
    assert!(memory.contains("Peak memory per device"));
    let timeline = std::fs::read_to_string(dir.join("timeline.svg")).unwrap();
    assert!(timeline.matches("<rect").count() > 10);
    // Re-simulating the written plan gives the same step time.
    let plan = dir.join("plan.json");
    let p = plan.to_string_lossy().into_owned();
    let mut args = vec!["simulate"];
    args.extend(JOB);
    args.extend(["--plan", &p, "--json"]);
    let again = json(&parallax(&args));
    let t = again["step_time_s"].as_f64().unwrap();
    assert!((t - step).abs() <= 1e-9 * step, "{t} vs {step}");
    // A second --out into the same folder is refused.
    let mut args = vec!["plan"];
    args.extend(JOB);
    args.extend(["--out", &d]);
    let out = parallax(&args);
    assert_eq!(out.status.code(), Some(2));
    // A plan naming another node is one line, status 2, naming the field.
    let text = std::fs::read_to_string(&plan).unwrap();
    let broken = dir.join("broken.json");
    std::fs::write(&broken, text.replacen("\"conv1\"", "\"conv0\"", 1)).unwrap();
    let b = broken.to_string_lossy().into_owned();
    let mut args = vec!["simulate"];
    args.extend(JOB);
    args.extend(["--plan", &b]);
    let out = parallax(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("op_configs[0]"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inline_layouts_simulate_data_parallelism_and_pipelines() {
    let simulate = |plan: &str, json_flag: &[&str]| {
        let mut args = vec![
            "simulate",
            "--model",
            "lstm-lm",
            "--cluster",
            "dgx-a100-80gb:gpus=4",
            "--global-batch",
            "64",
            "--plan",
            plan,
        ];
        args.extend(json_flag);
        parallax(&args)
    };
    let dp = json(&simulate("dp=4", &["--json"]));
    assert_eq!(dp["stages"], 1);
    assert_eq!(dp["used_devices"], 4);
    let pp = json(&simulate("dp=2,pp=2,mb=4", &["--json"]));
    assert_eq!(pp["stages"], 2);
    assert_eq!(pp["micro_batches"], 8);
    assert!(pp["bubble_fraction"].as_f64().unwrap() > 0.0);
    assert_eq!(simulate("cp=2", &[]).status.code(), Some(2));
}

/// `zero=` on a graph's inline layout: each stage keeps less per device (optimizer states,
/// then gradients, then the weights, sharded over their replicas), the summary names it, a
/// per-op pipeline refuses ZeRO-3 in one line, and the executor trains a ZeRO plan to the
/// losses of plain data parallelism.
#[test]
fn zero_stages_shard_a_graphs_states_and_train_as_data_parallelism() {
    let simulate = |plan: &str| {
        let mut args = vec!["simulate"];
        args.extend(JOB);
        args.extend(["--plan", plan, "--json"]);
        parallax(&args)
    };
    let mut last = f64::INFINITY;
    for z in 0..=3 {
        let doc = json(&simulate(&format!("dp=8,zero={z}")));
        let peak = doc["peak_memory_gib"].as_f64().unwrap();
        assert!(peak < last, "zero={z}: {peak} GiB after {last}");
        last = peak;
        let layout = doc["layout"].as_str().unwrap();
        assert_eq!(layout.contains(&format!("ZeRO-{z}")), z > 0, "{layout}");
    }
    let out = simulate("dp=4,pp=2,zero=3");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("zero stage 3"), "{err}");
    let losses = |plan: &str| run_resnet_tiny(plan, "3", &[])["losses"].clone();
    assert_eq!(losses("dp=2,zero=2"), losses("dp=2"));
}

/// `bn=local` keeps BatchNorm's statistics per device: the step no longer waits for their
/// all-reduces, the summary and the written plan say so, the plan re-loads with the same
/// prediction, the executor trains it (differently from the synchronised default), and a
/// transformer refuses the key in one line.
#[test]
fn local_batch_norm_is_a_plan_setting_priced_and_run() {
    let dir = std::env::temp_dir().join(format!("parallax-bn-{}", std::process::id()));
    let simulate = |plan: &str| {
        let mut args = vec!["simulate"];
        args.extend(JOB);
        args.extend(["--plan", plan, "--json"]);
        json(&parallax(&args))
    };
    let sync = simulate("dp=8");
    let local = simulate("dp=8,bn=local");
    let step = |d: &serde_json::Value| d["step_time_s"].as_f64().unwrap();
    assert!(
        step(&local) < step(&sync),
        "{} vs {}",
        step(&local),
        step(&sync)
    );
    assert!(sync["layout"]
        .as_str()
        .unwrap()
        .contains("synchronised BatchNorm"));
    assert!(local["layout"]
        .as_str()
        .unwrap()
        .contains("per-device BatchNorm"));
    // The search keeps what --fix says, writes it and re-loads it.
    let out = dir.join("local");
    let mut args = vec!["plan"];
    args.extend(JOB);
    args.extend([
        "--fix",
        "bn=local",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    let planned = json(&parallax(&args));
    assert!(planned["layout"]
        .as_str()
        .unwrap()
        .contains("per-device BatchNorm"));
    let written = out.join("plan.json");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&written).unwrap()).unwrap();
    assert_eq!(doc["layout"]["batch_norm"], "local");
    let again = simulate(written.to_str().unwrap());
    assert_eq!(step(&again), step(&planned));
    // 8 samples per device: local statistics are warned about, synchronised ones cover 64.
    let warned = |fix: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            "resnet50",
            "--cluster",
            "dgx-a100-80gb:gpus=8",
            "--global-batch",
            "64",
        ];
        args.extend(fix);
        let out = parallax(&args);
        assert_eq!(out.status.code(), Some(0));
        String::from_utf8_lossy(&out.stdout).contains("statistics cover 8 samples per device")
    };
    assert!(warned(&["--fix", "bn=local"]));
    assert!(!warned(&[]));
    let losses = |plan: &str| run_resnet_tiny(plan, "3", &[])["losses"].clone();
    assert_ne!(losses("dp=2,bn=local"), losses("dp=2"));
    for (cmd, flag) in [("simulate", "--plan"), ("plan", "--fix")] {
        let refused = parallax(&[
            cmd,
            "--model",
            "gpt-tiny",
            "--cluster",
            "dgx-a100-80gb:gpus=2",
            "--global-batch",
            "8",
            flag,
            "dp=2,bn=local",
        ]);
        assert_eq!(refused.status.code(), Some(2));
        let err = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("bn"), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `run --json` of resnet-tiny (8 samples a step) under an inline `plan`, `extra` flags added.
fn run_resnet_tiny(plan: &str, steps: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "run",
        "--model",
        "resnet-tiny",
        "--plan",
        plan,
        "--global-batch",
        "8",
        "--steps",
        steps,
        "--json",
    ];
    args.extend(extra);
    json(&parallax(&args))
}

/// `--memory-format nchw` prices cuDNN's transposes around tensor-core convolutions: slower
/// in TF32 than channels-last, the same in fp32 (the SIMT pipes run NCHW natively).
#[test]
fn nchw_costs_tensor_core_convolutions_their_transposes() {
    let step = |precision: &str, format: &str| {
        let mut args = vec!["simulate"];
        args.extend(JOB);
        args.extend([
            "--plan",
            "dp=8",
            "--precision",
            precision,
            "--memory-format",
            format,
            "--json",
        ]);
        json(&parallax(&args))["step_time_s"].as_f64().unwrap()
    };
    assert!(step("tf32", "nchw") > 1.05 * step("tf32", "channels-last"));
    assert_eq!(step("fp32", "nchw"), step("fp32", "channels-last"));
}

/// `run` trains a model that is not a GPT or Llama (a CNN, an RNN, a ViT) under an inline layout of every kind the
/// per-op path lays out (sample, parameter and pipeline splits) and under the plans `plan`
/// writes for it, with the per-op simulator's prediction beside the measurement.
#[test]
fn run_trains_cnns_and_rnns_under_inline_layouts_and_searched_plans() {
    for (model, seq) in [("resnet-tiny", "1"), ("lstm-tiny", "12"), ("vit-tiny", "1")] {
        for layout in ["dp=2", "dp=1,tp=2", "pp=2,mb=2"] {
            let doc = json(&parallax(&[
                "run",
                "--model",
                model,
                "--plan",
                layout,
                "--global-batch",
                "8",
                "--seq",
                seq,
                "--steps",
                "3",
                "--json",
            ]));
            let losses = doc["losses"].as_array().unwrap();
            assert_eq!(losses.len(), 3, "{model} {layout}");
            assert!(losses.iter().all(|l| l.as_f64().unwrap().is_finite()));
            assert_eq!(doc["ranks"], 2, "{model} {layout}");
            assert!(doc["predicted_step_time_s"].as_f64().unwrap() > 0.0);
        }
        let doc = run_searched_plan(model, &["--seq", seq]);
        assert_eq!(
            doc["losses"].as_array().unwrap().len(),
            2,
            "{model}: searched plan"
        );
    }
}

/// Plans `model` on two CPU cores (8 samples, fp32, `extra` flags) into a fresh folder, runs
/// the written plan.json for two steps and returns the run's JSON document.
fn run_searched_plan(model: &str, extra: &[&str]) -> serde_json::Value {
    let name = std::path::Path::new(model)
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let dir = std::env::temp_dir().join(format!("parallax-run-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    let mut args = vec![
        "plan",
        "--model",
        model,
        "--cluster",
        "cpu-local:gpus=2",
        "--precision",
        "fp32",
        "--global-batch",
        "8",
        "--json",
        "--out",
        &d,
    ];
    args.extend_from_slice(extra);
    json(&parallax(&args));
    let plan = dir.join("plan.json").to_string_lossy().into_owned();
    let doc = json(&parallax(&["run", &plan, "--steps", "2", "--json"]));
    let _ = std::fs::remove_dir_all(&dir);
    doc
}

/// Unusable data and an unwritable trace are refused before anything runs.
#[test]
fn run_of_a_cnn_refuses_what_its_trainer_lacks_in_one_line() {
    for extra in [
        ["--data", "/etc/hostname"],
        ["--trace", "/nonexistent-dir/t.json"],
    ] {
        let mut args = vec![
            "run",
            "--model",
            "resnet-tiny",
            "--plan",
            "dp=2",
            "--global-batch",
            "8",
        ];
        args.extend(extra);
        let out = parallax(&args);
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(extra[0]), "{err}");
    }
}

/// An ONNX export of an inference graph trains against a cross-entropy on its logits.
#[test]
fn run_trains_an_onnx_classifier_against_its_logits() {
    let mlp =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ir/tests/fixtures/mlp.onnx");
    let m = mlp.to_string_lossy().into_owned();
    let doc = json(&parallax(&[
        "run",
        "--model",
        &m,
        "--plan",
        "dp=2",
        "--global-batch",
        "8",
        "--steps",
        "3",
        "--json",
    ]));
    let losses = doc["losses"].as_array().unwrap();
    assert_eq!(losses.len(), 3);
    assert!(losses
        .iter()
        .all(|l| l.as_f64().unwrap().is_finite() && l.as_f64().unwrap() > 0.0));
    // The plan a search writes for it names the file, so `run PLAN.json` trains the same graph.
    let doc = run_searched_plan(&m, &[]);
    assert_eq!(doc["model"], "mlp");
}

/// Real data: the byte-level LSTM language model learns a text file, and the tiny ResNet an
/// image set written by `scripts/make_shapes.py`, over 200 steps each.
#[test]
fn run_learns_a_text_file_and_an_image_set_over_200_steps() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let falls = |doc: &serde_json::Value| {
        let l: Vec<f64> = doc["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let first = l[..10].iter().sum::<f64>() / 10.0;
        let last = l[l.len() - 10..].iter().sum::<f64>() / 10.0;
        (first, last)
    };
    let text = root.join("README.md").to_string_lossy().into_owned();
    let doc = json(&parallax(&[
        "run",
        "--model",
        "lstm-tiny",
        "--data",
        &text,
        "--plan",
        "dp=2",
        "--global-batch",
        "16",
        "--seq",
        "32",
        "--steps",
        "200",
        "--lr",
        "3e-3",
        "--json",
    ]));
    let (first, last) = falls(&doc);
    assert!(
        last < 0.8 * first,
        "lstm-tiny on README.md: loss {first:.3} → {last:.3}"
    );
    let dir = std::env::temp_dir().join(format!("parallax-shapes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let set = dir.join("shapes.pximg");
    let made = std::process::Command::new("python3")
        .arg(root.join("scripts/make_shapes.py"))
        .args(["--count", "1024", "--out"])
        .arg(&set)
        .status();
    match made {
        Ok(s) if s.success() => {}
        other => {
            eprintln!(
                "skipping the image half: python3 scripts/make_shapes.py did not run ({other:?})"
            );
            return;
        }
    }
    let s = set.to_string_lossy().into_owned();
    let doc = json(&parallax(&[
        "run",
        "--model",
        "resnet-tiny",
        "--data",
        &s,
        "--plan",
        "dp=2",
        "--global-batch",
        "32",
        "--steps",
        "200",
        "--lr",
        "3e-3",
        "--json",
    ]));
    let (first, last) = falls(&doc);
    assert!(
        last < 0.5 * first,
        "resnet-tiny on shapes: loss {first:.3} → {last:.3}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The transformer layouts the executor gained: expert, context and zero-bubble pipeline
/// parallelism, and DeepSeek-V3's latent attention, each trained from the command line.
#[test]
fn run_trains_expert_context_and_zero_bubble_layouts() {
    for (model, plan) in [
        ("mixtral-tiny", "dp=2,ep=2"),
        ("llama-tiny", "cp=2"),
        ("gpt-tiny", "pp=2,schedule=zb-h1"),
        ("deepseek-tiny", "tp=2,sp=true"),
    ] {
        let doc = json(&parallax(&[
            "run",
            "--model",
            model,
            "--plan",
            plan,
            "--global-batch",
            "4",
            "--seq",
            "32",
            "--steps",
            "2",
            "--json",
        ]));
        let losses = doc["losses"].as_array().unwrap();
        assert_eq!(losses.len(), 2, "{model} {plan}");
        assert!(
            losses.iter().all(|l| l.as_f64().unwrap().is_finite()),
            "{model} {plan}"
        );
        assert_eq!(doc["ranks"], 2, "{model} {plan}");
    }
}

/// A CNN run saves checkpoints and a later run resumes from them, under another plan, to the
/// losses the uninterrupted run has.
#[test]
fn a_cnn_run_saves_and_resumes_to_the_same_losses() {
    let dir = std::env::temp_dir().join(format!("parallax-cnn-ck-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    let run = run_resnet_tiny;
    let whole = run("dp=2", "4", &[]);
    let trace = dir.with_extension("trace.json");
    let t = trace.to_string_lossy().into_owned();
    run("dp=2", "2", &["--save", &d, "--trace", &t]);
    assert!(dir.join("LATEST").is_file());
    // The timeline has every op's forward and backward on both devices.
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    for (name, tid) in [("F conv1 mb0", 0), ("B fc mb0", 1), ("grad-sync", 0)] {
        assert!(
            events.iter().any(|e| e["name"] == name && e["tid"] == tid),
            "{name} on device {tid}"
        );
    }
    let _ = std::fs::remove_file(&trace);
    let resumed = run("dp=1,tp=2", "2", &["--resume", &d]);
    let a: Vec<f64> = whole["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let b: Vec<f64> = resumed["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    for (x, y) in b.iter().zip(&a[2..]) {
        assert!((x - y).abs() <= 1e-4 * y.abs(), "resumed {b:?} vs {a:?}");
    }
    // A checkpoint of another model is refused in one line naming --resume.
    let out = parallax(&[
        "run",
        "--model",
        "lstm-tiny",
        "--plan",
        "dp=2",
        "--global-batch",
        "4",
        "--resume",
        &d,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--resume") && err.trim().lines().count() == 1,
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
