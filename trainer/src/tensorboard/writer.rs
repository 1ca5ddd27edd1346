//! The driver's TensorBoard writer: a run's steps and validations as scalars in one events
//! file under `[logging] tensorboard` (a directory or an object-store URL). The whole file
//! is put again at most every few seconds (object stores do not append) and at the end.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use regatta_object_store::{Place, PlaceError};
use tokio::task::JoinHandle;

use super::{file_name, EventFile};
use crate::error::Error;
use crate::group::TrainEvent;

/// Least time between two puts of the file while a run goes on.
const PUT_EVERY: Duration = Duration::from_secs(5);

/// One run's events file.
pub struct TensorBoardWriter {
    place: Place,
    name: String,
    file: EventFile,
    last_put: Instant,
    in_flight: Option<JoinHandle<Result<(), PlaceError>>>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl TensorBoardWriter {
    /// Starts a file in `dir` and writes its first record, so a directory that cannot be
    /// written fails the run before it trains.
    pub async fn create(dir: &str) -> Result<Self, Error> {
        let fail = |e: PlaceError| Error::Fatal(format!("logging.tensorboard: {e}"));
        let place = Place::dir(dir).map_err(fail)?;
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let wall = now();
        let writer = Self {
            name: file_name(wall, &host, std::process::id()),
            place,
            file: EventFile::new(wall),
            last_put: Instant::now(),
            in_flight: None,
        };
        writer
            .place
            .put(&writer.name, Bytes::copy_from_slice(writer.file.bytes()))
            .await
            .map_err(fail)?;
        Ok(writer)
    }

    /// The file's URL.
    pub fn url(&self) -> String {
        format!("{}/{}", self.place.url().trim_end_matches('/'), self.name)
    }

    /// Adds an event's scalars (steps and validations; other events have none), putting
    /// the file in the background when the last put is old enough and done.
    pub fn record(&mut self, event: &TrainEvent) {
        let scalars = match event {
            TrainEvent::Step(s) => {
                let mut scalars = vec![
                    ("train/loss", s.loss),
                    ("train/learning_rate", s.lr),
                    ("train/grad_norm", s.grad_norm),
                    ("train/tokens_per_sec", s.tokens_per_sec),
                    ("train/step_secs", s.step_secs),
                    (
                        "train/bytes_per_rank",
                        (s.param_bytes + s.grad_bytes + s.optimizer_bytes) as f64,
                    ),
                ];
                if let Some(mfu) = s.mfu {
                    scalars.push(("train/mfu", mfu));
                }
                (s.step, scalars)
            }
            TrainEvent::Eval(e) => (e.step, vec![("eval/loss", e.loss), ("eval/perplexity", e.perplexity())]),
            _ => return,
        };
        self.file.scalars(now(), scalars.0, &scalars.1);
        let idle = self.in_flight.as_ref().is_none_or(JoinHandle::is_finished);
        if idle && self.last_put.elapsed() >= PUT_EVERY {
            self.last_put = Instant::now();
            let (place, name) = (self.place.clone(), self.name.clone());
            let bytes = Bytes::copy_from_slice(self.file.bytes());
            let earlier = self
                .in_flight
                .replace(tokio::spawn(async move { place.put(&name, bytes).await }));
            if let Some(Ok(Err(e))) = earlier.and_then(futures::FutureExt::now_or_never) {
                tracing::warn!("logging.tensorboard: {e} (tried again at the next put)");
            }
        }
    }

    /// Puts the whole file a last time (after any put still under way); returns its URL.
    pub async fn finish(mut self) -> Result<String, Error> {
        if let Some(handle) = self.in_flight.take() {
            let _ = handle.await;
        }
        self.place
            .put(&self.name, Bytes::copy_from_slice(self.file.bytes()))
            .await
            .map_err(|e| Error::Fatal(format!("logging.tensorboard: {e}")))?;
        Ok(self.url())
    }
}
