//! What the module knows of each SavedModel variable and signature tensor, with
//! the ops Kiln added to the graph for it.

use kiln_core::DType;
use tensorflow::{Operation, Output};

use crate::saved_model::load::TensorSpec;

/// What a SavedModel variable is to the [`SavedModelModule`] wrapping it.
///
/// [`SavedModelModule`]: crate::SavedModelModule
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum VariableRole {
    /// Trainable model state: in [`Module::named_parameters`].
    ///
    /// [`Module::named_parameters`]: kiln_core::module::Module::named_parameters
    Parameter,
    /// Non-trainable model state (batch-norm statistics): in
    /// [`Module::named_buffers`].
    ///
    /// [`Module::named_buffers`]: kiln_core::module::Module::named_buffers
    Buffer,
    /// The exported optimizer's state (step count, moments, learning rate): in the
    /// [`SignatureOptimizer`]'s state dict.
    ///
    /// [`SignatureOptimizer`]: crate::SignatureOptimizer
    Optimizer,
}

/// One SavedModel variable with the ops Kiln added to read and write it.
#[derive(Debug)]
pub(super) struct Variable {
    pub(super) name: String,
    pub(super) role: VariableRole,
    pub(super) dtype: DType,
    pub(super) dims: Vec<usize>,
    /// The handle's current value.
    pub(super) read: Output,
    /// The placeholder that [`write`](Self::write) assigns.
    pub(super) feed: Output,
    /// `handle = feed`, and `mirror = feed` for a Keras mirror.
    pub(super) write: Vec<Operation>,
}

/// A signature tensor resolved in the graph.
#[derive(Debug, Clone)]
pub(super) struct BoundTensor {
    pub(super) spec: TensorSpec,
    pub(super) port: Output,
}
