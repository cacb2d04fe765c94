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

/// How fp8 training scales a tensor before casting it: what the casts around each fp8 GEMM
/// cost and whether tensor-parallel gathers move fp8 (`--fp8-recipe`; the names are Megatron's
/// `--fp8-recipe` and torchao's `Float8LinearConfig.from_recipe_name`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Fp8Recipe {
    /// One scale per tensor from its amax history of earlier steps (Transformer Engine's
    /// `DelayedScaling`, its default through 1.x; NeMo and Megatron-Core until 2025).
    Delayed,
    /// One scale per tensor from its current absolute maximum (Transformer Engine's
    /// `Float8CurrentScaling`, Megatron's `tensorwise`, Megatron-Bridge's `fp8_cs`; torchao's
    /// `tensorwise`, torchtitan's default).
    #[default]
    #[serde(alias = "current")]
    Tensorwise,
    /// One scale per row of each GEMM operand along its reduction dimension (torchao's
    /// `rowwise`): every operand is cast twice, once per GEMM that reduces along a different
    /// axis.
    Rowwise,
    /// One scale per 1 × 128 tile of activations and gradients and per 128 × 128 block of
    /// weights (DeepSeek-V3's recipe; Transformer Engine's `Float8BlockScaling`, Megatron's
    /// `blockwise`).
    Blockwise,
}

impl Fp8Recipe {
    pub const ALL: [Fp8Recipe; 4] = [
        Fp8Recipe::Delayed,
        Fp8Recipe::Tensorwise,
        Fp8Recipe::Rowwise,
        Fp8Recipe::Blockwise,
    ];

    /// The lowercase name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            Fp8Recipe::Delayed => "delayed",
            Fp8Recipe::Tensorwise => "tensorwise",
            Fp8Recipe::Rowwise => "rowwise",
            Fp8Recipe::Blockwise => "blockwise",
        }
    }

    /// The recipe a publication names in free text (a validation case's `fp8_recipe`:
    /// "fp8-cs (per-tensor current scaling; …)", "rowwise", "DeepSeek blockwise"), by its first
    /// word; `None` where the text names none ("fp8, recipe unpublished").
    pub fn from_published(text: &str) -> Option<Fp8Recipe> {
        let first = text
            .split(|c: char| c.is_whitespace() || c == ',' || c == '(' || c == ';')
            .find(|w| !w.is_empty())?
            .to_ascii_lowercase();
        match first.as_str() {
            "fp8-cs" | "fp8_cs" | "cs" | "current" | "tensorwise" | "per-tensor" => {
                Some(Fp8Recipe::Tensorwise)
            }
            "delayed" | "fp8-ds" | "fp8_ds" => Some(Fp8Recipe::Delayed),
            "rowwise" | "row-wise" => Some(Fp8Recipe::Rowwise),
            "blockwise" | "block-wise" | "fp8-ss" | "fp8_ss" | "fp8-blockwise" => {
                Some(Fp8Recipe::Blockwise)
            }
            _ => None,
        }
    }

    /// Whether tensor-parallel all-gathers move the GEMM inputs already cast to fp8: a
    /// per-tensor or per-block scale survives the gather (Transformer Engine gathers its fp8
    /// tensors, torchao's `Float8ColwiseParallel` casts before it gathers); torchao's rowwise
    /// scales run along the gathered sequence, so its TP gathers stay 16-bit and each rank
    /// casts the whole gathered tensor (torchtitan enables float8 TP only for tensorwise).
    pub fn gathers_fp8(self) -> bool {
        self != Fp8Recipe::Rowwise
    }
}

impl fmt::Display for Fp8Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fp8Recipe {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.trim().to_ascii_lowercase();
        if lower == "current" {
            return Ok(Fp8Recipe::Tensorwise);
        }
        Fp8Recipe::ALL
            .into_iter()
            .find(|r| r.name() == lower)
            .ok_or_else(|| {
                let hint = if lower == "mxfp8" {
                    " (mxfp8 needs Blackwell's block-scaled tensor cores; no preset has them)"
                } else {
                    ""
                };
                format!(
                    "unknown fp8 recipe '{}'{hint} (expected delayed, tensorwise, rowwise or blockwise)",
                    s.chars().take(40).collect::<String>()
                )
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

    #[test]
    fn fp8_recipes_parse_by_name_and_from_published_text() {
        for r in Fp8Recipe::ALL {
            assert_eq!(r.name().parse::<Fp8Recipe>().unwrap(), r);
        }
        assert_eq!("current".parse::<Fp8Recipe>(), Ok(Fp8Recipe::Tensorwise));
        assert!("mxfp8"
            .parse::<Fp8Recipe>()
            .unwrap_err()
            .contains("Blackwell"));
        let published = |t| Fp8Recipe::from_published(t);
        assert_eq!(
            published("fp8-cs (per-tensor current scaling; table 'FP8-CS')"),
            Some(Fp8Recipe::Tensorwise)
        );
        assert_eq!(published("rowwise"), Some(Fp8Recipe::Rowwise));
        assert_eq!(published("blockwise 1x128"), Some(Fp8Recipe::Blockwise));
        assert_eq!(published("fp8, recipe unpublished (…)"), None);
        assert!(!Fp8Recipe::Rowwise.gathers_fp8() && Fp8Recipe::Blockwise.gathers_fp8());
    }
}
