// Allocation latency with and without the gpusnap agent: median time of cuMemAlloc_v2 and
// cuMemFree_v2 per size (the agent turns allocations of 1 MiB or more into VMM mappings:
// reserve + create + map + set access). Driver API only, linked with -lcuda, so an
// LD_PRELOADed agent interposes on the calls.
// Build: nvcc -O2 -o /tmp/gpusnap-bin/alloc_latency gpu/alloc_latency.cu -lcuda
// Run:   alloc_latency [label]   -> one JSON line per size on stdout
#include <cuda.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

static double now_us() {
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

static int check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        const char *s = "?";
        cuGetErrorName(r, &s);
        std::fprintf(stderr, "%s failed: %s\n", what, s);
        return 1;
    }
    return 0;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char **argv) {
    const char *label = argc > 1 ? argv[1] : "plain";
    CUdevice dev;
    CUcontext ctx;
    if (check(cuInit(0), "cuInit") || check(cuDeviceGet(&dev, 0), "cuDeviceGet") ||
        check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain") ||
        check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent"))
        return 1;
    const size_t sizes[] = {512u << 10, 1u << 20, 2u << 20, 64u << 20, 1u << 30};
    for (size_t size : sizes) {
        const int iters = size >= (1u << 30) ? 20 : 200;
        std::vector<double> alloc_us, free_us;
        for (int i = 0; i < iters + 5; i++) {
            CUdeviceptr p = 0;
            double t0 = now_us();
            if (check(cuMemAlloc_v2(&p, size), "cuMemAlloc_v2")) return 1;
            double t1 = now_us();
            if (check(cuMemFree_v2(p), "cuMemFree_v2")) return 1;
            double t2 = now_us();
            if (i >= 5) {  // warm-up excluded
                alloc_us.push_back(t1 - t0);
                free_us.push_back(t2 - t1);
            }
        }
        std::printf("{\"kind\": \"alloc-latency\", \"label\": \"%s\", \"bytes\": %zu, \"iters\": %d, "
                    "\"alloc_us_median\": %.1f, \"free_us_median\": %.1f}\n",
                    label, size, iters, median(alloc_us), median(free_us));
    }
    return 0;
}
