"""The asynchronous `criu dump -R`'s kill points on a GPU (issue 36; the stand-in's
criu-tests/tests/async_leave_running.rs): for each point, one job (gpu/workload.cu, the split
path) is dumped with `async_leave_running` and GPUSNAP_TEST_KILL_CRIU_AT=<point>:
  dump-snapshot-copied   CRIU is killed once the keeper holds the snapshot, before the job is
                         released: criu fails;
  async-drain-started    the drainer kills the keeper after CRIU returned: criu succeeds;
  async-before-manifest  the drainer kills itself with every chunk written: criu succeeds.
Each must leave the job running on its own memory (ticks go on, bit-exact by gpu/workload.cu's
checker), and an image that nothing takes for a checkpoint: `gpusnap wait` exits 1 (failed, or
pending with its writer gone), `gpusnap verify` fails, `criu restore` fails and forks no task.
Writes $OUT/NAME.log and NAME.jsonl; exit status 1 if a point fails.
"""

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crlib import criu, output, procs, ticklog  # noqa: E402

POINTS = ["dump-snapshot-copied", "async-drain-started", "async-before-manifest"]
# Slow chunks for the keeper's kill, so that it dies with most of the drain ahead (as the
# stand-in test does).
EXTRA = {"async-drain-started": {"GPUSNAP_STAGING_SLOTS": "2", "GPUSNAP_STAGING_SLOT_MIB": "1"}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--images", default="/dev/shm/gpusnap-async-kills")
    ap.add_argument("--work", default="/tmp/gpusnap-work/async-kills")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--name", default="async-kills")
    a = ap.parse_args()
    out, log, mi = output.start_run(a.name, "gpusnap async kill points: %s" % " ".join(sys.argv),
                                    a.plugdir)
    jsonl = os.path.join(out, a.name + ".jsonl")
    os.makedirs(a.work, exist_ok=True)
    failed = []
    for point in [p.strip() for p in a.points.split(",") if p.strip()]:
        problems, rec = run_point(a, log, point)
        rec.update({"case": "async-kill", "point": point, "pass": not problems, "problems": problems,
                    "date": output.iso_now(), "gpu": mi.get("gpu"), "driver": mi.get("driver")})
        output.append_jsonl([jsonl], rec)
        log("RESULT %s: %s%s" % (point, "PASS" if not problems else "FAIL",
                                 "" if not problems else " (%s)" % "; ".join(problems)))
        if problems:
            failed.append(point)
    log("SUMMARY: failed: %s" % (failed or "none"))
    return 1 if failed else 0


def run_point(a, log, point):
    log("=" * 78)
    imgdir = os.path.join(a.images, point)
    shutil.rmtree(imgdir, ignore_errors=True)
    os.makedirs(imgdir)
    wlog, wout = procs.fresh_workload_files(a.work, point)
    cmd = [a.workload, "--gib", str(a.gib), "--chunk-mib", "512", "--log", wlog, "--interval-ms", "100"]
    popen = procs.start_process(cmd, wout, procs.workload_env("split"), log)
    problems, rec, rpid = [], {}, None
    ticks = lambda: len(ticklog.parse_workload_log(wlog)[1])  # noqa: E731
    try:
        if not procs.wait_until(lambda: ticks() >= 3, 120, proc=popen):
            return ["the job did not tick 3 times (exit %s)" % popen.poll()], rec
        env = {"GPUSNAP_ASYNC_LEAVE_RUNNING": "1", "GPUSNAP_TEST_KILL_CRIU_AT": point}
        env.update(EXTRA.get(point, {}))
        dump = criu.criu_dump(popen.pid, imgdir, a.plugdir, "auto", log, leave_running=True, env=env)
        rec["dump_rc"] = dump["rc"]
        fired = any("test fault" in l and point in l for l in dump["gpusnap_lines"])
        expect_ok = point != "dump-snapshot-copied"
        if point == "dump-snapshot-copied" and not fired:
            problems.append("the kill point did not fire (no 'test fault' line)")
        if (dump["rc"] == 0) != expect_ok:
            problems.append("criu dump rc %d, expected %s" % (dump["rc"], "0" if expect_ok else "a failure"))
        # The job runs on its own memory: 5 more ticks, all correct.
        n = ticks()
        if not procs.wait_until(lambda: ticks() >= n + 5, 60, proc=popen):
            problems.append("the job did not tick on after the dump (%d -> %d ticks; exit %s)"
                            % (n, ticks(), popen.poll()))
        ready, tks, errors = ticklog.parse_workload_log(wlog)
        chk = ticklog.check_ticks(ready, tks, errors)
        problems.extend("checker: " + p for p in chk["problems"])
        # Nothing takes the image for a checkpoint.
        wrc, wtext = criu.gpusnap_cli(["wait", imgdir, "--timeout", "120"], log, timeout=180)
        rec["wait_rc"] = wrc
        log.block("gpusnap wait", wtext or "", max_lines=10)
        if wrc != 1:
            problems.append("gpusnap wait rc %s, expected 1 (failed)" % wrc)
        vrc, vtext = criu.gpusnap_cli(["verify", imgdir], log)
        rec["verify_rc"] = vrc
        if vrc == 0:
            problems.append("gpusnap verify passed an image the drain never finished")
        # The job still runs here, with its pids: the restore is refused before it needs them.
        r = criu.criu_restore(imgdir, a.plugdir, "auto", log, timeout=120)
        rec["restore_rc"] = r["rc"]
        rpid = r["pid"]
        if r["rc"] == 0:
            problems.append("criu restore succeeded on an unfinished image")
        said = " ".join(r["gpusnap_lines"]).lower()
        if not any(w in said for w in ("pending", "not-a-checkpoint", "not a checkpoint")):
            problems.append("the restore's refusal does not name the unfinished image")
        with open(r["log"], errors="replace") if os.path.exists(r["log"]) else open(os.devnull) as f:
            forked = sum(1 for l in f if "Forking task" in l)
        if forked:
            problems.append("criu restore forked %d task(s)" % forked)
        rec["files"] = sorted(os.listdir(imgdir))[:40]
    finally:
        left = [x for x in (rpid, popen.pid) if x and procs.alive(x)]
        procs.kill_and_wait(left, log, popen=popen)
        # A drainer left behind, if any, ends with the image directory gone.
        saved = criu.save_criu_logs(imgdir, a.work, point)
        output.archive_add([wlog, wout] + saved, "%s/%s" % (a.name, point), log)
        shutil.rmtree(imgdir, ignore_errors=True)
    return problems, rec


if __name__ == "__main__":
    time.tzset()
    sys.exit(main())
