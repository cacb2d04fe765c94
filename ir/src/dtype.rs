//! Element types of tensors and the training precision of a run.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
    F8,
    I64,
    I32,
    U8,
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8 | DType::U8 | DType::Bool => 1,
            DType::I64 => 8,
        }
    }

    /// Whether elements are floating point (and so take the training precision's size).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F8)
    }
}

/// Precision a model is trained in: which dense peak of the device applies and how many bytes
/// activations and working weights take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// IEEE fp32 on the fp32 pipes.
    Fp32,
    /// fp32 storage, TF32 tensor-core math.
    Tf32,
    /// fp16 mixed precision (fp32 master weights).
    Fp16,
    /// bf16 mixed precision (fp32 master weights).
    Bf16,
    /// fp8 matmuls with bf16 activations elsewhere (Transformer Engine / torchao style).
    Fp8,
}

impl Precision {
    /// All precisions, in the order profiles list their peaks.
    pub const ALL: [Precision; 5] = [
        Precision::Fp32,
        Precision::Tf32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::Fp8,
    ];

    /// Element type of activations and working (compute) weights.
    pub fn activation_dtype(self) -> DType {
        match self {
            Precision::Fp32 | Precision::Tf32 => DType::F32,
            Precision::Fp16 => DType::F16,
            Precision::Bf16 | Precision::Fp8 => DType::BF16,
        }
    }

    /// Whether training keeps a separate fp32 master copy of the weights (mixed precision).
    pub fn is_mixed(self) -> bool {
        !matches!(self, Precision::Fp32 | Precision::Tf32)
    }

    /// The lowercase name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                format!("unknown precision '{s}' (expected fp32, tf32, fp16, bf16 or fp8)")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_round_trips_through_its_name() {
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>().unwrap(), p);
        }
        assert!("fp64".parse::<Precision>().is_err());
        assert_eq!(Precision::Bf16.activation_dtype().size_bytes(), 2);
    }
}
