//! Built-in model definitions.

pub mod transformer;
pub mod zoo;

pub use transformer::{BuildOptions, Mlp, MoeConfig, Norm, Position, TransformerConfig};
