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
        let result = crate::attention_check::check(Device::Cpu, Kind::Float, 48);
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
