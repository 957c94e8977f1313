//! TensorFlow SavedModels: list their signatures, run them, fine-tune them through a
//! training signature, write the trained variables back, and export a [`TfModel`] as
//! one. See [`SavedModel`].
//!
//! Three rooms, with imports one way (`finetune` and `export` build on `load`; `load`
//! imports from neither, and nothing imports from this root, which only declares the
//! rooms and re-exports their public items):
//!
//! | room | holds | imports |
//! |---|---|---|
//! | `load` | reading a SavedModel: its files, `SaverDef`, object graph and signatures; [`SavedModel`] (load, describe, run, save its variables) | - |
//! | `finetune` | [`SavedModelModule`] (a SavedModel trained through its training signature), its [`SignatureOptimizer`] and checks; the `saved_model` layer | `load` |
//! | `export` | [`SavedModelExport`]: a [`TfModel`] written as a SavedModel, with the protobuf writer | `load` |
//!
//! [`TfModel`]: crate::TfModel

mod export;
mod finetune;
mod load;

pub use export::{export_saved_model, SavedModelExport, SERVING_SIGNATURE};
pub(crate) use finetune::SavedModelLayers;
pub use finetune::{
    resolve_saved_model_shapes, SavedModelModule, SavedModelModuleBuilder, SignatureOptimizer,
    VariableRole,
};
pub use load::{SavedModel, SignatureInfo, TensorDType, TensorSpec};
