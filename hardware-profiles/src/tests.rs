//! Crate-level tests: presets, round trips, error messages, cluster specs.

use crate::*;
use parallax_ir::Precision;

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1e-30)
}

/// A small valid profile to mutate in error tests.
const GOOD: &str = r#"
name = "test"

[device]
name = "G"
hbm_gib = 80.0
hbm_gbps = 2000.0
peak_tflops_fp32 = 20.0
peak_tflops_bf16 = 300.0
matmul_efficiency = [[1e9, 0.35], [1e11, 0.7], [1e12, 0.85]]
memory_efficiency = 0.85
kernel_overhead_us = 4.0

[node]
gpus_per_node = 8
intra_fabric = "nvswitch"
intra_gbps = 300.0
intra_latency_us = 2.0
pcie_host_gbps = 31.5

[network]
nics_per_node = 8
nic_gbit = 200.0
latency_us = 5.0
topology = "fat-tree"
oversubscription = 1.0

[collectives]
intra_busbw_efficiency = 0.77
inter_busbw_efficiency = 0.96
"#;

fn err_of(text: &str) -> String {
    let e = ClusterProfile::from_toml_str(text, "bad.toml").unwrap_err();
    let s = e.to_string();
    assert!(!s.contains('\n'), "error must be one line: {s:?}");
    s
}

#[test]
fn good_profile_parses() {
    let p = ClusterProfile::from_toml_str(GOOD, "good.toml").unwrap();
    assert_eq!(p.origin, "good.toml");
    assert_eq!(p.node.gpus_per_node, 8);
    assert!(!p.node.nvls);
    assert_eq!(
        p.device.supported_precisions(),
        vec![Precision::Fp32, Precision::Bf16]
    );
}

// ---------------------------------------------------------------- presets

#[test]
fn every_preset_parses_and_validates() {
    let list = presets();
    assert_eq!(list.len(), 26);
    for (name, desc) in list {
        let p = preset(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        p.validate().unwrap();
        assert_eq!(p.name, name, "the file's name key matches the preset name");
        assert_eq!(p.description, desc);
        assert!(!desc.is_empty() && !desc.contains('\n'));
        assert!(p.peak_flops(Precision::Fp32).is_ok());
        // The top of every curve is at most the best measured fraction (A100 86.9 %).
        assert!(p.device.matmul_efficiency.max() <= 0.869 + 1e-12, "{name}");
    }
}

#[test]
fn preset_names_are_the_required_ones() {
    let want = [
        "dgx2-v100-32gb",
        "dgx-a100-40gb",
        "dgx-a100-80gb",
        "dgx-h100-80gb",
        "hgx-h200-141gb",
        "grand-teton-h100-96gb",
        "jean-zay-v100-16gb",
        "jean-zay-v100-32gb",
        "jean-zay-a100-80gb",
        "aws-p3dn-v100-32gb",
        "aws-p4d-a100-40gb",
        "aws-p5-h100-80gb",
        "ibm-a100-80gb-400g",
        "ibm-h100-80gb-800g",
        "dgx1-p100-16gb",
        "dgx1-v100-16gb",
        "dgx1-v100-32gb",
        "dgx2h-v100-32gb",
        "aws-p2-8xlarge-k80",
        "gce-k80x8",
        "p40x8-pcie",
        "p100x4-nvlink-edr",
        "k80x4-pcie-fdr",
        "titan-rtx-2x-nvlink",
        "titan-rtx-2x-pcie",
        "cpu-local",
    ];
    assert_eq!(preset_names(), want);
}

#[test]
fn every_preset_value_line_cites_a_source() {
    for name in preset_names() {
        let text = preset_toml(name).unwrap();
        let mut in_multiline_comment_block = false;
        for (i, line) in text.lines().enumerate() {
            let t = line.trim();
            if t.is_empty() || t.starts_with('[') {
                in_multiline_comment_block = false;
                continue;
            }
            if t.starts_with('#') {
                in_multiline_comment_block = true;
                continue;
            }
            if t.starts_with("name =") && !line.contains('#') {
                continue; // names need no source
            }
            assert!(
                line.contains('#') || in_multiline_comment_block,
                "{name}:{}: value without a source comment: {line}",
                i + 1
            );
            in_multiline_comment_block = false;
        }
    }
}

#[test]
fn public_cases_name_existing_presets() {
    // Every preset the published runs in shared/ground-truth/public.json name.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/ground-truth/public.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: the tests read the published runs from ../shared beside the clone, as CI has it",
            path.display()
        )
    });
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for c in cases {
        let name = c["cluster"]["preset"].as_str().unwrap();
        assert!(is_preset(name), "{}: {name}", c["id"]);
    }
}

#[test]
fn datasheet_numbers_of_key_presets() {
    let a = preset("dgx-a100-80gb").unwrap();
    assert_eq!(a.device.hbm_gib, 80.0);
    assert_eq!(a.device.hbm_gbps, 2039.0);
    assert_eq!(a.peak_flops(Precision::Fp32).unwrap(), 19.5e12);
    assert_eq!(a.peak_flops(Precision::Tf32).unwrap(), 156e12);
    assert_eq!(a.peak_flops(Precision::Bf16).unwrap(), 312e12);
    assert_eq!(a.peak_flops(Precision::Fp16).unwrap(), 312e12);
    assert!(a.peak_flops(Precision::Fp8).is_err());
    assert_eq!(a.node.gpus_per_node, 8);
    let net = a.network.as_ref().unwrap();
    assert_eq!((net.nics_per_node, net.nic_gbit), (8, 200.0));

    let a40 = preset("dgx-a100-40gb").unwrap();
    assert_eq!((a40.device.hbm_gib, a40.device.hbm_gbps), (40.0, 1555.0));

    let h = preset("dgx-h100-80gb").unwrap();
    assert_eq!(h.device.hbm_gbps, 3350.0);
    assert_eq!(h.peak_flops(Precision::Fp32).unwrap(), 67e12);
    assert_eq!(h.peak_flops(Precision::Tf32).unwrap(), 494.7e12);
    assert_eq!(h.peak_flops(Precision::Bf16).unwrap(), 989.4e12);
    assert_eq!(h.peak_flops(Precision::Fp8).unwrap(), 1978.9e12);
    assert!(h.node.nvls);
    let net = h.network.as_ref().unwrap();
    assert_eq!((net.nics_per_node, net.nic_gbit), (8, 400.0));

    let h200 = preset("hgx-h200-141gb").unwrap();
    assert_eq!(h200.device.hbm_gbps, 4800.0);
    assert_eq!(h200.peak_flops(Precision::Bf16).unwrap(), 989.4e12);

    let gt = preset("grand-teton-h100-96gb").unwrap();
    assert_eq!(gt.device.hbm_gib, 96.0);
    assert_eq!(gt.device.hbm_gbps, 2400.0);
    assert_eq!(gt.device.tdp_w, Some(500.0));
    let bf16 = gt.peak_flops(Precision::Bf16).unwrap();
    assert!(bf16 > 835.5e12 && bf16 < 989.4e12, "between NVL and SXM");

    let v = preset("dgx2-v100-32gb").unwrap();
    assert_eq!(v.node.gpus_per_node, 16);
    assert_eq!(v.peak_flops(Precision::Fp16).unwrap(), 125e12);
    assert_eq!(v.peak_flops(Precision::Fp32).unwrap(), 15.7e12);
    assert_eq!(v.device.hbm_gbps, 900.0);
    let net = v.network.as_ref().unwrap();
    assert_eq!((net.nics_per_node, net.nic_gbit), (8, 100.0));

    for name in ["jean-zay-v100-16gb", "jean-zay-v100-32gb"] {
        let j = preset(name).unwrap();
        assert_eq!(j.node.gpus_per_node, 4);
        assert_eq!(j.network.as_ref().unwrap().nic_gbit, 100.0);
    }
    assert_eq!(preset("jean-zay-v100-16gb").unwrap().device.hbm_gib, 16.0);
    assert_eq!(preset("jean-zay-a100-80gb").unwrap().node.gpus_per_node, 8);

    let p3 = preset("aws-p3dn-v100-32gb").unwrap();
    assert_eq!(p3.network.as_ref().unwrap().node_bandwidth().0 * 8.0, 100e9);
    let p4 = preset("aws-p4d-a100-40gb").unwrap();
    assert_eq!(p4.network.as_ref().unwrap().node_bandwidth().0 * 8.0, 400e9);
    let p5 = preset("aws-p5-h100-80gb").unwrap();
    assert_eq!(
        p5.network.as_ref().unwrap().node_bandwidth().0 * 8.0,
        3200e9
    );

    let t = preset("titan-rtx-2x-nvlink").unwrap();
    assert_eq!(t.peak_flops(Precision::Fp32).unwrap(), 16.3e12);
    assert_eq!(t.node.gpus_per_node, 2);
    assert!(t.network.is_none());
    let tp = preset("titan-rtx-2x-pcie").unwrap();
    assert_eq!(tp.node.intra_fabric, FabricKind::Pcie);
    assert!(tp.node.intra_gbps < t.node.intra_gbps);
}

#[test]
fn volta_and_turing_have_no_bf16_tf32_or_fp8() {
    for name in [
        "dgx2-v100-32gb",
        "jean-zay-v100-16gb",
        "aws-p3dn-v100-32gb",
        "dgx1-v100-16gb",
        "dgx1-v100-32gb",
        "dgx2h-v100-32gb",
        "titan-rtx-2x-nvlink",
    ] {
        let p = preset(name).unwrap();
        for prec in [Precision::Bf16, Precision::Tf32, Precision::Fp8] {
            let e = p.peak_flops(prec).unwrap_err();
            assert!(matches!(e, HwError::UnsupportedPrecision { .. }));
            let msg = e.to_string();
            assert!(msg.contains(&format!("peak_tflops_{prec}")), "{msg}");
            assert!(msg.contains(&format!("preset {name}")), "{msg}");
        }
    }
}

#[test]
fn dgx1_volta_and_dgx2h_presets_have_their_datasheet_numbers() {
    let tf = |p: &ClusterProfile, x: Precision| p.device.peak_tflops(x);
    let base = preset("dgx2-v100-32gb").unwrap();

    // DGX-1 Volta: V100-SXM2 at 300 W, 16 or 32 GB, hybrid cube mesh, 4 EDR NICs.
    for (name, mem) in [("dgx1-v100-16gb", 16.0), ("dgx1-v100-32gb", 32.0)] {
        let p = preset(name).unwrap();
        assert_eq!(p.device.hbm_gib, mem);
        assert_eq!(tf(&p, Precision::Fp16), Some(125.0));
        assert_eq!(tf(&p, Precision::Fp32), Some(15.7));
        assert_eq!(p.device.tdp_w, Some(300.0));
        assert_eq!(p.node.gpus_per_node, 8);
        assert_eq!(p.node.intra_fabric, FabricKind::NvlinkMesh);
        assert_eq!(p.node.intra_gbps, 150.0);
        let net = p.network.as_ref().unwrap();
        assert_eq!((net.nics_per_node, net.nic_gbit), (4, 100.0));
        // The fit writes one value per chip family into every preset of it.
        assert_eq!(
            p.device.sustained_efficiency,
            base.device.sustained_efficiency
        );
    }

    // DGX-2H: DGX-2's topology, 450 W parts ~4 % faster (2.1 vs 2 PFLOPS per 16 GPUs).
    let h = preset("dgx2h-v100-32gb").unwrap();
    assert_eq!(h.node, base.node);
    assert_eq!(
        h.device.sustained_efficiency,
        base.device.sustained_efficiency
    );
    assert_eq!(h.network, base.network);
    assert_eq!(h.device.tdp_w, Some(450.0));
    let ratio = tf(&h, Precision::Fp16).unwrap() / tf(&base, Precision::Fp16).unwrap();
    assert!((1.03..=1.06).contains(&ratio), "{ratio}");
    let fp32 = tf(&h, Precision::Fp32).unwrap() / tf(&base, Precision::Fp32).unwrap();
    assert!(close(fp32, ratio, 0.01), "{fp32} vs {ratio}");
}

#[test]
fn pascal_and_kepler_presets_have_their_datasheet_numbers() {
    let tf = |p: &ClusterProfile, x: Precision| p.device.peak_tflops(x);
    let gib = |p: &ClusterProfile| p.device.hbm_gib;

    // Pascal P100-SXM2: fp16 at twice the fp32 rate, no tensor-core precisions; mixed-precision
    // GEMMs (fp32 accumulation) reach only the fp32 rate.
    for name in ["dgx1-p100-16gb", "p100x4-nvlink-edr"] {
        let p = preset(name).unwrap();
        assert_eq!(p.device.name, "P100-SXM2-16GB");
        assert_eq!((gib(&p), p.device.hbm_gbps), (16.0, 732.0));
        assert_eq!(tf(&p, Precision::Fp32), Some(10.6));
        assert_eq!(tf(&p, Precision::Fp16), Some(2.0 * 10.6));
        assert_eq!(
            p.device.supported_precisions(),
            vec![Precision::Fp32, Precision::Fp16]
        );
        let f = 1e11;
        let fp16 =
            tf(&p, Precision::Fp16).unwrap() * p.device.matmul_efficiency_for(Precision::Fp16, f);
        let fp32 =
            tf(&p, Precision::Fp32).unwrap() * p.device.matmul_efficiency_for(Precision::Fp32, f);
        assert!(close(fp16, fp32, 1e-9), "{name}: {fp16} vs {fp32}");
        assert_eq!(p.node.intra_fabric, FabricKind::NvlinkMesh);
        assert_eq!(p.node.intra_gbps, 80.0); // 4 NVLink 1.0 links x 20 GB/s
        assert!(!p.device.has_fused_attention());
    }
    let d = preset("dgx1-p100-16gb").unwrap();
    assert_eq!(d.node.gpus_per_node, 8);
    let net = d.network.as_ref().unwrap();
    assert_eq!((net.nics_per_node, net.nic_gbit), (4, 100.0));
    let ff = preset("p100x4-nvlink-edr").unwrap();
    assert_eq!(ff.node.gpus_per_node, 4);
    assert_eq!(ff.network.as_ref().unwrap().nic_gbit, 100.0);

    // A K80 "GPU" is one GK210 die: 12 GiB, 240 GB/s, half a board's 8.74 TFLOPS, fp32 only.
    for name in ["aws-p2-8xlarge-k80", "gce-k80x8", "k80x4-pcie-fdr"] {
        let p = preset(name).unwrap();
        assert_eq!((gib(&p), p.device.hbm_gbps), (12.0, 240.0), "{name}");
        assert_eq!(tf(&p, Precision::Fp32), Some(4.37));
        assert_eq!(p.device.supported_precisions(), vec![Precision::Fp32]);
        let e = p.peak_flops(Precision::Fp16).unwrap_err();
        assert!(matches!(e, HwError::UnsupportedPrecision { .. }), "{e}");
        assert_eq!(p.node.intra_fabric, FabricKind::Pcie);
        assert_eq!(p.node.intra_gbps, 15.75);
        // Two dies share their board's x16 uplink.
        assert_eq!(p.node.pcie_host_gbps, Some(15.75 / 2.0));
    }
    let aws = preset("aws-p2-8xlarge-k80").unwrap();
    assert_eq!(aws.node.gpus_per_node, 8);
    assert_eq!(aws.network.as_ref().unwrap().node_bandwidth().0 * 8.0, 10e9);
    assert_eq!(
        Cluster::parse("aws-p2-8xlarge-k80:gpus=64")
            .unwrap()
            .nodes(),
        8
    );
    let gce = preset("gce-k80x8").unwrap();
    assert_eq!(gce.node.gpus_per_node, 8);
    assert_eq!(gce.network.as_ref().unwrap().nic_gbit, 16.0);
    let k = preset("k80x4-pcie-fdr").unwrap();
    assert_eq!(k.node.gpus_per_node, 4); // 4 dies = 2 boards per node
    let net = k.network.as_ref().unwrap();
    assert_eq!(net.nic_gbit, 56.0);
    // FDR's 56 Gb/s is signalling: the achieved share sits below EDR's 0.96.
    assert!(k.collectives.inter_busbw_efficiency.unwrap() < 0.96);

    // P40: 24 GB GDDR5, fp32 only (GP102's fp16 rate is 1/64), one server, no network.
    let p40 = preset("p40x8-pcie").unwrap();
    assert_eq!((gib(&p40), p40.device.hbm_gbps), (24.0, 346.0));
    assert_eq!(p40.device.supported_precisions(), vec![Precision::Fp32]);
    assert_eq!(p40.node.gpus_per_node, 8);
    assert_eq!(p40.node.intra_fabric, FabricKind::Pcie);
    assert!(p40.network.is_none());
    assert!(Cluster::parse("p40x8-pcie:gpus=16").is_err());

    // GEMM curves of the SIMT chips: monotone, and a K80 die (13 SMX of 192 lanes) fills at the
    // GEMM sizes a P100 (56 SMs of 64) does.
    for name in ["dgx1-p100-16gb", "aws-p2-8xlarge-k80", "p40x8-pcie"] {
        let dev = preset(name).unwrap().device;
        let mut prev = 0.0;
        for k in 0..60 {
            let e = dev.matmul_efficiency(10f64.powf(6.0 + k as f64 * 0.1));
            assert!(e >= prev, "{name}");
            prev = e;
        }
    }
    for flops in [1e7, 1e8, 1e9, 1e10, 1e11] {
        assert_eq!(
            aws.device.matmul_efficiency(flops),
            d.device.matmul_efficiency(flops)
        );
    }
}

#[test]
fn collective_factors_reproduce_the_reference_busbw() {
    let gb = |b: parallax_ir::BytesPerSec| b.0 / 1e9;
    let a = preset("dgx-a100-80gb").unwrap();
    assert!(close(gb(a.intra_busbw()), 230.0, 0.01)); // nccl-a100-8gpu-allreduce
    assert!(close(gb(a.inter_busbw_per_nic().unwrap()), 24.0, 0.01)); // nccl-hdr-per-nic
    assert!(a.nvls_allreduce_busbw(8).is_none());

    let h = preset("dgx-h100-80gb").unwrap();
    assert!(close(gb(h.intra_busbw()), 370.0, 0.01)); // nccl-h100-8gpu-ring-effective
    assert!(close(gb(h.nvls_allreduce_busbw(8).unwrap()), 480.0, 0.01)); // ...-allreduce-nvls
    let ndr = gb(h.inter_busbw_per_nic().unwrap());
    assert!((46.0..=48.0).contains(&ndr), "{ndr}"); // nccl-ndr-per-nic
    assert!(close(
        gb(h.inter_busbw_per_node().unwrap()),
        8.0 * ndr,
        1e-9
    ));
}

#[test]
fn matmul_curves_hit_the_reference_mamf() {
    let a = preset("dgx-a100-80gb").unwrap();
    // stas00 MAMF A100 SXM bf16: 1024x10240x5120 at 86.9 %.
    let f = 2.0 * 1024.0 * 10240.0 * 5120.0;
    assert!(close(a.device.matmul_efficiency(f), 0.869, 0.01));
    let h = preset("dgx-h100-80gb").unwrap();
    let f = 2.0 * 2048.0 * 2048.0 * 13312.0;
    assert!(close(h.device.matmul_efficiency(f), 0.803, 0.01));
    // fp8 e4m3: 70.9 %.
    assert!(close(
        h.device.matmul_efficiency_for(Precision::Fp8, 1e13),
        0.709,
        0.01
    ));
    // Small GEMMs are far less efficient than large ones, and the curve rises monotonically.
    assert!(h.device.matmul_efficiency(1e8) < 0.1);
    let mut prev = 0.0;
    for k in 0..60 {
        let e = h.device.matmul_efficiency(10f64.powf(6.0 + k as f64 * 0.1));
        assert!(e >= prev);
        prev = e;
    }
}

#[test]
fn cpu_local_uses_the_detected_cores() {
    let p = preset(CPU_LOCAL).unwrap();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    assert_eq!(p.node.gpus_per_node, cores);
    assert_eq!(p.node.intra_fabric, FabricKind::HostMemory);
    assert!(p.network.is_none());
    assert!(p.node.pcie_host_gbps.is_none());
    let c = Cluster::parse("cpu-local").unwrap();
    assert_eq!(c.gpus, cores);
}

// ---------------------------------------------------------------- round trip

#[test]
fn every_preset_round_trips_through_toml() {
    for name in preset_names() {
        let p = preset(name).unwrap();
        let text = p.to_toml_string().unwrap();
        let back = ClusterProfile::from_toml_str(&text, "written.toml").unwrap();
        let mut expect = p.clone();
        expect.origin = "written.toml".into();
        assert_eq!(back, expect, "{name}:\n{text}");
    }
}

#[test]
fn calibration_table_round_trips_and_save_load_works() {
    let mut p = preset("dgx-a100-80gb").unwrap();
    p.calibration = Some(Calibration {
        provenance: "parallax calibrate --backend cuda, 2025-01-01, 12 GEMM shapes".into(),
        fitted_at: Some("2025-01-01T00:00:00Z".into()),
        fitted_fields: vec!["device.matmul_efficiency".into()],
        step_time_band: Some(0.08),
    });
    p.device.matmul_efficiency = EfficiencyCurve(vec![(1e8, 0.1), (1e11, 0.8)]);
    let dir = std::env::temp_dir().join(format!("parallax-hw-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("calibrated.toml");
    p.save(&path).unwrap();
    let back = ClusterProfile::load(&path).unwrap();
    assert_eq!(back.calibration, p.calibration);
    assert_eq!(back.device, p.device);
    let c = Cluster::parse(&format!("{}:gpus=16", path.display())).unwrap();
    assert_eq!(c.nodes(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- bad input

#[test]
fn unknown_key_names_file_line_and_dotted_key() {
    let bad = GOOD.replace("nic_gbit = 200.0", "nic_gbit = 200.0\nnic_gbits = 1.0");
    let msg = err_of(&bad);
    let line = bad
        .lines()
        .position(|l| l.starts_with("nic_gbits"))
        .unwrap()
        + 1;
    assert!(
        msg.starts_with(&format!("bad.toml:{line}:1: network.nic_gbits: ")),
        "{msg}"
    );
    assert!(msg.contains("unknown field `nic_gbits`"), "{msg}");

    let bad = GOOD.replace("[collectives]", "[collectives]\nfoo = 1");
    let msg = err_of(&bad);
    assert!(msg.contains("collectives.foo"), "{msg}");

    let bad = format!("{GOOD}\n[extra]\nx = 1\n");
    let msg = err_of(&bad);
    assert!(msg.contains(": extra: unknown field `extra`"), "{msg}");
}

#[test]
fn type_errors_and_syntax_errors_are_one_line_with_position() {
    let bad = GOOD.replace("gpus_per_node = 8", "gpus_per_node = \"eight\"");
    let msg = err_of(&bad);
    let line = bad
        .lines()
        .position(|l| l.starts_with("gpus_per_node"))
        .unwrap()
        + 1;
    assert!(msg.starts_with(&format!("bad.toml:{line}:")), "{msg}");
    assert!(msg.contains("node.gpus_per_node"), "{msg}");

    let msg = err_of(&GOOD.replace("gpus_per_node = 8", "gpus_per_node = -8"));
    assert!(msg.contains("node.gpus_per_node"), "{msg}");

    let msg = err_of(&GOOD.replace("[node]", "[node"));
    let line = GOOD.lines().position(|l| l == "[node]").unwrap() + 1;
    assert!(msg.starts_with(&format!("bad.toml:{line}:")), "{msg}");
    assert!(
        !msg.contains("device"),
        "a syntax error is not blamed on a key: {msg}"
    );

    let msg = err_of(&GOOD.replace("topology = \"fat-tree\"", "topology = \"torus\""));
    assert!(msg.contains("network.topology"), "{msg}");
    assert!(msg.contains("torus"), "{msg}");
}

#[test]
fn missing_key_is_named() {
    let msg = err_of(&GOOD.replace("hbm_gbps = 2000.0\n", ""));
    assert!(msg.contains("hbm_gbps"), "{msg}");
    assert!(msg.contains("missing"), "{msg}");
}

#[test]
fn range_errors_name_the_field() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "hbm_gib = 80.0",
            "hbm_gib = 0.0",
            "bad.toml: device.hbm_gib: must be a positive number, got 0",
        ),
        (
            "hbm_gbps = 2000.0",
            "hbm_gbps = -1.0",
            "bad.toml: device.hbm_gbps: must be a positive number",
        ),
        (
            "peak_tflops_bf16 = 300.0",
            "peak_tflops_bf16 = -3.0",
            "device.peak_tflops_bf16: must be zero or a positive number",
        ),
        (
            "memory_efficiency = 0.85",
            "memory_efficiency = 1.5",
            "device.memory_efficiency: must satisfy 0 < value <= 1, got 1.5",
        ),
        (
            "memory_efficiency = 0.85",
            "memory_efficiency = 0.0",
            "device.memory_efficiency: must satisfy 0 < value <= 1",
        ),
        (
            "memory_efficiency = 0.85",
            "memory_efficiency = nan",
            "device.memory_efficiency",
        ),
        (
            "memory_efficiency = 0.85",
            "memory_efficiency = 0.85\nnative_attention_speedup = 0.5",
            "device.native_attention_speedup: must satisfy 1 <= value <= 4, got 0.5",
        ),
        (
            "[[1e9, 0.35], [1e11, 0.7], [1e12, 0.85]]",
            "[[1e9, 0.35], [1e12, 0.7], [1e11, 0.85]]",
            "device.matmul_efficiency[2]: sizes must be sorted",
        ),
        (
            "[[1e9, 0.35], [1e11, 0.7], [1e12, 0.85]]",
            "[[1e9, 0.35], [1e11, 1.7]]",
            "device.matmul_efficiency[1]: efficiency must satisfy 0 < efficiency <= 1",
        ),
        (
            "[[1e9, 0.35], [1e11, 0.7], [1e12, 0.85]]",
            "[[0.0, 0.35]]",
            "device.matmul_efficiency[0]: size must be a positive number",
        ),
        (
            "[[1e9, 0.35], [1e11, 0.7], [1e12, 0.85]]",
            "[]",
            "device.matmul_efficiency: must have at least one",
        ),
        (
            "gpus_per_node = 8",
            "gpus_per_node = 0",
            "node.gpus_per_node: must be at least 1",
        ),
        (
            "intra_gbps = 300.0",
            "intra_gbps = 0.0",
            "node.intra_gbps: must be a positive number",
        ),
        (
            "nic_gbit = 200.0",
            "nic_gbit = -200.0",
            "bad.toml: network.nic_gbit: must be a positive number, got -200",
        ),
        (
            "nics_per_node = 8",
            "nics_per_node = 0",
            "network.nics_per_node: must be at least 1",
        ),
        (
            "oversubscription = 1.0",
            "oversubscription = 0.5",
            "network.oversubscription: must be >= 1.0",
        ),
        (
            "oversubscription = 1.0",
            "oversubscription = 1.0\nnodes_per_leaf = 0",
            "network.nodes_per_leaf: must be at least 1",
        ),
        (
            "latency_us = 5.0",
            "latency_us = -5.0",
            "network.latency_us: must be zero or a positive number",
        ),
        (
            "intra_busbw_efficiency = 0.77",
            "intra_busbw_efficiency = 1.01",
            "collectives.intra_busbw_efficiency: must satisfy 0 < value <= 1",
        ),
        (
            "inter_busbw_efficiency = 0.96\n",
            "",
            "collectives.inter_busbw_efficiency: missing; required when [network] is present",
        ),
        (
            "intra_latency_us = 2.0",
            "intra_latency_us = 2.0\nnvls = true",
            "collectives.nvls_allreduce_algbw_efficiency: missing; required when node.nvls = true",
        ),
        (
            "intra_fabric = \"nvswitch\"",
            "intra_fabric = \"pcie\"\nnvls = true",
            "node.nvls: NVLink SHARP needs",
        ),
        (
            "name = \"G\"",
            "name = \"\"",
            "device.name: must not be empty",
        ),
    ];
    for (from, to, want) in cases {
        assert!(GOOD.contains(from), "fixture lacks {from}");
        let msg = err_of(&GOOD.replacen(from, to, 1));
        assert!(msg.contains(want), "{to}: got `{msg}`, want `{want}`");
    }
}

#[test]
fn scale_and_calibration_are_checked() {
    let with_scale = format!("{GOOD}\n[device.matmul_efficiency_scale]\nfp8 = 1.5\n");
    // The sub-table must come after [device]'s keys; appending after [collectives] is still
    // valid TOML because dotted headers can appear anywhere.
    let msg = err_of(&with_scale);
    assert!(
        msg.contains("device.matmul_efficiency_scale.fp8: must satisfy 0 < value <= 1"),
        "{msg}"
    );
    let bad_key = format!("{GOOD}\n[device.matmul_efficiency_scale]\nint8 = 0.5\n");
    let msg = err_of(&bad_key);
    assert!(msg.contains("unknown field `int8`"), "{msg}");
    let cal = format!("{GOOD}\n[calibration]\nprovenance = \" \"\n");
    assert!(err_of(&cal).contains("calibration.provenance: must not be empty"));
    let cal = format!("{GOOD}\n[calibration]\nprovenance = \"fit\"\nwhen = 1\n");
    assert!(err_of(&cal).contains("unknown field `when`"));
}

#[test]
fn network_less_profile_rejects_inter_efficiency() {
    let start = GOOD.find("[network]").unwrap();
    let end = GOOD.find("[collectives]").unwrap();
    let no_net = format!("{}{}", &GOOD[..start], &GOOD[end..]);
    let msg = err_of(&no_net);
    assert!(
        msg.contains("collectives.inter_busbw_efficiency: given but there is no [network]"),
        "{msg}"
    );
    let ok = no_net.replace("inter_busbw_efficiency = 0.96\n", "");
    let p = ClusterProfile::from_toml_str(&ok, "x.toml").unwrap();
    assert!(p.inter_busbw_per_node().is_none());
}

// ---------------------------------------------------------------- cluster specs

#[test]
fn cluster_specs_parse() {
    let c = Cluster::parse("dgx-a100-80gb:gpus=1024").unwrap();
    assert_eq!((c.gpus, c.nodes(), c.gpus_per_node()), (1024, 128, 8));
    assert!(!c.is_partial_node());

    let c = Cluster::parse("dgx-h100-80gb").unwrap();
    assert_eq!((c.gpus, c.nodes()), (8, 1));

    let c = Cluster::parse("dgx-a100-40gb:gpus=2").unwrap();
    assert_eq!((c.gpus, c.nodes(), c.gpus_per_node()), (2, 1, 2));
    assert!(c.is_partial_node());

    let c = Cluster::parse("dgx2-v100-32gb:gpus=1").unwrap();
    assert_eq!(c.nodes(), 1);
    let c = Cluster::parse(" jean-zay-v100-32gb:gpus=8 ").unwrap();
    assert_eq!(c.nodes(), 2);
    assert_eq!(
        c.to_string(),
        "jean-zay-v100-32gb:gpus=8 (2 nodes x 4 V100-SXM2-32GB)"
    );

    let c = Cluster::new(preset("dgx-h100-80gb").unwrap(), 16).unwrap();
    assert_eq!(c.nodes(), 2);
    assert_eq!(
        Cluster::one_node(preset("titan-rtx-2x-pcie").unwrap()).gpus,
        2
    );
}

fn spec_err(spec: &str) -> String {
    let e = Cluster::parse(spec).unwrap_err();
    let s = e.to_string();
    assert!(!s.contains('\n'), "{s:?}");
    s
}

#[test]
fn bad_cluster_specs_are_one_line_errors() {
    let msg = spec_err("dgx-a100-80gb:gpus=12");
    assert!(
        msg.contains("gpus=12 does not fill whole nodes of 8 GPUs"),
        "{msg}"
    );
    assert!(
        msg.starts_with("cluster `dgx-a100-80gb:gpus=12`: "),
        "{msg}"
    );

    let msg = spec_err("dgx-a100-80gb:gpus=0");
    assert!(msg.contains("gpus must be at least 1, got 0"), "{msg}");
    let msg = spec_err("dgx-a100-80gb:gpus=lots");
    assert!(msg.contains("gpus must be a whole number"), "{msg}");
    let msg = spec_err("dgx-a100-80gb:gpus=-8");
    assert!(msg.contains("gpus must be a whole number"), "{msg}");
    let msg = spec_err("dgx-a100-80gb:nodes=2");
    assert!(msg.contains("unknown option `nodes`"), "{msg}");
    let msg = spec_err("dgx-a100-80gb:8");
    assert!(msg.contains("expected `gpus=N`"), "{msg}");
    let msg = spec_err("");
    assert!(msg.contains("empty"), "{msg}");

    let msg = spec_err("dgx-a100-81gb:gpus=8");
    assert!(
        msg.starts_with("unknown cluster preset `dgx-a100-81gb`; available presets: "),
        "{msg}"
    );
    assert!(
        msg.contains("dgx-a100-80gb") && msg.contains("cpu-local"),
        "{msg}"
    );

    let msg = spec_err("/no/such/dir/profile.toml:gpus=8");
    assert!(
        msg.starts_with("/no/such/dir/profile.toml: cannot read cluster profile:"),
        "{msg}"
    );

    let msg = spec_err("titan-rtx-2x-nvlink:gpus=4");
    assert!(msg.contains("has no [network]"), "{msg}");

    assert!(Cluster::new(preset("dgx-a100-80gb").unwrap(), 0).is_err());
    assert!(Cluster::new(preset("dgx-a100-80gb").unwrap(), 20).is_err());
}

#[test]
fn invalid_file_error_names_the_path() {
    let dir = std::env::temp_dir().join(format!("parallax-hw-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, GOOD.replace("nic_gbit = 200.0", "nic_gbit = -1.0")).unwrap();
    let msg = Cluster::parse(&format!("{}:gpus=16", path.display()))
        .unwrap_err()
        .to_string();
    assert_eq!(
        msg,
        format!(
            "{}: network.nic_gbit: must be a positive number, got -1",
            path.display()
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_driver_device_name_finds_its_preset() {
    use crate::preset_for_device;
    // Names as `nvidia-smi` / cuDeviceGetName report them, with the memory the driver gives.
    assert_eq!(
        preset_for_device("NVIDIA H200", 139.8),
        Some("hgx-h200-141gb")
    );
    assert_eq!(
        preset_for_device("NVIDIA H100 80GB HBM3", 79.1),
        Some("dgx-h100-80gb")
    );
    assert_eq!(
        preset_for_device("NVIDIA A100-SXM4-40GB", 39.4),
        Some("dgx-a100-40gb")
    );
    assert_eq!(
        preset_for_device("NVIDIA A100-SXM4-80GB", 79.2),
        Some("dgx-a100-80gb")
    );
    let v100 = preset_for_device("Tesla V100-SXM2-16GB", 15.8).unwrap();
    assert_eq!(crate::preset(v100).unwrap().device.name, "V100-SXM2-16GB");
    assert_eq!(
        preset_for_device("NVIDIA TITAN RTX", 23.6),
        Some("titan-rtx-2x-nvlink")
    );
    assert_eq!(preset_for_device("NVIDIA GeForce RTX 4090", 23.6), None);
    assert_eq!(
        preset_for_device("NVIDIA H100 NVL", 93.0),
        Some("grand-teton-h100-96gb")
    );
}

/// The measured kernel tables of host cores: read back as written, and each bad entry named
/// by its field path in one line.
#[test]
fn host_kernel_tables_parse_and_name_their_bad_entries() {
    let cpu = preset_toml("cpu-local").unwrap();
    let with = |table: &str| {
        cpu.replacen(
            "\n[node]",
            &format!("\n[device.host_kernels.graph]\n{table}\n\n[node]"),
            1,
        )
    };
    let p = ClusterProfile::from_toml_str(
        &with("conv2d = [[9216.0, 3e9, 1e9], [451584.0, 6.6e9, 1.9e9]]"),
        "cpu.toml",
    )
    .unwrap();
    let rates = p
        .device
        .host_kernels
        .as_ref()
        .and_then(|h| h.rates(HostTrainer::Graph, "conv2d"))
        .unwrap();
    assert_eq!(rates.0.len(), 2);
    assert!(p
        .device
        .host_kernels
        .as_ref()
        .unwrap()
        .rates(HostTrainer::Transformer, "conv2d")
        .is_none());
    let e = err_of(&with("warp = [[1.0, 1.0, 1.0]]"));
    assert!(
        e.contains("device.host_kernels.graph.warp") && e.contains("unknown op class"),
        "{e}"
    );
    let e = err_of(&with("relu = [[1e4, 1e9, 1e9], [1e3, 1e9, 1e9]]"));
    assert!(
        e.contains("device.host_kernels.graph.relu[1]") && e.contains("increase"),
        "{e}"
    );
    let e = err_of(&with("relu = [[1e4, -1e9, 1e9]]"));
    assert!(e.contains("positive"), "{e}");
}
