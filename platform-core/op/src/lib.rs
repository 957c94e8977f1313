//! The API for writing your own ops in Rust, defined once and registered in both
//! of Kiln's engines (`kiln::custom_op` in the facade). Kiln's own fused C++/CUDA
//! ops are another crate, `kiln-fused-ops`.
//!
//! An op is a type implementing [`CustomOp`]: its [`OpSchema`] (namespace, name,
//! tensor inputs and outputs, scalar attributes, and the op that computes its
//! gradient), a shape function, and a CPU kernel generic over the element type
//! ([`Float`]: `f32` and `f64`). The same type is registered in libtorch by
//! `kiln_torch_op::register::<Op>()` (through libtorch's stable C ABI: schema,
//! CPU and Meta kernels, autograd through the gradient op) and in TensorFlow by
//! `kiln_tf_op::register::<Op>()` (through TensorFlow's C op and kernel API: op,
//! shape function, CPU kernel, gradient in the graph). Neither engine sees Rust
//! types: both call the kernel through C functions that Kiln generates per op.
//!
//! A kernel reports bad input by returning an [`OpError`]; a panic in a kernel is
//! caught before it reaches C or C++ and becomes an [`OpError`] too. The engines
//! turn either into their own error: a `c10::Error` in libtorch (a `RuntimeError`
//! in Python), the op's failure status in TensorFlow.
//!
//! # Example: squared ReLU and its gradient
//!
//! ```
//! use kiln_custom_op::{CustomOp, Context, Float, OpError, OpSchema, Saved, Shape, TensorMut, TensorRef, Attrs};
//!
//! /// `y = max(x, 0)^2`.
//! struct SquaredRelu;
//!
//! impl CustomOp for SquaredRelu {
//!     fn schema() -> OpSchema {
//!         OpSchema::new("demo", "squared_relu")
//!             .input("x")
//!             .output("y")
//!             .gradient("squared_relu_backward", Saved::Inputs)
//!     }
//!     fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
//!         Ok(vec![inputs[0].to_vec()])
//!     }
//!     fn compute<T: Float>(
//!         inputs: &[TensorRef<'_, T>],
//!         outputs: &mut [TensorMut<'_, T>],
//!         _: &Attrs,
//!         ctx: &Context<'_>,
//!     ) -> Result<(), OpError> {
//!         let x = inputs[0].data();
//!         ctx.map_chunks(outputs[0].data_mut(), 1, 4096, |start, y| {
//!             for (i, y) in y.iter_mut().enumerate() {
//!                 let r = x[start + i].max(T::ZERO);
//!                 *y = r * r;
//!             }
//!         });
//!         Ok(())
//!     }
//! }
//!
//! // What a backend does with it, here on host buffers:
//! let x = [-1.0_f32, 0.5, 2.0];
//! let mut y = [0.0_f32; 3];
//! kiln_custom_op::run::<SquaredRelu, f32>(
//!     &[TensorRef::new(&x, &[3])?],
//!     &mut [TensorMut::new(&mut y, &[3])?],
//!     &Attrs::defaults(&SquaredRelu::schema()),
//!     &Context::serial(),
//! )?;
//! assert_eq!(y, [0.0, 0.25, 4.0]);
//! # Ok::<(), OpError>(())
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod attrs;
mod error;
mod float;
mod parallel;
mod schema;
mod tensor;

use std::panic::{catch_unwind, AssertUnwindSafe};

pub use attrs::{AttrDef, AttrKind, AttrValue, Attrs};
pub use error::OpError;
pub use float::{Float, FloatType};
pub use parallel::{Context, Parallel, Serial, ThreadPool};
pub use schema::{Gradient, OpSchema, Saved};
pub use tensor::{TensorMut, TensorRef};

/// A shape: one size per dimension. In TensorFlow's graph-time shape inference a
/// dimension that is not known yet is `-1`; a shape function passes it on.
pub type Shape = Vec<i64>;

/// An op written in Rust: its schema, shape function and CPU kernel.
///
/// Every tensor input and output of the op has one element type `T` (`f32` or
/// `f64`), chosen by the caller's tensors. Inputs reach the kernel contiguous and
/// row-major; outputs are allocated by the engine with the shapes
/// [`output_shapes`](CustomOp::output_shapes) returned, and the kernel must
/// write every element.
///
/// An op with a [`Gradient`] names another `CustomOp` in the same namespace that
/// computes it; see [`Saved`] for that op's inputs and outputs. Registering the
/// two is order-independent: the engines look the gradient op up when they
/// differentiate.
pub trait CustomOp: Send + Sync + 'static {
    /// The op's name, inputs, outputs, attributes and gradient.
    fn schema() -> OpSchema;

    /// The output shapes for these input shapes (one per input, in order) and
    /// attributes, or an error naming the input that does not fit. Under
    /// TensorFlow's shape inference unknown dimensions are `-1`.
    fn output_shapes(inputs: &[&[i64]], attrs: &Attrs) -> Result<Vec<Shape>, OpError>;

    /// The kernel: reads `inputs`, writes every element of `outputs`.
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError>;
}

/// Runs `O`'s shape function, with the checks every engine makes: one shape
/// per declared output, no negative size other than `-1` (unknown), and a
/// panic caught and returned as [`OpError::Panic`].
pub fn infer_shapes<O: CustomOp>(inputs: &[&[i64]], attrs: &Attrs) -> Result<Vec<Shape>, OpError> {
    let schema = O::schema();
    if inputs.len() != schema.inputs.len() {
        return Err(OpError::new(format!(
            "{}: got {} inputs, expected {} ({})",
            schema.qualified_name(),
            inputs.len(),
            schema.inputs.len(),
            schema.inputs.join(", ")
        )));
    }
    let shapes = catch_panic(&schema, "shape function", || {
        O::output_shapes(inputs, attrs)
    })?;
    if shapes.len() != schema.outputs.len() {
        return Err(OpError::new(format!(
            "{}: the shape function returned {} shapes, the op declares {} outputs",
            schema.qualified_name(),
            shapes.len(),
            schema.outputs.len()
        )));
    }
    for (shape, name) in shapes.iter().zip(&schema.outputs) {
        if shape.iter().any(|&d| d < -1) {
            return Err(OpError::new(format!(
                "{}: the shape function gave output `{name}` the shape {shape:?}",
                schema.qualified_name()
            )));
        }
    }
    Ok(shapes)
}

/// Runs `O`'s kernel on `T`, as the engines do: checks the number of inputs
/// and outputs, and catches a panic in the kernel, returning it as
/// [`OpError::Panic`] so that it never unwinds into C or C++.
pub fn run<O: CustomOp, T: Float>(
    inputs: &[TensorRef<'_, T>],
    outputs: &mut [TensorMut<'_, T>],
    attrs: &Attrs,
    ctx: &Context<'_>,
) -> Result<(), OpError> {
    let schema = O::schema();
    if inputs.len() != schema.inputs.len() || outputs.len() != schema.outputs.len() {
        return Err(OpError::new(format!(
            "{}: got {} inputs and {} outputs, expected {} and {}",
            schema.qualified_name(),
            inputs.len(),
            outputs.len(),
            schema.inputs.len(),
            schema.outputs.len()
        )));
    }
    catch_panic(&schema, "kernel", || {
        O::compute(inputs, outputs, attrs, ctx)
    })
}

/// Calls `f`, turning a panic into [`OpError::Panic`].
fn catch_panic<R>(
    schema: &OpSchema,
    what: &str,
    f: impl FnOnce() -> Result<R, OpError>,
) -> Result<R, OpError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(|e| e.in_op(&schema.qualified_name())),
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic payload".to_owned());
            Err(OpError::Panic {
                op: schema.qualified_name(),
                what: what.to_owned(),
                message,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Scale;

    impl CustomOp for Scale {
        fn schema() -> OpSchema {
            OpSchema::new("t", "scale")
                .input("x")
                .output("y")
                .attr("alpha", AttrValue::Float(2.0))
                .attr("fail", AttrValue::Bool(false))
        }
        fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
            if inputs[0].is_empty() {
                panic!("scalar input");
            }
            Ok(vec![inputs[0].to_vec()])
        }
        fn compute<T: Float>(
            inputs: &[TensorRef<'_, T>],
            outputs: &mut [TensorMut<'_, T>],
            attrs: &Attrs,
            ctx: &Context<'_>,
        ) -> Result<(), OpError> {
            if attrs.bool("fail")? {
                let v: Vec<i32> = Vec::new();
                let _ = v[3];
            }
            let alpha = T::from_f64(attrs.float("alpha")?);
            let x = inputs[0].data();
            ctx.map_chunks(outputs[0].data_mut(), 1, 2, |start, y| {
                for (i, y) in y.iter_mut().enumerate() {
                    *y = alpha * x[start + i];
                }
            });
            Ok(())
        }
    }

    #[test]
    fn runs_the_kernel_with_attributes() {
        let x = [1.0, -2.0, 3.0, 4.5, 5.0];
        let mut y = [0.0; 5];
        let mut attrs = Attrs::defaults(&Scale::schema());
        attrs.set("alpha", AttrValue::Float(-0.5)).unwrap();
        let threads = parallel::ThreadPool::new(3);
        run::<Scale, f64>(
            &[TensorRef::new(&x, &[5]).unwrap()],
            &mut [TensorMut::new(&mut y, &[5]).unwrap()],
            &attrs,
            &Context::new(&threads),
        )
        .unwrap();
        assert_eq!(y, [-0.5, 1.0, -1.5, -2.25, -2.5]);
    }

    #[test]
    fn panics_become_errors() {
        let x = [1.0_f32];
        let mut y = [0.0_f32];
        let mut attrs = Attrs::defaults(&Scale::schema());
        attrs.set("fail", AttrValue::Bool(true)).unwrap();
        let err = run::<Scale, f32>(
            &[TensorRef::new(&x, &[1]).unwrap()],
            &mut [TensorMut::new(&mut y, &[1]).unwrap()],
            &attrs,
            &Context::serial(),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, OpError::Panic { .. }), "{text}");
        assert!(
            text.contains("t::scale") && text.contains("index out of bounds"),
            "{text}"
        );

        let err = infer_shapes::<Scale>(&[&[]], &attrs)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shape function panicked: scalar input"),
            "{err}"
        );
    }

    #[test]
    fn checks_counts_and_shapes() {
        let attrs = Attrs::defaults(&Scale::schema());
        let err = infer_shapes::<Scale>(&[&[2], &[3]], &attrs)
            .unwrap_err()
            .to_string();
        assert!(err.contains("got 2 inputs, expected 1 (x)"), "{err}");
        assert_eq!(
            infer_shapes::<Scale>(&[&[-1, 4]], &attrs).unwrap(),
            [vec![-1, 4]]
        );
        assert!(TensorRef::new(&[1.0_f32; 3], &[2, 2]).is_err());
    }
}
