//! Completing a partial layout: every knob the user (or a published run) left out is chosen
//! as the fastest feasible value, by simulating every combination.

use crate::search::{
    degree_tuples, recompute_options, schedule_options, zero_options, Space,
    DEFAULT_MAX_MICRO_BATCH, TP_ACROSS_NODES,
};
use parallax_cost::model_flops_per_step;
use parallax_cost::transformer::Setup;
use parallax_ir::{Layout, PartialLayout};
use parallax_sim::{simulate_step_with_flops, StepError, StepPrediction};
use rayon::prelude::*;
use std::collections::BTreeMap;
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

/// A simulated candidate, or why it was rejected: (reason kind, full message).
type Outcome = Result<StepPrediction, (String, String)>;

/// A chosen layout and its prediction.
#[derive(Clone, Debug)]
pub struct Completed {
    pub layout: Layout,
    pub prediction: StepPrediction,
    /// Candidates tried, and rejections by reason.
    pub tried: usize,
    pub rejected: BTreeMap<String, usize>,
}

/// Every full layout consistent with `p` on `setup`'s cluster whose left-out knobs take
/// values in `space`, telling `reject` about each degree combination rejected outright.
fn candidates_or_why(
    setup: &Setup,
    p: &PartialLayout,
    space: &Space,
    reject: &mut dyn FnMut(&'static str, String),
) -> Vec<Layout> {
    let mut out = Vec::new();
    let recomputes = recompute_options(p, space);
    for (d, mbs) in degree_tuples(setup, p, DEFAULT_MAX_MICRO_BATCH, reject) {
        let zeros = zero_options(p, space, d.dp);
        let sps = p.sequence_parallel_options(d.tp);
        for &micro_batch in &mbs {
            let m = setup.global_batch / (u64::from(d.dp) * micro_batch);
            let scheds = schedule_options(setup, p, space, d.pp, m, reject);
            for &zero_stage in &zeros {
                for &recompute in &recomputes {
                    for &sequence_parallel in &sps {
                        for &(schedule, interleave) in &scheds {
                            out.push(Layout {
                                dp: d.dp,
                                tp: d.tp,
                                pp: d.pp,
                                cp: d.cp,
                                ep: d.ep,
                                zero_stage,
                                micro_batch,
                                recompute,
                                sequence_parallel,
                                schedule,
                                interleave,
                                stages: Vec::new(),
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// Chooses the fastest layout that fits among the completions of `p`, any option allowed.
pub fn complete_layout(setup: &Setup, p: &PartialLayout) -> Result<Completed, CompleteError> {
    complete_within(setup, p, &Space::default())
}

/// [`complete_layout`] with the left-out knobs limited to `space`.
pub fn complete_within(
    setup: &Setup,
    p: &PartialLayout,
    space: &Space,
) -> Result<Completed, CompleteError> {
    // The first reason, preferring one about the knobs given to a tensor-parallel group too
    // wide for a node (which every search of enough devices meets).
    let (mut why, mut wide_tp) = (None, None);
    let cands = candidates_or_why(setup, p, space, &mut |kind, w| {
        if kind == TP_ACROSS_NODES {
            wide_tp.get_or_insert(w);
        } else {
            why.get_or_insert(w);
        }
    });
    let tried = cands.len();
    if cands.is_empty() {
        return Err(CompleteError::NoCandidate(why.or(wide_tp).unwrap_or_else(
            || format!("the given degrees do not divide {} devices", setup.gpus),
        )));
    }
    let model_flops =
        model_flops_per_step(setup).map_err(|e| CompleteError::NoCandidate(e.to_string()))?;
    let results: Vec<(usize, Outcome)> = cands
        .par_iter()
        .enumerate()
        .map(|(i, l)| {
            // (reason kind for the counts, full message for the error); the simulation
            // checks the layout first.
            let r = simulate_step_with_flops(setup, l, model_flops)
                .map(|s| s.prediction)
                .map_err(|e| match e {
                    StepError::Infeasible(i) => (i.kind().to_string(), i.to_string()),
                    other => ("simulation".to_string(), other.to_string()),
                });
            (i, r)
        })
        .collect();
    let mut rejected: BTreeMap<String, usize> = BTreeMap::new();
    let mut best: Option<(usize, &StepPrediction)> = None;
    let mut smallest: Option<(usize, &StepPrediction)> = None;
    let mut last_reason = String::new();
    for (i, r) in &results {
        match r {
            Ok(pred) if pred.fits => {
                if best.is_none_or(|(_, b)| pred.step_time_s < b.step_time_s) {
                    best = Some((*i, pred));
                }
            }
            Ok(pred) => {
                *rejected.entry("out of memory".to_string()).or_default() += 1;
                if smallest.is_none_or(|(_, b)| pred.peak_memory_gib < b.peak_memory_gib) {
                    smallest = Some((*i, pred));
                }
            }
            Err((kind, message)) => {
                *rejected.entry(kind.clone()).or_default() += 1;
                last_reason = message.clone();
            }
        }
    }
    match (best, smallest) {
        (Some((i, pred)), _) => Ok(Completed {
            layout: cands[i].clone(),
            prediction: pred.clone(),
            tried,
            rejected,
        }),
        (None, Some((i, pred))) => Err(CompleteError::DoesNotFit {
            need_gib: pred.peak_memory_gib,
            have_gib: pred.capacity_gib,
            layout: layout_string(&cands[i]),
            smallest: Box::new(cands[i].clone()),
        }),
        (None, None) => Err(CompleteError::NoCandidate(last_reason)),
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
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallax_hardware::preset;
    use parallax_ir::models::TransformerConfig;
    use parallax_ir::{Recompute, Schedule};

    /// Every full layout consistent with `p` on `setup`'s cluster whose left-out knobs take
    /// values in `space`.
    fn candidates(setup: &Setup, p: &PartialLayout, space: &Space) -> Vec<Layout> {
        candidates_or_why(setup, p, space, &mut |_, _| {})
    }

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
        let c = candidates(&s, &open, &full_only);
        assert!(!c.is_empty());
        assert!(c
            .iter()
            .all(|l| l.recompute != Recompute::Selective && l.zero_stage == 1));
        // A published value is what the run used, whatever the space offers.
        let given = PartialLayout::parse("tp=2,pp=2,cp=1,recompute=selective,zero=2").unwrap();
        let c = candidates(&s, &given, &full_only);
        assert!(!c.is_empty());
        assert!(c
            .iter()
            .all(|l| l.recompute == Recompute::Selective && l.zero_stage == 2));
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
        assert!(candidates(&s, &partial, &even).is_empty());
        let err = complete_within(&s, &partial, &even).unwrap_err();
        assert!(err.to_string().contains("no interleave"), "{err}");
        let uneven = Space::default();
        let mut vs: Vec<u32> = candidates(&s, &partial, &uneven)
            .iter()
            .map(|l| l.interleave)
            .collect();
        vs.sort_unstable();
        vs.dedup();
        // Every virtual stage keeps at least one layer: 4 × 7 ≤ 30 < 4 × 8.
        assert_eq!(vs, (2..=7).collect::<Vec<_>>());
        let done = complete_within(&s, &partial, &uneven).unwrap();
        assert_eq!(done.layout.schedule, Schedule::Interleaved1F1B);
    }
}
