// MoE routing of f32 router logits: softmax (f32, max-subtracted), top-k by probability with ties
// broken towards the lower expert index (moerun-model's `route`), then optionally renormalised so
// the k weights sum to one (summed in rank order, as the CPU does).
// Launch: block (32, ROUTER_ROWS_PER_BLOCK), grid ceil(rows / ROUTER_ROWS_PER_BLOCK); one warp per
// token row; dynamic shared memory 4 * experts * ROUTER_ROWS_PER_BLOCK bytes holds the
// probabilities. Each of the k rounds is a warp argmax over the experts not yet taken.

extern "C" __global__ void route_topk_f32(const float* __restrict__ logits, int rows, int experts,
                                          int k, int renormalise, u32* __restrict__ out_experts,
                                          float* __restrict__ out_weights) {
    extern __shared__ float probs_all[];
    pdl_entry();
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;  // no block-wide barrier below: warps are independent
    const int lane = threadIdx.x;
    float* p = probs_all + threadIdx.y * experts;
    const float* l = logits + (u64)row * experts;

    float mx = __int_as_float(0xff800000);  // -inf
    for (int i = lane; i < experts; i += 32) {
        const float v = l[i];
        p[i] = v;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int i = lane; i < experts; i += 32) {
        const float e = expf(p[i] - mx);
        p[i] = e;
        sum += e;
    }
    const float inv = 1.0f / warp_sum(sum);
    for (int i = lane; i < experts; i += 32) p[i] *= inv;
    __syncwarp();

    float total = 0.0f;  // lane 0: the chosen weights summed in rank order
    u32* idx_out = out_experts + (u64)row * k;
    float* w_out = out_weights + (u64)row * k;
    for (int r = 0; r < k; ++r) {
        // Probabilities are >= 0; taken experts are marked -1 and never win again.
        float bv = -2.0f;
        int bi = 0x7fffffff;
        for (int i = lane; i < experts; i += 32) {
            const float v = p[i];
            if (v > bv) {  // ascending i within a lane: strict > keeps the lower index on ties
                bv = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            idx_out[r] = (u32)bi;
            w_out[r] = bv;
            total += bv;
            p[bi] = -1.0f;
        }
        __syncwarp();
    }
    if (renormalise && lane == 0) {
        for (int r = 0; r < k; ++r) w_out[r] = w_out[r] / total;
    }
}
