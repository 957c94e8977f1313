//! Building custom ops: C++ (and CUDA) sources compiled with `cc` against
//! libtorch, bridged to Rust with `cxx`, and linked a second time as a shared
//! library that Python loads with `torch.ops.load_library`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cxx::configure_cxx;
use crate::error::{BuildError, Result};
use crate::link::torch_lib_dir;

/// A crate's custom ops, for its build script.
///
/// - **op sources** hold the kernels and their `TORCH_LIBRARY` registration; they
///   must not call into Rust, because they are also linked into the shared library.
/// - **bridge sources** hold the C++ side of the `#[cxx::bridge]` module.
///
/// Both are compiled with C++17, libtorch's ABI flag and include paths, into one
/// static archive linked whole (so the static registrations are never dropped).
///
/// ```no_run
/// // in build.rs of a crate with its own op (see examples/custom-op)
/// let ops = kiln_build::TorchOps::new("my_ops")
///     .bridge("src/ffi.rs")
///     .bridge_source("cpp/bridge.cc")
///     .op_source("cpp/my_op.cc")
///     .compile()
///     .unwrap_or_else(|e| panic!("{e}"));
/// println!("cargo:rustc-env=MY_OPS_LIBRARY={}", ops.shared_library.display());
/// ```
#[derive(Debug, Clone)]
pub struct TorchOps {
    name: String,
    bridge: Option<PathBuf>,
    bridge_sources: Vec<PathBuf>,
    op_sources: Vec<PathBuf>,
    includes: Vec<PathBuf>,
}

/// What [`TorchOps::compile`] produced.
#[derive(Debug, Clone)]
pub struct OpsArtifacts {
    /// `lib<name>.so` in `OUT_DIR`: the op sources linked against libtorch, for
    /// `torch.ops.load_library` in Python.
    pub shared_library: PathBuf,
    /// libtorch's `lib/` directory the ops were built against.
    pub libtorch_lib: PathBuf,
}

impl TorchOps {
    /// Ops named `name` (the archive is `lib<name>.a`, the shared library `lib<name>.so`).
    pub fn new(name: impl Into<String>) -> Self {
        TorchOps {
            name: name.into(),
            bridge: None,
            bridge_sources: Vec::new(),
            op_sources: Vec::new(),
            includes: Vec::new(),
        }
    }

    /// The Rust file holding the `#[cxx::bridge]` module.
    pub fn bridge(mut self, path: impl AsRef<Path>) -> Self {
        self.bridge = Some(path.as_ref().to_path_buf());
        self
    }

    /// A C++ file of the bridge (functions the Rust side calls).
    pub fn bridge_source(mut self, path: impl AsRef<Path>) -> Self {
        self.bridge_sources.push(path.as_ref().to_path_buf());
        self
    }

    /// A C++ file with kernels and registrations (no Rust dependency).
    pub fn op_source(mut self, path: impl AsRef<Path>) -> Self {
        self.op_sources.push(path.as_ref().to_path_buf());
        self
    }

    /// An extra include directory.
    pub fn include(mut self, dir: impl AsRef<Path>) -> Self {
        self.includes.push(dir.as_ref().to_path_buf());
        self
    }

    /// Compiles everything and emits cargo's link directives.
    pub fn compile(self) -> Result<OpsArtifacts> {
        let lib = torch_lib_dir()?;
        let root = lib
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| lib.clone());
        let includes = [
            root.join("include"),
            root.join("include/torch/csrc/api/include"),
        ];
        let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());

        // The op objects, compiled once, go into both the archive and the .so.
        let mut ops = cc::Build::new();
        configure_cxx(&mut ops);
        ops.includes(&includes)
            .includes(&self.includes)
            .files(&self.op_sources)
            .flag_if_supported("-Wno-unused-parameter")
            .flag_if_supported("-Wno-missing-field-initializers");
        let objects = ops.compile_intermediates();

        let mut archive = match &self.bridge {
            Some(bridge) => cxx_build::bridge(bridge),
            None => cc::Build::new(),
        };
        configure_cxx(&mut archive);
        archive
            .includes(&includes)
            .includes(&self.includes)
            .files(&self.bridge_sources)
            .objects(&objects)
            .link_lib_modifier("+whole-archive")
            .flag_if_supported("-Wno-unused-parameter")
            .compile(&self.name);

        let shared_library = out_dir.join(format!("lib{}.so", self.name));
        let compiler = ops.get_compiler();
        let mut link = Command::new(compiler.path());
        link.arg("-shared")
            .arg("-o")
            .arg(&shared_library)
            .args(&objects)
            .arg(format!("-L{}", lib.display()))
            .arg(format!("-Wl,-rpath,{}", lib.display()))
            .args(["-ltorch", "-ltorch_cpu", "-lc10"]);
        let output = link.output().map_err(|e| BuildError::Command {
            command: format!("{link:?}"),
            detail: e.to_string(),
        })?;
        if !output.status.success() {
            return Err(BuildError::Command {
                command: format!("{link:?}"),
                detail: String::from_utf8_lossy(&output.stderr).into_owned(),
            });
        }
        for path in self
            .op_sources
            .iter()
            .chain(&self.bridge_sources)
            .chain(self.bridge.iter())
        {
            println!("cargo:rerun-if-changed={}", path.display());
        }
        Ok(OpsArtifacts {
            shared_library,
            libtorch_lib: lib,
        })
    }
}
