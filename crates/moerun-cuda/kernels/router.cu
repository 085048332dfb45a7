// MoE routing of f32 router logits (warp_route_topk, common.cuh: softmax, top-k by probability
// with ties to the lower expert index, optional renormalisation), for logits another kernel wrote.
// Launch: block (32, ROUTER_ROWS_PER_BLOCK), grid ceil(rows / ROUTER_ROWS_PER_BLOCK); one warp
// per token row, the experts' probabilities in its registers. route_topk_f32_l<L> holds L experts
// per lane (32 L experts at most): ops/router.rs takes the smallest L that holds the layer's
// experts, since each of the k rounds walks all L registers twice (a batch-1 decode step waits
// for this chain once per layer: 16 per lane for Qwen3's 128 experts was 4x the walk needed).
// Every L gives the same results: the extra registers hold no expert.
// One token's router GEMV and its routing also run as one launch: gemv.cu's gemv_route.

// Given expert_scale (non-null), each chosen weight is then multiplied by its expert's scale
// (Gemma 4's per-expert scale, after the renormalisation; NaN for an out-of-range id), as
// gemma.cu's expert_scale_f32 did in a launch of its own: each lane rescales the ranks it stored
// itself (warp_route_topk: rank r in lane r % 32), so its own writes are what it reads back.
__device__ __forceinline__ void route_expert_scale(u32* ids, float* weights, int k, int experts,
                                                   const float* __restrict__ scale) {
    for (int r = threadIdx.x & 31; r < k; r += 32) {
        const u32 e = ids[r];
        weights[r] = e < (u32)experts ? weights[r] * scale[e] : __int_as_float(0x7fc00000);
    }
}

#define ROUTE_TOPK_KERNEL(NAME, L)                                                               \
    extern "C" __global__ void NAME(const float* __restrict__ logits, int rows, int experts,      \
                                    int k, int renormalise, u32* __restrict__ out_experts,        \
                                    float* __restrict__ out_weights,                              \
                                    const float* __restrict__ expert_scale) {                     \
        pdl_entry_launch_first();                                                                 \
        const int row = blockIdx.x * blockDim.y + threadIdx.y;                                    \
        if (row >= rows) return; /* no block-wide barrier: warps are independent */               \
        warp_route_topk<L>(logits + (u64)row * experts, experts, k, renormalise,                  \
                           out_experts + (u64)row * k, out_weights + (u64)row * k);               \
        if (expert_scale != nullptr)                                                              \
            route_expert_scale(out_experts + (u64)row * k, out_weights + (u64)row * k, k,         \
                               experts, expert_scale);                                            \
    }

ROUTE_TOPK_KERNEL(route_topk_f32_l1, 1)
ROUTE_TOPK_KERNEL(route_topk_f32_l2, 2)
ROUTE_TOPK_KERNEL(route_topk_f32_l4, 4)
ROUTE_TOPK_KERNEL(route_topk_f32_l8, 8)
ROUTE_TOPK_KERNEL(route_topk_f32_l16, 16)
