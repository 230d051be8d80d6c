"""GPU-side faults on the H200 ("failures that never cost a job"); called by gpu/faults.sh.

Cases (each independent: a failure is recorded and the next case runs):
  damaged-image             split: dump, flip one byte in the payload of gpusnap-<pid>-data-0.img,
                            criu restore must fail with a `gpusnap:` "restore refused"/"checksum"
                            line and leave no process with the dumped pid; flip it back, restore,
                            ticks continue bit-exact.
  no-gpu-memory             split, --nomem-gib (8) GiB: dump; a torch blocker leaves half the
                            image's size free; restore must fail with "GiB free but the image
                            needs"; kill the blocker, restore, ticks continue bit-exact.
  lock-timeout              transparent and split: a torch process inside a ~10 s kernel
                            (torch.cuda._sleep) when criu dump starts with
                            GPUSNAP_LOCK_TIMEOUT_MS=1000: the dump fails with "locking the CUDA
                            state", the process keeps running, untraced, ticks go on.
  criu-killed-then-recover  split: criu dump --action-script S; S SIGKILLs criu in the post-dump
                            action (after the device checkpoint: memory released, manifest
                            written); `gpusnap recover PID --images DIR` must exit 0 and the
                            ticks continue bit-exact.
  recover-nothing           split and transparent: `gpusnap recover PID` on a CUDA workload that
                            was never dumped: exit 0, "nothing to recover", ticks go on.
  kill-matrix               (only when named; a device call of its own) split and transparent,
                            --matrix-gib (16) GiB: for each point of GPUSNAP_TEST_KILL_CRIU_AT
                            (common/host/src/fault.rs; --points), criu dump / dump -R / restore with it
                            set, so that the plugin SIGKILLs its criu there. Dump side: the
                            workload survives, never logs ok 0, does not tick while released or
                            locked (--watch-s), is group-stopped (T) when killed between release
                            and relock (or in a rollback's reload); `gpusnap recover PID --images
                            DIR` exits 0 and the ticks go on bit-exact. Restore side: the restored
                            process is dead within --watch-s and never ran, `gpusnap verify`
                            passes, a second restore of the image goes on bit-exact. A point the
                            path does not reach: criu exits 0, recorded "not reached". One
                            workload per path goes from case to case (see matrix_order); the
                            estimate is printed at the start.
Writes $OUT/faults.log, $OUT/faults-h200.jsonl and bench/results/faults-h200.jsonl (one record per
case and path: run, date, gpu, driver, case, path, pass, detail, ...), per-case logs in
$OUT/logs.tar. Exit status 1 if any case failed.
--mock runs gpu/mock_workload.py and CPU stand-ins for the torch helpers (harness test only:
without a GPU the fault-specific expectations fail).
"""

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crlib  # noqa: E402
from crlib import criu, machine, output, procs, ticklog  # noqa: E402

# `--cases all`; kill-matrix runs only when named (it needs a device call of its own).
ALL_CASES = ["damaged-image", "no-gpu-memory", "lock-timeout", "criu-killed-then-recover",
             "recover-nothing"]
# The paths each case runs on, in order.
CASE_PATHS = {
    "damaged-image": ["split"],
    "no-gpu-memory": ["split"],
    "lock-timeout": ["transparent", "split"],
    "criu-killed-then-recover": ["split"],
    "recover-nothing": ["split", "transparent"],
}
MODES = {"split": "auto", "transparent": "transparent"}

# Payload of the first chunk of a data file: after the 64-byte file header and the 64-byte record
# header (common/image/src/header.rs); 4096 bytes in, so not the header checksum that is hit.
FLIP_OFFSET = 64 + 64 + 4096

# A torch process that spends nearly all its time inside one long kernel; a line per kernel.
LONG_KERNEL_PY = r'''
import os, sys, time
out, cycles, mock = sys.argv[1], int(float(sys.argv[2])), sys.argv[3] == "1"
if not mock:
    import torch
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    v = int(x[0].item())
else:
    v = 1
with open(out, "a", buffering=1) as f:
    f.write("ready pid %d t %.6f cycles %d\n" % (os.getpid(), time.time(), cycles))
    i = 0
    while True:
        t0 = time.time()
        if mock:
            time.sleep(cycles / 2e9)
            v += 1
        else:
            torch.cuda._sleep(cycles)
            x.add_(1)
            v = int(x[0].item())  # synchronizes
        i += 1
        f.write("tick %d t %.6f kernel_s %.3f value %d\n" % (i, time.time(), time.time() - t0, v))
'''

# Fills the GPU so that `need // 2` bytes stay free; prints one "ready" line, then sleeps.
BLOCKER_PY = r'''
import sys, time
need, mock = int(sys.argv[1]), sys.argv[2] == "1"
if mock:
    print("ready mock 1 free_before 0 alloc 0 free_after 0 total 0", flush=True)
else:
    import torch
    free, total = torch.cuda.mem_get_info()
    n = free - need // 2
    if n <= 0:
        print("blocker: only %d bytes free, need/2 is %d: nothing to fill" % (free, need // 2), flush=True)
        n = 0
    x = torch.empty(max(n, 1), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    free2, _ = torch.cuda.mem_get_info()
    print("ready free_before %d alloc %d free_after %d total %d" % (free, n, free2, total), flush=True)
while True:
    time.sleep(1)
'''

# CRIU action script: SIGKILLs the criu that runs it when the action is one of KILL_ON. criu's
# pid is in PIDFILE (written by the harness right after starting criu; scripts/criu execs the
# real criu, so the Popen pid is criu's); it is looked up among the script's ancestors, falling
# back to the parent. Every invocation is logged.
KILL_SCRIPT = r'''#!/bin/sh
echo "$(date +%s.%N) action=$CRTOOLS_SCRIPT_ACTION pid=$$ ppid=$PPID" >> '@LOG@'
case " @KILL_ON@ " in
    *" $CRTOOLS_SCRIPT_ACTION "*) ;;
    *) exit 0 ;;
esac
i=0
while [ ! -s '@PIDFILE@' ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
want=$(cat '@PIDFILE@' 2>/dev/null)
target=
p=$$
while [ -n "$p" ] && [ "$p" -gt 1 ]; do
    if [ "$p" = "$want" ]; then target=$p; break; fi
    p=$(awk '/^PPid:/ {print $2}' "/proc/$p/status" 2>/dev/null)
done
[ -n "$target" ] || target=$PPID
echo "$(date +%s.%N) killing criu $target (pidfile: $want) with SIGKILL" >> '@LOG@'
kill -9 "$target"
exit 0
'''


class Fail(Exception):
    pass


class Case:
    """One case on one path: its files, the processes to clean up, problems and notes."""

    def __init__(self, h, name, path):
        self.h, self.name, self.path = h, name, path
        self.mode = MODES.get(path)
        self.tag = "%s-%s" % (name, path)
        self.dir = os.path.join(h.a.work, self.tag)
        self.img = os.path.join(h.a.images, self.tag)
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.img, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)
        self.problems, self.notes, self.info = [], [], {}
        self.popens = []      # started here: killed and reaped at the end
        self.pids = []        # restored pids: killed at the end
        self.free_pids = []   # pids/tids that must be free at the end
        self.archive = []

    def f(self, name):
        p = os.path.join(self.dir, name)
        self.archive.append(p)
        return p

    def problem(self, msg):
        self.h.log("PROBLEM: %s" % msg)
        self.problems.append(msg)

    def note(self, msg):
        self.h.log("note: %s" % msg)
        self.notes.append(msg)


class Harness:
    def __init__(self, a, log, mi):
        self.a, self.log, self.mi = a, log, mi
        self.workload = os.path.join(crlib.REPO, "gpu", "mock_workload.py") if a.mock else a.workload
        self.wprefix = [sys.executable] if a.mock else []

    # ---------------------------------------------------------- C workload

    def start_workload(self, c, gib, path, name="workload"):
        wlog, wout = c.f(name + ".log"), c.f(name + ".out")
        cmd = self.wprefix + [self.workload, "--gib", str(gib), "--alloc", "driver", "--log", wlog,
                              "--interval-ms", str(self.a.interval_ms)]
        p = procs.start_process(cmd, wout, procs.workload_env(path), self.log)
        c.popens.append(p)
        t0 = time.time()
        if not procs.wait_until(lambda: ticklog.parse_workload_log(wlog)[0] is not None,
                                90 + 3 * float(gib), proc=p):
            raise Fail("workload not ready after %.0f s (exit status %s)" % (time.time() - t0, p.poll()))
        if not procs.wait_until(lambda: len(ticklog.parse_workload_log(wlog)[1]) >= 3, 30, proc=p):
            raise Fail("fewer than 3 ticks before the fault (exit status %s)" % p.poll())
        ready, ticks, errors = ticklog.parse_workload_log(wlog)
        pre = ticklog.check_ticks(ready, ticks, errors)
        if not pre["pass"]:
            raise Fail("ticks already bad before the fault: %s" % pre["problems"][:3])
        tids = procs.tree_tids(p.pid)
        c.free_pids.extend(tids)
        self.log("workload pid %d ready after %.1f s, %d threads, %d ticks" % (
            p.pid, time.time() - t0, len(tids), len(ticks)))
        return p, wlog, wout, tids

    def n_ticks(self, wlog):
        return len(ticklog.parse_workload_log(wlog)[1])

    def dump_and_reap(self, c, p, tids, gib, wlog):
        """criu dump (no -R) of the workload; it must exit and its pids become free."""
        d = criu.criu_dump(p.pid, c.img, self.a.plugdir, c.mode, self.log,
                            timeout=120 + 10 * float(gib))
        c.archive.append(d["log"])
        c.info["dump_s"] = round(d["secs"], 3)
        if d["rc"] != 0:
            raise Fail("criu dump failed with rc %d: %s" % (d["rc"], _last(d["gpusnap_lines"])))
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise Fail("workload still running 30 s after criu dump returned")
        n = self.n_ticks(wlog)
        if not procs.wait_pids_free(tids, 60, self.log):
            raise Fail("dumped pids still in use 60 s after the dump")
        return d, n

    def restore_and_check(self, c, wlog, n_dump, dump, gib, what="restore"):
        """criu restore that must succeed; then 5 more ticks, checker over the whole log."""
        r = criu.criu_restore(c.img, self.a.plugdir, c.mode, self.log, timeout=120 + 10 * float(gib))
        self._save_criu_log(c, r, what)
        if r["pid"]:
            c.pids.append(r["pid"])
        c.info[what + "_s"] = round(r["secs"], 3)
        if r["rc"] != 0:
            raise Fail("%s failed with rc %d: %s" % (what, r["rc"], _last(r["gpusnap_lines"])))
        self.check_ticks_after(c, wlog, n_dump, window=(dump["start"], r["end"]))
        return r

    def check_ticks_after(self, c, wlog, n_before, window=None, need=5):
        got = procs.wait_until(lambda: self.n_ticks(wlog) >= n_before + need,
                               30 + 5 * need * self.a.interval_ms / 1000.0)
        ready, ticks, errors = ticklog.parse_workload_log(wlog)
        chk = ticklog.check_ticks(ready, ticks, errors, need_after=need, after_index=n_before,
                                window=window)
        lo = max(0, n_before - 2)
        for t in ticks[lo:n_before + need + 1]:
            self.log("  tick %(tick)d counter %(counter)d state %(state)016x sum %(sum)016x ok %(ok)d "
                     "err %(err)d" % t)
        self.log("checker: %s; %d ticks, %d after index %d; gap %s s" % (
            "PASS" if chk["pass"] else "FAIL", chk["n_ticks"], chk["ticks_after"], n_before,
            chk.get("gap_s")))
        c.info["ticks"] = chk["n_ticks"]
        c.info["ticks_after"] = chk["ticks_after"]
        if chk.get("gap_s") is not None:
            c.info["gap_s"] = chk["gap_s"]
        if not got:
            self.log("only %d of %d ticks" % (self.n_ticks(wlog), n_before + need))
        for p in chk["problems"][:8]:
            c.problem("checker: " + p)
        if chk["pass"]:
            c.note("ticks bit-exact: %d after the fault" % chk["ticks_after"])
        return chk

    def _save_criu_log(self, c, res, what):
        src = res.get("log")
        if src and os.path.exists(src):
            dst = os.path.join(c.dir, "%s.log" % what)
            shutil.copy(src, dst)
            c.archive.append(dst)

    def dumped_pid_gone(self, c, pid, restored_pid=None):
        """After a refused restore: no process with the dumped (or reported) pid runs."""
        time.sleep(0.5)
        procs.reap_our_zombies()
        bad = []
        for q in sorted({x for x in (pid, restored_pid) if x}):
            if procs.alive(q):
                try:
                    with open("/proc/%d/cmdline" % q, "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = "?"
                bad.append("%d (%s, state %s)" % (q, cmd[:80], (procs.proc_stat(q) or "?")[0]))
        if bad:
            c.problem("a process with the dumped pid runs after the refused restore: %s" % ", ".join(bad))
            # kill it, or the next restore of the same image cannot have its pid
            procs.kill_and_wait([x for x in (pid, restored_pid) if x], self.log, timeout=30)
        else:
            c.note("no process with pid %d after the refused restore" % pid)

    # ------------------------------------------------------------ helpers

    def start_helper(self, c, name, code, args, env=None):
        script = c.f(name + ".py")
        with open(script, "w") as f:
            f.write(code)
        out = c.f(name + ".out")
        p = procs.start_process([self.a.python, script] + [str(x) for x in args], out,
                                env or procs.workload_env("transparent"), self.log)
        c.popens.append(p)
        return p, out

    def held(self, pid):
        """[(tid, state, tracer)] of every thread of pid."""
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

    def check_free(self, c, pid, when):
        h = self.held(pid)
        if h is None or not procs.alive(pid):
            c.problem("%s: pid %d is gone (%s)" % (when, pid, procs.proc_stat(pid)))
            return False
        bad = [x for x in h if x[2] not in (0, None) or x[1] in ("t", "T")]
        if bad:
            c.problem("%s: pid %d is held: threads (tid, state, TracerPid) %s" % (when, pid, bad[:6]))
            return False
        self.log("%s: pid %d runs untraced (%d threads, TracerPid 0)" % (when, pid, len(h)))
        return True

    def cleanup(self, c):
        targets = [p.pid for p in c.popens] + c.pids
        victims = []
        for t in targets:
            if t and procs.alive(t):
                victims.extend(procs.tree_pids(t))
        if victims:
            self.log("killing %s" % procs.short_list(sorted(set(victims))))
        for v in set(victims):
            try:
                os.kill(v, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in c.popens:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.log("pid %d did not exit 30 s after SIGKILL" % p.pid)
        want = sorted(set(x for x in targets + c.free_pids if x))
        if want:
            procs.wait_pids_free(want, 60, self.log)

    # --------------------------------------------------------------- cases

    def case_damaged_image(self, c):
        gib = self.a.gib
        p, wlog, wout, tids = self.start_workload(c, gib, c.path)
        pid = p.pid
        dump, n_dump = self.dump_and_reap(c, p, tids, gib, wlog)
        data = os.path.join(c.img, "gpusnap-%d-data-0.img" % pid)
        if not os.path.exists(data):
            cands = sorted(glob.glob(os.path.join(c.img, "gpusnap-*-data-0.img")))
            if not cands and self.a.mock:  # harness test: a stand-in file CRIU ignores
                with open(data, "wb") as f:
                    f.write(os.urandom(FLIP_OFFSET * 2))
                cands = [data]
            if not cands:
                raise Fail("no gpusnap-*-data-0.img in %s: the split path was not taken (%s)" % (
                    c.img, sorted(os.listdir(c.img))[:20]))
            data = cands[0]
        size = os.path.getsize(data)
        if size <= FLIP_OFFSET:
            raise Fail("%s has only %d bytes" % (data, size))
        old = _flip(data, FLIP_OFFSET)
        self.log("flipped byte %d of %s (%d bytes): 0x%02x -> 0x%02x" % (
            FLIP_OFFSET, os.path.basename(data), size, old, old ^ 0xFF))
        c.info["damaged_file"] = os.path.basename(data)
        vrc, vout = criu.gpusnap_cli(["verify", c.img], self.log)
        c.info["verify_rc_damaged"] = vrc
        if vout.strip():
            self.log.block("gpusnap verify (damaged image)", vout, max_lines=20)
        if vrc == 0:
            c.note("gpusnap verify passed the damaged image")
        try:
            r = criu.criu_restore(c.img, self.a.plugdir, c.mode, self.log, timeout=120 + 10 * gib)
            self._save_criu_log(c, r, "restore-damaged")
            c.info["damaged_restore_rc"] = r["rc"]
            if r["rc"] == 0:
                if r["pid"]:
                    c.pids.append(r["pid"])
                c.problem("criu restore of the damaged image succeeded")
            refused = [l for l in r["gpusnap_lines"] if "restore refused" in l or "checksum" in l]
            c.info["refusal"] = _last(refused) or _last(r["gpusnap_lines"])
            if refused:
                c.note("refused: %s" % refused[-1].strip()[-200:])
            else:
                c.problem("no gpusnap: line with 'restore refused' or 'checksum' in restore.log "
                          "(last: %s)" % _last(r["gpusnap_lines"]))
            self.dumped_pid_gone(c, pid, r["pid"] if r["rc"] != 0 else None)
        finally:
            _flip(data, FLIP_OFFSET)
            self.log("flipped byte %d back" % FLIP_OFFSET)
        if not procs.wait_pids_free(tids, 60, self.log):
            raise Fail("dumped pids still in use 60 s after the refused restore")
        self.restore_and_check(c, wlog, n_dump, dump, gib)

    def case_no_gpu_memory(self, c):
        gib = self.a.nomem_gib
        p, wlog, wout, tids = self.start_workload(c, gib, c.path)
        pid = p.pid
        dump, n_dump = self.dump_and_reap(c, p, tids, gib, wlog)
        if not self.a.mock and not glob.glob(os.path.join(c.img, "gpusnap-*-data-*.img")):
            c.note("no gpusnap data files: the split path was not taken")
        need = int(float(gib) * (1 << 30))
        used0 = machine.gpu_used_gib()
        bp, bout = self.start_helper(c, "blocker", BLOCKER_PY, [need, int(self.a.mock)])
        ok = procs.wait_until(lambda: "ready" in _read(bout), 180, poll=0.2, proc=bp)
        line = [l for l in _read(bout).splitlines() if l.startswith("ready")]
        if not ok or not line:
            raise Fail("blocker not ready (exit status %s): %s" % (bp.poll(), _read(bout)[-400:]))
        kv = line[0].split()[1:]
        binfo = dict(zip(kv[0::2], kv[1::2]))
        c.info["blocker"] = binfo
        self.log("blocker pid %d: %s; nvidia-smi used %s GiB (before %s)" % (
            bp.pid, line[0], machine.gpu_used_gib(), used0))
        r = criu.criu_restore(c.img, self.a.plugdir, c.mode, self.log, timeout=120 + 10 * gib)
        self._save_criu_log(c, r, "restore-no-memory")
        c.info["nomem_restore_rc"] = r["rc"]
        if r["rc"] == 0:
            if r["pid"]:
                c.pids.append(r["pid"])
            c.problem("criu restore succeeded with too little free GPU memory")
        hits = [l for l in r["gpusnap_lines"] if "GiB free but the image needs" in l]
        c.info["refusal"] = _last(hits) or _last(r["gpusnap_lines"])
        if hits:
            c.note("refused: %s" % hits[-1].strip()[-200:])
        else:
            c.problem("no gpusnap: line with 'GiB free but the image needs' (last: %s)" %
                      _last(r["gpusnap_lines"]))
        self.dumped_pid_gone(c, pid, r["pid"] if r["rc"] != 0 else None)
        # Free the GPU again, then the same image must restore.
        try:
            os.kill(bp.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            bp.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise Fail("blocker did not exit 60 s after SIGKILL")
        if used0 is not None:
            procs.wait_until(lambda: (machine.gpu_used_gib() or 0) < used0 + 1.0, 30, poll=0.5)
        self.log("blocker gone; nvidia-smi used %s GiB" % machine.gpu_used_gib())
        if not procs.wait_pids_free(tids, 60, self.log):
            raise Fail("dumped pids still in use 60 s after the refused restore")
        self.restore_and_check(c, wlog, n_dump, dump, gib)

    def case_lock_timeout(self, c):
        ticks = c.f("ticks.txt")
        env = procs.workload_env(c.path)
        p, out = self.start_helper(c, "long_kernel", LONG_KERNEL_PY,
                                   [ticks, self.a.sleep_cycles, int(self.a.mock)], env=env)
        c.free_pids.append(p.pid)
        if not procs.wait_until(lambda: _read(ticks).startswith("ready"), 180, poll=0.2, proc=p):
            raise Fail("torch process not ready (exit status %s): %s" % (p.poll(), _read(out)[-400:]))
        time.sleep(1.5)  # well inside the first kernel (~10 s at 2e10 cycles)
        n0 = _kernel_ticks(ticks)
        c.free_pids.extend(procs.tree_tids(p.pid))
        self.log("torch pid %d inside its kernel; %d ticks so far" % (p.pid, len(n0)))
        os.environ["GPUSNAP_LOCK_TIMEOUT_MS"] = str(self.a.lock_timeout_ms)
        try:
            d = criu.criu_dump(p.pid, c.img, self.a.plugdir, c.mode, self.log, timeout=120)
        finally:
            os.environ.pop("GPUSNAP_LOCK_TIMEOUT_MS", None)
        self._save_criu_log(c, d, "dump")
        c.info["dump_rc"] = d["rc"]
        c.info["dump_s"] = round(d["secs"], 3)
        hits = [l for l in d["gpusnap_lines"] if "locking the CUDA state" in l]
        c.info["refusal"] = _last(hits) or _last(d["gpusnap_lines"])
        if d["rc"] == 0:
            c.problem("criu dump succeeded although a kernel was running (the lock did not time out)")
        if hits:
            c.note("dump failed in %.2f s: %s" % (d["secs"], hits[-1].strip()[-160:]))
        else:
            c.problem("no gpusnap: line with 'locking the CUDA state' (last: %s)" %
                      _last(d["gpusnap_lines"]))
        time.sleep(0.3)
        if not self.check_free(c, p.pid, "right after the failed dump"):
            return
        at_end = len(_kernel_ticks(ticks))
        est = self.a.sleep_cycles / 1.5e9
        got = procs.wait_until(lambda: len(_kernel_ticks(ticks)) >= at_end + 2, 3 * est + 30,
                               poll=0.2, proc=p)
        tk = _kernel_ticks(ticks)
        c.info["kernel_s"] = [t[2] for t in tk[-3:]]
        if not got:
            c.problem("only %d new ticks within %.0f s after the failed dump (exit status %s)" % (
                len(tk) - at_end, 3 * est + 30, p.poll()))
        bad = [t for i, t in enumerate(tk) if t[0] != i + 1 or t[3] != i + 2]
        if bad:
            c.problem("tick lines out of order or values wrong: %s" % bad[:3])
        if got and not bad:
            c.note("%d ticks after the failed dump (kernel %.1f s)" % (len(tk) - at_end, tk[-1][2]))
        self.check_free(c, p.pid, "after the new ticks")

    def case_criu_killed(self, c):
        gib = self.a.gib
        p, wlog, wout, tids = self.start_workload(c, gib, c.path)
        pid = p.pid
        os.makedirs(c.img, exist_ok=True)
        script, slog, pidfile = c.f("kill-criu.sh"), c.f("action-script.log"), c.f("criu.pid")
        with open(script, "w") as f:
            f.write(KILL_SCRIPT.replace("@LOG@", slog).replace("@PIDFILE@", pidfile)
                    .replace("@KILL_ON@", " ".join(self.a.kill_on)))
        os.chmod(script, 0o755)
        cmd = [crlib.CRIU, "dump", "-t", str(pid), "-D", c.img, "-L", self.a.plugdir, "-v4",
               "-o", "dump.log", "--action-script", script]
        cmd += os.environ.get("CRIU_DUMP_EXTRA", "").split()
        self.log("$ GPUSNAP_MODE=%s %s" % (c.mode, " ".join(cmd)))
        cout = c.f("criu.out")
        t0 = time.time()
        with open(cout, "wb") as co:
            cp = subprocess.Popen(cmd, env=criu.criu_env(c.mode), stdout=co, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=crlib.REPO)
        with open(pidfile + ".tmp", "w") as f:
            f.write("%d\n" % cp.pid)
        os.rename(pidfile + ".tmp", pidfile)
        try:
            rc = cp.wait(timeout=120 + 10 * gib)
        except subprocess.TimeoutExpired:
            cp.kill()
            cp.wait()
            raise Fail("criu dump did not finish within %d s" % (120 + 10 * gib))
        secs = time.time() - t0
        dlog = os.path.join(c.img, "dump.log")
        self._save_criu_log(c, {"log": dlog}, "dump")
        lines = criu.gpusnap_lines(dlog)
        if lines:
            self.log.block("gpusnap: lines of dump.log", "\n".join(lines), max_lines=60)
        self.log.block("action script log", _read(slog) or "(empty)", max_lines=20)
        c.info["criu_rc"] = rc
        c.info["criu_s"] = round(secs, 3)
        self.log("criu dump rc %s after %.2f s" % (rc, secs))
        if rc != -signal.SIGKILL:
            self.log.file_tail("criu dump.log", dlog, 30)
            raise Fail("criu was not killed by the action script (rc %s; actions run: %s)" % (
                rc, " ".join(_actions(slog)) or "none"))
        dtext = _read(dlog)
        c.info["post_dump_reached"] = "post-dump" in dtext
        c.info["manifest"] = sorted(os.path.basename(x) for x in
                                    glob.glob(os.path.join(c.img, "gpusnap-*-manifest.img")))
        self.log("criu killed; manifests %s; data files %d" % (
            c.info["manifest"], len(glob.glob(os.path.join(c.img, "gpusnap-*-data-*.img")))))
        procs.reap_our_zombies(skip={pid})
        time.sleep(1.0)
        if not procs.alive(pid):
            raise Fail("the workload died with criu (%s)" % (procs.proc_stat(pid),))
        c.info["held_after_kill"] = (self.held(pid) or [])[:4]
        n1 = self.n_ticks(wlog)
        time.sleep(2.0)
        n2 = self.n_ticks(wlog)
        c.info["ticks_while_criu_dead"] = n2 - n1
        if n2 == n1:
            c.note("ticks stopped after criu died (%d ticks)" % n1)
        else:
            c.note("WARNING: %d ticks while criu was dead (expected none: memory released)" % (n2 - n1))
        t1 = time.time()
        rrc, rout = criu.gpusnap_cli(["recover", str(pid), "--images", c.img], self.log, timeout=300)
        c.info["recover_rc"] = rrc
        c.info["recover_output"] = rout.strip()[-600:]
        c.info["recover_s"] = round(time.time() - t1, 3)
        self.log.block("gpusnap recover", rout or "(no output)", max_lines=30)
        if rrc != 0:
            raise Fail("gpusnap recover exited %s: %s" % (rrc, rout.strip()[-300:]))
        c.note("recover: %s" % rout.strip()[-200:])
        n_rec = self.n_ticks(wlog)
        self.check_ticks_after(c, wlog, n_rec, window=(t0, time.time()))
        self.check_free(c, pid, "after gpusnap recover")

    def case_recover_nothing(self, c):
        p, wlog, wout, tids = self.start_workload(c, self.a.gib, c.path)
        rc, out = criu.gpusnap_cli(["recover", str(p.pid)], self.log, timeout=120)
        c.info["recover_rc"] = rc
        c.info["recover_output"] = out.strip()[-400:]
        self.log.block("gpusnap recover", out or "(no output)", max_lines=20)
        if rc != 0:
            c.problem("gpusnap recover exited %s" % rc)
        if "nothing to recover" not in out:
            c.problem("no 'nothing to recover' in the output: %s" % out.strip()[-200:])
        else:
            c.note(out.strip()[-160:])
        self.check_free(c, p.pid, "after gpusnap recover")
        self.check_ticks_after(c, wlog, self.n_ticks(wlog), need=3)


def _flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    return b


def _read(path):
    try:
        with open(path, "r", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _last(lines):
    return lines[-1].strip()[-300:] if lines else None


def _actions(slog):
    return [w.split("=", 1)[1] for w in _read(slog).split() if w.startswith("action=")]


def _kernel_ticks(path):
    """[(i, t, kernel_s, value)] of the long-kernel process's complete tick lines."""
    res = []
    for line in _read(path).split("\n")[:-1]:
        parts = line.split()
        if len(parts) >= 8 and parts[0] == "tick":
            try:
                res.append((int(parts[1]), float(parts[3]), float(parts[5]), int(parts[7])))
            except ValueError:
                pass
    return res


# ------------------------------------------------------------------------------ kill-matrix
#
# GPUSNAP_TEST_KILL_CRIU_AT=<point> in criu's environment makes the plugin SIGKILL its own criu at
# that point (common/host/src/fault.rs). One case per point and path; one workload per path is handed
# from case to case (a chain) while that is safe, so that few expensive transparent dumps run.

MATRIX_CASE = "kill-matrix"
KNOB = "GPUSNAP_TEST_KILL_CRIU_AT"
# common/host/src/fault.rs's POINTS, in the order a dump (then its rollback) or a restore reaches them,
# less STANDIN_ONLY_POINTS.
KILL_POINTS = ["dump-locked", "dump-data-out", "dump-lent", "dump-released", "dump-relocked",
               "dump-checkpointed", "dump-drained", "dump-before-manifest", "rollback-restored",
               "rollback-reload", "rollback-reclaimed", "restore-keeper-load",
               "restore-keeper-loaded", "restore-handing-over", "restore-control",
               "restore-unlocked", "restore-data"]
# Reached only where the GPU cannot run the hash kernel, which only the stand-in driver in CI can
# arrange (criu-tests/tests/fail_closed.rs); the last of the plugin's points.
STANDIN_ONLY_POINTS = ["restore-host-check"]
# The split path here is the default one, the hand-over (the memory lent to gpusnap-keeper and
# drained beside CRIU's dump; dump-data-out is the drain's first chunk). Reached only on it: on
# the transparent path criu then completes normally.
# The restore of such an image is handed over too: the keeper loads beside CRIU's restore
# (restore-keeper-load is on its thread, during CRIU's own restore: the half-restored process may
# be left asleep in CRIU's restorer, never running), then the job maps the memory.
SPLIT_ONLY_POINTS = {"dump-data-out", "dump-lent", "dump-released", "dump-relocked",
                     "dump-drained", "dump-before-manifest", "rollback-reclaimed",
                     "restore-keeper-load", "restore-keeper-loaded", "restore-handing-over"}
# Reached only on the copy-first route (handover = false), which this matrix does not run: a
# rollback after a hand-over maps the memory back instead of reloading it, and its restore loads
# in the keeper instead of through the job's agent.
COPY_FIRST_ONLY_POINTS = {"rollback-reload", "restore-data"}
# Split path, killed here: the hold must leave the process group-stopped (state T): between the
# release and the relock of a dump, and between the memory mapped back and the hold let go.
STOPPED_AT = {"dump-released", "rollback-reclaimed"}
# Killed here the memory is in place and the driver lock off (no hold yet): the process may run on.
RUNS_ON_AT = {"dump-lent"}
# --mock: the knob needs the plugin and a GPU, so the harness's action script kills criu at the
# nearest CRIU action instead (after post-dump the tasks run on; after post-restore the restored
# process stays stuck in CRIU's restorer, alive, until the harness kills it).
MOCK_KILL_ACTION = {"dump": "post-dump", "dump -R": "post-dump", "restore": "post-restore"}
# Seconds per GiB of a criu dump and restore on the H200, and what a criu run costs besides
# (bench/results/split-vs-transparent-h200.jsonl, 16 GiB: transparent ~17.5 s / ~12.7 s, split
# ~2 s / ~2.9 s): the estimate printed at the start.
MATRIX_RATES = {"transparent": (1.1, 0.8), "split": (0.12, 0.18)}
CRIU_S = 1.0
START_S = 1.5      # workload start, ready and 3 ticks
TICKS_S = 1.0      # 5 more ticks at 100 ms and the checker

# Action script of --mock: SIGKILLs the criu that runs it at action @KILL_ON@. Only its parent,
# and only if that is the criu working on @IMG@ (its command line has "-D @IMG@").
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

# CPU stand-in of .devcarry/gpusnap for --mock: `recover` ends a group stop, `verify` passes.
MOCK_CLI = r'''#!/bin/sh
case "$1" in
    recover) kill -CONT "$2" && echo "mock: pid $2 continued (SIGCONT); no GPU state here" ;;
    verify) echo "mock: $2: no gpusnap images checked" ;;
    *) echo "mock gpusnap: $1 is not simulated" >&2; exit 2 ;;
esac
'''


def point_operation(point):
    """The criu run a point is reached in: dump, dump -R (the rollback points) or restore."""
    if point.startswith("restore-"):
        return "restore"
    return "dump -R" if point.startswith("rollback-") else "dump"


def point_reached(point, path):
    if point in COPY_FIRST_ONLY_POINTS:
        return False
    return path == "split" or point not in SPLIT_ONLY_POINTS


def matrix_order(path, points):
    """The order in which one path's chain runs `points`. First the dump-side points after which
    the workload runs on (killed and recovered, or an unreached dump -R); then each plain dump
    that completes (a point not reached) followed by a restore-side point, which restores from
    the image that dump left, so that the dumps a restore needs are those of unreached points."""
    points = [p for p in KILL_POINTS if p in points]
    dumps = [p for p in points if point_operation(p) != "restore"]
    run_on = [p for p in dumps if point_reached(p, path) or point_operation(p) == "dump -R"]
    imaging = [p for p in dumps if p not in run_on]
    restores = [p for p in points if point_operation(p) == "restore"]
    order = list(run_on)
    while imaging or restores:
        for q in (imaging, restores):
            if q:
                order.append(q.pop(0))
    return order


def matrix_step(path, point, state, gib, watch_s=2.0):
    """(seconds, workload state after) of one case on the H200 when all goes as expected, from
    the chain's state before it: none, running or dumped."""
    rd, rr = MATRIX_RATES[path]
    dump_s, restore_s = rd * float(gib) + CRIU_S, rr * float(gib) + CRIU_S
    op, reached = point_operation(point), point_reached(point, path)
    s = 0.0
    if state == "none":
        s, state = START_S, "running"
    if op == "restore" and state == "running":
        s += dump_s
    if op != "restore" and state == "dumped":
        s += restore_s
    transparent = path == "transparent"
    if op == "restore":
        if not reached:
            return s + restore_s + TICKS_S, "running"
        # transparent: killed after the driver restore, nearly all of a restore's time
        killed = restore_s if transparent else CRIU_S + 0.5
        verify = 0.5 if transparent else 0.1 * float(gib)
        return s + killed + 0.5 + verify + restore_s + TICKS_S, "running"
    if not reached:  # criu completes: a dump leaves an image, a dump -R the workload running
        if op == "dump":
            return s + dump_s, "dumped"
        return s + dump_s + restore_s + TICKS_S, "running"
    if point in ("dump-locked", "dump-data-out"):
        until, recover = CRIU_S, 0.5
    elif op == "dump -R":  # the dump, then the rollback's driver restore (transparent: all data)
        until = dump_s + (restore_s if transparent else 1.0)
        recover = 0.5 if transparent else restore_s
    else:  # recover restores (transparent) or reloads (split) the data
        until, recover = dump_s, restore_s
    return s + until + 0.5 + watch_s + recover + TICKS_S, "running"


def matrix_plan(paths, points, gib, watch_s=2.0):
    """[(path, point, estimated s)] in the order the kill-matrix runs them (split first: cheap
    and every point is reached there)."""
    plan = []
    for path in [p for p in ("split", "transparent") if p in paths]:
        state = "none"
        for point in matrix_order(path, points):
            s, state = matrix_step(path, point, state, gib, watch_s)
            plan.append((path, point, s))
    return plan


class Chain:
    """One path's workload, handed from case to case: its state is none (no workload), running
    (pid, its tick log) or dumped (into img by the dump `dumped`, the process gone)."""

    def __init__(self, h, path):
        self.path, self.mode = path, MODES[path]
        self.c = Case(h, MATRIX_CASE, path)  # the workloads' files
        self.state, self.pid, self.wlog, self.tids = "none", None, None, []
        self.img, self.dumped = None, None
        self.n_started = 0


class MatrixCase(Case):
    def __init__(self, h, point, path):
        Case.__init__(self, h, "%s-%s" % (MATRIX_CASE, point), path)
        self.point, self.op = point, point_operation(point)
        self.expected = "killed" if point_reached(point, path) else "not reached"
        self.outcome = "not run"
        self.timings, self.gpusnap_lines = {}, []


class KillMatrix:
    def __init__(self, h):
        self.h, self.a, self.log = h, h.a, h.log
        self.gib = self.a.matrix_gib
        self.mock_cli = None
        if self.a.mock:
            self.mock_cli = os.path.join(self.a.work, "mock-gpusnap")
            os.makedirs(self.a.work, exist_ok=True)
            with open(self.mock_cli, "w") as f:
                f.write(MOCK_CLI)
            os.chmod(self.mock_cli, 0o755)

    def run(self, paths, points, t_start, emit):
        plan = matrix_plan(paths, points, self.gib, self.a.watch_s)
        chains = {}
        for path, point, _ in plan:
            ch = chains.get(path) or chains.setdefault(path, Chain(self.h, path))
            # from the chain's state now (a case that failed leaves no workload)
            est, _ = matrix_step(path, point, ch.state, self.gib, self.a.watch_s)
            elapsed = time.time() - t_start
            # faults.py's clock starts after the build, run-all's before: no slack past it
            if self.a.deadline_s and elapsed + est > self.a.deadline_s:
                self.log("deadline of %.0f s: skipping %s %s (estimate %.0f s, %.0f s gone)" % (
                    self.a.deadline_s, point, path, est, elapsed))
                emit({"case": MATRIX_CASE, "path": path, "point": point,
                      "operation": point_operation(point), "pass": None,
                      "detail": "skipped: deadline", "outcome": "skipped"})
                continue
            emit(self.run_one(ch, point, est))
        for ch in chains.values():
            self.end_chain(ch)

    def run_one(self, ch, point, est):
        log = self.log
        log("=" * 78)
        c = MatrixCase(self.h, point, ch.path)
        log("CASE %s %s, path %s (GPUSNAP_MODE=%s): criu %s with %s=%s, expected: %s; "
            "workload %s; estimate %.0f s" % (MATRIX_CASE, point, ch.path, ch.mode, c.op, KNOB,
                                              point, c.expected, ch.state, est))
        t0 = time.time()
        try:
            if c.op == "restore":
                self.restore_side(ch, c)
            else:
                self.dump_side(ch, c)
        except Fail as e:
            c.problem(str(e))
        except Exception:
            tb = output.format_exc()
            log.block("exception", tb)
            c.problem("exception: " + tb.strip().splitlines()[-1])
        finally:
            try:
                if c.problems:
                    # whatever state it is in, the next case starts from a fresh workload
                    if ch.wlog:
                        log.file_tail(os.path.basename(ch.wlog), ch.wlog, 12)
                    self.reset(ch, "after the problems of %s" % point)
            except Exception:
                log.block("reset exception", output.format_exc())
            output.archive_add(c.archive, "faults/%s" % c.tag, log)
            if not self.a.keep_images and c.img != ch.img:
                shutil.rmtree(c.img, ignore_errors=True)
        ok = not c.problems
        detail = "; ".join(c.problems if not ok else c.notes)
        rec = {"case": MATRIX_CASE, "path": ch.path, "point": point, "operation": c.op,
               "expected": c.expected, "outcome": c.outcome, "pass": ok, "detail": detail[:1500],
               "secs": round(time.time() - t0, 1), "estimate_s": round(est, 1), "gib": self.gib,
               "timings": c.timings, "gpusnap_lines": [l.strip()[-300:] for l in c.gpusnap_lines[-40:]],
               "info": c.info}
        log("RESULT %s %s %s: %s, outcome %s (%.0f s, estimate %.0f s) %s" % (
            MATRIX_CASE, point, ch.path, "PASS" if ok else "FAIL", c.outcome, rec["secs"], est,
            detail[:400]))
        return rec

    # ----------------------------------------------------------- the chain

    def need(self, ch, c, state):
        """Brings the chain's workload to `state` (running or dumped) for case c."""
        t0 = time.time()
        if ch.state == "none":
            ch.n_started += 1
            p, wlog, _, tids = self.h.start_workload(ch.c, self.gib, ch.path,
                                                     name="workload-%d" % ch.n_started)
            ch.state, ch.pid, ch.wlog, ch.tids = "running", p.pid, wlog, tids
            c.info["workload"] = os.path.basename(wlog)
        if state == "dumped" and ch.state == "running":
            ch.tids = procs.tree_tids(ch.pid)
            r = self.criu(ch, c, "dump", c.img)
            self.save_log(c, r, "prep-dump")
            c.timings["prep_dump_s"] = round(r["secs"], 3)
            if r["rc"] != 0:
                raise Fail("preparing: criu dump failed with rc %s: %s" % (
                    r["rc"], _last(r["gpusnap_lines"])))
            self.dumped(ch, c.img, r)
        if state == "running" and ch.state == "dumped":
            r = self.criu(ch, c, "restore", ch.img)
            self.save_log(c, r, "prep-restore")
            c.timings["prep_restore_s"] = round(r["secs"], 3)
            if r["rc"] != 0:
                raise Fail("preparing: criu restore failed with rc %s: %s" % (
                    r["rc"], _last(r["gpusnap_lines"])))
            self.restored(ch)
            self.h.check_ticks_after(c, ch.wlog, ch.dumped["ticks"], need=3)
        c.info["ticks_before"] = self.h.n_ticks(ch.wlog)
        if time.time() - t0 > 0.5:
            self.log("workload %s (pid %d) after %.1f s" % (ch.state, ch.pid, time.time() - t0))

    def dumped(self, ch, img, r):
        """criu dump completed: the workload exits, its pids become free; img is the chain's."""
        if not procs.wait_until(lambda: _gone(ch.pid), 30):
            raise Fail("workload still running 30 s after criu dump returned")
        for p in ch.c.popens:
            p.poll()
        if not procs.wait_pids_free(ch.tids, 60, self.log):
            raise Fail("dumped pids still in use 60 s after the dump")
        ch.state, ch.img = "dumped", img
        ch.dumped = {"start": r["start"], "end": r["end"], "ticks": self.h.n_ticks(ch.wlog),
                     "log_bytes": os.path.getsize(ch.wlog)}

    def restored(self, ch):
        """A restore from ch.img completed: the workload runs (same pid); the image is spent."""
        ch.state = "running"
        if not self.a.keep_images:
            shutil.rmtree(ch.img, ignore_errors=True)
        ch.img = None

    def reset(self, ch, why):
        """Kills the chain's workload (any state) and drops its image: the next case starts anew."""
        if ch.state == "none":
            return
        self.log("chain %s: dropping the workload (%s, pid %s) %s" % (ch.path, ch.state, ch.pid, why))
        pids = sorted(set(ch.tids + [ch.pid]))
        # only a process that is still our workload: its command line names its own tick log (a
        # restored one's too); a dumped one's pid may be anyone's by now
        if procs.alive(ch.pid) and ch.wlog in _cmdline(ch.pid):
            procs.kill_and_wait([ch.pid], self.log, wait_pids=pids, timeout=60)
        elif procs.alive(ch.pid):
            self.log("pid %d is not our workload any more (%s): left alone" % (
                ch.pid, _cmdline(ch.pid)[:120]))
        else:
            procs.wait_pids_free(pids, 60, self.log)
        for p in ch.c.popens:
            p.poll()
        if ch.img and not self.a.keep_images:
            shutil.rmtree(ch.img, ignore_errors=True)
        ch.state, ch.pid, ch.img, ch.dumped = "none", None, None, None

    def end_chain(self, ch):
        try:
            self.reset(ch, "at the end of the matrix")
            if ch.path == "split":
                for q in glob.glob(os.path.join(ch.c.dir, "workload-*.out")):
                    criu.log_agent_lines(self.log, q)
        except Exception:
            self.log.block("end of chain exception", output.format_exc())
        output.archive_add(ch.c.archive, "faults/%s" % ch.c.tag, self.log)

    # ------------------------------------------------------------ criu runs

    def criu(self, ch, c, op, img, point=None):
        """criu dump / dump -R / restore of the chain's workload; with `point`, the knob is set in
        criu's environment (and under --mock the harness kills criu where the point is reached)."""
        env, extra = None, []
        if point:
            env = {KNOB: point}
            if self.a.mock and point_reached(point, ch.path):
                extra = ["--action-script", self.mock_kill_script(c, MOCK_KILL_ACTION[op], img)]
        timeout = 120 + 10 * float(self.gib)
        if op == "restore":
            return criu.criu_restore(img, self.a.plugdir, ch.mode, self.log, timeout=timeout,
                                     extra=extra, env=env)
        return criu.criu_dump(ch.pid, img, self.a.plugdir, ch.mode, self.log,
                              leave_running=op == "dump -R", timeout=timeout, extra=extra, env=env)

    def mock_kill_script(self, c, action, img):
        script, slog = c.f("mock-kill-criu.sh"), c.f("action-script.log")
        with open(script, "w") as f:
            f.write(MOCK_KILL_SCRIPT.replace("@LOG@", slog).replace("@KILL_ON@", action)
                    .replace("@IMG@", img))
        os.chmod(script, 0o755)
        c.note("mock: the harness kills criu at CRIU's %s action (the knob needs the plugin "
               "and a GPU)" % action)
        return script

    def cli(self, args, timeout=90):
        return criu.gpusnap_cli(args, self.log, timeout=timeout, cli=self.mock_cli)

    def save_log(self, c, r, what):
        src = r.get("log")
        if src and os.path.exists(src):
            dst = os.path.join(c.dir, "%s.log" % what)
            shutil.copy(src, dst)
            c.archive.append(dst)

    def expect(self, c, ok, msg):
        """A check that needs the plugin and a GPU: a problem there, a note under --mock."""
        if not ok:
            if self.a.mock:
                c.note("mock, not met (GPU-only check): " + msg)
            else:
                c.problem(msg)
        return ok

    def judge_run(self, c, r, what):
        """Outcome of the criu run that has the knob: killed, not reached, or failed."""
        c.timings["criu_s"] = round(r["secs"], 3)
        c.info["criu_rc"] = r["rc"]
        c.gpusnap_lines = r["gpusnap_lines"]
        fired = [l for l in r["gpusnap_lines"] if "%s=%s" % (KNOB, c.point) in l]
        if r["rc"] == -signal.SIGKILL:
            c.outcome = "killed"
            self.log("criu %s killed after %.2f s" % (what, r["secs"]))
            self.expect(c, fired, "no gpusnap: line saying that %s=%s killed CRIU (last: %s)" % (
                KNOB, c.point, _last(r["gpusnap_lines"])))
            if c.expected != "killed":
                c.problem("criu %s was killed at %s, a point the %s path should not reach" % (
                    what, c.point, c.path))
        elif r["rc"] == 0:
            c.outcome = "not reached"
            if c.expected == "killed":
                c.problem("criu %s exited 0: %s was not reached (expected a kill)" % (what, c.point))
            else:
                c.note("not reached on the %s path, as expected: criu %s exited 0 in %.1f s" % (
                    c.path, what, r["secs"]))
        else:
            c.outcome = "criu rc %s" % r["rc"]
            c.problem("criu %s failed with rc %s (neither killed nor complete): %s" % (
                what, r["rc"], _last(r["gpusnap_lines"])))
        return c.outcome

    # ------------------------------------------------------------ the cases

    def dump_side(self, ch, c):
        self.need(ch, c, "running")
        pid, wlog = ch.pid, ch.wlog
        ch.tids = procs.tree_tids(pid)
        r = self.criu(ch, c, c.op, c.img, point=c.point)
        self.save_log(c, r, "dump")
        outcome = self.judge_run(c, r, c.op)
        if outcome == "killed":
            self.after_dump_kill(ch, c, r)
        elif outcome == "not reached" and c.op == "dump":
            self.dumped(ch, c.img, r)
            c.note("the dump completed: its image serves the next restore")
        elif outcome == "not reached":
            self.h.check_free(c, pid, "after criu dump -R")
            self.h.check_ticks_after(c, wlog, self.h.n_ticks(wlog), window=(r["start"], time.time()))
        else:
            time.sleep(0.3)
            self.h.check_free(c, pid, "after the failed dump")

    def after_dump_kill(self, ch, c, r):
        """criu died in a dump: the workload must survive it, not advance while it is held, and
        `gpusnap recover` must bring it back bit-exact."""
        pid, wlog = ch.pid, ch.wlog
        time.sleep(0.5)  # the queued SIGSTOP of a hold takes effect as the tracer's death detaches
        procs.reap_our_zombies(skip={pid})
        if not procs.alive(pid):
            raise Fail("the workload died with criu (%s)" % (procs.proc_stat(pid),))
        stopped_expected = ch.path == "split" and c.point in STOPPED_AT
        if stopped_expected:
            procs.wait_until(lambda: (procs.proc_stat(pid) or "?")[0] == "T", 1.0)
        st = (procs.proc_stat(pid) or "?")[0]
        threads = self.h.held(pid) or []
        c.info["state_after_kill"] = st
        c.info["threads_after_kill"] = threads[:6]
        self.log("after criu died: pid %d state %s, threads (tid, state, TracerPid) %s" % (
            pid, st, procs.short_list(threads, 6)))
        traced = [t for t in threads if t[2] not in (0, None)]
        if traced:
            c.problem("threads still traced after criu died: %s" % traced[:4])
        if stopped_expected:
            self.expect(c, st == "T", "state %s after criu died at %s, expected T (group-stopped "
                        "by the hold)" % (st, c.point))
        n1 = self.h.n_ticks(wlog)
        time.sleep(self.a.watch_s)
        n2 = self.h.n_ticks(wlog)
        c.timings["ticks_while_dead"] = n2 - n1
        if c.point in RUNS_ON_AT:
            c.note("%d ticks in %.1f s while criu was dead (allowed: memory in place, unlocked)" % (
                n2 - n1, self.a.watch_s))
        elif self.expect(c, n2 == n1, "%d ticks in %.1f s after criu died at %s (memory released "
                         "or the driver lock holds it: none expected)" % (n2 - n1, self.a.watch_s,
                                                                          c.point)):
            c.note("no ticks for %.1f s after criu died (state %s)" % (self.a.watch_s, st))
        bad = [t for t in ticklog.parse_workload_log(wlog)[1] if t["ok"] != 1]
        if bad:
            c.problem("%d ticks with ok 0 after criu died, first: tick %d err %d" % (
                len(bad), bad[0]["tick"], bad[0]["err"]))
        t1 = time.time()
        rrc, rout = self.cli(["recover", str(pid), "--images", c.img])
        c.timings["recover_s"] = round(time.time() - t1, 3)
        c.info["recover_rc"] = rrc
        c.info["recover_output"] = rout.strip()[-600:]
        self.log.block("gpusnap recover", rout or "(no output)", max_lines=30)
        if rrc != 0:
            raise Fail("gpusnap recover exited %s: %s" % (rrc, rout.strip()[-300:]))
        c.note("recover (%.1f s): %s" % (c.timings["recover_s"], rout.strip()[-200:]))
        self.h.check_free(c, pid, "after gpusnap recover")
        self.h.check_ticks_after(c, wlog, self.h.n_ticks(wlog), window=(r["start"], time.time()))

    def restore_side(self, ch, c):
        self.need(ch, c, "dumped")
        pid, wlog, img, dumped = ch.pid, ch.wlog, ch.img, ch.dumped
        if img != c.img:
            c.note("restores the image of %s" % os.path.basename(img))
        r = self.criu(ch, c, "restore", img, point=c.point)
        self.save_log(c, r, "restore-fault")
        outcome = self.judge_run(c, r, "restore")
        if outcome == "killed":
            self.after_restore_kill(ch, c, r)
            r2 = self.criu(ch, c, "restore", img)
            self.save_log(c, r2, "restore-again")
            c.timings["restore_again_s"] = round(r2["secs"], 3)
            if r2["rc"] != 0:
                raise Fail("the second restore of the same image failed with rc %s: %s" % (
                    r2["rc"], _last(r2["gpusnap_lines"])))
            r = r2
        elif outcome != "not reached":
            self.h.dumped_pid_gone(c, pid, r.get("pid"))
            raise Fail("the image was not restored")
        self.restored(ch)
        self.h.check_free(c, pid, "after the restore")
        self.h.check_ticks_after(c, wlog, dumped["ticks"], window=(dumped["start"], r["end"]))

    def after_restore_kill(self, ch, c, r):
        """criu died in a restore: the half-restored process must be dead at once and never have
        run; the image must still verify, and its pids be free for the next restore."""
        pid, wlog, dumped = ch.pid, ch.wlog, ch.dumped
        limit = self.a.watch_s
        # a little longer than the limit, to say how late it died (--mock: it never dies)
        gone = procs.wait_until(lambda: _gone(pid), limit + (1.0 if self.a.mock else 8.0), poll=0.01)
        die_s = time.time() - r["end"]
        if gone:
            c.timings["die_s"] = round(die_s, 3)
            self.log("restored pid %d gone %.3f s after criu died" % (pid, die_s))
            self.expect(c, die_s <= limit, "the restored process died only %.1f s after criu "
                        "(limit %.1f s)" % (die_s, limit))
        else:
            self.expect(c, False, "the restored process (pid %d, state %s) was still alive %.0f s "
                        "after criu died" % (pid, (procs.proc_stat(pid) or "?")[0], die_s))
            procs.kill_and_wait([pid], self.log, wait_pids=[pid], timeout=30)
        n = self.h.n_ticks(wlog)
        c.info["ticks_from_killed_restore"] = n - dumped["ticks"]
        self.expect(c, n == dumped["ticks"], "the half-restored process ran: %d ticks after the "
                    "killed restore" % (n - dumped["ticks"]))
        bad = [t for t in ticklog.parse_workload_log(wlog)[1] if t["ok"] != 1]
        if bad:
            c.problem("%d ticks with ok 0, first: tick %d err %d" % (
                len(bad), bad[0]["tick"], bad[0]["err"]))
        size = os.path.getsize(wlog)
        if size != dumped["log_bytes"]:
            # the image holds the log as it was at the dump: so must the file, for the next restore
            os.truncate(wlog, dumped["log_bytes"])
            c.note("tick log cut back from %d to %d bytes (its size at the dump)" % (
                size, dumped["log_bytes"]))
        vrc, vout = self.cli(["verify", ch.img])
        c.info["verify_rc"] = vrc
        self.log.block("gpusnap verify", vout or "(no output)", max_lines=20)
        if vrc != 0:
            c.problem("gpusnap verify of the image after the killed restore exited %s: %s" % (
                vrc, vout.strip()[-300:]))
        if not procs.wait_pids_free(sorted(set(ch.tids + [pid])), 60, self.log):
            raise Fail("the restored pids still in use 60 s after the killed restore")


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _gone(pid):
    """pid runs no more (our zombies reaped on the way)."""
    procs.reap_our_zombies()
    return not procs.alive(pid)


CASE_FUNCS = {
    "damaged-image": Harness.case_damaged_image,
    "no-gpu-memory": Harness.case_no_gpu_memory,
    "lock-timeout": Harness.case_lock_timeout,
    "criu-killed-then-recover": Harness.case_criu_killed,
    "recover-nothing": Harness.case_recover_nothing,
}


def run_case(h, name, path):
    log = h.log
    log("=" * 78)
    log("CASE %s, path %s (GPUSNAP_MODE=%s)" % (name, path, MODES.get(path)))
    c = Case(h, name, path)
    t0 = time.time()
    try:
        CASE_FUNCS[name](h, c)
    except Fail as e:
        c.problem(str(e))
    except Exception:
        tb = output.format_exc()
        log.block("exception", tb)
        c.problem("exception: " + tb.strip().splitlines()[-1])
    finally:
        try:
            if path == "split":
                for n in ("workload.out", "long_kernel.out"):
                    q = os.path.join(c.dir, n)
                    if os.path.exists(q):
                        criu.log_agent_lines(log, q)
            if c.problems:
                for n in ("workload.log", "workload.out", "long_kernel.out", "blocker.out"):
                    q = os.path.join(c.dir, n)
                    if os.path.exists(q):
                        log.file_tail(n, q, 20)
            h.cleanup(c)
        except Exception:
            log.block("cleanup exception", output.format_exc())
        output.archive_add(c.archive, "faults/%s" % c.tag, log)
        if not h.a.keep_images:
            shutil.rmtree(c.img, ignore_errors=True)
    ok = not c.problems
    detail = "; ".join(c.problems if not ok else c.notes)
    rec = {"case": name, "path": path, "pass": ok, "detail": detail[:1500],
           "secs": round(time.time() - t0, 1), "info": c.info}
    log("RESULT %s %s: %s (%.0f s) %s" % (name, path, "PASS" if ok else "FAIL", rec["secs"], detail[:400]))
    return rec


def log_matrix_plan(log, a, paths, points):
    plan = matrix_plan(paths, points, a.matrix_gib, a.watch_s)
    total = sum(s for _, _, s in plan)
    log("%s: %d cases at %s GiB, estimate %.0f s (%s); deadline %.0f s" % (
        MATRIX_CASE, len(plan), a.matrix_gib, total, ", ".join(
            "%s %.0f s" % (p, sum(s for q, _, s in plan if q == p)) for p in paths),
        a.deadline_s))
    for path, point, s in plan:
        log("  %-12s %-18s %-8s expected %-12s ~%4.0f s" % (
            path, point, point_operation(point),
            "killed" if point_reached(point, path) else "not reached", s))
    if a.deadline_s and total > a.deadline_s:
        log("WARNING: the estimate passes --deadline-s: the last cases will be skipped "
            "(--points, --paths or --matrix-gib make the matrix smaller)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="all",
                    help="comma list of %s, or all (default: all but kill-matrix)" % ",".join(
                        ALL_CASES + [MATRIX_CASE]))
    ap.add_argument("--gib", type=float, default=1, help="workload size (default 1)")
    ap.add_argument("--nomem-gib", type=float, default=8, help="workload size of no-gpu-memory (default 8)")
    ap.add_argument("--paths", default="", help="only these paths (comma list of split,transparent)")
    ap.add_argument("--matrix-gib", type=float, default=16, help="workload size of kill-matrix (default 16)")
    ap.add_argument("--points", default="",
                    help="kill-matrix: only these points (comma list of %s)" % ",".join(KILL_POINTS))
    ap.add_argument("--watch-s", type=float, default=2.0,
                    help="kill-matrix: seconds a workload must not tick after its dump's criu died, "
                         "and within which a restore's must be dead (default 2)")
    ap.add_argument("--sleep-cycles", type=float, default=2e10,
                    help="torch.cuda._sleep cycles per kernel in lock-timeout (default 2e10, ~10 s)")
    ap.add_argument("--lock-timeout-ms", type=int, default=1000)
    ap.add_argument("--kill-on", default="post-dump,network-lock",
                    help="CRIU actions at which the action script kills criu (default post-dump,"
                         "network-lock; CRIU runs network-lock only for a process in its own net "
                         "namespace, post-dump always, after the device checkpoint)")
    ap.add_argument("--interval-ms", type=int, default=100)
    ap.add_argument("--images", default="/dev/shm/gpusnap-faults")
    ap.add_argument("--work", default="/tmp/gpusnap-work/faults")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--python", default=sys.executable, help="python with torch (helpers)")
    ap.add_argument("--name", default="faults-h200", help="bench/results/NAME.jsonl")
    ap.add_argument("--deadline-s", type=float, default=500,
                    help="start no new case after this many seconds (default 500)")
    ap.add_argument("--budget-s", type=float, default=0, help="alias of --deadline-s (run-all.sh)")
    ap.add_argument("--keep-images", action="store_true")
    ap.add_argument("--mock", action="store_true", help="CPU stand-ins (harness test, no GPU)")
    a = ap.parse_args()
    if a.budget_s:
        a.deadline_s = a.budget_s
    a.kill_on = [x for x in a.kill_on.split(",") if x]
    a.gib = int(a.gib) if float(a.gib).is_integer() else a.gib
    a.nomem_gib = int(a.nomem_gib) if float(a.nomem_gib).is_integer() else a.nomem_gib
    a.matrix_gib = int(a.matrix_gib) if float(a.matrix_gib).is_integer() else a.matrix_gib
    cases = ALL_CASES if a.cases == "all" else [x.strip() for x in a.cases.split(",") if x.strip()]
    unknown = [x for x in cases if x not in ALL_CASES + [MATRIX_CASE]]
    if unknown:
        ap.error("unknown case(s) %s; known: %s" % (unknown, ", ".join(ALL_CASES + [MATRIX_CASE])))
    only = [x for x in a.paths.split(",") if x]
    bad = [x for x in only if x not in MODES]
    if bad:
        ap.error("unknown path(s) %s; known: split, transparent" % bad)
    points = [x.strip() for x in a.points.split(",") if x.strip()] or list(KILL_POINTS)
    bad = [x for x in points if x not in KILL_POINTS]
    if bad:
        ap.error("unknown point(s) %s; known: %s" % (bad, ", ".join(KILL_POINTS)))

    t_start = time.time()
    out, log, mi = output.start_run("faults", "gpusnap faults: %s" % " ".join(sys.argv), a.plugdir)
    jsonls = output.result_files(out, a.name, a.mock)
    for f in (crlib.AGENT_SO, crlib.GPUSNAP_CLI, crlib.CRIU, a.workload):
        log("%s: %s" % (f, "present" if os.path.exists(f) else "MISSING"))
    if os.path.isfile(crlib.GPUSNAP_CLI):
        usage = subprocess.run([crlib.GPUSNAP_CLI], capture_output=True, text=True).stdout
        rl = [l for l in usage.splitlines() if "recover" in l]
        log("gpusnap CLI: %s" % (rl[0].strip() if rl else "(no recover in its usage)"))
        if not rl or "not implemented" in rl[0]:
            log("WARNING: %s has no working `recover` (stale bundle? scripts/build-device-bundle.sh "
                "rebuilds .devcarry): criu-killed-then-recover and recover-nothing will fail" %
                crlib.GPUSNAP_CLI)
    stray = sorted(k for k in os.environ if k.startswith("GPUSNAP_"))
    if stray:
        log("note: GPUSNAP_* in the environment (passed to criu): %s" % stray)
    matrix_paths = [p for p in ("split", "transparent") if not only or p in only]
    if MATRIX_CASE in cases:
        log_matrix_plan(log, a, matrix_paths, points)
    os.makedirs(a.images, exist_ok=True)
    h = Harness(a, log, mi)
    run_id = time.strftime("%Y%m%dT%H%M%S")
    results = []

    def emit(rec):
        full = {"run": run_id, "date": output.iso_now(), "gpu": mi.get("gpu"),
                "driver": mi.get("driver"), "case": rec["case"], "path": rec["path"],
                "pass": rec["pass"], "detail": rec["detail"]}
        full.update({k: v for k, v in rec.items() if k not in full})
        if a.mock:
            full["mock"] = True
        output.append_jsonl(jsonls, full)
        results.append(full)

    for name in cases:
        if name == MATRIX_CASE:
            KillMatrix(h).run(matrix_paths, points, t_start, emit)
            continue
        for path in CASE_PATHS[name]:
            if only and path not in only:
                continue
            if a.deadline_s and time.time() - t_start > a.deadline_s:
                log("deadline of %.0f s passed: skipping %s %s" % (a.deadline_s, name, path))
                emit({"case": name, "path": path, "pass": None, "detail": "skipped: deadline"})
            else:
                emit(run_case(h, name, path))
    log("=" * 78)
    log("SUMMARY (%.0f s)" % (time.time() - t_start))
    for r in results:
        res = "SKIP" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        name = r["case"] + (" " + r["point"] if r.get("point") else "")
        extra = " [%s]" % r["outcome"] if r.get("outcome") else ""
        log("%-36s %-12s %-5s %6s s%s  %s" % (name, r["path"], res, r.get("secs", "-"), extra,
                                              r["detail"][:300]))
    n_pass = sum(1 for r in results if r["pass"])
    n_fail = sum(1 for r in results if r["pass"] is False)
    n_skip = sum(1 for r in results if r["pass"] is None)
    log("faults: %d passed, %d failed, %d skipped" % (n_pass, n_fail, n_skip))
    return 1 if n_fail or n_skip else 0


if __name__ == "__main__":
    sys.exit(main())
