//! The affine, rotation and perspective warps against torchvision's.

use super::*;
use kiln_data::{Transform, TransformRng};

#[test]
fn identity_warps_keep_the_image() -> Result<()> {
    let img = HostTensor::new(
        (0..3 * 7 * 9).map(|v| (v * 7 % 256) as u8).collect(),
        [3, 7, 9],
    )?;
    for mode in [Interpolation::Nearest, Interpolation::Bilinear] {
        let y = affine(&img, 0.0, (0.0, 0.0), 1.0, (0.0, 0.0), mode, None, None)?;
        assert_eq!(y.as_slice::<u8>()?, img.as_slice::<u8>()?);
        let y = rotate(&img, 360.0, mode, false, None, Some(&[0.0]))?;
        assert_eq!(y.as_slice::<u8>()?, img.as_slice::<u8>()?);
    }
    Ok(())
}

#[test]
fn quarter_turns_agree_with_the_grid() -> Result<()> {
    // A square image: the 90-degree fast path and a rotation about an
    // explicit centre (which takes the grid path) give the same pixels.
    let img = HostTensor::new((0..25).collect::<Vec<u8>>(), [1, 5, 5])?;
    let fast = rotate(&img, 90.0, Interpolation::Nearest, false, None, None)?;
    let grid = rotate(
        &img,
        90.0,
        Interpolation::Nearest,
        false,
        Some((2.5, 2.5)),
        None,
    )?;
    assert_eq!(fast.as_slice::<u8>()?, grid.as_slice::<u8>()?);
    Ok(())
}

#[test]
fn expand_holds_the_rotated_image() {
    let m = inverse_affine_matrix((0.0, 0.0), -90.0, (0.0, 0.0), 1.0, (0.0, 0.0));
    assert_eq!(expanded_size(&m, 30, 20), (20, 30));
    let m = inverse_affine_matrix((0.0, 0.0), -45.0, (0.0, 0.0), 1.0, (0.0, 0.0));
    let (w, h) = expanded_size(&m, 10, 10);
    assert_eq!((w, h), (16, 16));
}

#[test]
fn bad_arguments_name_themselves() {
    let img = HostTensor::zeros(kiln_core::DType::U8, [3, 6, 6]).expect("image");
    let err = affine(
        &img,
        0.0,
        (0.0, 0.0),
        0.0,
        (0.0, 0.0),
        Interpolation::Nearest,
        None,
        None,
    )
    .expect_err("scale 0");
    assert!(err.to_string().contains("`scale`"), "{err}");
    let err = rotate(
        &img,
        10.0,
        Interpolation::Nearest,
        false,
        None,
        Some(&[1.0, 2.0]),
    )
    .expect_err("two fills for three channels");
    assert!(err.to_string().contains("`fill`"), "{err}");
    let mut t = RandomAffine::new(10.0).expect("valid");
    t.translate = Some((1.5, 0.0));
    assert!(t
        .validate()
        .expect_err("translate")
        .to_string()
        .contains("`translate`"));
    t.translate = None;
    t.scale = Some((0.0, 1.0));
    assert!(t
        .validate()
        .expect_err("scale")
        .to_string()
        .contains("`scale`"));
    let bad = RandomPerspective {
        distortion_scale: 1.5,
        ..RandomPerspective::default()
    };
    assert!(bad
        .validate()
        .expect_err("d")
        .to_string()
        .contains("`distortion_scale`"));
    let line = [[0, 0], [1, 1], [2, 2], [3, 3]];
    assert!(perspective_coefficients(&line, &line).is_err());
    let mut rr = RandomRotation::new(30.0).expect("valid");
    rr.expand = true;
    let batch = HostTensor::zeros(kiln_core::DType::U8, [2, 3, 6, 6]).expect("batch");
    let err = rr
        .apply(batch.clone(), &mut TransformRng::new(0))
        .expect_err("expand on a batch");
    assert!(err.to_string().contains("`expand`"), "{err}");
    rr.expand = false;
    assert_eq!(
        rr.apply(batch, &mut TransformRng::new(0))
            .expect("batch")
            .dims(),
        &[2, 3, 6, 6]
    );
}
