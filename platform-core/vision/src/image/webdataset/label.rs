//! A sample's label: a `cls` member's integer or a `json` member's
//! `"label"`, checked against the data set's classes.

use std::path::Path;

use kiln_core::error::{Error, Result};

/// Class indices `0..classes`, and a label a loss ignores.
#[derive(Clone, Copy, Debug)]
pub(super) struct LabelRange {
    pub(super) classes: usize,
    pub(super) ignore_index: Option<i64>,
}

/// A `cls` member's integer, or a `json` member's `"label"`.
pub(super) fn parse_label(bytes: &[u8], ext: &str, name: &Path) -> Result<i64> {
    if ext == "json" {
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| Error::data_caused_by(name, None, "not valid JSON", e))?;
        return value.get("label").and_then(|l| l.as_i64()).ok_or_else(|| {
            Error::data(name, None, "expected an object with an integer \"label\"")
        });
    }
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|t| t.trim().parse::<i64>().ok())
        .ok_or_else(|| {
            Error::data(
                name,
                None,
                format!(
                    "expected an ASCII integer label, got {:?}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(32)])
                ),
            )
        })
}

/// Checks that `label`, read from the member `name`, is a class of `range`.
pub(super) fn check_label(label: i64, range: LabelRange, name: &Path) -> Result<()> {
    let classes = range.classes;
    if Some(label) == range.ignore_index
        || usize::try_from(label).is_ok_and(|index| index < classes)
    {
        return Ok(());
    }
    let expected = match classes {
        0 => "there are no classes".to_owned(),
        n => format!("expected a class index from 0 to {}", n - 1),
    };
    let ignored = match range.ignore_index {
        Some(i) => format!(", or {i}, the ignored label"),
        None => String::new(),
    };
    Err(Error::data(
        name,
        None,
        format!("label {label} is outside the {classes} classes: {expected}{ignored}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_outside_the_classes_name_member_value_and_range() {
        let name = Path::new("s.tar:000001.cls");
        let range = LabelRange {
            classes: 10,
            ignore_index: Some(-100),
        };
        for ok in [0, 9, -100] {
            assert!(check_label(ok, range, name).is_ok(), "{ok}");
        }
        for bad in [-1, 10, 99] {
            let err = check_label(bad, range, name).unwrap_err().to_string();
            for wanted in [
                "s.tar:000001.cls",
                &format!("label {bad} "),
                "10 classes",
                "0 to 9",
                "-100",
            ] {
                assert!(err.contains(wanted), "{wanted}: {err}");
            }
        }
    }
}
