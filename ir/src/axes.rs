//! Einsum-style axes mappings and the one generic function that derives legal splits from them.
//!
//! Every op declares, for each dimension of each input and output, a label (`'b'`, `'s'`, `'k'`…)
//! and, for each label, its role (Sample / Attribute / Parameter, the S, A and P of FlexFlow's
//! SOAP space) and whether it may be split. From that alone:
//! - a label present in an output and in every input splits freely (each shard is independent);
//! - a label present in inputs but not in an output leaves that output as *partial sums*
//!   (a pending all-reduce or reduce-scatter);
//! - a label present in an output but missing from some input *replicates* that input.
//!
//! A label may stand for dimensions of different sizes in different tensors (grouped-query
//! attention has `heads` query heads but `kv_heads` key heads under one label): a degree is legal
//! when it divides every dimension the label names.

use crate::shape::Shape;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use thiserror::Error;

/// What kind of axis a label is (FlexFlow's SOAP dimensions, less Operator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AxisRole {
    /// The batch: splitting it is data parallelism.
    Sample,
    /// Sequence or spatial positions: sequence / context / spatial parallelism.
    Attribute,
    /// Channels, heads, hidden, experts, vocabulary: tensor / expert parallelism.
    Parameter,
}

/// Role and splittability of one label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AxisInfo {
    pub role: AxisRole,
    /// False where a split would need communication the mapping cannot express (the axis a
    /// softmax or norm reduces over, the time axis of a recurrence).
    pub splittable: bool,
    /// A degree that does not divide the size pads the last shard instead of being refused:
    /// every device holds ceil(size / degree), the last one fewer real elements. Vocabulary
    /// and output-feature axes (Megatron pads the vocabulary to a multiple of the
    /// tensor-parallel degree; padded weight columns compute zeros nobody reads).
    #[serde(default)]
    pub paddable: bool,
}

impl AxisInfo {
    /// An axis of `role` that pads no split.
    pub fn new(role: AxisRole, splittable: bool) -> Self {
        AxisInfo {
            role,
            splittable,
            paddable: false,
        }
    }
}

/// Labels of every dimension of an op's inputs and outputs, and what each label is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AxesMapping {
    pub inputs: Vec<Vec<char>>,
    pub outputs: Vec<Vec<char>>,
    pub axes: BTreeMap<char, AxisInfo>,
}

/// How one tensor is distributed under a split: FlexFlow's `ParallelTensorDimDegrees`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorDegrees {
    /// Number of shards along each dimension.
    pub shard: Vec<u32>,
    /// Number of partial sums that must be added to obtain the value (outputs only).
    pub sum: u32,
    /// Number of identical copies.
    pub replica: u32,
}

impl TensorDegrees {
    /// The shape of one shard.
    pub fn shard_shape(&self, full: &Shape) -> Shape {
        Shape(
            full.0
                .iter()
                .zip(&self.shard)
                .map(|(d, s)| d.div_ceil(u64::from(*s)))
                .collect(),
        )
    }
    /// Total devices this tensor is spread over (shards × sums × replicas).
    pub fn total(&self) -> u32 {
        self.shard.iter().product::<u32>() * self.sum * self.replica
    }
}

/// One legal split of an op: degrees per label and what they imply for each tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Split {
    pub degrees: BTreeMap<char, u32>,
    pub inputs: Vec<TensorDegrees>,
    pub outputs: Vec<TensorDegrees>,
}

impl Split {
    /// Devices the op runs on under this split.
    pub fn total_degree(&self) -> u32 {
        self.degrees.values().product()
    }
    /// Whether any output is left as partial sums (needs a reduction).
    pub fn has_partial_sums(&self) -> bool {
        self.outputs.iter().any(|o| o.sum > 1)
    }
}

/// Why a requested split is not legal.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SplitError {
    #[error("axis '{0}' is not part of this op")]
    UnknownAxis(char),
    #[error("axis '{0}' cannot be split")]
    NotSplittable(char),
    #[error("degree {degree} of axis '{axis}' does not divide its size {size}")]
    Indivisible { axis: char, degree: u32, size: u64 },
    #[error("degree 0 for axis '{0}'")]
    ZeroDegree(char),
    #[error("mapping has {mapping} {what} but the op has {actual}")]
    RankMismatch {
        what: &'static str,
        mapping: usize,
        actual: usize,
    },
}

impl AxesMapping {
    /// Parses `"bsk,kn->bsn"`; every label must be described in `axes`.
    ///
    /// # Panics
    /// On a malformed spec or an undescribed label: specs are written by op authors, not users.
    pub fn parse(spec: &str, axes: &[(char, AxisRole, bool)]) -> Self {
        let (ins, outs) = spec.split_once("->").expect("axes spec needs '->'");
        let side = |s: &str| -> Vec<Vec<char>> {
            if s.is_empty() {
                return Vec::new();
            }
            s.split(',').map(|t| t.chars().collect()).collect()
        };
        let m = AxesMapping {
            inputs: side(ins),
            outputs: side(outs),
            axes: axes
                .iter()
                .map(|&(c, role, splittable)| (c, AxisInfo::new(role, splittable)))
                .collect(),
        };
        for l in m.inputs.iter().chain(&m.outputs).flatten() {
            assert!(
                m.axes.contains_key(l),
                "label '{l}' of '{spec}' has no role"
            );
        }
        m
    }

    /// All labels in a fixed order.
    pub fn labels(&self) -> impl Iterator<Item = (char, AxisInfo)> + '_ {
        self.axes.iter().map(|(c, i)| (*c, *i))
    }

    /// Sizes of every dimension named by `label`.
    fn sizes<'a>(
        &'a self,
        label: char,
        ins: &'a [Shape],
        outs: &'a [Shape],
    ) -> impl Iterator<Item = u64> + 'a {
        let pick = move |labels: &'a [Vec<char>], shapes: &'a [Shape]| {
            labels.iter().zip(shapes).flat_map(move |(ls, sh)| {
                ls.iter()
                    .zip(&sh.0)
                    .filter(move |(l, _)| **l == label)
                    .map(|(_, d)| *d)
            })
        };
        pick(&self.inputs, ins).chain(pick(&self.outputs, outs))
    }

    /// Derives how every tensor is distributed when the labels are split by `degrees`.
    pub fn derive_split(
        &self,
        ins: &[Shape],
        outs: &[Shape],
        degrees: &BTreeMap<char, u32>,
    ) -> Result<Split, SplitError> {
        if ins.len() != self.inputs.len() {
            return Err(SplitError::RankMismatch {
                what: "inputs",
                mapping: self.inputs.len(),
                actual: ins.len(),
            });
        }
        if outs.len() != self.outputs.len() {
            return Err(SplitError::RankMismatch {
                what: "outputs",
                mapping: self.outputs.len(),
                actual: outs.len(),
            });
        }
        for (&axis, &degree) in degrees {
            let info = self.axes.get(&axis).ok_or(SplitError::UnknownAxis(axis))?;
            if degree == 0 {
                return Err(SplitError::ZeroDegree(axis));
            }
            if degree > 1 && !info.splittable {
                return Err(SplitError::NotSplittable(axis));
            }
            let uneven =
                |s: &u64| s % u64::from(degree) != 0 && !(info.paddable && *s >= u64::from(degree));
            if let Some(size) = self.sizes(axis, ins, outs).find(uneven) {
                return Err(SplitError::Indivisible { axis, degree, size });
            }
        }
        let total: u32 = degrees.values().product();
        let deg = |l: &char| degrees.get(l).copied().unwrap_or(1);
        let tensor = |labels: &Vec<char>, sum: u32| {
            let shard: Vec<u32> = labels.iter().map(deg).collect();
            let used = shard.iter().product::<u32>() * sum;
            TensorDegrees {
                shard,
                sum,
                replica: total / used,
            }
        };
        let inputs = self.inputs.iter().map(|l| tensor(l, 1)).collect();
        let outputs = self
            .outputs
            .iter()
            .map(|out| {
                // Labels split in the inputs but absent from this output leave partial sums.
                let sum = degrees
                    .iter()
                    .filter(|(l, _)| !out.contains(l) && self.inputs.iter().any(|i| i.contains(l)))
                    .map(|(_, d)| *d)
                    .product();
                tensor(out, sum)
            })
            .collect();
        Ok(Split {
            degrees: degrees
                .iter()
                .filter(|(_, d)| **d > 1)
                .map(|(l, d)| (*l, *d))
                .collect(),
            inputs,
            outputs,
        })
    }

    /// Every legal split whose total degree is at most `max_degree`, the unsplit one first.
    /// Degrees of each label range over the common divisors of the sizes it names, and for a
    /// paddable label also over the powers of two up to its smallest size.
    pub fn legal_splits(&self, ins: &[Shape], outs: &[Shape], max_degree: u32) -> Vec<Split> {
        let mut options: Vec<(char, Vec<u32>)> = Vec::new();
        for (label, info) in self.labels() {
            if !info.splittable {
                continue;
            }
            let g = self.sizes(label, ins, outs).fold(0u64, gcd);
            let mut divs: Vec<u32> = (2..=u64::from(max_degree).min(g))
                .filter(|d| g % d == 0)
                .map(|d| d as u32)
                .collect();
            if info.paddable {
                // Padded splits by powers of two (what engines pad a vocabulary to), up to
                // the smallest size the label names.
                let smallest = self.sizes(label, ins, outs).min().unwrap_or(0);
                let mut d = 2u64;
                while d <= u64::from(max_degree).min(smallest) {
                    if !divs.contains(&(d as u32)) {
                        divs.push(d as u32);
                    }
                    d *= 2;
                }
                divs.sort_unstable();
            }
            if !divs.is_empty() {
                options.push((label, divs));
            }
        }
        let mut out = Vec::new();
        let mut current = BTreeMap::new();
        enumerate(&options, 0, 1, max_degree, &mut current, &mut |degrees| {
            if let Ok(s) = self.derive_split(ins, outs, degrees) {
                out.push(s);
            }
        });
        out
    }
}

fn enumerate(
    options: &[(char, Vec<u32>)],
    i: usize,
    product: u32,
    max: u32,
    current: &mut BTreeMap<char, u32>,
    f: &mut dyn FnMut(&BTreeMap<char, u32>),
) {
    if i == options.len() {
        f(current);
        return;
    }
    enumerate(options, i + 1, product, max, current, f);
    let (label, divs) = &options[i];
    for &d in divs {
        if product * d > max {
            break;
        }
        current.insert(*label, d);
        enumerate(options, i + 1, product * d, max, current, f);
        current.remove(label);
    }
}

/// Greatest common divisor (gcd(0, x) = x).
pub fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use AxisRole::*;

    fn linear() -> AxesMapping {
        AxesMapping::parse(
            "bsk,kn->bsn",
            &[
                ('b', Sample, true),
                ('s', Attribute, true),
                ('k', Parameter, true),
                ('n', Parameter, true),
            ],
        )
    }

    #[test]
    fn megatron_splits_fall_out_of_the_mapping() {
        let m = linear();
        let ins = [Shape::new([8, 16, 32]), Shape::new([32, 64])];
        let outs = [Shape::new([8, 16, 64])];
        // Column parallel: input replicated, weight and output sharded on n.
        let col = m
            .derive_split(&ins, &outs, &BTreeMap::from([('n', 4)]))
            .unwrap();
        assert_eq!(col.inputs[0].replica, 4);
        assert_eq!(col.inputs[1].shard, vec![1, 4]);
        assert_eq!(col.outputs[0].shard, vec![1, 1, 4]);
        assert!(!col.has_partial_sums());
        // Row parallel: contracted k leaves partial sums.
        let row = m
            .derive_split(&ins, &outs, &BTreeMap::from([('k', 2)]))
            .unwrap();
        assert_eq!(row.outputs[0].sum, 2);
        assert_eq!(row.outputs[0].replica, 1);
        // Data parallel: weight replicated.
        let dp = m
            .derive_split(&ins, &outs, &BTreeMap::from([('b', 8)]))
            .unwrap();
        assert_eq!(dp.inputs[1].replica, 8);
        assert_eq!(dp.inputs[0].shard_shape(&ins[0]), Shape::new([1, 16, 32]));
    }

    /// A vocabulary that no degree divides (GPT-2's 50,257) splits padded: every shard holds
    /// ceil(v / degree) rows; a contraction axis still refuses an uneven degree.
    #[test]
    fn paddable_axes_split_unevenly() {
        let m = AxesMapping::parse(
            "bk,kn->bn",
            &[
                ('b', AxisRole::Sample, true),
                ('k', AxisRole::Parameter, true),
                ('n', AxisRole::Parameter, true),
            ],
        );
        let mut padded = m.clone();
        padded.axes.get_mut(&'n').unwrap().paddable = true;
        let ins = [Shape::new([8, 64]), Shape::new([64, 50257])];
        let outs = [Shape::new([8, 50257])];
        let n8 = BTreeMap::from([('n', 8)]);
        assert!(matches!(
            m.derive_split(&ins, &outs, &n8),
            Err(SplitError::Indivisible { axis: 'n', .. })
        ));
        let s = padded.derive_split(&ins, &outs, &n8).unwrap();
        assert_eq!(s.outputs[0].shard_shape(&outs[0]), Shape::new([8, 6283]));
        assert_eq!(s.inputs[1].shard_shape(&ins[1]), Shape::new([64, 6283]));
    }

    #[test]
    fn illegal_splits_are_typed_errors() {
        let m = linear();
        let ins = [Shape::new([8, 16, 30]), Shape::new([30, 64])];
        let outs = [Shape::new([8, 16, 64])];
        assert_eq!(
            m.derive_split(&ins, &outs, &BTreeMap::from([('k', 4)])),
            Err(SplitError::Indivisible {
                axis: 'k',
                degree: 4,
                size: 30
            })
        );
        assert_eq!(
            m.derive_split(&ins, &outs, &BTreeMap::from([('z', 2)])),
            Err(SplitError::UnknownAxis('z'))
        );
    }

    #[test]
    fn legal_splits_enumerates_products_within_the_limit() {
        let m = linear();
        let ins = [Shape::new([2, 4, 4]), Shape::new([4, 4])];
        let outs = [Shape::new([2, 4, 4])];
        let splits = m.legal_splits(&ins, &outs, 4);
        assert!(splits.iter().all(|s| s.total_degree() <= 4));
        assert_eq!(splits[0].total_degree(), 1);
        // b∈{1,2}, s,k,n∈{1,2,4}; count products ≤ 4.
        let mut n = 0;
        for b in [1, 2] {
            for s in [1, 2, 4] {
                for k in [1, 2, 4] {
                    for nn in [1, 2, 4] {
                        if b * s * k * nn <= 4 {
                            n += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(splits.len(), n);
    }
}
