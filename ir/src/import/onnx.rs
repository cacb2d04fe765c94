//! ONNX importer: decodes an `.onnx` file (protobuf, no `protoc` needed) and rebuilds its graph
//! with parallax ops, running our shape rules on every node.
//!
//! Only shapes are read, never weight values: initializers may be stripped of their data (the
//! test fixtures are) or stored externally. Small integer constants that an op reads as a value
//! (Reshape / Squeeze / Unsqueeze / Split arguments, the Dropout ratio) must carry data.
//!
//! # Mapping
//!
//! | ONNX | parallax |
//! |---|---|
//! | `Conv` (2-D, symmetric or `SAME_*` padding) | `Conv2d`, weight `(o, c/g, kh, kw)` as stored |
//! | `BatchNormalization` | `BatchNorm` on `[x, scale, B]`; running mean / var are buffers and are dropped |
//! | `Relu`, `Sigmoid`, `Tanh`, `Gelu` | `Activation` |
//! | `MaxPool`, `AveragePool` (2-D) | `Pool2d` |
//! | `GlobalAveragePool` | `GlobalAvgPool` |
//! | `Add`, `Mul` | `Add`, `Mul` (an initializer operand becomes a weight) |
//! | `Gemm` with an initializer `B` | `Linear`; our weight is `(in, out)`, so a `transB=1` weight `(out, in)` is recorded with the transposed shape (no data is read); a bias `C` of `out` elements becomes the Linear bias |
//! | `Gemm` with `transB=1` on a table already used as a weight (tied embedding) | `MatMul { transpose_b }` on the shared tensor, so the table counts once |
//! | `Gemm` with a computed `B` | `MatMul` (+ `Add` for `C`); `transA=1` inserts a `Transpose`; `alpha` / `beta` are ignored |
//! | `MatMul` with a rank-2 initializer `B` | `Linear` without bias; otherwise `MatMul` |
//! | `Flatten` | `Flatten` |
//! | `Reshape` (`0` copies the input dim unless `allowzero`, `-1` is inferred), `Squeeze`, `Unsqueeze` | `Reshape` |
//! | `Concat`, `Split`, `Transpose`, `Softmax` | same-named ops |
//! | `Dropout` | `Dropout` at its ratio (default 0.5) |
//! | `Identity` | nothing: its output aliases its input |
//! | `LSTM`, `GRU` (unidirectional) | `Lstm` / `Gru`, see below |
//! | `Gather` on a rank-2 initializer, axis 0 | `Embedding` |
//! | `LayerNormalization` over the last axis | `LayerNorm` (a missing bias becomes a fresh weight) |
//! | `Constant` | no node: a value source (Reshape shapes, …) |
//!
//! **Recurrent layers.** ONNX is sequence-first (`layout=0`): `X(s, b, i)`, `W(1, G·h, i)`,
//! `R(1, G·h, h)`, `B(1, 2·G·h)`, `Y(s, 1, b, h)`. Ours is batch-first `[x(b, s, i),
//! w_ih(i, G·h), w_hh(h, G·h), bias(G·h)] -> [b, s, h]` (G = 4 for LSTM, 3 for GRU). The
//! importer inserts a `Transpose` before the op and a `Transpose` + `Reshape` after it
//! (`layout=1` needs only the `Reshape`), records `W` and `R` with our transposed shapes and
//! folds ONNX's two bias vectors (`Wb`, `Rb`) into one of `G·h` (they are only ever summed), so
//! an imported RNN layer has `G·h` fewer parameters than the ONNX file stores; a missing `B`
//! becomes a fresh bias weight. `direction="reverse"` is accepted (same shapes and cost),
//! `bidirectional` is an error. Only the output `Y` may be read; `Y_h` / `Y_c`, peepholes `P`
//! and the `sequence_lens` / `initial_*` inputs are not modelled (the latter are ignored).
//!
//! **Inputs.** Graph inputs that are not initializers become [`TensorRole::Input`] tensors. Every
//! symbolic (`dim_param`) or unknown dimension — normally the batch — becomes the `batch` passed
//! to [`import_onnx_bytes`] (1 for [`import_onnx`]); fixed dimensions are kept.
//!
//! **Parameters.** Initializers become [`TensorRole::Weight`] tensors lazily, when an op reads
//! them as a weight or data operand, so buffers (BatchNorm running statistics) and shape
//! constants never count as parameters. A `Constant` node read as a data operand also becomes
//! a weight tensor. All imported nodes are in [`crate::Segment::Pre`]: ONNX carries no block
//! structure.
//!
//! Anything else is rejected after scanning the whole graph, with one error listing every
//! unsupported op type ([`ImportError::OnnxUnsupportedOps`]).
//!
//! [`TensorRole::Input`]: crate::TensorRole::Input
//! [`TensorRole::Weight`]: crate::TensorRole::Weight

use super::onnx_proto::{
    data_type, AttributeProto, DimensionValue, GraphProto, ModelProto, NodeProto, TensorProto,
};
use super::ImportError;
use crate::dtype::DType;
use crate::graph::{Graph, GraphBuilder, TensorId};
use crate::op::{
    Activation, ActivationAttrs, AxisAttrs, Conv2dAttrs, DropoutAttrs, EmbeddingAttrs, LinearAttrs,
    MatMulAttrs, OpKind, Pool2dAttrs, PoolKind, ReshapeAttrs, RnnAttrs, SoftmaxAttrs, SplitAttrs,
    TransposeAttrs,
};
use crate::shape::Shape;
use prost::Message;
use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Display;
use std::path::Path;
use std::rc::Rc;

/// ONNX op types (default domain) the importer maps; see the [module docs](self) for how.
pub const SUPPORTED_ONNX_OPS: &[&str] = &[
    "Add",
    "AveragePool",
    "BatchNormalization",
    "Concat",
    "Constant",
    "Conv",
    "Dropout",
    "Flatten",
    "GRU",
    "Gather",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "Identity",
    "LSTM",
    "LayerNormalization",
    "MatMul",
    "MaxPool",
    "Mul",
    "Relu",
    "Reshape",
    "Sigmoid",
    "Softmax",
    "Split",
    "Squeeze",
    "Tanh",
    "Transpose",
    "Unsqueeze",
];

/// Largest single dimension or size-like attribute accepted from a file (2^31). Together with
/// [`MAX_ELEMS`] it keeps every product the shape rules form far from `u64` overflow, so a
/// hostile file gives an error, not a panic.
const MAX_DIM: u64 = 1 << 31;

/// Largest element count of any tensor (2^53, still exact as an `f64` FLOP operand).
const MAX_ELEMS: u64 = 1 << 53;

/// Opset assumed for the default domain when a model declares none (ONNX 1.16's).
const DEFAULT_OPSET: i64 = 21;

/// Dropout ratio ONNX uses when none is given.
const DEFAULT_DROPOUT_RATIO: f64 = 0.5;

/// Imports an `.onnx` file with batch size 1 (see [`import_onnx_bytes`]).
pub fn import_onnx(path: &Path) -> Result<Graph, ImportError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| ImportError::Io {
        file: file.clone(),
        source,
    })?;
    import_onnx_bytes(&bytes, &file, None)
}

/// Imports a serialized ONNX model. `origin` names it in errors (usually the file path);
/// `batch` replaces every symbolic or unknown input dimension (default 1).
///
/// Never panics on any input: malformed bytes give [`ImportError::Onnx`] saying the data is not
/// a valid ONNX model, unsupported op types give [`ImportError::OnnxUnsupportedOps`].
pub fn import_onnx_bytes(
    bytes: &[u8],
    origin: &str,
    batch: Option<u64>,
) -> Result<Graph, ImportError> {
    let model = ModelProto::decode(bytes)
        .map_err(|e| err(origin, format!("not a valid ONNX model: {e}")))?;
    let graph = model
        .graph
        .as_ref()
        .ok_or_else(|| err(origin, "not a valid ONNX model: it has no graph"))?;
    let batch = batch.unwrap_or(1);
    if batch == 0 || batch > MAX_DIM {
        return Err(err(
            origin,
            format!("batch size {batch} must be in 1..={MAX_DIM}"),
        ));
    }
    let unsupported: BTreeSet<String> = graph
        .node
        .iter()
        .filter(|n| !is_supported(n))
        .map(display_op)
        .collect();
    if !unsupported.is_empty() {
        return Err(ImportError::OnnxUnsupportedOps {
            file: origin.to_string(),
            ops: unsupported.into_iter().collect(),
        });
    }
    let opset = model
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map(|o| o.version)
        .unwrap_or(DEFAULT_OPSET);
    let name = if graph.name.is_empty() {
        origin.to_string()
    } else {
        graph.name.clone()
    };
    let mut imp = Importer {
        file: origin,
        b: GraphBuilder::new(name),
        opset,
        batch,
        values: HashMap::new(),
        weights: HashMap::new(),
    };
    imp.graph_inputs(graph)?;
    for (i, node) in graph.node.iter().enumerate() {
        let name = if node.name.is_empty() {
            format!("{}_{i}", node.op_type)
        } else {
            node.name.clone()
        };
        imp.node(Cx {
            n: node,
            name: &name,
        })?;
    }
    imp.finish(graph)
}

fn err(file: &str, message: impl Into<String>) -> ImportError {
    ImportError::Onnx {
        file: file.to_string(),
        message: message.into(),
    }
}

/// A name from the file, safe to print on one line.
fn esc(s: &str) -> String {
    s.escape_debug().to_string()
}

fn is_default_domain(n: &NodeProto) -> bool {
    n.domain.is_empty() || n.domain == "ai.onnx"
}

fn is_supported(n: &NodeProto) -> bool {
    is_default_domain(n) && SUPPORTED_ONNX_OPS.contains(&n.op_type.as_str())
}

fn display_op(n: &NodeProto) -> String {
    if is_default_domain(n) {
        esc(&n.op_type)
    } else {
        format!("{}:{}", esc(&n.domain), esc(&n.op_type))
    }
}

/// Element count of `dims`, or `None` past [`MAX_ELEMS`].
fn checked_elems(dims: &[u64]) -> Option<u64> {
    dims.iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&e| e <= MAX_ELEMS)
}

fn dtype_of(elem_type: i32) -> Option<DType> {
    Some(match elem_type {
        data_type::FLOAT | data_type::DOUBLE => DType::F32,
        data_type::FLOAT16 => DType::F16,
        data_type::BFLOAT16 => DType::BF16,
        data_type::FLOAT8E4M3FN..=data_type::FLOAT8E5M2FNUZ => DType::F8,
        data_type::INT64 | data_type::UINT64 => DType::I64,
        data_type::INT32 | data_type::UINT32 | data_type::INT16 | data_type::UINT16 => DType::I32,
        data_type::UINT8 | data_type::INT8 => DType::U8,
        data_type::BOOL => DType::Bool,
        _ => return None,
    })
}

fn attr<'n>(n: &'n NodeProto, name: &str) -> Option<&'n AttributeProto> {
    n.attribute.iter().find(|a| a.name == name)
}

fn attr_i(n: &NodeProto, name: &str) -> Option<i64> {
    attr(n, name).map(|a| a.i)
}

fn attr_f(n: &NodeProto, name: &str) -> Option<f32> {
    attr(n, name).map(|a| a.f)
}

fn attr_ints<'n>(n: &'n NodeProto, name: &str) -> Option<&'n [i64]> {
    attr(n, name).map(|a| a.ints.as_slice())
}

fn attr_s(n: &NodeProto, name: &str) -> Option<String> {
    attr(n, name).map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

/// Integer values of a constant tensor, if it holds integer data.
fn tensor_ints(t: &TensorProto) -> Option<Vec<i64>> {
    let raw = &t.raw_data;
    match t.data_type {
        data_type::INT64 if !t.int64_data.is_empty() => Some(t.int64_data.clone()),
        data_type::INT64 if raw.len() % 8 == 0 => Some(
            raw.chunks_exact(8)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    i64::from_le_bytes(b)
                })
                .collect(),
        ),
        data_type::INT32 if !t.int32_data.is_empty() => {
            Some(t.int32_data.iter().map(|&v| i64::from(v)).collect())
        }
        data_type::INT32 if raw.len() % 4 == 0 => Some(
            raw.chunks_exact(4)
                .map(|c| {
                    let mut b = [0u8; 4];
                    b.copy_from_slice(c);
                    i64::from(i32::from_le_bytes(b))
                })
                .collect(),
        ),
        _ => None,
    }
}

/// Floating-point values of a constant tensor, if it holds float data.
fn tensor_floats(t: &TensorProto) -> Option<Vec<f64>> {
    let raw = &t.raw_data;
    match t.data_type {
        data_type::FLOAT if !t.float_data.is_empty() => {
            Some(t.float_data.iter().map(|&v| f64::from(v)).collect())
        }
        data_type::FLOAT if raw.len() % 4 == 0 => Some(
            raw.chunks_exact(4)
                .map(|c| {
                    let mut b = [0u8; 4];
                    b.copy_from_slice(c);
                    f64::from(f32::from_le_bytes(b))
                })
                .collect(),
        ),
        data_type::DOUBLE if !t.double_data.is_empty() => Some(t.double_data.clone()),
        data_type::DOUBLE if raw.len() % 8 == 0 => Some(
            raw.chunks_exact(8)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    f64::from_le_bytes(b)
                })
                .collect(),
        ),
        _ => None,
    }
}

/// What an ONNX value name refers to while importing.
#[derive(Clone, Debug)]
enum Value<'a> {
    /// A tensor of the graph being built.
    Tensor(TensorId),
    /// An initializer or `Constant` value: becomes a weight when read as data.
    Const(ConstRef<'a>),
    /// An output the importer does not model; reading it is an error with this reason.
    Unusable(String),
}

/// The node being imported and the name its parallax nodes take.
#[derive(Clone, Copy)]
struct Cx<'a, 'c> {
    n: &'a NodeProto,
    name: &'c str,
}

type R<T> = Result<T, ImportError>;

/// A constant tensor, borrowed from the model or built from a `Constant` attribute.
type ConstRef<'a> = Rc<Cow<'a, TensorProto>>;

/// A constant with the value name it was read under.
type Named<'a> = (&'a str, ConstRef<'a>);

struct Importer<'a> {
    file: &'a str,
    b: GraphBuilder,
    opset: i64,
    batch: u64,
    values: HashMap<&'a str, Value<'a>>,
    /// Weight tensors made from constants, by value name, with the shape they were given.
    weights: HashMap<String, Vec<(Vec<u64>, TensorId)>>,
}

impl<'a> Importer<'a> {
    fn e(&self, cx: Cx, msg: impl Display) -> ImportError {
        err(
            self.file,
            format!("{} node '{}': {msg}", esc(&cx.n.op_type), esc(cx.name)),
        )
    }

    fn graph_inputs(&mut self, g: &'a GraphProto) -> R<()> {
        for t in &g.initializer {
            self.values
                .insert(t.name.as_str(), Value::Const(Rc::new(Cow::Borrowed(t))));
        }
        for vi in &g.input {
            if self.values.contains_key(vi.name.as_str()) {
                continue; // Old IR versions list initializers among the inputs too.
            }
            let what = format!("graph input '{}'", esc(&vi.name));
            let tt = vi
                .r#type
                .as_ref()
                .and_then(|t| t.tensor_type.as_ref())
                .ok_or_else(|| err(self.file, format!("{what} is not a tensor")))?;
            let dtype = dtype_of(tt.elem_type).ok_or_else(|| {
                err(
                    self.file,
                    format!("{what} has unsupported element type {}", tt.elem_type),
                )
            })?;
            let shape = tt
                .shape
                .as_ref()
                .ok_or_else(|| err(self.file, format!("{what} has no shape")))?;
            let mut dims = Vec::with_capacity(shape.dim.len());
            for d in &shape.dim {
                dims.push(match d.value {
                    Some(DimensionValue::DimValue(v)) if v > 0 => {
                        if v as u64 > MAX_DIM {
                            return Err(err(
                                self.file,
                                format!("{what} has dimension {v}, above {MAX_DIM}"),
                            ));
                        }
                        v as u64
                    }
                    _ => self.batch,
                });
            }
            if checked_elems(&dims).is_none() {
                return Err(err(self.file, format!("{what} is too large: {dims:?}")));
            }
            let t = self.b.input(vi.name.clone(), dims, dtype);
            self.values.insert(vi.name.as_str(), Value::Tensor(t));
        }
        Ok(())
    }

    fn finish(self, g: &GraphProto) -> R<Graph> {
        let mut outs = Vec::new();
        for o in &g.output {
            let what = format!("graph output '{}'", esc(&o.name));
            match self.values.get(o.name.as_str()) {
                Some(Value::Tensor(t)) => outs.push(*t),
                Some(Value::Const(_)) => {
                    return Err(err(self.file, format!("{what} is a constant")))
                }
                Some(Value::Unusable(why)) => {
                    return Err(err(self.file, format!("{what} is {why}")))
                }
                None => {
                    return Err(err(
                        self.file,
                        format!("{what} is not produced by any node"),
                    ))
                }
            }
        }
        if outs.is_empty() {
            return Err(err(self.file, "the graph has no outputs"));
        }
        self.b
            .finish(&outs)
            .map_err(|e| err(self.file, format!("imported graph is invalid: {e}")))
    }

    // ---- value access -------------------------------------------------------------------

    /// Name of input `i` if present (ONNX marks absent optional inputs with "").
    fn input_name(cx: Cx<'a, '_>, i: usize) -> Option<&'a str> {
        cx.n.input
            .get(i)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }

    fn value(&self, cx: Cx<'a, '_>, i: usize) -> R<(&'a str, Value<'a>)> {
        let name =
            Self::input_name(cx, i).ok_or_else(|| self.e(cx, format!("input #{i} is missing")))?;
        let v = self.values.get(name).ok_or_else(|| {
            self.e(
                cx,
                format!(
                    "input '{}' is not a graph input, initializer or output of an earlier node",
                    esc(name)
                ),
            )
        })?;
        Ok((name, v.clone()))
    }

    /// Input `i` as a tensor of the graph; constants become weights.
    fn data(&mut self, cx: Cx<'a, '_>, i: usize) -> R<TensorId> {
        match self.value(cx, i)? {
            (_, Value::Tensor(t)) => Ok(t),
            (name, Value::Const(t)) => {
                let dims = self.dims(cx, name, &t)?;
                Ok(self.weight(name, dims))
            }
            (_, Value::Unusable(why)) => Err(self.e(cx, format!("reads {why}"))),
        }
    }

    /// Input `i` if it is a constant (initializer or `Constant`), else `None`.
    fn konst_opt(&self, cx: Cx<'a, '_>, i: usize) -> R<Option<Named<'a>>> {
        match self.value(cx, i)? {
            (name, Value::Const(t)) => Ok(Some((name, t))),
            _ => Ok(None),
        }
    }

    /// Input `i`, which must be a constant.
    fn konst(&self, cx: Cx<'a, '_>, i: usize, what: &str) -> R<Named<'a>> {
        self.konst_opt(cx, i)?.ok_or_else(|| {
            self.e(
                cx,
                format!("{what} (input #{i}) must be an initializer or Constant"),
            )
        })
    }

    /// Integer values of constant input `i`.
    fn ints(&self, cx: Cx<'a, '_>, i: usize, what: &str) -> R<Vec<i64>> {
        let (name, t) = self.konst(cx, i, what)?;
        tensor_ints(&t).ok_or_else(|| {
            self.e(
                cx,
                format!(
                    "{what} '{}' must be an int64/int32 constant with data",
                    esc(name)
                ),
            )
        })
    }

    /// Validated dimensions of a constant.
    fn dims(&self, cx: Cx, name: &str, t: &TensorProto) -> R<Vec<u64>> {
        let mut out = Vec::with_capacity(t.dims.len());
        for &d in &t.dims {
            if d <= 0 || d as u64 > MAX_DIM {
                return Err(self.e(cx, format!("constant '{}' has dimension {d}", esc(name))));
            }
            out.push(d as u64);
        }
        if checked_elems(&out).is_none() {
            return Err(self.e(cx, format!("constant '{}' is too large", esc(name))));
        }
        Ok(out)
    }

    /// The weight tensor for constant `name` with `shape` (one tensor per name and shape).
    fn weight(&mut self, name: &str, shape: Vec<u64>) -> TensorId {
        let forms = self.weights.entry(name.to_string()).or_default();
        if let Some((_, t)) = forms.iter().find(|(s, _)| *s == shape) {
            return *t;
        }
        let t = self.b.weight(name, shape.clone());
        forms.push((shape, t));
        t
    }

    /// Whether constant `name` already has a weight tensor of this shape.
    fn has_weight(&self, name: &str, shape: &[u64]) -> bool {
        self.weights
            .get(name)
            .is_some_and(|f| f.iter().any(|(s, _)| s == shape))
    }

    fn shape(&self, t: TensorId) -> Shape {
        self.b.shape(t).clone()
    }

    fn set(&mut self, cx: Cx<'a, '_>, k: usize, v: Value<'a>) {
        if let Some(name) = cx.n.output.get(k).filter(|s| !s.is_empty()) {
            self.values.insert(name.as_str(), v);
        }
    }

    /// Marks outputs `from..` as not modelled.
    fn unusable_from(&mut self, cx: Cx<'a, '_>, from: usize, why: &str) {
        for k in from..cx.n.output.len() {
            let v = Value::Unusable(format!(
                "output #{k} of {} node '{}', which is not supported ({why})",
                esc(&cx.n.op_type),
                esc(cx.name)
            ));
            self.set(cx, k, v);
        }
    }

    fn op(&mut self, cx: Cx, name: &str, op: OpKind, ins: &[TensorId]) -> R<Vec<TensorId>> {
        let outs = self.b.op(name, op, ins).map_err(|e| self.e(cx, e))?;
        for &t in &outs {
            if checked_elems(self.b.shape(t).dims()).is_none() {
                return Err(self.e(cx, format!("output {} is too large", self.b.shape(t))));
            }
        }
        Ok(outs)
    }

    fn op1(&mut self, cx: Cx, name: &str, op: OpKind, ins: &[TensorId]) -> R<TensorId> {
        let outs = self.op(cx, name, op, ins)?;
        outs.first()
            .copied()
            .ok_or_else(|| self.e(cx, "op produced no output"))
    }

    /// Adds the main node of `cx` and binds its first output.
    fn emit(&mut self, cx: Cx<'a, '_>, op: OpKind, ins: &[TensorId]) -> R<()> {
        let y = self.op1(cx, cx.name, op, ins)?;
        self.set(cx, 0, Value::Tensor(y));
        Ok(())
    }

    fn pos(&self, cx: Cx, v: i64, what: &str) -> R<u64> {
        if v <= 0 || v as u64 > MAX_DIM {
            return Err(self.e(cx, format!("{what} must be in 1..={MAX_DIM}, got {v}")));
        }
        Ok(v as u64)
    }

    fn pair(&self, cx: Cx, v: Option<&[i64]>, default: u64, what: &str) -> R<[u64; 2]> {
        match v {
            None => Ok([default; 2]),
            Some([a, b]) => Ok([self.pos(cx, *a, what)?, self.pos(cx, *b, what)?]),
            Some(v) => Err(self.e(
                cx,
                format!("{what} has {} values; only 2-D is supported", v.len()),
            )),
        }
    }

    fn norm_axis(&self, cx: Cx, axis: i64, rank: usize) -> R<usize> {
        let r = rank as i64;
        let a = if axis < 0 { axis + r } else { axis };
        if !(0..r).contains(&a) {
            return Err(self.e(cx, format!("axis {axis} out of range for rank {rank}")));
        }
        Ok(a as usize)
    }

    // ---- ops ----------------------------------------------------------------------------

    fn node(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let act = |kind| OpKind::Activation(ActivationAttrs { kind });
        match cx.n.op_type.as_str() {
            "Constant" => self.constant(cx),
            "Identity" => {
                let (_, v) = self.value(cx, 0)?;
                self.set(cx, 0, v);
                Ok(())
            }
            "Relu" => self.unary(cx, act(Activation::Relu)),
            "Sigmoid" => self.unary(cx, act(Activation::Sigmoid)),
            "Tanh" => self.unary(cx, act(Activation::Tanh)),
            "Gelu" => self.unary(cx, act(Activation::Gelu)),
            "GlobalAveragePool" => self.unary(cx, OpKind::GlobalAvgPool),
            "Flatten" => {
                let axis = attr_i(cx.n, "axis").unwrap_or(1);
                self.unary(cx, OpKind::Flatten(AxisAttrs { axis }))
            }
            "Softmax" => {
                let default = if self.opset < 13 { 1 } else { -1 };
                let axis = attr_i(cx.n, "axis").unwrap_or(default);
                self.unary(cx, OpKind::Softmax(SoftmaxAttrs { axis }))
            }
            "Add" | "Mul" => {
                let (a, b) = (self.data(cx, 0)?, self.data(cx, 1)?);
                let op = if cx.n.op_type == "Add" {
                    OpKind::Add
                } else {
                    OpKind::Mul
                };
                self.emit(cx, op, &[a, b])
            }
            "Conv" => self.conv(cx),
            "BatchNormalization" => self.batch_norm(cx),
            "MaxPool" | "AveragePool" => self.pool(cx),
            "Gemm" => self.gemm(cx),
            "MatMul" => self.matmul(cx),
            "Reshape" => self.reshape(cx),
            "Squeeze" | "Unsqueeze" => self.squeeze(cx),
            "Concat" => self.concat(cx),
            "Split" => self.split(cx),
            "Transpose" => self.transpose(cx),
            "Dropout" => self.dropout(cx),
            "LSTM" | "GRU" => self.rnn(cx),
            "Gather" => self.gather(cx),
            "LayerNormalization" => self.layer_norm(cx),
            _ => Err(self.e(cx, "unsupported op type")),
        }
    }

    fn unary(&mut self, cx: Cx<'a, '_>, op: OpKind) -> R<()> {
        let x = self.data(cx, 0)?;
        self.emit(cx, op, &[x])
    }

    fn constant(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let a =
            cx.n.attribute
                .first()
                .ok_or_else(|| self.e(cx, "has no value attribute"))?;
        let owned = |dims: Vec<i64>, dt: i32| TensorProto {
            dims,
            data_type: dt,
            ..TensorProto::default()
        };
        let t: Cow<'a, TensorProto> = match (a.name.as_str(), a.t.as_ref()) {
            ("value", Some(t)) => Cow::Borrowed(t),
            ("value_int", _) => Cow::Owned(TensorProto {
                int64_data: vec![a.i],
                ..owned(vec![], data_type::INT64)
            }),
            ("value_ints", _) => Cow::Owned(TensorProto {
                int64_data: a.ints.clone(),
                ..owned(vec![a.ints.len() as i64], data_type::INT64)
            }),
            ("value_float", _) => Cow::Owned(TensorProto {
                float_data: vec![a.f],
                ..owned(vec![], data_type::FLOAT)
            }),
            ("value_floats", _) => Cow::Owned(TensorProto {
                float_data: a.floats.clone(),
                ..owned(vec![a.floats.len() as i64], data_type::FLOAT)
            }),
            (other, _) => {
                return Err(self.e(
                    cx,
                    format!("value attribute '{}' is not supported", esc(other)),
                ))
            }
        };
        self.set(cx, 0, Value::Const(Rc::new(t)));
        Ok(())
    }

    /// Symmetric 2-D padding from `pads` / `auto_pad`.
    fn pads(
        &self,
        cx: Cx,
        spatial: &[u64],
        kernel: [u64; 2],
        stride: [u64; 2],
        dilation: [u64; 2],
    ) -> R<[u64; 2]> {
        let auto = attr_s(cx.n, "auto_pad").unwrap_or_default();
        match auto.as_str() {
            "" | "NOTSET" => match attr_ints(cx.n, "pads") {
                None => Ok([0, 0]),
                Some(&[h0, w0, h1, w1]) => {
                    if h0 != h1 || w0 != w1 {
                        return Err(self.e(
                            cx,
                            format!("asymmetric pads {:?} are not supported", [h0, w0, h1, w1]),
                        ));
                    }
                    let p = |v: i64| {
                        if (0..=MAX_DIM as i64).contains(&v) {
                            Ok(v as u64)
                        } else {
                            Err(self.e(cx, format!("pad {v} out of range")))
                        }
                    };
                    Ok([p(h0)?, p(w0)?])
                }
                Some(v) => Err(self.e(
                    cx,
                    format!("pads has {} values; only 2-D is supported", v.len()),
                )),
            },
            "VALID" => Ok([0, 0]),
            "SAME_UPPER" | "SAME_LOWER" => {
                let mut out = [0u64; 2];
                for i in 0..2 {
                    let size = spatial.get(i).copied().unwrap_or(1);
                    let o = size.div_ceil(stride[i]);
                    let span = (kernel[i] - 1) * dilation[i] + 1;
                    let total = ((o - 1) * stride[i] + span).saturating_sub(size);
                    if total % 2 != 0 {
                        return Err(self.e(
                            cx,
                            format!(
                                "auto_pad={auto} needs asymmetric padding ({total} in all) here, which is not supported"
                            ),
                        ));
                    }
                    out[i] = total / 2;
                }
                Ok(out)
            }
            other => Err(self.e(cx, format!("unknown auto_pad '{}'", esc(other)))),
        }
    }

    fn conv(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let (wname, w) = self.konst(cx, 1, "weight")?;
        let wd = self.dims(cx, wname, &w)?;
        if wd.len() != 4 {
            return Err(self.e(
                cx,
                format!(
                    "only 2-D convolutions are supported (weight has rank {})",
                    wd.len()
                ),
            ));
        }
        let groups = self.pos(cx, attr_i(cx.n, "group").unwrap_or(1), "group")?;
        let kernel = self.pair(cx, attr_ints(cx.n, "kernel_shape"), 0, "kernel_shape")?;
        let kernel = if kernel == [0, 0] {
            [wd[2], wd[3]]
        } else {
            kernel
        };
        let stride = self.pair(cx, attr_ints(cx.n, "strides"), 1, "strides")?;
        let dilation = self.pair(cx, attr_ints(cx.n, "dilations"), 1, "dilations")?;
        let xs = self.shape(x);
        let padding = self.pads(
            cx,
            xs.dims().get(2..).unwrap_or(&[]),
            kernel,
            stride,
            dilation,
        )?;
        let wt = self.weight(wname, wd.clone());
        let mut ins = vec![x, wt];
        let bias = Self::input_name(cx, 2).is_some();
        if bias {
            let (bname, b) = self.konst(cx, 2, "bias")?;
            self.dims(cx, bname, &b)?;
            ins.push(self.weight(bname, vec![wd[0]]));
        }
        let attrs = Conv2dAttrs {
            out_channels: wd[0],
            kernel,
            stride,
            padding,
            dilation,
            groups,
            bias,
        };
        self.emit(cx, OpKind::Conv2d(attrs), &ins)
    }

    fn batch_norm(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let c = self
            .shape(x)
            .dim(1)
            .ok_or_else(|| self.e(cx, "input must have a channel dimension"))?;
        let mut ins = vec![x];
        for (i, what) in [(1, "scale"), (2, "bias")] {
            let (name, t) = self.konst(cx, i, what)?;
            let d = self.dims(cx, name, &t)?;
            if checked_elems(&d) != Some(c) {
                return Err(self.e(cx, format!("{what} has shape {d:?}, expected [{c}]")));
            }
            ins.push(self.weight(name, vec![c]));
        }
        // Inputs 3 and 4 (running mean / variance) are buffers: not parameters, not read.
        self.emit(cx, OpKind::BatchNorm, &ins)?;
        self.unusable_from(cx, 1, "training-mode running statistics");
        Ok(())
    }

    fn pool(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let kind = if cx.n.op_type == "MaxPool" {
            PoolKind::Max
        } else {
            PoolKind::Avg
        };
        let ks = attr_ints(cx.n, "kernel_shape")
            .ok_or_else(|| self.e(cx, "kernel_shape is required"))?;
        let kernel = self.pair(cx, Some(ks), 1, "kernel_shape")?;
        let stride = self.pair(cx, attr_ints(cx.n, "strides"), 1, "strides")?;
        if self.pair(cx, attr_ints(cx.n, "dilations"), 1, "dilations")? != [1, 1] {
            return Err(self.e(cx, "dilated pooling is not supported"));
        }
        let xs = self.shape(x);
        let spatial = xs.dims().get(2..).unwrap_or(&[]);
        let padding = self.pads(cx, spatial, kernel, stride, [1, 1])?;
        if attr_i(cx.n, "ceil_mode") == Some(1) {
            for i in 0..2 {
                let padded = spatial.get(i).copied().unwrap_or(1) + 2 * padding[i];
                if padded >= kernel[i] && (padded - kernel[i]) % stride[i] != 0 {
                    return Err(self.e(
                        cx,
                        "ceil_mode=1 changes the output size here, which is not supported",
                    ));
                }
            }
        }
        let attrs = Pool2dAttrs {
            kind,
            kernel,
            stride,
            padding,
        };
        self.emit(cx, OpKind::Pool2d(attrs), &[x])?;
        self.unusable_from(cx, 1, "MaxPool indices");
        Ok(())
    }

    /// `y + C` for a Gemm whose bias could not be folded into a Linear.
    fn add_bias(&mut self, cx: Cx<'a, '_>, y: TensorId) -> R<TensorId> {
        if Self::input_name(cx, 2).is_none() {
            return Ok(y);
        }
        let c = self.data(cx, 2)?;
        self.op1(cx, &format!("{}.bias", cx.name), OpKind::Add, &[y, c])
    }

    fn gemm(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let trans_a = attr_i(cx.n, "transA").unwrap_or(0) != 0;
        let trans_b = attr_i(cx.n, "transB").unwrap_or(0) != 0;
        let mut a = self.data(cx, 0)?;
        if self.shape(a).rank() != 2 {
            return Err(self.e(cx, format!("input A must be 2-D, got {}", self.shape(a))));
        }
        if trans_a {
            let perm = TransposeAttrs { perm: vec![1, 0] };
            let n = format!("{}.transpose_a", cx.name);
            a = self.op1(cx, &n, OpKind::Transpose(perm), &[a])?;
        }
        let y = match self.konst_opt(cx, 1)? {
            Some((bname, b)) => {
                let bd = self.dims(cx, bname, &b)?;
                let &[d0, d1] = bd.as_slice() else {
                    return Err(self.e(cx, format!("weight B must be 2-D, got {bd:?}")));
                };
                let n = if trans_b { d0 } else { d1 };
                if trans_b && self.has_weight(bname, &bd) {
                    // A tied table (e.g. the embedding) read transposed: share the tensor.
                    let w = self.weight(bname, bd);
                    let mm = OpKind::MatMul(MatMulAttrs { transpose_b: true });
                    let y = self.op1(cx, cx.name, mm, &[a, w])?;
                    self.add_bias(cx, y)?
                } else {
                    let w = self.weight(bname, if trans_b { vec![d1, d0] } else { bd });
                    let folded = match self.konst_opt_present(cx, 2)? {
                        Some((cname, c)) => {
                            let cd = self.dims(cx, cname, &c)?;
                            (checked_elems(&cd) == Some(n)).then_some(cname)
                        }
                        None => None,
                    };
                    let lin = |bias| {
                        OpKind::Linear(LinearAttrs {
                            out_features: n,
                            bias,
                        })
                    };
                    match folded {
                        Some(cname) => {
                            let bias = self.weight(cname, vec![n]);
                            self.op1(cx, cx.name, lin(true), &[a, w, bias])?
                        }
                        None => {
                            let y = self.op1(cx, cx.name, lin(false), &[a, w])?;
                            self.add_bias(cx, y)?
                        }
                    }
                }
            }
            None => {
                let b = self.data(cx, 1)?;
                let mm = OpKind::MatMul(MatMulAttrs {
                    transpose_b: trans_b,
                });
                let y = self.op1(cx, cx.name, mm, &[a, b])?;
                self.add_bias(cx, y)?
            }
        };
        self.set(cx, 0, Value::Tensor(y));
        Ok(())
    }

    /// Optional input `i` if present and constant.
    fn konst_opt_present(&self, cx: Cx<'a, '_>, i: usize) -> R<Option<Named<'a>>> {
        if Self::input_name(cx, i).is_none() {
            return Ok(None);
        }
        self.konst_opt(cx, i)
    }

    fn matmul(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let a = self.data(cx, 0)?;
        if let Some((bname, b)) = self.konst_opt(cx, 1)? {
            let bd = self.dims(cx, bname, &b)?;
            if let &[_, n] = bd.as_slice() {
                let w = self.weight(bname, bd.clone());
                let lin = OpKind::Linear(LinearAttrs {
                    out_features: n,
                    bias: false,
                });
                return self.emit(cx, lin, &[a, w]);
            }
        }
        let b = self.data(cx, 1)?;
        let mm = OpKind::MatMul(MatMulAttrs { transpose_b: false });
        self.emit(cx, mm, &[a, b])
    }

    fn reshape_to(&mut self, cx: Cx<'a, '_>, x: TensorId, shape: Vec<u64>) -> R<()> {
        if shape.contains(&0) {
            return Err(self.e(cx, format!("zero-sized output shape {shape:?}")));
        }
        self.emit(cx, OpKind::Reshape(ReshapeAttrs { shape }), &[x])
    }

    fn reshape(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let spec = match (Self::input_name(cx, 1), attr_ints(cx.n, "shape")) {
            (None, Some(s)) => s.to_vec(), // opset < 5
            _ => self.ints(cx, 1, "shape")?,
        };
        let allowzero = attr_i(cx.n, "allowzero").unwrap_or(0) != 0;
        let xs = self.shape(x);
        let mut out = Vec::with_capacity(spec.len());
        let mut infer_at = None;
        for (i, &v) in spec.iter().enumerate() {
            match v {
                0 if !allowzero => out.push(xs.dims().get(i).copied().ok_or_else(|| {
                    self.e(
                        cx,
                        format!("shape {spec:?} copies dimension {i} of {xs}, which has none"),
                    )
                })?),
                -1 if infer_at.is_none() => {
                    infer_at = Some(i);
                    out.push(1);
                }
                v if v > 0 => out.push(self.pos(cx, v, "shape entry")?),
                _ => return Err(self.e(cx, format!("invalid shape {spec:?}"))),
            }
        }
        if let Some(i) = infer_at {
            let known = checked_elems(&out).unwrap_or(0);
            let total = xs.elems();
            if known == 0 || total % known != 0 {
                return Err(self.e(
                    cx,
                    format!("cannot reshape {xs} to {spec:?}: -1 does not divide evenly"),
                ));
            }
            out[i] = total / known;
        }
        self.reshape_to(cx, x, out)
    }

    fn squeeze(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let xs = self.shape(x);
        let axes = match (Self::input_name(cx, 1), attr_ints(cx.n, "axes")) {
            (Some(_), _) => Some(self.ints(cx, 1, "axes")?),
            (None, a) => a.map(<[i64]>::to_vec),
        };
        let out = if cx.n.op_type == "Squeeze" {
            match axes {
                None => xs.dims().iter().copied().filter(|&d| d != 1).collect(),
                Some(axes) => {
                    let mut drop = vec![false; xs.rank()];
                    for a in axes {
                        let a = self.norm_axis(cx, a, xs.rank())?;
                        if xs.dims()[a] != 1 {
                            return Err(
                                self.e(cx, format!("cannot squeeze axis {a} of {xs}: not 1"))
                            );
                        }
                        drop[a] = true;
                    }
                    xs.dims()
                        .iter()
                        .zip(&drop)
                        .filter(|(_, d)| !**d)
                        .map(|(v, _)| *v)
                        .collect()
                }
            }
        } else {
            let axes = axes.ok_or_else(|| self.e(cx, "axes are required"))?;
            let r = xs.rank() + axes.len();
            let mut ones = vec![false; r];
            for a in axes {
                let a = self.norm_axis(cx, a, r)?;
                if std::mem::replace(&mut ones[a], true) {
                    return Err(self.e(cx, format!("axis {a} repeated")));
                }
            }
            let mut it = xs.dims().iter();
            ones.iter()
                .map(|&one| {
                    if one {
                        1
                    } else {
                        it.next().copied().unwrap_or(1)
                    }
                })
                .collect()
        };
        self.reshape_to(cx, x, out)
    }

    fn concat(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let axis = attr_i(cx.n, "axis").ok_or_else(|| self.e(cx, "axis is required"))?;
        let mut ins = Vec::new();
        let mut total = 0u64;
        for i in 0..cx.n.input.len() {
            if Self::input_name(cx, i).is_none() {
                continue;
            }
            let t = self.data(cx, i)?;
            let s = self.shape(t);
            let d = s.dim(axis as isize).unwrap_or(0);
            total = total
                .checked_add(d)
                .filter(|&t| t <= MAX_ELEMS)
                .ok_or_else(|| self.e(cx, "output is too large"))?;
            ins.push(t);
        }
        self.emit(cx, OpKind::Concat(AxisAttrs { axis }), &ins)
    }

    fn split(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let xs = self.shape(x);
        let axis = attr_i(cx.n, "axis").unwrap_or(0);
        let ax = self.norm_axis(cx, axis, xs.rank())?;
        let d = xs.dims()[ax];
        let nout = cx.n.output.len();
        let given = match (Self::input_name(cx, 1), attr_ints(cx.n, "split")) {
            (Some(_), _) => Some(self.ints(cx, 1, "split")?),
            (None, s) => s.map(<[i64]>::to_vec),
        };
        let sizes: Vec<u64> = match given {
            Some(s) => {
                let mut sum = 0u64;
                let mut out = Vec::with_capacity(s.len());
                for v in s {
                    let v = self.pos(cx, v, "split size")?;
                    sum = sum.saturating_add(v);
                    out.push(v);
                }
                if sum != d {
                    return Err(self.e(
                        cx,
                        format!("split sizes {out:?} do not add up to {d} (axis {ax} of {xs})"),
                    ));
                }
                out
            }
            None => {
                let k = attr_i(cx.n, "num_outputs").unwrap_or(nout as i64);
                let k = self.pos(cx, k, "num_outputs")?;
                if k != nout as u64 {
                    return Err(self.e(cx, format!("num_outputs {k} but {nout} outputs")));
                }
                let chunk = d.div_ceil(k);
                let last = d.checked_sub(chunk * (k - 1)).filter(|&l| l > 0);
                let last = last.ok_or_else(|| {
                    self.e(cx, format!("cannot split {d} into {k} non-empty parts"))
                })?;
                let mut s = vec![chunk; (k - 1) as usize];
                s.push(last);
                s
            }
        };
        if sizes.len() != nout {
            return Err(self.e(
                cx,
                format!("{} split sizes for {nout} outputs", sizes.len()),
            ));
        }
        let outs = self.op(cx, cx.name, OpKind::Split(SplitAttrs { axis, sizes }), &[x])?;
        for (k, t) in outs.into_iter().enumerate() {
            self.set(cx, k, Value::Tensor(t));
        }
        Ok(())
    }

    fn transpose(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let r = self.shape(x).rank();
        let perm = match attr_ints(cx.n, "perm") {
            None => (0..r).rev().collect(),
            Some(p) => {
                let mut out = Vec::with_capacity(p.len());
                for &v in p {
                    if !(0..r as i64).contains(&v) {
                        return Err(self.e(cx, format!("perm {p:?} out of range for rank {r}")));
                    }
                    out.push(v as usize);
                }
                out
            }
        };
        self.emit(cx, OpKind::Transpose(TransposeAttrs { perm }), &[x])
    }

    fn dropout(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let ratio = match self.konst_opt_present(cx, 1)? {
            Some((_, t)) => tensor_floats(&t)
                .and_then(|v| v.first().copied())
                .unwrap_or(DEFAULT_DROPOUT_RATIO),
            None => attr_f(cx.n, "ratio").map_or(DEFAULT_DROPOUT_RATIO, f64::from),
        };
        let rate_permille = (ratio * 1000.0).round().clamp(0.0, 1000.0) as u32;
        self.emit(cx, OpKind::Dropout(DropoutAttrs { rate_permille }), &[x])?;
        self.unusable_from(cx, 1, "dropout mask");
        Ok(())
    }

    fn gather(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let Some((tname, table)) = self.konst_opt(cx, 0)? else {
            return Err(self.e(
                cx,
                "only Gather from an initializer table (an embedding lookup) is supported",
            ));
        };
        let td = self.dims(cx, tname, &table)?;
        let &[vocab, dim] = td.as_slice() else {
            return Err(self.e(cx, format!("embedding table must be 2-D, got {td:?}")));
        };
        let axis = attr_i(cx.n, "axis").unwrap_or(0);
        if axis != 0 && axis != -2 {
            return Err(self.e(cx, format!("only axis 0 is supported, got {axis}")));
        }
        let ids = match self.value(cx, 1)? {
            (_, Value::Tensor(t)) => t,
            _ => return Err(self.e(cx, "indices must be a graph tensor, not a constant")),
        };
        let w = self.weight(tname, td.clone());
        self.emit(
            cx,
            OpKind::Embedding(EmbeddingAttrs { vocab, dim }),
            &[ids, w],
        )
    }

    fn layer_norm(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let x = self.data(cx, 0)?;
        let xs = self.shape(x);
        let axis = attr_i(cx.n, "axis").unwrap_or(-1);
        let ax = self.norm_axis(cx, axis, xs.rank())?;
        if ax + 1 != xs.rank() {
            return Err(self.e(
                cx,
                format!("normalizing from axis {axis} of {xs}: only the last axis is supported"),
            ));
        }
        let c = xs.last();
        let mut ins = vec![x];
        for (i, what) in [(1, "scale"), (2, "bias")] {
            if i == 2 && Self::input_name(cx, 2).is_none() {
                ins.push(self.b.weight(format!("{}.bias", cx.name), [c]));
                continue;
            }
            let (name, t) = self.konst(cx, i, what)?;
            let d = self.dims(cx, name, &t)?;
            if checked_elems(&d) != Some(c) {
                return Err(self.e(cx, format!("{what} has shape {d:?}, expected [{c}]")));
            }
            ins.push(self.weight(name, vec![c]));
        }
        self.emit(cx, OpKind::LayerNorm, &ins)?;
        self.unusable_from(cx, 1, "mean / inverse std outputs");
        Ok(())
    }

    fn rnn(&mut self, cx: Cx<'a, '_>) -> R<()> {
        let lstm = cx.n.op_type == "LSTM";
        let gates: u64 = if lstm { 4 } else { 3 };
        let dir = attr_s(cx.n, "direction").unwrap_or_else(|| "forward".into());
        match dir.as_str() {
            "forward" | "reverse" => {}
            "bidirectional" => {
                return Err(self.e(
                    cx,
                    "direction=bidirectional is not supported (unidirectional only)",
                ))
            }
            other => return Err(self.e(cx, format!("unknown direction '{}'", esc(other)))),
        }
        let layout = attr_i(cx.n, "layout").unwrap_or(0);
        if layout != 0 && layout != 1 {
            return Err(self.e(cx, format!("unknown layout {layout}")));
        }
        if lstm && Self::input_name(cx, 7).is_some() {
            return Err(self.e(cx, "peephole weights (input P) are not supported"));
        }
        let x = self.data(cx, 0)?;
        let xs = self.shape(x);
        if xs.rank() != 3 {
            return Err(self.e(cx, format!("input X must be 3-D, got {xs}")));
        }
        let (wname, w) = self.konst(cx, 1, "W")?;
        let wd = self.dims(cx, wname, &w)?;
        let &[1, gh, input] = wd.as_slice() else {
            return Err(self.e(cx, format!("W must be [1, G*hidden, input], got {wd:?}")));
        };
        let hidden = match attr_i(cx.n, "hidden_size") {
            Some(h) => self.pos(cx, h, "hidden_size")?,
            None => gh / gates,
        };
        if gh != gates * hidden {
            return Err(self.e(
                cx,
                format!("W has {gh} rows, expected {gates} x hidden_size {hidden}"),
            ));
        }
        let (rname, r) = self.konst(cx, 2, "R")?;
        let rd = self.dims(cx, rname, &r)?;
        if rd != [1, gh, hidden] {
            return Err(self.e(cx, format!("R must be [1, {gh}, {hidden}], got {rd:?}")));
        }
        let bias = match self.konst_opt_present(cx, 3)? {
            Some((bname, b)) => {
                let bd = self.dims(cx, bname, &b)?;
                if bd != [1, 2 * gh] {
                    return Err(self.e(cx, format!("B must be [1, {}], got {bd:?}", 2 * gh)));
                }
                // Wb + Rb are only ever summed: one bias of G·h (see module docs).
                self.weight(bname, vec![gh])
            }
            None if Self::input_name(cx, 3).is_some() => {
                return Err(self.e(cx, "B (input #3) must be an initializer or Constant"))
            }
            None => self.b.weight(format!("{}.bias", cx.name), [gh]),
        };
        let w_ih = self.weight(wname, vec![input, gh]);
        let w_hh = self.weight(rname, vec![hidden, gh]);
        let swap = |a: &mut Self, name: String, t: TensorId| {
            let perm = TransposeAttrs {
                perm: vec![1, 0, 2],
            };
            a.op1(cx, &name, OpKind::Transpose(perm), &[t])
        };
        let xb = if layout == 0 {
            swap(self, format!("{}.batch_first", cx.name), x)?
        } else {
            x
        };
        let attrs = RnnAttrs { hidden };
        let op = if lstm {
            OpKind::Lstm(attrs)
        } else {
            OpKind::Gru(attrs)
        };
        let y = self.op1(cx, cx.name, op, &[xb, w_ih, w_hh, bias])?;
        if cx.n.output.first().is_some_and(|s| !s.is_empty()) {
            let (s, b) = if layout == 0 {
                (xs.dims()[0], xs.dims()[1])
            } else {
                (xs.dims()[1], xs.dims()[0])
            };
            let (src, shape) = if layout == 0 {
                let t = swap(self, format!("{}.seq_first", cx.name), y)?;
                (t, vec![s, 1, b, hidden])
            } else {
                (y, vec![b, s, 1, hidden])
            };
            let r = ReshapeAttrs { shape };
            let yy = self.op1(cx, &format!("{}.Y", cx.name), OpKind::Reshape(r), &[src])?;
            self.set(cx, 0, Value::Tensor(yy));
        }
        self.unusable_from(cx, 1, "only the output Y of a recurrent layer is modelled");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::onnx_proto::{
        Dimension, OperatorSetIdProto, TensorShapeProto, TypeProto, TypeProtoTensor, ValueInfoProto,
    };
    use super::*;
    use crate::TensorRole;

    const ATTR_INT: i32 = 2;
    const ATTR_STRING: i32 = 3;
    const ATTR_INTS: i32 = 7;

    fn node(op: &str, ins: &[&str], outs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
        NodeProto {
            input: ins.iter().map(|s| s.to_string()).collect(),
            output: outs.iter().map(|s| s.to_string()).collect(),
            name: outs.first().map_or(String::new(), |s| format!("n_{s}")),
            op_type: op.into(),
            attribute: attrs,
            ..NodeProto::default()
        }
    }

    fn int(name: &str, i: i64) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            r#type: ATTR_INT,
            i,
            ..AttributeProto::default()
        }
    }

    fn ints(name: &str, v: &[i64]) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            r#type: ATTR_INTS,
            ints: v.to_vec(),
            ..AttributeProto::default()
        }
    }

    fn string(name: &str, s: &str) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            r#type: ATTR_STRING,
            s: s.as_bytes().to_vec(),
            ..AttributeProto::default()
        }
    }

    /// A float initializer without data.
    fn init(name: &str, dims: &[i64]) -> TensorProto {
        TensorProto {
            name: name.into(),
            dims: dims.to_vec(),
            data_type: data_type::FLOAT,
            ..TensorProto::default()
        }
    }

    /// An int64 initializer with data.
    fn int_init(name: &str, v: &[i64]) -> TensorProto {
        TensorProto {
            name: name.into(),
            dims: vec![v.len() as i64],
            data_type: data_type::INT64,
            int64_data: v.to_vec(),
            ..TensorProto::default()
        }
    }

    /// A value info; negative dims are symbolic.
    fn vi(name: &str, elem: i32, dims: &[i64]) -> ValueInfoProto {
        let dim = dims
            .iter()
            .map(|&d| Dimension {
                value: Some(if d < 0 {
                    DimensionValue::DimParam("batch".into())
                } else {
                    DimensionValue::DimValue(d)
                }),
                ..Dimension::default()
            })
            .collect();
        ValueInfoProto {
            name: name.into(),
            r#type: Some(TypeProto {
                tensor_type: Some(TypeProtoTensor {
                    elem_type: elem,
                    shape: Some(TensorShapeProto { dim }),
                }),
                ..TypeProto::default()
            }),
            ..ValueInfoProto::default()
        }
    }

    fn model(
        nodes: Vec<NodeProto>,
        inits: Vec<TensorProto>,
        inputs: Vec<ValueInfoProto>,
        outputs: &[&str],
    ) -> Vec<u8> {
        ModelProto {
            ir_version: 8,
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: 17,
            }],
            graph: Some(GraphProto {
                name: "t".into(),
                node: nodes,
                initializer: inits,
                input: inputs,
                output: outputs.iter().map(|o| vi(o, 1, &[])).collect(),
                ..GraphProto::default()
            }),
            ..ModelProto::default()
        }
        .encode_to_vec()
    }

    fn import(bytes: &[u8]) -> Graph {
        import_onnx_bytes(bytes, "t.onnx", None).unwrap()
    }

    fn out_shape(g: &Graph) -> Shape {
        g.tensor(g.outputs[0]).shape.clone()
    }

    fn import_err(bytes: &[u8]) -> String {
        let e = import_onnx_bytes(bytes, "t.onnx", None)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("t.onnx: "), "{e}");
        assert!(!e.contains('\n'), "{e}");
        e
    }

    #[test]
    fn reshape_handles_zero_and_minus_one_squeeze_unsqueeze() {
        let m = model(
            vec![
                node(
                    "Constant",
                    &[],
                    &["shape"],
                    vec![ints("value_ints", &[0, -1])],
                ),
                node("Reshape", &["x", "shape"], &["r"], vec![]),
                node("Unsqueeze", &["r", "ax"], &["u"], vec![]),
                node("Squeeze", &["u"], &["s"], vec![]),
                node("Reshape", &["s", "shape2"], &["y"], vec![]),
            ],
            vec![int_init("ax", &[-2]), int_init("shape2", &[-1, 4, 3])],
            vec![vi("x", 1, &[2, 3, 4])],
            &["y"],
        );
        let g = import(&m);
        let shapes: Vec<Shape> = g
            .nodes
            .iter()
            .map(|n| g.output_shapes(n)[0].clone())
            .collect();
        assert_eq!(
            shapes,
            [
                Shape::new([2, 12]),
                Shape::new([2, 1, 12]),
                Shape::new([2, 12]),
                Shape::new([2, 4, 3]),
            ]
        );
        assert_eq!(g.param_count(), 0, "shape constants are not parameters");

        let bad = model(
            vec![node("Reshape", &["x", "shape"], &["y"], vec![])],
            vec![int_init("shape", &[5, -1])],
            vec![vi("x", 1, &[2, 3, 4])],
            &["y"],
        );
        let e = import_err(&bad);
        assert!(e.contains("Reshape node 'n_y'") && e.contains("-1"), "{e}");
    }

    #[test]
    fn gemm_trans_b_records_in_out_weight_and_folds_bias() {
        let m = model(
            vec![node(
                "Gemm",
                &["x", "w", "b"],
                &["y"],
                vec![int("transB", 1)],
            )],
            vec![init("w", &[16, 8]), init("b", &[16])],
            vec![vi("x", 1, &[-1, 8])],
            &["y"],
        );
        let g = import_onnx_bytes(&m, "t.onnx", Some(4)).unwrap();
        assert_eq!(g.nodes.len(), 1);
        assert_eq!(
            g.nodes[0].op,
            OpKind::Linear(LinearAttrs {
                out_features: 16,
                bias: true
            })
        );
        assert_eq!(g.input_shapes(&g.nodes[0])[1], Shape::new([8, 16]));
        assert_eq!(out_shape(&g), Shape::new([4, 16]));
        assert_eq!(g.param_count(), 8 * 16 + 16);

        // Computed B: a MatMul reading it transposed, then the bias as an Add.
        let m = model(
            vec![node(
                "Gemm",
                &["x", "w", "b"],
                &["y"],
                vec![int("transB", 1)],
            )],
            vec![init("b", &[16])],
            vec![vi("x", 1, &[4, 8]), vi("w", 1, &[16, 8])],
            &["y"],
        );
        let g = import(&m);
        assert_eq!(
            g.nodes[0].op,
            OpKind::MatMul(MatMulAttrs { transpose_b: true })
        );
        assert_eq!(g.nodes[1].op, OpKind::Add);
        assert_eq!(out_shape(&g), Shape::new([4, 16]));
    }

    #[test]
    fn tied_embedding_and_head_share_one_table() {
        let m = model(
            vec![
                node("Gather", &["emb", "ids"], &["h"], vec![]),
                node("Gemm", &["h2", "emb"], &["y"], vec![int("transB", 1)]),
                node("Reshape", &["h", "s"], &["h2"], vec![]),
            ],
            vec![init("emb", &[100, 8]), int_init("s", &[-1, 8])],
            vec![vi("ids", data_type::INT64, &[2, 5])],
            &["y"],
        );
        // Nodes out of order: the Gemm reads h2 before the Reshape defines it.
        let e = import_err(&m);
        assert!(e.contains("input 'h2'"), "{e}");

        let m = model(
            vec![
                node("Gather", &["emb", "ids"], &["h"], vec![]),
                node("Reshape", &["h", "s"], &["h2"], vec![]),
                node("Gemm", &["h2", "emb"], &["y"], vec![int("transB", 1)]),
            ],
            vec![init("emb", &[100, 8]), int_init("s", &[-1, 8])],
            vec![vi("ids", data_type::INT64, &[2, 5])],
            &["y"],
        );
        let g = import(&m);
        assert_eq!(g.param_count(), 800, "the tied table counts once");
        assert_eq!(out_shape(&g), Shape::new([10, 100]));
        assert_eq!(
            g.nodes[2].op,
            OpKind::MatMul(MatMulAttrs { transpose_b: true })
        );
    }

    #[test]
    fn batch_norm_drops_running_stats_and_identity_adds_no_node() {
        let m = model(
            vec![
                node(
                    "Conv",
                    &["x", "w"],
                    &["c"],
                    vec![
                        ints("kernel_shape", &[3, 3]),
                        string("auto_pad", "SAME_UPPER"),
                    ],
                ),
                node("Identity", &["c"], &["i"], vec![]),
                node(
                    "BatchNormalization",
                    &["i", "g", "b", "mean", "var"],
                    &["y"],
                    vec![],
                ),
            ],
            vec![
                init("w", &[8, 3, 3, 3]),
                init("g", &[8]),
                init("b", &[8]),
                init("mean", &[8]),
                init("var", &[8]),
            ],
            vec![vi("x", 1, &[-1, 3, 16, 16])],
            &["y"],
        );
        let g = import(&m);
        assert_eq!(g.nodes.len(), 2);
        assert_eq!(out_shape(&g), Shape::new([1, 8, 16, 16]));
        assert_eq!(g.param_count(), 8 * 3 * 9 + 8 + 8);
        assert!(g
            .tensors
            .iter()
            .all(|t| t.name != "mean" && t.name != "var"));
        match &g.nodes[0].op {
            OpKind::Conv2d(a) => assert_eq!(a.padding, [1, 1]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn split_concat_transpose_softmax() {
        let m = model(
            vec![
                node("Split", &["x"], &["a", "b"], vec![int("axis", 1)]),
                node("Split", &["x", "sz"], &["c", "d"], vec![int("axis", 1)]),
                node("Concat", &["b", "c", "d"], &["e"], vec![int("axis", 1)]),
                node("Transpose", &["e"], &["t"], vec![]),
                node("Softmax", &["t"], &["y"], vec![]),
            ],
            vec![int_init("sz", &[2, 4])],
            vec![vi("x", 1, &[3, 6])],
            &["y"],
        );
        let g = import(&m);
        assert_eq!(out_shape(&g), Shape::new([3 + 2 + 4, 3]));
        assert_eq!(
            g.nodes[0].op,
            OpKind::Split(SplitAttrs {
                axis: 1,
                sizes: vec![3, 3]
            })
        );
    }

    #[test]
    fn gru_layout_one_and_missing_bias() {
        let m = model(
            vec![node(
                "GRU",
                &["x", "w", "r"],
                &["y"],
                vec![int("hidden_size", 5), int("layout", 1)],
            )],
            vec![init("w", &[1, 15, 4]), init("r", &[1, 15, 5])],
            vec![vi("x", 1, &[2, 7, 4])],
            &["y"],
        );
        let g = import(&m);
        // (b, s, 1, h) for layout 1; the missing B becomes a fresh (G·h) bias.
        assert_eq!(out_shape(&g), Shape::new([2, 7, 1, 5]));
        assert_eq!(g.param_count(), 4 * 15 + 5 * 15 + 15);
        assert_eq!(g.op_histogram().get("transpose"), None);
    }

    #[test]
    fn lstm_restrictions_are_errors_naming_the_node() {
        let lstm = |attrs, outs: &[&str]| {
            model(
                vec![node("LSTM", &["x", "w", "r", "b"], outs, attrs)],
                vec![
                    init("w", &[1, 8, 3]),
                    init("r", &[1, 8, 2]),
                    init("b", &[1, 16]),
                ],
                vec![vi("x", 1, &[5, -1, 3])],
                &[outs[0]],
            )
        };
        let ok = import(&lstm(vec![int("hidden_size", 2)], &["y", "yh"]));
        assert_eq!(out_shape(&ok), Shape::new([5, 1, 1, 2]));
        assert_eq!(ok.param_count(), 3 * 8 + 2 * 8 + 8);
        assert!(ok.tensors.iter().any(|t| t.name == "w"
            && t.shape == Shape::new([3, 8])
            && t.role == TensorRole::Weight));

        let e = import_err(&lstm(
            vec![int("hidden_size", 2), string("direction", "bidirectional")],
            &["y"],
        ));
        assert!(
            e.contains("LSTM node 'n_y'") && e.contains("bidirectional"),
            "{e}"
        );

        // Reading Y_h is an error naming the LSTM.
        let mut m = ModelProto::decode(lstm(vec![], &["y", "yh"]).as_slice()).unwrap();
        if let Some(g) = m.graph.as_mut() {
            g.node.push(node("Relu", &["yh"], &["z"], vec![]));
            g.output = vec![vi("z", 1, &[])];
        }
        let e = import_err(&m.encode_to_vec());
        assert!(e.contains("output #1 of LSTM node 'n_y'"), "{e}");
    }

    #[test]
    fn unsupported_op_types_are_collected_sorted_and_deduplicated() {
        let m = model(
            vec![
                node("TopK", &["x", "k"], &["a", "i"], vec![]),
                node("Relu", &["x"], &["r"], vec![]),
                node("NonMaxSuppression", &["x"], &["n"], vec![]),
                node("TopK", &["r", "k"], &["b", "j"], vec![]),
                NodeProto {
                    domain: "com.microsoft".into(),
                    ..node("FusedConv", &["x"], &["f"], vec![])
                },
            ],
            vec![],
            vec![vi("x", 1, &[4])],
            &["r"],
        );
        match import_onnx_bytes(&m, "t.onnx", None) {
            Err(ImportError::OnnxUnsupportedOps { ops, .. }) => assert_eq!(
                ops,
                ["NonMaxSuppression", "TopK", "com.microsoft:FusedConv"]
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn structural_problems_are_one_line_errors() {
        let e = import_err(&ModelProto::default().encode_to_vec());
        assert!(e.contains("not a valid ONNX model: it has no graph"), "{e}");

        let m = model(
            vec![node("Relu", &["x"], &["y"], vec![])],
            vec![],
            vec![vi("x", 1, &[4])],
            &["nope"],
        );
        assert!(import_err(&m).contains("graph output 'nope' is not produced"));

        // Absurd sizes are rejected before any arithmetic can overflow.
        let m = model(
            vec![node("Add", &["x", "x"], &["y"], vec![])],
            vec![],
            vec![vi("x", 1, &[1 << 40, 4])],
            &["y"],
        );
        assert!(import_err(&m).contains("above"));
        let m = model(
            vec![node("Add", &["x", "z"], &["y"], vec![])],
            vec![],
            vec![vi("x", 1, &[1 << 30, 1]), vi("z", 1, &[1, 1 << 30])],
            &["y"],
        );
        assert!(import_err(&m).contains("too large"));

        let m = model(
            vec![node("Relu", &["x"], &["y"], vec![])],
            vec![],
            vec![vi("x", 1, &[-1, 4])],
            &["y"],
        );
        let e = import_onnx_bytes(&m, "t.onnx", Some(0)).unwrap_err();
        assert!(e.to_string().contains("batch size 0"), "{e}");
    }
}
