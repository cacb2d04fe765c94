//! Measured speeds of the CPU executor's own kernels, by op class: what host cores need
//! besides a GEMM curve and a streaming bandwidth.
//!
//! A GPU runs a bandwidth-bound op as one kernel near the memory bandwidth, so bytes and a
//! bandwidth price it. parallax's CPU executor runs each op as a loop of its own — a BatchNorm
//! with per-channel statistics, a pooling backward scattering through saved indices, a
//! convolution's im2col copies between per-sample GEMMs, an LSTM cell's scalar sigmoids and
//! tangents over strided gate rows — and those loops differ per op by several times in what a
//! byte costs. `parallax calibrate` times each class's kernel on this machine at two sizes, and
//! records the rate of what is not GEMM arithmetic (the GEMMs it runs are priced on the
//! calibrated GEMM curve) in bytes of the op's priced traffic per second (see the cost model's
//! `DeviceModel::host_split` for which bytes each class is priced on).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The op classes a table may name: op names (the cost model maps every op to one of these or
/// none), and `ring_attention`, the transformer trainer's context-parallel attention (a ring
/// of key/value blocks under a running softmax, scores recomputed in backward).
pub const HOST_KERNEL_CLASSES: &[&str] = &[
    "add",
    "attention",
    "avg_pool2d",
    "batch_norm",
    "broadcast_add",
    "broadcast_mul",
    "concat",
    "conv2d",
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "global_avg_pool",
    "gru",
    "layer_norm",
    "linear",
    "lstm",
    "matmul",
    "max_pool2d",
    "moe",
    "mul",
    "relu",
    "ring_attention",
    "rms_norm",
    "rope",
    "sigmoid",
    "silu",
    "softmax",
    "split",
    "squared_relu",
    "swiglu",
    "tanh",
    "transpose",
];

/// Which of the CPU executor's trainers runs a model's ops: they are separate kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HostTrainer {
    /// The transformer trainer (`parallax run` of a GPT, Llama or MoE model).
    #[default]
    Transformer,
    /// The general-graph trainer (CNNs, RNNs, any per-op plan).
    Graph,
}

/// One class's rates by size: `[[bytes, forward bytes/s, backward bytes/s], ...]` by increasing
/// bytes — the bytes of one call of the kernel's inner loop (a sample's convolution, a step of
/// a recurrent layer; the whole op for the rest) at the measured size, and the rates at which
/// the op's priced bytes went (the backward's rate counts the same bytes, so a backward twice
/// as slow as its forward has half the forward's rate). Between sizes the rates are
/// interpolated in `log(bytes)`; outside, the nearest size's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KernelRates(pub Vec<[f64; 3]>);

impl KernelRates {
    /// `(forward, backward)` rates at `bytes`.
    pub fn at(&self, bytes: f64) -> (f64, f64) {
        let pts = &self.0;
        let (Some(first), Some(last)) = (pts.first(), pts.last()) else {
            return (f64::INFINITY, f64::INFINITY);
        };
        if !(bytes.is_finite() && bytes > first[0]) {
            return (first[1], first[2]);
        }
        if bytes >= last[0] {
            return (last[1], last[2]);
        }
        let x = bytes.ln();
        for w in pts.windows(2) {
            let (a, b) = (w[0], w[1]);
            if bytes <= b[0] {
                let t = (x - a[0].ln()) / (b[0].ln() - a[0].ln()).max(f64::MIN_POSITIVE);
                // Interpolated in log(rate) too: a rate that halves between sizes is at
                // 1/√2 half way.
                let lerp = |u: f64, v: f64| (u.ln() + t * (v.ln() - u.ln())).exp();
                return (lerp(a[1], b[1]), lerp(a[2], b[2]));
            }
        }
        (last[1], last[2])
    }

    /// Checks the table; on failure `(index or None, problem)`.
    pub(crate) fn check(&self) -> Result<(), (Option<usize>, String)> {
        if self.0.is_empty() {
            return Err((
                None,
                "needs at least one [bytes, forward, backward] entry".into(),
            ));
        }
        for (i, p) in self.0.iter().enumerate() {
            if !p.iter().all(|v| v.is_finite() && *v > 0.0) {
                return Err((Some(i), format!("values must be positive, got {p:?}")));
            }
            if i > 0 && p[0] <= self.0[i - 1][0] {
                return Err((Some(i), "bytes must increase".into()));
            }
        }
        Ok(())
    }
}

/// The measured classes of each trainer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostKernels {
    /// The transformer trainer's kernels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub transformer: BTreeMap<String, KernelRates>,
    /// The general-graph trainer's kernels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub graph: BTreeMap<String, KernelRates>,
    /// The general-graph trainer's fixed cost of one op call (a forward or a backward),
    /// microseconds: scheduling the op, gathering its inputs, storing its outputs, as a view
    /// op's call measures it. An op's class rate prices what is left; a small micro-batch
    /// pays the call as often as a large one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graph_call_us: Option<f64>,
}

impl HostKernels {
    /// `trainer`'s rates of `class`, where measured.
    pub fn rates(&self, trainer: HostTrainer, class: &str) -> Option<&KernelRates> {
        match trainer {
            HostTrainer::Transformer => self.transformer.get(class),
            HostTrainer::Graph => self.graph.get(class),
        }
    }

    /// The general-graph trainer's fixed cost of one op call, seconds (0 where not measured).
    pub fn graph_call_s(&self) -> f64 {
        self.graph_call_us.map_or(0.0, |us| us * 1e-6)
    }

    /// Checks every table; on failure `(field path below the table, problem)`.
    pub(crate) fn check(&self) -> Result<(), (String, String)> {
        if let Some(us) = self.graph_call_us {
            if !(us.is_finite() && us >= 0.0) {
                return Err((
                    "graph_call_us".into(),
                    format!("must be a non-negative number of microseconds, got {us}"),
                ));
            }
        }
        for (trainer, table) in [("transformer", &self.transformer), ("graph", &self.graph)] {
            for (class, rates) in table {
                if !HOST_KERNEL_CLASSES.contains(&class.as_str()) {
                    return Err((
                        format!("{trainer}.{class}"),
                        format!(
                            "unknown op class; known: {}",
                            HOST_KERNEL_CLASSES.join(", ")
                        ),
                    ));
                }
                rates.check().map_err(|(i, problem)| {
                    let at = i.map_or(String::new(), |i| format!("[{i}]"));
                    (format!("{trainer}.{class}{at}"), problem)
                })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_interpolate_in_log_space_and_clamp_outside() {
        let r = KernelRates(vec![[1e3, 4e9, 2e9], [1e5, 1e9, 5e8]]);
        assert_eq!(r.at(10.0), (4e9, 2e9));
        assert_eq!(r.at(1e7), (1e9, 5e8));
        let (f, b) = r.at(1e4);
        assert!((f - 2e9).abs() < 1e3 && (b - 1e9).abs() < 1e3, "{f} {b}");
    }

    #[test]
    fn a_table_names_known_classes_with_positive_increasing_rates() {
        let mut h = HostKernels::default();
        h.graph
            .insert("batch_norm".into(), KernelRates(vec![[1e3, 1e9, 1e9]]));
        assert!(h.check().is_ok());
        h.graph
            .insert("warp_drive".into(), KernelRates(vec![[1e3, 1e9, 1e9]]));
        assert!(h.check().unwrap_err().0.contains("graph.warp_drive"));
        let mut h = HostKernels::default();
        h.transformer.insert(
            "add".into(),
            KernelRates(vec![[1e3, 1e9, 1e9], [1e2, 1e9, 1e9]]),
        );
        assert_eq!(h.check().unwrap_err().0, "transformer.add[1]");
        h.transformer
            .insert("add".into(), KernelRates(vec![[1e3, 0.0, 1e9]]));
        assert!(h.check().unwrap_err().1.contains("positive"));
    }
}
