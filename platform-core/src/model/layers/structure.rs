//! Structure: `Flatten`, and the containers `Sequential`, `Residual` and
//! `Parallel`, with the constructors that compose layers.

use super::context::{context, dims, join};
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::error::{Error, Result};
use crate::model::{AttentionConfig, GeluApproximation, Layer, LayerNormConfig, LinearConfig};

/// Normalises a possibly negative dimension index for a tensor of `rank` dimensions.
pub(super) fn normalize_dim(dim: isize, rank: usize) -> Option<usize> {
    if dim < 0 {
        rank.checked_sub(dim.unsigned_abs())
    } else {
        Some(dim.unsigned_abs()).filter(|&d| d < rank)
    }
}

impl Layer {
    /// A [`Layer::Sequential`] of `layers`.
    pub fn sequential(layers: impl IntoIterator<Item = Layer>) -> Self {
        Layer::Sequential {
            layers: layers.into_iter().collect(),
        }
    }

    /// A [`Layer::Residual`] around `block`.
    pub fn residual(block: Layer) -> Self {
        Layer::Residual {
            block: Box::new(block),
        }
    }

    /// A [`Layer::Parallel`] of `branches`, their outputs summed.
    ///
    /// ```
    /// use kiln_core::model::{Layer, LayerNormConfig, LinearConfig};
    ///
    /// // GPT-NeoX's parallel residual: x + attn(ln1(x)) + mlp(ln2(x)).
    /// let block = Layer::residual(Layer::parallel([
    ///     Layer::sequential([LayerNormConfig::new([8]).into(), LinearConfig::new(8, 8).into()]),
    ///     Layer::sequential([LayerNormConfig::new([8]).into(), LinearConfig::new(8, 8).into()]),
    /// ]));
    /// assert_eq!(block.output_shape(&[2, 5, 8])?, vec![2, 5, 8]);
    /// assert_eq!(block.parameter_specs("")?[4].name, "block.1.0.weight");
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn parallel(branches: impl IntoIterator<Item = Layer>) -> Self {
        Layer::Parallel {
            branches: branches.into_iter().collect(),
        }
    }

    /// A pre-norm transformer encoder block on `[batch, seq, embed_dim]`:
    ///
    /// ```text
    /// Sequential[
    ///   Residual(Sequential[LayerNorm(E), MultiHeadSelfAttention(E, heads, causal, dropout)]),
    ///   Residual(Sequential[LayerNorm(E), Linear(E, F), Gelu, Linear(F, E), Dropout(dropout)]),
    /// ]
    /// ```
    ///
    /// ```
    /// use kiln_core::model::Layer;
    ///
    /// let block = Layer::transformer_encoder_block(64, 4, 256, true, 0.1);
    /// assert_eq!(block.output_shape(&[2, 10, 64])?, vec![2, 10, 64]);
    /// let specs = block.parameter_specs("encoder.0")?;
    /// assert_eq!(specs[2].name, "encoder.0.0.block.1.in_proj_weight");
    /// assert_eq!(specs[2].shape, vec![192, 64]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn transformer_encoder_block(
        embed_dim: usize,
        num_heads: usize,
        ff_dim: usize,
        causal: bool,
        dropout: f64,
    ) -> Self {
        Layer::sequential([
            Layer::residual(Layer::sequential([
                Layer::LayerNorm(LayerNormConfig::new([embed_dim])),
                Layer::MultiHeadSelfAttention(
                    AttentionConfig::new(embed_dim, num_heads)
                        .with_causal(causal)
                        .with_dropout(dropout),
                ),
            ])),
            Layer::residual(Layer::sequential([
                Layer::LayerNorm(LayerNormConfig::new([embed_dim])),
                Layer::Linear(LinearConfig::new(embed_dim, ff_dim)),
                Layer::Gelu {
                    approximate: GeluApproximation::None,
                },
                Layer::Linear(LinearConfig::new(ff_dim, embed_dim)),
                Layer::Dropout { p: dropout },
            ])),
        ])
    }
}

/// [`Layer::Flatten`]'s dimensions.
pub(crate) struct Flatten {
    pub(crate) start_dim: isize,
    pub(crate) end_dim: isize,
}

impl LayerSpec for Flatten {
    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let Flatten { start_dim, end_dim } = self;
        // torch.flatten treats a scalar as a 1-d tensor of one element.
        let rank = input.len().max(1);
        let padded: Vec<usize> = if input.is_empty() {
            vec![1]
        } else {
            input.to_vec()
        };
        let (start, end) = match (
            normalize_dim(*start_dim, rank),
            normalize_dim(*end_dim, rank),
        ) {
            (Some(s), Some(e)) if s <= e => (s, e),
            _ => {
                return Err(at.mismatch(format!(
                    "a tensor where start_dim {start_dim} is a dimension at or before end_dim {end_dim}"
                )))
            }
        };
        let merged = padded[start..=end]
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| at.mismatch("dimensions whose product fits in usize".to_owned()))?;
        let mut out = padded[..start].to_vec();
        out.push(merged);
        out.extend_from_slice(&padded[end + 1..]);
        Ok(out)
    }
}

/// [`Layer::Select`]'s dimension and index.
pub(crate) struct Select {
    pub(crate) dim: isize,
    pub(crate) index: isize,
}

impl LayerSpec for Select {
    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let Select { dim, index } = *self;
        let wanted = || {
            format!("a tensor with a dimension {dim} (not the batch's) that has a position {index}")
        };
        let d = match normalize_dim(dim, input.len()) {
            Some(d) if d > 0 => d,
            _ => return Err(at.mismatch(wanted())),
        };
        let size = input[d] as isize;
        if !(-size..size).contains(&index) {
            return Err(at.mismatch(wanted()));
        }
        let mut out = input.to_vec();
        out.remove(d);
        Ok(out)
    }
}

/// [`Layer::Transpose`]'s dimensions.
pub(crate) struct Transpose {
    pub(crate) dim0: isize,
    pub(crate) dim1: isize,
}

impl LayerSpec for Transpose {
    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let Transpose { dim0, dim1 } = *self;
        match (
            normalize_dim(dim0, input.len()),
            normalize_dim(dim1, input.len()),
        ) {
            (Some(a), Some(b)) if a > 0 && b > 0 => {
                let mut out = input.to_vec();
                out.swap(a, b);
                Ok(out)
            }
            _ => Err(at.mismatch(format!(
                "a tensor with dimensions {dim0} and {dim1}, neither the batch's"
            ))),
        }
    }
}

/// [`Layer::Sequential`]'s layers: children named `"0"`, `"1"`, ...
pub(crate) struct Sequential<'a>(pub(crate) &'a [Layer]);

impl LayerSpec for Sequential<'_> {
    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let mut shape = input.to_vec();
        for (i, layer) in self.0.iter().enumerate() {
            shape = layer.infer(&join(at.path, &i.to_string()), &shape)?;
        }
        Ok(shape)
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        for (i, layer) in self.0.iter().enumerate() {
            layer.collect_specs(&join(params.path, &i.to_string()), params.out)?;
        }
        Ok(())
    }
}

/// [`Layer::Residual`]'s block: the child named `"block"`.
pub(crate) struct Residual<'a>(pub(crate) &'a Layer);

impl LayerSpec for Residual<'_> {
    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let out = self.0.infer(&join(at.path, "block"), input)?;
        if out != input {
            return Err(Error::ShapeMismatch {
                context: format!(
                    "{}: block output, added to the input",
                    context(at.path, at.kind)
                ),
                expected: dims(input),
                actual: dims(&out),
            });
        }
        Ok(out)
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        self.0
            .collect_specs(&join(params.path, "block"), params.out)
    }
}

/// [`Layer::Parallel`]'s branches: children named `"0"`, `"1"`, ...
pub(crate) struct Parallel<'a>(pub(crate) &'a [Layer]);

impl LayerSpec for Parallel<'_> {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        if self.0.is_empty() {
            return Err(check.invalid(
                "branches",
                "has no branch; a parallel container sums the outputs of at least one",
            ));
        }
        Ok(())
    }

    fn output_shape(&self, input: &[usize], at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let mut shape: Option<Vec<usize>> = None;
        for (i, layer) in self.0.iter().enumerate() {
            let out = layer.infer(&join(at.path, &i.to_string()), input)?;
            match &shape {
                Some(first) if *first != out => {
                    return Err(Error::ShapeMismatch {
                        context: format!(
                            "{}: branch {i}'s output, added to branch 0's",
                            context(at.path, at.kind)
                        ),
                        expected: dims(first),
                        actual: dims(&out),
                    })
                }
                Some(_) => {}
                None => shape = Some(out),
            }
        }
        shape.ok_or_else(|| at.mismatch("a parallel container with at least one branch".into()))
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        for (i, layer) in self.0.iter().enumerate() {
            layer.collect_specs(&join(params.path, &i.to_string()), params.out)?;
        }
        Ok(())
    }
}
