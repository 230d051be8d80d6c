//! The state machine and the protocol checks against a real child process that has a
//! `fakecuda-rt` thread (this test binary, re-run as [`restore_thread_child`]).

use super::*;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

const CHILD_ENV: &str = "FAKECUDA_TEST_CHILD";

/// Not a test of its own: run by [`Target::start`] in a child process (with `CHILD_ENV` set),
/// it starts a `fakecuda-rt` thread and sleeps until it is killed (30 s at most).
#[test]
fn restore_thread_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    std::thread::Builder::new()
        .spawn(|| {
            // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
            unsafe { libc::prctl(libc::PR_SET_NAME, c"fakecuda-rt".as_ptr()) };
            loop {
                std::thread::sleep(Duration::from_millis(20));
            }
        })
        .unwrap();
    std::thread::sleep(Duration::from_secs(30));
    std::process::exit(0);
}

/// A child process with a restore thread, and a fresh state directory; killed on drop.
struct Target {
    child: Child,
    pid: i32,
    rt: i32,
    dir: PathBuf,
}

impl Target {
    fn start(name: &str) -> Target {
        let dir = std::env::temp_dir().join(format!("fakecuda-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "tests::restore_thread_child", "--nocapture"])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let deadline = Instant::now() + Duration::from_secs(10);
        let rt = loop {
            if let Some(rt) = restore_thread(pid) {
                break rt;
            }
            assert!(
                Instant::now() < deadline,
                "the child never named its thread"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        Target {
            child,
            pid,
            rt,
            dir,
        }
    }

    fn settings(&self) -> Settings {
        Settings::new(&self.dir)
    }

    fn state(&self) -> State {
        read_state(&self.dir, self.pid).unwrap()
    }

    fn log(&self) -> String {
        fs::read_to_string(log_path(&self.dir, self.pid)).unwrap_or_default()
    }

    /// Sends `sig` and waits until the restore thread is (`true`) or is not stopped.
    fn signal_and_wait(&self, sig: i32, stopped: bool) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.pid, sig) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while thread_state(self.pid, self.rt).map(is_stopped) != Some(stopped) {
            assert!(Instant::now() < deadline, "signal {sig} had no effect");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn args() -> OpArgs {
    OpArgs {
        initialised: true,
        ..OpArgs::default()
    }
}

#[test]
fn legal_transitions_only() {
    let t = Target::start("transitions");
    let s = t.settings();
    assert_eq!(get_restore_tid(&s, t.pid), Ok(t.rt));
    assert_eq!(get_state(&s, t.pid), Ok(State::Running));
    // Out of order: refused, state unchanged.
    for op in [Op::Checkpoint, Op::Restore, Op::Unlock] {
        assert_eq!(
            run_op(&s, t.pid, op, &args()),
            code::ILLEGAL_STATE,
            "{op:?}"
        );
    }
    assert_eq!(t.state(), State::Running);
    let expected = [
        (Op::Lock, State::Locked),
        (Op::Checkpoint, State::Checkpointed),
        (Op::Restore, State::Locked),
        (Op::Unlock, State::Running),
    ];
    for (op, after) in expected {
        assert_eq!(run_op(&s, t.pid, op, &args()), code::SUCCESS, "{op:?}");
        assert_eq!(t.state(), after);
        assert_eq!(get_state(&s, t.pid), Ok(after));
    }
    // Twice in a row is illegal.
    assert_eq!(run_op(&s, t.pid, Op::Unlock, &args()), code::ILLEGAL_STATE);
    assert_eq!(run_op(&s, t.pid, Op::Lock, &args()), code::SUCCESS);
    assert_eq!(run_op(&s, t.pid, Op::Lock, &args()), code::ILLEGAL_STATE);
    // A thread id stands for its process.
    let main_thread = t.pid;
    assert_eq!(get_restore_tid(&s, t.rt), Ok(t.rt));
    assert_eq!(get_state(&s, t.rt), Ok(State::Locked));
    assert_eq!(run_op(&s, t.rt, Op::Unlock, &args()), code::SUCCESS);
    assert_eq!(get_state(&s, main_thread), Ok(State::Running));

    let log = t.log();
    let lines: Vec<&str> = log.lines().collect();
    assert!(
        lines.iter().any(|l| l.starts_with(&format!(
            "lock rc=0 pid={} state=running->locked rt={} rt_state=",
            t.pid, t.rt
        ))),
        "{log}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("checkpoint rc=401 ")
            && l.contains(" state=running->running ")
            && l.contains("msg=checkpoint is illegal in state running")),
        "{log}"
    );
    assert!(lines.iter().all(|l| l.contains(" end_us=")), "{log}");
}

#[test]
fn stopped_restore_thread_fails_the_call() {
    let t = Target::start("stopped");
    let s = t.settings();
    assert_eq!(run_op(&s, t.pid, Op::Lock, &args()), code::SUCCESS);
    t.signal_and_wait(libc::SIGSTOP, true);
    assert_eq!(
        run_op(&s, t.pid, Op::Checkpoint, &args()),
        code::OPERATING_SYSTEM
    );
    assert_eq!(t.state(), State::Locked);
    assert!(
        t.log().contains("msg=restore thread stopped"),
        "{}",
        t.log()
    );
    assert!(t.log().contains(" rt_state=T app=T"), "{}", t.log());
    t.signal_and_wait(libc::SIGCONT, false);
    assert_eq!(run_op(&s, t.pid, Op::Checkpoint, &args()), code::SUCCESS);
    assert_eq!(t.state(), State::Checkpointed);
    // Every call needs it running.
    t.signal_and_wait(libc::SIGSTOP, true);
    assert_eq!(
        run_op(&s, t.pid, Op::Restore, &args()),
        code::OPERATING_SYSTEM
    );
    assert_eq!(t.state(), State::Checkpointed);
}

#[test]
fn injected_failures_happen_once_per_pid() {
    let t = Target::start("inject");
    let mut s = t.settings();
    s.fail = parse_injections("lock,checkpoint:after").unwrap();
    assert_eq!(run_op(&s, t.pid, Op::Lock, &args()), code::UNKNOWN);
    assert_eq!(t.state(), State::Running);
    assert_eq!(run_op(&s, t.pid, Op::Lock, &args()), code::SUCCESS);
    assert_eq!(t.state(), State::Locked);
    // `:after`: the state moved, the call still failed.
    assert_eq!(run_op(&s, t.pid, Op::Checkpoint, &args()), code::UNKNOWN);
    assert_eq!(t.state(), State::Checkpointed);
    // Aimed at another pid: no effect here.
    s.fail = parse_injections(&format!("restore@{}", t.pid + 1)).unwrap();
    assert_eq!(run_op(&s, t.pid, Op::Restore, &args()), code::SUCCESS);
    assert!(t.log().contains("msg=injected failure (FAKECUDA_FAIL)"));
    assert!(
        t.log()
            .contains("msg=injected failure after the state change")
    );
    // A malformed setting fails every call.
    let bad = Settings::from_vars(|k| (k == FAIL_ENV).then(|| "checkpiont".to_owned()));
    assert!(bad.error.as_deref().unwrap().contains("checkpiont"));
    assert_eq!(
        run_op(&bad, t.pid, Op::Unlock, &args()),
        code::INVALID_VALUE
    );
    assert_eq!(t.state(), State::Locked);
}

#[test]
fn lock_delay_beyond_the_timeout_times_out() {
    let t = Target::start("timeout");
    let mut s = t.settings();
    s.lock_delay_ms = 5000;
    let t0 = Instant::now();
    let timeout = OpArgs {
        timeout_ms: 100,
        ..args()
    };
    assert_eq!(run_op(&s, t.pid, Op::Lock, &timeout), code::TIMEOUT);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_millis(3000),
        "{took:?}"
    );
    assert_eq!(t.state(), State::Running);
    assert!(t.log().contains(" timeout_ms=100 "), "{}", t.log());
    // Within the timeout (or none): it succeeds after the delay.
    s.lock_delay_ms = 50;
    assert_eq!(run_op(&s, t.pid, Op::Lock, &args()), code::SUCCESS);
}

#[test]
fn restore_needs_cuinit_and_known_gpus() {
    let t = Target::start("restore-args");
    let s = t.settings();
    write_state(&t.dir, t.pid, State::Checkpointed).unwrap();
    let uninit = OpArgs::default();
    assert_eq!(
        run_op(&s, t.pid, Op::Restore, &uninit),
        code::NOT_INITIALIZED
    );
    let other = [0x11u8; 16];
    let bad_pair = OpArgs {
        pairs: vec![(DEVICE_UUID, other)],
        ..args()
    };
    assert_eq!(
        run_op(&s, t.pid, Op::Restore, &bad_pair),
        code::INVALID_VALUE
    );
    assert_eq!(t.state(), State::Checkpointed);
    let same = OpArgs {
        pairs: vec![(DEVICE_UUID, DEVICE_UUID)],
        ..args()
    };
    assert_eq!(run_op(&s, t.pid, Op::Restore, &same), code::SUCCESS);
    assert!(t.log().contains(" pairs=1 "), "{}", t.log());
}

#[test]
fn no_restore_thread_means_no_cuda_state() {
    let dir = std::env::temp_dir().join(format!("fakecuda-test-{}-none", std::process::id()));
    let s = Settings::new(&dir);
    let me = std::process::id() as i32;
    assert_eq!(get_restore_tid(&s, me), Err(code::NOT_INITIALIZED));
    assert_eq!(get_state(&s, me), Err(code::NOT_INITIALIZED));
    assert_eq!(run_op(&s, me, Op::Lock, &args()), code::NOT_INITIALIZED);
    assert!(!state_path(&dir, me).exists());
    let log = fs::read_to_string(log_path(&dir, me)).unwrap();
    assert_eq!(log.lines().count(), 3, "{log}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn argument_structs_are_checked() {
    let mut b = [0u8; ARGS_SIZE];
    b[0..4].copy_from_slice(&2500u32.to_ne_bytes());
    let mut a = OpArgs::default();
    lock_args(Some(b), &mut a);
    assert_eq!((a.timeout_ms, a.bad_args.as_deref()), (2500, None));
    b[40] = 1;
    lock_args(Some(b), &mut a);
    assert!(a.bad_args.unwrap().contains("reserved byte 40"));

    let pairs = [GpuPair {
        old: DEVICE_UUID,
        new: [7; 16],
    }];
    let mut r = [0u8; ARGS_SIZE];
    r[0..8].copy_from_slice(&(pairs.as_ptr() as usize).to_ne_bytes());
    r[8..12].copy_from_slice(&1u32.to_ne_bytes());
    let mut a = OpArgs::default();
    // SAFETY: the pointer in `r` points to `pairs`, one pair, alive for the call.
    unsafe { restore_args(Some(r), &mut a) };
    assert_eq!(a.pairs, vec![(DEVICE_UUID, [7; 16])]);
    assert!(a.bad_args.is_none());
    r[8..12].copy_from_slice(&0u32.to_ne_bytes());
    let mut a = OpArgs::default();
    // SAFETY: as above (the count is 0 now, so nothing is read).
    unsafe { restore_args(Some(r), &mut a) };
    assert!(a.bad_args.is_some());
}

#[test]
fn settings_from_the_environment() {
    let vars = |k: &str| match k {
        DIR_ENV => Some("/x".to_owned()),
        FAIL_ENV => Some("unlock, restore:after@42".to_owned()),
        LOCK_DELAY_ENV => Some("250".to_owned()),
        _ => None,
    };
    let s = Settings::from_vars(vars);
    assert_eq!(s.dir, Path::new("/x"));
    assert_eq!(
        s.fail,
        [
            Injection {
                op: Op::Unlock,
                after: false,
                pid: None
            },
            Injection {
                op: Op::Restore,
                after: true,
                pid: Some(42)
            }
        ]
    );
    assert_eq!((s.lock_delay_ms, s.call_delay_ms), (250, 0));
    assert!(s.error.is_none());
    let none = Settings::from_vars(|_| None);
    assert_eq!(none.dir, Path::new(DEFAULT_DIR));
    let bad = Settings::from_vars(|k| (k == CALL_DELAY_ENV).then(|| "1s".to_owned()));
    assert!(bad.error.unwrap().contains(CALL_DELAY_ENV));
    assert!(parse_injections("lock:before").is_err());
    assert!(parse_injections("lock@x").is_err());
}

#[test]
fn device_queries_after_cuinit() {
    let mut n: c_int = -1;
    // SAFETY: every pointer is a valid local of the documented type and size.
    unsafe {
        if !INITIALISED.load(Ordering::SeqCst) {
            assert_eq!(cuDeviceGetCount(&mut n), code::NOT_INITIALIZED);
        }
        assert_eq!(cuInit(1), code::INVALID_VALUE);
        assert_eq!(cuInit(0), code::SUCCESS);
        assert_eq!(cuDeviceGetCount(&mut n), code::SUCCESS);
    }
    assert_eq!(n, 1);
    let mut dev: c_int = -1;
    let mut uuid = [0u8; 16];
    let mut name = [0x55 as c_char; 5];
    let mut mem = 0usize;
    let mut v = 0;
    let mut s: *const c_char = std::ptr::null();
    // SAFETY: as above.
    unsafe {
        assert_eq!(cuDeviceGet(&mut dev, 1), code::INVALID_DEVICE);
        assert_eq!(cuDeviceGet(&mut dev, 0), code::SUCCESS);
        assert_eq!(cuDeviceGetUuid_v2(uuid.as_mut_ptr(), dev), code::SUCCESS);
        assert_eq!(
            cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev),
            code::SUCCESS
        );
        assert_eq!(cuDeviceTotalMem_v2(&mut mem, dev), code::SUCCESS);
        assert_eq!(cuDriverGetVersion(&mut v), code::SUCCESS);
        assert_eq!(cuGetErrorName(code::TIMEOUT, &mut s), code::SUCCESS);
        assert_eq!(CStr::from_ptr(s), c"CUDA_ERROR_TIMEOUT");
        assert_eq!(cuGetErrorName(12345, &mut s), code::INVALID_VALUE);
        assert!(s.is_null());
        assert_eq!(cuDeviceGetCount(std::ptr::null_mut()), code::INVALID_VALUE);
        assert_eq!(
            cuCheckpointProcessGetState(1, std::ptr::null_mut()),
            code::INVALID_VALUE
        );
    }
    assert_eq!((dev, uuid, mem, v), (0, DEVICE_UUID, 80 << 30, 13000));
    // Truncated to the buffer, NUL-terminated.
    // SAFETY: cuDeviceGetName NUL-terminated the buffer.
    assert_eq!(unsafe { CStr::from_ptr(name.as_ptr()) }, c"Fake");
}

#[test]
fn several_gpus_and_the_pairs_of_a_restore() {
    let vars = |k: &str| match k {
        DEVICES_ENV => Some("2".to_owned()),
        UUID_SALT_ENV => Some("7".to_owned()),
        DEVICE_NAME_ENV => Some("Other GPU".to_owned()),
        _ => None,
    };
    let s = Settings::from_vars(vars);
    assert!(s.error.is_none(), "{:?}", s.error);
    assert_eq!(s.devices, 2);
    assert_eq!(s.name(), b"Other GPU");
    let (a, b) = (s.uuid(0), s.uuid(1));
    assert_ne!(a, b);
    assert_eq!((a[4], a[15], b[15]), (7, 1, 2));
    assert_eq!(Settings::new("/x").uuid(0), DEVICE_UUID);
    for (var, v) in [(DEVICES_ENV, "0"), (DEVICES_ENV, "9"), (UUID_SALT_ENV, "0")] {
        let bad = Settings::from_vars(|k| (k == var).then(|| v.to_owned()));
        assert!(bad.error.unwrap().contains(var), "{var}={v}");
    }

    // Checkpointed on two GPUs (x, y); the host now has x, y or z, w.
    let (x, y, z, w) = ([1u8; 16], [2u8; 16], [3u8; 16], [4u8; 16]);
    assert!(check_pairs(&[x, y], &[x, y], &[]).is_ok());
    assert!(check_pairs(&[x, y], &[x, y], &[(x, y), (y, x)]).is_ok());
    assert!(check_pairs(&[x, y], &[z, w], &[(x, w), (y, z)]).is_ok());
    for (host, pairs, why) in [
        (vec![z, w], vec![], "not on this host"),
        (vec![z, w], vec![(z, w), (y, z)], "not checkpointed"),
        (vec![z, w], vec![(x, y), (y, z)], "does not exist"),
        (vec![z, w], vec![(x, z), (y, z)], "repeats"),
        (vec![z, w], vec![(x, z)], "missing from the GPU pairs"),
    ] {
        let e = check_pairs(&[x, y], &host, &pairs).unwrap_err();
        assert!(e.contains(why), "{e}");
    }

    // A checkpoint records the host's GPUs; the restore checks its pairs against them and logs
    // them.
    let t = Target::start("two-gpus");
    let two = Settings {
        devices: 2,
        ..t.settings()
    };
    for op in [Op::Lock, Op::Checkpoint] {
        assert_eq!(run_op(&two, t.pid, op, &args()), code::SUCCESS);
    }
    assert_eq!(
        read_gpus(&t.dir, t.pid).unwrap(),
        Some(vec![two.uuid(0), two.uuid(1)])
    );
    let moved = Settings {
        uuid_salt: 9,
        ..two.clone()
    };
    assert_eq!(
        run_op(&moved, t.pid, Op::Restore, &args()),
        code::INVALID_VALUE
    );
    let pairs = OpArgs {
        pairs: vec![(two.uuid(0), moved.uuid(1)), (two.uuid(1), moved.uuid(0))],
        ..args()
    };
    assert_eq!(run_op(&moved, t.pid, Op::Restore, &pairs), code::SUCCESS);
    let want = format!(
        " pairs=2 gpu_pairs={}={},{}={} ",
        hex(&two.uuid(0)),
        hex(&moved.uuid(1)),
        hex(&two.uuid(1)),
        hex(&moved.uuid(0))
    );
    assert!(t.log().contains(&want), "{want}\n{}", t.log());
}
