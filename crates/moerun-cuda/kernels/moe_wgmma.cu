// MoE routed experts, prefill path on Hopper tensor cores (ops/moe/wgmma.rs launches it): the two
// expert projections as grouped GEMMs with wgmma, bf16 operands, f32 accumulation. Pairs are in
// group order q (moe_align's pairs[] / offsets[]); expert e owns rows offsets[e] .. offsets[e+1].
// Group E (ids >= E) is never computed.
//
// - moe_wgmma_gate_up_n<BN>: h[q, j] = bf16(act(g) * u), g = x_t . gate_j and u = x_t . up_j for
//   q's token t, from xb (bf16(x), [n, H]): A rows are gathered by index (cp.async per row).
//   A tile takes BN / 2 gate rows j0.. and the BN / 2 matching up rows I + j0.. as one B tile, so
//   g and u of one (q, j) land in the same thread's accumulators, and the epilogue writes h.
// - moe_wgmma_down_n<BN>: y[q, c] = bf16(h_q . down_c), A = h rows in group order.
//
// Both are "TN" GEMMs: A [rows, K] and the weights W [N, K] are K-major. One CTA of 384 threads
// per SM, persistent: tile t = m_tile * n_tiles + n_tile, m tiles counted over the experts in
// order (each expert ceil(rows / 128) of them), CTA b takes t = b, b + grid, ... The tile list
// comes from offsets[] on the device (a prefix of tile counts in shared memory, built once per
// CTA), so no host sizes are needed. Per tile 128 x BN x K, in K blocks of 64:
// - warpgroup 0, the producer: cp.async 16-byte chunks of A (128 rows) and B
//   (BN rows) into a ring of STAGES shared-memory stages, in the 128-byte swizzled K-major layout
//   wgmma reads (row r, chunk c at r * 128 + 16 * (c ^ (r % 8)); rows or chunks outside the
//   matrix are zero-filled), then cp.async.mbarrier.arrive on the stage's `full` barrier;
// - warpgroups 1 and 2, the consumers: each owns 64 rows x BN; per K block it
//   waits on `full`, issues 4 wgmma m64nBNk16 (descriptors advanced 32 bytes per k16 inside the
//   swizzled rows), and once the previous block's wgmma group has retired (wait_group 1) frees
//   that stage on its `empty` barrier. The epilogue writes straight from the accumulators. A
//   consumer whose 64 rows all lie past the expert's end skips its wgmma (partial last tiles).
// - moe_wgmma_*_pair: clusters of two CTAs share each B tile through TMA multicast (see PAIR).
// No setmaxnreg: 384 threads get 168 registers each, and the BN 256 consumers (128 accumulators)
// fit in that without spilling (ptxas: 161-164); cutting the producer to 40 made it spill.
// The tile order keeps one expert's weights and one A tile hot in L2 across neighbouring CTAs.
//
// wgmma needs sm_90a: compile.rs builds this file for sm_90a on sm_90 devices
// (NVRTC then defines __CUDA_ARCH_FEAT_SM90_ALL); on any other architecture the entry points
// are empty and ops/moe never launches them.

#define WG_BM 128
#define WG_BK 64
#define WG_THREADS 384

// A CUtensorMap, passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) WgMap {
    u64 v[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---- pairs of CTAs (a cluster of 2) sharing B through TMA multicast ----

// A box of the tensor map at (k, row) into `dst` of every CTA in `mask`, each completing its
// bytes on the barrier at the same offset in its own shared memory.
__device__ __forceinline__ void tma_multicast(u32 dst, const WgMap* map, int k, int row, u32 bar,
                                              u16 mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(k), "r"(row), "r"(bar), "h"(mask)
        : "memory");
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                     : "memory");
}

// A consumer warp frees a stage: its own CTA's `empty`, or with pairs both CTAs' (the partner's
// producer multicasts into this CTA's stage too).
template <bool PAIR>
__device__ __forceinline__ void wg_release(u32 empty) {
    if (PAIR) {
        mbar_arrive_cluster(empty, 0);
        mbar_arrive_cluster(empty, 1);
    } else {
        mbar_arrive(empty);
    }
}

// The m tile `t / n_tiles` of the tile list: expert e (the last whose first tile is <= it), its
// rows m0 .. mend, and the first output column c0 of n tile `t % n_tiles`.
struct WgTile {
    int e;
    u32 m0, mend;
    int c0;
};

// With pairs, entry m of the list is a pair of m tiles of one expert and CTA `rank` of the pair
// takes the rank-th (its rows start past mend when the expert's tile count is odd: it then loads
// no A, computes zeros and stores nothing, but still multicasts its half of B).
template <bool PAIR>
__device__ __forceinline__ WgTile wg_locate(u32 t, u32 n_tiles, int n_out, const u32* tstart,
                                            const u32* __restrict__ offsets, int experts,
                                            u32 rank) {
    const u32 m_tile = t / n_tiles;
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tstart[mid] <= m_tile) lo = mid;
        else hi = mid - 1;
    }
    WgTile tile;
    tile.e = lo;
    const u32 local = PAIR ? 2 * (m_tile - tstart[lo]) + rank : m_tile - tstart[lo];
    tile.m0 = offsets[lo] + local * WG_BM;
    tile.mend = offsets[lo + 1];
    tile.c0 = (int)(t % n_tiles) * n_out;
    return tile;
}

// GATED: A = xb rows gathered through pairs[] (token = pair / top_k), W = gate_up [E][2I][K],
// out = h [P][I] (n_rows = I), epilogue act(g) * u. Else: A = h [P][K] in group order,
// W = down [E][H][K], out = y [P][H] (n_rows = H).
// PAIR: CTAs 2c and 2c + 1 (a cluster) take the two m tiles of one pair entry with the same n
// tile, so they need the same B tile: each loads half of it with TMA (gated: rank 0 the gate
// rows, rank 1 the up rows; else rank r rows 128 r ..) and multicasts it to both. A stage is then
// refilled only once the consumers of both CTAs released it (16 arrivals on `empty`); `full`
// counts the 128 cp.async arrivals of A plus one expect_tx for the B bytes.
template <int BN, int STAGES, bool GATED, bool PAIR>
__device__ __forceinline__ void wg_grouped(const u16* __restrict__ a, const u32* __restrict__ pairs,
                                           const u32* __restrict__ offsets,
                                           const u16* __restrict__ w, u16* __restrict__ out,
                                           int experts, int K, int n_rows, int top_k, int act,
                                           const WgMap* bmap) {
    constexpr u32 A_BYTES = WG_BM * 128;
    constexpr u32 B_BYTES = BN * 128;
    constexpr u32 STAGE = A_BYTES + B_BYTES;
    constexpr int N_OUT = GATED ? BN / 2 : BN;  // output columns per tile
    extern __shared__ unsigned char wg_smem[];
    const u32 raw = smem_u32(wg_smem);
    const u32 base = (raw + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
    const u32 bars = base + STAGES * STAGE;   // full[s] at bars + 8 s, empty[s] after them
    u32* tstart = reinterpret_cast<u32*>(wg_smem + (base - raw) + STAGES * STAGE + 16 * STAGES);
    const int tid = threadIdx.x;
    const u32 rank = PAIR ? (blockIdx.x & 1u) : 0u;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            // Every producer thread via cp.async (and the B expect_tx with pairs); lane 0 of each
            // consumer warp (of both CTAs with pairs).
            mbar_init(bars + 8 * s, PAIR ? 129 : 128);
            mbar_init(bars + 8 * (STAGES + s), PAIR ? 16 : 8);
        }
        if (PAIR) asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (tid < 32) {
        // First m tile of each expert: a running scan of ceil(rows / 128), 32 experts at a time.
        u32 carry = 0;
        for (int e0 = 0; e0 < experts; e0 += 32) {
            const int e = e0 + tid;
            u32 v = e < experts ? (offsets[e + 1] - offsets[e] + WG_BM - 1) / WG_BM : 0u;
            if (PAIR) v = (v + 1) / 2;
            u32 inc = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 s = __shfl_up_sync(0xffffffffu, inc, o);
                if (tid >= o) inc += s;
            }
            if (e < experts) tstart[e] = carry + inc - v;
            carry += __shfl_sync(0xffffffffu, inc, 31);
        }
        if (tid == 0) tstart[experts] = carry;
    }
    __syncthreads();
    if (PAIR) cluster_sync();  // the partner's barriers exist before anything reaches them
    const u32 first = PAIR ? blockIdx.x / 2 : blockIdx.x;
    const u32 step = PAIR ? gridDim.x / 2 : gridDim.x;

    const u32 n_tiles = (u32)((n_rows + N_OUT - 1) / N_OUT);
    const u32 tiles = tstart[experts] * n_tiles;
    const int kblocks = (K + WG_BK - 1) / WG_BK;
    const int wg = tid / 128;
    int stage = 0;
    u32 phase = 0;

    if (wg == 0) {
        // ---- producer ----
        const int c = tid & 7, r0 = tid >> 3;      // 16-byte chunk of the row, first row
        const u32 sw = (u32)((c ^ (r0 & 7)) << 4);  // rows r0 + 16 i share r % 8
        for (u32 t = first; t < tiles; t += step) {
            const WgTile tile = wg_locate<PAIR>(t, n_tiles, N_OUT, tstart, offsets, experts, rank);
            u32 aoff[WG_BM / 16];
            u32 amask = 0;
#pragma unroll
            for (int i = 0; i < WG_BM / 16; ++i) {
                const u32 q = tile.m0 + r0 + 16 * i;
                const bool ok = q < tile.mend;
                aoff[i] = ok ? (GATED ? pairs[q] / (u32)top_k : q) * (u32)K : 0u;
                amask |= (u32)ok << i;
            }
            const u16* wb = w + (u64)tile.e * (GATED ? 2 : 1) * n_rows * K;
            for (int kb = 0; kb < kblocks; ++kb) {
                if (PAIR) mbar_wait_cluster(bars + 8 * (STAGES + stage), phase ^ 1);
                else mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);
                const int k = kb * WG_BK + c * 8;
                const bool kok = k < K;
                const u32 sa = base + stage * STAGE + r0 * 128 + sw;
                const u32 sb = sa + A_BYTES;
#pragma unroll
                for (int i = 0; i < WG_BM / 16; ++i) {
                    const bool ok = kok && ((amask >> i) & 1u);
                    cp_async16(sa + i * 16 * 128, ok ? a + aoff[i] + k : a, ok);
                }
                if (PAIR) {
                    if (tid == 0) {
                        const u32 full = bars + 8 * stage;
                        mbar_expect_tx(full, B_BYTES);
                        const int row = GATED ? (tile.e * 2 + (int)rank) * n_rows + tile.c0
                                              : tile.e * n_rows + tile.c0 + (int)rank * (BN / 2);
                        tma_multicast(base + stage * STAGE + A_BYTES + rank * (B_BYTES / 2), bmap,
                                      kb * WG_BK, row, full, (u16)3);
                    }
                } else {
#pragma unroll
                for (int i = 0; i < BN / 16; ++i) {
                    const int rr = r0 + 16 * i;
                    int j, row;
                    if (GATED) {
                        const int up = i >= BN / 32;  // second half of the B tile: up rows
                        j = tile.c0 + rr - up * (BN / 2);
                        row = up * n_rows + j;
                    } else {
                        j = tile.c0 + rr;
                        row = j;
                    }
                    const bool ok = kok && j < n_rows;
                    cp_async16(sb + i * 16 * 128, ok ? wb + (u64)row * K + k : wb, ok);
                }
                }
                cp_async_arrive(bars + 8 * stage);
                if (++stage == STAGES) {
                    stage = 0;
                    phase ^= 1;
                }
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
    } else {
        // ---- consumers ----
        const int cw = wg - 1;  // rows 64 cw .. of the tile
        const int warp = (tid >> 5) & 3, lane = tid & 31;
        float d[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
        for (u32 t = first; t < tiles; t += step) {
            const WgTile tile = wg_locate<PAIR>(t, n_tiles, N_OUT, tstart, offsets, experts, rank);
            int prev = -1;
            // A warpgroup whose 64 rows are all past the expert's end (the last tile of an
            // expert holds 1-64 rows, or a pair's idle CTA) issues no wgmma: the tensor cores
            // are the bottleneck, and zero rows are pure waste. It still waits and frees stages.
            const bool busy = tile.m0 + cw * 64 < tile.mend;
            for (int kb = 0; kb < kblocks; ++kb) {
                mbar_wait(bars + 8 * stage, phase);
                if (busy) {
                    // cp.async wrote the stage through the generic proxy; wgmma reads it through
                    // the async proxy.
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                    const u32 sa = base + stage * STAGE + cw * 64 * 128;
                    const u32 sb = base + stage * STAGE + A_BYTES;
                    fence_regs(d);
                    wg_fence();
#pragma unroll
                    for (int kk = 0; kk < WG_BK / 16; ++kk)
                        wg_mma(d, wg_desc(sa + 32 * kk), wg_desc(sb + 32 * kk), (kb | kk) != 0);
                    wg_commit();
                    wg_wait<1>();
                    fence_regs(d);
                }
                if (prev >= 0 && lane == 0) wg_release<PAIR>(bars + 8 * (STAGES + prev));
                prev = stage;
                if (++stage == STAGES) {
                    stage = 0;
                    phase ^= 1;
                }
            }
            wg_wait<0>();
            fence_regs(d);
            if (prev >= 0 && lane == 0) wg_release<PAIR>(bars + 8 * (STAGES + prev));
            if (!busy) continue;

            // Epilogue: thread (warp, lane) holds rows 16 warp + lane / 4 (+ 8) of its 64, columns
            // 8 j + 2 (lane % 4) (+ 1) of block j.
            const int col = tile.c0 + 2 * (lane & 3);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 q = tile.m0 + cw * 64 + warp * 16 + (lane >> 2) + 8 * half;
                if (q >= tile.mend) continue;
                u16* orow = out + (u64)q * n_rows;
#pragma unroll
                for (int j = 0; j < N_OUT / 8; ++j) {
                    const int cc = col + 8 * j;
                    if (cc >= n_rows) continue;
                    float v0 = d[4 * j + 2 * half], v1 = d[4 * j + 2 * half + 1];
                    if (GATED) {
                        const int uj = 4 * (j + BN / 16) + 2 * half;
                        v0 = expert_act(v0, act) * d[uj];
                        v1 = expert_act(v1, act) * d[uj + 1];
                    }
                    *reinterpret_cast<u32*>(orow + cc) =
                        (u32)f32_to_bf16(v0) | ((u32)f32_to_bf16(v1) << 16);
                }
            }
        }
    }
    // Neither CTA of a pair may leave while the other can still multicast into it or arrive on
    // its barriers.
    if (PAIR) cluster_sync();
}

#define WG_ENTRY(NAME, BN, STAGES, GATED)                                                         \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)                                  \
        NAME(const u16* __restrict__ a, const u32* __restrict__ pairs,                           \
             const u32* __restrict__ offsets, const u16* __restrict__ w, u16* __restrict__ out,  \
             int experts, int K, int n_rows, int top_k, int act) {                               \
        wg_grouped<BN, STAGES, GATED, false>(a, pairs, offsets, w, out, experts, K, n_rows,      \
                                             top_k, act, nullptr);                               \
    }
// Pairs: the B tile comes from `bmap` (a 2-D map of the stacked weights, rows x K, boxes of 128
// rows x 64, 128-byte swizzle); `w` is unused.
#define WG_PAIR_ENTRY(NAME, BN, STAGES, GATED)                                                    \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) __cluster_dims__(2, 1, 1)        \
        NAME(const u16* __restrict__ a, const u32* __restrict__ pairs,                           \
             const u32* __restrict__ offsets, const u16* __restrict__ w, u16* __restrict__ out,  \
             int experts, int K, int n_rows, int top_k, int act,                                 \
             const __grid_constant__ WgMap bmap) {                                               \
        wg_grouped<BN, STAGES, GATED, true>(a, pairs, offsets, w, out, experts, K, n_rows,       \
                                            top_k, act, &bmap);                                  \
    }

#else  // not sm_90a: entry points that are never launched (ops/moe checks the architecture)

#define WG_ENTRY(NAME, BN, STAGES, GATED)                                                         \
    extern "C" __global__ void NAME(const u16* a, const u32* pairs, const u32* offsets,          \
                                    const u16* w, u16* out, int experts, int K, int n_rows,      \
                                    int top_k, int act) {}
#define WG_PAIR_ENTRY(NAME, BN, STAGES, GATED)                                                    \
    extern "C" __global__ void NAME(const u16* a, const u32* pairs, const u32* offsets,          \
                                    const u16* w, u16* out, int experts, int K, int n_rows,      \
                                    int top_k, int act, const WgMap bmap) {}

#endif

// Stages: 5 x 32 KiB for BN 128, 4 x 48 KiB for BN 256 (wgmma.rs sizes the shared memory).
WG_ENTRY(moe_wgmma_gate_up_n128, 128, 5, true)
WG_ENTRY(moe_wgmma_gate_up_n256, 256, 4, true)
WG_ENTRY(moe_wgmma_down_n128, 128, 5, false)
WG_ENTRY(moe_wgmma_down_n256, 256, 4, false)
WG_PAIR_ENTRY(moe_wgmma_gate_up_pair, 256, 4, true)
WG_PAIR_ENTRY(moe_wgmma_down_pair, 256, 4, false)
