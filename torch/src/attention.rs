//! Attention over packed rows without a dense mask.
//!
//! A packed row holds several documents; each token attends causally inside its own
//! document only. The dense way is a `[batch, 1, time, time]` mask, and with a mask plus GQA
//! libtorch's SDPA on CUDA falls back to its math kernel (f32 scores, O(time²) memory per
//! head). Here the documents are cumulative lengths over the flattened `[batch * time]`
//! tokens ([`Segments`], FlashAttention's `cu_seqlens`), and on CUDA in bf16/f16 the
//! variable-length FlashAttention kernel runs them ([`Kernel::FlashVarlen`], through
//! `shim::flash_varlen`), with GQA and Mistral's sliding window, no mask at all.
//!
//! Elsewhere (the CPU, f32, head sizes the kernel does not take) the dense mask stays: on
//! the CPU libtorch runs its own flash kernel with the mask. [`per_document`] computes what
//! the variable-length kernel computes, one document at a time, so the bookkeeping (the
//! segments, the layouts, the window) is tested against the masked path on the CPU.

use tch::{Device, Kind, Tensor};

/// Documents of a packed batch as FlashAttention's cumulative lengths over the flattened
/// `[batch * time]` tokens: document `i` is tokens `cu_seqlens[i]..cu_seqlens[i + 1]`. A
/// document never spans two rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segments {
    /// `0`, then the end of every document.
    pub cu_seqlens: Vec<i32>,
    /// The longest document.
    pub max_len: i64,
}

impl Segments {
    /// The segments of `documents` (`[batch, time]` row-major document numbers, as the
    /// packer writes them): a new document starts where the number changes and at every
    /// row's start.
    pub fn from_documents(documents: &[i64], time: usize) -> Self {
        let mut cu_seqlens = vec![0i32];
        let mut max_len = 0i64;
        let mut start = 0usize;
        for (i, doc) in documents.iter().enumerate() {
            let row_start = i % time.max(1) == 0;
            if i > 0 && (row_start || documents[i - 1] != *doc) {
                cu_seqlens.push(i as i32);
                max_len = max_len.max((i - start) as i64);
                start = i;
            }
        }
        if !documents.is_empty() {
            cu_seqlens.push(documents.len() as i32);
            max_len = max_len.max((documents.len() - start) as i64);
        }
        Self { cu_seqlens, max_len }
    }

    /// One segment per row: plain causal rows (a sliding window without packing).
    pub fn rows(batch: usize, time: usize) -> Self {
        Self {
            cu_seqlens: (0..=batch).map(|b| (b * time) as i32).collect(),
            max_len: time as i64,
        }
    }

    /// Documents in the batch.
    pub fn len(&self) -> usize {
        self.cu_seqlens.len().saturating_sub(1)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How a packed batch's attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// FlashAttention's variable-length kernel, no mask (CUDA, bf16/f16).
    FlashVarlen,
    /// SDPA with the dense document mask (CPU, f32, unusual head sizes).
    DenseMask,
}

impl Kernel {
    /// The kernel for attention on `device` in `kind` with heads of `head_dim`: the
    /// variable-length FlashAttention kernel takes f16/bf16 on CUDA with head sizes that
    /// are multiples of 8 up to 256.
    pub fn choose(device: Device, kind: Kind, head_dim: usize) -> Self {
        let half = matches!(kind, Kind::BFloat16 | Kind::Half);
        if device.is_cuda() && half && head_dim.is_multiple_of(8) && head_dim <= 256 {
            Self::FlashVarlen
        } else {
            Self::DenseMask
        }
    }

    /// The kernel's name as logs and `doctor` print it.
    pub fn name(self) -> &'static str {
        match self {
            Self::FlashVarlen => "flash-varlen",
            Self::DenseMask => "sdpa-dense-mask",
        }
    }
}

/// `[batch, heads, time, dim]` as `[batch * time, heads, dim]` (the varlen layout).
fn flatten(x: &Tensor) -> Tensor {
    let size = x.size();
    x.transpose(1, 2).reshape([size[0] * size[2], size[1], size[3]])
}

/// Back from `[batch * time, heads, dim]` to `[batch, heads, time, dim]`.
fn unflatten(x: &Tensor, batch: i64) -> Tensor {
    let size = x.size();
    x.reshape([batch, size[0] / batch, size[1], size[2]]).transpose(1, 2)
}

/// Causal attention inside each segment with the variable-length FlashAttention kernel:
/// `q` `[batch, heads, time, dim]`, `k`/`v` `[batch, kv_heads, time, dim]`; `window`: a
/// query sees only the `window` most recent keys, itself included.
pub fn flash_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    segments: &Segments,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor, tch::TchError> {
    let cu = Tensor::from_slice(&segments.cu_seqlens).to_device(q.device());
    let out = crate::shim::flash_varlen(
        &flatten(q),
        &flatten(k),
        &flatten(v),
        &cu,
        segments.max_len,
        scale,
        window.map(|w| w.saturating_sub(1) as i64),
    )?;
    Ok(unflatten(&out, q.size()[0]))
}

/// What [`flash_varlen`] computes, one document at a time with SDPA (any device and
/// dtype): the reference its bookkeeping is tested against.
pub fn per_document(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    segments: &Segments,
    scale: f64,
    window: Option<usize>,
) -> Tensor {
    let (fq, fk, fv) = (flatten(q), flatten(k), flatten(v));
    let gqa = q.size()[1] != k.size()[1];
    let parts: Vec<Tensor> = segments
        .cu_seqlens
        .windows(2)
        .map(|w| {
            let (start, len) = (w[0] as i64, (w[1] - w[0]) as i64);
            let part = |x: &Tensor| x.narrow(0, start, len).transpose(0, 1).unsqueeze(0);
            let mask = window.filter(|w| (*w as i64) < len).map(|w| {
                Tensor::ones([len, len], (Kind::Bool, q.device()))
                    .tril(0)
                    .triu(-(w as i64 - 1))
            });
            Tensor::scaled_dot_product_attention(
                &part(&fq),
                &part(&fk),
                &part(&fv),
                mask.as_ref(),
                0.0,
                mask.is_none(),
                scale,
                gqa,
            )
            .squeeze_dim(0)
            .transpose(0, 1)
        })
        .collect();
    unflatten(&Tensor::cat(&parts, 0), q.size()[0])
}

/// What `regatta-torch-rank attention-check` found: the packed-rows kernel against SDPA
/// with the dense mask in f32, forward and backward, and both timed.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AttentionCheck {
    /// The kernel checked (`flash-varlen`, or `per-document` where it cannot run).
    pub kernel: &'static str,
    /// Device and dtype.
    pub on: String,
    /// Shape: batch, heads, kv heads, time, head size.
    pub shape: [i64; 5],
    /// Documents in the batch.
    pub documents: usize,
    /// Largest difference of the outputs, relative to the largest output.
    pub output_relative_diff: f64,
    /// Largest difference of the query/key/value gradients, relative to the largest one.
    pub gradient_relative_diff: f64,
    /// Forward + backward of the kernel, milliseconds (best of 3).
    pub kernel_ms: f64,
    /// Forward + backward of SDPA with the dense mask in the same dtype, milliseconds.
    pub dense_mask_ms: f64,
    /// Within the dtype's tolerance.
    pub ok: bool,
}

/// Runs the packed-rows kernel [`Kernel::choose`] picks on `device` in `kind` against SDPA
/// with the dense mask computed in f64 (CPU) or f32 (CUDA), on random packed documents.
pub fn check(device: Device, kind: Kind, time: i64) -> AttentionCheck {
    let (batch, heads, kv_heads, dim) = (2i64, 16i64, 4i64, 64i64);
    let trial = Trial::new(device, [batch, heads, kv_heads, time, dim]);
    let kernel = Kernel::choose(device, kind, dim as usize);
    let (want, want_grads) = trial.run(None, trial.exact);
    let (got, got_grads) = trial.run(Some(kernel), kind);
    let output_relative_diff = relative(&got, &want);
    let gradient_relative_diff = got_grads
        .iter()
        .zip(&want_grads)
        .map(|(a, b)| relative(a, b))
        .fold(0.0, f64::max);
    let tolerance = match kind {
        Kind::BFloat16 => 3e-2,
        Kind::Half => 5e-3,
        _ => 1e-5,
    };
    AttentionCheck {
        // Where the variable-length kernel does not run, its per-document stand-in is what
        // is checked (the production path there is the dense mask itself).
        kernel: match kernel {
            Kernel::FlashVarlen => kernel.name(),
            Kernel::DenseMask => "per-document",
        },
        on: format!("{device:?} {kind:?}"),
        shape: [batch, heads, kv_heads, time, dim],
        documents: trial.segments.len(),
        output_relative_diff,
        gradient_relative_diff,
        kernel_ms: trial.best_ms(Some(kernel), kind),
        dense_mask_ms: trial.best_ms(None, kind),
        ok: output_relative_diff < tolerance && gradient_relative_diff < tolerance,
    }
}

/// The largest difference of `a` from `b`, relative to `b`'s largest value.
fn relative(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30)
}

/// Document ids of `batch` rows of `time` tokens: documents of 1..=time/3 tokens, varied,
/// restarting at each row.
fn varied_documents(batch: i64, time: i64) -> Vec<i64> {
    let mut documents = Vec::new();
    let mut doc = 0i64;
    for _ in 0..batch {
        let mut left = time;
        let mut len = 1 + time / 7;
        while left > 0 {
            let take = len.min(left);
            documents.extend(std::iter::repeat_n(doc, take as usize));
            left -= take;
            doc += 1;
            len = 1 + (len * 5 + 3) % (time / 3).max(1);
        }
    }
    documents
}

/// What the check runs every attention on: packed documents (segments and dense mask)
/// and seeded random queries, keys, values and output gradient in the exact kind.
struct Trial {
    segments: Segments,
    mask: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    upstream: Tensor,
    scale: f64,
    /// What the reference computes in: f64 on the CPU, f32 on CUDA.
    exact: Kind,
    device: Device,
}

impl Trial {
    fn new(device: Device, [batch, heads, kv_heads, time, dim]: [i64; 5]) -> Self {
        let documents = varied_documents(batch, time);
        let packed = crate::model::Batch::packed(&Tensor::from_slice(&documents).view([batch, time]), true);
        let segments = packed.segments.expect("a packed batch has segments");
        let mask = packed.mask.expect("the dense mask was asked for").to_device(device);
        tch::manual_seed(11);
        let exact = if device.is_cuda() { Kind::Float } else { Kind::Double };
        let make = |h| Tensor::randn([batch, h, time, dim], (exact, device));
        let (q, k, v, upstream) = (make(heads), make(kv_heads), make(kv_heads), make(heads));
        Self {
            segments,
            mask,
            q,
            k,
            v,
            upstream,
            scale: 1.0 / (dim as f64).sqrt(),
            exact,
            device,
        }
    }

    /// The output and query/key/value gradients (in the exact kind) of the kernel `which`
    /// (`None`: SDPA with the dense mask), computed in `as_kind`.
    fn run(&self, which: Option<Kernel>, as_kind: Kind) -> (Tensor, Vec<Tensor>) {
        let leaves: Vec<Tensor> = [&self.q, &self.k, &self.v]
            .iter()
            .map(|t| t.to_kind(as_kind).detach().set_requires_grad(true))
            .collect();
        let (lq, lk, lv) = (&leaves[0], &leaves[1], &leaves[2]);
        let (segments, scale) = (&self.segments, self.scale);
        let out = match which {
            Some(Kernel::FlashVarlen) => flash_varlen(lq, lk, lv, segments, scale, None)
                .unwrap_or_else(|e| panic!("FlashAttention's variable-length kernel failed: {e}")),
            Some(Kernel::DenseMask) => per_document(lq, lk, lv, segments, scale, None),
            None => Tensor::scaled_dot_product_attention(lq, lk, lv, Some(&self.mask), 0.0, false, scale, true),
        };
        let target = (&out * self.upstream.to_kind(as_kind)).sum(self.exact);
        let grads = Tensor::run_backward(&[target], &leaves, false, false);
        (
            out.to_kind(self.exact),
            grads.iter().map(|g| g.to_kind(self.exact)).collect::<Vec<_>>(),
        )
    }

    /// Forward and backward of `which` in `kind`, milliseconds, best of 3.
    fn best_ms(&self, which: Option<Kernel>, kind: Kind) -> f64 {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            if self.device.is_cuda() {
                tch::Cuda::synchronize(0);
            }
            let start = std::time::Instant::now();
            let _ = self.run(which, kind);
            if self.device.is_cuda() {
                tch::Cuda::synchronize(0);
            }
            best = best.min(start.elapsed().as_secs_f64() * 1e3);
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Batch;

    #[test]
    fn segments_restart_at_every_row_and_document_change() {
        // Two rows of 4: [7 7 8 8] [8 8 8 9] (document 8 continues across rows in the
        // numbering, but a row is its own sequence).
        let segments = Segments::from_documents(&[7, 7, 8, 8, 8, 8, 8, 9], 4);
        assert_eq!(segments.cu_seqlens, vec![0, 2, 4, 7, 8]);
        assert_eq!(segments.max_len, 3);
        assert_eq!(segments.len(), 4);
        assert_eq!(Segments::from_documents(&[], 4).cu_seqlens, vec![0]);
        assert_eq!(Segments::rows(2, 3).cu_seqlens, vec![0, 3, 6]);
    }

    #[test]
    fn kernel_choice_needs_cuda_half_precision_and_a_fitting_head() {
        assert_eq!(
            Kernel::choose(Device::Cuda(0), Kind::BFloat16, 128),
            Kernel::FlashVarlen
        );
        assert_eq!(Kernel::choose(Device::Cuda(0), Kind::Half, 64), Kernel::FlashVarlen);
        assert_eq!(Kernel::choose(Device::Cuda(0), Kind::Float, 128), Kernel::DenseMask);
        assert_eq!(Kernel::choose(Device::Cuda(0), Kind::BFloat16, 100), Kernel::DenseMask);
        assert_eq!(Kernel::choose(Device::Cuda(0), Kind::BFloat16, 512), Kernel::DenseMask);
        assert_eq!(Kernel::choose(Device::Cpu, Kind::BFloat16, 128), Kernel::DenseMask);
    }

    /// Packed rows with GQA, with and without a sliding window: attention per segment
    /// equals SDPA under the batch's dense mask.
    #[test]
    fn per_segment_attention_equals_the_dense_masked_path() {
        tch::manual_seed(3);
        let (batch, heads, kv_heads, time, dim) = (2, 4, 2, 12, 8);
        let documents = Tensor::from_slice(&[
            0i64, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6,
        ])
        .view([batch, time]);
        let packed = Batch::packed(&documents, true);
        let dense = packed.mask.as_ref().expect("the dense mask was asked for");
        let segments = packed.segments.as_ref().expect("a packed batch has segments");
        assert_eq!(segments.cu_seqlens, vec![0, 3, 8, 10, 12, 19, 24]);
        let q = Tensor::randn([batch, heads, time, dim], (Kind::Double, Device::Cpu));
        let k = Tensor::randn([batch, kv_heads, time, dim], (Kind::Double, Device::Cpu));
        let v = Tensor::randn([batch, kv_heads, time, dim], (Kind::Double, Device::Cpu));
        let scale = 1.0 / (dim as f64).sqrt();
        for window in [None, Some(3)] {
            let mask = match window {
                Some(w) => {
                    dense.logical_and(&Tensor::ones([time, time], (Kind::Bool, Device::Cpu)).triu(-(w as i64 - 1)))
                }
                None => dense.shallow_clone(),
            };
            let want = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), 0.0, false, scale, true);
            let got = per_document(&q, &k, &v, segments, scale, window);
            let diff = (&got - &want).abs().max().double_value(&[]);
            assert!(diff < 1e-12, "window {window:?}: differs by {diff}");
        }
    }

    #[test]
    fn the_check_passes_on_the_cpu_kernel() {
        let result = check(Device::Cpu, Kind::Float, 48);
        assert_eq!(result.kernel, "per-document");
        assert!(result.documents > 4, "{result:?}");
        assert!(result.ok, "{result:?}");
    }

    #[test]
    fn flash_varlen_is_refused_on_the_cpu_with_libtorchs_reason() {
        let q = Tensor::zeros([1, 2, 4, 8], (Kind::BFloat16, Device::Cpu));
        let error = flash_varlen(&q, &q, &q, &Segments::rows(1, 4), 0.35, None)
            .expect_err("the variable-length kernel is CUDA-only");
        assert!(!error.to_string().is_empty());
    }
}
