"""CPU stand-in for gpu/workload.cu, to test the harness (e2e, bench) on a machine without a GPU.

Same arguments and log format; the "device" counter and state live in host memory and the
checksum is a constant. Holds --gib * 16 MiB of host memory so that images are not empty.
Run: python3 gpu/mock_workload.py --gib 1 --log /tmp/x.log
"""

import argparse
import os
import time

LCG_A = 6364136223846793005
STATE0 = 0x243F6A8885A308D3
MASK = (1 << 64) - 1


def log(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1)
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--alloc", default="driver")
    ap.add_argument("--log", default="/tmp/workload.log")
    ap.add_argument("--interval-ms", type=int, default=100)
    ap.add_argument("--devices", default="0")  # accepted like workload.cu's; no devices here
    a = ap.parse_args()
    log(a.log, "start pid %d gib %g mock 1 ld_preload %s" % (os.getpid(), a.gib,
                                                             os.environ.get("LD_PRELOAD", "-")))
    data = bytearray(os.urandom(1 << 20)) * int(max(1, a.gib * 16))
    ref = 0x1234567890ABCDEF
    log(a.log, "ready pid %d gib %g chunks 1 alloc %s ref 0x%016x state0 0x%016x interval_ms %d "
        "mock 1 bytes %d" % (os.getpid(), a.gib, a.alloc, ref, STATE0, a.interval_ms, len(data)))
    counter, state, tick = 0, STATE0, 0
    while True:
        t0 = time.time()
        counter += 1
        state = (state * LCG_A + counter) & MASK
        log(a.log, "tick %d counter %d state 0x%016x sum 0x%016x ok 1 err 0 us %d dt_us %d" % (
            tick, counter, state, ref, int(time.time() * 1e6), int((time.time() - t0) * 1e6)))
        tick += 1
        time.sleep(a.interval_ms / 1000.0)


if __name__ == "__main__":
    main()
