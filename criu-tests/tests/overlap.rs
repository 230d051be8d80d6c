//! Careless operators and busy clusters (issue 33): two dumps of one job at once, and a job
//! stopped by a signal. Real CRIU on the stand-in driver, the hand-over on (the default).

mod common;

use std::time::{Duration, Instant};

use common::split::Split;

const ARGS: &[&str] = &["--seed", "17", "--allocs", "3", "--mib", "4"];

/// Two `criu dump -R` of one job started together: one is refused before it touches anything
/// (naming the other operation), the other dumps; the job computes on, its driver state is
/// `running`, and nothing needs `gpusnap recover`. Repeated, since who wins is a race (before
/// the job lock, 2 runs of 4 left the job locked by the driver and stopped).
#[test]
fn two_dumps_of_one_job_never_strand_it() {
    let Some(mut s) = Split::launch("overlap-two-dumps", 1, ARGS, &[]) else {
        return;
    };
    s.vmm.wait_for_tick(2);
    for round in 0..4 {
        let dirs: Vec<_> = (0..2)
            .map(|i| {
                let d = s.w.path.join(format!("images-{round}-{i}"));
                std::fs::create_dir_all(&d).expect("mkdir images");
                d
            })
            .collect();
        let pid = s.vmm.pid().to_string();
        let runs: Vec<_> = std::thread::scope(|sc| {
            let handles: Vec<_> = dirs
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let s = &s;
                    let pid = pid.as_str();
                    sc.spawn(move || {
                        s.criu_at(
                            d,
                            "dump",
                            &format!("dump-{round}-{i}.log"),
                            &["-t", pid, "--leave-running"],
                            &[],
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let ok = runs.iter().filter(|r| r.succeeded()).count();
        let described = runs
            .iter()
            .map(|r| s.describe(r))
            .collect::<Vec<_>>()
            .join("\n=====\n");
        let describe = || described.clone();
        assert!(
            ok >= 1,
            "round {round}: neither dump succeeded\n{}",
            describe()
        );
        for r in runs.iter().filter(|r| !r.succeeded()) {
            // The loser failed cleanly: refused by the job lock, or by CRIU itself (the other
            // CRIU had seized the process), never a rollback that left something behind.
            assert!(
                !r.log.contains("ROLLBACK FAILED")
                    && !r.log.contains(&format!("gpusnap recover {pid}")),
                "round {round}: a failed dump left the job to recover\n{}",
                describe()
            );
        }
        assert_eq!(
            s.driver_state(),
            "running",
            "round {round}: the driver state is not running\n{}",
            describe()
        );
        assert!(s.vmm.original_running(), "round {round}\n{}", describe());
        let last = s.vmm.last_ticks();
        let t0 = Instant::now();
        while s.vmm.last_ticks()[0] < last[0] + 2 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "round {round}: the job stopped computing\n{}",
                describe()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A job stopped by SIGSTOP: the dump says so at once (it used to wait about 10 s for CRIU's
/// timeout and speak of a long-running kernel), touches nothing, and the job runs on once
/// continued.
#[test]
fn a_stopped_job_is_named_as_stopped() {
    let Some(s) = Split::launch("overlap-sigstop", 1, ARGS, &[]) else {
        return;
    };
    s.vmm.wait_for_tick(2);
    let pid = s.vmm.pid();
    // SAFETY: kill(2) of the test's own workload.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let t0 = Instant::now();
    let dump = s.dump(true);
    let took = t0.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(!dump.succeeded(), "{}", s.describe(&dump));
    s.assert_line(&dump, &["is stopped", "kill -CONT"]);
    assert!(
        took < Duration::from_secs(5),
        "took {took:?}\n{}",
        s.describe(&dump)
    );
    assert_eq!(s.driver_state(), "running", "{}", s.describe(&dump));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
}

/// Unmounts a test's tmpfs, also when the test fails.
struct Tmpfs(std::path::PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A disk that fills up around the drain (a 330 MiB tmpfs, a 4×32 MiB job). The drain's space
/// is held from the checkpoint on, so CRIU's own part now runs out first and fails the dump;
/// should the drain still run out after CRIU's part (CRIU then exits 0: its fini hook cannot
/// fail the dump), the dump says so on stderr in one fixed line, marks the directory
/// NOT-A-CHECKPOINT, and `gpusnap verify` and `criu restore` refuse it (that branch is also
/// played by `handover.rs`'s keeper killed after CRIU's part). Either way the job runs on.
/// (It used to exit 0 with nothing on stderr and gpusnap's files deleted.)
#[test]
fn a_disk_full_during_the_drain_is_never_a_checkpoint() {
    let Some(mut s) = Split::launch(
        "overlap-disk-full",
        1,
        &["--seed", "19", "--allocs", "4", "--mib", "32"],
        &[],
    ) else {
        return;
    };
    s.vmm.wait_for_tick(2);
    let full = s.w.path.join("full");
    std::fs::create_dir_all(&full).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=330m", "gpusnap-test-full"])
        .arg(&full)
        .status()
        .expect("mount");
    assert!(mounted.success(), "mount tmpfs");
    let _umount = Tmpfs(full.clone());
    let pid = s.vmm.pid().to_string();
    let dump = s.criu_at(
        &full,
        "dump",
        "dump-full.log",
        &["-t", pid.as_str(), "--leave-running"],
        &[],
    );
    let marker = full.join(format!("gpusnap-{pid}-NOT-A-CHECKPOINT.txt"));
    if dump.status.success() {
        assert!(
            dump.output
                .lines()
                .any(|l| l.starts_with("gpusnap: NOT A CHECKPOINT:")),
            "CRIU exited 0 without saying the image is not a checkpoint\n{}",
            s.describe(&dump)
        );
        assert!(
            marker.is_file(),
            "no {}\n{}",
            marker.display(),
            s.describe(&dump)
        );
        let (ok, text) = s.run_cli(&["verify", full.to_str().unwrap()]);
        assert!(!ok, "gpusnap verify took it: {text}");
        let restore = s.criu_at(
            &full,
            "restore",
            "restore-full.log",
            &["--restore-detached"],
            &[],
        );
        assert!(
            !restore.status.success(),
            "criu restore took it\n{}",
            s.describe(&restore)
        );
        // Refused once, naming the marker (the AMD side used to repeat the refusal).
        s.assert_line(&restore, &["NOT-A-CHECKPOINT"]);
        assert!(
            !restore.log.contains("amd: restore refused"),
            "the refusal was repeated\n{}",
            s.describe(&restore)
        );
    } else {
        eprintln!("overlap-disk-full: CRIU's own part failed (the disk filled before the drain)");
    }
    assert!(s.vmm.original_running(), "{}", s.describe(&dump));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
}

/// A job at its descriptor limit (two free under its soft RLIMIT_NOFILE): the dump is refused
/// before anything moves, naming the limit, and the job runs on. (It used to exit 0 with the
/// job held, and the `gpusnap recover` it suggested failed with a bare driver error.)
#[test]
fn a_job_at_its_descriptor_limit_is_refused_naming_it() {
    let Some(s) = Split::launch("overlap-nofile", 1, ARGS, &[]) else {
        return;
    };
    s.vmm.wait_for_tick(2);
    let pid = s.vmm.pid();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit(2) reading the workload's limit into a valid rlimit.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    // Only the soft limit is lowered (raising the hard one needs CAP_SYS_RESOURCE).
    let lim = libc::rlimit {
        rlim_cur: open + 2,
        rlim_max: old.rlim_max,
    };
    // SAFETY: prlimit(2) of the test's own workload with a valid rlimit; old limit not read.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &lim, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let dump = s.dump(true);
    assert!(!dump.succeeded(), "{}", s.describe(&dump));
    s.assert_line(&dump, &["RLIMIT_NOFILE", "nothing was moved"]);
    assert_eq!(s.driver_state(), "running", "{}", s.describe(&dump));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
}

/// A keeper stopped (SIGSTOP) once it is ready, before the lend: the dump notices within a
/// tenth of a second that it cannot answer, copies the memory first instead, and the job runs
/// on. (It used to hold the job for the 30 s agent timeout and 5 s more.)
#[test]
fn a_stopped_keeper_is_given_up_at_once() {
    let Some(s) = Split::launch("overlap-keeper-stopped", 1, ARGS, &[]) else {
        return;
    };
    s.vmm.wait_for_tick(2);
    let log = s.w.path.join("dump.log");
    let mut args = s.w.criu_args_in("dump", &s.w.images, &log);
    args.extend(["-t".to_owned(), s.vmm.pid().to_string(), "-R".to_owned()]);
    let env = [
        ("GPUSNAP_LIBCUDA", s.fakecuda_so.to_str().expect("utf-8")),
        ("FAKECUDA_DIR", s.state.to_str().expect("utf-8")),
        (
            "GPUSNAP_TEST_KEEPER_LIBCUDA",
            s.job_libcuda.to_str().expect("utf-8"),
        ),
        // The driver lock takes a while: the keeper is stopped before the lend.
        ("FAKECUDA_CALL_DELAY_MS", "300"),
    ];
    let t0 = Instant::now();
    let mut criu = s.w.spawn_criu(&args, &env, &log);
    let keeper = loop {
        let text = criu.log_so_far();
        if let Some(pid) = common::split::keeper_pid(&text) {
            break pid;
        }
        assert!(
            criu.try_status().is_none() && t0.elapsed() < common::WAIT,
            "criu ended or took too long before planning a hand-over:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    // SAFETY: kill(2) of the keeper the test's CRIU started.
    unsafe { libc::kill(keeper, libc::SIGSTOP) };
    let dump = criu.wait(Duration::from_secs(60)).expect("criu");
    let took = t0.elapsed();
    s.assert_ok(&dump);
    s.assert_line(&dump, &["is stopped", "given up on at once"]);
    assert!(
        took < Duration::from_secs(15),
        "the dump took {took:?} with a stopped keeper\n{}",
        s.describe(&dump)
    );
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
}

/// A disk without room for the GPU data at the checkpoint (a 100 MiB tmpfs, a 4×32 MiB job):
/// the hand-over's space reservation fails while the dump can still fail, so CRIU exits
/// non-zero naming the lack of space, nothing is released, no image claims the job, and the
/// job runs on. (Before the reservation the drain ran into the full disk after CRIU's part.)
#[test]
fn a_disk_without_room_for_the_gpu_data_fails_the_dump() {
    let Some(s) = Split::launch(
        "overlap-no-room",
        1,
        &["--seed", "23", "--allocs", "4", "--mib", "32"],
        &[],
    ) else {
        return;
    };
    s.vmm.wait_for_tick(2);
    let small = s.w.path.join("small");
    std::fs::create_dir_all(&small).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=100m", "gpusnap-test-small"])
        .arg(&small)
        .status()
        .expect("mount");
    assert!(mounted.success(), "mount tmpfs");
    let _umount = Tmpfs(small.clone());
    let pid = s.vmm.pid().to_string();
    let dump = s.criu_at(
        &small,
        "dump",
        "dump-small.log",
        &["-t", pid.as_str(), "--leave-running"],
        &[],
    );
    assert!(!dump.status.success(), "{}", s.describe(&dump));
    s.assert_line(
        &dump,
        &["bytes free for the GPU data", "nothing was released"],
    );
    assert!(
        dump.output.contains("bytes free for the GPU data"),
        "not on CRIU's stderr\n{}",
        s.describe(&dump)
    );
    assert_eq!(s.driver_state(), "running", "{}", s.describe(&dump));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
}

/// The drain's space is held from PAUSE on (beside the keeper's start, the lock and the lend,
/// not on the job's pause) and the drain writes its data files into it, on a tmpfs as
/// `/dev/shm` is: the hand-over says how long it waited for the space, the image verifies
/// (each data file whole, at the size the manifest gives), and no unfinished name is left.
/// With 2 writers and a reservation of one piece, the second writer's file takes its space from
/// the first one's piece, and every write stays inside what was held.
#[test]
fn the_drains_space_is_held_from_pause_on_and_written_into() {
    let Some(s) = Split::launch(
        "overlap-held",
        1,
        &["--seed", "29", "--allocs", "4", "--mib", "32"],
        &[("GPUSNAP_WRITER_THREADS", "2")],
    ) else {
        return;
    };
    s.vmm.wait_for_tick(2);
    let dir = s.w.path.join("shm");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2g", "gpusnap-test-held"])
        .arg(&dir)
        .status()
        .expect("mount");
    assert!(mounted.success(), "mount tmpfs");
    let _umount = Tmpfs(dir.clone());
    let pid = s.vmm.pid().to_string();
    let dump = s.criu_at(
        &dir,
        "dump",
        "dump-held.log",
        &["-t", pid.as_str(), "--leave-running"],
        &[],
    );
    s.assert_ok(&dump);
    s.assert_line(
        &dump,
        &["space for the drain held", "taken from PAUSE on", "waited"],
    );
    // Every write stayed inside what was held.
    assert!(
        dump.gpusnap_lines_with("past the space held").is_empty(),
        "{}",
        s.describe(&dump)
    );
    let (ok, text) = s.run_cli(&["verify", dir.to_str().unwrap()]);
    assert!(ok, "gpusnap verify: {text}\n{}", s.describe(&dump));
    let names: Vec<String> = std::fs::read_dir(&dir)
        .expect("read the image dir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .filter(|n| n.starts_with("gpusnap-"))
        .collect();
    let data = names.iter().filter(|n| n.contains("-data-")).count();
    assert!((1..=2).contains(&data), "{names:?}");
    assert!(
        names.iter().any(|n| n.ends_with("-manifest.img"))
            && !names.iter().any(|n| n.ends_with(".tmp")
                || n.contains("PENDING")
                || n.contains("NOT-A-CHECKPOINT")),
        "{names:?}"
    );
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
}
