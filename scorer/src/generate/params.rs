//! Sampling settings: the run's defaults (`--temperature`, `--top-p`, ...) and a row's own
//! `"params": {...}` laid over them, checked into typed values at the edge so a row with an
//! out-of-range value goes to the errors file with the reason instead of reaching a model.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// Longest generation a row may ask for.
pub const MAX_NEW_TOKENS_LIMIT: usize = 32_768;
/// Stop strings a row may give.
pub const MAX_STOPS: usize = 16;

/// How one row is generated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Tokens generated at most (fewer when the model's context ends first).
    pub max_new_tokens: usize,
    /// 0: greedy (the most likely token, ties to the lowest id); above 0: sampling from
    /// the distribution with its logits divided by this.
    pub temperature: f64,
    /// Nucleus sampling: only the most likely tokens whose probabilities add up to this
    /// (1: all).
    pub top_p: f64,
    /// Only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Seed of the row's random stream; the stream also depends on the row's id, so rows
    /// sharing a seed still draw differently, and a row draws the same wherever it runs.
    pub seed: u64,
    /// Generation stops before the first of these strings; the text ends before it.
    pub stop: Vec<String>,
    /// Whether each generated token's log-probability is returned.
    pub logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            stop: Vec::new(),
            logprobs: false,
        }
    }
}

impl SamplingParams {
    /// Checks every field; the error names the field, its value and the allowed range.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_NEW_TOKENS_LIMIT).contains(&self.max_new_tokens) {
            return Err(Error::MaxNewTokens {
                asked: self.max_new_tokens,
                limit: MAX_NEW_TOKENS_LIMIT,
            });
        }
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return Err(Error::Temperature(self.temperature));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::TopP(self.top_p));
        }
        if self.stop.len() > MAX_STOPS {
            return Err(Error::TooManyStops {
                given: self.stop.len(),
                limit: MAX_STOPS,
            });
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(Error::EmptyStop);
        }
        Ok(())
    }

    /// These defaults with a row's `params` object laid over them (only the keys it has);
    /// unknown keys and wrong types are errors, as are values out of range.
    pub fn with_overrides(&self, params: Option<&Value>) -> Result<Self> {
        let merged = match params {
            None | Some(Value::Null) => self.clone(),
            Some(Value::Object(overrides)) => {
                let mut base = serde_json::to_value(self)?;
                let object = base
                    .as_object_mut()
                    .expect("SamplingParams, a struct with named fields, serializes as a JSON object");
                for (key, value) in overrides {
                    if !object.contains_key(key) {
                        return Err(Error::UnknownParam(key.clone()));
                    }
                    object.insert(key.clone(), value.clone());
                }
                serde_json::from_value(base).map_err(Error::ParamType)?
            }
            Some(other) => return Err(Error::ParamsNotObject(other.clone())),
        };
        merged.validate()?;
        Ok(merged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_row_overrides_only_what_it_names() {
        let defaults = SamplingParams {
            temperature: 0.7,
            seed: 3,
            ..SamplingParams::default()
        };
        let row = defaults
            .with_overrides(Some(&json!({"max_new_tokens": 5, "stop": ["\n"]})))
            .unwrap();
        assert_eq!(row.max_new_tokens, 5);
        assert_eq!(row.stop, vec!["\n".to_string()]);
        assert_eq!((row.temperature, row.seed), (0.7, 3));
        assert_eq!(defaults.with_overrides(None).unwrap(), defaults);
    }

    #[test]
    fn bad_params_say_which_and_why() {
        let d = SamplingParams::default();
        let cases = [
            (json!({"temperature": -1.0}), "temperature must be 0..=100"),
            (json!({"top_p": 0.0}), "top_p must be in (0, 1]"),
            (json!({"max_new_tokens": 0}), "max_new_tokens must be 1..="),
            (json!({"top_k": "many"}), "`params`"),
            (json!({"beam": 4}), "unknown key `beam`"),
            (json!({"stop": [""]}), "stop string is empty"),
            (json!([1]), "must be an object"),
        ];
        for (params, expected) in cases {
            let error = d.with_overrides(Some(&params)).unwrap_err().to_string();
            assert!(error.contains(expected), "{params}: {error}");
        }
    }
}
