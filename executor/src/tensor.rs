//! fp32 kernels on flat row-major buffers: a strided matrix view over which the `gemm` crate
//! multiplies, and the pointwise, normalisation, attention and loss kernels of the transformer
//! with their hand-written gradients.

use std::ops::Range;

/// A read-only strided matrix view: element `(i, j)` is `data[off + i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// A dense row-major `rows × cols` matrix at the start of `data`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef::strided(data, 0, rows, cols, cols, 1)
    }

    /// A general strided view. Panics (a programming error, never user input) when it reaches
    /// past `data`.
    pub fn strided(
        data: &'a [f32],
        off: usize,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Self {
        check_view(off, rows, cols, rs, cs, data.len());
        MatRef {
            data,
            off,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// The transpose (a view; nothing moves).
    pub fn t(self) -> Self {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// A mutable strided matrix view.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatMut<'a> {
    /// A dense row-major `rows × cols` matrix at the start of `data`.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        MatMut::strided(data, 0, rows, cols, cols, 1)
    }

    /// A general strided view; panics when it reaches past `data`.
    pub fn strided(
        data: &'a mut [f32],
        off: usize,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Self {
        check_view(off, rows, cols, rs, cs, data.len());
        MatMut {
            data,
            off,
            rows,
            cols,
            rs,
            cs,
        }
    }
}

/// One past the largest index a view touches (0 for an empty view).
pub(crate) fn span(off: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        off + (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// Panics (a programming error, never user input) when a view reaches past its buffer.
fn check_view(off: usize, rows: usize, cols: usize, rs: usize, cs: usize, len: usize) {
    assert!(
        span(off, rows, cols, rs, cs) <= len,
        "matrix view {rows}x{cols} (rs {rs}, cs {cs}, off {off}) exceeds buffer of {len}"
    );
}

/// Whether `gemm` may use several threads (only when one rank owns the whole machine).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Threads {
    /// The calling thread only (one rank per core).
    #[default]
    One,
    /// Up to this many threads (rayon).
    Many(usize),
}

/// One operand of a [`ColMajorGemm`]: where it lies in its buffer and how to read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColMajorOperand {
    /// The elements the operand touches (`off .. span`) in its buffer.
    pub range: std::ops::Range<usize>,
    /// Read transposed (`CUBLAS_OP_T`).
    pub trans: bool,
    /// Leading dimension of the stored column-major matrix.
    pub ld: usize,
}

/// A row-major `c (+)= a · b` on strided views restated as a column-major BLAS call
/// `C' = op(A') · op(B')` (cuBLAS's convention): since a row-major matrix is the column-major
/// storage of its transpose, `cᵀ = bᵀ · aᵀ` is computed with `A'` from `b`, `B'` from `a`,
/// `m' = n`, `n' = m`. Ranges are relative to each view's buffer, so a device copy of just
/// that range (starting at 0) is addressed by the same call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColMajorGemm {
    /// Rows of `C'` (columns of the row-major `c`).
    pub m: usize,
    /// Columns of `C'` (rows of `c`).
    pub n: usize,
    /// The shared dimension.
    pub k: usize,
    /// `A'`, read from the row-major `b`.
    pub a: ColMajorOperand,
    /// `B'`, read from the row-major `a`.
    pub b: ColMajorOperand,
    /// `C'`: the row-major `c`, not transposed.
    pub c: ColMajorOperand,
}

/// The column-major form of one row-major view that must be read as its transpose: a view
/// with unit column stride is the column-major storage of its transpose (no op), one with
/// unit row stride is the column-major storage of itself (op T). `None` when neither stride
/// is 1 or the views overlap themselves (a BLAS cannot address them).
fn col_major_operand(
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
) -> Option<ColMajorOperand> {
    let range = off..span(off, rows, cols, rs, cs);
    if cs == 1 && (rows <= 1 || rs >= cols) {
        Some(ColMajorOperand {
            range,
            trans: false,
            ld: rs.max(cols).max(1),
        })
    } else if rs == 1 && (cols <= 1 || cs >= rows) {
        Some(ColMajorOperand {
            range,
            trans: true,
            ld: cs.max(rows).max(1),
        })
    } else {
        None
    }
}

/// The column-major BLAS call computing `c (+)= a · b`, or `None` when a view has no unit
/// stride (the CPU kernel handles those) or `c` is stored transposed.
pub fn col_major_gemm(c: &MatMut<'_>, a: &MatRef<'_>, b: &MatRef<'_>) -> Option<ColMajorGemm> {
    let cm = col_major_operand(c.off, c.rows, c.cols, c.rs, c.cs)?;
    if cm.trans {
        return None;
    }
    Some(ColMajorGemm {
        m: c.cols,
        n: c.rows,
        k: a.cols,
        a: col_major_operand(b.off, b.rows, b.cols, b.rs, b.cs)?,
        b: col_major_operand(a.off, a.rows, a.cols, a.rs, a.cs)?,
        c: cm,
    })
}

/// Runs the heavy kernels somewhere else (a GPU): installed per thread with
/// [`set_device_offload`], consulted by [`matmul`] for every GEMM of at least
/// [`DeviceOffload::min_flops`] and by the trainer's Adam update ([`adam_offloaded`]).
pub trait DeviceOffload {
    /// Smallest GEMM (in FLOPs, 2·m·n·k) worth handing over; smaller ones stay on the CPU.
    fn min_flops(&self) -> usize {
        OFFLOAD_MIN_FLOPS
    }

    /// `C' = op(A')·op(B') (+ C' when accumulate)` on the operands' ranges: `a`, `b` and `c`
    /// are exactly `plan.a.range`, `plan.b.range` and `plan.c.range` of the views' buffers.
    /// Returns `false` to decline (the CPU kernel then runs it); an error is a failure of the
    /// device: [`matmul`] panics with it, which the backends report as a failure of the rank.
    fn gemm(
        &self,
        plan: &ColMajorGemm,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<bool, String>;

    /// The Adam update of `p` with gradients `g` and moments `m`, `v` (bias corrections
    /// `bc1`, `bc2` given), the same arithmetic as the trainer's own loop. `false` declines.
    #[allow(clippy::too_many_arguments)]
    fn adam(
        &self,
        _cfg: &crate::engine::AdamConfig,
        _bc: (f32, f32),
        _p: &mut [f32],
        _g: &[f32],
        _m: &mut [f32],
        _v: &mut [f32],
    ) -> Result<bool, String> {
        Ok(false)
    }
}

/// Hands an Adam update to this thread's offload; `false` when there is none or it declined
/// (the caller then runs its own loop). Panics on a device failure, as [`matmul`] does.
pub fn adam_offloaded(
    cfg: &crate::engine::AdamConfig,
    bc: (f32, f32),
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> bool {
    let Some(o) = OFFLOAD.with(|x| x.borrow().clone()) else {
        return false;
    };
    match o.adam(cfg, bc, p, g, m, v) {
        Ok(done) => done,
        Err(e) => panic!("device offload failed: {e}"),
    }
}

/// Default of [`DeviceOffload::min_flops`]: small enough that the trainer's test models hand
/// their GEMMs over; a real device states what its copies cost.
pub const OFFLOAD_MIN_FLOPS: usize = 1 << 16;

thread_local! {
    static OFFLOAD: std::cell::RefCell<Option<std::rc::Rc<dyn DeviceOffload>>> =
        const { std::cell::RefCell::new(None) };
}

/// Installs (or with `None` removes) this thread's device offload.
pub fn set_device_offload(o: Option<std::rc::Rc<dyn DeviceOffload>>) {
    OFFLOAD.with(|x| *x.borrow_mut() = o);
}

/// Hands `c (+)= a · b` to this thread's offload if one is installed and takes it.
fn offloaded(c: &mut MatMut<'_>, a: &MatRef<'_>, b: &MatRef<'_>, accumulate: bool) -> bool {
    let Some(o) = OFFLOAD.with(|x| x.borrow().clone()) else {
        return false;
    };
    if 2 * c.rows * c.cols * a.cols < o.min_flops() {
        return false;
    }
    let Some(plan) = col_major_gemm(c, a, b) else {
        return false;
    };
    let (ar, br, cr) = (
        plan.a.range.clone(),
        plan.b.range.clone(),
        plan.c.range.clone(),
    );
    match o.gemm(&plan, &b.data[ar], &a.data[br], &mut c.data[cr], accumulate) {
        Ok(done) => done,
        Err(e) => panic!("device offload failed: {e}"),
    }
}

/// `c = a · b` (or `c += a · b` when `accumulate`), fp32, through the `gemm` crate's packed
/// SIMD kernels — or through this thread's [`DeviceOffload`] when one is installed.
pub fn matmul(mut c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool, threads: Threads) {
    assert!(
        a.rows == c.rows && b.cols == c.cols && a.cols == b.rows,
        "matmul shapes: {}x{} · {}x{} -> {}x{}",
        a.rows,
        a.cols,
        b.rows,
        b.cols,
        c.rows,
        c.cols
    );
    let (m, n, k) = (c.rows, c.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    c.data[c.off + i * c.rs + j * c.cs] = 0.0;
                }
            }
        }
        return;
    }
    if offloaded(&mut c, &a, &b, accumulate) {
        return;
    }
    let par = match threads {
        Threads::One => gemm::Parallelism::None,
        Threads::Many(t) => gemm::Parallelism::Rayon(t.max(1)),
    };
    let isz = |x: usize| x as isize;
    // SAFETY: the views were bounds-checked on construction (`span` <= len) and the shapes
    // agree (asserted above), so every element gemm reads or writes lies inside the slices; `c`
    // is borrowed mutably, so it cannot alias `a` or `b`.
    #[allow(unsafe_code)]
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.data.as_mut_ptr().add(c.off),
            isz(c.cs),
            isz(c.rs),
            accumulate,
            a.data.as_ptr().add(a.off),
            isz(a.cs),
            isz(a.rs),
            b.data.as_ptr().add(b.off),
            isz(b.cs),
            isz(b.rs),
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        );
    }
}

/// `y[rows × n] = x[rows × k] · w[k × n]` (+= when `acc`), dense row-major.
pub fn mm(y: &mut [f32], x: &[f32], w: &[f32], rows: usize, k: usize, n: usize, acc: bool) {
    matmul(
        MatMut::new(y, rows, n),
        MatRef::new(x, rows, k),
        MatRef::new(w, k, n),
        acc,
        Threads::One,
    );
}

/// `y[rows × k] (+)= dy[rows × n] · w[k × n]ᵀ` (input gradient of [`mm`]).
pub fn mm_nt(y: &mut [f32], dy: &[f32], w: &[f32], rows: usize, k: usize, n: usize, acc: bool) {
    matmul(
        MatMut::new(y, rows, k),
        MatRef::new(dy, rows, n),
        MatRef::new(w, k, n).t(),
        acc,
        Threads::One,
    );
}

/// `dw[k × n] (+)= x[rows × k]ᵀ · dy[rows × n]` (weight gradient of [`mm`]).
pub fn mm_tn(dw: &mut [f32], x: &[f32], dy: &[f32], rows: usize, k: usize, n: usize, acc: bool) {
    matmul(
        MatMut::new(dw, k, n),
        MatRef::new(x, rows, k).t(),
        MatRef::new(dy, rows, n),
        acc,
        Threads::One,
    );
}

/// Adds a bias row vector to every row.
pub fn add_bias(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_exact_mut(b.len()) {
        for (v, bb) in row.iter_mut().zip(b) {
            *v += bb;
        }
    }
}

/// Accumulates the column sums of `dy` into `db` (bias gradient).
pub fn bias_grad(db: &mut [f32], dy: &[f32]) {
    for row in dy.chunks_exact(db.len()) {
        for (g, d) in db.iter_mut().zip(row) {
            *g += d;
        }
    }
}

/// `a += b` elementwise.
pub fn add_into(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// Normalisation epsilon (PyTorch's LayerNorm default and Llama's RMSNorm `rms_norm_eps`).
pub const NORM_EPS: f32 = 1e-5;

/// LayerNorm (`w`, optional `b`) or RMSNorm (`b` is `None` and `rms`) over rows of width
/// `w.len()`. Returns per-row `(mean, rstd)` for the backward (mean is 0 for RMSNorm).
pub fn norm_fwd(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    rms: bool,
) -> Vec<[f32; 2]> {
    let h = w.len();
    let mut stats = Vec::with_capacity(x.len() / h);
    for (yr, xr) in y.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
        let mean = if rms {
            0.0
        } else {
            xr.iter().sum::<f32>() / h as f32
        };
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let rstd = 1.0 / (var + NORM_EPS).sqrt();
        for j in 0..h {
            let xhat = (xr[j] - mean) * rstd;
            yr[j] = xhat * w[j] + b.map_or(0.0, |b| b[j]);
        }
        stats.push([mean, rstd]);
    }
    stats
}

/// Backward of [`norm_fwd`]: `dx` (overwritten, or accumulated when `acc`), `dw`, `db` accumulated.
#[allow(clippy::too_many_arguments)]
pub fn norm_bwd(
    dx: &mut [f32],
    dy: &[f32],
    x: &[f32],
    stats: &[[f32; 2]],
    w: &[f32],
    dw: &mut [f32],
    mut db: Option<&mut [f32]>,
    rms: bool,
    acc: bool,
) {
    let h = w.len();
    let mut dxhat = vec![0.0f32; h];
    for (r, ((dxr, dyr), xr)) in dx
        .chunks_exact_mut(h)
        .zip(dy.chunks_exact(h))
        .zip(x.chunks_exact(h))
        .enumerate()
    {
        let [mean, rstd] = stats[r];
        let (mut s1, mut s2) = (0.0f32, 0.0f32);
        for j in 0..h {
            let xhat = (xr[j] - mean) * rstd;
            dw[j] += dyr[j] * xhat;
            if let Some(db) = db.as_deref_mut() {
                db[j] += dyr[j];
            }
            dxhat[j] = dyr[j] * w[j];
            s1 += dxhat[j];
            s2 += dxhat[j] * xhat;
        }
        let (m1, m2) = (if rms { 0.0 } else { s1 / h as f32 }, s2 / h as f32);
        for j in 0..h {
            let xhat = (xr[j] - mean) * rstd;
            let g = rstd * (dxhat[j] - m1 - xhat * m2);
            if acc {
                dxr[j] += g;
            } else {
                dxr[j] = g;
            }
        }
    }
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2 / pi)

/// GeLU, tanh approximation (GPT-2's `gelu_new`).
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (GELU_C * (x + 0.044_715 * x * x * x)).tanh())
}

/// Derivative of [`gelu`].
pub fn gelu_grad(x: f32) -> f32 {
    let u = GELU_C * (x + 0.044_715 * x * x * x);
    let t = u.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * 0.044_715 * x * x)
}

/// An MLP's activation: GeLU of one projection, or a gate and an up projection combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// GeLU (tanh approximation).
    Gelu,
    /// `max(x, 0)` (OPT).
    Relu,
    /// `max(x, 0)²` (Primer; Nemotron's `relu2`).
    SquaredRelu,
    /// `silu(gate) · up` (Llama).
    Swiglu,
    /// GPT-OSS's `(clamp(up, −L, L) + 1) · g · σ(α g)`, `g = min(gate, L)`, with
    /// [`CLAMPED_GLU_LIMIT`] and [`CLAMPED_GLU_ALPHA`].
    ClampedSwiglu,
}

/// GPT-OSS's clamp on the gate (above) and the up projection (both ways): `swiglu_limit`.
pub const CLAMPED_GLU_LIMIT: f32 = 7.0;
/// GPT-OSS's factor inside the gate's sigmoid (the quick GeLU's 1.702).
pub const CLAMPED_GLU_ALPHA: f32 = 1.702;

impl Act {
    /// The activation of pre-activations `g` (and the gated kinds' `up`).
    pub fn fwd(self, g: &[f32], up: Option<&[f32]>) -> Vec<f32> {
        match (self, up) {
            (Act::Swiglu, Some(u)) => g.iter().zip(u).map(|(a, b)| a * sigmoid(*a) * b).collect(),
            (Act::ClampedSwiglu, Some(u)) => g
                .iter()
                .zip(u)
                .map(|(a, b)| {
                    let (a, b) = (
                        a.min(CLAMPED_GLU_LIMIT),
                        b.clamp(-CLAMPED_GLU_LIMIT, CLAMPED_GLU_LIMIT),
                    );
                    (b + 1.0) * a * sigmoid(CLAMPED_GLU_ALPHA * a)
                })
                .collect(),
            (Act::Relu, _) => g.iter().map(|a| a.max(0.0)).collect(),
            (Act::SquaredRelu, _) => g.iter().map(|a| a.max(0.0).powi(2)).collect(),
            _ => g.iter().map(|a| gelu(*a)).collect(),
        }
    }

    /// Backward: turns `da` (the activation's gradient) into the gradient of `g` in place and
    /// returns the up projection's (gated kinds). A clamped input passes no gradient.
    pub fn bwd(self, da: &mut [f32], g: &[f32], up: Option<&[f32]>) -> Option<Vec<f32>> {
        match (self, up) {
            (Act::Swiglu, Some(u)) => {
                let mut du = vec![0.0; da.len()];
                for i in 0..da.len() {
                    let sg = sigmoid(g[i]);
                    du[i] = da[i] * g[i] * sg;
                    da[i] *= u[i] * sg * (1.0 + g[i] * (1.0 - sg));
                }
                Some(du)
            }
            (Act::ClampedSwiglu, Some(u)) => {
                let (lim, al) = (CLAMPED_GLU_LIMIT, CLAMPED_GLU_ALPHA);
                let mut du = vec![0.0; da.len()];
                for i in 0..da.len() {
                    let (a, b) = (g[i].min(lim), u[i].clamp(-lim, lim));
                    let sg = sigmoid(al * a);
                    du[i] = if u[i].abs() <= lim {
                        da[i] * a * sg
                    } else {
                        0.0
                    };
                    da[i] *= if g[i] <= lim {
                        (b + 1.0) * sg * (1.0 + al * a * (1.0 - sg))
                    } else {
                        0.0
                    };
                }
                Some(du)
            }
            (Act::Relu, _) => {
                for (d, x) in da.iter_mut().zip(g) {
                    *d = if *x > 0.0 { *d } else { 0.0 };
                }
                None
            }
            (Act::SquaredRelu, _) => {
                for (d, x) in da.iter_mut().zip(g) {
                    *d *= 2.0 * x.max(0.0);
                }
                None
            }
            _ => {
                for (d, x) in da.iter_mut().zip(g) {
                    *d *= gelu_grad(*x);
                }
                None
            }
        }
    }
}

/// Logistic sigmoid.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Applies (or, with `inverse`, un-applies — the backward) rotary embeddings of base `theta`
/// (Su et al. 2021: 10 000; Llama 3: 500 000, HF's `rope_theta`) in place to `x` of
/// `rows × (heads · hd)`, row `t` at position `pos(t)`; pairs `(i, i + hd/2)` rotate together
/// (HuggingFace Llama's `rotate_half`).
pub fn rope(
    x: &mut [f32],
    heads: usize,
    hd: usize,
    theta: f64,
    pos: impl Fn(usize) -> usize,
    inverse: bool,
) {
    let half = hd / 2;
    let width = heads * hd;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| theta.powf(-(2.0 * i as f64) / hd as f64) as f32)
        .collect();
    for (t, row) in x.chunks_exact_mut(width).enumerate() {
        let p = pos(t) as f32;
        for (i, f) in inv_freq.iter().enumerate() {
            let (s, c) = (p * f).sin_cos();
            let s = if inverse { -s } else { s };
            for hh in 0..heads {
                let base = hh * hd;
                let (a, b) = (row[base + i], row[base + i + half]);
                row[base + i] = a * c - b * s;
                row[base + i + half] = b * c + a * s;
            }
        }
    }
}

/// The keys a query row sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Every key of its sequence (an encoder).
    All,
    /// The keys up to its own position; with a sliding window, the `w` latest of them.
    Causal(Option<usize>),
}

impl Mask {
    /// The key positions, of `0..sk`, a query at `pos` sees.
    pub fn keys(self, pos: usize, sk: usize) -> Range<usize> {
        match self {
            Mask::All => 0..sk,
            Mask::Causal(w) => {
                let seen = (pos + 1).min(sk);
                w.map_or(0, |w| (pos + 1).saturating_sub(w)).min(seen)..seen
            }
        }
    }

    /// Whether a query at position `q` sees the key at position `k`.
    pub fn sees(self, q: usize, k: usize) -> bool {
        match self {
            Mask::All => true,
            Mask::Causal(w) => k <= q && w.is_none_or(|w| q < k + w),
        }
    }
}

/// The shape of one attention call: `batch` sequences, each with query rows at positions
/// `q_pos` and `sk` key/value rows, `heads` query heads sharing `kv_heads` key/value heads of
/// size `hd`, and the keys a query sees.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape<'a> {
    pub batch: usize,
    pub q_pos: &'a [usize],
    pub sk: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub mask: Mask,
}

/// Causal softmax attention of `batch` sequences: each has `q_pos.len()` query rows at
/// positions `q_pos` of the sequence and `sk` key/value rows at positions `0..sk` (the whole
/// sequence: the square case when `q_pos` is `0..sk`; a context-parallel rank's chunks
/// against the gathered keys otherwise), `heads` query heads sharing `kv_heads` key/value
/// heads (GQA), head size `hd`. `q` is `batch·sq × heads·hd`, `k`/`v` are
/// `batch·sk × kv_heads·hd`. Writes `o` (`batch·sq × heads·hd`) and returns the attention
/// probabilities (`batch · heads · sq · sk`) when `keep_probs`. `mask` says which keys a query
/// sees: those up to its own position (causal; with a sliding window the latest of them), or
/// all (an encoder). With `sinks` (one logit per
/// head, GPT-OSS's attention sinks) each row's softmax also counts a sink that holds no value:
/// the probabilities of the keys sum to less than one.
pub fn attention_fwd(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttnShape<'_>,
    sinks: Option<&[f32]>,
    keep_probs: bool,
) -> Option<Vec<f32>> {
    let AttnShape {
        batch,
        q_pos,
        sk,
        heads,
        kv_heads,
        hd,
        ..
    } = *shape;
    let sq = q_pos.len();
    let mut all = keep_probs.then(|| vec![0.0f32; batch * heads * sq * sk]);
    let mut p = vec![0.0f32; sq * sk];
    for b in 0..batch {
        for hh in 0..heads {
            let sink = sinks.map(|s| s[hh]);
            attention_probs(&mut p, (q, k), (b, hh), shape, sink);
            let kvh = hh / (heads / kv_heads);
            let (qw, kw) = (heads * hd, kv_heads * hd);
            matmul(
                MatMut::strided(o, b * sq * qw + hh * hd, sq, hd, qw, 1),
                MatRef::new(&p, sq, sk),
                MatRef::strided(v, b * sk * kw + kvh * hd, sk, hd, kw, 1),
                false,
                Threads::One,
            );
            if let Some(all) = all.as_mut() {
                let at = (b * heads + hh) * sq * sk;
                all[at..at + sq * sk].copy_from_slice(&p);
            }
        }
    }
    all
}

/// Softmax(q kᵀ / √hd) over the keys `mask` lets each query see (causal: key position ≤
/// query position, with a sliding window also above query position − window; an encoder's:
/// all) for one sequence and head, into `p` (`sq × sk`); a `sink` logit joins each row's
/// normaliser.
fn attention_probs(
    p: &mut [f32],
    (q, k): (&[f32], &[f32]),
    (b, hh): (usize, usize),
    shape: &AttnShape<'_>,
    sink: Option<f32>,
) {
    let AttnShape {
        q_pos,
        sk,
        heads,
        kv_heads,
        hd,
        mask,
        ..
    } = *shape;
    let sq = q_pos.len();
    let kvh = hh / (heads / kv_heads);
    let (qw, kw) = (heads * hd, kv_heads * hd);
    matmul(
        MatMut::new(p, sq, sk),
        MatRef::strided(q, b * sq * qw + hh * hd, sq, hd, qw, 1),
        MatRef::strided(k, b * sk * kw + kvh * hd, sk, hd, kw, 1).t(),
        false,
        Threads::One,
    );
    let scale = 1.0 / (hd as f32).sqrt();
    for (i, &pos) in q_pos.iter().enumerate() {
        let row = &mut p[i * sk..(i + 1) * sk];
        let Range {
            start: first,
            end: seen,
        } = mask.keys(pos, sk);
        let mut mx = sink.unwrap_or(f32::NEG_INFINITY);
        for x in &mut row[first..seen] {
            *x *= scale;
            mx = mx.max(*x);
        }
        let mut sum = sink.map_or(0.0, |s| (s - mx).exp());
        for x in &mut row[first..seen] {
            *x = (*x - mx).exp();
            sum += *x;
        }
        for (j, x) in row.iter_mut().enumerate() {
            *x = if (first..seen).contains(&j) {
                *x / sum
            } else {
                0.0
            };
        }
    }
}

/// Backward of [`attention_fwd`]: accumulates into `dq`, `dk`, `dv` (callers zero them) and,
/// with sinks, their gradient into `dsinks`: a row's sink, holding no value, takes
/// `−p_sink · rowsum(dP ⊙ P)`. Uses the saved probabilities when given, else recomputes them
/// from `q` and `k` (selective recomputation).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    d_o: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: Option<&[f32]>,
    shape: &AttnShape<'_>,
    sinks: Option<&[f32]>,
    mut dsinks: Option<&mut [f32]>,
) {
    let AttnShape {
        batch,
        q_pos,
        sk,
        heads,
        kv_heads,
        hd,
        ..
    } = *shape;
    let sq = q_pos.len();
    let (qw, kw) = (heads * hd, kv_heads * hd);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut p_buf = vec![0.0f32; sq * sk];
    let mut dp = vec![0.0f32; sq * sk];
    for b in 0..batch {
        for hh in 0..heads {
            let kvh = hh / (heads / kv_heads);
            let p: &[f32] = match probs {
                Some(all) => {
                    let at = (b * heads + hh) * sq * sk;
                    &all[at..at + sq * sk]
                }
                None => {
                    attention_probs(&mut p_buf, (q, k), (b, hh), shape, sinks.map(|s| s[hh]));
                    &p_buf
                }
            };
            let qoff = b * sq * qw + hh * hd;
            let koff = b * sk * kw + kvh * hd;
            // dV += Pᵀ dO; dP = dO Vᵀ
            matmul(
                MatMut::strided(dv, koff, sk, hd, kw, 1),
                MatRef::new(p, sq, sk).t(),
                MatRef::strided(d_o, qoff, sq, hd, qw, 1),
                true,
                Threads::One,
            );
            matmul(
                MatMut::new(&mut dp, sq, sk),
                MatRef::strided(d_o, qoff, sq, hd, qw, 1),
                MatRef::strided(v, koff, sk, hd, kw, 1).t(),
                false,
                Threads::One,
            );
            // dS = P ⊙ (dP − rowsum(dP ⊙ P)) · scale
            for i in 0..sq {
                let pr = &p[i * sk..(i + 1) * sk];
                let dr = &mut dp[i * sk..(i + 1) * sk];
                let dot: f32 = pr.iter().zip(dr.iter()).map(|(a, b)| a * b).sum();
                if let Some(ds) = dsinks.as_deref_mut() {
                    ds[hh] -= (1.0 - pr.iter().sum::<f32>()) * dot;
                }
                for (d, pv) in dr.iter_mut().zip(pr) {
                    *d = pv * (*d - dot) * scale;
                }
            }
            // dQ += dS K; dK += dSᵀ Q
            matmul(
                MatMut::strided(dq, qoff, sq, hd, qw, 1),
                MatRef::new(&dp, sq, sk),
                MatRef::strided(k, koff, sk, hd, kw, 1),
                true,
                Threads::One,
            );
            matmul(
                MatMut::strided(dk, koff, sk, hd, kw, 1),
                MatRef::new(&dp, sq, sk).t(),
                MatRef::strided(q, qoff, sq, hd, qw, 1),
                true,
                Threads::One,
            );
        }
    }
}

/// A target that counts for nothing: no loss and no gradient (the positions a multi-token
/// prediction module has no token for, at the end of a sequence).
pub const IGNORE: u32 = u32::MAX;

/// Softmax cross-entropy of `logits` (`rows × vocab`) against `targets`: returns the summed
/// loss and overwrites `logits` with `scale · (softmax − onehot)`, the gradient of
/// `scale · loss_sum`; rows whose target is [`IGNORE`] count for nothing.
pub fn cross_entropy(logits: &mut [f32], targets: &[u32], vocab: usize, scale: f32) -> f64 {
    let mut total = 0.0f64;
    for (row, &t) in logits.chunks_exact_mut(vocab).zip(targets) {
        if t == IGNORE {
            row.fill(0.0);
            continue;
        }
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for x in row.iter_mut() {
            *x = (*x - mx).exp();
            sum += *x;
        }
        let t = t as usize;
        // `max` would turn a NaN probability into MIN_POSITIVE (a finite 87.34): keep it NaN, so
        // that a diverged run is seen as one.
        let p = row[t] / sum;
        total -= if p.is_nan() {
            f64::NAN
        } else {
            f64::from(p.max(f32::MIN_POSITIVE).ln())
        };
        for x in row.iter_mut() {
            *x *= scale / sum;
        }
        row[t] -= scale;
    }
    total
}

/// A host emulation of the GPU offload, so that everything the trainer hands a device is
/// checked without one. GEMMs follow cuBLAS `sgemm` semantics (column-major, `op` per operand,
/// leading dimensions), written independently of the trainer's kernels. Adam runs
/// `AdamConfig::update`, the trainer's own arithmetic, which the NVRTC kernel repeats line by
/// line: that half checks what is handed over (which slices, which bias corrections), not the
/// kernel, which only a GPU run checks.
#[cfg(test)]
pub(crate) mod emulated {
    use super::{ColMajorGemm, DeviceOffload};
    use crate::engine::AdamConfig;
    use std::cell::Cell;

    /// Counts what it was handed.
    #[derive(Debug, Default)]
    pub(crate) struct BlasOnHost {
        pub(crate) gemms: Cell<usize>,
        pub(crate) adams: Cell<usize>,
    }

    /// `sgemm` on host buffers.
    fn blas_sgemm(p: &ColMajorGemm, a: &[f32], b: &[f32], c: &mut [f32], beta: f32) {
        let at = |i: usize, l: usize| {
            if p.a.trans {
                a[l + i * p.a.ld]
            } else {
                a[i + l * p.a.ld]
            }
        };
        let bt = |l: usize, j: usize| {
            if p.b.trans {
                b[j + l * p.b.ld]
            } else {
                b[l + j * p.b.ld]
            }
        };
        for i in 0..p.m {
            for j in 0..p.n {
                let mut acc = 0.0f32;
                for l in 0..p.k {
                    acc += at(i, l) * bt(l, j);
                }
                let x = &mut c[i + j * p.c.ld];
                *x = acc + beta * *x;
            }
        }
    }

    impl DeviceOffload for BlasOnHost {
        fn gemm(
            &self,
            plan: &ColMajorGemm,
            a: &[f32],
            b: &[f32],
            c: &mut [f32],
            accumulate: bool,
        ) -> Result<bool, String> {
            assert_eq!(a.len(), plan.a.range.len());
            assert_eq!(b.len(), plan.b.range.len());
            assert_eq!(c.len(), plan.c.range.len());
            blas_sgemm(plan, a, b, c, if accumulate { 1.0 } else { 0.0 });
            self.gemms.set(self.gemms.get() + 1);
            Ok(true)
        }

        fn adam(
            &self,
            cfg: &AdamConfig,
            bc: (f32, f32),
            p: &mut [f32],
            g: &[f32],
            m: &mut [f32],
            v: &mut [f32],
        ) -> Result<bool, String> {
            cfg.update(bc, p, g, m, v);
            self.adams.set(self.adams.get() + 1);
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::emulated::BlasOnHost;
    use super::*;
    use crate::rng::SplitMix64;

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        (0..n).map(|_| g.normal() as f32).collect()
    }

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn matmul_matches_naive_with_transposes_and_accumulation() {
        let (m, k, n) = (7, 13, 5);
        let (a, b) = (rand(m * k, 1), rand(k * n, 2));
        let want = naive(&a, &b, m, k, n);
        let mut c = vec![0.0; m * n];
        mm(&mut c, &a, &b, m, k, n, false);
        for (x, y) in c.iter().zip(&want) {
            assert!((x - y).abs() < 1e-4);
        }
        // xᵀ·dy and dy·wᵀ against explicit transposes.
        let mut dw = vec![1.0; k * n];
        mm_tn(&mut dw, &a, &naive(&a, &b, m, k, n), m, k, n, true);
        let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let w2 = naive(&at, &want, k, m, n);
        for (x, y) in dw.iter().zip(&w2) {
            assert!((x - 1.0 - y).abs() < 1e-3);
        }
        let mut dx = vec![0.0; m * k];
        mm_nt(&mut dx, &want, &b, m, k, n, false);
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let x2 = naive(&want, &bt, m, n, k);
        for (x, y) in dx.iter().zip(&x2) {
            assert!((x - y).abs() < 1e-3);
        }
    }

    /// Central differences of a scalar function of `x` at every element.
    fn check_grad(x: &[f32], analytic: &[f32], f: impl Fn(&[f32]) -> f64) {
        crate::testing::check_grad("grad", x, analytic, 0..x.len(), 1e-2, f);
    }

    #[test]
    fn norm_gradients_match_finite_differences() {
        for rms in [false, true] {
            let (rows, h) = (3, 8);
            let x = rand(rows * h, 3);
            let w = rand(h, 4);
            let b = rand(h, 5);
            let dy = rand(rows * h, 6);
            let bias = (!rms).then_some(&b[..]);
            let loss = |x: &[f32]| {
                let mut y = vec![0.0; rows * h];
                norm_fwd(&mut y, x, &w, bias, rms);
                y.iter().zip(&dy).map(|(a, b)| f64::from(a * b)).sum()
            };
            let mut y = vec![0.0; rows * h];
            let stats = norm_fwd(&mut y, &x, &w, bias, rms);
            let (mut dx, mut dw, mut db) = (vec![0.0; rows * h], vec![0.0; h], vec![0.0; h]);
            norm_bwd(
                &mut dx,
                &dy,
                &x,
                &stats,
                &w,
                &mut dw,
                Some(&mut db),
                rms,
                false,
            );
            check_grad(&x, &dx, loss);
        }
    }

    /// Each activation's backward against central differences of its forward, GPT-OSS's
    /// clamped gate on both sides of its clamps (where the clamped input passes nothing).
    #[test]
    fn activation_gradients_match_finite_differences() {
        let g: Vec<f32> = (0..40).map(|i| i as f32 * 0.5 - 10.25).collect();
        let u: Vec<f32> = g.iter().rev().map(|x| x * 0.9).collect();
        for act in [
            Act::Gelu,
            Act::Relu,
            Act::SquaredRelu,
            Act::Swiglu,
            Act::ClampedSwiglu,
        ] {
            let up = matches!(act, Act::Swiglu | Act::ClampedSwiglu).then_some(&u[..]);
            let mut dg = vec![1.0; g.len()];
            let du = act.bwd(&mut dg, &g, up);
            // Σ act: its gradient is `bwd` of ones.
            let total = |g: &[f32], u: Option<&[f32]>| -> f64 {
                act.fwd(g, u).iter().map(|v| f64::from(*v)).sum()
            };
            let what = format!("{act:?} dg");
            crate::testing::check_grad(&what, &g, &dg, 0..g.len(), 1e-3, |x| total(x, up));
            if let (Some(du), Some(u)) = (&du, up) {
                let what = format!("{act:?} du");
                crate::testing::check_grad(&what, u, du, 0..u.len(), 1e-3, |x| total(&g, Some(x)));
            }
        }
        // Beyond the clamps nothing passes: a gate above 7, an up projection outside ±7.
        let mut dg = vec![1.0; 2];
        let du = Act::ClampedSwiglu
            .bwd(&mut dg, &[8.0, 1.0], Some(&[1.0, -9.0]))
            .unwrap();
        assert_eq!((dg[0], du[1]), (0.0, 0.0));
        assert!(dg[1] != 0.0 && du[0] != 0.0);
    }

    #[test]
    fn attention_gradients_match_finite_differences() {
        // The square case, and a context-parallel rank's two chunks (positions 1 and 6 of 8
        // with cp = 4... here 2 of 2·cp chunks of one row each) against every key.
        // A sliding window of 2 keys too, and an encoder's attention to every key.
        let square: Vec<usize> = (0..4).collect();
        // And GPT-OSS's sinks, one logit per head.
        let (causal, all) = (Mask::Causal(None), Mask::All);
        for (q_pos, sk, mask, sunk) in [
            (square.clone(), 4, causal, false),
            (vec![1, 6], 8, causal, false),
            (square.clone(), 4, Mask::Causal(Some(2)), false),
            (square.clone(), 4, causal, true),
            (square.clone(), 4, Mask::Causal(Some(2)), true),
            (square.clone(), 4, all, false),
            (vec![1, 6], 8, all, true),
        ] {
            let window = match mask {
                Mask::Causal(w) => w,
                Mask::All => None,
            };
            let (batch, heads, kvh, hd) = (2, 4, 2, 4);
            let sinks = sunk.then(|| rand(heads, 11));
            let sq = q_pos.len();
            let q = rand(batch * sq * heads * hd, 7);
            let k = rand(batch * sk * kvh * hd, 8);
            let v = rand(batch * sk * kvh * hd, 9);
            let d_o = rand(batch * sq * heads * hd, 10);
            let shape = AttnShape {
                batch,
                q_pos: &q_pos,
                sk,
                heads,
                kv_heads: kvh,
                hd,
                mask,
            };
            let run_with = |q: &[f32], k: &[f32], v: &[f32], sinks: Option<&[f32]>| {
                let mut o = vec![0.0; batch * sq * heads * hd];
                attention_fwd(&mut o, q, k, v, &shape, sinks, false);
                o.iter()
                    .zip(&d_o)
                    .map(|(a, b)| f64::from(a * b))
                    .sum::<f64>()
            };
            let run = |q: &[f32], k: &[f32], v: &[f32]| run_with(q, k, v, sinks.as_deref());
            let mut o = vec![0.0; batch * sq * heads * hd];
            let probs = attention_fwd(&mut o, &q, &k, &v, &shape, sinks.as_deref(), true);
            // An encoder's first query sees every key.
            if let (Mask::All, Some(p), false) = (mask, probs.as_deref(), sunk) {
                assert!(p[..sk].iter().all(|&x| x > 0.0), "{:?}", &p[..sk]);
            }
            // The window masks the keys before it: query 3 sees keys 2 and 3 only.
            if let (Some(w), Some(p), false) = (window, probs.as_deref(), sunk) {
                let row = &p[3 * sk..4 * sk];
                assert!(row[..4 - w].iter().all(|&x| x == 0.0), "{row:?}");
                assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            }
            for saved in [probs.as_deref(), None] {
                let (mut dq, mut dk, mut dv) =
                    (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
                let mut ds = vec![0.0; heads];
                attention_bwd(
                    &mut dq,
                    &mut dk,
                    &mut dv,
                    &d_o,
                    &q,
                    &k,
                    &v,
                    saved,
                    &shape,
                    sinks.as_deref(),
                    sinks.as_ref().map(|_| &mut ds[..]),
                );
                check_grad(&q, &dq, |x| run(x, &k, &v));
                check_grad(&k, &dk, |x| run(&q, x, &v));
                check_grad(&v, &dv, |x| run(&q, &k, x));
                if let Some(s) = &sinks {
                    check_grad(s, &ds, |x| run_with(&q, &k, &v, Some(x)));
                    // A sink takes probability from every row.
                    let p = probs.as_deref().unwrap();
                    assert!(p[..sk].iter().sum::<f32>() < 1.0 - 1e-3);
                }
            }
        }
    }

    #[test]
    fn pointwise_and_loss_gradients() {
        for x in [-3.0f32, -0.5, 0.0, 0.7, 2.5] {
            let num = (gelu(x + 1e-3) - gelu(x - 1e-3)) / 2e-3;
            assert!((num - gelu_grad(x)).abs() < 1e-2);
        }
        let logits = rand(3 * 5, 11);
        let targets = [1u32, 4, 0];
        let mut g = logits.clone();
        let loss = cross_entropy(&mut g, &targets, 5, 1.0);
        assert!(loss > 0.0);
        check_grad(&logits, &g, |x| {
            let mut y = x.to_vec();
            cross_entropy(&mut y, &targets, 5, 1.0)
        });
        // Rotary embedding is a rotation: inverse undoes it.
        let x0 = rand(3 * 8, 12);
        let mut x = x0.clone();
        rope(&mut x, 2, 4, 10_000.0, |t| t + 1, false);
        rope(&mut x, 2, 4, 10_000.0, |t| t + 1, true);
        for (a, b) in x.iter().zip(&x0) {
            assert!((a - b).abs() < 1e-5);
        }
        // The base sets the frequencies: Llama 3's 500 000 rotates a position differently.
        let (mut a, mut b) = (x0.clone(), x0.clone());
        rope(&mut a, 2, 4, 10_000.0, |t| t + 1, false);
        rope(&mut b, 2, 4, 500_000.0, |t| t + 1, false);
        assert!(a.iter().zip(&b).any(|(p, q)| (p - q).abs() > 1e-3));
    }

    #[test]
    fn offloaded_gemms_match_the_cpu_kernel_on_every_view_the_trainer_uses() {
        let (m, k, n) = (96, 40, 56);
        let a = rand(m * k, 1);
        let b = rand(k * n, 2);
        let bt = rand(n * k, 3);
        let at = rand(k * m, 4);
        let c0 = rand(m * n, 5);
        // Per-head views: 2 heads of width 20 inside rows of 40 (attention's q·kᵀ and p·v).
        let heads = rand(m * 40, 6);
        let keys = rand(56 * 40, 7);
        type Case<'a> = (&'a str, MatRef<'a>, MatRef<'a>, usize, usize);
        let cases: Vec<Case> = vec![
            ("x·W", MatRef::new(&a, m, k), MatRef::new(&b, k, n), m, n),
            (
                "dy·Wᵀ",
                MatRef::new(&a, m, k),
                MatRef::new(&bt, n, k).t(),
                m,
                n,
            ),
            (
                "xᵀ·dy",
                MatRef::new(&at, k, m).t(),
                MatRef::new(&b, k, n),
                m,
                n,
            ),
            (
                "q·kᵀ of head 1",
                MatRef::strided(&heads, 20, m, 20, 40, 1),
                MatRef::strided(&keys, 20, 56, 20, 40, 1).t(),
                m,
                56,
            ),
            (
                "p·v of head 1",
                MatRef::new(&c0[..m * 56], m, 56),
                MatRef::strided(&keys, 20, 56, 20, 40, 1),
                m,
                20,
            ),
        ];
        let host = std::rc::Rc::new(BlasOnHost::default());
        for (name, x, y, rows, cols) in cases {
            for acc in [false, true] {
                let mut want = c0[..rows * cols].to_vec();
                matmul(MatMut::new(&mut want, rows, cols), x, y, acc, Threads::One);
                let mut got = c0[..rows * cols].to_vec();
                set_device_offload(Some(host.clone()));
                matmul(MatMut::new(&mut got, rows, cols), x, y, acc, Threads::One);
                set_device_offload(None);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{name} acc={acc}");
                }
            }
        }
        assert_eq!(host.gemms.get(), 10, "every case went through the offload");
    }

    #[test]
    fn views_a_blas_cannot_address_stay_on_the_cpu() {
        let x = vec![1.0f32; 64 * 64];
        // Neither stride is 1: no column-major form.
        let odd = MatRef::strided(&x, 0, 16, 16, 128, 2);
        let y = MatRef::new(&x, 16, 16);
        let mut c = vec![0.0f32; 256];
        assert!(col_major_gemm(&MatMut::new(&mut c, 16, 16), &odd, &y).is_none());
        // A transposed output view.
        let mut c2 = vec![0.0f32; 256];
        let ct = MatMut::strided(&mut c2, 0, 16, 16, 1, 16);
        assert!(col_major_gemm(&ct, &y, &y).is_none());
    }
}
