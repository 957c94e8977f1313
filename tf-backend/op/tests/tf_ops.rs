//! Rust ops in TensorFlow graphs: forward against TensorFlow's own composition of
//! built-in ops (float32, 1e-6), gradients from `Graph::add_gradients` against the
//! composition's (float32) and central finite differences (float64), attributes,
//! two outputs, and errors: a kernel's error and panic fail the run (and the next
//! run works), a wrong dtype, a shape-function error, registering twice.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

mod common;

use std::sync::Once;

use common::*;
use kiln_core::{DType, Error};
use kiln_custom_op::{AttrValue, Attrs, CustomOp, OpSchema};
use kiln_tf_op::{add_op, register};
use tensorflow::{DataType, Output};

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        register::<SquaredRelu>().unwrap();
        register::<SquaredReluBackward>().unwrap();
        // The gradient op first, its forward op later: order does not matter.
        register::<RmsNormBackward>().unwrap();
        register::<RmsNorm>().unwrap();
        register::<RepeatScale>().unwrap();
        register::<SplitSign>().unwrap();
        register::<SplitSignBackward>().unwrap();
        register::<Checked>().unwrap();
    });
}

fn defaults<O: CustomOp>() -> Attrs {
    Attrs::defaults(&O::schema())
}

const DIMS: [u64; 2] = [3, 5];
const IDIMS: [i64; 2] = [3, 5];

/// Each case: the op's output, the reference's, and the gradients of
/// `sum(y * c)` with respect to the inputs from both, in float32.
#[test]
fn forward_and_gradients_match_builtin_compositions_in_float32() {
    setup();
    let x = values(15, 1);
    let w: Vec<f64> = values(5, 2).iter().map(|v| v + 1.5).collect();
    let c = values(15, 3);

    // squared ReLU vs Square(Relu(x))
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(Some(&IDIMS));
    let cc = net.constant(&c, &DIMS);
    let y = add_op::<SquaredRelu>(
        &mut net.graph,
        "sq",
        std::slice::from_ref(&xp),
        &defaults::<SquaredRelu>(),
    )
    .unwrap()
    .remove(0);
    let relu = net.builtin("Relu", std::slice::from_ref(&xp));
    let y_ref = net.builtin("Square", &[relu]);
    let loss = net.weighted_sum(&y, &cc, 2);
    let loss_ref = net.weighted_sum(&y_ref, &cc, 2);
    let g = net
        .graph
        .add_gradients(None, &[loss], std::slice::from_ref(&xp), None)
        .unwrap();
    let g_ref = net
        .graph
        .add_gradients(None, &[loss_ref], std::slice::from_ref(&xp), None)
        .unwrap();
    let out = net
        .run(
            &[(&xp, &x, &DIMS)],
            &[y, y_ref, g[0].clone().unwrap(), g_ref[0].clone().unwrap()],
        )
        .unwrap();
    let (fwd, grad) = (
        max_abs_diff(&out[0], &out[1]),
        max_abs_diff(&out[2], &out[3]),
    );
    eprintln!("squared_relu f32: forward max |diff| {fwd:.2e}, gradient {grad:.2e}");
    assert!(fwd <= 1e-6 && grad <= 1e-6, "{fwd} {grad}");
    assert!(
        out[2].iter().any(|v| v.abs() > 0.01),
        "a non-trivial gradient"
    );

    // RMSNorm (eps 1e-3, not the default) vs x * rsqrt(mean(x^2) + eps) * w
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(Some(&IDIMS));
    let wp = net.placeholder(Some(&[5]));
    let cc = net.constant(&c, &DIMS);
    let mut attrs = defaults::<RmsNorm>();
    attrs.set("eps", AttrValue::Float(1e-3)).unwrap();
    let y = add_op::<RmsNorm>(&mut net.graph, "rms", &[xp.clone(), wp.clone()], &attrs)
        .unwrap()
        .remove(0);
    let y_ref = net.rms_norm_reference(&xp, &wp, f64::from(1e-3_f32));
    let loss = net.weighted_sum(&y, &cc, 2);
    let loss_ref = net.weighted_sum(&y_ref, &cc, 2);
    let g = net
        .graph
        .add_gradients(None, &[loss], &[xp.clone(), wp.clone()], None)
        .unwrap();
    let g_ref = net
        .graph
        .add_gradients(None, &[loss_ref], &[xp.clone(), wp.clone()], None)
        .unwrap();
    let fetch: Vec<Output> = [y, y_ref]
        .into_iter()
        .chain(g.into_iter().chain(g_ref).map(Option::unwrap))
        .collect();
    let out = net
        .run(&[(&xp, &x, &DIMS), (&wp, &w, &[5])], &fetch)
        .unwrap();
    let fwd = max_abs_diff(&out[0], &out[1]);
    let dx = max_abs_diff(&out[2], &out[4]);
    let dw = max_abs_diff(&out[3], &out[5]);
    eprintln!("rms_norm f32: forward max |diff| {fwd:.2e}, dx {dx:.2e}, dweight {dw:.2e}");
    assert!(fwd <= 1e-6 && dx <= 1e-6 && dw <= 1e-6, "{fwd} {dx} {dw}");
}

/// `sum(y * c)` of `build`'s output at `inputs`, in float64.
fn loss_at(
    build: &dyn Fn(&mut Net, &[Output]) -> Output,
    inputs: &[(Vec<f64>, Vec<u64>)],
    c: &[f64],
) -> f64 {
    let mut net = Net::new(DataType::Double);
    let ps: Vec<Output> = inputs.iter().map(|_| net.placeholder(None)).collect();
    let y = build(&mut net, &ps);
    let dims = &inputs[0].1;
    let cc = net.constant(c, dims);
    let loss = net.weighted_sum(&y, &cc, dims.len());
    let feeds: Vec<_> = ps
        .iter()
        .zip(inputs)
        .map(|(p, (v, d))| (p, v.as_slice(), d.as_slice()))
        .collect();
    net.run(&feeds, &[loss]).unwrap()[0][0]
}

/// The gradient of `sum(build(inputs) * c)` from `Graph::add_gradients` and from
/// central differences (h = 1e-6), in float64; returns the largest difference.
fn gradient_vs_finite_differences(
    build: &dyn Fn(&mut Net, &[Output]) -> Output,
    inputs: &[(Vec<f64>, Vec<u64>)],
    c: &[f64],
) -> f64 {
    let mut net = Net::new(DataType::Double);
    let ps: Vec<Output> = inputs.iter().map(|_| net.placeholder(None)).collect();
    let y = build(&mut net, &ps);
    let dims = &inputs[0].1;
    let cc = net.constant(c, dims);
    let loss = net.weighted_sum(&y, &cc, dims.len());
    let grads: Vec<Output> = net
        .graph
        .add_gradients(None, &[loss], &ps, None)
        .unwrap()
        .into_iter()
        .map(Option::unwrap)
        .collect();
    let feeds: Vec<_> = ps
        .iter()
        .zip(inputs)
        .map(|(p, (v, d))| (p, v.as_slice(), d.as_slice()))
        .collect();
    let analytic = net.run(&feeds, &grads).unwrap();
    let h = 1e-6;
    let mut worst = 0.0_f64;
    for (k, (v, _)) in inputs.iter().enumerate() {
        for i in 0..v.len() {
            let mut at = inputs.to_vec();
            at[k].0[i] = v[i] + h;
            let up = loss_at(build, &at, c);
            at[k].0[i] = v[i] - h;
            let down = loss_at(build, &at, c);
            let numeric = (up - down) / (2.0 * h);
            worst = worst.max((numeric - analytic[k][i]).abs());
        }
    }
    worst
}

#[test]
fn gradients_match_finite_differences_in_float64() {
    setup();
    let x = (values(12, 4), vec![3, 4]);
    let w = (values(4, 5).iter().map(|v| v + 1.5).collect(), vec![4]);
    let c = values(12, 6);
    let sq = |net: &mut Net, i: &[Output]| {
        add_op::<SquaredRelu>(&mut net.graph, "sq", i, &defaults::<SquaredRelu>())
            .unwrap()
            .remove(0)
    };
    let d = gradient_vs_finite_differences(&sq, std::slice::from_ref(&x), &c);
    eprintln!("squared_relu f64: gradient vs finite differences max |diff| {d:.2e}");
    assert!(d < 1e-6, "{d}");

    let rms = |net: &mut Net, i: &[Output]| {
        let mut attrs = defaults::<RmsNorm>();
        attrs.set("eps", AttrValue::Float(0.01)).unwrap();
        add_op::<RmsNorm>(&mut net.graph, "rms", i, &attrs)
            .unwrap()
            .remove(0)
    };
    let d = gradient_vs_finite_differences(&rms, &[x.clone(), w], &c);
    eprintln!("rms_norm f64: gradient vs finite differences max |diff| {d:.2e}");
    assert!(d < 1e-6, "{d}");

    // Two outputs, both used: pos * 1 + neg * 3 (through the two outputs' gradients).
    let split_both = |net: &mut Net, i: &[Output]| {
        let out = add_op::<SplitSign>(&mut net.graph, "split", i, &Attrs::default()).unwrap();
        let three = net.constant(&[3.0], &[]);
        let neg3 = net.builtin("Mul", &[out[1].clone(), three]);
        net.builtin("AddV2", &[out[0].clone(), neg3])
    };
    let d = gradient_vs_finite_differences(&split_both, std::slice::from_ref(&x), &c);
    eprintln!("split_sign f64 (both outputs): gradient vs finite differences max |diff| {d:.2e}");
    assert!(d < 1e-6, "{d}");

    // Only the second output used: the first one's gradient arrives as zeros.
    let split_neg = |net: &mut Net, i: &[Output]| {
        add_op::<SplitSign>(&mut net.graph, "split", i, &Attrs::default())
            .unwrap()
            .remove(1)
    };
    let d = gradient_vs_finite_differences(&split_neg, &[x], &c);
    eprintln!(
        "split_sign f64 (second output only): gradient vs finite differences max |diff| {d:.2e}"
    );
    assert!(d < 1e-6, "{d}");
}

#[test]
fn two_outputs_match_relu_and_minimum() {
    setup();
    let x = values(15, 7);
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(None);
    let out = add_op::<SplitSign>(
        &mut net.graph,
        "split",
        std::slice::from_ref(&xp),
        &Attrs::default(),
    )
    .unwrap();
    assert_eq!(out.len(), 2);
    let relu = net.builtin("Relu", std::slice::from_ref(&xp));
    let zero = net.constant(&[0.0], &[]);
    let min = net.builtin("Minimum", &[xp.clone(), zero]);
    let r = net
        .run(
            &[(&xp, &x, &DIMS)],
            &[out[0].clone(), out[1].clone(), relu, min],
        )
        .unwrap();
    assert_eq!(max_abs_diff(&r[0], &r[2]), 0.0);
    assert_eq!(max_abs_diff(&r[1], &r[3]), 0.0);
}

#[test]
fn attributes_reach_the_kernel_and_the_shape_function() {
    setup();
    let x = values(6, 8);
    for (k, scale, negate) in [(2_i64, 1.0_f64, false), (3, 0.1, true)] {
        let mut net = Net::new(DataType::Float);
        let xp = net.placeholder(Some(&[2, 3]));
        let mut attrs = defaults::<RepeatScale>();
        if k != 2 {
            attrs.set("k", AttrValue::Int(k)).unwrap();
            attrs.set("scale", AttrValue::Float(scale)).unwrap();
            attrs.set("negate", AttrValue::Bool(negate)).unwrap();
        }
        let y = add_op::<RepeatScale>(&mut net.graph, "rep", std::slice::from_ref(&xp), &attrs)
            .unwrap()
            .remove(0);
        // The shape function saw k: the static shape is [2, 3k].
        let shape = net.graph.tensor_shape(y.clone()).unwrap();
        assert_eq!(shape.dims(), Some(2));
        assert_eq!(shape[1], Some(3 * k), "static shape {shape:?}");
        // Tile(x, [1, k]) * s from built-ins.
        let name = format!("multiples_{k}");
        let mut nd = net.graph.new_operation("Const", &name).unwrap();
        nd.set_attr_type("dtype", DataType::Int32).unwrap();
        nd.set_attr_tensor(
            "value",
            tensorflow::Tensor::new(&[2])
                .with_values(&[1, k as i32])
                .unwrap(),
        )
        .unwrap();
        let multiples: Output = nd.finish().unwrap().into();
        let tiled = net.builtin("Tile", &[xp.clone(), multiples]);
        let s = net.constant(&[if negate { -scale } else { scale }], &[]);
        let y_ref = net.builtin("Mul", &[tiled, s]);
        let r = net.run(&[(&xp, &x, &[2, 3])], &[y, y_ref]).unwrap();
        assert_eq!(r[0].len(), 6 * k as usize);
        let d = max_abs_diff(&r[0], &r[1]);
        assert!(d <= 1e-6, "k={k} scale={scale} negate={negate}: {d}");
    }
}

#[test]
fn a_kernel_error_fails_the_run_with_its_message() {
    setup();
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(None);
    let y = add_op::<Checked>(
        &mut net.graph,
        "checked",
        std::slice::from_ref(&xp),
        &defaults::<Checked>(),
    )
    .unwrap()
    .remove(0);
    let err = net
        .run(
            &[(&xp, &[1.0, f64::NAN, 2.0], &[3])],
            std::slice::from_ref(&y),
        )
        .unwrap_err();
    let text = err.to_string();
    eprintln!("{text}");
    assert!(
        text.contains("tft::checked: input `x` holds NaN at index 1"),
        "{text}"
    );
    assert_eq!(err.code(), tensorflow::Code::InvalidArgument, "{text}");
    // The kernel works on good input.
    assert_eq!(
        net.run(&[(&xp, &[1.0, 2.0], &[2])], &[y]).unwrap()[0],
        [1.0, 2.0]
    );

    // Known shapes at graph time: the shape function refuses RMSNorm's weight.
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(Some(&[2, 4]));
    let wp = net.placeholder(Some(&[3]));
    let err =
        add_op::<RmsNorm>(&mut net.graph, "rms", &[xp, wp], &defaults::<RmsNorm>()).unwrap_err();
    let text = err.display_chain().to_string();
    eprintln!("{text}");
    assert!(matches!(err, Error::Backend { .. }), "{text}");
    assert!(
        text.contains("weight has shape [3], expected [4] (x's last dimension)"),
        "{text}"
    );
    // Unknown shapes at graph time: the kernel refuses it at run time, same words.
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(None);
    let wp = net.placeholder(None);
    let y = add_op::<RmsNorm>(
        &mut net.graph,
        "rms",
        &[xp.clone(), wp.clone()],
        &defaults::<RmsNorm>(),
    )
    .unwrap()
    .remove(0);
    let err = net
        .run(&[(&xp, &[0.5; 8], &[2, 4]), (&wp, &[1.0; 3], &[3])], &[y])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tft::rms_norm: weight has shape [3], expected [4]"),
        "{err}"
    );
}

#[test]
fn a_panicking_kernel_fails_the_run_and_the_process_goes_on() {
    setup();
    let mut net = Net::new(DataType::Double);
    let xp = net.placeholder(None);
    let mut attrs = defaults::<Checked>();
    attrs.set("explode", AttrValue::Bool(true)).unwrap();
    let bad = add_op::<Checked>(
        &mut net.graph,
        "explodes",
        std::slice::from_ref(&xp),
        &attrs,
    )
    .unwrap()
    .remove(0);
    let good = add_op::<Checked>(
        &mut net.graph,
        "fine",
        std::slice::from_ref(&xp),
        &defaults::<Checked>(),
    )
    .unwrap()
    .remove(0);
    for _ in 0..2 {
        let err = net
            .run(&[(&xp, &[1.0], &[1])], std::slice::from_ref(&bad))
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("tft::checked: the kernel panicked: boom from the checked kernel"),
            "{text}"
        );
        // The next run in the same process works.
        assert_eq!(
            net.run(&[(&xp, &[4.0, 5.0], &[2])], std::slice::from_ref(&good))
                .unwrap()[0],
            [4.0, 5.0]
        );
    }
}

#[test]
fn inputs_of_other_dtypes_are_typed_errors() {
    setup();
    for (dtype, kiln) in [(DataType::Int32, DType::I32), (DataType::Half, DType::F16)] {
        let mut net = Net::new(DataType::Float);
        let xp = net.placeholder_of(dtype, None);
        let err = add_op::<SquaredRelu>(&mut net.graph, "sq", &[xp], &defaults::<SquaredRelu>())
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, Error::DTypeMismatch { actual, .. } if actual == kiln),
            "{text}"
        );
        assert!(text.contains("tft::squared_relu input `x`"), "{text}");
    }
    // Mixed float32 and float64.
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(None);
    let wp = net.placeholder_of(DataType::Double, None);
    let err =
        add_op::<RmsNorm>(&mut net.graph, "rms", &[xp, wp], &defaults::<RmsNorm>()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DTypeMismatch {
                expected: DType::F32,
                actual: DType::F64,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn misuse_is_refused_with_errors_not_aborts() {
    setup();
    // The same op twice.
    let err = register::<SquaredRelu>().unwrap_err().to_string();
    assert!(
        err.contains("tft::squared_relu") && err.contains("already registered"),
        "{err}"
    );
    // An op type TensorFlow has: `mat::mul` is MatMul.
    struct MatMul;
    impl CustomOp for MatMul {
        fn schema() -> OpSchema {
            OpSchema::new("mat", "mul")
                .input("a")
                .input("b")
                .output("c")
        }
        fn output_shapes(
            i: &[&[i64]],
            a: &Attrs,
        ) -> Result<Vec<kiln_custom_op::Shape>, kiln_custom_op::OpError> {
            SquaredRelu::output_shapes(i, a)
        }
        fn compute<T: kiln_custom_op::Float>(
            i: &[kiln_custom_op::TensorRef<'_, T>],
            o: &mut [kiln_custom_op::TensorMut<'_, T>],
            a: &Attrs,
            c: &kiln_custom_op::Context<'_>,
        ) -> Result<(), kiln_custom_op::OpError> {
            SquaredRelu::compute(i, o, a, c)
        }
    }
    let err = register::<MatMul>().unwrap_err().to_string();
    assert!(
        err.contains("MatMul") && err.contains("TensorFlow already has"),
        "{err}"
    );
    // A gradient op that does not fit its op (it lacks `weight`'s gradient).
    struct BadGrad;
    impl CustomOp for BadGrad {
        fn schema() -> OpSchema {
            OpSchema::new("tft", "rms_norm_backward_bad")
                .input("grad")
                .input("x")
                .input("weight")
                .output("dx")
        }
        fn output_shapes(
            i: &[&[i64]],
            a: &Attrs,
        ) -> Result<Vec<kiln_custom_op::Shape>, kiln_custom_op::OpError> {
            SquaredRelu::output_shapes(i, a)
        }
        fn compute<T: kiln_custom_op::Float>(
            i: &[kiln_custom_op::TensorRef<'_, T>],
            o: &mut [kiln_custom_op::TensorMut<'_, T>],
            a: &Attrs,
            c: &kiln_custom_op::Context<'_>,
        ) -> Result<(), kiln_custom_op::OpError> {
            SquaredRelu::compute(i, o, a, c)
        }
    }
    struct NeedsBadGrad;
    impl CustomOp for NeedsBadGrad {
        fn schema() -> OpSchema {
            OpSchema::new("tft", "needs_bad_grad")
                .input("x")
                .input("weight")
                .output("y")
                .gradient("rms_norm_backward_bad", kiln_custom_op::Saved::Inputs)
        }
        fn output_shapes(
            i: &[&[i64]],
            _: &Attrs,
        ) -> Result<Vec<kiln_custom_op::Shape>, kiln_custom_op::OpError> {
            Ok(vec![i[0].to_vec()])
        }
        fn compute<T: kiln_custom_op::Float>(
            _: &[kiln_custom_op::TensorRef<'_, T>],
            _: &mut [kiln_custom_op::TensorMut<'_, T>],
            _: &Attrs,
            _: &kiln_custom_op::Context<'_>,
        ) -> Result<(), kiln_custom_op::OpError> {
            Ok(())
        }
    }
    register::<NeedsBadGrad>().unwrap();
    let err = register::<BadGrad>().unwrap_err().to_string();
    assert!(
        err.contains("returns 2 gradients (one per input), not 1"),
        "{err}"
    );
    // Not registered, wrong input count, an unknown attribute.
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(None);
    let err = add_op::<MatMul>(
        &mut net.graph,
        "m",
        &[xp.clone(), xp.clone()],
        &Attrs::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("not registered"), "{err}");
    let err = add_op::<RmsNorm>(
        &mut net.graph,
        "r",
        std::slice::from_ref(&xp),
        &defaults::<RmsNorm>(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("got 1 inputs, the op takes 2 (x, weight)"),
        "{err}"
    );
    let err = add_op::<SquaredRelu>(&mut net.graph, "s", &[xp], &defaults::<RmsNorm>())
        .unwrap_err()
        .to_string();
    assert!(err.contains("tft::squared_relu.eps"), "{err}");
    // Still working afterwards.
    let mut net = Net::new(DataType::Float);
    let xp = net.placeholder(None);
    let y = add_op::<SquaredRelu>(
        &mut net.graph,
        "sq",
        std::slice::from_ref(&xp),
        &defaults::<SquaredRelu>(),
    )
    .unwrap()
    .remove(0);
    assert_eq!(
        net.run(&[(&xp, &[-1.0, 3.0], &[2])], &[y]).unwrap()[0],
        [0.0, 9.0]
    );
}
