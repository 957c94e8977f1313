//! The `kiln` CLI end to end: train from a config, get killed by a real signal
//! mid-run, resume from the last checkpoint, and reproduce the per-step losses
//! of an uninterrupted run bitwise. Also: inspect, eval and predict, and a
//! config error that names the key.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    config, digits_available, kiln, kiln_fails, kiln_stdout, losses, scratch, serial, train, KILN,
};
use kiln::core::state_dict::StateDict;
use kiln::train::Checkpoint;

mod common;

/// Per-step losses of two runs agree. Exactly, as a rule; but across processes
/// libtorch's CPU kernels were seen to differ in the last bit now and then (two
/// uninterrupted runs of one config included) while other processes loaded the two
/// cores, and a last-bit difference then grows slowly over the following steps.
/// So the check allows 1e-4 relative: any real resume fault (a wrong data
/// position, optimizer or schedule state) changes the losses far more than that.
/// The in-process trainer test (`tests/trainer.rs`) checks resume bitwise.
fn assert_same_run(actual: &[(String, String)], expected: &[(String, String)], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: number of steps");
    let mut exact = 0;
    for ((step, a), (_, e)) in actual.iter().zip(expected) {
        let (a, e): (f64, f64) = (a.parse().unwrap(), e.parse().unwrap());
        exact += usize::from(a == e);
        assert!(
            (a - e).abs() <= 1e-4 * e.abs(),
            "{what}: step {step} loss {a} vs {e}"
        );
    }
    eprintln!(
        "{what}: {exact} of {} step losses bitwise equal",
        expected.len()
    );
}

/// `kiln eval` of `checkpoint` with `config`: the accuracy it prints, and all it printed.
fn eval_accuracy(config: &Path, checkpoint: &Path) -> (f64, String) {
    let metrics = String::from_utf8(
        kiln(&[
            "eval",
            "--config",
            config.to_str().unwrap(),
            "--checkpoint",
            checkpoint.to_str().unwrap(),
        ])
        .stdout,
    )
    .unwrap();
    let accuracy = metrics
        .lines()
        .find_map(|l| l.strip_prefix("accuracy"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (accuracy, metrics)
}

#[test]
fn killed_run_resumes_bitwise() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("resume");
    let cfg = config(&dir, 2);
    let cfg = cfg.to_str().unwrap();
    let (a, b) = (dir.join("uninterrupted"), dir.join("killed"));
    // Long enough that the kill at step 20 lands well before the end.
    train(cfg, &a, &["--epochs", "10"]);
    let reference = losses(&a);
    assert!(
        reference.len() > 50,
        "expected a few epochs of steps, got {}",
        reference.len()
    );

    // Start the same run, and SIGKILL it once a checkpoint past step 20 exists.
    let mut child = Command::new(KILN)
        .args([
            "train",
            "--config",
            cfg,
            "--output",
            b.to_str().unwrap(),
            "--epochs",
            "10",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let target = b.join("checkpoints/step-00000020.safetensors");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !target.exists() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint appeared at {}",
            target.display()
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before it could be killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL: no chance to clean up
    child.wait().unwrap();
    let last = b.join("checkpoints/last.safetensors");
    let checkpoint = Checkpoint::load(&last).expect("the last checkpoint must load after a kill");
    // The kill may land between writing step 20 and pointing `last` at it.
    assert!(checkpoint.step >= 15 && checkpoint.step < reference.len() as u64);

    train(cfg, &b, &["--epochs", "10", "--resume", "auto"]);
    let resumed = losses(&b);
    assert_eq!(
        resumed.len(),
        reference.len(),
        "steps.csv rows after resume"
    );
    assert_same_run(&resumed, &reference, "resumed");
}

/// A copy of the checkpoint `from` at `to` without `kiln.data_order`, as a
/// Kiln from before the loaders took PyTorch's order wrote it.
fn unstamped(from: &Path, to: &Path) -> Checkpoint {
    let (tensors, mut meta) = StateDict::load_safetensors(from).unwrap();
    assert_eq!(
        meta.remove("kiln.data_order").as_deref(),
        Some(kiln::core::rng::EPOCH_ORDER),
        "the trainer stamps its checkpoints"
    );
    tensors.save_safetensors(to, &meta).unwrap();
    Checkpoint::load(to).unwrap()
}

/// A checkpoint of an older Kiln (no `kiln.data_order`, another shuffle):
/// written mid-epoch it is refused, naming the file and what to do; at an
/// epoch boundary it resumes.
#[test]
fn an_older_kiln_s_checkpoint_resumes_only_at_an_epoch_boundary() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("data-order");
    let cfg = config(&dir, 0);
    let cfg = cfg.to_str().unwrap();
    let run = dir.join("run");
    let out = run.to_str().unwrap();
    // 45 steps of one epoch; checkpoints at steps 35, 40 and 45 are kept.
    train(cfg, &run, &["--epochs", "1"]);
    let checkpoints = run.join("checkpoints");
    let (mid, boundary) = (
        dir.join("old-mid.safetensors"),
        dir.join("old-end.safetensors"),
    );
    let old_mid = unstamped(&checkpoints.join("step-00000040.safetensors"), &mid);
    let old_end = unstamped(&checkpoints.join("step-00000045.safetensors"), &boundary);
    assert_eq!((old_mid.epoch, old_mid.batch_in_epoch), (0, 40));
    assert_eq!((old_end.epoch, old_end.batch_in_epoch), (1, 0));
    assert_eq!(old_mid.data_order, None);
    let shown = kiln_stdout(&["inspect", mid.to_str().unwrap()]);
    assert!(shown.contains("data order  not recorded"), "{shown}");

    let steps = std::fs::read_to_string(run.join("steps.csv")).unwrap();
    let err = kiln_fails(&[
        "train",
        "--config",
        cfg,
        "--output",
        out,
        "--epochs",
        "2",
        "--resume",
        mid.to_str().unwrap(),
    ]);
    for part in [
        mid.to_str().unwrap(),
        "stands at batch 40 of epoch 0",
        "by an older Kiln, whose shuffled data order differs",
        "Resume from a checkpoint written at the end of an epoch",
        "start the run over",
    ] {
        assert!(err.contains(part), "no {part:?} in:\n{err}");
    }
    assert_eq!(
        std::fs::read_to_string(run.join("steps.csv")).unwrap(),
        steps,
        "nothing written"
    );

    train(
        cfg,
        &run,
        &["--epochs", "2", "--resume", boundary.to_str().unwrap()],
    );
    assert_eq!(losses(&run).len(), 2 * 45);
    let last = Checkpoint::load(&checkpoints.join("last.safetensors")).unwrap();
    assert_eq!(
        last.data_order.as_deref(),
        Some(kiln::core::rng::EPOCH_ORDER)
    );
}

#[test]
fn loader_order_does_not_depend_on_workers() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("workers");
    let cfg = config(&dir, 0);
    let (one, four) = (dir.join("w1"), dir.join("w4"));
    let cfg = cfg.to_str().unwrap();
    train(cfg, &one, &["--workers", "1", "--max-steps", "30"]);
    train(cfg, &four, &["--workers", "4", "--max-steps", "30"]);
    assert_same_run(&losses(&four), &losses(&one), "4 workers vs 1");
}

#[test]
fn inspect_eval_predict_and_config_errors() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("tools");
    let cfg = config(&dir, 0);
    let cfg = cfg.to_str().unwrap();
    let out = dir.join("run");
    train(cfg, &out, &["--epochs", "2"]);
    let last = out.join("checkpoints/last.safetensors");
    let table = String::from_utf8(kiln(&["inspect", last.to_str().unwrap()]).stdout).unwrap();
    assert!(
        table.contains("model.0.weight") && table.contains("[64, 64]"),
        "{table}"
    );
    assert!(
        table.contains("optimizer.state.0.weight.exp_avg"),
        "{table}"
    );

    let (accuracy, metrics) = eval_accuracy(Path::new(cfg), &last);
    assert!(accuracy > 0.8, "{metrics}");

    let predictions = dir.join("predictions.csv");
    kiln(&[
        "predict",
        "--config",
        cfg,
        "--checkpoint",
        last.to_str().unwrap(),
        "--output",
        predictions.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&predictions).unwrap();
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), 360);
    let correct = rows
        .iter()
        .filter(|r| {
            let c: Vec<&str> = r.split(',').collect();
            c[1] == c[2]
        })
        .count() as f64
        / 360.0;
    assert!(
        (correct - accuracy).abs() < 1e-6, // eval prints six decimals
        "predict and eval agree: {correct} vs {accuracy}"
    );

    // A typo in the config names the key and the allowed values.
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(cfg)
            .unwrap()
            .replace("type = \"adam\"", "type = \"adm\""),
    )
    .unwrap();
    let out = Command::new(KILN)
        .args(["train", "--config", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("adm") && err.contains("adamw") && err.contains("optimizer"),
        "{err}"
    );

    // A file that is not a checkpoint.
    let out = Command::new(KILN).args(["inspect", cfg]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.toml"));
}

/// `--precision` (or `[training] precision`): bf16-mixed, bf16-true, 16-mixed
/// (with loss scaling: its scale is in the checkpoint) and 16-true train to the
/// accuracy float32 reaches here, `eval` of the run's checkpoint uses the run's
/// precision (its written config), and the weights are stored in the
/// precision's parameter dtype. The TensorFlow backend refuses them by name.
#[test]
fn half_precisions_train_and_evaluate() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("precision");
    let cfg = config(&dir, 0);
    let cfg = cfg.to_str().unwrap();
    for (precision, dtype) in [
        ("bf16-mixed", "float32"),
        ("bf16-true", "bfloat16"),
        ("16-mixed", "float32"),
        ("16-true", "float16"),
    ] {
        let out = dir.join(precision);
        // Adam's default eps (1e-8) is below float16's range, where 16-true keeps
        // Adam's state: such a run needs a larger one, as in PyTorch (see below).
        let eps_cfg = dir.join("config-eps.toml");
        std::fs::write(
            &eps_cfg,
            std::fs::read_to_string(cfg)
                .unwrap()
                .replace("lr = 0.003", "lr = 0.003\neps = 1e-4"),
        )
        .unwrap();
        let cfg = if precision == "16-true" {
            eps_cfg.to_str().unwrap()
        } else {
            cfg
        };
        let stdout = train(cfg, &out, &["--epochs", "2", "--precision", precision]);
        assert!(
            stdout.contains(&format!("on cpu in {precision}")),
            "{stdout}"
        );
        let run_config = out.join("config.toml");
        assert!(
            std::fs::read_to_string(&run_config)
                .unwrap()
                .contains(&format!("precision = \"{precision}\"")),
            "the run's config records its precision"
        );
        let last = out.join("checkpoints/last.safetensors");
        let table = String::from_utf8(kiln(&["inspect", last.to_str().unwrap()]).stdout).unwrap();
        let row = table
            .lines()
            .find(|l| l.contains("model.0.weight"))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(row.contains(dtype), "{precision}: {row}");
        assert_eq!(
            table.contains("grad_scaler.scale"),
            precision == "16-mixed",
            "{precision}: only 16-mixed checkpoints hold a loss scale: {table}"
        );

        let (accuracy, metrics) = eval_accuracy(&run_config, &last);
        assert!(accuracy > 0.8, "{precision}: {metrics}");
    }

    // 16-true with Adam's default eps: Kiln warns before training, and the run
    // stops on the NaN loss that follows, as the warning says it would.
    let out = Command::new(KILN)
        .args([
            "train",
            "--config",
            cfg,
            "--epochs",
            "2",
            "--precision",
            "16-true",
        ])
        .arg("--output")
        .arg(dir.join("16-true-default-eps"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("eps 1e-8 is below float16's range") && err.contains("eps = 1e-4"),
        "{err}"
    );
    assert!(!out.status.success() && err.contains("NaN"), "{err}");

    for precision in ["bf16-mixed", "16-mixed", "16-true"] {
        let out = Command::new(KILN)
            .args([
                "train",
                "--config",
                cfg,
                "--backend",
                "tensorflow",
                "--precision",
                precision,
                "--output",
                dir.join(format!("tf-{precision}")).to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(precision) && err.contains("torch backend"),
            "{err}"
        );
    }

    let out = Command::new(KILN)
        .args(["train", "--config", cfg, "--precision", "fp8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fp8") && err.contains("bf16-mixed"), "{err}");
}

/// The shipped config runs as the README's first command runs it (fewer epochs),
/// and leaves every output a user expects.
#[test]
fn the_shipped_config_trains_and_writes_every_output() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("shipped");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs/digits-cnn.toml");
    let out = kiln(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--output",
        dir.to_str().unwrap(),
        "--epochs",
        "3",
        "--no-progress",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let accuracy: f64 = stdout
        .split("accuracy ")
        .nth(1)
        .and_then(|rest| rest.split('%').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(accuracy > 90.0, "{stdout}");
    for file in [
        "steps.csv",
        "epochs.csv",
        "curves.png",
        "model.safetensors",
        "config.toml",
        "checkpoints/last.safetensors",
    ] {
        assert!(dir.join(file).is_file(), "{file} missing");
    }
    let events = std::fs::read_dir(dir.join("tensorboard")).unwrap().count();
    assert_eq!(events, 1, "one TensorBoard event file");
    let epochs = std::fs::read_to_string(dir.join("epochs.csv")).unwrap();
    assert_eq!(
        epochs.lines().count(),
        4,
        "a header and three epochs:\n{epochs}"
    );
}

/// `[training] ema`: the same training steps as without it (the losses are
/// equal), validation with the average (other validation losses), the
/// average checkpointed with its update count and written as the run's
/// `model.safetensors`, and a resumed run ending on the same average.
#[test]
fn ema_validates_checkpoints_resumes_and_writes_the_average() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("ema");
    let plain = config(&dir, 0);
    let text = std::fs::read_to_string(&plain).unwrap();
    let averaged = dir.join("ema.toml");
    std::fs::write(
        &averaged,
        text.replace(
            "[training]\n",
            "[training]\nema = { decay = 0.9, every_n_steps = 2, start_step = 4 }\n",
        ),
    )
    .unwrap();
    let (plain, averaged) = (plain.to_str().unwrap(), averaged.to_str().unwrap());
    let (a, b, c) = (dir.join("ema"), dir.join("plain"), dir.join("resumed"));
    train(averaged, &a, &["--epochs", "2"]);
    train(plain, &b, &["--epochs", "2"]);
    assert_eq!(
        losses(&a),
        losses(&b),
        "the average does not touch training"
    );
    let val_loss = |run: &Path| {
        let text = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
        let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
        let col = header.iter().position(|h| *h == "val_loss").unwrap();
        text.lines()
            .skip(1)
            .map(|l| l.split(',').nth(col).unwrap().parse::<f64>().unwrap())
            .collect::<Vec<_>>()
    };
    let (va, vb) = (val_loss(&a), val_loss(&b));
    assert!(va.iter().zip(&vb).all(|(x, y)| x != y), "{va:?} {vb:?}");

    let last = kiln::train::Checkpointer::last_path(&a.join("checkpoints"));
    let checkpoint = Checkpoint::load(&last).unwrap();
    let saved = checkpoint
        .averaged
        .as_ref()
        .expect("the checkpoint holds the average");
    let steps = losses(&a).len() as u64;
    assert_eq!(checkpoint.step, steps, "a checkpoint at the last step");
    assert_eq!(
        saved.updates,
        (4..=steps).filter(|s| s % 2 == 0).count() as u64
    );
    let (model, _) = StateDict::load_safetensors(a.join("model.safetensors")).unwrap();
    let (trained, _) = StateDict::load_safetensors(b.join("model.safetensors")).unwrap();
    for (name, t) in saved.tensors.iter() {
        assert_eq!(
            model.get(name),
            Some(t),
            "model.safetensors holds the average's {name}"
        );
        assert_ne!(trained.get(name), Some(t), "{name}");
    }

    // `buffers = false` keeps the model's running statistics; `validate = false`
    // validates the training weights, as a run without an average.
    let bn = text.replace(
        "  { type = \"relu\" },",
        "  { type = \"batch_norm1d\", num_features = 64 },\n  { type = \"relu\" },",
    );
    assert_ne!(bn, text);
    let (bn_plain, bn_ema) = (dir.join("bn.toml"), dir.join("bn-ema.toml"));
    std::fs::write(&bn_plain, &bn).unwrap();
    std::fs::write(
        &bn_ema,
        bn.replace(
            "[training]\n",
            "[training]\nema = { decay = 0.9, warmup = true, buffers = false, validate = false }\n",
        ),
    )
    .unwrap();
    let (d, e) = (dir.join("bn-ema"), dir.join("bn-plain"));
    train(bn_ema.to_str().unwrap(), &d, &["--epochs", "1"]);
    train(bn_plain.to_str().unwrap(), &e, &["--epochs", "1"]);
    assert_eq!(
        val_loss(&d)[..1],
        val_loss(&e)[..1],
        "validated with the training weights"
    );
    let (wd, _) = StateDict::load_safetensors(d.join("model.safetensors")).unwrap();
    let (we, _) = StateDict::load_safetensors(e.join("model.safetensors")).unwrap();
    assert_eq!(wd.get("1.running_mean"), we.get("1.running_mean"));
    assert_ne!(wd.get("1.weight"), we.get("1.weight"));
    let last = kiln::train::Checkpointer::last_path(&d.join("checkpoints"));
    let saved = Checkpoint::load(&last).unwrap().averaged.unwrap();
    assert!(saved.tensors.get("1.weight").is_some());
    assert!(saved.tensors.get("1.running_mean").is_none());

    train(averaged, &c, &["--epochs", "1"]);
    train(averaged, &c, &["--epochs", "2", "--resume", "auto"]);
    let (resumed, _) = StateDict::load_safetensors(c.join("model.safetensors")).unwrap();
    for (name, t) in model.iter() {
        assert!(
            resumed.get(name).unwrap().allclose(t, 1e-4, 1e-6),
            "the resumed run's average of {name}"
        );
    }
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

/// `[training] swa` through the CLI: the schedule anneals from the StepLR rate
/// in effect when averaging begins, the checkpoint holds the equal-weight
/// average, and `model.safetensors` is that average with batch norm's
/// statistics recomputed over the training data; a run resumed mid-average
/// ends with the same model.
#[test]
fn swa_anneals_averages_and_writes_the_average_with_its_statistics() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("swa");
    let text = std::fs::read_to_string(config(&dir, 0)).unwrap();
    let swa = text
        .replace(
            "  { type = \"relu\" },",
            "  { type = \"batch_norm1d\", num_features = 64 },\n  { type = \"relu\" },",
        )
        .replace(
            "[training]\n",
            "[training]\nswa = { lrs = 0.001, epoch_start = 1, annealing_epochs = 2, \
             annealing_strategy = \"linear\" }\n",
        );
    let cfg = dir.join("swa.toml");
    std::fs::write(&cfg, swa).unwrap();
    let cfg = cfg.to_str().unwrap();
    let (a, b) = (dir.join("swa"), dir.join("resumed"));
    train(cfg, &a, &["--epochs", "3"]);

    // Adam at 0.003, StepLR 0.7 after epoch 0, then SWALR from 0.0021 to 0.001
    // over two epochs, linearly: 0.0021, 0.00155.
    let text = std::fs::read_to_string(a.join("epochs.csv")).unwrap();
    let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "lr").unwrap();
    let lrs: Vec<f64> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect();
    for (got, want) in lrs.iter().zip([0.003, 0.0021, 0.00155]) {
        assert!((got - want).abs() < 1e-12, "{lrs:?}");
    }
    assert_eq!(lrs.len(), 3);

    let checkpoint = Checkpoint::load(&kiln::train::Checkpointer::last_path(
        &a.join("checkpoints"),
    ))
    .unwrap();
    let saved = checkpoint.averaged.as_ref().expect("the average is saved");
    assert_eq!(saved.method, kiln::train::AveragingMethod::Swa);
    assert_eq!(saved.updates, 2, "after epochs 1 and 2");
    assert!((saved.swa_lrs_from.as_ref().unwrap()[0] - 0.0021).abs() < 1e-15);
    assert!(
        saved.tensors.get("1.running_mean").is_none(),
        "parameters only"
    );
    let (model, _) = StateDict::load_safetensors(a.join("model.safetensors")).unwrap();
    for (name, t) in saved.tensors.iter() {
        assert_eq!(
            model.get(name),
            Some(t),
            "model.safetensors holds the average's {name}"
        );
        assert_ne!(checkpoint.model.get(name), Some(t), "{name} is averaged");
    }
    let steps_per_epoch = losses(&a).len() as f64 / 3.0;
    assert_eq!(
        model.get("1.num_batches_tracked").unwrap().to_f64_vec(),
        [steps_per_epoch],
        "one pass over the training batches"
    );
    assert_ne!(
        model.get("1.running_var"),
        checkpoint.model.get("1.running_var"),
        "statistics recomputed for the average"
    );

    // `validate = true` validates the average once it holds two epochs (one
    // is the weights themselves); `update_bn = false` keeps the training
    // weights' statistics; int(0.34 * 3) = 1 starts at the same epoch.
    let v_cfg = dir.join("swa-validate.toml");
    std::fs::write(
        &v_cfg,
        std::fs::read_to_string(cfg).unwrap().replace(
            "epoch_start = 1,",
            "epoch_start = 0.34, validate = true, update_bn = false,",
        ),
    )
    .unwrap();
    let v = dir.join("validated");
    train(v_cfg.to_str().unwrap(), &v, &["--epochs", "3"]);
    assert_eq!(losses(&v), losses(&a), "the same training");
    let val_loss = |run: &Path| {
        let text = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
        let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
        let col = header.iter().position(|h| *h == "val_loss").unwrap();
        text.lines()
            .skip(1)
            .map(|l| l.split(',').nth(col).unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let (va, vv) = (val_loss(&a), val_loss(&v));
    assert_eq!(va[..2], vv[..2], "{va:?} {vv:?}");
    assert_ne!(va[2], vv[2], "{va:?} {vv:?}");
    let v_last = Checkpoint::load(&kiln::train::Checkpointer::last_path(
        &v.join("checkpoints"),
    ))
    .unwrap();
    let (v_model, _) = StateDict::load_safetensors(v.join("model.safetensors")).unwrap();
    assert_eq!(
        v_model.get("1.running_var"),
        v_last.model.get("1.running_var"),
        "update_bn = false keeps the training statistics"
    );
    assert_eq!(
        v_model.get("0.weight"),
        model.get("0.weight"),
        "the same average"
    );

    train(cfg, &b, &["--epochs", "2"]);
    train(cfg, &b, &["--epochs", "3", "--resume", "auto"]);
    let (resumed, _) = StateDict::load_safetensors(b.join("model.safetensors")).unwrap();
    for (name, t) in model.iter() {
        assert!(
            resumed.get(name).unwrap().allclose(t, 1e-4, 1e-6),
            "the resumed run's {name}"
        );
    }
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
