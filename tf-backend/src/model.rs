//! [`TfModel`]: a Kiln model definition built as a TensorFlow graph over resource variables.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_core::{
    backend::Mode,
    model::{InitDistribution, Layer, ParamKind, ParamSpec},
    module::Module,
    rng::SplitMix64,
    state_dict::StateDict,
    Device, Error, HostTensor, Result,
};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::custom_layer::CustomOps;
use crate::engine::{next_stream, Engine, Var};
use crate::saved_model::SavedModelLayers;
use crate::step::{self, CompiledGraph, ModelGraph, ProgramKey, ProgramKind, Signature};

/// A model built from a Kiln [`Layer`] definition as a TensorFlow graph.
///
/// Parameters and buffers are TensorFlow resource variables named as PyTorch's
/// `state_dict()` names them (`"0.weight"`, `"1.running_mean"`), so state
/// dicts and checkpoints move between this backend and the torch backend.
/// Each forward pass is one session run of a graph compiled once per input
/// shape and mode.
///
/// ```no_run
/// use kiln_core::{model::{Layer, LinearConfig}, module::Module, Device, HostTensor};
/// use kiln_tf::{TfBackend, TfModel, TfTensor};
///
/// let spec = Layer::sequential([
///     Layer::Linear(LinearConfig::new(4, 8)),
///     Layer::Relu,
///     Layer::Linear(LinearConfig::new(8, 2)),
/// ]);
/// let model = TfModel::new(&spec, Device::Cpu)?;
/// let x = TfTensor::from_host(&HostTensor::new(vec![0.5f32; 12], [3, 4])?)?;
/// let y = Module::<TfBackend>::forward(&model, &x)?;
/// assert_eq!(y.shape().dims(), &[3, 2]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug)]
pub struct TfModel {
    spec: Layer,
    mode: Mode,
    /// The graph, its session and the programs compiled on it (shared with
    /// the model's optimizers).
    pub(crate) graph: Arc<Mutex<CompiledGraph>>,
    pub(crate) vars: Vec<Var>,
}

/// Locks a model's graph; a poisoned lock (a panic elsewhere) is an error, not a panic.
pub(crate) fn lock(graph: &Mutex<CompiledGraph>) -> Result<MutexGuard<'_, CompiledGraph>> {
    graph.lock().map_err(|_| {
        Error::backend(
            "tensorflow",
            "locking the model's session",
            "a thread panicked while holding it",
        )
    })
}

impl TfModel {
    /// Builds `spec` with its initialisers (PyTorch's defaults where none is
    /// given), drawing from the backend's generator (seed it with
    /// [`kiln_core::backend::Backend::manual_seed`] for reproducible weights). Starts in
    /// training mode. TensorFlow runs on the CPU only here: other devices are
    /// [`Error::DeviceUnavailable`].
    ///
    /// A [`Layer::SavedModel`] layer loads its SavedModel now: its signature's
    /// graph is imported into the model's graph as a frozen feature extractor
    /// and its variables are restored from the SavedModel's checkpoint; they are
    /// not the model's (not in the state dict, never trained). Its
    /// `output_shape` is filled in from the signature where that knows it
    /// ([`spec`](Self::spec) returns the definition with it).
    pub fn new(spec: &Layer, device: Device) -> Result<Self> {
        crate::backend::check_device(device)?;
        spec.validate()?;
        // Mixture-of-experts layers that the router losses cannot pool.
        kiln_core::model::RouterLosses::of(spec)?;
        if let Some((path, layer)) = spec.torchscript_layers().first() {
            return Err(Error::unsupported(format!(
                "the torchscript layer `{}` ({}) on the TensorFlow backend: TorchScript \
                 runs on libtorch; train this model with the torch backend \
                 (backend = \"torch\")",
                if path.is_empty() { "(root)" } else { path },
                layer.path.display()
            )));
        }
        let (saved_models, spec) = SavedModelLayers::load(spec)?;
        let spec = &spec;
        let specs = spec.parameter_specs("")?;
        let mut engine = Engine::new();
        engine.custom_ops = CustomOps::resolve(spec)?;
        let vars = specs
            .iter()
            .map(|p| engine.add_var("model", &p.name, p.dtype, &p.shape, p.kind))
            .collect::<Result<Vec<_>>>()?;
        let values = specs.iter().map(init_value).collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Var> = vars.iter().collect();
        let value_refs: Vec<&HostTensor> = values.iter().collect();
        engine.write_vars(&refs, &value_refs)?;
        if !saved_models.is_empty() {
            saved_models.restore(&mut engine)?;
        }
        let mut graph = CompiledGraph::new(engine);
        graph.saved_models = saved_models;
        Ok(TfModel {
            spec: spec.clone(),
            mode: Mode::Train,
            graph: Arc::new(Mutex::new(graph)),
            vars,
        })
    }

    /// The definition this model was built from.
    pub fn spec(&self) -> &Layer {
        &self.spec
    }

    /// How many session runs this model's graph has executed (forward passes,
    /// training steps, state reads and writes): a training step is one run
    /// (data-parallel, one per micro-batch and one more to apply the step).
    pub fn session_runs(&self) -> Result<u64> {
        Ok(lock(&self.graph)?.engine.runs)
    }

    /// Writes the state dict to a safetensors file (atomically) with PyTorch's
    /// names, which Python's `safetensors.torch.load_file` reads.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut metadata = std::collections::BTreeMap::new();
        metadata.insert("format".to_owned(), "pt".to_owned());
        Module::<TfBackend>::state_dict(self)?.save_safetensors(path.as_ref(), &metadata)
    }

    /// Loads a safetensors state dict; nothing changes unless every entry matches.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let (state, _) = StateDict::load_safetensors(path.as_ref())?;
        Module::<TfBackend>::load_state_dict(self, &state)
    }

    /// The gradients of `loss(forward(inputs), targets)` with respect to every
    /// parameter, by name (as `param.grad` after `loss.backward()` in PyTorch),
    /// and the loss value; one session run, nothing is updated (batch-norm
    /// running statistics included). Parameters the loss does not depend on
    /// are left out.
    pub fn gradients(
        &self,
        loss: &kiln_core::loss::Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, StateDict)> {
        let key = ProgramKey {
            kind: ProgramKind::Gradients { loss: loss.clone() },
            train: self.mode.is_train(),
            input: Some(Signature::of(inputs)),
            target: Some(Signature::of(targets)),
        };
        let batch = inputs.shape();
        let mut graph = lock(&self.graph)?;
        let program = step::program(&mut graph, &key, Some(self.model_graph(batch.dims())), None)?;
        let fetched = step::run(
            &mut graph.engine,
            &program,
            Some(inputs),
            Some(targets),
            &[],
            "computing gradients",
        )?;
        let loss_value = fetched.loss_value()?;
        let mut out = StateDict::new();
        for (name, value) in fetched.gradients {
            out.insert(name, value.to_host()?);
        }
        Ok((loss_value, out))
    }

    /// The model as programs see it, for a batch of `batch_dims`.
    pub(crate) fn model_graph<'a>(&'a self, batch_dims: &'a [usize]) -> ModelGraph<'a> {
        ModelGraph {
            spec: &self.spec,
            vars: &self.vars,
            batch_dims,
            separate_mask: false,
        }
    }

    /// Host copies of the parameters and buffers, in one session run.
    fn read_all(&self) -> Result<Vec<HostTensor>> {
        lock(&self.graph)?.engine.read_vars(&self.vars)
    }
}

/// The initial value of one entry, drawn from the backend's generator.
fn init_value(spec: &ParamSpec) -> Result<HostTensor> {
    let n: usize = spec.shape.iter().product();
    let (seed, draw) = next_stream();
    let mut rng = SplitMix64::new(seed ^ draw.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234_5678);
    let mut values: Vec<f64> = match spec.init {
        InitDistribution::Constant { value } => vec![value; n],
        InitDistribution::Uniform { low, high } => {
            (0..n).map(|_| low + (high - low) * rng.uniform()).collect()
        }
        InitDistribution::Normal { mean, std } => {
            (0..n).map(|_| mean + std * rng.normal()).collect()
        }
    };
    if let Some(row) = spec.zero_row {
        let width = spec.shape.get(1..).map_or(1, |d| d.iter().product());
        for v in values.iter_mut().skip(row * width).take(width) {
            *v = 0.0;
        }
    }
    let host = HostTensor::new(values, spec.shape.clone())?;
    Ok(host.to_dtype(spec.dtype))
}

impl Module<TfBackend> for TfModel {
    /// A mixture of experts' `aux_loss` and `router_z_loss`, which the
    /// training and evaluation steps fetch beside the loss.
    fn auxiliary_loss_names(&self) -> Vec<String> {
        match kiln_core::model::RouterLosses::of(&self.spec) {
            Ok(Some(_)) => kiln_core::model::RouterLosses::NAMES
                .iter()
                .map(|n| (*n).to_owned())
                .collect(),
            _ => Vec::new(),
        }
    }

    fn forward(&self, input: &TfTensor) -> Result<TfTensor> {
        let key = ProgramKey {
            kind: ProgramKind::Forward,
            train: self.mode.is_train(),
            input: Some(Signature::of(input)),
            target: None,
        };
        let batch = input.shape();
        let mut graph = lock(&self.graph)?;
        let program = step::program(&mut graph, &key, Some(self.model_graph(batch.dims())), None)?;
        step::run(
            &mut graph.engine,
            &program,
            Some(input),
            None,
            &[],
            "running the forward pass",
        )?
        .output
        .ok_or_else(|| Error::backend("tensorflow", "running the forward pass", "no output"))
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// The current values of the parameters, read in one session run: TensorFlow
    /// variables live in the session, so these are copies (unlike libtorch's
    /// shared handles) and writing to them does not change the model. A failed
    /// read (a poisoned lock, a session error) is returned, not hidden.
    fn named_parameters(&self) -> Result<Vec<(String, TfTensor)>> {
        self.named(ParamKind::Parameter)
    }

    /// The current values of the buffers: copies, as for
    /// [`named_parameters`](Module::named_parameters).
    fn named_buffers(&self) -> Result<Vec<(String, TfTensor)>> {
        self.named(ParamKind::Buffer)
    }

    /// The batch-norm layers of the definition.
    fn running_stats(&self) -> Result<Vec<kiln_core::module::RunningStats>> {
        Ok(self.spec.running_stats())
    }

    /// The model's graph with every program built on it so far.
    fn graph_def(&self) -> Result<Option<Vec<u8>>> {
        let graph = lock(&self.graph)?;
        graph
            .engine
            .b
            .graph
            .graph_def()
            .map(Some)
            .map_err(|s| crate::error::tf_error("serialising the model's graph", s))
    }

    fn state_dict(&self) -> Result<StateDict> {
        let values = self.read_all()?;
        let mut state = StateDict::new();
        for (var, value) in self.vars.iter().zip(values) {
            state.insert(var.name.clone(), value);
        }
        Ok(state)
    }

    /// Strict, like PyTorch's default: every parameter and buffer must be
    /// present with its shape, and no other key; dtypes convert. One session
    /// run writes everything; nothing changes on error.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let mut values = Vec::with_capacity(self.vars.len());
        for var in &self.vars {
            let host = state.get(&var.name).ok_or_else(|| Error::MissingKey {
                key: var.name.clone(),
                available: state.len(),
            })?;
            if host.dims() != var.dims.as_slice() {
                return Err(Error::ShapeMismatch {
                    context: format!("state dict entry `{}`", var.name),
                    expected: kiln_core::Shape::new(var.dims.clone()).to_string(),
                    actual: host.shape().to_string(),
                });
            }
            values.push(host.to_dtype(var.dtype));
        }
        if let Some(extra) = state
            .keys()
            .find(|k| !self.vars.iter().any(|v| &v.name == *k))
        {
            return Err(Error::invalid_argument(
                extra.as_str(),
                format!(
                    "unexpected entry in state dict; the model's {} entries do not include it",
                    self.vars.len()
                ),
            ));
        }
        let vars: Vec<&Var> = self.vars.iter().collect();
        let refs: Vec<&HostTensor> = values.iter().collect();
        lock(&self.graph)?.engine.write_vars(&vars, &refs)
    }
}

impl TfModel {
    /// The current values of the variables of one kind, in one session run.
    fn named(&self, kind: ParamKind) -> Result<Vec<(String, TfTensor)>> {
        let values = self.read_all()?;
        self.vars
            .iter()
            .zip(values)
            .filter(|(v, _)| v.kind == kind)
            .map(|(v, h)| Ok((v.name.clone(), TfTensor::from_host(&h)?)))
            .collect()
    }
}

impl kiln_core::model::Definition for TfModel {
    fn definition(&self) -> &Layer {
        &self.spec
    }
}

#[cfg(test)]
mod tests {
    //! Reading the variables through [`Module`] reports the engine's errors.

    use kiln_core::{
        model::{Layer, LinearConfig, ParamKind},
        module::Module,
        DType, Device, Error, Result,
    };

    use super::{lock, TfModel};
    use crate::backend::TfBackend;

    fn linear() -> Result<TfModel> {
        TfModel::new(&Layer::Linear(LinearConfig::new(3, 2)), Device::Cpu)
    }

    fn is_backend_error(err: &Error, context: &str) -> bool {
        matches!(err, Error::Backend { backend: "tensorflow", context: c, .. } if c == context)
    }

    /// A variable that is in the graph but was never written cannot be read, so
    /// the session run reading the model's variables fails: that error is what
    /// `named_parameters` and `named_buffers` return (they used to log it and
    /// return an empty list).
    #[test]
    fn a_failed_variable_read_is_returned() -> Result<()> {
        let mut model = linear()?;
        let names: Vec<String> = Module::<TfBackend>::named_parameters(&model)?
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["weight", "bias"]);
        assert_eq!(Module::<TfBackend>::num_parameters(&model)?, 8);

        let unwritten = lock(&model.graph)?.engine.add_var(
            "model",
            "unwritten",
            DType::F32,
            &[2],
            ParamKind::Buffer,
        )?;
        model.vars.push(unwritten);

        let err = Module::<TfBackend>::named_parameters(&model).expect_err("unreadable variable");
        assert!(is_backend_error(&err, "reading variables"), "{err:?}");
        let chain = err.display_chain().to_string();
        assert!(chain.contains("unwritten"), "{chain}");
        let err = Module::<TfBackend>::named_buffers(&model).expect_err("unreadable variable");
        assert!(is_backend_error(&err, "reading variables"), "{err:?}");
        let err = Module::<TfBackend>::num_parameters(&model).expect_err("unreadable variable");
        assert!(is_backend_error(&err, "reading variables"), "{err:?}");
        let err = Module::<TfBackend>::state_dict(&model).expect_err("unreadable variable");
        assert!(is_backend_error(&err, "reading variables"), "{err:?}");
        Ok(())
    }

    /// A thread that panicked while holding the model's session poisons it:
    /// reading the parameters is then an error, not a panic or an empty list.
    #[test]
    fn a_poisoned_session_is_an_error() -> Result<()> {
        let model = linear()?;
        let graph = std::sync::Arc::clone(&model.graph);
        let panicked = std::thread::spawn(move || {
            let _held = graph.lock();
            panic!("poisoning the model's session on purpose");
        })
        .join();
        assert!(panicked.is_err());

        for err in [
            Module::<TfBackend>::named_parameters(&model).expect_err("poisoned"),
            Module::<TfBackend>::named_buffers(&model).expect_err("poisoned"),
        ] {
            assert!(
                is_backend_error(&err, "locking the model's session"),
                "{err:?}"
            );
        }
        Ok(())
    }
}
