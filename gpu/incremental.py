"""Incremental split-path checkpoints on the GPU: gpu/workload.cu (which rewrites only its control
words, in its first allocation, between dumps) dumped three times, each dump against the one
before, then restored from the last.

CRIU's own way, `criu dump --prev-images-dir ../N --track-mem`, needs soft-dirty page tracking,
which the GPU machine's kernel lacks. So, as the CI test criu-tests/tests/incremental.rs
does, this script makes the `parent` link itself: to a directory holding only the previous
dump's gpusnap files (hard links) and, for a chain, its own `parent` link. CRIU finds no images
of its own there and dumps its part in full; gpusnap follows the link.

Steps: start the workload with the agent; dump 1 with -R (full); 3 ticks; dump 2 with -R against
dump 1; 3 ticks; dump 3 (the workload is killed) against dump 2; `gpusnap verify` dump 3 (follows
the chain); restore from dump 3; 5 ticks; checker. Records per dump: dump_s, bytes written and
referenced (gpusnap-stats.json), image size; and restore_s, identical.
Writes $OUT/incremental.log and $OUT/NAME.jsonl (and bench/results/NAME.jsonl unless --mock;
NAME defaults to incremental-h200).
"""

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crlib  # noqa: E402
from crlib import criu, output, procs, ticklog  # noqa: E402


def gpu_part(src, dst, parent):
    """dst: hard links of src's gpusnap-* files, and a `parent` link to `parent` if given."""
    os.makedirs(dst)
    for n in os.listdir(src):
        if n.startswith("gpusnap-") and not n.endswith(".tmp"):
            os.link(os.path.join(src, n), os.path.join(dst, n))
    if parent:
        os.symlink(os.path.join("..", os.path.basename(parent)), os.path.join(dst, "parent"))


def data_stats(imgdir):
    st = criu.read_stats_json(imgdir) or {}
    processes = st.get("processes") or [{}]
    return processes[0].get("data") or {}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--images", default="/dev/shm/gpusnap-incr")
    ap.add_argument("--work", default="/tmp/gpusnap-work/incr")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--name", default="incremental-h200")
    ap.add_argument("--mock", action="store_true", help="gpu/mock_workload.py, no GPU (harness test)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="accepted for gpu/run-all.sh; one run of this script takes about a minute")
    a = ap.parse_args()
    a.gib = int(a.gib) if float(a.gib).is_integer() else a.gib
    out, log, mi = output.start_run("incremental", "gpusnap incremental: %s" % " ".join(sys.argv),
                                   a.plugdir)
    shutil.rmtree(a.images, ignore_errors=True)
    os.makedirs(a.images)
    wlog, wout = procs.fresh_workload_files(a.work, "incr")
    workload = os.path.join(crlib.REPO, "gpu", "mock_workload.py") if a.mock else a.workload
    prefix = [sys.executable] if a.mock else []
    rec = {"run": time.strftime("%Y%m%dT%H%M%S"), "date": output.iso_now(), "gpu": mi.get("gpu"),
           "driver": mi.get("driver"), "case": "incremental", "path": "split", "gib": a.gib,
           "dumps": [], "pass": False, "problems": []}
    popen, pid, rpid, pids = None, None, None, []
    ticks = lambda: ticklog.parse_workload_log(wlog)[1]  # noqa: E731
    try:
        popen = procs.start_process(prefix + [workload, "--gib", str(a.gib), "--log", wlog],
                                    wout, procs.workload_env("split"), log)
        pid = popen.pid
        if not procs.wait_until(lambda: len(ticks()) >= 3, 120 + 3 * a.gib, proc=popen):
            raise RuntimeError("workload not ticking (exit %s)" % popen.poll())
        parent = None
        for n in (1, 2, 3):
            d = os.path.join(a.images, "dump%d" % n)
            os.makedirs(d)
            if parent:
                os.symlink(os.path.join("..", os.path.basename(parent)), os.path.join(d, "parent"))
            pids = procs.tree_tids(pid)
            before = len(ticks())
            leave = n < 3
            dump = criu.criu_dump(pid, d, a.plugdir, "auto", log, leave_running=leave,
                                   timeout=120 + 10 * a.gib)
            if dump["rc"] != 0:
                raise RuntimeError("dump %d failed with rc %d" % (n, dump["rc"]))
            ds = data_stats(d)
            img = criu.image_stats(d)
            r = {"dump": n, "dump_s": round(dump["secs"], 3), "leave_running": leave,
                 "bytes_written": ds.get("bytes_written"), "bytes_referenced": ds.get("bytes_referenced"),
                 "device_bytes": ds.get("device_bytes"), "image_bytes": img["image_bytes"]}
            rec["dumps"].append(r)
            log("dump %d: %s" % (n, r))
            if n > 1 and not ds.get("bytes_referenced"):
                rec["problems"].append("dump %d referenced nothing in its parent" % n)
            if leave:
                if not procs.wait_until(lambda: len(ticks()) >= before + 3, 60):
                    raise RuntimeError("fewer than 3 ticks after dump %d" % n)
                g = os.path.join(a.images, "gpu%d" % n)
                gpu_part(d, g, os.path.join(a.images, "gpu%d" % (n - 1)) if n > 1 else None)
                parent = g
        popen.wait(timeout=30)
        n_dump = len(ticks())
        if not procs.wait_pids_free(pids, 60, log):
            raise RuntimeError("dumped pids still in use")
        last = os.path.join(a.images, "dump3")
        rec["verify_rc"], problems = criu.verify_image_dir(last, log)
        rec["problems"].extend(problems)
        rec["restore_s"], rpid, problems, rec["identical"] = criu.restore_and_check(
            last, a.plugdir, log, wlog, n_dump, 120 + 10 * a.gib)
        rec["problems"].extend("checker: " + p for p in problems)
    except Exception as e:
        rpid = rpid or getattr(e, "pid", None)  # a failed restore's process, to clean up
        output.note_failure(rec, log, e, expected=RuntimeError)
    finally:
        criu.log_agent_lines(log, wout)
        targets = [x for x in {rpid, pid} if x]
        if targets:
            procs.kill_and_wait(targets, log, wait_pids=targets + pids, popen=popen)
        saved = []
        for n in (1, 2, 3):
            saved += criu.save_criu_logs(os.path.join(a.images, "dump%d" % n), a.work, "incr-dump%d" % n)
        output.archive_add([wlog, wout] + saved, "incremental", log)
        shutil.rmtree(a.images, ignore_errors=True)
    rec["pass"] = not rec["problems"]
    output.append_jsonl(output.result_files(out, a.name, a.mock), rec)
    log("RESULT incremental: %s %s" % ("PASS" if rec["pass"] else "FAIL", json.dumps(rec["dumps"])))
    for p in rec["problems"]:
        log("  problem: %s" % p)
    return 0 if rec["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
