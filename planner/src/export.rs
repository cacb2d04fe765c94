//! Exports of a plan to the training engines teams run: Megatron-LM (`pretrain_gpt.py`
//! arguments), DeepSpeed (`ds_config.json`) and torchtitan (its TOML job config).
//!
//! Each engine offers only part of the layout space; [`Engine::supports`] says which part, so
//! the planner can search inside it (`parallax plan --export ENGINE`) and an export never
//! silently drops a knob: [`export`] refuses a layout the engine cannot express.

use crate::search::Space;
use parallax_cost::transformer::{Runtime, SelectivePolicy};
use parallax_ir::models::{Mlp, Norm, Position, TransformerConfig};
use parallax_ir::{Layout, Plan, Precision, Recompute, Schedule};
use serde_json::json;
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// A training engine a plan can be exported to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Engine {
    /// Megatron-LM / Megatron-Core `pretrain_gpt.py`.
    Megatron,
    /// DeepSpeed (ZeRO, pipeline engine, AutoTP).
    DeepSpeed,
    /// torchtitan (FSDP2, TP, PP, CP).
    Torchtitan,
}

impl Engine {
    /// All engines.
    pub const ALL: [Engine; 3] = [Engine::Megatron, Engine::DeepSpeed, Engine::Torchtitan];

    /// Name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Megatron => "megatron",
            Engine::DeepSpeed => "deepspeed",
            Engine::Torchtitan => "torchtitan",
        }
    }

    /// File the export is written to.
    pub fn file_name(self) -> &'static str {
        match self {
            Engine::Megatron => "megatron_args.sh",
            Engine::DeepSpeed => "ds_config.json",
            Engine::Torchtitan => "torchtitan.toml",
        }
    }

    /// How the engine behaves beyond the layout, for predicting the plans it will run:
    /// torchtitan is plain FSDP2 + SDPA (no userbuffer overlap of TP collectives; op-level
    /// selective checkpointing that saves only every second matmul output; pipelined models
    /// kept gathered across micro-batches); the others run the current default stack.
    pub fn runtime(self) -> Runtime {
        match self {
            Engine::Torchtitan => Runtime {
                tp_comm_overlap: false,
                selective: SelectivePolicy::CheapOpsAndAlternateMatmuls,
                zero3_gathered_under_pp: true,
                ..Runtime::default()
            },
            Engine::Megatron | Engine::DeepSpeed => Runtime::default(),
        }
    }

    /// The part of the layout space the engine offers that a [`Space`] can say: its pipeline
    /// schedules, ZeRO stages and recompute policies, and whether its stages may be uneven.
    /// The search stays inside it for a plan meant for export; [`Engine::supports`] adds what
    /// depends on the layout.
    pub fn space(self) -> Space {
        match self {
            Engine::Megatron => Space {
                schedules: vec![Schedule::OneFOneB, Schedule::Interleaved1F1B],
                uneven_stages: false,
                ..Space::default()
            },
            Engine::DeepSpeed => Space {
                schedules: vec![Schedule::OneFOneB],
                recompute: vec![Recompute::None, Recompute::Full],
                ..Space::default()
            },
            Engine::Torchtitan => Space {
                schedules: vec![
                    Schedule::GPipe,
                    Schedule::OneFOneB,
                    Schedule::Interleaved1F1B,
                ],
                zero_stages: vec![0, 2, 3],
                ..Space::default()
            },
        }
    }

    /// Why the engine cannot run `l`, or `None` when it can. No engine takes the planner's
    /// balanced stage ranges; beyond that:
    ///
    /// - Megatron-LM: 1F1B and interleaved 1F1B only; ZeRO 0 (DDP), 1–2 (distributed
    ///   optimizer) or 3 (`--use-torch-fsdp2`, FSDP2 needs pp = 1 there); every (virtual)
    ///   stage holds the same number of layers.
    /// - DeepSpeed: its pipeline engine runs 1F1B with ZeRO 0–1 only; no context parallelism;
    ///   recompute none or full (activation checkpointing); its `uniform` partition.
    /// - torchtitan: GPipe, 1F1B, interleaved 1F1B; DDP (ZeRO 0), FSDP with or without
    ///   resharding after forward (ZeRO 3 and 2; FSDP shards gradients too, so no ZeRO-1);
    ///   its own split points, uneven where the layers do not divide.
    pub fn supports(self, l: &Layout, layers: u32) -> Option<String> {
        self.supports_within(&self.space(), l, layers)
    }

    /// [`Engine::supports`] with the engine's [`Engine::space`] built once by the caller (the
    /// search asks for every candidate).
    pub(crate) fn supports_within(self, space: &Space, l: &Layout, layers: u32) -> Option<String> {
        let name = self.name();
        if !l.stages.is_empty() {
            return Some(format!("{name} splits stages evenly"));
        }
        if l.schedule != Schedule::None && !space.schedules.contains(&l.schedule) {
            return Some(format!("{name} has no {} schedule", l.schedule));
        }
        if !space.recompute.contains(&l.recompute) {
            return Some(format!("{name} has no {} recomputation", l.recompute));
        }
        if !space.zero_stages.contains(&l.zero_stage) {
            return Some(format!("{name} has no ZeRO-{}", l.zero_stage));
        }
        let chunks = l.pp * l.interleave.max(1);
        if !space.uneven_stages && layers % chunks != 0 {
            return Some(format!(
                "{name} splits the {layers} layers evenly over pp × v = {chunks} stages"
            ));
        }
        match self {
            Engine::Megatron if l.zero_stage == 3 && l.pp > 1 => {
                Some("megatron runs FSDP (ZeRO-3) without pipeline parallelism only".into())
            }
            Engine::DeepSpeed if l.pp > 1 && l.zero_stage >= 2 => {
                Some("deepspeed's pipeline engine supports ZeRO 0 and 1 only".into())
            }
            Engine::DeepSpeed if l.cp > 1 => Some("deepspeed has no context parallelism".into()),
            Engine::DeepSpeed if l.ep > 1 => {
                Some("deepspeed export does not cover expert parallelism".into())
            }
            Engine::Torchtitan if l.ep > 1 => {
                Some("torchtitan export does not cover expert parallelism".into())
            }
            _ => None,
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Engine::ALL
            .into_iter()
            .find(|e| e.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                format!("unknown engine '{s}' (expected megatron, deepspeed or torchtitan)")
            })
    }
}

/// Why a plan could not be exported.
#[derive(Debug, Error, PartialEq)]
pub enum ExportError {
    #[error("cannot export to {engine}: {reason}")]
    Unsupported { engine: Engine, reason: String },
}

/// Gradient accumulation steps (micro-batches per step per data-parallel rank).
fn accumulation(plan: &Plan) -> u64 {
    plan.layout.micro_batches(plan.training.global_batch)
}

/// The engine's configuration for `plan` of `model`.
pub fn export(
    engine: Engine,
    plan: &Plan,
    model: &TransformerConfig,
) -> Result<String, ExportError> {
    if let Some(reason) = engine.supports(&plan.layout, model.layers) {
        return Err(ExportError::Unsupported { engine, reason });
    }
    Ok(match engine {
        Engine::Megatron => megatron(plan, model),
        Engine::DeepSpeed => deepspeed(plan),
        Engine::Torchtitan => torchtitan(plan, model),
    })
}

/// `pretrain_gpt.py` arguments, one per line, as a shell script.
fn megatron(plan: &Plan, m: &TransformerConfig) -> String {
    let l = &plan.layout;
    let t = &plan.training;
    let mut a: Vec<String> = vec![
        format!("--num-layers {}", m.layers),
        format!("--hidden-size {}", m.hidden),
        format!("--num-attention-heads {}", m.heads),
        format!("--ffn-hidden-size {}", m.ffn_hidden),
        format!("--seq-length {}", t.seq_len),
        format!("--max-position-embeddings {}", m.max_seq.max(t.seq_len)),
    ];
    if m.kv_heads != m.heads {
        a.push("--group-query-attention".into());
        a.push(format!("--num-query-groups {}", m.kv_heads));
    }
    if m.mlp == Mlp::Swiglu {
        a.push("--swiglu".into());
    }
    if m.norm == Norm::RmsNorm {
        a.push("--normalization RMSNorm".into());
    }
    if m.position == Position::Rope {
        a.push("--position-embedding-type rope".into());
    }
    if !m.tied_embeddings {
        a.push("--untie-embeddings-and-output-weights".into());
    }
    if !m.bias {
        a.push("--disable-bias-linear".into());
    }
    if let Some(moe) = m.moe {
        a.push(format!("--num-experts {}", moe.experts));
        a.push(format!("--moe-router-topk {}", moe.top_k));
        a.push(format!("--expert-model-parallel-size {}", l.ep));
    }
    a.push(format!("--tensor-model-parallel-size {}", l.tp));
    a.push(format!("--pipeline-model-parallel-size {}", l.pp));
    a.push(format!("--context-parallel-size {}", l.cp));
    if l.schedule == Schedule::Interleaved1F1B {
        a.push(format!(
            "--num-layers-per-virtual-pipeline-stage {}",
            m.layers / (l.pp * l.interleave)
        ));
    }
    a.push(format!("--micro-batch-size {}", l.micro_batch));
    a.push(format!("--global-batch-size {}", t.global_batch));
    if l.sequence_parallel && l.tp > 1 {
        a.push("--sequence-parallel".into());
    }
    match l.recompute {
        Recompute::None => {}
        Recompute::Selective => a.push("--recompute-granularity selective".into()),
        Recompute::Full => {
            a.push("--recompute-granularity full".into());
            a.push("--recompute-method uniform".into());
            a.push("--recompute-num-layers 1".into());
        }
    }
    match l.zero_stage {
        0 => {}
        1 | 2 => a.push("--use-distributed-optimizer".into()),
        _ => a.push("--use-torch-fsdp2".into()),
    }
    match t.precision {
        Precision::Bf16 => a.push("--bf16".into()),
        Precision::Fp16 => a.push("--fp16".into()),
        Precision::Fp8 => {
            a.push("--bf16".into());
            a.push("--fp8-format hybrid".into());
        }
        Precision::Fp32 | Precision::Tf32 => {}
    }
    let mut s = format!(
        "#!/bin/sh\n# parallax plan: {} on {} ({} GPUs), dp {} (implied by the world size)\n\
         # launch on every node with torchrun; Megatron-LM derives dp = world / (tp × pp × cp).\n\
         torchrun --nproc-per-node {} pretrain_gpt.py \\\n",
        plan.model.name,
        plan.cluster.spec,
        plan.cluster.gpus,
        l.dp,
        plan.cluster.gpus.min(gpus_per_node_hint(plan)),
    );
    let n = a.len();
    for (i, arg) in a.iter().enumerate() {
        s.push_str("    ");
        s.push_str(arg);
        s.push_str(if i + 1 < n {
            " \\\n"
        } else {
            " \\\n    \"$@\"\n"
        });
    }
    s
}

/// Devices per node for the launcher line: the plan's cluster's, when its spec resolves (a
/// preset or a readable profile); else at least tp (the tensor-parallel group sits in a node)
/// and 8, the common node size.
fn gpus_per_node_hint(plan: &Plan) -> u32 {
    parallax_hardware::Cluster::parse(&plan.cluster.spec)
        .map_or(plan.layout.tp.max(8), |c| c.profile.node.gpus_per_node)
}

/// A DeepSpeed `ds_config.json`.
fn deepspeed(plan: &Plan) -> String {
    let l = &plan.layout;
    let t = &plan.training;
    let mut doc = json!({
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": l.micro_batch,
        "gradient_accumulation_steps": accumulation(plan),
        "zero_optimization": { "stage": l.zero_stage },
        "bf16": { "enabled": matches!(t.precision, Precision::Bf16 | Precision::Fp8) },
        "fp16": { "enabled": t.precision == Precision::Fp16 },
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": false,
    });
    if l.pp > 1 {
        doc["pipeline"] = json!({
            "stages": l.pp,
            "partition_method": "uniform",
            "activation_checkpoint_interval": if l.recompute == Recompute::Full { 1 } else { 0 },
        });
    }
    if l.tp > 1 {
        doc["tensor_parallel"] = json!({ "autotp_size": l.tp });
    }
    if l.recompute == Recompute::Full {
        doc["activation_checkpointing"] = json!({
            "partition_activations": l.tp > 1,
            "contiguous_memory_optimization": false,
            "cpu_checkpointing": false,
        });
    }
    serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
}

/// torchtitan's `[parallelism]`, `[training]` and `[activation_checkpoint]` sections.
fn torchtitan(plan: &Plan, m: &TransformerConfig) -> String {
    let l = &plan.layout;
    let t = &plan.training;
    let (replicate, shard) = if l.zero_stage == 0 {
        (l.dp, 1)
    } else {
        (1, l.dp)
    };
    let mut p = toml::Table::new();
    p.insert(
        "data_parallel_replicate_degree".into(),
        i64::from(replicate).into(),
    );
    p.insert("data_parallel_shard_degree".into(), i64::from(shard).into());
    p.insert(
        "fsdp_reshard_after_forward".into(),
        (if l.zero_stage == 2 {
            "never"
        } else {
            "default"
        })
        .into(),
    );
    p.insert("tensor_parallel_degree".into(), i64::from(l.tp).into());
    p.insert("enable_async_tensor_parallel".into(), false.into());
    p.insert("pipeline_parallel_degree".into(), i64::from(l.pp).into());
    p.insert("context_parallel_degree".into(), i64::from(l.cp).into());
    // torchtitan's sequence parallelism is always on with TP (its TP plan shards norms).
    if l.pp > 1 {
        let sched = match l.schedule {
            Schedule::GPipe => "GPipe",
            Schedule::Interleaved1F1B => "Interleaved1F1B",
            _ => "1F1B",
        };
        p.insert("pipeline_parallel_schedule".into(), sched.into());
        p.insert(
            "pipeline_parallel_microbatch_size".into(),
            (l.micro_batch as i64).into(),
        );
        let chunks = l.pp * l.interleave;
        if m.layers % chunks == 0 {
            p.insert(
                "pipeline_parallel_layers_per_stage".into(),
                i64::from(m.layers / chunks).into(),
            );
        }
    }
    let mut tr = toml::Table::new();
    // Per data-parallel rank: the whole share with a pipeline (split into micro-batches), one
    // micro-batch without (torchtitan accumulates gradients up to the global batch).
    let local = if l.pp > 1 {
        t.global_batch / u64::from(l.dp)
    } else {
        l.micro_batch
    };
    tr.insert("local_batch_size".into(), (local as i64).into());
    tr.insert("global_batch_size".into(), (t.global_batch as i64).into());
    tr.insert("seq_len".into(), (t.seq_len as i64).into());
    tr.insert(
        "mixed_precision_param".into(),
        (match t.precision {
            Precision::Fp16 => "float16",
            Precision::Fp32 | Precision::Tf32 => "float32",
            _ => "bfloat16",
        })
        .into(),
    );
    tr.insert("mixed_precision_reduce".into(), "float32".into());
    let mut ac = toml::Table::new();
    ac.insert(
        "mode".into(),
        (match l.recompute {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        })
        .into(),
    );
    if l.recompute == Recompute::Selective {
        ac.insert("selective_ac_option".into(), "op".into());
    }
    let mut doc = toml::Table::new();
    doc.insert("parallelism".into(), p.into());
    doc.insert("training".into(), tr.into());
    doc.insert("activation_checkpoint".into(), ac.into());
    if t.precision == Precision::Fp8 {
        let mut f = toml::Table::new();
        f.insert(
            "enable_fsdp_float8_all_gather".into(),
            (l.zero_stage >= 2).into(),
        );
        let mut mc = toml::Table::new();
        mc.insert(
            "converters".into(),
            toml::Value::Array(vec!["float8".into()]),
        );
        doc.insert("model".into(), mc.into());
        doc.insert("float8".into(), f.into());
    }
    format!(
        "# parallax plan: {} on {} ({} GPUs)\n{}",
        plan.model.name,
        plan.cluster.spec,
        plan.cluster.gpus,
        toml::to_string(&doc).unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_ir::models::zoo;
    use parallax_ir::plan::{ClusterRef, ModelRef, Prediction, Training};
    use parallax_ir::PLAN_SCHEMA;

    fn model(name: &str) -> TransformerConfig {
        zoo::transformer(name).unwrap()
    }

    fn plan(l: Layout, precision: Precision) -> Plan {
        Plan {
            schema: PLAN_SCHEMA.into(),
            model: ModelRef {
                name: "llama3-70b".into(),
            },
            cluster: ClusterRef {
                spec: "dgx-h100-80gb:gpus=512".into(),
                gpus: l.devices() as u32,
            },
            training: Training {
                global_batch: 1024,
                seq_len: 8192,
                precision,
            },
            layout: l,
            op_configs: Vec::new(),
            micro_batches: None,
            prediction: Some(Prediction::default()),
        }
    }

    /// The value after `flag` in a Megatron argument script.
    fn arg<'a>(s: &'a str, flag: &str) -> Option<&'a str> {
        s.lines().map(str::trim).find_map(|line| {
            let line = line.trim_end_matches(" \\");
            let rest = line.strip_prefix(flag)?;
            if rest.is_empty() {
                Some("")
            } else {
                rest.strip_prefix(' ')
            }
        })
    }

    #[test]
    fn the_launcher_starts_one_process_per_gpu_of_the_clusters_nodes() {
        let m = model("gpt3-1.3b");
        let l = Layout {
            dp: 32,
            ..Layout::default()
        };
        let nproc = |spec: &str| {
            let mut p = plan(l.clone(), Precision::Fp16);
            p.cluster.spec = spec.into();
            let s = export(Engine::Megatron, &p, &m).unwrap();
            s.split("--nproc-per-node ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(nproc("dgx2-v100-32gb:gpus=32"), "16");
        assert_eq!(nproc("jean-zay-v100-32gb:gpus=32"), "4");
        assert_eq!(nproc("dgx-a100-80gb:gpus=32"), "8");
    }

    #[test]
    fn megatron_arguments_carry_every_knob() {
        let m = model("llama3-70b");
        let l = Layout {
            dp: 8,
            tp: 8,
            pp: 4,
            cp: 2,
            zero_stage: 1,
            micro_batch: 2,
            recompute: Recompute::Full,
            sequence_parallel: true,
            schedule: Schedule::Interleaved1F1B,
            interleave: 5,
            ..Layout::default()
        };
        let p = plan(l.clone(), Precision::Bf16);
        let s = export(Engine::Megatron, &p, &m).unwrap();
        assert_eq!(arg(&s, "--tensor-model-parallel-size"), Some("8"));
        assert_eq!(arg(&s, "--pipeline-model-parallel-size"), Some("4"));
        assert_eq!(arg(&s, "--context-parallel-size"), Some("2"));
        assert_eq!(
            arg(&s, "--num-layers-per-virtual-pipeline-stage"),
            Some("4")
        );
        assert_eq!(arg(&s, "--micro-batch-size"), Some("2"));
        assert_eq!(arg(&s, "--global-batch-size"), Some("1024"));
        assert_eq!(arg(&s, "--sequence-parallel"), Some(""));
        assert_eq!(arg(&s, "--recompute-granularity"), Some("full"));
        assert_eq!(arg(&s, "--recompute-method"), Some("uniform"));
        assert_eq!(arg(&s, "--use-distributed-optimizer"), Some(""));
        assert_eq!(arg(&s, "--bf16"), Some(""));
        assert_eq!(arg(&s, "--fp16"), None);
        assert_eq!(arg(&s, "--num-layers"), Some("80"));
        assert_eq!(arg(&s, "--hidden-size"), Some("8192"));
        assert_eq!(arg(&s, "--num-attention-heads"), Some("64"));
        assert_eq!(arg(&s, "--num-query-groups"), Some("8"));
        assert_eq!(arg(&s, "--ffn-hidden-size"), Some("28672"));
        assert_eq!(arg(&s, "--seq-length"), Some("8192"));
        assert_eq!(arg(&s, "--swiglu"), Some(""));
        // Megatron-LM takes dp from the world size (world / (tp × pp × cp)): the script
        // launches a node's GPUs per node and names the dp it implies.
        assert!(
            s.contains("torchrun --nproc-per-node 8 pretrain_gpt.py"),
            "{s}"
        );
        assert!(s.contains("(512 GPUs), dp 8 (implied"), "{s}");

        let plain = Layout {
            zero_stage: 0,
            recompute: Recompute::Selective,
            sequence_parallel: false,
            schedule: Schedule::OneFOneB,
            interleave: 1,
            ..l
        };
        let s = export(Engine::Megatron, &plan(plain, Precision::Fp16), &m).unwrap();
        assert_eq!(arg(&s, "--recompute-granularity"), Some("selective"));
        assert_eq!(arg(&s, "--use-distributed-optimizer"), None);
        assert_eq!(arg(&s, "--sequence-parallel"), None);
        assert_eq!(arg(&s, "--num-layers-per-virtual-pipeline-stage"), None);
        assert_eq!(arg(&s, "--fp16"), Some(""));
    }

    #[test]
    fn deepspeed_config_carries_every_knob() {
        let m = model("llama3-70b");
        let l = Layout {
            dp: 16,
            tp: 4,
            pp: 8,
            zero_stage: 1,
            micro_batch: 4,
            recompute: Recompute::Full,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        };
        let p = plan(l, Precision::Bf16);
        let s = export(Engine::DeepSpeed, &p, &m).unwrap();
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["train_batch_size"], 1024);
        assert_eq!(v["train_micro_batch_size_per_gpu"], 4);
        assert_eq!(v["gradient_accumulation_steps"], 1024 / (16 * 4));
        assert_eq!(v["zero_optimization"]["stage"], 1);
        assert_eq!(v["bf16"]["enabled"], true);
        assert_eq!(v["fp16"]["enabled"], false);
        assert_eq!(v["pipeline"]["stages"], 8);
        assert_eq!(v["pipeline"]["activation_checkpoint_interval"], 1);
        assert_eq!(v["tensor_parallel"]["autotp_size"], 4);

        // ZeRO-3 only without a pipeline; no context parallelism; no selective recompute.
        let bad = Layout {
            zero_stage: 3,
            ..p.layout.clone()
        };
        assert!(export(Engine::DeepSpeed, &plan(bad, Precision::Bf16), &m).is_err());
        let z3 = Layout {
            dp: 128,
            tp: 4,
            pp: 1,
            zero_stage: 3,
            micro_batch: 1,
            schedule: Schedule::None,
            ..Layout::default()
        };
        let v: serde_json::Value = serde_json::from_str(
            &export(Engine::DeepSpeed, &plan(z3, Precision::Fp16), &m).unwrap(),
        )
        .unwrap();
        assert_eq!(v["zero_optimization"]["stage"], 3);
        assert_eq!(v["fp16"]["enabled"], true);
        assert!(v.get("pipeline").is_none());
        assert_eq!(v["gradient_accumulation_steps"], 8);
    }

    #[test]
    fn torchtitan_config_carries_every_knob() {
        let m = model("llama3-70b");
        let l = Layout {
            dp: 8,
            tp: 8,
            pp: 4,
            cp: 2,
            zero_stage: 3,
            micro_batch: 2,
            recompute: Recompute::Selective,
            sequence_parallel: true,
            schedule: Schedule::Interleaved1F1B,
            interleave: 2,
            ..Layout::default()
        };
        let p = plan(l, Precision::Bf16);
        let s = export(Engine::Torchtitan, &p, &m).unwrap();
        let v: toml::Table = s.parse().unwrap();
        let par = v["parallelism"].as_table().unwrap();
        assert_eq!(par["data_parallel_shard_degree"].as_integer(), Some(8));
        assert_eq!(par["data_parallel_replicate_degree"].as_integer(), Some(1));
        assert_eq!(par["tensor_parallel_degree"].as_integer(), Some(8));
        assert_eq!(par["pipeline_parallel_degree"].as_integer(), Some(4));
        assert_eq!(par["context_parallel_degree"].as_integer(), Some(2));
        assert_eq!(
            par["pipeline_parallel_schedule"].as_str(),
            Some("Interleaved1F1B")
        );
        assert_eq!(
            par["pipeline_parallel_microbatch_size"].as_integer(),
            Some(2)
        );
        assert_eq!(par["fsdp_reshard_after_forward"].as_str(), Some("default"));
        assert_eq!(
            par["pipeline_parallel_layers_per_stage"].as_integer(),
            Some(10)
        );
        let tr = v["training"].as_table().unwrap();
        assert_eq!(tr["global_batch_size"].as_integer(), Some(1024));
        assert_eq!(tr["local_batch_size"].as_integer(), Some(1024 / 8));
        assert_eq!(tr["seq_len"].as_integer(), Some(8192));
        assert_eq!(tr["mixed_precision_param"].as_str(), Some("bfloat16"));
        assert_eq!(
            v["activation_checkpoint"]["mode"].as_str(),
            Some("selective")
        );

        let ddp = Layout {
            dp: 64,
            tp: 8,
            pp: 1,
            cp: 1,
            zero_stage: 0,
            micro_batch: 1,
            recompute: Recompute::None,
            schedule: Schedule::None,
            interleave: 1,
            ..Layout::default()
        };
        let v: toml::Table = export(Engine::Torchtitan, &plan(ddp, Precision::Bf16), &m)
            .unwrap()
            .parse()
            .unwrap();
        let par = v["parallelism"].as_table().unwrap();
        assert_eq!(par["data_parallel_replicate_degree"].as_integer(), Some(64));
        assert_eq!(par["data_parallel_shard_degree"].as_integer(), Some(1));
        assert!(par.get("pipeline_parallel_schedule").is_none());
        assert_eq!(v["training"]["local_batch_size"].as_integer(), Some(1));
        assert_eq!(v["activation_checkpoint"]["mode"].as_str(), Some("none"));
    }

    /// A search inside an engine's space returns what a search over every option returns
    /// once the engine refuses what it cannot run: the space only keeps out, before pricing,
    /// layouts the engine would refuse.
    #[test]
    fn an_engines_space_keeps_out_only_what_it_refuses() {
        use crate::search::{search, SearchOptions};
        use parallax_cost::transformer::Setup;
        let m = model("gpt3-1.3b");
        let c = parallax_hardware::Cluster::parse("dgx-a100-80gb:gpus=16").unwrap();
        for e in Engine::ALL {
            let s = Setup {
                runtime: e.runtime(),
                ..Setup::new(&m, &c.profile, 16, 2048, 64)
            };
            let run = |space| {
                let opts = SearchOptions {
                    top_k: 8,
                    families: false,
                    space,
                    engine: Some(e),
                    ..SearchOptions::default()
                };
                search(&s, &opts).unwrap()
            };
            let (inside, everywhere) = (run(e.space()), run(Default::default()));
            let layouts = |r: &crate::search::SearchResult| -> Vec<Layout> {
                r.top.iter().map(|p| p.layout.clone()).collect()
            };
            assert_eq!(layouts(&inside), layouts(&everywhere), "{e}");
            for p in &inside.top {
                assert_eq!(e.supports(&p.layout, m.layers), None, "{e}: {:?}", p.layout);
            }
            let refused = |r: &crate::search::SearchResult| {
                r.counts
                    .rejected
                    .get(&format!("not supported by {e}"))
                    .copied()
                    .unwrap_or(0)
            };
            assert!(refused(&inside) < refused(&everywhere), "{e}");
        }
    }

    #[test]
    fn engines_refuse_what_they_cannot_run() {
        let m = model("llama3-70b");
        let zb = Layout {
            dp: 16,
            tp: 8,
            pp: 4,
            schedule: Schedule::ZeroBubbleH1,
            ..Layout::default()
        };
        for e in Engine::ALL {
            let err = export(e, &plan(zb.clone(), Precision::Bf16), &m).unwrap_err();
            assert!(err.to_string().contains("zb-h1"), "{err}");
        }
        // 80 layers over 4 stages of 3 virtual stages each: torchtitan splits them unevenly,
        // Megatron-LM cannot.
        let uneven = Layout {
            dp: 16,
            tp: 8,
            pp: 4,
            schedule: Schedule::Interleaved1F1B,
            interleave: 3,
            ..Layout::default()
        };
        let err = export(Engine::Megatron, &plan(uneven.clone(), Precision::Bf16), &m).unwrap_err();
        assert!(err.to_string().contains("evenly over pp × v = 12"), "{err}");
        assert!(export(Engine::Torchtitan, &plan(uneven, Precision::Bf16), &m).is_ok());
        assert_eq!("DeepSpeed".parse::<Engine>(), Ok(Engine::DeepSpeed));
        assert!("jax".parse::<Engine>().is_err());
    }
}
