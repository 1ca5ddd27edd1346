//! Lower-case hexadecimal text for bytes (digests, keys, package names), one way and back.

/// `bytes` as lower-case hex digits, two per byte.
pub fn encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of lower-case hex `text` (what [`encode`] writes); `None` for an odd length,
/// or a character that is not `0-9a-f`.
pub fn decode(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_go_to_hex_and_back_and_other_text_is_refused() {
        let bytes = [0u8, 1, 0x7f, 0xab, 0xff];
        assert_eq!(encode(&bytes), "00017fabff");
        assert_eq!(decode("00017fabff").as_deref(), Some(&bytes[..]));
        assert_eq!(decode("").as_deref(), Some(&[][..]));
        for bad in ["0", "zz", "AB", "é0", "0g"] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
