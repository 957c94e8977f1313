//! Images: decoding against Pillow, `ImageFolder` against torchvision's,
//! WebDataset shards (coverage, worker counts, resume) and the typed errors
//! for corrupt files. The fixtures come from tests/reference/data_image.py,
//! run once per test binary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use kiln_core::{Error, HostTensor, Result};
use kiln_data::{Batch, DataLoader, Dataset, EpochOrder, PrefetchLoader, TransformedDataset};
use kiln_vision::{
    decode_image, ColorMode, ImageFolder, OnError, RandomHorizontalFlip, WebDataset,
};
use serde_json::Value;

extern "C" {
    /// `csrc/jpeg_simd.c`: 0 keeps libjpeg-turbo's plain C kernels.
    fn kiln_jpeg_simd_set_enabled(enabled: std::ffi::c_int);
}

/// The fixtures' description, or `None` (skipped) without the virtualenv.
fn fixtures(test: &str) -> Option<&'static Value> {
    static FIXTURES: OnceLock<Option<Value>> = OnceLock::new();
    FIXTURES
        .get_or_init(|| {
            let python = kiln_testkit::python(test)?;
            let dir = kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "images");
            let out = kiln_testkit::run_reference_script!(&python, "data_image.py", &[&dir]);
            Some(serde_json::from_str(&out).expect("JSON from data_image.py"))
        })
        .as_ref()
}

fn path_of(v: &Value) -> PathBuf {
    PathBuf::from(v.as_str().expect("a path string"))
}

fn shard_paths(fx: &Value) -> Vec<PathBuf> {
    fx["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|s| path_of(&s["path"]))
        .collect()
}

fn labels_of(batches: &[Batch]) -> Vec<i64> {
    batches
        .iter()
        .flat_map(|b| b.targets.as_slice::<i64>().expect("i64 labels").to_vec())
        .collect()
}

#[test]
fn class_mapping_and_samples_equal_torchvisions_image_folder() -> Result<()> {
    let Some(fx) = fixtures("class_mapping_and_samples_equal_torchvisions_image_folder") else {
        return Ok(());
    };
    let folder = ImageFolder::new(path_of(&fx["folder"]["root"]))?;
    let expected: BTreeMap<String, i64> =
        serde_json::from_value(fx["folder"]["class_to_idx"].clone()).expect("class_to_idx");
    assert_eq!(folder.class_to_idx(), &expected);
    let mut classes: Vec<(&String, &i64)> = expected.iter().collect();
    classes.sort_by_key(|(_, &i)| i);
    let names: Vec<&String> = classes.into_iter().map(|(c, _)| c).collect();
    assert_eq!(folder.classes().iter().collect::<Vec<_>>(), names);
    let samples: Vec<(PathBuf, i64)> = fx["folder"]["samples"]
        .as_array()
        .expect("samples")
        .iter()
        .map(|s| (path_of(&s[0]), s[1].as_i64().expect("label")))
        .collect();
    assert_eq!(folder.samples(), samples.as_slice());

    // Every sample decodes to 3 channels, with its label.
    assert_eq!(folder.len(), samples.len());
    for (i, (path, expected_label)) in samples.iter().enumerate() {
        let (image, label) = folder.get(i)?;
        assert_eq!(image.dims()[0], 3, "{}", path.display());
        assert_eq!(label.item::<i64>()?, *expected_label);
    }

    // The same samples from CSV and JSON lists, relative to the list's directory.
    let root = path_of(&fx["folder"]["root"]);
    let rel = |p: &Path| {
        p.strip_prefix(&root)
            .expect("under root")
            .display()
            .to_string()
    };
    let csv: String = std::iter::once("path,label\n".to_string())
        .chain(samples.iter().map(|(p, l)| format!("\"{}\",{l}\n", rel(p))))
        .collect();
    std::fs::write(root.join("list.csv"), csv).expect("write list.csv");
    let listed = ImageFolder::from_list(root.join("list.csv"))?;
    assert_eq!(listed.samples(), samples.as_slice());
    let json: Vec<Value> = samples
        .iter()
        .map(|(p, l)| serde_json::json!({"path": rel(p), "label": names[*l as usize].as_str()}))
        .collect();
    std::fs::write(root.join("list.json"), Value::Array(json).to_string()).expect("write json");
    let listed = ImageFolder::from_list(root.join("list.json"))?;
    assert_eq!(listed.samples(), samples.as_slice());
    assert_eq!(listed.class_to_idx(), &expected);
    Ok(())
}

#[test]
fn decoding_matches_pillow() -> Result<()> {
    let Some(fx) = fixtures("decoding_matches_pillow") else {
        return Ok(());
    };
    let mut per_format: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for case in fx["decode"].as_array().expect("cases") {
        let file = path_of(&case["file"]);
        let mode = match case["mode"].as_str() {
            Some("RGB") => ColorMode::Rgb,
            Some("L") => ColorMode::Gray,
            Some("RGBA") => ColorMode::Rgba,
            other => panic!("mode {other:?}"),
        };
        let shape: Vec<usize> = case["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim") as usize)
            .collect();
        let expected = std::fs::read(path_of(&case["expected"])).expect("expected pixels");
        let bytes = std::fs::read(&file).expect("image");
        let image = decode_image(&bytes, mode, &file)?;
        let what = format!("{} as {:?}", file.display(), mode);
        assert_eq!(image.dims(), shape.as_slice(), "{what}");
        let got = image.as_slice::<u8>()?;
        let differing = got.iter().zip(&expected).filter(|(g, e)| g != e).count();
        let largest = got
            .iter()
            .zip(&expected)
            .map(|(g, e)| g.abs_diff(*e))
            .max()
            .unwrap_or(0);
        if case["damaged"].as_bool() == Some(true) {
            // Corrupt entropy-coded data: both decoders warn and go on, and
            // may resynchronise differently inside the damaged blocks (how
            // the data reaches libjpeg differs: Pillow feeds it in chunks).
            eprintln!("  {what}: {differing} values differ, by up to {largest}");
            assert!(
                differing * 50 < got.len(),
                "{what}: {differing} of {} values differ",
                got.len()
            );
            continue;
        }
        assert!(
            differing == 0,
            "{what}: {differing} of {} values differ from Pillow's, by up to {largest}",
            got.len()
        );
        let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("");
        let count = per_format.entry(ext.to_string()).or_insert((0, 0));
        count.0 += 1;
        count.1 += got.len();
    }
    for (ext, (decodes, values)) in &per_format {
        eprintln!("{ext}: {decodes} decodes ({values} values) equal Pillow's bit for bit");
    }
    // The same JPEGs through libjpeg-turbo's plain C IDCT, upsampling and
    // colour conversion: Kiln's AVX2 replacements change no byte.
    // SAFETY: `kiln_jpeg_simd_set_enabled` (csrc/jpeg_simd.c) only stores a
    // flag, atomically; the other tests' decodes give the same bytes either way.
    unsafe { kiln_jpeg_simd_set_enabled(0) };
    let mut plain = 0;
    for case in fx["decode"].as_array().expect("cases") {
        let file = path_of(&case["file"]);
        if file.extension().is_none_or(|e| e != "jpg") || case["mode"] != "RGB" {
            continue;
        }
        let bytes = std::fs::read(&file).expect("image");
        let with = std::fs::read(path_of(&case["expected"])).expect("expected");
        let without = decode_image(&bytes, ColorMode::Rgb, &file)?;
        if case["damaged"].as_bool() != Some(true) {
            assert!(without.as_bytes() == with.as_slice(), "{}", file.display());
        }
        plain += 1;
    }
    // SAFETY: as above.
    unsafe { kiln_jpeg_simd_set_enabled(1) };
    eprintln!("jpg: {plain} decodes without the AVX2 kernels equal too");
    for ext in ["jpg", "png", "webp", "bmp", "tif", "gif", "ppm", "pgm"] {
        assert!(per_format.contains_key(ext), "the corpus has {ext} files");
    }
    assert!(
        per_format["jpg"].0 >= 30,
        "the corpus has the JPEG kinds it should"
    );
    Ok(())
}

#[test]
fn truncated_and_corrupt_images_are_errors_naming_the_file() -> Result<()> {
    let Some(fx) = fixtures("truncated_and_corrupt_images_are_errors_naming_the_file") else {
        return Ok(());
    };
    let decode_dir = path_of(&fx["decode"][0]["file"])
        .parent()
        .expect("decode/")
        .to_path_buf();
    let name = Path::new("broken/cut.jpg");
    let expect_error = |bytes: &[u8], needle: &str, what: &str| {
        let err = decode_image(bytes, ColorMode::Rgb, name).expect_err(what);
        assert!(matches!(err, Error::Data { .. }), "{what}: {err:?}");
        let text = err.to_string();
        assert!(
            text.contains("broken/cut.jpg") && text.contains(needle),
            "{what}: {text}"
        );
    };
    for file in [
        "photo_375x500.jpg",
        "progressive.jpg",
        "cmyk_progressive.jpg",
    ] {
        let whole = std::fs::read(decode_dir.join(file)).expect("fixture");
        for cut in [3, 20, 160, whole.len() / 2, whole.len() - 2] {
            expect_error(
                &whole[..cut],
                "truncated JPEG",
                &format!("{file} cut at {cut}"),
            );
        }
    }
    // The other formats, cut short: errors naming the file and the format.
    for (file, format) in [
        ("photo.webp", "WebP"),
        ("lossless_alpha.webp", "WebP"),
        ("rgb24.bmp", "BMP"),
        ("bits1.bmp", "BMP"),
        ("lzw.tif", "TIFF"),
        ("raw.tif", "TIFF"),
        ("palette.gif", "GIF"),
        ("colour.ppm", "PNM"),
    ] {
        let whole = std::fs::read(decode_dir.join(file)).expect("fixture");
        // A GIF's last bytes are its trailer, after the complete image.
        let last = if format == "GIF" {
            whole.len() / 2
        } else {
            whole.len() - 3
        };
        for cut in [12, whole.len() / 2, last] {
            let what = format!("{file} cut at {cut}");
            let err = decode_image(&whole[..cut], ColorMode::Rgb, name).expect_err(&what);
            assert!(matches!(err, Error::Data { .. }), "{what}: {err:?}");
            let text = err.to_string();
            assert!(
                text.contains("broken/cut.jpg") && text.contains(format),
                "{what}: {text}"
            );
        }
    }
    // A palette TIFF, which Kiln does not decode.
    let palette = std::fs::read(decode_dir.join("palette.tif.unsupported")).expect("fixture");
    let err = decode_image(&palette, ColorMode::Rgb, name).expect_err("palette TIFF");
    assert!(
        err.to_string().contains("RGBPalette") && err.to_string().contains("not supported"),
        "{err}"
    );
    // A frame header of 2 components (Pillow: "cannot handle 2-layer images").
    let mut two = std::fs::read(decode_dir.join("q75_420.jpg")).expect("fixture");
    let sof = two
        .windows(2)
        .position(|w| w == [0xFF, 0xC0])
        .expect("a baseline frame header");
    two[sof + 9] = 2;
    expect_error(&two, "JPEG", "2 components");
    // A frame header of zero width.
    let mut zero = std::fs::read(decode_dir.join("q75_420.jpg")).expect("fixture");
    zero[sof + 7] = 0;
    zero[sof + 8] = 0;
    expect_error(&zero, "corrupt JPEG", "zero width");
    Ok(())
}

#[test]
fn empty_class_folders_and_missing_classes_are_errors_naming_them() -> Result<()> {
    let Some(fx) = fixtures("empty_class_folders_and_missing_classes_are_errors_naming_them")
    else {
        return Ok(());
    };
    let root = path_of(&fx["empty"]["root"]);
    let err = ImageFolder::new(&root).expect_err("the class `hollow` has no image");
    assert!(matches!(err, Error::Data { .. }), "{err:?}");
    let text = err.to_string();
    let torchvision = fx["empty"]["error"]
        .as_str()
        .expect("torchvision's message");
    assert!(
        text.contains(root.to_str().expect("utf-8"))
            && text.to_lowercase().contains(&torchvision.to_lowercase()),
        "{text}\nvs torchvision: {torchvision}"
    );
    let err = ImageFolder::new(root.join("hollow")).expect_err("no class folder");
    assert!(err.to_string().contains("class folder"), "{err}");
    let err = ImageFolder::new(root.join("absent")).expect_err("no such folder");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    Ok(())
}

#[test]
fn a_corrupt_jpeg_fails_its_batch_or_is_skipped_and_counted() -> Result<()> {
    let Some(fx) = fixtures("a_corrupt_jpeg_fails_its_batch_or_is_skipped_and_counted") else {
        return Ok(());
    };
    let root = path_of(&fx["stack"]["root"]);
    let corrupt = root.join("a/1.jpg");
    for workers in [0, 2] {
        // Fail: the batch holding it is an error naming the file.
        let loader = ImageFolder::new(&root)?.loader(2)?.num_workers(workers);
        let results: Vec<Result<Batch>> = loader.batches(0).collect();
        assert!(
            results[0].is_err(),
            "{workers} workers: batch 0 holds a/1.jpg"
        );
        let err = results[0].as_ref().expect_err("error");
        assert!(matches!(err, Error::Data { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains(corrupt.to_str().expect("utf-8")) && text.contains("truncated JPEG"),
            "{text}"
        );
        assert_eq!(results.len(), 1, "the iterator ends after the error");

        // Skip: the batch comes without it, and it is counted.
        let loader = ImageFolder::new(&root)?
            .on_error(OnError::Skip)
            .loader(2)?
            .num_workers(workers);
        let batches: Vec<Batch> = loader.batches(0).collect::<Result<_>>()?;
        let sizes: Vec<usize> = batches.iter().map(|b| b.targets.numel()).collect();
        assert_eq!(sizes, [1, 2, 1], "{workers} workers");
        assert_eq!(labels_of(&batches), [0, 0, 1, 1]);
        assert_eq!(loader.skipped_samples(), 1);
        loader.batches(1).for_each(drop);
        assert_eq!(
            loader.skipped_samples(),
            1,
            "the same file met again in another epoch is counted once"
        );
    }

    // A batch made only of failing samples is an error even when skipping.
    let loader = PrefetchLoader::new(ImageFolder::new(&root)?, 1)?.skip_failed_samples(true);
    let results: Vec<Result<Batch>> = loader.batches(0).collect();
    let err = results[1].as_ref().expect_err("batch 1 is only a/1.jpg");
    assert!(
        err.to_string()
            .contains("every one of the batch's 1 samples"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_truncated_shard_is_an_error_naming_the_shard_and_member() -> Result<()> {
    let Some(fx) = fixtures("a_truncated_shard_is_an_error_naming_the_shard_and_member") else {
        return Ok(());
    };
    let truncated = path_of(&fx["truncated"]);
    let err = WebDataset::open(std::slice::from_ref(&truncated)).expect_err("truncated");
    assert!(matches!(err, Error::Data { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(truncated.to_str().expect("utf-8")) && text.contains("000000.jpg"),
        "{text}"
    );
    let missing = truncated.with_file_name("missing-{000..001}.tar");
    let err = WebDataset::from_pattern(missing.to_str().expect("utf-8")).expect_err("missing");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("missing-000.tar"), "{err}");
    Ok(())
}

#[test]
fn shards_index_every_sample_with_its_label() -> Result<()> {
    let Some(fx) = fixtures("shards_index_every_sample_with_its_label") else {
        return Ok(());
    };
    let shards = shard_paths(fx);
    let dir = shards[0].parent().expect("dir").to_str().expect("utf-8");
    let ds = WebDataset::from_pattern(&format!("{dir}/train-{{000000..000003}}.tar"))?;
    assert_eq!(ds.shards(), shards.as_slice());
    let mut index = 0;
    for shard in fx["shards"].as_array().expect("shards") {
        for sample in shard["samples"].as_array().expect("samples") {
            let (path, key) = ds.sample_key(index).expect("indexed");
            assert_eq!(path, path_of(&shard["path"]));
            assert_eq!(key, sample[0].as_str().expect("key"));
            let (image, label) = ds.get(index)?;
            assert_eq!(image.dims(), &[3, 6, 8]);
            assert_eq!(label.item::<i64>()?, sample[1].as_i64().expect("label"));
            index += 1;
        }
    }
    assert_eq!(ds.len(), index);

    // `json` labels, GNU long names.
    let json = &fx["json_shard"];
    let ds = WebDataset::open(&[path_of(&json["path"])])?.label_key("json");
    for (i, sample) in json["samples"]
        .as_array()
        .expect("samples")
        .iter()
        .enumerate()
    {
        assert_eq!(
            ds.sample_key(i).expect("indexed").1,
            sample[0].as_str().expect("key")
        );
        assert_eq!(
            ds.get(i)?.1.item::<i64>()?,
            sample[1].as_i64().expect("label")
        );
    }
    let err = ds
        .clone()
        .image_key("jpg")
        .get(0)
        .expect_err("no jpg member");
    assert!(err.to_string().contains("no image member `jpg`"), "{err}");
    Ok(())
}

/// Counts the samples read, to show what resuming skips.
struct Counting<D> {
    inner: D,
    reads: AtomicUsize,
}

impl<D: Dataset> Dataset for Counting<D> {
    type Item = D::Item;
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn get(&self, index: usize) -> Result<Self::Item> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.get(index)
    }
}

#[test]
fn shards_cover_every_sample_once_per_epoch_for_any_worker_count() -> Result<()> {
    let Some(fx) = fixtures("shards_cover_every_sample_once_per_epoch_for_any_worker_count") else {
        return Ok(());
    };
    let ds = WebDataset::open(&shard_paths(fx))?;
    let n = ds.len();
    // Label of each index, read independently of the loader.
    let label_of: Vec<i64> = fx["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .flat_map(|s| s["samples"].as_array().expect("samples").clone())
        .map(|s| s[1].as_i64().expect("label"))
        .collect();
    for buffer in [0, 4] {
        let order = ds.epoch_order(5, buffer, 0, 1)?;
        let reference = PrefetchLoader::new(ds.clone(), 3)?.order(order.clone());
        let mut epoch_labels = Vec::new();
        for epoch in 0..2 {
            let indices = reference.epoch_order(epoch);
            let mut sorted = indices.clone();
            sorted.sort();
            assert_eq!(
                sorted,
                (0..n).collect::<Vec<_>>(),
                "buffer {buffer}, epoch {epoch}"
            );
            let expected: Vec<i64> = indices.iter().map(|&i| label_of[i]).collect();
            let baseline: Vec<Batch> = reference.batches(epoch).collect::<Result<_>>()?;
            assert_eq!(labels_of(&baseline), expected);
            for workers in [1, 2, 4] {
                let loader = reference.clone().num_workers(workers);
                let batches: Vec<Batch> = loader.batches(epoch).collect::<Result<_>>()?;
                assert!(
                    batches == baseline,
                    "buffer {buffer}, {workers} workers: bitwise equal"
                );
            }
            epoch_labels.push(indices);
        }
        assert_ne!(
            epoch_labels[0], epoch_labels[1],
            "epochs are shuffled differently"
        );
        assert_eq!(reference.num_batches(), n.div_ceil(3));
    }

    // Two ranks: contiguous blocks of ceil(n / 2) of the global order, the
    // last padded from its start; together every sample, the padding twice.
    let global = ds.epoch_order(5, 4, 0, 1)?.order(n, 1);
    let mut joined = Vec::new();
    for rank in 0..2 {
        let order = ds.epoch_order(5, 4, rank, 2)?;
        assert_eq!(order.num_samples(n), n.div_ceil(2));
        joined.extend(order.order(n, 1));
    }
    let padded: Vec<usize> = (0..2 * n.div_ceil(2)).map(|i| global[i % n]).collect();
    assert_eq!(joined, padded);
    let mut distinct = joined.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), n);
    Ok(())
}

#[test]
fn resuming_from_shards_mid_epoch_gives_the_uninterrupted_batches() -> Result<()> {
    let Some(fx) = fixtures("resuming_from_shards_mid_epoch_gives_the_uninterrupted_batches")
    else {
        return Ok(());
    };
    let ds = WebDataset::open(&shard_paths(fx))?;
    let n = ds.len();
    let order = ds.epoch_order(11, 5, 0, 1)?;
    for workers in [0, 2] {
        let loader = PrefetchLoader::new(
            Counting {
                inner: ds.clone(),
                reads: AtomicUsize::new(0),
            },
            4,
        )?
        .order(order.clone())
        .num_workers(workers);
        let all: Vec<Batch> = loader.batches(1).collect::<Result<_>>()?;
        for k in [1, 2] {
            let before = loader.dataset().reads.load(Ordering::Relaxed);
            let rest: Vec<Batch> = loader.batches_from(1, k).collect::<Result<_>>()?;
            assert!(rest == all[k..], "{workers} workers, from batch {k}");
            assert_eq!(
                loader.dataset().reads.load(Ordering::Relaxed) - before,
                n - 4 * k,
                "only the remaining samples are read"
            );
        }
    }
    Ok(())
}

#[test]
fn other_color_modes_have_their_channel_counts() -> Result<()> {
    let Some(fx) = fixtures("other_color_modes_have_their_channel_counts") else {
        return Ok(());
    };
    let root = path_of(&fx["folder"]["root"]);
    let gray = root.join("cat/gray.png");
    let rgba = root.join("dog/rgba.png");
    let read = |p: &Path, mode| -> Result<HostTensor> {
        decode_image(&std::fs::read(p).expect("image"), mode, p)
    };
    assert_eq!(read(&gray, ColorMode::Unchanged)?.dims(), &[1, 9, 7]);
    assert_eq!(read(&rgba, ColorMode::Unchanged)?.dims(), &[4, 10, 14]);
    let folder = ImageFolder::new(&root)?.color_mode(ColorMode::Gray);
    assert!((0..folder.len()).all(|i| folder.get(i).is_ok_and(|(x, _)| x.dims()[0] == 1)));
    Ok(())
}

#[test]
fn shards_compose_with_seeded_transforms_for_any_worker_count() -> Result<()> {
    let Some(fx) = fixtures("shards_compose_with_seeded_transforms_for_any_worker_count") else {
        return Ok(());
    };
    let ds = WebDataset::open(&shard_paths(fx))?;
    let order = ds.epoch_order(3, 4, 0, 1)?;
    let flipped = TransformedDataset::new(ds, RandomHorizontalFlip::default(), 9);
    let loader = PrefetchLoader::new(flipped, 5)?.order(order);
    let baseline: Vec<Batch> = loader.batches(0).collect::<Result<_>>()?;
    for workers in [1, 3] {
        let batches: Vec<Batch> = loader
            .clone()
            .num_workers(workers)
            .batches(0)
            .collect::<Result<_>>()?;
        assert!(batches == baseline, "{workers} workers");
    }
    Ok(())
}
