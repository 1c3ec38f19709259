//! The queue engine: a line-by-line port of `layer/domain/engine.py` (the reference).
//!
//! Every method keeps the Python method's name, order of operations and events, so the two
//! can be run side by side on the same inputs and compared (tests/unit/domain). Expressions
//! (filters, priority, barrier), the redelivery back-off and test token sources stay Python
//! objects, called through the GIL the caller holds; everything per entry is here.

use crate::ordered::{OrderedMap, OrderedSet};
use crate::table::{Location, Order, Pos, Table};
use crate::types::*;
use pyo3::prelude::*;
use rustc_hash::{FxHashMap, FxHashSet};
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};
use std::sync::Arc;

/// `engine.MAX_PURGE_READ`: records asked for at once from a purged deferred part.
pub const MAX_PURGE_READ: i64 = 10_000;
/// At most this many entries' documents are asked for at once (`MAX_WANTED_DOCUMENTS`).
pub const MAX_WANTED_DOCUMENTS: usize = 10_000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fairness {
    Fast,
    RoundRobin,
    Proportional,
}

/// The definition's fields the engine reads (`engine._Policy`).
pub struct Policy {
    pub name: Name,
    pub at_most_once: bool,
    pub lease_period: f64,
    pub max_deliveries: i64,
    pub max_cancels: i64,
    pub expiration: Option<f64>,
    pub delivery_delay: f64,
    pub max_per_subscription_backlog: i64,
    pub fairness: Fairness,
    pub priority: Option<Py<PyAny>>,
    pub barrier: Option<Py<PyAny>>,
    pub filter: Option<Py<PyAny>>,
    pub target_queue_depth: Option<i64>,
    pub strict: bool,
    pub key_groups: bool,
    pub backoff: Option<Py<PyAny>>,
    pub dead_letter_expired: bool,
}

/// The Python objects the engine needs: the DELETE sentinel, document types, `priority_rank`.
pub struct PyHooks {
    pub delete: Py<PyAny>,
    pub raw_document: Py<PyAny>,
    pub partial_document: Py<PyAny>,
    pub priority_rank: Py<PyAny>,
}

/// One backlog shared by the consumers of one regex subscription across its queues
/// (`consumers.BacklogShare`): each member's limit and the leases it holds.
#[pyclass(module = "qlayer_native")]
#[derive(Default)]
pub struct Share {
    /// id -> (limit, leases held, draining: its limit no longer counts, its leases do)
    members: FxHashMap<u64, (i64, i64, bool)>,
    next: u64,
}

#[pymethods]
impl Share {
    #[new]
    fn py_new() -> Self {
        Self::default()
    }

    /// min(the subscribed members' limits) less the leases every member holds; 0 without
    /// subscribed members.
    pub fn room(&self) -> i64 {
        let Some(limit) = self.members.values().filter(|(_, _, d)| !*d).map(|(l, _, _)| *l).min()
        else {
            return 0;
        };
        limit - self.members.values().map(|(_, h, _)| *h).sum::<i64>()
    }

    #[getter]
    fn member_count(&self) -> usize {
        self.members.len()
    }

    fn __repr__(&self) -> String {
        format!("Share({} queues, room={})", self.members.len(), self.room())
    }
}

impl Share {
    fn join(&mut self, limit: i64, held: i64, draining: bool) -> u64 {
        let id = self.next;
        self.next += 1;
        self.members.insert(id, (limit, held, draining));
        id
    }
    fn leave(&mut self, id: u64) {
        self.members.remove(&id);
    }
    fn set(&mut self, id: u64, limit: i64, held: i64, draining: bool) {
        if let Some(m) = self.members.get_mut(&id) {
            *m = (limit, held, draining);
        }
    }
}

pub struct Consumer {
    pub consumer_id: Name,
    pub session_id: Name,
    pub order: i64,
    pub requested_backlog: Option<i64>,
    pub limit: i64,
    pub filter: Option<Py<PyAny>>,
    pub filter_text: Option<String>,
    pub delivery_topic: Name,
    pub last_seen: f64,
    pub session_timeout: f64,
    pub leases: OrderedSet<Bm>,
    pub position: Pos,
    pub position_matched: bool,
    pub share: Option<(Py<Share>, u64)>,
    /// A replace took the subscription off this queue (`Engine::retire`).
    pub draining: bool,
    /// `Consumer.transactional`: its leases and session wait for a fence (`Engine::fenced`).
    pub transactional: bool,
}

impl Consumer {
    pub fn room(&self, py: Python<'_>) -> i64 {
        if self.draining {
            return 0;
        }
        let own = self.limit - self.leases.len() as i64;
        if let Some((share, _)) = &self.share {
            if own > 0 {
                return own.min(share.borrow(py).room());
            }
        }
        own
    }

    fn sync_share(&self, py: Python<'_>) {
        if let Some((share, id)) = &self.share {
            share.borrow_mut(py).set(*id, self.limit, self.leases.len() as i64, self.draining);
        }
    }

    fn add_lease(&mut self, py: Python<'_>, bm: Bm) {
        self.leases.insert(bm);
        self.sync_share(py);
    }

    fn drop_lease(&mut self, py: Python<'_>, bm: &Bm) {
        self.leases.remove(bm);
        self.sync_share(py);
    }

    pub fn leave_share(&mut self, py: Python<'_>) {
        if let Some((share, id)) = self.share.take() {
            share.borrow_mut(py).leave(id);
        }
    }
}

/// The mutable state of an entry delivered at least once (`entries.Touched`).
#[derive(Clone, Debug)]
pub struct Touched {
    pub seq: Seq,
    pub bm: Bm,
    pub delivery_count: i64,
    pub cancel_count: i64,
    pub consumer_id: Name,
    pub session_id: Name,
    pub token: Option<Name>,
    pub deadline: f64,
    pub available_at: Option<f64>,
    pub reason: Option<Reason>,
    pub restored: bool,
    pub slot_only: bool,
    /// In Python's `_touched` (an entry still in the queue, or done and not drained yet).
    /// A drained at-most-once entry's backlog slot outlives it in `leased` (unlisted).
    pub listed: bool,
}

impl Touched {
    fn new(seq: Seq, bm: Bm, empty: &Name) -> Self {
        Self {
            seq,
            bm,
            delivery_count: 0,
            cancel_count: 0,
            consumer_id: empty.clone(),
            session_id: empty.clone(),
            token: None,
            deadline: 0.0,
            available_at: None,
            reason: None,
            restored: false,
            slot_only: false,
            listed: true,
        }
    }
}

/// One record offered to the queue (`entries.OfferedRecord`), already read out of Python.
pub struct Offered {
    pub topic: Name,
    pub partition: i64,
    pub offset: i64,
    pub key: Option<Arc<[u8]>>,
    pub doc: Py<PyAny>,
    pub timestamp: Option<f64>,
    pub deliver_at: Option<f64>,
    /// The message's own expiration (seconds from `timestamp`), overriding the queue's.
    pub expiration: Option<f64>,
}

/// One acknowledgement item (`engine.EntryAck`).
pub struct AckIn {
    pub topic: String,
    pub partition: i64,
    pub offset: i64,
    pub token: Option<String>,
    pub kind: i64,
    pub delay: Option<f64>,
    pub reason: Option<String>,
}

/// Where lease tokens come from: the OS (as `LeaseTokens`), or a Python callable (tests).
pub enum Tokens {
    Native { pool: Vec<u8>, next: usize },
    Python(Py<PyAny>),
}

impl Tokens {
    fn next(&mut self, py: Python<'_>) -> PyResult<Name> {
        match self {
            Tokens::Python(source) => {
                let token: String = source.call0(py)?.extract(py)?;
                Ok(Arc::from(token.as_str()))
            }
            Tokens::Native { pool, next } => {
                if *next + 16 > pool.len() {
                    pool.resize(16 * 4096, 0);
                    crate::random::fill(pool)?;
                    *next = 0;
                }
                let bytes = &pool[*next..*next + 16];
                *next += 16;
                let mut text = String::with_capacity(32);
                for b in bytes {
                    text.push(HEX[(b >> 4) as usize] as char);
                    text.push(HEX[(b & 15) as usize] as char);
                }
                Ok(Arc::from(text.as_str()))
            }
        }
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";
const NO_FENCE: Seq = 1 << 62;

pub struct Engine {
    pub policy: Policy,
    pub hooks: PyHooks,
    pub tokens: Tokens,
    pub session_timeout: f64,
    pub table: Table,
    pub order: Order,
    fifo: bool,
    lease_period: f64,
    done_hooks: bool,
    plain: bool,
    pub touched: FxHashMap<Seq, Touched>,
    pub leased: OrderedMap<Bm, Seq>,
    restored_deadlines: BinaryHeap<Reverse<Timed>>,
    pub consumers: OrderedMap<Name, Consumer>,
    next_order: i64,
    last_served: i64,
    orphans: FxHashMap<Name, OrderedSet<Bm>>,
    delays: BinaryHeap<Reverse<Timed>>,
    barriers: VecDeque<Seq>,
    pending_barriers: FxHashSet<Seq>,
    key_head: FxHashMap<Arc<[u8]>, Seq>,
    key_tail: FxHashMap<Arc<[u8]>, Seq>,
    active: i64,
    inactive_from: i64,
    not_before: FxHashMap<Seq, f64>,
    /// `QueueEngine._expires_at` / `_expiries`: entries with an expiration of their own.
    expires_at: FxHashMap<Seq, f64>,
    expiries: BinaryHeap<Reverse<Timed>>,
    /// `QueueEngine._unparseable` / `_first_unparseable`.
    pub unparseable: i64,
    pub first_unparseable: Option<Bm>,
    early_acks: FxHashSet<Bm>,
    /// `QueueEngine._deferring` (source indexes, in the order they began to defer),
    /// `_rereading`, `_stopped`, `_acked_ahead`, `_hold_through`.
    deferring: Vec<usize>,
    rereading: Option<Vec<(usize, i64)>>,
    stopped: FxHashSet<usize>,
    acked_ahead: FxHashSet<Bm>,
    hold_through: FxHashMap<(Name, i64), i64>,
    restoring: OrderedMap<Bm, Rec>,
    resend: Vec<(Seq, Bm, Option<Name>)>,
    pub events: Vec<Ev>,
    dirty: BTreeSet<Seq>,
    direct_records: Vec<Rec>,
    projection_seqs: Vec<Seq>,
    projection_fields: Vec<Py<PyAny>>,
    wanted: OrderedSet<Seq>,
    empty: Name,
    /// `QueueEngine._parts` / `_served`: a part of a queue of several parts serves the
    /// journal partitions of its parts only.
    parts: i64,
    served: FxHashSet<i64>,
    /// `QueueEngine._fence_wanted` / `_fence_new` / `_transactional`.
    fence_wanted: FxHashSet<Name>,
    fence_new: Vec<Name>,
    transactional: i64,
}

fn call_matches(py: Python<'_>, expression: &Py<PyAny>, doc: &Py<PyAny>) -> PyResult<bool> {
    expression.call_method1(py, "matches", (doc.clone_ref(py),))?.extract(py)
}

impl Engine {
    pub fn new(policy: Policy, hooks: PyHooks, tokens: Tokens, session_timeout: f64) -> Self {
        let prioritised = policy.priority.is_some();
        let table = Table::new(policy.key_groups, prioritised);
        let order = if prioritised { Order::Priority(BTreeSet::new()) } else { Order::Fifo };
        let done_hooks = prioritised
            || policy.target_queue_depth.is_some()
            || policy.key_groups
            || policy.barrier.is_some();
        let plain = !done_hooks && policy.filter.is_none();
        let lease_period = policy.lease_period;
        Self {
            policy,
            hooks,
            tokens,
            session_timeout,
            table,
            order,
            fifo: !prioritised,
            lease_period,
            done_hooks,
            plain,
            touched: FxHashMap::default(),
            leased: OrderedMap::new(),
            restored_deadlines: BinaryHeap::new(),
            consumers: OrderedMap::new(),
            next_order: 0,
            last_served: -1,
            orphans: FxHashMap::default(),
            delays: BinaryHeap::new(),
            barriers: VecDeque::new(),
            pending_barriers: FxHashSet::default(),
            key_head: FxHashMap::default(),
            key_tail: FxHashMap::default(),
            active: 0,
            inactive_from: 0,
            not_before: FxHashMap::default(),
            expires_at: FxHashMap::default(),
            expiries: BinaryHeap::new(),
            unparseable: 0,
            first_unparseable: None,
            early_acks: FxHashSet::default(),
            deferring: Vec::new(),
            rereading: None,
            stopped: FxHashSet::default(),
            acked_ahead: FxHashSet::default(),
            hold_through: FxHashMap::default(),
            restoring: OrderedMap::new(),
            resend: Vec::new(),
            events: Vec::new(),
            dirty: BTreeSet::new(),
            direct_records: Vec::new(),
            projection_seqs: Vec::new(),
            projection_fields: Vec::new(),
            wanted: OrderedSet::new(),
            empty: Arc::from(""),
            parts: 1,
            served: FxHashSet::default(),
            fence_wanted: FxHashSet::default(),
            fence_new: Vec::new(),
            transactional: 0,
        }
    }

    /// `QueueEngine.set_transactional`.
    pub fn set_transactional(&mut self, consumer_id: &Name) -> bool {
        let Some(c) = self.consumers.get_mut(consumer_id) else { return false };
        if !c.transactional {
            c.transactional = true;
            self.transactional += 1;
        }
        true
    }

    /// `QueueEngine._held`.
    fn held(&mut self, consumer_id: &Name, session_id: Option<&Name>) -> bool {
        let Some(c) = self.consumers.get(consumer_id) else { return false };
        if !c.transactional || session_id.is_some_and(|s| *s != c.session_id) {
            return false;
        }
        if !self.fence_wanted.contains(consumer_id) {
            self.fence_wanted.insert(consumer_id.clone());
            self.fence_new.push(consumer_id.clone());
        }
        true
    }

    /// `QueueEngine.take_fences`.
    pub fn take_fences(&mut self) -> Vec<Name> {
        let new = std::mem::take(&mut self.fence_new);
        new.into_iter().filter(|c| self.fence_wanted.contains(c)).collect()
    }

    /// `QueueEngine.fenced`.
    pub fn fenced(&mut self, py: Python<'_>, consumer_id: &Name, now: f64) -> PyResult<bool> {
        let Some(c) = self.consumers.get(consumer_id) else {
            self.fence_wanted.remove(consumer_id);
            return Ok(false);
        };
        for bm in c.leases.to_vec() {
            let seq = self.leased.get(&bm).copied().expect("a lease");
            let t = &self.touched[&seq];
            if !t.slot_only && t.deadline <= now {
                self.expire_lease(py, seq, now)?;
            }
        }
        self.leave(py, consumer_id, Leave::SessionTimeout, now);
        Ok(true)
    }

    /// `QueueEngine.serve_parts`.
    pub fn serve_parts(&mut self, parts: i64, served: Vec<i64>) {
        self.parts = parts;
        self.served = served.into_iter().collect();
    }

    /// `QueueEngine.serves`.
    pub fn serves(&self, partition: i64) -> bool {
        self.parts <= 1 || self.served.contains(&partition.rem_euclid(self.parts))
    }

    fn name(&self) -> Name {
        self.policy.name.clone()
    }

    /// `self._touched.get(seq)` of the reference.
    fn listed(&self, seq: Seq) -> Option<&Touched> {
        self.touched.get(&seq).filter(|t| t.listed)
    }

    /// `self._touched.pop(seq)`: kept (unlisted) while its backlog slot is leased.
    fn unlist(&mut self, seq: Seq) {
        let Some(t) = self.touched.get_mut(&seq) else { return };
        if self.leased.get(&t.bm) == Some(&seq) {
            t.listed = false;
        } else {
            self.touched.remove(&seq);
        }
    }

    /// The interned topic name (a bookmark's topic from outside, made an engine name).
    pub fn intern(&self, topic: &str) -> Name {
        self.table.topic_name(topic).unwrap_or_else(|| Arc::from(topic))
    }

    // ------------------------------------------------------------------ reading
    pub fn recovery_points(&mut self) -> Vec<(Name, i64, i64)> {
        let table = &mut self.table;
        let base = table.base;
        let state = &table.state;
        table
            .sources
            .iter_mut()
            .map(|s| (s.topic.clone(), s.partition, s.recovery_point(state, base)))
            .collect()
    }

    pub fn restoring_has(&self, bm: &Bm) -> bool {
        self.restoring.contains_key(bm)
    }

    pub fn entry(&self, bm: &Bm) -> Option<Rec> {
        match self.table.locate(&bm.topic, bm.partition, bm.offset) {
            Location::Found(seq) => Some(self.record(seq)),
            _ => None,
        }
    }

    /// AVAILABLE entries in delivery order (seq, doc, enqueue time, delivery count).
    pub fn view(
        &mut self,
        py: Python<'_>,
        expression: Option<&Py<PyAny>>,
        limit: usize,
    ) -> PyResult<Vec<(Seq, Py<PyAny>, f64, i64)>> {
        let mut found = Vec::new();
        let mut position = self.order.start(&self.table);
        while found.len() < limit {
            let Some(seq) = self.order.first(&self.table, position) else { break };
            position = after(self.order.position(&self.table, seq));
            let slot = self.table.slot(seq);
            let doc = self.document(py, slot)?;
            if let Some(e) = expression {
                if !self.covers(py, seq, &doc, e)? || !call_matches(py, e, &doc)? {
                    continue;
                }
            }
            let count = self.listed(seq).map(|t| t.delivery_count).unwrap_or(0);
            found.push((seq, doc, self.table.times[slot], count));
        }
        Ok(found)
    }

    /// `QueueStats.not_read`: offsets deferred past the depth.
    pub fn not_read(&self) -> i64 {
        self.deferring
            .iter()
            .map(|&i| {
                let s = &self.table.sources[i];
                s.next_offset - s.deferred_from
            })
            .sum()
    }

    /// (available, leased, delayed, inactive, consumers, backlog, oldest, barriers, acks)
    #[allow(clippy::type_complexity)]
    pub fn stats(&self) -> (usize, usize, usize, usize, usize, usize, Option<f64>, usize, usize) {
        let state = &self.table.state;
        let count = |s: u8| state.iter().filter(|&&x| x == s).count();
        let first = if self.fifo {
            memchr::memchr(AVAILABLE, state)
        } else {
            self.order
                .first(&self.table, self.order.start(&self.table))
                .map(|seq| self.table.slot(seq))
        };
        (
            count(AVAILABLE),
            count(LEASED),
            count(DELAYED),
            count(INACTIVE),
            self.consumers.len(),
            self.leased.len(),
            first.map(|slot| self.table.times[slot]),
            self.pending_barriers.len(),
            self.early_acks.len(),
        )
    }

    /// (held, waiting) of one consumer for the credit its consumer granted this shard
    /// (`QueueEngine.credit_view`): its leases here, and the AVAILABLE entries when at least
    /// one of them is one it may take now, else 0.
    pub fn credit_view(&mut self, py: Python<'_>, id: &Name) -> PyResult<(usize, usize)> {
        let (held, draining) = match self.consumers.get(id) {
            None => return Ok((0, 0)),
            Some(c) => (c.leases.len(), c.draining),
        };
        if draining {
            return Ok((held, 0));
        }
        let available = memchr::memchr_iter(AVAILABLE, &self.table.state).count();
        if available == 0 || self.candidates(py, id, 1)?.is_empty() {
            return Ok((held, 0));
        }
        Ok((held, available))
    }

    pub fn next_deadline(&self) -> Option<f64> {
        let mut candidates: Vec<f64> = Vec::new();
        let held = &self.fence_wanted;
        for seq in self.leased.values() {
            let t = &self.touched[seq];
            if !t.restored && !held.contains(&t.consumer_id) {
                candidates.push(t.deadline);
                break;
            }
        }
        if let Some(Reverse(Timed(at, _))) = self.restored_deadlines.peek() {
            candidates.push(*at);
        }
        if let Some(Reverse(Timed(at, _))) = self.delays.peek() {
            candidates.push(*at);
        }
        if let Some(Reverse(Timed(at, _))) = self.expiries.peek() {
            candidates.push(*at);
        }
        for c in self.consumers.values() {
            if !held.contains(&c.consumer_id) {
                candidates.push(c.last_seen + c.session_timeout);
            }
        }
        if let Some(expiration) = self.policy.expiration {
            let table = &self.table;
            for source in &table.sources {
                if source.expiry_index < source.seqs.len() {
                    let seq = source.seqs[source.expiry_index];
                    if seq >= table.base {
                        candidates.push(table.times[table.slot(seq)] + expiration);
                    }
                }
            }
        }
        candidates.into_iter().reduce(f64::min)
    }

    // ------------------------------------------------------------------ projected documents
    fn covers(&self, py: Python<'_>, seq: Seq, doc: &Py<PyAny>, expression: &Py<PyAny>) -> PyResult<bool> {
        covers_with(py, &self.hooks, &self.projection_seqs, &self.projection_fields, seq, doc,
                    expression)
    }

    fn want(&mut self, seq: Seq) -> bool {
        if self.wanted.len() >= MAX_WANTED_DOCUMENTS {
            return false;
        }
        self.wanted.insert(seq);
        true
    }

    pub fn documents_wanted(&mut self) -> Vec<Bm> {
        if self.wanted.is_empty() {
            return Vec::new();
        }
        let base = self.table.base;
        let out = self
            .wanted
            .iter()
            .filter(|&&seq| seq >= base && self.table.state[(seq - base) as usize] < ACKED)
            .map(|&seq| self.table.bookmark(seq))
            .collect();
        self.wanted.clear();
        out
    }

    pub fn refresh_documents(
        &mut self,
        py: Python<'_>,
        docs: Vec<(Bm, Py<PyAny>)>,
        fields: Py<PyAny>,
        document_of: &Py<PyAny>,
    ) -> PyResult<i64> {
        let mut refreshed = 0;
        let mut first: Option<Pos> = None;
        for (bm, doc) in docs {
            let Location::Found(seq) = self.table.locate(&bm.topic, bm.partition, bm.offset)
            else {
                continue;
            };
            if self.table.state_of(seq) >= ACKED {
                continue;
            }
            let value = document_of.call1(py, (doc,))?;
            let partial = self.hooks.partial_document.call1(py, (value, fields.clone_ref(py)))?;
            let slot = self.table.slot(seq);
            self.table.docs[slot] = partial;
            refreshed += 1;
            let position = self.order.position(&self.table, seq);
            if first.is_none_or(|f| position < f) {
                first = Some(position);
            }
        }
        if let Some(position) = first {
            self.rewind(position);
        }
        Ok(refreshed)
    }

    // ------------------------------------------------------------------ outbox
    pub fn drain(&mut self) -> (Vec<Ev>, Vec<Rec>) {
        let mut records = std::mem::take(&mut self.direct_records);
        let base = self.table.base;
        let dirty = std::mem::take(&mut self.dirty);
        for seq in dirty {
            let current = self.table.state[(seq - base) as usize];
            if current < ACKED {
                records.push(self.record(seq));
                continue;
            }
            let found = self.listed(seq).map(|t| (t.bm.clone(), t.delivery_count, t.cancel_count));
            match found {
                Some((bm, delivery_count, cancel_count)) if current == ACKED => {
                    records.push(Rec {
                        bm,
                        state: ACKED,
                        delivery_count,
                        cancel_count,
                        consumer_id: None,
                        session_id: None,
                        token: None,
                        deadline: None,
                        available_at: None,
                        reason: None,
                    });
                    self.unlist(seq);
                }
                Some(_) => {
                    records.push(self.record(seq));
                    self.unlist(seq);
                }
                None => records.push(self.record(seq)),
            }
        }
        let events = std::mem::take(&mut self.events);
        self.trim();
        (events, records)
    }

    fn record(&self, seq: Seq) -> Rec {
        let state = self.table.state_of(seq);
        let Some(t) = self.listed(seq) else {
            return Rec::plain(self.table.bookmark(seq), state);
        };
        let leased = state == LEASED;
        Rec {
            bm: t.bm.clone(),
            state,
            delivery_count: t.delivery_count,
            cancel_count: t.cancel_count,
            consumer_id: if leased { Some(t.consumer_id.clone()) } else { None },
            session_id: if leased { Some(t.session_id.clone()) } else { None },
            token: if leased { t.token.clone() } else { None },
            deadline: if leased { Some(t.deadline) } else { None },
            available_at: if state == DELAYED { t.available_at } else { None },
            reason: if state == EXPIRED { t.reason } else { None },
        }
    }

    fn trim(&mut self) {
        if self.policy.key_groups && self.policy.at_most_once && !self.leased.is_empty() {
            let held = self.leased.values().map(|s| self.touched[s].seq).min().unwrap_or(0);
            if held < self.table.advance_first_live() {
                return;
            }
        }
        self.table.trim();
        self.inactive_from = self.inactive_from.max(self.table.base);
        let seqs = &mut self.projection_seqs;
        if seqs.len() > 1 && seqs[1] <= self.table.base {
            let drop = seqs.partition_point(|&s| s <= self.table.base) - 1;
            seqs.drain(..drop);
            self.projection_fields.drain(..drop);
        }
    }

    // ------------------------------------------------------------------ restart
    pub fn restore(&mut self, entries: Vec<Rec>, points: Vec<(Name, i64, i64)>) {
        for (topic, partition, offset) in points {
            self.table.source(&topic, partition, offset);
        }
        for record in entries {
            if record.state == LEASED {
                let key = (record.bm.topic.clone(), record.bm.partition);
                let held = self.hold_through.entry(key).or_insert(-1);
                *held = (*held).max(record.bm.offset);
            }
            self.restoring.insert(record.bm.clone(), record);
        }
    }

    pub fn expire_before(&mut self, py: Python<'_>, topic: &Name, partition: i64, offset: i64, now: f64, reason: Reason) -> PyResult<i64> {
        let mut count = 0;
        let matching: Vec<Bm> = self
            .restoring
            .keys()
            .filter(|b| &*b.topic == &**topic && b.partition == partition)
            .cloned()
            .collect();
        for bm in matching {
            if bm.offset < offset {
                let record = self.restoring.remove(&bm).expect("restoring");
                if !record.done() {
                    let mut expired = record;
                    expired.state = EXPIRED;
                    expired.reason = Some(reason);
                    self.direct_records.push(expired);
                    count += 1;
                }
            }
        }
        let Some(index) = self.table.find_source(topic, partition) else {
            self.table.source(topic, partition, offset);
            return Ok(count);
        };
        let mut doomed = Vec::new();
        {
            let table = &self.table;
            let source = &table.sources[index];
            for i in source.head..source.offsets.len() {
                if source.offsets[i] >= offset {
                    break;
                }
                let seq = source.seqs[i];
                if seq >= table.base && table.state[table.slot(seq)] < ACKED {
                    doomed.push(seq);
                }
            }
        }
        for seq in doomed {
            if let Some(t) = self.listed(seq) {
                if self.leased.contains_key(&t.bm) {
                    self.drop_lease(py, seq);
                }
            }
            self.expire(py, seq, reason, None, None, now)?;
            count += 1;
        }
        let source = &mut self.table.sources[index];
        source.next_offset = source.next_offset.max(offset);
        if source.deferred_from >= 0 && offset > source.deferred_from {
            // Deferred records below `offset` are gone: there is nothing to read again.
            source.deferred_from = offset;
            if offset >= source.next_offset {
                self.undefer(index);
            }
        }
        Ok(count)
    }

    /// `QueueEngine.expire_entries`: these entries leave the queue at once with `reason`.
    pub fn expire_entries(&mut self, py: Python<'_>, bookmarks: Vec<(String, i64, i64)>, reason: Reason, now: f64, detail: Option<String>) -> PyResult<i64> {
        let mut count = 0;
        for (topic, partition, offset) in bookmarks {
            let Location::Found(seq) = self.table.locate(&topic, partition, offset) else { continue };
            if self.table.state_of(seq) >= ACKED {
                continue;
            }
            // A leased entry's holder: its dead letter's last consumer.
            let holder = match self.touched.get(&seq) {
                Some(t) if self.leased.contains_key(&t.bm) => Some(t.consumer_id.clone()),
                _ => None,
            };
            if holder.is_some() {
                self.drop_lease(py, seq);
            }
            self.expire(py, seq, reason, detail.clone(), holder, now)?;
            count += 1;
        }
        Ok(count)
    }

    // ------------------------------------------------------------------ enqueue
    pub fn note_projection(&mut self, py: Python<'_>, projected: Py<PyAny>) -> PyResult<()> {
        let differs = match self.projection_fields.last() {
            None => true,
            Some(last) => last.bind(py).ne(projected.bind(py))?,
        };
        if differs {
            self.projection_seqs.push(self.table.end());
            self.projection_fields.push(projected);
        }
        Ok(())
    }

    pub fn enqueue(&mut self, py: Python<'_>, records: Vec<Offered>, now: f64) -> PyResult<i64> {
        let mut accepted: Vec<(usize, Vec<i64>)> = Vec::new();
        let mark = self.events.len();
        let plain = self.plain && self.restoring.is_empty() && self.early_acks.is_empty();
        let depth = self.policy.target_queue_depth;
        let mut current: Option<usize> = None; // index into `accepted`
        let mut source: usize = usize::MAX;
        let split = self.parts > 1;
        for record in records {
            if split && !self.serves(record.partition) {
                continue; // another part's partition: its own shard serves it
            }
            let same = source != usize::MAX && {
                let s = &self.table.sources[source];
                s.partition == record.partition && *s.topic == *record.topic
            };
            if !same {
                source = match self.table.find_source(&record.topic, record.partition) {
                    Some(i) => i,
                    None => self.table.source(&record.topic, record.partition, record.offset),
                };
                current = Some(match accepted.iter().position(|(s, _)| *s == source) {
                    Some(i) => i,
                    None => {
                        accepted.push((source, Vec::new()));
                        accepted.len() - 1
                    }
                });
            }
            let run = current.expect("a run");
            let offset = record.offset;
            let reread = offset < self.table.sources[source].next_offset;
            if reread {
                if self.rereading.is_none() || !self.reread_takes(source, offset) {
                    continue; // a replay or a duplicate
                }
                if !self.acked_ahead.is_empty() {
                    let bm = Bm::new(record.topic.clone(), record.partition, offset);
                    if self.acked_ahead.remove(&bm) {
                        self.restoring.remove(&bm);
                        continue; // acknowledged while deferred: ACKED, announced, persisted
                    }
                }
            } else {
                self.table.sources[source].next_offset = offset + 1;
                if depth.is_some() && self.defers(source, offset) {
                    let settled = self.defer(py, source, offset, &record.doc, now)?;
                    if settled {
                        accepted[run].1.push(offset);
                    }
                    continue;
                }
            }
            if record.doc.is(&self.hooks.delete) {
                continue;
            }
            // `QueueEngine.enqueue`: the queue's delay counts from the record's timestamp; a
            // later deliver-at of its own wins.
            let deliver_at = if self.policy.delivery_delay > 0.0 {
                let at = record.timestamp.unwrap_or(now) + self.policy.delivery_delay;
                Some(record.deliver_at.map_or(at, |d| d.max(at)))
            } else {
                record.deliver_at
            };
            if plain && deliver_at.is_none_or(|d| d <= now) && record.expiration.is_none() {
                let ts = record.timestamp.unwrap_or(now);
                self.table.append(source, offset, ts, record.doc, None, AVAILABLE, 0);
            } else {
                // Expressions read the document now: a plain value becomes a `RawDocument`.
                let raw = record.doc.bind(py).is_exact_instance_of::<pyo3::types::PyBytes>();
                let doc = if raw {
                    self.hooks.raw_document.call1(py, (record.doc,))?
                } else {
                    record.doc
                };
                let keep = match &self.policy.filter {
                    Some(filter) => call_matches(py, filter, &doc)?,
                    None => true,
                };
                let probe = if raw || doc.bind(py).is_instance(self.hooks.raw_document.bind(py))? {
                    Some(doc.clone_ref(py))
                } else {
                    None
                };
                let end = self.table.end();
                let admitted = keep && self.admit(py, source, offset, record.key, doc, record.timestamp,
                                                  deliver_at, record.expiration, now)?;
                if reread && self.table.end() > end {
                    if offset < self.table.sources[source].purge_until {
                        self.purge_reread(py, end, now)?;
                    } else {
                        self.expire_stale(py, end, now)?;
                    }
                }
                if let Some(d) = probe {
                    // `QueueEngine.enqueue`: the queue's expressions read a value that is not JSON.
                    if d.bind(py).getattr(pyo3::intern!(py, "failed"))?.is_truthy()? {
                        self.unparseable += 1;
                        if self.first_unparseable.is_none() {
                            self.first_unparseable = Some(Bm::new(record.topic.clone(), record.partition, offset));
                        }
                    }
                }
                if !admitted {
                    continue;
                }
            }
            accepted[run].1.push(offset);
        }
        let mut announced = Vec::new();
        let mut total = 0;
        for (source, offsets) in accepted {
            if offsets.is_empty() {
                continue;
            }
            total += offsets.len() as i64;
            let s = &self.table.sources[source];
            announced.push(Ev::Enqueued { topic: s.topic.clone(), partition: s.partition, offsets, at: now });
        }
        self.events.splice(mark..mark, announced);
        Ok(total)
    }

    // ------------------------------------------------------------------ deferred records
    /// `QueueEngine._defers`.
    fn defers(&self, source: usize, offset: i64) -> bool {
        let depth = self.policy.target_queue_depth.expect("depth");
        let s = &self.table.sources[source];
        s.deferred_from >= 0
            || (self.active >= depth
                && offset > self.hold_through.get(&(s.topic.clone(), s.partition)).copied().unwrap_or(-1))
    }

    /// `QueueEngine._defer`; true when a remembered ack settled the record (announced).
    fn defer(&mut self, py: Python<'_>, source: usize, offset: i64, doc: &Py<PyAny>, now: f64) -> PyResult<bool> {
        let (topic, partition) = {
            let s = &mut self.table.sources[source];
            if s.deferred_from < 0 {
                s.deferred_from = offset;
                self.deferring.push(source);
            }
            (s.topic.clone(), s.partition)
        };
        if self.early_acks.is_empty() || doc.is(&self.hooks.delete) {
            return Ok(false);
        }
        let bm = Bm::new(topic, partition, offset);
        if !self.early_acks.contains(&bm) {
            return Ok(false);
        }
        if let Some(filter) = &self.policy.filter {
            // As `_admit`'s callers: a plain value is read as a `RawDocument`.
            let raw = doc.bind(py).is_exact_instance_of::<pyo3::types::PyBytes>();
            let doc = if raw { self.hooks.raw_document.call1(py, (doc.clone_ref(py),))? } else { doc.clone_ref(py) };
            if !call_matches(py, filter, &doc)? {
                return Ok(false);
            }
        }
        self.early_acks.remove(&bm);
        self.settle_early_ack(bm.clone(), now);
        self.acked_ahead.insert(bm);
        Ok(true)
    }

    /// `QueueEngine._reread_takes`.
    fn reread_takes(&mut self, source: usize, offset: i64) -> bool {
        let through = self
            .rereading
            .as_ref()
            .and_then(|r| r.iter().find(|(s, _)| *s == source).map(|(_, t)| *t));
        let Some(through) = through else { return false };
        let from = self.table.sources[source].deferred_from;
        if self.stopped.contains(&source) || from < 0 || offset < from || offset >= through {
            return false;
        }
        let depth = self.policy.target_queue_depth.expect("depth");
        if self.active >= depth && offset >= self.table.sources[source].purge_until {
            self.table.sources[source].deferred_from = offset;
            self.stopped.insert(source);
            return false;
        }
        self.table.sources[source].deferred_from = offset + 1;
        true
    }

    /// `QueueEngine._expire_stale`.
    fn expire_stale(&mut self, py: Python<'_>, seq: Seq, now: f64) -> PyResult<()> {
        if self.table.state_of(seq) != LEASED && self.too_old(seq, now) {
            self.expire(py, seq, Reason::Expiration, None, None, now)?;
        }
        Ok(())
    }

    /// `QueueEngine._undefer`.
    fn undefer(&mut self, source: usize) {
        let s = &mut self.table.sources[source];
        s.deferred_from = -1;
        let (topic, partition) = (s.topic.clone(), s.partition);
        self.deferring.retain(|&i| i != source);
        if !self.acked_ahead.is_empty() {
            self.acked_ahead.retain(|b| !(*b.topic == *topic && b.partition == partition));
        }
    }

    /// `QueueEngine.records_wanted`: (topic, partition, from_offset, max_records, until).
    pub fn records_wanted(&self) -> Vec<(Name, i64, i64, i64, i64)> {
        let Some(depth) = self.policy.target_queue_depth else { return Vec::new() };
        let room = depth - self.active;
        self.deferring
            .iter()
            .map(|&i| &self.table.sources[i])
            .filter(|s| room > 0 || s.deferred_from < s.purge_until)
            .map(|s| {
                let n = if s.deferred_from < s.purge_until { room.max(MAX_PURGE_READ) } else { room };
                (s.topic.clone(), s.partition, s.deferred_from, n, s.next_offset)
            })
            .collect()
    }

    /// `QueueEngine.purge_deferred`.
    pub fn purge_deferred(&mut self) -> i64 {
        let mut covered = 0;
        for &i in &self.deferring {
            let s = &mut self.table.sources[i];
            s.purge_until = s.next_offset;
            covered += s.next_offset - s.deferred_from;
        }
        covered
    }

    /// `QueueEngine._purge_reread`.
    fn purge_reread(&mut self, py: Python<'_>, seq: Seq, now: f64) -> PyResult<()> {
        self.not_before.remove(&seq);
        if self.table.state_of(seq) < ACKED {
            self.accept_unleased(py, seq, AckSource::Admin, now)?;
        }
        Ok(())
    }

    /// `QueueEngine.deferred`.
    pub fn deferred(&self) -> Vec<(Name, i64, i64)> {
        self.deferring
            .iter()
            .map(|&i| {
                let s = &self.table.sources[i];
                (s.topic.clone(), s.partition, s.deferred_from)
            })
            .collect()
    }

    /// `QueueEngine.expect_rereads`.
    pub fn expect_rereads(&mut self, through: Vec<(String, i64, i64)>) {
        let mut found = Vec::new();
        for (topic, partition, end) in through {
            if let Some(i) = self.table.find_source(&topic, partition) {
                found.push((i, end));
            }
        }
        self.rereading = Some(found);
        self.stopped.clear();
    }

    /// `QueueEngine.finish_rereads`.
    pub fn finish_rereads(&mut self) {
        let rereading = self.rereading.take().unwrap_or_default();
        let stopped = std::mem::take(&mut self.stopped);
        for (source, through) in rereading {
            let s = &mut self.table.sources[source];
            if s.deferred_from < 0 || stopped.contains(&source) {
                continue;
            }
            s.deferred_from = s.deferred_from.max(through);
            if s.deferred_from >= s.next_offset {
                self.undefer(source);
            }
        }
    }

    /// `QueueEngine._in_deferred`.
    fn in_deferred(&self, topic: &str, partition: i64, offset: i64) -> bool {
        match self.table.find_source(topic, partition) {
            None => false,
            Some(i) => {
                let s = &self.table.sources[i];
                s.deferred_from >= 0 && s.deferred_from <= offset && offset < s.next_offset
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        py: Python<'_>,
        source: usize,
        offset: i64,
        key: Option<Arc<[u8]>>,
        doc: Py<PyAny>,
        timestamp: Option<f64>,
        deliver_at: Option<f64>,
        expiration: Option<f64>,
        now: f64,
    ) -> PyResult<bool> {
        let (topic, partition) = {
            let s = &self.table.sources[source];
            (s.topic.clone(), s.partition)
        };
        let mut restored: Option<Rec> = None;
        if !self.restoring.is_empty() {
            restored = self.restoring.remove(&Bm::new(topic.clone(), partition, offset));
            if let Some(r) = &restored {
                if r.done() {
                    return Ok(false);
                }
            }
        }
        if !self.early_acks.is_empty() {
            let bm = Bm::new(topic.clone(), partition, offset);
            if self.early_acks.remove(&bm) {
                self.settle_early_ack(bm, now);
                return Ok(true);
            }
        }
        let mut state = if restored.as_ref().is_some_and(|r| r.state == LEASED) {
            LEASED
        } else if self.policy.target_queue_depth.is_some_and(|d| self.active >= d) {
            INACTIVE
        } else {
            AVAILABLE
        };
        let mut available_at = deliver_at;
        if let Some(r) = &restored {
            if r.available_at.is_some() {
                available_at = r.available_at;
            }
        }
        if state == AVAILABLE && available_at.is_some_and(|a| a > now) {
            state = DELAYED;
        }
        let rank: i128 = if !self.fifo {
            let priority = self.policy.priority.as_ref().expect("priority");
            let value = priority.call_method1(py, "evaluate", (doc.clone_ref(py),))?;
            self.hooks.priority_rank.call1(py, (value,))?.extract(py)?
        } else {
            0
        };
        let end = self.table.end();
        let barrier = match &self.policy.barrier {
            Some(b) => call_matches(py, b, &doc)?,
            None => false,
        };
        let kept_key = if self.policy.key_groups { key.clone() } else { None };
        let seq = self.table.append(source, offset, timestamp.unwrap_or(now), doc, kept_key, state, rank);
        debug_assert_eq!(seq, end);
        let position: Pos = if self.fifo { (0, seq) } else { (rank, seq) };
        self.order.add(position);
        if let Some(e) = expiration {
            let expires_at = timestamp.unwrap_or(now) + e;
            self.expires_at.insert(seq, expires_at);
            self.expiries.push(Reverse(Timed(expires_at, seq)));
        }
        if state != INACTIVE {
            self.active += 1;
        } else if let Some(a) = available_at {
            if a > now {
                self.not_before.insert(seq, a);
            }
        }
        if barrier {
            self.barriers.push_back(seq);
            self.pending_barriers.insert(seq);
        }
        if self.policy.key_groups {
            if let Some(k) = key {
                self.link_key(seq, k);
            }
        }
        let was_restored = restored.is_some();
        if let Some(r) = restored {
            self.restore_entry(py, seq, r, state, now);
        }
        if state == DELAYED {
            let at = available_at.expect("delayed");
            self.delays.push(Reverse(Timed(at, seq)));
            if !was_restored {
                let bm = self.table.bookmark(seq);
                self.events.push(Ev::Delayed { bm, until: at, at: now });
            }
        } else if state == AVAILABLE && !self.fifo {
            self.rewind(position);
        }
        Ok(true)
    }

    fn link_key(&mut self, seq: Seq, key: Arc<[u8]>) {
        let base = self.table.base;
        match self.key_tail.get(&key).copied() {
            None => {
                self.key_head.insert(key.clone(), seq);
            }
            Some(tail) => {
                self.table.key_next.as_mut().expect("keys")[(tail - base) as usize] = seq;
            }
        }
        self.key_tail.insert(key, seq);
    }

    fn restore_entry(&mut self, py: Python<'_>, seq: Seq, record: Rec, state: u8, now: f64) {
        let mut t = Touched::new(seq, record.bm.clone(), &self.empty);
        t.delivery_count = record.delivery_count;
        t.cancel_count = record.cancel_count;
        if state == DELAYED {
            t.available_at = record.available_at;
        }
        if state != LEASED {
            self.touched.insert(seq, t);
            return;
        }
        let consumer_id: Name = record.consumer_id.clone().unwrap_or_else(|| self.empty.clone());
        t.consumer_id = consumer_id.clone();
        t.session_id = record.session_id.clone().unwrap_or_else(|| self.empty.clone());
        t.token = record.token.clone();
        t.deadline = record.deadline.unwrap_or(0.0);
        t.restored = true;
        let deadline = t.deadline;
        let token = t.token.clone();
        self.touched.insert(seq, t);
        self.leased.insert(record.bm.clone(), seq);
        self.resend.push((seq, record.bm.clone(), token));
        self.restored_deadlines.push(Reverse(Timed(deadline, seq)));
        match self.consumers.get_mut(&consumer_id) {
            None => {
                self.orphans.entry(consumer_id).or_default().insert(record.bm.clone());
            }
            Some(c) if record.session_id.as_deref() == Some(&*c.session_id) => {
                c.add_lease(py, record.bm.clone());
            }
            Some(_) => self.break_lease(py, seq, Leave::SessionReplaced, now),
        }
    }

    pub fn resends(&mut self, now: f64) -> Vec<Ev> {
        let pending = std::mem::take(&mut self.resend);
        let mut out = Vec::new();
        for (seq, bm, token) in pending {
            let Some(token) = token else { continue };
            if self.leased.get(&bm) != Some(&seq) {
                continue;
            }
            let Some(t) = self.touched.get(&seq) else { continue };
            if t.token.as_ref() != Some(&token) {
                continue;
            }
            let Some(c) = self.consumers.get(&t.consumer_id) else { continue };
            if c.session_id != t.session_id {
                continue;
            }
            out.push(Ev::Leased {
                bm: t.bm.clone(),
                consumer_id: t.consumer_id.clone(),
                delivery_topic: c.delivery_topic.clone(),
                token,
                deadline: t.deadline,
                delivery_count: t.delivery_count,
                at: now,
            });
        }
        out
    }

    // ------------------------------------------------------------------ consumers
    /// `effective_backlog`: min(requested or 1, the queue's limit); an error below 0.
    pub fn effective_backlog(&self, requested: Option<i64>) -> PyResult<i64> {
        let wanted = requested.unwrap_or(1);
        if wanted < 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "max_backlog must be 0 or more, got {wanted}"
            )));
        }
        Ok(wanted.min(self.policy.max_per_subscription_backlog))
    }

    /// Returns the event (ConsumerSubscribed, or ConsumerReplaced for the same session).
    #[allow(clippy::too_many_arguments)]
    pub fn subscribe(
        &mut self,
        py: Python<'_>,
        consumer_id: Name,
        session_id: Name,
        now: f64,
        delivery_topic: Name,
        max_backlog: Option<i64>,
        filter: Option<(Py<PyAny>, String)>,
        session_timeout: Option<f64>,
        share: Option<Py<Share>>,
    ) -> PyResult<Ev> {
        let limit = self.effective_backlog(max_backlog)?;
        if let Some(existing) = self.consumers.get(&consumer_id) {
            if existing.session_id == session_id {
                return self.replace(py, &consumer_id, now, max_backlog, filter, Some(delivery_topic), share);
            }
            self.leave(py, &consumer_id.clone(), Leave::SessionReplaced, now);
        }
        let position = self.order.start(&self.table);
        let (filter_obj, filter_text) = match filter {
            Some((e, t)) => (Some(e), Some(t)),
            None => (None, None),
        };
        let mut consumer = Consumer {
            consumer_id: consumer_id.clone(),
            session_id: session_id.clone(),
            order: self.next_order,
            requested_backlog: max_backlog,
            limit,
            filter: filter_obj,
            filter_text: filter_text.clone(),
            delivery_topic: delivery_topic.clone(),
            last_seen: now,
            session_timeout: session_timeout.unwrap_or(self.session_timeout),
            leases: OrderedSet::new(),
            position,
            position_matched: false,
            share: None,
            draining: false,
            transactional: false,
        };
        if let Some(share) = share {
            let id = share.borrow_mut(py).join(limit, 0, false);
            consumer.share = Some((share, id));
        }
        self.next_order += 1;
        self.consumers.insert(consumer_id.clone(), consumer);
        self.adopt_orphans(py, &consumer_id, now);
        let event = Ev::Subscribed {
            consumer_id,
            session_id,
            max_backlog: limit,
            filter: filter_text,
            delivery_topic,
            at: now,
        };
        self.events.push(event.clone());
        Ok(event)
    }

    fn adopt_orphans(&mut self, py: Python<'_>, consumer_id: &Name, now: f64) {
        let Some(orphans) = self.orphans.remove(consumer_id) else { return };
        if orphans.is_empty() {
            return;
        }
        for bm in orphans.to_vec() {
            let Some(&seq) = self.leased.get(&bm) else { continue };
            let session = self.touched[&seq].session_id.clone();
            let consumer = self.consumers.get_mut(consumer_id).expect("consumer");
            if session == consumer.session_id {
                consumer.add_lease(py, bm);
            } else {
                self.break_lease(py, seq, Leave::SessionReplaced, now);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn replace(
        &mut self,
        py: Python<'_>,
        consumer_id: &Name,
        now: f64,
        max_backlog: Option<i64>,
        filter: Option<(Py<PyAny>, String)>,
        delivery_topic: Option<Name>,
        share: Option<Py<Share>>,
    ) -> PyResult<Ev> {
        if !self.consumers.contains_key(consumer_id) {
            return Err(PyErr::new::<pyo3::exceptions::PyLookupError, _>(consumer_id.to_string()));
        }
        let limit = self.effective_backlog(max_backlog)?;
        let start = self.order.start(&self.table);
        let consumer = self.consumers.get_mut(consumer_id).expect("consumer");
        consumer.limit = limit;
        consumer.requested_backlog = max_backlog;
        consumer.draining = false; // subscribed to this queue again
        let (filter_obj, filter_text) = match filter {
            Some((e, t)) => (Some(e), Some(t)),
            None => (None, None),
        };
        consumer.filter = filter_obj;
        consumer.filter_text = filter_text.clone();
        if let Some(topic) = delivery_topic {
            consumer.delivery_topic = topic;
        }
        let same_share = match (&consumer.share, &share) {
            (Some((a, _)), Some(b)) => a.is(b),
            (None, None) => true,
            _ => false,
        };
        if !same_share {
            consumer.leave_share(py);
            if let Some(share) = share {
                let id = share.borrow_mut(py).join(limit, consumer.leases.len() as i64, false);
                consumer.share = Some((share, id));
            }
        }
        consumer.sync_share(py);
        consumer.last_seen = now;
        consumer.position = start;
        consumer.position_matched = false;
        let event = Ev::Replaced {
            consumer_id: consumer_id.clone(),
            session_id: consumer.session_id.clone(),
            max_backlog: consumer.limit,
            filter: filter_text,
            delivery_topic: consumer.delivery_topic.clone(),
            at: now,
        };
        self.events.push(event.clone());
        Ok(event)
    }

    /// `retire`: a replace took the subscription off this queue; the consumer keeps its
    /// leases (counting against ``share``), takes nothing new, and leaves once it holds none.
    pub fn retire(&mut self, py: Python<'_>, consumer_id: &Name, now: f64, share: Option<Py<Share>>) -> bool {
        let Some(consumer) = self.consumers.get_mut(consumer_id) else { return false };
        consumer.draining = true;
        consumer.last_seen = consumer.last_seen.max(now);
        let same = match (&consumer.share, &share) {
            (Some((a, _)), Some(b)) => a.is(b),
            (None, None) => true,
            _ => false,
        };
        if !same {
            consumer.leave_share(py);
            if let Some(share) = share {
                let id = share.borrow_mut(py).join(consumer.limit, consumer.leases.len() as i64, true);
                consumer.share = Some((share, id));
            }
        }
        consumer.sync_share(py);
        true
    }

    pub fn heartbeat(&mut self, consumer_id: &str, now: f64, session_id: Option<&str>) -> bool {
        let Some(c) = self.consumers.get_mut(&Arc::<str>::from(consumer_id)) else { return false };
        if session_id.is_some_and(|s| s != &*c.session_id) {
            return false;
        }
        c.last_seen = c.last_seen.max(now);
        true
    }

    pub fn unsubscribe(&mut self, py: Python<'_>, consumer_id: &Name, now: f64, reason: Leave) -> bool {
        if !self.consumers.contains_key(consumer_id) {
            return false;
        }
        self.leave(py, consumer_id, reason, now);
        true
    }

    fn leave(&mut self, py: Python<'_>, consumer_id: &Name, reason: Leave, now: f64) {
        let Some(mut consumer) = self.consumers.remove(consumer_id) else { return };
        consumer.leave_share(py);
        if consumer.transactional {
            self.transactional -= 1;
            self.fence_wanted.remove(consumer_id);
        }
        let mut broken = 0;
        // Out of `consumers` now, its leases are dropped as a gone consumer's are (as in
        // Python, where `_drop_lease` no longer finds it).
        for bm in consumer.leases.to_vec() {
            let seq = self.leased.get(&bm).copied().expect("a lease");
            if self.touched[&seq].slot_only {
                self.free_slot(py, seq, now);
            } else {
                self.break_lease(py, seq, reason, now);
                broken += 1;
            }
        }
        self.events.push(Ev::Left {
            consumer_id: consumer.consumer_id.clone(),
            session_id: consumer.session_id.clone(),
            reason,
            broken,
            at: now,
        });
    }
}

fn after(position: Pos) -> Pos {
    (position.0, position.1 + 1)
}
/// `_covers` without borrowing the whole engine (dispatch holds other parts of it).
fn covers_with(
    py: Python<'_>,
    hooks: &PyHooks,
    projection_seqs: &[Seq],
    projection_fields: &[Py<PyAny>],
    seq: Seq,
    doc: &Py<PyAny>,
    expression: &Py<PyAny>,
) -> PyResult<bool> {
    let bound = doc.bind(py);
    let kind = bound.get_type();
    if kind.is(hooks.raw_document.bind(py)) || bound.is_exact_instance_of::<pyo3::types::PyBytes>() {
        return Ok(true);
    }
    if kind.is(hooks.partial_document.bind(py)) {
        let fields = doc.getattr(py, "fields")?;
        return expression.call_method1(py, "covered_by", (fields,))?.extract(py);
    }
    let index = projection_seqs.partition_point(|&s| s <= seq);
    if index == 0 {
        return Ok(true);
    }
    expression
        .call_method1(py, "covered_by", (projection_fields[index - 1].clone_ref(py),))?
        .extract(py)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Deliver {
    Lease,
    AtMostOnce,
}

impl Engine {
    // ------------------------------------------------------------------ acknowledgements
    /// With `consumer` (the consumer the ack record came from, protocol 5), a token counts as
    /// the holder's only when that consumer holds the lease (`QueueEngine.ack`).
    pub fn ack(&mut self, py: Python<'_>, items: Vec<AckIn>, now: f64, consumer: Option<&str>) -> PyResult<Vec<Outcome>> {
        let mut results = Vec::with_capacity(items.len());
        let strict = self.policy.strict;
        for item in items {
            let seq = self
                .table
                .topic_name(&item.topic)
                .and_then(|topic| self.leased.get(&Bm::new(topic, item.partition, item.offset)).copied());
            let Some(seq) = seq else {
                let outcome = self.ack_unleased(py, &item, now)?;
                results.push(outcome);
                continue;
            };
            let (holder, slot_only) = {
                let t = &self.touched[&seq];
                let holder = match (&item.token, &t.token) {
                    (Some(given), Some(held)) => given.as_str() == &**held,
                    _ => false,
                } && consumer.is_none_or(|c| c == &*t.consumer_id);
                (holder, t.slot_only)
            };
            let kind = item.kind;
            let outcome = if slot_only {
                if strict && !holder {
                    Outcome::WrongToken
                } else if kind == RENEW {
                    self.renew(seq, item.delay, now);
                    Outcome::Applied
                } else {
                    self.free_slot(py, seq, now);
                    Outcome::Applied
                }
            } else if kind == ACCEPT {
                if holder || !strict {
                    self.accept(py, seq, now)?;
                    Outcome::Applied
                } else {
                    Outcome::WrongToken
                }
            } else if kind == RELEASE {
                if holder {
                    self.release(py, seq, item.delay, now)?;
                    Outcome::Applied
                } else {
                    Outcome::WrongToken
                }
            } else if kind == REJECT {
                if holder || !strict {
                    self.reject(py, seq, item.reason.clone(), now)?;
                    Outcome::Applied
                } else {
                    Outcome::WrongToken
                }
            } else if kind == RENEW {
                if holder {
                    self.renew(seq, item.delay, now);
                    Outcome::Applied
                } else {
                    Outcome::WrongToken
                }
            } else {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown ack type {kind}"
                )));
            };
            results.push(outcome);
        }
        Ok(results)
    }

    /// ACCEPT of many leases of one journal partition (an AcceptRecord group): `ack` for
    /// items of one kind, without an item each. Returns (index, outcome) of those not applied.
    pub fn accept_many(&mut self, py: Python<'_>, topic: &str, partition: i64, offsets: &[i64],
                       tokens: &[&str], now: f64, consumer: Option<&str>) -> PyResult<Vec<(usize, Outcome)>> {
        let name = self.table.topic_name(topic);
        let strict = self.policy.strict;
        let mut odd = Vec::new();
        for (i, (&offset, &token)) in offsets.iter().zip(tokens).enumerate() {
            let seq = name
                .as_ref()
                .and_then(|n| self.leased.get(&Bm::new(n.clone(), partition, offset)).copied());
            let Some(seq) = seq else {
                let item = AckIn {
                    topic: topic.to_string(),
                    partition,
                    offset,
                    token: Some(token.to_string()),
                    kind: ACCEPT,
                    delay: None,
                    reason: None,
                };
                let outcome = self.ack_unleased(py, &item, now)?;
                if outcome != Outcome::Applied {
                    odd.push((i, outcome));
                }
                continue;
            };
            let (holder, slot_only) = {
                let t = &self.touched[&seq];
                (t.token.as_deref() == Some(token) && consumer.is_none_or(|c| c == &*t.consumer_id),
                 t.slot_only)
            };
            if slot_only {
                if strict && !holder {
                    odd.push((i, Outcome::WrongToken));
                } else {
                    self.free_slot(py, seq, now);
                }
            } else if holder || !strict {
                self.accept(py, seq, now)?;
            } else {
                odd.push((i, Outcome::WrongToken));
            }
        }
        Ok(odd)
    }

    fn ack_unleased(&mut self, py: Python<'_>, item: &AckIn, now: f64) -> PyResult<Outcome> {
        let strict = self.policy.strict;
        let seq = match self.table.locate(&item.topic, item.partition, item.offset) {
            Location::Done => return Ok(Outcome::AlreadyDone),
            Location::Unknown => {
                if self.policy.target_queue_depth.is_some()
                    && self.in_deferred(&item.topic, item.partition, item.offset)
                {
                    // A message of the queue past its depth, not in memory: inactive.
                    let bm = Bm::new(self.intern(&item.topic), item.partition, item.offset);
                    if self.acked_ahead.contains(&bm) || self.restoring.get(&bm).is_some_and(|r| r.done()) {
                        return Ok(Outcome::AlreadyDone);
                    }
                    if strict || item.kind != ACCEPT {
                        return Ok(Outcome::NotLeased);
                    }
                    // `QueueEngine._accept_deferred`.
                    self.events.push(Ev::Enqueued {
                        topic: bm.topic.clone(),
                        partition: bm.partition,
                        offsets: vec![bm.offset],
                        at: now,
                    });
                    self.settle_early_ack(bm.clone(), now);
                    self.acked_ahead.insert(bm);
                    return Ok(Outcome::Applied);
                }
                if self.policy.target_queue_depth.is_some()
                    && !strict
                    && item.kind == ACCEPT
                    && self.not_read_yet(&item.topic, item.partition, item.offset)
                {
                    let bm = Bm::new(self.intern(&item.topic), item.partition, item.offset);
                    self.early_acks.insert(bm);
                    return Ok(Outcome::Remembered);
                }
                return Ok(Outcome::UnknownBookmark);
            }
            Location::Found(seq) => seq,
        };
        let state = self.table.state_of(seq);
        if state >= ACKED {
            return Ok(Outcome::AlreadyDone);
        }
        if strict {
            return Ok(Outcome::NotLeased);
        }
        if item.kind == ACCEPT {
            let source = if state == INACTIVE { AckSource::Early } else { AckSource::Consumer };
            self.accept_unleased(py, seq, source, now)?;
            return Ok(Outcome::Applied);
        }
        if item.kind == REJECT {
            self.expire(py, seq, Reason::Rejected, item.reason.clone(), None, now)?;
            return Ok(Outcome::Applied);
        }
        Ok(Outcome::NotLeased)
    }

    fn not_read_yet(&self, topic: &str, partition: i64, offset: i64) -> bool {
        match self.table.find_source(topic, partition) {
            None => true,
            Some(i) => offset >= self.table.sources[i].next_offset,
        }
    }

    pub fn ack_matching(&mut self, py: Python<'_>, expression: Option<Py<PyAny>>, now: f64) -> PyResult<i64> {
        let base = self.table.base;
        let first = (self.table.advance_first_live() - base).max(0) as usize;
        let mut matching = Vec::new();
        for slot in first..self.table.state.len() {
            let current = self.table.state[slot];
            if current >= ACKED || current == INACTIVE {
                continue;
            }
            let seq = base + slot as i64;
            match &expression {
                None => matching.push(seq),
                Some(e) => {
                    let doc = self.document(py, slot)?;
                    if covers_with(py, &self.hooks, &self.projection_seqs, &self.projection_fields,
                                   seq, &doc, e)?
                        && call_matches(py, e, &doc)?
                    {
                        matching.push(seq);
                    }
                }
            }
        }
        let count = matching.len() as i64;
        for seq in matching {
            if let Some(t) = self.listed(seq) {
                if self.leased.contains_key(&t.bm) {
                    self.drop_lease(py, seq);
                }
            }
            self.accept_unleased(py, seq, AckSource::Admin, now)?;
        }
        Ok(count)
    }

    // ------------------------------------------------------------------ timers
    pub fn tick(&mut self, py: Python<'_>, now: f64) -> PyResult<()> {
        self.expire_due_leases(py, now)?;
        while let Some(Reverse(Timed(at, seq))) = self.delays.peek().copied() {
            if at > now {
                break;
            }
            self.delays.pop();
            if seq >= self.table.base && self.table.state[self.table.slot(seq)] == DELAYED {
                self.promote(py, seq, now)?;
            }
        }
        if self.policy.expiration.is_some() {
            self.expire_old_entries(py, now)?;
        }
        if self.expiries.peek().is_some_and(|Reverse(Timed(at, _))| *at <= now) {
            self.expire_own(py, now)?;
        }
        let ids = self.consumers.keys_vec();
        for id in ids {
            let due = match self.consumers.get(&id) {
                Some(c) => (now >= c.last_seen + c.session_timeout, c.transactional),
                None => (false, false),
            };
            if due.0 && !(due.1 && self.held(&id, None)) {
                self.leave(py, &id, Leave::SessionTimeout, now);
            }
        }
        let drained: Vec<Name> = self
            .consumers
            .iter()
            .filter(|(_, c)| c.draining && c.leases.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        for id in drained {
            self.leave(py, &id, Leave::Replaced, now);
        }
        Ok(())
    }

    fn expire_due_leases(&mut self, py: Python<'_>, now: f64) -> PyResult<()> {
        let mut due: Vec<Seq> = Vec::new();
        for seq in self.leased.values() {
            let t = &self.touched[seq];
            if t.restored {
                continue;
            }
            if t.deadline > now {
                break;
            }
            due.push(*seq);
        }
        if !due.is_empty() && self.transactional > 0 {
            let mut kept = Vec::with_capacity(due.len());
            for seq in due {
                let (slot_only, consumer_id, session_id) = {
                    let t = &self.touched[&seq];
                    (t.slot_only, t.consumer_id.clone(), t.session_id.clone())
                };
                if slot_only || !self.held(&consumer_id, Some(&session_id)) {
                    kept.push(seq);
                }
            }
            due = kept;
        }
        let mut popped: std::collections::HashSet<Seq> = std::collections::HashSet::new();
        while let Some(Reverse(Timed(at, seq))) = self.restored_deadlines.peek().copied() {
            if at > now {
                break;
            }
            self.restored_deadlines.pop();
            // `t.deadline <= now`: not renewed since it was pushed; `popped.insert`: not
            // pushed twice (renewed twice with a length).
            let found = self.listed(seq).and_then(|t| {
                (t.restored && t.deadline <= now && self.leased.contains_key(&t.bm))
                    .then(|| (t.slot_only, t.consumer_id.clone(), t.session_id.clone()))
            });
            if let Some((slot_only, consumer_id, session_id)) = found {
                if popped.insert(seq) && (slot_only || !self.held(&consumer_id, Some(&session_id))) {
                    due.push(seq);
                }
            }
        }
        for seq in due {
            if self.touched[&seq].slot_only {
                self.free_slot(py, seq, now);
            } else {
                self.expire_lease(py, seq, now)?;
            }
        }
        Ok(())
    }

    fn expire_old_entries(&mut self, py: Python<'_>, now: f64) -> PyResult<()> {
        let expiration = self.policy.expiration.expect("expiration");
        for index in 0..self.table.sources.len() {
            let mut i = self.table.sources[index].expiry_index;
            loop {
                let end = self.table.sources[index].seqs.len();
                if i >= end {
                    break;
                }
                let seq = self.table.sources[index].seqs[i];
                if seq >= self.table.base {
                    let slot = self.table.slot(seq);
                    let current = self.table.state[slot];
                    if current < ACKED && current != LEASED && !self.expires_at.contains_key(&seq) {
                        if self.table.times[slot] + expiration > now {
                            break;
                        }
                        self.expire(py, seq, Reason::Expiration, None, None, now)?;
                    }
                }
                i += 1;
            }
            self.table.sources[index].expiry_index = i;
        }
        Ok(())
    }

    /// `QueueEngine._expire_own`: entries whose own expiration is due leave unless leased.
    fn expire_own(&mut self, py: Python<'_>, now: f64) -> PyResult<()> {
        while let Some(Reverse(Timed(at, seq))) = self.expiries.peek().copied() {
            if at > now {
                break;
            }
            self.expiries.pop();
            if !self.expires_at.contains_key(&seq) {
                continue;
            }
            if seq < self.table.base {
                self.expires_at.remove(&seq);
                continue;
            }
            let current = self.table.state[self.table.slot(seq)];
            if current >= ACKED {
                self.expires_at.remove(&seq);
            } else if current == LEASED {
                let again = self.touched.get(&seq).map_or(now, |t| t.deadline);
                self.expiries.push(Reverse(Timed(again.max(now + 0.001), seq)));
            } else {
                self.expires_at.remove(&seq);
                self.expire(py, seq, Reason::Expiration, None, None, now)?;
            }
        }
        Ok(())
    }

    fn too_old(&self, seq: Seq, now: f64) -> bool {
        if !self.expires_at.is_empty() {
            if let Some(at) = self.expires_at.get(&seq) {
                return *at <= now;
            }
        }
        match self.policy.expiration {
            Some(expiration) => self.table.times[self.table.slot(seq)] + expiration <= now,
            None => false,
        }
    }

    // ------------------------------------------------------------------ dispatch
    pub fn dispatch(&mut self, py: Python<'_>, now: f64) -> PyResult<Vec<Ev>> {
        let mut deliveries: Vec<Ev> = Vec::new();
        if !self.barriers.is_empty() {
            self.deliver_due_barriers(py, now, &mut deliveries)?;
        }
        if self.consumers.is_empty() {
            return Ok(deliveries);
        }
        let deliver = if self.policy.at_most_once { Deliver::AtMostOnce } else { Deliver::Lease };
        let mut needy: Vec<Name> = self
            .consumers
            .iter()
            .filter(|(_, c)| c.room(py) > 0)
            .map(|(id, _)| id.clone())
            .collect();
        if needy.len() > 1 && needy.iter().all(|id| self.consumers.get(id).expect("c").filter.is_none()) {
            self.dispatch_unfiltered(py, needy, deliver, &mut deliveries, now)?;
            return Ok(deliveries);
        }
        while !needy.is_empty() {
            if needy.len() == 1 {
                let id = needy[0].clone();
                let room = self.consumers.get(&id).expect("c").room(py);
                let seqs = self.candidates(py, &id, room)?;
                if !seqs.is_empty() {
                    let got = self.deliver(py, deliver, &seqs, &id, now)?;
                    deliveries.extend(got);
                    self.last_served = self.consumers.get(&id).expect("c").order;
                }
                break;
            }
            let mut best: Option<Pos> = None;
            let mut chosen: Vec<Name> = Vec::new();
            let mut hungry: Vec<Name> = Vec::new();
            for id in &needy {
                if self.candidates(py, id, 1)?.is_empty() {
                    continue;
                }
                hungry.push(id.clone());
                let position = self.consumers.get(id).expect("c").position;
                match best {
                    Some(b) if position > b => {}
                    Some(b) if position == b => chosen.push(id.clone()),
                    _ => {
                        best = Some(position);
                        chosen = vec![id.clone()];
                    }
                }
            }
            let Some(best) = best else { break };
            let winner = self.choose(py, &chosen);
            let got = self.deliver(py, deliver, &[best.1], &winner, now)?;
            deliveries.extend(got);
            self.last_served = self.consumers.get(&winner).expect("c").order;
            needy = hungry
                .into_iter()
                .filter(|id| self.consumers.get(id).is_some_and(|c| c.room(py) > 0))
                .collect();
        }
        Ok(deliveries)
    }

    fn deliver(&mut self, py: Python<'_>, how: Deliver, seqs: &[Seq], id: &Name, now: f64) -> PyResult<Vec<Ev>> {
        match how {
            Deliver::Lease => self.lease(py, seqs, id, now),
            Deliver::AtMostOnce => self.deliver_at_most_once(py, seqs, id, now),
        }
    }

    fn dispatch_unfiltered(
        &mut self,
        py: Python<'_>,
        needy: Vec<Name>,
        deliver: Deliver,
        deliveries: &mut Vec<Ev>,
        now: f64,
    ) -> PyResult<()> {
        // min() keeps the first of equal positions, as Python's min(key=...) does.
        let mut lead = needy[0].clone();
        let mut lead_position = self.consumers.get(&lead).expect("c").position;
        for id in &needy[1..] {
            let p = self.consumers.get(id).expect("c").position;
            if p < lead_position {
                lead = id.clone();
                lead_position = p;
            }
        }
        let total: i64 = needy.iter().map(|id| self.consumers.get(id).expect("c").room(py)).sum();
        let seqs = self.candidates(py, &lead, total)?;
        let shared = needy.iter().any(|id| self.consumers.get(id).expect("c").share.is_some());
        let taken = if shared {
            self.deliver_one_by_one(py, &seqs, needy.clone(), deliver, deliveries, now)?
        } else {
            self.deliver_by_fairness(py, &seqs, &needy, deliver, deliveries, now)?
        };
        let (position, matched) = if taken < seqs.len() {
            (self.order.position(&self.table, seqs[taken]), false)
        } else {
            let c = self.consumers.get(&lead).expect("c");
            (c.position, c.position_matched)
        };
        for id in &needy {
            if let Some(c) = self.consumers.get_mut(id) {
                c.position = position;
                c.position_matched = matched;
            }
        }
        Ok(())
    }

    fn deliver_one_by_one(
        &mut self,
        py: Python<'_>,
        seqs: &[Seq],
        mut needy: Vec<Name>,
        deliver: Deliver,
        deliveries: &mut Vec<Ev>,
        now: f64,
    ) -> PyResult<usize> {
        let mut taken = 0;
        for &seq in seqs {
            if needy.is_empty() {
                break;
            }
            let winner = self.choose(py, &needy);
            let got = self.deliver(py, deliver, &[seq], &winner, now)?;
            deliveries.extend(got);
            self.last_served = self.consumers.get(&winner).expect("c").order;
            taken += 1;
            needy.retain(|id| self.consumers.get(id).is_some_and(|c| c.room(py) > 0));
        }
        Ok(taken)
    }

    fn deliver_by_fairness(
        &mut self,
        py: Python<'_>,
        seqs: &[Seq],
        needy: &[Name],
        deliver: Deliver,
        deliveries: &mut Vec<Ev>,
        now: f64,
    ) -> PyResult<usize> {
        let fairness = self.policy.fairness;
        let n = needy.len();
        let mut held: Vec<i64> = Vec::with_capacity(n);
        let mut room: Vec<i64> = Vec::with_capacity(n);
        let mut limit: Vec<i64> = Vec::with_capacity(n);
        let mut orders: Vec<i64> = Vec::with_capacity(n);
        for id in needy {
            let c = self.consumers.get(id).expect("c");
            held.push(c.leases.len() as i64);
            room.push(c.room(py));
            limit.push(c.limit);
            orders.push(c.order);
        }
        let mut got: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut open: Vec<usize> = (0..n).collect();
        let mut last = self.last_served;
        let mut taken = 0usize;
        for _ in seqs {
            if open.is_empty() {
                break;
            }
            let w = match fairness {
                Fairness::Proportional => {
                    let mut w = open[0];
                    for &i in &open[1..] {
                        if held[i] * limit[w] < held[w] * limit[i] {
                            w = i;
                        }
                    }
                    w
                }
                Fairness::RoundRobin => open.iter().copied().find(|&i| orders[i] > last).unwrap_or(open[0]),
                Fairness::Fast => open[0],
            };
            got[w].push(taken);
            held[w] += 1;
            room[w] -= 1;
            last = orders[w];
            taken += 1;
            if room[w] <= 0 {
                open.retain(|&i| i != w);
            }
        }
        self.last_served = last;
        let first_event = self.events.len();
        let mut placed: Vec<Option<Ev>> = vec![None; taken];
        for (i, mine) in got.iter().enumerate() {
            if mine.is_empty() {
                continue;
            }
            let batch: Vec<Seq> = mine.iter().map(|&k| seqs[k]).collect();
            let delivered = self.deliver(py, deliver, &batch, &needy[i], now)?;
            for (&k, d) in mine.iter().zip(delivered) {
                placed[k] = Some(d);
            }
        }
        let in_order: Vec<Ev> = placed.into_iter().flatten().collect();
        if got.len() > 1 {
            let rank: FxHashMap<&Bm, usize> = in_order
                .iter()
                .enumerate()
                .filter_map(|(k, d)| d.bookmark().map(|b| (b, k)))
                .collect();
            let mut tail: Vec<Ev> = self.events.drain(first_event..).collect();
            tail.sort_by_key(|e| e.bookmark().and_then(|b| rank.get(b).copied()).unwrap_or(taken));
            self.events.extend(tail);
        }
        deliveries.extend(in_order);
        Ok(taken)
    }

    fn choose(&self, py: Python<'_>, candidates: &[Name]) -> Name {
        if candidates.len() == 1 {
            return candidates[0].clone();
        }
        let get = |id: &Name| self.consumers.get(id).expect("c");
        match self.policy.fairness {
            Fairness::Proportional => {
                let mut best = &candidates[0];
                let (mut best_leased, mut best_limit) = {
                    let c = get(best);
                    (c.leases.len() as i64, c.limit)
                };
                for id in &candidates[1..] {
                    let c = get(id);
                    let (leased, limit) = (c.leases.len() as i64, c.limit);
                    if leased * best_limit < best_leased * limit {
                        best = id;
                        best_leased = leased;
                        best_limit = limit;
                    }
                }
                let _ = py;
                best.clone()
            }
            Fairness::RoundRobin => candidates
                .iter()
                .find(|id| get(id).order > self.last_served)
                .unwrap_or(&candidates[0])
                .clone(),
            Fairness::Fast => candidates[0].clone(),
        }
    }

    /// An entry's document for an expression: a record value held as plain bytes (the
    /// coordinator's batch path stores the value itself) becomes a `RawDocument` the first
    /// time an expression reads it, and stays one (its parse is kept).
    fn document(&mut self, py: Python<'_>, slot: usize) -> PyResult<Py<PyAny>> {
        let doc = &self.table.docs[slot];
        if doc.bind(py).is_exact_instance_of::<pyo3::types::PyBytes>() {
            let wrapped = self.hooks.raw_document.call1(py, (doc.clone_ref(py),))?;
            self.table.docs[slot] = wrapped.clone_ref(py);
            return Ok(wrapped);
        }
        Ok(doc.clone_ref(py))
    }

    /// Whether `filter` takes the entry: None when its projected document cannot tell
    /// (asked for again), the filter's answer otherwise.
    fn filter_takes(&mut self, py: Python<'_>, seq: Seq, filter: &Py<PyAny>, projected: bool)
        -> PyResult<Option<bool>> {
        let slot = self.table.slot(seq);
        let doc = self.document(py, slot)?;
        if projected
            && !covers_with(py, &self.hooks, &self.projection_seqs, &self.projection_fields, seq,
                            &doc, filter)?
        {
            return Ok(None);
        }
        call_matches(py, filter, &doc).map(Some)
    }

    /// The first `room` entries in queue order this consumer may get now (`_candidates`).
    fn candidates(&mut self, py: Python<'_>, id: &Name, room: i64) -> PyResult<Vec<Seq>> {
        let (filter, mut position, mut matched_flag) = {
            let c = self.consumers.get(id).expect("consumer");
            (c.filter.as_ref().map(|f| f.clone_ref(py)), c.position, c.position_matched)
        };
        let matched_at: Option<Pos> = if matched_flag { Some(position) } else { None };
        let fence = self.barriers.front().copied().unwrap_or(NO_FENCE);
        let projected = filter.is_some() && !self.projection_seqs.is_empty();
        let room = room.max(0) as usize;
        let mut found: Vec<Seq> = Vec::new();
        if self.fifo && room == 0 {
            return Ok(found);
        }
        let base = self.table.base;
        let mut cursor: Pos = position;
        let mut cap_hit = false;
        loop {
            // The next AVAILABLE entry from the cursor on, in queue order.
            let next: Option<(Pos, Seq)> = if self.fifo {
                let slot = (cursor.1 - base).max(0) as usize;
                let state = &self.table.state;
                if slot < state.len() {
                    memchr::memchr(AVAILABLE, &state[slot..])
                        .map(|i| base + (slot + i) as i64)
                        .map(|seq| ((0, seq), seq))
                } else {
                    None
                }
            } else {
                let Order::Priority(set) = &self.order else { unreachable!() };
                let state = &self.table.state;
                set.range(cursor..)
                    .find(|(_, seq)| state[(seq - base) as usize] == AVAILABLE)
                    .map(|&(rank, seq)| ((rank, seq), seq))
            };
            let Some((here, seq)) = next else { break };
            cursor = (here.0, here.1 + 1);
            if seq >= fence {
                if self.fifo {
                    // Everything after a barrier waits until the barrier is delivered.
                    if found.is_empty() {
                        position = (0, seq);
                        matched_flag = false;
                    }
                    cap_hit = true;
                    break;
                }
                continue;
            }
            let slot = (seq - base) as usize;
            if let Some(keys) = self.table.keys.as_ref() {
                if let Some(key) = &keys[slot] {
                    if self.key_head.get(key).copied() != Some(seq) {
                        continue;
                    }
                }
            }
            if let Some(expression) = &filter {
                if matched_at != Some(here) {
                    match self.filter_takes(py, seq, expression, projected)? {
                        None => {
                            // Undecidable until the record is read again: passed over now.
                            if self.wanted.len() >= MAX_WANTED_DOCUMENTS {
                                if found.is_empty() {
                                    position = here;
                                    matched_flag = false;
                                }
                                cap_hit = true;
                                break;
                            }
                            self.wanted.insert(seq);
                            continue;
                        }
                        Some(false) => continue,
                        Some(true) => {}
                    }
                }
            }
            found.push(seq);
            position = here;
            matched_flag = true;
            if found.len() >= room {
                cap_hit = true;
                break;
            }
        }
        if !cap_hit && found.is_empty() {
            position = self.order.end(&self.table);
            matched_flag = false;
        }
        let c = self.consumers.get_mut(id).expect("consumer");
        c.position = position;
        c.position_matched = matched_flag;
        Ok(found)
    }

    fn rewind(&mut self, position: Pos) {
        for c in self.consumers.values_mut_unordered() {
            if position < c.position {
                c.position = position;
                c.position_matched = false;
            }
        }
    }

    fn rewind_all(&mut self) {
        let start = self.order.start(&self.table);
        for c in self.consumers.values_mut_unordered() {
            c.position = start;
            c.position_matched = false;
        }
    }

    // ------------------------------------------------------------------ barriers
    fn deliver_due_barriers(&mut self, py: Python<'_>, now: f64, deliveries: &mut Vec<Ev>) -> PyResult<()> {
        while let Some(&seq) = self.barriers.front() {
            if self.table.advance_first_live() != seq {
                return Ok(());
            }
            if self.policy.at_most_once && self.leased.values().any(|s| self.touched[s].seq < seq) {
                return Ok(());
            }
            if self.consumers.values().all(|c| c.draining) {
                return Ok(());
            }
            if self.table.state[self.table.slot(seq)] != AVAILABLE {
                return Ok(());
            }
            if !self.projection_seqs.is_empty() {
                let doc = self.document(py, self.table.slot(seq))?;
                let mut all = true;
                for c in self.consumers.values().filter(|c| !c.draining) {
                    if let Some(f) = &c.filter {
                        if !covers_with(py, &self.hooks, &self.projection_seqs,
                                        &self.projection_fields, seq, &doc, f)? {
                            all = false;
                            break;
                        }
                    }
                }
                if !all {
                    self.want(seq);
                    return Ok(());
                }
            }
            let event = self.deliver_barrier(py, seq, now)?;
            deliveries.push(event);
        }
        Ok(())
    }

    fn deliver_barrier(&mut self, py: Python<'_>, seq: Seq, now: f64) -> PyResult<Ev> {
        let slot = self.table.slot(seq);
        let mut recipients = Vec::new();
        {
            let doc = self.document(py, slot)?;
            for c in self.consumers.values().filter(|c| !c.draining) {
                let takes = match &c.filter {
                    None => true,
                    Some(f) => call_matches(py, f, &doc)?,
                };
                if takes {
                    recipients.push((c.consumer_id.clone(), c.delivery_topic.clone()));
                }
            }
        }
        self.table.state[slot] = ACKED;
        let bm = self.table.bookmark(seq);
        let event = Ev::Barrier { bm: bm.clone(), recipients, at: now };
        self.events.push(event.clone());
        self.events.push(Ev::Acked { bm, consumer_id: None, source: AckSource::Barrier, at: now, delivery_count: None });
        self.dirty.insert(seq);
        self.on_done(py, seq, AVAILABLE, now, true)?;
        Ok(event)
    }

    // ------------------------------------------------------------------ transitions
    fn touch(&mut self, seq: Seq) -> &mut Touched {
        if self.listed(seq).is_none() {
            let bm = self.table.bookmark(seq);
            self.touched.insert(seq, Touched::new(seq, bm, &self.empty));
        }
        self.touched.get_mut(&seq).expect("touched")
    }

    fn lease(&mut self, py: Python<'_>, seqs: &[Seq], id: &Name, now: f64) -> PyResult<Vec<Ev>> {
        let name = self.name();
        let _ = name;
        let (consumer_id, session_id, delivery_topic) = {
            let c = self.consumers.get(id).expect("consumer");
            (c.consumer_id.clone(), c.session_id.clone(), c.delivery_topic.clone())
        };
        let deadline = now + self.lease_period;
        let mut events = Vec::with_capacity(seqs.len());
        for &seq in seqs {
            let slot = self.table.slot(seq);
            self.table.state[slot] = LEASED;
            let token = self.tokens.next(py)?;
            let t = self.touch(seq);
            let count = t.delivery_count + 1;
            t.delivery_count = count;
            t.token = Some(token.clone());
            t.deadline = deadline;
            t.consumer_id = consumer_id.clone();
            t.session_id = session_id.clone();
            let bm = t.bm.clone();
            self.leased.insert(bm.clone(), seq);
            self.consumers.get_mut(id).expect("consumer").leases.insert(bm.clone());
            events.push(Ev::Leased {
                bm,
                consumer_id: consumer_id.clone(),
                delivery_topic: delivery_topic.clone(),
                token,
                deadline,
                delivery_count: count,
                at: now,
            });
        }
        self.consumers.get(id).expect("consumer").sync_share(py);
        self.dirty.extend(seqs.iter().copied());
        self.events.extend(events.iter().cloned());
        Ok(events)
    }

    fn deliver_at_most_once(&mut self, py: Python<'_>, seqs: &[Seq], id: &Name, now: f64) -> PyResult<Vec<Ev>> {
        let mut events = Vec::with_capacity(seqs.len());
        for &seq in seqs {
            events.extend(self.lease(py, &[seq], id, now)?);
            let slot = self.table.slot(seq);
            self.table.state[slot] = ACKED;
            let t = self.touched.get_mut(&seq).expect("touched");
            t.slot_only = true;
            let ev = Ev::Acked {
                bm: t.bm.clone(),
                consumer_id: Some(id.clone()),
                source: AckSource::Delivery,
                at: now,
                delivery_count: Some(t.delivery_count),
            };
            self.events.push(ev);
            self.on_done(py, seq, LEASED, now, false)?;
        }
        Ok(events)
    }

    fn accept(&mut self, py: Python<'_>, seq: Seq, now: f64) -> PyResult<()> {
        let consumer_id = self.touched[&seq].consumer_id.clone();
        self.drop_lease(py, seq);
        let slot = self.table.slot(seq);
        self.table.state[slot] = ACKED;
        self.dirty.insert(seq);
        let t = &self.touched[&seq];
        self.events.push(Ev::Acked {
            bm: t.bm.clone(),
            consumer_id: Some(consumer_id),
            source: AckSource::Consumer,
            at: now,
            delivery_count: Some(t.delivery_count),
        });
        if self.done_hooks {
            self.on_done(py, seq, LEASED, now, true)?;
        }
        Ok(())
    }

    fn accept_unleased(&mut self, py: Python<'_>, seq: Seq, source: AckSource, now: f64) -> PyResult<()> {
        let slot = self.table.slot(seq);
        let was = self.table.state[slot];
        self.table.state[slot] = ACKED;
        self.dirty.insert(seq);
        let bm = self.table.bookmark(seq);
        self.events.push(Ev::Acked { bm, consumer_id: None, source, at: now, delivery_count: None });
        self.on_done(py, seq, was, now, true)
    }

    fn settle_early_ack(&mut self, bm: Bm, now: f64) {
        self.direct_records.push(Rec::plain(bm.clone(), ACKED));
        self.events.push(Ev::Acked { bm, consumer_id: None, source: AckSource::Early, at: now, delivery_count: None });
    }

    fn release(&mut self, py: Python<'_>, seq: Seq, delay: Option<f64>, now: f64) -> PyResult<()> {
        let consumer_id = self.touched[&seq].consumer_id.clone();
        self.drop_lease(py, seq);
        let (cancels, deliveries, bm) = {
            let t = self.touched.get_mut(&seq).expect("touched");
            t.cancel_count += 1;
            (t.cancel_count, t.delivery_count, t.bm.clone())
        };
        let policy = &self.policy;
        let reason = if policy.max_cancels != 0 && cancels >= policy.max_cancels {
            Some(Reason::MaxCancels)
        } else if policy.max_deliveries != 0 && deliveries >= policy.max_deliveries {
            Some(Reason::MaxDeliveries)
        } else if self.too_old(seq, now) {
            Some(Reason::Expiration)
        } else {
            None
        };
        if let Some(reason) = reason {
            self.events.push(Ev::Released { bm, consumer_id: consumer_id.clone(), cancel_count: cancels, available_at: None, at: now });
            return self.expire(py, seq, reason, None, Some(consumer_id), now);
        }
        let wait = match delay {
            Some(d) => d,
            None => self.backoff(py, deliveries)?,
        };
        let available_at = if wait > 0.0 { now + wait } else { now };
        self.events.push(Ev::Released { bm, consumer_id, cancel_count: cancels, available_at: Some(available_at), at: now });
        self.return_(seq, if wait > 0.0 { Some(available_at) } else { None });
        Ok(())
    }

    fn expire_lease(&mut self, py: Python<'_>, seq: Seq, now: f64) -> PyResult<()> {
        let consumer_id = self.touched[&seq].consumer_id.clone();
        self.drop_lease(py, seq);
        let bm = self.touched[&seq].bm.clone();
        if let Some(reason) = self.return_limit(seq, now) {
            self.events.push(Ev::LeaseExpired { bm, consumer_id: consumer_id.clone(), available_at: None, at: now });
            return self.expire(py, seq, reason, None, Some(consumer_id), now);
        }
        let wait = self.backoff(py, self.touched[&seq].delivery_count)?;
        let available_at = if wait > 0.0 { now + wait } else { now };
        self.events.push(Ev::LeaseExpired { bm, consumer_id, available_at: Some(available_at), at: now });
        self.return_(seq, if wait > 0.0 { Some(available_at) } else { None });
        Ok(())
    }

    fn break_lease(&mut self, py: Python<'_>, seq: Seq, reason: Leave, now: f64) {
        let consumer_id = self.touched[&seq].consumer_id.clone();
        self.drop_lease(py, seq);
        let bm = self.touched[&seq].bm.clone();
        self.events.push(Ev::LeaseBroken { bm, consumer_id: consumer_id.clone(), reason, at: now });
        if let Some(limit) = self.return_limit(seq, now) {
            // Expiring cannot fail here: no expression is evaluated on the way.
            let _ = self.expire(py, seq, limit, None, Some(consumer_id), now);
            return;
        }
        self.return_(seq, None);
    }

    fn return_limit(&self, seq: Seq, now: f64) -> Option<Reason> {
        let max = self.policy.max_deliveries;
        if max != 0 && self.touched[&seq].delivery_count >= max {
            return Some(Reason::MaxDeliveries);
        }
        if self.too_old(seq, now) {
            return Some(Reason::Expiration);
        }
        None
    }

    fn backoff(&self, py: Python<'_>, delivery_count: i64) -> PyResult<f64> {
        match &self.policy.backoff {
            Some(b) => b.call1(py, (delivery_count,))?.extract(py),
            None => Ok(0.0),
        }
    }

    fn return_(&mut self, seq: Seq, available_at: Option<f64>) {
        self.dirty.insert(seq);
        let slot = self.table.slot(seq);
        match available_at {
            None => {
                self.table.state[slot] = AVAILABLE;
                self.touched.get_mut(&seq).expect("touched").available_at = None;
                let position = self.order.position(&self.table, seq);
                self.rewind(position);
            }
            Some(at) => {
                self.table.state[slot] = DELAYED;
                self.touched.get_mut(&seq).expect("touched").available_at = Some(at);
                self.delays.push(Reverse(Timed(at, seq)));
            }
        }
    }

    fn reject(&mut self, py: Python<'_>, seq: Seq, reason: Option<String>, now: f64) -> PyResult<()> {
        let consumer_id = self.touched[&seq].consumer_id.clone();
        self.drop_lease(py, seq);
        self.expire(py, seq, Reason::Rejected, reason, Some(consumer_id), now)
    }

    /// `QueueEngine._renew`: the lease period from now, or `extend` seconds from now (out of
    /// deadline order, so timed by the heap restored leases use).
    fn renew(&mut self, seq: Seq, extend: Option<f64>, now: f64) {
        let period = self.policy.lease_period;
        let off_order = extend.is_some_and(|e| e != period);
        let deadline = now + if off_order { extend.unwrap_or(period) } else { period };
        let (bm, slot_only, consumer_id) = {
            let t = self.touched.get_mut(&seq).expect("touched");
            t.deadline = deadline;
            t.restored = off_order;
            (t.bm.clone(), t.slot_only, t.consumer_id.clone())
        };
        if off_order {
            self.restored_deadlines.push(Reverse(Timed(deadline, seq)));
        }
        self.leased.remove(&bm);
        self.leased.insert(bm.clone(), seq);
        if !slot_only {
            self.dirty.insert(seq);
        }
        self.events.push(Ev::Renewed { bm, consumer_id, deadline, at: now });
    }

    fn free_slot(&mut self, py: Python<'_>, seq: Seq, now: f64) {
        let consumer_id = self.touched[&seq].consumer_id.clone();
        let bm = self.touched[&seq].bm.clone();
        self.drop_lease(py, seq);
        self.events.push(Ev::BacklogFreed { bm, consumer_id, at: now });
        if self.policy.key_groups {
            self.release_key(seq);
        }
    }

    fn promote(&mut self, py: Python<'_>, seq: Seq, now: f64) -> PyResult<()> {
        if self.too_old(seq, now) {
            return self.expire(py, seq, Reason::Expiration, None, None, now);
        }
        let slot = self.table.slot(seq);
        self.table.state[slot] = AVAILABLE;
        if let Some(t) = self.touched.get_mut(&seq).filter(|t| t.listed) {
            t.available_at = None;
            self.dirty.insert(seq);
        }
        let position = self.order.position(&self.table, seq);
        self.rewind(position);
        Ok(())
    }

    fn activate(&mut self, py: Python<'_>, seq: Seq, now: f64) -> PyResult<()> {
        let not_before = self.not_before.remove(&seq);
        if self.too_old(seq, now) {
            return self.expire(py, seq, Reason::Expiration, None, None, now);
        }
        self.active += 1;
        let slot = self.table.slot(seq);
        if let Some(at) = not_before {
            if at > now {
                self.table.state[slot] = DELAYED;
                self.delays.push(Reverse(Timed(at, seq)));
                return Ok(());
            }
        }
        self.table.state[slot] = AVAILABLE;
        let position = self.order.position(&self.table, seq);
        self.rewind(position);
        Ok(())
    }

    fn expire(
        &mut self,
        py: Python<'_>,
        seq: Seq,
        reason: Reason,
        detail: Option<String>,
        consumer_id: Option<Name>,
        now: f64,
    ) -> PyResult<()> {
        let slot = self.table.slot(seq);
        let was = self.table.state[slot];
        self.table.state[slot] = EXPIRED;
        let dead_letter = reason.dead_letter()
            || (reason == Reason::Expiration && self.policy.dead_letter_expired);
        let t = self.touch(seq);
        t.reason = Some(reason);
        let event = Ev::Expired {
            bm: t.bm.clone(),
            reason,
            dead_letter,
            delivery_count: t.delivery_count,
            cancel_count: t.cancel_count,
            consumer_id,
            detail,
            at: now,
        };
        self.dirty.insert(seq);
        self.events.push(event);
        self.on_done(py, seq, was, now, true)
    }

    // ------------------------------------------------------------------ bookkeeping
    fn drop_lease(&mut self, py: Python<'_>, seq: Seq) {
        let (bm, consumer_id, session_id) = {
            let t = &self.touched[&seq];
            (t.bm.clone(), t.consumer_id.clone(), t.session_id.clone())
        };
        self.leased.remove(&bm);
        match self.consumers.get_mut(&consumer_id) {
            Some(c) if c.session_id == session_id => c.drop_lease(py, &bm),
            _ => {
                if let Some(orphans) = self.orphans.get_mut(&consumer_id) {
                    orphans.remove(&bm);
                }
            }
        }
        let t = self.touched.get_mut(&seq).expect("touched");
        t.token = None;
        t.restored = false;
        if !t.listed {
            self.touched.remove(&seq);
        }
    }

    fn on_done(&mut self, py: Python<'_>, seq: Seq, was: u8, now: f64, release_key: bool) -> PyResult<()> {
        self.order.discard(&self.table, seq);
        if self.policy.target_queue_depth.is_some() && was != INACTIVE {
            self.active -= 1;
            self.activate_more(py, now)?;
        }
        if self.policy.key_groups && release_key {
            self.release_key(seq);
        }
        if self.pending_barriers.remove(&seq) {
            if self.barriers.front() == Some(&seq) {
                while let Some(front) = self.barriers.front() {
                    if self.pending_barriers.contains(front) {
                        break;
                    }
                    self.barriers.pop_front();
                }
                self.rewind_all();
            }
        }
        Ok(())
    }

    fn activate_more(&mut self, py: Python<'_>, now: f64) -> PyResult<()> {
        let depth = self.policy.target_queue_depth.expect("depth");
        while self.active < depth {
            let base = self.table.base;
            let from = ((self.inactive_from - base).max(0) as usize).min(self.table.state.len());
            let Some(found) = memchr::memchr(INACTIVE, &self.table.state[from..]) else {
                self.inactive_from = self.table.end();
                return Ok(());
            };
            let seq = base + (from + found) as i64;
            self.inactive_from = seq + 1;
            self.activate(py, seq, now)?;
        }
        Ok(())
    }

    fn release_key(&mut self, seq: Seq) {
        let base = self.table.base;
        let slot = (seq - base) as usize;
        let Some(key) = self.table.keys.as_ref().expect("keys")[slot].clone() else { return };
        if self.key_head.get(&key).copied() != Some(seq) {
            return;
        }
        let key_next = self.table.key_next.as_ref().expect("keys");
        let mut following = key_next[slot];
        while following >= 0 && self.table.state[(following - base) as usize] >= ACKED {
            following = key_next[(following - base) as usize];
        }
        if following < 0 {
            self.key_head.remove(&key);
            self.key_tail.remove(&key);
            return;
        }
        self.key_head.insert(key, following);
        if self.table.state[(following - base) as usize] == AVAILABLE {
            let position = self.order.position(&self.table, following);
            self.rewind(position);
        }
    }
}
