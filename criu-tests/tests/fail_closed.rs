//! Fail closed, end to end: CRIU killed at every named point of a dump, a `dump -R` and a
//! restore (`GPUSNAP_TEST_KILL_CRIU_AT`, common/host/src/fault.rs), on the split path (`fakegpu-vmm`
//! with the agent, `mode = auto`) and on the transparent path (the same workload, `mode =
//! transparent`: the driver checkpoints everything and CRIU dumps the device memory).
//!
//! No job may compute on missing or partial device memory, whatever dies:
//!
//! - a kill during a dump or its rollback leaves the workload held (by the driver lock, or
//!   group-stopped by the SIGSTOP the plugin queued before the memory went away), or, where its
//!   memory is in place and unlocked, running on intact; it never logs a bad tick, and `gpusnap
//!   recover PID --images DIR` brings it back bit-exact (or says there is nothing to recover);
//! - a kill during a restore kills the half-restored process (`PTRACE_O_EXITKILL`): it is dead
//!   and reaped, nothing of it ran, the image still passes `gpusnap verify`, and a new restore
//!   runs on bit-exact;
//! - a point the path or operation never reaches is detected as such: CRIU finishes normally,
//!   with no fault line, and the operation's usual outcome is checked.
//!
//! Beside the matrix: a rollback whose reload fails part-way or hangs in the agent, `gpusnap
//! recover` itself killed part-way (the knob works in its environment too), and the image
//! directory filling up before or after the release.
//!
//! Which state each kill must leave is written down below ([`expected`]), from the plugin's
//! protocol, not from what a run showed; [`the_matrix_names_every_fault_point`] keeps the table
//! in step with the plugin's list of points.
//!
//! Root and CRIU are needed, as for `criu-tests`; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::thread::sleep;
use std::time::Duration;

use common::split::{AtDump, Split};
use criu_tests::fixtures::Tmpfs;
use criu_tests::{CriuRun, procs};

/// The knob (the plugin's `fault::ENV`).
const KNOB: &str = "GPUSNAP_TEST_KILL_CRIU_AT";

/// After CRIU's death, a driver call or a tick already past its last driver call may still
/// finish: the workload is sampled this long after, then watched for [`HELD_FOR`].
const SETTLE: Duration = Duration::from_millis(100);

/// How long a held workload is watched (6 ticks of 50 ms) for a tick it must not log.
const HELD_FOR: Duration = Duration::from_millis(300);

/// Every point the test covers, in the plugin's order.
const POINTS: &[&str] = &[
    "dump-locked",
    "dump-data-out",
    "dump-lent",
    "dump-released",
    "dump-relocked",
    "dump-checkpointed",
    "dump-drained",
    "dump-before-manifest",
    "rollback-restored",
    "rollback-reload",
    "rollback-reclaimed",
    "restore-keeper-load",
    "restore-keeper-loaded",
    "restore-handing-over",
    "restore-control",
    "restore-unlocked",
    "restore-data",
    "restore-host-check",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// `mode = auto` with the agent, `handover = false`: the agent copies the data into
    /// gpusnap's files before the driver checkpoint.
    Split,
    /// `mode = auto` with the agent, `handover = true` (the default): the memory is lent to
    /// the keeper, which drains it beside CRIU's dump.
    HandOver,
    /// `mode = transparent`: the driver checkpoint of everything, CRIU dumps the memory.
    Transparent,
}

impl Route {
    /// gpusnap's settings for CRIU, at dump and restore alike (after [`start`]'s, which turn
    /// the hand-over off for the tests beside the matrix).
    fn config(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Route::Split => vec![],
            Route::HandOver => vec![("GPUSNAP_HANDOVER", "1")],
            Route::Transparent => vec![("GPUSNAP_MODE", "transparent")],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// `criu dump` (the workload is killed once dumped).
    Dump,
    /// `criu dump -R` (the rollback runs the workload on).
    DumpLeaveRunning,
    /// `criu restore` of a good dump.
    Restore,
}

/// What holds a workload whose CRIU died during a dump or rollback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// The driver lock (its driver calls wait); no thread is stopped.
    Lock,
    /// The group stop of the plugin's hold: every thread in state `T`.
    Stopped,
    /// The driver lock, and maybe still the hold (CRIU's main thread drains the hold once the
    /// lock is back; the kill may come before or after that).
    LockOrStopped,
}

/// What a kill at a point leaves behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Left {
    /// Dump side, memory in place and unlocked: the workload runs on; `gpusnap recover` finds
    /// nothing to do.
    RunsOn,
    /// Dump side: held; `gpusnap recover` takes these steps (its message, in order).
    Held(Held, &'static str),
    /// Restore side: the half-restored process is killed with CRIU.
    Killed,
    /// Restore side, CRIU killed during its own restore (the keeper's load runs beside it):
    /// the half-restored process dies with CRIU, or is left asleep in CRIU's restorer code,
    /// where it never runs the application; once it is killed, the image restores again.
    KilledOrAsleepInCriu,
}

/// What a kill at `point` must leave on `route` in `op`; `None` where the point is not reached
/// (CRIU must then finish normally).
fn expected(route: Route, op: Op, point: &str) -> Option<Left> {
    use Held::*;
    use Route::*;
    let dump = matches!(op, Op::Dump | Op::DumpLeaveRunning);
    let split = route == Split;
    let lent = route == HandOver;
    Some(match point {
        // PAUSE: locked while it runs, before CRIU seizes it; nothing moved.
        "dump-locked" if dump => Left::Held(Lock, "unlock"),
        // Split: unlocked for the agent, the first chunk written, nothing released, no hold.
        "dump-data-out" if dump && split => Left::RunsOn,
        // Hand-over: the drain wrote its first chunk, while the job's thread releases, relocks or
        // has the driver checkpoint the job (the drain runs beside them).
        "dump-data-out" if dump && lent => Left::Held(
            LockOrStopped,
            "device memory mapped back|unlock, device memory mapped back|driver restore, unlock, device memory mapped back",
        ),
        // Hand-over: the keeper holds the memory, the job's not yet released, no hold.
        "dump-lent" if dump && lent => Left::RunsOn,
        // Split: held (SIGSTOP queued), memory released, unlocked.
        "dump-released" if dump && split => Left::Held(Stopped, "device data reloaded"),
        // Hand-over: the same, the memory in the job's kept descriptors (and the keeper's).
        "dump-released" if dump && lent => Left::Held(Stopped, "device memory mapped back"),
        // Split: locked again, the hold handed to CRIU's main thread to drain.
        "dump-relocked" if dump && split => {
            Left::Held(LockOrStopped, "unlock, device data reloaded")
        }
        "dump-relocked" if dump && lent => {
            Left::Held(LockOrStopped, "unlock, device memory mapped back")
        }
        // Checkpointed by the driver (split: memory released, the hold drained or about to be).
        "dump-checkpointed" if dump && split => Left::Held(
            LockOrStopped,
            "driver restore, unlock, device data reloaded",
        ),
        // Hand-over: checkpointed, the drain running, done, or joined in `exit`.
        "dump-checkpointed" | "dump-drained" | "dump-before-manifest" if dump && lent => {
            Left::Held(
                LockOrStopped,
                "driver restore, unlock, device memory mapped back",
            )
        }
        "dump-checkpointed" if dump => Left::Held(Lock, "driver restore, unlock"),
        // The rollback's driver restore done: locked; split: the rollback's hold placed before
        // it (memory still released), transparent: nothing released, no hold.
        "rollback-restored" if op == Op::DumpLeaveRunning && split => {
            Left::Held(Stopped, "unlock, device data reloaded")
        }
        "rollback-restored" if op == Op::DumpLeaveRunning && lent => {
            Left::Held(Stopped, "unlock, device memory mapped back")
        }
        "rollback-restored" if op == Op::DumpLeaveRunning => Left::Held(Lock, "unlock"),
        // Split: unlocked, held, the first chunk reloaded.
        "rollback-reload" if op == Op::DumpLeaveRunning && split => {
            Left::Held(Stopped, "device data reloaded")
        }
        // Hand-over: mapped back, the hold not yet let go: whole, but stopped.
        "rollback-reclaimed" if op == Op::DumpLeaveRunning && lent => Left::Held(Stopped, ""),
        // Hand-over restore: the keeper's load beside CRIU's restore, its end, the job's first
        // map of handed-over memory. The job is killed; the image stays good.
        "restore-keeper-load" if op == Op::Restore && lent => Left::KilledOrAsleepInCriu,
        "restore-keeper-loaded" | "restore-handing-over" if op == Op::Restore && lent => {
            Left::Killed
        }
        "restore-control" | "restore-unlocked" if op == Op::Restore => Left::Killed,
        // The agent's own load (the hand-over route loads in the keeper instead).
        "restore-data" if op == Op::Restore && split => Left::Killed,
        // Split, the hash kernel failing in the restored process (the cell injects that): all
        // loaded, the GPU checked none, the host check of the image begins.
        // (On the hand-over route the keeper loads and checks: the job's kernel is not used.)
        "restore-host-check" if op == Op::Restore && split => Left::Killed,
        _ => return None,
    })
}

/// The workload: 3 allocations of 4 MiB (the last one odd-sized), a counter, a small one.
fn start(test: &str) -> Option<Split> {
    // The copy-first route unless a cell asks for the hand-over (`Route::config`).
    Split::launch(
        test,
        1,
        &["--seed", "23", "--allocs", "3", "--mib", "4"],
        &[("GPUSNAP_HANDOVER", "0")],
    )
}

fn run_op(s: &Split, route: Route, op: Op, extra: &[(&'static str, &'static str)]) -> CriuRun {
    let mut config = route.config();
    config.extend_from_slice(extra);
    match op {
        Op::Dump => s.dump_with(false, &config),
        Op::DumpLeaveRunning => s.dump_with(true, &config),
        Op::Restore => s.restore_with(&config),
    }
}

/// Whether the plugin killed this CRIU at `point`: killed by SIGKILL after its fault line.
/// A CRIU killed without the line, or a fault line without the kill, fails the test.
fn killed_at(s: &Split, run: &CriuRun, point: &str) -> bool {
    let line = format!("test fault {KNOB}={point}: killing CRIU now");
    let said = run.gpusnap_lines().iter().any(|l| l.contains(&line));
    let killed = run.status.signal() == Some(libc::SIGKILL);
    assert_eq!(
        said,
        killed,
        "fault line {said}, CRIU killed {killed} ({})\n{}",
        run.status,
        s.describe(run)
    );
    assert!(
        !killed || !run.log.contains("finished successfully"),
        "CRIU finished and was killed too\n{}",
        s.describe(run)
    );
    killed
}

/// `/proc` state letters of every thread of `pid`, and whether any is traced.
fn threads(pid: i32) -> (String, bool) {
    let tids = procs::tids(pid);
    let states = tids
        .iter()
        .map(|&t| procs::stat(t).map_or('?', |s| s.state))
        .collect();
    let traced = tids.iter().any(|&t| procs::tracer_pid(t) != Some(0));
    (states, traced)
}

fn assert_verifies(s: &Split, run: &CriuRun) {
    let images = s.w.images.to_str().expect("utf-8 path");
    let (ok, text) = s.run_cli(&["verify", images]);
    assert!(
        ok,
        "gpusnap verify {images} failed:\n{text}\n{}",
        s.describe(run)
    );
}

/// Every tick logged so far is good (`ok 1`, consecutive, the device counter equal to it).
fn assert_no_bad_tick(s: &Split, run: &CriuRun, what: &str) {
    for log in s.vmm.read() {
        if let Err(e) = log.check() {
            panic!("{what}: {e}\n{}", s.describe(run));
        }
    }
}

/// One cell of the matrix: CRIU with the knob at `point` on `route` in `op`, and what it must
/// leave.
fn cell(route: Route, op: Op, point: &'static str) {
    let test = format!("fc-{route:?}-{op:?}-{point}").to_lowercase();
    let Some(mut s) = start(&test) else {
        return;
    };
    let what = format!("{route:?} {op:?}, CRIU killed at {point}");
    // A restore needs a good image first; the driver state the stand-in keeps in a file plays
    // the one inside the process image (checkpointed), which a new restore must find again.
    let mut last = Vec::new();
    let mut image = AtDump::default();
    if op == Op::Restore {
        let dump = run_op(&s, route, Op::Dump, &[]);
        s.assert_ok(&dump);
        last = s.reap_dumped();
        image = AtDump::of(&s);
        assert_eq!(image.driver_state, "checkpointed", "{}", s.describe(&dump));
        if point == "restore-host-check" {
            // The only way there: the GPU cannot check what it loaded.
            s.inject("fail cuLaunchKernel");
        }
    }
    let before = s.vmm.last_ticks();
    let run = run_op(&s, route, op, &[(KNOB, point)]);
    let killed = killed_at(&s, &run, point);
    let want = expected(route, op, point);
    assert_eq!(
        killed,
        want.is_some(),
        "{what}: CRIU killed: {killed}, expected to reach the point: {}\n{}",
        want.is_some(),
        s.describe(&run)
    );
    match want {
        None => not_reached(&mut s, route, op, &run, &before, &last),
        Some(Left::Killed) => {
            restore_killed(&mut s, route, &run, &last, &image, &what);
        }
        Some(Left::KilledOrAsleepInCriu) => {
            end_asleep_in_criu(&s, &run, &last, &what);
            restore_killed(&mut s, route, &run, &last, &image, &what);
        }
        Some(left) => dump_killed(&mut s, &run, left, &what),
    }
}

/// The point is not on this path: the operation did what it always does.
fn not_reached(
    s: &mut Split,
    route: Route,
    op: Op,
    run: &CriuRun,
    before: &[u64],
    dumped_at: &[u64],
) {
    s.assert_ok(run);
    if op != Op::Restore {
        match route {
            Route::Split => s.assert_line(run, &["agent released"]),
            Route::HandOver => s.assert_line(run, &["lent to keeper"]),
            Route::Transparent => s.assert_line(run, &["path transparent"]),
        }
    }
    match op {
        Op::Dump => {
            assert_verifies(s, run);
            let last = s.reap_dumped();
            assert!(last >= before.to_vec(), "{last:?} {before:?}");
            assert_no_bad_tick(s, run, "dumped workload");
        }
        Op::DumpLeaveRunning => {
            assert!(s.vmm.original_running(), "{}", s.describe(run));
            s.assert_runs_on(&s.vmm.last_ticks(), run);
        }
        Op::Restore => s.assert_runs_on(dumped_at, run),
    }
}

/// Whether CRIU died while its parasite was in the (one) dumped process: it had switched the
/// parasite to daemon mode and had not yet come to the process tree, which it dumps once every
/// process is cured.
fn parasite_was_inside(run: &CriuRun) -> bool {
    let Some(infected) = run.log.rfind("has been switched to daemon mode") else {
        return false;
    };
    !run.log[infected..].contains("Dumping pstree")
}

/// CRIU died during a dump or its rollback: the workload is held or runs on intact, never on
/// missing memory (or, killed with CRIU's parasite inside it, dead), and `gpusnap recover`
/// brings it back.
fn dump_killed(s: &mut Split, run: &CriuRun, left: Left, what: &str) {
    let pid = s.vmm.pid();
    if !s.vmm.original_running() && parasite_was_inside(run) {
        // A kill on the drain's thread can land while CRIU's main thread works in the process
        // through its parasite: the process dies with CRIU then, GPU or not (CRIU's own
        // limit). Nothing of it ran on missing memory, and no image claims to be whole.
        assert_no_bad_tick(s, run, what);
        assert!(
            !s.w.images.join("inventory.img").exists(),
            "{what}: CRIU wrote an inventory before it died\n{}",
            s.describe(run)
        );
        eprintln!("{what}: the workload died with CRIU's parasite inside it (CRIU's own limit)");
        return;
    }
    assert!(
        s.vmm.original_running(),
        "{what}: the workload died\n{}",
        s.describe(run)
    );
    sleep(SETTLE);
    let at_kill = s.vmm.last_ticks();
    let steps = match left {
        Left::RunsOn => {
            s.assert_runs_on(&at_kill, run);
            let (states, traced) = threads(pid);
            assert!(
                !traced && !states.contains(['t', 'T']),
                "{what}: threads {states:?}, traced {traced}\n{}",
                s.describe(run)
            );
            None
        }
        Left::Held(held, steps) => {
            sleep(HELD_FOR);
            assert_no_bad_tick(s, run, what);
            assert_eq!(
                s.vmm.last_ticks(),
                at_kill,
                "{what}: the workload ran on while it should be held\n{}",
                s.describe(run)
            );
            let (states, traced) = threads(pid);
            let stopped = !states.is_empty() && states.chars().all(|c| c == 'T');
            let none_stopped = !states.contains(['t', 'T']);
            let as_expected = match held {
                Held::Lock => none_stopped,
                Held::Stopped => stopped,
                Held::LockOrStopped => stopped || none_stopped,
            };
            assert!(
                as_expected && !traced,
                "{what}: expected {held:?}; threads {states:?}, traced {traced} (CRIU is dead)\n{}",
                s.describe(run)
            );
            Some(steps)
        }
        Left::Killed | Left::KilledOrAsleepInCriu => unreachable!("restore side"),
    };
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    let (ok, text) = s.run_cli(&["recover", &pid.to_string(), "--images", &images]);
    // `a|b`: the steps are one of these (a kill on the drain's thread lands in whichever
    // phase the job's own thread has reached); an empty one: nothing is left to undo.
    let said: Vec<String> = match steps {
        None | Some("") => vec!["nothing to recover".to_owned()],
        Some(steps) => steps
            .split('|')
            .map(|s| format!("recovered ({s}); it runs again"))
            .collect(),
    };
    assert!(
        ok && said.iter().any(|s| text.contains(s)),
        "{what}: gpusnap recover: ok {ok}, expected {said:?}:\n{text}\n{}",
        s.describe(run)
    );
    assert_eq!(s.driver_state(), "running", "{what}\n{}", s.describe(run));
    s.assert_runs_on(&at_kill, run);
    let (states, traced) = threads(pid);
    assert!(
        !traced && !states.contains(['t', 'T']),
        "{what}: after recover: threads {states:?}, traced {traced}\n{}",
        s.describe(run)
    );
}

/// CRIU died during a restore: the restored process died with it, nothing of it ran, the image
/// is intact and restores.
/// CRIU died during its own restore: what is left of the workload must not have run (no tick
/// since the dump) and sleeps in CRIU's restorer (state `S`); it is killed, as its user would.
fn end_asleep_in_criu(s: &Split, run: &CriuRun, dumped_at: &[u64], what: &str) {
    std::thread::sleep(HELD_FOR);
    assert_eq!(
        s.vmm.last_ticks(),
        dumped_at,
        "{what}: the workload ran after CRIU died in its restore\n{}",
        s.describe(run)
    );
    for &pid in &s.vmm.pids {
        if let Some(st) = procs::stat(pid) {
            assert!(
                st.state == 'S' || st.state == 'Z',
                "{what}: pid {pid} left in state {}\n{}",
                st.state,
                s.describe(run)
            );
            eprintln!("{what}: pid {pid} left asleep in CRIU's restorer; killing it");
            // SAFETY: kill(2) of the test's own half-restored workload.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn restore_killed(
    s: &mut Split,
    route: Route,
    run: &CriuRun,
    dumped_at: &[u64],
    image: &AtDump,
    what: &str,
) {
    let pid = s.vmm.pid();
    // Reaped (we are the subreaper CRIU's orphans come to) and gone, its log as at the dump.
    s.assert_nothing_runs(dumped_at, run);
    procs::wait_pid_free(pid, common::WAIT).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_verifies(s, run);
    image.put_back(s);
    let again = s.restore_in("restore-again.log", &route.config());
    s.assert_ok(&again);
    s.assert_runs_on(dumped_at, &again);
}

/// The table above names the plugin's points, no more, no fewer, in its order; every point is
/// reached by some route and operation, and every restore point only by restores.
#[test]
fn the_matrix_names_every_fault_point() {
    assert_eq!(POINTS, gpusnap_host::fault::POINTS);
    for p in POINTS {
        let reached: Vec<(Route, Op)> = [Route::Split, Route::HandOver, Route::Transparent]
            .into_iter()
            .flat_map(|r| {
                [Op::Dump, Op::DumpLeaveRunning, Op::Restore]
                    .into_iter()
                    .map(move |o| (r, o))
            })
            .filter(|(r, o)| expected(*r, *o, p).is_some())
            .collect();
        assert!(!reached.is_empty(), "{p} is never reached");
        let restore = reached.iter().all(|(_, o)| *o == Op::Restore);
        assert_eq!(restore, p.starts_with("restore-"), "{p}: {reached:?}");
    }
}

macro_rules! cells {
    ($( $(#[$attr:meta])* $name:ident: $route:ident $op:ident $point:literal; )*) => {
        $(
            #[test]
            $(#[$attr])*
            fn $name() {
                cell(Route::$route, Op::$op, $point);
            }
        )*
    };
}

cells! {
    split_dump_locked: Split Dump "dump-locked";
    split_dump_data_out: Split Dump "dump-data-out";
    split_dump_released: Split Dump "dump-released";
    split_dump_relocked: Split Dump "dump-relocked";
    split_dump_checkpointed: Split Dump "dump-checkpointed";
    split_dump_rollback_restored: Split Dump "rollback-restored";
    split_dump_rollback_reload: Split Dump "rollback-reload";
    split_dump_restore_control: Split Dump "restore-control";
    split_dump_restore_unlocked: Split Dump "restore-unlocked";
    split_dump_restore_data: Split Dump "restore-data";
    split_dump_restore_host_check: Split Dump "restore-host-check";

    split_dump_r_locked: Split DumpLeaveRunning "dump-locked";
    split_dump_r_data_out: Split DumpLeaveRunning "dump-data-out";
    split_dump_r_released: Split DumpLeaveRunning "dump-released";
    split_dump_r_relocked: Split DumpLeaveRunning "dump-relocked";
    split_dump_r_checkpointed: Split DumpLeaveRunning "dump-checkpointed";
    split_dump_r_rollback_restored: Split DumpLeaveRunning "rollback-restored";
    split_dump_r_rollback_reload: Split DumpLeaveRunning "rollback-reload";
    split_dump_r_restore_control: Split DumpLeaveRunning "restore-control";
    split_dump_r_restore_unlocked: Split DumpLeaveRunning "restore-unlocked";
    split_dump_r_restore_data: Split DumpLeaveRunning "restore-data";
    split_dump_r_restore_host_check: Split DumpLeaveRunning "restore-host-check";

    split_restore_dump_locked: Split Restore "dump-locked";
    split_restore_dump_data_out: Split Restore "dump-data-out";
    split_restore_dump_released: Split Restore "dump-released";
    split_restore_dump_relocked: Split Restore "dump-relocked";
    split_restore_dump_checkpointed: Split Restore "dump-checkpointed";
    split_restore_rollback_restored: Split Restore "rollback-restored";
    split_restore_rollback_reload: Split Restore "rollback-reload";
    split_restore_control: Split Restore "restore-control";
    split_restore_unlocked: Split Restore "restore-unlocked";
    split_restore_data: Split Restore "restore-data";
    split_restore_keeper_load: Split Restore "restore-keeper-load";
    split_restore_keeper_loaded: Split Restore "restore-keeper-loaded";
    split_restore_handing_over: Split Restore "restore-handing-over";
    split_restore_host_check: Split Restore "restore-host-check";

    handover_dump_dump_locked: HandOver Dump "dump-locked";
    handover_dump_dump_data_out: HandOver Dump "dump-data-out";
    handover_dump_dump_lent: HandOver Dump "dump-lent";
    handover_dump_dump_released: HandOver Dump "dump-released";
    handover_dump_dump_relocked: HandOver Dump "dump-relocked";
    handover_dump_dump_checkpointed: HandOver Dump "dump-checkpointed";
    handover_dump_dump_drained: HandOver Dump "dump-drained";
    handover_dump_dump_before_manifest: HandOver Dump "dump-before-manifest";
    handover_dump_rollback_restored: HandOver Dump "rollback-restored";
    handover_dump_rollback_reload: HandOver Dump "rollback-reload";
    handover_dump_rollback_reclaimed: HandOver Dump "rollback-reclaimed";
    handover_dump_restore_control: HandOver Dump "restore-control";
    handover_dump_restore_unlocked: HandOver Dump "restore-unlocked";
    handover_dump_restore_data: HandOver Dump "restore-data";
    handover_dump_restore_keeper_load: HandOver Dump "restore-keeper-load";
    handover_dump_restore_handing_over: HandOver Dump "restore-handing-over";
    handover_dump_restore_host_check: HandOver Dump "restore-host-check";

    handover_dump_r_dump_locked: HandOver DumpLeaveRunning "dump-locked";
    handover_dump_r_dump_data_out: HandOver DumpLeaveRunning "dump-data-out";
    handover_dump_r_dump_lent: HandOver DumpLeaveRunning "dump-lent";
    handover_dump_r_dump_released: HandOver DumpLeaveRunning "dump-released";
    handover_dump_r_dump_relocked: HandOver DumpLeaveRunning "dump-relocked";
    handover_dump_r_dump_checkpointed: HandOver DumpLeaveRunning "dump-checkpointed";
    handover_dump_r_dump_drained: HandOver DumpLeaveRunning "dump-drained";
    handover_dump_r_dump_before_manifest: HandOver DumpLeaveRunning "dump-before-manifest";
    handover_dump_r_rollback_restored: HandOver DumpLeaveRunning "rollback-restored";
    handover_dump_r_rollback_reload: HandOver DumpLeaveRunning "rollback-reload";
    handover_dump_r_rollback_reclaimed: HandOver DumpLeaveRunning "rollback-reclaimed";
    handover_dump_r_restore_control: HandOver DumpLeaveRunning "restore-control";
    handover_dump_r_restore_unlocked: HandOver DumpLeaveRunning "restore-unlocked";
    handover_dump_r_restore_data: HandOver DumpLeaveRunning "restore-data";
    handover_dump_r_restore_keeper_loaded: HandOver DumpLeaveRunning "restore-keeper-loaded";
    handover_dump_r_restore_host_check: HandOver DumpLeaveRunning "restore-host-check";

    handover_restore_dump_locked: HandOver Restore "dump-locked";
    handover_restore_dump_data_out: HandOver Restore "dump-data-out";
    handover_restore_dump_lent: HandOver Restore "dump-lent";
    handover_restore_dump_released: HandOver Restore "dump-released";
    handover_restore_dump_relocked: HandOver Restore "dump-relocked";
    handover_restore_dump_checkpointed: HandOver Restore "dump-checkpointed";
    handover_restore_dump_drained: HandOver Restore "dump-drained";
    handover_restore_dump_before_manifest: HandOver Restore "dump-before-manifest";
    handover_restore_rollback_restored: HandOver Restore "rollback-restored";
    handover_restore_rollback_reload: HandOver Restore "rollback-reload";
    handover_restore_rollback_reclaimed: HandOver Restore "rollback-reclaimed";
    handover_restore_keeper_load: HandOver Restore "restore-keeper-load";
    handover_restore_keeper_loaded: HandOver Restore "restore-keeper-loaded";
    handover_restore_handing_over: HandOver Restore "restore-handing-over";
    handover_restore_control: HandOver Restore "restore-control";
    handover_restore_unlocked: HandOver Restore "restore-unlocked";
    handover_restore_data: HandOver Restore "restore-data";
    handover_restore_host_check: HandOver Restore "restore-host-check";

    transparent_dump_locked: Transparent Dump "dump-locked";
    transparent_dump_data_out: Transparent Dump "dump-data-out";
    transparent_dump_released: Transparent Dump "dump-released";
    transparent_dump_relocked: Transparent Dump "dump-relocked";
    transparent_dump_checkpointed: Transparent Dump "dump-checkpointed";
    transparent_dump_rollback_restored: Transparent Dump "rollback-restored";
    transparent_dump_rollback_reload: Transparent Dump "rollback-reload";
    transparent_dump_restore_control: Transparent Dump "restore-control";
    transparent_dump_restore_unlocked: Transparent Dump "restore-unlocked";
    transparent_dump_restore_data: Transparent Dump "restore-data";
    transparent_dump_restore_host_check: Transparent Dump "restore-host-check";

    transparent_dump_r_locked: Transparent DumpLeaveRunning "dump-locked";
    transparent_dump_r_data_out: Transparent DumpLeaveRunning "dump-data-out";
    transparent_dump_r_released: Transparent DumpLeaveRunning "dump-released";
    transparent_dump_r_relocked: Transparent DumpLeaveRunning "dump-relocked";
    transparent_dump_r_checkpointed: Transparent DumpLeaveRunning "dump-checkpointed";
    transparent_dump_r_rollback_restored: Transparent DumpLeaveRunning "rollback-restored";
    transparent_dump_r_rollback_reload: Transparent DumpLeaveRunning "rollback-reload";
    transparent_dump_r_restore_control: Transparent DumpLeaveRunning "restore-control";
    transparent_dump_r_restore_unlocked: Transparent DumpLeaveRunning "restore-unlocked";
    transparent_dump_r_restore_data: Transparent DumpLeaveRunning "restore-data";
    transparent_dump_r_restore_host_check: Transparent DumpLeaveRunning "restore-host-check";

    transparent_restore_dump_locked: Transparent Restore "dump-locked";
    transparent_restore_dump_data_out: Transparent Restore "dump-data-out";
    transparent_restore_dump_released: Transparent Restore "dump-released";
    transparent_restore_dump_relocked: Transparent Restore "dump-relocked";
    transparent_restore_dump_checkpointed: Transparent Restore "dump-checkpointed";
    transparent_restore_rollback_restored: Transparent Restore "rollback-restored";
    transparent_restore_rollback_reload: Transparent Restore "rollback-reload";
    transparent_restore_control: Transparent Restore "restore-control";
    transparent_restore_unlocked: Transparent Restore "restore-unlocked";
    transparent_restore_data: Transparent Restore "restore-data";
    transparent_restore_host_check: Transparent Restore "restore-host-check";
}

/// `dump -R` whose rollback cannot finish the reload: the agent's second copy into re-created
/// memory fails (`cuMemcpyHtoDAsync_v2`, which only the agent calls), after every allocation was
/// re-created and the first chunk loaded. The dump says ROLLBACK FAILED, the workload is held
/// (it must not compute on the partly loaded memory), and once the fault is gone `gpusnap
/// recover` brings it back bit-exact from the files.
#[test]
fn rollback_reload_failing_part_way_is_recovered() {
    let Some(s) = start("fc-rollback-copy-fails") else {
        return;
    };
    s.inject("fail cuMemcpyHtoDAsync_v2 after 1");
    let dump = s.dump(true);
    s.assert_line(&dump, &["ROLLBACK FAILED"]);
    held_then_recovered(&s, &dump, "a failed copy in the rollback's reload");
}

/// After a failed rollback (`run`): the workload does not advance and never logged a bad tick;
/// with the fault disarmed, `gpusnap recover` reloads it and it runs on bit-exact.
fn held_then_recovered(s: &Split, run: &CriuRun, what: &str) {
    sleep(SETTLE);
    let held = s.vmm.last_ticks();
    sleep(HELD_FOR);
    assert_no_bad_tick(s, run, what);
    assert_eq!(
        s.vmm.last_ticks(),
        held,
        "{what}: the workload ran on\n{}",
        s.describe(run)
    );
    fs::remove_file(s.state.join(format!("{}.dev-inject", s.vmm.pid()))).expect("disarm");
    let pid = s.vmm.pid().to_string();
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    let (ok, text) = s.run_cli(&["recover", &pid, "--images", &images]);
    assert!(
        ok && text.contains("device data reloaded"),
        "{what}: gpusnap recover: ok {ok}:\n{text}\n{}",
        s.describe(run)
    );
    s.assert_runs_on(&held, run);
}

/// The agent hangs in the rollback's reload (a wedged GPU; `agent_timeout_ms = 1000`): the
/// dump ends, saying ROLLBACK FAILED, within a bounded time; the workload is held and never
/// computes on its partly loaded memory; `gpusnap recover` cannot reach the hung agent and says
/// so, and the workload is still held afterwards.
#[test]
fn agent_hung_in_the_rollback_keeps_the_job_held() {
    let Some(s) = start("fc-rollback-agent-hangs") else {
        return;
    };
    s.inject("hang cuMemcpyHtoDAsync_v2");
    let t0 = std::time::Instant::now();
    let dump = s.dump_with(true, &[("GPUSNAP_AGENT_TIMEOUT_MS", "1000")]);
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the dump took {:?}\n{}",
        t0.elapsed(),
        s.describe(&dump)
    );
    s.assert_line(&dump, &["ROLLBACK FAILED"]);
    let what = "a hung agent in the rollback's reload";
    sleep(SETTLE);
    let held = s.vmm.last_ticks();
    sleep(HELD_FOR);
    assert_no_bad_tick(&s, &dump, what);
    assert_eq!(s.vmm.last_ticks(), held, "{what}\n{}", s.describe(&dump));

    let pid = s.vmm.pid().to_string();
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    let out = Command::new(&s.cli)
        .args(["recover", &pid, "--images", &images])
        .env("GPUSNAP_LIBCUDA", &s.fakecuda_so)
        .env("FAKECUDA_DIR", &s.state)
        .env("GPUSNAP_AGENT_TIMEOUT_MS", "1000")
        .output()
        .expect("run gpusnap recover");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() && text.contains("gpusnap recover: ") && text.contains("agent"),
        "{what}: gpusnap recover ({}) should fail naming the agent:\n{text}\n{}",
        out.status,
        s.describe(&dump)
    );
    sleep(HELD_FOR);
    assert_no_bad_tick(&s, &dump, what);
    assert_eq!(
        s.vmm.last_ticks(),
        held,
        "{what}: the workload ran on after the failed recover ({text})\n{}",
        s.describe(&dump)
    );
}

/// A dump into an image directory of `size` (a tmpfs; the log is outside it) fails; the
/// workload runs on intact, untraced and unlocked. Returns the dump's run and the directory.
fn dump_into_a_full_fs(s: &mut Split, size: &str) -> (CriuRun, std::path::PathBuf, Tmpfs) {
    let images = s.w.path.join("small-images");
    let mount = Tmpfs::mount(&images, size);
    let pid = s.vmm.pid().to_string();
    let dump = s.criu_at(&images, "dump", "dump.log", &["-t", &pid], &[]);
    assert!(
        !dump.succeeded(),
        "the dump into {size} succeeded\n{}",
        s.describe(&dump)
    );
    assert!(
        dump.log.contains("No space left on device"),
        "no ENOSPC in the log\n{}",
        s.describe(&dump)
    );
    assert!(
        s.vmm.original_running(),
        "the workload died\n{}",
        s.describe(&dump)
    );
    s.assert_runs_on(&s.vmm.last_ticks(), &dump);
    let (states, traced) = threads(s.vmm.pid());
    assert!(
        !traced && !states.contains(['t', 'T']),
        "threads {states:?}, traced {traced}\n{}",
        s.describe(&dump)
    );
    assert_eq!(s.driver_state(), "running", "{}", s.describe(&dump));
    (dump, images, mount)
}

/// gpusnap's files in `dir`.
fn gpusnap_files(dir: &std::path::Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("gpusnap-"))
                .collect()
        })
        .unwrap_or_default()
}

/// The image directory fills up while gpusnap's writers store the device data (4 MiB for
/// 16 MiB of data): the split path gives up before anything is released, says why, and falls
/// back to the driver checkpoint, whose dump by CRIU then fails for want of space too; the
/// workload runs on intact.
#[test]
fn storage_full_while_writing_the_data_leaves_the_job_running() {
    let Some(mut s) = start("fc-full-while-writing") else {
        return;
    };
    let (dump, images, _mount) = dump_into_a_full_fs(&mut s, "4m");
    s.assert_line(
        &dump,
        &[
            "split path failed before any memory was released",
            "No space left on device",
        ],
    );
    assert!(
        !dump.log.contains("agent released"),
        "{}",
        s.describe(&dump)
    );
    let left = gpusnap_files(&images);
    assert!(left.is_empty(), "{left:?}\n{}", s.describe(&dump));
}

/// The image directory has room for gpusnap's data but not for CRIU's own images after it
/// (24 MiB; the workload's host memory is about as large as its device data): the memory was
/// released when CRIU fails, so the rollback reloads it from the files just written, and the
/// workload runs on bit-exact; the failed dump's gpusnap files are removed.
#[test]
fn storage_full_after_the_release_reloads_and_leaves_the_job_running() {
    let Some(mut s) = start("fc-full-after-release") else {
        return;
    };
    let (dump, images, _mount) = dump_into_a_full_fs(&mut s, "24m");
    s.assert_line(&dump, &["agent released"]);
    s.assert_line(&dump, &["device data reloaded"]);
    let left = gpusnap_files(&images);
    assert!(left.is_empty(), "{left:?}\n{}", s.describe(&dump));
}

/// `gpusnap recover` of a split dump whose CRIU died once checkpointed, with the knob in
/// recover's environment: the recover itself dies at `point` of its undo (it shares the dump's
/// rollback, fault points included). The workload must still be held: group-stopped by the hold
/// recover placed before the unlock, not a tick logged; a second recover brings it back
/// bit-exact, taking `steps`.
fn recover_killed_at(test: &str, point: &'static str, steps: &str) {
    let Some(mut s) = start(test) else {
        return;
    };
    let dump = run_op(&s, Route::Split, Op::Dump, &[(KNOB, "dump-checkpointed")]);
    assert!(killed_at(&s, &dump, "dump-checkpointed"));
    let pid = s.vmm.pid();
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    let out = Command::new(&s.cli)
        .args(["recover", &pid.to_string(), "--images", &images])
        .env("GPUSNAP_LIBCUDA", &s.fakecuda_so)
        .env("FAKECUDA_DIR", &s.state)
        .env(KNOB, point)
        .output()
        .expect("run gpusnap recover");
    let what = format!("gpusnap recover killed at {point}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "{what}: recover was not killed ({}): {}{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        s.describe(&dump)
    );
    assert!(
        s.vmm.original_running(),
        "{what}: the workload died\n{}",
        s.describe(&dump)
    );
    sleep(SETTLE);
    let held = s.vmm.last_ticks();
    sleep(HELD_FOR);
    assert_no_bad_tick(&s, &dump, &what);
    assert_eq!(s.vmm.last_ticks(), held, "{what}\n{}", s.describe(&dump));
    let (states, traced) = threads(pid);
    assert!(
        !traced && !states.is_empty() && states.chars().all(|c| c == 'T'),
        "{what}: threads {states:?}, traced {traced}: not group-stopped\n{}",
        s.describe(&dump)
    );
    let (ok, text) = s.run_cli(&["recover", &pid.to_string(), "--images", &images]);
    let said = format!("recovered ({steps}); it runs again");
    assert!(
        ok && text.contains(&said),
        "{what}, then recover again: ok {ok}, expected {said:?}:\n{text}\n{}",
        s.describe(&dump)
    );
    s.assert_runs_on(&held, &dump);
}

#[test]
fn recover_killed_after_its_driver_restore_leaves_the_job_held() {
    recover_killed_at(
        "fc-recover-killed-restored",
        "rollback-restored",
        "unlock, device data reloaded",
    );
}

#[test]
fn recover_killed_mid_reload_leaves_the_job_held() {
    recover_killed_at(
        "fc-recover-killed-reload",
        "rollback-reload",
        "device data reloaded",
    );
}

/// The campaign's finding: a job held with its memory released whose hold record
/// (`/run/gpusnap/held-<pid>`) is lost. `gpusnap recover` must find out from the job itself
/// (its agent) that the memory is released, refuse, never advise continuing it, and leave it
/// held: group-stopped, not a tick logged. With the record back, recover brings it back
/// bit-exact.
#[test]
fn a_held_job_without_its_record_is_never_run_on_released_memory() {
    let Some(s) = start("fc-recover-no-record") else {
        return;
    };
    let dump = run_op(&s, Route::Split, Op::Dump, &[(KNOB, "dump-released")]);
    assert!(killed_at(&s, &dump, "dump-released"));
    let pid = s.vmm.pid();
    sleep(SETTLE);
    let held = s.vmm.last_ticks();
    let record = std::path::PathBuf::from(format!("/run/gpusnap/held-{pid}"));
    let kept = fs::read(&record).expect("the dump recorded its hold");
    fs::remove_file(&record).unwrap();
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    let (ok, text) = s.run_cli(&["recover", &pid.to_string(), "--images", &images]);
    assert!(!ok, "recover without the record succeeded: {text}");
    assert!(!text.contains("kill -CONT"), "advises running it: {text}");
    assert!(
        text.contains("GPU memory released") && text.contains("Do not continue it"),
        "{text}"
    );
    sleep(HELD_FOR);
    assert_no_bad_tick(&s, &dump, "recover without the record");
    assert_eq!(s.vmm.last_ticks(), held, "it ran\n{}", s.describe(&dump));
    let (states, traced) = threads(pid);
    assert!(
        !traced && !states.is_empty() && states.chars().all(|c| c == 'T'),
        "threads {states:?}, traced {traced}: not held after the refusal\n{}",
        s.describe(&dump)
    );
    fs::write(&record, kept).unwrap();
    let (ok, text) = s.run_cli(&["recover", &pid.to_string(), "--images", &images]);
    assert!(
        ok && text.contains("recovered (device data reloaded); it runs again"),
        "{text}\n{}",
        s.describe(&dump)
    );
    assert!(!record.exists(), "the record outlives the hold");
    s.assert_runs_on(&held, &dump);
}

/// The other half of that finding: a job continued by hand (`kill -CONT`) with its memory
/// released ran on without it; a later `gpusnap recover` must not reload the image of before
/// under the job that moved on, and says why.
#[test]
fn a_job_that_ran_on_released_memory_is_not_reloaded() {
    let Some(s) = start("fc-recover-moved-on") else {
        return;
    };
    let dump = run_op(&s, Route::Split, Op::Dump, &[(KNOB, "dump-released")]);
    assert!(killed_at(&s, &dump, "dump-released"));
    let pid = s.vmm.pid();
    let _ = fs::remove_file(format!("/run/gpusnap/held-{pid}"));
    procs::signal(pid, libc::SIGCONT);
    sleep(HELD_FOR);
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    let (ok, text) = s.run_cli(&["recover", &pid.to_string(), "--images", &images]);
    assert!(
        !ok,
        "an old image was reloaded under a job that ran on: {text}"
    );
    assert!(text.contains("moved on"), "{text}");
    assert!(!text.contains("recovered"), "{text}");
}

/// Two GPU processes checkpointed in parallel, CRIU killed when the first of them has released
/// its memory (`dump-released`). The other may be anywhere in its own protocol (locked, copying
/// out, released and held, locked again): whatever it is, neither ever logs a bad tick, each is
/// held or (its memory in place and unlocked) runs on, and `gpusnap recover` of each brings both
/// back bit-exact.
#[test]
fn two_processes_criu_killed_when_one_has_released() {
    let Some(mut s) = Split::launch(
        "fc-two-released",
        2,
        &["--seed", "29", "--allocs", "2", "--mib", "4"],
        &[("GPUSNAP_HANDOVER", "0")],
    ) else {
        return;
    };
    let run = run_op(&s, Route::Split, Op::Dump, &[(KNOB, "dump-released")]);
    assert!(killed_at(&s, &run, "dump-released"));
    assert!(s.vmm.original_running(), "{}", s.describe(&run));
    sleep(SETTLE);
    let at_kill = s.vmm.last_ticks();
    sleep(HELD_FOR);
    assert_no_bad_tick(&s, &run, "two processes");
    let now = s.vmm.last_ticks();
    let released: Vec<bool> = s
        .vmm
        .pids
        .iter()
        .map(|pid| {
            run.gpusnap_lines()
                .iter()
                .any(|l| l.contains(&format!("pid {pid}: agent released")))
        })
        .collect();
    assert!(
        released.iter().any(|&r| r),
        "no process released its memory\n{}",
        s.describe(&run)
    );
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    for (i, &pid) in s.vmm.pids.iter().enumerate() {
        // A process whose memory went away never runs before the recover.
        if released[i] {
            assert_eq!(
                now[i],
                at_kill[i],
                "pid {pid} ran with its memory released\n{}",
                s.describe(&run)
            );
        }
        let (ok, text) = s.run_cli(&["recover", &pid.to_string(), "--images", &images]);
        let reloaded = text.contains("device data reloaded");
        assert!(
            ok && (reloaded || !released[i]),
            "pid {pid} (released {}): gpusnap recover: ok {ok}:\n{text}\n{}",
            released[i],
            s.describe(&run)
        );
    }
    s.assert_runs_on(&now, &run);
}

/// CRIU dies once the memory is released (the workload is held, its memory in the first dump's
/// files only) and, instead of `gpusnap recover`, the dump is simply run again into another
/// directory. That second dump must not produce an image whose restore runs on the missing
/// memory: either it is refused (and the workload stays held, and recover still works), or its
/// restore runs on bit-exact.
fn dump_again_after_a_kill_at(test: &str, point: &'static str) {
    let Some(mut s) = start(test) else {
        return;
    };
    let first = run_op(&s, Route::Split, Op::Dump, &[(KNOB, point)]);
    assert!(killed_at(&s, &first, point));
    sleep(SETTLE);
    let held = s.vmm.last_ticks();
    let images = s.w.images.join("again");
    fs::create_dir_all(&images).expect("mkdir");
    let pid = s.vmm.pid().to_string();
    // The held agent cannot answer: CRIU's timeout ends the wait (3 s instead of 10).
    let again = s.criu_at(
        &images,
        "dump",
        "dump-again.log",
        &["-t", &pid, "--timeout", "3"],
        &[],
    );
    if again.succeeded() {
        let last = s.reap_dumped();
        assert_eq!(last, held, "{}", s.describe(&again));
        let restore = s.criu_at(
            &images,
            "restore",
            "restore-again.log",
            &["--restore-detached"],
            &[],
        );
        s.assert_ok(&restore);
        s.assert_runs_on(&last, &restore);
    } else {
        // Refused at PAUSE, saying what happened and what to do.
        s.assert_line(&again, &["left by an interrupted dump", "gpusnap recover"]);
        sleep(HELD_FOR);
        assert_no_bad_tick(&s, &again, "after the refused second dump");
        assert_eq!(s.vmm.last_ticks(), held, "{}", s.describe(&again));
        let dir = s.w.images.to_str().expect("utf-8 path").to_owned();
        let (ok, text) = s.run_cli(&["recover", &pid, "--images", &dir]);
        assert!(ok && text.contains("device data reloaded"), "{text}");
        s.assert_runs_on(&held, &again);
    }
}

/// Killed released and unlocked: group-stopped.
#[test]
fn dumping_again_after_a_kill_once_released_never_runs_on_missing_memory() {
    dump_again_after_a_kill_at("fc-dump-again-released", "dump-released");
}

/// Killed checkpointed by the driver, its memory released.
#[test]
fn dumping_again_after_a_kill_once_checkpointed_never_runs_on_missing_memory() {
    dump_again_after_a_kill_at("fc-dump-again-checkpointed", "dump-checkpointed");
}
