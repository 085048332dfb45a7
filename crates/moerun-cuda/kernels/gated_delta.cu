// Qwen3.5's layers on the device: the attention output gate (split of the doubled q_proj, sigmoid
// gate) and the Gated DeltaNet (causal conv + SiLU from each sequence's conv window, l2norm of
// q/k with beta/decay, the gated delta rule from each sequence's recurrent state, gated RMSNorm).
//
// A batch is a list of sequences, each a run of consecutive rows [seq_start[s], +seq_len[s]) of
// the flat batch; states[s] is the device address of sequence s's state slot (one buffer per
// slot: per Gated DeltaNet layer, the conv window [kernel-1][conv_dim] oldest input first, then
// [value_heads][key_dim][value_dim]). A sequence of zero rows touches nothing.
// The q|k|v rows of the conv output are [conv_dim] = q (key_heads * key_dim), k (same), v
// (value_heads * value_dim).

#define DELTA_MAX_TAPS 8
#define DELTA_MAX_DK 256
#define DELTA_MAX_THREADS 512

// Qwen3.5's q_proj gives each head its query then its gate, 2 * head_dim values; split them.
// n = rows * heads * head_dim. Launch: 1-D grid-stride, block 256.
extern "C" __global__ void split_query_gate_f32(const float* __restrict__ src, float* q,
                                                float* gate, u64 n, int head_dim) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const u64 rh = i / (u64)head_dim;
        const u64 j = i - rh * (u64)head_dim;
        const float* s = src + rh * 2 * (u64)head_dim;
        q[i] = s[j];
        gate[i] = s[j + head_dim];
    }
}

// x *= sigmoid(gate), sigmoid as moerun-cpu: 1 / (1 + exp(-g)). Launch: as above.
extern "C" __global__ void sigmoid_gate_f32(float* x, const float* __restrict__ gate, u64 n) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// Causal depthwise conv1d, then SiLU, over each sequence's rows of `x` ([rows, channels], in
// place), continuing from its conv window and leaving the last kernel-1 inputs there. Output t of
// channel c = silu(sum_j taps[j][c] * input[t - kernel + 1 + j][c]), summed over j in order (as
// moerun-cpu's causal_conv1d_silu). A thread walks one (sequence, channel) through its rows.
// Launch: grid (ceil(channels / 256), sequences), block 256.
extern "C" __global__ void deltanet_conv_silu_f32(float* x, const float* __restrict__ taps,
                                                  const u64* __restrict__ states,
                                                  const int* __restrict__ seq_start,
                                                  const int* __restrict__ seq_len, u64 conv_offset,
                                                  int channels, int kernel) {
    pdl_entry();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    const int len = seq_len[s];
    if (c >= channels || len == 0) return;
    float* window = (float*)states[s] + conv_offset;
    float tap[DELTA_MAX_TAPS];
    float hist[DELTA_MAX_TAPS];  // the kernel-1 previous inputs, oldest first
#pragma unroll
    for (int j = 0; j < DELTA_MAX_TAPS; j++) {
        tap[j] = j < kernel ? taps[(u64)j * channels + c] : 0.0f;
        hist[j] = j < kernel - 1 ? window[(u64)j * channels + c] : 0.0f;
    }
    float* row = x + (u64)seq_start[s] * channels + c;
    for (int t = 0; t < len; t++, row += channels) {
        const float in = *row;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < DELTA_MAX_TAPS; j++) {
            if (j < kernel - 1) acc += tap[j] * hist[j];
            else if (j == kernel - 1) acc += tap[j] * in;
        }
        *row = silu_f(acc);
#pragma unroll
        for (int j = 0; j < DELTA_MAX_TAPS - 1; j++) {
            if (j < kernel - 2) hist[j] = hist[j + 1];
            else if (j == kernel - 2) hist[j] = in;
        }
    }
#pragma unroll
    for (int j = 0; j < DELTA_MAX_TAPS; j++)
        if (j < kernel - 1) window[(u64)j * channels + c] = hist[j];
}

// Per row of the conv output: l2norm of every q and k head (x / sqrt(sum(x^2) + 1e-6), in place),
// beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) per value head (softplus as
// torch: x above 20 passes through). Launch: grid (rows), a warp per q/k head up to 32 warps
// (gated_delta.rs): at one token a row is a latency chain, and 4 warps walking 32 heads took
// ~6 µs a layer. A lane keeps its values of the head in registers between the sum and the scale.
extern "C" __global__ void deltanet_gates_f32(float* qkv, const float* __restrict__ b,
                                              const float* __restrict__ a,
                                              const float* __restrict__ a_log,
                                              const float* __restrict__ dt_bias, float* beta,
                                              float* g, int conv_dim, int key_heads, int key_dim,
                                              int value_heads) {
    pdl_entry();
    const int t = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* row = qkv + (u64)t * conv_dim;
    for (int hh = warp; hh < 2 * key_heads; hh += warps) {
        float* p = row + hh * key_dim;
        float v[DELTA_MAX_DK / 32];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < DELTA_MAX_DK / 32; ++j) {
            const int i = lane + 32 * j;
            v[j] = i < key_dim ? p[i] : 0.0f;
            if (i < key_dim) ss += v[j] * v[j];
        }
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss + 1e-6f);
#pragma unroll
        for (int j = 0; j < DELTA_MAX_DK / 32; ++j) {
            const int i = lane + 32 * j;
            if (i < key_dim) p[i] = v[j] * inv;
        }
    }
    for (int h = threadIdx.x; h < value_heads; h += blockDim.x) {
        const u64 i = (u64)t * value_heads + h;
        beta[i] = 1.0f / (1.0f + expf(-b[i]));
        const float x = a[i] + dt_bias[h];
        const float sp = x > 20.0f ? x : log1pf(expf(x));
        g[i] = -expf(a_log[h]) * sp;
    }
}

// The gated delta rule, token after token (transformers' recurrent form), for one (value head,
// sequence) per block from its state S [key_dim][value_dim]:
//   S *= e^g;  delta = beta (v - k^T S);  S += k (x) delta;  o = (q / sqrt(key_dim))^T S
// Thread (c, grp) = (tid % value_dim, tid / value_dim) keeps column c of rows grp + groups * i,
// i < ROWS, of S in registers (key_dim = groups * ROWS exactly); the column sums over rows are
// reduced across the groups through shared memory.
// Launch: grid (value_heads, sequences), block value_dim * groups (<= 512).
template <int ROWS>
__device__ __forceinline__ void gated_delta_recurrent(
    const float* __restrict__ qkv, const float* __restrict__ beta, const float* __restrict__ g,
    const u64* __restrict__ states, const int* __restrict__ seq_start,
    const int* __restrict__ seq_len, u64 rec_offset, int key_heads, int value_heads, int key_dim,
    int value_dim, int groups, int conv_dim, float* out) {
    __shared__ float q_s[DELTA_MAX_DK];
    __shared__ float k_s[DELTA_MAX_DK];
    __shared__ float red[DELTA_MAX_THREADS];
    __shared__ float d_s[DELTA_MAX_THREADS];
    const int h = blockIdx.x, s = blockIdx.y;
    const int len = seq_len[s];
    if (len == 0) return;
    const int start = seq_start[s];
    const int tid = threadIdx.x;
    const int c = tid % value_dim, grp = tid / value_dim;
    const int kh = h / (value_heads / key_heads);
    float* st = (float*)states[s] + rec_offset + (u64)h * key_dim * value_dim + (u64)grp * value_dim + c;
    const u64 row_step = (u64)groups * value_dim;
    float reg[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; i++) reg[i] = st[i * row_step];
    const float root = sqrtf((float)key_dim);
    const int out_w = value_heads * value_dim;
    for (int t = 0; t < len; t++) {
        const u64 row = (u64)(start + t);
        const float* qr = qkv + row * conv_dim + kh * key_dim;
        const float* kr = qr + key_heads * key_dim;
        const float* vr = qkv + row * conv_dim + 2 * key_heads * key_dim + h * value_dim;
        for (int i = tid; i < key_dim; i += blockDim.x) {
            q_s[i] = qr[i] / root;
            k_s[i] = kr[i];
        }
        const float decay = expf(g[row * value_heads + h]);
        const float bt = beta[row * value_heads + h];
        __syncthreads();
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            reg[i] *= decay;
            part += reg[i] * k_s[grp + groups * i];
        }
        red[tid] = part;
        __syncthreads();
        if (grp == 0) {
            float mem = 0.0f;
            for (int j = 0; j < groups; j++) mem += red[j * value_dim + c];
            d_s[c] = (vr[c] - mem) * bt;
        }
        __syncthreads();
        const float d = d_s[c];
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            reg[i] += k_s[grp + groups * i] * d;
            o += reg[i] * q_s[grp + groups * i];
        }
        red[tid] = o;
        __syncthreads();
        if (grp == 0) {
            float sum = 0.0f;
            for (int j = 0; j < groups; j++) sum += red[j * value_dim + c];
            out[row * out_w + h * value_dim + c] = sum;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < ROWS; i++) st[i * row_step] = reg[i];
}

#define DELTA_RECURRENT(ROWS)                                                                     \
    extern "C" __global__ void __launch_bounds__(DELTA_MAX_THREADS)                              \
        gated_delta_recurrent_r##ROWS##_f32(                                                      \
            const float* __restrict__ qkv, const float* __restrict__ beta,                       \
            const float* __restrict__ g, const u64* __restrict__ states,                         \
            const int* __restrict__ seq_start, const int* __restrict__ seq_len, u64 rec_offset,  \
            int key_heads, int value_heads, int key_dim, int value_dim, int groups, int conv_dim, \
            float* out) {                                                                         \
        pdl_entry();                                                                              \
        gated_delta_recurrent<ROWS>(qkv, beta, g, states, seq_start, seq_len, rec_offset,        \
                                    key_heads, value_heads, key_dim, value_dim, groups,          \
                                    conv_dim, out);                                               \
    }
DELTA_RECURRENT(8)
DELTA_RECURRENT(16)
DELTA_RECURRENT(32)

// The same rule split by state columns: columns of S never mix (k^T S, the update and q^T S are
// all per column), so each column is independent work. SPLIT adjacent lanes share a column, each
// keeping ROWS = DK / SPLIT consecutive rows in registers; the two sums over rows per token are
// a row-order sum per lane, then a butterfly over the SPLIT lanes (which leaves every lane the
// same value). No block barrier: a warp takes 32 / SPLIT columns of one (value head, sequence),
// so Qwen3.5-35B-A3B's 32 heads of 128 columns (DK 128, SPLIT 4) are 512 warps per sequence.
// Launch: grid (ceil(value_dim / (32 / SPLIT)), value_heads, sequences), block 32.
template <int DK, int SPLIT>
__device__ __forceinline__ void gated_delta_columns(
    const float* __restrict__ qkv, const float* __restrict__ beta, const float* __restrict__ g,
    const u64* __restrict__ states, const int* __restrict__ seq_start,
    const int* __restrict__ seq_len, u64 rec_offset, int key_heads, int value_heads,
    int value_dim, int conv_dim, float* out) {
    constexpr int ROWS = DK / SPLIT;
    __shared__ float q_s[DK];
    __shared__ float k_s[DK];
    const int lane = threadIdx.x;
    const int part = lane % SPLIT;
    const int c = blockIdx.x * (32 / SPLIT) + lane / SPLIT;
    const int h = blockIdx.y, s = blockIdx.z;
    const int len = seq_len[s];
    if (len == 0) return;
    const int start = seq_start[s];
    const bool active = c < value_dim;
    const int kh = h / (value_heads / key_heads);
    float* st = (float*)states[s] + rec_offset + (u64)h * DK * value_dim +
                (u64)part * ROWS * value_dim + c;
    float reg[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; i++) reg[i] = active ? st[(u64)i * value_dim] : 0.0f;
    const float root = sqrtf((float)DK);
    const int out_w = value_heads * value_dim;
    const float* ks = k_s + part * ROWS;
    const float* qs = q_s + part * ROWS;
    for (int t = 0; t < len; t++) {
        const u64 row = (u64)(start + t);
        const float* qr = qkv + row * conv_dim + kh * DK;
        const float* kr = qr + key_heads * DK;
        __syncwarp();  // the previous token's reads of q_s / k_s are done
        for (int i = lane; i < DK; i += 32) {
            q_s[i] = qr[i] / root;
            k_s[i] = kr[i];
        }
        __syncwarp();
        const float decay = expf(g[row * value_heads + h]);
        const float bt = beta[row * value_heads + h];
        float mem = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            reg[i] *= decay;
            mem += reg[i] * ks[i];
        }
#pragma unroll
        for (int o = 1; o < SPLIT; o <<= 1) mem += __shfl_xor_sync(0xffffffffu, mem, o);
        const float v = active ? qkv[row * conv_dim + 2 * key_heads * DK + h * value_dim + c] : 0.0f;
        const float d = (v - mem) * bt;
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            reg[i] += ks[i] * d;
            o += reg[i] * qs[i];
        }
#pragma unroll
        for (int m = 1; m < SPLIT; m <<= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
        if (active && part == 0) out[row * out_w + h * value_dim + c] = o;
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < ROWS; i++) st[(u64)i * value_dim] = reg[i];
    }
}

#define DELTA_COLUMNS(DK, SPLIT)                                                                  \
    extern "C" __global__ void __launch_bounds__(32) gated_delta_columns_k##DK##_f32(             \
        const float* __restrict__ qkv, const float* __restrict__ beta,                           \
        const float* __restrict__ g, const u64* __restrict__ states,                             \
        const int* __restrict__ seq_start, const int* __restrict__ seq_len, u64 rec_offset,      \
        int key_heads, int value_heads, int value_dim, int conv_dim, float* out) {                \
        pdl_entry();                                                                              \
        gated_delta_columns<DK, SPLIT>(qkv, beta, g, states, seq_start, seq_len, rec_offset,     \
                                       key_heads, value_heads, value_dim, conv_dim, out);        \
    }
DELTA_COLUMNS(16, 1)
DELTA_COLUMNS(32, 1)
DELTA_COLUMNS(64, 2)
DELTA_COLUMNS(128, 4)

// The Gated DeltaNet's output norm, in place on rows of `width` (one per (token, value head)):
// x = (w * (x * inv_rms)) * silu(z), as moerun-cpu's rms_norm_gated_rows.
// Launch: block (32, 4), grid ceil(rows / 4); one warp per row.
extern "C" __global__ void gated_rms_norm_f32(float* x, const float* __restrict__ z,
                                              const float* __restrict__ w, int rows, int width,
                                              float eps) {
    pdl_entry();
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    float* xr = x + (u64)row * width;
    const float* zr = z + (u64)row * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += 32) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += 32) xr[i] = (w[i] * (xr[i] * inv)) * silu_f(zr[i]);
}
