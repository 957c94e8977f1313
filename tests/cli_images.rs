//! `kiln train` on image files: class folders (`dataset = "image_folder"`) and
//! WebDataset shards (`dataset = "webdataset"`) made by
//! `examples/images/make_shapes.py`, with every transform and data key the README
//! documents; a run resumed mid-epoch from shards repeats the uninterrupted run's
//! steps; bad data and bad keys are errors that name the file or the key.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{kiln, kiln_fails as fails, losses, scratch, serial, train, KILN};

mod common;

/// A small shapes set (120 training and 30 validation images of 48x48, 40 per
/// shard) in `dir`, or `None` (a skip) without the project's Python.
fn shapes(dir: &Path) -> Option<PathBuf> {
    let python = kiln_testkit::python("the CLI image tests")?;
    let out = dir.join("shapes");
    let status = Command::new(python)
        .arg(kiln_testkit::workspace_root().join("examples/images/make_shapes.py"))
        .arg(&out)
        .args([
            "--size",
            "48",
            "--train-per-class",
            "20",
            "--val-per-class",
            "5",
        ])
        .args(["--shard-size", "40", "--seed", "1"])
        .status()
        .unwrap();
    assert!(status.success());
    Some(out)
}

/// A run config on image data: `data` is the `[data]` section's keys.
fn image_config(dir: &Path, name: &str, data: &str, channels: usize) -> PathBuf {
    let text = format!(
        r#"
seed = 5
output_dir = "{out}"

[data]
batch_size = 16
{data}

[model]
type = "sequential"
layers = [
  {{ type = "conv2d", in_channels = {channels}, out_channels = 8, kernel_size = 3, padding = 1 }},
  {{ type = "relu" }},
  {{ type = "max_pool2d", kernel_size = 2 }},
  {{ type = "conv2d", in_channels = 8, out_channels = 16, kernel_size = 3, padding = 1 }},
  {{ type = "relu" }},
  {{ type = "adaptive_avg_pool2d", output_size = 1 }},
  {{ type = "flatten" }},
  {{ type = "linear", in_features = 16, out_features = 6 }},
]

[loss]
type = "cross_entropy"

[optimizer]
type = "adam"
lr = 0.01

[training]
epochs = 2
log_every = 1

[checkpoint]
every_n_steps = 3
keep_last = 20

[logging]
tensorboard = false
plots = false
progress = false
"#,
        out = dir.join(format!("{name}-default-out")).display()
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Every transform, from class folders with a validation folder: the run reads
/// every image, takes every step and validates every epoch (what it learns is not
/// checked: two epochs under this much augmentation stay at chance, as do ten);
/// then eval and predict on the validation folder, in ImageFolder's order.
#[test]
fn runs_every_transform_on_class_folders_then_evals_and_predicts() {
    let _serial = serial();
    let dir = scratch("images-folder");
    let Some(shapes) = shapes(&dir) else { return };
    let data = format!(
        r#"dataset = "image_folder"
path = "{train}"
val_path = "{val}"
image_size = 32
workers = 2
transforms = [
  {{ type = "resize", size = 40 }},
  {{ type = "random_resized_crop", size = 32, scale = [0.5, 1.0], ratio = [0.8, 1.25] }},
  {{ type = "random_horizontal_flip", p = 0.5 }},
  {{ type = "color_jitter", brightness = 0.3, contrast = 0.3, saturation = 0.3, hue = 0.1 }},
  {{ type = "to_tensor" }},
  {{ type = "normalize", mean = [0.5, 0.5, 0.5], std = [0.25, 0.25, 0.25] }},
]
val_transforms = [
  {{ type = "resize", size = 36 }},
  {{ type = "center_crop", size = 32 }},
  {{ type = "to_tensor" }},
  {{ type = "normalize", mean = [0.5, 0.5, 0.5], std = [0.25, 0.25, 0.25] }},
]"#,
        train = shapes.join("train").display(),
        val = shapes.join("val").display()
    );
    let cfg = image_config(&dir, "folder", &data, 3);
    // With the misclassified validation images in TensorBoard.
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        "tensorboard = false",
        "tensorboard = true\nmisclassified_images = 8",
    );
    std::fs::write(&cfg, text).unwrap();
    let run = dir.join("run");
    let printed = train(s(&cfg), &run, &[]);
    assert!(
        printed.contains("120 training and 30 validation examples"),
        "{printed}"
    );
    let epochs = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
    assert!(epochs.contains("val_accuracy"), "{epochs}");
    assert_eq!(epochs.lines().count(), 3, "{epochs}");
    // 8 batches of 16 (the last one 8) per epoch.
    assert_eq!(losses(&run).len(), 16);
    // The misclassified images, named by their class folders, as TensorBoard
    // reads them: one grid of up to 8 RGB 32x32 images and a table per epoch.
    let python = kiln_testkit::python("the misclassified images").unwrap();
    let read: serde_json::Value = serde_json::from_str(&kiln_testkit::run_reference_script!(
        &python,
        "tensorboard_views.py",
        &[run.join("tensorboard").as_os_str()]
    ))
    .unwrap();
    let header: Vec<&str> = epochs.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "val_accuracy").unwrap();
    let accuracy: Vec<f64> = epochs
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect();
    let texts = read["texts"]["val_misclassified"].as_array().unwrap();
    let images = read["images"]["val_misclassified"].as_array().unwrap();
    assert_eq!(texts.len(), 2, "{read}");
    for (epoch, text) in texts.iter().enumerate() {
        let table = text[1].as_str().unwrap();
        let wrong = ((1.0 - accuracy[epoch]) * 30.0).round() as usize;
        assert!(
            table.starts_with(&format!(
                "Epoch {epoch}: {wrong} of 30 validation samples misclassified"
            )),
            "{table}"
        );
        // The folders are sorted: circle (0), cross (1), ...
        let classes = ["circle", "cross", "ring", "square", "star", "triangle"];
        let named = table
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| #"))
            .filter(|l| {
                classes
                    .iter()
                    .enumerate()
                    .any(|(i, c)| l.contains(&format!("{c} ({i})")))
            })
            .count();
        assert_eq!(named, wrong.min(8), "{table}");
        if wrong > 0 {
            let image = images.iter().find(|i| i[0] == epoch as u64).unwrap();
            let shown = wrong.min(8);
            let width = if shown == 1 { 32 } else { shown * 34 + 2 };
            let height = if shown == 1 { 32 } else { 36 };
            assert_eq!(
                (image[1].as_u64(), image[2].as_u64()),
                (Some(width as u64), Some(height as u64))
            );
        }
    }

    let ckpt = run.join("checkpoints/last.safetensors");
    let table =
        String::from_utf8(kiln(&["eval", "--config", s(&cfg), "--checkpoint", s(&ckpt)]).stdout)
            .unwrap();
    assert!(table.contains("accuracy"), "{table}");
    let predictions = dir.join("predictions.csv");
    kiln(&[
        "predict",
        "--config",
        s(&cfg),
        "--checkpoint",
        s(&ckpt),
        "--output",
        s(&predictions),
    ]);
    let text = std::fs::read_to_string(&predictions).unwrap();
    let labels: Vec<i64> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(2).unwrap().parse().unwrap())
        .collect();
    // The validation folder in ImageFolder's order: sorted classes, 5 images each.
    let expected: Vec<i64> = (0..6).flat_map(|c| [c; 5]).collect();
    assert_eq!(labels, expected);
}

/// Shards with a shuffle buffer: a run stopped mid-epoch and resumed gives the
/// uninterrupted run's losses, and every option of the webdataset section works.
#[test]
fn shards_resume_mid_epoch_as_the_uninterrupted_run() {
    let _serial = serial();
    let dir = scratch("images-shards");
    let Some(shapes) = shapes(&dir) else { return };
    let data = format!(
        r#"dataset = "webdataset"
shards = "{shards}/train-{{000000..000002}}.tar"
val_shards = "{shards}/val-000000.tar"
shuffle_buffer = 50
image_size = 32
color_mode = "gray"
workers = 2
transforms = [
  {{ type = "random_resized_crop", size = 32 }},
  {{ type = "random_horizontal_flip" }},
  {{ type = "to_tensor" }},
]"#,
        shards = shapes.join("shards").display()
    );
    let cfg = image_config(&dir, "shards", &data, 1);
    let (whole, parts) = (dir.join("whole"), dir.join("parts"));
    let printed = train(s(&cfg), &whole, &[]);
    assert!(
        printed.contains("120 training and 30 validation examples"),
        "{printed}"
    );
    // Stopped at step 11 of 16 (batch 3 of epoch 1), then resumed.
    train(s(&cfg), &parts, &["--max-steps", "11"]);
    train(s(&cfg), &parts, &["--resume", "auto"]);
    assert_eq!(losses(&parts), losses(&whole));

    // Other worker counts: the same batches, so the same losses.
    let zero = dir.join("zero");
    train(s(&cfg), &zero, &["--workers", "0"]);
    assert_eq!(losses(&zero), losses(&whole));
}

/// A corrupt image fails the run naming the file, or with `on_error = "skip"`
/// is left out with a warning; an empty class folder is an error.
#[test]
fn bad_images_are_named_or_skipped() {
    let _serial = serial();
    let dir = scratch("images-bad");
    let Some(shapes) = shapes(&dir) else { return };
    let train_dir = shapes.join("train");
    let victim = std::fs::read_dir(train_dir.join("star"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "jpg"))
        .unwrap();
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 3]).unwrap();
    let data = |extra: &str| {
        format!(
            "dataset = \"image_folder\"\npath = \"{}\"\nimage_size = 32\nval_fraction = 0.2\n{extra}",
            train_dir.display()
        )
    };
    let cfg = image_config(&dir, "fail", &data(""), 3);
    let err = fails(&["train", "--config", s(&cfg), "--output", s(&dir.join("a"))]);
    let name = victim.file_name().unwrap().to_str().unwrap();
    assert!(err.contains(name), "{err}");

    let cfg = image_config(&dir, "skip", &data("on_error = \"skip\""), 3);
    let out = Command::new(KILN)
        .args(["train", "--config", s(&cfg), "--output", s(&dir.join("b"))])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(name),
        "the warning names the file: {stderr}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("skipped"),
        "the summary counts it"
    );

    let empty = dir.join("empty");
    std::fs::create_dir_all(empty.join("a")).unwrap();
    std::fs::create_dir_all(empty.join("b")).unwrap();
    std::fs::copy(&victim, empty.join("a/x.jpg")).unwrap();
    let cfg = image_config(
        &dir,
        "empty",
        &format!(
            "dataset = \"image_folder\"\npath = \"{}\"\nimage_size = 32",
            empty.display()
        ),
        3,
    );
    let err = fails(&["train", "--config", s(&cfg), "--output", s(&dir.join("c"))]);
    assert!(err.contains("empty") && err.contains('b'), "{err}");
}

/// Keys that do not apply to the dataset, and bad values, are config errors
/// naming the key, before anything is written.
#[test]
fn image_keys_are_checked() {
    let dir = scratch("images-keys");
    let base = "dataset = \"image_folder\"\npath = \"x\"\nimage_size = 32";
    for (data, key) in [
        (
            "dataset = \"image_folder\"\npath = \"x\"",
            "data.image_size",
        ),
        (&format!("{base}\nscale = 255.0") as &str, "data.scale"),
        (&format!("{base}\nshards = \"a.tar\""), "data.shards"),
        (
            &format!("{base}\nval_path = \"y\"\nval_fraction = 0.1"),
            "data.val_fraction",
        ),
        (
            &format!("{base}\ntransforms = [{{ type = \"resize\", sise = 3 }}]"),
            "data.transforms",
        ),
        (
            &format!("{base}\ntransforms = [{{ type = \"color_jitter\", hue = 0.9 }}]"),
            "data.transforms[0]",
        ),
        ("dataset = \"digits\"\nimage_size = 32", "data.image_size"),
        ("dataset = \"webdataset\"\nimage_size = 32", "data.shards"),
    ] {
        let cfg = image_config(&dir, "keys", data, 3);
        let out = dir.join("never");
        let err = fails(&["train", "--config", s(&cfg), "--output", s(&out)]);
        assert!(err.contains(key), "{key}: {err}");
        assert!(!out.exists(), "nothing written for {key}");
    }
}

/// The shipped example trains on the set `cargo xtask setup` renders, from its
/// folders and, as its comment says, from its shards.
#[test]
fn the_example_config_runs_from_folders_and_shards() {
    let _serial = serial();
    let root = kiln_testkit::workspace_root();
    if !root.join(".kiln/data/shapes/VERSION").exists() {
        kiln_testkit::skip(
            "the_example_config_runs_from_folders_and_shards",
            ".kiln/data/shapes is missing: run `cargo xtask setup`",
        );
        return;
    }
    let dir = scratch("images-example");
    let cfg = root.join("examples/configs/images-cnn.toml");
    let printed = train(s(&cfg), &dir.join("folders"), &["--max-steps", "2"]);
    assert!(
        printed.contains("3000 training and 600 validation examples"),
        "{printed}"
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    let shards = text
        .replace("dataset = \"image_folder\"", "dataset = \"webdataset\"")
        .replace(
            "path = \".kiln/data/shapes/train\"",
            "shards = \".kiln/data/shapes/shards/train-{000000..000005}.tar\"",
        )
        .replace(
            "val_path = \".kiln/data/shapes/val\"",
            "val_shards = \".kiln/data/shapes/shards/val-{000000..000001}.tar\"",
        );
    // What the example's comment tells a user to write.
    assert!(text.contains("#   shards = \".kiln/data/shapes/shards/train-{000000..000005}.tar\""));
    let shards_cfg = dir.join("shards.toml");
    std::fs::write(&shards_cfg, shards).unwrap();
    let printed = train(s(&shards_cfg), &dir.join("shards"), &["--max-steps", "2"]);
    assert!(
        printed.contains("3000 training and 600 validation examples"),
        "{printed}"
    );
}

/// Two ranks under `kiln launch` split each epoch's shard stream: 60 of the
/// 120 images each, so 4 steps of 16 per epoch.
#[test]
fn shards_split_across_two_ranks() {
    let _serial = serial();
    let dir = scratch("images-ranks");
    let Some(shapes) = shapes(&dir) else { return };
    let data = format!(
        r#"dataset = "webdataset"
shards = "{shards}/train-{{000000..000002}}.tar"
val_shards = "{shards}/val-000000.tar"
shuffle_buffer = 30
image_size = 32
workers = 1"#,
        shards = shapes.join("shards").display()
    );
    let cfg = image_config(&dir, "ranks", &data, 3);
    let run = dir.join("run");
    let out = Command::new(KILN)
        .args(["launch", "--nproc-per-node", "2", "--", "train", "--config"])
        .args([s(&cfg), "--output", s(&run)])
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(losses(&run).len(), 8);
    let epochs = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
    assert!(epochs.contains("val_accuracy"), "{epochs}");
}

/// A shard pattern that expands to more paths than Kiln reads, or an empty
/// one, is refused at once naming the pattern and what is expected: never a
/// listing that exhausts memory and aborts the process.
#[test]
fn huge_or_empty_shard_patterns_are_refused_at_once() {
    let dir = scratch("images-patterns");
    let huge = "x-{0..99999999999}.tar";
    for (pattern, wanted) in [
        (huge, &[huge, "100000000000 shard paths", "1000000"][..]),
        ("", &["data.shards", "pattern is empty", ".tar"][..]),
    ] {
        let data = format!("dataset = \"webdataset\"\nshards = \"{pattern}\"\nimage_size = 32");
        let cfg = image_config(&dir, "patterns", &data, 3);
        let out_dir = dir.join("never");
        let started = std::time::Instant::now();
        let out = Command::new(KILN)
            .args(["train", "--config", s(&cfg), "--output", s(&out_dir)])
            .env("RUST_LOG", "warn")
            .env("TF_CPP_MIN_LOG_LEVEL", "2")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && out.status.code().is_some(),
            "{pattern:?}: an error exit, not a signal: {:?}\n{err}",
            out.status
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "{pattern:?}: took {:?}",
            started.elapsed()
        );
        for w in wanted {
            assert!(err.contains(w), "{pattern:?}: no {w:?} in\n{err}");
        }
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out_dir.exists(), "nothing written for {pattern:?}");
    }
}

/// Rewrites the shard `src` as `dst` with the `index`th `.cls` member holding
/// `label`; the name of that member.
fn relabel(src: &Path, dst: &Path, index: usize, label: &str) -> String {
    const SCRIPT: &str = r#"
import io, sys, tarfile
src, dst, index, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
seen = 0
with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.USTAR_FORMAT) as tout:
    for info in tin.getmembers():
        data = tin.extractfile(info).read()
        if info.name.endswith(".cls"):
            if seen == index:
                data = label.encode()
                print(info.name)
            seen += 1
        info.size = len(data)
        tout.addfile(info, io.BytesIO(data))
"#;
    let python = kiln_testkit::python("relabelling a shard").unwrap();
    let out = Command::new(python)
        .args(["-c", SCRIPT, s(src), s(dst), &index.to_string(), label])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Shards whose labels are `.json` members (`{"label": 3}`) and whose images
/// are `.image` members train with `label_key = "json"` and `image_key =
/// "image"` exactly as the same samples with `.cls` and `.png` do; without the
/// key the sample's members are named.
#[test]
fn shard_labels_in_json_members_train_as_cls_members_do() {
    const SCRIPT: &str = r#"
import io, json, sys, tarfile
src, dst = sys.argv[1], sys.argv[2]
with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.USTAR_FORMAT) as tout:
    for info in tin.getmembers():
        data = tin.extractfile(info).read()
        stem, ext = info.name.rsplit(".", 1)
        if ext == "cls":
            info.name, data = stem + ".json", json.dumps({"label": int(data), "source": "x"}).encode()
        else:
            info.name = stem + ".image"
        info.size = len(data)
        tout.addfile(info, io.BytesIO(data))
"#;
    let _serial = serial();
    let dir = scratch("images-json-labels");
    let Some(shapes) = shapes(&dir) else { return };
    let cls = shapes.join("shards/train-000000.tar");
    let json = dir.join("json.tar");
    let python = kiln_testkit::python("rewriting a shard").unwrap();
    let out = Command::new(python)
        .args(["-c", SCRIPT, s(&cls), s(&json)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let data = |shard: &Path, keys: &str| {
        format!(
            "dataset = \"webdataset\"\nshards = \"{}\"\nshuffle_buffer = 0\nimage_size = 32\n{keys}",
            shard.display()
        )
    };
    let run = |name: &str, data: String| {
        let cfg = image_config(&dir, name, &data, 3);
        let out = dir.join(name);
        train(s(&cfg), &out, &["--max-steps", "2"]);
        losses(&out)
    };
    let expected = run("cls", data(&cls, ""));
    let got = run(
        "json",
        data(&json, "label_key = \"json\"\nimage_key = \"image\""),
    );
    assert_eq!(got, expected);
    let cfg = image_config(&dir, "no-key", &data(&json, "image_key = \"image\""), 3);
    let err = fails(&[
        "train",
        "--config",
        s(&cfg),
        "--output",
        s(&dir.join("no-key")),
    ]);
    assert!(
        err.contains(
            "sample has no label member `cls` (it has: image, json; `label_key` chooses another)"
        ),
        "{err}"
    );
    let cfg = image_config(
        &dir,
        "on-csv",
        "dataset = \"digits\"\nlabel_key = \"json\"",
        3,
    );
    let err = fails(&[
        "train",
        "--config",
        s(&cfg),
        "--output",
        s(&dir.join("on-csv")),
    ]);
    assert!(
        err.contains("label_key") && err.contains("applies to webdataset"),
        "{err}"
    );
}

/// A shard label outside the model's 6 classes names the shard, the member,
/// the label and the range, as a CSV label names its file and line: the first
/// sample's (read when the data loads) and one read mid-epoch alike.
#[test]
fn a_shard_label_outside_the_classes_names_its_member() {
    let _serial = serial();
    let dir = scratch("images-labels");
    let Some(shapes) = shapes(&dir) else { return };
    for (index, label) in [(0, "-1"), (7, "99")] {
        let shard = dir.join(format!("bad-{index}.tar"));
        let member = relabel(
            &shapes.join("shards/train-000000.tar"),
            &shard,
            index,
            label,
        );
        let data = format!(
            "dataset = \"webdataset\"\nshards = \"{}\"\nimage_size = 32\nworkers = 1",
            shard.display()
        );
        let cfg = image_config(&dir, &format!("labels-{index}"), &data, 3);
        let err = fails(&[
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&dir.join(format!("run-{index}"))),
        ]);
        let name = format!("bad-{index}.tar:{member}");
        for wanted in [&name, &format!("label {label} "), "6 classes", "0 to 5"] {
            assert!(err.contains(wanted), "no {wanted:?} in\n{err}");
        }
        assert!(!err.contains("out of bounds"), "{err}");
    }
}

/// A torchvision resnet18 (scripted, frozen) under a trained head: `kiln
/// predict`'s scores equal PyTorch's on the same files (Pillow, then
/// `transforms.v2` on the tensor), JPEG (4:2:0, progressive 4:4:4, gray,
/// CMYK), WebP and PNG alike.
#[test]
fn predictions_equal_pytorchs_on_jpeg_and_png() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("predictions_equal_pytorchs_on_jpeg_and_png") else {
        return;
    };
    let dir = scratch("images-predict");
    let script = kiln_testkit::workspace_root().join("tests/reference/vision_predict.py");
    let status = Command::new(&python)
        .arg(&script)
        .args(["prepare", s(&dir)])
        .status()
        .unwrap();
    assert!(status.success());
    let val = dir.join("val");
    let transforms = r#"[
  { type = "resize", size = 72 },
  { type = "center_crop", size = 64 },
  { type = "to_tensor" },
  { type = "normalize", mean = [0.485, 0.456, 0.406], std = [0.229, 0.224, 0.225] },
]"#;
    let cfg = dir.join("resnet.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"seed = 3
output_dir = "{out}"
frozen_batch_norm = "eval"

[data]
dataset = "image_folder"
path = "{val}"
val_path = "{val}"
image_size = 64
batch_size = 4
transforms = {transforms}
val_transforms = {transforms}

[model]
type = "sequential"
layers = [
  {{ type = "torchscript", path = "{pt}", trainable = false }},
  {{ type = "linear", in_features = 512, out_features = 2 }},
]

[loss]
type = "cross_entropy"

[optimizer]
type = "sgd"
lr = 0.05

[training]
epochs = 1

[logging]
tensorboard = false
plots = false
progress = false
"#,
            val = val.display(),
            pt = dir.join("backbone.pt").display(),
            out = dir.join("default-out").display(),
        ),
    )
    .unwrap();
    let run = dir.join("run");
    train(s(&cfg), &run, &[]);
    let csv = dir.join("predictions.csv");
    kiln(&[
        "predict",
        "--config",
        s(&cfg),
        "--checkpoint",
        s(&run.join("checkpoints/last.safetensors")),
        "--output",
        s(&csv),
    ]);
    let out = Command::new(&python)
        .arg(&script)
        .args(["reference", s(&dir), s(&run.join("model.safetensors"))])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let reference = reference.as_array().unwrap();
    let text = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<Vec<f64>> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').skip(3).map(|v| v.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), reference.len());
    let mut worst: std::collections::BTreeMap<String, f64> = Default::default();
    for (ours, theirs) in rows.iter().zip(reference) {
        let path = theirs["path"].as_str().unwrap();
        let logits: Vec<f64> = serde_json::from_value(theirs["logits"].clone()).unwrap();
        // Relative to the logit's size (at least 1): the pixels are equal,
        // and libtorch's convolutions in two processes differ in a float's
        // last bits (1-2 ulp, seen alike on PNG files).
        let diff = ours
            .iter()
            .zip(&logits)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
            .fold(0.0, f64::max);
        let ext = path.rsplit('.').next().unwrap().to_string();
        let entry = worst.entry(ext).or_default();
        *entry = entry.max(diff);
        assert!(
            diff <= 1e-6,
            "{path}: Kiln {ours:?}, PyTorch {logits:?} (largest relative logit difference {diff:e})"
        );
    }
    eprintln!("largest relative logit difference from PyTorch, per format: {worst:?}");
    assert!(["jpg", "png", "webp"]
        .iter()
        .all(|e| worst.contains_key(*e)));
}

/// Every augmentation of issue 41's list through the config, and MixUp /
/// CutMix (`data.mixup_alpha`, `data.cutmix_alpha`) reaching the loss as
/// soft targets; their bad values and a loss that cannot take soft targets
/// are errors naming the key.
#[test]
fn recipe_augmentations_and_mixup_cutmix_train_from_the_config() {
    let _serial = serial();
    let dir = scratch("images-recipe");
    let Some(shapes) = shapes(&dir) else { return };
    let data = |extra: &str| {
        format!(
            r#"dataset = "image_folder"
path = "{train}"
val_path = "{val}"
image_size = 32
workers = 2
transforms = [
  {{ type = "resize", size = 40 }},
  {{ type = "random_crop", size = 36, padding = [2], padding_mode = "reflect" }},
  {{ type = "pad", padding = [1, 1, 1, 1], fill = 0 }},
  {{ type = "random_rotation", degrees = 10, interpolation = "bilinear" }},
  {{ type = "random_affine", degrees = 5, translate = [0.1, 0.1], scale = [0.9, 1.1], shear = 5 }},
  {{ type = "random_perspective", distortion_scale = 0.2, p = 0.5 }},
  {{ type = "gaussian_blur", kernel_size = 3, sigma = [0.1, 1.0] }},
  {{ type = "random_grayscale", p = 0.2 }},
  {{ type = "auto_augment", policy = "imagenet" }},
  {{ type = "rand_augment", num_ops = 2, magnitude = 9 }},
  {{ type = "trivial_augment_wide" }},
  {{ type = "center_crop", size = 32 }},
  {{ type = "to_tensor" }},
  {{ type = "normalize", mean = [0.5, 0.5, 0.5], std = [0.25, 0.25, 0.25] }},
  {{ type = "random_erasing", p = 0.25, value = "random" }},
]
val_transforms = [
  {{ type = "resize", size = 32 }},
  {{ type = "center_crop", size = 32 }},
  {{ type = "to_tensor" }},
  {{ type = "normalize", mean = [0.5, 0.5, 0.5], std = [0.25, 0.25, 0.25] }},
]
{extra}"#,
            train = shapes.join("train").display(),
            val = shapes.join("val").display()
        )
    };
    let plain = image_config(&dir, "plain", &data(""), 3);
    let mixed = image_config(
        &dir,
        "mixed",
        &data("mixup_alpha = 0.4\ncutmix_alpha = 1.0"),
        3,
    );
    let (a, b) = (dir.join("plain"), dir.join("mixed"));
    train(s(&plain), &a, &[]);
    train(s(&mixed), &b, &[]);
    let (la, lb) = (losses(&a), losses(&b));
    assert_eq!(la.len(), 16);
    assert_eq!(lb.len(), 16);
    let finite = |l: &(String, String)| l.1.parse::<f64>().is_ok_and(f64::is_finite);
    assert!(la.iter().chain(&lb).all(finite), "{la:?} {lb:?}");
    // The same images and model at step 1; mixed targets give another loss.
    assert_ne!(
        la[0].1, lb[0].1,
        "MixUp / CutMix changed the first batch's loss"
    );
    let epochs = std::fs::read_to_string(b.join("epochs.csv")).unwrap();
    assert!(epochs.contains("val_accuracy"), "{epochs}");

    // Each alone, too.
    for extra in ["mixup_alpha = 0.2", "cutmix_alpha = 1.0"] {
        let cfg = image_config(&dir, "alone", &data(extra), 3);
        let run = dir.join(format!("alone-{}", &extra[..5]));
        train(s(&cfg), &run, &["--max-steps", "2"]);
        assert_eq!(losses(&run).len(), 2);
    }

    // Bad values and a loss without soft targets name the key.
    let bad = image_config(&dir, "bad", &data("mixup_alpha = 0.0"), 3);
    let err = fails(&[
        "train",
        "--config",
        s(&bad),
        "--output",
        s(&dir.join("bad")),
    ]);
    assert!(
        err.contains("data.mixup_alpha") && err.contains("positive"),
        "{err}"
    );
    let text = std::fs::read_to_string(&mixed)
        .unwrap()
        .replace(r#"type = "cross_entropy""#, r#"type = "mse""#);
    let mse = dir.join("mse.toml");
    std::fs::write(&mse, text).unwrap();
    let err = fails(&[
        "train",
        "--config",
        s(&mse),
        "--output",
        s(&dir.join("mse")),
    ]);
    assert!(
        err.contains("data.mixup_alpha") && err.contains("cross_entropy"),
        "{err}"
    );
    assert!(!dir.join("mse").exists(), "nothing written");
}
