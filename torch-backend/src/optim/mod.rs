//! Optimizers on libtorch tensors, with PyTorch's update rules (`torch.optim`,
//! single-tensor form), parameter groups and state that saves and restores.

mod adagrad;
mod adam;
mod clip;
mod fused;
mod optimizer;
mod rmsprop;
mod scaler;
mod sgd;

use std::collections::BTreeMap;

use kiln_core::{
    optim::{
        load_group_hypers, optimizer_state_key, read_optimizer_state, resolve_groups,
        save_group_hypers, set_group_learning_rates, GroupHyper, Optimizer, OptimizerConfig,
        ParamGroup,
    },
    state_dict::StateDict,
    state_tensors::{StateTensor, StateTensors},
    DType, Error, HostTensor, Result,
};
use tch::{Kind, Tensor};

use crate::backend::TorchBackend;
use crate::convert::{dtype_from_kind, to_tch};
use crate::device::device_from_tch;
use crate::error::torch_error;
use fused::{fused_adam_step, FusedAdamBatch, FusedAdamHypers};
use scaler::GradScaler;

/// State-dict keys of the loss scale (`16-mixed`), beside the optimizer's own.
const SCALE_KEY: &str = "grad_scaler.scale";
const GROWTH_TRACKER_KEY: &str = "grad_scaler.growth_tracker";

pub use clip::{clip_grad_norm, clip_grad_norm_on_device, clip_grad_norm_with, clip_grad_value};

/// One parameter the optimizer updates, with its per-parameter state.
#[derive(Debug)]
pub(crate) struct ParamSlot {
    pub(crate) name: String,
    pub(crate) tensor: Tensor,
    pub(crate) group: usize,
    /// Number of steps taken for this parameter (PyTorch's `state["step"]`).
    pub(crate) step: u64,
    /// Named state tensors (`exp_avg`, `exp_avg_sq`, `momentum_buffer`, ...),
    /// created lazily on the first step, as PyTorch does.
    pub(crate) state: BTreeMap<&'static str, Tensor>,
    /// In capturable mode, the step count and learning rate on the parameter's device.
    pub(crate) on_device: Option<DeviceScalars>,
}

/// What a step reads from the host, kept on the parameter's device instead, so that
/// a step captured in a CUDA graph still counts steps and follows learning-rate
/// changes when it is replayed (PyTorch's `capturable=True`). Both are 0-dim
/// float32, as PyTorch's capturable and fused optimizers keep them.
#[derive(Debug)]
pub(crate) struct DeviceScalars {
    /// The step count; each step adds one on the device.
    pub(crate) step: Tensor,
    /// The parameter group's learning rate, rewritten by `set_learning_rate`.
    pub(crate) lr: Tensor,
}

impl ParamSlot {
    /// The step count: the device's in capturable mode (replays of a captured step
    /// advance only that one), else the host's.
    fn step_count(&self) -> Result<u64> {
        match &self.on_device {
            None => Ok(self.step),
            Some(scalars) => {
                let step = scalars.step.f_double_value(&[]).map_err(|e| {
                    torch_error(&format!("reading the step count of {}", self.name), e)
                })?;
                Ok(step as u64)
            }
        }
    }
}

/// An optimizer over named libtorch parameters.
///
/// ```no_run
/// use kiln_core::optim::{AdamConfig, Optimizer, OptimizerConfig};
/// use kiln_torch::TorchOptimizer;
///
/// let w = tch::Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let mut opt = TorchOptimizer::new(
///     OptimizerConfig::Adam(AdamConfig::new(1e-3)),
///     vec![("w".to_owned(), w.shallow_clone())],
///     &[],
/// )?;
/// let loss = (&w - 1.0).square().sum(tch::Kind::Float);
/// loss.backward();
/// opt.step()?;
/// opt.zero_grad()?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug)]
pub struct TorchOptimizer {
    config: OptimizerConfig,
    groups: Vec<GroupHyper>,
    params: Vec<ParamSlot>,
    /// libtorch's own optimizer over the same parameters, used only for its
    /// `zero_grad`, which sets gradients to none (PyTorch's default since 2.0):
    /// tch has no other way to drop a gradient, and zeroing it instead costs a
    /// pass over every parameter plus an accumulating add in the next backward.
    grad_reset: tch::COptimizer,
    /// Dynamic loss scaling (`16-mixed`), if on.
    scaler: Option<GradScaler>,
    /// This step's inf/NaN flag, once [`unscale_gradients`](Self::unscale_gradients) ran.
    found_inf: Option<Tensor>,
    /// Capturable mode: the learning rate too is read from the device.
    lr_on_device: bool,
}

impl TorchOptimizer {
    /// An optimizer for `params` (as returned by `Module::named_parameters`).
    ///
    /// `groups` assign parameters to groups with their own learning rate and weight
    /// decay; parameters no group selects form a last, default group with the
    /// config's values. A parameter that does not require grad is an error naming it.
    pub fn new(
        config: OptimizerConfig,
        params: Vec<(String, Tensor)>,
        groups: &[ParamGroup],
    ) -> Result<Self> {
        Self::new_shard(config, params, groups, |_| true)
    }

    /// An optimizer that updates, and keeps state for, only the parameters of
    /// `params` that `keep` takes (a rank's shard under ZeRO), with `groups`
    /// resolved over all of `params`: every shard has the same groups, in the
    /// same order, with the same hyperparameters.
    pub fn new_shard(
        config: OptimizerConfig,
        params: Vec<(String, Tensor)>,
        groups: &[ParamGroup],
        keep: impl Fn(&str) -> bool,
    ) -> Result<Self> {
        config.validate()?;
        let names: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
        let (hypers, assignment) = resolve_groups(&config, &names, groups)?;
        let mut slots = Vec::with_capacity(params.len());
        let mut grad_reset = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)
            .map_err(|e| torch_error("creating the gradient reset", e))?;
        for ((name, tensor), group) in params.into_iter().zip(assignment) {
            if !tensor.requires_grad() {
                return Err(Error::invalid_argument(
                    name,
                    "parameter does not require grad; freeze it by leaving it out of the optimizer",
                ));
            }
            if !keep(&name) {
                continue;
            }
            grad_reset
                .add_parameters(&tensor, 0)
                .map_err(|e| torch_error(&format!("registering {name}"), e))?;
            slots.push(ParamSlot {
                name,
                tensor,
                group,
                step: 0,
                state: BTreeMap::new(),
                on_device: None,
            });
        }
        warn_of_a_vanishing_eps(&config, &slots);
        Ok(Self {
            config,
            groups: hypers,
            params: slots,
            grad_reset,
            scaler: None,
            found_inf: None,
            lr_on_device: false,
        })
    }

    /// The configuration this optimizer runs.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Learning rate of each parameter group, in group order.
    pub fn group_learning_rates(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.lr).collect()
    }

    /// Sets the learning rate of group `index`.
    pub fn set_group_learning_rate(&mut self, index: usize, lr: f64) -> Result<()> {
        let count = self.groups.len();
        let group = self
            .groups
            .get_mut(index)
            .ok_or_else(|| Error::invalid_argument("index", format!("group {index} of {count}")))?;
        group.lr = lr;
        self.write_device_learning_rates()
    }

    /// Turns capturable mode on or off (PyTorch's `capturable=True`): each step then
    /// reads its step count and learning rate from 0-dim tensors on the parameters'
    /// device and does all its arithmetic there, with no host synchronisation, so
    /// that the step can be captured in a CUDA graph and replayed (see kiln-fused-ops'
    /// `graph` module). Learning-rate changes write those tensors, so schedulers keep
    /// working with a captured step; `load_state_dict` copies into the existing state
    /// tensors instead of replacing them. Adam and AdamW then run libtorch's fused
    /// multi-tensor kernels (`torch.optim.Adam(fused=True)`, as they always do on the
    /// CPU): one update per parameter group, device and dtype instead of a dozen small
    /// kernels per parameter. Works on the CPU too (the same results, but for the
    /// learning rate rounded to float32).
    ///
    /// Supported for SGD, Adam and AdamW (other optimizers fail with
    /// [`Error::Unsupported`]). SGD with momentum and a non-zero dampening must have
    /// taken its first step before it is captured: that step differs from the
    /// others.
    pub fn set_capturable(&mut self, capturable: bool) -> Result<()> {
        if capturable == self.is_capturable() {
            return Ok(());
        }
        if !capturable {
            self.lr_on_device = false;
            return self.move_steps_to_host();
        }
        if !matches!(
            self.config,
            OptimizerConfig::Sgd(_) | OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_)
        ) {
            return Err(Error::unsupported(format!(
                "capturable mode (for CUDA graphs) of {:?}; SGD, Adam and AdamW have it",
                self.config
            )));
        }
        self.move_steps_to_device()?;
        self.lr_on_device = true;
        Ok(())
    }

    /// Whether capturable mode is on (see [`set_capturable`](Self::set_capturable)).
    pub fn is_capturable(&self) -> bool {
        self.lr_on_device && self.steps_on_device()
    }

    /// Keeps Adam's and AdamW's step counts on the parameters' device (float32
    /// tensors, as `torch.optim.Adam(fused=True)` keeps `state["step"]`) and runs
    /// their fused kernel, with the learning rate still a number: with loss
    /// scaling, the kernel then skips a step with inf/NaN gradients on the device,
    /// so the host never waits for the flag. The same results as without it. A
    /// `16-mixed` model on CUDA builds its Adam or AdamW optimizer this way.
    /// Capturable mode implies it. Other optimizers fail with [`Error::Unsupported`].
    pub fn set_steps_on_device(&mut self, on: bool) -> Result<()> {
        if self.is_capturable() || on == self.steps_on_device() {
            return Ok(());
        }
        if !on {
            return self.move_steps_to_host();
        }
        if self.fused_adam_hypers().is_none() {
            return Err(Error::unsupported(format!(
                "step counts on the device for {:?}; Adam and AdamW have them",
                self.config
            )));
        }
        self.move_steps_to_device()
    }

    /// Whether the step counts live on the device (capturable mode, or
    /// [`set_steps_on_device`](Self::set_steps_on_device)).
    pub fn steps_on_device(&self) -> bool {
        self.params.iter().any(|slot| slot.on_device.is_some())
    }

    fn move_steps_to_host(&mut self) -> Result<()> {
        let steps = self
            .params
            .iter()
            .map(ParamSlot::step_count)
            .collect::<Result<Vec<_>>>()?;
        for (slot, step) in self.params.iter_mut().zip(steps) {
            slot.step = step;
            slot.on_device = None;
        }
        Ok(())
    }

    fn move_steps_to_device(&mut self) -> Result<()> {
        let scalars = self
            .params
            .iter()
            .map(|slot| {
                let device = slot.tensor.device();
                let on = |value: f64| Tensor::from(value as f32).f_to_device(device);
                Ok(DeviceScalars {
                    step: on(slot.step as f64)?,
                    lr: on(self.groups[slot.group].lr)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, tch::TchError>>()
            .map_err(|e| torch_error("moving the step counts to the device", e))?;
        for (slot, scalars) in self.params.iter_mut().zip(scalars) {
            slot.on_device = Some(scalars);
        }
        Ok(())
    }

    /// In capturable mode, writes each group's learning rate into its parameters'
    /// device tensors (a device-side fill: no synchronisation).
    fn write_device_learning_rates(&mut self) -> Result<()> {
        for slot in &mut self.params {
            if let Some(scalars) = &mut slot.on_device {
                let lr = self.groups[slot.group].lr;
                let _ = scalars.lr.f_fill_(lr).map_err(|e| {
                    torch_error(&format!("setting the learning rate of {}", slot.name), e)
                })?;
            }
        }
        Ok(())
    }

    /// Names of the parameter groups, in order.
    pub fn group_names(&self) -> Vec<String> {
        self.groups.iter().map(|g| g.name.clone()).collect()
    }

    /// The parameters, for gradient clipping.
    pub fn parameters(&self) -> Vec<&Tensor> {
        self.params.iter().map(|p| &p.tensor).collect()
    }

    /// Every parameter's gradient, checked before anything changes so that a step
    /// either updates all parameters or none.
    fn gradients(&self) -> Result<Vec<Option<Tensor>>> {
        self.params
            .iter()
            .map(|slot| {
                let grad = slot.tensor.f_grad().map_err(|e| {
                    torch_error(&format!("reading the gradient of {}", slot.name), e)
                })?;
                if !grad.defined() {
                    return Ok(None);
                }
                if grad.size() != slot.tensor.size() {
                    return Err(Error::ShapeMismatch {
                        context: format!("gradient of {}", slot.name),
                        expected: format!("{:?}", slot.tensor.size()),
                        actual: format!("{:?}", grad.size()),
                    });
                }
                if grad.kind() != slot.tensor.kind() {
                    return Err(Error::DTypeMismatch {
                        context: format!("gradient of {}", slot.name),
                        expected: dtype_from_kind(slot.tensor.kind())?,
                        actual: dtype_from_kind(grad.kind())?,
                    });
                }
                if grad.device() != slot.tensor.device() {
                    return Err(Error::DeviceMismatch {
                        context: format!("gradient of {}", slot.name),
                        expected: device_from_tch(slot.tensor.device())?,
                        actual: device_from_tch(grad.device())?,
                    });
                }
                Ok(Some(grad))
            })
            .collect()
    }

    /// The fused kernels' hyperparameters, for Adam and AdamW (without their
    /// per-group learning rate and weight decay, filled in per batch).
    fn fused_adam_hypers(&self) -> Option<FusedAdamHypers> {
        let (betas, eps, amsgrad, decoupled) = match &self.config {
            OptimizerConfig::Adam(c) => (c.betas, c.eps, c.amsgrad, false),
            OptimizerConfig::AdamW(c) => (c.betas, c.eps, c.amsgrad, true),
            _ => return None,
        };
        Some(FusedAdamHypers {
            lr: 0.0,
            beta1: betas.0,
            beta2: betas.1,
            weight_decay: 0.0,
            eps,
            amsgrad,
            decoupled,
        })
    }

    /// Adam or AdamW as libtorch's fused kernel (`torch.optim.Adam(fused=True)`):
    /// one update per parameter group, device and dtype (the kernel needs one of
    /// each per call), in one pass over each parameter. In capturable mode it reads
    /// the step counts and the learning rate from the device; otherwise the step
    /// counts go in as temporary float32 tensors and the learning rate as a number.
    /// Parameters without a gradient are skipped, as PyTorch does.
    fn fused_adam_step(
        &mut self,
        grads: &[Option<Tensor>],
        hypers: FusedAdamHypers,
        found_inf: Option<&Tensor>,
    ) -> Result<()> {
        let moments: &[&'static str] = if hypers.amsgrad {
            &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        } else {
            &["exp_avg", "exp_avg_sq"]
        };
        let mut batches: Vec<((usize, tch::Device, tch::Kind), Vec<usize>)> = Vec::new();
        for (index, (slot, grad)) in self.params.iter_mut().zip(grads).enumerate() {
            if grad.is_none() {
                continue;
            }
            for &key in moments {
                let created = state_tensor(slot, key, Tensor::f_zeros_like).map(drop);
                created.map_err(|e| {
                    torch_error(&format!("creating the optimizer state of {}", slot.name), e)
                })?;
            }
            let key = (slot.group, slot.tensor.device(), slot.tensor.kind());
            match batches.iter_mut().find(|(k, _)| *k == key) {
                Some((_, indices)) => indices.push(index),
                None => batches.push((key, vec![index])),
            }
        }
        for ((group, device, kind), indices) in batches {
            let context = || {
                format!(
                    "fused {} step of group {} ({device:?}, {kind:?})",
                    if hypers.decoupled { "AdamW" } else { "Adam" },
                    self.groups[group].name
                )
            };
            // The step counts the kernel reads and increments: in capturable mode
            // handles to the device's own, else temporaries holding the host's.
            let steps = indices
                .iter()
                .map(|&index| {
                    let slot = &self.params[index];
                    match &slot.on_device {
                        Some(scalars) => Ok(scalars.step.shallow_clone()),
                        None => Tensor::f_from_slice(&[slot.step as f32])
                            .and_then(|t| t.f_reshape([0i64; 0])),
                    }
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| torch_error("creating the step counts", e))?;
            // One learning rate per group: in capturable mode the first slot's device
            // copy, else the number.
            let lr = indices
                .first()
                .filter(|_| self.lr_on_device)
                .and_then(|&index| self.params[index].on_device.as_ref())
                .map(|scalars| &scalars.lr);
            let mut batch = FusedAdamBatch {
                steps: steps.iter().collect(),
                found_inf,
                ..FusedAdamBatch::default()
            };
            for &index in &indices {
                let slot = &self.params[index];
                let state = |key: &str| {
                    slot.state.get(key).ok_or_else(|| {
                        Error::backend(
                            "torch",
                            context(),
                            format!("{key} of {} missing", slot.name),
                        )
                    })
                };
                batch.params.push(&slot.tensor);
                batch.grads.extend(grads[index].as_ref());
                batch.exp_avgs.push(state("exp_avg")?);
                batch.exp_avg_sqs.push(state("exp_avg_sq")?);
                if hypers.amsgrad {
                    batch.max_exp_avg_sqs.push(state("max_exp_avg_sq")?);
                }
            }
            let hypers = FusedAdamHypers {
                lr: self.groups[group].lr,
                weight_decay: self.groups[group].weight_decay,
                ..hypers
            };
            fused_adam_step(&batch, lr, &hypers)
                .map_err(|e| Error::backend_with_source("torch", context(), e))?;
            for index in indices {
                self.params[index].step += 1;
            }
        }
        Ok(())
    }
}

impl TorchOptimizer {
    /// One update of every parameter with a gradient: libtorch's fused kernel for
    /// Adam and AdamW on the CPU or with the step counts on the device (with
    /// `found_inf`, which needs the latter, the kernel skips the update on the device
    /// when it is set), else PyTorch's single-tensor rules (`found_inf` must then be
    /// `None`).
    fn update(&mut self, grads: &[Option<Tensor>], found_inf: Option<&Tensor>) -> Result<()> {
        if let Some(hypers) = self.fused_adam_hypers() {
            let on_cpu = self
                .params
                .iter()
                .all(|s| s.tensor.device() == tch::Device::Cpu);
            if self.steps_on_device() || on_cpu {
                return tch::no_grad(|| self.fused_adam_step(grads, hypers, found_inf));
            }
        }
        // Disjoint borrows: the slots change, the config and groups are only read.
        let Self {
            config,
            groups,
            params,
            ..
        } = self;
        tch::no_grad(|| -> Result<()> {
            for (slot, grad) in params.iter_mut().zip(grads) {
                // PyTorch skips parameters that received no gradient.
                let Some(grad) = grad.as_ref() else { continue };
                let hyper = &groups[slot.group];
                slot.step += 1;
                if let Some(scalars) = &mut slot.on_device {
                    let _ = scalars.step.f_add_scalar_(1.0).map_err(|e| {
                        torch_error(&format!("counting the step of {}", slot.name), e)
                    })?;
                }
                let result = match &*config {
                    OptimizerConfig::Sgd(c) => sgd::update(slot, grad, c, hyper),
                    OptimizerConfig::Adam(c) => adam::update_adam(slot, grad, c, hyper),
                    OptimizerConfig::AdamW(c) => adam::update_adamw(slot, grad, c, hyper),
                    OptimizerConfig::RmsProp(c) => rmsprop::update(slot, grad, c, hyper),
                    OptimizerConfig::Adagrad(c) => adagrad::update(slot, grad, c, hyper),
                    _ => Ok(()), // rejected above
                };
                result.map_err(|e| torch_error(&format!("optimizer step for {}", slot.name), e))?;
            }
            Ok(())
        })
    }
}

/// The one value of the scalar `host` at `key`, as `dtype`.
fn scalar_value<T: kiln_core::dtype::Element>(
    key: &str,
    host: &HostTensor,
    dtype: DType,
) -> Result<T> {
    host.to_dtype(dtype)
        .as_slice::<T>()?
        .first()
        .copied()
        .ok_or_else(|| Error::invalid_argument(key, "an empty tensor where a number was saved"))
}

/// Warns when the optimizer's `eps` is below float16's normal range while a
/// parameter, and so its optimizer state, is float16 (`16-true`): a second
/// moment that underflows to zero then makes the step `lr * m / eps`, huge, and
/// training soon stops on a NaN loss. (bfloat16 has float32's range.)
fn warn_of_a_vanishing_eps(config: &OptimizerConfig, slots: &[ParamSlot]) {
    let eps = match config {
        OptimizerConfig::Adam(c) => c.eps,
        OptimizerConfig::AdamW(c) => c.eps,
        OptimizerConfig::RmsProp(c) => c.eps,
        OptimizerConfig::Adagrad(c) => c.eps,
        _ => return,
    };
    // float16's smallest normal number, 2^-14.
    if eps >= 2f64.powi(-14) {
        return;
    }
    if let Some(slot) = slots.iter().find(|s| s.tensor.kind() == tch::Kind::Half) {
        log::warn!(
            "the {} optimizer's eps {eps:e} is below float16's range, the dtype of {} and \
             of its optimizer state (16-true): a second moment that underflows to zero \
             then gives a huge step; use eps = 1e-4 or more, or 16-mixed",
            config.kind(),
            slot.name
        );
    }
}

fn slot_dims(tensor: &Tensor) -> Vec<usize> {
    tensor.size().iter().map(|&d| d as usize).collect()
}

/// The state tensor `key` of a slot, created with `init` on first use.
pub(crate) fn state_tensor<'a>(
    slot: &'a mut ParamSlot,
    key: &'static str,
    init: impl FnOnce(&Tensor) -> std::result::Result<Tensor, tch::TchError>,
) -> std::result::Result<&'a mut Tensor, tch::TchError> {
    if !slot.state.contains_key(key) {
        let value = init(&slot.tensor)?;
        slot.state.insert(key, value);
    }
    // Inserted just above when missing.
    slot.state
        .get_mut(key)
        .ok_or_else(|| tch::TchError::Kind(format!("optimizer state {key} missing")))
}

/// `grad + weight_decay * param` (PyTorch's coupled L2 penalty), or the gradient itself.
pub(crate) fn with_weight_decay(
    grad: &Tensor,
    param: &Tensor,
    weight_decay: f64,
) -> std::result::Result<Tensor, tch::TchError> {
    if weight_decay == 0.0 {
        return Ok(grad.shallow_clone());
    }
    grad.f_add(&param.f_mul_scalar(weight_decay)?)
}
