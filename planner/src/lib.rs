//! parallax-planner: search over parallel layouts, ranking, reports and exports.

pub mod complete;
pub mod fit;
pub mod validate;

pub use complete::{
    candidates, candidates_within, complete_layout, complete_within, layout_string, CompleteError,
    Completed, Space,
};
pub use validate::{parse_cases, summarize, validate, Case, CaseResult, Framework, Summary};
