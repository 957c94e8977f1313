//! Post-local SGD (Lin et al., "Don't Use Large Mini-Batches, Use Local
//! SGD"), as PyTorch runs it: `DistributedDataParallel` with the
//! `post_localSGD_hook` and `PostLocalSGDOptimizer` around a
//! `PeriodicModelAverager`.

use std::sync::Arc;

use kiln_core::distributed::{Collectives, DistributedOptions, ReduceOp};
use kiln_core::module::Module;
use kiln_core::strategy::StepHooks;
use kiln_core::{Error, Result};
use kiln_torch::{torch_error, TorchBackend};
use tch::{Kind, Tensor};

use crate::ddp::{check_device_suits_group, DistributedDataParallel};
use crate::ProcessGroup;

/// When post-local SGD stops synchronising gradients, and how often it
/// averages the parameters after that. With the `serde` feature it reads as
/// a config section (the `kiln` CLI's `[distributed.post_local_sgd]`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct PostLocalSgdOptions {
    /// Optimizer steps trained as DDP trains them, gradients averaged over
    /// the ranks (`PostLocalSGDState`'s `start_localSGD_iter` and
    /// `PeriodicModelAverager`'s `warmup_steps`).
    pub warmup_steps: u64,
    /// After the warm-up, the parameters are averaged over the ranks after
    /// every `period`-th optimizer step, the first at step `warmup_steps + 1`;
    /// the steps between are each rank's own (`PeriodicModelAverager`'s
    /// `period`).
    pub period: u64,
}

impl Default for PostLocalSgdOptions {
    /// PyTorch's tutorial values: 100 warm-up steps, then averaging every 4.
    fn default() -> Self {
        PostLocalSgdOptions {
            warmup_steps: 100,
            period: 4,
        }
    }
}

impl PostLocalSgdOptions {
    /// Checks the period (at least 1).
    pub fn validate(&self) -> Result<()> {
        if self.period == 0 {
            return Err(Error::invalid_argument(
                "post_local_sgd.period",
                "must be at least 1 (the parameters are averaged every `period` steps)",
            ));
        }
        Ok(())
    }

    /// Whether the optimizer step taken after `step` earlier ones (0-based)
    /// synchronises gradients: the warm-up's steps do.
    pub fn syncs_gradients(&self, step: u64) -> bool {
        step < self.warmup_steps
    }

    /// Whether the parameters are averaged after the optimizer step taken
    /// after `step` earlier ones, as `PeriodicModelAverager` decides:
    /// `step >= warmup_steps` and `(step - warmup_steps) % period == 0`.
    ///
    /// ```
    /// use kiln_c10d::PostLocalSgdOptions;
    /// let options = PostLocalSgdOptions { warmup_steps: 2, period: 3 };
    /// let averaged: Vec<u64> = (0..10).filter(|&s| options.averages_after(s)).collect();
    /// assert_eq!(averaged, [2, 5, 8]);
    /// ```
    pub fn averages_after(&self, step: u64) -> bool {
        step >= self.warmup_steps && (step - self.warmup_steps).is_multiple_of(self.period.max(1))
    }
}

/// Post-local SGD's [`StepHooks`]: for the first
/// [`warmup_steps`](PostLocalSgdOptions::warmup_steps) optimizer steps it is
/// [`DistributedDataParallel`] (gradients averaged in buckets during the
/// backward pass); after them each rank steps on its own gradients (DDP's
/// `no_sync()`, as `post_localSGD_hook` with a one-rank subgroup leaves
/// them), and after every `period`-th step the parameters that received a
/// gradient are averaged over the ranks in one flat all-reduce per dtype
/// (`PeriodicModelAverager`). Buffers still come from rank 0 before each
/// forward pass, and the loss is still averaged for reporting and for the
/// non-finite check.
///
/// Each rank's optimizer state stays its own after the warm-up, as under
/// `PostLocalSGDOptimizer`. A checkpoint holds rank 0's replica; every rank
/// resumes from it, with the step counter restored from the checkpoint's
/// step ([`StepHooks::start_at_step`]).
pub struct PostLocalSgd {
    ddp: DistributedDataParallel,
    options: PostLocalSgdOptions,
    /// The parameters that train, averaged after the warm-up.
    params: Vec<Tensor>,
    /// Optimizer steps taken (`PeriodicModelAverager.step`).
    step: u64,
}

impl std::fmt::Debug for PostLocalSgd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostLocalSgd")
            .field("ddp", &self.ddp)
            .field("options", &self.options)
            .field("params", &self.params.len())
            .field("step", &self.step)
            .finish()
    }
}

impl PostLocalSgd {
    /// Post-local SGD over `group` for `module`: the options checked, then
    /// [`DistributedDataParallel::of`] (rank 0's parameters and buffers on
    /// every rank now). Call it on every rank, after setting precision and
    /// freezing, before building the optimizer.
    pub fn of<M: Module<TorchBackend> + ?Sized>(
        group: Arc<ProcessGroup>,
        module: &M,
        options: &PostLocalSgdOptions,
        distributed: &DistributedOptions,
    ) -> Result<Self> {
        options.validate()?;
        let params = module.named_parameters()?;
        check_device_suits_group(&group, &params)?;
        let ddp =
            DistributedDataParallel::new(group, &params, &module.named_buffers()?, distributed)?;
        log::info!(
            "post-local SGD: DDP for {} steps, then parameters averaged every {} steps",
            options.warmup_steps,
            options.period
        );
        Ok(PostLocalSgd {
            ddp,
            options: options.clone(),
            params: params
                .into_iter()
                .filter(|(_, t)| t.requires_grad())
                .map(|(_, t)| t)
                .collect(),
            step: 0,
        })
    }

    /// The options.
    pub fn options(&self) -> &PostLocalSgdOptions {
        &self.options
    }

    /// Optimizer steps taken, as the averaging schedule counts them.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Whether this micro-batch's gradients are averaged over the ranks.
    fn syncs(&self, sync: bool) -> bool {
        sync && self.options.syncs_gradients(self.step)
    }

    /// Every rank's mean of the parameters that have a gradient, in place:
    /// per dtype, one flat buffer divided by the world size, then summed, as
    /// `average_parameters` does.
    fn average_parameters(&self) -> Result<()> {
        let world = self.ddp.group().world_size() as f64;
        let with_grad: Vec<&Tensor> = self.params.iter().filter(|p| p.grad().defined()).collect();
        let mut kinds: Vec<Kind> = Vec::new();
        for p in &with_grad {
            if !kinds.contains(&p.kind()) {
                kinds.push(p.kind());
            }
        }
        tch::no_grad(|| -> Result<()> {
            for kind in kinds {
                let same: Vec<&Tensor> = with_grad
                    .iter()
                    .copied()
                    .filter(|p| p.kind() == kind)
                    .collect();
                let flat: Vec<Tensor> = same.iter().map(|p| p.reshape([-1])).collect();
                let flat = Tensor::f_cat(&flat, 0)
                    .and_then(|f| f.f_div_scalar(world))
                    .map_err(|e| torch_error("post-local SGD's parameter average", e))?;
                self.ddp.group().all_reduce(&flat, ReduceOp::Sum)?;
                let mut offset = 0;
                for p in same {
                    let n = p.numel() as i64;
                    let part = flat
                        .f_narrow(0, offset, n)
                        .and_then(|part| part.f_view_as(p))
                        .map_err(|e| torch_error("post-local SGD's parameter average", e))?;
                    p.shallow_clone()
                        .f_copy_(&part)
                        .map_err(|e| torch_error("post-local SGD's parameter average", e))?;
                    offset += n;
                }
            }
            Ok(())
        })
    }
}

impl StepHooks<TorchBackend> for PostLocalSgd {
    fn name(&self) -> &str {
        "PostLocalSGD"
    }

    fn agrees_on_loss(&self) -> bool {
        true
    }

    fn before_forward(&mut self, sync: bool) -> Result<()> {
        let sync = self.syncs(sync);
        StepHooks::before_forward(&mut self.ddp, sync)
    }

    fn before_backward(&mut self, local_loss: f64, scaled: &Tensor, sync: bool) -> Result<()> {
        let sync = self.syncs(sync);
        self.ddp.before_backward(local_loss, scaled, sync)
    }

    fn backward_failed(&mut self, error: Error, sync: bool) -> Error {
        let sync = self.syncs(sync);
        self.ddp.backward_failed(error, sync)
    }

    fn agreed_loss(&mut self, local_loss: f64) -> Result<f64> {
        self.ddp.agreed_loss(local_loss)
    }

    fn after_update(&mut self) -> Result<()> {
        if self.options.averages_after(self.step) {
            self.average_parameters()?;
        }
        self.step += 1;
        Ok(())
    }

    fn sync_buffers(&mut self) -> Result<()> {
        StepHooks::sync_buffers(&mut self.ddp)
    }

    fn start_at_step(&mut self, step: u64) -> Result<()> {
        if step != self.step {
            log::info!(
                "post-local SGD continues at step {step}: {}",
                if self.options.syncs_gradients(step) {
                    format!("{} warm-up steps left", self.options.warmup_steps - step)
                } else {
                    "local steps, parameters averaged periodically".to_string()
                }
            );
        }
        self.step = step;
        Ok(())
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        self.ddp.collectives()
    }
}
