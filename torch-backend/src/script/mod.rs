//! TorchScript models (`torch.jit.script` / `torch.jit.trace` output) as Kiln modules:
//! run, fine-tune with Kiln's optimizers, and save back for Python's `torch.jit.load`.

mod bridge;
/// The cxx bridge the TorchScript export builds its module tree with (`crate::export`).
pub(crate) mod export_bridge;

use std::path::{Path, PathBuf};

use kiln_core::{
    backend::Mode, model::Layer, module::Module, state_dict::StateDict,
    state_tensors::StateTensors, DType, Device, Error, Result,
};
use tch::{CModule, IValue, Kind, Tensor};

use crate::backend::TorchBackend;
use crate::convert::{dtype_from_kind, is_float_kind};
use crate::custom::copy_state;
use crate::device::{device_from_tch, device_to_tch};
use crate::error::{torch_error, TorchError};
use crate::freeze::{all_frozen, Freeze};

/// A TorchScript model loaded from a `.pt` file.
///
/// Its parameters and buffers keep PyTorch's dotted names (`fc1.weight`,
/// `bn1.running_mean`) and share storage with the model, so an optimizer built
/// from [`Module::named_parameters`] fine-tunes it in place, a checkpoint of
/// [`Module::state_tensors`] holds what `model.state_dict()` holds in Python
/// (buffers included), and [`ScriptModule::save`] writes the new weights.
///
/// ```no_run
/// use kiln_core::{module::Module, Device};
/// use kiln_torch::ScriptModule;
///
/// let model = ScriptModule::load("model.pt", Device::Cpu)?;
/// let x = tch::Tensor::ones([1, 4], (tch::Kind::Float, tch::Device::Cpu));
/// let y = model.forward(&x)?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug)]
pub struct ScriptModule {
    path: PathBuf,
    module: CModule,
    params: Vec<(String, Tensor)>,
    mode: Mode,
    device: Device,
    /// The dtype of the floating-point parameters, which float inputs must match.
    float_kind: Option<Kind>,
    /// Submodules kept in eval mode when the module trains
    /// ([`Freeze::keep_frozen_batch_norm_in_eval`]).
    eval_submodules: Vec<String>,
}

impl ScriptModule {
    /// Loads a TorchScript archive onto `device`, in training mode (as
    /// `torch.jit.load` leaves a module saved in training mode).
    ///
    /// A missing file is [`Error::Io`]; a file that is not a TorchScript archive
    /// (a `state_dict` saved with `torch.save`, a random file) is [`Error::Data`].
    pub fn load(path: impl AsRef<Path>, device: Device) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if let Err(source) = std::fs::metadata(&path) {
            return Err(Error::io(&path, source));
        }
        let module = CModule::load_on_device(&path, device_to_tch(device)?).map_err(|e| {
            Error::data_caused_by(
                &path,
                None,
                "not a loadable TorchScript archive (expected the output of torch.jit.save)",
                TorchError::new(e),
            )
        })?;
        let params = module
            .named_parameters()
            .map_err(|e| torch_error("listing TorchScript parameters", e))?;
        bridge::check_bridge(&module, &params)?;
        let float_kind = params
            .iter()
            .map(|(_, t)| t.kind())
            .find(|k| is_float_kind(*k));
        let mut loaded = Self {
            path,
            module,
            params,
            mode: Mode::Train,
            device,
            float_kind,
            eval_submodules: Vec::new(),
        };
        loaded.apply_mode(Mode::Train)?;
        Ok(loaded)
    }

    /// The file this module was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device the module lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The loaded TorchScript module (for the exporter, which copies it).
    pub(crate) fn c_module(&self) -> &CModule {
        &self.module
    }

    /// Runs `forward` with arbitrary TorchScript values (tensors, tuples, lists,
    /// dicts, numbers) and returns its value unchanged.
    ///
    /// Tensor inputs are checked first: each must be on the model's device, and
    /// floating-point inputs must have the parameters' dtype. A wrong number of
    /// inputs is [`Error::InvalidArgument`] quoting the model's declaration.
    pub fn forward_values(&self, inputs: &[IValue]) -> Result<IValue> {
        for (index, input) in inputs.iter().enumerate() {
            self.check_input(index, input)?;
        }
        self.module
            .forward_is(inputs)
            .map_err(|e| self.forward_error(inputs.len(), e))
    }

    /// Runs `forward` on tensors and returns its tensors: a tensor output as one,
    /// a tuple or list of tensors in order. Use [`forward_values`](Self::forward_values)
    /// for dicts and nested outputs.
    pub fn forward_tensors(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let values: Vec<IValue> = inputs
            .iter()
            .map(|t| IValue::Tensor(t.shallow_clone()))
            .collect();
        flatten_tensors(self.forward_values(&values)?)
    }

    /// Saves the module, with its current weights and buffers, as a TorchScript
    /// archive that Python's `torch.jit.load` reads. Written into a temporary
    /// directory beside `path` under `path`'s own file name (the archive's
    /// records are named after it, as `torch.jit.save(path)` names them), then
    /// renamed, so an interrupted save never leaves a broken file at `path`;
    /// the same weights give the same bytes.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let file_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model.pt".to_owned());
        // A new directory of an unpredictable name: never one planted there.
        let tmp_dir = kiln_core::fs::create_temporary_dir_beside(path)?;
        let tmp = tmp_dir.join(&file_name);
        let result = self
            .module
            .save(&tmp)
            .map_err(|e| torch_error(&format!("saving TorchScript to {}", path.display()), e))
            .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
        if let Err(e) = std::fs::remove_dir_all(&tmp_dir) {
            log::warn!("cannot remove the temporary {}: {e}", tmp_dir.display());
        }
        result
    }

    /// Switches to `mode` (and pins the submodules kept in eval), or says why not.
    pub(crate) fn set_training(&mut self, mode: Mode) -> Result<()> {
        self.apply_mode(mode)
    }

    fn apply_mode(&mut self, mode: Mode) -> Result<()> {
        let result = match mode {
            Mode::Train => self.module.f_set_train(),
            Mode::Eval => self.module.f_set_eval(),
        };
        result.map_err(|e| torch_error("switching TorchScript mode", e))?;
        if mode.is_train() {
            for name in &self.eval_submodules {
                bridge::set_submodule_training(&self.module, name, false)?;
            }
        }
        self.mode = mode;
        Ok(())
    }

    fn check_input(&self, index: usize, input: &IValue) -> Result<()> {
        match input {
            IValue::Tensor(t) => {
                let device = device_from_tch(t.device())?;
                if device != self.device {
                    return Err(Error::DeviceMismatch {
                        context: format!("input {index} of {}", self.path.display()),
                        expected: self.device,
                        actual: device,
                    });
                }
                if let Some(expected) = self.float_kind {
                    let kind = t.kind();
                    if is_float_kind(kind) && kind != expected {
                        return Err(Error::DTypeMismatch {
                            context: format!("input {index} of {}", self.path.display()),
                            expected: dtype_from_kind(expected)?,
                            actual: dtype_from_kind(kind)?,
                        });
                    }
                }
                Ok(())
            }
            IValue::Tuple(items) | IValue::GenericList(items) => items
                .iter()
                .try_for_each(|item| self.check_input(index, item)),
            IValue::TensorList(items) => items
                .iter()
                .try_for_each(|t| self.check_input(index, &IValue::Tensor(t.shallow_clone()))),
            _ => Ok(()),
        }
    }

    /// libtorch's argument errors quote the declaration; keep it in a typed error.
    fn forward_error(&self, given: usize, error: tch::TchError) -> Error {
        let message = error.to_string();
        if message.contains("argument(s)") || message.contains("missing value for argument") {
            let declaration = message
                .split("Declaration:")
                .nth(1)
                .and_then(|rest| rest.lines().next())
                .map(str::trim)
                .unwrap_or("unknown");
            return Error::invalid_argument(
                "inputs",
                format!(
                    "{} declares {declaration}; got {given} input(s)",
                    self.path.display()
                ),
            );
        }
        torch_error(&format!("forward of {}", self.path.display()), error)
    }
}

impl Freeze for ScriptModule {
    /// Finds the batch-norm submodules by their TorchScript class
    /// (`BatchNorm1d/2d/3d`, `SyncBatchNorm`) through the bridge to
    /// `torch::jit::Module`.
    fn keep_frozen_batch_norm_in_eval(&mut self) -> Result<Vec<String>> {
        let params = self.named_parameters()?;
        let whole_frozen = !params.is_empty() && params.iter().all(|(_, t)| !t.requires_grad());
        let mut kept = Vec::new();
        for (name, class) in bridge::submodules(&self.module)? {
            let short = class.rsplit('.').next().unwrap_or_default();
            if !(short.starts_with("BatchNorm") || short == "SyncBatchNorm") {
                continue;
            }
            let has_params = params
                .iter()
                .any(|(n, _)| n.starts_with(&format!("{name}.")));
            if all_frozen(&params, &name) || (!has_params && whole_frozen) {
                kept.push(name);
            }
        }
        self.eval_submodules = kept.clone();
        self.apply_mode(self.mode)?;
        Ok(kept)
    }
}

fn flatten_tensors(value: IValue) -> Result<Vec<Tensor>> {
    match value {
        IValue::Tensor(t) => Ok(vec![t]),
        IValue::TensorList(ts) => Ok(ts),
        IValue::Tuple(items) | IValue::GenericList(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                out.extend(flatten_tensors(item)?);
            }
            Ok(out)
        }
        other => Err(Error::unsupported(format!(
            "TorchScript output {} is not a tensor or a tuple/list of tensors; use forward_values",
            ivalue_kind(&other)
        ))),
    }
}

fn ivalue_kind(value: &IValue) -> &'static str {
    match value {
        IValue::None => "None",
        IValue::Double(_) | IValue::Int(_) | IValue::Bool(_) => "a number",
        IValue::String(_) | IValue::StringList(_) => "a string",
        IValue::GenericDict(_) => "a dict",
        _ => "a value",
    }
}

impl Module<TorchBackend> for ScriptModule {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let mut outputs = self.forward_tensors(std::slice::from_ref(input))?;
        match outputs.len() {
            1 => Ok(outputs.remove(0)),
            n => Err(Error::invalid_argument(
                "forward",
                format!("the model returns {n} tensors; use forward_many"),
            )),
        }
    }

    fn forward_many(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.forward_tensors(inputs)
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    fn set_mode(&mut self, mode: Mode) {
        if let Err(error) = self.apply_mode(mode) {
            log::error!(
                "cannot switch {} to {mode:?}: {}",
                self.path.display(),
                error.display_chain()
            );
        }
    }

    /// Handles sharing storage with the model; never fails.
    fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect())
    }

    /// The buffers (batch-norm running statistics and counters) with PyTorch's
    /// names, as handles sharing storage with the model, read from the
    /// `torch::jit::Module` each time (a TorchScript method may rebind a buffer).
    fn named_buffers(&self) -> Result<Vec<(String, Tensor)>> {
        bridge::named_buffers(&self.module)
    }

    /// Handles to the parameters and buffers: a checkpoint reads them in place.
    fn state_tensors(&self) -> Result<StateTensors<TorchBackend>> {
        let mut handles = self.named_parameters()?;
        handles.extend(self.named_buffers()?);
        StateTensors::from_handles(handles)
    }

    /// Copies values into the parameters and buffers, as PyTorch's
    /// `load_state_dict(strict=True)`: every parameter and buffer must be given,
    /// with its shape, and no other key; nothing changes unless all match.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let mut targets = self.named_parameters()?;
        targets.extend(self.named_buffers()?);
        copy_state(&targets, state)
    }
}

/// `spec` with the output shape of each of its [`Layer::TorchScript`] layers
/// filled in (where not given), found by running each file once, in eval
/// mode and without gradients, on zeros of one example: `example_shape` is
/// the shape of one example of the model's input (without the batch
/// dimension) and `dtype` its dtype; the shapes reaching a TorchScript layer
/// come from the layers before it. Loads the files on `device`; draws no
/// random numbers. A model without TorchScript layers comes back unchanged.
///
/// ```no_run
/// use kiln_core::{model::{Layer, LinearConfig, TorchScriptConfig}, DType, Device};
///
/// let spec = Layer::sequential([
///     TorchScriptConfig::new("backbone.pt").frozen().into(),
///     LinearConfig::new(64, 10).into(),
/// ]);
/// let resolved = kiln_torch::resolve_torchscript_shapes(&spec, &[1, 8, 8], DType::F32, Device::Cpu)?;
/// assert_eq!(resolved.output_shape(&[32, 1, 8, 8])?, vec![32, 10]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn resolve_torchscript_shapes(
    spec: &Layer,
    example_shape: &[usize],
    dtype: DType,
    device: Device,
) -> Result<Layer> {
    let mut resolved = spec.clone();
    if resolved.torchscript_layers().is_empty() {
        return Ok(resolved);
    }
    let mut input = vec![1];
    input.extend_from_slice(example_shape);
    resolved.resolve_shapes(
        &input,
        dtype,
        &mut |path, layer, input, dtype| match layer {
            Layer::TorchScript(config) if config.output_shape.is_none() => {
                config.output_shape = Some(run_once(path, config, input, dtype, device)?);
                Ok(())
            }
            _ => Ok(()),
        },
    )?;
    Ok(resolved)
}

/// The output shape of one example (batch dimension excluded) of the
/// TorchScript file of `config`, run once in eval mode on zeros of `input`.
fn run_once(
    path: &str,
    config: &kiln_core::model::TorchScriptConfig,
    input: &[usize],
    dtype: DType,
    device: Device,
) -> Result<Vec<usize>> {
    let shown = if path.is_empty() { "(root)" } else { path };
    let mut module = ScriptModule::load(&config.path, device)?;
    module.apply_mode(Mode::Eval)?;
    let dims: Vec<i64> = input.iter().map(|&d| d as i64).collect();
    let zeros = Tensor::f_zeros(
        dims.as_slice(),
        (
            crate::convert::kind_from_dtype(dtype)?,
            device_to_tch(device)?,
        ),
    )
    .map_err(|e| torch_error("making a probe input", e))?;
    let output = tch::no_grad(|| module.forward(&zeros)).map_err(|e| {
        Error::invalid_argument(
            if path.is_empty() { "model" } else { path },
            format!(
                "the torchscript layer {} does not run on an input of shape {input:?} \
                 (what the layers before it give for the data): {}",
                config.path.display(),
                e.display_chain()
            ),
        )
    })?;
    let out: Vec<usize> = output.size().iter().map(|&d| d as usize).collect();
    log::debug!(
        "torchscript layer {shown} ({}): input {input:?} -> output {out:?}",
        config.path.display()
    );
    Ok(out.get(1..).unwrap_or_default().to_vec())
}
