"""One checkpoint case of the C workload (gpu/workload.cu), shared by gpu/e2e.py and bench/bench.py.

run_c_case() starts the workload on one path (split: agent preloaded; transparent: without),
waits for `ready` and some ticks, runs `criu dump` (or `criu dump -R`), then either restores
the image and lets it tick on, or lets the left-running process tick on, checks the tick log
(ticklog.check_ticks) and returns a record. It never raises: any failure is a FAIL record, and
the processes it started are killed and their PIDs waited free.
"""

import json
import os
import re
import shutil
import subprocess
import time

from crlib import criu, machine, output, procs, ticklog


class CaseConfig:
    def __init__(self, **kw):
        self.workload = kw.get("workload", "/tmp/gpusnap-bin/workload")
        self.workload_prefix = kw.get("workload_prefix", [])  # e.g. [python3] for the mock
        self.plugdir = kw.get("plugdir", "/tmp/gpusnap-plugins")
        self.images = kw.get("images", "/dev/shm/gpusnap-e2e")
        self.work = kw.get("work", "/tmp/gpusnap-work")
        self.alloc = kw.get("alloc", "driver")
        self.chunk_mib = kw.get("chunk_mib", 1024)
        self.interval_ms = kw.get("interval_ms", 100)
        self.ticks_before = kw.get("ticks_before", 3)
        self.ticks_after = kw.get("ticks_after", 5)
        self.verify = kw.get("verify", True)
        self.inspect = kw.get("inspect", True)
        self.keep_images = kw.get("keep_images", False)
        self.archive_prefix = kw.get("archive_prefix", "e2e")
        # split: the hand-over (data drained beside CRIU's dump); split-copyfirst: the same
        # agent with handover = false (data copied out before the driver checkpoint).
        # split-async: the hand-over with async_leave_running (-R only: CRIU returns once the
        # keeper has a snapshot; a drainer writes the image after, `gpusnap wait` says when).
        self.modes = kw.get("modes", {"split": "auto", "split-copyfirst": "auto",
                                      "split-async": "auto", "transparent": "transparent"})
        self.criu_env = kw.get("criu_env", {"split-copyfirst": {"GPUSNAP_HANDOVER": "0"},
                                            "split-async": {"GPUSNAP_ASYNC_LEAVE_RUNNING": "1"}})
        self.devices = kw.get("devices")  # workload --devices (e.g. "0,1"); None: its default
        self.restore_env = kw.get("restore_env", {})  # e.g. {"GPUSNAP_DEVICE_MAP": "..."}
        self.workload_args = kw.get("workload_args", [])  # e.g. ["--reserve-gib", "92"]


def _ticks(wlog):
    return ticklog.parse_workload_log(wlog)


def run_c_case(cfg, log, path, gib, leave_running, tag="e2e"):
    kind = "leave" if leave_running else "dump"
    name = "%s-%s-%sg-%s" % (tag, path, gib, kind)
    imgdir = os.path.join(cfg.images, name)
    wlog, wout = procs.fresh_workload_files(cfg.work, name)
    shutil.rmtree(imgdir, ignore_errors=True)
    mode = cfg.modes.get(path)
    rec = {"case": name, "path": path, "gib": gib, "leave_running": leave_running,
           "alloc": cfg.alloc, "chunk_mib": cfg.chunk_mib, "mode_env": mode, "pass": False,
           "problems": []}
    log("=" * 78)
    log("CASE %s: path %s, %s GiB, %s, alloc %s, GPUSNAP_MODE=%s" % (
        name, path, gib, "criu dump -R (leave running)" if leave_running else "criu dump + restore",
        cfg.alloc, mode))
    m = machine.meminfo_gib()
    log("meminfo: MemTotal %.1f GiB MemAvailable %.1f GiB Shmem %.1f GiB" % (
        m.get("MemTotal", 0), m.get("MemAvailable", 0), m.get("Shmem", 0)))
    popen = None
    rpid = None
    pids = []
    t_case = time.time()
    try:
        cmd = list(cfg.workload_prefix) + [
            cfg.workload, "--gib", str(gib), "--chunk-mib", str(cfg.chunk_mib), "--alloc", cfg.alloc,
            "--log", wlog, "--interval-ms", str(cfg.interval_ms)] + list(cfg.workload_args)
        if cfg.devices is not None:
            cmd += ["--devices", cfg.devices]
        popen = procs.start_process(cmd, wout, procs.workload_env(path), log)
        t0 = time.time()
        ok = procs.wait_until(lambda: _ticks(wlog)[0] is not None, 90 + 3 * float(gib), proc=popen)
        ready, ticks, errors = _ticks(wlog)
        if not ok or ready is None:
            raise CaseError("workload not ready after %.1f s (exit code %s)" % (
                time.time() - t0, popen.poll()))
        log("ready after %.2f s: %s" % (time.time() - t0, " ".join(
            "%s=%s" % kv for kv in sorted(ready.items()))))
        rec["ready_s"] = round(time.time() - t0, 3)
        if int(ready.get("pid", popen.pid)) != popen.pid:
            log("WARNING: workload reports pid %s, Popen pid %d" % (ready.get("pid"), popen.pid))
        pid = popen.pid
        if not procs.wait_until(lambda: len(_ticks(wlog)[1]) >= cfg.ticks_before, 30, proc=popen):
            raise CaseError("fewer than %d ticks before the dump" % cfg.ticks_before)
        ready, ticks, errors = _ticks(wlog)
        pre = ticklog.check_ticks(ready, ticks, errors)
        if not pre["pass"]:
            raise CaseError("ticks already bad before the dump: %s" % pre["problems"][:5])
        pids = procs.tree_tids(pid)
        if cfg.devices is not None:
            rec["gpus_before"] = machine.gpus_of_pids([pid])
            log("pid %d holds memory on GPUs %s" % (pid, rec["gpus_before"]))
        log("pid %d, %d threads; %d ticks before dump; last: %s" % (
            pid, len(pids), len(ticks), ticks[-1]))

        dump = criu.criu_dump(pid, imgdir, cfg.plugdir, mode, log, leave_running=leave_running,
                               timeout=300 + 10 * float(gib), env=cfg.criu_env.get(path))
        rec["dump_s"] = round(dump["secs"], 3)
        rec["dump_rc"] = dump["rc"]
        rec["dump_gpusnap_lines"] = dump["gpusnap_lines"]
        img = criu.image_stats(imgdir)
        rec.update({k: img[k] for k in ("image_bytes", "image_alloc_bytes", "n_files",
                                        "gpusnap_data_files", "gpusnap_manifests")})
        log("image dir %s: %d files, %.3f GiB (%.3f GiB allocated); gpusnap data files %d, "
            "manifests %d; largest %s" % (imgdir, img["n_files"], img["image_bytes"] / 2**30,
                                          img["image_alloc_bytes"] / 2**30, img["gpusnap_data_files"],
                                          img["gpusnap_manifests"], img["largest"][:6]))
        stats = criu.read_stats_json(imgdir)
        rec["phases"] = stats
        if stats is not None:
            log.block("gpusnap-stats.json", json.dumps(stats, indent=1), max_lines=80)
        else:
            log("(no gpusnap-stats.json in %s)" % imgdir)
        if dump["rc"] != 0:
            raise CaseError("criu dump failed with rc %d" % dump["rc"])
        if img["gpusnap_data_files"] == 0 and path.startswith("split"):
            rec["problems"].append("split path not taken: no gpusnap-*-data-*.img in the image dir")
        rec["handover"] = any("lent to keeper" in l for l in dump["gpusnap_lines"])
        # The record field: "handoff" (lent to the keeper), "copy" or "mixed".
        rec["data_path"] = criu.data_path(dump["gpusnap_lines"])
        for l in dump["gpusnap_lines"]:
            m = re.search(r"the drain ran ([0-9.]+) s beside CRIU's dump; at CRIU's end "
                          r"\(([0-9.]+) s after the hand-over\) it waited ([0-9.]+) s", l)
            if m:
                rec["drain_s"], rec["criu_part_s"], rec["drain_wait_s"] = map(float, m.groups())
        if path in ("split", "split-async") and not rec["handover"]:
            rec["problems"].append("hand-over not taken (no 'lent to keeper' line in the dump log)")

        if not leave_running:
            try:
                rc = popen.wait(timeout=30)
                log("dumped workload exited (status %s) as expected" % rc)
            except subprocess.TimeoutExpired:
                raise CaseError("workload still running 30 s after criu dump returned")
            ready, ticks, errors = _ticks(wlog)
            n_dump = len(ticks)
            log("%d ticks at dump; last: %s" % (n_dump, ticks[-1] if ticks else None))
            if not procs.wait_pids_free(pids, 60, log):
                raise CaseError("dumped pids still in use 60 s after the dump")
            if cfg.verify:
                vrc, vout = criu.gpusnap_cli(["verify", imgdir], log)
                rec["verify_rc"] = vrc
                if vout.strip():
                    log.block("gpusnap verify", vout, max_lines=40)
                if vrc not in (0, None):
                    msg = "gpusnap verify rc %s" % vrc
                    if path.startswith("split"):
                        rec["problems"].append(msg)
                    else:
                        log("(transparent path: %s, not counted as a failure)" % msg)
            if cfg.inspect:
                irc, iout = criu.gpusnap_cli(["inspect", imgdir, "--json"], log)
                if iout:
                    ipath = os.path.join(cfg.work, name + "-inspect.json")
                    with open(ipath, "w") as f:
                        f.write(iout)
                    log.block("gpusnap inspect --json (head)", iout, max_lines=60)
                    output.archive_add([ipath], "%s/%s" % (cfg.archive_prefix, name), log)
            restore = criu.criu_restore(imgdir, cfg.plugdir, mode, log,
                                         timeout=300 + 10 * float(gib),
                                         env=dict(cfg.criu_env.get(path, {}), **cfg.restore_env))
            rec["restore_s"] = round(restore["secs"], 3)
            rec["restore_rc"] = restore["rc"]
            rec["restore_gpusnap_lines"] = restore["gpusnap_lines"]
            rpid = restore["pid"]
            log("restored pid %s (dumped pid %d), alive %s" % (
                rpid, pid, procs.alive(rpid) if rpid else None))
            if restore["rc"] != 0:
                raise CaseError("criu restore failed with rc %d" % restore["rc"])
            if cfg.devices is not None:
                rec["gpus_after"] = machine.gpus_of_pids([rpid])
                log("restored pid %s holds memory on GPUs %s" % (rpid, rec["gpus_after"]))
            stats2 = criu.read_stats_json(imgdir)
            if stats2 is not None and stats2 != stats:
                rec["phases"] = stats2
            # Which way the data came back: "handoff" (loaded by a keeper beside the restore,
            # then handed to the job) or "copy" (loaded by the job's agent after the unlock).
            rprocs = ((stats2 or {}).get("restore") or {}).get("processes") or []
            rpaths = sorted({p.get("data_path") for p in rprocs if p.get("data_path")})
            rec["restore_data_path"] = ",".join(rpaths) if rpaths else None
            hand = [p["timings_s"]["handover"] for p in rprocs
                    if "handover" in p.get("timings_s", {})]
            if hand:
                rec["restore_handover_s"] = max(hand)
            if path == "split" and rpaths != ["handoff"]:
                rec["problems"].append("restore hand-over not taken (restore data_path %s)"
                                       % (rpaths or None))
            if stats2 is not None and stats2 != stats:
                log.block("gpusnap-stats.json after restore", json.dumps(stats2, indent=1),
                          max_lines=80)
            need = n_dump + cfg.ticks_after
            got = procs.wait_until(lambda: len(_ticks(wlog)[1]) >= need,
                                   30 + 5 * cfg.ticks_after * cfg.interval_ms / 1000.0)
            ready, ticks, errors = _ticks(wlog)
            if len(ticks) > n_dump:
                rec["first_tick_after_restore_s"] = round(
                    ticks[n_dump]["us"] / 1e6 - restore["end"], 3)
            chk = ticklog.check_ticks(ready, ticks, errors, need_after=cfg.ticks_after,
                                    after_index=n_dump, window=(dump["start"], restore["end"]))
            if not got:
                log("only %d of %d ticks after restore" % (len(ticks), need))
            rec["downtime_s"] = chk.get("gap_s")
        else:
            n_dump = len(_ticks(wlog)[1])
            need = n_dump + cfg.ticks_after
            got = procs.wait_until(lambda: len(_ticks(wlog)[1]) >= need,
                                   30 + 5 * cfg.ticks_after * cfg.interval_ms / 1000.0, proc=popen)
            ready, ticks, errors = _ticks(wlog)
            chk = ticklog.check_ticks(ready, ticks, errors, need_after=cfg.ticks_after,
                                    after_index=n_dump, window=(dump["start"], dump["end"]))
            rec["pause_s"] = chk.get("pause_s")
            rec["max_gap_s"] = chk.get("gap_s")
            if path == "split-async":
                _wait_async_image(rec, log, imgdir, dump, gib)
            if popen.poll() is not None:
                rec["problems"].append("workload exited (status %s) after criu dump -R" % popen.poll())
        rec["check"] = {k: v for k, v in chk.items() if k != "problems"}
        rec["identical"] = chk["pass"]
        lo = max(0, n_dump - 2)
        log("ticks around the dump / after it:")
        for t in ticks[lo:lo + 2 + cfg.ticks_after + 1]:
            log("  tick %(tick)d counter %(counter)d state %(state)016x sum %(sum)016x ok %(ok)d "
                "err %(err)d us %(us)d dt_us %(dt_us)d" % t)
        log("checker: %s; %d ticks, %d after the dump; median gap %s s; gap around dump %s s "
            "(ticks %s); pause %s s" % (
                "PASS" if chk["pass"] else "FAIL", chk["n_ticks"], chk["ticks_after"],
                chk["median_gap_s"], chk.get("gap_s"), chk.get("gap_ticks"), chk.get("pause_s")))
        for p in chk["problems"]:
            log("  checker problem: %s" % p)
        rec["problems"].extend("checker: " + p for p in chk["problems"])
    except Exception as e:
        output.note_failure(rec, log, e, expected=CaseError)
    finally:
        if path.startswith("split"):
            criu.log_agent_lines(log, wout)
        if rec["problems"]:
            log.file_tail("workload log", wlog, 30)
            log.file_tail("workload stdout/stderr", wout, 30)
            for what in ("dump", "restore"):
                p = os.path.join(imgdir, what + ".log")
                if os.path.exists(p):
                    log.file_tail("criu %s.log" % what, p, 30)
        # Kill whatever is left: the left-running or restored process, or a workload after a
        # failed dump, and wait until its PIDs are free for the next case.
        targets = [x for x in {rpid, popen.pid if popen else None} if x]
        if targets:
            still = [t for t in targets if procs.alive(t)]
            if still:
                log("killing %s" % still)
            procs.kill_and_wait(targets, log, wait_pids=targets + pids, popen=popen)
        saved = criu.save_criu_logs(imgdir, cfg.work, name)
        sj = os.path.join(imgdir, "gpusnap-stats.json")
        if os.path.exists(sj):
            q = os.path.join(cfg.work, name + "-stats.json")
            shutil.copy(sj, q)
            saved.append(q)
        output.archive_add([wlog, wout] + saved, "%s/%s" % (cfg.archive_prefix, name), log)
        if not cfg.keep_images:
            shutil.rmtree(imgdir, ignore_errors=True)
    rec["pass"] = not rec["problems"]
    rec["case_s"] = round(time.time() - t_case, 1)
    log("RESULT %s: %s%s" % (name, "PASS" if rec["pass"] else "FAIL",
                             "" if rec["pass"] else " (%s)" % "; ".join(rec["problems"][:4])))
    return rec


def _wait_async_image(rec, log, imgdir, dump, gib):
    """An asynchronous -R: the image is complete only when `gpusnap wait` says so; then verify."""
    rec["async"] = any("drainer pid" in l for l in dump["gpusnap_lines"])
    # The per-allocation choice: how much went into the snapshot, how much on the pause, and why.
    rec["async_plan"] = next((l for l in dump["gpusnap_lines"]
                              if "asynchronous -R per allocation" in l), None)
    if not rec["async"]:
        rec["problems"].append("asynchronous -R not taken (no 'drainer pid' line in the dump log)")
    wrc, wout = criu.gpusnap_cli(["wait", imgdir, "--timeout", str(int(120 + 5 * float(gib)))],
                                 log, timeout=int(180 + 5 * float(gib)))
    rec["async_wait_rc"] = wrc
    rec["async_complete_after_dump_s"] = round(time.time() - dump["end"], 3)
    if wout.strip():
        log.block("gpusnap wait", wout, max_lines=20)
    if wrc != 0:
        rec["problems"].append("gpusnap wait rc %s" % wrc)
        return
    vrc, vout = criu.gpusnap_cli(["verify", imgdir], log)
    rec["verify_rc"] = vrc
    if vout.strip():
        log.block("gpusnap verify", vout, max_lines=40)
    if vrc != 0:
        rec["problems"].append("gpusnap verify rc %s after the asynchronous drain" % vrc)


class CaseError(Exception):
    pass
