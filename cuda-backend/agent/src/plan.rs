//! Pure planning of data moves: the spans to move, their cut into staging-slot-sized chunks,
//! the containing-span check for `ChunkLoad`, and the validation of ring parameters.

use std::fmt;

/// One converted allocation as a data move sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub id: u64,
    pub device: i32,
    /// The allocation's address in the job: its identity (chunks, the image, the plugin).
    pub addr: u64,
    pub size: u64,
    /// Where the memory is mapped in this process, for every driver call that touches it
    /// (copies, fills, hash kernels, unmaps): `addr` but in a keeper that could not map the
    /// job's memory at the job's address ([`Span::device_ptr`]).
    pub at: u64,
}

impl Span {
    /// The device pointer in this process of the job's address `addr` inside this span.
    pub fn device_ptr(&self, addr: u64) -> u64 {
        self.at + (addr - self.addr)
    }
}

/// One chunk of a span: at most one slot's worth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub alloc_id: u64,
    pub device: i32,
    /// The job's address (what the image and the plugin see).
    pub addr: u64,
    pub len: u64,
    /// The device pointer of `addr` in this process ([`Span::at`]).
    pub at: u64,
}

/// Largest accepted slot.
pub const MAX_SLOT_SIZE: u64 = 1 << 30;
/// Most slots in a ring.
pub const MAX_SLOTS: u32 = 256;
/// Most copy streams per device.
pub const MAX_STREAMS: u32 = 32;
/// Slot sizes are whole pages.
pub const SLOT_ALIGN: u64 = 4096;

/// A `DumpBegin` / `RestoreBegin` ring parameter out of bounds (the value asked for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingError {
    SlotSize(u64),
    Slots(u32),
    Streams(u32),
}

impl fmt::Display for RingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SlotSize(slot_size) => write!(
                f,
                "slot_size {slot_size} must be a non-zero multiple of {SLOT_ALIGN} of at most {MAX_SLOT_SIZE}"
            ),
            Self::Slots(slots) => write!(f, "slots {slots} must be between 1 and {MAX_SLOTS}"),
            Self::Streams(streams) => {
                write!(f, "streams {streams} must be between 1 and {MAX_STREAMS}")
            }
        }
    }
}

impl std::error::Error for RingError {}

/// Checks `DumpBegin` / `RestoreBegin` ring parameters.
pub fn validate_ring(slot_size: u64, slots: u32, streams: u32) -> Result<(), RingError> {
    if slot_size == 0 || !slot_size.is_multiple_of(SLOT_ALIGN) || slot_size > MAX_SLOT_SIZE {
        return Err(RingError::SlotSize(slot_size));
    }
    if slots == 0 || slots > MAX_SLOTS {
        return Err(RingError::Slots(slots));
    }
    if streams == 0 || streams > MAX_STREAMS {
        return Err(RingError::Streams(streams));
    }
    Ok(())
}

/// Spans (sorted here by address) cut into chunks of at most `slot_size` bytes, in address order.
pub fn chunks(spans: &[Span], slot_size: u64) -> Vec<Chunk> {
    let mut sorted: Vec<&Span> = spans.iter().collect();
    sorted.sort_by_key(|s| s.addr);
    let mut out = Vec::new();
    if slot_size == 0 {
        return out;
    }
    for s in sorted {
        let mut off = 0;
        while off < s.size {
            let len = slot_size.min(s.size - off);
            out.push(Chunk {
                alloc_id: s.id,
                device: s.device,
                addr: s.addr + off,
                len,
                at: s.at + off,
            });
            off += len;
        }
    }
    out
}

/// The span (from a list sorted by address) containing `[addr, addr+len)` entirely.
pub fn containing(sorted: &[Span], addr: u64, len: u64) -> Option<&Span> {
    let end = addr.checked_add(len)?;
    let i = sorted.partition_point(|s| s.addr <= addr).checked_sub(1)?;
    let s = &sorted[i];
    (end <= s.addr.checked_add(s.size)?).then_some(s)
}

/// Why a `ChunkLoad` is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkLoadError {
    /// The slot is not one of the ring's `slots`.
    Slot { slot: u32, slots: u32 },
    /// The length is zero or larger than a slot.
    Length { len: u64, slot_size: u64 },
    /// `[addr, addr+len)` does not lie inside one converted allocation.
    Outside { addr: u64, len: u64 },
}

impl fmt::Display for ChunkLoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Slot { slot, slots } => write!(f, "slot {slot} out of range (ring has {slots})"),
            Self::Length { len, slot_size } => write!(
                f,
                "length {len} must be between 1 and the slot size {slot_size}"
            ),
            Self::Outside { addr, len } => write!(
                f,
                "[{addr:#x}, +{len}) is not inside one converted allocation"
            ),
        }
    }
}

impl std::error::Error for ChunkLoadError {}

/// A `ChunkLoad` against the ring and the spans: the slot exists, the length fits a slot and
/// is non-zero, and the destination lies inside one span.
pub fn check_chunk_load(
    sorted: &[Span],
    slot: u32,
    addr: u64,
    len: u64,
    slots: u32,
    slot_size: u64,
) -> Result<&Span, ChunkLoadError> {
    if slot >= slots {
        return Err(ChunkLoadError::Slot { slot, slots });
    }
    if len == 0 || len > slot_size {
        return Err(ChunkLoadError::Length { len, slot_size });
    }
    containing(sorted, addr, len).ok_or(ChunkLoadError::Outside { addr, len })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(id: u64, addr: u64, size: u64) -> Span {
        Span {
            id,
            device: (id % 2) as i32,
            addr,
            size,
            at: addr,
        }
    }

    #[test]
    fn ring_validation() {
        assert!(validate_ring(64 << 20, 16, 4).is_ok());
        assert!(validate_ring(4096, 1, 1).is_ok());
        assert!(validate_ring(1 << 30, 256, 32).is_ok());
        assert!(validate_ring(0, 16, 4).is_err());
        assert!(validate_ring(4095, 16, 4).is_err());
        assert!(validate_ring((1 << 30) + 4096, 16, 4).is_err());
        assert!(validate_ring(4096, 0, 4).is_err());
        assert!(validate_ring(4096, 257, 4).is_err());
        assert!(validate_ring(4096, 1, 0).is_err());
        assert!(validate_ring(4096, 1, 33).is_err());
    }

    #[test]
    fn chunking_in_address_order() {
        let spans = [
            span(2, 0x9000_0000, 5 << 20),
            span(1, 0x1000_0000, 2 << 20),
            span(3, 0xa000_0000, 0),
        ];
        let c = chunks(&spans, 2 << 20);
        let got: Vec<(u64, u64, u64)> = c.iter().map(|c| (c.alloc_id, c.addr, c.len)).collect();
        assert_eq!(
            got,
            vec![
                (1, 0x1000_0000, 2 << 20),
                (2, 0x9000_0000, 2 << 20),
                (2, 0x9020_0000, 2 << 20),
                (2, 0x9040_0000, 1 << 20),
            ]
        );
        assert_eq!(c[1].device, 0);
        assert_eq!(c.iter().map(|c| c.len).sum::<u64>(), 7 << 20);
        assert!(chunks(&spans, 0).is_empty());
        assert!(chunks(&[], 4096).is_empty());
    }

    #[test]
    fn chunks_of_a_span_mapped_elsewhere_keep_the_job_s_addresses() {
        let s = Span {
            at: 0x7f00_0000_0000,
            ..span(4, 0x7fc4_dba0_0000, 3 << 20)
        };
        let c = chunks(&[s], 2 << 20);
        let got: Vec<(u64, u64, u64)> = c.iter().map(|c| (c.addr, c.at, c.len)).collect();
        assert_eq!(
            got,
            vec![
                (0x7fc4_dba0_0000, 0x7f00_0000_0000, 2 << 20),
                (0x7fc4_dbc0_0000, 0x7f00_0020_0000, 1 << 20),
            ]
        );
        assert_eq!(s.device_ptr(0x7fc4_dba0_1000), 0x7f00_0000_1000);
    }

    #[test]
    fn chunk_load_checks() {
        let sorted = [span(1, 0x1000_0000, 2 << 20), span(2, 0x2000_0000, 4 << 20)];
        let ok = check_chunk_load(&sorted, 0, 0x2000_0000 + 4096, 4096, 4, 1 << 20).unwrap();
        assert_eq!(ok.id, 2);
        assert_eq!(
            check_chunk_load(&sorted, 3, 0x1000_0000, 1 << 20, 4, 1 << 20)
                .unwrap()
                .id,
            1
        );
        assert!(
            check_chunk_load(&sorted, 4, 0x1000_0000, 1, 4, 1 << 20).is_err(),
            "slot"
        );
        assert!(
            check_chunk_load(&sorted, 0, 0x1000_0000, 0, 4, 1 << 20).is_err(),
            "empty"
        );
        assert!(check_chunk_load(&sorted, 0, 0x1000_0000, (1 << 20) + 1, 4, 2 << 20).is_ok());
        assert!(
            check_chunk_load(&sorted, 0, 0x1000_0000, (1 << 20) + 1, 4, 1 << 20).is_err(),
            "len"
        );
        assert!(
            check_chunk_load(&sorted, 0, 0x1000_0000 + (2 << 20) - 1, 2, 4, 1 << 20).is_err(),
            "past end"
        );
        assert!(
            check_chunk_load(&sorted, 0, 0x0fff_f000, 8192, 4, 1 << 20).is_err(),
            "before"
        );
        assert!(
            check_chunk_load(&sorted, 0, 0x1800_0000, 1, 4, 1 << 20).is_err(),
            "gap"
        );
        assert!(
            check_chunk_load(&sorted, 0, u64::MAX, 2, 4, 1 << 20).is_err(),
            "overflow"
        );
        assert!(
            check_chunk_load(&[], 0, 0x1000, 1, 4, 1 << 20).is_err(),
            "nothing"
        );
    }
}
