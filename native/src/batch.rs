//! Decoding a delivery batch record (`layer/protocol/batch.py`, docs/protocol.md): what an SDK
//! consumer does for every message it receives. The Python decoder is the reference; this one
//! answers the same tuples (`BatchEntry`'s fields, in order) for every whole batch and refuses
//! (ValueError) whatever the reference refuses, which then runs to give its exact error.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

const MAGIC: &[u8; 2] = b"qB";
const VERSION: u8 = 1;
const NULL: u32 = 0xFFFF_FFFF;

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

fn cut() -> PyErr {
    PyValueError::new_err("delivery batch cut or garbled")
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> PyResult<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or_else(cut)?;
        let slice = self.data.get(self.pos..end).ok_or_else(cut)?;
        self.pos = end;
        Ok(slice)
    }
    fn u8(&mut self) -> PyResult<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> PyResult<usize> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]) as usize)
    }
    fn u32(&mut self) -> PyResult<u32> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes(b.try_into().map_err(|_| cut())?))
    }
    fn u64(&mut self) -> PyResult<u64> {
        let b = self.take(8)?;
        Ok(u64::from_be_bytes(b.try_into().map_err(|_| cut())?))
    }
    fn text(&mut self) -> PyResult<&'a str> {
        let n = self.u16()?;
        std::str::from_utf8(self.take(n)?).map_err(|_| cut())
    }
    fn bytes<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let n = self.u32()?;
        if n == NULL {
            return Ok(py.None().into_bound(py));
        }
        Ok(PyBytes::new(py, self.take(n as usize)?).into_any())
    }
}

fn name<'a, 'py>(py: Python<'py>, r: &mut Reader<'a>,
                 names: &mut Vec<(&'a [u8], Bound<'py, PyString>)>) -> PyResult<Bound<'py, PyString>> {
    let n = r.u16()?;
    let raw = r.take(n)?;
    if let Some((_, s)) = names.iter().find(|(t, _)| *t == raw) {
        return Ok(s.clone());
    }
    let s = PyString::new(py, std::str::from_utf8(raw).map_err(|_| cut())?);
    names.push((raw, s.clone()));
    Ok(s)
}

/// The messages of a batch record's value as tuples of `BatchEntry`'s fields.
#[pyfunction]
pub fn decode_delivery_batch<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
    let mut r = Reader { data, pos: 0 };
    if r.take(2)? != MAGIC || r.u8()? != VERSION {
        return Err(PyValueError::new_err("not a delivery batch of this version"));
    }
    let count = r.u32()? as usize;
    let out = PyList::empty(py);
    // Queue and topic names repeat within a batch: one Python string each.
    let mut names: Vec<(&[u8], Bound<'py, PyString>)> = Vec::new();
    for _ in 0..count {
        let queue = name(py, &mut r, &mut names)?;
        let topic = name(py, &mut r, &mut names)?;
        let partition = r.u32()?;
        let offset = r.u64()?;
        let n = r.u16()?;
        let lease = r.take(n)?;
        if !lease.is_ascii() {
            return Err(cut());
        }
        let lease = std::str::from_utf8(lease).map_err(|_| cut())?;
        let expires = r.u64()?;
        let deliveries = r.u32()?;
        let flags = r.u8()?;
        let timestamp = r.u64()? as i64;
        let key = r.bytes(py)?;
        let value = r.bytes(py)?;
        let header_count = r.u16()?;
        let headers = PyList::empty(py);
        for _ in 0..header_count {
            let hname = r.text()?;
            let hvalue = r.bytes(py)?;
            headers.append(PyTuple::new(py, [PyString::new(py, hname).into_any(), hvalue])?)?;
        }
        let timestamp: Bound<'py, PyAny> = if timestamp < 0 {
            py.None().into_bound(py)
        } else {
            timestamp.into_pyobject(py)?.into_any()
        };
        let fields: [Bound<'py, PyAny>; 12] = [
            queue.into_any(),
            topic.into_any(),
            partition.into_pyobject(py)?.into_any(),
            offset.into_pyobject(py)?.into_any(),
            PyString::new(py, lease).into_any(),
            expires.into_pyobject(py)?.into_any(),
            deliveries.into_pyobject(py)?.into_any(),
            pyo3::types::PyBool::new(py, flags & 1 == 1).to_owned().into_any(),
            timestamp,
            key,
            value,
            headers.into_any(),
        ];
        out.append(PyTuple::new(py, fields)?)?;
    }
    if r.pos != data.len() {
        return Err(PyValueError::new_err("bytes after the last message"));
    }
    Ok(out)
}
