// MoE routed experts, prefill path (ops/moe/prefill.rs): the elementwise steps around the two
// cuBLAS grouped GEMMs. Pairs are in group order q (moe_align's pairs[]: q -> pair p = t * k + r,
// pos[]: p -> q); only bf16 weights take this path.
//
// - moe_gather_bf16: grid P, block 256. Row q of xg = bf16(x[t]) for q's token t (round to
//   nearest even), the tensor cores' activations.
// - moe_silu_mul_bf16: grid P, block 256. In place on the gate_up output gu [P][2I]:
//   gu[q][j] = bf16(act(gu[q][j]) * gu[q][I + j]) in f32 (act: SiLU, or GELU-tanh
//   for Gemma 4; expert_act in common.cuh), so the down GEMM reads h with ldb = 2I.
// - moe_combine_bf16: grid n, block 256. out[t] = sum_r weights[t, r] * y[pos[t k + r]] in rank
//   order r = 0..k, f32.
// - moe_combine_checked_bf16: the same for the wgmma path (ops/moe/wgmma.rs), which reads no
//   offsets on the host: a token with a pair of id >= E gets NaN.

extern "C" __global__ void moe_gather_bf16(const float* __restrict__ x, const u32* __restrict__ pairs,
                                           u16* __restrict__ xg, int hidden, int top_k) {
    const u64 q = blockIdx.x;
    const u64 t = pairs[q] / (u32)top_k;
    const float4* src = reinterpret_cast<const float4*>(x + t * hidden);
    uint2* dst = reinterpret_cast<uint2*>(xg + q * hidden);
    for (int i = threadIdx.x; i < hidden / 4; i += blockDim.x) {
        const float4 v = src[i];
        const u32 lo = (u32)f32_to_bf16(v.x) | ((u32)f32_to_bf16(v.y) << 16);
        const u32 hi = (u32)f32_to_bf16(v.z) | ((u32)f32_to_bf16(v.w) << 16);
        dst[i] = make_uint2(lo, hi);
    }
}

extern "C" __global__ void moe_silu_mul_bf16(u16* __restrict__ gu, int inter, int act) {
    u16* row = gu + (u64)blockIdx.x * 2 * inter;
    for (int j = threadIdx.x; j < inter; j += blockDim.x) {
        const float g = bf16_to_f32(row[j]);
        const float u = bf16_to_f32(row[inter + j]);
        row[j] = f32_to_bf16(expert_act(g, act) * u);
    }
}

// out[t] = sum_r weights[t, r] * y[pos[t k + r]], r = 0..k in order (one fmaf per rank and
// element); places >= `invalid` are skipped. With hidden % 8 == 0 (rows 16-byte aligned) each
// thread takes 8 consecutive columns: one 16-byte load per rank, up to 8 ranks' loads in flight
// before their fmafs (a thread per column issued k dependent-free 2-byte loads per element: 66 us
// a layer at 4096 tokens of Qwen3-30B-A3B). The same chain per element, so the same bits.
#define COMBINE_RANKS 8
__device__ __forceinline__ void moe_combine_row(const u16* __restrict__ y, const u32* __restrict__ tp,
                                                const float* __restrict__ tw, float* __restrict__ o,
                                                int hidden, int top_k, u32 invalid) {
    if ((hidden & 7) != 0) {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            float s = 0.0f;
            for (int r = 0; r < top_k; ++r) {
                if (tp[r] < invalid) s = fmaf(tw[r], bf16_to_f32(y[(u64)tp[r] * hidden + c]), s);
            }
            o[c] = s;
        }
        return;
    }
    for (int c = 8 * threadIdx.x; c < hidden; c += 8 * blockDim.x) {
        float s[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = 0.0f;
        for (int r0 = 0; r0 < top_k; r0 += COMBINE_RANKS) {
            uint4 v[COMBINE_RANKS];
#pragma unroll
            for (int j = 0; j < COMBINE_RANKS; ++j) {
                const int r = r0 + j;
                v[j] = r < top_k && tp[r] < invalid
                           ? *reinterpret_cast<const uint4*>(y + (u64)tp[r] * hidden + c)
                           : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int j = 0; j < COMBINE_RANKS; ++j) {
                const int r = r0 + j;
                if (r >= top_k || tp[r] >= invalid) continue;
                const u32 words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    s[2 * i] = fmaf(tw[r], __uint_as_float(words[i] << 16), s[2 * i]);
                    s[2 * i + 1] = fmaf(tw[r], __uint_as_float(words[i] & 0xffff0000u), s[2 * i + 1]);
                }
            }
        }
        float4* dst = reinterpret_cast<float4*>(o + c);
        dst[0] = make_float4(s[0], s[1], s[2], s[3]);
        dst[1] = make_float4(s[4], s[5], s[6], s[7]);
    }
}

extern "C" __global__ void moe_combine_bf16(const u16* __restrict__ y, const u32* __restrict__ pos,
                                            const float* __restrict__ weights,
                                            float* __restrict__ out, int hidden, int top_k) {
    const u64 t = blockIdx.x;
    moe_combine_row(y, pos + t * top_k, weights + t * top_k, out + t * hidden, hidden, top_k,
                    0xffffffffu);
}

// As moe_combine_bf16, for the sync-free wgmma path (ops/moe/wgmma.rs), which never checks the
// ids on the host: a pair whose place is in group E (id >= E, offsets[E] .. offsets[E + 1]) had
// no expert run, so its token's output becomes NaN (as on the decode path), never a sum that
// silently drops a term.
extern "C" __global__ void moe_combine_checked_bf16(const u16* __restrict__ y,
                                                    const u32* __restrict__ pos,
                                                    const u32* __restrict__ offsets, int experts,
                                                    const float* __restrict__ weights,
                                                    float* __restrict__ out, int hidden,
                                                    int top_k) {
    const u64 t = blockIdx.x;
    const u32* tp = pos + t * top_k;
    const u32 invalid = offsets[experts];
    bool bad = false;
    for (int r = 0; r < top_k; ++r) bad |= tp[r] >= invalid;
    float* o = out + t * hidden;
    if (bad) {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) o[c] = __int_as_float(0x7fc00000);
        return;
    }
    moe_combine_row(y, tp, weights + t * top_k, o, hidden, top_k, invalid);
}
