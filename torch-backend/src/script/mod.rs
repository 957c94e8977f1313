//! TorchScript models (`torch.jit.script` / `torch.jit.trace` output) as Kiln modules:
//! run, fine-tune with Kiln's optimizers, and save back for Python's `torch.jit.load`.

mod bridge;

use std::path::{Path, PathBuf};

use kiln_core::{
    backend::Mode, module::Module, state_dict::StateDict, state_tensors::StateTensors, Device,
    Error, Result,
};
use tch::{CModule, IValue, Kind, Tensor};

use crate::backend::TorchBackend;
use crate::convert::{dtype_from_kind, is_float_kind};
use crate::custom::copy_state;
use crate::device::{device_from_tch, device_to_tch};
use crate::error::{torch_error, TorchError};

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
        let tmp_dir = path.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
        std::fs::create_dir_all(&tmp_dir).map_err(|e| Error::io(&tmp_dir, e))?;
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

    fn apply_mode(&mut self, mode: Mode) -> Result<()> {
        let result = match mode {
            Mode::Train => self.module.f_set_train(),
            Mode::Eval => self.module.f_set_eval(),
        };
        result.map_err(|e| torch_error("switching TorchScript mode", e))?;
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
