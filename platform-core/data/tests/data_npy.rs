//! `read_npy` against files `numpy.save` wrote (tests/reference/data_npy.py):
//! every dtype it reads, both byte orders, Fortran order, a scalar, an empty
//! array and format versions 2.0 and 3.0; and the files it must refuse.

use kiln_core::{DType, Error, Result};
use kiln_data::read_npy;
use kiln_testkit::TempDir;

#[test]
fn reads_what_numpy_wrote() -> Result<()> {
    let Some(python) = kiln_testkit::python("reads_what_numpy_wrote") else {
        return Ok(());
    };
    let dir = TempDir::new("npy-numpy");
    let out =
        kiln_testkit::run_reference_script!(&python, "data_npy.py", &[dir.path().as_os_str()]);
    let reference: serde_json::Value = serde_json::from_str(&out).expect("JSON from the script");
    let cases = reference.as_object().expect("an object");
    assert_eq!(cases.len(), 18);
    for (name, case) in cases {
        let t = read_npy(dir.path().join(name))?;
        let shape: Vec<usize> = case["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim") as usize)
            .collect();
        assert_eq!(t.dims(), shape.as_slice(), "{name}");
        let want: Vec<f64> = case["values"]
            .as_array()
            .expect("values")
            .iter()
            .map(|v| v.as_f64().expect("a number"))
            .collect();
        let got: Vec<f64> = t.to_dtype(DType::F64).into_vec::<f64>()?;
        assert_eq!(got, want, "{name}");
        let dtype = match name.as_str() {
            "f64.npy" | "scalar.npy" => DType::F64,
            "f16.npy" => DType::F16,
            "i64.npy" | "u32.npy" | "big_endian_i64.npy" => DType::I64,
            "i32.npy" | "i16.npy" | "i8.npy" | "u16.npy" => DType::I32,
            "u8.npy" | "bool.npy" => DType::U8,
            _ => DType::F32,
        };
        assert_eq!(t.dtype(), dtype, "{name}");
    }
    Ok(())
}

/// A file whose header lies about its size, a truncated one, an unknown
/// dtype and a file that is not a `.npy` are each an [`Error::Data`] naming
/// the file and what is wrong; nothing is allocated from the header's claim.
#[test]
fn refuses_files_that_are_not_what_they_say() {
    let dir = TempDir::new("npy-bad");
    let file = |header: &str, data: &[u8]| {
        let padded = format!("{header:<117}\n");
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend((padded.len() as u16).to_le_bytes());
        bytes.extend(padded.as_bytes());
        bytes.extend(data);
        bytes
    };
    let reason = |name: &str, bytes: &[u8]| -> String {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        match read_npy(&path) {
            Err(Error::Data {
                path: p, reason, ..
            }) => {
                assert_eq!(p, path);
                reason
            }
            other => panic!("{name}: expected Error::Data, got {other:?}"),
        }
    };
    let huge = file(
        "{'descr': '<f8', 'fortran_order': False, 'shape': (100000000000,), }",
        &[0; 16],
    );
    assert_eq!(
        reason("huge.npy", &huge),
        "shape [100000000000] of \"<f8\" needs 800000000000 bytes of data, the file has 16"
    );
    let short = file(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }",
        &[0; 8],
    );
    assert!(reason("short.npy", &short).starts_with("shape [3] of \"<f4\" needs 12 bytes"));
    let complex = file(
        "{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }",
        &[0; 8],
    );
    assert!(reason("complex.npy", &complex).starts_with("elements of type \"<c8\""));
    let objects = file(
        "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
        &[0; 8],
    );
    assert!(reason("objects.npy", &objects).starts_with("elements of type \"|O\""));
    assert!(reason("text.npy", b"a,b\n1,2\n").starts_with("not a .npy file"));
    assert_eq!(
        reason("cut.npy", b"\x93NUMPY\x01\x00\x40\x00{'descr'"),
        "the file ends inside its header"
    );
    let mut v9 = file("{}", &[]);
    v9[6] = 9;
    assert_eq!(
        reason("v9.npy", &v9),
        "format version 9.0; Kiln reads 1.0, 2.0 and 3.0"
    );
}
