//! Building custom ops: C++ (and CUDA) sources compiled with `cc` against
//! libtorch, bridged to Rust with `cxx`, and linked a second time as a shared
//! library that Python loads with `torch.ops.load_library`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cxx::configure_cxx;
use crate::error::{BuildError, Result};
use crate::link::torch_lib_dir;

pub(crate) mod cuda;

/// What both kinds of op build compile: a name, the cxx bridge and its C++ side,
/// the op sources and extra include directories.
#[derive(Debug, Clone)]
struct Sources {
    name: String,
    bridges: Vec<PathBuf>,
    bridge_sources: Vec<PathBuf>,
    op_sources: Vec<PathBuf>,
    includes: Vec<PathBuf>,
}

impl Sources {
    fn new(name: impl Into<String>) -> Self {
        Sources {
            name: name.into(),
            bridges: Vec::new(),
            bridge_sources: Vec::new(),
            op_sources: Vec::new(),
            includes: Vec::new(),
        }
    }

    /// The build of the static archive: the cxx bridges' when there are any.
    fn archive_build(&self) -> cc::Build {
        if self.bridges.is_empty() {
            cc::Build::new()
        } else {
            cxx_build::bridges(&self.bridges)
        }
    }

    /// Reruns the build script when a source changes.
    fn watch(&self) {
        for path in self
            .op_sources
            .iter()
            .chain(&self.bridge_sources)
            .chain(&self.bridges)
        {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

/// The builder methods both op builds share (they fill `self.sources`).
macro_rules! source_setters {
    ($op_source_doc:literal) => {
        /// A Rust file holding a `#[cxx::bridge]` module (call once per file).
        pub fn bridge(mut self, path: impl AsRef<Path>) -> Self {
            self.sources.bridges.push(path.as_ref().to_path_buf());
            self
        }

        /// A C++ file of the bridge (functions the Rust side calls).
        pub fn bridge_source(mut self, path: impl AsRef<Path>) -> Self {
            self.sources
                .bridge_sources
                .push(path.as_ref().to_path_buf());
            self
        }

        #[doc = $op_source_doc]
        pub fn op_source(mut self, path: impl AsRef<Path>) -> Self {
            self.sources.op_sources.push(path.as_ref().to_path_buf());
            self
        }

        /// An extra include directory.
        pub fn include(mut self, dir: impl AsRef<Path>) -> Self {
            self.sources.includes.push(dir.as_ref().to_path_buf());
            self
        }
    };
}

/// A crate's custom ops, for its build script.
///
/// - **op sources** hold the kernels and their `TORCH_LIBRARY` registration; they
///   must not call into Rust, because they are also linked into the shared library.
/// - **bridge sources** hold the C++ side of the `#[cxx::bridge]` module.
///
/// Both are compiled with C++17, libtorch's ABI flag and include paths, into one
/// static archive linked whole (so the static registrations are never dropped).
///
/// - **CUDA sources** ([`cuda_source`](Self::cuda_source)) are built only when the
///   crate's `cuda` feature is on (`CARGO_FEATURE_CUDA`): `.cu` files with nvcc,
///   other files (host wrappers using libtorch's CUDA API) with the C++ compiler and
///   the CUDA headers. Their objects join both the archive and the shared library,
///   which then also link `torch_cuda`, `c10_cuda` and the CUDA runtime.
///
/// ```no_run
/// // in build.rs of a crate with its own op (see examples/custom-op)
/// let ops = kiln_build::TorchOps::new("my_ops")
///     .bridge("src/ffi.rs")
///     .bridge_source("cpp/bridge.cc")
///     .op_source("cpp/my_op.cc")
///     .compile()
///     .unwrap_or_else(|e| panic!("{}", e.display_chain()));
/// if let Some(library) = &ops.shared_library {
///     println!("cargo:rustc-env=MY_OPS_LIBRARY={}", library.display());
/// }
/// ```
#[derive(Debug, Clone)]
pub struct TorchOps {
    sources: Sources,
    cuda_sources: Vec<PathBuf>,
}

/// What [`TorchOps::compile`] produced.
#[derive(Debug, Clone)]
pub struct OpsArtifacts {
    /// `lib<name>.so` in `OUT_DIR`: the op sources linked against libtorch, for
    /// `torch.ops.load_library` in Python; `None` without op or CUDA sources
    /// (a bridge to libtorch's C++ API only).
    pub shared_library: Option<PathBuf>,
    /// libtorch's `lib/` directory the ops were built against.
    pub libtorch_lib: PathBuf,
}

impl TorchOps {
    /// Ops named `name` (the archive is `lib<name>.a`, the shared library `lib<name>.so`).
    pub fn new(name: impl Into<String>) -> Self {
        TorchOps {
            sources: Sources::new(name),
            cuda_sources: Vec::new(),
        }
    }

    source_setters!("A C++ file with kernels and registrations (no Rust dependency).");

    /// A CUDA source with kernels or their registration (no Rust dependency),
    /// compiled only when the crate's `cuda` feature is on: a `.cu` file with nvcc
    /// (`-std=c++17`, SASS for sm_80 and sm_90 plus sm_90 PTX, `-Xcompiler -fPIC`,
    /// libtorch's ABI flag), any other file with the C++ compiler and the CUDA
    /// headers. nvcc comes from `NVCC`, `CUDA_HOME`, or the `nvidia/cu13` wheels
    /// beside torch (the project virtualenv has them); no GPU is needed to build.
    pub fn cuda_source(mut self, path: impl AsRef<Path>) -> Self {
        self.cuda_sources.push(path.as_ref().to_path_buf());
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
            // Kiln's own headers for C++ that calls libtorch (`kiln/rethrowing.h`).
            Path::new(env!("CARGO_MANIFEST_DIR")).join("include"),
        ];
        let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());

        // The op objects, compiled once, go into both the archive and the .so.
        let mut ops = cc::Build::new();
        configure_cxx(&mut ops);
        ops.includes(&includes)
            .includes(&self.sources.includes)
            .files(one_translation_unit(
                &self.sources.op_sources,
                &out_dir,
                &format!("{}_ops", self.sources.name),
            )?)
            .flag_if_supported("-Wno-unused-parameter")
            .flag_if_supported("-Wno-missing-field-initializers");
        let mut objects = ops.compile_intermediates();
        let cuda = if cuda::feature_enabled() && !self.cuda_sources.is_empty() {
            let mut dirs = includes.to_vec();
            dirs.extend(self.sources.includes.iter().cloned());
            // NCCL's header (for libtorch's ProcessGroupNCCL.hpp) from the
            // `nvidia-nccl-cu13` wheel beside torch's; libtorch_cuda links NCCL itself.
            if let Some(nccl) = root
                .canonicalize()
                .ok()
                .and_then(|torch| torch.parent().map(|site| site.join("nvidia/nccl/include")))
                .filter(|dir| dir.join("nccl.h").is_file())
            {
                dirs.push(nccl);
            }
            cuda::compile(&self.cuda_sources, &dirs, &lib, &ops)?
        } else {
            cuda::CudaObjects::default()
        };
        objects.extend(cuda.objects.iter().cloned());

        let mut archive = self.sources.archive_build();
        configure_cxx(&mut archive);
        archive
            .includes(&includes)
            .includes(&self.sources.includes)
            .files(one_translation_unit(
                &self.sources.bridge_sources,
                &out_dir,
                &format!("{}_bridges", self.sources.name),
            )?)
            .objects(&objects)
            .link_lib_modifier("+whole-archive")
            .flag_if_supported("-Wno-unused-parameter")
            .compile(&self.sources.name);
        cuda.emit_rust_links();

        self.sources.watch();
        if objects.is_empty() {
            // A bridge only (no kernels, nothing for Python to load).
            return Ok(OpsArtifacts {
                shared_library: None,
                libtorch_lib: lib,
            });
        }
        let shared_library = out_dir.join(format!("lib{}.so", self.sources.name));
        let compiler = ops.get_compiler();
        let mut link = Command::new(compiler.path());
        link.arg("-shared")
            .arg("-o")
            .arg(&shared_library)
            .args(&objects)
            .arg(format!("-L{}", lib.display()))
            .arg(format!("-Wl,-rpath,{}", lib.display()))
            .args(["-ltorch", "-ltorch_cpu", "-lc10"])
            .args(&cuda.shared_link_args);
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
        Ok(OpsArtifacts {
            shared_library: Some(shared_library),
            libtorch_lib: lib,
        })
    }
}

/// The C++ files of `sources` as one translation unit (a "unity build"): a
/// file `OUT_DIR/<name>.cc` that includes each of them, when there are two or
/// more. Kiln's bridges each include a large part of libtorch's headers
/// (autograd, TorchScript, the profiler), whose parsing is most of their
/// compile time: parsed once, the release build of kiln-torch's bridges takes
/// a fraction of the time. The sources must then not define the same static
/// names; a compiler error names the source file and line as usual.
fn one_translation_unit(sources: &[PathBuf], out_dir: &Path, name: &str) -> Result<Vec<PathBuf>> {
    if sources.len() < 2 {
        return Ok(sources.to_vec());
    }
    let mut text =
        String::from("// Generated by kiln-build: one translation unit of these sources.\n");
    for source in sources {
        let path = source
            .canonicalize()
            .map_err(|e| BuildError::io("reading", source, e))?;
        text.push_str(&format!("#include \"{}\"\n", path.display()));
    }
    let unity = out_dir.join(format!("{name}.cc"));
    std::fs::write(&unity, &text).map_err(|e| BuildError::io("writing", &unity, e))?;
    Ok(vec![unity])
}

/// A crate's TensorFlow ops, for its build script: C++ sources that register ops
/// and kernels through TensorFlow's C API (`tensorflow/c/ops.h`, `c/kernels.h`) and
/// gradients through its C++ gradient registry
/// (`tensorflow/cc/framework/grad_op_registry.h`), plus an optional cxx bridge.
///
/// Everything is compiled with the flags `tf.sysconfig.get_compile_flags()` gives for
/// the pinned wheel (C++17, `_GLIBCXX_USE_CXX11_ABI=1`, `EIGEN_MAX_ALIGN_BYTES=64`,
/// the wheel's `tensorflow/include` as a system include directory, so its headers'
/// warnings stay quiet) into one static archive linked whole (so static
/// registrations are kept; see [`link_whole`](Self::link_whole)), and linked against `libtensorflow_cc.so.2` (the C API
/// and the gradient registry) and `libtensorflow_framework.so.2` (the op and kernel
/// registries), with an rpath to their directory.
///
/// The TensorFlow directory is found as Kiln's other build scripts find it
/// (`DEP_KILN_TF_TENSORFLOW_LIB` from a dependency on kiln-tf, `LIBTENSORFLOW`, or
/// `tensorflow.pc`). It must be a wheel's `tensorflow/` directory: the C API archive
/// ships neither the C++ headers nor the gradient registry.
///
/// Kiln's own headers (`build-support/include`) are on the include path: a
/// gradient adds its node and registers through `kiln/tf_gradient.h`, which
/// kiln-fused-ops and kiln-tf-op share.
///
/// ```no_run
/// // in build.rs of a crate with TensorFlow ops (its dependency on kiln-tf supplies the library)
/// kiln_build::TfOps::new("my_tf_ops")
///     .bridge("src/tf.rs")
///     .op_source("src/tf_ops.cc")
///     .compile()
///     .unwrap_or_else(|e| panic!("{}", e.display_chain()));
/// ```
#[derive(Debug, Clone)]
pub struct TfOps {
    sources: Sources,
    link_whole: bool,
}

/// What [`TfOps::compile`] built against.
#[derive(Debug, Clone)]
pub struct TfOpsArtifacts {
    /// The directory holding `libtensorflow_framework.so.2` (and the C API library).
    pub tensorflow_lib: PathBuf,
    /// The header root the sources were compiled against (holds `tensorflow/c/c_api.h`).
    pub tensorflow_include: PathBuf,
}

/// The header that only a wheel's include tree has and the gradients need.
const TF_CC_HEADER: &str = "tensorflow/cc/framework/grad_op_registry.h";

impl TfOps {
    /// Ops named `name` (the archive is `lib<name>.a`).
    pub fn new(name: impl Into<String>) -> Self {
        TfOps {
            sources: Sources::new(name),
            link_whole: true,
        }
    }

    /// Whether the archive is linked whole (the default), so static registrations
    /// are kept in every binary that links the crate. With `false` it is an ordinary
    /// archive compiled with hidden visibility: a binary keeps only what it reaches,
    /// so registration must be reached from Rust (a function the crate's users
    /// call, no static initialiser), and a binary that never reaches the ops (Kiln's
    /// `kiln` CLI) does not load TensorFlow for them.
    pub fn link_whole(mut self, whole: bool) -> Self {
        self.link_whole = whole;
        self
    }

    source_setters!("A C++ file with op definitions, kernels, gradients and their registration.");

    /// Compiles everything and emits cargo's link directives.
    pub fn compile(self) -> Result<TfOpsArtifacts> {
        let lib = crate::link::tensorflow_lib_dir()?;
        let include = [lib.join("include"), lib.join("../include")]
            .into_iter()
            .find(|dir| dir.join(TF_CC_HEADER).exists())
            .ok_or_else(|| BuildError::LibraryNotFound {
                what: "TensorFlow C++ headers",
                path: lib.clone(),
                missing: format!("include/{TF_CC_HEADER}"),
                fix: "build against the tensorflow/ directory of the tensorflow-cpu wheel \
                      (LIBTENSORFLOW=<site-packages>/tensorflow, or let `cargo xtask setup` \
                      provision it): the C API archive lacks the C++ headers and the \
                      gradient registry that TensorFlow ops with gradients need"
                    .into(),
            })?;
        let c_api = ["libtensorflow_cc.so.2", "libtensorflow.so.2"]
            .into_iter()
            .find(|name| lib.join(name).exists())
            .ok_or_else(|| BuildError::LibraryNotFound {
                what: "TensorFlow C API",
                path: lib.clone(),
                missing: "libtensorflow_cc.so.2".into(),
                fix: "point LIBTENSORFLOW at a tensorflow-cpu wheel's tensorflow/ directory".into(),
            })?;

        let mut build = self.sources.archive_build();
        configure_cxx(&mut build);
        if !self.link_whole {
            // An object a binary pulls in but never reaches must keep nothing alive:
            // TensorFlow's inline functions and vtables that it instantiates would
            // otherwise be exported (TensorFlow's libraries reference them), kept,
            // and make the binary load TensorFlow.
            build
                .flag("-fvisibility=hidden")
                .flag("-fvisibility-inlines-hidden");
        }
        build
            // -isystem: TensorFlow's, Eigen's, absl's and protobuf's headers are not ours to warn about.
            .flag("-isystem")
            .flag(include.display().to_string())
            .define("EIGEN_MAX_ALIGN_BYTES", "64")
            // Kiln's own headers for C++ that calls TensorFlow (`kiln/tf_gradient.h`).
            .include(Path::new(env!("CARGO_MANIFEST_DIR")).join("include"))
            .includes(&self.sources.includes)
            .files(&self.sources.op_sources)
            .files(&self.sources.bridge_sources)
            .link_lib_modifier(if self.link_whole {
                "+whole-archive"
            } else {
                "-whole-archive"
            })
            .flag_if_supported("-Wno-unused-parameter")
            .compile(&self.sources.name);

        // After the archive, so the linker sees its references first.
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=dylib:+verbatim={c_api}");
        println!("cargo:rustc-link-lib=dylib:+verbatim=libtensorflow_framework.so.2");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        self.sources.watch();
        println!(
            "cargo:rerun-if-changed={}",
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("include/kiln/tf_gradient.h")
                .display()
        );
        Ok(TfOpsArtifacts {
            tensorflow_lib: lib,
            tensorflow_include: include,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_become_one_translation_unit_including_each() {
        let dir = std::env::temp_dir().join(format!("kiln-unity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.cc"), dir.join("b.cc"));
        std::fs::write(&a, "int a() { return 1; }\n").unwrap();
        std::fs::write(&b, "int b() { return 2; }\n").unwrap();

        // One source stays as it is.
        let one = one_translation_unit(std::slice::from_ref(&a), &dir, "one").unwrap();
        assert_eq!(one, vec![a.clone()]);

        let unity = one_translation_unit(&[a.clone(), b.clone()], &dir, "both").unwrap();
        assert_eq!(unity, vec![dir.join("both.cc")]);
        let text = std::fs::read_to_string(&unity[0]).unwrap();
        let includes: Vec<&str> = text.lines().filter(|l| l.starts_with("#include")).collect();
        let quoted = |p: &Path| format!("#include \"{}\"", p.canonicalize().unwrap().display());
        assert_eq!(includes, vec![quoted(&a), quoted(&b)]);

        // A missing source is named.
        let err = one_translation_unit(&[a, dir.join("gone.cc")], &dir, "x").unwrap_err();
        assert!(err.to_string().contains("gone.cc"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
