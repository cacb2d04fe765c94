//! parallax-cost: compute, communication and memory cost of a plan on a hardware profile.

pub mod comm;
pub mod compute;

pub use comm::{Collective, Group, Network};
pub use compute::{DeviceModel, OpTimes};
