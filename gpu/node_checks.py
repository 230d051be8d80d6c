"""The restore's node checks on a real driver (issue "the cluster path"): an image that this
node cannot take is refused at the plugin's init, before CRIU creates any process, and the
same image then restores here.

One job (gpu/workload.cu, --gib, the split path) is dumped once; then:
  inspect       `gpusnap inspect --json`: requires.kernel_driver is this node's driver version,
                requires.driver_library names a libcuda with a 128-bit digest, the driver-stack
                identity and the least GPU memory are filled in;
  no-such-gpu   restore with device_map onto a GPU UUID this machine does not have;
  other-driver  restore where the node's kernel driver reads as another branch (the plugin's
                GPUSNAP_TEST_NVIDIA_VERSION names a version file of 570.86.15);
  other-library restore where the recorded libcuda path holds another file (GPUSNAP_TEST_DRIVER_ROOT);
  each refused: criu restore fails, the log names why, no task was forked, no restore pid;
  restore       the plain restore afterwards: the job ticks on, bit-exact (gpu/workload.cu's checker).
Writes $OUT/NAME.log and NAME.jsonl (one record per check); exit status 1 if a check fails.
"""

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crlib  # noqa: E402
from crlib import criu, machine, output, procs, ticklog  # noqa: E402

FAKE_UUID = "GPU-deadbeef-0000-4000-8000-00000000dead"
OTHER_VERSION = "570.86.15"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1)
    ap.add_argument("--images", default="/dev/shm/gpusnap-node-checks")
    ap.add_argument("--work", default="/tmp/gpusnap-work/node-checks")
    ap.add_argument("--plugdir", default="/tmp/gpusnap-plugins")
    ap.add_argument("--workload", default="/tmp/gpusnap-bin/workload")
    ap.add_argument("--name", default="node-checks")
    a = ap.parse_args()

    out, log, mi = output.start_run(a.name, "gpusnap node checks: %s" % " ".join(sys.argv), a.plugdir)
    jsonl = os.path.join(out, a.name + ".jsonl")
    os.makedirs(a.work, exist_ok=True)
    shutil.rmtree(a.images, ignore_errors=True)
    os.makedirs(a.images)
    results = []

    def record(check, problems, **kw):
        rec = {"case": "node-check", "check": check, "pass": not problems, "problems": problems,
               "date": output.iso_now(), "gpu": mi.get("gpu"), "driver": mi.get("driver")}
        rec.update(kw)
        output.append_jsonl([jsonl], rec)
        results.append(rec)
        log("RESULT %s: %s%s" % (check, "PASS" if not problems else "FAIL",
                                 "" if not problems else " (%s)" % "; ".join(problems)))

    wlog, wout = procs.fresh_workload_files(a.work, "job")
    cmd = [a.workload, "--gib", str(a.gib), "--chunk-mib", "256", "--log", wlog, "--interval-ms", "100"]
    popen = procs.start_process(cmd, wout, procs.workload_env("split"), log)
    rpid = None
    try:
        if not procs.wait_until(lambda: len(ticklog.parse_workload_log(wlog)[1]) >= 3, 120, proc=popen):
            record("dump", ["the job did not tick 3 times (exit %s)" % popen.poll()])
            return 1
        pid = popen.pid
        pids = procs.tree_tids(pid)
        dump = criu.criu_dump(pid, a.images, a.plugdir, "auto", log)
        if dump["rc"] != 0:
            record("dump", ["criu dump rc %d" % dump["rc"]])
            return 1
        popen.wait(timeout=30)
        procs.wait_pids_free(pids, 60, log)
        n_dump = len(ticklog.parse_workload_log(wlog)[1])
        record("dump", [], dump_s=round(dump["secs"], 3))

        # What the image says a restore needs, read from a real image.
        irc, iout = criu.gpusnap_cli(["inspect", a.images, "--json"], log)
        problems = []
        try:
            v = json.loads(iout)
        except ValueError as e:
            v = {}
            problems.append("inspect --json rc %s, not JSON: %s" % (irc, e))
        p = (v.get("processes") or [{}])[0]
        req = p.get("requires") or {}
        lib = req.get("driver_library") or {}
        if req.get("kernel_driver") != mi.get("driver"):
            problems.append("requires.kernel_driver %r, nvidia-smi says %r" % (
                req.get("kernel_driver"), mi.get("driver")))
        if "libcuda.so" not in (lib.get("path") or ""):
            problems.append("requires.driver_library.path %r" % lib.get("path"))
        if len(lib.get("xxh3_128") or "") != 32:
            problems.append("requires.driver_library.xxh3_128 %r" % lib.get("xxh3_128"))
        identity = v.get("driver_stack_identity") or ""
        if not identity.startswith("nvidia=%s;" % mi.get("driver")):
            problems.append("driver_stack_identity %r" % identity)
        if (v.get("min_gpu_memory_bytes") or 0) < int(a.gib * 2**30):
            problems.append("min_gpu_memory_bytes %r below the job's %s GiB" % (
                v.get("min_gpu_memory_bytes"), a.gib))
        record("inspect", problems, requires=req, driver_stack_identity=identity,
               min_gpu_memory_bytes=v.get("min_gpu_memory_bytes"))

        # Nodes that cannot take the image.
        uuids = machine.gpu_uuids()
        vfile = os.path.join(a.work, "other-version")
        with open(vfile, "w") as f:
            f.write("NVRM version: NVIDIA UNIX x86_64 Kernel Module  %s  Thu Jan  1 00:00:00 UTC 2026\n"
                    "GCC version:  gcc version 12.2.0\n" % OTHER_VERSION)
        root = os.path.join(a.work, "other-node")
        shutil.rmtree(root, ignore_errors=True)
        if lib.get("path"):
            target = root + lib["path"]
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(b"\x7fELF not the library the job ran on\n")
        cases = [
            ("no-such-gpu", {"GPUSNAP_DEVICE_MAP": "%s=%s" % (uuids[0] if uuids else "GPU-0", FAKE_UUID)},
             [FAKE_UUID.lower()[4:12]]),
            ("other-driver", {"GPUSNAP_TEST_NVIDIA_VERSION": vfile},
             [OTHER_VERSION, "allow_other_kernel_driver"]),
            ("other-library", {"GPUSNAP_TEST_DRIVER_ROOT": root}, ["libcuda"]),
        ]
        for check, env, needles in cases:
            log("=" * 78)
            log("CHECK %s: restore with %s" % (check, env))
            r = criu.criu_restore(a.images, a.plugdir, "auto", log, timeout=120, env=env)
            lines = r["gpusnap_lines"]
            problems = []
            if r["rc"] == 0:
                problems.append("criu restore succeeded (pid %s)" % r["pid"])
                rpid = r["pid"]
            if r["pid"]:
                problems.append("a restored pid %s exists" % r["pid"])
            text = "\n".join(lines)
            missing = [n for n in needles if n.lower() not in text.lower()]
            if missing:
                problems.append("the log does not name %s" % missing)
            logpath = os.path.join(a.images, "restore.log")
            forked = 0
            if os.path.exists(logpath):
                with open(logpath, errors="replace") as f:
                    forked = sum(1 for l in f if "Forking task" in l)
                shutil.copy(logpath, os.path.join(a.work, "restore-%s.log" % check))
            if forked:
                problems.append("CRIU forked %d task(s) before the refusal" % forked)
            for l in lines[-6:]:
                log("  %s" % l)
            record(check, problems, restore_rc=r["rc"], refusal=[l for l in lines if "refus" in l.lower()
                                                                 or "cannot" in l.lower()][:3])
            if rpid:
                procs.kill_and_wait([rpid], log)
                rpid = None

        # The image is still whole: the plain restore runs it on.
        log("=" * 78)
        try:
            secs, rpid, chk_problems, identical = criu.restore_and_check(
                a.images, a.plugdir, log, wlog, n_dump, 120)
            record("restore", chk_problems, restore_s=secs, identical=identical)
        except RuntimeError as e:
            rpid = getattr(e, "pid", None)
            record("restore", [str(e)])
    finally:
        left = [x for x in (rpid, popen.pid) if x and procs.alive(x)]
        if left:
            procs.kill_and_wait(left, log, popen=popen)
        files = [wlog, wout] + [os.path.join(a.work, f) for f in os.listdir(a.work)
                                if f.startswith("restore-")]
        for f in ("dump.log", "restore.log"):
            if os.path.exists(os.path.join(a.images, f)):
                files.append(os.path.join(a.images, f))
        output.archive_add(files, a.name, log)
        shutil.rmtree(a.images, ignore_errors=True)
    failed = [r["check"] for r in results if not r["pass"]]
    log("SUMMARY: %d checks, failed: %s" % (len(results), failed or "none"))
    return 1 if failed else 0


if __name__ == "__main__":
    time.tzset()
    sys.exit(main())
