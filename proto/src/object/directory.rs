//! The head's directory of every object: size, checksum, which nodes hold it in memory,
//! where a spilled copy lives, and who still references it. Pure state: the head's actor
//! calls it and carries out the releases it returns.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::id::ObjectId;
use crate::error::Error;
use crate::protocol::HeldObject;

/// Where an object can be read from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    /// Size in bytes.
    pub size: u64,
    /// CRC-32 of the whole object.
    pub checksum: u32,
    /// Nodes holding it in memory, with their transfer addresses.
    pub sources: Vec<(String, String)>,
    /// URL of a spilled copy, if any.
    pub spilled: Option<String>,
}

/// Why an object cannot be located.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Missing {
    /// Never existed here, or was freed.
    Unknown,
    /// Every copy was on a node that died.
    Lost {
        /// The node that held the last copy.
        node: String,
    },
}

/// Tell these nodes to drop their copies (and the spiller to delete its spilled file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    /// The object.
    pub id: ObjectId,
    /// Nodes holding it in memory.
    pub nodes: Vec<String>,
    /// The node that spilled it and the URL, to delete the spilled copy.
    pub spilled: Option<(String, String)>,
}

/// Directory-wide figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectoryStats {
    /// Objects known.
    pub objects: u64,
    /// Their total size.
    pub bytes: u64,
    /// Objects with a spilled copy.
    pub spilled_objects: u64,
    /// Bytes with a spilled copy.
    pub spilled_bytes: u64,
    /// Objects lost with their node.
    pub lost: u64,
}

#[derive(Serialize, Deserialize)]
struct Meta {
    size: u64,
    checksum: u32,
    sources: BTreeMap<String, String>,
    spilled: Option<(String, String)>,
    holders: BTreeSet<String>,
    job: Option<String>,
    unreferenced_since_ms: Option<u64>,
}

/// Lost objects remembered (so a `get` can say which node took them); older ones are
/// forgotten and then read as unknown.
pub const MAX_LOST_OBJECTS: usize = 100_000;

/// Freed objects remembered, so that a node's late word that it cached a copy of one can
/// be answered with a release. Not saved: after a restart an unknown object's copy is left
/// alone (the head cannot tell a freed object from one its nodes have yet to report).
pub const MAX_FREED_REMEMBERED: usize = 100_000;

/// Every object in the cluster.
#[derive(Serialize, Deserialize)]
pub struct Directory {
    objects: HashMap<ObjectId, Meta>,
    lost: HashMap<ObjectId, String>,
    lost_order: std::collections::VecDeque<ObjectId>,
    grace_ms: u64,
    #[serde(skip)]
    freed: std::collections::HashSet<ObjectId>,
    #[serde(skip)]
    freed_order: std::collections::VecDeque<ObjectId>,
}

impl Directory {
    /// An empty directory; objects nobody references are released `grace_ms` later (so a
    /// reference travelling inside a message can still be adopted).
    pub fn new(grace_ms: u64) -> Self {
        Self {
            objects: HashMap::new(),
            lost: HashMap::new(),
            lost_order: std::collections::VecDeque::new(),
            grace_ms,
            freed: std::collections::HashSet::new(),
            freed_order: std::collections::VecDeque::new(),
        }
    }

    /// The same directory releasing unreferenced objects `grace_ms` after their last
    /// reference (a restored head takes its setting from its own configuration).
    pub fn with_grace(self, grace_ms: u64) -> Self {
        Self { grace_ms, ..self }
    }

    /// Records a new object held by `node` and referenced by `holder`.
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &mut self,
        id: ObjectId,
        size: u64,
        checksum: u32,
        holder: &str,
        node: &str,
        address: &str,
        job: Option<String>,
    ) -> Result<(), Error> {
        if let Some(meta) = self.objects.get_mut(&id) {
            if meta.size != size || meta.checksum != checksum {
                return Err(Error::ObjectExists { id });
            }
            // The same bytes registered again by a process that holds them (a client
            // telling a restarted head what it holds): one more source, nothing dropped.
            meta.sources.insert(node.to_string(), address.to_string());
            meta.holders.insert(holder.to_string());
            self.lost.remove(&id);
            return Ok(());
        }
        self.lost.remove(&id);
        self.objects.insert(
            id,
            Meta {
                size,
                checksum,
                sources: BTreeMap::from([(node.to_string(), address.to_string())]),
                spilled: None,
                holders: BTreeSet::from([holder.to_string()]),
                job,
                unreferenced_since_ms: None,
            },
        );
        Ok(())
    }

    /// Where to read an object.
    pub fn locate(&self, id: ObjectId) -> Result<Location, Missing> {
        if let Some(node) = self.lost.get(&id) {
            return Err(Missing::Lost { node: node.clone() });
        }
        let meta = self.objects.get(&id).ok_or(Missing::Unknown)?;
        Ok(Location {
            size: meta.size,
            checksum: meta.checksum,
            sources: meta.sources.iter().map(|(n, a)| (n.clone(), a.clone())).collect(),
            spilled: meta.spilled.as_ref().map(|(_, url)| url.clone()),
        })
    }

    /// A node now holds a copy in memory (after a pull or a restore). A copy of an object
    /// freed here lately (the node's word came after the release) is of no use: the answer
    /// tells that node to drop it, else it would be held until the process ends. A copy of
    /// an object not known at all is left alone: it may be one a restarted head has yet to
    /// hear about from its holder.
    pub fn add_source(&mut self, id: ObjectId, node: &str, address: &str) -> Option<Release> {
        match self.objects.get_mut(&id) {
            Some(meta) => {
                meta.sources.insert(node.to_string(), address.to_string());
                None
            }
            None if !self.freed.contains(&id) => None,
            None => Some(Release {
                id,
                nodes: vec![node.to_string()],
                spilled: None,
            }),
        }
    }

    /// A node dropped its in-memory copy (after spilling it, or under memory pressure).
    pub fn remove_source(&mut self, id: ObjectId, node: &str) {
        if let Some(meta) = self.objects.get_mut(&id) {
            meta.sources.remove(node);
        }
    }

    /// A node wrote a spilled copy at `url`.
    pub fn spilled(&mut self, id: ObjectId, node: &str, url: &str) {
        if let Some(meta) = self.objects.get_mut(&id) {
            meta.spilled = Some((node.to_string(), url.to_string()));
        }
    }

    /// `holder` references the object (again).
    pub fn add_ref(&mut self, id: ObjectId, holder: &str) -> Result<(), Missing> {
        if let Some(node) = self.lost.get(&id) {
            return Err(Missing::Lost { node: node.clone() });
        }
        let meta = self.objects.get_mut(&id).ok_or(Missing::Unknown)?;
        meta.holders.insert(holder.to_string());
        meta.unreferenced_since_ms = None;
        Ok(())
    }

    /// `holder` dropped its last reference.
    pub fn drop_ref(&mut self, id: ObjectId, holder: &str, now_ms: u64) {
        if let Some(meta) = self.objects.get_mut(&id) {
            meta.holders.remove(holder);
            if meta.holders.is_empty() && meta.unreferenced_since_ms.is_none() {
                meta.unreferenced_since_ms = Some(now_ms);
            }
        }
    }

    /// Frees an object now, whoever references it.
    pub fn free(&mut self, id: ObjectId) -> Option<Release> {
        self.lost.remove(&id);
        let meta = self.objects.remove(&id)?;
        self.remember_freed(id);
        Some(Release {
            id,
            nodes: meta.sources.into_keys().collect(),
            spilled: meta.spilled,
        })
    }

    /// Frees every object of a finished job.
    pub fn end_job(&mut self, job: &str) -> Vec<Release> {
        let ids: Vec<ObjectId> = self
            .objects
            .iter()
            .filter(|(_, m)| m.job.as_deref() == Some(job))
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter().filter_map(|id| self.free(id)).collect()
    }

    /// Releases objects unreferenced for longer than the grace period.
    pub fn collect(&mut self, now_ms: u64) -> Vec<Release> {
        let grace = self.grace_ms;
        let due: Vec<ObjectId> = self
            .objects
            .iter()
            .filter(|(_, m)| {
                m.unreferenced_since_ms
                    .is_some_and(|since| now_ms.saturating_sub(since) >= grace)
            })
            .map(|(id, _)| *id)
            .collect();
        due.into_iter().filter_map(|id| self.free(id)).collect()
    }

    /// A holder process is gone (a client disconnected): drop its references.
    pub fn holder_gone(&mut self, holder: &str, now_ms: u64) {
        let ids: Vec<ObjectId> = self
            .objects
            .iter()
            .filter(|(_, m)| m.holders.contains(holder))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.drop_ref(id, holder, now_ms);
        }
    }

    /// A node died: its copies are gone, its references dropped. Objects with no other copy
    /// and no spilled copy become lost, naming the node. Returns the ids lost.
    pub fn node_lost(&mut self, node: &str, now_ms: u64) -> Vec<ObjectId> {
        self.holder_gone(node, now_ms);
        let mut lost = Vec::new();
        for (id, meta) in &mut self.objects {
            if meta.sources.remove(node).is_some() && meta.sources.is_empty() && meta.spilled.is_none() {
                lost.push(*id);
            }
        }
        for id in &lost {
            self.objects.remove(id);
            self.remember_lost(*id, node);
        }
        lost
    }

    /// A node (re)registered holding `held` in memory: it is a source of exactly those.
    /// Copies it no longer has stop being sources (an object left with no copy is lost);
    /// copies the directory did not know, or had given up as lost, are taken back, held
    /// by the node when it references them. Returns the objects lost.
    pub fn reconcile(&mut self, node: &str, address: &str, held: &[HeldObject], now_ms: u64) -> Vec<ObjectId> {
        let reported: BTreeMap<ObjectId, &HeldObject> = held.iter().map(|h| (h.id, h)).collect();
        let mut lost = Vec::new();
        for (id, meta) in &mut self.objects {
            if !reported.contains_key(id)
                && meta.sources.remove(node).is_some()
                && meta.sources.is_empty()
                && meta.spilled.is_none()
            {
                lost.push(*id);
            }
        }
        for id in &lost {
            self.objects.remove(id);
            self.remember_lost(*id, node);
        }
        for (id, object) in reported {
            match self.objects.get_mut(&id) {
                Some(meta) => {
                    meta.sources.insert(node.to_string(), address.to_string());
                    if object.referenced {
                        meta.holders.insert(node.to_string());
                        meta.unreferenced_since_ms = None;
                    }
                }
                None => {
                    self.lost.remove(&id);
                    self.objects.insert(
                        id,
                        Meta {
                            size: object.size,
                            checksum: object.checksum,
                            sources: BTreeMap::from([(node.to_string(), address.to_string())]),
                            spilled: None,
                            holders: if object.referenced {
                                BTreeSet::from([node.to_string()])
                            } else {
                                BTreeSet::new()
                            },
                            job: None,
                            unreferenced_since_ms: (!object.referenced).then_some(now_ms),
                        },
                    );
                }
            }
        }
        lost
    }

    fn remember_freed(&mut self, id: ObjectId) {
        if self.freed.insert(id) {
            self.freed_order.push_back(id);
        }
        while self.freed_order.len() > MAX_FREED_REMEMBERED {
            if let Some(oldest) = self.freed_order.pop_front() {
                self.freed.remove(&oldest);
            }
        }
    }

    fn remember_lost(&mut self, id: ObjectId, node: &str) {
        self.lost.insert(id, node.to_string());
        self.lost_order.push_back(id);
        while self.lost_order.len() > MAX_LOST_OBJECTS {
            if let Some(oldest) = self.lost_order.pop_front() {
                self.lost.remove(&oldest);
            }
        }
    }

    /// Bytes of objects each node holds in memory, by node.
    pub fn bytes_by_node(&self) -> BTreeMap<String, u64> {
        let mut bytes = BTreeMap::<String, u64>::new();
        for meta in self.objects.values() {
            for node in meta.sources.keys() {
                *bytes.entry(node.clone()).or_default() += meta.size;
            }
        }
        bytes
    }

    /// Figures for metrics.
    pub fn stats(&self) -> DirectoryStats {
        let mut stats = DirectoryStats {
            objects: self.objects.len() as u64,
            lost: self.lost.len() as u64,
            ..Default::default()
        };
        for meta in self.objects.values() {
            stats.bytes += meta.size;
            if meta.spilled.is_some() {
                stats.spilled_objects += 1;
                stats.spilled_bytes += meta.size;
            }
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(id: u128, node: &str) -> Directory {
        let mut dir = Directory::new(1_000);
        dir.put(ObjectId(id), 10, 42, "driver", node, "addr", None).unwrap();
        dir
    }

    fn held(id: u128, referenced: bool) -> HeldObject {
        HeldObject {
            id: ObjectId(id),
            size: 10,
            checksum: 42,
            referenced,
        }
    }

    #[test]
    fn a_copy_reported_after_its_object_was_freed_is_released_and_any_other_unknown_copy_kept() {
        let mut dir = dir_with(1, "w1");
        assert!(dir.free(ObjectId(1)).is_some());
        assert_eq!(
            dir.add_source(ObjectId(1), "w2", "addr2"),
            Some(Release {
                id: ObjectId(1),
                nodes: vec!["w2".into()],
                spilled: None
            })
        );
        assert!(matches!(dir.locate(ObjectId(1)), Err(Missing::Unknown)));
        let mut dir = dir_with(2, "w1");
        assert_eq!(dir.node_lost("w1", 5), vec![ObjectId(2)]);
        assert_eq!(dir.add_source(ObjectId(2), "w2", "addr2"), None, "maybe the last copy");
        assert_eq!(dir.add_source(ObjectId(3), "w2", "addr2"), None, "never heard of");
        // A restored directory remembers no frees: an unknown copy is left alone.
        let mut dir = dir_with(4, "w1");
        dir.free(ObjectId(4));
        let mut restored: Directory = serde_json::from_str(&serde_json::to_string(&dir).unwrap()).unwrap();
        assert_eq!(restored.add_source(ObjectId(4), "w2", "addr2"), None);
        // Only the latest frees are remembered.
        let mut dir = Directory::new(1_000);
        for id in 0..=MAX_FREED_REMEMBERED as u128 {
            dir.put(ObjectId(id), 1, 1, "driver", "w1", "a1", None).unwrap();
            dir.free(ObjectId(id));
        }
        assert_eq!(dir.add_source(ObjectId(0), "w2", "a2"), None, "forgotten");
        assert!(dir.add_source(ObjectId(1), "w2", "a2").is_some());
    }

    #[test]
    fn a_registering_node_is_the_source_of_exactly_what_it_holds() {
        let mut dir = dir_with(1, "w1");
        dir.put(ObjectId(2), 10, 42, "driver", "w1", "addr", None).unwrap();
        assert_eq!(dir.add_source(ObjectId(2), "w2", "addr2"), None);
        dir.put(ObjectId(3), 10, 42, "driver", "w1", "addr", None).unwrap();
        dir.spilled(ObjectId(3), "w1", "file:///spill/3");
        // w1 comes back holding object 1 and one the directory never heard of (its
        // registration was lost), but not 2 (w2 still has it) nor 3 (spilled).
        let lost = dir.reconcile("w1", "addr", &[held(1, false), held(9, true)], 5);
        assert!(lost.is_empty(), "{lost:?}");
        assert_eq!(
            dir.locate(ObjectId(2)).unwrap().sources,
            vec![("w2".to_string(), "addr2".to_string())]
        );
        assert!(dir.locate(ObjectId(3)).unwrap().spilled.is_some());
        let taken_back = dir.locate(ObjectId(9)).expect("taken back");
        assert_eq!((taken_back.size, taken_back.checksum), (10, 42));
        // Referenced by the node: kept past the grace period; object 1 still by the driver.
        assert!(dir.collect(10_000).is_empty());
        // A new process under the name holds nothing: its only copies are lost.
        let lost = dir.reconcile("w1", "addr", &[], 20_000);
        assert_eq!(lost.len(), 2, "objects 1 and 9: {lost:?}");
        assert!(matches!(dir.locate(ObjectId(1)), Err(Missing::Lost { node }) if node == "w1"));
        // A copy the directory had given up as lost is taken back when a node has it.
        dir.reconcile("w2", "addr2", &[held(2, false), held(1, false)], 20_001);
        assert!(dir.locate(ObjectId(1)).is_ok());
        // An unreferenced copy taken back is released after the grace period.
        assert_eq!(dir.collect(20_001 + 1_000).len(), 1);
    }

    #[test]
    fn the_same_bytes_put_again_add_a_source_and_other_bytes_are_refused() {
        let mut dir = dir_with(1, "w1");
        // A client registering again what it holds: idempotent, one more source.
        dir.put(ObjectId(1), 10, 42, "client", "client", "caddr", None)
            .expect("the same bytes again");
        let sources = dir.locate(ObjectId(1)).unwrap().sources;
        assert_eq!(sources.len(), 2, "{sources:?}");
        let exists = Err(Error::ObjectExists { id: ObjectId(1) });
        assert_eq!(dir.put(ObjectId(1), 10, 43, "client", "client", "caddr", None), exists);
        assert_eq!(dir.put(ObjectId(1), 11, 42, "client", "client", "caddr", None), exists);
        // An object given up as lost comes back when a holder registers it again.
        dir.reconcile("w1", "addr", &[], 5);
        dir.reconcile("client", "caddr", &[], 5);
        assert!(dir.locate(ObjectId(1)).is_err());
        dir.put(ObjectId(1), 10, 42, "client", "client", "caddr", None)
            .expect("registered again");
        assert!(dir.locate(ObjectId(1)).is_ok());
    }

    #[test]
    fn objects_are_released_after_the_last_reference_and_the_grace_period() {
        let mut dir = dir_with(1, "w1");
        dir.add_ref(ObjectId(1), "w2").unwrap();
        dir.drop_ref(ObjectId(1), "driver", 0);
        assert!(dir.collect(5_000).is_empty(), "w2 still holds it");
        dir.drop_ref(ObjectId(1), "w2", 100);
        assert!(dir.collect(500).is_empty(), "within the grace period");
        dir.add_ref(ObjectId(1), "w3").unwrap();
        assert!(dir.collect(5_000).is_empty(), "adopted within the grace period");
        dir.drop_ref(ObjectId(1), "w3", 6_000);
        let released = dir.collect(7_000);
        assert_eq!(
            released,
            vec![Release {
                id: ObjectId(1),
                nodes: vec!["w1".into()],
                spilled: None
            }]
        );
        assert_eq!(dir.locate(ObjectId(1)), Err(Missing::Unknown));
    }

    #[test]
    fn losing_the_only_holder_loses_the_object_with_the_node_named() {
        let mut dir = dir_with(1, "w1");
        dir.put(ObjectId(2), 10, 1, "driver", "w1", "a1", None).unwrap();
        assert_eq!(dir.add_source(ObjectId(2), "w2", "a2"), None);
        dir.put(ObjectId(3), 10, 1, "driver", "w1", "a1", None).unwrap();
        dir.spilled(ObjectId(3), "w1", "file:///spill/3");
        dir.remove_source(ObjectId(3), "w1");
        assert_eq!(dir.node_lost("w1", 0), vec![ObjectId(1)]);
        assert_eq!(dir.locate(ObjectId(1)), Err(Missing::Lost { node: "w1".into() }));
        assert_eq!(
            dir.locate(ObjectId(2)).unwrap().sources,
            vec![("w2".into(), "a2".into())]
        );
        assert_eq!(
            dir.locate(ObjectId(3)).unwrap().spilled.as_deref(),
            Some("file:///spill/3")
        );
    }

    #[test]
    fn ending_a_job_frees_its_objects_and_their_spilled_copies() {
        let mut dir = Directory::new(0);
        dir.put(ObjectId(1), 5, 0, "d", "w1", "a", Some("job-1".into()))
            .unwrap();
        dir.put(ObjectId(2), 5, 0, "d", "w1", "a", Some("job-2".into()))
            .unwrap();
        dir.spilled(ObjectId(1), "w1", "file:///x");
        let released = dir.end_job("job-1");
        assert_eq!(released.len(), 1);
        assert_eq!(released[0].spilled, Some(("w1".into(), "file:///x".into())));
        assert_eq!(dir.stats().objects, 1);
    }

    #[test]
    fn duplicate_ids_are_refused() {
        let mut dir = dir_with(1, "w1");
        assert!(dir.put(ObjectId(1), 1, 1, "x", "w2", "a", None).is_err());
    }
}
