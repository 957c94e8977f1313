//! The `kiln` CLI never loses a user's data, and resumes only what it can
//! resume exactly: each test drives the real binary in a scratch directory
//! through a situation a careless user creates, and checks that what was on
//! disk is untouched and the message says what to do.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, digits_available, kiln, scratch, serial, train, KILN};
use kiln::core::state_dict::StateDict;
use kiln::train::Checkpoint;

/// Runs `kiln args` in `cwd` (when given), expecting it to fail; its stderr.
fn fails_in(cwd: Option<&Path>, args: &[&str]) -> String {
    let mut command = Command::new(KILN);
    command.args(args).env("RUST_LOG", "warn");
    if let Some(dir) = cwd {
        command.current_dir(dir);
    }
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "kiln {args:?} succeeded:\n{stderr}");
    stderr
}

fn fails(args: &[&str]) -> String {
    fails_in(None, args)
}

/// Every file under `dir` with its bytes (a symbolic link: its target).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let kind = std::fs::symlink_metadata(&path).unwrap().file_type();
            if kind.is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                files.insert(path, target.to_string_lossy().as_bytes().to_vec());
            } else if kind.is_dir() {
                pending.push(path);
            } else {
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

/// A copy of the config at `config` with `from` replaced by `to`, as `name`.
fn edited(config: &Path, from: &str, to: &str, name: &str) -> PathBuf {
    let text = std::fs::read_to_string(config).unwrap();
    assert!(text.contains(from), "`{from}` not in the config");
    let path = config.with_file_name(name);
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
    path
}

fn refs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Cases 1 to 3: a new run into an existing run or a user's directory, and a
/// config error found only by the model's shapes, change nothing on disk.
#[test]
fn a_new_run_never_writes_over_anything() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("safety-new");
    let cfg = config(&dir, 0);
    let run = dir.join("run");
    train(s(&cfg), &run, &["--epochs", "1"]);
    let before = snapshot(&run);

    // 1. A fresh run into the existing run.
    let err = fails(&["train", "--config", s(&cfg), "--output", s(&run)]);
    assert!(
        err.contains("is not empty") && err.contains("--resume auto") && err.contains("--output"),
        "{err}"
    );
    assert_eq!(snapshot(&run), before, "the existing run is untouched");

    // 2. A model that does not fit the data, found before anything is written:
    // resuming with it, and starting it anew elsewhere.
    let bad = edited(
        &cfg,
        "in_features = 64, out_features = 10",
        "in_features = 32, out_features = 10",
        "bad-shape.toml",
    );
    let err = fails(&[
        "train",
        "--config",
        s(&bad),
        "--output",
        s(&run),
        "--resume",
        "auto",
    ]);
    assert!(
        err.contains("Linear") && err.contains("[32, 64]"),
        "names the layer and the shapes: {err}"
    );
    assert_eq!(snapshot(&run), before, "steps.csv and epochs.csv kept");
    let fresh = dir.join("fresh");
    fails(&["train", "--config", s(&bad), "--output", s(&fresh)]);
    assert!(
        !fresh.exists(),
        "nothing written for a config that cannot run"
    );

    // 3. output_dir = "." where the user keeps their config, and "".
    let user = dir.join("user");
    std::fs::create_dir(&user).unwrap();
    let mine = "# my notes\n".to_owned()
        + &std::fs::read_to_string(&cfg).unwrap().replace(
            &format!("\"{}\"", dir.join("default-out").display()),
            "\".\"",
        );
    std::fs::write(user.join("config.toml"), &mine).unwrap();
    let err = fails_in(Some(&user), &["train", "--config", "config.toml"]);
    assert!(
        err.contains("not empty") && err.contains("config.toml"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(user.join("config.toml")).unwrap(),
        mine
    );
    std::fs::write(user.join("empty.toml"), mine.replace("\".\"", "\"\"")).unwrap();
    let err = fails_in(Some(&user), &["train", "--config", "empty.toml"]);
    assert!(err.contains("output_dir"), "{err}");
    assert_eq!(std::fs::read_dir(&user).unwrap().count(), 2);
}

/// Case 4: `--resume auto` without `last.safetensors` resumes from the newest
/// step checkpoint; with files but no checkpoint at all it refuses.
#[test]
fn resume_auto_finds_the_newest_step_checkpoint() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("safety-auto");
    let cfg = config(&dir, 0);
    let run = dir.join("run");
    train(s(&cfg), &run, &["--epochs", "2"]);
    let last = run.join("checkpoints/last.safetensors");
    assert!(
        std::fs::symlink_metadata(&last)
            .unwrap()
            .file_type()
            .is_symlink(),
        "last.safetensors points at a step checkpoint, it is no second name of its bytes"
    );
    let steps_before = std::fs::read_to_string(run.join("steps.csv")).unwrap();
    std::fs::remove_file(&last).unwrap();
    let out = Command::new(KILN)
        .args([
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&run),
            "--resume",
            "auto",
            "--epochs",
            "3",
        ])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("resumed from") && stderr.contains("step-00000090.safetensors"),
        "{stderr}"
    );
    let steps = std::fs::read_to_string(run.join("steps.csv")).unwrap();
    assert!(
        steps.starts_with(&steps_before),
        "the first two epochs kept"
    );
    assert_eq!(steps.lines().count(), 1 + 3 * 45);

    // Files but no checkpoint: nothing to resume, and nothing to overwrite.
    std::fs::remove_dir_all(run.join("checkpoints")).unwrap();
    let before = snapshot(&run);
    let err = fails(&[
        "train",
        "--config",
        s(&cfg),
        "--output",
        s(&run),
        "--resume",
        "auto",
    ]);
    assert!(err.contains("no checkpoint"), "{err}");
    assert_eq!(snapshot(&run), before);

    // No run at all: `--resume auto` starts one (for jobs that always pass it).
    let new = dir.join("new");
    train(s(&cfg), &new, &["--resume", "auto", "--max-steps", "5"]);
    assert!(new.join("checkpoints/last.safetensors").exists());
}

/// Case 5: the best checkpoint by the monitored metric survives a resume; stale
/// temporary files of a crashed writer are removed.
#[test]
fn keep_best_survives_a_resume() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("safety-best");
    // The highest val_loss is the first epoch's: "best" in max mode, and never the last.
    let cfg = edited(
        &config(&dir, 0),
        "every_n_steps = 5\nkeep_last = 3",
        "keep_last = 1\nkeep_best = 1\nmonitor = \"val_loss\"\nmode = \"max\"",
        "best.toml",
    );
    let run = dir.join("run");
    train(s(&cfg), &run, &["--epochs", "2"]);
    let checkpoints = run.join("checkpoints");
    assert!(checkpoints.join("step-00000045.safetensors").exists());
    let stale = checkpoints.join("step-00000050.safetensors.tmp-4194303");
    std::fs::write(&stale, b"half a checkpoint").unwrap();
    train(s(&cfg), &run, &["--epochs", "3", "--resume", "auto"]);
    assert!(
        checkpoints.join("step-00000045.safetensors").exists(),
        "the best checkpoint is kept across the resume"
    );
    assert!(checkpoints.join("step-00000135.safetensors").exists());
    assert!(!checkpoints.join("step-00000090.safetensors").exists());
    assert!(
        !stale.exists(),
        "a crashed writer's temporary file is removed"
    );
}

/// Cases 6 to 8 and the checkpoint weak spots: a monitor that names no metric,
/// a checkpoint with optimizer state removed, of another dtype, of another
/// model definition, seed or optimizer, are refused with what differs.
#[test]
fn mismatched_or_damaged_checkpoints_are_refused() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("safety-checkpoints");
    let cfg = config(&dir, 0);
    let run = dir.join("run");

    // 6. A typo in checkpoint.monitor.
    let typo = edited(
        &cfg,
        "keep_last = 3",
        "keep_last = 3\nkeep_best = 1\nmonitor = \"val_acc\"",
        "typo.toml",
    );
    let err = fails(&["train", "--config", s(&typo), "--output", s(&run)]);
    assert!(
        err.contains("checkpoint.monitor")
            && err.contains("val_acc")
            && err.contains("val_accuracy"),
        "{err}"
    );
    assert!(!run.exists());

    train(s(&cfg), &run, &["--epochs", "1"]);
    let step = run.join("checkpoints/step-00000045.safetensors");
    let (tensors, meta) = StateDict::load_safetensors(&step).unwrap();
    let rewrite = |name: &str, keep: &dyn Fn(&str) -> bool, edit: &dyn Fn(&mut StateDict)| {
        let mut kept: StateDict = tensors
            .iter()
            .filter(|(k, _)| keep(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        edit(&mut kept);
        let path = dir.join(name);
        kept.save_safetensors(&path, &meta).unwrap();
        path
    };
    let resume = |checkpoint: &Path, config: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--config",
            s(config),
            "--output",
            s(&run),
            "--resume",
            s(checkpoint),
        ];
        args.extend_from_slice(extra);
        fails(&args)
    };

    // 7. Optimizer state removed: one tensor, or all of them.
    let one = rewrite(
        "one.safetensors",
        &|k| k != "optimizer.state.0.weight.exp_avg",
        &|_| {},
    );
    let err = resume(&one, &cfg, &[]);
    assert!(
        err.contains("optimizer tensors") && err.contains("one.safetensors"),
        "{err}"
    );
    let none = rewrite(
        "none.safetensors",
        &|k| !k.starts_with("optimizer."),
        &|_| {},
    );
    let err = resume(&none, &cfg, &[]);
    assert!(err.contains("optimizer tensors"), "{err}");

    // A weight of another dtype is refused, never cast.
    let int = rewrite("int.safetensors", &|_| true, &|sd| {
        let w = sd
            .get("model.0.weight")
            .unwrap()
            .to_dtype(kiln::core::DType::I32);
        sd.insert("model.0.weight", w);
    });
    let err = fails(&["eval", "--config", s(&cfg), "--checkpoint", s(&int)]);
    assert!(
        err.contains("0.weight") && err.contains("float32") && err.contains("int32"),
        "{err}"
    );
    let err = resume(&int, &cfg, &[]);
    assert!(err.contains("int32"), "{err}");

    // 8. The config is the source of truth: another definition is an error
    // for eval, predict and resume alike, showing both values.
    let wider = edited(
        &cfg,
        "in_features = 64, out_features = 64 }",
        "in_features = 64, out_features = 32 }",
        "wider.toml",
    );
    let wider = edited(
        &wider,
        "in_features = 64, out_features = 10",
        "in_features = 32, out_features = 10",
        "wider.toml",
    );
    for args in [
        vec!["eval", "--config", s(&wider), "--checkpoint", s(&step)],
        vec![
            "predict",
            "--config",
            s(&wider),
            "--checkpoint",
            s(&step),
            "--output",
            s(&dir.join("p.csv")),
        ],
    ] {
        let err = fails(&args);
        assert!(
            err.contains("model.layers[0].out_features")
                && err.contains("32")
                && err.contains("64"),
            "{err}"
        );
    }
    let err = resume(&step, &wider, &[]);
    assert!(err.contains("model.layers[0].out_features"), "{err}");

    // Another seed, another optimizer.
    let err = resume(&step, &cfg, &["--seed", "4"]);
    assert!(err.contains("seed 3") && err.contains("--seed 3"), "{err}");
    let sgd = edited(&cfg, "type = \"adam\"", "type = \"sgd\"", "sgd.toml");
    let err = resume(&step, &sgd, &[]);
    assert!(err.contains("`adam`") && err.contains("`sgd`"), "{err}");
    assert!(
        Checkpoint::load(&step).is_ok(),
        "the checkpoint itself is untouched"
    );
}

/// Case 9: `predict` writes over nothing unless told, and then replaces the file
/// whole, so a checkpoint behind a link survives.
#[test]
fn predict_never_writes_over_a_file_unless_told() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("safety-predict");
    let cfg = config(&dir, 0);
    let run = dir.join("run");
    train(s(&cfg), &run, &["--epochs", "1"]);
    let last = run.join("checkpoints/last.safetensors");
    let step = std::fs::canonicalize(&last).unwrap();
    let bytes = std::fs::read(&step).unwrap();
    let predict = |output: &Path, overwrite: bool| {
        let mut args = vec![
            "predict",
            "--config",
            s(&cfg),
            "--checkpoint",
            s(&step),
            "--output",
            s(output),
        ];
        if overwrite {
            args.push("--overwrite");
        }
        args.iter().map(|a| a.to_string()).collect::<Vec<_>>()
    };
    let err = fails(&refs(&predict(&last, false)));
    assert!(err.contains("--overwrite"), "{err}");
    assert_eq!(std::fs::read(&step).unwrap(), bytes);

    let mine = dir.join("mine.csv");
    std::fs::write(&mine, "my own file\n").unwrap();
    fails(&refs(&predict(&mine, false)));
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "my own file\n");
    kiln(&refs(&predict(&mine, true)));
    assert!(std::fs::read_to_string(&mine)
        .unwrap()
        .starts_with("index,predicted,label"));

    // Told to, it replaces the link itself: the step checkpoint keeps its bytes.
    kiln(&refs(&predict(&last, true)));
    assert_eq!(std::fs::read(&step).unwrap(), bytes);
    assert!(Checkpoint::load(&step).is_ok());
}

/// A child process that is killed when the test ends, failed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Case 10: a second run on a directory another run holds fails at once,
/// naming the holder's PID, and changes nothing.
#[test]
fn a_held_run_directory_names_its_holder() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("safety-lock");
    let cfg = config(&dir, 0);
    let run = dir.join("run");
    let mut child = KillOnDrop(
        Command::new(KILN)
            .args(["train", "--config", s(&cfg), "--output", s(&run)])
            .args(["--epochs", "1000"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !run.join("steps.csv").exists() {
        assert!(Instant::now() < deadline, "the first run never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = format!("PID {}", child.0.id());
    for extra in [&["--resume", "auto"][..], &[][..]] {
        let mut args = vec!["train", "--config", s(&cfg), "--output", s(&run)];
        args.extend_from_slice(extra);
        let err = fails(&args);
        assert!(err.contains(&pid) && err.contains("another run"), "{err}");
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    // The lock went with the process: the run resumes (for one step more),
    // with the first run's `--epochs`, however many epochs it got through.
    let step = Checkpoint::load(&run.join("checkpoints/last.safetensors"))
        .unwrap()
        .step;
    let one_more = (step + 1).to_string();
    train(
        s(&cfg),
        &run,
        &[
            "--resume",
            "auto",
            "--epochs",
            "1000",
            "--max-steps",
            &one_more,
        ],
    );
}

/// Labels outside the model's classes and NaN cells are refused when the data
/// loads, naming the file and the line; `val_fraction = 0` trains without a
/// validation split; `log_every` thins the step log.
#[test]
fn data_is_checked_when_it_loads() {
    let _serial = serial();
    let dir = scratch("safety-data");
    let csv = dir.join("data.csv");
    let mut rows = String::from("a,b,c,d,label\n");
    for i in 0..40 {
        rows.push_str(&format!(
            "{},{},{},{},{}\n",
            i % 3,
            i % 5,
            i % 7,
            i % 2,
            i % 3
        ));
    }
    std::fs::write(&csv, &rows).unwrap();
    let cfg = edited(
        &config(&dir, 0),
        "dataset = \"digits\"",
        &format!("dataset = \"csv\"\npath = \"{}\"", csv.display()),
        "csv.toml",
    );
    let cfg = edited(
        &cfg,
        "in_features = 64, out_features = 64",
        "in_features = 4, out_features = 16",
        "csv.toml",
    );
    let cfg = edited(
        &cfg,
        "in_features = 64, out_features = 10",
        "in_features = 16, out_features = 3",
        "csv.toml",
    );
    let cfg = edited(&cfg, "scale = 16.0", "scale = 1.0", "csv.toml");
    let run = |name: &str| dir.join(name);
    train(s(&cfg), &run("ok"), &["--epochs", "1"]);

    for (bad, line) in [("99", 8), ("-1", 8)] {
        let lines: Vec<String> = rows
            .lines()
            .enumerate()
            .map(|(i, l)| {
                if i + 1 == line {
                    format!("{},{bad}", l.rsplit_once(',').unwrap().0)
                } else {
                    l.to_owned()
                }
            })
            .collect();
        std::fs::write(&csv, lines.join("\n") + "\n").unwrap();
        let err = fails(&["train", "--config", s(&cfg), "--output", s(&run("bad"))]);
        assert!(
            err.contains("data.csv")
                && err.contains(&format!("line {line}"))
                && err.contains(&format!("label {bad}"))
                && err.contains("3 classes"),
            "{err}"
        );
        assert!(
            !err.contains("out of bounds"),
            "caught before libtorch: {err}"
        );
    }
    std::fs::write(&csv, rows.replacen("\n1,1,1,1,1\n", "\n1,nan,1,1,1\n", 1)).unwrap();
    let err = fails(&["train", "--config", s(&cfg), "--output", s(&run("nan"))]);
    assert!(
        err.contains("line 3") && err.contains("`b`") && err.contains("nan"),
        "{err}"
    );
    assert!(!run("bad").exists() && !run("nan").exists());

    // No validation split.
    std::fs::write(&csv, &rows).unwrap();
    let none = edited(
        &cfg,
        "scale = 1.0",
        "scale = 1.0\nval_fraction = 0.0",
        "none.toml",
    );
    let stdout = train(s(&none), &run("none"), &["--epochs", "2"]);
    assert!(stdout.contains("40 training and 0 validation"), "{stdout}");
    let epochs = std::fs::read_to_string(run("none").join("epochs.csv")).unwrap();
    assert!(!epochs.contains("val_"), "{epochs}");

    // log_every = 5: steps 5, 10, ...; the epoch log still names each epoch's last step.
    let sparse = edited(&cfg, "log_every = 1", "log_every = 5", "sparse.toml");
    train(
        s(&sparse),
        &run("sparse"),
        &["--epochs", "3", "--batch-size", "4"],
    );
    let steps: Vec<String> = std::fs::read_to_string(run("sparse").join("steps.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap().to_owned())
        .collect();
    // 32 training rows in batches of 4: 8 steps an epoch, 24 in all.
    assert_eq!(steps, ["5", "10", "15", "20"]);
    let epoch_steps: Vec<String> = std::fs::read_to_string(run("sparse").join("epochs.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().to_owned())
        .collect();
    assert_eq!(epoch_steps, ["8", "16", "24"]);
}

/// `reduce_lr_on_plateau` through the CLI: it trains past the first epoch, and
/// the learning rates it sets follow PyTorch's `ReduceLROnPlateau` fed the same
/// metric sequence.
#[test]
fn reduce_lr_on_plateau_follows_pytorch_through_the_cli() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let Some(python) = kiln_testkit::python("reduce_lr_on_plateau_follows_pytorch_through_the_cli")
    else {
        return;
    };
    let dir = scratch("safety-plateau");
    // val_loss falls every epoch, so in `max` mode every epoch but the first is bad.
    let cfg = edited(
        &config(&dir, 0),
        "type = \"step_lr\"\nstep_size = 1\ngamma = 0.7",
        "type = \"reduce_lr_on_plateau\"\nmonitor = \"val_loss\"\nmode = \"max\"\n\
         patience = 1\nfactor = 0.5\ncooldown = 1\nthreshold = 0.0",
        "plateau.toml",
    );
    let run = dir.join("run");
    train(s(&cfg), &run, &["--epochs", "7"]);
    let text = std::fs::read_to_string(run.join("epochs.csv")).unwrap();
    let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<f64>> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(|c| c.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), 7, "{text}");
    let metric: Vec<f64> = rows.iter().map(|r| r[col("val_loss")]).collect();
    let lrs: Vec<f64> = rows.iter().map(|r| r[col("lr")]).collect();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/plateau_lrs.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(
            serde_json::json!({
                "lr": 0.003, "mode": "max", "patience": 1, "factor": 0.5, "cooldown": 1,
                "threshold": 0.0, "metrics": metric,
            })
            .to_string(),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: Vec<f64> = serde_json::from_slice(&out.stdout).unwrap();
    // PyTorch's rate after stepping on epoch i is the one epoch i + 1 trains with:
    // one rate per metric, the last for an eighth epoch that did not run.
    assert_eq!(
        expected.len(),
        metric.len(),
        "PyTorch's rates: {expected:?}"
    );
    let trained_with = &expected[..expected.len() - 1];
    assert_eq!(lrs[0], 0.003);
    assert_eq!(
        lrs[1..].len(),
        trained_with.len(),
        "{lrs:?} vs {expected:?}"
    );
    for (i, (kiln, torch)) in lrs[1..].iter().zip(trained_with).enumerate() {
        assert!(
            (kiln - torch).abs() <= 1e-12 * torch,
            "epoch {}: {kiln} vs {torch}",
            i + 1
        );
    }
    assert!(
        lrs.last().unwrap() < &0.003,
        "the rate was reduced: {lrs:?}"
    );
}

/// `kiln inspect` recognises a TorchScript file and lists its parameters,
/// where it used to call it a truncated safetensors file.
#[test]
fn inspect_describes_a_torchscript_file() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("inspect_describes_a_torchscript_file") else {
        return;
    };
    let dir = scratch("safety-inspect");
    let model = dir.join("linear.pt");
    let status = Command::new(&python)
        .args([
            "-c",
            "import sys, torch; torch.jit.script(torch.nn.Linear(3, 2)).save(sys.argv[1])",
            s(&model),
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let listing = String::from_utf8(kiln(&["inspect", s(&model)]).stdout).unwrap();
    assert!(listing.starts_with("torchscript"), "{listing}");
    let weight = listing.lines().find(|l| l.starts_with("weight")).unwrap();
    assert!(
        weight.contains("float32") && weight.contains("[2, 3]"),
        "{listing}"
    );
    assert!(
        listing.contains("2 parameter tensors and 0 buffers, 8 values"),
        "{listing}"
    );
}

/// Writes an IDX file: `magic` (dtype and rank), the dims, the bytes.
fn write_idx(path: &Path, rank: u8, dims: &[u32], bytes: &[u8]) {
    let mut data = vec![0, 0, 0x08, rank];
    for d in dims {
        data.extend_from_slice(&d.to_be_bytes());
    }
    data.extend_from_slice(bytes);
    std::fs::write(path, data).unwrap();
}

/// An MNIST label outside the model's classes (255) is refused when the files
/// load, naming the directory, the split and the record, not by libtorch.
#[test]
fn an_mnist_label_outside_the_classes_names_its_record() {
    let _serial = serial();
    let dir = scratch("safety-mnist");
    let data = dir.join("mnist");
    std::fs::create_dir(&data).unwrap();
    for (split, n) in [("train", 12u32), ("t10k", 4)] {
        let pixels: Vec<u8> = (0..n * 16).map(|i| (i % 251) as u8).collect();
        write_idx(
            &data.join(format!("{split}-images-idx3-ubyte")),
            3,
            &[n, 4, 4],
            &pixels,
        );
        let mut labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        if split == "train" {
            labels[7] = 255;
        }
        write_idx(
            &data.join(format!("{split}-labels-idx1-ubyte")),
            1,
            &[n],
            &labels,
        );
    }
    let cfg = edited(
        &config(&dir, 0),
        "dataset = \"digits\"",
        &format!("dataset = \"mnist\"\npath = \"{}\"", data.display()),
        "mnist.toml",
    );
    let cfg = edited(
        &cfg,
        "in_features = 64, out_features = 64",
        "in_features = 16, out_features = 64",
        "mnist.toml",
    );
    let err = fails(&[
        "train",
        "--config",
        s(&cfg),
        "--output",
        s(&dir.join("run")),
    ]);
    assert!(
        err.contains("training labels")
            && err.contains("record 7")
            && err.contains("label 255")
            && err.contains("10 classes"),
        "{err}"
    );
    assert!(!dir.join("run").exists());
}

/// A checkpoint whose optimizer tensors were stripped is refused however its
/// metadata was edited to match, naming what is missing: with the count set to
/// 0 (the record `kiln.optimizer_state` names the missing entries), and with
/// the record removed too, as a file from before it (the resume checks the
/// state against the config's Adam, which keeps moments from its first step).
/// Plain SGD, which keeps no moments, still resumes.
#[test]
fn a_stripped_optimizer_state_is_refused_whatever_its_metadata_says() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("safety-stripped");
    let cfg = config(&dir, 0);
    let run = dir.join("run");
    train(s(&cfg), &run, &["--max-steps", "10"]);
    let step = run.join("checkpoints/step-00000010.safetensors");
    let (tensors, meta) = StateDict::load_safetensors(&step).unwrap();
    let rewrite = |name: &str, keep: &dyn Fn(&str) -> bool, drop_meta: &[&str]| {
        let kept: StateDict = tensors
            .iter()
            .filter(|(k, _)| keep(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut meta = meta.clone();
        let count = kept.keys().filter(|k| k.starts_with("optimizer.")).count();
        meta.insert("kiln.optimizer_tensors".to_owned(), count.to_string());
        for key in drop_meta {
            meta.remove(*key);
        }
        let path = dir.join(name);
        kept.save_safetensors(&path, &meta).unwrap();
        path
    };
    let resume = |checkpoint: &Path| {
        fails(&[
            "train",
            "--config",
            s(&cfg),
            "--output",
            s(&run),
            "--resume",
            s(checkpoint),
        ])
    };

    let stripped = rewrite(
        "stripped.safetensors",
        &|k| !k.starts_with("optimizer."),
        &[],
    );
    let err = resume(&stripped);
    for wanted in [
        "stripped.safetensors",
        "kiln.optimizer_state",
        "missing",
        "`exp_avg`",
        "`exp_avg_sq`",
    ] {
        assert!(err.contains(wanted), "no {wanted:?} in\n{err}");
    }

    let unrecorded = rewrite(
        "unrecorded.safetensors",
        &|k| !k.starts_with("optimizer."),
        &["kiln.optimizer_state"],
    );
    let err = resume(&unrecorded);
    for wanted in [
        "unrecorded.safetensors",
        "step 10",
        "adam",
        "exp_avg and exp_avg_sq",
        "`state.0.weight.step`",
    ] {
        assert!(err.contains(wanted), "no {wanted:?} in\n{err}");
    }

    // The moments alone removed, the step counts kept.
    let momentless = rewrite(
        "momentless.safetensors",
        &|k| !k.ends_with(".exp_avg") && !k.ends_with(".exp_avg_sq"),
        &["kiln.optimizer_state"],
    );
    let err = resume(&momentless);
    assert!(
        err.contains("momentless.safetensors") && err.contains("state.0.weight.exp_avg"),
        "{err}"
    );

    let sgd = edited(&cfg, "type = \"adam\"", "type = \"sgd\"", "sgd.toml");
    let sgd_run = dir.join("sgd");
    train(s(&sgd), &sgd_run, &["--max-steps", "10"]);
    train(
        s(&sgd),
        &sgd_run,
        &["--resume", "auto", "--max-steps", "12"],
    );
}
