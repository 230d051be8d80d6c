// gpusnap end-to-end / benchmark workload.
//
// Holds N GiB of device memory in chunks, fills it with a deterministic
// pattern, computes a reference checksum once, then every interval:
//   - re-checksums ALL the pattern data on the GPU (position-dependent hash,
//     so data restored at the wrong offset or chunks swapped are detected),
//   - increments a device-resident counter and mixes it into a device-resident
//     running state (state = state * LCG_A + counter),
//   - copies sum, counter and state back and appends one line to the log:
//     tick T counter C state 0x.. sum 0x.. ok 0|1 err E us <realtime us> dt_us <tick time>
// The control words (sum accumulator, counter, state) live in the first 4 KiB
// of allocation 0; the checksum covers every other word of every allocation.
//
// --devices 0,1 spreads the allocations round robin over several GPUs (no peer
// access: each GPU checksums its own allocations into the control words at the
// start of its first allocation; the host adds the per-GPU sums).
//
// CUDA errors never stop the loop: they are logged (an "error" line plus
// ok 0 / err <code> on the tick line) so that a checker sees failures.
//
// Build: nvcc -O2 -o /tmp/workload gpu/workload.cu -lcuda
// Usage: workload --gib N [--chunk-mib M] [--alloc driver|runtime]
//                 [--log FILE] [--interval-ms MS] [--devices 0,1] [--reserve-gib R]
//
// --reserve-gib R also allocates R GiB (in chunk-sized allocations on the first device) that
// the workload never writes, as JAX's preallocation or a server's KV-cache reservation does;
// every tick checks that the first, middle and last word of each reserved allocation read 0.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include <sys/types.h>
#include <unistd.h>

typedef unsigned long long u64;

#define PAT_MUL 0x9E3779B97F4A7C15ull
#define PAT_ALLOC 0xC2B2AE3D27D4EB4Full
#define MIX_A 0xBF58476D1CE4E5B9ull
#define MIX_B 0x94D049BB133111EBull
#define LCG_A 6364136223846793005ull
#define STATE0 0x243F6A8885A308D3ull
// Words reserved at the start of allocation 0 for control data (4 KiB).
#define CTRL_WORDS 512ull
// Control word indices.
#define C_SUM 0
#define C_COUNTER 1
#define C_STATE 2

static const char *g_log = "/tmp/workload.log";

static void logf_(const char *fmt, ...) {
  va_list ap;
  FILE *f = fopen(g_log, "a");
  if (!f) {
    fprintf(stderr, "workload: cannot open log %s: %s\n", g_log, strerror(errno));
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return;
  }
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  fflush(f);
  fclose(f);
}

static u64 now_us() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (u64)ts.tv_sec * 1000000ull + (u64)ts.tv_nsec / 1000ull;
}

static double mono_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(long ms) {
  struct timespec req, rem;
  req.tv_sec = ms / 1000;
  req.tv_nsec = (ms % 1000) * 1000000L;
  while (nanosleep(&req, &rem) != 0 && errno == EINTR) req = rem;
}

// ---------------------------------------------------------------- kernels

__device__ __forceinline__ u64 pattern(u64 gi, u64 alloc) {
  return (gi * PAT_MUL) ^ ((alloc + 1ull) * PAT_ALLOC);
}

__device__ __forceinline__ u64 mix(u64 v, u64 gi) {
  u64 t = (v ^ (gi * MIX_A)) * MIX_B;
  return t ^ (t >> 31);
}

// p[i] = pattern(gbase + i, alloc) for i in [0, n)
__global__ void fill_kernel(u64 *p, u64 n, u64 gbase, u64 alloc) {
  u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = pattern(gbase + i, alloc);
}

// *out += sum over i in [start, n) of mix(p[i], gbase + i)   (mod 2^64)
// blockDim.x must be a multiple of 32 and at most 1024.
__global__ void checksum_kernel(const u64 *p, u64 start, u64 n, u64 gbase, u64 *out) {
  u64 stride = (u64)gridDim.x * blockDim.x;
  u64 s = 0;
  for (u64 i = start + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    s += mix(p[i], gbase + i);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  __shared__ u64 warp_sums[32];
  unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = (lane < (blockDim.x >> 5)) ? warp_sums[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
    if (lane == 0) atomicAdd(out, s);
  }
}

__global__ void init_ctrl_kernel(u64 *ctrl) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (u64 i = 0; i < CTRL_WORDS; i++) ctrl[i] = 0;
    ctrl[C_STATE] = STATE0;
  }
}

__global__ void begin_tick_kernel(u64 *ctrl) {
  if (blockIdx.x == 0 && threadIdx.x == 0) ctrl[C_SUM] = 0;
}

__global__ void end_tick_kernel(u64 *ctrl) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    u64 c = ctrl[C_COUNTER] + 1;
    ctrl[C_COUNTER] = c;
    ctrl[C_STATE] = ctrl[C_STATE] * LCG_A + c;
  }
}

// ------------------------------------------------------------- host side

struct Chunk {
  u64 *ptr;
  u64 words;
  u64 gbase;  // global word index of word 0
  size_t dev;  // index into g_devs
  bool first_on_dev;  // starts with that GPU's control words
};

static bool g_driver = true;
static std::vector<Chunk> g_chunks;
static u64 *g_ctrl = nullptr;  // control words of the first GPU (counter, state, its sum)
static std::vector<int> g_devs;  // CUDA ordinals in use
static std::vector<CUcontext> g_ctxs;  // their primary contexts (driver mode)
static std::vector<u64 *> g_dev_ctrl;  // control words of each GPU (its sum)
static int g_grid = 1024;
static const int BLOCK = 256;

// Error lines written so far; capped so that a sticky error cannot flood the log.
static long g_error_lines = 0;
static const long MAX_ERROR_LINES = 200;

// Records the first error code of a tick and logs the error (up to MAX_ERROR_LINES in all).
struct Err {
  int code = 0;
  void rt(cudaError_t e, const char *what, long tick) {
    if (e == cudaSuccess) return;
    if (!code) code = (int)e;
    if (++g_error_lines > MAX_ERROR_LINES) return;
    logf_("error tick %ld where %s runtime %d %s: %s", tick, what, (int)e, cudaGetErrorName(e),
          cudaGetErrorString(e));
  }
  void drv(CUresult r, const char *what, long tick) {
    if (r == CUDA_SUCCESS) return;
    if (!code) code = (int)r;
    if (++g_error_lines > MAX_ERROR_LINES) return;
    const char *name = "?", *str = "?";
    cuGetErrorName(r, &name);
    cuGetErrorString(r, &str);
    logf_("error tick %ld where %s driver %d %s: %s", tick, what, (int)r, name ? name : "?",
          str ? str : "?");
  }
};

static void copy_d2h(void *dst, const void *src, size_t bytes, Err &err, const char *what,
                     long tick) {
  if (g_driver)
    err.drv(cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes), what, tick);
  else
    err.rt(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), what, tick);
}

// Makes GPU g_devs[k] current for the following launches and copies.
static void use_dev(size_t k, Err &err, long tick) {
  if (g_driver) err.drv(cuCtxSetCurrent(g_ctxs[k]), "cuCtxSetCurrent", tick);
  err.rt(cudaSetDevice(g_devs[k]), "cudaSetDevice", tick);
}

static void sync_all(Err &err, const char *what, long tick) {
  for (size_t k = 0; k < g_devs.size(); k++) {
    use_dev(k, err, tick);
    if (g_driver)
      err.drv(cuCtxSynchronize(), what, tick);
    else
      err.rt(cudaDeviceSynchronize(), what, tick);
  }
  use_dev(0, err, tick);
}

// Launches the checksum of everything into ctrl[C_SUM] (after zeroing it).
static void launch_checksum(Err &err, long tick) {
  for (size_t k = 0; k < g_devs.size(); k++) {
    use_dev(k, err, tick);
    begin_tick_kernel<<<1, 32>>>(g_dev_ctrl[k]);
    err.rt(cudaGetLastError(), "launch begin_tick", tick);
  }
  for (size_t c = 0; c < g_chunks.size(); c++) {
    const Chunk &ch = g_chunks[c];
    if (g_devs.size() > 1) use_dev(ch.dev, err, tick);
    u64 start = ch.first_on_dev ? CTRL_WORDS : 0;
    checksum_kernel<<<g_grid, BLOCK>>>(ch.ptr, start, ch.words, ch.gbase, g_dev_ctrl[ch.dev] + C_SUM);
    err.rt(cudaGetLastError(), "launch checksum", tick);
  }
  use_dev(0, err, tick);
}

// Copies the control words of the first GPU to h and adds the other GPUs' sums to h[C_SUM].
static void read_ctrl(u64 h[3], Err &err, const char *what, long tick) {
  copy_d2h(h, g_ctrl, 3 * sizeof(u64), err, what, tick);
  for (size_t k = 1; k < g_devs.size(); k++) {
    u64 s = 0;
    use_dev(k, err, tick);
    copy_d2h(&s, g_dev_ctrl[k] + C_SUM, sizeof s, err, what, tick);
    h[C_SUM] += s;
  }
  use_dev(0, err, tick);
}

static u64 host_pattern(u64 gi, u64 alloc) { return (gi * PAT_MUL) ^ ((alloc + 1ull) * PAT_ALLOC); }

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s --gib N [--chunk-mib M] [--alloc driver|runtime] [--log FILE] "
          "[--interval-ms MS] [--devices 0,1]\n"
          "  --gib N         device data in GiB (may be fractional, e.g. 0.25; default 1)\n"
          "  --chunk-mib M   size of each allocation in MiB (default 1024)\n"
          "  --alloc A       driver: cuMemAlloc (driver API); runtime: cudaMalloc (default driver)\n"
          "  --log FILE      log file, appended (default /tmp/workload.log)\n"
          "  --interval-ms   pause between ticks (default 100)\n"
          "  --devices LIST  CUDA ordinals, comma separated; allocations round robin (default 0)\n"
          "  --reserve-gib R also allocate R GiB never written (checked to read 0 every tick)\n",
          argv0);
}

int main(int argc, char **argv) {
  double gib = 1.0, reserve_gib = 0.0;
  long chunk_mib = 1024;
  long interval_ms = 100;
  std::string alloc = "driver";
  std::string devices = "0";
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto need = [&](void) -> const char * {
      if (i + 1 >= argc) {
        fprintf(stderr, "workload: %s needs a value\n", a.c_str());
        usage(argv[0]);
        exit(2);
      }
      return argv[++i];
    };
    if (a == "--gib") gib = atof(need());
    else if (a == "--chunk-mib") chunk_mib = atol(need());
    else if (a == "--alloc") alloc = need();
    else if (a == "--log") g_log = need();
    else if (a == "--interval-ms") interval_ms = atol(need());
    else if (a == "--devices") devices = need();
    else if (a == "--reserve-gib") reserve_gib = atof(need());
    else if (a == "-h" || a == "--help") { usage(argv[0]); return 0; }
    else { fprintf(stderr, "workload: unknown argument %s\n", a.c_str()); usage(argv[0]); return 2; }
  }
  if (!(gib > 0) || chunk_mib <= 0 || interval_ms < 0 || (alloc != "driver" && alloc != "runtime")) {
    usage(argv[0]);
    return 2;
  }
  g_driver = (alloc == "driver");
  for (size_t pos = 0; pos <= devices.size();) {
    size_t end = devices.find(',', pos);
    if (end == std::string::npos) end = devices.size();
    std::string item = devices.substr(pos, end - pos);
    char *rest = nullptr;
    long ord = strtol(item.c_str(), &rest, 10);
    if (item.empty() || *rest || ord < 0) {
      fprintf(stderr, "workload: bad --devices %s\n", devices.c_str());
      return 2;
    }
    g_devs.push_back((int)ord);
    pos = end + 1;
  }
  const char *preload = getenv("LD_PRELOAD");
  logf_("start pid %d gib %g chunk_mib %ld alloc %s interval_ms %ld devices %s ld_preload %s",
        (int)getpid(), gib, chunk_mib, alloc.c_str(), interval_ms, devices.c_str(),
        preload && *preload ? preload : "-");

  u64 total = (u64)(gib * 1073741824.0);
  total &= ~(u64)((2ull << 20) - 1);  // whole 2 MiB
  u64 chunk_bytes = (u64)chunk_mib << 20;
  if (total < (CTRL_WORDS * 8ull) * 2) total = 2ull << 20;
  if (chunk_bytes < (2ull << 20)) chunk_bytes = 2ull << 20;

  Err err;
  double t0 = mono_s();
  if (g_driver) err.drv(cuInit(0), "cuInit", -1);
  for (size_t k = 0; k < g_devs.size() && !err.code; k++) {
    if (g_driver) {
      CUdevice dev;
      CUcontext ctx = nullptr;
      err.drv(cuDeviceGet(&dev, g_devs[k]), "cuDeviceGet", -1);
      err.drv(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain", -1);
      g_ctxs.push_back(ctx);
      err.drv(cuCtxSetCurrent(ctx), "cuCtxSetCurrent", -1);
    } else {
      err.rt(cudaSetDevice(g_devs[k]), "cudaSetDevice", -1);
      err.rt(cudaFree(0), "cudaFree(0)", -1);
    }
  }
  g_dev_ctrl.assign(g_devs.size(), nullptr);
  if (!err.code) use_dev(0, err, -1);
  if (err.code) {
    logf_("fatal: CUDA initialisation failed (%d)", err.code);
    return 1;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g_devs[0]) == cudaSuccess &&
      sms > 0)
    g_grid = sms * 8;

  u64 gbase = 0;
  for (u64 off = 0, no = 0; off < total; no++) {
    u64 bytes = total - off < chunk_bytes ? total - off : chunk_bytes;
    size_t k = (size_t)(no % g_devs.size());
    use_dev(k, err, -1);
    void *p = nullptr;
    if (g_driver) {
      CUdeviceptr d = 0;
      CUresult r = cuMemAlloc(&d, (size_t)bytes);
      err.drv(r, "cuMemAlloc", -1);
      if (r != CUDA_SUCCESS) { logf_("fatal: allocation %llu of %llu bytes failed", no, bytes); return 1; }
      p = (void *)(uintptr_t)d;
    } else {
      cudaError_t e = cudaMalloc(&p, (size_t)bytes);
      err.rt(e, "cudaMalloc", -1);
      if (e != cudaSuccess) { logf_("fatal: allocation %llu of %llu bytes failed", no, bytes); return 1; }
    }
    Chunk c;
    c.ptr = (u64 *)p;
    c.words = bytes / 8;
    c.gbase = gbase;
    c.dev = k;
    c.first_on_dev = (g_dev_ctrl[k] == nullptr);
    if (c.first_on_dev) g_dev_ctrl[k] = c.ptr;
    g_chunks.push_back(c);
    logf_("alloc %llu ptr 0x%llx bytes %llu device %d", no, (u64)(uintptr_t)p, bytes, g_devs[k]);
    gbase += c.words;
    off += bytes;
  }
  for (size_t k = 0; k < g_devs.size(); k++) {
    if (!g_dev_ctrl[k]) {
      logf_("fatal: device %d got no allocation (raise --gib or lower --chunk-mib)", g_devs[k]);
      return 1;
    }
  }
  // Reserved, never written: in chunk-sized allocations on the first device.
  std::vector<std::pair<u64, u64>> reserved;  // (device address, bytes)
  u64 reserve_total = (u64)(reserve_gib * 1073741824.0) & ~(u64)((2ull << 20) - 1);
  use_dev(0, err, -1);
  for (u64 off = 0, no = 0; off < reserve_total; no++) {
    u64 bytes = reserve_total - off < chunk_bytes ? reserve_total - off : chunk_bytes;
    void *p = nullptr;
    if (g_driver) {
      CUdeviceptr d = 0;
      CUresult r = cuMemAlloc(&d, (size_t)bytes);
      err.drv(r, "cuMemAlloc reserve", -1);
      if (r != CUDA_SUCCESS) { logf_("fatal: reserve %llu of %llu bytes failed", no, bytes); return 1; }
      p = (void *)(uintptr_t)d;
    } else {
      cudaError_t e = cudaMalloc(&p, (size_t)bytes);
      err.rt(e, "cudaMalloc reserve", -1);
      if (e != cudaSuccess) { logf_("fatal: reserve %llu of %llu bytes failed", no, bytes); return 1; }
    }
    reserved.push_back({(u64)(uintptr_t)p, bytes});
    logf_("reserve %llu ptr 0x%llx bytes %llu device %d", no, (u64)(uintptr_t)p, bytes, g_devs[0]);
    off += bytes;
  }
  double t_alloc = mono_s();
  for (size_t c = 0; c < g_chunks.size(); c++) {
    use_dev(g_chunks[c].dev, err, -1);
    fill_kernel<<<g_grid, BLOCK>>>(g_chunks[c].ptr, g_chunks[c].words, g_chunks[c].gbase, (u64)c);
    err.rt(cudaGetLastError(), "launch fill", -1);
  }
  g_ctrl = g_chunks[0].ptr;
  for (size_t k = 0; k < g_devs.size(); k++) {
    use_dev(k, err, -1);
    init_ctrl_kernel<<<1, 32>>>(g_dev_ctrl[k]);
    err.rt(cudaGetLastError(), "launch init_ctrl", -1);
  }
  sync_all(err, "sync fill", -1);
  double t_fill = mono_s();

  // Spot check: first and last pattern word of every chunk (host-computed).
  int spot_ok = 1;
  for (size_t c = 0; c < g_chunks.size(); c++) {
    u64 first_i = g_chunks[c].first_on_dev ? CTRL_WORDS : 0, last_i = g_chunks[c].words - 1;
    u64 v[2] = {0, 0};
    // From the owning GPU's context: the agent's VMM mappings are accessible from that GPU
    // only, where cuMemAlloc memory is reachable from any context (UVA).
    use_dev(g_chunks[c].dev, err, -1);
    copy_d2h(&v[0], g_chunks[c].ptr + first_i, 8, err, "spot copy", -1);
    copy_d2h(&v[1], g_chunks[c].ptr + last_i, 8, err, "spot copy", -1);
    if (v[0] != host_pattern(g_chunks[c].gbase + first_i, c) ||
        v[1] != host_pattern(g_chunks[c].gbase + last_i, c)) {
      spot_ok = 0;
      logf_("error spot check chunk %zu: got 0x%llx 0x%llx", c, v[0], v[1]);
    }
  }

  use_dev(0, err, -1);
  launch_checksum(err, -1);
  sync_all(err, "sync ref", -1);
  u64 ctrl_h[3] = {0, 0, 0};
  read_ctrl(ctrl_h, err, "copy ref", -1);
  double t_ref = mono_s();
  const u64 ref = ctrl_h[C_SUM];
  if (err.code || !spot_ok) {
    logf_("fatal: fill or reference checksum failed (err %d spot_ok %d)", err.code, spot_ok);
    return 1;
  }
  logf_("ready pid %d gib %g chunks %zu chunk_bytes %llu total_bytes %llu alloc %s ref 0x%016llx "
        "state0 0x%016llx lcg_a %llu interval_ms %ld alloc_ms %.1f fill_ms %.1f "
        "ref_ms %.1f spot_ok %d devices %s",
        (int)getpid(), gib, g_chunks.size(), chunk_bytes, total, alloc.c_str(), ref,
        (u64)STATE0, (u64)LCG_A, interval_ms, (t_alloc - t0) * 1e3, (t_fill - t_alloc) * 1e3,
        (t_ref - t_fill) * 1e3, spot_ok, devices.c_str());

  for (long tick = 0;; tick++) {
    Err te;
    double a = mono_s();
    launch_checksum(te, tick);
    end_tick_kernel<<<1, 32>>>(g_ctrl);
    te.rt(cudaGetLastError(), "launch end_tick", tick);
    sync_all(te, "sync tick", tick);
    u64 h[3] = {0, 0, 0};
    read_ctrl(h, te, "copy ctrl", tick);
    // The reserved memory still reads 0 (first, middle and last word of each allocation).
    int reserve_ok = 1;
    if (!reserved.empty()) use_dev(0, te, tick);
    for (auto &r : reserved) {
      u64 at[3] = {0, r.second / 16 * 8, r.second - 8};
      for (u64 o : at) {
        u64 v = 1;
        copy_d2h(&v, (u64 *)(uintptr_t)(r.first + o), 8, te, "reserve check", tick);
        if (v != 0) reserve_ok = 0;
      }
    }
    double b = mono_s();
    int ok = (te.code == 0 && h[C_SUM] == ref && reserve_ok) ? 1 : 0;
    logf_("tick %ld counter %llu state 0x%016llx sum 0x%016llx ok %d err %d us %llu dt_us %llu",
          tick, h[C_COUNTER], h[C_STATE], h[C_SUM], ok, te.code, now_us(),
          (u64)((b - a) * 1e6));
    if (interval_ms > 0) sleep_ms(interval_ms);
  }
  return 0;
}
