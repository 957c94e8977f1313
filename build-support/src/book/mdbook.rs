//! Building the guide: mdBook installed once into the shared cache, then
//! `mdbook build` of `docs/` and the link check of [`check_links`].

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::{check_links, BookError, BuiltBook};

/// The mdBook release `cargo xtask book` installs (from crates.io, with its
/// `search` feature, the guide's search box, and without `serve` and `watch`,
/// which building the HTML does not need).
pub const MDBOOK_VERSION: &str = "0.5.4";

/// What [`build`] did.
#[derive(Debug, Clone)]
pub struct BookReport {
    /// The mdBook binary used.
    pub mdbook: PathBuf,
    /// How long installing it took, when this run installed it.
    pub installed_in: Option<Duration>,
    /// How long `mdbook build` took.
    pub built_in: Duration,
    /// Where the HTML is (`target/book`).
    pub html: PathBuf,
    /// How many markdown files the link check read.
    pub files_checked: usize,
}

/// mdBook, installed from crates.io (with `cargo install --locked`,
/// [`MDBOOK_VERSION`], the `search` feature only) unless a binary of that version
/// is there already: into `mdbook-<version>-search` of the cache every Kiln checkout of
/// this user shares (where the virtualenv is, [`shared_cache_dir`]), so a second
/// clone or a CI run in a fresh clone reuses it, else into the workspace's
/// `.kiln/tools`. Returns the binary and, when it had to install it, how long
/// that took.
///
/// [`shared_cache_dir`]: crate::shared_cache_dir
pub fn ensure_mdbook(workspace: &Path) -> Result<(PathBuf, Option<Duration>), BookError> {
    let root = crate::shared_cache_dir()
        // `-search`: an earlier Kiln installed this version without search here.
        .map(|cache| cache.join(format!("mdbook-{MDBOOK_VERSION}-search")))
        .unwrap_or_else(|| workspace.join(".kiln").join("tools"));
    let binary = root.join("bin").join("mdbook");
    let wanted = format!("mdbook v{MDBOOK_VERSION}");
    let installed = Command::new(&binary)
        .arg("--version")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .is_some_and(|out| String::from_utf8_lossy(&out.stdout).trim() == wanted);
    if installed {
        return Ok((binary, None));
    }
    log::info!(
        "installing mdBook {MDBOOK_VERSION} into {} (once; a few minutes)",
        root.display()
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let start = Instant::now();
    let status = Command::new(&cargo)
        .args([
            "install",
            "mdbook",
            "--locked",
            "--no-default-features",
            "--features",
            "search",
            // Whatever is in `root` is not the wanted version (checked above).
            "--force",
            "--version",
        ])
        .arg(MDBOOK_VERSION)
        .arg("--root")
        .arg(&root)
        .status()
        .map_err(|error| BookError::Command {
            what: "cargo install mdbook".into(),
            detail: error.to_string(),
        })?;
    if !status.success() {
        return Err(BookError::Command {
            what: format!("cargo install mdbook --version {MDBOOK_VERSION}"),
            detail: format!("{status}; it needs crates.io to be reachable the first time"),
        });
    }
    Ok((binary, Some(start.elapsed())))
}

/// `cargo xtask book`: mdBook ([`ensure_mdbook`]) builds `<workspace>/docs` into
/// `<workspace>/target/book`, then every link of the book's pages and of
/// `README.md` is checked ([`check_links`]). Broken links are an error listing
/// each as `file:line: target: reason`.
pub fn build(workspace: &Path) -> Result<BookReport, BookError> {
    let (mdbook, installed_in) = ensure_mdbook(workspace)?;
    let docs = workspace.join("docs");
    let html = workspace.join("target").join("book");
    let start = Instant::now();
    let status = Command::new(&mdbook)
        .arg("build")
        .arg(&docs)
        .arg("--dest-dir")
        .arg(&html)
        .status()
        .map_err(|error| BookError::Command {
            what: format!("{} build", mdbook.display()),
            detail: error.to_string(),
        })?;
    if !status.success() {
        return Err(BookError::Command {
            what: format!("mdbook build {}", docs.display()),
            detail: status.to_string(),
        });
    }
    let built_in = start.elapsed();
    if !has_search_index(&html)? {
        return Err(BookError::Command {
            what: format!("mdbook build {}", docs.display()),
            detail: format!(
                "{} wrote no search index (searchindex*.js) into {}: it was built without \
                 mdBook's `search` feature; delete it and `cargo xtask book` installs one with it",
                mdbook.display(),
                html.display()
            ),
        });
    }
    let src = docs.join("src");
    let mut files = vec![workspace.join("README.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(&src)
        .map_err(|source| BookError::Read {
            path: src.clone(),
            source,
        })?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    files.extend(pages);
    let book = BuiltBook {
        src,
        html: html.clone(),
    };
    let mut broken = check_links(&files, Some(&book))?;
    // Paths relative to the workspace, as a user reads them.
    let prefix = format!("{}/", workspace.display());
    for link in &mut broken {
        if let Ok(relative) = link.file.strip_prefix(workspace) {
            link.file = relative.to_path_buf();
        }
        link.reason = link.reason.replace(&prefix, "");
    }
    if !broken.is_empty() {
        return Err(BookError::BrokenLinks(broken));
    }
    Ok(BookReport {
        mdbook,
        installed_in,
        built_in,
        html,
        files_checked: files.len(),
    })
}

/// Whether the built HTML in `html` has mdBook's search index.
fn has_search_index(html: &Path) -> Result<bool, BookError> {
    let entries = std::fs::read_dir(html).map_err(|source| BookError::Read {
        path: html.to_path_buf(),
        source,
    })?;
    Ok(entries.filter_map(|entry| entry.ok()).any(|entry| {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        name.starts_with("searchindex") && name.ends_with(".js")
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_search_index_is_found_by_its_name() {
        let dir =
            std::env::temp_dir().join(format!("kiln-book-search-index-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("index.html"), "<html></html>").unwrap();
        assert!(!has_search_index(&dir).unwrap());
        std::fs::write(dir.join("searchindex-fcb0470c.js"), "window.search = {};").unwrap();
        assert!(has_search_index(&dir).unwrap());
        assert!(matches!(
            has_search_index(&dir.join("missing")),
            Err(BookError::Read { .. })
        ));
    }
}
