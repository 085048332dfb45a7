// A kernel timeline of any CUDA program, CUDA graphs and programmatic dependent launch included:
// a CUPTI injection library (the driver loads it at cuInit when CUDA_INJECTION64_PATH names it)
// that records every kernel's GPU start and end (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, which
// does not serialise kernels) and writes one line per kernel at exit:
//   start_ns end_ns grid_x grid_y grid_z block_x name
// The device machine has no nsys; ncu times kernels one at a time, without the overlap a graph
// with PDL edges has. scripts/gpu-trace.sh builds this, runs a bench under it and summarises.
//
//   nvcc -O2 -shared -Xcompiler -fPIC -DKREC=CUpti_ActivityKernel9 -I$CUPTI/include \
//        -o libktrace.so scripts/probes/ktrace.cpp -L$CUPTI/lib64 -lcupti
//   CUDA_INJECTION64_PATH=$PWD/libktrace.so KTRACE_OUT=trace.txt moerun bench ...
#include <cuda.h>
#include <cupti.h>

#include <cstdio>
#include <cstdlib>

#ifndef KREC
#define KREC CUpti_ActivityKernel9
#endif

static FILE* g_out = nullptr;
static const size_t kBuf = 16u << 20;

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = static_cast<uint8_t*>(aligned_alloc(8, kBuf));
    *size = kBuf;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    CUpti_Activity* rec = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const KREC* k = reinterpret_cast<const KREC*>(rec);
        if (g_out)
            fprintf(g_out, "%llu %llu %d %d %d %d %s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->gridX, k->gridY, k->gridZ, k->blockX, k->name);
    }
    uint64_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
    if (dropped) fprintf(stderr, "ktrace: %llu records dropped\n", (unsigned long long)dropped);
    free(buffer);
}

static void flush_at_exit() {
    cuptiActivityFlushAll(1);
    if (g_out) fclose(g_out);
    g_out = nullptr;
}

extern "C" int InitializeInjection(void) {
    const char* path = getenv("KTRACE_OUT");
    g_out = fopen(path ? path : "ktrace.txt", "w");
    if (!g_out) return 0;
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "ktrace: CUPTI refused the kernel activity\n");
        return 0;
    }
    atexit(flush_at_exit);
    return 1;
}
