//! qlayer's native shard core (DESIGN §6): the queue engine of `layer/domain/engine.py`,
//! ported line by line, behind the same Python interface (`layer.domain.native` wraps it).
//! The Python engine is the reference; tests run both on the same inputs and compare.

mod engine;
mod ordered;
mod random;
mod table;
mod types;

use engine::{AckIn, Engine, Fairness, Offered, Policy, PyHooks, Share, Tokens};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::sync::Arc;
use types::*;

/// The Python classes and enum members the compatible interface builds its answers from.
struct Api {
    bookmark: Py<PyAny>,
    entry_record: Py<PyAny>,
    outbox: Py<PyAny>,
    view_entry: Py<PyAny>,
    consumer_info: Py<PyAny>,
    queue_stats: Py<PyAny>,
    recipient: Py<PyAny>,
    ev: [Py<PyAny>; 14],
    states: Vec<Py<PyAny>>,
    ack_source: Py<PyAny>,
    expiry_reason: Py<PyAny>,
    leave_reason: Py<PyAny>,
    ack_outcome: Py<PyAny>,
    unknown_consumer: Py<PyAny>,
    document_of: Py<PyAny>,
}

const EV_NAMES: [&str; 14] = [
    "EntriesEnqueued",
    "EntryDelayed",
    "EntryLeased",
    "EntryAcked",
    "EntryReleased",
    "LeaseRenewed",
    "LeaseExpired",
    "LeaseBroken",
    "EntryExpired",
    "BarrierDelivered",
    "BacklogFreed",
    "ConsumerSubscribed",
    "ConsumerReplaced",
    "ConsumerLeft",
];

impl Api {
    fn load(py: Python<'_>, api: &Bound<'_, PyAny>) -> PyResult<Self> {
        let get = |name: &str| -> PyResult<Py<PyAny>> { Ok(api.getattr(name)?.unbind()) };
        let ev = EV_NAMES.map(|n| api.getattr(n).map(|o| o.unbind()));
        let mut events = Vec::with_capacity(14);
        for e in ev {
            events.push(e?);
        }
        let state_enum = api.getattr("EntryState")?;
        let mut states = vec![py.None()];
        for i in 1..=6 {
            states.push(state_enum.call1((i,))?.unbind());
        }
        Ok(Self {
            bookmark: get("Bookmark")?,
            entry_record: get("EntryRecord")?,
            outbox: get("Outbox")?,
            view_entry: get("ViewEntry")?,
            consumer_info: get("ConsumerInfo")?,
            queue_stats: get("QueueStats")?,
            recipient: get("Recipient")?,
            ev: events.try_into().map_err(|_| PyValueError::new_err("event classes"))?,
            states,
            ack_source: get("AckSource")?,
            expiry_reason: get("ExpiryReason")?,
            leave_reason: get("LeaveReason")?,
            ack_outcome: get("AckOutcome")?,
            unknown_consumer: get("UnknownConsumerError")?,
            document_of: get("document_of")?,
        })
    }

    fn bm<'py>(&self, py: Python<'py>, bm: &Bm) -> PyResult<Bound<'py, PyAny>> {
        self.bookmark.bind(py).call1((&*bm.topic, bm.partition, bm.offset))
    }

    fn name(n: &Option<Name>) -> Option<&str> {
        n.as_deref()
    }

    fn event<'py>(&self, py: Python<'py>, queue: &str, e: &Ev) -> PyResult<Bound<'py, PyAny>> {
        let cls = |i: usize| self.ev[i].bind(py);
        match e {
            Ev::Enqueued { topic, partition, offsets, at } => {
                cls(0).call1((queue, &**topic, *partition, PyTuple::new(py, offsets)?, *at))
            }
            Ev::Delayed { bm, until, at } => cls(1).call1((queue, self.bm(py, bm)?, *until, *at)),
            Ev::Leased { bm, consumer_id, delivery_topic, token, deadline, delivery_count, at } => {
                cls(2).call1((
                    queue,
                    self.bm(py, bm)?,
                    &**consumer_id,
                    &**delivery_topic,
                    &**token,
                    *deadline,
                    *delivery_count,
                    *at,
                ))
            }
            Ev::Acked { bm, consumer_id, source, at, delivery_count } => cls(3).call1((
                queue,
                self.bm(py, bm)?,
                Self::name(consumer_id),
                self.ack_source.bind(py).call1((source.as_str(),))?,
                *at,
                *delivery_count,
            )),
            Ev::Released { bm, consumer_id, cancel_count, available_at, at } => cls(4).call1((
                queue,
                self.bm(py, bm)?,
                &**consumer_id,
                *cancel_count,
                *available_at,
                *at,
            )),
            Ev::Renewed { bm, consumer_id, deadline, at } => {
                cls(5).call1((queue, self.bm(py, bm)?, &**consumer_id, *deadline, *at))
            }
            Ev::LeaseExpired { bm, consumer_id, available_at, at } => {
                cls(6).call1((queue, self.bm(py, bm)?, &**consumer_id, *available_at, *at))
            }
            Ev::LeaseBroken { bm, consumer_id, reason, at } => cls(7).call1((
                queue,
                self.bm(py, bm)?,
                &**consumer_id,
                self.leave_reason.bind(py).call1((reason.as_str(),))?,
                *at,
            )),
            Ev::Expired {
                bm,
                reason,
                dead_letter,
                delivery_count,
                cancel_count,
                consumer_id,
                detail,
                at,
            } => cls(8).call1((
                queue,
                self.bm(py, bm)?,
                self.expiry_reason.bind(py).call1((reason.as_str(),))?,
                *dead_letter,
                *delivery_count,
                *cancel_count,
                Self::name(consumer_id),
                detail.as_deref(),
                *at,
            )),
            Ev::Barrier { bm, recipients, at } => {
                let mut rs = Vec::with_capacity(recipients.len());
                for (c, t) in recipients {
                    rs.push(self.recipient.bind(py).call1((&**c, &**t))?);
                }
                cls(9).call1((queue, self.bm(py, bm)?, PyTuple::new(py, rs)?, *at))
            }
            Ev::BacklogFreed { bm, consumer_id, at } => {
                cls(10).call1((queue, self.bm(py, bm)?, &**consumer_id, *at))
            }
            Ev::Subscribed { consumer_id, session_id, max_backlog, filter, delivery_topic, at } => {
                cls(11).call1((
                    queue,
                    &**consumer_id,
                    &**session_id,
                    *max_backlog,
                    filter.as_deref(),
                    &**delivery_topic,
                    *at,
                ))
            }
            Ev::Replaced { consumer_id, session_id, max_backlog, filter, delivery_topic, at } => {
                cls(12).call1((
                    queue,
                    &**consumer_id,
                    &**session_id,
                    *max_backlog,
                    filter.as_deref(),
                    &**delivery_topic,
                    *at,
                ))
            }
            Ev::Left { consumer_id, session_id, reason, broken, at } => cls(13).call1((
                queue,
                &**consumer_id,
                &**session_id,
                self.leave_reason.bind(py).call1((reason.as_str(),))?,
                *broken,
                *at,
            )),
        }
    }

    fn record<'py>(&self, py: Python<'py>, r: &Rec) -> PyResult<Bound<'py, PyAny>> {
        let reason = match r.reason {
            Some(reason) => Some(self.expiry_reason.bind(py).call1((reason.as_str(),))?),
            None => None,
        };
        self.entry_record.bind(py).call1((
            self.bm(py, &r.bm)?,
            self.states[r.state as usize].bind(py),
            r.delivery_count,
            r.cancel_count,
            r.consumer_id.as_deref(),
            r.session_id.as_deref(),
            r.token.as_deref(),
            r.deadline,
            r.available_at,
            reason,
        ))
    }
}

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
        Ok(Self { core: Engine::new(p, hooks, tokens, session_timeout), api: Api::load(py, api)? })
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
        ))
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

    fn expire_before(&mut self, py: Python<'_>, topic: &str, partition: i64, offset: i64, now: f64) -> PyResult<i64> {
        let topic = self.core.intern(topic);
        self.core.expire_before(py, &topic, partition, offset, now)
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

    #[pyo3(signature = (consumer_id, now, session_id=None))]
    fn heartbeat(&mut self, consumer_id: &str, now: f64, session_id: Option<&str>) -> bool {
        self.core.heartbeat(consumer_id, now, session_id)
    }

    fn unsubscribe(&mut self, py: Python<'_>, consumer_id: &str, now: f64, reason: &Bound<'_, PyAny>) -> PyResult<bool> {
        let text = reason.str()?.to_string();
        let reason = Leave::parse(&text).ok_or_else(|| PyValueError::new_err(format!("unknown leave reason {text:?}")))?;
        Ok(self.core.unsubscribe(py, &Arc::from(consumer_id), now, reason))
    }

    fn ack<'py>(&mut self, py: Python<'py>, items: &Bound<'_, PyAny>, now: f64) -> PyResult<Bound<'py, PyList>> {
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
        let outcomes = self.core.ack(py, parsed, now)?;
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
}

#[pymodule]
fn qlayer_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeEngine>()?;
    m.add_class::<Share>()?;
    m.add("MAX_WANTED_DOCUMENTS", engine::MAX_WANTED_DOCUMENTS)?;
    Ok(())
}
