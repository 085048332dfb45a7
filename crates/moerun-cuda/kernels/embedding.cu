// Embedding gather: out[t, :] = widen(table[ids[t], :]) for a bf16, f16 or f32 table.
// The ids were checked against the vocabulary on the host before upload.
// Launch: grid (tokens), block 256; each block copies one row.

template <typename T, typename Widen>
__device__ __forceinline__ void embed_rows(const T* __restrict__ table, const u32* __restrict__ ids,
                                           float* __restrict__ out, int hidden) {
    const u64 src = (u64)ids[blockIdx.x] * hidden;
    float* dst = out + (u64)blockIdx.x * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = Widen::at(table, src + j);
}

extern "C" __global__ void embed_bf16(const u16* table, const u32* ids, float* out, int hidden) {
    embed_rows<u16, WidenBf16>(table, ids, out, hidden);
}
extern "C" __global__ void embed_f16(const u16* table, const u32* ids, float* out, int hidden) {
    embed_rows<u16, WidenF16>(table, ids, out, hidden);
}
extern "C" __global__ void embed_f32(const float* table, const u32* ids, float* out, int hidden) {
    embed_rows<float, WidenF32>(table, ids, out, hidden);
}
