//! The `finetune` room: a loaded SavedModel put to work in Kiln's training.
//!
//! | file | what |
//! |---|---|
//! | `module.rs` | [`SavedModelModule`]: a SavedModel trained through its training signature, as a `Module` and `Trainable` |
//! | `builder.rs` | [`SavedModelModuleBuilder`]: naming its signatures and tensors |
//! | `checks.rs` | finding and checking those signatures, tensors and variables |
//! | `shared.rs` | what the module and its optimizer share, and the session runs they make |
//! | `variable.rs` | [`VariableRole`], and the ops Kiln adds per variable |
//! | `optimizer.rs` | [`SignatureOptimizer`]: the optimizer the training signature applies |
//! | `layer/` | the `saved_model` layer: a signature imported into a [`TfModel`](crate::TfModel) as a frozen feature extractor, to fine-tune the layers around it |
//!
//! Everything here builds on the `load` room ([`SavedModel`](crate::SavedModel) and
//! its resolved signatures); nothing here is used by `load` or `export`.

mod builder;
mod checks;
mod layer;
mod module;
mod optimizer;
mod shared;
mod variable;

pub use builder::SavedModelModuleBuilder;
pub use layer::resolve_saved_model_shapes;
pub(crate) use layer::SavedModelLayers;
pub use module::SavedModelModule;
pub use optimizer::SignatureOptimizer;
pub use variable::VariableRole;
