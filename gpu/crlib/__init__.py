"""Shared harness of gpusnap's GPU scripts (stdlib only; Python 3.8+).

Used by the scripts in gpu/ and by bench/bench.py, one module per job:
- `output`: $OUT, the run's log, JSON-lines results, logs.tar, and `start_run`, the common start
  of a script;
- `machine`: the host and its GPUs (nvidia-smi, /proc/meminfo);
- `procs`: workloads started in their own session (stdin /dev/null, output to files), process
  trees, waiting until the PIDs a restore needs are free, killing what is left;
- `criu`: `criu dump` and `criu restore` through scripts/criu with the gpusnap plugin, what they
  left in the image directory, and the gpusnap CLI;
- `ticklog`: the C workload's tick log, and the checker that the computation went on bit-exact.

This file holds only where things are, so the modules can share it without importing each other.

PID trap (docs/measurements.md): `criu restore` fails with "Can't fork for PID: File exists"
while any task, zombies included, has a dumped PID as its pid, pgid or sid. The harness makes
itself a child subreaper, so that killed workload trees and restored (detached) processes are
re-parented to it and reaped here instead of by a lazy init, and it waits until no task uses the
dumped PIDs before restoring.
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRIU = os.path.join(REPO, "scripts", "criu")
DEVCARRY = os.path.join(REPO, ".devcarry")
PLUGIN_SO = os.path.join(DEVCARRY, "libgpusnap_plugin.so")
AGENT_SO = os.path.join(DEVCARRY, "libgpusnap_agent.so")
KEEPER = os.path.join(DEVCARRY, "gpusnap-keeper")
GPUSNAP_CLI = os.path.join(DEVCARRY, "gpusnap")
