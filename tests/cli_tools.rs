//! The training tools through the `kiln` CLI: weight averaging (EMA, SWA),
//! the learning-rate finder (`kiln tune lr`), the model summary (`kiln inspect
//! CONFIG` and at the start of a run), the TensorBoard views of `[logging]`, and
//! the profiler (`kiln train --profile`); weight averaging in
//! `cli_tools/averaging.rs`, the TensorBoard views in `cli_tools/views.rs`, the
//! profiler in `cli_tools/profile.rs`, the time limit (`max_time`) in
//! `cli_tools/timer.rs`.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::Path;

use common::{config, digits_available, kiln_fails, kiln_stdout, scratch, serial, train};

mod common;

#[path = "cli_tools/averaging.rs"]
mod averaging;
#[path = "cli_tools/profile.rs"]
mod profile;
#[path = "cli_tools/timer.rs"]
mod timer;
#[path = "cli_tools/views.rs"]
mod views;

/// The column `name` of a run's `epochs.csv`, one value per epoch.
pub(crate) fn epoch_column(run: &Path, name: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
    let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == name).unwrap();
    text.lines()
        .skip(1)
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect()
}

/// `kiln tune lr`: the range test on the config's data, model and optimizer,
/// its table and plot in a directory of its own, the suggestion printed and
/// written into a new copy of the config (never over a file, the config
/// included); the same on TensorFlow.
#[test]
fn tune_lr_suggests_a_rate_and_writes_only_new_files() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("tune-lr");
    let cfg = config(&dir, 0);
    let original = std::fs::read(&cfg).unwrap();
    let (out, tuned) = (dir.join("lr"), dir.join("tuned.toml"));
    let args = [
        "tune",
        "lr",
        "--config",
        cfg.to_str().unwrap(),
        "--min-lr",
        "1e-5",
        "--max-lr",
        "10",
        "--num-training",
        "60",
        "--mode",
        "exponential",
        "--early-stop-threshold",
        "4",
        "--output",
        out.to_str().unwrap(),
        "--suggestion",
        "log",
        "--save-config",
        tuned.to_str().unwrap(),
    ];
    let stdout = kiln_stdout(&args);
    let suggested: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("kiln: suggested learning rate "))
        .unwrap_or_else(|| panic!("{stdout}"))
        .parse()
        .unwrap();
    let csv = std::fs::read_to_string(out.join("lr_find.csv")).unwrap();
    let rows: Vec<(f64, f64)> = csv
        .lines()
        .skip(1)
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            (cells[1].parse().unwrap(), cells[2].parse().unwrap())
        })
        .collect();
    assert!(rows.len() > 12 && rows.len() <= 60, "{csv}");
    assert_eq!(rows[0].0, 1e-5);
    let at = rows
        .iter()
        .position(|r| r.0 == suggested)
        .expect("a rate of the sweep");
    assert!((10..rows.len() - 1).contains(&at), "{at} of {}", rows.len());
    let recorded = kiln::train::LrFinderResult {
        lrs: rows.iter().map(|r| r.0).collect(),
        losses: rows.iter().map(|r| r.1).collect(),
        stopped_early: rows.len() < 60,
    };
    assert_eq!(
        recorded.suggestion_log(),
        Some(suggested),
        "--suggestion log"
    );
    assert!(std::fs::metadata(out.join("lr_find.png")).unwrap().len() > 1000);
    assert_eq!(
        std::fs::read(&cfg).unwrap(),
        original,
        "the config is untouched"
    );
    let text = std::fs::read_to_string(&tuned).unwrap();
    let value: toml::Value = toml::from_str(&text).unwrap();
    assert_eq!(value["optimizer"]["lr"].as_float(), Some(suggested));
    assert_eq!(value["optimizer"]["type"].as_str(), Some("adam"));

    // Again: the copy exists, so nothing runs and nothing is written.
    let err = kiln_fails(&args);
    assert!(
        err.contains("--save-config") && err.contains("exists"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&tuned).unwrap(), text);
    // An output directory that holds other files is refused too.
    let err = kiln_fails(&args[..18]);
    assert!(err.contains(out.to_str().unwrap()), "{err}");

    // On TensorFlow, through its executable.
    let tf = dir.join("lr-tf");
    let stdout = kiln_stdout(&[
        "tune",
        "lr",
        "--config",
        cfg.to_str().unwrap(),
        "--backend",
        "tensorflow",
        "--min-lr",
        "1e-4",
        "--max-lr",
        "1",
        "--num-training",
        "20",
        "--mode",
        "linear",
        "--early-stop-threshold",
        "0",
        "--output",
        tf.to_str().unwrap(),
    ]);
    assert!(stdout.contains("20 steps from 1e-4 to 1e0"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(tf.join("lr_find.csv"))
            .unwrap()
            .lines()
            .count(),
        21
    );
}

/// `kiln inspect CONFIG`: the model summary of the config's model for one
/// sample of its data (hand-counted: Linear(64, 64), ReLU, Dropout,
/// Linear(64, 10)), with frozen parameters, to a depth, writing nothing; and
/// `kiln train` prints it at the start unless `summary_depth = 0`.
#[test]
fn inspect_config_prints_the_model_summary() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("summary");
    let cfg = config(&dir, 0);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let shown = kiln_stdout(&["inspect", cfg.to_str().unwrap()]);
    let rows: Vec<Vec<&str>> = shown
        .lines()
        .map(|l| l.split_whitespace().collect())
        .filter(|r: &Vec<&str>| r.len() >= 6)
        .collect();
    let expected = [
        ["Sequential", "[1,", "10]", "4,810", "4,810", "4,736"].as_slice(),
        &["0", "(Linear)", "[1,", "64]", "4,160", "4,160", "4,096"],
        &["1", "(Relu)", "[1,", "64]", "0", "0", "0"],
        &["2", "(Dropout)", "[1,", "64]", "0", "0", "0"],
        &["3", "(Linear)", "[1,", "10]", "650", "650", "640"],
    ];
    for want in expected {
        assert!(
            rows.iter().any(|r| r == want),
            "no row {want:?} in\n{shown}"
        );
    }
    assert!(
        shown.contains("params: 4,810 (4,810 trainable, 0 frozen)"),
        "{shown}"
    );
    assert!(
        shown.contains("mult-adds for one sample of [1, 64]: 4,736"),
        "{shown}"
    );
    assert!(!dir.join("default-out").exists(), "inspect writes nothing");

    let frozen = dir.join("frozen.toml");
    std::fs::write(&frozen, format!("freeze = [\"0.*\"]\n{text}")).unwrap();
    let shown = kiln_stdout(&["inspect", frozen.to_str().unwrap(), "--depth", "0"]);
    assert!(
        shown.contains("params: 4,810 (650 trainable, 4,160 frozen)"),
        "{shown}"
    );
    assert!(
        !shown.contains("(Linear)"),
        "depth 0: the model's row only\n{shown}"
    );
    let other = dir.join("model.safetensors");
    let err = kiln_fails(&["inspect", other.to_str().unwrap(), "--depth", "1"]);
    assert!(
        err.contains("--depth applies to a config's model summary"),
        "{err}"
    );

    let run = dir.join("run");
    let printed = train(cfg.to_str().unwrap(), &run, &["--epochs", "1"]);
    assert!(printed.contains("3 (Linear)"), "{printed}");
    let quiet = dir.join("quiet.toml");
    std::fs::write(
        &quiet,
        text.replace("[logging]\n", "[logging]\nsummary_depth = 0\n"),
    )
    .unwrap();
    let printed = train(
        quiet.to_str().unwrap(),
        &dir.join("quiet"),
        &["--epochs", "1"],
    );
    assert!(!printed.contains("(Linear)"), "{printed}");
}
