// Pinned-host PCIe bandwidth, driver API only.
//
// Copies --gib GiB (default 4) device->host and host->device between one
// device allocation and one pinned host allocation (cuMemHostAlloc), in
// --chunk-mib MiB chunks (default 64) spread round-robin over --streams
// streams (default 4) with cuMemcpyDtoHAsync / cuMemcpyHtoDAsync. One warm-up
// pass per direction, then --iters timed passes (default 3); reports the best
// and the mean rate in GB/s (1e9 bytes/s).
//
// Output (stdout): human-readable lines, then one JSON line:
//   {"kind": "pcie", "d2h_gbps": .., "h2d_gbps": .., "d2h_mean_gbps": .., ...}
// Exit code 1 on any CUDA error.
//
// Build: nvcc -O2 -o /tmp/pcie_bw gpu/pcie_bw.cu -lcuda
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    CUresult r_ = (x);                                                               \
    if (r_ != CUDA_SUCCESS) {                                                        \
      const char *n_ = "?";                                                          \
      cuGetErrorName(r_, &n_);                                                       \
      fprintf(stderr, "pcie_bw: %s:%d: %s failed: %d %s\n", __FILE__, __LINE__, #x, \
              (int)r_, n_ ? n_ : "?");                                               \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

static double mono_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  double gib = 4;
  long chunk_mib = 64, streams = 4, iters = 3;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (i + 1 < argc && a == "--gib") gib = atof(argv[++i]);
    else if (i + 1 < argc && a == "--chunk-mib") chunk_mib = atol(argv[++i]);
    else if (i + 1 < argc && a == "--streams") streams = atol(argv[++i]);
    else if (i + 1 < argc && a == "--iters") iters = atol(argv[++i]);
    else {
      fprintf(stderr,
              "usage: %s [--gib 4] [--chunk-mib 64] [--streams 4] [--iters 3]\n", argv[0]);
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  if (!(gib > 0) || chunk_mib <= 0 || streams <= 0 || iters <= 0) return 2;
  const size_t chunk = (size_t)chunk_mib << 20;
  size_t total = (size_t)(gib * 1073741824.0);
  total = (total / chunk) * chunk;
  if (total == 0) total = chunk;
  const size_t nchunks = total / chunk;

  CUdevice dev;
  CUcontext ctx;
  char name[256] = {0};
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDeviceGetName(name, (int)sizeof name - 1, dev));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));

  double t0 = mono_s();
  CUdeviceptr d = 0;
  CK(cuMemAlloc(&d, total));
  CK(cuMemsetD8(d, 0x5a, total));
  void *h = nullptr;
  CK(cuMemHostAlloc(&h, total, 0));
  memset(h, 0xa5, total);  // touch every page
  double t1 = mono_s();
  printf("device %s, %.2f GiB, %zu chunks of %ld MiB, %ld streams, %ld iters (setup %.2f s)\n",
         name, (double)total / 1073741824.0, nchunks, chunk_mib, streams, iters, t1 - t0);

  std::vector<CUstream> st((size_t)streams);
  for (auto &s : st) CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

  double best[2] = {0, 0}, sum[2] = {0, 0};
  const char *dir_name[2] = {"d2h", "h2d"};
  for (int dir = 0; dir < 2; dir++) {
    for (long it = -1; it < iters; it++) {  // it == -1: warm-up
      CK(cuCtxSynchronize());
      double a = mono_s();
      for (size_t c = 0; c < nchunks; c++) {
        CUstream s = st[c % st.size()];
        size_t off = c * chunk;
        if (dir == 0)
          CK(cuMemcpyDtoHAsync((char *)h + off, d + off, chunk, s));
        else
          CK(cuMemcpyHtoDAsync(d + off, (const char *)h + off, chunk, s));
      }
      for (auto &s : st) CK(cuStreamSynchronize(s));
      double b = mono_s();
      double gbps = (double)total / (b - a) / 1e9;
      if (it >= 0) {
        sum[dir] += gbps;
        if (gbps > best[dir]) best[dir] = gbps;
      }
      printf("%s %s: %.3f s, %.2f GB/s\n", dir_name[dir], it < 0 ? "warm-up" : "timed", b - a,
             gbps);
    }
  }
  printf("d2h_gbps %.2f h2d_gbps %.2f (best of %ld)\n", best[0], best[1], iters);
  printf("{\"kind\": \"pcie\", \"device\": \"%s\", \"d2h_gbps\": %.2f, \"h2d_gbps\": %.2f, "
         "\"d2h_mean_gbps\": %.2f, \"h2d_mean_gbps\": %.2f, \"bytes\": %zu, \"chunk_mib\": %ld, "
         "\"streams\": %ld, \"iters\": %ld}\n",
         name, best[0], best[1], sum[0] / iters, sum[1] / iters, total, chunk_mib, streams, iters);
  for (auto &s : st) CK(cuStreamDestroy(s));
  CK(cuMemFreeHost(h));
  CK(cuMemFree(d));
  CK(cuDevicePrimaryCtxRelease(dev));
  return 0;
}
