//! The batch and sample an error happened for, added to its message (its
//! variant and source kept), and the message of a caught panic.

use std::any::Any;
use std::fmt;
use std::io;

use kiln_core::error::Error;

/// Sample indices an error message lists before abbreviating.
const LISTED_INDICES: usize = 8;

/// `[3, 9, 4]`, or the first few indices and a count.
pub(super) fn list_indices(indices: &[usize]) -> String {
    if indices.len() <= LISTED_INDICES {
        format!("{indices:?}")
    } else {
        format!(
            "{:?} and {} more",
            &indices[..LISTED_INDICES],
            indices.len() - LISTED_INDICES
        )
    }
}

/// The message of a panic payload (`panic!("...")` gives a `&str` or a `String`).
pub(super) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

/// `err` with `context` (`"batch 3, dataset index 17"`) prepended to the
/// free-text part of its message, keeping its variant and source.
///
/// Variants without a free-text field are returned unchanged and the
/// context is logged instead.
pub(super) fn with_context(err: Error, context: &str) -> Error {
    let prefix = |s: String| format!("{context}: {s}");
    match err {
        Error::ShapeMismatch {
            context: c,
            expected,
            actual,
        } => Error::ShapeMismatch {
            context: prefix(c),
            expected,
            actual,
        },
        Error::DTypeMismatch {
            context: c,
            expected,
            actual,
        } => Error::DTypeMismatch {
            context: prefix(c),
            expected,
            actual,
        },
        Error::DeviceMismatch {
            context: c,
            expected,
            actual,
        } => Error::DeviceMismatch {
            context: prefix(c),
            expected,
            actual,
        },
        Error::Io { path, source } => Error::Io {
            path,
            source: io::Error::new(
                source.kind(),
                ContextError {
                    context: context.to_string(),
                    source,
                },
            ),
        },
        Error::Checkpoint {
            path,
            reason,
            source,
        } => Error::Checkpoint {
            path,
            reason: prefix(reason),
            source,
        },
        Error::Data {
            path,
            offset,
            reason,
            source,
        } => Error::Data {
            path,
            offset,
            reason: prefix(reason),
            source,
        },
        Error::Backend {
            backend,
            context: c,
            source,
        } => Error::Backend {
            backend,
            context: prefix(c),
            source,
        },
        Error::Unsupported { what } => Error::Unsupported { what: prefix(what) },
        Error::InvalidArgument { name, reason } => Error::InvalidArgument {
            name,
            reason: prefix(reason),
        },
        other => {
            log::error!("data loader: {context}: {}", other.display_chain());
            other
        }
    }
}

/// The batch and sample an I/O error happened for; the I/O error is its
/// source, and is not repeated in its message.
#[derive(Debug)]
struct ContextError {
    context: String,
    source: io::Error,
}

impl fmt::Display for ContextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)
    }
}

impl std::error::Error for ContextError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic;
    use std::path::PathBuf;

    #[test]
    fn context_is_prepended_and_source_kept() {
        let e = with_context(
            Error::data(PathBuf::from("x.bin"), Some(4), "bad byte"),
            "batch 2, dataset index 9",
        );
        assert_eq!(
            e.to_string(),
            "malformed data file x.bin at byte 4: batch 2, dataset index 9: bad byte"
        );

        let e = with_context(
            Error::io("img/7.png", io::Error::new(io::ErrorKind::NotFound, "gone")),
            "batch 0, dataset index 7",
        );
        assert_eq!(
            e.display_chain().to_string(),
            "img/7.png: batch 0, dataset index 7: gone"
        );
        match &e {
            Error::Io { source, .. } => assert_eq!(source.kind(), io::ErrorKind::NotFound),
            other => panic!("unexpected {other:?}"),
        }
        assert!(std::error::Error::source(&e).is_some());

        let e = with_context(Error::unsupported("float16"), "batch 1, dataset index 3");
        assert_eq!(
            e.to_string(),
            "unsupported: batch 1, dataset index 3: float16"
        );
    }

    #[test]
    fn index_lists_are_abbreviated() {
        assert_eq!(list_indices(&[3, 1]), "[3, 1]");
        let many: Vec<usize> = (0..10).collect();
        assert_eq!(list_indices(&many), "[0, 1, 2, 3, 4, 5, 6, 7] and 2 more");
    }

    #[test]
    fn panic_messages_are_extracted() {
        let p = panic::catch_unwind(|| panic!("static {}", "text")).expect_err("panics");
        assert_eq!(panic_message(p.as_ref()), "static text");
        let p = panic::catch_unwind(|| std::panic::panic_any(5u8)).expect_err("panics");
        assert_eq!(
            panic_message(p.as_ref()),
            "a panic with a non-string payload"
        );
    }
}
