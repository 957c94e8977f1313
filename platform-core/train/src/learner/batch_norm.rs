//! Recomputing batch norm's running statistics for a model's current weights,
//! as `torch.optim.swa_utils.update_bn` does after stochastic weight averaging.

use kiln_core::backend::{Mode, TrainBackend, Trainable};
use kiln_core::device::Device;
use kiln_core::error::{Error, Result};
use kiln_core::module::RunningStats;
use kiln_core::state_dict::StateDict;
use kiln_core::tensor::HostTensor;
use kiln_data::DataLoader;

/// Recomputes the running mean and variance of every batch-norm layer of
/// `model` as the plain average of their values over the batches of `loader`
/// (epoch `epoch`'s order), in training mode and without gradients, as
/// `torch.optim.swa_utils.update_bn` does with `momentum = None`;
/// `num_batches_tracked` becomes the number of batches. Returns that number
/// (0 for a model without batch norm, which is left as it was).
///
/// Each layer's momentum `m` stays as it is: before each batch the statistics
/// are set to zero, so the pass leaves `m` times the batch's statistics, which
/// are divided by `m` and averaged here. Fails, leaving the model as it was,
/// for a model with running statistics it cannot describe
/// ([`Module::running_stats`](kiln_core::module::Module::running_stats): a
/// TorchScript model's), a layer of momentum 0, or an empty loader.
///
/// ```no_run
/// # use kiln_core::{backend::TrainBackend, Device, Result};
/// # fn f<B: TrainBackend>(model: &mut B::Model, train: &dyn kiln_data::DataLoader) -> Result<()> {
/// // After loading averaged weights into `model`:
/// let batches = kiln_train::update_batch_norm::<B, _>(model, train, 0, Device::Cpu)?;
/// # Ok(()) }
/// ```
pub fn update_batch_norm<B: TrainBackend, M: Trainable<B> + ?Sized>(
    model: &mut M,
    loader: &dyn DataLoader,
    epoch: u64,
    device: Device,
) -> Result<u64> {
    let layers = batch_norm_layers::<B, M>(model)?;
    if layers.is_empty() {
        return Ok(0);
    }
    let before = model.state_dict()?;
    let mode = model.mode();
    model.set_mode(Mode::Train);
    let result = average_statistics::<B, M>(model, loader, epoch, device, &layers, &before);
    model.set_mode(mode);
    match result {
        Ok((after, batches)) => {
            model.load_state_dict(&after)?;
            Ok(batches)
        }
        Err(e) => {
            model.load_state_dict(&before)?;
            Err(e)
        }
    }
}

/// The model's batch-norm layers, checked: every `*.running_mean` buffer
/// belongs to one, and every momentum is positive.
pub(crate) fn batch_norm_layers<B: TrainBackend, M: Trainable<B> + ?Sized>(
    model: &M,
) -> Result<Vec<RunningStats>> {
    let layers = model.running_stats()?;
    for (name, _) in model.named_buffers()? {
        let Some(path) = name.strip_suffix("running_mean") else {
            continue;
        };
        let path = path.strip_suffix('.').unwrap_or(path);
        if !layers.iter().any(|l| l.path == path) {
            return Err(Error::invalid_argument(
                "training.swa.update_bn",
                format!(
                    "the model's `{name}` is a batch-norm statistic Kiln cannot recompute (a \
                     TorchScript or SavedModel layer's): set update_bn = false to keep the \
                     training weights' statistics"
                ),
            ));
        }
    }
    if let Some(layer) = layers
        .iter()
        .find(|l| l.momentum.is_nan() || l.momentum <= 0.0)
    {
        return Err(Error::invalid_argument(
            "training.swa.update_bn",
            format!(
                "the batch norm `{}` has momentum {}: its statistics never move, so they \
                 cannot be recomputed",
                layer.path, layer.momentum
            ),
        ));
    }
    Ok(layers)
}

/// The state with the averaged statistics, and the batches run.
fn average_statistics<B: TrainBackend, M: Trainable<B> + ?Sized>(
    model: &mut M,
    loader: &dyn DataLoader,
    epoch: u64,
    device: Device,
    layers: &[RunningStats],
    before: &StateDict,
) -> Result<(StateDict, u64)> {
    let stats = ["running_mean", "running_var"];
    let mut zeroed = before.clone();
    let mut sums: Vec<Vec<f64>> = Vec::new();
    for layer in layers {
        for stat in stats {
            let name = layer.buffer(stat);
            let current = before.get(&name).ok_or_else(|| Error::MissingKey {
                key: name.clone(),
                available: before.len(),
            })?;
            let zeros = HostTensor::new(vec![0.0; current.numel()], current.dims().to_vec())?;
            sums.push(vec![0.0; current.numel()]);
            zeroed.insert(name, zeros.to_dtype(current.dtype()));
        }
    }
    let mut batches = 0u64;
    for batch in loader.batches(epoch) {
        let batch = batch?;
        model.load_state_dict(&zeroed)?;
        let inputs = B::from_host(&batch.inputs, device)?;
        // The forward pass without gradients (its small output is dropped).
        drop(model.predict_step(&inputs)?);
        let buffers = model.named_buffers()?;
        let mut sum = sums.iter_mut();
        for layer in layers {
            for stat in stats {
                let name = layer.buffer(stat);
                let (_, tensor) =
                    buffers
                        .iter()
                        .find(|(n, _)| *n == name)
                        .ok_or_else(|| Error::MissingKey {
                            key: name.clone(),
                            available: buffers.len(),
                        })?;
                let values = B::to_host(tensor)?.to_f64_vec();
                if let Some(sum) = sum.next() {
                    for (s, v) in sum.iter_mut().zip(values) {
                        *s += v / layer.momentum;
                    }
                }
            }
        }
        batches += 1;
    }
    if batches == 0 {
        return Err(Error::invalid_argument(
            "training.swa.update_bn",
            "the training data has no batch to recompute batch-norm statistics on",
        ));
    }
    let mut after = before.clone();
    let mut sum = sums.into_iter();
    for layer in layers {
        for stat in stats {
            let name = layer.buffer(stat);
            let Some((sum, current)) = sum.next().zip(before.get(&name)) else {
                continue;
            };
            let mean: Vec<f64> = sum.iter().map(|s| s / batches as f64).collect();
            let averaged = HostTensor::new(mean, current.dims().to_vec())?;
            after.insert(name, averaged.to_dtype(current.dtype()));
        }
        let count = layer.buffer("num_batches_tracked");
        if let Some(current) = before.get(&count) {
            let tracked = HostTensor::new(vec![batches as f64], current.dims().to_vec())?;
            after.insert(count, tracked.to_dtype(current.dtype()));
        }
    }
    Ok((after, batches))
}
