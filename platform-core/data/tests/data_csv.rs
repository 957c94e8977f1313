//! CSV reader: values, options, and errors that name line, offset and column.

use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::write::GzEncoder;
use flate2::Compression;
use kiln_core::{DType, Error, HostTensor, Result};
use kiln_data::{load_csv, CsvOptions, LabelColumn, LabelKind};
use kiln_testkit::TempDir;

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write test file");
    path
}

fn data_error(err: Error) -> (PathBuf, Option<u64>, String) {
    match err {
        Error::Data {
            path,
            offset,
            reason,
            ..
        } => (path, offset, reason),
        other => panic!("expected Error::Data, got {other:?}"),
    }
}

const IRIS: &str = "\
sepal length,\"species, as id\",petal width
5.1,0,0.2
\"4.9\",0, 0.25

7.0,1,1.4
";

#[test]
fn label_by_name_in_the_middle() -> Result<()> {
    let dir = TempDir::new("csv-iris");
    let path = write(dir.path(), "iris.csv", IRIS.as_bytes());
    let options = CsvOptions {
        label_column: LabelColumn::Name("species, as id".into()),
        ..CsvOptions::default()
    };
    let (x, y) = load_csv(&path, &options)?;
    assert_eq!(x.dims(), &[3, 2]);
    assert_eq!(x.dtype(), DType::F32);
    assert_eq!(x.as_slice::<f32>()?, &[5.1, 0.2, 4.9, 0.25, 7.0, 1.4]);
    assert_eq!(y, HostTensor::new(vec![0i64, 0, 1], [3])?);

    // the same by index, and the default (last column) as regression target
    let by_index = CsvOptions {
        label_column: LabelColumn::Index(1),
        ..CsvOptions::default()
    };
    assert_eq!(load_csv(&path, &by_index)?, (x, y));
    let regression = CsvOptions {
        labels: LabelKind::Regression,
        ..CsvOptions::default()
    };
    let (x, y) = load_csv(&path, &regression)?;
    assert_eq!(x.as_slice::<f32>()?, &[5.1, 0.0, 4.9, 0.0, 7.0, 1.0]);
    assert_eq!(y, HostTensor::new(vec![0.2f32, 0.25, 1.4], [3])?);
    Ok(())
}

#[test]
fn no_header_other_delimiter_crlf_and_gzip() -> Result<()> {
    let dir = TempDir::new("csv-options");
    let text = "3;1.5;-2\r\n1.0;2.5e1;\"7\"\r\n";
    let options = CsvOptions {
        has_header: false,
        delimiter: b';',
        label_column: LabelColumn::Index(0),
        labels: LabelKind::Class,
        allow_non_finite: false,
    };
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(text.as_bytes()).expect("compress");
    let gz = enc.finish().expect("compress");
    for (name, bytes) in [("plain.csv", text.as_bytes().to_vec()), ("packed.csv", gz)] {
        let path = write(dir.path(), name, &bytes);
        let (x, y) = load_csv(&path, &options)?;
        assert_eq!(
            x,
            HostTensor::new(vec![1.5f32, -2.0, 25.0, 7.0], [2, 2])?,
            "{name}"
        );
        // "1.0" is class 1
        assert_eq!(y, HostTensor::new(vec![3i64, 1], [2])?, "{name}");
    }
    Ok(())
}

#[test]
fn a_bad_number_names_line_offset_and_column() -> Result<()> {
    let dir = TempDir::new("csv-bad-number");
    // line 3 starts at byte 16; its second field "x1" at byte 20
    let text = "a,b,label\n1,2,0\n3.5,x1,1\n";
    assert_eq!(&text[16..22], "3.5,x1");
    let path = write(dir.path(), "bad.csv", text.as_bytes());
    let err = load_csv(&path, &CsvOptions::default()).expect_err("x1");
    let message = err.to_string();
    let (p, offset, reason) = data_error(err);
    assert_eq!(p, path.as_path());
    assert_eq!(offset, Some(20));
    assert_eq!(reason, "line 3, column 2 (`b`): `x1` is not a number");
    assert_eq!(
        message,
        format!(
            "malformed data file {} at byte 20: line 3, column 2 (`b`): `x1` is not a number",
            path.display()
        )
    );

    // without a header the column has no name
    let path = write(dir.path(), "bad-label.csv", b"1,2,0\n1,2,2.5\n");
    let options = CsvOptions {
        has_header: false,
        ..CsvOptions::default()
    };
    let (_, offset, reason) = data_error(load_csv(&path, &options).expect_err("2.5"));
    assert_eq!(offset, Some(10));
    assert_eq!(
        reason,
        "line 2, column 3: `2.5` is not an integer class label"
    );

    // an empty field
    let path = write(dir.path(), "empty-field.csv", b"a,b\n1,\n");
    let (_, offset, reason) =
        data_error(load_csv(&path, &CsvOptions::default()).expect_err("empty"));
    assert_eq!(offset, Some(6));
    assert_eq!(reason, "line 2, column 2 (`b`): empty field");
    Ok(())
}

#[test]
fn structural_errors() -> Result<()> {
    let dir = TempDir::new("csv-structure");
    let defaults = CsvOptions::default();

    // a record with too few fields, starting at byte 9 on line 4 (after a blank line)
    let path = write(dir.path(), "short.csv", b"a,b\n1,2\n\n3\n");
    let (_, offset, reason) = data_error(load_csv(&path, &defaults).expect_err("short"));
    assert_eq!(offset, Some(9));
    assert_eq!(reason, "line 4: expected 2 fields, found 1");

    // an unterminated quote, opened at byte 8 on line 3
    let path = write(dir.path(), "quote.csv", b"a,b\n1,2\n\"3,4\n");
    let (_, offset, reason) = data_error(load_csv(&path, &defaults).expect_err("quote"));
    assert_eq!(offset, Some(8));
    assert_eq!(
        reason,
        "line 3: the quoted field opened here is never closed"
    );

    // label name not in the header
    let path = write(dir.path(), "names.csv", b"a,b\n1,2\n");
    let options = CsvOptions {
        label_column: LabelColumn::Name("y".into()),
        ..CsvOptions::default()
    };
    let (_, offset, reason) = data_error(load_csv(&path, &options).expect_err("no y"));
    assert_eq!(offset, Some(0));
    assert_eq!(
        reason,
        "line 1: no column named `y` in the header (columns: a, b)"
    );
    let options = CsvOptions {
        label_column: LabelColumn::Index(2),
        ..CsvOptions::default()
    };
    let (_, _, reason) = data_error(load_csv(&path, &options).expect_err("index 2"));
    assert_eq!(
        reason,
        "line 1: label column index 2 is out of range: the header has 2 columns"
    );
    // a name without a header is an invalid argument
    let options = CsvOptions {
        has_header: false,
        label_column: LabelColumn::Name("b".into()),
        ..CsvOptions::default()
    };
    let err = load_csv(&path, &options).expect_err("name without header");
    assert!(matches!(err, Error::InvalidArgument { ref name, .. } if name == "label_column"));

    // header only, and empty
    let path = write(dir.path(), "header-only.csv", b"a,b\n");
    let (_, offset, reason) = data_error(load_csv(&path, &defaults).expect_err("no rows"));
    assert_eq!(offset, Some(4));
    assert_eq!(reason, "no data rows after the header");
    let path = write(dir.path(), "empty.csv", b"");
    let (_, _, reason) = data_error(load_csv(&path, &defaults).expect_err("empty"));
    assert_eq!(reason, "no data rows: the file is empty");

    let err = load_csv(&dir.path().join("missing.csv"), &defaults).expect_err("missing");
    assert!(matches!(err, Error::Io { .. }), "{err}");
    Ok(())
}
