//! The training job `plan` and `simulate` predict: model, cluster, batch, sequence, precision.

use crate::general::GraphModel;
use crate::user;
use clap::Args as ClapArgs;
use parallax_cost::transformer::Setup;
use parallax_hardware::Cluster;
use parallax_ir::models::{MoeConfig, TransformerConfig};
use parallax_ir::PartialLayout;
use parallax_ir::{load_model, Fp8Recipe, Precision, MAX_GLOBAL_BATCH};
use parallax_planner::ds_config::DsConfig;
use parallax_planner::Framework;

/// The flags that name a training job.
#[derive(Debug, ClapArgs)]
pub struct JobArgs {
    /// Zoo name, HuggingFace config.json, ONNX file or parallax graph JSON.
    #[arg(long)]
    pub model: String,
    /// `PRESET:gpus=N` (e.g. dgx-a100-80gb:gpus=1024) or a profile TOML path.
    #[arg(long)]
    pub cluster: String,
    /// Sequences per optimizer step (default with --ds-config: its train_batch_size).
    #[arg(long, required_unless_present = "ds_config")]
    pub global_batch: Option<u64>,
    /// Sequence length (default: the model's maximum).
    #[arg(long)]
    pub seq: Option<u64>,
    /// Training precision: fp32, tf32, fp16, bf16 or fp8. Default: bf16 where the cluster's
    /// GPUs have it, else fp16, else fp32 (the precision `parallax clusters` lists).
    #[arg(long)]
    pub precision: Option<Precision>,
    /// How convolutional graphs store activations: channels-last (what tuned mixed-precision
    /// stacks use) or nchw (PyTorch's default: cuDNN transposes around tensor-core convolutions).
    #[arg(long, value_enum, default_value_t = MemoryFormat::ChannelsLast)]
    pub memory_format: MemoryFormat,
    /// The software stack that runs the job, `NAME@VERSION` (e.g. megatron-lm@2022,
    /// deepspeed-zero3@2021, torchtitan; `parallax frameworks` lists them): its kernels,
    /// overlap and options. Default: a current stack. Transformer models only.
    #[arg(long, value_name = "NAME@VERSION")]
    pub framework: Option<String>,
    /// fp8 only: how the stack scales its casts, delayed, tensorwise, rowwise or blockwise
    /// (Megatron's `--fp8-recipe`, torchao's recipe names). Default: the stack's own.
    #[arg(long, value_name = "RECIPE")]
    pub fp8_recipe: Option<String>,
    /// Micro-pipeline the tensor-parallel collectives with their matmuls (PyTorch's
    /// asynchronous TP: torchtitan's `enable_async_tensor_parallel`).
    #[arg(long)]
    pub async_tp: bool,
    /// Run the model's module code under `torch.compile` (torchtitan's `--training.compile`)
    /// on a stack whose code is otherwise eager (torchtitan, FSDP, the HuggingFace Trainer).
    /// fp8 and asynchronous-TP runs there are compiled without it.
    #[arg(long)]
    pub compile: bool,
    /// Mixture-of-experts models: drop the routed token copies beyond this factor times each
    /// expert's even share (Megatron-Core's `--moe-expert-capacity-factor`, DeepSpeed-MoE's
    /// `capacity_factor`). Default: dropless, as the model loads.
    #[arg(long, value_name = "X")]
    pub capacity_factor: Option<String>,
    /// With a capacity: pad every expert's input to it, so each computes exactly its capacity
    /// (Megatron-Core's `--moe-pad-expert-input-to-capacity`).
    #[arg(long)]
    pub pad_to_capacity: bool,
    /// A DeepSpeed run's `ds_config.json`: its batch, precision, ZeRO stage, micro-batch,
    /// offload and AutoTP fix those of the job and the layout, and its overlap_comm,
    /// communication_data_type, reduce_bucket_size and stage3 thresholds the stack's (a
    /// DeepSpeed stack: `deepspeed` unless --framework names another). Keys it sets that
    /// parallax does not price are listed in a note.
    #[arg(long, value_name = "FILE")]
    pub ds_config: Option<std::path::PathBuf>,
}

/// How activations are laid out in memory (`--memory-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MemoryFormat {
    ChannelsLast,
    Nchw,
}

/// A job with its transformer and cluster loaded.
pub struct Job {
    /// The model's display name.
    pub name: String,
    pub model: TransformerConfig,
    pub cluster: Cluster,
    pub seq: u64,
    pub global_batch: u64,
    pub precision: Precision,
    /// The stack that runs it (`--framework`, else a current one), with the options chosen.
    pub framework: Framework,
    /// The fp8 recipe `--fp8-recipe` chose (already in `framework`; kept for a stack that
    /// replaces it, as `--export` does).
    pub fp8_recipe: Option<Fp8Recipe>,
    /// The run's `ds_config.json` (`--ds-config`) and its name as given: already in
    /// `framework`; its layout knobs are fixed by [`Job::fixes`].
    pub ds_config: Option<Box<(DsConfig, String)>>,
}

/// A loaded job: a transformer for the structured path, or any other graph for the per-op path.
pub enum Loaded {
    Transformer(Box<Job>),
    Graph(Box<GraphModel>),
}

/// A batch flag (`--global-batch`, `--batch`) within what is modelled: at least 1, at most
/// [`MAX_GLOBAL_BATCH`].
pub fn check_batch(flag: &str, batch: u64) -> anyhow::Result<()> {
    if batch == 0 {
        return Err(user(format!("{flag}: must be at least 1")));
    }
    if batch > MAX_GLOBAL_BATCH {
        return Err(user(format!(
            "{flag} {batch}: beyond the {MAX_GLOBAL_BATCH} samples parallax models"
        )));
    }
    Ok(())
}

impl JobArgs {
    /// Loads the model and the cluster once; bad input is one line naming the flag.
    pub fn load(&self) -> anyhow::Result<Loaded> {
        let ds_config = self.read_ds_config()?;
        let global_batch = self.global_batch(ds_config.as_ref())?;
        let loaded = load_model(&self.model).map_err(user)?;
        let seq = self.seq.unwrap_or(loaded.default_seq());
        loaded.check_seq(seq).map_err(user)?;
        let cluster = Cluster::parse(&self.cluster).map_err(user)?;
        let framework = match (&self.framework, &ds_config) {
            (Some(spec), _) => {
                Framework::parse(spec).map_err(|e| user(format!("--framework: {e}")))?
            }
            (None, Some(_)) => Framework::for_engine(parallax_planner::export::Engine::DeepSpeed),
            (None, None) => Framework::current(),
        };
        // Read here rather than by clap, whose refusal would echo the whole value.
        let fp8_recipe = self
            .fp8_recipe
            .as_deref()
            .map(str::parse::<Fp8Recipe>)
            .transpose()
            .map_err(|e| user(format!("--fp8-recipe: {e}")))?;
        let precision = self
            .precision(ds_config.as_ref())?
            .unwrap_or_else(|| cluster.profile.device.default_precision());
        if fp8_recipe.is_some() && precision != Precision::Fp8 {
            return Err(user(format!(
                "--fp8-recipe: the job trains in {precision} (add --precision fp8)"
            )));
        }
        Ok(match loaded.transformer().cloned() {
            Some(mut model) => {
                let framework = self.with_options(framework, fp8_recipe)?;
                let framework = with_ds_config(framework, ds_config.as_ref())?;
                self.apply_capacity(&mut model)?;
                Loaded::Transformer(Box::new(Job {
                    name: loaded.name,
                    model,
                    cluster,
                    seq,
                    global_batch,
                    precision,
                    framework,
                    fp8_recipe,
                    ds_config: ds_config.map(Box::new),
                }))
            }
            None if self.framework.is_some()
                || self.ds_config.is_some()
                || self.fp8_recipe.is_some()
                || self.async_tp
                || self.compile
                || self.capacity_flag().is_some() =>
            {
                let flag = if self.framework.is_some() {
                    "--framework"
                } else if self.ds_config.is_some() {
                    "--ds-config"
                } else if self.async_tp {
                    "--async-tp"
                } else if self.compile {
                    "--compile"
                } else {
                    self.capacity_flag().unwrap_or("--fp8-recipe")
                };
                return Err(user(format!(
                    "{flag}: {} is not a transformer; its per-op plans are costed op by op, not by a stack's transformer kernels",
                    self.model
                )));
            }
            None => Loaded::Graph(Box::new(GraphModel::new(
                loaded,
                cluster,
                seq,
                global_batch,
                precision,
                self.memory_format == MemoryFormat::Nchw,
            )?)),
        })
    }

    /// The `--ds-config` file read, with its name as given.
    fn read_ds_config(&self) -> anyhow::Result<Option<(DsConfig, String)>> {
        let Some(path) = &self.ds_config else {
            return Ok(None);
        };
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| user(format!("--ds-config {shown}: cannot read: {e}")))?;
        let c = DsConfig::parse(&text, &shown).map_err(user)?;
        Ok(Some((c, shown)))
    }

    /// The job's global batch: `--global-batch`, or the ds_config's `train_batch_size`, which
    /// must agree where both are given.
    fn global_batch(&self, ds: Option<&(DsConfig, String)>) -> anyhow::Result<u64> {
        let batch = match (self.global_batch, ds) {
            (Some(g), Some((c, name))) if c.train_batch.is_some_and(|d| d != g) => {
                return Err(user(format!(
                    "--global-batch {g}: --ds-config {name}: train_batch_size is {}",
                    c.train_batch.unwrap_or_default()
                )))
            }
            (Some(g), _) => g,
            (None, Some((c, name))) => c.train_batch.ok_or_else(|| {
                user(format!(
                    "--global-batch: needed (--ds-config {name} gives no train_batch_size)"
                ))
            })?,
            // clap requires one of the two.
            (None, None) => return Err(user("--global-batch: needed")),
        };
        check_batch("--global-batch", batch)?;
        Ok(batch)
    }

    /// The precision `--precision` or the ds_config names (`None`: the cluster's default); a
    /// file enabling bf16 trains fp8 too (Transformer Engine's fp8 inside bf16 training), any
    /// other disagreement is refused.
    fn precision(&self, ds: Option<&(DsConfig, String)>) -> anyhow::Result<Option<Precision>> {
        let (file, name) = match ds {
            Some((c, name)) => (c.precision, name.as_str()),
            None => (None, ""),
        };
        Ok(match (self.precision, file) {
            (Some(Precision::Fp8), Some(Precision::Bf16)) => Some(Precision::Fp8),
            (Some(p), Some(d)) if p != d => {
                return Err(user(format!(
                    "--precision {p}: --ds-config {name} trains in {d} (its fp16 / bf16 sections)"
                )))
            }
            (p, d) => p.or(d),
        })
    }

    /// The token-dropping flag given, if any.
    fn capacity_flag(&self) -> Option<&'static str> {
        if self.capacity_factor.is_some() {
            Some("--capacity-factor")
        } else if self.pad_to_capacity {
            Some("--pad-to-capacity")
        } else {
            None
        }
    }

    /// Sets the mixture's token dropping from `--capacity-factor` and `--pad-to-capacity`;
    /// a dense model, a value that is not a number of at least 0.001, or one past where an expert
    /// would take every copy is one line naming the flag.
    fn apply_capacity(&self, m: &mut TransformerConfig) -> anyhow::Result<()> {
        let Some(flag) = self.capacity_flag() else {
            return Ok(());
        };
        let Some(moe) = m.moe.as_mut() else {
            return Err(user(format!(
                "{flag}: {} has no mixture of experts to drop tokens from",
                self.model
            )));
        };
        if let Some(text) = &self.capacity_factor {
            let shown: String = text.trim().chars().take(40).collect();
            moe.capacity_permille = text
                .trim()
                .parse::<f64>()
                .ok()
                .and_then(MoeConfig::capacity_permille_of)
                .ok_or_else(|| {
                    user(format!(
                        "--capacity-factor: expected a number of at least 0.001 (1.0: an even share), found '{shown}'"
                    ))
                })?;
        }
        if self.pad_to_capacity {
            moe.pad_to_capacity = true;
        }
        m.validate().map_err(|e| user(format!("{flag}: {e}")))
    }

    /// `fw` with the fp8 recipe (`--fp8-recipe`, read by [`JobArgs::load`]), `--async-tp`
    /// and `--compile` chosen, where it offers them.
    pub fn with_options(
        &self,
        fw: Framework,
        fp8_recipe: Option<Fp8Recipe>,
    ) -> anyhow::Result<Framework> {
        fw.with_options(fp8_recipe, self.async_tp)
            .and_then(|fw| fw.with_compile(self.compile))
            .map_err(|e| user(e.to_string()))
    }
}

/// `fw` as the run's ds_config sets it up, where `--ds-config` names one.
pub fn with_ds_config(fw: Framework, ds: Option<&(DsConfig, String)>) -> anyhow::Result<Framework> {
    match ds {
        Some((c, name)) => fw
            .with_ds_config(c, name)
            .map_err(|e| user(format!("--ds-config {name}: {e}"))),
        None => Ok(fw),
    }
}

impl Job {
    /// `given` (`--plan` or `--fix`, named by `flag`) with the layout knobs the ds_config
    /// fixes; a knob both set differently is refused.
    pub fn fixes(&self, flag: &str, given: PartialLayout) -> anyhow::Result<PartialLayout> {
        self.merge_fixes(flag, given, true)
    }

    /// [`Job::fixes`] at another GPU count (`plan --max-gpus`): DeepSpeed keeps the file's batch
    /// and micro-batch and changes the accumulation, so the data parallelism its
    /// `gradient_accumulation_steps` fixed at this count is free there.
    pub fn fixes_at_any_count(
        &self,
        flag: &str,
        given: PartialLayout,
    ) -> anyhow::Result<PartialLayout> {
        self.merge_fixes(flag, given, false)
    }

    fn merge_fixes(
        &self,
        flag: &str,
        given: PartialLayout,
        with_dp: bool,
    ) -> anyhow::Result<PartialLayout> {
        let Some((c, name)) = self.ds_config.as_deref() else {
            return Ok(given);
        };
        let f = &c.fixes;
        let mut out = given;
        fn merge<T: PartialEq + Copy + std::fmt::Display>(
            slot: &mut Option<T>,
            from_file: Option<T>,
            what: &str,
            conflict: &dyn Fn(String) -> anyhow::Error,
        ) -> anyhow::Result<()> {
            match (*slot, from_file) {
                (Some(a), Some(b)) if a != b => Err(conflict(format!("{what} {b} (given {a})"))),
                (_, Some(b)) => {
                    *slot = Some(b);
                    Ok(())
                }
                _ => Ok(()),
            }
        }
        let conflict = |what: String| user(format!("{flag}: --ds-config {name} sets {what}"));
        merge(
            &mut out.zero_stage,
            f.zero_stage,
            "zero_optimization.stage",
            &conflict,
        )?;
        merge(
            &mut out.micro_batch,
            f.micro_batch,
            "train_micro_batch_size_per_gpu",
            &conflict,
        )?;
        if with_dp {
            merge(
                &mut out.dp,
                f.dp,
                "data parallelism (train_batch_size / micro-batch / accumulation)",
                &conflict,
            )?;
        }
        merge(&mut out.offload, f.offload, "offload", &conflict)?;
        merge(&mut out.tp, f.tp, "tensor_parallel.autotp_size", &conflict)?;
        merge(
            &mut out.recompute,
            f.recompute,
            "pipeline.activation_checkpoint_interval",
            &conflict,
        )?;
        Ok(out)
    }

    /// Says which keys of the ds_config parallax does not price (once the job is settled:
    /// after a refusal only the error line is printed).
    pub fn note_unpriced(&self) {
        if let Some((c, name)) = self.ds_config.as_deref() {
            if !c.unpriced.is_empty() {
                eprintln!(
                    "note: --ds-config {name}: not priced: {}",
                    c.unpriced.join(", ")
                );
            }
        }
    }

    /// The costing setup of this job on its stack.
    pub fn setup(&self) -> Setup<'_> {
        Setup {
            precision: self.precision,
            runtime: self.framework.runtime,
            ..Setup::new(
                &self.model,
                &self.cluster.profile,
                self.cluster.gpus,
                self.seq,
                self.global_batch,
            )
        }
    }
}
