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
