//! `[model] pretrained = "dir"` through the CLI: a tiny LLaMA, GPT-2 and BERT
//! saved by `transformers` fine-tune as sequence classifiers (`num_labels`)
//! on a CSV of token ids, with frozen layers, parameter groups and bf16
//! autocast; a run stopped after one epoch resumes to the uninterrupted run's
//! losses; the checkpoint exports to ONNX and TorchScript; the TensorFlow
//! backend trains the same config; ViT fine-tunes on image folders; two ranks
//! under `kiln launch` train what one process does; and `kiln generate`
//! decodes greedily exactly as `transformers`' `generate` does.

#![allow(clippy::unwrap_used)]

#[path = "cli_pretrained/chat.rs"]
mod chat;
mod common;
#[path = "cli_pretrained/hub.rs"]
mod hub;
#[path = "cli_pretrained/keys.rs"]
mod keys;
#[path = "cli_pretrained/mock_hub.rs"]
mod mock_hub;

use std::path::{Path, PathBuf};

use common::{kiln, kiln_fails, kiln_stdout, losses, scratch, serial, train};
use kiln::prelude::*;
use kiln::train::Checkpoint;

/// The reference models, made once per test binary (in the first caller's
/// scratch directory), or `None` without Python.
fn models(test: &str) -> Option<PathBuf> {
    static MADE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    common::made_once(test, &MADE, "pretrained.py", "pretrained-models")
}

/// 96 rows of 8 token ids and a label: whether the last token is in the upper
/// half of the vocabulary (which the last position's hidden state can tell).
fn token_csv(dir: &Path) -> PathBuf {
    let ids = kiln_testkit::noise_indices(96 * 8, 297, 5);
    let mut text = String::new();
    for row in ids.chunks(8) {
        let tokens: Vec<String> = row.iter().map(|t| (t + 3).to_string()).collect();
        let label = i64::from(row[7] + 3 >= 150);
        text.push_str(&format!("{},{label}\n", tokens.join(",")));
    }
    let path = dir.join("tokens.csv");
    std::fs::write(&path, text).unwrap();
    path
}

fn config(dir: &Path, model: &Path, csv: &Path, name: &str, extra: &str) -> PathBuf {
    let text = format!(
        r#"
seed = 4
output_dir = "{out}"
{extra}

[data]
dataset = "csv"
path = "{csv}"
batch_size = 16
val_fraction = 0.25

[model]
pretrained = "{model}"
num_labels = 2

[loss]
type = "cross_entropy"

[optimizer]
type = "adamw"
lr = 0.003

[training]
epochs = 2
log_every = 1

[checkpoint]
every_n_epochs = 1
keep_last = 4

[logging]
tensorboard = false
plots = false
progress = false
"#,
        out = dir.join("default-out").display(),
        csv = csv.display(),
        model = model.display(),
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// The finite per-step losses of two runs agree to 1e-4 relative (two
/// processes; the in-process trainer tests check resume bitwise).
fn assert_same_losses(actual: &[(String, String)], expected: &[(String, String)], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: steps");
    for ((step, a), (_, b)) in actual.iter().zip(expected) {
        let (a, b): (f64, f64) = (a.parse().unwrap(), b.parse().unwrap());
        assert!(a.is_finite(), "{what}: step {step} loss {a}");
        assert!(
            (a - b).abs() <= 1e-4 * b.abs().max(1.0),
            "{what}: step {step}: {a} vs {b}"
        );
    }
}

#[test]
fn pretrained_models_fine_tune_resume_export_and_generate_through_the_cli() {
    let test = "pretrained_models_fine_tune_resume_export_and_generate_through_the_cli";
    let _serial = serial();
    let dir = scratch("pretrained");
    let Some(models) = models(test) else {
        return;
    };
    let csv = token_csv(&dir);
    let frozen = r#"freeze = ["1.0.*"]

[[param_groups]]
name = "body"
params = { prefix = "2." }
lr = 0.001
"#;
    for family in ["llama", "gpt2", "bert"] {
        // The first block: after GPT-2's embeddings and dropout (3), BERT's
        // embeddings, norm and dropout (5).
        let first = match family {
            "gpt2" => 3,
            "bert" => 5,
            _ => 1,
        };
        let extra = frozen
            .replace("1.0.*", &format!("{first}.0.*"))
            .replace("\"2.\"", &format!("\"{}.\"", first + 1));
        let cfg = config(&dir, &models.join(family), &csv, family, &extra);
        let cfg = cfg.to_str().unwrap();
        let (a, b) = (
            dir.join(format!("{family}-whole")),
            dir.join(format!("{family}-stopped")),
        );
        let printed = train(cfg, &a, &["--precision", "bf16-mixed"]);
        assert!(printed.contains("loss"), "{printed}");
        let reference = losses(&a);
        assert_eq!(
            reference.len(),
            10,
            "{family}: 72 training rows in batches of 16, 2 epochs"
        );
        train(cfg, &b, &["--precision", "bf16-mixed", "--epochs", "1"]);
        train(
            cfg,
            &b,
            &[
                "--precision",
                "bf16-mixed",
                "--epochs",
                "2",
                "--resume",
                "auto",
            ],
        );
        assert_same_losses(&losses(&b), &reference, &format!("{family}: resumed"));

        // The frozen block kept its pretrained weights; the rest trained.
        let last = Checkpoint::load(&a.join("checkpoints/last.safetensors")).unwrap();
        let pretrained = kiln::hf::Pretrained::open(models.join(family))
            .unwrap()
            .load_weights()
            .unwrap();
        let attention = if family == "bert" {
            "0.block.0"
        } else {
            "0.block.1"
        };
        let frozen_name = format!("{first}.{attention}.q_proj.weight");
        let trained_name = format!("{}.{attention}.q_proj.weight", first + 1);
        let (frozen_name, trained_name) = (frozen_name.as_str(), trained_name.as_str());
        assert_eq!(
            last.model.get(frozen_name),
            pretrained.get(frozen_name),
            "{family}: frozen"
        );
        assert_ne!(
            last.model.get(trained_name),
            pretrained.get(trained_name),
            "{family}: trained"
        );

        for (format, file) in [("onnx", "model.onnx"), ("torchscript", "model.pt")] {
            let out = dir.join(format!("{family}-{file}"));
            kiln(&[
                "export",
                "--checkpoint",
                a.join("checkpoints/last.safetensors").to_str().unwrap(),
                "--config",
                cfg,
                "--format",
                format,
                "--output",
                out.to_str().unwrap(),
            ]);
            assert!(out.is_file(), "{family}: {format} export");
        }
        // The ONNX classifier takes the ids and their attention mask.
        let onnx = dir.join(format!("{family}-model.onnx"));
        let inspected = kiln_stdout(&["inspect", onnx.to_str().unwrap()]);
        assert!(
            inspected.contains("attention_mask"),
            "{family}: {inspected}"
        );
    }

    // The TensorFlow backend trains the same model (without freezing, which it lacks).
    let cfg = config(&dir, &models.join("llama"), &csv, "llama-tf", "");
    let tf = dir.join("llama-tf");
    train(
        cfg.to_str().unwrap(),
        &tf,
        &["--backend", "tensorflow", "--epochs", "1"],
    );
    let tf_losses = losses(&tf);
    assert_eq!(tf_losses.len(), 5);
    for (step, loss) in &tf_losses {
        assert!(
            loss.parse::<f64>().unwrap().is_finite(),
            "TensorFlow step {step}: {loss}"
        );
    }

    // Bad keys name themselves.
    let bad = dir.join("bad.toml");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("num_labels = 2", "num_labels = 2\nlayers = []");
    std::fs::write(&bad, text).unwrap();
    let err = kiln_fails(&["train", "--config", bad.to_str().unwrap()]);
    assert!(err.contains("model.layers"), "{err}");
}

#[test]
fn kiln_generate_decodes_as_transformers_generate() {
    let test = "kiln_generate_decodes_as_transformers_generate";
    let dir = scratch("generate");
    let Some(models) = models(test) else {
        return;
    };
    for family in ["llama", "gpt2"] {
        let (io, _) =
            StateDict::load_safetensors(models.join(format!("{family}.io.safetensors"))).unwrap();
        let (ids, mask, greedy) = (
            io.get("prompt_ids").unwrap(),
            io.get("attention_mask").unwrap(),
            io.get("greedy").unwrap(),
        );
        let width = ids.dims()[1];
        let out_width = greedy.dims()[1];
        let mut args: Vec<String> = vec![
            "generate".into(),
            "--model".into(),
            models.join(family).display().to_string(),
            "--max-new-tokens".into(),
            (out_width - width).to_string(),
            // The reference ran without a stop token.
            "--stop=-1".into(),
        ];
        let rows = ids.as_slice::<i64>().unwrap().chunks(width);
        for (row, m) in rows.zip(mask.as_slice::<i64>().unwrap().chunks(width)) {
            let prompt: Vec<String> = row
                .iter()
                .zip(m)
                .filter(|(_, m)| **m != 0)
                .map(|(t, _)| t.to_string())
                .collect();
            args.push("--prompt-ids".into());
            args.push(prompt.join(","));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let printed = kiln_stdout(&args);
        let expected: Vec<String> = greedy
            .as_slice::<i64>()
            .unwrap()
            .chunks(out_width)
            .map(|row| {
                row[width..]
                    .iter()
                    .map(i64::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect();
        let lines: Vec<&str> = printed.lines().collect();
        assert_eq!(
            lines, expected,
            "{family}: kiln generate against transformers"
        );

        // Text in, text out, sampled reproducibly from the seed.
        let sample = |seed: &str| {
            kiln_stdout(&[
                "generate",
                "--model",
                models.join(family).to_str().unwrap(),
                "--prompt",
                "the quick brown fox",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0.9",
                "--top-p",
                "0.9",
                "--seed",
                seed,
            ])
        };
        let first = sample("7");
        assert!(first.starts_with("the quick brown fox"), "{first}");
        assert_eq!(
            sample("7"),
            first,
            "{family}: the same seed samples the same text"
        );
    }
    let err = kiln_fails(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert!(err.contains("config.json"), "{err}");

    // Top-k sampling without the cache draws what it draws with it.
    let llama = models.join("llama");
    let sampled = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            llama.to_str().unwrap(),
            "--prompt",
            "a kiln fires",
            "--max-new-tokens",
            "8",
            "--top-k",
            "5",
            "--seed",
            "3",
        ];
        args.extend_from_slice(extra);
        kiln_stdout(&args)
    };
    assert_eq!(
        sampled(&["--no-cache"]),
        sampled(&[]),
        "sampling with and without the cache"
    );

    // A Kiln checkpoint of the language model, with the directory's tokenizer.
    let csv = token_csv(&dir);
    let cfg = config(&dir, &llama, &csv, "generate", "");
    let run = dir.join("classifier");
    train(cfg.to_str().unwrap(), &run, &["--epochs", "1"]);
    let mut checkpoint = Checkpoint::load(&run.join("checkpoints/last.safetensors")).unwrap();
    let pretrained = kiln::hf::Pretrained::open(&llama).unwrap();
    checkpoint.model = pretrained.load_weights().unwrap();
    checkpoint.model_definition = Some(pretrained.layer().clone());
    let lm = dir.join("lm.safetensors");
    checkpoint.save(&lm).unwrap();
    let from_checkpoint = kiln_stdout(&[
        "generate",
        "--model",
        lm.to_str().unwrap(),
        "--tokenizer",
        llama.to_str().unwrap(),
        "--prompt",
        "the quick brown fox",
        "--max-new-tokens",
        "6",
    ]);
    let from_dir = kiln_stdout(&[
        "generate",
        "--model",
        llama.to_str().unwrap(),
        "--prompt",
        "the quick brown fox",
        "--max-new-tokens",
        "6",
        "--stop=-1",
    ]);
    assert_eq!(
        from_checkpoint, from_dir,
        "a checkpoint generates as its directory does"
    );
    // A classifier's checkpoint does not generate.
    let err = kiln_fails(&[
        "generate",
        "--model",
        run.join("checkpoints/last.safetensors").to_str().unwrap(),
        "--prompt-ids",
        "5,6,7",
    ]);
    assert!(err.contains("[batch, seq, vocab]"), "{err}");
}

/// `kiln predict` and `kiln eval` run a classifier straight from its Hugging
/// Face directory (no training run first): BERT's scores are `transformers`'
/// logits, and the loss is the cross entropy of those logits.
#[test]
fn a_hugging_face_classifier_directory_predicts_and_evaluates_as_transformers() {
    let test = "a_hugging_face_classifier_directory_predicts_and_evaluates_as_transformers";
    let _serial = serial();
    let dir = scratch("pretrained-hf-eval");
    let Some(models) = models(test) else {
        return;
    };
    let (io, _) = StateDict::load_safetensors(models.join("bert.io.safetensors")).unwrap();
    let ids: Vec<i64> = io
        .get("input_ids")
        .unwrap()
        .as_slice::<i64>()
        .unwrap()
        .to_vec();
    let logits: Vec<f64> = io.get("logits").unwrap().to_f64_vec();
    // The two reference rows, labelled 0 and 1, four times each.
    let mut text = String::new();
    for i in 0..8 {
        let row = &ids[(i % 2) * 7..(i % 2 + 1) * 7];
        let row: Vec<String> = row.iter().map(i64::to_string).collect();
        text.push_str(&format!("{},{}\n", row.join(","), i % 2));
    }
    let csv = dir.join("rows.csv");
    std::fs::write(&csv, text).unwrap();
    let cfg = config(&dir, &models.join("bert"), &csv, "bert", "")
        .to_str()
        .unwrap()
        .to_owned();
    let cfg_text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("num_labels = 2\n", "")
        .replace("val_fraction = 0.25", "val_fraction = 0.5");
    std::fs::write(&cfg, cfg_text).unwrap();
    let bert = models.join("bert");
    let out = dir.join("predictions.csv");
    kiln(&[
        "predict",
        "--config",
        &cfg,
        "--checkpoint",
        bert.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&out).unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("index,predicted,label,score_0,score_1,score_2")
    );
    let mut expected_loss = 0.0;
    let mut rows = 0;
    for line in lines {
        let cells: Vec<f64> = line.split(',').map(|c| c.parse().unwrap()).collect();
        let label = cells[2] as usize;
        let reference = &logits[label * 3..label * 3 + 3];
        for (got, want) in cells[3..].iter().zip(reference) {
            assert!((got - want).abs() <= 1e-5, "{line}: {reference:?}");
        }
        let log_sum = reference.iter().map(|l| l.exp()).sum::<f64>().ln();
        expected_loss += log_sum - reference[label];
        rows += 1;
    }
    assert_eq!(rows, 4, "{text}");
    expected_loss /= rows as f64;
    let printed = kiln_stdout(&[
        "eval",
        "--config",
        &cfg,
        "--checkpoint",
        bert.to_str().unwrap(),
    ]);
    let loss: f64 = printed
        .lines()
        .find_map(|l| l.strip_prefix("loss"))
        .unwrap_or_else(|| panic!("{printed}"))
        .trim()
        .parse()
        .unwrap();
    assert!(
        (loss - expected_loss).abs() <= 1e-5,
        "{loss} vs {expected_loss}"
    );

    // A config whose model is not the directory's is refused naming a tensor.
    let other = config(&dir, &models.join("bert"), &csv, "bert-new-head", "");
    let err = kiln_fails(&[
        "eval",
        "--config",
        other.to_str().unwrap(),
        "--checkpoint",
        bert.to_str().unwrap(),
    ]);
    assert!(err.contains("does not fit the config's model"), "{err}");
    let err = kiln_fails(&[
        "eval",
        "--config",
        &cfg,
        "--checkpoint",
        dir.to_str().unwrap(),
    ]);
    assert!(err.contains("is a directory without config.json"), "{err}");
}

#[test]
fn the_shipped_pretrained_config_trains_on_the_example_model() {
    let test = "the_shipped_pretrained_config_trains_on_the_example_model";
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    let _serial = serial();
    let dir = scratch("pretrained-shipped");
    common::tiny_llama(&python, &dir.join("models/tiny-llama"));
    // The config's paths are relative to where kiln runs, as for a user in the workspace.
    let config = kiln_testkit::workspace_root().join("examples/configs/pretrained-llama.toml");
    let out = std::process::Command::new(common::KILN)
        .current_dir(&dir)
        .args([
            "train",
            "--config",
            config.to_str().unwrap(),
            "--epochs",
            "1",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = dir.join("runs/pretrained-llama");
    assert!(run.join("checkpoints/last.safetensors").is_file());
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.contains("accuracy"), "{printed}");
}

/// ViT from its checkpoint on image folders (a new 6-class classifier, as a
/// `head`), and
/// a LLaMA classifier data-parallel on two ranks with `kiln launch`: both
/// train, and the two ranks end with the single process's loss curve.
#[test]
fn vit_on_image_folders_and_llama_on_two_ranks() {
    let test = "vit_on_image_folders_and_llama_on_two_ranks";
    let _serial = serial();
    let dir = scratch("pretrained-vit-ddp");
    let Some(models) = models(test) else {
        return;
    };
    let python = kiln_testkit::python(test).unwrap();
    let shapes = dir.join("shapes");
    let status = std::process::Command::new(python)
        .arg(kiln_testkit::workspace_root().join("examples/images/make_shapes.py"))
        .arg(&shapes)
        .args([
            "--size",
            "24",
            "--train-per-class",
            "8",
            "--val-per-class",
            "2",
            "--seed",
            "1",
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let text = format!(
        r#"
seed = 2
output_dir = "{out}"

[data]
dataset = "image_folder"
path = "{train}"
val_path = "{val}"
image_size = 16
batch_size = 12
workers = 1

[model]
pretrained = "{model}"
# The classifier after the class token's LayerNorm and selection, replaced.
head = [{{ type = "linear", in_features = 32, out_features = 6 }}]

[loss]
type = "cross_entropy"

[optimizer]
type = "adamw"
lr = 0.001

[training]
epochs = 2
log_every = 1

[logging]
tensorboard = false
plots = false
progress = false
"#,
        out = dir.join("vit-default").display(),
        train = shapes.join("train").display(),
        val = shapes.join("val").display(),
        model = models.join("vit").display(),
    );
    let cfg = dir.join("vit.toml");
    std::fs::write(&cfg, text).unwrap();
    let run = dir.join("vit");
    train(cfg.to_str().unwrap(), &run, &[]);
    let steps = losses(&run);
    assert_eq!(steps.len(), 8, "48 images in batches of 12, 2 epochs");
    let export = dir.join("vit.onnx");
    kiln(&[
        "export",
        "--checkpoint",
        run.join("checkpoints/last.safetensors").to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
        "--format",
        "onnx",
        "--output",
        export.to_str().unwrap(),
    ]);
    assert!(export.is_file());

    // Data-parallel: two ranks of batch 8 train what one process of batch 16
    // trains (LLaMA has no dropout and no batch statistics).
    let csv = token_csv(&dir);
    let base = config(&dir, &models.join("llama"), &csv, "llama-ddp", "");
    let text = std::fs::read_to_string(&base).unwrap();
    let single_cfg = dir.join("llama-single.toml");
    std::fs::write(
        &single_cfg,
        text.replace("batch_size = 16", "batch_size = 16\ndrop_last = true"),
    )
    .unwrap();
    let cfg = dir.join("llama-ranks.toml");
    std::fs::write(
        &cfg,
        text.replace("batch_size = 16", "batch_size = 8\ndrop_last = true"),
    )
    .unwrap();
    let single = dir.join("llama-single");
    train(single_cfg.to_str().unwrap(), &single, &["--epochs", "1"]);
    let ranks = dir.join("llama-ranks");
    kiln(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output",
        ranks.to_str().unwrap(),
        "--epochs",
        "1",
    ]);
    assert_same_losses(
        &losses(&ranks),
        &losses(&single),
        "two ranks against one process",
    );
}
