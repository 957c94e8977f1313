//! Token ids and their attention mask as one input: what a model that
//! [takes an attention mask](super::Layer::takes_attention_mask) reads from a
//! batch (one tensor, so that loaders, strategies splitting the batch and
//! CUDA graphs carry it as they carry the ids).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::HostTensor;

/// `[batch, 2, seq]` int64: `ids` (`[:, 0]`) and `attention_mask` (`[:, 1]`),
/// both `[batch, seq]` int64, the mask 1 on the tokens and 0 on the padding
/// (as the `attention_mask` of a `transformers` tokenizer). Padding may be on
/// either side; a position id counts every position, padding included, as
/// `model(input_ids, attention_mask=...)` does.
///
/// ```
/// use kiln_core::{model::stack_attention_mask, HostTensor};
///
/// let ids = HostTensor::new(vec![5i64, 6, 7, 8, 0, 0], [2, 3])?;
/// let mask = HostTensor::new(vec![1i64, 1, 1, 1, 0, 0], [2, 3])?;
/// let stacked = stack_attention_mask(&ids, &mask)?;
/// assert_eq!(stacked.dims(), [2, 2, 3]);
/// assert_eq!(stacked.as_slice::<i64>()?, &[5, 6, 7, 1, 1, 1, 8, 0, 0, 1, 0, 0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn stack_attention_mask(ids: &HostTensor, attention_mask: &HostTensor) -> Result<HostTensor> {
    let [batch, seq] = *ids.dims() else {
        return Err(Error::ShapeMismatch {
            context: "stack_attention_mask: the token ids".to_owned(),
            expected: "[batch, seq]".to_owned(),
            actual: crate::shape::Shape::from(ids.dims()).to_string(),
        });
    };
    if attention_mask.dims() != ids.dims() {
        return Err(Error::ShapeMismatch {
            context: "stack_attention_mask: the attention mask (one entry per token id)".to_owned(),
            expected: crate::shape::Shape::from(ids.dims()).to_string(),
            actual: crate::shape::Shape::from(attention_mask.dims()).to_string(),
        });
    }
    for (what, t) in [("token ids", ids), ("attention mask", attention_mask)] {
        if t.dtype() != DType::I64 {
            return Err(Error::DTypeMismatch {
                context: format!("stack_attention_mask: the {what}"),
                expected: DType::I64,
                actual: t.dtype(),
            });
        }
    }
    let (ids, mask) = (ids.as_slice::<i64>()?, attention_mask.as_slice::<i64>()?);
    if let Some(bad) = mask.iter().find(|&&m| m != 0 && m != 1) {
        return Err(Error::invalid_argument(
            "attention_mask",
            format!("holds {bad}; expected 1 on the tokens and 0 on the padding"),
        ));
    }
    let mut out = Vec::with_capacity(2 * ids.len());
    for row in 0..batch {
        out.extend_from_slice(&ids[row * seq..(row + 1) * seq]);
        out.extend_from_slice(&mask[row * seq..(row + 1) * seq]);
    }
    HostTensor::new(out, [batch, 2, seq])
}
