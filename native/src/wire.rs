//! Byte formats the lane writes: Avro binary (events, `layer/protocol/eventwire.py`) and the
//! delivery batch framing (`layer/protocol/batch.py`). Byte for byte what the Python encoders
//! write; tests/unit/coordinator/test_native_lane.py compares them.

pub const NULL: u8 = 0x00;
pub const SOME: u8 = 0x02;
/// The union branch starting an `EventBatch` item: an `Event` (0) or an `EventRun` (1).
pub const EVENT_ITEM: u8 = 0x00;
pub const RUN_ITEM: u8 = 0x02;

/// An Avro int or long: zig-zag, then 7 bits per byte, least significant first.
pub fn long(out: &mut Vec<u8>, n: i64) {
    let mut z = ((n << 1) ^ (n >> 63)) as u64;
    while z >= 0x80 {
        out.push((z as u8 & 0x7F) | 0x80);
        z >>= 7;
    }
    out.push(z as u8);
}

pub fn string(out: &mut Vec<u8>, text: &str) {
    long(out, text.len() as i64);
    out.extend_from_slice(text.as_bytes());
}

pub fn opt_string(out: &mut Vec<u8>, text: Option<&str>) {
    match text {
        None => out.push(NULL),
        Some(t) => {
            out.push(SOME);
            string(out, t);
        }
    }
}

pub fn opt_long(out: &mut Vec<u8>, n: Option<i64>) {
    match n {
        None => out.push(NULL),
        Some(v) => {
            out.push(SOME);
            long(out, v);
        }
    }
}

pub fn long_array(out: &mut Vec<u8>, values: &[i64]) {
    if values.is_empty() {
        out.push(NULL);
        return;
    }
    long(out, values.len() as i64);
    for &v in values {
        long(out, v);
    }
    out.push(NULL);
}

/// A nullable array of nullable longs (an ENQUEUED run's record timestamps).
pub fn opt_long_array(out: &mut Vec<u8>, values: &[Option<i64>]) {
    out.push(SOME);
    if values.is_empty() {
        out.push(NULL);
        return;
    }
    long(out, values.len() as i64);
    for v in values {
        opt_long(out, *v);
    }
    out.push(NULL);
}

/// Python's `int(seconds * 1000)`: truncated toward zero.
pub fn ms(seconds: f64) -> i64 {
    (seconds * 1000.0) as i64
}

// --- delivery batches (protocol 3) ---------------------------------------------------------

pub const BATCH_MAGIC: &[u8; 2] = b"qB";
pub const BATCH_VERSION: u8 = 1;
pub const BATCH_HEAD: usize = 7;
const NULL32: u32 = 0xFFFF_FFFF;

fn str16(out: &mut Vec<u8>, text: &[u8]) {
    out.extend_from_slice(&(text.len() as u16).to_be_bytes());
    out.extend_from_slice(text);
}

fn bytes32(out: &mut Vec<u8>, data: Option<&[u8]>) {
    match data {
        None => out.extend_from_slice(&NULL32.to_be_bytes()),
        Some(d) => {
            out.extend_from_slice(&(d.len() as u32).to_be_bytes());
            out.extend_from_slice(d);
        }
    }
}

/// The encoded size of a batch message (`batch_entry`'s output).
pub fn batch_entry_len(queue: &[u8], topic: &[u8], lease: &[u8], key: Option<&[u8]>,
                       value: Option<&[u8]>, headers: &[(&[u8], Option<&[u8]>)]) -> usize {
    2 + queue.len() + 2 + topic.len() + 12 + 2 + lease.len() + 21
        + 4 + key.map_or(0, |k| k.len()) + 4 + value.map_or(0, |v| v.len()) + 2
        + headers.iter().map(|(n, v)| 2 + n.len() + 4 + v.map_or(0, |v| v.len())).sum::<usize>()
}

/// One message of a batch (`batch.encode_entry`).
#[allow(clippy::too_many_arguments)]
pub fn batch_entry(
    out: &mut Vec<u8>,
    queue: &[u8],
    topic: &[u8],
    partition: i64,
    offset: i64,
    lease: &[u8],
    lease_expires_ms: i64,
    delivery_count: i64,
    barrier: bool,
    timestamp_ms: Option<i64>,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: &[(&[u8], Option<&[u8]>)],
) {
    str16(out, queue);
    str16(out, topic);
    out.extend_from_slice(&(partition as u32).to_be_bytes());
    out.extend_from_slice(&(offset as u64).to_be_bytes());
    str16(out, lease);
    out.extend_from_slice(&(lease_expires_ms as u64).to_be_bytes());
    out.extend_from_slice(&(delivery_count as u32).to_be_bytes());
    out.push(if barrier { 1 } else { 0 });
    out.extend_from_slice(&timestamp_ms.unwrap_or(-1).to_be_bytes());
    bytes32(out, key);
    bytes32(out, value);
    out.extend_from_slice(&(headers.len() as u16).to_be_bytes());
    for (name, value) in headers {
        str16(out, name);
        bytes32(out, *value);
    }
}

/// A batch record's value being filled: its header, then messages (`batch_entry`), then
/// `finish` writes the count.
pub fn batch_start(capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(BATCH_HEAD + capacity);
    out.extend_from_slice(BATCH_MAGIC);
    out.push(BATCH_VERSION);
    out.extend_from_slice(&0u32.to_be_bytes());
    out
}

pub fn batch_finish(out: &mut [u8], count: usize) {
    out[3..7].copy_from_slice(&(count as u32).to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longs_are_zigzag_varints() {
        let enc = |n| {
            let mut v = Vec::new();
            long(&mut v, n);
            v
        };
        assert_eq!(enc(0), vec![0]);
        assert_eq!(enc(-1), vec![1]);
        assert_eq!(enc(1), vec![2]);
        assert_eq!(enc(64), vec![0x80, 0x01]);
        assert_eq!(enc(i64::MIN), vec![0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]);
    }
}
