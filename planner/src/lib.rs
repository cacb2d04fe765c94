//! Search over parallel layouts, ranking, reports and exports.
