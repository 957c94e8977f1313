//! The TensorFlow library actually loaded at run time.

use kiln_core::{Error, Result};

/// The TensorFlow version Kiln is built and tested against.
pub const TENSORFLOW_VERSION: &str = "2.21.0";

/// The version string of the loaded TensorFlow library (`TF_Version`).
pub fn runtime_version() -> Result<String> {
    tensorflow::version()
        .map_err(|e| Error::backend_with_source("tensorflow", "reading TF_Version", e))
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

/// Thread counts for the sessions Kiln creates (0: TensorFlow's choice).
static THREAD_COUNTS: std::sync::Mutex<(u32, u32)> = std::sync::Mutex::new((0, 0));

/// Whether a session was created: TensorFlow sizes its thread pools once, with the
/// first session of the process.
static SESSION_CREATED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets how many threads TensorFlow uses: `intra_op` within one op (the blocks of a
/// matrix product) and `inter_op` to run independent ops at once; 0 leaves
/// TensorFlow's default (one per core). As `tf.config.threading`'s
/// `set_intra_op_parallelism_threads` / `set_inter_op_parallelism_threads`.
///
/// TensorFlow sizes its thread pools once per process, when the first session is
/// created, so this must be called before any model is built or loaded; a change
/// after that is [`Error::InvalidArgument`] (setting the counts in force again is
/// not).
///
/// ```no_run
/// kiln_tf::set_thread_counts(2, 2)?;
/// // ... build models, train ...
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn set_thread_counts(intra_op: usize, inter_op: usize) -> Result<()> {
    let to_u32 = |name: &str, n: usize| {
        u32::try_from(n)
            .ok()
            .filter(|n| *n <= i32::MAX as u32)
            .ok_or_else(|| Error::invalid_argument(name, format!("{n} threads is too many")))
    };
    let wanted = (to_u32("intra_op", intra_op)?, to_u32("inter_op", inter_op)?);
    let mut counts = THREAD_COUNTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if *counts != wanted && SESSION_CREATED.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(Error::invalid_argument(
            "thread counts",
            format!(
                "TensorFlow's thread pools were sized when the first session was created \
                 (intra-op {}, inter-op {}; 0 is one per core); set them before building \
                 or loading any TensorFlow model",
                counts.0, counts.1
            ),
        ));
    }
    *counts = wanted;
    Ok(())
}

/// The serialised `ConfigProto` holding `intra_op_parallelism_threads` (field 2)
/// and `inter_op_parallelism_threads` (field 5), each only where non-zero.
fn config_proto((intra_op, inter_op): (u32, u32)) -> Vec<u8> {
    let mut out = Vec::new();
    for (field, value) in [(2u8, intra_op), (5, inter_op)] {
        if value == 0 {
            continue;
        }
        out.push(field << 3); // wire type 0: varint
        let mut v = value;
        while v >= 0x80 {
            out.push((v as u8 & 0x7f) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    out
}

/// Options for a new session, with the thread counts of [`set_thread_counts`].
pub(crate) fn session_options() -> Result<tensorflow::SessionOptions> {
    crate::quiet::follow_log_level();
    let counts = *THREAD_COUNTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut options = tensorflow::SessionOptions::new();
    options
        .set_config(&config_proto(counts))
        .map_err(|s| crate::tf_error("setting the session's thread counts", s))?;
    SESSION_CREATED.store(true, std::sync::atomic::Ordering::SeqCst);
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_proto_holds_the_non_zero_counts_as_varints() {
        assert_eq!(config_proto((0, 0)), Vec::<u8>::new());
        assert_eq!(config_proto((3, 0)), vec![0x10, 3]);
        assert_eq!(config_proto((0, 1)), vec![0x28, 1]);
        // 300 = 0b10_0101100: low 7 bits first, with the continuation bit.
        assert_eq!(config_proto((300, 2)), vec![0x10, 0xac, 0x02, 0x28, 2]);
    }
}
