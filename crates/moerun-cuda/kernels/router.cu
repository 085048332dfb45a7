// MoE routing of f32 router logits (warp_route_topk below: softmax, top-k by probability
// with ties to the lower expert index, optional renormalisation), for logits another kernel wrote.
// Launch: block (32, ROUTER_ROWS_PER_BLOCK), grid ceil(rows / ROUTER_ROWS_PER_BLOCK); one warp
// per token row, the experts' probabilities in its registers. route_topk_f32_l<L> holds L experts
// per lane (32 L experts at most): ops/router.rs takes the smallest L that holds the layer's
// experts, since each of the k rounds walks all L registers twice (a batch-1 decode step waits
// for this chain once per layer: 16 per lane for Qwen3's 128 experts was 4x the walk needed).
// Every L gives the same results: the extra registers hold no expert.

// Warp-wide max / min of a u32: one redux.sync (sm_80+, the least the backend runs on).
__device__ __forceinline__ u32 warp_max_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 warp_min_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}

// One token's routing by one warp, the steps of moerun-model's `route`: softmax of the f32 router
// logits (max-subtracted; each lane sums its experts lane, lane + 32, ... in order, then a fixed
// butterfly), top-k by probability with ties to the lower expert index, then optionally the k
// weights renormalised to sum to one (summed in rank order). experts <= 32 * ROUTE_PER_LANE.
// Lane l holds experts l + 32 s in registers; a probability's f32 bits order like
// the probability (it is >= 0), so each round is a warp max of (bits + 1) keys (taken: 0) and a
// warp min of the indices holding it. A NaN probability never wins: with only NaNs left the id
// is out of range (0x7fffffff) and the weight -2, so the token's expert sum becomes NaN downstream.
template <int ROUTE_PER_LANE>
__device__ __forceinline__ void warp_route_topk(const float* __restrict__ logits, int experts, int k,
                                                int renormalise, u32* __restrict__ out_ids,
                                                float* __restrict__ out_weights) {
    const int lane = threadIdx.x & 31;
    float p[ROUTE_PER_LANE];
    float mx = __int_as_float(0xff800000);  // -inf
#pragma unroll
    for (int s = 0; s < ROUTE_PER_LANE; ++s) {
        const int i = 32 * s + lane;
        p[s] = i < experts ? logits[i] : 0.0f;
        if (i < experts) mx = fmaxf(mx, p[s]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < ROUTE_PER_LANE; ++s) {
        if (32 * s + lane < experts) {
            p[s] = expf(p[s] - mx);
            sum += p[s];
        }
    }
    const float inv = 1.0f / warp_sum(sum);
    u32 key[ROUTE_PER_LANE];
#pragma unroll
    for (int s = 0; s < ROUTE_PER_LANE; ++s) {
        const float v = p[s] * inv;
        key[s] = 32 * s + lane < experts && v >= 0.0f ? __float_as_uint(v) + 1u : 0u;
    }
    float total = 0.0f;  // every lane: the chosen weights summed in rank order
    for (int r = 0; r < k; ++r) {
        u32 bk = 0u, bi = 0xffffffffu;
#pragma unroll
        for (int s = 0; s < ROUTE_PER_LANE; ++s) {
            if (key[s] > bk) {  // ascending index within a lane: strict > keeps the lower one
                bk = key[s];
                bi = 32 * s + lane;
            }
        }
        const u32 best = warp_max_u32(bk);
        const u32 at = warp_min_u32(best != 0u && bk == best ? bi : 0xffffffffu);
        const float w = best != 0u ? __uint_as_float(best - 1u) : -2.0f;
        if (lane == 0) {
            out_ids[r] = best != 0u ? at : 0x7fffffffu;
            out_weights[r] = w;
        }
        total += w;
#pragma unroll
        for (int s = 0; s < ROUTE_PER_LANE; ++s)
            if (32 * s + lane == (int)at) key[s] = 0u;
    }
    if (renormalise && lane == 0) {
        for (int r = 0; r < k; ++r) out_weights[r] = out_weights[r] / total;
    }
}

#define ROUTE_TOPK_KERNEL(NAME, L)                                                               \
    extern "C" __global__ void NAME(const float* __restrict__ logits, int rows, int experts,      \
                                    int k, int renormalise, u32* __restrict__ out_experts,        \
                                    float* __restrict__ out_weights) {                            \
        pdl_entry();                                                                              \
        const int row = blockIdx.x * blockDim.y + threadIdx.y;                                    \
        if (row >= rows) return; /* no block-wide barrier: warps are independent */               \
        warp_route_topk<L>(logits + (u64)row * experts, experts, k, renormalise,                  \
                           out_experts + (u64)row * k, out_weights + (u64)row * k);               \
    }

ROUTE_TOPK_KERNEL(route_topk_f32_l1, 1)
ROUTE_TOPK_KERNEL(route_topk_f32_l2, 2)
ROUTE_TOPK_KERNEL(route_topk_f32_l4, 4)
ROUTE_TOPK_KERNEL(route_topk_f32_l8, 8)
ROUTE_TOPK_KERNEL(route_topk_f32_l16, 16)

// ---- one token's post-attention step in one launch ----
//
// add_rms_norm_route_<dt>_l<L>: grid ceil(experts / 16), block 1024, dynamic shared memory
// (2 width + experts) f32. The chain add_rms_norm_f32 -> gemv_rows_<dt>_m1 (the router) ->
// route_topk_f32_l<L> of a batch-1 decode step, whose three launches each wait for the one
// before, as one:
// 1. Every block computes x + y and its RMSNorm into shared memory with add_rms_norm_f32's
//    steps (the same device functions at the same 1024 threads: the same bits), having loaded
//    the residual row, the norm weights and the first chunk of each of its router rows before
//    griddepcontrol.wait.
// 2. Its four groups of 256 threads compute 4 router rows each exactly as gemv_block_rows<C, 1>
//    does (same thread-to-chunk map, fmaf order and reductions) and write the logits.
// 3. The last block to count itself done (a fence, then an atomic on `counter`) writes the new
//    residual x and the normed row (nobody reads x after its count), reads every block's logits
//    through L2 and ranks them with warp_route_topk<L> (route_topk's warp), then resets the
//    counter for the next launch (CUDA graph replays included).
#define ROUTE_GROUP 256                  // threads per 4-row GEMV group, as gemv_rows
#define ROUTE_GROUPS 4                   // groups per block of 1024
#define ROUTE_ROWS (4 * ROUTE_GROUPS)    // router rows per block

template <typename C, int L>
__device__ __forceinline__ void add_rms_norm_route(float* x, const float* __restrict__ y,
                                                   const float* __restrict__ nw, float* out,
                                                   int width, float eps, const void* rw,
                                                   float* logits, int experts, int k,
                                                   int renormalise, u32* __restrict__ out_ids,
                                                   float* __restrict__ out_weights,
                                                   u32* counter) {
    extern __shared__ float route_smem[];
    float* sums = route_smem;         // [width]: x + y
    float* normed = sums + width;     // [width]: the norm's output, the router's input
    float* ranked = normed + width;   // [experts]: every block's logits (last block)
    __shared__ float gpart[ROUTE_GROUPS][ROUTE_GROUP / 32][4];
    __shared__ int s_last;
    const int tid = threadIdx.x;
    const int g = tid / ROUTE_GROUP;
    const int t = tid - g * ROUTE_GROUP;
    const int lane = tid & 31;
    const int row0 = blockIdx.x * ROUTE_ROWS + g * 4;
    const int rows_here = max(0, min(4, experts - row0));  // group-uniform
    const int chunks = width / C::N;
    const uint4* w = reinterpret_cast<const uint4*>(rw) + (u64)max(row0, 0) * chunks;
    float v[ADD_NORM_EARLY], wv[ADD_NORM_EARLY];
    add_norm_early(x, nw, width, v, wv);
    uint4 first[4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
        first[r] = r < rows_here && t < chunks ? load_stream(w + (u64)r * chunks + t)
                                               : make_uint4(0u, 0u, 0u, 0u);
    pdl_entry();
    const float inv = add_norm_sums(x, y, sums, width, eps, v);
    add_norm_write(sums, nw, normed, nullptr, width, inv, v, wv);
    __syncthreads();
    float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    for (int c = t; c < chunks; c += ROUTE_GROUP) {
        uint4 q[4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
            q[r] = c == t ? first[r]
                          : (r < rows_here ? load_stream(w + (u64)r * chunks + c)
                                           : make_uint4(0u, 0u, 0u, 0u));
        fma_rows<C, 1, 4>(q, normed, width, c, acc);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float s = warp_sum(acc[0][r]);
        if (lane == 0) gpart[g][t >> 5][r] = s;
    }
    __syncthreads();
    if (t < rows_here) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ROUTE_GROUP / 32; ++i) s += gpart[g][i][t];
        logits[row0 + t] = s;
    }
    // Publish this block's logits, then count it done.
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;  // block-uniform
    __threadfence();      // the other blocks' logits, published before their counts
    for (int i = tid; i < experts; i += blockDim.x) ranked[i] = load_cg(logits + i);
    for (int i = tid; i < width; i += blockDim.x) {
        x[i] = sums[i];
        out[i] = normed[i];
    }
    __syncthreads();
    if (tid < 32) warp_route_topk<L>(ranked, experts, k, renormalise, out_ids, out_weights);
    if (tid == 0) *counter = 0u;
}

#define ADD_RMS_NORM_ROUTE_KERNEL(DT, CHUNK, L)                                                  \
    extern "C" __global__ void __launch_bounds__(ROUTE_GROUP * ROUTE_GROUPS)                     \
        add_rms_norm_route_##DT##_l##L(float* x, const float* y, const float* nw, float* out,    \
                                       int width, float eps, const void* rw, float* logits,      \
                                       int experts, int k, int renormalise, u32* out_ids,        \
                                       float* out_weights, u32* counter) {                       \
        add_rms_norm_route<CHUNK, L>(x, y, nw, out, width, eps, rw, logits, experts, k,         \
                                     renormalise, out_ids, out_weights, counter);                \
    }
#define ADD_RMS_NORM_ROUTE_KERNELS(DT, CHUNK)                                                    \
    ADD_RMS_NORM_ROUTE_KERNEL(DT, CHUNK, 1)                                                      \
    ADD_RMS_NORM_ROUTE_KERNEL(DT, CHUNK, 2)                                                      \
    ADD_RMS_NORM_ROUTE_KERNEL(DT, CHUNK, 4)                                                      \
    ADD_RMS_NORM_ROUTE_KERNEL(DT, CHUNK, 8)                                                      \
    ADD_RMS_NORM_ROUTE_KERNEL(DT, CHUNK, 16)

ADD_RMS_NORM_ROUTE_KERNELS(bf16, ChunkBf16)
ADD_RMS_NORM_ROUTE_KERNELS(f16, ChunkF16)
ADD_RMS_NORM_ROUTE_KERNELS(f32, ChunkF32)
