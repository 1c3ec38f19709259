//! qlayer's native shard core (DESIGN §6): the queue engine of `layer/domain/engine.py`,
//! ported line by line, behind the same Python interface (`layer.domain.native` wraps it).
//! The Python engine is the reference; tests run both on the same inputs and compare.

mod batch;
mod convert;
mod engine;
mod lane;
mod ordered;
mod random;
mod table;
mod types;
mod wire;

use convert::Api;
use engine::{AckIn, Engine, Fairness, Offered, Policy, PyHooks, Share, Tokens};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use lane::{Lane, Payloads};
use std::sync::Arc;
use types::*;

fn read_bm(b: &Bound<'_, PyAny>) -> PyResult<(String, i64, i64)> {
    let t = b.cast::<PyTuple>()?;
    Ok((t.get_item(0)?.extract()?, t.get_item(1)?.extract()?, t.get_item(2)?.extract()?))
}

fn read_record(e: &Engine, r: &Bound<'_, PyAny>) -> PyResult<Rec> {
    let t = r.cast::<PyTuple>()?;
    let (topic, partition, offset) = read_bm(&t.get_item(0)?)?;
    let name = |v: Bound<'_, PyAny>| -> PyResult<Option<Name>> {
        let s: Option<String> = v.extract()?;
        Ok(s.map(|s| Arc::from(s.as_str())))
    };
    let reason: Option<String> = {
        let v = t.get_item(9)?;
        if v.is_none() { None } else { Some(v.str()?.to_string()) }
    };
    Ok(Rec {
        bm: Bm::new(e.intern(&topic), partition, offset),
        state: t.get_item(1)?.extract::<u8>()?,
        delivery_count: t.get_item(2)?.extract()?,
        cancel_count: t.get_item(3)?.extract()?,
        consumer_id: name(t.get_item(4)?)?,
        session_id: name(t.get_item(5)?)?,
        token: name(t.get_item(6)?)?,
        deadline: t.get_item(7)?.extract()?,
        available_at: t.get_item(8)?.extract()?,
        reason: reason.and_then(|r| Reason::parse(&r)),
    })
}

fn opt_py(v: Bound<'_, PyAny>) -> Option<Py<PyAny>> {
    if v.is_none() { None } else { Some(v.unbind()) }
}

/// One queue's engine (the Python `QueueEngine` interface, for `layer.domain.native`).
#[pyclass(module = "qlayer_native")]
struct NativeEngine {
    core: Engine,
    api: Api,
    /// What `drain_pending` took, for `absorb_into` (the core drains every queue first).
    pending: Option<(Vec<Ev>, Vec<Rec>)>,
}

#[pymethods]
impl NativeEngine {
    #[new]
    fn new(
        py: Python<'_>,
        policy: &Bound<'_, PyAny>,
        api: &Bound<'_, PyAny>,
        tokens: Py<PyAny>,
        session_timeout: f64,
        native_tokens: bool,
    ) -> PyResult<Self> {
        let fairness: String = policy.getattr("fairness")?.getattr("value")?.extract()?;
        let fairness = match fairness.as_str() {
            "fast" => Fairness::Fast,
            "round-robin" => Fairness::RoundRobin,
            "proportional" => Fairness::Proportional,
            other => return Err(PyValueError::new_err(format!("unknown fairness {other:?}"))),
        };
        let name: String = policy.getattr("name")?.extract()?;
        let p = Policy {
            name: Arc::from(name.as_str()),
            at_most_once: policy.getattr("at_most_once")?.extract()?,
            lease_period: policy.getattr("lease_period")?.extract()?,
            max_deliveries: policy.getattr("max_deliveries")?.extract()?,
            max_cancels: policy.getattr("max_cancels")?.extract()?,
            expiration: policy.getattr("expiration")?.extract()?,
            delivery_delay: policy.getattr("delivery_delay")?.extract()?,
            max_per_subscription_backlog: policy.getattr("max_per_subscription_backlog")?.extract()?,
            fairness,
            priority: opt_py(policy.getattr("priority")?),
            barrier: opt_py(policy.getattr("barrier")?),
            filter: opt_py(policy.getattr("filter")?),
            target_queue_depth: policy.getattr("target_queue_depth")?.extract()?,
            strict: policy.getattr("strict")?.extract()?,
            key_groups: policy.getattr("key_groups")?.extract()?,
            backoff: opt_py(policy.getattr("backoff")?),
            dead_letter_expired: policy.getattr("dead_letter_expired")?.extract()?,
        };
        let hooks = PyHooks {
            delete: api.getattr("DELETE")?.unbind(),
            raw_document: api.getattr("RawDocument")?.unbind(),
            partial_document: api.getattr("PartialDocument")?.unbind(),
            priority_rank: api.getattr("priority_rank")?.unbind(),
        };
        let tokens = if native_tokens {
            Tokens::Native { pool: Vec::new(), next: 0 }
        } else {
            Tokens::Python(tokens)
        };
        Ok(Self {
            core: Engine::new(p, hooks, tokens, session_timeout),
            api: Api::load(py, api)?,
            pending: None,
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.core.policy.name
    }

    fn recovery_points<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (topic, partition, offset) in self.core.recovery_points() {
            out.set_item((&*topic, partition), offset)?;
        }
        Ok(out)
    }

    fn restoring(&self, bookmark: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (topic, partition, offset) = read_bm(bookmark)?;
        Ok(self.core.restoring_has(&Bm::new(self.core.intern(&topic), partition, offset)))
    }

    fn entry<'py>(&self, py: Python<'py>, bookmark: &Bound<'_, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let (topic, partition, offset) = read_bm(bookmark)?;
        match self.core.entry(&Bm::new(self.core.intern(&topic), partition, offset)) {
            Some(r) => Ok(Some(self.api.record(py, &r)?)),
            None => Ok(None),
        }
    }

    #[pyo3(signature = (expression, limit))]
    fn view<'py>(&mut self, py: Python<'py>, expression: Option<Py<PyAny>>, limit: usize) -> PyResult<Bound<'py, PyList>> {
        let found = self.core.view(py, expression.as_ref(), limit)?;
        let out = PyList::empty(py);
        let document_of = self.api.document_of.bind(py);
        for (seq, doc, at, count) in found {
            let bm = self.core.table.bookmark(seq);
            out.append(self.api.view_entry.bind(py).call1((
                self.api.bm(py, &bm)?,
                document_of.call1((doc,))?,
                at,
                count,
            ))?)?;
        }
        Ok(out)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (available, leased, delayed, inactive, consumers, backlog, oldest, barriers, acks) =
            self.core.stats();
        let not_read = self.core.not_read();
        self.api.queue_stats.bind(py).call1((
            &*self.core.policy.name,
            available,
            leased,
            delayed,
            inactive,
            consumers,
            backlog,
            oldest,
            barriers,
            acks,
            not_read,
        ))
    }

    fn records_wanted(&self) -> Vec<(String, i64, i64, i64, i64)> {
        self.core
            .records_wanted()
            .into_iter()
            .map(|(t, p, from, n, until)| (t.to_string(), p, from, n, until))
            .collect()
    }

    fn deferred<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (t, p, from) in self.core.deferred() {
            out.set_item((&*t, p), from)?;
        }
        Ok(out)
    }

    fn expect_rereads(&mut self, through: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut found = Vec::new();
        for item in through.call_method0("items")?.try_iter()? {
            let (key, end): ((String, i64), i64) = item?.extract()?;
            found.push((key.0, key.1, end));
        }
        self.core.expect_rereads(found);
        Ok(())
    }

    fn finish_rereads(&mut self) {
        self.core.finish_rereads();
    }

    fn purge_deferred(&mut self) -> i64 {
        self.core.purge_deferred()
    }

    fn consumers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for c in self.core.consumers.values() {
            out.append(self.api.consumer_info.bind(py).call1((
                &*c.consumer_id,
                &*c.session_id,
                c.leases.len(),
                c.limit,
                c.filter_text.as_deref(),
                &*c.delivery_topic,
                c.last_seen,
            ))?)?;
        }
        Ok(out)
    }

    /// `QueueEngine.serve_parts`: the parts of a queue of several parts this engine serves.
    fn serve_parts(&mut self, parts: i64, served: Vec<i64>) {
        self.core.serve_parts(parts, served)
    }

    /// `QueueEngine.serves`.
    fn serves(&self, partition: i64) -> bool {
        self.core.serves(partition)
    }

    /// `QueueEngine.credit_view`: (held, waiting) of one consumer for its credit.
    fn credit_view(&mut self, py: Python<'_>, consumer_id: &str) -> PyResult<(usize, usize)> {
        self.core.credit_view(py, &Arc::from(consumer_id))
    }

    /// The filters of the current consumers (for `fields_needed`).
    fn consumer_filters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for c in self.core.consumers.values() {
            if let Some(f) = &c.filter {
                out.append(f.bind(py))?;
            }
        }
        Ok(out)
    }

    fn next_deadline(&self) -> Option<f64> {
        self.core.next_deadline()
    }

    fn take_unparseable<'py>(&mut self, py: Python<'py>) -> PyResult<(i64, Py<PyAny>)> {
        let count = std::mem::take(&mut self.core.unparseable);
        let first = match self.core.first_unparseable.take() {
            Some(bm) => self.api.bm(py, &bm)?.unbind(),
            None => py.None(),
        };
        Ok((count, first))
    }

    fn documents_wanted<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for bm in self.core.documents_wanted() {
            out.append(self.api.bm(py, &bm)?)?;
        }
        Ok(out)
    }

    fn refresh_documents(&mut self, py: Python<'_>, docs: &Bound<'_, PyDict>, fields: Py<PyAny>) -> PyResult<i64> {
        let mut items = Vec::with_capacity(docs.len());
        for (k, v) in docs.iter() {
            let (topic, partition, offset) = read_bm(&k)?;
            items.push((Bm::new(self.core.intern(&topic), partition, offset), v.unbind()));
        }
        let document_of = self.api.document_of.clone_ref(py);
        self.core.refresh_documents(py, items, fields, &document_of)
    }

    fn drain<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (events, records) = self.core.drain();
        let queue = self.core.policy.name.clone();
        let es = PyList::empty(py);
        for e in &events {
            es.append(self.api.event(py, &queue, e)?)?;
        }
        let rs = PyList::empty(py);
        for r in &records {
            rs.append(self.api.record(py, r)?)?;
        }
        self.api.outbox.bind(py).call1((es, rs))
    }

    fn restore(&mut self, entries: &Bound<'_, PyAny>, recovery_points: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut points = Vec::new();
        for item in recovery_points.call_method0("items")?.try_iter()? {
            let item = item?;
            let key = item.get_item(0)?;
            let topic: String = key.get_item(0)?.extract()?;
            let partition: i64 = key.get_item(1)?.extract()?;
            let offset: i64 = item.get_item(1)?.extract()?;
            points.push((self.core.intern(&topic), partition, offset));
        }
        // Sources first, so restored records' topics are interned with them.
        self.core.restore(Vec::new(), points);
        let mut records = Vec::new();
        for r in entries.try_iter()? {
            records.push(read_record(&self.core, &r?)?);
        }
        self.core.restore(records, Vec::new());
        Ok(())
    }

    #[pyo3(signature = (topic, partition, offset, now, reason="retention"))]
    fn expire_before(&mut self, py: Python<'_>, topic: &str, partition: i64, offset: i64, now: f64, reason: &str) -> PyResult<i64> {
        let topic = self.core.intern(topic);
        let reason = Reason::parse(reason)
            .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("unknown expiry reason {reason:?}")))?;
        self.core.expire_before(py, &topic, partition, offset, now, reason)
    }

    #[pyo3(signature = (bookmarks, reason, now, detail=None))]
    fn expire_entries(&mut self, py: Python<'_>, bookmarks: Vec<(String, i64, i64)>, reason: &str, now: f64, detail: Option<String>) -> PyResult<i64> {
        let reason = Reason::parse(reason)
            .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("unknown expiry reason {reason:?}")))?;
        self.core.expire_entries(py, bookmarks, reason, now, detail)
    }

    #[pyo3(signature = (records, now, projected=None))]
    fn enqueue(&mut self, py: Python<'_>, records: &Bound<'_, PyAny>, now: f64, projected: Option<Py<PyAny>>) -> PyResult<i64> {
        if let Some(p) = projected {
            self.core.note_projection(py, p)?;
        }
        let mut offered = Vec::new();
        let mut last_topic: Option<(String, Name)> = None;
        for r in records.try_iter()? {
            let r = r?;
            let t = r.cast::<PyTuple>()?;
            let topic: String = t.get_item(0)?.extract()?;
            let name = match &last_topic {
                Some((text, name)) if *text == topic => name.clone(),
                _ => {
                    let name = self.core.intern(&topic);
                    last_topic = Some((topic, name.clone()));
                    name
                }
            };
            let key = t.get_item(3)?;
            let key: Option<Arc<[u8]>> = if key.is_none() { None } else { Some(Arc::from(key.extract::<Vec<u8>>()?)) };
            offered.push(Offered {
                topic: name,
                partition: t.get_item(1)?.extract()?,
                offset: t.get_item(2)?.extract()?,
                key,
                doc: t.get_item(4)?.unbind(),
                timestamp: t.get_item(5)?.extract()?,
                deliver_at: t.get_item(6)?.extract()?,
                expiration: t.get_item(7)?.extract()?,
            });
        }
        self.core.enqueue(py, offered, now)
    }

    fn resends<'py>(&mut self, py: Python<'py>, now: f64) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let queue = self.core.policy.name.clone();
        for e in self.core.resends(now) {
            out.append(self.api.event(py, &queue, &e)?)?;
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (consumer_id, session_id, now, delivery_topic, max_backlog, filter, filter_text, session_timeout, share))]
    fn subscribe<'py>(
        &mut self,
        py: Python<'py>,
        consumer_id: &str,
        session_id: &str,
        now: f64,
        delivery_topic: &str,
        max_backlog: Option<i64>,
        filter: Option<Py<PyAny>>,
        filter_text: Option<String>,
        session_timeout: Option<f64>,
        share: Option<Py<Share>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let filter = filter.zip(filter_text);
        let e = self.core.subscribe(
            py,
            Arc::from(consumer_id),
            Arc::from(session_id),
            now,
            Arc::from(delivery_topic),
            max_backlog,
            filter,
            session_timeout,
            share,
        )?;
        let queue = self.core.policy.name.clone();
        self.api.event(py, &queue, &e)
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (consumer_id, now, max_backlog, filter, filter_text, delivery_topic, share))]
    fn replace<'py>(
        &mut self,
        py: Python<'py>,
        consumer_id: &str,
        now: f64,
        max_backlog: Option<i64>,
        filter: Option<Py<PyAny>>,
        filter_text: Option<String>,
        delivery_topic: Option<String>,
        share: Option<Py<Share>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let id: Name = Arc::from(consumer_id);
        if !self.core.consumers.contains_key(&id) {
            let err = self.api.unknown_consumer.bind(py).call1((consumer_id,))?;
            return Err(PyErr::from_value(err));
        }
        let e = self.core.replace(
            py,
            &id,
            now,
            max_backlog,
            filter.zip(filter_text),
            delivery_topic.map(|t| Arc::from(t.as_str())),
            share,
        )?;
        let queue = self.core.policy.name.clone();
        self.api.event(py, &queue, &e)
    }

    #[pyo3(signature = (consumer_id, now, share=None))]
    fn retire(&mut self, py: Python<'_>, consumer_id: &str, now: f64, share: Option<Py<Share>>) -> bool {
        self.core.retire(py, &Arc::from(consumer_id), now, share)
    }

    /// `QueueEngine.set_transactional`.
    fn set_transactional(&mut self, consumer_id: &str) -> bool {
        self.core.set_transactional(&Arc::from(consumer_id))
    }

    /// `QueueEngine.take_fences`.
    fn take_fences(&mut self) -> Vec<String> {
        self.core.take_fences().iter().map(|c| c.to_string()).collect()
    }

    /// `QueueEngine.fenced`.
    fn fenced(&mut self, py: Python<'_>, consumer_id: &str, now: f64) -> PyResult<bool> {
        self.core.fenced(py, &Arc::from(consumer_id), now)
    }

    #[pyo3(signature = (consumer_id, now, session_id=None))]
    fn heartbeat(&mut self, consumer_id: &str, now: f64, session_id: Option<&str>) -> bool {
        self.core.heartbeat(consumer_id, now, session_id)
    }

    fn unsubscribe(&mut self, py: Python<'_>, consumer_id: &str, now: f64, reason: &Bound<'_, PyAny>) -> PyResult<bool> {
        let text = reason.str()?.to_string();
        let reason = Leave::parse(&text).ok_or_else(|| PyValueError::new_err(format!("unknown leave reason {text:?}")))?;
        Ok(self.core.unsubscribe(py, &Arc::from(consumer_id), now, reason))
    }

    #[pyo3(signature = (items, now, consumer=None))]
    fn ack<'py>(&mut self, py: Python<'py>, items: &Bound<'_, PyAny>, now: f64, consumer: Option<&str>) -> PyResult<Bound<'py, PyList>> {
        let mut parsed = Vec::new();
        for item in items.try_iter()? {
            let item = item?;
            let t = item.cast::<PyTuple>()?;
            let (topic, partition, offset) = read_bm(&t.get_item(0)?)?;
            parsed.push(AckIn {
                topic,
                partition,
                offset,
                token: t.get_item(1)?.extract()?,
                kind: t.get_item(2)?.extract()?,
                delay: t.get_item(3)?.extract()?,
                reason: t.get_item(4)?.extract()?,
            });
        }
        let outcomes = self.core.ack(py, parsed, now, consumer)?;
        let out = PyList::empty(py);
        let cls = self.api.ack_outcome.bind(py);
        for o in outcomes {
            out.append(cls.call1((o.as_str(),))?)?;
        }
        Ok(out)
    }

    fn ack_matching(&mut self, py: Python<'_>, expression: Option<Py<PyAny>>, now: f64) -> PyResult<i64> {
        self.core.ack_matching(py, expression, now)
    }

    fn tick(&mut self, py: Python<'_>, now: f64) -> PyResult<()> {
        self.core.tick(py, now)
    }

    fn dispatch<'py>(&mut self, py: Python<'py>, now: f64) -> PyResult<Bound<'py, PyList>> {
        let deliveries = self.core.dispatch(py, now)?;
        let out = PyList::empty(py);
        let queue = self.core.policy.name.clone();
        for d in &deliveries {
            out.append(self.api.event(py, &queue, d)?)?;
        }
        Ok(out)
    }

    /// `dispatch`, the deliveries kept in the lane for `Lane.encode_deliveries`; returns how
    /// many there are.
    fn dispatch_into(&mut self, py: Python<'_>, lane: &Bound<'_, Lane>, now: f64) -> PyResult<usize> {
        let deliveries = self.core.dispatch(py, now)?;
        let n = deliveries.len();
        let queue = self.core.policy.name.clone();
        lane.borrow_mut().deliveries.extend(deliveries.into_iter().map(|d| (queue.clone(), d)));
        Ok(n)
    }

    /// `drain`, kept here for `absorb_into` (the reference drains every queue before it
    /// acts on any outbox).
    fn drain_pending(&mut self) {
        let (mut events, mut records) = self.core.drain();
        if let Some((e, r)) = self.pending.take() {
            let mut all_e = e;
            all_e.append(&mut events);
            let mut all_r = r;
            all_r.append(&mut records);
            events = all_e;
            records = all_r;
        }
        self.pending = Some((events, records));
    }

    /// `drain` into the lane (rows, events, held payloads, done entries); returns the
    /// counters to add and the events the core acts on (dead letters, consumers that left).
    #[pyo3(signature = (lane, counted_from, passed, sessions))]
    fn absorb_into<'py>(
        &mut self,
        py: Python<'py>,
        lane: &Bound<'py, Lane>,
        counted_from: Option<&Bound<'py, PyDict>>,
        passed: Option<&Bound<'py, PyDict>>,
        sessions: &Bound<'py, PyDict>,
    ) -> PyResult<(Vec<(&'static str, i64)>, Bound<'py, PyList>)> {
        let read = |d: Option<&Bound<'py, PyDict>>| -> PyResult<rustc_hash::FxHashMap<(String, i64), i64>> {
            let mut out = rustc_hash::FxHashMap::default();
            if let Some(d) = d {
                for (k, v) in d.iter() {
                    let (topic, partition): (String, i64) = k.extract()?;
                    out.insert((topic, partition), v.extract()?);
                }
            }
            Ok(out)
        };
        let counted = read(counted_from)?;
        let passed = read(passed)?;
        let (events, records) = match self.pending.take() {
            Some(p) => p,
            None => self.core.drain(),
        };
        let queue = self.core.policy.name.clone();
        let absorbed = lane.borrow_mut().absorb(py, &queue, events, records, &counted, &passed, sessions)?;
        let specials = PyList::empty(py);
        for e in &absorbed.specials {
            specials.append(self.api.event(py, &queue, e)?)?;
        }
        Ok((absorbed.counts, specials))
    }

    /// ACCEPT of one AcceptRecord group: (index, outcome) of the items not applied, where the
    /// outcome is an `AckOutcome` value or "restoring" (a restored lease whose record the
    /// replay has not reached: the item waits).
    #[pyo3(signature = (topic, partition, offsets, leases, now, consumer=None))]
    fn accept(&mut self, py: Python<'_>, topic: &str, partition: i64, offsets: Vec<i64>,
              leases: &Bound<'_, PyAny>, now: f64, consumer: Option<&str>) -> PyResult<Vec<(usize, &'static str)>> {
        let leases: Vec<Bound<'_, PyAny>> = leases.try_iter()?.collect::<PyResult<_>>()?;
        let mut tokens: Vec<&str> = Vec::with_capacity(leases.len());
        for lease in &leases {
            tokens.push(lease.cast::<pyo3::types::PyString>()?.to_str()?);
        }
        if tokens.len() != offsets.len() {
            return Err(PyValueError::new_err(format!(
                "{} offsets but {} leases", offsets.len(), tokens.len())));
        }
        let outcomes = self.core.accept_many(py, topic, partition, &offsets, &tokens, now, consumer)?;
        let mut odd = Vec::with_capacity(outcomes.len());
        for (i, outcome) in outcomes {
            if outcome == Outcome::UnknownBookmark
                && self.core.restoring_has(&Bm::new(self.core.intern(topic), partition, offsets[i]))
            {
                odd.push((i, "restoring"));
            } else {
                odd.push((i, outcome.as_str()));
            }
        }
        Ok(odd)
    }
}

/// `ShardCore._enqueue` for native engines: journal records offered to the engines of their
/// topics, documents the record values themselves (a `RawDocument` once an expression reads
/// one) within the payload budget's ``room`` and ``project(topic, value) -> (doc, fields)``
/// past it, deliver-at times and expirations (ms) from ``timing(record)`` for records with
/// headers, and each
/// record kept in the lane for this step. Returns (the deletes per topic, projected, and per
/// topic and partition the last offset offered).
#[pyfunction]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn enqueue(
    py: Python<'_>,
    lane: &Bound<'_, Lane>,
    records: &Bound<'_, PyList>,
    engines_for: &Bound<'_, PyAny>,
    now: f64,
    room: i64,
    project: &Bound<'_, PyAny>,
    timing: &Bound<'_, PyAny>,
    delete: &Bound<'_, PyAny>,
) -> PyResult<(Vec<(String, i64)>, i64, Vec<(String, i64, i64)>)> {
    let mut topics: Vec<(String, Vec<usize>)> = Vec::new();
    {
        let mut index: rustc_hash::FxHashMap<String, usize> = rustc_hash::FxHashMap::default();
        let mut last: Option<(String, usize)> = None;
        for (i, r) in records.iter().enumerate() {
            let t = r.cast::<PyTuple>()?;
            let topic = t.get_item(0)?;
            let topic = topic.cast::<pyo3::types::PyString>()?.to_str()?;
            if let Some((name, at)) = &last {
                if name == topic {
                    topics[*at].1.push(i);
                    continue;
                }
            }
            let at = match index.get(topic) {
                Some(&at) => at,
                None => {
                    topics.push((topic.to_string(), Vec::new()));
                    index.insert(topic.to_string(), topics.len() - 1);
                    topics.len() - 1
                }
            };
            topics[at].1.push(i);
            last = Some((topic.to_string(), at));
        }
    }
    let mut deletes: Vec<(String, i64)> = Vec::new();
    let mut projected = 0i64;
    let mut room = room;
    let mut lasts = Vec::new();
    for (topic, indexes) in topics {
        let engines = engines_for.call1((topic.as_str(),))?;
        let engines = engines.cast::<PyList>()?;
        if engines.is_empty() {
            continue;
        }
        let mut keyed = false;
        for e in engines.iter() {
            keyed |= e.cast::<NativeEngine>()?.borrow().core.policy.key_groups;
        }
        let name = lane.borrow_mut().intern(&topic);
        let mut fields: Option<Py<PyAny>> = None;
        let mut offered: Vec<Offered> = Vec::with_capacity(indexes.len());
        let mut last: Vec<(i64, i64)> = Vec::new();
        for i in indexes {
            let r = records.get_item(i)?;
            let t = r.cast::<PyTuple>()?;
            let partition: i64 = t.get_item(1)?.extract()?;
            let offset: i64 = t.get_item(2)?.extract()?;
            match last.iter_mut().find(|(p, _)| *p == partition) {
                Some(entry) => entry.1 = offset,
                None => last.push((partition, offset)),
            }
            let key_obj = t.get_item(3)?;
            let key: Option<Arc<[u8]>> = if keyed && !key_obj.is_none() {
                Some(Arc::from(key_obj.extract::<Vec<u8>>()?))
            } else {
                None
            };
            let value = t.get_item(4)?;
            if value.is_none() {
                // A tombstone is a delete, not a publish: no queue gets an entry for it.
                match deletes.last_mut() {
                    Some((t, n)) if *t == topic => *n += 1,
                    _ => deletes.push((topic.clone(), 1)),
                }
                offered.push(Offered {
                    topic: name.clone(),
                    partition,
                    offset,
                    key,
                    doc: delete.clone().unbind(),
                    timestamp: None,
                    deliver_at: None,
                    expiration: None,
                });
                continue;
            }
            let headers = t.get_item(6)?;
            let (at, expiration): (Option<i64>, Option<i64>) = if !headers.is_none() && headers.len()? > 0 {
                timing.call1((&r,))?.extract()?
            } else {
                (None, None)
            };
            room -= lane::record_size(t)?;
            let doc = if room >= 0 {
                value.unbind()
            } else {
                projected += 1;
                let (doc, f): (Py<PyAny>, Py<PyAny>) = project.call1((topic.as_str(), value))?.extract()?;
                fields = Some(f);
                doc
            };
            let ts: i64 = t.get_item(5)?.extract()?;
            offered.push(Offered {
                topic: name.clone(),
                partition,
                offset,
                key,
                doc,
                timestamp: if ts > 0 { Some(ts as f64 / 1000.0) } else { None },
                deliver_at: at.map(|ms| ms as f64 / 1000.0),
                expiration: expiration.map(|ms| ms as f64 / 1000.0),
            });
            lane.borrow_mut().hold_fresh(Bm::new(name.clone(), partition, offset), r.unbind());
        }
        for e in engines.iter() {
            let engine = e.cast::<NativeEngine>()?;
            let mut engine = engine.borrow_mut();
            if let Some(f) = &fields {
                engine.core.note_projection(py, f.clone_ref(py))?;
            }
            let copy: Vec<Offered> = offered
                .iter()
                .map(|o| Offered {
                    topic: o.topic.clone(),
                    partition: o.partition,
                    offset: o.offset,
                    key: o.key.clone(),
                    doc: o.doc.clone_ref(py),
                    timestamp: o.timestamp,
                    deliver_at: o.deliver_at,
                    expiration: o.expiration,
                })
                .collect();
            engine.core.enqueue(py, copy, now)?;
        }
        lasts.extend(last.into_iter().map(|(p, o)| (topic.clone(), p, o)));
    }
    Ok((deletes, projected, lasts))
}

#[pymodule]
fn qlayer_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(enqueue, m)?)?;
    m.add_function(wrap_pyfunction!(batch::decode_delivery_batch, m)?)?;
    m.add_class::<NativeEngine>()?;
    m.add_class::<Share>()?;
    m.add_class::<Lane>()?;
    m.add_class::<Payloads>()?;
    m.add("MAX_WANTED_DOCUMENTS", engine::MAX_WANTED_DOCUMENTS)?;
    Ok(())
}
