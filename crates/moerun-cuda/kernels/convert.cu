// f32 -> bf16 (round to nearest even), for the activations that go into the cuBLAS bf16 GEMM.
// f32_to_bf16_split: x as two bf16 halves, hi = bf16(x) and lo = bf16(x - hi), so that hi + lo
// holds x to about 2^-17 relative (16 mantissa bits instead of 8) for a GEMM run once per half.
// Launch: 1-D grid-stride, block 256.

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, u16* __restrict__ out, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = f32_to_bf16(x[i]);
    }
}

extern "C" __global__ void f32_to_bf16_split(const float* __restrict__ x, u16* __restrict__ hi,
                                             u16* __restrict__ lo, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = x[i];
        const u16 h = f32_to_bf16(v);
        hi[i] = h;
        lo[i] = f32_to_bf16(v - bf16_to_f32(h));
    }
}
