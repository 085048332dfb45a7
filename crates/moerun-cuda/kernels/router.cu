// MoE routing of f32 router logits (warp_route_topk, common.cuh: softmax, top-k by probability
// with ties to the lower expert index, optional renormalisation), for logits another kernel wrote.
// Launch: block (32, ROUTER_ROWS_PER_BLOCK), grid ceil(rows / ROUTER_ROWS_PER_BLOCK); one warp
// per token row, the experts' probabilities in its registers. route_topk_f32_l<L> holds L experts
// per lane (32 L experts at most): ops/router.rs takes the smallest L that holds the layer's
// experts, since each of the k rounds walks all L registers twice (a batch-1 decode step waits
// for this chain once per layer: 16 per lane for Qwen3's 128 experts was 4x the walk needed).
// Every L gives the same results: the extra registers hold no expert.
// One token's router GEMV and its routing also run as one launch: gemv.cu's gemv_route.

#define ROUTE_TOPK_KERNEL(NAME, L)                                                               \
    extern "C" __global__ void NAME(const float* __restrict__ logits, int rows, int experts,      \
                                    int k, int renormalise, u32* __restrict__ out_experts,        \
                                    float* __restrict__ out_weights) {                            \
        pdl_entry_launch_first();                                                                 \
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

// ---- the matrices a MoE layer's routing is made of from o_proj's input (route ahead) ----
//
// route_ahead_weights_<dt>: out[e][c] = sum_j router[e][j] g[j] wo[j][c] (M, wo [hidden][cols]) or,
// with wo null, router[e][c] g[c] (R, cols = hidden), in f64, stored in the weights' dtype: f32
// rounded once; bf16 as two rows, the value rounded (rows 0 .. experts) and what that rounding
// left, rounded (rows experts .. 2 experts): hi + lo within ~2^-17 of the f64 value, where one
// bf16 would be 2^-9 off and move the router's logits by as much. Grid (ceil(cols / 256),
// experts), block 256. Made once at upload (ops/route_ahead.rs).
template <typename T, typename W, bool HI_LO>
__device__ __forceinline__ void route_ahead_weights(const T* router, const float* g, const T* wo,
                                                    int experts, int hidden, int cols, T* out) {
    const int e = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    double acc = 0.0;
    if (wo == nullptr) {
        acc = (double)W::at(router, (u64)e * hidden + c) * (double)g[c];
    } else {
        for (int j = 0; j < hidden; ++j)
            acc += (double)W::at(router, (u64)e * hidden + j) * (double)g[j] *
                   (double)W::at(wo, (u64)j * cols + c);
    }
    if constexpr (HI_LO) {
        const u16 hi = f32_to_bf16((float)acc);
        out[(u64)e * cols + c] = hi;
        out[((u64)experts + e) * cols + c] = f32_to_bf16((float)(acc - (double)bf16_to_f32(hi)));
    } else {
        out[(u64)e * cols + c] = (T)acc;
    }
}

extern "C" __global__ void route_ahead_weights_bf16(const u16* router, const float* g,
                                                    const u16* wo, int experts, int hidden,
                                                    int cols, u16* out) {
    route_ahead_weights<u16, WidenBf16, true>(router, g, wo, experts, hidden, cols, out);
}
extern "C" __global__ void route_ahead_weights_f32(const float* router, const float* g,
                                                   const float* wo, int experts, int hidden,
                                                   int cols, float* out) {
    route_ahead_weights<float, WidenF32, false>(router, g, wo, experts, hidden, cols, out);
}
