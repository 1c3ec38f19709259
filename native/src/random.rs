//! Lease tokens' randomness: the OS's (as `os.urandom`, what `LeaseTokens` uses).

use pyo3::prelude::*;
use std::io::Read;

pub fn fill(buffer: &mut [u8]) -> PyResult<()> {
    let mut source = std::fs::File::open("/dev/urandom")
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("/dev/urandom: {e}")))?;
    source
        .read_exact(buffer)
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("/dev/urandom: {e}")))
}
