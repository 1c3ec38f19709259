//! The engine's vocabulary, as in `layer/domain/states.py`, `entries.py` and `events.py`.

use std::sync::Arc;

pub type Seq = i64;
pub type Name = Arc<str>;

// Entry states: `EntryState` (one byte per entry).
pub const AVAILABLE: u8 = 1;
pub const LEASED: u8 = 2;
pub const DELAYED: u8 = 3;
pub const INACTIVE: u8 = 4;
pub const ACKED: u8 = 5;
pub const EXPIRED: u8 = 6;

// Ack types: `AckType`.
pub const ACCEPT: i64 = 1;
pub const RELEASE: i64 = 2;
pub const REJECT: i64 = 3;
pub const RENEW: i64 = 4;

/// Where a journal record lives: the identity of an entry.
#[derive(Clone, Debug)]
pub struct Bm {
    pub topic: Name,
    pub partition: i64,
    pub offset: i64,
}

// The offset tells bookmarks apart almost always: compared first, and the topic (an interned
// name, the same allocation nearly always) by address before by content; hashed without the
// topic (equal bookmarks still hash alike). Bookmarks are the keys of every lease map.
impl PartialEq for Bm {
    fn eq(&self, other: &Self) -> bool {
        self.offset == other.offset
            && self.partition == other.partition
            && (Arc::ptr_eq(&self.topic, &other.topic) || *self.topic == *other.topic)
    }
}

impl Eq for Bm {}

impl std::hash::Hash for Bm {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_i64(self.offset);
        state.write_i64(self.partition);
    }
}

impl Bm {
    pub fn new(topic: Name, partition: i64, offset: i64) -> Self {
        Self { topic, partition, offset }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckSource {
    Consumer,
    Admin,
    Delivery,
    Barrier,
    Early,
}

impl AckSource {
    pub fn as_str(self) -> &'static str {
        match self {
            AckSource::Consumer => "consumer",
            AckSource::Admin => "admin",
            AckSource::Delivery => "delivery",
            AckSource::Barrier => "barrier",
            AckSource::Early => "early",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    MaxDeliveries,
    MaxCancels,
    Rejected,
    Expiration,
    Retention,
    TooLarge,
    JournalDeleted,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::MaxDeliveries => "max-deliveries",
            Reason::MaxCancels => "max-cancels",
            Reason::Rejected => "rejected",
            Reason::Expiration => "expiration",
            Reason::Retention => "retention",
            Reason::TooLarge => "too-large",
            Reason::JournalDeleted => "journal-deleted",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "max-deliveries" => Reason::MaxDeliveries,
            "max-cancels" => Reason::MaxCancels,
            "rejected" => Reason::Rejected,
            "expiration" => Reason::Expiration,
            "retention" => Reason::Retention,
            "too-large" => Reason::TooLarge,
            "journal-deleted" => Reason::JournalDeleted,
            _ => return None,
        })
    }

    /// `ExpiryReason.dead_letter`.
    pub fn dead_letter(self) -> bool {
        matches!(self, Reason::MaxDeliveries | Reason::MaxCancels | Reason::Rejected | Reason::TooLarge)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leave {
    Unsubscribed,
    SessionTimeout,
    SessionReplaced,
    Evicted,
    Replaced,
}

impl Leave {
    pub fn as_str(self) -> &'static str {
        match self {
            Leave::Unsubscribed => "unsubscribed",
            Leave::SessionTimeout => "session-timeout",
            Leave::SessionReplaced => "session-replaced",
            Leave::Evicted => "evicted",
            Leave::Replaced => "replaced",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "unsubscribed" => Leave::Unsubscribed,
            "session-timeout" => Leave::SessionTimeout,
            "session-replaced" => Leave::SessionReplaced,
            "evicted" => Leave::Evicted,
            "replaced" => Leave::Replaced,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    Remembered,
    WrongToken,
    NotLeased,
    AlreadyDone,
    UnknownBookmark,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Remembered => "remembered",
            Outcome::WrongToken => "wrong-token",
            Outcome::NotLeased => "not-leased",
            Outcome::AlreadyDone => "already-done",
            Outcome::UnknownBookmark => "unknown-bookmark",
        }
    }
}

/// `EntryRecord`: the persistent state of one touched entry.
#[derive(Clone, Debug)]
pub struct Rec {
    pub bm: Bm,
    pub state: u8,
    pub delivery_count: i64,
    pub cancel_count: i64,
    pub consumer_id: Option<Name>,
    pub session_id: Option<Name>,
    pub token: Option<Name>,
    pub deadline: Option<f64>,
    pub available_at: Option<f64>,
    pub reason: Option<Reason>,
}

impl Rec {
    pub fn plain(bm: Bm, state: u8) -> Self {
        Self {
            bm,
            state,
            delivery_count: 0,
            cancel_count: 0,
            consumer_id: None,
            session_id: None,
            token: None,
            deadline: None,
            available_at: None,
            reason: None,
        }
    }

    pub fn done(&self) -> bool {
        self.state >= ACKED
    }
}

/// The engine's events (`layer/domain/events.py`), queue name implied.
#[derive(Clone, Debug)]
pub enum Ev {
    Enqueued { topic: Name, partition: i64, offsets: Vec<i64>, at: f64 },
    Delayed { bm: Bm, until: f64, at: f64 },
    Leased {
        bm: Bm,
        consumer_id: Name,
        delivery_topic: Name,
        token: Name,
        deadline: f64,
        delivery_count: i64,
        at: f64,
    },
    Acked {
        bm: Bm,
        consumer_id: Option<Name>,
        source: AckSource,
        at: f64,
        delivery_count: Option<i64>,
    },
    Released {
        bm: Bm,
        consumer_id: Name,
        cancel_count: i64,
        available_at: Option<f64>,
        at: f64,
    },
    Renewed { bm: Bm, consumer_id: Name, deadline: f64, at: f64 },
    LeaseExpired { bm: Bm, consumer_id: Name, available_at: Option<f64>, at: f64 },
    LeaseBroken { bm: Bm, consumer_id: Name, reason: Leave, at: f64 },
    Expired {
        bm: Bm,
        reason: Reason,
        dead_letter: bool,
        delivery_count: i64,
        cancel_count: i64,
        consumer_id: Option<Name>,
        detail: Option<String>,
        at: f64,
    },
    Barrier { bm: Bm, recipients: Vec<(Name, Name)>, at: f64 },
    BacklogFreed { bm: Bm, consumer_id: Name, at: f64 },
    Subscribed {
        consumer_id: Name,
        session_id: Name,
        max_backlog: i64,
        filter: Option<String>,
        delivery_topic: Name,
        at: f64,
    },
    Replaced {
        consumer_id: Name,
        session_id: Name,
        max_backlog: i64,
        filter: Option<String>,
        delivery_topic: Name,
        at: f64,
    },
    Left { consumer_id: Name, session_id: Name, reason: Leave, broken: i64, at: f64 },
}

impl Ev {
    /// The entry an event is about, if it is about one (`getattr(e, "bookmark", None)`).
    pub fn bookmark(&self) -> Option<&Bm> {
        match self {
            Ev::Delayed { bm, .. }
            | Ev::Leased { bm, .. }
            | Ev::Acked { bm, .. }
            | Ev::Released { bm, .. }
            | Ev::Renewed { bm, .. }
            | Ev::LeaseExpired { bm, .. }
            | Ev::LeaseBroken { bm, .. }
            | Ev::Expired { bm, .. }
            | Ev::Barrier { bm, .. }
            | Ev::BacklogFreed { bm, .. } => Some(bm),
            _ => None,
        }
    }
}

/// A total order for the floats of timer heaps ((time, seq) tuples in Python's heapq).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed(pub f64, pub Seq);

impl Eq for Timed {}

impl PartialOrd for Timed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Timed {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
    }
}
