//! IDX / MNIST reader: hand-written files (raw and gzip), malformed ones,
//! and files written by numpy.

use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::write::GzEncoder;
use flate2::Compression;
use kiln_core::{DType, Error, HostTensor, Result};
use kiln_data::{load_mnist, load_mnist_images, load_mnist_labels, read_idx};
use kiln_testkit::TempDir;

/// An IDX header: magic `00 00 type rank`, then the sizes big-endian.
fn header(type_code: u8, dims: &[u32]) -> Vec<u8> {
    let mut h = vec![0, 0, type_code, dims.len() as u8];
    for d in dims {
        h.extend_from_slice(&d.to_be_bytes());
    }
    h
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(bytes).expect("compress");
    enc.finish().expect("compress")
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write test file");
    path
}

/// Three 2x2 images with pixels 0..12 (times 20) and labels 7, 0, 255.
fn images_bytes() -> Vec<u8> {
    let mut b = header(0x08, &[3, 2, 2]);
    b.extend((0..12u8).map(|v| v * 20));
    b
}

fn labels_bytes() -> Vec<u8> {
    let mut b = header(0x08, &[3]);
    b.extend([7u8, 0, 255]);
    b
}

/// The `Error::Data` fields of `err`, or a panic.
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

#[test]
fn reads_raw_and_gzip_images_and_labels() -> Result<()> {
    let dir = TempDir::new("mnist-read");
    let expected_pixels: Vec<u8> = (0..12u8).map(|v| v * 20).collect();
    // gzip is recognised by its magic bytes, not by the name
    for (name, bytes) in [
        ("raw-images", images_bytes()),
        ("gz-images.gz", gzip(&images_bytes())),
        ("gz-without-suffix", gzip(&images_bytes())),
    ] {
        let path = write(dir.path(), name, &bytes);
        let images = load_mnist_images(&path)?;
        assert_eq!(images.dims(), &[3, 2, 2], "{name}");
        assert_eq!(images.dtype(), DType::U8);
        assert_eq!(
            images.as_slice::<u8>()?,
            expected_pixels.as_slice(),
            "{name}"
        );
        assert_eq!(read_idx(&path)?, images);
    }
    for (name, bytes) in [
        ("labels", labels_bytes()),
        ("labels.gz", gzip(&labels_bytes())),
    ] {
        let path = write(dir.path(), name, &bytes);
        let labels = load_mnist_labels(&path)?;
        assert_eq!(labels, HostTensor::new(vec![7i64, 0, 255], [3])?, "{name}");
    }
    // any image size the header gives, e.g. 28x28
    let mut big = header(0x08, &[2, 28, 28]);
    big.extend((0..2 * 28 * 28).map(|i| (i % 251) as u8));
    let path = write(dir.path(), "mnist-sized.gz", &gzip(&big));
    let images = load_mnist_images(&path)?;
    assert_eq!(images.dims(), &[2, 28, 28]);
    let px = images.as_slice::<u8>()?;
    assert_eq!((px[0], px[783], px[784], px[1567]), (0, 30, 31, 61));
    Ok(())
}

#[test]
fn read_idx_decodes_other_element_types() -> Result<()> {
    let dir = TempDir::new("mnist-types");
    let mut b = header(0x0D, &[2, 2]);
    for v in [1.5f32, -2.0, 0.25, 1e-3] {
        b.extend_from_slice(&v.to_be_bytes());
    }
    let t = read_idx(&write(dir.path(), "floats", &b))?;
    assert_eq!(t, HostTensor::new(vec![1.5f32, -2.0, 0.25, 1e-3], [2, 2])?);

    let mut b = header(0x0C, &[3]);
    for v in [-7i32, 0, 65536] {
        b.extend_from_slice(&v.to_be_bytes());
    }
    let t = read_idx(&write(dir.path(), "ints.gz", &gzip(&b)))?;
    assert_eq!(t, HostTensor::new(vec![-7i32, 0, 65536], [3])?);

    // a float file is not an image file
    let err = load_mnist_images(&dir.path().join("floats")).expect_err("type 0x0D");
    let (_, offset, reason) = data_error(err);
    assert_eq!(offset, Some(0));
    assert!(
        reason.starts_with("magic number 0x00000d02, expected 0x00000803"),
        "{reason}"
    );
    Ok(())
}

#[test]
fn truncated_files_name_the_offset() -> Result<()> {
    let dir = TempDir::new("mnist-truncated");
    let full = images_bytes(); // 16-byte header + 12 pixels

    // payload cut after 7 pixels: offset 16 + 7 = 23, inside image 1 (4 pixels each)
    let path = write(dir.path(), "cut-payload", &full[..23]);
    let err = load_mnist_images(&path).expect_err("truncated payload");
    assert!(err.to_string().contains("cut-payload at byte 23"), "{err}");
    let (p, offset, reason) = data_error(err);
    assert_eq!(p, path.as_path());
    assert_eq!(offset, Some(23));
    assert_eq!(
        reason,
        "truncated payload: dimensions [3, 2, 2] of unsigned byte need 12 bytes after the \
         16-byte header, the file has 7 (it ends inside item 1)"
    );

    // the same file compressed: the offset is in the decompressed stream
    let path = write(dir.path(), "cut-payload.gz", &gzip(&full[..23]));
    let (_, offset, _) = data_error(load_mnist_images(&path).expect_err("truncated"));
    assert_eq!(offset, Some(23));

    // header cut inside the second dimension: 4 + 6 bytes
    let path = write(dir.path(), "cut-header", &full[..10]);
    let (_, offset, reason) = data_error(load_mnist_images(&path).expect_err("header"));
    assert_eq!(offset, Some(10));
    assert_eq!(
        reason,
        "truncated header: 3 dimension sizes need 16 bytes, the file ends after 10"
    );

    // shorter than the magic number, and empty
    let path = write(dir.path(), "two-bytes", &full[..2]);
    let (_, offset, reason) = data_error(load_mnist_images(&path).expect_err("2 bytes"));
    assert_eq!(offset, Some(2));
    assert!(reason.starts_with("truncated header"), "{reason}");
    let path = write(dir.path(), "empty", &[]);
    let (_, offset, _) = data_error(read_idx(&path).expect_err("empty"));
    assert_eq!(offset, Some(0));

    // a gzip stream cut in the middle: an error inside the decompressed data
    let mut big = header(0x08, &[50, 28, 28]);
    big.extend((0..50 * 28 * 28).map(|i| (i * 7 % 256) as u8));
    let gz = gzip(&big);
    let path = write(dir.path(), "cut-stream.gz", &gz[..gz.len() / 2]);
    let err = load_mnist_images(&path).expect_err("cut gzip stream");
    let (p, offset, reason) = data_error(err);
    assert_eq!(p, path.as_path());
    let offset = offset.expect("an offset");
    assert!(
        offset >= 16 && offset < big.len() as u64,
        "offset {offset}: {reason}"
    );
    assert!(
        reason.starts_with("cannot decompress gzip data")
            || reason.starts_with("truncated payload"),
        "{reason}"
    );
    Ok(())
}

#[test]
fn malformed_headers_and_trailing_data() -> Result<()> {
    let dir = TempDir::new("mnist-malformed");

    // label file given as images (and the reverse): magic checked at offset 0
    let labels = write(dir.path(), "labels", &labels_bytes());
    let (_, offset, reason) = data_error(load_mnist_images(&labels).expect_err("labels"));
    assert_eq!(offset, Some(0));
    assert_eq!(
        reason,
        "magic number 0x00000801, expected 0x00000803 for an MNIST image file (unsigned bytes, \
         3 dimensions) (is this the right file?)"
    );
    let images = write(dir.path(), "images", &images_bytes());
    let (_, offset, _) = data_error(load_mnist_labels(&images).expect_err("images"));
    assert_eq!(offset, Some(0));

    // not IDX at all
    let path = write(dir.path(), "text", b"hello world, not idx");
    let (_, offset, reason) = data_error(read_idx(&path).expect_err("text"));
    assert_eq!(offset, Some(0));
    assert!(reason.contains("not an IDX file"), "{reason}");

    // unknown element type 0x0A at byte 2
    let path = write(dir.path(), "type", &header(0x0A, &[1]));
    let (_, offset, reason) = data_error(read_idx(&path).expect_err("type"));
    assert_eq!(offset, Some(2));
    assert!(
        reason.starts_with("unknown element type code 0x0a"),
        "{reason}"
    );

    // a zero image height, stored at bytes 8..12
    let path = write(dir.path(), "zero-rows", &header(0x08, &[3, 0, 2]));
    let (_, offset, reason) = data_error(load_mnist_images(&path).expect_err("zero"));
    assert_eq!(offset, Some(8));
    assert_eq!(reason, "dimension 1 has size 0");

    // one byte too many after the 12-pixel payload
    let mut long = images_bytes();
    long.push(9);
    let path = write(dir.path(), "long.gz", &gzip(&long));
    let (_, offset, reason) = data_error(load_mnist_images(&path).expect_err("trailing"));
    assert_eq!(offset, Some(28));
    assert_eq!(
        reason,
        "unexpected data after the 12-byte payload of dimensions [3, 2, 2]"
    );

    // missing file
    let err = read_idx(&dir.path().join("nope")).expect_err("missing");
    assert!(matches!(err, Error::Io { .. }), "{err}");
    Ok(())
}

#[test]
fn load_mnist_finds_the_four_files() -> Result<()> {
    let dir = TempDir::new("mnist-dir");
    write(
        dir.path(),
        "train-images-idx3-ubyte.gz",
        &gzip(&images_bytes()),
    );
    write(dir.path(), "train-labels-idx1-ubyte", &labels_bytes());
    let mut test_images = header(0x08, &[1, 2, 2]);
    test_images.extend([1, 2, 3, 4]);
    let mut test_labels = header(0x08, &[1]);
    test_labels.push(4);
    write(dir.path(), "t10k-images-idx3-ubyte", &test_images);

    // a missing part is a not-found I/O error naming it
    let err = load_mnist(dir.path()).expect_err("no test labels");
    match &err {
        Error::Io { path, source } => {
            assert_eq!(path, &dir.path().join("t10k-labels-idx1-ubyte"));
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("unexpected {other:?}"),
    }
    // the dotted spelling of some mirrors is found too
    write(dir.path(), "t10k-labels.idx1-ubyte.gz", &gzip(&test_labels));
    let mnist = load_mnist(dir.path())?;
    assert_eq!(mnist.train_images.dims(), &[3, 2, 2]);
    assert_eq!(mnist.train_labels.as_slice::<i64>()?, &[7, 0, 255]);
    assert_eq!(mnist.test_images.as_slice::<u8>()?, &[1, 2, 3, 4]);
    assert_eq!(mnist.test_labels.as_slice::<i64>()?, &[4]);

    // counts that disagree
    let mut two_labels = header(0x08, &[2]);
    two_labels.extend([1, 2]);
    let labels_path = write(dir.path(), "train-labels-idx1-ubyte", &two_labels);
    let err = load_mnist(dir.path()).expect_err("2 labels for 3 images");
    let (p, offset, reason) = data_error(err);
    assert_eq!(p, labels_path.as_path());
    assert_eq!(offset, Some(4));
    assert!(reason.starts_with("2 labels, but "), "{reason}");
    assert!(reason.ends_with("holds 3 images"), "{reason}");
    Ok(())
}

#[test]
fn reads_files_written_by_numpy() -> Result<()> {
    let Some(python) = kiln_testkit::python("reads_files_written_by_numpy") else {
        return Ok(());
    };
    let dir = TempDir::new("mnist-numpy");
    let out =
        kiln_testkit::run_reference_script!(&python, "data_idx.py", &[dir.path().as_os_str()]);
    let reference: serde_json::Value = serde_json::from_str(&out).expect("JSON from the script");
    let entry = |name: &str| -> (Vec<usize>, Vec<f64>) {
        let e = &reference[name];
        let shape = e["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim") as usize)
            .collect();
        let values = e["values"]
            .as_array()
            .expect("values")
            .iter()
            .map(|v| v.as_f64().expect("number"))
            .collect();
        (shape, values)
    };

    let mnist = load_mnist(dir.path())?;
    for (name, tensor) in [
        ("train-images-idx3-ubyte", &mnist.train_images),
        ("train-labels-idx1-ubyte.gz", &mnist.train_labels),
        ("t10k-images-idx3-ubyte.gz", &mnist.test_images),
        ("t10k-labels-idx1-ubyte", &mnist.test_labels),
    ] {
        let (shape, values) = entry(name);
        assert_eq!(tensor.dims(), shape.as_slice(), "{name}");
        assert_eq!(tensor.to_f64_vec(), values, "{name}");
    }
    assert_eq!(mnist.train_images.dtype(), DType::U8);
    assert_eq!(mnist.train_labels.dtype(), DType::I64);

    let floats = read_idx(&dir.path().join("floats-idx2-float"))?;
    let (shape, values) = entry("floats-idx2-float");
    assert_eq!(floats.dims(), shape.as_slice());
    assert_eq!(floats.dtype(), DType::F32);
    // numpy's float32 values, printed as exact doubles
    assert_eq!(floats.to_f64_vec(), values);

    let shorts = read_idx(&dir.path().join("shorts-idx1-int16.gz"))?;
    assert_eq!(
        shorts,
        HostTensor::new(vec![-32768i32, -1, 300, 32767], [4])?
    );
    Ok(())
}
