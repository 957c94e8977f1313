//! How a checkpoint's tensors become a Kiln model's: each checkpoint tensor
//! gives one Kiln tensor or, split along its first dimension, several (GPT-2's
//! fused `c_attn` gives `q_proj`, `k_proj` and `v_proj`), transposed first
//! where the checkpoint stores `[in, out]` (GPT-2's `Conv1D`).

use kiln_core::{DType, HostTensor};

use crate::error::Result;

/// One checkpoint tensor and the Kiln tensors it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Mapping {
    /// The checkpoint's name (`model.layers.0.self_attn.q_proj.weight`).
    pub hf: String,
    /// The Kiln names, in the order their rows follow each other.
    pub kiln: Vec<String>,
    /// Whether the checkpoint stores the matrix transposed (`[in, out]`).
    pub transposed: bool,
    /// The checkpoint's shape where it differs from Kiln's by unit
    /// dimensions only (ViT's `[1, n, hidden]` position table is Kiln's `[n, hidden]`).
    pub hf_shape: Option<Vec<usize>>,
}

/// Every tensor of a family's checkpoint, and the tensors it may hold that
/// the model ignores (causal-mask buffers, a tied head stored twice).
#[derive(Clone, Debug, Default)]
pub struct NameMap {
    /// The mappings, in the model's order.
    pub mappings: Vec<Mapping>,
    /// Checkpoint tensors read and dropped: exact names, and name suffixes.
    pub ignored: Vec<String>,
    /// Suffixes of ignored names (`.attn.masked_bias`).
    pub ignored_suffixes: Vec<String>,
}

impl NameMap {
    /// An empty map for `model`, and the names of its parameters and buffers
    /// (what [`prefix`](NameMap::prefix) maps).
    pub(crate) fn for_model(model: &kiln_core::model::Layer) -> Result<(Self, Vec<String>)> {
        let names = model
            .parameter_specs("")?
            .into_iter()
            .map(|s| s.name)
            .collect();
        Ok((NameMap::default(), names))
    }

    /// Maps every Kiln tensor under `kiln_prefix` to the same local name under `hf_prefix`.
    pub(crate) fn prefix(&mut self, names: &[String], kiln_prefix: &str, hf_prefix: &str) {
        self.prefix_with(names, kiln_prefix, hf_prefix, false);
    }

    /// As [`prefix`](NameMap::prefix), for matrices stored transposed.
    pub(crate) fn prefix_with(
        &mut self,
        names: &[String],
        kiln_prefix: &str,
        hf_prefix: &str,
        transposed: bool,
    ) {
        let dotted = format!("{kiln_prefix}.");
        for name in names {
            if let Some(local) = name.strip_prefix(&dotted) {
                self.mappings.push(Mapping {
                    hf: format!("{hf_prefix}.{local}"),
                    kiln: vec![name.clone()],
                    transposed: transposed && local == "weight",
                    hf_shape: None,
                });
            }
        }
    }

    /// Replaces the mappings of checkpoint tensors `parts` by one tensor
    /// `fused` whose rows hold theirs, in that order (Phi-3's `qkv_proj` of
    /// `q_proj`, `k_proj` and `v_proj`); unchanged unless every part is mapped.
    pub(crate) fn fuse(&mut self, parts: &[String], fused: &str) {
        let found: Vec<usize> = parts
            .iter()
            .filter_map(|p| self.mappings.iter().position(|m| &m.hf == p))
            .collect();
        if found.len() != parts.len() {
            return;
        }
        let kiln = found
            .iter()
            .flat_map(|&i| self.mappings[i].kiln.clone())
            .collect();
        let at = found.iter().copied().min().unwrap_or(0);
        let transposed = self.mappings[at].transposed;
        self.mappings[at] = Mapping {
            hf: fused.to_owned(),
            kiln,
            transposed,
            hf_shape: None,
        };
        let mut drop: Vec<usize> = found.into_iter().filter(|&i| i != at).collect();
        drop.sort_unstable_by(|a, b| b.cmp(a));
        for i in drop {
            self.mappings.remove(i);
        }
    }

    /// Whether the checkpoint tensor `name` is one the model drops.
    pub fn is_ignored(&self, name: &str) -> bool {
        self.ignored.iter().any(|n| n == name)
            || self
                .ignored_suffixes
                .iter()
                .any(|s| name.ends_with(s.as_str()))
    }

    /// The mapping of checkpoint tensor `name`.
    pub fn find(&self, name: &str) -> Option<&Mapping> {
        self.mappings.iter().find(|m| m.hf == name)
    }
}

/// A 2-d `[rows, cols]` float32 matrix transposed.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// The Kiln tensors (float32) of a checkpoint tensor, as `mapping` says;
/// `shapes` are theirs, in order (Phi-3's `qkv_proj` holds more query rows
/// than key or value rows).
pub(crate) fn split(
    mapping: &Mapping,
    tensor: &HostTensor,
    shapes: &[&[usize]],
) -> Result<Vec<HostTensor>> {
    let mut dims = tensor.dims().to_vec();
    if mapping.hf_shape.is_some() {
        dims = shapes.first().map(|s| s.to_vec()).unwrap_or_default();
    }
    let mut values: Vec<f32> = tensor.to_dtype(DType::F32).into_vec()?;
    if mapping.transposed && dims.len() == 2 {
        values = transpose(&values, dims[0], dims[1]);
        dims.swap(0, 1);
    }
    if mapping.kiln.len() == 1 {
        return Ok(vec![HostTensor::new(values, dims)?]);
    }
    let row_len: usize = dims[1..].iter().product();
    let mut out = Vec::with_capacity(shapes.len());
    let mut start = 0;
    for r in shapes.iter().map(|s| s.first().copied().unwrap_or(0)) {
        let mut part_dims = dims.clone();
        part_dims[0] = r;
        out.push(HostTensor::from_slice(
            &values[start..start + r * row_len],
            part_dims,
        )?);
        start += r * row_len;
    }
    Ok(out)
}

/// The checkpoint tensor (float32) of Kiln tensors `parts`, the inverse of [`split`].
pub(crate) fn join(mapping: &Mapping, parts: &[&HostTensor]) -> Result<HostTensor> {
    let mut values: Vec<f32> = Vec::new();
    let mut dims = parts[0].dims().to_vec();
    for p in parts {
        values.extend(p.to_dtype(DType::F32).into_vec::<f32>()?);
    }
    dims[0] = parts.iter().map(|p| p.dims()[0]).sum();
    if mapping.transposed && dims.len() == 2 {
        values = transpose(&values, dims[0], dims[1]);
        dims.swap(0, 1);
    }
    if let Some(shape) = &mapping.hf_shape {
        dims = shape.clone();
    }
    Ok(HostTensor::new(values, dims)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fused_transposed_tensor_splits_and_joins_back() {
        // GPT-2's c_attn: [in = 2, out = 3 * 2], q, k, v side by side.
        let fused =
            HostTensor::new((0..12).map(|v| v as f32).collect::<Vec<_>>(), [2, 6]).expect("tensor");
        let m = Mapping {
            hf: "c_attn.weight".to_owned(),
            kiln: vec!["q".into(), "k".into(), "v".into()],
            transposed: true,
            hf_shape: None,
        };
        let parts = split(&m, &fused, &[&[2, 2], &[2, 2], &[2, 2]]).expect("splits");
        // q = columns 0..2 of the [2, 6] matrix, transposed to [out, in].
        assert_eq!(
            parts[0].as_slice::<f32>().expect("f32"),
            &[0.0, 6.0, 1.0, 7.0]
        );
        assert_eq!(
            parts[2].as_slice::<f32>().expect("f32"),
            &[4.0, 10.0, 5.0, 11.0]
        );
        let refs: Vec<&HostTensor> = parts.iter().collect();
        assert_eq!(join(&m, &refs).expect("joins"), fused);
    }
}
