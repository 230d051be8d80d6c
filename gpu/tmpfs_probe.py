"""How fast this machine's tmpfs takes and gives back data, by size: the host half of the split
path's data phase without the GPU, CRIU or gpusnap. For issue 14's question why the dump's data
rate falls with size (17 GiB/s at 16 GiB, 6 GiB/s at 64 GiB on the H200 VM).

    python3 gpu/tmpfs_probe.py [--gib 16 64 64] [--threads 16] [--block-mib 32] [--dir /dev/shm/p]

A size given twice runs twice: if the second run is faster, the first paid for the VM's first
touch of guest memory (the host backing pages the guest never used), not for tmpfs itself.

For each size: THREADS threads each write their share into one file of their own in BLOCK-MiB
pwrite calls (as gpusnap's 16 writer threads do), then read it back (pread), then the files are
removed. pwrite and pread release the GIL, so the threads run in parallel. One JSON line per
size on stdout: write and read GB/s, and MemAvailable before and after.
"""
import argparse
import json
import os
import threading
import time


def mem_available_gib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return None


def run(path, nbytes, threads, block):
    buf = os.urandom(block)
    share = nbytes // threads // block * block
    files = [os.path.join(path, "probe-%d" % i) for i in range(threads)]

    def writer(name):
        fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            for off in range(0, share, block):
                os.pwrite(fd, buf, off)
        finally:
            os.close(fd)

    def reader(name):
        mine = bytearray(block)
        fd = os.open(name, os.O_RDONLY)
        try:
            for off in range(0, share, block):
                os.preadv(fd, [mine], off)
        finally:
            os.close(fd)

    out = {}
    for what, fn in (("write", writer), ("read", reader)):
        ts = [threading.Thread(target=fn, args=(n,)) for n in files]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        out[what + "_s"] = round(dt, 3)
        out[what + "_gbps"] = round(share * threads / dt / 1e9, 2)
    for n in files:
        os.unlink(n)
    out["bytes"] = share * threads
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, nargs="+", default=[16, 64, 64])
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--block-mib", type=int, default=32)
    ap.add_argument("--dir", default="/dev/shm/gpusnap-tmpfs-probe")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    for gib in a.gib:
        before = mem_available_gib()
        r = run(a.dir, int(gib * 2**30), a.threads, a.block_mib << 20)
        r.update(kind="tmpfs-probe", gib=gib, threads=a.threads, block_mib=a.block_mib,
                 mem_available_gib_before=round(before, 1), mem_available_gib_after=round(mem_available_gib(), 1))
        print(json.dumps(r), flush=True)
    os.rmdir(a.dir)


if __name__ == "__main__":
    main()
