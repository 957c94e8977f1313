//! The portable layout of an optimizer's state dict, which every backend writes
//! and reads through here, so that a run resumes on either engine.
//!
//! Keys, as the torch backend has always written them:
//! - `state.<param>.step`: the steps taken (int64 scalar);
//! - `state.<param>.<buffer>`: one tensor per buffer `torch.optim` keeps for the
//!   algorithm ([`OptimizerConfig::state_buffers`]), with the parameter's shape.
//!   PyTorch creates them on the first step, so before it they are absent;
//! - `group.<i>.lr`, `group.<i>.weight_decay` ([`save_group_hypers`](super::save_group_hypers)).
//!
//! ```
//! use kiln_core::optim::{optimizer_state_key, AdamConfig, OptimizerConfig};
//!
//! let adam = OptimizerConfig::Adam(AdamConfig::new(1e-3));
//! let names: Vec<_> = adam.state_buffers().iter().map(|b| b.name).collect();
//! assert_eq!(names, ["exp_avg", "exp_avg_sq"]);
//! assert_eq!(optimizer_state_key("0.weight", "exp_avg"), "state.0.weight.exp_avg");
//! ```

use std::collections::BTreeMap;

use super::OptimizerConfig;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::state_dict::StateDict;
use crate::tensor::HostTensor;

/// One per-parameter buffer an optimizer keeps (PyTorch's `state[p][name]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StateBuffer {
    /// PyTorch's name: `exp_avg`, `momentum_buffer`, ...
    pub name: &'static str,
    /// Its value before the first update (every element).
    pub initial: f64,
}

impl OptimizerConfig {
    /// The per-parameter buffers `torch.optim` keeps for this configuration, in
    /// the order the backends create them.
    pub fn state_buffers(&self) -> Vec<StateBuffer> {
        let zero = |name| StateBuffer { name, initial: 0.0 };
        match self {
            OptimizerConfig::Sgd(c) if c.momentum != 0.0 => vec![zero("momentum_buffer")],
            OptimizerConfig::Sgd(_) => vec![],
            OptimizerConfig::Adam(c) if c.amsgrad => {
                vec![zero("exp_avg"), zero("exp_avg_sq"), zero("max_exp_avg_sq")]
            }
            OptimizerConfig::AdamW(c) if c.amsgrad => {
                vec![zero("exp_avg"), zero("exp_avg_sq"), zero("max_exp_avg_sq")]
            }
            OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => {
                vec![zero("exp_avg"), zero("exp_avg_sq")]
            }
            OptimizerConfig::RmsProp(c) => {
                let mut buffers = vec![zero("square_avg")];
                if c.momentum > 0.0 {
                    buffers.push(zero("momentum_buffer"));
                }
                if c.centered {
                    buffers.push(zero("grad_avg"));
                }
                buffers
            }
            OptimizerConfig::Adagrad(c) => vec![StateBuffer {
                name: "sum",
                initial: c.initial_accumulator_value,
            }],
        }
    }
}

/// `state.<param>.<buffer>`: the key of one state tensor (`buffer` may be `step`).
pub fn optimizer_state_key(param: &str, buffer: &str) -> String {
    format!("state.{param}.{buffer}")
}

/// One parameter's state as read from a state dict.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamState {
    /// Steps taken (0 when the dict has no `step` entry).
    pub step: u64,
    /// The buffers present, by name (absent: not created yet, as before
    /// PyTorch's first step).
    pub buffers: BTreeMap<&'static str, HostTensor>,
}

/// Reads the state of `params` (each a name and its dims) from `state`, written
/// by any backend for an optimizer configured as `config`, and checks all of it
/// before returning any: step counts are non-negative integers, every
/// `state.<param>.<buffer>` entry is a buffer `config` keeps, with the
/// parameter's shape, and a parameter that took a step has every buffer
/// `config` keeps (they are created on the first step). Entries of parameters
/// not in `params`, and group entries, are not looked at.
///
/// ```
/// use kiln_core::{optim::{read_optimizer_state, OptimizerConfig, SgdConfig}, state_dict::StateDict, HostTensor};
///
/// let sgd = OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9));
/// let mut state = StateDict::new();
/// state.insert("state.w.step".to_owned(), HostTensor::scalar(3i64));
/// state.insert("state.w.momentum_buffer".to_owned(), HostTensor::new(vec![0.5f32; 2], [2])?);
/// let read = read_optimizer_state(&sgd, &[("w", &[2])], &state)?;
/// assert_eq!(read[0].step, 3);
///
/// state.insert("state.w.exp_avg".to_owned(), HostTensor::new(vec![0f32; 2], [2])?);
/// assert!(read_optimizer_state(&sgd, &[("w", &[2])], &state).is_err());
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn read_optimizer_state(
    config: &OptimizerConfig,
    params: &[(&str, &[usize])],
    state: &StateDict,
) -> Result<Vec<ParamState>> {
    let known = config.state_buffers();
    let mut out = Vec::with_capacity(params.len());
    for (param, dims) in params {
        let step_key = optimizer_state_key(param, "step");
        let step = match state.get(&step_key) {
            Some(t) => t
                .to_dtype(DType::I64)
                .as_slice::<i64>()?
                .first()
                .copied()
                .unwrap_or(0),
            None => 0,
        };
        let step = u64::try_from(step).map_err(|_| {
            Error::invalid_argument(step_key.clone(), format!("negative step count {step}"))
        })?;
        let prefix = optimizer_state_key(param, "");
        let mut buffers = BTreeMap::new();
        for (key, host) in state.iter() {
            let Some(buffer) = key.strip_prefix(&prefix) else {
                continue;
            };
            if buffer == "step" {
                continue;
            }
            let Some(known) = known.iter().find(|b| b.name == buffer) else {
                return Err(Error::invalid_argument(
                    key.clone(),
                    format!(
                        "unknown optimizer state buffer (the {} optimizer keeps {})",
                        config.kind(),
                        describe(&known)
                    ),
                ));
            };
            if host.dims() != *dims {
                return Err(Error::ShapeMismatch {
                    context: format!("optimizer state {key}"),
                    expected: Shape::new(dims.to_vec()).to_string(),
                    actual: host.shape().to_string(),
                });
            }
            buffers.insert(known.name, host.clone());
        }
        if step > 0 {
            if let Some(missing) = known.iter().find(|b| !buffers.contains_key(b.name)) {
                return Err(Error::invalid_argument(
                    optimizer_state_key(param, missing.name),
                    format!(
                        "missing: {param} has taken {step} steps, and from its first step the \
                         {} optimizer keeps {} for each parameter; the state was removed or \
                         saved for another configuration, so continuing from it would not be exact",
                        config.kind(),
                        describe(&known)
                    ),
                ));
            }
        }
        out.push(ParamState { step, buffers });
    }
    Ok(out)
}

/// Checks that `saved`, the optimizer state of a checkpoint taken after
/// `steps` optimizer steps, holds what an optimizer configured as `config`
/// keeps by then. `fresh` lists the keys of the state of the optimizer about
/// to load it (built from `config`, before any step): its `state.<param>.step`
/// keys name the parameters it updates.
///
/// A stateful algorithm ([`OptimizerConfig::state_buffers`] not empty) that
/// took a step has a `state.<param>.step` entry for every parameter, written
/// with the parameter's buffers ([`read_optimizer_state`] checks those); a
/// state without them after `steps > 0` was removed from the checkpoint, and
/// loading it would restart the moments instead of continuing them. That is an
/// [`Error::InvalidArgument`] naming the optimizer, the steps and the missing
/// keys. Plain SGD keeps no buffers, and a state at step 0 none yet: both pass.
///
/// ```
/// use kiln_core::optim::{check_state_after_steps, AdamConfig, OptimizerConfig};
/// use kiln_core::{state_dict::StateDict, HostTensor};
///
/// let adam = OptimizerConfig::Adam(AdamConfig::new(1e-3));
/// let fresh = ["state.w.step", "group.0.lr"];
/// let stripped = StateDict::new();
/// let err = check_state_after_steps(&adam, &fresh, &stripped, 6).unwrap_err();
/// assert!(err.to_string().contains("state.w.step"));
/// assert!(check_state_after_steps(&adam, &fresh, &stripped, 0).is_ok());
///
/// let mut saved = StateDict::new();
/// saved.insert("state.w.step".to_owned(), HostTensor::scalar(6i64));
/// assert!(check_state_after_steps(&adam, &fresh, &saved, 6).is_ok());
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn check_state_after_steps(
    config: &OptimizerConfig,
    fresh: &[&str],
    saved: &StateDict,
    steps: u64,
) -> Result<()> {
    let buffers = config.state_buffers();
    if steps == 0 || buffers.is_empty() {
        return Ok(());
    }
    let params: Vec<&str> = fresh
        .iter()
        .filter_map(|k| k.strip_prefix("state.")?.strip_suffix(".step"))
        .collect();
    let missing: Vec<String> = params
        .iter()
        .map(|p| optimizer_state_key(p, "step"))
        .filter(|key| saved.get(key).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    const SHOWN: usize = 4;
    let mut names: Vec<String> = missing
        .iter()
        .take(SHOWN)
        .map(|k| format!("`{k}`"))
        .collect();
    if missing.len() > SHOWN {
        names.push(format!("{} more", missing.len() - SHOWN));
    }
    let held = if saved.is_empty() {
        "it holds no optimizer state at all".to_owned()
    } else {
        format!("it holds {} optimizer entries", saved.len())
    };
    Err(Error::invalid_argument(
        "optimizer state",
        format!(
            "the state is from step {steps}, when the {kind} optimizer keeps `step`, {buffers} \
             for each of its {n} parameters, but {count} of them have none (missing {names}; \
             {held}): it was removed after saving, and resuming would restart the {kind} \
             state instead of continuing it",
            kind = config.kind(),
            buffers = describe(&buffers),
            n = params.len(),
            count = missing.len(),
            names = names.join(", "),
        ),
    ))
}

/// `exp_avg and exp_avg_sq`, or `no buffers`.
fn describe(buffers: &[StateBuffer]) -> String {
    match buffers {
        [] => "no buffers".to_owned(),
        [only] => only.name.to_owned(),
        [rest @ .., last] => {
            let rest: Vec<&str> = rest.iter().map(|b| b.name).collect();
            format!("{} and {}", rest.join(", "), last.name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdagradConfig, AdamConfig, RmsPropConfig, SgdConfig};

    fn names(config: &OptimizerConfig) -> Vec<&'static str> {
        config.state_buffers().iter().map(|b| b.name).collect()
    }

    #[test]
    fn buffers_are_torch_optims() {
        assert!(names(&OptimizerConfig::Sgd(SgdConfig::new(0.1))).is_empty());
        assert_eq!(
            names(&OptimizerConfig::Sgd(
                SgdConfig::new(0.1).with_momentum(0.9)
            )),
            ["momentum_buffer"]
        );
        assert_eq!(
            names(&OptimizerConfig::Adam(
                AdamConfig::new(0.1).with_amsgrad(true)
            )),
            ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        );
        let rms = RmsPropConfig::new(0.1)
            .with_momentum(0.5)
            .with_centered(true);
        assert_eq!(
            names(&OptimizerConfig::RmsProp(rms)),
            ["square_avg", "momentum_buffer", "grad_avg"]
        );
        let adagrad = AdagradConfig::new(0.1).with_initial_accumulator_value(0.25);
        assert_eq!(
            OptimizerConfig::Adagrad(adagrad).state_buffers(),
            [StateBuffer {
                name: "sum",
                initial: 0.25
            }]
        );
    }

    #[test]
    fn a_bad_entry_is_refused_naming_it() {
        let adam = OptimizerConfig::Adam(AdamConfig::new(0.1));
        let mut state = StateDict::new();
        state.insert(
            "state.w.exp_avg".to_owned(),
            HostTensor::new(vec![0f32; 3], [3]).unwrap(),
        );
        let err = read_optimizer_state(&adam, &[("w", &[2])], &state).unwrap_err();
        assert!(err.to_string().contains("state.w.exp_avg"), "{err}");

        let mut state = StateDict::new();
        state.insert(
            "state.w.momentum_buffer".to_owned(),
            HostTensor::new(vec![0f32; 2], [2]).unwrap(),
        );
        let err = read_optimizer_state(&adam, &[("w", &[2])], &state).unwrap_err();
        assert!(err.to_string().contains("exp_avg and exp_avg_sq"), "{err}");

        let mut state = StateDict::new();
        state.insert("state.w.step".to_owned(), HostTensor::scalar(-1i64));
        let err = read_optimizer_state(&adam, &[("w", &[2])], &state).unwrap_err();
        assert!(err.to_string().contains("negative step count -1"), "{err}");
    }

    #[test]
    fn a_stepped_parameter_without_its_buffers_is_refused() {
        let adam = OptimizerConfig::Adam(AdamConfig::new(0.1));
        let mut state = StateDict::new();
        state.insert("state.w.step".to_owned(), HostTensor::scalar(3i64));
        state.insert(
            "state.w.exp_avg".to_owned(),
            HostTensor::new(vec![0f32; 2], [2]).unwrap(),
        );
        let err = read_optimizer_state(&adam, &[("w", &[2])], &state).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("state.w.exp_avg_sq") && text.contains("3 steps"),
            "{text}"
        );
        // Before the first step there are none yet, as in PyTorch.
        state.insert("state.w.step".to_owned(), HostTensor::scalar(0i64));
        assert!(read_optimizer_state(&adam, &[("w", &[2])], &state).is_ok());
        // Plain SGD keeps none.
        let sgd = OptimizerConfig::Sgd(SgdConfig::new(0.1));
        let mut state = StateDict::new();
        state.insert("state.w.step".to_owned(), HostTensor::scalar(3i64));
        assert!(read_optimizer_state(&sgd, &[("w", &[2])], &state).is_ok());
    }

    #[test]
    fn a_stripped_state_after_steps_is_refused_unless_stateless() {
        let fresh = ["state.a.step", "state.b.step", "group.0.lr"];
        let adam = OptimizerConfig::Adam(AdamConfig::new(0.1));
        let err = check_state_after_steps(&adam, &fresh, &StateDict::new(), 6).unwrap_err();
        let text = err.to_string();
        for wanted in [
            "step 6",
            "adam",
            "exp_avg and exp_avg_sq",
            "`state.a.step`",
            "`state.b.step`",
            "no optimizer state",
        ] {
            assert!(text.contains(wanted), "{wanted}: {text}");
        }
        let sgd = OptimizerConfig::Sgd(SgdConfig::new(0.1));
        assert!(check_state_after_steps(&sgd, &fresh, &StateDict::new(), 6).is_ok());
        let momentum = OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9));
        assert!(check_state_after_steps(&momentum, &fresh, &StateDict::new(), 6).is_err());
    }
}
