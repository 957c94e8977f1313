//! The one thread-safety claim kiln-c10d makes that libtorch's types do not:
//! [`StepShared`], the tensor handles that a strategy's parts share behind an
//! `Arc` (its step hooks, its optimizer, the gradient hooks autograd runs, the
//! prefetch schedule). Everything else in the crate is `Send` or `Sync` by
//! its fields: the c10d objects are `Send` by their declarations at the FFI
//! edge (`bridge.rs`), the process group `Sync` by its own lock (`group.rs`).

use std::ops::Deref;

/// A value (a tensor handle, or a list of them) shared by the parts of one
/// strategy and used only within the training step's sequence. It derefs to
/// the value.
#[derive(Debug)]
pub(crate) struct StepShared<T>(T);

// SAFETY: `tch::Tensor` is `Send` but not `Sync` because libtorch does not
// synchronise calls on one tensor from two threads at once. A `StepShared`
// tensor is used only by the training step, whose phases run one at a time:
// the training thread runs the forward pass, then waits inside `backward()`
// while autograd's thread for the device runs the gradient hooks, then runs
// the optimizer step and the checkpoint's gathers. No two threads touch these
// handles at the same time, so sharing a reference between them is sound.
// The values are private to kiln-c10d's strategies; none is handed to users.
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for StepShared<T> {}

impl<T> StepShared<T> {
    /// `value`, to be shared by a strategy's parts.
    pub(crate) fn new(value: T) -> Self {
        StepShared(value)
    }
}

impl<T> Deref for StepShared<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}
