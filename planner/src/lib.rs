//! parallax-planner: search over parallel layouts, ranking, reports and exports.

pub mod bounds;
pub mod complete;
pub mod ds_config;
pub mod envelope;
pub mod export;
pub mod fit;
pub mod framework;
pub mod general_cases;
pub mod plots;
pub mod report;
pub mod search;
pub mod validate;

pub use complete::{
    complete_layout, complete_or_smallest, complete_within, layout_string, CompleteError, Completed,
};
pub use search::{
    search, search_with_progress, Counts, Evaluated, Family, FamilyResult, Progress, SearchError,
    SearchOptions, SearchResult, Space,
};
pub use validate::{
    parse_cases, summarize, validate, Case, CaseResult, Framework, GeneralCase, MemoryKind,
    Summary, TransformerCase,
};
pub mod soap;
pub use soap::{
    layout_plan, plan_graph, search_ops, GraphJob, GraphPlan, SoapCounts, SoapError, SoapOptions,
    SoapResult,
};
