//! Completing a partial layout: every knob the user (or a published run) left out is chosen
//! as the fastest feasible value, by the same pruned search as `parallax plan` with the given
//! knobs forced (one routine for `simulate`, `plan --fix` and `validate`).

use crate::search::{search, SearchError, SearchOptions, Space};
use parallax_cost::transformer::Setup;
use parallax_ir::{Layout, PartialLayout, Schedule};
use parallax_sim::StepPrediction;
use thiserror::Error;

/// Why no layout could be completed.
#[derive(Debug, Error)]
pub enum CompleteError {
    #[error("no layout matches: {0}")]
    NoCandidate(String),
    #[error("no completion fits in memory: the smallest needs {need_gib:.1} GiB per device, the device has {have_gib:.1} GiB ({layout})")]
    DoesNotFit {
        need_gib: f64,
        have_gib: f64,
        layout: String,
        /// The completion that needs the least memory.
        smallest: Box<Layout>,
    },
}

/// A chosen layout and its prediction.
#[derive(Clone, Debug)]
pub struct Completed {
    pub layout: Layout,
    pub prediction: StepPrediction,
}

/// Chooses the fastest layout that fits among the completions of `p`, any option allowed.
pub fn complete_layout(setup: &Setup, p: &PartialLayout) -> Result<Completed, CompleteError> {
    complete_within(setup, p, &Space::default())
}

/// [`complete_layout`] with the left-out knobs limited to `space`. Stages are split evenly
/// (as the frameworks whose runs are completed split them).
pub fn complete_within(
    setup: &Setup,
    p: &PartialLayout,
    space: &Space,
) -> Result<Completed, CompleteError> {
    let opts = SearchOptions {
        top_k: 1,
        space: space.clone(),
        force: with_pipeline_defaults(setup, p, space),
        force_even_stages: true,
        families: false,
        ..SearchOptions::default()
    };
    match search(setup, &opts) {
        Ok(r) => {
            let best = r.best();
            Ok(Completed {
                layout: best.layout.clone(),
                prediction: best.prediction.clone(),
            })
        }
        Err(SearchError::DoesNotFit {
            need_gib,
            have_gib,
            layout,
            smallest,
            ..
        }) => Err(CompleteError::DoesNotFit {
            need_gib,
            have_gib,
            layout,
            smallest,
        }),
        Err(SearchError::NoCandidate { summary, .. }) => Err(CompleteError::NoCandidate(summary)),
        Err(SearchError::Unsupported(why)) => Err(CompleteError::NoCandidate(why)),
    }
}

/// `p` with the micro-batch count and stages per rank a pipelined run left open set as the
/// stack sets them ([`Space::pipeline_defaults`]), where the run's data and pipeline degrees
/// are known and the batch divides.
fn with_pipeline_defaults(setup: &Setup, p: &PartialLayout, space: &Space) -> PartialLayout {
    let mut p = p.clone();
    let (Some(d), Some(pp)) = (space.pipeline_defaults, p.pp) else {
        return p;
    };
    if pp < 2 {
        return p;
    }
    if let (None, Some(dp)) = (p.micro_batch, p.dp) {
        let per_rank = setup.global_batch / u64::from(dp.max(1));
        let count = u64::from(pp) * d.microbatches_per_rank;
        if per_rank * u64::from(dp) == setup.global_batch && count > 0 && per_rank % count == 0 {
            p.micro_batch = Some(per_rank / count);
        }
    }
    if p.interleave.is_none() && p.schedule == Some(Schedule::Interleaved1F1B) {
        p.interleave = Some(d.looped_stages_per_rank);
    }
    p
}

/// The layout [`complete_within`] chooses, with the prediction it chose it by, or, where no
/// completion fits, the one that needs the least memory and no prediction (it fits nothing:
/// a run that happened, or a layout a user asked to see, is predicted over memory rather than
/// refused).
pub fn complete_or_smallest(
    setup: &Setup,
    p: &PartialLayout,
    space: &Space,
) -> Result<(Layout, Option<StepPrediction>), CompleteError> {
    match complete_within(setup, p, space) {
        Ok(done) => Ok((done.layout, Some(done.prediction))),
        Err(CompleteError::DoesNotFit { smallest, .. }) => Ok((*smallest, None)),
        Err(e) => Err(e),
    }
}

/// The inline form of the knobs `p` gives (`tp=3,pp=2`), for messages.
pub fn partial_string(p: &PartialLayout) -> String {
    let mut parts = Vec::new();
    for (k, v) in [
        ("dp", p.dp),
        ("tp", p.tp),
        ("pp", p.pp),
        ("cp", p.cp),
        ("ep", p.ep),
        ("etp", p.etp),
    ] {
        if let Some(v) = v {
            parts.push(format!("{k}={v}"));
        }
    }
    if parts.is_empty() {
        "none given".into()
    } else {
        parts.join(",")
    }
}

/// The inline form of a layout (`tp=8,pp=2,…`), as `--plan` accepts it.
pub fn layout_string(l: &Layout) -> String {
    let mut s = format!(
        "dp={},tp={},pp={},cp={},ep={},zero={},mb={},recompute={},sp={},schedule={}",
        l.dp,
        l.tp,
        l.pp,
        l.cp,
        l.ep,
        l.zero_stage,
        l.micro_batch,
        l.recompute,
        l.sequence_parallel,
        l.schedule
    );
    if l.interleave > 1 {
        s.push_str(&format!(",v={}", l.interleave));
    }
    if l.expert_tp() != l.tp {
        s.push_str(&format!(",etp={}", l.expert_tp()));
    }
    if !l.dispatcher.is_all_to_all() {
        s.push_str(&format!(",dispatcher={}", l.dispatcher));
    }
    if l.ep_overlap {
        s.push_str(",ep_overlap=true");
    }
    if l.offload != parallax_ir::Offload::None {
        s.push_str(&format!(",offload={}", l.offload));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_hardware::preset;
    use parallax_ir::models::TransformerConfig;
    use parallax_ir::{Recompute, Schedule};

    #[test]
    fn the_space_limits_only_the_knobs_left_out() {
        let m = TransformerConfig::llama(32, 2048, 16, 16, 5632, 32000, 2048);
        let p = preset("dgx-a100-80gb").unwrap();
        let s = Setup::new(&m, &p, 8, 2048, 16);
        let full_only = Space {
            recompute: vec![Recompute::None, Recompute::Full],
            zero_stages: vec![1],
            ..Space::default()
        };
        let open = PartialLayout::parse("tp=2,pp=2,cp=1").unwrap();
        let c = complete_within(&s, &open, &full_only).unwrap().layout;
        assert!(c.recompute != Recompute::Selective && c.zero_stage == 1);
        assert_eq!((c.tp, c.pp, c.dp), (2, 2, 2));
        // A published value is what the run used, whatever the space offers.
        let given = PartialLayout::parse("tp=2,pp=2,cp=1,recompute=selective,zero=2").unwrap();
        let c = complete_within(&s, &given, &full_only).unwrap().layout;
        assert!(c.recompute == Recompute::Selective && c.zero_stage == 2);
    }

    #[test]
    fn a_stacks_pipeline_defaults_fill_only_what_a_run_left_open() {
        let m = TransformerConfig::llama(32, 2048, 16, 16, 5632, 32000, 2048);
        let p = preset("dgx-a100-80gb").unwrap();
        // 64 sequences over dp 2: 32 a data-parallel rank, 4 pipeline ranks.
        let s = Setup::new(&m, &p, 16, 2048, 64);
        let titan = Space {
            pipeline_defaults: Some(crate::search::PipelineDefaults {
                microbatches_per_rank: 1,
                looped_stages_per_rank: 2,
            }),
            ..Space::default()
        };
        let open = PartialLayout::parse("dp=2,tp=2,pp=4,schedule=interleaved-1f1b").unwrap();
        let done = complete_within(&s, &open, &titan).unwrap().layout;
        // One micro-batch per pipeline rank (4 micro-batches of 8 sequences), two stages a rank.
        assert_eq!((done.micro_batch, done.interleave), (8, 2), "{done:?}");
        // Without the defaults the search picks what is fastest: more, smaller micro-batches.
        let free = complete_within(&s, &open, &Space::default())
            .unwrap()
            .layout;
        assert!(free.micro_batch < 8, "{free:?}");
        // A published count is what the run used.
        let given =
            PartialLayout::parse("dp=2,tp=2,pp=4,mb=2,v=4,schedule=interleaved-1f1b").unwrap();
        let done = complete_within(&s, &given, &titan).unwrap().layout;
        assert_eq!((done.micro_batch, done.interleave), (2, 4));
        // A batch the default count does not divide (18 a rank over 4) is left to the
        // search: the completion is the one without defaults.
        let s = Setup::new(&m, &p, 16, 2048, 36);
        let one_f_one_b = PartialLayout::parse("dp=2,tp=2,pp=4,schedule=1f1b").unwrap();
        let done = complete_within(&s, &one_f_one_b, &titan).unwrap().layout;
        let free = complete_within(&s, &one_f_one_b, &Space::default())
            .unwrap()
            .layout;
        assert_eq!(done, free);
    }

    #[test]
    fn an_unpublished_interleave_splits_evenly_unless_the_framework_splits_unevenly() {
        // 30 layers over 4 stages: no interleave divides them.
        let m = TransformerConfig::llama(30, 2048, 16, 16, 5632, 32000, 2048);
        let p = preset("dgx-a100-80gb").unwrap();
        let s = Setup::new(&m, &p, 8, 2048, 16);
        let partial = PartialLayout::parse("tp=2,pp=4,schedule=interleaved-1f1b").unwrap();
        let even = Space {
            uneven_stages: false,
            ..Space::default()
        };
        let err = complete_within(&s, &partial, &even).unwrap_err();
        assert!(err.to_string().contains("no interleave"), "{err}");
        let done = complete_within(&s, &partial, &Space::default()).unwrap();
        assert_eq!(done.layout.schedule, Schedule::Interleaved1F1B);
        // Every virtual stage keeps at least one layer: 4 × 7 ≤ 30 < 4 × 8.
        assert!((2..=7).contains(&done.layout.interleave));
        // Megatron-Core counts the embedding and the loss as layers where that evens the
        // split: 32 over 8 or 16 chunks (not 32: the end chunks would hold no layer).
        let megatron = Space {
            embedding_and_loss_as_layers: true,
            ..even
        };
        let done = complete_within(&s, &partial, &megatron).unwrap().layout;
        assert!([2, 4].contains(&done.interleave), "{done:?}");
    }

    #[test]
    fn experts_fold_over_tensor_ranks_where_the_published_ep_needs_it() {
        // Qwen3-30B-A3B on 16 GPUs with tp 2 and ep 16 published, etp not: only etp 1 fits
        // ep 16 into dp × tp = 16 ranks, and it needs sequence parallelism.
        let m = parallax_ir::models::zoo::transformer("qwen3-30b-a3b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup::new(&m, &p, 16, 256, 4096);
        let partial = PartialLayout::parse("tp=2,pp=1,ep=16").unwrap();
        let done = complete_within(&s, &partial, &Space::default())
            .unwrap()
            .layout;
        assert_eq!((done.dp, done.etp, done.expert_dp()), (8, Some(1), 1));
        assert!(done.sequence_parallel);
        assert!(
            layout_string(&done).contains(",etp=1"),
            "{}",
            layout_string(&done)
        );
        // Given etp = tp, ep 16 does not divide dp × cp = 8: nothing to complete.
        let inside = PartialLayout::parse("tp=2,pp=1,ep=16,etp=2").unwrap();
        assert!(complete_within(&s, &inside, &Space::default()).is_err());
    }

    #[test]
    fn dual_pipe_is_completed_where_given_and_never_proposed() {
        let m = parallax_ir::models::zoo::transformer("llama3-8b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup::new(&m, &p, 32, 4096, 256);
        let given = PartialLayout::parse("pp=4,schedule=dualpipe").unwrap();
        let done = complete_within(&s, &given, &Space::default())
            .unwrap()
            .layout;
        assert_eq!((done.schedule, done.interleave), (Schedule::DualPipe, 1));
        let open = PartialLayout::parse("pp=4").unwrap();
        let best = complete_within(&s, &open, &Space::default())
            .unwrap()
            .layout;
        assert_ne!(best.schedule, Schedule::DualPipe);
        // An interleave past u32 when multiplied by pp is refused, not overflowed (a case
        // file the fuzz target mutated).
        let huge = PartialLayout::parse("pp=4,schedule=interleaved-1f1b,v=1073741824").unwrap();
        let e = complete_within(&s, &huge, &Space::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("4294967296"), "{e}");
        // Too few micro-batches for it: said, not guessed.
        let few = PartialLayout::parse("pp=4,dp=8,mb=8,schedule=dualpipe").unwrap();
        let e = complete_within(&s, &few, &Space::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("dualpipe needs"), "{e}");
    }

    #[test]
    fn the_expert_dispatch_overlaps_where_the_stack_and_schedule_allow() {
        // Qwen3-30B-A3B's experts over 2 nodes of each stage: a stack with the combined 1F1B
        // overlaps the dispatch (faster, and it fits); over pipeline stages only interleaved.
        let m = parallax_ir::models::zoo::transformer("qwen3-30b-a3b").unwrap();
        let p = preset("dgx-h100-80gb").unwrap();
        let s = Setup::new(&m, &p, 64, 512, 4096);
        let done = |partial: &str, space: &Space| {
            complete_within(&s, &PartialLayout::parse(partial).unwrap(), space).map(|d| d.layout)
        };
        // At a given micro-batch size: fewer, larger micro-batches also save each MoE layer's
        // host sync, which may outweigh the overlap.
        let one = done(
            "dp=64,pp=1,ep=16,mb=4,recompute=selective",
            &Space::default(),
        )
        .unwrap();
        assert!(one.ep_overlap, "{one:?}");
        assert!(layout_string(&one).ends_with(",ep_overlap=true"));
        let older = Space {
            ep_overlap: false,
            ..Space::default()
        };
        assert!(
            !done("dp=64,pp=1,ep=16,mb=4,recompute=selective", &older)
                .unwrap()
                .ep_overlap
        );
        // Full recompute rules it out; with pp > 1 an asked-for overlap takes interleaving.
        assert!(
            !done("dp=64,pp=1,ep=16,recompute=full", &Space::default())
                .unwrap()
                .ep_overlap
        );
        let piped = done("dp=16,pp=4,ep=16,ep_overlap=true", &Space::default()).unwrap();
        assert_eq!(piped.schedule, Schedule::Interleaved1F1B, "{piped:?}");
        let e = done(
            "dp=16,pp=4,ep=16,ep_overlap=true,schedule=1f1b",
            &Space::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("needs the interleaved-1f1b (or dualpipe) schedule"),
            "{e}"
        );
    }
}
