#!/usr/bin/env python3
"""A PyTorch producer/consumer pair sharing CUDA tensors, checkpointed on the split path (issue 26).

``pair``: the workload. The producer makes a 256 MiB int32 CUDA tensor (element i = i % 9973,
element 0 a counter) and hands it to a ``torch.multiprocessing`` spawn child. Every 100 ms the
consumer adds 1 to element 0 and checks a checksum of the rest; the producer reads element 0 and
checks the rest too. Each logs ``tick N counter C ok 0|1`` (``producer.log`` / ``consumer.log``
in ``--dir``; the producer's first line is ``pid P consumer C``, then ``torch V alloc A``; the
consumer logs ``received ...`` or ``share-failed ...``). ``--alloc default`` shares through
legacy CUDA IPC (served by the gpusnap agent); ``--alloc expandable`` sets
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in both processes, where recent PyTorch
shares through ``cuMemExportToShareableHandle`` and ``pidfd_getfd`` (which the agent does not
serve: gpusnap is expected to refuse the dump, naming the cause, and the pair to run on).

``run``: for each case, start the pair (under the agent: ``LD_PRELOAD``), let it tick, then:
- ``dump-restore``: ``criu dump`` of the producer's tree (``--link-remap``: multiprocessing's
  semaphores are deleted files), reap, ``criu restore``; ``leave-running``: ``criu dump -R``.
  Afterwards both sides must tick on with ``ok 1`` and both counters grow past their value at the
  dump (the memory is still shared, not copied). A dump refused by gpusnap (criu rc != 0 and a
  ``gpusnap:`` line naming CUDA IPC or a shareable handle) is recorded ``checkpointed: false,
  refused: true``; it passes if the pair runs on correctly, except for ``--alloc default``, which
  gpusnap carries (a refusal fails there).
- ``share-check`` / ``share-check-no-agent``: no checkpoint; the pair, with and without the
  agent, must tick and share (records ``share_worked``, the torch version).
- ``kill:<point>`` (``kill-matrix`` = the default points below): ``GPUSNAP_TEST_KILL_CRIU_AT=
  <point>`` in criu's environment only (common/host/src/fault.rs), as criu-tests/tests/ipc_checkpoint.rs
  does with the stand-in: a fresh pair per point.
  Dump side (``dump-*``: ``criu dump``; ``rollback-*``: ``criu dump -R``): criu rc -9 with the
  plugin's ``test fault GPUSNAP_TEST_KILL_CRIU_AT=<point>`` line; both processes alive, no thread
  traced; no ``ok 0`` tick anywhere; for ``--watch-s`` (2) s neither side ticks, except the
  exporter at ``rollback-reimport`` (its rollback is complete: it must tick 3 times) where the
  importer must be group-stopped (state T); then ``gpusnap recover PID --images DIR`` of each side
  that does not run on by itself, exporter first, then importer (exit 0; at
  ``rollback-reimport`` the importer's output must say "CUDA IPC shares mapped again"); both
  untraced, not stopped, 10 more ticks each, all ``ok 1``, both counters past their value at the
  dump.
  Restore side (``restore-*``): a plain dump of the pair, then ``criu restore`` with the knob:
  rc -9 and the plugin's line; no tick logged by the restored tree (nothing of it ran); its pids
  gone within 20 s; the pair's output files cut back to their size at the dump (the agents'
  debug lines of the killed restore grew them, and CRIU restores only a file of the size it
  dumped); ``gpusnap verify DIR`` exits 0; a second ``criu restore`` succeeds and both tick on
  sharing, as above.
  Default points (``--points``): dump-released (the first process's memory released, not yet
  relocked), dump-drained (every chunk drained, the keeper not yet released: the importer's
  shares unmapped, the exporter released), rollback-reclaimed (a rollback's first process mapped
  back, the importer still unmapped), rollback-reimport and restore-reimport (fault.rs's
  IPC_POINTS). A point not reached (criu rc 0) fails. The plan with estimates is printed at the
  start; no point starts past ``--deadline-s``.

One JSON record per case in ``OUT/ipc-ckpt.jsonl`` (``--name``):
``{"case": "ipc-torch-ckpt" | "ipc-torch-expandable-ckpt", "path": "split"|"none", "kind",
"checkpointed", "refused", "identical", "sharing_after", "pass", "dump_s", "restore_s",
"counter_at_dump", "counter_after", "torch", "alloc", "share_worked", "gpusnap_lines"}``; the
kill matrix: ``{"case": "ipc-kill-matrix", "point", "path": "split", "operation", "expected":
"killed", "outcome", "pass", "detail", "timings", "info", "gpusnap_lines"}``. Per-case logs
(pair logs and output, criu logs, recover/verify output) go to ``OUT/logs.tar`` under
``ipc-ckpt/<case>/``.

``--mock`` (no GPU, no torch, no plugin): the pair is gpu/shareable_pair.cu's host build (a memfd
shared by fd passing; same logs), criu runs without the plugin, an action script kills criu at
CRIU's post-dump / post-restore where the point would be, and a stand-in answers ``gpusnap
recover`` (SIGCONT) and ``verify``; checks that need the plugin and a GPU become notes.

Usage: python3 gpu/ipc_ckpt.py run --agent SO --out DIR [--cases dump-restore,leave-running]
           [--alloc default|expandable] [--points P,...] [--watch-s 2] [--deadline-s 500]
           [--mock]
"""
import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

N = 256 * (1 << 20) // 4
ALLOC_CONF = {"default": None, "expandable": "expandable_segments:True"}
CASE_NAME = {"default": "ipc-torch-ckpt", "expandable": "ipc-torch-expandable-ckpt"}
CKPT_KINDS = ["dump-restore", "leave-running", "share-check", "share-check-no-agent"]
KNOB = "GPUSNAP_TEST_KILL_CRIU_AT"
MATRIX_CASE = "ipc-kill-matrix"
# common/host/src/fault.rs: POINTS and IPC_POINTS (the AMD ones are not ours).
KNOWN_POINTS = ["dump-locked", "dump-data-out", "dump-lent", "dump-released", "dump-relocked",
                "dump-checkpointed", "dump-drained", "dump-before-manifest", "rollback-restored",
                "rollback-reload", "rollback-reclaimed", "rollback-reimport",
                "restore-keeper-load", "restore-keeper-loaded", "restore-handing-over",
                "restore-control", "restore-unlocked", "restore-data", "restore-host-check",
                "restore-reimport"]
DEFAULT_POINTS = ["dump-released", "dump-drained", "rollback-reclaimed", "rollback-reimport",
                  "restore-reimport"]
# Killed here the exporter's rollback is complete: it runs on while the importer is held.
EXPORTER_RUNS_AT = {"rollback-reimport"}
# Killed here the memory is in place and unlocked (faults.py's RUNS_ON_AT): ticks allowed.
RUNS_ON_AT = {"dump-lent"}
# Killed here, the processes of the tree are released one after another: a side whose release
# had not begun runs on with its memory mapped (intact and running is a valid outcome); a side
# already released must be held. So at these points a side may tick if it is not stopped, and
# every tick must still say ok 1.
EITHER_AT = {"dump-released"}
# Estimated seconds of one case on the H200: the pair's start (two Python processes importing
# torch and making CUDA contexts, ~10 s), the dump (~3.5-5 s, bench/results/ipc-ckpt-h200-*),
# the watch, two recovers, 10 ticks; a restore case: start, dump, killed restore, verify, restore.
START_S = 12.0
EST_S = {"dump": START_S + 4 + 1 + 2 + 6 + 3, "dump -R": START_S + 5 + 1 + 2 + 6 + 3,
         "restore": START_S + 4 + 2 + 3 + 1 + 3 + 3}
CKPT_EST_S = {"dump-restore": START_S + 4 + 3 + 3, "leave-running": START_S + 5 + 3,
              "share-check": START_S + 3, "share-check-no-agent": START_S + 3}
# A dump refused by gpusnap for memory shared with another process.
REFUSAL_RE = re.compile(r"CUDA IPC|shareable handle|ShareableHandle|pidfd", re.I)
REFUSAL_WORDS = re.compile(r"cannot be checkpointed|refus|not support|unsupported", re.I)
MOCK_KILL_ACTION = {"dump": "post-dump", "dump -R": "post-dump", "restore": "post-restore"}
MOCK_MIB = 16

# Action script of --mock (faults.py's): SIGKILLs its parent criu at @KILL_ON@, if that criu works
# on @IMG@.
MOCK_KILL_SCRIPT = r'''#!/bin/sh
echo "$(date +%s.%N) action=$CRTOOLS_SCRIPT_ACTION pid=$$ ppid=$PPID" >> '@LOG@'
[ "$CRTOOLS_SCRIPT_ACTION" = '@KILL_ON@' ] || exit 0
if tr '\0' ' ' < "/proc/$PPID/cmdline" | grep -q -F -e '-D @IMG@ '; then
    echo "$(date +%s.%N) killing criu $PPID with SIGKILL" >> '@LOG@'
    kill -9 "$PPID"
else
    echo "$(date +%s.%N) parent $PPID is not the criu of @IMG@: not killed" >> '@LOG@'
fi
exit 0
'''
# Stand-in of .devcarry/gpusnap for --mock: `recover` ends a group stop, `verify` passes.
MOCK_CLI = r'''#!/bin/sh
case "$1" in
    recover) kill -CONT "$2" && echo "mock: pid $2 continued (SIGCONT); no GPU state here" ;;
    verify) echo "mock: $2: no gpusnap images checked" ;;
    *) echo "mock gpusnap: $1 is not simulated" >&2; exit 2 ;;
esac
'''


def point_operation(point):
    if point.startswith("restore-"):
        return "restore"
    return "dump -R" if point.startswith("rollback-") else "dump"


# ------------------------------------------------------------------------------ the workload

def expected_rest_sum():
    # sum over i in 1..N-1 of i % 9973, exactly (int64 on the GPU matches Python's int).
    q, r = divmod(N, 9973)
    full = q * (9973 * 9972 // 2)
    part = (r - 1) * r // 2
    return full + part  # element 0 (i = 0) contributes 0


def tick_log(path, tick, counter, ok):
    with open(path, "a") as f:
        f.write("tick %d counter %d ok %d\n" % (tick, counter, 1 if ok else 0))


def note_line(path, text):
    with open(path, "a") as f:
        f.write(text.rstrip("\n") + "\n")


def consumer(q, dirname):
    import torch
    path = os.path.join(dirname, "consumer.log")
    note_line(path, "pid %d" % os.getpid())
    try:
        t = q.get(timeout=60)
        note_line(path, "received ptr 0x%x numel %d alloc_conf %s" % (
            t.data_ptr(), t.numel(), os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "-")))
    except Exception as e:  # the share itself failed: say so, the producer ticks on alone
        note_line(path, "share-failed %s: %s" % (type(e).__name__, str(e).replace("\n", " ")[:400]))
        raise
    want = expected_rest_sum()
    tick = 0
    while True:
        t[0] += 1
        rest = int(t[1:].sum(dtype=torch.int64).item())
        c = int(t[0].item())
        tick_log(path, tick, c, rest == want)
        tick += 1
        time.sleep(0.1)


def pair(dirname):
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    t = torch.arange(N, dtype=torch.int32, device="cuda") % 9973
    t[0] = 0
    torch.cuda.synchronize()
    q = ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, dirname), daemon=True)
    p.start()
    path = os.path.join(dirname, "producer.log")
    note_line(path, "pid %d consumer %d" % (os.getpid(), p.pid))
    note_line(path, "torch %s cuda %s alloc_conf %s reserved %d" % (
        torch.__version__, torch.version.cuda, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "-"),
        torch.cuda.memory_reserved()))
    try:
        q.put(t)
    except Exception as e:
        note_line(path, "share-failed %s: %s" % (type(e).__name__, str(e).replace("\n", " ")[:400]))
    want = expected_rest_sum()
    tick = 0
    while True:
        rest = int(t[1:].sum(dtype=torch.int64).item())
        tick_log(path, tick, int(t[0].item()), rest == want)
        tick += 1
        time.sleep(0.1)


# ------------------------------------------------------------------------------ tick logs
# Shared with gpu/shareable_ckpt.py (gpu/shareable_pair.cu writes the same files and lines).

SIDES = ("producer", "consumer")


def _lines(path):
    try:
        with open(path, errors="replace") as f:
            data = f.read()
    except OSError:
        return []
    lines = data.split("\n")
    return lines[:-1]  # '' after the last newline, or a line still being written


def read_ticks(path):
    """[(counter, ok)] of one side's log; a `tick` line that does not parse counts as not ok
    (criu-tests/tests/ipc_checkpoint.rs reads them so)."""
    out = []
    for line in _lines(path):
        w = line.split()
        if not w or w[0] != "tick":
            continue
        if len(w) == 6 and w[2] == "counter" and w[4] == "ok":
            try:
                out.append((int(w[3]), w[5] == "1"))
                continue
            except ValueError:
                pass
        out.append((0, False))
    return out


def side_log(dirname, side):
    return os.path.join(dirname, side + ".log")


def n_ticks(dirname):
    return [len(read_ticks(side_log(dirname, s))) for s in SIDES]


def wait_ticks(dirname, n, timeout, sides=SIDES):
    base = {s: len(read_ticks(side_log(dirname, s))) for s in sides}
    t0 = time.time()
    while time.time() - t0 < timeout:
        if all(len(read_ticks(side_log(dirname, s))) >= base[s] + n for s in sides):
            return True
        time.sleep(0.05)
    return False


def pids_of(dirname):
    """(producer, consumer) from the producer's `pid P consumer C` line."""
    for line in _lines(side_log(dirname, "producer")):
        w = line.split()
        if len(w) == 4 and w[0] == "pid" and w[2] == "consumer":
            try:
                return int(w[1]), int(w[3])
            except ValueError:
                break
    return None, None


def log_words(dirname, side, first):
    """Lines of a side's log that start with one of the prefixes `first`."""
    return [l for l in _lines(side_log(dirname, side)) if l.startswith(tuple(first))]


def last_counter(dirname, side):
    t = read_ticks(side_log(dirname, side))
    return t[-1][0] if t else None


def bad_ticks(dirname):
    return {s: sum(1 for _, ok in read_ticks(side_log(dirname, s)) if not ok) for s in SIDES}


def shared_on(dirname, before, n=10, timeout=60):
    """Both sides tick n more times, every tick of both logs ok, and both counters past
    `before` + 5: they still share the memory. Returns (problems, info)."""
    problems = []
    got = wait_ticks(dirname, n, timeout)
    if not got:
        problems.append("the pair did not tick %d more times on both sides within %d s (ticks %s)" % (
            n, timeout, n_ticks(dirname)))
    bad = bad_ticks(dirname)
    if any(bad.values()):
        problems.append("ticks with ok 0: %s" % bad)
    after = {s: last_counter(dirname, s) for s in SIDES}
    info = {"counter_at_dump": before, "counter_after": after.get("producer"),
            "counter_after_consumer": after.get("consumer"), "ticks": n_ticks(dirname)}
    if before is None or any(v is None or v <= before + 5 for v in after.values()):
        problems.append("the counter does not grow past %s on both sides (producer %s, consumer %s):"
                        " not shared" % (before, after.get("producer"), after.get("consumer")))
    return problems, info


def refusal(d):
    """The gpusnap: line of a dump refused for memory shared with another process, or None."""
    if d["rc"] == 0:
        return None
    for line in d["gpusnap_lines"]:
        if REFUSAL_RE.search(line) and REFUSAL_WORDS.search(line):
            return line.strip()[-400:]
    return None


# ------------------------------------------------------------------------------ process helpers

def proc_state(pid):
    from crlib import procs
    st = procs.proc_stat(pid)
    return st[0] if st else None


def threads(pid):
    """[(tid, state, TracerPid)] of every thread of pid (None: gone)."""
    res = []
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for t in tids:
        st, tr = "?", None
        try:
            with open("/proc/%d/task/%s/status" % (pid, t)) as f:
                for line in f:
                    if line.startswith("State:"):
                        st = line.split()[1]
                    elif line.startswith("TracerPid:"):
                        tr = int(line.split()[1])
        except OSError:
            continue
        res.append((int(t), st, tr))
    return res


def free_running(pid):
    """(True, '') if pid is alive, untraced and not stopped; else (False, why)."""
    th = threads(pid)
    if th is None or proc_state(pid) in (None, "Z", "X"):
        return False, "pid %d is gone" % pid
    bad = [x for x in th if x[2] not in (0, None) or x[1] in ("t", "T")]
    if bad:
        return False, "pid %d held: threads (tid, state, TracerPid) %s" % (pid, bad[:4])
    return True, ""


class Env:
    """What a run needs: options, log, the pair's command and environments."""

    def __init__(self, a, log):
        self.a, self.log = a, log
        self.mock_cli = None
        if a.mock:
            os.makedirs(a.work, exist_ok=True)
            self.mock_cli = os.path.join(a.work, "mock-gpusnap")
            with open(self.mock_cli, "w") as f:
                f.write(MOCK_CLI)
            os.chmod(self.mock_cli, 0o755)

    def cli(self, args, timeout=90):
        from crlib import criu
        return criu.gpusnap_cli(args, self.log, timeout=timeout, cli=self.mock_cli)


def pair_env(agent, extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPUSNAP_AGENT") and k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF")}
    env["PYTHONUNBUFFERED"] = "1"
    # A fatal signal (the pair's SIGSEGV at start, seen twice on the H100) prints every
    # thread's Python stack into pair.out.
    env["PYTHONFAULTHANDLER"] = "1"
    if agent:
        env["LD_PRELOAD"] = agent
        env["GPUSNAP_AGENT_DEBUG"] = "1"
    env.update(extra or {})
    return env


def clean_link_remaps(log):
    # What --link-remap left in /dev/shm from an earlier case (a dump fails on a name taken).
    for f in glob.glob("/dev/shm/link_remap.*"):
        try:
            os.unlink(f)
            log("removed %s (left by an earlier --link-remap)" % f)
        except OSError:
            pass


class Pair:
    """One pair started for one case: its dir, image dir, process, restored pid."""

    def __init__(self, e, tag, cmd, env):
        self.e, self.log = e, e.log
        self.tag = tag
        self.dir = os.path.join(e.a.work, tag)
        self.images = os.path.join(e.a.images, tag)
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.images, ignore_errors=True)
        os.makedirs(self.dir)
        os.makedirs(self.images)
        clean_link_remaps(self.log)
        self.out = os.path.join(self.dir, "pair.out")
        self.cmd, self.env = cmd, env
        self.proc = None
        self.restored_pid = None
        self.tree, self.tids = [], []
        self.saved = []  # extra files for the archive

    def start(self, timeout=90):
        self.log("starting the pair: %s%s" % (
            "LD_PRELOAD=%s " % self.env["LD_PRELOAD"] if self.env.get("LD_PRELOAD") else "",
            " ".join(self.cmd)))
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        t0 = time.time()
        ok = False
        while time.time() - t0 < timeout:
            if all(n >= 5 for n in n_ticks(self.dir)):
                ok = True
                break
            # a share that failed, or a producer that exited, will not start ticking
            failed = [l for s in SIDES for l in log_words(self.dir, s, ("share-failed", "fatal"))]
            # (multiprocessing pickles in a feeder thread: a failed share is only its traceback)
            failed += ["pair.out: " + l.strip() for l in _lines(self.out) if l.startswith("Traceback")][:1]
            if failed or self.proc.poll() is not None:
                time.sleep(1.0)  # let the other side say what it saw
                self.log("the pair will not start: %s (producer exit status %s)" % (
                    failed[:2], self.proc.poll()))
                break
            time.sleep(0.05)
        return ok, round(time.time() - t0, 2)

    def pids(self):
        return pids_of(self.dir)

    def snapshot_tree(self):
        from crlib import procs
        producer, _ = self.pids()
        self.tree = procs.tree_pids(producer)
        self.tids = procs.tree_tids(producer)
        return self.tree

    def files(self):
        return [self.out] + [side_log(self.dir, s) for s in SIDES]

    def sizes(self):
        return {f: (os.path.getsize(f) if os.path.exists(f) else 0) for f in self.files()}

    def dump(self, leave_running, env=None, extra_args=(), timeout=120):
        from crlib import criu
        producer, _ = self.pids()
        return criu.criu_dump(producer, self.images, self.e.a.plugdir, "auto", self.log,
                              leave_running=leave_running, timeout=timeout,
                              extra=["--link-remap"] + list(extra_args), env=env)

    def restore(self, env=None, extra_args=(), log_as=None, timeout=120):
        from crlib import criu
        r = criu.criu_restore(self.images, self.e.a.plugdir, "auto", self.log, timeout=timeout,
                              extra=["--link-remap"] + list(extra_args), env=env)
        if r.get("pid"):
            self.restored_pid = r["pid"]
        if log_as:
            self.keep_log(r, log_as)
        return r

    def keep_log(self, r, name):
        src = r.get("log")
        if src and os.path.exists(src):
            dst = os.path.join(self.dir, name + ".log")
            shutil.copy(src, dst)
            self.saved.append(dst)

    def wait_dumped_gone(self, timeout=30):
        """After a completed dump: the producer exits and every pid/tid of the tree is free."""
        from crlib import procs
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return "the producer still runs %d s after the dump" % timeout
        if not procs.wait_pids_free(sorted(set(self.tree + self.tids)), timeout, self.log):
            return "pids of the dumped tree still in use %d s after the dump" % timeout
        return None

    def kill(self):
        """SIGKILLs the pair's processes: only those of its own session (started with
        start_new_session, so sid = the producer's pid; a restored tree keeps its sid), never
        anything a wrong pid in a log would name."""
        from crlib import procs
        sid = self.proc.pid if self.proc is not None else None
        me = os.getpid()
        victims = set()
        for pid in [x for x in (*self.pids(), self.restored_pid) if x and x > 1]:
            if procs.alive(pid):
                victims.update(procs.tree_pids(pid))
        victims = {v for v in victims
                   if v > 1 and v != me and sid and (procs.proc_stat(v) or (0, 0, 0, None))[3] == sid}
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.log("pid %d did not exit 20 s after SIGKILL" % self.proc.pid)
        want = sorted(set(self.tree + self.tids + list(victims)))
        if want:
            procs.wait_pids_free(want, 30, self.log)

    def finish(self, archive_prefix):
        """Kill what is left, show the logs' tails and agent lines, archive the files."""
        from crlib import criu, output
        try:
            self.kill()
        except Exception:
            self.log.block("kill exception", output.format_exc())
        criu.log_agent_lines(self.log, self.out)
        for s in SIDES:
            self.log.file_tail(s + ".log", side_log(self.dir, s), 8)
        output.archive_add(self.files() + self.saved, archive_prefix, self.log)
        if not self.e.a.keep_images:
            shutil.rmtree(self.images, ignore_errors=True)


def mock_kill_script(p, action):
    script = os.path.join(p.dir, "mock-kill-criu.sh")
    slog = os.path.join(p.dir, "action-script.log")
    with open(script, "w") as f:
        f.write(MOCK_KILL_SCRIPT.replace("@LOG@", slog).replace("@KILL_ON@", action)
                .replace("@IMG@", p.images))
    os.chmod(script, 0o755)
    p.saved.append(slog)
    return script


def build_mock_pair(work, log):
    """The host build of gpu/shareable_pair.cu (no GPU), for --mock."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shareable_pair.cu")
    out = os.path.join(work, "shareable_pair-mock")
    os.makedirs(work, exist_ok=True)
    if not (os.path.exists(out) and os.path.getmtime(out) > os.path.getmtime(src)):
        cmd = ["g++", "-O2", "-x", "c++", "-DSHAREABLE_HOST_MOCK", "-o", out, src]
        r = subprocess.run(cmd, capture_output=True, text=True)
        log("$ %s -> rc %d %s" % (" ".join(cmd), r.returncode, r.stderr.strip()[-500:]))
        if r.returncode != 0:
            raise RuntimeError("building the host mock of shareable_pair.cu failed")
    return out


# ------------------------------------------------------------------------------ checkpoint cases

def checkpoint_case(e, rec, p, kind, refusal_ok):
    """One checkpoint case (dump-restore, leave-running, share-check[-no-agent]) of pair p, whose
    record rec (with rec["problems"]) it fills in. refusal_ok: a refused dump with the pair
    running on is a pass (a share gpusnap does not carry yet)."""
    log = e.log
    ok, secs = p.start()
    rec["start_s"] = secs
    prod_notes = log_words(p.dir, "producer", ("torch", "shared", "share-failed", "platform"))
    cons_notes = log_words(p.dir, "consumer", ("received", "imported", "share-failed",
                                               "pidfd_getfd:", "SCM_RIGHTS:"))
    rec["producer_notes"], rec["consumer_notes"] = prod_notes[:6], cons_notes[:6]
    for line in prod_notes:
        if line.startswith("torch "):
            rec["torch"] = line.split()[1]
    rec["share_worked"] = bool(ok) and not any("share-failed" in l for l in prod_notes + cons_notes)
    if not ok:
        rec["problems"].append("the pair did not start ticking on both sides (ticks %s; %s)" % (
            n_ticks(p.dir), (prod_notes + cons_notes)[-3:]))
        return
    producer, consumer_pid = p.pids()
    p.snapshot_tree()
    rec["tree"] = len(p.tree)
    before = last_counter(p.dir, "consumer")
    if kind.startswith("share-check"):
        probs, info = shared_on(p.dir, before)
        rec.update(info)
        rec["problems"] += probs
        rec["sharing_after"] = not probs
        return
    d = p.dump(leave_running=(kind == "leave-running"))
    p.keep_log(d, "dump")
    rec["dump_s"] = round(d["secs"], 3)
    rec["criu_dump_rc"] = d["rc"]
    rec["gpusnap_lines"] = [l.strip()[-300:] for l in d["gpusnap_lines"][-30:]]
    before = last_counter(p.dir, "consumer")
    if d["rc"] != 0:
        why = refusal(d)
        rec["refused"] = why is not None
        rec["refusal"] = why
        # Whatever failed, the pair must run on (fail closed).
        time.sleep(0.3)
        for pid in (producer, consumer_pid):
            fr, msg = free_running(pid)
            if not fr:
                rec["problems"].append("after the failed dump: " + msg)
        probs, info = shared_on(p.dir, before)
        rec.update(info)
        rec["sharing_after"] = not probs
        rec["problems"] += probs
        if why is None:
            rec["problems"].append("criu dump rc %d without a gpusnap: refusal naming CUDA IPC or "
                                   "a shareable handle" % d["rc"])
        elif not refusal_ok:
            rec["problems"].append("the dump was refused (%s), but gpusnap carries this share" % why)
        else:
            log("dump refused, as allowed here: %s" % why)
        return
    rec["checkpointed"], rec["refused"] = True, False
    if kind == "dump-restore":
        gone = p.wait_dumped_gone()
        if gone:
            rec["problems"].append(gone)
            return
        r = p.restore(log_as="restore")
        rec["restore_s"] = round(r["secs"], 3)
        rec["gpusnap_lines"] += [l.strip()[-300:] for l in r["gpusnap_lines"][-30:]]
        if r["rc"] != 0:
            rec["problems"].append("criu restore rc %d" % r["rc"])
            return
    else:
        time.sleep(0.3)
        for pid in (producer, consumer_pid):
            fr, msg = free_running(pid)
            if not fr:
                rec["problems"].append("after criu dump -R: " + msg)
    probs, info = shared_on(p.dir, before)
    rec.update(info)
    rec["sharing_after"] = not probs
    rec["problems"] += probs


def torch_pair_cmd(e, dirname):
    if e.a.mock:
        return [e.mock_bin, "parent", "--dir", dirname, "--mode", "scm", "--mib", str(MOCK_MIB)]
    return [sys.executable, os.path.abspath(__file__), "pair", "--dir", dirname]


def torch_env(e, kind):
    agent = None if (e.a.mock or kind == "share-check-no-agent") else e.a.agent
    extra = {}
    conf = ALLOC_CONF[e.a.alloc]
    if conf:
        extra["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return pair_env(agent, extra)


def run_ckpt(e, kind):
    from crlib import output
    a = e.a
    name = CASE_NAME[a.alloc]
    tag = "%s-%s" % (a.alloc, kind)
    rec = {"case": name, "path": "none" if kind == "share-check-no-agent" else "split", "kind": kind,
           "alloc": a.alloc, "alloc_conf": ALLOC_CONF[a.alloc], "checkpointed": False,
           "refused": False, "identical": False, "sharing_after": None, "problems": []}
    p = Pair(e, tag, [], {})
    p.cmd, p.env = torch_pair_cmd(e, p.dir), torch_env(e, kind)
    t0 = time.time()
    try:
        checkpoint_case(e, rec, p, kind, refusal_ok=(a.alloc != "default") or a.mock)
    except Exception as ex:
        output.note_failure(rec, e.log, ex)
    finally:
        p.finish("ipc-ckpt/%s" % tag)
    rec["secs"] = round(time.time() - t0, 1)
    rec["pass"] = not rec["problems"]
    rec["identical"] = rec["pass"] and rec["checkpointed"]
    rec["detail"] = "; ".join(rec["problems"]) or (
        "refused: %s; the pair ran on sharing" % rec.get("refusal") if rec.get("refused") else
        "checkpointed, both sides tick on sharing" if rec["checkpointed"] else
        "ticks and shares")
    return rec


# ------------------------------------------------------------------------------ the kill matrix

class KillCase:
    def __init__(self, e, point):
        self.e, self.log, self.a = e, e.log, e.a
        self.point, self.op = point, point_operation(point)
        self.problems, self.notes, self.info, self.timings = [], [], {}, {}
        self.outcome, self.gpusnap_lines = "not run", []

    def problem(self, msg):
        self.log("PROBLEM: %s" % msg)
        self.problems.append(msg)

    def note(self, msg):
        self.log("note: %s" % msg)
        self.notes.append(msg)

    def expect(self, ok, msg):
        """A check that needs the plugin and a GPU: a problem, or a note under --mock."""
        if not ok:
            if self.a.mock:
                self.note("mock, not met (GPU-only check): " + msg)
            else:
                self.problem(msg)
        return ok

    def criu_env_and_args(self, p):
        env = {KNOB: self.point}
        extra = []
        if self.a.mock:
            extra = ["--action-script", mock_kill_script(p, MOCK_KILL_ACTION[self.op])]
            self.note("mock: criu is killed at CRIU's %s action" % MOCK_KILL_ACTION[self.op])
        return env, extra

    def judge(self, r, what):
        self.timings["criu_s"] = round(r["secs"], 3)
        self.info["criu_rc"] = r["rc"]
        self.gpusnap_lines = r["gpusnap_lines"]
        fired = [l for l in r["gpusnap_lines"] if "%s=%s" % (KNOB, self.point) in l]
        if r["rc"] == -signal.SIGKILL:
            self.outcome = "killed"
            self.expect(bool(fired), "no gpusnap: line saying that %s=%s killed CRIU" % (KNOB, self.point))
        elif r["rc"] == 0:
            self.outcome = "not reached"
            self.problem("criu %s exited 0: %s was not reached (expected a kill)" % (what, self.point))
        else:
            self.outcome = "criu rc %s" % r["rc"]
            self.problem("criu %s failed with rc %s (neither killed nor complete): %s" % (
                what, r["rc"], (r["gpusnap_lines"] or ["(no gpusnap: line)"])[-1].strip()[-300:]))
        return self.outcome

    def recover(self, pid, who, images):
        t0 = time.time()
        rc, out = self.e.cli(["recover", str(pid), "--images", images])
        self.timings["recover_%s_s" % who] = round(time.time() - t0, 3)
        self.info["recover_%s_rc" % who] = rc
        self.info["recover_%s_output" % who] = (out or "").strip()[-600:]
        self.log.block("gpusnap recover %s (pid %d)" % (who, pid), out or "(no output)", max_lines=30)
        if rc != 0:
            self.problem("gpusnap recover of the %s (pid %d) exited %s: %s" % (
                who, pid, rc, (out or "").strip()[-300:]))
        return rc, out or ""

    def dump_side(self, p):
        exporter, importer = p.pids()
        p.snapshot_tree()
        before = last_counter(p.dir, "consumer")
        env, extra = self.criu_env_and_args(p)
        r = p.dump(leave_running=(self.op == "dump -R"), env=env, extra_args=extra)
        p.keep_log(r, "dump")
        if self.judge(r, self.op) != "killed":
            if r["rc"] == 0 and self.op == "dump":
                p.wait_dumped_gone()
            return
        time.sleep(0.5)  # a hold's queued SIGSTOP takes effect as the tracer's death detaches
        from crlib import procs
        procs.reap_our_zombies(skip={p.proc.pid})
        for pid, who in ((exporter, "exporter"), (importer, "importer")):
            if not procs.alive(pid):
                self.problem("the %s (pid %d) died with criu (%s)" % (who, pid, procs.proc_stat(pid)))
        if self.problems:
            return
        if self.point in EXPORTER_RUNS_AT:
            # criu-tests' held(): the importer's log stays still and it is stopped
            procs.wait_until(lambda: proc_state(importer) in ("T", "t"), 1.0)
        states = {}
        for pid, who in ((exporter, "exporter"), (importer, "importer")):
            th = threads(pid) or []
            states[who] = proc_state(pid)
            self.info["threads_%s_after_kill" % who] = th[:6]
            traced = [t for t in th if t[2] not in (0, None)]
            if traced:
                self.problem("%s threads still traced after criu died: %s" % (who, traced[:4]))
        self.info["state_after_kill"] = states
        self.log("after criu died: states %s" % states)
        n1 = n_ticks(p.dir)
        time.sleep(self.a.watch_s)
        n2 = n_ticks(p.dir)
        moved = {s: n2[i] - n1[i] for i, s in enumerate(SIDES)}
        self.timings["ticks_while_dead"] = moved
        runs_on = {"producer": self.point in EXPORTER_RUNS_AT or self.point in RUNS_ON_AT,
                   "consumer": self.point in RUNS_ON_AT}
        if self.point in EITHER_AT:
            for s, who in (("producer", "exporter"), ("consumer", "importer")):
                if states[who] not in ("T", "t") and moved[s] > 0:
                    runs_on[s] = True
                    self.note("the %s was not released yet when criu died: it ticked on %d times "
                              "(state %s)" % (who, moved[s], states[who]))
        for s, who in (("producer", "exporter"), ("consumer", "importer")):
            if runs_on[s]:
                continue
            if self.expect(moved[s] == 0, "the %s ticked %d times in %.1f s after criu died at %s "
                           "(held or locked: none expected)" % (who, moved[s], self.a.watch_s, self.point)):
                self.note("the %s did not tick for %.1f s (state %s)" % (who, self.a.watch_s, states[who]))
        if self.point in EXPORTER_RUNS_AT:
            self.expect(states["importer"] in ("T", "t"), "the importer's state is %s after criu died "
                        "at %s, expected T (held)" % (states["importer"], self.point))
            got = wait_ticks(p.dir, 3, 20, sides=("producer",))
            self.expect(got, "the exporter did not tick on while the importer was held")
            if got:
                self.note("the exporter ticked on while the importer was held")
        bad = bad_ticks(p.dir)
        if any(bad.values()):
            self.problem("ticks with ok 0 after criu died: %s" % bad)
        # recover, exporter first: a side that runs on by itself is left alone (as CI does)
        for pid, who, side in ((exporter, "exporter", "producer"), (importer, "importer", "consumer")):
            if runs_on[side] and free_running(pid)[0]:
                self.note("the %s runs on by itself: not recovered" % who)
                continue
            rc, out = self.recover(pid, who, p.images)
            if who == "importer" and self.point == "rollback-reimport" and rc == 0:
                self.expect("CUDA IPC shares mapped again" in out,
                            "the importer's recover does not say 'CUDA IPC shares mapped again'")
        for pid, who in ((exporter, "exporter"), (importer, "importer")):
            fr, msg = free_running(pid)
            if not fr:
                self.problem("after gpusnap recover: " + msg)
        probs, info = shared_on(p.dir, before)
        self.info.update(info)
        for x in probs:
            self.problem(x)
        if not probs:
            self.note("both tick on sharing: counter %s -> producer %s, consumer %s" % (
                before, info["counter_after"], info["counter_after_consumer"]))

    def restore_side(self, p):
        from crlib import procs
        exporter, importer = p.pids()
        p.snapshot_tree()
        d = p.dump(leave_running=False)
        p.keep_log(d, "prep-dump")
        self.timings["prep_dump_s"] = round(d["secs"], 3)
        if d["rc"] != 0:
            self.problem("preparing: criu dump rc %d: %s" % (
                d["rc"], (d["gpusnap_lines"] or ["-"])[-1].strip()[-300:]))
            return
        gone = p.wait_dumped_gone()
        if gone:
            self.problem("preparing: " + gone)
            return
        sizes = p.sizes()
        # CRIU's --link-remap files (the deleted semaphores of multiprocessing) are used up by a
        # restore, a killed one too: keep copies so the second restore has what the first had.
        remaps = {}
        for f in glob.glob("/dev/shm/link_remap.*"):
            try:
                with open(f, "rb") as fh:
                    remaps[f] = (fh.read(), os.stat(f).st_mode & 0o7777)
            except OSError:
                pass
        ticks_at_dump = n_ticks(p.dir)
        before = last_counter(p.dir, "consumer")
        env, extra = self.criu_env_and_args(p)
        r = p.restore(env=env, extra_args=extra, log_as="restore-fault")
        outcome = self.judge(r, "restore")
        if outcome == "not reached":
            self.restored_ok_anyway(p, before)
            return
        if outcome != "killed":
            return
        # killed with CRIU (PTRACE_O_EXITKILL): nothing of the tree may have run
        t0 = r["end"]
        tree = sorted(set(p.tree))

        def all_gone():
            procs.reap_our_zombies()
            return not any(procs.alive(x) for x in tree)

        gone = procs.wait_until(all_gone, 1.0 if self.a.mock else 20.0, poll=0.01)
        self.timings["die_s"] = round(time.time() - t0, 3)
        if not self.expect(gone, "the restored tree still runs %.0f s after criu died: %s" % (
                time.time() - t0, [(x, proc_state(x)) for x in tree if procs.alive(x)])):
            p.kill()  # its own session only
        ticks_now = n_ticks(p.dir)
        self.info["ticks_from_killed_restore"] = [b - a for a, b in zip(ticks_at_dump, ticks_now)]
        self.expect(ticks_now == ticks_at_dump, "the restored tree ticked after CRIU died in the "
                    "restore: ticks %s at the dump, %s now" % (ticks_at_dump, ticks_now))
        if ticks_now == ticks_at_dump:
            self.note("nothing of the restored tree ticked")
        for f, size in sizes.items():
            now = os.path.getsize(f) if os.path.exists(f) else 0
            if now != size:
                os.truncate(f, size)
                self.note("%s cut back from %d to %d bytes (its size at the dump)" % (
                    os.path.basename(f), now, size))
        vrc, vout = self.e.cli(["verify", p.images])
        self.info["verify_rc"] = vrc
        self.info["verify_output"] = (vout or "").strip()[-400:]
        self.log.block("gpusnap verify", vout or "(no output)", max_lines=20)
        if vrc != 0:
            self.problem("gpusnap verify after the killed restore exited %s: %s" % (
                vrc, (vout or "").strip()[-300:]))
        if not procs.wait_pids_free(sorted(set(p.tree + p.tids)), 60, self.log):
            self.problem("the restored pids still in use 60 s after the killed restore")
            return
        p.restored_pid = None
        for f, (data, mode) in remaps.items():
            if not os.path.exists(f):
                with open(f, "wb") as fh:
                    fh.write(data)
                os.chmod(f, mode)
                self.note("%s put back (the killed restore used it up)" % os.path.basename(f))
        r2 = p.restore(log_as="restore-again")
        self.timings["restore_again_s"] = round(r2["secs"], 3)
        if r2["rc"] != 0:
            self.problem("the second restore failed with rc %s: %s" % (
                r2["rc"], (r2["gpusnap_lines"] or ["-"])[-1].strip()[-300:]))
            return
        if not self.a.mock:
            found = any("CUDA IPC imports mapped again" in l for l in r2["gpusnap_lines"])
            self.info["reimport_line"] = found
            if not found:
                self.note("the second restore's log has no 'CUDA IPC imports mapped again' line")
        self.restored_ok_anyway(p, before)

    def restored_ok_anyway(self, p, before):
        time.sleep(0.3)
        for pid, who in zip(p.pids(), ("exporter", "importer")):
            fr, msg = free_running(pid)
            if not fr:
                self.problem("after the restore: " + msg)
        probs, info = shared_on(p.dir, before)
        self.info.update(info)
        for x in probs:
            self.problem(x)
        if not probs:
            self.note("restored, both tick on sharing: counter %s -> producer %s, consumer %s" % (
                before, info["counter_after"], info["counter_after_consumer"]))


def run_kill(e, point, est):
    from crlib import output
    log = e.log
    log("=" * 78)
    c = KillCase(e, point)
    log("CASE %s %s: criu %s with %s=%s, expected: killed; estimate %.0f s" % (
        MATRIX_CASE, point, c.op, KNOB, point, est))
    tag = "kill-%s" % point
    p = Pair(e, tag, [], {})
    p.cmd, p.env = torch_pair_cmd(e, p.dir), torch_env(e, "kill")
    t0 = time.time()
    try:
        ok, secs = p.start()
        c.timings["start_s"] = secs
        if not ok:
            c.problem("the pair did not start ticking on both sides (ticks %s)" % n_ticks(p.dir))
        elif c.op == "restore":
            c.restore_side(p)
        else:
            c.dump_side(p)
    except Exception:
        tb = output.format_exc()
        log.block("exception", tb)
        c.problem("exception: " + tb.strip().splitlines()[-1])
    finally:
        p.finish("ipc-ckpt/%s" % tag)
    ok = not c.problems
    detail = "; ".join(c.problems if not ok else c.notes)
    rec = {"case": MATRIX_CASE, "point": point, "path": "split", "operation": c.op,
           "expected": "killed", "outcome": c.outcome, "pass": ok, "detail": detail[:1500],
           "secs": round(time.time() - t0, 1), "estimate_s": round(est, 1), "timings": c.timings,
           "gpusnap_lines": [l.strip()[-300:] for l in c.gpusnap_lines[-40:]], "info": c.info}
    log("RESULT %s %s: %s, outcome %s (%.0f s, estimate %.0f s) %s" % (
        MATRIX_CASE, point, "PASS" if ok else "FAIL", c.outcome, rec["secs"], est, detail[:400]))
    return rec


# ------------------------------------------------------------------------------ main

def expand_cases(cases, points):
    out = []
    for c in [x.strip() for x in cases.split(",") if x.strip()]:
        if c == "kill-matrix":
            out += ["kill:" + p for p in points]
        else:
            out.append(c)
    return out


def estimate(case):
    if case.startswith("kill:"):
        return EST_S[point_operation(case[5:])]
    return CKPT_EST_S.get(case, 30.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pair")
    p.add_argument("--dir", required=True)
    r = sub.add_parser("run")
    r.add_argument("--agent", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), ".devcarry", "libgpusnap_agent.so"))
    r.add_argument("--out", required=True)
    r.add_argument("--cases", default="dump-restore,leave-running",
                   help="comma list of %s, kill:<point>, kill-matrix" % ",".join(CKPT_KINDS))
    r.add_argument("--alloc", choices=sorted(ALLOC_CONF), default="default",
                   help="expandable: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in both")
    r.add_argument("--points", default=",".join(DEFAULT_POINTS),
                   help="the points of kill-matrix (default %s)" % ",".join(DEFAULT_POINTS))
    r.add_argument("--watch-s", type=float, default=2.0,
                   help="seconds the held side must not tick after criu died (default 2)")
    r.add_argument("--deadline-s", type=float, default=500,
                   help="start no case whose estimate ends past this (default 500)")
    r.add_argument("--name", default="ipc-ckpt", help="OUT/NAME.jsonl (default ipc-ckpt)")
    r.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    r.add_argument("--images", default="/dev/shm/gpusnap-ipc-ckpt")
    r.add_argument("--work", default="/tmp/gpusnap-work/ipc-ckpt")
    r.add_argument("--keep-images", action="store_true")
    r.add_argument("--mock", action="store_true",
                   help="no GPU: the host build of shareable_pair.cu as the pair (harness test)")
    a = ap.parse_args()
    if a.cmd == "pair":
        return pair(a.dir)
    t_start = time.time()
    points = [x.strip() for x in a.points.split(",") if x.strip()]
    bad = [x for x in points if x not in KNOWN_POINTS]
    if bad:
        ap.error("unknown point(s) %s; known: %s" % (bad, ", ".join(KNOWN_POINTS)))
    cases = expand_cases(a.cases, points)
    bad = [c for c in cases if c not in CKPT_KINDS and not (c.startswith("kill:") and c[5:] in KNOWN_POINTS)]
    if bad:
        ap.error("unknown case(s) %s" % bad)
    os.environ["OUT"] = a.out
    from crlib import output
    out, log, mi = output.start_run(a.name, "gpusnap ipc-ckpt: %s" % " ".join(sys.argv), a.plugdir)
    e = Env(a, log)
    if a.mock:
        e.mock_bin = build_mock_pair(a.work, log)
        log("mock: the pair is %s (no GPU, no torch); criu runs without the plugin" % e.mock_bin)
    elif not os.path.isfile(a.agent):
        log("WARNING: the agent %s is missing: the split path cannot be taken" % a.agent)
    stray = sorted(k for k in os.environ if k.startswith("GPUSNAP_"))
    if stray:
        log("note: GPUSNAP_* in the environment (passed to criu): %s" % stray)
    plan = [(c, estimate(c)) for c in cases]
    log("plan: %d cases, estimate %.0f s; deadline %.0f s" % (
        len(plan), sum(s for _, s in plan), a.deadline_s))
    for c, s in plan:
        log("  %-28s %-8s ~%3.0f s" % (c, point_operation(c[5:]) if c.startswith("kill:") else "", s))
    jsonl = os.path.join(out, a.name + ".jsonl")
    results = []
    for case, est in plan:
        elapsed = time.time() - t_start
        if a.deadline_s and elapsed + est > a.deadline_s:
            log("deadline of %.0f s: skipping %s (estimate %.0f s, %.0f s gone)" % (
                a.deadline_s, case, est, elapsed))
            rec = {"case": MATRIX_CASE if case.startswith("kill:") else CASE_NAME[a.alloc],
                   "path": "split", "pass": None, "detail": "skipped: deadline", "outcome": "skipped"}
            if case.startswith("kill:"):
                rec["point"] = case[5:]
            else:
                rec["kind"] = case
        elif case.startswith("kill:"):
            rec = run_kill(e, case[5:], est)
        else:
            log("=" * 78)
            log("CASE %s %s (alloc %s), estimate %.0f s" % (CASE_NAME[a.alloc], case, a.alloc, est))
            rec = run_ckpt(e, case)
            log("RESULT %s %s: %s %s" % (CASE_NAME[a.alloc], case, "PASS" if rec["pass"] else "FAIL",
                                         rec["detail"][:400]))
        rec.update(date=output.iso_now(), machine=mi, build=_build())
        if a.mock:
            rec["mock"] = True
        output.append_jsonl([jsonl], rec)
        results.append(rec)
    log("=" * 78)
    log("SUMMARY (%.0f s)" % (time.time() - t_start))
    for rec in results:
        res = "SKIP" if rec["pass"] is None else ("PASS" if rec["pass"] else "FAIL")
        log("%-26s %-22s %-5s %s" % (rec["case"], rec.get("point") or rec.get("kind"), res,
                                     rec.get("detail", "")[:300]))
    n_fail = sum(1 for x in results if x["pass"] is False)
    n_skip = sum(1 for x in results if x["pass"] is None)
    log("ipc-ckpt: %d passed, %d failed, %d skipped" % (len(results) - n_fail - n_skip, n_fail, n_skip))
    return 1 if n_fail or n_skip else 0


def _build():
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               ".devcarry", "COMMIT")) as f:
            return f.read().strip()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
