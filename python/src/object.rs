//! An object in the cluster's object store, as the Python side holds it.

use bytes::Bytes;
use pyo3::prelude::*;
use regatta::ObjectRef;

/// An object in the cluster's object store, held while this lives (and, once it is
/// dropped everywhere, kept a grace period for references in flight).
#[pyclass(module = "regatta._native")]
pub(crate) struct Object {
    pub(crate) reference: ObjectRef<bytes::Bytes>,
}

#[pymethods]
impl Object {
    /// The object's id (what travels when a reference is sent).
    #[getter]
    fn id(&self) -> String {
        self.reference.id().to_string()
    }
}

/// A large object's bytes as this process's store holds them (its shared-memory mapping,
/// or the buffer a transfer received into), lent to Python without a copy: Python views
/// them through a `ctypes` array at [`Held::address`] that keeps this alive, since the
/// stable ABI of Python 3.10 has no buffer protocol for a native class. The bytes never
/// change and stay where they are while this lives, whatever the store does meanwhile.
#[pyclass(module = "regatta._native", frozen)]
pub(crate) struct Held {
    pub(crate) bytes: Bytes,
}

#[pymethods]
impl Held {
    /// Where the first byte is, in this process.
    #[getter]
    fn address(&self) -> usize {
        self.bytes.as_ptr() as usize
    }

    fn __len__(&self) -> usize {
        self.bytes.len()
    }
}
