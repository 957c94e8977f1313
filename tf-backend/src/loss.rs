//! Kiln [`Loss`]es as TensorFlow graph ops, with the semantics of
//! `torch.nn.functional` as libtorch computes them (the torch backend's
//! `compute_loss` is the behaviour to match).
//!
//! Every op on the path from the model output to the loss has a gradient in
//! TensorFlow's C++ registry, so the result can be differentiated with
//! `Graph::add_gradients`. Float values are picked with gathers and float
//! masks, never with `Select`; class-index targets only feed integer ops
//! (`SelectV2` among them), gathers' indices and constants, none of which is
//! on the gradient path.

use kiln_core::{
    loss::{CrossEntropyConfig, Loss, NllConfig, Reduction},
    DType, Error, Result,
};
use tensorflow::{DataType, Output};

use crate::graph::{out0, Builder};

/// PyTorch's default `ignore_index`.
const DEFAULT_IGNORE_INDEX: i64 = -100;

/// Builds `loss(input, target)` into `b`'s graph and returns it: a float32
/// scalar for [`Reduction::Mean`] and [`Reduction::Sum`], the per-element
/// losses for [`Reduction::None`] (`[N, d1, ...]` for the class losses, the
/// input's shape for the others).
///
/// `input` is the float32 model output and `target` a tensor of
/// `target_dtype`; `input_dims` and `target_dims` are their static shapes, with
/// `-1` for a dimension (normally the batch dim 0) known only at run time.
///
/// - `CrossEntropy` takes logits `[N, C]` or `[N, C, d1, ...]` and either int64
///   class indices `[N]` / `[N, d1, ...]` or float32 class probabilities of the
///   input's shape; `Nll` takes log-probabilities of the same layouts and int64
///   class indices. The class count `C` must be known statically.
/// - `Mse`, `L1`, `SmoothL1` and `BceWithLogits` take float32 targets of the
///   input's shape.
///
/// Fails before adding any op with the option's [`Error::InvalidArgument`]
/// from [`Loss::validate`], [`Error::DTypeMismatch`] for a target of the
/// wrong dtype, [`Error::ShapeMismatch`] naming the expected and actual shapes,
/// and [`Error::Unsupported`] for a loss this backend does not build. A class
/// index outside `[0, C)` that is not `ignore_index` fails the session run
/// that evaluates the loss or its gradient (PyTorch raises there too).
pub(crate) fn build_loss(
    b: &mut Builder,
    loss: &Loss,
    input: &Output,
    input_dims: &[i64],
    target: &Output,
    target_dtype: DType,
    target_dims: &[i64],
) -> Result<Output> {
    loss.validate()?;
    let shapes = Shapes {
        input: input_dims,
        target: target_dims,
    };
    match loss {
        Loss::CrossEntropy(c) => cross_entropy(b, c, input, target, target_dtype, shapes),
        Loss::Nll(c) => nll(b, c, input, target, target_dtype, shapes),
        Loss::Mse { reduction } => {
            shapes.check_regression("mse", target_dtype)?;
            let per_element = b.squared_difference(input, target)?;
            reduce(b, &per_element, input_dims.len(), *reduction)
        }
        Loss::L1 { reduction } => {
            shapes.check_regression("l1", target_dtype)?;
            let diff = b.sub(input, target)?;
            let per_element = b.unary("Abs", &diff)?;
            reduce(b, &per_element, input_dims.len(), *reduction)
        }
        Loss::SmoothL1(c) => {
            shapes.check_regression("smooth_l1", target_dtype)?;
            let per_element = smooth_l1(b, input, target, c.beta as f32)?;
            reduce(b, &per_element, input_dims.len(), c.reduction)
        }
        Loss::BceWithLogits(c) => {
            shapes.check_regression("bce_with_logits", target_dtype)?;
            let pos_weight = c
                .pos_weight
                .as_deref()
                .map(|w| shapes.check_pos_weight(w))
                .transpose()?;
            let per_element = bce_with_logits(b, input, target, pos_weight.as_deref())?;
            reduce(b, &per_element, input_dims.len(), c.reduction)
        }
        other => Err(Error::unsupported(format!(
            "loss {} on the TensorFlow backend",
            other.torch_name()
        ))),
    }
}

// ----- validation -----

/// The static shapes of a loss's input and target.
#[derive(Clone, Copy)]
struct Shapes<'a> {
    input: &'a [i64],
    target: &'a [i64],
}

/// `[?, 5, 3]`: static dims with `?` for one known only at run time.
fn fmt_dims(dims: &[i64]) -> String {
    let parts: Vec<String> = dims
        .iter()
        .map(|&d| if d < 0 { "?".to_owned() } else { d.to_string() })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Whether two static shapes can be equal at run time.
fn dims_compatible(a: &[i64], b: &[i64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| x < 0 || y < 0 || x == y)
}

impl Shapes<'_> {
    /// The class count `C` of an input `[N, C, ...]`.
    fn classes(&self, name: &str) -> Result<i64> {
        match self.input.get(1) {
            Some(&c) if c > 0 => Ok(c),
            _ => Err(Error::ShapeMismatch {
                context: format!("{name} input"),
                expected: "[N, C] or [N, C, d1, ...] with the class count C known \
                           when the graph is built"
                    .to_owned(),
                actual: fmt_dims(self.input),
            }),
        }
    }

    /// Class-index targets: int64 of the input's shape without dim 1.
    fn check_index_targets(&self, name: &str, dtype: DType) -> Result<()> {
        if dtype != DType::I64 {
            return Err(Error::DTypeMismatch {
                context: format!("{name} class-index targets"),
                expected: DType::I64,
                actual: dtype,
            });
        }
        let mut expected = self.input.to_vec();
        expected.remove(1);
        if !dims_compatible(&expected, self.target) {
            return Err(Error::ShapeMismatch {
                context: format!("{name} class-index targets"),
                expected: format!(
                    "{} (the input's shape {} without the class dim 1)",
                    fmt_dims(&expected),
                    fmt_dims(self.input)
                ),
                actual: fmt_dims(self.target),
            });
        }
        Ok(())
    }

    /// Float32 targets of the input's shape.
    fn check_same_shape(&self, context: &str, dtype: DType) -> Result<()> {
        if dtype != DType::F32 {
            return Err(Error::DTypeMismatch {
                context: context.to_owned(),
                expected: DType::F32,
                actual: dtype,
            });
        }
        if !dims_compatible(self.input, self.target) {
            return Err(Error::ShapeMismatch {
                context: context.to_owned(),
                expected: format!("{} (the input's shape)", fmt_dims(self.input)),
                actual: fmt_dims(self.target),
            });
        }
        Ok(())
    }

    fn check_regression(&self, name: &str, dtype: DType) -> Result<()> {
        self.check_same_shape(&format!("{name} target"), dtype)
    }

    /// `pos_weight` broadcasts over the input's last dim: one value per entry, or one in all.
    fn check_pos_weight(&self, pos_weight: &[f64]) -> Result<Vec<f32>> {
        let fits = match self.input.last() {
            Some(&last) => pos_weight.len() == 1 || last < 0 || pos_weight.len() as i64 == last,
            None => false,
        };
        if !fits {
            return Err(Error::ShapeMismatch {
                context: "bce_with_logits pos_weight".to_owned(),
                expected: format!(
                    "[1] or one value per entry of the last dim of the input {}",
                    fmt_dims(self.input)
                ),
                actual: format!("[{}]", pos_weight.len()),
            });
        }
        Ok(pos_weight.iter().map(|&w| w as f32).collect())
    }
}

/// The per-class weights as float32, checked to hold one value per class.
fn class_weights(name: &str, weight: Option<&[f64]>, classes: i64) -> Result<Option<Vec<f32>>> {
    let Some(weight) = weight else {
        return Ok(None);
    };
    if weight.len() as i64 != classes {
        return Err(Error::ShapeMismatch {
            context: format!("{name} weight"),
            expected: format!("[{classes}] (one weight per class)"),
            actual: format!("[{}]", weight.len()),
        });
    }
    Ok(Some(weight.iter().map(|&w| w as f32).collect()))
}

// ----- class losses -----

fn cross_entropy(
    b: &mut Builder,
    c: &CrossEntropyConfig,
    input: &Output,
    target: &Output,
    target_dtype: DType,
    shapes: Shapes<'_>,
) -> Result<Output> {
    const NAME: &str = "cross_entropy";
    let classes = shapes.classes(NAME)?;
    let weight = class_weights(NAME, c.weight.as_deref(), classes)?;
    let ignore_index = c.ignore_index.unwrap_or(DEFAULT_IGNORE_INDEX);
    let smoothing = c.label_smoothing;
    if target_dtype == DType::F32 || target_dtype == DType::F64 {
        shapes.check_same_shape("cross_entropy probability targets", target_dtype)?;
        if ignore_index >= 0 {
            return Err(Error::invalid_argument(
                "ignore_index",
                format!("is not supported with probability targets, got {ignore_index}"),
            ));
        }
        return cross_entropy_probs(b, c.reduction, input, target, shapes, weight, smoothing);
    }
    shapes.check_index_targets(NAME, target_dtype)?;
    let rank = shapes.input.len();
    let logits = move_class_last(b, input, rank)?;
    let log_probs = log_softmax_last(b, &logits, rank, classes)?;
    let targets = IndexTargets::new(b, NAME, target, classes, ignore_index, weight.as_deref())?;
    let rows = b.reshape(&log_probs, &[-1, classes as i32], DataType::Float)?;
    let nll = targets.nll_terms(b, &rows)?;
    if smoothing <= 0.0 {
        return targets.reduce(b, &nll, c.reduction);
    }
    // ATen's cross_entropy_loss_label_smoothing: (1 - eps) * nll_loss +
    // eps / C * (the loss against the uniform distribution, weighted per class,
    // zero where the target is ignored, with nll_loss's mean normaliser).
    let smooth = match &weight {
        Some(w) => {
            let w = b.constant(w, &[w.len() as u64])?;
            b.mul(&rows, &w)?
        }
        None => rows,
    };
    let smooth = b.reduce("Sum", &smooth, &[1], false)?;
    let smooth = b.unary("Neg", &smooth)?;
    let smooth = b.mul(&smooth, &targets.kept)?;
    let nll = targets.reduce(b, &nll, c.reduction)?;
    let smooth = match c.reduction {
        Reduction::None => b.reshape_to(&smooth, &targets.shape, DataType::Float)?,
        Reduction::Sum => b.reduce("Sum", &smooth, &[0], false)?,
        Reduction::Mean => {
            let total = b.reduce("Sum", &smooth, &[0], false)?;
            let norm = targets.weight_sum(b)?;
            b.div(&total, &norm)?
        }
    };
    let nll = b.mul_scalar(&nll, (1.0 - smoothing) as f32)?;
    let smooth = b.mul_scalar(&smooth, (smoothing / classes as f64) as f32)?;
    b.add(&nll, &smooth)
}

/// ATen's `cross_entropy_loss_prob_target`: `-sum(log_softmax(x) * t * w)` over
/// classes, with smoothed targets `t * (1 - eps) + eps / C`; the mean divides
/// by the number of samples `N * d1 * ...`, whatever the weights.
fn cross_entropy_probs(
    b: &mut Builder,
    reduction: Reduction,
    input: &Output,
    target: &Output,
    shapes: Shapes<'_>,
    weight: Option<Vec<f32>>,
    smoothing: f64,
) -> Result<Output> {
    let rank = shapes.input.len();
    let classes = shapes.input[1];
    let logits = move_class_last(b, input, rank)?;
    let log_probs = log_softmax_last(b, &logits, rank, classes)?;
    let mut probs = move_class_last(b, target, rank)?;
    if smoothing > 0.0 {
        probs = b.mul_scalar(&probs, (1.0 - smoothing) as f32)?;
        probs = b.add_scalar(&probs, (smoothing / classes as f64) as f32)?;
    }
    let mut terms = b.mul(&log_probs, &probs)?;
    if let Some(w) = &weight {
        let w = b.constant(w, &[w.len() as u64])?;
        terms = b.mul(&terms, &w)?;
    }
    match reduction {
        Reduction::None => {
            let per_sample = b.reduce("Sum", &terms, &[rank as i32 - 1], false)?;
            b.unary("Neg", &per_sample)
        }
        Reduction::Sum => {
            let total = b.sum_all(&terms, rank)?;
            b.unary("Neg", &total)
        }
        Reduction::Mean => {
            let total = b.sum_all(&terms, rank)?;
            let total = b.unary("Neg", &total)?;
            // numel / C samples, counted on the target (off the gradient path).
            let numel = b.op("Size", &[target], &|nd| {
                nd.set_attr_type("T", DataType::Float)?;
                nd.set_attr_type("out_type", DataType::Int32)?;
                Ok(())
            })?;
            let c = b.constant(&[classes as i32], &[])?;
            let samples = int_op(b, "FloorDiv", &[&numel, &c], DataType::Int32)?;
            let samples = b.cast(&samples, DataType::Int32, DataType::Float)?;
            b.div(&total, &samples)
        }
    }
}

fn nll(
    b: &mut Builder,
    c: &NllConfig,
    input: &Output,
    target: &Output,
    target_dtype: DType,
    shapes: Shapes<'_>,
) -> Result<Output> {
    const NAME: &str = "nll";
    let classes = shapes.classes(NAME)?;
    let weight = class_weights(NAME, c.weight.as_deref(), classes)?;
    shapes.check_index_targets(NAME, target_dtype)?;
    let ignore_index = c.ignore_index.unwrap_or(DEFAULT_IGNORE_INDEX);
    let log_probs = move_class_last(b, input, shapes.input.len())?;
    let rows = b.reshape(&log_probs, &[-1, classes as i32], DataType::Float)?;
    let targets = IndexTargets::new(b, NAME, target, classes, ignore_index, weight.as_deref())?;
    let terms = targets.nll_terms(b, &rows)?;
    targets.reduce(b, &terms, c.reduction)
}

/// Transposes `[N, C, d1, ...]` to `[N, d1, ..., C]` (TensorFlow's softmax
/// works on the last axis); a rank-2 tensor is returned as it is.
fn move_class_last(b: &mut Builder, x: &Output, rank: usize) -> Result<Output> {
    if rank <= 2 {
        return Ok(x.clone());
    }
    let mut perm: Vec<i32> = vec![0];
    perm.extend(2..rank as i32);
    perm.push(1);
    b.transpose(x, &perm)
}

/// `LogSoftmax` over the last axis of `x` (of rank `rank`, with `classes`
/// entries on the last axis). TensorFlow's C++ gradient of `LogSoftmax` sums
/// over axis 1, which is the last axis only for rank 2, so a higher-rank `x`
/// goes through `[-1, C]` and back.
pub(crate) fn log_softmax_last(
    b: &mut Builder,
    x: &Output,
    rank: usize,
    classes: i64,
) -> Result<Output> {
    if rank <= 2 {
        return b.log_softmax(x);
    }
    let shape = b.shape_of(x, DataType::Float)?;
    let rows = b.reshape(x, &[-1, classes as i32], DataType::Float)?;
    let rows = b.log_softmax(&rows)?;
    b.reshape_to(&rows, &shape, DataType::Float)
}

/// Flattened class-index targets and what the class losses derive from them.
struct IndexTargets {
    /// int64 `[M]`: the targets, with each ignored one replaced by `C`, the
    /// index of the zero column [`nll_terms`](Self::nll_terms) appends.
    safe: Output,
    /// float32 `[M]`: 1 where the target is not ignored, else 0.
    kept: Output,
    /// float32 `[M]`: each target's class weight (1 without weights), 0 where ignored.
    weight: Output,
    /// The targets' dynamic shape (int32), for unreduced losses.
    shape: Output,
    /// The class count `C`.
    classes: i64,
}

impl IndexTargets {
    /// Flattens `target` and adds a run-time check that every target is in
    /// `[0, C)` or is `ignore_index`, which everything built from the targets
    /// depends on; `weight` holds the class weights, if any.
    fn new(
        b: &mut Builder,
        name: &str,
        target: &Output,
        classes: i64,
        ignore_index: i64,
        weight: Option<&[f32]>,
    ) -> Result<Self> {
        let raw = b.reshape(target, &[-1], DataType::Int64)?;
        let ignore = b.constant(&[ignore_index], &[])?;
        let zero = b.constant(&[0i64], &[])?;
        let count = b.constant(&[classes], &[])?;
        let at_least_zero = int_op(b, "GreaterEqual", &[&raw, &zero], DataType::Int64)?;
        let below_count = int_op(b, "Less", &[&raw, &count], DataType::Int64)?;
        let ignored = int_op(b, "Equal", &[&raw, &ignore], DataType::Int64)?;
        let in_range = b.op("LogicalAnd", &[&at_least_zero, &below_count], &|_| Ok(()))?;
        let valid = b.op("LogicalOr", &[&in_range, &ignored], &|_| Ok(()))?;
        let axis = b.ints(&[0])?;
        let all_valid = b.op("All", &[&valid, &axis], &|nd| {
            nd.set_attr_type("Tidx", DataType::Int32)?;
            nd.set_attr_bool("keep_dims", false)?;
            Ok(())
        })?;
        let check = b.assert(
            &all_valid,
            &format!(
                "{name}: a class-index target is out of bounds: every target must be in \
                 [0, {classes}) or equal ignore_index ({ignore_index})"
            ),
        )?;
        let flat = out0(&b.op_with("Identity", &[&raw], &[&check], &|nd| {
            nd.set_attr_type("T", DataType::Int64)?;
            Ok(())
        })?);
        let ignored = int_op(b, "Equal", &[&flat, &ignore], DataType::Int64)?;
        let safe = b.op("SelectV2", &[&ignored, &count, &flat], &|nd| {
            nd.set_attr_type("T", DataType::Int64)?;
            Ok(())
        })?;
        let not_ignored = b.op("LogicalNot", &[&ignored], &|_| Ok(()))?;
        let kept = b.cast(&not_ignored, DataType::Bool, DataType::Float)?;
        // The weight table has a 0 at index C, for ignored targets.
        let mut table: Vec<f32> = match weight {
            Some(w) => w.to_vec(),
            None => vec![1.0; classes as usize],
        };
        table.push(0.0);
        let table = b.constant(&table, &[table.len() as u64])?;
        let weight = b.gather(&table, &safe, DataType::Int64)?;
        let shape = b.shape_of(target, DataType::Int64)?;
        Ok(IndexTargets {
            safe,
            kept,
            weight,
            shape,
            classes,
        })
    }

    /// `-weight[t] * rows[i, t]` per row `i` of the `[M, C]` log-probabilities
    /// (0 where ignored), picked with a gather so that other classes' values,
    /// even infinite ones, do not enter (as in ATen's `nll_loss`).
    fn nll_terms(&self, b: &mut Builder, rows: &Output) -> Result<Output> {
        let classes = self.classes;
        // A zero column at index C, which ignored targets pick.
        let padded = b.pad(rows, &[[0, 0], [0, 1]], 0.0)?;
        let flat = b.reshape(&padded, &[-1], DataType::Float)?;
        let rows_count = b.op("Size", &[&self.safe], &|nd| {
            nd.set_attr_type("T", DataType::Int64)?;
            nd.set_attr_type("out_type", DataType::Int64)?;
            Ok(())
        })?;
        let stride = b.constant(&[classes + 1], &[])?;
        let start = b.constant(&[0i64], &[])?;
        let limit = int_op(b, "Mul", &[&rows_count, &stride], DataType::Int64)?;
        let offsets = b.op("Range", &[&start, &limit, &stride], &|nd| {
            nd.set_attr_type("Tidx", DataType::Int64)?;
            Ok(())
        })?;
        let index = int_op(b, "AddV2", &[&offsets, &self.safe], DataType::Int64)?;
        let picked = b.gather(&flat, &index, DataType::Int64)?;
        let weighted = b.mul(&self.weight, &picked)?;
        b.unary("Neg", &weighted)
    }

    /// The sum of the picked weights: `nll_loss`'s mean normaliser.
    fn weight_sum(&self, b: &mut Builder) -> Result<Output> {
        b.reduce("Sum", &self.weight, &[0], false)
    }

    /// Reduces flat per-target terms like `nll_loss`.
    fn reduce(&self, b: &mut Builder, terms: &Output, reduction: Reduction) -> Result<Output> {
        match reduction {
            Reduction::None => b.reshape_to(terms, &self.shape, DataType::Float),
            Reduction::Sum => b.reduce("Sum", terms, &[0], false),
            Reduction::Mean => {
                let total = b.reduce("Sum", terms, &[0], false)?;
                let norm = self.weight_sum(b)?;
                b.div(&total, &norm)
            }
        }
    }
}

// ----- elementwise losses -----

/// `0.5 * d^2 / beta` below `beta`, `d - 0.5 * beta` above, for `d = |x - y|`,
/// written as `0.5 * q^2 / beta + (d - q)` with `q = min(d, beta)` so that it
/// needs no `Select`.
fn smooth_l1(b: &mut Builder, input: &Output, target: &Output, beta: f32) -> Result<Output> {
    let diff = b.sub(input, target)?;
    let d = b.unary("Abs", &diff)?;
    let beta_c = b.scalar(beta)?;
    let q = b.minimum(&d, &beta_c)?;
    let half_q = b.mul_scalar(&q, 0.5)?;
    let quad = b.mul(&half_q, &q)?;
    let quad = b.div(&quad, &beta_c)?;
    let linear = b.sub(&d, &q)?;
    b.add(&quad, &linear)
}

/// PyTorch's stable form `(1 - y) * x + (1 + (pw - 1) * y) * softplus(-x)`,
/// with `softplus(-x) = log1p(exp(-|x|)) + (|x| - x) / 2`: the last term is
/// `max(-x, 0)` exactly, and its derivative at `x = 0` is -1/2 (where
/// `Maximum`'s gradient would give -1), so the gradient is right there too.
fn bce_with_logits(
    b: &mut Builder,
    input: &Output,
    target: &Output,
    pos_weight: Option<&[f32]>,
) -> Result<Output> {
    let abs = b.unary("Abs", input)?;
    let neg_abs = b.unary("Neg", &abs)?;
    let exp = b.unary("Exp", &neg_abs)?;
    let log_term = b.unary("Log1p", &exp)?;
    let relu_neg = b.sub(&abs, input)?;
    let relu_neg = b.mul_scalar(&relu_neg, 0.5)?;
    let mut softplus_neg = b.add(&log_term, &relu_neg)?;
    if let Some(pw) = pos_weight {
        let pw_minus_one: Vec<f32> = pw.iter().map(|w| w - 1.0).collect();
        let pw_minus_one = b.constant(&pw_minus_one, &[pw.len() as u64])?;
        let scale = b.mul(&pw_minus_one, target)?;
        let scale = b.add_scalar(&scale, 1.0)?;
        softplus_neg = b.mul(&softplus_neg, &scale)?;
    }
    let one = b.scalar(1.0)?;
    let complement = b.sub(&one, target)?;
    let linear = b.mul(&complement, input)?;
    b.add(&linear, &softplus_neg)
}

/// Reduces a per-element loss of known rank.
fn reduce(b: &mut Builder, x: &Output, rank: usize, reduction: Reduction) -> Result<Output> {
    let axes: Vec<i32> = (0..rank as i32).collect();
    match reduction {
        Reduction::None => Ok(x.clone()),
        Reduction::Sum => b.reduce("Sum", x, &axes, false),
        Reduction::Mean => b.reduce("Mean", x, &axes, false),
    }
}

/// An op whose attribute `T` is `dtype` (integer arithmetic and comparisons).
fn int_op(b: &mut Builder, ty: &str, inputs: &[&Output], dtype: DataType) -> Result<Output> {
    b.op(ty, inputs, &|nd| {
        nd.set_attr_type("T", dtype)?;
        Ok(())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    //! Loss values and input gradients against `torch.nn.functional`
    //! (tests/reference/losses.py), and the validation errors.

    use std::fmt::Write as _;
    use std::path::Path;

    use kiln_core::{
        loss::{
            BceWithLogitsConfig, CrossEntropyConfig, Loss, NllConfig, Reduction, SmoothL1Config,
        },
        state_dict::StateDict,
        DType, Error,
    };
    use tensorflow::{DataType, Session, SessionOptions, SessionRunArgs, Tensor};

    use super::build_loss;
    use crate::graph::Builder;

    /// Absolute and relative tolerance on values and gradients.
    const TOL: f64 = 1e-5;

    /// A class-index or float target.
    #[derive(Clone)]
    enum Target {
        Index(Vec<i64>),
        Float(Vec<f32>),
    }

    struct Case {
        name: String,
        loss: Loss,
        input_dims: Vec<i64>,
        input: Vec<f32>,
        target_dims: Vec<i64>,
        target: Target,
        /// Leave the batch dim unknown (`-1`) in the placeholders.
        dynamic_batch: bool,
    }

    /// A small deterministic generator (64-bit LCG).
    struct Lcg(u64);

    impl Lcg {
        fn uniform(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 40) as f32 / (1u64 << 24) as f32
        }
        fn floats(&mut self, n: usize, scale: f32) -> Vec<f32> {
            (0..n)
                .map(|_| (self.uniform() * 2.0 - 1.0) * scale)
                .collect()
        }
        fn classes(&mut self, n: usize, classes: i64) -> Vec<i64> {
            (0..n)
                .map(|_| ((self.uniform() * classes as f32) as i64).min(classes - 1))
                .collect()
        }
        /// Rows of non-negative values summing to 1 along `axis` 1 of `dims`.
        fn probabilities(&mut self, dims: &[i64]) -> Vec<f32> {
            let (n, c) = (dims[0] as usize, dims[1] as usize);
            let inner: usize = dims[2..].iter().product::<i64>() as usize;
            let mut p: Vec<f32> = (0..n * c * inner).map(|_| self.uniform() + 0.05).collect();
            for i in 0..n {
                for k in 0..inner {
                    let at = |j: usize| (i * c + j) * inner + k;
                    let total: f32 = (0..c).map(|j| p[at(j)]).sum();
                    for j in 0..c {
                        p[at(j)] /= total;
                    }
                }
            }
            p
        }
    }

    fn numel(dims: &[i64]) -> usize {
        dims.iter().product::<i64>() as usize
    }

    fn reduction_name(r: Reduction) -> &'static str {
        match r {
            Reduction::Mean => "mean",
            Reduction::Sum => "sum",
            Reduction::None => "none",
        }
    }

    /// An `f32` as JSON, exactly (through `f64`); infinities as Python's json reads them.
    fn json_f32(v: f32) -> String {
        if v == f32::NEG_INFINITY {
            "-Infinity".to_owned()
        } else if v == f32::INFINITY {
            "Infinity".to_owned()
        } else {
            format!("{:?}", f64::from(v))
        }
    }

    fn json_list<T>(values: &[T], f: impl Fn(&T) -> String) -> String {
        let parts: Vec<String> = values.iter().map(f).collect();
        format!("[{}]", parts.join(","))
    }

    fn json_weights(w: &Option<Vec<f64>>) -> String {
        match w {
            Some(w) => json_list(w, |v| format!("{v:?}")),
            None => "null".to_owned(),
        }
    }

    fn json_loss(loss: &Loss) -> String {
        let r = |r: Reduction| reduction_name(r);
        match loss {
            Loss::CrossEntropy(c) => format!(
                r#"{{"type":"cross_entropy","weight":{},"ignore_index":{},"label_smoothing":{:?},"reduction":"{}"}}"#,
                json_weights(&c.weight),
                c.ignore_index.unwrap_or(-100),
                c.label_smoothing,
                r(c.reduction)
            ),
            Loss::Nll(c) => format!(
                r#"{{"type":"nll","weight":{},"ignore_index":{},"reduction":"{}"}}"#,
                json_weights(&c.weight),
                c.ignore_index.unwrap_or(-100),
                r(c.reduction)
            ),
            Loss::Mse { reduction } => {
                format!(r#"{{"type":"mse","reduction":"{}"}}"#, r(*reduction))
            }
            Loss::L1 { reduction } => format!(r#"{{"type":"l1","reduction":"{}"}}"#, r(*reduction)),
            Loss::SmoothL1(c) => format!(
                r#"{{"type":"smooth_l1","beta":{:?},"reduction":"{}"}}"#,
                c.beta,
                r(c.reduction)
            ),
            Loss::BceWithLogits(c) => format!(
                r#"{{"type":"bce_with_logits","pos_weight":{},"reduction":"{}"}}"#,
                json_weights(&c.pos_weight),
                r(c.reduction)
            ),
            other => panic!("no reference for {other:?}"),
        }
    }

    fn json_cases(cases: &[Case]) -> String {
        let mut out = String::from(r#"{"cases":["#);
        for (i, case) in cases.iter().enumerate() {
            let (dtype, data) = match &case.target {
                Target::Index(t) => ("int64", json_list(t, |v| v.to_string())),
                Target::Float(t) => ("float32", json_list(t, |v| json_f32(*v))),
            };
            write!(
                out,
                r#"{}{{"name":"{}","loss":{},"input":{{"shape":{:?},"dtype":"float32","data":{}}},"target":{{"shape":{:?},"dtype":"{}","data":{}}}}}"#,
                if i == 0 { "" } else { "," },
                case.name,
                json_loss(&case.loss),
                case.input_dims,
                json_list(&case.input, |v| json_f32(*v)),
                case.target_dims,
                dtype,
                data
            )
            .unwrap();
        }
        out.push_str("]}");
        out
    }

    /// The reference values and gradients, or `None` (with a message) without the venv.
    fn torch_reference(test: &str, cases: &[Case]) -> Option<StateDict> {
        let python = kiln_testkit::python(test)?;
        let dir = std::env::temp_dir().join(format!("kiln-tf-losses-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let request = dir.join("cases.json");
        let answer = dir.join("reference.safetensors");
        std::fs::write(&request, json_cases(cases)).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/losses.py");
        kiln_testkit::run_reference(&python, &script, &[&request, &answer]);
        let (dict, _) = StateDict::load_safetensors(&answer).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        Some(dict)
    }

    fn to_u64(dims: &[i64]) -> Vec<u64> {
        dims.iter().map(|&d| d as u64).collect()
    }

    /// The loss and its gradient with respect to the input, as computed by TensorFlow.
    fn run_tf(case: &Case) -> (Vec<u64>, Vec<f32>, Vec<u64>, Vec<f32>) {
        let mut b = Builder::new();
        let unknown_batch = |dims: &[i64]| -> Vec<i64> {
            let mut d = dims.to_vec();
            if case.dynamic_batch && !d.is_empty() {
                d[0] = -1;
            }
            d
        };
        let input_dims = unknown_batch(&case.input_dims);
        let target_dims = unknown_batch(&case.target_dims);
        let input = b.placeholder(DataType::Float, Some(&input_dims)).unwrap();
        let (target_type, target_dtype) = match case.target {
            Target::Index(_) => (DataType::Int64, DType::I64),
            Target::Float(_) => (DataType::Float, DType::F32),
        };
        let target = b.placeholder(target_type, Some(&target_dims)).unwrap();
        let loss = build_loss(
            &mut b,
            &case.loss,
            &input,
            &input_dims,
            &target,
            target_dtype,
            &target_dims,
        )
        .unwrap();
        let grads = b.gradients(&loss, std::slice::from_ref(&input)).unwrap();
        let grad = grads[0].clone().expect("the loss depends on the input");
        let session = Session::new(&SessionOptions::new(), &b.graph).unwrap();
        let x = Tensor::new(&to_u64(&case.input_dims))
            .with_values(&case.input)
            .unwrap();
        let t_index;
        let t_float;
        let mut args = SessionRunArgs::new();
        args.add_feed(&input.operation, input.index, &x);
        match &case.target {
            Target::Index(t) => {
                t_index = Tensor::new(&to_u64(&case.target_dims))
                    .with_values(t)
                    .unwrap();
                args.add_feed(&target.operation, target.index, &t_index);
            }
            Target::Float(t) => {
                t_float = Tensor::new(&to_u64(&case.target_dims))
                    .with_values(t)
                    .unwrap();
                args.add_feed(&target.operation, target.index, &t_float);
            }
        }
        let loss_token = args.request_fetch(&loss.operation, loss.index);
        let grad_token = args.request_fetch(&grad.operation, grad.index);
        session.run(&mut args).unwrap();
        let value: Tensor<f32> = args.fetch(loss_token).unwrap();
        let grad: Tensor<f32> = args.fetch(grad_token).unwrap();
        (
            value.dims().to_vec(),
            value.to_vec(),
            grad.dims().to_vec(),
            grad.to_vec(),
        )
    }

    /// The largest `|a - e| / (1 + |e|)`, asserting it is within [`TOL`].
    fn check_close(what: &str, actual: &[f32], expected: &[f64]) -> f64 {
        assert_eq!(actual.len(), expected.len(), "{what}: element count");
        let mut worst = 0.0f64;
        for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            let a = f64::from(a);
            let err = (a - e).abs() / (1.0 + e.abs());
            assert!(
                err <= TOL,
                "{what}: element {i} is {a} but PyTorch gives {e} (error {err:.3e} > {TOL:.0e})"
            );
            worst = worst.max(err);
        }
        worst
    }

    fn class_case(
        name: &str,
        loss: Loss,
        dims: &[i64],
        ignore: &[(usize, i64)],
        g: &mut Lcg,
    ) -> Case {
        let mut target_dims = dims.to_vec();
        target_dims.remove(1);
        let mut target = g.classes(numel(&target_dims), dims[1]);
        for &(at, value) in ignore {
            target[at] = value;
        }
        Case {
            name: name.to_owned(),
            loss,
            input_dims: dims.to_vec(),
            input: g.floats(numel(dims), 3.0),
            target_dims,
            target: Target::Index(target),
            dynamic_batch: true,
        }
    }

    fn probability_case(name: &str, loss: Loss, dims: &[i64], g: &mut Lcg) -> Case {
        Case {
            name: name.to_owned(),
            loss,
            input_dims: dims.to_vec(),
            input: g.floats(numel(dims), 3.0),
            target_dims: dims.to_vec(),
            target: Target::Float(g.probabilities(dims)),
            dynamic_batch: true,
        }
    }

    fn regression_case(name: &str, loss: Loss, input: Vec<f32>, target: Vec<f32>) -> Case {
        let dims = vec![4, input.len() as i64 / 4];
        Case {
            name: name.to_owned(),
            loss,
            input_dims: dims.clone(),
            input,
            target_dims: dims,
            target: Target::Float(target),
            dynamic_batch: true,
        }
    }

    fn ce(weight: Option<Vec<f64>>, ignore: Option<i64>, smoothing: f64, r: Reduction) -> Loss {
        Loss::CrossEntropy(CrossEntropyConfig {
            weight,
            ignore_index: ignore,
            label_smoothing: smoothing,
            reduction: r,
        })
    }

    fn nll(weight: Option<Vec<f64>>, ignore: Option<i64>, r: Reduction) -> Loss {
        Loss::Nll(NllConfig {
            weight,
            ignore_index: ignore,
            reduction: r,
        })
    }

    fn cases() -> Vec<Case> {
        use Reduction::{Mean, None as Unreduced, Sum};
        let mut g = Lcg(0x5eed);
        let w5 = Some(vec![1.0, 2.0, 0.5, 1.5, 0.25]);
        let w4 = Some(vec![0.5, 2.0, 1.0, 3.0]);
        let mut cases = vec![
            // Cross-entropy on class indices.
            class_case("ce_mean", ce(None, None, 0.0, Mean), &[6, 5], &[], &mut g),
            class_case("ce_sum", ce(None, None, 0.0, Sum), &[6, 5], &[], &mut g),
            class_case(
                "ce_none",
                ce(None, None, 0.0, Unreduced),
                &[6, 5],
                &[],
                &mut g,
            ),
            class_case(
                "ce_weight_mean",
                ce(w5.clone(), None, 0.0, Mean),
                &[7, 5],
                &[],
                &mut g,
            ),
            class_case(
                "ce_weight_ignore_sum",
                ce(w5.clone(), Some(2), 0.0, Sum),
                &[7, 5],
                &[(1, 2), (4, 2)],
                &mut g,
            ),
            class_case(
                "ce_default_ignore_mean",
                ce(None, None, 0.0, Mean),
                &[6, 5],
                &[(0, -100), (3, -100)],
                &mut g,
            ),
            class_case(
                "ce_weight_ignore_none",
                ce(w5.clone(), Some(1), 0.0, Unreduced),
                &[6, 5],
                &[(2, 1), (5, 1)],
                &mut g,
            ),
            // Label smoothing.
            class_case(
                "ce_smooth_mean",
                ce(None, None, 0.1, Mean),
                &[6, 5],
                &[],
                &mut g,
            ),
            class_case(
                "ce_smooth_ignore_sum",
                ce(None, None, 0.15, Sum),
                &[6, 5],
                &[(1, -100)],
                &mut g,
            ),
            class_case(
                "ce_smooth_weight_ignore_mean",
                ce(w5.clone(), Some(3), 0.2, Mean),
                &[8, 5],
                &[(0, 3), (6, 3)],
                &mut g,
            ),
            class_case(
                "ce_smooth_weight_ignore_none",
                ce(w5.clone(), Some(0), 0.3, Unreduced),
                &[6, 5],
                &[(2, 0)],
                &mut g,
            ),
            class_case(
                "ce_smooth_weight_sum",
                ce(w5.clone(), None, 0.1, Sum),
                &[6, 5],
                &[],
                &mut g,
            ),
            // Spatial class dims: [N, C, L] and [N, C, H, W].
            class_case(
                "ce_ncl_mean",
                ce(None, None, 0.0, Mean),
                &[3, 4, 5],
                &[],
                &mut g,
            ),
            class_case(
                "ce_ncl_weight_ignore_sum",
                ce(w4.clone(), None, 0.0, Sum),
                &[3, 4, 5],
                &[(4, -100), (7, -100)],
                &mut g,
            ),
            class_case(
                "ce_nchw_smooth_weight_ignore_none",
                ce(w4.clone(), Some(2), 0.1, Unreduced),
                &[2, 4, 2, 3],
                &[(1, 2), (9, 2)],
                &mut g,
            ),
            class_case(
                "ce_nchw_smooth_weight_ignore_mean",
                ce(w4.clone(), Some(2), 0.1, Mean),
                &[2, 4, 2, 3],
                &[(1, 2), (9, 2)],
                &mut g,
            ),
            // Probability targets.
            probability_case("ce_probs_mean", ce(None, None, 0.0, Mean), &[6, 5], &mut g),
            probability_case(
                "ce_probs_smooth_sum",
                ce(None, None, 0.2, Sum),
                &[6, 5],
                &mut g,
            ),
            probability_case(
                "ce_probs_weight_mean",
                ce(w5.clone(), None, 0.0, Mean),
                &[6, 5],
                &mut g,
            ),
            probability_case(
                "ce_probs_smooth_weight_mean",
                ce(w4.clone(), None, 0.1, Mean),
                &[3, 4, 5],
                &mut g,
            ),
            probability_case(
                "ce_probs_ncl_smooth_none",
                ce(None, None, 0.1, Unreduced),
                &[2, 4, 3],
                &mut g,
            ),
            // Negative log-likelihood (any floats stand in for log-probabilities).
            class_case("nll_mean", nll(None, None, Mean), &[6, 5], &[], &mut g),
            class_case(
                "nll_weight_ignore_mean",
                nll(w5.clone(), Some(4), Mean),
                &[7, 5],
                &[(0, 4), (5, 4)],
                &mut g,
            ),
            class_case(
                "nll_weight_sum",
                nll(w5.clone(), None, Sum),
                &[6, 5],
                &[],
                &mut g,
            ),
            class_case(
                "nll_ncl_ignore_none",
                nll(None, None, Unreduced),
                &[3, 4, 5],
                &[(2, -100)],
                &mut g,
            ),
        ];
        // NLL ignores other classes' log-probabilities entirely, even infinite ones,
        // and an ignored row contributes an exact 0.
        let mut infinite = class_case(
            "nll_infinite_others_mean",
            nll(None, Some(1), Mean),
            &[4, 3],
            &[(3, 1)],
            &mut g,
        );
        let Target::Index(t) = infinite.target.clone() else {
            unreachable!()
        };
        for (row, &class) in t.iter().enumerate() {
            for j in 0..3 {
                if j as i64 != class {
                    infinite.input[row * 3 + j] = f32::NEG_INFINITY;
                }
            }
        }
        cases.push(infinite);

        // Regression losses, with ties (x == y) and |x - y| == beta exactly.
        let mut x = g.floats(12, 2.0);
        let mut y = g.floats(12, 2.0);
        (x[0], y[0]) = (0.75, 0.75);
        (x[1], y[1]) = (1.5, 0.5);
        (x[2], y[2]) = (-0.25, 0.25);
        cases.extend([
            regression_case("mse_mean", Loss::mse(), x.clone(), y.clone()),
            regression_case(
                "mse_sum",
                Loss::mse().with_reduction(Sum),
                x.clone(),
                y.clone(),
            ),
            regression_case(
                "mse_none",
                Loss::mse().with_reduction(Unreduced),
                x.clone(),
                y.clone(),
            ),
            regression_case("l1_mean", Loss::l1(), x.clone(), y.clone()),
            regression_case(
                "l1_sum",
                Loss::l1().with_reduction(Sum),
                x.clone(),
                y.clone(),
            ),
            regression_case(
                "l1_none",
                Loss::l1().with_reduction(Unreduced),
                x.clone(),
                y.clone(),
            ),
            regression_case("smooth_l1_mean", Loss::smooth_l1(), x.clone(), y.clone()),
            regression_case(
                "smooth_l1_none",
                Loss::smooth_l1().with_reduction(Unreduced),
                x.clone(),
                y.clone(),
            ),
            regression_case(
                "smooth_l1_beta_0_5_sum",
                SmoothL1Config::new()
                    .with_beta(0.5)
                    .with_reduction(Sum)
                    .into(),
                x.clone(),
                y.clone(),
            ),
            regression_case(
                "smooth_l1_beta_0_5_none",
                SmoothL1Config::new()
                    .with_beta(0.5)
                    .with_reduction(Unreduced)
                    .into(),
                x.clone(),
                y.clone(),
            ),
        ]);

        // BCE with logits: zero, large and small logits; hard and soft targets.
        let mut logits = g.floats(12, 4.0);
        (logits[0], logits[1], logits[2], logits[3]) = (0.0, 30.0, -30.0, -0.0);
        let targets: Vec<f32> = (0..12)
            .map(|i| match i % 3 {
                0 => 1.0,
                1 => 0.0,
                _ => g.uniform(),
            })
            .collect();
        cases.extend([
            regression_case(
                "bce_mean",
                Loss::bce_with_logits(),
                logits.clone(),
                targets.clone(),
            ),
            regression_case(
                "bce_sum",
                Loss::bce_with_logits().with_reduction(Sum),
                logits.clone(),
                targets.clone(),
            ),
            regression_case(
                "bce_pos_weight_mean",
                BceWithLogitsConfig::new()
                    .with_pos_weight(vec![2.0, 0.5, 3.0])
                    .into(),
                logits.clone(),
                targets.clone(),
            ),
            regression_case(
                "bce_pos_weight_none",
                BceWithLogitsConfig::new()
                    .with_pos_weight(vec![2.0, 0.5, 3.0])
                    .with_reduction(Unreduced)
                    .into(),
                logits.clone(),
                targets.clone(),
            ),
            regression_case(
                "bce_pos_weight_one_sum",
                BceWithLogitsConfig::new()
                    .with_pos_weight(vec![4.0])
                    .with_reduction(Sum)
                    .into(),
                logits.clone(),
                targets.clone(),
            ),
        ]);
        // Static batch dims work the same.
        for name in ["ce_smooth_weight_ignore_mean", "mse_sum", "ce_probs_mean"] {
            let case = cases.iter().find(|c| c.name == name).unwrap();
            cases.push(Case {
                name: format!("{name}_static"),
                loss: case.loss.clone(),
                input_dims: case.input_dims.clone(),
                input: case.input.clone(),
                target_dims: case.target_dims.clone(),
                target: case.target.clone(),
                dynamic_batch: false,
            });
        }
        cases
    }

    #[test]
    fn losses_match_pytorch() {
        let cases = cases();
        let Some(reference) = torch_reference("losses_match_pytorch", &cases) else {
            return;
        };
        let (mut worst_value, mut worst_grad) = ((0.0f64, ""), (0.0f64, ""));
        for case in &cases {
            let (value_dims, value, grad_dims, grad) = run_tf(case);
            let expected_value = reference.get(&format!("{}/value", case.name)).unwrap();
            let expected_grad = reference.get(&format!("{}/grad", case.name)).unwrap();
            let to_u64 = |d: &[usize]| d.iter().map(|&x| x as u64).collect::<Vec<_>>();
            assert_eq!(
                value_dims,
                to_u64(expected_value.dims()),
                "{}: loss shape",
                case.name
            );
            assert_eq!(
                grad_dims,
                to_u64(expected_grad.dims()),
                "{}: gradient shape",
                case.name
            );
            let v = check_close(
                &format!("{} loss", case.name),
                &value,
                &expected_value.to_f64_vec(),
            );
            let g = check_close(
                &format!("{} gradient", case.name),
                &grad,
                &expected_grad.to_f64_vec(),
            );
            if v >= worst_value.0 {
                worst_value = (v, &case.name);
            }
            if g >= worst_grad.0 {
                worst_grad = (g, &case.name);
            }
        }
        eprintln!(
            "{} cases; worst loss error {:.2e} ({}), worst gradient error {:.2e} ({})",
            cases.len(),
            worst_value.0,
            worst_value.1,
            worst_grad.0,
            worst_grad.1
        );
    }

    /// Builds `loss` on placeholders of the given static shapes.
    fn build(loss: &Loss, input_dims: &[i64], target_dtype: DType, target_dims: &[i64]) -> Error {
        let mut b = Builder::new();
        let input = b.placeholder(DataType::Float, Some(input_dims)).unwrap();
        let tf_type = match target_dtype {
            DType::I64 => DataType::Int64,
            DType::I32 => DataType::Int32,
            DType::F64 => DataType::Double,
            _ => DataType::Float,
        };
        let target = b.placeholder(tf_type, Some(target_dims)).unwrap();
        build_loss(
            &mut b,
            loss,
            &input,
            input_dims,
            &target,
            target_dtype,
            target_dims,
        )
        .expect_err("the loss should be rejected")
    }

    #[test]
    fn invalid_targets_are_rejected() {
        let ce = Loss::cross_entropy();
        /// The loss, input dims, target dtype and dims, and the expected message.
        type Rejected = (Loss, &'static [i64], DType, &'static [i64], &'static str);
        let cases: Vec<Rejected> = vec![
            (
                ce.clone(),
                &[-1, 5],
                DType::I32,
                &[-1],
                "cross_entropy class-index targets: expected dtype int64, got int32",
            ),
            (
                Loss::nll(),
                &[-1, 5],
                DType::F32,
                &[-1],
                "nll class-index targets: expected dtype int64, got float32",
            ),
            (
                ce.clone(),
                &[-1, 5, 3],
                DType::I64,
                &[-1, 4],
                "cross_entropy class-index targets: expected shape [?, 3] (the input's shape \
                 [?, 5, 3] without the class dim 1), got [?, 4]",
            ),
            (
                ce.clone(),
                &[6, 5],
                DType::I64,
                &[4],
                "cross_entropy class-index targets: expected shape [6] (the input's shape \
                 [6, 5] without the class dim 1), got [4]",
            ),
            (
                ce.clone(),
                &[-1, 5],
                DType::F32,
                &[-1, 4],
                "cross_entropy probability targets: expected shape [?, 5] (the input's \
                 shape), got [?, 4]",
            ),
            (
                ce.clone(),
                &[-1, 5],
                DType::F64,
                &[-1, 5],
                "cross_entropy probability targets: expected dtype float32, got float64",
            ),
            (
                ce.clone(),
                &[-1],
                DType::I64,
                &[-1],
                "cross_entropy input: expected shape [N, C] or [N, C, d1, ...] with the class \
                 count C known when the graph is built, got [?]",
            ),
            (
                CrossEntropyConfig::new().with_weight(vec![1.0; 4]).into(),
                &[-1, 5],
                DType::I64,
                &[-1],
                "cross_entropy weight: expected shape [5] (one weight per class), got [4]",
            ),
            (
                CrossEntropyConfig::new().with_ignore_index(0).into(),
                &[-1, 5],
                DType::F32,
                &[-1, 5],
                "invalid argument `ignore_index`: is not supported with probability targets, \
                 got 0",
            ),
            (
                CrossEntropyConfig::new().with_label_smoothing(1.5).into(),
                &[-1, 5],
                DType::I64,
                &[-1],
                "invalid argument `label_smoothing`: must be in [0, 1], got 1.5",
            ),
            (
                Loss::mse(),
                &[-1, 3],
                DType::F32,
                &[-1, 3, 1],
                "mse target: expected shape [?, 3] (the input's shape), got [?, 3, 1]",
            ),
            (
                Loss::l1(),
                &[-1, 3],
                DType::I64,
                &[-1, 3],
                "l1 target: expected dtype float32, got int64",
            ),
            (
                BceWithLogitsConfig::new()
                    .with_pos_weight(vec![1.0, 2.0])
                    .into(),
                &[-1, 3],
                DType::F32,
                &[-1, 3],
                "bce_with_logits pos_weight: expected shape [1] or one value per entry of the \
                 last dim of the input [?, 3], got [2]",
            ),
        ];
        for (loss, input_dims, dtype, target_dims, message) in cases {
            let err = build(&loss, input_dims, dtype, target_dims);
            assert_eq!(err.to_string(), message);
            match (&err, message.contains("dtype")) {
                (Error::DTypeMismatch { .. }, true) | (Error::ShapeMismatch { .. }, false) => {}
                (Error::InvalidArgument { .. }, false) => {}
                _ => panic!("unexpected error kind: {err:?}"),
            }
        }
        // An unknown batch dim on either side is compatible with a known one.
        let mut b = Builder::new();
        let input = b.placeholder(DataType::Float, Some(&[6, 5])).unwrap();
        let target = b.placeholder(DataType::Int64, Some(&[-1])).unwrap();
        build_loss(&mut b, &ce, &input, &[6, 5], &target, DType::I64, &[-1]).unwrap();
        build_loss(&mut b, &ce, &input, &[-1, 5], &target, DType::I64, &[6]).unwrap();
    }

    #[test]
    fn out_of_range_targets_fail_the_run() {
        for (loss, target) in [
            (Loss::cross_entropy(), [0i64, 5]),
            (Loss::nll(), [-1, 2]),
            (
                CrossEntropyConfig::new()
                    .with_ignore_index(7)
                    .with_label_smoothing(0.1)
                    .into(),
                [7, 9],
            ),
        ] {
            let mut b = Builder::new();
            let input = b.placeholder(DataType::Float, Some(&[-1, 5])).unwrap();
            let t = b.placeholder(DataType::Int64, Some(&[-1])).unwrap();
            let out = build_loss(&mut b, &loss, &input, &[-1, 5], &t, DType::I64, &[-1]).unwrap();
            let grad = b.gradients(&out, std::slice::from_ref(&input)).unwrap()[0]
                .clone()
                .unwrap();
            let session = Session::new(&SessionOptions::new(), &b.graph).unwrap();
            let x = Tensor::new(&[2, 5]).with_values(&[0.5f32; 10]).unwrap();
            let targets = Tensor::new(&[2]).with_values(&target).unwrap();
            // Fetching only the gradient runs the check too.
            for fetch in [&out, &grad] {
                let mut args = SessionRunArgs::new();
                args.add_feed(&input.operation, 0, &x);
                args.add_feed(&t.operation, 0, &targets);
                args.request_fetch(&fetch.operation, fetch.index);
                let err = session.run(&mut args).expect_err("out-of-range target");
                assert!(err.to_string().contains("out of bounds"), "{err}");
            }
        }
    }
}
