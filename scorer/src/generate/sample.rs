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
    Nucleus::new(logits, params).draw(u)
}

/// The tokens a sampling row may draw and their probabilities, most likely first: the
/// tempered softmax cut to the top-k tokens, then to the top-p nucleus, renormalised (as
/// `transformers`' temperature, top-k and top-p logits warpers leave it). Needs a
/// temperature above 0. The reference the sampling tests draw against.
#[cfg(test)]
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Vec<(usize, f64)> {
    let mut nucleus = Nucleus::new(logits, params);
    let kept = nucleus.kept;
    nucleus.sort_to(kept);
    nucleus.order[..kept]
        .iter()
        .map(|&i| (i, nucleus.weight(i) / nucleus.kept_total))
        .collect()
}

/// A row's candidates: walked from the most likely down and sorted only as far as a walk
/// reaches (chunks of 64, 256, ... by partial selection), not the whole vocabulary.
struct Nucleus<'l> {
    logits: &'l [f32],
    temperature: f64,
    max: f64,
    /// Candidate ids; `order[..sorted]` are the most likely, in order.
    order: Vec<usize>,
    sorted: usize,
    /// Candidates in the nucleus (a prefix of the sorted order).
    kept: usize,
    kept_total: f64,
}

impl<'l> Nucleus<'l> {
    fn new(logits: &'l [f32], params: &SamplingParams) -> Self {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        let k = if params.top_k == 0 {
            logits.len()
        } else {
            params.top_k.min(logits.len())
        };
        let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        if k < order.len() {
            order.select_nth_unstable_by(k - 1, by_logit);
            // Tokens tied with the k-th stay, as `transformers`' top-k keeps every token
            // whose logit is at least the k-th largest.
            let edge = logits[order[k - 1]];
            let mut end = k;
            for n in k..order.len() {
                if logits[order[n]] >= edge {
                    order.swap(end, n);
                    end += 1;
                }
            }
            order.truncate(end);
        }
        let max = order.iter().map(|&i| logits[i]).fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut nucleus = Self {
            logits,
            temperature: params.temperature,
            max,
            kept: order.len(),
            order,
            sorted: 0,
            kept_total: 0.0,
        };
        let total: f64 = nucleus.order.iter().map(|&i| nucleus.weight(i)).sum();
        nucleus.kept_total = total;
        if params.top_p < 1.0 {
            // The shortest prefix whose mass reaches top_p (at least one token).
            let (mut mass, mut kept_total, mut n, mut chunk) = (0.0, 0.0, 0, 64);
            'walk: while n < nucleus.order.len() {
                nucleus.sort_to(n + chunk);
                while n < nucleus.sorted {
                    let w = nucleus.weight(nucleus.order[n]);
                    mass += w / total;
                    kept_total += w;
                    n += 1;
                    if mass >= params.top_p {
                        nucleus.kept = n;
                        nucleus.kept_total = kept_total;
                        break 'walk;
                    }
                }
                chunk *= 4;
            }
        }
        nucleus
    }

    fn weight(&self, i: usize) -> f64 {
        ((self.logits[i] as f64 - self.max) / self.temperature).exp()
    }

    /// Extends the sorted prefix to `want` candidates: a partial selection of the next
    /// ones among the rest, then a sort of those alone.
    fn sort_to(&mut self, want: usize) {
        let want = want.min(self.order.len());
        if want <= self.sorted {
            return;
        }
        let logits = self.logits;
        let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        let rest = &mut self.order[self.sorted..];
        if want - self.sorted < rest.len() {
            rest.select_nth_unstable_by(want - self.sorted - 1, by_logit);
        }
        self.order[self.sorted..want].sort_unstable_by(by_logit);
        self.sorted = want;
    }

    /// The token at `u` of the nucleus's cumulative weight, most likely first.
    fn draw(&mut self, u: f64) -> usize {
        let target = u * self.kept_total;
        let (mut running, mut n, mut chunk) = (0.0, 0, 64);
        while n < self.kept {
            self.sort_to((n + chunk).min(self.kept));
            while n < self.sorted.min(self.kept) {
                running += self.weight(self.order[n]);
                if target < running {
                    return self.order[n];
                }
                n += 1;
            }
            chunk *= 4;
        }
        self.order[self.kept - 1]
    }
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

    #[test]
    fn top_k_and_top_p_keep_what_transformers_logits_warpers_keep() {
        // Made by scripts/make-sampling-fixtures.py with transformers' own warpers.
        let fixture: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/fixtures/sampling.json")).unwrap();
        let rows: Vec<Vec<f32>> = serde_json::from_value(fixture["logits"].clone()).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert!(cases.len() >= 20, "{} cases", cases.len());
        for case in cases {
            let p = params(
                case["temperature"].as_f64().unwrap(),
                case["top_k"].as_u64().unwrap() as usize,
                case["top_p"].as_f64().unwrap(),
            );
            let logits = &rows[case["row"].as_u64().unwrap() as usize];
            let got = distribution(logits, &p);
            let mut tokens: Vec<usize> = got.iter().map(|(t, _)| *t).collect();
            tokens.sort_unstable();
            let expected: Vec<usize> = serde_json::from_value(case["tokens"].clone()).unwrap();
            assert_eq!(tokens, expected, "{case:?}");
            let probs: Vec<f64> = serde_json::from_value(case["probs"].clone()).unwrap();
            let by_token: std::collections::HashMap<usize, f64> = got.into_iter().collect();
            for (t, want) in expected.iter().zip(probs) {
                let diff = (by_token[t] - want).abs();
                assert!(diff < 1e-6, "token {t}: {} vs transformers' {want}", by_token[t]);
            }
        }
        // Draws only ever land in the nucleus, and the most likely token is first.
        let p = params(1.0, 0, 0.9);
        let kept: std::collections::HashSet<usize> = distribution(&rows[0], &p).into_iter().map(|(t, _)| t).collect();
        let stream = RowStream::new(3, "z");
        assert!((0..500).all(|i| kept.contains(&(choose(&rows[0], &p, stream, i).token as usize))));
    }
}
