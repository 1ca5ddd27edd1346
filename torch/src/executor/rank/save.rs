//! What a rank's checkpoints hold: its part of the checkpoint of a step, the manifest and
//! the files it lists, and the `best` pointer that follows the lowest validation loss.

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::eval::improves;
use regatta_trainer::FromExecutor;

use super::Rank;
use crate::checkpoint::{self, Manifest, SaveSpec};
use crate::engine::Engine;
use crate::executor::{emit, lost, tokenizer_spec, Failure, SHARD_BYTES};

impl Rank {
    /// The lowest validation loss of the checkpoints an earlier attempt wrote (with
    /// `checkpoint.keep_best`, when resuming).
    pub(super) fn earlier_best(&self) -> Result<Option<f64>, Failure> {
        let (Some(place), true) = (&self.place, self.config.checkpoint.keep_best && self.resume) else {
            return Ok(None);
        };
        let best = self.runtime.block_on(checkpoint::best(place))?;
        Ok(best.and_then(|m| m.eval_loss))
    }

    /// Writes the checkpoint of step `done` to `place` (a collective: every rank calls it)
    /// with this rank's `loader` state; rank 0 points `best` at it when `eval_loss` is the
    /// lowest so far (with `keep_best`) and reports it.
    pub(super) fn save(
        &self,
        engine: &mut Engine,
        done: u64,
        place: &Place,
        loader: Option<(String, Bytes)>,
        eval_loss: Option<f64>,
    ) -> Result<(), Failure> {
        let spec = SaveSpec {
            manifest: self.manifest(engine, done, eval_loss),
            side_files: &self.side_files,
            shard_bytes: SHARD_BYTES,
            loader,
            weights_kind: self.weights_kind,
        };
        let url = checkpoint::save(&self.runtime, place, engine, self.rank, self.world, spec)?;
        let is_best = self.config.checkpoint.keep_best && eval_loss.is_some_and(|loss| improves(self.best.get(), loss));
        if is_best {
            self.best.set(eval_loss);
        }
        if self.rank == 0 {
            if is_best {
                let pointer = Bytes::from(checkpoint::step_dir(done));
                self.runtime
                    .block_on(place.put(checkpoint::BEST, pointer))
                    .map_err(|e| lost(format!("cannot write the best-checkpoint pointer: {e}")))?;
            }
            emit(&FromExecutor::Checkpoint {
                step: done,
                url,
                best: is_best,
            });
        }
        Ok(())
    }

    /// The manifest of the checkpoint at step `done`.
    fn manifest(&self, engine: &Engine, done: u64, eval_loss: Option<f64>) -> Manifest {
        let (config, world) = (&self.config, self.world);
        Manifest {
            step: done,
            world,
            zero_stage: config.zero_stage,
            model: config.model.clone(),
            vocab: self.vocab,
            tokenizer: tokenizer_spec(config),
            params: engine.parameter_count(),
            positions: vec![done * self.per_rank as u64; world],
            loader_files: if config.streaming() {
                (0..world).map(|r| checkpoint::loader_file(r, world)).collect()
            } else {
                Vec::new()
            },
            files: self.checkpoint_files(),
            data: config.data.clone(),
            lora: config.lora.clone(),
            micro_batch_size: config.micro_batch_size,
            gradient_accumulation: config.gradient_accumulation,
            eval_loss,
        }
    }

    /// The files the manifest lists: every rank's optimizer shard (and loader state when
    /// streaming), the model's `config.json` or the LoRA adapter's files, and itself.
    fn checkpoint_files(&self) -> Vec<String> {
        let (config, world) = (&self.config, self.world);
        let streaming = config.streaming();
        (0..world)
            .map(|r| format!("optim-rank-{r}-of-{world}.safetensors"))
            .chain(
                (0..world)
                    .filter(|_| streaming)
                    .map(|r| checkpoint::loader_file(r, world)),
            )
            .chain(match &config.lora {
                None => vec!["config.json".to_string()],
                Some(lora) => {
                    let mut files = vec![
                        regatta_trainer::ADAPTER_CONFIG.to_string(),
                        regatta_trainer::ADAPTER_WEIGHTS.to_string(),
                    ];
                    if lora.merge_on_save {
                        files.push(format!("{}/config.json", checkpoint::MERGED));
                    }
                    files
                }
            })
            .chain(["manifest.json".to_string()])
            .collect()
    }
}
