//! The ops, in Rust, each defined once: a schema, a shape function and a
//! kernel generic over `f32`/`f64`. This file depends on `kiln-custom-op` alone, so the
//! Python library (`torch-library/`) compiles the same file.
//!
//! - [`SquaredRelu`]: `y = max(x, 0)^2` (the Primer activation; the C++ version
//!   is `examples/custom-op`), with [`SquaredReluBackward`].
//! - [`RmsNorm`]: `y = x / sqrt(mean(x^2, last dim) + eps) * weight`, fused, with
//!   [`RmsNormBackward`] computing both gradients in one pass. Neither libtorch
//!   2.11's C++ API nor TensorFlow has it as one kernel.
//! - [`Swish`]: `y = x * sigmoid(beta * x)` with a learned one-element `beta`,
//!   with [`SwishBackward`]: the Rust twin of kiln-fused-ops' C++ `kiln::swish`, which
//!   the benchmark runs side by side.

use kiln_custom_op::{
    AttrValue, Attrs, Context, CustomOp, Float, OpError, OpSchema, Saved, Shape, TensorMut,
    TensorRef,
};

/// The namespace of these ops: `torch.ops.example_rs.*`, TensorFlow op types
/// `ExampleRs*`.
pub const NAMESPACE: &str = "example_rs";

/// Elements per task when an elementwise loop is split across threads.
const GRAIN: usize = 16 * 1024;

/// Checks that two shapes are equal, dimensions that are not known yet (-1)
/// matching anything.
fn same_shape(what: &str, got: &[i64], expected: &[i64], of: &str) -> Result<(), OpError> {
    let fits = got.len() == expected.len()
        && got
            .iter()
            .zip(expected)
            .all(|(&a, &b)| a == b || a == -1 || b == -1);
    if fits {
        Ok(())
    } else {
        Err(OpError::new(format!(
            "{what} has shape {got:?}, expected {of}'s shape {expected:?}"
        )))
    }
}

/// Partial sums of a reduction, one slot per block of a
/// [`Context::map_chunks`] pass, added in block order afterwards: the result
/// depends on the block size (fixed) but not on how many threads ran the
/// blocks or in which order.
struct BlockSums {
    block: usize,
    slots: Vec<std::sync::Mutex<Vec<f64>>>,
}

impl BlockSums {
    /// Slots of `width` sums for the blocks of `block` elements of `len`.
    fn new(len: usize, block: usize, width: usize) -> Self {
        let block = block.max(1);
        BlockSums {
            block,
            slots: (0..len.div_ceil(block))
                .map(|_| std::sync::Mutex::new(vec![0.0; width]))
                .collect(),
        }
    }

    /// Stores the sums of the block starting at element `start`.
    fn store(&self, start: usize, sums: Vec<f64>) {
        if let Some(slot) = self.slots.get(start / self.block) {
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = sums;
        }
    }

    /// The blocks' sums added in block order.
    fn total(self) -> Vec<f64> {
        let mut slots = self
            .slots
            .into_iter()
            .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()));
        let mut total = slots.next().unwrap_or_default();
        for sums in slots {
            for (t, s) in total.iter_mut().zip(sums) {
                *t += s;
            }
        }
        total
    }
}

/// Squared ReLU, `y = max(x, 0)^2`.
#[derive(Debug, Clone, Copy)]
pub struct SquaredRelu;

impl CustomOp for SquaredRelu {
    fn schema() -> OpSchema {
        OpSchema::new(NAMESPACE, "squared_relu")
            .input("x")
            .output("y")
            .gradient("squared_relu_backward", Saved::Inputs)
    }

    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[0].to_vec()])
    }

    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let x = inputs[0].data();
        ctx.map_chunks(outputs[0].data_mut(), 1, GRAIN, |start, y| {
            for (y, &x) in y.iter_mut().zip(&x[start..]) {
                let r = if x > T::ZERO { x } else { T::ZERO };
                *y = r * r;
            }
        });
        Ok(())
    }
}

/// The gradient of [`SquaredRelu`]: `(grad, x) -> grad * 2 max(x, 0)`.
#[derive(Debug, Clone, Copy)]
pub struct SquaredReluBackward;

impl CustomOp for SquaredReluBackward {
    fn schema() -> OpSchema {
        OpSchema::new(NAMESPACE, "squared_relu_backward")
            .input("grad")
            .input("x")
            .output("grad_x")
    }

    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        same_shape("grad", inputs[0], inputs[1], "x")?;
        Ok(vec![inputs[1].to_vec()])
    }

    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let (grad, x) = (inputs[0].data(), inputs[1].data());
        let two = T::ONE + T::ONE;
        ctx.map_chunks(outputs[0].data_mut(), 1, GRAIN, |start, dx| {
            for ((dx, &g), &x) in dx.iter_mut().zip(&grad[start..]).zip(&x[start..]) {
                // Branch-free (a select the compiler vectorises): 2 relu(x) g.
                let r = if x > T::ZERO { x } else { T::ZERO };
                *dx = two * r * g;
            }
        });
        Ok(())
    }
}

/// RMSNorm over the last dimension with a learned scale:
/// `y = x / sqrt(mean(x^2) + eps) * weight`, `x [..., D]`, `weight [D]`.
///
/// The mean of squares is accumulated in `f64` whatever `T` is.
#[derive(Debug, Clone, Copy)]
pub struct RmsNorm;

/// The default `eps`, PyTorch's `nn.RMSNorm` uses the dtype's epsilon; Kiln's
/// layers (and LLaMA) use a fixed one.
pub const RMS_NORM_EPS: f64 = 1e-6;

/// Checks `x [..., D]` against `weight [D]`.
fn rms_norm_shapes(x: &[i64], weight: &[i64]) -> Result<(), OpError> {
    let Some(&d) = x.last() else {
        return Err(OpError::new(
            "x is a scalar, expected at least one dimension (the one normalised)",
        ));
    };
    if weight.len() != 1 || (weight[0] != d && weight[0] != -1 && d != -1) {
        return Err(OpError::new(format!(
            "weight has shape {weight:?}, expected [{d}] (x's last dimension; x has shape {x:?})"
        )));
    }
    Ok(())
}

/// `1 / sqrt(mean(row^2) + eps)`, accumulated in f64.
fn inverse_rms<T: Float>(row: &[T], eps: f64) -> f64 {
    let sum: f64 = row.iter().map(|&v| v.to_f64() * v.to_f64()).sum();
    1.0 / (sum / row.len() as f64 + eps).sqrt()
}

/// Reads `eps`, which must be positive for the op to be defined at zero rows.
fn eps(attrs: &Attrs) -> Result<f64, OpError> {
    let eps = attrs.float("eps")?;
    if eps > 0.0 && eps.is_finite() {
        Ok(eps)
    } else {
        Err(OpError::new(format!(
            "eps is {eps}, expected a positive number"
        )))
    }
}

impl CustomOp for RmsNorm {
    fn schema() -> OpSchema {
        OpSchema::new(NAMESPACE, "rms_norm")
            .input("x")
            .input("weight")
            .output("y")
            .attr("eps", AttrValue::Float(RMS_NORM_EPS))
            .gradient("rms_norm_backward", Saved::Inputs)
    }

    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        rms_norm_shapes(inputs[0], inputs[1])?;
        Ok(vec![inputs[0].to_vec()])
    }

    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let eps = eps(attrs)?;
        let (x, w) = (inputs[0].data(), inputs[1].data());
        let d = inputs[0].last_dim();
        if d == 0 {
            return Ok(());
        }
        ctx.map_chunks(outputs[0].data_mut(), d, rows_per_task(d), |start, y| {
            for (y, x) in y.chunks_exact_mut(d).zip(x[start..].chunks_exact(d)) {
                let r = T::from_f64(inverse_rms(x, eps));
                for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                    *y = x * r * w;
                }
            }
        });
        Ok(())
    }
}

/// Rows per task so that a task has about [`GRAIN`] elements.
fn rows_per_task(d: usize) -> usize {
    (GRAIN / d.max(1)).max(1)
}

/// The gradient of [`RmsNorm`]: `(grad, x, weight) -> (grad_x, grad_weight)`.
///
/// With `r = 1 / sqrt(mean(x^2) + eps)` per row and `D` the row length:
/// `grad_x = r * grad * weight - x * r^3 / D * sum(grad * weight * x)` and
/// `grad_weight = sum over rows of grad * x * r`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormBackward;

impl CustomOp for RmsNormBackward {
    fn schema() -> OpSchema {
        OpSchema::new(NAMESPACE, "rms_norm_backward")
            .input("grad")
            .input("x")
            .input("weight")
            .output("grad_x")
            .output("grad_weight")
            .attr("eps", AttrValue::Float(RMS_NORM_EPS))
    }

    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        rms_norm_shapes(inputs[1], inputs[2])?;
        same_shape("grad", inputs[0], inputs[1], "x")?;
        Ok(vec![inputs[1].to_vec(), inputs[2].to_vec()])
    }

    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let eps = eps(attrs)?;
        let (grad, x, w) = (inputs[0].data(), inputs[1].data(), inputs[2].data());
        let d = inputs[1].last_dim();
        let (grad_x, grad_w) = outputs.split_at_mut(1);
        if d == 0 {
            return Ok(());
        }
        // grad_x row by row, in parallel, and each block's share of
        // grad_weight in the same pass, added in block order after it.
        let rows = rows_per_task(d);
        let partial = BlockSums::new(x.len(), rows * d, d);
        ctx.map_chunks(grad_x[0].data_mut(), d, rows, |start, dx| {
            let mut dw = vec![0.0f64; d];
            for ((dx, x), g) in dx
                .chunks_exact_mut(d)
                .zip(x[start..].chunks_exact(d))
                .zip(grad[start..].chunks_exact(d))
            {
                let r = inverse_rms(x, eps);
                let dot: f64 = g
                    .iter()
                    .zip(x)
                    .zip(w)
                    .map(|((&g, &x), &w)| g.to_f64() * w.to_f64() * x.to_f64())
                    .sum();
                let c = r * r * r / d as f64 * dot;
                for ((((dx, &g), &x), &w), dw) in dx.iter_mut().zip(g).zip(x).zip(w).zip(&mut dw) {
                    let (g, x) = (g.to_f64(), x.to_f64());
                    *dx = T::from_f64(r * g * w.to_f64() - c * x);
                    *dw += g * x * r;
                }
            }
            partial.store(start, dw);
        });
        let sums = partial.total();
        for (dw, s) in grad_w[0].data_mut().iter_mut().zip(sums) {
            *dw = T::from_f64(s);
        }
        Ok(())
    }
}

/// Swish-β, `y = x * sigmoid(beta * x)`, `beta [1]`.
#[derive(Debug, Clone, Copy)]
pub struct Swish;

/// Checks that `beta` has one element.
fn swish_shapes(beta: &[i64]) -> Result<(), OpError> {
    if beta == [1] || beta == [-1] {
        Ok(())
    } else {
        Err(OpError::new(format!(
            "beta has shape {beta:?}, expected [1]"
        )))
    }
}

/// `1 / (1 + e^-v)`.
fn sigmoid<T: Float>(v: T) -> T {
    T::ONE / (T::ONE + (-v).exp())
}

impl CustomOp for Swish {
    fn schema() -> OpSchema {
        OpSchema::new(NAMESPACE, "swish")
            .input("x")
            .input("beta")
            .output("y")
            .gradient("swish_backward", Saved::Inputs)
    }

    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        swish_shapes(inputs[1])?;
        Ok(vec![inputs[0].to_vec()])
    }

    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let (x, beta) = (inputs[0].data(), inputs[1].data()[0]);
        ctx.map_chunks(outputs[0].data_mut(), 1, GRAIN, |start, y| {
            for (y, &x) in y.iter_mut().zip(&x[start..]) {
                *y = x * sigmoid(beta * x);
            }
        });
        Ok(())
    }
}

/// The gradient of [`Swish`]: `(grad, x, beta) -> (grad_x, grad_beta)`, with
/// `s = sigmoid(beta x)`: `grad_x = grad (s + beta x s (1 - s))`,
/// `grad_beta = sum(grad x^2 s (1 - s))` (accumulated in f64, in a fixed order).
#[derive(Debug, Clone, Copy)]
pub struct SwishBackward;

impl CustomOp for SwishBackward {
    fn schema() -> OpSchema {
        OpSchema::new(NAMESPACE, "swish_backward")
            .input("grad")
            .input("x")
            .input("beta")
            .output("grad_x")
            .output("grad_beta")
    }

    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        swish_shapes(inputs[2])?;
        same_shape("grad", inputs[0], inputs[1], "x")?;
        Ok(vec![inputs[1].to_vec(), inputs[2].to_vec()])
    }

    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let (grad, x, beta) = (inputs[0].data(), inputs[1].data(), inputs[2].data()[0]);
        let (grad_x, grad_beta) = outputs.split_at_mut(1);
        // With e = exp(-beta x): s = 1 / (1 + e) and s (1 - s) = e s^2, which
        // keeps its relative precision where 1 - s would cancel. grad_beta's
        // terms have both signs and cancel in the sum: they are taken in f64,
        // per block, and the blocks added in order.
        let partial = BlockSums::new(x.len(), GRAIN, 1);
        ctx.map_chunks(grad_x[0].data_mut(), 1, GRAIN, |start, dx| {
            let mut sum = 0.0f64;
            for ((dx, &g), &x) in dx.iter_mut().zip(&grad[start..]).zip(&x[start..]) {
                let e = (-(beta * x)).exp();
                let s = T::ONE / (T::ONE + e);
                let ds = e * s * s;
                *dx = g * (s + beta * x * ds);
                let x64 = x.to_f64();
                sum += g.to_f64() * x64 * x64 * ds.to_f64();
            }
            partial.store(start, vec![sum]);
        });
        let sum = partial.total().first().copied().unwrap_or(0.0);
        grad_beta[0].data_mut()[0] = T::from_f64(sum);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_custom_op::ThreadPool;

    /// Runs `O` on f64 host buffers with three threads.
    fn run<O: CustomOp>(inputs: &[(&[f64], &[i64])], attrs: &Attrs) -> Vec<Vec<f64>> {
        let views: Vec<_> = inputs
            .iter()
            .map(|(d, s)| TensorRef::new(d, s).expect("view"))
            .collect();
        let shapes = kiln_custom_op::infer_shapes::<O>(
            &inputs.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
            attrs,
        )
        .expect("shapes");
        let mut data: Vec<Vec<f64>> = shapes
            .iter()
            .map(|s| vec![0.0; s.iter().product::<i64>() as usize])
            .collect();
        let mut outs: Vec<_> = data
            .iter_mut()
            .zip(&shapes)
            .map(|(d, s)| TensorMut::new(d, s).expect("view"))
            .collect();
        let pool = ThreadPool::new(3);
        kiln_custom_op::run::<O, f64>(&views, &mut outs, attrs, &Context::new(&pool)).expect("run");
        drop(outs);
        data
    }

    fn rms_norm(x: &[f64], w: &[f64], shape: &[i64]) -> Vec<f64> {
        run::<RmsNorm>(
            &[(x, shape), (w, &shape[1..])],
            &Attrs::defaults(&RmsNorm::schema()),
        )
        .remove(0)
    }

    #[test]
    fn gradients_match_central_differences() {
        let shape = [3, 5];
        let x: Vec<f64> = (0..15).map(|i| ((i * 7 % 11) as f64 - 5.0) / 3.0).collect();
        let w: Vec<f64> = (0..5).map(|i| 0.5 + i as f64 * 0.3).collect();
        let g: Vec<f64> = (0..15).map(|i| ((i * 5 % 7) as f64 - 3.0) / 2.0).collect();
        let attrs = Attrs::defaults(&RmsNormBackward::schema());
        let grads = run::<RmsNormBackward>(&[(&g, &shape), (&x, &shape), (&w, &[5])], &attrs);
        // L = sum(g * rms_norm(x, w)); dL/dv by central differences.
        let loss = |x: &[f64], w: &[f64]| -> f64 {
            rms_norm(x, w, &shape)
                .iter()
                .zip(&g)
                .map(|(y, g)| y * g)
                .sum()
        };
        let h = 1e-6;
        for i in 0..x.len() {
            let (mut up, mut down) = (x.clone(), x.clone());
            up[i] += h;
            down[i] -= h;
            let fd = (loss(&up, &w) - loss(&down, &w)) / (2.0 * h);
            assert!(
                (fd - grads[0][i]).abs() < 1e-7,
                "x[{i}]: {fd} vs {}",
                grads[0][i]
            );
        }
        for i in 0..w.len() {
            let (mut up, mut down) = (w.clone(), w.clone());
            up[i] += h;
            down[i] -= h;
            let fd = (loss(&x, &up) - loss(&x, &down)) / (2.0 * h);
            assert!(
                (fd - grads[1][i]).abs() < 1e-7,
                "w[{i}]: {fd} vs {}",
                grads[1][i]
            );
        }

        // Swish: L = sum(g * swish(x, beta)).
        let beta = [0.7];
        let none = Attrs::default();
        let swish = |x: &[f64], beta: &[f64]| -> f64 {
            let y = run::<Swish>(&[(x, &shape), (beta, &[1])], &none).remove(0);
            y.iter().zip(&g).map(|(y, g)| y * g).sum()
        };
        let grads = run::<SwishBackward>(&[(&g, &shape), (&x, &shape), (&beta, &[1])], &none);
        for i in 0..x.len() {
            let (mut up, mut down) = (x.clone(), x.clone());
            up[i] += h;
            down[i] -= h;
            let fd = (swish(&up, &beta) - swish(&down, &beta)) / (2.0 * h);
            assert!(
                (fd - grads[0][i]).abs() < 1e-7,
                "x[{i}]: {fd} vs {}",
                grads[0][i]
            );
        }
        let fd = (swish(&x, &[beta[0] + h]) - swish(&x, &[beta[0] - h])) / (2.0 * h);
        assert!(
            (fd - grads[1][0]).abs() < 1e-7,
            "beta: {fd} vs {}",
            grads[1][0]
        );

        let x = [-1.5, 0.0, 0.25, 2.0];
        let g = [1.0, 2.0, -3.0, 0.5];
        let dx = run::<SquaredReluBackward>(&[(&g, &[4]), (&x, &[4])], &none).remove(0);
        assert_eq!(dx, [0.0, 0.0, -1.5, 2.0]); // 2 max(x, 0) g, by hand
    }

    #[test]
    fn rms_norm_matches_the_formula() {
        let x = [3.0, 4.0, 0.0, 0.0, 1.0, -1.0];
        let y = rms_norm(&x, &[1.0, 2.0], &[3, 2]);
        // Row [3, 4]: mean square 12.5; row [0, 0]: 0 (eps keeps it finite).
        let r = 1.0 / (12.5f64 + 1e-6).sqrt();
        assert_eq!(y[..2], [3.0 * r, 8.0 * r]);
        assert_eq!(y[2..4], [0.0, 0.0]);
        let r = 1.0 / (1.0f64 + 1e-6).sqrt();
        assert_eq!(y[4..], [r, -2.0 * r]);
    }

    #[test]
    fn bad_shapes_and_attributes_are_named() {
        let attrs = Attrs::defaults(&RmsNorm::schema());
        let err = kiln_custom_op::infer_shapes::<RmsNorm>(&[&[4, 8], &[7]], &attrs).unwrap_err();
        assert_eq!(
            err.to_string(),
            "example_rs::rms_norm: weight has shape [7], expected [8] (x's last dimension; x has shape [4, 8])"
        );
        assert!(kiln_custom_op::infer_shapes::<RmsNorm>(&[&[-1, 8], &[8]], &attrs).is_ok());
        let mut bad = attrs.clone();
        bad.set("eps", AttrValue::Float(0.0)).expect("eps exists");
        let x = [1.0f32; 4];
        let w = [1.0f32; 2];
        let mut y = [0.0f32; 4];
        let err = kiln_custom_op::run::<RmsNorm, f32>(
            &[
                TensorRef::new(&x, &[2, 2]).expect("x"),
                TensorRef::new(&w, &[2]).expect("w"),
            ],
            &mut [TensorMut::new(&mut y, &[2, 2]).expect("y")],
            &bad,
            &Context::serial(),
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("eps is 0, expected a positive number"),
            "{err}"
        );
    }

    #[test]
    fn gradient_ops_fit_their_forward_ops() {
        for (fwd, bwd) in [
            (SquaredRelu::schema(), SquaredReluBackward::schema()),
            (RmsNorm::schema(), RmsNormBackward::schema()),
            (Swish::schema(), SwishBackward::schema()),
        ] {
            fwd.validate().expect("valid");
            bwd.validate().expect("valid");
            fwd.check_gradient_op(&bwd).expect("fits");
        }
    }
}
