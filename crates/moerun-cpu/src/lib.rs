//! CPU backend kernels: matrix products over stored weights (f32/bf16/f16, widened in-register,
//! f32 accumulation), normalisations, rotary embeddings, paged attention, and the Gated DeltaNet's
//! causal conv and delta rule. SIMD paths are chosen at run time (AVX-512, AVX2+FMA, scalar) and
//! work is spread over rayon's thread pool.

pub mod attention;
pub mod bandwidth;
pub mod gated_delta;
pub mod linear;
pub mod ops;
pub mod simd;
