//! The job is untrusted (issue 32, items 2 and 9), with real CRIU on the stand-in driver.
//!
//! - **Another user's memory.** A victim of uid 1001 (`fakegpu-ipc export --loop`: an exporter
//!   of one 8 MiB allocation through the agent's CUDA IPC and the importer it spawned) runs
//!   beside a job whose agent is the hostile test build playing `fake-share`: its `ListSharing`
//!   adds an import of the victim's allocation, named by pid, id and the victim's right key
//!   (read here as root; it is no longer in the victim's public socket name). Neither a dump of
//!   a tree that holds both (`-R`, whose rollback would map the "import" again) nor `gpusnap
//!   recover` of the job may hand the job a descriptor of that memory: the share is refused,
//!   naming both owners, the job's agent is never sent a `Reimport`, no descriptor of the job's
//!   is the victim's memory (`kcmp`), and the victim runs on.
//! - **Knocking.** Clients that knock on the job's agent door with garbage (ten connections that
//!   each send one bad record, and a knocker every 2 ms throughout a dump) neither make the dump
//!   wait nor fail it, and the image restores: the agent drops a malformed connection at once,
//!   takes only the tracer's knocks while a tracer holds the process, and the plugin seals the
//!   door for the rest of the dump.
//!
//! Root and CRIU are needed; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::pair::read_log;
use common::split::Split;
use common::{VmmLog, built, libcuda_dir, vmm_bin};
use criu_tests::CriuRun;
use gpusnap_proto::pid::HostPid;
use gpusnap_proto::{AgentRequest, Channel, CommonRequest, Door, PROTOCOL_VERSION, Reply, Share};

/// The job's workload: two 4 MiB allocations, copied out first.
const ARGS: &[&str] = &["--seed", "23", "--allocs", "2", "--mib", "4"];
const ENV: &[(&str, &str)] = &[("GPUSNAP_HANDOVER", "0")];
/// The victim's user (no name needed).
const VICTIM_UID: u32 = 1001;
const VICTIM_BYTES: &str = "8388608";
/// Where the forged import says it is mapped in the job.
const FORGED_ADDR: u64 = 0x7e00_0000_0000;
/// A dump of the small job takes about a second on the stand-in; the agent's own timeouts,
/// which a knocker used to make the plugin wait for, are 10 s.
const PROMPT: Duration = Duration::from_secs(5);

/// Makes `dir` (and its files' creation) open to the victim's user.
fn open_to_all(dir: &Path) {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).expect("chmod 0777");
}

/// The victim's `fakegpu-ipc export --loop <dir>/v`, as uid 1001, with the workspace's agent
/// preloaded (the command, to be run directly or from the tree's script).
fn victim_command(dir: &Path, lib: &Path, agent: &Path, state: &Path) -> Command {
    let mut cmd = Command::new(built("fake-cuda-device", "fakegpu-ipc"));
    cmd.args(["export", "--bytes", VICTIM_BYTES, "--loop"])
        .arg(dir.join("v"))
        .env("LD_LIBRARY_PATH", lib)
        .env("LD_PRELOAD", agent)
        .env("GPUSNAP_AGENT_DEBUG", "1")
        .env("FAKECUDA_DIR", state)
        .env_remove("GPUSNAP_AGENT_MIN_BYTES")
        .uid(VICTIM_UID)
        .gid(VICTIM_UID);
    cmd
}

/// The victim pair's logs (`v.exporter`, `v.importer`) in `dir`.
struct VictimLogs(PathBuf);

impl VictimLogs {
    fn side(&self, which: &str) -> PathBuf {
        self.0.join(format!("v.{which}"))
    }

    /// Waits until both sides have written `n` more ticks than `from` (all `ok 1`); returns
    /// (exporter pid, importer pid, ticks of each).
    fn wait_ticks(&self, from: (usize, usize), n: usize) -> (i32, i32, usize, usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (ep, et) = read_log(&self.side("exporter"));
            let (ip, it) = read_log(&self.side("importer"));
            if let (Some(ep), Some(ip)) = (ep, ip)
                && et.len() >= from.0 + n
                && it.len() >= from.1 + n
            {
                assert!(
                    et.iter().chain(&it).all(|t| t.ok),
                    "a victim tick is damaged\n{}",
                    self.describe()
                );
                return (ep, ip, et.len(), it.len());
            }
            assert!(
                Instant::now() < deadline,
                "the victim pair did not tick\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn describe(&self) -> String {
        let tail = |p: PathBuf| {
            let t = std::fs::read_to_string(&p).unwrap_or_default();
            let lines: Vec<&str> = t.lines().rev().take(8).collect();
            format!(
                "--- {} (newest first) ---\n{}\n",
                p.display(),
                lines.join("\n")
            )
        };
        [
            self.side("exporter"),
            self.side("importer"),
            self.0.join("victim.out"),
        ]
        .into_iter()
        .map(tail)
        .collect()
    }
}

/// What the victim's agent says about its export (as root may ask): (allocation id, size,
/// key).
fn victim_export(pid: i32) -> (u64, u64, [u8; 16]) {
    let ch = Channel::new(gpusnap_proto::connect_agent(HostPid(pid)).expect("the victim's agent"));
    ch.send_request(&AgentRequest::ListSharing, None)
        .expect("ListSharing");
    let mut found = None;
    loop {
        match ch
            .recv_reply(Some(Duration::from_secs(10)))
            .expect("a ListSharing reply")
        {
            Reply::Shared(Share {
                import: false,
                id,
                size,
                key,
                ..
            }) => found = Some((id, size, key)),
            Reply::SharedEnd { .. } => break,
            _ => {}
        }
    }
    let _ = ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    );
    found.expect("the victim's agent lists its export")
}

fn hex(key: &[u8; 16]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hostile agent's attack: an import of the victim's allocation `id` of `size` bytes.
fn fake_share(victim: i32, id: u64, size: u64, key: &[u8; 16]) -> String {
    format!(
        "fake-share:{victim}:{id}:{}:{FORGED_ADDR:#x}:{size}",
        hex(key)
    )
}

/// The key is not public: no unix socket name (`/proc/net/unix`, which every user reads) holds
/// it.
fn assert_key_not_public(key: &[u8; 16]) {
    let table = std::fs::read_to_string("/proc/net/unix").expect("/proc/net/unix");
    assert!(
        !table.contains(&hex(key)),
        "the victim's key is in a public socket name:\n{}",
        table
            .lines()
            .filter(|l| l.contains("gpusnap"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The lines of the job's agent log that asked it to map memory of `victim` (a `Reimport`
/// always comes with a descriptor of that memory).
fn reimports_of(out: &Path, victim: i32) -> Vec<String> {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Reimport") && l.contains(&format!("exporter_pid: {victim}")))
        .map(str::to_owned)
        .collect()
}

/// Whether fd `a` of `pid_a` and fd `b` of `pid_b` are one open file (`kcmp(KCMP_FILE)`).
fn same_file(pid_a: i32, a: i32, pid_b: i32, b: i32) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    // SAFETY: kcmp compares kernel objects of two processes; no memory is passed.
    unsafe { libc::syscall(libc::SYS_kcmp, pid_a, pid_b, KCMP_FILE, a, b) == 0 }
}

fn fds(pid: i32) -> Vec<(i32, String)> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let n = e.file_name().to_str()?.parse().ok()?;
                    let target = std::fs::read_link(e.path()).ok()?;
                    Some((n, target.to_string_lossy().into_owned()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// No descriptor of `job` is one of the victim exporter's memfds (its device memory and the
/// export of it, on the stand-in).
fn assert_holds_none_of(job: i32, victim: i32) {
    for (vfd, target) in fds(victim) {
        if !target.starts_with("/memfd:") {
            continue;
        }
        for (jfd, jt) in fds(job) {
            assert!(
                !same_file(job, jfd, victim, vfd),
                "the job's fd {jfd} ({jt}) is the victim's fd {vfd} ({target})"
            );
        }
    }
}

/// `gpusnap recover` of a job whose agent lists an import of another user's live allocation,
/// with the right pid, id, size and key: it refuses the share (named in its answer, both
/// owners), never sends the job a `Reimport` (which carries the memory's descriptor), and the
/// job is left held; the victim runs on. Red before the ownership check: recover fetched the
/// victim's memory and sent it to the job.
#[test]
fn gpusnap_recover_never_hands_a_job_another_users_memory() {
    let test = "hostile-share-recover";
    let Some(h) = criu_tests::harness(test) else {
        return;
    };
    let vw = h.workdir(&format!("{test}-victim"));
    let dir = vw.path.join("victim");
    open_to_all(&dir);
    let state = dir.join("fakecuda");
    open_to_all(&state);
    let lib = libcuda_dir(&vw.path);
    let agent = h.agent_so().expect("agent").to_owned();
    let mut cmd = victim_command(&dir, &lib, &agent, &state);
    cmd.stdout(std::fs::File::create(dir.join("victim.out")).expect("out"))
        .stderr(std::fs::File::create(dir.join("victim.err")).expect("err"));
    let victim = criu_tests::procs::spawn_in_new_session(&mut cmd).expect("victim");
    let _kill = KillOnDrop(Vec::new(), Some(victim));
    let logs = VictimLogs(dir.clone());
    let (exporter, importer, e0, i0) = logs.wait_ticks((0, 0), 5);
    let _kill_importer = KillOnDrop(vec![importer], None);
    let (id, size, key) = victim_export(exporter);

    let attack: &'static str = Box::leak(fake_share(exporter, id, size, &key).into_boxed_str());
    let Some(s) = Split::hostile(test, attack, ARGS, ENV) else {
        return;
    };
    let job = s.vmm.pid();
    let (ok, out) = s.run_cli(&["recover", &job.to_string()]);
    assert!(
        !ok,
        "recover mapped a forged import and let the job run: {out}"
    );
    for needle in [
        "the share is refused".to_owned(),
        format!("pid {exporter} runs as uid {VICTIM_UID}"),
        "held".to_owned(),
    ] {
        assert!(out.contains(&needle), "no {needle:?} in: {out}");
    }
    let sent = reimports_of(&s.vmm.out, exporter);
    assert!(
        sent.is_empty(),
        "the job's agent was sent the victim's memory: {sent:?}\n{out}"
    );
    assert_holds_none_of(job, exporter);
    assert!(
        criu_tests::procs::is_alive(job),
        "the job is left held, alive"
    );
    logs.wait_ticks((e0, i0), 5);
    // Nor could the job have read the key: no public socket name holds it.
    assert_key_not_public(&key);
}

/// A dump (`-R`) of a tree that holds the victim pair (uid 1001) and a job (root) whose agent
/// lists an import of the victim's allocation with the right key: refused before anything is
/// released, naming both owners; nothing is mapped into the job (its agent is never sent a
/// `Reimport`), and all of them run on. Red before the ownership check: the dump went through
/// and its rollback handed the victim's memory to the job.
#[test]
fn a_dump_never_maps_another_users_memory_into_a_job() {
    let test = "hostile-share-dump";
    let Some(s) = Split::launch(test, 1, ARGS, ENV) else {
        return;
    };
    let h = s.w.harness();
    let dir = s.w.path.join("victim");
    open_to_all(&dir);
    open_to_all(&s.state);
    let lib = s.job_libcuda.parent().expect("lib dir").to_owned();
    let agent = h.agent_so().expect("agent").to_owned();
    let hostile = criu_tests::build::hostile_agent();
    let attack_file = dir.join("attack");
    let job_log = dir.join("job.log");
    let job_out = dir.join("job.out");
    // The tree: a shell (root) that starts the victim pair as uid 1001, waits for the attack,
    // then starts the job. Its environment is the job's; the victim's is set on its command.
    let victim = victim_command(&dir, &lib, &agent, &s.state);
    let mut victim_line = format!(
        "setpriv --reuid={VICTIM_UID} --regid={VICTIM_UID} --clear-groups env LD_LIBRARY_PATH={} LD_PRELOAD={} GPUSNAP_AGENT_DEBUG=1 FAKECUDA_DIR={}",
        lib.display(),
        agent.display(),
        s.state.display()
    );
    victim_line.push_str(&format!(" {}", victim.get_program().to_string_lossy()));
    for a in victim.get_args() {
        victim_line.push_str(&format!(" {}", a.to_string_lossy()));
    }
    let script = format!(
        "{victim_line} >{victim_out} 2>&1 &\n\
         while [ ! -s {attack} ]; do sleep 0.02; done\n\
         GPUSNAP_HOSTILE=$(cat {attack}) LD_PRELOAD={hostile} {vmm} --log {job_log} {args} >{job_out} 2>&1 &\n\
         wait\n",
        victim_out = dir.join("victim.out").display(),
        attack = attack_file.display(),
        hostile = hostile.display(),
        vmm = vmm_bin().display(),
        job_log = job_log.display(),
        args = ARGS.join(" "),
        job_out = job_out.display(),
    );
    let mut sh = Command::new("/bin/sh");
    sh.arg("-c")
        .arg(&script)
        .current_dir(&dir)
        .env("LD_LIBRARY_PATH", &lib)
        .env("GPUSNAP_AGENT_DEBUG", "1")
        .env("FAKECUDADEV_DEBUG", "1")
        .env("FAKECUDA_DIR", &s.state)
        .env("GPUSNAP_HANDOVER", "0")
        .env_remove("GPUSNAP_AGENT_MIN_BYTES")
        .stdout(std::fs::File::create(dir.join("sh.out")).expect("out"))
        .stderr(std::fs::File::create(dir.join("sh.err")).expect("err"));
    let tree = criu_tests::procs::spawn_in_new_session(&mut sh).expect("the tree's shell");
    let root = tree.id() as i32;
    let mut kill = KillOnDrop(Vec::new(), Some(tree));
    let logs = VictimLogs(dir.clone());
    let (exporter, importer, _, _) = logs.wait_ticks((0, 0), 5);
    let (id, size, key) = victim_export(exporter);
    std::fs::write(&attack_file, fake_share(exporter, id, size, &key)).expect("the attack");
    let job_ticks = |n: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(l)) = VmmLog::read(&job_log)
                && l.last_tick() >= n
            {
                return l;
            }
            assert!(
                Instant::now() < deadline,
                "the job did not reach tick {n}\n{}",
                std::fs::read_to_string(&job_out).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let job = job_ticks(3).pid;
    kill.0 = vec![job, importer, exporter];

    let dump = s.criu(
        "dump",
        "tree-dump.log",
        &["-t", &root.to_string(), "--leave-running"],
        &[],
    );
    let describe = |run: &CriuRun| {
        format!(
            "{}\n{}\n--- job ---\n{}",
            run.diagnostics(),
            logs.describe(),
            std::fs::read_to_string(&job_out).unwrap_or_default()
        )
    };
    let sent = reimports_of(&job_out, exporter);
    assert!(
        sent.is_empty(),
        "the job's agent was sent the victim's memory: {sent:?}\n{}",
        describe(&dump)
    );
    assert!(
        !dump.succeeded(),
        "a dump carried a forged import\n{}",
        describe(&dump)
    );
    let refusal = format!("pid {exporter} runs as uid {VICTIM_UID}");
    assert!(
        dump.gpusnap_lines()
            .iter()
            .any(|l| l.contains("the share is refused") && l.contains(&refusal)),
        "the refusal is not logged naming the owners\n{}",
        describe(&dump)
    );
    assert_holds_none_of(job, exporter);
    // All run on: the victim pair ticks and shares, the job ticks.
    let (_, _, e, i) = logs.wait_ticks((0, 0), 0);
    logs.wait_ticks((e, i), 5);
    let last = job_ticks(0).last_tick();
    job_ticks(last + 5).check().expect("the job's ticks");
}

/// Kills these pids and this child (and reaps what is ours) when the test ends, however it
/// ends.
struct KillOnDrop(Vec<i32>, Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        criu_tests::procs::kill_and_reap(&self.0);
        if let Some(c) = self.1.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Knocks once on `door` and sends a record that is no request on the new connection; returns
/// the client's end of it.
fn knock_with_garbage(door: &Door) -> std::io::Result<OwnedFd> {
    let c = door.knock()?;
    let junk = b"GSNP not a request at all";
    // SAFETY: send on a socket we own, of a live buffer of the given length.
    let n = unsafe {
        libc::send(
            c.as_raw_fd(),
            junk.as_ptr().cast(),
            junk.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(c)
}

/// The dump took the split path and did not wait on the agent.
fn assert_prompt_split_dump(s: &Split, dump: &CriuRun, took: Duration) {
    s.assert_ok(dump);
    s.assert_line(dump, &[&format!("pid {} ", s.vmm.pid()), "path split"]);
    assert!(
        took < PROMPT,
        "the dump took {took:?} (knockers made it wait)\n{}",
        s.describe(dump)
    );
}

/// Ten connections to the agent's door that each send one garbage record and stay open: the
/// agent drops each at once, so the plugin's own knock is served, the dump is as quick as
/// without them and restores. Red before: the agent kept each bad connection for seconds, the
/// dump waited 10 s for it and then failed ("External socket is used").
#[test]
fn ten_garbage_connections_neither_slow_nor_fail_a_dump() {
    let Some(mut s) = Split::launch("hostile-share-ten-knocks", 1, ARGS, ENV) else {
        return;
    };
    let door = Door::open(HostPid(s.vmm.pid()))
        .expect("the job's door")
        .expect("the job runs the agent");
    let held: Vec<OwnedFd> = (0..10)
        .map(|_| knock_with_garbage(&door).expect("knock"))
        .collect();
    let t0 = Instant::now();
    let dump = s.dump(false);
    assert_prompt_split_dump(&s, &dump, t0.elapsed());
    drop(held);
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}

/// A client that knocks every 2 ms with garbage, throughout a `-R` dump and then a dump and a
/// restore (re-copying the door whenever a knock fails, as a client with ptrace rights can):
/// every dump is prompt and whole, the job runs on after `-R`, and the image restores. Red
/// before: CRIU found one of its knocks queued in the door ("Unix socket ... not found").
#[test]
fn a_knocker_throughout_a_dump_neither_slows_nor_fails_it() {
    let Some(mut s) = Split::launch("hostile-share-knocker", 1, ARGS, ENV) else {
        return;
    };
    let pid = s.vmm.pid();
    let stop = Arc::new(AtomicBool::new(false));
    let knocks = Arc::new(AtomicUsize::new(0));
    let knocker = {
        let (stop, knocks) = (stop.clone(), knocks.clone());
        std::thread::spawn(move || {
            let mut door = Door::open(HostPid(pid)).ok().flatten();
            let mut held = VecDeque::new();
            while !stop.load(Ordering::Relaxed) {
                match door.as_ref().map(knock_with_garbage) {
                    Some(Ok(c)) => {
                        knocks.fetch_add(1, Ordering::Relaxed);
                        held.push_back(c);
                        if held.len() > 4 {
                            held.pop_front();
                        }
                    }
                    // Sealed, or gone: copy the door again.
                    _ => door = Door::open(HostPid(pid)).ok().flatten(),
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let wait_knocks = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(10);
        let from = knocks.load(Ordering::Relaxed);
        while knocks.load(Ordering::Relaxed) < from + n {
            assert!(Instant::now() < deadline, "the knocker does not knock");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_knocks(20);
    let t0 = Instant::now();
    let dump = s.dump(true);
    assert_prompt_split_dump(&s, &dump, t0.elapsed());
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
    // The door the dump sealed is open again, to the knocker too.
    wait_knocks(20);
    s.clear_images();
    let t0 = Instant::now();
    let dump = s.dump(false);
    assert_prompt_split_dump(&s, &dump, t0.elapsed());
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
    wait_knocks(20);
    stop.store(true, Ordering::Relaxed);
    knocker.join().expect("the knocker");
}
