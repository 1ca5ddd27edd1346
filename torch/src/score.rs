//! Batched inference with a trainer checkpoint: per-row log-likelihood and perplexity, and
//! greedy generation. Rows in a batch are right-padded; the model is causal, so padding
//! never changes the scores of real positions, and only real positions are counted.

use crate::error::{Error, Result};
use tch::{Device, Kind, Tensor};

use regatta_scorer::{stop_at, GenRequest, Generation, GenerationSetup, Prompt, RowStream};
use regatta_trainer::{Message, TokenizerSettings};

use crate::data::TextTokenizer;
use crate::generate::{Generator, Output, Prepared, RowError};
use crate::hf::HfModel;
use crate::lora::Adapter;
use crate::model::{arrange, logits, parameter_count, Model};

/// One scored row.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    /// Tokens scored (the text's first `context` tokens).
    pub tokens: usize,
    /// Whether the text was longer than the context and cut.
    pub truncated: bool,
    /// Sum of log p(token | tokens before) over every token after the first.
    pub log_likelihood: f64,
    /// exp(-log_likelihood / (tokens - 1)).
    pub perplexity: f64,
    /// Greedy continuation (empty when no new tokens were asked for).
    pub generated: String,
}

/// The network behind a scorer.
enum Net {
    /// A [`Model`] (the built-in GPT or a Llama-family model) with its weights per block.
    Model {
        model: Box<dyn Model>,
        params: Vec<Vec<Tensor>>,
    },
    /// A TorchScript module: `forward(Long[batch, time]) -> Float[batch, time, vocab]`.
    Script(tch::CModule),
}

/// A model loaded for inference.
pub struct Scorer {
    net: Net,
    context: usize,
    tokenizer: TextTokenizer,
    device: Device,
    /// Special tokens and chat template (`tokenizer_config.json`), for generation.
    settings: TokenizerSettings,
    /// Token ids that end a generation.
    eos: Vec<i64>,
}

impl Scorer {
    /// A model folder (Hugging Face layout, or a trainer checkpoint) with its weights in
    /// `kind` on `device` (`cuda::inference_kind`: bf16 on CUDA), scoring texts of up to
    /// `context` tokens (0: the model's own limit). Log-probabilities are taken in f32.
    /// `generation`: the setup its [`Scorer::generator`] will run under, where it is loaded
    /// to generate (the weights' layout follows it: see [`Scorer::from_model`]).
    pub async fn from_folder(
        hf: &HfModel,
        adapter: Option<&Adapter>,
        context: usize,
        tokenizer: TextTokenizer,
        (device, kind): (Device, Kind),
        generation: Option<&GenerationSetup>,
    ) -> Result<Self> {
        let mut model = hf.model()?;
        hf.check(model.as_ref())?;
        if let Some(adapter) = adapter {
            model.set_lora(&adapter.config)?;
            adapter.check(model.as_ref())?;
            // A QLoRA base: its projections held in 4 bits by the model itself.
            crate::executor::load_quantized(model.as_mut(), hf, device).await?;
        }
        if tokenizer.vocab() > model.vocab() {
            return Err(Error::Invalid(format!(
                "the model embeds {} tokens but the tokenizer has {}",
                model.vocab(),
                tokenizer.vocab()
            )));
        }
        let mut stored = std::collections::HashMap::new();
        for spec in model.blocks().into_iter().flatten().filter(|s| s.tied_to.is_none()) {
            // Straight from the file's dtype to `kind` (a bf16 file is never widened).
            let tensor = match adapter.and_then(|a| a.tensors.get(&spec.name)) {
                Some(tensor) => tensor.to_kind(kind),
                None => hf.read_as(&spec, kind).await?,
            };
            stored.insert(spec.name, tensor.to_device(device));
        }
        let params = arrange(model.as_ref(), &stored)?;
        let limit = model_context(hf.config_json());
        let context = match (context, limit) {
            (0, Some(limit)) => limit,
            (0, None) => 2048,
            (asked, _) => asked,
        };
        let settings = match hf.file("tokenizer_config.json").await? {
            Some(bytes) => {
                let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::ModelFile {
                    path: format!("{}/tokenizer_config.json", hf.url()),
                    problem: format!("is not valid JSON: {e}"),
                })?;
                TokenizerSettings::from_json(&json)
            }
            None => TokenizerSettings::default(),
        };
        let mut eos = eos_ids(hf.config_json());
        if let Some(bytes) = hf.file("generation_config.json").await? {
            let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::ModelFile {
                path: format!("{}/generation_config.json", hf.url()),
                problem: format!("is not valid JSON: {e}"),
            })?;
            eos.extend(eos_ids(&json));
        }
        if let (Some(text), TextTokenizer::Hf(t)) = (&settings.eos_token, &tokenizer) {
            eos.extend(t.token_to_id(text).map(i64::from));
        }
        eos.sort_unstable();
        eos.dedup();
        let mut scorer = Self::from_model(model, params, context, tokenizer, device, generation);
        scorer.settings = settings;
        scorer.eos = eos;
        Ok(scorer)
    }

    /// A model with its weights per block (tied ones included), for texts of up to
    /// `context` tokens. The weights are laid out for what the scorer is loaded for: for
    /// scoring (`generation` `None`), in [`crate::model::inference_layout`]; for generation
    /// under `generation`, as [`crate::generate::generation_layout`] decides (as stored
    /// where the generator packs them). Either serves both, one of them slower.
    pub fn from_model(
        model: Box<dyn Model>,
        params: Vec<Vec<Tensor>>,
        context: usize,
        tokenizer: TextTokenizer,
        device: Device,
        generation: Option<&GenerationSetup>,
    ) -> Self {
        let params = match generation {
            Some(setup) => crate::generate::generation_layout(params, setup, device),
            None => crate::model::inference_layout(params, device),
        };
        Self {
            context,
            net: Net::Model { model, params },
            tokenizer,
            device,
            settings: TokenizerSettings::default(),
            eos: Vec::new(),
        }
    }

    /// A TorchScript module (the bytes of a file `torch.jit.save` or [`Scorer::export`]
    /// wrote) whose `forward` maps token ids `[batch, time]` to logits
    /// `[batch, time, vocab]`, for texts of up to `context` tokens. The contract is checked
    /// here with a two-token batch, so a module that does not fit fails at load.
    pub fn from_torchscript(bytes: &[u8], context: usize, tokenizer: TextTokenizer, device: Device) -> Result<Self> {
        if context < 2 {
            return Err(Error::Invalid(format!(
                "a TorchScript model needs a context of at least 2 tokens, not {context}"
            )));
        }
        let mut module = tch::CModule::load_data_on_device(&mut std::io::Cursor::new(bytes), device)
            .map_err(|e| Error::Invalid(format!("not a TorchScript module: {e}")))?;
        module.set_eval();
        let scorer = Self {
            net: Net::Script(module),
            context,
            tokenizer,
            device,
            settings: TokenizerSettings::default(),
            eos: Vec::new(),
        };
        let probe = Tensor::from_slice(&[0i64, 1, 0, 1]).view([2, 2]).to_device(device);
        let logits = scorer.logits(&probe).map_err(|e| {
            Error::Invalid(format!(
                "the TorchScript module does not take token ids [batch, time]: {e}"
            ))
        })?;
        let shape = logits.size();
        let vocab = scorer.tokenizer.vocab() as i64;
        match shape.as_slice() {
            [2, 2, v] if *v >= vocab => Ok(scorer),
            [2, 2, v] => Err(Error::Invalid(format!(
                "the TorchScript module gives logits over {v} tokens but the tokenizer has {vocab}"
            ))),
            other => Err(Error::Invalid(format!(
                "the TorchScript module maps token ids [2, 2] to {other:?}, not logits [2, 2, vocab]"
            ))),
        }
    }

    /// Parameters of the model (0 for a TorchScript module).
    pub fn parameters(&self) -> u64 {
        match &self.net {
            Net::Model { model, .. } => parameter_count(model.as_ref()),
            Net::Script(_) => 0,
        }
    }

    /// Bytes of the weights the model holds quantized (a QLoRA base's 4-bit projections:
    /// codes and absmax values); 0 when none is.
    pub fn quantized_bytes(&self) -> u64 {
        match &self.net {
            Net::Model { model, .. } => model.quantized_bytes(),
            Net::Script(_) => 0,
        }
    }

    /// The longest text (in tokens) the scorer reads.
    pub fn context(&self) -> usize {
        self.context
    }

    /// This scorer's model as a TorchScript module: traced, so it
    /// takes token ids of any `[batch, time]` with time up to the model's context.
    pub fn export(&self) -> Result<tch::CModule> {
        let Net::Model { model, params } = &self.net else {
            return Err(Error::Invalid("a TorchScript module is exported already".into()));
        };
        let example = Tensor::zeros([2, self.context as i64], (Kind::Int64, self.device));
        let mut forward = |inputs: &[Tensor]| vec![logits(model.as_ref(), params, &inputs[0])];
        tch::no_grad(|| tch::CModule::create_by_tracing("RegattaGpt", "forward", &[example], &mut forward))
            .map_err(|e| Error::Invalid(format!("cannot trace the model: {e}")))
    }

    /// Token ids of a text as the scorer sees them (at most the context; at least 2 needed).
    pub fn tokenize(&self, text: &str) -> Result<(Vec<i64>, bool)> {
        let mut ids = self.tokenizer.encode(text.as_bytes())?;
        let context = self.context;
        let truncated = ids.len() > context;
        ids.truncate(context);
        if ids.len() < 2 {
            return Err(Error::Invalid(format!(
                "the text has {} token(s); scoring needs at least 2",
                ids.len()
            )));
        }
        Ok((ids, truncated))
    }

    fn logits(&self, batch: &Tensor) -> Result<Tensor> {
        tch::no_grad(|| match &self.net {
            Net::Model { model, params } => Ok(logits(model.as_ref(), params, batch)),
            Net::Script(module) => module
                .forward_ts(&[batch])
                .map_err(|e| Error::Invalid(format!("the TorchScript module failed: {e}"))),
        })
    }

    /// Scores rows already tokenized by [`Scorer::tokenize`], as one batch.
    pub fn score(&self, rows: &[(Vec<i64>, bool)], max_new_tokens: usize) -> Result<Vec<Scored>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let width = rows.iter().map(|(ids, _)| ids.len()).max().unwrap_or(0);
        let mut flat = Vec::with_capacity(rows.len() * width);
        for (ids, _) in rows {
            flat.extend_from_slice(ids);
            flat.extend(std::iter::repeat_n(0, width - ids.len()));
        }
        let batch = Tensor::from_slice(&flat)
            .view([rows.len() as i64, width as i64])
            .to_device(self.device);
        let log_probs = self.logits(&batch)?.log_softmax(-1, Kind::Float);
        // log p(token t+1 | tokens up to t), for every position t < width - 1.
        let next = batch.narrow(1, 1, width as i64 - 1).unsqueeze(-1);
        let picked = log_probs
            .narrow(1, 0, width as i64 - 1)
            .gather(-1, &next, false)
            .squeeze_dim(-1);
        let picked = picked.to_device(Device::Cpu);
        rows.iter()
            .enumerate()
            .map(|(i, (ids, truncated))| {
                let n = ids.len();
                let log_likelihood = picked
                    .get(i as i64)
                    .narrow(0, 0, n as i64 - 1)
                    .sum(Kind::Double)
                    .double_value(&[]);
                Ok(Scored {
                    tokens: n,
                    truncated: *truncated,
                    log_likelihood,
                    perplexity: (-log_likelihood / (n - 1) as f64).exp(),
                    generated: self.generate(ids, max_new_tokens)?,
                })
            })
            .collect()
    }

    /// The token ids of a generation prompt: text as is (after a BOS when the tokenizer
    /// adds one), chat messages through the model's chat template.
    pub fn prompt_ids(&self, prompt: &Prompt) -> std::result::Result<Vec<i64>, RowError> {
        let text = match prompt {
            Prompt::Text(text) => match (&self.settings.bos_token, self.settings.add_bos_token) {
                (Some(bos), true) => format!("{bos}{text}"),
                _ => text.clone(),
            },
            Prompt::Chat(messages) => {
                let messages: Vec<Message> = messages
                    .iter()
                    .map(|m| Message {
                        role: m.role.clone(),
                        content: m.content.clone(),
                    })
                    .collect();
                self.settings.chat_prompt(&messages).map_err(RowError::Chat)?
            }
        };
        self.tokenizer.encode(text.as_bytes()).map_err(RowError::Tokenize)
    }

    /// The generator of this scorer's model under `setup` (the executor keeps one
    /// [`crate::generate::Session`] of it for every row it is sent).
    pub fn generator(&self, setup: &GenerationSetup) -> Result<Generator<'_>> {
        let Net::Model { model, params } = &self.net else {
            return Err(Error::Invalid(
                "generation needs a model folder or checkpoint; a TorchScript module has no KV cache".into(),
            ));
        };
        Generator::new(
            model.as_ref(),
            params,
            setup.clone(),
            self.context,
            self.eos.clone(),
            self.device,
        )
    }

    /// A request ready for a generator: its prompt's token ids, settings and random
    /// stream; or why its prompt cannot be rendered or tokenized.
    pub fn prepare(&self, request: &GenRequest) -> std::result::Result<Prepared, RowError> {
        Ok(Prepared {
            prompt: self.prompt_ids(&request.prompt)?,
            params: request.params.clone(),
            stream: RowStream::new(request.params.seed, &request.id),
        })
    }

    /// Text of token ids.
    pub fn decode(&self, ids: &[i64]) -> String {
        self.tokenizer.decode(ids)
    }

    /// A finished row as it is written: its text up to the first stop string, its counts,
    /// why it ended and, when asked for, its tokens' log-probabilities.
    pub fn generation(&self, request: &GenRequest, prompt_tokens: usize, output: Output) -> Generation {
        let mut text = self.tokenizer.decode(&output.tokens);
        if let Some(cut) = stop_at(&text, &request.params.stop) {
            text.truncate(cut);
        }
        Generation {
            text,
            prompt_tokens: prompt_tokens as u64,
            generated_tokens: output.tokens.len() as u64,
            finish_reason: output.finish.as_str().to_string(),
            logprobs: request.params.logprobs.then_some(output.logprobs),
        }
    }

    /// Greedy continuation of `ids` by up to `max_new_tokens` tokens.
    pub fn generate(&self, ids: &[i64], max_new_tokens: usize) -> Result<String> {
        let context = self.context;
        let mut sequence = ids.to_vec();
        let mut new = Vec::with_capacity(max_new_tokens);
        for _ in 0..max_new_tokens {
            let window = &sequence[sequence.len().saturating_sub(context)..];
            let input = Tensor::from_slice(window)
                .view([1, window.len() as i64])
                .to_device(self.device);
            let logits = self.logits(&input)?;
            let next = logits
                .get(0)
                .get(window.len() as i64 - 1)
                .argmax(0, false)
                .int64_value(&[]);
            sequence.push(next);
            new.push(next);
        }
        Ok(self.tokenizer.decode(&new))
    }
}

/// `eos_token_id` of a `config.json` or `generation_config.json`: one id or a list.
fn eos_ids(json: &serde_json::Value) -> Vec<i64> {
    match json.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(serde_json::Value::Array(list)) => list.iter().filter_map(serde_json::Value::as_i64).collect(),
        _ => Vec::new(),
    }
}

/// The context a `config.json` gives: the GPT's `context`, or a Llama's
/// `max_position_embeddings`.
fn model_context(json: &serde_json::Value) -> Option<usize> {
    ["context", "max_position_embeddings"]
        .iter()
        .find_map(|k| json.get(*k).and_then(serde_json::Value::as_u64))
        .map(|n| n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::seeded;
    use crate::gpt::Gpt;
    use regatta_trainer::ModelConfig;

    fn scorer() -> Scorer {
        scorer_for(None)
    }

    fn scorer_for(generation: Option<&GenerationSetup>) -> Scorer {
        let config = ModelConfig {
            layers: 1,
            width: 16,
            heads: 2,
            context: 12,
            ..ModelConfig::default()
        };
        let gpt = Gpt::new(config, 256);
        let params = gpt
            .blocks()
            .into_iter()
            .map(|block| block.iter().map(|spec| seeded(spec, 5)).collect())
            .collect();
        Scorer::from_model(Box::new(gpt), params, 12, TextTokenizer::Bytes, Device::Cpu, generation)
    }

    /// The strides of the decoder layer's matrices.
    fn matrix_strides(scorer: &Scorer) -> Vec<Vec<i64>> {
        let Net::Model { params, .. } = &scorer.net else {
            unreachable!("a model")
        };
        params[1].iter().filter(|w| w.dim() == 2).map(Tensor::stride).collect()
    }

    #[test]
    fn the_weights_layout_follows_what_the_scorer_is_loaded_for_and_generations_agree() {
        let packed = GenerationSetup {
            kv_cache_bytes: Some(1 << 20),
            max_batch: 4,
            ..GenerationSetup::default()
        };
        let unpacked = GenerationSetup {
            packed_weights: false,
            ..packed.clone()
        };
        let (for_scoring, for_packed, for_unpacked) =
            (scorer(), scorer_for(Some(&packed)), scorer_for(Some(&unpacked)));
        // Stored `[out, in]` row-major where the generator packs the weights (the packer
        // reads them so); transposed for libtorch's `linear` everywhere else.
        let stored = matrix_strides(&for_packed);
        assert!(!stored.is_empty());
        for (stride, laid_out) in stored.iter().zip(matrix_strides(&for_scoring)) {
            assert_eq!(stride[1], 1, "as stored: {stored:?}");
            assert_eq!(laid_out[0], 1, "laid out, transposed: {laid_out:?}");
        }
        assert_eq!(matrix_strides(&for_unpacked), matrix_strides(&for_scoring));

        let rows: Vec<Prepared> = ["hi", "abc", "hey"]
            .iter()
            .enumerate()
            .map(|(i, text)| Prepared {
                prompt: for_scoring.tokenize(text).unwrap().0,
                params: regatta_scorer::SamplingParams {
                    max_new_tokens: 6,
                    logprobs: true,
                    ..Default::default()
                },
                stream: RowStream::new(0, &i.to_string()),
            })
            .collect();
        let generate = |scorer: &Scorer, setup: &GenerationSetup| -> Vec<(Vec<i64>, Vec<f64>)> {
            let generator = scorer.generator(setup).unwrap();
            generator
                .run(&rows, &|_| String::new(), &mut |_| {})
                .unwrap()
                .into_iter()
                .map(|row| row.map(|out| (out.tokens, out.logprobs)).unwrap())
                .collect()
        };
        let want = generate(&for_scoring, &packed);
        assert!(want
            .iter()
            .all(|(tokens, logprobs)| tokens.len() == 6 && logprobs.len() == 6));
        // The same packed matrices from either layout: the same tokens and numbers, exactly.
        assert_eq!(generate(&for_packed, &packed), want);
        // libtorch's own products: the same tokens, numbers up to summation order.
        for ((tokens, logprobs), (want_tokens, want_logprobs)) in generate(&for_unpacked, &unpacked).iter().zip(&want) {
            assert_eq!(tokens, want_tokens);
            for (a, b) in logprobs.iter().zip(want_logprobs) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn padding_in_a_batch_changes_no_score() {
        let s = scorer();
        let rows: Vec<_> = ["hello there", "hi", "a longer text than the context"]
            .iter()
            .map(|t| s.tokenize(t).unwrap())
            .collect();
        assert!(rows[2].1, "the long text is truncated to the context");
        let together = s.score(&rows, 3).unwrap();
        for (row, scored) in rows.iter().zip(&together) {
            let alone = &s.score(std::slice::from_ref(row), 3).unwrap()[0];
            assert!(
                (alone.log_likelihood - scored.log_likelihood).abs() < 1e-4,
                "{alone:?} vs {scored:?}"
            );
            assert_eq!(alone.generated, scored.generated);
            let ppl = (-scored.log_likelihood / (scored.tokens - 1) as f64).exp();
            assert!((scored.perplexity - ppl).abs() < 1e-9 && scored.perplexity > 1.0);
            // Three bytes; invalid UTF-8 among them reads as replacement characters.
            let chars = scored.generated.chars().count();
            assert!(
                (1..=3).contains(&chars),
                "three bytes generated: {:?}",
                scored.generated
            );
        }
        assert!(s.tokenize("x").unwrap_err().to_string().contains("at least 2"));
    }

    #[test]
    fn a_traced_export_scores_like_the_checkpoint_at_any_batch_shape() {
        let s = scorer();
        let module = s.export().unwrap();
        let path = std::env::temp_dir().join(format!("regatta-export-{}.pt", std::process::id()));
        module.save(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let script = Scorer::from_torchscript(&bytes, 12, TextTokenizer::Bytes, Device::Cpu).unwrap();
        // Traced at [2, 12]; scored at other batch sizes and widths.
        let texts = ["hello there", "hi", "a longer text than the context", "abc"];
        let rows: Vec<_> = texts.iter().map(|t| s.tokenize(t).unwrap()).collect();
        for shape in [&rows[..1], &rows[1..2], &rows[..]] {
            let (a, b) = (s.score(shape, 2).unwrap(), script.score(shape, 2).unwrap());
            for (x, y) in a.iter().zip(&b) {
                assert!((x.log_likelihood - y.log_likelihood).abs() < 1e-4, "{x:?} vs {y:?}");
                assert_eq!(x.generated, y.generated);
            }
        }
        assert!(Scorer::from_torchscript(b"junk", 12, TextTokenizer::Bytes, Device::Cpu)
            .err()
            .unwrap()
            .to_string()
            .contains("not a TorchScript module"));
    }
}
