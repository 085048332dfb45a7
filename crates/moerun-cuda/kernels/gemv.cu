// Decode GEMV: y[m, n] = x[m, k] . W[n, k]^T with W row-major in its stored dtype (bf16, f16, f32)
// and f32 activations, f32 accumulation. Bound by reading W once: lanes stream 16-byte chunks of
// weight rows (ld.global.nc, no L1 allocation: W is read once, x stays in L1), several chunks in
// flight per thread, and each chunk is used for all M (<= 8) rows of x.
// Needs k % (16 / sizeof(element)) == 0 (rows stay 16-byte aligned); the wrapper checks it.
//
// Two layouts (gemv.rs chooses; docs/perf/cuda-ops.md has their speeds):
// - warp per row (gemv_<dt>_m<M>): block 256 = 8 warps, grid ceil(n / 8); warp w of block b owns
//   row 8b + w, lanes stride over its chunks, 4 in flight per lane; one butterfly reduction.
// - block per rows (gemv_rows_<dt>_m<M>): block 256, grid ceil(n / 4); block b owns rows 4b..4b+3,
//   its 256 threads stride over the chunks of all four rows (4 or 8 chunks in flight per thread),
//   so each x chunk read from L1 serves four rows and short rows need no serial loop; a warp
//   reduce-scatter of its M x 4 sums, then the 8 warps' partials are added in warp order through
//   shared memory.
// Summation order of an output: per thread over its chunks in order, then fixed trees (the block
// layout's warp reduce-scatter adds in warp_sum's tree). It depends on k and the layout, never
// on M: rows of a batch equal the same rows run alone, bit for bit.
// gemv_route_<dt>_l<L> (the end of this file) is the block layout's one-token GEMV of a MoE
// router (16 rows a block, the same sums) with the routing of route_topk in the same launch.

#define GEMV_WARPS 8
#define GEMV_UNROLL 4

template <typename C, int M>
__device__ __forceinline__ void fma_chunk(uint4 q, const float* __restrict__ x, int k, int c,
                                          float* acc) {
    float f[C::N];
    C::widen(q, f);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float4* xv = reinterpret_cast<const float4*>(x + (u64)m * k + (u64)c * C::N);
#pragma unroll
        for (int v = 0; v < C::N / 4; ++v) {
            const float4 xx = xv[v];
            acc[m] += f[4 * v] * xx.x + f[4 * v + 1] * xx.y + f[4 * v + 2] * xx.z + f[4 * v + 3] * xx.w;
        }
    }
}

template <typename C, int M>
__device__ __forceinline__ void gemv_warp_row(const void* __restrict__ w_raw, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int k) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int chunks = k / C::N;
    const uint4* w = reinterpret_cast<const uint4*>(w_raw) + (u64)row * chunks;
    // The first step's weights do not depend on the kernel before (programmatic dependent
    // launch, common.cuh): load them, then wait for it. Same steps, same order as without.
    int c = lane;
    const int first = c + 32 * (GEMV_UNROLL - 1) < chunks ? GEMV_UNROLL : (c < chunks ? 1 : 0);
    uint4 q[GEMV_UNROLL];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u)
        q[u] = row < n && u < first ? load_stream_early(w + c + 32 * u) : make_uint4(0u, 0u, 0u, 0u);
    pdl_entry();
    if (row >= n) return;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    if (first == GEMV_UNROLL) {
        for (;;) {
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) fma_chunk<C, M>(q[u], x, k, c + 32 * u, acc);
            c += 32 * GEMV_UNROLL;
            if (c + 32 * (GEMV_UNROLL - 1) >= chunks) break;
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) q[u] = load_stream(w + c + 32 * u);
        }
    } else if (first == 1) {
        fma_chunk<C, M>(q[0], x, k, c, acc);
        c += 32;
    }
    for (; c < chunks; c += 32) fma_chunk<C, M>(load_stream(w + c), x, k, c, acc);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = warp_sum(acc[m]);
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) y[(u64)m * n + row] = acc[m];
    }
}

#define GEMV_KERNEL(NAME, CHUNK, M)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                               \
        NAME(const void* w, const float* x, float* y, int n, int k) {                           \
        gemv_warp_row<CHUNK, M>(w, x, y, n, k);                                                   \
    }

GEMV_KERNEL(gemv_bf16_m1, ChunkBf16, 1)
GEMV_KERNEL(gemv_bf16_m2, ChunkBf16, 2)
GEMV_KERNEL(gemv_bf16_m4, ChunkBf16, 4)
GEMV_KERNEL(gemv_bf16_m8, ChunkBf16, 8)
GEMV_KERNEL(gemv_f16_m1, ChunkF16, 1)
GEMV_KERNEL(gemv_f16_m2, ChunkF16, 2)
GEMV_KERNEL(gemv_f16_m4, ChunkF16, 4)
GEMV_KERNEL(gemv_f16_m8, ChunkF16, 8)
GEMV_KERNEL(gemv_f32_m1, ChunkF32, 1)
GEMV_KERNEL(gemv_f32_m2, ChunkF32, 2)
GEMV_KERNEL(gemv_f32_m4, ChunkF32, 4)
GEMV_KERNEL(gemv_f32_m8, ChunkF32, 8)

// ---- block per rows ----

#define ROWS_THREADS 256
#define ROWS_WARPS (ROWS_THREADS / 32)
#define ROWS_PER_BLOCK 4

// acc[m][r] += chunk r of the weights . chunk c of x row m, for R rows: each x chunk is read once
// for up to 4 rows (more rows go in groups of 4, so that at most 4 x 8 widened weights are live;
// each row's additions are the same whatever R).
// acc[i] += values 4 v .. 4 v + 3 of the group's widened row i . xx, for its G rows.
template <int G, int N>
__device__ __forceinline__ void fma_group(const float (&f)[G][N], int v, float4 xx, float* acc) {
#pragma unroll
    for (int i = 0; i < G; ++i)
        acc[i] += f[i][4 * v] * xx.x + f[i][4 * v + 1] * xx.y + f[i][4 * v + 2] * xx.z +
                  f[i][4 * v + 3] * xx.w;
}

template <typename C, int M, int R>
__device__ __forceinline__ void fma_rows(const uint4* q, const float* __restrict__ x, int k, int c,
                                         float (&acc)[M][R]) {
    static_assert(R <= 4 || R % 4 == 0, "rows in groups of 4");
    constexpr int G = R < 4 ? R : 4;
#pragma unroll
    for (int g = 0; g < R; g += G) {
        float f[G][C::N];
#pragma unroll
        for (int r = 0; r < G; ++r) C::widen(q[g + r], f[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4* xv = reinterpret_cast<const float4*>(x + (u64)m * k + (u64)c * C::N);
#pragma unroll
            for (int v = 0; v < C::N / 4; ++v) fma_group<G, C::N>(f, v, xv[v], &acc[m][g]);
        }
    }
}

// The block's R rows from row0 (those < n) . x: each warp's sums of every row (and token) into
// partial[warp] (one lane per total), ending in a block barrier. Each row's sums do not depend on
// R: gemv_route's 16 rows a block give the bits of gemv_rows_<dt>_m1's 4.
template <typename C, int M, int U, int R>
__device__ __forceinline__ void gemv_rows_partials(const void* __restrict__ w_raw,
                                                   const float* x, int n, int k,
                                                   int row0, float (&partial)[ROWS_WARPS][M * R]) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int rows_here = min(R, n - row0);  // block-uniform
    const int chunks = k / C::N;
    const uint4* w = reinterpret_cast<const uint4*>(w_raw) + (u64)row0 * chunks;
    // The first step's weights do not depend on the kernel before (programmatic dependent
    // launch, common.cuh): load them, then wait for it. Same steps, same order as without.
    int c = tid;
    const int first = c + ROWS_THREADS * (U - 1) < chunks ? U : (c < chunks ? 1 : 0);
    uint4 q[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r)
            q[u][r] = u < first && r < rows_here
                          ? load_stream_early(w + (u64)r * chunks + c + ROWS_THREADS * u)
                          : make_uint4(0u, 0u, 0u, 0u);
    pdl_entry();
    probe_mark(1);
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    if (first == U) {
        for (;;) {
#pragma unroll
            for (int u = 0; u < U; ++u) fma_rows<C, M, R>(q[u], x, k, c + ROWS_THREADS * u, acc);
            c += ROWS_THREADS * U;
            if (c + ROWS_THREADS * (U - 1) >= chunks) break;
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int r = 0; r < R; ++r)
                    q[u][r] = r < rows_here ? load_stream(w + (u64)r * chunks + c + ROWS_THREADS * u)
                                            : make_uint4(0u, 0u, 0u, 0u);
        }
    } else if (first == 1) {
        fma_rows<C, M, R>(q[0], x, k, c, acc);
        c += ROWS_THREADS;
    }
    for (; c < chunks; c += ROWS_THREADS) {
        uint4 t[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            t[r] = r < rows_here ? load_stream(w + (u64)r * chunks + c) : make_uint4(0u, 0u, 0u, 0u);
        fma_rows<C, M, R>(t, x, k, c, acc);
    }
    // One token's 4 rows (gemv_rows_<dt>_m1): one butterfly per sum, lane 0 writing; with the
    // reduce-scatter batch-1 decode lost 0.7-1% (H200, alternating; docs/perf/cuda-model.md v13).
    // gemv_route's 16 rows a block take the reduce-scatter (16 shuffles a warp where the
    // butterflies took 80; the same bits): +0.5% (v19).
    if constexpr (M == 1 && R < 16) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[0][r]);
            if (lane == 0) partial[warp][r] = v;
        }
    } else {
        // Each warp's M x R sums, one lane per total (see warp_reduce_scatter).
        constexpr int NV = M * R;
        float sums[NV];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) sums[m * R + r] = acc[m][r];
        warp_reduce_scatter<NV>(sums, lane);
        if (scatter_writer<NV>(lane)) partial[warp][scatter_first<NV>(lane)] = sums[0];
    }
    __syncthreads();
}

// Block `block` of the layout: rows 4 block .. + 4.
template <typename C, int M, int U>
__device__ __forceinline__ void gemv_block_rows(const void* __restrict__ w_raw,
                                                const float* __restrict__ x, float* __restrict__ y,
                                                int n, int k, int block) {
    constexpr int R = ROWS_PER_BLOCK;
    __shared__ float partial[ROWS_WARPS][M * R];
    const int tid = threadIdx.x;
    const int row0 = block * R;
    const int rows_here = min(R, n - row0);  // block-uniform
    gemv_rows_partials<C, M, U, R>(w_raw, x, n, k, row0, partial);
    if (tid < M * R) {
        const int m = tid / R;
        const int r = tid - m * R;
        if (r < rows_here) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < ROWS_WARPS; ++i) s += partial[i][tid];
            y[(u64)m * n + row0 + r] = s;
        }
    }
}

#define GEMV_ROWS_KERNEL(NAME, CHUNK, M, U)                                                     \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                  \
        NAME(const void* w, const float* x, float* y, int n, int k) {                           \
        gemv_block_rows<CHUNK, M, U>(w, x, y, n, k, blockIdx.x);                                \
    }

GEMV_ROWS_KERNEL(gemv_rows_bf16_m1, ChunkBf16, 1, 2)
GEMV_ROWS_KERNEL(gemv_rows_bf16_m2, ChunkBf16, 2, 2)
GEMV_ROWS_KERNEL(gemv_rows_bf16_m4, ChunkBf16, 4, 1)
GEMV_ROWS_KERNEL(gemv_rows_bf16_m8, ChunkBf16, 8, 1)
GEMV_ROWS_KERNEL(gemv_rows_f16_m1, ChunkF16, 1, 2)
GEMV_ROWS_KERNEL(gemv_rows_f16_m2, ChunkF16, 2, 2)
GEMV_ROWS_KERNEL(gemv_rows_f16_m4, ChunkF16, 4, 1)
GEMV_ROWS_KERNEL(gemv_rows_f16_m8, ChunkF16, 8, 1)
GEMV_ROWS_KERNEL(gemv_rows_f32_m1, ChunkF32, 1, 2)
GEMV_ROWS_KERNEL(gemv_rows_f32_m2, ChunkF32, 2, 2)
GEMV_ROWS_KERNEL(gemv_rows_f32_m4, ChunkF32, 4, 1)
GEMV_ROWS_KERNEL(gemv_rows_f32_m8, ChunkF32, 8, 1)

// ---- one token's GEMV with the residual add and RMSNorm before it folded in ----
//
// y = W . rmsnorm(x + r) for one token, where add_rms_norm_f32 and a GEMV took two launches (a
// decode layer's add+norm: ~1.3-1.7 us of a batch-1 layer's chain each, for 8 KiB). The norm's
// scale is one scalar, so it comes out of the sums: y[i] = inv * sum_j W[i, j] (s[j] nw[j]),
// s = x + r, inv = 1 / sqrt(mean(s^2) + eps). Each block sums the squares of the s values it
// reads anyway, beside its rows' products (one more warp sum, one more shared-memory slot): no
// block waits for a normed row to be made first. One block writes s, the new residual, to
// x_out (not x: the other blocks may still be reading x). The residual x and the norm weights
// load before the programmatic wait (no kernel right before this one writes them:
// graph::EARLY_ACTIVATION_READERS), r after it. Every row of a launch gets the same inv; the bits
// are not those of the two launches (the squares' tree and where inv applies differ, by a few
// ulp).
// - gemv_rows_norm_<dt>: grid ceil(n / 4), block 256: gemv_rows_<dt>_m1's layout (the q/k/v
//   projection of a decode step); block 0 writes x_out.
// - gemv_route_norm_<dt>_l<L> (below, with gemv_route): the router GEMV and its top-k; its block
//   0 writes x_out and the normed row (the experts' input).

__device__ __forceinline__ float4 add4f(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
__device__ __forceinline__ float4 mul4f(float4 a, float4 b) {
    return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

// Rows w[0 .. rows_here) (chunks each) . (s * nw), s = x + r: each warp's sums of every row into
// partial[warp][0 .. R) and of s's squares into partial[warp][R], ending in a block barrier. The
// first step's weights, x and nw load before the programmatic wait, r after it; `write`: this
// block stores s to x_out. sv, nv: s and nw of the thread's first chunk (chunk tid; zeros past
// the row), for a caller that writes the normed row. x, r and x_out are not __restrict__: with
// them NVRTC read r (the kernel before's output) through ld.global.nc, which the compiler may
// order before the programmatic wait.
template <typename C, int R>
__device__ __forceinline__ void norm_rows_partials(const uint4* w, int rows_here, int chunks,
                                                   const float* x, const float* r, const float* nw,
                                                   float* x_out,
                                                   bool write, float (&partial)[ROWS_WARPS][R + 1],
                                                   float4 (&sv)[C::N / 4],
                                                   float4 (&nv)[C::N / 4]) {
    constexpr int V = C::N / 4;  // float4 of activations per chunk
    constexpr int G = R < 4 ? R : 4;  // rows widened at once (fma_rows' groups)
    static_assert(R % G == 0, "rows in groups of 4");
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const bool in = tid < chunks;
    uint4 q[R];
    float4 xv[V];
#pragma unroll
    for (int i = 0; i < R; ++i)
        q[i] = in && i < rows_here ? load_stream_early(w + (u64)i * chunks + tid)
                                   : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int v = 0; v < V; ++v) {
        xv[v] = in ? load_early4(x + (u64)tid * C::N + 4 * v) : make_float4(0.f, 0.f, 0.f, 0.f);
        nv[v] = in ? load_early4(nw + (u64)tid * C::N + 4 * v) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    pdl_entry();
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;
    float ss = 0.0f;
    // Chunk c: s (stored where `write`), its squares, then the rows' products with s * nw, added
    // as fma_rows adds them.
    auto step = [&](const uint4 (&qq)[R], int c, const float4 (&xc)[V], const float4 (&nc)[V],
                    float4 (&sc)[V]) {
        float4 a[V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
            sc[v] = add4f(xc[v], *reinterpret_cast<const float4*>(r + (u64)c * C::N + 4 * v));
            if (write) *reinterpret_cast<float4*>(x_out + (u64)c * C::N + 4 * v) = sc[v];
            ss = __fmaf_rn(sc[v].x, sc[v].x, ss);
            ss = __fmaf_rn(sc[v].y, sc[v].y, ss);
            ss = __fmaf_rn(sc[v].z, sc[v].z, ss);
            ss = __fmaf_rn(sc[v].w, sc[v].w, ss);
            a[v] = mul4f(sc[v], nc[v]);
        }
#pragma unroll
        for (int g = 0; g < R; g += G) {
            float f[G][C::N];
#pragma unroll
            for (int i = 0; i < G; ++i) C::widen(qq[g + i], f[i]);
#pragma unroll
            for (int v = 0; v < V; ++v) fma_group<G, C::N>(f, v, a[v], &acc[g]);
        }
    };
#pragma unroll
    for (int v = 0; v < V; ++v) sv[v] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (in) step(q, tid, xv, nv, sv);
    for (int c = tid + ROWS_THREADS; c < chunks; c += ROWS_THREADS) {
        uint4 t[R];
        float4 xc[V], nc[V], sc[V];
#pragma unroll
        for (int i = 0; i < R; ++i)
            t[i] = i < rows_here ? load_stream(w + (u64)i * chunks + c) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int v = 0; v < V; ++v) {
            xc[v] = *reinterpret_cast<const float4*>(x + (u64)c * C::N + 4 * v);
            nc[v] = *reinterpret_cast<const float4*>(nw + (u64)c * C::N + 4 * v);
        }
        step(t, c, xc, nc, sc);
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0) partial[warp][i] = v;
    }
    const float sq = warp_sum(ss);
    if (lane == 0) partial[warp][R] = sq;
    __syncthreads();
}

// The norm's scale from norm_rows_partials' squares (the same value in every thread and block).
template <int R>
__device__ __forceinline__ float norm_inv(const float (&partial)[ROWS_WARPS][R + 1], int k,
                                          float eps) {
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < ROWS_WARPS; ++i) t += partial[i][R];
    return 1.0f / sqrtf(t / (float)k + eps);
}

// gemv_rows_norm_strided_<dt>: the same sums by a grid of at most 4 blocks an SM (the host's
// choice: one wave), block b taking row groups b, b + grid, ... of 4 rows, each thread with two
// groups' weights in flight (the one after next loads while a group computes; the first
// group's before the programmatic wait, as gemv_rows_norm's, the second's right after it).
// Rows of 256 chunks only (one a thread: k = 2048 bf16/f16, 1024 f32; the host checks), so a
// thread makes its s * nw once for all its groups. The same sums in the same order as
// gemv_rows_norm: the same bits. Against gemv_rows_norm's one group a block (Qwen3-30B-A3B's
// q/k/v: 1,280 blocks, 2.4 waves; its LM head: 37,984, 72 waves) batch-1 decode gained 0.9% for
// the projections and 1.1% with the LM head (H200, docs/perf/cuda-model.md v24). A grid of 2
// blocks an SM instead, which leaves decode attention room to launch beside the projection
// (attention's inc fell 0.65 us), streamed it 2 us slower.
template <typename C>
__device__ __forceinline__ void gemv_rows_norm_strided(const void* __restrict__ w_raw,
                                                      const float* x, const float* r,
                                                      const float* nw, float eps, float* x_out,
                                                      float* __restrict__ y, int n, int k) {
    constexpr int R = ROWS_PER_BLOCK;
    constexpr int V = C::N / 4;
    __shared__ float partial[ROWS_WARPS][R + 1];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int chunks = k / C::N;  // == ROWS_THREADS
    const int groups = (n + R - 1) / R;
    const int stride = gridDim.x;
    const uint4* w = reinterpret_cast<const uint4*>(w_raw);
    auto load_group = [&](int g, uint4 (&q)[R], bool early) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int row = g * R + i;
            const uint4* p = w + (u64)row * chunks + tid;
            q[i] = g < groups && row < n ? (early ? load_stream_early(p) : load_stream(p))
                                         : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    uint4 qa[R], qb[R];
    int g = blockIdx.x;
    load_group(g, qa, true);
    float4 xv[V], nv[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
        xv[v] = load_early4(x + (u64)tid * C::N + 4 * v);
        nv[v] = load_early4(nw + (u64)tid * C::N + 4 * v);
    }
    pdl_entry();
    load_group(g + stride, qb, false);  // after the wait: through the read-only path
    // s = x + r (block 0 stores it), its squares, and s * nw: the thread's chunk, once.
    float4 av[V];
    float ss = 0.0f;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const float4 sc = add4f(xv[v], *reinterpret_cast<const float4*>(r + (u64)tid * C::N + 4 * v));
        if (blockIdx.x == 0) *reinterpret_cast<float4*>(x_out + (u64)tid * C::N + 4 * v) = sc;
        ss = __fmaf_rn(sc.x, sc.x, ss);
        ss = __fmaf_rn(sc.y, sc.y, ss);
        ss = __fmaf_rn(sc.z, sc.z, ss);
        ss = __fmaf_rn(sc.w, sc.w, ss);
        av[v] = mul4f(sc, nv[v]);
    }
    {
        const float sq = warp_sum(ss);
        if (lane == 0) partial[warp][R] = sq;
    }
    float inv = 0.0f;
    // One group from q: its rows' sums, then y.
    auto group = [&](int gg, const uint4 (&q)[R], bool first) {
        float acc[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            float f[1][C::N];
            C::widen(q[i], f[0]);
            acc[i] = 0.0f;
#pragma unroll
            for (int v = 0; v < V; ++v) fma_group<1, C::N>(f, v, av[v], &acc[i]);
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float t = warp_sum(acc[i]);
            if (lane == 0) partial[warp][i] = t;
        }
        __syncthreads();
        if (first) inv = norm_inv<R>(partial, k, eps);
        const int row0 = gg * R;
        if (tid < R && row0 + tid < n) {
            float t = 0.0f;
#pragma unroll
            for (int i = 0; i < ROWS_WARPS; ++i) t += partial[i][tid];
            y[row0 + tid] = t * inv;
        }
        __syncthreads();  // partial's rows are written again by the next group
    };
    bool first = true;
    while (g < groups) {
        group(g, qa, first);
        first = false;
        load_group(g + 2 * stride, qa, false);
        g += stride;
        if (g >= groups) break;
        group(g, qb, false);
        load_group(g + 2 * stride, qb, false);
        g += stride;
    }
}

template <typename C>
__device__ __forceinline__ void gemv_rows_norm(const void* __restrict__ w_raw,
                                               const float* x, const float* r, const float* nw,
                                               float eps, float* x_out, float* __restrict__ y,
                                               int n, int k) {
    constexpr int R = ROWS_PER_BLOCK;
    __shared__ float partial[ROWS_WARPS][R + 1];
    const int row0 = blockIdx.x * R;
    const int rows_here = min(R, n - row0);  // block-uniform
    const int chunks = k / C::N;
    const uint4* w = reinterpret_cast<const uint4*>(w_raw) + (u64)row0 * chunks;
    float4 sv[C::N / 4], nv[C::N / 4];
    norm_rows_partials<C, R>(w, rows_here, chunks, x, r, nw, x_out, blockIdx.x == 0, partial, sv,
                             nv);
    const int tid = threadIdx.x;
    if (tid < rows_here) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS_WARPS; ++i) s += partial[i][tid];
        y[row0 + tid] = s * norm_inv<R>(partial, k, eps);
    }
}

// Only the first chunk of each row loads before the wait (a thread's chunks past it after):
// with two, as gemv_rows_bf16_m1 has, the bf16 build held 90 registers (2 blocks an SM where
// gemv_rows_bf16_m1 has 4); with one, 60, and rows of up to 2,048 bf16 still load whole.
// BODY: gemv_rows_norm or gemv_rows_norm_strided; the rest: its __launch_bounds__.
#define GEMV_ROWS_NORM_KERNEL(NAME, BODY, CHUNK, ...)                                           \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__)                                   \
        NAME(const void* w, const float* x, const float* r, const float* nw, float eps,         \
             float* x_out, float* y, int n, int k) {                                             \
        BODY<CHUNK>(w, x, r, nw, eps, x_out, y, n, k);                                           \
    }

GEMV_ROWS_NORM_KERNEL(gemv_rows_norm_bf16, gemv_rows_norm, ChunkBf16, ROWS_THREADS)
GEMV_ROWS_NORM_KERNEL(gemv_rows_norm_f16, gemv_rows_norm, ChunkF16, ROWS_THREADS)
GEMV_ROWS_NORM_KERNEL(gemv_rows_norm_f32, gemv_rows_norm, ChunkF32, ROWS_THREADS)
// Four blocks an SM (64 registers): the grid the host launches is one wave.
GEMV_ROWS_NORM_KERNEL(gemv_rows_norm_strided_bf16, gemv_rows_norm_strided, ChunkBf16, ROWS_THREADS, 4)
GEMV_ROWS_NORM_KERNEL(gemv_rows_norm_strided_f16, gemv_rows_norm_strided, ChunkF16, ROWS_THREADS, 4)
GEMV_ROWS_NORM_KERNEL(gemv_rows_norm_strided_f32, gemv_rows_norm_strided, ChunkF32, ROWS_THREADS, 4)

// ---- the router GEMV of one token with its top-k, in one cluster (sm_90) ----
//
// gemv_route_<dt>_l<L>: grid (ROUTE_CLUSTER), cluster (ROUTE_CLUSTER, 1, 1), block 256; experts
// <= ROUTE_ROWS * ROUTE_CLUSTER. Block r computes router rows 16 r .. 16 r + 16 exactly as
// gemv_rows_<dt>_m1 does (the same bits: gemv_rows_partials, weights loaded before the
// programmatic wait) and sends the logits by st.async into block 0's shared memory, whose
// mbarrier counts them; block 0's first warp then routes them as route_topk_f32_l<L> does
// (warp_route_topk: the same ids and weights). One launch and no global round trip between the
// logits and their ranking, where the GEMV and route_topk took two launches (~1 µs each on a
// decode step's chain) and the logits went through L2.
#define ROUTE_ROWS 16
#define ROUTE_CLUSTER 8

// The add+norm fold's arguments (gemv_route_norm): s = x + r goes to x_out, nw * (s * inv) to xn.
struct RouteNorm {
    const float* r;
    const float* nw;
    float eps;
    float* x_out;
    float* xn;
};

// NORM: gemv_route_norm (norm_rows_partials, with `nrm` its arguments).
template <typename C, int L, bool NORM = false>
__device__ __forceinline__ void gemv_route(const void* __restrict__ w, const float* x,
                                           int experts, int k, int topk, int renormalise,
                                           u32* __restrict__ out_ids,
                                           float* __restrict__ out_weights,
                                           const RouteNorm& nrm = RouteNorm{}) {
    __shared__ float partial[ROWS_WARPS][ROUTE_ROWS + (NORM ? 1 : 0)];
    __shared__ __align__(16) float logits[ROUTE_ROWS * ROUTE_CLUSTER];
    __shared__ __align__(8) u64 inbox;
    // Marks (MOERUN_PROBE builds, common.cuh): 1 the programmatic wait passed, 2 the rows
    // summed, 3 the cluster barrier passed, 4 the logits sent, 5 block 0's inbox full, 6 its
    // routing keys made, 7 its k rounds done (warp_route_topk).
    probe_begin();
    // A grid of one cluster of (ROUTE_CLUSTER, 1, 1): blockIdx.x is the block's cluster rank.
    const int rank = blockIdx.x;
    const int row0 = rank * ROUTE_ROWS;
    if (rank == 0 && threadIdx.x == 0) {
        mbar_init(smem_u32(&inbox), 1);
        mbar_expect_tx(smem_u32(&inbox), (u32)(experts * sizeof(float)));
    }
    fence_mbarrier_init();
    cluster_arrive_relaxed();
    constexpr int V = C::N / 4;
    float4 sv[V], nv[V];  // NORM: the thread's first chunk of s and nw
    float inv = 1.0f;     // NORM: the norm's scale
    if constexpr (NORM) {
        const int chunks = k / C::N;
        norm_rows_partials<C, ROUTE_ROWS>(
            reinterpret_cast<const uint4*>(w) + (u64)row0 * chunks, min(ROUTE_ROWS, experts - row0),
            chunks, x, nrm.r, nrm.nw, nrm.x_out, rank == 0, partial, sv, nv);
        inv = norm_inv<ROUTE_ROWS>(partial, k, nrm.eps);
    } else {
        gemv_rows_partials<C, 1, 1, ROUTE_ROWS>(w, x, experts, k, row0, partial);
    }
    probe_mark(2);
    cluster_wait();  // block 0's mbarrier is ready
    probe_mark(3);
    const int t = threadIdx.x;
    if (t < ROUTE_ROWS && row0 + t < experts) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS_WARPS; ++i) s += partial[i][t];
        if constexpr (NORM) s *= inv;
        st_async1(cluster_addr(logits + row0 + t, 0), s,
                  cluster_addr(&inbox, 0));
    }
    probe_mark(4);
    if (rank != 0) {
        probe_end("gemv_route");
        return;
    }
    if constexpr (NORM) {
        // Block 0: the normed row, nw * (s * inv) as add_rms_norm makes it, from the chunk each
        // thread holds (s past a thread's first chunk read back from its own x_out stores).
        const int chunks = k / C::N;
        if (t < chunks) {
#pragma unroll
            for (int v = 0; v < V; ++v)
                *reinterpret_cast<float4*>(nrm.xn + (u64)t * C::N + 4 * v) = mul4f(
                    nv[v], make_float4(sv[v].x * inv, sv[v].y * inv, sv[v].z * inv, sv[v].w * inv));
        }
        for (int c = t + ROWS_THREADS; c < chunks; c += ROWS_THREADS)
#pragma unroll
            for (int j = 0; j < C::N; ++j) {
                const u64 i = (u64)c * C::N + j;
                nrm.xn[i] = nrm.nw[i] * (nrm.x_out[i] * inv);
            }
    }
    if (t >= 32) return;
    mbar_wait_cluster(smem_u32(&inbox), 0);
    probe_mark(5);
    warp_route_topk<L>(logits, experts, topk, renormalise, out_ids, out_weights);
    probe_end("gemv_route");
}

#if __CUDA_ARCH__ >= 900
#define GEMV_ROUTE_KERNEL(NAME, CHUNK, L)                                                        \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) __cluster_dims__(ROUTE_CLUSTER, 1, 1) \
        NAME(const void* w, const float* x, int experts, int k, int topk, int renormalise,      \
             u32* out_ids, float* out_weights) {                                                \
        gemv_route<CHUNK, L>(w, x, experts, k, topk, renormalise, out_ids, out_weights);        \
    }
#define GEMV_ROUTE_NORM_KERNEL(NAME, CHUNK, L)                                                   \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) __cluster_dims__(ROUTE_CLUSTER, 1, 1) \
        NAME(const void* w, const float* x, const float* r, const float* nw, float eps,         \
             float* x_out, float* xn, int experts, int k, int topk, int renormalise,             \
             u32* out_ids, float* out_weights) {                                                \
        gemv_route<CHUNK, L, true>(w, x, experts, k, topk, renormalise, out_ids, out_weights,   \
                                   RouteNorm{r, nw, eps, x_out, xn});                            \
    }
#else
// Elsewhere the entry points exist (the host loads every name) but stay empty and are never
// launched (ops/router.rs checks the compute capability).
#define GEMV_ROUTE_KERNEL(NAME, CHUNK, L)                                                        \
    extern "C" __global__ void NAME(const void* w, const float* x, int experts, int k, int topk, \
                                    int renormalise, u32* out_ids, float* out_weights) {}
#define GEMV_ROUTE_NORM_KERNEL(NAME, CHUNK, L)                                                   \
    extern "C" __global__ void NAME(const void* w, const float* x, const float* r,              \
                                    const float* nw, float eps, float* x_out, float* xn,         \
                                    int experts, int k, int topk, int renormalise,               \
                                    u32* out_ids, float* out_weights) {}
#endif

GEMV_ROUTE_KERNEL(gemv_route_bf16_l1, ChunkBf16, 1)
GEMV_ROUTE_KERNEL(gemv_route_bf16_l2, ChunkBf16, 2)
GEMV_ROUTE_KERNEL(gemv_route_bf16_l4, ChunkBf16, 4)
GEMV_ROUTE_KERNEL(gemv_route_f16_l1, ChunkF16, 1)
GEMV_ROUTE_KERNEL(gemv_route_f16_l2, ChunkF16, 2)
GEMV_ROUTE_KERNEL(gemv_route_f16_l4, ChunkF16, 4)
GEMV_ROUTE_KERNEL(gemv_route_f32_l1, ChunkF32, 1)
GEMV_ROUTE_KERNEL(gemv_route_f32_l2, ChunkF32, 2)
GEMV_ROUTE_KERNEL(gemv_route_f32_l4, ChunkF32, 4)

GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_bf16_l1, ChunkBf16, 1)
GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_bf16_l2, ChunkBf16, 2)
GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_bf16_l4, ChunkBf16, 4)
GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_f16_l1, ChunkF16, 1)
GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_f16_l2, ChunkF16, 2)
GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_f16_l4, ChunkF16, 4)
GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_f32_l1, ChunkF32, 1)
GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_f32_l2, ChunkF32, 2)
GEMV_ROUTE_NORM_KERNEL(gemv_route_norm_f32_l4, ChunkF32, 4)

// ---- one token's o_proj with its MoE layer's routing ahead of the norm (the route ahead) ----
//
// A MoE layer routes n(x + o) (n the post-attention RMSNorm, x the residual, o = W_o a the
// attention's output projection): logits_e = inv * sum_j R[e, j] nw[j] (x[j] + o[j]), inv > 0 the
// norm's one scale. Ranked by logit / inv, the experts come from
//   u_e = sum_j R[e, j] (nw[j] x[j]) + sum_i F[e, i] a[i],   F = R diag(nw) W_o (f32, folded once
// at upload: route_fold_<dt>), which needs neither o nor the norm: the routing runs beside o_proj
// instead of after it (the router and its top-k were ~3.1 µs of a batch-1 decode layer's chain,
// DRAM idle). inv only enters the routing weights, which the experts' gate_up makes once it has
// the norm (moe.cu's moe_tiny_gate_up_norm, warp_route_weights).
// gemv_rows_route_<dt>_l<L>: grid ceil(E / RA_ROWS) + ceil(n / 4), block 256. The first
// ceil(E / RA_ROWS) blocks (dispatched first, so they are resident beside attention) each make u
// for RA_ROWS experts: R's rows . (nw x) before the programmatic wait (x, the residual, comes from
// the q/k/v GEMV two kernels back: graph::EARLY_ACTIVATION_READERS), F's first RA_PRE float4 a
// thread loaded before it, then . a. Each stores its u, counts itself in `arrived`, and the
// block that arrives last ranks u (warp_route_topk: the ids alone), zeroes the count for the
// next launch and stores the ids, which block 0 set to ROUTE_ID_UNSET (and fenced) after its
// wait and before it let the successor launch (never before the wait: the ids are a pass's
// activation buffer, whose bytes an earlier kernel may still be using until then). The successor
// (moe_tiny_gate_up_norm) polls its id before its programmatic wait and, once it is set, starts
// streaming that expert's weights while this kernel ends. topk <= 32 (the host checks). The
// other blocks are gemv_rows_<dt>_m1's for o (the same bits).
// Every u is one block's fixed sum (per thread in order, warp_sum's tree, warps in order): the
// same ids for the same inputs, whichever block arrives last.
#define RA_ROWS 2  // ops/route_ahead.rs' ROUTE_ROWS_PER_BLOCK (1 measured 0.3% slower)
#define RA_PRE 4

template <typename C, int L>
__device__ __forceinline__ void route_ahead_block(const void* __restrict__ router,
                                                  const float* __restrict__ fold,
                                                  const float* x, const float* __restrict__ nw,
                                                  const float* a, int experts, int hidden,
                                                  int width, int topk, float* u,
                                                  u32* out_ids, u32* arrived,
                                                  int block) {
    __shared__ float partial[ROWS_WARPS][RA_ROWS];
    __shared__ float logits[32 * L];
    __shared__ u32 ranked[32];  // topk <= 32
    __shared__ int last;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int e0 = block * RA_ROWS;
    const int rows_here = min(RA_ROWS, experts - e0);  // >= 1, block-uniform
    const int fchunks = width / 4;                       // float4 of F's rows
    const uint4* f = reinterpret_cast<const uint4*>(fold) + (u64)e0 * fchunks;

    uint4 fq[RA_PRE][RA_ROWS];
#pragma unroll
    for (int i = 0; i < RA_PRE; ++i)
#pragma unroll
        for (int r = 0; r < RA_ROWS; ++r) {
            const int c = tid + ROWS_THREADS * i;
            fq[i][r] = r < rows_here && c < fchunks ? load_stream_early(f + (u64)r * fchunks + c)
                                                    : make_uint4(0u, 0u, 0u, 0u);
        }
    float acc[RA_ROWS];
#pragma unroll
    for (int r = 0; r < RA_ROWS; ++r) acc[r] = 0.0f;
    // R's rows . (nw x), before the wait.
    const int rchunks = hidden / C::N;
    const uint4* w = reinterpret_cast<const uint4*>(router) + (u64)e0 * rchunks;
    for (int c = tid; c < rchunks; c += ROWS_THREADS) {
        float xv[C::N];
#pragma unroll
        for (int v = 0; v < C::N / 4; ++v) {
            const float4 xx = load_early4(x + (u64)c * C::N + 4 * v);
            const float4 nn = load_early4(nw + (u64)c * C::N + 4 * v);
            xv[4 * v] = nn.x * xx.x;
            xv[4 * v + 1] = nn.y * xx.y;
            xv[4 * v + 2] = nn.z * xx.z;
            xv[4 * v + 3] = nn.w * xx.w;
        }
#pragma unroll
        for (int r = 0; r < RA_ROWS; ++r) {
            if (r < rows_here) {
                float wf[C::N];
                C::widen(load_stream_early(w + (u64)r * rchunks + c), wf);
#pragma unroll
                for (int i = 0; i < C::N; ++i) acc[r] = fmaf(wf[i], xv[i], acc[r]);
            }
        }
    }
    pdl_wait();
    if (block == 0) {
        // The ids to ROUTE_ID_UNSET, after the wait (the buffer is the pass's: before it, an
        // earlier kernel may still use those bytes) and before this block lets the successor
        // launch, which polls them (the last launch left them set).
        if (tid < topk) {
            out_ids[tid] = ROUTE_ID_UNSET;
            __threadfence();
        }
        __syncthreads();
    }
    pdl_launch_dependents();
    // F's rows . a: the preloaded float4s, then any past them.
    auto fma4 = [&](int r, uint4 q, float4 av) {
        acc[r] = fmaf(__uint_as_float(q.x), av.x, acc[r]);
        acc[r] = fmaf(__uint_as_float(q.y), av.y, acc[r]);
        acc[r] = fmaf(__uint_as_float(q.z), av.z, acc[r]);
        acc[r] = fmaf(__uint_as_float(q.w), av.w, acc[r]);
    };
#pragma unroll
    for (int i = 0; i < RA_PRE; ++i) {
        const int c = tid + ROWS_THREADS * i;
        if (c < fchunks) {
            const float4 av = *reinterpret_cast<const float4*>(a + (u64)c * 4);
#pragma unroll
            for (int r = 0; r < RA_ROWS; ++r) fma4(r, fq[i][r], av);
        }
    }
    for (int c = tid + ROWS_THREADS * RA_PRE; c < fchunks; c += ROWS_THREADS) {
        const float4 av = *reinterpret_cast<const float4*>(a + (u64)c * 4);
#pragma unroll
        for (int r = 0; r < RA_ROWS; ++r)
            if (r < rows_here) fma4(r, load_stream(f + (u64)r * fchunks + c), av);
    }
#pragma unroll
    for (int r = 0; r < RA_ROWS; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = v;
    }
    __syncthreads();
    if (tid < rows_here) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS_WARPS; ++i) s += partial[i][tid];
        u[e0 + tid] = s;
        __threadfence();  // u before the count: the last block reads it
    }
    __syncthreads();
    if (tid == 0) {
        const int blocks = (experts + RA_ROWS - 1) / RA_ROWS;
        last = atomicAdd(arrived, 1u) == (u32)(blocks - 1);
    }
    __syncthreads();
    if (!last || warp != 0) return;
    __threadfence();
#pragma unroll
    for (int s = 0; s < L; ++s) {
        const int i = 32 * s + lane;
        if (i < experts) logits[i] = load_cg(u + i);
    }
    __syncwarp();
    warp_route_topk<L, false>(logits, experts, topk, 0, ranked, nullptr);
    __syncwarp();
    if (lane < topk) store_relaxed(out_ids + lane, ranked[lane]);
    if (lane == 0) *arrived = 0u;  // the next launch counts from zero
}

// MINB: blocks an SM; bf16 and f16 at 4 (64 registers, as gemv_rows_<dt>_m1; unbounded, the
// route's wait split took 76), f32 at 2 (at 3 its l4 build spilled).
#define GEMV_ROWS_ROUTE_KERNEL(NAME, CHUNK, L, MINB)                                             \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS, MINB)                             \
        NAME(const void* w, const float* a, float* y, int n, int k, const void* router,         \
             const float* fold, const float* x, const float* nw, int experts, int hidden,        \
             int topk, float* u, u32* out_ids, u32* arrived) {                                   \
        const int route_blocks = (experts + RA_ROWS - 1) / RA_ROWS;                             \
        if ((int)blockIdx.x < route_blocks)                                                      \
            route_ahead_block<CHUNK, L>(router, fold, x, nw, a, experts, hidden, k, topk, u,     \
                                        out_ids, arrived, blockIdx.x);                           \
        else                                                                                     \
            gemv_block_rows<CHUNK, 1, 2>(w, a, y, n, k, (int)blockIdx.x - route_blocks);         \
    }

GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_bf16_l1, ChunkBf16, 1, 4)
GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_bf16_l2, ChunkBf16, 2, 4)
GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_bf16_l4, ChunkBf16, 4, 4)
GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_f16_l1, ChunkF16, 1, 4)
GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_f16_l2, ChunkF16, 2, 4)
GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_f16_l4, ChunkF16, 4, 4)
GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_f32_l1, ChunkF32, 1, 2)
GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_f32_l2, ChunkF32, 2, 2)
GEMV_ROWS_ROUTE_KERNEL(gemv_rows_route_f32_l4, ChunkF32, 4, 2)

// route_fold_<dt>: F = R diag(nw) W_o for the route ahead, once at upload. F[e, i] =
// sum_j R[e, j] nw[j] W_o[j, i] (R: E x H, W_o: H x width, both in the stored dtype), summed in
// f64 in ascending j and rounded to f32 once. Grid (ceil(width / 256), E), block 256: thread i of
// block (bx, e) makes F[e, 256 bx + i]; the row of R diag(nw) goes through shared memory in tiles.
template <typename T>
__device__ __forceinline__ float elem_f32(const T* p, u64 i);
template <>
__device__ __forceinline__ float elem_f32<u16>(const u16* p, u64 i) {
    return __uint_as_float((u32)p[i] << 16);
}
template <>
__device__ __forceinline__ float elem_f32<float>(const float* p, u64 i) {
    return p[i];
}
struct F16Elem {
    u16 bits;
};
template <>
__device__ __forceinline__ float elem_f32<F16Elem>(const F16Elem* p, u64 i) {
    return f16_to_f32(p[i].bits);
}

template <typename T>
__device__ __forceinline__ void route_fold(const T* __restrict__ router,
                                           const float* __restrict__ nw,
                                           const T* __restrict__ w_o, int hidden, int width,
                                           float* __restrict__ fold) {
    __shared__ double rn[256];
    const int e = blockIdx.y;
    const int i = blockIdx.x * 256 + threadIdx.x;
    double acc = 0.0;
    for (int j0 = 0; j0 < hidden; j0 += 256) {
        const int j = j0 + threadIdx.x;
        __syncthreads();
        rn[threadIdx.x] =
            j < hidden ? (double)elem_f32<T>(router, (u64)e * hidden + j) * (double)nw[j] : 0.0;
        __syncthreads();
        if (i < width) {
            const int jn = min(256, hidden - j0);
            for (int t = 0; t < jn; ++t)
                acc += rn[t] * (double)elem_f32<T>(w_o, (u64)(j0 + t) * width + i);
        }
    }
    if (i < width) fold[(u64)e * width + i] = (float)acc;
}

extern "C" __global__ void __launch_bounds__(256)
    route_fold_bf16(const u16* router, const float* nw, const u16* w_o, int hidden, int width,
                    float* fold) {
    route_fold<u16>(router, nw, w_o, hidden, width, fold);
}
extern "C" __global__ void __launch_bounds__(256)
    route_fold_f16(const u16* router, const float* nw, const u16* w_o, int hidden, int width,
                   float* fold) {
    route_fold<F16Elem>(reinterpret_cast<const F16Elem*>(router), nw,
                        reinterpret_cast<const F16Elem*>(w_o), hidden, width, fold);
}
extern "C" __global__ void __launch_bounds__(256)
    route_fold_f32(const float* router, const float* nw, const float* w_o, int hidden, int width,
                   float* fold) {
    route_fold<float>(router, nw, w_o, hidden, width, fold);
}
