// Embedding gather: out[t, :] = widen(table[ids[t], :]) for a bf16, f16 or f32 table.
// An id outside the table (`>= rows`) yields a row of NaN instead of reading out of bounds: ids
// already on the device (a CUDA graph's inputs) cannot be checked on the host at launch.
// Launch: grid (tokens), block 256; each block copies one row.

template <typename T, typename Widen>
__device__ __forceinline__ void embed_rows(const T* __restrict__ table, const u32* __restrict__ ids,
                                           float* __restrict__ out, int hidden, u32 rows) {
    pdl_entry();
    const u32 id = ids[blockIdx.x];
    float* dst = out + (u64)blockIdx.x * hidden;
    if (id >= rows) {
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = __int_as_float(0x7fc00000);
        return;
    }
    const u64 src = (u64)id * hidden;
    // EMBED_PER loads a thread in flight before its stores: a plain loop issued one dependent
    // load-then-store after another, 8 round trips for a 2048-wide row (the decode step's first
    // kernel took 4.35 us at batch 1 on the H200).
    constexpr int EMBED_PER = 8;
    for (int base = threadIdx.x; base < hidden; base += EMBED_PER * blockDim.x) {
        float v[EMBED_PER];
#pragma unroll
        for (int u = 0; u < EMBED_PER; ++u) {
            const int j = base + u * blockDim.x;
            v[u] = j < hidden ? Widen::at(table, src + j) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < EMBED_PER; ++u) {
            const int j = base + u * blockDim.x;
            if (j < hidden) dst[j] = v[u];
        }
    }
}

extern "C" __global__ void embed_bf16(const u16* table, const u32* ids, float* out, int hidden, u32 rows) {
    embed_rows<u16, WidenBf16>(table, ids, out, hidden, rows);
}
extern "C" __global__ void embed_f16(const u16* table, const u32* ids, float* out, int hidden, u32 rows) {
    embed_rows<u16, WidenF16>(table, ids, out, hidden, rows);
}
extern "C" __global__ void embed_f32(const float* table, const u32* ids, float* out, int hidden, u32 rows) {
    embed_rows<float, WidenF32>(table, ids, out, hidden, rows);
}
