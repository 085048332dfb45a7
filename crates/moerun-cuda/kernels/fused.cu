// Fusions of the small steps between a decoder layer's big kernels (a decode step at batch 1 is
// bound by how many kernels run, not by their bytes):
// - add_rms_norm_f32: the residual add and the next RMSNorm in one pass over the row.
//   x[r] += y[r]; out[r] = w * (x[r] * inv_rms(x[r])), the formula of rms_norm_f32; given
//   out_bf16 (non-null), also out rounded to bf16 there (prefill's GEMM input). A block of
//   1024 per row: at batch 1 a warp per 2048-wide row took 19 us (a serial walk of dependent
//   loads over the row), 256 threads 5.4 us; each thread now loads two values. Launch: grid
//   (rows), block 1024.
// - rms_norm_block_f32: RMSNorm alone, the same layout, for wide rows (rms_norm_f32 keeps a warp
//   per row for narrow ones: per-head q/k norms).
// - qkv_split_norm_rope_f32: the attention prologue after one GEMV of the stacked [q; k; v]
//   projection: split each token's row into q, k and v, RMSNorm each q and k head (per-head
//   weights; skipped when the weight pointer is null), then rotate q and k (rotate-half RoPE on
//   the leading 2 * half dims, angle inv_freq[i] * pos in f32, cos/sin scaled by the attention
//   factor), exactly as rms_norm_f32 then rope_rotate_half_f32 compute them; with v_unit_norm,
//   RMSNorm each v head without a weight (Gemma 4's v_norm); with a gate buffer, each q head's
//   projection is its query then its output gate (Qwen3.5's doubled q_proj), the gate copied out. Given a KV pool
//   (KvDest.pool_k non-null), the k and v heads also go straight into the token's slot there,
//   as kv_write_f32 would put them (f32, or rounded to bf16 for a bf16 pool; skipped for a
//   position whose block is out of range). Given a batch copy (KvDest.copy_k non-null), the k
//   and v heads also go, rounded to bf16, into the token's row there: what the tensor-core
//   prefill kernel reads for the batch's own keys.
//   Launch: grid (tokens, ceil((heads_q + 2 * heads_kv) / 4)), block (32, 4): one warp per head
//   (head_dim <= 256), four heads per block.

#define FUSED_MAX_HEAD_DIM 256
// Heads (warps) per block of qkv_split_norm_rope_f32: a block per (token, head) made prefill's
// 4096 x 40 blocks of one warp cost 105 us a layer, scheduling-bound.
#define QKV_HEADS_PER_BLOCK 4

// Values of the row (and of the norm weights) a thread keeps in registers: the first
// ADD_NORM_EARLY of its elements; wider rows loop over the rest.
#define ADD_NORM_EARLY 4

// One row of RMSNorm, a block per row: out = w * x / rms(x), with ADD first x += y (written
// back: the residual stream) and, given out_bf16, out rounded to bf16 too. At batch 1 this is a
// chain of dependent steps, so the norm weights load before the programmatic wait, and with ADD
// the residual x too: only this kernel (and a final add) writes it, never the kernel right
// before it (forward.rs: a layer's residual adds are separated by its attention or FFN); y is
// that kernel's output and is read after the wait. The kernel lets its successor launch first
// (pdl_entry_launch_first). The row's values stay in registers between the reduction and the
// output (no second read of x or w behind the block sum). Each thread writes only the elements
// it read itself, so out may alias x.
template <bool ADD>
__device__ __forceinline__ void rms_norm_row(float* x, const float* __restrict__ y,
                                             const float* __restrict__ w, float* out, int width,
                                             float eps, u16* __restrict__ out_bf16) {
    const u64 row = blockIdx.x;
    float* xr = x + row * width;
    const float* yr = ADD ? y + row * width : nullptr;
    float* o = out + row * width;
    u16* ob = out_bf16 ? out_bf16 + row * width : nullptr;
    float v[ADD_NORM_EARLY], wv[ADD_NORM_EARLY];
#pragma unroll
    for (int u = 0; u < ADD_NORM_EARLY; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if constexpr (ADD) v[u] = i < width ? xr[i] : 0.0f;
        wv[u] = i < width ? w[i] : 0.0f;
    }
    pdl_entry_launch_first();
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < ADD_NORM_EARLY; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if constexpr (ADD) {
            if (i < width) {
                v[u] += yr[i];
                xr[i] = v[u];
                ss = __fmaf_rn(v[u], v[u], ss);
            }
        } else {
            v[u] = i < width ? xr[i] : 0.0f;
            if (i < width) ss = __fmaf_rn(v[u], v[u], ss);
        }
    }
    for (int i = threadIdx.x + ADD_NORM_EARLY * blockDim.x; i < width; i += blockDim.x) {
        const float a = ADD ? xr[i] + yr[i] : xr[i];
        if constexpr (ADD) xr[i] = a;
        ss = __fmaf_rn(a, a, ss);
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
#pragma unroll
    for (int u = 0; u < ADD_NORM_EARLY; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < width) {
            const float r = wv[u] * (v[u] * inv);
            o[i] = r;
            if (ob) ob[i] = f32_to_bf16(r);
        }
    }
    for (int i = threadIdx.x + ADD_NORM_EARLY * blockDim.x; i < width; i += blockDim.x) {
        const float r = w[i] * (xr[i] * inv);
        o[i] = r;
        if (ob) ob[i] = f32_to_bf16(r);
    }
}

extern "C" __global__ void add_rms_norm_f32(float* x, const float* __restrict__ y,
                                            const float* __restrict__ w, float* out, int width,
                                            float eps, u16* __restrict__ out_bf16) {
    rms_norm_row<true>(x, y, w, out, width, eps, out_bf16);
}

// RMSNorm of wide rows (hidden states), a block per row: out may alias x (Gemma 4 runs ~8 of
// these a layer). x is only read (rms_norm_row without ADD never writes it).
extern "C" __global__ void rms_norm_block_f32(const float* x, const float* __restrict__ w,
                                              float* out, int width, float eps) {
    rms_norm_row<false>(const_cast<float*>(x), nullptr, w, out, width, eps, nullptr);
}

// Where the prologue writes K/V in the paged pool: the layout of ops/fused.rs's KvDest.
struct KvDest {
    void* pool_k;  // null: no pool write
    void* pool_v;
    const int* table_start;
    const int* block_tables;
    int tables_len;
    int block_size;
    int blocks;
    // The pool's values are bf16 (rounded to nearest even once, here), else f32.
    int pool_bf16;
    // The batch copy of K and V for tensor-core prefill attention ([tokens][heads_kv][head_dim]
    // bf16; null: none), written whether or not the pool is.
    u16* copy_k;
    u16* copy_v;
};

// Rotary pairs (i, i + half) one lane rotates: i = lane, lane + 32, ... < half <= 128.
#define ROPE_PER_LANE (FUSED_MAX_HEAD_DIM / 2 / 32)
// Head dims one lane holds: lane, lane + 32, ... < head_dim <= 256.
#define DIMS_PER_LANE (FUSED_MAX_HEAD_DIM / 32)

// EARLY (the _early entry, for decode-sized batches): before the wait (programmatic launch,
// common.cuh), everything that does not come from the q/k/v projection just before: the norm
// weights, the position (uploaded with the batch, before any kernel of the pass), the rotation's
// cos/sin and the pool slot from the block table; after the wait the projection's values go
// straight through norm, rotation and stores. That holds ~20 more registers per thread, which
// halves the resident blocks: a prefill's 4096 x 10 blocks of this latency-bound kernel then took
// 105 instead of 78 us a layer, so batches past a few tiles take the plain entry, which finds
// each of those where it uses it. Both compute the same values.
template <bool EARLY>
__device__ __forceinline__ void qkv_split_norm_rope(
    const float* __restrict__ qkv, float* q, float* k, float* v, const u32* __restrict__ positions,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm,
    const float* __restrict__ inv_freq, int heads_q, int heads_kv, int head_dim, int half,
    float attention_factor, float eps, int v_unit_norm, float* gate, const KvDest& kv) {
    __shared__ float heads_smem[QKV_HEADS_PER_BLOCK][FUSED_MAX_HEAD_DIM];
    float* hd = heads_smem[threadIdx.y];
    const int t = blockIdx.x;
    const int h = blockIdx.y * QKV_HEADS_PER_BLOCK + threadIdx.y;
    const int lane = threadIdx.x;
    if (h >= heads_q + 2 * heads_kv) return;  // warps are independent: no block barrier below
    float* dst;
    const float* norm;
    bool rotate = true;
    if (h < heads_q) {
        dst = q + ((u64)t * heads_q + h) * head_dim;
        norm = q_norm;
    } else if (h < heads_q + heads_kv) {
        dst = k + ((u64)t * heads_kv + (h - heads_q)) * head_dim;
        norm = k_norm;
    } else {
        dst = v + ((u64)t * heads_kv + (h - heads_q - heads_kv)) * head_dim;
        norm = 0;
        rotate = false;
    }
    // This head's row in its pool (K or V) as an element offset, when it is k or v and its block
    // is in range; else -1.
    auto pool_slot = [&](int pos) -> long long {
        if (!kv.pool_k || h < heads_q) return -1;
        const int ti = kv.table_start[t] + pos / kv.block_size;
        const int blk = ti >= 0 && ti < kv.tables_len ? kv.block_tables[ti] : -1;
        if (blk < 0 || blk >= kv.blocks) return -1;
        const bool is_k = h < heads_q + heads_kv;
        const int kvh = is_k ? h - heads_q : h - heads_q - heads_kv;
        const u64 row = (u64)blk * kv.block_size + pos % kv.block_size;
        return (long long)((row * heads_kv + kvh) * head_dim);
    };
    // cos and sin of rotary pair i, scaled by the attention factor.
    auto rotation = [&](int i, int pos, float& c, float& sn) {
        rope_cos_sin(inv_freq[i], pos, attention_factor, c, sn);
    };
    float nw[EARLY ? DIMS_PER_LANE : 1];
    float rc[EARLY ? ROPE_PER_LANE : 1], rs[EARLY ? ROPE_PER_LANE : 1];
    int pos = 0;
    long long slot = -1;
    if constexpr (EARLY) {
#pragma unroll
        for (int d = 0; d < DIMS_PER_LANE; ++d) {
            const int i = lane + 32 * d;
            nw[d] = norm && i < head_dim ? norm[i] : 0.0f;
        }
        pos = (int)positions[t];
#pragma unroll
        for (int d = 0; d < ROPE_PER_LANE; ++d) {
            const int i = lane + 32 * d;
            rc[d] = 0.0f;
            rs[d] = 0.0f;
            if (rotate && i < half) rotation(i, pos, rc[d], rs[d]);
        }
        slot = pool_slot(pos);
    }
    pdl_entry_launch_first();
    // With an output gate (Qwen3.5) each q head's rows are its query then its gate.
    const int q_width = gate ? 2 * head_dim : head_dim;
    const int width = heads_q * q_width + 2 * heads_kv * head_dim;
    const float* row = qkv + (u64)t * width;
    const float* src = h < heads_q ? row + (u64)h * q_width
                                   : row + (u64)heads_q * q_width + (u64)(h - heads_q) * head_dim;
    if (gate && h < heads_q) {
        float* g = gate + ((u64)t * heads_q + h) * head_dim;
        for (int i = lane; i < head_dim; i += 32) g[i] = src[head_dim + i];
    }
    float ss = stage_head(src, hd, head_dim, lane);
    if (norm) {
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
        if constexpr (EARLY) {
#pragma unroll
            for (int d = 0; d < DIMS_PER_LANE; ++d) {
                const int i = lane + 32 * d;
                if (i < head_dim) hd[i] = nw[d] * (hd[i] * inv);
            }
        } else {
            for (int i = lane; i < head_dim; i += 32) hd[i] = norm[i] * (hd[i] * inv);
        }
    } else if (!rotate && v_unit_norm) {
        // v_norm without a learned scale: the weight 1 multiplies exactly, so it is left out.
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
        for (int i = lane; i < head_dim; i += 32) hd[i] = hd[i] * inv;
    }
    __syncwarp();
    if (!EARLY) pos = (int)positions[t];
    if (rotate) {
#pragma unroll
        for (int d = 0; d < ROPE_PER_LANE; ++d) {
            const int i = lane + 32 * d;
            if (i < half) {
                float c, sn;
                if constexpr (EARLY) {
                    c = rc[d];
                    sn = rs[d];
                } else {
                    rotation(i, pos, c, sn);
                }
                float a = hd[i];
                float b = hd[i + half];
                rope_pair(a, b, c, sn);
                hd[i] = a;
                hd[i + half] = b;
            }
        }
        __syncwarp();
    }
    for (int i = lane; i < head_dim; i += 32) dst[i] = hd[i];
    if (kv.copy_k && h >= heads_q) {
        // The same f32 values the pool gets, rounded as the tensor-core kernel rounds the pool.
        const bool is_k = h < heads_q + heads_kv;
        const int kvh = is_k ? h - heads_q : h - heads_q - heads_kv;
        u16* crow = (is_k ? kv.copy_k : kv.copy_v) + ((u64)t * heads_kv + kvh) * head_dim;
        for (int i = lane; i < head_dim; i += 32) crow[i] = f32_to_bf16(hd[i]);
    }
    if (!EARLY) slot = pool_slot(pos);
    if (slot >= 0) {
        void* pool = h < heads_q + heads_kv ? kv.pool_k : kv.pool_v;
        if (kv.pool_bf16) {
            u16* row = reinterpret_cast<u16*>(pool) + slot;
            for (int i = lane; i < head_dim; i += 32) row[i] = f32_to_bf16(hd[i]);
        } else {
            float* row = reinterpret_cast<float*>(pool) + slot;
            for (int i = lane; i < head_dim; i += 32) row[i] = hd[i];
        }
    }
}

#define QKV_PROLOGUE_KERNEL(NAME, EARLY)                                                         \
    extern "C" __global__ void NAME(                                                             \
        const float* __restrict__ qkv, float* q, float* k, float* v,                             \
        const u32* __restrict__ positions, const float* __restrict__ q_norm,                     \
        const float* __restrict__ k_norm, const float* __restrict__ inv_freq, int heads_q,       \
        int heads_kv, int head_dim, int half, float attention_factor, float eps,                 \
        int v_unit_norm, float* gate, const KvDest kv) {                                         \
        qkv_split_norm_rope<EARLY>(qkv, q, k, v, positions, q_norm, k_norm, inv_freq, heads_q,  \
                                   heads_kv, head_dim, half, attention_factor, eps, v_unit_norm, \
                                   gate, kv);                                                    \
    }

QKV_PROLOGUE_KERNEL(qkv_split_norm_rope_f32, false)
QKV_PROLOGUE_KERNEL(qkv_split_norm_rope_early_f32, true)
