// What the standalone probes of this directory share (each is built alone with nvcc on the GPU
// machine and includes this file from its own directory): a checked CUDA call and the GPU clock.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

typedef unsigned long long u64;
typedef unsigned int u32;

// Stop the probe with the failing call's text and CUDA's reason.
#define CHECK(x)                                                                        \
    do {                                                                                \
        cudaError_t e = (x);                                                            \
        if (e != cudaSuccess) {                                                         \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));    \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

// Nanoseconds of the GPU's global timer (the same clock on every SM).
__device__ __forceinline__ u64 now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Milliseconds of one launch of `exec` on `s`, from events recorded around it (s idle first).
inline float graph_launch_ms(cudaGraphExec_t exec, cudaStream_t s) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaEventRecord(a, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaStreamSynchronize(s));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    return ms;
}
