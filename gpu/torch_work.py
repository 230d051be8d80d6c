"""PyTorch workloads for gpusnap's real-workload cases; started (twice: reference and
checkpointed) by gpu/torch_cases.py. Each writes its outputs one line at a time to --out
(opened, appended, closed per line, so no file offset matters across a checkpoint):

    ready pid <pid> ...            once set up
    v <index> <value> <unix_us>    one per output (token, loss, step value)
    done n <count> gpu_gib <torch.cuda.max_memory_reserved in GiB> secs <run time>

The values are deterministic (seeded weights and data, greedy decoding, deterministic
algorithms), so two runs must give the same lines bit for bit, whatever happened in between.

Workloads (first argument):
  llama-generate  Llama-style decoder (transformers LlamaForCausalLM, seeded random weights,
                  bf16), greedy decoding one token at a time with a KV cache; value =
                  "<token>:<max logit as float.hex>".
  train           forward + backward + AdamW on a smaller such model, random token batches from
                  a seeded generator; value = loss.item() as float.hex().
  tree-parent     a parent (no CUDA) with two `tree-worker` children (plain subprocesses).
  tree-worker     holds --gib GiB on the GPU and computes a deterministic sequence.
  malloc-async    temporaries of varying size allocated and freed every step (run with
                  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync).
  pinned          pin_memory() host tensors used in non_blocking copies both ways.
  streams-events  three streams chained with events.
  cuda-graph      torch.cuda.CUDAGraph captured once, replayed every step.
  managed         64 MiB of managed memory (cuMemAllocManaged) next to a compute loop.
  ipc-parent      exports 256 KiB of cuMemAlloc memory with cuIpcGetMemHandle to an `ipc-child`
                  (a plain subprocess) that opens it with cuIpcOpenMemHandle and reads it every
                  step; both compute. 256 KiB is under the agent's conversion threshold, so the
                  agent passes the allocation through and CUDA IPC works under it.
  plain           a compute loop and nothing else (the MPS case runs it as an MPS client).
Use --device cpu with small sizes to test the logic without a GPU.
"""

import argparse
import ctypes
import hashlib
import os
import subprocess
import sys
import time

# Must be set before CUDA/cuBLAS initialise for deterministic cuBLAS.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

T0 = time.time()


def emit(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


def value_line(path, i, value):
    emit(path, "v %d %s %d" % (i, value, int(time.time() * 1e6)))


def gpu_gib(dev):
    if dev.type == "cuda":
        return round(torch.cuda.max_memory_reserved(dev) / 2**30, 3)
    return 0.0


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def set_deterministic():
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # warn_only: an op without a deterministic kernel warns (visible in the .out file) instead
    # of killing a run whose device time is scarce; the comparison still catches any difference.
    torch.use_deterministic_algorithms(True, warn_only=True)


def ready(a, dev, **kw):
    extra = " ".join("%s %s" % kv for kv in kw.items())
    emit(a.out, "ready pid %d workload %s device %s alloc_conf %s gpu_gib %s %s" % (
        os.getpid(), a.workload, dev, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "-"), gpu_gib(dev),
        extra))


def done(a, dev, n, **kw):
    extra = " ".join("%s %s" % kv for kv in kw.items())
    emit(a.out, "done n %d gpu_gib %s secs %.3f %s" % (n, gpu_gib(dev), time.time() - T0, extra))


def pace(a):
    if a.interval_ms > 0:
        time.sleep(a.interval_ms / 1000.0)


# ------------------------------------------------------------------ llama


def llama_config(a, max_pos):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
        max_position_embeddings=max_pos, attn_implementation="eager", tie_word_embeddings=False)


def build_llama(a, dev, dtype, max_pos):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.manual_seed_all(0)
    cfg = llama_config(a, max_pos)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with dev:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    nparams = sum(p.numel() for p in model.parameters())
    return model, nparams


def run_generate(a, dev):
    model, nparams = build_llama(a, dev, torch.bfloat16, a.prompt_len + a.tokens + 8)
    model.eval()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, a.vocab, (1, a.prompt_len), generator=g).to(dev)
    sync(dev)
    ready(a, dev, params=nparams, tokens=a.tokens)
    digest = hashlib.sha256()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for i in range(a.tokens):
            logits = out.logits[:, -1, :].float()
            mx, nxt = logits.max(dim=-1)
            value = "%d:%s" % (int(nxt.item()), float(mx.item()).hex())
            digest.update(value.encode())
            value_line(a.out, i, value)
            if i + 1 < a.tokens:
                out = model(input_ids=nxt.view(1, 1), past_key_values=out.past_key_values,
                            use_cache=True)
            pace(a)
    done(a, dev, a.tokens, sha256=digest.hexdigest()[:16], params=nparams)


def run_train(a, dev):
    set_deterministic()
    model, nparams = build_llama(a, dev, torch.float32, a.seq + 8)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(4321)
    use_amp = dev.type == "cuda"
    ready(a, dev, params=nparams, steps=a.steps)
    for step in range(a.steps):
        batch = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_amp):
            out = model(input_ids=batch, labels=batch)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value_line(a.out, step, float(loss.item()).hex())
        pace(a)
    done(a, dev, a.steps, params=nparams)


# ---------------------------------------------------------- process tree


def run_tree_parent(a, dev):
    here = os.path.abspath(__file__)
    kids = []
    for rank in range(a.workers):
        out = "%s.w%d" % (a.out, rank)
        cmd = [sys.executable, here, "tree-worker", "--out", out, "--gib", str(a.gib),
               "--steps", str(a.steps), "--interval-ms", str(a.interval_ms), "--rank", str(rank),
               "--device", a.device]
        log = open(out + ".stdout", "ab")
        kids.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, close_fds=True))
        log.close()
    emit(a.out, "ready pid %d workload tree-parent children %s" % (
        os.getpid(), ",".join(str(k.pid) for k in kids)))
    codes = [k.wait() for k in kids]
    emit(a.out, "done n %d codes %s secs %.3f" % (len(kids), ",".join(map(str, codes)),
                                                   time.time() - T0))
    sys.exit(0 if all(c == 0 for c in codes) else 1)


def run_tree_worker(a, dev):
    n = int(a.gib * 2**30) // 8
    big = torch.arange(n, dtype=torch.int64, device=dev)
    big.mul_(a.rank + 3)
    torch.manual_seed(100 + a.rank)
    w = (torch.randn(512, 512, device=dev) / 16).contiguous()
    s = torch.randn(512, 512, device=dev)
    sync(dev)
    ready(a, dev, rank=a.rank, gib=a.gib)
    for step in range(a.steps):
        big.add_(step + 1)
        total = int(big.sum().item())  # all of the big buffer (int64 sum wraps, deterministically)
        last = int(big[-1].item())
        s = torch.tanh(s @ w + float(step % 7))
        value_line(a.out, step, "%d:%d:%s" % (total, last, float(s.double().sum().item()).hex()))
        pace(a)
    done(a, dev, a.steps, rank=a.rank)


# ---------------------------------------------------------- small cases


def run_malloc_async(a, dev):
    torch.manual_seed(7)
    base = torch.randn(1024, 1024, device=dev)
    keep = []
    ready(a, dev, backend=torch.cuda.get_allocator_backend() if dev.type == "cuda" else "cpu")
    for step in range(a.steps):
        mib = 16 << (step % 5)  # 16..256 MiB temporaries
        t = torch.full((mib << 18,), float(step), device=dev)  # mib MiB of fp32
        u = (t[: 1 << 20].view(1024, 1024) + base) @ base
        v = float(u.double().sum().item())
        keep.append(u)
        if len(keep) > 3:
            keep.pop(0)  # freed while later work is queued: the pool reuses it
        del t
        value_line(a.out, step, "%d:%s" % (mib, v.hex()))
        pace(a)
    done(a, dev, a.steps)


def run_pinned(a, dev):
    torch.manual_seed(8)
    n = 16 << 20  # 64 MiB of fp32
    d = torch.randn(n, device=dev)
    pin_ok = dev.type == "cuda"
    h = torch.empty(n, pin_memory=pin_ok)
    h2 = torch.empty(n, pin_memory=pin_ok)
    ready(a, dev, pinned=h.is_pinned() if pin_ok else False)
    for step in range(a.steps):
        d.mul_(0.5).add_(float(step))
        h.copy_(d, non_blocking=True)
        sync(dev)
        hv = float(h[:: 4096].double().sum().item())  # read on the host, from pinned memory
        h2.copy_(h)
        h2.mul_(2.0)
        d.copy_(h2, non_blocking=True)
        sync(dev)
        value_line(a.out, step, "%s:%s" % (hv.hex(), float(d.double().sum().item()).hex()))
        pace(a)
    done(a, dev, a.steps)


def run_streams_events(a, dev):
    torch.manual_seed(9)
    x = torch.randn(2048, 2048, device=dev)
    w = torch.randn(2048, 2048, device=dev) / 64
    if dev.type != "cuda":
        ready(a, dev, streams=0)
        for step in range(a.steps):
            y = torch.tanh(x @ w + step)
            z = torch.sin(y @ w)
            x = (y + z) / 2
            value_line(a.out, step, float(x.double().sum().item()).hex())
            pace(a)
        done(a, dev, a.steps)
        return
    s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    ready(a, dev, streams=3)
    for step in range(a.steps):
        e0, e1, e2 = torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event(enable_timing=False)
        e0.record()  # on the current (default) stream: x is ready
        with torch.cuda.stream(s1):
            s1.wait_event(e0)
            y = torch.tanh(x @ w + step)
            e1.record(s1)
        with torch.cuda.stream(s2):
            s2.wait_event(e1)
            z = torch.sin(y @ w)
            e2.record(s2)
        with torch.cuda.stream(s3):
            s3.wait_event(e2)
            x_new = (y + z) / 2
        torch.cuda.current_stream().wait_stream(s3)
        # tensors used on streams other than the one they were allocated on
        y.record_stream(s2)
        y.record_stream(s3)
        z.record_stream(s3)
        x_new.record_stream(torch.cuda.current_stream())
        x = x_new
        value_line(a.out, step, float(x.double().sum().item()).hex())
        pace(a)
    done(a, dev, a.steps)


def run_cuda_graph(a, dev):
    torch.manual_seed(10)
    w = torch.randn(1024, 1024, device=dev) / 32
    static_in = torch.randn(1024, 1024, device=dev)
    if dev.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as the docs advise
            for _ in range(3):
                static_out = torch.tanh(static_in @ w) @ w
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = torch.tanh(static_in @ w) @ w

        def replay():
            graph.replay()
    else:
        static_out = torch.empty(1024, 1024)

        def replay():
            static_out.copy_(torch.tanh(static_in @ w) @ w)
    ready(a, dev, graph=dev.type == "cuda")
    state = torch.zeros(1024, 1024, device=dev)
    for step in range(a.steps):
        static_in.copy_(state + float(step) / 100.0)
        replay()
        state = static_out.clone() / 4
        value_line(a.out, step, float(static_out.double().sum().item()).hex())
        pace(a)
    done(a, dev, a.steps)


def run_managed(a, dev):
    """Holds 64 MiB of managed (unified) memory from cuMemAllocManaged, which neither the agent
    nor the driver's checkpoint can take: gpusnap must refuse the dump and the job go on."""
    torch.manual_seed(9)
    x = torch.randn(1024, 1024, device=dev)
    ptr = ctypes.c_uint64(0)
    if dev.type == "cuda":
        cu = ctypes.CDLL("libcuda.so.1")  # symbols through dlsym, as the agent interposes them
        rc = cu.cuMemAllocManaged(ctypes.byref(ptr), ctypes.c_size_t(64 << 20), ctypes.c_uint(1))
        if rc != 0:
            raise SystemExit("cuMemAllocManaged failed: %d" % rc)
    ready(a, dev, managed_ptr=hex(ptr.value))
    for step in range(a.steps):
        x, v = compute_step(x, step)
        value_line(a.out, step, v)
        pace(a)
    done(a, dev, a.steps)


# ---------------------------------------------------------- CUDA IPC and MPS

IPC_WORDS = 64 * 1024  # int32 words: 256 KiB, under the agent's 1 MiB conversion threshold


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def libcuda():
    """libcuda through dlopen/dlsym, which the agent interposes when preloaded."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemsetD32_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(CUipcMemHandle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), CUipcMemHandle,
                                          ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    return lib


def process_view():
    """(fd -> target, set of /proc/self/maps lines): what a checkpointer sees from outside."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[int(fd)] = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        return fds, set(f.read().splitlines())


def print_view_change(what, before):
    """Prints the fds and mappings that appeared since `before` (a process_view()): whether CUDA
    IPC leaves a trace a checkpointer could see without the agent."""
    fds, maps = process_view()
    new_fds = {k: v for k, v in fds.items() if before[0].get(k) != v}
    new_maps = sorted(maps - before[1])
    print("view change %s: new fds %s; %d new mappings %s" % (what, new_fds, len(new_maps), new_maps[:12]),
          flush=True)


def cu_check(rc, what):
    if rc != 0:
        raise SystemExit("%s failed: CUresult %d" % (what, rc))


def compute_step(x, step):
    """One step of the small compute loops: the new matrix and its output value."""
    x = torch.tanh(x @ x.T / 1024 + float(step % 5))
    return x, float(x.double().sum().item()).hex()


def run_ipc_parent(a, dev):
    torch.manual_seed(11)
    x = torch.randn(1024, 1024, device=dev)  # the primary context, current on this thread
    handle_hex = "00" * 64
    if dev.type == "cuda":
        cu = libcuda()
        ptr = ctypes.c_uint64(0)
        cu_check(cu.cuMemAlloc_v2(ctypes.byref(ptr), IPC_WORDS * 4), "cuMemAlloc_v2")
        cu_check(cu.cuMemsetD32_v2(ptr.value, 0x01020304, IPC_WORDS), "cuMemsetD32_v2")
        cu_check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        h = CUipcMemHandle()
        before = process_view()
        cu_check(cu.cuIpcGetMemHandle(ctypes.byref(h), ptr.value), "cuIpcGetMemHandle")
        print_view_change("cuIpcGetMemHandle", before)
        handle_hex = ctypes.string_at(ctypes.addressof(h), 64).hex()
    out = a.out + ".w0"
    cmd = [sys.executable, os.path.abspath(__file__), "ipc-child", "--out", out,
           "--handle", handle_hex, "--steps", str(a.steps), "--interval-ms", str(a.interval_ms),
           "--device", a.device]
    log = open(out + ".stdout", "ab")
    kid = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                           close_fds=True)
    log.close()
    ready(a, dev, child=kid.pid, ipc_bytes=IPC_WORDS * 4)
    for step in range(a.steps):
        x, v = compute_step(x, step)
        value_line(a.out, step, v)
        pace(a)
    code = kid.wait()  # the exported memory stays allocated until the importer is gone
    done(a, dev, a.steps, child_code=code)
    sys.exit(0 if code == 0 else 1)


def run_ipc_child(a, dev):
    torch.manual_seed(12)
    x = torch.randn(1024, 1024, device=dev)
    host = (ctypes.c_uint32 * IPC_WORDS)()
    ptr = ctypes.c_uint64(0)
    cu = None
    if dev.type == "cuda":
        cu = libcuda()
        h = CUipcMemHandle.from_buffer_copy(bytes.fromhex(a.handle))
        flags = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        before = process_view()
        cu_check(cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, flags), "cuIpcOpenMemHandle_v2")
        print_view_change("cuIpcOpenMemHandle_v2", before)
    ready(a, dev, imported=hex(ptr.value))
    for step in range(a.steps):
        if cu is not None:
            cu_check(cu.cuMemcpyDtoH_v2(ctypes.addressof(host), ptr.value, IPC_WORDS * 4),
                     "cuMemcpyDtoH_v2")
        digest = hashlib.sha256(bytes(host)).hexdigest()[:16]
        x, v = compute_step(x, step)
        value_line(a.out, step, "%s:%s" % (digest, v))
        pace(a)
    if cu is not None:
        cu_check(cu.cuIpcCloseMemHandle(ptr.value), "cuIpcCloseMemHandle")
    done(a, dev, a.steps)


def run_plain(a, dev):
    torch.manual_seed(13)
    x = torch.randn(1024, 1024, device=dev)
    ready(a, dev)
    for step in range(a.steps):
        x, v = compute_step(x, step)
        value_line(a.out, step, v)
        pace(a)
    done(a, dev, a.steps)


WORKLOADS = {
    "llama-generate": run_generate, "train": run_train, "tree-parent": run_tree_parent,
    "tree-worker": run_tree_worker, "malloc-async": run_malloc_async, "pinned": run_pinned,
    "streams-events": run_streams_events, "cuda-graph": run_cuda_graph, "managed": run_managed,
    "ipc-parent": run_ipc_parent, "ipc-child": run_ipc_child, "plain": run_plain,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--interval-ms", type=float, default=0)
    # llama model (defaults: ~1.1B parameters)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=32)
    # training
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    # process tree
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--rank", type=int, default=0)
    # CUDA IPC child: the exported handle, 64 bytes in hex
    ap.add_argument("--handle", default="00" * 64)
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda" and a.workload != "tree-parent":  # the parent holds no CUDA context
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    WORKLOADS[a.workload](a, dev)


if __name__ == "__main__":
    main()
