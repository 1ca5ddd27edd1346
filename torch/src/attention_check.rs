//! `regatta-torch-rank attention-check`: the packed-rows kernel against SDPA with the dense
//! mask, forward and backward, both timed.

use tch::{Device, Kind, Tensor};

use crate::attention::{flash_varlen, per_document, Kernel, Segments};
use crate::model::Batch;

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
        let packed = Batch::packed(&Tensor::from_slice(&documents).view([batch, time]), true);
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
