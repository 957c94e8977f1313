//! TensorBoard event files written by `TensorBoardSink`, read back by
//! TensorBoard's own `EventAccumulator` (`tests/reference/logger_tensorboard.py`,
//! which also checks every record's CRCs and protobuf by hand).

use std::collections::BTreeMap;

use kiln_train::{MetricSink, TensorBoardSink};
use serde::Deserialize;

#[derive(Deserialize)]
struct ReadBack {
    files: Vec<String>,
    records: usize,
    file_version: Option<String>,
    scalars: BTreeMap<String, Vec<(i64, f64)>>,
}

/// The value TensorBoard stores for `v`: the nearest f32.
fn stored(v: f64) -> f64 {
    f64::from(v as f32)
}

#[test]
fn event_files_read_back_in_tensorboard() {
    let Some(python) = kiln_testkit::python("event_files_read_back_in_tensorboard") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("tensorboard");
    let mut expected: BTreeMap<String, Vec<(i64, f64)>> = BTreeMap::new();
    let mut add = |tag: &str, step: u64, v: f64| {
        expected
            .entry(tag.to_string())
            .or_default()
            .push((step as i64, stored(v)));
    };

    let mut tb = TensorBoardSink::new(dir.path()).expect("create sink");
    assert!(tb.path().starts_with(dir.path()));
    let name = tb
        .path()
        .file_name()
        .and_then(|n| n.to_str())
        .expect("file name")
        .to_string();
    assert!(name.starts_with("events.out.tfevents."), "{name}");

    let mut records = 1; // the file-version event
    for epoch in 1..=3u64 {
        for i in 1..=40u64 {
            let step = (epoch - 1) * 40 + i;
            let loss = 2.0 / (step as f64 + 0.3) + 1e-9 * step as f64;
            let lr = 0.1 * 0.97f64.powi(step as i32);
            let mut values = vec![("loss".to_string(), loss), ("lr".to_string(), lr)];
            add("loss", step, loss);
            add("lr", step, lr);
            if step % 10 == 0 {
                // A tag that appears only on some steps, with extreme magnitudes.
                let grad = if step % 20 == 0 { -3.5e30 } else { 1.25e-38 };
                values.push(("grad_norm/layer.0".to_string(), grad));
                add("grad_norm/layer.0", step, grad);
            }
            tb.log_step(step, &values).expect("log_step");
            records += 1;
        }
        let values = [
            ("loss".to_string(), 1.0 / epoch as f64),
            ("val_loss".to_string(), 1.1 / epoch as f64),
            ("val_accuracy".to_string(), 1.0 - 0.3 / epoch as f64),
        ];
        for (tag, v) in &values {
            add(&format!("epoch/{tag}"), epoch, *v);
        }
        tb.log_epoch(epoch, &values).expect("log_epoch");
        records += 1;
    }
    tb.finish().expect("finish");

    let stdout = kiln_testkit::run_reference_script!(
        &python,
        "logger_tensorboard.py",
        &[dir.path().as_os_str()]
    );
    let back: ReadBack = serde_json::from_str(&stdout).expect("script prints JSON");
    assert_eq!(back.files, vec![name]);
    assert_eq!(back.records, records);
    assert_eq!(back.file_version.as_deref(), Some("brain.Event:2"));
    assert_eq!(
        back.scalars.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    for (tag, points) in &expected {
        assert_eq!(&back.scalars[tag], points, "tag {tag}");
    }
    assert_eq!(back.scalars["loss"].len(), 120);
    assert_eq!(back.scalars["epoch/val_accuracy"][2], (3, stored(0.9)));
}

#[test]
fn sinks_started_together_get_their_own_files() {
    let dir = kiln_testkit::TempDir::new("tensorboard-two");
    let mut a = TensorBoardSink::new(dir.path()).expect("first");
    let mut b = TensorBoardSink::new(dir.path()).expect("second");
    assert_ne!(a.path(), b.path());
    a.log_step(1, &[("x".into(), 1.0)]).expect("log a");
    b.log_step(1, &[("x".into(), 2.0)]).expect("log b");
    a.finish().expect("finish a");
    b.finish().expect("finish b");
    let files = std::fs::read_dir(dir.path()).expect("read dir").count();
    assert_eq!(files, 2);

    let err = a
        .log_step(2, &[("x".into(), 1.0), ("x".into(), 2.0)])
        .expect_err("duplicate name");
    assert!(
        matches!(err, kiln_core::Error::InvalidArgument { .. }),
        "{err}"
    );
    let err = a
        .log_step(u64::MAX, &[("x".into(), 1.0)])
        .expect_err("step beyond i64");
    assert!(err.to_string().contains("int64"), "{err}");
}

/// A resumed run's sink purges what the interrupted run logged after the
/// checkpoint, as TensorBoard shows it: every step once, the later value winning.
#[test]
fn a_resumed_run_does_not_show_steps_twice() {
    let Some(python) = kiln_testkit::python("a_resumed_run_does_not_show_steps_twice") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("tensorboard-resume");
    let mut first = TensorBoardSink::new(dir.path()).expect("first run");
    for step in 1..=10u64 {
        first
            .log_step(step, &[("loss".into(), step as f64)])
            .expect("log");
    }
    first.finish().expect("finish");
    // Killed after step 10, resumed from the checkpoint at step 6.
    let mut resumed = TensorBoardSink::resume(dir.path(), 6).expect("resumed run");
    for step in 7..=12u64 {
        resumed
            .log_step(step, &[("loss".into(), 100.0 + step as f64)])
            .expect("log");
    }
    resumed.finish().expect("finish");

    let stdout = kiln_testkit::run_reference_script!(
        &python,
        "logger_tensorboard.py",
        &[dir.path().as_os_str()]
    );
    let back: ReadBack = serde_json::from_str(&stdout).expect("script prints JSON");
    assert_eq!(back.files.len(), 2);
    let expected: Vec<(i64, f64)> = (1..=12)
        .map(|s| (s, if s <= 6 { s as f64 } else { 100.0 + s as f64 }))
        .collect();
    assert_eq!(back.scalars["loss"], expected);
}
