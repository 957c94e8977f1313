//! libtorch errors as Kiln errors.
//!
//! libtorch appends a C++ stack trace to many of its messages ("Exception raised
//! from ... (most recent call first):" followed by `frame #N: ...` lines). It is
//! noise to a user and can run to dozens of lines, so it never reaches an error
//! chain's `Display`: [`torch_error`] wraps the [`tch::TchError`] in a
//! [`TorchError`], which displays the message without the trace and keeps the
//! trace for a developer ([`TorchError::native_trace`], and `Debug`).

use std::fmt;

use kiln_core::Error;

/// Where libtorch's C++ stack trace starts in a message, if it has one.
fn trace_start(text: &str) -> Option<usize> {
    ["\nException raised from", "\nframe #0:"]
        .iter()
        .filter_map(|marker| text.find(marker))
        .min()
}

/// A libtorch error whose `Display` is libtorch's message without the C++ stack
/// trace libtorch appends to it; the source of the [`Error::Backend`] that
/// [`torch_error`] makes.
///
/// The trace is kept: [`native_trace`](Self::native_trace) returns it, `Debug`
/// shows it with the whole [`tch::TchError`], and
/// [`tch_error`](Self::tch_error) gives the original value. Its
/// [`source`](std::error::Error::source) is the `TchError`'s own source (an I/O
/// error, for example), never the `TchError` itself, whose `Display` would bring
/// the trace back.
pub struct TorchError {
    /// The message up to the trace.
    message: String,
    /// The trace, from "Exception raised from", when there is one.
    trace: Option<String>,
    /// The original error (its `Display` is `message` and `trace` together).
    error: tch::TchError,
}

impl TorchError {
    /// Splits `error`'s text into the message and libtorch's C++ stack trace.
    pub fn new(error: tch::TchError) -> Self {
        let text = error.to_string();
        let (message, trace) = match trace_start(&text) {
            Some(start) => (
                text[..start].trim_end().to_owned(),
                Some(text[start..].trim().to_owned()),
            ),
            None => (text, None),
        };
        Self {
            message,
            trace,
            error,
        }
    }

    /// libtorch's message, without the C++ stack trace (this error's `Display`).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The C++ stack trace libtorch appended to the message ("Exception raised
    /// from ..." and the `frame #N` lines), when there was one.
    pub fn native_trace(&self) -> Option<&str> {
        self.trace.as_deref()
    }

    /// The original error, whose `Display` still carries the trace.
    pub fn tch_error(&self) -> &tch::TchError {
        &self.error
    }

    /// The original error.
    pub fn into_tch_error(self) -> tch::TchError {
        self.error
    }
}

impl fmt::Display for TorchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for TorchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TorchError")
            .field("message", &self.message)
            .field("native_trace", &self.trace)
            .field("error", &self.error)
            .finish()
    }
}

impl std::error::Error for TorchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // `TchError`'s wrapping variants are transparent: their source is the
        // wrapped error's source, which this error's message already shows.
        std::error::Error::source(&self.error)
    }
}

impl From<tch::TchError> for TorchError {
    fn from(error: tch::TchError) -> Self {
        Self::new(error)
    }
}

/// Wraps a [`tch::TchError`] as [`Error::Backend`] naming the operation that
/// failed, with a [`TorchError`] as its source: the chain shows libtorch's
/// message once, without the C++ stack trace (which the `TorchError` keeps).
pub fn torch_error(context: &str, error: tch::TchError) -> Error {
    Error::backend_with_source("torch", context, TorchError::new(error))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::error::ErrorChain;

    fn matmul_error() -> tch::TchError {
        tch::Tensor::zeros([2, 3], (tch::Kind::Float, tch::Device::Cpu))
            .f_matmul(&tch::Tensor::zeros(
                [2, 3],
                (tch::Kind::Float, tch::Device::Cpu),
            ))
            .unwrap_err()
    }

    #[test]
    fn the_cpp_stack_trace_is_cut_from_the_message() {
        let error = matmul_error();
        let full = error.to_string();
        let err = torch_error("multiplying", error);
        let text = ErrorChain::new(&err).to_string();
        assert!(text.starts_with("torch failed in multiplying: "), "{text}");
        assert!(text.contains("cannot be multiplied"), "{text}");
        assert!(!text.contains("frame #"), "{text}");
        let source = std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<TorchError>())
            .expect("a TorchError source");
        assert_eq!(source.tch_error().to_string(), full);
        if full.contains("frame #") {
            let trace = source.native_trace().expect("a trace");
            assert!(trace.starts_with("Exception raised from"), "{trace}");
            assert!(format!("{source:?}").contains("frame #"));
        }
    }

    #[test]
    fn a_message_without_a_trace_is_kept_whole() {
        let err = TorchError::new(tch::TchError::Kind("exp_avg missing".into()));
        assert_eq!(err.to_string(), "tensor kind error: exp_avg missing");
        assert_eq!(err.native_trace(), None);

        let text = "Internal torch error: bad\nframe #0: c10::Error::Error() + 0x9d";
        assert_eq!(trace_start(text), Some("Internal torch error: bad".len()));
    }
}
