// Small elementwise kernels the forward pass strings between the big ones: residual add, bias
// add, clamp, row gather, the sigmoid-gated shared-expert add, and the hash-based random fill of
// synthetic benchmark weights.
// Launch (all but gather_rows): 1-D grid-stride, block 256, grid min(ceil(n / 256), 32 * SMs).

extern "C" __global__ void add_f32(float* x, const float* __restrict__ y, u64 n) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] += y[i];
}

// x[r, c] += bias[c] for `n` = rows * width elements.
extern "C" __global__ void add_bias_f32(float* x, const float* __restrict__ bias, u64 n, int width) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] += bias[i % (u64)width];
}

extern "C" __global__ void clamp_f32(float* x, float c, u64 n) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = fminf(fmaxf(x[i], -c), c);
}

// out[t, :] += sigmoid(gate[t]) * s[t, :], Qwen2-MoE's gated shared expert; `gate` may be null
// (an ungated shared expert: scale 1). n = rows * width.
extern "C" __global__ void add_sigmoid_scaled_f32(float* out, const float* __restrict__ s,
                                                  const float* __restrict__ gate, u64 n, int width) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float scale = 1.0f;
        if (gate) scale = 1.0f / (1.0f + expf(-gate[i / (u64)width]));
        out[i] += scale * s[i];
    }
}

// out[j, :] = x[rows[j], :]. Launch: grid (rows), block 256.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, const int* __restrict__ rows,
                                           float* out, int width) {
    pdl_entry();
    const float* src = x + (u64)rows[blockIdx.x] * width;
    float* dst = out + (u64)blockIdx.x * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = src[c];
}

// Random weights for benchmarks: element i of a tensor seeded `seed` is uniform in
// [-scale, scale), from a 64-bit mix of (seed, i), so any tensor size fills at full bandwidth
// with no state. Written as bf16 or f32 bit patterns.
__device__ __forceinline__ float hash_uniform(u64 seed, u64 i) {
    u64 z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
}

extern "C" __global__ void fill_random_bf16(u16* out, u64 n, u64 seed, float scale) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = f32_to_bf16(hash_uniform(seed, i) * scale);
}

extern "C" __global__ void fill_random_f32(float* out, u64 n, u64 seed, float scale) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = hash_uniform(seed, i) * scale;
}

// Greedy pick of each row of `width` logits: the largest value, the lowest index among equal
// ones; NaN never wins and a row with nothing above -inf gives 0 (moerun-model's `argmax`, the
// engine's greedy), so only the ids go to the host, not rows x vocab floats. Two launches:
// - argmax_part_f32: grid (rows, parts), block 256; block (r, p) scans slice p of row r (parts
//   contiguous slices, each thread its strided elements in order), then warp and block
//   reductions into part_v / part_i [rows][parts]. A row of a 151,936-word vocabulary in one block
//   took 34 us (one SM's bandwidth); parts spread it over the GPU.
// - argmax_finish_f32: grid (rows), block 32; one warp merges a row's parts (parts <= 32). With
//   next_token non-null (a greedy decode chain, moerun-model's cuda/ahead.rs) it also writes the
//   next step's inputs of each row: its token, the pick, and its position, one further (both
//   positions arrays), so that the next step's graph replay copies nothing in. With host_pick
//   non-null (page-locked host memory, mapped) it writes the pick there too: no copy on the
//   stream between two steps of a chain.
// Merging keeps the larger value, and the lower index on equal values, so the order of the
// reductions never changes the pick.
__device__ __forceinline__ void argmax_merge(float& bv, u32& bi, float ov, u32 oi) {
    if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
    }
}

__device__ __forceinline__ void argmax_warp(float& bv, u32& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
}

#define ARGMAX_THREADS 256

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_part_f32(const float* __restrict__ x, int width, float* __restrict__ part_v,
                    u32* __restrict__ part_i) {
    __shared__ float s_v[ARGMAX_THREADS / 32];
    __shared__ u32 s_i[ARGMAX_THREADS / 32];
    const int parts = gridDim.y;
    const int per = (width + parts - 1) / parts;
    const int lo = blockIdx.y * per, hi = min(width, lo + per);
    const float* r = x + (u64)blockIdx.x * width;
    float bv = __int_as_float(0xff800000);  // -inf
    u32 bi = 0xffffffffu;                   // none yet: loses every tie
    for (int i = lo + threadIdx.x; i < hi; i += ARGMAX_THREADS) {
        const float v = r[i];
        if (v > bv) {
            bv = v;
            bi = (u32)i;
        }
    }
    argmax_warp(bv, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        s_v[warp] = bv;
        s_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < ARGMAX_THREADS / 32 ? s_v[lane] : __int_as_float(0xff800000);
        bi = lane < ARGMAX_THREADS / 32 ? s_i[lane] : 0xffffffffu;
        argmax_warp(bv, bi);
        if (lane == 0) {
            part_v[(u64)blockIdx.x * parts + blockIdx.y] = bv;
            part_i[(u64)blockIdx.x * parts + blockIdx.y] = bi;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32)
    argmax_finish_f32(const float* __restrict__ part_v, const u32* __restrict__ part_i, int parts,
                      u32* __restrict__ out, u32* __restrict__ next_token,
                      int* __restrict__ next_pos, u32* __restrict__ next_pos_u32,
                      u32* __restrict__ host_pick) {
    const int lane = threadIdx.x;
    const u64 at = (u64)blockIdx.x * parts + lane;
    float bv = lane < parts ? part_v[at] : __int_as_float(0xff800000);
    u32 bi = lane < parts ? part_i[at] : 0xffffffffu;
    argmax_warp(bv, bi);
    if (lane == 0) {
        const u32 pick = bi == 0xffffffffu ? 0u : bi;
        out[blockIdx.x] = pick;
        if (next_token) {
            next_token[blockIdx.x] = pick;
            next_pos[blockIdx.x] += 1;
            next_pos_u32[blockIdx.x] += 1u;
        }
        if (host_pick) {
            host_pick[blockIdx.x] = pick;
            __threadfence_system();
        }
    }
}
