//! A DeepSpeed `ds_config.json` as the settings of a run (`--ds-config`): the layout knobs
//! it fixes (ZeRO stage, micro-batch, data parallelism through the batch arithmetic, offload,
//! AutoTP, the pipeline's checkpointing), the job's batch and precision, and the stack options
//! the model prices (gradient-reduction overlap, the reduce type and collective, ZeRO's
//! bucket, persistence threshold and reuse distance).
//!
//! Keys are read as DeepSpeed reads them (`deepspeed/runtime/config.py`, `zero/config.py`):
//! numbers written as integers or floats (`5e8`), `"auto"` (the HuggingFace integration's
//! placeholder) as unset. Keys that do not change a step's time or memory (optimizer,
//! scheduler, logging) are ignored; keys that do but that parallax does not price are listed
//! in [`DsConfig::unpriced`], so a report can say so.

use parallax_cost::transformer::ZeroConfig;
use parallax_ir::{Offload, PartialLayout, Precision, Recompute};
use serde_json::Value;

/// What a `ds_config.json` sets.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DsConfig {
    /// Layout knobs it fixes.
    pub fixes: PartialLayout,
    /// `train_batch_size`.
    pub train_batch: Option<u64>,
    /// From `fp16.enabled` / `bf16.enabled` (`amp.enabled` as fp16); fp32 when the file
    /// enables neither, as DeepSpeed trains then.
    pub precision: Option<Precision>,
    /// `zero_optimization.overlap_comm` (ZeRO 1–2: the gradient reduction overlaps backward).
    pub overlap_comm: Option<bool>,
    /// `communication_data_type`: whether gradients are reduced in fp32.
    pub reduce_fp32: Option<bool>,
    /// `zero_optimization.reduce_bucket_size`.
    pub reduce_bucket: Option<u64>,
    /// `zero_optimization.stage3_param_persistence_threshold`.
    pub persistence_threshold: Option<u64>,
    /// `zero_optimization.stage3_max_reuse_distance`.
    pub max_reuse_distance: Option<u64>,
    /// `activation_checkpointing.cpu_checkpointing`.
    pub cpu_checkpointing: Option<bool>,
    /// `zero_optimization.contiguous_gradients`.
    pub contiguous_gradients: Option<bool>,
    /// `zero_optimization.reduce_scatter`.
    pub reduce_scatter: Option<bool>,
    /// Keys set that change a DeepSpeed step but that parallax does not price.
    pub unpriced: Vec<String>,
    /// The file as read: `--export deepspeed` writes its plan onto it, keeping every key the
    /// plan does not decide (optimizer, scheduler, loss scaling, the ZeRO options).
    pub document: Value,
}

/// Keys DeepSpeed reads that change a step's time or memory and that parallax does not price
/// (dotted paths), with DeepSpeed's default: a key set to its default changes nothing.
const UNPRICED: &[(&str, Unset)] = &[
    ("zero_optimization.allgather_bucket_size", Unset::Is(5e8)),
    (
        "zero_optimization.round_robin_gradients",
        Unset::Flag(false),
    ),
    (
        "zero_optimization.stage3_prefetch_bucket_size",
        Unset::Is(5e7),
    ),
    (
        "zero_optimization.stage3_max_live_parameters",
        Unset::Is(1e9),
    ),
    ("zero_optimization.sub_group_size", Unset::Is(1e9)),
    ("zero_optimization.zero_hpz_partition_size", Unset::Is(1.0)),
    (
        "zero_optimization.zero_quantized_weights",
        Unset::Flag(false),
    ),
    (
        "zero_optimization.zero_quantized_gradients",
        Unset::Flag(false),
    ),
    (
        "zero_optimization.offload_optimizer.pipeline_read",
        Unset::Flag(false),
    ),
    (
        "zero_optimization.offload_optimizer.pipeline_write",
        Unset::Flag(false),
    ),
    ("zero_optimization.offload_optimizer.ratio", Unset::Is(1.0)),
    (
        "activation_checkpointing.partition_activations",
        Unset::Flag(false),
    ),
    (
        "activation_checkpointing.contiguous_memory_optimization",
        Unset::Flag(false),
    ),
    (
        "activation_checkpointing.synchronize_checkpoint_boundary",
        Unset::Flag(false),
    ),
    ("aio", Unset::Any),
    ("sparse_attention", Unset::Any),
    ("compression_training", Unset::Any),
    ("data_efficiency", Unset::Any),
    ("sequence_parallel_size", Unset::Is(1.0)),
];

/// What an unpriced key holds when it changes nothing.
#[derive(Clone, Copy, Debug)]
enum Unset {
    /// DeepSpeed's default boolean.
    Flag(bool),
    /// DeepSpeed's default number.
    Is(f64),
    /// No value leaves the step unchanged (its default depends on the version or the stage).
    Any,
}

/// Whether a key's value leaves it to the tool: `null` or `"auto"`.
pub(crate) fn is_unset(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("auto")
}

impl Unset {
    /// Whether `v`, a value the file sets ([`Reader::set`]), may change the step.
    fn changes(self, v: &Value) -> bool {
        match (self, v) {
            (Unset::Flag(d), Value::Bool(b)) => *b != d,
            (Unset::Is(d), Value::Number(n)) => n.as_f64() != Some(d),
            _ => true,
        }
    }
}

impl DsConfig {
    /// Reads a `ds_config.json`'s text; `origin` names the file in the one-line errors.
    pub fn parse(text: &str, origin: &str) -> Result<DsConfig, String> {
        let doc: Value = serde_json::from_str(text)
            .map_err(|e| format!("{origin}: {}", parallax_ir::plan::json_message(&e)))?;
        DsConfig::from_value(&doc).map_err(|e| format!("{origin}: {e}"))
    }

    /// Reads a parsed ds_config (a case file's `plan.ds_config`); errors name the key.
    pub fn from_value(doc: &Value) -> Result<DsConfig, String> {
        if !doc.is_object() {
            return Err("a ds_config is a JSON object".into());
        }
        let r = Reader { doc };
        let mut c = DsConfig {
            train_batch: r.count("train_batch_size")?,
            overlap_comm: r.flag("zero_optimization.overlap_comm")?,
            reduce_bucket: r.count("zero_optimization.reduce_bucket_size")?,
            persistence_threshold: r
                .count("zero_optimization.stage3_param_persistence_threshold")?,
            max_reuse_distance: r.count("zero_optimization.stage3_max_reuse_distance")?,
            cpu_checkpointing: r.flag("activation_checkpointing.cpu_checkpointing")?,
            contiguous_gradients: r.flag("zero_optimization.contiguous_gradients")?,
            reduce_scatter: r.flag("zero_optimization.reduce_scatter")?,
            document: doc.clone(),
            ..DsConfig::default()
        };
        // Read for the data parallelism it fixes (below).
        let grad_accum = r.count("gradient_accumulation_steps")?;
        if grad_accum == Some(0) {
            return Err(r.bad("gradient_accumulation_steps", "must be at least 1"));
        }
        if c.train_batch == Some(0) {
            return Err(r.bad("train_batch_size", "must be at least 1"));
        }
        c.precision = r.precision()?;
        c.reduce_fp32 = match r.text("communication_data_type")? {
            None => None,
            Some("fp32") => Some(true),
            Some("fp16" | "bf16") => Some(false),
            Some(other) => {
                return Err(r.bad(
                    "communication_data_type",
                    &format!("`{other}` is none of fp32, fp16, bf16"),
                ))
            }
        };
        c.fixes = PartialLayout {
            zero_stage: match r.count("zero_optimization.stage")? {
                Some(z @ 0..=3) => Some(z as u8),
                Some(z) => return Err(r.bad("zero_optimization.stage", &format!("{z} is not 0–3"))),
                None => None,
            },
            micro_batch: match r.count("train_micro_batch_size_per_gpu")? {
                Some(0) => {
                    return Err(r.bad("train_micro_batch_size_per_gpu", "must be at least 1"))
                }
                mb => mb,
            },
            offload: r.offload()?,
            tp: match r.count("tensor_parallel.autotp_size")? {
                Some(0) => return Err(r.bad("tensor_parallel.autotp_size", "must be at least 1")),
                Some(tp) => Some(
                    u32::try_from(tp)
                        .map_err(|_| r.bad("tensor_parallel.autotp_size", "beyond any cluster"))?,
                ),
                None => None,
            },
            recompute: match r.count("pipeline.activation_checkpoint_interval")? {
                Some(0) => Some(Recompute::None),
                // PipelineModule checkpoints the input of every `interval` layers and
                // recomputes them together in backward: full recomputation, coarser.
                Some(_) => Some(Recompute::Full),
                None => None,
            },
            ..PartialLayout::default()
        };
        // The data-parallel degree the batch arithmetic fixes:
        // train_batch_size = micro-batch × accumulation × data-parallel ranks.
        if let (Some(b), Some(mb), Some(gas)) = (c.train_batch, c.fixes.micro_batch, grad_accum) {
            let per_rank = mb.saturating_mul(gas);
            if b % per_rank != 0 {
                return Err(format!(
                    "train_batch_size {b} is not train_micro_batch_size_per_gpu {mb} × gradient_accumulation_steps {gas} × a whole number of data-parallel ranks"
                ));
            }
            c.fixes.dp = Some(
                u32::try_from(b / per_rank)
                    .map_err(|_| r.bad("train_batch_size", "beyond any cluster"))?,
            );
        }
        for (key, unset) in UNPRICED {
            if r.set(key).is_some_and(|v| unset.changes(v)) {
                c.unpriced.push((*key).to_string());
            }
        }
        if c.overlap_comm == Some(false) && c.fixes.zero_stage == Some(3) {
            // Stage 3 overlaps as its engine does (its default); turned off, not priced.
            c.unpriced
                .push("zero_optimization.overlap_comm (stage 3)".into());
        }
        Ok(c)
    }

    /// `base`'s ZeRO sizes with the file's.
    pub fn zero_config(&self, base: ZeroConfig) -> ZeroConfig {
        ZeroConfig {
            reduce_bucket: self.reduce_bucket.unwrap_or(base.reduce_bucket),
            persistence_threshold: self
                .persistence_threshold
                .unwrap_or(base.persistence_threshold),
            max_reuse_distance: self.max_reuse_distance.unwrap_or(base.max_reuse_distance),
            contiguous_gradients: self.contiguous_gradients.or(base.contiguous_gradients),
            reduce_scatter: self.reduce_scatter.or(base.reduce_scatter),
        }
    }
}

/// A parsed document, for reading keys with one-line errors naming them.
struct Reader<'a> {
    doc: &'a Value,
}

impl Reader<'_> {
    fn get(&self, path: &str) -> Option<&Value> {
        path.split('.').try_fold(self.doc, |v, k| v.get(k))
    }

    /// The value at `path` where the file sets one: absent, `null` and `"auto"` (the
    /// HuggingFace integration's placeholder) leave the key to the tool.
    fn set(&self, path: &str) -> Option<&Value> {
        self.get(path).filter(|v| !is_unset(v))
    }

    fn bad(&self, path: &str, why: &str) -> String {
        format!("{path}: {why}")
    }

    /// A whole number at `path` (an integer, or a float with no fraction such as `5e8`).
    fn count(&self, path: &str) -> Result<Option<u64>, String> {
        match self.set(path) {
            None => Ok(None),
            Some(Value::Number(n)) => match (n.as_u64(), n.as_f64()) {
                (Some(u), _) => Ok(Some(u)),
                (None, Some(f)) if f >= 0.0 && f.fract() == 0.0 && f < 9.0e15 => Ok(Some(f as u64)),
                _ => Err(self.bad(path, &format!("{n} is not a whole number of at least 0"))),
            },
            Some(v) => Err(self.bad(path, &format!("expected a number or \"auto\", got {v}"))),
        }
    }

    /// A boolean at `path`.
    fn flag(&self, path: &str) -> Result<Option<bool>, String> {
        match self.set(path) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.bad(path, &format!("expected true, false or \"auto\", got {v}"))),
        }
    }

    /// A string at `path`.
    fn text(&self, path: &str) -> Result<Option<&str>, String> {
        match self.set(path) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.bad(path, &format!("expected a string, got {v}"))),
        }
    }

    /// The training precision the file enables (`bfloat16` is bf16's older key, `amp` apex's
    /// fp16); both 16-bit types at once is refused, as DeepSpeed refuses it.
    fn precision(&self) -> Result<Option<Precision>, String> {
        let on = |key: &str| self.flag(&format!("{key}.enabled"));
        let fp16 = on("fp16")?.unwrap_or(false) || on("amp")?.unwrap_or(false);
        let bf16 = on("bf16")?.unwrap_or(false) || on("bfloat16")?.unwrap_or(false);
        let any = ["fp16", "bf16", "bfloat16", "amp"]
            .iter()
            .any(|k| self.get(&format!("{k}.enabled")).is_some());
        match (fp16, bf16) {
            (true, true) => Err(
                "fp16.enabled and bf16.enabled: DeepSpeed trains in one 16-bit type, not both"
                    .into(),
            ),
            (true, false) => Ok(Some(Precision::Fp16)),
            (false, true) => Ok(Some(Precision::Bf16)),
            // Neither enabled where the file says so: DeepSpeed trains in fp32.
            (false, false) if any => Ok(Some(Precision::Fp32)),
            (false, false) => Ok(None),
        }
    }

    /// Where ZeRO keeps the optimizer states and the parameters: `offload_optimizer.device`
    /// and `offload_param.device` (`none`, `cpu`, `nvme`), or 0.3–0.4's `cpu_offload` and
    /// `cpu_offload_params` flags.
    fn offload(&self) -> Result<Option<Offload>, String> {
        let device = |key: &str| -> Result<Option<&str>, String> {
            let path = format!("zero_optimization.{key}.device");
            match self.text(&path)? {
                None | Some("none") => Ok(None),
                Some(d @ ("cpu" | "nvme")) => Ok(Some(d)),
                Some(other) => {
                    Err(self.bad(&path, &format!("`{other}` is none of none, cpu, nvme")))
                }
            }
        };
        let legacy = |key: &str| self.flag(&format!("zero_optimization.{key}"));
        let optimizer = match device("offload_optimizer")? {
            Some(d) => Some(d),
            None if legacy("cpu_offload")? == Some(true) => Some("cpu"),
            None => None,
        };
        let params = match device("offload_param")? {
            Some(d) => Some(d),
            None if legacy("cpu_offload_params")? == Some(true) => Some("cpu"),
            None => None,
        };
        let any = [
            "offload_optimizer",
            "offload_param",
            "cpu_offload",
            "cpu_offload_params",
        ]
        .iter()
        .any(|k| self.get(&format!("zero_optimization.{k}")).is_some());
        Ok(match (optimizer, params) {
            (None, None) if any => Some(Offload::None),
            (None, None) => None,
            (Some("cpu"), None) => Some(Offload::Optimizer),
            (Some("nvme"), None) => Some(Offload::OptimizerNvme),
            (Some("cpu"), Some("cpu")) => Some(Offload::Params),
            (Some("nvme"), Some("nvme")) => Some(Offload::ParamsNvme),
            (o, Some(p)) => {
                return Err(self.bad(
                    "zero_optimization.offload_param.device",
                    &format!(
                        "parameters on {p} with the optimizer on {}: parallax prices parameters offloaded with the optimizer on the same device",
                        o.unwrap_or("the GPU")
                    ),
                ))
            }
            (Some(_), None) => unreachable!("devices are cpu or nvme"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<DsConfig, String> {
        DsConfig::parse(text, "ds.json")
    }

    /// A ZeRO-3 config as DeepSpeed's Azure recipes write it: every key it prices read, the
    /// batch arithmetic fixing data parallelism, unpriced keys listed.
    #[test]
    fn reads_what_a_deepspeed_run_sets() {
        let c = parse(
            r#"{
              "train_batch_size": 2048,
              "train_micro_batch_size_per_gpu": 8,
              "gradient_accumulation_steps": 2,
              "bf16": {"enabled": true},
              "communication_data_type": "fp32",
              "zero_optimization": {
                "stage": 3,
                "overlap_comm": false,
                "reduce_bucket_size": 5e7,
                "stage3_max_reuse_distance": 3e9,
                "stage3_param_persistence_threshold": 1e5,
                "stage3_prefetch_bucket_size": 1e7,
                "offload_optimizer": {"device": "cpu", "pin_memory": true},
                "offload_param": {"device": "cpu"}
              },
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "steps_per_print": 10
            }"#,
        )
        .unwrap();
        assert_eq!(c.train_batch, Some(2048));
        assert_eq!(c.precision, Some(Precision::Bf16));
        assert_eq!(c.reduce_fp32, Some(true));
        assert_eq!(c.fixes.zero_stage, Some(3));
        assert_eq!(c.fixes.micro_batch, Some(8));
        assert_eq!(c.fixes.dp, Some(128));
        assert_eq!(c.fixes.offload, Some(Offload::Params));
        let z = c.zero_config(ZeroConfig::default());
        assert_eq!(
            (
                z.reduce_bucket,
                z.max_reuse_distance,
                z.persistence_threshold
            ),
            (50_000_000, 3_000_000_000, 100_000)
        );
        assert_eq!(
            c.unpriced,
            [
                "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.overlap_comm (stage 3)"
            ]
        );
    }

    /// The HuggingFace integration's `"auto"` leaves a key to the tool; an empty file sets
    /// nothing; neither 16-bit type enabled is fp32; 0.3's offload flag is optimizer offload.
    #[test]
    fn auto_and_absent_keys_leave_the_knob_open() {
        let c = parse(
            r#"{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
                "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "cpu_offload": true}}"#,
        )
        .unwrap();
        assert_eq!(c.fixes.micro_batch, None);
        assert_eq!(c.fixes.dp, None);
        assert_eq!(c.precision, Some(Precision::Fp32));
        assert_eq!(c.fixes.offload, Some(Offload::Optimizer));
        assert_eq!(
            parse("{}").unwrap(),
            DsConfig {
                document: serde_json::json!({}),
                ..DsConfig::default()
            }
        );
    }

    /// Bad values are one line naming the file and the key.
    #[test]
    fn bad_values_name_the_file_and_the_key() {
        for (text, want) in [
            ("[1, 2]", "ds.json: a ds_config is a JSON object"),
            (r#"{"zero_optimization": {"stage": 4}}"#, "ds.json: zero_optimization.stage: 4 is not 0–3"),
            (r#"{"zero_optimization": {"stage": "two"}}"#, "ds.json: zero_optimization.stage: expected a number"),
            (r#"{"zero_optimization": {"reduce_bucket_size": -5}}"#, "ds.json: zero_optimization.reduce_bucket_size: -5 is not a whole number"),
            (r#"{"zero_optimization": {"reduce_bucket_size": 2.5}}"#, "ds.json: zero_optimization.reduce_bucket_size: 2.5 is not a whole number"),
            (r#"{"zero_optimization": {"overlap_comm": 1}}"#, "ds.json: zero_optimization.overlap_comm: expected true"),
            (r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}}"#, "ds.json: fp16.enabled and bf16.enabled"),
            (r#"{"communication_data_type": "fp8"}"#, "ds.json: communication_data_type: `fp8` is none of"),
            (r#"{"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}"#, "ds.json: zero_optimization.offload_optimizer.device: `gpu` is none of"),
            (r#"{"zero_optimization": {"offload_param": {"device": "cpu"}}}"#, "ds.json: zero_optimization.offload_param.device: parameters on cpu with the optimizer on the GPU"),
            (r#"{"train_micro_batch_size_per_gpu": 0}"#, "ds.json: train_micro_batch_size_per_gpu: must be at least 1"),
            (r#"{"train_batch_size": 100, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}"#, "ds.json: train_batch_size 100 is not"),
            ("{\"zero_optimization\": ", "ds.json: "),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.starts_with(want), "{text}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
