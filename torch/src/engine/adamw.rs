//! AdamW over flat buffers in place, the same update on the device or on the host (when
//! the optimizer state is offloaded).

use std::ops::Range;

use tch::Tensor;

/// The settings of one AdamW update.
#[derive(Clone, Copy, Debug)]
pub struct AdamwStep {
    /// This step's learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay (where `decay` is 1).
    pub weight_decay: f64,
    /// The step's number, from 1 (bias corrections).
    pub step: u64,
}

/// One AdamW update of flat fp32 buffers in place, as `torch.optim.AdamW` computes it
/// (decoupled weight decay on the `decay` ranges only), in nine whole-buffer libtorch
/// kernels (vectorised, on every intra-op thread; no per-tensor loop, no temporaries:
/// `grad` is the scratch buffer). With ZeRO-Offload every buffer is in host memory.
pub fn adamw_update(
    master: &mut Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    decay: &[Range<usize>],
    mut grad: Tensor,
    s: &AdamwStep,
) {
    let t = s.step.min(i32::MAX as u64) as i32;
    let (bc1, bc2) = (1.0 - s.beta1.powi(t), 1.0 - s.beta2.powi(t));
    tch::no_grad(|| {
        if s.weight_decay > 0.0 {
            for range in decay {
                let _ = master
                    .narrow(0, range.start as i64, range.len() as i64)
                    .g_mul_scalar_(1.0 - s.lr * s.weight_decay);
            }
        }
        // m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
        let _ = m.lerp_(&grad, 1.0 - s.beta1);
        let _ = grad.g_mul_(&grad.shallow_clone());
        let _ = v.lerp_(&grad, 1.0 - s.beta2);
        // p <- p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        //    = p - (lr sqrt(bc2) / bc1) * m / (sqrt(v) + eps sqrt(bc2))
        let _ = v.sqrt_out(&grad);
        let _ = grad.g_add_scalar_(s.eps * bc2.sqrt());
        let _ = m.div_out(&grad, &grad.shallow_clone());
        let _ = grad.g_mul_scalar_(-s.lr * bc2.sqrt() / bc1);
        let _ = master.g_add_(&grad);
    });
}
