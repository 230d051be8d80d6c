//! Little-endian field writer and bounds-checked reader over one message buffer.
//!
//! The reader is fed untrusted bytes: every read checks the remaining length and returns
//! [`ProtoError::Malformed`] instead of panicking; [`Reader::finish`] rejects trailing bytes.

use crate::{ForeignFd, MAX_MESSAGE, ProtoError};

/// Writes fields into a fixed message buffer. Every message of this protocol fits in
/// [`MAX_MESSAGE`] bytes by construction (strings are truncated before they are written), so the
/// writer only guards against overflow by stopping, which the unit tests show never happens.
pub(crate) struct Writer<'a> {
    buf: &'a mut [u8; MAX_MESSAGE],
    len: usize,
}

impl<'a> Writer<'a> {
    pub(crate) fn new(buf: &'a mut [u8; MAX_MESSAGE]) -> Self {
        Writer { buf, len: 0 }
    }

    fn put(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        debug_assert!(end <= MAX_MESSAGE, "message exceeds MAX_MESSAGE");
        if let Some(dst) = self.buf.get_mut(self.len..end) {
            dst.copy_from_slice(bytes);
            self.len = end;
        }
    }

    pub(crate) fn u8(&mut self, v: u8) {
        self.put(&[v]);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.put(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }
    pub(crate) fn i32(&mut self, v: i32) {
        self.put(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }
    pub(crate) fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    pub(crate) fn bytes16(&mut self, v: &[u8; 16]) {
        self.put(v);
    }
    /// Another process's descriptor number as an `i32`, -1 for none.
    pub(crate) fn fd(&mut self, v: Option<ForeignFd>) {
        self.i32(v.map_or(-1, ForeignFd::get));
    }
    /// u16 length + UTF-8 bytes; the caller has already bounded the length.
    pub(crate) fn str(&mut self, s: &str) {
        let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
        self.u16(len);
        self.put(&s.as_bytes()[..usize::from(len)]);
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// Reads fields from received bytes, refusing to read past the end.
pub(crate) struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], ProtoError> {
        let (head, rest) = self
            .b
            .split_first_chunk::<N>()
            .ok_or(ProtoError::Malformed("message truncated"))?;
        self.b = rest;
        Ok(*head)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, ProtoError> {
        Ok(self.take::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    pub(crate) fn i32(&mut self) -> Result<i32, ProtoError> {
        Ok(i32::from_le_bytes(self.take()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    pub(crate) fn bytes16(&mut self) -> Result<[u8; 16], ProtoError> {
        self.take()
    }
    /// Another process's descriptor number: -1 is none, any other negative number is refused
    /// (so that every decode encodes to the same bytes).
    pub(crate) fn fd(&mut self) -> Result<Option<ForeignFd>, ProtoError> {
        match self.i32()? {
            -1 => Ok(None),
            n => ForeignFd::new(n)
                .map(Some)
                .ok_or(ProtoError::Malformed("descriptor number below -1")),
        }
    }
    pub(crate) fn bool(&mut self) -> Result<bool, ProtoError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(ProtoError::Malformed("boolean is neither 0 nor 1")),
        }
    }
    pub(crate) fn str(&mut self) -> Result<String, ProtoError> {
        let len = usize::from(self.u16()?);
        if self.b.len() < len {
            return Err(ProtoError::Malformed("string longer than the message"));
        }
        let (s, rest) = self.b.split_at(len);
        self.b = rest;
        std::str::from_utf8(s)
            .map(str::to_owned)
            .map_err(|_| ProtoError::Malformed("string is not UTF-8"))
    }
    /// Every byte must have been consumed.
    pub(crate) fn finish(self) -> Result<(), ProtoError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::Malformed("trailing bytes after the message"))
        }
    }
}
