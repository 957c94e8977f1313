//! bindgen for the provisioned wheels' C headers (feature `bindgen`).
//!
//! Kiln generates its bindings to libtorch's stable C ABI and TensorFlow's C
//! kernel API at build time from the headers of the wheels it links, so they
//! always match the library. libclang comes from the `libclang` wheel in the
//! same virtualenv (tensorflow-cpu depends on it), loaded at run time by
//! bindgen's `runtime` feature; clang's builtin headers (`stddef.h`), which that
//! wheel lacks, come from the C compiler.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{BuildError, Result};
use crate::layout::Layout;
use crate::provision::existing_venv;

/// The directory holding `libclang.so`: `LIBCLANG_PATH` when set, else the
/// project virtualenv's `clang/native` (the libclang wheel).
pub fn libclang_dir(layout: &Layout) -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("LIBCLANG_PATH").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let venv = existing_venv(layout).ok_or_else(|| BuildError::LibraryNotFound {
        what: "libclang (for bindgen)",
        path: layout.venv(),
        missing: "a provisioned virtualenv".to_owned(),
        fix: "run `cargo xtask setup`, or set LIBCLANG_PATH to a directory holding libclang.so"
            .to_owned(),
    })?;
    let dir = venv.site_packages.join("clang").join("native");
    if dir.join("libclang.so").is_file() {
        Ok(dir)
    } else {
        Err(BuildError::LibraryNotFound {
            what: "libclang (for bindgen)",
            path: dir,
            missing: "libclang.so".to_owned(),
            fix: "the libclang wheel (a dependency of tensorflow-cpu) is missing from the \
                  virtualenv: run `cargo xtask setup` again, or set LIBCLANG_PATH"
                .to_owned(),
        })
    }
}

/// The C compiler's own header directory (`stddef.h`, `stdint.h` builtins).
fn compiler_include_dir() -> Result<PathBuf> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let out = Command::new(&cc)
        .arg("-print-file-name=include")
        .output()
        .map_err(|e| BuildError::io("running", Path::new(&cc), e))?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if dir.join("stddef.h").is_file() {
        Ok(dir)
    } else {
        Err(BuildError::LibraryNotFound {
            what: "the C compiler's builtin headers (for bindgen)",
            path: dir,
            missing: "stddef.h".to_owned(),
            fix: "install gcc (Debian: `apt-get install gcc`) or point CC at a C compiler"
                .to_owned(),
        })
    }
}

/// A `bindgen::Builder` ready for the wheels' headers: libclang found (see
/// [`libclang_dir`]), the compiler's builtin headers and `include_dirs` on the
/// include path, C++17 when `cplusplus` (libtorch's shim headers are C++), and
/// no layout tests. Allow-list what you use on the result.
///
/// ```no_run
/// // in a build script, with kiln-build's `bindgen` feature:
/// let layout = kiln_build::Layout::find_from(std::path::Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
/// let bindings = kiln_build::bindgen_builder(&layout, &["/path/to/include".into()], false)?
///     .header_contents("wrapper.h", "#include <tensorflow/c/kernels.h>\n")
///     .allowlist_function("TF_NewKernelBuilder")
///     .generate();
/// # Ok::<(), kiln_build::BuildError>(())
/// ```
pub fn bindgen_builder(
    layout: &Layout,
    include_dirs: &[PathBuf],
    cplusplus: bool,
) -> Result<bindgen::Builder> {
    let libclang = libclang_dir(layout)?;
    println!("cargo:rerun-if-env-changed=LIBCLANG_PATH");
    // bindgen's `runtime` feature reads LIBCLANG_PATH when it first loads
    // libclang; a build script is one thread here.
    std::env::set_var("LIBCLANG_PATH", &libclang);
    let mut args = Vec::new();
    if cplusplus {
        args.extend(["-x".to_owned(), "c++".to_owned(), "-std=c++17".to_owned()]);
    }
    args.push(format!("-isystem{}", compiler_include_dir()?.display()));
    args.extend(include_dirs.iter().map(|d| format!("-I{}", d.display())));
    Ok(bindgen::Builder::default()
        .clang_args(args)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new())))
}
