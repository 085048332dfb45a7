// Probe: can L2 hold one layer's dense weights while the MoE streams past them?
//
// Question (docs/perf/cuda-model.md, v10): a decode layer leaves DRAM idle during its latency-bound
// steps (attention, the norms, routing). If the next layer's q/k/v matrix (21 MB at Qwen3-30B-A3B
// shapes) were pulled into L2 then, it would have to survive the layer's expert stream (75 MB)
// before its GEMV reads it. This measures, with kernel durations from %globaltimer (first block
// in to last block out, no launch overhead):
//   cold  : read A after a flush (A from DRAM)
//   hot   : read A right after reading A (A from L2)
//   held  : prefetch A into L2 (policy P), stream B (load policy Q), then read A
// for A of 21 and 38 MB, B of 75 MB, with and without an L2 set-aside for persisting lines.
//
// Build and run on the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o /tmp/l2_hold scripts/probes/l2_hold.cu && /tmp/l2_hold
#include "probe.cuh"

#include <algorithm>
#include <cstdio>
#include <vector>

enum Policy { NORMAL = 0, FIRST = 1, LAST = 2 };

__device__ __forceinline__ u64 make_policy(int p) {
    u64 pol = 0;
    if (p == FIRST) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    if (p == LAST) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

__device__ __forceinline__ uint4 ld16(const uint4* p, int policy, u64 pol) {
    uint4 r;
    if (policy == NORMAL) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                     : "l"(p));
    } else {
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                     : "l"(p), "l"(pol));
    }
    return r;
}

// span[0] = earliest block start, span[1] = latest block end (ns).
__device__ __forceinline__ void stamp_in(u64* span) {
    if (span && threadIdx.x == 0) atomicMin(span, now());
}
__device__ __forceinline__ void stamp_out(u64* span) {
    __syncthreads();
    if (span && threadIdx.x == 0) atomicMax(span + 1, now());
}

// Reads n 16-byte chunks, 4 in flight per thread; folds them so that nothing is dead code.
__global__ void __launch_bounds__(256) read_all(const uint4* p, u64 n, int policy, unsigned* sink,
                                                u64* span) {
    stamp_in(span);
    const u64 pol = make_policy(policy);
    const u64 stride = (u64)gridDim.x * blockDim.x;
    unsigned acc = 0;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = ld16(p + i, policy, pol), b = ld16(p + i + stride, policy, pol);
        uint4 c = ld16(p + i + 2 * stride, policy, pol), d = ld16(p + i + 3 * stride, policy, pol);
        acc ^= a.x ^ b.y ^ c.z ^ d.w ^ a.w ^ b.x ^ c.y ^ d.z;
    }
    for (; i < n; i += stride) acc ^= ld16(p + i, policy, pol).x;
    if (acc == 0x9e3779b9u) sink[0] = acc;
    stamp_out(span);
}

// The bulk copy engine pulls [p, p + bytes) into L2, 64 KiB per instruction, one thread each.
__global__ void prefetch_bulk(const char* p, u64 bytes, int policy, u64* span) {
    stamp_in(span);
    const u64 pol = make_policy(policy);
    const u64 chunk = 65536;
    for (u64 off = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * chunk; off < bytes;
         off += (u64)gridDim.x * blockDim.x * chunk) {
        const unsigned size = (unsigned)(bytes - off < chunk ? bytes - off : chunk);
        if (policy == NORMAL) {
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(size) : "memory");
        } else {
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p + off),
                         "r"(size), "l"(pol)
                         : "memory");
        }
    }
    stamp_out(span);
}

struct Bufs {
    char* flush;
    u64 flush_bytes;
    char* a;
    char* b;
    unsigned* sink;
    u64* span;
};

static int g_blocks;

static void read(const Bufs& z, const char* p, u64 bytes, int policy, bool timed) {
    read_all<<<g_blocks, 256>>>((const uint4*)p, bytes / 16, policy, z.sink, timed ? z.span : nullptr);
}

static double timed_read(const Bufs& z, const char* p, u64 bytes) {
    u64 init[2] = {~0ull, 0};
    CHECK(cudaMemcpy(z.span, init, sizeof init, cudaMemcpyHostToDevice));
    read(z, p, bytes, NORMAL, true);
    CHECK(cudaDeviceSynchronize());
    u64 got[2];
    CHECK(cudaMemcpy(got, z.span, sizeof got, cudaMemcpyDeviceToHost));
    return (got[1] - got[0]) / 1000.0;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// The three cases for A of a_bytes, with prefetch policy pp and stream policy sp for the held case.
static void run(const Bufs& z, u64 a_bytes, u64 b_bytes, int pp, int sp, const char* label) {
    const int reps = 15;
    std::vector<double> cold, hot, held, pf;
    for (int r = 0; r < reps; ++r) {
        read(z, z.flush, z.flush_bytes, NORMAL, false);
        cold.push_back(timed_read(z, z.a, a_bytes));
        hot.push_back(timed_read(z, z.a, a_bytes));
        read(z, z.flush, z.flush_bytes, NORMAL, false);
        prefetch_bulk<<<(unsigned)((a_bytes / 65536 + 255) / 256), 256>>>(z.a, a_bytes, pp, nullptr);
        read(z, z.b, b_bytes, sp, false);
        held.push_back(timed_read(z, z.a, a_bytes));
        CHECK(cudaCtxResetPersistingL2Cache());
        // How long DRAM is busy with the prefetch: prefetch then an immediate timed read of A.
        read(z, z.flush, z.flush_bytes, NORMAL, false);
        prefetch_bulk<<<(unsigned)((a_bytes / 65536 + 255) / 256), 256>>>(z.a, a_bytes, pp, nullptr);
        pf.push_back(timed_read(z, z.a, a_bytes));
        CHECK(cudaCtxResetPersistingL2Cache());
    }
    printf("%-44s A %5.1f MB: cold %6.2f us (%5.0f GB/s)  hot %6.2f us  held %6.2f us  prefetch+read %6.2f us\n",
           label, a_bytes / 1e6, median(cold), a_bytes / median(cold) / 1e3, median(hot), median(held),
           median(pf));
}

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    g_blocks = prop.multiProcessorCount * 8;
    printf("%s: %d SMs, L2 %d MB, persisting L2 max %d MB\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20, prop.persistingL2CacheMaxSize >> 20);
    Bufs z;
    z.flush_bytes = 512ull << 20;
    const u64 a_max = 40ull << 20, b_bytes = 75'500'000ull;
    CHECK(cudaMalloc(&z.flush, z.flush_bytes));
    CHECK(cudaMalloc(&z.a, a_max));
    CHECK(cudaMalloc(&z.b, b_bytes));
    CHECK(cudaMalloc(&z.sink, 4));
    CHECK(cudaMalloc(&z.span, 16));
    CHECK(cudaMemset(z.flush, 1, z.flush_bytes));
    CHECK(cudaMemset(z.a, 2, a_max));
    CHECK(cudaMemset(z.b, 3, b_bytes));
    // DRAM read bandwidth, for scale.
    std::vector<double> big;
    for (int r = 0; r < 5; ++r) big.push_back(timed_read(z, z.flush, z.flush_bytes));
    printf("read 512 MB: %.1f us = %.0f GB/s\n", median(big), z.flush_bytes / median(big) / 1e3);

    const u64 sizes[2] = {20'971'520ull, 37'748'736ull};
    for (int setaside = 0; setaside < 2; ++setaside) {
        if (setaside) {
            CHECK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, prop.persistingL2CacheMaxSize));
            size_t got = 0;
            CHECK(cudaDeviceGetLimit(&got, cudaLimitPersistingL2CacheSize));
            printf("-- persisting L2 set-aside %zu MB\n", got >> 20);
        } else {
            printf("-- no persisting L2 set-aside\n");
        }
        for (u64 a : sizes) {
            run(z, a, b_bytes, NORMAL, NORMAL, "prefetch normal, stream normal");
            run(z, a, b_bytes, LAST, NORMAL, "prefetch evict_last, stream normal");
            run(z, a, b_bytes, LAST, FIRST, "prefetch evict_last, stream evict_first");
            run(z, a, b_bytes, NORMAL, FIRST, "prefetch normal, stream evict_first");
        }
    }
    return 0;
}
