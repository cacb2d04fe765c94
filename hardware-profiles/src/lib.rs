//! parallax-hardware: cluster description types, the TOML profile loader with validation, and
//! the built-in presets (`profiles/*.toml`).
//!
//! ```
//! use parallax_hardware::Cluster;
//! use parallax_ir::Precision;
//!
//! let c = Cluster::parse("dgx-a100-80gb:gpus=1024").unwrap();
//! assert_eq!(c.nodes(), 128);
//! let peak = c.profile.peak_flops(Precision::Bf16).unwrap();
//! assert_eq!(peak, 312e12);
//! ```
//!
//! A profile has five tables: `[device]` (memory, dense peaks per precision, a GEMM efficiency
//! curve indexed by FLOPs, memory-bound efficiency, launch overhead), `[node]` (devices per node,
//! intra-node fabric and bandwidth, NVLS, host link), `[network]` (NICs, rate, latency,
//! topology, oversubscription, nodes per leaf; absent for single-node machines), `[collectives]` (achieved
//! fractions of line rate) and an optional `[calibration]` (provenance of fitted values).

mod cluster;
mod curve;
pub mod edit;
mod error;
mod host_kernels;
mod presets;
mod profile;

pub use cluster::Cluster;
pub use curve::EfficiencyCurve;
pub use error::HwError;
pub use host_kernels::{HostKernels, HostTrainer, KernelRates, HOST_KERNEL_CLASSES};
pub use presets::{
    is_preset, preset, preset_for_device, preset_names, preset_toml, presets, CPU_LOCAL,
};
pub use profile::{
    Calibration, ClusterProfile, CollectiveSpec, DeviceSpec, FabricKind, NetworkSpec, NodeSpec,
    NvmeSpec, PrecisionScale, Topology, MAX_SUSTAINED,
};

#[cfg(test)]
mod tests;
