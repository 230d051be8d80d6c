"""Split path vs transparent path benchmark (issue "split path benchmark"); run by bench/run.sh.

One run: pinned PCIe bandwidth (gpu/pcie_bw.cu), the floor's ring probe at each size
(gpu/ring_probe.cu, two runs, the second counts; see floor_of), then for each size (default 4 16 64 GiB) and
path (transparent, split): gpu/workload.cu, criu dump (timed: start to return), criu restore
--restore-detached (timed: start to return; the plugin restores all data before criu returns),
the tick checker after restore ("identical"). Cases that do not fit in RAM are skipped with a
record saying so. Appends one JSON object per line to bench/results/<name>.jsonl and
$OUT/<name>.jsonl, then renders bench/results/<name>.md (and $OUT/<name>.md) with
bench/report.py. Log: $OUT/bench.log; per-case logs in $OUT/logs.tar.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "gpu"))
import crlib  # noqa: E402
from crlib import machine, output  # noqa: E402
import ccase  # noqa: E402


def need_gib(path, gib):
    # transparent: the driver checkpoint puts the GPU data into the process's RAM, and the image
    # (on /dev/shm) holds it again. split: the image holds it once; staging is small.
    return (2 * gib if path == "transparent" else gib) + 6


def usable_gib(ram_gib):
    m = machine.meminfo_gib()
    total, avail = m.get("MemTotal", 0), m.get("MemAvailable", 0)
    if total >= 0.9 * ram_gib:
        return avail, m
    # Memory that grows as it is used (seen on some of these VMs): trust the nominal size.
    return ram_gib - (total - avail), m


def pcie(binary, gib, log):
    if not os.path.exists(binary):
        log("pcie_bw binary %s missing" % binary)
        return None
    cmd = [binary, "--gib", str(gib), "--chunk-mib", "64", "--streams", "4", "--iters", "3"]
    log("$ " + " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        log("pcie_bw timed out")
        return None
    log.block("pcie_bw output (rc %d)" % r.returncode, r.stdout + r.stderr)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None


def ring_floor(binary, images, gib, shape, log):
    """gpu/ring_probe.cu at `gib` in the image directory, two runs (the first pays the VM's first
    touch of guest memory, the second is the floor): (the second run's record, with the first's
    rates added, or None; why not). shape: the probe's ring (slots, slot_mib, streams, threads)."""
    if not os.path.exists(binary):
        return None, "ring_probe binary %s missing (gpu/build.sh builds it)" % binary
    pdir = os.path.join(images, "floor-probe")
    cmd = [binary, "--gib", str(gib), "--repeat", "2", "--dir", pdir]
    for k in ("slots", "slot_mib", "streams", "threads"):
        cmd += ["--" + k.replace("_", "-"), str(shape[k])]
    log("$ " + " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120 + 6 * float(gib))
    except subprocess.TimeoutExpired:
        return None, "ring_probe timed out"
    finally:
        # a probe that died leaves its files (GiB of /dev/shm) behind
        shutil.rmtree(pdir, ignore_errors=True)
    log.block("ring_probe output (rc %d)" % r.returncode, r.stdout + r.stderr)
    recs = []
    for x in r.stdout.splitlines():
        if x.startswith("{"):
            try:
                recs.append(json.loads(x))
            except ValueError:
                pass
    if r.returncode != 0 or len(recs) != 2:
        return None, "ring_probe rc %d with %d record(s): %s" % (
            r.returncode, len(recs), (r.stderr.strip().splitlines() or ["no message"])[-1])
    if not all(x.get("verified") for x in recs):
        return None, "ring_probe: the restored data did not verify"
    last = dict(recs[-1])
    last.update(first_write_gbps=recs[0].get("write_gbps"), first_read_gbps=recs[0].get("read_gbps"))
    return last, None


def tmpfs_floor(images, gib, log):
    """gpu/tmpfs_probe.py at `gib` in the image directory, twice (the first run pays the VM's
    first touch of guest memory, the second counts); the second run's record, or None. Only with
    --tmpfs-probe, as a column beside the floor: tmpfs alone, from one cache-hot buffer."""
    cmd = [sys.executable, os.path.join(crlib.REPO, "gpu", "tmpfs_probe.py"), "--gib", str(gib), str(gib),
           "--dir", os.path.join(images, "floor-probe")]
    log("$ " + " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        log("tmpfs_probe timed out")
        return None
    log.block("tmpfs_probe output (rc %d)" % r.returncode, r.stdout + r.stderr)
    recs = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    return recs[-1] if len(recs) == 2 else None


def floor_of(rec, pcie, probe):
    """The machine's floor for a split case, from the same run (issue 14): the data the case
    moved at the ring probe's rates (gpu/ring_probe.cu at the same size: device -> pinned ring ->
    tmpfs files and back, PCIe and tmpfs together), plus the driver's control checkpoint
    (restore) and CRIU's own part of the call (the call's time less gpusnap's phases), both as
    measured in this case. gpusnap's own set-up (ring, release) and its per-chunk work are what
    the floor leaves out. pcie (may be None) only gives the shares of PCIe."""
    st = rec.get("phases") or {}
    try:
        p = st["processes"][0]
        t = p["timings_s"]
        d = p["data"]
        rt = st["restore"]["processes"][0]["timings_s"]
    except (KeyError, IndexError, TypeError):
        return {}
    moved = d.get("device_bytes", 0) - d.get("bytes_zero", 0) - d.get("bytes_referenced", 0)
    out_gbps, in_gbps = probe.get("write_gbps"), probe.get("read_gbps")
    if not out_gbps or not in_gbps:
        return {}
    criu_dump = rec["dump_s"] - sum(v for v in t.values() if isinstance(v, (int, float)))
    criu_restore = rec["restore_s"] - rt.get("total", 0)
    f = {
        "floor_dump_s": round(moved / (out_gbps * 1e9) + t.get("control", 0) + max(criu_dump, 0), 3),
        "floor_restore_s": round(moved / (in_gbps * 1e9) + rt.get("control", 0) + max(criu_restore, 0), 3),
        "floor_out_gbps": out_gbps, "floor_in_gbps": in_gbps, "moved_bytes": moved,
        "floor_probe": "ring",
        "floor_probe_params": {k: probe.get(k) for k in ("gib", "slots", "slot_mib", "streams", "threads")},
    }
    if t.get("data"):
        f["data_out_share_of_floor"] = round(moved / t["data"] / (out_gbps * 1e9), 3)
        if pcie and pcie.get("d2h_gbps"):
            f["data_out_share_of_pcie"] = round(moved / t["data"] / (pcie["d2h_gbps"] * 1e9), 3)
    if rt.get("data"):
        f["data_in_share_of_floor"] = round(moved / rt["data"] / (in_gbps * 1e9), 3)
        if pcie and pcie.get("h2d_gbps"):
            f["data_in_share_of_pcie"] = round(moved / rt["data"] / (pcie["h2d_gbps"] * 1e9), 3)
    return f


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[4, 16, 64])
    ap.add_argument("--paths", default="transparent,split", help="comma list (default transparent,split)")
    ap.add_argument("--name", default="split-vs-transparent-h200")
    ap.add_argument("--images", default="/dev/shm/gpusnap-bench")
    ap.add_argument("--work", default="/tmp/gpusnap-work/bench")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--bin", default="/tmp/gpusnap-bin")
    ap.add_argument("--mock", action="store_true", help="CPU stand-in workload (harness test)")
    ap.add_argument("--alloc", choices=["driver", "runtime"], default="driver")
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--ram-gib", type=float, default=128, help="nominal RAM of the machine (default 128)")
    ap.add_argument("--pcie-gib", type=float, default=4)
    ap.add_argument("--no-pcie", action="store_true")
    ap.add_argument("--verify", action="store_true", help="also run gpusnap verify (untimed)")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new case after this many s")
    ap.add_argument("--reserve-gib", type=float, default=0,
                    help="the workload also reserves this much device memory it never writes "
                         "(records case sparse-<reserved+written>g-touch-<written>g)")
    ap.add_argument("--cmdline", default=None, help="command line to record (default: this one)")
    ap.add_argument("--no-floor", action="store_true",
                    help="do not measure the floor (gpu/ring_probe.cu at each size)")
    ap.add_argument("--probe-slots", type=int, default=16, help="ring probe: ring slots (default 16)")
    ap.add_argument("--probe-slot-mib", type=int, default=32, help="ring probe: MiB per slot (default 32)")
    ap.add_argument("--probe-streams", type=int, default=4, help="ring probe: copy streams (default 4)")
    ap.add_argument("--probe-threads", type=int, default=16,
                    help="ring probe: writer/reader threads, one file each (default 16)")
    ap.add_argument("--tmpfs-probe", action="store_true",
                    help="also run gpu/tmpfs_probe.py at each size (tmpfs alone, a column beside the floor)")
    a = ap.parse_args()
    shape = {"slots": a.probe_slots, "slot_mib": a.probe_slot_mib, "streams": a.probe_streams,
             "threads": a.probe_threads}

    t_start = time.time()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-%d" % os.getpid()
    cmdline = a.cmdline or " ".join(sys.argv)
    out, log, mi = output.start_run("bench", "bench run %s: %s" % (run_id, cmdline), a.plugdir)
    jsonls = output.result_files(out, a.name, a.mock)
    base = {"run": run_id, "date": output.iso_now(), "gpu": mi.get("gpu"), "driver": mi.get("driver")}
    output.append_jsonl(jsonls, dict(base, kind="meta", cmdline=cmdline, cpus=mi.get("cpus"),
                                    ram_gib=mi.get("ram_gib"), kernel=mi.get("kernel"),
                                    gpu_mem=mi.get("gpu_mem"), criu=mi.get("criu"),
                                    shm_options=mi.get("shm_options"), sizes=a.sizes, paths=a.paths,
                                    alloc=a.alloc, chunk_mib=a.chunk_mib, mock=a.mock,
                                    floor_probe=None if a.no_floor or a.mock else "ring",
                                    floor_probe_params=shape))

    p = None
    if not a.no_pcie and not a.mock:
        p = pcie(os.path.join(a.bin, "pcie_bw"), a.pcie_gib, log)
        if p:
            output.append_jsonl(jsonls, dict(base, date=output.iso_now(), kind="pcie",
                                            d2h_gbps=p.get("d2h_gbps"), h2d_gbps=p.get("h2d_gbps"),
                                            d2h_mean_gbps=p.get("d2h_mean_gbps"),
                                            h2d_mean_gbps=p.get("h2d_mean_gbps"),
                                            bytes=p.get("bytes"), chunk_mib=p.get("chunk_mib"),
                                            streams=p.get("streams")))

    # The floor: the ring probe at each size, before the cases, so that they and the probe see the
    # same, already touched, guest memory. The harness test (--mock) has no GPU: no floor.
    probes, tmpfs = {}, {}
    if a.mock:
        log("floor: not measured (--mock: the ring probe needs a GPU)")
    elif not a.no_floor:
        os.makedirs(a.images, exist_ok=True)
        for gib in a.sizes:
            pr, why = ring_floor(os.path.join(a.bin, "ring_probe"), a.images, gib, shape, log)
            rec = dict(base, kind="floor-probe", probe="ring", date=output.iso_now(), gib=gib)
            if pr:
                probes[gib] = pr
                # the probe's own "run" (1, 2) must not replace the bench's run id
                rec.update({{"run": "probe_run", "runs": "probe_runs"}.get(k, k): v
                            for k, v in pr.items() if k not in ("kind", "gib")})
            else:
                log("floor at %s GiB: none (%s)" % (gib, why))
                rec.update(shape, failed=why)
            output.append_jsonl(jsonls, rec)
            if a.tmpfs_probe:
                tp = tmpfs_floor(a.images, gib, log)
                if tp:
                    tmpfs[gib] = tp
                    output.append_jsonl(jsonls, dict(base, **dict(tp, kind="tmpfs-probe", date=output.iso_now())))

    cfg = ccase.CaseConfig(
        workload=os.path.join(crlib.REPO, "gpu", "mock_workload.py") if a.mock else os.path.join(a.bin, "workload"),
        workload_prefix=[sys.executable] if a.mock else [], plugdir=a.plugdir, images=a.images,
        work=a.work, alloc=a.alloc, chunk_mib=a.chunk_mib, interval_ms=100, ticks_before=3,
        ticks_after=5, verify=a.verify, inspect=True, archive_prefix="bench",
        workload_args=["--reserve-gib", str(a.reserve_gib)] if a.reserve_gib else [])
    os.makedirs(a.images, exist_ok=True)
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    failed = 0
    for gib in a.sizes:
        gib = int(gib) if float(gib).is_integer() else gib
        for path in paths:
            rec = dict(base, date=output.iso_now(), gib=gib, path=path)
            if a.reserve_gib:
                rec.update(case="sparse-%gg-touch-%gg" % (gib + a.reserve_gib, gib),
                           reserve_gib=a.reserve_gib, touched_bytes=int(gib * 2**30))
            # The transparent path (and a split path without zero chunks) saves reserved memory too.
            need = need_gib(path, gib + (a.reserve_gib if path == "transparent" else 0))
            usable, m = usable_gib(a.ram_gib)
            if need > a.ram_gib or need > usable:
                why = "%s %s GiB needs ~%d GiB RAM; usable ~%.0f GiB (MemTotal %.0f, MemAvailable %.0f, nominal %.0f)" % (
                    path, gib, need, usable, m.get("MemTotal", 0), m.get("MemAvailable", 0), a.ram_gib)
                log("SKIP: " + why)
                output.append_jsonl(jsonls, dict(rec, skipped=why))
                continue
            if a.budget_s and time.time() - t_start > a.budget_s:
                why = "time budget of %.0f s spent" % a.budget_s
                log("SKIP %s %s GiB: %s" % (path, gib, why))
                output.append_jsonl(jsonls, dict(rec, skipped=why))
                continue
            r = ccase.run_c_case(cfg, log, path, gib, False, tag="bench")
            rec.update({
                "dump_s": r.get("dump_s"), "restore_s": r.get("restore_s"),
                "image_bytes": r.get("image_bytes"), "identical": bool(r.get("identical")),
                "phases": r.get("phases"), "pass": r["pass"], "problems": r["problems"],
                "first_tick_after_restore_s": r.get("first_tick_after_restore_s"),
                "downtime_s": r.get("downtime_s"), "ready_s": r.get("ready_s"),
                "gpusnap_data_files": r.get("gpusnap_data_files"), "verify_rc": r.get("verify_rc"),
                "alloc": a.alloc, "chunk_mib": a.chunk_mib,
                "dump_gpusnap_lines": r.get("dump_gpusnap_lines"),
                "restore_gpusnap_lines": r.get("restore_gpusnap_lines"),
            })
            if path.startswith("split") and r["pass"] and probes.get(gib):
                rec.update(floor_of(rec, p, probes[gib]))
                if tmpfs.get(gib):
                    rec.update(tmpfs_write_gbps=tmpfs[gib].get("write_gbps"),
                               tmpfs_read_gbps=tmpfs[gib].get("read_gbps"))
            output.append_jsonl(jsonls, rec)
            if not r["pass"]:
                failed += 1

    for jl in jsonls:
        md = jl[:-len(".jsonl")] + ".md"
        cmd = [sys.executable, os.path.join(HERE, "report.py"), jl, "--run", run_id, "-o", md]
        r = subprocess.run(cmd, capture_output=True, text=True)
        log("$ %s -> rc %d %s" % (" ".join(cmd), r.returncode, r.stderr.strip()))
    try:
        with open(jsonls[0][:-len(".jsonl")] + ".md") as f:
            log.block("report", f.read())
    except OSError:
        pass
    log("bench done in %.0f s; %d case(s) failed" % (time.time() - t_start, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
