//! The one error type of the pure core: input that does not parse into its typed value, or
//! that breaks a rule the core keeps (whole GPUs, a job's id, a run's name).

use crate::fixed::format_fixed;
use crate::object::ObjectId;

/// What the pure core refuses, each with the input that caused it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A resource string could not be parsed.
    #[error("bad resource list '{input}': {reason}")]
    BadResources {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A view query (page, filter) that cannot be answered as asked.
    #[error("bad query: {0}")]
    BadQuery(String),
    /// A placement strategy that is not one of Ray's four.
    #[error("unknown placement strategy '{input}'; use PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")]
    UnknownStrategy {
        /// The name given.
        input: String,
    },
    /// A request for more than one GPU that is not a whole number of them.
    #[error(
        "GPU={} is not allowed: ask for a fraction of one GPU (below 1) or a whole number",
        format_fixed(*.gpu)
    )]
    GpuRequestNotWhole {
        /// The amount asked for, in fixed point ([`crate::UNIT`] = one GPU).
        gpu: u64,
    },
    /// A node that declares a fraction of a GPU.
    #[error("GPU={} is not allowed on a node: declare whole GPUs", format_fixed(*.gpu))]
    NodeGpuNotWhole {
        /// The amount declared, in fixed point ([`crate::UNIT`] = one GPU).
        gpu: u64,
    },
    /// A node that declares more GPUs than one node may have.
    #[error("GPU={} is more than {max} GPUs on one node; declare the real count", format_fixed(*.gpu))]
    TooManyGpus {
        /// The amount declared, in fixed point ([`crate::UNIT`] = one GPU).
        gpu: u64,
        /// The most whole GPUs a node may declare.
        max: u64,
    },
    /// A run report whose run name is empty or too long, or whose kind is too long.
    #[error("run name must be 1 to {max} bytes and its kind at most {max} (got {run:?})")]
    BadRunName {
        /// The start of the run name given (its first 40 characters).
        run: String,
        /// The most bytes a run name or kind may have.
        max: usize,
    },
    /// Text that is not an object id.
    #[error("'{input}' is not an object id (32 hex digits)")]
    BadObjectId {
        /// The text given.
        input: String,
    },
    /// An object id registered again with a different size or checksum.
    #[error("object {id} already exists")]
    ObjectExists {
        /// The object.
        id: ObjectId,
    },
    /// A `runtime_env` key Regatta does not carry out.
    #[error("runtime_env.{key} is not supported: {why}; supported keys are {}", supported.join(", "))]
    UnsupportedRuntimeEnv {
        /// The key given.
        key: String,
        /// Why Regatta does not carry it out, and what to do instead.
        why: &'static str,
        /// The keys Regatta carries out.
        supported: &'static [&'static str],
    },
    /// A job submission with no command line.
    #[error("entrypoint is empty; give the driver's command line")]
    EmptyEntrypoint,
    /// A job's environment variable that cannot be set.
    #[error("runtime_env.env_vars has an invalid entry '{name}'")]
    BadEnvVar {
        /// The variable's name.
        name: String,
    },
    /// A job submission placing its driver by node labels.
    #[error(
        "entrypoint_label_selector is not supported: place the driver with entrypoint_resources (e.g. a node's custom resource)"
    )]
    LabelSelectorUnsupported,
    /// A `working_dir` or `py_modules` URI that is neither a path nor an uploaded package.
    #[error(
        "runtime_env package '{uri}' is not supported: give a folder (the client uploads it as {scheme}...) or a path on the node"
    )]
    UnsupportedPackage {
        /// The URI given.
        uri: String,
        /// The scheme of uploaded packages.
        scheme: &'static str,
    },
    /// A `py_modules` entry that is not an uploaded package.
    #[error(
        "runtime_env.py_modules takes uploaded packages ({scheme}...): give local folders to the client, which uploads them"
    )]
    PyModuleNotUploaded {
        /// The entry given.
        module: String,
        /// The scheme of uploaded packages.
        scheme: &'static str,
    },
    /// A job's resource amount that is negative or not finite.
    #[error("resource amount {amount} must be a finite number >= 0")]
    BadAmount {
        /// The amount given.
        amount: f64,
    },
    /// A job id that cannot be a file name.
    #[error(
        "submission_id '{id}' is not allowed: use 1 to {max} letters, digits, '-', '_' or '.', not starting with '.'"
    )]
    BadJobId {
        /// The id given.
        id: String,
        /// The most bytes an id may have.
        max: usize,
    },
}

/// The pure core's result type.
pub type Result<T> = std::result::Result<T, Error>;
