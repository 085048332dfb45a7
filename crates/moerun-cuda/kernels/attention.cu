// Paged causal attention over one layer's KV pool, f32 activations (ops/attention.rs wraps these).
//
// Pool: K and V each [blocks][block_size][kv_heads][head_dim], f32 or (the MOERUN_KV_BF16
// build, attention_common.cuh) bf16; every kernel below reads it through ld_kv4 or the staging
// helpers, so both builds do the same arithmetic on the same widened values. Token i of the
// flat batch sits at position positions[i] of the sequence whose block table starts at
// block_tables[table_start[i]]: position p of that sequence lives in block
// block_tables[table_start[i] + p / block_size], slot p % block_size. Token i attends to its
// sequence's positions lo..=p, lo = max(0, p + 1 - window) (window 0: no window), as
// moerun-cpu's paged_attention does. Query head h reads kv head h / group.
//
// Scores live in the log2 domain: q is multiplied by scale * log2(e) once, so softmax weights are
// exp2(s - max), the same numbers as exp(scale * q.k - max). Every online-softmax update guards
// the all-masked case (max = -inf) so that no -inf - -inf ever makes a NaN.
//
// Kernels (all take one AttnArgs by value; launch shapes are repeated in ops/attention.rs):
// - kv_write_f32: grid (n), block 128; copies token i's K and V rows into its slot (and, given a
//   batch copy, rounded to bf16 into its row there).
// - attn_split_d<D>_g<G>: split-K flash-decoding, exact f32. Grid (n, nsplit, kv_heads *
//   head_chunks), block 128 (dynamic shared memory below). A block owns one token,
//   one kv head, up to G of its query heads (head chunk), and one split of the token's keys, so
//   each K/V row is read once for all the query heads of its group. Groups of L lanes each take
//   one key (L = D / 4 lanes of one float4 each; two float4 for D = 256, four for D = 512, where
//   G is at most 2), U keys per group per
//   step with the next step's rows already loading (register double buffer). A key's G partial
//   dot products are reduce-scattered over the group (each lane ends up owning G / L' heads'
//   scores), so shuffles and exp2 per key are ~G / 4 instead of G * log2(L); the owners run the
//   online softmax and broadcast the weights. Then the groups' states merge (shuffles, then
//   shared memory). With nsplit == 1 the block writes the normalised output, else an
//   unnormalised partial (acc, max, sum); the last of a token's active split blocks for its kv
//   head and head chunk to finish (an atomic count in `arrivals`, reset by that block) merges the
//   partials of its heads in split order (merge_splits), so no second launch is needed. Dynamic
//   shared memory: the larger of 4 * G * (head_dim + 2) floats and G * nsplit floats (merge).
// - attn_tile_f32_c<C>: tiled exact-f32 prefill on CUDA cores, tiles of 64 tokens (head_dim <= 256:
//   the tiles of head_dim 512 would need 400 KiB of shared memory, so that size never tiles). Grid (n / 64,
//   num_heads), block 256, dynamic shared (3 * 64 * (head_dim + 4) + 64 * 65) floats: Q, K and V
//   tiles of 64 rows (K/V by cp.async), P. Each thread owns 4 query rows x 4 keys of S and
//   4 rows x C float4 columns of O.
// - attn_tile_bf16_d<D>: tensor cores (mma.sync m16n8k16, bf16 operands, f32 accumulation),
//   tiles of 64 tokens. Grid (n / 64, num_heads), block 128 (one warp per 16 query rows), two
//   blocks per SM; dynamic shared: 3 stages of the bf16 K and V tiles, [64][D + 8] each, which
//   ldmatrix(.trans) reads. Key tiles of the batch's own positions are cp.async-copied from the
//   batch copy (AttnArgs.copy_k/v); the others are read from the pool and rounded (an f32
//   pool; a bf16 one holds them rounded already; see the section below).
//   attn_tile_bf16_h2_d<D> and _h4_d<D>: the same tiles and arithmetic (the same bits), each
//   warp 16 tokens of two query heads of one kv head (32 rows sharing every K and V fragment);
//   blocks of 2 heads (grid (n / 64, num_heads / 2), block 128, 2 stages + a bf16 q
//   tile, two blocks per SM) or 4 heads (grid (n / 64, num_heads / 4), block 256, 3 stages + q,
//   one block per SM).
//
// Which kernel owns a token (the tile rule, `tile_owned`): when the host launches a tiled kernel
// (n >= tile_m, AttnArgs.tiled), a tile of tile_m consecutive tokens that lies wholly inside the
// batch and whose tokens all share one table_start (one sequence) belongs to the tiled kernel;
// every other token to attn_split. Each kernel evaluates the rule itself from the
// same data, so the launches cover the batch exactly once without the host reading device data.
//
// Keys whose block-table entry or block id is out of range (a caller bug) are skipped, never read
// out of bounds; kv_write_f32 skips such rows too.

#define TILE_M 64
#define TILE_N 64
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float4 zero4() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}
__device__ __forceinline__ float4 scale4(float4 a, float s) {
    return make_float4(a.x * s, a.y * s, a.z * s, a.w * s);
}
__device__ __forceinline__ float4 axpy4(float p, float4 x, float4 y) {
    return make_float4(y.x + p * x.x, y.y + p * x.y, y.z + p * x.z, y.w + p * x.w);
}
__device__ __forceinline__ float4 shfl_xor4(float4 v, int o) {
    return make_float4(__shfl_xor_sync(0xffffffffu, v.x, o), __shfl_xor_sync(0xffffffffu, v.y, o),
                       __shfl_xor_sync(0xffffffffu, v.z, o), __shfl_xor_sync(0xffffffffu, v.w, o));
}
// The reference point of an online-softmax step: the running max, or 0 while nothing is visible.
__device__ __forceinline__ float softmax_ref(float mx) { return mx == NEG_INF ? 0.0f : mx; }


// Four pool values (src; `ok` false: zeros, nothing read) into f32 shared memory at dst, for a
// tile read as f32: an f32 pool by cp.async (the caller commits and waits), a bf16 pool widened
// by a plain load and store (done when this returns).
__device__ __forceinline__ void stage_kv4_f32(float* dst, const kv_t* src, bool ok) {
#ifdef MOERUN_KV_BF16
    st4(dst, ok ? ld_kv4(src) : zero4());
#else
    cp_async16(dst, src, ok ? 16 : 0);
#endif
}

// Four pool values (src; `ok` false: zeros, nothing read) by cp.async into a 16-byte slot at dst
// of a tile that is rounded to bf16 afterwards (landed_bf16x4): an f32 pool's 16 bytes, a bf16
// pool's 8 (the slot's first half).
__device__ __forceinline__ void land_kv4(float* dst, const kv_t* src, bool ok) {
#ifdef MOERUN_KV_BF16
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(d), "l"(src),
                 "r"(ok ? 8 : 0)
                 : "memory");
#else
    cp_async16(dst, src, ok ? 16 : 0);
#endif
}

// The four values land_kv4 put at p, as two pairs of bf16 (round to nearest even from an f32
// pool; as they are from a bf16 one, which holds the same rounding of the same values).
__device__ __forceinline__ uint2 landed_bf16x4(const float* p) {
#ifdef MOERUN_KV_BF16
    return *reinterpret_cast<const uint2*>(p);
#else
    const float4 x = ld4(p);
    return make_uint2(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w));
#endif
}

// ---- kv_write ----

// The cluster-only builds (ATTN_CLUSTER_ONLY: compile.rs's 16-block `attention_cl16` files) hold
// the cluster decode kernels alone; the other entry points come from the plain build.
#ifndef ATTN_CLUSTER_ONLY
// With copy_k non-null, also writes row i rounded to bf16 into the batch copy (whatever the
// pool's table says: the copy is indexed by batch row). f32 rows in; the pool's type out.
extern "C" __global__ void __launch_bounds__(128)
    kv_write_f32(const float* __restrict__ k, const float* __restrict__ v,
                 const int* __restrict__ positions, const int* __restrict__ table_start,
                 const int* __restrict__ block_tables, int tables_len, kv_t* __restrict__ pool_k,
                 kv_t* __restrict__ pool_v, int n, int width, int block_size, int blocks,
                 u16* __restrict__ copy_k, u16* __restrict__ copy_v) {
    const int i = blockIdx.x;
    if (i >= n) return;
    if (copy_k) {
        const u64 src = (u64)i * width;
        for (int e = threadIdx.x; e < width; e += blockDim.x) {
            copy_k[src + e] = f32_to_bf16(k[src + e]);
            copy_v[src + e] = f32_to_bf16(v[src + e]);
        }
    }
    const int pos = positions[i];
    if (pos < 0) return;
    const int ti = table_start[i] + pos / block_size;
    if (ti < 0 || ti >= tables_len) return;
    const int blk = block_tables[ti];
    if (blk < 0 || blk >= blocks) return;
    const u64 dst = ((u64)blk * block_size + pos % block_size) * width;
    const u64 src = (u64)i * width;
    for (int e = threadIdx.x; e < width; e += blockDim.x) {
        pool_k[dst + e] = to_kv(k[src + e]);
        pool_v[dst + e] = to_kv(v[src + e]);
    }
}
#endif  // ATTN_CLUSTER_ONLY

// ---- split-K decode ----

#define SPLIT_WARPS 4
#define SPLIT_THREADS (32 * SPLIT_WARPS)
// Keys per group per step by default (rows of d <= 128: 4; of d = 256, two float4 per lane: 2;
// the split kernels of d = 128 take 2, see ATTN_SPLIT_2KEYS).
#define SPLIT_KEYS 4

// Reduce-scatter of GM per-lane partial sums over a group of L lanes (common.cuh's
// warp_reduce_scatter does the same steps over a whole warp; these kernels keep the loop form
// they were measured with: over L lanes through that template, the SASS of the g8 builds
// changed): each halving step sends
// half of the heads to the partner lane and keeps the other half, so after the log2(GM) halving
// steps (as far as the group has lanes) a lane holds the group's full sums of OWN heads,
// base(lane) .. base(lane) + OWN, in x[0 .. OWN).
template <int L, int GM>
struct Scatter {
    static constexpr int NH = ilog2(GM) < ilog2(L) ? ilog2(GM) : ilog2(L);
    static constexpr int OWN = GM >> NH;

    __device__ static __forceinline__ void reduce(float (&x)[GM], int lane) {
#pragma unroll
        for (int k = 0; k < ilog2(L); ++k) {
            const int o = L >> (k + 1);
            if (k < NH) {
                const int half = GM >> (k + 1);
                const bool up = (lane & o) != 0;
#pragma unroll
                for (int j = 0; j < half; ++j) {
                    const float send = up ? x[j] : x[j + half];
                    const float keep = up ? x[j + half] : x[j];
                    x[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                }
            } else {
                x[0] += __shfl_xor_sync(0xffffffffu, x[0], o);
            }
        }
    }

    // The lane of this lane's group that owns head h (its slot there is h % OWN).
    __device__ static __forceinline__ int owner(int lane, int h) {
        int src = lane & ~(L - 1);
#pragma unroll
        for (int k = 0; k < NH; ++k)
            if (h & (GM >> (k + 1))) src |= L >> (k + 1);
        return src;
    }

    // Value `v[h % OWN]` of head h's owner, in every lane.
    template <int N>
    __device__ static __forceinline__ float from_owner(const float (&v)[N], int lane, int h) {
        if constexpr (OWN == GM) {
            return v[h];
        } else {
            return __shfl_sync(0xffffffffu, v[h % OWN], owner(lane, h));
        }
    }
};

// One key's K and V rows at pool offset `off` (-1: none, zeros), this lane's VPL float4 of each;
// whether the key is real.
template <int L, int VPL>
__device__ __forceinline__ bool key_rows(const AttnArgs& a, long long off, int sub, int d4,
                                         kv4_t (&kr)[VPL], kv4_t (&vr)[VPL]) {
    const bool real = off >= 0;
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        const int c = sub + L * v;
        ld_kv_pair<VPL>(a.pool_k, a.pool_v, off, 4 * c, real && c < d4, kr[v], vr[v]);
    }
    return real;
}

// Rows of the U keys group `grp` takes at step jb (zeros past k1 or out of range; ok[u] says
// which are real); block-table entries below TAB_N from `tab` when given (kv_offset). Every lane
// of the warp takes part (its shuffles): callers keep to block-uniform control flow.
template <int W, int L, int VPL, int U>
__device__ __forceinline__ void fetch_keys(const AttnArgs& a, int ts, int kh, int jb, int k1,
                                           int grp, int sub, int d4, kv4_t (&kr)[U][VPL],
                                           kv4_t (&vr)[U][VPL], bool (&ok)[U],
                                           const int* tab = nullptr) {
    constexpr int GROUPS = 32 * W / L;
    if constexpr (L == 32) {
        // A warp is one group (grp is the warp): lane u < U works out the pool offset of the
        // group's key u, and every lane takes the U offsets by shuffles. Where every lane worked
        // out all U (each a table lookup and a 64-bit chain behind branches, ~95 SASS
        // instructions a key, one after another), the folded attention's first two steps took
        // ~3,400 cycles to issue after its wait, then ~1,700, and batch-1 decode went 456.5 ->
        // 464.2 tok/s (H200, docs/perf/cuda-model.md v22).
        static_assert(U <= 32, "one key a lane");
        const int lane = threadIdx.x & 31;
        long long mine = -1;
        if (lane < U) {
            const int j = jb + grp + GROUPS * lane;
            if (j < k1) mine = kv_offset(a, ts, j, kh, tab);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            ok[u] = key_rows<L, VPL>(a, __shfl_sync(0xffffffffu, mine, u), sub, d4, kr[u], vr[u]);
    } else {
        // Several groups a warp (head dims below 128): each lane its U offsets (the lane-shared
        // form made the d16 split and d32 / d64 cluster builds spill).
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = jb + grp + GROUPS * u;
            ok[u] = key_rows<L, VPL>(a, j < k1 ? kv_offset(a, ts, j, kh, tab) : -1, sub, d4,
                                     kr[u], vr[u]);
        }
    }
}

// The rows of a block's first DEPTH steps from k0 (keys below k1): fetch_keys into kr (and kr2,
// one step on, for DEPTH 2).
template <int W, int L, int VPL, int U, int DEPTH>
__device__ __forceinline__ void fetch_first_steps(const AttnArgs& a, int ts, int kh, int k0,
                                                  int k1, int grp, int sub, int d4,
                                                  kv4_t (&kr)[U][VPL], kv4_t (&vr)[U][VPL],
                                                  bool (&ok)[U], kv4_t (&kr2)[U][VPL],
                                                  kv4_t (&vr2)[U][VPL], bool (&ok2)[U],
                                                  const int* tab) {
    constexpr int STEP = 32 * W / L * U;  // attend_keys' step: its groups' U keys each
    fetch_keys<W, L, VPL, U>(a, ts, kh, k0, k1, grp, sub, d4, kr, vr, ok, tab);
    if constexpr (DEPTH == 2)
        fetch_keys<W, L, VPL, U>(a, ts, kh, k0 + STEP, k1, grp, sub, d4, kr2, vr2, ok2, tab);
}

// Loads of partials other blocks wrote during this launch: through L2 (load_cg and this).
__device__ __forceinline__ float4 ld_cg4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

// The weights exp2(m_s - max) of one row's `active` partials, (max, sum) pairs at `ml`, into
// w[0 .. active) (one warp); returns their sum weighted by the partials' sums (the softmax
// denominator), in every lane.
__device__ __forceinline__ float partial_weights(const float* ml, int active, float* w) {
    const int lane = threadIdx.x & 31;
    float mx = NEG_INF;
    for (int s = lane; s < active; s += 32) mx = fmaxf(mx, load_cg(ml + 2 * s));
    const float ref = softmax_ref(warp_max(mx));
    float sum = 0.0f;
    for (int s = lane; s < active; s += 32) {
        const float ws = exp2f(load_cg(ml + 2 * s) - ref);
        w[s] = ws;
        sum += ws * load_cg(ml + 2 * s + 1);
    }
    return warp_sum(sum);
}

// One float4 of a row's merged output: sum over the `active` partials (rows `d` apart from `acc`)
// of weight x partial in split order, over the denominator `sum`; 8 partials' loads in flight at a
// time (they come from L2, so the merge is as long as its chain of dependent load rounds).
__device__ __forceinline__ float4 merge_partials(const float* acc, const float* w, int active, int d,
                                                 float sum) {
    float4 num = zero4();
    int s = 0;
    for (; s + 8 <= active; s += 8) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = ld_cg4(acc + (u64)(s + u) * d);
#pragma unroll
        for (int u = 0; u < 8; ++u) num = axpy4(w[s + u], v[u], num);
    }
    for (; s < active; ++s) num = axpy4(w[s], ld_cg4(acc + (u64)s * d), num);
    return sum > 0.0f ? make_float4(num.x / sum, num.y / sum, num.z / sum, num.w / sum) : zero4();
}

// Token i's output for query heads h0 .. h0 + gh from its `active` split partials: per head the
// splits' weights exp2(m_s - max) (one warp per head, into `w`, [gh][active]) and their sum
// weighted by l_s, then each output element sums weight x partial over the splits in split order
// (a float4 of elements per item; head_dim is a multiple of 4).
__device__ __forceinline__ void merge_splits(const AttnArgs& a, int i, int h0, int gh, int active,
                                             float* w) {
    __shared__ float sums[8];  // gh <= 8
    const int d = a.head_dim;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    for (int h = warp; h < gh; h += SPLIT_WARPS) {
        const float* ml = a.part_ml + ((u64)i * a.num_heads + h0 + h) * a.nsplit * 2;
        const float sum = partial_weights(ml, active, w + h * active);
        if (lane == 0) sums[h] = sum;
    }
    __syncthreads();
    const int d4 = d >> 2;
    for (int idx = threadIdx.x; idx < gh * d4; idx += SPLIT_THREADS) {
        const int h = idx / d4;
        const int c = idx - h * d4;
        const u64 row = (u64)i * a.num_heads + h0 + h;
        const float* acc = a.part_acc + row * a.nsplit * d + 4 * c;
        st4(a.out + row * d + 4 * c, merge_partials(acc, w + h * active, active, d, sums[h]));
    }
}

// ---- the attention prologue folded into decode attention (attn_cluster_d<D>_g<G>_pro) ----
//
// At batch 1 the prologue kernel (fused.cu qkv_split_norm_rope) was a launch and a programmatic
// wait of its own between the q/k/v GEMV and attention, ~3 µs a layer for ~40 KB of work. The
// _pro builds of the cluster kernel take the GEMV's raw rows instead. Before the wait each block
// puts the token's rotation (cos, sin), the q/k norm weights and the block table's first entries
// in shared memory and looks up the own key's pool slot (fold_loads, fold_constants; no earlier
// kernel writes them); after it, warps 0 .. gh - 1 make the block's query heads (RMSNorm by
// q_norm, rotate-half RoPE) in shared memory, and in the blocks whose keys hold the token's own
// position warps GM and GM + 1 make that key (k_norm, RoPE) and value, store them in the pool
// slot and keep them (as stored) in shared memory, from where the block's own rows of that key
// are set (no read back from the pool). The arithmetic is qkv_split_norm_rope's, lane by lane,
// with the same rounding helpers (common.cuh rope_cos_sin, rope_pair): the same q, the same pool
// values, the same output bits. Both head chunks of a kv head hold that position and both
// store it, the same bits; a block that reads it from the pool (a later step of a long block)
// does so after its own store and a block barrier. Every token of the batch must be its own
// sequence's only token (a decode step; the host checks): no block needs a key another token's
// blocks make.
struct PrologueArgs {
    // [n][(num_heads + 2 * kv_heads) * head_dim]: each token's q heads, then k heads, then v
    // heads, as the stacked projection writes them.
    const float* qkv;
    const float* q_norm;  // head_dim weights, or null: no norm
    const float* k_norm;
    const float* inv_freq;  // [half]
    float attention_factor;
    float eps;
    int half;
};

// The fold's shared memory (DMAX: the build's widest head): the query heads, the own key and
// value as f32 (staging) and as stored in the pool, the rotation, the q and k norm weights.
template <int GM, int DMAX>
struct FoldSmem {
    float q[GM][DMAX];
    float kv[2][DMAX];
    kv_t kv_stored[2][DMAX];
    float cos_sin[2][DMAX / 2];
    float norm[2][DMAX];
    int tab[TAB_N];  // block_tables[0 .. TAB_N), -1 past its end (fold_loads)
};

// What the fold needs that no earlier kernel writes, one thread's share (the _pro builds'
// head_dim <= 128 < the block's 256 threads = TAB_N: one element each): the rotary inverse
// frequency, the q and k norm weights and an entry of the block table. Loaded at the kernel's
// entry, all in the round trip of the token's position, because at batch 1 the way to the
// programmatic wait is on the critical path (the blocks reach the wait after the q/k/v GEMV has
// finished, so each dependent round trip before it delays the layer). Loaded where they are
// used, the constants took a round trip of their own (loading them here: decode +1.3%) and the
// keys' table entries, which need the position, another (+1.4% more; H200,
// docs/perf/cuda-model.md v20).
struct FoldLoads {
    float inv_freq, q_norm, k_norm;
    int tab;
};
__device__ __forceinline__ FoldLoads fold_loads(const AttnArgs& a, const PrologueArgs& p) {
    const int t = threadIdx.x;
    FoldLoads f;
    f.inv_freq = t < p.half ? p.inv_freq[t] : 0.0f;
    f.q_norm = p.q_norm && t < a.head_dim ? p.q_norm[t] : 0.0f;
    f.k_norm = p.k_norm && t < a.head_dim ? p.k_norm[t] : 0.0f;
    f.tab = t < a.tables_len ? a.block_tables[t] : -1;
    return f;
}

// Before the wait, from fold_loads' values: the cos and sin of the token's position `pos` per
// rotary pair into fs.cos_sin, the q and k norm weights into fs.norm (read after the wait, the
// weights were a second L2 round trip on the chain, behind the head's own), the block table's
// first entries into fs.tab. Every thread must call it: it ends in a block barrier.
template <int GM, int DMAX>
__device__ __forceinline__ void fold_constants(const AttnArgs& a, const PrologueArgs& p, int pos,
                                               const FoldLoads& f, FoldSmem<GM, DMAX>& fs) {
    const int t = threadIdx.x;
    if (t < p.half)
        rope_cos_sin(f.inv_freq, pos, p.attention_factor, fs.cos_sin[0][t], fs.cos_sin[1][t]);
    if (t < a.head_dim) {
        if (p.q_norm) fs.norm[0][t] = f.q_norm;
        if (p.k_norm) fs.norm[1][t] = f.k_norm;
    }
    if (t < TAB_N) fs.tab[t] = f.tab;
    __syncthreads();
}

// One head of the prologue by one warp in hd (head_dim floats of shared memory, on their way
// there from fold_prologue_fetch): RMSNorm by `norm` (none when null), then, if `rotate`,
// rotate-half RoPE by cos_sin; the arithmetic of qkv_split_norm_rope, lane by lane.
template <int DMAX>
__device__ __forceinline__ void prologue_head(const float* norm, bool rotate,
                                              const PrologueArgs& p, int d,
                                              const float (&cos_sin)[2][DMAX / 2], float* hd) {
    const int lane = threadIdx.x & 31;
    // The head is already on its way into hd (fold_prologue_fetch): wait for it, then its squares
    // in stage_head's order.
    cp_async_wait<0>();
    __syncwarp();
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss += hd[i] * hd[i];
    if (norm) {
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)d + p.eps);
        for (int i = lane; i < d; i += 32) hd[i] = norm[i] * (hd[i] * inv);
    }
    __syncwarp();
    if (rotate) {
        for (int i = lane; i < p.half; i += 32) {
            float x = hd[i];
            float y = hd[i + p.half];
            rope_pair(x, y, cos_sin[0][i], cos_sin[1][i]);
            hd[i] = x;
            hd[i + p.half] = y;
        }
        __syncwarp();
    }
}

// The q/k/v values of this warp's head in fold_prologue, copied asynchronously into its staging
// row right after the wait, so that their round trip overlaps the first steps' key loads the
// block issues next (prologue_head waits for them): the prologue done ~570 cycles sooner,
// batch-1 decode 466.0 -> 467.6 tok/s (H200, docs/perf/cuda-model.md v22). Its warps and heads
// must be fold_prologue's, whose prologue_head calls wait for exactly these copies (written out
// in both: one shared role test changed the measured PTX).
template <int W, int GM, int DMAX>
__device__ __forceinline__ void fold_prologue_fetch(const AttnArgs& a, const PrologueArgs& p,
                                                    int i, int kh, int h0, int gh, bool own,
                                                    FoldSmem<GM, DMAX>& fs) {
    const int warp = threadIdx.x >> 5;
    const int d = a.head_dim;
    const float* row = p.qkv + (u64)i * (a.num_heads + 2 * a.kv_heads) * d;
    const float* src;
    float* hd;
    if (warp < gh) {
        src = row + (u64)(h0 + warp) * d;
        hd = fs.q[warp];
    } else if (own && warp >= GM && warp < GM + 2) {
        const int is_k = warp == GM;
        src = row + (u64)(a.num_heads + (is_k ? kh : a.kv_heads + kh)) * d;
        hd = fs.kv[1 - is_k];
    } else {
        return;
    }
    for (int c = threadIdx.x & 31; c < d / 4; c += 32) cp_async16(hd + 4 * c, src + 4 * c, 16);
    cp_async_commit();
}

// The fold's work after the programmatic wait, on the heads fold_prologue_fetch copied in (a
// block of gh query heads of one kv head): the q heads in fs.q; when this block holds the
// token's position (`own`), the key and value into the pool slot `slot` (when in range) and
// fs.kv_stored. Ends in a block barrier. W warps, at least GM + 2.
template <int W, int GM, int DMAX>
__device__ __forceinline__ void fold_prologue(const AttnArgs& a, const PrologueArgs& p, int gh,
                                              bool own, long long slot, FoldSmem<GM, DMAX>& fs) {
    static_assert(W >= GM + 2, "a warp for each query head, the key and the value");
    const int warp = threadIdx.x >> 5;
    const int d = a.head_dim;
    if (warp < gh) {
        prologue_head<DMAX>(p.q_norm ? fs.norm[0] : nullptr, true, p, d, fs.cos_sin, fs.q[warp]);
    } else if (own && warp >= GM && warp < GM + 2) {
        const int is_k = warp == GM;
        float* hd = fs.kv[1 - is_k];
        prologue_head<DMAX>(is_k && p.k_norm ? fs.norm[1] : nullptr, is_k, p, d, fs.cos_sin, hd);
        kv_t* dst = const_cast<kv_t*>(is_k ? a.pool_k : a.pool_v) + slot;
        for (int e = threadIdx.x & 31; e < d; e += 32) {
            const kv_t x = to_kv(hd[e]);
            fs.kv_stored[1 - is_k][e] = x;
            if (slot >= 0) dst[e] = x;
        }
    }
    __syncthreads();
}

// The own key's rows where this lane's group holds them in a prefetch buffer of the step from
// key jb (U keys per group): rows from fs.kv_stored, marked real.
template <int W, int L, int VPL, int U, int GM, int DMAX>
__device__ __forceinline__ void set_own_key(int jb, int pos, int grp, int sub, int d4,
                                            const FoldSmem<GM, DMAX>& fs, kv4_t (&kr)[U][VPL],
                                            kv4_t (&vr)[U][VPL], bool (&ok)[U]) {
    constexpr int GROUPS = 32 * W / L;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (jb + grp + GROUPS * u != pos) continue;
        ok[u] = true;
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = sub + L * v;
            if (c < d4) {
                kr[u][v] = *reinterpret_cast<const kv4_t*>(&fs.kv_stored[0][4 * c]);
                vr[u][v] = *reinterpret_cast<const kv4_t*>(&fs.kv_stored[1][4 * c]);
            }
        }
    }
}

// One block's pass over keys k0 .. k1 - 1 of token i for query heads h0 .. h0 + gh (of kv head
// kh): W warps of L-lane groups, each group one key at a time (U per step, the next step's rows
// loading meanwhile), then the groups of each warp merged by shuffles. Leaves each warp's state
// in shared memory: unnormalised acc in s_acc [W][GM][d], (max, sum) in s_ml [W][GM][2], for
// h < gh; ends in a barrier. An empty range leaves (-inf, 0) and zeros.
// EARLY (programmatic dependent launch, common.cuh): the kernel has not waited for the one before
// it yet. Keys before `fresh` were written by earlier passes, so the first DEPTH steps' rows of
// those load first; then the wait, and q and the fresh rows (the previous kernel writes them)
// after. DEPTH 2 holds two steps of rows (two buffers in turn, each refilled with the step two
// ahead once used), so a block of two steps has all its rows loaded when it starts computing,
// and the loads of a longer block run a step further ahead.
// PRO (the cluster kernel's _pro builds, EARLY only): the folded prologue from `pro`, in `fold`
// (q is read from there, not a.q); the token's own key is then the only fresh one, and the
// first DEPTH steps' rows load right after the wait, not before it (see there).
template <int W, int L, int VPL, int GM, bool EARLY = false, int U = SPLIT_KEYS / VPL,
          int DEPTH = 1, bool PRO = false>
__device__ __forceinline__ void attend_keys(const AttnArgs& a, int i, int kh, int h0, int gh, int ts,
                                            int k0, int k1, float* s_acc, float* s_ml,
                                            int fresh = 0, const PrologueArgs* pro = nullptr,
                                            FoldSmem<GM, 4 * L * VPL>* fold = nullptr,
                                            const FoldLoads* early = nullptr) {
    constexpr int GROUPS = 32 * W / L;
    using S = Scatter<L, GM>;
    constexpr int OWN = S::OWN;
    const int d = a.head_dim;
    const int d4 = d >> 2;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sub = lane & (L - 1);
    const int grp = threadIdx.x / L;

    static_assert(DEPTH == 1 || (DEPTH == 2 && EARLY), "two steps ahead: the cluster kernel's");
    static_assert(!PRO || EARLY, "the folded prologue runs after the programmatic wait");
    constexpr int DMAX = 4 * L * VPL;
    constexpr int STEP = GROUPS * U;
    kv4_t kr[U][VPL], vr[U][VPL];
    bool ok[U];
    // The next step's rows (DEPTH 2 only; unused otherwise).
    kv4_t kr2[U][VPL], vr2[U][VPL];
    bool ok2[U];
    // The folded builds look their keys up in the fold's copy of the block table, so their
    // constants go to shared memory first.
    const int* tab = PRO ? fold->tab : nullptr;
    if constexpr (EARLY) {
        const int old_end = min(k1, fresh);
        const int pos = PRO ? a.positions[i] : 0;  // the token's position (the folded builds)
        if constexpr (PRO) fold_constants<GM, DMAX>(a, *pro, pos, *early, *fold);
        probe_mark(16);
        // The rows of keys earlier passes wrote load before the wait, but in the folded builds,
        // whose way to the wait is on the chain (fold_loads): there they load right after it,
        // beside the prologue's reads. Before it, their ~880 instructions of addresses and
        // loads, issued while the q/k/v GEMV's last blocks stream, took ~3,300 cycles (probe
        // marks 16-17); after it they overlap the prologue (batch-1 decode +0.65%; H200,
        // docs/perf/cuda-model.md v21).
        if constexpr (PRO) {
            // The token's own key, the only fresh one (the token is its sequence's only one, so
            // fresh == pos): set in the fetched rows that hold it, not read back. (Were the
            // host's promise broken, keys fresh .. pos - 1 would stay masked: wrong, but only
            // this token's own slot is ever written.) Its pool slot comes from the positions and
            // block tables, which no earlier kernel writes: looked up before the wait (after it,
            // the two dependent reads delayed the block holding the key, the cluster's last).
            const bool own = pos >= k0 && pos < k1;
            const long long slot = own ? kv_offset(a, ts, pos, kh, tab) : -1;
            probe_mark(18);
            pdl_wait();
            probe_mark(1);
            fold_prologue_fetch<W, GM, DMAX>(a, *pro, i, kh, h0, gh, own, *fold);
            fetch_first_steps<W, L, VPL, U, DEPTH>(a, ts, kh, k0, old_end, grp, sub, d4, kr, vr,
                                                   ok, kr2, vr2, ok2, tab);
            probe_mark(17);
            fold_prologue<W, GM, DMAX>(a, *pro, gh, own, slot, *fold);
            probe_mark(7);
            // The o_proj GEMV launches (and streams its weights) from here, not from the wait:
            // launched at the wait, its stream overlapped this kernel's own key fetches, and the
            // keys' loop took ~3,900 cycles more (MOERUN_PROBE marks 8-9, Qwen3-30B-A3B shapes at
            // batch 1); from the loop's end, the GEMV had too little time to load. Decode 409.8 /
            // 413.6-415.8 / 405.0-405.3 tok/s (wait / here / loop end; H200, docs/perf/cuda-model.md
            // v16).
            pdl_launch_dependents();
            if (slot >= 0) {  // block-uniform
                set_own_key<W, L, VPL, U>(k0, pos, grp, sub, d4, *fold, kr, vr, ok);
                if constexpr (DEPTH == 2)
                    set_own_key<W, L, VPL, U>(k0 + STEP, pos, grp, sub, d4, *fold, kr2, vr2, ok2);
            }
        } else {
            fetch_first_steps<W, L, VPL, U, DEPTH>(a, ts, kh, k0, old_end, grp, sub, d4, kr, vr, ok,
                                                   kr2, vr2, ok2, tab);
            pdl_entry();
            probe_mark(1);
            if (fresh < k1 && fresh < k0 + STEP)  // block-uniform
                fetch_keys<W, L, VPL, U>(a, ts, kh, k0, k1, grp, sub, d4, kr, vr, ok);
            if constexpr (DEPTH == 2)
                if (fresh < k1 && fresh < k0 + 2 * STEP)
                    fetch_keys<W, L, VPL, U>(a, ts, kh, k0 + STEP, k1, grp, sub, d4, kr2, vr2,
                                             ok2);
        }
    }
    float4 qr[GM][VPL];
#pragma unroll
    for (int h = 0; h < GM; ++h)
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = sub + L * v;
            qr[h][v] = (h < gh && c < d4)
                           ? scale4(PRO ? ld4(&fold->q[h][4 * c])
                                        : ld4(a.q + ((u64)i * a.num_heads + h0 + h) * d + 4 * c),
                                    a.scale_log2)
                           : zero4();
        }
    probe_mark(8);
    // Running max and sum of the heads this lane owns; the accumulator of every head.
    float mo[OWN], lo_sum[OWN];
#pragma unroll
    for (int j = 0; j < OWN; ++j) {
        mo[j] = NEG_INF;
        lo_sum[j] = 0.0f;
    }
    float4 acc[GM][VPL];
#pragma unroll
    for (int h = 0; h < GM; ++h)
#pragma unroll
        for (int v = 0; v < VPL; ++v) acc[h][v] = zero4();

    if constexpr (!EARLY) fetch_keys<W, L, VPL, U>(a, ts, kh, k0, k1, grp, sub, d4, kr, vr, ok);
    // One step: the U keys of each group (rows kc, vc; okc says which are real) into the running
    // max, sum and accumulator. Steps go in key order, whatever the loop shape below.
    auto attend_step = [&](const kv4_t (&kc)[U][VPL], const kv4_t (&vc)[U][VPL],
                           const bool (&okc)[U]) {
        float x[U][GM];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int h = 0; h < GM; ++h) {
                float t = 0.0f;
#pragma unroll
                for (int v = 0; v < VPL; ++v) t += dot4(qr[h][v], widen_kv4(kc[u][v]));
                x[u][h] = t;
            }
            S::reduce(x[u], lane);
        }
        float corr[OWN], p[U][OWN];
#pragma unroll
        for (int j = 0; j < OWN; ++j) {
            float mx = mo[j];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (!okc[u]) x[u][j] = NEG_INF;
                mx = fmaxf(mx, x[u][j]);
            }
            const float ref = softmax_ref(mx);
            corr[j] = exp2f(mo[j] - ref);
            lo_sum[j] *= corr[j];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                p[u][j] = exp2f(x[u][j] - ref);
                lo_sum[j] += p[u][j];
            }
            mo[j] = mx;
        }
#pragma unroll
        for (int h = 0; h < GM; ++h) {
            const float c = S::from_owner(corr, lane, h);
#pragma unroll
            for (int v = 0; v < VPL; ++v) acc[h][v] = scale4(acc[h][v], c);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float ph = S::from_owner(p[u], lane, h);
#pragma unroll
                for (int v = 0; v < VPL; ++v) acc[h][v] = axpy4(ph, widen_kv4(vc[u][v]), acc[h][v]);
            }
        }
    };
    // The loop bound is block-uniform so that every lane takes part in the shuffles; a group past
    // k1 sees its keys as masked.
    if constexpr (DEPTH == 2) {
        // Ping-pong: kr holds step jb, kr2 step jb + STEP (both loaded before the wait); a
        // buffer refills with the step two ahead once computed.
        // (Shifting kr2 into kr instead would wait for the step after next before computing.)
        for (int jb = k0; jb < k1; jb += 2 * STEP) {
            attend_step(kr, vr, ok);
            probe_mark(jb == k0 ? 13 : 15);  // the first / third step computed
            fetch_keys<W, L, VPL, U>(a, ts, kh, jb + 2 * STEP, k1, grp, sub, d4, kr, vr, ok, tab);
            if (jb + STEP >= k1) break;
            attend_step(kr2, vr2, ok2);
            probe_mark(jb == k0 ? 14 : 15);  // the second step computed
            fetch_keys<W, L, VPL, U>(a, ts, kh, jb + 3 * STEP, k1, grp, sub, d4, kr2, vr2, ok2,
                                     tab);
        }
    } else {
        for (int jb = k0; jb < k1; jb += STEP) {
            kv4_t kc[U][VPL], vc[U][VPL];
            bool okc[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                okc[u] = ok[u];
#pragma unroll
                for (int v = 0; v < VPL; ++v) {
                    kc[u][v] = kr[u][v];
                    vc[u][v] = vr[u][v];
                }
            }
            // The next step's rows load while this one computes.
            fetch_keys<W, L, VPL, U>(a, ts, kh, jb + STEP, k1, grp, sub, d4, kr, vr, ok);
            attend_step(kc, vc, okc);
        }
    }

    probe_mark(9);
    // Every lane gets every head's (max, sum); then the groups of each warp merge (lanes L, 2L,
    // ... apart hold the same columns).
    float m[GM], l[GM];
#pragma unroll
    for (int h = 0; h < GM; ++h) {
        m[h] = S::from_owner(mo, lane, h);
        l[h] = S::from_owner(lo_sum, lane, h);
    }
#pragma unroll
    for (int o = L; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < GM; ++h) {
            const float mo_other = __shfl_xor_sync(0xffffffffu, m[h], o);
            const float l_other = __shfl_xor_sync(0xffffffffu, l[h], o);
            const float mx = fmaxf(m[h], mo_other);
            const float ref = softmax_ref(mx);
            const float ca = exp2f(m[h] - ref);
            const float cb = exp2f(mo_other - ref);
            l[h] = l[h] * ca + l_other * cb;
#pragma unroll
            for (int v = 0; v < VPL; ++v) {
                const float4 other = shfl_xor4(acc[h][v], o);
                acc[h][v] = make_float4(acc[h][v].x * ca + other.x * cb,
                                        acc[h][v].y * ca + other.y * cb,
                                        acc[h][v].z * ca + other.z * cb,
                                        acc[h][v].w * ca + other.w * cb);
            }
            m[h] = mx;
        }
    }

    probe_mark(10);
    // Then the warps, through shared memory: acc [warp][GM][d], then (max, sum) [warp][GM][2].
    if (lane < L) {
#pragma unroll
        for (int h = 0; h < GM; ++h) {
            if (h < gh) {
#pragma unroll
                for (int v = 0; v < VPL; ++v) {
                    const int c = sub + L * v;
                    if (c < d4) st4(s_acc + (warp * GM + h) * d + 4 * c, acc[h][v]);
                }
                if (lane == 0) {
                    // The pair in one 8-byte store (s_ml is 16-byte aligned).
                    *reinterpret_cast<float2*>(s_ml + (warp * GM + h) * 2) = make_float2(m[h], l[h]);
                }
            }
        }
    }
    __syncthreads();
}

// combine_warps for elements e .. e + N of head h: the warps' weights once, each element's sum
// exactly as combine_warps adds it.
template <int W, int GM, int N>
__device__ __forceinline__ void combine_warps_n(const float* s_acc, const float* s_ml, int d, int h,
                                                int e, float (&num)[N], float& mx, float& sum) {
    // Each warp's (max, sum) as one 8-byte load, four elements (N == 4, e a multiple of 4) as
    // one 16-byte load: the same values, a quarter of the shared-memory loads, which the send
    // phase of the cluster kernel waits on (s_ml and s_acc rows are 16-byte aligned: d is a
    // multiple of 4). Batch-1 decode +0.6% (H200, alternating; docs/perf/cuda-model.md v19).
    float2 ml[W];
#pragma unroll
    for (int w = 0; w < W; ++w) ml[w] = *reinterpret_cast<const float2*>(s_ml + (w * GM + h) * 2);
    mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, ml[w].x);
    const float ref = softmax_ref(mx);
    sum = 0.0f;
#pragma unroll
    for (int n = 0; n < N; ++n) num[n] = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
        const float c = exp2f(ml[w].x - ref);
        sum += c * ml[w].y;
        if constexpr (N == 4) {
            const float4 v = *reinterpret_cast<const float4*>(s_acc + (w * GM + h) * d + e);
            num[0] += c * v.x;
            num[1] += c * v.y;
            num[2] += c * v.z;
            num[3] += c * v.w;
        } else {
#pragma unroll
            for (int n = 0; n < N; ++n) num[n] += c * s_acc[(w * GM + h) * d + e + n];
        }
    }
}

// Element e of head h merged over the W warps' states attend_keys left: returns the unnormalised
// sum, sets the max and the softmax sum.
template <int W, int GM>
__device__ __forceinline__ float combine_warps(const float* s_acc, const float* s_ml, int d, int h,
                                               int e, float& mx, float& sum) {
    float num[1];
    combine_warps_n<W, GM, 1>(s_acc, s_ml, d, h, e, num, mx, sum);
    return num[0];
}

// L lanes per key, VPL float4 of the head per lane (L * VPL * 4 >= head_dim), up to GM query
// heads per block.
template <int L, int VPL, int GM, int U = SPLIT_KEYS / VPL>
__device__ __forceinline__ void attn_split(const AttnArgs& a) {
    extern __shared__ float4 split_smem4[];
    const int i = a.token0 + blockIdx.x;
    const int s = blockIdx.y;
    const int kh = blockIdx.z / a.head_chunks;
    const int hc = blockIdx.z - kh * a.head_chunks;
    if (tile_owned(a, i)) return;
    const int d = a.head_dim;
    const int h0 = kh * a.group + hc * GM;
    const int gh = min(GM, a.group - hc * GM);
    const int pos = a.positions[i];
    const int ts = a.table_start[i];
    const int lo = window_lo(a, pos);
    const int len = pos + 1 - lo;
    const bool direct = a.nsplit == 1;
    const int active = len <= 0 ? 0 : min(a.nsplit, (len + a.chunk - 1) / a.chunk);
    if (s >= active) {
        // Only a token with no visible key at all gets here with s == 0: its output is zero
        // (written by split 0 alone; no partials, so no merge either).
        pdl_entry();
        if (s == 0) {
            float* o = a.out + ((u64)i * a.num_heads + h0) * d;
            for (int e = threadIdx.x; e < gh * d; e += SPLIT_THREADS) o[e] = 0.0f;
        }
        return;
    }
    const int k0 = lo + s * a.chunk;
    // The last split runs to the token itself, whatever the host's bound on the context said.
    const int k1 = (s == a.nsplit - 1) ? pos + 1 : min(k0 + a.chunk, pos + 1);

    float* s_acc = reinterpret_cast<float*>(split_smem4);
    float* s_ml = s_acc + SPLIT_WARPS * GM * d;
    // The block's first step of keys loads before the programmatic wait when the kernel before
    // (the attention prologue) did not write them: keys older than the batch's own tokens. The
    // first token of its sequence in the batch (a decode token, always) knows that bound, its
    // own position, without a walk back over the batch; the others (inside a prefill chunk's
    // untiled tail) load everything after the wait.
    const bool first_of_seq = i == 0 || a.table_start[i - 1] != ts;
    attend_keys<SPLIT_WARPS, L, VPL, GM, true, U>(a, i, kh, h0, gh, ts, k0, k1, s_acc, s_ml,
                                                  first_of_seq ? pos : lo);
    for (int idx = threadIdx.x; idx < gh * d; idx += SPLIT_THREADS) {
        const int h = idx / d;
        const int e = idx - h * d;
        float mx, sum;
        const float num = combine_warps<SPLIT_WARPS, GM>(s_acc, s_ml, d, h, e, mx, sum);
        const u64 row = (u64)i * a.num_heads + h0 + h;
        if (direct) {
            a.out[row * d + e] = sum > 0.0f ? num / sum : 0.0f;
        } else {
            const u64 ps = row * a.nsplit + s;
            a.part_acc[ps * d + e] = num;
            if (e == 0) {
                a.part_ml[ps * 2] = mx;
                a.part_ml[ps * 2 + 1] = sum;
            }
        }
    }
    if (direct) return;
    // The last split block of this (token, kv head, head chunk) to arrive merges. The fence
    // makes this block's partials visible device-wide before it is counted.
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* count = a.arrivals + ((u64)i * gridDim.z + blockIdx.z);
        const u32 before = atomicAdd(count, 1u);
        s_last = before == (u32)(active - 1);
        if (s_last) *count = 0u;  // ready for the next launch
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    merge_splits(a, i, h0, gh, active, reinterpret_cast<float*>(split_smem4));
}

// attn_split waits for the kernel before (pdl_entry) itself, after its first loads.
#define ATTN_SPLIT(NAME, L, VPL, GM)                                                             \
    extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) NAME(const AttnArgs a) {        \
        attn_split<L, VPL, GM>(a);                                                               \
    }
// head_dim 128 takes 2 keys per group per step instead of 4, so that four blocks fit an SM (128
// registers, no spills) where the 4-key kernel's 168 left three: more warps to hide the shuffle
// and exp2 chains that bound it, fewer bytes in flight per warp. ops_bench attention (H200):
// 128 sequences of 512 / 4096 keys 179.5 / 1160.4 -> 130.7 / 833.2 µs, 8 of 4096 keys
// 113.4 -> 65.9 µs; decode of 128 sequences 13.0k -> 14.2k tok/s (16 layers of Qwen3-30B-A3B).
#define ATTN_SPLIT_2KEYS(NAME, L, VPL, GM)                                                       \
    extern "C" __global__ void __launch_bounds__(SPLIT_THREADS, 4) NAME(const AttnArgs a) {     \
        attn_split<L, VPL, GM, 2>(a);                                                            \
    }

#ifndef ATTN_CLUSTER_ONLY
ATTN_SPLIT(attn_split_d16_g1, 4, 1, 1)
ATTN_SPLIT(attn_split_d16_g2, 4, 1, 2)
ATTN_SPLIT(attn_split_d16_g4, 4, 1, 4)
ATTN_SPLIT(attn_split_d16_g8, 4, 1, 8)
ATTN_SPLIT(attn_split_d32_g1, 8, 1, 1)
ATTN_SPLIT(attn_split_d32_g2, 8, 1, 2)
ATTN_SPLIT(attn_split_d32_g4, 8, 1, 4)
ATTN_SPLIT(attn_split_d32_g8, 8, 1, 8)
ATTN_SPLIT(attn_split_d64_g1, 16, 1, 1)
ATTN_SPLIT(attn_split_d64_g2, 16, 1, 2)
ATTN_SPLIT(attn_split_d64_g4, 16, 1, 4)
ATTN_SPLIT(attn_split_d64_g8, 16, 1, 8)
ATTN_SPLIT_2KEYS(attn_split_d128_g1, 32, 1, 1)
ATTN_SPLIT_2KEYS(attn_split_d128_g2, 32, 1, 2)
ATTN_SPLIT_2KEYS(attn_split_d128_g4, 32, 1, 4)
ATTN_SPLIT_2KEYS(attn_split_d128_g8, 32, 1, 8)
ATTN_SPLIT(attn_split_d256_g1, 32, 2, 1)
ATTN_SPLIT(attn_split_d256_g2, 32, 2, 2)
ATTN_SPLIT(attn_split_d256_g4, 32, 2, 4)
ATTN_SPLIT(attn_split_d256_g8, 32, 2, 8)
// head_dim 512 (Gemma 4's full layers): four float4 per lane, one key per group per step, at most
// 2 query heads per block (q and the accumulator of 8 heads would take 256 registers); larger
// groups run in head chunks of 2.
ATTN_SPLIT(attn_split_d512_g1, 32, 4, 1)
ATTN_SPLIT(attn_split_d512_g2, 32, 4, 2)
#endif  // ATTN_CLUSTER_ONLY

// ---- split-K decode in thread-block clusters (Hopper, sm_90+) ----
//
// attn_cluster_d<D>_g<G>: the same per-block work as attn_split (attend_keys), 8 warps per block,
// but the splits of one (token, kv head, head chunk) form clusters of CL_SIZE blocks that merge
// through distributed shared memory: no partials in global memory, no fence, no atomic for a
// context one cluster covers. Grid (n, CL_SIZE * clusters, kv_heads * head_chunks), cluster
// (1, CL_SIZE, 1), block CL_THREADS. A token's visible keys are shared evenly by the blocks of
// its first `act` clusters, act = min(clusters, ceil(len / (CL_SIZE * chunk))) (a.chunk: the
// fewest keys a block should take), so a token beyond the host's context bound is still covered
// exactly. Block r of the cluster (its %cluster_ctarank) owns slice r of the (head, element)
// float4 items of the output. Each block merges its warps' states and sends every slice owner
// that slice of its state (unnormalised acc) and its (max, sum) per head, by st.async into the
// owner's shared-memory inbox, which counts the bytes on an mbarrier; the owner waits for all of
// them and merges its slice over the CL_SIZE blocks (weights per head from their (max, sum), a
// float4 per lane, the ranks summed by shuffles in a fixed tree order). No block reads another's
// shared memory, so no cluster barrier orders the merge (a release barrier is a GPU-wide MEMBAR);
// one relaxed barrier at the start publishes the mbarriers. With one active cluster the merge is
// the output. With several, each block writes its slice of the cluster's partial (acc, max, sum;
// part_acc row * clusters + cluster) and the last of the token's clusters to count slice r (an
// atomic in `arrivals`, per (token, kv head x head chunk, rank), reset by that block) merges
// slice r of their partials. Dynamic shared memory: CL_WARPS * G * (head_dim + 2) floats, then
// the inbox (ops/attention.rs cluster_smem).
// attn_cluster_d<D>_g4_pro (D <= 128): the same kernel with the attention prologue folded in
// (see "the attention prologue folded into decode attention" above); a second parameter,
// PrologueArgs, and static shared memory for the fold.

// Blocks per cluster: 8, the portable maximum, or 16 (non-portable on Hopper) in the
// `attention_cl16` builds (compile.rs); the host plans each call with one or the other
// (ops/attention.rs ClusterPlan).
#ifndef CL_SIZE
#define CL_SIZE 8
#endif
#define CL_WARPS 8
#define CL_THREADS (32 * CL_WARPS)

// Slice `rank` of the `act` cluster partials of token i's heads h0 .. h0 + gh: items beg .. end
// (float4 of the [gh][d] output). Run by the last cluster to count this slice; `w` holds
// [heads of the slice][act] floats, `sums` one per head of the slice.
__device__ __forceinline__ void merge_cluster_partials(const AttnArgs& a, int i, int h0, int beg,
                                                       int end, int act, int nclust, float* w,
                                                       float* sums) {
    const int d = a.head_dim;
    const int d4 = d >> 2;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int ha = beg / d4;
    const int hb = (end - 1) / d4;
    for (int hh = warp; hh <= hb - ha; hh += CL_WARPS) {
        const float* ml = a.part_ml + ((u64)i * a.num_heads + h0 + ha + hh) * nclust * 2;
        const float sum = partial_weights(ml, act, w + hh * act);
        if (lane == 0) sums[hh] = sum;
    }
    __syncthreads();
    for (int item = beg + threadIdx.x; item < end; item += CL_THREADS) {
        const int h = item / d4;
        const int c = item - h * d4;
        const u64 row = (u64)i * a.num_heads + h0 + h;
        const float* acc = a.part_acc + row * nclust * d + 4 * c;
        st4(a.out + row * d + 4 * c, merge_partials(acc, w + (h - ha) * act, act, d, sums[h - ha]));
    }
}

// PRO: the folded prologue (attend_keys), from `pro` (unused otherwise).
template <int L, int VPL, int GM, bool PRO = false>
__device__ __forceinline__ void attn_cluster(const AttnArgs& a, const PrologueArgs* pro = nullptr) {
    extern __shared__ float4 cl_smem4[];
    // The folded prologue's shared memory (PRO builds only).
    FoldSmem<GM, 4 * L * VPL>* fold = nullptr;
    if constexpr (PRO) {
        __shared__ __align__(16) FoldSmem<GM, 4 * L * VPL> s_fold;
        fold = &s_fold;
    }
    __shared__ int s_last;
    // Marks (MOERUN_PROBE builds, common.cuh): 1 the programmatic wait passed, 2 the keys done,
    // 3 the cluster barrier passed, 4 the slices sent, 5 the inbox full, 6 the slice merged;
    // PRO builds: 7 the folded prologue done; attend_keys: 8 q loaded, 9 the keys' loop done,
    // 10 the warp's groups merged; 11 thread 0's first slice item combined over the warps, 12
    // every slice item sent (then 4: the (max, sum) pairs sent too); 13 / 14 / 15 the loop's
    // first / second / last later step computed (attend_keys, two steps ahead); PRO builds: 19
    // the fold's loads issued, 16 its constants in shared memory, 18 the own key's slot known
    // (then the wait, 1), 17 the first steps' key loads issued.
    probe_begin();
    // fold_loads and fold_constants take one element a thread.
    static_assert(!PRO || (CL_THREADS == TAB_N && 4 * L * VPL <= CL_THREADS),
                  "the fold's constants and table entries: one a thread");
    FoldLoads early{};  // the fold's constants, loaded first (fold_loads)
    if constexpr (PRO) early = fold_loads(a, *pro);
    probe_mark(19);  // (the fold's loads issued)
    const int i = a.token0 + blockIdx.x;
    const int kh = blockIdx.z / a.head_chunks;
    const int hc = blockIdx.z - kh * a.head_chunks;
    // Token-uniform, so a whole cluster leaves together (no block waits on a departed one).
    if (tile_owned(a, i)) return;
    const int d = a.head_dim;
    const int d4 = d >> 2;
    const int h0 = kh * a.group + hc * GM;
    const int gh = min(GM, a.group - hc * GM);
    const int pos = a.positions[i];
    const int ts = a.table_start[i];
    const int lo = window_lo(a, pos);
    const int len = pos + 1 - lo;
    const int nclust = a.nsplit / CL_SIZE;
    const int cl = blockIdx.y / CL_SIZE;
    // This block's share of the keys and of the merge: its rank in the cluster, the block the
    // merge's st.async address (%cluster_ctarank: the linear index in a cluster of (1, CL_SIZE, 1)
    // is blockIdx.y - cl * CL_SIZE). Read from %cluster_ctarank, ptxas spilled the d32 build.
    const int rank = blockIdx.y - cl * CL_SIZE;
    const int per_cluster = CL_SIZE * a.chunk;
    const int act = len <= 0 ? 0 : min(nclust, (len + per_cluster - 1) / per_cluster);
    // This block's slice of the [gh][d] output, in float4 items.
    const int items = gh * d4;
    const int per = (items + CL_SIZE - 1) / CL_SIZE;
    const int beg = min(items, rank * per);
    const int end = min(items, beg + per);
    if (act == 0) {
        // No visible key: zeros, from the first cluster (no merge, no barrier).
        pdl_entry();
        if (cl == 0) {
            float* o = a.out + ((u64)i * a.num_heads + h0) * d;
            for (int it = beg + threadIdx.x; it < end; it += CL_THREADS) st4(o + 4 * it, zero4());
        }
        return;
    }
    if (cl >= act) return;  // cluster-uniform
    const int kb = (len + act * CL_SIZE - 1) / (act * CL_SIZE);
    const int k0 = lo + (cl * CL_SIZE + rank) * kb;
    const int k1 = min(k0 + kb, pos + 1);

    float* s_acc = reinterpret_cast<float*>(cl_smem4);  // [CL_WARPS][GM][d]
    float* s_ml = s_acc + CL_WARPS * GM * d;            // [CL_WARPS][GM][2]
    // The inbox: what the cluster's blocks send this block for its slice, [CL_SIZE][per] float4
    // of their states' slice items, then [CL_SIZE][GM] (max, sum) pairs.
    float4* in_acc = reinterpret_cast<float4*>(s_ml + CL_WARPS * GM * 2);
    float* in_ml = reinterpret_cast<float*>(in_acc + CL_SIZE * per);
    __shared__ __align__(8) u64 inbox_bar;
    // Every block with a slice expects its items and the heads' (max, sum) from every block of
    // the cluster; the barrier after arming (waited for just before the sends) tells the others
    // its mbarrier is ready. Before the keys: the wait is long passed when the sends start.
    if (threadIdx.x == 0 && beg < end) {
        mbar_init(smem_u32(&inbox_bar), 1);
        mbar_expect_tx(smem_u32(&inbox_bar),
                       (u32)(CL_SIZE * ((end - beg) * sizeof(float4) + gh * 2 * sizeof(float))));
    }
    fence_mbarrier_init();
    cluster_arrive_relaxed();
    // The first position of this token's sequence in the batch: keys from there on are written
    // by the kernel before (the attention prologue), older ones by earlier passes.
    int first = i;
    while (first > 0 && a.table_start[first - 1] == ts) --first;
    // Two steps of rows where the registers allow (4 query heads at most: the 8-head builds
    // already hold 170-250); batch 1 takes 4-head chunks (decode_head_cap).
    constexpr int DEPTH = GM <= 4 ? 2 : 1;
    attend_keys<CL_WARPS, L, VPL, GM, true, SPLIT_KEYS / VPL, DEPTH, PRO>(
        a, i, kh, h0, gh, ts, k0, k1, s_acc, s_ml, a.positions[first], pro, fold, &early);
    probe_mark(2);
    cluster_wait();
    probe_mark(3);
    // This block's state (its warps merged), sent slice by slice to the blocks that own the
    // slices: item `it` of the [gh][d] output (a float4) goes to rank it / per, the heads'
    // (max, sum) to every rank with a slice.
    const u32 me = (u32)rank;
    for (int it = threadIdx.x; it < items; it += CL_THREADS) {
        const int h = it / d4;
        const int c = it - h * d4;
        const u32 dst = (u32)(it / per);
        float mx, sum, n4[4];
        combine_warps_n<CL_WARPS, GM, 4>(s_acc, s_ml, d, h, 4 * c, n4, mx, sum);
        const float4 v = make_float4(n4[0], n4[1], n4[2], n4[3]);
        if (it == 0) probe_mark(11);
        const int at = (int)me * per + (it - (int)dst * per);
        st_async4(cluster_addr(in_acc + at, dst), v,
                  cluster_addr(&inbox_bar, dst));
    }
    probe_mark(12);
    for (int t = threadIdx.x; t < gh * CL_SIZE; t += CL_THREADS) {
        const int h = t / CL_SIZE;
        const u32 dst = (u32)(t - h * CL_SIZE);
        if ((int)dst * per < items) {  // that rank has a slice
            float mx, sum;
            combine_warps<CL_WARPS, GM>(s_acc, s_ml, d, h, 0, mx, sum);
            st_async2(cluster_addr(in_ml + (me * GM + h) * 2, dst), mx, sum,
                      cluster_addr(&inbox_bar, dst));
        }
    }
    probe_mark(4);
    if (beg >= end) {  // block-uniform: nothing to merge, nothing sent to this block
        probe_end("attn_cluster");
        return;
    }
    __syncthreads();  // s_acc is read above and reused below
    mbar_wait_cluster(smem_u32(&inbox_bar), 0);
    probe_mark(5);

    // Weights of the cluster's blocks per head: w [GM][CL_SIZE], then max and sum [GM] each.
    float* cw = s_acc;
    float* cmax = cw + GM * CL_SIZE;
    float* csum = cmax + GM;
    const int t = threadIdx.x;
    const int src = t & (CL_SIZE - 1);  // the rank this thread reads
    if ((t >> 5) < (GM * CL_SIZE + 31) / 32) {
        const int h = t / CL_SIZE;
        float m = NEG_INF, l = 0.0f;
        if (h < gh) {
            // The pair in one 8-byte load (in_ml follows the float4 items).
            const float2 ml = *reinterpret_cast<const float2*>(in_ml + (src * GM + h) * 2);
            m = ml.x;
            l = ml.y;
        }
        float mx = m;
#pragma unroll
        for (int o = CL_SIZE / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float wr = exp2f(m - softmax_ref(mx));
        float sum = wr * l;
#pragma unroll
        for (int o = CL_SIZE / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (h < GM) {
            cw[h * CL_SIZE + src] = wr;
            if (src == 0) {
                cmax[h] = mx;
                csum[h] = sum;
            }
        }
    }
    __syncthreads();

    // Slice items merged over the ranks: CL_SIZE adjacent lanes per item, one rank each.
    const bool direct = act == 1;
    for (int base = beg; base < beg + per; base += CL_THREADS / CL_SIZE) {
        const int item = base + t / CL_SIZE;
        const bool ok = item < end;
        int h = 0, c = 0;
        float4 v = zero4();
        if (ok) {
            h = item / d4;
            c = item - h * d4;
            v = scale4(in_acc[src * per + (item - beg)], cw[h * CL_SIZE + src]);
        }
#pragma unroll
        for (int o = CL_SIZE / 2; o > 0; o >>= 1) {
            const float4 other = shfl_xor4(v, o);
            v = make_float4(v.x + other.x, v.y + other.y, v.z + other.z, v.w + other.w);
        }
        if (ok && src == 0) {
            const u64 row = (u64)i * a.num_heads + h0 + h;
            if (direct) {
                const float sum = csum[h];
                st4(a.out + row * d + 4 * c,
                    sum > 0.0f ? make_float4(v.x / sum, v.y / sum, v.z / sum, v.w / sum) : zero4());
            } else {
                st4(a.part_acc + (row * nclust + cl) * d + 4 * c, v);
            }
        }
    }
    probe_mark(6);
    if (!direct) {
        // The (max, sum) of every head this slice touches, then count the slice in.
        if (t < gh && t * d4 < end && (t + 1) * d4 > beg) {
            const u64 row = (u64)i * a.num_heads + h0 + t;
            a.part_ml[(row * nclust + cl) * 2] = cmax[t];
            a.part_ml[(row * nclust + cl) * 2 + 1] = csum[t];
        }
        __threadfence();
        __syncthreads();
        if (t == 0) {
            u32* count = a.arrivals + ((u64)i * gridDim.z + blockIdx.z) * CL_SIZE + rank;
            const u32 before = atomicAdd(count, 1u);
            s_last = before == (u32)(act - 1);
            if (s_last) *count = 0u;  // ready for the next launch
        }
        __syncthreads();
        if (s_last) {
            __threadfence();
            // Past the cluster weights (GM * (CL_SIZE + 2) floats): [GM][act], then [GM].
            float* w = csum + GM;
            merge_cluster_partials(a, i, h0, beg, end, act, nclust, w, w + GM * act);
        }
    }
    probe_end("attn_cluster");
}

// Sm_90 only: elsewhere the entry points exist (the host loads every name) but stay empty and are
// never launched (ops/attention.rs checks the compute capability).
#if __CUDA_ARCH__ >= 900
#define ATTN_CLUSTER(NAME, L, VPL, GM)                                                           \
    extern "C" __global__ void __launch_bounds__(CL_THREADS) __cluster_dims__(1, CL_SIZE, 1)    \
        NAME(const AttnArgs a) {                                                                 \
        attn_cluster<L, VPL, GM>(a);                                                             \
    }
// The 4-head builds of head_dim <= 128 (batch 1's blocks) fit 128 registers with two steps of
// rows in flight: two blocks per SM, so the o_proj GEMV's blocks that launch behind them still
// find room to load their weights during attention.
#define ATTN_CLUSTER_2(NAME, L, VPL, GM)                                                         \
    extern "C" __global__ void __launch_bounds__(CL_THREADS, 2) __cluster_dims__(1, CL_SIZE, 1) \
        NAME(const AttnArgs a) {                                                                 \
        attn_cluster<L, VPL, GM>(a);                                                             \
    }
// The folded-prologue builds (the 4-head ones of ATTN_CLUSTER_2: batch 1's).
#define ATTN_CLUSTER_PRO(NAME, L, VPL, GM)                                                       \
    extern "C" __global__ void __launch_bounds__(CL_THREADS, 2) __cluster_dims__(1, CL_SIZE, 1) \
        NAME(const AttnArgs a, const PrologueArgs p) {                                           \
        attn_cluster<L, VPL, GM, true>(a, &p);                                                   \
    }
#else
#define ATTN_CLUSTER(NAME, L, VPL, GM)                                                           \
    extern "C" __global__ void __launch_bounds__(CL_THREADS) NAME(const AttnArgs a) {}
#define ATTN_CLUSTER_2(NAME, L, VPL, GM) ATTN_CLUSTER(NAME, L, VPL, GM)
#define ATTN_CLUSTER_PRO(NAME, L, VPL, GM)                                                       \
    extern "C" __global__ void __launch_bounds__(CL_THREADS)                                     \
        NAME(const AttnArgs a, const PrologueArgs p) {}
#endif

ATTN_CLUSTER(attn_cluster_d16_g1, 4, 1, 1)
ATTN_CLUSTER(attn_cluster_d16_g2, 4, 1, 2)
ATTN_CLUSTER_2(attn_cluster_d16_g4, 4, 1, 4)
ATTN_CLUSTER(attn_cluster_d16_g8, 4, 1, 8)
ATTN_CLUSTER(attn_cluster_d32_g1, 8, 1, 1)
ATTN_CLUSTER(attn_cluster_d32_g2, 8, 1, 2)
ATTN_CLUSTER_2(attn_cluster_d32_g4, 8, 1, 4)
ATTN_CLUSTER(attn_cluster_d32_g8, 8, 1, 8)
ATTN_CLUSTER(attn_cluster_d64_g1, 16, 1, 1)
ATTN_CLUSTER(attn_cluster_d64_g2, 16, 1, 2)
ATTN_CLUSTER_2(attn_cluster_d64_g4, 16, 1, 4)
ATTN_CLUSTER(attn_cluster_d64_g8, 16, 1, 8)
ATTN_CLUSTER(attn_cluster_d128_g1, 32, 1, 1)
ATTN_CLUSTER(attn_cluster_d128_g2, 32, 1, 2)
ATTN_CLUSTER_2(attn_cluster_d128_g4, 32, 1, 4)
ATTN_CLUSTER(attn_cluster_d128_g8, 32, 1, 8)
ATTN_CLUSTER(attn_cluster_d256_g1, 32, 2, 1)
ATTN_CLUSTER(attn_cluster_d256_g2, 32, 2, 2)
ATTN_CLUSTER(attn_cluster_d256_g4, 32, 2, 4)
ATTN_CLUSTER(attn_cluster_d256_g8, 32, 2, 8)
ATTN_CLUSTER(attn_cluster_d512_g1, 32, 4, 1)
ATTN_CLUSTER(attn_cluster_d512_g2, 32, 4, 2)
ATTN_CLUSTER_PRO(attn_cluster_d16_g4_pro, 4, 1, 4)
ATTN_CLUSTER_PRO(attn_cluster_d32_g4_pro, 8, 1, 4)
ATTN_CLUSTER_PRO(attn_cluster_d64_g4_pro, 16, 1, 4)
ATTN_CLUSTER_PRO(attn_cluster_d128_g4_pro, 32, 1, 4)

// ---- tiled prefill, exact f32 on CUDA cores ----

#define TF_THREADS 256

// C: float4 columns of O per thread and row (head_dim <= 64 * C).
template <int C>
__device__ __forceinline__ void attn_tile_f32(const AttnArgs& a) {
    extern __shared__ float4 tile_smem4[];
    __shared__ int s_kmin, s_kend;
    // Later tiles see more keys: launch them first so the grid does not end on a long one.
    const int t0 = (gridDim.x - 1 - blockIdx.x) * TILE_M;
    const int h = blockIdx.y;
    if (!tile_owned(a, t0)) return;
    const int d = a.head_dim;
    const int d4 = d >> 2;
    const int ds = d + 4;  // row stride: keeps float4 rows aligned, shifts banks by one float4
    const int H = a.num_heads;
    const int kh = h / a.group;
    const int ts = a.table_start[t0];
    const int tid = threadIdx.x;
    float* Qs = reinterpret_cast<float*>(tile_smem4);
    float* Ks = Qs + TILE_M * ds;
    float* Vs = Ks + TILE_N * ds;
    float* Ps = Vs + TILE_N * ds;  // [TILE_M][TILE_N + 1]

    for (int idx = tid; idx < TILE_M * d4; idx += TF_THREADS) {
        const int r = idx / d4;
        const int c = idx - r * d4;
        st4(Qs + r * ds + 4 * c,
            scale4(ld4(a.q + ((u64)(t0 + r) * H + h) * d + 4 * c), a.scale_log2));
    }
    tile_key_range(a, t0, &s_kmin, &s_kend);
    const int kmin = s_kmin, kend = s_kend;

    const int tr = tid >> 4;  // rows 4 tr .. 4 tr + 3
    const int tc = tid & 15;  // keys tc + 16 j; O columns (float4) tc + 16 jj
    int rp[4], rlo[4];
    float m[4], l[4];
    float4 o[4][C];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        rp[r] = a.positions[t0 + 4 * tr + r];
        rlo[r] = window_lo(a, rp[r]);
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int jj = 0; jj < C; ++jj) o[r][jj] = zero4();
    }

    for (int kt = kmin; kt < kend; kt += TILE_N) {
        for (int idx = tid; idx < TILE_N * d4; idx += TF_THREADS) {
            const int r = idx / d4;
            const int c = idx - r * d4;
            const int kp = kt + r;
            const long long off = kp < kend ? kv_offset(a, ts, kp, kh) : -1;
            const bool ok = off >= 0;
            stage_kv4_f32(Ks + r * ds + 4 * c, ok ? a.pool_k + off + 4 * c : a.pool_k, ok);
            stage_kv4_f32(Vs + r * ds + 4 * c, ok ? a.pool_v + off + 4 * c : a.pool_v, ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float sc[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j) sc[r][j] = 0.0f;
        for (int c = 0; c < d4; ++c) {
            float4 qv[4], kv[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) qv[r] = ld4(Qs + (4 * tr + r) * ds + 4 * c);
#pragma unroll
            for (int j = 0; j < 4; ++j) kv[j] = ld4(Ks + (tc + 16 * j) * ds + 4 * c);
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int j = 0; j < 4; ++j) sc[r][j] += dot4(qv[r], kv[j]);
        }

#pragma unroll
        for (int r = 0; r < 4; ++r) {
            float mx = m[r];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int kp = kt + tc + 16 * j;
                if (kp < rlo[r] || kp > rp[r]) sc[r][j] = NEG_INF;
                mx = fmaxf(mx, sc[r][j]);
            }
            // The 16 threads of a row are lanes 0-15 or 16-31 of one warp.
#pragma unroll
            for (int x = 8; x > 0; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
            const float ref = softmax_ref(mx);
            const float corr = exp2f(m[r] - ref);
            l[r] *= corr;
#pragma unroll
            for (int jj = 0; jj < C; ++jj) o[r][jj] = scale4(o[r][jj], corr);
            m[r] = mx;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float p = exp2f(sc[r][j] - ref);
                l[r] += p;
                Ps[(4 * tr + r) * (TILE_N + 1) + tc + 16 * j] = p;
            }
        }
        __syncthreads();

        for (int c = 0; c < TILE_N; ++c) {
            float pv[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) pv[r] = Ps[(4 * tr + r) * (TILE_N + 1) + c];
#pragma unroll
            for (int jj = 0; jj < C; ++jj) {
                const int g = tc + 16 * jj;
                if (g < d4) {
                    const float4 vv = ld4(Vs + c * ds + 4 * g);
#pragma unroll
                    for (int r = 0; r < 4; ++r) o[r][jj] = axpy4(pv[r], vv, o[r][jj]);
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 4; ++r) {
        float sum = l[r];
#pragma unroll
        for (int x = 8; x > 0; x >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, x);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        float* orow = a.out + ((u64)(t0 + 4 * tr + r) * H + h) * d;
#pragma unroll
        for (int jj = 0; jj < C; ++jj) {
            const int g = tc + 16 * jj;
            if (g < d4) st4(orow + 4 * g, scale4(o[r][jj], inv));
        }
    }
}

#define ATTN_TILE_F32(NAME, C)                                                                   \
    extern "C" __global__ void __launch_bounds__(TF_THREADS) NAME(const AttnArgs a) {           \
        attn_tile_f32<C>(a);                                                                     \
    }

#ifndef ATTN_CLUSTER_ONLY
ATTN_TILE_F32(attn_tile_f32_c1, 1)
ATTN_TILE_F32(attn_tile_f32_c2, 2)
ATTN_TILE_F32(attn_tile_f32_c4, 4)
#endif  // ATTN_CLUSTER_ONLY

// ---- tiled prefill on tensor cores (bf16 operands, f32 accumulation) ----
//
// mma.sync.m16n8k16 fragments (g = lane / 4, t = lane % 4): A (16x16, row-major) a0 = (g, 2t..2t+1),
// a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..); B (16x8) b0 = (k 2t..2t+1, n g),
// b1 = (k 2t + 8.., n g); C (16x8) c0, c1 = (g, 2t..2t+1), c2, c3 = (g + 8, 2t..). S = Q K^T takes
// A from q (registers, rounded once) and B from the bf16 K rows by ldmatrix (an 8x8 block of 8 keys
// x 8 dims gives each lane (key g, dims 2t, 2t + 1): b0 or b1 of one n-tile); P V takes A from S's
// accumulators (the C layout of two 8-key tiles is the A layout of one 16-key step) and B from the
// bf16 V rows by ldmatrix.trans (an 8x8 block of 8 keys x 8 dims, transposed: (keys 2t, 2t + 1,
// dim g)). Both bf16 tiles are row-major with a row stride of D + 8 (272 bytes for D = 128): the 8
// rows one 8x8 load touches start 4 banks apart, so it is conflict-free.
//
// Where a key tile comes from: the batch's own K/V, rounded to bf16 by whoever wrote them into the
// pool (the q/k/v prologue or kv_write), sit in the *batch copy* (AttnArgs.copy_k/copy_v, rows
// [n][kv_heads][D] bf16, null when the caller has none). Within one sequence's run of consecutive
// tokens at consecutive positions, the key at position p is batch row p - (positions[t0] - t0);
// `batch_copy_start` checks, from the tile's first row back to its first key, which of those rows
// really are this sequence at that position, so any layout stays exact. A key tile wholly at or
// after that start is cp.async-copied straight into the bf16 stage; the key tiles before it (a
// cached prefix: chunked prefill; every tile without a copy) come from the pool. Both give
// the same bf16 numbers (an f32 pool holds the same f32 values, a bf16 pool the same rounding of
// them), so the output does not depend on which source a tile took.
//
// Pipeline, in two phases. Pool tiles first: tile j + 1's f32 K and V rows cp.async into stages 0
// and 1 while tile j computes from stage 2, where it was rounded (two barriers per tile). Then
// the copy tiles, three bf16 stages, one barrier per key tile i: [wait for tile i's copies;
// barrier; start tile i + 2 into the stage tile i - 1 left; S, softmax and P V of tile i]. Blocks
// are 4 warps (64 query rows of one head) so two run on an SM (~104 KiB of shared memory each for
// D = 128): one block's softmax and loads overlap the other's tensor-core work.
//
// Builds (template <D, HW, WG, ST>, ops/attention.rs TC_VARIANTS). Each K or V fragment a warp
// loads by ldmatrix serves 16 rows with one head per warp (HW = 1): ~64 ldmatrix.x4 per 128 mma
// per key tile, and each K/V tile in shared memory serves one head's 64 rows while the group's
// heads read the same K/V. With HW = 2 a warp holds two m16 tiles, the same 16 tokens of two
// query heads (so one mask, one key range): every K and V fragment feeds 4 mma instead of 2 and a
// K/V tile serves 2 (or, WG = 2 warp groups, 4) heads. Two heads' accumulators (O 128 + S 64
// registers for D = 128) leave no room for q in registers: the block stages its q rows, scaled
// and rounded to bf16 as the one-head build rounds them, in shared memory ([HB][64][D + 8], read
// by ldmatrix per 16-dim step), and keeps the rows' visible ranges and its load state in shared
// memory too (255 registers, no spills). Per row the arithmetic is the same (same fragments, same
// mma order over dims and over keys, same softmax steps), so every build gives the same bits
// (tests/attention.rs tensor_core_prefill_builds_are_bitwise_equal). h2 (4 warps, 2 heads) keeps
// two blocks per SM by taking 2 stages (q: 34 KiB + 2 x 34 KiB): a copy tile then loads one tile
// ahead, and a pool tile lands as two halves of 32 keys (f32 K and V rows) in stage 0, each
// rounded into stage 1 (one of the two loads waited for in the open). h4 (8 warps, 4 heads)
// keeps 3 stages and the pool pipeline above (q: 68 KiB; 170 KiB per block, one per SM).
//
// All builds take the softmax weights and rescale factors by ex2.approx.ftz (ex2_ftz: one
// instruction; exp2f was four): results under 2^-126 are 0 instead of subnormal, the one
// numerical difference from the kernel before the builds.

#define TC_WARPS 4
#define TC_THREADS (32 * TC_WARPS)
#define TC_M (16 * TC_WARPS)
#define TC_STAGES 3

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    // Not volatile: a pure register operation the compiler may schedule freely.
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 blocks; lanes 8m .. 8m + 7 give the row addresses of block m, which lands in r[m].
__device__ __forceinline__ void ldmatrix4(u32 (&r)[4], const u16* p) {
    const u32 s = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void ldmatrix4_trans(u32 (&r)[4], const u16* p) {
    const u32 s = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// HW: query heads per warp (1: 16 rows, q fragments in registers; 2: 32 rows, two m16 tiles of
// the same 16 tokens for two heads, sharing every K and V fragment, q fragments by ldmatrix from
// a bf16 q tile in shared memory, which 255 registers need). WG: warp groups of 4 warps (64
// tokens each); the block's HB = HW x WG query heads all read one kv head. ST: pipeline stages of
// bf16 K/V tiles (3: pool tiles land as f32 in two stages and are rounded into the third; 2: a
// pool tile lands as two halves of 32 keys in one stage, each rounded into the other).
template <int D, int HW, int WG, int ST>
__device__ __forceinline__ void attn_tile_bf16(const AttnArgs& a) {
    constexpr int NT = TC_THREADS * WG;     // threads of the block
    constexpr int HB = HW * WG;             // query heads of the block
    constexpr bool QS = HW > 1;             // q fragments from shared memory
    constexpr int BS = D + 8;               // bf16 row stride of K, V (and q)
    constexpr int STAGE = 2 * TILE_N * BS;  // one stage: K rows, then V rows (u16)
    constexpr int FS = D + 4;               // f32 row stride of a pool tile's K or V in a stage
    constexpr int CH8 = D / 8;              // 16-byte chunks of a bf16 row
    constexpr int CH4 = D / 4;              // 16-byte chunks of an f32 row
    constexpr int PS = ST - 1;              // the stage a pool tile is rounded into
    static_assert(ST == 2 || ST == 3, "two or three stages");
    static_assert(ST == 2 || TILE_N * FS * 4 <= STAGE * 2, "an f32 K (or V) tile fits one stage");
    static_assert(ST == 3 || TILE_N * FS * 4 <= STAGE * 2, "f32 K and V of 32 keys fit one stage");
    extern __shared__ float4 tc_smem4[];
    u16* bf = reinterpret_cast<u16*>(tc_smem4);
    u16* const qs = bf + ST * STAGE;  // QS: the block's q, [HB][TC_M][BS] bf16, pre-scaled
    __shared__ int s_kmin, s_kend, s_kloc, s_bad;
    // Later tiles see more keys: launch them first so the grid does not end on a long one.
    const int t0 = (gridDim.x - 1 - blockIdx.x) * TC_M;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int hw0 = (warp / TC_WARPS) * HW;  // this warp's first head within the block's
    const int h0 = blockIdx.y * HB;
    const int H = a.num_heads;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int ra = (warp % TC_WARPS) * 16 + g;  // this thread's two rows of the tile
    const int rb = ra + 8;

    // This thread's q values (HW == 1), loaded first: their latency overlaps the block's set-up
    // below (the tile is inside the batch whether or not this kernel owns it).
    float2 qv[QS ? 1 : D / 16][4];
    if constexpr (!QS) {
        if (t0 + TC_M <= a.n) {
            const float* qa = a.q + ((u64)(t0 + ra) * H + h0 + hw0) * D;
            const float* qb = a.q + ((u64)(t0 + rb) * H + h0 + hw0) * D;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const int cc = kk * 16 + 2 * t;
                qv[kk][0] = *reinterpret_cast<const float2*>(qa + cc);
                qv[kk][1] = *reinterpret_cast<const float2*>(qb + cc);
                qv[kk][2] = *reinterpret_cast<const float2*>(qa + cc + 8);
                qv[kk][3] = *reinterpret_cast<const float2*>(qb + cc + 8);
            }
        }
    }
    if (!tile_owned(a, t0)) return;
    if constexpr (QS) {
        // The block's q rows, scaled and rounded as the register path rounds them (the same
        // bits), into shared memory; the pipeline's first barrier publishes them. The HB heads of
        // a token are contiguous in q, so consecutive threads read consecutive 16 bytes.
        const float sl = a.scale_log2;
#pragma unroll 8
        for (int it = 0; it < TC_M * HB * CH4 / NT; ++it) {
            const int idx = tid + it * NT;
            const int rh = idx / CH4;
            const int ch = idx - rh * CH4;
            const int r = rh / HB;
            const int hh = rh - r * HB;
            const float4 x = ld4(a.q + ((u64)(t0 + r) * H + h0 + hh) * D + 4 * ch);
            *reinterpret_cast<uint2*>(qs + (hh * TC_M + r) * BS + 4 * ch) =
                make_uint2(pack_bf16(x.x * sl, x.y * sl), pack_bf16(x.z * sl, x.w * sl));
        }
    }
    const int kh = h0 / a.group;
    const int ts = a.table_start[t0];
    const int c = a.positions[t0] - t0;  // key p of the checked run is batch row p - c
    // QS: what the loads need, re-read from shared memory at each tile (volatile: not kept in
    // registers across the tile's products, where two heads' accumulators fill the file);
    // tile_key_range's barriers publish them.
    __shared__ int s_c, s_kh, s_ts;
    if constexpr (QS) {
        if (tid == 0) {
            s_c = c;
            s_kh = kh;
            s_ts = ts;
        }
    }
    tile_key_range(a, t0, &s_kmin, &s_kend);
    const KeyTiles kt = key_tiles<TC_M, TILE_N>(a, t0, &s_kmin, &s_kend, &s_kloc, &s_bad);
    const int kmin = kt.kmin, kend = kt.kend, ntiles = kt.ntiles, npool = kt.npool;

    auto ld_state = [&](int& kend_, int& c_, int& kh_, int& ts_) {
        if constexpr (QS) {
            kend_ = *(volatile int*)&s_kend;
            c_ = *(volatile int*)&s_c;
            kh_ = *(volatile int*)&s_kh;
            ts_ = *(volatile int*)&s_ts;
        } else {
            kend_ = kend;
            c_ = c;
            kh_ = kh;
            ts_ = ts;
        }
    };
    // Stage `st` <- keys kt .. kt + 63 from the batch copy, by cp.async (rows past kend: zeros).
    auto copy_tile = [&](int st, int kt) {
        int kend, c, kh, ts;
        ld_state(kend, c, kh, ts);
        u16* kb = bf + st * STAGE;
        u16* vb = kb + TILE_N * BS;
        if constexpr (QS) {
            // Pass `it` takes row r0 + it * RPI: one offset per tile, then a fixed stride per
            // pass (an add and a compare, where the offset from scratch cost ~20 instructions).
            constexpr int RPI = NT / CH8;
            static_assert(NT % CH8 == 0, "a pass covers whole rows");
            const int r0 = tid / CH8;
            const int ch = tid % CH8;
            const int lim = kend - kt - r0;  // pass `it` is a real key while it * RPI < lim
            const long long step = (long long)RPI * a.kv_heads * D;
            long long off = ((long long)(kt + r0 - c) * a.kv_heads + kh) * D + 8 * ch;
            u16* dk = kb + r0 * BS + 8 * ch;
#pragma unroll 1
            for (int it = 0; it < TILE_N / RPI; ++it, off += step, dk += RPI * BS) {
                const bool ok = it * RPI < lim;
                cp_async16(dk, a.copy_k + (ok ? off : 0), ok ? 16 : 0);
                cp_async16(dk + TILE_N * BS, a.copy_v + (ok ? off : 0), ok ? 16 : 0);
            }
        } else {
#pragma unroll
            for (int it = 0; it < TILE_N * CH8 / NT; ++it) {
                const int idx = tid + it * NT;
                const int r = idx / CH8;
                const int ch = idx - r * CH8;
                const int kp = kt + r;
                const bool ok = kp < kend;
                const u64 off = ok ? ((u64)(kp - c) * a.kv_heads + kh) * D + 8 * ch : 0;
                cp_async16(kb + r * BS + 8 * ch, a.copy_k + off, ok ? 16 : 0);
                cp_async16(vb + r * BS + 8 * ch, a.copy_v + off, ok ? 16 : 0);
            }
        }
    };
    // Pool tiles: rows of keys by cp.async into the landing stages (land_kv4: f32 rows in their
    // 16-byte slots, or bf16 rows in each slot's first half; rows past kend or out of range:
    // zeros), then rounded to bf16 (landed_bf16x4) into stage PS. ST == 3: K rows of the whole
    // tile into stage 0, V rows into stage 1. ST == 2: K rows of keys kt + 32 half .. + 31, then
    // their V rows, into stage 0.
    float* const kf = reinterpret_cast<float*>(bf);
    float* const vf = ST == 3 ? reinterpret_cast<float*>(bf + STAGE) : kf + (TILE_N / 2) * FS;
    constexpr int PR = ST == 3 ? TILE_N : TILE_N / 2;  // key rows per fetch
    auto pool_fetch = [&](int kt) {
        int kend, c, kh, ts;
        ld_state(kend, c, kh, ts);
#pragma unroll(QS ? 1 : 4)
        for (int it = 0; it < PR * CH4 / NT; ++it) {
            const int idx = tid + it * NT;
            const int r = idx / CH4;
            const int ch = idx - r * CH4;
            const int kp = kt + r;
            const long long off = kp < kend ? kv_offset(a, ts, kp, kh) : -1;
            const bool ok = off >= 0;
            land_kv4(kf + r * FS + 4 * ch, ok ? a.pool_k + off + 4 * ch : a.pool_k, ok);
            land_kv4(vf + r * FS + 4 * ch, ok ? a.pool_v + off + 4 * ch : a.pool_v, ok);
        }
        cp_async_commit();
    };
    // The landed rows into rows r0 .. r0 + PR - 1 of stage PS.
    auto pool_round = [&](int r0) {
        u16* kb = bf + PS * STAGE + r0 * BS;
        u16* vb = kb + TILE_N * BS;
#pragma unroll(QS ? 1 : PR * CH4 / NT)
        for (int it = 0; it < PR * CH4 / NT; ++it) {
            const int idx = tid + it * NT;
            const int r = idx / CH4;
            const int ch = idx - r * CH4;
            const uint2 x = landed_bf16x4(kf + r * FS + 4 * ch);
            const uint2 y = landed_bf16x4(vf + r * FS + 4 * ch);
            *reinterpret_cast<uint2*>(kb + r * BS + 4 * ch) = x;
            *reinterpret_cast<uint2*>(vb + r * BS + 4 * ch) = y;
        }
    };
    // Copy tile i (tile npool + i) into stage st (i % ST); always one commit group, so the
    // waits count tiles.
    auto load_copy = [&](int i, int st) {
        if (npool + i < ntiles) copy_tile(st, kmin + (npool + i) * TILE_N);
        cp_async_commit();
    };
    if (npool > 0) {
        pool_fetch(kmin);
    } else {
#pragma unroll
        for (int i = 0; i < ST - 1; ++i) load_copy(i, i);
    }

    const int pa = a.positions[t0 + ra], pb = a.positions[t0 + rb];
    const int loa = window_lo(a, pa), lob = window_lo(a, pb);
    // QS: the rows' visible ranges wait in shared memory for the (few) masked tiles: every
    // register counts with two heads' accumulators.
    __shared__ int s_p[QS ? TC_M : 1], s_lo[QS ? TC_M : 1];
    if constexpr (QS) {
        if (warp < TC_WARPS && t == 0) {
            s_p[ra] = pa;
            s_p[rb] = pb;
            s_lo[ra] = loa;
            s_lo[rb] = lob;
        }
    }
    // A key tile every row of this warp sees whole needs no mask (all but the diagonal tiles
    // and, under a window, its lower edge).
    int wmin_p = min(pa, pb), wmax_lo = max(loa, lob);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wmin_p = min(wmin_p, __shfl_xor_sync(0xffffffffu, wmin_p, o));
        wmax_lo = max(wmax_lo, __shfl_xor_sync(0xffffffffu, wmax_lo, o));
    }
    __shared__ int s_wmin[QS ? TC_WARPS * WG : 1], s_wmax[QS ? TC_WARPS * WG : 1];
    if constexpr (QS) {
        if (lane == 0) {
            s_wmin[warp] = wmin_p;
            s_wmax[warp] = wmax_lo;
        }
    }

    u32 qf[QS ? 1 : D / 16][4];
    if constexpr (!QS) {
        const float sl = a.scale_log2;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) qf[kk][e] = pack_bf16(qv[kk][e].x * sl, qv[kk][e].y * sl);
    }
    float o[HW][D / 8][4];
#pragma unroll
    for (int hw = 0; hw < HW; ++hw)
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            o[hw][dt][0] = o[hw][dt][1] = o[hw][dt][2] = o[hw][dt][3] = 0.0f;
    float ma[HW], mb[HW], la[HW], lb[HW];
#pragma unroll
    for (int hw = 0; hw < HW; ++hw) {
        ma[hw] = mb[hw] = NEG_INF;
        la[hw] = lb[hw] = 0.0f;
    }

    // This lane's row of the 8x8 blocks it addresses for ldmatrix: block lane / 8, row lane % 8.
    const int lm = lane >> 3;
    const int lr = lane & 7;
    // QS: this lane's row address in the q tile of head hw0 (blocks: (rows +0, dims +0),
    // (rows +8, dims +0), (rows +0, dims +8), (+8, +8): a0..a3 of the A fragment).
    const u16* const qrow =
        qs + (hw0 * TC_M + (warp % TC_WARPS) * 16 + (lm & 1) * 8 + lr) * BS + (lm >> 1) * 8;

    // S = Q K^T, online softmax and O += P V for the bf16 key tile at kb (V rows after K's),
    // keys kt .. kt + 63, for each of the warp's HW heads (one m16 tile each: same tokens, so the
    // same mask; every K and V fragment serves all of them).
    auto attend = [&](const u16* kb, int kt) {
        const u16* vb = kb + TILE_N * BS;
        float s[HW][TILE_N / 8][4];
#pragma unroll
        for (int hw = 0; hw < HW; ++hw)
#pragma unroll
            for (int nt = 0; nt < TILE_N / 8; ++nt)
                s[hw][nt][0] = s[hw][nt][1] = s[hw][nt][2] = s[hw][nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 qa[HW][4];
            if constexpr (QS) {
#pragma unroll
                for (int hw = 0; hw < HW; ++hw) ldmatrix4(qa[hw], qrow + hw * TC_M * BS + kk * 16);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e) qa[0][e] = qf[kk][e];
            }
#pragma unroll
            for (int np = 0; np < TILE_N / 16; ++np) {
                // Blocks: (keys +0, dims +0), (keys +0, dims +8), (keys +8, dims +0), (+8, +8).
                u32 b[4];
                ldmatrix4(b, kb + (np * 16 + (lm >> 1) * 8 + lr) * BS + kk * 16 + (lm & 1) * 8);
#pragma unroll
                for (int hw = 0; hw < HW; ++hw) {
                    mma_bf16(s[hw][2 * np], qa[hw], b[0], b[1]);
                    mma_bf16(s[hw][2 * np + 1], qa[hw], b[2], b[3]);
                }
            }
        }

        int wmin = wmin_p, wmax = wmax_lo;
        if constexpr (QS) {
            wmin = *(volatile int*)&s_wmin[warp];
            wmax = *(volatile int*)&s_wmax[warp];
        }
        if (!(kt + TILE_N - 1 <= wmin && kt >= wmax)) {
            int mpa = pa, mpb = pb, mloa = loa, mlob = lob;
            if constexpr (QS) {
                const int r = (warp % TC_WARPS) * 16 + g;
                mpa = s_p[r];
                mpb = s_p[r + 8];
                mloa = s_lo[r];
                mlob = s_lo[r + 8];
            }
#pragma unroll
            for (int hw = 0; hw < HW; ++hw)
#pragma unroll
                for (int nt = 0; nt < TILE_N / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int kp = kt + nt * 8 + 2 * t + e;
                        if (kp < mloa || kp > mpa) s[hw][nt][e] = NEG_INF;
                        if (kp < mlob || kp > mpb) s[hw][nt][2 + e] = NEG_INF;
                    }
        }
        u32 pf[HW][TILE_N / 16][4];
#pragma unroll
        for (int hw = 0; hw < HW; ++hw) {
            float mxa = ma[hw], mxb = mb[hw];
#pragma unroll
            for (int nt = 0; nt < TILE_N / 8; ++nt) {
                mxa = fmaxf(mxa, fmaxf(s[hw][nt][0], s[hw][nt][1]));
                mxb = fmaxf(mxb, fmaxf(s[hw][nt][2], s[hw][nt][3]));
            }
            // A row's 64 keys are spread over the 4 lanes of its quad.
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
            const float refa = softmax_ref(mxa), refb = softmax_ref(mxb);
            const float ca = ex2_ftz(ma[hw] - refa), cb = ex2_ftz(mb[hw] - refb);
            la[hw] *= ca;
            lb[hw] *= cb;
            // Past the first tiles a row's max rarely moves: then every factor is exactly 1 and
            // the warp skips the rescale (the same bits as multiplying by 1).
            if (__any_sync(0xffffffffu, ca != 1.0f || cb != 1.0f)) {
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt) {
                    o[hw][dt][0] *= ca;
                    o[hw][dt][1] *= ca;
                    o[hw][dt][2] *= cb;
                    o[hw][dt][3] *= cb;
                }
            }
            ma[hw] = mxa;
            mb[hw] = mxb;
#pragma unroll
            for (int nt = 0; nt < TILE_N / 8; ++nt) {
                s[hw][nt][0] = ex2_ftz(s[hw][nt][0] - refa);
                s[hw][nt][1] = ex2_ftz(s[hw][nt][1] - refa);
                s[hw][nt][2] = ex2_ftz(s[hw][nt][2] - refb);
                s[hw][nt][3] = ex2_ftz(s[hw][nt][3] - refb);
                la[hw] += s[hw][nt][0] + s[hw][nt][1];
                lb[hw] += s[hw][nt][2] + s[hw][nt][3];
            }
            // S's accumulators as P's A fragments (two 8-key tiles per 16-key step).
#pragma unroll
            for (int kk = 0; kk < TILE_N / 16; ++kk) {
                pf[hw][kk][0] = pack_bf16(s[hw][2 * kk][0], s[hw][2 * kk][1]);
                pf[hw][kk][1] = pack_bf16(s[hw][2 * kk][2], s[hw][2 * kk][3]);
                pf[hw][kk][2] = pack_bf16(s[hw][2 * kk + 1][0], s[hw][2 * kk + 1][1]);
                pf[hw][kk][3] = pack_bf16(s[hw][2 * kk + 1][2], s[hw][2 * kk + 1][3]);
            }
        }

#pragma unroll
        for (int kk = 0; kk < TILE_N / 16; ++kk) {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                // Blocks: (keys +0, dims +0), (keys +8, dims +0), (keys +0, dims +8), (+8, +8).
                u32 b[4];
                ldmatrix4_trans(b, vb + (kk * 16 + (lm & 1) * 8 + lr) * BS + (2 * dp + (lm >> 1)) * 8);
#pragma unroll
                for (int hw = 0; hw < HW; ++hw) {
                    mma_bf16(o[hw][2 * dp], pf[hw][kk], b[0], b[1]);
                    mma_bf16(o[hw][2 * dp + 1], pf[hw][kk], b[2], b[3]);
                }
            }
        }
    };

    // Pool phase: tile j + 1's f32 rows load while tile j computes from stage PS.
    for (int j = 0; j < npool; ++j) {
        const int kt = kmin + j * TILE_N;
        cp_async_wait<0>();
        __syncthreads();  // tile j's (first) f32 rows have landed; everyone is done with stage PS
        pool_round(0);
        __syncthreads();  // the landing stages are free
        if constexpr (ST == 2) {
            // The second half of the tile: its latency is not hidden (the other block on the SM
            // computes meanwhile).
            pool_fetch(kt + TILE_N / 2);
            cp_async_wait<0>();
            __syncthreads();
            pool_round(TILE_N / 2);
            __syncthreads();
        }
        if (j + 1 < npool) {
            pool_fetch(kt + TILE_N);
        } else {
            // The copy phase's first tiles load into the other stages meanwhile.
#pragma unroll
            for (int i = 0; i < ST - 1; ++i) load_copy(i, i);
        }
        attend(bf + PS * STAGE, kt);
    }
    if (npool > 0) __syncthreads();  // everyone is done with stage PS before the ring reuses it

    // Copy phase, one barrier per tile: [wait for tile i's copies; barrier; start tile
    // i + ST - 1 into the stage tile i - 1 left; compute tile i].
    for (int i = 0, st = 0; npool + i < ntiles; ++i) {  // st = i % ST
        cp_async_wait<ST - 2>();
        __syncthreads();
        load_copy(i + ST - 1, st == 0 ? ST - 1 : st - 1);
        attend(bf + st * STAGE, kmin + (npool + i) * TILE_N);
        st = st == ST - 1 ? 0 : st + 1;
    }
    cp_async_wait<0>();  // no copy may land in shared memory after the block exits

    // QS: the output rows' addresses from the block and thread indices read again (volatile), not
    // values held in registers through the loop.
    int ot0 = t0, oh = h0 + hw0, ora = ra;
    if constexpr (QS) {
        u32 bx, by, tx;
        asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
        asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(by));
        asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
        ot0 = (gridDim.x - 1 - bx) * TC_M;
        oh = by * HB + (tx / 32 / TC_WARPS) * HW;
        ora = (tx / 32 % TC_WARPS) * 16 + (tx & 31) / 4;
    }
#pragma unroll
    for (int hw = 0; hw < HW; ++hw) {
        float sa = la[hw], sb = lb[hw];
        sa += __shfl_xor_sync(0xffffffffu, sa, 1);
        sa += __shfl_xor_sync(0xffffffffu, sa, 2);
        sb += __shfl_xor_sync(0xffffffffu, sb, 1);
        sb += __shfl_xor_sync(0xffffffffu, sb, 2);
        const float ia = sa > 0.0f ? 1.0f / sa : 0.0f;
        const float ib = sb > 0.0f ? 1.0f / sb : 0.0f;
        const int h = oh + hw;
        float* oa = a.out + ((u64)(ot0 + ora) * H + h) * D;
        float* ob = a.out + ((u64)(ot0 + ora + 8) * H + h) * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            const int cc = dt * 8 + 2 * t;
            *reinterpret_cast<float2*>(oa + cc) = make_float2(o[hw][dt][0] * ia, o[hw][dt][1] * ia);
            *reinterpret_cast<float2*>(ob + cc) = make_float2(o[hw][dt][2] * ib, o[hw][dt][3] * ib);
        }
    }
}

// attn_tile_bf16_d<D>: one head per warp, 4 warps, 3 stages; two blocks per SM (128 threads x 2
// leaves each thread up to 255 registers).
// attn_tile_bf16_h2_d<D>: two heads per warp, 4 warps, 2 stages plus the q tile; two blocks per SM.
// attn_tile_bf16_h4_d<D>: two heads per warp, 8 warps (4 heads), 3 stages plus the q tile; one
// block per SM.
#define ATTN_TILE_BF16(NAME, D, HW, WG, ST, MINB)                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS * WG, MINB) NAME(const AttnArgs a) { \
        attn_tile_bf16<D, HW, WG, ST>(a);                                                        \
    }

#ifndef ATTN_CLUSTER_ONLY
ATTN_TILE_BF16(attn_tile_bf16_d64, 64, 1, 1, 3, 2)
ATTN_TILE_BF16(attn_tile_bf16_d128, 128, 1, 1, 3, 2)
ATTN_TILE_BF16(attn_tile_bf16_h2_d64, 64, 2, 1, 2, 2)
ATTN_TILE_BF16(attn_tile_bf16_h2_d128, 128, 2, 1, 2, 2)
ATTN_TILE_BF16(attn_tile_bf16_h4_d64, 64, 2, 2, 3, 1)
ATTN_TILE_BF16(attn_tile_bf16_h4_d128, 128, 2, 2, 3, 1)
#endif  // ATTN_CLUSTER_ONLY
