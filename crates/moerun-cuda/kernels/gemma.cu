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

// weights[i] *= scale[ids[i]]: the router's learned per-expert scale after renormalisation.
// An id out of range gives NaN (the MoE op then makes that token's output NaN too).
extern "C" __global__ void expert_scale_f32(float* weights, const u32* __restrict__ ids,
                                            const float* __restrict__ scale, u64 n, int experts) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const u32 e = ids[i];
        weights[i] = e < (u32)experts ? weights[i] * scale[e] : __int_as_float(0x7fc00000);
    }
}

// ---- a Gemma 4 layer's norm chains, one launch each (ops/gemma.rs: gemma4_attn_tail and
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
// checked by the host). Before the programmatic wait a block prefetches its norm weights and
// loads the residual x: only these two kernels write it, and never as the kernel right before
// the other (o_proj, the experts' down or the dense down GEMV sits between:
// graph::EARLY_ACTIVATION_READERS). Launch: grid (rows), block TAIL_THREADS.

#define TAIL_THREADS 1024
#define TAIL_VALS 8

__device__ __forceinline__ void tail_prefetch(const float* __restrict__ w, int width) {
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        if (i < width && (i & 31) == 0)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(w + i));
    }
}

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

// v = w * (v * inv) where the row is.
__device__ __forceinline__ void tail_norm(float (&v)[TAIL_VALS], const float* __restrict__ w,
                                          int width, float inv) {
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        v[u] = i < width ? w[i] * (v[u] * inv) : 0.0f;
    }
}

// rscale null: a layer without experts (xr, xe and w_pre2 unused).
extern "C" __global__ void __launch_bounds__(TAIL_THREADS)
    gemma4_attn_tail_f32(float* x, const float* a, const float* __restrict__ w_post,
                         const float* __restrict__ w_pre, float* xn,
                         const float* __restrict__ rscale, float root,
                         const float* __restrict__ w_pre2, float* xr, float* xe, int width,
                         float eps) {
    const u64 off = (u64)blockIdx.x * width;
    tail_prefetch(w_post, width);
    tail_prefetch(w_pre, width);
    if (rscale != nullptr) {
        tail_prefetch(rscale, width);
        tail_prefetch(w_pre2, width);
    }
    float s[TAIL_VALS], t[TAIL_VALS];
    tail_load(x + off, width, s);
    pdl_entry_launch_first();
    tail_load(a + off, width, t);
    tail_norm(t, w_post, width, tail_inv_rms(t, width, eps));
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        if (i < width) {
            s[u] = s[u] + t[u];
            x[off + i] = s[u];
        }
    }
    const float inv = tail_inv_rms(s, width, eps);
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        if (i < width) {
            const float y = s[u] * inv;
            xn[off + i] = w_pre[i] * y;
            if (rscale != nullptr) {
                // The router's unit norm is 1 * y = y; then x * s * root, left to right.
                xr[off + i] = y * rscale[i] * root;
                xe[off + i] = w_pre2[i] * y;
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
    if (r != nullptr) {
        tail_prefetch(w_f1, width);
        tail_prefetch(w_r, width);
    }
    tail_prefetch(w_post, width);
    if (w_next != nullptr) tail_prefetch(w_next, width);
    float s[TAIL_VALS], t[TAIL_VALS];
    tail_load(x + off, width, s);
    pdl_entry_launch_first();
    tail_load(f + off, width, t);
    if (r != nullptr) {
        float q[TAIL_VALS];
        tail_load(r + off, width, q);
        tail_norm(t, w_f1, width, tail_inv_rms(t, width, eps));
        tail_norm(q, w_r, width, tail_inv_rms(q, width, eps));
#pragma unroll
        for (int u = 0; u < TAIL_VALS; ++u) t[u] = t[u] + q[u];
    }
    tail_norm(t, w_post, width, tail_inv_rms(t, width, eps));
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        if (i < width) {
            s[u] = (s[u] + t[u]) * scalar;
            x[off + i] = s[u];
        } else {
            s[u] = 0.0f;
        }
    }
    if (w_next == nullptr) return;  // block-uniform
    tail_norm(s, w_next, width, tail_inv_rms(s, width, eps));
#pragma unroll
    for (int u = 0; u < TAIL_VALS; ++u) {
        const int i = threadIdx.x + u * TAIL_THREADS;
        if (i < width) xn[off + i] = s[u];
    }
}
