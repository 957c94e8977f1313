//! The escape hatch: user code over `tch` as a Kiln [`Module`], and [`Chain`] to
//! mix such modules with built ones.

use kiln_core::{backend::Mode, module::Module, state_dict::StateDict, Device, Error, Result};
use tch::{nn, TchError, Tensor};

use crate::backend::TorchBackend;
use crate::convert::{dtype_from_kind, kind_from_dtype};
use crate::device::device_to_tch;
use crate::error::torch_error;
use crate::freeze::Freeze;
use crate::host_view::copy_host_into;

type ForwardFn = dyn Fn(&Tensor, bool) -> std::result::Result<Tensor, TchError> + Send;

/// Any `tch` code as a Kiln module: a closure built over a [`nn::Path`] of its own
/// [`nn::VarStore`]. The closure gets the input and whether the module is training.
/// Variables that require grad are its parameters; the others are buffers.
///
/// ```no_run
/// use kiln_core::{module::Module, Device};
/// use kiln_torch::TchModule;
/// use tch::nn::Module as _;
///
/// let block = TchModule::new(Device::Cpu, |p| {
///     let lin = tch::nn::linear(p / "proj", 16, 16, Default::default());
///     move |x: &tch::Tensor, _train: bool| Ok(lin.forward(x).tanh() + x)
/// })?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub struct TchModule {
    vs: nn::VarStore,
    forward: Box<ForwardFn>,
    mode: Mode,
}

impl std::fmt::Debug for TchModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TchModule")
            .field("variables", &self.sorted_variables().len())
            .field("mode", &self.mode)
            .finish()
    }
}

impl TchModule {
    /// Creates the variable store on `device` and lets `build` declare variables
    /// under its root path and return the forward closure.
    pub fn new<F>(device: Device, build: impl FnOnce(&nn::Path<'_>) -> F) -> Result<Self>
    where
        F: Fn(&Tensor, bool) -> std::result::Result<Tensor, TchError> + Send + 'static,
    {
        let vs = nn::VarStore::new(device_to_tch(device)?);
        let forward = build(&vs.root());
        Ok(Self {
            vs,
            forward: Box::new(forward),
            mode: Mode::Train,
        })
    }

    /// The variable store the closure's variables live in.
    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    fn sorted_variables(&self) -> Vec<(String, Tensor)> {
        let mut vars: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    }
}

impl Module<TorchBackend> for TchModule {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        (self.forward)(input, self.mode.is_train())
            .map_err(|e| torch_error("custom module forward", e))
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .sorted_variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect())
    }

    fn named_buffers(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .sorted_variables()
            .into_iter()
            .filter(|(_, t)| !t.requires_grad())
            .collect())
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let vars = self.sorted_variables();
        copy_state(&vars, state)
    }
}

/// Strictly copies `state` into `targets` (names, shapes); all or nothing.
///
/// Every entry is checked (present, same shape, a dtype libtorch has, no extra key)
/// before the first one is written. Values go from the host tensors straight into
/// the targets, converting dtype on the way, with no intermediate libtorch copy.
pub(crate) fn copy_state(targets: &[(String, Tensor)], state: &StateDict) -> Result<()> {
    let mut values = Vec::with_capacity(targets.len());
    for (name, tensor) in targets {
        let host = state.get(name).ok_or_else(|| Error::MissingKey {
            key: name.clone(),
            available: state.len(),
        })?;
        let expected: Vec<usize> = tensor.size().iter().map(|&d| d as usize).collect();
        if host.dims() != expected.as_slice() {
            return Err(Error::ShapeMismatch {
                context: format!("state dict entry {name}"),
                expected: format!("{expected:?}"),
                actual: host.shape().to_string(),
            });
        }
        kind_from_dtype(host.dtype())?;
        dtype_from_kind(tensor.kind())?;
        values.push(host);
    }
    if let Some(extra) = state.keys().find(|k| !targets.iter().any(|(n, _)| n == *k)) {
        return Err(Error::invalid_argument(
            extra.clone(),
            "unexpected key: not in this module",
        ));
    }
    tch::no_grad(|| -> Result<()> {
        for ((name, tensor), host) in targets.iter().zip(values) {
            copy_host_into(&mut tensor.shallow_clone(), host, name)?;
        }
        Ok(())
    })
}

/// Modules applied in order, each under its own name prefix (`"<name>.<param>"`),
/// so built layers, TorchScript models and [`TchModule`]s compose.
#[derive(Default)]
pub struct Chain {
    children: Vec<(String, Box<dyn Freeze + Send>)>,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.children.iter().map(|(n, _)| n))
            .finish()
    }
}

impl Chain {
    /// An empty chain.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a module under `name` (must not contain `.` and must be unique):
    /// a [`TorchModel`](crate::TorchModel), a [`ScriptModule`](crate::ScriptModule),
    /// a [`TchModule`] or another chain (wrap other modules' code in a `TchModule`).
    pub fn push(
        mut self,
        name: impl Into<String>,
        module: impl Freeze + Send + 'static,
    ) -> Result<Self> {
        let name = name.into();
        if name.is_empty() || name.contains('.') || self.children.iter().any(|(n, _)| *n == name) {
            return Err(Error::invalid_argument(
                "name",
                format!("`{name}` must be non-empty, without `.`, and unique in the chain"),
            ));
        }
        self.children.push((name, Box::new(module)));
        Ok(self)
    }
}

fn prefixed(
    name: &str,
    items: Vec<(String, Tensor)>,
) -> impl Iterator<Item = (String, Tensor)> + '_ {
    items
        .into_iter()
        .map(move |(n, t)| (format!("{name}.{n}"), t))
}

impl Freeze for TchModule {
    /// None: a `TchModule`'s closure gets the training flag and decides itself
    /// how its batch norm runs; keep frozen ones in eval there.
    fn keep_frozen_batch_norm_in_eval(&mut self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }
}

impl Freeze for Chain {
    /// Each child's, under its name.
    fn keep_frozen_batch_norm_in_eval(&mut self) -> Result<Vec<String>> {
        let mut kept = Vec::new();
        for (name, child) in &mut self.children {
            kept.extend(
                child
                    .keep_frozen_batch_norm_in_eval()?
                    .into_iter()
                    .map(|n| format!("{name}.{n}")),
            );
        }
        Ok(kept)
    }
}

impl Module<TorchBackend> for Chain {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let mut x = input.shallow_clone();
        for (_, child) in &self.children {
            x = child.forward(&x)?;
        }
        Ok(x)
    }

    fn mode(&self) -> Mode {
        self.children.first().map_or(Mode::Train, |(_, c)| c.mode())
    }

    fn set_mode(&mut self, mode: Mode) {
        for (_, child) in &mut self.children {
            child.set_mode(mode);
        }
    }

    fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (n, c) in &self.children {
            out.extend(prefixed(n, c.named_parameters()?));
        }
        Ok(out)
    }

    fn named_buffers(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (n, c) in &self.children {
            out.extend(prefixed(n, c.named_buffers()?));
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        // Split by child first and check that every key belongs to one.
        let mut parts: Vec<StateDict> = self.children.iter().map(|_| StateDict::new()).collect();
        for (key, value) in state.iter() {
            let (child, rest) = key.split_once('.').unwrap_or((key.as_str(), ""));
            let index = self
                .children
                .iter()
                .position(|(n, _)| n == child)
                .ok_or_else(|| {
                    Error::invalid_argument(
                        key.clone(),
                        "unexpected key: no child module of that name",
                    )
                })?;
            parts[index].insert(rest.to_owned(), value.clone());
        }
        // All-or-nothing across children: keep the old values to restore on failure.
        let old: Vec<StateDict> = self
            .children
            .iter()
            .map(|(_, c)| c.state_dict())
            .collect::<Result<_>>()?;
        for (i, part) in parts.iter().enumerate() {
            if let Err(error) = self.children[i].1.load_state_dict(part) {
                for (j, previous) in old.iter().enumerate().take(i) {
                    self.children[j].1.load_state_dict(previous)?;
                }
                return Err(error);
            }
        }
        Ok(())
    }
}
