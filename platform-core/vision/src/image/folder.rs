//! torchvision's `ImageFolder`: one subfolder per class, or a list of files.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use crate::image::decode::{decode_image, ColorMode};
use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use kiln_data::Dataset;
use kiln_data::PrefetchLoader;

/// The extensions torchvision's `ImageFolder` accepts (`IMG_EXTENSIONS`),
/// compared case-insensitively with the end of the path. Every one decodes
/// (see [`decode_image`](crate::decode_image)).
pub const IMG_EXTENSIONS: [&str; 9] = [
    ".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
];

/// What to do with a sample that cannot be read or decoded (`"fail"`,
/// `"skip"` in a config).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// The batch fails with an error naming the file (the default).
    #[default]
    Fail,
    /// The sample is left out of its batch, with a warning naming the file,
    /// and counted ([`PrefetchLoader::skipped_samples`]). A dataset cannot
    /// leave a sample out by itself: this takes effect through a loader with
    /// [`PrefetchLoader::skip_failed_samples`], which the datasets'
    /// `loader` methods set from it.
    Skip,
}

/// Images in class folders, as torchvision's
/// `torchvision.datasets.ImageFolder(root)`: samples are `(image, label)`,
/// the image a u8 `[C, H, W]` tensor ([`ColorMode::Rgb`] by default, what
/// torchvision's default loader gives) and the label an i64 scalar.
///
/// * Classes are the names of `root`'s subdirectories, sorted; a class's
///   index is its position.
/// * Samples are the files under each class folder (recursively, following
///   symbolic links) whose names end with one of [`IMG_EXTENSIONS`], class
///   by class, directories in sorted path order and files sorted by name
///   within each: torchvision's `make_dataset` order. (A directory reached
///   twice through symbolic links is listed once, where `os.walk` would
///   repeat it, or loop forever on a cycle.)
/// * Only the paths are held: [`get`](Dataset::get) reads and decodes the
///   file in the calling thread, so with a [`PrefetchLoader`] the worker
///   threads decode, and memory holds no more images than the queue.
///
/// ```no_run
/// use kiln_data::DataLoader;
/// use kiln_vision::{ImageFolder, OnError};
///
/// let folder = ImageFolder::new("data/train")?.on_error(OnError::Skip);
/// println!("{} images of {} classes", folder.samples().len(), folder.classes().len());
/// let loader = folder.loader(32)?.shuffle(0).num_workers(4);
/// # let _ = loader;
/// # Ok::<(), kiln_core::Error>(())
/// ```
///
/// A batch of images of different sizes does not stack: wrap the folder in
/// a [`TransformedDataset`](kiln_data::TransformedDataset) that resizes or crops.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    class_to_idx: BTreeMap<String, i64>,
    samples: Vec<(PathBuf, i64)>,
    color_mode: ColorMode,
    on_error: OnError,
}

impl ImageFolder {
    /// The images under `root`, one subfolder per class.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] if `root` cannot be listed, [`Error::Data`] naming
    /// `root` if it has no class folder or naming the classes without a
    /// valid file (torchvision's `FileNotFoundError`s).
    pub fn new(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        let mut classes = Vec::new();
        for entry in fs::read_dir(&root).map_err(|e| Error::io(&root, e))? {
            let entry = entry.map_err(|e| Error::io(&root, e))?;
            // `is_dir` through `metadata` follows symbolic links, as Python's
            // `DirEntry.is_dir()` does.
            if entry.path().is_dir() {
                classes.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(Error::data(
                &root,
                None,
                "couldn't find any class folder (ImageFolder expects one subdirectory per class)",
            ));
        }
        let class_to_idx: BTreeMap<String, i64> = classes
            .iter()
            .enumerate()
            .map(|(i, c)| (c.clone(), i as i64))
            .collect();
        let mut samples = Vec::new();
        let mut empty = Vec::new();
        for (index, class) in classes.iter().enumerate() {
            let before = samples.len();
            for dir in walk_sorted(&root, &root.join(class))? {
                let mut files: Vec<String> = match fs::read_dir(&dir) {
                    Ok(entries) => entries
                        .filter_map(|e| e.ok())
                        .filter(|e| !e.path().is_dir())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect(),
                    Err(e) => {
                        log::warn!("ImageFolder: cannot list {}: {e}", dir.display());
                        continue;
                    }
                };
                files.sort();
                for file in files {
                    let path = dir.join(&file);
                    if has_image_extension(&path) {
                        // A named pipe or a device under an image's name would
                        // block or read forever when its turn came mid-epoch.
                        kiln_core::fs::check_regular_file(&path)?;
                        samples.push((path, index as i64));
                    }
                }
            }
            if samples.len() == before {
                empty.push(class.as_str());
            }
        }
        if !empty.is_empty() {
            return Err(Error::data(
                &root,
                None,
                format!(
                    "found no valid file for the classes {}. Supported extensions are: {}",
                    empty.join(", "),
                    IMG_EXTENSIONS.join(", ")
                ),
            ));
        }
        log::debug!(
            "ImageFolder {}: {} images in {} classes",
            root.display(),
            samples.len(),
            classes.len()
        );
        Ok(ImageFolder {
            root,
            classes,
            class_to_idx,
            samples,
            color_mode: ColorMode::Rgb,
            on_error: OnError::Fail,
        })
    }

    /// The images a list file names: CSV lines `path,label` (an optional
    /// header line `path,label`; the label is the text after the last comma,
    /// fields may be double-quoted) or a JSON array
    /// `[{"path": ..., "label": ...}]`, told apart by the `.json` extension.
    /// Relative paths are relative to the list's directory.
    ///
    /// Labels are all integers (non-negative; [`classes`](ImageFolder::classes)
    /// are then the distinct labels as text) or all class names (classes
    /// sorted by name and numbered in that order, as [`new`](ImageFolder::new)
    /// does). The files are not opened until read.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] if the list cannot be read, [`Error::Data`] naming it and
    /// the line (or entry) that is malformed, or if it lists no image.
    pub fn from_list(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = kiln_core::fs::read_regular_to_string(path)?;
        let is_json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let entries = if is_json {
            parse_json_list(&text, path)?
        } else {
            parse_csv_list(&text, path)?
        };
        if entries.is_empty() {
            return Err(Error::data(path, None, "the list names no image"));
        }
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let numeric = entries.iter().all(|(_, l, _)| l.parse::<i64>().is_ok());
        let mut class_to_idx = BTreeMap::new();
        let classes: Vec<String>;
        if numeric {
            let mut labels = BTreeSet::new();
            for (_, label, line) in &entries {
                let value: i64 = label.parse().unwrap_or(-1);
                if value < 0 {
                    return Err(Error::data(
                        path,
                        None,
                        format!("{line}: label {label} is negative; labels are class indices"),
                    ));
                }
                labels.insert(value);
            }
            classes = labels.iter().map(i64::to_string).collect();
            for &l in &labels {
                class_to_idx.insert(l.to_string(), l);
            }
        } else {
            let names: BTreeSet<&str> = entries.iter().map(|(_, l, _)| l.as_str()).collect();
            classes = names.iter().map(|s| s.to_string()).collect();
            for (i, c) in classes.iter().enumerate() {
                class_to_idx.insert(c.clone(), i as i64);
            }
        }
        let samples = entries
            .into_iter()
            .map(|(p, label, _)| {
                let p = PathBuf::from(p);
                let p = if p.is_absolute() { p } else { base.join(p) };
                (p, class_to_idx.get(&label).copied().unwrap_or_default())
            })
            .collect();
        Ok(ImageFolder {
            root: base,
            classes,
            class_to_idx,
            samples,
            color_mode: ColorMode::Rgb,
            on_error: OnError::Fail,
        })
    }

    /// Decodes into `mode`'s channels (default [`ColorMode::Rgb`]).
    pub fn color_mode(mut self, mode: ColorMode) -> Self {
        self.color_mode = mode;
        self
    }

    /// Whether a sample that fails to read or decode fails its batch
    /// ([`OnError::Fail`], the default) or is skipped by the
    /// [`loader`](ImageFolder::loader).
    pub fn on_error(mut self, on_error: OnError) -> Self {
        self.on_error = on_error;
        self
    }

    /// The error policy set with [`on_error`](ImageFolder::on_error).
    pub fn error_policy(&self) -> OnError {
        self.on_error
    }

    /// The folder (or the list's directory).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Class names, in label order.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Each class name's label.
    pub fn class_to_idx(&self) -> &BTreeMap<String, i64> {
        &self.class_to_idx
    }

    /// Every sample's file and label, in index order.
    pub fn samples(&self) -> &[(PathBuf, i64)] {
        &self.samples
    }

    /// A [`PrefetchLoader`] over this folder with batches of `batch_size`,
    /// skipping failed samples when [`on_error`](ImageFolder::on_error) is
    /// [`OnError::Skip`].
    pub fn loader(self, batch_size: usize) -> Result<PrefetchLoader<ImageFolder>> {
        let skip = self.on_error == OnError::Skip;
        Ok(PrefetchLoader::new(self, batch_size)?.skip_failed_samples(skip))
    }
}

impl Dataset for ImageFolder {
    type Item = (HostTensor, HostTensor);

    fn len(&self) -> usize {
        self.samples.len()
    }

    /// Reads and decodes image `index`; errors name the file.
    fn get(&self, index: usize) -> Result<Self::Item> {
        let Some((path, label)) = self.samples.get(index) else {
            return Err(Error::invalid_argument(
                "index",
                format!(
                    "index {index} is out of range for an ImageFolder of {} images",
                    self.samples.len()
                ),
            ));
        };
        let bytes = kiln_core::fs::read_regular_file(path)?;
        let image = decode_image(&bytes, self.color_mode, path)?;
        Ok((image, HostTensor::scalar(*label)))
    }
}

/// `dir` (a class folder of `root`) and every directory below it (following
/// symbolic links, each real directory once), sorted by path as Python sorts
/// `os.walk`'s tuples.
///
/// A link there that leads back into `root` outside `dir` (to the root, to
/// another class, or above them) is [`Error::Data`]: torchvision would list
/// the other classes' images again, labelled as this class. A link elsewhere
/// (images kept on another disk) is followed.
fn walk_sorted(root: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let real_root = fs::canonicalize(root).map_err(|e| Error::io(root, e))?;
    let real_class = fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        // A link cycle would make os.walk loop forever; visit each real directory once.
        if let Ok(real) = fs::canonicalize(&d) {
            let elsewhere_in_root = !real.starts_with(&real_class)
                && (real.starts_with(&real_root) || real_root.starts_with(&real));
            if elsewhere_in_root {
                return Err(Error::data(
                    &d,
                    None,
                    format!(
                        "leads (through a symbolic link) to {}, which is not inside its class \
                         folder {} but holds or contains the images of {}: they would be listed \
                         again under this class; remove the link",
                        real.display(),
                        dir.display(),
                        root.display()
                    ),
                ));
            }
            if !seen.insert(real) {
                continue;
            }
        }
        if let Ok(entries) = fs::read_dir(&d) {
            for e in entries.filter_map(|e| e.ok()) {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                }
            }
        }
        out.push(d);
    }
    // Python compares the path strings by code point, as Rust's `str` order does.
    out.sort_by(|a, b| a.to_string_lossy().cmp(&b.to_string_lossy()));
    Ok(out)
}

/// torchvision's `has_file_allowed_extension`: the lower-cased path ends with one of them.
fn has_image_extension(path: &Path) -> bool {
    let lower = path.to_string_lossy().to_lowercase();
    IMG_EXTENSIONS.iter().any(|ext| lower.ends_with(ext))
}

/// `(path, label, "line N")` of a CSV list.
fn parse_csv_list(text: &str, list: &Path) -> Result<Vec<(String, String, String)>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Some((p, label)) = line.rsplit_once(',') else {
            return Err(Error::data(
                list,
                None,
                format!("line {}: expected `path,label`, got {line:?}", i + 1),
            ));
        };
        let (p, label) = (unquote(p.trim()), unquote(label.trim()));
        if out.is_empty() && p.eq_ignore_ascii_case("path") && label.eq_ignore_ascii_case("label") {
            continue;
        }
        if p.is_empty() || label.is_empty() {
            return Err(Error::data(
                list,
                None,
                format!("line {}: empty path or label in {line:?}", i + 1),
            ));
        }
        out.push((p, label, format!("line {}", i + 1)));
    }
    Ok(out)
}

/// A CSV field without its surrounding double quotes (`""` inside is one quote).
fn unquote(field: &str) -> String {
    match field.strip_prefix('"').and_then(|f| f.strip_suffix('"')) {
        Some(inner) => inner.replace("\"\"", "\""),
        None => field.to_string(),
    }
}

/// `(path, label, "entry N")` of a JSON list.
fn parse_json_list(text: &str, list: &Path) -> Result<Vec<(String, String, String)>> {
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| Error::data_caused_by(list, None, "not valid JSON", e))?;
    let Some(items) = value.as_array() else {
        return Err(Error::data(
            list,
            None,
            "expected a JSON array of {\"path\": ..., \"label\": ...} objects",
        ));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let p = item.get("path").and_then(|p| p.as_str());
        let label = match item.get("label") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Number(n)) if n.is_i64() => Some(n.to_string()),
            _ => None,
        };
        let (Some(p), Some(label)) = (p, label) else {
            return Err(Error::data(
                list,
                None,
                format!(
                    "entry {i}: expected {{\"path\": string, \"label\": integer or string}}, got {item}"
                ),
            ));
        };
        out.push((p.to_string(), label, format!("entry {i}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_are_matched_case_insensitively_on_the_path_end() {
        assert!(has_image_extension(Path::new("a/B.JPG")));
        assert!(has_image_extension(Path::new("a/b.tiff")));
        assert!(!has_image_extension(Path::new("a/b.jpg.txt")));
        assert!(!has_image_extension(Path::new("a/jpg")));
    }

    #[test]
    fn csv_lists_take_an_optional_header_and_quotes() -> Result<()> {
        let list = Path::new("list.csv");
        let rows = parse_csv_list("path,label\n\"a,b.png\",cat\n\nc.jpg, 2\n", list)?;
        let got: Vec<(&str, &str)> = rows
            .iter()
            .map(|(p, l, _)| (p.as_str(), l.as_str()))
            .collect();
        assert_eq!(got, [("a,b.png", "cat"), ("c.jpg", "2")]);
        let err = parse_csv_list("a.png\n", list).expect_err("no label");
        assert!(err.to_string().contains("line 1"), "{err}");
        Ok(())
    }

    #[test]
    fn json_lists_need_path_and_label() -> Result<()> {
        let list = Path::new("list.json");
        let rows = parse_json_list(r#"[{"path": "a.png", "label": 3}]"#, list)?;
        assert_eq!((rows[0].0.as_str(), rows[0].1.as_str()), ("a.png", "3"));
        let err = parse_json_list(r#"[{"path": "a.png"}]"#, list).expect_err("no label");
        assert!(err.to_string().contains("entry 0"), "{err}");
        Ok(())
    }
}
