#!/usr/bin/env python3
"""What the driver's checkpoint does to processes that share CUDA memory or events (issue 26).

A controller (``all``) starts an exporter (``exporter``: PyTorch, a 64 MiB int32 CUDA tensor of
3s, or an interprocess CUDA event) which hands it to a ``spawn`` child (the importer) the way
``torch.multiprocessing`` does. The controller makes no CUDA context of its own in the
processes it probes: it calls the driver's checkpoint API (``cuCheckpointProcessLock``,
``...Checkpoint``, ``...Restore``, ``...Unlock`` through ctypes) on the importer, then asks the
pair whether sharing still works (the child adds 1 to the tensor, or waits on the event the
parent records after a 50 ms kernel; the parent checks what it sees), then the same on the
exporter, and asks again. Configurations: the tensor without the agent, the tensor with the
agent (``LD_PRELOAD``: the agent serves the share, the importer maps VMM memory it imported),
the event without the agent. One JSON record per configuration goes to ``OUT/ipc-probe.jsonl``:
``{"case": "ipc-probe", "config", "share", "importer_steps", "after_importer",
"exporter_steps", "after_exporter", "views"}`` where ``*_steps`` map each API call to its return
code (the first failing call ends the sequence) and ``after_*`` is what the pair answered.

Usage: python3 gpu/ipc_probe.py all --agent SO --out DIR [--deadline-s N]
"""
import argparse
import collections
import ctypes
import json
import os
import select
import subprocess
import sys
import time

MIB = 1 << 20
STEPS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
         "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")


def nvidia_view(pid):
    """Counts of /dev/nvidia* mappings and of device and anonymous-inode descriptors of `pid`."""
    maps, fds = collections.Counter(), collections.Counter()
    try:
        for line in open("/proc/%d/maps" % pid):
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/"):
                maps[parts[5]] += 1
        for fd in os.listdir("/proc/%d/fd" % pid):
            try:
                t = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if t.startswith("/dev/") or t.startswith("anon_inode:") or t.startswith("/memfd:"):
                fds[t] += 1
    except OSError as e:
        maps["error: %s" % e] += 1
    return {"maps": dict(maps), "fds": dict(fds)}


# ---- the pair (exporter and its spawned importer) ----

def importer(case, inq, outq):
    import torch
    try:
        if case == "event":
            handle = inq.get(timeout=120)
            ev = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)
            outq.put("opened")
            while inq.get(timeout=300) == "check":
                ev.synchronize()
                outq.put("synchronized")
        else:
            t = inq.get(timeout=120)
            outq.put("opened sum %d" % int(t.sum(dtype=torch.int64).item()))
            while inq.get(timeout=300) == "check":
                before = int(t.sum(dtype=torch.int64).item())
                t.add_(1)
                torch.cuda.synchronize()
                outq.put("child saw sum %d, added 1" % before)
    except Exception as e:
        outq.put("child error %s: %s" % (type(e).__name__, e))


def exporter(case):
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=importer, args=(case, inq, outq), daemon=True)
    p.start()
    if case == "event":
        ev = torch.cuda.Event(enable_timing=False, interprocess=True)
        ev.record()
        torch.cuda.synchronize()
        inq.put(ev.ipc_handle())
    else:
        t = torch.full((64 * MIB // 4,), 3, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        inq.put(t)
    opened = outq.get(timeout=120)
    print("ready %d %d %s" % (os.getpid(), p.pid, opened), flush=True)
    expect = 3
    for line in sys.stdin:
        if line.strip() != "check":
            break
        inq.put("check")
        if case == "event":
            torch.cuda._sleep(50_000_000)
            ev.record()
            try:
                got = outq.get(timeout=30)
            except Exception as e:
                got = "no answer: %s" % type(e).__name__
            print("check %s, event done %s" % (got, ev.query()), flush=True)
        else:
            try:
                got = outq.get(timeout=30)
            except Exception as e:
                got = "no answer: %s" % type(e).__name__
            expect += 1
            torch.cuda.synchronize()
            seen = bool((t == expect).all().item())
            print("check %s; parent sees the child's write %s" % (got, seen), flush=True)
    inq.put("quit")
    p.join(10)
    if p.is_alive():
        p.kill()
    return 0


# ---- the controller ----

def checkpoint_steps(cuda, pid):
    out = {}
    for name in STEPS:
        f = getattr(cuda, name, None)
        if f is None:
            out[name] = "absent"
            break
        t0 = time.time()
        rc = f(ctypes.c_int(pid), ctypes.c_void_p(0))  # NULL args: the defaults
        out[name] = {"rc": rc, "s": round(time.time() - t0, 3)}
        if rc != 0:
            break
    return out


def ask(proc, timeout=60):
    """Sends `check` to the exporter and returns its answer line (or why there was none)."""
    try:
        proc.stdin.write("check\n")
        proc.stdin.flush()
    except OSError as e:
        return "exporter gone: %s" % e
    deadline = time.time() + timeout
    while time.time() < deadline:
        # Never block past the deadline: a pair the driver left stuck prints nothing.
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.time()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            return "exporter ended (rc %s)" % proc.poll()
        if line.startswith("check "):
            return line.strip()[len("check "):]
    return "no answer in %d s" % timeout


def probe(config, case, env, out_dir):
    rec = {"case": "ipc-probe", "config": config, "share": case}
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    # stderr to a file: the agent's debug lines would fill a pipe and stop the exporter.
    err_path = os.path.join(out_dir, "ipc-probe-%s.err" % config)
    err_file = open(err_path, "w")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "exporter", "--case", case],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file,
                            text=True, env=env, start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        line = proc.stdout.readline().split(maxsplit=3) if ready else []
        if len(line) < 3 or line[0] != "ready":
            rec["error"] = "exporter did not get ready: %r (its stderr: %s)" % (line, err_path)
            return rec
        exp_pid, imp_pid = int(line[1]), int(line[2])
        rec["opened"] = line[3].strip() if len(line) > 3 else ""
        rec["views"] = {"exporter": nvidia_view(exp_pid), "importer": nvidia_view(imp_pid)}
        rec["importer_steps"] = checkpoint_steps(cuda, imp_pid)
        rec["after_importer"] = ask(proc, 30)
        rec["exporter_steps"] = checkpoint_steps(cuda, exp_pid)
        rec["after_exporter"] = ask(proc, 30)
    finally:
        try:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(20)
        except Exception:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        err_file.close()
        with open(err_path, errors="replace") as f:
            rec["agent_served"] = f.read().count("ipc: handed #")
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("exporter")
    e.add_argument("--case", choices=["tensor", "event"], required=True)
    c = sub.add_parser("all")
    c.add_argument("--agent", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--deadline-s", type=float, default=150)
    c.add_argument("--configs", default="tensor-no-agent,tensor-agent,event-no-agent")
    a = ap.parse_args()
    if a.cmd == "exporter":
        return exporter(a.case)
    os.makedirs(a.out, exist_ok=True)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("GPUSNAP_AGENT") and k != "LD_PRELOAD"}
    configs = [
        ("tensor-no-agent", "tensor", base),
        ("tensor-agent", "tensor", dict(base, LD_PRELOAD=a.agent, GPUSNAP_AGENT_DEBUG="1")),
        ("event-no-agent", "event", base),
    ]
    deadline = time.monotonic() + a.deadline_s
    with open(os.path.join(a.out, "ipc-probe.jsonl"), "a") as jl:
        for config, case, env in configs:
            if config not in a.configs.split(","):
                continue
            if time.monotonic() > deadline - 30:
                rec = {"case": "ipc-probe", "config": config, "skipped": "deadline"}
            else:
                rec = probe(config, case, env, a.out)
            jl.write(json.dumps(rec) + "\n")
            jl.flush()
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
