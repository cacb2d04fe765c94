//! Built-in model definitions.

pub mod amoebanet;
pub mod classic;
pub mod cnn;
pub mod dlrm;
pub mod gnmt;
pub mod resnet;
pub mod rnn;
pub mod transformer;
pub mod unet;
pub mod vision;
pub mod zoo;

pub use transformer::{
    BuildOptions, HybridConfig, LayerKind, LayerStack, MambaConfig, MlaConfig, Mlp, MoeConfig,
    Norm, Position, Router, Section, SlidingWindow, TransformerConfig,
};
