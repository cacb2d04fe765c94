//! Everything a user can type or feed that is wrong ends with one line on stderr naming the
//! file / field and the problem, exit status 2, and no panic.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_parallax")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ir/tests/fixtures")
}

struct Case {
    args: Vec<String>,
    /// Substrings the error line must contain.
    expect: Vec<&'static str>,
}

fn case<S: AsRef<str>>(args: &[S], expect: &[&'static str]) -> Case {
    Case {
        args: args.iter().map(|s| s.as_ref().to_string()).collect(),
        expect: expect.to_vec(),
    }
}

fn write(dir: &Path, name: &str, content: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p.to_string_lossy().into_owned()
}

#[test]
fn bad_inputs_end_in_one_line_and_status_2() {
    let dir = std::env::temp_dir().join(format!("parallax-cli-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = &dir;
    let llama = |extra: &str| {
        format!(
            r#"{{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":8,"intermediate_size":128,"vocab_size":100{extra}}}"#
        )
    };
    let malformed = write(d, "malformed.json", b"{\"model_type\": \"gpt2\", ");
    let empty = write(d, "empty.json", b"");
    let junk = write(d, "junk.json", &[0xff, 0xfe, 0x00, 0x13, 0x37]);
    let no_kind = write(d, "nokind.json", b"{\"hello\": 1}");
    let t5 = write(d, "t5.json", br#"{"model_type":"t5","d_model":512}"#);
    let missing = write(
        d,
        "missing.json",
        br#"{"model_type":"llama","hidden_size":4096}"#,
    );
    let negative = write(
        d,
        "negative.json",
        llama("")
            .replace("\"hidden_size\":64", "\"hidden_size\":-64")
            .as_bytes(),
    );
    let zero_layers = write(
        d,
        "zerolayers.json",
        llama("")
            .replace("\"num_hidden_layers\":2", "\"num_hidden_layers\":0")
            .as_bytes(),
    );
    let bad_kv = write(
        d,
        "badkv.json",
        llama(",\"num_key_value_heads\":3").as_bytes(),
    );
    let string_num = write(
        d,
        "stringnum.json",
        llama("")
            .replace("\"vocab_size\":100", "\"vocab_size\":\"big\"")
            .as_bytes(),
    );
    let bad_moe = write(
        d,
        "badmoe.json",
        llama(",\"num_local_experts\":4,\"num_experts_per_tok\":8")
            .replace("llama", "mixtral")
            .as_bytes(),
    );
    let bad_tie = write(
        d,
        "badtie.json",
        llama(",\"tie_word_embeddings\":\"yes\"").as_bytes(),
    );

    // A valid graph to corrupt in several ways.
    let graph = dir.join("graph.json");
    let ok = Command::new(bin())
        .args([
            "inspect",
            "--model",
            "gpt-tiny",
            "--seq",
            "8",
            "--save-graph",
        ])
        .arg(&graph)
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let g = std::fs::read_to_string(&graph).unwrap();
    let wrong_schema = write(
        d,
        "schema.json",
        g.replace("parallax-graph/1", "parallax-graph/9").as_bytes(),
    );
    let dangling = write(
        d,
        "dangling.json",
        g.replacen("\"inputs\":[0,", "\"inputs\":[99999,", 1)
            .as_bytes(),
    );
    let unknown_field = write(
        d,
        "unknownfield.json",
        g.replacen("\"name\":", "\"nmae\":", 1).as_bytes(),
    );
    let op_key = write(
        d,
        "opkey.json",
        g.replacen(
            "\"out_features\":",
            "\"in_features\":1,\"out_features\":",
            1,
        )
        .as_bytes(),
    );
    assert!(std::fs::read_to_string(&op_key)
        .unwrap()
        .contains("in_features"));
    let shape = write(
        d,
        "shape.json",
        g.replacen("\"out_features\":256", "\"out_features\":255", 1)
            .as_bytes(),
    );
    let no_nodes = write(d, "nonodes.json", br#"{"schema":"parallax-graph/1","graph":{"name":"x","tensors":[],"nodes":[],"outputs":[]}}"#);

    // A checkpoint of gpt-tiny, to resume a llama-tiny run from.
    let tiny_run = |model: &str, flag: &str, dir: &str| run_args(model, 1, "1", &[flag, dir]);
    let ckpt = dir.join("gpt-ckpt").display().to_string();
    let saved = Command::new(bin())
        .args(tiny_run("gpt-tiny", "--save", &ckpt))
        .output()
        .unwrap();
    assert!(
        saved.status.success(),
        "{}",
        String::from_utf8_lossy(&saved.stderr)
    );

    let resnet = std::fs::read(fixtures().join("resnet50.onnx")).unwrap();
    let truncated = write(d, "truncated.onnx", &resnet[..resnet.len() / 3]);
    let garbage = write(
        d,
        "garbage.onnx",
        b"this is not protobuf at all \xff\xff\xff\xff",
    );
    let unsupported = fixtures()
        .join("unsupported.onnx")
        .to_string_lossy()
        .into_owned();

    let bad_toml = write(d, "bad.toml", b"name = \"x\"\n[device\n");
    let unknown_key = write(
        d,
        "unknownkey.toml",
        parallax_preset("dgx-a100-80gb")
            .replace("[node]", "[node]\nwarp_drive = true")
            .as_bytes(),
    );
    let eff = write(
        d,
        "eff.toml",
        parallax_preset("dgx-a100-80gb")
            .replace("memory_efficiency = 0.85", "memory_efficiency = 1.5")
            .as_bytes(),
    );
    let neg_nic = write(
        d,
        "negnic.toml",
        parallax_preset("dgx-a100-80gb")
            .replace("nic_gbit = 200.0", "nic_gbit = -200.0")
            .as_bytes(),
    );
    // The A100 preset with the whole line of `key` set to `v` (fitted values change with
    // every refit, so the line is matched by its key).
    let with_line = |key: &str, v: &str| {
        parallax_preset("dgx-a100-80gb")
            .lines()
            .map(|l| match l.starts_with(&format!("{key} =")) {
                true => format!("{key} = {v}"),
                false => l.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let neg_host = write(
        d,
        "neghost.toml",
        with_line("host_memory_gib", "-1.0").as_bytes(),
    );
    let existing = write(d, "existing.json", b"precious user data");
    let bad_plan = write(d, "badplan.json", br#"{"schema":"other/1"}"#);
    let band = |v: &str| with_line("step_time_band", v);
    let nan_band = write(d, "nanband.toml", band("nan").as_bytes());
    let neg_band = write(d, "negband.toml", band("-1.0").as_bytes());
    let escape_name = write(
        d,
        "escape.toml",
        parallax_preset("dgx-a100-80gb")
            .replacen("name = \"", "name = \"\\u001b[31m", 1)
            .as_bytes(),
    );
    let plan_file = write(d, "runnable.json", br#"{"schema":"parallax-plan/1"}"#);
    let tiny = |extra: &[&str]| run_args("gpt-tiny", 1, "1", extra);
    let a_file = write(d, "afile", b"not a folder");
    // held-out.json with its first case changed by `edit`, under `name`.
    let edited_cases = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../validation/held-out.json"),
        )
        .unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(&mut v["cases"][0]);
        write(d, name, v.to_string().as_bytes())
    };
    let typo_case = edited_cases("typo.json", &|c| c["model"]["kv_head"] = 8.into());
    let tp3_case = edited_cases("tp3.json", &|c| c["plan"]["tp"] = 3.into());
    let zero7_case = edited_cases("zero7.json", &|c| c["plan"]["zero_stage"] = 7.into());
    let rwkv_case = edited_cases("rwkv.json", &|c| c["model"]["arch"] = "rwkv".into());
    let tiny_plan_dir = dir.join("tiny-plan");
    let planned = Command::new(bin())
        .args([
            "plan",
            "--model",
            "gpt-tiny",
            "--cluster",
            "dgx-a100-80gb:gpus=8",
        ])
        .args(["--global-batch", "8", "--seq", "64", "--out"])
        .arg(&tiny_plan_dir)
        .output()
        .unwrap();
    assert!(planned.status.success());
    let tiny_plan = std::fs::read_to_string(tiny_plan_dir.join("plan.json")).unwrap();
    let tiny_plan_path = tiny_plan_dir.join("plan.json").display().to_string();
    assert!(tiny_plan.contains("\"global_batch\": 8"));
    let zero_batch_plan = write(
        d,
        "zerobatch.json",
        tiny_plan
            .replace("\"global_batch\": 8", "\"global_batch\": 0")
            .as_bytes(),
    );
    let huge_ffn = write(
        d,
        "hugeffn.json",
        llama("")
            .replace(
                "\"intermediate_size\":128",
                "\"intermediate_size\":4611686018427387904",
            )
            .as_bytes(),
    );
    let deep = write(
        d,
        "deep.json",
        llama("")
            .replace("\"num_hidden_layers\":2", "\"num_hidden_layers\":10000000")
            .as_bytes(),
    );
    let sim = |extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = [
            "simulate",
            "--model",
            "gpt3-1.3b",
            "--cluster",
            "dgx-a100-80gb:gpus=8",
            "--plan",
            "tp=2",
            "--global-batch",
            "8",
            "--seq",
            "256",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for pair in extra.chunks(2) {
            match args.iter().position(|a| a == pair[0]) {
                Some(i) => args[i + 1] = pair[1].to_string(),
                None => args.extend(pair.iter().map(|s| s.to_string())),
            }
        }
        args
    };

    let cases = vec![
        case(
            &["inspect", "--model", "gpt-5"],
            &["unknown model 'gpt-5'", "llama3-8b"],
        ),
        case(
            &["inspect", "--model", "/no/such/config.json"],
            &["/no/such/config.json", "cannot read"],
        ),
        case(
            &["inspect", "--model", "/no/such/model.onnx"],
            &["/no/such/model.onnx"],
        ),
        case(
            &["inspect", "--model", d.to_str().unwrap()],
            &["unknown model"],
        ),
        case(
            &["inspect", "--model", &malformed],
            &["malformed.json: line 1"],
        ),
        case(&["inspect", "--model", &empty], &["empty.json: line 1"]),
        case(&["inspect", "--model", &junk], &["junk.json"]),
        case(
            &["inspect", "--model", &no_kind],
            &["nokind.json", "neither"],
        ),
        case(
            &["inspect", "--model", &t5],
            &["t5.json", "'t5'", "supported"],
        ),
        case(
            &["inspect", "--model", &missing],
            &["missing.json", ": missing"],
        ),
        case(
            &["inspect", "--model", &negative],
            &["negative.json", "hidden_size"],
        ),
        case(
            &["inspect", "--model", &zero_layers],
            &["zerolayers.json", "num_hidden_layers", "positive"],
        ),
        case(
            &["inspect", "--model", &bad_kv],
            &["badkv.json", "kv_heads"],
        ),
        case(
            &["inspect", "--model", &string_num],
            &["stringnum.json", "vocab_size"],
        ),
        case(&["inspect", "--model", &bad_moe], &["badmoe.json", "top_k"]),
        case(
            &["inspect", "--model", &bad_tie],
            &["badtie.json", "tie_word_embeddings"],
        ),
        case(
            &["inspect", "--model", &wrong_schema],
            &["schema.json", "schema", "parallax-graph/9"],
        ),
        case(
            &["inspect", "--model", &dangling],
            &["dangling.json", "99999"],
        ),
        case(
            &["inspect", "--model", &unknown_field],
            &["unknownfield.json", "nmae"],
        ),
        case(&["inspect", "--model", &shape], &["shape.json", "node"]),
        case(
            &["inspect", "--model", &op_key],
            &["opkey.json", "in_features"],
        ),
        case(
            &["inspect", "--model", &no_nodes],
            &["nonodes.json", "no nodes"],
        ),
        case(&["inspect", "--model", &truncated], &["truncated.onnx"]),
        case(&["inspect", "--model", &garbage], &["garbage.onnx"]),
        case(
            &["inspect", "--model", &unsupported],
            &["unsupported.onnx", "unsupported ONNX op types"],
        ),
        case(
            &["inspect", "--model", "gpt2", "--seq", "0"],
            &["gpt2", "seq", "at least 1"],
        ),
        case(&["inspect", "--model", "gpt2", "--seq", "-5"], &["-5"]),
        case(&["inspect", "--model", "gpt2", "--seq", "abc"], &["--seq"]),
        case(
            &["inspect", "--model", "gpt2", "--batch", "0"],
            &["batch", "at least 1"],
        ),
        case(
            &["inspect", "--model", "gpt2", "--seq", "4096"],
            &["gpt2", "1024 learned positions"],
        ),
        case(
            &["inspect", "--model", "gpt2", "--precision", "fp64"],
            &["--precision", "fp64"],
        ),
        case(
            &["inspect", "--model", "gpt2", "--save-graph", &existing],
            &["existing.json", "already exists", "--force"],
        ),
        case(
            &[
                "inspect",
                "--model",
                "gpt2",
                "--save-graph",
                "/no/such/dir/g.json",
            ],
            &["/no/such/dir/g.json", "cannot write"],
        ),
        case(&["inspect"], &["--model"]),
        case(&["models", "--frobnicate"], &["--frobnicate"]),
        case(&["teleport"], &["teleport"]),
        case(
            &["clusters", "--show", "dgx-z900"],
            &["dgx-z900", "dgx-a100-80gb"],
        ),
        case(&["clusters", "--show", "dgx-a100-80gb:gpus=0"], &["gpus"]),
        case(
            &["clusters", "--show", "dgx-a100-80gb:gpus=12"],
            &["gpus=12", "whole nodes"],
        ),
        case(
            &["clusters", "--show", "dgx-a100-80gb:gpus=many"],
            &["many"],
        ),
        case(&["clusters", "--show", "dgx-a100-80gb:nodes=2"], &["nodes"]),
        case(
            &["clusters", "--show", "/no/such/profile.toml"],
            &["/no/such/profile.toml"],
        ),
        case(&["clusters", "--show", &bad_toml], &["bad.toml"]),
        case(
            &["clusters", "--show", &unknown_key],
            &["unknownkey.toml", "warp_drive"],
        ),
        case(
            &["clusters", "--show", &eff],
            &["eff.toml", "memory_efficiency"],
        ),
        case(
            &["clusters", "--show", &neg_nic],
            &["negnic.toml", "nic_gbit"],
        ),
        case(
            &["clusters", "--show", &neg_host],
            &["neghost.toml", "host_memory_gib"],
        ),
        // A search budget is a positive number of seconds, for per-op plans.
        case(
            &[
                "plan",
                "--model",
                "resnet50",
                "--cluster",
                "dgx-a100-80gb:gpus=8",
                "--global-batch",
                "64",
                "--search-seconds",
                "nan",
            ],
            &["--search-seconds", "(0, 86400]"],
        ),
        case(
            &[
                "plan",
                "--model",
                "gpt3-1.3b",
                "--cluster",
                "dgx-a100-80gb:gpus=8",
                "--global-batch",
                "8",
                "--search-seconds",
                "1",
            ],
            &["--search-seconds applies to per-op plans"],
        ),
        // Offload names its values and the ZeRO stage it needs; the executor refuses it.
        case(
            &sim(&["--model", "gpt3-1.3b", "--plan", "dp=8,offload=disk"]),
            &["--plan", "unknown offload 'disk'"],
        ),
        case(
            &sim(&[
                "--model",
                "gpt3-1.3b",
                "--plan",
                "dp=8,zero=0,offload=optimizer",
            ]),
            &["offload optimizer needs zero 1, 2 or 3"],
        ),
        // A preset without drives prices no NVMe offload, and says what would describe them.
        case(
            &sim(&[
                "--model",
                "gpt3-1.3b",
                "--plan",
                "dp=8,zero=3,offload=params-nvme",
            ]),
            &["offload params-nvme", "node.nvme", "calibrate --nvme"],
        ),
        case(
            &[
                "calibrate",
                "--out",
                &format!("{}/never.toml", d.display()),
                "--nvme",
                "/no/such/folder",
            ],
            &["--nvme /no/such/folder", "not a folder"],
        ),
        case(
            &[
                "run",
                "--model",
                "gpt-tiny",
                "--plan",
                "dp=1,zero=1,offload=optimizer",
                "--global-batch",
                "2",
                "--steps",
                "1",
            ],
            &["offload optimizer", "executor"],
        ),
        // A per-op plan takes dp, tp, pp, mb, schedule and recompute; cp is a transformer knob.
        case(
            &sim(&["--model", "resnet50", "--plan", "cp=2"]),
            &["--plan", "cp", "transformer"],
        ),
        // dp × tp × pp must be the cluster's device count.
        case(
            &sim(&["--model", "resnet50", "--plan", "dp=3,tp=2"]),
            &["--plan", "8 devices"],
        ),
        case(&sim(&["--cluster", "dgx-z900:gpus=8"]), &["dgx-z900"]),
        case(&sim(&["--plan", "tp=0"]), &["--plan", "tp"]),
        case(&sim(&["--plan", "warp=9"]), &["--plan", "warp"]),
        case(
            &sim(&["--plan", "/no/such/plan.json"]),
            &["/no/such/plan.json", "cannot read"],
        ),
        case(&sim(&["--plan", &bad_plan]), &["badplan.json"]),
        case(&sim(&["--global-batch", "0"]), &["--global-batch"]),
        case(&sim(&["--plan", "tp=3"]), &["--plan", "tp=3", "divide"]),
        case(
            &sim(&["--plan", "tp=3,schedule=interleaved-1f1b"]),
            &["tp=3", "do not divide 8"],
        ),
        case(
            &sim(&["--plan", "tp=2,dp=4,mb=3"]),
            &["micro-batch 3", "2 sequences per data-parallel replica"],
        ),
        case(
            &sim(&["--plan", "tp=2,cp=4", "--seq", "250"]),
            &["cp=4", "seq 250"],
        ),
        case(
            &sim(&["--plan", "pp=2,schedule=interleaved-1f1b,v=100"]),
            &["v = 100", "pp × v = 200", "24 layers"],
        ),
        case(
            &sim(&["--plan", "pp=1,schedule=1f1b"]),
            &["schedule 1f1b needs pp > 1"],
        ),
        case(
            &sim(&[
                "--cluster",
                "dgx2-v100-32gb:gpus=16",
                "--plan",
                "tp=8",
                "--precision",
                "bf16",
            ]),
            &["bf16"],
        ),
        case(&sim(&["--precision", "fp4"]), &["--precision", "fp4"]),
        case(
            &sim(&["--trace", &existing]),
            &["existing.json", "already exists"],
        ),
        case(
            &["validate", "/no/such/cases.json"],
            &["/no/such/cases.json", "cannot read"],
        ),
        case(&["validate", &malformed], &["malformed.json: line"]),
        // hostile-input D1, D5–D7, D12, D14–D16 and the negative numbers of severity 4.
        case(
            &tiny(&["--trace", &existing]),
            &["existing.json", "already exists"],
        ),
        case(
            &tiny(&["--trace", "/proc/nope/t.json"]),
            &["--trace", "does not exist"],
        ),
        case(&tiny(&["--save", &a_file]), &["--save", "not a folder"]),
        case(
            &tiny(&["--save", &ckpt]),
            &["--save", "another run's checkpoint"],
        ),
        case(&tiny(&["--timeout", "1e20"]), &["--timeout", "at most"]),
        case(
            &tiny(&["--save", &ckpt, "--save-every", "0"]),
            &["--save-every"],
        ),
        case(&tiny(&["--seed", "-1"]), &["'-1'", "--seed"]),
        case(
            &tiny(&["--data", &empty]),
            &["--data", "empty.json", "0 bytes"],
        ),
        // What neither the planner nor the executor runs: context parallelism over Mamba.
        case(
            &[
                "run",
                "--model",
                "nemotron-h",
                "--plan",
                "cp=2",
                "--global-batch",
                "2",
                "--seq",
                "16",
                "--steps",
                "1",
            ]
            .map(String::from),
            &["context parallelism", "Mamba-2"],
        ),
        case(&tiny(&["--cluster", "dgx-z900:gpus=8"]), &["dgx-z900"]),
        case(
            &tiny(&["--cluster", "dgx-a100-80gb:gpus=8"]),
            &["--cluster", "8 devices", "1 ranks"],
        ),
        case(
            &["run", &plan_file, "--model", "llama-tiny"],
            &["--model llama-tiny", "not both"],
        ),
        case(&sim(&["--global-batch", "-1"]), &["'-1'", "--global-batch"]),
        case(
            &sim(&["--global-batch", "1000000000"]),
            &["--global-batch 1000000000"],
        ),
        case(&sim(&["--seq", "4096"]), &["seq", "2048 learned positions"]),
        case(
            &sim(&["--seq", "18446744073709551615"]),
            &["seq", "18446744073709551615"],
        ),
        case(&sim(&["--plan", "v=1000"]), &["v=1000 needs pp > 1"]),
        case(
            &sim(&["--plan", &tiny_plan_path]),
            &["made for model gpt-tiny, not gpt3-1.3b"],
        ),
        case(
            &sim(&["--plan", &zero_batch_plan]),
            &["zerobatch.json", "training.global_batch"],
        ),
        // D9, D12: sizes the machine cannot hold, counts that would overflow.
        case(
            &[
                "run",
                "--model",
                "gpt3-175b",
                "--plan",
                "dp=1",
                "--global-batch",
                "1",
                "--seq",
                "16",
                "--steps",
                "1",
            ],
            &["--model gpt3-175b", "GiB", "available"],
        ),
        case(
            &["inspect", "--model", &huge_ffn],
            &["hugeffn.json", "intermediate_size", "too large"],
        ),
        case(
            &["inspect", "--model", &deep],
            &["deep.json", "layers 10000000", "beyond"],
        ),
        case(
            &[
                "inspect",
                "--model",
                "llama3-8b",
                "--batch",
                "18446744073709551615",
            ],
            &["--batch"],
        ),
        case(&sim(&["--plan", "tp=2,tp=4"]), &["tp given twice"]),
        case(
            &sim(&["--cluster", "dgx-a100-80gb:gpus=8,gpus=16"]),
            &["gpus given twice"],
        ),
        case(
            &sim(&["--cluster", &format!("{nan_band}:gpus=8")]),
            &["calibration.step_time_band", "NaN"],
        ),
        case(
            &sim(&["--cluster", &format!("{neg_band}:gpus=8")]),
            &["calibration.step_time_band", "-1"],
        ),
        case(
            &sim(&["--cluster", &format!("{escape_name}:gpus=8")]),
            &["name", "control characters"],
        ),
        case(
            &sim(&["--plan", "tp=2,pp=2", "--global-batch", "16000000"]),
            &["micro-batches per data-parallel replica"],
        ),
        case(&["validate", &wrong_schema], &["schema.json"]),
        case(
            &["validate", &typo_case],
            &["typo.json", "unknown field `kv_head`"],
        ),
        case(
            &["validate", &tp3_case],
            &["tp3.json", "case '", "plan", "GPUs"],
        ),
        case(
            &["validate", &zero7_case],
            &["zero7.json", "plan.zero_stage"],
        ),
        case(
            &["validate", &rwkv_case],
            &["rwkv.json", "model.arch 'rwkv'"],
        ),
        case(
            &tiny_run("llama-tiny", "--resume", &ckpt),
            &["--resume", "gpt-ckpt", "tensor", "the model needs"],
        ),
    ];
    assert!(cases.len() >= 30);
    let mut failures = Vec::new();
    for c in &cases {
        let out = Command::new(bin())
            .args(&c.args)
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        let code = out.status.code();
        let ok = code == Some(2)
            && !stderr.contains("panicked")
            && !stderr.contains("backtrace")
            && c.expect.iter().all(|e| stderr.contains(e))
            && lines.len() == 1
            && lines[0].starts_with("error: ");
        if !ok {
            failures.push(format!("{:?} -> status {code:?}, stderr: {stderr}", c.args));
        }
    }
    // The user's file was not touched.
    assert_eq!(std::fs::read(&existing).unwrap(), b"precious user data");
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

fn parallax_preset(name: &str) -> String {
    let out = Command::new(bin())
        .args(["clusters", "--show", name])
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parallax-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `parallax run` of `model` over `dp` ranks (two sequences of 16 tokens each), `steps` steps,
/// then `extra`.
fn run_args(model: &str, dp: u32, steps: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["run", "--model", model, "--plan"]
        .map(String::from)
        .to_vec();
    args.push(format!("dp={dp}"));
    args.extend(["--global-batch".into(), (2 * dp).to_string()]);
    args.extend(["--seq", "16", "--steps", steps].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// gpt-tiny on two ranks.
fn tiny_run_args(steps: &str, extra: &[&str]) -> Vec<String> {
    run_args("gpt-tiny", 2, steps, extra)
}

/// One step of gpt-tiny saving into `dir`.
fn run_one_step_saving_into(dir: &std::path::Path) -> std::process::Output {
    Command::new(bin())
        .args(tiny_run_args("1", &["--save", dir.to_str().unwrap()]))
        .output()
        .unwrap()
}

/// hostile-input D3: a reader that goes away (`run … | head -n 1`) neither ends the run nor
/// makes it report success without its last checkpoint.
#[test]
fn a_closed_stdout_does_not_end_a_run() {
    use std::io::BufRead;
    let dir = scratch("closed-stdout");
    let ck = dir.join("ck");
    let mut child = Command::new(bin())
        .args(tiny_run_args("12", &["--save", ck.to_str().unwrap()]))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("step "), "{first}");
    // The reader is gone: the pipe is closed.
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(ck.join("LATEST")).unwrap().trim(),
        "step-00000012"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// hostile-input D4: a diverged run says so, exits non-zero and saves no NaN checkpoint.
#[test]
fn a_diverged_run_stops_and_keeps_no_nan_checkpoint() {
    let dir = scratch("diverged");
    let ck = dir.join("ck");
    let out = Command::new(bin())
        .args(tiny_run_args(
            "3",
            &["--lr", "1e30", "--save", ck.to_str().unwrap(), "--json"],
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("loss is NaN"), "{stderr}");
    assert!(!stderr.contains("87.33"), "{stderr}");
    assert!(!ck.join("LATEST").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// hostile-input D5: `--save DIR` never replaces a user's files in DIR.
#[test]
fn save_refuses_a_folder_with_a_users_files() {
    let dir = scratch("save-user-files");
    std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
    std::fs::write(dir.join("LATEST"), b"my own latest").unwrap();
    let out = run_one_step_saving_into(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("notes.txt") || stderr.contains("LATEST"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(dir.join("LATEST")).unwrap(), b"my own latest");
    assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"mine");
    std::fs::remove_dir_all(&dir).ok();
}

/// hostile-input D11: a full disk behind stdout is an error (exit 1), not a panic.
#[test]
fn a_failed_write_to_stdout_is_one_line_and_status_1() {
    let Ok(full) = std::fs::File::create("/dev/full") else {
        eprintln!("skipped: no /dev/full here");
        return;
    };
    let out = Command::new(bin())
        .arg("models")
        .stdout(full)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr.trim(),
        "error: cannot write to stdout: No space left on device"
    );
}

/// hostile-input D5: a run resumed from an older checkpoint does not replace a newer one.
#[test]
fn a_resumed_run_never_replaces_a_checkpoint() {
    let dir = scratch("no-replace");
    let ck = dir.join("ck");
    let ck_s = ck.to_str().unwrap();
    let first = Command::new(bin())
        .args(tiny_run_args("4", &["--save-every", "2", "--save", ck_s]))
        .output()
        .unwrap();
    assert!(first.status.success());
    let newest = std::fs::read(ck.join("step-00000004/tensors.bin")).unwrap();
    let older = ck.join("step-00000002").display().to_string();
    let again = Command::new(bin())
        .args(tiny_run_args("2", &["--resume", &older, "--save", ck_s]))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("step-00000004"), "{stderr}");
    assert_eq!(
        std::fs::read(ck.join("step-00000004/tensors.bin")).unwrap(),
        newest
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// hostile-input D5: two runs saving into one folder at once would interleave their
/// checkpoints; the second is refused while the first lives, and a killed run's lock is
/// taken over.
#[test]
fn a_folder_another_live_run_saves_into_is_refused() {
    let dir = scratch("save-lock");
    let lock = dir.join(".parallax-lock");
    // This test's own process stands for a live run holding the folder.
    std::fs::write(&lock, std::process::id().to_string()).unwrap();
    let out = run_one_step_saving_into(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("process {}", std::process::id())) && stderr.contains("--save"),
        "{stderr}"
    );
    assert!(!dir.join("LATEST").exists());
    // A lock left by a process that is gone is taken over, and released at the end.
    std::fs::write(&lock, "4294967295").unwrap();
    let out = run_one_step_saving_into(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.join("LATEST").exists());
    assert!(!lock.exists());
    std::fs::remove_dir_all(&dir).ok();
}
