//! The error a kernel or shape function returns.

/// What went wrong in an op: the engines turn it into their own error (a
/// `c10::Error` in libtorch, the op's failure status in TensorFlow), with this
/// text as the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// Bad input or a failed check, with a message naming what was expected.
    #[error("{message}")]
    Invalid {
        /// The message, prefixed with the op's name once it leaves the op.
        message: String,
    },
    /// A panic in the op's Rust code, caught before it could unwind into C or C++.
    #[error("{op}: the {what} panicked: {message}")]
    Panic {
        /// The op, `namespace::name`.
        op: String,
        /// `kernel` or `shape function`.
        what: String,
        /// The panic's message.
        message: String,
    },
}

impl OpError {
    /// An error with this message: say what was wrong and what was expected,
    /// e.g. `"weight has 7 elements, expected x's last dimension, 8"`.
    pub fn new(message: impl Into<String>) -> Self {
        OpError::Invalid {
            message: message.into(),
        }
    }

    /// Prefixes the message with the op's name unless it already starts with it.
    pub(crate) fn in_op(self, op: &str) -> Self {
        match self {
            OpError::Invalid { message } if !message.starts_with(op) => OpError::Invalid {
                message: format!("{op}: {message}"),
            },
            other => other,
        }
    }
}
