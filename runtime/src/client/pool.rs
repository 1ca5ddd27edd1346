//! An actor pool with Ray's `ActorPool` semantics: work is handed to idle actors, queued
//! while all are busy, and results come back in submission order (`get_next`) or as they
//! finish (`get_next_unordered`).
//!
//! [`PoolBook`] (in `regatta-proto`) is the pure bookkeeping (who is idle, what waits, what
//! finished); [`ActorPool`] is the async shell that makes the calls.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};

use super::actor::Actor;
use super::handle::ActorHandle;
use crate::error::{Error, Result};
use regatta_proto::{PoolBook, Seq};

type Call<A> = BoxFuture<'static, (Seq, usize, Result<<A as Actor>::Reply>)>;

/// A pool of actors of kind `A`.
pub struct ActorPool<A: Actor> {
    actors: Vec<Option<ActorHandle<A>>>,
    book: PoolBook<A::Request>,
    running: FuturesUnordered<Call<A>>,
    results: BTreeMap<Seq, Result<A::Reply>>,
    timeout: Duration,
}

impl<A: Actor> ActorPool<A>
where
    A::Request: Clone + Sync,
{
    /// A pool over these actors.
    pub fn new(actors: Vec<ActorHandle<A>>) -> Self {
        let book = PoolBook::new(actors.len());
        Self {
            actors: actors.into_iter().map(Some).collect(),
            book,
            running: FuturesUnordered::new(),
            results: BTreeMap::new(),
            timeout: super::cluster::DEFAULT_CALL_TIMEOUT,
        }
    }

    /// Sets the timeout of each call.
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn dispatch(&mut self, seq: Seq, actor: usize, item: A::Request) {
        let Some(handle) = self.actors.get(actor).and_then(|a| a.clone()) else {
            self.results
                .insert(seq, Err(Error::Rejected(format!("pool actor {actor} was removed"))));
            return;
        };
        let timeout = self.timeout;
        self.running.push(Box::pin(async move {
            (seq, actor, handle.call_timeout(item, timeout).await)
        }));
    }

    /// Submits one item; it runs on an idle actor now or when one frees up.
    pub fn submit(&mut self, item: A::Request) -> Seq {
        let (seq, now) = self.book.submit(item);
        if let Some((actor, item)) = now {
            self.dispatch(seq, actor, item);
        }
        seq
    }

    /// Waits for one call to finish and hands its actor the next queued item.
    async fn advance(&mut self) -> bool {
        let Some((seq, actor, result)) = self.running.next().await else {
            return false;
        };
        self.results.insert(seq, result);
        if let Some((next, actor, item)) = self.book.finished(seq, actor) {
            self.dispatch(next, actor, item);
        }
        true
    }

    /// Whether results are outstanding.
    pub fn has_next(&self) -> bool {
        self.book.has_next() || !self.results.is_empty()
    }

    /// Whether an actor is idle.
    pub fn has_free(&self) -> bool {
        self.book.has_free()
    }

    /// The next result in submission order.
    pub async fn get_next(&mut self) -> Result<A::Reply> {
        let wanted = self.book.next_in_order();
        loop {
            if let Some(result) = self.results.remove(&wanted) {
                self.book.taken(wanted);
                return result;
            }
            if !self.advance().await {
                return Err(Error::Rejected("no pending results in the pool".into()));
            }
        }
    }

    /// Whichever result finishes first.
    pub async fn get_next_unordered(&mut self) -> Result<A::Reply> {
        if self.results.is_empty() && !self.advance().await {
            return Err(Error::Rejected("no pending results in the pool".into()));
        }
        let seq = *self.results.keys().next().expect("a result was just added");
        let result = self.results.remove(&seq).expect("the key exists");
        self.book.taken(seq);
        result
    }

    /// Runs every item and returns the results in order.
    pub async fn map(&mut self, items: impl IntoIterator<Item = A::Request>) -> Vec<Result<A::Reply>> {
        let seqs: Vec<Seq> = items.into_iter().map(|item| self.submit(item)).collect();
        let mut out = Vec::with_capacity(seqs.len());
        for _ in seqs {
            out.push(self.get_next().await);
        }
        out
    }

    /// Runs every item and returns the results as they finish.
    pub async fn map_unordered(&mut self, items: impl IntoIterator<Item = A::Request>) -> Vec<Result<A::Reply>> {
        let count = items.into_iter().map(|item| self.submit(item)).count();
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            out.push(self.get_next_unordered().await);
        }
        out
    }

    /// Adds an actor to the pool.
    pub fn push(&mut self, actor: ActorHandle<A>) {
        self.actors.push(Some(actor));
        if let Some((seq, index, item)) = self.book.push(self.actors.len() - 1) {
            self.dispatch(seq, index, item);
        }
    }

    /// Removes and returns an idle actor.
    pub fn pop_idle(&mut self) -> Option<ActorHandle<A>> {
        let index = self.book.pop_idle()?;
        self.actors.get_mut(index).and_then(Option::take)
    }
}
