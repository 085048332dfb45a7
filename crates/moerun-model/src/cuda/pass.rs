//! One forward pass on the GPU: the [`Backend`] ops as device kernels over f32 activation
//! buffers. Nothing here waits for the device except [`Backend::to_host`] at the end (and the
//! fused MoE op's prefill path, which groups tokens by expert on the host).
//!
//! Linear layers: up to [`GEMV_MAX_ROWS`] rows run the GEMV (f32 activations, weights streamed
//! once per 8 rows); more rows run cuBLAS, whose bf16 path rounds the activations to bf16 first
//! (f32 weights stay an exact f32 SGEMM). That rounding is the main difference between GPU
//! prefill and the CPU: 4e-3 to 1.3e-2 relative error on the bf16 fixtures' logits, where token
//! by token (GEMV) stays under 1e-6.

use moerun_core::{DType, Error, Result, Tensor};
use moerun_cuda::{
    AttentionShape, BatchKvBf16, CudaDevice, CudaSlice, DeviceBuffer, DeviceKvPool, DeviceMatrix,
    FoldedPrologue, GemmOut, QkvShape, RouterShape, TokenPlacement,
};

use super::{dev_err, profile, tensor_key, vec_key, CudaModel, DeviceKv, PassScratch, StackedQkv};
use crate::backend::{AttentionInputs, AttentionSpec, Backend};
use crate::batch::Batch;
use crate::config::{ModelConfig, MoeConfig};
use crate::weights::{AttentionWeights, GatedDeltaNetWeights, Linear, MlpWeights, MoeWeights};

/// Rows up to which a linear layer runs the GEMV rather than cuBLAS: the GEMV streams the
/// weights once per 8 rows, so past a few launches the GEMM's single read wins.
pub const GEMV_MAX_ROWS: usize = 16;

/// The batch's placement on the device, shared by every layer: each token's position (i32 for
/// attention, u32 for RoPE), where its sequence's block table starts, the tables, and the
/// host-known bound on contexts that sizes attention's split-K grid. When the batch names window
/// tables, they follow the block tables in `block_tables` and `window_table_start` says where
/// each token's starts; the sliding-window layers read those.
pub struct Placement {
    pub(crate) positions_u32: CudaSlice<u32>,
    pub(crate) positions: CudaSlice<i32>,
    pub(crate) table_start: CudaSlice<i32>,
    pub(crate) window_table_start: Option<CudaSlice<i32>>,
    pub(crate) block_tables: CudaSlice<i32>,
    pub(crate) max_context: usize,
    /// Each sequence's first token in the flat batch (host side: attention's split grid starts
    /// past the tokens that prefill tiles own).
    pub(crate) seq_starts: Vec<usize>,
}

impl Placement {
    /// Upload the placement of `batch`'s tokens.
    pub fn of_batch(dev: &CudaDevice, batch: &Batch) -> Result<Placement> {
        let n = batch.num_tokens();
        let mut positions = Vec::with_capacity(n);
        let mut tables: Vec<i32> = Vec::new();
        let mut max_context = 0;
        let mut seq_starts = Vec::with_capacity(batch.seqs.len());
        for seq in &batch.seqs {
            seq_starts.push(positions.len());
            for i in 0..seq.tokens.len() {
                positions.push((seq.start_pos + i) as i32);
            }
            max_context = max_context.max(seq.start_pos + seq.tokens.len());
        }
        let table_start = append_tables(batch, false, &mut tables)?;
        let window_table_start = match batch.window_tables.is_empty() {
            true => None,
            false => Some(append_tables(batch, true, &mut tables)?),
        };
        if tables.is_empty() {
            tables.push(0); // a zero-length device buffer cannot be passed to a kernel
        }
        let positions_u32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        Ok(Placement {
            positions_u32: dev.upload(&positions_u32).map_err(dev_err)?,
            positions: dev.upload(&positions).map_err(dev_err)?,
            table_start: dev.upload(&table_start).map_err(dev_err)?,
            window_table_start: window_table_start
                .map(|w| dev.upload(&w).map_err(dev_err))
                .transpose()?,
            block_tables: dev.upload(&tables).map_err(dev_err)?,
            max_context,
            seq_starts,
        })
    }
}

/// Append each sequence's block table of the window group (`windowed`) or of the other layers to
/// `tables` (released entries become -1, which the kernels skip) and return, per token, where
/// its sequence's table starts.
fn append_tables(batch: &Batch, windowed: bool, tables: &mut Vec<i32>) -> Result<Vec<i32>> {
    let mut starts = Vec::with_capacity(batch.num_tokens());
    for (i, seq) in batch.seqs.iter().enumerate() {
        let start = i32::try_from(tables.len())
            .map_err(|_| Error::InvalidArgument("block tables too large".into()))?;
        tables.extend(batch.table(i, windowed).blocks.iter().map(|&b| b as i32));
        starts.extend(std::iter::repeat_n(start, seq.tokens.len()));
    }
    Ok(starts)
}

/// The batch's placement in the block tables of a layer's group: the window group's tables for a
/// sliding-window layer when the cache keeps them apart, else the others.
pub(crate) fn placement(at: &Placement, windowed: bool) -> TokenPlacement<'_> {
    let table_start = match (&at.window_table_start, windowed) {
        (Some(w), true) => w,
        _ => &at.table_start,
    };
    TokenPlacement {
        positions: &at.positions,
        table_start,
        block_tables: &at.block_tables,
        max_context: at.max_context,
        seq_starts: &at.seq_starts,
    }
}

/// The bf16 copy of this batch's K/V that the tensor-core prefill tiles read, when the batch
/// takes them (`(rows, kv_heads, head_dim)`): the prologue (or kv_write) fills it and attention
/// reads it, both asking here. Never in a decode step captured into a graph (tokens on the
/// device): the graph would keep the copy's address, which a later, larger prefill frees; such
/// steps never tile anyway (one token per sequence).
fn batch_copy<'s>(
    m: &CudaModel,
    tokens: &Tokens,
    slot: &'s mut Option<BatchKvBf16>,
    (rows, kv_heads, head_dim): (usize, usize, usize),
) -> Result<Option<&'s mut BatchKvBf16>> {
    if !matches!(tokens, Tokens::Host) || !m.prefill_attention.takes_batch_copy(rows, head_dim) {
        return Ok(None);
    }
    let copy = m.dev.batch_kv_in(slot, rows, kv_heads, head_dim);
    copy.map(Some).map_err(dev_err)
}

/// The device attention's shape of the generic block's spec.
fn attention_shape(spec: &AttentionSpec) -> AttentionShape {
    AttentionShape {
        num_heads: spec.num_heads,
        num_kv_heads: spec.num_kv_heads,
        head_dim: spec.head_dim,
        scale: spec.scale,
        sliding_window: spec.sliding_window,
    }
}

/// A layer's per-head q and k norm weights on the device, each where the layer has one.
type HeadNorms<'a> = (Option<&'a CudaSlice<f32>>, Option<&'a CudaSlice<f32>>);

/// Where the pass finds the batch's token ids.
pub enum Tokens<'a> {
    /// On the host, uploaded (and checked) by the embedding op.
    Host,
    /// Already on the device: a CUDA graph's input buffer, filled before each replay.
    Device(&'a CudaSlice<u32>),
}

/// A forward pass of a [`CudaModel`] over one batch, writing into `kv`'s pools.
pub struct CudaPass<'a> {
    m: &'a CudaModel,
    pools: &'a mut [Option<DeviceKvPool>],
    scratch: &'a mut PassScratch,
    at: &'a Placement,
    tokens: Tokens<'a>,
    /// Sequences and state slots of the Gated DeltaNet layers (hybrid models only).
    linear: Option<&'a super::deltanet::LinearPlacement>,
    /// The layer whose K/V the fused prologue has just written into its pool: its `attention`
    /// skips the write.
    kv_written: Option<usize>,
    /// The routing the last o_proj made ahead for the MoE block after it (see
    /// [`super::route_ahead`]), which that block's `add_norm_moe` takes.
    routed_ahead: Option<RoutedAhead>,
    /// MoE blocks this pass ran behind a route ahead (for tests: which path a step took).
    routed_ahead_blocks: usize,
}

/// A route ahead's outputs: the logits up to the norm's scale, the experts, and the router and
/// norm they were made for.
struct RoutedAhead {
    u: DeviceBuffer<f32>,
    ids: DeviceBuffer<u32>,
    router: (usize, usize),
    norm: (usize, usize),
}

impl<'a> CudaPass<'a> {
    pub fn new(
        m: &'a CudaModel,
        kv: &'a mut DeviceKv,
        at: &'a Placement,
        tokens: Tokens<'a>,
    ) -> CudaPass<'a> {
        CudaPass {
            m,
            pools: &mut kv.pools,
            scratch: &mut kv.scratch,
            at,
            tokens,
            linear: None,
            kv_written: None,
            routed_ahead: None,
            routed_ahead_blocks: 0,
        }
    }

    /// The pass with the batch's linear-attention placement, for models with Gated DeltaNet
    /// layers.
    pub fn with_linear_state(mut self, lp: &'a super::deltanet::LinearPlacement) -> CudaPass<'a> {
        self.linear = Some(lp);
        self
    }

    pub(crate) fn model(&self) -> &'a CudaModel {
        self.m
    }

    /// An output buffer the op about to run writes in full (see [`PassScratch::activation`]).
    pub(crate) fn alloc(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        self.scratch.activation(&self.m.dev, len)
    }

    /// `x · Wᵀ` for the device copy of `w`.
    fn product(&self, x: &DeviceBuffer<f32>, w: &Tensor) -> Result<DeviceBuffer<f32>> {
        self.product_with(x, self.m.mat(w)?)
    }

    /// `x · Dᵀ` for a device matrix.
    pub(crate) fn product_with(
        &self,
        x: &DeviceBuffer<f32>,
        d: &DeviceMatrix,
    ) -> Result<DeviceBuffer<f32>> {
        let rows = x.len() / d.cols();
        let mut out = self.alloc(rows * d.rows())?;
        let dev = &self.m.dev;
        if rows <= GEMV_MAX_ROWS || d.dtype() == DType::F16 {
            dev.gemv(x, rows, d, &mut out).map_err(dev_err)?;
        } else if let (Some(xb), DType::BF16) = (x.bf16(), d.dtype()) {
            // The bits gemm's own conversion would give, already written by x's producer.
            dev.gemm_bf16(xb, rows, d, GemmOut::F32(&mut out))
                .map_err(dev_err)?;
        } else {
            dev.gemm(x, rows, d, &mut out).map_err(dev_err)?;
        }
        Ok(out)
    }
    /// The stacked q/k/v projection of `xn` (its bias added): the fused prologue's input.
    fn stacked_qkv(
        &self,
        xn: &DeviceBuffer<f32>,
        stacked: &StackedQkv,
    ) -> Result<DeviceBuffer<f32>> {
        let mut qkv = self.product_with(xn, &stacked.weight)?;
        if let Some(b) = &stacked.bias {
            self.m.dev.add_bias(&mut qkv, b).map_err(dev_err)?;
        }
        Ok(qkv)
    }

    /// The stacked q/k/v weights of layer `layer` where its self-attention takes the folded
    /// path (the q/k/v GEMV, then one launch for the prologue and attention: a decode step the
    /// cluster kernel's folded build takes); None where it takes the composition of ops.
    fn folded_attention_qkv(
        &self,
        layer: usize,
        cfg: &ModelConfig,
        w: &AttentionWeights,
        spec: &AttentionSpec,
    ) -> Option<&'a StackedQkv> {
        let m = self.m;
        let stacked = m.qkv.get(&tensor_key(&w.q_proj.weight))?;
        if cfg.attention_output_gate {
            return None;
        }
        let at = placement(self.at, spec.sliding_window.is_some());
        let pool = self.pools[layer].as_ref()?;
        m.dev
            .attention_prologue_folds(&at, &attention_shape(spec), pool, &self.scratch.attention)
            .then_some(stacked)
    }

    /// The folded path's prologue and attention (see `folded_attention_qkv`) from the q/k/v
    /// GEMV's output `qkv`.
    fn folded_attention(
        &mut self,
        layer: usize,
        cfg: &ModelConfig,
        w: &AttentionWeights,
        spec: &AttentionSpec,
        qkv: &DeviceBuffer<f32>,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        let shape = attention_shape(spec);
        let at = placement(self.at, spec.sliding_window.is_some());
        profile::timed(&m.dev, "attention", || {
            let rows = qkv.len()
                / (spec.num_heads * spec.head_dim + 2 * spec.num_kv_heads * spec.head_dim);
            let mut out = self.alloc(rows * spec.num_heads * spec.head_dim)?;
            let (q_norm, k_norm) = self.head_norms(w)?;
            let prologue = FoldedPrologue {
                q_norm,
                k_norm,
                rope: &m.rope,
                eps: cfg.rms_norm_eps,
            };
            let pool = self.pools[layer]
                .as_mut()
                .ok_or_else(|| Error::Device(format!("layer {layer} has no KV pool")))?;
            m.dev
                .paged_attention_folded(
                    qkv,
                    prologue,
                    pool,
                    &at,
                    &shape,
                    &mut out,
                    &mut self.scratch.attention,
                )
                .map_err(dev_err)?;
            Ok(out)
        })
    }

    /// The device copies of a layer's per-head q and k norm weights (none where it has none).
    fn head_norms(&self, w: &AttentionWeights) -> Result<HeadNorms<'a>> {
        let m = self.m;
        let norm = |n: &Option<Vec<f32>>| n.as_deref().map(|n| m.vec(n)).transpose();
        Ok((norm(&w.q_norm)?, norm(&w.k_norm)?))
    }

    /// The MoE block after its routing (`ids`, `weights`: top-k per row): the experts, summed
    /// in rank order, and the shared expert as the family defines it.
    fn moe_routed(
        &mut self,
        x: &DeviceBuffer<f32>,
        (ids, weights): (&DeviceBuffer<u32>, &DeviceBuffer<f32>),
        cfg: &MoeConfig,
        w: &MoeWeights,
    ) -> Result<DeviceBuffer<f32>> {
        let dev = &self.m.dev;
        let hidden = w.router.shape[1];
        let rows = x.len() / hidden;
        let k = cfg.top_k;
        let experts = self.m.experts.get(&tensor_key(&w.router)).ok_or_else(|| {
            Error::Device("internal: a MoE layer's experts were not uploaded".into())
        })?;
        let mut out = self.alloc(rows * hidden)?;
        let scratch = self.scratch.moe(dev, experts, rows, k)?;
        let xb = x.bf16().map(|b| &**b);
        dev.moe_experts_with_bf16_x(x, xb, ids, weights, k, experts, scratch, &mut out)
            .map_err(dev_err)?;
        if let Some(shared) = &w.shared_expert {
            // One token: the shared expert's gate, up and gate rows in one GEMV (upload.rs
            // stacks them), read as slices of its output; the same rows, so the same bits
            // as three products.
            let stacked = match self.m.qkv.get(&tensor_key(&shared.gate_proj.weight)) {
                Some(st) if rows == 1 => Some(self.product_with(x, &st.weight)?),
                _ => None,
            };
            if let Some(mut all) = stacked {
                let inter = shared.gate_proj.weight.shape[0];
                let gates = usize::from(w.shared_expert_gate.is_some());
                if all.len() != 2 * inter + gates {
                    return Err(Error::Device(format!(
                        "moe: the stacked shared expert gives {} values, expected {}",
                        all.len(),
                        2 * inter + gates
                    )));
                }
                let (mut g, mut rest) = all.split_at_mut(inter);
                let (u, sg) = rest.split_at_mut(inter);
                dev.silu_mul(&mut g, &u).map_err(dev_err)?;
                let down = &shared.down_proj;
                let mut s = self.alloc(hidden)?;
                dev.gemv(&g, 1, self.m.mat(&down.weight)?, &mut s)
                    .map_err(dev_err)?;
                if let Some(b) = &down.bias {
                    dev.add_bias(&mut s, self.m.vec(b)?).map_err(dev_err)?;
                }
                let gate = (gates == 1).then_some(&sg);
                dev.add_sigmoid_scaled(&mut out, &s, gate, hidden)
                    .map_err(dev_err)?;
                return Ok(out);
            }
            let s = self.mlp(x, shared)?;
            let gate = match &w.shared_expert_gate {
                Some(g) => Some(self.product(x, g)?),
                None => None,
            };
            dev.add_sigmoid_scaled(&mut out, &s, gate.as_deref(), hidden)
                .map_err(dev_err)?;
        }
        Ok(out)
    }
}

impl CudaPass<'_> {
    /// A layer's o_proj of one token's attention output `a`, with the route ahead of the MoE
    /// block after it where the layer has one (the routing left for that block's
    /// `add_norm_moe`); else the plain projection. `x`: the residual the block will add to.
    fn o_proj_routing_ahead(
        &mut self,
        layer: usize,
        a: &DeviceBuffer<f32>,
        w: &AttentionWeights,
        x: &DeviceBuffer<f32>,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        self.routed_ahead = None;
        let Some(ra) = m.route_ahead.get(&layer) else {
            return self.linear(a, &w.o_proj);
        };
        let o_proj = m.mat(&w.o_proj.weight)?;
        let (hidden, experts) = (o_proj.rows(), ra.shape.experts);
        if a.len() != o_proj.cols() || x.len() != hidden {
            return self.linear(a, &w.o_proj);
        }
        let router = m.mats.get(&ra.router).ok_or_else(|| {
            Error::Device("internal: a route ahead's router was not uploaded".into())
        })?;
        let norm = m.vecs.get(&ra.norm).ok_or_else(|| {
            Error::Device("internal: a route ahead's norm was not uploaded".into())
        })?;
        let mut y = self.alloc(hidden)?;
        let mut u = self.alloc(experts)?;
        let mut ids = self.scratch.activation::<u32>(&m.dev, ra.shape.top_k)?;
        profile::timed(&m.dev, "o_proj_route", || {
            m.dev
                .gemv_route_ahead(
                    a,
                    o_proj,
                    &mut y,
                    moerun_cuda::RouteInputs { router, norm, x },
                    (&ra.fold, ra.shape),
                    (&mut u, &mut ids),
                )
                .map_err(dev_err)
        })?;
        self.routed_ahead = Some(RoutedAhead {
            u,
            ids,
            router: ra.router,
            norm: ra.norm,
        });
        Ok(y)
    }

    /// The MoE block of one token behind its route ahead: `x += y` and the post-attention norm
    /// folded into the experts' gate_up, which also makes the routing weights.
    fn moe_routed_ahead(
        &mut self,
        x: &mut DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        (weight, eps): (&[f32], f32),
        cfg: &MoeConfig,
        w: &MoeWeights,
        ahead: RoutedAhead,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        let hidden = x.len();
        let experts = m.experts.get(&tensor_key(&w.router)).ok_or_else(|| {
            Error::Device("internal: a MoE layer's experts were not uploaded".into())
        })?;
        let mut sum = self.alloc(hidden)?;
        let mut weights = self.alloc(cfg.top_k)?;
        let mut out = self.alloc(hidden)?;
        let norm = m.vec(weight)?;
        let scratch = self.scratch.moe(&m.dev, experts, 1, cfg.top_k)?;
        m.dev
            .moe_experts_norm_routed(
                (&*x, y, norm, eps),
                &mut sum,
                (&ahead.u, &ahead.ids, cfg.norm_topk_prob),
                &mut weights,
                experts,
                scratch,
                &mut out,
            )
            .map_err(dev_err)?;
        *x = sum;
        self.routed_ahead_blocks += 1;
        Ok(out)
    }

    /// MoE blocks this pass has run behind a route ahead.
    #[cfg(test)]
    pub(crate) fn routed_ahead_blocks(&self) -> usize {
        self.routed_ahead_blocks
    }
}

impl Backend for CudaPass<'_> {
    type Act = DeviceBuffer<f32>;

    fn embed(&mut self, table: &Tensor, tokens: &[u32]) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "embed", || {
            let d = self.m.mat(table)?;
            let mut out = self.alloc(tokens.len() * d.cols())?;
            match self.tokens {
                Tokens::Host => self.m.dev.embed(d, tokens, &mut out),
                Tokens::Device(ids) => self.m.dev.embed_ids(d, ids, &mut out),
            }
            .map_err(dev_err)?;
            Ok(out)
        })
    }

    fn rms_norm(
        &mut self,
        x: &DeviceBuffer<f32>,
        weight: &[f32],
        eps: f32,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "rms_norm", || {
            let w = self.m.vec(weight)?;
            let mut out = self.alloc(x.len())?;
            self.m.dev.rms_norm(x, w, eps, &mut out).map_err(dev_err)?;
            Ok(out)
        })
    }

    fn add_rms_norm(
        &mut self,
        x: &mut DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        weight: &[f32],
        eps: f32,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "add_rms_norm", || {
            let w = m.vec(weight)?;
            let mut out = self.alloc(x.len())?;
            // Rows that go to the GEMMs (not the GEMV) of a bf16 model: write the bf16 input
            // they need in the same pass (see `product_with` and `moe`).
            let rows = x.len() / weight.len().max(1);
            if m.bf16_gemm_inputs && rows > GEMV_MAX_ROWS {
                let mut xb = self.scratch.activation::<u16>(&m.dev, x.len())?;
                m.dev
                    .add_rms_norm_with_bf16(x, y, w, eps, &mut out, Some(&mut xb))
                    .map_err(dev_err)?;
                out.attach_bf16(xb);
            } else {
                m.dev
                    .add_rms_norm(x, y, w, eps, &mut out)
                    .map_err(dev_err)?;
            }
            Ok(out)
        })
    }

    fn attention_inputs(
        &mut self,
        layer: usize,
        cfg: &ModelConfig,
        w: &AttentionWeights,
        xn: &DeviceBuffer<f32>,
    ) -> Result<AttentionInputs<DeviceBuffer<f32>>> {
        let m = self.m;
        let Some(stacked) = m.qkv.get(&tensor_key(&w.q_proj.weight)) else {
            return crate::forward::attention_inputs(self, cfg, w, xn);
        };
        profile::timed(&m.dev, "qkv_prologue", || {
            let qkv = self.stacked_qkv(xn, stacked)?;
            let d = cfg.head_dim;
            let rows = xn.len() / cfg.hidden_size;
            let mut gate = match cfg.attention_output_gate {
                true => Some(self.alloc(rows * cfg.num_heads * d)?),
                false => None,
            };
            let mut q = self.alloc(rows * cfg.num_heads * d)?;
            let mut k = self.alloc(rows * cfg.num_kv_heads * d)?;
            let mut v = self.alloc(rows * cfg.num_kv_heads * d)?;
            let norms = self.head_norms(w)?;
            let shape = QkvShape {
                heads_q: cfg.num_heads,
                heads_kv: cfg.num_kv_heads,
                head_dim: d,
                eps: cfg.rms_norm_eps,
                v_unit_norm: false,
            };
            // K/V go straight into the layer's pool too: no kv_write launch in `attention`; and
            // into the batch copy the tensor-core tiles read, when they take this batch.
            let windowed = cfg.layers[layer].sliding_window.is_some();
            let at = placement(self.at, windowed);
            let pool = self.pools[layer]
                .as_mut()
                .ok_or_else(|| Error::Device(format!("layer {layer} has no KV pool")))?;
            let copy = batch_copy(
                m,
                &self.tokens,
                &mut self.scratch.batch_kv,
                (rows, cfg.num_kv_heads, d),
            )?;
            m.dev
                .qkv_split_norm_rope_copy(
                    &qkv,
                    shape,
                    &self.at.positions_u32,
                    norms,
                    &m.rope,
                    (&mut q, &mut k, &mut v),
                    gate.as_deref_mut(),
                    Some((pool, &at)),
                    copy,
                )
                .map_err(dev_err)?;
            self.kv_written = Some(layer);
            Ok(AttentionInputs { q, k, v, gate })
        })
    }

    fn self_attention(
        &mut self,
        layer: usize,
        cfg: &ModelConfig,
        w: &AttentionWeights,
        spec: &AttentionSpec,
        xn: &DeviceBuffer<f32>,
    ) -> Result<DeviceBuffer<f32>> {
        let Some(stacked) = self.folded_attention_qkv(layer, cfg, w, spec) else {
            return crate::forward::self_attention(self, layer, cfg, w, spec, xn);
        };
        // A decode step that the cluster kernel's folded build takes: the q/k/v GEMV, then one
        // launch for the prologue (norms, RoPE, this token's K/V into the pool) and attention.
        let qkv = profile::timed(&self.m.dev, "qkv_prologue", || {
            self.stacked_qkv(xn, stacked)
        })?;
        self.folded_attention(layer, cfg, w, spec, &qkv)
    }

    fn add_norm_attention(
        &mut self,
        layer: usize,
        cfg: &ModelConfig,
        w: &AttentionWeights,
        x: &mut DeviceBuffer<f32>,
        y: Option<&DeviceBuffer<f32>>,
        (weight, eps): (&[f32], f32),
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        let hidden = cfg.hidden_size;
        let spec = crate::forward::attention_spec(cfg, cfg.layers[layer].sliding_window);
        let folds = x.len() == hidden
            && weight.len() == hidden
            && m.zero_row.len() == hidden
            && m.dev.gemv_add_norm_wanted();
        let folded = folds
            .then(|| self.folded_attention_qkv(layer, cfg, w, &spec))
            .flatten();
        let Some(stacked) = folded else {
            // The plain composition (forward::add_norm_attention), its o_proj with the route
            // ahead where the layer has one.
            let xn = crate::forward::add_norm(self, x, y, (weight, eps))?;
            let out = self.self_attention(layer, cfg, w, &spec, &xn)?;
            return self.o_proj_routing_ahead(layer, &out, w, x);
        };
        // One token: the residual add and the input norm folded into the q/k/v GEMV (one launch
        // and its wait fewer on the step's chain), then the folded attention. The first layer
        // has nothing to add: its row (the embedding's, from the launch right before) goes in
        // as the added term, after the GEMV's wait, to a zero residual read before it.
        let qkv = profile::timed(&m.dev, "qkv_prologue", || {
            let mut sum = self.alloc(hidden)?;
            let mut qkv = self.alloc(stacked.weight.rows())?;
            let norm = m.vec(weight)?;
            match y {
                Some(y) => {
                    m.dev
                        .gemv_add_norm((&*x, y, norm, eps), &stacked.weight, &mut sum, &mut qkv)
                }
                None => m.dev.gemv_add_norm(
                    (&m.zero_row, &*x, norm, eps),
                    &stacked.weight,
                    &mut sum,
                    &mut qkv,
                ),
            }
            .map_err(dev_err)?;
            *x = sum;
            if let Some(b) = &stacked.bias {
                m.dev.add_bias(&mut qkv, b).map_err(dev_err)?;
            }
            Ok(qkv)
        })?;
        let out = self.folded_attention(layer, cfg, w, &spec, &qkv)?;
        self.o_proj_routing_ahead(layer, &out, w, x)
    }

    fn final_logits(
        &mut self,
        x: &mut DeviceBuffer<f32>,
        y: Option<&DeviceBuffer<f32>>,
        rows: &[usize],
        hidden: usize,
        (weight, eps): (&[f32], f32),
        lm_head: &Tensor,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        // The fold reads rows in 16-byte chunks: 8 values of any dtype is a whole number of them.
        let one_token =
            x.len() == hidden && rows == [0] && weight.len() == hidden && hidden.is_multiple_of(8);
        let (Some(y), true) = (y, one_token && m.dev.gemv_add_norm_wanted()) else {
            return crate::forward::final_logits(self, x, y, rows, hidden, (weight, eps), lm_head);
        };
        // One token: the last residual add and the final norm folded into the LM head's GEMV
        // (two launches and their waits fewer a decode step).
        profile::timed(&m.dev, "final_logits", || {
            let head = m.mat(lm_head)?;
            let mut sum = self.alloc(hidden)?;
            let mut logits = self.alloc(head.rows())?;
            m.dev
                .gemv_add_norm((&*x, y, m.vec(weight)?, eps), head, &mut sum, &mut logits)
                .map_err(dev_err)?;
            *x = sum;
            Ok(logits)
        })
    }

    fn add_assign(&mut self, x: &mut DeviceBuffer<f32>, y: &DeviceBuffer<f32>) -> Result<()> {
        let m = self.m;
        profile::timed(&m.dev, "add_assign", || {
            self.m.dev.add_assign(x, y).map_err(dev_err)
        })
    }

    fn linear(&mut self, x: &DeviceBuffer<f32>, l: &Linear) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "linear", || {
            let mut out = self.product(x, &l.weight)?;
            if let Some(b) = &l.bias {
                let bias = self.m.vec(b)?;
                self.m.dev.add_bias(&mut out, bias).map_err(dev_err)?;
            }
            Ok(out)
        })
    }

    fn matmul(&mut self, x: &DeviceBuffer<f32>, w: &Tensor) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "matmul", || self.product(x, w))
    }

    fn clamp(&mut self, x: &mut DeviceBuffer<f32>, c: f32) -> Result<()> {
        let m = self.m;
        profile::timed(&m.dev, "clamp", || self.m.dev.clamp(x, c).map_err(dev_err))
    }

    fn rope(&mut self, x: &mut DeviceBuffer<f32>, heads: usize, head_dim: usize) -> Result<()> {
        let m = self.m;
        profile::timed(&m.dev, "rope", || {
            self.m
                .dev
                .rope(x, &self.at.positions_u32, &self.m.rope, heads, head_dim)
                .map_err(dev_err)
        })
    }

    fn split_query_gate(
        &mut self,
        q_and_gate: &DeviceBuffer<f32>,
        head_dim: usize,
    ) -> Result<(DeviceBuffer<f32>, DeviceBuffer<f32>)> {
        let m = self.m;
        profile::timed(&m.dev, "split_query_gate", || {
            let half = q_and_gate.len() / 2;
            let mut q = self.alloc(half)?;
            let mut gate = self.alloc(half)?;
            m.dev
                .split_query_gate(q_and_gate, head_dim, &mut q, &mut gate)
                .map_err(dev_err)?;
            Ok((q, gate))
        })
    }

    fn sigmoid_gate(&mut self, x: &mut DeviceBuffer<f32>, gate: &DeviceBuffer<f32>) -> Result<()> {
        let m = self.m;
        profile::timed(&m.dev, "sigmoid_gate", || {
            m.dev.sigmoid_gate(x, gate).map_err(dev_err)
        })
    }

    fn attention(
        &mut self,
        layer: usize,
        q: &DeviceBuffer<f32>,
        k: &DeviceBuffer<f32>,
        v: &DeviceBuffer<f32>,
        spec: &AttentionSpec,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "attention", || {
            let dev = &self.m.dev;
            let rows = q.len() / (spec.num_heads * spec.head_dim);
            let mut out = self.alloc(rows * spec.num_heads * spec.head_dim)?;
            let written = self.kv_written.take() == Some(layer);
            let at = placement(self.at, spec.sliding_window.is_some());
            let pool = self.pools[layer]
                .as_mut()
                .ok_or_else(|| Error::Device(format!("layer {layer} has no KV pool")))?;
            // The tensor-core tiles read this batch's own keys from its bf16 copy: filled by the
            // prologue when it wrote the pool (same batch, same question), else here.
            let mut copy = batch_copy(
                self.m,
                &self.tokens,
                &mut self.scratch.batch_kv,
                (rows, spec.num_kv_heads, spec.head_dim),
            )?;
            if !written {
                dev.kv_write_with_copy(pool, k, v, &at, copy.as_deref_mut())
                    .map_err(dev_err)?;
            }
            // A bf16 model's prefill: o_proj's GEMM reads the output rounded to bf16, which the
            // batch-copy attention writes itself (the wgmma tile kernel as it stores its rows).
            let out_bf16 = match copy.is_some() && m.bf16_gemm_inputs && rows > GEMV_MAX_ROWS {
                true => Some(dev.activation::<u16>(Some(&self.scratch.arena), out.len()))
                    .transpose()
                    .map_err(dev_err)?,
                false => None,
            };
            let shape = attention_shape(spec);
            let scratch = &mut self.scratch.attention;
            match (copy, out_bf16) {
                (Some(c), Some(mut ob)) => {
                    dev.paged_attention_batch_copy_with_bf16(
                        q, pool, c, &at, &shape, &mut out, &mut ob, scratch,
                    )
                    .map_err(dev_err)?;
                    out.attach_bf16(ob);
                    return Ok(out);
                }
                (Some(c), None) => {
                    dev.paged_attention_batch_copy(q, pool, c, &at, &shape, &mut out, scratch)
                }
                (None, _) => dev.paged_attention_with(
                    self.m.prefill_attention,
                    q,
                    pool,
                    &at,
                    &shape,
                    &mut out,
                    scratch,
                ),
            }
            .map_err(dev_err)?;
            Ok(out)
        })
    }

    fn mlp(&mut self, x: &DeviceBuffer<f32>, w: &MlpWeights) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "mlp", || {
            let mut g = self.linear(x, &w.gate_proj)?;
            let u = self.linear(x, &w.up_proj)?;
            self.m.dev.silu_mul(&mut g, &u).map_err(dev_err)?;
            self.linear(&g, &w.down_proj)
        })
    }

    fn moe(
        &mut self,
        x: &DeviceBuffer<f32>,
        cfg: &MoeConfig,
        w: &MoeWeights,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "moe", || {
            let dev = &self.m.dev;
            let hidden = w.router.shape[1];
            let rows = x.len() / hidden;
            let k = cfg.top_k;
            // The routing writes every choice: no memset (a launch per layer in a decode step).
            let mut ids = self.scratch.activation::<u32>(&self.m.dev, rows * k)?;
            let mut weights = self.alloc(rows * k)?;
            let shape = RouterShape {
                experts: cfg.num_experts,
                top_k: k,
                renormalise: cfg.norm_topk_prob,
            };
            let router = self.m.mat(&w.router)?;
            if rows == 1 && dev.gemv_route_supported(router.rows()) {
                // One token: the router GEMV and its top-k in one launch (the same bits).
                dev.gemv_route(x, router, shape, &mut ids, &mut weights)
            } else {
                let logits = self.product_with(x, router)?;
                dev.route_topk(&logits, shape, &mut ids, &mut weights)
            }
            .map_err(dev_err)?;
            self.moe_routed(x, (&ids, &weights), cfg, w)
        })
    }

    fn add_norm_moe(
        &mut self,
        x: &mut DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        (weight, eps): (&[f32], f32),
        cfg: &MoeConfig,
        w: &MoeWeights,
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        let hidden = w.router.shape[1];
        if let Some(ahead) = self.routed_ahead.take() {
            if ahead.router == tensor_key(&w.router)
                && ahead.norm == vec_key(weight)
                && x.len() == hidden
                && y.len() == hidden
            {
                return profile::timed(&m.dev, "moe", || {
                    self.moe_routed_ahead(x, y, (weight, eps), cfg, w, ahead)
                });
            }
        }
        let folds = m.dev.norm_route_wanted()
            && x.len() == hidden
            && weight.len() == hidden
            && m.dev.gemv_route_supported(cfg.num_experts);
        if !folds {
            return crate::forward::add_norm_moe(self, x, y, (weight, eps), cfg, w);
        }
        let router = m.mat(&w.router)?;
        // One token: the add+norm folded into the routing (one launch and its wait fewer on the
        // step's chain), then the experts.
        let k = cfg.top_k;
        let (xn, ids, weights) = profile::timed(&m.dev, "add_rms_norm", || {
            let mut ids = self.scratch.activation::<u32>(&m.dev, k)?;
            let mut weights = self.alloc(k)?;
            let mut sum = self.alloc(hidden)?;
            let mut xn = self.alloc(hidden)?;
            let shape = RouterShape {
                experts: cfg.num_experts,
                top_k: k,
                renormalise: cfg.norm_topk_prob,
            };
            m.dev
                .gemv_route_norm(
                    (&*x, y, m.vec(weight)?, eps),
                    (&mut sum, &mut xn),
                    router,
                    shape,
                    &mut ids,
                    &mut weights,
                )
                .map_err(dev_err)?;
            *x = sum;
            Ok((xn, ids, weights))
        })?;
        profile::timed(&m.dev, "moe", || {
            self.moe_routed(&xn, (&ids, &weights), cfg, w)
        })
    }

    fn gated_deltanet(
        &mut self,
        layer: usize,
        w: &GatedDeltaNetWeights,
        xn: &DeviceBuffer<f32>,
    ) -> Result<DeviceBuffer<f32>> {
        let Some(lp) = self.linear else {
            return Err(Error::Unsupported(
                "Gated DeltaNet layers keep per-sequence state: run the model with \
                 Model::forward_with_state and a cache from Model::new_linear_state"
                    .into(),
            ));
        };
        let m = self.m;
        profile::timed(&m.dev, "gated_deltanet", || {
            super::deltanet::gated_deltanet(self, lp, layer, w, xn)
        })
    }

    fn select_rows(
        &mut self,
        x: &DeviceBuffer<f32>,
        width: usize,
        rows: &[usize],
    ) -> Result<DeviceBuffer<f32>> {
        let m = self.m;
        profile::timed(&m.dev, "select_rows", || {
            let dev = &self.m.dev;
            if rows.iter().copied().eq(0..x.len() / width.max(1)) {
                // Every row in order (decode): a copy, and no host upload (which a graph could not
                // capture).
                let mut out = self.alloc(x.len())?;
                dev.copy_within(x, &mut out).map_err(dev_err)?;
                return Ok(out);
            }
            let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
            if idx.is_empty() {
                return self.alloc(0);
            }
            let idx = dev.upload(&idx).map_err(dev_err)?;
            let mut out = self.alloc(rows.len() * width)?;
            dev.gather_rows(x, &idx, width, &mut out).map_err(dev_err)?;
            Ok(out)
        })
    }

    fn upload(&mut self, x: &[f32]) -> Result<DeviceBuffer<f32>> {
        let x = self.m.dev.upload(x).map_err(dev_err)?;
        Ok(DeviceBuffer::owned(x))
    }

    fn to_host(&mut self, x: DeviceBuffer<f32>) -> Result<Vec<f32>> {
        if x.is_empty() {
            return Ok(Vec::new());
        }
        self.m.dev.download(&x).map_err(dev_err)
    }
}
