//! [`TfOptimizer`]: PyTorch's update rules as TensorFlow ops in the model's
//! graph, one file per algorithm, and clipping ([`clip`]). The programs that
//! run them (a training step, an update from given gradients) are composed in
//! [`crate::step`]; the state dict layout is kiln-core's
//! ([`kiln_core::optim::read_optimizer_state`]).

mod adagrad;
mod adam;
mod clip;
mod data_parallel;
mod rmsprop;
mod sgd;
mod zero;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_core::{
    backend::StepPlan,
    loss::Reduction,
    model::ParamKind,
    module::Module,
    optim::{
        load_group_hypers, optimizer_state_key, read_optimizer_state, resolve_groups,
        save_group_hypers, set_group_learning_rates, GradClip, GroupHyper, Optimizer,
        OptimizerConfig, ParamGroup,
    },
    state_dict::StateDict,
    DType, Error, HostTensor, Result,
};
use tensorflow::{DataType, Operation, OperationDescription, Output, Status};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::engine::{Engine, Var};
use crate::graph::Builder;
use crate::model::{lock, TfModel};
use crate::step::{
    self, CompiledGraph, GradientSource, OptimizerId, ProgramKey, ProgramKind, Signature,
    UpdateRule,
};
use adam::AdamRule;
pub(crate) use data_parallel::hooked_step;
pub use zero::TfShardedOptimizer;

/// One trainable parameter with its optimizer state variables.
#[derive(Debug)]
struct Slot {
    name: String,
    var: Var,
    group: usize,
    /// State variables by PyTorch's names (`exp_avg`, `momentum_buffer`, ...),
    /// as [`OptimizerConfig::state_buffers`] lists them.
    state: Vec<(&'static str, Var)>,
    /// The gradient accumulator, once gradient accumulation is used.
    accum: Option<Var>,
    /// Whether this optimizer updates the parameter and holds its state: all
    /// of them, except on a rank of a ZeRO strategy ([`TfShardedOptimizer`]),
    /// which owns a share.
    owned: bool,
}

/// Placeholders fed with each step's coefficients.
#[derive(Debug)]
struct Coefs {
    /// Per group: learning rate, weight decay, and two the algorithm chooses.
    group: Vec<[Output; 4]>,
    /// Per step: four the algorithm chooses.
    global: [Output; 4],
}

/// What one parameter's update is built from.
pub(super) struct ParamUpdate<'a> {
    slot: &'a Slot,
    /// The parameter's gradient.
    grad: &'a Output,
    /// The parameter's value, read after `after`.
    param: Output,
    /// The ops every update runs after.
    after: &'a [&'a Operation],
    /// The group's coefficients ([`Coefs::group`]).
    group: [Output; 4],
    /// The step's coefficients ([`Coefs::global`]).
    global: [Output; 4],
}

impl ParamUpdate<'_> {
    /// The parameter's variable.
    fn handle(&self) -> &Output {
        &self.slot.var.handle
    }

    /// The state variable `key` (one of the algorithm's buffers).
    fn state(&self, key: &str) -> Result<Output> {
        self.slot
            .state
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.handle.clone())
            .ok_or_else(|| {
                Error::backend(
                    "tensorflow",
                    "building the optimizer",
                    format!("no {key} state for {}", self.slot.name),
                )
            })
    }

    /// PyTorch's coupled L2 penalty: `grad + weight_decay * param`.
    fn coupled(&self, b: &mut Builder) -> Result<Output> {
        let decay = b.mul(&self.group[1], &self.param)?;
        b.add(self.grad, &decay)
    }
}

/// The attributes of TensorFlow's float `ResourceApply*` ops.
fn apply_attrs(nd: &mut OperationDescription<'_>) -> std::result::Result<(), Status> {
    nd.set_attr_type("T", DataType::Float)?;
    nd.set_attr_bool("use_locking", false)?;
    Ok(())
}

/// Identities for optimizers, which share their model's program cache.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// An optimizer whose update is part of its model's TensorFlow graph.
///
/// Built by [`Trainable::build_optimizer`](kiln_core::backend::Trainable::build_optimizer)
/// (or [`TfOptimizer::new`]) over a [`TfModel`]. SGD, Adam, AdamW, RMSprop and
/// Adagrad follow PyTorch's formulas; state dicts use kiln-core's portable
/// layout, the torch backend's, so optimizer state moves between backends in
/// checkpoints.
#[derive(Debug)]
pub struct TfOptimizer {
    id: OptimizerId,
    config: OptimizerConfig,
    groups: Vec<GroupHyper>,
    graph: Arc<Mutex<CompiledGraph>>,
    slots: Vec<Slot>,
    coefs: Coefs,
    /// Steps taken (PyTorch's per-parameter `state["step"]`, equal for all here).
    step: u64,
    /// Whether gradients not yet applied are held (in the accumulators, or in
    /// `local` when training data-parallel).
    pending: bool,
    /// A data-parallel step's gradients of micro-batches that did not apply,
    /// summed on this rank only.
    local: Option<data_parallel::LocalGradients>,
    /// The metrics (a mixture of experts' router losses) of the last
    /// training step's micro-batch, on this rank.
    metrics: Vec<f64>,
}

fn scalar_ph(b: &mut Builder) -> Result<Output> {
    b.placeholder(DataType::Float, Some(&[]))
}

impl TfOptimizer {
    /// An optimizer over `model`'s parameters; `groups` as in the torch backend
    /// (parameters no group selects form a last, default group).
    pub fn new(config: OptimizerConfig, model: &TfModel, groups: &[ParamGroup]) -> Result<Self> {
        Self::with_owned(config, model, groups, &|_| true)
    }

    /// An optimizer over `model`'s parameters that holds state for (and
    /// updates) only the parameters `owned` selects, by index in the model's
    /// order; groups are resolved over every parameter.
    fn with_owned(
        config: OptimizerConfig,
        model: &TfModel,
        groups: &[ParamGroup],
        owned: &dyn Fn(usize) -> bool,
    ) -> Result<Self> {
        config.validate()?;
        let buffers = config.state_buffers();
        let params: Vec<&Var> = model
            .vars
            .iter()
            .filter(|v| v.kind == ParamKind::Parameter)
            .collect();
        let param_names: Vec<String> = params.iter().map(|v| v.name.clone()).collect();
        let (hypers, assignment) = resolve_groups(&config, &param_names, groups)?;
        let graph = Arc::clone(&model.graph);
        let mut guard = lock(&graph)?;
        let engine = &mut guard.engine;
        let mut slots = Vec::with_capacity(params.len());
        let mut inits: Vec<(Var, HostTensor)> = Vec::new();
        for (index, (var, group)) in params.into_iter().zip(assignment).enumerate() {
            let owned = owned(index);
            let mut state = Vec::new();
            for buffer in buffers.iter().filter(|_| owned) {
                let sv = engine.add_var(
                    "optim",
                    &format!("{}.{}", var.name, buffer.name),
                    DType::F32,
                    &var.dims,
                    ParamKind::Buffer,
                )?;
                inits.push((sv.clone(), full(buffer.initial as f32, &var.dims)?));
                state.push((buffer.name, sv));
            }
            slots.push(Slot {
                name: var.name.clone(),
                var: var.clone(),
                group,
                state,
                accum: None,
                owned,
            });
        }
        let saved = engine.b.set_scope("optim/coefficients");
        let coefs = (|| -> Result<Coefs> {
            let b = &mut engine.b;
            let group = (0..hypers.len())
                .map(|_| Ok([scalar_ph(b)?, scalar_ph(b)?, scalar_ph(b)?, scalar_ph(b)?]))
                .collect::<Result<Vec<_>>>()?;
            let global = [scalar_ph(b)?, scalar_ph(b)?, scalar_ph(b)?, scalar_ph(b)?];
            Ok(Coefs { group, global })
        })();
        engine.b.set_scope(&saved);
        let coefs = coefs?;
        let vars: Vec<&Var> = inits.iter().map(|(v, _)| v).collect();
        let values: Vec<&HostTensor> = inits.iter().map(|(_, h)| h).collect();
        engine.write_vars(&vars, &values)?;
        drop(guard);
        Ok(TfOptimizer {
            id: OptimizerId(NEXT_ID.fetch_add(1, Ordering::Relaxed)),
            config,
            groups: hypers,
            graph,
            slots,
            coefs,
            step: 0,
            pending: false,
            local: None,
            metrics: Vec::new(),
        })
    }

    /// The configuration this optimizer runs.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Names of the parameter groups, in order.
    pub fn group_names(&self) -> Vec<String> {
        self.groups.iter().map(|g| g.name.clone()).collect()
    }

    /// Applies `gradients` (by parameter name, as [`TfModel::gradients`] gives
    /// them, computed here or elsewhere, e.g. averaged across processes) in one
    /// session run, clipped first when `clip` is given: `optimizer.step()` after
    /// setting each `param.grad` in PyTorch. A parameter without an entry is not
    /// updated (as PyTorch skips a parameter whose gradient is `None`).
    ///
    /// Every entry is checked before anything changes: it must name one of the
    /// optimizer's parameters and have its shape. Gradients accumulated by
    /// training steps that did not apply them must be applied or zeroed first.
    ///
    /// ```no_run
    /// use kiln_core::{loss::{Loss, Reduction}, model::{Layer, LinearConfig}, optim::{AdamConfig, OptimizerConfig}, Device, HostTensor};
    /// use kiln_tf::{TfModel, TfOptimizer, TfTensor};
    ///
    /// let model = TfModel::new(&Layer::Linear(LinearConfig::new(3, 1)), Device::Cpu)?;
    /// let mut opt = TfOptimizer::new(OptimizerConfig::Adam(AdamConfig::new(1e-2)), &model, &[])?;
    /// let x = TfTensor::from_host(&HostTensor::new(vec![1f32; 6], [2, 3])?)?;
    /// let y = TfTensor::from_host(&HostTensor::new(vec![0f32; 2], [2, 1])?)?;
    /// let mse = Loss::Mse { reduction: Reduction::Mean };
    /// let (_, grads) = model.gradients(&mse, &x, &y)?;
    /// opt.apply_gradients(&grads, None)?;
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn apply_gradients(
        &mut self,
        gradients: &StateDict,
        clip: Option<&GradClip>,
    ) -> Result<()> {
        if self.pending {
            return Err(Error::invalid_argument(
                "gradients",
                "this optimizer holds accumulated gradients not yet applied; call step() or \
                 zero_grad() first",
            ));
        }
        if let Some(clip) = clip {
            clip.validate()?;
        }
        let mut present = vec![false; self.slots.len()];
        let mut values = Vec::with_capacity(gradients.len());
        for (name, host) in gradients.iter() {
            let Some(index) = self.slots.iter().position(|s| &s.name == name) else {
                return Err(Error::invalid_argument(
                    name.as_str(),
                    format!(
                        "not a parameter this optimizer updates ({} parameters)",
                        self.slots.len()
                    ),
                ));
            };
            let slot = &self.slots[index];
            if host.dims() != slot.var.dims.as_slice() {
                return Err(Error::ShapeMismatch {
                    context: format!("gradient of `{name}`"),
                    expected: kiln_core::Shape::new(slot.var.dims.clone()).to_string(),
                    actual: host.shape().to_string(),
                });
            }
            present[index] = true;
            values.push((
                name.clone(),
                TfTensor::from_host(&host.to_dtype(DType::F32))?,
            ));
        }
        let key = ProgramKey {
            kind: ProgramKind::Apply {
                optimizer: self.id,
                source: GradientSource::Fed { present },
                clip: clip.copied(),
            },
            train: false,
            input: None,
            target: None,
        };
        let graph_arc = Arc::clone(&self.graph);
        let mut graph = lock(&graph_arc)?;
        let program = step::program(&mut graph, &key, None, Some(&*self))?;
        let mut feeds = self.coefficient_feeds()?;
        for (name, placeholder) in &program.gradient_feeds {
            let (_, value) = values
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| Error::backend("tensorflow", "applying gradients", "no value"))?;
            feeds.push((placeholder.clone(), value.clone()));
        }
        step::run(
            &mut graph.engine,
            &program,
            None,
            None,
            &feeds,
            "applying gradients",
        )?;
        self.step += 1;
        Ok(())
    }

    /// The coefficients fed to the next update: per group, then global.
    fn coefficients(&self) -> (Vec<[f32; 4]>, [f32; 4]) {
        let t = i32::try_from(self.step + 1).unwrap_or(i32::MAX);
        let group = |f: &dyn Fn(&GroupHyper) -> [f64; 2]| -> Vec<[f32; 4]> {
            self.groups
                .iter()
                .map(|g| {
                    let [a, b] = f(g);
                    [g.lr as f32, g.weight_decay as f32, a as f32, b as f32]
                })
                .collect()
        };
        match &self.config {
            OptimizerConfig::Sgd(c) => (group(&|_| [0.0, 0.0]), sgd::coefficients(c, self.step)),
            OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => match self.adam_rule() {
                Some(rule) => (
                    group(&|g| rule.group_coefficients(g, t)),
                    rule.global_coefficients(t),
                ),
                None => (group(&|_| [0.0, 0.0]), [0.0; 4]),
            },
            OptimizerConfig::Adagrad(c) => {
                (group(&|g| [adagrad::step_size(c, g, t), 0.0]), [0.0; 4])
            }
            _ => (group(&|_| [0.0, 0.0]), [0.0; 4]),
        }
    }

    /// Adam's or AdamW's rule, where the config is one of them.
    fn adam_rule(&self) -> Option<AdamRule> {
        match &self.config {
            OptimizerConfig::Adam(c) => Some(AdamRule {
                betas: c.betas,
                eps: c.eps,
                amsgrad: c.amsgrad,
                coupled: true,
            }),
            OptimizerConfig::AdamW(c) => Some(AdamRule {
                betas: c.betas,
                eps: c.eps,
                amsgrad: c.amsgrad,
                coupled: false,
            }),
            _ => None,
        }
    }

    fn coefficient_feeds(&self) -> Result<Vec<(Output, TfTensor)>> {
        let (per_group, global) = self.coefficients();
        let mut feeds = Vec::new();
        for (phs, values) in self.coefs.group.iter().zip(per_group) {
            for (ph, v) in phs.iter().zip(values) {
                feeds.push((ph.clone(), TfTensor::from_host(&HostTensor::scalar(v))?));
            }
        }
        for (ph, v) in self.coefs.global.iter().zip(global) {
            feeds.push((ph.clone(), TfTensor::from_host(&HostTensor::scalar(v))?));
        }
        Ok(feeds)
    }

    /// One parameter's update ops.
    fn update_one(&self, b: &mut Builder, u: &ParamUpdate<'_>) -> Result<Vec<Operation>> {
        match &self.config {
            OptimizerConfig::Sgd(c) => sgd::update(b, u, c),
            OptimizerConfig::RmsProp(c) => rmsprop::update(b, u, c),
            OptimizerConfig::Adagrad(c) => adagrad::update(b, u, c),
            other => match self.adam_rule() {
                Some(rule) => rule.update(b, u),
                None => Err(Error::unsupported(format!(
                    "optimizer {other:?} on TensorFlow"
                ))),
            },
        }
    }

    /// Creates the gradient accumulators (zeros) on first use.
    fn ensure_accumulators(&mut self, engine: &mut Engine) -> Result<()> {
        if self.slots.iter().all(|s| s.accum.is_some()) {
            return Ok(());
        }
        let mut inits = Vec::new();
        for slot in &mut self.slots {
            let var = engine.add_var(
                "grad",
                &slot.name,
                DType::F32,
                &slot.var.dims,
                ParamKind::Buffer,
            )?;
            inits.push((var.clone(), full(0f32, &slot.var.dims)?));
            slot.accum = Some(var);
        }
        let vars: Vec<&Var> = inits.iter().map(|(v, _)| v).collect();
        let values: Vec<&HostTensor> = inits.iter().map(|(_, h)| h).collect();
        engine.write_vars(&vars, &values)
    }

    /// Runs one training micro-batch on `model` (see
    /// [`Trainable::train_step`](kiln_core::backend::Trainable::train_step)): one
    /// session run. A non-finite loss updates nothing and is returned.
    pub(crate) fn train_step(
        &mut self,
        model: &TfModel,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        self.check_step(model, plan)?;
        if self.local.is_some() {
            return Err(Error::invalid_argument(
                "optimizer",
                "this optimizer holds a data-parallel step's gradients; call zero_grad() first",
            ));
        }
        let graph_arc = Arc::clone(&self.graph);
        let mut graph = lock(&graph_arc)?;
        if !plan.apply {
            self.ensure_accumulators(&mut graph.engine)?;
        }
        let key = ProgramKey {
            kind: ProgramKind::Train {
                optimizer: self.id,
                loss: plan.loss.clone(),
                apply: plan.apply,
                clip: plan.clip.copied(),
                accumulators: self.slots.iter().any(|s| s.accum.is_some()),
            },
            train: Module::<TfBackend>::mode(model).is_train(),
            input: Some(Signature::of(inputs)),
            target: Some(Signature::of(targets)),
        };
        let batch = inputs.shape();
        let program = step::program(
            &mut graph,
            &key,
            Some(model.model_graph(batch.dims())),
            Some(&*self),
        )?;
        let mut feeds = self.coefficient_feeds()?;
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
            "running the training step",
        )?;
        if fetched.applied {
            if plan.apply {
                self.step += 1;
                self.pending = false;
            } else {
                self.pending = true;
            }
        }
        self.metrics = std::mem::take(&mut fetched.metrics);
        fetched.loss_value()
    }

    /// The metrics of the last training step's micro-batch (a mixture of
    /// experts' unweighted `aux_loss` and `router_z_loss`), taken.
    pub(crate) fn take_metrics(&mut self) -> Vec<f64> {
        std::mem::take(&mut self.metrics)
    }

    /// The parameters this optimizer updates and holds state for.
    fn owned_slots(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().filter(|s| s.owned)
    }

    /// Checks that a training step on `model` with `plan` can run.
    fn check_step(&self, model: &TfModel, plan: &StepPlan<'_>) -> Result<()> {
        if !Arc::ptr_eq(&self.graph, &model.graph) {
            return Err(Error::invalid_argument(
                "optimizer",
                "this optimizer was built for another model",
            ));
        }
        if matches!(plan.loss.reduction(), Reduction::None) {
            return Err(Error::invalid_argument(
                "loss",
                "training needs a scalar loss; reduction `none` gives one value per element",
            ));
        }
        Ok(())
    }

    /// Runs this optimizer's program of `kind` (no feeds but the coefficients).
    fn run_own(&self, kind: ProgramKind, context: &str) -> Result<()> {
        let key = ProgramKey {
            kind,
            train: false,
            input: None,
            target: None,
        };
        let mut graph = lock(&self.graph)?;
        let program = step::program(&mut graph, &key, None, Some(self))?;
        let feeds = self.coefficient_feeds()?;
        step::run(&mut graph.engine, &program, None, None, &feeds, context)?;
        Ok(())
    }
}

impl UpdateRule for TfOptimizer {
    fn parameters(&self) -> Vec<(&str, &[usize], Option<&Var>)> {
        self.slots
            .iter()
            .map(|s| (s.name.as_str(), s.var.dims.as_slice(), s.accum.as_ref()))
            .collect()
    }

    fn update_ops(
        &self,
        b: &mut Builder,
        grads: &[Option<Output>],
        after: &[&Operation],
    ) -> Result<Vec<Operation>> {
        let mut ops = Vec::new();
        for (slot, grad) in self.slots.iter().zip(grads) {
            // PyTorch skips parameters that received no gradient.
            let Some(grad) = grad else { continue };
            if !slot.owned {
                return Err(Error::backend(
                    "tensorflow",
                    "building the optimizer's update",
                    format!(
                        "`{}` has a gradient, but this rank's optimizer does not own it",
                        slot.name
                    ),
                ));
            }
            let saved = b.set_scope(&format!("optim/{}", slot.name));
            let result = (|| {
                let update = ParamUpdate {
                    slot,
                    grad,
                    param: b.read_after(&slot.var.handle, DataType::Float, after)?,
                    after,
                    group: self.coefs.group[slot.group].clone(),
                    global: self.coefs.global.clone(),
                };
                self.update_one(b, &update)
            })();
            b.set_scope(&saved);
            ops.extend(result?);
        }
        Ok(ops)
    }

    fn clip(
        &self,
        b: &mut Builder,
        grads: Vec<Option<Output>>,
        clip: &GradClip,
    ) -> Result<Vec<Option<Output>>> {
        clip::clip_gradients(b, grads, clip)
    }
}

/// A float32 tensor of `dims` filled with `value`.
fn full(value: f32, dims: &[usize]) -> Result<HostTensor> {
    HostTensor::new(vec![value; dims.iter().product()], dims.to_vec())
}

impl Optimizer<TfBackend> for TfOptimizer {
    /// Applies the gradients accumulated by training micro-batches that did not
    /// apply them (a no-op when there are none, as PyTorch skips parameters
    /// without gradients). [`Trainable::train_step`](kiln_core::backend::Trainable::train_step)
    /// normally applies the update in the same run that computes the gradients.
    ///
    /// Data-parallel, the gradients accumulated on this rank are first averaged
    /// over the ranks (one all-reduce): every rank must call it.
    fn step(&mut self) -> Result<()> {
        if !self.pending {
            return Ok(());
        }
        if let Some(local) = self.local.take() {
            self.pending = false;
            return self.apply_local(local);
        }
        let kind = ProgramKind::Apply {
            optimizer: self.id,
            source: GradientSource::Accumulated,
            clip: None,
        };
        self.run_own(kind, "applying accumulated gradients")?;
        self.step += 1;
        self.pending = false;
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        if !self.pending {
            return Ok(());
        }
        if self.local.take().is_some() {
            self.pending = false;
            return Ok(());
        }
        let kind = ProgramKind::ZeroAccumulators { optimizer: self.id };
        self.run_own(kind, "zeroing gradients")?;
        self.pending = false;
        Ok(())
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
        Ok(())
    }

    fn learning_rates(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.lr).collect()
    }

    fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        set_group_learning_rates(&mut self.groups, lrs)
    }

    /// kiln-core's portable layout ([`kiln_core::optim::read_optimizer_state`]):
    /// `state.<param>.step`, `state.<param>.<buffer>` (once a step was taken, as
    /// PyTorch creates state lazily), and `group.<i>.lr` / `group.<i>.weight_decay`.
    fn state_dict(&self) -> Result<StateDict> {
        let mut out = StateDict::new();
        let state_vars: Vec<Var> = self
            .owned_slots()
            .flat_map(|s| s.state.iter().map(|(_, v)| v.clone()))
            .collect();
        let values = if self.step > 0 {
            lock(&self.graph)?.engine.read_vars(&state_vars)?
        } else {
            Vec::new()
        };
        let mut values = values.into_iter();
        for slot in self.owned_slots() {
            out.insert(
                optimizer_state_key(&slot.name, "step"),
                HostTensor::scalar(self.step as i64),
            );
            for (key, _) in &slot.state {
                if let Some(value) = values.next() {
                    out.insert(optimizer_state_key(&slot.name, key), value);
                }
            }
        }
        save_group_hypers(&self.groups, &mut out);
        Ok(out)
    }

    /// All or nothing: kiln-core checks the whole state first; buffers not in
    /// it (not created yet) start from their initial values.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let params: Vec<(&str, &[usize])> = self
            .owned_slots()
            .map(|s| (s.name.as_str(), s.var.dims.as_slice()))
            .collect();
        let loaded = read_optimizer_state(&self.config, &params, state)?;
        let mut step: Option<u64> = None;
        for (slot, read) in self.owned_slots().zip(&loaded) {
            match step {
                None => step = Some(read.step),
                Some(prev) if prev != read.step => {
                    return Err(Error::unsupported(format!(
                        "optimizer state with different step counts per parameter ({} has {}, \
                         others {prev}) on TensorFlow",
                        slot.name, read.step
                    )))
                }
                Some(_) => {}
            }
        }
        let buffers = self.config.state_buffers();
        let mut writes: Vec<(&Var, HostTensor)> = Vec::new();
        for (slot, mut read) in self.owned_slots().zip(loaded) {
            for (name, var) in &slot.state {
                let value = match read.buffers.remove(name) {
                    Some(host) => host.to_dtype(DType::F32),
                    None => {
                        let initial = buffers
                            .iter()
                            .find(|b| b.name == *name)
                            .map_or(0.0, |b| b.initial);
                        full(initial as f32, &var.dims)?
                    }
                };
                writes.push((var, value));
            }
        }
        let groups = load_group_hypers(&self.groups, state);
        let vars: Vec<&Var> = writes.iter().map(|(v, _)| *v).collect();
        let values: Vec<&HostTensor> = writes.iter().map(|(_, h)| h).collect();
        lock(&self.graph)?.engine.write_vars(&vars, &values)?;
        self.step = step.unwrap_or(0);
        self.groups = groups;
        Ok(())
    }
}
