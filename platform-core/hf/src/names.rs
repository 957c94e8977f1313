//! How a checkpoint's tensors become a Kiln model's: each checkpoint tensor
//! gives one Kiln tensor or, split along its first dimension, several (GPT-2's
//! fused `c_attn` gives `q_proj`, `k_proj` and `v_proj`), transposed first
//! where the checkpoint stores `[in, out]` (GPT-2's `Conv1D`), its rows
//! reordered where the checkpoint lays them out otherwise ([`RowOrder`]).

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
    /// How the checkpoint's rows follow from Kiln's.
    pub rows: RowOrder,
}

/// How a checkpoint tensor's rows (after any transposition) follow from the
/// rows of its Kiln tensors, taken one after another.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum RowOrder {
    /// In the same order (Phi-3's `qkv_proj`, GPT-2's `c_attn`).
    #[default]
    Concatenated,
    /// Head by head: each of `heads` heads holds its rows of every part in
    /// turn, as GPT-NeoX's `query_key_value` holds `[q_0, k_0, v_0, q_1, ...]`.
    PerHead {
        /// The number of heads every part's rows divide into.
        heads: usize,
    },
    /// Interleaved rotary pairs: within each head of `head_dim` rows the
    /// checkpoint rotates dimension `2 i` with `2 i + 1` (Cohere's RoPE),
    /// where Kiln rotates `i` with `i + head_dim / 2`; Kiln's row `i` is the
    /// checkpoint's `2 i` and its row `head_dim / 2 + i` the checkpoint's
    /// `2 i + 1`, which turns one rotation into the other exactly (queries
    /// and keys permuted alike keep every score).
    RotaryPairs {
        /// The rows of one head (even).
        head_dim: usize,
    },
}

impl RowOrder {
    /// For each checkpoint row, the Kiln row it holds, for parts of `parts`
    /// rows; `None` for [`RowOrder::Concatenated`]. Fails when the rows do
    /// not divide into the heads.
    pub(crate) fn kiln_rows(&self, parts: &[usize]) -> Result<Option<Vec<usize>>, String> {
        let total: usize = parts.iter().sum();
        match *self {
            RowOrder::Concatenated => Ok(None),
            RowOrder::PerHead { heads } => {
                if heads == 0 || parts.iter().any(|n| !n.is_multiple_of(heads)) {
                    return Err(format!(
                        "parts of {parts:?} rows do not divide into {heads} heads"
                    ));
                }
                let mut out = Vec::with_capacity(total);
                for h in 0..heads {
                    let mut offset = 0;
                    for &n in parts {
                        let per = n / heads;
                        out.extend(offset + h * per..offset + (h + 1) * per);
                        offset += n;
                    }
                }
                Ok(Some(out))
            }
            RowOrder::RotaryPairs { head_dim } => {
                if head_dim == 0 || !head_dim.is_multiple_of(2) || !total.is_multiple_of(head_dim) {
                    return Err(format!(
                        "{total} rows do not divide into heads of an even {head_dim} rows"
                    ));
                }
                let half = head_dim / 2;
                Ok(Some(
                    (0..total)
                        .map(|row| {
                            let (head, i) = (row / head_dim, row % head_dim);
                            head * head_dim + if i % 2 == 0 { i / 2 } else { half + i / 2 }
                        })
                        .collect(),
                ))
            }
        }
    }
}

/// `values`, rows of `row_len`, reordered from the checkpoint's order to
/// Kiln's (`to_kiln`) or back, as `order` says for parts of `parts` rows.
pub(crate) fn reorder(
    order: &RowOrder,
    parts: &[usize],
    values: Vec<f32>,
    row_len: usize,
    to_kiln: bool,
) -> std::result::Result<Vec<f32>, String> {
    let Some(kiln_rows) = order.kiln_rows(parts)? else {
        return Ok(values);
    };
    if values.len() != kiln_rows.len() * row_len {
        return Err(format!(
            "{} values are not {} rows of {row_len}",
            values.len(),
            kiln_rows.len()
        ));
    }
    let mut out = vec![0f32; values.len()];
    for (hf, &kiln) in kiln_rows.iter().enumerate() {
        let (from, to) = if to_kiln { (hf, kiln) } else { (kiln, hf) };
        out[to * row_len..(to + 1) * row_len]
            .copy_from_slice(&values[from * row_len..(from + 1) * row_len]);
    }
    Ok(out)
}

/// `tensor` (`[rows, ...]`, float32) with its rows reordered as
/// [`reorder`] does.
pub(crate) fn reorder_tensor(
    order: &RowOrder,
    parts: &[usize],
    tensor: &HostTensor,
    to_kiln: bool,
) -> std::result::Result<HostTensor, String> {
    if *order == RowOrder::Concatenated {
        return Ok(tensor.clone());
    }
    let dims = tensor.dims().to_vec();
    let row_len: usize = dims.iter().skip(1).product();
    let values: Vec<f32> = tensor
        .to_dtype(DType::F32)
        .into_vec()
        .map_err(|e| e.to_string())?;
    let values = reorder(order, parts, values, row_len, to_kiln)?;
    HostTensor::new(values, dims).map_err(|e| e.to_string())
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
                    rows: RowOrder::Concatenated,
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
            rows: RowOrder::Concatenated,
        };
        let mut drop: Vec<usize> = found.into_iter().filter(|&i| i != at).collect();
        drop.sort_unstable_by(|a, b| b.cmp(a));
        for i in drop {
            self.mappings.remove(i);
        }
    }

    /// Sets the row order of the checkpoint tensor `hf` (mapped already).
    pub(crate) fn order_rows(&mut self, hf: &str, rows: RowOrder) {
        if let Some(m) = self.mappings.iter_mut().find(|m| m.hf == hf) {
            m.rows = rows;
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
    if mapping.rows != RowOrder::Concatenated {
        let parts: Vec<usize> = shapes
            .iter()
            .map(|s| s.first().copied().unwrap_or(1))
            .collect();
        let row_len: usize = dims.iter().skip(1).product();
        values = reorder(&mapping.rows, &parts, values, row_len, true).map_err(|e| {
            crate::HfError::Core(kiln_core::Error::invalid_argument(&mapping.hf, e))
        })?;
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
    if mapping.rows != RowOrder::Concatenated {
        let rows: Vec<usize> = parts.iter().map(|p| p.dims()[0]).collect();
        let row_len: usize = dims.iter().skip(1).product();
        values = reorder(&mapping.rows, &rows, values, row_len, false).map_err(|e| {
            crate::HfError::Core(kiln_core::Error::invalid_argument(&mapping.hf, e))
        })?;
    }
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
            rows: RowOrder::Concatenated,
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

#[cfg(test)]
mod row_order_tests {
    use super::*;

    fn rows(order: RowOrder, parts: &[usize]) -> Vec<usize> {
        order.kiln_rows(parts).unwrap().unwrap()
    }

    #[test]
    fn per_head_rows_interleave_the_parts_head_by_head() {
        // q, k, v of 2 heads of 2 rows: [q0 q0 k0 k0 v0 v0 q1 q1 k1 k1 v1 v1].
        assert_eq!(
            rows(RowOrder::PerHead { heads: 2 }, &[4, 4, 4]),
            [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
        );
        assert!(RowOrder::PerHead { heads: 3 }.kiln_rows(&[4, 4]).is_err());
    }

    #[test]
    fn rotary_pairs_deinterleave_each_head() {
        // Two heads of 4: the checkpoint's rows 0 2 | 1 3 are Kiln's 0 1 | 2 3.
        assert_eq!(
            rows(RowOrder::RotaryPairs { head_dim: 4 }, &[8]),
            [0, 2, 1, 3, 4, 6, 5, 7]
        );
        assert!(RowOrder::RotaryPairs { head_dim: 3 }
            .kiln_rows(&[6])
            .is_err());
    }

    #[test]
    fn a_reordered_fused_tensor_splits_and_joins_back() {
        let m = Mapping {
            hf: "qkv.weight".to_owned(),
            kiln: vec!["q".into(), "k".into(), "v".into()],
            transposed: false,
            hf_shape: None,
            rows: RowOrder::PerHead { heads: 2 },
        };
        // 12 rows of 1: row r holds r.
        let fused =
            HostTensor::new((0..12).map(|v| v as f32).collect::<Vec<_>>(), [12, 1]).unwrap();
        let parts = split(&m, &fused, &[&[4, 1], &[4, 1], &[4, 1]]).unwrap();
        // q = heads 0 and 1's first two rows: checkpoint rows 0, 1, 6, 7.
        assert_eq!(parts[0].as_slice::<f32>().unwrap(), &[0.0, 1.0, 6.0, 7.0]);
        assert_eq!(parts[2].as_slice::<f32>().unwrap(), &[4.0, 5.0, 10.0, 11.0]);
        let refs: Vec<&HostTensor> = parts.iter().collect();
        assert_eq!(join(&m, &refs).unwrap(), fused);
    }
}
