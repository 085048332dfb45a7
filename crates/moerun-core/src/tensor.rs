//! Weight tensors. A [`Tensor`] knows its dtype and shape and where its bytes live: inside a shared
//! file mapping (the usual case: nothing is copied at load) or in an owned buffer (synthetic weights,
//! converted tensors). [`MatRef`] is the borrowed 2-D view the kernels take.

use std::sync::Arc;

use half::{bf16, f16};

use crate::{DType, Error, Result};

/// A cheap-to-clone window onto bytes owned by something shared (an mmap, a `Vec<u8>`).
#[derive(Clone)]
pub struct SharedBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    offset: usize,
    len: usize,
}

impl SharedBytes {
    /// A window `[offset, offset + len)` onto `owner`. Fails if the window is out of bounds.
    pub fn new(
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        offset: usize,
        len: usize,
    ) -> Option<Self> {
        let total = (*owner).as_ref().len();
        if offset.checked_add(len)? > total {
            return None;
        }
        Some(SharedBytes { owner, offset, len })
    }

    /// Take ownership of a byte vector.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        SharedBytes {
            owner: Arc::new(bytes),
            offset: 0,
            len,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.offset..self.offset + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-window, relative to this one.
    pub fn slice(&self, offset: usize, len: usize) -> Option<Self> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        Some(SharedBytes {
            owner: self.owner.clone(),
            offset: self.offset + offset,
            len,
        })
    }
}

/// A stored tensor: dtype, shape (row-major) and bytes.
#[derive(Clone)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    bytes: SharedBytes,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({}, {:?})", self.dtype, self.shape)
    }
}

impl Tensor {
    /// A tensor over `bytes`; fails unless the byte count matches dtype and shape.
    pub fn new(dtype: DType, shape: Vec<usize>, bytes: SharedBytes) -> Result<Tensor> {
        let expected = shape.iter().product::<usize>() * dtype.size();
        if expected != bytes.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor of shape {shape:?} and dtype {dtype} needs {expected} bytes, got {}",
                bytes.len()
            )));
        }
        Ok(Tensor {
            dtype,
            shape,
            bytes,
        })
    }

    /// An owned f32 tensor.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Tensor> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor::new(DType::F32, shape, SharedBytes::from_vec(bytes))
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }

    /// Element `i` of the first dimension, as a tensor of one rank less (e.g. one expert of a
    /// fused `[experts, rows, cols]` tensor). Shares the bytes.
    pub fn index0(&self, i: usize) -> Result<Tensor> {
        let (&n, rest) = self
            .shape
            .split_first()
            .ok_or_else(|| Error::InvalidArgument("index0 on a scalar tensor".into()))?;
        if i >= n {
            return Err(Error::InvalidArgument(format!("index {i} out of {n}")));
        }
        let stride = rest.iter().product::<usize>() * self.dtype.size();
        let bytes = self
            .bytes
            .slice(i * stride, stride)
            .expect("in bounds by construction");
        Ok(Tensor {
            dtype: self.dtype,
            shape: rest.to_vec(),
            bytes,
        })
    }

    /// Rows `[start, start + count)` of the first dimension, sharing the bytes.
    pub fn narrow0(&self, start: usize, count: usize) -> Result<Tensor> {
        let n = *self
            .shape
            .first()
            .ok_or_else(|| Error::InvalidArgument("narrow0 on a scalar tensor".into()))?;
        if start + count > n {
            return Err(Error::InvalidArgument(format!(
                "rows {start}..{} out of {n}",
                start + count
            )));
        }
        let row = self.shape[1..].iter().product::<usize>() * self.dtype.size();
        let bytes = self
            .bytes
            .slice(start * row, count * row)
            .expect("in bounds by construction");
        let mut shape = self.shape.clone();
        shape[0] = count;
        Ok(Tensor {
            dtype: self.dtype,
            shape,
            bytes,
        })
    }

    /// The 2-D view `[rows, cols]` the kernels take. A 1-D tensor is one row.
    pub fn mat(&self) -> MatRef<'_> {
        let (rows, cols) = match self.shape.as_slice() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            _ => panic!("mat() on a tensor of rank {}", self.shape.len()),
        };
        MatRef {
            dtype: self.dtype,
            rows,
            cols,
            data: self.bytes(),
        }
    }

    /// All elements widened to f32 (for small tensors: norms, biases, embeddings rows).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.numel()];
        widen_into(self.dtype, self.bytes(), &mut out);
        out
    }
}

/// Widen `bytes` of `dtype` into `out` (little-endian storage, as safetensors and GGUF use).
pub fn widen_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}

/// A borrowed row-major matrix `[rows, cols]` of stored weights: `rows` output features, each a
/// contiguous run of `cols` input features. `data.len() == rows * cols * dtype.size()`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> MatRef<'a> {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols * self.dtype.size()
    }

    /// Row `r`'s bytes.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `[start, start + count)`.
    pub fn rows_range(&self, start: usize, count: usize) -> MatRef<'a> {
        let rb = self.row_bytes();
        MatRef {
            dtype: self.dtype,
            rows: count,
            cols: self.cols,
            data: &self.data[start * rb..(start + count) * rb],
        }
    }
}
