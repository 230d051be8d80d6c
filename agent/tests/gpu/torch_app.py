"""Test workload for the agent under PyTorch (dynamic libcudart, caching allocator).

Allocates tensors, remembers exact integer checksums, then obeys stdin: check | mem | touch | exit.
"""
import os
import sys

import torch


def main():
    big = int(sys.argv[1]) if len(sys.argv) > 1 else 1024  # MiB
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(1)
    ts = [
        torch.randint(-(2**40), 2**40, (big * (1 << 20) // 8,), device=dev, generator=g, dtype=torch.int64),
        torch.randint(-(2**40), 2**40, (3 * (1 << 20) // 8 + 1,), device=dev, generator=g, dtype=torch.int64),
        torch.randint(-100, 100, (1000,), device=dev, generator=g, dtype=torch.int64),  # small pool
    ]
    refs = [int(t.sum().item()) for t in ts]
    print(f"READY {os.getpid()}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            got = [int(t.sum().item()) for t in ts]
            bad = [i for i, (a, b) in enumerate(zip(got, refs)) if a != b]
            print("CHECK OK" if not bad else f"CHECK FAIL {bad}", flush=True)
        elif cmd == "mem":
            f, t = torch.cuda.mem_get_info()
            print(f"MEM used {(t - f) >> 20} MiB of {t >> 20} MiB", flush=True)
        elif cmd == "touch":
            for t in ts:
                t.add_(1)
            torch.cuda.synchronize()
            refs[:] = [int(t.sum().item()) for t in ts]
            print("TOUCHED", flush=True)
        elif cmd == "exit":
            del ts
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            print("EXIT OK", flush=True)
            return


if __name__ == "__main__":
    main()
