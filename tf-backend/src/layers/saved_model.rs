//! `SavedModel` layers as an imported copy of the SavedModel's graph (see
//! `crate::saved_model::SavedModelLayers`).

use kiln_core::{model::Layer, Error, Result};

use super::{Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let Layer::SavedModel(config) = layer else {
        return Ok(Built::Pass(x));
    };
    let dims = config
        .output_shape
        .as_ref()
        .ok_or_else(|| {
            Error::unsupported(format!(
                "the saved_model layer `{}` ({}): its output shape is unknown; fill it in \
                 with kiln_tf::resolve_saved_model_shapes",
                if prefix.is_empty() { "(root)" } else { prefix },
                config.path.display()
            ))
        })?
        .iter()
        .map(|&d| d as i64)
        .collect();
    // The signature gets the tensor as the model's data has it (logical layout).
    let x = ctx.nchw(x)?;
    let out = ctx
        .saved_models
        .import(ctx.b, prefix, config, &x.out, &x.dims)?;
    Ok(Built::Out(Val {
        out,
        dims,
        nhwc: false,
    }))
}
