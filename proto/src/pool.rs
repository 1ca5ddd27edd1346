//! An actor pool's bookkeeping with Ray's `ActorPool` semantics: work goes to idle actors,
//! waits while all are busy, and results come out in submission order or as they finish.
//! The runtime's `ActorPool` makes the calls around it.

use std::collections::{BTreeMap, VecDeque};

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
