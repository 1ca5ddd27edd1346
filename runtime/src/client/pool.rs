//! An actor pool with Ray's `ActorPool` semantics: work is handed to idle actors, queued
//! while all are busy, and results come back in submission order (`get_next`) or as they
//! finish (`get_next_unordered`).
//!
//! [`PoolBook`] is the pure bookkeeping (who is idle, what waits, what finished);
//! [`ActorPool`] is the async shell that makes the calls.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};

use super::actor::Actor;
use super::handle::ActorHandle;
use crate::error::{Error, Result};

/// Sequence number of a submitted item.
pub type Seq = u64;

/// The pool's bookkeeping, free of I/O.
#[derive(Debug, Default)]
pub struct PoolBook<T> {
    idle: VecDeque<usize>,
    pending: VecDeque<(Seq, T)>,
    in_flight: usize,
    next_seq: Seq,
    next_out: Seq,
    done: BTreeMap<Seq, ()>,
    handed: std::collections::BTreeSet<Seq>,
}

impl<T> PoolBook<T> {
    /// A pool over actors `0..actors`, all idle.
    pub fn new(actors: usize) -> Self {
        Self {
            idle: (0..actors).collect(),
            pending: VecDeque::new(),
            in_flight: 0,
            next_seq: 0,
            next_out: 0,
            done: BTreeMap::new(),
            handed: std::collections::BTreeSet::new(),
        }
    }

    /// Accepts an item: returns `Some((seq, actor, item))` to dispatch now, or queues it.
    pub fn submit(&mut self, item: T) -> (Seq, Option<(usize, T)>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        match self.idle.pop_front() {
            Some(actor) => {
                self.in_flight += 1;
                (seq, Some((actor, item)))
            }
            None => {
                self.pending.push_back((seq, item));
                (seq, None)
            }
        }
    }

    /// An item finished on `actor`: the actor takes the next queued item, if any.
    pub fn finished(&mut self, seq: Seq, actor: usize) -> Option<(Seq, usize, T)> {
        self.in_flight -= 1;
        self.done.insert(seq, ());
        match self.pending.pop_front() {
            Some((next, item)) => {
                self.in_flight += 1;
                Some((next, actor, item))
            }
            None => {
                self.idle.push_back(actor);
                None
            }
        }
    }

    /// The sequence number `get_next` returns next.
    pub fn next_in_order(&self) -> Seq {
        self.next_out
    }

    /// Marks a result as handed out.
    pub fn taken(&mut self, seq: Seq) {
        self.done.remove(&seq);
        self.handed.insert(seq);
        while self.handed.remove(&self.next_out) {
            self.next_out += 1;
        }
    }

    /// Whether any submitted result has not been handed out.
    pub fn has_next(&self) -> bool {
        self.in_flight > 0 || !self.pending.is_empty() || !self.done.is_empty()
    }

    /// Whether an actor is idle.
    pub fn has_free(&self) -> bool {
        !self.idle.is_empty() && self.pending.is_empty()
    }

    /// Adds an actor (idle, or taking queued work at once).
    pub fn push(&mut self, actor: usize) -> Option<(Seq, usize, T)> {
        match self.pending.pop_front() {
            Some((seq, item)) => {
                self.in_flight += 1;
                Some((seq, actor, item))
            }
            None => {
                self.idle.push_back(actor);
                None
            }
        }
    }

    /// Removes an idle actor.
    pub fn pop_idle(&mut self) -> Option<usize> {
        self.idle.pop_back()
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_waits_for_a_free_actor_and_runs_in_order_of_submission() {
        let mut book = PoolBook::new(2);
        assert_eq!(book.submit("a"), (0, Some((0, "a"))));
        assert_eq!(book.submit("b"), (1, Some((1, "b"))));
        assert_eq!(book.submit("c"), (2, None));
        assert!(!book.has_free());
        assert_eq!(
            book.finished(1, 1),
            Some((2, 1, "c")),
            "the freed actor takes queued work"
        );
        assert_eq!(book.finished(0, 0), None);
        assert!(book.has_free());
        assert_eq!(book.next_in_order(), 0);
        book.taken(0);
        assert_eq!(book.next_in_order(), 1);
        book.taken(1);
        assert_eq!(book.finished(2, 1), None);
        book.taken(2);
        assert!(!book.has_next());
    }

    #[test]
    fn unordered_hand_outs_keep_the_in_order_cursor_right() {
        let mut book = PoolBook::new(3);
        for item in ["a", "b", "c"] {
            book.submit(item);
        }
        book.finished(2, 2);
        book.taken(2);
        assert_eq!(book.next_in_order(), 0);
        book.finished(0, 0);
        book.taken(0);
        assert_eq!(book.next_in_order(), 1);
        book.finished(1, 1);
        book.taken(1);
        assert_eq!(book.next_in_order(), 3, "skips the one already handed out");
    }

    #[test]
    fn pushed_actors_take_queued_work_and_idle_ones_can_be_popped() {
        let mut book: PoolBook<&str> = PoolBook::new(0);
        assert_eq!(book.submit("x"), (0, None));
        assert_eq!(book.push(7), Some((0, 7, "x")));
        assert_eq!(book.finished(0, 7), None);
        assert_eq!(book.pop_idle(), Some(7));
        assert_eq!(book.pop_idle(), None);
    }
}
