//! The typed key of a compiled program: what it computes ([`ProgramKind`]), in
//! which mode, on which batch [`Signature`]s. One [`ProgramKey`] identifies one
//! program in a graph's cache; its [`Hash`] is written by hand because the loss and
//! clipping settings hold floats.

use std::hash::{Hash, Hasher};

use kiln_core::{loss::Loss, optim::GradClip, DType};

use crate::convert::TfTensor;

/// The dims of a batch with the batch dimension left open (`-1`), and its dtype:
/// what a program's placeholder accepts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Signature {
    /// The tensor's dims, the first (the batch) as `-1`.
    pub(crate) dims: Vec<i64>,
    pub(crate) dtype: DType,
}

impl Signature {
    /// The signature of `tensor` (a scalar keeps no dims).
    pub(crate) fn of(tensor: &TfTensor) -> Self {
        let mut dims: Vec<i64> = tensor.shape().dims().iter().map(|&d| d as i64).collect();
        if let Some(first) = dims.first_mut() {
            *first = -1;
        }
        Signature {
            dims,
            dtype: tensor.dtype(),
        }
    }

    /// The per-sample dims (all but the batch).
    pub(crate) fn sample(&self) -> &[i64] {
        self.dims.get(1..).unwrap_or(&[])
    }
}

/// Which optimizer a program updates (optimizers over one model share its graph).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct OptimizerId(pub(crate) u64);

/// Where an [`ProgramKind::Apply`] program takes its gradients from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum GradientSource {
    /// Fed by the caller, a placeholder for each parameter that has a gradient
    /// (`present`, in the optimizer's order; gradients computed elsewhere, e.g.
    /// averaged across processes).
    Fed { present: Vec<bool> },
    /// The accumulators that training micro-batches without `apply` added to.
    Accumulated,
    /// Fed by the caller as one flat float vector, what a
    /// [`ProgramKind::FlatGradients`] program fetches: the gradients of the
    /// parameters marked `present` (in the optimizer's order), each flattened,
    /// then one last element that the update ignores (the loss).
    Flat { present: Vec<bool> },
}

/// What a program computes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ProgramKind {
    /// The model's output.
    Forward,
    /// The model's output and its loss.
    Eval { loss: Loss },
    /// The loss and each parameter's gradient, fetched; nothing is updated.
    Gradients { loss: Loss },
    /// Forward, loss and gradients, then the optimizer's update (`apply`) or the
    /// gradients added to the accumulators. Skipped, except for the fetched loss,
    /// when the loss is not finite.
    Train {
        optimizer: OptimizerId,
        loss: Loss,
        apply: bool,
        clip: Option<GradClip>,
        /// Whether accumulators exist (an applying step then adds their sum).
        accumulators: bool,
    },
    /// The optimizer's update from gradients fed or accumulated.
    Apply {
        optimizer: OptimizerId,
        source: GradientSource,
        clip: Option<GradClip>,
    },
    /// The optimizer's gradient accumulators set to zero.
    ZeroAccumulators { optimizer: OptimizerId },
    /// Forward, loss, and the gradients of `loss * scale` with respect to the
    /// optimizer's parameters, fetched as **one** float vector (each gradient
    /// flattened, in the optimizer's order, then the unscaled loss): the buffer
    /// a data-parallel step all-reduces. No variable changes except the
    /// forward pass's state updates (batch-norm statistics), which run when the
    /// loss is finite, as in [`ProgramKind::Train`].
    FlatGradients { optimizer: OptimizerId, loss: Loss },
}

/// One compiled program's identity: what it computes, in which mode, on which
/// batch signatures.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ProgramKey {
    pub(crate) kind: ProgramKind,
    /// Training mode (dropout draws, batch norm uses and updates batch statistics).
    pub(crate) train: bool,
    /// The model's input.
    pub(crate) input: Option<Signature>,
    pub(crate) target: Option<Signature>,
}

// `Loss` and `GradClip` hold floats, so `PartialEq` is derived and equivalence is
// asserted here: their settings are validated (never NaN) before a program is
// built, so equality is reflexive on every key that reaches the cache (and a NaN
// would only miss it).
impl Eq for ProgramKey {}

impl Hash for ProgramKey {
    /// Hashes everything but the float settings (equal keys still hash equally).
    fn hash<H: Hasher>(&self, state: &mut H) {
        std::mem::discriminant(&self.kind).hash(state);
        match &self.kind {
            ProgramKind::Forward => {}
            ProgramKind::Eval { loss } | ProgramKind::Gradients { loss } => {
                std::mem::discriminant(loss).hash(state);
            }
            ProgramKind::Train {
                optimizer,
                loss,
                apply,
                clip,
                accumulators,
            } => {
                optimizer.hash(state);
                std::mem::discriminant(loss).hash(state);
                apply.hash(state);
                clip.as_ref().map(std::mem::discriminant).hash(state);
                accumulators.hash(state);
            }
            ProgramKind::Apply {
                optimizer,
                source,
                clip,
            } => {
                optimizer.hash(state);
                source.hash(state);
                clip.as_ref().map(std::mem::discriminant).hash(state);
            }
            ProgramKind::ZeroAccumulators { optimizer } => optimizer.hash(state),
            ProgramKind::FlatGradients { optimizer, loss } => {
                optimizer.hash(state);
                std::mem::discriminant(loss).hash(state);
            }
        }
        self.train.hash(state);
        self.input.hash(state);
        self.target.hash(state);
    }
}
