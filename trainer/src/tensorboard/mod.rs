//! TensorBoard event files: the `[logging]` section and the bytes of an events file
//! (TFRecord framing with masked CRC-32C, `tensorflow.Event` protobufs holding scalar
//! summaries), written by the driver as steps and validations arrive. This module is pure;
//! [`writer`] puts the bytes where `[logging] tensorboard` says.

use serde::{Deserialize, Serialize};

pub mod writer;

pub use writer::TensorBoardWriter;

/// `[logging]`: where a run's logs go besides the step lines.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoggingConfig {
    /// A directory or object-store URL for TensorBoard event files (`tensorboard --logdir`
    /// reads it); empty: none.
    pub tensorboard: String,
}

/// An events file being written: the records so far.
#[derive(Clone, Debug, Default)]
pub struct EventFile {
    bytes: Vec<u8>,
}

impl EventFile {
    /// A file that starts with the version record TensorBoard expects first.
    pub fn new(wall_time: f64) -> Self {
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time);
        put_bytes(&mut event, 3, b"brain.Event:2");
        let mut file = Self::default();
        file.record(&event);
        file
    }

    /// Appends one event holding `scalars` (tag and value) at `step`.
    pub fn scalars(&mut self, wall_time: f64, step: u64, scalars: &[(&str, f64)]) {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut entry = Vec::new();
            put_bytes(&mut entry, 1, tag.as_bytes());
            put_key(&mut entry, 2, 5);
            entry.extend_from_slice(&(*value as f32).to_le_bytes());
            put_bytes(&mut summary, 1, &entry);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time);
        put_key(&mut event, 2, 0);
        put_varint(&mut event, step);
        put_bytes(&mut event, 5, &summary);
        self.record(&event);
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// TFRecord framing: length, its masked CRC, the data, its masked CRC.
    fn record(&mut self, data: &[u8]) {
        let length = (data.len() as u64).to_le_bytes();
        self.bytes.extend_from_slice(&length);
        self.bytes.extend_from_slice(&masked_crc(&length).to_le_bytes());
        self.bytes.extend_from_slice(data);
        self.bytes.extend_from_slice(&masked_crc(data).to_le_bytes());
    }
}

/// An events file's name: TensorBoard reads files whose names hold `tfevents`.
pub fn file_name(wall_time: f64, host: &str, pid: u32) -> String {
    format!("events.out.tfevents.{}.{host}.{pid}.regatta", wall_time as u64)
}

fn put_key(out: &mut Vec<u8>, field: u64, wire: u64) {
    put_varint(out, field << 3 | wire);
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_double(out: &mut Vec<u8>, field: u64, value: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, value: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, value.len() as u64);
    out.extend_from_slice(value);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78).
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut crc = i as u32;
            let mut bit = 0;
            while bit < 8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0x82f6_3b78
                } else {
                    crc >> 1
                };
                bit += 1;
            }
            table[i] = crc;
            i += 1;
        }
        table
    };
    !data.iter().fold(!0u32, |crc, byte| {
        TABLE[((crc ^ u32::from(*byte)) & 0xff) as usize] ^ (crc >> 8)
    })
}

/// TFRecord's masked CRC: rotated and offset so a CRC of CRCs is not trivial.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_its_check_values() {
        // The CRC catalogue's check value, and RFC 3720's 32 bytes of zeros.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
    }

    /// Reads the records back by their framing, checking both CRCs.
    fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let length: [u8; 8] = bytes[at..at + 8].try_into().unwrap();
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc(&length));
            let n = u64::from_le_bytes(length) as usize;
            let data = &bytes[at + 12..at + 12 + n];
            let crc = u32::from_le_bytes(bytes[at + 12 + n..at + 16 + n].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            out.push(data.to_vec());
            at += 16 + n;
        }
        out
    }

    #[test]
    fn events_are_framed_records_of_version_then_scalars() {
        let mut file = EventFile::new(1.5);
        file.scalars(2.0, 300, &[("train/loss", 0.5)]);
        let records = records(file.bytes());
        assert_eq!(records.len(), 2);
        // wall_time 1.5, file_version "brain.Event:2".
        let mut version = vec![0x09];
        version.extend_from_slice(&1.5f64.to_le_bytes());
        version.extend_from_slice(b"\x1a\x0dbrain.Event:2");
        assert_eq!(records[0], version);
        // wall_time, step 300 as a varint, summary { value { tag, simple_value } }.
        let mut scalar = vec![0x09];
        scalar.extend_from_slice(&2.0f64.to_le_bytes());
        scalar.extend_from_slice(&[0x10, 0xac, 0x02, 0x2a, 19, 0x0a, 17, 0x0a, 10]);
        scalar.extend_from_slice(b"train/loss");
        scalar.push(0x15);
        scalar.extend_from_slice(&0.5f32.to_le_bytes());
        assert_eq!(records[1], scalar);
        assert!(file_name(12.9, "node", 7).contains("tfevents.12.node.7"));
    }
}
