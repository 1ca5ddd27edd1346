//! CRC-32 over objects and chunks: cheap enough for multi-GB objects (crc32fast uses SIMD,
//! and a large object's pieces are summed on every core, then combined), and it catches
//! corruption in transfer and in spilled copies. TLS already guards against tampering in
//! transit.

/// Objects at least this big are checksummed in pieces beside each other.
const PARALLEL_MIN: usize = 32 << 20;
/// The smallest piece one thread takes.
const PIECE_MIN: usize = 16 << 20;

/// CRC-32 of `bytes`.
pub fn crc32(bytes: &[u8]) -> u32 {
    if bytes.len() < PARALLEL_MIN {
        return crc32fast::hash(bytes);
    }
    crc32_in(bytes, cores())
}

/// The cores this process may use, asked once: the standard library reads the cgroup's
/// CPU quota from files at every ask (four file system calls and three opens), which for
/// small objects cost more than their checksum.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// CRC-32 of `bytes` in at most `threads` pieces, each summed on a thread of its own (a
/// fresh mapping's page faults are spread too), combined in order.
fn crc32_in(bytes: &[u8], threads: usize) -> u32 {
    let pieces = threads.min(bytes.len() / PIECE_MIN).max(1);
    if bytes.len() < PARALLEL_MIN || pieces == 1 {
        return crc32fast::hash(bytes);
    }
    let piece = bytes.len().div_ceil(pieces);
    let sums: Vec<(u32, u64)> = std::thread::scope(|scope| {
        let mut chunks = bytes.chunks(piece);
        let first = chunks.next().unwrap_or_default();
        let others: Vec<_> = chunks
            .map(|chunk| scope.spawn(move || (crc32fast::hash(chunk), chunk.len() as u64)))
            .collect();
        let mut sums = vec![(crc32fast::hash(first), first.len() as u64)];
        // A thread that cannot run its piece (it panicked) is summed again here.
        sums.extend(
            others
                .into_iter()
                .zip(bytes.chunks(piece).skip(1))
                .map(|(handle, chunk)| {
                    handle
                        .join()
                        .unwrap_or_else(|_| (crc32fast::hash(chunk), chunk.len() as u64))
                }),
        );
        sums
    });
    let mut whole = crc32fast::Hasher::new();
    for (sum, len) in sums {
        whole.combine(&crc32fast::Hasher::new_with_initial_len(sum, len));
    }
    whole.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_summed_beside_each_other_give_the_crc_of_the_whole() {
        // Uneven contents and a length that does not split evenly.
        let bytes: Vec<u8> = (0..(PARALLEL_MIN * 2 + 12_345))
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let whole = crc32fast::hash(&bytes);
        for threads in [1, 2, 3, 5] {
            assert_eq!(crc32_in(&bytes, threads), whole, "{threads} threads");
        }
        assert_eq!(
            crc32_in(&bytes[..PARALLEL_MIN - 1], 4),
            crc32fast::hash(&bytes[..PARALLEL_MIN - 1])
        );
        assert_ne!(crc32_in(&bytes[1..], 4), whole);
    }
}
