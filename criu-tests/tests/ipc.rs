//! Legacy CUDA IPC (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`) between
//! an exporter and the importer it spawns (`fakegpu-ipc`), on the stand-in driver, with and
//! without the gpusnap agent preloaded. The agent converts `cuMemAlloc` memory into VMM
//! mappings, which the driver's legacy IPC refuses; the agent must serve IPC for those itself,
//! so that a program behaves exactly as without it.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// `fakegpu-ipc`, the IPC workload (a binary of `fake-cuda-device`).
fn ipc_bin() -> PathBuf {
    common::built("fake-cuda-device", "fakegpu-ipc")
}

/// 8 MiB plus a bit: converted by the agent (at least 1 MiB), not a multiple of 2 MiB.
const LARGE: &str = "8400000";
/// Below the agent's threshold: left to the driver.
const SMALL: &str = "65536";

fn agent_so() -> PathBuf {
    common::built("gpusnap-agent", "libgpusnap_agent.so")
}

/// The `libcuda.so.1` link's directory, made once for all tests of this binary.
fn lib_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = common::profile_dir()
            .join("fake-cuda-device-tests")
            .join(format!("ipc-{}", std::process::id()));
        fs::create_dir_all(&d).expect("mkdir work dir");
        common::libcuda_dir(&d)
    })
    .clone()
}

/// Which processes have the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Agent {
    Both,
    Neither,
    ExporterOnly,
    ImporterOnly,
}

/// Runs the exporter (which runs the importer) and returns its `key value` lines; the
/// importer's are keyed `importer <key>`.
fn run(agent: Agent, args: &[&str]) -> BTreeMap<String, String> {
    let agent_so = agent_so();
    let mut cmd = Command::new(ipc_bin());
    cmd.arg("export")
        .args(args)
        .env("LD_LIBRARY_PATH", lib_dir())
        .env("GPUSNAP_AGENT_DEBUG", "1")
        .env("FAKECUDADEV_DEBUG", "1")
        .env_remove("LD_PRELOAD")
        .env_remove("GPUSNAP_AGENT_DISABLE")
        .env_remove("GPUSNAP_AGENT_MIN_BYTES");
    match agent {
        Agent::Both => {
            cmd.env("LD_PRELOAD", &agent_so);
        }
        Agent::Neither => {}
        Agent::ExporterOnly => {
            cmd.env("LD_PRELOAD", &agent_so)
                .args(["--importer-preload", "none"]);
        }
        Agent::ImporterOnly => {
            cmd.arg("--importer-preload").arg(&agent_so);
        }
    }
    let out = cmd.output().expect("run fakegpu-ipc");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "fakegpu-ipc {args:?} ({agent:?}) failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    let mut m = BTreeMap::new();
    for line in stdout.lines() {
        let (k, v) = match line.strip_prefix("importer ") {
            Some(rest) => {
                let (k, v) = rest.split_once(' ').unwrap_or((rest, ""));
                (format!("importer {k}"), v.to_owned())
            }
            None => {
                let (k, v) = line.split_once(' ').unwrap_or((line, ""));
                (k.to_owned(), v.to_owned())
            }
        };
        m.insert(k, v);
    }
    m.insert("stderr".into(), stderr);
    m
}

#[track_caller]
fn expect(m: &BTreeMap<String, String>, pairs: &[(&str, &str)]) {
    for (k, v) in pairs {
        assert_eq!(
            m.get(*k).map(String::as_str),
            Some(*v),
            "{k}\nall: {:#?}",
            m
        );
    }
}

/// What a successful share looks like: the importer sees the exporter's bytes, the exporter
/// the importer's, every open and close succeeds, one close too many is refused.
const SHARED: &[(&str, &str)] = &[
    ("get", "CUDA_SUCCESS"),
    ("importer open0", "CUDA_SUCCESS"),
    ("importer sees-exporter-data", "true"),
    ("importer write", "CUDA_SUCCESS"),
    ("importer close0", "CUDA_SUCCESS"),
    ("importer close-extra", "CUDA_ERROR_INVALID_VALUE"),
    ("importer-exit", "0"),
    ("exporter-sees-importer-writes", "true"),
    ("free", "CUDA_SUCCESS"),
];

#[test]
fn the_stand_in_shares_cu_mem_alloc_memory_without_the_agent() {
    for bytes in [LARGE, SMALL] {
        let m = run(Agent::Neither, &["--bytes", bytes]);
        expect(&m, SHARED);
    }
}

/// The bug: a converted allocation is VMM memory, which the driver's IPC refuses; the agent
/// serves the share itself.
#[test]
fn a_converted_allocation_is_shared_as_without_the_agent() {
    let m = run(Agent::Both, &["--bytes", LARGE]);
    expect(&m, SHARED);
    for served in [
        "converted #",
        "ipc: handed #",
        "importer: gpusnap-agent",
        "ipc: opened #",
    ] {
        assert!(
            m["stderr"].contains(served),
            "converted and served by the agents ({served:?}): {}",
            m["stderr"]
        );
    }
    let m = run(Agent::Both, &["--bytes", LARGE, "--resolve", "proc"]);
    expect(&m, SHARED);
}

/// An importer without the agent hands the agent's token to the driver, which does not know it:
/// the driver's error (documented in docs/ipc.md: both sides need the agent).
#[test]
fn an_importer_without_the_agent_gets_the_drivers_error_for_an_agent_token() {
    let m = run(Agent::ExporterOnly, &["--bytes", LARGE]);
    // The exporter is served by the agent; its token means nothing to a driver alone.
    expect(
        &m,
        &[
            ("get", "CUDA_SUCCESS"),
            ("importer open0", "CUDA_ERROR_INVALID_VALUE"),
            ("importer-exit", "0"),
        ],
    );
}

/// A pointer inside the allocation names all of it; the importer gets the base, as from the
/// driver.
#[test]
fn an_interior_pointer_shares_the_whole_allocation() {
    for agent in [Agent::Neither, Agent::Both] {
        let m = run(agent, &["--bytes", LARGE, "--offset", "3145851"]);
        expect(&m, SHARED);
    }
}

/// Opening the same handle twice in one process returns the same pointer and counts: the
/// first close leaves it mapped, the second unmaps, a third is refused.
#[test]
fn two_opens_return_one_pointer_and_need_two_closes() {
    for (agent, bytes) in [
        (Agent::Neither, LARGE),
        (Agent::Both, LARGE),
        (Agent::Both, SMALL),
    ] {
        let m = run(agent, &["--bytes", bytes, "--opens", "2"]);
        expect(&m, SHARED);
        expect(
            &m,
            &[
                ("importer open1", "CUDA_SUCCESS"),
                ("importer open1-same-pointer", "true"),
                ("importer close1", "CUDA_SUCCESS"),
                ("importer after-close0-readable", "true"),
            ],
        );
    }
}

/// Memory the agent left to the driver (small), or a handle from an exporter without the
/// agent, goes to the driver untouched.
#[test]
fn handles_the_agent_did_not_make_go_to_the_driver() {
    let m = run(Agent::Both, &["--bytes", SMALL]);
    expect(&m, SHARED);
    let m = run(Agent::ImporterOnly, &["--bytes", LARGE]);
    expect(&m, SHARED);
}

/// The exporting process opening its own handle: the driver's error, with and without agent.
#[test]
fn the_exporter_cannot_open_its_own_handle() {
    for agent in [Agent::Neither, Agent::Both] {
        let m = run(agent, &["--bytes", LARGE, "--self-open"]);
        expect(&m, &[("self-open", "CUDA_ERROR_INVALID_CONTEXT")]);
        expect(&m, SHARED);
    }
}

/// A handle of freed memory does not open (the agent's server no longer has it).
#[test]
fn a_handle_of_freed_memory_does_not_open() {
    for agent in [Agent::Neither, Agent::Both] {
        let m = run(agent, &["--bytes", LARGE, "--free-first"]);
        expect(
            &m,
            &[
                ("free", "CUDA_SUCCESS"),
                ("importer open0", "CUDA_ERROR_INVALID_VALUE"),
                ("importer-exit", "0"),
            ],
        );
    }
}

/// Another user may not open the exporter's memory through the agent (SO_PEERCRED); as root
/// only (the importer is started as uid 65534).
#[test]
fn another_user_is_refused() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        criu_tests::harness::skipped(
            "another_user_is_refused",
            "needs root (the importer runs as uid 65534)",
        );
        return;
    }
    let m = run(Agent::Both, &["--bytes", LARGE, "--importer-uid", "65534"]);
    expect(
        &m,
        &[
            ("get", "CUDA_SUCCESS"),
            ("importer open0", "CUDA_ERROR_INVALID_VALUE"),
            ("importer-exit", "0"),
        ],
    );
    assert!(
        m["stderr"].contains("another user"),
        "the refusal is logged: {}",
        m["stderr"]
    );
}

/// The agent's `Hello` from process `pid`: its hazard bits.
fn hazards_of(pid: i32) -> u32 {
    use gpusnap_proto::{
        AgentRequest, Channel, CommonRequest, PROTOCOL_VERSION, Reply, connect_agent,
    };
    let ch = Channel::new(
        connect_agent(gpusnap_proto::pid::HostPid(pid)).expect("connect to the agent"),
    );
    ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    )
    .expect("send Hello");
    match ch
        .recv_reply(Some(std::time::Duration::from_secs(10)))
        .expect("Hello reply")
    {
        Reply::Hello { hazards, .. } => hazards,
        other => panic!("not a Hello: {other:?}"),
    }
}

/// Both sides of an agent-served share report it: the exporter `SERVED_IPC_EXPORT`, the
/// importer `SERVED_IPC_IMPORT` (a dump carries the share only with both sides in it), and not
/// the driver's IPC bits, which refuse a dump by themselves.
#[test]
fn both_sides_of_an_agent_served_share_report_their_hazard() {
    use gpusnap_proto::hazard;
    let dir = lib_dir().parent().unwrap().join("hold");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let hold = dir.join("h");
    let hold_s = hold.to_str().unwrap().to_owned();
    let runner =
        std::thread::spawn(move || run(Agent::Both, &["--bytes", LARGE, "--hold", &hold_s]));
    let importer_file = dir.join("h.importer");
    let t0 = std::time::Instant::now();
    while !importer_file.exists() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "the importer never held"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    let pid_of =
        |p: &std::path::Path| -> i32 { fs::read_to_string(p).unwrap().trim().parse().unwrap() };
    let exporter = hazards_of(pid_of(&dir.join("h.exporter")));
    let importer = hazards_of(pid_of(&importer_file));
    fs::remove_file(&importer_file).unwrap();
    let m = runner.join().unwrap();
    expect(&m, SHARED);
    assert_ne!(
        exporter & hazard::SERVED_IPC_EXPORT,
        0,
        "exporter hazards {exporter:#x}"
    );
    assert_ne!(
        importer & hazard::SERVED_IPC_IMPORT,
        0,
        "importer hazards {importer:#x}"
    );
    assert_eq!(
        (exporter | importer) & hazard::REFUSING,
        0,
        "hazards {exporter:#x} / {importer:#x}"
    );
    let _ = fs::remove_dir_all(&dir);
}
