//! [`TfModel`]: a Kiln model definition built as a TensorFlow graph over resource variables.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_core::{
    DType, Device, Error, HostTensor, InitDistribution, Layer, Mode, Module, ParamKind, ParamSpec,
    Result, SplitMix64, StateDict,
};
use tensorflow::{DataType, Output};

use crate::backend::TfBackend;
use crate::convert::TfTensor;
use crate::custom_layer::CustomOps;
use crate::engine::{next_stream, seed_tensor, tf_dtype, Engine, Forward, GradientProgram, Var};
use crate::layers::{Ctx, Val};

/// A model built from a Kiln [`Layer`] definition as a TensorFlow graph.
///
/// Parameters and buffers are TensorFlow resource variables named as PyTorch's
/// `state_dict()` names them (`"0.weight"`, `"1.running_mean"`), so state
/// dicts and checkpoints move between this backend and the torch backend.
/// Each forward pass is one session run of a graph compiled once per input
/// shape and mode.
///
/// ```no_run
/// use kiln_core::{Device, HostTensor, Layer, LinearConfig, Module};
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
    pub(crate) engine: Arc<Mutex<Engine>>,
    pub(crate) vars: Vec<Var>,
}

/// Locks an engine; a poisoned lock (a panic elsewhere) is an error, not a panic.
pub(crate) fn lock(engine: &Mutex<Engine>) -> Result<MutexGuard<'_, Engine>> {
    engine.lock().map_err(|_| {
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
    /// [`kiln_core::Backend::manual_seed`] for reproducible weights). Starts in
    /// training mode. TensorFlow runs on the CPU only here: other devices are
    /// [`Error::DeviceUnavailable`].
    pub fn new(spec: &Layer, device: Device) -> Result<Self> {
        crate::backend::check_device(device)?;
        spec.validate()?;
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
        Ok(TfModel {
            spec: spec.clone(),
            mode: Mode::Train,
            engine: Arc::new(Mutex::new(engine)),
            vars,
        })
    }

    /// The definition this model was built from.
    pub fn spec(&self) -> &Layer {
        &self.spec
    }

    /// How many session runs this model's graph has executed (forward passes,
    /// training steps, state reads and writes): a training step is one run.
    pub fn session_runs(&self) -> Result<u64> {
        Ok(lock(&self.engine)?.runs)
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
        loss: &kiln_core::Loss,
        inputs: &TfTensor,
        targets: &TfTensor,
    ) -> Result<(f64, StateDict)> {
        let train = self.mode.is_train();
        let mut engine = lock(&self.engine)?;
        self.forward_program(&mut engine, inputs, train)?;
        let sample: Vec<i64> = inputs
            .shape()
            .dims()
            .iter()
            .skip(1)
            .map(|&d| d as i64)
            .collect();
        let mut tdims: Vec<i64> = targets.shape().dims().iter().map(|&d| d as i64).collect();
        if let Some(first) = tdims.first_mut() {
            *first = -1;
        }
        let key = format!(
            "{loss:?}|{train}|{sample:?}|{}|{tdims:?}|{}",
            inputs.dtype(),
            targets.dtype()
        );
        if !engine.gradient_programs.contains_key(&key) {
            let forward = build_forward(
                &mut engine,
                &self.spec,
                &self.handles(),
                &sample,
                inputs.data_type(),
                train,
            )?;
            let b = &mut engine.b;
            let t = b.placeholder(targets.data_type(), Some(&tdims))?;
            let mut odims = vec![-1i64];
            odims.extend(&forward.output_dims);
            let l = crate::loss::build_loss(
                b,
                loss,
                &forward.output,
                &odims,
                &t,
                targets.dtype(),
                &tdims,
            )?;
            let names: Vec<(String, Output)> = self
                .vars
                .iter()
                .filter(|v| v.kind == ParamKind::Parameter)
                .filter_map(|v| {
                    forward
                        .reads
                        .get(&v.name)
                        .map(|r| (v.name.clone(), r.clone()))
                })
                .collect();
            let xs: Vec<Output> = names.iter().map(|(_, r)| r.clone()).collect();
            let grads = b.gradients(&l, &xs)?;
            let named = names
                .into_iter()
                .zip(grads)
                .filter_map(|((n, _), g)| g.map(|g| (n, g)))
                .collect();
            engine.gradient_programs.insert(
                key.clone(),
                GradientProgram {
                    forward,
                    target: t,
                    loss: l,
                    grads: named,
                },
            );
        }
        let GradientProgram {
            forward,
            target: t,
            loss: l,
            grads: named,
        } = engine
            .gradient_programs
            .get(&key)
            .cloned()
            .ok_or_else(|| Error::backend("tensorflow", "gradients", "program missing"))?;
        let seed = forward.seed.as_ref().map(|_| seed_tensor()).transpose()?;
        let mut feeds = vec![(&forward.input, inputs), (&t, targets)];
        if let (Some(ph), Some(seed)) = (&forward.seed, &seed) {
            feeds.push((ph, seed));
        }
        let mut fetches = vec![(&l, DataType::Float)];
        fetches.extend(named.iter().map(|(_, g)| (g, DataType::Float)));
        let values = engine.run(&feeds, &fetches, &[], "computing gradients")?;
        let mut values = values.into_iter();
        let value = values
            .next()
            .map(|v| v.to_host())
            .transpose()?
            .and_then(|h| h.to_f64_vec().first().copied())
            .unwrap_or(f64::NAN);
        let mut out = StateDict::new();
        for ((name, _), v) in named.iter().zip(values) {
            out.insert(name.clone(), v.to_host()?);
        }
        Ok((value, out))
    }

    /// Handles of the model's variables by state-dict name.
    pub(crate) fn handles(&self) -> HashMap<String, (Output, DataType)> {
        self.vars
            .iter()
            .filter_map(|v| Some((v.name.clone(), (v.handle.clone(), tf_dtype(v.dtype).ok()?))))
            .collect()
    }

    /// The forward program for inputs like `input` in `train` mode, built on first use.
    pub(crate) fn forward_program(
        &self,
        engine: &mut Engine,
        input: &TfTensor,
        train: bool,
    ) -> Result<Forward> {
        let dims = input.shape().dims().to_vec();
        let Some((_, sample)) = dims.split_first() else {
            return Err(Error::ShapeMismatch {
                context: "TfModel::forward".to_owned(),
                expected: "a batch: at least one dimension".to_owned(),
                actual: "a scalar".to_owned(),
            });
        };
        let sample: Vec<i64> = sample.iter().map(|&d| d as i64).collect();
        let key = (sample.clone(), input.dtype(), train);
        if let Some(program) = engine.forwards.get(&key) {
            return Ok(program.clone());
        }
        // Check the shape against the definition first, for an error naming the layer.
        self.spec.output_shape(&dims)?;
        let expected_dtype = if matches!(first_layer(&self.spec), Some(Layer::Embedding(_))) {
            DType::I64
        } else {
            DType::F32
        };
        if input.dtype() != expected_dtype {
            return Err(Error::DTypeMismatch {
                context: "TfModel::forward input".to_owned(),
                expected: expected_dtype,
                actual: input.dtype(),
            });
        }
        let mut program = build_forward(
            engine,
            &self.spec,
            &self.handles(),
            &sample,
            input.data_type(),
            train,
        )?;
        program.update_ops = crate::layers::add_updates(&mut engine.b, &program.updates, &[])?;
        engine.forwards.insert(key, program.clone());
        Ok(program)
    }

    /// Host copies of the parameters and buffers, in one session run.
    fn read_all(&self) -> Result<Vec<HostTensor>> {
        lock(&self.engine)?.read_vars(&self.vars)
    }
}

/// The first layer that sees the input.
fn first_layer(layer: &Layer) -> Option<&Layer> {
    match layer {
        Layer::Sequential { layers } => layers.first().and_then(first_layer),
        Layer::Residual { block } => first_layer(block),
        other => Some(other),
    }
}

/// Builds a forward pass for inputs `[batch, sample...]`.
pub(crate) fn build_forward(
    engine: &mut Engine,
    spec: &Layer,
    handles: &HashMap<String, (Output, DataType)>,
    sample: &[i64],
    input_dtype: DataType,
    train: bool,
) -> Result<Forward> {
    let saved = engine.b.set_scope(if train {
        "train_forward"
    } else {
        "eval_forward"
    });
    let mut shape = vec![-1i64];
    shape.extend(sample);
    let input = engine.b.placeholder(input_dtype, Some(&shape));
    engine.b.set_scope(&saved);
    let input = input?;
    let mut ctx = Ctx {
        b: &mut engine.b,
        custom_ops: &engine.custom_ops,
        reads: HashMap::new(),
        handles,
        train,
        seed: None,
        random_ops: 0,
        updates: Vec::new(),
    };
    let x = Val {
        out: input.clone(),
        dims: sample.to_vec(),
        nhwc: false,
    };
    let y = ctx.layer(spec, "", x)?;
    let y = ctx.nchw(y)?;
    let (seed, updates, reads) = (ctx.seed, ctx.updates, ctx.reads);
    // A named output that is never the input itself (eval-mode dropout is the identity).
    let output = engine.b.op("Identity", &[&y.out], &|nd| {
        nd.set_attr_type("T", DataType::Float)?;
        Ok(())
    })?;
    Ok(Forward {
        update_ops: Vec::new(),
        input,
        output,
        output_dims: y.dims,
        seed,
        updates,
        reads,
    })
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
    fn forward(&self, input: &TfTensor) -> Result<TfTensor> {
        let train = self.mode.is_train();
        let mut engine = lock(&self.engine)?;
        let program = self.forward_program(&mut engine, input, train)?;
        let seed = program.seed.as_ref().map(|_| seed_tensor()).transpose()?;
        let mut feeds = vec![(&program.input, input)];
        if let (Some(ph), Some(seed)) = (&program.seed, &seed) {
            feeds.push((ph, seed));
        }
        let targets: Vec<_> = program.update_ops.iter().collect();
        let mut out = engine.run(
            &feeds,
            &[(&program.output, DataType::Float)],
            &targets,
            "running the forward pass",
        )?;
        out.pop()
            .ok_or_else(|| Error::backend("tensorflow", "running the forward pass", "no output"))
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Snapshots of the parameters: TensorFlow variables live in the session,
    /// so these are host-side copies (unlike libtorch's shared handles).
    fn named_parameters(&self) -> Vec<(String, TfTensor)> {
        self.named(ParamKind::Parameter)
    }

    fn named_buffers(&self) -> Vec<(String, TfTensor)> {
        self.named(ParamKind::Buffer)
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
        lock(&self.engine)?.write_vars(&vars, &refs)
    }
}

impl TfModel {
    fn named(&self, kind: ParamKind) -> Vec<(String, TfTensor)> {
        let Ok(values) = self.read_all() else {
            log::error!("reading the model's variables failed");
            return Vec::new();
        };
        self.vars
            .iter()
            .zip(values)
            .filter(|(v, _)| v.kind == kind)
            .filter_map(|(v, h)| Some((v.name.clone(), TfTensor::from_host(&h).ok()?)))
            .collect()
    }
}
