//! The TensorFlow library actually loaded at run time.

use kiln_core::{Error, Result};

/// The TensorFlow version Kiln is built and tested against.
pub const TENSORFLOW_VERSION: &str = "2.21.0";

/// The version string of the loaded TensorFlow library (`TF_Version`).
pub fn runtime_version() -> Result<String> {
    tensorflow::version()
        .map_err(|e| Error::backend("tensorflow", "reading TF_Version", e.to_string()))
}

/// Checks that the loaded library is TensorFlow [`TENSORFLOW_VERSION`]; a different
/// one is `Error::Unsupported` naming both versions.
pub fn check_runtime_version() -> Result<()> {
    let found = runtime_version()?;
    if found != TENSORFLOW_VERSION {
        return Err(Error::unsupported(format!(
            "TensorFlow {found} is loaded, but Kiln needs {TENSORFLOW_VERSION}; point LIBTENSORFLOW \
             at TensorFlow {TENSORFLOW_VERSION} or unset it and run `cargo xtask setup`"
        )));
    }
    Ok(())
}
