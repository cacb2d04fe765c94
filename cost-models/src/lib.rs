//! parallax-cost: compute, communication and memory cost of a plan on a hardware profile.

pub mod comm;
pub mod compute;
pub mod memory;
pub mod transformer;

pub use comm::{Collective, Group, Network};
pub use compute::{DeviceModel, OpTimes};
pub use memory::MemoryBreakdown;
pub use transformer::{
    check_layout, transformer_costs, Infeasible, PartCost, Runtime, Setup, TransformerCosts,
};
