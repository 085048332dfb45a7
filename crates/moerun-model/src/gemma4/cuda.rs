//! Gemma 4 on the CUDA backend: its weights on the device and its forward pass as device ops,
//! step for step the CPU flow of [`super::forward`] (same order of norms, adds and scales).
//!
//! This is the brief's fallback design, a family forward of its own calling device ops directly,
//! not the [`crate::backend::Backend`] flow: Gemma 4's layer (sandwich norms, dense MLP beside the
//! routed experts, routing on the un-normed residual, KV sharing, per-layer RoPE and head dims,
//! per-layer inputs, `layer_scalar`) shares almost no step order with [`crate::forward`], and
//! moving the CPU code under the trait was more than this change could carry safely
//! (docs/ARCHITECTURE.md). The device ops it uses are shared with every family: GEMV/GEMM,
//! RMSNorm, RoPE, paged attention, the router and the fused MoE op (with its GELU-tanh activation),
//! plus the small Gemma ops of `moerun_cuda` (`gelu_tanh_mul`, `scale`, `softcap`, the router's
//! per-expert scale inside `route_topk_scaled`) and a layer's two norm chains
//! (`gemma4_attn_tail`, `gemma4_ffn_tail`: the sandwich norms, adds and scales between its big
//! kernels, one launch each).
//!
//! Decode steps are captured in CUDA graphs by `crate::cuda::graph` like every family's
//! ([`decode_logits`] is the captured body): no host work happens inside a pass once the batch's
//! placement and token ids are on the device.

use std::collections::HashMap;

use moerun_core::{DType, Error, MatRef, Result, Tensor};
use moerun_cuda::{
    AttentionPrefill, AttentionShape, AttnTailNorms, AttnTailOut, CudaDevice, CudaSlice,
    DeviceBuffer, DeviceMatrix, DeviceRope, ExpertActivation, FfnTail, QkvShape, RouterNorms,
    RouterShape, TokenPlacement, GEMMA_TAIL_MAX_WIDTH,
};

use crate::batch::Batch;
use crate::config::{Gemma4Config, ModelConfig};
use crate::cuda::upload::{Uploader, WeightSource};
use crate::cuda::{dev_err, tensor_key, CudaModel, DeviceKv, Placement, Tokens, GEMV_MAX_ROWS};
use crate::weights::Linear;

use super::weights::{Gemma4AttentionWeights, Gemma4LayerWeights, Gemma4MoeWeights, Gemma4Weights};

/// What a Gemma 4 model needs on the device beyond its weights.
pub(crate) struct Gemma4Device {
    sliding_rope: DeviceRope,
    full_rope: DeviceRope,
    /// All-ones weights by width: `v_norm` and the router's norm have no learned scale.
    ones: HashMap<usize, CudaSlice<f32>>,
}

/// Upload (or draw, for `WeightSource::Random`) every Gemma 4 weight.
pub(crate) fn upload(
    dev: CudaDevice,
    cfg: &ModelConfig,
    g: &Gemma4Config,
    w: &Gemma4Weights,
    source: WeightSource,
) -> Result<CudaModel> {
    if cfg.hidden_size > GEMMA_TAIL_MAX_WIDTH {
        return Err(Error::Unsupported(format!(
            "Gemma 4 on CUDA: a hidden size of {} (its layer's norm kernels take rows of at most \
             {GEMMA_TAIL_MAX_WIDTH}; every published Gemma 4 is narrower)",
            cfg.hidden_size
        )));
    }
    let sliding_rope = dev
        .upload_rope(&g.sliding_rope.inv_freq(), 1.0)
        .map_err(dev_err)?;
    let full_rope = dev
        .upload_rope(&g.full_rope.inv_freq(), 1.0)
        .map_err(dev_err)?;
    let mut ones = HashMap::new();
    let mut widths = vec![cfg.hidden_size];
    widths.extend(g.layers.iter().map(|l| l.head_dim));
    for width in widths {
        if let std::collections::hash_map::Entry::Vacant(e) = ones.entry(width) {
            e.insert(dev.upload(&vec![1.0f32; width]).map_err(dev_err)?);
        }
    }
    let rope = dev
        .upload_rope(&g.sliding_rope.inv_freq(), 1.0)
        .map_err(dev_err)?;

    let mut u = Uploader::new(&dev, source);
    u.matrix(&w.embed_tokens)?;
    if let Some(p) = &w.per_layer_input {
        u.matrix(&p.embed_tokens_per_layer)?;
        u.matrix(&p.model_projection)?;
        u.vector(&p.projection_norm)?;
    }
    for lw in &w.layers {
        upload_layer(&mut u, lw)?;
    }
    u.vector(&w.norm)?;
    u.matrix(&w.lm_head)?;
    let (mats, vecs, experts, qkv, bytes) = (u.mats, u.vecs, u.experts, u.qkv, u.bytes);
    let bf16 = w.embed_tokens.dtype == DType::BF16;
    let zero_row = dev.zeros(cfg.hidden_size).map_err(dev_err)?;
    Ok(CudaModel {
        // Per layer, head dims outside 64/128 fall back to the exact kernel (see `attention`).
        prefill_attention: if bf16 {
            AttentionPrefill::TensorCoreBf16
        } else {
            AttentionPrefill::ExactF32
        },
        bf16_gemm_inputs: crate::cuda::bf16_gemm_inputs(bf16),
        dev,
        mats,
        vecs,
        experts,
        qkv,
        rope,
        weight_bytes: bytes,
        route_ahead: Default::default(),
        zero_row,
        gemma4: Some(Gemma4Device {
            sliding_rope,
            full_rope,
            ones,
        }),
    })
}

/// Whether the fused attention prologue takes a layer: head_dim within its limit.
fn fused_prologue_fits(lw: &Gemma4LayerWeights) -> bool {
    lw.self_attn.q_norm.len() <= moerun_cuda::FUSED_MAX_HEAD_DIM
}

fn upload_layer(u: &mut Uploader, lw: &Gemma4LayerWeights) -> Result<()> {
    for v in [
        &lw.input_layernorm,
        &lw.post_attention_layernorm,
        &lw.pre_feedforward_layernorm,
        &lw.post_feedforward_layernorm,
    ] {
        u.vector(v)?;
    }
    let a = &lw.self_attn;
    u.vector(&a.q_norm)?;
    u.linear(&a.o_proj)?;
    match &a.kv {
        // q, k and v of one input: one stacked matrix, run by the fused prologue (`attention`).
        Some(own) if own.v_proj.is_some() && fused_prologue_fits(lw) => {
            let v = own.v_proj.as_ref().expect("matched");
            u.stacked_qkv(&[&a.q_proj, &own.k_proj, v])?;
            u.vector(&own.k_norm)?;
        }
        Some(own) => {
            u.linear(&a.q_proj)?;
            u.linear(&own.k_proj)?;
            if let Some(v) = &own.v_proj {
                u.linear(v)?;
            }
            u.vector(&own.k_norm)?;
        }
        None => u.linear(&a.q_proj)?,
    }
    if lw.mlp.gate_proj.bias.is_none() && lw.mlp.up_proj.bias.is_none() {
        // Gate and up of one input: one GEMV at a single token (`mlp`); stacked first, so that
        // the separate gate and up are its row ranges, not copies.
        u.stacked_rows(&[&lw.mlp.gate_proj.weight, &lw.mlp.up_proj.weight])?;
    }
    u.mlp(&lw.mlp)?;
    if let Some(moe) = &lw.moe {
        upload_experts(u, moe)?;
    }
    if let Some(li) = &lw.per_layer_input {
        u.matrix(&li.gate)?;
        u.matrix(&li.projection)?;
        u.vector(&li.post_norm)?;
    }
    Ok(())
}

/// A layer's router, its scales and norms, and its experts stacked for the fused MoE op (gate
/// rows then up rows per expert, as `gate_up_proj` already keeps them), keyed by `router.proj`.
fn upload_experts(u: &mut Uploader, w: &Gemma4MoeWeights) -> Result<()> {
    u.matrix(&w.router_proj)?;
    for v in [
        &w.router_scale,
        &w.per_expert_scale,
        &w.pre_feedforward_layernorm_2,
        &w.post_feedforward_layernorm_1,
        &w.post_feedforward_layernorm_2,
    ] {
        u.vector(v)?;
    }
    let Some((gate_up, _)) = w.experts.first() else {
        return Ok(());
    };
    let (dtype, inter, hidden) = (gate_up.dtype, gate_up.shape[0] / 2, gate_up.shape[1]);
    let stacked = match u.source {
        WeightSource::Host => {
            fn halves(t: &Tensor, first: bool) -> MatRef<'_> {
                let m = t.mat();
                let half = m.data.len() / 2;
                MatRef {
                    dtype: m.dtype,
                    rows: m.rows / 2,
                    cols: m.cols,
                    data: if first {
                        &m.data[..half]
                    } else {
                        &m.data[half..]
                    },
                }
            }
            let parts: Vec<_> = w
                .experts
                .iter()
                .map(|(gu, down)| (halves(gu, true), halves(gu, false), down.mat()))
                .collect();
            u.dev.upload_experts(&parts).map_err(dev_err)?
        }
        WeightSource::Random { seed } => {
            u.random_experts(dtype, w.experts.len(), hidden, inter, seed)?
        }
    };
    u.bytes += stacked.bytes();
    u.experts.insert(
        tensor_key(&w.router_proj),
        stacked.with_activation(ExpertActivation::GeluTanh),
    );
    Ok(())
}

/// One Gemma 4 forward pass on the device.
struct Pass<'a> {
    m: &'a CudaModel,
    extra: &'a Gemma4Device,
    cfg: &'a ModelConfig,
    g: &'a Gemma4Config,
    kv: &'a mut DeviceKv,
    at: &'a Placement,
    tokens: Tokens<'a>,
    rows: usize,
}

/// Run `tokens` (the batch's tokens, already checked against the vocabulary) through the model
/// on the device, writing K/V into `kv`, and return the soft-capped logits of `rows`.
#[allow(clippy::too_many_arguments)] // the CPU forward's arguments plus the device pair
pub(crate) fn forward(
    m: &CudaModel,
    kv: &mut DeviceKv,
    cfg: &ModelConfig,
    w: &Gemma4Weights,
    batch: &Batch,
    tokens: &[u32],
    rows: &[usize],
) -> Result<DeviceBuffer<f32>> {
    check_tokens(cfg, tokens)?;
    let at = Placement::of_batch(&m.dev, batch)?;
    run(m, kv, cfg, w, &at, Tokens::Host, tokens, rows)
}

/// Refuse tokens past the per-layer-input table (the main vocabulary is checked by the caller).
pub(crate) fn check_tokens(cfg: &ModelConfig, tokens: &[u32]) -> Result<()> {
    if let Some(ple) = cfg.gemma4.as_ref().and_then(|g| g.per_layer_input) {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= ple.vocab) {
            return Err(Error::TokenOutOfRange {
                id: t,
                vocab: ple.vocab,
            });
        }
    }
    Ok(())
}

/// A decode step's body as a CUDA graph captures it: token ids already on the device (`ids`;
/// `host_tokens` only gives their count), logits left on the device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_logits(
    m: &CudaModel,
    kv: &mut DeviceKv,
    cfg: &ModelConfig,
    w: &Gemma4Weights,
    at: &Placement,
    ids: &CudaSlice<u32>,
    host_tokens: &[u32],
    rows: &[usize],
) -> Result<DeviceBuffer<f32>> {
    run(m, kv, cfg, w, at, Tokens::Device(ids), host_tokens, rows)
}

#[allow(clippy::too_many_arguments)]
fn run(
    m: &CudaModel,
    kv: &mut DeviceKv,
    cfg: &ModelConfig,
    w: &Gemma4Weights,
    at: &Placement,
    tokens: Tokens,
    host_tokens: &[u32],
    rows: &[usize],
) -> Result<DeviceBuffer<f32>> {
    let g = cfg
        .gemma4
        .as_ref()
        .ok_or_else(|| Error::InvalidArgument("Gemma 4 weights without a Gemma 4 config".into()))?;
    let extra = m.gemma4.as_ref().ok_or_else(|| {
        Error::Device("internal: a Gemma 4 model uploaded without its device extras".into())
    })?;
    let mut p = Pass {
        m,
        extra,
        cfg,
        g,
        kv,
        at,
        tokens,
        rows: host_tokens.len(),
    };
    p.run(w, host_tokens, rows)
}

/// Decoder layer `l` alone on the device over `batch`, from and to host values (tests).
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_alone(
    m: &CudaModel,
    kv: &mut DeviceKv,
    cfg: &ModelConfig,
    w: &Gemma4Weights,
    batch: &Batch,
    l: usize,
    x: &[f32],
    ple: Option<(&[f32], usize)>,
) -> Result<Vec<f32>> {
    let g = cfg.gemma4.as_ref().expect("a Gemma 4 config");
    let extra = m.gemma4.as_ref().expect("Gemma 4 extras");
    let at = Placement::of_batch(&m.dev, batch)?;
    let mut p = Pass {
        m,
        extra,
        cfg,
        g,
        kv,
        at: &at,
        tokens: Tokens::Host,
        rows: batch.num_tokens(),
    };
    let mut xd = DeviceBuffer::owned(m.dev.upload(x).map_err(dev_err)?);
    let pd = match ple {
        Some((v, width)) => Some((
            DeviceBuffer::owned(m.dev.upload(v).map_err(dev_err)?),
            width,
        )),
        None => None,
    };
    p.layer(l, &w.layers[l], &mut xd, None, pd.as_ref(), None)?;
    m.dev.download(&xd).map_err(dev_err)
}

impl Pass<'_> {
    fn dev(&self) -> &CudaDevice {
        &self.m.dev
    }

    /// An output buffer (see `PassScratch::activation`).
    fn alloc(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        self.kv.scratch.activation(&self.m.dev, len)
    }

    /// A copy of `x` in a buffer of its own (from the arena like every output).
    fn copy(&self, x: &DeviceBuffer<f32>) -> Result<DeviceBuffer<f32>> {
        let mut out = self.alloc(x.len())?;
        self.dev().copy_within(x, &mut out).map_err(dev_err)?;
        Ok(out)
    }

    /// `x · Wᵀ`: the GEMV up to [`GEMV_MAX_ROWS`] rows, cuBLAS past it (as `CudaPass` does).
    fn product(&self, x: &DeviceBuffer<f32>, w: &Tensor) -> Result<DeviceBuffer<f32>> {
        self.product_with(x, self.m.mat(w)?)
    }

    /// [`Self::product`] for a device matrix (a stacked q/k/v).
    fn product_with(&self, x: &DeviceBuffer<f32>, d: &DeviceMatrix) -> Result<DeviceBuffer<f32>> {
        let rows = x.len() / d.cols();
        let mut out = self.alloc(rows * d.rows())?;
        if rows <= GEMV_MAX_ROWS || d.dtype() == DType::F16 {
            self.dev().gemv(x, rows, d, &mut out).map_err(dev_err)?;
        } else {
            // x enters as two bf16 halves, not rounded to one: Gemma renormalises every branch
            // (sandwich norms), so a branch's relative error reaches the residual at full size.
            // With x rounded to bf16 the gemma4_vl_bf16 fixture's prefill ended 2.4e-2 from
            // transformers (the CPU emulating that rounding: 2.2e-2 from the GEMMs alone), over
            // the bf16 prefill bar of 2e-2; twice the tensor-core work buys the GEMV's precision.
            self.dev()
                .gemm_split(x, rows, d, &mut out)
                .map_err(dev_err)?;
        }
        Ok(out)
    }

    fn linear(&self, x: &DeviceBuffer<f32>, l: &Linear) -> Result<DeviceBuffer<f32>> {
        let mut out = self.product(x, &l.weight)?;
        if let Some(b) = &l.bias {
            self.dev()
                .add_bias(&mut out, self.m.vec(b)?)
                .map_err(dev_err)?;
        }
        Ok(out)
    }

    fn norm(&self, x: &DeviceBuffer<f32>, w: &[f32]) -> Result<DeviceBuffer<f32>> {
        let mut out = self.alloc(x.len())?;
        self.dev()
            .rms_norm(x, self.m.vec(w)?, self.cfg.rms_norm_eps, &mut out)
            .map_err(dev_err)?;
        Ok(out)
    }

    fn norm_in_place(&self, x: &mut DeviceBuffer<f32>, w: &[f32]) -> Result<()> {
        self.dev()
            .rms_norm_in_place(x, self.m.vec(w)?, self.cfg.rms_norm_eps)
            .map_err(dev_err)
    }

    /// RMSNorm without a learned scale, over rows of `width`.
    fn unit_norm(&self, x: &mut DeviceBuffer<f32>, width: usize) -> Result<()> {
        let ones = self.extra.ones.get(&width).ok_or_else(|| {
            Error::Device(format!("internal: no unit norm weight of width {width}"))
        })?;
        self.dev()
            .rms_norm_in_place(x, ones, self.cfg.rms_norm_eps)
            .map_err(dev_err)
    }

    fn add(&self, x: &mut DeviceBuffer<f32>, y: &DeviceBuffer<f32>) -> Result<()> {
        self.dev().add_assign(x, y).map_err(dev_err)
    }

    fn scale(&self, x: &mut DeviceBuffer<f32>, s: f32) -> Result<()> {
        self.dev().scale(x, s).map_err(dev_err)
    }

    fn embed(&self, table: &Tensor, tokens: &[u32]) -> Result<DeviceBuffer<f32>> {
        let d = self.m.mat(table)?;
        let mut out = self.alloc(tokens.len() * d.cols())?;
        match self.tokens {
            Tokens::Host => self.dev().embed(d, tokens, &mut out),
            Tokens::Device(ids) => self.dev().embed_ids(d, ids, &mut out),
        }
        .map_err(dev_err)?;
        Ok(out)
    }

    fn run(
        &mut self,
        w: &Gemma4Weights,
        tokens: &[u32],
        rows: &[usize],
    ) -> Result<DeviceBuffer<f32>> {
        let h = self.cfg.hidden_size;
        let mut x = self.embed(&w.embed_tokens, tokens)?;
        self.scale(&mut x, w.embed_scale)?;
        let ple = match (&self.g.per_layer_input, &w.per_layer_input) {
            (Some(cfg), Some(pw)) => {
                // Per-layer inputs of every token, [n, layers * width] (CPU: per_layer_inputs).
                let mut identity = self.embed(&pw.embed_tokens_per_layer, tokens)?;
                self.scale(&mut identity, pw.embed_scale)?;
                let mut context = self.product(&x, &pw.model_projection)?;
                self.scale(&mut context, (h as f64).powf(-0.5) as f32)?;
                self.norm_in_place(&mut context, &pw.projection_norm)?;
                self.add(&mut context, &identity)?;
                self.scale(&mut context, 2f64.powf(-0.5) as f32)?;
                Some((context, cfg.width))
            }
            _ => None,
        };
        // Each layer's last kernel also makes the next norm of the residual: the next layer's
        // input norm, then the final norm (a layer with per-layer inputs leaves it to the next).
        let mut xn = None;
        for (l, lw) in w.layers.iter().enumerate() {
            let next = w.layers.get(l + 1).map_or(&w.norm, |n| &n.input_layernorm);
            xn = self.layer(l, lw, &mut x, xn, ple.as_ref(), Some(next))?;
        }
        if rows.is_empty() {
            return self.alloc(0);
        }
        let normed = xn.is_some();
        let src = xn.unwrap_or(x);
        let last = if rows.iter().copied().eq(0..self.rows) {
            src
        } else {
            let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
            let idx = self.dev().upload(&idx).map_err(dev_err)?;
            let mut out = self.alloc(rows.len() * h)?;
            self.dev()
                .gather_rows(&src, &idx, h, &mut out)
                .map_err(dev_err)?;
            out
        };
        let last = if normed {
            last
        } else {
            self.norm(&last, &w.norm)?
        };
        let mut logits = self.product(&last, &w.lm_head)?;
        if let Some(cap) = self.g.final_logit_softcapping {
            self.dev().softcap(&mut logits, cap).map_err(dev_err)?;
        }
        Ok(logits)
    }

    /// One decoder layer on the residual stream `x`, in place (CPU: `forward::layer`), its
    /// norms, adds and scales in two launches (`gemma4_attn_tail`, `gemma4_ffn_tail`). `xn` is
    /// `input_layernorm(x)` when the layer before made it. Given `next` (the next layer's input
    /// norm, or the final norm), returns that norm of the new `x`, unless the layer has
    /// per-layer inputs (they come between its last add and its scale).
    fn layer(
        &mut self,
        l: usize,
        lw: &Gemma4LayerWeights,
        x: &mut DeviceBuffer<f32>,
        xn: Option<DeviceBuffer<f32>>,
        ple: Option<&(DeviceBuffer<f32>, usize)>,
        next: Option<&[f32]>,
    ) -> Result<Option<DeviceBuffer<f32>>> {
        let m = self.m;
        let eps = self.cfg.rms_norm_eps;
        let h = self.cfg.hidden_size;
        let xn = match xn {
            Some(xn) => xn,
            None => self.norm(x, &lw.input_layernorm)?,
        };
        let attn = self.attention(l, &lw.self_attn, &xn)?;

        let moe = lw.moe.as_ref().zip(self.cfg.moe.as_ref());
        let mut ffn_in = self.alloc(x.len())?;
        let mut routed_in = match moe {
            Some(_) => Some((self.alloc(x.len())?, self.alloc(x.len())?)),
            None => None,
        };
        let router = match moe {
            Some((mw, _)) => Some(RouterNorms {
                scale: m.vec(&mw.router_scale)?,
                root: (h as f64).powf(-0.5) as f32,
                pre_feedforward_2: m.vec(&mw.pre_feedforward_layernorm_2)?,
            }),
            None => None,
        };
        let norms = AttnTailNorms {
            post_attention: m.vec(&lw.post_attention_layernorm)?,
            pre_feedforward: m.vec(&lw.pre_feedforward_layernorm)?,
            router,
            eps,
        };
        let out = AttnTailOut {
            normed: &mut ffn_in,
            router_in: routed_in.as_mut().map(|(r, e)| (r, e)),
        };
        m.dev
            .gemma4_attn_tail(x, &attn, &norms, out)
            .map_err(dev_err)?;

        let dense = self.mlp(&ffn_in, &lw.mlp)?;
        let routed = match (moe, &routed_in) {
            (Some((mw, mc)), Some((xr, xe))) => Some((self.experts(mw, mc.top_k, xr, xe)?, mw)),
            _ => None,
        };
        let per_layer = lw.per_layer_input.as_ref().zip(ple);
        let tail = FfnTail {
            dense: &dense,
            routed: match &routed {
                Some((r, mw)) => Some((
                    r,
                    m.vec(&mw.post_feedforward_layernorm_1)?,
                    m.vec(&mw.post_feedforward_layernorm_2)?,
                )),
                None => None,
            },
            post_feedforward: m.vec(&lw.post_feedforward_layernorm)?,
            // With per-layer inputs the scale waits for them (below); times 1 changes no bit.
            layer_scalar: if per_layer.is_some() {
                1.0
            } else {
                lw.layer_scalar
            },
            eps,
        };
        let mut next_out = match next {
            Some(w) if per_layer.is_none() => Some((m.vec(w)?, self.alloc(x.len())?)),
            _ => None,
        };
        m.dev
            .gemma4_ffn_tail(x, &tail, next_out.as_mut().map(|(w, o)| (*w, o)))
            .map_err(dev_err)?;

        if let Some((li, (inputs, width))) = per_layer {
            let packed = self.g.layers.len() * width;
            let mut gate = self.product(x, &li.gate)?;
            self.dev()
                .gelu_tanh_mul_strided(&mut gate, *width, inputs, packed, l * width)
                .map_err(dev_err)?;
            let mut proj = self.product(&gate, &li.projection)?;
            self.norm_in_place(&mut proj, &li.post_norm)?;
            self.add(x, &proj)?;
            self.scale(x, lw.layer_scalar)?;
        }
        Ok(next_out.map(|(_, o)| o))
    }

    /// `down(gelu_tanh(gate(x)) * up(x))`.
    fn mlp(
        &self,
        x: &DeviceBuffer<f32>,
        w: &crate::weights::MlpWeights,
    ) -> Result<DeviceBuffer<f32>> {
        // One token: gate and up in one GEMV over their stacked rows (upload_layer), read as
        // two slices; the same rows, so the same bits as two products.
        let inter = w.gate_proj.weight.shape[0];
        let stacked = match self.m.qkv.get(&tensor_key(&w.gate_proj.weight)) {
            Some(st) if x.len() == self.cfg.hidden_size => Some(self.product_with(x, &st.weight)?),
            _ => None,
        };
        if let Some(mut all) = stacked {
            if all.len() != 2 * inter {
                return Err(Error::Device(format!(
                    "gemma4 mlp: the stacked gate and up give {} values, expected {}",
                    all.len(),
                    2 * inter
                )));
            }
            let (mut gate, up) = all.split_at_mut(inter);
            self.dev().gelu_tanh_mul(&mut gate, &up).map_err(dev_err)?;
            let down = &w.down_proj;
            let mut out = self.alloc(self.cfg.hidden_size)?;
            self.dev()
                .gemv(&gate, 1, self.m.mat(&down.weight)?, &mut out)
                .map_err(dev_err)?;
            if let Some(b) = &down.bias {
                self.dev()
                    .add_bias(&mut out, self.m.vec(b)?)
                    .map_err(dev_err)?;
            }
            return Ok(out);
        }
        let mut gate = self.linear(x, &w.gate_proj)?;
        let up = self.linear(x, &w.up_proj)?;
        self.dev().gelu_tanh_mul(&mut gate, &up).map_err(dev_err)?;
        self.linear(&gate, &w.down_proj)
    }

    /// The routed experts (CPU: `moe::experts`) from the attention tail's two inputs: the
    /// router's `xr` (the residual normed and scaled) and the experts' `xe`
    /// (`pre_feedforward_layernorm_2` of it); the weighted sum before
    /// `post_feedforward_layernorm_2`.
    fn experts(
        &mut self,
        w: &Gemma4MoeWeights,
        top_k: usize,
        xr: &DeviceBuffer<f32>,
        xe: &DeviceBuffer<f32>,
    ) -> Result<DeviceBuffer<f32>> {
        let h = self.cfg.hidden_size;
        let n = self.rows;
        let num_experts = w.per_expert_scale.len();
        let logits = self.product(xr, &w.router_proj)?;
        let m = self.m;
        let dev = &m.dev;
        let mut ids = self.kv.scratch.activation::<u32>(&self.m.dev, n * top_k)?;
        let mut weights = self.alloc(n * top_k)?;
        let shape = RouterShape {
            experts: num_experts,
            top_k,
            renormalise: true,
        };
        let scale = self.m.vec(&w.per_expert_scale)?;
        dev.route_topk_scaled(&logits, shape, scale, &mut ids, &mut weights)
            .map_err(dev_err)?;
        let experts = m.experts.get(&tensor_key(&w.router_proj)).ok_or_else(|| {
            Error::Device("internal: a Gemma 4 layer's experts were not uploaded".into())
        })?;
        let mut out = self.alloc(n * h)?;
        let scratch = self.kv.scratch.moe(dev, experts, n, top_k)?;
        dev.moe_experts(xe, &ids, &weights, top_k, experts, scratch, &mut out)
            .map_err(dev_err)?;
        Ok(out)
    }

    /// Self-attention of layer `l` (CPU: `attention::attention`).
    fn attention(
        &mut self,
        l: usize,
        w: &Gemma4AttentionWeights,
        xn: &DeviceBuffer<f32>,
    ) -> Result<DeviceBuffer<f32>> {
        let spec = self.g.layers[l];
        let d = spec.head_dim;
        let heads = self.cfg.num_heads;
        let extra = self.extra;
        let rope = if spec.sliding {
            &extra.sliding_rope
        } else {
            &extra.full_rope
        };
        let (m, placement) = (self.m, self.at);
        let dev = &m.dev;
        // Sliding layers read their own tables when the KV cache keeps them apart.
        let at = crate::cuda::placement(placement, spec.sliding);
        let stacked = m.qkv.get(&tensor_key(&w.q_proj.weight));
        let q = match (stacked, &w.kv) {
            // One GEMV (or GEMM) of the stacked q/k/v, then one kernel for the q/k norms, RoPE,
            // v's unit norm and the K/V write into the pool.
            (Some(stacked), Some(own)) => {
                let qkv = self.product_with(xn, &stacked.weight)?;
                let rows = self.rows;
                let mut q = self.alloc(rows * heads * d)?;
                let mut k = self.alloc(rows * spec.num_kv_heads * d)?;
                let mut v = self.alloc(rows * spec.num_kv_heads * d)?;
                let shape = QkvShape {
                    heads_q: heads,
                    heads_kv: spec.num_kv_heads,
                    head_dim: d,
                    eps: self.cfg.rms_norm_eps,
                    v_unit_norm: true,
                };
                let pool = self.kv.pools[l]
                    .as_mut()
                    .ok_or_else(|| Error::Device(format!("layer {l} has no KV pool")))?;
                dev.qkv_split_norm_rope(
                    &qkv,
                    shape,
                    &placement.positions_u32,
                    Some(m.vec(&w.q_norm)?),
                    Some(m.vec(&own.k_norm)?),
                    rope,
                    &mut q,
                    &mut k,
                    &mut v,
                    None,
                    Some((pool, &at)),
                )
                .map_err(dev_err)?;
                q
            }
            _ => self.attention_inputs_unfused(l, w, xn, rope, &at)?,
        };
        self.attend(l, &q, &w.o_proj)
    }

    /// q normed and rotated, and (for a layer with its own K/V) k and v written into the layer's
    /// pool, one op after another.
    fn attention_inputs_unfused(
        &mut self,
        l: usize,
        w: &Gemma4AttentionWeights,
        xn: &DeviceBuffer<f32>,
        rope: &DeviceRope,
        at: &TokenPlacement,
    ) -> Result<DeviceBuffer<f32>> {
        let spec = self.g.layers[l];
        let d = spec.head_dim;
        let heads = self.cfg.num_heads;
        let (m, placement) = (self.m, self.at);
        let dev = &m.dev;
        let mut q = self.linear(xn, &w.q_proj)?;
        self.norm_in_place(&mut q, &w.q_norm)?;
        dev.rope(&mut q, &placement.positions_u32, rope, heads, d)
            .map_err(dev_err)?;

        if let Some(own) = &w.kv {
            let mut k = self.linear(xn, &own.k_proj)?;
            let mut v = match &own.v_proj {
                Some(v_proj) => self.linear(xn, v_proj)?,
                // attention_k_eq_v: the values are the keys before k_norm and RoPE.
                None => self.copy(&k)?,
            };
            self.norm_in_place(&mut k, &own.k_norm)?;
            dev.rope(&mut k, &placement.positions_u32, rope, spec.num_kv_heads, d)
                .map_err(dev_err)?;
            self.unit_norm(&mut v, d)?;
            let pool = self.kv.pools[l]
                .as_mut()
                .ok_or_else(|| Error::Device(format!("layer {l} has no KV pool")))?;
            dev.kv_write(pool, &k, &v, at).map_err(dev_err)?;
        }
        Ok(q)
    }

    /// Attention of layer `l`'s queries over the K/V it reads, then `o_proj`.
    fn attend(
        &mut self,
        l: usize,
        q: &DeviceBuffer<f32>,
        o_proj: &Linear,
    ) -> Result<DeviceBuffer<f32>> {
        let spec = self.g.layers[l];
        let d = spec.head_dim;
        let heads = self.cfg.num_heads;
        let (m, placement) = (self.m, self.at);
        let dev = &m.dev;
        let at = crate::cuda::placement(placement, spec.sliding);

        let shape = AttentionShape {
            num_heads: heads,
            num_kv_heads: spec.num_kv_heads,
            head_dim: d,
            scale: 1.0,
            sliding_window: spec.sliding.then_some(self.g.sliding_window),
        };
        // The tensor-core prefill tiles exist for head_dim 64 and 128 only.
        let prefill = match m.prefill_attention {
            AttentionPrefill::TensorCoreBf16 if matches!(d, 64 | 128) => {
                AttentionPrefill::TensorCoreBf16
            }
            _ => AttentionPrefill::ExactF32,
        };
        let mut out = self.alloc(self.rows * heads * d)?;
        let DeviceKv { pools, scratch, .. } = &mut *self.kv;
        let pool = pools[spec.kv_source].as_ref().ok_or_else(|| {
            Error::Device(format!(
                "layer {l} attends over layer {}'s K/V, which has no pool",
                spec.kv_source
            ))
        })?;
        dev.paged_attention_with(
            prefill,
            q,
            pool,
            &at,
            &shape,
            &mut out,
            &mut scratch.attention,
        )
        .map_err(dev_err)?;
        self.linear(&out, o_proj)
    }
}
