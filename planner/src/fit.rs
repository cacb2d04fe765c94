//! Fitting the physical efficiency parameters of each GPU chip to published step times, and
//! writing them into the preset files (`parallax validate CASES --fit --write-presets DIR`).
//!
//! Two parameters per chip, shared by every preset built on it: the *sustained efficiency*
//! (the fraction of isolated-GEMM efficiency a training step keeps: clocks under a full power
//! load, communication kernels sharing the SMs) and, where fused-attention runs exist, the
//! attention efficiency relative to GEMMs. Nothing is fitted per case; each chip's values are
//! fitted over all of its cases at once, by coordinate descent with golden-section line
//! searches on the mean absolute percentage error.

use crate::validate::{summarize, Case, CaseResult};
use parallax_hardware::{preset, preset_names, ClusterProfile};
use rayon::prelude::*;
use serde::Serialize;

/// Chip families: presets whose device name starts with one of the prefixes share parameters.
pub const CHIPS: &[(&str, &[&str])] = &[
    ("A100", &["A100"]),
    ("H100/H200 SXM", &["H100-SXM5", "H200"]),
    ("H100 96GB 500W", &["H100-96GB"]),
    ("V100", &["V100"]),
    ("TITAN RTX", &["TITAN RTX"]),
];

/// The chip family of a profile, if any.
pub fn chip_of(p: &ClusterProfile) -> Option<&'static str> {
    CHIPS
        .iter()
        .find(|(_, prefixes)| prefixes.iter().any(|x| p.device.name.starts_with(x)))
        .map(|(c, _)| *c)
}

/// The fitted values of one chip.
#[derive(Clone, Debug, Serialize)]
pub struct ChipFit {
    pub chip: String,
    pub presets: Vec<String>,
    pub cases: usize,
    pub sustained_efficiency: f64,
    /// Fitted only when the chip has fused-attention cases.
    pub attention_efficiency_scale: Option<f64>,
    pub mape_before: f64,
    pub mape_after: f64,
    /// 90th percentile of |APE| after the fit (the step-time band).
    pub band: f64,
}

fn mape(results: &[CaseResult]) -> f64 {
    let s = summarize(results);
    // A skipped case counts as a 100 % miss, so the fit cannot win by making cases infeasible.
    (s.mape * s.n as f64 + s.skipped as f64) / (s.n + s.skipped).max(1) as f64
}

fn run(cases: &[&Case], sustained: f64, attention: Option<f64>) -> Vec<CaseResult> {
    cases
        .par_iter()
        .map(|c| {
            c.run_with(&move |p: &mut ClusterProfile| {
                p.device.sustained_efficiency = Some(sustained);
                if let Some(a) = attention {
                    p.device.attention_efficiency_scale = Some(a);
                }
            })
        })
        .collect()
}

/// Golden-section search of `f` on `[lo, hi]`.
fn golden(mut lo: f64, mut hi: f64, f: &dyn Fn(f64) -> f64) -> f64 {
    let r = (5f64.sqrt() - 1.0) / 2.0;
    let (mut a, mut b) = (hi - r * (hi - lo), lo + r * (hi - lo));
    let (mut fa, mut fb) = (f(a), f(b));
    for _ in 0..18 {
        if fa < fb {
            hi = b;
            b = a;
            fb = fa;
            a = hi - r * (hi - lo);
            fa = f(a);
        } else {
            lo = a;
            a = b;
            fa = fb;
            b = lo + r * (hi - lo);
            fb = f(b);
        }
    }
    (lo + hi) / 2.0
}

/// 90th percentile of |APE|.
pub fn band(results: &[CaseResult]) -> f64 {
    let mut apes: Vec<f64> = results.iter().filter_map(|r| r.ape).collect();
    if apes.is_empty() {
        return 0.0;
    }
    apes.sort_by(f64::total_cmp);
    let i = ((apes.len() as f64 * 0.9).ceil() as usize).clamp(1, apes.len()) - 1;
    apes[i]
}

/// Fits every chip that has cases.
pub fn fit(cases: &[Case]) -> Vec<ChipFit> {
    let mut out = Vec::new();
    for (chip, _) in CHIPS {
        let mine: Vec<&Case> = cases
            .iter()
            .filter(|c| preset(&c.cluster.preset).ok().as_ref().and_then(chip_of) == Some(*chip))
            .collect();
        let presets: Vec<String> = preset_names()
            .into_iter()
            .filter(|n| preset(n).ok().as_ref().and_then(chip_of) == Some(*chip))
            .map(String::from)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let before = mine.iter().map(|c| c.run()).collect::<Vec<_>>();
        let fused = mine.iter().any(|c| {
            crate::validate::Framework::for_source(&c.source)
                .runtime
                .fused_attention
        });
        let mut s = 0.8;
        let mut a = if fused { Some(0.8) } else { None };
        for _ in 0..if fused { 3 } else { 1 } {
            s = golden(0.3, parallax_hardware::MAX_SUSTAINED, &|x| {
                mape(&run(&mine, x, a))
            });
            if a.is_some() {
                a = Some(golden(0.2, 1.0, &|y| mape(&run(&mine, s, Some(y)))));
            }
        }
        let after = run(&mine, s, a);
        out.push(ChipFit {
            chip: chip.to_string(),
            presets,
            cases: mine.len(),
            sustained_efficiency: s,
            attention_efficiency_scale: a,
            mape_before: mape(&before),
            mape_after: mape(&after),
            band: band(&after),
        });
    }
    out
}
