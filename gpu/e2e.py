"""GPU end to end on the H200: gpu/workload.cu through criu dump/restore with the gpusnap plugin.

Called by gpu/e2e.sh (which builds the workload and installs the plugin); see --help.
For each size and path: (1) criu dump + wait PIDs free + gpusnap verify + criu restore
--restore-detached, 5 more ticks, checker; (2) criu dump -R, 5 more ticks, checker, pause.
Writes $OUT/e2e.log and $OUT/e2e.jsonl (one record per case), adds the per-case logs to
$OUT/logs.tar. Exit status 1 if any case FAILs.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crlib  # noqa: E402
from crlib import output  # noqa: E402
import ccase  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, nargs="+", default=[4, 16], help="sizes in GiB (default 4 16)")
    ap.add_argument("--path", choices=["transparent", "split", "split-copyfirst", "split-async", "both",
                             "splits"],
                    default="both",
                    help="split: the hand-over (default config); split-copyfirst: handover = false; "
                         "split-async: the hand-over with async_leave_running (-R cases only); "
                         "both: transparent and split; splits: split and split-copyfirst")
    ap.add_argument("--images", default="/dev/shm/gpusnap-e2e", help="base dir of image dirs")
    ap.add_argument("--work", default="/tmp/gpusnap-work/e2e", help="workload logs")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--mock", action="store_true", help="use gpu/mock_workload.py (no GPU; harness test)")
    ap.add_argument("--alloc", choices=["driver", "runtime"], default="driver")
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--interval-ms", type=int, default=100)
    ap.add_argument("--no-leave-running", action="store_true", help="skip the criu dump -R cases")
    ap.add_argument("--no-restore", action="store_true", help="skip the dump+restore cases")
    ap.add_argument("--keep-images", action="store_true")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no new case after this many seconds (0: no limit)")
    ap.add_argument("--log-name", default="e2e")
    ap.add_argument("--criu-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more of criu's environment, for every path (e.g. GPUSNAP_ASYNC_SNAPSHOT_SHARE=80)")
    a = ap.parse_args()

    t_start = time.time()
    out, log, mi = output.start_run(a.log_name, "gpusnap e2e: %s" % " ".join(sys.argv), a.plugdir)
    jsonl = os.path.join(out, a.log_name + ".jsonl")
    for f in (crlib.AGENT_SO, crlib.GPUSNAP_CLI, crlib.CRIU):
        log("%s: %s" % (f, "present" if os.path.exists(f) else "MISSING"))
    os.makedirs(a.images, exist_ok=True)
    cfg = ccase.CaseConfig(
        workload=os.path.join(crlib.REPO, "gpu", "mock_workload.py") if a.mock else a.workload,
        workload_prefix=[sys.executable] if a.mock else [],
        plugdir=a.plugdir, images=a.images, work=a.work, alloc=a.alloc, chunk_mib=a.chunk_mib,
        interval_ms=a.interval_ms, keep_images=a.keep_images, archive_prefix=a.log_name)
    for kv in a.criu_env:
        k, _, v = kv.partition("=")
        for p in ("transparent", "split", "split-copyfirst", "split-async"):
            cfg.criu_env.setdefault(p, {})[k] = v
    paths = {"both": ["transparent", "split"], "splits": ["split", "split-copyfirst"]}.get(
        a.path, [a.path])
    kinds = []
    if not a.no_restore:
        kinds.append(False)
    if not a.no_leave_running:
        kinds.append(True)
    run_id = time.strftime("%Y%m%dT%H%M%S")
    results = []
    for gib in a.gib:
        gib = int(gib) if float(gib).is_integer() else gib
        for path in paths:
            for leave in kinds:
                if path == "split-async" and not leave:
                    continue  # the asynchronous route is taken by criu dump -R alone
                if a.budget_s and time.time() - t_start > a.budget_s:
                    log("budget of %.0f s spent: skipping %s %s GiB %s" % (
                        a.budget_s, path, gib, "leave" if leave else "dump"))
                    results.append({"case": "%s-%sg-%s" % (path, gib, "leave" if leave else "dump"),
                                    "pass": None, "skipped": "time budget"})
                    continue
                rec = ccase.run_c_case(cfg, log, path, gib, leave, tag=a.log_name)
                rec.update({"run": run_id, "date": output.iso_now(), "gpu": mi.get("gpu"),
                            "driver": mi.get("driver")})
                output.append_jsonl([jsonl], rec)
                results.append(rec)
    log("=" * 78)
    log("SUMMARY (%.0f s)" % (time.time() - t_start))
    log("%-34s %-6s %8s %8s %9s %7s %8s %s" % (
        "case", "result", "dump_s", "rest_s", "img_GiB", "ticks", "pause_s", "problems"))
    for r in results:
        res = "SKIP" if r.get("pass") is None else ("PASS" if r["pass"] else "FAIL")
        log("%-34s %-6s %8s %8s %9s %7s %8s %s" % (
            r["case"], res, r.get("dump_s", "-"), r.get("restore_s", "-"),
            "%.2f" % (r["image_bytes"] / 2**30) if "image_bytes" in r else "-",
            r.get("check", {}).get("ticks_after", "-"),
            r.get("pause_s", r.get("downtime_s", "-")),
            "; ".join(r.get("problems", []))[:200]))
        for phase_line in (r.get("dump_gpusnap_lines") or [])[-8:]:
            log("    dump    %s" % phase_line.strip()[:200])
        for phase_line in (r.get("restore_gpusnap_lines") or [])[-8:]:
            log("    restore %s" % phase_line.strip()[:200])
    failed = [r for r in results if r.get("pass") is False]
    log("e2e: %d passed, %d failed, %d skipped" % (
        sum(1 for r in results if r.get("pass")), len(failed),
        sum(1 for r in results if r.get("pass") is None)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
