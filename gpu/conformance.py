#!/usr/bin/env python3
"""Third-party CUDA test suites run without the gpusnap agent, with it, and with it and
GPUSNAP_AGENT_MIN_BYTES=0 (every allocation converted); what fails only with the agent is what
the agent broke.

Suites (each taken from the carried folder ``.devcarry/conformance``; see
gpu/fetch-conformance.md; a suite whose files are not there is recorded as skipped):

- ``cupy-cuda_tests``: CuPy's own ``tests/cupy_tests/cuda_tests`` at the installed CuPy's tag
  (``cupy-v14.2.0/``), run with the installed CuPy.
- ``torch-multiprocessing-cuda``: PyTorch's ``test/test_multiprocessing.py`` (``pytorch/``),
  the tests whose name contains ``cuda`` or ``event`` (CUDA IPC of memory and of events).

Each run: ``pytest -p no:cacheprovider -q --timeout 60 -n N --junitxml ...`` with a wall-clock
limit; the per-test outcomes come from the JUnit XML. One JSON line per suite and configuration
is appended to ``OUT/conformance.jsonl``: ``{"case": "conformance", "suite", "config":
"no-agent"|"agent"|"agent-min0", "tests", "passed", "failed", "errors", "skipped",
"failed_only_with_agent": [...], "passed_only_with_agent": [...], "rc", "seconds",
"timed_out"}`` (the two lists compare with the suite's no-agent run). Exit status 1 if anything
fails only with the agent.
"""

import argparse
import json
import os
import sys
import time

from procgroup import run_group
import xml.etree.ElementTree as ET

SUITES = [
    # (name, directory under the carry folder, pytest arguments relative to it)
    ("cupy-cuda_tests", "cupy-v14.2.0", ["tests/cupy_tests/cuda_tests"]),
    ("torch-multiprocessing-cuda", "pytorch", ["test_multiprocessing.py", "-k", "cuda or event"]),
]




def outcomes(junit):
    """test id -> passed|failed|error|skipped."""
    res = {}
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return res
    for tc in root.iter("testcase"):
        tid = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        kinds = {child.tag for child in tc}
        if "failure" in kinds:
            res[tid] = "failed"
        elif "error" in kinds:
            res[tid] = "error"
        elif "skipped" in kinds:
            res[tid] = "skipped"
        else:
            res[tid] = "passed"
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agent", required=True)
    ap.add_argument("--carry", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline-s", type=float, default=200)
    ap.add_argument("--run-timeout-s", type=float, default=110)
    ap.add_argument("--workers", default="8")
    ap.add_argument("--suites", default=",".join(s[0] for s in SUITES))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    wanted = a.suites.split(",")
    configs = [
        ("no-agent", {}),
        ("agent", {"LD_PRELOAD": a.agent}),
        ("agent-min0", {"LD_PRELOAD": a.agent, "GPUSNAP_AGENT_MIN_BYTES": "0"}),
    ]
    deadline = time.monotonic() + a.deadline_s
    bad = False
    jl = open(os.path.join(a.out, "conformance.jsonl"), "a")
    log = open(os.path.join(a.out, "conformance.log"), "a")

    def emit(rec):
        jl.write(json.dumps(rec) + "\n")
        jl.flush()
        print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, list) or len(v) < 20}))

    # in the order --suites names them (the first gets the time when the deadline is short)
    for name, sub, pyargs in sorted((s for s in SUITES if s[0] in wanted),
                                    key=lambda s: wanted.index(s[0])):
        cwd = os.path.join(a.carry, sub)
        if not os.path.exists(os.path.join(cwd, pyargs[0])):
            emit({"case": "conformance", "suite": name, "skipped": f"{cwd}/{pyargs[0]} not carried"})
            continue
        baseline = None
        for config, extra in configs:
            left = deadline - time.monotonic()
            rec = {"case": "conformance", "suite": name, "config": config}
            if left < 15:
                rec["skipped"] = "deadline"
                emit(rec)
                bad = True
                continue
            env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSNAP_AGENT")}
            env.pop("LD_PRELOAD", None)
            env.update(extra)
            # Pure-Python test helpers a suite imports that the GPU machine lacks (PyTorch's
            # test utilities need `expecttest`), carried in CARRY/pylib (gpu/fetch-conformance.md).
            pylib = os.path.join(a.carry, "pylib")
            if os.path.isdir(pylib):
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (pylib, env.get("PYTHONPATH", "")) if p)
            junit = os.path.join(a.out, f"conformance-{name}-{config}.xml")
            if os.path.exists(junit):
                os.remove(junit)
            cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                   "--timeout", "60", "-n", a.workers, f"--junitxml={junit}", *pyargs]
            t0 = time.monotonic()
            rc, out, err = run_group(cmd, min(left, a.run_timeout_s), cwd=cwd, env=env)
            timed_out = rc == "timeout"
            out = out + err
            seconds = round(time.monotonic() - t0, 1)
            log.write(f"==> {name} {config} rc={rc} {seconds}s\n")
            log.write("\n".join(out.splitlines()[-80:]) + "\n")
            log.flush()
            res = outcomes(junit)
            count = lambda k: sum(1 for v in res.values() if v == k)  # noqa: E731
            rec.update(tests=len(res), passed=count("passed"), failed=count("failed"),
                       errors=count("error"), skipped=count("skipped"), rc=rc,
                       seconds=seconds, timed_out=timed_out)
            if baseline is None:
                baseline = res
            else:
                bad_now = sorted(t for t, v in res.items()
                                 if v in ("failed", "error") and baseline.get(t) == "passed")
                rec["failed_only_with_agent"] = bad_now
                rec["passed_only_with_agent"] = sorted(
                    t for t, v in res.items()
                    if v == "passed" and baseline.get(t) in ("failed", "error"))
                rec["missing_with_agent"] = len([t for t in baseline if t not in res])
                bad |= bool(bad_now) or timed_out or rec["missing_with_agent"] > 0
            # A run that found no tests (suite broken, or cut short) proves nothing.
            bad |= not res
            emit(rec)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
