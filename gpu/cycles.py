"""Consecutive checkpoint/restore cycles of one process (issue "split path", correctness): the
same gpu/workload.cu process is dumped and restored N times in a row (default 20), and must go on
bit-exact after each restore with device and host memory back at their starting level.

Called by gpu/cycles.sh (which builds the workload and installs the plugin); see --help.
Per path: start the workload, wait for ready and 3 ticks, take the baseline (GPU memory used as
nvidia-smi reports it, the workload's VmRSS, the host's MemAvailable); then N times: criu dump,
wait until its PIDs are free, criu restore --restore-detached, 3 more ticks, and the readings
again. The tick log runs on across every cycle, so the checker sees one computation: counter +1
per tick, state recomputed, checksum == reference, from the first tick to the last.
Leak bounds (after the last cycle against the baseline): GPU memory +256 MiB, VmRSS +256 MiB,
MemAvailable -1 GiB (images are deleted after each restore).
Writes $OUT/cycles.log and $OUT/NAME.jsonl (and bench/results/NAME.jsonl unless --mock; NAME
defaults to cycles-h200): one record per path with the per-cycle timings and readings.
"""

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crlib  # noqa: E402
from crlib import criu, machine, output, procs, ticklog  # noqa: E402

GPU_SLACK_MIB = 256
RSS_SLACK_MIB = 256
AVAIL_SLACK_GIB = 1.0


def vm_rss_mib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def readings(pid):
    used = machine.gpu_used_gib()
    return {"gpu_used_mib": None if used is None else round(used * 1024),
            "rss_mib": vm_rss_mib(pid),
            "mem_available_gib": round(machine.meminfo_gib().get("MemAvailable", 0), 2)}


def run_path(a, log, path, workload, prefix):
    name = "cycles-%s-%sg" % (path, a.gib)
    imgdir = os.path.join(a.images, name)
    wlog, wout = procs.fresh_workload_files(a.work, name)
    mode = {"split": "auto", "transparent": "transparent"}[path]
    rec = {"case": "cycles", "path": path, "gib": a.gib, "cycles_wanted": a.cycles, "cycles": [],
           "pass": False, "problems": []}
    log("=" * 78)
    log("CASE %s: %d cycles of dump + restore, path %s" % (name, a.cycles, path))
    popen, pid, pids = None, None, []
    t_case = time.time()
    try:
        cmd = prefix + [workload, "--gib", str(a.gib), "--log", wlog, "--interval-ms", "100"]
        popen = procs.start_process(cmd, wout, procs.workload_env(path), log)
        pid = popen.pid
        ticks = lambda: ticklog.parse_workload_log(wlog)[1]  # noqa: E731
        if not procs.wait_until(lambda: len(ticks()) >= 3, 120 + 3 * a.gib, proc=popen):
            raise RuntimeError("workload not ticking (exit code %s)" % popen.poll())
        rec["baseline"] = readings(pid)
        log("baseline: %s" % rec["baseline"])
        for i in range(a.cycles):
            if a.budget_s and time.time() - t_case > a.budget_s:
                rec["problems"].append("time budget spent after %d cycles" % i)
                break
            shutil.rmtree(imgdir, ignore_errors=True)
            pids = procs.tree_tids(pid)
            dump = criu.criu_dump(pid, imgdir, a.plugdir, mode, log, timeout=120 + 10 * a.gib)
            if dump["rc"] != 0:
                raise RuntimeError("cycle %d: criu dump failed with rc %d" % (i + 1, dump["rc"]))
            if i == 0:
                popen.wait(timeout=30)
            if not procs.wait_pids_free(pids, 60, log):
                raise RuntimeError("cycle %d: dumped pids still in use" % (i + 1))
            lent = any("lent to keeper" in l for l in dump.get("gpusnap_lines", []))
            n = len(ticks())
            restore = criu.criu_restore(imgdir, a.plugdir, mode, log, timeout=120 + 10 * a.gib)
            if restore["rc"] != 0:
                raise RuntimeError("cycle %d: criu restore failed with rc %d" % (i + 1, restore["rc"]))
            if restore["pid"] != pid:
                raise RuntimeError("cycle %d: restored pid %s, dumped %d" % (i + 1, restore["pid"], pid))
            if not procs.wait_until(lambda: len(ticks()) >= n + 3, 30):
                raise RuntimeError("cycle %d: fewer than 3 ticks after the restore" % (i + 1))
            # Which way the data went each cycle: lent to the keeper at the dump ("handoff") or
            # copied out first ("copy"), and loaded by a keeper or by the job's agent at restore.
            rprocs = ((criu.read_stats_json(imgdir) or {}).get("restore") or {}).get("processes") or []
            rpaths = sorted({p.get("data_path") for p in rprocs if p.get("data_path")})
            shutil.rmtree(imgdir, ignore_errors=True)
            r = readings(pid)
            r.update(cycle=i + 1, dump_s=round(dump["secs"], 3), restore_s=round(restore["secs"], 3))
            if path == "split":
                r.update(data_path="handoff" if lent else "copy",
                         restore_data_path=",".join(rpaths) or None)
            rec["cycles"].append(r)
            log("cycle %d: dump %.2f s, restore %.2f s, %s" % (i + 1, dump["secs"], restore["secs"], r))
        ready, all_ticks, errors = ticklog.parse_workload_log(wlog)
        chk = ticklog.check_ticks(ready, all_ticks, errors)
        rec["n_ticks"] = chk["n_ticks"]
        rec["problems"].extend("checker: " + p for p in chk["problems"])
        base, last = rec["baseline"], (rec["cycles"] or [None])[-1]
        if last:
            if base["gpu_used_mib"] is not None and last["gpu_used_mib"] is not None and \
                    last["gpu_used_mib"] - base["gpu_used_mib"] > GPU_SLACK_MIB:
                rec["problems"].append("GPU memory used grew from %d to %d MiB" % (
                    base["gpu_used_mib"], last["gpu_used_mib"]))
            if base["rss_mib"] is not None and last["rss_mib"] is not None and \
                    last["rss_mib"] - base["rss_mib"] > RSS_SLACK_MIB:
                rec["problems"].append("workload VmRSS grew from %.0f to %.0f MiB" % (
                    base["rss_mib"], last["rss_mib"]))
            if base["mem_available_gib"] - last["mem_available_gib"] > AVAIL_SLACK_GIB:
                rec["problems"].append("host MemAvailable fell from %.1f to %.1f GiB" % (
                    base["mem_available_gib"], last["mem_available_gib"]))
    except Exception as e:
        output.note_failure(rec, log, e, expected=RuntimeError)
        for p in (wlog, wout, os.path.join(imgdir, "dump.log"), os.path.join(imgdir, "restore.log")):
            log.file_tail(os.path.basename(p), p, 25)
    finally:
        if path == "split":
            criu.log_agent_lines(log, wout)
        if pid:
            procs.kill_and_wait([pid], log, wait_pids=pids or [pid], popen=popen)
        output.archive_add([wlog, wout], "cycles/" + name, log)
        shutil.rmtree(imgdir, ignore_errors=True)
    rec["cycles_done"] = len(rec["cycles"])
    if path == "split":
        rec["handover_cycles"] = sum(1 for c in rec["cycles"] if c.get("data_path") == "handoff")
    rec["identical"] = not any(p.startswith("checker") for p in rec["problems"])
    rec["pass"] = not rec["problems"] and rec["cycles_done"] == a.cycles
    rec["case_s"] = round(time.time() - t_case, 1)
    log("RESULT %s: %s, %d cycles%s" % (name, "PASS" if rec["pass"] else "FAIL", rec["cycles_done"],
                                        "" if rec["pass"] else " (%s)" % "; ".join(rec["problems"][:4])))
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--path", choices=["split", "transparent", "both"], default="split")
    ap.add_argument("--images", default="/dev/shm/gpusnap-cycles")
    ap.add_argument("--work", default="/tmp/gpusnap-work/cycles")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--name", default="cycles-h200")
    ap.add_argument("--budget-s", type=float, default=0, help="stop a path's cycles after S seconds")
    ap.add_argument("--mock", action="store_true", help="gpu/mock_workload.py, no GPU (harness test)")
    a = ap.parse_args()
    a.gib = int(a.gib) if a.gib.is_integer() else a.gib
    out, log, mi = output.start_run("cycles", "gpusnap cycles: %s" % " ".join(sys.argv), a.plugdir)
    jsonl = output.result_files(out, a.name, a.mock)
    workload = os.path.join(crlib.REPO, "gpu", "mock_workload.py") if a.mock else a.workload
    prefix = [sys.executable] if a.mock else []
    run_id = time.strftime("%Y%m%dT%H%M%S")
    failed = 0
    for path in (["split", "transparent"] if a.path == "both" else [a.path]):
        rec = run_path(a, log, path, workload, prefix)
        rec.update({"run": run_id, "date": output.iso_now(), "gpu": mi.get("gpu"), "driver": mi.get("driver")})
        output.append_jsonl(jsonl, rec)
        failed += 0 if rec["pass"] else 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
