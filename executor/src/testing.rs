//! Helpers of the kernels' finite-difference tests.

use crate::rng::SplitMix64;

/// `n` normal draws of standard deviation `std` from the stream `seed`.
pub fn rand(n: usize, seed: u64, std: f64) -> Vec<f32> {
    let mut g = SplitMix64::for_stream(seed, "test");
    (0..n).map(|_| (g.normal() * std) as f32).collect()
}

/// Central differences (step `eps`) of the scalar `f` at the elements `at` of `x` against the
/// `analytic` gradient: each within 2 % of the numeric value, or of 0.05 where that is
/// smaller; `what` names the checked tensor in a failure.
pub fn check_grad(
    what: &str,
    x: &[f32],
    analytic: &[f32],
    at: impl IntoIterator<Item = usize>,
    eps: f32,
    mut f: impl FnMut(&[f32]) -> f64,
) {
    for i in at {
        let (mut xp, mut xm) = (x.to_vec(), x.to_vec());
        xp[i] += eps;
        xm[i] -= eps;
        let num = (f(&xp) - f(&xm)) / (2.0 * f64::from(eps));
        let a = f64::from(analytic[i]);
        assert!(
            (num - a).abs() <= 2e-2 * num.abs().max(0.05),
            "{what}[{i}]: numeric {num}, analytic {a}"
        );
    }
}
