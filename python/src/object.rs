//! An object in the cluster's object store, as the Python side holds it.

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
