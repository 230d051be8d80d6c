"""JAX in its default configuration through gpusnap (issue 14: "JAX in its default configuration
on the split path"); run by gpu/jax_case.sh.

JAX preallocates 75% of the GPU at start (XLA_PYTHON_CLIENT_PREALLOCATE defaults to true,
MEM_FRACTION to 0.75): about 105 GiB on an H200, of which this job (gpu/jax_work.py) touches
about --gib 4. The split path records chunks that were never written as zero chunks and does not
copy them, so the dump should be about as small and fast as a 4 GiB job's. The job's environment
has every XLA_PYTHON_CLIENT_* variable removed (recorded), so the configuration is JAX's own.

Per path (--paths, default split,transparent; split = the agent preloaded, GPUSNAP_MODE=auto;
transparent = without, GPUSNAP_MODE=transparent):
  1. a reference run of the job, uninterrupted (per path, as gpu/torch_cases.py does);
  2. the job again; when its output has --trigger step lines: the GPU memory it holds
     (nvidia-smi --query-compute-apps used_memory), criu dump (timed), the image's size (every
     file in the image dir but logs), gpusnap-stats.json; reap, PIDs free, criu restore
     --restore-detached (timed), the restored job's GPU memory, wait for it to finish;
  3. the outputs compared line by line with the reference: "identical" is computed.
The transparent path needs the whole reservation in host RAM twice (the driver's checkpoint in the
process, then the image on /dev/shm): when that does not fit in MemAvailable (an estimate from
the split case's reservation, or 75% of the GPU), the case is recorded as skipped with the
numbers, unless --transparent-anyway, which runs it and records what happens.

Records (one per path) to $OUT/NAME.jsonl and bench/results/NAME.jsonl (NAME default
jax-default-h200): case "jax-default", path, identical, pass, problems, dump_s, restore_s,
image_bytes, data (bytes_zero, chunks_zero, bytes_written, chunks, device_bytes from
gpusnap-stats.json, summed over processes), gpu_used_mib (at the dump) and
gpu_used_mib_restored, jax_bytes_limit / jax_bytes_reserved (the job's memory_stats), the
removed XLA variables, phases, run, date, gpu, driver, build (.devcarry/COMMIT), machine.
--mock: the job on the CPU (JAX_PLATFORMS=cpu, small sizes), results only in $OUT; the GPU-only
checks (split path taken) become notes.
Log: $OUT/jax.log; per-case logs in $OUT/logs.tar.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from crlib import DEVCARRY, criu, machine, output, procs  # noqa: E402
from torch_cases import read_output, remove_outputs, wait_exit  # noqa: E402 (no torch imported)

WORK = os.path.join(HERE, "jax_work.py")
XLA_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "TF_GPU_ALLOCATOR")
MOCK_ARGS = ["--gib", "0.03", "--dim", "256", "--batch", "64", "--steps", "60", "--interval-ms", "30"]


class CaseError(Exception):
    pass


def smi_used_mib(pid):
    """GPU memory (MiB) that nvidia-smi lists for pid, or None."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    total = None
    for line in r.stdout.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            total = (total or 0) + int(parts[1])
    return total


def gpu_total_mib():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return int(r.stdout.strip().splitlines()[0])
    except Exception:  # noqa: BLE001
        return None


def build_id():
    try:
        with open(os.path.join(DEVCARRY, "COMMIT")) as f:
            return f.read().strip()[:12] or None
    except OSError:
        return None


def harness_commit():
    try:
        r = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def ready_fields(ready):
    words = (ready or "").split()
    return dict(zip(words[1::2], words[2::2]))


def data_stats(phases):
    """gpusnap's data counters of a dump, summed over its processes."""
    keys = ("bytes_zero", "chunks_zero", "bytes_written", "chunks", "device_bytes", "bytes_referenced")
    out = {}
    for p in (phases or {}).get("processes") or []:
        for k in keys:
            v = (p.get("data") or {}).get(k)
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out


class Runner:
    def __init__(self, a, log, mi, base, jsonls):
        self.a, self.log, self.mi, self.base, self.jsonls = a, log, mi, base, jsonls
        self.refs = {}
        self.split_used_mib = None
        # JAX's memory settings as JAX sets them: none of these reach the job
        self.removed = {k: os.environ[k] for k in XLA_VARS if k in os.environ}
        os.makedirs(a.work, exist_ok=True)
        os.makedirs(a.images, exist_ok=True)

    def cmd(self, out):
        args = MOCK_ARGS if self.a.mock else ["--gib", str(self.a.gib), "--steps", str(self.a.steps),
                                              "--interval-ms", str(self.a.interval_ms)]
        return [self.a.python, WORK, "--out", out] + args

    def trigger(self):
        return 20 if self.a.mock else self.a.trigger

    def env(self, path):
        env = procs.workload_env(path)
        for k in XLA_VARS:
            env.pop(k, None)
        env["PYTHONUNBUFFERED"] = "1"
        if self.a.mock:
            env["JAX_PLATFORMS"] = "cpu"
        return env

    def reference(self, path):
        if path in self.refs:
            return self.refs[path]
        log = self.log
        out = os.path.join(self.a.work, "ref-jax-%s.out" % path)
        remove_outputs(out)
        t0 = time.time()
        p = procs.start_process(self.cmd(out), out + ".stdout", self.env(path), log)
        try:
            rc = p.wait(timeout=self.a.run_timeout)
        except subprocess.TimeoutExpired:
            procs.kill_and_wait([p.pid], log, popen=p)
            rc = "timeout"
        o = read_output(out)
        ok = rc == 0 and o[3] is not None
        log("reference (%s): rc %s in %.1f s, %d values%s; %s" % (
            path, rc, time.time() - t0, len(o[0]), "" if ok else " (INCOMPLETE)", o[2]))
        if not ok:
            log.file_tail("reference stdout", out + ".stdout", 40)
        output.archive_add([out, out + ".stdout"], "jax/ref-%s" % path, log)
        self.refs[path] = {"ok": ok, "rc": rc, "secs": time.time() - t0, "out": o}
        return self.refs[path]

    def transparent_fits(self):
        """(fits, why): the transparent dump holds the reservation twice in host RAM."""
        used = self.split_used_mib
        how = "the split case's reservation"
        if used is None:
            total = gpu_total_mib()
            used = int(0.75 * total) if total else None
            how = "75% of the GPU"
        if used is None:
            return True, "reservation unknown"
        need = 2 * used / 1024 + 6
        avail = machine.meminfo_gib().get("MemAvailable", 0)
        why = "needs ~%.0f GiB of host RAM (2 x %.0f GiB reserved, %s, + 6) ; MemAvailable %.0f GiB" % (
            need, used / 1024, how, avail)
        return need <= avail, why

    def case(self, path):
        a, log = self.a, self.log
        rec = dict(self.base, date=output.iso_now(), case="jax-default", path=path, identical=False,
                   dump_s=None, restore_s=None, image_bytes=None, problems=[], notes=[], **{"pass": False})
        log("=" * 78)
        log("CASE jax-default-%s" % path)
        t_case = time.time()
        if path == "transparent" and not a.mock:
            fits, why = self.transparent_fits()
            rec["ram_check"] = why
            if not fits and not a.transparent_anyway:
                rec["skipped"] = "transparent path " + why + " (--transparent-anyway runs it)"
                log("SKIP: " + rec["skipped"])
                return self.finish(rec, t_case)
            log("RAM check: %s%s" % (why, "" if fits else "; running anyway (--transparent-anyway)"))
        ref = self.reference(path)
        rec["ref_s"] = round(ref["secs"], 2)
        rec["removed_env"] = self.removed
        if not ref["ok"]:
            rec["problems"].append("reference run failed (rc %s)" % ref["rc"])
            return self.finish(rec, t_case)
        tag = "jax-default-%s" % path
        out = os.path.join(a.work, tag + ".out")
        remove_outputs(out)
        imgdir = os.path.join(a.images, tag)
        shutil.rmtree(imgdir, ignore_errors=True)
        mode = {"split": "auto", "transparent": "transparent"}[path]
        popen, rpid, pids = None, None, []
        try:
            popen = procs.start_process(self.cmd(out), out + ".stdout", self.env(path), log)
            trig = self.trigger()
            if not procs.wait_until(lambda: len(read_output(out)[0]) >= trig, a.run_timeout, poll=0.02,
                                    proc=popen):
                raise CaseError("output never reached %d lines before the dump (exit %s)" % (trig, popen.poll()))
            pids = procs.tree_tids(popen.pid)
            rf = ready_fields(read_output(out)[2])
            rec.update(jax=rf.get("jax"), jax_device=rf.get("device"), jax_bytes_limit=rf.get("bytes_limit"),
                       jax_bytes_reserved=rf.get("bytes_reserved"), state_bytes=rf.get("state_bytes"),
                       preallocate=rf.get("preallocate"), mem_fraction=rf.get("mem_fraction"))
            rec["gpu_used_mib"] = smi_used_mib(popen.pid)
            rec["gpu_used_smi_gib"] = machine.gpu_used_gib()
            if path == "split":
                self.split_used_mib = rec["gpu_used_mib"]
            log("trigger reached (%d lines); %d tasks/threads; the job holds %s MiB of GPU memory "
                "(JAX bytes_limit %s, reserved %s)" % (len(read_output(out)[0]), len(pids), rec["gpu_used_mib"],
                                                      rec["jax_bytes_limit"], rec["jax_bytes_reserved"]))
            dump = criu.criu_dump(popen.pid, imgdir, a.plugdir, mode, log, timeout=a.criu_timeout)
            rec["dump_s"] = round(dump["secs"], 3)
            rec["dump_gpusnap_lines"] = dump["gpusnap_lines"]
            img = criu.image_stats(imgdir)
            rec["image_bytes"] = img["image_bytes"]
            rec["image_alloc_bytes"] = img["image_alloc_bytes"]
            rec["gpusnap_data_files"] = img["gpusnap_data_files"]
            rec["phases"] = criu.read_stats_json(imgdir)
            rec["data"] = data_stats(rec["phases"])
            log("image: %.3f GiB in %d files, gpusnap data files %d; largest %s; data %s" % (
                img["image_bytes"] / 2**30, img["n_files"], img["gpusnap_data_files"], img["largest"][:5],
                rec["data"]))
            if dump["rc"] != 0:
                raise CaseError("criu dump rc %d" % dump["rc"])
            if path == "split" and img["gpusnap_data_files"] == 0:
                msg = "split path not taken: no gpusnap-*-data-*.img in the image dir"
                (rec["notes"] if a.mock else rec["problems"]).append(msg)
            try:
                popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise CaseError("job still running 30 s after criu dump")
            if not procs.wait_pids_free(pids, 60, log):
                raise CaseError("dumped pids still in use after 60 s")
            restore = criu.criu_restore(imgdir, a.plugdir, mode, log, timeout=a.criu_timeout)
            rec["restore_s"] = round(restore["secs"], 3)
            rec["restore_gpusnap_lines"] = restore["gpusnap_lines"]
            rpid = restore["pid"]
            if restore["rc"] != 0:
                raise CaseError("criu restore rc %d" % restore["rc"])
            rec["gpu_used_mib_restored"] = smi_used_mib(rpid)
            st2 = criu.read_stats_json(imgdir)
            if st2:
                rec["phases"] = st2
            rc = wait_exit(rpid, a.run_timeout)
            log("restored job (pid %s, %s MiB on the GPU after the restore) exited with %s" % (
                rpid, rec["gpu_used_mib_restored"], rc))
            if rc not in (0, None):
                rec["problems"].append("restored job exit status %s" % rc)
            self.compare(rec, ref["out"], read_output(out))
        except CaseError as e:
            rec["problems"].append(str(e))
            log("CASE ERROR: %s" % e)
        except Exception:  # noqa: BLE001 (recorded, the next path runs)
            tb = output.format_exc()
            rec["problems"].append("exception: " + tb.strip().splitlines()[-1])
            log.block("exception", tb)
        finally:
            if path == "split":
                criu.log_agent_lines(log, out + ".stdout", 20)
            if rec["problems"]:
                log.file_tail("job stdout", out + ".stdout", 40)
                for what in ("dump", "restore"):
                    pth = os.path.join(imgdir, what + ".log")
                    if os.path.exists(pth):
                        log.file_tail("criu %s.log" % what, pth, 30)
            targets = [x for x in {rpid, popen.pid if popen else None} if x]
            if targets:
                procs.kill_and_wait(targets, log, wait_pids=targets + pids, popen=popen)
            saved = criu.save_criu_logs(imgdir, a.work, tag)
            output.archive_add([out, out + ".stdout"] + saved, "jax/" + tag, log)
            if not a.keep_images:
                shutil.rmtree(imgdir, ignore_errors=True)
        return self.finish(rec, t_case)

    def compare(self, rec, ro, co):
        rv, cv = ro[0], co[0]
        identical = rv == cv and co[3] is not None
        rec["identical"] = identical
        rec["values"] = [len(rv), len(cv)]
        if not identical:
            first = next((i for i in range(min(len(rv), len(cv))) if rv[i] != cv[i]), None)
            msg = "output differs: %d reference values, %d checkpointed, first mismatch at %s" % (
                len(rv), len(cv), first)
            if first is not None:
                msg += " (ref %s, got %s)" % (rv[first], cv[first])
            if co[3] is None:
                msg += "; no done line"
            rec["problems"].append(msg)
        ts = co[1]
        gaps = sorted(ts[i + 1] - ts[i] for i in range(len(ts) - 1))
        if gaps:
            rec["downtime_s"] = round(gaps[-1] - gaps[len(gaps) // 2], 3)  # largest gap less the median
        self.log("compare: identical %s; values %s (reference, checkpointed); downtime %s s" % (
            identical, rec["values"], rec.get("downtime_s")))

    def finish(self, rec, t_case):
        if not rec.get("skipped") and not rec["identical"] and not rec["problems"]:
            rec["problems"].append("outputs not identical")
        rec["pass"] = not rec.get("skipped") and not rec["problems"]
        rec["case_s"] = round(time.time() - t_case, 1)
        output.append_jsonl(self.jsonls, rec)
        d = rec.get("data") or {}
        self.log("RESULT jax-default-%s: %s identical=%s dump_s=%s restore_s=%s image %.2f GiB, zero %.1f GiB "
                 "in %s chunks, written %.2f GiB; GPU %s MiB%s" % (
                     rec["path"], "SKIP" if rec.get("skipped") else ("PASS" if rec["pass"] else "FAIL"),
                     rec["identical"], rec["dump_s"], rec["restore_s"], (rec.get("image_bytes") or 0) / 2**30,
                     d.get("bytes_zero", 0) / 2**30, d.get("chunks_zero"), d.get("bytes_written", 0) / 2**30,
                     rec.get("gpu_used_mib"), "" if rec["pass"] else " (%s)" % "; ".join(
                         rec["problems"][:3] or [rec.get("skipped", "")])))
        return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="split,transparent", help="comma list, in order (default split,transparent)")
    ap.add_argument("--name", default="jax-default-h200")
    ap.add_argument("--images", default="/dev/shm/gpusnap-jax")
    ap.add_argument("--work", default="/tmp/gpusnap-work/jax")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--python", default=sys.executable, help="python that runs the job (with jax)")
    ap.add_argument("--gib", type=float, default=4, help="the job's state in GiB (default 4)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--trigger", type=int, default=100, help="dump after this many step lines")
    ap.add_argument("--interval-ms", type=float, default=20)
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--criu-timeout", type=float, default=300)
    ap.add_argument("--transparent-anyway", action="store_true",
                    help="run the transparent path even when it does not fit in host RAM")
    ap.add_argument("--keep-images", action="store_true")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new path after this many s")
    ap.add_argument("--mock", action="store_true", help="the job on the CPU (harness test, results only in $OUT)")
    a = ap.parse_args()
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    for p in paths:
        if p not in ("split", "transparent"):
            ap.error("unknown path %s" % p)

    t_start = time.time()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-%d" % os.getpid()
    out, log, mi = output.start_run("jax", "jax case run %s: %s" % (run_id, " ".join(sys.argv)), a.plugdir)
    jsonls = output.result_files(out, a.name, a.mock)
    base = {"run": run_id, "gpu": mi.get("gpu"), "driver": mi.get("driver"), "build": build_id(),
            "harness": harness_commit(), "cmdline": " ".join(sys.argv), "mock": a.mock,
            "machine": {k: mi.get(k) for k in ("cpus", "ram_gib", "kernel", "gpu_mem", "criu", "shm_options")}}
    log("paths %s, python %s, build %s" % (paths, a.python, base["build"]))
    r = Runner(a, log, mi, base, jsonls)
    results = []
    for path in paths:
        if a.budget_s and time.time() - t_start > a.budget_s:
            rec = dict(base, date=output.iso_now(), case="jax-default", path=path,
                       skipped="time budget of %.0f s spent" % a.budget_s)
            output.append_jsonl(jsonls, rec)
            log("SKIP %s: %s" % (path, rec["skipped"]))
            results.append(rec)
            continue
        results.append(r.case(path))
    failed = [x for x in results if not x.get("skipped") and not x.get("pass")]
    log("jax cases: %d passed, %d failed, %d skipped in %.0f s" % (
        sum(1 for x in results if x.get("pass")), len(failed), sum(1 for x in results if x.get("skipped")),
        time.time() - t_start))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
