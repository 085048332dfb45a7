// How long the blocks of a decode kernel wait for a small input that all of them read right
// after their programmatic wait (the expert ids of gate_up, the activation row of a GEMV), when
// every block reads the same bytes against when they read one of several copies (nvcc on the
// GPU machine):
//
//   nvcc -O3 -arch=sm_90 -o /tmp/hot_reads scripts/probes/hot_reads.cu && /tmp/hot_reads
//
// A producer kernel (1 block) writes `bytes` of input into each of C copies; the consumer
// (programmatic launch, griddepcontrol.wait first) has G blocks of 256 threads, whose readers
// (every warp, or warp 0 only) load the input of copy blockIdx.x % C (ld.global, the path
// kernels take for data an earlier kernel wrote) and sum it. Per consumer block, the cycles from
// its wait returning to its sum being ready (clock64 on the block's SM); medians and maxima
// over blocks and 50 repetitions, and the graph time per producer + consumer pair.
#include "probe.cuh"

#include <algorithm>
#include <cstdio>
#include <vector>

__global__ void produce(float* in, int floats, int copies, float v) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (int c = 0; c < copies; ++c)
        for (int i = threadIdx.x; i < floats; i += blockDim.x) in[(size_t)c * floats + i] = v + i;
}

// readers: 0 every warp reads, 1 warp 0 reads and shares through shared memory.
__global__ void consume(const float* in, int floats, int copies, int readers, long long* cycles,
                        float* sink) {
    __shared__ float shared_in[4096];
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const long long t0 = clock64();
    const float* src = in + (size_t)(blockIdx.x % copies) * floats;
    float s = 0.0f;
    if (readers == 0) {
        // Every warp reads the whole input, as a GEMV's warps read x (float4 per lane).
        for (int i = 4 * (threadIdx.x & 31); i < floats; i += 128) {
            const float4 v = *reinterpret_cast<const float4*>(src + i);
            s += v.x + v.y + v.z + v.w;
        }
    } else {
        for (int i = 4 * threadIdx.x; i < floats; i += 4 * blockDim.x)
            *reinterpret_cast<float4*>(shared_in + i) = *reinterpret_cast<const float4*>(src + i);
        __syncthreads();
        for (int i = 4 * (threadIdx.x & 31); i < floats; i += 128) {
            const float4 v = *reinterpret_cast<const float4*>(shared_in + i);
            s += v.x + v.y + v.z + v.w;
        }
    }
    __syncthreads();
    const long long t1 = clock64();
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
    if (s == -1.0f) sink[blockIdx.x] = s;
}

int main() {
    const int reps = 50;
    printf("%6s %6s %6s %8s %12s %12s %12s\n", "grid", "bytes", "copies", "readers",
           "med_cycles", "max_cycles", "us/pair");
    for (int grid : {384, 1280}) {
        for (int floats : {32, 2048}) {
            for (int copies : {1, 8, 32}) {
                for (int readers : {0, 1}) {
                    float *in, *sink;
                    long long* cycles;
                    CHECK(cudaMalloc(&in, (size_t)copies * floats * 4));
                    CHECK(cudaMalloc(&sink, grid * 4));
                    CHECK(cudaMalloc(&cycles, (size_t)reps * grid * 8));
                    cudaStream_t s;
                    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                    cudaGraph_t graph;
                    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
                    for (int r = 0; r < reps; ++r) {
                        cudaLaunchAttribute attr[1];
                        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                        attr[0].val.programmaticStreamSerializationAllowed = 1;
                        cudaLaunchConfig_t p = {};
                        p.gridDim = dim3(1);
                        p.blockDim = dim3(1024);
                        p.stream = s;
                        p.attrs = attr;
                        p.numAttrs = 1;
                        CHECK(cudaLaunchKernelEx(&p, produce, in, floats, copies, (float)r));
                        cudaLaunchConfig_t c = p;
                        c.gridDim = dim3(grid);
                        c.blockDim = dim3(256);
                        CHECK(cudaLaunchKernelEx(&c, consume, (const float*)in, floats, copies,
                                                 readers, cycles + (size_t)r * grid, sink));
                    }
                    CHECK(cudaStreamEndCapture(s, &graph));
                    cudaGraphExec_t exec;
                    CHECK(cudaGraphInstantiate(&exec, graph, 0));
                    CHECK(cudaGraphLaunch(exec, s));  // warm
                    CHECK(cudaStreamSynchronize(s));
                    const float ms = graph_launch_ms(exec, s);
                    std::vector<long long> h((size_t)reps * grid);
                    CHECK(cudaMemcpy(h.data(), cycles, h.size() * 8, cudaMemcpyDeviceToHost));
                    std::vector<long long> med, mx;
                    for (int r = 0; r < reps; ++r) {
                        std::vector<long long> v(h.begin() + (size_t)r * grid,
                                                 h.begin() + (size_t)(r + 1) * grid);
                        std::sort(v.begin(), v.end());
                        med.push_back(v[v.size() / 2]);
                        mx.push_back(v.back());
                    }
                    std::sort(med.begin(), med.end());
                    std::sort(mx.begin(), mx.end());
                    printf("%6d %6d %6d %8s %12lld %12lld %12.3f\n", grid, floats * 4, copies,
                           readers ? "warp0" : "every", med[reps / 2], mx[reps / 2],
                           ms * 1000.0f / reps);
                    CHECK(cudaGraphExecDestroy(exec));
                    CHECK(cudaGraphDestroy(graph));
                    CHECK(cudaStreamDestroy(s));
                    CHECK(cudaFree(in));
                    CHECK(cudaFree(sink));
                    CHECK(cudaFree(cycles));
                }
            }
        }
    }
    return 0;
}
