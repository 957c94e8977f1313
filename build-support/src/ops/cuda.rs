//! The CUDA half of [`TorchOps`](super::TorchOps): finds nvcc, compiles `.cu`
//! files with it and CUDA-side C++ wrappers with the host compiler, and says what
//! the archive's users and the shared library must link (libtorch's CUDA
//! libraries and the CUDA runtime).
//!
//! nvcc compiles without a GPU, so the `cuda` feature builds on any machine that
//! has the toolkit; the project virtualenv carries one from PyPI
//! (`cuda-toolkit[nvcc,nvvm,crt,cccl]`, see
//! [`PYTHON_REQUIREMENTS`](crate::versions::PYTHON_REQUIREMENTS)).

use std::collections::BTreeSet;
use std::env;
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use crate::cxx::configure_cxx;
use crate::error::{BuildError, Result};
use crate::layout::Layout;
use crate::versions::CXX11_ABI;

/// The CUDA release torch's `+cu130` wheel was built with; another major
/// version of nvcc gets a warning (its headers and runtime do not match torch's).
const CUDA_MAJOR: &str = "13";

/// What the device code is built for: SASS for sm_80 (A100) and sm_90 (H100,
/// H200), and sm_90 PTX that newer GPUs JIT-compile at load time.
pub(crate) const GENCODE: &[&str] = &[
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
];

/// The command to install the toolkit, for error messages.
const INSTALL: &str = "pip install \"cuda-toolkit[nvcc,nvvm,crt,cccl]==13.0.2\"";

/// A CUDA toolkit: nvcc, its headers and the runtime library.
#[derive(Debug, Clone)]
struct Toolkit {
    nvcc: PathBuf,
    include: PathBuf,
    /// The directory holding the CUDA runtime library.
    lib: PathBuf,
    /// The runtime's file name (`libcudart.so`, or `libcudart.so.13` in the wheels,
    /// which ship no unversioned link).
    cudart: String,
}

/// The CUDA objects of a build and what linking them needs.
#[derive(Debug, Clone, Default)]
pub(crate) struct CudaObjects {
    /// Objects for both the archive and the shared library.
    pub(crate) objects: Vec<PathBuf>,
    /// Extra arguments for the shared library's link line (after the objects).
    pub(crate) shared_link_args: Vec<String>,
    /// `cargo:` link directives for the crate's Rust artefacts, printed after the
    /// archive so that the linker sees the archive's references first.
    rust_link_lines: Vec<String>,
}

impl CudaObjects {
    /// Prints the `cargo:` link directives (call after the archive is compiled).
    pub(crate) fn emit_rust_links(&self) {
        for line in &self.rust_link_lines {
            println!("{line}");
        }
    }
}

/// The directory of the CUDA runtime that the `cuda` feature links
/// (`libcudart.so.13`, from the toolkit [`compile`] uses), or `None` where no
/// toolkit is found. The crates that compile CUDA code link the runtime, and
/// every binary above them then needs it: a link argument of theirs reaches
/// only their own targets, so every build script puts this directory on its
/// binaries' rpath ([`build_script`](crate::build_script)).
pub(crate) fn runtime_dir(torch_lib: &Path) -> Option<PathBuf> {
    find_toolkit(torch_lib).ok().map(|toolkit| toolkit.lib)
}

/// Whether the crate being built has its `cuda` feature on.
pub(crate) fn feature_enabled() -> bool {
    env::var_os("CARGO_FEATURE_CUDA").is_some()
}

/// Compiles `sources` (`.cu` with nvcc, anything else with `host`'s compiler
/// plus the CUDA headers) against libtorch at `torch_lib` with `includes`.
pub(crate) fn compile(
    sources: &[PathBuf],
    includes: &[PathBuf],
    torch_lib: &Path,
    host: &cc::Build,
) -> Result<CudaObjects> {
    for name in ["NVCC", "CUDA_HOME", "CUDA_PATH"] {
        println!("cargo:rerun-if-env-changed={name}");
    }
    let toolkit = find_toolkit(torch_lib)?;
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default()).join("cuda");
    fs::create_dir_all(&out_dir).map_err(|e| BuildError::io("creating", &out_dir, e))?;

    let (cu, cc_sources): (Vec<&PathBuf>, Vec<&PathBuf>) = sources
        .iter()
        .partition(|p| p.extension().is_some_and(|e| e == "cu"));
    let mut objects = Vec::new();

    let host_compiler = host.get_compiler();
    for (index, source) in cu.iter().enumerate() {
        let stem = source
            .file_stem()
            .map_or_else(|| "kernels".into(), |s| s.to_string_lossy().into_owned());
        let object = out_dir.join(format!("{index}-{stem}.o"));
        let mut nvcc = Command::new(&toolkit.nvcc);
        nvcc.arg("-ccbin")
            .arg(host_compiler.path())
            .args(["-std=c++17", "-O3", "-Xcompiler", "-fPIC"])
            .arg(format!("-D_GLIBCXX_USE_CXX11_ABI={CXX11_ABI}"))
            .args(GENCODE)
            .args(includes.iter().map(|dir| format!("-I{}", dir.display())))
            .arg(format!("-I{}", toolkit.include.display()))
            .arg("-c")
            .arg(source)
            .arg("-o")
            .arg(&object);
        run(&mut nvcc)?;
        objects.push(object);
    }

    if !cc_sources.is_empty() {
        let mut wrappers = cc::Build::new();
        configure_cxx(&mut wrappers);
        wrappers
            .includes(includes)
            .include(&toolkit.include)
            .files(cc_sources)
            .flag_if_supported("-Wno-unused-parameter")
            .flag_if_supported("-Wno-missing-field-initializers")
            // c10/cuda/CUDAEvent.h aligns by hardware_destructive_interference_size.
            .flag_if_supported("-Wno-interference-size");
        objects.extend(wrappers.compile_intermediates());
    }

    for path in local_dependencies(sources) {
        println!("cargo:rerun-if-changed={}", path.display());
    }

    let cudart_link = if toolkit.cudart == "libcudart.so" {
        "-lcudart".to_owned()
    } else {
        format!("-l:{}", toolkit.cudart)
    };
    let shared_link_args = vec![
        format!("-L{}", torch_lib.display()),
        "-ltorch_cuda".into(),
        "-lc10_cuda".into(),
        format!("-L{}", toolkit.lib.display()),
        cudart_link,
        format!("-Wl,-rpath,{}", toolkit.lib.display()),
    ];
    let rust_link_lines = vec![
        format!("cargo:rustc-link-search=native={}", torch_lib.display()),
        "cargo:rustc-link-lib=dylib=torch_cuda".into(),
        "cargo:rustc-link-lib=dylib=c10_cuda".into(),
        format!("cargo:rustc-link-search=native={}", toolkit.lib.display()),
        format!("cargo:rustc-link-lib=dylib:+verbatim={}", toolkit.cudart),
        format!("cargo:rustc-link-arg=-Wl,-rpath,{}", toolkit.lib.display()),
    ];
    Ok(CudaObjects {
        objects,
        shared_link_args,
        rust_link_lines,
    })
}

/// How many times nvcc runs when it (or a compiler it starts) crashes: a crash
/// is a fault of the toolchain, not of the source, and has been seen to pass on a
/// second run (a `Segmentation fault` from nvcc on a CI machine whose previous
/// run of the same sources had built).
const NVCC_ATTEMPTS: usize = 3;

fn run(command: &mut Command) -> Result<()> {
    let mut attempt = 1;
    loop {
        let output = command.output().map_err(|e| BuildError::Command {
            command: format!("{command:?}"),
            detail: e.to_string(),
        })?;
        if output.status.success() {
            // cargo shows a build script's output only when it fails; warnings go
            // through cargo:warning, as cc does for the C++ compiler's.
            for line in String::from_utf8_lossy(&output.stderr).lines() {
                if !line.trim().is_empty() {
                    println!("cargo:warning=nvcc: {line}");
                }
            }
            return Ok(());
        }
        let detail = format!(
            "{}{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            status_note(&output.status)
        );
        if attempt < NVCC_ATTEMPTS && crashed(&output.status, &detail) {
            println!(
                "cargo:warning=nvcc crashed (attempt {attempt} of {NVCC_ATTEMPTS}), running it again: {}",
                detail.trim().replace('\n', " | ")
            );
            attempt += 1;
            continue;
        }
        return Err(BuildError::Command {
            command: format!("{command:?}"),
            detail,
        });
    }
}

/// Whether a failed compiler run was a crash (a signal, or a crash of a program
/// nvcc started, which nvcc reports in its output) rather than an error in the
/// source.
fn crashed(status: &std::process::ExitStatus, output: &str) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal().is_some()
        || [
            "Segmentation fault",
            "died due to signal",
            "internal compiler error",
            "Bus error",
        ]
        .iter()
        .any(|sign| output.contains(sign))
}

/// The exit status in words, where the output alone would not say it.
fn status_note(status: &std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (_, Some(signal)) => format!(" (killed by signal {signal})"),
        (Some(code), None) => format!(" (exit status {code})"),
        (None, None) => String::new(),
    }
}

/// nvcc from `NVCC`, else `CUDA_HOME` / `CUDA_PATH`, else the `nvidia/cu13` wheels
/// beside the linked torch, else those of the project virtualenv.
fn find_toolkit(torch_lib: &Path) -> Result<Toolkit> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(nvcc) = env::var_os("NVCC").filter(|v| !v.is_empty()) {
        let nvcc = PathBuf::from(nvcc);
        if !nvcc.is_file() {
            return Err(not_found(&nvcc, "NVCC names no file"));
        }
        candidates.push(nvcc);
    }
    for name in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(name).filter(|v| !v.is_empty()) {
            candidates.push(PathBuf::from(home).join("bin/nvcc"));
        }
    }
    // torch_lib is <site-packages>/torch/lib in a wheel.
    if let Some(site) = torch_lib.parent().and_then(Path::parent) {
        candidates.push(site.join("nvidia/cu13/bin/nvcc"));
    }
    if let Some(layout) = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .and_then(|dir| Layout::find_from(&dir))
    {
        candidates.extend(venv_site_packages(&layout).map(|s| s.join("nvidia/cu13/bin/nvcc")));
    }
    let Some(nvcc) = candidates.iter().find(|p| p.is_file()) else {
        let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
        return Err(not_found(
            Path::new("nvcc"),
            &format!("looked at: {}", looked.join(", ")),
        ));
    };
    check_version(nvcc);
    let root = nvcc
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| not_found(nvcc, "nvcc is not in a toolkit's bin/ directory"))?;
    let include = root.join("include");
    if !include.join("cuda_runtime_api.h").is_file() {
        return Err(BuildError::LibraryNotFound {
            what: "CUDA headers",
            path: include,
            missing: "cuda_runtime_api.h".into(),
            fix: format!("install the CUDA toolkit beside nvcc ({INSTALL})"),
        });
    }
    for lib in [root.join("lib64"), root.join("lib")] {
        if let Some(cudart) = cudart_in(&lib) {
            return Ok(Toolkit {
                nvcc: nvcc.clone(),
                include,
                lib,
                cudart,
            });
        }
    }
    Err(BuildError::LibraryNotFound {
        what: "CUDA runtime",
        path: root.join("lib"),
        missing: "libcudart.so".into(),
        fix: format!("install the CUDA runtime beside nvcc ({INSTALL})"),
    })
}

fn not_found(path: &Path, detail: &str) -> BuildError {
    BuildError::LibraryNotFound {
        what: "nvcc (the CUDA compiler the `cuda` feature needs)",
        path: path.to_path_buf(),
        missing: format!("an nvcc executable ({detail})"),
        fix: format!(
            "In the Kiln workspace `cargo xtask setup` installs it into .kiln/venv; elsewhere \
             `{INSTALL}` into torch's environment, or set NVCC to an nvcc {CUDA_MAJOR}.x binary or \
             CUDA_HOME to a CUDA {CUDA_MAJOR}.x toolkit. Or build without the `cuda` feature"
        ),
    }
}

/// `lib/python3.*/site-packages` of the project virtualenv.
fn venv_site_packages(layout: &Layout) -> Option<PathBuf> {
    let lib = layout.venv().join("lib");
    let mut found: Vec<PathBuf> = fs::read_dir(&lib)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("site-packages")))
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    found.pop()
}

/// The CUDA runtime's file name in `dir`: `libcudart.so`, else the shortest
/// `libcudart.so.N` (the soname, not a full `.so.N.M.P`).
fn cudart_in(dir: &Path) -> Option<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n == "libcudart.so" || n.starts_with("libcudart.so."))
        .collect();
    names.sort_by_key(|n| (n.len(), n.clone()));
    names.into_iter().next()
}

/// Warns when nvcc is not CUDA 13 (it still compiles, but against other headers
/// than the runtime torch loads).
fn check_version(nvcc: &Path) {
    let Ok(output) = Command::new(nvcc).arg("--version").output() else {
        return; // a broken nvcc fails the compile below with its own message
    };
    let text = String::from_utf8_lossy(&output.stdout);
    let Some(release) = text
        .split("release ")
        .nth(1)
        .and_then(|r| r.split(',').next())
    else {
        return;
    };
    if release.split('.').next() != Some(CUDA_MAJOR) {
        println!(
            "cargo:warning=kiln-build: {} is CUDA {release}, but torch's wheel is built with \
             CUDA {CUDA_MAJOR}.0; use nvcc {CUDA_MAJOR}.x ({INSTALL})",
            nvcc.display()
        );
    }
}

/// The sources and every file they include with `#include "..."` that exists
/// relative to the including file (the crate's own headers), transitively, so
/// that editing a header rebuilds.
fn local_dependencies(sources: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut seen = BTreeSet::new();
    let mut todo: Vec<PathBuf> = sources.to_vec();
    while let Some(file) = todo.pop() {
        if !seen.insert(file.clone()) {
            continue;
        }
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        let dir = file.parent().unwrap_or(Path::new("")).to_path_buf();
        for line in text.lines() {
            let Some(rest) = line.trim_start().strip_prefix("#include") else {
                continue;
            };
            let Some(name) = rest
                .trim()
                .strip_prefix('"')
                .and_then(|r| r.split('"').next())
            else {
                continue;
            };
            let path = normalize(&dir.join(name));
            if path.is_file() {
                todo.push(path);
            }
        }
    }
    seen
}

/// `a/b/../c` as `a/c`, without touching the file system (for readable paths).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir
                if matches!(out.components().next_back(), Some(Component::Normal(_))) =>
            {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shell command that appends a line to `count` each run, then does `then`.
    fn counted(count: &Path, then: &str) -> Command {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("echo run >> '{}'; {then}", count.display()));
        command
    }

    fn runs(count: &Path) -> usize {
        fs::read_to_string(count).map_or(0, |s| s.lines().count())
    }

    #[test]
    fn a_crashing_compiler_runs_again_and_an_error_in_the_source_does_not() {
        let dir = env::temp_dir().join(format!("kiln-nvcc-retry-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();

        // Crashes (killed by SIGSEGV) on the first run, builds on the second.
        let count = dir.join("crash-once");
        let script = format!(
            "if [ $(wc -l < '{}') -lt 2 ]; then kill -SEGV $$; fi",
            count.display()
        );
        run(&mut counted(&count, &script)).unwrap();
        assert_eq!(runs(&count), 2);

        // A child's crash that nvcc reports in its output, every time: three runs.
        let count = dir.join("crash-always");
        let err = run(&mut counted(
            &count,
            "echo 'Segmentation fault' >&2; exit 139",
        ))
        .unwrap_err()
        .to_string();
        assert_eq!(runs(&count), NVCC_ATTEMPTS);
        assert!(
            err.contains("Segmentation fault") && err.contains("exit status 139"),
            "{err}"
        );

        // An error in the source: one run, and its message.
        let count = dir.join("error");
        let err = run(&mut counted(
            &count,
            "echo 'k.cu(3): error: identifier x is undefined' >&2; exit 1",
        ))
        .unwrap_err()
        .to_string();
        assert_eq!(runs(&count), 1);
        assert!(
            err.contains("identifier x is undefined") && err.contains("exit status 1"),
            "{err}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cudart_prefers_the_unversioned_name_then_the_soname() {
        let dir = env::temp_dir().join(format!("kiln-cudart-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("libcudart.so.13.0.96"), "").unwrap();
        fs::write(dir.join("libcudart.so.13"), "").unwrap();
        fs::write(dir.join("libcudart_static.a"), "").unwrap();
        assert_eq!(cudart_in(&dir).as_deref(), Some("libcudart.so.13"));
        fs::write(dir.join("libcudart.so"), "").unwrap();
        assert_eq!(cudart_in(&dir).as_deref(), Some("libcudart.so"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn local_includes_are_followed_transitively() {
        let dir = env::temp_dir().join(format!("kiln-deps-{}", std::process::id()));
        fs::create_dir_all(dir.join("src/cuda")).unwrap();
        fs::create_dir_all(dir.join("include")).unwrap();
        fs::write(
            dir.join("src/cuda/k.cu"),
            "#include <cuda.h>\n#include \"launch.h\"\n  #include \"../../include/checks.h\"\n",
        )
        .unwrap();
        fs::write(dir.join("src/cuda/launch.h"), "#include \"missing.h\"\n").unwrap();
        fs::write(dir.join("include/checks.h"), "").unwrap();
        let deps = local_dependencies(&[dir.join("src/cuda/k.cu")]);
        let names: Vec<String> = deps
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 3, "{deps:?}");
        for name in ["k.cu", "launch.h", "checks.h"] {
            assert!(names.iter().any(|n| n == name), "{name} in {deps:?}");
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
