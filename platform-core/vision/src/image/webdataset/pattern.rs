//! Shard patterns: brace ranges and lists (`train-{000000..000099}.tar`,
//! `{a,b}.tar`) as the `webdataset` package expands them, counted before
//! they are listed.

use kiln_core::error::{Error, Result};

/// Most shard paths a pattern may expand to: far more shards than any data
/// set has, far fewer than would exhaust memory listing them.
pub const MAX_SHARDS: u64 = 1_000_000;

/// The first brace group of a pattern: the text before it, its
/// alternatives, and the text after it.
struct BraceGroup<'a> {
    head: &'a str,
    alternatives: Alternatives<'a>,
    tail: &'a str,
}

/// What a brace group stands for.
enum Alternatives<'a> {
    /// `{a..b}`: the integers from `lo` to `hi` (either way round),
    /// zero-padded to `width`.
    Range { lo: u64, hi: u64, width: usize },
    /// `{x,y}`: each part, itself a pattern.
    List(Vec<&'a str>),
}

/// Splits off the first brace group of `pattern`, `None` when it has none.
fn first_group(pattern: &str) -> Result<Option<BraceGroup<'_>>> {
    let bad = |why: &str| Error::invalid_argument("pattern", format!("{pattern:?}: {why}"));
    let Some(open) = pattern.find('{') else {
        if pattern.contains('}') {
            return Err(bad("a `}` without its `{`"));
        }
        return Ok(None);
    };
    let mut depth = 0usize;
    let mut close = None;
    let mut commas = Vec::new();
    for (i, c) in pattern[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            ',' if depth == 1 => commas.push(open + i),
            _ => {}
        }
    }
    let close = close.ok_or_else(|| bad("a `{` without its `}`"))?;
    let body = &pattern[open + 1..close];
    let alternatives = if commas.is_empty() {
        let (a, b) = body
            .split_once("..")
            .ok_or_else(|| bad("expected `{a..b}` or `{x,y}`"))?;
        let (lo, hi): (u64, u64) = match (a.parse(), b.parse()) {
            (Ok(lo), Ok(hi)) => (lo, hi),
            _ => return Err(bad("range ends must be non-negative integers")),
        };
        let padded = (a.len() > 1 && a.starts_with('0')) || (b.len() > 1 && b.starts_with('0'));
        let width = if padded { a.len().max(b.len()) } else { 0 };
        Alternatives::Range { lo, hi, width }
    } else {
        let mut parts = Vec::new();
        let mut start = open + 1;
        for &c in &commas {
            parts.push(&pattern[start..c]);
            start = c + 1;
        }
        parts.push(&pattern[start..close]);
        Alternatives::List(parts)
    };
    Ok(Some(BraceGroup {
        head: &pattern[..open],
        alternatives,
        tail: &pattern[close + 1..],
    }))
}

/// How many paths `pattern` expands to (saturating at `u64::MAX`), counted
/// without expanding it; checks the whole pattern as
/// [`expand_braces`] does.
pub(super) fn count_expansions(pattern: &str) -> Result<u64> {
    let Some(group) = first_group(pattern)? else {
        return Ok(1);
    };
    // The head has no braces and a group's parts are balanced, so the
    // expansions of a group followed by the tail are every pairing of the two.
    let here = match group.alternatives {
        Alternatives::Range { lo, hi, .. } => lo.abs_diff(hi).saturating_add(1),
        Alternatives::List(parts) => parts.iter().try_fold(0u64, |n, part| {
            Ok::<_, Error>(n.saturating_add(count_expansions(part)?))
        })?,
    };
    Ok(here.saturating_mul(count_expansions(group.tail)?))
}

/// Shell-style brace expansion: `{000..002}` and `{a,b}`, nested and
/// repeated. Callers check the count first ([`count_expansions`]): a range
/// is expanded in full.
pub(super) fn expand_braces(pattern: &str) -> Result<Vec<String>> {
    let Some(BraceGroup {
        head,
        alternatives,
        tail,
    }) = first_group(pattern)?
    else {
        return Ok(vec![pattern.to_string()]);
    };
    let alternatives: Vec<String> = match alternatives {
        Alternatives::Range { lo, hi, width } => {
            let values: Vec<u64> = if lo <= hi {
                (lo..=hi).collect()
            } else {
                (hi..=lo).rev().collect()
            };
            values.into_iter().map(|v| format!("{v:0width$}")).collect()
        }
        Alternatives::List(parts) => parts.into_iter().map(str::to_owned).collect(),
    };
    let mut out = Vec::new();
    for alt in alternatives {
        out.extend(expand_braces(&format!("{head}{alt}{tail}"))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces_expand_ranges_and_lists() -> Result<()> {
        assert_eq!(
            expand_braces("s-{000..002}.tar")?,
            ["s-000.tar", "s-001.tar", "s-002.tar"]
        );
        assert_eq!(
            expand_braces("{a,b}-{8..10}")?,
            ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
        );
        assert_eq!(expand_braces("{x,{y,z}}")?, ["x", "y", "z"]);
        assert_eq!(expand_braces("plain.tar")?, ["plain.tar"]);
        for bad in ["{1..", "a}", "{a}", "{x..2}"] {
            let err = expand_braces(bad).expect_err(bad);
            assert!(matches!(err, Error::InvalidArgument { .. }), "{bad}: {err}");
            let err = count_expansions(bad).expect_err(bad);
            assert!(matches!(err, Error::InvalidArgument { .. }), "{bad}: {err}");
        }
        Ok(())
    }
    #[test]
    fn counts_match_expansions_without_listing_them() -> Result<()> {
        for pattern in [
            "s-{000..002}.tar",
            "{a,b}-{8..10}",
            "{x,{y,z}}",
            "p",
            "{3..1}{a,{b,c}d{0..1}}",
        ] {
            assert_eq!(
                count_expansions(pattern)?,
                expand_braces(pattern)?.len() as u64,
                "{pattern}"
            );
        }
        assert_eq!(count_expansions("x-{0..99999999999}.tar")?, 100_000_000_000);
        assert_eq!(count_expansions(&"{0..99999}".repeat(8))?, u64::MAX);
        Ok(())
    }
}
