// Helpers shared by every kernel file. compile.rs prepends this text to each .cu file before
// handing it to NVRTC, so the kernels need no include path and no CUDA headers at run time:
// bf16/f16 are handled as raw 16-bit patterns and widened with bit shifts or one PTX cvt.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 -> f32 is exact: a bf16 is the top half of an f32.
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// f16 -> f32 is exact; one hardware conversion.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 -> bf16, round to nearest even (NaN stays NaN), as half::bf16::from_f32 does on the CPU.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = lane < warps ? partial[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();  // `partial` may be reused by a following call
    return v;
}

__host__ __device__ constexpr int ilog2(int v) { return v <= 1 ? 0 : 1 + ilog2(v >> 1); }

// Warp reduce-scatter of NV per-lane partial sums, kept in groups of KEEP adjacent values (NV and
// KEEP powers of two, NV / KEEP at most 32): a step at lane offset o (16, 8, ..., warp_sum's
// order) sends half of the values a lane still holds to the lane o apart and keeps the other
// half, until KEEP are left; plain butterfly steps finish. Lane l then holds in x[0 .. KEEP) the
// warp's totals of values scatter_first<NV, KEEP>(l) onwards. Each total is the same tree of the
// same additions as warp_sum gives it, so the same bits, for about NV shuffles instead of 5 NV
// (a GEMV of 8 tokens reduced 32 sums a lane with 160). Lanes that differ only in their low bits
// hold the same totals; scatter_writer picks one of them.
template <int NV, int KEEP = 1, int K = 0>
__device__ __forceinline__ void warp_reduce_scatter(float (&x)[NV], int lane) {
    static_assert((1 << ilog2(NV)) == NV && (1 << ilog2(KEEP)) == KEEP && KEEP <= NV &&
                      NV / KEEP <= 32,
                  "powers of two, at most a warp's worth of groups");
    // One step per instantiation, so that every index is a constant and x stays in registers.
    if constexpr (K < 5) {
        constexpr int o = 16 >> K;
        if constexpr ((KEEP << K) < NV) {
            constexpr int half = NV >> (K + 1);
            const bool up = (lane & o) != 0;
#pragma unroll
            for (int j = 0; j < half; ++j) {
                const float send = up ? x[j] : x[j + half];
                const float keep = up ? x[j + half] : x[j];
                x[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        } else {
#pragma unroll
            for (int j = 0; j < KEEP; ++j) x[j] += __shfl_xor_sync(0xffffffffu, x[j], o);
        }
        warp_reduce_scatter<NV, KEEP, K + 1>(x, lane);
    }
}

// The first of the values whose totals warp_reduce_scatter<NV, KEEP> leaves in `lane`.
template <int NV, int KEEP = 1>
__device__ __forceinline__ int scatter_first(int lane) {
    constexpr int NH = ilog2(NV / KEEP);
    int h = 0;
#pragma unroll
    for (int k = 0; k < NH; ++k)
        if (lane & (16 >> k)) h |= NV >> (k + 1);
    return h;
}

// Whether `lane` is the one lane that writes its totals (of those holding the same ones).
template <int NV, int KEEP = 1>
__device__ __forceinline__ bool scatter_writer(int lane) {
    return (lane & ((32 >> ilog2(NV / KEEP)) - 1)) == 0;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One warp copies a head's d values from src into hd (shared memory), lane l taking l, l + 32,
// ...; returns the lane's sum of their squares (warp_sum gives the head's): the first step of
// the attention prologue's per-head RMSNorm (fused.cu; attention.cu's fold copies the head in
// asynchronously and sums the squares in this order).
__device__ __forceinline__ float stage_head(const float* src, float* hd, int d, int lane) {
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) {
        const float x = src[i];
        hd[i] = x;
        ss += x * x;
    }
    return ss;
}

// 16-byte asynchronous copy global -> shared; `src_bytes` 0 writes zeros (and reads nothing).
// (hopper.cuh's overload takes a shared-window address and a bool.)
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- rotary embedding (rotate half), shared by every kernel that rotates ----

// cos and sin of angle inv_freq * pos in f32 (as transformers computes it), each scaled by the
// attention factor.
__device__ __forceinline__ void rope_cos_sin(float inv_freq, int pos, float factor, float& c,
                                             float& s) {
    sincosf(inv_freq * (float)pos, &s, &c);
    c *= factor;
    s *= factor;
}

// The rotated pair (x, y) -> (x c - y s, y c + x s), each as the second product rounded, then
// one fused multiply-add. Spelled out so that every kernel rounds alike: left to contraction,
// ptxas fused one product or the other depending on the kernel, and the attention prologue
// folded into attention differed from the prologue kernel by an ulp in ~1/8 of the rotated keys.
__device__ __forceinline__ void rope_pair(float& x, float& y, float c, float s) {
    const float rx = __fmaf_rn(x, c, -__fmul_rn(y, s));
    const float ry = __fmaf_rn(y, c, __fmul_rn(x, s));
    x = rx;
    y = ry;
}

// Widening of stored weights, one element at a time.
struct WidenBf16 { __device__ static float at(const u16* p, u64 i) { return bf16_to_f32(p[i]); } };
struct WidenF16 { __device__ static float at(const u16* p, u64 i) { return f16_to_f32(p[i]); } };
struct WidenF32 { __device__ static float at(const float* p, u64 i) { return p[i]; } };

// GELU, tanh approximation, as torch computes it in f32: kBeta = sqrt(2) * (2 / sqrt(pi)) * 0.5.
__device__ __forceinline__ float gelu_tanh_f32(float x) {
    const float beta = 0.7978845608028654f;
    const float kappa = 0.044715f;
    const float inner = beta * (x + kappa * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
}

// An expert's activation (ops/moe.rs ExpertActivation): 0 SiLU, x / (1 + exp(-x)), as
// transformers writes it; 1 GELU-tanh (Gemma 4).
__device__ __forceinline__ float expert_act(float g, int act) {
    return act == 1 ? gelu_tanh_f32(g) : g / (1.0f + expf(-g));
}

// ---- weight streaming, shared by the GEMV, MoE and attention kernels ----

// 16 bytes of read-once weights: not kept in L1 (ld.global.nc.L1::no_allocate).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// load_stream for a kernel's loads before its programmatic wait (pdl_entry): the same bytes
// through the coherent path. ptxas keeps a coherent load before griddepcontrol.wait, but it
// hoisted the wait above every ld.global.nc (legal for read-only data, and it undid the point of
// loading early): in the SASS of every GEMV the wait came first and the weights loaded after it.
__device__ __forceinline__ uint4 load_stream_early(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Four f32 activations for a kernel's loads before its programmatic wait, through the coherent
// path as load_stream_early (the kernel before does not write them: they may not come from it).
__device__ __forceinline__ float4 load_early4(const float* p) {
    float4 r;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
                 : "l"(p));
    return r;
}

// A 16-byte chunk of weights widened to f32.
struct ChunkBf16 {
    static constexpr int N = 8;
    __device__ static void widen(uint4 c, float* f) {
        const u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            f[2 * q] = __uint_as_float(w[q] << 16);
            f[2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
        }
    }
};
struct ChunkF16 {
    static constexpr int N = 8;
    __device__ static void widen(uint4 c, float* f) {
        const u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            f[2 * q] = f16_to_f32((u16)(w[q] & 0xffffu));
            f[2 * q + 1] = f16_to_f32((u16)(w[q] >> 16));
        }
    }
};
struct ChunkF32 {
    static constexpr int N = 4;
    __device__ static void widen(uint4 c, float* f) {
        f[0] = __uint_as_float(c.x);
        f[1] = __uint_as_float(c.y);
        f[2] = __uint_as_float(c.z);
        f[3] = __uint_as_float(c.w);
    }
};

// A load served by L2, the point of coherence: it sees what other blocks of the same launch
// published (after their fence), never a stale L1 line.
__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// Programmatic dependent launch (Hopper and later). In a captured decode graph, graph.rs turns
// the edge into each kernel named in `graph::PDL_KERNELS` programmatic: the kernel may launch
// while the one before it still runs. Such a kernel calls pdl_entry() before it touches memory
// that an earlier kernel writes or reads (it may first pull read-only weights towards L2, the
// point of launching early): griddepcontrol.wait returns once the previous kernel has finished
// and its writes are visible. It then lets the next kernel launch, so at most one kernel waits
// ahead of the running one. Launched any other way, both instructions do nothing.
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// pdl_entry's two halves, for a kernel that lets its successor launch later than its wait.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The entry of a latency-bound kernel of few blocks (graph::LAUNCH_FIRST_KERNELS: the norms, the
// attention prologue, route_topk) whose successor streams weights before its own wait: it lets
// the successor launch *before* waiting, so the successor's blocks become resident, and start
// their loads, while the kernel before this one still runs (docs/perf/cuda-model.md v10). The
// successor's pre-wait part then runs up to two kernels early, so it may read nothing this kernel
// or the one before it writes: add_rms_norm's residual and moe_tiny_down's expert ids are such
// reads, and graph capture keeps plain the edges into them from these kernels
// (graph::EARLY_ACTIVATION_READERS). After its own wait the successor sees everything before, as
// with pdl_entry: this kernel completes only after its wait, so after the one before it.
__device__ __forceinline__ void pdl_entry_launch_first() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A word one kernel hands the next while both run (the route ahead's ids, gemv.cu): stored and
// polled at GPU scope (through L2, never a stale L1 line). The word is all the reader takes from
// it: no ordering of other data is implied.
// The route ahead's "not ranked yet" id (gemv.cu stores it, moe.cu polls past it): never a
// ranked id, which is < E or warp_route_topk's 0x7fffffff.
#define ROUTE_ID_UNSET 0xffffffffu
__device__ __forceinline__ void store_relaxed(u32* p, u32 v) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 load_relaxed(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// ---- thread-block clusters (sm_90+; only kernels built for sm_90 call these) ----
//
// Blocks of a cluster exchange data by st.async into each other's shared memory, counted by the
// receiver's mbarrier, rather than by reading each other's shared memory between cluster
// barriers: `barrier.cluster.arrive.release` (and `fence.acq_rel.cluster`) is a GPU-wide MEMBAR
// in the SASS, ~1-2 µs on a decode step's path (docs/perf/cuda-model.md v15).

// Wait (acquire) on the cluster barrier; every thread of every block of the cluster must take
// part. Its arrive is relaxed (cluster_arrive_relaxed), never a release one (above).
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Arrive without ordering anything (no fence): for a start-of-kernel barrier that publishes
// mbarriers' initialisation (fence_mbarrier_init before it orders that).
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
// The shared-memory address of a generic pointer into this block's shared memory.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// mbarriers (transaction barriers; hopper.cuh has the rest of their primitives, for its files).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Arrive once and expect `bytes` more of asynchronous stores (st.async, TMA) in this phase.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// Wait for the phase of parity `parity` to complete, acquiring at cluster scope (what other
// CTAs of the cluster stored or arrived with is visible after it).
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

// Every thread, before the cluster barrier that publishes this block's mbarriers (mbar_init).
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Stores into another block's shared memory (shared::cluster addresses, cluster_addr) that
// signal its mbarrier `bar` (also a shared::cluster address) with their bytes: no fence, no
// cluster barrier (a release barrier costs a GPU-wide MEMBAR in the SASS).
__device__ __forceinline__ void st_async4(u32 addr, float4 v, u32 bar) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
        ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void st_async1(u32 addr, float x, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                 ::"r"(addr), "f"(x), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void st_async2(u32 addr, float x, float y, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                 ::"r"(addr), "f"(x), "f"(y), "r"(bar)
                 : "memory");
}

// The shared::cluster address of `p` (in this block's shared memory) in block `rank`.
__device__ __forceinline__ u32 cluster_addr(const void* p, u32 rank) {
    const u32 local = smem_u32(p);
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
    return r;
}

// ---- phase probes (built only with MOERUN_CUDA_DEFINES="-DMOERUN_PROBE"; compile.rs) ----
//
// Where a latency-bound kernel's time goes, block by block: probe_begin() at the kernel's entry
// (before any early return) takes the block's ticket and stamps %globaltimer and clock64;
// probe_mark(i) (i in 1..PROBE_MARKS) stamps clock64 where thread 0 passes a phase's end;
// probe_end(name) prints one line per block of the launches MOERUN_PROBE_FROM ..
// + MOERUN_PROBE_LAUNCHES of that kernel (tickets count blocks in launch order, one counter per
// kernel file, so probe one kernel per file): the block, its SM, its start and end times (ns)
// and each mark's cycles since its start (-1: not reached). scripts/probes/phases.py
// summarises them. Without MOERUN_PROBE all three are empty.
#define PROBE_MARKS 20
#ifdef MOERUN_PROBE
#ifndef MOERUN_PROBE_FROM
#define MOERUN_PROBE_FROM 2000
#endif
#ifndef MOERUN_PROBE_LAUNCHES
#define MOERUN_PROBE_LAUNCHES 3
#endif
__device__ unsigned int probe_tickets;
__shared__ long long probe_clock[PROBE_MARKS];
__shared__ unsigned long long probe_t0;
__shared__ unsigned int probe_ticket;
__device__ __forceinline__ bool probe_thread0() {
    return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
}
__device__ __forceinline__ unsigned long long probe_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void probe_begin() {
    if (!probe_thread0()) return;
    probe_t0 = probe_now();
    probe_clock[0] = clock64();
    for (int i = 1; i < PROBE_MARKS; ++i) probe_clock[i] = -1;
    probe_ticket = atomicAdd(&probe_tickets, 1u);
}
__device__ __forceinline__ void probe_mark(int i) {
    if (probe_thread0()) probe_clock[i] = clock64();
}
__device__ __forceinline__ void probe_end(const char* name) {
    if (!probe_thread0()) return;
    const unsigned long long t1 = probe_now();
    const unsigned int blocks = gridDim.x * gridDim.y * gridDim.z;
    const unsigned int launch = probe_ticket / blocks;
    if (launch < MOERUN_PROBE_FROM || launch >= MOERUN_PROBE_FROM + MOERUN_PROBE_LAUNCHES) return;
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    long long m[PROBE_MARKS];
    for (int i = 1; i < PROBE_MARKS; ++i)
        m[i] = probe_clock[i] < 0 ? -1 : probe_clock[i] - probe_clock[0];
    printf("PROBE %s launch %u block %u %u %u sm %u t0 %llu t1 %llu marks %lld %lld %lld %lld %lld "
           "%lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld\n",
           name, launch, blockIdx.x, blockIdx.y, blockIdx.z, sm, probe_t0, t1, m[1], m[2], m[3],
           m[4], m[5], m[6], m[7], m[8], m[9], m[10], m[11], m[12], m[13], m[14], m[15], m[16],
           m[17], m[18], m[19]);
}
#else
__device__ __forceinline__ void probe_begin() {}
__device__ __forceinline__ void probe_mark(int) {}
__device__ __forceinline__ void probe_end(const char*) {}
#endif

// ---- MoE routing by one warp (route_topk in router.cu, gemv_route in gemv.cu) ----

// Warp-wide max / min of a u32: one redux.sync (sm_80+, the least the backend runs on).
__device__ __forceinline__ u32 warp_max_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 warp_min_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
// Warp-wide max of a float that is not NaN (warp_max's value) as one redux of keys that order
// like the floats: sign bit set, the rest kept, for >= +0; all bits flipped below.
__device__ __forceinline__ float warp_max_redux(float v) {
    const u32 b = __float_as_uint(v);
    const u32 m = warp_max_u32((b & 0x80000000u) ? ~b : (b | 0x80000000u));
    return __uint_as_float((m & 0x80000000u) ? (m & 0x7fffffffu) : ~m);
}

// One token's routing by one warp, the steps of moerun-model's `route`: softmax of the f32 router
// logits (max-subtracted; each lane sums its experts lane, lane + 32, ... in order, then a fixed
// butterfly), top-k by probability with ties to the lower expert index, then optionally the k
// weights renormalised to sum to one (summed in rank order). experts <= 32 * ROUTE_PER_LANE.
// Lane l holds experts l + 32 s in registers; a probability's f32 bits order like
// the probability (it is >= 0), so each round is a warp max of (bits + 1) keys (taken: 0) and a
// warp min of the indices holding it. A NaN probability never wins: with only NaNs left the id
// is out of range (0x7fffffff) and the weight -2, so the token's expert sum becomes NaN downstream.
// A routing warp's softmax numerators: p[s] holds the logit of expert lane + 32 s (those <
// experts) and mx the lane's largest, taken as they loaded; p leaves with exp(p - max) over the
// warp's experts, and it returns 1 / their sum. Shared by warp_route_topk and
// warp_route_weights: the same probabilities from the same logits.
template <int ROUTE_PER_LANE>
__device__ __forceinline__ float warp_softmax_exp(float (&p)[ROUTE_PER_LANE], float mx,
                                                  int experts) {
    const int lane = threadIdx.x & 31;
    mx = warp_max_redux(mx);  // one redux where warp_max took five dependent shuffles
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < ROUTE_PER_LANE; ++s) {
        if (32 * s + lane < experts) {
            p[s] = expf(p[s] - mx);
            sum += p[s];
        }
    }
    return 1.0f / warp_sum(sum);
}

// WEIGHTS = false: the ids alone (the route ahead ranks logits whose scale is not known yet,
// gemv.cu's gemv_rows_route; out_weights is not touched).
template <int ROUTE_PER_LANE, bool WEIGHTS = true>
__device__ __forceinline__ void warp_route_topk(const float* __restrict__ logits, int experts, int k,
                                                int renormalise, u32* __restrict__ out_ids,
                                                float* __restrict__ out_weights) {
    const int lane = threadIdx.x & 31;
    float p[ROUTE_PER_LANE];
    float mx = __int_as_float(0xff800000);  // -inf
#pragma unroll
    for (int s = 0; s < ROUTE_PER_LANE; ++s) {
        const int i = 32 * s + lane;
        p[s] = i < experts ? logits[i] : 0.0f;
        if (i < experts) mx = fmaxf(mx, p[s]);
    }
    const float inv = warp_softmax_exp<ROUTE_PER_LANE>(p, mx, experts);
    u32 key[ROUTE_PER_LANE];
#pragma unroll
    for (int s = 0; s < ROUTE_PER_LANE; ++s) {
        const float v = p[s] * inv;
        key[s] = 32 * s + lane < experts && v >= 0.0f ? __float_as_uint(v) + 1u : 0u;
    }
    probe_mark(6);  // gemv_route's block 0 (phase probes): the keys made
    float total = 0.0f;  // every lane: the chosen weights summed in rank order
    // Rank r's id and weight stay with lane r % 32 (slot r / 32; k <= experts) and are stored
    // once the k rounds are done, by all lanes at once: stored per round by lane 0 and read
    // back for the renormalisation, they were a chain of dependent global round trips.
    u32 my_id[ROUTE_PER_LANE];
    float my_w[ROUTE_PER_LANE];
    for (int r = 0; r < k; ++r) {
        u32 bk = 0u, bi = 0xffffffffu;
#pragma unroll
        for (int s = 0; s < ROUTE_PER_LANE; ++s) {
            if (key[s] > bk) {  // ascending index within a lane: strict > keeps the lower one
                bk = key[s];
                bi = 32 * s + lane;
            }
        }
        const u32 best = warp_max_u32(bk);
        const u32 at = warp_min_u32(best != 0u && bk == best ? bi : 0xffffffffu);
        const float w = best != 0u ? __uint_as_float(best - 1u) : -2.0f;
#pragma unroll
        for (int s = 0; s < ROUTE_PER_LANE; ++s) {
            if (32 * s + lane == r) {
                my_id[s] = best != 0u ? at : 0x7fffffffu;
                my_w[s] = w;
            }
        }
        total += w;
#pragma unroll
        for (int s = 0; s < ROUTE_PER_LANE; ++s)
            if (32 * s + lane == (int)at) key[s] = 0u;
    }
    probe_mark(7);  // the k rounds done
#pragma unroll
    for (int s = 0; s < ROUTE_PER_LANE; ++s) {
        const int r = 32 * s + lane;
        if (r < k) {
            out_ids[r] = my_id[s];
            if constexpr (WEIGHTS) out_weights[r] = renormalise ? my_w[s] / total : my_w[s];
        }
    }
}

// The routing weights of experts already chosen (rank r's id in lane r's `my_id`, k <= 32), from
// logits known up to a positive scale (the route ahead: logits = scale * u, gemv.cu's
// gemv_rows_route; lane l's `uv[s]` holds u[l + 32 s], read by the caller): the softmax over
// all experts and the optional renormalisation exactly as warp_route_topk makes them from
// scale * u. An out-of-range id (warp_route_topk's NaN case) gets the weight -2, as there.
template <int ROUTE_PER_LANE>
__device__ __forceinline__ void warp_route_weights(const float (&uv)[ROUTE_PER_LANE], int experts,
                                                   float scale, u32 my_id, int k,
                                                   int renormalise, float* out_weights) {
    const int lane = threadIdx.x & 31;
    float p[ROUTE_PER_LANE];
    float mx = __int_as_float(0xff800000);  // -inf
#pragma unroll
    for (int s = 0; s < ROUTE_PER_LANE; ++s) {
        const int i = 32 * s + lane;
        p[s] = i < experts ? uv[s] * scale : 0.0f;
        if (i < experts) mx = fmaxf(mx, p[s]);
    }
    const float inv = warp_softmax_exp<ROUTE_PER_LANE>(p, mx, experts);
    float total = 0.0f;
    float mine = 0.0f;  // lane r: rank r's weight
    for (int r = 0; r < k; ++r) {
        const u32 id = __shfl_sync(0xffffffffu, my_id, r);
        const int slot = (int)(id >> 5);
        float v = 0.0f;
#pragma unroll
        for (int s = 0; s < ROUTE_PER_LANE; ++s)
            if (s == slot) v = p[s];
        v = __shfl_sync(0xffffffffu, v, (int)(id & 31u));
        const float w = id < (u32)experts ? v * inv : -2.0f;
        total += w;
        if (lane == r) mine = w;
    }
    if (lane < k) out_weights[lane] = renormalise ? mine / total : mine;
}
