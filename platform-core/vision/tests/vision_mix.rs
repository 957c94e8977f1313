//! MixUp and CutMix against torchvision 0.26's `transforms.v2.MixUp` and
//! `CutMix` with the same drawn parameters (`tests/reference/vision_mix.py`),
//! and `BatchTransformed`'s seeding: the same batches on every pass and from
//! any batch on.

use std::path::Path;
use std::sync::Arc;

use kiln_core::{DType, HostTensor, Result};
use kiln_data::{Batch, DataLoader, InMemoryDataset, PrefetchLoader, TransformRng};
use kiln_vision::transforms::{BatchTransform, BatchTransformed, CutMix, MixUp, MixUpOrCutMix};
use serde_json::json;

fn batch(n: usize, c: usize, h: usize, w: usize, dtype: DType, seed: u64) -> Batch {
    let noise = kiln_testkit::noise(n * c * h * w, seed);
    let inputs = match dtype {
        DType::U8 => HostTensor::new(
            noise
                .iter()
                .map(|v| ((v + 1.0) * 127.0) as u8)
                .collect::<Vec<u8>>(),
            [n, c, h, w],
        ),
        _ => HostTensor::new(noise, [n, c, h, w]),
    }
    .expect("inputs");
    let labels: Vec<i64> = (0..n as i64).map(|i| (i * 3 + seed as i64) % 5).collect();
    Batch {
        inputs,
        targets: HostTensor::new(labels, [n]).expect("labels"),
    }
}

#[test]
fn mixup_and_cutmix_equal_torchvisions_with_the_same_draws() -> Result<()> {
    let Some(python) = kiln_testkit::python("mixup_and_cutmix_equal_torchvisions") else {
        return Ok(());
    };
    let dir = kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "vision-mix");
    let mut cases = Vec::new();
    let mut ours = Vec::new();
    let inputs = [
        ("f32", batch(4, 3, 9, 11, DType::F32, 1)),
        ("u8", batch(3, 3, 8, 13, DType::U8, 2)),
        ("one", batch(1, 1, 5, 6, DType::F32, 3)),
    ];
    for (input, b) in &inputs {
        std::fs::write(dir.join(format!("{input}.bin")), b.inputs.as_bytes()).expect("write");
        let labels = b.targets.as_slice::<i64>()?.to_vec();
        let dtype = if b.inputs.dtype() == DType::U8 {
            "uint8"
        } else {
            "float32"
        };
        let (h, w) = (b.inputs.dims()[2], b.inputs.dims()[3]);
        for seed in 0..4u64 {
            let mut rng = TransformRng::new(seed);
            let cutmix = CutMix::new([0.5, 1.0, 2.0, 0.2][seed as usize], 5)?;
            let cut = cutmix.get_params(h, w, &mut rng);
            let name = format!("{input}-cutmix{seed}");
            cases.push(
                json!({"name": name, "input": input, "shape": b.inputs.dims(),
                "dtype": dtype, "labels": labels, "num_classes": 5, "op": "cutmix",
                "box": [cut.x1, cut.y1, cut.x2, cut.y2], "lam": cut.lam}),
            );
            ours.push((name, cutmix.apply_params(b.clone(), cut)?));
            if b.inputs.dtype() == DType::F32 {
                let mixup = MixUp::new([0.2, 1.0, 0.8, 3.0][seed as usize], 5)?;
                let lam = mixup.get_params(&mut rng);
                let name = format!("{input}-mixup{seed}");
                cases.push(
                    json!({"name": name, "input": input, "shape": b.inputs.dims(),
                    "dtype": dtype, "labels": labels, "num_classes": 5, "op": "mixup",
                    "lam": lam}),
                );
                ours.push((name, mixup.apply_params(b.clone(), lam)?));
            }
        }
    }
    std::fs::write(
        dir.join("cases.json"),
        serde_json::to_string(&cases).expect("json"),
    )
    .expect("write cases");
    let dir_arg = dir.to_str().expect("utf-8").to_string();
    kiln_testkit::run_reference_script!(&python, "vision_mix.py", &[dir_arg]);
    for (name, got) in &ours {
        let out = std::fs::read(dir.join(format!("{name}.out"))).expect("reference output");
        assert!(
            got.inputs.as_bytes() == out.as_slice(),
            "{name}: images differ"
        );
        let labels = std::fs::read(dir.join(format!("{name}.labels"))).expect("labels");
        assert_eq!(got.targets.dims()[1], 5);
        assert!(
            got.targets.as_bytes() == labels.as_slice(),
            "{name}: targets differ"
        );
    }
    eprintln!(
        "{} MixUp and CutMix cases equal torchvision's bit for bit",
        ours.len()
    );
    Ok(())
}

#[test]
fn mixed_batches_are_seeded_per_batch_and_resume_alike() -> Result<()> {
    let n = 10;
    let x = HostTensor::new(kiln_testkit::noise(n * 3 * 4 * 4, 5), [n, 3, 4, 4])?;
    let y = HostTensor::new((0..n as i64).map(|i| i % 3).collect::<Vec<_>>(), [n])?;
    let loader = PrefetchLoader::new(InMemoryDataset::new(x, y)?, 4)?.shuffle(1);
    let both = MixUpOrCutMix {
        mixup: MixUp::new(0.4, 3)?,
        cutmix: CutMix::new(1.0, 3)?,
    };
    let mixed = BatchTransformed::new(loader, Arc::new(both.clone()), 9);
    let epoch: Vec<Batch> = mixed.batches(2).collect::<Result<_>>()?;
    assert_eq!(epoch.len(), 3);
    for b in &epoch {
        assert_eq!(b.targets.dtype(), DType::F32);
        // Each row of targets is a distribution.
        for row in b.targets.as_slice::<f32>()?.chunks(3) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6, "{row:?}");
        }
    }
    let again: Vec<Batch> = mixed.batches(2).collect::<Result<_>>()?;
    assert!(epoch == again, "the same epoch twice");
    let resumed: Vec<Batch> = mixed.batches_from(2, 1).collect::<Result<_>>()?;
    assert!(resumed[..] == epoch[1..], "resumed from batch 1");
    let other: Vec<Batch> = mixed.batches(3).collect::<Result<_>>()?;
    assert!(other != epoch, "another epoch mixes differently");
    // One of the two per batch, with equal chances: CutMix only moves pixels
    // (0 and 1 here), MixUp blends them.
    let mut cut = 0;
    for i in 0..400 {
        let mut rng = TransformRng::for_sample(1, 0, i);
        let mut pixels = vec![0.0f32; 64];
        pixels.extend([1.0f32; 64]);
        let b = Batch {
            inputs: HostTensor::new(pixels, [2, 1, 8, 8])?,
            targets: HostTensor::new(vec![0i64, 1], [2])?,
        };
        let out = both.apply(b, &mut rng)?;
        let moved_only = out
            .inputs
            .as_slice::<f32>()?
            .iter()
            .all(|&v| v == 0.0 || v == 1.0);
        cut += usize::from(moved_only);
    }
    assert!(
        (150..250).contains(&cut),
        "{cut} of 400 batches took CutMix"
    );
    Ok(())
}
