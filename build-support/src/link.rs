//! What build scripts print so that binaries, tests and examples find the native
//! libraries at run time without `LD_LIBRARY_PATH`.
//!
//! This module runs inside build scripts, whose protocol with cargo is standard
//! output (`cargo:` lines), hence `println!` here rather than `log`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{BuildError, Result};
use crate::layout::Layout;
use crate::libtorch::Libtorch;
use crate::tensorflow::Tensorflow;

/// Which native libraries a crate's own binaries, tests and examples load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Native {
    /// libtorch (through `tch`).
    pub torch: bool,
    /// The TensorFlow C API (through `tensorflow`).
    pub tensorflow: bool,
}

/// The whole job of a Kiln build script: resolves the libraries in `native`, and
/// prints the rpath and `--no-as-needed` link arguments, plus metadata for dependent
/// crates (`cargo:libtorch_lib`, `cargo:tensorflow_lib`, read by them as
/// `DEP_<LINKS>_LIBTORCH_LIB` when the package declares `links`).
///
/// On failure it prints the reason as `cargo:warning=` lines (what was wrong and how
/// to fix it) and exits with status 1, instead of leaving a wall of linker errors.
///
/// ```no_run
/// // the body of a build.rs `main`:
/// kiln_build::build_script(kiln_build::Native { torch: true, tensorflow: false });
/// ```
pub fn build_script(native: Native) {
    if let Err(error) = emit_links(native) {
        for line in error.display_chain().to_string().lines() {
            println!("cargo:warning=kiln: {line}");
        }
        println!(
            "cargo:warning=kiln: in the Kiln workspace, `cargo xtask setup` provisions both libraries"
        );
        eprintln!("kiln-build: {}", error.display_chain());
        std::process::exit(1);
    }
}

fn emit_links(native: Native) -> Result<()> {
    if let Some(layout) = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .and_then(|dir| Layout::find_from(&dir))
    {
        // Tests run reference computations with the project's Python.
        println!(
            "cargo:rustc-env=KILN_VENV_PYTHON={}",
            layout.venv_python().display()
        );
    }
    if native.torch {
        let lib = torch_lib_dir()?;
        let libtorch = Libtorch::at(lib.parent().unwrap_or(&lib), "LIBTORCH")?;
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        println!(
            "cargo:rustc-env=KILN_LIBTORCH_CUDA={}",
            u8::from(libtorch.has_cuda())
        );
        if libtorch.has_cuda() {
            // The linker drops libtorch_cuda as unneeded (nothing references it
            // directly), and CUDA then silently reports unavailable at run time.
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
            // With Kiln's `cuda` feature a dependency links the CUDA runtime into
            // this package's binaries, whose rpath must then find it.
            if let Some(dir) = crate::ops::cuda::runtime_dir(&lib) {
                println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
            }
        }
        println!("cargo:libtorch_lib={}", lib.display());
    }
    if native.tensorflow {
        let lib = tensorflow_lib_dir()?;
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        println!("cargo:tensorflow_lib={}", lib.display());
    }
    Ok(())
}

fn var(name: &str) -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn canonical(path: &Path) -> Result<PathBuf> {
    fs::canonicalize(path).map_err(|e| BuildError::io("resolving", path, e))
}

/// The real (symlink-free) libtorch `lib/` directory: `$ORIGIN` in libtorch's own
/// rpath must resolve inside the wheel to find the CUDA runtime wheels beside it.
pub(crate) fn torch_lib_dir() -> Result<PathBuf> {
    let from_deps = [
        "DEP_KILN_LIBTORCH_LIB",
        "DEP_KILN_TORCH_LIBTORCH_LIB",
        "DEP_TCH_LIBTORCH_LIB",
    ]
    .into_iter()
    .find_map(var);
    let lib = match from_deps {
        Some(lib) => lib,
        None => var("LIBTORCH").map(|dir| dir.join("lib")).ok_or_else(|| {
            BuildError::LibraryNotFound {
                what: "libtorch",
                path: PathBuf::from("$LIBTORCH"),
                missing: "the LIBTORCH variable".into(),
                fix: "set LIBTORCH to a libtorch 2.11.0 directory".into(),
            }
        })?,
    };
    canonical(&lib)
}

/// The real directory of the TensorFlow C API library.
pub(crate) fn tensorflow_lib_dir() -> Result<PathBuf> {
    if let Some(dir) = ["DEP_KILN_TENSORFLOW_LIB", "DEP_KILN_TF_TENSORFLOW_LIB"]
        .into_iter()
        .find_map(var)
    {
        return canonical(&dir);
    }
    if let Some(dir) = var("LIBTENSORFLOW") {
        return Ok(Tensorflow::at(&dir, "LIBTENSORFLOW")?.runtime_dir());
    }
    let search = var("PKG_CONFIG_PATH").unwrap_or_default();
    for dir in env::split_paths(&search) {
        let pc = dir.join("tensorflow.pc");
        println!("cargo:rerun-if-changed={}", pc.display());
        if let Ok(text) = fs::read_to_string(&pc) {
            if let Some(lib) = pc_libdir(&text) {
                let real = canonical(&lib.join("libtensorflow.so"))?;
                return Ok(real.parent().map(Path::to_path_buf).unwrap_or(real));
            }
        }
    }
    Err(BuildError::LibraryNotFound {
        what: "TensorFlow C API",
        path: search,
        missing: "tensorflow.pc".into(),
        fix: "set LIBTENSORFLOW to a TensorFlow 2.21.0 C API directory".into(),
    })
}

/// `libdir` of a pkg-config file, with `${prefix}` expanded.
fn pc_libdir(text: &str) -> Option<PathBuf> {
    let value = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .map(str::trim)
    };
    let prefix = value("prefix").unwrap_or("");
    value("libdir").map(|l| PathBuf::from(l.replace("${prefix}", prefix)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pc_libdir_expands_prefix() {
        let pc = "prefix=/a/b\nlibdir=${prefix}/lib\nName: tensorflow\n";
        assert_eq!(pc_libdir(pc), Some(PathBuf::from("/a/b/lib")));
        assert_eq!(pc_libdir("Name: x\n"), None);
    }
}
