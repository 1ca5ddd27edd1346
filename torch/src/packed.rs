//! Weights packed once for inference on the CPU, multiplied by a kernel that suits
//! decode steps' few rows.
//!
//! libtorch's CPU `linear` is MKL's `sgemm`, which on the AMD machine kind takes MKL's
//! generic code path and repacks every weight on every call. Two packed forms replace it:
//!
//! - **Column panels** ([`PackKernel::Panels`], where the CPU has AVX-512F, or AVX2 up to
//!   32 rows: [`PackKernel::best`]): Regatta's own kernel (`src/shim/panel_linear.cpp`)
//!   over `[ceil(out / 32), in, 32]`, streaming each weight byte once per product and
//!   multiplying it into up to 12 (AVX2: 6) batch rows at a time. A decode step of
//!   SmolLM2-135M with AVX-512: 2x faster than oneDNN at 16 rows, 1.3x at 64 (docs/
//!   NOTES.md, "Generation speed on the CPU"). Each output sums its products in input
//!   order, the same bits from either instruction set.
//! - **oneDNN's blocked layout** ([`PackKernel::OneDnn`], elsewhere): what TorchInductor's
//!   CPU freezing pass does (`mkldnn::_reorder_linear_weight` + `mkldnn::_linear_pointwise`),
//!   1.2-1.4x faster than MKL at 1, 16 and 64 rows.
//!
//! Results differ from MKL's by the order of summation (~1e-6 relative); greedy tokens on
//! the benchmark's real model stay identical to `transformers`' (scripts/bench-vs-hf.sh
//! checks it on every run).
//!
//! MKL's own packed API (`cblas_sgemm_pack` once, `cblas_sgemm_compute` per call) was
//! tried first: the same values as `linear` bit for bit, and no faster.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use tch::{Device, Kind, TchError, Tensor};

use crate::shim::{onednn_linear, onednn_pack_linear, panel_kernel_wide, panel_linear};

/// The largest batch hint for which a CPU with AVX2 but no AVX-512F packs column panels.
const AVX2_PANEL_ROWS: usize = 32;

/// Which kernel multiplies the packed weights, and so their layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackKernel {
    /// Regatta's own AVX-512 kernel over column panels (`src/shim/panel_linear.cpp`):
    /// `[ceil(out / 32), in, 32]`, each panel's 32 output columns of one input position
    /// side by side.
    Panels,
    /// oneDNN's inner product against its own blocked layout (an opaque mkldnn tensor).
    OneDnn,
}

impl PackKernel {
    /// The kernel for products of about `batch_hint` rows on this CPU: the panels where it
    /// has AVX-512F; where it has only AVX2 (AMD Zen 3), the panels up to 32 rows and
    /// oneDNN above, the two measured so on SmolLM2-135M decode steps (2-core EPYC, same
    /// tokens): the panels 2% faster at 1 row, 9% at 16, 6% at 32, but 10% slower at 64,
    /// where oneDNN's AVX2 kernel blocks better than two 16-column halves of 6 rows.
    pub fn best(batch_hint: usize) -> Self {
        Self::choose(panel_kernel_wide(), batch_hint)
    }

    /// [`PackKernel::best`] for a CPU whose panel tiles are `wide` (see
    /// [`crate::shim::panel_kernel_wide`]).
    fn choose(wide: Option<bool>, batch_hint: usize) -> Self {
        match wide {
            Some(true) => Self::Panels,
            Some(false) if batch_hint <= AVX2_PANEL_ROWS => Self::Panels,
            _ => Self::OneDnn,
        }
    }

    /// `weight` (`[out, in]`, float32, CPU, any strides) in this kernel's layout.
    fn pack(self, weight: &Tensor, batch_hint: i64) -> Option<Tensor> {
        tch::no_grad(|| match self {
            Self::Panels => {
                let (out, width) = weight.size2().ok()?;
                let panels = (out + 31) / 32;
                let padded = weight.constant_pad_nd([0, 0, 0, panels * 32 - out]);
                Some(padded.view([panels, 32, width]).transpose(1, 2).contiguous())
            }
            Self::OneDnn => onednn_pack_linear(weight, batch_hint).ok(),
        })
    }

    /// `x Wᵀ + bias` against `packed`, W having `out` rows.
    fn linear(self, x: &Tensor, packed: &Tensor, out: i64, bias: Option<&Tensor>) -> Result<Tensor, TchError> {
        match self {
            Self::Panels => panel_linear(x, packed, out, bias),
            Self::OneDnn => onednn_linear(x, packed, bias),
        }
    }
}

/// One weight in the kernel's layout.
struct PackedWeight {
    /// The weight it was packed from: held so its memory (the key) is never reused.
    source: Tensor,
    /// The reordered weight.
    packed: Tensor,
}

/// Projections of one input packed as one matrix (a layer's query, key and value; its
/// gate and up projections): one product instead of several, 1.15x faster at one row.
struct PackedGroup {
    /// The member weights, in order (held, as [`PackedWeight::source`]).
    sources: Vec<Tensor>,
    /// Their rows stacked and reordered.
    packed: Tensor,
    /// Their biases stacked, where they have them.
    bias: Option<Tensor>,
    /// Each member's output width.
    widths: Vec<i64>,
}

/// Weights that take one input and are best multiplied as one matrix: a model's
/// [`crate::model::Model::linear_groups`].
pub struct LinearGroup {
    /// The weights (`[out_i, in]`, one `in`).
    pub weights: Vec<Tensor>,
    /// Their biases: none, or one per weight.
    pub biases: Vec<Tensor>,
}

/// The matrices of a model's parameters packed for one [`PackKernel`], found again by the
/// weight tensor a forward hands to `linear` (or, for a group, its first weight).
pub struct PackedWeights {
    kernel: PackKernel,
    by_data: HashMap<usize, PackedWeight>,
    groups: HashMap<usize, PackedGroup>,
    bytes: u64,
    /// Whether a refused product has been reported (once per model: the fallback is
    /// correct but slower, and a step makes hundreds of products).
    refusal_reported: AtomicBool,
}

fn packable(weight: &Tensor) -> bool {
    weight.dim() == 2 && weight.kind() == Kind::Float && weight.device() == Device::Cpu
}

/// Whether a packed copy of `source` serves `x Wᵀ` for `weight`: `weight` is `source`
/// seen the same way (not its memory with another shape), and `x` is a non-empty float32
/// CPU input without gradients whose last dimension is the weight's input width.
fn takes(source: &Tensor, weight: &Tensor, x: &Tensor) -> bool {
    source.size() == weight.size()
        && source.stride() == weight.stride()
        && x.kind() == Kind::Float
        && x.device() == Device::Cpu
        && !x.requires_grad()
        && x.dim() > 0
        && x.size().last() == weight.size().get(1)
        && x.numel() > 0
}

impl PackedWeights {
    /// Packs each of `groups` as one matrix, then every other 2-D float32 CPU parameter of
    /// `params` after the first block (the embeddings, looked up rather than multiplied; a
    /// head tied to them is packed where the last block holds it), for products of about
    /// `batch_hint` rows, for the best kernel this CPU runs ([`PackKernel::best`]). `None`
    /// where it cannot (no oneDNN in this libtorch) or nothing qualifies.
    pub fn pack(params: &[Vec<Tensor>], groups: &[LinearGroup], batch_hint: usize) -> Option<Self> {
        Self::pack_for(PackKernel::best(batch_hint), params, groups, batch_hint)
    }

    /// [`PackedWeights::pack`] for `kernel`.
    pub fn pack_for(
        kernel: PackKernel,
        params: &[Vec<Tensor>],
        groups: &[LinearGroup],
        batch_hint: usize,
    ) -> Option<Self> {
        let hint = batch_hint.max(1) as i64;
        let mut packed = Self {
            kernel,
            by_data: HashMap::new(),
            groups: HashMap::new(),
            bytes: 0,
            refusal_reported: AtomicBool::new(false),
        };
        let mut grouped = std::collections::HashSet::new();
        for group in groups {
            let Some(first) = group.weights.first() else { continue };
            let width = first.size().get(1).copied();
            let fits = group
                .weights
                .iter()
                .all(|w| packable(w) && w.size().get(1).copied() == width)
                && (group.biases.is_empty() || group.biases.len() == group.weights.len())
                && group.biases.iter().all(|b| b.kind() == Kind::Float && b.dim() == 1);
            if !fits || packed.groups.contains_key(&(first.data_ptr() as usize)) {
                continue;
            }
            let stacked = Tensor::cat(&group.weights, 0);
            let matrix = kernel.pack(&stacked, hint)?;
            packed.bytes += stacked.numel() as u64 * 4;
            grouped.extend(group.weights.iter().map(|w| w.data_ptr() as usize));
            packed.groups.insert(
                first.data_ptr() as usize,
                PackedGroup {
                    sources: group.weights.iter().map(Tensor::shallow_clone).collect(),
                    packed: matrix,
                    bias: (!group.biases.is_empty()).then(|| Tensor::cat(&group.biases, 0)),
                    widths: group.weights.iter().map(|w| w.size()[0]).collect(),
                },
            );
        }
        for weight in params.iter().skip(1).flatten() {
            let key = weight.data_ptr() as usize;
            if !packable(weight) || grouped.contains(&key) || packed.by_data.contains_key(&key) {
                continue;
            }
            let matrix = kernel.pack(weight, hint)?;
            packed.bytes += weight.numel() as u64 * 4;
            packed.by_data.insert(
                key,
                PackedWeight {
                    source: weight.shallow_clone(),
                    packed: matrix,
                },
            );
        }
        (!packed.is_empty()).then_some(packed)
    }

    /// The kernel the weights were packed for.
    pub fn kernel(&self) -> PackKernel {
        self.kernel
    }

    /// Bytes the packed copies take.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Matrices packed (a group counts once).
    pub fn len(&self) -> usize {
        self.by_data.len() + self.groups.len()
    }

    /// Whether nothing was packed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `x Wᵀ + bias` through `weight`'s packed copy; `None` where `weight` was not packed
    /// (or `x` is not a float32 CPU tensor without gradients), for the caller's own
    /// `linear`.
    pub fn linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Option<Tensor> {
        let packed = self.by_data.get(&(weight.data_ptr() as usize))?;
        let bias_fits = bias.is_none_or(|b| b.kind() == Kind::Float && b.device() == Device::Cpu && b.dim() == 1);
        if !takes(&packed.source, weight, x) || !bias_fits {
            return None;
        }
        let product = self.kernel.linear(x, &packed.packed, weight.size()[0], bias);
        self.or_report(product, x)
    }

    /// Every member's `x Wᵢᵀ + bᵢ` of the group that starts with `first`, by one product;
    /// `None` where no group starts with it (or `x` does not fit), for the caller's own
    /// products one by one.
    pub fn linear_group(&self, x: &Tensor, first: &Tensor) -> Option<Vec<Tensor>> {
        let group = self.groups.get(&(first.data_ptr() as usize))?;
        if !takes(group.sources.first()?, first, x) {
            return None;
        }
        let product = self
            .kernel
            .linear(x, &group.packed, group.widths.iter().sum(), group.bias.as_ref());
        Some(self.or_report(product, x)?.split_with_sizes(&group.widths, -1))
    }

    /// The kernel's product, or `None` (the caller's own `linear` then serves it) with
    /// the refusal written to stderr the first time: an input the checks above let
    /// through but the kernel refuses (its strides, its layout) costs speed, not tokens,
    /// and a run that falls back should say so rather than be slow in silence.
    fn or_report(&self, product: Result<Tensor, TchError>, x: &Tensor) -> Option<Tensor> {
        match product {
            Ok(product) => Some(product),
            Err(e) => {
                if !self.refusal_reported.swap(true, Ordering::Relaxed) {
                    eprintln!(
                        "warning: the packed {:?} kernel refused a product of input {:?} (strides {:?}); \
                         libtorch's linear serves it and any others it refuses (slower; equal up to summation order): {e}",
                        self.kernel,
                        x.size(),
                        x.stride()
                    );
                }
                None
            }
        }
    }

    /// Whether a product was refused and served by libtorch instead.
    #[cfg(test)]
    fn refused_any(&self) -> bool {
        self.refusal_reported.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shim::panel_kernel_available;

    /// Decoder-like shapes: a square projection, a narrow one, and both MLP directions;
    /// then output widths off the panels' 32 columns (a last panel of 6, one of 20).
    const SHAPES: [(i64, i64); 6] = [(96, 96), (32, 96), (256, 96), (96, 256), (70, 40), (20, 96)];

    /// The kernels this CPU runs.
    fn kernels() -> Vec<PackKernel> {
        let mut kernels = vec![PackKernel::OneDnn];
        if panel_kernel_available() {
            kernels.push(PackKernel::Panels);
        }
        kernels
    }

    /// An embedding block, then a block of matrices.
    fn weights(layout_transposed: bool) -> Vec<Vec<Tensor>> {
        tch::manual_seed(7);
        let embedding = vec![Tensor::randn([50, 96], (Kind::Float, Device::Cpu))];
        let matrices = SHAPES
            .iter()
            .map(|&(n, k)| {
                let w = Tensor::randn([n, k], (Kind::Float, Device::Cpu)) * 0.05;
                if layout_transposed {
                    // What `inference_layout` hands the decoder layers.
                    w.transpose(0, 1).contiguous().transpose(0, 1)
                } else {
                    w
                }
            })
            .collect();
        vec![embedding, matrices]
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        f64::try_from((a - b).abs().max()).unwrap()
    }

    #[test]
    fn packed_products_equal_libtorchs_linear_for_every_row_count_and_both_layouts() {
        for (transposed, kernel) in [false, true]
            .into_iter()
            .flat_map(|t| kernels().into_iter().map(move |k| (t, k)))
        {
            let params = weights(transposed);
            let packed = PackedWeights::pack_for(kernel, &params, &[], 16).expect("this libtorch has oneDNN");
            assert_eq!(packed.kernel(), kernel);
            assert_eq!(packed.len(), SHAPES.len());
            for (w, &(n, k)) in params[1].iter().zip(&SHAPES) {
                for rows in [1, 3, 16, 37, 64, 130] {
                    let x = Tensor::randn([rows, k], (Kind::Float, Device::Cpu));
                    let got = packed.linear(&x, w, None).expect("a packed weight answers");
                    let want = x.linear::<Tensor>(w, None);
                    assert_eq!(got.size(), want.size());
                    // Another summation order: float32 rounding apart, no more.
                    let diff = max_diff(&got, &want);
                    assert!(
                        diff < 1e-5,
                        "{kernel:?} {n}x{k} rows {rows} transposed {transposed}: {diff}"
                    );
                    let bias = Tensor::randn([n], (Kind::Float, Device::Cpu));
                    let kept = bias.copy();
                    let got = packed.linear(&x, w, Some(&bias)).unwrap();
                    assert_eq!(bias, kept, "the bias is read, never written");
                    let diff = max_diff(&got, &x.linear(w, Some(&bias)));
                    assert!(diff < 1e-5, "{kernel:?} {n}x{k} rows {rows} with bias: {diff}");
                }
            }
            // Leading dimensions are kept: [batch, time, in] -> [batch, time, out].
            let x = Tensor::randn([2, 5, 96], (Kind::Float, Device::Cpu));
            let got = packed.linear(&x, &params[1][0], None).unwrap();
            assert_eq!(got.size(), vec![2, 5, 96]);
            assert!(max_diff(&got, &x.linear::<Tensor>(&params[1][0], None)) < 1e-5);
            // A non-contiguous input (a transposed view) is read as its values.
            let x = Tensor::randn([96, 7], (Kind::Float, Device::Cpu)).transpose(0, 1);
            let got = packed.linear(&x, &params[1][0], None).unwrap();
            assert!(max_diff(&got, &x.linear::<Tensor>(&params[1][0], None)) < 1e-5);
        }
    }

    #[test]
    fn what_was_not_packed_is_left_to_the_caller() {
        let params = weights(false);
        let packed = PackedWeights::pack(&params, &[], 16).unwrap();
        let other = Tensor::randn([96, 96], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([4, 96], (Kind::Float, Device::Cpu));
        assert!(packed.linear(&x, &other, None).is_none(), "a weight never packed");
        assert!(
            packed.linear(&x, &params[0][0], None).is_none(),
            "the embeddings are not packed"
        );
        // The same memory seen with another shape is not the packed matrix.
        let reshaped = params[1][0].view([48, 192]);
        let wide = Tensor::randn([4, 192], (Kind::Float, Device::Cpu));
        assert!(packed.linear(&wide, &reshaped, None).is_none());
        assert!(
            packed.linear(&x.to_kind(Kind::Double), &params[1][0], None).is_none(),
            "float64 input"
        );
        let narrow = Tensor::randn([4, 95], (Kind::Float, Device::Cpu));
        assert!(packed.linear(&narrow, &params[1][0], None).is_none(), "wrong width");
        let empty = Tensor::zeros([0, 96], (Kind::Float, Device::Cpu));
        assert!(packed.linear(&empty, &params[1][0], None).is_none(), "no rows");
        // What the checks let through and the kernel refuses (a bias of the wrong width)
        // falls back too, and is reported (once) rather than silent.
        assert!(!packed.refused_any());
        let x = Tensor::randn([4, 96], (Kind::Float, Device::Cpu));
        let short_bias = Tensor::zeros([95], (Kind::Float, Device::Cpu));
        assert!(
            packed.linear(&x, &params[1][0], Some(&short_bias)).is_none(),
            "bias width"
        );
        assert!(packed.refused_any(), "the refusal is reported");
        // Non-float32 and non-matrix parameters are not packed at all.
        let mixed = vec![
            Vec::new(),
            vec![
                Tensor::randn([8, 8], (Kind::Double, Device::Cpu)),
                Tensor::randn([8], (Kind::Float, Device::Cpu)),
            ],
        ];
        assert!(PackedWeights::pack(&mixed, &[], 16).is_none());
    }

    #[test]
    fn a_group_is_one_product_equal_to_its_members_one_by_one() {
        let params = weights(true);
        let members: Vec<Tensor> = params[1][..3].iter().map(Tensor::shallow_clone).collect();
        let biases: Vec<Tensor> = [96, 32, 256]
            .iter()
            .map(|&n| Tensor::randn([n], (Kind::Float, Device::Cpu)))
            .collect();
        let group = || LinearGroup {
            weights: members.iter().map(Tensor::shallow_clone).collect(),
            biases: biases.iter().map(Tensor::shallow_clone).collect(),
        };
        for kernel in kernels() {
            let packed = PackedWeights::pack_for(kernel, &params, &[group()], 16).unwrap();
            // The group and the weights outside it.
            assert_eq!(packed.len(), SHAPES.len() - 2);
            assert!(
                packed
                    .linear(&Tensor::randn([4, 96], (Kind::Float, Device::Cpu)), &members[1], None)
                    .is_none(),
                "a member alone is not packed twice"
            );
            for rows in [1, 16, 64] {
                let x = Tensor::randn([rows, 96], (Kind::Float, Device::Cpu));
                let outs = packed
                    .linear_group(&x, &members[0])
                    .expect("the group starts with its first weight");
                assert_eq!(outs.len(), 3);
                for ((out, w), b) in outs.iter().zip(&members).zip(&biases) {
                    let diff = max_diff(out, &x.linear(w, Some(b)));
                    assert!(diff < 1e-5, "{kernel:?} rows {rows}: {diff}");
                }
            }
            assert!(
                packed
                    .linear_group(&Tensor::randn([4, 96], (Kind::Float, Device::Cpu)), &members[1])
                    .is_none(),
                "no group starts with the second member"
            );
        }
    }

    /// Each output of the panel kernel is one FMA chain in input order, then the bias: the
    /// same bits from its AVX-512 and its AVX2 tiles, whatever the row count and however
    /// the last panel is cut.
    #[test]
    fn both_panel_tiles_give_each_output_as_one_fma_chain_in_input_order() {
        if !panel_kernel_available() {
            return;
        }
        tch::manual_seed(11);
        let cpu = (Kind::Float, Device::Cpu);
        for (n, k) in [(70i64, 40i64), (20, 96), (64, 33), (5, 7)] {
            let w = Tensor::randn([n, k], cpu);
            let packed = PackKernel::Panels.pack(&w, 16).unwrap();
            let bias = Tensor::randn([n], cpu);
            let ws = Vec::<f32>::try_from(w.view([-1])).unwrap();
            let bs = Vec::<f32>::try_from(&bias).unwrap();
            for rows in [1i64, 2, 5, 6, 7, 12, 13, 37] {
                let x = Tensor::randn([rows, k], cpu);
                let xs = Vec::<f32>::try_from(x.view([-1])).unwrap();
                let chain = |r: usize, o: usize| {
                    (0..k as usize).fold(0f32, |acc, i| {
                        xs[r * k as usize + i].mul_add(ws[o * k as usize + i], acc)
                    })
                };
                for avx2 in [false, true] {
                    crate::shim::panel_force_avx2(avx2);
                    let plain = panel_linear(&x, &packed, n, None);
                    let biased = panel_linear(&x, &packed, n, Some(&bias));
                    crate::shim::panel_force_avx2(false);
                    let (plain, biased) = (plain.unwrap(), biased.unwrap());
                    let (plain, biased) = (
                        Vec::<f32>::try_from(plain.view([-1])).unwrap(),
                        Vec::<f32>::try_from(biased.view([-1])).unwrap(),
                    );
                    for r in 0..rows as usize {
                        for (o, b) in bs.iter().enumerate() {
                            let want = chain(r, o);
                            let at = r * n as usize + o;
                            assert_eq!(
                                plain[at].to_bits(),
                                want.to_bits(),
                                "{n}x{k} rows {rows} avx2 {avx2} ({r}, {o})"
                            );
                            assert_eq!(
                                biased[at].to_bits(),
                                (want + b).to_bits(),
                                "{n}x{k} rows {rows} avx2 {avx2} bias"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn avx2_cpus_pack_panels_for_small_batches_and_onednn_for_large_ones() {
        for hint in [1, 16, 32, 64, 256] {
            assert_eq!(PackKernel::choose(Some(true), hint), PackKernel::Panels);
            assert_eq!(PackKernel::choose(None, hint), PackKernel::OneDnn);
        }
        assert_eq!(PackKernel::choose(Some(false), 1), PackKernel::Panels);
        assert_eq!(PackKernel::choose(Some(false), 32), PackKernel::Panels);
        assert_eq!(PackKernel::choose(Some(false), 33), PackKernel::OneDnn);
        assert_eq!(PackKernel::choose(Some(false), 64), PackKernel::OneDnn);
    }

    #[test]
    fn the_panel_kernel_refuses_what_does_not_fit() {
        if !panel_kernel_available() {
            let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
            let error = panel_linear(&x, &Tensor::zeros([1, 4, 32], (Kind::Float, Device::Cpu)), 8, None)
                .expect_err("neither AVX-512F nor AVX2");
            assert!(error.to_string().contains("AVX-512F or AVX2"), "{error}");
            return;
        }
        let w = Tensor::randn([40, 8], (Kind::Float, Device::Cpu));
        let packed = PackKernel::Panels.pack(&w, 1).unwrap();
        assert_eq!(packed.size(), vec![2, 8, 32], "two panels, the second zero-padded");
        let x = Tensor::randn([3, 8], (Kind::Float, Device::Cpu));
        assert!(
            max_diff(
                &panel_linear(&x, &packed, 40, None).unwrap(),
                &x.linear::<Tensor>(&w, None)
            ) < 1e-5
        );
        for (input, width, bias, why) in [
            (
                Tensor::randn([3, 9], (Kind::Float, Device::Cpu)),
                40,
                None,
                "input width",
            ),
            (x.to_kind(Kind::Double), 40, None, "float64 input"),
            (x.shallow_clone(), 70, None, "width past the panels"),
            (x.shallow_clone(), 32, None, "width short of the panels"),
            (
                x.shallow_clone(),
                40,
                Some(Tensor::zeros([39], (Kind::Float, Device::Cpu))),
                "bias width",
            ),
        ] {
            assert!(panel_linear(&input, &packed, width, bias.as_ref()).is_err(), "{why}");
        }
    }
}
