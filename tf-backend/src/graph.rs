//! A thin builder over [`tensorflow::Graph`]: unique op names, typed helpers
//! for the raw ops Kiln's layers, losses and optimizers are made of, and errors
//! that name the op that could not be added.

use kiln_core::{Error, Result};
use tensorflow::{
    DataType, Graph, Operation, OperationDescription, Output, Shape as TfShape, Status, Tensor,
    TensorType,
};

use crate::error::tf_error;

/// Adds operations to a graph under unique, readable names (`scope/Op_12`).
#[derive(Debug)]
pub(crate) struct Builder {
    pub(crate) graph: Graph,
    counter: usize,
    scope: String,
}

/// Output `0` of an operation.
pub(crate) fn out0(op: &Operation) -> Output {
    Output {
        operation: op.clone(),
        index: 0,
    }
}

type Attrs<'a> = &'a dyn Fn(&mut OperationDescription<'_>) -> std::result::Result<(), Status>;

impl Builder {
    /// A builder over an empty graph.
    pub(crate) fn new() -> Self {
        Builder {
            graph: Graph::new(),
            counter: 0,
            scope: String::new(),
        }
    }

    /// A builder adding ops to an existing `graph` (a loaded SavedModel's) under
    /// `scope`, which must be a name prefix the graph does not use yet.
    pub(crate) fn over(graph: Graph, scope: &str) -> Self {
        Builder {
            graph,
            counter: 0,
            scope: scope.to_owned(),
        }
    }

    /// Sets the name scope of the ops added next (`""` for none).
    pub(crate) fn set_scope(&mut self, scope: &str) -> String {
        std::mem::replace(&mut self.scope, scope.replace('.', "/"))
    }

    /// A new op name, unique in the graph: `scope/ty_N`.
    pub(crate) fn name(&mut self, ty: &str) -> String {
        self.counter += 1;
        if self.scope.is_empty() {
            format!("{ty}_{}", self.counter)
        } else {
            format!("{}/{ty}_{}", self.scope, self.counter)
        }
    }

    /// Adds one op with `inputs` (each a single tensor), control inputs and attributes.
    pub(crate) fn op_with(
        &mut self,
        ty: &str,
        inputs: &[&Output],
        control: &[&Operation],
        attrs: Attrs<'_>,
    ) -> Result<Operation> {
        let name = self.name(ty);
        let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
            let mut nd = graph.new_operation(ty, &name)?;
            for input in inputs {
                nd.add_input((*input).clone());
            }
            for op in control {
                nd.add_control_input(op);
            }
            attrs(&mut nd)?;
            nd.finish()
        };
        build(&mut self.graph).map_err(|s| tf_error(&format!("adding TensorFlow op {ty}"), s))
    }

    /// Adds one op and returns its first output.
    pub(crate) fn op(&mut self, ty: &str, inputs: &[&Output], attrs: Attrs<'_>) -> Result<Output> {
        Ok(out0(&self.op_with(ty, inputs, &[], attrs)?))
    }

    /// An op of type `T` (float) with the given inputs.
    fn float_op(&mut self, ty: &str, inputs: &[&Output]) -> Result<Output> {
        self.op(
            ty,
            inputs,
            &|nd| Ok(nd.set_attr_type("T", DataType::Float)?),
        )
    }

    // ----- sources -----

    /// A constant tensor.
    pub(crate) fn constant<T: TensorType>(&mut self, values: &[T], dims: &[u64]) -> Result<Output> {
        let tensor = Tensor::new(dims)
            .with_values(values)
            .map_err(|s| tf_error("building a constant", s))?;
        self.op("Const", &[], &|nd| {
            nd.set_attr_type("dtype", T::data_type())?;
            nd.set_attr_tensor("value", tensor.clone())?;
            Ok(())
        })
    }

    /// A float32 scalar constant.
    pub(crate) fn scalar(&mut self, value: f32) -> Result<Output> {
        self.constant(&[value], &[])
    }

    /// An int32 vector constant (shapes, axes, permutations).
    pub(crate) fn ints(&mut self, values: &[i32]) -> Result<Output> {
        self.constant(values, &[values.len() as u64])
    }

    /// A placeholder of `dtype`; `dims` of `None` leaves the shape unknown,
    /// `Some(-1)` entries leave one dimension unknown.
    pub(crate) fn placeholder(&mut self, dtype: DataType, dims: Option<&[i64]>) -> Result<Output> {
        let shape = dims.map(|d| {
            TfShape::from(Some(
                d.iter().map(|&x| (x >= 0).then_some(x)).collect::<Vec<_>>(),
            ))
        });
        self.op("Placeholder", &[], &|nd| {
            nd.set_attr_type("dtype", dtype)?;
            if let Some(shape) = &shape {
                nd.set_attr_shape("shape", shape)?;
            }
            Ok(())
        })
    }

    // ----- resource variables -----

    /// A resource variable handle with a unique shared name.
    pub(crate) fn var_handle(
        &mut self,
        name: &str,
        dtype: DataType,
        dims: &[u64],
    ) -> Result<Output> {
        let shape = TfShape::from(Some(
            dims.iter().map(|&d| Some(d as i64)).collect::<Vec<_>>(),
        ));
        let shared = name.to_owned();
        self.op("VarHandleOp", &[], &|nd| {
            nd.set_attr_type("dtype", dtype)?;
            nd.set_attr_shape("shape", &shape)?;
            nd.set_attr_string("shared_name", &shared)?;
            Ok(())
        })
    }

    /// The variable's current value.
    pub(crate) fn read(&mut self, handle: &Output, dtype: DataType) -> Result<Output> {
        self.op("ReadVariableOp", &[handle], &|nd| {
            Ok(nd.set_attr_type("dtype", dtype)?)
        })
    }

    /// The variable's value, read after every op in `after` ran.
    pub(crate) fn read_after(
        &mut self,
        handle: &Output,
        dtype: DataType,
        after: &[&Operation],
    ) -> Result<Output> {
        Ok(out0(&self.op_with(
            "ReadVariableOp",
            &[handle],
            after,
            &|nd| {
                nd.set_attr_type("dtype", dtype)?;
                Ok(())
            },
        )?))
    }

    /// `variable = value`, after `control`.
    pub(crate) fn assign(
        &mut self,
        handle: &Output,
        value: &Output,
        dtype: DataType,
        control: &[&Operation],
    ) -> Result<Operation> {
        self.op_with("AssignVariableOp", &[handle, value], control, &|nd| {
            nd.set_attr_type("dtype", dtype)?;
            Ok(())
        })
    }

    // ----- elementwise -----

    /// `a + b` (broadcasting).
    pub(crate) fn add(&mut self, a: &Output, b: &Output) -> Result<Output> {
        self.float_op("AddV2", &[a, b])
    }
    /// `a - b`.
    pub(crate) fn sub(&mut self, a: &Output, b: &Output) -> Result<Output> {
        self.float_op("Sub", &[a, b])
    }
    /// `a * b`.
    pub(crate) fn mul(&mut self, a: &Output, b: &Output) -> Result<Output> {
        self.float_op("Mul", &[a, b])
    }
    /// `a / b`.
    pub(crate) fn div(&mut self, a: &Output, b: &Output) -> Result<Output> {
        self.float_op("RealDiv", &[a, b])
    }
    /// `max(a, b)`.
    pub(crate) fn maximum(&mut self, a: &Output, b: &Output) -> Result<Output> {
        self.float_op("Maximum", &[a, b])
    }
    /// `min(a, b)`.
    pub(crate) fn minimum(&mut self, a: &Output, b: &Output) -> Result<Output> {
        self.float_op("Minimum", &[a, b])
    }
    /// `(a - b)^2`.
    pub(crate) fn squared_difference(&mut self, a: &Output, b: &Output) -> Result<Output> {
        self.float_op("SquaredDifference", &[a, b])
    }
    /// `a * c` for a float constant `c`.
    pub(crate) fn mul_scalar(&mut self, a: &Output, c: f32) -> Result<Output> {
        let c = self.scalar(c)?;
        self.mul(a, &c)
    }
    /// `a + c` for a float constant `c`.
    pub(crate) fn add_scalar(&mut self, a: &Output, c: f32) -> Result<Output> {
        let c = self.scalar(c)?;
        self.add(a, &c)
    }
    /// A unary float op (`Relu`, `Tanh`, `Sqrt`, ...).
    pub(crate) fn unary(&mut self, ty: &str, a: &Output) -> Result<Output> {
        self.float_op(ty, &[a])
    }
    /// `x > y` as a bool tensor.
    pub(crate) fn compare(&mut self, ty: &str, a: &Output, b: &Output) -> Result<Output> {
        self.float_op(ty, &[a, b])
    }
    /// Casts to `dtype`.
    pub(crate) fn cast(&mut self, x: &Output, from: DataType, to: DataType) -> Result<Output> {
        self.op("Cast", &[x], &|nd| {
            nd.set_attr_type("SrcT", from)?;
            nd.set_attr_type("DstT", to)?;
            Ok(())
        })
    }
    /// Blocks gradients.
    pub(crate) fn stop_gradient(&mut self, x: &Output) -> Result<Output> {
        self.float_op("StopGradient", &[x])
    }
    /// `LeakyRelu` with slope `alpha`.
    pub(crate) fn leaky_relu(&mut self, x: &Output, alpha: f32) -> Result<Output> {
        self.op("LeakyRelu", &[x], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_float("alpha", alpha)?;
            Ok(())
        })
    }

    // ----- shapes -----

    /// Reshapes to `dims` (`-1` once for an inferred size).
    pub(crate) fn reshape(&mut self, x: &Output, dims: &[i32], dtype: DataType) -> Result<Output> {
        let shape = self.ints(dims)?;
        self.reshape_to(x, &shape, dtype)
    }
    /// Reshapes to a shape given as an int32 tensor.
    pub(crate) fn reshape_to(
        &mut self,
        x: &Output,
        shape: &Output,
        dtype: DataType,
    ) -> Result<Output> {
        self.op("Reshape", &[x, shape], &|nd| {
            nd.set_attr_type("T", dtype)?;
            nd.set_attr_type("Tshape", DataType::Int32)?;
            Ok(())
        })
    }
    /// The dynamic shape of `x` as int32.
    pub(crate) fn shape_of(&mut self, x: &Output, dtype: DataType) -> Result<Output> {
        self.op("Shape", &[x], &|nd| {
            nd.set_attr_type("T", dtype)?;
            nd.set_attr_type("out_type", DataType::Int32)?;
            Ok(())
        })
    }
    /// Permutes dimensions.
    pub(crate) fn transpose(&mut self, x: &Output, perm: &[i32]) -> Result<Output> {
        let perm = self.ints(perm)?;
        self.op("Transpose", &[x, &perm], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_type("Tperm", DataType::Int32)?;
            Ok(())
        })
    }
    /// Pads with a constant.
    pub(crate) fn pad(&mut self, x: &Output, paddings: &[[i32; 2]], value: f32) -> Result<Output> {
        let flat: Vec<i32> = paddings.iter().flatten().copied().collect();
        let p = self.constant(&flat, &[paddings.len() as u64, 2])?;
        if value == 0.0 {
            return self.op("Pad", &[x, &p], &|nd| {
                nd.set_attr_type("T", DataType::Float)?;
                nd.set_attr_type("Tpaddings", DataType::Int32)?;
                Ok(())
            });
        }
        let v = self.scalar(value)?;
        self.op("PadV2", &[x, &p, &v], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_type("Tpaddings", DataType::Int32)?;
            Ok(())
        })
    }
    /// Splits `x` into `n` equal parts along `axis`.
    pub(crate) fn split(&mut self, x: &Output, axis: i32, n: usize) -> Result<Vec<Output>> {
        let axis = self.ints(&[axis])?;
        let axis = self.reshape(&axis, &[], DataType::Int32)?;
        let op = self.op_with("Split", &[&axis, x], &[], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_int("num_split", n as i64)?;
            Ok(())
        })?;
        Ok((0..n as i32)
            .map(|index| Output {
                operation: op.clone(),
                index,
            })
            .collect())
    }
    /// Concatenates along `axis`.
    pub(crate) fn concat(&mut self, parts: &[Output], axis: i32) -> Result<Output> {
        let axis = self.constant(&[axis], &[])?;
        let name = self.name("ConcatV2");
        let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
            let mut nd = graph.new_operation("ConcatV2", &name)?;
            nd.add_input_list(parts);
            nd.add_input(axis.clone());
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_int("N", parts.len() as i64)?;
            nd.set_attr_type("Tidx", DataType::Int32)?;
            nd.finish()
        };
        Ok(out0(&build(&mut self.graph).map_err(|s| {
            tf_error("adding TensorFlow op ConcatV2", s)
        })?))
    }
    /// `einsum(equation, a, b)` on float tensors. Its gradient (TensorFlow's C++
    /// registry) is Einsum ops again, which TensorFlow's oneDNN pass runs as
    /// `_MklEinsum`; `BatchMatMulV2`'s gradient is `BatchMatMulV3`, which it
    /// leaves to Eigen.
    pub(crate) fn einsum(&mut self, equation: &str, a: &Output, b: &Output) -> Result<Output> {
        let name = self.name("Einsum");
        let parts = [a.clone(), b.clone()];
        let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
            let mut nd = graph.new_operation("Einsum", &name)?;
            nd.add_input_list(&parts);
            nd.set_attr_string("equation", equation)?;
            nd.set_attr_int("N", 2)?;
            nd.set_attr_type("T", DataType::Float)?;
            nd.finish()
        };
        Ok(out0(
            &build(&mut self.graph).map_err(|s| tf_error("adding TensorFlow op Einsum", s))?,
        ))
    }
    /// `x[..., begin:begin+size, ...]` on every axis (`-1` size: to the end).
    pub(crate) fn slice(&mut self, x: &Output, begin: &[i32], size: &[i32]) -> Result<Output> {
        self.slice_of(x, begin, size, DataType::Float)
    }
    /// [`slice`](Self::slice) of a tensor of `dtype`.
    pub(crate) fn slice_of(
        &mut self,
        x: &Output,
        begin: &[i32],
        size: &[i32],
        dtype: DataType,
    ) -> Result<Output> {
        let b = self.ints(begin)?;
        let s = self.ints(size)?;
        self.op("Slice", &[x, &b, &s], &|nd| {
            nd.set_attr_type("T", dtype)?;
            nd.set_attr_type("Index", DataType::Int32)?;
            Ok(())
        })
    }
    /// Reverses the listed axes.
    pub(crate) fn reverse(&mut self, x: &Output, axes: &[i32]) -> Result<Output> {
        let a = self.ints(axes)?;
        self.op("ReverseV2", &[x, &a], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_type("Tidx", DataType::Int32)?;
            Ok(())
        })
    }

    // ----- reductions -----

    /// A reduction (`Sum`, `Mean`, `Max`) over `axes`.
    pub(crate) fn reduce(
        &mut self,
        ty: &str,
        x: &Output,
        axes: &[i32],
        keep: bool,
    ) -> Result<Output> {
        let a = self.ints(axes)?;
        self.op(ty, &[x, &a], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_type("Tidx", DataType::Int32)?;
            nd.set_attr_bool("keep_dims", keep)?;
            Ok(())
        })
    }
    /// The sum of every element (a scalar), for a tensor of known rank.
    pub(crate) fn sum_all(&mut self, x: &Output, rank: usize) -> Result<Output> {
        let axes: Vec<i32> = (0..rank as i32).collect();
        self.reduce("Sum", x, &axes, false)
    }

    // ----- linear algebra and neural-network ops -----

    /// `a @ b` with optional transposes.
    pub(crate) fn matmul(&mut self, a: &Output, b: &Output, ta: bool, tb: bool) -> Result<Output> {
        self.op("MatMul", &[a, b], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_bool("transpose_a", ta)?;
            nd.set_attr_bool("transpose_b", tb)?;
            Ok(())
        })
    }
    /// Softmax over the last axis.
    pub(crate) fn softmax(&mut self, x: &Output) -> Result<Output> {
        self.unary("Softmax", x)
    }
    /// Log-softmax over the last axis.
    pub(crate) fn log_softmax(&mut self, x: &Output) -> Result<Output> {
        self.unary("LogSoftmax", x)
    }
    /// NHWC convolution with `VALID` padding, or `SAME` (zero padding inside the
    /// op, no separate `Pad` and its copy); the filter is `[kh, kw, in, out]`.
    /// (`EXPLICIT` padding would be more general, but the C API's gradient of
    /// `Conv2D` drops its `explicit_paddings`.)
    pub(crate) fn conv2d(
        &mut self,
        x: &Output,
        filter: &Output,
        strides: [i64; 2],
        same: bool,
    ) -> Result<Output> {
        self.op("Conv2D", &[x, filter], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_int_list("strides", &[1, strides[0], strides[1], 1])?;
            nd.set_attr_int_list("dilations", &[1, 1, 1, 1])?;
            nd.set_attr_string("padding", if same { "SAME" } else { "VALID" })?;
            nd.set_attr_string("data_format", "NHWC")?;
            Ok(())
        })
    }
    /// `x + bias` along the last axis (`BiasAdd`: TensorFlow's optimizer fuses it
    /// into a preceding `MatMul` or `Conv2D`, with a following `Relu`).
    pub(crate) fn bias_add(&mut self, x: &Output, bias: &Output) -> Result<Output> {
        self.op("BiasAdd", &[x, bias], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_string("data_format", "NHWC")?;
            Ok(())
        })
    }
    /// NHWC pooling (`MaxPool` or `AvgPool`) with `VALID` padding.
    pub(crate) fn pool(
        &mut self,
        ty: &str,
        x: &Output,
        kernel: [i64; 2],
        strides: [i64; 2],
    ) -> Result<Output> {
        self.op(ty, &[x], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_int_list("ksize", &[1, kernel[0], kernel[1], 1])?;
            nd.set_attr_int_list("strides", &[1, strides[0], strides[1], 1])?;
            nd.set_attr_string("padding", "VALID")?;
            nd.set_attr_string("data_format", "NHWC")?;
            Ok(())
        })
    }
    /// Rows of `params` picked by integer `indices` (axis 0).
    pub(crate) fn gather(
        &mut self,
        params: &Output,
        indices: &Output,
        index_type: DataType,
    ) -> Result<Output> {
        let axis = self.constant(&[0i32], &[])?;
        self.op("GatherV2", &[params, indices, &axis], &|nd| {
            nd.set_attr_type("Tparams", DataType::Float)?;
            nd.set_attr_type("Tindices", index_type)?;
            nd.set_attr_type("Taxis", DataType::Int32)?;
            nd.set_attr_int("batch_dims", 0)?;
            Ok(())
        })
    }
    /// Uniform `[0, 1)` floats of the shape given by the int32 tensor `shape`,
    /// from the stateless generator keyed by an int64 `[2]` `seed`.
    pub(crate) fn stateless_uniform(&mut self, shape: &Output, seed: &Output) -> Result<Output> {
        self.op("StatelessRandomUniform", &[shape, seed], &|nd| {
            nd.set_attr_type("dtype", DataType::Float)?;
            nd.set_attr_type("T", DataType::Int32)?;
            nd.set_attr_type("Tseed", DataType::Int64)?;
            Ok(())
        })
    }
    /// Fails the run with `message` unless the bool scalar `condition` holds.
    pub(crate) fn assert(&mut self, condition: &Output, message: &str) -> Result<Operation> {
        // Built by hand: cloning a string tensor in the `tensorflow` crate crashes.
        let msg = Tensor::<String>::new(&[])
            .with_values(&[message.to_owned()])
            .map_err(|s| tf_error("building an assertion", s))?;
        let text_name = self.name("Const");
        let text = {
            let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
                let mut nd = graph.new_operation("Const", &text_name)?;
                nd.set_attr_type("dtype", DataType::String)?;
                nd.set_attr_tensor("value", msg)?;
                nd.finish()
            };
            out0(&build(&mut self.graph).map_err(|s| tf_error("adding TensorFlow op Const", s))?)
        };
        let name = self.name("Assert");
        let build = |graph: &mut Graph| -> std::result::Result<Operation, Status> {
            let mut nd = graph.new_operation("Assert", &name)?;
            nd.add_input(condition.clone());
            nd.add_input_list(std::slice::from_ref(&text));
            nd.set_attr_type_list("T", &[DataType::String])?;
            nd.set_attr_int("summarize", 3)?;
            nd.finish()
        };
        build(&mut self.graph).map_err(|s| tf_error("adding TensorFlow op Assert", s))
    }

    /// An op that runs only when the bool scalar `flag` is true: every op with a
    /// control dependency on it is skipped otherwise (TensorFlow's dead-branch
    /// propagation through `Switch`, as `tf.cond` builds on).
    pub(crate) fn gate(&mut self, flag: &Output) -> Result<Operation> {
        let switch = self.op_with("Switch", &[flag, flag], &[], &|nd| {
            Ok(nd.set_attr_type("T", DataType::Bool)?)
        })?;
        let taken = Output {
            operation: switch,
            index: 1,
        };
        self.op_with("Identity", &[&taken], &[], &|nd| {
            Ok(nd.set_attr_type("T", DataType::Bool)?)
        })
    }

    /// Whether every element of the float tensor `x` (of rank `rank`) is finite.
    pub(crate) fn all_finite(&mut self, x: &Output, rank: usize) -> Result<Output> {
        let finite = self.op("IsFinite", &[x], &|nd| {
            Ok(nd.set_attr_type("T", DataType::Float)?)
        })?;
        let axes: Vec<i32> = (0..rank as i32).collect();
        let a = self.ints(&axes)?;
        self.op("All", &[&finite, &a], &|nd| {
            nd.set_attr_type("Tidx", DataType::Int32)?;
            nd.set_attr_bool("keep_dims", false)?;
            Ok(())
        })
    }

    /// Symbolic gradients of `y` with respect to each of `xs` (`None` where `y`
    /// does not depend on it), through TensorFlow's gradient registry.
    pub(crate) fn gradients(&mut self, y: &Output, xs: &[Output]) -> Result<Vec<Option<Output>>> {
        // Never pass initial gradients (`dx`): tensorflow 0.21's `add_gradients`
        // frees that array before handing it to `TF_AddGradientsWithPrefix` (it
        // crashed there when tried; BENCHMARKS.md, (b) on TensorFlow).
        self.graph
            .add_gradients(None, std::slice::from_ref(y), xs, None)
            .map_err(|s| {
                Error::backend(
                    "tensorflow",
                    "building the gradient graph (an op without a registered C++ gradient \
                     cannot be differentiated by the TensorFlow backend)",
                    s.to_string(),
                )
            })
    }
}
