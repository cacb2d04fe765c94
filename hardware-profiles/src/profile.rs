//! The cluster profile: what one device can do, how devices in a node are connected, how nodes
//! are networked, and the factors that turn line rates into achieved collective bandwidth.
//!
//! Profiles are TOML files with units in the key names; unknown keys are rejected and
//! [`ClusterProfile::validate`] range-checks every value. See `profiles/*.toml` for commented
//! examples.

use crate::curve::EfficiencyCurve;
use crate::error::{from_toml_error, one_line, HwError};
use crate::host_kernels::HostKernels;
use parallax_ir::{Bytes, BytesPerSec, Precision, Seconds, GIB};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A whole cluster description, one TOML file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterProfile {
    /// Short name (for presets, the preset name).
    pub name: String,
    /// One-line human description.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// One device (GPU, or one CPU core for the CPU executor).
    pub device: DeviceSpec,
    /// One node: devices per node and the intra-node fabric.
    pub node: NodeSpec,
    /// The inter-node network; absent for single-node machines (workstations, `cpu-local`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
    /// Achieved fractions of line rate for collectives.
    pub collectives: CollectiveSpec,
    /// Where the efficiency values came from, when they were fitted by `parallax calibrate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
    /// Where the profile was loaded from (`path` or `preset NAME`), for error messages.
    #[serde(skip)]
    pub origin: String,
}

/// Upper bound of [`DeviceSpec::sustained_efficiency`].
pub const MAX_SUSTAINED: f64 = 1.3;

/// One device.
///
/// Peaks are dense (no structured sparsity) tensor/vector peaks in TFLOP/s. A precision whose
/// peak is absent or 0 is unsupported: [`DeviceSpec::peak_flops`] returns an error for it rather
/// than silently falling back (e.g. V100 has no bf16, tf32 or fp8; a caller that wants fp32 in
/// place of tf32 on V100 must ask for fp32).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// Device name, e.g. `A100-SXM4-80GB`.
    pub name: String,
    /// Memory capacity in GiB.
    pub hbm_gib: f64,
    /// Peak memory bandwidth in GB/s (10^9 bytes per second).
    pub hbm_gbps: f64,
    /// Dense fp32 peak (non-tensor-core), TFLOP/s. Required.
    pub peak_tflops_fp32: f64,
    /// Dense TF32 tensor peak, TFLOP/s; absent or 0 when unsupported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_tflops_tf32: Option<f64>,
    /// Dense fp16 tensor peak with fp32 accumulate (what mixed precision uses), TFLOP/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_tflops_fp16: Option<f64>,
    /// Dense bf16 tensor peak, TFLOP/s; absent or 0 when unsupported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_tflops_bf16: Option<f64>,
    /// Dense fp8 tensor peak, TFLOP/s; absent or 0 when unsupported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_tflops_fp8: Option<f64>,
    /// Board power in W, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tdp_w: Option<f64>,
    /// Achieved fraction of peak of one GEMM, by its FLOPs: `[[flops, efficiency], ...]`,
    /// sorted by FLOPs. Excludes the launch overhead ([`DeviceSpec::kernel_overhead_us`]).
    pub matmul_efficiency: EfficiencyCurve,
    /// Per-precision multipliers on [`DeviceSpec::matmul_efficiency`] (e.g. fp8 GEMMs reach a
    /// lower fraction of their peak than bf16 ones); a missing precision means 1.0.
    #[serde(default, skip_serializing_if = "PrecisionScale::is_empty")]
    pub matmul_efficiency_scale: PrecisionScale,
    /// Fraction of `hbm_gbps` achieved by memory-bound (elementwise, normalization) kernels.
    pub memory_efficiency: f64,
    /// Fixed cost per kernel launch, in microseconds.
    pub kernel_overhead_us: f64,
    /// Fused (flash) attention kernels reach this fraction of the GEMM efficiency curve at the
    /// same FLOPs; absent means the cost model's default (FlashAttention-2, Dao 2023).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_efficiency_scale: Option<f64>,
    /// How much faster this architecture's own fused attention kernels run than the
    /// FlashAttention-2-class kernels `attention_efficiency_scale` describes, for stacks that
    /// use them (FlashAttention-3 and cuDNN 9's fused attention on Hopper: warp-specialised,
    /// asynchronous TMA/WGMMA pipelines); absent: the chip has none, or they are no faster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub native_attention_speedup: Option<f64>,
    /// Share of the aligned rate at which a 16-bit GEMM runs when one of its dimensions is not
    /// a multiple of 8 elements (16 bytes): cuBLAS then falls back from its TMA / wide-load
    /// kernels to ones that load an element or two at a time. Absent: not measured on this
    /// chip, and no penalty is priced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub misaligned_gemm_efficiency: Option<f64>,
    /// Fraction of the isolated-kernel efficiency (the curve above, measured one GEMM at a
    /// time) sustained inside a training step: clocks under a full power load, caches shared
    /// with communication kernels. Fitted to published step times; absent means 1. Up to
    /// [`MAX_SUSTAINED`], for chips whose curve has no measured reference point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sustained_efficiency: Option<f64>,
    /// Whether fused (flash) attention kernels exist for this device; absent means yes.
    /// FlashAttention and PyTorch's fused SDPA kernels need compute capability 7.5 or newer
    /// (Volta has none), so attention there runs as batched GEMMs and a softmax.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused_attention: Option<bool>,
    /// Streaming multiprocessors on the chip (NVIDIA's datasheets and architecture
    /// whitepapers); absent for host cores. Communication kernels that run on SMs beside a GEMM
    /// take theirs from it: Transformer Engine's userbuffers reserve 16 for each pipelined or
    /// bulk collective and run the GEMM on the rest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_count: Option<u32>,
    /// Whether tensor-core GEMMs hide the store of each output tile behind the main loop of
    /// the next; absent means no. A GEMM kernel computes an output tile in a main loop over
    /// the reduction dimension, then writes it in an epilogue (CUTLASS, "Efficient GEMM in
    /// CUDA"). The large tensor-core tiles of Volta and Ampere kernels fill an SM with one
    /// thread block, so the epilogue's stores wait for nothing to overlap; Hopper's persistent
    /// warp-specialized kernels (CUTLASS 3 "ping-pong", cuBLAS 12 on sm_90) run one tile's
    /// epilogue while another warp group runs the next tile's main loop. GPUs without tensor
    /// cores run SIMT kernels only, several blocks per SM, which hide one another's epilogues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_epilogue_overlapped: Option<bool>,
    /// Elementwise exponentials (an exp, a sigmoid) one device sustains per second, where
    /// they rather than memory bound a pointwise kernel: a CPU core evaluates each in libm,
    /// tens of cycles (measured by `parallax calibrate`). Absent for GPUs, whose
    /// special-function units keep such kernels memory-bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transcendentals_per_s: Option<f64>,
    /// Hyperbolic tangents per second (GeLU's tanh approximation, an LSTM cell's), which a
    /// CPU core's libm takes several times longer for than an exponential; absent: counted
    /// at `transcendentals_per_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tanh_per_s: Option<f64>,
    /// Host cores: `memory_efficiency` by the bytes one kernel touches, `[[bytes,
    /// efficiency]]` (the caches serve a kernel whose tensors fit them faster than DRAM);
    /// absent: `memory_efficiency` at every size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_efficiency_curve: Option<EfficiencyCurve>,
    /// Host cores: the CPU executor's kernels by op class, as `parallax calibrate` measured
    /// them (`[device.host_kernels.graph]`, `[device.host_kernels.transformer]`: see
    /// [`HostKernels`]); an op of a class not measured is priced by bytes and bandwidth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_kernels: Option<HostKernels>,
}

/// Optional per-precision factors (used for [`DeviceSpec::matmul_efficiency_scale`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrecisionScale {
    /// Factor for fp32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32: Option<f64>,
    /// Factor for tf32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tf32: Option<f64>,
    /// Factor for fp16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16: Option<f64>,
    /// Factor for bf16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<f64>,
    /// Factor for fp8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<f64>,
}

impl PrecisionScale {
    /// The factor for `p` (1.0 when not given).
    pub fn get(&self, p: Precision) -> f64 {
        self.slot(p).unwrap_or(1.0)
    }

    fn slot(&self, p: Precision) -> Option<f64> {
        match p {
            Precision::Fp32 => self.fp32,
            Precision::Tf32 => self.tf32,
            Precision::Fp16 => self.fp16,
            Precision::Bf16 => self.bf16,
            Precision::Fp8 => self.fp8,
        }
    }

    /// Whether no factor is given.
    pub fn is_empty(&self) -> bool {
        Precision::ALL.iter().all(|&p| self.slot(p).is_none())
    }
}

/// Kind of intra-node fabric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FabricKind {
    /// NVSwitch: every GPU reaches every other at its full NVLink bandwidth (DGX/HGX).
    Nvswitch,
    /// Direct NVLink links between some GPU pairs (hybrid cube mesh, 4-GPU all-to-all, bridges);
    /// `intra_gbps` is the sum over one GPU's links, a single pair may get less.
    NvlinkMesh,
    /// GPUs talk over PCIe (through the host or a PCIe switch).
    Pcie,
    /// Devices are cores of one host sharing its memory (CPU executor).
    HostMemory,
}

/// Inter-node network topology.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    /// A (possibly oversubscribed) fat tree / Clos: any NIC reaches any other NIC.
    FatTree,
    /// Rail-optimized: NIC k of every node shares a leaf switch with NIC k of the others, so
    /// same-rank GPUs across nodes are one switch hop apart.
    RailOptimized,
}

/// One node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Devices per node.
    pub gpus_per_node: u32,
    /// Intra-node fabric.
    pub intra_fabric: FabricKind,
    /// Per-device unidirectional intra-node line rate, GB/s.
    pub intra_gbps: f64,
    /// Latency of one intra-node transfer (collective step), microseconds.
    pub intra_latency_us: f64,
    /// NVLink SHARP (in-switch reduction) all-reduce is available (NVSwitch gen3, H100-class).
    #[serde(default)]
    pub nvls: bool,
    /// Per-device unidirectional PCIe link to host memory, GB/s (used for offload); absent when
    /// the devices are host cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_host_gbps: Option<f64>,
    /// DRAM bandwidth of the node's host CPUs, GB/s, all sockets (channels × transfer rate ×
    /// 8 bytes): what an offloaded optimizer step streams its states through. Absent: offload
    /// cannot be priced on this profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_gbps: Option<f64>,
    /// Host memory of the node, GiB: where offloaded states must fit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_gib: Option<f64>,
    /// Parameters the node's CPUs update with Adam per second, billions, all cores at once
    /// (fp32 weights, gradients and moments in host memory, the 16-bit copy written): what
    /// `parallax calibrate` measures. Given, an offloaded optimizer step is priced at it;
    /// absent, from streaming the states through `host_memory_gbps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_adam_gparams_per_s: Option<f64>,
    /// The node's NVMe storage, where ZeRO-Infinity offloads to. Absent: NVMe offload cannot be
    /// priced on this profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvme: Option<NvmeSpec>,
}

/// A node's NVMe storage as offload sees it (`[node.nvme]`; `parallax calibrate --nvme DIR`
/// measures it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmeSpec {
    /// Sequential read bandwidth, GB/s, all the node's drives at once (the node's devices
    /// share it).
    pub read_gbps: f64,
    /// Sequential write bandwidth, GB/s, likewise.
    pub write_gbps: f64,
    /// Space free for offloaded states, GiB.
    pub gib: f64,
    /// The folder on it (what `--export deepspeed` writes as `nvme_path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// The inter-node network.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Compute NICs per node (storage NICs not counted).
    pub nics_per_node: u32,
    /// Line rate of one NIC, Gb/s (10^9 bits per second).
    pub nic_gbit: f64,
    /// Latency of one inter-node message, microseconds.
    pub latency_us: f64,
    /// Fabric topology.
    pub topology: Topology,
    /// Oversubscription of the fabric above the leaf switches (1.0 = full bisection): the leaf's
    /// uplinks carry 1/oversubscription of its NICs' bandwidth.
    pub oversubscription: f64,
    /// Nodes whose NICs share one leaf switch (fat tree) or one rail group (rail-optimized;
    /// DGX SuperPOD: a 32-node scalable unit). Traffic between nodes farther apart crosses the
    /// oversubscribed tier. Absent: unknown, and every inter-node byte is taken to cross it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes_per_leaf: Option<u32>,
}

/// Collective algorithm factors: achieved bus bandwidth as a fraction of line rate, per tier.
///
/// Bus bandwidth (busbw) is nccl-tests' algorithm-independent figure: for a ring all-reduce of
/// `S` bytes over `n` ranks taking `t`, busbw = `S/t * 2(n-1)/n`; it is comparable to the line
/// rate of the slowest link. Cost models apply the usual per-collective factors on top.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveSpec {
    /// Achieved busbw / `node.intra_gbps` for large intra-node ring collectives.
    pub intra_busbw_efficiency: f64,
    /// Achieved busbw / NIC line rate for large inter-node collectives, per NIC. Required when
    /// `[network]` is present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_busbw_efficiency: Option<f64>,
    /// NVLS all-reduce: achieved *algorithm* bandwidth / `node.intra_gbps` (each GPU sends its
    /// buffer once and receives the reduced result once, so busbw = algbw * 2(n-1)/n can exceed
    /// the line rate). Required exactly when `node.nvls = true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvls_allreduce_algbw_efficiency: Option<f64>,
}

/// Provenance of fitted values (written by `parallax calibrate`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// How and from what the values were fitted (tool, backend, cases).
    pub provenance: String,
    /// When the fit was made (free-form date/time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fitted_at: Option<String>,
    /// Dotted keys whose values were fitted, e.g. `device.matmul_efficiency`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fitted_fields: Vec<String>,
    /// Relative half-width of the step-time band, from the residuals of the fit (the 90th
    /// percentile of |predicted / measured − 1|).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_time_band: Option<f64>,
}

impl DeviceSpec {
    /// Dense peak in TFLOP/s for `p`, `None` when unsupported (absent or 0).
    pub fn peak_tflops(&self, p: Precision) -> Option<f64> {
        let v = match p {
            Precision::Fp32 => Some(self.peak_tflops_fp32),
            Precision::Tf32 => self.peak_tflops_tf32,
            Precision::Fp16 => self.peak_tflops_fp16,
            Precision::Bf16 => self.peak_tflops_bf16,
            Precision::Fp8 => self.peak_tflops_fp8,
        };
        v.filter(|&t| t > 0.0)
    }

    /// The precision a job trains in on this device unless told otherwise: bf16 where the
    /// device has it (Ampere and later), else fp16 mixed precision (Volta, Turing, Pascal's
    /// P100), else fp32 (earlier chips, host cores).
    pub fn default_precision(&self) -> Precision {
        [Precision::Bf16, Precision::Fp16]
            .into_iter()
            .find(|&p| self.peak_tflops(p).is_some())
            .unwrap_or(Precision::Fp32)
    }

    /// Precisions with a nonzero peak.
    pub fn supported_precisions(&self) -> Vec<Precision> {
        Precision::ALL
            .into_iter()
            .filter(|&p| self.peak_tflops(p).is_some())
            .collect()
    }

    /// Memory capacity.
    pub fn hbm_capacity(&self) -> Bytes {
        Bytes::from_gib(self.hbm_gib)
    }

    /// Peak memory bandwidth.
    pub fn hbm_bandwidth(&self) -> BytesPerSec {
        BytesPerSec::from_gbps_bytes(self.hbm_gbps)
    }

    /// Memory bandwidth achieved by memory-bound kernels (`hbm_gbps * memory_efficiency`).
    pub fn effective_memory_bandwidth(&self) -> BytesPerSec {
        self.hbm_bandwidth() * self.memory_efficiency
    }

    /// Achieved fraction of peak of one GEMM of `flops` FLOPs (the curve alone).
    pub fn matmul_efficiency(&self, flops: f64) -> f64 {
        self.matmul_efficiency.at(flops)
    }

    /// Achieved fraction of the `p` peak of one GEMM of `flops` FLOPs: the curve times the
    /// precision's scale, capped at 1.
    pub fn matmul_efficiency_for(&self, p: Precision, flops: f64) -> f64 {
        (self.matmul_efficiency.at(flops) * self.matmul_efficiency_scale.get(p)).min(1.0)
    }

    /// Whether fused attention kernels run on this device.
    pub fn has_fused_attention(&self) -> bool {
        self.fused_attention.unwrap_or(true)
    }

    /// Whether tensor-core GEMMs hide their epilogue ([`DeviceSpec::gemm_epilogue_overlapped`]).
    pub fn gemm_epilogue_hidden(&self) -> bool {
        self.gemm_epilogue_overlapped.unwrap_or(false)
    }

    /// Whether NVIDIA's Transformer Engine (its userbuffers TP overlap, fused layers) runs
    /// on this chip. Its README lists Ampere and later ("Hardware: Blackwell, Hopper, Grace
    /// Hopper/Blackwell, Ada, Ampere"): the generations whose tensor cores take bf16, which
    /// Volta, Turing, Pascal and Kepler do not (their datasheets list no bf16 rate), so a chip
    /// without a bf16 peak runs none of it.
    pub fn runs_transformer_engine(&self) -> bool {
        self.peak_tflops(Precision::Bf16).is_some()
    }

    /// [`DeviceSpec::sustained_efficiency`], 1 when not given.
    pub fn sustained(&self) -> f64 {
        self.sustained_efficiency.unwrap_or(1.0)
    }

    /// Launch overhead of one kernel.
    pub fn kernel_overhead(&self) -> Seconds {
        Seconds(self.kernel_overhead_us * 1e-6)
    }
}

impl NodeSpec {
    /// Per-device intra-node line rate.
    pub fn intra_bandwidth(&self) -> BytesPerSec {
        BytesPerSec::from_gbps_bytes(self.intra_gbps)
    }
    /// Intra-node latency.
    pub fn intra_latency(&self) -> Seconds {
        Seconds(self.intra_latency_us * 1e-6)
    }
    /// Per-device host link, if any.
    pub fn host_link_bandwidth(&self) -> Option<BytesPerSec> {
        self.pcie_host_gbps.map(BytesPerSec::from_gbps_bytes)
    }
    /// DRAM bandwidth of the node's host, if given.
    pub fn host_memory_bandwidth(&self) -> Option<BytesPerSec> {
        self.host_memory_gbps.map(BytesPerSec::from_gbps_bytes)
    }
    /// Whether the node's devices are host CPU cores (they share host memory), on which the
    /// CPU executor runs, rather than GPUs.
    pub fn devices_are_host_cores(&self) -> bool {
        self.intra_fabric == FabricKind::HostMemory
    }
}

impl NetworkSpec {
    /// Line rate of one NIC.
    pub fn nic_bandwidth(&self) -> BytesPerSec {
        BytesPerSec::from_gbit(self.nic_gbit)
    }
    /// Line rate of all compute NICs of one node.
    pub fn node_bandwidth(&self) -> BytesPerSec {
        self.nic_bandwidth() * f64::from(self.nics_per_node)
    }
    /// Inter-node latency.
    pub fn latency(&self) -> Seconds {
        Seconds(self.latency_us * 1e-6)
    }

    /// Nodes under one leaf (or rail group); 1 when unknown.
    fn leaf_nodes(&self) -> f64 {
        f64::from(self.nodes_per_leaf.unwrap_or(1).max(1))
    }

    /// Slowdown of a ring over `nodes` consecutive nodes from the oversubscribed tier. Every
    /// NIC of a leaf carries one ring, and each ring leaves a leaf it does not fill by one
    /// edge: a leaf of `L` nodes sends `nics` rings' worth through uplinks of `L × nics /
    /// oversubscription`, so rings slow down by `oversubscription / L` where that exceeds 1.
    pub fn ring_slowdown(&self, nodes: u32) -> f64 {
        let leaf = self.leaf_nodes();
        if f64::from(nodes) <= leaf {
            1.0
        } else {
            (self.oversubscription / leaf).max(1.0)
        }
    }

    /// Slowdown of a uniform all-to-all over `nodes` consecutive nodes: the share of each
    /// node's inter-node traffic bound beyond its leaf crosses uplinks of
    /// 1/oversubscription of the NICs' bandwidth.
    pub fn all_to_all_slowdown(&self, nodes: u32) -> f64 {
        if nodes <= 1 {
            return 1.0;
        }
        let n = f64::from(nodes);
        let beyond = (n - self.leaf_nodes().min(n)) / (n - 1.0);
        (self.oversubscription * beyond).max(1.0)
    }
}

impl ClusterProfile {
    /// Parses and validates a profile from TOML text. `origin` names the text in error messages
    /// (a file path, or `preset NAME`).
    pub fn from_toml_str(text: &str, origin: &str) -> Result<ClusterProfile, HwError> {
        let mut p: ClusterProfile =
            toml::from_str(text).map_err(|e| from_toml_error(&e, text, origin))?;
        p.origin = origin.to_string();
        p.validate()?;
        Ok(p)
    }

    /// Reads, parses and validates a profile file.
    pub fn load(path: impl AsRef<Path>) -> Result<ClusterProfile, HwError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| HwError::Io {
            path: shown.clone(),
            reason: one_line(&e.to_string()),
        })?;
        ClusterProfile::from_toml_str(&text, &shown)
    }

    /// Writes the profile as TOML (no comments); [`ClusterProfile::from_toml_str`] reads it back
    /// to an equal profile.
    pub fn to_toml_string(&self) -> Result<String, HwError> {
        toml::to_string(self).map_err(|e| HwError::Serialize {
            origin: self.origin_or_name(),
            reason: one_line(&e.to_string()),
        })
    }

    /// Writes the profile to a TOML file, after validating it.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), HwError> {
        self.validate()?;
        let path = path.as_ref();
        let text = self.to_toml_string()?;
        std::fs::write(path, text).map_err(|e| HwError::Io {
            path: path.display().to_string(),
            reason: one_line(&e.to_string()),
        })
    }

    fn origin_or_name(&self) -> String {
        if self.origin.is_empty() {
            self.name.clone()
        } else {
            self.origin.clone()
        }
    }

    fn invalid(&self, field: impl Into<String>, problem: impl Into<String>) -> HwError {
        HwError::Invalid {
            origin: self.origin_or_name(),
            field: field.into(),
            problem: problem.into(),
        }
    }

    /// Dense peak of the device for `p`, in FLOP/s; an error naming the device when the precision
    /// is unsupported.
    pub fn peak_flops(&self, p: Precision) -> Result<f64, HwError> {
        self.device.peak_flops_from(p, &self.origin_or_name())
    }

    /// Achieved intra-node bus bandwidth per device for large ring collectives:
    /// `intra_gbps * intra_busbw_efficiency`.
    pub fn intra_busbw(&self) -> BytesPerSec {
        self.node.intra_bandwidth() * self.collectives.intra_busbw_efficiency
    }

    /// Achieved NVLS all-reduce bus bandwidth over `n` devices of one node, `None` without NVLS:
    /// `intra_gbps * nvls_allreduce_algbw_efficiency * 2(n-1)/n`.
    pub fn nvls_allreduce_busbw(&self, n: u32) -> Option<BytesPerSec> {
        if !self.node.nvls || n < 2 {
            return None;
        }
        let eff = self.collectives.nvls_allreduce_algbw_efficiency?;
        let n = f64::from(n);
        Some(self.node.intra_bandwidth() * (eff * 2.0 * (n - 1.0) / n))
    }

    /// Achieved inter-node bus bandwidth of one NIC, `None` without a network.
    pub fn inter_busbw_per_nic(&self) -> Option<BytesPerSec> {
        let net = self.network.as_ref()?;
        let eff = self.collectives.inter_busbw_efficiency?;
        Some(net.nic_bandwidth() * eff)
    }

    /// Achieved inter-node bus bandwidth of one node (all compute NICs), `None` without a
    /// network. Oversubscription is not applied here: whether a collective crosses the
    /// oversubscribed tier depends on the group and its traffic pattern
    /// ([`NetworkSpec::ring_slowdown`], [`NetworkSpec::all_to_all_slowdown`]).
    pub fn inter_busbw_per_node(&self) -> Option<BytesPerSec> {
        let net = self.network.as_ref()?;
        Some(self.inter_busbw_per_nic()? * f64::from(net.nics_per_node))
    }

    /// Range and consistency checks; the error names the first bad field.
    pub fn validate(&self) -> Result<(), HwError> {
        let pos = |field: &str, v: f64| -> Result<(), HwError> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(self.invalid(field, format!("must be a positive number, got {v}")))
            }
        };
        let non_neg = |field: &str, v: f64| -> Result<(), HwError> {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(self.invalid(field, format!("must be zero or a positive number, got {v}")))
            }
        };
        let frac = |field: &str, v: f64| -> Result<(), HwError> {
            if v.is_finite() && v > 0.0 && v <= 1.0 {
                Ok(())
            } else {
                Err(self.invalid(field, format!("must satisfy 0 < value <= 1, got {v}")))
            }
        };

        // Names are echoed to terminals: no escapes or line breaks.
        for (field, name) in [("name", &self.name), ("device.name", &self.device.name)] {
            if name.trim().is_empty() {
                return Err(self.invalid(field, "must not be empty"));
            }
            if name.chars().any(char::is_control) {
                return Err(self.invalid(field, "must not contain control characters"));
            }
        }

        let d = &self.device;
        pos("device.hbm_gib", d.hbm_gib)?;
        pos("device.hbm_gbps", d.hbm_gbps)?;
        pos("device.peak_tflops_fp32", d.peak_tflops_fp32)?;
        for (key, v) in [
            ("device.peak_tflops_tf32", d.peak_tflops_tf32),
            ("device.peak_tflops_fp16", d.peak_tflops_fp16),
            ("device.peak_tflops_bf16", d.peak_tflops_bf16),
            ("device.peak_tflops_fp8", d.peak_tflops_fp8),
        ] {
            if let Some(v) = v {
                non_neg(key, v)?;
            }
        }
        if let Some(w) = d.tdp_w {
            pos("device.tdp_w", w)?;
        }
        if let Err((idx, problem)) = d.matmul_efficiency.check() {
            let field = match idx {
                Some(i) => format!("device.matmul_efficiency[{i}]"),
                None => "device.matmul_efficiency".to_string(),
            };
            return Err(self.invalid(field, problem));
        }
        for p in Precision::ALL {
            if let Some(v) = d.matmul_efficiency_scale.slot(p) {
                frac(&format!("device.matmul_efficiency_scale.{p}"), v)?;
            }
        }
        frac("device.memory_efficiency", d.memory_efficiency)?;
        non_neg("device.kernel_overhead_us", d.kernel_overhead_us)?;
        if let Some(a) = d.attention_efficiency_scale {
            frac("device.attention_efficiency_scale", a)?;
        }
        if let Some(s) = d.native_attention_speedup {
            if !(s.is_finite() && (1.0..=4.0).contains(&s)) {
                return Err(self.invalid(
                    "device.native_attention_speedup",
                    format!("must satisfy 1 <= value <= 4, got {s}"),
                ));
            }
        }
        if let Some(m) = d.misaligned_gemm_efficiency {
            frac("device.misaligned_gemm_efficiency", m)?;
        }
        if let Some(t) = d.transcendentals_per_s {
            pos("device.transcendentals_per_s", t)?;
        }
        if let Some(t) = d.tanh_per_s {
            pos("device.tanh_per_s", t)?;
        }
        if let Some(h) = &d.host_kernels {
            if let Err((field, problem)) = h.check() {
                return Err(self.invalid(format!("device.host_kernels.{field}"), problem));
            }
        }
        if let Some(c) = &d.memory_efficiency_curve {
            if let Err((idx, problem)) = c.check() {
                let at = idx.map_or(String::new(), |i| format!("[{i}]"));
                return Err(self.invalid(format!("device.memory_efficiency_curve{at}"), problem));
            }
        }
        if let Some(a) = d.sustained_efficiency {
            // Above 1 when the isolated-GEMM curve of a chip without measured reference points
            // underestimates it; bounded to catch nonsense.
            if !(a.is_finite() && a > 0.0 && a <= MAX_SUSTAINED) {
                return Err(self.invalid(
                    "device.sustained_efficiency",
                    format!("must satisfy 0 < value <= {MAX_SUSTAINED}, got {a}"),
                ));
            }
        }

        let n = &self.node;
        if n.gpus_per_node == 0 {
            return Err(self.invalid("node.gpus_per_node", "must be at least 1, got 0"));
        }
        pos("node.intra_gbps", n.intra_gbps)?;
        non_neg("node.intra_latency_us", n.intra_latency_us)?;
        if let Some(h) = n.host_memory_gbps {
            pos("node.host_memory_gbps", h)?;
        }
        if let Some(h) = n.host_memory_gib {
            pos("node.host_memory_gib", h)?;
        }
        if let Some(h) = n.pcie_host_gbps {
            pos("node.pcie_host_gbps", h)?;
        }
        if let Some(h) = n.host_adam_gparams_per_s {
            pos("node.host_adam_gparams_per_s", h)?;
        }
        if let Some(nv) = &n.nvme {
            pos("node.nvme.read_gbps", nv.read_gbps)?;
            pos("node.nvme.write_gbps", nv.write_gbps)?;
            pos("node.nvme.gib", nv.gib)?;
        }
        if n.nvls && n.intra_fabric != FabricKind::Nvswitch {
            return Err(self.invalid(
                "node.nvls",
                "NVLink SHARP needs intra_fabric = \"nvswitch\"",
            ));
        }

        if let Some(net) = &self.network {
            if net.nics_per_node == 0 {
                return Err(self.invalid(
                    "network.nics_per_node",
                    "must be at least 1, got 0 (leave out [network] for a single-node machine)",
                ));
            }
            pos("network.nic_gbit", net.nic_gbit)?;
            non_neg("network.latency_us", net.latency_us)?;
            if !(net.oversubscription.is_finite() && net.oversubscription >= 1.0) {
                return Err(self.invalid(
                    "network.oversubscription",
                    format!(
                        "must be >= 1.0 (1.0 = full bisection), got {}",
                        net.oversubscription
                    ),
                ));
            }
            if net.nodes_per_leaf == Some(0) {
                return Err(self.invalid("network.nodes_per_leaf", "must be at least 1"));
            }
        }

        let c = &self.collectives;
        frac(
            "collectives.intra_busbw_efficiency",
            c.intra_busbw_efficiency,
        )?;
        match (&self.network, c.inter_busbw_efficiency) {
            (Some(_), Some(v)) => frac("collectives.inter_busbw_efficiency", v)?,
            (Some(_), None) => {
                return Err(self.invalid(
                    "collectives.inter_busbw_efficiency",
                    "missing; required when [network] is present",
                ))
            }
            (None, Some(_)) => {
                return Err(self.invalid(
                    "collectives.inter_busbw_efficiency",
                    "given but there is no [network] section",
                ))
            }
            (None, None) => {}
        }
        match (n.nvls, c.nvls_allreduce_algbw_efficiency) {
            (true, Some(v)) => frac("collectives.nvls_allreduce_algbw_efficiency", v)?,
            (true, None) => {
                return Err(self.invalid(
                    "collectives.nvls_allreduce_algbw_efficiency",
                    "missing; required when node.nvls = true",
                ))
            }
            (false, Some(_)) => {
                return Err(self.invalid(
                    "collectives.nvls_allreduce_algbw_efficiency",
                    "given but node.nvls is false",
                ))
            }
            (false, None) => {}
        }

        if let Some(cal) = &self.calibration {
            if cal.provenance.trim().is_empty() {
                return Err(self.invalid("calibration.provenance", "must not be empty"));
            }
            if let Some(b) = cal.step_time_band {
                non_neg("calibration.step_time_band", b)?;
            }
        }
        Ok(())
    }
}

impl DeviceSpec {
    /// Dense peak in FLOP/s for `p`; `origin` names the profile in the error.
    fn peak_flops_from(&self, p: Precision, origin: &str) -> Result<f64, HwError> {
        self.peak_tflops(p)
            .map(|t| t * 1e12)
            .ok_or_else(|| HwError::UnsupportedPrecision {
                origin: origin.to_string(),
                device: self.name.clone(),
                precision: p,
            })
    }

    /// Dense peak in FLOP/s for `p`; an error when the device does not support `p`.
    pub fn peak_flops(&self, p: Precision) -> Result<f64, HwError> {
        self.peak_flops_from(p, &self.name)
    }

    /// Memory capacity in bytes as `f64` (for ratios).
    pub fn hbm_bytes_f64(&self) -> f64 {
        self.hbm_gib * GIB
    }
}
