// Shared by the attention kernel files (attention.cu, attention_wgmma.cu; compile.rs prepends it
// to both, after common.cuh): the one argument struct every attention kernel takes by value
// (ops/attention.rs `AttnArgs`, the same C layout), the pool addressing, the tile rule, the
// key range, batch-copy scan and key tiles of a prefill tile, and two bf16/exp2 helpers. attention.cu's
// header describes the contract.

// The pool's element type. compile.rs builds each attention file twice: for an f32 pool, and
// with MOERUN_KV_BF16 defined for a bf16 pool (ops/attention.rs picks the build by the pool's
// dtype). A bf16 value is rounded once, when written (to nearest even, as moerun-cpu's bf16 pool
// rounds), and widened exactly when read: attention over a bf16 pool is, bit for bit, attention
// over an f32 pool that holds the rounded values.
// kv4_t: four pool values as loaded (kept so in the decode kernels' prefetch registers, half the
// registers for bf16), widened by widen_kv4 where used.
#ifdef MOERUN_KV_BF16
typedef u16 kv_t;
typedef uint2 kv4_t;
__device__ __forceinline__ kv_t to_kv(float x) { return f32_to_bf16(x); }
// Four pool values at p (8-byte aligned: head_dim is a multiple of 4).
__device__ __forceinline__ kv4_t ld_kv4_raw(const kv_t* p) {
    return *reinterpret_cast<const uint2*>(p);
}
__device__ __forceinline__ kv4_t zero_kv4() { return make_uint2(0u, 0u); }
// Four pool values at p if `pred`, else zeros, as one predicated load (ld_kv_pair says why):
// TIED loads into registers that already hold the zeros; untied writes the zeros under the
// opposite predicate.
template <bool TIED>
__device__ __forceinline__ kv4_t ld_kv4_raw_if(const kv_t* p, bool pred) {
    kv4_t r;
    if constexpr (TIED) {
        r = zero_kv4();
        asm volatile(
            "{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %3, 0;\n\t@q ld.global.v2.u32 {%0, %1}, [%2];"
            "\n\t}"
            : "+r"(r.x), "+r"(r.y)
            : "l"(p), "r"((unsigned)pred));
    } else {
        asm volatile(
            "{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %3, 0;\n\t@q ld.global.v2.u32 {%0, %1}, [%2];"
            "\n\t@!q mov.b32 %0, 0;\n\t@!q mov.b32 %1, 0;\n\t}"
            : "=r"(r.x), "=r"(r.y)
            : "l"(p), "r"((unsigned)pred));
    }
    return r;
}
__device__ __forceinline__ float4 widen_kv4(kv4_t r) {
    return make_float4(__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xffff0000u),
                       __uint_as_float(r.y << 16), __uint_as_float(r.y & 0xffff0000u));
}
#else
typedef float kv_t;
typedef float4 kv4_t;
__device__ __forceinline__ kv_t to_kv(float x) { return x; }
__device__ __forceinline__ kv4_t ld_kv4_raw(const kv_t* p) {
    return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ kv4_t zero_kv4() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
// As the bf16 build's.
template <bool TIED>
__device__ __forceinline__ kv4_t ld_kv4_raw_if(const kv_t* p, bool pred) {
    kv4_t r;
    if constexpr (TIED) {
        r = zero_kv4();
        asm volatile(
            "{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %5, 0;"
            "\n\t@q ld.global.v4.f32 {%0, %1, %2, %3}, [%4];\n\t}"
            : "+f"(r.x), "+f"(r.y), "+f"(r.z), "+f"(r.w)
            : "l"(p), "r"((unsigned)pred));
    } else {
        asm volatile(
            "{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %5, 0;"
            "\n\t@q ld.global.v4.f32 {%0, %1, %2, %3}, [%4];\n\t@!q mov.b32 %0, 0;"
            "\n\t@!q mov.b32 %1, 0;\n\t@!q mov.b32 %2, 0;\n\t@!q mov.b32 %3, 0;\n\t}"
            : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
            : "l"(p), "r"((unsigned)pred));
    }
    return r;
}
__device__ __forceinline__ float4 widen_kv4(kv4_t r) { return r; }
#endif
// Four pool values at p, widened to f32.
__device__ __forceinline__ float4 ld_kv4(const kv_t* p) { return widen_kv4(ld_kv4_raw(p)); }
// The K and V pool values at off + at if `real`, else zeros (a decode kernel's prefetch of a key),
// as predicated loads. Written as an if/else, ptxas sometimes loaded into a temporary and moved it
// into place under the predicate, and a move waits for its load: a prefetch's loads then went out
// one round trip at a time. Predicated loads into their own registers: decode over an f32 pool at
// batch 1 and 8192 keys 35.8 -> 31.2 µs, 8 sequences of 512 keys 21.6 -> 19.8 (H200, `ops_bench
// attention`; docs/perf/cuda-model.md v14). Each form of the load makes one kernel spill (NVRTC
// 13.0: TIED the split kernel at head_dim 512, untied at 16), so the head dims of 4 values per
// lane (VPL 4) take the untied one. Volatile: loads after the programmatic wait must stay after it.
template <int VPL>
__device__ __forceinline__ void ld_kv_pair(const kv_t* k, const kv_t* v, long long off, int at,
                                           bool real, kv4_t& kr, kv4_t& vr) {
    kr = ld_kv4_raw_if<VPL < 4>(k + off + at, real);
    vr = ld_kv4_raw_if<VPL < 4>(v + off + at, real);
}

struct AttnArgs {
    const float* q;
    float* out;
    const kv_t* pool_k;
    const kv_t* pool_v;
    const int* positions;
    const int* table_start;
    const int* block_tables;
    float* part_acc;
    float* part_ml;
    // Per (token, kv head x head chunk): how many of its split blocks have written their partials.
    u32* arrivals;
    // The batch's own K and V rounded to bf16, [n][kv_heads][head_dim] each (attn_tile_bf16 only;
    // null: every key tile comes from the pool).
    const u16* copy_k;
    const u16* copy_v;
    int n;
    int num_heads;
    int kv_heads;
    int head_dim;
    int group;
    int head_chunks;
    int tables_len;
    int blocks;
    int block_size;
    int block_shift;  // log2(block_size), or -1 when it is not a power of two
    int window;
    int chunk;
    int nsplit;
    int tiled;
    int tile_m;
    float scale_log2;
    // The token of the split and cluster kernels' blockIdx.x 0: the host starts their grids at
    // the first token a prefill tile does not own (every token before it is tiled).
    int token0;
    // The output rounded to bf16 too (null: not wanted): the wgmma tile kernel stores its rows
    // there; the host converts the others (ops/attention.rs rest_to_bf16).
    u16* out_bf16;
};

// Block-table entries the folded decode kernels keep in shared memory (attention.cu fold_loads).
#define TAB_N 256

// Element offset of position `pos` (kv head `kh`) in the pool, or -1 when out of range.
__device__ __forceinline__ long long kv_offset(const AttnArgs& a, int ts, int pos, int kh,
                                               const int* tab = nullptr) {
    if (pos < 0) return -1;
    int bi, slot;
    if (a.block_shift >= 0) {
        bi = pos >> a.block_shift;
        slot = pos & (a.block_size - 1);
    } else {
        bi = pos / a.block_size;
        slot = pos - bi * a.block_size;
    }
    const int ti = ts + bi;
    if (ti < 0 || ti >= a.tables_len) return -1;
    // `tab`: the table's first TAB_N entries in shared memory (the folded decode kernels').
    const int blk = tab && ti < TAB_N ? tab[ti] : a.block_tables[ti];
    if (blk < 0 || blk >= a.blocks) return -1;
    return (((long long)blk * a.block_size + slot) * a.kv_heads + kh) * (long long)a.head_dim;
}

__device__ __forceinline__ int window_lo(const AttnArgs& a, int pos) {
    return a.window > 0 ? max(0, pos + 1 - a.window) : 0;
}

// Whether token i lies in a tile the tiled kernel owns (see the header). Every thread of the
// block must call it: it ends in a block-wide barrier.
__device__ __forceinline__ bool tile_owned(const AttnArgs& a, int i) {
    if (!a.tiled) return false;
    const int t0 = (i / a.tile_m) * a.tile_m;
    if (t0 + a.tile_m > a.n) return false;
    const int ts = a.table_start[t0];
    int same = 1;
    for (int r = threadIdx.x; r < a.tile_m; r += blockDim.x) same &= a.table_start[t0 + r] == ts;
    return __syncthreads_and(same) != 0;
}

// The key range [kmin, kend) of tile t0's rows, into shared memory; every thread must call it.
__device__ __forceinline__ void tile_key_range(const AttnArgs& a, int t0, int* s_kmin, int* s_kend) {
    if (threadIdx.x == 0) {
        *s_kmin = 0x7fffffff;
        *s_kend = 0;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < a.tile_m; r += blockDim.x) {
        const int p = a.positions[t0 + r];
        atomicMin(s_kmin, window_lo(a, p));
        atomicMax(s_kend, p + 1);
    }
    __syncthreads();
}

// The first key position of tile t0 that the batch copy serves, into *s_kloc (INT_MAX: none).
// Every token from the one that would hold key kmin up to the tile's last row must belong to the
// tile's sequence at position t + c (c = positions[t0] - t0); the copy serves the keys after the
// last token before t0 that does not, and nothing when a row of the tile itself does not. The
// scan reads positions and table_start as int4 (16-byte aligned buffers, checked by the host):
// all of a thread's loads are in flight at once. Every thread must call it (block barriers).
// M: the tile's rows (a multiple of 4).
template <int M>
__device__ __forceinline__ void batch_copy_start(const AttnArgs& a, int t0, int kmin, int* s_kloc,
                                                 int* s_bad) {
    const int c = a.positions[t0] - t0;
    const int ts = a.table_start[t0];
    // Tokens before max(0, kmin - c) cannot hold a visible key of this sequence's run.
    const int lo = max(0, kmin - c);
    const int hi = t0 + M;  // a multiple of 4: t0 is a multiple of M
    if (threadIdx.x == 0) *s_bad = lo - 1;
    __syncthreads();
    int bad_lo = lo - 1, bad_hi = 0;
    const int4* p4 = reinterpret_cast<const int4*>(a.positions);
    const int4* s4 = reinterpret_cast<const int4*>(a.table_start);
#pragma unroll 8
    for (int q = (lo >> 2) + threadIdx.x; q < (hi >> 2); q += blockDim.x) {
        const int4 p = p4[q];
        const int4 s = s4[q];
        const int pv[4] = {p.x, p.y, p.z, p.w};
        const int sv[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = 4 * q + e;
            const bool bad = t >= lo && (sv[e] != ts || pv[e] != t + c);
            if (bad && t < t0) bad_lo = max(bad_lo, t);
            if (bad && t >= t0) bad_hi = 1;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) bad_lo = max(bad_lo, __shfl_xor_sync(0xffffffffu, bad_lo, o));
    if ((threadIdx.x & 31) == 0) atomicMax(s_bad, bad_lo);
    const bool tile_bad = __syncthreads_or(bad_hi) != 0;  // also orders the atomics before the read
    if (threadIdx.x == 0) *s_kloc = tile_bad ? 0x7fffffff : *s_bad + 1 + c;
    __syncthreads();
}

// The key tiles of N keys of token tile t0 (M rows), after tile_key_range filled *s_kmin and
// *s_kend: the range, how many tiles, and how many of them (the first) come from the pool rather
// than the batch copy (all of them without a copy: the copy's first key is then INT_MAX,
// compared, never offset). Every thread must call it (batch_copy_start's barriers).
struct KeyTiles {
    int kmin, kend, ntiles, npool;
};
template <int M, int N>
__device__ __forceinline__ KeyTiles key_tiles(const AttnArgs& a, int t0, const int* s_kmin,
                                              const int* s_kend, int* s_kloc, int* s_bad) {
    KeyTiles k;
    k.kmin = *s_kmin;
    k.kend = *s_kend;
    k.ntiles = k.kmin < k.kend ? (k.kend - k.kmin + N - 1) / N : 0;
    int kloc = 0x7fffffff;
    if (a.copy_k) {
        batch_copy_start<M>(a, t0, k.kmin, s_kloc, s_bad);
        kloc = *s_kloc;
    }
    k.npool = kloc <= k.kmin   ? 0
              : kloc >= k.kend ? k.ntiles
                               : min(k.ntiles, (kloc - k.kmin + N - 1) / N);
    return k;
}

// Two f32 as a bf16x2 register, `lo` in the low half (the lower column of a fragment).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x by one MUFU.EX2, subnormal results flushed to 0. exp2f compiles (without --ftz) to four
// instructions, a range test and two multiplies around it that keep 2^x for x < -126 subnormal:
// softmax weights under 2^-126 of their row's max, far below the f32 resolution of the row's
// sum (which holds the max's weight 1).
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
