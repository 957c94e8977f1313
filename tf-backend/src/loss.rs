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
mod tests;
