#!/usr/bin/env python3
"""What tells a CUDA IPC importer apart before a driver checkpoint (issue 26, item 3).

Three processes without the agent: an exporter (a 256 MiB CUDA tensor shared through
torch.multiprocessing), the importer it spawned (holds the tensor open), and a plain CUDA process.
For each: the /dev/nvidia* mappings and descriptors in /proc, counted by device. Then the driver's
checkpoint API on the importer (lock, checkpoint, restore, unlock through libcuda's
cuCheckpointProcess* with ctypes), each step's status recorded; the importer then checks its data.
One JSON record per process and one for the checkpoint attempt go to --out (JSONL).

Usage: python3 gpu/ipc_probe.py --out FILE
"""
import argparse
import collections
import ctypes
import json
import os
import sys
import time


def nvidia_view(pid):
    """Counts of /dev/nvidia* (and other device) mappings and fds of `pid`."""
    maps = collections.Counter()
    try:
        for line in open("/proc/%d/maps" % pid):
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/"):
                maps[parts[5]] += 1
    except OSError as e:
        maps["error: %s" % e] += 1
    fds = collections.Counter()
    try:
        for fd in os.listdir("/proc/%d/fd" % pid):
            try:
                t = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if t.startswith("/dev/") or t.startswith("anon_inode:"):
                fds[t] += 1
    except OSError as e:
        fds["error: %s" % e] += 1
    return {"maps": dict(maps), "fds": dict(fds)}


def child(q, done):
    import torch
    t = q.get()
    q.put(("opened", os.getpid(), float(t[:1024].sum().item())))
    done.wait(120)
    q.put(("after", os.getpid(), float(t[:1024].sum().item()), bool((t == 3).all().item())))
    done.wait(1)


def plain(ready, done):
    import torch
    x = torch.full((64 << 20,), 5, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    ready.set()
    done.wait(120)
    del x


def checkpoint_steps(pid):
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    out = {}
    for name in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                 "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"):
        f = getattr(cuda, name, None)
        if f is None:
            out[name] = "absent"
            continue
        t0 = time.time()
        # Each takes (pid, args*): NULL args are the defaults.
        rc = f(ctypes.c_int(pid), ctypes.c_void_p(0))
        out[name] = {"rc": rc, "s": round(time.time() - t0, 3)}
        if rc != 0:
            break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    ready, done2 = ctx.Event(), ctx.Event()
    t = torch.full((64 << 20,), 3, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    importer = ctx.Process(target=child, args=(q, done))
    importer.start()
    other = ctx.Process(target=plain, args=(ready, done2))
    other.start()
    q.put(t)
    opened = q.get(timeout=120)
    ready.wait(120)
    time.sleep(1)
    recs = []
    for role, pid in (("exporter", os.getpid()), ("importer", importer.pid),
                      ("plain", other.pid)):
        recs.append(dict(case="ipc-probe-view", role=role, pid=pid, **nvidia_view(pid)))
    steps = checkpoint_steps(importer.pid)
    done.set()
    try:
        after = q.get(timeout=20)
    except Exception as e:  # a restore that failed leaves the importer checkpointed, stuck
        after = "no answer in 20 s: %r" % (e,)
        importer.kill()
    recs.append({"case": "ipc-probe-checkpoint", "role": "importer", "steps": steps,
                 "opened": opened, "after": after})
    done2.set()
    importer.join(30)
    other.join(30)
    for p in (importer, other):
        if p.is_alive():
            p.kill()
    with open(a.out, "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
