// gpusnap-sum64: the device-side chunk hash of gpusnap (docs/image-format.md, "Device hash").
// Built to PTX by gpu/devhash/build.sh (nvcc on the GPU machine) into agent/src/devhash/sum64.ptx,
// which the agent loads with cuModuleLoadData. The host reference is image/src/devhash.rs; both
// must agree bit for bit (gpu/devhash/test_sum64.py checks this on a GPU).
//
// For the 8-byte little-endian words w[0..n) of a chunk, the kernel adds into out[0] the sum
// (mod 2^64) of fmix64(w[i] ^ (i * K)) and ORs every word into out[1]; out must be zeroed first.
// The sum is order-free, so any number of threads may add in any order.

#define K 0x9E3779B97F4A7C15ull

__device__ __forceinline__ unsigned long long fmix64(unsigned long long k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

extern "C" __global__ void gpusnap_sum64(const unsigned long long *__restrict__ words,
                                         unsigned long long n, unsigned long long *out) {
    unsigned long long sum = 0, any = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        unsigned long long w = words[i];
        any |= w;
        sum += fmix64(w ^ (i * K));
    }
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, off);
        any |= __shfl_down_sync(0xffffffffu, any, off);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(&out[0], sum);
        atomicOr(&out[1], any);
    }
}
