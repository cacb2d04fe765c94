//! parallax-ir: the model graph, op kinds with typed attrs, per-op work, sharding, the `Plan`
//! type and model importers.

pub mod dtype;
pub mod units;

pub use dtype::{DType, Precision};
pub use units::{Bytes, BytesPerSec, Flops, Seconds, GIB};
