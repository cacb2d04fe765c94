//! Model importers: turn a model description from outside into an [`crate::Graph`].

pub mod onnx;
mod onnx_proto;

use thiserror::Error;

/// Why a model could not be imported. Every message is one line naming the file.
#[derive(Debug, Error)]
pub enum ImportError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// The ONNX model is malformed or uses something the importer does not support.
    #[error("{file}: {message}")]
    Onnx { file: String, message: String },
    /// The ONNX graph uses op types the importer does not map (all of them, sorted).
    #[error(
        "{file}: unsupported ONNX op types: {} (supported: {})",
        ops.join(", "),
        onnx::SUPPORTED_ONNX_OPS.join(", ")
    )]
    OnnxUnsupportedOps { file: String, ops: Vec<String> },
}
