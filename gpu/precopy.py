"""Pre-copy on the GPU: gpu/workload.cu (which rewrites only its control words, in its first
allocation, every tick) copied out by `gpusnap precopy` rounds while it runs, then dumped by
`criu dump` against the last round, then restored and checked bit-exact.

Steps: start the workload with the agent; a full split `criu dump -R` as the baseline pause of
the same job in the same run (its pause includes the rollback's reload of the data); round 1;
round 2 against round 1; the final `criu dump` (the job is killed) into a directory whose
`parent` link leads to round 2 (made here, as `criu dump --prev-images-dir` would: that needs
soft-dirty tracking, which this kernel lacks); `gpusnap verify` of the final image; restore;
5 ticks; checker.

The job's pause in a round is measured from its own tick log: the longest gap between
consecutive ticks whose time stamps fall in the round, less the tick interval (the workload
stamps each tick with CLOCK_REALTIME). The final dump's pause is the criu dump's wall time (the
job is stopped from CRIU's seize until it is killed).

Writes $OUT/precopy.log and $OUT/NAME.jsonl (and bench/results/NAME.jsonl; NAME
defaults to precopy-h200; nothing without a GPU). One record: case precopy-<gib>, rounds [{round, wall_s, pause_s,
ticks_during, bytes_written, bytes_referenced, bytes_zero}], final {pause_s, bytes_written,
bytes_referenced, changed_share}, baseline_full_dump_s, restore_s, identical.
"""

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crlib import criu, output, procs, ticklog  # noqa: E402

INTERVAL_MS = 100


def data_stats(imgdir):
    st = criu.read_stats_json(imgdir) or {}
    processes = st.get("processes") or [{}]
    return processes[0].get("data") or {}


def pause_in(ticks, t0, t1):
    """(pause_s, ticks) of the job between wall times t0 and t1 (seconds): the longest gap
    between consecutive ticks stamped in [t0, t1] (the tick before t0 included) less the
    interval."""
    us0, us1 = t0 * 1e6, t1 * 1e6
    inside = [t["us"] for t in ticks if us0 <= t["us"] <= us1]
    before = [t["us"] for t in ticks if t["us"] < us0]
    after = [t["us"] for t in ticks if t["us"] > us1]
    stamps = before[-1:] + inside + after[:1]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    if not gaps:
        return None, len(inside)
    return round(max(0.0, max(gaps) / 1e6 - INTERVAL_MS / 1000.0), 3), len(inside)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--images", default="/dev/shm/gpusnap-precopy")
    ap.add_argument("--work", default="/tmp/gpusnap-work/precopy")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--name", default="precopy-h200")
    ap.add_argument("--budget-s", type=float, default=0, help="accepted for gpu/run-all.sh")
    a = ap.parse_args()
    a.gib = int(a.gib) if float(a.gib).is_integer() else a.gib
    out, log, mi = output.start_run("precopy", "gpusnap precopy: %s" % " ".join(sys.argv), a.plugdir)
    shutil.rmtree(a.images, ignore_errors=True)
    os.makedirs(a.images)
    wlog, wout = procs.fresh_workload_files(a.work, "precopy")
    # No mock mode: the rounds need the gpusnap CLI and a real agent.
    workload, prefix = a.workload, []
    vrc, version = criu.gpusnap_cli(["-V"], log)
    rec = {"run": time.strftime("%Y%m%dT%H%M%S"), "date": output.iso_now(), "gpu": mi.get("gpu"),
           "driver": mi.get("driver"), "machine": mi, "build": (version or "").strip() or None,
           "command": " ".join([sys.executable] + sys.argv), "case": "precopy-%s" % a.gib,
           "path": "split", "gib": a.gib, "rounds": [], "pass": False, "problems": []}
    popen, pid, rpid, pids = None, None, None, []
    ticks = lambda: ticklog.parse_workload_log(wlog)[1]  # noqa: E731
    try:
        popen = procs.start_process(prefix + [workload, "--gib", str(a.gib), "--log", wlog,
                                              "--interval-ms", str(INTERVAL_MS)],
                                    wout, procs.workload_env("split"), log)
        pid = popen.pid
        if not procs.wait_until(lambda: len(ticks()) >= 3, 120 + 3 * a.gib, proc=popen):
            raise RuntimeError("workload not ticking (exit %s)" % popen.poll())

        # Baseline: a full split dump of the same job, -R (the pause includes the reload).
        base = os.path.join(a.images, "full")
        os.makedirs(base)
        t0 = time.time()
        dump = criu.criu_dump(pid, base, a.plugdir, "auto", log, leave_running=True,
                              timeout=120 + 10 * a.gib)
        t1 = time.time()
        if dump["rc"] != 0:
            raise RuntimeError("baseline dump -R failed with rc %d" % dump["rc"])
        n = len(ticks())
        procs.wait_until(lambda: len(ticks()) >= n + 3, 60)
        rec["baseline_full_dump_s"] = round(dump["secs"], 3)
        rec["baseline_pause_s"] = pause_in(ticks(), t0, t1)[0]
        rec["baseline_data"] = data_stats(base)
        shutil.rmtree(base, ignore_errors=True)

        parent = None
        for k in (1, 2):
            d = os.path.join(a.images, "pre%d" % k)
            args = ["precopy", str(pid), "--images", d, "--json"]
            if parent:
                args += ["--parent", os.path.join("..", os.path.basename(parent))]
            t0 = time.time()
            rc, text = criu.gpusnap_cli(args, log, timeout=120 + 10 * a.gib)
            t1 = time.time()
            log.block("gpusnap precopy round %d" % k, text or "", max_lines=10)
            if rc != 0:
                raise RuntimeError("round %d failed (rc %s)" % (k, rc))
            rep = json.loads(text.strip().splitlines()[-1])
            n = len(ticks())
            procs.wait_until(lambda: len(ticks()) >= n + 2, 30)
            pause, during = pause_in(ticks(), t0, t1)
            r = {"round": k, "wall_s": round(t1 - t0, 3), "pause_s": pause, "ticks_during": during,
                 "data_s": round(rep.get("data_seconds", 0), 3),
                 "bytes_written": rep.get("bytes_written"), "bytes_referenced": rep.get("bytes_referenced"),
                 "bytes_zero": rep.get("bytes_zero"), "device_bytes": rep.get("device_bytes"),
                 "incremental": rep.get("incremental")}
            rec["rounds"].append(r)
            log("round %d: %s" % (k, r))
            parent = d

        final = os.path.join(a.images, "final")
        os.makedirs(final)
        os.symlink(os.path.join("..", os.path.basename(parent)), os.path.join(final, "parent"))
        pids = procs.tree_tids(pid)
        dump = criu.criu_dump(pid, final, a.plugdir, "auto", log, leave_running=False,
                              timeout=120 + 10 * a.gib)
        if dump["rc"] != 0:
            raise RuntimeError("final dump failed with rc %d" % dump["rc"])
        ds = data_stats(final)
        dev = ds.get("device_bytes") or 0
        rec["final"] = {"pause_s": round(dump["secs"], 3), "bytes_written": ds.get("bytes_written"),
                        "bytes_referenced": ds.get("bytes_referenced"), "bytes_zero": ds.get("bytes_zero"),
                        "device_bytes": dev, "incremental": ds.get("incremental"),
                        "changed_share": round((ds.get("bytes_written") or 0) / dev, 4) if dev else None,
                        "image_bytes": criu.image_stats(final)["image_bytes"]}
        st = criu.read_stats_json(final) or {}
        rec["final"]["timings_s"] = ((st.get("processes") or [{}])[0]).get("timings_s")
        rec["pause_s"] = rec["final"]["pause_s"]
        log("final dump: %s" % rec["final"])
        if not ds.get("bytes_referenced"):
            rec["problems"].append("the final dump referenced nothing in the last round")
        popen.wait(timeout=30)
        n_dump = len(ticks())
        if not procs.wait_pids_free(pids, 60, log):
            raise RuntimeError("dumped pids still in use")
        rec["problems"].extend(criu.verify_image_dir(final, log)[1])
        rec["restore_s"], rpid, problems, rec["identical"] = criu.restore_and_check(
            final, a.plugdir, log, wlog, n_dump, 120 + 10 * a.gib)
        rec["problems"].extend("checker: " + p for p in problems)
    except Exception as e:
        rpid = rpid or getattr(e, "pid", None)  # a failed restore's process, to clean up
        output.note_failure(rec, log, e, expected=RuntimeError)
    finally:
        criu.log_agent_lines(log, wout)
        targets = [x for x in {rpid, pid} if x]
        if targets:
            procs.kill_and_wait(targets, log, wait_pids=targets + pids, popen=popen)
        saved = criu.save_criu_logs(os.path.join(a.images, "final"), a.work, "precopy-final")
        output.archive_add([wlog, wout] + saved, "precopy", log)
        shutil.rmtree(a.images, ignore_errors=True)
    rec["pass"] = not rec["problems"]
    output.append_jsonl(output.result_files(out, a.name, False), rec)
    log("RESULT precopy: %s rounds %s final %s" % ("PASS" if rec["pass"] else "FAIL",
                                                  json.dumps(rec["rounds"]), json.dumps(rec.get("final"))))
    for p in rec["problems"]:
        log("  problem: %s" % p)
    return 0 if rec["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
