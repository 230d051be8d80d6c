"""Processes: workloads started in their own session, process trees, waiting until PIDs are
free, killing and reaping (the harness is a child subreaper, see the package's docstring)."""

import ctypes
import os
import signal
import subprocess
import time

from crlib import AGENT_SO, REPO


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
    if path.startswith("split"):
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


def fresh_workload_files(work, name):
    """(work/NAME.log, work/NAME.out) for a workload's log and its stdout/stderr, left over
    copies from an earlier run removed; `work` is created."""
    os.makedirs(work, exist_ok=True)
    files = (os.path.join(work, name + ".log"), os.path.join(work, name + ".out"))
    for f in files:
        if os.path.exists(f):
            os.unlink(f)
    return files
