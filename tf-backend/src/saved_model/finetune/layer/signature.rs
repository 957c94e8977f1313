//! A `saved_model` layer's signature: opening the layer's SavedModel, picking the
//! signature's input and output, checking the shape reaching the layer against
//! it, and [`resolve_saved_model_shapes`], which fills in each layer's output shape.

use kiln_core::{
    model::{Layer, SavedModelLayerConfig},
    DType, Error, HostTensor, Result,
};

use crate::saved_model::load::{SavedModel, SignatureInfo, TensorSpec};

/// `(root)` for the root layer's empty path.
pub(super) fn shown(path: &str) -> &str {
    if path.is_empty() {
        "(root)"
    } else {
        path
    }
}

/// The signature's tensor the layer uses: `chosen` by name, or the only one.
/// `field` is `input` or `output`.
fn pick<'a>(
    specs: &'a [TensorSpec],
    chosen: Option<&str>,
    field: &str,
    info: &SignatureInfo,
    at: &str,
) -> Result<&'a TensorSpec> {
    let names = || {
        specs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match (chosen, specs) {
        (Some(name), _) => specs.iter().find(|s| s.name == name).ok_or_else(|| {
            Error::invalid_argument(
                format!("{}.{field}", shown(at)),
                format!(
                    "signature `{}` has no {field} `{name}`; its {field}s: {}",
                    info.name,
                    names()
                ),
            )
        }),
        (None, [only]) => Ok(only),
        (None, _) => Err(Error::invalid_argument(
            format!("{}.{field}", shown(at)),
            format!(
                "signature `{}` has {} {field}s ({}); name the one to use as `{field}`",
                info.name,
                specs.len(),
                names()
            ),
        )),
    }
}

/// The per-example dims of `spec`'s shape when every one is known and the
/// first dimension is a batch.
pub(super) fn known_example_dims(spec: &TensorSpec) -> Option<Vec<usize>> {
    let shape = spec.shape.as_ref()?;
    let (_batch, rest) = shape.split_first()?;
    rest.iter().copied().collect()
}

/// Checks an example shape (batch excluded) and dtype against the signature input.
pub(super) fn check_input(
    at: &str,
    config: &SavedModelLayerConfig,
    input: &TensorSpec,
    example: &[usize],
    dtype: Option<DType>,
) -> Result<()> {
    let context = || {
        format!(
            "{} (SavedModel {}, signature `{}`): input `{}`",
            shown(at),
            config.path.display(),
            config.signature,
            input.name
        )
    };
    let mut dims = vec![1];
    dims.extend_from_slice(example);
    let batch_free = input
        .shape
        .as_ref()
        .is_none_or(|s| s.first().is_some_and(Option::is_none));
    if !batch_free || !input.accepts(&dims) {
        return Err(Error::ShapeMismatch {
            context: context(),
            expected: format!("{} (batch first, of any size)", input.shape_string()),
            actual: format!(
                "[batch, {}]",
                example
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    if let (Some(actual), Some(expected)) = (dtype, input.dtype.kiln()) {
        if actual != expected {
            return Err(Error::DTypeMismatch {
                context: context(),
                expected,
                actual,
            });
        }
    }
    Ok(())
}

/// Loads the SavedModel of `config` and picks its signature's input and output.
pub(super) fn open(
    at: &str,
    config: &SavedModelLayerConfig,
) -> Result<(SavedModel, TensorSpec, TensorSpec)> {
    let model = SavedModel::load(&config.path)?;
    let info = model.signature(&config.signature)?;
    let input = pick(&info.inputs, config.input.as_deref(), "input", info, at)?.clone();
    let output = pick(&info.outputs, config.output.as_deref(), "output", info, at)?.clone();
    if info.inputs.len() > 1 {
        return Err(Error::unsupported(format!(
            "the saved_model layer `{}`: signature `{}` of {} takes {} inputs ({}); a layer \
             feeds one tensor, so export a signature of one input",
            shown(at),
            info.name,
            config.path.display(),
            info.inputs.len(),
            info.inputs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    if input.dtype.kiln().is_none() {
        return Err(Error::unsupported(format!(
            "the saved_model layer `{}`: input `{}` of signature `{}` has dtype {}, which \
             Kiln cannot feed",
            shown(at),
            input.name,
            info.name,
            input.dtype
        )));
    }
    if output.dtype.kiln() != Some(DType::F32) {
        return Err(Error::unsupported(format!(
            "the saved_model layer `{}`: output `{}` of signature `{}` has dtype {}; layers \
             pass float32 activations on",
            shown(at),
            output.name,
            info.name,
            output.dtype
        )));
    }
    Ok((model, input, output))
}
/// `spec` with the output shape of each of its [`Layer::SavedModel`] layers
/// filled in (where not given): read from the signature's output spec, or, when
/// that leaves a dimension unknown, found by running the signature once on zeros
/// of one example. `example_shape` is the shape of one example of the model's
/// input (without the batch dimension) and `dtype` its dtype; the shape reaching
/// a `saved_model` layer comes from the layers before it, and is checked against
/// the signature's input ([`Error::ShapeMismatch`], [`Error::DTypeMismatch`]).
/// A model without `saved_model` layers comes back unchanged.
///
/// ```no_run
/// use kiln_core::model::{Layer, LinearConfig, SavedModelLayerConfig};
/// use kiln_core::DType;
///
/// let spec = Layer::sequential([
///     SavedModelLayerConfig::new("exported/mlp").with_signature("features").into(),
///     LinearConfig::new(16, 2).into(),
/// ]);
/// let resolved = kiln_tf::resolve_saved_model_shapes(&spec, &[8], DType::F32)?;
/// assert_eq!(resolved.output_shape(&[32, 8])?, vec![32, 2]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn resolve_saved_model_shapes(
    spec: &Layer,
    example_shape: &[usize],
    dtype: DType,
) -> Result<Layer> {
    let mut resolved = spec.clone();
    if resolved.saved_model_layers().is_empty() {
        return Ok(resolved);
    }
    resolved.validate()?;
    let mut input = vec![1];
    input.extend_from_slice(example_shape);
    resolved.resolve_shapes(
        &input,
        dtype,
        &mut |path, layer, input, dtype| match layer {
            Layer::SavedModel(config) if config.output_shape.is_none() => {
                config.output_shape = Some(output_dims(path, config, input, dtype)?);
                Ok(())
            }
            _ => Ok(()),
        },
    )?;
    Ok(resolved)
}

/// The output shape of one example (batch dimension excluded) of the
/// signature of `config` on `input`: from the signature when it states it,
/// else by running it once on zeros.
fn output_dims(
    path: &str,
    config: &SavedModelLayerConfig,
    input: &[usize],
    dtype: DType,
) -> Result<Vec<usize>> {
    let example = input.get(1..).unwrap_or_default().to_vec();
    let (model, spec_in, spec_out) = open(path, config)?;
    check_input(path, config, &spec_in, &example, Some(dtype))?;
    let dims = match known_example_dims(&spec_out) {
        Some(dims) => dims,
        None => {
            let mut dims = vec![1];
            dims.extend_from_slice(&example);
            let n = dims.iter().product();
            let zeros = HostTensor::new(vec![0f64; n], dims)?.to_dtype(dtype);
            let outputs = model.run(&config.signature, &[(spec_in.name.as_str(), &zeros)])?;
            let out = outputs.get(&spec_out.name).ok_or_else(|| {
                Error::backend(
                    "tensorflow",
                    format!("running signature `{}` once", config.signature),
                    format!("output `{}` was not fetched", spec_out.name),
                )
            })?;
            out.dims().get(1..).unwrap_or_default().to_vec()
        }
    };
    log::debug!(
        "saved_model layer `{}`: output shape [batch, {dims:?}]",
        shown(path)
    );
    Ok(dims)
}
