//! Built-in cluster presets: one commented TOML file each in `profiles/`, embedded at compile
//! time. Every number in them cites its source in a comment.

use crate::error::HwError;
use crate::profile::ClusterProfile;

/// One built-in preset.
struct Preset {
    name: &'static str,
    description: &'static str,
    toml: &'static str,
}

macro_rules! preset {
    ($name:literal, $desc:literal) => {
        Preset {
            name: $name,
            description: $desc,
            toml: include_str!(concat!("../profiles/", $name, ".toml")),
        }
    };
}

/// The presets, in the order `parallax clusters` lists them.
const PRESETS: &[Preset] = &[
    preset!("dgx2-v100-32gb", "NVIDIA DGX-2: 16x V100-SXM3 32GB, NVSwitch, 8x 100 Gb/s EDR InfiniBand"),
    preset!("dgx-a100-40gb", "NVIDIA DGX A100 320GB: 8x A100-SXM4 40GB, NVSwitch, 8x 200 Gb/s HDR InfiniBand"),
    preset!("dgx-a100-80gb", "NVIDIA DGX A100 640GB: 8x A100-SXM4 80GB, NVSwitch, 8x 200 Gb/s HDR InfiniBand"),
    preset!("dgx-h100-80gb", "NVIDIA DGX H100: 8x H100-SXM5 80GB, NVSwitch with NVLS, 8x 400 Gb/s NDR InfiniBand"),
    preset!("hgx-h200-141gb", "NVIDIA HGX/DGX H200: 8x H200-SXM 141GB, NVSwitch with NVLS, 8x 400 Gb/s NDR InfiniBand"),
    preset!("grand-teton-h100-96gb", "Meta Grand Teton: 8x H100 96GB HBM2e at 500 W, NVSwitch, 400 Gb/s RDMA per GPU"),
    preset!("jean-zay-v100-16gb", "IDRIS Jean Zay gpu_p13 (v100-16g): 4x V100-SXM2 16GB per node, NVLink, Omni-Path 100 Gb/s"),
    preset!("jean-zay-v100-32gb", "IDRIS Jean Zay gpu_p13 (v100-32g): 4x V100-SXM2 32GB per node, NVLink, Omni-Path 100 Gb/s"),
    preset!("jean-zay-a100-80gb", "IDRIS Jean Zay gpu_p5: 8x A100-SXM4 80GB per node, NVSwitch, 4x Omni-Path 100 Gb/s"),
    preset!("aws-p3dn-v100-32gb", "AWS p3dn.24xlarge: 8x V100-SXM2 32GB, NVLink hybrid cube mesh, 100 Gb/s EFA"),
    preset!("aws-p4d-a100-40gb", "AWS p4d.24xlarge: 8x A100-SXM4 40GB, NVSwitch, 4x 100 Gb/s EFA"),
    preset!("aws-p5-h100-80gb", "AWS p5.48xlarge: 8x H100-SXM5 80GB, NVSwitch with NVLS, 32x 100 Gb/s EFA"),
    preset!("ibm-a100-80gb-400g", "IBM's A100 80GB cluster of the PyTorch FSDP blog (2024): 8 GPUs per node assumed, 400 Gb/s per node with GPUDirect RDMA"),
    preset!("ibm-h100-80gb-800g", "IBM's H100 80GB cluster of the PyTorch FSDP blog (2024): 8 GPUs per node assumed, 800 Gb/s per node"),
    preset!("dgx1-p100-16gb", "NVIDIA DGX-1 (Pascal): 8x Tesla P100-SXM2 16GB, NVLink 1.0 hybrid cube mesh, 4x 100 Gb/s EDR InfiniBand"),
    preset!("dgx1-v100-16gb", "NVIDIA DGX-1 (Volta): 8x V100-SXM2 16GB (300 W), NVLink 2.0 hybrid cube mesh, 4x 100 Gb/s EDR InfiniBand"),
    preset!("dgx1-v100-32gb", "NVIDIA DGX-1 (Volta): 8x V100-SXM2 32GB (300 W), NVLink 2.0 hybrid cube mesh, 4x 100 Gb/s EDR InfiniBand"),
    preset!("dgx2h-v100-32gb", "NVIDIA DGX-2H: 16x V100-SXM3 32GB at 450 W, NVSwitch, 8x 100 Gb/s EDR InfiniBand"),
    preset!("aws-p2-8xlarge-k80", "AWS p2.8xlarge: 4x Tesla K80 = 8 GK210 GPUs of 12GB, PCIe 3.0, 10 Gb/s EC2 network"),
    preset!("gce-k80x8", "Google Compute Engine n1-standard-32 with 4x Tesla K80 = 8 GK210 GPUs of 12GB, PCIe, 16 Gb/s VM egress"),
    preset!("p40x8-pcie", "Server: 8x Tesla P40 24GB on PCIe 3.0 (no NVLink), 2x Xeon E5-2650 v4"),
    preset!("p100x4-nvlink-edr", "FlexFlow (SysML 2019) cluster 1: 4x Tesla P100-SXM2 16GB per node, NVLink, 100 Gb/s EDR InfiniBand"),
    preset!("k80x4-pcie-fdr", "FlexFlow (SysML 2019) cluster 2: 4 K80 GPUs (GK210 dies, 12GB) per node, PCIe, 56 Gb/s FDR InfiniBand"),
    preset!("titan-rtx-2x-nvlink", "Workstation: 2x TITAN RTX 24GB with a 2-link NVLink bridge"),
    preset!("titan-rtx-2x-pcie", "Workstation: 2x TITAN RTX 24GB over PCIe 3.0 (no NVLink / NCCL_P2P_DISABLE=1)"),
    preset!("cpu-local", "This machine's CPU cores as devices (threads executor); nominal numbers until `parallax calibrate`"),
];

/// Name of the preset whose device count is the number of cores detected at load time.
pub const CPU_LOCAL: &str = "cpu-local";

/// The built-in presets: `(name, one-line description)`, in listing order.
pub fn presets() -> Vec<(&'static str, &'static str)> {
    PRESETS.iter().map(|p| (p.name, p.description)).collect()
}

/// The names of the built-in presets.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.name).collect()
}

/// The embedded TOML text of a preset (with its source comments).
pub fn preset_toml(name: &str) -> Result<&'static str, HwError> {
    PRESETS
        .iter()
        .find(|p| p.name == name)
        .map(|p| p.toml)
        .ok_or_else(|| HwError::UnknownPreset {
            name: name.to_string(),
            available: preset_names().join(", "),
        })
}

/// Loads and validates a built-in preset. For `cpu-local`, `node.gpus_per_node` is set to the
/// number of cores available to this process (`std::thread::available_parallelism`, 1 if it
/// cannot be determined).
pub fn preset(name: &str) -> Result<ClusterProfile, HwError> {
    let entry = PRESETS
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| HwError::UnknownPreset {
            name: name.to_string(),
            available: preset_names().join(", "),
        })?;
    let mut p = ClusterProfile::from_toml_str(entry.toml, &format!("preset {name}"))?;
    if p.description.is_empty() {
        p.description = entry.description.to_string();
    }
    if name == CPU_LOCAL {
        p.node.gpus_per_node = std::thread::available_parallelism()
            .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
            .unwrap_or(1);
        p.validate()?;
    }
    Ok(p)
}

/// Whether `name` is a built-in preset.
pub fn is_preset(name: &str) -> bool {
    PRESETS.iter().any(|p| p.name == name)
}

/// The preset whose device is the GPU the driver names `driver_name` with `mem_gib` of memory
/// (e.g. "NVIDIA H200", 139.8 → `hgx-h200-141gb`): the model in its device name (the part
/// before the first `-`, e.g. `H200`, `A100`, `TITAN RTX`) appears among the driver name's
/// words, and its memory is the nearest within 15 %. `None` for a GPU no preset has.
pub fn preset_for_device(driver_name: &str, mem_gib: f64) -> Option<&'static str> {
    let words = |s: &str| -> Vec<String> {
        s.split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_ascii_uppercase)
            .collect()
    };
    let driver = words(driver_name);
    PRESETS
        .iter()
        .filter(|p| p.name != CPU_LOCAL)
        .filter_map(|p| {
            let prof = ClusterProfile::from_toml_str(p.toml, p.name).ok()?;
            let model = prof.device.name.split('-').next().unwrap_or("");
            let wanted = words(model);
            let off = (prof.device.hbm_gib - mem_gib).abs() / prof.device.hbm_gib;
            (!wanted.is_empty() && wanted.iter().all(|w| driver.contains(w)) && off <= 0.15)
                .then_some((p.name, off))
        })
        // The first of equally near presets (the vendor's own system before a cloud's).
        .fold(None, |best: Option<(&str, f64)>, (name, off)| match best {
            Some((_, b)) if b <= off => best,
            _ => Some((name, off)),
        })
        .map(|(name, _)| name)
}
