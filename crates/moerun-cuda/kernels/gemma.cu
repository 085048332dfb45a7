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

// x[r, c] = x[r, c] * s[c] * root, left to right as transformers' router writes it.
extern "C" __global__ void row_scale_f32(float* x, const float* __restrict__ s, float root, u64 n,
                                         int width) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = x[i] * s[i % (u64)width] * root;
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
