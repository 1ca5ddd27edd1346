//! One logical shard's documents tokenized and packed into rows of `context` inputs: the
//! documents' tokens kept from the first one a row still needs, and which documents start
//! in each row (counted once, for the data report) with the shard's state after it.

use std::collections::VecDeque;
use std::sync::Arc;

use regatta_trainer::stream::ShardState;
use regatta_trainer::{TokenizerSettings, IGNORE_INDEX};

use super::reader::ShardReader;
use super::{Row, Skipped};
use crate::data::{encode_record, TextTokenizer};
use crate::error::Result;

/// A document whose tokens are (partly) in the packer: where they start in the stream,
/// how many, how many a resumed shard skipped, and whether a row has counted it.
struct Pending {
    before: ShardState,
    start: u64,
    len: u64,
    skip: u64,
    key: String,
    counted: bool,
}

/// A shard's documents, tokenized and packed into rows of `context` inputs (row k reads
/// stream tokens `k*context ..= (k+1)*context`, as [`regatta_trainer::Packed`]).
pub(super) struct ShardPacker {
    pub(super) reader: ShardReader,
    context: u64,
    tokenizer: Arc<TextTokenizer>,
    settings: Arc<TokenizerSettings>,
    tokens: VecDeque<(i64, bool, u32)>,
    base: u64,
    pending: VecDeque<Pending>,
    next_row: u64,
    resume_skip: u64,
    exhausted: bool,
    documents: u32,
}

impl ShardPacker {
    /// Packs `reader`'s documents from its state; `resume_skip` tokens of the first one
    /// were trained on before.
    pub(super) fn new(
        reader: ShardReader,
        context: u64,
        tokenizer: Arc<TextTokenizer>,
        settings: Arc<TokenizerSettings>,
        resume_skip: u64,
    ) -> Self {
        Self {
            reader,
            context,
            tokenizer,
            settings,
            tokens: VecDeque::new(),
            base: 0,
            pending: VecDeque::new(),
            next_row: 0,
            resume_skip,
            exhausted: false,
            documents: 0,
        }
    }

    fn end(&self) -> u64 {
        self.base + self.tokens.len() as u64
    }

    fn pull(&mut self) -> Result<()> {
        let Some(pulled) = self.reader.next_doc()? else {
            self.exhausted = true;
            return Ok(());
        };
        let document = match encode_record(&self.tokenizer, &self.settings, &pulled.record) {
            Ok(document) => document,
            Err(e) => {
                // A template that does not render, text the tokenizer refuses: this row only.
                self.reader.skipped.push(Skipped {
                    what: format!("{}: {e}", pulled.key),
                });
                return Ok(());
            }
        };
        self.reader.state.chosen[pulled.source] += document.tokens.len() as u64;
        let skip = std::mem::take(&mut self.resume_skip).min(document.tokens.len() as u64);
        self.documents = self.documents.wrapping_add(1);
        let start = self.end();
        let id = self.documents;
        self.tokens.extend(
            document
                .tokens
                .iter()
                .zip(&document.loss)
                .skip(skip as usize)
                .map(|(t, l)| (*t, *l, id)),
        );
        self.pending.push_back(Pending {
            before: pulled.before,
            start,
            len: document.tokens.len() as u64 - skip,
            skip,
            key: pulled.key,
            counted: skip > 0,
        });
        Ok(())
    }

    /// The next row, or `None` once the shard's last document is trained on.
    pub(super) fn next_row(&mut self) -> Result<Option<Row>> {
        let (c, s) = (self.context, self.next_row);
        // One token past the row, so a stream ending right at its last target is known
        // to end there.
        while !self.exhausted && self.end() <= s + c + 1 {
            self.pull()?;
        }
        // Left alone, the last token (the previous row's last target) would make a row
        // with no target: the row before counted its document already.
        if self.end() <= s + 1 && self.exhausted {
            return Ok(None);
        }
        let at = |i: u64| self.tokens.get((i - self.base) as usize).copied();
        let pad = self.documents.wrapping_add(1);
        let mut row = Row {
            inputs: Vec::with_capacity(c as usize),
            targets: Vec::with_capacity(c as usize),
            documents: Vec::with_capacity(c as usize),
            shard: self.reader.shard,
            state: ShardState::default(),
            keys: Vec::new(),
        };
        for i in s..s + c {
            match at(i) {
                Some((token, _, doc)) => {
                    row.inputs.push(token);
                    row.documents.push(i64::from(doc));
                    row.targets.push(match at(i + 1) {
                        Some((next, true, next_doc)) if next_doc == doc => next,
                        _ => IGNORE_INDEX,
                    });
                }
                None => {
                    row.inputs.push(0);
                    row.documents.push(i64::from(pad));
                    row.targets.push(IGNORE_INDEX);
                }
            }
        }
        // A document starting at the row's last target is counted here when nothing
        // follows it (no next row will have it as an input).
        let horizon = if self.exhausted && self.end() == s + c + 1 {
            s + c + 1
        } else {
            s + c
        };
        for p in self.pending.iter_mut().filter(|p| p.start < horizon && !p.counted) {
            p.counted = true;
            row.keys.push(p.key.clone());
        }
        let e = s + c;
        self.next_row = e;
        row.state = match self.pending.iter().find(|p| p.start <= e && e < p.start + p.len) {
            Some(p) => ShardState {
                partial: e - p.start + p.skip,
                ..p.before.clone()
            },
            None => {
                let mut state = self.reader.state.clone();
                state.partial = 0;
                state
            }
        };
        while self.pending.front().is_some_and(|p| p.start + p.len <= e && p.counted) {
            self.pending.pop_front();
        }
        let drop = (e.min(self.end()) - self.base) as usize;
        self.tokens.drain(..drop);
        self.base += drop as u64;
        Ok(Some(row))
    }
}
