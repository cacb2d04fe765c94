//! Units as types. Quantities that can be huge (FLOPs) or fractional (seconds) are `f64`;
//! byte counts are exact `u64`.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, Mul, Sub};

/// Wall-clock time in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Seconds(pub f64);

/// Floating-point operations (a count, not a rate).
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Flops(pub f64);

/// A size in bytes.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Bytes(pub u64);

/// A bandwidth in bytes per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BytesPerSec(pub f64);

/// Bytes in one GiB.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

impl Bytes {
    /// The size in GiB.
    pub fn gib(self) -> f64 {
        self.0 as f64 / GIB
    }
    /// A size given in GiB (rounded down to whole bytes).
    pub fn from_gib(gib: f64) -> Self {
        Bytes((gib * GIB) as u64)
    }
}

impl BytesPerSec {
    /// A bandwidth given in GB/s (10^9 bytes per second, as datasheets quote them).
    pub fn from_gbps_bytes(gb_per_s: f64) -> Self {
        BytesPerSec(gb_per_s * 1e9)
    }
    /// A bandwidth given in Gb/s (10^9 bits per second, as NICs are quoted).
    pub fn from_gbit(gbit_per_s: f64) -> Self {
        BytesPerSec(gbit_per_s * 1e9 / 8.0)
    }
}

macro_rules! float_unit {
    ($t:ident, $suffix:literal) => {
        impl Add for $t {
            type Output = $t;
            fn add(self, o: $t) -> $t {
                $t(self.0 + o.0)
            }
        }
        impl AddAssign for $t {
            fn add_assign(&mut self, o: $t) {
                self.0 += o.0;
            }
        }
        impl Sub for $t {
            type Output = $t;
            fn sub(self, o: $t) -> $t {
                $t(self.0 - o.0)
            }
        }
        impl Mul<f64> for $t {
            type Output = $t;
            fn mul(self, k: f64) -> $t {
                $t(self.0 * k)
            }
        }
        impl Div<f64> for $t {
            type Output = $t;
            fn div(self, k: f64) -> $t {
                $t(self.0 / k)
            }
        }
        impl Sum for $t {
            fn sum<I: Iterator<Item = $t>>(it: I) -> $t {
                $t(it.map(|x| x.0).sum())
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}{}", self.0, $suffix)
            }
        }
    };
}
float_unit!(Seconds, " s");
float_unit!(Flops, " FLOP");
float_unit!(BytesPerSec, " B/s");

impl Add for Bytes {
    type Output = Bytes;
    fn add(self, o: Bytes) -> Bytes {
        Bytes(self.0 + o.0)
    }
}
impl AddAssign for Bytes {
    fn add_assign(&mut self, o: Bytes) {
        self.0 += o.0;
    }
}
impl Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(it: I) -> Bytes {
        Bytes(it.map(|x| x.0).sum())
    }
}
impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2} GiB", self.gib())
    }
}

/// Bytes divided by a bandwidth is a time.
impl Div<BytesPerSec> for Bytes {
    type Output = Seconds;
    fn div(self, bw: BytesPerSec) -> Seconds {
        Seconds(self.0 as f64 / bw.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_over_bandwidth_is_seconds() {
        let t = Bytes(1_000_000_000) / BytesPerSec::from_gbps_bytes(100.0);
        assert!((t.0 - 0.01).abs() < 1e-12);
        assert_eq!(BytesPerSec::from_gbit(400.0).0, 50e9);
        assert_eq!(Bytes::from_gib(2.0).gib(), 2.0);
    }
}
