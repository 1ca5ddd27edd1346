//! CRC-32 over objects and chunks: cheap enough for multi-GB objects (crc32fast uses SIMD),
//! and it catches corruption in transfer and in spilled copies. TLS already guards
//! against tampering in transit.

/// CRC-32 of `bytes`.
pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}
