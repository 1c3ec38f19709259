//! A queue's entries as columns indexed by `seq - base`, and their order (`entries.py`).

use crate::types::*;
use pyo3::prelude::*;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::sync::Arc;

/// Columns are trimmed when at least this many done slots sit at the front and they are at
/// least half of the table (as `entries._TRIM_AT_LEAST`).
const TRIM_AT_LEAST: usize = 4096;

/// A position in queue order: (rank, seq). FIFO queues use rank 0 (order by seq); priority
/// queues rank by `priority_rank`, lower first, ties by age.
pub type Pos = (i128, i64);
pub const POS_MIN: Pos = (i128::MIN, i64::MIN);
pub const POS_MAX: Pos = (i128::MAX, i64::MAX);

pub struct Source {
    pub topic: Name,
    pub partition: i64,
    pub offsets: Vec<i64>,
    pub seqs: Vec<i64>,
    pub head: usize,
    pub expiry_index: usize,
    pub next_offset: i64,
    pub floor: i64,
    /// `Source.deferred_from`: the first offset deferred past target_queue_depth (-1: none).
    pub deferred_from: i64,
    /// `Source.purge_until`.
    pub purge_until: i64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Location {
    Found(Seq),
    Done,
    Unknown,
}

impl Source {
    fn new(topic: Name, partition: i64, next_offset: i64) -> Self {
        Self {
            topic,
            partition,
            offsets: Vec::new(),
            seqs: Vec::new(),
            head: 0,
            expiry_index: 0,
            next_offset,
            floor: next_offset,
            deferred_from: -1,
            purge_until: -1,
        }
    }

    pub fn advance_head(&mut self, state: &[u8], base: i64) {
        let mut head = self.head;
        let end = self.seqs.len();
        while head < end {
            let seq = self.seqs[head];
            if seq >= base && state[(seq - base) as usize] < ACKED {
                break;
            }
            head += 1;
        }
        self.head = head;
    }

    pub fn recovery_point(&mut self, state: &[u8], base: i64) -> i64 {
        self.advance_head(state, base);
        if self.head < self.offsets.len() {
            self.offsets[self.head]
        } else if self.deferred_from < 0 {
            self.next_offset
        } else {
            // Deferred records are not settled: the point stays at the first of them.
            self.deferred_from
        }
    }

    pub fn locate(&self, offset: i64) -> Location {
        if offset < self.floor {
            return Location::Done;
        }
        if offset >= self.next_offset {
            return Location::Unknown;
        }
        match self.offsets.binary_search(&offset) {
            Ok(index) => Location::Found(self.seqs[index]),
            Err(_) => Location::Unknown,
        }
    }

    fn trim(&mut self) {
        let head = self.head;
        if head < TRIM_AT_LEAST || head * 2 < self.offsets.len() {
            return;
        }
        self.floor = if head < self.offsets.len() {
            self.offsets[head]
        } else if self.deferred_from < 0 {
            self.next_offset
        } else {
            self.deferred_from // deferred offsets are not done
        };
        self.offsets.drain(..head);
        self.seqs.drain(..head);
        self.expiry_index = self.expiry_index.saturating_sub(head);
        self.head = 0;
    }
}

pub struct Table {
    pub base: i64,
    pub first_live: i64,
    pub state: Vec<u8>,
    pub source_ids: Vec<u32>,
    pub offsets: Vec<i64>,
    pub times: Vec<f64>,
    pub docs: Vec<Py<PyAny>>,
    pub keys: Option<Vec<Option<Arc<[u8]>>>>,
    pub key_next: Option<Vec<i64>>,
    pub ranks: Option<Vec<i128>>,
    pub sources: Vec<Source>,
    /// topic -> partition -> index in `sources` (looked up by `&str`).
    pub sources_by_name: FxHashMap<Name, FxHashMap<i64, usize>>,
}

impl Table {
    pub fn new(keyed: bool, prioritised: bool) -> Self {
        Self {
            base: 0,
            first_live: 0,
            state: Vec::new(),
            source_ids: Vec::new(),
            offsets: Vec::new(),
            times: Vec::new(),
            docs: Vec::new(),
            keys: if keyed { Some(Vec::new()) } else { None },
            key_next: if keyed { Some(Vec::new()) } else { None },
            ranks: if prioritised { Some(Vec::new()) } else { None },
            sources: Vec::new(),
            sources_by_name: FxHashMap::default(),
        }
    }

    pub fn end(&self) -> i64 {
        self.base + self.state.len() as i64
    }

    pub fn find_source(&self, topic: &str, partition: i64) -> Option<usize> {
        self.sources_by_name.get(topic).and_then(|parts| parts.get(&partition)).copied()
    }

    /// The interned name of a topic the table has a source of.
    pub fn topic_name(&self, topic: &str) -> Option<Name> {
        self.sources_by_name.get_key_value(topic).map(|(name, _)| name.clone())
    }

    /// The source of a partition, created (starting at `next_offset`) on first use.
    pub fn source(&mut self, topic: &Name, partition: i64, next_offset: i64) -> usize {
        if let Some(i) = self.find_source(topic, partition) {
            return i;
        }
        let index = self.sources.len();
        let topic = self.topic_name(topic).unwrap_or_else(|| topic.clone());
        self.sources.push(Source::new(topic.clone(), partition, next_offset));
        self.sources_by_name.entry(topic).or_default().insert(partition, index);
        index
    }

    #[allow(clippy::too_many_arguments)]
    pub fn append(
        &mut self,
        source: usize,
        offset: i64,
        timestamp: f64,
        doc: Py<PyAny>,
        key: Option<Arc<[u8]>>,
        state: u8,
        rank: i128,
    ) -> Seq {
        let seq = self.end();
        self.state.push(state);
        self.source_ids.push(source as u32);
        self.offsets.push(offset);
        self.times.push(timestamp);
        self.docs.push(doc);
        if let (Some(keys), Some(key_next)) = (self.keys.as_mut(), self.key_next.as_mut()) {
            keys.push(key);
            key_next.push(-1);
        }
        if let Some(ranks) = self.ranks.as_mut() {
            ranks.push(rank);
        }
        let s = &mut self.sources[source];
        s.offsets.push(offset);
        s.seqs.push(seq);
        seq
    }

    pub fn slot(&self, seq: Seq) -> usize {
        (seq - self.base) as usize
    }

    pub fn bookmark(&self, seq: Seq) -> Bm {
        let slot = self.slot(seq);
        let source = &self.sources[self.source_ids[slot] as usize];
        Bm::new(source.topic.clone(), source.partition, self.offsets[slot])
    }

    pub fn locate(&self, topic: &str, partition: i64, offset: i64) -> Location {
        let Some(index) = self.find_source(topic, partition) else {
            return Location::Unknown;
        };
        match self.sources[index].locate(offset) {
            Location::Found(seq) if seq < self.base => Location::Done,
            other => other,
        }
    }

    pub fn state_of(&self, seq: Seq) -> u8 {
        if seq >= self.base {
            self.state[self.slot(seq)]
        } else {
            ACKED
        }
    }

    /// Move `first_live` to the oldest entry not ACKED or EXPIRED, and return it.
    pub fn advance_first_live(&mut self) -> i64 {
        let len = self.state.len();
        let from = ((self.first_live - self.base).max(0) as usize).min(len);
        self.first_live = match self.state[from..].iter().position(|&s| s < ACKED) {
            Some(found) => self.base + (from + found) as i64,
            None => self.base + len as i64,
        };
        self.first_live
    }

    pub fn trim(&mut self) {
        let done = (self.advance_first_live() - self.base) as usize;
        if done < TRIM_AT_LEAST || done * 2 < self.state.len() {
            return;
        }
        self.state.drain(..done);
        self.source_ids.drain(..done);
        self.offsets.drain(..done);
        self.times.drain(..done);
        self.docs.drain(..done);
        if let (Some(keys), Some(key_next)) = (self.keys.as_mut(), self.key_next.as_mut()) {
            keys.drain(..done);
            key_next.drain(..done);
        }
        if let Some(ranks) = self.ranks.as_mut() {
            ranks.drain(..done);
        }
        self.base += done as i64;
        let base = self.base;
        let state = &self.state;
        for source in self.sources.iter_mut() {
            source.advance_head(state, base);
            source.trim();
        }
    }
}

/// Queue order: FIFO by seq, or by priority then age (a sorted set of positions).
pub enum Order {
    Fifo,
    Priority(BTreeSet<Pos>),
}

impl Order {
    pub fn position(&self, table: &Table, seq: Seq) -> Pos {
        match self {
            Order::Fifo => (0, seq),
            Order::Priority(_) => (table.ranks.as_ref().expect("ranks")[table.slot(seq)], seq),
        }
    }

    pub fn start(&self, table: &Table) -> Pos {
        match self {
            Order::Fifo => (0, table.first_live),
            Order::Priority(_) => POS_MIN,
        }
    }

    pub fn end(&self, table: &Table) -> Pos {
        match self {
            Order::Fifo => (0, table.end()),
            Order::Priority(_) => POS_MAX,
        }
    }

    pub fn add(&mut self, position: Pos) {
        if let Order::Priority(set) = self {
            set.insert(position);
        }
    }

    pub fn discard(&mut self, table: &Table, seq: Seq) {
        if let Order::Priority(set) = self {
            let rank = table.ranks.as_ref().expect("ranks")[table.slot(seq)];
            set.remove(&(rank, seq));
        }
    }

    /// The first AVAILABLE entry from `position` on, in queue order.
    pub fn first(&self, table: &Table, position: Pos) -> Option<Seq> {
        let state = &table.state;
        let base = table.base;
        match self {
            Order::Fifo => {
                let slot = (position.1 - base).max(0) as usize;
                if slot >= state.len() {
                    return None;
                }
                memchr::memchr(AVAILABLE, &state[slot..]).map(|found| base + (slot + found) as i64)
            }
            Order::Priority(set) => set
                .range(position..)
                .find(|(_, seq)| state[(seq - base) as usize] == AVAILABLE)
                .map(|(_, seq)| *seq),
        }
    }
}
