//! The training loss: the summed cross-entropy of every target token, and its gradient
//! with respect to the logits computed a chunk of rows at a time without autograd.

use tch::{Kind, Reduction, Tensor};

use super::IGNORE_INDEX;

/// Sum of the cross-entropy of every target token (float32).
pub fn token_loss_sum(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = logits.size()[logits.dim() - 1];
    logits
        .reshape([-1, vocab])
        .to_kind(Kind::Float)
        .cross_entropy_loss::<Tensor>(&targets.reshape([-1]), None, Reduction::Sum, IGNORE_INDEX, 0.0)
}

/// [`token_loss_sum`] a chunk of rows at a time (as [`token_loss_and_grad`] chunks them),
/// without gradients: a float64 scalar on the logits' device.
pub fn token_loss_sum_chunked(logits: &Tensor, targets: &Tensor) -> Tensor {
    tch::no_grad(|| {
        let vocab = logits.size()[logits.dim() - 1];
        let flat = logits.reshape([-1, vocab]);
        let targets = targets.reshape([-1]).to_device(flat.device());
        let (rows, chunk_rows) = (flat.size()[0], (LOSS_CHUNK_ELEMENTS / vocab.max(1)).max(1));
        let mut loss = Tensor::zeros([], (Kind::Double, flat.device()));
        let mut start = 0;
        while start < rows {
            let len = chunk_rows.min(rows - start);
            loss += token_loss_sum(&flat.narrow(0, start, len), &targets.narrow(0, start, len)).to_kind(Kind::Double);
            start += len;
        }
        loss
    })
}

/// Elements of f32 logits the loss works on at once (64 MiB): the loss never holds an f32
/// copy of the whole `[batch, time, vocab]` logits, which at bf16 compute would be twice
/// the logits' own size again.
const LOSS_CHUNK_ELEMENTS: i64 = 1 << 24;

/// The sum of the cross-entropy of every target token, and the gradient of that sum times
/// `scale` with respect to `logits` (in the logits' dtype), computed a chunk of rows at a time in f32
/// and without autograd: softmax minus the one-hot target, zero on [`IGNORE_INDEX`] rows. Equal to
/// autograd through [`token_loss_sum`]; the engine's last block takes the gradient as its
/// upstream. The loss stays a float64 scalar tensor on the logits' device (no host sync).
pub fn token_loss_and_grad(logits: &Tensor, targets: &Tensor, scale: f64) -> (Tensor, Tensor) {
    let vocab = logits.size()[logits.dim() - 1];
    chunked_loss_and_grad(logits, targets, scale, (LOSS_CHUNK_ELEMENTS / vocab.max(1)).max(1))
}

fn chunked_loss_and_grad(logits: &Tensor, targets: &Tensor, scale: f64, chunk_rows: i64) -> (Tensor, Tensor) {
    tch::no_grad(|| {
        let vocab = logits.size()[logits.dim() - 1];
        let flat = logits.reshape([-1, vocab]);
        let targets = targets.reshape([-1]).to_device(flat.device());
        let rows = flat.size()[0];
        let grad = flat.empty_like();
        let mut loss = Tensor::zeros([], (Kind::Double, flat.device()));
        // f32 at least (bf16 logits are widened a chunk at a time), f64 kept as f64.
        let exact = if flat.kind() == Kind::Double {
            Kind::Double
        } else {
            Kind::Float
        };
        let mut start = 0;
        while start < rows {
            let len = chunk_rows.min(rows - start);
            let chunk = flat.narrow(0, start, len).to_kind(exact);
            let target = targets.narrow(0, start, len);
            let valid = target.ne(IGNORE_INDEX);
            let safe = target.where_scalarother(&valid, 0).unsqueeze(1);
            let log_probs = chunk.log_softmax(-1, exact);
            let picked = log_probs.gather(1, &safe, false).squeeze_dim(1);
            loss += (-picked * valid.to_kind(exact)).sum(Kind::Double);
            let mut probs = log_probs.exp();
            let _ = probs.scatter_add_(1, &safe, &Tensor::full([len, 1], -1.0, (exact, flat.device())));
            let chunk_grad = probs * valid.to_kind(exact).unsqueeze(1) * scale;
            grad.narrow(0, start, len).copy_(&chunk_grad.to_kind(grad.kind()));
            start += len;
        }
        (loss, grad.view(logits.size().as_slice()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn the_chunked_loss_and_its_gradient_equal_autograd_through_the_whole_loss() {
        tch::manual_seed(5);
        let logits = Tensor::randn([3, 7, 11], (Kind::Double, Device::Cpu));
        let targets = Tensor::randint(11, [3, 7], (Kind::Int64, Device::Cpu));
        let _ = targets.get(1).get(2).fill_(IGNORE_INDEX);
        let _ = targets.get(2).get(6).fill_(IGNORE_INDEX);
        let leaf = logits.detach().set_requires_grad(true);
        let scale = 1.0 / 19.0;
        let sum = token_loss_sum(&leaf, &targets);
        let want = Tensor::run_backward(&[&(&sum * scale)], &[&leaf], false, false).remove(0);
        // Chunks of 4 rows over 21 (the last one short), and one chunk for all.
        for rows in [4, 1000] {
            let (loss, grad) = chunked_loss_and_grad(&logits, &targets, scale, rows);
            let loss = loss.double_value(&[]);
            // token_loss_sum computes in f32, this one in f64 for f64 logits.
            let want_loss = sum.double_value(&[]);
            assert!(
                (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
                "{rows}: loss {loss} vs {want_loss}"
            );
            assert_eq!(grad.size(), logits.size());
            let diff = (&grad.to_kind(Kind::Double) - &want).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "{rows}: gradient differs by {diff}");
        }
        // An ignored row's gradient is zero.
        let (_, grad) = chunked_loss_and_grad(&logits, &targets, scale, 4);
        assert_eq!(grad.get(1).get(2).abs().sum(Kind::Double).double_value(&[]), 0.0);
    }
}
