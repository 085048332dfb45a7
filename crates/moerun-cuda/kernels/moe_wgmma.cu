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

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Wait for the phase of parity `parity` of the barrier to complete.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred P1;\n"
        "WG_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra WG_DONE;\n"
        "bra WG_WAIT;\n"
        "WG_DONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// 16 bytes global -> shared, zero-filled when `valid` is false (nothing is read then).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

// The barrier's pending count drops by one when all of this thread's earlier cp.async are done.
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// ---- pairs of CTAs (a cluster of 2) sharing B through TMA multicast ----

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// Arrive on the barrier at the same shared offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 rank) {
    asm volatile(
        "{\n.reg .b32 ra;\n"
        "mapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
}

// As mbar_wait, acquiring at cluster scope (the arrivals come from both CTAs of the pair).
__device__ __forceinline__ void mbar_wait_cluster(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred P1;\n"
        "WG_CWAIT:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra WG_CDONE;\n"
        "bra WG_CWAIT;\n"
        "WG_CDONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

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

// A K-major operand in the 128-byte swizzle: 8-row core groups 1024 bytes apart (SBO); the
// leading offset is unused in this mode; the tile base is 1024-byte aligned (base offset 0).
__device__ __forceinline__ u64 wg_desc(u32 addr) {
    return (u64)((addr & 0x3ffff) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keep the compiler from moving accumulator reads or writes across the asynchronous wgmma.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wg_mma(float (&d)[64], u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wg_mma(float (&d)[128], u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
        "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
        "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
        "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d));
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
