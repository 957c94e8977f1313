//! The ONNX pieces Kiln takes from the virtualenv: `onnx.proto` from the `onnx`
//! wheel (its protobuf types are generated from it at build time) and
//! `libonnxruntime.so` from the `onnxruntime` wheel (loaded at run time).

use std::path::{Path, PathBuf};

use crate::error::{BuildError, Result};
use crate::layout::Layout;
use crate::provision::existing_venv;
use crate::versions::{ONNXRUNTIME_VERSION, ONNX_VERSION};

/// Where the ONNX schema and the ONNX Runtime library are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Onnx {
    /// `onnx.proto` (proto2) of the pinned `onnx` wheel.
    pub proto: PathBuf,
    /// `libonnxruntime.so.<version>` of the pinned `onnxruntime` wheel.
    pub runtime_library: PathBuf,
}

impl Onnx {
    /// Finds both in the project virtualenv above `start` (a crate's manifest
    /// directory), unless `KILN_ONNX_PROTO` and `KILN_ONNXRUNTIME_LIB` name them.
    pub fn find_from(start: &Path) -> Result<Self> {
        let site_packages = || -> Result<PathBuf> {
            let layout = Layout::find_from(start).ok_or_else(|| not_provisioned(start))?;
            existing_venv(&layout)
                .map(|venv| venv.site_packages)
                .ok_or_else(|| not_provisioned(&layout.venv()))
        };
        let proto = match std::env::var_os("KILN_ONNX_PROTO") {
            Some(path) => PathBuf::from(path),
            None => site_packages()?.join("onnx").join("onnx.proto"),
        };
        let runtime_library = match std::env::var_os("KILN_ONNXRUNTIME_LIB") {
            Some(path) => PathBuf::from(path),
            None => site_packages()?
                .join("onnxruntime")
                .join("capi")
                .join(format!("libonnxruntime.so.{ONNXRUNTIME_VERSION}")),
        };
        for (what, path, fix) in [
            (
                "onnx.proto",
                &proto,
                format!("Run `cargo xtask build` (it installs onnx=={ONNX_VERSION}), or set KILN_ONNX_PROTO"),
            ),
            (
                "libonnxruntime",
                &runtime_library,
                format!(
                    "Run `cargo xtask build` (it installs onnxruntime=={ONNXRUNTIME_VERSION}), or set KILN_ONNXRUNTIME_LIB"
                ),
            ),
        ] {
            if !path.is_file() {
                return Err(BuildError::LibraryNotFound {
                    what,
                    path: path.parent().map(Path::to_path_buf).unwrap_or_default(),
                    missing: path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    fix,
                });
            }
        }
        Ok(Self {
            proto,
            runtime_library,
        })
    }
}

fn not_provisioned(at: &Path) -> BuildError {
    BuildError::LibraryNotFound {
        what: "the project virtualenv",
        path: at.to_path_buf(),
        missing: ".kiln/venv".into(),
        fix: "Run `cargo xtask build` once to provision it".into(),
    }
}
