//! Lower-case hex for the short binary values that travel as text: ring secrets, host keys
//! in ring addresses, NCCL ids.

/// `bytes` as lower-case hex.
pub fn encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a hex string; `None` for an odd length or a non-hex digit.
pub fn decode(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_malformed_text() {
        let bytes = [0u8, 1, 0xab, 0xff];
        assert_eq!(encode(&bytes), "0001abff");
        assert_eq!(decode("0001abff").unwrap(), bytes);
        assert_eq!(decode("").unwrap(), Vec::<u8>::new());
        for bad in ["abc", "zz", "0g", "é1"] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
