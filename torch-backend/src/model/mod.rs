//! [`TorchModel`]: a Kiln [`Layer`] definition built natively on libtorch.
//!
//! The model, its nodes and its forward pass are here; each feature is an
//! `impl TorchModel` block of its own file: building from the definition
//! (`build.rs`), [`Module`] (`module.rs`), dtype and precision
//! (`precision.rs`), LoRA (`lora.rs`), activation checkpointing
//! (`activation_checkpointing.rs`), frozen batch norm
//! (`frozen_batch_norm.rs`), cached decoding (`decode.rs`), TorchScript
//! layers (`script_layers.rs`) and sharded units (`sharding.rs`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_core::{
    backend::Mode,
    lora::LoraConfig,
    model::{Layer, ParamKind, RouterLosses},
    module::Module,
    precision::FloatPrecision,
    state_dict::StateDict,
    DType, Device, Error, Result,
};
use tch::{TchError, Tensor};

use crate::convert::{dtype_from_kind, is_float_kind, kind_from_dtype};
use crate::device::{device_from_tch, device_to_tch};
use crate::error::torch_error;
use crate::layers::{join, Failure, Forward, ForwardResult, Pass, RouterLog};
use crate::script::ScriptModule;

mod activation_checkpointing;
mod build;
mod decode;
mod frozen_batch_norm;
mod lora;
mod module;
mod precision;
mod script_layers;
mod sharding;

use build::{build, collect_entries};
use precision::cast_float;

use kiln_core::module::name_matches;
pub use sharding::ShardedUnit;
use sharding::{has_sharded, Overlay, UnitParams};

/// One named tensor of the model: a trainable parameter or a buffer.
#[derive(Debug)]
struct Entry {
    name: String,
    kind: ParamKind,
    tensor: Tensor,
}

/// The built layer tree: the containers, walked here, around the layers
/// without children, each built and run by its family in [`crate::layers`].
#[derive(Debug)]
enum Node {
    Leaf {
        layer: Box<dyn Forward>,
        path: String,
        /// A batch norm (which [`Freeze::keep_frozen_batch_norm_in_eval`] may pin).
        batch_norm: bool,
        /// Runs in eval behaviour even when the model trains.
        eval: bool,
    },
    /// A TorchScript file ([`Layer::TorchScript`]); its tensors are also the
    /// model's entries (handles sharing storage).
    Script {
        module: Mutex<ScriptModule>,
        path: String,
    },
    Sequential(Vec<Node>),
    Residual(Box<Node>),
    /// [`Layer::Parallel`]: every branch on the same input, summed.
    Parallel(Vec<Node>),
    /// A part whose activations are not kept while training: the backward
    /// pass runs it again ([`TorchModel::checkpoint_activations`]).
    Checkpoint {
        inner: Arc<Node>,
        path: String,
    },
    /// A part whose parameters are sharded across ranks: gathered for its
    /// forward and backward passes, freed after ([`TorchModel::shard_units`]).
    Sharded {
        inner: Arc<Node>,
        unit: Arc<UnitParams>,
    },
}

/// Handles to every parameter and buffer of a model, for a checkpointed part's
/// second run (the model itself may have moved by then).
struct Snapshot(Vec<Tensor>, Option<Arc<RouterLog>>);

impl Snapshot {
    /// Handles to every tensor of `tensors`, and where its routers record.
    fn of(tensors: &dyn crate::layers::Tensors) -> Self {
        Self(
            (0..tensors.count())
                .map(|i| tensors.tensor(i).shallow_clone())
                .collect(),
            tensors.router_log().cloned(),
        )
    }
}

impl crate::layers::Tensors for Snapshot {
    fn tensor(&self, index: usize) -> &Tensor {
        &self.0[index]
    }
    fn count(&self) -> usize {
        self.0.len()
    }
    fn router_log(&self) -> Option<&Arc<RouterLog>> {
        self.1.as_ref()
    }
}

/// The autocast a checkpointed part enters again for its second run, in the
/// backward pass (the forward pass's region is over by then).
#[derive(Clone, Copy)]
struct PartContext {
    autocast: Option<(Device, DType)>,
}

/// Runs `node` on `x` with the model's `tensors`; checkpointed parts as
/// `part` says (`None`: inside one, run plainly).
fn run_node(
    tensors: &dyn crate::layers::Tensors,
    node: &Node,
    x: &Tensor,
    pass: &Pass,
    part: Option<PartContext>,
) -> ForwardResult {
    let train = pass.train;
    match node {
        Node::Sequential(children) => {
            let mut out = x.shallow_clone();
            for child in children {
                out = run_node(tensors, child, &out, pass, part)?;
            }
            Ok(out)
        }
        Node::Residual(block) => Ok(x.f_add(&run_node(tensors, block, x, pass, part)?)?),
        Node::Parallel(branches) => {
            let mut sum: Option<Tensor> = None;
            for branch in branches {
                let y = run_node(tensors, branch, x, pass, part)?;
                sum = Some(match sum {
                    Some(s) => s.f_add(&y)?,
                    None => y,
                });
            }
            sum.ok_or_else(|| Failure::Layer(Error::invalid_argument("branches", "no branch")))
        }
        Node::Leaf { layer, eval, .. } if *eval && train => {
            layer.forward_pass(tensors, x, &pass.with_train(false))
        }
        Node::Leaf { layer, .. } => layer.forward_pass(tensors, x, pass),
        Node::Script { module, .. } => {
            let mut module = lock_script(module).map_err(Failure::Layer)?;
            let mode = if train { Mode::Train } else { Mode::Eval };
            if module.mode() != mode {
                module.set_training(mode).map_err(Failure::Layer)?;
            }
            module.forward(x).map_err(Failure::Layer)
        }
        Node::Checkpoint { inner, path } => match part {
            Some(PartContext { autocast }) if train => {
                let snapshot = Snapshot::of(tensors);
                // Every trainable tensor: the part's own, and any it shares (tied weights).
                let params: Vec<Tensor> = snapshot
                    .0
                    .iter()
                    .filter(|t| t.requires_grad())
                    .map(Tensor::shallow_clone)
                    .collect();
                let inner = Arc::clone(inner);
                let pass = pass.clone();
                let what = format!("the checkpointed part `{path}`");
                crate::checkpoint::checkpoint(x, &params, move |x| {
                    let run = || {
                        run_node(&snapshot, &inner, x, &pass, None).map_err(|e| match e {
                            Failure::Torch(e) => torch_error(&what, e),
                            Failure::Layer(e) => e,
                        })
                    };
                    match autocast {
                        None => run(),
                        Some((device, dtype)) => crate::autocast(device, dtype, run)?,
                    }
                })
                .map_err(Failure::Layer)
            }
            _ => run_node(tensors, inner, x, pass, None),
        },
        Node::Sharded { inner, unit } => {
            // The other tensors (buffers, other units' shards) as they are now.
            let snapshot = Snapshot::of(tensors);
            let inner = Arc::clone(inner);
            let indices = unit.indices.clone();
            let pass = pass.clone();
            crate::sharded_unit::sharded_unit(
                x,
                Arc::clone(&unit.collectives),
                unit.reshard_after_forward,
                move |x, full| {
                    let view = Overlay {
                        base: &snapshot,
                        indices: &indices,
                        full,
                    };
                    run_node(&view, &inner, x, &pass, part).map_err(|e| match e {
                        Failure::Torch(e) => torch_error("a sharded unit of the model", e),
                        Failure::Layer(e) => e,
                    })
                },
            )
            .map_err(Failure::Layer)
        }
    }
}

/// An error naming `key` for the first of `patterns` that matches no layer
/// under `root`, listing some of the layers there are.
fn every_pattern_matches(root: &Node, patterns: &[&str], key: &str) -> Result<()> {
    let mut all = Vec::new();
    layer_paths(root, "", &mut all);
    for pattern in patterns {
        if !all.iter().any(|p| name_matches(pattern, p)) {
            let some: Vec<&str> = all.iter().take(8).map(String::as_str).collect();
            return Err(Error::invalid_argument(
                key,
                format!(
                    "`{pattern}` matches no layer of the model (its layers: {}{})",
                    some.join(", "),
                    if all.len() > some.len() { ", ..." } else { "" }
                ),
            ));
        }
    }
    Ok(())
}

/// The path of every layer under `node` (at `path`), containers included.
/// A checkpointed or sharded part is the layer it wraps.
fn layer_paths(node: &Node, path: &str, out: &mut Vec<String>) {
    if let Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } = node {
        return layer_paths(inner, path, out);
    }
    if !path.is_empty() {
        out.push(path.to_owned());
    }
    match node {
        Node::Sequential(children) | Node::Parallel(children) => {
            for (i, child) in children.iter().enumerate() {
                layer_paths(child, &join(path, &i.to_string()), out);
            }
        }
        Node::Residual(block) => layer_paths(block, &join(path, "block"), out),
        _ => {}
    }
}

/// A model built from a Kiln [`Layer`] on libtorch.
///
/// Parameters and buffers carry PyTorch's `state_dict` names, so weights move
/// between Kiln and Python through safetensors files (see [`TorchModel::save`]).
///
/// ```no_run
/// use kiln_core::{model::{Layer, LinearConfig}, module::Module, Device};
/// use kiln_torch::TorchModel;
///
/// let spec = Layer::Sequential {
///     layers: vec![
///         Layer::Linear(LinearConfig::new(64, 128)),
///         Layer::Relu,
///         Layer::Linear(LinearConfig::new(128, 10)),
///     ],
/// };
/// let model = TorchModel::new(&spec, Device::Cpu)?;
/// let x = tch::Tensor::zeros([8, 64], (tch::Kind::Float, tch::Device::Cpu));
/// assert_eq!(model.forward(&x)?.size(), vec![8, 10]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug)]
pub struct TorchModel {
    spec: Layer,
    root: Node,
    entries: Vec<Entry>,
    mode: Mode,
    device: Device,
    /// The dtype of the floating-point parameters and buffers (`None` when
    /// the model has none): what a floating-point input must be.
    float_dtype: Option<DType>,
    /// How the forward pass computes ([`set_precision`](TorchModel::set_precision)).
    precision: FloatPrecision,
    /// The LoRA adapters added by [`add_lora`](TorchModel::add_lora).
    lora: Option<LoraConfig>,
    /// The patterns of [`checkpoint_activations`](TorchModel::checkpoint_activations).
    checkpointed: Vec<String>,
    /// The router losses of its mixture-of-experts layers, if it has any,
    /// and where a forward pass records their logits.
    routers: Option<(RouterLosses, Arc<RouterLog>)>,
}

impl crate::layers::Tensors for TorchModel {
    fn tensor(&self, index: usize) -> &Tensor {
        TorchModel::tensor(self, index)
    }
    fn count(&self) -> usize {
        self.entries.len()
    }
    fn router_log(&self) -> Option<&Arc<RouterLog>> {
        self.routers.as_ref().map(|(_, log)| log)
    }
}

impl TorchModel {
    /// Builds `spec` on `device` with its initialisers (PyTorch's defaults where
    /// none is given), drawing from libtorch's generator (seed it with
    /// [`kiln_core::backend::Backend::manual_seed`] for reproducible weights). Starts in training mode.
    ///
    /// A [`Layer::TorchScript`] layer loads its file onto `device`: its
    /// parameters and buffers join the model's under the layer's path
    /// (`0.layer1.0.bn1.running_mean`), frozen when the layer is not
    /// `trainable`. A missing or unreadable file is an error naming the layer.
    pub fn new(spec: &Layer, device: Device) -> Result<Self> {
        spec.validate()?;
        let target = device_to_tch(device)?;
        let mut entries = Vec::new();
        let mut scripts = HashMap::new();
        let mut float = false;
        tch::no_grad(|| {
            collect_entries(
                spec,
                "",
                device,
                target,
                &mut entries,
                &mut scripts,
                &mut float,
            )
        })?;
        let index: HashMap<&str, usize> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.as_str(), i))
            .collect();
        let root = build(spec, "", &index, None, &mut scripts)?;
        let float_dtype = float.then_some(DType::F32);
        Ok(Self {
            spec: spec.clone(),
            root,
            entries,
            mode: Mode::Train,
            device,
            float_dtype,
            precision: FloatPrecision::F32,
            lora: None,
            checkpointed: Vec::new(),
            routers: RouterLosses::of(spec)?.map(|r| (r, Arc::default())),
        })
    }

    /// The definition this model was built from.
    pub fn spec(&self) -> &Layer {
        &self.spec
    }

    /// The device the parameters live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Moves every parameter and buffer to `device` (like `model.to(device)`).
    /// Build optimizers after moving: they hold the parameters they update.
    pub fn to(&mut self, device: Device) -> Result<()> {
        let target = device_to_tch(device)?;
        if device == self.device {
            return Ok(());
        }
        self.replace_entries(&format!("moving to {device}"), |t| t.f_to_device(target))?;
        self.device = device;
        Ok(())
    }

    /// Writes the state dict to a safetensors file (atomically) that Python's
    /// `safetensors.torch.load_file` reads into the equivalent `torch.nn` model.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut metadata = std::collections::BTreeMap::new();
        metadata.insert("format".to_owned(), "pt".to_owned());
        self.state_tensors()?
            .save_safetensors(path.as_ref(), &metadata)
    }

    /// Loads a safetensors state dict (from [`save`](Self::save) or Python's
    /// `safetensors.torch.save_file`); nothing changes unless every entry matches.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let (state, _) = StateDict::load_safetensors(path.as_ref())?;
        self.load_state_dict(&state)
    }

    /// The input's device must be the model's, and a floating-point input must
    /// have the model's floating-point dtype (integer inputs feed embeddings).
    fn check_input(&self, input: &Tensor) -> Result<()> {
        let device = device_from_tch(input.device())?;
        if device != self.device {
            return Err(Error::DeviceMismatch {
                context: "model input".to_owned(),
                expected: self.device,
                actual: device,
            });
        }
        let kind = input
            .f_kind()
            .map_err(|e| torch_error("reading the input's dtype", e))?;
        if let Some(expected) = self.float_dtype {
            if is_float_kind(kind) && kind != kind_from_dtype(expected)? {
                return Err(Error::DTypeMismatch {
                    context: "model input (convert it, or the model with `to_dtype`)".to_owned(),
                    expected,
                    actual: dtype_from_kind(kind)?,
                });
            }
        }
        Ok(())
    }

    /// Why libtorch rejected `input`: the definition's shape check names the
    /// layer and both shapes; libtorch's own message when the shapes are fine.
    fn explain_failure(&self, input: &Tensor, error: TchError) -> Error {
        let dims: Vec<usize> = input.size().iter().map(|&d| d as usize).collect();
        match self.spec.output_shape(&dims) {
            // A torchscript layer whose output shape is not recorded stops the
            // shape check: libtorch's message is then the better one.
            Err(shape_error) if !matches!(shape_error, Error::Unsupported { .. }) => shape_error,
            _ => torch_error("forward", error),
        }
    }

    /// The parameter or buffer at `index` in the entries.
    pub(crate) fn tensor(&self, index: usize) -> &Tensor {
        &self.entries[index].tensor
    }

    fn run(&self, node: &Node, x: &Tensor, pass: &Pass) -> ForwardResult {
        let part = PartContext {
            autocast: self.precision.autocast_dtype().map(|d| (self.device, d)),
        };
        run_node(self, node, x, pass, Some(part))
    }

    /// The module of the [`Layer::TorchScript`] layer at `layer` (its path), if any.
    pub(crate) fn script_layer(&self, layer: &str) -> Option<&Mutex<ScriptModule>> {
        fn find<'a>(node: &'a Node, wanted: &str) -> Option<&'a Mutex<ScriptModule>> {
            match node {
                Node::Script { module, path } if path == wanted => Some(module),
                Node::Sequential(children) | Node::Parallel(children) => {
                    children.iter().find_map(|c| find(c, wanted))
                }
                Node::Residual(block) => find(block, wanted),
                Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } => find(inner, wanted),
                _ => None,
            }
        }
        find(&self.root, layer)
    }

    /// The paths of the layers that run in eval behaviour even when the model
    /// trains ([`Freeze::keep_frozen_batch_norm_in_eval`]).
    pub(crate) fn eval_pinned_layers(&self) -> Vec<String> {
        fn walk(node: &Node, out: &mut Vec<String>) {
            match node {
                Node::Leaf {
                    path, eval: true, ..
                } => out.push(path.clone()),
                Node::Sequential(children) | Node::Parallel(children) => {
                    children.iter().for_each(|c| walk(c, out))
                }
                Node::Residual(block) => walk(block, out),
                Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } => walk(inner, out),
                Node::Leaf { .. } | Node::Script { .. } => {}
            }
        }
        let mut out = Vec::new();
        walk(&self.root, &mut out);
        out
    }
}

pub(crate) fn lock_script(module: &Mutex<ScriptModule>) -> Result<MutexGuard<'_, ScriptModule>> {
    module.lock().map_err(|_| {
        Error::backend(
            "torch",
            "running a torchscript layer",
            "an earlier forward pass panicked while holding it",
        )
    })
}
