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
