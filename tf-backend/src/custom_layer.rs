//! The TensorFlow side of [`Layer::Custom`](kiln_core::model::Layer::Custom): graph
//! builders registered by op name, resolved when a [`TfModel`](crate::TfModel) is built,
//! and the portable builders (standard TensorFlow ops only) a SavedModel export uses.

use std::collections::HashMap;
use std::sync::Arc;

use kiln_core::{
    model::{CustomConfig, CustomLayerRegistry, Layer},
    Result,
};
use tensorflow::{Graph, Output};

/// A custom layer's computation as TensorFlow graph ops: it adds ops to the
/// graph that take the input (`float32`, PyTorch's logical layout, batch first)
/// and the layer's parameters in declaration order, and returns the output, of
/// the input's shape. `name` is unique in the graph: name the main op `name`
/// and any helper ops `name/...`. Gradients come from TensorFlow's gradient
/// registry, so an op of one's own needs a registered gradient function.
pub type CustomLayerFn =
    dyn Fn(&mut Graph, &str, Output, &[Output], &CustomConfig) -> Result<Output> + Send + Sync;

static REGISTRY: CustomLayerRegistry<CustomLayerFn> =
    CustomLayerRegistry::new("TensorFlow", "kiln_tf::register_custom_layer");

/// The portable builders: the same computations from standard TensorFlow ops,
/// for graphs that leave this process.
static PORTABLE: CustomLayerRegistry<CustomLayerFn> = CustomLayerRegistry::new(
    "TensorFlow (portable)",
    "kiln_tf::register_portable_custom_layer",
);

/// Makes `op` (`namespace::name`) available to [`Layer::Custom`](kiln_core::model::Layer::Custom)
/// layers built on TensorFlow. Registering a name again replaces its function, so
/// registering at start-up is idempotent. Models built before keep the function
/// they were built with.
///
/// ```
/// use kiln_core::{model::{CustomConfig, Init, Layer}, module::Module, Device, HostTensor};
/// use kiln_tf::{register_custom_layer, tf_error, TfModel, TfTensor};
/// use tensorflow::{DataType, Graph, Operation, Output, Status};
///
/// // `x * scale` with a learned scale, from TensorFlow's built-in Mul.
/// register_custom_layer("demo::scale", |graph, name, x, params, _config| {
///     let build = |graph: &mut Graph| -> Result<Operation, Status> {
///         let mut op = graph.new_operation("Mul", name)?;
///         op.add_input(x);
///         op.add_input(params[0].clone());
///         op.set_attr_type("T", DataType::Float)?;
///         op.finish()
///     };
///     let operation = build(graph).map_err(|s| tf_error(name, s))?;
///     Ok(Output { operation, index: 0 })
/// });
/// let layer: Layer = CustomConfig::new("demo::scale")
///     .with_param("scale", [1], Init::Constant { value: 2.0 })
///     .into();
/// let model = TfModel::new(&layer, Device::Cpu)?;
/// let x = TfTensor::from_host(&HostTensor::new(vec![1.0f32, -3.0], [2, 1])?)?;
/// assert_eq!(model.forward(&x)?.to_host()?.to_f64_vec(), [2.0, -6.0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn register_custom_layer<F>(op: &str, f: F)
where
    F: Fn(&mut Graph, &str, Output, &[Output], &CustomConfig) -> Result<Output>
        + Send
        + Sync
        + 'static,
{
    REGISTRY.register(op, Arc::new(f));
}

/// Whether `op` is registered with [`register_custom_layer`].
pub fn custom_layer_registered(op: &str) -> bool {
    REGISTRY.contains(op)
}

/// Gives `op` (`namespace::name`) a second, portable graph builder, made only
/// of standard TensorFlow ops (those Python's TensorFlow and TF Serving know,
/// `tf.raw_ops`), that a [`SavedModelExport`](crate::SavedModelExport) builds
/// instead of the function of [`register_custom_layer`]. Register one for a layer
/// whose training-time ops come from a custom op library (a fused kernel): the
/// export then writes its standard-op decomposition, which must compute the
/// same function. Training and [`TfModel`](crate::TfModel)'s forward keep
/// using the function of [`register_custom_layer`].
///
/// `f` has [`CustomLayerFn`]'s signature and contract. A custom layer without a
/// portable builder is exported with its ordinary function, and refused
/// ([`ExportError::NonStandardOp`](kiln_core::export::ExportError::NonStandardOp)) when that
/// adds an op outside TensorFlow's standard set. Registering a name again
/// replaces its portable builder.
///
/// ```
/// use kiln_tf::{portable_custom_layer_registered, register_portable_custom_layer, tf_error};
/// use tensorflow::{Graph, Operation, Output, Status};
///
/// // `x * sigmoid(x)` from TensorFlow's Sigmoid and Mul.
/// register_portable_custom_layer("demo::silu", |graph, name, x, _params, _config| {
///     let build = |graph: &mut Graph| -> Result<Operation, Status> {
///         let mut sigmoid = graph.new_operation("Sigmoid", &format!("{name}/sigmoid"))?;
///         sigmoid.add_input(x.clone());
///         let sigmoid = sigmoid.finish()?;
///         let mut mul = graph.new_operation("Mul", name)?;
///         mul.add_input(x);
///         mul.add_input(Output { operation: sigmoid, index: 0 });
///         mul.finish()
///     };
///     let operation = build(graph).map_err(|s| tf_error(name, s))?;
///     Ok(Output { operation, index: 0 })
/// });
/// assert!(portable_custom_layer_registered("demo::silu"));
/// ```
pub fn register_portable_custom_layer<F>(op: &str, f: F)
where
    F: Fn(&mut Graph, &str, Output, &[Output], &CustomConfig) -> Result<Output>
        + Send
        + Sync
        + 'static,
{
    PORTABLE.register(op, Arc::new(f));
}

/// Whether `op` has a portable builder ([`register_portable_custom_layer`]).
pub fn portable_custom_layer_registered(op: &str) -> bool {
    PORTABLE.contains(op)
}

/// The functions of a model's custom layers, resolved when it is built.
#[derive(Clone, Default)]
pub(crate) struct CustomOps(HashMap<String, Arc<CustomLayerFn>>);

impl std::fmt::Debug for CustomOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl CustomOps {
    /// Looks up every custom layer's op in `spec`; fails on the first one not registered.
    pub(crate) fn resolve(spec: &Layer) -> Result<Self> {
        let mut ops = CustomOps::default();
        ops.collect(spec, "")?;
        Ok(ops)
    }

    fn collect(&mut self, layer: &Layer, path: &str) -> Result<()> {
        let child = |name: &str| {
            if path.is_empty() {
                name.to_owned()
            } else {
                format!("{path}.{name}")
            }
        };
        match layer {
            Layer::Sequential { layers } | Layer::Parallel { branches: layers } => {
                for (i, l) in layers.iter().enumerate() {
                    self.collect(l, &child(&i.to_string()))?;
                }
                Ok(())
            }
            Layer::Residual { block } => self.collect(block, &child("block")),
            Layer::Custom(c) => {
                if !self.0.contains_key(&c.op) {
                    let f = REGISTRY.lookup(&child("op"), &c.op)?;
                    self.0.insert(c.op.clone(), f);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// These functions with each op's portable builder in place of its own
    /// where one is registered ([`register_portable_custom_layer`]).
    pub(crate) fn portable(&self) -> Result<Self> {
        let mut ops = self.clone();
        for (op, f) in &mut ops.0 {
            if PORTABLE.contains(op) {
                *f = PORTABLE.lookup("op", op)?;
                log::debug!("exporting the custom layer op {op} with its portable builder");
            }
        }
        Ok(ops)
    }

    /// The function for `op`, resolved by [`resolve`](Self::resolve).
    pub(crate) fn get(&self, op: &str) -> Result<Arc<CustomLayerFn>> {
        match self.0.get(op) {
            Some(f) => Ok(Arc::clone(f)),
            None => REGISTRY.lookup("op", op),
        }
    }
}
