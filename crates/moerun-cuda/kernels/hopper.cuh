// Hopper (sm_90a) primitives shared by the kernel files of compile::SM90A_FILES, prepended after
// common.cuh to those files only: mbarriers (beyond common.cuh's init, expect_tx and cluster
// wait), cp.async into shared memory, wgmma descriptors and the wgmma instructions the kernels
// use. Everything is inside __CUDA_ARCH_FEAT_SM90_ALL, so the
// same text compiles (to nothing) for any other target.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

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

// The accumulator operands of a wgmma: its register list ("%0, ..., %63" / "%64, ..., %127")
// and the matching "+f" bindings of d[B .. B + 64), written once for every wgmma wrapper.
#define WG_REGS_0_63                                                                             \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                     \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                           \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                           \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define WG_REGS_64_127                                                                           \
    "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"                           \
    "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"                           \
    "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"               \
    "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
#define WG_ACC8(d, B)                                                                            \
    "+f"(d[(B) + 0]), "+f"(d[(B) + 1]), "+f"(d[(B) + 2]), "+f"(d[(B) + 3]), "+f"(d[(B) + 4]),      \
        "+f"(d[(B) + 5]), "+f"(d[(B) + 6]), "+f"(d[(B) + 7])
#define WG_ACC64(d, B)                                                                           \
    WG_ACC8(d, (B) + 0), WG_ACC8(d, (B) + 8), WG_ACC8(d, (B) + 16), WG_ACC8(d, (B) + 24),         \
        WG_ACC8(d, (B) + 32), WG_ACC8(d, (B) + 40), WG_ACC8(d, (B) + 48), WG_ACC8(d, (B) + 56)

__device__ __forceinline__ void wg_mma(float (&d)[64], u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS_0_63
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC64(d, 0)
        : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wg_mma(float (&d)[128], u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WG_REGS_0_63 "," WG_REGS_64_127
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC64(d, 0), WG_ACC64(d, 64)
        : "l"(da), "l"(db), "r"(scale_d));
}

// ---- TMA completion and clusters of CTAs ----

// Arrive on the barrier at the same shared offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 rank) {
    asm volatile(
        "{\n.reg .b32 ra;\n"
        "mapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
