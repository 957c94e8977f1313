//! The training step under a strategy that needs the gradients
//! ([`StepHooks::needs_gradients`]): the single-process step's result on the
//! global batch, with the gradients reduced over the ranks between the session
//! run that computes them and the one that applies them. It is written once,
//! [`hooked_step`], for data parallelism (kiln-tf's
//! [`GradientAllReduce`](crate::GradientAllReduce) with a [`TfOptimizer`]) and
//! ZeRO's stages (a [`TfShardedOptimizer`](super::TfShardedOptimizer)); what
//! differs is a [`FlatUpdate`]: how the vector is reduced, kept and applied.
//!
//! Per micro-batch, on every rank:
//!
//! 1. with `broadcast_buffers` and a model with buffers, rank 0's buffers
//!    (one broadcast; a session run to read them on rank 0, one to write them
//!    on the others);
//! 2. one session run of [`ProgramKind::FlatGradients`]: forward, loss and the
//!    gradients of `loss * plan.scale`, fetched as one float32 vector
//!    `[grad_0.., grad_1.., .., loss]` that TensorFlow allocates (the only
//!    tensor that crosses the FFI edge, besides the batch and the scale);
//! 3. a micro-batch that does not apply (DDP's `no_sync`): only the loss is
//!    averaged (an all-reduce of the vector's last element, in place), and the
//!    gradients are added on this rank to those of the earlier micro-batches;
//! 4. a micro-batch that applies: the earlier micro-batches' sum is added into
//!    the vector, which is then averaged over the ranks **in place, in
//!    TensorFlow's memory** (one all-reduce of gradients and loss together),
//!    and the same tensor is fed to [`ProgramKind::Apply`] with
//!    [`GradientSource::Flat`]: clipping (of the averaged gradients, so the
//!    global batch's norm) and the update, one session run.
//!
//! So a step of `k` micro-batches makes `k` all-reduces: `k - 1` of one float
//! and one of all the gradients plus one float. The returned loss is the mean
//! over the ranks; when it is not finite every rank skips the micro-batch alike:
//! no parameter, optimizer state or accumulated gradient changes, and buffers
//! broadcast in step 1 are written back (see [`LocalGradients`]).

use std::sync::Arc;

use kiln_core::{
    backend::StepPlan,
    distributed::{Collectives, ReduceOp},
    module::Module,
    optim::GradClip,
    strategy::StepHooks,
    Error, HostTensor, Result,
};

use super::TfOptimizer;
use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::model::{lock, TfModel};
use crate::step::{self, GradientSource, ProgramKey, ProgramKind, Signature, UpdateRule};

/// The gradients of the micro-batches of a data-parallel step that did not
/// apply, summed on this rank only (DDP's `no_sync`): a flat vector in the
/// layout of [`ProgramKind::FlatGradients`], in the memory TensorFlow
/// allocated for the first of them.
pub(super) struct LocalGradients {
    /// The summed gradients, then one element that is not used.
    pub(super) flat: TfTensor,
    /// Which of the optimizer's parameters have a gradient in `flat`.
    pub(super) present: Vec<bool>,
    /// The ranks the gradients are to be averaged over (none: a strategy that
    /// spans no ranks).
    pub(super) group: Option<Arc<dyn Collectives>>,
}

impl std::fmt::Debug for LocalGradients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalGradients")
            .field("flat", &self.flat)
            .field("present", &self.present)
            .field("ranks", &self.group.as_ref().map(|g| g.world_size()))
            .finish()
    }
}

/// The `f32` elements of a flat gradient vector, which must have at least one.
pub(super) fn elements(flat: &mut TfTensor) -> Result<&mut [f32]> {
    let (dtype, shape) = (flat.dtype(), flat.shape());
    match flat {
        TfTensor::F32(t) if !t.is_empty() => Ok(&mut t[..]),
        _ => Err(Error::backend(
            "tensorflow",
            "a data-parallel training step",
            format!("the flat gradient vector is a {dtype} tensor of shape {shape}"),
        )),
    }
}

/// `into[i] += from[i]` over the gradients (all but the last element).
pub(super) fn add_gradients(into: &mut [f32], from: &mut TfTensor) -> Result<()> {
    let from = elements(from)?;
    if from.len() != into.len() {
        return Err(Error::ShapeMismatch {
            context: "accumulating data-parallel gradients".to_owned(),
            expected: format!("[{}]", into.len()),
            actual: format!("[{}]", from.len()),
        });
    }
    let n = into.len() - 1;
    for (a, b) in into[..n].iter_mut().zip(&from[..n]) {
        *a += *b;
    }
    Ok(())
}

/// What a hooked step does with a micro-batch's flat gradient vector: the
/// part in which data parallelism ([`TfOptimizer`]) and ZeRO's stages
/// ([`TfShardedOptimizer`](super::TfShardedOptimizer)) differ. The step
/// itself is [`hooked_step`], once for all of them.
pub(crate) trait FlatUpdate {
    /// What the step is called in its errors.
    const CONTEXT: &'static str;

    /// The optimizer that computes the gradients (this rank's, for ZeRO).
    fn optimizer(&self) -> &TfOptimizer;

    /// Refuses to start a step the optimizer's state does not allow.
    fn check_start(&self) -> Result<()> {
        Ok(())
    }

    /// Which parameters the earlier micro-batches of this step differentiated.
    fn earlier(&self) -> Option<&[bool]>;

    /// Reduces the micro-batch's vector `data` (gradients, then the loss)
    /// over the ranks in place, before the loss is read; `present` says which
    /// parameters it holds.
    fn reduce(
        &mut self,
        hooks: &mut dyn StepHooks<TfBackend>,
        data: &mut [f32],
        present: &[bool],
        apply: bool,
    ) -> Result<()>;

    /// The agreed loss is finite: keeps the micro-batch's gradients, or, when
    /// `plan.apply`, applies them with the earlier ones'.
    fn finish(
        &mut self,
        hooks: &mut dyn StepHooks<TfBackend>,
        flat: TfTensor,
        present: Vec<bool>,
        plan: &StepPlan<'_>,
    ) -> Result<()>;
}

/// One training micro-batch on `model` with `hooks` through `update` (see the
/// [module docs](self)): the hooks' `before_forward`, one session run for the
/// flat gradients, the reduction, the loss, then keep or apply. Returns the
/// loss averaged over the ranks, and this rank's metrics (as libtorch's
/// strategies report them); when the loss is not finite, nothing changes.
pub(crate) fn hooked_step<U: FlatUpdate>(
    update: &mut U,
    model: &TfModel,
    hooks: &mut dyn StepHooks<TfBackend>,
    inputs: &TfTensor,
    targets: &TfTensor,
    plan: &StepPlan<'_>,
) -> Result<(f64, Vec<f64>)> {
    update.optimizer().check_step(model, plan)?;
    if let Some(clip) = plan.clip {
        clip.validate()?;
    }
    update.check_start()?;
    hooks.before_forward(plan.apply)?;
    let (mut flat, present, metrics) = update
        .optimizer()
        .flat_gradients(model, inputs, targets, plan)?;
    if update.earlier().is_some_and(|p| p != present) {
        return Err(Error::backend(
            "tensorflow",
            U::CONTEXT,
            "the micro-batches of one step differentiate different parameters",
        ));
    }
    let data = elements(&mut flat)?;
    update.reduce(hooks, data, &present, plan.apply)?;
    let loss = data[data.len() - 1];
    if !loss.is_finite() {
        hooks.skipped()?;
        return Ok((f64::from(loss), metrics));
    }
    update.finish(hooks, flat, present, plan)?;
    Ok((f64::from(loss), metrics))
}

/// Data parallelism: the whole vector averaged over the ranks on the
/// micro-batch that applies (only the loss on the others, whose gradients
/// stay on this rank), then applied in one session run.
impl FlatUpdate for TfOptimizer {
    const CONTEXT: &'static str = "a data-parallel training step";

    fn optimizer(&self) -> &TfOptimizer {
        self
    }

    fn check_start(&self) -> Result<()> {
        if self.pending && self.local.is_none() {
            return Err(Error::invalid_argument(
                "optimizer",
                "this optimizer holds gradients accumulated before the model was wrapped in \
                 a strategy; call zero_grad() first",
            ));
        }
        Ok(())
    }

    fn earlier(&self) -> Option<&[bool]> {
        self.local.as_ref().map(|l| &l.present[..])
    }

    fn reduce(
        &mut self,
        hooks: &mut dyn StepHooks<TfBackend>,
        data: &mut [f32],
        _present: &[bool],
        apply: bool,
    ) -> Result<()> {
        if apply {
            // The earlier micro-batches' sum, added into this one's vector, so
            // that a skipped micro-batch leaves it as it was.
            if let Some(local) = self.local.as_mut() {
                add_gradients(data, &mut local.flat)?;
            }
        }
        hooks.reduce_flat(data, apply)
    }

    fn finish(
        &mut self,
        hooks: &mut dyn StepHooks<TfBackend>,
        flat: TfTensor,
        present: Vec<bool>,
        plan: &StepPlan<'_>,
    ) -> Result<()> {
        if plan.apply {
            self.apply_flat(flat, &present, plan.clip)?;
            self.local = None;
            self.pending = false;
            Ok(())
        } else {
            self.keep_local(flat, present, hooks.collectives())
        }
    }
}

impl TfOptimizer {
    /// Keeps a micro-batch's gradients that do not apply on this rank (DDP's
    /// `no_sync`): `flat`, the earlier micro-batches' sum added into it, is
    /// the new sum, to be averaged over `group` when the step applies.
    pub(super) fn keep_local(
        &mut self,
        mut flat: TfTensor,
        present: Vec<bool>,
        group: Option<Arc<dyn Collectives>>,
    ) -> Result<()> {
        if let Some(mut local) = self.local.take() {
            add_gradients(elements(&mut flat)?, &mut local.flat)?;
        }
        self.local = Some(LocalGradients {
            flat,
            present,
            group,
        });
        self.pending = true;
        Ok(())
    }

    /// Runs the [`ProgramKind::FlatGradients`] program on one micro-batch:
    /// the flat vector, which parameters it holds gradients of, and this
    /// rank's metrics (a mixture of experts' router losses).
    pub(super) fn flat_gradients(
        &self,
        model: &TfModel,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<(TfTensor, Vec<bool>, Vec<f64>)> {
        let key = ProgramKey {
            kind: ProgramKind::FlatGradients {
                optimizer: self.id,
                loss: plan.loss.clone(),
            },
            train: Module::<TfBackend>::mode(model).is_train(),
            input: Some(Signature::of(inputs)),
            target: Some(Signature::of(targets)),
        };
        let batch = inputs.shape();
        let mut graph = lock(&self.graph)?;
        let program = step::program(
            &mut graph,
            &key,
            Some(model.model_graph(batch.dims())),
            Some(self),
        )?;
        let mut feeds = Vec::with_capacity(1);
        if let Some(ph) = &program.scale {
            feeds.push((
                ph.clone(),
                TfTensor::from_host(&HostTensor::scalar(plan.scale as f32))?,
            ));
        }
        let mut fetched = step::run(
            &mut graph.engine,
            &program,
            Some(inputs),
            Some(targets),
            &feeds,
            "computing a data-parallel step's gradients",
        )?;
        let flat = fetched.flat.ok_or_else(|| {
            Error::backend(
                "tensorflow",
                "computing a data-parallel step's gradients",
                "no flat gradient vector was fetched",
            )
        })?;
        Ok((flat, program.present, std::mem::take(&mut fetched.metrics)))
    }

    /// Applies a flat gradient vector (already averaged over the ranks) in one
    /// session run: the tensor itself is fed, clipped first when `clip` is given.
    pub(super) fn apply_flat(
        &mut self,
        flat: TfTensor,
        present: &[bool],
        clip: Option<&GradClip>,
    ) -> Result<()> {
        let expected = step::flat_len(&self.parameters(), present);
        let len = flat.shape().numel();
        if len != expected {
            return Err(Error::ShapeMismatch {
                context: "a data-parallel step's flat gradients".to_owned(),
                expected: format!("[{expected}]"),
                actual: format!("[{len}]"),
            });
        }
        let key = ProgramKey {
            kind: ProgramKind::Apply {
                optimizer: self.id,
                source: GradientSource::Flat {
                    present: present.to_vec(),
                },
                clip: clip.copied(),
            },
            train: false,
            input: None,
            target: None,
        };
        let graph_arc = Arc::clone(&self.graph);
        let mut graph = lock(&graph_arc)?;
        let program = step::program(&mut graph, &key, None, Some(&*self))?;
        let placeholder = program.flat_feed.clone().ok_or_else(|| {
            Error::backend(
                "tensorflow",
                "applying data-parallel gradients",
                "the program has no gradient input",
            )
        })?;
        let mut feeds = self.coefficient_feeds()?;
        feeds.push((placeholder, flat));
        step::run(
            &mut graph.engine,
            &program,
            None,
            None,
            &feeds,
            "applying data-parallel gradients",
        )?;
        self.step += 1;
        Ok(())
    }

    /// [`Optimizer::step`](kiln_core::optim::Optimizer::step) on gradients a
    /// hooked step accumulated: averaged over the ranks, then applied without
    /// clipping.
    pub(super) fn apply_local(&mut self, mut local: LocalGradients) -> Result<()> {
        let data = elements(&mut local.flat)?;
        if let Some(group) = &local.group {
            group.all_reduce_f32(data, ReduceOp::Mean)?;
        }
        self.apply_flat(local.flat, &local.present, None)
    }
}
