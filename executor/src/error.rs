//! Errors of the executor.

use crate::comm::CommError;
use thiserror::Error;

/// Why a run could not start or did not finish. Messages are one line and name the field,
/// file or rank concerned.
#[derive(Debug, Error)]
pub enum ExecError {
    /// The model cannot be run by this executor.
    #[error("model: {0}")]
    Model(String),
    /// The layout is invalid for the model, batch or executor.
    #[error("layout: {0}")]
    Layout(String),
    /// A communication failure (timeout, failed peer).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A rank failed for another reason (a panic, an injected fault).
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The rank.
        rank: usize,
        /// What happened.
        message: String,
    },
    /// The loss stopped being a finite number: training diverged. Nothing is saved at or after
    /// this step, so the last checkpoint written holds finite parameters.
    #[error("step {step}: loss is {loss} (parameters diverged; a lower learning rate may help); no checkpoint was written for this step")]
    Diverged {
        /// The 1-based global step whose loss is not finite.
        step: u64,
        /// The loss (NaN or infinite).
        loss: f64,
    },
    /// The training data is unusable.
    #[error("data: {0}")]
    Data(String),
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint directory or file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The checkpoint to resume from is not one of this model (a tensor missing, extra or of
    /// another shape).
    #[error("resume: {0}")]
    Resume(String),
    /// A backend is compiled in but cannot run here (library missing, already initialised).
    #[error("{backend} backend: {message}")]
    Backend {
        /// The backend.
        backend: &'static str,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A backend that this build does not include.
    #[error(
        "the {backend} backend is not compiled in: rebuild with `cargo build --features {feature}`"
    )]
    NotCompiled {
        /// The backend asked for.
        backend: &'static str,
        /// The cargo feature that enables it.
        feature: &'static str,
    },
}
