//! `regatta._native`: what the Python package needs from Rust. A [`Cluster`] is a driver's
//! connection (to a local cluster it started, or to a running head); it spawns Python
//! actors ([`regatta::PythonActor`]: one Python process each, on a worker) and calls them
//! with the package's pickles, returning a [`Pending`] the Python side waits on without
//! holding the GIL. Everything else (pickling, refs, errors, `remote`) is Python, in
//! `python/regatta`.

use std::sync::OnceLock;
use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

mod cluster;
mod object;
mod pending;

use cluster::{Cluster, Group};
use object::Object;
use pending::Pending;

/// Python calls have no deadline of their own (as in Ray): a day is "never" for a driver.
const CALL_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("regatta-driver")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start the driver's runtime: {e}"))
    })
}

fn error(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

pyo3::create_exception!(
    _native,
    Infeasible,
    PyRuntimeError,
    "No node could ever hold what an actor, task or placement group asks for."
);

/// A spawn's or a placement group's error: `Infeasible` when no node could ever hold the
/// request (the Python side raises `regatta.exceptions.InfeasibleError` for it).
fn placing_error(e: regatta::Error) -> PyErr {
    match e {
        regatta::Error::Infeasible(why) => Infeasible::new_err(why),
        other => error(other),
    }
}

/// The cluster's certificate authorities (DER; the issuing one first, during a rotation
/// the retiring one too) as the job API at `base` serves them, believed only with the join
/// token's proof of each: what a Python client trusts to check a head without a file.
#[pyfunction]
fn cluster_authorities_der<'py>(py: Python<'py>, base: &str, token: &str) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let authorities = py
        .detach(|| runtime().block_on(regatta::fetch_cluster_authority(base, token)))
        .map_err(error)?;
    Ok(authorities.iter().map(|der| PyBytes::new(py, der.as_ref())).collect())
}

/// Whether this host gives shared memory transparent huge pages: `"never"`, `"advise"`
/// (a large object is copied in through a mapping advised for them) or `"always"` (any
/// write gets them). The put of a large object writes it accordingly.
#[pyfunction]
fn shared_memory_huge_pages() -> &'static str {
    regatta_object_store::SharedHugePages::of_this_host().name()
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Cluster>()?;
    m.add_class::<Pending>()?;
    m.add_class::<Group>()?;
    m.add_class::<Object>()?;
    m.add_class::<object::Held>()?;
    m.add_function(wrap_pyfunction!(cluster_authorities_der, m)?)?;
    m.add_function(wrap_pyfunction!(shared_memory_huge_pages, m)?)?;
    m.add("MAX_FRAME", regatta::PYTHON_MAX_FRAME)?;
    m.add("Infeasible", m.py().get_type::<Infeasible>())?;
    Ok(())
}
