//! Event-driven simulator of one training step.
//!
//! - [`engine`]: the pure simulation core, `simulate(&TaskGraph, costs, &Resources) -> Trace`,
//!   plus trace analysis (busy time, critical path, per-kind totals, Chrome/Perfetto export).
//! - [`schedule`]: pipeline schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1) as per-stage op
//!   lists, their in-flight activation counts, and their translation into a task graph.

pub mod engine;
pub mod schedule;

pub use engine::{
    simulate, CommKind, Dependency, Edge, EdgeFilter, Resource, ResourceId, Resources, SimError,
    Span, Task, TaskGraph, TaskId, TaskKind, TaskRef, Trace,
};
pub use schedule::{
    build_pipeline, build_pipeline_with, max_in_flight, merged_fraction, simulate_schedule, Flow,
    Op, OpContext, OpSpan, OpTasks, PipelineCosts, PipelineGraph, PipelineSchedule, ScheduleError,
    ScheduleKind, ScheduledOp,
};
pub mod step;
pub use step::{
    accounted_layers, pass_costs, simulate_priced, simulate_step, simulate_step_with_flops,
    stage_layers, stage_memory_of, step_terms, virtual_stage_params, Breakdown, MemoryGib,
    SimulatedStep, StepError, StepPrediction, StepTerms,
};
pub mod perop;
pub use perop::{
    simulate_op_plan, DeltaCounts, DeltaSimulator, OpPlan, OpStepError, OpStepPrediction,
    SimulatedOpStep,
};
