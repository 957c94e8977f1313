//! The `kiln` CLI with Kiln's fused C++ ops as layers
//! (`examples/configs/digits-mlp-fused.toml`): the config trains on both backends,
//! and a checkpoint written on one evaluates to the same numbers on the other.

#![cfg(feature = "ops")]
#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::{Path, PathBuf};
mod common;

use common::{kiln_stdout as kiln, metric};

const CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/configs/digits-mlp-fused.toml"
);

/// `kiln eval` of `checkpoint` with the config's `backend` set to `backend`
/// (`eval` takes the backend from the config).
fn eval(dir: &Path, backend: &str, checkpoint: &Path) -> String {
    let text = std::fs::read_to_string(CONFIG).unwrap();
    let config = dir.join(format!("{backend}.toml"));
    let changed = text.replace("backend = \"torch\"", &format!("backend = \"{backend}\""));
    assert!(changed.contains(&format!("backend = \"{backend}\"")));
    std::fs::write(&config, changed).unwrap();
    kiln(&[
        "eval",
        "--config",
        config.to_str().unwrap(),
        "--checkpoint",
        checkpoint.to_str().unwrap(),
    ])
}

#[test]
fn fused_layers_train_from_a_config_on_both_backends() {
    let dir: PathBuf =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-ops-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for backend in ["torch", "tensorflow"] {
        let out = dir.join(backend);
        kiln(&[
            "train",
            "--config",
            CONFIG,
            "--backend",
            backend,
            "--epochs",
            "6",
            "--no-progress",
            "--output",
            out.to_str().unwrap(),
        ]);
        let checkpoint = out.join("checkpoints/last.safetensors");
        let here = eval(&dir, backend, &checkpoint);
        let other = eval(
            &dir,
            if backend == "torch" {
                "tensorflow"
            } else {
                "torch"
            },
            &checkpoint,
        );
        let accuracy = metric(&here, "accuracy");
        assert!(accuracy > 0.93, "6 epochs on {backend} reach {accuracy}");
        assert_eq!(accuracy, metric(&other, "accuracy"), "{here}\n{other}");
        assert!((metric(&here, "loss") - metric(&other, "loss")).abs() < 1e-5);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
