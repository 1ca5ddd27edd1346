//! Object ids: 128 random bits, printed as 32 hex digits.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// A cluster-wide object id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectId(pub u128);

impl ObjectId {
    /// A fresh random id.
    pub fn random() -> Self {
        let mut bytes = [0u8; 16];
        // The OS random source failing is not recoverable and not input-driven.
        getrandom::getrandom(&mut bytes).expect("the OS random source is available");
        Self(u128::from_le_bytes(bytes))
    }

    /// The id as 16 bytes (for the transfer protocol).
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }

    /// The id from 16 bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(u128::from_le_bytes(bytes))
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for ObjectId {
    type Err = Error;
    fn from_str(text: &str) -> Result<Self, Error> {
        u128::from_str_radix(text, 16)
            .map(Self)
            .map_err(|_| Error::BadObjectId {
                input: text.to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_text_and_bytes() {
        let id = ObjectId::random();
        assert_eq!(id.to_string().parse::<ObjectId>().unwrap(), id);
        assert_eq!(ObjectId::from_bytes(id.to_bytes()), id);
        assert_ne!(ObjectId::random(), id);
        assert!("xyz".parse::<ObjectId>().is_err());
    }
}
