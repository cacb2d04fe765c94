//! Published runs of any model (`parallax-validation-cases/2`, `shared/ground-truth/general.json`
//! and its `fields` block): CNNs, RNNs and pipelines predicted on the per-op (SOAP) path with the
//! published layout, transformers (BERT) on the structured path; each with the software stack
//! that ran it.

use crate::search::Space;
use crate::soap::{layout_plan, segment_stages, staged_layout_plan};
use crate::validate::{complete_predicted, Framework, Measured, Predicted};
use parallax_cost::soap::{GradSync, OpCosts, Optimizer};
use parallax_cost::transformer::{Runtime, Setup};
use parallax_hardware::ClusterProfile;
use parallax_ir::graph::TensorRole;
use parallax_ir::{load_model, BatchNormStats, Model, PartialLayout, Precision, Schedule};
use parallax_sim::perop::{simulate_op_plan, OpPlan};
use serde::Deserialize;

/// Schema tag of case files of any model.
pub const GENERAL_CASES_SCHEMA: &str = "parallax-validation-cases/2";

/// One published run of any model.
#[derive(Clone, Debug, Deserialize)]
pub struct GeneralCase {
    pub id: String,
    #[serde(default)]
    pub source: String,
    /// Normalised framework id, then the published text in parentheses.
    pub framework: String,
    pub model: GeneralModel,
    pub cluster: crate::validate::CaseCluster,
    /// `fp32`, `tf32`, `amp-fp16`, `fp16` or `bf16`.
    pub precision: String,
    pub plan: GeneralPlan,
    pub measured: Measured,
    #[serde(default)]
    pub group: String,
}

/// The model of a case: a zoo name and its input size.
#[derive(Clone, Debug, Deserialize)]
pub struct GeneralModel {
    pub name: String,
    #[serde(default)]
    pub input: ModelInput,
    #[serde(default)]
    pub details: ModelDetails,
}

/// Architecture and training facts as published (only those the prediction reads).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ModelDetails {
    /// BERT pretraining phase (`phase 1` at 128 tokens, `phase 2` at 512).
    pub phase: Option<String>,
}

/// Input size as published.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ModelInput {
    pub image_size: Option<u64>,
    pub seq_len: Option<u64>,
    /// Mean source plus target tokens of a sentence pair of a bucketed translation dataset.
    pub mean_tokens_per_sentence_pair_derived: Option<f64>,
}

/// The published layout.
#[derive(Clone, Debug, Deserialize)]
pub struct GeneralPlan {
    pub dp: u32,
    pub tp: u32,
    pub pp: u32,
    /// Samples per replica per forward pass (per pipeline micro-batch for GPipe).
    pub micro_batch: u64,
    pub grad_accumulation: u32,
    pub global_batch: u64,
    pub pipeline: Option<GPipeSetup>,
    pub gradient_sync: Option<String>,
}

/// A published GPipe setup (torchgpipe).
#[derive(Clone, Debug, Deserialize)]
pub struct GPipeSetup {
    pub chunks: u32,
    pub checkpoint: Checkpoint,
    /// Layers of the source's `nn.Sequential` per partition (found by torchgpipe's profiling
    /// balancer). The run's stages where the zoo's graph has the source's layers as its
    /// segments (AmoebaNet-D: stem, 22 cells, classifier); elsewhere (ResNet-101's 370
    /// flattened modules, U-Net's 241) the cost model balances the stages by compute.
    #[serde(default)]
    pub balance: Option<Vec<u32>>,
}

/// Which micro-batches recompute their forward in backward (torchgpipe's `checkpoint`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Checkpoint {
    Always,
    /// torchgpipe's default: every micro-batch but the last.
    ExceptLast,
    Never,
}

/// Padding in BERT's English Wikipedia pretraining samples at 512 tokens: more than half of
/// all tokens (Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination",
/// abstract and Fig. 1: a skewed length histogram from short documents and BERT's random
/// short targets). Taken at one half.
const WIKIPEDIA_PADDING_AT_512: f64 = 0.5;

/// Width of the length bins of DeepLearningExamples BERT's phase-2 loader (README changelog,
/// January 2022: "binned pretraining for phase2 with LDDL using a bin size of 64"; 8 bins up to
/// 512 tokens in `run_pretraining.py`). A batch draws from one bin and is padded to its longest
/// sample, about half a bin above the mean.
const LDDL_PHASE2_BIN: u64 = 64;

/// Length buckets of NVIDIA's MLPerf GNMT loader (`rnn_translator`, `--num-buckets` 5): its
/// `BucketingSampler` bins each sentence pair by the longer side into `num_buckets` bins of
/// `(max_len + num_buckets − 1) / num_buckets` tokens, every batch draws from one bin and is
/// padded to its longest sentence — about half a bin above the mean, as the LDDL bins above.
const GNMT_BUCKETS: u64 = 5;

/// The zoo model a case names, for the framework that ran it.
fn zoo_name<'a>(name: &'a str, framework: &str) -> &'a str {
    match name {
        // TensorFlow's benchmarks run their own AlexNet (wider fourth conv, 227 input).
        "alexnet" if framework.starts_with("tensorflow") => "alexnet-tf",
        // ResNet-50 v1.5 moves the stride of the downsampling bottleneck to its 3×3
        // convolution (torchvision's ResNet-50 is v1.5 already).
        "resnet50-v1.5" => "resnet50",
        n => n,
    }
}

/// The precision a case names: parallax's names, and `amp-fp16` for fp16 mixed precision
/// cast per op (`fp16` casts the model; both keep fp32 master weights).
fn precision(p: &str) -> Result<Precision, String> {
    match p {
        "amp-fp16" => Ok(Precision::Fp16),
        other => other.parse(),
    }
}

impl GeneralCase {
    /// The normalised framework id (`tensorflow-1.x/tf_cnn_benchmarks`, `pytorch-ddp`, ...).
    pub fn framework_id(&self) -> &str {
        self.framework.split_whitespace().next().unwrap_or("")
    }

    /// Whether the run's attention was a fused kernel: a transformer on a stack with one.
    pub fn fused_attention(&self) -> bool {
        load_model(zoo_name(&self.model.name, self.framework_id()))
            .is_ok_and(|m| m.transformer().is_some())
            && self.framework().runtime.fused_attention
    }

    /// The run's stack (from its `framework` field), with what its training script did on
    /// top: DeepLearningExamples' BERT pretraining script (`run_pretraining.py`) all-reduces
    /// once after its accumulation steps (`allreduce_post_accumulation`), not overlapped with
    /// backward, and runs its masked-LM head on the masked positions only
    /// (`dense_sequence_output`, on unless `--no_dense_sequence_output`).
    pub fn framework(&self) -> Framework {
        let mut fw = Framework::for_case(Some(&self.framework));
        if self.source.starts_with("dle-pytorch-bert") {
            fw.runtime = Runtime {
                overlap_grad_reduce: false,
                mlm_masked_only: true,
                ..fw.runtime
            };
        }
        fw
    }

    /// How gradients were combined: the published mechanism.
    pub fn grad_sync(&self) -> Result<GradSync, String> {
        Ok(match self.plan.gradient_sync.as_deref() {
            // `distributed_replicated` is replicated inside a node and parameter servers
            // sharded over the nodes across them: the bytes of a ring all-reduce (GradSync).
            None
            | Some("nccl-allreduce" | "replicated" | "ring-allreduce" | "distributed_replicated") => {
                GradSync::AllReduce
            }
            // tf_cnn_benchmarks' parameter_server runs published here kept the variables on
            // the CPU (local_parameter_device=cpu, the benchmarks page's configuration table).
            Some("parameter_server") => GradSync::HostParameterServer,
            Some(other) => return Err(format!("plan.gradient_sync '{other}' is not modelled")),
        })
    }

    /// Sequence length of sequence models as computed: the mean of a bucketed dataset where
    /// published, the mean padded length of a length-binned loader, else the published
    /// (maximum, padded) length.
    fn seq(&self, model: &Model) -> u64 {
        let i = &self.model.input;
        match (i.mean_tokens_per_sentence_pair_derived, i.seq_len) {
            // Source plus target tokens: one side is half, padded within its bucket.
            (Some(mean), max) => {
                let side = mean / 2.0;
                let padded = match max.filter(|_| self.source.starts_with("mlperf")) {
                    Some(max) => {
                        let width = max.div_ceil(GNMT_BUCKETS);
                        (side + width as f64 / 2.0).min(max as f64)
                    }
                    None => side,
                };
                (padded.round() as u64).max(1)
            }
            (None, Some(512)) if self.lddl_binned() => {
                let real = 512.0 * (1.0 - WIKIPEDIA_PADDING_AT_512);
                (real as u64 + LDDL_PHASE2_BIN / 2).min(512)
            }
            (None, Some(s)) => s,
            (None, None) => model.default_seq(),
        }
    }

    /// Whether the run kept its activations NCHW: the default of TensorFlow's benchmarks on
    /// GPUs (`data_format=NCHW`) and of PyTorch; DeepLearningExamples' ConvNets switch to
    /// channels-last for AMP only (`memory_format: nhwc` under `AMP` in its `configs.yml`,
    /// not under TF32 or FP32).
    fn nchw(&self, precision: Precision) -> bool {
        !(self.source.starts_with("dle-pytorch") && precision.is_mixed())
    }

    /// Whether the run loaded its samples through DeepLearningExamples BERT's binned phase-2
    /// loader.
    fn lddl_binned(&self) -> bool {
        self.source.starts_with("dle-pytorch-bert")
            && self.model.details.phase.as_deref() == Some("phase 2")
    }

    /// Predicts the case on a profile changed by `adjust` first, with the published layout.
    pub(crate) fn predict(
        &self,
        adjust: &(dyn Fn(&mut ClusterProfile) + Sync),
    ) -> Result<Predicted, String> {
        let p = &self.plan;
        let (mut r, scale) = self.with_inputs(adjust, |inputs| match inputs {
            GeneralInputs::Transformer(setup, partial, space) => {
                complete_predicted(setup, partial, space)
            }
            GeneralInputs::PerOp(costs, plan, ran) => {
                let sim = simulate_op_plan(costs, plan, ran).map_err(|e| e.to_string())?;
                let layout = format!(
                    "dp={} tp={} pp={} mb={} m={}{}{}",
                    p.dp,
                    p.tp,
                    p.pp,
                    p.micro_batch,
                    plan.micro_batches,
                    if plan.recompute { " recompute" } else { "" },
                    match costs.sync {
                        GradSync::AllReduce => "",
                        GradSync::HostParameterServer => " ps=host",
                    }
                );
                Ok(Predicted {
                    step_time_s: sim.prediction.step_time_s,
                    peak_memory_gib: sim.prediction.peak_memory_gib,
                    reserved_memory_gib: sim.prediction.reserved_memory_gib,
                    layout,
                })
            }
        })?;
        r.step_time_s *= scale;
        Ok(r)
    }

    /// Calls `f` with what the case is predicted from on a profile changed by `adjust`: a
    /// transformer's step, published knobs and stack space, or a per-op graph's costs, plan
    /// and samples of one step as run. Returns `f`'s answer and the factor from the step as
    /// run to the published global batch (where a source's global batch disagrees with its
    /// layout, the step is predicted as run and scaled: its step time is the published batch
    /// over the measured throughput). What `GeneralCase::predict` scores and `validate
    /// --explain` prints.
    pub fn with_inputs<R>(
        &self,
        adjust: &(dyn Fn(&mut ClusterProfile) + Sync),
        f: impl FnOnce(GeneralInputs<'_, '_>) -> Result<R, String>,
    ) -> Result<(R, f64), String> {
        let precision = precision(&self.precision)?;
        let model = load_model(zoo_name(&self.model.name, self.framework_id()))
            .map_err(|e| e.to_string())?;
        let cluster = self.cluster.build(adjust)?;
        let p = &self.plan;
        if p.dp.max(1) * p.tp.max(1) * p.pp.max(1) != cluster.gpus {
            return Err(format!(
                "plan: dp {} x tp {} x pp {} is not cluster.gpus {}",
                p.dp, p.tp, p.pp, cluster.gpus
            ));
        }
        let seq = self.seq(&model);
        let chunks = p
            .pipeline
            .as_ref()
            .map_or(p.grad_accumulation, |g| g.chunks)
            .max(1);
        let ran = p.micro_batch * u64::from(p.dp) * u64::from(chunks);
        let scale = p.global_batch as f64 / ran as f64;
        if let Some(cfg) = model.transformer() {
            let fw = self.framework();
            let setup = Setup {
                precision,
                runtime: fw.runtime,
                ..Setup::new(cfg, &cluster.profile, cluster.gpus, seq, ran)
            };
            let partial = PartialLayout {
                dp: Some(p.dp),
                tp: Some(p.tp),
                pp: Some(p.pp),
                cp: Some(1),
                ep: Some(1),
                zero_stage: Some(0),
                micro_batch: Some(p.micro_batch),
                sequence_parallel: Some(false),
                ..PartialLayout::default()
            };
            let space = Space {
                zero_stages: vec![0],
                ..fw.space
            };
            return Ok((
                f(GeneralInputs::Transformer(&setup, &partial, &space))?,
                scale,
            ));
        }
        // Per-op path: the graph of one micro-batch over all replicas.
        let graph = model
            .graph(p.micro_batch * u64::from(p.dp), seq, false)
            .map_err(|e| e.to_string())?;
        if let Some(size) = self.model.input.image_size {
            let side = graph
                .tensors
                .iter()
                .find(|t| t.role == TensorRole::Input && t.shape.rank() == 4)
                .and_then(|t| t.shape.dim(2));
            if side.is_some_and(|s| s != size) {
                return Err(format!(
                    "model.input.image_size {size}: the zoo's {} takes {}",
                    graph.name,
                    side.unwrap_or_default()
                ));
            }
        }
        let mut costs = OpCosts::new(&graph, &cluster.profile, cluster.gpus, precision)
            .map_err(|e| format!("precision: {e}"))?;
        costs.optimizer = Optimizer::default_for(&graph);
        costs.sync = self.grad_sync()?;
        costs.set_nchw(self.nchw(precision));
        let published = p
            .pipeline
            .as_ref()
            .and_then(|g| g.balance.as_deref())
            .filter(|b| b.len() == p.pp as usize)
            .and_then(|b| segment_stages(&graph, b));
        let mut plan = match published {
            Some(stage) => staged_layout_plan(&mut costs, p.dp, p.tp, p.pp, &stage),
            None => layout_plan(&mut costs, p.dp, p.tp, p.pp),
        };
        if let Some(g) = &p.pipeline {
            plan.schedule = Schedule::GPipe;
            plan.recompute = match g.checkpoint {
                Checkpoint::Always => true,
                Checkpoint::ExceptLast => g.chunks > 1,
                Checkpoint::Never => false,
            };
        }
        plan.micro_batches = chunks;
        // Every stack of these cases keeps BatchNorm's statistics per device (TensorFlow's
        // per-tower batch norm in tf_cnn_benchmarks, `nn.BatchNorm2d` under PyTorch DDP and in
        // torchgpipe's partitions); none synchronises them.
        plan.batch_norm = BatchNormStats::Local;
        Ok((f(GeneralInputs::PerOp(&mut costs, &plan, ran))?, scale))
    }
}

/// What a general case is predicted from ([`GeneralCase::with_inputs`]).
#[derive(Debug)]
pub enum GeneralInputs<'a, 'g> {
    /// A transformer's step, its published knobs and the stack's space.
    Transformer(&'a Setup<'g>, &'a PartialLayout, &'a Space),
    /// A graph's per-op costs, the published layout op by op, and the samples of one step as
    /// run.
    PerOp(&'a mut OpCosts<'g>, &'a OpPlan, u64),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_precisions_of_the_case_file() {
        assert_eq!(zoo_name("resnet50-v1.5", "pytorch-ddp"), "resnet50");
        assert_eq!(zoo_name("vgg16", "pytorch-ddp"), "vgg16");
        let tf = "tensorflow-1.x/tf_cnn_benchmarks";
        assert_eq!(zoo_name("alexnet", tf), "alexnet-tf");
        assert_eq!(zoo_name("alexnet", "pytorch-ddp"), "alexnet");
        assert_eq!(precision("amp-fp16"), Ok(Precision::Fp16));
        assert_eq!(precision("tf32"), Ok(Precision::Tf32));
        assert!(precision("int8").unwrap_err().contains("int8"));
    }

    fn general_json() -> Vec<crate::Case> {
        crate::validate::ground_truth("general.json")
    }

    /// Every published run is predicted (none skipped), each with the layout and gradient
    /// mechanism it ran: GPipe pipelines recompute, tf_cnn_benchmarks parameter servers sit on
    /// the host, BERT takes the structured path.
    #[test]
    fn every_published_run_is_predicted_as_it_ran() {
        let cases = general_json();
        assert_eq!(cases.len(), 167);
        let gpipe = cases
            .iter()
            .find(|c| c.id() == "torchgpipe-amoebanet-d-18-256-p40-4g-b1152-fp32-pp4m32")
            .unwrap();
        let r = gpipe.run();
        assert_eq!(r.status, "ok");
        assert!(r.layout.unwrap().contains("pp=4 mb=36 m=32 recompute"));
        let ps = cases
            .iter()
            .find(|c| c.id() == "tf-benchmarks-2017-resnet50-dgx1-p100-8g-b512-fp32")
            .unwrap()
            .run();
        assert!(ps.layout.unwrap().ends_with("ps=host"));
        // A source whose global batch disagrees with its layout is predicted as run and
        // scaled to the published batch.
        let odd = cases
            .iter()
            .find(|c| {
                c.id()
                    == "dle-pytorch-bert-bert-large-s128-a100-80gb-8g-b65536-tf32-multinode-table"
            })
            .unwrap()
            .run();
        assert_eq!(odd.status, "ok");
        assert!(odd.layout.unwrap().contains("mb=126"));
    }

    /// MLPerf GNMT's bucketing sampler: 5 buckets of 15 tokens up to 75; a batch is padded
    /// about half a bucket above a side's mean (56 tokens a pair: 28 + 7.5).
    #[test]
    fn bucketed_translation_computes_its_mean_padded_length() {
        let cases = general_json();
        let c = cases
            .iter()
            .find(|c| c.id() == "mlperf-v0.7-gnmt-v2-v100-16gb-8g-b2048-fp16")
            .unwrap();
        let crate::Case::General(g) = c else {
            panic!("a general case")
        };
        assert_eq!(g.seq(&load_model("gnmt-v2").unwrap()), 36);
    }

    /// DeepLearningExamples' phase 2 loads length bins of 64 tokens: a sample of Wikipedia's
    /// 512-token set holds half padding, and its batch is padded half a bin above that; phase 1
    /// and SQuAD compute their full padded length.
    #[test]
    fn binned_phase_two_computes_its_mean_padded_length() {
        let cases = general_json();
        let seq_of = |id: &str| {
            let c = cases.iter().find(|c| c.id() == id).unwrap();
            let crate::Case::General(g) = c else {
                panic!("{id} is a general case")
            };
            g.seq(&load_model("bert-large").unwrap())
        };
        assert_eq!(
            seq_of("dle-pytorch-bert-bert-large-s512-a100-80gb-1g-b4096-tf32"),
            256 + 32
        );
        assert_eq!(
            seq_of("dle-pytorch-bert-bert-large-s128-a100-80gb-1g-b8192-tf32"),
            128
        );
        assert_eq!(
            seq_of("dle-pytorch-bert-bert-large-squad-s384-a100-80gb-1g-b32-tf32"),
            384
        );
    }

    /// The P100 runs are what the P100 preset was fitted to: they score within its band.
    #[test]
    fn the_p100_runs_score_within_the_fitted_band() {
        let p100: Vec<crate::Case> = general_json()
            .into_iter()
            .filter(|c| c.preset() == "dgx1-p100-16gb")
            .collect();
        let results: Vec<crate::CaseResult> = p100.iter().map(|c| c.run()).collect();
        let s = crate::summarize(&results);
        assert_eq!((s.n, s.skipped), (36, 0));
        let band = parallax_hardware::preset("dgx1-p100-16gb")
            .unwrap()
            .calibration
            .unwrap()
            .step_time_band
            .unwrap();
        assert!(crate::fit::band(&results) <= band + 1e-3, "{s:?}");
    }
}
