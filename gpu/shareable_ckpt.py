#!/usr/bin/env python3
"""A parent and child sharing device memory through a POSIX-fd shareable handle
(gpu/shareable_pair.cu), checkpointed on the split path.

The pair: the parent ``cuMemCreate``s 256 MiB (``--mib``) exportable as a POSIX fd, fills it,
exports it, fork+execs the child and hands it the fd, over a unix socket (``--modes scm``:
SCM_RIGHTS; the child closes its fd after the import, the parent closes its own once the child
acked) or by ``pidfd_getfd`` (``pidfd``: the parent keeps its fd open). The child imports and
maps it; every 100 ms it adds 1 to word 0, both check the checksum of the rest and log ``tick N
counter C ok 0|1`` (``producer.log``, ``consumer.log``: the same files and lines as
gpu/ipc_ckpt.py's PyTorch pair, whose harness this reuses).

Cases, for each mode (``--cases``):
- ``no-agent``: the pair without the agent, no checkpoint: it must tick and share (the program
  itself is right);
- ``agent``: the same under the agent (``LD_PRELOAD``), no checkpoint;
- ``dump-restore``: under the agent, ``criu dump`` of the parent's tree (``--link-remap``, as
  ipc_ckpt.py), reap, ``criu restore``: both must tick on, ``ok 1``, both counters growing
  (``sharing_after``);
- ``leave-running``: ``criu dump -R``, the same checks.
A dump **refused** by gpusnap (criu rc != 0 and a ``gpusnap:`` line saying the process cannot be
checkpointed for memory shared through CUDA IPC or a shareable handle) is recorded
``checkpointed: false, refused: true`` and passes if the pair then runs on correctly (untraced,
every tick ok, still sharing): gpusnap carries such shares only once the Rust side for them is
done. A dump that fails without such a line fails the case.

Records (one per mode and case) in ``OUT/shareable-ckpt.jsonl`` (``--name``): ``{"case":
"ipc-shareable-<mode>-ckpt", "mode", "path": "none"|"split", "kind", "checkpointed", "refused",
"refusal", "identical", "sharing_after", "pass", "detail", "dump_s", "restore_s",
"counter_at_dump", "counter_after", "producer_notes", "consumer_notes", "gpusnap_lines",
"secs"}``. Logs (pair logs, output with the agent's lines, criu logs) in ``OUT/logs.tar`` under
``shareable-ckpt/<mode>-<case>/``.

The binary: ``--bin`` (default /tmp/gpusnap-bin/shareable_pair; gpu/build.sh builds it with
nvcc, and is run when it is missing). ``--mock``: the host build (``g++ -DSHAREABLE_HOST_MOCK``:
a memfd instead of device memory, the same fd passing), no agent, criu without the plugin: a
harness test on a machine without a GPU.

Usage: python3 gpu/shareable_ckpt.py --out DIR [--agent SO] [--modes scm,pidfd]
           [--cases no-agent,agent,dump-restore,leave-running] [--mib 256] [--deadline-s 90]
           [--mock]
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ipc_ckpt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ["no-agent", "agent", "dump-restore", "leave-running"]
# what ipc_ckpt.checkpoint_case does for each
KIND = {"no-agent": "share-check-no-agent", "agent": "share-check",
        "dump-restore": "dump-restore", "leave-running": "leave-running"}
# seconds on the H200: start (two CUDA contexts, 256 MiB filled) ~2 s, 10 ticks ~1.5 s, a
# dump / restore of ~0.3 GiB ~2-3 s each
EST_S = {"no-agent": 5.0, "agent": 5.0, "dump-restore": 12.0, "leave-running": 10.0}


def ensure_binary(a, log):
    if a.mock:
        return ipc_ckpt.build_mock_pair(a.work, log)
    if not os.path.isfile(a.bin):
        r = subprocess.run([os.path.join(REPO, "gpu", "build.sh")], capture_output=True, text=True)
        log.block("gpu/build.sh (rc %d)" % r.returncode, r.stdout + r.stderr, max_lines=40)
    if not os.path.isfile(a.bin):
        raise RuntimeError("%s is missing and gpu/build.sh did not build it" % a.bin)
    return a.bin


def run_case(e, mode, case):
    from crlib import output
    a = e.a
    tag = "%s-%s" % (mode, case)
    rec = {"case": "ipc-shareable-%s-ckpt" % mode, "mode": mode,
           "path": "none" if case == "no-agent" else "split", "kind": case, "mib": a.mib,
           "checkpointed": False, "refused": False, "identical": False, "sharing_after": None,
           "problems": []}
    p = ipc_ckpt.Pair(e, tag, [], {})
    p.cmd = [e.bin, "parent", "--dir", p.dir, "--mode", mode, "--mib", str(a.mib),
             "--interval-ms", "100"]
    agent = None if (case == "no-agent" or a.mock) else a.agent
    p.env = ipc_ckpt.pair_env(agent)
    t0 = time.time()
    try:
        ipc_ckpt.checkpoint_case(e, rec, p, KIND[case], refusal_ok=True)
    except Exception as ex:
        output.note_failure(rec, e.log, ex)
    finally:
        p.finish("shareable-ckpt/%s" % tag)
    rec["secs"] = round(time.time() - t0, 1)
    rec["pass"] = not rec["problems"]
    rec["identical"] = rec["pass"] and rec["checkpointed"]
    rec["detail"] = "; ".join(rec["problems"]) or (
        "refused: %s; the pair ran on sharing" % rec.get("refusal") if rec.get("refused") else
        "checkpointed, both sides tick on sharing" if rec["checkpointed"] else
        "ticks and shares")
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "out"))
    ap.add_argument("--agent", default=os.path.join(REPO, ".devcarry", "libgpusnap_agent.so"))
    ap.add_argument("--bin", default="/tmp/gpusnap-bin/shareable_pair")
    ap.add_argument("--modes", default="scm,pidfd")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--deadline-s", type=float, default=90)
    ap.add_argument("--name", default="shareable-ckpt")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--images", default="/dev/shm/gpusnap-shareable-ckpt")
    ap.add_argument("--work", default="/tmp/gpusnap-work/shareable-ckpt")
    ap.add_argument("--keep-images", action="store_true")
    ap.add_argument("--mock", action="store_true", help="host build of the pair, no GPU (harness test)")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    cases = [c for c in a.cases.split(",") if c]
    bad = [m for m in modes if m not in ("scm", "pidfd")] + [c for c in cases if c not in CASES]
    if bad:
        ap.error("unknown mode(s)/case(s) %s (modes scm,pidfd; cases %s)" % (bad, ",".join(CASES)))
    if a.mock and a.mib == 256:
        a.mib = ipc_ckpt.MOCK_MIB
    a.watch_s = 2.0
    t_start = time.time()
    os.environ["OUT"] = a.out
    from crlib import output
    out, log, mi = output.start_run(a.name, "gpusnap shareable-ckpt: %s" % " ".join(sys.argv),
                                    a.plugdir)
    e = ipc_ckpt.Env(a, log)
    e.bin = ensure_binary(a, log)
    log("pair binary %s; agent %s (%s)" % (e.bin, a.agent, "present" if os.path.isfile(a.agent)
                                          else "MISSING"))
    plan = [(m, c, EST_S[c]) for m in modes for c in cases]
    log("plan: %d cases, estimate %.0f s; deadline %.0f s" % (
        len(plan), sum(s for _, _, s in plan), a.deadline_s))
    jsonl = os.path.join(out, a.name + ".jsonl")
    results = []
    for mode, case, est in plan:
        elapsed = time.time() - t_start
        if a.deadline_s and elapsed + est > a.deadline_s:
            log("deadline of %.0f s: skipping %s %s (estimate %.0f s, %.0f s gone)" % (
                a.deadline_s, mode, case, est, elapsed))
            rec = {"case": "ipc-shareable-%s-ckpt" % mode, "mode": mode, "kind": case,
                   "path": "none" if case == "no-agent" else "split", "pass": None,
                   "detail": "skipped: deadline"}
        else:
            log("=" * 78)
            log("CASE ipc-shareable-%s-ckpt %s, estimate %.0f s" % (mode, case, est))
            rec = run_case(e, mode, case)
            log("RESULT ipc-shareable-%s-ckpt %s: %s%s %s" % (
                mode, case, "PASS" if rec["pass"] else "FAIL",
                " (refused)" if rec.get("refused") else "", rec["detail"][:400]))
        rec.update(date=output.iso_now(), machine=mi, build=ipc_ckpt._build())
        if a.mock:
            rec["mock"] = True
        output.append_jsonl([jsonl], rec)
        results.append(rec)
    log("=" * 78)
    log("SUMMARY (%.0f s)" % (time.time() - t_start))
    for rec in results:
        res = "SKIP" if rec["pass"] is None else ("PASS" if rec["pass"] else "FAIL")
        log("%-26s %-14s %-5s checkpointed %-5s refused %-5s %s" % (
            rec["case"], rec["kind"], res, rec.get("checkpointed"), rec.get("refused"),
            rec.get("detail", "")[:200]))
    n_fail = sum(1 for x in results if x["pass"] is False)
    n_skip = sum(1 for x in results if x["pass"] is None)
    log("shareable-ckpt: %d passed, %d failed, %d skipped" % (
        len(results) - n_fail - n_skip, n_fail, n_skip))
    return 1 if n_fail or n_skip else 0


if __name__ == "__main__":
    sys.exit(main())
