"""A command run in a process group of its own, killed whole at its timeout (shared by
gpu/conformance.py and gpu/ipc_torch.py)."""

import os
import signal
import subprocess


def run_group(cmd, timeout, **kw):
    """Runs cmd in a session of its own; at the timeout the whole group is killed (pytest-xdist
    workers, spawned children). Returns (rc or "timeout", stdout, stderr)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return "timeout", out or "", err or ""
