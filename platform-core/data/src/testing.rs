//! Test-only helpers.

/// The parts of an [`Error::Data`](kiln_core::Error::Data); panics on any other error.
pub(crate) fn data_error(err: kiln_core::Error) -> (std::path::PathBuf, Option<u64>, String) {
    match err {
        kiln_core::Error::Data {
            path,
            offset,
            reason,
            ..
        } => (path, offset, reason),
        other => panic!("expected Error::Data, got {other:?}"),
    }
}
