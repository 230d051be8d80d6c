#!/usr/bin/env python3
"""CUDA tensors handed to a torch.multiprocessing child, with and without the gpusnap agent.

Two roles:

- ``gpu/ipc_torch.py run``: the workload. The parent makes CUDA tensors (int32, exact): ``big``
  (256 MiB), ``small`` (4 KiB) and ``view`` (a slice starting 12345 elements into a 64 MiB
  tensor: an interior pointer, shared with its storage offset), pickles them for a Queue (where
  ``storage._share_cuda_()`` runs, and where the agent bug raised "CUDA error: invalid
  argument"), and hands them to a ``spawn`` child. The child reads each (sum), modifies it in
  place (``x * 3 + 7``), synchronizes and answers; the parent checks that it sees the child's
  writes, exactly. Every outcome is one line on stdout (no addresses, no timings), so two runs
  print the same text exactly when they behaved the same.
- ``gpu/ipc_torch.py compare --agent SO --out DIR``: runs ``run`` without the agent, with it
  (``LD_PRELOAD``), and with it and ``GPUSNAP_AGENT_MIN_BYTES=0`` (every allocation converted),
  and appends one JSON record per configuration to ``DIR/ipc.jsonl``:
  ``{"case": "ipc-torch", "path": "no-agent" | "agent" | "agent-min0", "identical": <stdout
  equals the no-agent run's>, "checkpointed": false, "rc", "seconds", "agent_served": <agent
  "ipc: handed" log lines>, "first_difference"}``. Exit status 1 if any run differs or fails.
"""

import argparse
import json
import os
import sys
import time

from procgroup import run_group

MIB = 1 << 20
# (name, elements of the tensor made, slice start): the view shares a tensor from an offset.
TENSORS = [
    ("big", 256 * MIB // 4, 0),
    ("small", 4096 // 4, 0),
    ("view", 64 * MIB // 4, 12345),
]




def child(inq, outq, done):
    import torch

    try:
        items = inq.get(timeout=120)
        lines = []
        for name, t in items:
            lines.append(f"{name} child-sees-sum {int(t.sum(dtype=torch.int64).item())}")
            t.mul_(3).add_(7)
        torch.cuda.synchronize()
        outq.put(("ok", lines))
    except Exception as e:  # reported, compared like any other outcome
        outq.put(("error", [f"child error {type(e).__name__}: {e}"]))
    # Keep the imports open until the parent has checked them.
    done.wait(120)


def run():
    import torch
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    ctx = mp.get_context("spawn")
    print(f"cuda {torch.cuda.is_available()}", flush=True)
    made = []
    for name, n, start in TENSORS:
        base = (torch.arange(n, dtype=torch.int32, device="cuda") % 9973).contiguous()
        made.append((name, base[start:] if start else base))
    torch.cuda.synchronize()
    expected = [(name, t.clone()) for name, t in made]
    for name, t in expected:
        print(f"{name} parent-sum {int(t.sum(dtype=torch.int64).item())}", flush=True)
    # Pickling here (not in the Queue's feeder thread) surfaces a sharing error in this thread.
    try:
        ForkingPickler.dumps(made)
        print("share ok", flush=True)
    except Exception as e:
        print(f"share error {type(e).__name__}: {e}", flush=True)
        return 1
    inq, outq, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(inq, outq, done), daemon=True)
    p.start()
    inq.put(made)
    try:
        status, lines = outq.get(timeout=180)
    except Exception as e:
        status, lines = "error", [f"no answer from the child: {type(e).__name__}"]
    for line in lines:
        print(line, flush=True)
    torch.cuda.synchronize()
    for (name, t), (_, before) in zip(made, expected):
        want = before * 3 + 7
        print(f"{name} parent-sees-child-writes {bool(torch.equal(t, want))}", flush=True)
    done.set()
    p.join(60)
    print(f"child exit {p.exitcode}", flush=True)
    return 0 if status == "ok" and p.exitcode == 0 else 1


def compare(args):
    os.makedirs(args.out, exist_ok=True)
    configs = [
        ("no-agent", {}),
        ("agent", {"LD_PRELOAD": args.agent}),
        ("agent-min0", {"LD_PRELOAD": args.agent, "GPUSNAP_AGENT_MIN_BYTES": "0"}),
    ]
    deadline = time.monotonic() + args.deadline_s
    reference = None
    bad = False
    with open(os.path.join(args.out, "ipc.jsonl"), "a") as jl, open(
        os.path.join(args.out, "ipc.log"), "a"
    ) as log:
        for path, extra in configs:
            env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSNAP_AGENT")}
            env.pop("LD_PRELOAD", None)
            env.update(extra)
            if "LD_PRELOAD" in extra:
                env["GPUSNAP_AGENT_DEBUG"] = "1"
            left = deadline - time.monotonic()
            rec = {"case": "ipc-torch", "path": path, "checkpointed": False}
            if left < 20:
                rec.update(identical=None, skipped="deadline")
                jl.write(json.dumps(rec) + "\n")
                bad = True
                continue
            t0 = time.monotonic()
            rc, out, err = run_group(
                [sys.executable, os.path.abspath(__file__), "run"],
                min(left, args.run_timeout_s),
                env=env,
            )
            seconds = round(time.monotonic() - t0, 2)
            log.write(f"==> {path} rc={rc} {seconds}s\n{out}\n--- stderr (last 60 lines)\n")
            log.write("\n".join(err.splitlines()[-60:]) + "\n")
            if reference is None:
                reference = out
            identical = out == reference and rc == 0
            diff = next(
                (
                    f"{a!r} vs {b!r}"
                    for a, b in zip(reference.splitlines() + [""] * 99, out.splitlines() + [""] * 99)
                    if a != b
                ),
                None,
            )
            rec.update(
                identical=identical,
                rc=rc,
                seconds=seconds,
                agent_served=err.count("ipc: handed #"),
                first_difference=diff,
                lines=len(out.splitlines()),
            )
            jl.write(json.dumps(rec) + "\n")
            jl.flush()
            print(json.dumps(rec), flush=True)
            bad |= not identical
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run")
    c = sub.add_parser("compare")
    c.add_argument("--agent", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--deadline-s", type=float, default=150)
    c.add_argument("--run-timeout-s", type=float, default=60)
    a = ap.parse_args()
    if a.cmd == "run":
        return run()
    return compare(a)


if __name__ == "__main__":
    sys.exit(main())
