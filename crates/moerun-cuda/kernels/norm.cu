// RMSNorm of f32 rows: out[r, i] = w[i] * (x[r, i] * inv_rms(r)), inv_rms = 1 / sqrt(mean(x^2) + eps),
// the order of operations transformers (and moerun-cpu's rms_norm_rows) use.
// Launch: block (32, ROWS_PER_BLOCK), grid ceil(rows / ROWS_PER_BLOCK); one warp per row.
// `x` and `out` may be the same buffer (each element is read before its own lane writes it).

extern "C" __global__ void rms_norm_f32(const float* x, const float* __restrict__ w, float* out,
                                        int rows, int width, float eps) {
    pdl_entry();
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    const float* xr = x + (u64)row * width;
    float* yr = out + (u64)row * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += 32) {
        const float v = xr[i];
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += 32) yr[i] = w[i] * (xr[i] * inv);
}
