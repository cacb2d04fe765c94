//! ONNX importer against the checked-in fixtures (built by `tests/fixtures/make_onnx.py`).

use parallax_ir::import::onnx::{import_onnx, import_onnx_bytes};
use parallax_ir::import::ImportError;
use parallax_ir::op::OpKind;
use parallax_ir::{Graph, Shape, TensorRole};
use proptest::prelude::*;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixture(name)).unwrap()
}

fn count(g: &Graph, op: &str) -> usize {
    g.op_histogram().get(op).copied().unwrap_or(0)
}

fn fwd_flops_of(g: &Graph, ops: &[&str]) -> f64 {
    g.nodes
        .iter()
        .filter(|n| ops.contains(&n.op.name()))
        .map(|n| g.node_work(n, 4).fwd_flops.0)
        .sum()
}

/// Multiply-adds of ResNet-50's 53 convolutions at 224x224, one image (fvcore / ptflops count;
/// torchvision quotes it rounded as "4.09 GFLOPS", which are in fact GMACs).
const RESNET50_CONV_MACS: f64 = 4_087_136_256.0;

#[test]
fn resnet50_params_flops_and_shape() {
    let g = import_onnx(&fixture("resnet50.onnx")).unwrap();
    // torchvision's count: conv weights + BN scale/shift + fc; BN running stats are buffers.
    assert_eq!(g.param_count(), 25_557_032);
    assert_eq!(g.tensor(g.outputs[0]).shape, Shape::new([1, 1000]));
    assert_eq!(count(&g, "conv2d"), 53);
    assert_eq!(count(&g, "batch_norm"), 53);
    assert_eq!(count(&g, "linear"), 1);
    assert!(g.tensors.iter().all(|t| !t.name.contains("running")));

    // Our convention: a multiply-add is 2 FLOPs. Convolutions: 2 x 4.087 GMACs = 8.174 GFLOPs;
    // fc: 2 x 2048 x 1000 + 1000 (bias) = 4.097 MFLOPs.
    let convs = fwd_flops_of(&g, &["conv2d"]);
    assert_eq!(convs, 2.0 * RESNET50_CONV_MACS);
    assert_eq!(fwd_flops_of(&g, &["linear"]), 4_097_000.0);
    // Everything else is elementwise: BN (8/elem) 88.9 M, ReLU 9.6 M, residual adds 5.5 M,
    // pools 1.9 M, so the whole forward is 8.284 GFLOPs per image (~4.14 G multiply-adds).
    let total = g.total_work(4).fwd_flops.0;
    assert!((8.27e9..8.30e9).contains(&total), "{total}");
    assert_eq!(total, 8_284_316_136.0);

    // The symbolic batch takes the requested size; work scales with it.
    let g8 = import_onnx_bytes(&bytes("resnet50.onnx"), "resnet50", Some(8)).unwrap();
    assert_eq!(g8.tensor(g8.outputs[0]).shape, Shape::new([8, 1000]));
    assert_eq!(g8.param_count(), 25_557_032);
    assert_eq!(g8.total_work(4).fwd_flops.0, 8.0 * total);
}

#[test]
fn mlp_params_and_transposed_gemm_weights() {
    let g = import_onnx(&fixture("mlp.onnx")).unwrap();
    assert_eq!(
        g.param_count(),
        784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    );
    assert_eq!(g.param_count(), 535_818);
    assert_eq!(g.tensor(g.outputs[0]).shape, Shape::new([1, 10]));
    assert_eq!(count(&g, "linear"), 3);
    assert_eq!(count(&g, "relu"), 2);
    // Gemm transB=1 stores (out, in); our Linear weight is (in, out).
    let w1 = g.tensors.iter().find(|t| t.name == "fc1.weight").unwrap();
    assert_eq!(w1.shape, Shape::new([784, 512]));
    assert_eq!(w1.role, TensorRole::Weight);
    let g = import_onnx_bytes(&bytes("mlp.onnx"), "mlp", Some(32)).unwrap();
    assert_eq!(g.tensor(g.outputs[0]).shape, Shape::new([32, 10]));
}

#[test]
fn lstm_lm_shapes_and_params() {
    let g = import_onnx_bytes(&bytes("lstm_lm.onnx"), "lstm_lm", Some(4)).unwrap();
    // Tokens are (seq 35, batch); logits (35, batch, 10000).
    assert_eq!(g.tensor(g.outputs[0]).shape, Shape::new([35, 4, 10000]));
    assert_eq!(count(&g, "embedding"), 1);
    assert_eq!(count(&g, "lstm"), 2);
    assert_eq!(count(&g, "dropout"), 1);
    for n in g.nodes.iter().filter(|n| matches!(n.op, OpKind::Lstm(_))) {
        assert_eq!(
            n.op,
            OpKind::Lstm(parallax_ir::op::RnnAttrs { hidden: 650 })
        );
        // Batch-first inside: x (b, s, i), w_ih (i, 4h), w_hh (h, 4h), bias (4h).
        let ins = g.input_shapes(n);
        assert_eq!(ins[0], Shape::new([4, 35, 650]));
        assert_eq!(ins[1], Shape::new([650, 2600]));
        assert_eq!(ins[2], Shape::new([650, 2600]));
        assert_eq!(ins[3], Shape::new([2600]));
        assert_eq!(g.output_shapes(n)[0], Shape::new([4, 35, 650]));
    }
    assert!(g
        .nodes
        .iter()
        .any(|n| n.op == OpKind::Dropout(parallax_ir::op::DropoutAttrs { rate_permille: 500 })));
    assert_eq!(g.embedding_params(), 10_000 * 650);
    // Embedding 6.5 M + 2 layers x (2 x 4·650·650 + 4·650) + head 650·10000 + 10000. ONNX's
    // B holds two bias vectors (Wb, Rb) per layer; the importer folds them into one, so the
    // file's own count is 2 x 2600 higher (19,780,400).
    let layer = 2 * 4 * 650 * 650 + 4 * 650;
    assert_eq!(g.param_count(), 6_500_000 + 2 * layer + 6_500_000 + 10_000);
    assert_eq!(g.param_count(), 19_775_200);
}

#[test]
fn unsupported_ops_are_all_listed_once() {
    let path = fixture("unsupported.onnx");
    let e = import_onnx(&path).unwrap_err();
    match &e {
        ImportError::OnnxUnsupportedOps { file, ops } => {
            assert_eq!(ops, &["NonMaxSuppression", "TopK"]);
            assert!(file.ends_with("unsupported.onnx"));
        }
        other => panic!("wrong error: {other}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("unsupported.onnx"), "{msg}");
    assert!(msg.contains("NonMaxSuppression, TopK"), "{msg}");
    assert!(msg.contains("supported: Add, AveragePool"), "{msg}");
    assert!(!msg.contains('\n'));
}

#[test]
fn garbage_and_truncated_files_give_clean_errors() {
    let e =
        import_onnx_bytes(b"\xff\xff\xff\xffnot a model at all", "junk.onnx", None).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("junk.onnx: not a valid ONNX model"),
        "{msg}"
    );
    assert!(!msg.contains('\n'));

    let full = bytes("resnet50.onnx");
    let e = import_onnx_bytes(&full[..full.len() / 2], "half.onnx", None).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("half.onnx: not a valid ONNX model"),
        "{msg}"
    );

    let e = import_onnx_bytes(b"", "empty.onnx", None).unwrap_err();
    assert!(
        e.to_string().contains("empty.onnx: not a valid ONNX model"),
        "{e}"
    );

    let e = import_onnx(&fixture("does-not-exist.onnx")).unwrap_err();
    assert!(matches!(e, ImportError::Io { .. }), "{e}");
    assert!(e.to_string().contains("does-not-exist.onnx"), "{e}");
}

#[test]
fn every_prefix_of_every_fixture_imports_or_errors_without_panicking() {
    for (name, step) in [
        ("mlp.onnx", 1),
        ("lstm_lm.onnx", 1),
        ("unsupported.onnx", 1),
        ("resnet50.onnx", 13),
    ] {
        let full = bytes(name);
        for len in (0..full.len()).step_by(step) {
            let r = import_onnx_bytes(&full[..len], name, None);
            if let Err(e) = r {
                assert!(!e.to_string().contains('\n'), "{e}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = import_onnx_bytes(&data, "random", None);
    }

    #[test]
    fn corrupted_fixtures_never_panic(
        which in 0usize..3,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        batch in proptest::option::of(1u64..64),
    ) {
        let name = ["mlp.onnx", "lstm_lm.onnx", "resnet50.onnx"][which];
        let mut data = bytes(name);
        for (at, v) in edits {
            let i = at.index(data.len());
            data[i] = v;
        }
        if let Err(e) = import_onnx_bytes(&data, name, batch) {
            prop_assert!(!e.to_string().contains('\n'));
        }
    }
}

#[test]
fn a_loaded_onnx_model_takes_the_batch_asked_for() {
    let m = parallax_ir::load_model(fixture("resnet50.onnx").to_str().unwrap()).unwrap();
    let flops = |b| m.graph(b, 1, true).unwrap().total_work(4).fwd_flops.0;
    let (one, eight) = (flops(1), flops(8));
    assert!((eight / one - 8.0).abs() < 1e-9, "{eight} vs 8 × {one}");
}
