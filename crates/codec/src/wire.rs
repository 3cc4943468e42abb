//! Primitive readers and writers. Every read checks the remaining length first, so
//! truncated input is an error and never a panic; strings are zero-copy slices.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::CodecError;
use crate::strings::{truncate_str, ShortStr};
use crate::table::FieldTable;

#[inline]
pub(crate) fn need(buf: &Bytes, n: usize) -> Result<(), CodecError> {
    if buf.remaining() < n {
        Err(CodecError::Truncated)
    } else {
        Ok(())
    }
}

#[inline]
pub(crate) fn get_u8(buf: &mut Bytes) -> Result<u8, CodecError> {
    need(buf, 1)?;
    Ok(buf.get_u8())
}

#[inline]
pub(crate) fn get_u16(buf: &mut Bytes) -> Result<u16, CodecError> {
    need(buf, 2)?;
    Ok(buf.get_u16())
}

#[inline]
pub(crate) fn get_u32(buf: &mut Bytes) -> Result<u32, CodecError> {
    need(buf, 4)?;
    Ok(buf.get_u32())
}

#[inline]
pub(crate) fn get_u64(buf: &mut Bytes) -> Result<u64, CodecError> {
    need(buf, 8)?;
    Ok(buf.get_u64())
}

/// Splits off `n` bytes (zero copy), checking the length first.
#[inline]
pub(crate) fn take(buf: &mut Bytes, n: usize) -> Result<Bytes, CodecError> {
    need(buf, n)?;
    Ok(buf.split_to(n))
}

#[inline]
pub(crate) fn get_shortstr(buf: &mut Bytes) -> Result<ShortStr, CodecError> {
    let len = get_u8(buf)? as usize;
    let raw = take(buf, len)?;
    ShortStr::try_from_bytes(raw)
}

#[inline]
pub(crate) fn get_longstr(buf: &mut Bytes) -> Result<Bytes, CodecError> {
    let len = get_u32(buf)? as usize;
    take(buf, len)
}

/// Writes a shortstr from a `&str`, cutting it to 255 bytes on a char boundary.
#[inline]
pub(crate) fn put_shortstr(out: &mut BytesMut, s: &str) {
    let s = truncate_str(s, ShortStr::MAX_LEN);
    out.put_u8(s.len() as u8);
    out.put_slice(s.as_bytes());
}

/// Writes a longstr. Lengths above `u32::MAX` cannot be represented and are cut.
#[inline]
pub(crate) fn put_longstr(out: &mut BytesMut, s: &[u8]) {
    let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
    out.put_u32(len);
    out.put_slice(s.get(..len as usize).unwrap_or(s));
}

/// Overwrites the big-endian u32 at `pos` (a placeholder written earlier).
#[inline]
pub(crate) fn patch_u32(out: &mut BytesMut, pos: usize, value: u32) {
    if let Some(slot) = out.get_mut(pos..pos + 4) {
        slot.copy_from_slice(&value.to_be_bytes());
    }
}

/// Reads method arguments, tracking bit packing: consecutive `bit` fields share one
/// octet (least significant bit first); any other field ends the run.
pub(crate) struct Reader {
    buf: Bytes,
    bits: u8,
    /// Next bit position within `bits`; 8 means no octet is open.
    bit_pos: u8,
}

impl Reader {
    pub(crate) fn new(buf: Bytes) -> Self {
        Reader {
            buf,
            bits: 0,
            bit_pos: 8,
        }
    }

    #[inline]
    fn end_bits(&mut self) {
        self.bit_pos = 8;
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.remaining()
    }

    #[inline]
    pub(crate) fn octet(&mut self) -> Result<u8, CodecError> {
        self.end_bits();
        get_u8(&mut self.buf)
    }
    #[inline]
    pub(crate) fn short(&mut self) -> Result<u16, CodecError> {
        self.end_bits();
        get_u16(&mut self.buf)
    }
    #[inline]
    pub(crate) fn long(&mut self) -> Result<u32, CodecError> {
        self.end_bits();
        get_u32(&mut self.buf)
    }
    #[inline]
    pub(crate) fn longlong(&mut self) -> Result<u64, CodecError> {
        self.end_bits();
        get_u64(&mut self.buf)
    }
    #[inline]
    pub(crate) fn shortstr(&mut self) -> Result<ShortStr, CodecError> {
        self.end_bits();
        get_shortstr(&mut self.buf)
    }
    #[inline]
    pub(crate) fn longstr(&mut self) -> Result<Bytes, CodecError> {
        self.end_bits();
        get_longstr(&mut self.buf)
    }
    #[inline]
    pub(crate) fn table(&mut self) -> Result<FieldTable, CodecError> {
        self.end_bits();
        FieldTable::decode(&mut self.buf)
    }
    #[inline]
    pub(crate) fn bit(&mut self) -> Result<bool, CodecError> {
        if self.bit_pos >= 8 {
            self.bits = get_u8(&mut self.buf)?;
            self.bit_pos = 0;
        }
        let v = (self.bits >> self.bit_pos) & 1 == 1;
        self.bit_pos += 1;
        Ok(v)
    }
}

/// Writes method arguments with the same bit packing as [`Reader`].
pub(crate) struct Writer<'a> {
    out: &'a mut BytesMut,
    /// Index of the open bits octet in `out`, if any.
    bits_at: usize,
    bit_pos: u8,
}

impl<'a> Writer<'a> {
    pub(crate) fn new(out: &'a mut BytesMut) -> Self {
        Writer {
            out,
            bits_at: 0,
            bit_pos: 8,
        }
    }

    #[inline]
    fn end_bits(&mut self) {
        self.bit_pos = 8;
    }

    #[inline]
    pub(crate) fn octet(&mut self, v: &u8) {
        self.end_bits();
        self.out.put_u8(*v);
    }
    #[inline]
    pub(crate) fn short(&mut self, v: &u16) {
        self.end_bits();
        self.out.put_u16(*v);
    }
    #[inline]
    pub(crate) fn long(&mut self, v: &u32) {
        self.end_bits();
        self.out.put_u32(*v);
    }
    #[inline]
    pub(crate) fn longlong(&mut self, v: &u64) {
        self.end_bits();
        self.out.put_u64(*v);
    }
    #[inline]
    pub(crate) fn shortstr(&mut self, v: &ShortStr) {
        self.end_bits();
        put_shortstr(self.out, v.as_str());
    }
    #[inline]
    pub(crate) fn longstr(&mut self, v: &Bytes) {
        self.end_bits();
        put_longstr(self.out, v);
    }
    #[inline]
    pub(crate) fn table(&mut self, v: &FieldTable) {
        self.end_bits();
        v.encode(self.out);
    }
    #[inline]
    pub(crate) fn bit(&mut self, v: &bool) {
        if self.bit_pos >= 8 {
            self.bits_at = self.out.len();
            self.out.put_u8(0);
            self.bit_pos = 0;
        }
        if *v {
            if let Some(b) = self.out.get_mut(self.bits_at) {
                *b |= 1 << self.bit_pos;
            }
        }
        self.bit_pos += 1;
    }
}
