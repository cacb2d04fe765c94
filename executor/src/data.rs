//! Training data: synthetic token sequences, or byte-level windows of a text file. Which
//! sequences a step trains on depends only on the seed, the step number and the sequence's
//! index in the global batch, so every layout (and a resumed run) sees the same data.

use crate::rng::SplitMix64;
use std::sync::Arc;

/// Where tokens come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    /// Learnable synthetic sequences: each is an arithmetic progression modulo the vocabulary
    /// with a random start and a random stride in `1..=SYNTHETIC_MAX_STRIDE`, so a model can
    /// drive the loss well below `ln(vocab)` by reading the stride from context.
    Synthetic,
    /// The bytes of a text file (vocabulary 256); each sequence is a window at a random offset.
    Bytes(Arc<Vec<u8>>),
}

/// Largest stride of the synthetic progressions.
pub const SYNTHETIC_MAX_STRIDE: u64 = 7;

impl DataSource {
    /// Checks that the source fits the model and sequence length.
    pub fn check(&self, vocab: usize, seq: usize) -> Result<(), String> {
        match self {
            DataSource::Synthetic => Ok(()),
            DataSource::Bytes(b) => {
                if vocab < 256 {
                    return Err(format!(
                        "byte-level training needs a vocabulary of at least 256, the model has {vocab}"
                    ));
                }
                if b.len() < seq + 2 {
                    return Err(format!(
                        "the text has {} bytes, fewer than one sequence of {} tokens plus its target",
                        b.len(),
                        seq
                    ));
                }
                Ok(())
            }
        }
    }

    /// The `seq + 1` tokens of sequence `index` of the global batch of `step` (inputs are the
    /// first `seq`, targets the last `seq`).
    pub fn sequence(&self, seed: u64, step: u64, index: u64, seq: usize, vocab: usize) -> Vec<u32> {
        let mut g = SplitMix64::new(
            seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ index.wrapping_mul(0xc2b2_ae3d_27d4_eb4f),
        );
        g.next_u64();
        match self {
            DataSource::Synthetic => {
                let v = vocab as u64;
                let start = g.below(v);
                let stride = 1 + g.below(SYNTHETIC_MAX_STRIDE.min(v.max(2) - 1));
                (0..=seq as u64)
                    .map(|i| ((start + i * stride) % v) as u32)
                    .collect()
            }
            DataSource::Bytes(b) => {
                let span = (b.len() - seq - 1) as u64;
                let off = g.below(span + 1) as usize;
                b[off..off + seq + 1]
                    .iter()
                    .map(|x| u32::from(*x))
                    .collect()
            }
        }
    }
}

/// Inputs and targets of one micro-batch: `batch` sequences starting at global index `first`,
/// flattened sequence-major (`batch · seq` each).
pub fn micro_batch(
    src: &DataSource,
    seed: u64,
    step: u64,
    first: u64,
    batch: usize,
    seq: usize,
    vocab: usize,
) -> (Vec<u32>, Vec<u32>) {
    let mut inputs = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for i in 0..batch as u64 {
        let s = src.sequence(seed, step, first + i, seq, vocab);
        inputs.extend_from_slice(&s[..seq]);
        targets.extend_from_slice(&s[1..]);
    }
    (inputs, targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_are_deterministic_and_in_range() {
        let s = DataSource::Synthetic;
        let a = s.sequence(1, 2, 3, 16, 64);
        assert_eq!(a, s.sequence(1, 2, 3, 16, 64));
        assert_ne!(a, s.sequence(1, 2, 4, 16, 64));
        assert_eq!(a.len(), 17);
        assert!(a.iter().all(|t| *t < 64));
        let text = DataSource::Bytes(Arc::new(b"hello world, hello parallax".to_vec()));
        assert!(text.check(256, 8).is_ok());
        assert!(text.check(64, 8).unwrap_err().contains("256"));
        assert!(text.check(256, 100).unwrap_err().contains("bytes"));
        let (x, y) = micro_batch(&text, 0, 0, 0, 2, 8, 256);
        assert_eq!(x.len(), 16);
        assert_eq!(x[1..8], y[..7]);
    }
}
