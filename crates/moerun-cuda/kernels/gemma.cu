// Gemma 4's elementwise steps (ops/gemma.rs wraps these), each the f32 arithmetic of the CPU
// reference in crates/moerun-model/src/gemma4 and moerun-cpu's ops, in the same order.
// Launch (all): 1-D grid-stride, block 256, grid min(ceil(n / 256), 32 * SMs).

// gate[r, c] = gelu_tanh(gate[r, c]) * up[r * up_stride + up_offset + c], rows of `width`:
// the dense MLP (up_stride = width, offset 0) and the per-layer-input gate, whose `up` is layer
// l's slice of each token's packed per-layer inputs (stride layers * width, offset l * width).
extern "C" __global__ void gelu_tanh_mul_f32(float* gate, const float* __restrict__ up, u64 n,
                                             int width, u64 up_stride, u64 up_offset) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const u64 r = i / (u64)width;
        const u64 c = i - r * (u64)width;
        gate[i] = gelu_tanh_f32(gate[i]) * up[r * up_stride + up_offset + c];
    }
}

// x *= s (embedding scale, layer_scalar, hidden^-0.5, 2^-0.5).
extern "C" __global__ void scale_f32(float* x, float s, u64 n) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] *= s;
}

// x = tanh(x / cap) * cap: final logit soft-capping.
extern "C" __global__ void softcap_f32(float* x, float cap, u64 n) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = tanhf(x[i] / cap) * cap;
}

// ---- a Gemma 4 layer's norm chains, one launch each (ops/gemma_tail.rs: gemma4_attn_tail and
// gemma4_ffn_tail) ----
//
// Between its big kernels a Gemma 4 layer runs sandwich norms, adds and scales: eight RMSNorms,
// three adds, two scales, a copy a layer, each a launch of its own (~25 us of a 112 us decode
// step's layer at batch 1, DRAM idle). These two kernels run the same f32 arithmetic as the CPU
// reference (crates/moerun-model/src/gemma4/forward.rs), step for step, on a row a block:
// - gemma4_attn_tail_f32, after attention's o_proj: x += post_attention_layernorm(a); then of the
//   new residual the dense MLP's input pre_feedforward_layernorm(x) and, for a layer with
//   experts, the router's input norm(x) * router_scale * root and the experts' input
//   pre_feedforward_layernorm_2(x), from one rms.
// - gemma4_ffn_tail_f32, after the feed-forward: f = post_feedforward_layernorm_1(f) +
//   post_feedforward_layernorm_2(r) (with experts; else f alone), x = (x +
//   post_feedforward_layernorm(f)) * layer_scalar, and (given w_next) the next norm of x: the
//   next layer's input_layernorm, or the final norm.
// Each norm is w * (v * inv), inv = 1 / sqrt(mean(v^2) + eps), as rms_norm_f32 writes it. A
// thread keeps TAIL_VALS of a row's values in registers (width <= TAIL_THREADS * TAIL_VALS,
// checked by the host: 6,144, past every published Gemma 4's 5,376). Before the programmatic wait
// a block loads its norm weights (into registers: read after the wait, from DRAM where a
// layer's ~95 MB of experts have pushed them out of L2, they were ~2.5 us of each tail) and the
// residual x: only these two kernels write it, and never as the kernel right before the other
// (o_proj, the experts' down or the dense down GEMV sits between:
// graph::EARLY_ACTIVATION_READERS). Launch: grid (rows), block TAIL_THREADS.

#define TAIL_THREADS 1024
#define TAIL_VALS 6

__device__ __forceinline__ void tail_load(const float* p, int width, float (&v)[TAIL_VALS]) {
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        v[u] = i < width ? p[i] : 0.0f;
    }
}

// 1 / rms of the block's row in v (zeros past the width).
__device__ __forceinline__ float tail_inv_rms(const float (&v)[TAIL_VALS], int width, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) ss = __fmaf_rn(v[u], v[u], ss);
    ss = block_sum(ss);
    return 1.0f / sqrtf(ss / (float)width + eps);
}

// rscale null: a layer without experts (xr, xe and w_pre2 unused).
extern "C" __global__ void __launch_bounds__(TAIL_THREADS)
    gemma4_attn_tail_f32(float* x, const float* a, const float* __restrict__ w_post,
                         const float* __restrict__ w_pre, float* xn,
                         const float* __restrict__ rscale, float root,
                         const float* __restrict__ w_pre2, float* xr, float* xe, int width,
                         float eps) {
    const u64 off = (u64)blockIdx.x * width;
    const bool router = rscale != nullptr;  // block-uniform
    float s[TAIL_VALS], t[TAIL_VALS], wp[TAIL_VALS], wn[TAIL_VALS], ws[TAIL_VALS], we[TAIL_VALS];
    tail_load(w_post, width, wp);
    tail_load(w_pre, width, wn);
    tail_load(router ? rscale : w_pre, width, ws);
    tail_load(router ? w_pre2 : w_pre, width, we);
    tail_load(x + off, width, s);
    pdl_entry_launch_first();
    tail_load(a + off, width, t);
    const float inv_a = tail_inv_rms(t, width, eps);
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        if (i < width) {
            s[u] = s[u] + wp[u] * (t[u] * inv_a);  // x += post_attention_layernorm(a)
            x[off + i] = s[u];
        }
    }
    const float inv = tail_inv_rms(s, width, eps);
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        if (i < width) {
            const float y = s[u] * inv;
            xn[off + i] = wn[u] * y;
            if (router) {
                // The router's unit norm is 1 * y = y; then x * s * root, left to right.
                xr[off + i] = y * ws[u] * root;
                xe[off + i] = we[u] * y;
            }
        }
    }
}

// r null: a layer without experts (w_f1, w_r unused); w_next null: no next norm (xn unused).
extern "C" __global__ void __launch_bounds__(TAIL_THREADS)
    gemma4_ffn_tail_f32(float* x, const float* f, const float* __restrict__ w_f1,
                        const float* r, const float* __restrict__ w_r,
                        const float* __restrict__ w_post, float scalar,
                        const float* __restrict__ w_next, float* xn, int width, float eps) {
    const u64 off = (u64)blockIdx.x * width;
    const bool routed = r != nullptr, next = w_next != nullptr;  // block-uniform
    float s[TAIL_VALS], t[TAIL_VALS], w1[TAIL_VALS], w2[TAIL_VALS], wp[TAIL_VALS], wn[TAIL_VALS];
    tail_load(routed ? w_f1 : w_post, width, w1);
    tail_load(routed ? w_r : w_post, width, w2);
    tail_load(w_post, width, wp);
    tail_load(next ? w_next : w_post, width, wn);
    tail_load(x + off, width, s);
    pdl_entry_launch_first();
    tail_load(f + off, width, t);
    if (routed) {
        float q[TAIL_VALS];
        tail_load(r + off, width, q);
        const float inv_f = tail_inv_rms(t, width, eps), inv_r = tail_inv_rms(q, width, eps);
        // post_feedforward_layernorm_1(f) + post_feedforward_layernorm_2(r)
#pragma unroll
        for (int u = 0; u < TAIL_VALS; ++u) t[u] = w1[u] * (t[u] * inv_f) + w2[u] * (q[u] * inv_r);
    }
    const float inv_t = tail_inv_rms(t, width, eps);
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        // x = (x + post_feedforward_layernorm(f)) * layer_scalar; zeros past the width.
        s[u] = (s[u] + wp[u] * (t[u] * inv_t)) * scalar;
        if (i < width) x[off + i] = s[u];
    }
    if (!next) return;
    const float inv = tail_inv_rms(s, width, eps);
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        if (i < width) xn[off + i] = wn[u] * (s[u] * inv);
    }
}
