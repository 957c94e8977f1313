//! Which optional features a command needs (see `features.rs`), decided from
//! the command line and the config's TOML alone: no data, checkpoint or model
//! is read, so a command `kiln` cannot run leaves nothing behind.

use std::ffi::OsString;
use std::path::Path;

use clap::Parser;

use crate::args::{Cli, Command, ExportFormat, TuneCommand};
use crate::features::{Feature, FeatureMissing};
use crate::formats::{is_config, is_onnx};

/// The first feature `command` needs that this executable lacks, decided
/// from the command line and the config's TOML alone.
pub(crate) fn missing_feature(command: &Command) -> Option<FeatureMissing> {
    needed(command)
        .into_iter()
        .find(|missing| !missing.feature().compiled())
}

/// Every feature `command` needs, built in or not (what [`missing_feature`] checks).
fn needed(command: &Command) -> Vec<FeatureMissing> {
    let mut found = Vec::new();
    match command {
        Command::Train(args) => config_needs(&args.config, &mut found),
        Command::Tune(TuneCommand::Lr(args)) => config_needs(&args.config, &mut found),
        Command::Eval(args) => {
            checkpoint_needs(&args.checkpoint, &mut found);
            config_needs(&args.config, &mut found);
        }
        Command::Predict(args) => {
            checkpoint_needs(&args.common.checkpoint, &mut found);
            config_needs(&args.common.config, &mut found);
        }
        Command::Inspect { checkpoint, .. } if is_config(checkpoint) => {
            config_needs(checkpoint, &mut found);
        }
        Command::Inspect { checkpoint, .. } => checkpoint_needs(checkpoint, &mut found),
        Command::Export(args) => {
            if args.format == ExportFormat::Onnx {
                found.push(FeatureMissing::new(Feature::Onnx, "exporting ONNX"));
            }
            checkpoint_needs(&args.checkpoint, &mut found);
            if let Some(config) = &args.config {
                config_needs(config, &mut found);
            }
        }
        Command::Generate(_) => found.push(FeatureMissing::new(
            Feature::Text,
            "generating text (kiln generate)",
        )),
        Command::Launch(args) => {
            // The workers run this executable with these arguments.
            if args.exec.is_none() {
                let argv = std::iter::once(OsString::from("kiln")).chain(args.args.iter().cloned());
                if let Ok(worker) = Cli::try_parse_from(argv) {
                    found = needed(&worker.command);
                }
            }
        }
        Command::Consolidate(_) => {}
    }
    found
}

/// What a checkpoint path given to a command needs: a Hugging Face directory
/// (the text feature reads it) or an ONNX model.
fn checkpoint_needs(path: &Path, found: &mut Vec<FeatureMissing>) {
    if is_onnx(path) {
        found.push(FeatureMissing::new(
            Feature::Onnx,
            format!("the ONNX model {}", path.display()),
        ));
    } else if path.is_dir() && path.join("config.json").is_file() {
        found.push(FeatureMissing::new(
            Feature::Text,
            format!("the Hugging Face model directory {}", path.display()),
        ));
    }
}

/// What a run's config needs, from its TOML (a file that cannot be read or
/// parsed needs nothing here: the command itself reports it).
fn config_needs(path: &Path, found: &mut Vec<FeatureMissing>) {
    let Ok(text) = kiln_core::fs::read_regular_to_string(path) else {
        return;
    };
    let Ok(root) = toml::from_str::<toml::Value>(&text) else {
        return;
    };
    toml_needs(&root, found);
}

fn toml_needs(root: &toml::Value, found: &mut Vec<FeatureMissing>) {
    let model = root.get("model");
    if model.and_then(|m| m.get("pretrained")).is_some() {
        found.push(FeatureMissing::new(
            Feature::Text,
            "a Hugging Face model (`model.pretrained`)",
        ));
    }
    let data = root.get("data");
    if data
        .and_then(|d| d.get("dataset"))
        .and_then(toml::Value::as_str)
        == Some("text")
    {
        found.push(FeatureMissing::new(
            Feature::Text,
            "text data (`data.dataset = \"text\"`)",
        ));
    }
    if let Some(kind @ ("image_folder" | "webdataset")) = data
        .and_then(|d| d.get("dataset"))
        .and_then(toml::Value::as_str)
    {
        found.push(FeatureMissing::new(
            Feature::Vision,
            format!("image data (`data.dataset = \"{kind}\"`)"),
        ));
    }
    if let Some(op) = model.and_then(fused_op) {
        found.push(FeatureMissing::new(
            Feature::Ops,
            format!("Kiln's fused op `{op}` as a layer"),
        ));
    }
}

/// The first of Kiln's fused ops (`op = "kiln::..."` in a `custom` layer)
/// anywhere in `value`.
fn fused_op(value: &toml::Value) -> Option<&str> {
    match value {
        toml::Value::Table(table) => {
            let op = table.get("op").and_then(toml::Value::as_str);
            let custom = table.get("type").and_then(toml::Value::as_str) == Some("custom");
            match op {
                Some(op) if custom && op.starts_with("kiln::") => Some(op),
                _ => table.values().find_map(fused_op),
            }
        }
        toml::Value::Array(items) => items.iter().find_map(fused_op),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features_of(args: &[&str]) -> Vec<&'static str> {
        let cli = Cli::try_parse_from(std::iter::once("kiln").chain(args.iter().copied()))
            .expect("a valid command line");
        needed(&cli.command)
            .iter()
            .map(|m| m.feature().name())
            .collect()
    }

    fn config(dir: &Path, name: &str, toml: &str) -> String {
        let path = dir.join(name);
        std::fs::write(&path, toml).expect("writing a config");
        path.display().to_string()
    }

    #[test]
    fn each_command_needs_what_its_arguments_and_config_name() {
        let dir = std::env::temp_dir().join(format!("kiln-features-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let plain = config(
            &dir,
            "plain.toml",
            "[model]\nlayers = [{ type = \"linear\", in = 4, out = 2 }]\n[data]\ndataset = \"digits\"\n",
        );
        let hf = config(
            &dir,
            "hf.toml",
            "[model]\npretrained = \"org/name\"\n[data]\ndataset = \"text\"\npath = \"a.jsonl\"\n",
        );
        let ops = config(
            &dir,
            "ops.toml",
            "[model]\nlayers = [{ type = \"sequential\", layers = [{ type = \"custom\", op = \"kiln::swish\" }] }]\n",
        );
        let images = config(
            &dir,
            "images.toml",
            "[model]\nlayers = []\n[data]\ndataset = \"webdataset\"\nshards = \"s-{0..1}.tar\"\n",
        );
        let mine = config(
            &dir,
            "mine.toml",
            "[model]\nlayers = [{ type = \"custom\", op = \"mine::swish\" }]\n",
        );
        let hf_dir = dir.join("hf-model");
        std::fs::create_dir_all(&hf_dir).expect("a model directory");
        std::fs::write(hf_dir.join("config.json"), "{}").expect("config.json");
        let hf_dir = hf_dir.display().to_string();

        assert!(features_of(&["train", "--config", &plain]).is_empty());
        assert!(features_of(&["train", "--config", &mine]).is_empty());
        assert_eq!(features_of(&["train", "--config", &hf]), ["text", "text"]);
        assert_eq!(features_of(&["tune", "lr", "--config", &ops]), ["ops"]);
        assert_eq!(features_of(&["train", "--config", &images]), ["vision"]);
        assert_eq!(
            features_of(&["eval", "--config", &plain, "--checkpoint", &hf_dir]),
            ["text"]
        );
        assert_eq!(
            features_of(&[
                "predict",
                "--config",
                &plain,
                "--checkpoint",
                "m.onnx",
                "--output",
                "p.csv"
            ]),
            ["onnx"]
        );
        assert_eq!(features_of(&["inspect", "m.onnx"]), ["onnx"]);
        assert_eq!(features_of(&["inspect", &ops]), ["ops"]);
        assert!(features_of(&["inspect", "last.safetensors"]).is_empty());
        assert_eq!(
            features_of(&[
                "export",
                "--checkpoint",
                "c.safetensors",
                "--format",
                "onnx",
                "--output",
                "m.onnx"
            ]),
            ["onnx"]
        );
        assert!(features_of(&[
            "export",
            "--checkpoint",
            "c.safetensors",
            "--format",
            "torchscript",
            "--output",
            "m.pt"
        ])
        .is_empty());
        assert_eq!(
            features_of(&["generate", "--model", &hf_dir, "--prompt-ids", "1"]),
            ["text"]
        );
        assert_eq!(
            features_of(&[
                "launch",
                "--nproc-per-node",
                "2",
                "--",
                "train",
                "--config",
                &hf
            ]),
            ["text", "text"]
        );
        assert!(features_of(&["consolidate", "runs/x", "--output", "w.safetensors"]).is_empty());
        // A config that cannot be read needs nothing here: the command says why.
        assert!(features_of(&["train", "--config", "/nonexistent/kiln.toml"]).is_empty());
        std::fs::remove_dir_all(&dir).expect("removing the scratch directory");
    }
}
