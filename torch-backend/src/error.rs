//! libtorch errors as Kiln errors.

use kiln_core::Error;

/// Wraps a [`tch::TchError`] as [`Error::Backend`], keeping it as the source and
/// naming the operation that failed. The message is libtorch's without the C++
/// stack trace it appends ("Exception raised from ... frame #0 ..."); the
/// source keeps the whole text.
pub fn torch_error(context: &str, error: tch::TchError) -> Error {
    let text = error.to_string();
    let message = match text.find("\nException raised from") {
        Some(end) => text[..end].trim_end().to_owned(),
        None => text,
    };
    Error::Backend {
        backend: "torch",
        context: context.to_owned(),
        message,
        source: Some(Box::new(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpp_stack_trace_is_cut_from_the_message() {
        let error = tch::Tensor::zeros([2, 3], (tch::Kind::Float, tch::Device::Cpu))
            .f_matmul(&tch::Tensor::zeros(
                [2, 3],
                (tch::Kind::Float, tch::Device::Cpu),
            ))
            .unwrap_err();
        let full = error.to_string();
        let err = torch_error("multiplying", error);
        let text = err.to_string();
        assert!(text.starts_with("torch failed in multiplying: "), "{text}");
        assert!(text.contains("cannot be multiplied"), "{text}");
        assert!(!text.contains("frame #"), "{text}");
        if full.contains("frame #") {
            let source = std::error::Error::source(&err).map(ToString::to_string);
            assert_eq!(source.as_deref(), Some(full.as_str()));
        }
    }
}
