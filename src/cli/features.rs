//! Which of Kiln's optional features an executable was built with, and which a
//! command needs.
//!
//! `cargo xtask kiln` builds `kiln` with libtorch alone at first (the main job,
//! a CNN on the digits, needs nothing more), and a command that needs more
//! (a Hugging Face model or text data, image files, ONNX, Kiln's fused ops as
//! layers) makes `kiln` exit with [`FEATURES_MISSING_EXIT_CODE`] having read
//! and written nothing: the xtask then builds `kiln` with every feature, once,
//! and runs the command again. `needs.rs` decides from the command line and
//! the config's TOML alone (no data, checkpoint or model read), as
//! `needs_tensorflow` does for TensorFlow; [`FeatureMissing`] in the code that
//! a feature removes is the safety net, for a case it did not foresee. A leaf:
//! it imports no module of the crate.

use std::fmt;

/// The exit status of `kiln` when a command needs a feature it was built
/// without ([`FeatureMissing`]): nothing was read or written, so `cargo xtask
/// kiln`, which builds `kiln` with libtorch alone at first, builds it with
/// every feature on this status and runs the command again (`EX_UNAVAILABLE`
/// of `sysexits.h`).
pub const FEATURES_MISSING_EXIT_CODE: i32 = 69;

/// An optional feature of the `kiln` executables (the `kiln` crate's feature
/// of the same name turns it on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Feature {
    /// Language models: Hugging Face checkpoints, tokenizers, text data,
    /// PEFT adapters and generation (kiln-hf, kiln-text).
    Text,
    /// Image data: decoders, image folders, WebDataset shards and
    /// torchvision's transforms (kiln-vision).
    Vision,
    /// ONNX export, and ONNX models to predict with or inspect (kiln-onnx).
    Onnx,
    /// Kiln's fused C++ ops as layers (`type = "custom", op = "kiln::..."`).
    Ops,
}

impl Feature {
    /// The feature's name, as `--features` takes it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Feature::Text => "text",
            Feature::Vision => "vision",
            Feature::Onnx => "onnx",
            Feature::Ops => "ops",
        }
    }

    /// Whether this executable was built with it.
    pub(crate) fn compiled(self) -> bool {
        match self {
            Feature::Text => cfg!(feature = "text"),
            Feature::Vision => cfg!(feature = "vision"),
            Feature::Onnx => cfg!(feature = "onnx"),
            Feature::Ops => cfg!(feature = "ops"),
        }
    }
}

/// A command needs a feature this executable was built without.
#[derive(Debug, PartialEq, Eq)]
pub struct FeatureMissing {
    feature: Feature,
    what: String,
}

impl FeatureMissing {
    /// `what` (for example "text data") needs `feature`.
    pub(crate) fn new(feature: Feature, what: impl Into<String>) -> FeatureMissing {
        FeatureMissing {
            feature,
            what: what.into(),
        }
    }

    /// The feature needed.
    pub(crate) fn feature(&self) -> Feature {
        self.feature
    }
}

impl fmt::Display for FeatureMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.feature.name();
        write!(
            f,
            "{} needs Kiln's `{name}` feature, which this executable was built without: \
             `cargo xtask kiln ...` builds kiln with every feature when a command first needs \
             one, or build it with `cargo build --release -p kiln --features {name}` (the \
             crate's default features include it)",
            self.what
        )
    }
}

impl std::error::Error for FeatureMissing {}

/// `Ok` when this executable has `feature`, else the [`FeatureMissing`] error
/// for `what` (used where ONNX code is left out).
#[cfg(not(feature = "onnx"))]
pub(crate) fn require(feature: Feature, what: &str) -> Result<(), FeatureMissing> {
    if feature.compiled() {
        Ok(())
    } else {
        Err(FeatureMissing::new(feature, what))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_feature_says_what_needs_it_and_how_to_build_it() {
        let missing = FeatureMissing::new(Feature::Onnx, "exporting ONNX");
        assert_eq!(
            missing.to_string(),
            "exporting ONNX needs Kiln's `onnx` feature, which this executable was built \
             without: `cargo xtask kiln ...` builds kiln with every feature when a command \
             first needs one, or build it with `cargo build --release -p kiln --features onnx` \
             (the crate's default features include it)"
        );
    }
}
