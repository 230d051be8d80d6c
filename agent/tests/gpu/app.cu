// Test workload for the agent on a GPU machine (not built by cargo). Allocates device memory
// every way the agent sees it (cudaMalloc small and large, cudaMallocPitch, driver cuMemAlloc,
// the application's own cuMemCreate + cuMemMap), fills it, remembers checksums, then obeys
// commands on stdin: check | mem | touch | exit.
// Build: nvcc -O2 -o app app.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <unistd.h>

static void die(const char *what, int line, const char *msg) {
  fprintf(stderr, "app: line %d: %s failed: %s\n", line, what, msg);
  exit(2);
}
#define RT(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) die(#x, __LINE__, cudaGetErrorString(e_)); } while (0)
#define DR(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = "?"; cuGetErrorName(r_, &s_); die(#x, __LINE__, s_); } } while (0)

__global__ void fill(unsigned long long *p, size_t n, unsigned long long seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (i * 0x9E3779B97F4A7C15ull) ^ seed;
}
__global__ void sum(const unsigned long long *p, size_t n, unsigned long long *out) {
  unsigned long long s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    s += p[i] * (i | 1);
  atomicAdd(out, s);
}

struct Buf { std::string how; CUdeviceptr p; size_t bytes; unsigned long long seed, ref; };
static std::vector<Buf> bufs;
static unsigned long long *d_out;

static unsigned long long checksum(const Buf &b) {
  RT(cudaMemset(d_out, 0, 8));
  sum<<<264, 256>>>((const unsigned long long *)b.p, b.bytes / 8, d_out);
  RT(cudaGetLastError());
  unsigned long long h = 0;
  RT(cudaMemcpy(&h, d_out, 8, cudaMemcpyDeviceToHost));
  return h;
}
static void fill_all(unsigned long long round) {
  for (auto &b : bufs) {
    b.seed = round * 1000003ull + (unsigned long long)b.p;
    fill<<<264, 256>>>((unsigned long long *)b.p, b.bytes / 8, b.seed);
    RT(cudaGetLastError());
  }
  RT(cudaDeviceSynchronize());
  for (auto &b : bufs) b.ref = checksum(b);
}

int main(int argc, char **argv) {
  size_t big = (argc > 1 ? strtoull(argv[1], 0, 0) : 1024) << 20;
  RT(cudaSetDevice(0));
  RT(cudaFree(0));
  RT(cudaMalloc((void **)&d_out, 8));
  auto rt = [](const char *how, size_t bytes) {
    void *p = 0;
    RT(cudaMalloc(&p, bytes));
    bufs.push_back({how, (CUdeviceptr)p, bytes, 0, 0});
  };
  rt("cudaMalloc 512KiB", 512 << 10);
  rt("cudaMalloc 3MiB+8", (3 << 20) + 8);
  rt("cudaMalloc 64MiB", 64 << 20);
  rt("cudaMalloc big", big + 4096);
  {
    void *p = 0; size_t pitch = 0;
    RT(cudaMallocPitch(&p, &pitch, 5000, 300));
    if (pitch < 5000) { fprintf(stderr, "app: bad pitch %zu\n", pitch); return 2; }
    bufs.push_back({"cudaMallocPitch 5000x300 pitch " + std::to_string(pitch), (CUdeviceptr)p, pitch * 300, 0, 0});
  }
  {
    CUdeviceptr p = 0;
    DR(cuMemAlloc(&p, 32 << 20));
    bufs.push_back({"cuMemAlloc 32MiB", p, 32 << 20, 0, 0});
  }
  {
    void *p = 0;
    RT(cudaMalloc(&p, 16 << 20));
    RT(cudaFree(p));  // a converted allocation freed before any dump
  }
  CUmemGenericAllocationHandle vh = 0; CUdeviceptr vp = 0; size_t vsz = 0;
  {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    DR(cuMemGetAllocationGranularity(&vsz, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    vsz *= 2;
    DR(cuMemAddressReserve(&vp, vsz, 0, 0, 0));
    DR(cuMemCreate(&vh, vsz, &prop, 0));
    DR(cuMemMap(vp, vsz, 0, vh, 0));
    CUmemAccessDesc ad = {};
    ad.location = prop.location;
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    DR(cuMemSetAccess(vp, vsz, &ad, 1));
    bufs.push_back({"app cuMemCreate+cuMemMap", vp, vsz, 0, 0});
  }
  fill_all(1);
  for (auto &b : bufs) printf("BUF %s at 0x%llx, %zu bytes\n", b.how.c_str(), (unsigned long long)b.p, b.bytes);
  printf("READY %d\n", (int)getpid());
  fflush(stdout);

  char line[64];
  unsigned long long round = 1;
  while (fgets(line, sizeof line, stdin)) {
    if (!strncmp(line, "check", 5)) {
      int bad = 0;
      for (auto &b : bufs) {
        unsigned long long h = checksum(b);
        if (h != b.ref) { printf("CHECK FAIL %s: %llx != %llx\n", b.how.c_str(), h, b.ref); bad++; }
      }
      if (!bad) printf("CHECK OK %zu buffers\n", bufs.size());
    } else if (!strncmp(line, "mem", 3)) {
      size_t f = 0, t = 0;
      RT(cudaMemGetInfo(&f, &t));
      printf("MEM used %zu MiB of %zu MiB\n", (t - f) >> 20, t >> 20);
    } else if (!strncmp(line, "touch", 5)) {
      fill_all(++round);
      printf("TOUCHED round %llu\n", round);
    } else if (!strncmp(line, "exit", 4)) {
      for (auto &b : bufs) {
        if (b.p == vp) continue;
        if (b.how.rfind("cuMemAlloc", 0) == 0) DR(cuMemFree(b.p)); else RT(cudaFree((void *)b.p));
      }
      DR(cuMemUnmap(vp, vsz));
      DR(cuMemRelease(vh));
      DR(cuMemAddressFree(vp, vsz));
      RT(cudaFree(d_out));
      RT(cudaDeviceSynchronize());
      printf("EXIT OK\n");
      fflush(stdout);
      return 0;
    }
    fflush(stdout);
  }
  return 0;
}
