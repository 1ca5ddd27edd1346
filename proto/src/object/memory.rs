//! A node's in-memory object store: capacity accounting and least-recently-used choice of
//! what to spill. Holds `Bytes`, so a local read hands out the same memory without a copy.
//! No I/O: the caller spills the victims this module names.

use std::collections::HashMap;

use bytes::Bytes;

use super::id::ObjectId;

struct Entry {
    bytes: Bytes,
    last_used: u64,
    pins: u32,
}

/// Why an object cannot be stored here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoRoom {
    /// Size asked for.
    pub size: u64,
    /// The store's capacity.
    pub capacity: u64,
    /// Bytes held by pinned objects that cannot be spilled now.
    pub pinned: u64,
}

/// Figures for metrics and status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Objects held.
    pub objects: u64,
    /// Bytes held.
    pub bytes: u64,
    /// Capacity.
    pub capacity: u64,
}

/// In-memory objects with a byte capacity.
pub struct MemoryStore {
    capacity: u64,
    used: u64,
    clock: u64,
    objects: HashMap<ObjectId, Entry>,
}

impl MemoryStore {
    /// An empty store holding at most `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            clock: 0,
            objects: HashMap::new(),
        }
    }

    /// The object's bytes (shared, not copied), marking it recently used.
    pub fn get(&mut self, id: ObjectId) -> Option<Bytes> {
        self.clock += 1;
        let clock = self.clock;
        self.objects.get_mut(&id).map(|entry| {
            entry.last_used = clock;
            entry.bytes.clone()
        })
    }

    /// Every object here with its bytes (shared, not copied), without marking any used.
    pub fn held(&self) -> Vec<(ObjectId, Bytes)> {
        self.objects
            .iter()
            .map(|(id, entry)| (*id, entry.bytes.clone()))
            .collect()
    }

    /// Whether the object is here.
    pub fn contains(&self, id: ObjectId) -> bool {
        self.objects.contains_key(&id)
    }

    /// Which objects to spill (least recently used first, never pinned ones) so that
    /// `size` more bytes fit; an error when even spilling everything unpinned is not enough.
    pub fn plan_room(&self, size: u64) -> Result<Vec<ObjectId>, NoRoom> {
        let pinned: u64 = self
            .objects
            .values()
            .filter(|e| e.pins > 0)
            .map(|e| e.bytes.len() as u64)
            .sum();
        if size > self.capacity.saturating_sub(pinned) {
            return Err(NoRoom {
                size,
                capacity: self.capacity,
                pinned,
            });
        }
        let mut free = self.capacity - self.used;
        if size <= free {
            return Ok(Vec::new());
        }
        let mut candidates: Vec<(&ObjectId, &Entry)> = self.objects.iter().filter(|(_, e)| e.pins == 0).collect();
        candidates.sort_by_key(|(id, e)| (e.last_used, **id));
        let mut victims = Vec::new();
        for (id, entry) in candidates {
            if size <= free {
                break;
            }
            free += entry.bytes.len() as u64;
            victims.push(*id);
        }
        Ok(victims)
    }

    /// Stores an object; the caller made room with [`Self::plan_room`]. Returns false (and
    /// stores nothing) if it still does not fit or the id is taken.
    pub fn insert(&mut self, id: ObjectId, bytes: Bytes) -> bool {
        let size = bytes.len() as u64;
        if self.objects.contains_key(&id) || self.used + size > self.capacity {
            return false;
        }
        self.clock += 1;
        self.used += size;
        self.objects.insert(
            id,
            Entry {
                bytes,
                last_used: self.clock,
                pins: 0,
            },
        );
        true
    }

    /// Removes an object, returning its bytes.
    pub fn remove(&mut self, id: ObjectId) -> Option<Bytes> {
        let entry = self.objects.remove(&id)?;
        self.used -= entry.bytes.len() as u64;
        Some(entry.bytes)
    }

    /// Swaps an object's bytes for the same bytes held elsewhere (a shared-memory mapping
    /// of them, say), keeping its pins and recency, and hands back the bytes it held (for
    /// the caller to free where it suits). Refuses (`Err`, giving the new bytes back) an
    /// unknown id or bytes of another length, so the accounting cannot drift.
    pub fn replace(&mut self, id: ObjectId, bytes: Bytes) -> Result<Bytes, Bytes> {
        match self.objects.get_mut(&id) {
            Some(entry) if entry.bytes.len() == bytes.len() => Ok(std::mem::replace(&mut entry.bytes, bytes)),
            _ => Err(bytes),
        }
    }

    /// Keeps an object from being chosen for spilling (while it is served or spilled).
    pub fn pin(&mut self, id: ObjectId) -> Option<Bytes> {
        let entry = self.objects.get_mut(&id)?;
        entry.pins += 1;
        Some(entry.bytes.clone())
    }

    /// Undoes one [`Self::pin`].
    pub fn unpin(&mut self, id: ObjectId) {
        if let Some(entry) = self.objects.get_mut(&id) {
            entry.pins = entry.pins.saturating_sub(1);
        }
    }

    /// Current figures.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            objects: self.objects.len() as u64,
            bytes: self.used,
            capacity: self.capacity,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_swaps_same_length_bytes_only_and_keeps_the_accounting() {
        let mut store = MemoryStore::new(100);
        let id = ObjectId(1);
        assert!(store.insert(id, Bytes::from_static(b"abcd")));
        assert!(store.replace(id, Bytes::from_static(b"abc")).is_err(), "another length");
        assert!(
            store.replace(ObjectId(2), Bytes::from_static(b"wxyz")).is_err(),
            "unknown id"
        );
        assert_eq!(&store.replace(id, Bytes::from_static(b"ABCD")).unwrap()[..], b"abcd");
        assert_eq!(&store.get(id).unwrap()[..], b"ABCD");
        assert_eq!(store.stats().bytes, 4);
        assert_eq!(store.remove(id).map(|b| b.len()), Some(4));
        assert_eq!(store.stats().bytes, 0);
    }

    fn object(size: usize) -> Bytes {
        Bytes::from(vec![7u8; size])
    }

    #[test]
    fn local_reads_share_memory() {
        let mut store = MemoryStore::new(100);
        let id = ObjectId(1);
        let bytes = object(10);
        let ptr = bytes.as_ptr();
        assert!(store.insert(id, bytes));
        assert_eq!(store.get(id).unwrap().as_ptr(), ptr, "no copy on a local get");
    }

    #[test]
    fn least_recently_used_unpinned_objects_are_spilled_first() {
        let mut store = MemoryStore::new(30);
        for i in 1..=3 {
            assert!(store.insert(ObjectId(i), object(10)));
        }
        store.get(ObjectId(1));
        store.pin(ObjectId(2));
        assert_eq!(store.plan_room(10).unwrap(), vec![ObjectId(3)]);
        assert_eq!(store.plan_room(20).unwrap(), vec![ObjectId(3), ObjectId(1)]);
        let err = store.plan_room(25).unwrap_err();
        assert_eq!(
            err,
            NoRoom {
                size: 25,
                capacity: 30,
                pinned: 10
            }
        );
        store.unpin(ObjectId(2));
        assert_eq!(store.plan_room(30).unwrap().len(), 3);
    }

    #[test]
    fn an_object_larger_than_the_store_never_fits() {
        let store = MemoryStore::new(10);
        assert!(store.plan_room(11).is_err());
    }

    #[test]
    fn accounting_follows_inserts_and_removes() {
        let mut store = MemoryStore::new(100);
        store.insert(ObjectId(1), object(40));
        assert!(!store.insert(ObjectId(1), object(40)), "ids are unique");
        assert!(!store.insert(ObjectId(2), object(61)), "over capacity");
        assert_eq!(store.stats().bytes, 40);
        store.remove(ObjectId(1));
        assert_eq!(
            store.stats(),
            MemoryStats {
                objects: 0,
                bytes: 0,
                capacity: 100
            }
        );
    }
}
