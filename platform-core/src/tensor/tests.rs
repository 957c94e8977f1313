//! Unit tests of `tensor.rs`.

use super::*;

#[test]
fn new_checks_element_count() -> Result<()> {
    let t = HostTensor::new(vec![1i32, 2, 3, 4, 5, 6], [2, 3])?;
    assert_eq!(t.numel(), 6);
    assert_eq!(t.rank(), 2);
    assert_eq!(t.size_in_bytes(), 24);

    let err = HostTensor::new(vec![1.0f32; 5], [2, 3]).expect_err("5 != 6");
    match &err {
        Error::ElementCount {
            shape,
            expected,
            actual,
        } => {
            assert_eq!(shape, &Shape::from([2, 3]));
            assert_eq!((*expected, *actual), (6, 5));
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "shape [2, 3] holds 6 elements, but 5 were given"
    );
    Ok(())
}

#[test]
fn constructors_reject_overflowing_shapes() {
    let huge = [usize::MAX, 3];
    for err in [
        HostTensor::new(vec![0u8; 3], huge).expect_err("overflow"),
        HostTensor::zeros(DType::F32, huge).expect_err("overflow"),
        HostTensor::from_bytes(DType::U8, huge, &[0; 3]).expect_err("overflow"),
    ] {
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        assert!(err.to_string().contains("overflows"), "{err}");
    }
    // numel fits but the byte size does not
    let err = HostTensor::from_bytes(DType::F64, [usize::MAX / 4], &[]).expect_err("bytes");
    assert!(err.to_string().contains("byte size"), "{err}");
}

#[test]
fn from_slice_scalar_and_zeros() -> Result<()> {
    let t = HostTensor::from_slice(&[7u8, 8], [2, 1])?;
    assert_eq!(t.as_slice::<u8>()?, &[7, 8]);
    assert!(HostTensor::from_slice(&[7u8, 8], [3]).is_err());

    let s = HostTensor::scalar(-3i64);
    assert_eq!(s.dims(), &[] as &[usize]);
    assert_eq!(s.as_slice::<i64>()?, &[-3]);

    let z = HostTensor::zeros(DType::F64, [2, 2])?;
    assert_eq!(z.as_slice::<f64>()?, &[0.0; 4]);
    let z = HostTensor::zeros(DType::I32, [0, 5])?;
    assert_eq!(z.numel(), 0);
    assert_eq!(z.dtype(), DType::I32);
    Ok(())
}

#[test]
fn from_bytes_round_trips_and_checks_length() -> Result<()> {
    let t = HostTensor::new(vec![1.5f32, -2.0, 1e30], [3])?;
    let bytes = t.as_bytes().to_vec();
    assert_eq!(bytes.len(), 12);
    assert_eq!(&bytes[0..4], &1.5f32.to_ne_bytes());
    assert_eq!(HostTensor::from_bytes(DType::F32, [3], &bytes)?, t);

    let err = HostTensor::from_bytes(DType::F32, [2, 2], &bytes).expect_err("12 != 16");
    let msg = err.to_string();
    assert!(msg.contains("needs 16 bytes"), "{msg}");
    assert!(msg.contains("got 12"), "{msg}");
    assert!(msg.contains("[2, 2]") && msg.contains("float32"), "{msg}");
    Ok(())
}

#[test]
fn from_bytes_accepts_unaligned_input() -> Result<()> {
    let values = [1i64, -2, i64::MAX];
    let mut buf = vec![0xAAu8];
    for v in values {
        buf.extend_from_slice(&v.to_ne_bytes());
    }
    // Try every misalignment of the same payload.
    for pad in 0..8 {
        let mut shifted = vec![0u8; pad];
        shifted.extend_from_slice(&buf[1..]);
        let t = HostTensor::from_bytes(DType::I64, [3], &shifted[pad..])?;
        assert_eq!(t.as_slice::<i64>()?, &values);
    }
    let t = HostTensor::from_bytes(DType::F64, [1], &buf[1..9])?;
    assert_eq!(t.as_slice::<f64>()?, &[f64::from_bits(1)]);
    Ok(())
}

#[test]
fn typed_access_checks_dtype() -> Result<()> {
    let mut t = HostTensor::new(vec![1i64, 2, 3], [3])?;
    let err = t.as_slice::<f32>().expect_err("wrong dtype");
    assert_eq!(
        err.to_string(),
        "HostTensor::as_slice::<float32>: expected dtype float32, got int64"
    );
    assert!(matches!(
        t.as_mut_slice::<i32>(),
        Err(Error::DTypeMismatch {
            expected: DType::I32,
            actual: DType::I64,
            ..
        })
    ));
    t.as_mut_slice::<i64>()?[1] = 20;
    assert_eq!(t.as_slice::<i64>()?, &[1, 20, 3]);
    assert!(matches!(
        t.clone().into_vec::<u8>(),
        Err(Error::DTypeMismatch {
            expected: DType::U8,
            actual: DType::I64,
            ..
        })
    ));
    assert_eq!(t.into_vec::<i64>()?, vec![1, 20, 3]);
    Ok(())
}

#[test]
fn item_requires_one_element() -> Result<()> {
    assert_eq!(HostTensor::new(vec![4.0f32], [1, 1])?.item::<f32>()?, 4.0);
    let err = HostTensor::new(vec![1u8, 2], [2])?
        .item::<u8>()
        .expect_err("two elements");
    assert!(err.to_string().contains("[2] (2 elements)"), "{err}");
    Ok(())
}

#[test]
fn reshape_keeps_data_and_checks_count() -> Result<()> {
    let t = HostTensor::new((0..6).collect::<Vec<i32>>(), [2, 3])?;
    let r = t.clone().reshape([3, 2])?;
    assert_eq!(r.dims(), &[3, 2]);
    assert_eq!(r.as_slice::<i32>()?, t.as_slice::<i32>()?);
    let err = t.clone().reshape([4]).expect_err("6 != 4");
    assert_eq!(
        err.to_string(),
        "HostTensor::reshape of [2, 3]: expected shape with 6 elements, got [4] (4 elements)"
    );
    assert!(t.reshape([usize::MAX, 2]).is_err());
    Ok(())
}

#[test]
fn half_precision_casts_round_to_nearest_even() -> Result<()> {
    // bf16 keeps 8 bits of significand: 1 + 2^-8 is halfway between 1 and
    // 1 + 2^-7 and goes to the even one (1); 1 + 3 * 2^-8 goes to 1 + 2^-6.
    let f = HostTensor::new(
        vec![1.0f32 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), -2.5],
        [3],
    )?;
    let b = f.to_dtype(DType::BF16);
    assert_eq!(b.dtype(), DType::BF16);
    assert_eq!(b.to_f64_vec(), vec![1.0, 1.015625, -2.5]);
    assert_eq!(b.as_bytes().len(), 6);
    // f16 overflows past 65504 (to infinity) where bf16 keeps f32's range.
    let big = HostTensor::new(vec![70000.0f32, 1e-8], [2])?;
    assert_eq!(big.to_dtype(DType::F16).to_f64_vec()[0], f64::INFINITY);
    assert_eq!(big.to_dtype(DType::BF16).to_f64_vec()[0], 70144.0);
    // Back to integers through the exact value.
    let i = b.to_dtype(DType::I64);
    assert_eq!(i.as_slice::<i64>()?, &[1, 1, -2]);
    Ok(())
}

#[test]
fn to_dtype_casts_like_as() -> Result<()> {
    let f = HostTensor::new(vec![-1.7f32, 2.9, 300.0, f32::NAN], [4])?;
    assert_eq!(f.to_dtype(DType::I64).as_slice::<i64>()?, &[-1, 2, 300, 0]);
    // saturating float -> u8
    assert_eq!(f.to_dtype(DType::U8).as_slice::<u8>()?, &[0, 2, 255, 0]);

    let i = HostTensor::new(vec![-1i64, 257, 3], [3])?;
    // wrapping integer narrowing
    assert_eq!(i.to_dtype(DType::U8).as_slice::<u8>()?, &[255, 1, 3]);
    assert_eq!(
        i.to_dtype(DType::F32).as_slice::<f32>()?,
        &[-1.0, 257.0, 3.0]
    );
    let same = i.to_dtype(DType::I64);
    assert_eq!(same, i);

    let u = HostTensor::new(vec![200u8], [1])?;
    assert_eq!(u.to_dtype(DType::I32).as_slice::<i32>()?, &[200]);
    assert_eq!(u.to_f64_vec(), vec![200.0]);
    assert_eq!(
        HostTensor::new(vec![0.5f64, -4.0], [2])?.to_f64_vec(),
        vec![0.5, -4.0]
    );
    Ok(())
}

#[test]
fn allclose_semantics() -> Result<()> {
    let a = HostTensor::new(vec![1.0f64, 100.0, f64::INFINITY], [3])?;
    let b = HostTensor::new(vec![1.05f64, 101.0, f64::INFINITY], [3])?;
    // |1 - 1.05| = 0.05 <= 0.01 + 0.05 * 1.05; |100 - 101| = 1 <= 0.01 + 0.05 * 101
    assert!(a.allclose(&b, 0.05, 0.01));
    assert!(!a.allclose(&b, 0.0, 0.04));
    let nan = HostTensor::new(vec![f64::NAN], [1])?;
    assert!(!nan.allclose(&nan, 1.0, 1.0));
    // shape or dtype mismatch is never close
    let reshaped = a.clone().reshape([3, 1])?;
    assert!(!a.allclose(&reshaped, 1.0, 1.0));
    assert!(!a.allclose(&a.to_dtype(DType::F32), 1.0, 1.0));
    Ok(())
}

#[test]
fn stack_and_select_rows() -> Result<()> {
    let a = HostTensor::new(vec![1.0f32, 2.0], [2])?;
    let b = HostTensor::new(vec![3.0f32, 4.0], [2])?;
    let s = HostTensor::stack(&[a.clone(), b.clone(), a.clone()])?;
    assert_eq!(s.dims(), &[3, 2]);
    assert_eq!(s.as_slice::<f32>()?, &[1.0, 2.0, 3.0, 4.0, 1.0, 2.0]);

    let scalars = [HostTensor::scalar(5i64), HostTensor::scalar(6i64)];
    let s2 = HostTensor::stack(&scalars)?;
    assert_eq!(s2.dims(), &[2]);
    assert_eq!(s2.as_slice::<i64>()?, &[5, 6]);

    assert!(HostTensor::stack(&[]).is_err());
    let err = HostTensor::stack(&[a.clone(), a.to_dtype(DType::F64)]).expect_err("dtype");
    assert!(err.to_string().contains("tensor 1"), "{err}");
    let c = HostTensor::new(vec![1.0f32, 2.0, 3.0], [3])?;
    let err = HostTensor::stack(&[a, c]).expect_err("shape");
    assert_eq!(
        err.to_string(),
        "HostTensor::stack: tensor 1: expected shape [2], got [3]"
    );

    let picked = s.select_rows(&[1, 1, 0])?;
    assert_eq!(picked.as_slice::<f32>()?, &[3.0, 4.0, 3.0, 4.0, 1.0, 2.0]);
    assert_eq!(s.select_rows(&[])?.dims(), &[0, 2]);
    let err = s.select_rows(&[0, 3]).expect_err("out of range");
    assert!(err
        .to_string()
        .contains("row 3 is out of range for shape [3, 2]"));
    assert!(HostTensor::scalar(1u8).select_rows(&[0]).is_err());

    let r = s.row(1)?;
    assert_eq!(r.dims(), &[2]);
    assert_eq!(r.as_slice::<f32>()?, &[3.0, 4.0]);
    let r = s2.row(0)?;
    assert_eq!(r, HostTensor::scalar(5i64));
    Ok(())
}

#[test]
fn debug_shows_at_most_eight_values() -> Result<()> {
    let t = HostTensor::new((0..100).collect::<Vec<i32>>(), [10, 10])?;
    let s = format!("{t:?}");
    assert_eq!(
        s,
        "HostTensor { shape: [10, 10], dtype: int32, data: [0, 1, 2, 3, 4, 5, 6, 7, ... (100 values)] }"
    );
    let small = HostTensor::new(vec![0.5f32, 1.0], [2])?;
    assert_eq!(
        format!("{small:?}"),
        "HostTensor { shape: [2], dtype: float32, data: [0.5, 1.0] }"
    );
    Ok(())
}

#[test]
fn equality_compares_shape_dtype_and_values() -> Result<()> {
    let a = HostTensor::new(vec![1i32, 2], [2])?;
    assert_eq!(a, HostTensor::new(vec![1i32, 2], [2])?);
    assert_ne!(a, HostTensor::new(vec![1i32, 2], [1, 2])?);
    assert_ne!(a, HostTensor::new(vec![1i64, 2], [2])?);
    assert_ne!(a, HostTensor::new(vec![1i32, 3], [2])?);
    Ok(())
}
