//! Weight averaging through the CLI: `[training] ema` and `swa`.

use std::path::Path;

use super::common::{config, digits_available, kiln_stdout, losses, scratch, serial, train};
use super::epoch_column;
use kiln::core::state_dict::StateDict;
use kiln::train::Checkpoint;

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
    let val_loss = |run: &Path| epoch_column(run, "val_loss");
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
    // `kiln inspect` lists the average with its tensors.
    let printed = kiln_stdout(&["inspect", last.to_str().unwrap()]);
    assert!(
        printed.contains(&format!(
            "averaged    EMA of {} updates, {} tensors",
            saved.updates,
            saved.tensors.len()
        )),
        "{printed}"
    );
    for (name, t) in saved.tensors.iter() {
        let row = printed
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&format!("averaged.{name}")))
            .unwrap_or_else(|| panic!("no averaged.{name} in\n{printed}"));
        assert!(row.ends_with(&t.numel().to_string()), "{row}");
    }
    assert!(
        printed.contains(&format!("{} averaged tensors", saved.tensors.len())),
        "{printed}"
    );

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
    let lrs = epoch_column(&a, "lr");
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
    let val_loss = |run: &Path| epoch_column(run, "val_loss");
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
