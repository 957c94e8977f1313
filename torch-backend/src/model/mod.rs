//! [`TorchModel`]: a Kiln [`Layer`] definition built natively on libtorch.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_core::{
    backend::Mode,
    lora::LoraConfig,
    model::{InitDistribution, Layer, ParamKind, ParamSpec},
    module::Module,
    precision::FloatPrecision,
    state_dict::StateDict,
    state_tensors::StateTensors,
    DType, Device, Error, Result,
};
use tch::{Kind, TchError, Tensor};

use crate::backend::TorchBackend;
use crate::convert::{dtype_from_kind, is_float_kind, kind_from_dtype};
use crate::custom::copy_state;
use crate::device::{device_from_tch, device_to_tch};
use crate::error::torch_error;
use crate::freeze::{all_frozen, Freeze};
use crate::layers::{self, join, DecodeStep, Failure, Forward, ForwardResult, Lookup};
use crate::script::ScriptModule;

mod sharding;

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
struct Snapshot(Vec<Tensor>);

impl crate::layers::Tensors for Snapshot {
    fn tensor(&self, index: usize) -> &Tensor {
        &self.0[index]
    }
    fn count(&self) -> usize {
        self.0.len()
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
    train: bool,
    part: Option<PartContext>,
) -> ForwardResult {
    match node {
        Node::Sequential(children) => {
            let mut out = x.shallow_clone();
            for child in children {
                out = run_node(tensors, child, &out, train, part)?;
            }
            Ok(out)
        }
        Node::Residual(block) => Ok(x.f_add(&run_node(tensors, block, x, train, part)?)?),
        Node::Leaf { layer, eval, .. } => layer.forward(tensors, x, train && !eval),
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
                let snapshot = Snapshot(
                    (0..tensors.count())
                        .map(|i| tensors.tensor(i).shallow_clone())
                        .collect(),
                );
                // Every trainable tensor: the part's own, and any it shares (tied weights).
                let params: Vec<Tensor> = snapshot
                    .0
                    .iter()
                    .filter(|t| t.requires_grad())
                    .map(Tensor::shallow_clone)
                    .collect();
                let inner = Arc::clone(inner);
                let what = format!("the checkpointed part `{path}`");
                crate::checkpoint::checkpoint(x, &params, move |x| {
                    let run = || {
                        run_node(&snapshot, &inner, x, true, None).map_err(|e| match e {
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
            _ => run_node(tensors, inner, x, train, None),
        },
        Node::Sharded { inner, unit } => {
            // The other tensors (buffers, other units' shards) as they are now.
            let snapshot = Snapshot(
                (0..tensors.count())
                    .map(|i| tensors.tensor(i).shallow_clone())
                    .collect(),
            );
            let inner = Arc::clone(inner);
            let indices = unit.indices.clone();
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
                    run_node(&view, &inner, x, train, part).map_err(|e| match e {
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
        Node::Sequential(children) => {
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
}

impl crate::layers::Tensors for TorchModel {
    fn tensor(&self, index: usize) -> &Tensor {
        TorchModel::tensor(self, index)
    }
    fn count(&self) -> usize {
        self.entries.len()
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
        })
    }

    /// Adds LoRA adapters to the projections `lora` targets and freezes
    /// everything else, as `peft.get_peft_model` does: each targeted
    /// projection gains `{module}.lora_A.weight` (`[r, in]`, PEFT's
    /// initialisation) and `{module}.lora_B.weight` (`[out, r]`, zero), so
    /// the model computes what it did until the adapters train. Returns the
    /// adapters' parameter names. Call it before [`set_precision`](TorchModel::set_precision)
    /// and before building the optimizer, which then holds the adapters only.
    ///
    /// A target that matches no projection, a model that already has
    /// adapters, or one with TorchScript layers, is an error; the model is
    /// unchanged then.
    ///
    /// ```no_run
    /// use kiln_core::{lora::LoraConfig, model::{Layer, LinearConfig}, Device};
    /// use kiln_torch::TorchModel;
    ///
    /// let spec = Layer::sequential([LinearConfig::new(64, 64).into(), Layer::Relu,
    ///                               LinearConfig::new(64, 10).into()]);
    /// let mut model = TorchModel::new(&spec, Device::Cpu)?;
    /// let adapters = model.add_lora(&LoraConfig::new(8, 16.0).with_target_modules(["0"]))?;
    /// assert_eq!(adapters, ["0.lora_A.weight", "0.lora_B.weight"]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn add_lora(&mut self, lora: &LoraConfig) -> Result<Vec<String>> {
        if has_sharded(&self.root) {
            return Err(Error::invalid_argument(
                "lora",
                "the model is sharded: add the adapters before sharding it (the units are \
                 planned over the parameters there are)",
            ));
        }
        if let Some(existing) = &self.lora {
            return Err(Error::invalid_argument(
                "lora",
                format!(
                    "the model already has LoRA adapters (r = {}, on {:?})",
                    existing.r, existing.target_modules
                ),
            ));
        }
        if self.has_scripts() {
            return Err(Error::unsupported(
                "LoRA adapters on a model with torchscript layers: Kiln adapts its own \
                 linear, attention and MLP projections",
            ));
        }
        let specs = lora.parameter_specs(&self.spec)?;
        let target = device_to_tch(self.device)?;
        let kind = self
            .float_dtype
            .map(kind_from_dtype)
            .transpose()?
            .unwrap_or(Kind::Float);
        let mut added = Vec::with_capacity(specs.len());
        tch::no_grad(|| -> Result<()> {
            for spec in &specs {
                let tensor = init_tensor(spec, target)
                    .and_then(|t| t.f_to_kind(kind))
                    .and_then(|t| t.f_set_requires_grad(true))
                    .map_err(|e| torch_error(&format!("initialising {}", spec.name), e))?;
                added.push(Entry {
                    name: spec.name.clone(),
                    kind: ParamKind::Parameter,
                    tensor,
                });
            }
            Ok(())
        })?;
        let mut entries: Vec<&str> = self.entries.iter().map(|e| e.name.as_str()).collect();
        entries.extend(added.iter().map(|e| e.name.as_str()));
        let index: HashMap<&str, usize> =
            entries.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let root = build(
            &self.spec,
            "",
            &index,
            Some((lora.scale(), lora.dropout)),
            &mut HashMap::new(),
        )?;
        // Built: now the model changes, all at once.
        for entry in &mut self.entries {
            if entry.kind == ParamKind::Parameter && entry.tensor.requires_grad() {
                let _ = entry
                    .tensor
                    .f_set_requires_grad(false)
                    .map_err(|e| torch_error(&format!("freezing {}", entry.name), e))?;
            }
        }
        let names = added.iter().map(|e| e.name.clone()).collect();
        self.entries.extend(added);
        self.root = root;
        self.lora = Some(lora.clone());
        // The rebuilt tree's parts, checkpointed again.
        let patterns = std::mem::take(&mut self.checkpointed);
        if !patterns.is_empty() {
            let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
            self.checkpoint_activations(&patterns)?;
        }
        Ok(names)
    }

    /// Activation checkpointing (PyTorch's `torch.utils.checkpoint`): each
    /// layer whose path matches one of `patterns` (globs, as for
    /// [`Freeze::freeze`]: `"2"`, `"1.*"`; the outermost match wins) keeps
    /// only its input while training; the backward pass runs it again, with
    /// the random generators as they were (dropout draws the same mask) and
    /// under the model's autocast, to compute its gradients. The gradients are
    /// an ordinary run's; the activations inside the parts are not held
    /// between the forward and backward passes, at the cost of a second
    /// forward pass through them. Evaluation and generation run the parts
    /// plainly. Returns the checkpointed paths.
    ///
    /// A pattern that matches no layer, or a part holding a batch norm (its
    /// running statistics would be updated twice) or a torchscript layer, is
    /// an error, and nothing changes.
    ///
    /// ```no_run
    /// use kiln_core::{model::{Layer, LinearConfig}, Device};
    /// use kiln_torch::TorchModel;
    ///
    /// let block = Layer::sequential([LinearConfig::new(64, 64).into(), Layer::Tanh]);
    /// let spec = Layer::sequential([block.clone(), block, LinearConfig::new(64, 10).into()]);
    /// let mut model = TorchModel::new(&spec, Device::Cpu)?;
    /// assert_eq!(model.checkpoint_activations(&["0", "1"])?, ["0", "1"]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn checkpoint_activations(&mut self, patterns: &[&str]) -> Result<Vec<String>> {
        fn refusal(node: &Node) -> Option<String> {
            match node {
                Node::Leaf {
                    batch_norm: true,
                    path,
                    ..
                } => Some(format!(
                    "the batch norm `{path}` (a second forward pass would update its running \
                     statistics twice)"
                )),
                Node::Leaf { .. } => None,
                Node::Script { path, .. } => Some(format!("the torchscript layer `{path}`")),
                Node::Sequential(children) => children.iter().find_map(refusal),
                Node::Residual(block) => refusal(block),
                Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } => refusal(inner),
            }
        }
        fn wrap(node: &mut Node, path: &str, patterns: &[&str], out: &mut Vec<String>) {
            if matches!(node, Node::Checkpoint { .. }) {
                return;
            }
            // Checkpointing goes inside a sharded unit (its second run then
            // reads the parameters gathered again for the backward pass).
            if let Node::Sharded { inner, .. } = node {
                if let Some(inner) = Arc::get_mut(inner) {
                    wrap(inner, path, patterns, out);
                }
                return;
            }
            if !path.is_empty() && patterns.iter().any(|p| name_matches(p, path)) {
                let inner = std::mem::replace(node, Node::Sequential(Vec::new()));
                *node = Node::Checkpoint {
                    inner: Arc::new(inner),
                    path: path.to_owned(),
                };
                out.push(path.to_owned());
                return;
            }
            match node {
                Node::Sequential(children) => {
                    for (i, child) in children.iter_mut().enumerate() {
                        wrap(child, &join(path, &i.to_string()), patterns, out);
                    }
                }
                Node::Residual(block) => wrap(block, &join(path, "block"), patterns, out),
                _ => {}
            }
        }
        // Checked first: nothing changes on a refusal.
        every_pattern_matches(&self.root, patterns, "activation_checkpointing")?;
        fn check(node: &Node, path: &str, patterns: &[&str]) -> Result<()> {
            if !path.is_empty() && patterns.iter().any(|p| name_matches(p, path)) {
                if let Some(why) = refusal(node) {
                    return Err(Error::unsupported(format!(
                        "activation checkpointing of `{path}`: it holds {why}"
                    )));
                }
                return Ok(());
            }
            match node {
                Node::Sequential(children) => children
                    .iter()
                    .enumerate()
                    .try_for_each(|(i, c)| check(c, &join(path, &i.to_string()), patterns)),
                Node::Residual(block) => check(block, &join(path, "block"), patterns),
                Node::Sharded { inner, .. } => check(inner, path, patterns),
                _ => Ok(()),
            }
        }
        check(&self.root, "", patterns)?;
        let mut wrapped = Vec::new();
        wrap(&mut self.root, "", patterns, &mut wrapped);
        self.checkpointed
            .extend(patterns.iter().map(|p| (*p).to_owned()));
        Ok(wrapped)
    }

    /// The LoRA adapters added by [`add_lora`](TorchModel::add_lora), if any.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
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

    /// The dtype of the floating-point parameters and buffers (`float32` when
    /// built; `None` for a model without any), which floating-point inputs must have.
    pub fn dtype(&self) -> Option<DType> {
        self.float_dtype
    }

    /// Converts the floating-point parameters and buffers to `dtype`, like
    /// `model.to(torch.bfloat16)`; integer buffers stay as they are. Inputs
    /// must then have `dtype` too. Build optimizers after converting: they
    /// hold the parameters they update, and keep their state in the
    /// parameters' dtype (pure bf16 training, as PyTorch's with a bf16 model).
    ///
    /// ```no_run
    /// use kiln_core::{model::{Layer, LinearConfig}, DType, Device};
    /// use kiln_torch::TorchModel;
    ///
    /// let mut model = TorchModel::new(&Layer::Linear(LinearConfig::new(64, 10)), Device::Cpu)?;
    /// model.to_dtype(DType::BF16)?;
    /// assert_eq!(model.dtype(), Some(DType::BF16));
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn to_dtype(&mut self, dtype: DType) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::invalid_argument(
                "dtype",
                format!("a model's parameters convert to a floating-point dtype, not {dtype}"),
            ));
        }
        if self.float_dtype.is_none_or(|current| current == dtype) {
            return Ok(()); // already there: nothing to convert
        }
        let kind = kind_from_dtype(dtype)?;
        self.replace_entries(&format!("converting to {dtype}"), |t| {
            if is_float_kind(t.kind()) {
                t.f_to_kind(kind)
            } else {
                Ok(t.shallow_clone())
            }
        })?;
        if self.float_dtype.is_some() {
            self.float_dtype = Some(dtype);
        }
        Ok(())
    }

    /// Trains and runs at `precision`, like Lightning's `Trainer(precision=...)`
    /// (see [`FloatPrecision`]): converts the floating-point parameters and buffers to
    /// [`FloatPrecision::parameter_dtype`] and sets how [`forward`](Module::forward)
    /// computes:
    ///
    /// - `bf16-mixed`: float32 parameters; the layers run under
    ///   [`autocast`](crate::autocast) to bfloat16, and a floating-point output
    ///   comes back in float32 (what Keras recommends for a mixed-precision
    ///   model's last layer), so losses and metrics are computed in float32.
    /// - `bf16-true`: bfloat16 parameters; float inputs are cast to bfloat16 (as
    ///   Lightning's precision plugin does), the output is bfloat16.
    /// - `16-mixed` and `16-true`: the same with float16; `16-mixed` optimizers
    ///   scale the loss ([`TorchOptimizer::set_loss_scaling`](crate::TorchOptimizer::set_loss_scaling)).
    /// - `32-true`: float32 throughout (the default).
    ///
    /// Build optimizers after this: they hold the parameters they update.
    /// Nothing changes on error.
    ///
    /// ```no_run
    /// use kiln_core::{model::{Layer, LinearConfig}, module::Module, precision::FloatPrecision, Device};
    /// use kiln_torch::TorchModel;
    ///
    /// let mut model = TorchModel::new(&Layer::Linear(LinearConfig::new(64, 10)), Device::Cpu)?;
    /// model.set_precision(FloatPrecision::Bf16Mixed)?;
    /// let x = tch::Tensor::randn([8, 64], (tch::Kind::Float, tch::Device::Cpu));
    /// assert_eq!(model.forward(&x)?.kind(), tch::Kind::Float); // computed in bf16
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn set_precision(&mut self, precision: FloatPrecision) -> Result<()> {
        self.to_dtype(precision.parameter_dtype())?;
        self.precision = precision;
        Ok(())
    }

    /// The precision set by [`set_precision`](Self::set_precision) (`32-true`
    /// when built; [`to_dtype`](Self::to_dtype) does not change it).
    pub fn precision(&self) -> FloatPrecision {
        self.precision
    }

    /// Replaces every parameter and buffer with `f` of it (detached, parameters
    /// requiring gradients again); nothing changes unless every one succeeds.
    fn replace_entries(
        &mut self,
        what: &str,
        f: impl Fn(&Tensor) -> std::result::Result<Tensor, TchError>,
    ) -> Result<()> {
        if self.has_scripts() {
            return Err(Error::unsupported(format!(
                "{what} a model with a torchscript layer: its tensors live in the \
                 TorchScript module; build the model on the device it trains on, in float32"
            )));
        }
        let mut replaced = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let t = f(&e.tensor)
                .and_then(|t| t.f_detach())
                .and_then(|t| {
                    if e.kind == ParamKind::Parameter {
                        // A frozen parameter stays frozen.
                        t.f_set_requires_grad(e.tensor.requires_grad())
                    } else {
                        Ok(t)
                    }
                })
                .map_err(|err| torch_error(&format!("{what}: {}", e.name), err))?;
            replaced.push(t);
        }
        for (e, t) in self.entries.iter_mut().zip(replaced) {
            e.tensor = t;
        }
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

    /// Runs `node` on one cached decoding step (eval behaviour).
    fn run_decode(&self, node: &Node, x: &Tensor, step: &mut DecodeStep) -> ForwardResult {
        match node {
            Node::Sequential(children) => {
                let mut out = x.shallow_clone();
                for child in children {
                    out = self.run_decode(child, &out, step)?;
                }
                Ok(out)
            }
            Node::Residual(block) => Ok(x.f_add(&self.run_decode(block, x, step)?)?),
            Node::Leaf { layer, .. } => layer.decode(self, x, step),
            Node::Checkpoint { inner, .. } => self.run_decode(inner, x, step),
            Node::Sharded { .. } => Err(Failure::Layer(Error::unsupported(
                "cached decoding through a sharded unit: generate from the consolidated \
                 weights (a model that is not sharded)",
            ))),
            Node::Script { path, .. } => Err(Failure::Layer(Error::unsupported(format!(
                "cached decoding through the torchscript layer `{path}`: Kiln cannot give it \
                 positions or a key/value cache"
            )))),
        }
    }

    /// Runs the model on one step of cached decoding (`step`), in eval
    /// behaviour with the model's precision; the output is float32.
    pub(crate) fn decode_step(&self, tokens: &Tensor, step: &mut DecodeStep) -> Result<Tensor> {
        self.check_input(tokens)?;
        let mut run = || {
            self.run_decode(&self.root, tokens, step)
                .map_err(|e| match e {
                    Failure::Torch(e) => torch_error("decoding", e),
                    Failure::Layer(e) => e,
                })
        };
        let output = match self.precision.autocast_dtype() {
            None => run()?,
            Some(dtype) => crate::autocast(self.device, dtype, run)??,
        };
        cast_float(&output, Kind::Float, "casting the logits to float32")
    }

    fn run(&self, node: &Node, x: &Tensor, train: bool) -> ForwardResult {
        let part = PartContext {
            autocast: self.precision.autocast_dtype().map(|d| (self.device, d)),
        };
        run_node(self, node, x, train, Some(part))
    }

    /// Saves the [`Layer::TorchScript`] layer at `layer` (its path in the
    /// model, `"0"`) with its current weights and buffers as a TorchScript
    /// file that Python's `torch.jit.load` reads (see [`ScriptModule::save`]):
    /// a fine-tuned backbone goes back to Python as it came. An unknown path,
    /// or one that is not a torchscript layer, is [`Error::InvalidArgument`].
    pub fn save_torchscript_layer(&self, layer: &str, path: impl AsRef<Path>) -> Result<()> {
        let module = self.script_layer(layer).ok_or_else(|| {
            let layers: Vec<String> = self
                .spec
                .torchscript_layers()
                .into_iter()
                .map(|(p, _)| format!("`{p}`"))
                .collect();
            Error::invalid_argument(
                "layer",
                format!(
                    "`{layer}` is not a torchscript layer of this model (its torchscript \
                     layers: {})",
                    if layers.is_empty() {
                        "none".to_owned()
                    } else {
                        layers.join(", ")
                    }
                ),
            )
        })?;
        lock_script(module)?.save(path)
    }

    /// The module of the [`Layer::TorchScript`] layer at `layer` (its path), if any.
    pub(crate) fn script_layer(&self, layer: &str) -> Option<&Mutex<ScriptModule>> {
        fn find<'a>(node: &'a Node, wanted: &str) -> Option<&'a Mutex<ScriptModule>> {
            match node {
                Node::Script { module, path } if path == wanted => Some(module),
                Node::Sequential(children) => children.iter().find_map(|c| find(c, wanted)),
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
                Node::Sequential(children) => children.iter().for_each(|c| walk(c, out)),
                Node::Residual(block) => walk(block, out),
                Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } => walk(inner, out),
                Node::Leaf { .. } | Node::Script { .. } => {}
            }
        }
        let mut out = Vec::new();
        walk(&self.root, &mut out);
        out
    }

    /// Whether the model has a [`Layer::TorchScript`] layer.
    fn has_scripts(&self) -> bool {
        self.spec
            .layers()
            .iter()
            .any(|(_, l)| matches!(l, Layer::TorchScript(_)))
    }
}

fn init_tensor(spec: &ParamSpec, device: tch::Device) -> std::result::Result<Tensor, TchError> {
    let kind = match spec.dtype {
        DType::I64 => Kind::Int64,
        DType::F64 => Kind::Double,
        _ => Kind::Float,
    };
    let dims: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
    let mut t = Tensor::f_empty(dims.as_slice(), (kind, device))?;
    match spec.init {
        InitDistribution::Constant { value } => {
            let _ = t.f_fill_(value)?;
        }
        InitDistribution::Uniform { low, high } => {
            let _ = t.f_uniform_(low, high)?;
        }
        InitDistribution::Normal { mean, std } => {
            let _ = t.f_normal_(mean, std)?;
        }
    }
    if let Some(row) = spec.zero_row {
        let _ = t.f_get(row as i64)?.f_zero_()?;
    }
    if spec.kind == ParamKind::Parameter {
        t = t.f_set_requires_grad(true)?;
    }
    Ok(t)
}

/// Creates the tensors of `layer` at `prefix` in state-dict order: initialised
/// from the definition, or loaded from a TorchScript file (kept in `scripts`
/// by path). Sets `float` when one is floating-point.
fn collect_entries(
    layer: &Layer,
    prefix: &str,
    device: Device,
    target: tch::Device,
    entries: &mut Vec<Entry>,
    scripts: &mut HashMap<String, ScriptModule>,
    float: &mut bool,
) -> Result<()> {
    match layer {
        Layer::Sequential { layers } => {
            for (i, child) in layers.iter().enumerate() {
                collect_entries(
                    child,
                    &join(prefix, &i.to_string()),
                    device,
                    target,
                    entries,
                    scripts,
                    float,
                )?;
            }
        }
        Layer::Residual { block } => {
            collect_entries(
                block,
                &join(prefix, "block"),
                device,
                target,
                entries,
                scripts,
                float,
            )?;
        }
        Layer::TorchScript(config) => {
            // Its errors name the file: Io when missing, Data when not TorchScript.
            let mut module = ScriptModule::load(&config.path, device)?;
            if !config.trainable {
                module
                    .freeze(&["*"])
                    .or_else(|e| match module.num_parameters() {
                        Ok(0) => Ok(Vec::new()), // nothing to freeze
                        _ => Err(e),
                    })?;
            }
            for (name, tensor) in Module::<TorchBackend>::named_parameters(&module)? {
                *float |= is_float_kind(tensor.kind());
                entries.push(Entry {
                    name: join(prefix, &name),
                    kind: ParamKind::Parameter,
                    tensor,
                });
            }
            for (name, tensor) in Module::<TorchBackend>::named_buffers(&module)? {
                *float |= is_float_kind(tensor.kind());
                entries.push(Entry {
                    name: join(prefix, &name),
                    kind: ParamKind::Buffer,
                    tensor,
                });
            }
            scripts.insert(prefix.to_owned(), module);
        }
        leaf => {
            for p in leaf.parameter_specs(prefix)? {
                *float |= p.dtype.is_float();
                let tensor = init_tensor(&p, target)
                    .map_err(|e| torch_error(&format!("initialising {}", p.name), e))?;
                entries.push(Entry {
                    name: p.name,
                    kind: p.kind,
                    tensor,
                });
            }
        }
    }
    Ok(())
}

/// Builds the node for `layer` at `prefix`, finding its tensors by name and
/// taking its TorchScript module from `scripts`.
fn build(
    layer: &Layer,
    prefix: &str,
    index: &HashMap<&str, usize>,
    lora: Option<(f64, f64)>,
    scripts: &mut HashMap<String, ScriptModule>,
) -> Result<Node> {
    Ok(match layer {
        Layer::Sequential { layers } => Node::Sequential(
            layers
                .iter()
                .enumerate()
                .map(|(i, l)| build(l, &join(prefix, &i.to_string()), index, lora, scripts))
                .collect::<Result<_>>()?,
        ),
        Layer::Residual { block } => Node::Residual(Box::new(build(
            block,
            &join(prefix, "block"),
            index,
            lora,
            scripts,
        )?)),
        Layer::TorchScript(_) => Node::Script {
            module: Mutex::new(scripts.remove(prefix).ok_or_else(|| {
                Error::backend(
                    "torch",
                    "building a torchscript layer",
                    "its module was not loaded",
                )
            })?),
            path: prefix.to_owned(),
        },
        leaf => Node::Leaf {
            layer: layers::build(
                leaf,
                &Lookup {
                    prefix,
                    index,
                    lora,
                },
            )?,
            path: prefix.to_owned(),
            batch_norm: matches!(leaf, Layer::BatchNorm1d(_) | Layer::BatchNorm2d(_)),
            eval: false,
        },
    })
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

/// Pins the frozen batch norms under `node` to eval mode; returns their names.
fn pin_frozen_batch_norm(
    node: &mut Node,
    params: &[(String, Tensor)],
    kept: &mut Vec<String>,
) -> Result<()> {
    match node {
        Node::Sequential(children) => {
            for child in children {
                pin_frozen_batch_norm(child, params, kept)?;
            }
        }
        Node::Residual(block) => pin_frozen_batch_norm(block, params, kept)?,
        // Holds no batch norm and no torchscript layer (refused when wrapped).
        Node::Checkpoint { .. } => {}
        Node::Sharded { inner, .. } => {
            if let Some(inner) = Arc::get_mut(inner) {
                pin_frozen_batch_norm(inner, params, kept)?;
            }
        }
        Node::Leaf {
            path,
            batch_norm,
            eval,
            ..
        } => {
            if *batch_norm && all_frozen(params, path) {
                *eval = true;
                kept.push(path.clone());
            }
        }
        Node::Script { module, path } => {
            let mut module = lock_script(module)?;
            kept.extend(
                module
                    .keep_frozen_batch_norm_in_eval()?
                    .into_iter()
                    .map(|n| join(path, &n)),
            );
        }
    }
    Ok(())
}

impl Freeze for TorchModel {
    /// Kiln's `BatchNorm1d`/`2d` layers whose weight and bias are frozen, and
    /// the frozen batch norms inside TorchScript layers.
    fn keep_frozen_batch_norm_in_eval(&mut self) -> Result<Vec<String>> {
        let params = self.named_parameters()?;
        let mut kept = Vec::new();
        pin_frozen_batch_norm(&mut self.root, &params, &mut kept)?;
        Ok(kept)
    }
}

impl Module<TorchBackend> for TorchModel {
    /// Shapes are checked by libtorch as the layers run; only on failure does the
    /// definition's shape inference run, to name the layer and both shapes
    /// (the training step does no shape bookkeeping of its own).
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let cast;
        let input = match self.precision {
            FloatPrecision::Bf16True => {
                cast = cast_float(input, Kind::BFloat16, "casting the input to bfloat16")?;
                &cast
            }
            FloatPrecision::F16True => {
                cast = cast_float(input, Kind::Half, "casting the input to float16")?;
                &cast
            }
            FloatPrecision::F32 | FloatPrecision::Bf16Mixed | FloatPrecision::F16Mixed => input,
        };
        self.check_input(input)?;
        let run = || {
            self.run(&self.root, input, self.mode.is_train())
                .map_err(|e| match e {
                    Failure::Torch(e) => self.explain_failure(input, e),
                    Failure::Layer(e) => e,
                })
        };
        match self.precision.autocast_dtype() {
            None => run(),
            Some(dtype) => {
                let output = crate::autocast(self.device, dtype, run)??;
                cast_float(&output, Kind::Float, "casting the output to float32")
            }
        }
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Handles sharing storage with the model; never fails.
    fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .entries
            .iter()
            .filter(|e| e.kind == ParamKind::Parameter)
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect())
    }

    /// Handles sharing storage with the model; never fails.
    fn named_buffers(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .entries
            .iter()
            .filter(|e| e.kind == ParamKind::Buffer)
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect())
    }

    /// The batch-norm layers of the definition (a TorchScript layer's own are
    /// not described).
    fn running_stats(&self) -> Result<Vec<kiln_core::module::RunningStats>> {
        Ok(self.spec.running_stats())
    }

    /// Handles to the parameters and buffers: a checkpoint reads them in place.
    fn state_tensors(&self) -> Result<StateTensors<TorchBackend>> {
        StateTensors::from_handles(
            self.named_parameters()?
                .into_iter()
                .chain(self.named_buffers()?),
        )
    }

    /// Strict, like PyTorch's default: every parameter and buffer must be present
    /// with its shape, and no other key; dtypes convert. Nothing changes on error.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let targets: Vec<(String, Tensor)> = self
            .entries
            .iter()
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect();
        copy_state(&targets, state)
    }
}

/// `tensor` in `kind` when it is floating-point and of another kind; otherwise
/// itself (integer inputs feed embeddings, and keep their kind).
fn cast_float(tensor: &Tensor, kind: Kind, what: &str) -> Result<Tensor> {
    let current = tensor.f_kind().map_err(|e| torch_error(what, e))?;
    if is_float_kind(current) && current != kind {
        tensor.f_to_kind(kind).map_err(|e| torch_error(what, e))
    } else {
        Ok(tensor.shallow_clone())
    }
}

impl kiln_core::model::Definition for TorchModel {
    fn definition(&self) -> &Layer {
        &self.spec
    }
}
