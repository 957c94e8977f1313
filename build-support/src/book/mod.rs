//! The guide (`docs/`, an mdBook): building it with a project-local mdBook, and
//! checking that every relative link and image of the guide and the README
//! resolves (`cargo xtask book`).
//!
//! The link check reads markdown, not HTML: a link `[text](path#anchor)` must name
//! a file that exists (relative to the page), and its anchor a heading of that
//! page. Anchors of book pages are checked against the `id="..."` attributes of the
//! built HTML, the ground truth of what a browser can jump to; anchors of other
//! markdown files (the README, as GitHub renders it) against the headings' slugs,
//! computed with the rule both GitHub and mdBook use ([`slug`]), which the check
//! itself verifies against the built HTML on every book page. External links
//! (`https:`, `mailto:`, ...) are not fetched.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Component, Path, PathBuf};

mod mdbook;

pub use mdbook::{build, ensure_mdbook, BookReport, MDBOOK_VERSION};

/// What can go wrong while building or checking the guide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BookError {
    /// A file or directory could not be read; the I/O error is the source.
    #[error("cannot read {path}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A program could not be started or failed.
    #[error("{what} failed: {detail}")]
    Command {
        /// What was run.
        what: String,
        /// Why it failed (its exit status, or the error starting it).
        detail: String,
    },
    /// Links that do not resolve.
    #[error("{} broken link(s) in the guide or the README:\n{}", .0.len(), list(.0))]
    BrokenLinks(Vec<BrokenLink>),
}

impl BookError {
    /// This error with all its causes, `context: cause`: the message to show a
    /// user (`cannot read docs/src/guide.md: No such file or directory (os error 2)`).
    pub fn display_chain(&self) -> crate::ErrorChain<'_> {
        crate::ErrorChain::new(self)
    }
}

fn list(links: &[BrokenLink]) -> String {
    links
        .iter()
        .map(|link| format!("  {link}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// One link that does not resolve: where it is and what it points to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokenLink {
    /// The markdown file holding the link.
    pub file: PathBuf,
    /// Its line, from 1.
    pub line: usize,
    /// The link's target as written.
    pub target: String,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for BrokenLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {}: {}",
            self.file.display(),
            self.line,
            self.target,
            self.reason
        )
    }
}

/// A built mdBook: its markdown sources and the HTML mdBook wrote from them.
#[derive(Debug, Clone)]
pub struct BuiltBook {
    /// The book's `src` directory (`docs/src`).
    pub src: PathBuf,
    /// The directory mdBook wrote the HTML into (`target/book`).
    pub html: PathBuf,
}

/// The anchor a heading gets on GitHub and in mdBook: its text lower-cased,
/// whitespace to `-`, everything but letters, digits, `-` and `_` dropped
/// (`Training: the \`kiln\` CLI` is `training-the-kiln-cli`). Markdown links in
/// the heading count by their text.
pub fn slug(heading: &str) -> String {
    let text = link_texts(heading);
    let mut slug = String::with_capacity(text.len());
    for c in text.trim().chars() {
        if c.is_alphanumeric() || c == '-' || c == '_' {
            slug.extend(c.to_lowercase());
        } else if c.is_whitespace() {
            slug.push('-');
        }
    }
    slug
}

/// `heading` with each `[text](target)` replaced by `text`.
fn link_texts(heading: &str) -> String {
    let mut out = String::with_capacity(heading.len());
    let mut rest = heading;
    while let Some(open) = rest.find("](") {
        match rest[open + 2..].find(')') {
            Some(close) => {
                out.push_str(&rest[..open]);
                rest = &rest[open + 2 + close + 1..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out
}

/// The anchors of a markdown page's headings (ATX headings, `# ...` to
/// `###### ...`, outside code blocks), in order, a repeated one suffixed `-1`,
/// `-2`, ... as GitHub and mdBook do.
pub fn heading_anchors(markdown: &str) -> Vec<String> {
    headings(markdown).into_iter().map(|(_, a)| a).collect()
}

/// [`heading_anchors`] with each heading's line.
fn headings(markdown: &str) -> Vec<(usize, String)> {
    let mut anchors = Vec::new();
    let mut seen = BTreeSet::new();
    for (number, line) in prose_lines(markdown) {
        let trimmed = line.trim_start();
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || line.len() - trimmed.len() > 3 {
            continue;
        }
        let text = &trimmed[hashes..];
        if !(text.is_empty() || text.starts_with(' ') || text.starts_with('\t')) {
            continue;
        }
        let base = slug(text.trim().trim_end_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while !seen.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        anchors.push((number, anchor));
    }
    anchors
}

/// Every `id="..."` attribute of an HTML page.
pub fn html_ids(html: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut rest = html;
    while let Some(at) = rest.find("id=\"") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + 4..];
        // `id=` as an attribute of its own, not the end of `data-id=` or `grid=`.
        if before.is_some_and(|c| !c.is_whitespace()) {
            continue;
        }
        if let Some(end) = rest.find('"') {
            ids.insert(rest[..end].to_owned());
            rest = &rest[end + 1..];
        }
    }
    ids
}

/// The lines of `markdown` that are prose (numbered from 1): fenced code blocks
/// (```` ``` ```` or `~~~`, at any indentation) and HTML comments are left out.
fn prose_lines(markdown: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    let mut in_comment = false;
    for (index, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some((c, len)) = fence {
            let run = trimmed.chars().take_while(|&x| x == c).count();
            if run >= len && trimmed[run..].trim().is_empty() {
                fence = None;
            }
            continue;
        }
        if in_comment {
            in_comment = !line.contains("-->");
            continue;
        }
        let first = trimmed.chars().next();
        if let Some(c @ ('`' | '~')) = first {
            let run = trimmed.chars().take_while(|&x| x == c).count();
            if run >= 3 {
                fence = Some((c, run));
                continue;
            }
        }
        if trimmed.starts_with("<!--") {
            in_comment = !line.contains("-->");
            continue;
        }
        out.push((index + 1, line));
    }
    out
}

/// `line` with its inline code spans blanked out (so a `` `[a](b)` `` is no link).
fn without_code_spans(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|&&c| c == '`').count();
        // The closing run: the next run of exactly as many backticks.
        let mut j = i + run;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let other = chars[j..].iter().take_while(|&&c| c == '`').count();
                if other == run {
                    close = Some(j);
                    break;
                }
                j += other;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                out.extend(std::iter::repeat_n(' ', j + run - i));
                i = j + run;
            }
            None => {
                out.extend(&chars[i..i + run]);
                i += run;
            }
        }
    }
    out
}

/// The targets of a markdown page's links and images, with their line:
/// inline links `[text](target "title")` and `![alt](target)`, reference
/// definitions `[label]: target`, and raw HTML `href="..."` / `src="..."`; not
/// inside code blocks, code spans or HTML comments.
pub fn markdown_links(markdown: &str) -> Vec<(usize, String)> {
    let mut links = Vec::new();
    for (number, line) in prose_lines(markdown) {
        let line = without_code_spans(line);
        // Reference definitions: `[label]: target`.
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') && !trimmed.starts_with("[^") {
            if let Some(end) = trimmed.find("]:") {
                if let Some(target) = trimmed[end + 2..].split_whitespace().next() {
                    links.push((number, unwrap_angle(target).to_owned()));
                }
                continue;
            }
        }
        let mut rest = line.as_str();
        while let Some(open) = rest.find("](") {
            let after = &rest[open + 2..];
            // The target runs to the `)` that balances the `(`.
            let mut depth = 0usize;
            let mut end = None;
            for (k, c) in after.char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' if depth == 0 => {
                        end = Some(k);
                        break;
                    }
                    ')' => depth -= 1,
                    _ => {}
                }
            }
            let Some(end) = end else { break };
            let inner = after[..end].trim();
            let target = if inner.starts_with('<') {
                inner.find('>').map_or(inner, |k| &inner[1..k])
            } else {
                inner.split_whitespace().next().unwrap_or("")
            };
            links.push((number, target.to_owned()));
            rest = &after[end + 1..];
        }
        for attribute in ["href=\"", "src=\""] {
            let mut rest = line.as_str();
            while let Some(at) = rest.find(attribute) {
                rest = &rest[at + attribute.len()..];
                if let Some(end) = rest.find('"') {
                    links.push((number, rest[..end].to_owned()));
                    rest = &rest[end + 1..];
                }
            }
        }
    }
    links
}

fn unwrap_angle(target: &str) -> &str {
    target
        .strip_prefix('<')
        .and_then(|t| t.strip_suffix('>'))
        .unwrap_or(target)
}

/// Whether a link leaves the repository: a URL scheme (`https:`, `mailto:`) or a
/// protocol-relative `//host`.
fn is_external(target: &str) -> bool {
    if target.starts_with("//") {
        return true;
    }
    match target.find(':') {
        Some(colon) => {
            let scheme = &target[..colon];
            !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
                && !target[..colon].contains('/')
        }
        None => false,
    }
}

/// `%20` and the like decoded; anything malformed is kept as written.
fn percent_decode(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(byte) = u8::from_str_radix(hex, 16) {
                out.push(byte);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap_or_else(|_| path.to_owned())
}

/// `path` with `.` and `..` resolved lexically (no file system access).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    out.push("..");
                }
            }
            other => out.push(other),
        }
    }
    out
}

/// Checks every relative link and image of the markdown `files`: the target must
/// exist, and its `#anchor` must be a heading of the target page. With `book`,
/// pages under `book.src` are checked against the HTML mdBook built (their
/// anchors against its `id` attributes; a link from a book page must stay inside
/// `book.src`, which is all mdBook copies), and each page's heading slugs as
/// [`slug`] computes them must be ids of its HTML page, so that the slugs used for
/// the other files are the real ones. Returns every broken link, in file order.
pub fn check_links(
    files: &[PathBuf],
    book: Option<&BuiltBook>,
) -> Result<Vec<BrokenLink>, BookError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|source| BookError::Read {
            path: path.to_owned(),
            source,
        })
    };
    let book_src = book.map(|b| normalize(&absolute(&b.src)));
    // The page a markdown file becomes in the built book, if it is one.
    let html_page = |md: &Path| -> Option<PathBuf> {
        let (book, src) = (book?, book_src.as_ref()?);
        let rel = md.strip_prefix(src).ok()?;
        Some(book.html.join(rel).with_extension("html"))
    };
    let mut broken = Vec::new();
    for file in files {
        let file_abs = normalize(&absolute(file));
        let text = read(file)?;
        let in_book = html_page(&file_abs).is_some();
        if let Some(page) = html_page(&file_abs) {
            // The slug rule against mdBook's own ids (SUMMARY.md is no page).
            if file_abs.file_name().is_some_and(|n| n != "SUMMARY.md") && page.is_file() {
                let ids = html_ids(&read(&page)?);
                for (line, anchor) in headings(&text) {
                    if !ids.contains(&anchor) {
                        broken.push(BrokenLink {
                            file: file.clone(),
                            line,
                            target: format!("#{anchor}"),
                            reason: format!(
                                "a heading's slug is not an id of {} (the slug rule and mdBook disagree)",
                                page.display()
                            ),
                        });
                    }
                }
            }
        }
        let dir = file_abs.parent().map(Path::to_path_buf).unwrap_or_default();
        for (line, target) in markdown_links(&text) {
            if target.is_empty() || is_external(&target) {
                continue;
            }
            let mut fail = |reason: String| {
                broken.push(BrokenLink {
                    file: file.clone(),
                    line,
                    target: target.clone(),
                    reason,
                })
            };
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let path = percent_decode(path);
            let resolved = if path.is_empty() {
                file_abs.clone()
            } else if path.starts_with('/') {
                fail("an absolute path: use a path relative to this file".into());
                continue;
            } else {
                normalize(&dir.join(&path))
            };
            if in_book {
                if let Some(src) = &book_src {
                    if !resolved.starts_with(src) {
                        fail(format!(
                            "points outside the book's {} (mdBook copies only that directory)",
                            src.display()
                        ));
                        continue;
                    }
                }
            }
            if !resolved.exists() {
                fail(format!("no such file: {}", resolved.display()));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            let anchor = percent_decode(anchor);
            let is_markdown = resolved.extension().is_some_and(|e| e == "md");
            if !is_markdown {
                fail("an anchor into a file that is not markdown".into());
                continue;
            }
            match html_page(&resolved) {
                Some(page) => {
                    if !page.is_file() {
                        fail(format!(
                            "{} is not in the built book (is it listed in SUMMARY.md?)",
                            page.display()
                        ));
                    } else if !html_ids(&read(&page)?).contains(&anchor) {
                        fail(format!("no id \"{anchor}\" in {}", page.display()));
                    }
                }
                None => {
                    if !heading_anchors(&read(&resolved)?).contains(&anchor) {
                        fail(format!(
                            "no heading with the anchor \"{anchor}\" in {}",
                            resolved.display()
                        ));
                    }
                }
            }
        }
    }
    Ok(broken)
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory of its own for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-book-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// The chain walked by hand through `source`, as `anyhow`'s `{:#}` prints it.
    fn chain(error: &(dyn std::error::Error + 'static)) -> String {
        let mut out = error.to_string();
        let mut next = error.source();
        while let Some(cause) = next {
            out.push_str(": ");
            out.push_str(&cause.to_string());
            next = cause.source();
        }
        out
    }

    #[test]
    fn a_read_error_prints_its_cause_once() {
        let dir = scratch("read-error");
        let missing = dir.join("missing.md");
        let error = check_links(std::slice::from_ref(&missing), None).unwrap_err();
        assert!(matches!(error, BookError::Read { .. }), "{error:?}");
        let cause = std::error::Error::source(&error)
            .expect("the I/O error")
            .to_string();
        let walked = chain(&error);
        assert_eq!(
            walked,
            format!("cannot read {}: {cause}", missing.display())
        );
        assert_eq!(walked.matches(&cause).count(), 1, "{walked}");
        assert_eq!(error.display_chain().to_string(), walked);
    }

    #[test]
    fn slugs_follow_github_and_mdbook() {
        // Hand-derived from the rule: lower case, spaces to '-', punctuation dropped.
        assert_eq!(slug("Training: the `kiln` CLI"), "training-the-kiln-cli");
        assert_eq!(
            slug("Precision: bf16-mixed and bf16-true"),
            "precision-bf16-mixed-and-bf16-true"
        );
        assert_eq!(slug("In C++"), "in-c");
        assert_eq!(slug("Kiln's fused C++ ops"), "kilns-fused-c-ops");
        assert_eq!(slug("`kiln launch` in detail"), "kiln-launch-in-detail");
        assert_eq!(slug("See [the guide](x.md) now"), "see-the-guide-now");
        assert_eq!(slug("snake_case and CamelCase"), "snake_case-and-camelcase");
    }

    #[test]
    fn headings_in_code_blocks_are_not_headings_and_repeats_are_numbered() {
        let md = "# Top\n\n```sh\n# a comment\n```\n\n## Usage\n\n## Usage\n\n#hashtag\n";
        assert_eq!(heading_anchors(md), ["top", "usage", "usage-1"]);
    }

    #[test]
    fn links_outside_code_are_found_with_their_lines() {
        let md = "See [a](a.md#x) and ![img](pics/p.png \"title\").\n\
                  `[not](a link)` here\n\
                  ```text\n[not](either)\n```\n\
                  [ref]: ref.md\n\
                  <!-- [hidden](gone.md) -->\n\
                  <a href=\"b.md\">b</a> [nested](f(1).md)\n";
        assert_eq!(
            markdown_links(md),
            [
                (1, "a.md#x".to_owned()),
                (1, "pics/p.png".to_owned()),
                (6, "ref.md".to_owned()),
                (8, "f(1).md".to_owned()),
                (8, "b.md".to_owned()),
            ]
        );
    }

    #[test]
    fn html_ids_are_the_id_attributes() {
        let html = r#"<h1 id="top">T</h1><div data-id="no" class="x" id="yes"></div>"#;
        assert_eq!(
            html_ids(html).into_iter().collect::<Vec<_>>(),
            ["top", "yes"]
        );
    }

    #[test]
    fn good_links_pass_and_broken_ones_are_named() {
        let dir = scratch("plain");
        write(&dir.join("other.md"), "# Other page\n\n## A section\n");
        write(&dir.join("img/curves.png"), "png");
        let page = dir.join("page.md");
        write(
            &page,
            "# Page\n\n\
             [good](other.md#a-section) ![good](img/curves.png) [self](#page) [web](https://example.invalid/x)\n\
             [missing file](nowhere.md)\n\
             [missing anchor](other.md#no-such-section)\n",
        );
        let broken = check_links(std::slice::from_ref(&page), None).unwrap();
        let found: Vec<(usize, &str)> =
            broken.iter().map(|b| (b.line, b.target.as_str())).collect();
        assert_eq!(found, [(4, "nowhere.md"), (5, "other.md#no-such-section")]);
        assert!(broken[0].reason.contains("no such file"), "{}", broken[0]);
        assert!(broken[1].reason.contains("no heading"), "{}", broken[1]);
        // The message a user sees: file:line: target: reason.
        assert!(broken[0]
            .to_string()
            .starts_with(&format!("{}:4: nowhere.md: ", page.display())));
    }

    #[test]
    fn book_anchors_are_checked_against_the_built_html() {
        let dir = scratch("book");
        let src = dir.join("src");
        let html = dir.join("html");
        // The markdown heading says "Setup", but the built page has only the id
        // "install": the HTML is what a browser jumps to, so it decides.
        write(
            &src.join("a.md"),
            "# Page A\n\n[b](b.md#setup) [b](b.md#install) [out](../x.md)\n",
        );
        write(&src.join("b.md"), "# Setup\n");
        write(&dir.join("x.md"), "# X\n");
        write(&html.join("a.html"), r#"<h1 id="page-a">Page A</h1>"#);
        write(&html.join("b.html"), r#"<h1 id="install">Setup</h1>"#);
        let book = BuiltBook {
            src: src.clone(),
            html,
        };
        let broken = check_links(&[src.join("a.md"), src.join("b.md")], Some(&book)).unwrap();
        let found: Vec<(&str, &str)> = broken
            .iter()
            .map(|b| (b.target.as_str(), b.reason.as_str()))
            .collect();
        assert_eq!(found.len(), 3, "{broken:#?}");
        assert_eq!(found[0].0, "b.md#setup");
        assert!(found[0].1.contains("no id \"setup\""), "{}", found[0].1);
        assert_eq!(found[1].0, "../x.md");
        assert!(found[1].1.contains("outside the book"), "{}", found[1].1);
        // b.md's heading slug "setup" is not an id of b.html: the slug rule is
        // checked against mdBook's output.
        assert_eq!(found[2].0, "#setup");
        assert_eq!(broken[2].line, 1);
    }
}
