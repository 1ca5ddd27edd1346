//! Resource sets: named amounts such as `CPU=8`, `GPU=2`, `memory=1e9` and free-form tags
//! such as `accelerator_type:H100=1`.
//!
//! Amounts are fixed point (1/10000 of a unit) so that fractional requests add and subtract
//! exactly: ten actors asking for `GPU=0.1` fill one GPU, never 0.9999.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub use crate::fixed::{format_fixed, UNIT};

/// The amount a request gets for a bare name (`accelerator_type:H100`): enough to require
/// that the node has the tag, small enough that thousands of actors can share it.
pub const BARE_REQUEST: u64 = 10;

/// The name of the GPU resource, whose units are whole devices with indices.
pub const GPU: &str = "GPU";

/// A set of named resource amounts, in fixed point ([`UNIT`] per whole unit). Serialized
/// as a map of whole units (`{"CPU": 0.5}`), which round-trips exactly.
///
/// A clone shares the map (copied on the first change): the head keeps one request per
/// actor and one allocation per placement, and actors of one shape share theirs (see the
/// scheduler's interning), so 100,000 actors do not hold 200,000 maps.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Resources(Arc<BTreeMap<String, u64>>);

impl Serialize for Resources {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.to_units().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Resources {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let units = BTreeMap::<String, f64>::deserialize(deserializer)?;
        let mut set = Resources::new();
        for (name, amount) in units {
            if !amount.is_finite() || amount < 0.0 {
                return Err(serde::de::Error::custom(format!(
                    "resource {name} has amount {amount}; must be >= 0"
                )));
            }
            set.set(&name, amount);
        }
        Ok(set)
    }
}

impl Resources {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses a request such as `CPU=1,GPU=0.5,accelerator_type:H100`: a bare name asks only
    /// that the node carries it.
    pub fn parse_request(text: &str) -> Result<Self> {
        Self::parse(text, BARE_REQUEST)
    }

    /// Parses a node's capacity such as `CPU=8,GPU=2,accelerator_type:H100=1`: a bare name
    /// counts as one unit.
    pub fn parse_capacity(text: &str) -> Result<Self> {
        Self::parse(text, UNIT)
    }

    fn parse(text: &str, bare: u64) -> Result<Self> {
        let mut set = Self::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, amount) = match item.split_once('=') {
                Some((name, value)) => (name.trim(), parse_amount(item, value.trim())?),
                None => (item, bare),
            };
            if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c == '=') {
                return Err(Error::BadResources {
                    input: text.to_string(),
                    reason: format!("'{item}' has no valid name; write NAME=AMOUNT"),
                });
            }
            if Arc::make_mut(&mut set.0).insert(name.to_string(), amount).is_some() {
                return Err(Error::BadResources {
                    input: text.to_string(),
                    reason: format!("'{name}' is given twice"),
                });
            }
        }
        Ok(set)
    }

    /// Builds a set from whole-unit pairs, e.g. `[("CPU", 2.0)]`.
    pub fn from_units<'a>(pairs: impl IntoIterator<Item = (&'a str, f64)>) -> Self {
        Self(Arc::new(
            pairs
                .into_iter()
                .map(|(name, units)| (name.to_string(), to_fixed(units)))
                .collect(),
        ))
    }

    /// Sets `name` to `units` whole units, replacing any earlier amount.
    pub fn set(&mut self, name: &str, units: f64) {
        Arc::make_mut(&mut self.0).insert(name.to_string(), to_fixed(units));
    }

    /// Sets `name` to a fixed-point amount.
    pub fn set_fixed(&mut self, name: &str, amount: u64) {
        Arc::make_mut(&mut self.0).insert(name.to_string(), amount);
    }

    /// The fixed-point amount of `name` (0 when absent).
    pub fn fixed(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    /// The amount of `name` in units (0 when absent).
    pub fn units(&self, name: &str) -> f64 {
        self.fixed(name) as f64 / UNIT as f64
    }

    /// Iterates `(name, fixed-point amount)` pairs in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> {
        self.0.iter().map(|(name, amount)| (name.as_str(), *amount))
    }

    /// Whether the set names nothing (or only zero amounts).
    pub fn is_empty(&self) -> bool {
        self.0.values().all(|amount| *amount == 0)
    }

    /// Whether every amount in `request` is available here.
    pub fn covers(&self, request: &Resources) -> bool {
        request.iter().all(|(name, amount)| self.fixed(name) >= amount)
    }

    /// Adds every amount of `other`.
    pub fn add(&mut self, other: &Resources) {
        let map = Arc::make_mut(&mut self.0);
        for (name, amount) in other.iter() {
            match map.get_mut(name) {
                Some(entry) => *entry += amount,
                None => {
                    map.insert(name.to_string(), amount);
                }
            }
        }
    }

    /// Subtracts every amount of `other`; the caller has checked [`Resources::covers`].
    pub fn subtract(&mut self, other: &Resources) {
        let map = Arc::make_mut(&mut self.0);
        for (name, amount) in other.iter() {
            match map.get_mut(name) {
                Some(entry) => *entry = entry.saturating_sub(amount),
                None => {
                    map.insert(name.to_string(), 0);
                }
            }
        }
    }

    /// Overrides this set's amounts with those in `other`.
    pub fn override_with(&mut self, other: &Resources) {
        let map = Arc::make_mut(&mut self.0);
        for (name, amount) in other.iter() {
            map.insert(name.to_string(), amount);
        }
    }

    /// Whether this set and `other` are one shared map (not merely equal).
    #[cfg(test)]
    pub(crate) fn shares_map_with(&self, other: &Resources) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Whole-unit view for display and JSON.
    pub fn to_units(&self) -> BTreeMap<String, f64> {
        self.0
            .iter()
            .map(|(name, amount)| (name.clone(), *amount as f64 / UNIT as f64))
            .collect()
    }
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (name, amount) in self.iter() {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{name}={}", format_fixed(amount))?;
        }
        Ok(())
    }
}

fn to_fixed(units: f64) -> u64 {
    (units * UNIT as f64).round().max(0.0) as u64
}

fn parse_amount(item: &str, value: &str) -> Result<u64> {
    let units: f64 = value.parse().map_err(|_| Error::BadResources {
        input: item.to_string(),
        reason: format!("amount '{value}' is not a number"),
    })?;
    if !units.is_finite() || units < 0.0 {
        return Err(Error::BadResources {
            input: item.to_string(),
            reason: format!("amount '{value}' must be a finite number >= 0"),
        });
    }
    if units > 1e15 {
        return Err(Error::BadResources {
            input: item.to_string(),
            reason: format!("amount '{value}' is too large"),
        });
    }
    Ok(to_fixed(units))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_capacity_with_tags() {
        let set = Resources::parse_capacity("CPU=8, GPU=2,accelerator_type:H100=1").unwrap();
        assert_eq!(set.fixed("CPU"), 8 * UNIT);
        assert_eq!(set.fixed("GPU"), 2 * UNIT);
        assert_eq!(set.fixed("accelerator_type:H100"), UNIT);
        assert_eq!(set.to_string(), "CPU=8,GPU=2,accelerator_type:H100=1");
    }

    #[test]
    fn bare_name_in_request_only_requires_presence() {
        let set = Resources::parse_request("GPU=0.5,accelerator_type:H100").unwrap();
        assert_eq!(set.fixed("accelerator_type:H100"), BARE_REQUEST);
        assert_eq!(set.fixed("GPU"), UNIT / 2);
    }

    #[test]
    fn rejects_bad_amounts_and_duplicates() {
        for bad in ["CPU=abc", "CPU=-1", "CPU=inf", "CPU=1,CPU=2", "=3", "CPU=NaN"] {
            let err = Resources::parse_request(bad).unwrap_err().to_string();
            assert!(err.contains("resource"), "{bad}: {err}");
        }
    }

    #[test]
    fn serialized_form_is_whole_units_and_round_trips() {
        let set = Resources::parse_capacity("CPU=0.5,memory=25276514304,accelerator_type:H100=0.001").unwrap();
        let bytes = bincode::serialize(&set).unwrap();
        assert_eq!(bincode::deserialize::<Resources>(&bytes).unwrap(), set);
        let text = format!("{:?}", set.to_units());
        assert!(text.contains("\"CPU\": 0.5"), "{text}");
    }

    #[test]
    fn fractional_amounts_add_up_exactly() {
        let tenth = Resources::parse_request("GPU=0.1").unwrap();
        let mut sum = Resources::new();
        for _ in 0..10 {
            sum.add(&tenth);
        }
        assert_eq!(sum.fixed("GPU"), UNIT);
        assert_eq!(format_fixed(UNIT / 1000 * 1), "0.001");
    }
}
