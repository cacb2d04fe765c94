//! Efficiency curves: tables of (size, achieved fraction of peak), interpolated log-linearly.

use serde::{Deserialize, Serialize};

/// A table of `(size, efficiency)` points, sorted by strictly increasing size, each efficiency in
/// `(0, 1]`. In a profile it is written as an array of pairs:
/// `matmul_efficiency = [[1e9, 0.35], [1e11, 0.7], [1e12, 0.85]]`.
///
/// [`EfficiencyCurve::at`] interpolates linearly in `log10(size)` between neighbouring points and
/// clamps to the first / last efficiency outside the table. Validation happens in
/// [`crate::ClusterProfile::validate`], which names the offending entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EfficiencyCurve(pub Vec<(f64, f64)>);

impl EfficiencyCurve {
    /// The efficiency at `size`, log-linearly interpolated and clamped to the table's ends.
    /// Returns 1.0 for an empty table (which validation rejects) and treats non-positive or
    /// non-finite sizes as smaller than every entry.
    pub fn at(&self, size: f64) -> f64 {
        let pts = &self.0;
        let (Some(first), Some(last)) = (pts.first(), pts.last()) else {
            return 1.0;
        };
        if !(size.is_finite() && size > 0.0) || size <= first.0 {
            return first.1;
        }
        if size >= last.0 {
            return last.1;
        }
        let x = size.log10();
        for w in pts.windows(2) {
            let (s0, e0) = w[0];
            let (s1, e1) = w[1];
            if size <= s1 {
                let (x0, x1) = (s0.log10(), s1.log10());
                if x1 <= x0 {
                    return e1;
                }
                let t = (x - x0) / (x1 - x0);
                return e0 + t * (e1 - e0);
            }
        }
        last.1
    }

    /// The highest efficiency in the table (the large-size plateau for a sensible curve).
    pub fn max(&self) -> f64 {
        self.0.iter().map(|p| p.1).fold(0.0, f64::max)
    }

    /// Checks the table; on failure returns `(index or None, problem)`.
    pub(crate) fn check(&self) -> Result<(), (Option<usize>, String)> {
        if self.0.is_empty() {
            return Err((
                None,
                "must have at least one [size, efficiency] point".into(),
            ));
        }
        for (i, &(s, e)) in self.0.iter().enumerate() {
            if !(s.is_finite() && s > 0.0) {
                return Err((Some(i), format!("size must be a positive number, got {s}")));
            }
            if !(e.is_finite() && e > 0.0 && e <= 1.0) {
                return Err((
                    Some(i),
                    format!("efficiency must satisfy 0 < efficiency <= 1, got {e}"),
                ));
            }
            if i > 0 && s <= self.0[i - 1].0 {
                return Err((
                    Some(i),
                    format!(
                        "sizes must be sorted in strictly increasing order, but {s} follows {}",
                        self.0[i - 1].0
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve() -> EfficiencyCurve {
        EfficiencyCurve(vec![(1e9, 0.35), (1e11, 0.7), (1e12, 0.85)])
    }

    #[test]
    fn interpolates_in_log_size() {
        let c = curve();
        assert!((c.at(1e10) - 0.525).abs() < 1e-12, "halfway in log10");
        assert!((c.at(1e11) - 0.7).abs() < 1e-12);
        assert!((c.at(10f64.powf(11.5)) - 0.775).abs() < 1e-12);
    }

    #[test]
    fn clamps_outside_the_table() {
        let c = curve();
        assert_eq!(c.at(1.0), 0.35);
        assert_eq!(c.at(0.0), 0.35);
        assert_eq!(c.at(f64::NAN), 0.35);
        assert_eq!(c.at(1e15), 0.85);
        assert_eq!(c.max(), 0.85);
    }

    #[test]
    fn is_monotone_for_a_monotone_table() {
        let c = curve();
        let mut prev = 0.0;
        for k in 0..80 {
            let e = c.at(10f64.powf(8.0 + k as f64 * 0.06));
            assert!(e >= prev);
            prev = e;
        }
    }

    #[test]
    fn check_names_bad_entries() {
        assert_eq!(
            EfficiencyCurve(vec![(1e9, 0.3), (1e8, 0.5)])
                .check()
                .unwrap_err()
                .0,
            Some(1)
        );
        assert_eq!(
            EfficiencyCurve(vec![(1e9, 1.2)]).check().unwrap_err().0,
            Some(0)
        );
        assert!(EfficiencyCurve(vec![]).check().is_err());
        assert!(curve().check().is_ok());
    }
}
