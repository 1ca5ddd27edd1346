//! Collectives on flat `f32` buffers: the one interface the trainer's ranks use, whatever
//! moves the bytes (NCCL on GPUs, a ring over the network on CPUs).
//!
//! [`RingCollective`] implements the classic bandwidth-optimal ring: reduce-scatter in
//! `world - 1` steps (each rank sends one chunk to its successor while receiving one from
//! its predecessor and adding it in), then all-gather in `world - 1` steps. It runs over
//! any [`RingLink`]; [`memory_ring`] wires ranks in one process (tests), and the QUIC link
//! between nodes plugs in the same way.

use std::ops::Range;
use std::sync::mpsc;

/// What can go wrong in a collective.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// A neighbour went away or the link broke.
    #[error("rank {rank}: ring link failed: {reason}")]
    Link {
        /// This rank.
        rank: usize,
        /// What happened.
        reason: String,
    },
    /// Buffers of the wrong size.
    #[error("rank {rank}: {reason}")]
    Shape {
        /// This rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
}

/// Why a ring link failed to send or receive.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct LinkError(pub String);

impl From<String> for LinkError {
    fn from(reason: String) -> Self {
        Self(reason)
    }
}

impl From<&str> for LinkError {
    fn from(reason: &str) -> Self {
        Self(reason.to_string())
    }
}

/// Result of a collective.
pub type Result<T> = std::result::Result<T, CollectiveError>;

/// The collectives every backend provides. Calls block; each rank drives its own thread.
pub trait Collective: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Sums `buffer` over all ranks, in place.
    fn all_reduce(&mut self, buffer: &mut [f32]) -> Result<()>;
    /// Sums `input` (world * n elements) over ranks; this rank keeps its n-element slice.
    fn reduce_scatter(&mut self, input: &[f32], output: &mut [f32]) -> Result<()>;
    /// Concatenates every rank's `input` (n elements) into `output` (world * n), in rank order.
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<()>;
    /// Reduce-scatter on a working buffer (world * n values): afterwards this rank's n-value
    /// chunk (`rank * n..(rank + 1) * n`) holds the sum over ranks; the rest is scratch. Saves
    /// [`reduce_scatter`](Self::reduce_scatter)'s copies when the caller owns the input.
    fn reduce_scatter_in_place(&mut self, buffer: &mut [f32]) -> Result<()>;
    /// Copies `root`'s buffer to every rank.
    fn broadcast(&mut self, buffer: &mut [f32], root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()> {
        let mut token = [0.0f32];
        self.all_reduce(&mut token)
    }
}

/// A rank's two neighbours in the ring: it sends to the next rank and receives from the
/// previous one. A bare `send` may block until the next rank reads (only `broadcast`, whose
/// chain is acyclic, uses it); ring steps go through `exchange`, which overlaps the two.
pub trait RingLink: Send {
    /// Sends to the next rank.
    fn send(&mut self, data: &[f32]) -> std::result::Result<(), LinkError>;
    /// Receives exactly `out.len()` values from the previous rank.
    fn recv(&mut self, out: &mut [f32]) -> std::result::Result<(), LinkError>;
    /// Sends `send` to the next rank while receiving `recv.len()` values from the previous
    /// one (one ring step). The default sends, then receives: right for links whose sends
    /// never wait for the receiver.
    fn exchange(&mut self, send: &[f32], recv: &mut [f32]) -> std::result::Result<(), LinkError> {
        self.send(send)?;
        self.recv(recv)
    }
}

/// The chunk boundaries of a buffer of `len` split `world` ways (the last chunks may be
/// one shorter; no padding is needed).
pub fn chunks(len: usize, world: usize) -> Vec<Range<usize>> {
    let base = len / world;
    let extra = len % world;
    let mut start = 0;
    (0..world)
        .map(|i| {
            let size = base + usize::from(i < extra);
            let range = start..start + size;
            start += size;
            range
        })
        .collect()
}

/// Two disjoint ranges of one buffer: the first to read, the second to write.
fn disjoint(buffer: &mut [f32], read: Range<usize>, write: Range<usize>) -> (&[f32], &mut [f32]) {
    assert!(
        read.end <= write.start || write.end <= read.start,
        "ring chunks overlap: {read:?} and {write:?}"
    );
    if read.end <= write.start {
        let (head, tail) = buffer.split_at_mut(write.start);
        (&head[read], &mut tail[..write.end - write.start])
    } else {
        let (head, tail) = buffer.split_at_mut(read.start);
        (&tail[..read.end - read.start], &mut head[write])
    }
}

/// A ring collective over a [`RingLink`].
pub struct RingCollective<L: RingLink> {
    rank: usize,
    world: usize,
    link: L,
    scratch: Vec<f32>,
}

impl<L: RingLink> RingCollective<L> {
    /// Rank `rank` of `world`, talking through `link`.
    pub fn new(rank: usize, world: usize, link: L) -> Self {
        Self {
            rank,
            world,
            link,
            scratch: Vec::new(),
        }
    }

    fn link_err(&self, reason: LinkError) -> CollectiveError {
        CollectiveError::Link {
            rank: self.rank,
            reason: reason.0,
        }
    }

    /// Reduce-scatter in place: afterwards chunk `(rank + 1) % world` of `buffer` holds the
    /// full sum. Each step sends a chunk straight from `buffer` and receives the previous
    /// rank's partial sum into the scratch buffer, then adds it in.
    fn ring_reduce_scatter(&mut self, buffer: &mut [f32], parts: &[Range<usize>]) -> Result<()> {
        let w = self.world;
        let mut scratch = std::mem::take(&mut self.scratch);
        for step in 0..w - 1 {
            let send = parts[(self.rank + w - step) % w].clone();
            let recv = parts[(self.rank + w - step - 1) % w].clone();
            scratch.resize(recv.len(), 0.0);
            if let Err(e) = self.link.exchange(&buffer[send], &mut scratch) {
                self.scratch = scratch;
                return Err(self.link_err(e));
            }
            for (dst, add) in buffer[recv].iter_mut().zip(&scratch) {
                *dst += add;
            }
        }
        self.scratch = scratch;
        Ok(())
    }

    /// All-gather in place, starting from each rank owning chunk `(rank + 1) % world`. Each
    /// step sends a chunk straight from `buffer` and receives the next one straight into it.
    fn ring_all_gather(&mut self, buffer: &mut [f32], parts: &[Range<usize>]) -> Result<()> {
        let w = self.world;
        for step in 0..w - 1 {
            let send = parts[(self.rank + 1 + w - step) % w].clone();
            let recv = parts[(self.rank + w - step) % w].clone();
            let (outgoing, incoming) = disjoint(buffer, send, recv);
            self.link.exchange(outgoing, incoming).map_err(|e| self.link_err(e))?;
        }
        Ok(())
    }
}

impl<L: RingLink> Collective for RingCollective<L> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, buffer: &mut [f32]) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let parts = chunks(buffer.len(), self.world);
        self.ring_reduce_scatter(buffer, &parts)?;
        self.ring_all_gather(buffer, &parts)
    }

    fn reduce_scatter(&mut self, input: &[f32], output: &mut [f32]) -> Result<()> {
        if input.len() != output.len() * self.world {
            return Err(CollectiveError::Shape {
                rank: self.rank,
                reason: format!(
                    "reduce_scatter needs input = world x output ({} != {} x {})",
                    input.len(),
                    self.world,
                    output.len()
                ),
            });
        }
        let mut buffer = input.to_vec();
        let n = output.len();
        self.reduce_scatter_in_place(&mut buffer)?;
        output.copy_from_slice(&buffer[self.rank * n..(self.rank + 1) * n]);
        Ok(())
    }

    fn reduce_scatter_in_place(&mut self, buffer: &mut [f32]) -> Result<()> {
        if !buffer.len().is_multiple_of(self.world) {
            return Err(CollectiveError::Shape {
                rank: self.rank,
                reason: format!(
                    "reduce_scatter of {} values does not split over {} ranks",
                    buffer.len(),
                    self.world
                ),
            });
        }
        let n = buffer.len() / self.world;
        let parts: Vec<Range<usize>> = (0..self.world).map(|r| r * n..(r + 1) * n).collect();
        // Rotate so this rank ends up owning its own chunk: shift chunk indices by one.
        let rotated: Vec<Range<usize>> = (0..self.world)
            .map(|i| parts[(i + self.world - 1) % self.world].clone())
            .collect();
        if self.world > 1 {
            self.ring_reduce_scatter(buffer, &rotated)?;
        }
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<()> {
        let n = input.len();
        if output.len() != n * self.world {
            return Err(CollectiveError::Shape {
                rank: self.rank,
                reason: format!(
                    "all_gather needs output = world x input ({} != {} x {n})",
                    output.len(),
                    self.world
                ),
            });
        }
        let parts: Vec<Range<usize>> = (0..self.world).map(|r| r * n..(r + 1) * n).collect();
        output[parts[self.rank].clone()].copy_from_slice(input);
        let rotated: Vec<Range<usize>> = (0..self.world)
            .map(|i| parts[(i + self.world - 1) % self.world].clone())
            .collect();
        if self.world > 1 {
            self.ring_all_gather(output, &rotated)?;
        }
        Ok(())
    }

    fn broadcast(&mut self, buffer: &mut [f32], root: usize) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        // Pass the buffer along the ring from the root; the rank before the root stops it.
        let from_root = (self.rank + self.world - root) % self.world;
        if from_root != 0 {
            self.link.recv(buffer).map_err(|e| self.link_err(e))?;
        }
        if from_root != self.world - 1 {
            self.link.send(buffer).map_err(|e| self.link_err(e))?;
        }
        Ok(())
    }
}

/// An in-process ring link over channels.
pub struct MemoryLink {
    next: mpsc::Sender<Vec<f32>>,
    previous: mpsc::Receiver<Vec<f32>>,
}

impl RingLink for MemoryLink {
    fn send(&mut self, data: &[f32]) -> std::result::Result<(), LinkError> {
        self.next
            .send(data.to_vec())
            .map_err(|_| LinkError("the next rank is gone".into()))
    }

    fn recv(&mut self, out: &mut [f32]) -> std::result::Result<(), LinkError> {
        let data = self
            .previous
            .recv()
            .map_err(|_| LinkError("the previous rank is gone".into()))?;
        if data.len() != out.len() {
            return Err(LinkError(format!("expected {} values, got {}", out.len(), data.len())));
        }
        out.copy_from_slice(&data);
        Ok(())
    }
}

/// `world` ring links wired in a circle, one per rank.
pub fn memory_ring(world: usize) -> Vec<MemoryLink> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..world).map(|_| mpsc::channel()).unzip();
    let mut receivers: Vec<Option<mpsc::Receiver<Vec<f32>>>> = receivers.into_iter().map(Some).collect();
    (0..world)
        .map(|rank| MemoryLink {
            // Rank r sends into the channel that rank r+1 receives from.
            next: senders[(rank + 1) % world].clone(),
            previous: receivers[rank].take().expect("each receiver is taken once"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `body` on every rank of an in-memory ring, each on its own thread.
    fn on_ring<T: Send + 'static>(
        world: usize,
        body: impl Fn(&mut RingCollective<MemoryLink>) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let body = std::sync::Arc::new(body);
        let threads: Vec<_> = memory_ring(world)
            .into_iter()
            .enumerate()
            .map(|(rank, link)| {
                let body = body.clone();
                std::thread::spawn(move || body(&mut RingCollective::new(rank, world, link)))
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    fn values(rank: usize, len: usize) -> Vec<f32> {
        (0..len).map(|i| (rank * 100 + i) as f32).collect()
    }

    #[test]
    fn disjoint_ranges_borrow_the_right_values() {
        let mut buffer: Vec<f32> = (0..10).map(|v| v as f32).collect();
        let (read, write) = disjoint(&mut buffer, 6..9, 1..4);
        assert_eq!(read, &[6.0, 7.0, 8.0]);
        write.copy_from_slice(read);
        let (read, write) = disjoint(&mut buffer, 0..2, 8..10);
        assert_eq!(read, &[0.0, 6.0]);
        assert_eq!(write, &[8.0, 9.0]);
        let (read, write) = disjoint(&mut buffer, 3..3, 3..5);
        assert!(read.is_empty());
        assert_eq!(write.len(), 2);
        assert_eq!(buffer, vec![0.0, 6.0, 7.0, 8.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    }

    #[test]
    #[should_panic(expected = "overlap")]
    fn overlapping_ranges_are_a_bug() {
        let mut buffer = vec![0.0; 4];
        let _ = disjoint(&mut buffer, 0..2, 1..3);
    }

    #[test]
    fn reduce_scatter_in_place_leaves_each_ranks_sum_in_its_chunk() {
        for world in [1, 2, 3] {
            let n = 4;
            let results = on_ring(world, move |c| {
                let mut buffer = values(c.rank(), n * c.world());
                c.reduce_scatter_in_place(&mut buffer).unwrap();
                (c.rank(), buffer[c.rank() * n..(c.rank() + 1) * n].to_vec())
            });
            for (rank, chunk) in results {
                let expected: Vec<f32> = (rank * n..(rank + 1) * n)
                    .map(|i| (0..world).map(|r| (r * 100 + i) as f32).sum())
                    .collect();
                assert_eq!(chunk, expected, "world {world} rank {rank}");
            }
        }
        let mut c = RingCollective::new(0, 2, memory_ring(2).remove(0));
        assert!(matches!(
            c.reduce_scatter_in_place(&mut [1.0; 5]),
            Err(CollectiveError::Shape { .. })
        ));
    }

    #[test]
    fn chunks_split_without_padding() {
        assert_eq!(chunks(7, 3), vec![0..3, 3..5, 5..7]);
        assert_eq!(chunks(2, 3), vec![0..1, 1..2, 2..2]);
    }

    #[test]
    fn all_reduce_sums_on_every_rank_for_awkward_sizes() {
        for world in 1..=4 {
            for len in [1, 2, 7, 10] {
                let results = on_ring(world, move |c| {
                    let mut buffer = values(c.rank(), len);
                    c.all_reduce(&mut buffer).unwrap();
                    buffer
                });
                let expected: Vec<f32> = (0..len)
                    .map(|i| (0..world).map(|r| (r * 100 + i) as f32).sum())
                    .collect();
                for got in results {
                    assert_eq!(got, expected, "world {world}, len {len}");
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_then_all_gather_equals_all_reduce() {
        for world in [2, 3] {
            let n = 5;
            let results = on_ring(world, move |c| {
                let input = values(c.rank(), n * c.world());
                let mut shard = vec![0.0; n];
                c.reduce_scatter(&input, &mut shard).unwrap();
                let mut whole = vec![0.0; n * c.world()];
                c.all_gather(&shard, &mut whole).unwrap();
                (c.rank(), shard, whole)
            });
            let expected: Vec<f32> = (0..n * world)
                .map(|i| (0..world).map(|r| (r * 100 + i) as f32).sum())
                .collect();
            for (rank, shard, whole) in results {
                assert_eq!(
                    shard,
                    expected[rank * n..(rank + 1) * n].to_vec(),
                    "world {world} rank {rank}"
                );
                assert_eq!(whole, expected);
            }
        }
    }

    #[test]
    fn broadcast_copies_the_roots_buffer_and_barrier_returns() {
        let results = on_ring(3, |c| {
            let mut buffer = values(c.rank(), 4);
            c.broadcast(&mut buffer, 1).unwrap();
            c.barrier().unwrap();
            buffer
        });
        assert!(results.iter().all(|b| *b == values(1, 4)));
    }

    #[test]
    fn wrong_shapes_are_refused() {
        let mut c = RingCollective::new(0, 2, memory_ring(2).remove(0));
        assert!(matches!(
            c.reduce_scatter(&[1.0; 5], &mut [0.0; 2]),
            Err(CollectiveError::Shape { .. })
        ));
        assert!(matches!(
            c.all_gather(&[1.0; 2], &mut [0.0; 3]),
            Err(CollectiveError::Shape { .. })
        ));
    }
}
