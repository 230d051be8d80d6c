//! Device mappings of a KFD process: which buffer object a CPU mapping of `/dev/kfd` or of a
//! render node shows, and where it must be mapped after a RESTORE.
//!
//! Facts of the kernel interface this relies on (`linux/kfd_ioctl.h`, the kernel's KFD and
//! amdgpu drivers):
//! - every CPU mapping of KFD memory is a mapping of a file at an mmap offset the kernel chose:
//!   VRAM and GTT buffer objects through the render node the process bound to the GPU (the
//!   DRM "fake offset" of the BO), doorbell and MMIO-remap pages through `/dev/kfd` (an offset
//!   whose top bits name the kind, see [`describe_kfd_offset`]);
//! - CHECKPOINT reports each BO's mmap offset at dump in `offset`; RESTORE re-creates it and
//!   reports the new one in `restored_offset` (the kernel picks it, it generally differs);
//! - a mapping may cover part of a BO: the distance from the BO's offset stays the same;
//! - DRM allows a BO's mapping only through the open file (the `drm_file`) the BO was made
//!   with, so a restored mapping of a render node must be made through the file RESTORE was
//!   given for that GPU; `/dev/kfd` mappings act on the calling process, through any of its KFD
//!   files.
//!
//! Everything here is plain data and is unit-tested; the plugin's `amd` module drives it from
//! CRIU's `HANDLE_DEVICE_VMA`/`UPDATE_VMA_MAP` hooks. Never run against a real KFD.

use super::sys::{
    KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL, KFD_IOC_ALLOC_MEM_FLAGS_GTT,
    KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP, KFD_IOC_ALLOC_MEM_FLAGS_VRAM,
};

/// Which device file a mapping is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmaNode {
    Kfd,
    Render { minor: u32 },
}

/// One mapping line of `/proc/<pid>/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapsLine {
    pub start: u64,
    pub end: u64,
    /// File offset, bytes.
    pub offset: u64,
    pub shared: bool,
    /// The mapped file's path (empty for anonymous memory).
    pub path: String,
}

/// Parses `/proc/<pid>/maps`. Lines that do not parse are skipped.
pub fn parse_maps(text: &str) -> Vec<MapsLine> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.splitn(6, ' ');
            let (range, perms, offset) = (w.next()?, w.next()?, w.next()?);
            let (_dev, _ino) = (w.next()?, w.next()?);
            let path = w.next().unwrap_or("").trim_start().to_owned();
            let (s, e) = range.split_once('-')?;
            Some(MapsLine {
                start: u64::from_str_radix(s, 16).ok()?,
                end: u64::from_str_radix(e, 16).ok()?,
                offset: u64::from_str_radix(offset, 16).ok()?,
                shared: perms.as_bytes().get(3) == Some(&b's'),
                path,
            })
        })
        .collect()
}

/// What [`identify`] needs of a BO: its bucket's offset, size, flags and GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoView {
    pub offset: u64,
    pub size: u64,
    pub alloc_flags: u32,
    pub gpu_id: u32,
}

/// The file a BO of these flags is mapped through: render node (VRAM, GTT) or `/dev/kfd`
/// (doorbell, MMIO remap); `None` for BOs that are not device-mapped (userptr memory is the
/// process's own pages).
pub fn mapped_through_kfd(alloc_flags: u32) -> Option<bool> {
    if alloc_flags & (KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL | KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP) != 0 {
        Some(true)
    } else if alloc_flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT) != 0 {
        Some(false)
    } else {
        None
    }
}

/// A short name for a BO's kind, for logs.
pub fn bo_kind(alloc_flags: u32) -> &'static str {
    if alloc_flags & KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL != 0 {
        "doorbell"
    } else if alloc_flags & KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP != 0 {
        "MMIO remap"
    } else if alloc_flags & KFD_IOC_ALLOC_MEM_FLAGS_VRAM != 0 {
        "VRAM"
    } else if alloc_flags & KFD_IOC_ALLOC_MEM_FLAGS_GTT != 0 {
        "GTT"
    } else {
        "other"
    }
}

/// The kernel's encoding of a `/dev/kfd` mmap offset (bytes): bits 63..62 the kind (3 doorbell,
/// 2 events, 1 reserved memory, 0 MMIO), bits 61..46 the gpu_id. For logs: an offset of the
/// events page (used on APUs) matches no BO and is refused by name.
pub fn describe_kfd_offset(offset: u64) -> String {
    let gpu_id = (offset >> 46) & 0xffff;
    let kind = match offset >> 62 {
        3 => "doorbell",
        2 => "events page",
        1 => "reserved memory",
        _ => "MMIO",
    };
    if gpu_id != 0 {
        format!("{kind} of gpu_id {gpu_id}")
    } else {
        format!("{kind} (no gpu_id)")
    }
}

/// Why a device mapping is no BO gpusnap can map again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VmaError {
    #[error("the mapping {start:#x}-{end:#x} is empty")]
    Empty { start: u64, end: u64 },
    #[error("render node minor {minor} is not the render node of a GPU this process uses")]
    NotOurGpu { minor: u32 },
    /// Nothing the process mapped through `/dev/kfd` (doorbells, MMIO remap) lies there; the
    /// offset's kind is named ([`describe_kfd_offset`]).
    #[error(
        "no doorbell or MMIO-remap buffer object of the process lies at /dev/kfd offset {offset:#x} ({}, {len:#x} bytes)",
        describe_kfd_offset(*offset)
    )]
    NoKfdBo { offset: u64, len: u64 },
    #[error(
        "no VRAM or GTT buffer object of the process lies at offset {offset:#x} ({len:#x} bytes) of render node {minor}"
    )]
    NoRenderBo { offset: u64, len: u64, minor: u32 },
}

/// The BO (index into `bos`) that the mapping `[start, end)` of `node` at `offset` shows.
/// `gpu_of_minor` gives the user gpu_id of a render node's minor (`None`: not a GPU of the
/// process). Errors say why the mapping is no BO gpusnap can map again.
pub fn identify(
    node: VmaNode,
    start: u64,
    end: u64,
    offset: u64,
    bos: &[BoView],
    gpu_of_minor: impl Fn(u32) -> Option<u32>,
) -> Result<usize, VmaError> {
    let len = end
        .checked_sub(start)
        .filter(|l| *l > 0)
        .ok_or(VmaError::Empty { start, end })?;
    let through_kfd = matches!(node, VmaNode::Kfd);
    let gpu = match node {
        VmaNode::Kfd => None,
        VmaNode::Render { minor } => {
            Some(gpu_of_minor(minor).ok_or(VmaError::NotOurGpu { minor })?)
        }
    };
    let hit = bos.iter().position(|b| {
        mapped_through_kfd(b.alloc_flags) == Some(through_kfd)
            && gpu.is_none_or(|g| g == b.gpu_id)
            && offset >= b.offset
            && (offset - b.offset)
                .checked_add(len)
                .is_some_and(|e| e <= b.size)
    });
    hit.ok_or(match node {
        VmaNode::Kfd => VmaError::NoKfdBo { offset, len },
        VmaNode::Render { minor } => VmaError::NoRenderBo { offset, len, minor },
    })
}

/// The offset to map at after RESTORE: the BO's restored offset plus the mapping's distance
/// from the BO's offset at dump. `None` when that does not fit (a damaged image).
pub fn translate(old_offset: u64, bo_old: u64, bo_restored: u64) -> Option<u64> {
    bo_restored.checked_add(old_offset.checked_sub(bo_old)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VRAM: u32 = KFD_IOC_ALLOC_MEM_FLAGS_VRAM;
    const DOORBELL: u32 = KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL;

    fn bos() -> Vec<BoView> {
        vec![
            BoView {
                offset: 0x10_0000,
                size: 0x20_0000,
                alloc_flags: VRAM,
                gpu_id: 7,
            },
            BoView {
                offset: (3 << 62) | (7 << 46),
                size: 0x2000,
                alloc_flags: DOORBELL,
                gpu_id: 7,
            },
            BoView {
                offset: 0x10_0000,
                size: 0x1000,
                alloc_flags: VRAM,
                gpu_id: 8,
            },
            BoView {
                offset: 0x90_0000,
                size: 0x1000,
                alloc_flags: KFD_IOC_ALLOC_MEM_FLAGS_GTT,
                gpu_id: 7,
            },
        ]
    }

    fn minor(m: u32) -> Option<u32> {
        match m {
            128 => Some(7),
            129 => Some(8),
            _ => None,
        }
    }

    #[test]
    fn mappings_are_matched_to_the_bo_they_show() {
        let b = bos();
        let r = |m| VmaNode::Render { minor: m };
        // A whole BO, part of a BO, the other GPU's BO at the same offset.
        assert_eq!(
            identify(r(128), 0x1000, 0x201000, 0x10_0000, &b, minor),
            Ok(0)
        );
        assert_eq!(
            identify(r(128), 0x5000, 0x6000, 0x2f_f000, &b, minor),
            Ok(0)
        );
        assert_eq!(
            identify(r(129), 0x1000, 0x2000, 0x10_0000, &b, minor),
            Ok(2)
        );
        assert_eq!(
            identify(r(128), 0x1000, 0x2000, 0x90_0000, &b, minor),
            Ok(3)
        );
        // Doorbells through /dev/kfd only.
        let db = (3u64 << 62) | (7 << 46);
        assert_eq!(identify(VmaNode::Kfd, 0x1000, 0x3000, db, &b, minor), Ok(1));
        assert!(identify(r(128), 0x1000, 0x3000, db, &b, minor).is_err());
        // A VRAM BO is not mapped through /dev/kfd.
        let e = identify(VmaNode::Kfd, 0x1000, 0x2000, 0x10_0000, &b, minor).unwrap_err();
        assert!(e.to_string().contains("no doorbell or MMIO-remap"), "{e}");
        // Past the end of a BO, before it, an unknown render node, an empty mapping.
        assert!(identify(r(128), 0x1000, 0x3000, 0x2f_f000, &b, minor).is_err());
        assert!(identify(r(128), 0x1000, 0x2000, 0x0f_f000, &b, minor).is_err());
        let e = identify(r(130), 0x1000, 0x2000, 0x10_0000, &b, minor).unwrap_err();
        assert!(e.to_string().contains("minor 130"), "{e}");
        assert!(identify(r(128), 0x1000, 0x1000, 0x10_0000, &b, minor).is_err());
        // The events page of an APU is no BO: refused, and named.
        let e = identify(VmaNode::Kfd, 0x1000, 0x2000, 2 << 62, &b, minor).unwrap_err();
        assert!(e.to_string().contains("events page"), "{e}");
    }

    #[test]
    fn offsets_translate_with_their_distance_from_the_bo() {
        assert_eq!(translate(0x10_0000, 0x10_0000, 0x55_0000), Some(0x55_0000));
        assert_eq!(translate(0x10_3000, 0x10_0000, 0x55_0000), Some(0x55_3000));
        assert_eq!(translate(0x0f_f000, 0x10_0000, 0x55_0000), None);
        assert_eq!(translate(0x2000, 0x1000, u64::MAX), None);
    }

    #[test]
    fn kfd_offsets_are_described() {
        assert_eq!(
            describe_kfd_offset((3 << 62) | (4660 << 46)),
            "doorbell of gpu_id 4660"
        );
        assert_eq!(describe_kfd_offset(2 << 62), "events page (no gpu_id)");
        assert_eq!(
            describe_kfd_offset(1 << 62 | 5 << 46),
            "reserved memory of gpu_id 5"
        );
        assert_eq!(describe_kfd_offset(9 << 46), "MMIO of gpu_id 9");
        assert_eq!(bo_kind(DOORBELL), "doorbell");
        assert_eq!(bo_kind(VRAM), "VRAM");
        assert_eq!(
            mapped_through_kfd(KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP),
            Some(true)
        );
        assert_eq!(mapped_through_kfd(0), None);
    }

    #[test]
    fn maps_lines() {
        let text = "7f0000000000-7f0000180000 rw-s 00100000 00:05 12 /dev/dri/renderD128\n\
                    7f0000200000-7f0000202000 rw-s c001234000000000 00:05 11       /dev/kfd\n\
                    55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0          [heap]\n\
                    7ffd0000-7ffd1000 r--p 00000000 00:00 0\n\
                    garbage\n";
        let m = parse_maps(text);
        assert_eq!(m.len(), 4);
        assert_eq!(
            m[0],
            MapsLine {
                start: 0x7f00_0000_0000,
                end: 0x7f00_0018_0000,
                offset: 0x10_0000,
                shared: true,
                path: "/dev/dri/renderD128".into()
            }
        );
        assert_eq!(m[1].offset, 0xc001_2340_0000_0000);
        assert_eq!(m[1].path, "/dev/kfd");
        assert!(!m[2].shared);
        assert_eq!(m[3].path, "");
    }
}
