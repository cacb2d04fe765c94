//! Tensor shapes.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Dimensions of a tensor, outermost first. A scalar has no dimensions.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Shape(pub Vec<u64>);

impl Shape {
    /// A shape from its dimensions.
    pub fn new(dims: impl Into<Vec<u64>>) -> Self {
        Shape(dims.into())
    }
    /// A scalar.
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements (1 for a scalar).
    pub fn elems(&self) -> u64 {
        self.0.iter().product()
    }
    /// The dimensions.
    pub fn dims(&self) -> &[u64] {
        &self.0
    }
    /// The last dimension (1 for a scalar).
    pub fn last(&self) -> u64 {
        self.0.last().copied().unwrap_or(1)
    }
    /// Dimension `i`; negative indexes count from the end.
    pub fn dim(&self, i: isize) -> Option<u64> {
        let r = self.0.len() as isize;
        let i = if i < 0 { r + i } else { i };
        (0..r).contains(&i).then(|| self.0[i as usize])
    }
    /// Product of all dimensions but the last (the "rows" of a matmul input).
    pub fn leading_elems(&self) -> u64 {
        self.0.iter().rev().skip(1).product()
    }
    /// A copy with the last dimension replaced.
    pub fn with_last(&self, last: u64) -> Shape {
        let mut d = self.0.clone();
        match d.last_mut() {
            Some(x) => *x = last,
            None => d.push(last),
        }
        Shape(d)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

impl From<Vec<u64>> for Shape {
    fn from(v: Vec<u64>) -> Self {
        Shape(v)
    }
}

impl<const N: usize> From<[u64; N]> for Shape {
    fn from(v: [u64; N]) -> Self {
        Shape(v.to_vec())
    }
}
