"""Real workloads through gpusnap (issue "PyTorch jobs, process trees, async allocators").

Each case runs gpu/torch_work.py twice on a path (split: agent preloaded; transparent: without):
an uninterrupted reference run, and a checkpointed run that is dumped in the middle (when its
output has `trigger` lines) and then restored (criu dump + criu restore --restore-detached), or
left running (criu dump -R). The outputs are compared line by line ("identical" is computed,
never assumed). References are cached per (workload, allocator, path) within one invocation.

Cases (--cases, comma list; groups: all, torch1, torch2, quick):
  llama, llama-exp, llama-R   greedy generation, caching allocator default / expandable_segments /
                              default with criu dump -R
  train, train-exp, train-R   forward+backward+AdamW, likewise
  llama-exp-R, train-exp-R    expandable_segments with criu dump -R
  tree, tree-R                a parent with two GPU worker processes (4 GiB each), one dump of the
                              parent takes all; dump+restore / dump -R
  malloc-async                PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  pinned, streams-events, cuda-graph   one small case each
  managed                     64 MiB from cuMemAllocManaged: on the split path the dump must be
                              refused with "managed (unified) memory" in CRIU's log and the job
                              finish identical to its reference; on the transparent path a
                              refusal or a correct checkpoint both pass (the driver decides)
  ipc                         a parent exports 256 KiB with cuIpcGetMemHandle to a child that
                              opens it (CUDA IPC across processes): judged as managed, with
                              "CUDA IPC" in the refusal
  mps                         a compute loop as a client of an MPS daemon started for the case
                              (private pipe directory, quit afterwards): the dump must be refused
                              with "CUDA MPS" on both paths (gpusnap's own check, not the
                              driver's), and an nvidia-cuda-mps-server must have run; skipped
                              where nvidia-cuda-mps-control is missing
--repeat N runs each case N times (the reference once), e.g. to catch a rare hang.
One JSON line per case to $OUT/<name>.jsonl and bench/results/<name>.jsonl:
  {run, date, gpu, driver, workload, path, allocator, leave_running, identical, gpu_gib,
   dump_s, restore_s, pause_s, ...}
Log: $OUT/torch.log; per-case logs (outputs, stdout, criu logs) in $OUT/logs.tar.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from crlib import criu, machine, output, procs  # noqa: E402

WORK = os.path.join(HERE, "torch_work.py")

CASES = {
    # id: (torch_work workload, allocator, leave_running, JSON workload name)
    "llama": ("llama-generate", "default", False, "llama-generate"),
    "llama-exp": ("llama-generate", "expandable", False, "llama-generate"),
    "llama-R": ("llama-generate", "default", True, "llama-generate"),
    "train": ("train", "default", False, "train"),
    "train-exp": ("train", "expandable", False, "train"),
    "train-R": ("train", "default", True, "train"),
    "llama-exp-R": ("llama-generate", "expandable", True, "llama-generate"),
    "train-exp-R": ("train", "expandable", True, "train"),
    "tree": ("tree-parent", "default", False, "process-tree"),
    "tree-R": ("tree-parent", "default", True, "process-tree"),
    "malloc-async": ("malloc-async", "async", False, "malloc-async"),
    "pinned": ("pinned", "default", False, "pinned"),
    "streams-events": ("streams-events", "default", False, "streams-events"),
    "cuda-graph": ("cuda-graph", "default", False, "cuda-graph"),
    # refusal: the dump must fail with the cause named and the job must finish as if untouched
    "managed": ("managed", "default", False, "managed-memory-refused"),
    "ipc": ("ipc-parent", "default", False, "cuda-ipc-refused"),
    "mps": ("plain", "default", False, "mps-refused"),
}
# Cases whose dump gpusnap must refuse: the words its refusal line must contain, and the paths on
# which gpusnap itself must refuse. On the other paths (no agent, the driver decides) a refusal
# or a correct checkpoint both pass.
REFUSED = {
    "managed": ("managed (unified) memory", ("split",)),
    "ipc": ("CUDA IPC", ("split",)),
    "mps": ("CUDA MPS", ("split", "transparent")),
}
# Cases run as clients of an MPS daemon started for them.
NEEDS_MPS = {"mps"}
GROUPS = {
    "all": list(CASES),
    # most telling first: a deadline cuts the tail
    "torch1": ["llama", "train", "llama-R", "train-R", "llama-exp", "train-exp"],
    "torch2": ["tree", "malloc-async", "cuda-graph", "pinned", "streams-events", "tree-R", "managed",
               "ipc", "mps"],
    "quick": ["llama", "train"],
}
ALLOC_CONF = {"default": None, "expandable": "expandable_segments:True",
              "async": "backend:cudaMallocAsync"}

# Workload arguments and the output line count at which the checkpoint is taken.
SIZES = {
    "full": {
        # 18 layers x 2048: 1.06 B parameters (16 layers, 0.95 B, before 2026-11-29 evening)
        "llama-generate": (["--layers", "18", "--hidden", "2048", "--heads", "16", "--inter", "5632",
                            "--vocab", "32000", "--tokens", "400", "--prompt-len", "32"], 100),
        "train": (["--layers", "18", "--hidden", "2048", "--heads", "16", "--inter", "5632",
                   "--vocab", "32000", "--steps", "120", "--batch", "4", "--seq", "512"], 40),
        "tree-parent": (["--gib", "4", "--steps", "100", "--interval-ms", "50"], 30),
        "small": (["--steps", "60", "--interval-ms", "50"], 20),
    },
    "small": {
        "llama-generate": (["--layers", "8", "--hidden", "1024", "--heads", "8", "--inter", "2816",
                            "--vocab", "32000", "--tokens", "200", "--prompt-len", "32"], 50),
        "train": (["--layers", "4", "--hidden", "1024", "--heads", "8", "--inter", "2816",
                   "--vocab", "32000", "--steps", "80", "--batch", "4", "--seq", "256",
                   "--interval-ms", "20"], 25),
        "tree-parent": (["--gib", "1", "--steps", "60", "--interval-ms", "50"], 20),
        "small": (["--steps", "40", "--interval-ms", "50"], 15),
    },
    "tiny": {  # CPU harness test: --device cpu
        "llama-generate": (["--layers", "2", "--hidden", "128", "--heads", "4", "--inter", "256",
                            "--vocab", "1000", "--tokens", "60", "--prompt-len", "8",
                            "--interval-ms", "30"], 15),
        "train": (["--layers", "2", "--hidden", "128", "--heads", "4", "--inter", "256",
                   "--vocab", "1000", "--steps", "40", "--batch", "2", "--seq", "32",
                   "--interval-ms", "30"], 10),
        "tree-parent": (["--gib", "0.01", "--steps", "40", "--interval-ms", "50"], 10),
        "small": (["--steps", "30", "--interval-ms", "50"], 10),
    },
}


def read_output(path):
    """(values, timestamps_s, ready, done) of one torch_work output file."""
    vals, ts, ready, done = [], [], None, None
    try:
        with open(path, "r", errors="replace") as f:
            data = f.read()
    except OSError:
        return vals, ts, ready, done
    lines = data.split("\n")
    if lines and lines[-1] != "":
        lines = lines[:-1]
    for line in lines:
        p = line.split()
        if not p:
            continue
        if p[0] == "v" and len(p) >= 4:
            vals.append(p[2])
            ts.append(int(p[3]) / 1e6)
        elif p[0] == "ready":
            ready = line
        elif p[0] == "done":
            done = dict(zip(p[1::2], p[2::2]))
    return vals, ts, ready, done


def ready_params(ready):
    """The model's parameter count from a `ready ... params N ...` line, or None."""
    words = (ready or "").split()
    for k, w in zip(words, words[1:]):
        if k == "params" and w.isdigit():
            return int(w)
    return None


def output_files(workload, out):
    if workload == "tree-parent":
        return [out + ".w0", out + ".w1"]
    if workload == "ipc-parent":
        return [out, out + ".w0"]
    return [out]


def remove_outputs(out):
    d = os.path.dirname(out)
    base = os.path.basename(out)
    for n in os.listdir(d):
        if n == base or n.startswith(base + "."):
            os.unlink(os.path.join(d, n))


def wait_exit(pid, timeout, popen=None):
    """Waits for pid to exit; returns its exit status if it was our child, else None."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if popen is not None and popen.pid == pid:
            try:
                return popen.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
        try:
            wpid, status = os.waitpid(pid, os.WNOHANG)
            if wpid == pid:
                return os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status
        except ChildProcessError:
            if not procs.alive(pid):
                return None
        time.sleep(0.1)
    raise TimeoutError("pid %d still running after %d s" % (pid, timeout))


class Runner:
    def __init__(self, a, log, mi, run_id, jsonls):
        self.a, self.log, self.mi, self.run_id, self.jsonls = a, log, mi, run_id, jsonls
        self.refs = {}
        self.extra_env = {}  # the MPS daemon's variables while an MPS case runs
        self.attempt = 1
        os.makedirs(a.work, exist_ok=True)
        os.makedirs(a.images, exist_ok=True)

    def cmd(self, workload, out):
        size = SIZES[self.a.size]
        args = size.get(workload, size["small"])[0]
        return [self.a.python, WORK, workload, "--out", out, "--device", self.a.device] + args

    def trigger(self, workload):
        size = SIZES[self.a.size]
        return size.get(workload, size["small"])[1]

    def env(self, path, allocator):
        env = procs.workload_env(path)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if ALLOC_CONF[allocator]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[allocator]
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.extra_env)
        return env

    def collect(self, workload, out):
        res = []
        for f in output_files(workload, out):
            res.append(read_output(f))
        return res

    # ------------------------------------------------------------- reference

    def reference(self, workload, allocator, path):
        # split and split-copyfirst differ only in criu's environment: one reference serves both
        path = "split" if path.startswith("split") else path
        key = (workload, allocator, path, tuple(sorted(self.extra_env.items())))
        if key in self.refs:
            return self.refs[key]
        log = self.log
        tag = "ref-%s-%s-%s" % (workload, allocator, path)
        out = os.path.join(self.a.work, tag + ".out")
        remove_outputs(out)
        t0 = time.time()
        p = procs.start_process(self.cmd(workload, out), out + ".stdout", self.env(path, allocator), log)
        try:
            rc = p.wait(timeout=self.a.run_timeout)
        except subprocess.TimeoutExpired:
            procs.kill_and_wait([p.pid], log, popen=p)
            rc = "timeout"
        secs = time.time() - t0
        outs = self.collect(workload, out)
        ok = rc == 0 and all(o[3] is not None for o in outs)
        log("reference %s: rc %s in %.1f s, %s values%s" % (
            tag, rc, secs, [len(o[0]) for o in outs], "" if ok else " (INCOMPLETE)"))
        if not ok:
            log.file_tail("reference stdout", out + ".stdout", 40)
            for f in output_files(workload, out):
                if f != out:
                    log.file_tail("worker stdout", f + ".stdout", 20)
        files = [out, out + ".stdout"] + [f for f in output_files(workload, out) if f != out]
        files += [f + ".stdout" for f in output_files(workload, out) if f != out]
        output.archive_add(files, "torch/" + tag, log)
        ref = {"ok": ok, "rc": rc, "secs": secs, "outs": outs}
        self.refs[key] = ref
        return ref

    # ---------------------------------------------------------- checkpointed

    def case(self, case_id, path):
        if case_id not in NEEDS_MPS:
            return self.run_case(case_id, path)
        env, why = mps_start(self.a.work, self.log)
        if env is None:
            rec = skipped_record(self.run_id, self.mi, case_id, path, why)
            output.append_jsonl(self.jsonls, rec)
            self.log("SKIP %s-%s: %s" % (case_id, path, why))
            return rec
        self.extra_env = env
        try:
            return self.run_case(case_id, path)
        finally:
            self.extra_env = {}
            mps_stop(env, self.log)

    def run_case(self, case_id, path):
        workload, allocator, leave, jname = CASES[case_id]
        log = self.log
        tag = "%s-%s" % (case_id, path)
        if self.a.repeat > 1:
            tag += "-%d" % self.attempt
        rec = {"run": self.run_id, "date": output.iso_now(), "gpu": self.mi.get("gpu"),
               "driver": self.mi.get("driver"), "workload": jname, "case": case_id, "path": path,
               "allocator": allocator, "leave_running": leave, "identical": False, "gpu_gib": None,
               "dump_s": None, "restore_s": None, "pause_s": None, "pass": False, "problems": []}
        if self.a.repeat > 1:
            rec["attempt"] = self.attempt
        log("=" * 78)
        log("CASE %s: workload %s, path %s, allocator %s (PYTORCH_CUDA_ALLOC_CONF=%s), %s" % (
            tag, workload, path, allocator, ALLOC_CONF[allocator],
            "criu dump -R" if leave else "criu dump + restore"))
        t_case = time.time()
        ref = self.reference(workload, allocator, path)
        rec["ref_s"] = round(ref["secs"], 2)
        if not ref["ok"]:
            rec["problems"].append("reference run failed (rc %s)" % ref["rc"])
            return self.finish(rec, t_case)
        out = os.path.join(self.a.work, tag + ".out")
        remove_outputs(out)
        imgdir = os.path.join(self.a.images, tag)
        shutil.rmtree(imgdir, ignore_errors=True)
        mode = {"split": "auto", "split-copyfirst": "auto", "transparent": "transparent"}[path]
        criu_env = {"GPUSNAP_HANDOVER": "0"} if path == "split-copyfirst" else None
        popen, rpid, pids, dump = None, None, [], None
        try:
            popen = procs.start_process(self.cmd(workload, out), out + ".stdout",
                                        self.env(path, allocator), log)
            trig = self.trigger(workload)
            files = output_files(workload, out)

            def progress():  # every process of the job computing (the IPC child has imported)
                return min(len(read_output(f)[0]) for f in files)

            ok = procs.wait_until(lambda: progress() >= trig, self.a.run_timeout, poll=0.02, proc=popen)
            if not ok:
                raise CaseError("output never reached %d lines before the dump (exit %s)" % (
                    trig, popen.poll()))
            pids = procs.tree_tids(popen.pid)
            rec["gpu_used_smi_gib"] = machine.gpu_used_gib()
            log("trigger reached: %s lines; tree of %d tasks/threads; nvidia-smi used %s GiB" % (
                [len(read_output(f)[0]) for f in files], len(pids), rec["gpu_used_smi_gib"]))
            if self.extra_env:
                rec["mps_processes"] = mps_processes()
                log("MPS processes: %s" % rec["mps_processes"])
                if not any("nvidia-cuda-mps-server" in p for p in rec["mps_processes"]):
                    rec["problems"].append("no nvidia-cuda-mps-server ran: the job is not an MPS client")
            dump = criu.criu_dump(popen.pid, imgdir, self.a.plugdir, mode, log,
                                   leave_running=leave, timeout=self.a.criu_timeout, env=criu_env)
            rec["dump_s"] = round(dump["secs"], 3)
            img = criu.image_stats(imgdir)
            rec["image_bytes"] = img["image_bytes"]
            rec["gpusnap_data_files"] = img["gpusnap_data_files"]
            rec["phases"] = criu.read_stats_json(imgdir)
            rec["dump_gpusnap_lines"] = dump["gpusnap_lines"]
            rec["data_path"] = criu.data_path(dump["gpusnap_lines"])
            log("image: %.3f GiB in %d files, gpusnap data files %d; largest %s" % (
                img["image_bytes"] / 2**30, img["n_files"], img["gpusnap_data_files"], img["largest"][:5]))
            refused = dump["rc"] != 0
            if case_id in REFUSED:
                words, enforced = REFUSED[case_id]
                rec["refused"] = refused
                why = [l for l in dump["gpusnap_lines"] if words in l]
                rec["refusal_line"] = why[0].strip() if why else None
                log("refusal case: dump rc %d, refusal line %s" % (dump["rc"], rec["refusal_line"]))
                if path in enforced and not (refused and why):
                    rec["problems"].append("%s path: dump not refused with a line naming %r" % (path, words))
                if refused:
                    rc = wait_exit(popen.pid, self.a.run_timeout, popen=popen)
                    log("job after the refused dump exited with %s" % rc)
                    if rc != 0:
                        rec["problems"].append("job exit status %s after the refused dump" % rc)
                    outs = self.collect(workload, out)
                    self.compare(rec, ref["outs"], outs, dump)
                    return self.finish(rec, t_case)
            elif refused:
                raise CaseError("criu dump rc %d" % dump["rc"])
            if path.startswith("split") and img["gpusnap_data_files"] == 0:
                log("WARNING: split path: no gpusnap data images (the agent took no allocation; "
                    "the driver checkpoint carried the data)")
                rec["split_taken"] = False
            elif path.startswith("split"):
                rec["split_taken"] = True
            if leave:
                rc = wait_exit(popen.pid, self.a.run_timeout, popen=popen)
                log("left-running job exited with %s" % rc)
                if rc != 0:
                    rec["problems"].append("job exit status %s after criu dump -R" % rc)
            else:
                try:
                    popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    raise CaseError("job still running 30 s after criu dump")
                if not procs.wait_pids_free(pids, 60, log):
                    raise CaseError("dumped pids still in use after 60 s")
                restore = criu.criu_restore(imgdir, self.a.plugdir, mode, log, timeout=self.a.criu_timeout,
                                            env=criu_env)
                rec["restore_s"] = round(restore["secs"], 3)
                rec["restore_gpusnap_lines"] = restore["gpusnap_lines"]
                rpid = restore["pid"]
                if restore["rc"] != 0:
                    raise CaseError("criu restore rc %d" % restore["rc"])
                st2 = criu.read_stats_json(imgdir)
                if st2:
                    rec["phases"] = st2
                rc = wait_exit(rpid, self.a.run_timeout)
                log("restored job (pid %s) exited with %s" % (rpid, rc))
                if rc not in (0, None):
                    rec["problems"].append("restored job exit status %s" % rc)
            outs = self.collect(workload, out)
            self.compare(rec, ref["outs"], outs, dump)
            gibs = [float(o[3].get("gpu_gib", 0)) for o in outs if o[3]]
            rec["gpu_gib"] = round(sum(gibs), 3) if gibs else None
            params = [ready_params(o[2]) for o in outs]
            if any(params):
                rec["params"] = max(p or 0 for p in params)
        except CaseError as e:
            rec["problems"].append(str(e))
            log("CASE ERROR: %s" % e)
        except Exception:
            tb = output.format_exc()
            rec["problems"].append("exception: " + tb.strip().splitlines()[-1])
            log.block("exception", tb)
        finally:
            if path.startswith("split"):
                for f in [out] + [g for g in output_files(workload, out) if g != out]:
                    criu.log_agent_lines(log, f + ".stdout", 20)
            if rec["problems"]:
                log.file_tail("job stdout", out + ".stdout", 40)
                for f in output_files(workload, out):
                    if f != out:
                        log.file_tail("worker stdout", f + ".stdout", 20)
                for what in ("dump", "restore"):
                    pth = os.path.join(imgdir, what + ".log")
                    if os.path.exists(pth):
                        log.file_tail("criu %s.log" % what, pth, 30)
            targets = [x for x in {rpid, popen.pid if popen else None} if x]
            live = [t for t in targets if procs.alive(t)]
            if live:
                log("killing %s" % live)
            if targets:
                procs.kill_and_wait(targets, log, wait_pids=targets + pids, popen=popen)
            saved = []
            for what in ("dump", "restore"):
                pth = os.path.join(imgdir, what + ".log")
                if os.path.exists(pth):
                    q = os.path.join(self.a.work, "%s-%s.log" % (tag, what))
                    shutil.copy(pth, q)
                    saved.append(q)
            files = [out, out + ".stdout"]
            for f in output_files(workload, out):
                if f != out:
                    files += [f, f + ".stdout"]
            output.archive_add(files + saved, "torch/" + tag, log)
            shutil.rmtree(imgdir, ignore_errors=True)
        return self.finish(rec, t_case)

    def compare(self, rec, ref_outs, outs, dump):
        log = self.log
        identical = True
        pauses = []
        for k, (ro, co) in enumerate(zip(ref_outs, outs)):
            rv, cv = ro[0], co[0]
            same = rv == cv and co[3] is not None
            if not same:
                identical = False
                first = next((i for i in range(min(len(rv), len(cv))) if rv[i] != cv[i]), None)
                msg = "output %d differs: %d reference values, %d checkpointed, first mismatch at %s" % (
                    k, len(rv), len(cv), first)
                if first is not None:
                    msg += " (ref %s, got %s)" % (rv[first], cv[first])
                if co[3] is None:
                    msg += "; no done line"
                rec["problems"].append(msg)
                log(msg)
            ts = co[1]
            gaps = [(ts[i + 1] - ts[i], i) for i in range(len(ts) - 1)]
            if gaps and dump:
                med = statistics.median(g for g, _ in gaps)
                after = [(g, i) for g, i in gaps if ts[i + 1] >= dump["start"]]
                if after:
                    g, i = max(after)
                    pauses.append((g - med, g, i, med))
        rec["identical"] = identical
        rec["values"] = [len(o[0]) for o in outs]
        if pauses:
            p, g, i, med = max(pauses)
            rec["pause_s"] = round(max(0.0, p), 4)
            rec["max_gap_s"] = round(g, 4)
            rec["median_gap_s"] = round(med, 4)
            rec["pause_at_value"] = i
        log("compare: identical %s; values %s (reference %s); pause %s s (gap %s s after value %s, "
            "median gap %s s)" % (identical, rec["values"], [len(o[0]) for o in ref_outs],
                                  rec.get("pause_s"), rec.get("max_gap_s"), rec.get("pause_at_value"),
                                  rec.get("median_gap_s")))

    def finish(self, rec, t_case):
        if not rec["identical"] and not rec["problems"]:
            rec["problems"].append("outputs not identical")
        rec["pass"] = not rec["problems"]
        rec["case_s"] = round(time.time() - t_case, 1)
        output.append_jsonl(self.jsonls, rec)
        self.log("RESULT %s-%s: %s identical=%s dump_s=%s restore_s=%s pause_s=%s gpu_gib=%s%s" % (
            rec["case"], rec["path"], "PASS" if rec["pass"] else "FAIL", rec["identical"],
            rec["dump_s"], rec["restore_s"], rec["pause_s"], rec["gpu_gib"],
            "" if rec["pass"] else " (%s)" % "; ".join(rec["problems"][:3])))
        return rec


class CaseError(Exception):
    pass


def skipped_record(run_id, mi, cid, path, why):
    return {"run": run_id, "date": output.iso_now(), "gpu": mi.get("gpu"), "driver": mi.get("driver"),
            "workload": CASES[cid][3], "case": cid, "path": path, "allocator": CASES[cid][1],
            "skipped": why}


def mps_processes():
    """'pid:command' of every running nvidia-cuda-mps-* process (full names, from cmdline)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % d, "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if os.path.basename(argv0).startswith("nvidia-cuda-mps"):
            found.append("%s:%s" % (d, os.path.basename(argv0)))
    return found


def reap_mps_zombies(log):
    """Reaps exited MPS processes whose parent is this script (the daemon forks away from its
    starter, so this subreaper inherits it): unreaped, they still show in /proc."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.find("(") + 1:stat.rfind(")")]
        rest = stat[stat.rfind(")") + 1:].split()
        if comm.startswith("nvidia-cuda-mps") and rest[:1] == ["Z"] and rest[1:2] == [str(os.getpid())]:
            try:
                os.waitpid(int(d), 0)
                log("reaped exited MPS process %s" % d)
            except ChildProcessError:
                pass


def mps_start(work, log):
    """Starts an MPS control daemon with its own pipe and log directories; returns (the
    variables its clients need, None) or (None, why not)."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if not ctl:
        return None, "nvidia-cuda-mps-control not found"
    if mps_processes():
        return None, "an MPS daemon already runs: %s" % mps_processes()
    base = os.path.join(work, "mps")
    shutil.rmtree(base, ignore_errors=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(base, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(base, "log")}
    for d in env.values():
        os.makedirs(d)
    r = subprocess.run([ctl, "-d"], env=dict(os.environ, **env), capture_output=True,
                             timeout=30)
    log("nvidia-cuda-mps-control -d: rc %d %s" % (r.returncode, (r.stdout + r.stderr).decode(errors="replace").strip()))
    if r.returncode != 0:
        return None, "nvidia-cuda-mps-control -d failed (rc %d)" % r.returncode
    return env, None


def mps_stop(env, log):
    """Quits the daemon (its server goes with it) and waits until no MPS process is left."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    try:
        r = subprocess.run([ctl], input=b"quit\n", env=dict(os.environ, **env),
                                 capture_output=True, timeout=30)
        log("MPS quit: rc %d" % r.returncode)
    except Exception as e:  # noqa: BLE001 (the check below decides)
        log("MPS quit failed: %s" % e)
    if not procs.wait_until(lambda: not mps_processes(), 20, poll=0.2):
        left = mps_processes()
        log("MPS processes still there after quit, killing: %s" % left)
        for p in left:
            try:
                os.kill(int(p.split(":")[0]), 9)
            except OSError:
                pass
    reap_mps_zombies(log)
    logs = [os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], n)
            for n in sorted(os.listdir(env["CUDA_MPS_LOG_DIRECTORY"]))]
    for pth in logs:
        log.file_tail("MPS " + os.path.basename(pth), pth, 15)
    output.archive_add(logs, "torch/mps", log)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="all", help="comma list of case ids or groups (default all)")
    ap.add_argument("--paths", default="split,transparent")
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--device", default="cuda", help="cpu: harness test without a GPU")
    ap.add_argument("--name", default="torch-cases-h200")
    ap.add_argument("--images", default="/dev/shm/gpusnap-torch")
    ap.add_argument("--work", default="/tmp/gpusnap-work/torch")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--python", default=sys.executable, help="python that runs the workloads")
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds for one workload run")
    ap.add_argument("--criu-timeout", type=float, default=180,
                    help="seconds for one criu dump or restore; past it, where criu waits is logged")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new case after this many s")
    ap.add_argument("--repeat", type=int, default=1, help="run each case this many times")
    a = ap.parse_args()

    ids = []
    for c in [c.strip() for c in a.cases.split(",") if c.strip()]:
        for x in GROUPS.get(c, [c]):
            if x not in CASES:
                ap.error("unknown case %s (cases: %s; groups: %s)" % (x, ", ".join(CASES), ", ".join(GROUPS)))
            if x not in ids:
                ids.append(x)
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    for p in paths:
        if p not in ("split", "split-copyfirst", "transparent"):
            ap.error("unknown path %s" % p)

    t_start = time.time()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-%d" % os.getpid()
    out, log, mi = output.start_run("torch", "torch cases run %s: %s" % (run_id, " ".join(sys.argv)),
                                   a.plugdir)
    log("cases %s, paths %s, size %s, python %s" % (ids, paths, a.size, a.python))
    jsonls = output.result_files(out, a.name, a.device == "cpu")
    r = Runner(a, log, mi, run_id, jsonls)
    results = []
    for cid in ids:
        for path in paths:
            for attempt in range(1, a.repeat + 1):
                if a.budget_s and time.time() - t_start > a.budget_s:
                    log("budget of %.0f s spent: skipping %s on %s" % (a.budget_s, cid, path))
                    rec = skipped_record(run_id, mi, cid, path, "time budget")
                    output.append_jsonl(jsonls, rec)
                    results.append(rec)
                    continue
                r.attempt = attempt
                results.append(r.case(cid, path))
    log("=" * 78)
    log("SUMMARY (%.0f s)" % (time.time() - t_start))
    log("%-16s %-12s %-10s %-6s %-9s %8s %8s %8s %7s %s" % (
        "case", "path", "allocator", "result", "identical", "dump_s", "rest_s", "pause_s", "gpu_gib",
        "problems"))
    for x in results:
        res = "SKIP" if x.get("skipped") else ("PASS" if x.get("pass") else "FAIL")
        log("%-16s %-12s %-10s %-6s %-9s %8s %8s %8s %7s %s" % (
            x["case"], x["path"], x.get("allocator"), res, x.get("identical", "-"),
            x.get("dump_s"), x.get("restore_s"), x.get("pause_s"), x.get("gpu_gib"),
            "; ".join(x.get("problems", []))[:160]))
    failed = sum(1 for x in results if not x.get("skipped") and not x.get("pass"))
    log("torch cases: %d passed, %d failed, %d skipped" % (
        sum(1 for x in results if x.get("pass")), failed, sum(1 for x in results if x.get("skipped"))))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
