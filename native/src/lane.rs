//! The shard core's per-message work around the native engines (the "lane"): journal records
//! in, and out of the engines' decisions the store's rows (as runs), the events (as an
//! `EventBatch`'s items) and the delivery batches, without a Python object per message.
//!
//! Each piece is the port of a Python function the reference core runs instead:
//! `ShardCore._enqueue` / `_hold` / `_decide` (core.py), `add_outbox` / `event_fields`
//! (translate.py), `Output.event_records` / `Output.deliveries` (output.py), `runs_of`
//! (store.py) and `PayloadCache` (payloads.py).

use crate::types::*;
use crate::wire;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;

/// What a held record counts beyond its bytes (`payloads.RECORD_OVERHEAD`).
pub const RECORD_OVERHEAD: i64 = 440;

/// Interned topic names.
#[derive(Default)]
pub struct Names {
    names: FxHashMap<String, Name>,
}

impl Names {
    pub fn get(&mut self, text: &str) -> Name {
        if let Some(n) = self.names.get(text) {
            return n.clone();
        }
        let n: Name = Arc::from(text);
        if self.names.len() > 100_000 {
            self.names.clear();
        }
        self.names.insert(text.to_string(), n.clone());
        n
    }
}

/// The bytes a held record counts against the budget (`payloads.record_size`).
pub fn record_size(record: &Bound<'_, PyTuple>) -> PyResult<i64> {
    let mut size = RECORD_OVERHEAD;
    for index in [3, 4] {
        let field = record.get_item(index)?;
        if !field.is_none() {
            size += field.len()? as i64;
        }
    }
    let headers = record.get_item(6)?;
    if !headers.is_none() && headers.len()? > 0 {
        for header in headers.try_iter()? {
            let header = header?;
            size += header.get_item(0)?.len()? as i64;
            let value = header.get_item(1)?;
            if !value.is_none() {
                size += value.len()? as i64;
            }
        }
    }
    Ok(size)
}

fn read_bookmark(b: &Bound<'_, PyAny>, names: &mut Names) -> PyResult<Bm> {
    let t = b.cast::<PyTuple>()?;
    let topic: String = t.get_item(0)?.extract()?;
    Ok(Bm::new(names.get(&topic), t.get_item(1)?.extract()?, t.get_item(2)?.extract()?))
}

/// The journal records the coordinator holds in memory, within a byte budget (the native
/// `PayloadCache`, with the same interface and rules).
#[pyclass(module = "qlayer_native")]
pub struct Payloads {
    #[pyo3(get)]
    budget: i64,
    #[pyo3(get)]
    bytes: i64,
    #[pyo3(get)]
    dropped: i64,
    #[pyo3(get)]
    pool: Option<Py<PyAny>>,
    records: FxHashMap<Bm, (Py<PyAny>, i64)>,
    extra: FxHashMap<Bm, i64>,
    names: Names,
}

impl Payloads {
    fn pool_room(&self, py: Python<'_>, size: i64) -> PyResult<bool> {
        match &self.pool {
            None => Ok(true),
            Some(pool) => {
                let used: i64 = pool.getattr(py, "used")?.extract(py)?;
                let budget: i64 = pool.getattr(py, "budget")?.extract(py)?;
                Ok(used + size <= budget)
            }
        }
    }

    fn pool_add(&self, py: Python<'_>, delta: i64) -> PyResult<()> {
        if delta == 0 {
            return Ok(());
        }
        if let Some(pool) = &self.pool {
            let used: i64 = pool.getattr(py, "used")?.extract(py)?;
            pool.setattr(py, "used", used + delta)?;
        }
        Ok(())
    }

    pub fn fill_bm(&mut self, py: Python<'_>, bm: Bm, record: &Bound<'_, PyAny>) -> PyResult<bool> {
        if self.records.contains_key(&bm) {
            return Ok(false);
        }
        let size = record_size(record.cast::<PyTuple>()?)?;
        if self.bytes + size > self.budget || !self.pool_room(py, size)? {
            self.dropped += 1;
            return Ok(false);
        }
        self.records.insert(bm, (record.clone().unbind(), size));
        self.bytes += size;
        self.pool_add(py, size)?;
        Ok(true)
    }

    pub fn hold_bm(&mut self, py: Python<'_>, bm: Bm, record: &Bound<'_, PyAny>) -> PyResult<()> {
        if self.records.contains_key(&bm) {
            *self.extra.entry(bm).or_insert(0) += 1;
            return Ok(());
        }
        self.fill_bm(py, bm, record).map(|_| ())
    }

    pub fn get_bm(&self, bm: &Bm) -> Option<&Py<PyAny>> {
        self.records.get(bm).map(|(r, _)| r)
    }

    pub fn release_bm(&mut self, py: Python<'_>, bm: &Bm) -> PyResult<()> {
        if let Some(extra) = self.extra.get_mut(bm) {
            if *extra > 1 {
                *extra -= 1;
            } else {
                self.extra.remove(bm);
            }
            return Ok(());
        }
        if let Some((_, size)) = self.records.remove(bm) {
            self.bytes -= size;
            self.pool_add(py, -size)?;
        }
        Ok(())
    }
}

#[pymethods]
impl Payloads {
    #[new]
    #[pyo3(signature = (budget, pool=None))]
    fn py_new(budget: i64, pool: Option<Py<PyAny>>) -> Self {
        Self {
            budget,
            bytes: 0,
            dropped: 0,
            pool,
            records: FxHashMap::default(),
            extra: FxHashMap::default(),
            names: Names::default(),
        }
    }

    fn hold(&mut self, py: Python<'_>, bookmark: &Bound<'_, PyAny>, record: &Bound<'_, PyAny>) -> PyResult<()> {
        let bm = read_bookmark(bookmark, &mut self.names)?;
        self.hold_bm(py, bm, record)
    }

    fn fill(&mut self, py: Python<'_>, bookmark: &Bound<'_, PyAny>, record: &Bound<'_, PyAny>) -> PyResult<bool> {
        let bm = read_bookmark(bookmark, &mut self.names)?;
        self.fill_bm(py, bm, record)
    }

    fn get(&mut self, py: Python<'_>, bookmark: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyAny>>> {
        let bm = read_bookmark(bookmark, &mut self.names)?;
        Ok(self.get_bm(&bm).map(|r| r.clone_ref(py)))
    }

    fn missing<'py>(&mut self, py: Python<'py>, bookmarks: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for b in bookmarks.try_iter()? {
            let b = b?;
            let bm = read_bookmark(&b, &mut self.names)?;
            if !self.records.contains_key(&bm) {
                out.append(b)?;
            }
        }
        Ok(out)
    }

    fn release(&mut self, py: Python<'_>, bookmark: &Bound<'_, PyAny>) -> PyResult<()> {
        let bm = read_bookmark(bookmark, &mut self.names)?;
        self.release_bm(py, &bm)
    }

    fn clear(&mut self, py: Python<'_>) -> PyResult<()> {
        self.pool_add(py, -self.bytes)?;
        self.records.clear();
        self.extra.clear();
        self.bytes = 0;
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.records.len()
    }
}

/// One event item being gathered: encoded, or a run that takes more offsets.
enum Item {
    Bytes(Vec<u8>),
    Run(usize),
}

struct Run {
    slot: usize,
    leased: bool,
    at_ms: i64,
    topic: Name,
    partition: i64,
    consumer_id: Option<Name>,
    delivery_count: Option<i64>,
    deadline_ms: i64,
    offsets: Vec<i64>,
}

#[derive(PartialEq, Eq, Hash)]
struct RunKey {
    leased: bool,
    topic: Name,
    partition: i64,
    consumer_id: Option<Name>,
    delivery_count: Option<i64>,
    at: u64,
    deadline: u64,
}

/// A row of the store (`EntryRow`), before runs are formed.
struct Row {
    queue: Name,
    rec: Rec,
}

/// The per-shard native state of the batch paths.
#[pyclass(module = "qlayer_native")]
pub struct Lane {
    #[pyo3(get)]
    payloads: Py<Payloads>,
    fresh: FxHashMap<Bm, Py<PyAny>>,
    pub(crate) deliveries: Vec<(Name, Ev)>,
    items: Vec<Vec<u8>>,
    rows: Vec<Row>,
    done: Vec<Bm>,
    types: FxHashMap<String, Vec<u8>>,
    fixed: Vec<u8>,
    delivery_keys: FxHashSet<String>,
    api: Py<PyAny>,
    conv: crate::convert::Api,
    names: Names,
}

impl Lane {
    fn type_index(&self, name: &str) -> &[u8] {
        &self.types[name]
    }

    pub fn intern(&mut self, topic: &str) -> Name {
        self.names.get(topic)
    }

    pub fn hold_fresh(&mut self, bm: Bm, record: Py<PyAny>) {
        self.fresh.insert(bm, record);
    }

    /// `_hold`: the records of entries a queue admitted stay in memory (within the budget).
    pub fn hold(&mut self, py: Python<'_>, topic: &Name, partition: i64, offsets: &[i64]) -> PyResult<()> {
        let mut payloads = self.payloads.borrow_mut(py);
        for &offset in offsets {
            let bm = Bm::new(topic.clone(), partition, offset);
            let record = match self.fresh.get(&bm) {
                Some(r) => r.clone_ref(py),
                None => match payloads.get_bm(&bm) {
                    Some(r) => r.clone_ref(py),
                    None => continue,
                },
            };
            payloads.hold_bm(py, bm, record.bind(py))?;
        }
        Ok(())
    }

    fn record_timestamp(&self, py: Python<'_>, bm: &Bm) -> PyResult<Option<i64>> {
        match self.fresh.get(bm) {
            None => Ok(None),
            Some(r) => {
                let ts: i64 = r.bind(py).cast::<PyTuple>()?.get_item(5)?.extract()?;
                Ok(if ts > 0 { Some(ts) } else { None })
            }
        }
    }

    fn event_item(&self, kind: &str, at_ms: i64, queue: &str, bm: Option<&Bm>, fields: EventFields<'_>) -> Vec<u8> {
        let mut out = Vec::with_capacity(96);
        out.push(wire::EVENT_ITEM);
        out.extend_from_slice(self.type_index(kind));
        wire::long(&mut out, at_ms);
        out.extend_from_slice(&self.fixed);
        wire::opt_string(&mut out, Some(queue));
        match bm {
            None => out.extend_from_slice(&[wire::NULL; 4]),
            Some(b) => {
                out.push(wire::SOME);
                wire::string(&mut out, &format!("{}/{}/{}", b.topic, b.partition, b.offset));
                wire::opt_string(&mut out, Some(&b.topic));
                out.push(wire::SOME);
                wire::long(&mut out, b.partition);
                out.push(wire::SOME);
                wire::long(&mut out, b.offset);
            }
        }
        wire::opt_string(&mut out, fields.consumer_id);
        wire::opt_string(&mut out, fields.session_id);
        wire::opt_long(&mut out, fields.delivery_count);
        wire::opt_string(&mut out, fields.reason);
        wire::opt_long(&mut out, fields.lease_expires_ms);
        wire::opt_long(&mut out, fields.available_at_ms);
        wire::opt_long(&mut out, None);
        out
    }

    fn run_where(&self, out: &mut Vec<u8>, queue: &str, topic: &str, partition: i64) {
        out.extend_from_slice(&self.fixed);
        wire::string(out, queue);
        wire::string(out, topic);
        wire::long(out, partition);
    }

    fn encode_run(&self, queue: &str, run: &Run, sessions: &Bound<'_, PyDict>) -> PyResult<Vec<u8>> {
        let mut out = Vec::with_capacity(64 + 3 * run.offsets.len());
        out.push(wire::RUN_ITEM);
        if run.leased {
            out.extend_from_slice(self.type_index("LEASED"));
            wire::long(&mut out, run.at_ms);
            self.run_where(&mut out, queue, &run.topic, run.partition);
            wire::long_array(&mut out, &run.offsets);
            let consumer = run.consumer_id.as_deref().unwrap_or("");
            wire::opt_string(&mut out, Some(consumer));
            let session: Option<String> = match sessions.get_item(consumer)? {
                Some(s) => s.extract()?,
                None => None,
            };
            wire::opt_string(&mut out, session.as_deref());
            wire::opt_long(&mut out, run.delivery_count);
            out.push(wire::NULL);
            wire::opt_long(&mut out, Some(run.deadline_ms));
            out.push(wire::NULL);
        } else {
            out.extend_from_slice(self.type_index("ACKED"));
            wire::long(&mut out, run.at_ms);
            self.run_where(&mut out, queue, &run.topic, run.partition);
            wire::long_array(&mut out, &run.offsets);
            wire::opt_string(&mut out, run.consumer_id.as_deref());
            out.push(wire::NULL);
            wire::opt_long(&mut out, run.delivery_count);
            wire::opt_string(&mut out, Some("consumer"));
            out.push(wire::NULL);
            out.push(wire::NULL);
        }
        Ok(out)
    }

    /// The store's state names (`translate._STORE_STATE`).
    fn stored_state(state: u8) -> &'static str {
        match state {
            LEASED => "LEASED",
            ACKED => "ACKED",
            EXPIRED => "EXPIRED",
            _ => "AVAILABLE",
        }
    }
}

#[derive(Default, Clone, Copy)]
struct EventFields<'a> {
    consumer_id: Option<&'a str>,
    session_id: Option<&'a str>,
    delivery_count: Option<i64>,
    reason: Option<&'a str>,
    lease_expires_ms: Option<i64>,
    available_at_ms: Option<i64>,
}

/// A truthy `available_at` in ms, as `event_fields` writes it (0.0 is written as null).
fn available_ms(at: Option<f64>) -> Option<i64> {
    match at {
        Some(v) if v != 0.0 => Some(wire::ms(v)),
        _ => None,
    }
}

fn lease_end(reason: Leave) -> &'static str {
    match reason {
        Leave::Unsubscribed | Leave::SessionReplaced | Leave::Replaced => "unsubscribed",
        Leave::SessionTimeout => "session_timed_out",
        Leave::Evicted => "evicted",
    }
}

fn leave_event(reason: Leave) -> &'static str {
    match reason {
        Leave::Unsubscribed | Leave::SessionReplaced | Leave::Replaced => "CONSUMER_UNSUBSCRIBED",
        Leave::SessionTimeout => "CONSUMER_TIMED_OUT",
        Leave::Evicted => "CONSUMER_EVICTED",
    }
}

/// What `Lane::absorb` counted (`add_outbox`'s counters) and the events the core must act on.
pub struct Absorbed {
    pub counts: Vec<(&'static str, i64)>,
    pub specials: Vec<Ev>,
}

impl Lane {
    /// One queue's drained decisions: rows (but those a recovery point of this batch passes),
    /// counters, payloads held for new entries, done entries, and event items in order with
    /// the same runs `Output.event_records` forms. Returns the counters and the events the
    /// core acts on (dead letters, consumers that left).
    #[allow(clippy::too_many_arguments)]
    pub fn absorb(
        &mut self,
        py: Python<'_>,
        queue: &Name,
        events: Vec<Ev>,
        records: Vec<Rec>,
        counted_from: &FxHashMap<(String, i64), i64>,
        passed: &FxHashMap<(String, i64), i64>,
        sessions: &Bound<'_, PyDict>,
    ) -> PyResult<Absorbed> {
        for rec in records {
            if rec.done() {
                if let Some(&point) = passed.get(&(rec.bm.topic.to_string(), rec.bm.partition)) {
                    if rec.bm.offset < point {
                        continue;
                    }
                }
            }
            self.rows.push(Row { queue: queue.clone(), rec });
        }
        let (mut enqueued, mut delivered, mut acked, mut released, mut ended) = (0i64, 0i64, 0i64, 0i64, 0i64);
        let (mut expired, mut dead, mut redelivered, mut rejected) = (0i64, 0i64, 0i64, 0i64);
        let mut specials = Vec::new();
        let mut items: Vec<Item> = Vec::new();
        let mut runs: Vec<Run> = Vec::new();
        let mut run_index: FxHashMap<RunKey, usize> = FxHashMap::default();
        let mut latest: FxHashMap<Bm, usize> = FxHashMap::default();
        let mut enqueued_at: FxHashMap<(Name, i64), usize> = FxHashMap::default();
        let q: &str = queue;
        for e in events {
            let at_ms = |at: f64| wire::ms(at);
            match &e {
                Ev::Enqueued { topic, partition, offsets, at } => {
                    self.hold(py, topic, *partition, offsets)?;
                    let start = counted_from.get(&(topic.to_string(), *partition)).copied();
                    let fresh: Vec<i64> = match start {
                        Some(s) => offsets.iter().copied().filter(|&o| o >= s).collect(),
                        None => offsets.clone(),
                    };
                    enqueued += fresh.len() as i64;
                    if fresh.is_empty() {
                        continue;
                    }
                    enqueued_at.insert((topic.clone(), *partition), items.len());
                    let mut out = Vec::with_capacity(64 + 4 * fresh.len());
                    out.push(wire::RUN_ITEM);
                    out.extend_from_slice(self.type_index("ENQUEUED"));
                    wire::long(&mut out, at_ms(*at));
                    self.run_where(&mut out, q, topic, *partition);
                    wire::long_array(&mut out, &fresh);
                    out.extend_from_slice(&[wire::NULL; 5]);
                    let mut stamps = Vec::with_capacity(fresh.len());
                    for &o in &fresh {
                        stamps.push(self.record_timestamp(py, &Bm::new(topic.clone(), *partition, o))?);
                    }
                    wire::opt_long_array(&mut out, &stamps);
                    items.push(Item::Bytes(out));
                    continue;
                }
                Ev::Leased { bm, consumer_id, delivery_count, deadline, at, .. } => {
                    delivered += 1;
                    if *delivery_count > 1 {
                        redelivered += 1;
                    }
                    let key = RunKey {
                        leased: true,
                        topic: bm.topic.clone(),
                        partition: bm.partition,
                        consumer_id: Some(consumer_id.clone()),
                        delivery_count: Some(*delivery_count),
                        at: at.to_bits(),
                        deadline: deadline.to_bits(),
                    };
                    let seed = Run {
                        slot: 0,
                        leased: true,
                        at_ms: at_ms(*at),
                        topic: bm.topic.clone(),
                        partition: bm.partition,
                        consumer_id: Some(consumer_id.clone()),
                        delivery_count: Some(*delivery_count),
                        deadline_ms: wire::ms(*deadline),
                        offsets: Vec::new(),
                    };
                    join_run(&mut items, &mut runs, &mut run_index, &mut latest, &enqueued_at, key, seed, bm);
                    continue;
                }
                Ev::Acked { bm, consumer_id, source: AckSource::Consumer, at, delivery_count } => {
                    acked += 1;
                    self.done.push(bm.clone());
                    let key = RunKey {
                        leased: false,
                        topic: bm.topic.clone(),
                        partition: bm.partition,
                        consumer_id: consumer_id.clone(),
                        delivery_count: *delivery_count,
                        at: at.to_bits(),
                        deadline: 0,
                    };
                    let seed = Run {
                        slot: 0,
                        leased: false,
                        at_ms: at_ms(*at),
                        topic: bm.topic.clone(),
                        partition: bm.partition,
                        consumer_id: consumer_id.clone(),
                        delivery_count: *delivery_count,
                        deadline_ms: 0,
                        offsets: Vec::new(),
                    };
                    join_run(&mut items, &mut runs, &mut run_index, &mut latest, &enqueued_at, key, seed, bm);
                    continue;
                }
                _ => {}
            }
            // Every other kind: zero or more single events, in `event_fields`' order.
            let before = items.len();
            match &e {
                Ev::Acked { bm, consumer_id, source, at, delivery_count } => {
                    acked += 1;
                    self.done.push(bm.clone());
                    if *source != AckSource::Barrier {
                        let kind = if *source == AckSource::Delivery { "DELIVERED_AT_MOST_ONCE" } else { "ACKED" };
                        let f = EventFields {
                            consumer_id: consumer_id.as_deref(),
                            delivery_count: *delivery_count,
                            reason: Some(source.as_str()),
                            ..Default::default()
                        };
                        items.push(Item::Bytes(self.event_item(kind, at_ms(*at), q, Some(bm), f)));
                    }
                }
                Ev::Released { bm, consumer_id, available_at, at, .. } => {
                    released += 1;
                    let f = EventFields {
                        consumer_id: Some(consumer_id),
                        available_at_ms: available_ms(*available_at),
                        ..Default::default()
                    };
                    items.push(Item::Bytes(self.event_item("RELEASED", at_ms(*at), q, Some(bm), f)));
                }
                Ev::Renewed { bm, consumer_id, deadline, at } => {
                    let f = EventFields {
                        consumer_id: Some(consumer_id),
                        lease_expires_ms: Some(wire::ms(*deadline)),
                        ..Default::default()
                    };
                    items.push(Item::Bytes(self.event_item("RENEWED", at_ms(*at), q, Some(bm), f)));
                }
                Ev::LeaseExpired { bm, consumer_id, available_at, at } => {
                    ended += 1;
                    let f = EventFields {
                        consumer_id: Some(consumer_id),
                        reason: Some("deadline"),
                        available_at_ms: available_ms(*available_at),
                        ..Default::default()
                    };
                    items.push(Item::Bytes(self.event_item("LEASE_EXPIRED", at_ms(*at), q, Some(bm), f)));
                }
                Ev::LeaseBroken { bm, consumer_id, reason, at } => {
                    ended += 1;
                    let f = EventFields {
                        consumer_id: Some(consumer_id),
                        reason: Some(lease_end(*reason)),
                        ..Default::default()
                    };
                    items.push(Item::Bytes(self.event_item("LEASE_EXPIRED", at_ms(*at), q, Some(bm), f)));
                }
                Ev::Expired { bm, reason, dead_letter, delivery_count, consumer_id, detail, at, .. } => {
                    // A consumer's rejection is counted apart: `expired` is every other way out.
                    if *reason == Reason::Rejected {
                        rejected += 1;
                    } else {
                        expired += 1;
                    }
                    self.done.push(bm.clone());
                    let wire_reason = reason.as_str().replace('-', "_");
                    if *reason == Reason::Rejected {
                        let f = EventFields {
                            consumer_id: consumer_id.as_deref(),
                            delivery_count: Some(*delivery_count),
                            reason: detail.as_deref(),
                            ..Default::default()
                        };
                        items.push(Item::Bytes(self.event_item("REJECTED", at_ms(*at), q, Some(bm), f)));
                    }
                    let f = EventFields {
                        consumer_id: consumer_id.as_deref(),
                        delivery_count: Some(*delivery_count),
                        reason: Some(&wire_reason),
                        ..Default::default()
                    };
                    if *dead_letter {
                        dead += 1;
                        items.push(Item::Bytes(self.event_item("DEAD_LETTERED", at_ms(*at), q, Some(bm), f)));
                        specials.push(e.clone());
                    }
                    items.push(Item::Bytes(self.event_item("EXPIRED", at_ms(*at), q, Some(bm), f)));
                }
                Ev::Barrier { bm, recipients, at } => {
                    let names: Vec<&str> = recipients.iter().map(|(c, _)| &**c).collect();
                    let joined = names.join(",");
                    let f = EventFields { reason: Some(&joined), ..Default::default() };
                    items.push(Item::Bytes(self.event_item("BARRIER_DELIVERED", at_ms(*at), q, Some(bm), f)));
                }
                Ev::Subscribed { consumer_id, session_id, at, .. } => {
                    let f = EventFields { consumer_id: Some(consumer_id), session_id: Some(session_id), ..Default::default() };
                    items.push(Item::Bytes(self.event_item("CONSUMER_SUBSCRIBED", at_ms(*at), q, None, f)));
                }
                Ev::Replaced { consumer_id, session_id, at, .. } => {
                    let f = EventFields { consumer_id: Some(consumer_id), session_id: Some(session_id), ..Default::default() };
                    items.push(Item::Bytes(self.event_item("CONSUMER_REPLACED", at_ms(*at), q, None, f)));
                }
                Ev::Left { consumer_id, session_id, reason, at, .. } => {
                    let wire_reason = reason.as_str().replace('-', "_");
                    let f = EventFields {
                        consumer_id: Some(consumer_id),
                        session_id: Some(session_id),
                        reason: Some(&wire_reason),
                        ..Default::default()
                    };
                    items.push(Item::Bytes(self.event_item(leave_event(*reason), at_ms(*at), q, None, f)));
                    specials.push(e.clone());
                }
                Ev::Delayed { .. } | Ev::BacklogFreed { .. } => {}
                Ev::Enqueued { .. } | Ev::Leased { .. } => unreachable!(),
            }
            if let Some(bm) = e.bookmark() {
                // `latest[(queue, bookmark)] = len(items) - 1`, even when nothing was added.
                let _ = before;
                latest.insert(bm.clone(), items.len().wrapping_sub(1));
            }
        }
        for item in items {
            match item {
                Item::Bytes(b) => self.items.push(b),
                Item::Run(i) => {
                    let encoded = self.encode_run(q, &runs[i], sessions)?;
                    self.items.push(encoded);
                }
            }
        }
        let counts = [
            ("enqueued", enqueued),
            ("delivered", delivered),
            ("acked", acked),
            ("released", released),
            ("lease_expired", ended),
            ("expired", expired),
            ("dead_lettered", dead),
            ("redelivered", redelivered),
            ("rejected", rejected),
        ]
        .into_iter()
        .filter(|(_, n)| *n != 0)
        .collect();
        Ok(Absorbed { counts, specials })
    }
}

/// `Output.event_records`' rule: an event joins an open run only if its entry has had no
/// event since the run began (and no ENQUEUED run of its partition came after it).
#[allow(clippy::too_many_arguments)]
fn join_run(
    items: &mut Vec<Item>,
    runs: &mut Vec<Run>,
    run_index: &mut FxHashMap<RunKey, usize>,
    latest: &mut FxHashMap<Bm, usize>,
    enqueued_at: &FxHashMap<(Name, i64), usize>,
    key: RunKey,
    seed: Run,
    bm: &Bm,
) {
    let open = run_index.get(&key).copied().filter(|&i| {
        let slot = runs[i].slot;
        let last = latest.get(bm).map(|&l| l as i64).unwrap_or(-1);
        let enq = enqueued_at
            .get(&(bm.topic.clone(), bm.partition))
            .map(|&l| l as i64)
            .unwrap_or(-1);
        !(last > slot as i64 || (!enqueued_at.is_empty() && enq > slot as i64))
    });
    let index = match open {
        Some(i) => i,
        None => {
            let mut run = seed;
            run.slot = items.len();
            runs.push(run);
            let i = runs.len() - 1;
            items.push(Item::Run(i));
            run_index.insert(key, i);
            i
        }
    };
    runs[index].offsets.push(bm.offset);
    latest.insert(bm.clone(), runs[index].slot);
}

#[pymethods]
impl Lane {
    #[new]
    fn py_new(py: Python<'_>, payloads: Py<Payloads>, types: &Bound<'_, PyDict>, delivery_keys: Vec<String>, api: Py<PyAny>) -> PyResult<Self> {
        let mut t = FxHashMap::default();
        for (k, v) in types.iter() {
            t.insert(k.extract::<String>()?, v.extract::<Vec<u8>>()?);
        }
        Ok(Self {
            payloads,
            fresh: FxHashMap::default(),
            deliveries: Vec::new(),
            items: Vec::new(),
            rows: Vec::new(),
            done: Vec::new(),
            types: t,
            fixed: Vec::new(),
            delivery_keys: delivery_keys.into_iter().collect(),
            conv: crate::convert::Api::load(py, api.bind(py))?,
            api,
            names: Names::default(),
        })
    }

    /// The coordinator's id and epoch, as every event carries them.
    fn set_coordinator(&mut self, coordinator_id: &str, epoch: i64) {
        self.fixed.clear();
        wire::string(&mut self.fixed, coordinator_id);
        wire::long(&mut self.fixed, epoch);
    }

    /// Event items encoded elsewhere (in order before what comes next).
    fn push_items(&mut self, items: Vec<Vec<u8>>) {
        self.items.extend(items);
    }

    /// This step's event items, in order.
    fn take_items<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for item in self.items.drain(..) {
            out.append(PyBytes::new(py, &item))?;
        }
        Ok(out)
    }

    fn has_deliveries(&self) -> bool {
        !self.deliveries.is_empty()
    }

    /// How many messages this step's decisions deliver (leases and barrier recipients).
    fn delivery_count(&self) -> usize {
        self.deliveries.len()
    }

    /// Bookmarks of this step's deliveries whose records are not in memory.
    fn missing<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let payloads = self.payloads.borrow(py);
        let bookmark = self.api.getattr(py, "Bookmark")?;
        let mut seen = FxHashSet::default();
        for (_, d) in &self.deliveries {
            if let Some(bm) = d.bookmark() {
                if payloads.get_bm(bm).is_none() && seen.insert(bm.clone()) {
                    out.append(bookmark.call1(py, (&*bm.topic, bm.partition, bm.offset))?)?;
                }
            }
        }
        Ok(out)
    }

    /// This step's rows: (runs, singles) as `runs_of` forms them (runs of at least two).
    fn take_rows<'py>(&mut self, py: Python<'py>) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
        let entry_run = self.api.getattr(py, "EntryRun")?;
        let entry_row = self.api.getattr(py, "EntryRow")?;
        let runs_out = PyList::empty(py);
        let singles_out = PyList::empty(py);
        type Key = (Name, Name, i64, &'static str, i64, i64, Option<Name>, Option<u64>);
        let mut groups: Vec<(Key, Vec<usize>)> = Vec::new();
        let mut group_of: FxHashMap<Key, usize> = FxHashMap::default();
        let rows = std::mem::take(&mut self.rows);
        let mut singles: Vec<usize> = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            let r = &row.rec;
            let state = Self::stored_state(r.state);
            let token_ok = r.token.as_deref().is_none_or(|t| !t.contains(','));
            if (r.state == LEASED || r.state == ACKED) && r.available_at.is_none() && r.reason.is_none() && token_ok {
                let leased = r.state == LEASED;
                let key: Key = (
                    row.queue.clone(),
                    r.bm.topic.clone(),
                    r.bm.partition,
                    state,
                    r.delivery_count,
                    r.cancel_count,
                    if leased { r.consumer_id.clone() } else { None },
                    if leased { r.deadline.map(f64::to_bits) } else { None },
                );
                match group_of.get(&key) {
                    Some(&g) => groups[g].1.push(i),
                    None => {
                        group_of.insert(key.clone(), groups.len());
                        groups.push((key, vec![i]));
                    }
                }
            } else {
                singles.push(i);
            }
        }
        for (key, mut members) in groups {
            if members.len() < 2 {
                singles.extend(members);
                continue;
            }
            members.sort_by_key(|&i| rows[i].rec.bm.offset);
            let offsets: Vec<i64> = members.iter().map(|&i| rows[i].rec.bm.offset).collect();
            let leased = key.3 == "LEASED";
            let tokens: Option<Vec<String>> = if leased {
                Some(members.iter().map(|&i| rows[i].rec.token.as_deref().unwrap_or("").to_string()).collect())
            } else {
                None
            };
            let deadline = key.7.map(f64::from_bits);
            let run_key = PyTuple::new(py, [
                key.0.as_ref().into_pyobject(py)?.into_any(),
                key.1.as_ref().into_pyobject(py)?.into_any(),
                key.2.into_pyobject(py)?.into_any(),
                key.3.into_pyobject(py)?.into_any(),
                key.4.into_pyobject(py)?.into_any(),
                key.5.into_pyobject(py)?.into_any(),
                key.6.as_deref().into_pyobject(py)?.into_any(),
                deadline.into_pyobject(py)?.into_any(),
            ])?;
            runs_out.append(entry_run.call1(py, (run_key, offsets, tokens))?)?;
        }
        singles.sort_unstable();
        for i in singles {
            let row = &rows[i];
            let r = &row.rec;
            let leased = r.state == LEASED;
            singles_out.append(entry_row.call1(py, (
                &*row.queue,
                &*r.bm.topic,
                r.bm.partition,
                r.bm.offset,
                Self::stored_state(r.state),
                r.delivery_count,
                r.cancel_count,
                if leased { r.consumer_id.as_deref() } else { None },
                if leased { r.token.as_deref() } else { None },
                if leased { r.deadline } else { None },
                r.available_at,
                r.reason.map(|x| x.as_str()),
            ))?)?;
        }
        Ok((runs_out, singles_out))
    }

    /// The delivery records of this step's batch-format sessions (`Output.deliveries`).
    ///
    /// ``sessions``: consumer id -> (session id, reads batches). Returns (records, what the
    /// Python path sends: deliveries to record-format sessions and barriers with any such
    /// recipient, messages packed, deliveries whose record is gone as (queue, bookmark)).
    #[allow(clippy::type_complexity)]
    fn encode_deliveries<'py>(
        &mut self,
        py: Python<'py>,
        sessions: &Bound<'py, PyDict>,
        reread: &Bound<'py, PyDict>,
        max_bytes: usize,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>, usize, Bound<'py, PyList>)> {
        let outgoing = self.api.getattr(py, "OutgoingRecord")?;
        let bookmark_cls = self.api.getattr(py, "Bookmark")?;
        let records = PyList::empty(py);
        let python = PyList::empty(py);
        let missing = PyList::empty(py);
        struct Batch {
            topic: Name,
            consumer: Vec<u8>,
            session: Vec<u8>,
            buf: Vec<u8>,
            count: usize,
        }
        let mut batches: Vec<Batch> = Vec::new();
        let mut batch_of: FxHashMap<Name, usize> = FxHashMap::default();
        let deliveries = std::mem::take(&mut self.deliveries);
        let mut packed = 0usize;
        let close = |b: &mut Batch, records: &Bound<'py, PyList>| -> PyResult<()> {
            if b.count == 0 {
                return Ok(());
            }
            wire::batch_finish(&mut b.buf, b.count);
            let headers = PyList::new(py, [
                ("qlayer.batch", PyBytes::new(py, b"1")),
                ("qlayer.session", PyBytes::new(py, &b.session)),
            ])?;
            records.append(outgoing.call1(py, (&*b.topic, PyBytes::new(py, &b.buf), PyBytes::new(py, &b.consumer), headers))?)?;
            b.buf.truncate(wire::BATCH_HEAD);
            b.count = 0;
            Ok(())
        };
        let session_of = |consumer: &str| -> PyResult<Option<(String, bool)>> {
            match sessions.get_item(consumer)? {
                None => Ok(None),
                Some(v) => {
                    let (s, batch): (Option<String>, bool) = v.extract()?;
                    Ok(s.map(|s| (s, batch)))
                }
            }
        };
        let payloads = self.payloads.clone_ref(py);
        let payloads = payloads.borrow(py);
        for (queue, d) in deliveries {
            let bm = d.bookmark().expect("a delivery has a bookmark").clone();
            let record: Py<PyAny> = match payloads.get_bm(&bm) {
                Some(r) => r.clone_ref(py),
                None => {
                    let key = bookmark_cls.call1(py, (&*bm.topic, bm.partition, bm.offset))?;
                    match reread.get_item(&key)? {
                        Some(r) => r.unbind(),
                        None => {
                            missing.append((&*queue, key))?;
                            continue;
                        }
                    }
                }
            };
            // Who gets it, and whether every one of them reads batches.
            let targets: Vec<(Name, Name, Option<(String, bool)>)> = match &d {
                Ev::Leased { consumer_id, delivery_topic, .. } => {
                    vec![(consumer_id.clone(), delivery_topic.clone(), session_of(consumer_id)?)]
                }
                Ev::Barrier { recipients, .. } => {
                    let mut t = Vec::new();
                    for (c, topic) in recipients {
                        t.push((c.clone(), topic.clone(), session_of(c)?));
                    }
                    t
                }
                _ => unreachable!(),
            };
            if !targets.iter().all(|(_, _, s)| s.as_ref().is_some_and(|(_, batch)| *batch)) {
                python.append(self.to_python(py, &queue, &d)?)?;
                continue;
            }
            // The record's bytes are borrowed, not copied, until they go into the batch.
            let r = record.bind(py).cast::<PyTuple>()?;
            let key_obj = r.get_item(3)?;
            let value_obj = r.get_item(4)?;
            let key: Option<&[u8]> = if key_obj.is_none() { None } else { Some(key_obj.cast::<PyBytes>()?.as_bytes()) };
            let value: Option<&[u8]> = if value_obj.is_none() { None } else { Some(value_obj.cast::<PyBytes>()?.as_bytes()) };
            let ts: i64 = r.get_item(5)?.extract()?;
            let timestamp = if ts > 0 { Some(ts) } else { None };
            let headers_obj = r.get_item(6)?;
            let mut header_items: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> = Vec::new();
            if !headers_obj.is_none() {
                for h in headers_obj.try_iter()? {
                    let h = h?;
                    let name = h.get_item(0)?;
                    if self.delivery_keys.contains(name.cast::<pyo3::types::PyString>()?.to_str()?) {
                        continue;
                    }
                    header_items.push((name, h.get_item(1)?));
                }
            }
            let mut headers: Vec<(&[u8], Option<&[u8]>)> = Vec::with_capacity(header_items.len());
            for (name, v) in &header_items {
                let name = name.cast::<pyo3::types::PyString>()?.to_str()?.as_bytes();
                let v = if v.is_none() { None } else { Some(v.cast::<PyBytes>()?.as_bytes()) };
                headers.push((name, v));
            }
            for (consumer, topic, session) in targets {
                let (session, _) = session.expect("batch sessions only");
                let (lease, expires, count, barrier): (&[u8], i64, i64, bool) = match &d {
                    Ev::Leased { token, deadline, delivery_count, .. } => {
                        (token.as_bytes(), wire::ms(*deadline), *delivery_count, false)
                    }
                    _ => (b"", 0, 1, true),
                };
                let size = wire::batch_entry_len(queue.as_bytes(), bm.topic.as_bytes(), lease,
                                                 key, value, &headers);
                let index = match batch_of.get(&consumer) {
                    Some(&i) => i,
                    None => {
                        batches.push(Batch {
                            topic,
                            consumer: consumer.as_bytes().to_vec(),
                            session: session.into_bytes(),
                            buf: wire::batch_start(64 * 1024),
                            count: 0,
                        });
                        batch_of.insert(consumer.clone(), batches.len() - 1);
                        batches.len() - 1
                    }
                };
                let b = &mut batches[index];
                if b.count > 0 && b.buf.len() - wire::BATCH_HEAD + size > max_bytes {
                    close(b, &records)?;
                }
                wire::batch_entry(&mut b.buf, queue.as_bytes(), bm.topic.as_bytes(), bm.partition,
                                  bm.offset, lease, expires, count, barrier, timestamp, key, value,
                                  &headers);
                b.count += 1;
                packed += 1;
            }
        }
        for b in batches.iter_mut() {
            close(b, &records)?;
        }
        Ok((records, python, packed, missing))
    }

    /// The plan was carried out: the records of the entries it finished can go, and this
    /// step's journal records are no longer needed for it.
    fn settle(&mut self, py: Python<'_>) -> PyResult<()> {
        let done = std::mem::take(&mut self.done);
        let mut payloads = self.payloads.borrow_mut(py);
        for bm in &done {
            payloads.release_bm(py, bm)?;
        }
        self.fresh.clear();
        Ok(())
    }

    /// Forget everything (a rebuild).
    fn reset(&mut self) {
        self.fresh.clear();
        self.deliveries.clear();
        self.items.clear();
        self.rows.clear();
        self.done.clear();
    }
}

impl Lane {
    pub fn api(&self) -> &Py<PyAny> {
        &self.api
    }

    fn to_python(&self, py: Python<'_>, queue: &str, e: &Ev) -> PyResult<Py<PyAny>> {
        Ok(self.conv.event(py, queue, e)?.unbind())
    }
}
