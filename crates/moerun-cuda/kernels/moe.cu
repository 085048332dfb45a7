// MoE routed experts, decode / small-batch path (ops/moe/decode.rs launches it). One layer's
// experts are stacked: gate_up [E][2I][H] (per expert its I gate rows, then its I up rows) and
// down [E][H][I], in the stored dtype; activations are f32 and every sum accumulates in f32.
// A pair p = t * k + r is token t's rank-r expert. Pairs whose id is out of range (>= E) form
// group E: no expert runs for them and their token's output becomes NaN (loud, never a silently
// wrong sum).
//
// Three launches, none of which reads device data to size itself (CUDA-graph friendly):
// 1. moe_align: one block of 1024 threads. Counts the pairs of each group in shared memory,
//    scans them into offsets[E + 2], lists each group's pairs contiguously in pairs[] (pos[p] is
//    pair p's place there), compacts the non-empty groups ascending into active[0..S) (MOE_NONE
//    after them), and zeroes the arrival counters of the down launch.
// 2. moe_gate_up_<dt>_m<M>: grid (ceil(I / 8), S), block 256. Block (bx, s) works for group
//    active[s] (exits at once when there is none); its warp w owns intermediate index
//    j = 8 bx + w and streams gate row j and up row j once for all of the group's tokens, up to
//    M tokens per pass, writing h[p, j] = act(gate . x_t) * (up . x_t), act SiLU or GELU-tanh
//    (the `act` argument, see expert_act in common.cuh).
// 3. moe_down_<dt>_m<M>: grid (ceil(H / 32), S), block 256. Warp w of block (bx, s) owns down rows
//    32 bx + 4 w .. + 4 and streams them once for all of the group's tokens: y[p, row] = down_row .
//    h[p]. After each pass the block counts, per token, one arrival on its row tile; the block
//    that brings a token's k-th arrival sums that tile of out[t] = sum_r weights[t, r] y[t k + r]
//    in rank order r = 0..k, so the combine needs no launch of its own and stays deterministic.
// M (1, 4 or 8) is the most tokens a pass takes; an expert with more runs several passes. Each
// variant has its own __launch_bounds__ minimum of blocks per SM (4, 2, 1), i.e. a register
// budget of 64, 128, 255: a pass of M tokens keeps M x rows accumulators live.
// At most 32 pairs take the two tiny kernels at the end of this file instead (no alignment).
//
// Every dot product is one fmaf chain per lane over its chunks in ascending order, then a fixed
// butterfly: a token's result depends on its row and the weights alone, never on how many tokens
// share its expert or which pass slot it lands in. The decode path is batch invariant, bit for bit.

#define MOE_WARPS 8
#define MOE_THREADS (32 * MOE_WARPS)
#define MOE_NONE 0xffffffffu
#define MOE_GU_UNROLL 4      // 16-byte chunks in flight per row per lane, gate_up
#ifndef MOE_TINY_NORM_U
// moe_tiny_gate_up_norm's chunks in flight per row per lane. 2: a 2048-wide row is 256 chunks,
// 4 whole steps of 64; 3 left a third of the last step idle and measured 2.8% slower at batch-1
// decode (docs/perf/cuda-model.md v26); 4 spills.
#define MOE_TINY_NORM_U 2
#endif
#define MOE_DOWN_ROWS 4      // down rows per warp
#define MOE_DOWN_UNROLL 2    // 16-byte chunks in flight per row per lane, down
#define MOE_DOWN_TILE (MOE_WARPS * MOE_DOWN_ROWS)  // down rows per block: one arrival counter each
#define MOE_MAX_M 8

// ---- 1. alignment ----

extern "C" __global__ void __launch_bounds__(1024)
    moe_align(const u32* __restrict__ ids, int pairs_n, int experts, int slots, int clear_n,
              u32* __restrict__ offsets, u32* __restrict__ pairs, u32* __restrict__ pos,
              u32* __restrict__ active, u32* __restrict__ arrivals) {
    extern __shared__ u32 moe_shared[];
    __shared__ u32 active_n;
    const int groups = experts + 1;  // group `experts`: out-of-range ids
    u32* count = moe_shared;
    u32* cursor = moe_shared + groups;
    const int tid = threadIdx.x;
    for (int g = tid; g < groups; g += blockDim.x) count[g] = 0;
    for (int i = tid; i < clear_n; i += blockDim.x) arrivals[i] = 0;
    __syncthreads();
    for (int p = tid; p < pairs_n; p += blockDim.x) atomicAdd(&count[min(ids[p], (u32)experts)], 1u);
    __syncthreads();
    if (tid < 32) {
        // Warp 0: lane l owns a contiguous run of groups; warp scans of the runs' pair counts and
        // non-empty counts give each group its offset and each non-empty group its slot.
        const int per = (groups + 31) / 32;
        const int g0 = min(tid * per, groups);
        const int g1 = min(g0 + per, groups);
        u32 sum = 0, nonempty = 0;
        for (int g = g0; g < g1; ++g) {
            sum += count[g];
            nonempty += count[g] != 0u;
        }
        u32 sum_inc = sum, ne_inc = nonempty;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 s = __shfl_up_sync(0xffffffffu, sum_inc, o);
            const u32 n = __shfl_up_sync(0xffffffffu, ne_inc, o);
            if (tid >= o) {
                sum_inc += s;
                ne_inc += n;
            }
        }
        u32 run = sum_inc - sum;
        u32 slot = ne_inc - nonempty;
        for (int g = g0; g < g1; ++g) {
            offsets[g] = run;
            cursor[g] = run;
            if (count[g] != 0u) active[slot++] = (u32)g;  // slot < min(groups, pairs_n) <= slots
            run += count[g];
        }
        if (tid == 31) {
            offsets[groups] = run;  // == pairs_n
            active_n = ne_inc;
        }
    }
    __syncthreads();
    for (int s = (int)active_n + tid; s < slots; s += blockDim.x) active[s] = MOE_NONE;
    // Order inside a group follows the atomics; nothing downstream depends on it (each pair is
    // computed alone, see the file comment).
    for (int p = tid; p < pairs_n; p += blockDim.x) {
        const u32 at = atomicAdd(&cursor[min(ids[p], (u32)experts)], 1u);
        pairs[at] = (u32)p;
        pos[p] = at;
    }
}

// ---- shared by 2. and 3. ----

// w[r] . x[m] over `chunks` 16-byte chunks of weights, by one warp: lane l takes chunks l,
// l + 32, ..., U of them in flight per row, each widened once and applied to all M rows of x.
// Every output is one fmaf chain per lane in a fixed order, then warp_sum's tree, by a
// reduce-scatter (common.cuh): lane l ends with tot[0 .. KEEP) = the totals of values
// scatter_first<M * R, KEEP>(l) onwards, value m * R + r being x[m] . w[r]. KEEP = M * R: every
// lane all of them, by one warp_sum each.
// WAIT: the first step's weights are issued before the kernel waits for the one before it
// (programmatic dependent launch, common.cuh); x is only read after. Same steps, same order.
// after_wait: called right after the wait (WAIT): to start loads of the kernel before's output,
// or to stage the activations (moe_tiny_gate_up_norm; every warp of the block calls it).
struct MoeNoHook {
    __device__ void operator()() const {}
};
// Chunk c of an activation row (C::N floats), as float4 loads.
template <typename C>
__device__ __forceinline__ void moe_x_chunk(const float* x, int c, float (&xv)[C::N]) {
    const float4* xp = reinterpret_cast<const float4*>(x + (u64)c * C::N);
#pragma unroll
    for (int v = 0; v < C::N / 4; ++v) {
        const float4 t = xp[v];
        xv[4 * v] = t.x;
        xv[4 * v + 1] = t.y;
        xv[4 * v + 2] = t.z;
        xv[4 * v + 3] = t.w;
    }
}
// ROW_AT_A_TIME (one token): each chunk's rows widened one at a time (the same fmaf chains).
template <typename C, int M, int R, int U, int KEEP, bool WAIT = false, typename Hook = MoeNoHook,
          bool ROW_AT_A_TIME = false>
__device__ __forceinline__ void moe_warp_rows(const uint4* const (&w)[R], const float* const (&x)[M],
                                              int chunks, float (&tot)[KEEP],
                                              const Hook& after_wait = Hook{}) {
    const int lane = threadIdx.x & 31;
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    uint4 q[U][R];
    // early: before the programmatic wait (load_stream_early says why it differs).
    auto load = [&](int c0, bool early) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
#pragma unroll
            for (int r = 0; r < R; ++r)
                q[u][r] = c >= chunks ? make_uint4(0u, 0u, 0u, 0u)
                          : early     ? load_stream_early(w[r] + c)
                                      : load_stream(w[r] + c);
        }
    };
    auto step = [&](int c0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c < chunks && M == 1 && ROW_AT_A_TIME) {
                // One row widened at a time: 8 floats live where R x 8 were, registers that
                // hold more chunks in flight instead.
                float xv[C::N];
                moe_x_chunk<C>(x[0], c, xv);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float f[C::N];
                    C::widen(q[u][r], f);
#pragma unroll
                    for (int i = 0; i < C::N; ++i) acc[0][r] = fmaf(f[i], xv[i], acc[0][r]);
                }
            } else if (c < chunks) {
                float f[R][C::N];
#pragma unroll
                for (int r = 0; r < R; ++r) C::widen(q[u][r], f[r]);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    float xv[C::N];
                    moe_x_chunk<C>(x[m], c, xv);
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int i = 0; i < C::N; ++i) acc[m][r] = fmaf(f[r][i], xv[i], acc[m][r]);
                }
            }
        }
    };
    if constexpr (WAIT) {
        int c0 = lane;
        load(c0, true);
        pdl_entry();
        after_wait();
        while (c0 < chunks) {
            step(c0);
            c0 += 32 * U;
            if (c0 < chunks) load(c0, false);
        }
    } else {
        for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
            load(c0, false);
            step(c0);
        }
    }
    if constexpr (KEEP == M * R) {
        // Every total in every lane: one butterfly per total (the batch-1 tiny kernels).
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) tot[m * R + r] = warp_sum(acc[m][r]);
    } else {
        float sums[M * R];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) sums[m * R + r] = acc[m][r];
        warp_reduce_scatter<M * R, KEEP>(sums, lane);
#pragma unroll
        for (int j = 0; j < KEEP; ++j) tot[j] = sums[j];
    }
}

// The pairs of one pass: `taken` (1..M) real ones; the slots after them repeat the last, so every
// load stays in bounds, and are never written.
template <int M>
__device__ __forceinline__ void moe_pass_pairs(const u32* __restrict__ list, int taken, u32 (&p)[M]) {
#pragma unroll
    for (int m = 0; m < M; ++m) p[m] = list[min(m, taken - 1)];
}

// ---- 2. gate_up + SiLU * up ----

// The warp's JW intermediate indices j .. j + JW (those < inter): gate and up rows of each, one
// fmaf chain per row exactly as with one index per warp, so JW changes no bit of h.
// KEEP: totals per lane (moe_warp_rows): 2, a gate and an up each (several tokens: the
// reduce-scatter), or all M x 2 JW (the batch-1 tiny kernel: butterflies, as before the
// reduce-scatter, which lost 0.7-1% of batch-1 decode; docs/perf/cuda-model.md v13).
// The add+norm fold's inputs (moe_tiny_gate_up_norm): the residual x, the added r, the norm's
// weights and eps, and the shared-memory row the block stages s * nw into (s = x + r).
struct MoeNormIn {
    const float* x;
    const float* r;
    const float* nw;
    float eps;
    float* xs;
};

// Stage one token's s * nw (s = x + r) into the block's shared row `xs` (and s into x_out where
// set), and return the norm's inv = 1 / sqrt(mean(s^2) + eps). Thread t takes float4s t,
// t + 256, ..., its squares summed in that order, then warp_sum's tree, then the warps in order:
// the same inv in every block of the launch. Every thread of the block calls it (a barrier): the
// row's loads are issued once, together, instead of one L1/L2 round trip per chunk step.
__device__ __forceinline__ float moe_stage_norm(const MoeNormIn& n, int hidden, float* x_out) {
    __shared__ float parts[MOE_WARPS];
    const int tid = threadIdx.x;
    float ss = 0.0f;
#pragma unroll 2
    for (int c = tid; c < hidden / 4; c += MOE_THREADS) {
        const u64 o = 4 * (u64)c;
        const float4 xx = *reinterpret_cast<const float4*>(n.x + o);
        const float4 rr = *reinterpret_cast<const float4*>(n.r + o);
        const float4 nn = *reinterpret_cast<const float4*>(n.nw + o);
        const float4 t = make_float4(xx.x + rr.x, xx.y + rr.y, xx.z + rr.z, xx.w + rr.w);
        if (x_out != nullptr) *reinterpret_cast<float4*>(x_out + o) = t;
        ss = __fmaf_rn(t.x, t.x, ss);
        ss = __fmaf_rn(t.y, t.y, ss);
        ss = __fmaf_rn(t.z, t.z, ss);
        ss = __fmaf_rn(t.w, t.w, ss);
        *reinterpret_cast<float4*>(n.xs + o) =
            make_float4(t.x * nn.x, t.y * nn.y, t.z * nn.z, t.w * nn.w);
    }
    ss = warp_sum(ss);
    if ((tid & 31) == 0) parts[tid >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int w = 0; w < MOE_WARPS; ++w) tot += parts[w];
    return 1.0f / sqrtf(tot / (float)hidden + n.eps);
}

// NORM (one token, WAIT): the rows run against the block's staged s * nw (moe_stage_norm, right
// after the wait; `x` is ignored), and gate and up are inv times their sums.
template <typename C, int M, int JW = 1, int KEEP = 2, bool NORM = false, bool WAIT = false>
__device__ __forceinline__ void moe_gate_up_pass(const uint4* wg, const uint4* wu,
                                                 const float* __restrict__ x, const u32 (&p)[M],
                                                 int taken, int top_k, int hidden, int inter, int j,
                                                 float* __restrict__ h, int act,
                                                 const MoeNormIn& nrm = MoeNormIn{}) {
    static_assert(!NORM || (M == 1 && WAIT), "the norm fold is one token's, staged after the wait");
    const float* xr[M];
#pragma unroll
    for (int m = 0; m < M; ++m) xr[m] = NORM ? nrm.xs : x + (u64)(p[m] / (u32)top_k) * hidden;
    const int chunks = hidden / C::N;
    const uint4* w[2 * JW];
#pragma unroll
    for (int jw = 0; jw < JW; ++jw) {
        const int jj = min(jw, inter - 1 - j);  // in bounds; rows past inter are never written
        w[2 * jw] = wg + (u64)jj * chunks;
        w[2 * jw + 1] = wu + (u64)jj * chunks;
    }
    // The gate and up totals of (m, jw) are values 2 q and 2 q + 1, q = m JW + jw.
    float gu[KEEP];
    // The same bytes in flight per lane for any JW: 2 JW rows x MOE_GU_UNROLL / JW chunks.
    if constexpr (NORM) {
        float inv = 0.0f;
        const auto stage = [&] { inv = moe_stage_norm(nrm, hidden, nullptr); };
        moe_warp_rows<C, M, 2 * JW, MOE_TINY_NORM_U, KEEP, true, decltype(stage), true>(
            w, xr, chunks, gu, stage);
#pragma unroll
        for (int i = 0; i < KEEP; ++i) gu[i] *= inv;
    } else {
        moe_warp_rows<C, M, 2 * JW, MOE_GU_UNROLL / JW, KEEP>(w, xr, chunks, gu);
    }
    constexpr int NV = M * 2 * JW;
    const int lane = threadIdx.x & 31;
    if constexpr (KEEP == NV) {
        // Every lane holds every total: lane q writes q's.
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int jw = 0; jw < JW; ++jw) {
                const int q = m * JW + jw;
                if (lane == q && m < taken && j + jw < inter)
                    h[(u64)p[m] * inter + j + jw] = expert_act(gu[2 * q], act) * gu[2 * q + 1];
            }
        }
        return;
    }
    const int q = scatter_first<NV, 2>(lane) / 2;
    if (scatter_writer<NV, 2>(lane)) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int jw = 0; jw < JW; ++jw) {
                if (q == m * JW + jw && m < taken && j + jw < inter)
                    h[(u64)p[m] * inter + j + jw] = expert_act(gu[0], act) * gu[1];
            }
        }
    }
}

// One pass over `taken` pairs of an expert's list.
template <typename C, int M>
__device__ __forceinline__ void moe_gate_up_list(const uint4* wg, const uint4* wu,
                                                 const float* __restrict__ x, const u32* list,
                                                 int taken, int top_k, int hidden, int inter, int j,
                                                 float* __restrict__ h, int act) {
    u32 p[M];
    moe_pass_pairs<M>(list, taken, p);
    moe_gate_up_pass<C, M>(wg, wu, x, p, taken, top_k, hidden, inter, j, h, act);
}

template <typename C, int MAXM>
__device__ __forceinline__ void moe_gate_up(const void* __restrict__ gate_up,
                                            const float* __restrict__ x,
                                            const u32* __restrict__ offsets,
                                            const u32* __restrict__ pairs,
                                            const u32* __restrict__ active, float* __restrict__ h,
                                            int experts, int hidden, int inter, int top_k,
                                            int act) {
    const u32 e = active[blockIdx.y];
    if (e >= (u32)experts) return;  // no group here, or the out-of-range group; no barriers below
    const int j = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    if (j >= inter) return;
    const u64 chunks = (u64)(hidden / C::N);
    const uint4* base = reinterpret_cast<const uint4*>(gate_up) + (u64)e * 2 * inter * chunks;
    const uint4* wg = base + (u64)j * chunks;
    const uint4* wu = base + (u64)(inter + j) * chunks;
    const u32 end = offsets[e + 1];
    for (u32 at = offsets[e]; at < end;) {
        const int rem = (int)(end - at);
        const u32* list = pairs + at;
        if constexpr (MAXM >= 8) {
            if (rem > 4) {
                const int n = min(rem, 8);
                moe_gate_up_list<C, 8>(wg, wu, x, list, n, top_k, hidden, inter, j, h, act);
                at += n;
                continue;
            }
        }
        if constexpr (MAXM >= 4) {
            if (rem > 2) {
                const int n = min(rem, 4);
                moe_gate_up_list<C, 4>(wg, wu, x, list, n, top_k, hidden, inter, j, h, act);
                at += n;
                continue;
            }
        }
        if constexpr (MAXM >= 2) {
            if (rem > 1) {
                moe_gate_up_list<C, 2>(wg, wu, x, list, 2, top_k, hidden, inter, j, h, act);
                at += 2;
                continue;
            }
        }
        moe_gate_up_list<C, 1>(wg, wu, x, list, 1, top_k, hidden, inter, j, h, act);
        at += 1;
    }
}

#define MOE_GATE_UP_KERNEL(NAME, CHUNK, MAXM, MINB)                                                  \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MINB)                              \
        NAME(const void* gate_up, const float* x, const u32* offsets, const u32* pairs,          \
             const u32* active, float* h, int experts, int hidden, int inter, int top_k,         \
             int act) {                                                                          \
        moe_gate_up<CHUNK, MAXM>(gate_up, x, offsets, pairs, active, h, experts, hidden, inter,  \
                                 top_k, act);                                                    \
    }

MOE_GATE_UP_KERNEL(moe_gate_up_bf16_m1, ChunkBf16, 1, 4)
MOE_GATE_UP_KERNEL(moe_gate_up_bf16_m4, ChunkBf16, 4, 2)
MOE_GATE_UP_KERNEL(moe_gate_up_bf16_m8, ChunkBf16, 8, 1)
MOE_GATE_UP_KERNEL(moe_gate_up_f16_m1, ChunkF16, 1, 4)
MOE_GATE_UP_KERNEL(moe_gate_up_f16_m4, ChunkF16, 4, 2)
MOE_GATE_UP_KERNEL(moe_gate_up_f16_m8, ChunkF16, 8, 1)
// f32 rows at 64 registers spilled a word: this one gets 128.
MOE_GATE_UP_KERNEL(moe_gate_up_f32_m1, ChunkF32, 1, 2)
MOE_GATE_UP_KERNEL(moe_gate_up_f32_m4, ChunkF32, 4, 2)
MOE_GATE_UP_KERNEL(moe_gate_up_f32_m8, ChunkF32, 8, 1)

// ---- 3. down + rank-order combine ----

// tot[0] = row row0 + r of the expert's down matrix at wexp . h[p[m]], for the value
// m * MOE_DOWN_ROWS + r = scatter_first<M * MOE_DOWN_ROWS>(lane) this lane ends with
// (moe_warp_rows), for rows_here >= 1 rows; NaN for the out-of-range group (wexp null), so its
// tokens' sums become NaN too.
// KEEP = M * MOE_DOWN_ROWS: every total in every lane (butterflies; the batch-1 tiny kernel).
template <typename C, int M, bool WAIT = false, int KEEP = 1, typename Hook = MoeNoHook>
__device__ __forceinline__ void moe_down_rows(const uint4* wexp, const float* __restrict__ h,
                                              const u32 (&p)[M], int inter, int row0,
                                              int rows_here, float (&tot)[KEEP],
                                              const Hook& after_wait = Hook{}) {
    if (wexp == nullptr) {
        if (WAIT) {
            pdl_entry();
            after_wait();
        }
#pragma unroll
        for (int i = 0; i < KEEP; ++i) tot[i] = __int_as_float(0x7fffffff);
    } else {
        const int chunks = inter / C::N;
        const float* xr[M];
#pragma unroll
        for (int m = 0; m < M; ++m) xr[m] = h + (u64)p[m] * inter;
        const uint4* w[MOE_DOWN_ROWS];
#pragma unroll
        for (int r = 0; r < MOE_DOWN_ROWS; ++r)
            w[r] = wexp + (u64)(row0 + min(r, rows_here - 1)) * chunks;  // in bounds; unused rows
        moe_warp_rows<C, M, MOE_DOWN_ROWS, MOE_DOWN_UNROLL, KEEP, WAIT, Hook>(w, xr, chunks, tot,
                                                                             after_wait);
    }
}

template <typename C, int M>
__device__ __forceinline__ void moe_down_pass(const uint4* wexp, const float* __restrict__ h,
                                              const u32* list, int taken, int hidden, int inter,
                                              int row0, int rows_here, float* __restrict__ y) {
    if (rows_here <= 0) return;  // warp-uniform: this warp's rows are past the end
    u32 p[M];
    moe_pass_pairs<M>(list, taken, p);
    float tot[1];
    moe_down_rows<C, M>(wexp, h, p, inter, row0, rows_here, tot);
    constexpr int NV = M * MOE_DOWN_ROWS;
    const int lane = threadIdx.x & 31;
    const int v = scatter_first<NV>(lane);
    const int m = v / MOE_DOWN_ROWS;
    const int r = v % MOE_DOWN_ROWS;
    // The pair from the list again (p[m] at a lane-dependent m would put p in local memory).
    if (scatter_writer<NV>(lane) && m < taken && r < rows_here)
        y[(u64)list[m] * hidden + row0 + r] = tot[0];
}

template <typename C, int MAXM>
__device__ __forceinline__ void moe_down(const void* __restrict__ down, const float* __restrict__ h,
                                         const u32* __restrict__ offsets,
                                         const u32* __restrict__ pairs,
                                         const u32* __restrict__ active,
                                         const float* __restrict__ weights, float* __restrict__ y,
                                         float* __restrict__ out, u32* __restrict__ arrivals,
                                         int experts, int hidden, int inter, int top_k) {
    __shared__ u32 done[MOE_MAX_M];  // tokens of this pass whose k ranks have all arrived
    __shared__ int done_n;
    const u32 g = active[blockIdx.y];
    if (g == MOE_NONE) return;  // block-uniform, before any barrier
    const int warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * MOE_DOWN_TILE + warp * MOE_DOWN_ROWS;
    const int rows_here = min(MOE_DOWN_ROWS, hidden - row0);
    const uint4* wexp = g < (u32)experts
                            ? reinterpret_cast<const uint4*>(down) + (u64)g * hidden * (inter / C::N)
                            : nullptr;
    const u64 tiles = gridDim.x;
    const u32 end = offsets[g + 1];
    for (u32 at = offsets[g]; at < end;) {
        const int rem = (int)(end - at);
        const u32* list = pairs + at;
        int taken = 1;
        if constexpr (MAXM >= 8) {
            if (rem > 4) taken = min(rem, 8);
        }
        if constexpr (MAXM >= 4) {
            if (taken == 1 && rem > 2) taken = min(rem, 4);
        }
        if constexpr (MAXM >= 2) {
            if (taken == 1 && rem > 1) taken = 2;
        }
        if (taken > 4) {
            if constexpr (MAXM >= 8)
                moe_down_pass<C, 8>(wexp, h, list, taken, hidden, inter, row0, rows_here, y);
        } else if (taken > 2) {
            if constexpr (MAXM >= 4)
                moe_down_pass<C, 4>(wexp, h, list, taken, hidden, inter, row0, rows_here, y);
        } else if (taken == 2) {
            if constexpr (MAXM >= 2)
                moe_down_pass<C, 2>(wexp, h, list, taken, hidden, inter, row0, rows_here, y);
        } else {
            moe_down_pass<C, 1>(wexp, h, list, taken, hidden, inter, row0, rows_here, y);
        }
        // Publish this tile's y rows, then count one arrival per pair of the pass.
        __threadfence();
        if (threadIdx.x == 0) done_n = 0;
        __syncthreads();
        if ((int)threadIdx.x < taken) {
            const u32 t = list[threadIdx.x] / (u32)top_k;
            const u32 before = atomicAdd(&arrivals[(u64)t * tiles + blockIdx.x], 1u);
            if (before == (u32)top_k - 1) {
                __threadfence();  // the other ranks' rows, published before their arrivals
                done[atomicAdd(&done_n, 1)] = t;
            }
        }
        __syncthreads();
        const int nd = done_n;
        for (int i = threadIdx.x; i < nd * MOE_DOWN_TILE; i += MOE_THREADS) {
            const u64 t = done[i / MOE_DOWN_TILE];
            const int row = blockIdx.x * MOE_DOWN_TILE + i % MOE_DOWN_TILE;
            if (row < hidden) {
                const u64 p0 = t * (u64)top_k;
                float s = 0.0f;
                for (int r = 0; r < top_k; ++r)
                    s = fmaf(weights[p0 + r], load_cg(y + (p0 + r) * hidden + row), s);
                out[t * hidden + row] = s;
            }
        }
        __syncthreads();  // done[] and done_n are rewritten by the next pass
        at += taken;
    }
}

#define MOE_DOWN_KERNEL(NAME, CHUNK, MAXM, MINB)                                                     \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MINB)                              \
        NAME(const void* down, const float* h, const u32* offsets, const u32* pairs,             \
             const u32* active, const float* weights, float* y, float* out, u32* arrivals,       \
             int experts, int hidden, int inter, int top_k) {                                    \
        moe_down<CHUNK, MAXM>(down, h, offsets, pairs, active, weights, y, out, arrivals,        \
                              experts, hidden, inter, top_k);                                    \
    }

MOE_DOWN_KERNEL(moe_down_bf16_m1, ChunkBf16, 1, 4)
MOE_DOWN_KERNEL(moe_down_bf16_m4, ChunkBf16, 4, 2)
MOE_DOWN_KERNEL(moe_down_bf16_m8, ChunkBf16, 8, 1)
MOE_DOWN_KERNEL(moe_down_f16_m1, ChunkF16, 1, 4)
MOE_DOWN_KERNEL(moe_down_f16_m4, ChunkF16, 4, 2)
MOE_DOWN_KERNEL(moe_down_f16_m8, ChunkF16, 8, 1)
MOE_DOWN_KERNEL(moe_down_f32_m1, ChunkF32, 1, 4)
MOE_DOWN_KERNEL(moe_down_f32_m4, ChunkF32, 4, 2)
MOE_DOWN_KERNEL(moe_down_f32_m8, ChunkF32, 8, 1)

// ---- tiny batches: P = n k <= 32 pairs, two launches, no alignment ----
//
// moe_tiny_gate_up_<dt>: grid (ceil(I / 16), min(E, P)), block 256. Lane l of every warp holds
//   pair l's expert id; one match/ballot gives the distinct in-range experts in order of first
//   appearance, block (bx, s) takes the s-th (exits at once when there is none) and runs one-token
//   passes over its pairs, exactly as moe_gate_up does (the same h values, bit for bit), each warp
//   for MOE_TINY_JW = 2 intermediate indices (4 rows, 2 chunks of each in flight per lane). Two
//   per warp halve the grid: Qwen3-30B-A3B's 8 experts x 768 rows take 384 blocks, one wave at 3
//   blocks per SM on 132 SMs, where one per warp took 768 blocks, 1.45 waves (the kernel went
//   from 20.3 to 16-17 us, decode at batch 1 from 288-298 to 298-309 tok/s). With `direct` (one
//   token, P = k <= E slots: the host decides) block (bx, s) takes pair s's expert straight from
//   ids[s], without the match and ballots.
// moe_tiny_down_<dt>: grid (ceil(H / 4), n), block 256. Block (bx, t) computes token t's rows
//   4 bx .. + 4: warp w takes ranks w, w + 8, ... and computes each rank's expert rows . h[t k + r]
//   exactly as moe_down does (NaN for an out-of-range id) into shared memory; then a thread per
//   row sums weights[t, r] * y_r over r = 0..k in order. An expert two tokens picked is read once
//   per token, which batches this small seldom have; no arrival counters, no y buffer.

#define MOE_TINY_PAIRS 32
#define MOE_TINY_MAX_K 32
#define MOE_TINY_JW 2  // intermediate indices per warp of moe_tiny_gate_up
#define MOE_ROUTE_PER_LANE 4  // moe_tiny_gate_up_norm's routing weights: experts <= 128
#ifndef MOE_EARLY_POLLS  // -DMOE_EARLY_POLLS=0 (MOERUN_CUDA_DEFINES) measures without them
#define MOE_EARLY_POLLS 32  // moe_tiny_gate_up_norm's polls of its id, an L2 round trip each
#endif

template <typename C, int JW>
__device__ __forceinline__ void moe_tiny_gate_up(const void* __restrict__ gate_up,
                                                 const float* __restrict__ x,
                                                 const u32* __restrict__ ids, int pairs_n,
                                                 float* __restrict__ h, int experts, int hidden,
                                                 int inter, int top_k, int act, int direct) {
    // Marks (MOERUN_PROBE builds, common.cuh): 1 the programmatic wait passed, 2 the expert
    // known, 3 a pass done (the last pass's stamp stays; one pass at batch 1).
    probe_begin();
    pdl_entry();
    probe_mark(1);
    const u32 slot = blockIdx.y;
    u32 e, todo;  // the slot's expert; its pairs, as a mask of pair indices
    if (direct) {
        // One token (the host checks: its k pairs are the grid's k slots): pair `slot` in block
        // row `slot`, one load and no match or ballots. A repeated expert (the router never
        // picks one twice) would be streamed once per pair, each pair's h the same as grouped.
        e = ids[slot];
        if (e >= (u32)experts) return;  // block-uniform; no barriers below
        todo = 1u << slot;
    } else {
        const u32 full = 0xffffffffu;
        const int lane = threadIdx.x & 31;
        const u32 id = lane < pairs_n ? ids[lane] : MOE_NONE;
        const bool valid = id < (u32)experts;
        // Out-of-range and absent pairs get keys of their own, so they never match.
        const u32 same = __match_any_sync(full, valid ? id : 0x80000000u | (u32)lane);
        const bool first = valid && __ffs(same) - 1 == lane;
        const u32 firsts = __ballot_sync(full, first);
        if ((u32)__popc(firsts) <= slot) return;  // the same for every warp; no barriers below
        const u32 mine =
            __ballot_sync(full, first && (u32)__popc(firsts & ((1u << lane) - 1u)) == slot);
        e = __shfl_sync(full, id, __ffs(mine) - 1);
        todo = __ballot_sync(full, id == e);  // lanes = pair indices of expert e
    }
    probe_mark(2);
    const int j = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * JW;
    if (j >= inter) return;
    const u64 chunks = (u64)(hidden / C::N);
    const uint4* base = reinterpret_cast<const uint4*>(gate_up) + (u64)e * 2 * inter * chunks;
    const uint4* wg = base + (u64)j * chunks;
    const uint4* wu = base + (u64)(inter + j) * chunks;
    while (todo != 0u) {
        const u32 p[1] = {(u32)(__ffs(todo) - 1)};
        todo &= todo - 1u;
        moe_gate_up_pass<C, 1, JW, 2 * JW>(wg, wu, x, p, 1, top_k, hidden, inter, j, h, act);
        probe_mark(3);
    }
    probe_end("moe_tiny_gate_up");
}

// moe_tiny_gate_up_norm_<dt>: one token's moe_tiny_gate_up (direct: block row s < k takes pair
// s) behind the route ahead (gemv.cu's gemv_rows_route), with the residual add and the
// post-attention RMSNorm folded in: right after its wait each block stages s * nw (s = x + r, r
// the o_proj output from the launch before) into shared memory with the norm's inv
// (moe_stage_norm: the same inv in every block), streams its rows against it and scales the sums
// by inv. One more block row, k (grid (ceil(I / 16), k + 1); only its block 0 works), stages the
// same way, storing s to x_out (the new residual), and makes the routing weights from the route
// ahead's u and inv (warp_route_weights), beside the streaming blocks rather than after them.
// Dynamic shared memory: hidden f32. u and r come from the launch right before: read after the
// wait. So is a block's id, unless that launch has stored it already: gemv_rows_route sets the
// ids to ROUTE_ID_UNSET before it lets this kernel launch and stores them once ranked; a block
// polls its id for up to MOE_EARLY_POLLS rounds before its programmatic wait and, once it is
// set, issues its first weights before the wait, streaming while o_proj ends (the route ahead
// finishes before o_proj's last rows).
template <typename C, int JW>
__device__ __forceinline__ void moe_tiny_gate_up_norm(
    const void* __restrict__ gate_up, const float* x, const float* r, const float* __restrict__ nw,
    float eps, float* x_out, const float* u, const u32* ids, float* __restrict__ h,
    float* weights, int experts, int hidden, int inter, int top_k, int act, int renormalise) {
    extern __shared__ __align__(16) float moe_xs[];  // hidden f32: the staged s * nw
    const MoeNormIn nrm{x, r, nw, eps, moe_xs};
    const u32 slot = blockIdx.y;
    if (slot == (u32)top_k) {
        if (blockIdx.x != 0) return;  // block-uniform
        pdl_entry();
        const int lane = threadIdx.x & 31;
        float uv[MOE_ROUTE_PER_LANE];
        u32 my_id = 0u;
        if (threadIdx.x < 32) {
#pragma unroll
            for (int s = 0; s < MOE_ROUTE_PER_LANE; ++s) {
                const int i = 32 * s + lane;
                uv[s] = i < experts ? load_cg(u + i) : 0.0f;
            }
            if (lane < top_k) my_id = __float_as_uint(load_cg(reinterpret_cast<const float*>(ids + lane)));
        }
        const float inv = moe_stage_norm(nrm, hidden, x_out);
        if (threadIdx.x < 32)
            warp_route_weights<MOE_ROUTE_PER_LANE>(uv, experts, inv, my_id, top_k, renormalise,
                                                   weights);
        return;
    }
    // One thread polls: four, staggered by a quarter of a round trip, measured 0.2% slower
    // (H200, docs/perf/cuda-model.md v25).
    __shared__ u32 polled;
    if (threadIdx.x == 0) {
        u32 id = ROUTE_ID_UNSET;
        for (int i = 0; i < MOE_EARLY_POLLS && id == ROUTE_ID_UNSET; ++i)
            id = load_relaxed(ids + slot);
        polled = id;
    }
    __syncthreads();
    const bool early = polled != ROUTE_ID_UNSET;
    if (!early) pdl_entry();
    const u32 e =
        early ? polled : __float_as_uint(load_cg(reinterpret_cast<const float*>(ids + slot)));
    if (e >= (u32)experts) {  // block-uniform
        if (early) pdl_entry();  // every thread waits once before it returns
        return;
    }
    // A warp past the last intermediate index still stages its share of the row (a barrier):
    // it streams row 0's weights and writes nothing (taken 0).
    const int j0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * JW;
    const bool spare = j0 >= inter;
    const int j = spare ? 0 : j0;
    const u64 chunks = (u64)(hidden / C::N);
    const uint4* base = reinterpret_cast<const uint4*>(gate_up) + (u64)e * 2 * inter * chunks;
    const uint4* wg = base + (u64)j * chunks;
    const uint4* wu = base + (u64)(inter + j) * chunks;
    const u32 p[1] = {slot};
    // The first weights, then the wait (moe_warp_rows' WAIT; a second wait, where the ids came
    // after one, returns at once), then the staged row.
    moe_gate_up_pass<C, 1, JW, 2 * JW, true, true>(wg, wu, x, p, spare ? 0 : 1, top_k, hidden,
                                                   inter, j, h, act, nrm);
}

// LATE: the routing weights come from the launch right before (moe_tiny_gate_up_norm) and load
// after the wait, beside the first rank's rows.
template <typename C, bool LATE = false>
__device__ __forceinline__ void moe_tiny_down(const void* __restrict__ down,
                                              const float* __restrict__ h,
                                              const u32* __restrict__ ids,
                                              const float* weights,
                                              float* __restrict__ out, int experts, int hidden,
                                              int inter, int top_k) {
    __shared__ float ys[MOE_TINY_MAX_K][MOE_DOWN_ROWS];
    __shared__ float rank_weights[MOE_TINY_MAX_K];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const u64 t = blockIdx.y;
    const int row0 = blockIdx.x * MOE_DOWN_ROWS;
    const int rows_here = min(MOE_DOWN_ROWS, hidden - row0);  // >= 1: grid.x = ceil(H / 4)
    // Under programmatic dependent launch (common.cuh) this kernel starts while gate_up runs:
    // a warp's first rank reads its expert id and starts that expert's weights before waiting
    // for gate_up. The ids come from the routing (gemv_route at one token, else route_topk), two
    // kernels back, which had finished before gate_up let this kernel launch (gate_up waits for
    // it first); they are read through L2. So do the token's routing weights, into shared memory
    // (read after the wait, they were one more L2 round trip at the very end of the MoE). Every
    // thread waits exactly once, before it reads h or writes anything.
    if (!LATE && (int)threadIdx.x < top_k)
        rank_weights[threadIdx.x] = load_cg(weights + t * (u64)top_k + threadIdx.x);
    auto late_weights = [&] {
        if (LATE && (int)threadIdx.x < top_k)
            rank_weights[threadIdx.x] = load_cg(weights + t * (u64)top_k + threadIdx.x);
    };
    bool waited = false;
    for (int r = warp; r < top_k; r += MOE_WARPS) {
        const u32 p[1] = {(u32)(t * top_k + r)};
        const u32 e = __float_as_uint(load_cg(reinterpret_cast<const float*>(ids + p[0])));
        const uint4* wexp = e < (u32)experts
                                ? reinterpret_cast<const uint4*>(down) + (u64)e * hidden * (inter / C::N)
                                : nullptr;
        // Every lane holds the four rows' totals (butterflies: batch 1).
        float tot[MOE_DOWN_ROWS];
        if (waited) {
            moe_down_rows<C, 1, false, MOE_DOWN_ROWS>(wexp, h, p, inter, row0, rows_here, tot);
        } else {
            moe_down_rows<C, 1, true, MOE_DOWN_ROWS>(wexp, h, p, inter, row0, rows_here, tot,
                                                     late_weights);
            waited = true;
        }
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < MOE_DOWN_ROWS; ++i) ys[r][i] = tot[i];
        }
    }
    if (!waited) {
        pdl_entry();
        late_weights();
    }
    __syncthreads();
    if ((int)threadIdx.x < rows_here) {
        float s = 0.0f;
        for (int r = 0; r < top_k; ++r) s = fmaf(rank_weights[r], ys[r][threadIdx.x], s);
        out[t * hidden + row0 + threadIdx.x] = s;
    }
}

#define MOE_TINY_KERNELS(DT, CHUNK)                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 3)                                 \
        moe_tiny_gate_up_##DT(const void* gate_up, const float* x, const u32* ids, int pairs_n,  \
                              float* h, int experts, int hidden, int inter, int top_k,           \
                              int act, int direct) {                                             \
        moe_tiny_gate_up<CHUNK, MOE_TINY_JW>(gate_up, x, ids, pairs_n, h, experts, hidden,      \
                                             inter, top_k, act, direct);                         \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 4)                                 \
        moe_tiny_down_##DT(const void* down, const float* h, const u32* ids,                     \
                           const float* weights, float* out, int experts, int hidden, int inter, \
                           int top_k) {                                                          \
        moe_tiny_down<CHUNK>(down, h, ids, weights, out, experts, hidden, inter, top_k);         \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 3)                                 \
        moe_tiny_gate_up_norm_##DT(const void* gate_up, const float* x, const float* r,          \
                                   const float* nw, float eps, float* x_out, const float* u,     \
                                   const u32* ids, float* h, float* weights, int experts,        \
                                   int hidden, int inter, int top_k, int act, int renormalise) { \
        moe_tiny_gate_up_norm<CHUNK, MOE_TINY_JW>(gate_up, x, r, nw, eps, x_out, u, ids, h,     \
                                                  weights, experts, hidden, inter, top_k, act,  \
                                                  renormalise);                                 \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 4)                                 \
        moe_tiny_down_late_##DT(const void* down, const float* h, const u32* ids,                \
                                const float* weights, float* out, int experts, int hidden,       \
                                int inter, int top_k) {                                          \
        moe_tiny_down<CHUNK, true>(down, h, ids, weights, out, experts, hidden, inter, top_k);   \
    }

MOE_TINY_KERNELS(bf16, ChunkBf16)
MOE_TINY_KERNELS(f16, ChunkF16)
MOE_TINY_KERNELS(f32, ChunkF32)
