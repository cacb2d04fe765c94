//! A small deterministic random number generator (SplitMix64, Steele et al. 2014) for parameter
//! initialisation and synthetic data. Chosen over a crate so that streams are fixed by this
//! file alone: the same seed gives the same model and tokens on every backend and release.

/// SplitMix64's output function of one state `z` (a stateless hash: the first draw of
/// [`SplitMix64::new`]`(z)`), for values keyed by an index rather than drawn in order.
pub fn mix(z: u64) -> u64 {
    SplitMix64::new(z).next_u64()
}

/// SplitMix64: 64 bits of state, passes BigCrush, one add and three xor-shift-multiplies per draw.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// A generator for a named stream (e.g. one parameter tensor) under a seed: the name is
    /// hashed (FNV-1a) and mixed with the seed, so streams do not depend on creation order.
    pub fn for_stream(seed: u64, name: &str) -> Self {
        let mut g = SplitMix64::new(seed ^ fnv1a64(name.as_bytes()));
        g.next_u64();
        g
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[0, n)` (`n > 0`; multiply-shift, bias below 2^-32 for small `n`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A standard normal draw (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// The 64-bit FNV-1a hash of `bytes`.
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| SplitMix64::new(7).next_u64()).collect();
        assert!(a.iter().all(|x| *x == a[0]));
        let mut s1 = SplitMix64::for_stream(1, "layers.0.attn.wq");
        let mut s2 = SplitMix64::for_stream(1, "layers.1.attn.wq");
        assert_ne!(s1.next_u64(), s2.next_u64());
        let mut g = SplitMix64::new(3);
        let n = 20_000;
        let (mut sum, mut sq) = (0.0, 0.0);
        for _ in 0..n {
            let x = g.normal();
            sum += x;
            sq += x * x;
        }
        let mean = sum / f64::from(n);
        assert!(mean.abs() < 0.03, "{mean}");
        assert!((sq / f64::from(n) - 1.0).abs() < 0.05);
        assert!((0..1000).all(|_| g.below(10) < 10));
    }
}
