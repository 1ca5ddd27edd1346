//! A call in flight: the slot its answer lands in (a result that went through the object
//! store held from the moment the answer came), waited on from Python without the GIL.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use regatta::{ObjectId, ObjectRef};

use crate::object::Object;

/// The object a call's answer names when its result went through the object store: the
/// answer is `R` + the object's id, after the optional `L` section of what the call printed
/// (`L`, pid and length as 4-byte big-endian numbers, the text).
fn stored_result(answer: &[u8]) -> Option<ObjectId> {
    let rest = match answer.first() {
        Some(b'L') => {
            let length = u32::from_be_bytes(answer.get(5..9)?.try_into().ok()?) as usize;
            answer.get(9usize.checked_add(length)?..)?
        }
        _ => answer,
    };
    let id = rest.strip_prefix(b"R")?;
    std::str::from_utf8(id).ok()?.parse().ok()
}

/// Ends a call: a result stored in the object store is held by this driver from the
/// moment the answer arrives (the worker that stored it lets go of it after answering),
/// until the Python side has read it.
pub(crate) async fn settle(cluster: &regatta::Cluster, slot: &Slot, result: regatta::Result<Vec<u8>>) {
    let held = match &result {
        Ok(answer) => match stored_result(answer) {
            Some(id) => {
                let reference = ObjectRef::<bytes::Bytes>::from_id(id);
                match cluster.adopt(&reference).await {
                    Ok(()) => Some(reference),
                    Err(e) => {
                        let message = format!("the call's result (object {id}) could not be held: {e}");
                        slot.set(("error".into(), message.into_bytes()), None);
                        return;
                    }
                }
            }
            None => None,
        },
        Err(_) => None,
    };
    slot.set(outcome(result), held);
}

/// How a call ended, as the Python side sorts it: `ok` (the process's answer), `dead` (the
/// actor is gone for good: its constructor failed, its node died, it was killed),
/// `failed` (its process died during the call; the actor may have restarted), `error`
/// (anything else: the message).
fn outcome(result: regatta::Result<Vec<u8>>) -> (String, Vec<u8>) {
    match result {
        Ok(bytes) => ("ok".into(), bytes),
        // `dead/<why>`: the cause's label (`regatta.exceptions.ActorDiedError.cause`).
        Err(regatta::Error::ActorDead { cause, .. }) => {
            (format!("dead/{}", cause.label()), cause.to_string().into_bytes())
        }
        Err(regatta::Error::Remote { message, .. }) => ("failed".into(), message.into_bytes()),
        Err(e) => ("error".into(), e.to_string().into_bytes()),
    }
}

pub(crate) struct Slot {
    value: Mutex<Option<(String, Vec<u8>)>>,
    /// The result's object, for a result stored in the object store.
    held: Mutex<Option<ObjectRef<bytes::Bytes>>>,
    ready: Condvar,
    /// The calls of its actor in flight, this one counted until its answer is in.
    in_flight: Arc<AtomicUsize>,
}

impl Slot {
    /// The slot of a call counted in `in_flight` (its actor's calls in flight).
    pub(crate) fn counted(in_flight: Arc<AtomicUsize>) -> Self {
        in_flight.fetch_add(1, Ordering::AcqRel);
        Self {
            value: Mutex::default(),
            held: Mutex::default(),
            ready: Condvar::new(),
            in_flight,
        }
    }

    fn set(&self, value: (String, Vec<u8>), held: Option<ObjectRef<bytes::Bytes>>) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = held;
        // Counted out before the caller can see the answer: its next call finds the actor idle.
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        let mut slot = self.value.lock().unwrap_or_else(|p| p.into_inner());
        *slot = Some(value);
        self.ready.notify_all();
    }
}

/// A call in flight.
#[pyclass(module = "regatta._native")]
pub(crate) struct Pending {
    pub(crate) slot: Arc<Slot>,
}

#[pymethods]
impl Pending {
    /// Whether the answer is in.
    fn done(&self) -> bool {
        self.slot.value.lock().map(|v| v.is_some()).unwrap_or(true)
    }

    /// `(kind, payload)` once the call ended, or None after `timeout` seconds.
    #[pyo3(signature = (timeout=None))]
    fn result<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
        if let Some(t) = timeout {
            if !t.is_finite() || t < 0.0 {
                return Err(PyValueError::new_err(format!("timeout must be a number >= 0, not {t}")));
            }
        }
        let slot = self.slot.clone();
        let value = py.detach(move || {
            let guard = slot.value.lock().unwrap_or_else(|p| p.into_inner());
            let guard = match timeout {
                None => slot
                    .ready
                    .wait_while(guard, |v| v.is_none())
                    .unwrap_or_else(|p| p.into_inner()),
                Some(t) => {
                    slot.ready
                        .wait_timeout_while(guard, Duration::from_secs_f64(t), |v| v.is_none())
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
            guard.clone()
        });
        Ok(value.map(|(kind, bytes)| (kind, PyBytes::new(py, &bytes))))
    }

    /// The object holding the call's result when it went through the object store (an
    /// answer `R` + id), held since the answer came.
    fn stored(&self) -> Option<Object> {
        let held = self.slot.held.lock().unwrap_or_else(|p| p.into_inner());
        held.clone().map(|reference| Object { reference })
    }
}
