"""Several GPUs on the H200 x2 machine (issue "Several GPUs"): gpu/workload.cu across two GPUs,
restored onto other GPUs, and a process tree with one process per GPU.

Called by gpu/multi_gpu.sh (which builds the workload and installs the plugin); see --help.
Cases, each on the split and the transparent path (dump + restore, checker as in gpu/e2e.py):
  two-gpu   one process with allocations round robin on GPUs 0 and 1, restored on the same GPUs;
            the dump log's per-GPU lines give each GPU's share and rate;
  remap     one process on GPU 0, restored onto GPU 1 (GPUSNAP_DEVICE_MAP=uuid0=uuid1); nvidia-smi
            must show the restored process on GPU 1 only;
  swap      the two-GPU process restored with its GPUs swapped (uuid0=uuid1,uuid1=uuid0);
  tree      `sh` with two workloads, one on GPU 0 and one on GPU 1: one dump, one restore, both
            computations go on bit-exact.
Writes $OUT/multi-gpu.log, $OUT/NAME.jsonl (and bench/results/NAME.jsonl; NAME defaults to
multi-gpu-h200x2) with one record per case and path: run, date, gpu, driver, case, path, gpus,
remap, identical, dump_s, restore_s, per_gpu (GiB and GiB/s of each GPU over the data phase),
landed_on (GPU UUIDs holding the restored process's memory). Exit status 1 if any case fails.
"""

import argparse
import os
import re
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crlib  # noqa: E402
from crlib import criu, machine, output, procs, ticklog  # noqa: E402
import ccase  # noqa: E402

PER_GPU = re.compile(r"GPU (\d+): ([0-9.]+) GiB, ([0-9.]+) GiB/s over the data phase")
ONTO = re.compile(r"GPU (\S+) is restored onto GPU (\S+)")


def per_gpu(lines):
    out = {}
    for line in lines or []:
        m = PER_GPU.search(line)
        if m:
            out[m.group(1)] = {"gib": float(m.group(2)), "gib_s": float(m.group(3))}
    return out


def norm(uuid):
    return uuid.lower().replace("gpu-", "").replace("-", "")


def tree_case(a, cfg, log, path, uuids):
    """sh with one workload per GPU; returns a record like ccase.run_c_case's."""
    name = "mgpu-tree-%s" % path
    imgdir = os.path.join(cfg.images, name)
    shutil.rmtree(imgdir, ignore_errors=True)
    os.makedirs(cfg.work, exist_ok=True)
    logs = [os.path.join(cfg.work, "%s-gpu%d.log" % (name, d)) for d in (0, 1)]
    wout = os.path.join(cfg.work, name + ".out")
    for f in logs + [wout]:
        if os.path.exists(f):
            os.unlink(f)
    rec = {"case": name, "path": path, "gib": a.gib, "pass": False, "problems": []}
    mode = cfg.modes[path]
    log("=" * 78)
    log("CASE %s: sh with two workloads (GPU 0, GPU 1) of %s GiB each, path %s" % (name, a.gib, path))
    popen, rpid, pids = None, None, []
    t_case = time.time()
    try:
        prefix = " ".join(cfg.workload_prefix)
        parts = ["%s %s --gib %s --chunk-mib %d --log %s --interval-ms %d --devices %d &" % (
            prefix, cfg.workload, a.gib, cfg.chunk_mib, logs[d], cfg.interval_ms, d) for d in (0, 1)]
        popen = procs.start_process(["sh", "-c", " ".join(parts) + " wait"], wout,
                                    procs.workload_env(path), log)
        parsed = lambda: [ticklog.parse_workload_log(p) for p in logs]  # noqa: E731
        ok = procs.wait_until(lambda: all(len(t) >= cfg.ticks_before for _, t, _ in parsed()),
                              120 + 3 * float(a.gib), proc=popen)
        if not ok:
            raise ccase.CaseError("workloads not ticking (sh exit %s)" % popen.poll())
        pids = procs.tree_tids(popen.pid)
        kids = [p for p in procs.tree_pids(popen.pid) if p != popen.pid]
        rec["gpus_before"] = machine.gpus_of_pids(kids)
        log("tree %d: children %s on GPUs %s" % (popen.pid, kids, rec["gpus_before"]))
        dump = criu.criu_dump(popen.pid, imgdir, cfg.plugdir, mode, log, timeout=300 + 20 * a.gib)
        rec["dump_s"], rec["dump_rc"] = round(dump["secs"], 3), dump["rc"]
        rec["dump_gpusnap_lines"] = dump["gpusnap_lines"]
        if dump["rc"] != 0:
            raise ccase.CaseError("criu dump failed with rc %d" % dump["rc"])
        popen.wait(timeout=30)
        n_dump = [len(t) for _, t, _ in parsed()]
        if not procs.wait_pids_free(pids, 60, log):
            raise ccase.CaseError("dumped pids still in use 60 s after the dump")
        restore = criu.criu_restore(imgdir, cfg.plugdir, mode, log, timeout=300 + 20 * a.gib)
        rec["restore_s"], rpid = round(restore["secs"], 3), restore["pid"]
        rec["restore_gpusnap_lines"] = restore["gpusnap_lines"]
        if restore["rc"] != 0:
            raise ccase.CaseError("criu restore failed with rc %d" % restore["rc"])
        rec["landed_on"] = machine.gpus_of_pids(procs.tree_pids(rpid))
        need = [n + cfg.ticks_after for n in n_dump]
        procs.wait_until(lambda: all(len(t) >= k for (_, t, _), k in zip(parsed(), need)), 60)
        for d, ((ready, ticks, errors), n) in enumerate(zip(parsed(), n_dump)):
            chk = ticklog.check_ticks(ready, ticks, errors, need_after=cfg.ticks_after, after_index=n,
                                    window=(dump["start"], restore["end"]))
            log("GPU %d workload: checker %s, %d ticks, %d after the dump" % (
                d, "PASS" if chk["pass"] else "FAIL", chk["n_ticks"], chk["ticks_after"]))
            rec["problems"].extend("GPU %d workload: %s" % (d, p) for p in chk["problems"])
        if not a.mock and sorted(map(norm, rec["landed_on"] or [])) != sorted(map(norm, uuids.values())):
            rec["problems"].append("restored tree holds memory on %s, expected both GPUs" % rec["landed_on"])
    except Exception as e:
        output.note_failure(rec, log, e, expected=ccase.CaseError)
    finally:
        if rec["problems"]:
            for p in logs + [wout, os.path.join(imgdir, "dump.log"), os.path.join(imgdir, "restore.log")]:
                log.file_tail(os.path.basename(p), p, 25)
        targets = [x for x in {rpid, popen.pid if popen else None} if x]
        tree = sorted({p for t in targets for p in procs.tree_pids(t)})
        if tree:
            procs.kill_and_wait(tree, log, wait_pids=tree + pids, popen=popen)
        saved = criu.save_criu_logs(imgdir, cfg.work, name)
        output.archive_add(logs + [wout] + saved, "%s/%s" % (cfg.archive_prefix, name), log)
        shutil.rmtree(imgdir, ignore_errors=True)
    rec["identical"] = not rec["problems"]
    rec["pass"] = not rec["problems"]
    rec["case_s"] = round(time.time() - t_case, 1)
    log("RESULT %s: %s%s" % (name, "PASS" if rec["pass"] else "FAIL",
                             "" if rec["pass"] else " (%s)" % "; ".join(rec["problems"][:4])))
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="two-gpu,remap,swap,tree")
    ap.add_argument("--paths", default="split,transparent")
    ap.add_argument("--gib", type=float, default=4, help="GiB per GPU (default 4)")
    ap.add_argument("--images", default="/dev/shm/gpusnap-mgpu")
    ap.add_argument("--work", default="/tmp/gpusnap-work/mgpu")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--name", default="multi-gpu-h200x2")
    ap.add_argument("--budget-s", type=float, default=0)
    ap.add_argument("--mock", action="store_true", help="gpu/mock_workload.py, no GPU (harness test)")
    a = ap.parse_args()
    a.gib = int(a.gib) if a.gib.is_integer() else a.gib
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA ordinals = nvidia-smi indexes

    t_start = time.time()
    out, log, mi = output.start_run("multi-gpu", "gpusnap multi-GPU: %s" % " ".join(sys.argv),
                                   a.plugdir)
    jsonl = output.result_files(out, a.name, a.mock)
    uuids = {} if a.mock else machine.gpu_uuids()
    log("GPUs: %s" % uuids)
    if not a.mock and len(uuids) < 2:
        log("fewer than 2 GPUs: nothing to do")
        return 1
    u0, u1 = (uuids.get(0, "GPU-0"), uuids.get(1, "GPU-1"))
    cfg_common = dict(
        workload=os.path.join(crlib.REPO, "gpu", "mock_workload.py") if a.mock else a.workload,
        workload_prefix=[sys.executable] if a.mock else [], plugdir=a.plugdir, images=a.images,
        work=a.work, chunk_mib=a.chunk_mib, archive_prefix="mgpu")
    # case: (devices, total GiB, device map, expected GPUs after restore, remap label)
    cases = {
        "two-gpu": ("0,1", 2 * a.gib, {}, [u0, u1], "none"),
        "remap": ("0", a.gib, {"GPUSNAP_DEVICE_MAP": "%s=%s" % (u0, u1)}, [u1], "0->1"),
        "swap": ("0,1", 2 * a.gib, {"GPUSNAP_DEVICE_MAP": "%s=%s,%s=%s" % (u0, u1, u1, u0)},
                 [u0, u1], "0->1,1->0"),
    }
    run_id = time.strftime("%Y%m%dT%H%M%S")
    results = []
    for case in a.cases.split(","):
        for path in a.paths.split(","):
            if a.budget_s and time.time() - t_start > a.budget_s:
                rec = {"case": case, "path": path, "pass": None, "skipped": "time budget"}
                log("budget of %.0f s spent: skipping %s %s" % (a.budget_s, case, path))
            elif case == "tree":
                rec = tree_case(a, ccase.CaseConfig(**cfg_common), log, path, uuids or {0: u0, 1: u1})
                rec.update(gpus=2, remap="none")
            else:
                devices, gib, env, expect, remap = cases[case]
                cfg = ccase.CaseConfig(devices=devices, restore_env=env, **cfg_common)
                rec = ccase.run_c_case(cfg, log, path, gib, False, tag="mgpu-" + case)
                rec.update(gpus=len(devices.split(",")), remap=remap)
                landed = rec.get("gpus_after")
                if landed is not None and not a.mock and sorted(map(norm, landed)) != sorted(map(norm, expect)):
                    rec["problems"].append("restored process holds memory on %s, expected %s" % (landed, expect))
                if env and not a.mock and rec.get("restore_rc") == 0:
                    onto = [ONTO.search(l) for l in rec.get("restore_gpusnap_lines") or []]
                    onto = sorted((norm(m.group(1)), norm(m.group(2))) for m in onto if m)
                    want = sorted((norm(o), norm(n)) for o, n in
                                  (p.split("=") for p in env["GPUSNAP_DEVICE_MAP"].split(",")))
                    rec["restored_onto"] = onto
                    # The plugin completes the map to a permutation of the host's GPUs (the
                    # driver's pairs cover every GPU the process's CUDA state knows).
                    if not set(want) <= set(onto):
                        rec["problems"].append("restore log maps GPUs %s, expected %s" % (onto, want))
                rec["identical"] = bool(rec.get("identical")) and not rec["problems"]
                rec["pass"] = not rec["problems"]
            rec["per_gpu"] = per_gpu(rec.get("dump_gpusnap_lines"))
            rec["landed_on"] = rec.get("landed_on", rec.get("gpus_after"))
            rec.update({"run": run_id, "date": output.iso_now(), "gpu": mi.get("gpu"),
                        "driver": mi.get("driver"), "gpu_count_host": len(uuids)})
            slim = {k: v for k, v in rec.items() if not k.endswith("gpusnap_lines")}
            output.append_jsonl(jsonl, slim)
            results.append(rec)
    log("=" * 78)
    log("SUMMARY (%.0f s)" % (time.time() - t_start))
    for r in results:
        res = "SKIP" if r.get("pass") is None else ("PASS" if r["pass"] else "FAIL")
        log("%-28s %-12s %-5s dump %-7s restore %-7s per-GPU %s landed %s %s" % (
            r["case"], r["path"], res, r.get("dump_s", "-"), r.get("restore_s", "-"),
            r.get("per_gpu"), r.get("landed_on"), "; ".join(r.get("problems", []))[:300]))
    failed = [r for r in results if r.get("pass") is not True]
    log("multi-gpu: %d passed, %d failed or skipped" % (len(results) - len(failed), len(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
