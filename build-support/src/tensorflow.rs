//! Finding the TensorFlow C API and presenting it to the `tensorflow` crate via pkg-config.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{BuildError, Result};
use crate::layout::Layout;
use crate::versions::TENSORFLOW_VERSION;

const WHY: &str = "the version Kiln's TensorFlow backend is built and tested with";

/// The TensorFlow C API: the library that exports `TF_*`, its framework library and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensorflow {
    /// The library exporting the C API (`libtensorflow_cc.so.2` in a wheel,
    /// `lib/libtensorflow.so.2` in a C API archive).
    pub c_api: PathBuf,
    /// `libtensorflow_framework.so.2`.
    pub framework: PathBuf,
    /// The header root (holds `tensorflow/c/c_api.h`).
    pub include: PathBuf,
    /// The version found.
    pub version: String,
}

impl Tensorflow {
    /// Checks that `dir` holds TensorFlow [`TENSORFLOW_VERSION`], either as a wheel's
    /// `tensorflow/` directory or as a C API archive (`lib/`, `include/`).
    pub fn at(dir: &Path, source: &str) -> Result<Self> {
        let fix = format!(
            "{source} must point at the tensorflow/ directory of a tensorflow-cpu=={TENSORFLOW_VERSION} \
             wheel or at an extracted libtensorflow {TENSORFLOW_VERSION} C API archive"
        );
        let (c_api, framework, version) = if dir.join("libtensorflow_cc.so.2").exists() {
            let version = dir.parent().and_then(wheel_version);
            (
                dir.join("libtensorflow_cc.so.2"),
                dir.join("libtensorflow_framework.so.2"),
                version,
            )
        } else if dir.join("lib/libtensorflow.so.2").exists() {
            let version = archive_version(&dir.join("lib"));
            (
                dir.join("lib/libtensorflow.so.2"),
                dir.join("lib/libtensorflow_framework.so.2"),
                version,
            )
        } else {
            return Err(BuildError::LibraryNotFound {
                what: "TensorFlow C API",
                path: dir.to_path_buf(),
                missing: "libtensorflow_cc.so.2 or lib/libtensorflow.so.2".into(),
                fix,
            });
        };
        if !framework.exists() {
            return Err(BuildError::LibraryNotFound {
                what: "TensorFlow framework library",
                path: dir.to_path_buf(),
                missing: "libtensorflow_framework.so.2".into(),
                fix,
            });
        }
        let include = dir.join("include");
        let version = version.ok_or_else(|| BuildError::LibraryNotFound {
            what: "TensorFlow version",
            path: dir.to_path_buf(),
            missing:
                "a tensorflow*.dist-info directory beside it or a lib/libtensorflow.so.X.Y.Z file"
                    .into(),
            fix: fix.clone(),
        })?;
        if version != TENSORFLOW_VERSION {
            return Err(BuildError::WrongVersion {
                library: "TensorFlow",
                path: dir.to_path_buf(),
                found: version,
                expected: TENSORFLOW_VERSION,
                why: WHY,
                fix: format!(
                    "Point {source} at TensorFlow {TENSORFLOW_VERSION} (pip install \
                     tensorflow-cpu=={TENSORFLOW_VERSION}), or unset it to let Kiln provision one"
                ),
            });
        }
        Ok(Self {
            c_api,
            framework,
            include,
            version,
        })
    }

    /// Writes `.kiln/tensorflow/{lib,include}` links and `.kiln/pkgconfig/tensorflow.pc`,
    /// which the `tensorflow` crate's build script finds through pkg-config instead of
    /// downloading a prebuilt library.
    pub fn write_pkg_config(&self, layout: &Layout) -> Result<PathBuf> {
        let prefix = layout.tensorflow();
        let lib = prefix.join("lib");
        fs::create_dir_all(&lib).map_err(|e| BuildError::io("creating", &lib, e))?;
        replace_symlink(&self.c_api, &lib.join("libtensorflow.so"))?;
        replace_symlink(&self.framework, &lib.join("libtensorflow_framework.so"))?;
        replace_symlink(&self.include, &prefix.join("include"))?;

        let pc_dir = layout.pkgconfig();
        fs::create_dir_all(&pc_dir).map_err(|e| BuildError::io("creating", &pc_dir, e))?;
        let pc = pc_dir.join("tensorflow.pc");
        let text = format!(
            "# Written by kiln-build; points at {c_api}\n\
             prefix={prefix}\n\
             libdir=${{prefix}}/lib\n\
             includedir=${{prefix}}/include\n\
             \n\
             Name: tensorflow\n\
             Description: TensorFlow C API\n\
             Version: {version}\n\
             Libs: -L${{libdir}} -ltensorflow -ltensorflow_framework\n\
             Cflags: -I${{includedir}}\n",
            c_api = self.c_api.display(),
            prefix = prefix.display(),
            version = self.version,
        );
        write_atomic(&pc, text.as_bytes())?;
        Ok(pc)
    }

    /// The directory to put on the runtime search path (where the real library lives).
    pub fn runtime_dir(&self) -> PathBuf {
        let real = fs::canonicalize(&self.c_api).unwrap_or_else(|_| self.c_api.clone());
        real.parent().map(Path::to_path_buf).unwrap_or(real)
    }
}

/// `tensorflow_cpu-2.21.0.dist-info` (or `tensorflow-...`) beside the package.
fn wheel_version(site_packages: &Path) -> Option<String> {
    fs::read_dir(site_packages)
        .ok()?
        .flatten()
        .find_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let rest = name
                .strip_prefix("tensorflow_cpu-")
                .or_else(|| name.strip_prefix("tensorflow-"))?;
            rest.strip_suffix(".dist-info").map(str::to_owned)
        })
}

/// `libtensorflow.so.2.21.0` in a C API archive's `lib/`.
fn archive_version(lib: &Path) -> Option<String> {
    fs::read_dir(lib).ok()?.flatten().find_map(|entry| {
        let name = entry.file_name().into_string().ok()?;
        let v = name.strip_prefix("libtensorflow.so.")?;
        (v.matches('.').count() == 2).then(|| v.to_owned())
    })
}

/// Points `link` at `target`, replacing whatever was there, atomically.
pub(crate) fn replace_symlink(target: &Path, link: &Path) -> Result<()> {
    let tmp = link.with_extension("kiln-tmp");
    let _ = fs::remove_file(&tmp); // a leftover from an interrupted run, if any
    std::os::unix::fs::symlink(target, &tmp).map_err(|e| BuildError::io("linking", &tmp, e))?;
    fs::rename(&tmp, link).map_err(|e| BuildError::io("renaming", link, e))
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("kiln-tmp");
    fs::write(&tmp, bytes).map_err(|e| BuildError::io("writing", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| BuildError::io("renaming", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_wheel(name: &str, dist_info: &str) -> PathBuf {
        let site = std::env::temp_dir().join(format!("kiln-tf-{name}-{}", std::process::id()));
        let tf = site.join("tensorflow");
        fs::create_dir_all(tf.join("include")).unwrap();
        fs::create_dir_all(site.join(dist_info)).unwrap();
        fs::write(tf.join("libtensorflow_cc.so.2"), "").unwrap();
        fs::write(tf.join("libtensorflow_framework.so.2"), "").unwrap();
        site
    }

    #[test]
    fn wheel_layout_is_found_and_pc_written() {
        let site = fake_wheel("ok", "tensorflow_cpu-2.21.0.dist-info");
        let tf = Tensorflow::at(&site.join("tensorflow"), "LIBTENSORFLOW").unwrap();
        assert_eq!(tf.version, "2.21.0");
        let layout = Layout::new(site.join(".kiln"));
        let pc = tf.write_pkg_config(&layout).unwrap();
        let text = fs::read_to_string(pc).unwrap();
        assert!(text.contains("Libs: -L${libdir} -ltensorflow -ltensorflow_framework"));
        let link = fs::read_link(layout.tensorflow().join("lib/libtensorflow.so")).unwrap();
        assert_eq!(link, tf.c_api);
        fs::remove_dir_all(site).unwrap();
    }

    #[test]
    fn wrong_wheel_version_is_named() {
        let site = fake_wheel("old", "tensorflow-2.15.1.dist-info");
        let err = Tensorflow::at(&site.join("tensorflow"), "LIBTENSORFLOW")
            .unwrap_err()
            .to_string();
        assert!(err.contains("2.15.1") && err.contains("2.21.0"), "{err}");
        fs::remove_dir_all(site).unwrap();
    }

    #[test]
    fn archive_layout_reads_version_from_soname() {
        let dir = std::env::temp_dir().join(format!("kiln-tf-archive-{}", std::process::id()));
        fs::create_dir_all(dir.join("lib")).unwrap();
        for f in [
            "libtensorflow.so.2",
            "libtensorflow.so.2.21.0",
            "libtensorflow_framework.so.2",
        ] {
            fs::write(dir.join("lib").join(f), "").unwrap();
        }
        let tf = Tensorflow::at(&dir, "LIBTENSORFLOW").unwrap();
        assert_eq!(tf.version, "2.21.0");
        fs::remove_dir_all(dir).unwrap();
    }
}
