// SwiGLU's elementwise half: gate[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)) as
// transformers writes it.
// Launch: 1-D grid-stride, block 256, grid min(ceil(n / 256), 4 * SMs * 8).

extern "C" __global__ void silu_mul_f32(float* gate, const float* __restrict__ up, u64 n) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
