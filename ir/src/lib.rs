//! parallax-ir: the model graph, op kinds with typed attrs, per-op work, sharding, the `Plan`
//! type and model importers.

pub mod dtype;
pub mod units;

pub use dtype::{DType, Fp8Recipe, Precision};
pub use units::{Bytes, BytesPerSec, Flops, Seconds, GIB};
pub mod axes;
pub mod op;
pub mod shape;

pub use axes::{AxesMapping, AxisInfo, AxisRole, Split, SplitError, TensorDegrees};
pub use op::{ComputeClass, OpKind, Saved, ShapeError, Work};
pub use shape::Shape;
pub mod graph;
pub use graph::{
    Graph, GraphBuilder, GraphError, Node, NodeId, SavedItem, Segment, Tensor, TensorId, TensorRole,
};
pub mod models;
pub mod plan;
pub use plan::{
    BatchNormStats, Dispatcher, Layout, Offload, PartialLayout, Plan, Recompute, RecomputeModules,
    Schedule, StageRange, PLAN_SCHEMA,
};
pub mod load;
pub use load::{load_model, Model, ModelError, ModelKind, MAX_GLOBAL_BATCH, MAX_SEQ};
pub mod import;
