//! Choosing the next token from one row of logits: greedy, or temperature / top-k / top-p
//! sampling driven by a counter-based random stream per row. The draw for a row's n-th
//! token depends only on (seed, row id, n), never on which rows share the batch, how many
//! actors run, or how often a sequence was scheduled, so a seeded run is reproducible
//! row by row. Pure: slices in, a token out.

use super::params::SamplingParams;

/// The token chosen and its log-probability under the model (temperature 1, no
/// truncation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// The token id.
    pub token: i64,
    /// log p(token) from the raw logits.
    pub logprob: f64,
}

/// A row's random stream: the seed mixed with a hash of the row's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowStream(u64);

impl RowStream {
    /// The stream of row `id` under `seed`.
    pub fn new(seed: u64, id: &str) -> Self {
        let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        Self(splitmix64(seed ^ splitmix64(hash)))
    }

    /// The uniform draw in [0, 1) for the row's `index`-th generated token.
    pub fn uniform(self, index: usize) -> f64 {
        let bits = splitmix64(self.0 ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        (bits >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// log-sum-exp of the logits (the normaliser of the softmax).
fn log_normaliser(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    max + sum.ln()
}

/// The most likely token (the lowest id among equals).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best
}

/// The next token for a row with these `params`, `index` tokens into its generation.
/// `logits` must be non-empty and finite where they matter; a NaN row picks token 0.
pub fn choose(logits: &[f32], params: &SamplingParams, stream: RowStream, index: usize) -> Choice {
    let token = if params.temperature <= 0.0 {
        argmax(logits)
    } else {
        sample(logits, params, stream.uniform(index))
    };
    let logprob = if params.logprobs {
        logits[token] as f64 - log_normaliser(logits)
    } else {
        0.0
    };
    Choice {
        token: token as i64,
        logprob,
    }
}

/// Draws with uniform `u` from the tempered distribution cut to the top-k tokens and then
/// to the smallest set whose probability reaches top-p, in order of decreasing
/// probability (ties by id), so the same `u` always gives the same token.
fn sample(logits: &[f32], params: &SamplingParams, u: f64) -> usize {
    let temperature = params.temperature;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let k = if params.top_k == 0 {
        logits.len()
    } else {
        params.top_k.min(logits.len())
    };
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, by_logit);
        order.truncate(k);
    }
    order.sort_unstable_by(by_logit);
    let max = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    // The nucleus: the shortest prefix whose mass reaches top_p (at least one token).
    let mut kept = weights.len();
    if params.top_p < 1.0 {
        let mut mass = 0.0;
        for (n, w) in weights.iter().enumerate() {
            mass += w / total;
            if mass >= params.top_p {
                kept = n + 1;
                break;
            }
        }
    }
    let kept_total: f64 = weights[..kept].iter().sum();
    let target = u * kept_total;
    let mut running = 0.0;
    for (n, w) in weights[..kept].iter().enumerate() {
        running += w;
        if target < running {
            return order[n];
        }
    }
    order[kept - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f64, top_k: usize, top_p: f64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            logprobs: true,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_most_likely_token_and_its_logprob() {
        let logits = [0.0f32, 2.0, 2.0, -1.0];
        let choice = choose(&logits, &params(0.0, 0, 1.0), RowStream::new(0, "a"), 0);
        assert_eq!(choice.token, 1, "ties go to the lowest id");
        let norm: f64 = logits.iter().map(|l| (*l as f64).exp()).sum::<f64>().ln();
        assert!((choice.logprob - (2.0 - norm)).abs() < 1e-12);
    }

    #[test]
    fn draws_depend_on_seed_row_and_index_only() {
        let a = RowStream::new(7, "row-1");
        assert_eq!(a, RowStream::new(7, "row-1"));
        assert_ne!(a.uniform(0), RowStream::new(8, "row-1").uniform(0));
        assert_ne!(a.uniform(0), RowStream::new(7, "row-2").uniform(0));
        assert_ne!(a.uniform(0), a.uniform(1));
        let draws: Vec<f64> = (0..10_000).map(|i| a.uniform(i)).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "uniform draws average {mean}");
    }

    #[test]
    fn sampling_follows_the_tempered_distribution() {
        // p = softmax([ln 1, ln 2, ln 3, ln 4]) = [0.1, 0.2, 0.3, 0.4].
        let logits: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
        let stream = RowStream::new(1, "x");
        let mut counts = [0usize; 4];
        let n = 40_000;
        for i in 0..n {
            counts[choose(&logits, &params(1.0, 0, 1.0), stream, i).token as usize] += 1;
        }
        for (token, expected) in [0.1, 0.2, 0.3, 0.4].iter().enumerate() {
            let seen = counts[token] as f64 / n as f64;
            assert!((seen - expected).abs() < 0.01, "token {token}: {seen} vs {expected}");
        }
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
        let stream = RowStream::new(2, "y");
        let seen = |p: &SamplingParams| -> Vec<i64> {
            let mut tokens: Vec<i64> = (0..2000).map(|i| choose(&logits, p, stream, i).token).collect();
            tokens.sort_unstable();
            tokens.dedup();
            tokens
        };
        assert_eq!(seen(&params(1.0, 2, 1.0)), vec![2, 3]);
        // 0.4 + 0.3 = 0.7 >= 0.65: the nucleus is the two most likely tokens.
        assert_eq!(seen(&params(1.0, 0, 0.65)), vec![2, 3]);
        assert_eq!(seen(&params(1.0, 0, 0.1)), vec![3]);
        assert_eq!(seen(&params(1.0, 1, 1.0)), vec![3]);
        // A very low temperature is all but greedy.
        assert_eq!(seen(&params(1e-4, 0, 1.0)), vec![3]);
    }
}
