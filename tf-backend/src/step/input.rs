//! What the forward pass reads from its input placeholder: the checks made
//! before a program is first built for a batch, and a `[batch, 2, seq]`
//! input's token ids and attention mask.

use kiln_core::{DType, Error, Result};
use tensorflow::{DataType, Output};

use super::compose::ModelGraph;
use super::key::Signature;
use crate::engine::tf_dtype;
use crate::graph::Builder;
use crate::layers::{Padding, Val};

/// Checks the batch a program is first built for against the model's
/// definition, for errors naming the layer and the expected dtype, before any
/// graph is built for it.
pub(super) fn check_input(model: ModelGraph<'_>, input: &Signature) -> Result<()> {
    let spec = model.spec;
    if model.batch_dims.is_empty() {
        return Err(Error::ShapeMismatch {
            context: "TfModel::forward".to_owned(),
            expected: "a batch: at least one dimension".to_owned(),
            actual: "a scalar".to_owned(),
        });
    }
    spec.output_shape(model.batch_dims)?;
    // A SavedModel layer's input is checked against its signature when imported.
    let Some(expected) = spec.input_dtype() else {
        return Ok(());
    };
    if input.dtype != expected {
        return Err(Error::DTypeMismatch {
            context: "TfModel::forward input".to_owned(),
            expected,
            actual: input.dtype,
        });
    }
    Ok(())
}

/// Whether `model` reads a `[batch, 2, seq]` input as token ids and their
/// attention mask ([`Layer::takes_attention_mask`](kiln_core::model::Layer::takes_attention_mask)).
fn spec_takes_mask(model: ModelGraph<'_>) -> bool {
    model.spec.token_ids_dims(model.batch_dims) != model.batch_dims
}

/// `[batch, 2, seq]` `stacked` (of `dtype`) as its token ids (`[:, 0]`) and
/// their attention mask as float32 (`[:, 1] != 0`), both `[batch, seq]`.
fn split_attention_mask(
    b: &mut Builder,
    stacked: &Output,
    dtype: DType,
) -> Result<(Output, Output)> {
    let dtype = tf_dtype(dtype)?;
    let axis = b.constant(&[1i32], &[])?;
    let part = |b: &mut Builder, i: i32| -> Result<Output> {
        let index = b.constant(&[i], &[])?;
        b.op("GatherV2", &[stacked, &index, &axis], &|nd| {
            nd.set_attr_type("Tparams", dtype)?;
            nd.set_attr_type("Tindices", DataType::Int32)?;
            nd.set_attr_type("Taxis", DataType::Int32)?;
            nd.set_attr_int("batch_dims", 0)?;
            Ok(())
        })
    };
    let ids = part(b, 0)?;
    let mask = part(b, 1)?;
    // `check_input` has made the ids int64.
    let zero = b.constant(&[0i64], &[])?;
    let kept = b.op("NotEqual", &[&mask, &zero], &|nd| {
        nd.set_attr_type("T", dtype)?;
        Ok(())
    })?;
    let mask = b.cast(&kept, DataType::Bool, DataType::Float)?;
    Ok((ids, mask))
}

/// What the layers take from the input `placeholder` of `input`: the value
/// the first layer reads and, for token ids stacked with their attention
/// mask, the mask the attention layers read.
pub(super) fn model_input(
    b: &mut Builder,
    model: ModelGraph<'_>,
    input: &Signature,
    placeholder: &Output,
) -> Result<(Val, Option<Padding>)> {
    Ok(match model.batch_dims {
        [_, 2, seq] if spec_takes_mask(model) => {
            let (ids, padding) = split_attention_mask(b, placeholder, input.dtype)?;
            let seq = *seq as i64;
            (
                Val {
                    out: ids,
                    dims: vec![seq],
                    nhwc: false,
                },
                Some(Padding { mask: padding, seq }),
            )
        }
        _ => (
            Val {
                out: placeholder.clone(),
                dims: input.sample().to_vec(),
                nhwc: false,
            },
            None,
        ),
    })
}

/// The forward pass's input placeholders: one of `input`'s dims, or, for a
/// model reading `[batch, 2, seq]` ids and mask from
/// [two placeholders](ModelGraph::separate_mask), the ids' and the mask's,
/// each `[batch, seq]` int64.
pub(super) fn placeholders(
    b: &mut Builder,
    model: ModelGraph<'_>,
    input: &Signature,
) -> Result<(Output, Option<Output>)> {
    match (model.batch_dims, input.dims.as_slice()) {
        ([_, 2, _], [batch, 2, seq]) if model.separate_mask && spec_takes_mask(model) => {
            let dims = [*batch, *seq];
            let ids = b.placeholder(DataType::Int64, Some(&dims))?;
            let mask = b.placeholder(DataType::Int64, Some(&dims))?;
            Ok((ids, Some(mask)))
        }
        _ => Ok((
            b.placeholder(tf_dtype(input.dtype)?, Some(&input.dims))?,
            None,
        )),
    }
}

/// What the layers take from the ids' and the mask's own placeholders: the
/// ids, and the mask as float32 (`mask != 0`), as [`model_input`] takes them
/// from a stacked placeholder.
pub(super) fn separate_input(
    b: &mut Builder,
    model: ModelGraph<'_>,
    ids: &Output,
    mask: &Output,
) -> Result<(Val, Option<Padding>)> {
    let seq = model.batch_dims.last().copied().unwrap_or(0) as i64;
    let zero = b.constant(&[0i64], &[])?;
    let kept = b.op("NotEqual", &[mask, &zero], &|nd| {
        nd.set_attr_type("T", DataType::Int64)?;
        Ok(())
    })?;
    let mask = b.cast(&kept, DataType::Bool, DataType::Float)?;
    Ok((
        Val {
            out: ids.clone(),
            dims: vec![seq],
            nhwc: false,
        },
        Some(Padding { mask, seq }),
    ))
}
