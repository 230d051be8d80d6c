#!/usr/bin/env python3
"""A PyTorch producer/consumer pair sharing CUDA tensors, checkpointed on the split path (issue 26).

``pair``: the workload. The producer makes a 256 MiB int32 CUDA tensor (element i = i % 9973,
element 0 a counter) and hands it to a ``torch.multiprocessing`` spawn child (legacy CUDA IPC,
which the gpusnap agent serves). Every 100 ms the consumer adds 1 to element 0 and checks a
checksum of the rest; the producer reads element 0 and checks the rest too. Each logs
``tick N counter C ok 0|1`` (``producer.log`` / ``consumer.log`` in ``--dir``).

``run``: under the agent (``LD_PRELOAD``), for each case: start the pair, let it tick, then
``criu dump`` of the producer's tree (``--link-remap``: multiprocessing's semaphores are
deleted files) followed by ``criu restore``, or ``criu dump -R``. After it, both sides must tick
on with ``ok 1`` and the producer must see the consumer's counter grow past its value at the dump
(the memory is still shared, not copied). One JSON record per case in ``OUT/ipc-ckpt.jsonl``:
``{"case": "ipc-torch-ckpt", "path": "split", "kind": "dump-restore"|"leave-running",
"checkpointed": true, "identical", "dump_s", "restore_s", "counter_at_dump", "counter_after",
"gpusnap_lines"}``.

Usage: python3 gpu/ipc_ckpt.py run --agent SO --out DIR [--cases dump-restore,leave-running]
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

N = 256 * (1 << 20) // 4


def expected_rest_sum():
    # sum over i in 1..N of i % 9973, exactly (int64 on the GPU matches Python's int).
    q, r = divmod(N, 9973)
    full = q * (9973 * 9972 // 2)
    part = (r - 1) * r // 2
    return full + part  # element 0 (i = 0) contributes 0


def tick_log(path, tick, counter, ok):
    with open(path, "a") as f:
        f.write("tick %d counter %d ok %d\n" % (tick, counter, 1 if ok else 0))


def consumer(q, dirname):
    import torch
    t = q.get(timeout=120)
    want = expected_rest_sum()
    path = os.path.join(dirname, "consumer.log")
    with open(path, "a") as f:
        f.write("pid %d\n" % os.getpid())
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
    q.put(t)
    want = expected_rest_sum()
    path = os.path.join(dirname, "producer.log")
    with open(path, "a") as f:
        f.write("pid %d consumer %d\n" % (os.getpid(), p.pid))
    tick = 0
    while True:
        rest = int(t[1:].sum(dtype=torch.int64).item())
        tick_log(path, tick, int(t[0].item()), rest == want)
        tick += 1
        time.sleep(0.1)


def read_ticks(path):
    out = []
    try:
        for line in open(path):
            w = line.split()
            if len(w) == 6 and w[0] == "tick":
                out.append((int(w[3]), w[5] == "1"))
    except OSError:
        pass
    return out


def wait_ticks(dirname, n, timeout):
    base = [len(read_ticks(os.path.join(dirname, s + ".log"))) for s in ("producer", "consumer")]
    t0 = time.time()
    while time.time() - t0 < timeout:
        now = [len(read_ticks(os.path.join(dirname, s + ".log"))) for s in ("producer", "consumer")]
        if all(a >= b + n for a, b in zip(now, base)):
            return True
        time.sleep(0.05)
    return False


def pids_of(dirname):
    try:
        w = open(os.path.join(dirname, "producer.log")).readline().split()
        return int(w[1]), int(w[3])
    except (OSError, IndexError, ValueError):
        return None, None


def run_case(kind, a, log):
    import glob
    from crlib import criu, procs
    rec = {"case": "ipc-torch-ckpt", "path": "split", "kind": kind, "checkpointed": False,
           "identical": False, "problems": []}
    dirname = os.path.join(a.work, kind)
    images = os.path.join(a.images, kind)
    shutil.rmtree(dirname, ignore_errors=True)
    shutil.rmtree(images, ignore_errors=True)
    # What --link-remap left in /dev/shm from an earlier case (a dump fails on a name taken).
    for f in glob.glob("/dev/shm/link_remap.*"):
        os.unlink(f)
    os.makedirs(dirname)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSNAP_AGENT")}
    env["LD_PRELOAD"] = a.agent
    env["GPUSNAP_AGENT_DEBUG"] = "1"
    out = open(os.path.join(dirname, "pair.out"), "w")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "pair", "--dir", dirname],
                            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    restored_pid = None
    try:
        if not wait_ticks(dirname, 5, 120):
            rec["problems"].append("the pair did not start ticking")
            return rec
        producer, consumer_pid = pids_of(dirname)
        tree = procs.tree_pids(producer)
        tids = procs.tree_tids(producer)
        rec["tree"] = len(tree)
        at_dump = read_ticks(os.path.join(dirname, "consumer.log"))[-1][0]
        extra = ["--link-remap"]
        d = criu.criu_dump(producer, images, a.plugdir, "auto", log,
                           leave_running=(kind == "leave-running"), extra=extra)
        rec["dump_s"] = round(d["secs"], 3)
        rec["gpusnap_lines"] = d["gpusnap_lines"][-30:]
        if d["rc"] != 0:
            rec["problems"].append("criu dump rc %d" % d["rc"])
            # Whatever failed, the pair must run on (fail closed): checked below all the same.
            if kind != "leave-running":
                return rec
        else:
            rec["checkpointed"] = True
        if kind == "dump-restore":
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                rec["problems"].append("the producer still runs 30 s after the dump")
                return rec
            # Every pid and tid of the tree must be free before CRIU restores them.
            if not procs.wait_pids_free(sorted(set(tree + tids)), 30, log):
                rec["problems"].append("pids of the dumped tree still in use")
                return rec
            r = criu.criu_restore(images, a.plugdir, "auto", log, extra=extra)
            rec["restore_s"] = round(r["secs"], 3)
            rec["gpusnap_lines"] += r["gpusnap_lines"][-30:]
            restored_pid = r.get("pid")
            if r["rc"] != 0:
                rec["problems"].append("criu restore rc %d" % r["rc"])
                return rec
        if not wait_ticks(dirname, 10, 60):
            rec["problems"].append("the pair did not tick on after the checkpoint")
        prod = read_ticks(os.path.join(dirname, "producer.log"))
        cons = read_ticks(os.path.join(dirname, "consumer.log"))
        rec["counter_at_dump"] = at_dump
        rec["counter_after"] = prod[-1][0] if prod else None
        if not all(ok for _, ok in prod + cons):
            rec["problems"].append("a tick saw a damaged tensor")
        if not prod or prod[-1][0] <= at_dump + 5:
            rec["problems"].append("the producer does not see the consumer's counter grow: not shared")
        rec["identical"] = not rec["problems"]
        return rec
    finally:
        for pid in [x for x in (*pids_of(dirname), restored_pid) if x]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        criu.save_criu_logs(images, dirname, kind)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pair")
    p.add_argument("--dir", required=True)
    r = sub.add_parser("run")
    r.add_argument("--agent", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--cases", default="dump-restore,leave-running")
    r.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    r.add_argument("--images", default="/dev/shm/gpusnap-ipc-ckpt")
    r.add_argument("--work", default="/tmp/gpusnap-work/ipc-ckpt")
    a = ap.parse_args()
    if a.cmd == "pair":
        return pair(a.dir)
    from crlib import output
    out, log, mi = output.start_run("ipc-ckpt", "gpusnap ipc-ckpt: %s" % " ".join(sys.argv), a.plugdir)
    bad = False
    for kind in a.cases.split(","):
        rec = run_case(kind, a, log)
        rec.update(date=output.iso_now(), machine=mi)
        log("%s: %s %s" % (kind, "PASS" if rec["identical"] else "FAIL", rec["problems"]))
        output.append_jsonl([os.path.join(out, "ipc-ckpt.jsonl")], rec)
        bad |= not rec["identical"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
