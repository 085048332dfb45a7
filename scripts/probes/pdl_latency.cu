// What one kernel boundary costs on the decode chain, three ways (nvcc on the GPU machine):
//
//   nvcc -O3 -arch=sm_90 -o /tmp/pdl_latency scripts/probes/pdl_latency.cu && /tmp/pdl_latency
//
// A CUDA graph of N kernels of G blocks each, every kernel depending on the one before through
// one word (block 0 of kernel i reads what kernel i - 1 wrote), replayed; the time per kernel is
// what a boundary costs when the kernels do nearly nothing:
//   plain  stream order (no programmatic launch);
//   pdl    programmatic dependent launch, each kernel's griddepcontrol.wait then
//          launch_dependents (moerun's pdl_entry);
//   flag   programmatic launch with launch_dependents first and no griddepcontrol.wait: every
//          block of kernel i adds one arrival to a counter once its work is stored (release), and
//          kernel i + 1's blocks poll the counter of kernel i (acquire, one thread a block) until
//          all G arrivals of this replay are in.
// Also `pdl` and `flag` with W nanoseconds of spinning in each block (a kernel that does work),
// and the flag variant where only block 0 signals (a producer whose one block holds the result,
// as gemv_route's block 0 holds the expert ids).
#include "probe.cuh"

#include <algorithm>
#include <cstdio>
#include <vector>

__device__ __forceinline__ void spin(int ns) {
    if (ns <= 0) return;
    const unsigned long long end = now() + ns;
    while (now() < end) {
    }
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// mode 0 plain, 1 pdl; `val` chains the kernels' data.
__global__ void k_wait(unsigned* val, int i, int work_ns, int pdl) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    spin(work_ns);
    if (blockIdx.x == 0 && threadIdx.x == 0) val[i] = val[i - 1] + 1;
}

// arrivals[i]: blocks of kernel i that have stored (cumulative over replays); gen: the replay's
// number (set by the host before each replay), so kernel i + 1 waits for signalers * gen.
__global__ void k_flag(unsigned* val, unsigned* arrivals, const unsigned* gen, int i, int work_ns,
                       int signalers) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    __shared__ unsigned g;
    if (threadIdx.x == 0) {
        g = *(volatile const unsigned*)gen;
        const unsigned want = (unsigned)signalers * g;
        if (i > 1)
            while (ld_acquire(&arrivals[i - 1]) < want) {
            }
    }
    __syncthreads();
    spin(work_ns);
    if (blockIdx.x == 0 && threadIdx.x == 0) val[i] = val[i - 1] + 1;
    __syncthreads();
    if (threadIdx.x == 0 && (int)blockIdx.x < signalers) red_release(&arrivals[i], 1u);
}

static float run(int mode, int n, int grid, int work_ns, int signalers, int replays) {
    unsigned *val, *arr, *gen;
    CHECK(cudaMalloc(&val, (n + 2) * 4));
    CHECK(cudaMalloc(&arr, (n + 2) * 4));
    CHECK(cudaMalloc(&gen, 4));
    CHECK(cudaMemset(val, 0, (n + 2) * 4));
    CHECK(cudaMemset(arr, 0, (n + 2) * 4));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 1; i <= n; ++i) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(grid);
        cfg.blockDim = dim3(256);
        cfg.stream = s;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = mode == 0 ? 0 : 1;
        if (mode == 2)
            CHECK(cudaLaunchKernelEx(&cfg, k_flag, val, arr, (const unsigned*)gen, i, work_ns,
                                     signalers));
        else
            CHECK(cudaLaunchKernelEx(&cfg, k_wait, val, i, work_ns, mode));
    }
    CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<float> ms;
    for (int r = 1; r <= replays; ++r) {
        unsigned g = (unsigned)r;
        CHECK(cudaMemcpyAsync(gen, &g, 4, cudaMemcpyHostToDevice, s));
        ms.push_back(graph_launch_ms(exec, s));
    }
    unsigned last;
    CHECK(cudaMemcpy(&last, val + n, 4, cudaMemcpyDeviceToHost));
    if (last != (unsigned)n) printf("chain broken: val[n] = %u, want %d\n", last, n);
    std::sort(ms.begin(), ms.end());
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(val));
    CHECK(cudaFree(arr));
    CHECK(cudaFree(gen));
    return ms[ms.size() / 2] * 1000.0f / n;  // µs a kernel, median replay
}

int main() {
    const int n = 400, replays = 21;
    const char* names[] = {"plain", "pdl", "flag"};
    printf("%-6s %6s %8s %10s %12s\n", "mode", "grid", "work_ns", "signalers", "us/kernel");
    for (int work : {0, 2000}) {
        for (int grid : {8, 132, 384}) {
            for (int mode = 0; mode < 3; ++mode) {
                for (int sig : {grid, 1}) {
                    if (mode != 2 && sig != grid) continue;
                    const float us = run(mode, n, grid, work, sig, replays);
                    printf("%-6s %6d %8d %10d %12.3f\n", names[mode], grid, work, sig, us);
                }
            }
        }
    }
    return 0;
}
