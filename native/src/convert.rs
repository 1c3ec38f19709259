//! Engine values as the reference's Python objects (events, entry records, bookmarks).

use crate::types::*;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// The Python classes and enum members the compatible interface builds its answers from.
pub struct Api {
    pub bookmark: Py<PyAny>,
    pub entry_record: Py<PyAny>,
    pub outbox: Py<PyAny>,
    pub view_entry: Py<PyAny>,
    pub consumer_info: Py<PyAny>,
    pub queue_stats: Py<PyAny>,
    pub recipient: Py<PyAny>,
    pub ev: [Py<PyAny>; 14],
    pub states: Vec<Py<PyAny>>,
    pub ack_source: Py<PyAny>,
    pub expiry_reason: Py<PyAny>,
    pub leave_reason: Py<PyAny>,
    pub ack_outcome: Py<PyAny>,
    pub unknown_consumer: Py<PyAny>,
    pub document_of: Py<PyAny>,
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
    pub fn load(py: Python<'_>, api: &Bound<'_, PyAny>) -> PyResult<Self> {
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

    pub fn bm<'py>(&self, py: Python<'py>, bm: &Bm) -> PyResult<Bound<'py, PyAny>> {
        self.bookmark.bind(py).call1((&*bm.topic, bm.partition, bm.offset))
    }

    fn name(n: &Option<Name>) -> Option<&str> {
        n.as_deref()
    }

    pub fn event<'py>(&self, py: Python<'py>, queue: &str, e: &Ev) -> PyResult<Bound<'py, PyAny>> {
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

    pub fn record<'py>(&self, py: Python<'py>, r: &Rec) -> PyResult<Bound<'py, PyAny>> {
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

