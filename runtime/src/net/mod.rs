//! The network layer: this process as a `ractor_cluster` node (sessions, process groups),
//! the wire codec every remote actor speaks, the link to the head, the cluster token and
//! the small HTTP helpers.

pub(crate) mod calls;
pub(crate) mod headlink;
pub(crate) mod http;
pub(crate) mod https;
pub(crate) mod node;
pub(crate) mod session_tls;
pub(crate) mod token;
pub(crate) mod trust;
pub(crate) mod wire;
