//! Fitting the physical efficiency parameters of each GPU chip to published step times, and
//! writing them into the preset files (`parallax validate CASES --fit --write-presets DIR`).
//!
//! Two parameters per chip, shared by every preset built on it: the *sustained efficiency*
//! (the fraction of isolated-GEMM efficiency a training step keeps: clocks under a full power
//! load, communication kernels sharing the SMs) and, where fused-attention runs exist, the
//! attention efficiency relative to GEMMs. Nothing is fitted per case; each chip's values are
//! fitted over all of its cases at once, minimizing the mean absolute percentage error: the
//! best point of a coarse grid, refined by coordinate descent with golden-section line searches
//! within one grid step of it.

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
    ("P100", &["P100"]),
    ("P40", &["P40"]),
    ("K80", &["K80"]),
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

/// Where the sustained efficiency is searched (the profile's bounds).
const SUSTAINED_RANGE: (f64, f64) = (0.3, parallax_hardware::MAX_SUSTAINED);
/// Where the attention efficiency scale is searched.
const ATTENTION_RANGE: (f64, f64) = (0.2, 1.0);
/// Spacing of the coarse grid.
const GRID_STEP: f64 = 0.05;

/// Points `GRID_STEP` apart from `lo` to `hi`.
fn grid((lo, hi): (f64, f64)) -> Vec<f64> {
    let n = ((hi - lo) / GRID_STEP).round() as usize;
    (0..=n).map(|i| lo + GRID_STEP * i as f64).collect()
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
            .filter(|c| preset(c.preset()).ok().as_ref().and_then(chip_of) == Some(*chip))
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
        let fused = mine.iter().any(|c| c.fused_attention());
        // The error jumps where a layout choice flips, so it has local minima: a coarse grid
        // first, then line searches within one grid step of its best point.
        let objective = |s: f64, a: Option<f64>| mape(&run(&mine, s, a));
        let sustained_grid = grid(SUSTAINED_RANGE);
        let attention_grid: Vec<Option<f64>> = if fused {
            grid(ATTENTION_RANGE).into_iter().map(Some).collect()
        } else {
            vec![None]
        };
        let points: Vec<(f64, Option<f64>)> = sustained_grid
            .iter()
            .flat_map(|&s| attention_grid.iter().map(move |&a| (s, a)))
            .collect();
        let (mut s, mut a) = points
            .iter()
            .map(|&(s, a)| (objective(s, a), s, a))
            .min_by(|x, y| x.0.total_cmp(&y.0))
            .map(|(_, s, a)| (s, a))
            .expect("a non-empty grid");
        let near =
            |x: f64, (lo, hi): (f64, f64)| ((x - GRID_STEP).max(lo), (x + GRID_STEP).min(hi));
        for _ in 0..if fused { 3 } else { 1 } {
            let (lo, hi) = near(s, SUSTAINED_RANGE);
            s = golden(lo, hi, &|x| objective(x, a));
            if let Some(y) = a {
                let (lo, hi) = near(y, ATTENTION_RANGE);
                a = Some(golden(lo, hi, &|y| objective(s, Some(y))));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_search_grid_and_band() {
        let x = golden(0.2, 1.0, &|x| (x - 0.37).powi(2));
        assert!((x - 0.37).abs() < 1e-3, "{x}");
        let g = grid(SUSTAINED_RANGE);
        assert_eq!(g.len(), 21);
        assert!(
            (g[0] - 0.3).abs() < 1e-12 && (g[20] - parallax_hardware::MAX_SUSTAINED).abs() < 1e-9
        );
        let results: Vec<CaseResult> = (1..=10)
            .map(|i| CaseResult {
                ape: Some(f64::from(i) / 100.0),
                ..CaseResult::default()
            })
            .collect();
        // The 9th of 10 errors: 90 % of the cases lie within the band.
        assert_eq!(band(&results), 0.09);
    }

    /// The checked-in presets are what the calibration command writes: refitting the two
    /// TITAN RTX runs of public.json gives the preset's value back.
    #[test]
    fn the_presets_are_the_fit_of_the_published_runs() {
        let cases = crate::validate::ground_truth("public.json");
        let titan: Vec<Case> = cases
            .into_iter()
            .filter(|c| c.preset().starts_with("titan-rtx"))
            .collect();
        assert_eq!(titan.len(), 2);
        let fits = fit(&titan);
        assert_eq!(fits.len(), 1);
        let f = &fits[0];
        assert_eq!(f.chip, "TITAN RTX");
        let preset = parallax_hardware::preset("titan-rtx-2x-pcie").unwrap();
        let written = preset.device.sustained_efficiency.unwrap();
        assert!(
            (f.sustained_efficiency - written).abs() < 1e-3,
            "fit {} against preset {written}: run `parallax validate ../shared/ground-truth/public.json --fit --write-presets hardware-profiles/profiles`",
            f.sustained_efficiency
        );
        assert!(f.mape_after <= f.mape_before + 1e-12);
    }
}
