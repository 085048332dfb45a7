//! Putting a model's weights on the device: every matrix in its stored dtype, every small vector
//! (norm weights, biases) as f32, each MoE layer's experts stacked.

use std::collections::HashMap;

use moerun_core::{DType, Result, Tensor};
use moerun_cuda::{AttentionPrefill, CudaDevice, CudaSlice, DeviceExperts, DeviceMatrix};

use super::{dev_err, tensor_key, vec_key, CudaModel, StackedQkv};
use crate::attention::Rope;
use crate::config::ModelConfig;
use crate::weights::{
    FfnWeights, GatedDeltaNetWeights, Linear, MixerWeights, MlpWeights, ModelWeights, MoeWeights,
};

/// Where the device copy of each matrix comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightSource {
    /// The host tensor's bytes (a real checkpoint).
    Host,
    /// Uniform random values drawn on the device (synthetic benchmark models: a 60 GB model
    /// need not exist on the host). The std is transformers' usual `initializer_range`, 0.02;
    /// norm weights and biases still come from the host.
    Random { seed: u64 },
}

/// Uniform bound with std 0.02 (a uniform on `[-a, a]` has std `a / √3`).
const RANDOM_BOUND: f32 = 0.02 * 1.732_050_8;

/// Collects a model's device weights; Gemma 4's upload (`crate::gemma4::cuda`) uses it too.
pub(crate) struct Uploader<'a> {
    pub(crate) dev: &'a CudaDevice,
    pub(crate) source: WeightSource,
    pub(crate) mats: HashMap<(usize, usize), DeviceMatrix>,
    pub(crate) vecs: HashMap<(usize, usize), CudaSlice<f32>>,
    pub(crate) experts: HashMap<(usize, usize), DeviceExperts>,
    pub(crate) qkv: HashMap<(usize, usize), StackedQkv>,
    pub(crate) bytes: usize,
    next_seed: u64,
}

impl<'a> Uploader<'a> {
    pub(crate) fn new(dev: &'a CudaDevice, source: WeightSource) -> Uploader<'a> {
        Uploader {
            dev,
            source,
            mats: HashMap::new(),
            vecs: HashMap::new(),
            experts: HashMap::new(),
            qkv: HashMap::new(),
            bytes: 0,
            next_seed: 0,
        }
    }

    fn seed(&mut self, base: u64) -> u64 {
        self.next_seed += 1;
        base ^ self.next_seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    pub(crate) fn matrix(&mut self, t: &Tensor) -> Result<()> {
        let key = tensor_key(t);
        if self.mats.contains_key(&key) {
            return Ok(()); // tied weights: one device copy
        }
        let m = t.mat();
        let d = match self.source {
            WeightSource::Host => self.dev.upload_matrix(m),
            WeightSource::Random { seed } => {
                let seed = self.seed(seed);
                self.dev
                    .random_matrix(m.dtype, m.rows, m.cols, seed, RANDOM_BOUND)
            }
        }
        .map_err(dev_err)?;
        self.bytes += d.byte_len();
        self.mats.insert(key, d);
        Ok(())
    }

    pub(crate) fn vector(&mut self, v: &[f32]) -> Result<()> {
        let key = vec_key(v);
        if !self.vecs.contains_key(&key) {
            let d = self.dev.upload(v).map_err(dev_err)?;
            self.vecs.insert(key, d);
        }
        Ok(())
    }

    pub(crate) fn linear(&mut self, l: &Linear) -> Result<()> {
        self.matrix(&l.weight)?;
        if let Some(b) = &l.bias {
            self.vector(b)?;
        }
        Ok(())
    }

    pub(crate) fn mlp(&mut self, w: &MlpWeights) -> Result<()> {
        self.linear(&w.gate_proj)?;
        self.linear(&w.up_proj)?;
        self.linear(&w.down_proj)
    }

    /// Projections of the same input stacked (the rows of each in turn) into one matrix, and
    /// their biases, found by the first part's weight: q, k and v; a Gated DeltaNet layer's four
    /// input projections.
    pub(crate) fn stacked_qkv(&mut self, parts: &[&Linear]) -> Result<()> {
        let mats: Vec<_> = parts.iter().map(|l| l.weight.mat()).collect();
        let weight = self.stack_matrices(&mats)?;
        let weights: Vec<&Tensor> = parts.iter().map(|l| &l.weight).collect();
        self.parts_as_row_ranges(&weights, &weight);
        let bias = if parts.iter().any(|l| l.bias.is_some()) {
            let mut b = Vec::with_capacity(weight.rows());
            for (l, m) in parts.iter().zip(&mats) {
                match &l.bias {
                    Some(v) => b.extend_from_slice(v),
                    None => b.extend(std::iter::repeat_n(0.0, m.rows)),
                }
            }
            Some(self.dev.upload(&b).map_err(dev_err)?)
        } else {
            None
        };
        self.bytes += weight.byte_len();
        self.qkv
            .insert(tensor_key(&parts[0].weight), StackedQkv { weight, bias });
        Ok(())
    }

    /// Bias-free matrices of the same input stacked into one, found (with `qkv`'s stacks) by the
    /// first part: a shared expert's gate, up and gate rows; a dense MLP's gate and up (Gemma 4).
    /// A single-token step runs one GEMV over them and reads each output as a slice.
    pub(crate) fn stacked_rows(&mut self, parts: &[&Tensor]) -> Result<()> {
        let mats: Vec<_> = parts.iter().map(|t| t.mat()).collect();
        let weight = self.stack_matrices(&mats)?;
        self.parts_as_row_ranges(parts, &weight);
        self.bytes += weight.byte_len();
        self.qkv
            .insert(tensor_key(parts[0]), StackedQkv { weight, bias: None });
        Ok(())
    }

    /// Each part of a stack as its own matrix over the stack's rows (the multi-token path runs
    /// them one by one), so the stack costs no second copy of its weights. Called before the
    /// parts are uploaded one by one, which then finds them present; a part whose rows would not
    /// start 16-byte aligned is left to that upload.
    fn parts_as_row_ranges(&mut self, parts: &[&Tensor], stack: &DeviceMatrix) {
        let mut first = 0;
        for t in parts {
            let rows = t.mat().rows;
            if let Ok(range) = stack.row_range(first, rows) {
                self.mats.entry(tensor_key(t)).or_insert(range);
            }
            first += rows;
        }
    }

    /// The rows of `mats` in turn as one device matrix (random ones drawn at the stacked shape).
    fn stack_matrices(&mut self, mats: &[moerun_core::MatRef<'_>]) -> Result<DeviceMatrix> {
        let (dtype, cols) = (mats[0].dtype, mats[0].cols);
        if mats.iter().any(|m| m.dtype != dtype || m.cols != cols) {
            return Err(moerun_core::Error::Config(
                "stacked projections differ in dtype or input width".into(),
            ));
        }
        let rows: usize = mats.iter().map(|m| m.rows).sum();
        match self.source {
            WeightSource::Host => {
                let mut bytes = Vec::with_capacity(rows * cols * dtype.size());
                for m in mats {
                    bytes.extend_from_slice(m.data);
                }
                self.dev.upload_matrix(moerun_core::MatRef {
                    dtype,
                    rows,
                    cols,
                    data: &bytes,
                })
            }
            WeightSource::Random { seed } => {
                let seed = self.seed(seed);
                self.dev
                    .random_matrix(dtype, rows, cols, seed, RANDOM_BOUND)
            }
        }
        .map_err(dev_err)
    }

    /// A Gated DeltaNet layer: its projections as every linear; the conv taps, `A_log`,
    /// `dt_bias` and the norm weight as f32 vectors. With random weights the matrices are drawn
    /// like every other; the conv taps, which a synthetic model leaves at zero on the host (they
    /// are a 3-d tensor there, a window onto its shared zero buffer), are drawn here uniform in
    /// ±1/√kernel (torch's Conv1d default bound) so that the layer does not degenerate to zero;
    /// `A_log` and `dt_bias` keep the synthetic model's small host values (|x| ≲ 0.03: decay
    /// e^g ≈ e^(-0.7) per token, β ≈ sigmoid(small) ≈ 0.5, finite for any input) and the norm
    /// weight its host ones.
    ///
    /// The four input projections are also stacked into one matrix: a single-token step (batch-1
    /// decode) runs one GEMV over it and reads the four outputs as slices of one row.
    fn gated_deltanet(&mut self, w: &GatedDeltaNetWeights) -> Result<()> {
        // The stack first: the projections are then its row ranges, not copies.
        if w.in_proj_qkv.bias.is_none()
            && w.in_proj_z.bias.is_none()
            && w.in_proj_b.bias.is_none()
            && w.in_proj_a.bias.is_none()
        {
            self.stacked_qkv(&[&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a])?;
        }
        for l in [
            &w.in_proj_qkv,
            &w.in_proj_z,
            &w.in_proj_b,
            &w.in_proj_a,
            &w.out_proj,
        ] {
            self.linear(l)?;
        }
        for v in [&w.a_log, &w.dt_bias, &w.norm] {
            self.vector(v)?;
        }
        match self.source {
            WeightSource::Host => self.vector(&w.conv1d_taps),
            WeightSource::Random { seed } => {
                let seed = self.seed(seed);
                let bound = 1.0 / (taps_per_channel(w).max(1) as f32).sqrt();
                let values: Vec<f32> = (0..w.conv1d_taps.len() as u64)
                    .map(|i| bound * hash_uniform(seed, i))
                    .collect();
                let d = self.dev.upload(&values).map_err(dev_err)?;
                self.vecs.insert(vec_key(&w.conv1d_taps), d);
                Ok(())
            }
        }
    }

    /// `experts` stacked experts of random weights drawn on the device (`bench --like`).
    pub(crate) fn random_experts(
        &mut self,
        dtype: DType,
        experts: usize,
        hidden: usize,
        inter: usize,
        seed: u64,
    ) -> Result<DeviceExperts> {
        let n = experts * inter * hidden;
        let gate_up = self.random_bytes(dtype, 2 * n, seed)?;
        let down = self.random_bytes(dtype, n, seed)?;
        self.dev
            .experts_from_parts(dtype, experts, hidden, inter, gate_up, down)
            .map_err(dev_err)
    }

    pub(crate) fn random_bytes(
        &mut self,
        dtype: DType,
        len: usize,
        seed: u64,
    ) -> Result<CudaSlice<u8>> {
        let seed = self.seed(seed);
        let mut buf = self.dev.zeros::<u8>(len * dtype.size()).map_err(dev_err)?;
        self.dev
            .fill_random(&mut buf, dtype, seed, RANDOM_BOUND)
            .map_err(dev_err)?;
        Ok(buf)
    }

    /// A MoE layer: the router and shared expert as every matrix, the experts stacked. A shared
    /// expert without biases also gets its gate, up and (if any) `shared_expert_gate` rows
    /// stacked into one matrix, found by `gate_proj`'s weight: a single-token step runs one GEMV
    /// over them and reads the three outputs as slices (`CudaPass::moe`).
    fn moe(&mut self, w: &MoeWeights) -> Result<()> {
        self.matrix(&w.router)?;
        // The stack first: the shared expert's gate and up (and its gate row) are then its row
        // ranges, not copies.
        if let Some(shared) = w
            .shared_expert
            .as_ref()
            .filter(|s| s.gate_proj.bias.is_none() && s.up_proj.bias.is_none())
        {
            let mut parts = vec![&shared.gate_proj.weight, &shared.up_proj.weight];
            parts.extend(w.shared_expert_gate.as_ref());
            self.stacked_rows(&parts)?;
        }
        if let Some(shared) = &w.shared_expert {
            self.mlp(shared)?;
        }
        if let Some(gate) = &w.shared_expert_gate {
            self.matrix(gate)?;
        }
        let Some(first) = w.experts.first() else {
            return Ok(());
        };
        let (dtype, inter, hidden) = (first.gate.dtype, first.gate.shape[0], first.gate.shape[1]);
        let stacked = match self.source {
            WeightSource::Host => {
                let parts: Vec<_> = w
                    .experts
                    .iter()
                    .map(|e| (e.gate.mat(), e.up.mat(), e.down.mat()))
                    .collect();
                self.dev.upload_experts(&parts).map_err(dev_err)?
            }
            WeightSource::Random { seed } => {
                self.random_experts(dtype, w.experts.len(), hidden, inter, seed)?
            }
        };
        self.bytes += stacked.bytes();
        self.experts.insert(tensor_key(&w.router), stacked);
        Ok(())
    }
}

/// Conv taps per channel of a Gated DeltaNet layer: `conv1d_taps` is `[kernel, conv_dim]` and
/// `in_proj_qkv` has `conv_dim` rows.
fn taps_per_channel(w: &GatedDeltaNetWeights) -> usize {
    w.conv1d_taps.len() / w.in_proj_qkv.weight.shape[0].max(1)
}

/// Uniform in [-1, 1) from (seed, i): a SplitMix64 step (host twin of the device fill's hash).
fn hash_uniform(seed: u64, i: u64) -> f32 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i)
        .wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 * (1.0 / 16_777_216.0) * 2.0 - 1.0
}

/// Upload `w` to `dev` (or draw it there, per `source`).
pub(crate) fn upload(
    dev: CudaDevice,
    cfg: &ModelConfig,
    w: &ModelWeights,
    rope: &Rope,
    source: WeightSource,
) -> Result<CudaModel> {
    if let (Some(g), Some(gw)) = (&cfg.gemma4, &w.gemma4) {
        return crate::gemma4::cuda::upload(dev, cfg, g, gw, source);
    }
    let (inv_freq, attention_factor) = rope.parts();
    let rope = dev
        .upload_rope(inv_freq, attention_factor)
        .map_err(dev_err)?;
    let mut u = Uploader::new(&dev, source);
    u.matrix(&w.embed_tokens)?;
    for layer in &w.layers {
        u.vector(&layer.input_layernorm)?;
        u.vector(&layer.post_attention_layernorm)?;
        match &layer.mixer {
            MixerWeights::Attention(a) => {
                if super::fused_prologue(cfg) {
                    u.stacked_qkv(&[&a.q_proj, &a.k_proj, &a.v_proj])?;
                } else {
                    for l in [&a.q_proj, &a.k_proj, &a.v_proj] {
                        u.linear(l)?;
                    }
                }
                u.linear(&a.o_proj)?;
                for n in [&a.q_norm, &a.k_norm].into_iter().flatten() {
                    u.vector(n)?;
                }
            }
            MixerWeights::GatedDeltaNet(g) => u.gated_deltanet(g)?,
        }
        match &layer.ffn {
            FfnWeights::Dense(m) => u.mlp(m)?,
            FfnWeights::Moe(m) => u.moe(m)?,
        }
    }
    u.vector(&w.norm)?;
    u.matrix(&w.lm_head)?;
    let Uploader {
        mats,
        vecs,
        experts,
        qkv,
        bytes,
        ..
    } = u;
    let route_ahead = super::route_ahead::folds(&dev, cfg, w, &mats, &vecs)?;
    let zero_row = dev.zeros(cfg.hidden_size).map_err(dev_err)?;
    let bf16 = w.embed_tokens.dtype == DType::BF16;
    let prefill_attention = if bf16 && matches!(cfg.head_dim, 64 | 128) {
        AttentionPrefill::TensorCoreBf16
    } else {
        AttentionPrefill::ExactF32
    };
    Ok(CudaModel {
        gemma4: None,
        prefill_attention,
        bf16_gemm_inputs: crate::cuda::bf16_gemm_inputs(bf16),
        dev,
        mats,
        vecs,
        experts,
        route_ahead,
        zero_row,
        qkv,
        rope,
        weight_bytes: bytes,
    })
}
