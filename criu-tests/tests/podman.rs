//! Podman end to end, with the gpusnap packages installed as a user installs them.
//!
//! The test builds `gpusnap_<version>_amd64.deb` and `gpusnap-criu_<criu>+gpusnap1_amd64.deb`
//! with `scripts/build-deb.sh --criu-root` (from this test build's plugin, agent and CLI, and
//! the harness's CRIU root: 4.1.1, or 4.2.x under `scripts/test.sh`'s second run), installs both
//! with `dpkg -i`, and sets one key in the installed `/etc/criu/gpusnap.conf` (`log_level =
//! "debug"`, which the plugin then reports): that file is gpusnap's only configuration. runc
//! (Debian 12's crun has no CRIU) finds the package's `/usr/sbin/criu` on its `PATH`. For the
//! GPU-like containers a wrapper first on runc's `PATH` adds the stand-in driver's variables
//! (`GPUSNAP_LIBCUDA`, `FAKECUDA_DIR`; `FAKECUDA_FAIL=restore` while a flag file exists) and
//! runs that `/usr/sbin/criu`; the CPU-only container is checkpointed with Podman's plain
//! `PATH`, nothing of the test's in it. The image is this build's workloads and their libraries
//! plus busybox (`busybox-static`), made with `podman import`: no registry.
//!
//! Then, with `podman container checkpoint --keep` and `restore --keep` (without `--keep`,
//! Podman deletes CRIU's logs after a success):
//! 1. a GPU-like process as the container's PID 1: dumped, restored (new host pid), runs on
//!    exactly; the driver calls and gpusnap's lines are the expected ones;
//! 2. the same, `--leave-running`: the job never stops counting, the driver is rolled back;
//! 3. `--export` then `restore --import` into a fresh container: the archive carries gpusnap's
//!    files (`gpusnap verify` with the installed CLI passes on the kept image), the copy runs on;
//! 4. a GPU-like process as the child of a shell (PID 1 is `sh`): dumped and restored;
//! 5. a restore of a container's PID 1 that fails in the driver: podman fails within a bound
//!    (it used to hang), naming the driver's error, the refused process is gone, nothing of
//!    the job runs, and a restore without the failure then runs it on from the same image;
//! 6. a CPU-only container, with Podman's own `PATH` (only the packages): the package's CRIU
//!    loads gpusnap, which stays out of the way, no driver call, it runs on;
//! 7. the split path: `fakegpu-vmm` on the stand-in device in a container started with
//!    `--device gpusnap.dev/agent=split` (the package's CDI spec mounts and preloads the agent):
//!    checkpoint and restore, `--leave-running`, `--export` and `--import` into a fresh
//!    container; each dump moved the device data through the agent into gpusnap's files, each
//!    restore loaded it back, and the job's device memory and counter go on exactly;
//!
//! and at the end `dpkg --purge gpusnap gpusnap-criu` leaves none of the packages' files and
//! puts `/usr/sbin/criu` (and dpkg's diversions) back as they were. Every podman command is
//! bounded in time ([`podman::COMMAND_LIMIT`]); containers and images are removed whether the
//! test passes or not, and those an earlier run left (killed before its clean-up: named
//! `gpusnap-test-<pid>-...`, that pid gone) before the test starts. Skipped, with the reason
//! printed, only where podman or runc is not installed.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criu_tests::fake_driver::{Call, FakeDriver, shorts};
use criu_tests::harness::skipped;
use criu_tests::packages::{self, CRIU_BIN, HostCriu, dpkg, host_criu};
use criu_tests::podman::{self, Podman};
use criu_tests::{CounterLog, Harness, harness, procs};

const FAKEGPU: &str = env!("CARGO_BIN_EXE_fakegpu");
const COUNTER: &str = env!("CARGO_BIN_EXE_counter");
const TEST: &str = "podman";
const CONF: &str = "/etc/criu/gpusnap.conf";
const CDI_SPEC: &str = "/etc/cdi/gpusnap.json";
/// The packages' files that must exist once they are installed.
const PACKAGE_FILES: [&str; 7] = [
    "/usr/lib/criu/gpusnap.so",
    "/usr/lib/gpusnap/libgpusnap_agent.so",
    "/usr/bin/gpusnap",
    "/usr/libexec/gpusnap/gpusnap-keeper",
    CONF,
    CDI_SPEC,
    "/usr/lib/gpusnap-criu/usr/sbin/criu",
];
/// Where the image has the stand-in device library, as `libcuda.so.1`.
const FAKE_LIBCUDA_DIR: &str = "/usr/local/lib/fakecuda";
/// How soon a restored or rolled-back job must be counting again.
const PROMPTLY: Duration = Duration::from_secs(10);
/// Ticks (50 ms each) a job must add to count as running.
const MORE_TICKS: u64 = 5;
/// How long a restore that fails in the driver may take, in all.
const FAILED_RESTORE_WITHIN: Duration = Duration::from_secs(60);

/// Everything the test set up; dropping it removes containers, images and the package.
struct Setup {
    h: &'static Harness,
    work: PathBuf,
    logs: PathBuf,
    fake: FakeDriver,
    podman: Podman,
    image: String,
    fail_flag: PathBuf,
    installed: bool,
    /// `/usr/sbin/criu` and dpkg's diversions before the packages were installed.
    before: HostCriu,
    /// Unique part of every name (the test's pid).
    tag: String,
    /// Held while the package is installed (dropped last).
    _lock: podman::HostLock,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.podman.clean_up();
        if self.installed {
            let _ = dpkg(&["--purge", "gpusnap", "gpusnap-criu"], &self.work);
        }
        if std::thread::panicking() {
            eprintln!("criu-tests: keeping {} for inspection", self.work.display());
        } else {
            let _ = fs::remove_dir_all(&self.work);
        }
    }
}

fn setup() -> Option<Setup> {
    let h = harness(TEST)?;
    if let Some(why) = podman::cannot_run() {
        skipped(TEST, &why);
        return None;
    }
    let lock = podman::HostLock::take(Duration::from_secs(300)).unwrap_or_else(|e| panic!("{e}"));
    let tag = std::process::id().to_string();
    let work = h
        .profile_dir
        .join("criu-tests")
        .join(format!("{TEST}-{tag}"));
    let _ = fs::remove_dir_all(&work);
    let logs = work.join("logs");
    fs::create_dir_all(&logs).unwrap();
    let fake_dir = work.join("fakecuda");
    fs::create_dir_all(&fake_dir).unwrap();
    let so = criu_tests::fake_driver::fakecuda_so(h)
        .unwrap_or_else(|e| panic!("building the fake driver: {e}"))
        .to_owned();
    let fake = FakeDriver { so, dir: fake_dir };
    // The host's device stand-in: the keeper's driver library. The container ships its own copy
    // as its libcuda.so.1, which root's keeper never loads (another file than the host's).
    let (host_device_so, _) = criu_tests::fake_driver::fake_device(h)
        .unwrap_or_else(|e| panic!("building the stand-in device: {e}"));
    let fail_flag = work.join("fail-restore");
    let wrapper = format!(
        "#!/bin/sh\n\
         # For runc (first on its PATH): the packaged criu with the stand-in driver.\n\
         GPUSNAP_LIBCUDA='{so}'\n\
         FAKECUDA_DIR='{dir}'\n\
         GPUSNAP_TEST_KEEPER_LIBCUDA='{keeper_lib}'\n\
         export GPUSNAP_LIBCUDA FAKECUDA_DIR GPUSNAP_TEST_KEEPER_LIBCUDA\n\
         if [ -e '{flag}' ]; then FAKECUDA_FAIL=restore; export FAKECUDA_FAIL; fi\n\
         exec {CRIU_BIN} \"$@\"\n",
        so = fake.so.display(),
        dir = fake.dir.display(),
        keeper_lib = host_device_so.display(),
        flag = fail_flag.display(),
    );
    let podman = Podman::new(&work, &wrapper).unwrap_or_else(|e| panic!("{e}"));
    // An earlier run killed before its clean-up left its containers (running) and image.
    for what in podman.remove_stale() {
        eprintln!("criu-tests: removed {what}, left by an earlier run of the test");
    }
    let mut s = Setup {
        h,
        logs,
        fake,
        podman,
        image: format!("localhost/gpusnap-test:{tag}"),
        fail_flag,
        installed: false,
        before: HostCriu {
            criu: None,
            diversions: String::new(),
        },
        tag,
        work,
        _lock: lock,
    };
    install_package(&mut s);
    make_image(&mut s);
    Some(s)
}

/// Builds the package from this test build and installs it; the one configuration change.
fn install_package(s: &mut Setup) {
    let h = s.h;
    // Refuse to overwrite a gpusnap that was not installed by the packages.
    for p in ["gpusnap", "gpusnap-criu"] {
        if packages::installed(p, &s.work) {
            dpkg(&["--purge", p], &s.work).unwrap().assert_ok();
        }
    }
    s.before = host_criu(&s.work);
    for f in PACKAGE_FILES {
        assert!(
            !Path::new(f).exists(),
            "{f} exists and is not from the gpusnap package: the test will not overwrite it"
        );
    }
    let (deb, criu_deb) = packages::build(h, &s.work);
    let (deb, criu_deb) = (deb.display().to_string(), criu_deb.display().to_string());
    let (deb, criu_deb) = (deb.as_str(), criu_deb.as_str());
    s.installed = true;
    let install = dpkg(&["-i", deb, criu_deb], &s.work).unwrap_or_else(|e| panic!("{e}"));
    install.assert_ok();
    for f in PACKAGE_FILES {
        assert!(
            Path::new(f).is_file(),
            "{f} is missing after dpkg -i {deb} {criu_deb}"
        );
    }
    // The package's criu is the harness's, and it is what a plain PATH finds.
    let v = h.criu_version;
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin; command -v criu && criu --version"]);
    let found = podman::run_bounded(&mut cmd, "criu --version", &s.work, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    found.assert_ok();
    assert!(
        found.stdout.starts_with(&format!("{CRIU_BIN}\n"))
            && found.stdout.contains(&format!("Version: {}.{}", v.0, v.1)),
        "the criu on PATH is not the package's {}.{}.{}\n{found}",
        v.0,
        v.1,
        v.2
    );
    // The installed configuration changes nothing until a line is uncommented.
    let conf = fs::read_to_string(CONF).unwrap();
    let active: Vec<&str> = conf
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .collect();
    assert!(active.is_empty(), "{CONF} sets {active:?}");
    fs::write(CONF, format!("{conf}\nlog_level = \"debug\"\n")).unwrap();
}

/// The image: busybox, this build's `fakegpu` and `counter`, and their shared libraries (if any).
fn make_image(s: &mut Setup) {
    let rootfs = s.work.join("rootfs");
    let (fakecudadev, vmm) = criu_tests::fake_driver::fake_device(s.h)
        .unwrap_or_else(|e| panic!("building the stand-in device: {e}"));
    let agent =
        s.h.agent_so()
            .unwrap_or_else(|e| panic!("building the agent: {e}"));
    assert!(
        Path::new("/bin/busybox").is_file(),
        "/bin/busybox is missing: install busybox-static (.ci/run does)"
    );
    let put = |src: &Path, dst: &str| {
        let to = rootfs.join(dst.trim_start_matches('/'));
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(src, &to).unwrap_or_else(|e| panic!("{} -> {}: {e}", src.display(), to.display()));
    };
    let libcuda = format!("{FAKE_LIBCUDA_DIR}/libcuda.so.1");
    // The agent itself comes from the host (the CDI spec mounts it); its libraries must be in
    // the image, as they must be in any image that uses it.
    let agent_libs = rootfs.join("agent-libs-only");
    for (bin, at) in [
        (Path::new("/bin/busybox"), "/bin/busybox"),
        (Path::new(FAKEGPU), "/usr/local/bin/fakegpu"),
        (Path::new(COUNTER), "/usr/local/bin/counter"),
        (vmm, "/usr/local/bin/fakegpu-vmm"),
        (fakecudadev, libcuda.as_str()),
        (agent, "/agent-libs-only/agent.so"),
    ] {
        put(bin, at);
        for lib in podman::shared_libraries(bin).unwrap_or_else(|e| panic!("{e}")) {
            put(&lib, &lib.display().to_string());
        }
    }
    fs::remove_dir_all(&agent_libs).unwrap();
    for tool in ["sh", "sleep", "cat", "true"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(tool)).unwrap();
    }
    fs::create_dir_all(rootfs.join("logs")).unwrap();
    fs::create_dir_all(rootfs.join("tmp")).unwrap();
    let tar = s.work.join("image.tar");
    let mut cmd = std::process::Command::new("tar");
    cmd.arg("-C").arg(&rootfs).arg("-cf").arg(&tar).arg(".");
    podman::run_bounded(&mut cmd, "tar", &s.work, Duration::from_secs(60))
        .unwrap()
        .assert_ok();
    s.podman.images.push(s.image.clone());
    s.podman
        .run(&["import", &tar.display().to_string(), &s.image])
        .assert_ok();
}

/// Starts a container; `args` is its command.
fn start(s: &mut Setup, name: &str, args: &[&str]) -> String {
    start_with(s, name, &[], args)
}

/// Starts a container with the `podman run` options `opts`; `args` is its command.
fn start_with(s: &mut Setup, name: &str, opts: &[&str], args: &[&str]) -> String {
    let name = format!("gpusnap-test-{}-{name}", s.tag);
    s.podman.containers.push(name.clone());
    let logs = format!("{}:/logs", s.logs.display());
    let mut run = vec![
        "run",
        "-d",
        "--name",
        &name,
        "--network",
        "none",
        "-v",
        &logs,
    ];
    run.extend_from_slice(opts);
    run.push(&s.image);
    run.extend_from_slice(args);
    let out = s.podman.run(&run);
    assert!(
        out.ok(),
        "the container does not start (on hosts without CAP_SYS_RESOURCE, containers.conf needs ulimits within the hard limits: {:?})\n{out}",
        Podman::containers_conf()
    );
    name
}

fn log_path(s: &Setup, job: &str) -> PathBuf {
    s.logs.join(format!("{job}.log"))
}

/// Waits until the job's log has `min` ticks.
fn wait_ticks(s: &Setup, job: &str, min: u64) -> CounterLog {
    CounterLog::wait_for(&log_path(s, job), min, PROMPTLY)
        .unwrap_or_else(|e| panic!("job {job} does not count: {e}"))
}

/// The job counts on from `from` within [`PROMPTLY`], its whole log consistent (counter,
/// memory checksum and in-memory chain continue exactly).
fn assert_runs_on(s: &Setup, job: &str, from: u64, what: &str) -> CounterLog {
    let log = CounterLog::wait_for(&log_path(s, job), from + MORE_TICKS, PROMPTLY)
        .unwrap_or_else(|e| panic!("{what}: job {job} does not run on: {e}"));
    log.verify()
        .unwrap_or_else(|e| panic!("{what}: job {job}'s state is damaged: {e}"));
    log
}

/// CRIU's log of the last checkpoint or restore of `name`.
fn criu_log(s: &Setup, name: &str, which: &str) -> String {
    let field = match which {
        "dump" => "{{.State.CheckpointLog}}",
        _ => "{{.State.RestoreLog}}",
    };
    let path = s.podman.inspect(name, field);
    fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{which} log {path:?} of {name}: {e} (was --keep given?)"))
}

fn gpusnap_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| criu_tests::criu::is_gpusnap_line(l))
        .collect()
}

/// `log` has a gpusnap line with every one of `needles`.
fn assert_line(log: &str, needles: &[&str], what: &str) {
    let lines = gpusnap_lines(log);
    assert!(
        lines.iter().any(|l| needles.iter().all(|n| l.contains(n))),
        "{what}: no gpusnap line with {needles:?}; gpusnap said:\n{}",
        lines.join("\n")
    );
}

/// The configuration came from the installed file, and from nothing else.
fn assert_configured_by_file(log: &str, what: &str) {
    assert_line(log, &["gpusnap: configuration:", "log_level=debug"], what);
}

fn context(s: &Setup, pids: &[i32], logs: &[&str]) -> String {
    let mut c = String::new();
    for &p in pids {
        c.push_str(&format!(
            "--- fake driver log of {p} ---\n{}",
            s.fake.log_text(p)
        ));
    }
    for l in logs {
        c.push_str("--- gpusnap lines ---\n");
        c.push_str(&gpusnap_lines(l).join("\n"));
        c.push('\n');
    }
    c
}

/// The driver calls other than the lock ran with CRIU holding every application thread, and
/// the restore thread ran during all of them.
fn assert_protocol(calls: &[Call], ctx: &str) {
    for c in calls {
        assert!(
            !c.rt_stopped(),
            "{} ran with the restore thread stopped\n{ctx}",
            c.call
        );
        if c.call != "lock" {
            assert!(
                c.app_all_traced(),
                "{} ran with application threads not held\n{ctx}",
                c.call
            );
        }
    }
}

/// The host pid of the GPU-like process of container `name`: its init, or (`child`) the
/// init's only child.
fn gpu_pid(s: &Setup, name: &str, child: bool) -> i32 {
    let init = s.podman.init_pid(name);
    assert!(init > 0, "container {name} is not running");
    if !child {
        return init;
    }
    let deadline = Instant::now() + PROMPTLY;
    loop {
        match procs::children(init).as_slice() {
            [p] => return *p,
            other if Instant::now() > deadline => {
                panic!("the shell {init} of {name} has children {other:?}, expected one")
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// The pids the stand-in driver has a log of (it was called about them).
fn driver_log_pids(s: &Setup) -> Vec<i32> {
    let mut v: Vec<i32> = fs::read_dir(&s.fake.dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.strip_suffix(".log")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort_unstable();
    v
}

/// The pid of host pid `pid` in its own (innermost) pid namespace.
fn ns_pid(pid: i32) -> i32 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|st| {
            st.lines()
                .find_map(|l| l.strip_prefix("NSpid:"))?
                .split_whitespace()
                .last()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no NSpid for pid {pid}"))
}

/// Checkpoint (the container stops) and restore of a GPU-like job; returns the ticks at the
/// restore.
fn dump_and_restore(s: &mut Setup, name: &str, job: &str, child: bool) -> u64 {
    let pid = gpu_pid(s, name, child);
    let nspid = ns_pid(pid);
    if !child {
        assert_eq!(nspid, 1, "{name}: the job is not the container's PID 1");
    }
    s.podman
        .run(&["container", "checkpoint", "--keep", name])
        .assert_ok();
    let dump = criu_log(s, name, "dump");
    let ctx = context(s, &[pid], &[&dump]);
    assert_configured_by_file(&dump, name);
    assert_line(
        &dump,
        &[&format!("(nspid {nspid}): CUDA state found")],
        name,
    );
    assert_line(&dump, &["dump phases"], name);
    let ops = s.fake.ops(pid);
    assert_eq!(shorts(&ops), ["lock:0", "checkpoint:0"], "{ctx}");
    assert_protocol(&ops, &ctx);
    let images = PathBuf::from(s.podman.inspect(name, "{{.State.CheckpointPath}}"));
    let manifest = gpusnap_image::manifest_file_name(gpusnap_proto::pid::NsPid(nspid as u32));
    assert!(
        images.join(&manifest).is_file(),
        "{name}: no {manifest} in {}\n{ctx}",
        images.display()
    );
    let status = s.podman.inspect(name, "{{.State.Status}}");
    assert_eq!(status, "exited", "{name} after checkpoint\n{ctx}");
    let at_dump = CounterLog::read(&log_path(s, job)).unwrap().unwrap().last();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        CounterLog::read(&log_path(s, job)).unwrap().unwrap().last(),
        at_dump,
        "{name}: the job ran on after its checkpoint"
    );

    s.podman
        .run(&["container", "restore", "--keep", name])
        .assert_ok();
    let restore = criu_log(s, name, "restore");
    let restored = gpu_pid(s, name, child);
    let ctx = context(s, &[restored], &[&restore]);
    assert_configured_by_file(&restore, name);
    assert_ne!(restored, pid, "{name}: same host pid after restore\n{ctx}");
    let ops = s.fake.ops(restored);
    assert_eq!(shorts(&ops), ["restore:0", "unlock:0"], "{ctx}");
    assert_eq!(ops[0].before.as_deref(), Some("checkpointed"), "{ctx}");
    assert_protocol(&ops, &ctx);
    assert_eq!(
        s.fake.state_in_memory(restored).as_deref(),
        Some("running"),
        "{ctx}"
    );
    let log = assert_runs_on(s, job, at_dump, &format!("{name} restored"));
    assert_eq!(log.pid, nspid, "{name}: the job's pid in its namespace");
    assert_eq!(
        ns_pid(restored),
        nspid,
        "{name}: the restored job's pid in its namespace"
    );
    at_dump
}

#[test]
fn podman_checkpoint_restore_with_the_package() {
    let t0 = Instant::now();
    let Some(mut s) = setup() else {
        return;
    };
    let v = s.h.criu_version;
    eprintln!(
        "criu-tests: podman test with CRIU {}.{}.{} ({}), package installed in {:.1} s",
        v.0,
        v.1,
        v.2,
        packages::criu_root(s.h).display(),
        t0.elapsed().as_secs_f64()
    );

    // `gpusnap check` from the package sees what the containers need.
    let mut cmd = s.podman.command("/usr/bin/gpusnap");
    cmd.arg("check");
    let check = podman::run_bounded(&mut cmd, "gpusnap check", &s.work, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    let criu_line = format!("is CRIU {}.{}.{}: what runc runs for Podman", v.0, v.1, v.2);
    for want in [
        "ok    plugin /usr/lib/criu/gpusnap.so",
        "ok    criu on PATH",
        &criu_line,
        "ok    podman's runtime runc can checkpoint",
        "ok    Podman keeps CRIU's logs",
        "ok    CDI spec /etc/cdi/gpusnap.json: `--device gpusnap.dev/agent=split`",
        "reads CDI specs from /etc/cdi and /var/run/cdi",
    ] {
        assert!(
            check.stdout.contains(want),
            "`gpusnap check` lacks {want:?}\n{check}"
        );
    }

    // 1. PID 1.
    let init = start(
        &mut s,
        "init",
        &[
            "/usr/local/bin/fakegpu",
            "--log",
            "/logs/init.log",
            "--seed",
            "401",
        ],
    );
    wait_ticks(&s, "init", 3);
    dump_and_restore(&mut s, &init, "init", false);

    // 2. --leave-running on the restored container: the job never stops.
    let pid = gpu_pid(&s, &init, false);
    let before = CounterLog::read(&log_path(&s, "init"))
        .unwrap()
        .unwrap()
        .last();
    s.podman
        .run(&[
            "container",
            "checkpoint",
            "--keep",
            "--leave-running",
            &init,
        ])
        .assert_ok();
    let dump = criu_log(&s, &init, "dump");
    let ctx = context(&s, &[pid], &[&dump]);
    assert_configured_by_file(&dump, "leave-running");
    assert_eq!(
        s.podman.inspect(&init, "{{.State.Status}}"),
        "running",
        "{ctx}"
    );
    assert_eq!(s.podman.init_pid(&init), pid, "{ctx}");
    let ops = s.fake.ops(pid);
    assert_eq!(
        shorts(&ops),
        [
            "restore:0",
            "unlock:0",
            "lock:0",
            "checkpoint:0",
            "restore:0",
            "unlock:0"
        ],
        "{ctx}"
    );
    assert_eq!(
        s.fake.state_in_memory(pid).as_deref(),
        Some("running"),
        "{ctx}"
    );
    assert_runs_on(&s, "init", before, "after --leave-running");

    // 3. --export, then --import into a fresh container.
    let archive = s.work.join("init-export.tar");
    let archive_s = archive.display().to_string();
    s.podman
        .run(&[
            "container",
            "checkpoint",
            "--keep",
            "--export",
            &archive_s,
            &init,
        ])
        .assert_ok();
    let images = PathBuf::from(s.podman.inspect(&init, "{{.State.CheckpointPath}}"));
    let verify = std::process::Command::new("/usr/bin/gpusnap")
        .arg("verify")
        .arg(&images)
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "gpusnap verify {}: {}\n{}",
        images.display(),
        verify.status,
        String::from_utf8_lossy(&verify.stdout)
    );
    let listing = s.podman_tar_listing(&archive);
    let manifest = gpusnap_image::manifest_file_name(gpusnap_proto::pid::NsPid(1));
    assert!(
        listing.iter().any(|f| f.ends_with(&manifest)),
        "the export archive has no {manifest}: {listing:?}"
    );
    let at_export = CounterLog::read(&log_path(&s, "init"))
        .unwrap()
        .unwrap()
        .last();
    let copy = format!("gpusnap-test-{}-copy", s.tag);
    s.podman.containers.push(copy.clone());
    s.podman
        .run(&[
            "container",
            "restore",
            "--keep",
            "--import",
            &archive_s,
            "--name",
            &copy,
        ])
        .assert_ok();
    let restore = criu_log(&s, &copy, "restore");
    let copied = gpu_pid(&s, &copy, false);
    let ctx = context(&s, &[copied], &[&restore]);
    assert_configured_by_file(&restore, "import");
    assert_eq!(
        shorts(&s.fake.ops(copied)),
        ["restore:0", "unlock:0"],
        "{ctx}"
    );
    assert_runs_on(&s, "init", at_export, "the imported copy");
    s.podman.run(&["rm", "-f", "-t", "0", &copy]).assert_ok();
    s.podman.run(&["rm", "-f", "-t", "0", &init]).assert_ok();

    // 4. The GPU-like process as the child of a shell.
    let shell = start(
        &mut s,
        "shell",
        &[
            "/bin/sh",
            "-c",
            "/usr/local/bin/fakegpu --log /logs/shell.log --seed 402 & wait",
        ],
    );
    wait_ticks(&s, "shell", 3);
    dump_and_restore(&mut s, &shell, "shell", true);

    // 5. A restore of a container's PID 1 that fails in the driver: a clear error, in bounded
    //    time (it used to hang podman), nothing of the job runs, no process is left; then a
    //    restore without the failure runs the job on from the same image.
    let failing = start(
        &mut s,
        "fail",
        &[
            "/usr/local/bin/fakegpu",
            "--log",
            "/logs/fail.log",
            "--seed",
            "404",
        ],
    );
    wait_ticks(&s, "fail", 3);
    s.podman
        .run(&["container", "checkpoint", "--keep", &failing])
        .assert_ok();
    let at_dump = CounterLog::read(&log_path(&s, "fail"))
        .unwrap()
        .unwrap()
        .last();
    let logged_before: Vec<i32> = driver_log_pids(&s);
    fs::write(&s.fail_flag, "").unwrap();
    let t = Instant::now();
    let failed = s.podman.run_within(
        &["container", "restore", "--keep", &failing],
        FAILED_RESTORE_WITHIN,
    );
    let took = t.elapsed();
    fs::remove_file(&s.fail_flag).unwrap();
    assert!(
        !failed.ok(),
        "the restore succeeded with the driver failing\n{failed}"
    );
    let restore = criu_log(&s, &failing, "restore");
    assert_line(
        &restore,
        &["cuCheckpointProcessRestore failed"],
        "failed restore",
    );
    assert_ne!(
        s.podman.inspect(&failing, "{{.State.Status}}"),
        "running",
        "{failed}"
    );
    // The restored init the driver refused: exactly one new process the driver saw, its one
    // call the injected failure, and it is gone.
    let refused: Vec<i32> = driver_log_pids(&s)
        .into_iter()
        .filter(|p| !logged_before.contains(p))
        .collect();
    let ctx = context(&s, &refused, &[&restore]);
    let [refused] = refused.as_slice() else {
        panic!("expected one restored process in the driver's logs, got {refused:?}\n{ctx}");
    };
    assert_eq!(shorts(&s.fake.ops(*refused)), ["restore:999"], "{ctx}");
    assert!(
        procs::reap(*refused, PROMPTLY).is_ok() && !procs::is_alive(*refused),
        "the refused process {refused} is still there\n{ctx}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        CounterLog::read(&log_path(&s, "fail"))
            .unwrap()
            .unwrap()
            .last(),
        at_dump,
        "the job ran after its failed restore"
    );
    eprintln!("criu-tests: podman restore failed in the driver, as it must, in {took:?}");
    s.podman
        .run(&["container", "restore", "--keep", &failing])
        .assert_ok();
    assert_runs_on(&s, "fail", at_dump, "restore after the failed one");
    s.podman.run(&["rm", "-f", "-t", "0", &failing]).assert_ok();
    s.podman.run(&["rm", "-f", "-t", "0", &shell]).assert_ok();

    // 6. A CPU-only container: gpusnap stays out of the way. Checkpointed and restored with a
    //    plain system PATH, so that what runc runs is the package's criu and nothing else.
    let cpu = start(
        &mut s,
        "cpu",
        &[
            "/usr/local/bin/counter",
            "--log",
            "/logs/cpu.log",
            "--seed",
            "403",
        ],
    );
    wait_ticks(&s, "cpu", 3);
    let pid = gpu_pid(&s, &cpu, false);
    s.podman.plain_path = true;
    s.podman
        .run(&["container", "checkpoint", "--keep", &cpu])
        .assert_ok();
    let dump = criu_log(&s, &cpu, "dump");
    assert_configured_by_file(&dump, "cpu");
    assert!(
        !gpusnap_lines(&dump)
            .iter()
            .any(|l| l.contains("CUDA state found")),
        "gpusnap found CUDA state in a CPU-only container:\n{}",
        gpusnap_lines(&dump).join("\n")
    );
    let at_dump = CounterLog::read(&log_path(&s, "cpu"))
        .unwrap()
        .unwrap()
        .last();
    s.podman
        .run(&["container", "restore", "--keep", &cpu])
        .assert_ok();
    s.podman.plain_path = false;
    assert_configured_by_file(&criu_log(&s, &cpu, "restore"), "cpu restore");
    let restored = gpu_pid(&s, &cpu, false);
    for p in [pid, restored] {
        assert!(
            s.fake.ops(p).is_empty(),
            "driver calls for the CPU-only job:\n{}",
            s.fake.log_text(p)
        );
    }
    assert_runs_on(&s, "cpu", at_dump, "CPU-only container restored");
    s.podman.run(&["rm", "-f", "-t", "0", &cpu]).assert_ok();

    // 7. The split path, the agent added by the package's CDI spec.
    split_path(&mut s);

    // Clean up, then the packages must leave nothing behind and put back what was there.
    s.podman.clean_up();
    let mut files = String::new();
    for p in ["gpusnap", "gpusnap-criu"] {
        let listed = dpkg(&["-L", p], &s.work).unwrap();
        listed.assert_ok();
        files.push_str(&listed.stdout);
    }
    dpkg(&["--purge", "gpusnap", "gpusnap-criu"], &s.work)
        .unwrap()
        .assert_ok();
    s.installed = false;
    let left: Vec<&str> = files
        .lines()
        .filter(|f| {
            let p = Path::new(f);
            // Directories shared with other packages (/usr, /etc, ...) stay; files must not,
            // except a file the purge put back (Debian's diverted criu).
            (p.symlink_metadata().is_ok_and(|m| !m.is_dir())
                && !(*f == CRIU_BIN && s.before.criu.is_some()))
                || (p.is_dir() && f.contains("gpusnap"))
        })
        .collect();
    assert!(
        left.is_empty(),
        "dpkg --purge gpusnap gpusnap-criu left {left:?}"
    );
    for f in [CONF, CDI_SPEC] {
        assert!(!Path::new(f).exists(), "{f} is still there after purge");
    }
    assert_eq!(
        host_criu(&s.work),
        s.before,
        "the purge did not put {CRIU_BIN} and dpkg's diversions back as they were"
    );
    eprintln!(
        "criu-tests: podman test passed in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

/// The log of `fakegpu-vmm` (`tick K counter C ok 1` lines after a `pid` line): every tick
/// good, consecutive from 1, the device counter equal to it; returns the last tick.
fn vmm_ticks(path: &Path) -> Result<u64, String> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        // Not started yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let mut last = 0u64;
    for line in text.lines().filter(|l| l.starts_with("tick ")) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let good = matches!(f.as_slice(), ["tick", k, "counter", c, "ok", "1"]
            if k.parse::<u64>() == Ok(last + 1) && c == k);
        if !good {
            return Err(format!("after tick {last}: {line:?}\n{text}"));
        }
        last += 1;
    }
    Ok(last)
}

/// Waits until the split job's log has more than `from` ticks, every one of them good.
fn vmm_runs_on(s: &Setup, name: &str, from: u64, what: &str) -> u64 {
    let path = log_path(s, "split");
    let deadline = Instant::now() + PROMPTLY;
    let said = || s.podman.run(&["logs", name]).to_string();
    loop {
        match vmm_ticks(&path) {
            Ok(n) if n >= from + MORE_TICKS => return n,
            Ok(n) if Instant::now() > deadline => panic!(
                "{what}: the split job is at tick {n}, not past {from} + {MORE_TICKS}\n{}",
                said()
            ),
            Err(e) => panic!("{what}: the split job's log is wrong: {e}\n{}", said()),
            Ok(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// The split path in a container: `fakegpu-vmm` with the agent from the CDI spec (one
/// `--device` flag), its driver state in its own memory (`FAKECUDADEV_STATE_PAGE=1`: the stand-in
/// device would otherwise look for it under the pid it has in the container).
fn split_path(s: &mut Setup) {
    let libpath = format!("LD_LIBRARY_PATH={FAKE_LIBCUDA_DIR}");
    let name = start_with(
        s,
        "split",
        &[
            "--device",
            "gpusnap.dev/agent=split",
            "-e",
            &libpath,
            "-e",
            "FAKECUDADEV_STATE_PAGE=1",
        ],
        &[
            "/usr/local/bin/fakegpu-vmm",
            "--log",
            "/logs/split.log",
            "--seed",
            "405",
            "--allocs",
            "2",
            "--mib",
            "4",
        ],
    );
    let ticks = vmm_runs_on(s, &name, 0, "split job started");
    let pid = gpu_pid(s, &name, false);
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        maps.contains("/usr/lib/gpusnap/libgpusnap_agent.so"),
        "the CDI device did not preload the agent into {name}"
    );
    let split_dump = |s: &Setup, name: &str, what: &str| -> String {
        let dump = criu_log(s, name, "dump");
        assert_configured_by_file(&dump, what);
        assert_line(&dump, &["(nspid 1)", "path split"], what);
        assert_line(&dump, &["data", "into", "files"], what);
        assert_line(&dump, &["agent released 3 allocations"], what);
        dump
    };
    let split_restore = |s: &Setup, name: &str, what: &str| {
        let restore = criu_log(s, name, "restore");
        assert_configured_by_file(&restore, what);
        assert_line(&restore, &["restored (Split path)", "data"], what);
    };

    // Checkpoint (the container stops), restore.
    s.podman
        .run(&["container", "checkpoint", "--keep", &name])
        .assert_ok();
    split_dump(s, &name, "split checkpoint");
    let images = PathBuf::from(s.podman.inspect(&name, "{{.State.CheckpointPath}}"));
    let verify = std::process::Command::new("/usr/bin/gpusnap")
        .arg("verify")
        .arg(&images)
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "gpusnap verify {}: {}\n{}",
        images.display(),
        verify.status,
        String::from_utf8_lossy(&verify.stdout)
    );
    let at_dump = vmm_ticks(&log_path(s, "split")).unwrap();
    assert!(at_dump >= ticks);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        vmm_ticks(&log_path(s, "split")).unwrap(),
        at_dump,
        "the split job ran on after its checkpoint"
    );
    s.podman
        .run(&["container", "restore", "--keep", &name])
        .assert_ok();
    split_restore(s, &name, "split restore");
    assert_ne!(gpu_pid(s, &name, false), pid, "same host pid after restore");
    let now = vmm_runs_on(s, &name, at_dump, "split restored");

    // --leave-running: the job goes on, its memory mapped back from what it kept at the
    // hand-over (the keeper ran from the package's /usr/libexec/gpusnap).
    let running = gpu_pid(s, &name, false);
    s.podman
        .run(&[
            "container",
            "checkpoint",
            "--keep",
            "--leave-running",
            &name,
        ])
        .assert_ok();
    let dump = split_dump(s, &name, "split --leave-running");
    assert_line(&dump, &["lent to keeper"], "split --leave-running");
    assert_line(
        &dump,
        &["device memory mapped back", "no file read"],
        "split --leave-running",
    );
    assert_eq!(s.podman.init_pid(&name), running);
    let now = vmm_runs_on(s, &name, now, "split after --leave-running");

    // --export, then --import into a fresh container.
    let archive = s.work.join("split-export.tar");
    let archive_s = archive.display().to_string();
    s.podman
        .run(&[
            "container",
            "checkpoint",
            "--keep",
            "--export",
            &archive_s,
            &name,
        ])
        .assert_ok();
    split_dump(s, &name, "split --export");
    let at_export = vmm_ticks(&log_path(s, "split")).unwrap();
    assert!(at_export >= now);
    s.podman.run(&["rm", "-f", "-t", "0", &name]).assert_ok();
    let copy = format!("gpusnap-test-{}-split-copy", s.tag);
    s.podman.containers.push(copy.clone());
    s.podman
        .run(&[
            "container",
            "restore",
            "--keep",
            "--import",
            &archive_s,
            "--name",
            &copy,
        ])
        .assert_ok();
    split_restore(s, &copy, "split --import");
    vmm_runs_on(s, &copy, at_export, "the imported split copy");
    s.podman.run(&["rm", "-f", "-t", "0", &copy]).assert_ok();
}

impl Setup {
    /// The file names in a tar archive (compressed or not).
    fn podman_tar_listing(&self, archive: &Path) -> Vec<String> {
        let mut cmd = std::process::Command::new("tar");
        cmd.arg("-tf").arg(archive);
        let out = podman::run_bounded(&mut cmd, "tar -tf", &self.work, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"));
        out.assert_ok();
        out.stdout.lines().map(str::to_owned).collect()
    }
}
