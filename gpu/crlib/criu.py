"""CRIU runs with the gpusnap plugin (through scripts/criu), what they leave in the image
directory, and the gpusnap CLI."""

import json
import os
import re
import shutil
import subprocess
import time

from crlib import CRIU, GPUSNAP_CLI, KEEPER, PLUGIN_SO, REPO
from crlib import ticklog
from crlib.procs import all_stats, wait_until


def install_plugin(plugdir, log):
    os.makedirs(plugdir, exist_ok=True)
    for f in os.listdir(plugdir):
        if f.endswith(".so") or f == "gpusnap-keeper":
            os.unlink(os.path.join(plugdir, f))
    if os.path.isfile(PLUGIN_SO):
        shutil.copy2(PLUGIN_SO, os.path.join(plugdir, "gpusnap.so"))
        log("installed %s as %s/gpusnap.so" % (PLUGIN_SO, plugdir))
        # The split path's hand-over starts gpusnap-keeper from beside the plugin.
        if os.path.isfile(KEEPER):
            shutil.copy2(KEEPER, os.path.join(plugdir, "gpusnap-keeper"))
            os.chmod(os.path.join(plugdir, "gpusnap-keeper"), 0o755)
            log("installed %s as %s/gpusnap-keeper" % (KEEPER, plugdir))
        else:
            log("WARNING: %s missing: the split path copies data out first (no hand-over)" % KEEPER)
        return True
    log("WARNING: %s missing: plugin dir %s is empty (CRIU runs without gpusnap)" % (PLUGIN_SO, plugdir))
    return False


def criu_env(mode, extra=None):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if mode:
        env["GPUSNAP_MODE"] = mode
    env.update(extra or {})
    return env


def gpusnap_lines(path, needle="gpusnap:"):
    try:
        with open(path, "r", errors="replace") as f:
            return [l.rstrip("\n") for l in f if needle in l]
    except OSError:
        return []


def data_path(lines):
    """handoff / copy / mixed from the dump's routes line (None: no split-path process)."""
    kinds = set()
    for l in lines:
        m = re.search(r"routes: (\d+) lent, (\d+) copied first", l)
        if m:
            lent, copied = int(m.group(1)), int(m.group(2))
            kinds.add("mixed" if lent and copied else "handoff" if lent else "copy")
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"


def log_agent_lines(log, path, n=40):
    lines = gpusnap_lines(path, "gpusnap-agent:")
    if lines:
        log.block("gpusnap-agent: lines of %s" % os.path.basename(path), "\n".join(lines), max_lines=n)


def criu_dump(pid, imgdir, plugdir, mode, log, leave_running=False, timeout=600, extra=(), env=None):
    """env: variables for criu's environment only (GPUSNAP_TEST_KILL_CRIU_AT, ...)."""
    os.makedirs(imgdir, exist_ok=True)
    cmd = [CRIU, "dump", "-t", str(pid), "-D", imgdir, "-L", plugdir, "-v4", "-o", "dump.log"]
    if leave_running:
        cmd.append("-R")
    cmd += list(extra) + os.environ.get("CRIU_DUMP_EXTRA", "").split()
    return _run_criu(cmd, imgdir, "dump", mode, log, timeout, env)


def criu_restore(imgdir, plugdir, mode, log, timeout=600, extra=(), env=None):
    pidfile = os.path.join(imgdir, "restore.pid")
    try:
        os.unlink(pidfile)
    except OSError:
        pass
    cmd = [CRIU, "restore", "-D", imgdir, "-L", plugdir, "-v4", "-o", "restore.log",
           "--restore-detached", "--pidfile", pidfile] + list(extra)
    cmd += os.environ.get("CRIU_RESTORE_EXTRA", "").split()
    res = _run_criu(cmd, imgdir, "restore", mode, log, timeout, env)
    res["pid"] = None
    try:
        with open(pidfile) as f:
            res["pid"] = int(f.read().strip())
    except (OSError, ValueError):
        pass
    return res


def _run_criu(cmd, imgdir, what, mode, log, timeout, env=None):
    log("$ %sGPUSNAP_MODE=%s %s" % ("".join("%s=%s " % kv for kv in sorted((env or {}).items())),
                                    mode, " ".join(cmd)))
    t0 = time.time()
    p = subprocess.Popen(cmd, env=criu_env(mode, env), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        # Say where it hangs before killing it: the log's tail and every thread's kernel wait.
        log.file_tail("criu %s still running after %d s: its log" % (what, timeout),
                      os.path.join(imgdir, "%s.log" % what), 40)
        log.block("where criu and its target wait", hang_report(p.pid), max_lines=200)
        p.kill()
        try:
            out, _ = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a child of criu still holds the pipe
            out = "(output not read: the pipe stayed open after criu was killed)"
        rc, out = 124, "TIMEOUT after %d s\n%s" % (timeout, out or "")
    t1 = time.time()
    res = {"rc": rc, "secs": t1 - t0, "start": t0, "end": t1,
           "log": os.path.join(imgdir, "%s.log" % what)}
    log("criu %s rc %d in %.3f s" % (what, rc, t1 - t0))
    if out.strip():
        log.block("criu %s output" % what, out, max_lines=40)
    lines = gpusnap_lines(res["log"])
    res["gpusnap_lines"] = lines
    if lines:
        log.block("gpusnap: lines of %s.log" % what, "\n".join(lines), max_lines=200)
    else:
        log("(no gpusnap: lines in %s.log)" % what)
    if rc != 0:
        log.file_tail("criu %s failed" % what, res["log"], 30)
    return res


def hang_report(criu_pid):
    """Threads of criu and of every process it traces (ptrace), with state, kernel wait channel
    and, readable as root, kernel stack: for a criu run that does not return."""
    lines = []
    traced = [pid for pid in all_stats() if _tracer(pid) == criu_pid]
    for pid in [criu_pid] + sorted(traced):
        try:
            tids = sorted(int(t) for t in os.listdir("/proc/%d/task" % pid))
        except OSError:
            continue
        for tid in tids:
            base = "/proc/%d/task/%d" % (pid, tid)
            comm = _read(base + "/comm").strip()
            wchan = _read(base + "/wchan").strip()
            st = (_read(base + "/stat").rsplit(")", 1) + [""])[1].split()[:1]
            lines.append("pid %d tid %d %s state %s wchan %s" % (pid, tid, comm, st, wchan))
            stopped = st == ["t"]
            if not stopped:
                # where a sleeping thread is: its system call, code and (futex) wait address
                lines.append("    syscall: %s" % _where_blocked(pid, _read(base + "/syscall")))
            stack = _read(base + "/stack").strip()
            if stack and (tid == pid or not stopped):
                lines.extend("    " + l for l in stack.splitlines()[:12])
    return "\n".join(lines) or "(no threads found)"


def _where_blocked(pid, syscall_text):
    """`/proc/.../syscall` (nr a0..a5 sp pc) with pc's mapping and, for futex (202 on x86_64),
    the mapping of the futex address."""
    f = syscall_text.split()
    if len(f) != 9:
        return syscall_text.strip() or "?"
    maps = _read("/proc/%d/maps" % pid).splitlines()

    def mapping(addr):
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].rsplit("/", 1)[-1] if len(parts) > 5 else "[anon]"
        return "?"

    out = "nr %s pc %s in %s" % (f[0], f[8], mapping(int(f[8], 16)))
    if f[0] == "202":
        out += ", futex %s in %s" % (f[1], mapping(int(f[1], 16)))
    return out


def _tracer(pid):
    for line in _read("/proc/%d/status" % pid).splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1])
    return 0


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def image_stats(imgdir):
    """Sizes of the image dir: all files but logs and pid files."""
    total = alloc = 0
    files = {}
    gp_data = gp_manifest = 0
    try:
        names = sorted(os.listdir(imgdir))
    except OSError:
        names = []
    for n in names:
        p = os.path.join(imgdir, n)
        if not os.path.isfile(p) or n.endswith(".log") or n.endswith(".pid"):
            continue
        st = os.stat(p)
        total += st.st_size
        alloc += st.st_blocks * 512
        files[n] = st.st_size
        if n.startswith("gpusnap-") and "-data-" in n:
            gp_data += 1
        if n.startswith("gpusnap-") and n.endswith("-manifest.img"):
            gp_manifest += 1
    big = sorted(files.items(), key=lambda kv: -kv[1])[:12]
    return {"image_bytes": total, "image_alloc_bytes": alloc, "n_files": len(files),
            "gpusnap_data_files": gp_data, "gpusnap_manifests": gp_manifest, "largest": big}


def read_stats_json(imgdir):
    p = os.path.join(imgdir, "gpusnap-stats.json")
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def gpusnap_cli(args, log, timeout=300, cli=None):
    """Runs the gpusnap CLI (cli: a stand-in for it, for harness tests without a GPU)."""
    cli = cli or GPUSNAP_CLI
    if not os.path.isfile(cli):
        log("gpusnap CLI %s missing; skipped %s" % (cli, " ".join(args)))
        return None, ""
    cmd = [cli] + list(args)
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, out = r.returncode, (r.stdout or "") + (r.stderr or "")
    except subprocess.TimeoutExpired:
        rc, out = 124, "TIMEOUT"
    except OSError as e:
        rc, out = 126, repr(e)
    log("$ %s -> rc %s in %.2f s" % (" ".join(cmd), rc, time.time() - t0))
    return rc, out


def save_criu_logs(imgdir, work, name):
    """Copies imgdir's dump.log / restore.log to work/NAME-dump.log etc.; returns the copies."""
    saved = []
    for what in ("dump", "restore"):
        p = os.path.join(imgdir, what + ".log")
        if os.path.exists(p):
            q = os.path.join(work, "%s-%s.log" % (name, what))
            shutil.copy(p, q)
            saved.append(q)
    return saved


def restore_and_check(imgdir, plugdir, log, wlog, n_dump, timeout):
    """criu restore from IMGDIR, then 5 more ticks of gpu/workload.cu's log WLOG after the
    N_DUMP ticks it had at the dump, and the checker over the whole log. Returns (restore
    seconds, restored pid, checker problems, identical); raises RuntimeError when the restore
    fails (its pid then comes with the error, for the caller's cleanup, as .pid)."""
    restore = criu_restore(imgdir, plugdir, "auto", log, timeout=timeout)
    if restore["rc"] != 0:
        e = RuntimeError("restore failed with rc %d" % restore["rc"])
        e.pid = restore["pid"]
        raise e
    wait_until(lambda: len(ticklog.parse_workload_log(wlog)[1]) >= n_dump + 5, 60)
    ready, ticks, errors = ticklog.parse_workload_log(wlog)
    chk = ticklog.check_ticks(ready, ticks, errors, need_after=5, after_index=n_dump)
    return round(restore["secs"], 3), restore["pid"], chk["problems"], chk["pass"]


def verify_image_dir(imgdir, log):
    """`gpusnap verify IMGDIR` (parent images included), its output in the log. Returns its exit
    status (None without the CLI) and the problem to record, if any."""
    rc, out = gpusnap_cli(["verify", imgdir], log)
    log.block("gpusnap verify (chain)", out or "", max_lines=30)
    return rc, ([] if rc in (0, None) else ["gpusnap verify rc %s" % rc])
