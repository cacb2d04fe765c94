//! parallax-planner: search over parallel layouts, ranking, reports and exports.

pub mod complete;
pub mod validate;

pub use complete::{candidates, complete_layout, layout_string, CompleteError, Completed};
pub use validate::{parse_cases, summarize, validate, Case, CaseResult, Summary};
