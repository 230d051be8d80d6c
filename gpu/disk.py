"""Durable split dumps onto this machine's disk (issue 14, item 6): gpu/workload.cu dumped with
`durable = true` into a directory on the disk, once per `compress` setting, against the disk's
own direct-write bandwidth measured in the same run (`dd oflag=direct`, one stream and 16 at once; the better
is the floor), then restored from a
cold page cache (`drop_caches` first) and checked bit-exact.

    python3 gpu/disk.py [--gib 16] [--dir /var/tmp/gpusnap-disk] [--compress off auto]

For each setting: the dump's wall time, the image's size, and the floor bytes ÷ direct-write
bandwidth (the target is a dump ≤ 1.2 × that). The workload's data (a multiplicative pattern)
does not compress, so `auto` (zstd on a disk) shows what trying costs, not what it saves.
Writes $OUT/disk.log and $OUT/NAME.jsonl (and bench/results/NAME.jsonl; NAME defaults to
disk-h200). Needs root (drop_caches) and a GPU.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crlib import criu, output, procs, ticklog  # noqa: E402


def direct_write_gbps(d, gib, streams, log):
    """GIB GiB of zeros written into d with O_DIRECT and a final fsync by STREAMS dd processes
    at once (one file each, as gpusnap's writers do): GB/s (1e9) and seconds."""
    count = max(1, int(gib * 16 / streams))
    paths = [os.path.join(d, "dd-probe-%d" % i) for i in range(streams)]
    t0 = time.time()
    ps = [subprocess.Popen(["dd", "if=/dev/zero", "of=" + p, "bs=64M", "count=%d" % count,
                            "oflag=direct", "conv=fsync"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True) for p in paths]
    errs = [(p.wait(), p.stderr.read()) for p in ps]
    secs = time.time() - t0
    for p in paths:
        os.unlink(p)
    if any(rc != 0 for rc, _ in errs):
        raise RuntimeError("dd failed: %s" % [e for rc, e in errs if rc != 0][:1])
    log("dd x%d: %s" % (streams, (errs[0][1].strip().splitlines()[-1:] or ["?"])[0]))
    return round(streams * count * 64 * 2**20 / secs / 1e9, 3), round(secs, 3)


def fs_of(d):
    best = ("?", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if d.startswith(mnt.rstrip("/") + "/") or d == mnt:
                if len(mnt) >= len(best[1]) or best[1] == "?":
                    best = (dev, mnt, fstype)
    return {"device": best[0], "mount": best[1], "fstype": best[2]}


def data_stats(imgdir):
    st = criu.read_stats_json(imgdir) or {}
    p = (st.get("processes") or [{}])[0]
    return p.get("data") or {}, p.get("timings_s") or {}


def one(a, compress, dd_gbps, log, mi, version):
    rec = {"run": time.strftime("%Y%m%dT%H%M%S"), "date": output.iso_now(), "gpu": mi.get("gpu"),
           "driver": mi.get("driver"), "machine": mi, "build": version,
           "command": " ".join([sys.executable] + sys.argv), "case": "disk-durable-%s" % compress,
           "path": "split", "gib": a.gib, "compress": compress, "durable": True,
           "dir": a.dir, "fs": fs_of(a.dir), "direct_write_gbps": dd_gbps, "pass": False, "problems": []}
    img = os.path.join(a.dir, "img-%s" % compress)
    shutil.rmtree(img, ignore_errors=True)
    wlog, wout = procs.fresh_workload_files(a.work, "disk-%s" % compress)
    ticks = lambda: ticklog.parse_workload_log(wlog)[1]  # noqa: E731
    popen, pid, rpid, pids = None, None, None, []
    env = {"GPUSNAP_DURABLE": "true", "GPUSNAP_COMPRESS": compress}
    try:
        popen = procs.start_process([a.workload, "--gib", str(a.gib), "--log", wlog], wout,
                                    procs.workload_env("split"), log)
        pid = popen.pid
        if not procs.wait_until(lambda: len(ticks()) >= 3, 120 + 3 * a.gib, proc=popen):
            raise RuntimeError("workload not ticking (exit %s)" % popen.poll())
        pids = procs.tree_tids(pid)
        dump = criu.criu_dump(pid, img, a.plugdir, "auto", log, timeout=300 + 10 * a.gib, env=env)
        rec["dump_s"] = round(dump["secs"], 3)
        if dump["rc"] != 0:
            raise RuntimeError("dump failed with rc %d" % dump["rc"])
        ds, ts = data_stats(img)
        rec["data"] = ds
        rec["timings_s"] = ts
        rec["image_bytes"] = criu.image_stats(img)["image_bytes"]
        rec["floor_s"] = round(rec["image_bytes"] / (dd_gbps * 1e9), 3)
        rec["x_floor"] = round(rec["dump_s"] / rec["floor_s"], 3) if rec["floor_s"] else None
        rec["gpusnap_lines"] = [l for l in criu.gpusnap_lines(os.path.join(img, "dump.log"))
                                if "stored as" in l or "durable" in l][:5]
        popen.wait(timeout=30)
        n_dump = len(ticks())
        if not procs.wait_pids_free(pids, 60, log):
            raise RuntimeError("dumped pids still in use")
        subprocess.run(["sync"])
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        rec["restore_cold_s"], rpid, problems, rec["identical"] = criu.restore_and_check(
            img, a.plugdir, log, wlog, n_dump, 300 + 10 * a.gib)
        rec["problems"].extend("checker: " + p for p in problems)
    except Exception as e:
        rpid = rpid or getattr(e, "pid", None)  # a failed restore's process, to clean up
        output.note_failure(rec, log, e, expected=RuntimeError)
    finally:
        targets = [x for x in {rpid, pid} if x]
        if targets:
            procs.kill_and_wait(targets, log, wait_pids=targets + pids, popen=popen)
        saved = criu.save_criu_logs(img, a.work, "disk-%s" % compress)
        output.archive_add([wlog, wout] + saved, "disk", log)
        shutil.rmtree(img, ignore_errors=True)
    rec["pass"] = not rec["problems"]
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--dir", default="/var/tmp/gpusnap-disk")
    ap.add_argument("--compress", nargs="+", default=["off", "auto"])
    ap.add_argument("--dd-gib", type=float, default=8)
    ap.add_argument("--work", default="/tmp/gpusnap-work/disk")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--name", default="disk-h200")
    ap.add_argument("--budget-s", type=float, default=0, help="accepted for gpu/run-all.sh")
    a = ap.parse_args()
    a.gib = int(a.gib) if float(a.gib).is_integer() else a.gib
    out, log, mi = output.start_run("disk", "gpusnap disk: %s" % " ".join(sys.argv), a.plugdir)
    os.makedirs(a.dir, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    log("image dir %s on %s" % (a.dir, fs_of(a.dir)))
    log(subprocess.run(["df", "-h", a.dir], capture_output=True, text=True).stdout)
    _, version = criu.gpusnap_cli(["-V"], log)
    version = (version or "").strip() or None
    # The disk's direct-write bandwidth: one stream, and as many as gpusnap has writers; the
    # better of the two is the floor.
    dd = {}
    for n in (1, 16):
        dd[n] = direct_write_gbps(a.dir, a.dd_gib, n, log)
        log("direct write, %d stream(s): %.3f GB/s (%s GiB in %.2f s)" % (n, dd[n][0], a.dd_gib, dd[n][1]))
    dd_gbps = max(v[0] for v in dd.values())
    status = 0
    for c in a.compress:
        rec = one(a, c, dd_gbps, log, mi, version)
        rec["direct_write_gbps_by_streams"] = {str(n): v[0] for n, v in dd.items()}
        output.append_jsonl(output.result_files(out, a.name, False), rec)
        log("RESULT disk %s: %s dump %s s (floor %s s, x%s) restore(cold) %s s image %s" % (
            c, "PASS" if rec["pass"] else "FAIL", rec.get("dump_s"), rec.get("floor_s"),
            rec.get("x_floor"), rec.get("restore_cold_s"), rec.get("image_bytes")))
        for p in rec["problems"]:
            log("  problem: %s" % p)
        status |= 0 if rec["pass"] else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
