//! Running a loaded SavedModel's signatures: [`SavedModel::run`] and
//! [`SavedModel::train_step`], with every input checked against the signature first.

use std::collections::{BTreeMap, BTreeSet};

use kiln_core::{DType, Error, HostTensor, Result};
use tensorflow::SessionRunArgs;

use super::{Port, SavedModel, Signature, LOSS_OUTPUT};
use crate::convert::{from_tf, TfTensor};
use crate::error::tf_error;

impl SavedModel {
    /// Runs `signature` on `inputs` (name, tensor) and returns every output by name.
    ///
    /// Everything is checked before TensorFlow runs, so a rejected call changes no
    /// variable: an unknown signature or input name, a missing input
    /// ([`Error::InvalidArgument`], naming the expected ones), a wrong dtype
    /// ([`Error::DTypeMismatch`]), a wrong rank or fixed dimension
    /// ([`Error::ShapeMismatch`], with `?` for dimensions of any size), and inputs
    /// or outputs of a dtype Kiln has no host type for ([`Error::Unsupported`]).
    pub fn run(
        &self,
        signature: &str,
        inputs: &[(&str, &HostTensor)],
    ) -> Result<BTreeMap<String, HostTensor>> {
        let signature = self.lookup(signature)?;
        let feeds = check_inputs(signature, inputs)?;
        let outputs = fetchable_outputs(signature)?;

        let mut args = SessionRunArgs::new();
        for (port, tensor) in signature.inputs.iter().zip(&feeds) {
            add_feed(&mut args, port, tensor);
        }
        let tokens: Vec<_> = signature
            .outputs
            .iter()
            .map(|port| args.request_fetch(&port.operation, port.index))
            .collect();
        crate::profile::run_traced(
            &self.session,
            &mut args,
            &format!(
                "running signature `{}` of the SavedModel {}",
                signature.info.name,
                self.dir.display()
            ),
        )?;

        let mut results = BTreeMap::new();
        for ((spec, dtype), token) in signature.info.outputs.iter().zip(outputs).zip(tokens) {
            let context = format!(
                "fetching output `{}` of signature `{}`",
                spec.name, signature.info.name
            );
            let host = match dtype {
                DType::U8 => args.fetch::<u8>(token).map(|t| from_tf(&t)),
                DType::I32 => args.fetch::<i32>(token).map(|t| from_tf(&t)),
                DType::I64 => args.fetch::<i64>(token).map(|t| from_tf(&t)),
                DType::F32 => args.fetch::<f32>(token).map(|t| from_tf(&t)),
                DType::F64 => args.fetch::<f64>(token).map(|t| from_tf(&t)),
                other => Ok(Err(Error::unsupported(format!(
                    "{context}: {other} tensors"
                )))),
            }
            .map_err(|status| tf_error(&context, status))??;
            results.insert(spec.name.clone(), host);
        }
        Ok(results)
    }

    /// Runs one step of a training signature and returns its loss: the output named
    /// `loss`, or the only output when there is just one. The loss must be a single
    /// number; it is returned as is, NaN included.
    ///
    /// The signature is expected to apply the optimizer itself (see the
    /// [type documentation](SavedModel#fine-tuning) for the Python side): this is
    /// [`run`](Self::run) plus picking out the loss.
    pub fn train_step(&self, signature: &str, inputs: &[(&str, &HostTensor)]) -> Result<f64> {
        let info = &self.lookup(signature)?.info;
        let loss = match info.output(LOSS_OUTPUT) {
            Some(spec) => spec,
            None => match info.outputs.as_slice() {
                [only] => only,
                _ => {
                    return Err(Error::invalid_argument(
                        "signature",
                        format!(
                            "training signature `{signature}` has no output `{LOSS_OUTPUT}` \
                             and {} outputs ({}); return {{\"{LOSS_OUTPUT}\": loss}} from it",
                            info.outputs.len(),
                            info.output_names()
                        ),
                    ))
                }
            },
        };
        if let Some(dims) = &loss.shape {
            if dims.iter().any(|d| *d != Some(1)) {
                return Err(loss_not_scalar(signature, &loss.name, &loss.shape_string()));
            }
        }
        let name = loss.name.clone();
        let outputs = self.run(signature, inputs)?;
        let value = outputs.get(&name).ok_or_else(|| {
            Error::backend(
                "tensorflow",
                format!("running training signature `{signature}`"),
                format!("output `{name}` was not fetched"),
            )
        })?;
        match value.to_f64_vec().as_slice() {
            [loss] => Ok(*loss),
            _ => Err(loss_not_scalar(
                signature,
                &name,
                &value.shape().to_string(),
            )),
        }
    }
}

/// Checks `inputs` against the signature and converts them, in the signature's order.
fn check_inputs(signature: &Signature, inputs: &[(&str, &HostTensor)]) -> Result<Vec<TfTensor>> {
    let info = &signature.info;
    let expected = || {
        info.inputs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut given: BTreeMap<&str, &HostTensor> = BTreeMap::new();
    for (name, tensor) in inputs {
        if info.input(name).is_none() {
            return Err(Error::invalid_argument(
                "inputs",
                format!(
                    "signature `{}` has no input `{name}`; expected inputs: {}",
                    info.name,
                    expected()
                ),
            ));
        }
        if given.insert(name, tensor).is_some() {
            return Err(Error::invalid_argument(
                "inputs",
                format!("input `{name}` of signature `{}` is given twice", info.name),
            ));
        }
    }
    let missing: BTreeSet<&str> = info
        .inputs
        .iter()
        .map(|spec| spec.name.as_str())
        .filter(|name| !given.contains_key(name))
        .collect();
    if !missing.is_empty() {
        return Err(Error::invalid_argument(
            "inputs",
            format!(
                "signature `{}` needs input{} `{}`, not given; expected inputs: {}",
                info.name,
                if missing.len() == 1 { "" } else { "s" },
                missing.into_iter().collect::<Vec<_>>().join("`, `"),
                expected()
            ),
        ));
    }

    let mut feeds = Vec::with_capacity(info.inputs.len());
    for spec in &info.inputs {
        let Some(tensor) = given.get(spec.name.as_str()) else {
            continue; // unreachable: every input was checked present above
        };
        let context = format!("signature `{}` input `{}`", info.name, spec.name);
        match spec.dtype.kiln() {
            Some(dtype) if dtype == tensor.dtype() => {}
            Some(dtype) => {
                return Err(Error::DTypeMismatch {
                    context,
                    expected: dtype,
                    actual: tensor.dtype(),
                })
            }
            None => {
                return Err(Error::unsupported(format!(
                    "{context} has dtype {}, which Kiln cannot feed (Kiln tensors are u8, i32, \
                     i64, f32 or f64)",
                    spec.dtype
                )))
            }
        }
        if !spec.accepts(tensor.dims()) {
            return Err(Error::ShapeMismatch {
                context,
                expected: spec.shape_string(),
                actual: tensor.shape().to_string(),
            });
        }
        feeds.push(TfTensor::from_host(tensor)?);
    }
    Ok(feeds)
}

/// The Kiln dtype of every output, or `Unsupported` for one Kiln cannot hold.
fn fetchable_outputs(signature: &Signature) -> Result<Vec<DType>> {
    signature
        .info
        .outputs
        .iter()
        .map(|spec| {
            spec.dtype.kiln().ok_or_else(|| {
                Error::unsupported(format!(
                    "signature `{}` output `{}` has dtype {}, which Kiln cannot fetch",
                    signature.info.name, spec.name, spec.dtype
                ))
            })
        })
        .collect()
}

fn add_feed<'a>(args: &mut SessionRunArgs<'a>, port: &Port, tensor: &'a TfTensor) {
    let (operation, index) = (&port.operation, port.index);
    match tensor {
        TfTensor::U8(t) => args.add_feed(operation, index, t),
        TfTensor::I32(t) => args.add_feed(operation, index, t),
        TfTensor::I64(t) => args.add_feed(operation, index, t),
        TfTensor::F32(t) => args.add_feed(operation, index, t),
        TfTensor::F64(t) => args.add_feed(operation, index, t),
    }
}

/// The error for a loss that is not a single number.
pub(crate) fn loss_not_scalar(signature: &str, output: &str, shape: &str) -> Error {
    Error::ShapeMismatch {
        context: format!("the loss `{output}` of training signature `{signature}`"),
        expected: "a single number ([] or [1])".to_owned(),
        actual: shape.to_owned(),
    }
}
