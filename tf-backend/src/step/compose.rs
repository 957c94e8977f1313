//! Building and running programs: [`program`] composes the program for a
//! [`ProgramKey`] from the forward pass, a loss, gradients and an optimizer's
//! updates, and caches it in the [`CompiledGraph`]; [`run`] feeds, fetches and runs
//! one in a single session run.
//!
//! One file, larger than most: the dispatcher, the compositions it dispatches to
//! and the runner share the [`Program`] layout (which placeholder is fed, what is
//! fetched in which order), and read best together.

use std::collections::HashMap;

use kiln_core::{
    loss::Loss,
    model::{Layer, RouterLosses},
    optim::GradClip,
    Error, HostTensor, Result,
};
use tensorflow::{DataType, Operation, Output};

use super::key::{GradientSource, ProgramKey, ProgramKind, Signature};
use crate::convert::TfTensor;
use crate::engine::{seed_tensor, tf_dtype, Engine, Var};
use crate::graph::Builder;
use crate::layers::{add_updates, Ctx, Update};
use crate::saved_model::SavedModelLayers;

/// The graph pieces of a forward pass, which the other programs build on.
#[derive(Debug, Clone)]
pub(crate) struct Forward {
    pub(crate) input: Output,
    /// The attention mask's own placeholder, read beside the ids in `input`
    /// ([`ModelGraph::separate_mask`]).
    pub(crate) mask_input: Option<Output>,
    /// The output, in PyTorch's logical layout.
    pub(crate) output: Output,
    /// The output's per-sample dims.
    pub(crate) output_dims: Vec<i64>,
    /// The seed placeholder when the pass draws random numbers.
    pub(crate) seed: Option<Output>,
    /// State updates of a training-mode pass (batch-norm statistics), not yet ops.
    pub(crate) updates: Vec<Update>,
    /// The reads of each parameter, by state-dict name (what gradients are taken against).
    pub(crate) reads: HashMap<String, Output>,
    /// The model's router losses times their weights, a scalar added to every
    /// loss built on this pass (`None`: no mixture of experts, or no weight).
    pub(crate) auxiliary: Option<Output>,
    /// The model's router losses, unweighted, in
    /// [`RouterLosses::NAMES`]' order (none without a mixture of experts).
    pub(crate) router_values: Vec<Output>,
}

impl Forward {
    /// The output's dims with the batch open.
    fn output_batch_dims(&self) -> Vec<i64> {
        let mut dims = vec![-1i64];
        dims.extend(&self.output_dims);
        dims
    }
}

/// A compiled program: what one session run feeds, fetches and runs.
#[derive(Debug, Clone, Default)]
pub(crate) struct Program {
    /// The forward pass it is built on (what other programs compose from).
    pub(crate) forward: Option<Forward>,
    pub(crate) input: Option<Output>,
    pub(crate) target: Option<Output>,
    pub(crate) seed: Option<Output>,
    /// A float scalar the loss is multiplied by before differentiation.
    pub(crate) scale: Option<Output>,
    /// Gradient placeholders ([`GradientSource::Fed`]), by parameter name.
    pub(crate) gradient_feeds: Vec<(String, Output)>,
    /// The flat gradient placeholder ([`GradientSource::Flat`]).
    pub(crate) flat_feed: Option<Output>,
    /// Fetched: the model's output.
    pub(crate) output: Option<Output>,
    /// Fetched: the loss.
    pub(crate) loss: Option<Output>,
    /// Fetched: 1 when the loss is finite and the updates ran, 0 when they were skipped.
    pub(crate) finite: Option<Output>,
    /// Fetched: each parameter's gradient, by name.
    pub(crate) gradients: Vec<(String, Output)>,
    /// Fetched: the objective's metrics (a mixture of experts' router
    /// losses), float scalars.
    pub(crate) metrics: Vec<Output>,
    /// Fetched: the gradients and the loss as one float vector
    /// ([`ProgramKind::FlatGradients`]).
    pub(crate) flat: Option<Output>,
    /// Which of the optimizer's parameters have a gradient in `flat`.
    pub(crate) present: Vec<bool>,
    /// Run: the ops with effects (variable updates).
    pub(crate) targets: Vec<Operation>,
}

/// What a run fetched.
#[derive(Debug, Default)]
pub(crate) struct Fetched {
    pub(crate) output: Option<TfTensor>,
    /// The loss: a scalar, or per element with reduction `none`.
    pub(crate) loss: Option<TfTensor>,
    /// Whether the updates ran (programs without a finiteness guard: `true`).
    pub(crate) applied: bool,
    pub(crate) gradients: Vec<(String, TfTensor)>,
    /// The flat gradient vector, in the memory TensorFlow allocated for it.
    pub(crate) flat: Option<TfTensor>,
    /// The metrics' values, in the program's order.
    pub(crate) metrics: Vec<f64>,
}

/// The model a program runs: its definition and variables, and the dims of the
/// batch it is being run on (a new program checks them against the definition).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ModelGraph<'a> {
    pub(crate) spec: &'a Layer,
    pub(crate) vars: &'a [Var],
    pub(crate) batch_dims: &'a [usize],
    /// Whether a `[batch, 2, seq]` batch of ids and their attention mask is
    /// read from two `[batch, seq]` placeholders (a SavedModel's signature)
    /// instead of one stacked placeholder.
    pub(crate) separate_mask: bool,
}

/// The optimizer a program updates with: its trainable parameters and update rule.
pub(crate) trait UpdateRule {
    /// The parameters it updates, in order: name, dims and the gradient
    /// accumulator once gradient accumulation is in use.
    fn parameters(&self) -> Vec<(&str, &[usize], Option<&Var>)>;
    /// The ops updating every parameter given its gradient (`None`: no
    /// gradient, left alone as PyTorch does), each after `after`.
    fn update_ops(
        &self,
        b: &mut Builder,
        grads: &[Option<Output>],
        after: &[&Operation],
    ) -> Result<Vec<Operation>>;
    /// `grads` clipped as `torch.nn.utils.clip_grad_*_` would.
    fn clip(
        &self,
        b: &mut Builder,
        grads: Vec<Option<Output>>,
        clip: &GradClip,
    ) -> Result<Vec<Option<Output>>>;
}

/// A graph with the programs compiled on it: what a model and its optimizers share.
#[derive(Debug)]
pub(crate) struct CompiledGraph {
    pub(crate) engine: Engine,
    /// The model's `saved_model` layers, loaded when it was built (their
    /// graphs are in the engine's; the forward pass wires them in).
    pub(crate) saved_models: SavedModelLayers,
    programs: HashMap<ProgramKey, Program>,
}

impl CompiledGraph {
    pub(crate) fn new(engine: Engine) -> Self {
        CompiledGraph {
            engine,
            saved_models: SavedModelLayers::default(),
            programs: HashMap::new(),
        }
    }
}

/// The program for `key`, composed and cached on first use.
///
/// `model` is needed by the kinds that run the model, `rule` by those that
/// update it ([`ProgramKind::Train`], [`ProgramKind::Apply`],
/// [`ProgramKind::ZeroAccumulators`]).
pub(crate) fn program(
    graph: &mut CompiledGraph,
    key: &ProgramKey,
    model: Option<ModelGraph<'_>>,
    rule: Option<&dyn UpdateRule>,
) -> Result<Program> {
    if let Some(program) = graph.programs.get(key) {
        return Ok(program.clone());
    }
    let need_model = || {
        model.ok_or_else(|| Error::backend("tensorflow", "building a program", "no model given"))
    };
    let need_rule = || {
        rule.ok_or_else(|| Error::backend("tensorflow", "building a program", "no optimizer given"))
    };
    let input = |key: &ProgramKey| {
        key.input
            .clone()
            .ok_or_else(|| Error::backend("tensorflow", "building a program", "no input signature"))
    };
    let target = |key: &ProgramKey| {
        key.target.clone().ok_or_else(|| {
            Error::backend("tensorflow", "building a program", "no target signature")
        })
    };
    let composed = match &key.kind {
        ProgramKind::Forward => compose_forward(
            &mut graph.engine,
            &graph.saved_models,
            need_model()?,
            &input(key)?,
            key.train,
        )?,
        ProgramKind::Eval { loss } => {
            let base = forward(graph, need_model()?, &input(key)?, key.train)?;
            compose_eval(&mut graph.engine.b, base, loss, &target(key)?)?
        }
        ProgramKind::Gradients { loss } => {
            let model = need_model()?;
            let base = forward(graph, model, &input(key)?, key.train)?;
            compose_gradients(
                &mut graph.engine.b,
                model,
                pieces(&base)?,
                loss,
                &target(key)?,
            )?
        }
        ProgramKind::Train {
            loss, apply, clip, ..
        } => {
            let base = forward(graph, need_model()?, &input(key)?, key.train)?;
            let b = &mut graph.engine.b;
            let saved = b.set_scope("train_step");
            let composed = compose_train(
                b,
                pieces(&base)?,
                need_rule()?,
                loss,
                &target(key)?,
                *apply,
                clip.as_ref(),
            );
            b.set_scope(&saved);
            composed?
        }
        ProgramKind::Apply { source, clip, .. } => {
            compose_apply(&mut graph.engine.b, need_rule()?, source, clip.as_ref())?
        }
        ProgramKind::ZeroAccumulators { .. } => Program {
            targets: zero_accumulators(&mut graph.engine.b, &need_rule()?.parameters(), &[])?,
            ..Program::default()
        },
        ProgramKind::FlatGradients { loss, .. } => {
            let base = forward(graph, need_model()?, &input(key)?, key.train)?;
            let b = &mut graph.engine.b;
            let saved = b.set_scope("flat_gradients");
            let composed =
                compose_flat_gradients(b, pieces(&base)?, need_rule()?, loss, &target(key)?);
            b.set_scope(&saved);
            composed?
        }
    };
    graph.programs.insert(key.clone(), composed.clone());
    Ok(composed)
}

/// The forward program for `input` in `train` mode (cached), which the other
/// programs of the model build on.
fn forward(
    graph: &mut CompiledGraph,
    model: ModelGraph<'_>,
    input: &Signature,
    train: bool,
) -> Result<Program> {
    let key = ProgramKey {
        kind: ProgramKind::Forward,
        train,
        input: Some(input.clone()),
        target: None,
    };
    program(graph, &key, Some(model), None)
}

/// The forward pass a program is built on.
fn pieces(program: &Program) -> Result<&Forward> {
    program
        .forward
        .as_ref()
        .ok_or_else(|| Error::backend("tensorflow", "building a program", "no forward pass"))
}

/// The forward pass: `[batch, sample...]` in, the model's output out, and in
/// training mode its state updates as ops of their own (batch-norm statistics).
fn compose_forward(
    engine: &mut Engine,
    saved_models: &SavedModelLayers,
    model: ModelGraph<'_>,
    input: &Signature,
    train: bool,
) -> Result<Program> {
    super::input::check_input(model, input)?;
    let handles: HashMap<String, (Output, DataType)> = model
        .vars
        .iter()
        .map(|v| Ok((v.name.clone(), (v.handle.clone(), tf_dtype(v.dtype)?))))
        .collect::<Result<_>>()?;
    let saved = engine.b.set_scope(if train {
        "train_forward"
    } else {
        "eval_forward"
    });
    let placeholders = super::input::placeholders(&mut engine.b, model, input);
    engine.b.set_scope(&saved);
    let (placeholder, mask_input) = placeholders?;
    // The first layer's input, and a padded batch's mask for the layers that read it.
    let (x, padding) = match &mask_input {
        Some(mask) => super::input::separate_input(&mut engine.b, model, &placeholder, mask)?,
        None => super::input::model_input(&mut engine.b, model, input, &placeholder)?,
    };
    let mut ctx = Ctx {
        b: &mut engine.b,
        custom_ops: &engine.custom_ops,
        saved_models,
        reads: HashMap::new(),
        handles: &handles,
        train,
        seed: None,
        random_ops: 0,
        updates: Vec::new(),
        routers: Vec::new(),
        padding,
    };
    let y = ctx.layer(model.spec, "", x)?;
    let y = ctx.nchw(y)?;
    let (seed, updates, reads, routers) = (ctx.seed, ctx.updates, ctx.reads, ctx.routers);
    // A mixture of experts' router losses: their values (the metrics), and
    // their weighted sum, added to every loss built on this pass.
    let (router_values, auxiliary) = match RouterLosses::of(model.spec)? {
        Some(losses) => {
            let (values, weighted) =
                crate::layers::router_losses(&mut engine.b, &routers, &losses)?;
            (values.to_vec(), weighted)
        }
        None => (Vec::new(), None),
    };
    // A named output that is never the input itself (eval-mode dropout is the identity).
    let output = engine.b.op("Identity", &[&y.out], &|nd| {
        nd.set_attr_type("T", DataType::Float)?;
        Ok(())
    })?;
    let targets = add_updates(&mut engine.b, &updates, &[])?;
    let forward = Forward {
        input: placeholder,
        mask_input,
        output,
        output_dims: y.dims,
        seed,
        updates,
        reads,
        auxiliary,
        router_values,
    };
    Ok(Program {
        input: Some(forward.input.clone()),
        seed: forward.seed.clone(),
        output: Some(forward.output.clone()),
        targets,
        forward: Some(forward),
        ..Program::default()
    })
}

/// A target placeholder and `loss(output, target)` on `forward`, with its
/// weighted router losses added.
fn loss_on(
    b: &mut Builder,
    loss: &Loss,
    forward: &Forward,
    target: &Signature,
) -> Result<(Output, Output)> {
    let placeholder = b.placeholder(tf_dtype(target.dtype)?, Some(&target.dims))?;
    let value = crate::loss::build_loss(
        b,
        loss,
        &forward.output,
        &forward.output_batch_dims(),
        &placeholder,
        target.dtype,
        &target.dims,
    )?;
    let value = match &forward.auxiliary {
        Some(aux) => b.add(&value, aux)?,
        None => value,
    };
    Ok((placeholder, value))
}

/// Forward and loss; in training mode the forward pass's state updates run too.
fn compose_eval(
    b: &mut Builder,
    forward: Program,
    loss: &Loss,
    target: &Signature,
) -> Result<Program> {
    let pieces = pieces(&forward)?;
    let (target, value) = loss_on(b, loss, pieces, target)?;
    let metrics = pieces.router_values.clone();
    Ok(Program {
        target: Some(target),
        loss: Some(value),
        metrics,
        ..forward
    })
}

/// Forward, loss and each parameter's gradient, fetched; no state changes.
/// Parameters the loss does not depend on are left out.
fn compose_gradients(
    b: &mut Builder,
    model: ModelGraph<'_>,
    forward: &Forward,
    loss: &Loss,
    target: &Signature,
) -> Result<Program> {
    let (target, value) = loss_on(b, loss, forward, target)?;
    let params: Vec<&str> = model
        .vars
        .iter()
        .filter(|v| v.kind == kiln_core::model::ParamKind::Parameter)
        .map(|v| v.name.as_str())
        .collect();
    let grads = differentiate(b, &value, forward, &params)?;
    let gradients = params
        .iter()
        .zip(grads)
        .filter_map(|(name, g)| g.map(|g| ((*name).to_owned(), g)))
        .collect();
    Ok(Program {
        input: Some(forward.input.clone()),
        seed: forward.seed.clone(),
        target: Some(target),
        loss: Some(value),
        gradients,
        ..Program::default()
    })
}

/// The gradient of `y` with respect to each of `params` (`None` where `y` does
/// not depend on it).
fn differentiate(
    b: &mut Builder,
    y: &Output,
    forward: &Forward,
    params: &[&str],
) -> Result<Vec<Option<Output>>> {
    let xs: Vec<Option<Output>> = params
        .iter()
        .map(|name| forward.reads.get(*name).cloned())
        .collect();
    let present: Vec<Output> = xs.iter().flatten().cloned().collect();
    let mut found = b.gradients(y, &present)?.into_iter();
    Ok(xs
        .iter()
        .map(|x| x.as_ref().and_then(|_| found.next().flatten()))
        .collect())
}

/// One training micro-batch: forward, loss, the gradients of `loss * scale`,
/// then (behind a gate that is closed when the loss is not finite) the forward
/// pass's state updates and either the optimizer's update of the accumulated
/// and new gradients, clipped, or the new gradients added to the accumulators.
fn compose_train(
    b: &mut Builder,
    forward: &Forward,
    rule: &dyn UpdateRule,
    loss: &Loss,
    target: &Signature,
    apply: bool,
    clip: Option<&GradClip>,
) -> Result<Program> {
    let (target, value) = loss_on(b, loss, forward, target)?;
    let scale = b.placeholder(DataType::Float, Some(&[]))?;
    let scaled = b.mul(&value, &scale)?;
    let params = rule.parameters();
    let names: Vec<&str> = params.iter().map(|(name, _, _)| *name).collect();
    let grads = differentiate(b, &scaled, forward, &names)?;
    let finite = b.all_finite(&value, 0)?;
    let gate = b.gate(&finite)?;
    let mut targets = add_updates(b, &forward.updates, &[&gate])?;
    if apply {
        // Add what earlier micro-batches accumulated.
        let mut totals = Vec::with_capacity(grads.len());
        for ((_, _, accum), g) in params.iter().zip(grads) {
            totals.push(match (g, accum) {
                (Some(g), Some(acc)) => {
                    let prev = b.read(&acc.handle, DataType::Float)?;
                    Some(b.add(&prev, &g)?)
                }
                (g, _) => g,
            });
        }
        let totals = match clip {
            Some(clip) => rule.clip(b, totals, clip)?,
            None => totals,
        };
        let updates = rule.update_ops(b, &totals, &[&gate])?;
        let refs: Vec<&Operation> = updates.iter().collect();
        let zeroing = zero_accumulators(b, &params, &refs)?;
        targets.extend(updates);
        targets.extend(zeroing);
    } else {
        for ((_, _, accum), g) in params.iter().zip(&grads) {
            if let (Some(g), Some(acc)) = (g, accum) {
                targets.push(b.op_with(
                    "AssignAddVariableOp",
                    &[&acc.handle, g],
                    &[&gate],
                    &|nd| {
                        nd.set_attr_type("dtype", DataType::Float)?;
                        Ok(())
                    },
                )?);
            }
        }
    }
    let finite = b.cast(&finite, DataType::Bool, DataType::UInt8)?;
    Ok(Program {
        metrics: forward.router_values.clone(),
        input: Some(forward.input.clone()),
        seed: forward.seed.clone(),
        target: Some(target),
        scale: Some(scale),
        loss: Some(value),
        finite: Some(finite),
        targets,
        ..Program::default()
    })
}

/// One data-parallel micro-batch: forward, loss, and the gradients of
/// `loss * scale` concatenated with the loss into one flat vector, fetched.
/// The forward pass's state updates run behind the same finiteness gate as in
/// [`compose_train`]; nothing else changes.
fn compose_flat_gradients(
    b: &mut Builder,
    forward: &Forward,
    rule: &dyn UpdateRule,
    loss: &Loss,
    target: &Signature,
) -> Result<Program> {
    let (target, value) = loss_on(b, loss, forward, target)?;
    let scale = b.placeholder(DataType::Float, Some(&[]))?;
    let scaled = b.mul(&value, &scale)?;
    let params = rule.parameters();
    let names: Vec<&str> = params.iter().map(|(name, _, _)| *name).collect();
    let grads = differentiate(b, &scaled, forward, &names)?;
    let finite = b.all_finite(&value, 0)?;
    let gate = b.gate(&finite)?;
    let targets = add_updates(b, &forward.updates, &[&gate])?;
    let present: Vec<bool> = grads.iter().map(Option::is_some).collect();
    let mut parts = Vec::with_capacity(grads.len() + 1);
    for g in grads.iter().flatten() {
        parts.push(b.reshape(g, &[-1], DataType::Float)?);
    }
    if parts.is_empty() {
        return Err(Error::invalid_argument(
            "model",
            "the loss depends on none of the optimizer's parameters: there is no gradient to \
             average over the ranks",
        ));
    }
    parts.push(b.reshape(&value, &[1], DataType::Float)?);
    let flat = b.concat(&parts, 0)?;
    Ok(Program {
        metrics: forward.router_values.clone(),
        input: Some(forward.input.clone()),
        seed: forward.seed.clone(),
        target: Some(target),
        scale: Some(scale),
        flat: Some(flat),
        present,
        targets,
        ..Program::default()
    })
}

/// The number of elements of a flat gradient vector with the gradients of the
/// parameters marked `present` (its last, extra element included).
pub(crate) fn flat_len(params: &[(&str, &[usize], Option<&Var>)], present: &[bool]) -> usize {
    params
        .iter()
        .zip(present)
        .filter(|(_, &p)| p)
        .map(|((_, dims, _), _)| dims.iter().product::<usize>())
        .sum::<usize>()
        + 1
}

/// The optimizer's update from gradients fed by the caller or read from the
/// accumulators (which it then zeroes), clipped first when `clip` is given.
fn compose_apply(
    b: &mut Builder,
    rule: &dyn UpdateRule,
    source: &GradientSource,
    clip: Option<&GradClip>,
) -> Result<Program> {
    let params = rule.parameters();
    let mut gradient_feeds = Vec::new();
    let mut grads = Vec::with_capacity(params.len());
    let mut flat_feed = None;
    if let GradientSource::Flat { present } = source {
        let len = i64::try_from(flat_len(&params, present)).map_err(|_| {
            Error::unsupported("a flat gradient vector of more than i64::MAX elements")
        })?;
        flat_feed = Some(b.placeholder(DataType::Float, Some(&[len]))?);
    }
    let mut offset = 0usize;
    for (i, (name, dims, accum)) in params.iter().enumerate() {
        grads.push(match source {
            GradientSource::Flat { present } => match (&flat_feed, present.get(i)) {
                (Some(flat), Some(true)) => {
                    let n: usize = dims.iter().product();
                    let int = |v: usize| {
                        i32::try_from(v).map_err(|_| {
                            Error::unsupported(
                                "flat gradient vectors of more than i32::MAX elements",
                            )
                        })
                    };
                    let part = b.slice(flat, &[int(offset)?], &[int(n)?])?;
                    offset += n;
                    let shape: Vec<i32> = dims.iter().map(|&d| int(d)).collect::<Result<_>>()?;
                    Some(b.reshape(&part, &shape, DataType::Float)?)
                }
                _ => None,
            },
            GradientSource::Fed { present } if !present.get(i).copied().unwrap_or(false) => None,
            GradientSource::Fed { .. } => {
                let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
                let placeholder = b.placeholder(DataType::Float, Some(&dims))?;
                gradient_feeds.push(((*name).to_owned(), placeholder.clone()));
                Some(placeholder)
            }
            GradientSource::Accumulated => accum
                .map(|acc| b.read(&acc.handle, DataType::Float))
                .transpose()?,
        });
    }
    let grads = match clip {
        Some(clip) => rule.clip(b, grads, clip)?,
        None => grads,
    };
    let mut targets = rule.update_ops(b, &grads, &[])?;
    if *source == GradientSource::Accumulated {
        let refs: Vec<&Operation> = targets.iter().collect();
        let zeroing = zero_accumulators(b, &params, &refs)?;
        targets.extend(zeroing);
    }
    Ok(Program {
        gradient_feeds,
        flat_feed,
        targets,
        ..Program::default()
    })
}

/// The ops that zero the accumulators of `params` after `after`.
pub(crate) fn zero_accumulators(
    b: &mut Builder,
    params: &[(&str, &[usize], Option<&Var>)],
    after: &[&Operation],
) -> Result<Vec<Operation>> {
    let mut ops = Vec::new();
    for (_, _, accum) in params {
        if let Some(acc) = accum {
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

/// Runs `program` once: the batch fed by reference (no copy), a fresh seed when
/// the forward pass draws random numbers, and `extra` feeds (coefficients,
/// scale, gradients); returns what it fetches.
pub(crate) fn run(
    engine: &mut Engine,
    program: &Program,
    input: Option<&TfTensor>,
    target: Option<&TfTensor>,
    extra: &[(Output, TfTensor)],
    context: &str,
) -> Result<Fetched> {
    let seed = program.seed.as_ref().map(|_| seed_tensor()).transpose()?;
    let mut feeds: Vec<(&Output, &TfTensor)> = extra.iter().map(|(o, t)| (o, t)).collect();
    for (placeholder, value) in [
        (&program.input, input),
        (&program.target, target),
        (&program.seed, seed.as_ref()),
    ] {
        match (placeholder, value) {
            (Some(placeholder), Some(value)) => feeds.push((placeholder, value)),
            (Some(_), None) => {
                return Err(Error::backend(
                    "tensorflow",
                    context,
                    "a program input was not given",
                ))
            }
            _ => {}
        }
    }
    let mut fetches: Vec<(&Output, DataType)> = Vec::new();
    for fetch in [&program.output, &program.loss].into_iter().flatten() {
        fetches.push((fetch, DataType::Float));
    }
    if let Some(finite) = &program.finite {
        fetches.push((finite, DataType::UInt8));
    }
    fetches.extend(program.gradients.iter().map(|(_, g)| (g, DataType::Float)));
    if let Some(flat) = &program.flat {
        fetches.push((flat, DataType::Float));
    }
    fetches.extend(program.metrics.iter().map(|m| (m, DataType::Float)));
    let targets: Vec<&Operation> = program.targets.iter().collect();
    let mut values = engine.run(&feeds, &fetches, &targets, context)?.into_iter();
    let missing = || Error::backend("tensorflow", context, "a fetched value is missing");
    let mut fetched = Fetched {
        applied: true,
        ..Fetched::default()
    };
    if program.output.is_some() {
        fetched.output = Some(values.next().ok_or_else(missing)?);
    }
    if program.loss.is_some() {
        fetched.loss = Some(values.next().ok_or_else(missing)?);
    }
    if program.finite.is_some() {
        fetched.applied = scalar(&values.next().ok_or_else(missing)?)? != 0.0;
    }
    for (name, _) in &program.gradients {
        fetched
            .gradients
            .push((name.clone(), values.next().ok_or_else(missing)?));
    }
    if program.flat.is_some() {
        fetched.flat = Some(values.next().ok_or_else(missing)?);
    }
    for _ in &program.metrics {
        fetched
            .metrics
            .push(scalar(&values.next().ok_or_else(missing)?)?);
    }
    Ok(fetched)
}

impl Fetched {
    /// The loss's value (NaN when the program fetches none).
    pub(crate) fn loss_value(&self) -> Result<f64> {
        self.loss.as_ref().map_or(Ok(f64::NAN), scalar)
    }
}

/// The value of a one-element tensor.
pub(crate) fn scalar(tensor: &TfTensor) -> Result<f64> {
    let host: HostTensor = tensor.to_host()?;
    match host.to_f64_vec().as_slice() {
        [value] => Ok(*value),
        _ => Err(Error::ShapeMismatch {
            context: "item()".to_owned(),
            expected: "one element".to_owned(),
            actual: host.shape().to_string(),
        }),
    }
}
