"""On a GPU: the PTX kernel agrees with the reference definition, and how fast it runs.

    python3 gpu/devhash/test_sum64.py PTX [--gib N]

The reference here is written from docs/image-format.md ("Device hash") with numpy; the Rust
reference (common/image/src/devhash.rs) is checked against fixed vectors this script prints.
"""
import argparse, sys, time
import numpy as np
import cupy as cp

K = np.uint64(0x9E3779B97F4A7C15)
M1 = np.uint64(0xFF51AFD7ED558CCD)
M2 = np.uint64(0xC4CEB9FE1A85EC53)


def fmix64(k):
    k = k ^ (k >> np.uint64(33))
    k = k * M1
    k = k ^ (k >> np.uint64(33))
    k = k * M2
    k = k ^ (k >> np.uint64(33))
    return k


def reference(words):
    with np.errstate(over="ignore"):
        i = np.arange(words.size, dtype=np.uint64)
        s = int(np.sum(fmix64(words ^ (i * K)), dtype=np.uint64))
    o = int(np.bitwise_or.reduce(words)) if words.size else 0
    return s, o


def on_gpu(fn, dptr_words, n, out):
    out.fill(0)
    threads = 256
    blocks = int(min(max(1, (n + threads - 1) // threads), 1056))
    fn((blocks,), (threads,), (dptr_words, np.uint64(n), out))
    return int(out[0].get()), int(out[1].get())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ptx")
    ap.add_argument("--gib", type=int, default=16)
    a = ap.parse_args()
    mod = cp.RawModule(path=a.ptx)
    fn = mod.get_function("gpusnap_sum64")
    out = cp.zeros(2, dtype=cp.uint64)
    rng = np.random.default_rng(7)
    bad = 0
    for n in [0, 1, 2, 31, 32, 33, 1000, 4096, 1 << 20, (32 << 20) // 8]:
        h = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True)
        d = cp.asarray(h)
        got = on_gpu(fn, d, n, out)
        want = reference(h)
        ok = got == want
        bad += not ok
        print("n=%-8d gpu=%016x/%016x ref=%016x/%016x %s" % (n, got[0], got[1], want[0], want[1], "ok" if ok else "MISMATCH"))
    z = cp.zeros((32 << 20) // 8, dtype=cp.uint64)
    got = on_gpu(fn, z, z.size, out)
    print("zeros 32 MiB: or=%x sum=%016x ref=%016x" % (got[1], got[0], reference(np.zeros(z.size, np.uint64))[0]))
    bad += got != reference(np.zeros(z.size, np.uint64))
    # Fixed vectors for the Rust reference: words i*0x0101010101010101 + 3, n = 1..5 and 4096.
    for n in [1, 5, 4096]:
        w = (np.arange(n, dtype=np.uint64) * np.uint64(0x0101010101010101) + np.uint64(3))
        with np.errstate(over="ignore"):
            w = w.astype(np.uint64)
        print("vector n=%d sum=%016x or=%016x" % (n, *on_gpu(fn, cp.asarray(w), n, out)))
    # Throughput: one launch per 32 MiB chunk over N GiB, as the agent does.
    total = a.gib << 30
    buf = cp.empty(total // 8, dtype=cp.uint64)
    buf.fill(1)
    chunk = (32 << 20) // 8
    outs = cp.zeros(2 * (buf.size // chunk), dtype=cp.uint64)
    cp.cuda.Device().synchronize()
    for rep in range(2):
        t0 = time.perf_counter()
        for k in range(buf.size // chunk):
            fn((1056,), (256,), (buf[k * chunk:], np.uint64(chunk), outs[2 * k:]))
        cp.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
        print("throughput: %d GiB in %.4f s = %.0f GB/s (%d launches)" % (a.gib, dt, total / dt / 1e9, buf.size // chunk))
    print("RESULT %s" % ("ok" if bad == 0 else "FAILED %d" % bad))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
