//! [`TfOptimizer`]: PyTorch's update rules as TensorFlow apply ops, and the
//! training step compiled into one graph program (forward, loss, gradients,
//! clipping, update) that runs as one session run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kiln_core::{
    load_group_hypers, resolve_groups, save_group_hypers, set_group_learning_rates, AdamConfig,
    AdamWConfig, DType, Error, GradClip, GroupHyper, HostTensor, Loss, Module, Optimizer,
    OptimizerConfig, ParamGroup, ParamKind, Reduction, Result, StateDict, StepPlan,
};
use tensorflow::{DataType, Operation, Output};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::engine::{seed_tensor, Engine, Var};
use crate::graph::Builder;
use crate::layers::add_updates;
use crate::model::{build_forward, lock, TfModel};

/// The assertion message that marks a non-finite loss.
const NON_FINITE: &str = "kiln: non-finite loss";

/// One trainable parameter with its optimizer state variables.
#[derive(Debug)]
struct Slot {
    name: String,
    var: Var,
    group: usize,
    /// State variables by PyTorch's names (`exp_avg`, `momentum_buffer`, ...).
    state: Vec<(&'static str, Var)>,
    /// The gradient accumulator, once gradient accumulation is used.
    accum: Option<Var>,
}

/// Placeholders fed with each step's coefficients.
#[derive(Debug)]
struct Coefs {
    /// Per group: learning rate, weight decay, and two optimizer-specific values.
    group: Vec<[Output; 4]>,
    /// Per step: four optimizer-specific values.
    global: [Output; 4],
}

/// A compiled program: the training step for one (input, target, loss, plan) shape.
#[derive(Debug)]
struct Program {
    input: Option<Output>,
    target: Option<Output>,
    seed: Option<Output>,
    scale: Option<Output>,
    loss: Option<Output>,
    run: Operation,
}

/// An optimizer whose update is part of its model's TensorFlow graph.
///
/// Built by [`TrainBackend::build_optimizer`](kiln_core::TrainBackend::build_optimizer)
/// (or [`TfOptimizer::new`]) over a [`TfModel`]. SGD, Adam, AdamW, RMSprop and
/// Adagrad follow PyTorch's formulas; state dicts use the same names as the torch
/// backend's, so optimizer state moves between backends in checkpoints.
#[derive(Debug)]
pub struct TfOptimizer {
    config: OptimizerConfig,
    groups: Vec<GroupHyper>,
    engine: Arc<Mutex<Engine>>,
    slots: Vec<Slot>,
    coefs: Coefs,
    /// Steps taken (PyTorch's per-parameter `state["step"]`, equal for all here).
    step: u64,
    programs: HashMap<String, Program>,
    /// Whether accumulators hold gradients not yet applied.
    pending: bool,
}

fn scalar_ph(b: &mut Builder) -> Result<Output> {
    b.placeholder(DataType::Float, Some(&[]))
}

/// The initial value of a state variable.
fn state_init(config: &OptimizerConfig, key: &str) -> f64 {
    match (config, key) {
        (OptimizerConfig::Adagrad(c), "sum") => c.initial_accumulator_value,
        _ => 0.0,
    }
}

/// The state variables PyTorch keeps per parameter for `config`.
fn state_names(config: &OptimizerConfig) -> Result<Vec<&'static str>> {
    Ok(match config {
        OptimizerConfig::Sgd(c) if c.momentum != 0.0 => vec!["momentum_buffer"],
        OptimizerConfig::Sgd(_) => vec![],
        OptimizerConfig::Adam(c) if c.amsgrad => vec!["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
        OptimizerConfig::AdamW(c) if c.amsgrad => vec!["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
        OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => vec!["exp_avg", "exp_avg_sq"],
        OptimizerConfig::RmsProp(c) => {
            let mut v = vec!["square_avg"];
            if c.momentum > 0.0 {
                v.push("momentum_buffer");
            }
            if c.centered {
                v.push("grad_avg");
            }
            v
        }
        OptimizerConfig::Adagrad(_) => vec!["sum"],
        other => {
            return Err(Error::unsupported(format!(
                "optimizer {other:?} on TensorFlow"
            )))
        }
    })
}

impl TfOptimizer {
    /// An optimizer over `model`'s parameters; `groups` as in the torch backend
    /// (parameters no group selects form a last, default group).
    pub fn new(config: OptimizerConfig, model: &TfModel, groups: &[ParamGroup]) -> Result<Self> {
        config.validate()?;
        let names = state_names(&config)?;
        let params: Vec<&Var> = model
            .vars
            .iter()
            .filter(|v| v.kind == ParamKind::Parameter)
            .collect();
        let param_names: Vec<String> = params.iter().map(|v| v.name.clone()).collect();
        let (hypers, assignment) = resolve_groups(&config, &param_names, groups)?;
        let engine = Arc::clone(&model.engine);
        let mut guard = lock(&engine)?;
        let mut slots = Vec::with_capacity(params.len());
        let mut inits: Vec<(Var, HostTensor)> = Vec::new();
        for (var, group) in params.into_iter().zip(assignment) {
            let mut state = Vec::new();
            for key in &names {
                let sv = guard.add_var(
                    "optim",
                    &format!("{}.{key}", var.name),
                    DType::F32,
                    &var.dims,
                    ParamKind::Buffer,
                )?;
                let init = full(state_init(&config, key) as f32, &var.dims)?;
                inits.push((sv.clone(), init));
                state.push((*key, sv));
            }
            slots.push(Slot {
                name: var.name.clone(),
                var: var.clone(),
                group,
                state,
                accum: None,
            });
        }
        let saved = guard.b.set_scope("optim/coefficients");
        let coefs = (|| -> Result<Coefs> {
            let b = &mut guard.b;
            let group = (0..hypers.len())
                .map(|_| Ok([scalar_ph(b)?, scalar_ph(b)?, scalar_ph(b)?, scalar_ph(b)?]))
                .collect::<Result<Vec<_>>>()?;
            let global = [scalar_ph(b)?, scalar_ph(b)?, scalar_ph(b)?, scalar_ph(b)?];
            Ok(Coefs { group, global })
        })();
        guard.b.set_scope(&saved);
        let coefs = coefs?;
        let vars: Vec<&Var> = inits.iter().map(|(v, _)| v).collect();
        let values: Vec<&HostTensor> = inits.iter().map(|(_, h)| h).collect();
        guard.write_vars(&vars, &values)?;
        drop(guard);
        Ok(TfOptimizer {
            config,
            groups: hypers,
            engine,
            slots,
            coefs,
            step: 0,
            programs: HashMap::new(),
            pending: false,
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

    /// The coefficients fed to the next update: per group, then global.
    fn coefficients(&self) -> (Vec<[f32; 4]>, [f32; 4]) {
        let t = (self.step + 1) as i32;
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
            OptimizerConfig::Sgd(c) => {
                let first = self.step == 0;
                // buf = m_eff * buf + d_eff * d_p; the first step copies d_p.
                let (m_eff, d_eff) = if first {
                    (0.0, 1.0)
                } else {
                    (c.momentum, 1.0 - c.dampening)
                };
                (
                    group(&|_| [0.0, 0.0]),
                    [m_eff as f32, d_eff as f32, 0.0, 0.0],
                )
            }
            OptimizerConfig::Adam(AdamConfig { betas, eps, .. })
            | OptimizerConfig::AdamW(AdamWConfig { betas, eps, .. }) => {
                // step_size = lr / (1 - beta1^t); AdamW's decay factor 1 - lr * wd.
                let bc1 = 1.0 - betas.0.powi(t);
                let bc2 = 1.0 - betas.1.powi(t);
                (
                    group(&|g| [g.lr / bc1, 1.0 - g.lr * g.weight_decay]),
                    [
                        betas.0.powi(t) as f32,
                        betas.1.powi(t) as f32,
                        (eps * bc2.sqrt()) as f32,
                        bc2.sqrt() as f32,
                    ],
                )
            }
            OptimizerConfig::Adagrad(c) => {
                let decay = 1.0 + (t as f64 - 1.0) * c.lr_decay;
                (group(&|g| [g.lr / decay, 0.0]), [0.0; 4])
            }
            _ => (group(&|_| [0.0, 0.0]), [0.0; 4]),
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

    /// Adds the update ops of every parameter, given its gradient (or `None`).
    fn add_update_ops(
        &self,
        b: &mut Builder,
        grads: &[Option<Output>],
        after: &[&Operation],
    ) -> Result<Vec<Operation>> {
        let mut ops = Vec::new();
        for (slot, grad) in self.slots.iter().zip(grads) {
            // PyTorch skips parameters that received no gradient.
            let Some(grad) = grad else { continue };
            let saved = b.set_scope(&format!("optim/{}", slot.name));
            let result = self.update_one(b, slot, grad, after);
            b.set_scope(&saved);
            ops.extend(result?);
        }
        Ok(ops)
    }

    fn state_handle(slot: &Slot, key: &str) -> Result<Output> {
        slot.state
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.handle.clone())
            .ok_or_else(|| {
                Error::backend(
                    "tensorflow",
                    "building the optimizer",
                    format!("no {key} state for {}", slot.name),
                )
            })
    }

    fn update_one(
        &self,
        b: &mut Builder,
        slot: &Slot,
        grad: &Output,
        after: &[&Operation],
    ) -> Result<Vec<Operation>> {
        let [lr, wd, ga, _gb] = self.coefs.group[slot.group].clone();
        let [c0, c1, _, _] = self.coefs.global.clone();
        let p = &slot.var.handle;
        let param = b.read_after(p, DataType::Float, after)?;
        let float = |nd: &mut tensorflow::OperationDescription<'_>| -> std::result::Result<(), tensorflow::Status> {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_bool("use_locking", false)?;
            Ok(())
        };
        // PyTorch's coupled L2 penalty: grad + weight_decay * param.
        let coupled = |b: &mut Builder| -> Result<Output> {
            let decay = b.mul(&wd, &param)?;
            b.add(grad, &decay)
        };
        let mut ops = Vec::new();
        match &self.config {
            OptimizerConfig::Sgd(c) => {
                let d_p = coupled(b)?;
                if c.momentum == 0.0 {
                    ops.push(b.op_with(
                        "ResourceApplyGradientDescent",
                        &[p, &lr, &d_p],
                        after,
                        &float,
                    )?);
                } else if c.dampening == 0.0 {
                    // TensorFlow's momentum update is PyTorch's when dampening is 0
                    // (its first step also leaves buf = d_p).
                    let buf = Self::state_handle(slot, "momentum_buffer")?;
                    let m = b.scalar(c.momentum as f32)?;
                    let nesterov = c.nesterov;
                    ops.push(b.op_with(
                        "ResourceApplyMomentum",
                        &[p, &buf, &lr, &d_p, &m],
                        after,
                        &|nd| {
                            float(nd)?;
                            nd.set_attr_bool("use_nesterov", nesterov)?;
                            Ok(())
                        },
                    )?);
                } else {
                    let buf_h = Self::state_handle(slot, "momentum_buffer")?;
                    let buf = b.read_after(&buf_h, DataType::Float, after)?;
                    let kept = b.mul(&buf, &c0)?;
                    let fresh = b.mul(&d_p, &c1)?;
                    let buf_new = b.add(&kept, &fresh)?;
                    ops.push(b.assign(&buf_h, &buf_new, DataType::Float, after)?);
                    let update = if c.nesterov {
                        let m = b.mul_scalar(&buf_new, c.momentum as f32)?;
                        b.add(&d_p, &m)?
                    } else {
                        buf_new
                    };
                    ops.push(b.op_with(
                        "ResourceApplyGradientDescent",
                        &[p, &lr, &update],
                        after,
                        &float,
                    )?);
                }
            }
            OptimizerConfig::Adam(c) => {
                ops.extend(self.adam(b, slot, grad, &param, after, c.betas, c.amsgrad, true)?)
            }
            OptimizerConfig::AdamW(c) => {
                ops.extend(self.adam(b, slot, grad, &param, after, c.betas, c.amsgrad, false)?)
            }
            OptimizerConfig::RmsProp(c) => {
                let g = coupled(b)?;
                let sa_h = Self::state_handle(slot, "square_avg")?;
                let sa = b.read_after(&sa_h, DataType::Float, after)?;
                let kept = b.mul_scalar(&sa, c.alpha as f32)?;
                let g2 = b.mul_scalar(&g, (1.0 - c.alpha) as f32)?;
                let g2 = b.mul(&g2, &g)?;
                let sa_new = b.add(&kept, &g2)?;
                ops.push(b.assign(&sa_h, &sa_new, DataType::Float, after)?);
                let avg = if c.centered {
                    let ga_h = Self::state_handle(slot, "grad_avg")?;
                    let ga = b.read_after(&ga_h, DataType::Float, after)?;
                    let diff = b.sub(&g, &ga)?;
                    let step = b.mul_scalar(&diff, (1.0 - c.alpha) as f32)?;
                    let ga_new = b.add(&ga, &step)?;
                    ops.push(b.assign(&ga_h, &ga_new, DataType::Float, after)?);
                    let neg = b.mul_scalar(&ga_new, -1.0)?;
                    let sq = b.mul(&neg, &ga_new)?;
                    let var = b.add(&sa_new, &sq)?;
                    b.unary("Sqrt", &var)?
                } else {
                    b.unary("Sqrt", &sa_new)?
                };
                let avg = b.add_scalar(&avg, c.eps as f32)?;
                let ratio = b.div(&g, &avg)?;
                let update = if c.momentum > 0.0 {
                    let buf_h = Self::state_handle(slot, "momentum_buffer")?;
                    let buf = b.read_after(&buf_h, DataType::Float, after)?;
                    let kept = b.mul_scalar(&buf, c.momentum as f32)?;
                    let buf_new = b.add(&kept, &ratio)?;
                    ops.push(b.assign(&buf_h, &buf_new, DataType::Float, after)?);
                    buf_new
                } else {
                    ratio
                };
                ops.push(b.op_with(
                    "ResourceApplyGradientDescent",
                    &[p, &lr, &update],
                    after,
                    &float,
                )?);
            }
            OptimizerConfig::Adagrad(c) => {
                let g = coupled(b)?;
                let sum = Self::state_handle(slot, "sum")?;
                let eps = b.scalar(c.eps as f32)?;
                ops.push(b.op_with(
                    "ResourceApplyAdagradV2",
                    &[p, &sum, &ga, &eps, &g],
                    after,
                    &|nd| {
                        float(nd)?;
                        nd.set_attr_bool("update_slots", true)?;
                        Ok(())
                    },
                )?);
            }
            other => {
                return Err(Error::unsupported(format!(
                    "optimizer {other:?} on TensorFlow"
                )))
            }
        }
        Ok(ops)
    }

    /// Adam / AdamW. Without AMSGrad this is TensorFlow's `ResourceApplyAdam`
    /// fed `epsilon * sqrt(1 - beta2^t)`, which makes its update PyTorch's
    /// `lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + epsilon)`.
    #[allow(clippy::too_many_arguments)]
    fn adam(
        &self,
        b: &mut Builder,
        slot: &Slot,
        grad: &Output,
        param: &Output,
        after: &[&Operation],
        betas: (f64, f64),
        amsgrad: bool,
        coupled: bool,
    ) -> Result<Vec<Operation>> {
        let [lr, wd, step_size, decay_factor] = self.coefs.group[slot.group].clone();
        let [beta1_power, beta2_power, eps_hat, bc2_sqrt] = self.coefs.global.clone();
        let p = &slot.var.handle;
        let mut ops = Vec::new();
        let mut deps: Vec<Operation> = after.iter().map(|o| (*o).clone()).collect();
        let g = if coupled {
            let decay = b.mul(&wd, param)?;
            b.add(grad, &decay)?
        } else {
            grad.clone()
        };
        // AdamW: param *= 1 - lr * weight_decay, before the Adam update.
        let base = if coupled {
            param.clone()
        } else {
            let decayed = b.mul(param, &decay_factor)?;
            if !amsgrad {
                let dep_refs: Vec<&Operation> = deps.iter().collect();
                let assign = b.assign(p, &decayed, DataType::Float, &dep_refs)?;
                deps.push(assign.clone());
                ops.push(assign);
            }
            decayed
        };
        let dep_refs: Vec<&Operation> = deps.iter().collect();
        let m = Self::state_handle(slot, "exp_avg")?;
        let v = Self::state_handle(slot, "exp_avg_sq")?;
        if !amsgrad {
            let b1 = b.scalar(betas.0 as f32)?;
            let b2 = b.scalar(betas.1 as f32)?;
            ops.push(b.op_with(
                "ResourceApplyAdam",
                &[
                    p,
                    &m,
                    &v,
                    &beta1_power,
                    &beta2_power,
                    &lr,
                    &b1,
                    &b2,
                    &eps_hat,
                    &g,
                ],
                &dep_refs,
                &|nd| {
                    nd.set_attr_type("T", DataType::Float)?;
                    nd.set_attr_bool("use_locking", false)?;
                    nd.set_attr_bool("use_nesterov", false)?;
                    Ok(())
                },
            )?);
            return Ok(ops);
        }
        // AMSGrad, composed: TensorFlow has no apply op for it.
        let m_old = b.read_after(&m, DataType::Float, &dep_refs)?;
        let diff = b.sub(&g, &m_old)?;
        let step = b.mul_scalar(&diff, (1.0 - betas.0) as f32)?;
        let m_new = b.add(&m_old, &step)?;
        let v_old = b.read_after(&v, DataType::Float, &dep_refs)?;
        let kept = b.mul_scalar(&v_old, betas.1 as f32)?;
        let g2 = b.mul_scalar(&g, (1.0 - betas.1) as f32)?;
        let g2 = b.mul(&g2, &g)?;
        let v_new = b.add(&kept, &g2)?;
        let vmax_h = Self::state_handle(slot, "max_exp_avg_sq")?;
        let vmax = b.read_after(&vmax_h, DataType::Float, &dep_refs)?;
        let vmax_new = b.maximum(&vmax, &v_new)?;
        let denom = b.unary("Sqrt", &vmax_new)?;
        let denom = b.div(&denom, &bc2_sqrt)?;
        let eps = match &self.config {
            OptimizerConfig::Adam(c) => c.eps,
            OptimizerConfig::AdamW(c) => c.eps,
            _ => 1e-8,
        };
        let denom = b.add_scalar(&denom, eps as f32)?;
        let ratio = b.div(&m_new, &denom)?;
        let neg = b.mul_scalar(&step_size, -1.0)?;
        let delta = b.mul(&ratio, &neg)?;
        let p_new = b.add(&base, &delta)?;
        for (h, value) in [
            (&m, &m_new),
            (&v, &v_new),
            (&vmax_h, &vmax_new),
            (p, &p_new),
        ] {
            ops.push(b.assign(h, value, DataType::Float, &dep_refs)?);
        }
        Ok(ops)
    }

    /// Clips `grads` in the graph as `torch.nn.utils.clip_grad_*_` would.
    fn clip(
        b: &mut Builder,
        grads: Vec<Option<Output>>,
        clip: &GradClip,
    ) -> Result<Vec<Option<Output>>> {
        match clip {
            GradClip::Value { clip_value } => grads
                .into_iter()
                .map(|g| {
                    g.map(|g| {
                        let hi = b.scalar(*clip_value as f32)?;
                        let lo = b.scalar(-*clip_value as f32)?;
                        let g = b.minimum(&g, &hi)?;
                        b.maximum(&g, &lo)
                    })
                    .transpose()
                })
                .collect(),
            GradClip::Norm {
                max_norm,
                norm_type,
            } => {
                let mut norms = Vec::new();
                for g in &grads {
                    let Some(g) = g else { continue };
                    let flat = b.reshape(g, &[-1], DataType::Float)?;
                    let abs = b.unary("Abs", &flat)?;
                    let norm = if norm_type.is_infinite() {
                        b.reduce("Max", &abs, &[0], false)?
                    } else if *norm_type == 2.0 {
                        let sq = b.mul(&flat, &flat)?;
                        b.reduce("Sum", &sq, &[0], false)?
                    } else {
                        let p = b.scalar(*norm_type as f32)?;
                        let pw = b.op("Pow", &[&abs, &p], &|nd| {
                            nd.set_attr_type("T", DataType::Float)?;
                            Ok(())
                        })?;
                        b.reduce("Sum", &pw, &[0], false)?
                    };
                    norms.push(norm);
                }
                if norms.is_empty() {
                    return Ok(grads);
                }
                let parts = norms
                    .iter()
                    .map(|n| b.reshape(n, &[1], DataType::Float))
                    .collect::<Result<Vec<_>>>()?;
                let all = b.concat(&parts, 0)?;
                let total = if norm_type.is_infinite() {
                    b.reduce("Max", &all, &[0], false)?
                } else {
                    let sum = b.reduce("Sum", &all, &[0], false)?;
                    if *norm_type == 2.0 {
                        b.unary("Sqrt", &sum)?
                    } else {
                        let inv = b.scalar((1.0 / norm_type) as f32)?;
                        b.op("Pow", &[&sum, &inv], &|nd| {
                            nd.set_attr_type("T", DataType::Float)?;
                            Ok(())
                        })?
                    }
                };
                let denom = b.add_scalar(&total, 1e-6)?;
                let max = b.scalar(*max_norm as f32)?;
                let coef = b.div(&max, &denom)?;
                let one = b.scalar(1.0)?;
                let coef = b.minimum(&coef, &one)?;
                grads
                    .into_iter()
                    .map(|g| g.map(|g| b.mul(&g, &coef)).transpose())
                    .collect()
            }
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

    /// The ops that zero the accumulators after `after`.
    fn zero_accumulators(&self, b: &mut Builder, after: &[&Operation]) -> Result<Vec<Operation>> {
        let mut ops = Vec::new();
        for slot in &self.slots {
            if let Some(acc) = &slot.accum {
                let read = b.read_after(&acc.handle, DataType::Float, after)?;
                let zero = b.op("ZerosLike", &[&read], &|nd| {
                    nd.set_attr_type("T", DataType::Float)?;
                    Ok(())
                })?;
                ops.push(b.assign(&acc.handle, &zero, DataType::Float, after)?);
            }
        }
        Ok(ops)
    }

    /// Runs one training micro-batch on `model` (see
    /// [`TrainBackend::train_step`](kiln_core::TrainBackend::train_step)): one session run.
    pub(crate) fn train_step(
        &mut self,
        model: &TfModel,
        inputs: &TfTensor,
        targets: &TfTensor,
        plan: &StepPlan<'_>,
    ) -> Result<f64> {
        let (loss, scale, apply, clip) = (plan.loss, plan.scale, plan.apply, plan.clip);
        if !Arc::ptr_eq(&self.engine, &model.engine) {
            return Err(Error::invalid_argument(
                "optimizer",
                "this optimizer was built for another model",
            ));
        }
        if matches!(loss.reduction(), Reduction::None) {
            return Err(Error::invalid_argument(
                "loss",
                "training needs a scalar loss; reduction `none` gives one value per element",
            ));
        }
        let engine_arc = Arc::clone(&self.engine);
        let mut engine = lock(&engine_arc)?;
        if !apply {
            self.ensure_accumulators(&mut engine)?;
        }
        let train = Module::<TfBackend>::mode(model).is_train();
        let has_accum = self.slots.iter().any(|s| s.accum.is_some());
        let key = format!(
            "{train}|{:?}|{}|{:?}|{}|{loss:?}|{apply}|{clip:?}|{has_accum}",
            inputs.shape().dims().get(1..),
            inputs.dtype(),
            targets.shape().dims().get(1..),
            targets.dtype(),
        );
        if !self.programs.contains_key(&key) {
            // Validate shapes with the definition's own error messages first.
            model.forward_program(&mut engine, inputs, train)?;
            let program = self.build_step(
                &mut engine,
                model,
                inputs,
                targets,
                loss,
                apply,
                clip,
                train,
            )?;
            self.programs.insert(key.clone(), program);
        }
        let program = self
            .programs
            .get(&key)
            .ok_or_else(|| Error::backend("tensorflow", "training step", "program missing"))?;
        // Small per-step values are owned here; the batch is fed by reference (no copy).
        let mut owned: Vec<(Output, TfTensor)> = self.coefficient_feeds()?;
        if let Some(ph) = &program.seed {
            owned.push((ph.clone(), seed_tensor()?));
        }
        if let Some(ph) = &program.scale {
            owned.push((
                ph.clone(),
                TfTensor::from_host(&HostTensor::scalar(scale as f32))?,
            ));
        }
        let mut feed_refs: Vec<(&Output, &TfTensor)> = owned.iter().map(|(o, t)| (o, t)).collect();
        if let Some(ph) = &program.input {
            feed_refs.push((ph, inputs));
        }
        if let Some(ph) = &program.target {
            feed_refs.push((ph, targets));
        }
        let loss_out = program
            .loss
            .clone()
            .ok_or_else(|| Error::backend("tensorflow", "training step", "no loss output"))?;
        let result = engine.run(
            &feed_refs,
            &[(&loss_out, DataType::Float)],
            &[&program.run],
            "running the training step",
        );
        match result {
            Ok(values) => {
                if apply {
                    self.step += 1;
                    self.pending = false;
                } else {
                    self.pending = true;
                }
                let value = values
                    .first()
                    .map(|t| {
                        t.to_host()
                            .map(|h| h.to_f64_vec().first().copied().unwrap_or(f64::NAN))
                    })
                    .transpose()?
                    .unwrap_or(f64::NAN);
                Ok(value)
            }
            Err(e) if e.display_chain().to_string().contains(NON_FINITE) => {
                // Nothing was applied; report the loss itself (one more run, forward only).
                let values = engine.run(
                    &feed_refs,
                    &[(&loss_out, DataType::Float)],
                    &[],
                    "evaluating a non-finite loss",
                )?;
                Ok(values
                    .first()
                    .and_then(|t| t.to_host().ok())
                    .and_then(|h| h.to_f64_vec().first().copied())
                    .unwrap_or(f64::NAN))
            }
            Err(e) => Err(e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn build_step(
        &self,
        engine: &mut Engine,
        model: &TfModel,
        inputs: &TfTensor,
        targets: &TfTensor,
        loss: &Loss,
        apply: bool,
        clip: Option<&GradClip>,
        train: bool,
    ) -> Result<Program> {
        let sample: Vec<i64> = inputs
            .shape()
            .dims()
            .iter()
            .skip(1)
            .map(|&d| d as i64)
            .collect();
        let forward = build_forward(
            engine,
            model.spec(),
            &model.handles(),
            &sample,
            inputs.data_type(),
            train,
        )?;
        let b = &mut engine.b;
        let saved = b.set_scope("train_step");
        let result = (|| -> Result<Program> {
            let mut tdims = vec![-1i64];
            tdims.extend(targets.shape().dims().iter().skip(1).map(|&d| d as i64));
            let target = b.placeholder(targets.data_type(), Some(&tdims))?;
            let mut odims = vec![-1i64];
            odims.extend(&forward.output_dims);
            let loss_out = crate::loss::build_loss(
                b,
                loss,
                &forward.output,
                &odims,
                &target,
                targets.dtype(),
                &tdims,
            )?;
            let scale = scalar_ph(b)?;
            let scaled = b.mul(&loss_out, &scale)?;
            let xs: Vec<Option<Output>> = self
                .slots
                .iter()
                .map(|s| forward.reads.get(&s.name).cloned())
                .collect();
            let present: Vec<Output> = xs.iter().flatten().cloned().collect();
            let mut found = b.gradients(&scaled, &present)?.into_iter();
            let grads: Vec<Option<Output>> = xs
                .iter()
                .map(|x| x.as_ref().and_then(|_| found.next().flatten()))
                .collect();
            let finite = b.all_finite(&loss_out, 0)?;
            let guard = b.assert(&finite, NON_FINITE)?;
            let mut ops = add_updates(b, &forward.updates, &[&guard])?;
            if apply {
                // Add what earlier micro-batches accumulated.
                let mut totals = Vec::with_capacity(grads.len());
                for (slot, g) in self.slots.iter().zip(grads) {
                    totals.push(match (g, &slot.accum) {
                        (Some(g), Some(acc)) => {
                            let prev = b.read(&acc.handle, DataType::Float)?;
                            Some(b.add(&prev, &g)?)
                        }
                        (g, _) => g,
                    });
                }
                let totals = match clip {
                    Some(clip) => Self::clip(b, totals, clip)?,
                    None => totals,
                };
                let updates = self.add_update_ops(b, &totals, &[&guard])?;
                let refs: Vec<&Operation> = updates.iter().collect();
                let zeroing = self.zero_accumulators(b, &refs)?;
                ops.extend(updates);
                ops.extend(zeroing);
            } else {
                for (slot, g) in self.slots.iter().zip(&grads) {
                    if let (Some(g), Some(acc)) = (g, &slot.accum) {
                        ops.push(b.op_with(
                            "AssignAddVariableOp",
                            &[&acc.handle, g],
                            &[&guard],
                            &|nd| {
                                nd.set_attr_type("dtype", DataType::Float)?;
                                Ok(())
                            },
                        )?);
                    }
                }
            }
            ops.push(guard.clone());
            let refs: Vec<&Operation> = ops.iter().collect();
            let run = b.group(&refs)?;
            Ok(Program {
                input: Some(forward.input.clone()),
                target: Some(target),
                seed: forward.seed.clone(),
                scale: Some(scale),
                loss: Some(loss_out),
                run,
            })
        })();
        b.set_scope(&saved);
        result
    }

    /// The program applying accumulated gradients (a standalone `step()`).
    fn build_apply_accumulated(&self, engine: &mut Engine) -> Result<Program> {
        let b = &mut engine.b;
        let grads = self
            .slots
            .iter()
            .map(|s| {
                s.accum
                    .as_ref()
                    .map(|acc| b.read(&acc.handle, DataType::Float))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let updates = self.add_update_ops(b, &grads, &[])?;
        let refs: Vec<&Operation> = updates.iter().collect();
        let zeroing = self.zero_accumulators(b, &refs)?;
        let all: Vec<&Operation> = updates.iter().chain(&zeroing).collect();
        let run = b.group(&all)?;
        Ok(Program {
            input: None,
            target: None,
            seed: None,
            scale: None,
            loss: None,
            run,
        })
    }
}

/// A float32 tensor of `dims` filled with `value`.
fn full(value: f32, dims: &[usize]) -> Result<HostTensor> {
    HostTensor::new(vec![value; dims.iter().product()], dims.to_vec())
}

impl Optimizer<TfBackend> for TfOptimizer {
    /// Applies the gradients accumulated by training micro-batches that did not
    /// apply them (a no-op when there are none, as PyTorch skips parameters
    /// without gradients). [`TrainBackend::train_step`](kiln_core::TrainBackend::train_step)
    /// normally applies the update in the same run that computes the gradients.
    fn step(&mut self) -> Result<()> {
        if !self.pending {
            return Ok(());
        }
        let engine_arc = Arc::clone(&self.engine);
        let mut engine = lock(&engine_arc)?;
        if !self.programs.contains_key("apply_accumulated") {
            let program = self.build_apply_accumulated(&mut engine)?;
            self.programs
                .insert("apply_accumulated".to_owned(), program);
        }
        let feeds = self.coefficient_feeds()?;
        let feed_refs: Vec<(&Output, &TfTensor)> = feeds.iter().map(|(o, t)| (o, t)).collect();
        let run = self
            .programs
            .get("apply_accumulated")
            .map(|p| p.run.clone())
            .ok_or_else(|| Error::backend("tensorflow", "optimizer step", "program missing"))?;
        engine.run(&feed_refs, &[], &[&run], "applying accumulated gradients")?;
        self.step += 1;
        self.pending = false;
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        if !self.pending {
            return Ok(());
        }
        let engine_arc = Arc::clone(&self.engine);
        let mut engine = lock(&engine_arc)?;
        let ops = self.zero_accumulators(&mut engine.b, &[])?;
        let refs: Vec<&Operation> = ops.iter().collect();
        engine.run(&[], &[], &refs, "zeroing gradients")?;
        self.pending = false;
        Ok(())
    }

    fn kind(&self) -> Option<&'static str> {
        Some(self.config.kind())
    }

    fn learning_rate(&self) -> f64 {
        self.groups.first().map_or(0.0, |g| g.lr)
    }

    fn set_learning_rate(&mut self, lr: f64) {
        for group in &mut self.groups {
            group.lr = lr;
        }
    }

    fn learning_rates(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.lr).collect()
    }

    fn set_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        set_group_learning_rates(&mut self.groups, lrs)
    }

    /// The torch backend's layout: `state.<param>.step`, `state.<param>.<buffer>`
    /// (once a step was taken, as PyTorch creates state lazily), and
    /// `group.<i>.lr` / `group.<i>.weight_decay`.
    fn state_dict(&self) -> Result<StateDict> {
        let mut out = StateDict::new();
        let state_vars: Vec<Var> = self
            .slots
            .iter()
            .flat_map(|s| s.state.iter().map(|(_, v)| v.clone()))
            .collect();
        let values = if self.step > 0 {
            lock(&self.engine)?.read_vars(&state_vars)?
        } else {
            Vec::new()
        };
        let mut values = values.into_iter();
        for slot in &self.slots {
            out.insert(
                format!("state.{}.step", slot.name),
                HostTensor::scalar(self.step as i64),
            );
            for (key, _) in &slot.state {
                if let Some(value) = values.next() {
                    out.insert(format!("state.{}.{key}", slot.name), value);
                }
            }
        }
        save_group_hypers(&self.groups, &mut out);
        Ok(out)
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        // Check everything first; change nothing unless all of it is good.
        let mut step: Option<u64> = None;
        let mut writes: Vec<(Var, HostTensor)> = Vec::new();
        for slot in &self.slots {
            let key = format!("state.{}.step", slot.name);
            let s = match state.get(&key) {
                Some(t) => t
                    .to_dtype(DType::I64)
                    .as_slice::<i64>()?
                    .first()
                    .copied()
                    .unwrap_or(0),
                None => 0,
            };
            let s = u64::try_from(s).map_err(|_| {
                Error::invalid_argument(key.clone(), format!("negative step count {s}"))
            })?;
            match step {
                None => step = Some(s),
                Some(prev) if prev != s => {
                    return Err(Error::unsupported(format!(
                        "optimizer state with different step counts per parameter ({} has {s}, others {prev}) on TensorFlow",
                        slot.name
                    )))
                }
                Some(_) => {}
            }
            let prefix = format!("state.{}.", slot.name);
            for (k, _) in state.iter() {
                if let Some(buffer) = k.strip_prefix(&prefix) {
                    if buffer != "step" && !slot.state.iter().any(|(name, _)| *name == buffer) {
                        return Err(Error::invalid_argument(
                            k.clone(),
                            "unknown optimizer state buffer",
                        ));
                    }
                }
            }
            for (name, var) in &slot.state {
                let value = match state.get(&format!("{prefix}{name}")) {
                    Some(host) => {
                        if host.dims() != var.dims.as_slice() {
                            return Err(Error::ShapeMismatch {
                                context: format!("optimizer state {prefix}{name}"),
                                expected: kiln_core::Shape::new(var.dims.clone()).to_string(),
                                actual: host.shape().to_string(),
                            });
                        }
                        host.to_dtype(DType::F32)
                    }
                    // Not created yet (PyTorch's lazy state): the initial value.
                    None => full(state_init(&self.config, name) as f32, &var.dims)?,
                };
                writes.push((var.clone(), value));
            }
        }
        let groups = load_group_hypers(&self.groups, state);
        let vars: Vec<&Var> = writes.iter().map(|(v, _)| v).collect();
        let values: Vec<&HostTensor> = writes.iter().map(|(_, h)| h).collect();
        lock(&self.engine)?.write_vars(&vars, &values)?;
        self.step = step.unwrap_or(0);
        self.groups = groups;
        Ok(())
    }
}
