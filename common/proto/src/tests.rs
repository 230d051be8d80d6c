//! Round trips, rejection of every truncation and of garbage, and sockets end to end.

use std::io::{Seek, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use crate::pid::{HostPid, NsPid, NsTid};
use crate::*;

/// The requests both servers take, as in the two lists below.
fn all_common_requests() -> Vec<CommonRequest> {
    vec![
        CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        },
        CommonRequest::DumpBegin {
            slot_size: 64 << 20,
            slots: 16,
            streams: 4,
        },
        CommonRequest::SlotFree { slot: 15 },
        CommonRequest::Release,
        CommonRequest::Abort,
        CommonRequest::RestoreBegin {
            slot_size: u64::MAX,
            slots: u32::MAX,
            streams: 0,
        },
        CommonRequest::ChunkLoad {
            slot: 3,
            addr: 0x7f00_0000_0000,
            len: 4096,
            device_hash: Some(u64::MAX),
        },
        CommonRequest::ChunkLoad {
            slot: 0,
            addr: 1,
            len: 2,
            device_hash: None,
        },
        CommonRequest::ChunkZero {
            addr: 0x7f00_0020_0000,
            len: 32 << 20,
            device_hash: Some(0),
        },
        CommonRequest::ChunkZero {
            addr: 0,
            len: 0,
            device_hash: None,
        },
        CommonRequest::RestoreDataDone,
        CommonRequest::LendBegin,
        CommonRequest::KnownChunk {
            addr: 0x7f00_0000_0000,
            len: 32 << 20,
            device_hash: u64::MAX,
        },
    ]
}

/// The job's agent's own requests (no keeper takes them).
fn agent_only_requests() -> Vec<AgentRequest> {
    vec![
        AgentRequest::ListAllocations,
        AgentRequest::PreCopyBegin {
            slot_size: 32 << 20,
            slots: 8,
            streams: 2,
        },
        AgentRequest::Take {
            id: 4,
            addr: 0x7000_0040_0000,
            size: 4 << 20,
            rdma_capable: true,
        },
        AgentRequest::TakeEnd,
        AgentRequest::ListSharing,
        AgentRequest::ShareFds,
        AgentRequest::Reimport {
            exporter_pid: NsPid(77),
            id: 9,
        },
        AgentRequest::ShareableSource {
            import: 2,
            exporter_pid: NsPid(77),
            id: 9,
            key: [0xc3; 16],
        },
        AgentRequest::Reclaim,
    ]
}

/// The keeper's own requests (no job's agent takes them).
fn keeper_only_requests() -> Vec<KeeperRequest> {
    vec![
        KeeperRequest::Expect {
            id: 4,
            gpu: [0xa5; 16],
            addr: 0x7000_0040_0000,
            size: 4 << 20,
            rdma_capable: false,
        },
        KeeperRequest::Expect {
            id: 5,
            gpu: [0x5a; 16],
            addr: 0x7000_0080_0000,
            size: 2 << 20,
            rdma_capable: true,
        },
        KeeperRequest::Adopt {
            id: 3,
            device: 1,
            addr: 0x7000_0020_0000,
            size: 2 << 20,
        },
        KeeperRequest::SnapshotRoom {
            device: 1,
            share_percent: 50,
        },
        KeeperRequest::SnapshotIds { ids: vec![7] },
        KeeperRequest::SnapshotIds {
            ids: (1..=MAX_SNAPSHOT_IDS as u64).map(|i| i << 40).collect(),
        },
        KeeperRequest::Snapshot {
            share_percent: 50,
            count: 61,
        },
    ]
}

/// Every request a job's agent takes.
fn all_agent_requests() -> Vec<AgentRequest> {
    all_common_requests()
        .into_iter()
        .map(AgentRequest::from)
        .chain(agent_only_requests())
        .collect()
}

/// Every request a keeper takes.
fn all_keeper_requests() -> Vec<KeeperRequest> {
    all_common_requests()
        .into_iter()
        .map(KeeperRequest::from)
        .chain(keeper_only_requests())
        .collect()
}

fn all_replies() -> Vec<Reply> {
    vec![
        Reply::Hello {
            version: PROTOCOL_VERSION,
            pid: NsPid(1234),
            tid: NsTid(-5),
            allocations: 7,
            converted_bytes: 1 << 40,
            devices: 2,
            released: true,
            hazards: 5,
            kept: 3,
        },
        Reply::Allocation {
            id: 9,
            device: 1,
            addr: 0x7000_0020_0000,
            size: 2 << 20,
            kind: AllocKind::Converted,
            rdma_capable: false,
        },
        Reply::Allocation {
            id: 10,
            device: 0,
            addr: 1,
            size: 2,
            kind: AllocKind::AppVmm,
            rdma_capable: false,
        },
        Reply::Allocation {
            id: 11,
            device: 1,
            addr: 0x7000_0040_0000,
            size: 2 << 20,
            kind: AllocKind::ConvertedNoExport,
            rdma_capable: false,
        },
        Reply::Allocation {
            id: 12,
            device: 0,
            addr: 0x7000_0060_0000,
            size: 2 << 20,
            kind: AllocKind::AppHandleMapping,
            rdma_capable: false,
        },
        Reply::Allocation {
            id: 13,
            device: 0,
            addr: 0x7000_0080_0000,
            size: 2 << 20,
            kind: AllocKind::AppHandleLendable,
            rdma_capable: true,
        },
        Reply::Allocation {
            id: 14,
            device: 0,
            addr: 0x7000_00a0_0000,
            size: 2 << 20,
            kind: AllocKind::AppHandleImported,
            rdma_capable: false,
        },
        Reply::AllocationsEnd { count: 6 },
        Reply::Ready,
        Reply::ChunkReady {
            slot: 1,
            alloc_id: 9,
            addr: 0x7000_0020_0000,
            len: 1 << 20,
            device_hash: Some(0x1234_5678_9abc_def0),
        },
        Reply::ChunkReady {
            slot: 0,
            alloc_id: 0,
            addr: 0,
            len: 0,
            device_hash: None,
        },
        Reply::ChunkUnchanged {
            alloc_id: 9,
            addr: 0x7000_0060_0000,
            len: 1 << 21,
            device_hash: 8,
        },
        Reply::ChunkZero {
            alloc_id: 9,
            addr: 0x7000_0040_0000,
            len: 1 << 21,
            device_hash: 7,
        },
        Reply::DumpDataDone {
            chunks: 3,
            bytes: 3 << 20,
            micros: 1000,
        },
        Reply::Released {
            allocations: 1,
            bytes: 2 << 20,
            micros: 5,
        },
        Reply::SlotFree { slot: 255 },
        Reply::Restored {
            bytes: 42,
            micros: 43,
            verified: 44,
        },
        Reply::Lent {
            id: 9,
            device: 1,
            addr: 0x7000_0020_0000,
            size: 2 << 20,
            rdma_capable: true,
        },
        Reply::LentEnd {
            count: 1,
            bytes: 2 << 20,
        },
        Reply::Adopted { id: 9 },
        Reply::SnapshotRoom {
            device: 1,
            free: 80 << 30,
            allowed: 40 << 30,
        },
        Reply::Snapshotted {
            count: 3,
            bytes: 6 << 20,
        },
        Reply::SnapshotRefused {
            needed: 1 << 30,
            allowed: 1 << 29,
            device: 1,
        },
        Reply::Expected { id: 9, device: 2 },
        Reply::Taken { id: 9 },
        Reply::TakenAll {
            allocations: 1,
            bytes: 2 << 20,
            micros: 5,
        },
        Reply::Detached { pid: HostPid(4242) },
        Reply::Shared(Share {
            import: true,
            pid: NsPid(77),
            id: 9,
            addr: 0x7000_0020_0000,
            size: 2 << 20,
            mapped: false,
            key: [0x5e; 16],
            kind: ShareKind::Ipc,
        }),
        Reply::Shared(Share {
            import: true,
            pid: NsPid(0),
            id: 2,
            addr: 0x7000_0080_0000,
            size: 2 << 20,
            mapped: true,
            key: [0; 16],
            kind: ShareKind::Shareable {
                agent_fd: ForeignFd::new(41),
                app_fd: ForeignFd::new(7),
                own_fd: ForeignFd::new(43),
            },
        }),
        Reply::Shared(Share {
            import: false,
            pid: NsPid(0),
            id: 3,
            addr: 0x7000_0040_0000,
            size: 4 << 20,
            mapped: true,
            key: [0x5e; 16],
            kind: ShareKind::Ipc,
        }),
        // A shareable export whose program closed its descriptor: none on the wire is -1.
        Reply::Shared(Share {
            import: false,
            pid: NsPid(0),
            id: 4,
            addr: 0x7000_00c0_0000,
            size: 2 << 20,
            mapped: true,
            key: [0x5e; 16],
            kind: ShareKind::Shareable {
                agent_fd: ForeignFd::new(40),
                app_fd: None,
                own_fd: None,
            },
        }),
        Reply::SharedEnd { count: 3 },
        Reply::ShareFd {
            id: 3,
            addr: 0x7000_0040_0000,
            size: 4 << 20,
            key: [0x5e; 16],
        },
        Reply::ShareFdEnd { count: 1 },
        Reply::Reimported {
            addr: 0x7000_0020_0000,
        },
        Reply::SourceNoted,
        Reply::Reclaimed {
            allocations: 1,
            bytes: 2 << 20,
            micros: 3,
        },
        Reply::Aborted,
        Reply::Error {
            code: ErrorCode::Cuda,
            message: "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY".into(),
        },
        Reply::Error {
            code: ErrorCode::BadRequest,
            message: String::new(),
        },
        Reply::Error {
            code: ErrorCode::VersionMismatch,
            message: "é".repeat(150),
        },
    ]
}

fn enc_req<R: Request>(r: &R) -> Vec<u8> {
    let mut buf = [0u8; MAX_MESSAGE];
    let n = r.encode(&mut buf);
    buf[..n].to_vec()
}

fn enc_rep(r: &Reply) -> Vec<u8> {
    let mut buf = [0u8; MAX_MESSAGE];
    let n = r.encode(&mut buf);
    buf[..n].to_vec()
}

fn requests_round_trip<R: Request>(all: Vec<R>) {
    for r in all {
        let b = enc_req(&r);
        assert_eq!(&b[..4], b"GSNP");
        assert_eq!(R::decode(&b).unwrap(), r);
    }
}

#[test]
fn every_request_round_trips() {
    requests_round_trip(all_agent_requests());
    requests_round_trip(all_keeper_requests());
}

#[test]
fn every_reply_round_trips() {
    for r in all_replies() {
        let b = enc_rep(&r);
        // The longest test string (150 two-byte characters) is under the cut: identical.
        assert_eq!(Reply::decode(&b).unwrap(), r);
    }
}

#[test]
fn error_message_is_truncated_on_a_char_boundary() {
    let long = "ü".repeat(300); // 600 bytes
    let b = enc_rep(&Reply::Error {
        code: ErrorCode::Staging,
        message: long.clone(),
    });
    assert!(b.len() <= MAX_MESSAGE);
    match Reply::decode(&b).unwrap() {
        Reply::Error { code, message } => {
            assert_eq!(code, ErrorCode::Staging);
            assert_eq!(message.len(), MAX_ERROR_MESSAGE);
            assert!(long.starts_with(&message));
        }
        other => panic!("{other:?}"),
    }
    let odd = format!("x{}", "ü".repeat(300)); // boundary falls inside a character
    let b = enc_rep(&Reply::Error {
        code: ErrorCode::Staging,
        message: odd,
    });
    match Reply::decode(&b).unwrap() {
        Reply::Error { message, .. } => assert_eq!(message.len(), MAX_ERROR_MESSAGE - 1),
        other => panic!("{other:?}"),
    }
}

fn request_truncations_and_extensions_are_rejected<R: Request>(all: Vec<R>) {
    for r in all {
        let b = enc_req(&r);
        for cut in 0..b.len() {
            assert!(R::decode(&b[..cut]).is_err(), "{r:?} cut at {cut}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(
            matches!(R::decode(&longer), Err(ProtoError::Malformed(_))),
            "{r:?}"
        );
    }
}

#[test]
fn every_truncation_and_extension_is_rejected() {
    request_truncations_and_extensions_are_rejected(all_agent_requests());
    request_truncations_and_extensions_are_rejected(all_keeper_requests());
    for r in all_replies() {
        let b = enc_rep(&r);
        for cut in 0..b.len() {
            assert!(Reply::decode(&b[..cut]).is_err(), "{r:?} cut at {cut}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(
            matches!(Reply::decode(&longer), Err(ProtoError::Malformed(_))),
            "{r:?}"
        );
    }
}

fn request_header_errors_are_typed<R: Request>() {
    let release = R::from(CommonRequest::Release);
    let mut b = enc_req(&release);
    b[0] ^= 1;
    assert!(matches!(R::decode(&b), Err(ProtoError::BadMagic)));
    let mut b = enc_req(&release);
    b[4] = 10;
    assert!(matches!(
        R::decode(&b),
        Err(ProtoError::VersionMismatch {
            ours: 9,
            theirs: 10
        })
    ));
    let mut b = enc_req(&release);
    b[6] = 0x77;
    assert!(matches!(
        R::decode(&b),
        Err(ProtoError::UnknownKind(0x0077))
    ));
    // A reply fed to the request decoder and the reverse.
    assert!(matches!(
        R::decode(&enc_rep(&Reply::Ready)),
        Err(ProtoError::UnknownKind(_))
    ));
    assert!(matches!(
        Reply::decode(&enc_req(&R::from(CommonRequest::Abort))),
        Err(ProtoError::UnknownKind(_))
    ));
}

#[test]
fn header_errors_are_typed() {
    request_header_errors_are_typed::<AgentRequest>();
    request_header_errors_are_typed::<KeeperRequest>();
    assert!(matches!(
        Reply::decode(&[0u8; MAX_MESSAGE + 1]),
        Err(ProtoError::TooLong)
    ));
}

/// Refusals name requests by their `Debug` text: a shared request prints as itself in both
/// types, and each type's own ones as a derived `Debug` would.
#[test]
fn requests_print_as_their_variant() {
    for c in all_common_requests() {
        assert_eq!(
            format!("{:?}", AgentRequest::from(c.clone())),
            format!("{c:?}")
        );
        assert_eq!(
            format!("{:?}", KeeperRequest::from(c.clone())),
            format!("{c:?}")
        );
    }
    assert_eq!(format!("{:?}", CommonRequest::Release), "Release");
    assert_eq!(
        format!("{:?}", AgentRequest::ListAllocations),
        "ListAllocations"
    );
    assert_eq!(
        format!(
            "{:?}",
            AgentRequest::Reimport {
                exporter_pid: NsPid(7),
                id: 9
            }
        ),
        "Reimport { exporter_pid: 7, id: 9 }"
    );
    assert_eq!(
        format!(
            "{:?}",
            KeeperRequest::Snapshot {
                share_percent: 50,
                count: 2
            }
        ),
        "Snapshot { share_percent: 50, count: 2 }"
    );
    assert_eq!(
        format!("{:?}", KeeperRequest::SnapshotIds { ids: vec![3, 4] }),
        "SnapshotIds { ids: [3, 4] }"
    );
}

/// A bare header of kind `k`.
fn header_of(k: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_LEN);
    b.extend_from_slice(&MAGIC.to_le_bytes());
    b.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b.extend_from_slice(&k.to_le_bytes());
    b
}

/// The kind a request is sent as.
fn kind_of<R: Request>(r: &R) -> u16 {
    let b = enc_req(r);
    u16::from_le_bytes([b[6], b[7]])
}

#[test]
fn each_server_refuses_the_others_requests() {
    // Whole, valid messages of one server's own requests are an unknown kind to the other.
    for r in agent_only_requests() {
        let k = kind_of(&r);
        assert!(
            matches!(KeeperRequest::decode(&enc_req(&r)), Err(ProtoError::UnknownKind(x)) if x == k),
            "the keeper took {r:?}"
        );
    }
    for r in keeper_only_requests() {
        let k = kind_of(&r);
        assert!(
            matches!(AgentRequest::decode(&enc_req(&r)), Err(ProtoError::UnknownKind(x)) if x == k),
            "the agent took {r:?}"
        );
    }
    // The shared ones are the same bytes to both, and read back as the same request.
    for c in all_common_requests() {
        let b = enc_req(&AgentRequest::from(c.clone()));
        assert_eq!(b, enc_req(&KeeperRequest::from(c.clone())), "{c:?}");
        assert_eq!(
            AgentRequest::decode(&b).unwrap(),
            AgentRequest::Common(c.clone())
        );
        assert_eq!(KeeperRequest::decode(&b).unwrap(), KeeperRequest::Common(c));
    }
    // Every request kind there is (and a few beyond): each decoder finds exactly the other's
    // own kinds unknown, whatever follows the header; the two own sets and the shared one
    // cover every request kind, once.
    let agent_own: Vec<u16> = agent_only_requests().iter().map(kind_of).collect();
    let keeper_own: Vec<u16> = keeper_only_requests().iter().map(kind_of).collect();
    let common: Vec<u16> = all_common_requests()
        .into_iter()
        .map(|c| kind_of(&AgentRequest::from(c)))
        .collect();
    for k in 0x0000..=0x0020u16 {
        let known = |own: &[u16]| own.contains(&k) || common.contains(&k);
        let unknown =
            |r: Result<(), ProtoError>| matches!(r, Err(ProtoError::UnknownKind(x)) if x == k);
        let b = header_of(k);
        assert_eq!(
            unknown(AgentRequest::decode(&b).map(drop)),
            !known(&agent_own),
            "kind {k:#06x} to the agent"
        );
        assert_eq!(
            unknown(KeeperRequest::decode(&b).map(drop)),
            !known(&keeper_own),
            "kind {k:#06x} to the keeper"
        );
        let owners = [&agent_own, &keeper_own, &common]
            .iter()
            .filter(|own| own.contains(&k))
            .count();
        assert!(owners <= 1, "kind {k:#06x} belongs to {owners} sets");
        if (0x0001..=0x0017).contains(&k) {
            assert_eq!(owners, 1, "kind {k:#06x} is nobody's");
        }
    }
}

#[test]
fn bad_field_values_are_rejected() {
    // Allocation kind 7 (none such), then an RDMA flag of 2; the kind byte is the one before
    // the last.
    let alloc = enc_rep(&Reply::Allocation {
        id: 1,
        device: 0,
        addr: 0,
        size: 0,
        kind: AllocKind::AppVmm,
        rdma_capable: false,
    });
    assert_eq!(alloc.len(), HEADER_LEN + 8 + 4 + 8 + 8 + 1 + 1);
    let n = alloc.len();
    let mut b = alloc.clone();
    b[n - 2] = 7;
    assert!(matches!(Reply::decode(&b), Err(ProtoError::Malformed(_))));
    let mut b = alloc;
    b[n - 1] = 2;
    assert!(matches!(Reply::decode(&b), Err(ProtoError::Malformed(_))));
    // Expect's RDMA flag is its last byte.
    let mut b = enc_req(&KeeperRequest::Expect {
        id: 1,
        gpu: [0; 16],
        addr: 0,
        size: 0,
        rdma_capable: true,
    });
    assert_eq!(b.len(), HEADER_LEN + 8 + 16 + 8 + 8 + 1);
    *b.last_mut().unwrap() = 2;
    assert!(matches!(
        KeeperRequest::decode(&b),
        Err(ProtoError::Malformed(_))
    ));
    // Boolean 2.
    let mut b = enc_rep(&Reply::Hello {
        version: 1,
        pid: NsPid(1),
        tid: NsTid(1),
        allocations: 0,
        converted_bytes: 0,
        devices: 0,
        released: false,
        hazards: 0,
        kept: 0,
    });
    // The boolean sits just before the 4-byte hazards and kept fields.
    let n = b.len();
    b[n - 9] = 2;
    assert!(matches!(Reply::decode(&b), Err(ProtoError::Malformed(_))));
    // Error code 0 and 9.
    for code in [0u16, 9] {
        let mut b = enc_rep(&Reply::Error {
            code: ErrorCode::Busy,
            message: "x".into(),
        });
        b[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&code.to_le_bytes());
        assert!(matches!(Reply::decode(&b), Err(ProtoError::Malformed(_))));
    }
    // Invalid UTF-8 and a length past the end.
    let mut b = enc_rep(&Reply::Error {
        code: ErrorCode::Busy,
        message: "ab".into(),
    });
    let n = b.len();
    b[n - 1] = 0xff;
    assert!(matches!(Reply::decode(&b), Err(ProtoError::Malformed(_))));
    let mut b = enc_rep(&Reply::Error {
        code: ErrorCode::Busy,
        message: "ab".into(),
    });
    b[HEADER_LEN + 2] = 3;
    assert!(matches!(Reply::decode(&b), Err(ProtoError::Malformed(_))));
}

/// A share's bytes, field by field, as the wire has always had them: import, pid, id, addr,
/// size, mapped, shareable, agent_fd, app_fd, own_fd (-1: none), key.
#[test]
fn a_share_keeps_its_wire_layout() {
    let body = |share: Share| enc_rep(&Reply::Shared(share))[HEADER_LEN..].to_vec();
    let layout = |shareable: bool, fds: [i32; 3]| {
        let mut v = vec![1u8];
        v.extend(77u32.to_le_bytes());
        v.extend(9u64.to_le_bytes());
        v.extend(0x7000_0020_0000u64.to_le_bytes());
        v.extend((2u64 << 20).to_le_bytes());
        v.push(0);
        v.push(u8::from(shareable));
        for fd in fds {
            v.extend(fd.to_le_bytes());
        }
        v.extend([0x5e; 16]);
        v
    };
    let ipc = Share {
        import: true,
        pid: NsPid(77),
        id: 9,
        addr: 0x7000_0020_0000,
        size: 2 << 20,
        mapped: false,
        key: [0x5e; 16],
        kind: ShareKind::Ipc,
    };
    assert_eq!(body(ipc.clone()), layout(false, [-1, -1, -1]));
    let shareable = Share {
        kind: ShareKind::Shareable {
            agent_fd: ForeignFd::new(41),
            app_fd: None,
            own_fd: ForeignFd::new(0),
        },
        ..ipc
    };
    assert_eq!(body(shareable), layout(true, [41, -1, 0]));
}

/// A share's descriptor fields hold -1 or a descriptor number; and only a shareable handle's
/// have any (the agent's IPC has none), so that every decode encodes to the same bytes.
#[test]
fn a_share_s_descriptors_are_checked() {
    let b = enc_rep(&Reply::Shared(Share {
        import: false,
        pid: NsPid(0),
        id: 3,
        addr: 0x7000_0040_0000,
        size: 4 << 20,
        mapped: true,
        key: [0x5e; 16],
        kind: ShareKind::Ipc,
    }));
    // The three descriptors sit just before the 16-byte key; the shareable flag before them.
    let fds = b.len() - 16 - 12;
    for (at, v) in [(fds, 5i32), (fds + 4, 0), (fds + 8, 7)] {
        let mut b = b.clone();
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        assert!(
            matches!(Reply::decode(&b), Err(ProtoError::Malformed(_))),
            "an IPC share with descriptor {v} at {at}"
        );
        b[fds - 1] = 1;
        assert!(
            Reply::decode(&b).is_ok(),
            "a shareable handle's, {v} at {at}"
        );
    }
    for v in [-2i32, i32::MIN] {
        let mut b = b.clone();
        b[fds - 1] = 1;
        b[fds..fds + 4].copy_from_slice(&v.to_le_bytes());
        assert!(
            matches!(Reply::decode(&b), Err(ProtoError::Malformed(_))),
            "descriptor {v}"
        );
    }
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[test]
fn random_bytes_never_panic_and_decodes_re_encode_identically() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let valid: Vec<Vec<u8>> = all_agent_requests()
        .iter()
        .map(enc_req)
        .chain(keeper_only_requests().iter().map(enc_req))
        .chain(all_replies().iter().map(enc_rep))
        .collect();
    for i in 0..200_000 {
        let mut b: Vec<u8> = if i % 2 == 0 {
            // Pure garbage, sometimes with a valid header so the body parsers are exercised.
            let len = (rng.next() % 80) as usize;
            let mut v: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            if i % 4 == 0 && v.len() >= HEADER_LEN {
                v[..4].copy_from_slice(&MAGIC.to_le_bytes());
                v[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
                let kind = [0x0001u16, 0x0009, 0x0101, 0x010B][(rng.next() % 4) as usize];
                v[6..8].copy_from_slice(&kind.to_le_bytes());
            }
            v
        } else {
            // A valid message with a few bytes flipped.
            let mut v = valid[(rng.next() as usize) % valid.len()].clone();
            for _ in 0..1 + rng.next() % 3 {
                let at = (rng.next() as usize) % v.len();
                v[at] = rng.next() as u8;
            }
            v
        };
        if let Ok(r) = AgentRequest::decode(&b) {
            assert_eq!(enc_req(&r), b, "request decode is not canonical");
        }
        if let Ok(r) = KeeperRequest::decode(&b) {
            assert_eq!(enc_req(&r), b, "request decode is not canonical");
        }
        if let Ok(r) = Reply::decode(&b) {
            assert_eq!(enc_rep(&r), b, "reply decode is not canonical");
        }
        b.clear();
    }
}

/// A `SnapshotIds` carries 1 to [`MAX_SNAPSHOT_IDS`] ids, as many as its count says: the list
/// is bounded on the wire, whatever the keeper bounds besides.
#[test]
fn a_snapshot_list_is_bounded() {
    let full = enc_req(&KeeperRequest::SnapshotIds {
        ids: vec![9; MAX_SNAPSHOT_IDS],
    });
    assert_eq!(full.len(), HEADER_LEN + 2 + 8 * MAX_SNAPSHOT_IDS);
    assert!(full.len() <= MAX_MESSAGE);
    // An encoder given more sends one message's worth, and says so.
    let more = enc_req(&KeeperRequest::SnapshotIds {
        ids: vec![9; MAX_SNAPSHOT_IDS + 5],
    });
    assert_eq!(more, full);
    let with_count = |n: u16, ids: usize| {
        let mut b = header_of(kind_of(&KeeperRequest::SnapshotIds { ids: vec![1] }));
        b.extend_from_slice(&n.to_le_bytes());
        for i in 0..ids {
            b.extend_from_slice(&(i as u64).to_le_bytes());
        }
        b
    };
    assert!(matches!(
        KeeperRequest::decode(&with_count(2, 2)),
        Ok(KeeperRequest::SnapshotIds { ids }) if ids == [0, 1]
    ));
    // None, more than a message holds, fewer than counted, more than counted.
    for (n, ids) in [
        (0, 0),
        (MAX_SNAPSHOT_IDS as u16 + 1, MAX_SNAPSHOT_IDS + 1),
        (3, 2),
        (2, 3),
    ] {
        assert!(
            matches!(
                KeeperRequest::decode(&with_count(n, ids)),
                Err(ProtoError::Malformed(_))
            ),
            "{n} counted, {ids} sent"
        );
    }
}

#[test]
fn largest_message_fits() {
    let b = enc_rep(&Reply::Error {
        code: ErrorCode::Cuda,
        message: "x".repeat(10_000),
    });
    assert_eq!(b.len(), HEADER_LEN + 2 + 2 + MAX_ERROR_MESSAGE);
    assert!(b.len() <= MAX_MESSAGE);
}

#[test]
fn an_absent_optional_value_must_be_zero() {
    let mut buf = [0u8; MAX_MESSAGE];
    let n = AgentRequest::from(CommonRequest::ChunkLoad {
        slot: 1,
        addr: 2,
        len: 3,
        device_hash: None,
    })
    .encode(&mut buf);
    // The last 8 bytes are the value; its presence byte says absent.
    buf[n - 1] = 1;
    assert!(matches!(
        AgentRequest::decode(&buf[..n]),
        Err(ProtoError::Malformed(_))
    ));
    assert!(matches!(
        KeeperRequest::decode(&buf[..n]),
        Err(ProtoError::Malformed(_))
    ));
    buf[n - 9] = 2;
    assert!(
        AgentRequest::decode(&buf[..n]).is_err(),
        "a presence byte of 2"
    );
    assert!(
        KeeperRequest::decode(&buf[..n]).is_err(),
        "a presence byte of 2"
    );
}

#[test]
fn door_labels_parse_exactly() {
    assert_eq!(
        parse_label("/memfd:gpusnap-agent-door:12:11 (deleted)"),
        Some((12, 11))
    );
    assert_eq!(parse_label("/memfd:gpusnap-agent-door:3:4"), Some((3, 4)));
    for bad in [
        "/memfd:gpusnap-agent-door:12 (deleted)",
        "/memfd:gpusnap-agent-door::4 (deleted)",
        "/memfd:gpusnap-agent-door:+1:4 (deleted)",
        "/memfd:gpusnap-agent-door:1:-4 (deleted)",
        "/memfd:gpusnap-agent-door:1:4:5 (deleted)",
        "/memfd:gpusnap-agent-door:99999999999:4 (deleted)",
        "/memfd:gpusnap-staging (deleted)",
        "/tmp/gpusnap-agent-door:1:2",
        "socket:[1234]",
    ] {
        assert_eq!(parse_label(bad), None, "{bad}");
    }
}

fn memfd_with(content: &[u8]) -> std::fs::File {
    // SAFETY: the name is a valid C string; flags are valid.
    let fd = unsafe { libc::memfd_create(c"gpusnap-proto-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fd is a new descriptor owned by nobody else.
    let mut f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    f.write_all(content).unwrap();
    f.rewind().unwrap();
    f
}

#[test]
fn pair_passes_messages_and_one_fd() {
    let (a, b) = Channel::pair().unwrap();
    let file = memfd_with(b"staging");
    let req = KeeperRequest::from(CommonRequest::DumpBegin {
        slot_size: 4096,
        slots: 2,
        streams: 1,
    });
    a.send_request(&req, Some(file.as_fd())).unwrap();
    let (got, fd) = b
        .recv_request::<KeeperRequest>(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(got, req);
    let fd = fd.expect("fd attached");
    assert_ne!(fd.as_raw_fd(), file.as_raw_fd());
    // CLOEXEC was set on receipt.
    // SAFETY: fd is open.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
    assert!(flags & libc::FD_CLOEXEC != 0);
    let mut back = std::fs::File::from(fd);
    let mut s = String::new();
    std::io::Read::read_to_string(&mut back, &mut s).unwrap();
    assert_eq!(s, "staging");

    b.send_reply(&Reply::Ready).unwrap();
    assert_eq!(a.recv_reply(None).unwrap(), Reply::Ready);
    assert!(a.try_recv_reply().unwrap().is_none());
    assert!(b.try_recv_request::<AgentRequest>().unwrap().is_none());
    a.send_request(&AgentRequest::Common(CommonRequest::Abort), None)
        .unwrap();
    assert_eq!(
        b.try_recv_request::<AgentRequest>()
            .unwrap()
            .map(|(r, _)| r),
        Some(AgentRequest::Common(CommonRequest::Abort))
    );
}

#[test]
fn timeout_closed_and_misuse_are_reported() {
    let (a, b) = Channel::pair().unwrap();
    let t0 = Instant::now();
    assert!(matches!(
        b.recv_request::<AgentRequest>(Some(Duration::from_millis(50))),
        Err(ProtoError::Timeout)
    ));
    assert!(t0.elapsed() >= Duration::from_millis(50));
    // An fd attached to a reply is refused (and closed).
    let file = memfd_with(b"x");
    send_raw_with_fds(&a, &enc_rep(&Reply::Ready), &[file.as_raw_fd()]);
    assert!(matches!(b.recv_reply(None), Err(ProtoError::UnexpectedFd)));
    drop(a);
    assert!(matches!(
        b.recv_request::<KeeperRequest>(None),
        Err(ProtoError::Closed)
    ));
    assert!(matches!(
        b.send_reply(&Reply::Ready),
        Err(ProtoError::Closed)
    ));
    assert!(matches!(b.try_recv_reply(), Err(ProtoError::Closed)));
}

/// Sends raw bytes with `n` descriptors attached, bypassing Channel's own sender.
fn send_raw_with_fds(sock: &Channel, bytes: &[u8], fds: &[i32]) {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut _,
        iov_len: bytes.len(),
    };
    #[repr(C, align(8))]
    struct Buf([u8; 256]);
    let mut cbuf = Buf([0; 256]);
    let data_len = std::mem::size_of_val(fds) as u32;
    // SAFETY: building one SCM_RIGHTS control message inside cbuf (256 bytes is ample for the
    // few descriptors tests pass), then one sendmsg over live buffers.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(data_len) as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(data_len) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<i32>(), fds.len());
        assert_eq!(
            libc::sendmsg(sock.fd().as_raw_fd(), &msg, 0),
            bytes.len() as isize
        );
    }
}

/// How many of this process's fds refer to the same file as `f` (other tests run in parallel
/// threads and open and close fds of their own, so a process-wide count would be racy).
fn fds_referring_to(f: &std::fs::File) -> usize {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata().unwrap();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .filter(|x| x.dev() == m.dev() && x.ino() == m.ino())
        .count()
}

#[test]
fn extra_fds_are_refused_and_closed() {
    let (a, b) = Channel::pair().unwrap();
    let f1 = memfd_with(b"1");
    let f2 = memfd_with(b"2");
    let bytes = enc_req(&AgentRequest::Common(CommonRequest::Release));
    let (before1, before2) = (fds_referring_to(&f1), fds_referring_to(&f2));
    send_raw_with_fds(&a, &bytes, &[f1.as_raw_fd(), f2.as_raw_fd()]);
    assert!(matches!(
        b.recv_request::<AgentRequest>(None),
        Err(ProtoError::TooManyFds(2))
    ));
    // Way more than the control buffer holds: truncated, still refused, nothing leaks.
    let many: Vec<i32> = (0..20).map(|_| f1.as_raw_fd()).collect();
    send_raw_with_fds(&a, &bytes, &many);
    let got = b.recv_request::<KeeperRequest>(None);
    assert!(
        matches!(
            got,
            Err(ProtoError::TooManyFds(_) | ProtoError::DescriptorsDropped)
        ),
        "{got:?}"
    );
    assert_eq!(
        (fds_referring_to(&f1), fds_referring_to(&f2)),
        (before1, before2),
        "received fds leaked"
    );
    // A too-long record.
    let long = vec![0u8; MAX_MESSAGE + 10];
    send_raw_with_fds(&a, &long, &[]);
    assert!(matches!(
        b.recv_request::<AgentRequest>(None),
        Err(ProtoError::TooLong)
    ));
    // Garbage is an error, and the channel still works after it.
    send_raw_with_fds(&a, b"garbage!", &[]);
    assert!(b.recv_request::<KeeperRequest>(None).is_err());
    a.send_request(&AgentRequest::ListAllocations, None)
        .unwrap();
    assert_eq!(
        b.recv_request::<AgentRequest>(None).unwrap().0,
        AgentRequest::ListAllocations
    );
}

#[test]
fn concurrent_senders_keep_messages_whole() {
    let (a, b) = Channel::pair().unwrap();
    let a = std::sync::Arc::new(a);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                for i in 0..100u32 {
                    a.send_reply(&Reply::SlotFree { slot: t * 1000 + i })
                        .unwrap();
                }
            })
        })
        .collect();
    let mut seen = Vec::new();
    for _ in 0..400 {
        match b.recv_reply(Some(Duration::from_secs(10))).unwrap() {
            Reply::SlotFree { slot } => seen.push(slot),
            other => panic!("{other:?}"),
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    seen.sort_unstable();
    let want: Vec<u32> = (0..4)
        .flat_map(|t| (0..100).map(move |i| t * 1000 + i))
        .collect();
    assert_eq!(seen, want);
}

/// The whole door in one process (one test, so no other test's door makes two labels): a
/// client finds it by its label, knocks, and the agent's end takes a connection whose
/// `SO_PEERCRED` is the knocker's; a knock nobody takes is withdrawn; junk is not a knock.
#[test]
fn door_knock_take_and_withdraw() {
    let me = std::process::id() as i32;
    assert!(
        Door::open(HostPid(me)).unwrap().is_none(),
        "no door before install"
    );
    let inside = install_door().unwrap();
    let agent = Channel::new(inside.agent_end);
    assert!(matches!(take_knock(&agent).unwrap(), Knock::Nothing));

    let door = Door::open(HostPid(me))
        .unwrap()
        .expect("the label is found");
    let ours = Channel::new(door.knock().unwrap());
    let Knock::Connection(conn) = take_knock(&agent).unwrap() else {
        panic!("no connection taken");
    };
    let cred = peer_cred(conn.as_fd()).unwrap();
    assert_eq!(cred.pid, me);
    // SAFETY: geteuid has no preconditions.
    assert_eq!(cred.uid, unsafe { libc::geteuid() });
    let served = Channel::new(conn);
    ours.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    )
    .unwrap();
    assert_eq!(
        served
            .recv_request::<AgentRequest>(Some(Duration::from_secs(5)))
            .unwrap()
            .0,
        AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION
        })
    );
    served.send_reply(&Reply::Aborted).unwrap();
    assert_eq!(
        ours.recv_reply(Some(Duration::from_secs(5))).unwrap(),
        Reply::Aborted
    );

    // Two knocks nobody takes, ours and another client's: both are taken out and closed
    // (each connection sees the close), and the door is empty: nothing is left in flight for
    // CRIU to find. (Queued again, the other knock stayed there for the dump.)
    let b = Channel::new(connect_agent(HostPid(me)).unwrap());
    let a = Channel::new(door.knock().unwrap());
    assert_eq!(door.withdraw().unwrap(), 1, "ours");
    for c in [&a, &b] {
        assert!(matches!(
            c.recv_reply(Some(Duration::from_secs(5))),
            Err(ProtoError::Closed)
        ));
    }
    assert!(matches!(take_knock(&agent).unwrap(), Knock::Nothing));

    // Records that are not knocks are refused and their descriptors closed.
    let raw = Channel::new(inside.client_end);
    raw.send_raw_now(b"hello", None).unwrap();
    assert!(matches!(take_knock(&agent).unwrap(), Knock::Malformed(_)));
    raw.send_raw_now(KNOCK, None).unwrap();
    assert!(matches!(take_knock(&agent).unwrap(), Knock::Malformed(_)));
    let f = std::fs::File::open("/proc/self/status").unwrap();
    raw.send_raw_now(KNOCK, Some(f.as_fd())).unwrap();
    assert!(matches!(take_knock(&agent).unwrap(), Knock::Malformed(_)));

    // A second label is refused, not guessed between.
    let second = install_door().unwrap();
    assert!(Door::open(HostPid(me)).is_err());
    drop(second);
    drop(inside.label);
    assert!(
        Door::open(HostPid(me)).unwrap().is_none(),
        "no label, no door"
    );
}

#[test]
fn every_hazard_bit_has_its_own_words_and_the_event_import_refuses() {
    let bits = [
        hazard::MANAGED_MEMORY,
        hazard::IPC_EXPORT,
        hazard::IPC_IMPORT,
        hazard::PEER_ACCESS,
        hazard::SERVED_IPC_EXPORT,
        hazard::SERVED_IPC_IMPORT,
        hazard::IPC_EVENT_IMPORT,
        hazard::SHAREABLE_EXPORT,
        hazard::SHAREABLE_IMPORT,
    ];
    let mut seen = std::collections::HashSet::new();
    for b in bits {
        assert_eq!(b.count_ones(), 1);
        let words = hazard::describe(b);
        assert_eq!(words.len(), 1, "{b:#x}");
        assert!(seen.insert(words[0]), "{b:#x}");
    }
    assert_ne!(hazard::REFUSING & hazard::IPC_EVENT_IMPORT, 0);
    // Carried shares need a look at the whole tree, never refuse by themselves.
    assert_eq!(hazard::REFUSING & hazard::SHARING, 0);
    assert_eq!(hazard::SHARING & hazard::IMPORTING, hazard::IMPORTING);
    assert_eq!(
        hazard::describe(hazard::IPC_EVENT_IMPORT),
        ["an interprocess CUDA event of another process opened here (cuIpcOpenEventHandle)"]
    );
}
