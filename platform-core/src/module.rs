//! Trainable functions.

use crate::backend::{Backend, Mode};
use crate::error::{Error, Result};
use crate::state_dict::StateDict;
use crate::state_tensors::StateTensors;

/// A trainable function: forward, train/eval mode, and named parameters and
/// buffers with PyTorch state-dict names (`"layers.0.weight"`).
///
/// Implementors provide [`forward`](Module::forward), the mode accessors,
/// [`named_parameters`](Module::named_parameters) and
/// [`load_state_dict`](Module::load_state_dict); the rest have defaults.
///
/// Parameter access is fallible because not every backend keeps its tensors in
/// the process: an eager backend (kiln-torch) hands out handles sharing storage
/// with the module, while a graph engine (kiln-tf) has to read its variables out
/// of a session, which can fail. Checkpoints should use
/// [`state_tensors`](Module::state_tensors), which every backend provides.
///
/// ```
/// use kiln_core::{backend::{Backend, Mode}, module::Module, state_dict::StateDict, Result};
///
/// /// Returns its input unchanged; has no parameters.
/// struct Identity {
///     mode: Mode,
/// }
///
/// impl<B: Backend> Module<B> for Identity {
///     fn forward(&self, input: &B::Tensor) -> Result<B::Tensor> {
///         // Moving a tensor to the device it is on is a cheap no-op copy of the handle.
///         B::to_device(input, B::device(input))
///     }
///     fn mode(&self) -> Mode {
///         self.mode
///     }
///     fn set_mode(&mut self, mode: Mode) {
///         self.mode = mode;
///     }
///     fn named_parameters(&self) -> Result<Vec<(String, B::Tensor)>> {
///         Ok(Vec::new())
///     }
///     fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
///         state.check_compatible(&StateDict::new())
///     }
/// }
/// ```
pub trait Module<B: Backend> {
    /// Applies the module to one input.
    fn forward(&self, input: &B::Tensor) -> Result<B::Tensor>;

    /// Applies the module to several inputs.
    ///
    /// The default accepts exactly one input and calls [`forward`](Module::forward);
    /// any other count is [`Error::InvalidArgument`].
    fn forward_many(&self, inputs: &[B::Tensor]) -> Result<Vec<B::Tensor>> {
        match inputs {
            [input] => Ok(vec![self.forward(input)?]),
            _ => Err(Error::invalid_argument(
                "inputs",
                format!("this module takes exactly 1 input, got {}", inputs.len()),
            )),
        }
    }

    /// The current mode.
    fn mode(&self) -> Mode;

    /// Sets the mode of this module and all its submodules.
    fn set_mode(&mut self, mode: Mode);

    /// Switches to [`Mode::Train`].
    fn train(&mut self) {
        self.set_mode(Mode::Train);
    }

    /// Switches to [`Mode::Eval`].
    fn eval(&mut self) {
        self.set_mode(Mode::Eval);
    }

    /// Trainable tensors with their dotted names, in a stable order.
    ///
    /// What the tensors are depends on the backend:
    ///
    /// - an eager backend (kiln-torch) returns handles sharing storage with the
    ///   module (as in PyTorch), which an optimizer updates in place;
    /// - a graph engine (kiln-tf) returns the current values, a copy: writing to
    ///   them does not change the module. Reading them can fail, and then this
    ///   returns the engine's error rather than hiding it.
    ///
    /// To save or copy a module's state on any backend, use
    /// [`state_tensors`](Module::state_tensors) or
    /// [`state_dict`](Module::state_dict) instead.
    fn named_parameters(&self) -> Result<Vec<(String, B::Tensor)>>;

    /// Non-trainable state saved in checkpoints (e.g. batch-norm running
    /// statistics), with dotted names; handles or copies, and fallible, as for
    /// [`named_parameters`](Module::named_parameters). Defaults to none.
    fn named_buffers(&self) -> Result<Vec<(String, B::Tensor)>> {
        Ok(Vec::new())
    }

    /// Host copies of all parameters and buffers.
    ///
    /// Fails if reading the parameters or buffers fails, a name appears twice
    /// or a copy to the host fails.
    fn state_dict(&self) -> Result<StateDict> {
        let mut state = StateDict::new();
        for (name, tensor) in self
            .named_parameters()?
            .into_iter()
            .chain(self.named_buffers()?)
        {
            let host = B::to_host(&tensor)?;
            if state.insert(name.as_str(), host).is_some() {
                return Err(Error::invalid_argument(
                    name,
                    "appears more than once among the module's parameters and buffers",
                ));
            }
        }
        Ok(state)
    }

    /// The parameters and buffers as a checkpoint writes them, named as in
    /// [`state_dict`](Module::state_dict): handles to the backend's tensors where
    /// the module has them, which the writer reads in place, so saving costs no
    /// host copy of the weights.
    ///
    /// The default wraps [`state_dict`](Module::state_dict)'s host copies; modules
    /// whose parameters are backend tensors override it.
    fn state_tensors(&self) -> Result<StateTensors<B>> {
        Ok(self.state_dict()?.into())
    }

    /// Replaces all parameters and buffers with the entries of `state`.
    ///
    /// Contract: all-or-nothing. Every entry is validated before anything is
    /// written, so on error the module is unchanged. A missing key fails with
    /// [`Error::MissingKey`]; a mis-shaped or mis-typed entry fails with an
    /// error naming the key and both shapes (or dtypes), as
    /// [`StateDict::expect_entry`] produces.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()>;

    /// The batch-norm layers that keep running statistics, each with the
    /// momentum of its updates: what recomputing those statistics for other
    /// weights needs (stochastic weight averaging's `update_bn`).
    ///
    /// The default is none: a module that holds `*.running_mean` buffers it
    /// cannot describe here (a TorchScript model) leaves them to the caller,
    /// which should refuse rather than guess.
    fn running_stats(&self) -> Result<Vec<RunningStats>> {
        Ok(Vec::new())
    }

    /// The engine's dataflow graph of the module, as a serialised TensorFlow
    /// `GraphDef` (what TensorBoard's Graphs view shows), where the engine keeps
    /// one: TensorFlow's graph holds the model and every program built on it so
    /// far (after a training step, the step's forward, backward and update).
    /// `None`, the default, for engines that run eagerly (libtorch).
    fn graph_def(&self) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }

    /// Total number of parameter elements; fails if
    /// [`named_parameters`](Module::named_parameters) does.
    fn num_parameters(&self) -> Result<usize> {
        Ok(self
            .named_parameters()?
            .iter()
            .map(|(_, t)| B::shape(t).numel())
            .sum())
    }

    /// The names of the auxiliary losses the module's forward pass computes
    /// (a mixture of experts' `aux_loss` and `router_z_loss`): what the
    /// supervised objective adds to its loss and logs as `train_<name>` and
    /// `val_<name>`. None by default.
    fn auxiliary_loss_names(&self) -> Vec<String> {
        Vec::new()
    }

    /// `loss` plus the auxiliary losses of the last forward pass, each times
    /// its weight, and their unweighted values in
    /// [`auxiliary_loss_names`](Module::auxiliary_loss_names)' order. It
    /// consumes what that pass recorded: call it once, after the forward pass
    /// `loss` comes from. The default returns `loss` unchanged and no values.
    fn add_auxiliary_losses(&self, loss: B::Tensor) -> Result<WithAuxiliaryLosses<B::Tensor>> {
        Ok(WithAuxiliaryLosses {
            loss,
            values: Vec::new(),
        })
    }
}

/// What [`Module::add_auxiliary_losses`] returns.
#[derive(Debug)]
pub struct WithAuxiliaryLosses<T> {
    /// The loss with each auxiliary loss times its weight added: what is
    /// differentiated.
    pub loss: T,
    /// Each auxiliary loss, unweighted and detached from autograd, in
    /// [`Module::auxiliary_loss_names`]' order.
    pub values: Vec<T>,
}

/// A batch-norm layer's running statistics: the dotted path of its
/// `running_mean`, `running_var` and `num_batches_tracked` buffers, and the
/// weight of each new batch in them (`running = (1 - m) running + m batch`).
#[derive(Clone, Debug, PartialEq)]
pub struct RunningStats {
    /// The layer's path (`"features.1"`); its buffers are `PATH.running_mean`, ...
    pub path: String,
    /// The layer's momentum `m`.
    pub momentum: f64,
}

impl RunningStats {
    /// The name of the layer's buffer `buffer` (`"running_mean"`, ...).
    pub fn buffer(&self, buffer: &str) -> String {
        if self.path.is_empty() {
            buffer.to_owned()
        } else {
            format!("{}.{buffer}", self.path)
        }
    }
}

/// Whether the dotted parameter name `name` matches `pattern`, a glob in which
/// `*` stands for any run of characters, dots included (`0.*`, `backbone.*`,
/// `*.bias`, `*bn*`), and everything else for itself.
///
/// ```
/// use kiln_core::module::name_matches;
///
/// assert!(name_matches("0.*", "0.layer1.0.conv1.weight"));
/// assert!(name_matches("*.bias", "fc.bias"));
/// assert!(!name_matches("0.*", "10.weight"));
/// assert!(name_matches("fc.weight", "fc.weight"));
/// ```
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    // Greedy matching with one backtrack point: the last `*` seen.
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        if i < p.len() && p[i] == b'*' {
            star = Some((i, j));
            i += 1;
        } else if i < p.len() && p[i] == n[j] {
            i += 1;
            j += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == b'*')
}

/// A boxed module is a module (`Box<dyn Module<B> + Send>` holds any of them).
impl<B: Backend, M: Module<B> + ?Sized> Module<B> for Box<M> {
    fn forward(&self, input: &B::Tensor) -> Result<B::Tensor> {
        (**self).forward(input)
    }
    fn forward_many(&self, inputs: &[B::Tensor]) -> Result<Vec<B::Tensor>> {
        (**self).forward_many(inputs)
    }
    fn mode(&self) -> Mode {
        (**self).mode()
    }
    fn set_mode(&mut self, mode: Mode) {
        (**self).set_mode(mode);
    }
    fn named_parameters(&self) -> Result<Vec<(String, B::Tensor)>> {
        (**self).named_parameters()
    }
    fn named_buffers(&self) -> Result<Vec<(String, B::Tensor)>> {
        (**self).named_buffers()
    }
    fn state_dict(&self) -> Result<StateDict> {
        (**self).state_dict()
    }
    fn state_tensors(&self) -> Result<StateTensors<B>> {
        (**self).state_tensors()
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        (**self).load_state_dict(state)
    }
    fn running_stats(&self) -> Result<Vec<RunningStats>> {
        (**self).running_stats()
    }
    fn graph_def(&self) -> Result<Option<Vec<u8>>> {
        (**self).graph_def()
    }
    fn num_parameters(&self) -> Result<usize> {
        (**self).num_parameters()
    }
    fn auxiliary_loss_names(&self) -> Vec<String> {
        (**self).auxiliary_loss_names()
    }
    fn add_auxiliary_losses(&self, loss: B::Tensor) -> Result<WithAuxiliaryLosses<B::Tensor>> {
        (**self).add_auxiliary_losses(loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::tensor::HostTensor;
    use crate::testing::RefBackend;

    /// `y[i] = weight[i] * x[i] + bias[i]`, counting calls in a buffer.
    struct Affine {
        weight: HostTensor,
        bias: HostTensor,
        calls: HostTensor,
        mode: Mode,
    }

    impl Affine {
        fn new(weight: Vec<f32>, bias: Vec<f32>) -> Result<Self> {
            let n = weight.len();
            Ok(Affine {
                weight: HostTensor::new(weight, [n])?,
                bias: HostTensor::new(bias, [n])?,
                calls: HostTensor::scalar(0i64),
                mode: Mode::default(),
            })
        }
    }

    impl Module<RefBackend> for Affine {
        fn forward(&self, input: &HostTensor) -> Result<HostTensor> {
            let x = input.as_slice::<f32>()?;
            let w = self.weight.as_slice::<f32>()?;
            let b = self.bias.as_slice::<f32>()?;
            if input.shape() != self.weight.shape() {
                return Err(Error::ShapeMismatch {
                    context: "Affine::forward".into(),
                    expected: self.weight.shape().to_string(),
                    actual: input.shape().to_string(),
                });
            }
            let y = x
                .iter()
                .zip(w)
                .zip(b)
                .map(|((x, w), b)| w * x + b)
                .collect();
            HostTensor::new(y, input.shape())
        }

        fn mode(&self) -> Mode {
            self.mode
        }

        fn set_mode(&mut self, mode: Mode) {
            self.mode = mode;
        }

        fn named_parameters(&self) -> Result<Vec<(String, HostTensor)>> {
            Ok(vec![
                ("weight".into(), self.weight.clone()),
                ("bias".into(), self.bias.clone()),
            ])
        }

        fn named_buffers(&self) -> Result<Vec<(String, HostTensor)>> {
            Ok(vec![("calls".into(), self.calls.clone())])
        }

        fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
            let w = state.expect_entry("weight", self.weight.shape(), DType::F32)?;
            let b = state.expect_entry("bias", self.bias.shape(), DType::F32)?;
            let c = state.expect_entry("calls", (), DType::I64)?;
            (self.weight, self.bias, self.calls) = (w.clone(), b.clone(), c.clone());
            Ok(())
        }
    }

    #[test]
    fn forward_and_forward_many() -> Result<()> {
        let m = Affine::new(vec![2.0, -1.0], vec![0.5, 0.0])?;
        let x = HostTensor::new(vec![3.0f32, 4.0], [2])?;
        let y = m.forward(&x)?;
        assert_eq!(y.as_slice::<f32>()?, &[6.5, -4.0]);

        let ys = m.forward_many(std::slice::from_ref(&x))?;
        assert_eq!(ys, vec![y]);

        for n in [0, 2] {
            let inputs = vec![x.clone(); n];
            let err = m.forward_many(&inputs).expect_err("needs one input");
            assert_eq!(
                err.to_string(),
                format!("invalid argument `inputs`: this module takes exactly 1 input, got {n}")
            );
        }
        Ok(())
    }

    #[test]
    fn train_and_eval_switch_mode() -> Result<()> {
        let mut m = Affine::new(vec![1.0], vec![0.0])?;
        assert_eq!(Module::<RefBackend>::mode(&m), Mode::Train);
        Module::<RefBackend>::eval(&mut m);
        assert_eq!(Module::<RefBackend>::mode(&m), Mode::Eval);
        Module::<RefBackend>::train(&mut m);
        assert_eq!(Module::<RefBackend>::mode(&m), Mode::Train);
        Ok(())
    }

    #[test]
    fn default_state_dict_and_num_parameters() -> Result<()> {
        let m = Affine::new(vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0])?;
        assert_eq!(Module::<RefBackend>::num_parameters(&m)?, 6);
        let sd = Module::<RefBackend>::state_dict(&m)?;
        let keys: Vec<&str> = sd.keys().map(String::as_str).collect();
        assert_eq!(keys, ["bias", "calls", "weight"]);
        assert_eq!(
            sd.get("bias").map(HostTensor::to_f64_vec),
            Some(vec![4.0, 5.0, 6.0])
        );
        assert_eq!(sd.get("calls"), Some(&HostTensor::scalar(0i64)));
        Ok(())
    }

    #[test]
    fn duplicate_names_are_rejected() -> Result<()> {
        struct Dup(HostTensor);
        impl Module<RefBackend> for Dup {
            fn forward(&self, input: &HostTensor) -> Result<HostTensor> {
                Ok(input.clone())
            }
            fn mode(&self) -> Mode {
                Mode::Eval
            }
            fn set_mode(&mut self, _mode: Mode) {}
            fn named_parameters(&self) -> Result<Vec<(String, HostTensor)>> {
                Ok(vec![
                    ("w".into(), self.0.clone()),
                    ("w".into(), self.0.clone()),
                ])
            }
            fn load_state_dict(&mut self, _state: &StateDict) -> Result<()> {
                Ok(())
            }
        }
        let err = Dup(HostTensor::scalar(1.0f32))
            .state_dict()
            .expect_err("duplicate");
        assert!(err
            .to_string()
            .starts_with("invalid argument `w`: appears more than once"));
        Ok(())
    }

    #[test]
    fn failed_parameter_reads_propagate_through_the_defaults() {
        /// A module whose parameters cannot be read (as a graph engine's
        /// session can fail).
        struct Unreadable;
        impl Module<RefBackend> for Unreadable {
            fn forward(&self, input: &HostTensor) -> Result<HostTensor> {
                Ok(input.clone())
            }
            fn mode(&self) -> Mode {
                Mode::Eval
            }
            fn set_mode(&mut self, _mode: Mode) {}
            fn named_parameters(&self) -> Result<Vec<(String, HostTensor)>> {
                Err(Error::backend(
                    "ref",
                    "reading parameters",
                    "session closed",
                ))
            }
            fn load_state_dict(&mut self, _state: &StateDict) -> Result<()> {
                Ok(())
            }
        }
        let expected = "ref failed in reading parameters";
        let m = Unreadable;
        let err = Module::<RefBackend>::num_parameters(&m).expect_err("unreadable");
        assert_eq!(err.to_string(), expected);
        let err = Module::<RefBackend>::state_dict(&m).expect_err("unreadable");
        assert_eq!(err.to_string(), expected);
        // `StateTensors` is not `Debug`, so no `expect_err`.
        let Err(err) = Module::<RefBackend>::state_tensors(&m) else {
            panic!("state_tensors of an unreadable module succeeded");
        };
        assert_eq!(err.to_string(), expected);
    }

    #[test]
    fn load_state_dict_round_trip_and_atomicity() -> Result<()> {
        let source = Affine::new(vec![1.0, 2.0], vec![3.0, 4.0])?;
        let mut target = Affine::new(vec![0.0, 0.0], vec![0.0, 0.0])?;
        let sd = Module::<RefBackend>::state_dict(&source)?;
        target.load_state_dict(&sd)?;
        assert_eq!(target.weight.as_slice::<f32>()?, &[1.0, 2.0]);
        assert_eq!(target.bias.as_slice::<f32>()?, &[3.0, 4.0]);

        // A bad later entry leaves the earlier ones unapplied.
        let mut bad = sd.clone();
        bad.insert("weight", HostTensor::new(vec![9.0f32, 9.0], [2])?);
        bad.insert("bias", HostTensor::new(vec![9.0f32; 3], [3])?);
        let err = target.load_state_dict(&bad).expect_err("bias shape");
        assert_eq!(
            err.to_string(),
            "state dict entry `bias`: expected shape [2], got [3]"
        );
        assert_eq!(target.weight.as_slice::<f32>()?, &[1.0, 2.0]);
        Ok(())
    }
}
