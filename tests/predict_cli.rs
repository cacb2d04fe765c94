//! The `--json` contracts of `simulate` and `validate` (../shared/DESIGN.md, issue 3), and the
//! Chrome trace of a predicted step.

mod common;

use common::parallax_json as run;
use serde_json::Value;

#[test]
fn simulate_json_has_every_contract_key() {
    let dir = std::env::temp_dir().join(format!("parallax-predict-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.json");
    let d = run(&[
        "simulate",
        "--model",
        "gpt3-13b",
        "--cluster",
        "dgx-a100-80gb:gpus=64",
        "--plan",
        "tp=4,pp=2,dp=8,mb=1,zero=1,recompute=selective,sp=true,schedule=1f1b",
        "--global-batch",
        "128",
        "--json",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    for k in [
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
    ] {
        assert!(d.get(k).is_some(), "missing {k}: {d}");
    }
    let t = d["step_time_s"].as_f64().unwrap();
    assert!(
        d["step_time_s_low"].as_f64().unwrap() < t && t < d["step_time_s_high"].as_f64().unwrap()
    );
    for k in ["compute_s", "bubble_s", "optimizer_s", "exposed_comm_s"] {
        assert!(d["breakdown"].get(k).is_some(), "breakdown.{k}");
    }
    for k in ["params", "grads", "optimizer", "activations", "buffers"] {
        assert!(d["memory"][k].as_f64().unwrap() >= 0.0, "memory.{k}");
    }
    assert_eq!(d["layout"]["tp"], 4);
    assert_eq!(d["fits"], true);
    // 2048 tokens × 128 sequences per step.
    let tokens = d["tokens_per_s"].as_f64().unwrap() * t;
    assert!((tokens - 128.0 * 2048.0).abs() < 1.0);
    let tr: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = tr["traceEvents"].as_array().unwrap();
    assert!(events.iter().any(|e| e["ph"] == "X"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn validate_json_scores_the_published_runs() {
    let cases = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/ground-truth/public.json"
    );
    assert!(
        std::path::Path::new(cases).exists(),
        "{cases} not found: the tests read the published runs from ../shared beside the clone, as CI has it"
    );
    let d = run(&["validate", cases, "--json"]);
    let s = &d["summary"];
    for k in [
        "n",
        "mape",
        "median_ape",
        "max_ape",
        "memory_mape",
        "skipped",
    ] {
        assert!(s.get(k).is_some(), "summary.{k}");
    }
    assert_eq!(s["skipped"], 0);
    // The figures the calibration is held to (issue 3): MAPE at most 5 %, peak-memory error at
    // most 10 % where measured.
    assert!(s["mape"].as_f64().unwrap() <= 0.05, "{s}");
    assert!(s["memory_mape"].as_f64().unwrap() <= 0.10, "{s}");
    for c in d["cases"].as_array().unwrap() {
        for k in [
            "id",
            "measured_step_time_s",
            "predicted_step_time_s",
            "ape",
            "status",
        ] {
            assert!(c.get(k).is_some(), "case.{k}");
        }
    }
}

/// `validate validation/FILE --json`, checked to model every one of its `n` cases within
/// `mape` and `max_ape`: a file of published runs kept out of calibration, whose error must
/// stay near the one measured when it was added.
fn held_out(file: &str, n: u64, mape: f64, max_ape: f64) -> serde_json::Value {
    let cases = format!("{}/../validation/{file}", env!("CARGO_MANIFEST_DIR"));
    let d = run(&["validate", &cases, "--json"]);
    let s = &d["summary"];
    assert_eq!(s["skipped"], 0, "{file}: {s}");
    assert_eq!(s["n"], n, "{file}: {s}");
    assert!(s["mape"].as_f64().unwrap() <= mape, "{file}: {s}");
    assert!(s["max_ape"].as_f64().unwrap() <= max_ape, "{file}: {s}");
    d
}

/// The predicted step time of case `id` in a `validate --json` document.
fn predicted_step(d: &serde_json::Value, id: &str) -> f64 {
    d["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap()["predicted_step_time_s"]
        .as_f64()
        .unwrap()
}

#[test]
fn validate_scores_the_held_out_runs() {
    // NeMo 24.07, torchtitan 70B/405B 2D–4D and its 8B FSDP runs compiled (3.3 %; 3.4 % before
    // FSDP2's pipelined stages paid their fp32 gradient accumulation, 5.9 % before
    // torchtitan's eager bf16 module code was priced and its chip refitted, 7.4 % before
    // nemo@24.07 kept its launcher recipes' bf16 gradients, 8.8 % before torchtitan 2024's
    // micro-batch default, one per pipeline rank, completed its 405B 3D runs). NeMo's
    // Nemotron 340B publishes no recomputation: with fp32 gradient buffers its first stage did
    // not fit without recomputing every layer (predicted +29 %); with the recipe's bf16 buffers
    // no layer is recomputed (selective, free under fused attention: HFU = MFU), as the recipe
    // runs it (within 3 %). The torchtitan TP runs' peak memory is DTensor's (loss_parallel,
    // gathered sequence-parallel inputs), and its pipelined stages' gradients freed stage by
    // stage and last-stage outputs kept (PyTorch's pipelining of late 2024): 6.5 % over 11
    // (7.7 % before those, 10.2 % before DTensor's buffers).
    let d = held_out("held-out.json", 21, 0.05, 0.15);
    let s = &d["summary"];
    assert!(s["memory_mape"].as_f64().unwrap() <= 0.075, "{s}");
    for c in d["cases"].as_array().unwrap() {
        let id = c["id"].as_str().unwrap();
        if id.starts_with("titan-405B-512gpu-3D") {
            assert!(c["layout"].as_str().unwrap().contains("mb=4"), "{c}");
        }
        if id.starts_with("nemo2407-nemotron-340b") {
            assert!(
                !c["layout"].as_str().unwrap().contains("recompute=full"),
                "{c}"
            );
            assert!(c["ape"].as_f64().unwrap() <= 0.03, "{c}");
        }
        // torchtitan's Table 1 and 3 rows with torch.compile (with and without float8), whose
        // eager rows are public.json's: within 4 % each (an eager stack priced as compiled had
        // the float8 rows 10–12 % slow).
        if id.starts_with("titan-8B-") {
            assert!(c["ape"].as_f64().unwrap() <= 0.04, "{c}");
        }
    }
    // Megatron-Core r0.8.0's GPT 1.7B–462B on 48–6,144 H100s (README table, July 2024): the
    // H100 calibration, fitted to other stacks' runs, holds at the layouts a tuned current
    // stack uses (4.7 % when the file was added).
    held_out("megatron-core-weak-scaling.json", 9, 0.06, 0.12);
    // Its strong-scaling benchmark: the 177B at a fixed batch of 1,152 on 96 and 4,608 H100s
    // (MFU 47 % and 42 % in the README's text): the fall with scale is the bubble of 12
    // micro-batches a pipeline and exposed data-parallel time (2.7 % when the file was added).
    held_out("megatron-core-strong-scaling.json", 2, 0.04, 0.06);
    // MosaicML's MPT 1B–70B under plain FSDP on 8–64 A100s and H100s (7.2 %; the runs without
    // activation checkpointing predicted fast on both chips).
    held_out("llm-foundry-mpt.json", 12, 0.09, 0.15);
    // Megatron-Turing NLG 530B on 280–420 DGX A100 nodes (Megatron-DeepSpeed 2021, 1F1B at
    // tp 8 × pp 35): a known miss, every run 18–22 % fast (19.9 %; 23.7 % when the file was
    // added, before DeepSpeed's fp16 engine summed each micro-batch's gradients by autograd);
    // BLOOM 176B on 384 A100s (Megatron-DeepSpeed 2022, tp 4 × pp 12, a logged iteration),
    // 11 % fast, added unfitted: 17.6 % over the four; 14.3 % now (MT-NLG 15–19 % fast, BLOOM
    // 7.1 % once the BF16_Optimizer's fp32 copy of each micro-batch's gradients is priced).
    held_out("megatron-deepspeed.json", 4, 0.19, 0.24);
    // DeepSpeed 0.6.2's ZeRO-3 without model parallelism (DeepSpeed on Azure, 2022): GPT
    // 175B–2T on 128–1,024 A100s at micro-batches 1–32, read off the post's figures. Priced
    // as a current, overlapped ZeRO-3 they came out 35 % fast (up to 68 % at micro-batch 1 on
    // 1,024 GPUs); with its collectives waiting for compute, a gather per submodule weight,
    // bucketed reduce-scatters in fp16 after a pass dividing each gradient, the host's view of
    // every rank's piece of every gradient, a gather of each small tensor after every step
    // and, beyond DeepSpeed's default reuse distance, a third gather of two thirds of each
    // layer under recomputation, 7.2 % (max 23.5 %) at DeepSpeed's defaults; each case now
    // carries its recipe's zero_optimization keys (`plan.ds_config`: reuse distance 3e9, which
    // spares the 175B layers that third gather; reduce bucket 9e7): 10.1 % (max 27.4 %:
    // micro-batch 1 and the offloaded 1T–2T still fast), the honest figure.
    let d = held_out("deepspeed-azure-zero3.json", 54, 0.105, 0.285);
    // The step grows with the micro-batch by its compute over a constant of the collectives'
    // time: doubling the micro-batch from 8 to 16 adds close to eight micro-batches' worth.
    let step = |id: &str| predicted_step(&d, id);
    let (one, eight, sixteen) = (
        step("ds-azure-175b-s1024-1024gpu-mb1"),
        step("ds-azure-175b-s1024-1024gpu-mb8"),
        step("ds-azure-175b-s1024-1024gpu-mb16"),
    );
    let per_micro_batch = (sixteen - eight) / 8.0;
    assert!(one > 2.0 * per_micro_batch, "{one} {eight} {sixteen}");
    // Trainy's torchtitan baseline on H200 hosts (Llama 3.1 8B, FSDP on 32 and 64 GPUs,
    // compiled, float8): a compiled torchtitan run of 2025 compiles its loss, which holds the
    // 16-bit logits and their gradient, not three fp32 copies: 48.0 / 47.0 GiB measured, 63 GiB
    // predicted with the eager loss, within 2 % with the compiled one (step times 4–6 % fast).
    let d = held_out("torchtitan-h200.json", 2, 0.07, 0.08);
    let s = &d["summary"];
    assert!(s["memory_mape"].as_f64().unwrap() <= 0.03, "{s}");
}

#[test]
fn validate_prices_fp8_recipes_and_async_tp_as_published() {
    // torchtitan's June 2025 async-TP benchmark and torchao's float8 benchmark: bf16,
    // tensorwise and rowwise fp8, vanilla and asynchronous TP, priced from each case's
    // `fp8_recipe` and `async_tp` (19.3 % MAPE, max 39.3 %, before either was modelled).
    let d = held_out("torchtitan-async-tp.json", 15, 0.12, 0.20);
    // What each option is worth, as the benchmark measured it: asynchronous TP saves 4–14 %
    // of a 70B step, rowwise fp8 gains less over bf16 than tensorwise.
    let step = |id: &str| predicted_step(&d, id);
    let t =
        |recipe: &str, tp: &str| step(&format!("titan2506-70B-256gpu-fsdp32-tp8-{recipe}-{tp}-tp"));
    for recipe in ["bf16", "tensorwise", "rowwise"] {
        let saved = 1.0 - t(recipe, "async") / t(recipe, "vanilla");
        assert!((0.02..0.15).contains(&saved), "{recipe}: {saved}");
    }
    assert!(t("tensorwise", "vanilla") < t("rowwise", "vanilla"));
    assert!(t("rowwise", "vanilla") < t("bf16", "vanilla"));
}

/// Case `id` of `cases` as `validate --json` scores it: (predicted, measured) step time.
fn scored(cases: &str, id: &str) -> (f64, f64) {
    let doc = run(&["validate", cases, "--json"]);
    let case = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap()
        .clone();
    (
        case["predicted_step_time_s"].as_f64().unwrap(),
        case["measured_step_time_s"].as_f64().unwrap(),
    )
}

/// `validate CASES --explain ID`'s text, checked to succeed, to open with the id and to hold
/// every one of `parts`.
fn explained(cases: &str, id: &str, parts: &[&str]) -> String {
    let out = common::parallax(&["validate", cases, "--explain", id]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.starts_with(id), "{text}");
    for part in parts {
        assert!(text.contains(part), "{part}: {text}");
    }
    text
}

#[test]
fn validate_explains_one_case_as_it_scores_it() {
    // `--explain ID` prints the case's breakdown and memory beside the measurement, with the
    // same prediction the scoring gives; an unknown id is one line and exit status 2.
    let cases = concat!(env!("CARGO_MANIFEST_DIR"), "/../validation/held-out.json");
    let id = "nemo2407-gpt3-175b-128gpu-tp4pp8cp1";
    let (predicted, _) = scored(cases, id);
    let text = explained(
        cases,
        id,
        &[
            "time on the busiest stage",
            "pipeline bubble",
            "memory ",
            "measured ",
            "one micro-batch on one device",
            "EP dispatch",
        ],
    );
    let step_line = text.lines().find(|l| l.starts_with("step time")).unwrap();
    let shown: f64 = step_line
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (shown - predicted).abs() <= 0.0005 * predicted.max(1.0),
        "{shown} vs {predicted}"
    );
    let out = common::parallax(&["validate", cases, "--explain", "no-such-case"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("no case 'no-such-case'"), "{err}");
    // A general graph's case prints its layout op by op, with the prediction the scoring gives.
    let general = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/ground-truth/general.json"
    );
    let id = "torchgpipe-resnet101-p40-2g-b25000-fp32-pp2m1667";
    let (predicted, measured) = scored(general, id);
    let text = explained(
        general,
        id,
        &[
            "per-op plan",
            "2 stages",
            "configuration",
            "unsplit @ gpu 1",
        ],
    );
    let err = format!(
        "(prediction {:+.1} %)",
        (predicted - measured) / measured * 100.0
    );
    assert!(text.contains(&err), "{err}: {text}");
}

#[test]
fn validate_scores_several_files_each_on_its_own() {
    // Two files: one JSON document with a summary per file; `--group` keeps the files that
    // have the group and is an error only when none has it.
    let held_out = concat!(env!("CARGO_MANIFEST_DIR"), "/../validation/held-out.json");
    let moe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/ground-truth/moe-zero-offload.json"
    );
    let d = run(&["validate", held_out, moe, "--json"]);
    let files = d["files"].as_array().unwrap();
    assert_eq!(files.len(), 2);
    assert_eq!(files[0]["file"], held_out);
    assert_eq!(files[0]["summary"]["n"], 21);
    assert!(files[1]["summary"]["n"].as_u64().unwrap() > 0);
    let d = run(&["validate", held_out, moe, "--group", "moe", "--json"]);
    assert_eq!(d["file"], moe, "only the MoE file has group moe");
    // Issue 16's figure: MAPE at most 15 % (13.4 % with the grouped GEMMs as one H100 ran them);
    // every run within 35 % but Megatron-Bridge 25.11's Qwen3-30B, which publishes half the
    // throughput of the same layout in 25.09 and 26.02 (the case file calls it regressed).
    assert!(
        d["summary"]["mape"].as_f64().unwrap() <= 0.15,
        "{}",
        d["summary"]
    );
    for c in d["cases"].as_array().unwrap() {
        if c["id"] != "mb2511-qwen3-30b-16xh100-fp8cs" {
            assert!(c["ape"].as_f64().unwrap() <= 0.35, "{c}");
        }
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_parallax"))
        .args(["validate", held_out, moe, "--group", "no-such-group"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("no case has group 'no-such-group'"), "{err}");
}
