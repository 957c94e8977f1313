//! Kiln's TensorFlow backend, through the TensorFlow C API ([`tensorflow`] crate).
//!
//! This crate converts between [`kiln_core::HostTensor`] and TensorFlow tensors
//! ([`TfTensor`] for any supported dtype, [`to_tf`] / [`from_tf`] for a known one)
//! and turns TensorFlow's [`tensorflow::Status`] into [`kiln_core::Error::Backend`].
//!
//! ```no_run
//! use kiln_core::HostTensor;
//! use kiln_tf::TfTensor;
//!
//! let host = HostTensor::new(vec![1i64, 2, 3], [3])?;
//! let tf = TfTensor::from_host(&host)?;
//! assert_eq!(tf.to_host()?, host);
//! # Ok::<(), kiln_core::Error>(())
//! ```
// `unsafe` only in `quiet`: the one call into Abseil, TensorFlow's logger.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod convert;
mod custom_layer;
mod distributed;
mod engine;
mod error;
mod graph;
mod layers;
mod loss;
mod model;
mod optim;
mod profile;
mod quiet;
mod runtime;
mod saved_model;
mod step;
mod train;
mod zero;

pub use backend::TfBackend;
pub use convert::{from_tf, to_tf, TfTensor};
pub use custom_layer::{
    custom_layer_registered, portable_custom_layer_registered, register_custom_layer,
    register_portable_custom_layer, CustomLayerFn,
};
pub use distributed::{data_parallel, GradientAllReduce};
pub use error::tf_error;
pub use model::TfModel;
pub use optim::{TfOptimizer, TfShardedOptimizer};
pub use profile::TfProfiler;
pub use quiet::{follow_log_level, TENSORFLOW_LOG_TARGET};
pub use runtime::{check_runtime_version, runtime_version, set_thread_counts, TENSORFLOW_VERSION};
pub use saved_model::{
    export_saved_model, resolve_saved_model_shapes, SavedModel, SavedModelExport, SavedModelModule,
    SavedModelModuleBuilder, SignatureInfo, SignatureOptimizer, TensorDType, TensorSpec,
    VariableRole, SERVING_SIGNATURE,
};
pub use zero::{zero_data_parallel, ZeroDataParallel, ZeroRedundancy};
