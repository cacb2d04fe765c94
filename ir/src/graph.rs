//! The model graph: an arena of tensors and nodes kept in topological order.

use crate::dtype::DType;
use crate::op::{
    Activation, ActivationAttrs, AttentionAttrs, Conv2dAttrs, DropoutAttrs, EmbeddingAttrs,
    LinearAttrs, OpKind, Saved, ShapeError, Work,
};
use crate::shape::Shape;
use crate::units::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use thiserror::Error;

/// Index of a tensor in [`Graph::tensors`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TensorId(pub u32);

/// Index of a node in [`Graph::nodes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u32);

/// What a tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorRole {
    /// Fed from outside (tokens, images, labels).
    Input,
    /// A trainable parameter.
    Weight,
    /// Produced by a node.
    Activation,
}

/// A tensor of the graph.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tensor {
    pub name: String,
    pub shape: Shape,
    /// Logical element type: floating tensors take the training precision's type when costed.
    pub dtype: DType,
    pub role: TensorRole,
}

/// Which part of the model a node belongs to, so pipeline stages can be formed from blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Segment {
    /// Before the repeated blocks (embeddings, stem).
    Pre,
    /// Repeated block `i` (a transformer layer, a residual stage).
    Block(u32),
    /// After the blocks (final norm, head, loss).
    Post,
}

/// One op applied to tensors.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    pub name: String,
    pub op: OpKind,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    pub segment: Segment,
}

/// A model graph. Nodes are in topological order; every activation has exactly one producer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Graph {
    pub name: String,
    pub tensors: Vec<Tensor>,
    pub nodes: Vec<Node>,
    /// Tensors the graph produces (the loss, or logits).
    pub outputs: Vec<TensorId>,
}

/// A structural problem in a graph.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum GraphError {
    #[error("node '{node}': input #{index} refers to tensor {tensor}, which does not exist")]
    DanglingTensor {
        node: String,
        index: usize,
        tensor: u32,
    },
    #[error("graph output refers to tensor {0}, which does not exist")]
    DanglingOutput(u32),
    #[error("node '{node}' is on a cycle")]
    Cycle { node: String },
    #[error("node '{node}': {source}")]
    Shape {
        node: String,
        #[source]
        source: ShapeError,
    },
    #[error(
        "node '{node}': tensor '{tensor}' is declared {declared} but the op produces {inferred}"
    )]
    ShapeDisagrees {
        node: String,
        tensor: String,
        declared: Shape,
        inferred: Shape,
    },
    #[error("tensor '{tensor}' is produced by both '{first}' and '{second}'")]
    MultipleProducers {
        tensor: String,
        first: String,
        second: String,
    },
    #[error("node '{node}' reads activation '{tensor}', which no node produces")]
    NoProducer { node: String, tensor: String },
    #[error("node '{node}' produces '{tensor}', which is declared as an {role:?}")]
    ProducesNonActivation {
        node: String,
        tensor: String,
        role: TensorRole,
    },
    #[error("tensor '{tensor}' has a zero dimension: {shape}")]
    ZeroDim { tensor: String, shape: Shape },
    #[error("graph has no nodes")]
    Empty,
}

impl Graph {
    /// The tensor with this id.
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.0 as usize]
    }

    /// Input shapes of a node.
    pub fn input_shapes(&self, node: &Node) -> Vec<Shape> {
        node.inputs
            .iter()
            .map(|t| self.tensor(*t).shape.clone())
            .collect()
    }

    /// Output shapes of a node.
    pub fn output_shapes(&self, node: &Node) -> Vec<Shape> {
        node.outputs
            .iter()
            .map(|t| self.tensor(*t).shape.clone())
            .collect()
    }

    /// Which inputs of a node are weights.
    pub fn weight_flags(&self, node: &Node) -> Vec<bool> {
        node.inputs
            .iter()
            .map(|t| self.tensor(*t).role == TensorRole::Weight)
            .collect()
    }

    /// Work of one node at a floating-point element size.
    pub fn node_work(&self, node: &Node, float_bytes: u64) -> Work {
        node.op.work(
            &self.input_shapes(node),
            &self.output_shapes(node),
            &self.weight_flags(node),
            float_bytes,
        )
    }

    /// Total work (FLOPs and kernel bytes) of the nodes selected by `filter`; parameters and
    /// saved tensors, which ops share, are counted by [`Graph::param_count`] and
    /// [`Graph::activation_bytes`].
    pub fn work_where(&self, float_bytes: u64, filter: impl Fn(&Node) -> bool) -> Work {
        self.nodes
            .iter()
            .filter(|n| filter(n))
            .map(|n| self.node_work(n, float_bytes))
            .fold(Work::default(), |a, b| a + b)
    }

    /// Work of the whole graph.
    pub fn total_work(&self, float_bytes: u64) -> Work {
        self.work_where(float_bytes, |_| true)
    }

    /// Trainable parameters (each weight tensor once, so tied weights count once).
    pub fn param_count(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.role == TensorRole::Weight)
            .map(|t| t.shape.elems())
            .sum()
    }

    /// Parameters of embedding tables (read by an Embedding op).
    pub fn embedding_params(&self) -> u64 {
        let tables: HashSet<TensorId> = self
            .nodes
            .iter()
            .filter(|n| matches!(n.op, OpKind::Embedding(_)))
            .filter_map(|n| n.inputs.get(1).copied())
            .collect();
        tables.iter().map(|t| self.tensor(*t).shape.elems()).sum()
    }

    /// Parameters owned by the nodes selected by `filter` (a weight counts where first read).
    pub fn params_where(&self, filter: impl Fn(&Node) -> bool) -> u64 {
        let mut seen = HashSet::new();
        let mut total = 0;
        for n in &self.nodes {
            for t in &n.inputs {
                if self.tensor(*t).role == TensorRole::Weight && seen.insert(*t) && filter(n) {
                    total += self.tensor(*t).shape.elems();
                }
            }
        }
        total
    }

    /// Number of repeated blocks (`Segment::Block`).
    pub fn num_blocks(&self) -> u32 {
        self.nodes
            .iter()
            .filter_map(|n| match n.segment {
                Segment::Block(i) => Some(i + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Count of nodes per op kind.
    pub fn op_histogram(&self) -> BTreeMap<&'static str, usize> {
        let mut h = BTreeMap::new();
        for n in &self.nodes {
            *h.entry(n.op.name()).or_insert(0) += 1;
        }
        h
    }

    /// Bytes kept for backward by the nodes selected by `filter`, each tensor counted once even
    /// when several ops keep it (views such as reshapes alias their input).
    pub fn activation_bytes(&self, float_bytes: u64, filter: impl Fn(&Node) -> bool) -> Bytes {
        Bytes(
            self.saved_items(float_bytes, filter)
                .iter()
                .map(|s| s.bytes)
                .sum(),
        )
    }

    /// Everything the nodes selected by `filter` keep for backward, one item per kept tensor
    /// (de-duplicated across nodes, views resolved to the tensor they alias) or extra state,
    /// attributed to the first node that keeps it.
    pub fn saved_items(&self, float_bytes: u64, filter: impl Fn(&Node) -> bool) -> Vec<SavedItem> {
        let roots = self.view_roots();
        let root = |t: TensorId| roots[t.0 as usize];
        let mut kept: HashSet<TensorId> = HashSet::new();
        let mut items = Vec::new();
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| filter(n)) {
            let node = NodeId(i as u32);
            let (s, tensors) = self.node_saves(n);
            for t in tensors {
                let r = root(t);
                if kept.insert(r) {
                    items.push(SavedItem {
                        node,
                        tensor: Some(r),
                        bytes: self.tensor_bytes(t, float_bytes),
                        gemm_input_elems: 0,
                    });
                }
            }
            let extra = s.extra_elems * float_bytes + s.extra_bytes;
            if extra > 0 {
                items.push(SavedItem {
                    node,
                    tensor: None,
                    bytes: extra,
                    gemm_input_elems: s.gemm_input_elems,
                });
            }
        }
        items
    }

    /// What `n` keeps for backward: its op's [`Saved`] and the tensors that names (inputs and
    /// outputs; views not resolved to the tensors they alias).
    pub fn node_saves(&self, n: &Node) -> (Saved, Vec<TensorId>) {
        let s = n.op.saves(&self.input_shapes(n), &self.weight_flags(n));
        let tensors = s
            .inputs
            .iter()
            .map(|&i| n.inputs[i])
            .chain(s.outputs.iter().map(|&i| n.outputs[i]))
            .collect();
        (s, tensors)
    }

    /// For every tensor, the tensor whose storage it is: a view (reshape, flatten, …) aliases
    /// its input's root; any other tensor is its own.
    pub fn view_roots(&self) -> Vec<TensorId> {
        let mut roots: Vec<TensorId> = (0..self.tensors.len() as u32).map(TensorId).collect();
        for n in &self.nodes {
            if n.op.is_view() {
                roots[n.outputs[0].0 as usize] = roots[n.inputs[0].0 as usize];
            }
        }
        roots
    }

    /// Bytes of a tensor: floating tensors at `float_bytes`, others at their own size.
    pub fn tensor_bytes(&self, t: TensorId, float_bytes: u64) -> u64 {
        self.tensor(t).shape.elems() * self.elem_bytes(t, float_bytes)
    }

    /// Bytes of one element of a tensor: `float_bytes` for floating tensors, their own size
    /// otherwise.
    pub fn elem_bytes(&self, t: TensorId, float_bytes: u64) -> u64 {
        let dt = self.tensor(t).dtype;
        if dt.is_float() {
            float_bytes
        } else {
            dt.size_bytes()
        }
    }

    /// Checks the structure: ids in range, one producer per activation, no cycles, every shape
    /// what its op infers. Nodes out of topological order are reordered.
    pub fn validate(&mut self) -> Result<(), GraphError> {
        if self.nodes.is_empty() {
            return Err(GraphError::Empty);
        }
        let nt = self.tensors.len() as u32;
        for t in &self.tensors {
            if t.shape.0.contains(&0) {
                return Err(GraphError::ZeroDim {
                    tensor: t.name.clone(),
                    shape: t.shape.clone(),
                });
            }
        }
        let mut producer: Vec<Option<usize>> = vec![None; nt as usize];
        for (ni, n) in self.nodes.iter().enumerate() {
            for (index, t) in n.inputs.iter().chain(&n.outputs).enumerate() {
                if t.0 >= nt {
                    return Err(GraphError::DanglingTensor {
                        node: n.name.clone(),
                        index,
                        tensor: t.0,
                    });
                }
            }
            for t in &n.outputs {
                let tensor = &self.tensors[t.0 as usize];
                if tensor.role != TensorRole::Activation {
                    return Err(GraphError::ProducesNonActivation {
                        node: n.name.clone(),
                        tensor: tensor.name.clone(),
                        role: tensor.role,
                    });
                }
                if let Some(first) = producer[t.0 as usize] {
                    return Err(GraphError::MultipleProducers {
                        tensor: tensor.name.clone(),
                        first: self.nodes[first].name.clone(),
                        second: n.name.clone(),
                    });
                }
                producer[t.0 as usize] = Some(ni);
            }
        }
        if let Some(o) = self.outputs.iter().find(|o| o.0 >= nt) {
            return Err(GraphError::DanglingOutput(o.0));
        }
        for n in &self.nodes {
            for t in &n.inputs {
                let tensor = &self.tensors[t.0 as usize];
                if tensor.role == TensorRole::Activation && producer[t.0 as usize].is_none() {
                    return Err(GraphError::NoProducer {
                        node: n.name.clone(),
                        tensor: tensor.name.clone(),
                    });
                }
            }
        }
        // Kahn's algorithm, stable: keeps the given order when it is already topological.
        let n = self.nodes.len();
        let mut indeg = vec![0usize; n];
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (ni, node) in self.nodes.iter().enumerate() {
            for t in &node.inputs {
                if let Some(p) = producer[t.0 as usize] {
                    indeg[ni] += 1;
                    users[p].push(ni);
                }
            }
        }
        let mut ready: std::collections::BTreeSet<usize> =
            (0..n).filter(|i| indeg[*i] == 0).collect();
        let mut order = Vec::with_capacity(n);
        while let Some(i) = ready.pop_first() {
            order.push(i);
            for &u in &users[i] {
                indeg[u] -= 1;
                if indeg[u] == 0 {
                    ready.insert(u);
                }
            }
        }
        if order.len() < n {
            let stuck = (0..n).find(|i| indeg[*i] > 0).unwrap_or(0);
            return Err(GraphError::Cycle {
                node: self.nodes[stuck].name.clone(),
            });
        }
        if order.iter().enumerate().any(|(i, o)| i != *o) {
            let mut old: Vec<Option<Node>> = std::mem::take(&mut self.nodes)
                .into_iter()
                .map(Some)
                .collect();
            self.nodes = order.iter().filter_map(|&i| old[i].take()).collect();
        }
        for node in &self.nodes {
            let inferred =
                node.op
                    .infer(&self.input_shapes(node))
                    .map_err(|source| GraphError::Shape {
                        node: node.name.clone(),
                        source,
                    })?;
            let declared = self.output_shapes(node);
            if inferred.len() != declared.len() {
                return Err(GraphError::Shape {
                    node: node.name.clone(),
                    source: ShapeError::Invalid {
                        op: node.op.name(),
                        reason: format!(
                            "produces {} outputs, {} declared",
                            inferred.len(),
                            declared.len()
                        ),
                    },
                });
            }
            for ((i, d), t) in inferred.iter().zip(&declared).zip(&node.outputs) {
                if i != d {
                    return Err(GraphError::ShapeDisagrees {
                        node: node.name.clone(),
                        tensor: self.tensor(*t).name.clone(),
                        declared: d.clone(),
                        inferred: i.clone(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// One thing kept for backward: a tensor (by its aliased root) or a node's extra state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedItem {
    /// The first node that keeps it.
    pub node: NodeId,
    /// The tensor, or `None` for extra state (statistics, masks, probabilities).
    pub tensor: Option<TensorId>,
    pub bytes: u64,
    /// Of extra state, the elements kept only as inputs of the op's own GEMMs
    /// ([`crate::op::Saved::gemm_input_elems`]).
    pub gemm_input_elems: u64,
}

/// Builds a graph op by op, inferring shapes and creating weight tensors.
#[derive(Debug)]
pub struct GraphBuilder {
    g: Graph,
    segment: Segment,
}

impl GraphBuilder {
    /// An empty graph named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        GraphBuilder {
            g: Graph {
                name: name.into(),
                tensors: Vec::new(),
                nodes: Vec::new(),
                outputs: Vec::new(),
            },
            segment: Segment::Pre,
        }
    }

    /// Nodes added from now on belong to `segment`.
    pub fn segment(&mut self, segment: Segment) {
        self.segment = segment;
    }

    fn tensor(&mut self, name: String, shape: Shape, dtype: DType, role: TensorRole) -> TensorId {
        self.g.tensors.push(Tensor {
            name,
            shape,
            dtype,
            role,
        });
        TensorId(self.g.tensors.len() as u32 - 1)
    }

    /// A graph input.
    pub fn input(
        &mut self,
        name: impl Into<String>,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> TensorId {
        self.tensor(name.into(), shape.into(), dtype, TensorRole::Input)
    }

    /// A trainable weight.
    pub fn weight(&mut self, name: impl Into<String>, shape: impl Into<Shape>) -> TensorId {
        self.tensor(name.into(), shape.into(), DType::F32, TensorRole::Weight)
    }

    /// Shape of a tensor built so far.
    pub fn shape(&self, t: TensorId) -> &Shape {
        &self.g.tensor(t).shape
    }

    /// Adds a node; its outputs are named `name` (or `name:i` for several).
    pub fn op(
        &mut self,
        name: impl Into<String>,
        op: OpKind,
        inputs: &[TensorId],
    ) -> Result<Vec<TensorId>, GraphError> {
        let name = name.into();
        let shapes: Vec<Shape> = inputs
            .iter()
            .map(|t| self.g.tensor(*t).shape.clone())
            .collect();
        let outs = op.infer(&shapes).map_err(|source| GraphError::Shape {
            node: name.clone(),
            source,
        })?;
        // Every op here produces floating-point outputs.
        let dtype = DType::F32;
        let many = outs.len() > 1;
        let outputs: Vec<TensorId> = outs
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let tn = if many {
                    format!("{name}:{i}")
                } else {
                    name.clone()
                };
                self.tensor(tn, s, dtype, TensorRole::Activation)
            })
            .collect();
        self.g.nodes.push(Node {
            name,
            op,
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
            segment: self.segment,
        });
        Ok(outputs)
    }

    /// Adds a single-output node.
    pub fn op1(
        &mut self,
        name: impl Into<String>,
        op: OpKind,
        inputs: &[TensorId],
    ) -> Result<TensorId, GraphError> {
        Ok(self.op(name, op, inputs)?[0])
    }

    /// `x @ W (+ b)` with fresh weights `name.weight` (in, out) and `name.bias`.
    pub fn linear(
        &mut self,
        name: &str,
        x: TensorId,
        out: u64,
        bias: bool,
    ) -> Result<TensorId, GraphError> {
        let k = self.shape(x).last();
        let w = self.weight(format!("{name}.weight"), [k, out]);
        let mut ins = vec![x, w];
        if bias {
            ins.push(self.weight(format!("{name}.bias"), [out]));
        }
        self.op1(
            name,
            OpKind::Linear(LinearAttrs {
                out_features: out,
                bias,
            }),
            &ins,
        )
    }

    /// Embedding lookup with a fresh table; returns the output and the table (for tying).
    pub fn embedding(
        &mut self,
        name: &str,
        ids: TensorId,
        vocab: u64,
        dim: u64,
    ) -> Result<(TensorId, TensorId), GraphError> {
        let table = self.weight(format!("{name}.weight"), [vocab, dim]);
        let out = self.op1(
            name,
            OpKind::Embedding(EmbeddingAttrs { vocab, dim }),
            &[ids, table],
        )?;
        Ok((out, table))
    }

    /// LayerNorm over the last dimension with fresh scale and shift.
    pub fn layer_norm(&mut self, name: &str, x: TensorId) -> Result<TensorId, GraphError> {
        let c = self.shape(x).last();
        let g = self.weight(format!("{name}.weight"), [c]);
        let b = self.weight(format!("{name}.bias"), [c]);
        self.op1(name, OpKind::LayerNorm, &[x, g, b])
    }

    /// RMSNorm over the last dimension with a fresh scale.
    pub fn rms_norm(&mut self, name: &str, x: TensorId) -> Result<TensorId, GraphError> {
        let c = self.shape(x).last();
        let g = self.weight(format!("{name}.weight"), [c]);
        self.op1(name, OpKind::RmsNorm, &[x, g])
    }

    /// BatchNorm over channels (dim 1) with fresh scale and shift.
    pub fn batch_norm(&mut self, name: &str, x: TensorId) -> Result<TensorId, GraphError> {
        let c = self.shape(x).0.get(1).copied().unwrap_or(1);
        let g = self.weight(format!("{name}.weight"), [c]);
        let b = self.weight(format!("{name}.bias"), [c]);
        self.op1(name, OpKind::BatchNorm, &[x, g, b])
    }

    /// An elementwise activation.
    pub fn activation(
        &mut self,
        name: &str,
        kind: Activation,
        x: TensorId,
    ) -> Result<TensorId, GraphError> {
        self.op1(name, OpKind::Activation(ActivationAttrs { kind }), &[x])
    }

    /// Dropout at `rate_permille / 1000`.
    pub fn dropout(
        &mut self,
        name: &str,
        x: TensorId,
        rate_permille: u32,
    ) -> Result<TensorId, GraphError> {
        self.op1(name, OpKind::Dropout(DropoutAttrs { rate_permille }), &[x])
    }

    /// Attention core.
    pub fn attention(
        &mut self,
        name: &str,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        attrs: AttentionAttrs,
    ) -> Result<TensorId, GraphError> {
        self.op1(name, OpKind::Attention(attrs), &[q, k, v])
    }

    /// 2-D convolution with fresh weights (`attrs.out_channels`, `c / groups`, kh, kw).
    pub fn conv2d(
        &mut self,
        name: &str,
        x: TensorId,
        attrs: Conv2dAttrs,
    ) -> Result<TensorId, GraphError> {
        let c = self.shape(x).0.get(1).copied().unwrap_or(1);
        let groups = attrs.groups.max(1);
        let w = self.weight(
            format!("{name}.weight"),
            [
                attrs.out_channels,
                c / groups,
                attrs.kernel[0],
                attrs.kernel[1],
            ],
        );
        let mut ins = vec![x, w];
        if attrs.bias {
            ins.push(self.weight(format!("{name}.bias"), [attrs.out_channels]));
        }
        self.op1(name, OpKind::Conv2d(attrs), &ins)
    }

    /// Validates and returns the graph with `outputs` as its outputs.
    pub fn finish(mut self, outputs: &[TensorId]) -> Result<Graph, GraphError> {
        self.g.outputs = outputs.to_vec();
        self.g.validate()?;
        Ok(self.g)
    }
}

/// Convolution attributes with the common defaults (no dilation, one group, no bias).
pub fn conv(out_channels: u64, kernel: u64, stride: u64, padding: u64) -> Conv2dAttrs {
    Conv2dAttrs {
        out_channels,
        kernel: [kernel, kernel],
        stride: [stride, stride],
        padding: [padding, padding],
        dilation: [1, 1],
        groups: 1,
        bias: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::ReshapeAttrs;

    fn mlp() -> Graph {
        let mut b = GraphBuilder::new("mlp");
        let x = b.input("x", [4, 16], DType::F32);
        let h = b.linear("fc1", x, 32, true).unwrap();
        let h = b.activation("act", Activation::Relu, h).unwrap();
        let y = b.linear("fc2", h, 8, true).unwrap();
        b.finish(&[y]).unwrap()
    }

    #[test]
    fn builder_infers_shapes_and_counts_params() {
        let g = mlp();
        assert_eq!(g.nodes.len(), 3);
        assert_eq!(g.param_count(), 16 * 32 + 32 + 32 * 8 + 8);
        assert_eq!(g.tensor(g.outputs[0]).shape, Shape::new([4, 8]));
        let w = g.total_work(4);
        assert_eq!(
            w.fwd_flops.0,
            (2 * 4 * 16 * 32 + 4 * 32 + 4 * 32 + 2 * 4 * 32 * 8 + 4 * 8) as f64
        );
    }

    #[test]
    fn shape_mismatch_is_a_typed_error_naming_the_node() {
        let mut b = GraphBuilder::new("bad");
        let x = b.input("x", [4, 16], DType::F32);
        let w = b.weight("w", [15, 8]);
        let err = b
            .op1(
                "fc",
                OpKind::Linear(LinearAttrs {
                    out_features: 8,
                    bias: false,
                }),
                &[x, w],
            )
            .unwrap_err();
        assert!(
            matches!(err, GraphError::Shape { ref node, .. } if node == "fc"),
            "{err}"
        );
    }

    #[test]
    fn validate_rejects_cycles_dangling_ids_and_reorders() {
        let mut g = mlp();
        g.nodes.swap(0, 2);
        g.validate().unwrap();
        assert_eq!(g.nodes[0].name, "fc1");

        let mut g = mlp();
        // act reads its own output through fc1: a cycle.
        let act_out = g.nodes[1].outputs[0];
        g.nodes[0].inputs[0] = act_out;
        assert!(matches!(
            g.validate(),
            Err(GraphError::Cycle { .. }) | Err(GraphError::Shape { .. })
        ));

        let mut g = mlp();
        g.nodes[1].inputs[0] = TensorId(999);
        assert!(matches!(
            g.validate(),
            Err(GraphError::DanglingTensor { tensor: 999, .. })
        ));

        let mut g = mlp();
        g.tensors[g.outputs[0].0 as usize].shape = Shape::new([4, 9]);
        assert!(matches!(
            g.validate(),
            Err(GraphError::ShapeDisagrees { .. })
        ));
    }

    #[test]
    fn cycle_is_detected() {
        let mut b = GraphBuilder::new("cyc");
        let x = b.input("x", [2, 2], DType::F32);
        let a = b.op1("a", OpKind::Add, &[x, x]).unwrap();
        let c = b.op1("c", OpKind::Add, &[a, x]).unwrap();
        let mut g = b.finish(&[c]).unwrap();
        g.nodes[0].inputs[1] = c;
        assert_eq!(g.validate(), Err(GraphError::Cycle { node: "a".into() }));
    }

    #[test]
    fn views_alias_their_input_in_activation_accounting() {
        let mut b = GraphBuilder::new("v");
        let x = b.input("x", [2, 6], DType::F32);
        let h = b.linear("fc", x, 6, false).unwrap();
        let r = b
            .op1(
                "r",
                OpKind::Reshape(ReshapeAttrs {
                    shape: vec![2, 2, 3],
                }),
                &[h],
            )
            .unwrap();
        let a = b.activation("act", Activation::Gelu, r).unwrap();
        let r2 = b
            .op1(
                "r2",
                OpKind::Reshape(ReshapeAttrs { shape: vec![2, 6] }),
                &[a],
            )
            .unwrap();
        let y = b.linear("fc2", r2, 6, false).unwrap();
        let g = b.finish(&[y]).unwrap();
        // fc keeps x (12), gelu keeps h (=r, 12), fc2 keeps a (=r2, 12): 36 elements.
        assert_eq!(g.activation_bytes(2, |_| true), Bytes(36 * 2));
    }
}
