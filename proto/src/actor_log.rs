//! Each worker's recent log lines per hosted actor: what the agent saw happen to it (started,
//! failed to start, exited, stopped) and what the actor wrote with `ActorContext::log`. The
//! dashboard's actor page reads them through the actor's node agent
//! (`AgentRequest::Logs`).
//!
//! Bounds: [`MAX_LINES`] lines per actor (oldest dropped first), lines cut at
//! [`MAX_LINE_BYTES`], at most [`MAX_ACTORS`] actors (the one written to least recently
//! goes first).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::protocol::ActorId;

/// Lines kept per actor.
pub const MAX_LINES: usize = 200;
/// Longest line kept, in bytes (longer ones are cut and marked).
pub const MAX_LINE_BYTES: usize = 4096;
/// Actors whose lines are kept per worker.
pub const MAX_ACTORS: usize = 10_000;

/// One line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The text (one line, no newline).
    pub text: String,
    /// Its number on this node: later lines have larger numbers (a reader's cursor).
    #[serde(default)]
    pub seq: u64,
    /// Written while a call runs, for its caller to follow (Python's prints of a long
    /// call: the caller's driver prints them as they come, not with the call's result).
    #[serde(default)]
    pub live: bool,
}

/// The lines of every actor a worker hosts or hosted lately.
#[derive(Default)]
pub struct ActorLogBook {
    lines: BTreeMap<ActorId, (u64, VecDeque<LogLine>)>,
    writes: u64,
    /// Lines written so far (the next line's `seq`).
    written: u64,
}

impl ActorLogBook {
    /// Nothing kept.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps `text` (each of its lines) for `actor`.
    pub fn push(&mut self, actor: ActorId, at_ms: u64, text: &str) {
        self.push_marked(actor, at_ms, text, false);
    }

    /// Keeps `text` for `actor`, marked `live` (for the caller of the call that wrote it).
    pub fn push_marked(&mut self, actor: ActorId, at_ms: u64, text: &str, live: bool) {
        if !self.lines.contains_key(&actor) && self.lines.len() >= MAX_ACTORS {
            let oldest = self
                .lines
                .iter()
                .min_by_key(|(_, (written, _))| *written)
                .map(|(id, _)| *id);
            if let Some(oldest) = oldest {
                self.lines.remove(&oldest);
            }
        }
        self.writes += 1;
        let (written, lines) = self.lines.entry(actor).or_default();
        *written = self.writes;
        for line in text.lines() {
            if lines.len() >= MAX_LINES {
                lines.pop_front();
            }
            self.written += 1;
            lines.push_back(LogLine {
                at_ms,
                text: cut(line),
                seq: self.written,
                live,
            });
        }
    }

    /// Marks the last `count` lines kept for `actor` live: a call's first lines, written
    /// as they came, that its caller is to follow now that the call runs long.
    pub fn mark_live(&mut self, actor: ActorId, count: usize) {
        if let Some((_, lines)) = self.lines.get_mut(&actor) {
            for line in lines.iter_mut().rev().take(count) {
                line.live = true;
            }
        }
    }

    /// The kept lines of `actor`, oldest first.
    pub fn lines(&self, actor: ActorId) -> Vec<LogLine> {
        self.lines
            .get(&actor)
            .map(|(_, lines)| lines.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// `line` within [`MAX_LINE_BYTES`], cut on a character boundary and marked.
fn cut(line: &str) -> String {
    if line.len() <= MAX_LINE_BYTES {
        return line.to_string();
    }
    let mut end = MAX_LINE_BYTES;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} [cut: {} bytes]", &line[..end], line.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_kept_per_actor_within_the_bounds() {
        let mut book = ActorLogBook::new();
        book.push(ActorId(1), 5, "started\nready");
        book.push(ActorId(2), 6, "other");
        let texts = |book: &ActorLogBook, id| book.lines(ActorId(id)).into_iter().map(|l| l.text).collect::<Vec<_>>();
        assert_eq!(texts(&book, 1), vec!["started", "ready"]);
        assert_eq!(book.lines(ActorId(2))[0].at_ms, 6);
        assert!(book.lines(ActorId(3)).is_empty());
        for i in 0..MAX_LINES + 5 {
            book.push(ActorId(1), 7, &format!("line {i}"));
        }
        let kept = texts(&book, 1);
        assert_eq!(kept.len(), MAX_LINES);
        assert_eq!(kept.last().unwrap(), &format!("line {}", MAX_LINES + 4));
        let long = "é".repeat(MAX_LINE_BYTES);
        book.push(ActorId(2), 8, &long);
        let cut = &texts(&book, 2)[1];
        assert!(cut.len() < MAX_LINE_BYTES + 40 && cut.ends_with(&format!("[cut: {} bytes]", long.len())));
    }

    #[test]
    fn the_actor_written_to_least_recently_goes_first() {
        let mut book = ActorLogBook::new();
        for id in 0..MAX_ACTORS as u64 {
            book.push(ActorId(id), 0, "x");
        }
        book.push(ActorId(0), 1, "still here");
        book.push(ActorId(u64::MAX), 2, "new");
        assert_eq!(book.lines(ActorId(0)).len(), 2);
        assert!(
            book.lines(ActorId(1)).is_empty(),
            "actor 1 was written to least recently"
        );
        assert_eq!(book.lines(ActorId(u64::MAX)).len(), 1);
    }

    #[test]
    fn lines_are_numbered_in_order_across_actors_and_keep_their_mark() {
        let mut book = ActorLogBook::new();
        book.push(ActorId(1), 5, "a\nb");
        book.push_marked(ActorId(2), 5, "live one", true);
        book.push(ActorId(1), 6, "c");
        let one = book.lines(ActorId(1));
        assert_eq!(one.iter().map(|l| l.seq).collect::<Vec<_>>(), vec![1, 2, 4]);
        assert!(one.iter().all(|l| !l.live));
        let two = book.lines(ActorId(2));
        assert_eq!((two[0].seq, two[0].live, two[0].text.as_str()), (3, true, "live one"));
        book.mark_live(ActorId(1), 2);
        let live: Vec<bool> = book.lines(ActorId(1)).iter().map(|l| l.live).collect();
        assert_eq!(live, vec![false, true, true]);
        book.mark_live(ActorId(9), 1);
        assert!(book.lines(ActorId(9)).is_empty());
    }
}
