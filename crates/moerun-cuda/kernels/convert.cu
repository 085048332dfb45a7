// f32 -> bf16 (round to nearest even), for the activations that go into the cuBLAS bf16 GEMM.
// Launch: 1-D grid-stride, block 256.

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, u16* __restrict__ out, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = f32_to_bf16(x[i]);
    }
}
