//! [`Optimizer`] for [`TorchOptimizer`]: the step (with loss scaling and
//! clipping), gradients, learning rates, and the state dict in Kiln's
//! portable layout.

use super::*;

impl Optimizer<TorchBackend> for TorchOptimizer {
    fn step(&mut self) -> Result<()> {
        if !matches!(
            self.config,
            OptimizerConfig::Sgd(_)
                | OptimizerConfig::Adam(_)
                | OptimizerConfig::AdamW(_)
                | OptimizerConfig::RmsProp(_)
                | OptimizerConfig::Adagrad(_)
        ) {
            return Err(Error::unsupported(format!(
                "optimizer {:?} on libtorch",
                self.config
            )));
        }
        let grads = self.gradients()?;
        if self.scaler.is_none() {
            return self.update(&grads, None);
        }
        // GradScaler's step and update: unscale (unless done before clipping), skip
        // the update when a gradient is inf or NaN, then grow or back off the scale.
        self.unscale_gradients()?;
        let Some(found_inf) = self.found_inf.take() else {
            return Err(Error::backend(
                "torch",
                "optimizer step",
                "no inf/NaN flag after unscaling",
            ));
        };
        if self.steps_on_device() && self.fused_adam_hypers().is_some() {
            // The fused kernel reads the flag on the device: nothing waits.
            self.update(&grads, Some(&found_inf))?;
        } else {
            // One flag read, as torch.amp.GradScaler does for optimizers without a
            // fused kernel.
            let skip = found_inf
                .f_double_value(&[])
                .map_err(|e| torch_error("reading the inf/NaN flag of the gradients", e))?
                != 0.0;
            if skip {
                log::debug!("inf or NaN gradients: step skipped, loss scale backs off");
            } else {
                self.update(&grads, None)?;
            }
        }
        match self.scaler.as_mut() {
            Some(scaler) => scaler.update(&found_inf),
            None => Ok(()),
        }
    }

    /// Sets every parameter's gradient to none, as PyTorch's
    /// `zero_grad(set_to_none=True)`: the next backward writes fresh gradients
    /// instead of adding to zeroed ones.
    fn zero_grad(&mut self) -> Result<()> {
        self.found_inf = None;
        self.grad_reset
            .zero_grad()
            .map_err(|e| torch_error("zero_grad", e))
    }

    fn kind(&self) -> Option<&'static str> {
        Some(self.config.kind())
    }

    fn config(&self) -> Option<&OptimizerConfig> {
        Some(&self.config)
    }

    fn learning_rate(&self) -> f64 {
        self.groups.first().map_or(0.0, |g| g.lr)
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        for group in &mut self.groups {
            group.lr = lr;
        }
        self.write_device_learning_rates()
    }

    fn learning_rates(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.lr).collect()
    }

    fn keeps_gradients(&self) -> bool {
        true
    }

    /// Summed on the device in f32 (per group, then one read).
    fn gradient_norms(&self) -> Result<Vec<f64>> {
        let fail = |e| torch_error("reading gradient norms", e);
        let mut squares: Vec<Option<Tensor>> = (0..self.groups.len()).map(|_| None).collect();
        for slot in &self.params {
            let grad = slot.tensor.grad();
            if !grad.defined() {
                continue;
            }
            let sq = grad
                .f_to_kind(Kind::Float)
                .and_then(|g| g.f_square())
                .and_then(|g| g.f_sum(Kind::Float))
                .map_err(fail)?;
            let entry = squares.get_mut(slot.group).ok_or_else(|| {
                Error::invalid_argument(
                    slot.name.as_str(),
                    format!("is in group {} of {}", slot.group, self.groups.len()),
                )
            })?;
            *entry = Some(match entry.take() {
                Some(sum) => sum.f_add(&sq).map_err(fail)?,
                None => sq,
            });
        }
        let device = self
            .params
            .first()
            .map_or(tch::Device::Cpu, |p| p.tensor.device());
        let sums: Vec<Tensor> = squares
            .into_iter()
            .map(|s| s.unwrap_or_else(|| Tensor::zeros([], (Kind::Float, device))))
            .collect();
        let stacked = Tensor::f_stack(&sums, 0)
            .and_then(|t| t.f_sqrt())
            .and_then(|t| t.f_to_kind(Kind::Double))
            .and_then(|t| t.f_to_device(tch::Device::Cpu))
            .map_err(fail)?;
        Vec::<f64>::try_from(&stacked).map_err(fail)
    }

    fn gradients(&self) -> Result<StateDict> {
        let mut grads = StateDict::new();
        for slot in &self.params {
            let grad = slot.tensor.grad();
            if grad.defined() {
                grads.insert(slot.name.clone(), crate::from_tch(&grad)?);
            }
        }
        Ok(grads)
    }

    fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        set_group_learning_rates(&mut self.groups, lrs)?;
        self.write_device_learning_rates()
    }

    /// kiln-core's portable layout ([`kiln_core::optim::optimizer_state_key`]):
    /// `state.<param>.<buffer>` (tensors), `state.<param>.step` (i64 scalar),
    /// `group.<i>.lr` and `group.<i>.weight_decay` (f64 scalars).
    fn state_dict(&self) -> Result<StateDict> {
        self.state_tensors()?.to_state_dict()
    }

    /// As [`state_dict`](Optimizer::state_dict), with the state buffers as handles
    /// that a checkpoint reads in place.
    fn state_tensors(&self) -> Result<StateTensors<TorchBackend>> {
        let mut hypers = StateDict::new();
        save_group_hypers(&self.groups, &mut hypers);
        if let Some(scaler) = &self.scaler {
            hypers.insert(SCALE_KEY, HostTensor::scalar(scaler.scale()?));
            hypers.insert(
                GROWTH_TRACKER_KEY,
                HostTensor::scalar(scaler.growth_tracker()?),
            );
        }
        let mut out = StateTensors::from(hypers);
        for slot in &self.params {
            out.insert(
                optimizer_state_key(&slot.name, "step"),
                StateTensor::Host(HostTensor::scalar(slot.step_count()? as i64)),
            )?;
            for (key, tensor) in &slot.state {
                out.insert(
                    optimizer_state_key(&slot.name, key),
                    StateTensor::Backend(tensor.shallow_clone()),
                )?;
            }
        }
        Ok(out)
    }

    /// All or nothing: kiln-core reads and checks the whole state first
    /// ([`kiln_core::optim::read_optimizer_state`]); this only moves the tensors to
    /// each parameter's device.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let dims: Vec<Vec<usize>> = self.params.iter().map(|s| slot_dims(&s.tensor)).collect();
        let params: Vec<(&str, &[usize])> = self
            .params
            .iter()
            .zip(&dims)
            .map(|(slot, dims)| (slot.name.as_str(), dims.as_slice()))
            .collect();
        let loaded = read_optimizer_state(&self.config, &params, state)?;
        let scale = match (
            &self.scaler,
            state.get(SCALE_KEY),
            state.get(GROWTH_TRACKER_KEY),
        ) {
            (Some(_), Some(scale), Some(tracker)) => Some((
                scalar_value::<f64>(SCALE_KEY, scale, DType::F64)?,
                scalar_value::<i64>(GROWTH_TRACKER_KEY, tracker, DType::I64)?,
            )),
            (Some(_), ..) => {
                return Err(Error::invalid_argument(
                    SCALE_KEY,
                    "the state has no loss scale (it was saved without 16-mixed loss \
                     scaling); load it into an optimizer without loss scaling",
                ))
            }
            (None, Some(_), _) => {
                return Err(Error::invalid_argument(
                    SCALE_KEY,
                    "the state holds a loss scale (it was saved training in 16-mixed); \
                     turn loss scaling on to load it",
                ))
            }
            (None, None, _) => None,
        };
        let mut steps = Vec::with_capacity(self.params.len());
        let mut buffers = Vec::with_capacity(self.params.len());
        for (slot, read) in self.params.iter().zip(loaded) {
            let device = device_from_tch(slot.tensor.device())?;
            let mut slot_buffers = BTreeMap::new();
            for (name, host) in &read.buffers {
                slot_buffers.insert(*name, to_tch(host, device)?);
            }
            steps.push(read.step);
            buffers.push(slot_buffers);
        }
        if let (Some(scaler), Some((scale, tracker))) = (self.scaler.as_mut(), scale) {
            scaler.load(scale, tracker)?;
        }
        self.groups = load_group_hypers(&self.groups, state);
        for ((slot, step), mut state) in self.params.iter_mut().zip(steps).zip(buffers) {
            slot.step = step;
            let Some(scalars) = &mut slot.on_device else {
                slot.state = state;
                continue;
            };
            // Capturable: a captured step reads these very tensors, so write into them.
            let fail = |e| torch_error(&format!("loading the state of {}", slot.name), e);
            let _ = scalars.step.f_fill_(step as f64).map_err(fail)?;
            for (name, existing) in &mut slot.state {
                match state.remove(name) {
                    Some(loaded) => existing.f_copy_(&loaded),
                    None => existing.f_zero_().map(drop),
                }
                .map_err(fail)?;
            }
            slot.state.append(&mut state);
        }
        self.write_device_learning_rates()
    }
}
