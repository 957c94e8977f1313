//! Compiled programs: what a session run feeds, fetches and runs, keyed by one
//! typed [`ProgramKey`] in one cache per graph ([`CompiledGraph`]), and
//! composed here from the same four parts: the model's forward pass, a loss,
//! gradients, and an optimizer's updates.
//!
//! | program | parts | used by |
//! |---|---|---|
//! | [`ProgramKind::Forward`] | forward | `Module::forward` |
//! | [`ProgramKind::Eval`] | forward, loss | `Trainable::eval_step` |
//! | [`ProgramKind::Gradients`] | forward, loss, gradients (fetched) | `TfModel::gradients` |
//! | [`ProgramKind::Train`] | forward, loss, gradients, then updates or accumulation | `Trainable::train_step` |
//! | [`ProgramKind::Apply`] | updates from fed or accumulated gradients | `TfOptimizer::apply_gradients`, `Optimizer::step` |
//! | [`ProgramKind::FlatGradients`] | forward, loss, gradients as one flat vector (fetched) | data-parallel `train_step` |
//!
//! All programs of a model share one forward graph per input signature and mode:
//! a program adds only what it needs on top of it.
//!
//! | file | what |
//! |---|---|
//! | `key.rs` | the typed key: [`ProgramKey`], [`ProgramKind`], [`Signature`], [`GradientSource`], [`OptimizerId`] |
//! | `compose.rs` | building programs on a [`CompiledGraph`] ([`program`]) and running them ([`run`]) |

mod compose;
mod input;
mod key;

pub(crate) use compose::{flat_len, program, run, CompiledGraph, ModelGraph, UpdateRule};
pub(crate) use key::{GradientSource, OptimizerId, ProgramKey, ProgramKind, Signature};
