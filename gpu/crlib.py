"""Shared harness for gpusnap's GPU scripts (stdlib only; Python 3.8+).

Used by gpu/e2e.py, bench/bench.py and gpu/torch_cases.py. It starts workloads
(each in its own session, stdin /dev/null, output to files), runs `criu dump`
and `criu restore` through scripts/criu with the gpusnap plugin, keeps track of
the PIDs that a restore needs free, parses the C workload's tick log and checks
that the computation went on bit-exact, and collects logs for $OUT.

PID trap (see shared/reference/h200-measurements.md): `criu restore` fails with
"Can't fork for PID: File exists" while any task, zombies included, has a
dumped PID as its pid, pgid or sid. The harness makes itself a child
subreaper, so that killed workload trees and restored (detached) processes are
re-parented to it and reaped here instead of by a lazy init, and it waits
until no task uses the dumped PIDs before restoring.
"""

import ctypes
import datetime
import gzip
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRIU = os.path.join(REPO, "scripts", "criu")
DEVCARRY = os.path.join(REPO, ".devcarry")
PLUGIN_SO = os.path.join(DEVCARRY, "libgpusnap.so")
AGENT_SO = os.path.join(DEVCARRY, "libgpusnap_agent.so")
GPUSNAP_CLI = os.path.join(DEVCARRY, "gpusnap")

# Constants of gpu/workload.cu (the checker recomputes the state sequence).
LCG_A = 6364136223846793005
STATE0 = 0x243F6A8885A308D3
MASK64 = (1 << 64) - 1

LOGS_TAR_LIMIT = 14 << 20  # $OUT files come back only up to 16 MiB each


# ----------------------------------------------------------------- output


def out_dir():
    d = os.environ.get("OUT") or os.path.join(REPO, "out")
    os.makedirs(d, exist_ok=True)
    return d


def iso_now():
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


class Log:
    """Appends timestamped lines to a file and echoes them to stdout."""

    def __init__(self, path):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.f = open(path, "a", buffering=1)
        self.t0 = time.time()

    def __call__(self, *parts):
        msg = " ".join(str(p) for p in parts)
        stamp = "%s +%7.2fs" % (time.strftime("%H:%M:%S"), time.time() - self.t0)
        for line in msg.splitlines() or [""]:
            text = "[%s] %s" % (stamp, line)
            self.f.write(text + "\n")
            print(text, flush=True)

    def block(self, title, text, max_lines=None):
        lines = text.splitlines()
        if max_lines is not None and len(lines) > max_lines:
            lines = ["... (%d lines cut)" % (len(lines) - max_lines)] + lines[-max_lines:]
        self("---- %s (%d lines)" % (title, len(lines)))
        for line in lines:
            self.f.write("    | " + line + "\n")
            print("    | " + line, flush=True)
        self("---- end %s" % title)

    def file_tail(self, title, path, n=30):
        try:
            with open(path, "r", errors="replace") as f:
                text = f.read()
        except OSError as e:
            self("(%s: cannot read %s: %s)" % (title, path, e))
            return
        self.block("%s: last %d lines of %s" % (title, n, path), text, max_lines=n)


def append_jsonl(paths, record):
    line = json.dumps(record, sort_keys=False)
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with open(p, "a") as f:
            f.write(line + "\n")


def archive_add(files, prefix, log=None):
    """Appends gzipped copies of `files` to $OUT/logs.tar under `prefix/`."""
    tar_path = os.path.join(out_dir(), "logs.tar")
    try:
        size = os.path.getsize(tar_path)
    except OSError:
        size = 0
    try:
        with tarfile.open(tar_path, "a") as tar:
            for p in files:
                if not p or not os.path.isfile(p):
                    continue
                with open(p, "rb") as f:
                    data = gzip.compress(f.read(), compresslevel=6)
                if size + len(data) > LOGS_TAR_LIMIT:
                    if log:
                        log("logs.tar would pass %d MiB; not adding %s" % (LOGS_TAR_LIMIT >> 20, p))
                    continue
                info = tarfile.TarInfo("%s/%s.gz" % (prefix, os.path.basename(p)))
                info.size = len(data)
                info.mtime = int(time.time())
                tar.addfile(info, io.BytesIO(data))
                size += len(data) + 1024
    except Exception as e:  # never let log collection fail a case
        if log:
            log("archive_add failed: %r" % (e,))


# ---------------------------------------------------------------- machine


def meminfo_gib():
    vals = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                vals[k] = int(v.split()[0]) / (1 << 20)
    except OSError:
        pass
    return vals


def machine_info():
    info = {"gpu": "unknown", "driver": "unknown"}
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30)
        first = r.stdout.strip().splitlines()[0]
        name, driver, mem = [x.strip() for x in first.split(",")]
        info.update(gpu=name, driver=driver, gpu_mem=mem)
    except Exception as e:
        info["nvidia_smi_error"] = repr(e)
    info["cpus"] = os.cpu_count()
    m = meminfo_gib()
    info["ram_gib"] = round(m.get("MemTotal", 0), 1)
    info["kernel"] = os.uname().release
    # the image storage's options (size, huge=) change the data rate
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[1] == "/dev/shm":
                    info["shm_options"] = fields[3]
    except OSError:
        pass
    try:
        r = subprocess.run([CRIU, "--version"], capture_output=True, text=True, timeout=30)
        info["criu"] = r.stdout.split("\n")[0].replace("Version:", "").strip() or None
    except Exception as e:
        info["criu_error"] = repr(e)
    return info


def gpu_uuids():
    """{CUDA ordinal (nvidia-smi index): UUID}; nvidia-smi orders GPUs by PCI bus like CUDA does
    when CUDA_DEVICE_ORDER=PCI_BUS_ID; the harness sets that for its workloads."""
    r = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    out = {}
    for line in r.stdout.strip().splitlines():
        idx, uuid = [x.strip() for x in line.split(",")]
        out[int(idx)] = uuid
    return out


def gpus_of_pids(pids):
    """UUIDs of the GPUs on which any of pids holds memory (nvidia-smi compute apps)."""
    want = {int(p) for p in pids if p}
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = set()
    for line in r.stdout.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in want:
            found.add(parts[1])
    return sorted(found)


def gpu_used_gib():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return round(float(r.stdout.strip().splitlines()[0]) / 1024, 2)
    except Exception:
        return None


def remount_shm(size="120G", log=None):
    if os.geteuid() != 0:
        return
    r = subprocess.run(["mount", "-o", "remount,size=" + size, "/dev/shm"],
                       capture_output=True, text=True)
    if log:
        log("remount /dev/shm size=%s: rc %d %s" % (size, r.returncode, r.stderr.strip()))


# ------------------------------------------------------------ processes


def set_subreaper():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def proc_stat(pid):
    """(state, ppid, pgrp, session) of a task, or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rfind(")") + 2:].split()
    return rest[0], int(rest[1]), int(rest[2]), int(rest[3])


def all_stats():
    res = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st:
                res[int(name)] = st
    return res


def tree_pids(root):
    """root and all its descendants (by ppid), as of now."""
    stats = all_stats()
    kids = {}
    for pid, st in stats.items():
        kids.setdefault(st[1], []).append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def tree_tids(root):
    """Every thread id of root's process tree (a restore needs all of them free)."""
    tids = []
    for pid in tree_pids(root):
        try:
            tids.extend(int(t) for t in os.listdir("/proc/%d/task" % pid))
        except OSError:
            tids.append(pid)
    return sorted(set(tids))


def reap_our_zombies(skip=()):
    """Reaps zombie children of this process (orphans handed to us as subreaper)."""
    me = os.getpid()
    for pid, st in all_stats().items():
        if st[1] == me and st[0] == "Z" and pid not in skip:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def pid_users(pids):
    """Tasks that still use any of `pids` as pid, tid, pgid or sid."""
    want = set(pids)
    users = []
    for pid, st in all_stats().items():
        if pid in want or st[2] in want or st[3] in want:
            users.append((pid, st))
    for p in want:  # thread ids are not listed in /proc but exist there
        if os.path.exists("/proc/%d" % p) and all(u[0] != p for u in users):
            users.append((p, ("thread?", 0, 0, 0)))
    return users


def wait_pids_free(pids, timeout, log, skip=()):
    t0 = time.time()
    last = None
    while True:
        reap_our_zombies(skip)
        users = pid_users(pids)
        if not users:
            log("pids free after %.2f s: %s" % (time.time() - t0, short_list(pids)))
            return True
        if time.time() - t0 > timeout:
            log("TIMEOUT: pids still in use after %.1f s: %r" % (timeout, users[:10]))
            return False
        if users != last and time.time() - t0 > 2:
            log("waiting for pids to be free: %r" % (users[:10],))
            last = users
        time.sleep(0.05)


def short_list(xs, n=8):
    xs = list(xs)
    return "%s%s" % (xs[:n], " ... (%d)" % len(xs) if len(xs) > n else "")


def kill_and_wait(pids, log, wait_pids=None, timeout=60, popen=None):
    """SIGKILLs the given processes and their descendants, then waits until `wait_pids`
    (default: `pids`) are used by no task, reaping what is handed to us."""
    allp = []
    for p in pids:
        if p and proc_stat(p):
            allp.extend(tree_pids(p))
    for p in allp:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if popen is not None:
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log("popen %d did not exit in %d s" % (popen.pid, timeout))
    skip = {popen.pid} if popen is not None and popen.returncode is None else set()
    want = sorted(set(p for p in (wait_pids or pids) if p))
    return wait_pids_free(want, timeout, log, skip=skip)


def start_process(cmd, out_path, env, log, cwd=None):
    """Starts cmd in a new session, stdin /dev/null, stdout+stderr appended to out_path."""
    out = open(out_path, "ab")
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             env=env, cwd=cwd or REPO, start_new_session=True, close_fds=True)
    finally:
        out.close()
    log("started pid %d: %s" % (p.pid, " ".join(cmd)))
    if env.get("LD_PRELOAD"):
        log("  LD_PRELOAD=%s" % env["LD_PRELOAD"])
    return p


def workload_env(path, extra=None):
    """Environment of a workload: split = with the agent preloaded, transparent = without."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["PYTHONUNBUFFERED"] = "1"
    if path == "split":
        env["LD_PRELOAD"] = AGENT_SO
        # the agent's own log (stderr, lines "gpusnap-agent: ...") goes to the workload's .out file
        env.setdefault("GPUSNAP_AGENT_DEBUG", "1")
    if extra:
        env.update(extra)
    return env


def wait_until(pred, timeout, poll=0.05, proc=None):
    """Polls pred() until true; returns False on timeout or if proc (Popen) exited."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(pred())
        time.sleep(poll)
    return bool(pred())


def alive(pid):
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


# ------------------------------------------------------------------- criu


def install_plugin(plugdir, log):
    os.makedirs(plugdir, exist_ok=True)
    for f in os.listdir(plugdir):
        if f.endswith(".so"):
            os.unlink(os.path.join(plugdir, f))
    if os.path.isfile(PLUGIN_SO):
        shutil.copy2(PLUGIN_SO, os.path.join(plugdir, "gpusnap.so"))
        log("installed %s as %s/gpusnap.so" % (PLUGIN_SO, plugdir))
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


def log_agent_lines(log, path, n=40):
    lines = gpusnap_lines(path, "gpusnap-agent:")
    if lines:
        log.block("gpusnap-agent: lines of %s" % os.path.basename(path), "\n".join(lines), max_lines=n)


def criu_dump(pid, imgdir, plugdir, mode, log, leave_running=False, timeout=600, extra=()):
    os.makedirs(imgdir, exist_ok=True)
    cmd = [CRIU, "dump", "-t", str(pid), "-D", imgdir, "-L", plugdir, "-v4", "-o", "dump.log"]
    if leave_running:
        cmd.append("-R")
    cmd += list(extra) + os.environ.get("CRIU_DUMP_EXTRA", "").split()
    return _run_criu(cmd, imgdir, "dump", mode, log, timeout)


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


def gpusnap_cli(args, log, timeout=300):
    if not os.path.isfile(GPUSNAP_CLI):
        log("gpusnap CLI %s missing; skipped %s" % (GPUSNAP_CLI, " ".join(args)))
        return None, ""
    cmd = [GPUSNAP_CLI] + list(args)
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


# -------------------------------------------------- C workload tick logs


def parse_workload_log(path):
    """Returns (ready: dict or None, ticks: [dict], errors: [str]) of gpu/workload.cu's log."""
    ready, ticks, errors = None, [], []
    try:
        with open(path, "r", errors="replace") as f:
            data = f.read()
    except OSError:
        return None, [], []
    lines = data.split("\n")
    if lines and lines[-1] != "":
        lines = lines[:-1]  # a line still being written
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "ready":
            ready = dict(zip(parts[1::2], parts[2::2]))
        elif parts[0] == "tick" and len(parts) >= 2:
            try:
                d = {"tick": int(parts[1])}
                kv = dict(zip(parts[2::2], parts[3::2]))
                for k in ("counter", "ok", "err", "us", "dt_us"):
                    d[k] = int(kv[k])
                d["state"] = int(kv["state"], 16)
                d["sum"] = int(kv["sum"], 16)
                ticks.append(d)
            except (KeyError, ValueError):
                errors.append("unparsable: " + line)
        elif parts[0] in ("error", "fatal:", "fatal"):
            errors.append(line)
    return ready, ticks, errors


def check_ticks(ready, ticks, errors, need_after=0, after_index=0, window=None):
    """The computation went on bit-exact: every tick ok, counter +1 per tick from 1,
    state = state * LCG_A + counter (recomputed here), sum == reference.

    need_after: ticks needed at index >= after_index. window: (t0, t1) in seconds
    (wall clock) of a dump; the largest gap between consecutive ticks that ends
    after t0 is reported as the pause."""
    problems = []
    if ready is None:
        problems.append("no ready line")
        ref = None
    else:
        ref = int(ready.get("ref", "0"), 16)
    state = STATE0
    for i, t in enumerate(ticks):
        where = "line %d (tick %d)" % (i, t["tick"])
        if t["tick"] != i:
            problems.append("%s: host tick %d, expected %d" % (where, t["tick"], i))
        if t["counter"] != i + 1:
            problems.append("%s: device counter %d, expected %d" % (where, t["counter"], i + 1))
        state = (state * LCG_A + (i + 1)) & MASK64
        if t["state"] != state:
            problems.append("%s: state %016x, expected %016x" % (where, t["state"], state))
            state = t["state"]  # resynchronise so one fault is reported once
        if ref is not None and t["sum"] != ref:
            problems.append("%s: sum %016x != reference %016x" % (where, t["sum"], ref))
        if t["ok"] != 1 or t["err"] != 0:
            problems.append("%s: ok %d err %d" % (where, t["ok"], t["err"]))
        if len(problems) > 20:
            problems.append("... (stopped after 20 problems)")
            break
    if errors:
        problems.append("%d error lines, first: %s" % (len(errors), errors[0]))
    after = max(0, len(ticks) - after_index)
    if after < need_after:
        problems.append("only %d ticks after index %d, need %d" % (after, after_index, need_after))
    gaps = [(ticks[i + 1]["us"] - ticks[i]["us"]) / 1e6 for i in range(len(ticks) - 1)]
    res = {"pass": not problems, "problems": problems, "n_ticks": len(ticks),
           "ticks_after": after, "median_gap_s": round(statistics.median(gaps), 4) if gaps else None,
           "max_gap_s": round(max(gaps), 4) if gaps else None}
    if window and gaps:
        t0 = window[0]
        cand = [(g, i) for i, g in enumerate(gaps) if ticks[i + 1]["us"] / 1e6 >= t0]
        if cand:
            g, i = max(cand)
            res["gap_s"] = round(g, 4)
            res["gap_ticks"] = [ticks[i]["tick"], ticks[i + 1]["tick"]]
            res["pause_s"] = round(max(0.0, g - (res["median_gap_s"] or 0)), 4)
    return res


def result_files(out, name, harness_test):
    """Where a script's JSON lines go: $OUT/NAME.jsonl, and bench/results/NAME.jsonl unless the
    run is a harness test without a GPU (--mock, --device cpu), which is not a result."""
    files = [os.path.join(out, name + ".jsonl")]
    if not harness_test:
        files.append(os.path.join(REPO, "bench", "results", name + ".jsonl"))
    return files


def start_run(log_name, headline, plugdir):
    """The common start of a GPU script: $OUT, its log ($OUT/LOG_NAME.log) with HEADLINE and
    this machine, this process made a child subreaper (restored processes are reparented to
    it), the plugin installed in PLUGDIR. Returns (out, log, machine_info)."""
    out = out_dir()
    log = Log(os.path.join(out, log_name + ".log"))
    log(headline)
    mi = machine_info()
    log("machine: %s" % mi)
    log("subreaper: %s" % set_subreaper())
    install_plugin(plugdir, log)
    return out, log, mi


def fresh_workload_files(work, name):
    """(work/NAME.log, work/NAME.out) for a workload's log and its stdout/stderr, left over
    copies from an earlier run removed; `work` is created."""
    os.makedirs(work, exist_ok=True)
    files = (os.path.join(work, name + ".log"), os.path.join(work, name + ".out"))
    for f in files:
        if os.path.exists(f):
            os.unlink(f)
    return files


def note_failure(rec, log, exc, expected=()):
    """Records a case's failure in rec["problems"]: an `expected` exception by its message, any
    other with its traceback in the log."""
    if isinstance(exc, expected):
        rec["problems"].append(str(exc))
        log("CASE ERROR: %s" % exc)
    else:
        tb = format_exc()
        rec["problems"].append("exception: " + tb.strip().splitlines()[-1])
        log.block("exception", tb)


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


def format_exc():
    return traceback.format_exc()
