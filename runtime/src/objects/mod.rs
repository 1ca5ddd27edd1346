//! Objects in the cluster: every process (head, worker, client) runs an [`ObjectService`]
//! with a memory store, a TCP+TLS endpoint that serves its objects to peers, and a spill
//! backend. The head keeps the directory. [`ObjectRef`]s name objects; the last reference
//! dropped anywhere releases them.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use regatta_net::{ObjectSource, TlsIdentity, Transfer};
use regatta_object_store::{crc32, MemoryStore, ObjectId, Segment, SpillBackend};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::net::headlink::HeadLink;
use crate::net::node;
use crate::net::wire::{self, Wire};
use regatta_proto::{Failure, HeadRequest, HeldObject, ObjectCommand};

mod pull;
mod shared;

use pull::Fetch;
#[cfg(test)]
use shared::{MAX_SEGMENTS, SHARED_MEMORY_MIN_BYTES};

/// Default share of this machine's memory an object store may hold.
pub const DEFAULT_MEMORY_SHARE: f64 = 0.3;

/// How a process stores objects.
#[derive(Clone, Debug)]
pub struct ObjectConfig {
    /// Bytes kept in memory before spilling (default: 30% of RAM).
    pub capacity_bytes: Option<u64>,
    /// Where spilled objects go: a directory, `file://` or `s3://` URL
    /// (default: `/tmp/regatta-<uid>/spill/<node>`; a local folder must be this user's alone,
    /// `regatta_object_store::make_private_dir`).
    pub spill_url: Option<String>,
    /// Address the transfer endpoint binds.
    pub bind: IpAddr,
    /// TCP port (0: any).
    pub port: u16,
    /// Host peers use to reach this endpoint.
    pub advertise_host: String,
}

impl ObjectConfig {
    /// Defaults for a process reachable at `advertise_host`.
    pub fn new(advertise_host: &str) -> Self {
        Self {
            capacity_bytes: None,
            spill_url: None,
            bind: IpAddr::from([0, 0, 0, 0]),
            port: 0,
            advertise_host: advertise_host.to_string(),
        }
    }

    pub(crate) fn for_client(host: &str) -> Self {
        Self::new(host)
    }
}

/// Counters for metrics and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectStats {
    /// Objects in memory here.
    pub objects_in_memory: u64,
    /// Bytes in memory here.
    pub bytes_in_memory: u64,
    /// Memory capacity.
    pub capacity_bytes: u64,
    /// Objects spilled by this process.
    pub spills: u64,
    /// Bytes spilled by this process.
    pub spilled_bytes: u64,
    /// Objects restored from spilled copies.
    pub restores: u64,
    /// Bytes received from peers.
    pub transfer_in_bytes: u64,
    /// Of those, bytes mapped from a same-host peer's shared memory (no socket copy).
    pub shared_in_bytes: u64,
    /// Bytes sent to peers.
    pub transfer_out_bytes: u64,
    /// Bytes of dropped received objects' buffers this process keeps for the next get
    /// (outside the capacity; `REGATTA_RECEIVE_POOL_BYTES`).
    #[serde(default)]
    pub receive_pool_bytes: u64,
}

#[derive(Default)]
struct Counters {
    spills: AtomicU64,
    spilled_bytes: AtomicU64,
    restores: AtomicU64,
    transfer_in: AtomicU64,
    shared_in: AtomicU64,
    transfer_out: AtomicU64,
}

/// One process's object store.
pub struct ObjectService {
    node: String,
    address: String,
    link: Arc<HeadLink>,
    memory: Mutex<MemoryStore>,
    room: tokio::sync::Mutex<()>,
    spill: SpillBackend,
    transfer: Transfer,
    refs: Mutex<HashMap<ObjectId, usize>>,
    inflight: Mutex<HashMap<ObjectId, Fetch>>,
    /// Shared-memory segments of objects held here, made on a same-host peer's first pull,
    /// kept while the object is in memory here (at most [`MAX_SEGMENTS`]).
    segments: Mutex<HashMap<ObjectId, Arc<Segment>>>,
    /// One segment maker per object at a time: peers pulling at once wait for the first
    /// one's segment instead of each copying the object.
    making: Mutex<HashMap<ObjectId, Arc<Mutex<()>>>>,
    counters: Counters,
}

struct Source(Weak<ObjectService>);

impl ObjectSource for Source {
    fn open(&self, id: ObjectId) -> Option<Bytes> {
        let service = self.0.upgrade()?;
        let mut memory = service.memory.lock().ok()?;
        memory.pin(id)
    }

    fn release(&self, id: ObjectId) {
        if let Some(service) = self.0.upgrade() {
            if let Ok(mut memory) = service.memory.lock() {
                memory.unpin(id);
            }
        }
    }

    fn sent(&self, bytes: u64) {
        if let Some(service) = self.0.upgrade() {
            service.counters.transfer_out.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    fn share(&self, id: ObjectId) -> Option<Arc<Segment>> {
        self.0.upgrade()?.share(id)
    }
}

fn default_capacity() -> u64 {
    total_memory_bytes()
        .map(|total| (total as f64 * DEFAULT_MEMORY_SHARE) as u64)
        .unwrap_or(1 << 30)
}

/// Reads `MemTotal` from /proc/meminfo.
pub(crate) fn total_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl ObjectService {
    /// Starts the store of process `node`: binds its transfer endpoint, opens its spill
    /// backend, and listens for release orders in process group `objects/<node>`.
    pub(crate) async fn start(
        node: &str,
        identity: &TlsIdentity,
        config: ObjectConfig,
        link: Arc<HeadLink>,
    ) -> Result<Arc<Self>> {
        let transfer = Transfer::bind(SocketAddr::new(config.bind, config.port), identity)?;
        let port = transfer.local_addr().port();
        let spill_url = config.spill_url.clone().unwrap_or_else(|| {
            let dir = regatta_object_store::default_spill_dir().join(format!("{node}-{}", node::random_hex(3)));
            dir.to_string_lossy().into_owned()
        });
        let spill = SpillBackend::open(&spill_url)?;
        let capacity = config.capacity_bytes.unwrap_or_else(default_capacity);
        let service = Arc::new(Self {
            node: node.to_string(),
            address: format!("{}:{port}", config.advertise_host),
            link: link.clone(),
            memory: Mutex::new(MemoryStore::new(capacity)),
            room: tokio::sync::Mutex::new(()),
            spill,
            transfer,
            refs: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            segments: Mutex::new(HashMap::new()),
            making: Mutex::new(HashMap::new()),
            counters: Counters::default(),
        });
        service.transfer.serve(Arc::new(Source(Arc::downgrade(&service))));
        let (actor, _) = Actor::spawn(None, ObjectsActor, Arc::downgrade(&service))
            .await
            .map_err(|e| Error::Actor(format!("cannot start the object service actor: {e}")))?;
        node::join_group(link.scope(), &objects_group(node), actor.get_cell());
        tracing::info!(
            node,
            address = %service.address,
            capacity_bytes = capacity,
            spill = service.spill.url(),
            shared_memory = service.transfer.shared_memory(),
            "object store up"
        );
        Ok(service)
    }

    /// Current figures.
    pub fn stats(&self) -> ObjectStats {
        let memory = self.memory.lock().map(|m| m.stats()).unwrap_or_default();
        ObjectStats {
            objects_in_memory: memory.objects,
            bytes_in_memory: memory.bytes,
            capacity_bytes: memory.capacity,
            spills: self.counters.spills.load(Ordering::Relaxed),
            spilled_bytes: self.counters.spilled_bytes.load(Ordering::Relaxed),
            restores: self.counters.restores.load(Ordering::Relaxed),
            transfer_in_bytes: self.counters.transfer_in.load(Ordering::Relaxed),
            shared_in_bytes: self.counters.shared_in.load(Ordering::Relaxed),
            transfer_out_bytes: self.counters.transfer_out.load(Ordering::Relaxed),
            receive_pool_bytes: regatta_net::pooled_bytes() as u64,
        }
    }

    fn memory(&self) -> std::sync::MutexGuard<'_, MemoryStore> {
        // A panic while holding this lock would be a bug in MemoryStore; keep serving.
        self.memory.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Stores bytes (no copy) and registers them with the head; this process holds the
    /// first reference.
    pub async fn put(self: &Arc<Self>, bytes: Bytes, job: Option<String>) -> Result<ObjectId> {
        self.put_held(bytes, None, job).await
    }

    /// Stores an object whose bytes are already in a sealed segment (written there by this
    /// process): the store holds its mapping, and same-host peers and readers map the same
    /// pages, so the object is on the host once.
    pub async fn put_segment(self: &Arc<Self>, segment: Segment, job: Option<String>) -> Result<ObjectId> {
        let segment = Arc::new(segment);
        let bytes = segment
            .map_lazily()
            .map_err(|e| Error::Rejected(format!("cannot map the object's segment: {e}")))?;
        self.put_held(bytes, Some(segment), job).await
    }

    async fn put_held(
        self: &Arc<Self>,
        bytes: Bytes,
        segment: Option<Arc<Segment>>,
        job: Option<String>,
    ) -> Result<ObjectId> {
        let id = ObjectId::random();
        let checksum = crc32(&bytes);
        let size = bytes.len() as u64;
        self.store(id, bytes).await?;
        if let Some(segment) = segment {
            self.keep_segment(id, segment);
        }
        self.count_ref(id);
        let put = HeadRequest::ObjectPut {
            id,
            size,
            checksum,
            node: self.node.clone(),
            address: self.address.clone(),
            job,
        };
        // Registration is sent, not awaited: the head parks lookups of an id it has not
        // heard of yet for a short while, so a reference that overtakes its registration
        // still resolves. A head that cannot be reached fails the put.
        if let Err(e) = self.link.send(&put) {
            self.memory().remove(id);
            self.uncount_ref(id);
            return Err(e);
        }
        Ok(id)
    }

    /// Makes room (spilling least-recently-used objects) and keeps `bytes` in memory.
    async fn store(&self, id: ObjectId, bytes: Bytes) -> Result<()> {
        let size = bytes.len() as u64;
        let _room = self.room.lock().await;
        let victims = self.memory().plan_room(size).map_err(|no| {
            Error::Object(regatta_object_store::Error::NoRoom {
                size: no.size,
                capacity: no.capacity,
                pinned: no.pinned,
            })
        })?;
        for victim in victims {
            self.spill_one(victim).await?;
        }
        if !self.memory().insert(id, bytes) {
            return Err(Error::Rejected(format!(
                "object {id} could not be stored (already present?)"
            )));
        }
        Ok(())
    }

    async fn spill_one(&self, id: ObjectId) -> Result<()> {
        let Some(bytes) = self.memory().pin(id) else {
            return Ok(());
        };
        let size = bytes.len() as u64;
        let written = self.spill.write(id, bytes).await;
        self.memory().unpin(id);
        let url = written?;
        self.memory().remove(id);
        self.segments().remove(&id);
        self.counters.spills.fetch_add(1, Ordering::Relaxed);
        self.counters.spilled_bytes.fetch_add(size, Ordering::Relaxed);
        tracing::debug!(%id, size, url = %url, "spilled");
        self.link.tell(&HeadRequest::ObjectRemoveSource {
            id,
            node: self.node.clone(),
            spilled_to: Some(url),
        });
        Ok(())
    }

    /// Drops this node's copy (and the spilled copy it wrote) on the head's order.
    async fn release(&self, id: ObjectId, spilled: Option<String>) {
        self.memory().remove(id);
        self.segments().remove(&id);
        if let Some(url) = spilled {
            if let Err(e) = regatta_object_store::delete_spilled(&url).await {
                tracing::warn!(%id, error = %e, "could not delete a spilled copy");
            }
        }
    }

    /// The copies this process holds in memory, for a registration with the head.
    pub(crate) fn held(&self) -> Vec<HeldObject> {
        let copies = self.memory().held();
        let refs = self.refs.lock().unwrap_or_else(|p| p.into_inner());
        copies
            .into_iter()
            .map(|(id, bytes)| HeldObject {
                id,
                size: bytes.len() as u64,
                checksum: crc32(&bytes),
                referenced: refs.contains_key(&id),
            })
            .collect()
    }

    /// This store's node name and transfer address, as the head's directory knows them.
    pub(crate) fn location(&self) -> (&str, &str) {
        (&self.node, &self.address)
    }

    fn count_ref(&self, id: ObjectId) -> bool {
        let mut refs = self.refs.lock().unwrap_or_else(|p| p.into_inner());
        let count = refs.entry(id).or_insert(0);
        *count += 1;
        *count == 1
    }

    fn uncount_ref(&self, id: ObjectId) -> bool {
        let mut refs = self.refs.lock().unwrap_or_else(|p| p.into_inner());
        match refs.get_mut(&id) {
            Some(count) if *count > 1 => {
                *count -= 1;
                false
            }
            Some(_) => {
                refs.remove(&id);
                true
            }
            None => false,
        }
    }

    /// Registers one more local reference; the first one tells the head.
    pub(crate) async fn adopt(self: &Arc<Self>, id: ObjectId) -> Result<Arc<RefGuard>> {
        if self.count_ref(id) {
            let add = HeadRequest::ObjectAddRef {
                id,
                holder: self.node.clone(),
            };
            if let Err(e) = self.link.ask::<()>(&add, Duration::from_secs(30)).await {
                self.uncount_ref(id);
                return Err(e);
            }
        }
        Ok(Arc::new(RefGuard {
            id,
            service: Arc::downgrade(self),
        }))
    }

    pub(crate) fn guard(self: &Arc<Self>, id: ObjectId) -> Arc<RefGuard> {
        Arc::new(RefGuard {
            id,
            service: Arc::downgrade(self),
        })
    }
}

/// The process group of a process's object service.
pub(crate) fn objects_group(node: &str) -> String {
    format!("objects/{node}")
}

/// One local reference; the last one dropped in a process tells the head.
pub(crate) struct RefGuard {
    id: ObjectId,
    service: Weak<ObjectService>,
}

impl Drop for RefGuard {
    fn drop(&mut self) {
        if let Some(service) = self.service.upgrade() {
            if service.uncount_ref(self.id) {
                service.link.tell(&HeadRequest::ObjectDropRef {
                    id: self.id,
                    holder: service.node.clone(),
                });
            }
        }
    }
}

/// Receives the head's release orders for one process's objects.
struct ObjectsActor;

impl Actor for ObjectsActor {
    type Msg = Wire;
    type State = Weak<ObjectService>;
    type Arguments = Weak<ObjectService>;

    async fn pre_start(
        &self,
        _me: ActorRef<Wire>,
        service: Weak<ObjectService>,
    ) -> std::result::Result<Self::State, ActorProcessingErr> {
        Ok(service)
    }

    async fn handle(
        &self,
        _me: ActorRef<Wire>,
        message: Wire,
        service: &mut Weak<ObjectService>,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let (bytes, port) = match message {
            Wire::Cast(bytes, _) => (bytes, None),
            Wire::Call(bytes, port) => (bytes, Some(port)),
            Wire::CallActor(actor, _, port) => {
                let failure = Failure::BadMessage(format!(
                    "could not decode an object command: the message is addressed to actor {actor}"
                ));
                wire::reply::<()>(port, Err(failure));
                return Ok(());
            }
            Wire::CastActor(..) | Wire::Local(_) => return Ok(()),
        };
        let outcome = wire::decode::<ObjectCommand>(&bytes, "an object command");
        if let (Ok(ObjectCommand::Release { id, spilled }), Some(service)) = (&outcome, service.upgrade()) {
            service.release(*id, spilled.clone()).await;
        }
        if let Some(port) = port {
            wire::reply(port, outcome.map(|_| ()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::shared::worth_sharing;
    use super::*;

    #[test]
    fn only_objects_of_a_mebibyte_or_more_are_shared_and_segments_are_capped() {
        assert!(!worth_sharing(SHARED_MEMORY_MIN_BYTES - 1, 0), "small objects stream");
        assert!(worth_sharing(SHARED_MEMORY_MIN_BYTES, 0));
        assert!(worth_sharing(1 << 30, MAX_SEGMENTS - 1));
        assert!(!worth_sharing(1 << 30, MAX_SEGMENTS), "no descriptor beyond the cap");
    }
}
