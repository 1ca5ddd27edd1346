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
use futures::future::{BoxFuture, FutureExt, Shared};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use regatta_object_store::{
    crc32, Fetched, Location, MemoryStore, ObjectId, ObjectSource, Segment, SpillBackend, TlsIdentity, Transfer,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::headlink::HeadLink;
use crate::node;
use crate::protocol::{Failure, HeadRequest, HeldObject, ObjectCommand};
use crate::wire::{self, Wire};

/// Default share of this machine's memory an object store may hold.
pub const DEFAULT_MEMORY_SHARE: f64 = 0.3;

/// How a process stores objects.
#[derive(Clone, Debug)]
pub struct ObjectConfig {
    /// Bytes kept in memory before spilling (default: 30% of RAM).
    pub capacity_bytes: Option<u64>,
    /// Where spilled objects go: a directory, `file://` or `s3://` URL
    /// (default: `/tmp/regatta/spill/<node>`).
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

type Fetch = Shared<BoxFuture<'static, std::result::Result<Bytes, PullFailure>>>;

/// Why a pull found no copy, and whether asking the head again may help.
#[derive(Clone, Debug)]
struct PullFailure {
    message: String,
    /// Every holder failed to answer (not corrupt, not refused): it may be dying, and the
    /// head will say so once it notices.
    transient: bool,
}

/// Smallest object handed to a same-host peer through shared memory: below it streaming
/// costs about as little, and a segment holds a descriptor for as long as the object is held.
pub const SHARED_MEMORY_MIN_BYTES: u64 = 1 << 20;

/// Most shared-memory segments one process holds at once (each is an open descriptor);
/// beyond it objects are streamed to same-host peers too.
pub const MAX_SEGMENTS: usize = 256;

/// Whether to make a shared-memory segment for an object of `len` bytes while holding
/// `segments_held` of them.
fn worth_sharing(len: u64, segments_held: usize) -> bool {
    len >= SHARED_MEMORY_MIN_BYTES && segments_held < MAX_SEGMENTS
}

/// How long a node waits for the head to name the holder to pull from: in a broadcast the
/// head holds the answer until a holder has room, as long as the pulls ahead take; the
/// get's own timeout is what bounds a caller's wait.
const PULL_ASK_TIMEOUT: Duration = Duration::from_secs(600);

/// A pull under way: tells the head it ended when it did without keeping a copy here (a
/// kept copy's `ObjectAddSource` says so), whatever the way out (an error, the getters
/// giving up), so that the holder's share it held is free at once.
struct PullEnd<'a> {
    service: &'a ObjectService,
    id: ObjectId,
    kept: bool,
}

impl Drop for PullEnd<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.service.link.tell(&HeadRequest::ObjectPullEnded {
                id: self.id,
                node: self.service.node.clone(),
            });
        }
    }
}

/// Pause before pulling again from holders that did not answer.
const PULL_RETRY: Duration = Duration::from_millis(250);

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
    crate::detect::total_memory_bytes()
        .map(|total| (total as f64 * DEFAULT_MEMORY_SHARE) as u64)
        .unwrap_or(1 << 30)
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
        let spill_url = config
            .spill_url
            .clone()
            .unwrap_or_else(|| format!("/tmp/regatta/spill/{node}-{}", node::random_hex(3)));
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
            receive_pool_bytes: regatta_object_store::pooled_bytes() as u64,
        }
    }

    fn memory(&self) -> std::sync::MutexGuard<'_, MemoryStore> {
        // A panic while holding this lock would be a bug in MemoryStore; keep serving.
        self.memory.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn segments(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectId, Arc<Segment>>> {
        self.segments.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The object's shared-memory segment for a same-host peer: the one made before, else
    /// (for an object of at least [`SHARED_MEMORY_MIN_BYTES`]) a new one, one copy of the
    /// bytes, after which this store holds the mapping instead of its own copy (the object is
    /// in memory once on the host however many processes read it). Blocking: runs on a
    /// blocking thread. The copy is made without holding the segments lock, which release
    /// and spill take on async threads.
    fn share(&self, id: ObjectId) -> Option<Arc<Segment>> {
        let gate = {
            let mut making = self.making.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            making.entry(id).or_default().clone()
        };
        let shared = {
            let _maker = gate.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            self.share_once(id)
        };
        let mut making = self.making.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // The last of the peers that waited removes the gate.
        if Arc::strong_count(&gate) == 2 {
            making.remove(&id);
        }
        shared
    }

    /// [`ObjectService::share`] under the object's gate.
    fn share_once(&self, id: ObjectId) -> Option<Arc<Segment>> {
        let held = {
            let segments = self.segments();
            if let Some(segment) = segments.get(&id) {
                return Some(segment.clone());
            }
            segments.len()
        };
        let bytes = self.memory().pin(id)?;
        if !worth_sharing(bytes.len() as u64, held) {
            self.memory().unpin(id);
            return None;
        }
        let made = Segment::create(&bytes).map(Arc::new).and_then(|segment| {
            let mapped = segment.map_lazily()?;
            Ok((segment, mapped))
        });
        let outcome = match made {
            Ok((segment, mapped)) => {
                let mut segments = self.segments();
                if let Some(other) = segments.get(&id) {
                    // Another peer's pull made one meanwhile: serve that, drop this one.
                    Some(other.clone())
                } else if let Ok(replaced) = self.memory().replace(id, mapped) {
                    segments.insert(id, segment.clone());
                    // Unmapping a large heap copy takes a while: not on the way to the reply.
                    let old = (bytes, replaced);
                    let _ = std::thread::Builder::new()
                        .name("regatta-free".into())
                        .spawn(move || drop(old));
                    Some(segment)
                } else {
                    // Released while the copy was made: nothing to serve.
                    None
                }
            }
            Err(e) => {
                tracing::warn!(%id, error = %e, "cannot make a shared-memory segment; peers will stream the object");
                None
            }
        };
        self.memory().unpin(id);
        outcome
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

    /// Remembers the segment that holds an object's bytes, up to [`MAX_SEGMENTS`].
    fn keep_segment(&self, id: ObjectId, segment: Arc<Segment>) {
        let mut segments = self.segments();
        if segments.len() < MAX_SEGMENTS {
            segments.insert(id, segment);
        }
    }

    /// The object's bytes and, for one of at least [`SHARED_MEMORY_MIN_BYTES`], the sealed
    /// segment that holds them (made now, one copy, when it has none yet): what a reader in
    /// this process maps itself instead of copying. Blocking for that copy.
    pub async fn get_shared(
        self: &Arc<Self>,
        id: ObjectId,
        timeout: Duration,
    ) -> Result<(Bytes, Option<Arc<Segment>>)> {
        let bytes = self.get(id, timeout).await?;
        if (bytes.len() as u64) < SHARED_MEMORY_MIN_BYTES {
            return Ok((bytes, None));
        }
        if let Some(segment) = self.segments().get(&id) {
            return Ok((bytes, Some(segment.clone())));
        }
        let me = self.clone();
        let segment = tokio::task::spawn_blocking(move || me.share(id)).await.ok().flatten();
        Ok((bytes, segment))
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

    /// The object's bytes: from memory without a copy, else pulled from a peer (mapped from
    /// a same-host peer's shared memory, or streamed; or restored from its spilled copy),
    /// checked, and cached here. A holder that cannot be reached is tried again until the
    /// head says what became of it (lost with its node) or the timeout ends.
    pub async fn get(self: &Arc<Self>, id: ObjectId, timeout: Duration) -> Result<Bytes> {
        if let Some(bytes) = self.memory().get(id) {
            return Ok(bytes);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let fetch = {
                let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                inflight
                    .entry(id)
                    .or_insert_with(|| {
                        let me = self.clone();
                        async move { me.pull(id).await }.boxed().shared()
                    })
                    .clone()
            };
            let outcome = tokio::time::timeout_at(deadline, fetch.clone()).await;
            {
                // The entry goes once its pull is over, or when this getter gave up and
                // nobody else waits on it (dropping it cancels the pull, which tells the
                // head). A pull other getters still wait on stays theirs, and a newer
                // pull's entry is not this one's to remove: one pull per node and object.
                let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                let ours = inflight.get(&id).is_some_and(|entry| entry.ptr_eq(&fetch));
                if ours && (outcome.is_ok() || fetch.strong_count() <= Some(2)) {
                    inflight.remove(&id);
                }
            }
            drop(fetch);
            match outcome {
                Ok(Ok(bytes)) => return Ok(bytes),
                Ok(Err(failure)) => {
                    let error = self.explain(id, &failure.message).await;
                    let again = tokio::time::Instant::now() + PULL_RETRY;
                    if failure.transient && matches!(error, Error::Rejected(_)) && again < deadline {
                        tracing::debug!(%id, reason = %failure.message, "no holder answered; asking again");
                        tokio::time::sleep_until(again).await;
                        continue;
                    }
                    return Err(error);
                }
                Err(_) => {
                    return Err(Error::Timeout {
                        what: format!("get of object {id}"),
                        timeout,
                    })
                }
            }
        }
    }

    /// Turns a failed pull into the typed error (lost, unknown) when the head knows why.
    async fn explain(&self, id: ObjectId, message: &str) -> Error {
        match self
            .link
            .ask::<Location>(&HeadRequest::ObjectLocate(id), Duration::from_secs(5))
            .await
        {
            Err(e @ (Error::ObjectLost { .. } | Error::ObjectUnknown { .. })) => e,
            _ => Error::Rejected(format!("object {id} could not be read: {message}")),
        }
    }

    async fn pull(self: Arc<Self>, id: ObjectId) -> std::result::Result<Bytes, PullFailure> {
        // Until this node keeps a copy (and tells the head), its pull may hold a share of a
        // holder's sending at the head; any other way out of here frees it.
        let mut end = PullEnd {
            service: &self,
            id,
            kept: false,
        };
        // The head names the holder to pull from first: in a broadcast it holds the answer
        // back until a holder has room in its share, for as long as the pulls ahead take.
        // The get's own timeout bounds the wait.
        let ask = HeadRequest::ObjectPull {
            id,
            node: self.node.clone(),
            address: self.address.clone(),
        };
        let location: Location = self.link.ask(&ask, PULL_ASK_TIMEOUT).await.map_err(|e| PullFailure {
            message: e.to_string(),
            transient: false,
        })?;
        let mut failures = Vec::new();
        // Whether every copy failed only for want of an answer (its holder may be dying).
        let mut transient = true;
        for (node, address) in &location.sources {
            if node == &self.node {
                continue;
            }
            let Ok(peer) = address.parse::<SocketAddr>() else {
                failures.push(format!("{node}: bad address {address}"));
                transient = false;
                continue;
            };
            match self.transfer.fetch(peer, id, location.size, location.checksum).await {
                Ok(Fetched { bytes, segment }) => {
                    self.counters.transfer_in.fetch_add(location.size, Ordering::Relaxed);
                    if segment.is_some() {
                        self.counters.shared_in.fetch_add(location.size, Ordering::Relaxed);
                    }
                    end.kept = self.cache(id, bytes.clone()).await;
                    // The segment (an open descriptor) is kept while there is room for it: a
                    // reader here that maps objects itself maps these pages, not a copy.
                    if let (true, Some(segment)) = (end.kept, segment) {
                        self.keep_segment(id, segment);
                    }
                    return Ok(bytes);
                }
                Err(e) => {
                    tracing::warn!(%id, node = %node, error = %e, "pull failed; trying the next copy");
                    transient &= matches!(
                        e,
                        regatta_object_store::Error::Transfer(_) | regatta_object_store::Error::NotHeld { .. }
                    );
                    failures.push(format!("{node}: {e}"));
                }
            }
        }
        if let Some(url) = &location.spilled {
            match regatta_object_store::restore(url, id, location.size, location.checksum).await {
                Ok(bytes) => {
                    self.counters.restores.fetch_add(1, Ordering::Relaxed);
                    end.kept = self.cache(id, bytes.clone()).await;
                    return Ok(bytes);
                }
                Err(e) => {
                    failures.push(format!("spilled copy: {e}"));
                    transient = false;
                }
            }
        }
        if failures.is_empty() {
            failures.push("no copy is held anywhere".into());
            transient = false;
        }
        Err(PullFailure {
            message: failures.join("; "),
            transient,
        })
    }

    /// Keeps a pulled copy here if there is room, and tells the head; true when it is kept.
    async fn cache(&self, id: ObjectId, bytes: Bytes) -> bool {
        if self.memory().contains(id) {
            return false;
        }
        match self.store(id, bytes).await {
            Ok(()) => {
                self.link.tell(&HeadRequest::ObjectAddSource {
                    id,
                    node: self.node.clone(),
                    address: self.address.clone(),
                });
                true
            }
            Err(e) => {
                tracing::debug!(%id, error = %e, "not caching a pulled object");
                false
            }
        }
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
            Wire::Cast(bytes) => (bytes, None),
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
    use super::*;

    #[test]
    fn only_objects_of_a_mebibyte_or_more_are_shared_and_segments_are_capped() {
        assert!(!worth_sharing(SHARED_MEMORY_MIN_BYTES - 1, 0), "small objects stream");
        assert!(worth_sharing(SHARED_MEMORY_MIN_BYTES, 0));
        assert!(worth_sharing(1 << 30, MAX_SEGMENTS - 1));
        assert!(!worth_sharing(1 << 30, MAX_SEGMENTS), "no descriptor beyond the cap");
    }
}
