//! What a step takes from each row's last logits: nothing, the greedy token (and its
//! log-probability) chosen where the logits are, or the logits on the host to sample from.

use tch::{Device, Kind, Tensor};

use crate::error::Result;

/// What a step needs of a row's last logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Want {
    /// Nothing: a prompt chunk that is not the prompt's last.
    Nothing,
    /// The most likely token (ties to the lowest id), and its log-probability when asked.
    Greedy { logprob: bool },
    /// The logits on the CPU (sampling, or kept for tests).
    Logits,
}

/// What [`Generator::forward`](super::Generator::forward) gives back for a row (see [`Want`]).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Picked {
    Nothing,
    Token { token: i64, logprob: f64 },
    Logits(Vec<f32>),
}

/// Picks from `logits` (`[rows, vocab]`, on the model's device and in its dtype) what each
/// row wants. Greedy rows are chosen where the logits are, as `choose` would: `argmax`
/// gives the first of equal maxima (the lowest id), and the log-probability is the
/// token's logit less the log-sum-exp of the row, in f64.
pub(super) fn pick(logits: &Tensor, wants: &[Want]) -> Result<Vec<Picked>> {
    let device = logits.device();
    let rows_where = |keep: &dyn Fn(&Want) -> bool| -> Vec<i64> {
        (0..wants.len() as i64).filter(|&r| keep(&wants[r as usize])).collect()
    };
    let greedy = rows_where(&|w| matches!(w, Want::Greedy { .. }));
    let full = rows_where(&|w| *w == Want::Logits);
    let mut picked = vec![Picked::Nothing; wants.len()];
    if !greedy.is_empty() {
        // A step of greedy rows only (the usual case) needs no copy of its logits.
        let chosen = if greedy.len() == wants.len() {
            logits.shallow_clone()
        } else {
            logits.index_select(0, &Tensor::from_slice(&greedy).to_device(device))
        };
        let with_logprob = greedy
            .iter()
            .any(|&r| wants[r as usize] == Want::Greedy { logprob: true });
        let (tokens, logprobs) = greedy_tokens(&chosen, with_logprob);
        let logprobs = match logprobs {
            Some(lp) => Vec::<f64>::try_from(lp.to_device(Device::Cpu))?,
            None => vec![0.0; greedy.len()],
        };
        let tokens = Vec::<i64>::try_from(tokens.to_device(Device::Cpu))?;
        for ((&r, token), logprob) in greedy.iter().zip(tokens).zip(logprobs) {
            let logprob = if wants[r as usize] == (Want::Greedy { logprob: true }) {
                logprob
            } else {
                0.0
            };
            picked[r as usize] = Picked::Token { token, logprob };
        }
    }
    if !full.is_empty() {
        for (&r, row) in full.iter().zip(host_logits(logits, &full)?) {
            picked[r as usize] = Picked::Logits(row);
        }
    }
    Ok(picked)
}

/// Rows `rows` of `logits` (`[rows, vocab]`, any device and dtype) as f32 on the host.
pub(super) fn host_logits(logits: &Tensor, rows: &[i64]) -> Result<Vec<Vec<f32>>> {
    let chosen = logits
        .index_select(0, &Tensor::from_slice(rows).to_device(logits.device()))
        .to_kind(Kind::Float)
        .to_device(Device::Cpu)
        .contiguous();
    let vocab = chosen.size()[1] as usize;
    let flat = Vec::<f32>::try_from(chosen.view([-1]))?;
    Ok(flat.chunks(vocab.max(1)).map(<[f32]>::to_vec).collect())
}

/// Each row's most likely token (`[rows]`, the lowest id of equal maxima) and its
/// log-probability (`[rows]`, f64: the token's logit less the row's log-sum-exp), chosen
/// where `logits` (`[rows, vocab]`) are.
pub(super) fn greedy(logits: &Tensor) -> (Tensor, Tensor) {
    let tokens = argmax_tokens(logits);
    let logprobs = logprobs_of(logits, &tokens);
    (tokens.view([-1]), logprobs)
}

/// [`greedy`], the log-probabilities only when asked for.
fn greedy_tokens(logits: &Tensor, logprob: bool) -> (Tensor, Option<Tensor>) {
    let tokens = argmax_tokens(logits);
    let logprobs = logprob.then(|| logprobs_of(logits, &tokens));
    (tokens.view([-1]), logprobs)
}

/// Each row's most likely token, `[rows, 1]`. `argmax` takes NaN for the largest value;
/// `choose` never picks one (a row of NaN picks token 0), so NaN counts as -inf here (and,
/// as `nan_to_num` has it, ±inf as the largest finite values).
///
/// On the CPU the logits are not copied for that: `argmax` alone is right for every row
/// whose pick is finite (such a row holds no NaN and no inf), which a host check of the
/// picks tells, and only otherwise does the copying path run. A decode step of 64 rows
/// has 12.6 MB of logits at SmolLM2's vocabulary.
fn argmax_tokens(logits: &Tensor) -> Tensor {
    if logits.device() == Device::Cpu {
        let tokens = logits.argmax(-1, true);
        let finite = logits.gather(-1, &tokens, false).isfinite().all();
        if finite.int64_value(&[]) != 0 {
            return tokens;
        }
    }
    logits.nan_to_num(Some(f64::NEG_INFINITY), None, None).argmax(-1, true)
}

/// The log-probability of each row's `tokens` (`[rows, 1]`), `[rows]` in f64.
fn logprobs_of(logits: &Tensor, tokens: &Tensor) -> Tensor {
    let logits = logits.to_kind(Kind::Double);
    (logits.gather(-1, tokens, false) - logits.logsumexp([-1i64].as_slice(), true)).view([-1])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(rows: &[[f32; 4]]) -> Tensor {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        Tensor::from_slice(&flat).view([rows.len() as i64, 4])
    }

    fn tokens(picked: &[Picked]) -> Vec<Option<i64>> {
        picked
            .iter()
            .map(|p| match p {
                Picked::Token { token, .. } => Some(*token),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn greedy_picks_the_lowest_of_equal_maxima_and_skips_nan_and_infinities_as_before() {
        let greedy = Want::Greedy { logprob: false };
        // Finite rows: argmax alone, ties to the lowest id.
        let finite = logits(&[[1.0, 3.0, 3.0, 2.0], [-1.0, -2.0, -0.5, -0.5], [0.0; 4]]);
        assert_eq!(
            tokens(&pick(&finite, &[greedy; 3]).unwrap()),
            [Some(1), Some(2), Some(0)]
        );
        // A NaN counts as -inf, +inf as the largest finite value (so it ties with
        // f32::MAX), -inf as the lowest: rows beside finite ones, which then go the
        // copying way too.
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let odd = logits(&[
            [nan, 1.0, 5.0, nan],
            [nan; 4],
            [f32::MAX, 1.0, inf, 2.0],
            [-inf, -inf, -inf, -inf],
            [1.0, inf, 2.0, inf],
            [1.0, 3.0, 3.0, 2.0],
        ]);
        assert_eq!(
            tokens(&pick(&odd, &[greedy; 6]).unwrap()),
            [Some(2), Some(0), Some(0), Some(0), Some(1), Some(1)]
        );
        // Some rows greedy, some not: only those are picked, from their own rows.
        let wants = [Want::Nothing, greedy, Want::Logits];
        let picked = pick(&finite, &wants).unwrap();
        assert_eq!(tokens(&picked), [None, Some(2), None]);
        assert_eq!(picked[0], Picked::Nothing);
        assert_eq!(picked[2], Picked::Logits(vec![0.0; 4]));
    }

    #[test]
    fn a_greedy_log_probability_is_the_logit_less_the_rows_log_sum_exp() {
        let row = [1.0f32, 3.0, 3.0, 2.0];
        let picked = pick(&logits(&[row]), &[Want::Greedy { logprob: true }]).unwrap();
        let normaliser = row.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        match picked[0] {
            Picked::Token { token, logprob } => {
                assert_eq!(token, 1);
                assert!((logprob - (3.0 - normaliser)).abs() < 1e-12, "{logprob}");
            }
            ref other => panic!("{other:?}"),
        }
    }
}
