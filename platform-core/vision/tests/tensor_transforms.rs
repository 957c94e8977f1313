//! Transforms: Normalize against torchvision's formula computed by PyTorch,
//! crops and flips against hand-built images.

use std::sync::Arc;

use kiln_core::{DType, Error, HostTensor, Result};
use kiln_data::{
    Batch, Compose, DataLoader, InMemoryDataset, PrefetchLoader, Transform, TransformRng,
    TransformedDataset,
};
use kiln_vision::{Normalize, RandomCrop, RandomHorizontalFlip, ToFloat};

#[test]
fn normalize_matches_torchvision() -> Result<()> {
    let Some(python) = kiln_testkit::python("normalize_matches_torchvision") else {
        return Ok(());
    };
    let out = kiln_testkit::run_reference_script!(&python, "data_normalize.py", &[] as &[&str]);
    let reference: serde_json::Value = serde_json::from_str(&out).expect("JSON from the script");
    let cases = reference["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 5);
    let floats = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_f64().expect("number"))
            .collect()
    };
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let dims: Vec<usize> = floats(&case["shape"]).iter().map(|&d| d as usize).collect();
        let input = floats(&case["input"]);
        let expected = floats(&case["output"]);
        let normalize = Normalize {
            mean: floats(&case["mean"]),
            std: floats(&case["std"]),
        };
        let x = match case["dtype"].as_str() {
            Some("float32") => HostTensor::new(
                input.iter().map(|&v| v as f32).collect::<Vec<_>>(),
                dims.clone(),
            )?,
            Some("float64") => HostTensor::new(input, dims.clone())?,
            other => panic!("{name}: unexpected dtype {other:?}"),
        };
        let dtype = x.dtype();
        let y = normalize.apply(x, &mut TransformRng::new(0))?;
        assert_eq!(y.dims(), dims.as_slice(), "{name}");
        assert_eq!(y.dtype(), dtype, "{name}");
        let got = y.to_f64_vec();
        assert_eq!(got.len(), expected.len(), "{name}");
        // The same IEEE operations in the same precision as PyTorch,
        // (x - m) / s, so the results agree exactly.
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "{name}[{i}]");
        }
    }
    Ok(())
}

/// The 3x3 image 1..=9 with one zero of padding on each side:
///
/// ```text
/// 0 0 0 0 0
/// 0 1 2 3 0
/// 0 4 5 6 0
/// 0 7 8 9 0
/// 0 0 0 0 0
/// ```
///
/// so the 3x3 crop at corner (top, left) of the padded image is `CROPS[top][left]`.
const CROPS: [[[i64; 9]; 3]; 3] = [
    [
        [0, 0, 0, 0, 1, 2, 0, 4, 5],
        [0, 0, 0, 1, 2, 3, 4, 5, 6],
        [0, 0, 0, 2, 3, 0, 5, 6, 0],
    ],
    [
        [0, 1, 2, 0, 4, 5, 0, 7, 8],
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [2, 3, 0, 5, 6, 0, 8, 9, 0],
    ],
    [
        [0, 4, 5, 0, 7, 8, 0, 0, 0],
        [4, 5, 6, 7, 8, 9, 0, 0, 0],
        [5, 6, 0, 8, 9, 0, 0, 0, 0],
    ],
];

fn one_to_nine() -> Result<HostTensor> {
    HostTensor::new((1..=9).collect::<Vec<i64>>(), [1, 3, 3])
}

#[test]
fn random_crop_picks_each_padded_window() -> Result<()> {
    let crop = RandomCrop {
        size: [3, 3],
        padding: 1,
    };
    let mut seen = [[false; 3]; 3];
    for seed in 0..200 {
        let y = crop.apply(one_to_nine()?, &mut TransformRng::new(seed))?;
        assert_eq!(y.dims(), &[1, 3, 3]);
        // the corner is drawn row first, then column, uniformly over 0..3
        let mut rng = TransformRng::new(seed);
        let (top, left) = (rng.below(3) as usize, rng.below(3) as usize);
        assert_eq!(y.as_slice::<i64>()?, &CROPS[top][left], "seed {seed}");
        seen[top][left] = true;
    }
    assert_eq!(seen, [[true; 3]; 3], "every window is drawn for some seed");
    Ok(())
}

#[test]
fn random_crop_without_padding_and_multichannel() -> Result<()> {
    // 2 channels of 2x3: [[1,2,3],[4,5,6]] and [[10,20,30],[40,50,60]] (u8)
    let x = HostTensor::new(vec![1u8, 2, 3, 4, 5, 6, 10, 20, 30, 40, 50, 60], [2, 2, 3])?;
    let crop = RandomCrop {
        size: [2, 2],
        padding: 0,
    };
    let mut lefts = Vec::new();
    for seed in 0..40 {
        let y = crop.apply(x.clone(), &mut TransformRng::new(seed))?;
        assert_eq!(y.dims(), &[2, 2, 2]);
        assert_eq!(y.dtype(), DType::U8);
        // Only the column can vary; both channels get the same window.
        let v = y.as_slice::<u8>()?;
        let expected: &[u8] = if v[0] == 1 {
            lefts.push(0);
            &[1, 2, 4, 5, 10, 20, 40, 50]
        } else {
            lefts.push(1);
            &[2, 3, 5, 6, 20, 30, 50, 60]
        };
        assert_eq!(v, expected, "seed {seed}");
    }
    assert!(lefts.contains(&0) && lefts.contains(&1));
    // a crop of the full size without padding is the identity
    let same = RandomCrop {
        size: [2, 3],
        padding: 0,
    }
    .apply(x.clone(), &mut TransformRng::new(1))?;
    assert_eq!(same, x);
    Ok(())
}

#[test]
fn random_crop_draws_per_image_in_a_batch() -> Result<()> {
    // 8 copies of the 1..9 image as f32 [8, 1, 3, 3]
    let data: Vec<f32> = (0..8).flat_map(|_| (1..=9).map(|v| v as f32)).collect();
    let x = HostTensor::new(data, [8, 1, 3, 3])?;
    let crop = RandomCrop {
        size: [3, 3],
        padding: 1,
    };
    let y = crop.apply(x, &mut TransformRng::new(42))?;
    assert_eq!(y.dims(), &[8, 1, 3, 3]);
    let mut rng = TransformRng::new(42);
    let mut distinct = Vec::new();
    for image in y.as_slice::<f32>()?.chunks(9) {
        let (top, left) = (rng.below(3) as usize, rng.below(3) as usize);
        let expected: Vec<f32> = CROPS[top][left].iter().map(|&v| v as f32).collect();
        assert_eq!(image, expected.as_slice());
        if !distinct.contains(&(top, left)) {
            distinct.push((top, left));
        }
    }
    assert!(distinct.len() >= 3, "{distinct:?}");
    Ok(())
}

#[test]
fn random_crop_errors() -> Result<()> {
    let too_big = RandomCrop {
        size: [4, 2],
        padding: 0,
    };
    let err = too_big
        .apply(one_to_nine()?, &mut TransformRng::new(0))
        .expect_err("4 > 3");
    assert_eq!(
        err.to_string(),
        "invalid argument `size`: RandomCrop of [4, 2] does not fit images of [3, 3] padded by 0 \
         to [3, 3]"
    );
    let err = RandomCrop {
        size: [2, 2],
        padding: 0,
    }
    .apply(
        HostTensor::zeros(DType::F32, [3, 3])?,
        &mut TransformRng::new(0),
    )
    .expect_err("rank 2");
    assert_eq!(
        err.to_string(),
        "RandomCrop: expected shape [C, H, W] or [N, C, H, W], got [3, 3]"
    );
    Ok(())
}

#[test]
fn horizontal_flip_mirrors_rows() -> Result<()> {
    // 2 channels of 2x3
    let x = HostTensor::new((1..=12).collect::<Vec<i32>>(), [2, 2, 3])?;
    let always = RandomHorizontalFlip { p: 1.0 };
    let y = always.apply(x.clone(), &mut TransformRng::new(0))?;
    assert_eq!(
        y.as_slice::<i32>()?,
        &[3, 2, 1, 6, 5, 4, 9, 8, 7, 12, 11, 10]
    );
    let never = RandomHorizontalFlip { p: 0.0 };
    assert_eq!(never.apply(x.clone(), &mut TransformRng::new(0))?, x);

    // p = 0.5 on a batch of 64 copies of [1, 2]: flip iff the draw is below 0.5
    let batch = HostTensor::new(
        (0..64).flat_map(|_| [1u8, 2]).collect::<Vec<_>>(),
        [64, 1, 1, 2],
    )?;
    let y = RandomHorizontalFlip::default().apply(batch, &mut TransformRng::new(5))?;
    let mut rng = TransformRng::new(5);
    let mut flipped = 0;
    for pair in y.as_slice::<u8>()?.chunks(2) {
        if rng.next_f64() < 0.5 {
            assert_eq!(pair, &[2, 1]);
            flipped += 1;
        } else {
            assert_eq!(pair, &[1, 2]);
        }
    }
    assert!((16..=48).contains(&flipped), "{flipped} of 64 flipped");

    let err = RandomHorizontalFlip { p: 1.5 }
        .apply(x, &mut TransformRng::new(0))
        .expect_err("p > 1");
    assert!(matches!(err, Error::InvalidArgument { ref name, .. } if name == "p"));
    Ok(())
}

#[test]
fn to_float_then_normalize_like_torchvision_mnist() -> Result<()> {
    // ToTensor then Normalize((0.1307,), (0.3081,)) on pixels 0, 255
    let x = HostTensor::new(vec![0u8, 255], [1, 1, 2])?;
    let mut rng = TransformRng::new(0);
    let y = Normalize {
        mean: vec![0.1307],
        std: vec![0.3081],
    }
    .apply(ToFloat.apply(x, &mut rng)?, &mut rng)?;
    let expected = [
        (0.0f32 - 0.1307f32) / 0.3081f32,
        (1.0f32 - 0.1307f32) / 0.3081f32,
    ];
    let got = y.as_slice::<f32>()?;
    assert_eq!(got, &expected);
    // MNIST's normalised range as torchvision users know it, about -0.4242 and
    // 2.8215: the values Kiln gave, not only the formula above, land there.
    assert!((f64::from(got[0]) + 0.424_212_9).abs() < 1e-6, "{got:?}");
    assert!((f64::from(got[1]) - 2.821_486_5).abs() < 1e-6, "{got:?}");
    Ok(())
}

fn collect(loader: &impl DataLoader, epoch: u64) -> Result<Vec<Batch>> {
    loader.batches(epoch).collect()
}

#[test]
fn seeded_transforms_reproduce_across_worker_counts() -> Result<()> {
    // 12 images 1x4x4 holding 16 i + pixel.
    let n = 12;
    let x: Vec<f32> = (0..n * 16).map(|v| v as f32).collect();
    let y: Vec<i64> = (0..n as i64).collect();
    let base = Arc::new(InMemoryDataset::new(
        HostTensor::new(x, [n, 1, 4, 4])?,
        HostTensor::new(y, [n])?,
    )?);
    let augment = || {
        Compose::new()
            .then(RandomCrop {
                size: [3, 3],
                padding: 1,
            })
            .then(RandomHorizontalFlip { p: 0.5 })
    };
    let loader = |workers| -> Result<_> {
        let ds = TransformedDataset::new(Arc::clone(&base), augment(), 99);
        Ok(PrefetchLoader::new(ds, 5)?.shuffle(3).num_workers(workers))
    };
    let a = collect(&loader(0)?, 2)?;
    assert_eq!(a[0].inputs.dims(), &[5, 1, 3, 3]);
    assert_eq!(collect(&loader(3)?, 2)?, a);
    assert_eq!(collect(&loader(1)?, 2)?, a);
    // another epoch draws other crops and flips for the same samples
    let b = collect(&loader(3)?, 3)?;
    let by_sample = |batches: &[Batch]| -> Vec<(i64, Vec<f32>)> {
        let mut rows: Vec<(i64, Vec<f32>)> = batches
            .iter()
            .flat_map(|batch| {
                let t = batch.targets.as_slice::<i64>().expect("i64").to_vec();
                let x = batch.inputs.as_slice::<f32>().expect("f32").to_vec();
                t.into_iter()
                    .zip(x.chunks(9).map(<[f32]>::to_vec).collect::<Vec<_>>())
            })
            .collect();
        rows.sort_by_key(|r| r.0);
        rows
    };
    let (ea, eb) = (by_sample(&a), by_sample(&b));
    let differing = ea.iter().zip(&eb).filter(|(p, q)| p.1 != q.1).count();
    assert!(differing >= 6, "only {differing} of 12 samples changed");
    Ok(())
}
