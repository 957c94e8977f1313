//! `Embedding`: a lookup table from integer indices to vectors.

use serde::{Deserialize, Serialize};

use super::builder::config_builder;
use super::{FieldCheck, LayerSpec, Params, ShapeCheck};
use crate::dtype::DType;
use crate::error::Result;
use crate::model::init::{Init, InitDistribution};
use crate::model::ParamKind;

/// `nn.Embedding`: a lookup table from indices to vectors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingConfig {
    /// Number of rows (the vocabulary size).
    pub num_embeddings: usize,
    /// Size of each vector.
    pub embedding_dim: usize,
    /// A row that is initialised to zero and receives no gradient.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding_idx: Option<usize>,
    /// Initialiser of `weight`; `None` is PyTorch's default, `N(0, 1)`.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// A factor of every looked-up vector, rounded to the weight's dtype first
    /// (Gemma's `sqrt(hidden_size)`); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f64>,
}

config_builder! {
    EmbeddingConfig {
        /// An embedding table without padding row and with `N(0, 1)` initialisation.
        new(num_embeddings: usize, embedding_dim: usize) {
            num_embeddings,
            embedding_dim,
            padding_idx: None,
            weight_init: None,
            scale: None,
        }
        /// Sets the padding row.
        with_padding_idx(padding_idx: Some(usize));
        /// Sets the initialiser of `weight` (the padding row is still zeroed).
        with_weight_init(weight_init: Some(Init));
        /// Multiplies every looked-up vector by `scale` (Gemma's embedding scaling).
        with_scale(scale: Some(f64));
    }
}

impl LayerSpec for EmbeddingConfig {
    fn validate(&self, check: &FieldCheck<'_>) -> Result<()> {
        let c = self;
        check.positive("num_embeddings", c.num_embeddings)?;
        check.positive("embedding_dim", c.embedding_dim)?;
        if let Some(scale) = c.scale {
            if !(scale.is_finite() && scale > 0.0) {
                return Err(
                    check.invalid("scale", format!("must be finite and above 0, got {scale}"))
                );
            }
        }
        match c.padding_idx {
            Some(idx) if idx >= c.num_embeddings => Err(check.invalid(
                "padding_idx",
                format!(
                    "must be below num_embeddings ({}), got {idx}",
                    c.num_embeddings
                ),
            )),
            _ => Ok(()),
        }
    }

    fn output_shape(&self, input: &[usize], _at: &ShapeCheck<'_>) -> Result<Vec<usize>> {
        let mut out = input.to_vec();
        out.push(self.embedding_dim);
        Ok(out)
    }

    fn param_specs(&self, params: &mut Params<'_>) -> Result<()> {
        let c = self;
        let shape = vec![c.num_embeddings, c.embedding_dim];
        let init = match &c.weight_init {
            Some(init) => params.resolve("weight_init", init, &shape)?,
            None => InitDistribution::Normal {
                mean: 0.0,
                std: 1.0,
            },
        };
        params.push("weight", shape, DType::F32, ParamKind::Parameter, init);
        if let Some(last) = params.out.last_mut() {
            last.zero_row = c.padding_idx;
        }
        Ok(())
    }
}
