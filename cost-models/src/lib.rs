//! parallax-cost: compute, communication and memory cost of a plan on a hardware profile.

pub mod comm;
pub mod compute;
pub mod memory;
pub mod soap;
pub mod transformer;

pub use comm::{Collective, Group, Network};
pub use compute::{DeviceModel, OpTimes};
pub use memory::MemoryBreakdown;
pub use soap::{MachineView, OpCosts, ParallelConfig, TensorLayout, Transfer, TransferKind};
pub use transformer::{
    check_layout, model_flops_per_step, transformer_costs, Infeasible, PartCost, RecomputeModules,
    Runtime, SelectivePolicy, Setup, TransformerCosts,
};

/// Relative half-width of the step-time band of an uncalibrated profile: the target accuracy
/// of the cost model on published runs (max error 15 %). Calibrated profiles carry the p90 of
/// their own residuals instead (each preset's `[calibration] step_time_band`), wider or
/// narrower.
pub const UNCALIBRATED_STEP_TIME_BAND: f64 = 0.15;

/// Relative half-width of the step-time band for predictions on `profile`: the 90th
/// percentile of the absolute residuals of its calibration, when it has one.
pub fn step_time_band(profile: &parallax_hardware::ClusterProfile) -> f64 {
    profile
        .calibration
        .as_ref()
        .and_then(|c| c.step_time_band)
        .unwrap_or(UNCALIBRATED_STEP_TIME_BAND)
}

/// The band `(low, high)` around a predicted step time for relative half-width `band`.
pub fn band_range(step_time_s: f64, band: f64) -> (f64, f64) {
    (step_time_s * (1.0 - band), step_time_s * (1.0 + band))
}
