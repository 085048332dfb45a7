// Prefill attention on Hopper tensor cores with wgmma (FlashAttention-3 style), head_dim 128,
// bf16 operands, f32 accumulation (ops/attention_wgmma.rs picks it, ops/attention.rs launches it
// as the tensor-core prefill tiles on sm_90).
//
// Same contract as attention.cu's attn_tile_bf16 kernels (read that file's header): one AttnArgs
// by value; a tile of AttnArgs.tile_m = 64 consecutive tokens of one sequence belongs to this
// kernel when `tile_owned` says so, every other token to attn_split; keys of the batch's own
// positions come from the bf16 batch copy (copy_k/copy_v, checked by `batch_copy_start`),
// earlier keys (a cached prefix: chunked prefill) from the pool (f32, rounded to bf16 here, or
// bf16: attention_common.cuh's ld_kv4 widens, the rounding then keeps them); both give the
// same bf16 values, so the output does not depend on which source a tile took.
// Scores are in the log2 domain (q scaled by scale_log2 and rounded to bf16 once), weights by
// ex2.approx.ftz, P rounded to bf16, one normalisation at the end: the arithmetic of the mma.sync
// kernel, in another accumulation order (so other bits, the same tolerance).
//
// AttnArgs, kv_offset, window_lo, tile_owned, tile_key_range, batch_copy_start and key_tiles come
// from attention_common.cuh, which compile.rs prepends to this file and to attention.cu alike.
//
// CTA: grid (n / 64, num_heads / HEADS), 128 (HEADS + 1) threads, one CTA per SM.
// - warpgroup 0, the producer: per key tile of FA_N = 128 keys, waits for a free stage of a ring
//   of STAGES, then fills its K and V (each [2 blocks of 64 dims][128 keys][128 bytes], the
//   128-byte swizzled layout: key r, 16-byte chunk c of a block at r * 128 + 16 (c ^ (r % 8)))
//   either from the batch copy or, for pool tiles, by loading pool rows (8 rows per warp in
//   flight, the block-table offsets of a warp's 32 rows found at once), rounding them and
//   storing them (fence.proxy.async, then arrive). Copy tiles: TMA == 0, cp.async by every
//   thread (arriving on the stage's `full` barrier when its copies land; rows past the tile's
//   last key zero-filled); TMA == 1, thread 0 posts the stage's 64 KiB on `full` and issues four
//   TMA boxes {64 dims, 1 kv head, 128 rows} per tile (rows past the tile's last key are real
//   rows of the copy, or zeros past its end: masked either way, with finite values, so the same
//   bits); TMA == 2, see fa_produce (clusters of two CTAs, multicast). Pool rows out of range or
//   past the last key are zeros.
// - warpgroups 1..HEADS, the consumers: consumer c owns query head h0 + c of the block's HEADS
//   heads (one kv head: every K/V tile serves all of them), 64 rows = the tile's 64 tokens. Its
//   q rows are scaled, rounded and stored in the same swizzled K-major layout. Per key tile:
//   S = Q K^T by 8 wgmma m64n128k16 (A = q, B = K, both K-major from shared memory), mask (only
//   tiles a row of the warp does not see whole), online softmax in registers (the accumulator
//   layout of S is the register-A fragment layout of P: rows g and g + 8 of the warp, keys
//   8 j + 2 t (+1)), then O += P V by 8 wgmma m64n128k16 with A = P from registers and B = V as
//   an N-major ("transposed") operand: the V stage is the K-major layout of V's rows, which read
//   as [keys][dims] is MN-major with the 64-dim blocks LBO = 16 KiB apart and 8-key groups SBO =
//   1 KiB apart. The stage is freed (lane 0 of each warp on `empty`) once its PV has retired.
// - OVERLAP (FA3's intra-warpgroup pipelining): tile j's S = Q K_j^T is issued together with
//   tile j - 1's O += P V, and the softmax of tile j runs while that PV runs; O's rescale by tile
//   j's factor waits for it. Same operations per row in the same order: the same bits.
// - PP (with OVERLAP, two heads; FA3's ping-pong): the two consumers take turns (named barriers)
//   to issue their wgmma, so one's softmax overlaps the other's tensor-core work.
// Causal: key tiles run from the rows' first visible key (window) to the last row's position;
// longest tiles (last token tiles) launch first.
// Measured (ops_bench attention, H200, 32/4 heads of 128; docs/perf/cuda-ops.md "Prefill
// attention on wgmma"): 4096 tokens from the copy 323 µs with cp.async (h2_s3_ovpp), 300 µs with
// TMA (h2_s3_ovpp_tma), 348 µs with the cluster multicast (it halves the L2 reads but waits on
// the partner); ops/attention_wgmma.rs picks the TMA build when every key is the batch's own.
// setmaxnreg (HEADS == 2): producer 104 registers (its pool loads keep 16 float4 in flight),
// consumers 200 (the overlapping consumer needs ~190). The CTA starts with 384 x 168 registers
// (__launch_bounds__(384, 1)) and the warpgroups only trade among those: 128 x 104 + 256 x 200 =
// 384 x 168 (more would leave setmaxnreg.inc waiting for ever).
//
// wgmma needs sm_90a: compile.rs builds this file for sm_90a on sm_90 devices; elsewhere the
// entry points are empty and never launched (ops/attention_wgmma.rs checks the architecture).

#define FA_M 64    // query tokens per tile (AttnArgs.tile_m)
#define FA_N 128   // keys per K/V tile
#define FA_D 128   // head_dim
#define FA_PU 8    // pool rows a producer warp loads at once (16 float4 per thread in flight)
#define FA_NEG_INF __int_as_float(0xff800000)

// A CUtensorMap of the batch copy (K or V), passed by value as a __grid_constant__ parameter:
// 3-D {head_dim 128, kv_heads, n}, boxes {64, 1, 128} in the 128-byte swizzle (the TMA builds).
struct __align__(64) FaMap {
    u64 v[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)


__device__ __forceinline__ float fa_ref(float mx) { return mx == FA_NEG_INF ? 0.0f : mx; }

__device__ __forceinline__ void fa_st8(u32 addr, u32 lo, u32 hi) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(lo), "r"(hi) : "memory");
}

__device__ __forceinline__ void fa_fence_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Box {x, y, z} of the map into `dst`, completing its bytes on `bar`.
__device__ __forceinline__ void fa_tma(u32 dst, const FaMap* map, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}

// The same into `dst` of both CTAs of the cluster, each completing on its own `bar` (same offset).
__device__ __forceinline__ void fa_tma_mc(u32 dst, const FaMap* map, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(z), "r"(bar), "h"((u16)3)
        : "memory");
}

__device__ __forceinline__ void fa_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

template <int R>
__device__ __forceinline__ void fa_fence_u(u32 (&p)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
        asm volatile("" : "+r"(p[i][0]), "+r"(p[i][1]), "+r"(p[i][2]), "+r"(p[i][3])::"memory");
}

// V as the N-major B operand: 128-byte swizzle, the next 64 dims (N) 16 KiB on (LBO), the next
// 8 keys (K) 1 KiB on (SBO).
__device__ __forceinline__ u64 fa_desc_v(u32 addr) {
    return (u64)((addr & 0x3ffff) >> 4) | ((u64)((FA_N * 128) >> 4) << 16) |
           ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// d[64] += A (registers, the m64k16 bf16 fragment) x B (N-major descriptor), m64n128k16.
__device__ __forceinline__ void fa_mma_rs(float (&d)[64], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS_0_63
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : WG_ACC64(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// Bytes of one 64-dim block of a K or V tile (128 keys x 128 bytes), of one head's q (64 rows x
// 2 blocks x 128 bytes), and of one stage (K's two blocks, then V's).
#define FA_KB (FA_N * 128)
#define FA_QB (FA_M * 2 * 128)
#define FA_STAGE (4 * FA_KB)

// Issue S = Q K^T for the tile in stage `kst` (not committed).
__device__ __forceinline__ void fa_issue_s(float (&s)[64], u32 qh, u32 kst) {
#pragma unroll
    for (int kk = 0; kk < FA_D / 16; ++kk)
        wg_mma(s, wg_desc(qh + (kk >> 2) * (FA_M * 128) + (kk & 3) * 32),
               wg_desc(kst + (kk >> 2) * FA_KB + (kk & 3) * 32), kk != 0);
}

// Issue O += P V for the tile in stage `kst` (V after K; not committed).
__device__ __forceinline__ void fa_issue_pv(float (&o)[64], const u32 (&p)[FA_N / 16][4], u32 kst) {
#pragma unroll
    for (int kk = 0; kk < FA_N / 16; ++kk) fa_mma_rs(o, p[kk], fa_desc_v(kst + 2 * FA_KB + kk * 2048));
}

// The consumer's row state: rows ra = 16 warp + g and rb = ra + 8 of its 64.
struct FaRows {
    int pa, pb, loa, lob;
    int wmin_p, wmax_lo;  // over the warp's 16 rows: a tile inside [wmax_lo, wmin_p] needs no mask
    float ma, mb, la, lb;
};

// Mask and online softmax of tile kt's scores; P (bf16, register-A fragments) into p, and the
// factors that rescale O into *ca, *cb.
__device__ __forceinline__ void fa_softmax(float (&s)[64], u32 (&p)[FA_N / 16][4], FaRows& r, int kt,
                                           int t, float* ca, float* cb) {
    if (!(kt + FA_N - 1 <= r.wmin_p && kt >= r.wmax_lo)) {
#pragma unroll
        for (int j = 0; j < FA_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int kp = kt + 8 * j + 2 * t + e;
                if (kp < r.loa || kp > r.pa) s[4 * j + e] = FA_NEG_INF;
                if (kp < r.lob || kp > r.pb) s[4 * j + 2 + e] = FA_NEG_INF;
            }
    }
    float mxa = r.ma, mxb = r.mb;
#pragma unroll
    for (int j = 0; j < FA_N / 8; ++j) {
        mxa = fmaxf(mxa, fmaxf(s[4 * j], s[4 * j + 1]));
        mxb = fmaxf(mxb, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
    const float refa = fa_ref(mxa), refb = fa_ref(mxb);
    *ca = ex2_ftz(r.ma - refa);
    *cb = ex2_ftz(r.mb - refb);
    r.la *= *ca;
    r.lb *= *cb;
    r.ma = mxa;
    r.mb = mxb;
#pragma unroll
    for (int j = 0; j < FA_N / 8; ++j) {
        s[4 * j] = ex2_ftz(s[4 * j] - refa);
        s[4 * j + 1] = ex2_ftz(s[4 * j + 1] - refa);
        s[4 * j + 2] = ex2_ftz(s[4 * j + 2] - refb);
        s[4 * j + 3] = ex2_ftz(s[4 * j + 3] - refb);
        r.la += s[4 * j] + s[4 * j + 1];
        r.lb += s[4 * j + 2] + s[4 * j + 3];
    }
#pragma unroll
    for (int kk = 0; kk < FA_N / 16; ++kk) {
        p[kk][0] = pack_bf16(s[8 * kk], s[8 * kk + 1]);
        p[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

__device__ __forceinline__ void fa_rescale(float (&o)[64], float ca, float cb) {
    // Past the first tiles a row's max rarely moves: every factor is then exactly 1.
    if (__any_sync(0xffffffffu, ca != 1.0f || cb != 1.0f)) {
#pragma unroll
        for (int j = 0; j < FA_D / 8; ++j) {
            o[4 * j] *= ca;
            o[4 * j + 1] *= ca;
            o[4 * j + 2] *= cb;
            o[4 * j + 3] *= cb;
        }
    }
}

// The producer: key tiles 0 .. ntiles - 1 into the ring (tiles before npool from the pool).
// A consumer warp frees a stage: its CTA's `empty`, or in a cluster both CTAs' (the partner's
// producer multicasts into this CTA's stage too).
template <int TMA>
__device__ __forceinline__ void fa_release(u32 empty) {
    if (TMA == 2) {
        mbar_arrive_cluster(empty, 0);
        mbar_arrive_cluster(empty, 1);
    } else {
        mbar_arrive(empty);
    }
}

// TMA: 0 cp.async by every thread; 1 the copy tiles by TMA (thread 0: four boxes); 2 a cluster
// of two CTAs (the same tokens, the other two heads of the kv head) shares each copy tile: rank 0
// multicasts K, rank 1 V, into both CTAs' stage; a stage is refilled once the consumers of both
// CTAs freed it (their arrivals reach both CTAs' `empty`). Pool tiles: each CTA its own.
template <int STAGES, int TMA>
__device__ __forceinline__ void fa_produce(const AttnArgs& a, int t0, int kmin, int kend,
                                           int ntiles, int npool, int kh, u32 sbase, u32 bars,
                                           const FaMap* kmap, const FaMap* vmap) {
    const int tid = threadIdx.x;  // 0 .. 127
    const int ts = a.table_start[t0];
    const int c = a.positions[t0] - t0;  // key p of the checked run is batch row p - c
    int stage = 0;
    u32 phase = 0;
    for (int j = 0; j < ntiles; ++j) {
        if (TMA == 2) mbar_wait_cluster(bars + 8 * (STAGES + stage), phase ^ 1);
        else mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);
        const int kt = kmin + j * FA_N;
        const u32 st = sbase + stage * FA_STAGE;
        if (j < npool) {
            // Warp w takes keys w + 4 i (i < 32); lane l dims 4 l .. 4 l + 3 (8 bytes of bf16).
            // Lane i first finds the pool offset of the warp's key i (one round trip for the
            // block-table reads of all 32), then the rows load in groups of FA_PU, every load of
            // a group in flight before its first store (the stores' memory clobber orders them).
            const int warp = tid >> 5, lane = tid & 31;
            const u32 col = (u32)(lane >> 4) * FA_KB + (lane & 1) * 8;
            const int cc = (lane >> 1) & 7;
            const int kl = kt + warp + 4 * lane;
            const long long off_l = kl < kend ? kv_offset(a, ts, kl, kh) : -1;
#pragma unroll 1
            for (int i0 = 0; i0 < FA_N / 4; i0 += FA_PU) {
                float4 x[FA_PU], y[FA_PU];
#pragma unroll
                for (int u = 0; u < FA_PU; ++u) {
                    const long long off = __shfl_sync(0xffffffffu, off_l, i0 + u);
                    const long long src = (off >= 0 ? off : 0) + 4 * lane;
                    x[u] = ld_kv4(a.pool_k + src);
                    y[u] = ld_kv4(a.pool_v + src);
                    if (off < 0) x[u] = y[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
#pragma unroll
                for (int u = 0; u < FA_PU; ++u) {
                    const int r = warp + 4 * (i0 + u);
                    const u32 dst = st + col + r * 128 + ((cc ^ (r & 7)) << 4);
                    fa_st8(dst, pack_bf16(x[u].x, x[u].y), pack_bf16(x[u].z, x[u].w));
                    fa_st8(dst + 2 * FA_KB, pack_bf16(y[u].x, y[u].y),
                           pack_bf16(y[u].z, y[u].w));
                }
            }
            // The consumers read the stage through the async proxy (wgmma).
            fa_fence_async();
            if (TMA) {
                // One arrival (thread 0's) per phase, as for the TMA tiles.
                asm volatile("bar.sync 5, 128;" ::: "memory");
                if (tid == 0) mbar_arrive(bars + 8 * stage);
            } else {
                mbar_arrive(bars + 8 * stage);
            }
        } else if (TMA) {
            if (tid == 0) {
                const u32 full = bars + 8 * stage;
                mbar_expect_tx(full, FA_STAGE);
                const int row = kt - c;
                if (TMA == 1) {
                    fa_tma(st, kmap, 0, kh, row, full);
                    fa_tma(st + FA_KB, kmap, 64, kh, row, full);
                    fa_tma(st + 2 * FA_KB, vmap, 0, kh, row, full);
                    fa_tma(st + 3 * FA_KB, vmap, 64, kh, row, full);
                } else {
                    u32 rank;
                    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
                    const FaMap* map = rank == 0 ? kmap : vmap;
                    fa_tma_mc(st + 2 * rank * FA_KB, map, 0, kh, row, full);
                    fa_tma_mc(st + (2 * rank + 1) * FA_KB, map, 64, kh, row, full);
                }
            }
        } else {
            // Thread: 16-byte chunk ch of a 256-byte row, rows r0 + 8 i (all with r % 8 = r0).
            const int ch = tid & 15, r0 = tid >> 4;
            const u32 dst0 = st + (ch >> 3) * FA_KB + r0 * 128 + (((ch & 7) ^ r0) << 4);
            const long long step = 8ll * a.kv_heads * FA_D;
            const u16* srck = a.copy_k + ((long long)(kt + r0 - c) * a.kv_heads + kh) * FA_D + 8 * ch;
            const u16* srcv = a.copy_v + ((long long)(kt + r0 - c) * a.kv_heads + kh) * FA_D + 8 * ch;
            const int lim = kend - kt - r0;  // row r0 + 8 i is a real key while 8 i < lim
#pragma unroll
            for (int i = 0; i < FA_N / 8; ++i) {
                const bool ok = 8 * i < lim;
                const u32 dst = dst0 + i * 8 * 128;
                cp_async16(dst, ok ? srck + i * step : a.copy_k, ok);
                cp_async16(dst + 2 * FA_KB, ok ? srcv + i * step : a.copy_v, ok);
            }
            cp_async_arrive(bars + 8 * stage);
        }
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}

template <int HEADS, int STAGES, bool OVERLAP, bool PP, int TMA>
__device__ __forceinline__ void fa_prefill(const AttnArgs& a, const FaMap* kmap, const FaMap* vmap) {
    extern __shared__ unsigned char fa_smem[];
    __shared__ int s_kmin, s_kend, s_kloc, s_bad;
    const u32 raw = smem_u32(fa_smem);
    const u32 base = (raw + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
    const u32 qbase = base;
    const u32 sbase = base + HEADS * FA_QB;
    const u32 bars = sbase + STAGES * FA_STAGE;  // full[s] at bars + 8 s, empty[s] after them
    // Later tiles see more keys: launch them first so the grid does not end on a long one.
    const int t0 = (gridDim.x - 1 - blockIdx.x) * FA_M;
    const int tid = threadIdx.x;
    if (!tile_owned(a, t0)) return;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            // Every producer thread (TMA: thread 0); lane 0 of each consumer warp (of both CTAs
            // of a cluster).
            mbar_init(bars + 8 * s, TMA ? 1 : 128);
            mbar_init(bars + 8 * (STAGES + s), (TMA == 2 ? 2 : 1) * 4 * HEADS);
        }
        if (TMA == 2) asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    tile_key_range(a, t0, &s_kmin, &s_kend);  // its barriers also publish the barrier inits
    // Both CTAs of a cluster own the same token tile (same t0), so both get here; the partner's
    // barriers exist before anything reaches them.
    if (TMA == 2) fa_cluster_sync();
    const KeyTiles kt = key_tiles<FA_M, FA_N>(a, t0, &s_kmin, &s_kend, &s_kloc, &s_bad);
    const int kmin = kt.kmin, kend = kt.kend, ntiles = kt.ntiles, npool = kt.npool;
    const int h0 = blockIdx.y * HEADS;
    const int kh = h0 / a.group;
    const int wg = tid >> 7;

    if (wg == 0) {
        if (HEADS == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 104;" ::: "memory");
        fa_produce<STAGES, TMA>(a, t0, kmin, kend, ntiles, npool, kh, sbase, bars, kmap, vmap);
        // A cluster's CTAs leave together: the partner may still multicast into this one.
        if (TMA == 2) fa_cluster_sync();
        return;
    }
    if (HEADS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 200;" ::: "memory");
    // ---- consumer ----
    const int cw = wg - 1;
    const int h = h0 + cw;
    const int H = a.num_heads;
    const int ctid = tid - 128 * wg;
    const int warp = ctid >> 5, lane = ctid & 31;
    const int g = lane >> 2, t = lane & 3;
    const u32 qh = qbase + cw * FA_QB;
    {
        // q rows, scaled and rounded to bf16 (as the mma.sync kernel rounds them), swizzled:
        // row r, dims 4 c4 .. 4 c4 + 3 of block c4 / 16, chunk (c4 / 2) % 8, half c4 % 2.
        const float sl = a.scale_log2;
#pragma unroll 8
        for (int it = 0; it < FA_M * (FA_D / 4) / 128; ++it) {
            const int idx = ctid + it * 128;
            const int r = idx >> 5, c4 = idx & 31;
            const float4 x =
                *reinterpret_cast<const float4*>(a.q + ((u64)(t0 + r) * H + h) * FA_D + 4 * c4);
            const u32 dst = qh + (c4 >> 4) * (FA_M * 128) + r * 128 +
                            ((((c4 >> 1) & 7) ^ (r & 7)) << 4) + (c4 & 1) * 8;
            fa_st8(dst, pack_bf16(x.x * sl, x.y * sl), pack_bf16(x.z * sl, x.w * sl));
        }
        fa_fence_async();
        asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
    }
    FaRows r;
    {
        const int ra = warp * 16 + g, rb = ra + 8;
        r.pa = a.positions[t0 + ra];
        r.pb = a.positions[t0 + rb];
        r.loa = window_lo(a, r.pa);
        r.lob = window_lo(a, r.pb);
        int wmin = min(r.pa, r.pb), wmax = max(r.loa, r.lob);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
            wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
        }
        r.wmin_p = wmin;
        r.wmax_lo = wmax;
        r.ma = r.mb = FA_NEG_INF;
        r.la = r.lb = 0.0f;
    }
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    int stage = 0;
    u32 phase = 0;
    const u32 empty = bars + 8 * STAGES;

    if constexpr (!OVERLAP) {
        for (int j = 0; j < ntiles; ++j) {
            mbar_wait(bars + 8 * stage, phase);
            fa_fence_async();
            const u32 kst = sbase + stage * FA_STAGE;
            float s[64];
            wg_fence();
            fa_issue_s(s, qh, kst);
            wg_commit();
            wg_wait<0>();
            fence_regs(s);
            u32 p[FA_N / 16][4];
            float ca, cb;
            fa_softmax(s, p, r, kmin + j * FA_N, t, &ca, &cb);
            fa_rescale(o, ca, cb);
            fence_regs(o);
            wg_fence();
            fa_issue_pv(o, p, kst);
            wg_commit();
            wg_wait<0>();
            fence_regs(o);
            fa_fence_u(p);
            if (lane == 0) fa_release<TMA>(empty + 8 * stage);
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    } else if (ntiles > 0) {
        // PP (ping-pong, two heads): the consumers take turns to issue their wgmma, so one's
        // softmax runs while the other's products do. Named barrier 3 + c: "consumer c may
        // issue"; c syncs on its own and arrives on the other's after issuing. Consumer 1 lets
        // consumer 0 go first and leaves out its last arrive, so every arrive is matched.
        const int turn = 3 + cw, other = 4 - cw;
        if (PP && cw == 1) asm volatile("bar.arrive %0, 256;" ::"r"(other) : "memory");
        // Tile 0: S and its softmax; its PV is issued with tile 1's S.
        u32 p[FA_N / 16][4];
        mbar_wait(bars + 8 * stage, phase);
        fa_fence_async();
        u32 prev = sbase + stage * FA_STAGE;
        int prev_stage = stage;
        {
            float s[64];
            if (PP) asm volatile("bar.sync %0, 256;" ::"r"(turn) : "memory");
            wg_fence();
            fa_issue_s(s, qh, prev);
            wg_commit();
            if (PP) asm volatile("bar.arrive %0, 256;" ::"r"(other) : "memory");
            wg_wait<0>();
            fence_regs(s);
            float ca, cb;
            fa_softmax(s, p, r, kmin, t, &ca, &cb);  // O is zero: no rescale
        }
        for (int j = 1; j < ntiles; ++j) {
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
            }
            mbar_wait(bars + 8 * stage, phase);
            fa_fence_async();
            const u32 kst = sbase + stage * FA_STAGE;
            float s[64];
            fence_regs(o);
            if (PP) asm volatile("bar.sync %0, 256;" ::"r"(turn) : "memory");
            wg_fence();
            fa_issue_s(s, qh, kst);
            wg_commit();
            fa_issue_pv(o, p, prev);
            wg_commit();
            if (PP) asm volatile("bar.arrive %0, 256;" ::"r"(other) : "memory");
            wg_wait<1>();  // S of tile j (the older group) has landed; tile j - 1's PV runs on
            fence_regs(s);
            u32 pn[FA_N / 16][4];
            float ca, cb;
            fa_softmax(s, pn, r, kmin + j * FA_N, t, &ca, &cb);
            wg_wait<0>();
            fence_regs(o);
            fa_fence_u(p);
            if (lane == 0) fa_release<TMA>(empty + 8 * prev_stage);
            fa_rescale(o, ca, cb);
#pragma unroll
            for (int kk = 0; kk < FA_N / 16; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) p[kk][e] = pn[kk][e];
            prev = kst;
            prev_stage = stage;
        }
        fence_regs(o);
        if (PP) asm volatile("bar.sync %0, 256;" ::"r"(turn) : "memory");
        wg_fence();
        fa_issue_pv(o, p, prev);
        wg_commit();
        if (PP && cw == 0) asm volatile("bar.arrive %0, 256;" ::"r"(other) : "memory");
        wg_wait<0>();
        fence_regs(o);
        fa_fence_u(p);
        if (lane == 0) fa_release<TMA>(empty + 8 * prev_stage);
    }

    // Normalise once and write rows ra, rb of head h.
    float sa = r.la, sb = r.lb;
    sa += __shfl_xor_sync(0xffffffffu, sa, 1);
    sa += __shfl_xor_sync(0xffffffffu, sa, 2);
    sb += __shfl_xor_sync(0xffffffffu, sb, 1);
    sb += __shfl_xor_sync(0xffffffffu, sb, 2);
    const float ia = sa > 0.0f ? 1.0f / sa : 0.0f;
    const float ib = sb > 0.0f ? 1.0f / sb : 0.0f;
    const int ra = warp * 16 + g;
    float* oa = a.out + ((u64)(t0 + ra) * H + h) * FA_D;
    float* ob = a.out + ((u64)(t0 + ra + 8) * H + h) * FA_D;
#pragma unroll
    for (int j = 0; j < FA_D / 8; ++j) {
        const int cc = 8 * j + 2 * t;
        const float2 va = make_float2(o[4 * j] * ia, o[4 * j + 1] * ia);
        const float2 vb = make_float2(o[4 * j + 2] * ib, o[4 * j + 3] * ib);
        *reinterpret_cast<float2*>(oa + cc) = va;
        *reinterpret_cast<float2*>(ob + cc) = vb;
        if (a.out_bf16) {
            // The same values rounded to nearest even (as f32_to_bf16): o_proj's GEMM input.
            u16* ba = a.out_bf16 + ((u64)(t0 + ra) * H + h) * FA_D;
            u16* bb = a.out_bf16 + ((u64)(t0 + ra + 8) * H + h) * FA_D;
            *reinterpret_cast<u32*>(ba + cc) = pack_bf16(va.x, va.y);
            *reinterpret_cast<u32*>(bb + cc) = pack_bf16(vb.x, vb.y);
        }
    }
    if (TMA == 2) fa_cluster_sync();
}

#define FA_ENTRY(NAME, HEADS, STAGES, OVERLAP, PP, TMA)                                          \
    extern "C" __global__ void __launch_bounds__(128 * (HEADS + 1), 1)                            \
        NAME(const AttnArgs a, const __grid_constant__ FaMap kmap,                                \
             const __grid_constant__ FaMap vmap) {                                                \
        fa_prefill<HEADS, STAGES, OVERLAP, PP, TMA>(a, &kmap, &vmap);                             \
    }
#define FA_CLUSTER_ENTRY(NAME, HEADS, STAGES, OVERLAP, PP)                                        \
    extern "C" __global__ void __launch_bounds__(128 * (HEADS + 1), 1) __cluster_dims__(1, 2, 1) \
        NAME(const AttnArgs a, const __grid_constant__ FaMap kmap,                                \
             const __grid_constant__ FaMap vmap) {                                                \
        fa_prefill<HEADS, STAGES, OVERLAP, PP, 2>(a, &kmap, &vmap);                               \
    }

#else  // not sm_90a: entry points that are never launched

#define FA_ENTRY(NAME, HEADS, STAGES, OVERLAP, PP, TMA) \
    extern "C" __global__ void NAME(const AttnArgs a, const FaMap kmap, const FaMap vmap) {}
#define FA_CLUSTER_ENTRY(NAME, HEADS, STAGES, OVERLAP, PP) \
    extern "C" __global__ void NAME(const AttnArgs a, const FaMap kmap, const FaMap vmap) {}

#endif

// Builds (ops/attention_wgmma.rs WGMMA_BUILDS, same order): two heads per CTA (one kv head's
// pair; an even GQA group) with 2 or 3 stages, without or with the S/PV overlap, with or without
// ping-pong, copy tiles by cp.async, by TMA, or by TMA multicast over a cluster of two CTAs (the
// kv head's four heads; a group divisible by 4); one head per CTA for odd groups. Shared memory: 1 KiB (alignment) + HEADS x 16 KiB
// (q) + STAGES x 64 KiB + the barriers.
FA_ENTRY(attn_wgmma_h2_s2, 2, 2, false, false, 0)
FA_ENTRY(attn_wgmma_h2_s3, 2, 3, false, false, 0)
FA_ENTRY(attn_wgmma_h2_s3_ov, 2, 3, true, false, 0)
FA_ENTRY(attn_wgmma_h2_s3_ovpp, 2, 3, true, true, 0)
FA_ENTRY(attn_wgmma_h2_s2_ovpp, 2, 2, true, true, 0)
FA_ENTRY(attn_wgmma_h2_s3_ovpp_tma, 2, 3, true, true, 1)
FA_CLUSTER_ENTRY(attn_wgmma_h2_s3_ovpp_cl, 2, 3, true, true)
FA_ENTRY(attn_wgmma_h1_s3, 1, 3, false, false, 0)
FA_ENTRY(attn_wgmma_h1_s3_ov, 1, 3, true, false, 0)
