//! Differential tests: every layout trains exactly like one rank (within 1e-4 relative), plus
//! resume, faults and input errors.

use crate::engine::{Fault, FaultKind, RunSpec};
use crate::fixtures::*;
use crate::{run, run_threads, Backend, ExecError, ModelState};
use parallax_ir::models::TransformerConfig;
use parallax_ir::{Layout, Recompute, Schedule};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const STEPS: u64 = 5;
const GLOBAL_BATCH: u64 = 8;
const SEQ: u64 = 16;
/// Relative tolerance of losses and parameters against the single-rank run.
const TOL: f64 = 1e-4;

/// What BERT reads: a repetitive text, whose masked bytes their neighbours give away (on the
/// synthetic progressions a masked-LM loss, over 15 % of the positions, moves too slowly for
/// five steps to show training).
fn bert_text() -> crate::DataSource {
    let text = "parallax plans, simulates and trains models. ".repeat(40);
    crate::DataSource::Bytes(Arc::new(text.into_bytes()))
}

fn spec(model: TransformerConfig, layout: Layout) -> RunSpec {
    let bert = model.bert;
    let mut s = RunSpec::new(model, layout, GLOBAL_BATCH, SEQ, STEPS);
    if bert {
        s.data = bert_text();
    }
    s.seed = 42;
    s.collect_state = true;
    s.timeout = Duration::from_secs(60);
    s
}

/// Megatron-Core's `--recompute-modules` of the named submodules.
fn modules(names: &[&str]) -> Recompute {
    Recompute::Modules(parallax_ir::RecomputeModules::parse(names).unwrap())
}

/// Losses and final state of a run.
type Outcome = Arc<(Vec<f64>, ModelState)>;

/// The single-rank run of a model, computed once per model.
fn reference(model: &TransformerConfig) -> Outcome {
    static CACHE: OnceLock<Mutex<HashMap<String, Outcome>>> = OnceLock::new();
    let key = format!("{model:?}");
    let cache = CACHE.get_or_init(Default::default);
    if let Some(r) = cache.lock().unwrap().get(&key) {
        return r.clone();
    }
    let r = run_threads(&spec(model.clone(), Layout::default())).unwrap();
    let out = Arc::new((r.losses, r.state.unwrap()));
    cache.lock().unwrap().insert(key, out.clone());
    out
}

/// Runs `layout` and checks it against the single-rank run; returns the worst relative error.
fn check_equivalent(model: TransformerConfig, layout: Layout) -> f64 {
    let reference = reference(&model);
    let r = run_threads(&spec(model, layout.clone())).unwrap();
    let worst = same_training(&r, &reference, &format!("{layout:?}"));
    // The loss must move: a run that does nothing would match trivially.
    assert!(
        reference.0[STEPS as usize - 1] < reference.0[0] - 0.05,
        "{:?}",
        reference.0
    );
    worst
}

/// Checks that run `r` has the losses and final parameters of `reference` within [`TOL`];
/// returns the worst relative error.
fn same_training(r: &crate::RunReport, reference: &(Vec<f64>, ModelState), what: &str) -> f64 {
    let mut worst: f64 = 0.0;
    for (i, (a, b)) in r.losses.iter().zip(&reference.0).enumerate() {
        let rel = (a - b).abs() / b.abs();
        assert!(
            rel <= TOL,
            "{what}: step {i} loss {a} vs reference {b} (rel {rel:e})"
        );
        worst = worst.max(rel);
    }
    assert_eq!(r.losses.len(), reference.0.len());
    let state = r.state.as_ref().unwrap();
    assert_eq!(state.tensors.len(), reference.1.tensors.len());
    let (d, name) = state.max_relative_diff_where(&reference.1, |n| !n.ends_with("attn.bk"));
    // The key bias has an identically zero gradient (softmax is invariant to adding q·b_k to
    // every score of a query), so what Adam does to it is rounding noise scaled up to ±lr:
    // check only that it stays that small.
    let lr = f64::from(crate::AdamConfig::default().lr);
    for (n, t) in state.tensors.iter().filter(|(n, _)| n.ends_with("attn.bk")) {
        let max = t
            .param
            .iter()
            .fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
        assert!(max <= 1.01 * lr * STEPS as f64, "{n}: {max}");
    }
    assert!(
        d <= TOL,
        "{what}: parameter {name} differs by {d:e} (relative)"
    );
    eprintln!("equivalence {what}: max relative error loss {worst:.2e}, params {d:.2e} ({name})");
    worst.max(d)
}

/// Stage ranges of `counts` blocks each, the embedding on the first and the head on the last.
fn uneven(counts: &[u32]) -> Vec<parallax_ir::plan::StageRange> {
    let mut first = 0;
    counts
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let r = parallax_ir::plan::StageRange {
                first_layer: first,
                end_layer: first + c,
                embedding: i == 0,
                head: i + 1 == counts.len(),
            };
            first += c;
            r
        })
        .collect()
}

/// One test per layout of the matrix (candle's `test_device!` pattern).
macro_rules! equivalence {
    ($($name:ident: $model:expr, $layout:expr;)*) => {$(
        #[test]
        fn $name() {
            check_equivalent($model, $layout);
        }
    )*};
}

equivalence! {
    dp2: gpt(4), Layout { dp: 2, ..Layout::default() };
    dp2_micro_batch2: gpt(4), Layout { dp: 2, micro_batch: 2, ..Layout::default() };
    tp2: gpt(4), Layout { tp: 2, ..Layout::default() };
    pp2_gpipe: gpt(4), pp(2, Schedule::GPipe);
    pp2_1f1b: gpt(4), pp(2, Schedule::OneFOneB);
    pp4_interleaved_v2: gpt(8), Layout { interleave: 2, ..pp(4, Schedule::Interleaved1F1B) };
    dp2_tp2: gpt(4), Layout { dp: 2, tp: 2, ..Layout::default() };
    tp2_pp2_sp: gpt(4), Layout { tp: 2, sequence_parallel: true, ..pp(2, Schedule::OneFOneB) };
    dp2_zero1: gpt(4), Layout { dp: 2, zero_stage: 1, ..Layout::default() };
    dp2_zero2: gpt(4), Layout { dp: 2, zero_stage: 2, ..Layout::default() };
    dp2_zero3: gpt(4), Layout { dp: 2, zero_stage: 3, ..Layout::default() };
    dp2_tp2_pp2: gpt(4), Layout { dp: 2, tp: 2, ..pp(2, Schedule::OneFOneB) };
    recompute_full_tp2: gpt(4), Layout { tp: 2, recompute: Recompute::Full, ..Layout::default() };
    // Every second layer recomputed, counted over the whole model across interleaved chunks.
    recompute_every2_pp2_interleaved: gpt(8), Layout { recompute: Recompute::Every(2), interleave: 2, ..pp(2, Schedule::Interleaved1F1B) };
    recompute_selective_pp2: gpt(4), Layout { recompute: Recompute::Selective, ..pp(2, Schedule::GPipe) };
    llama_tp2_sp_full_recompute: llama(4), Layout { tp: 2, sequence_parallel: true, recompute: Recompute::Full, ..Layout::default() };
    llama_dp2_pp2_zero3_interleaved: llama(4), Layout { dp: 2, zero_stage: 3, interleave: 2, ..pp(2, Schedule::Interleaved1F1B) };
    llama_dp2_tp2_sp_zero2_selective: llama(4), Layout { dp: 2, tp: 2, sequence_parallel: true, zero_stage: 2, recompute: Recompute::Selective, ..Layout::default() };
    // More tensor-parallel ranks than key/value heads (4 > 2): each head on two ranks.
    llama_tp4_replicated_kv: llama(4), Layout { tp: 4, ..Layout::default() };
    llama_dp2_tp4_sp_zero1_replicated_kv: llama(2), Layout { dp: 2, tp: 4, sequence_parallel: true, zero_stage: 1, ..Layout::default() };
    // Uneven (balanced) stages: the embedding's stage holds fewer blocks, as the planner
    // balances them.
    pp2_uneven_1f1b: gpt(5), Layout { stages: uneven(&[2, 3]), ..pp(2, Schedule::OneFOneB) };
    pp2_uneven_interleaved: gpt(8), Layout { stages: uneven(&[1, 2, 3, 2]), interleave: 2, ..pp(2, Schedule::Interleaved1F1B) };
    // Zero-bubble (ZB-H1): input gradients first, weight gradients where the pipeline idles.
    pp2_zb_h1: gpt(4), pp(2, Schedule::ZeroBubbleH1);
    llama_dp2_pp2_zb_h1_zero2_tp2_sp: llama(4), Layout { dp: 2, tp: 2, sequence_parallel: true, zero_stage: 2, ..pp(2, Schedule::ZeroBubbleH1) };
    pp4_zb_h1_full_recompute: gpt(4), Layout { recompute: Recompute::Full, ..pp(4, Schedule::ZeroBubbleH1) };
    // Context parallelism: each rank two load-balanced chunks of every sequence, ring
    // attention over them.
    cp2: gpt(4), Layout { cp: 2, ..Layout::default() };
    cp4_learned_positions: gpt(2), Layout { cp: 4, ..Layout::default() };
    llama_cp2_tp2_sp_selective: llama(4), Layout { cp: 2, tp: 2, sequence_parallel: true, recompute: Recompute::Selective, ..Layout::default() };
    llama_dp2_cp2_pp2_zero1_full_recompute: llama(4), Layout { dp: 2, cp: 2, zero_stage: 1, recompute: Recompute::Full, ..pp(2, Schedule::OneFOneB) };
    // Expert parallelism: experts split over ep data-parallel ranks, tokens dispatched to them
    // and combined back in all-to-alls.
    moe_dp2: mixtral(2), Layout { dp: 2, ..Layout::default() };
    moe_dp2_ep2: mixtral(2), Layout { dp: 2, ep: 2, ..Layout::default() };
    moe_dp4_ep2: mixtral(2), Layout { dp: 4, ep: 2, ..Layout::default() };
    moe_dp4_ep4_selective: mixtral(2), Layout { dp: 4, ep: 4, recompute: Recompute::Selective, ..Layout::default() };
    moe_dp2_ep2_pp2: mixtral(4), Layout { dp: 2, ep: 2, ..pp(2, Schedule::OneFOneB) };
    moe_dp2_ep2_cp2_full_recompute: mixtral(2), Layout { dp: 2, ep: 2, cp: 2, recompute: Recompute::Full, ..Layout::default() };
    moe_dp4_ep2_zero1: mixtral(2), Layout { dp: 4, ep: 2, zero_stage: 1, ..Layout::default() };
    moe_dp4_ep2_zero3_pp2_zb_h1: mixtral(4), Layout { dp: 4, ep: 2, zero_stage: 3, ..pp(2, Schedule::ZeroBubbleH1) };
    moe_dp2_ep2_zero2: mixtral(2), Layout { dp: 2, ep: 2, zero_stage: 2, ..Layout::default() };
    // Tensor parallelism runs the mixture of experts whole on every tensor-parallel rank.
    moe_tp2_sp: mixtral(2), Layout { tp: 2, sequence_parallel: true, ..Layout::default() };
    moe_dp2_ep2_tp2: mixtral(2), Layout { dp: 2, ep: 2, tp: 2, ..Layout::default() };
    // Folded over the tensor-parallel ranks (etp 1): each routes its own rows, the expert
    // group spans data and tensor ranks (Megatron-Core's MoE parallel folding).
    moe_dp2_tp2_sp_ep4_etp1: mixtral(2), Layout { dp: 2, tp: 2, sequence_parallel: true, ep: 4, etp: Some(1), ..Layout::default() };
    moe_tp2_sp_etp1: mixtral(2), Layout { tp: 2, sequence_parallel: true, etp: Some(1), ..Layout::default() };
    moe_dp2_tp2_sp_ep2_etp1_zero1_pp2: mixtral(4), Layout { dp: 2, tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), zero_stage: 1, ..pp(2, Schedule::OneFOneB) };
    moe_cp2_tp2_sp_ep4_etp1_zero3: mixtral(2), Layout { cp: 2, tp: 2, sequence_parallel: true, ep: 4, etp: Some(1), zero_stage: 3, ..Layout::default() };
    // Dense layers among the MoE layers, under expert, pipeline and folded tensor parallelism.
    moe_dense_dp2_ep2_pp2: mixed_dense(4), Layout { dp: 2, ep: 2, ..pp(2, Schedule::OneFOneB) };
    moe_dense_tp2_sp_ep2_etp1_zero1: mixed_dense(4), Layout { tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), zero_stage: 1, ..Layout::default() };
    // DeepSeek-V3's routing and shared experts, under expert, tensor (folded and not) and
    // pipeline parallelism.
    deepseek_moe_dp2_ep2: deepseek_moe(2), Layout { dp: 2, ep: 2, ..Layout::default() };
    deepseek_moe_tp2_sp_ep2_etp1_zero1: deepseek_moe(2), Layout { tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), zero_stage: 1, ..Layout::default() };
    deepseek_moe_dp2_tp2_ep2_pp2_selective: deepseek_moe(4), Layout { dp: 2, tp: 2, ep: 2, recompute: Recompute::Selective, ..pp(2, Schedule::OneFOneB) };
    deepseek_moe_dp2_ep2_zb_h1_full_recompute: deepseek_moe(4), Layout { dp: 2, ep: 2, recompute: Recompute::Full, ..pp(2, Schedule::ZeroBubbleH1) };
    // Latent attention: its down projections whole on every tensor-parallel rank, heads
    // padded to one width for the attention kernels, the rotary key shared by the heads.
    deepseek_dp2_ep2_zero1: deepseek(2, 16), Layout { dp: 2, ep: 2, zero_stage: 1, ..Layout::default() };
    deepseek_tp2_sp_ep2_etp1: deepseek(2, 16), Layout { tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), ..Layout::default() };
    deepseek_cp2_tp2: deepseek(2, 16), Layout { cp: 2, tp: 2, ..Layout::default() };
    deepseek_dp2_tp2_pp2_zb_h1_selective: deepseek(4, 16), Layout { dp: 2, tp: 2, recompute: Recompute::Selective, ..pp(2, Schedule::ZeroBubbleH1) };
    deepseek_tp4_full_recompute_zero3: deepseek(2, 16), Layout { tp: 4, dp: 2, zero_stage: 3, recompute: Recompute::Full, ..Layout::default() };
    deepseek_direct_queries_tp2_sp_pp2: deepseek(4, 0), Layout { tp: 2, sequence_parallel: true, ..pp(2, Schedule::OneFOneB) };
    // Multi-token prediction: modules on the last stage reading the embedding table (a copy
    // there under pipelining, its gradient summed with the first stage's) and the LM head.
    deepseek_mtp_dp2_ep2: deepseek_mtp(2, 2), Layout { dp: 2, ep: 2, ..Layout::default() };
    deepseek_mtp_tp2_sp_vocab_parallel: deepseek_mtp(2, 1), Layout { tp: 2, sequence_parallel: true, ..Layout::default() };
    deepseek_mtp_cp2_zero3: deepseek_mtp(2, 2), Layout { cp: 2, dp: 2, zero_stage: 3, ..Layout::default() };
    deepseek_mtp_pp2_zb_h1_tp2: deepseek_mtp(4, 1), Layout { tp: 2, ..pp(2, Schedule::ZeroBubbleH1) };
    deepseek_mtp_pp2_interleaved_full_recompute: deepseek_mtp(4, 2), Layout { dp: 2, recompute: Recompute::Full, interleave: 2, ..pp(2, Schedule::Interleaved1F1B) };
    gpt_mtp_tied_pp2_tp2_sp: TransformerConfig { mtp_layers: 1, ..gpt(4) }, Layout { tp: 2, sequence_parallel: true, ..pp(2, Schedule::OneFOneB) };
    qwen2_moe_dp2_ep2_zero2: qwen2_moe(2), Layout { dp: 2, ep: 2, zero_stage: 2, ..Layout::default() };
    qwen2_moe_tp2_sp_ep2_etp1: qwen2_moe(2), Layout { tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), ..Layout::default() };
    qwen2_moe_tp2_sp_pp2_full_recompute: qwen2_moe(4), Layout { tp: 2, sequence_parallel: true, recompute: Recompute::Full, ..pp(2, Schedule::OneFOneB) };
    qwen2_moe_dp2_tp2: qwen2_moe(2), Layout { dp: 2, tp: 2, ..Layout::default() };
    // Attention sinks (GPT-OSS), with windows and experts.
    gpt_oss_tp2_sp_ep2_etp1: gpt_oss(2), Layout { tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), ..Layout::default() };
    gpt_oss_dp2_ep2_pp2_zb_h1_selective: gpt_oss(4), Layout { dp: 2, ep: 2, recompute: Recompute::Selective, ..pp(2, Schedule::ZeroBubbleH1) };
    // Ring attention over windows and sinks: a window of 4 keys across chunks of 4 tokens, the
    // sink joining each row's normaliser once the ring is done.
    gpt_oss_cp2: gpt_oss(2), Layout { cp: 2, ..Layout::default() };
    gpt_oss_cp2_tp2_sp_ep2_etp1_selective: gpt_oss(2), Layout { cp: 2, tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), recompute: Recompute::Selective, ..Layout::default() };
    gpt_oss_sinks_cp4_dp2: TransformerConfig { sliding_window: None, ..gpt_oss(2) }, Layout { cp: 4, dp: 2, ..Layout::default() };
    windowed_nope_cp2_pp2_zb_h1: windowed_nope(4), Layout { cp: 2, ..pp(2, Schedule::ZeroBubbleH1) };
    gpt_oss_tp2_full_recompute_zero1: gpt_oss(2), Layout { tp: 2, zero_stage: 1, dp: 2, recompute: Recompute::Full, ..Layout::default() };
    // Query and key norms (Qwen3): the norms' weights see each rank's heads only.
    qwen3_tp2_sp_pp2: qwen3(4), Layout { tp: 2, sequence_parallel: true, ..pp(2, Schedule::OneFOneB) };
    qwen3_tp4_replicated_kv_zero2: qwen3(2), Layout { tp: 4, zero_stage: 2, dp: 2, ..Layout::default() };
    qwen3_cp2_tp2_selective: qwen3(2), Layout { cp: 2, tp: 2, recompute: Recompute::Selective, ..Layout::default() };
    qwen3_moe_dp2_ep2_full_recompute: TransformerConfig { qk_norm: true, ..mixtral(2) }, Layout { dp: 2, ep: 2, recompute: Recompute::Full, ..Layout::default() };
    // BERT's pre-training: masked-LM and next-sentence losses, attention to every key (the
    // ring's blocks unmasked under cp), post-norm blocks, a vocabulary-parallel decoder and
    // bias under tp.
    bert_dp2: bert(2), Layout { dp: 2, ..Layout::default() };
    bert_tp2_sp: bert(2), Layout { tp: 2, sequence_parallel: true, ..Layout::default() };
    bert_tp2_dp2: bert(2), Layout { tp: 2, dp: 2, ..Layout::default() };
    bert_tp2_full_recompute_zero3: bert(2), Layout { tp: 2, dp: 2, zero_stage: 3, recompute: Recompute::Full, ..Layout::default() };
    bert_cp2_dp2_selective: bert(2), Layout { cp: 2, dp: 2, recompute: Recompute::Selective, ..Layout::default() };
    bert_pp2_zb_h1_tp2_sp: bert(4), Layout { tp: 2, sequence_parallel: true, ..pp(2, Schedule::ZeroBubbleH1) };
    bert_pp2_interleaved_cp2: bert(4), Layout { cp: 2, interleave: 2, ..pp(2, Schedule::Interleaved1F1B) };
    // Hybrid stacks: Mamba-2 mixers split by heads and groups under tp, beside attention,
    // MoE and MLP layers.
    nemotron_h_dp2: nemotron_h("ME*M-"), Layout { dp: 2, ..Layout::default() };
    nemotron_h_tp2_sp_ep2_etp1: nemotron_h("ME*M-"), Layout { tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), ..Layout::default() };
    nemotron_h_tp2_pp2_zb_h1: nemotron_h("M*EM"), Layout { tp: 2, ..pp(2, Schedule::ZeroBubbleH1) };
    nemotron_h_dp2_zero3_full_recompute: nemotron_h("ME*M-"), Layout { dp: 2, zero_stage: 3, recompute: Recompute::Full, ..Layout::default() };
    nemotron_h_dp2_pp2_selective: nemotron_h("M-*E"), Layout { dp: 2, recompute: Recompute::Selective, ..pp(2, Schedule::OneFOneB) };
    // Ungated MLPs: squared ReLU (Nemotron), dense and as experts, and ReLU (OPT).
    nemotron_tp2_sp_pp2: nemotron(4), Layout { tp: 2, sequence_parallel: true, ..pp(2, Schedule::OneFOneB) };
    nemotron_relu2_experts_dp2_ep2_zero1: TransformerConfig { moe: Some(parallax_ir::models::MoeConfig::routed(4, 2)), ..nemotron(2) }, Layout { dp: 2, ep: 2, zero_stage: 1, ..Layout::default() };
    relu_gpt_tp2_full_recompute: TransformerConfig { mlp: parallax_ir::models::Mlp::Relu, ..gpt(2) }, Layout { tp: 2, recompute: Recompute::Full, ..Layout::default() };
    // Megatron-Core's named-module recomputation: the norms gathered again under sequence
    // parallelism, the mixture dispatched again, latent attention's up projections redone.
    llama_tp2_sp_pp2_recompute_norms_attention_mlp: llama(4), Layout { tp: 2, sequence_parallel: true, recompute: modules(&["layernorm", "core_attn", "mlp"]), ..pp(2, Schedule::OneFOneB) };
    deepseek_tp2_sp_ep2_etp1_recompute_moe_norms_up_proj: deepseek(2, 16), Layout { tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), recompute: modules(&["moe", "layernorm", "mla_up_proj"]), ..Layout::default() };
    deepseek_moe_dp2_ep2_recompute_shared_experts_moe_act: deepseek_moe(2), Layout { dp: 2, ep: 2, recompute: modules(&["shared_experts", "moe_act", "core_attn"]), ..Layout::default() };
    moe_dense_tp2_sp_ep2_etp1_zb_h1_recompute_mlp_moe: mixed_dense(4), Layout { tp: 2, sequence_parallel: true, ep: 2, etp: Some(1), recompute: modules(&["mlp", "moe"]), ..pp(2, Schedule::ZeroBubbleH1) };
    // Sliding windows alternating with full attention, no position embedding.
    windowed_nope_tp2_sp_pp2: windowed_nope(4), Layout { tp: 2, sequence_parallel: true, ..pp(2, Schedule::OneFOneB) };
    windowed_nope_dp2_zero1_selective: windowed_nope(4), Layout { dp: 2, zero_stage: 1, recompute: Recompute::Selective, ..Layout::default() };
    // A vocabulary tp does not divide: the embedding and head stay whole on every rank.
    tp2_sp_odd_vocab: TransformerConfig::gpt(2, 32, 4, 64, 65, 16), Layout { tp: 2, sequence_parallel: true, ..Layout::default() };
}

#[test]
fn the_window_and_the_position_embedding_change_what_is_trained() {
    // Each of the two is trained as itself, not as the plain model: the losses differ.
    let plain = reference(&llama(4));
    let nope = reference(&TransformerConfig {
        sliding_window: None,
        ..windowed_nope(4)
    });
    let windowed = reference(&windowed_nope(4));
    assert_ne!(plain.0, nope.0);
    assert_ne!(nope.0, windowed.0);
    // Query/key norms are trained as themselves.
    assert_ne!(reference(&qwen3(2)).0, reference(&llama(2)).0);
    // Sinks are trained as themselves.
    let no_sinks = TransformerConfig {
        attention_sinks: false,
        ..gpt_oss(2)
    };
    let sunk = reference(&gpt_oss(2));
    assert_ne!(reference(&no_sinks).0, sunk.0);
    assert_eq!(sunk.1.tensors["layers.0.attn.sinks"].shape, [4]);
}

#[test]
fn multi_token_prediction_trains_the_model_and_reports_the_main_loss() {
    // The reported loss is the main one: the same first step with or without the modules
    // (the model's tensors start alike), the later ones moved by the modules' gradients.
    let plain = reference(&deepseek(2, 16));
    let with = reference(&deepseek_mtp(2, 2));
    assert_eq!(plain.0[0], with.0[0]);
    assert_ne!(plain.0[1], with.0[1]);
    let t = &with.1.tensors;
    assert_eq!(t["mtp.0.proj"].shape, [64, 32]);
    assert!(t.contains_key("mtp.1.attn.wkv_up") && t.contains_key("mtp.1.final_norm.weight"));
    // The modules' blocks are shaped as the last layer: a mixture of experts here.
    assert!(t.contains_key("mtp.0.mlp.experts.wg"));
    // Their gradients reach the LM head and the main model's blocks (through the hidden
    // rows): after one step, Adam's first moment (the gradient, scaled) of each differs from
    // the plain model's.
    let first_moments = |c: TransformerConfig| {
        let mut s = spec(c, Layout::default());
        s.steps = 1;
        run_threads(&s).unwrap().state.unwrap().tensors
    };
    let (a, b) = (
        first_moments(deepseek(2, 16)),
        first_moments(deepseek_mtp(2, 1)),
    );
    for name in [
        "embed.wte",
        "lm_head",
        "layers.1.attn.wkv_up",
        "layers.0.attn.wq_up",
    ] {
        assert_ne!(a[name].m, b[name].m, "{name}");
    }
}

#[test]
fn hybrid_stacks_train_each_layer_as_its_kind() {
    let c = nemotron_h("ME*M-");
    let r = reference(&c);
    let t = &r.1.tensors;
    // Mamba layers: the mixer and its norm only; attention, MoE and MLP layers their part.
    assert_eq!(t["layers.0.mamba.w_x"].shape, [32, 32]);
    assert_eq!(t["layers.0.mamba.conv_b.weight"].shape, [8, 4]);
    assert!(!t.contains_key("layers.0.attn.wq") && !t.contains_key("layers.0.ln2.weight"));
    assert!(t.contains_key("layers.1.mlp.router") && !t.contains_key("layers.1.ln1.weight"));
    assert!(t.contains_key("layers.2.attn.wq") && !t.contains_key("layers.2.mlp.w1"));
    assert!(t.contains_key("layers.4.mlp.w1") && !t.contains_key("layers.4.attn.wq"));
    // Exactly the model the planner prices.
    let counted: usize = t.values().map(|x| x.shape.iter().product::<usize>()).sum();
    let opts = parallax_ir::models::BuildOptions {
        batch: 1,
        seq: 16,
        fused_attention: true,
    };
    assert_eq!(counted as u64, c.build("h", opts).unwrap().param_count());
    // Context parallelism would pass the scan's state between ranks: refused by name.
    let e = run_threads(&spec(
        c,
        Layout {
            cp: 2,
            ..Layout::default()
        },
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("Mamba-2"), "{e}");
}

#[test]
fn bert_trains_its_pretraining_model() {
    let r = reference(&bert(2));
    let t = &r.1.tensors;
    for (name, shape) in [
        ("embed.token_type", vec![2, 32]),
        ("embed.norm.weight", vec![32]),
        ("pooler.weight", vec![32, 32]),
        ("nsp.weight", vec![32, 2]),
        ("mlm.dense.weight", vec![32, 32]),
        ("mlm.bias", vec![256]),
    ] {
        assert_eq!(t[name].shape, shape, "{name}");
    }
    // No final norm (the blocks end in one) and no LM head of its own (the decoder is tied).
    assert!(!t.contains_key("final_norm.weight") && !t.contains_key("lm_head"));
    // Exactly the model the planner prices: BertForPreTraining's parameters.
    let counted: usize = t.values().map(|x| x.shape.iter().product::<usize>()).sum();
    let opts = parallax_ir::models::BuildOptions {
        batch: 1,
        seq: 16,
        fused_attention: true,
    };
    let graph = bert(2).build("bert", opts).unwrap();
    assert_eq!(counted as u64, graph.param_count());
    // A BERT with a causal mask is not BERT: refused by name, not run as another model.
    let causal = TransformerConfig {
        causal: true,
        ..bert(2)
    };
    let e = crate::model::Dims::from_config(&causal).unwrap_err();
    assert!(e.contains("BERT with causal attention"), "{e}");
}

#[test]
fn gpt_oss_biases_and_clamped_gate_change_what_is_trained() {
    let full = reference(&gpt_oss(2));
    let plain_gate = TransformerConfig {
        clamped_swiglu: false,
        ..gpt_oss(2)
    };
    let unbiased = TransformerConfig {
        bias: false,
        ..gpt_oss(2)
    };
    assert_ne!(full.0, reference(&plain_gate).0);
    assert_ne!(full.0, reference(&unbiased).0);
    let t = &full.1.tensors;
    assert_eq!(t["layers.0.mlp.router_bias"].shape, [4]);
    assert_eq!(t["layers.0.mlp.experts.bg"].shape, [4, 64]);
    assert_eq!(t["layers.0.mlp.experts.bu"].shape, [4, 64]);
    assert_eq!(t["layers.0.mlp.experts.bd"].shape, [4, 32]);
    assert_eq!(t["layers.0.attn.bo"].shape, [32]);
}

#[test]
fn deepseek_routing_and_shared_experts_change_what_is_trained() {
    // Each feature is trained as itself: removing any one changes the losses.
    let full = reference(&deepseek_moe(2));
    let without = |f: fn(&mut parallax_ir::models::MoeConfig)| {
        let mut c = deepseek_moe(2);
        if let Some(m) = c.moe.as_mut() {
            f(m);
        }
        reference(&c).0.clone()
    };
    for (what, losses) in [
        (
            "softmax",
            without(|m| m.router = parallax_ir::models::Router::Softmax),
        ),
        ("no groups", without(|m| m.groups = 0)),
        ("no scale", without(|m| m.routed_scale_permille = 1000)),
        ("no shared expert", without(|m| m.shared_ffn_hidden = 0)),
        ("unnormalised", without(|m| m.norm_top_k = false)),
    ] {
        assert_ne!(full.0, losses, "{what}");
    }
    // Latent attention's tensors, at their whole shapes: the values 6 wide per head.
    let t = &reference(&deepseek(2, 16)).1.tensors;
    assert_eq!(t["layers.0.attn.wq_down"].shape, [32, 16]);
    assert_eq!(t["layers.0.attn.wkv_down"].shape, [32, 12 + 4]);
    assert_eq!(t["layers.0.attn.wkv_up"].shape, [12, 4 * (4 + 6)]);
    assert_eq!(t["layers.0.attn.wo"].shape, [4 * 6, 32]);
    assert!(!t.contains_key("layers.0.attn.wk"));
    // Qwen2-MoE's gate on its shared expert is trained: without it the losses differ.
    let gated = reference(&qwen2_moe(2));
    let mut ungated = qwen2_moe(2);
    if let Some(m) = ungated.moe.as_mut() {
        m.shared_gate = false;
    }
    assert_ne!(gated.0, reference(&ungated).0);
    assert_eq!(gated.1.tensors["layers.0.mlp.shared_gate"].shape, [32, 1]);
    // Its biases: query, key and value only.
    let t = &gated.1.tensors;
    assert!(t.contains_key("layers.0.attn.bq") && t.contains_key("layers.0.attn.bv"));
    assert!(!t.contains_key("layers.0.attn.bo"));
    // The shared expert is a dense MLP of its own width in every MoE layer, none in the dense one.
    let t = &full.1.tensors;
    assert_eq!(t["layers.1.mlp.shared.wg"].shape, [32, 48]);
    assert_eq!(t["layers.0.mlp.wg"].shape, [32, 72]);
    assert!(!t.contains_key("layers.0.mlp.shared.wg"));
}

#[test]
fn embedding_and_head_split_by_vocabulary_where_tp_divides_it() {
    use crate::model::{SlotBuilder, Split};
    assert_eq!(SlotBuilder::new(2).vocab_split(64), Split::Dim(0));
    assert_eq!(SlotBuilder::new(2).vocab_split(65), Split::Replicated);
    assert_eq!(SlotBuilder::new(1).vocab_split(64), Split::Replicated);
    // Each of two ranks holds half the table: 32 of 64 rows of width 32.
    let d = crate::model::Dims::from_config(&gpt(2)).unwrap();
    let mut b = SlotBuilder::new(2);
    let r = crate::model::build_wte(&d, &mut b, false);
    assert_eq!(r.len(), 32 * 32);
}

#[test]
fn resume_continues_to_exactly_the_uninterrupted_losses() {
    let layout = Layout {
        dp: 2,
        zero_stage: 1,
        ..pp(2, Schedule::OneFOneB)
    };
    let full = run_threads(&spec(gpt(4), layout.clone())).unwrap();
    let mut first = spec(gpt(4), layout.clone());
    first.steps = 2;
    let half = run_threads(&first).unwrap();
    let mut second = spec(gpt(4), layout);
    second.steps = 3;
    second.resume = half.state.map(Arc::new);
    let rest = run_threads(&second).unwrap();
    let joined: Vec<f64> = half.losses.iter().chain(&rest.losses).copied().collect();
    assert_eq!(joined, full.losses, "bitwise equal losses after resume");
    assert_eq!(rest.state.unwrap(), full.state.unwrap());
}

#[test]
fn a_checkpoint_of_another_depth_is_refused_by_name() {
    let mut short = spec(gpt(2), Layout::default());
    short.steps = 1;
    let two = Arc::new(run_threads(&short).unwrap().state.unwrap());
    let mut deeper = spec(gpt(4), Layout::default());
    deeper.resume = Some(two.clone());
    let e = run_threads(&deeper).unwrap_err().to_string();
    assert!(
        e.contains("tensor layers.2.") && e.contains("missing"),
        "{e}"
    );
    let mut four = spec(gpt(4), Layout::default());
    four.steps = 1;
    let mut shallower = spec(gpt(2), Layout::default());
    shallower.resume = Some(Arc::new(run_threads(&four).unwrap().state.unwrap()));
    let e = run_threads(&shallower).unwrap_err().to_string();
    assert!(
        e.contains("tensor layers.2.") && e.contains("not part of this model"),
        "{e}"
    );
    // The same depth under another layout resumes.
    let mut same = spec(
        gpt(2),
        Layout {
            tp: 2,
            ..Layout::default()
        },
    );
    same.steps = 1;
    same.resume = Some(two);
    assert!(run_threads(&same).is_ok());
}

#[test]
fn a_dying_rank_ends_the_run_with_its_name() {
    let mut s = spec(
        gpt(2),
        Layout {
            dp: 2,
            ..pp(2, Schedule::OneFOneB)
        },
    );
    s.fault = Some(Fault {
        rank: 3,
        step: 1,
        kind: FaultKind::Die,
    });
    let e = run_threads(&s).unwrap_err().to_string();
    assert!(
        e.starts_with("rank 3 failed") && e.contains("injected fault"),
        "{e}"
    );
}

#[test]
fn a_stalled_rank_is_named_within_a_bounded_time() {
    let mut s = spec(
        gpt(2),
        Layout {
            dp: 2,
            ..pp(2, Schedule::OneFOneB)
        },
    );
    s.timeout = Duration::from_millis(500);
    s.fault = Some(Fault {
        rank: 2,
        step: 1,
        kind: FaultKind::Stall,
    });
    let t0 = Instant::now();
    let e = run_threads(&s).unwrap_err().to_string();
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert!(e.starts_with("rank 2 failed: stopped responding"), "{e}");
}

#[test]
fn unsupported_inputs_are_errors_not_panics() {
    let bad = |model: TransformerConfig, layout: Layout| -> String {
        run_threads(&spec(model, layout)).unwrap_err().to_string()
    };
    assert!(bad(
        gpt(4),
        Layout {
            tp: 3,
            ..Layout::default()
        }
    )
    .contains("tp 3"));
    // cp 3 cannot cut 16 tokens into 6 equal chunks.
    assert!(bad(
        gpt(4),
        Layout {
            cp: 3,
            ..Layout::default()
        }
    )
    .contains("2 × cp = 6 chunks"));
    assert!(bad(
        gpt(4),
        Layout {
            dp: 3,
            ..Layout::default()
        }
    )
    .contains("multiple"));
    let encoder = TransformerConfig {
        causal: false,
        ..gpt(2)
    };
    assert!(bad(encoder, Layout::default()).contains("encoders other than BERT"));
    // Experts folded over tensor-parallel ranks route each rank's own rows: sequence
    // parallelism must split them.
    let folded = Layout {
        dp: 2,
        tp: 2,
        ep: 4,
        etp: Some(1),
        ..Layout::default()
    };
    assert!(bad(mixtral(2), folded).contains("needs sequence parallelism"));
    let mut s = spec(gpt(2), Layout::default());
    s.seq = 17;
    assert!(run_threads(&s)
        .unwrap_err()
        .to_string()
        .contains("learned positions"));
    if cfg!(not(feature = "mpi")) {
        let e = run(&spec(gpt(2), Layout::default()), Backend::Mpi).unwrap_err();
        assert!(matches!(e, ExecError::NotCompiled { .. }), "{e}");
    }
}

/// The GPU backend's path through the trainer without a GPU: every rank hands its GEMMs and
/// Adam updates to the host emulation (the same `DeviceOffload` calls `cuda_backend` makes),
/// and trains like the plain CPU run. The GEMMs are an independent implementation; the Adam
/// updates run the trainer's own arithmetic, so for them this checks the hand-over only.
#[test]
fn offloading_gemms_and_adam_trains_like_the_cpu_kernels() {
    use crate::tensor::{emulated::BlasOnHost, set_device_offload};
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Wide enough that most GEMMs reach the offload's threshold.
    let wide_llama = TransformerConfig::llama(2, 64, 4, 2, 256, 128, 16);
    let wide_gpt = TransformerConfig::gpt(2, 64, 4, 256, 128, 16);
    for (model, layout) in [
        (
            wide_llama,
            Layout {
                dp: 2,
                tp: 2,
                sequence_parallel: true,
                zero_stage: 1,
                recompute: Recompute::Selective,
                ..Layout::default()
            },
        ),
        (
            wide_gpt,
            Layout {
                zero_stage: 3,
                dp: 2,
                ..pp(2, Schedule::OneFOneB)
            },
        ),
    ] {
        let s = spec(model, layout);
        let (gemms, adams) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let got = crate::run_threads_with(&s, &|spec, prep, comm, epoch| {
            let host = std::rc::Rc::new(BlasOnHost::default());
            set_device_offload(Some(host.clone()));
            let r = crate::engine::run_rank(spec, prep, comm, epoch);
            set_device_offload(None);
            gemms.fetch_add(host.gemms.get(), Ordering::Relaxed);
            adams.fetch_add(host.adams.get(), Ordering::Relaxed);
            r
        })
        .unwrap();
        let want = run_threads(&s).unwrap();
        assert!(gemms.into_inner() > 0 && adams.into_inner() > 0);
        same_training(
            &got,
            &(want.losses, want.state.unwrap()),
            &format!("offloaded {:?}", s.layout),
        );
    }
}

#[test]
fn zb_h1_runs_weight_gradients_as_their_own_passes() {
    let mut s = spec(gpt(4), pp(2, Schedule::ZeroBubbleH1));
    s.trace = true;
    let r = crate::run_threads(&s).unwrap();
    let names: Vec<&str> = r.spans.iter().map(|x| x.name.as_str()).collect();
    assert!(names.iter().any(|n| n.starts_with("W mb")), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("B mb")), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with("BW mb")), "{names:?}");
}
