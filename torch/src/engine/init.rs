//! A parameter's initial values from the run's seed, the same on every rank.

use tch::Tensor;

use crate::model::{Init, ParamSpec};

/// A parameter's initial values: a pure function of the seed and the parameter's name
/// (splitmix64 and Box-Muller), so every rank, thread and libtorch build starts the same
/// way without sharing libtorch's global generator.
pub fn initial_values(spec: &ParamSpec, seed: u64) -> Vec<f32> {
    let n = spec.numel();
    let (std, uniform) = match spec.init {
        Init::Zeros => return vec![0.0; n],
        Init::Ones => return vec![1.0; n],
        Init::Normal(std) => (std, false),
        Init::Uniform(bound) => (bound, true),
    };
    let mut state = spec.name.bytes().fold(seed ^ 0x9e37_79b9_7f4a_7c15, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // A uniform in (0, 1]: never 0, so the logarithm below is finite.
        ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    };
    if uniform {
        return (0..n).map(|_| ((2.0 * next() - 1.0) * std) as f32).collect();
    }
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let (u1, u2) = (next(), next());
        let radius = (-2.0 * u1.ln()).sqrt() * std;
        let angle = std::f64::consts::TAU * u2;
        out.push((radius * angle.cos()) as f32);
        out.push((radius * angle.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// A parameter's initial values from the seed, as a tensor of its shape.
pub fn seeded(spec: &ParamSpec, seed: u64) -> Tensor {
    Tensor::from_slice(&initial_values(spec, seed)).view(spec.shape.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_values_are_deterministic_and_scaled() {
        let spec = ParamSpec {
            name: "h.0.mlp.c_fc.weight".into(),
            shape: vec![100, 100],
            init: Init::Normal(0.02),
            tied_to: None,
            frozen: false,
        };
        let a = initial_values(&spec, 7);
        assert_eq!(a, initial_values(&spec, 7));
        assert_ne!(a, initial_values(&spec, 8));
        let mean = a.iter().map(|v| f64::from(*v)).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|v| (f64::from(*v) - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(
            mean.abs() < 0.002 && (var.sqrt() - 0.02).abs() < 0.002,
            "mean {mean} std {}",
            var.sqrt()
        );
    }
}
