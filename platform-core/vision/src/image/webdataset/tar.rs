//! Reading a tar's headers into an index of its members (name, data offset,
//! size), seeking over the data: ustar (with its prefix field), GNU long
//! names and pax headers.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use kiln_core::error::{Error, Result};

/// A tar block.
pub(super) const BLOCK: u64 = 512;
/// Most bytes of a GNU long name or a pax header Kiln reads.
const MAX_META: u64 = 1 << 20;

/// `(key, extension)` of a member path as `webdataset` splits it: the
/// extension starts at the first dot of the file name. `None` for names
/// without one, and for `__key__`-style metadata members.
pub(super) fn split_key(name: &str) -> Option<(&str, &str)> {
    let (dir_len, file) = match name.rfind('/') {
        Some(i) => (i + 1, &name[i + 1..]),
        None => (0, name),
    };
    if dir_len == 0 && file.starts_with("__") && file.ends_with("__") {
        return None;
    }
    let dot = file.find('.')?;
    if dot == 0 {
        return None;
    }
    Some((&name[..dir_len + dot], &file[dot + 1..]))
}

/// Every regular file member of the tar at `path`: `(name, data offset, size)`.
/// Understands ustar (with its prefix field), GNU long names (`L`) and pax
/// headers' `path` and `size`.
pub(super) fn scan_tar(path: &Path) -> Result<Vec<(String, u64, u64)>> {
    let file = kiln_core::fs::open_regular_file(path)?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut out = Vec::new();
    let mut pos = 0u64;
    let mut long_name: Option<String> = None;
    let mut pax_path: Option<String> = None;
    let mut pax_size: Option<u64> = None;
    let mut header = [0u8; BLOCK as usize];
    loop {
        if pos >= file_len {
            // No end-of-archive blocks: accepted, as GNU tar does with a warning.
            break;
        }
        if file_len - pos < BLOCK {
            return Err(Error::data(
                path,
                Some(pos),
                format!(
                    "truncated tar: {} bytes left where a 512-byte header starts",
                    file_len - pos
                ),
            ));
        }
        file.read_exact_at(&mut header, pos)
            .map_err(|e| Error::io(path, e))?;
        if header.iter().all(|&b| b == 0) {
            break;
        }
        check_checksum(&header, path, pos)?;
        let mut name = match long_name.take().or(pax_path.take()) {
            Some(n) => n,
            None => ustar_name(&header),
        };
        let size = match pax_size.take() {
            Some(s) => s,
            None => octal_field(&header[124..136])
                .ok_or_else(|| Error::data(path, Some(pos + 124), "tar header: bad size field"))?,
        };
        let data = pos + BLOCK;
        if data.checked_add(size).is_none_or(|end| end > file_len) {
            if name.is_empty() {
                name = "(unnamed)".to_string();
            }
            return Err(Error::data(
                path,
                Some(pos),
                format!(
                    "truncated tar: member {name} has {size} bytes of data from byte {data}, \
                     but the file ends at byte {file_len}"
                ),
            ));
        }
        let typeflag = header[156];
        match typeflag {
            b'0' | 0 | b'7' => out.push((name, data, size)),
            b'L' => long_name = Some(read_meta(&file, path, data, size)?),
            b'x' => {
                let text = read_meta(&file, path, data, size)?;
                for (key, value) in pax_records(&text) {
                    match key {
                        "path" => pax_path = Some(value.to_string()),
                        "size" => pax_size = value.parse().ok(),
                        _ => {}
                    }
                }
            }
            // Directories, links, global pax headers, ...: no sample data.
            _ => {}
        }
        pos = data + size.div_ceil(BLOCK) * BLOCK;
    }
    Ok(out)
}

/// The text of a GNU long-name or pax member (NULs trimmed).
fn read_meta(file: &File, path: &Path, offset: u64, size: u64) -> Result<String> {
    if size > MAX_META {
        return Err(Error::data(
            path,
            Some(offset),
            format!("tar: a {size}-byte extended header (at most {MAX_META} expected)"),
        ));
    }
    let mut buf = vec![0u8; size as usize];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| Error::io(path, e))?;
    let text = String::from_utf8_lossy(&buf);
    Ok(text.trim_end_matches('\0').to_string())
}

/// `(key, value)` of pax records `"<len> key=value\n"`.
fn pax_records(text: &str) -> Vec<(&str, &str)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some((len, _)) = rest.split_once(' ') {
        let Ok(n) = len.parse::<usize>() else { break };
        let (Some(record), Some(next)) = (rest.get(..n), rest.get(n..)) else {
            break;
        };
        let Some(body) = record.get(len.len() + 1..) else {
            break;
        };
        if let Some((k, v)) = body.trim_end_matches('\n').split_once('=') {
            out.push((k, v));
        }
        rest = next;
    }
    out
}

/// The header's name, with the ustar prefix when there is one.
fn ustar_name(header: &[u8]) -> String {
    let field = |b: &[u8]| {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).into_owned()
    };
    let name = field(&header[..100]);
    if &header[257..262] == b"ustar" {
        let prefix = field(&header[345..500]);
        if !prefix.is_empty() {
            return format!("{prefix}/{name}");
        }
    }
    name
}

/// An octal number field (NUL/space padded), or GNU base-256.
fn octal_field(b: &[u8]) -> Option<u64> {
    if b.first().is_some_and(|&c| c & 0x80 != 0) {
        let mut v: u64 = u64::from(b[0] & 0x7F);
        for &c in &b[1..] {
            v = v.checked_mul(256)?.checked_add(u64::from(c))?;
        }
        return Some(v);
    }
    let text = std::str::from_utf8(b).ok()?;
    let text = text.trim_matches(|c: char| c == '\0' || c == ' ');
    if text.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(text, 8).ok()
}

fn check_checksum(header: &[u8], path: &Path, pos: u64) -> Result<()> {
    let stored = octal_field(&header[148..156]);
    let sum: u64 = header
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            if (148..156).contains(&i) {
                u64::from(b' ')
            } else {
                u64::from(b)
            }
        })
        .sum();
    if stored == Some(sum) {
        Ok(())
    } else {
        Err(Error::data(
            path,
            Some(pos),
            "not a tar header (bad checksum): the shard is corrupt or not a tar file",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(split_key("000123.jpg"), Some(("000123", "jpg")));
        assert_eq!(split_key("a.b/c.seg.png"), Some(("a.b/c", "seg.png")));
        assert_eq!(split_key("dir/noext"), None);
        assert_eq!(split_key("__key__"), None);
    }
    #[test]
    fn pax_records_are_parsed() {
        let text = "29 path=a/very/long/name.jpg\n11 size=42\n";
        assert_eq!(
            pax_records(text),
            [("path", "a/very/long/name.jpg"), ("size", "42")]
        );
    }
    #[test]
    fn octal_and_base256_sizes() {
        assert_eq!(octal_field(b"00000000012\0"), Some(10));
        assert_eq!(octal_field(b"\x80\0\0\0\0\0\0\0\0\0\x01\x00"), Some(256));
        assert_eq!(octal_field(b"zz"), None);
    }
}
