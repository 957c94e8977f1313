//! Freezing parts of a torch module for fine-tuning, as PyTorch users do with
//! `p.requires_grad_(False)` and by keeping a frozen backbone's batch norm in
//! eval mode.

use kiln_core::{module::name_matches, module::Module, Error, Result};

use crate::backend::TorchBackend;
use crate::error::torch_error;

/// Freezing for torch modules.
///
/// ```no_run
/// use kiln_core::{backend::Trainable, module::Module, optim::{OptimizerConfig, SgdConfig}, Device};
/// use kiln_torch::{Freeze, ScriptModule};
///
/// let mut backbone = ScriptModule::load("backbone.pt", Device::Cpu)?;
/// backbone.freeze(&["*"])?;                       // every parameter
/// backbone.keep_frozen_batch_norm_in_eval()?;     // running statistics stay as loaded
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub trait Freeze: Module<TorchBackend> {
    /// Stops training the parameters whose names match one of `patterns`
    /// (globs, see [`name_matches`]): they get no gradient, and optimizers
    /// built afterwards ([`Trainable::build_optimizer`](kiln_core::backend::Trainable::build_optimizer))
    /// leave them out. Returns the frozen names, in the module's order.
    ///
    /// A pattern that matches no parameter is [`Error::InvalidArgument`] naming
    /// it (a typo would otherwise train what was meant to stay fixed); nothing
    /// is frozen then.
    fn freeze(&mut self, patterns: &[&str]) -> Result<Vec<String>> {
        let params = self.named_parameters()?;
        for pattern in patterns {
            if !params.iter().any(|(name, _)| name_matches(pattern, name)) {
                let some: Vec<&str> = params.iter().take(6).map(|(n, _)| n.as_str()).collect();
                return Err(Error::invalid_argument(
                    "freeze",
                    format!(
                        "`{pattern}` matches no parameter of the model (its parameters: {}{})",
                        some.join(", "),
                        if params.len() > some.len() {
                            ", ..."
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        let mut frozen = Vec::new();
        for (name, tensor) in params {
            if patterns.iter().any(|p| name_matches(p, &name)) {
                let _ = tensor
                    .f_set_requires_grad(false)
                    .map_err(|e| torch_error(&format!("freezing {name}"), e))?;
                frozen.push(name);
            }
        }
        Ok(frozen)
    }

    /// Keeps every batch-norm layer whose parameters are all frozen (or that
    /// has none, inside a frozen part) in eval mode while the rest of the
    /// module trains, as fine-tuning recipes do: its running statistics stay
    /// as loaded and it normalises with them. Returns the layers' names.
    fn keep_frozen_batch_norm_in_eval(&mut self) -> Result<Vec<String>>;
}

/// Whether every parameter under `prefix.` is frozen (`false` when there is none).
pub(crate) fn all_frozen(params: &[(String, tch::Tensor)], prefix: &str) -> bool {
    let under = format!("{prefix}.");
    let mut inside = params
        .iter()
        .filter(|(n, _)| n.starts_with(&under))
        .peekable();
    inside.peek().is_some() && inside.all(|(_, t)| !t.requires_grad())
}
