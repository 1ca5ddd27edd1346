//! Objects from a driver's or an actor's side: [`ObjectRef`] and `put`, `get`, `wait` and
//! `free` on [`Cluster`].

use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use regatta_object_store::{ObjectId, Segment};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::cluster::Cluster;
use crate::error::{failure_to_error, Result};
use crate::net::wire;
use crate::objects::{ObjectStats, RefGuard};
use regatta_proto::HeadRequest;

/// Time beyond a wait's own deadline for the head's answer to arrive.
const WAIT_SLACK: Duration = Duration::from_secs(5);

/// A reference to an object of type `T` somewhere in the cluster. Cheap to clone and to
/// send inside actor messages (only the id travels). A reference received in a message
/// is held by the receiver from its first use ([`Cluster::get`]) or [`Cluster::adopt`];
/// the head keeps unreferenced objects for a grace period so references in flight survive.
pub struct ObjectRef<T> {
    id: ObjectId,
    guard: OnceLock<Arc<RefGuard>>,
    _type: PhantomData<fn() -> T>,
}

impl<T> ObjectRef<T> {
    /// The object's id.
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// A reference to an existing object by id (held once used).
    pub fn from_id(id: ObjectId) -> Self {
        Self {
            id,
            guard: OnceLock::new(),
            _type: PhantomData,
        }
    }
}

impl<T> Clone for ObjectRef<T> {
    fn clone(&self) -> Self {
        let guard = OnceLock::new();
        if let Some(existing) = self.guard.get() {
            let _ = guard.set(existing.clone());
        }
        Self {
            id: self.id,
            guard,
            _type: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for ObjectRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectRef({})", self.id)
    }
}

impl<T> Serialize for ObjectRef<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.id.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for ObjectRef<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        ObjectId::deserialize(deserializer).map(Self::from_id)
    }
}

impl Cluster {
    /// Stores a value (encoded with bincode) and returns a reference to it.
    pub async fn put<T: Serialize>(&self, value: &T) -> Result<ObjectRef<T>> {
        self.put_raw(Bytes::from(wire::encode(value))).await
    }

    /// Stores bytes; handing over a `Vec<u8>` or `Bytes` moves them without a copy.
    pub async fn put_bytes(&self, bytes: impl Into<Bytes>) -> Result<ObjectRef<Bytes>> {
        self.put_raw(bytes.into()).await
    }

    /// Stores an object whose bytes this process wrote into a sealed shared-memory
    /// segment: the store keeps that segment's mapping instead of a copy, and readers on
    /// this host map the same pages.
    pub async fn put_segment(&self, segment: Segment) -> Result<ObjectRef<Bytes>> {
        let service = self.object_service()?;
        let id = service.put_segment(segment, self.job().map(str::to_string)).await?;
        let reference = ObjectRef::from_id(id);
        let _ = reference.guard.set(service.guard(id));
        Ok(reference)
    }

    async fn put_raw<T>(&self, bytes: Bytes) -> Result<ObjectRef<T>> {
        let service = self.object_service()?;
        let id = service.put(bytes, self.job().map(str::to_string)).await?;
        let reference = ObjectRef::from_id(id);
        let _ = reference.guard.set(service.guard(id));
        Ok(reference)
    }

    /// Reads a value.
    pub async fn get<T: DeserializeOwned>(&self, reference: &ObjectRef<T>) -> Result<T> {
        let bytes = self.get_bytes(reference).await?;
        wire::decode(&bytes, &format!("object {}", reference.id)).map_err(|f| failure_to_error(f, None))
    }

    /// Reads an object's bytes: shared, not copied, when this node holds it.
    pub async fn get_bytes<T>(&self, reference: &ObjectRef<T>) -> Result<Bytes> {
        self.adopt(reference).await?;
        self.object_service()?.get(reference.id, Duration::from_secs(600)).await
    }

    /// Makes this process a holder of a reference it received in a message.
    pub async fn adopt<T>(&self, reference: &ObjectRef<T>) -> Result<()> {
        if reference.guard.get().is_none() {
            let guard = self.object_service()?.adopt(reference.id).await?;
            let _ = reference.guard.set(guard);
        }
        Ok(())
    }

    /// Waits until `k` of the objects are readable or `timeout` passes; returns the ready
    /// and the not-ready references, in their original order.
    pub async fn wait<T>(
        &self,
        references: &[ObjectRef<T>],
        k: usize,
        timeout: Duration,
    ) -> Result<(Vec<ObjectRef<T>>, Vec<ObjectRef<T>>)> {
        let request = HeadRequest::ObjectsWait {
            ids: references.iter().map(|r| r.id).collect(),
            wanted: k,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        };
        // The head answers at the wait's own deadline at the latest; a little more here
        // covers the trip.
        let ready: Vec<ObjectId> = self.ask_head(&request, timeout.saturating_add(WAIT_SLACK)).await?;
        let ready: std::collections::HashSet<ObjectId> = ready.into_iter().collect();
        Ok(references.iter().cloned().partition(|r| ready.contains(&r.id)))
    }

    /// Frees an object everywhere now, even if others still reference it.
    pub async fn free<T>(&self, reference: &ObjectRef<T>) -> Result<()> {
        self.ask_head(&HeadRequest::ObjectFree(reference.id), Duration::from_secs(30))
            .await
    }

    /// This process's object store figures.
    pub fn object_stats(&self) -> Result<ObjectStats> {
        Ok(self.object_service()?.stats())
    }
}
