//! Small ops written for these tests, and a helper to build and run graphs in
//! float32 or float64.

#![allow(dead_code)] // each test binary uses part of it

use kiln_custom_op::{
    AttrValue, Attrs, Context, CustomOp, Float, OpError, OpSchema, Saved, Shape, TensorMut,
    TensorRef,
};
use tensorflow::{
    DataType, Graph, Operation, Output, Session, SessionOptions, SessionRunArgs, Shape as TfShape,
    Status, Tensor,
};

// ----- ops -----

/// `y = max(x, 0)^2`.
pub struct SquaredRelu;

impl CustomOp for SquaredRelu {
    fn schema() -> OpSchema {
        OpSchema::new("tft", "squared_relu")
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
        ctx.map_chunks(outputs[0].data_mut(), 1, 1024, |start, y| {
            for (i, y) in y.iter_mut().enumerate() {
                let r = x[start + i].max(T::ZERO);
                *y = r * r;
            }
        });
        Ok(())
    }
}

/// `dx = grad * 2 max(x, 0)`.
pub struct SquaredReluBackward;

impl CustomOp for SquaredReluBackward {
    fn schema() -> OpSchema {
        OpSchema::new("tft", "squared_relu_backward")
            .input("grad")
            .input("x")
            .output("dx")
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[1].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let (g, x) = (inputs[0].data(), inputs[1].data());
        if g.len() != x.len() {
            return Err(OpError::new("grad and x differ in size"));
        }
        let two = T::from_f64(2.0);
        for ((d, &g), &x) in outputs[0].data_mut().iter_mut().zip(g).zip(x) {
            *d = g * two * x.max(T::ZERO);
        }
        Ok(())
    }
}

/// `y = x * rsqrt(mean(x^2, last dim) + eps) * weight`, `weight` of x's last
/// dimension. Its gradient op gets the output too (`Saved::InputsAndOutputs`).
pub struct RmsNorm;

fn rms_shapes(x: &[i64], weight: &[i64]) -> Result<(), OpError> {
    let last = x.last().copied();
    match (last, weight) {
        (None, _) => Err(OpError::new("x must have at least one dimension")),
        (Some(n), [w]) if n < 0 || *w < 0 || n == *w => Ok(()),
        (Some(n), _) => Err(OpError::new(format!(
            "weight has shape {weight:?}, expected [{n}] (x's last dimension)"
        ))),
    }
}

impl CustomOp for RmsNorm {
    fn schema() -> OpSchema {
        OpSchema::new("tft", "rms_norm")
            .input("x")
            .input("weight")
            .output("y")
            .attr("eps", AttrValue::Float(1e-6))
            .gradient("rms_norm_backward", Saved::InputsAndOutputs)
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        rms_shapes(inputs[0], inputs[1])?;
        Ok(vec![inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        ctx: &Context<'_>,
    ) -> Result<(), OpError> {
        let eps = T::from_f64(attrs.float("eps")?);
        let (x, w) = (inputs[0].data(), inputs[1].data());
        let n = inputs[0].last_dim();
        let nf = T::from_f64(n as f64);
        ctx.map_chunks(outputs[0].data_mut(), n, 16, |start, y| {
            for (r, y) in y.chunks_mut(n).enumerate() {
                let row = &x[start + r * n..start + (r + 1) * n];
                let mut ss = T::ZERO;
                for &v in row {
                    ss += v * v;
                }
                let inv = T::ONE / (ss / nf + eps).sqrt();
                for j in 0..n {
                    y[j] = row[j] * inv * w[j];
                }
            }
        });
        Ok(())
    }
}

/// `(dx, dweight)` of [`RmsNorm`] from `(grad, x, weight, y)`.
pub struct RmsNormBackward;

impl CustomOp for RmsNormBackward {
    fn schema() -> OpSchema {
        OpSchema::new("tft", "rms_norm_backward")
            .input("grad")
            .input("x")
            .input("weight")
            .input("y")
            .output("dx")
            .output("dweight")
            .attr("eps", AttrValue::Float(1e-6))
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        rms_shapes(inputs[1], inputs[2])?;
        Ok(vec![inputs[1].to_vec(), inputs[2].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let eps = T::from_f64(attrs.float("eps")?);
        let (g, x, w, y) = (
            inputs[0].data(),
            inputs[1].data(),
            inputs[2].data(),
            inputs[3].data(),
        );
        let n = inputs[1].last_dim();
        let nf = T::from_f64(n as f64);
        let mut dw = vec![T::ZERO; n];
        {
            let dx = outputs[0].data_mut();
            for r in 0..x.len() / n.max(1) {
                let s = r * n..(r + 1) * n;
                let (gr, xr, yr) = (&g[s.clone()], &x[s.clone()], &y[s.clone()]);
                let mut ss = T::ZERO;
                let mut gy = T::ZERO;
                for j in 0..n {
                    ss += xr[j] * xr[j];
                    gy += gr[j] * yr[j];
                }
                let inv = T::ONE / (ss / nf + eps).sqrt();
                for j in 0..n {
                    dx[s.start + j] = inv * gr[j] * w[j] - inv * inv * xr[j] * gy / nf;
                    dw[j] += gr[j] * xr[j] * inv;
                }
            }
        }
        outputs[1].data_mut().copy_from_slice(&dw);
        Ok(())
    }
}

/// `y[..., j] = s * x[..., j % n]` with the last dimension repeated `k` times and
/// `s = scale` (negated when `negate`): an op whose attributes of every kind
/// reach the kernel and the shape function.
pub struct RepeatScale;

impl CustomOp for RepeatScale {
    fn schema() -> OpSchema {
        OpSchema::new("tft", "repeat_scale")
            .input("x")
            .output("y")
            .attr("k", AttrValue::Int(2))
            .attr("scale", AttrValue::Float(1.0))
            .attr("negate", AttrValue::Bool(false))
    }
    fn output_shapes(inputs: &[&[i64]], attrs: &Attrs) -> Result<Vec<Shape>, OpError> {
        let k = attrs.int("k")?;
        if k < 1 {
            return Err(OpError::new(format!("k must be at least 1, got {k}")));
        }
        let mut shape = inputs[0].to_vec();
        match shape.last_mut() {
            Some(d) if *d >= 0 => *d *= k,
            Some(_) => {}
            None => return Err(OpError::new("x must have at least one dimension")),
        }
        Ok(vec![shape])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let k = attrs.int("k")? as usize;
        let sign = if attrs.bool("negate")? { -1.0 } else { 1.0 };
        let s = T::from_f64(attrs.float("scale")? * sign);
        let x = inputs[0].data();
        let n = inputs[0].last_dim();
        for (i, y) in outputs[0].data_mut().iter_mut().enumerate() {
            let (row, j) = (i / (n * k), i % (n * k));
            *y = s * x[row * n + j % n];
        }
        Ok(())
    }
}

/// Two outputs: `(max(x, 0), min(x, 0))`.
pub struct SplitSign;

impl CustomOp for SplitSign {
    fn schema() -> OpSchema {
        OpSchema::new("tft", "split_sign")
            .input("x")
            .output("pos")
            .output("neg")
            .gradient("split_sign_backward", Saved::Inputs)
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[0].to_vec(), inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let x = inputs[0].data();
        let (pos, neg) = outputs.split_at_mut(1);
        for ((p, q), &v) in pos[0].data_mut().iter_mut().zip(neg[0].data_mut()).zip(x) {
            *p = v.max(T::ZERO);
            *q = v.min(T::ZERO);
        }
        Ok(())
    }
}

/// `dx = g_pos * (x > 0) + g_neg * (x <= 0)`.
pub struct SplitSignBackward;

impl CustomOp for SplitSignBackward {
    fn schema() -> OpSchema {
        OpSchema::new("tft", "split_sign_backward")
            .input("grad_pos")
            .input("grad_neg")
            .input("x")
            .output("dx")
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[2].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        _: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        let (gp, gn, x) = (inputs[0].data(), inputs[1].data(), inputs[2].data());
        for (i, d) in outputs[0].data_mut().iter_mut().enumerate() {
            *d = if x[i] > T::ZERO { gp[i] } else { gn[i] };
        }
        Ok(())
    }
}

/// `y = x`, but an error for a NaN in `x`, and a panic when `explode`.
pub struct Checked;

impl CustomOp for Checked {
    fn schema() -> OpSchema {
        OpSchema::new("tft", "checked")
            .input("x")
            .output("y")
            .attr("explode", AttrValue::Bool(false))
    }
    fn output_shapes(inputs: &[&[i64]], _: &Attrs) -> Result<Vec<Shape>, OpError> {
        Ok(vec![inputs[0].to_vec()])
    }
    fn compute<T: Float>(
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        attrs: &Attrs,
        _: &Context<'_>,
    ) -> Result<(), OpError> {
        if attrs.bool("explode")? {
            panic!("boom from the checked kernel");
        }
        let x = inputs[0].data();
        if let Some(i) = x.iter().position(|v| v.partial_cmp(v).is_none()) {
            return Err(OpError::new(format!("input `x` holds NaN at index {i}")));
        }
        outputs[0].data_mut().copy_from_slice(x);
        Ok(())
    }
}

// ----- graphs -----

/// A graph of one element type, float32 or float64, with helpers that take and
/// return host values as f64.
pub struct Net {
    pub graph: Graph,
    pub dtype: DataType,
    counter: usize,
}

enum Feed {
    F32(Tensor<f32>),
    F64(Tensor<f64>),
}

impl Net {
    pub fn new(dtype: DataType) -> Self {
        Net {
            graph: Graph::new(),
            dtype,
            counter: 0,
        }
    }

    fn fresh(&mut self, prefix: &str) -> String {
        self.counter += 1;
        format!("{prefix}_{}", self.counter)
    }

    /// A placeholder of this net's type and (when given) static shape.
    pub fn placeholder(&mut self, dims: Option<&[i64]>) -> Output {
        let dtype = self.dtype;
        self.placeholder_of(dtype, dims)
    }

    pub fn placeholder_of(&mut self, dtype: DataType, dims: Option<&[i64]>) -> Output {
        let name = self.fresh("x");
        let mut nd = self.graph.new_operation("Placeholder", &name).unwrap();
        nd.set_attr_type("dtype", dtype).unwrap();
        if let Some(dims) = dims {
            let shape = TfShape::from(Some(dims.iter().map(|&d| (d >= 0).then_some(d)).collect()));
            nd.set_attr_shape("shape", &shape).unwrap();
        }
        nd.finish().unwrap().into()
    }

    pub fn constant(&mut self, values: &[f64], dims: &[u64]) -> Output {
        let name = self.fresh("c");
        let mut nd = self.graph.new_operation("Const", &name).unwrap();
        nd.set_attr_type("dtype", self.dtype).unwrap();
        match self.dtype {
            DataType::Float => {
                let v: Vec<f32> = values.iter().map(|&v| v as f32).collect();
                nd.set_attr_tensor("value", Tensor::new(dims).with_values(&v).unwrap())
                    .unwrap()
            }
            _ => nd
                .set_attr_tensor("value", Tensor::new(dims).with_values(values).unwrap())
                .unwrap(),
        }
        nd.finish().unwrap().into()
    }

    fn int_constant(&mut self, values: &[i32]) -> Output {
        let name = self.fresh("i");
        let mut nd = self.graph.new_operation("Const", &name).unwrap();
        nd.set_attr_type("dtype", DataType::Int32).unwrap();
        nd.set_attr_tensor(
            "value",
            Tensor::new(&[values.len() as u64])
                .with_values(values)
                .unwrap(),
        )
        .unwrap();
        nd.finish().unwrap().into()
    }

    /// A built-in op (its `T` inferred from the inputs).
    pub fn builtin(&mut self, op_type: &str, inputs: &[Output]) -> Output {
        let name = self.fresh(op_type);
        let mut nd = self.graph.new_operation(op_type, &name).unwrap();
        for i in inputs {
            nd.add_input(i.clone());
        }
        let op: Operation = nd.finish().unwrap();
        op.into()
    }

    /// `x * rsqrt(mean(x^2, -1) + eps) * w` from built-in ops.
    pub fn rms_norm_reference(&mut self, x: &Output, w: &Output, eps: f64) -> Output {
        let sq = self.builtin("Square", std::slice::from_ref(x));
        let axis = self.int_constant(&[-1]);
        let name = self.fresh("mean");
        let mut nd = self.graph.new_operation("Mean", &name).unwrap();
        nd.add_input(sq);
        nd.add_input(axis);
        nd.set_attr_bool("keep_dims", true).unwrap();
        let mean: Output = nd.finish().unwrap().into();
        let eps = self.constant(&[eps], &[]);
        let shifted = self.builtin("AddV2", &[mean, eps]);
        let inv = self.builtin("Rsqrt", &[shifted]);
        let normed = self.builtin("Mul", &[x.clone(), inv]);
        self.builtin("Mul", &[normed, w.clone()])
    }

    /// `sum(y * c)` over all of `y`'s `rank` dimensions.
    pub fn weighted_sum(&mut self, y: &Output, c: &Output, rank: usize) -> Output {
        let prod = self.builtin("Mul", &[y.clone(), c.clone()]);
        let axes: Vec<i32> = (0..rank as i32).collect();
        let axes = self.int_constant(&axes);
        self.builtin("Sum", &[prod, axes])
    }

    /// Runs the graph with `feeds` (placeholder, values, dims) and returns the
    /// `fetches` as f64.
    pub fn run(
        &self,
        feeds: &[(&Output, &[f64], &[u64])],
        fetches: &[Output],
    ) -> Result<Vec<Vec<f64>>, Status> {
        let mut session = Session::new(&SessionOptions::new(), &self.graph)?;
        let tensors: Vec<Feed> = feeds
            .iter()
            .map(|(_, values, dims)| match self.dtype {
                DataType::Float => {
                    let v: Vec<f32> = values.iter().map(|&v| v as f32).collect();
                    Feed::F32(Tensor::new(dims).with_values(&v).unwrap())
                }
                _ => Feed::F64(Tensor::new(dims).with_values(values).unwrap()),
            })
            .collect();
        let mut args = SessionRunArgs::new();
        for ((output, _, _), tensor) in feeds.iter().zip(&tensors) {
            match tensor {
                Feed::F32(t) => args.add_feed(&output.operation, output.index, t),
                Feed::F64(t) => args.add_feed(&output.operation, output.index, t),
            }
        }
        let tokens: Vec<_> = fetches
            .iter()
            .map(|f| args.request_fetch(&f.operation, f.index))
            .collect();
        let result = session.run(&mut args);
        let fetched = result.map(|()| {
            tokens
                .iter()
                .map(|&t| match self.dtype {
                    DataType::Float => args
                        .fetch::<f32>(t)
                        .unwrap()
                        .iter()
                        .map(|&v| f64::from(v))
                        .collect(),
                    _ => args.fetch::<f64>(t).unwrap().to_vec(),
                })
                .collect()
        });
        session.close()?;
        fetched
    }
}

/// `n` deterministic values in [-1, 1), different per `seed` (kiln-testkit's
/// [`noise`](kiln_testkit::noise), the inputs of the torch op tests too).
pub fn values(n: usize, seed: u64) -> Vec<f64> {
    kiln_testkit::noise(n, seed)
        .into_iter()
        .map(f64::from)
        .collect()
}

pub use kiln_testkit::max_abs_diff;
