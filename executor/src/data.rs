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

/// Positions in a thousand BERT's masked-LM recipe chooses (Devlin et al. 2019, §3.1: 15 %).
pub const MLM_PERMILLE: u64 = 150;

/// The hash that decides BERT's masking of position `pos` of global sequence `sample` at
/// `step` (`u64::MAX`: the sequence's next-sentence label): the same on every rank, whatever
/// part of the sequence it holds.
fn mlm_hash(seed: u64, step: u64, sample: u64, pos: u64) -> u64 {
    use crate::rng::mix;
    mix(mix(mix(mix(seed ^ 0x6d6c_6d00) ^ step) ^ sample) ^ pos)
}

/// Whether BERT's recipe masks that position, with the hash's rest for what it reads.
fn mlm_masked(seed: u64, step: u64, sample: u64, pos: usize) -> Option<u64> {
    let h = mlm_hash(seed, step, sample, pos as u64);
    (h % 1000 < MLM_PERMILLE).then_some(h / 1000)
}

/// BERT's masked-LM inputs and targets from a micro-batch's `tokens` (`batch` sequences of
/// `seq` from global sequence `first`): a chosen position's target is its token and its input
/// the mask token (`vocab − 1`) 80 % of the time, a random token 10 %, itself 10 %; the other
/// positions have no target ([`crate::tensor::IGNORE`]).
pub fn mask_for_mlm(
    tokens: &mut [u32],
    (seed, step, first): (u64, u64, u64),
    seq: usize,
    vocab: usize,
) -> Vec<u32> {
    let mut targets = vec![crate::tensor::IGNORE; tokens.len()];
    for (i, (t, y)) in tokens.iter_mut().zip(&mut targets).enumerate() {
        let (sample, pos) = (first + (i / seq) as u64, i % seq);
        if let Some(r) = mlm_masked(seed, step, sample, pos) {
            *y = *t;
            *t = match r % 10 {
                0..=7 => (vocab - 1) as u32,
                8 => ((r / 10) % vocab as u64) as u32,
                _ => *t,
            };
        }
    }
    targets
}

/// Masked positions in the first `batch` sequences at `step`: the masked-LM loss's mean is
/// over them.
pub fn mlm_targets(seed: u64, step: u64, batch: u64, seq: usize) -> usize {
    (0..batch)
        .map(|s| {
            (0..seq)
                .filter(|p| mlm_masked(seed, step, s, *p).is_some())
                .count()
        })
        .sum()
}

/// The next-sentence label of global sequence `sample` at `step` (0: B follows A).
pub fn nsp_label(seed: u64, step: u64, sample: u64) -> u32 {
    (mlm_hash(seed, step, sample, u64::MAX) & 1) as u32
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

    /// BERT's masking: about 15 % of the positions carry a target (their own token), most of
    /// them read the mask token; the count of a batch is the targets' count.
    #[test]
    fn mlm_masking_follows_the_recipe() {
        let (seq, batch, vocab) = (128, 64, 1000);
        let (tokens, _) = micro_batch(&DataSource::Synthetic, 3, 5, 0, batch, seq, vocab);
        let mut inputs = tokens.clone();
        let targets = mask_for_mlm(&mut inputs, (3, 5, 0), seq, vocab);
        let masked: Vec<usize> = (0..targets.len())
            .filter(|i| targets[*i] != crate::tensor::IGNORE)
            .collect();
        let share = masked.len() as f64 / targets.len() as f64;
        assert!((0.13..0.17).contains(&share), "{share}");
        assert!(masked.iter().all(|i| targets[*i] == tokens[*i]));
        let mask_token = masked.iter().filter(|i| inputs[**i] == 999).count();
        let share = mask_token as f64 / masked.len() as f64;
        assert!((0.74..0.86).contains(&share), "{share}");
        assert_eq!(mlm_targets(3, 5, batch as u64, seq), masked.len());
        let labels: u32 = (0..1000).map(|s| nsp_label(3, 5, s)).sum();
        assert!((400..600).contains(&labels), "{labels}");
    }
}
