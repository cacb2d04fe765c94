//! `parallax plan` end to end: bad input ends in one line and status 2; `--out` writes every
//! file and never overwrites an earlier report without `--force`; `--json` carries the contract
//! keys; `--export` writes the engine's file.

mod common;

use std::process::Output;

fn plan(args: &[&str]) -> Output {
    common::parallax(&[&["plan"], args].concat())
}

const SMALL: [&str; 6] = [
    "--model",
    "gpt2",
    "--cluster",
    "dgx-a100-80gb:gpus=8",
    "--global-batch",
    "16",
];

/// Without `--precision` a job trains in what its GPUs offer: bf16 on Ampere and later,
/// fp16 on Volta (no bf16 there), fp32 on Kepler; `--precision` still overrides it, and an
/// unsupported one is refused.
#[test]
fn the_default_precision_is_the_clusters() {
    for (cluster, precision) in [
        ("dgx-a100-80gb:gpus=8", "bf16"),
        ("dgx1-v100-16gb:gpus=8", "fp16"),
        ("gce-k80x8:gpus=8", "fp32"),
    ] {
        let out = plan(&[
            "--model",
            "gpt2",
            "--cluster",
            cluster,
            "--global-batch",
            "16",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{cluster}: {out:?}");
        assert!(
            text.lines()
                .next()
                .unwrap_or("")
                .ends_with(&format!(", {precision}")),
            "{cluster}: {text}"
        );
    }
    let out = plan(&[
        "--model",
        "gpt2",
        "--cluster",
        "dgx1-v100-16gb:gpus=8",
        "--global-batch",
        "16",
        "--precision",
        "bf16",
    ]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bad_plan_inputs_end_in_one_line_and_status_2() {
    for (extra, expect) in [
        (vec!["--global-batch", "0"], "--global-batch"),
        (vec!["--export", "jax"], "--export"),
        (vec!["--precision", "fp64"], "--precision"),
        (vec!["--fix", "tp=x"], "--fix"),
        (
            vec!["--model", "resnet50", "--export", "megatron"],
            "apply to transformers",
        ),
        (vec!["--model", "resnet50", "--fix", "tp=2"], "fix only bn"),
        (vec!["--cluster", "nope:gpus=8"], "nope"),
        (vec!["--top", "0"], "--top"),
        (vec!["--max-gpus", "0"], "--max-gpus"),
        (vec!["--framework", "jax@0.4"], "unknown stack 'jax@0.4'"),
        (
            vec!["--framework", "megatron-lm@soon"],
            "cannot read the version",
        ),
        (
            vec!["--model", "resnet50", "--framework", "megatron-lm@2022"],
            "not a transformer",
        ),
        (vec!["--fp8-recipe", "rowwise"], "add --precision fp8"),
        (
            vec!["--capacity-factor", "1.25"],
            "--capacity-factor: gpt2 has no mixture of experts",
        ),
        (
            vec!["--model", "mixtral-8x7b", "--capacity-factor", "-1"],
            "expected a number of at least 0.001",
        ),
        (
            vec!["--model", "mixtral-8x7b", "--pad-to-capacity"],
            "--pad-to-capacity: moe: pad_to_capacity needs a capacity factor",
        ),
        (
            vec!["--model", "resnet50", "--capacity-factor", "1"],
            "--capacity-factor: resnet50 is not a transformer",
        ),
        (vec!["--fp8-recipe", "mxfp8"], "Blackwell"),
        (
            vec!["--async-tp", "--framework", "megatron-lm@2022"],
            "--async-tp: megatron-lm@2022",
        ),
        (
            vec!["--compile", "--framework", "megatron-core@2024"],
            "--compile: megatron-core@2024 runs fused kernels already",
        ),
        (
            vec!["--model", "resnet50", "--compile"],
            "--compile: resnet50 is not a transformer",
        ),
        (
            vec![
                "--precision",
                "fp8",
                "--fp8-recipe",
                "rowwise",
                "--framework",
                "megatron-core",
            ],
            "does not run it (its recipes: delayed, tensorwise, blockwise)",
        ),
    ] {
        // The small case with `extra` replacing its value of the same flag.
        let mut args: Vec<&str> = Vec::new();
        for pair in SMALL.chunks(2) {
            if pair[0] != extra[0] {
                args.extend(pair);
            }
        }
        args.extend(extra.iter().copied());
        let out = plan(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{extra:?}: {err}");
        assert!(err.contains(expect), "{extra:?}: {err}");
    }
    // A value thousands of characters long is named, not echoed whole.
    let long = "x".repeat(5000);
    let mut args = SMALL.to_vec();
    args.extend(["--fp8-recipe", &long]);
    let err = String::from_utf8_lossy(&plan(&args).stderr).into_owned();
    assert!(
        err.contains("unknown fp8 recipe") && err.len() < 300,
        "{err}"
    );
}

#[test]
fn out_writes_every_file_and_refuses_to_overwrite() {
    let dir = std::env::temp_dir().join(format!("parallax-plan-out-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    let mut args: Vec<&str> = SMALL.to_vec();
    args.extend(["--out", &d, "--export", "megatron", "--max-gpus", "16"]);
    let out = plan(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [
        "plan.json",
        "report.md",
        "report.html",
        "trace.json",
        "breakdown.svg",
        "memory.svg",
        "timeline.svg",
        "sweep.svg",
        "megatron_args.sh",
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    let plan_json = std::fs::read_to_string(dir.join("plan.json")).unwrap();
    assert!(plan_json.contains("\"schema\": \"parallax-plan/1\""));
    serde_json::from_str::<serde_json::Value>(
        &std::fs::read_to_string(dir.join("trace.json")).unwrap(),
    )
    .unwrap();
    // A file the user wrote survives; an earlier report is not overwritten without --force.
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    let again = plan(&args);
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    args.push("--force");
    assert!(plan(&args).status.success());
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "mine"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn json_carries_the_contract_keys() {
    let mut args: Vec<&str> = SMALL.to_vec();
    args.extend(["--json", "--top", "3", "--export", "deepspeed"]);
    let v = common::json_of(&plan(&args));
    for key in [
        "step_time_s",
        "step_time_s_low",
        "step_time_s_high",
        "tokens_per_s",
        "mfu",
        "hfu",
        "peak_memory_gib",
        "fits",
        "layout",
        "breakdown",
        "memory",
        "plan",
        "candidates",
        "rejected",
    ] {
        assert!(v.get(key).is_some(), "{key}");
    }
    assert_eq!(v["candidates"].as_array().unwrap().len(), 3);
    assert_eq!(v["plan"]["layout"], v["layout"]);
    assert_eq!(v["export"]["engine"], "deepspeed");
    assert!(v["step_time_s_low"].as_f64() < v["step_time_s"].as_f64());
}

/// `plan` with `extra` after the small case, succeeding, as its JSON document.
fn plan_json(extra: &[&str]) -> serde_json::Value {
    let mut args: Vec<&str> = SMALL.to_vec();
    args.extend(extra);
    args.push("--json");
    common::json_of(&plan(&args))
}

/// The stack is an input: named in the report, limiting the search, implied by `--export`.
#[test]
fn the_framework_is_named_in_reports_and_export_implies_its_own() {
    let doc = plan_json(&["--framework", "megatron-lm@2021"]);
    assert_eq!(doc["framework"], "megatron-lm@2021");
    assert_eq!(doc["plan"]["prediction"]["framework"], "megatron-lm@2021");
    let layout = &doc["plan"]["layout"];
    assert_eq!(layout["sequence_parallel"], false, "{layout}");
    assert_eq!(layout["zero_stage"], 0, "{layout}");
    // Text reports name the default stack too.
    let out = plan(&SMALL);
    assert!(String::from_utf8_lossy(&out.stdout).contains("stack       current"));
    // --export E is E's current stack: another stack beside it is refused, its own accepted.
    let mut args: Vec<&str> = SMALL.to_vec();
    args.extend(["--export", "deepspeed", "--framework", "megatron-lm@2021"]);
    let out = plan(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--export deepspeed plans for deepspeed's current stack"),
        "{err}"
    );
    let doc = plan_json(&["--export", "deepspeed", "--framework", "deepspeed@0.19"]);
    assert_eq!(doc["framework"], "deepspeed@0.19");
}

/// `--fp8-recipe` and `--async-tp` reach the plan document and the export that runs it.
#[test]
fn fp8_recipe_and_async_tp_reach_the_plan_and_its_export() {
    let doc = common::json_of(&plan(&[
        "--model",
        "llama3-8b",
        "--cluster",
        "dgx-h100-80gb:gpus=16",
        "--global-batch",
        "32",
        "--seq",
        "4096",
        "--precision",
        "fp8",
        "--fp8-recipe",
        "rowwise",
        "--async-tp",
        "--fix",
        "tp=8",
        "--export",
        "torchtitan",
        "--json",
    ]));
    let training = &doc["plan"]["training"];
    assert_eq!(training["fp8_recipe"], "rowwise", "{training}");
    assert_eq!(training["async_tp"], true, "{training}");
    assert_eq!(doc["framework"], "torchtitan, fp8 rowwise, async TP");
    // What the export writes for them is `export.rs`'s to test; here, that they reach it.
    let text = doc["export"]["text"].as_str().unwrap();
    assert!(
        text.contains("enable_async_tensor_parallel = true"),
        "{text}"
    );
    assert!(text.contains("recipe_name = \"rowwise\""), "{text}");
}

/// `--capacity-factor` and `--pad-to-capacity` reach the plan document, its prediction and the
/// Megatron export: padding every expert to 1.5 even shares is slower than dropless routing.
#[test]
fn token_dropping_reaches_the_plan_and_its_export() {
    const JOB: [&str; 8] = [
        "--model",
        "mixtral-8x7b",
        "--cluster",
        "dgx-h100-80gb:gpus=16",
        "--global-batch",
        "32",
        "--seq",
        "4096",
    ];
    let run = |extra: &[&str]| {
        let mut args = JOB.to_vec();
        args.extend([
            "--fix",
            "dp=2,tp=1,pp=1,ep=8,recompute=full",
            "--export",
            "megatron",
            "--json",
        ]);
        args.extend(extra);
        common::json_of(&plan(&args))
    };
    let dropless = run(&[]);
    let padded = run(&["--capacity-factor", "1.5", "--pad-to-capacity"]);
    let training = &padded["plan"]["training"];
    assert_eq!(training["capacity_permille"], 1500, "{training}");
    assert_eq!(training["pad_to_capacity"], true, "{training}");
    assert!(dropless["plan"]["training"]
        .get("capacity_permille")
        .is_none());
    let text = padded["export"]["text"].as_str().unwrap();
    assert!(
        text.contains("--moe-expert-capacity-factor 1.5")
            && text.contains("--moe-pad-expert-input-to-capacity"),
        "{text}"
    );
    let step = |d: &serde_json::Value| d["step_time_s"].as_f64().unwrap();
    assert!(
        step(&padded) > step(&dropless),
        "{} vs {}",
        step(&padded),
        step(&dropless)
    );

    // `simulate --plan plan.json` predicts the job its flags name: with the plan's capacity
    // flags (and the stack its export implied) it is the plan's prediction, without them a
    // note says what differs.
    let simulate = |extra: &[&str]| {
        let mut args = JOB.to_vec();
        args.extend(["--framework", "megatron-core@2025"]);
        args.extend(extra);
        simulate_plan(&padded["plan"], "padded", &args)
    };
    let same = simulate(&["--capacity-factor", "1.5", "--pad-to-capacity"]);
    assert_eq!(String::from_utf8_lossy(&same.stderr), "");
    assert!((step(&common::json_of(&same)) - step(&padded)).abs() < 1e-9 * step(&padded));
    let other = simulate(&[]);
    let note = String::from_utf8_lossy(&other.stderr).into_owned();
    assert!(
        note.contains("was made with capacity factor 1.5, padded; simulating dropless experts"),
        "{note}"
    );
    assert!((step(&common::json_of(&other)) - step(&dropless)).abs() < 1e-9 * step(&dropless));
}

/// `simulate --plan FILE --json` with `args`, FILE holding `plan` (under a name with `tag`,
/// removed after).
fn simulate_plan(plan: &serde_json::Value, tag: &str, args: &[&str]) -> Output {
    let file = std::env::temp_dir().join(format!("parallax-{tag}-{}.json", std::process::id()));
    std::fs::write(&file, plan.to_string()).unwrap();
    let mut all = vec!["simulate"];
    all.extend(args);
    all.extend(["--plan", file.to_str().unwrap(), "--json"]);
    let out = common::parallax(&all);
    let _ = std::fs::remove_file(&file);
    out
}

/// `--compile` on a stack whose module code is eager (torchtitan) prices the fused kernels
/// `torch.compile` makes: a faster step, recorded in the plan, compiled in its export; a
/// `simulate --plan` of that plan without the flag says what differs.
#[test]
fn compile_reaches_the_plan_its_prediction_and_its_export() {
    const JOB: [&str; 12] = [
        "--model",
        "llama3-8b",
        "--cluster",
        "grand-teton-h100-96gb:gpus=8",
        "--global-batch",
        "16",
        "--seq",
        "8192",
        "--framework",
        "torchtitan@2024-12",
        "--fix",
        "dp=8,zero=3,mb=2,recompute=selective",
    ];
    let run = |extra: &[&str]| {
        let mut args = JOB.to_vec();
        args.extend(["--json"]);
        args.extend(extra);
        common::json_of(&plan(&args))
    };
    let eager = run(&[]);
    let compiled = run(&["--compile"]);
    let step = |d: &serde_json::Value| d["step_time_s"].as_f64().unwrap();
    // torchtitan's own table: 5,762 against 6,667 tokens/s a GPU, 13.6 % less time.
    let saved = 1.0 - step(&compiled) / step(&eager);
    assert!((0.08..0.20).contains(&saved), "{saved}");
    assert_eq!(compiled["plan"]["training"]["compile"], true);
    assert!(eager["plan"]["training"].get("compile").is_none());
    assert!(
        compiled["framework"]
            .as_str()
            .unwrap()
            .ends_with("torchtitan@2024), compiled"),
        "{}",
        compiled["framework"]
    );

    let out = simulate_plan(&compiled["plan"], "compiled", &JOB[..10]);
    let note = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        note.contains("was made with compiled module code; simulating the stack's own (--compile)"),
        "{note}"
    );
    assert!((step(&common::json_of(&out)) - step(&eager)).abs() < 1e-9 * step(&eager));
}

#[test]
fn frameworks_lists_every_stack_with_sources() {
    let doc = common::parallax_json(&["frameworks", "--json"]);
    let rows = doc["frameworks"].as_array().unwrap();
    for name in [
        "megatron-lm@2023",
        "megatron-deepspeed@2021",
        "deepspeed-zero3@2021",
        "megascale@2024",
        "meta-llama3@2024",
        "nvidia-mlperf@3.1",
        "pytorch-dataparallel@1.8",
    ] {
        let row = rows
            .iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("{name}"));
        assert!(row["features"].as_array().is_some_and(|f| !f.is_empty()
            && f.iter()
                .all(|x| !x["source"].as_str().unwrap_or("").is_empty())));
    }
    // What `--fp8-recipe` and `--async-tp` may name, per stack.
    let titan = rows.iter().find(|r| r["name"] == "torchtitan").unwrap();
    assert_eq!(
        titan["fp8_recipes"],
        serde_json::json!(["tensorwise", "rowwise"])
    );
    assert_eq!(titan["async_tp"], true);
    let m21 = rows
        .iter()
        .find(|r| r["name"] == "megatron-lm@2021")
        .unwrap();
    assert_eq!(m21["fp8_recipes"], serde_json::json!([]));
    // Context parallelism: today's stacks, not 2021's nor data-parallel-only ones.
    assert_eq!(
        (
            titan["context_parallel"].as_bool(),
            m21["context_parallel"].as_bool()
        ),
        (Some(true), Some(false))
    );
    let dp_only = rows
        .iter()
        .find(|r| r["name"] == "pytorch-dataparallel@1.8")
        .unwrap();
    assert_eq!(dp_only["context_parallel"], false);
}

/// A DeepSpeed run's `ds_config.json` is an input: what `--export deepspeed` writes predicts,
/// through `simulate --ds-config`, the step its plan predicted (the batch, ZeRO stage, data
/// parallelism and micro-batch from the file); `plan --ds-config` searches only what the file
/// leaves open; a knob given otherwise, a non-DeepSpeed stack or a bad file is one line and
/// status 2; keys parallax does not price are named in a note.
#[test]
fn a_ds_config_sets_up_the_deepspeed_run_it_describes() {
    let dir = std::env::temp_dir().join(format!("parallax-ds-config-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let job = ["--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb:gpus=16"];
    let mut args: Vec<&str> = job.to_vec();
    args.extend(["--global-batch", "512", "--export", "deepspeed", "--json"]);
    args.extend(["--out", dir.to_str().unwrap()]);
    let planned = common::json_of(&plan(&args));
    let file = dir.join("ds_config.json");
    let ds = file.to_str().unwrap();
    let step = |d: &serde_json::Value| d["step_time_s"].as_f64().unwrap();
    let mut sim: Vec<&str> = vec!["simulate"];
    sim.extend(job);
    sim.extend(["--ds-config", ds, "--plan", "tp=1,pp=1", "--json"]);
    let simulated = common::json_of(&common::parallax(&sim));
    let want = planned["plan"]["prediction"]["step_time_s"]
        .as_f64()
        .unwrap();
    assert!((step(&simulated) - want).abs() < 1e-9 * want, "{simulated}");
    assert_eq!(
        simulated["framework"],
        format!("deepspeed@0.19, ds_config {ds}")
    );
    let layout = &planned["plan"]["layout"];
    for key in ["zero_stage", "micro_batch", "dp"] {
        assert_eq!(simulated["layout"][key], layout[key], "{key}");
    }

    // The search keeps the file's knobs: ZeRO-1 at micro-batch 2 over 16 ranks.
    let custom = dir.join("custom.json");
    std::fs::write(
        &custom,
        r#"{"train_batch_size": 512, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 16, "bf16": {"enabled": true},
            "zero_optimization": {"stage": 1, "allgather_bucket_size": 2e8},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "gradient_clipping": 0.5}"#,
    )
    .unwrap();
    let custom = custom.to_str().unwrap();
    let mut args: Vec<&str> = job.to_vec();
    args.extend(["--ds-config", custom]);
    let out = plan(&[args.as_slice(), &["--json"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "note: --ds-config {custom}: not priced: zero_optimization.allgather_bucket_size"
        )),
        "{err}"
    );
    let doc = common::json_of(&out);
    let l = &doc["plan"]["layout"];
    assert_eq!(
        (&l["zero_stage"], &l["micro_batch"], &l["dp"]),
        (&1.into(), &2.into(), &16.into())
    );
    assert_eq!(doc["plan"]["training"]["global_batch"], 512);
    // Its export is the file with the plan written onto it: the keys the plan does not decide
    // (the optimizer, the user's clipping, an unpriced bucket size) stay as written.
    let onto = dir.join("onto");
    let out = plan(
        &[
            args.as_slice(),
            &["--export", "deepspeed", "--out", onto.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(onto.join("ds_config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["optimizer"]["params"]["lr"], 3e-4, "{v}");
    assert_eq!(v["gradient_clipping"], 0.5);
    assert_eq!(v["zero_optimization"]["allgather_bucket_size"], 2e8);
    assert_eq!(
        (
            &v["zero_optimization"]["stage"],
            &v["train_micro_batch_size_per_gpu"],
            &v["gradient_accumulation_steps"],
            &v["bf16"]["enabled"]
        ),
        (&1.into(), &2.into(), &16.into(), &true.into())
    );
    // At other GPU counts the file's batch and micro-batch stand and its accumulation changes
    // (DeepSpeed's batch arithmetic): 32 GPUs run 32 data-parallel ranks, one micro-batch each.
    let swept = common::json_of(&plan(
        &[args.as_slice(), &["--max-gpus", "32", "--json"]].concat(),
    ));
    let at_32 = swept["sweep"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["gpus"] == 32)
        .unwrap();
    assert!(
        at_32["layout"]
            .as_str()
            .unwrap()
            .starts_with("dp=32,tp=1,pp=1,cp=1,ep=1,zero=1,mb=2,"),
        "{at_32}"
    );

    for (extra, want) in [
        (
            vec!["simulate", "--ds-config", custom, "--plan", "zero=2"],
            format!("error: --plan: --ds-config {custom} sets zero_optimization.stage 1 (given 2)"),
        ),
        (
            vec!["plan", "--ds-config", custom, "--global-batch", "256"],
            format!("error: --global-batch 256: --ds-config {custom}: train_batch_size is 512"),
        ),
        (
            vec!["plan", "--ds-config", custom, "--framework", "torchtitan"],
            format!("error: --ds-config {custom}: torchtitan reads no DeepSpeed config"),
        ),
        (
            vec!["plan", "--ds-config", custom, "--precision", "fp16"],
            format!("error: --precision fp16: --ds-config {custom} trains in bf16"),
        ),
        (
            vec!["plan", "--ds-config", "/nonexistent/ds.json"],
            "error: --ds-config /nonexistent/ds.json: cannot read:".to_string(),
        ),
    ] {
        let (cmd, rest) = extra.split_first().unwrap();
        let out = common::parallax(&[&[*cmd], &job[..], rest].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.starts_with(&want), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"zero_optimization": {"stage": 5}}"#).unwrap();
    let bad = bad.to_str().unwrap();
    let out = plan(&[&job[..], &["--global-batch", "512", "--ds-config", bad]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(
        err.trim(),
        format!("error: {bad}: zero_optimization.stage: 5 is not 0–3")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
