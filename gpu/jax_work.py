"""A JAX job in JAX's default memory configuration, for gpu/jax_case.py (issue 14: "JAX in its
default configuration on the split path"). Started twice per path: an uninterrupted reference
run and a run that is checkpointed in the middle; the two outputs must be identical.

Nothing here sets XLA_PYTHON_CLIENT_PREALLOCATE, _MEM_FRACTION or _ALLOCATOR (the harness also
removes them from the job's environment), so on a GPU JAX reserves 75% of its memory at start
(about 105 GiB on an H200) and the job touches only --gib GiB of it.

State: --gib GiB of float32 (dim x dim) matrices W_i with small integer values from a fixed
seed (jax.random, key 0), and an activation x (batch x dim) with values in [-8, 8]. One step t:
  x = remainder(x @ W_i + t, 17) - 8        for --chain matrices i = (t * chain + j) % n
  W_k = remainder(3 W_k + x[0] + row + t, 5) - 2   for k = t % n (in place: donated)
Every value is a small integer, so every product and sum is exact in float32 (and in TF32):
the results do not depend on the matmul algorithm XLA picks or on the order of sums. After each
step the host reads a checksum of the whole state: the wrapping uint32 sum, over every word of
every W, of a hash of the word's bits and its position (array, row, column); integer sums, so
independent of reduction order too; and the same for x.

Output (--out, one line at a time, opened and closed per line as gpu/torch_work.py does):
    ready pid <pid> platform <p> device <d> jax <v> arrays <n> state_bytes <b> bytes_limit <l>
          bytes_reserved <r> preallocate <env or default> mem_fraction <env or default>
    v <step> <state checksum>:<x checksum> <unix_us>
    done n <steps> secs <run time> bytes_limit <l> peak_bytes_in_use <p>
Run on the CPU for a harness test: JAX_PLATFORMS=cpu python3 gpu/jax_work.py --out F --gib 0.03
--dim 256 --batch 64.
"""

import argparse
import os
import time

T0 = time.time()


def emit(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


def mem_stats(dev):
    try:
        return dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 (a platform without memory stats)
        return {}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=4, help="state size in GiB (default 4)")
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--chain", type=int, default=4, help="matmuls per step")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--interval-ms", type=float, default=20)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from jax import lax

    dev = jax.devices()[0]
    n = max(1, int(round(a.gib * 2**30 / (a.dim * a.dim * 4))))
    keys = jax.random.split(jax.random.PRNGKey(0), n + 1)

    @jax.jit
    def make_w(k):
        return jax.random.randint(k, (a.dim, a.dim), -2, 3, dtype=jnp.int32).astype(jnp.float32)

    ws = [make_w(keys[i]) for i in range(n)]
    x = jax.random.randint(keys[n], (a.batch, a.dim), -8, 9, dtype=jnp.int32).astype(jnp.float32)

    @jax.jit
    def mm(x, w, t):
        return jnp.remainder(x @ w + t, 17.0) - 8.0

    def upd_(w, x, t):
        row = lax.broadcasted_iota(jnp.float32, w.shape, 0)
        return jnp.remainder(w * 3.0 + x[0][None, :] + row + t, 5.0) - 2.0

    upd = jax.jit(upd_, donate_argnums=(0,))

    def mix32(h, m1, m2):  # a 32-bit finaliser (xorshift-multiply), all in wrapping uint32
        h = (h ^ (h >> 16)) * jnp.uint32(m1)
        h = (h ^ (h >> 15)) * jnp.uint32(m2)
        return h ^ (h >> 16)

    def sum_one(m, salt):
        # each word's bits hashed with its position, then summed: order-independent, and a
        # changed, moved or swapped word changes the sum
        bits = lax.bitcast_convert_type(m, jnp.uint32)
        r = lax.broadcasted_iota(jnp.uint32, m.shape, 0)
        c = lax.broadcasted_iota(jnp.uint32, m.shape, 1)
        pos = r * jnp.uint32(m.shape[1]) + c + jnp.uint32(salt)
        h = mix32(bits ^ mix32(pos, 0x7FEB352D, 0x846CA68B), 0x85EBCA6B, 0xC2B2AE35)
        return jnp.sum(h, dtype=jnp.uint32)

    @jax.jit
    def checksum(ws, x):
        s = jnp.uint32(0)
        for i, m in enumerate(ws):
            s = s + sum_one(m, (i * 0x9E3779B1) & 0xFFFFFFFF)
        return s, sum_one(x, 0x243F6A88)

    st = mem_stats(dev)
    emit(a.out, "ready pid %d platform %s device %s jax %s arrays %d state_bytes %d bytes_limit %s "
         "bytes_reserved %s preallocate %s mem_fraction %s" % (
             os.getpid(), dev.platform, str(dev).replace(" ", "_"), jax.__version__, n,
             n * a.dim * a.dim * 4 + a.batch * a.dim * 4, st.get("bytes_limit", "-"),
             st.get("bytes_reserved", "-"), os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "default"),
             os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "default")))
    for t in range(a.steps):
        tf = jnp.float32(t)
        for j in range(a.chain):
            x = mm(x, ws[(t * a.chain + j) % n], tf)
        k = t % n
        ws[k] = upd(ws[k], x, tf)
        s, sx = checksum(ws, x)
        emit(a.out, "v %d %08x:%08x %d" % (t, int(s), int(sx), int(time.time() * 1e6)))
        if a.interval_ms > 0:
            time.sleep(a.interval_ms / 1000.0)
    st = mem_stats(dev)
    emit(a.out, "done n %d secs %.3f bytes_limit %s peak_bytes_in_use %s" % (
        a.steps, time.time() - T0, st.get("bytes_limit", "-"), st.get("peak_bytes_in_use", "-")))


if __name__ == "__main__":
    main()
