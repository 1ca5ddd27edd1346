//! How an NCCL communicator is set up: the join and collective timeouts (defaults and
//! environment) and the non-blocking `ncclConfig_t` a join passes.

use std::time::Duration;

use cudarc::nccl::sys;

use crate::error::{Error, Result};

/// How long a rank waits for the group to form, and for one collective to complete,
/// before it aborts the communicator and fails with the cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclTimeouts {
    /// For every rank to join (`REGATTA_NCCL_JOIN_TIMEOUT_SECS`, default 300).
    pub join: Duration,
    /// For the collectives issued before a settle to complete
    /// (`REGATTA_NCCL_TIMEOUT_SECS`, default 600, as PyTorch's process groups).
    pub collective: Duration,
}

impl Default for NcclTimeouts {
    fn default() -> Self {
        Self {
            join: Duration::from_secs(300),
            collective: Duration::from_secs(600),
        }
    }
}

impl NcclTimeouts {
    /// The defaults, with the environment's settings where given (whole seconds, > 0).
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let defaults = Self::default();
        let read = |name: &str, default: Duration| match get(name) {
            None => Ok(default),
            Some(text) => match text.trim().parse::<u64>() {
                Ok(secs) if secs > 0 => Ok(Duration::from_secs(secs)),
                _ => Err(Error::Invalid(format!(
                    "{name} must be a whole number of seconds above 0, not {text:?}"
                ))),
            },
        };
        Ok(Self {
            join: read("REGATTA_NCCL_JOIN_TIMEOUT_SECS", defaults.join)?,
            collective: read("REGATTA_NCCL_TIMEOUT_SECS", defaults.collective)?,
        })
    }
}

/// NCCL_CONFIG_INITIALIZER with `blocking = 0`, for the library version `version` (every
/// other field left undefined: NCCL's defaults).
pub(super) fn nonblocking_config(version: i32) -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: version as u32,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_default_and_read_whole_seconds_from_the_environment() {
        let none = NcclTimeouts::from_lookup(|_| None).unwrap();
        assert_eq!(none, NcclTimeouts::default());
        assert_eq!(none.collective, Duration::from_secs(600));
        let set =
            NcclTimeouts::from_lookup(|name| (name == "REGATTA_NCCL_JOIN_TIMEOUT_SECS").then(|| " 5 ".to_string()))
                .unwrap();
        assert_eq!(set.join, Duration::from_secs(5));
        assert_eq!(set.collective, Duration::from_secs(600));
        for bad in ["0", "-3", "1.5", "soon", ""] {
            let error =
                NcclTimeouts::from_lookup(|name| (name == "REGATTA_NCCL_TIMEOUT_SECS").then(|| bad.to_string()))
                    .expect_err(bad);
            assert!(
                error
                    .to_string()
                    .contains("REGATTA_NCCL_TIMEOUT_SECS must be a whole number"),
                "{error}"
            );
        }
    }

    #[test]
    fn the_nonblocking_config_is_nccls_initializer_with_blocking_off() {
        let config = nonblocking_config(22809);
        assert_eq!(config.magic, 0xcafe_beef);
        assert_eq!(config.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(config.version, 22809);
        assert_eq!(config.blocking, 0);
        // Undefined fields keep NCCL's defaults (NCCL_CONFIG_UNDEF_INT), not zero CTAs.
        assert_eq!(
            (config.minCTAs, config.maxCTAs, config.cgaClusterSize),
            (i32::MIN, i32::MIN, i32::MIN)
        );
        assert!(config.netName.is_null() && config.commName.is_null());
    }
}
