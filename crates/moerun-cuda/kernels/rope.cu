// Rotary embedding, "rotate half" convention, in place on f32 rows of `heads * head_dim`.
// Dimension i pairs with i + half (half = rotary_dim / 2); dimensions past rotary_dim pass through
// (partial rotary). cos/sin come from angle = inv_freq[i] * (float)pos in f32, as transformers
// computes them, each scaled by the attention factor (common.cuh rope_cos_sin, rope_pair).
// Launch: grid (tokens), block 128; the token's cos/sin go to shared memory once (half <= 512),
// then the block rotates every (head, pair).

#define ROPE_MAX_HALF 512

extern "C" __global__ void rope_rotate_half_f32(float* x, const u32* __restrict__ positions,
                                                const float* __restrict__ inv_freq, int heads,
                                                int head_dim, int half, float attention_factor) {
    __shared__ float cos_s[ROPE_MAX_HALF];
    __shared__ float sin_s[ROPE_MAX_HALF];
    pdl_entry();
    const int t = blockIdx.x;
    const int pos = (int)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        rope_cos_sin(inv_freq[i], pos, attention_factor, cos_s[i], sin_s[i]);
    __syncthreads();
    float* row = x + (u64)t * heads * head_dim;
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        const int h = j / half;
        const int i = j - h * half;
        float* hd = row + h * head_dim;
        float a = hd[i];
        float b = hd[i + half];
        rope_pair(a, b, cos_s[i], sin_s[i]);
        hd[i] = a;
        hd[i + half] = b;
    }
}
