//! Small row-wise kernels of the forward pass: RMSNorm (plain and gated), L2 normalisation,
//! rotary embedding, SwiGLU, softmax, softplus, and the fixed-order dot product that attention
//! uses. Each works on f32 rows and sums in an order that does not depend on how many rows are in
//! the batch, so batched and lone runs agree bitwise.

/// Lanes of the fixed-order reductions below. Sixteen independent partial sums let the compiler
/// vectorise without reassociating (which it may not do for floats on its own).
pub(crate) const LANES: usize = 16;

/// Sum of `a[i] * b[i]`, accumulated in 16 interleaved lanes then a fixed pairwise tree.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (x, y) = (&a[c * LANES..][..LANES], &b[c * LANES..][..LANES]);
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for i in chunks * LANES..a.len() {
        acc[i % LANES] += a[i] * b[i];
    }
    reduce_lanes(acc)
}

/// Sum of squares, with the same lane structure as [`dot`].
#[inline(always)]
pub fn sum_squares(a: &[f32]) -> f32 {
    dot(a, a)
}

#[inline(always)]
pub(crate) fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `y += alpha * x`.
#[inline(always)]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// RMSNorm of each `weight.len()`-wide row of `x`, in place: `w * (x / sqrt(mean(x²) + eps))`.
/// Matches transformers: the normalised value is computed in f32, then multiplied by the weight.
pub fn rms_norm_rows(x: &mut [f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    for row in x.chunks_exact_mut(width) {
        let inv = 1.0 / (sum_squares(row) / width as f32 + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
}

/// RMSNorm from `x` into `out` (same shapes), leaving `x` untouched.
pub fn rms_norm_rows_into(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm_rows(out, weight, eps);
}

/// Gated RMSNorm (Qwen3.5's `Qwen3_5MoeRMSNormGated`) of each `weight.len()`-wide row of `x`, in
/// place: `(w * (x / sqrt(mean(x²) + eps))) * silu(gate)`, in that order, as transformers does.
pub fn rms_norm_gated_rows(x: &mut [f32], gate: &[f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    assert_eq!(x.len(), gate.len());
    for (row, g) in x.chunks_exact_mut(width).zip(gate.chunks_exact(width)) {
        let inv = 1.0 / (sum_squares(row) / width as f32 + eps).sqrt();
        for ((v, w), z) in row.iter_mut().zip(weight).zip(g) {
            *v = (w * (*v * inv)) * silu(*z);
        }
    }
}

/// Scale each `width`-wide row of `x` to unit L2 norm, in place: `x / sqrt(sum(x²) + eps)` (the
/// `l2norm` of transformers' delta-rule fallbacks, eps inside the root).
pub fn l2_normalize_rows(x: &mut [f32], width: usize, eps: f32) {
    for row in x.chunks_exact_mut(width) {
        let inv = 1.0 / (sum_squares(row) + eps).sqrt();
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// `softplus(x) = ln(1 + eˣ)` as torch computes it (beta 1, threshold 20: above it, `x` itself).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Rotate one head in place with the "rotate half" convention of transformers: dimension `i` pairs
/// with `i + rotary_dim/2`; dimensions past `rotary_dim` pass through. `cos`/`sin` hold
/// `rotary_dim/2` values for this position (already scaled by the attention factor).
#[inline]
pub fn rope_rotate_half(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (x1, rest) = head.split_at_mut(half);
    let x2 = &mut rest[..half];
    for i in 0..half {
        let (a, b) = (x1[i], x2[i]);
        x1[i] = a * cos[i] - b * sin[i];
        x2[i] = b * cos[i] + a * sin[i];
    }
}

/// SiLU(x) = x * sigmoid(x), written as transformers' `x / (1 + exp(-x))`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`), as torch computes it in f32:
/// `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x³)))`.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    // torch: kBeta = M_SQRT2 * M_2_SQRTPI * 0.5, kKappa = 0.044715.
    const BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    const KAPPA: f32 = 0.044715;
    let inner = BETA * (x + KAPPA * (x * x * x));
    0.5 * x * (1.0 + inner.tanh())
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]` (Gemma's MLP).
pub fn gelu_tanh_mul_in_place(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// Numerically stable softmax of a row, in place.
pub fn softmax_in_place(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// `sigmoid(x)` as torch computes it for f32.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_matches_the_tanh_formula_in_f64() {
        for x in [-6.0f32, -2.5, -1.0, -0.1, 0.0, 0.3, 1.0, 2.0, 7.5] {
            let xd = x as f64;
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3));
            let want = 0.5 * xd * (1.0 + inner.tanh());
            let err = (gelu_tanh(x) as f64 - want).abs();
            assert!(err < 1e-6 * want.abs().max(1.0), "{x}");
        }
        assert_eq!(gelu_tanh(0.0), 0.0);
    }

    #[test]
    fn dot_matches_f64_reference_on_odd_lengths() {
        for n in [1usize, 15, 16, 17, 100, 257] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5 * (1.0 + want.abs()));
        }
    }

    #[test]
    fn rms_norm_gives_unit_rms_with_unit_weight() {
        let mut x = vec![3.0f32, -4.0, 12.0, 0.5];
        rms_norm_rows(&mut x, &[1.0; 4], 0.0);
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_by_zero_angle_is_identity_and_preserves_norm() {
        let mut h = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope_rotate_half(&mut h, &[1.0, 1.0], &[0.0, 0.0]);
        assert_eq!(h, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let (c, s) = (0.3f32.cos(), 0.3f32.sin());
        rope_rotate_half(&mut h, &[c, c], &[s, s]);
        let norm: f32 = h[..4].iter().map(|v| v * v).sum();
        assert!(
            (norm - 30.0).abs() < 1e-4,
            "rotation keeps the rotated dims' norm"
        );
        assert_eq!(&h[4..], &[5.0, 6.0], "dims past rotary_dim pass through");
    }

    #[test]
    fn gated_rms_norm_is_the_plain_norm_times_silu_of_the_gate() {
        let x = vec![1.0f32, -2.0, 0.5, 3.0];
        let mut plain = x.clone();
        rms_norm_rows(&mut plain, &[0.5, 1.5, 1.0, 2.0], 1e-6);
        let mut gated = x;
        let gate = [0.3f32, -1.0, 2.0, 0.0];
        rms_norm_gated_rows(&mut gated, &gate, &[0.5, 1.5, 1.0, 2.0], 1e-6);
        for i in 0..4 {
            assert!((gated[i] - plain[i] * silu(gate[i])).abs() < 1e-6);
        }
    }

    #[test]
    fn l2_normalised_rows_have_unit_norm_and_softplus_is_linear_past_20() {
        let mut x = vec![3.0f32, 4.0, 0.0, 1.0];
        l2_normalize_rows(&mut x, 2, 0.0);
        assert_eq!(&x[..2], &[0.6, 0.8]);
        assert_eq!(&x[2..], &[0.0, 1.0]);
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
    }

    #[test]
    fn softmax_sums_to_one_and_orders_like_input() {
        let mut r = vec![1.0f32, 3.0, 2.0, -1.0];
        softmax_in_place(&mut r);
        assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(r[1] > r[2] && r[2] > r[0] && r[0] > r[3]);
    }
}
