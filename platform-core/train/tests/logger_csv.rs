//! `CsvSink` files, resuming them, and `History` read back from them.

use std::fs;
use std::io::Write;

use kiln_core::Error;
use kiln_train::{CsvSink, History, MetricSink};

fn v(pairs: &[(&str, f64)]) -> Vec<(String, f64)> {
    pairs.iter().map(|&(n, x)| (n.to_string(), x)).collect()
}

fn read(path: &std::path::Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn header_with_first_row_and_new_columns_widen_the_file() {
    let dir = kiln_testkit::TempDir::new("csv-widen");
    let mut sink = CsvSink::new(dir.path()).expect("sink");
    assert_eq!(sink.dir(), dir.path());
    sink.log_step(1, &v(&[("loss", 0.5), ("lr", 0.1)]))
        .expect("step 1");
    sink.log_step(2, &v(&[("lr", 0.05), ("loss", 1.0 / 3.0)]))
        .expect("step 2");
    sink.log_epoch(1, &v(&[("loss", 0.4)])).expect("epoch 1");
    // A value that appears later gets a column; earlier rows get empty cells.
    sink.log_step(3, &v(&[("loss", 1e-7), ("grad_norm", 12.5)]))
        .expect("step 3");
    sink.log_step(4, &v(&[("loss", f64::INFINITY)]))
        .expect("step 4");
    sink.log_epoch(
        2,
        &v(&[("loss", 0.3), ("val_loss", 0.35), ("val_accuracy", 0.875)]),
    )
    .expect("epoch 2");
    sink.finish().expect("finish");

    assert_eq!(
        read(&dir.path().join("steps.csv")),
        "step,loss,lr,grad_norm\n\
         1,0.5,0.1,\n\
         2,0.3333333333333333,0.05,\n\
         3,1e-7,,12.5\n\
         4,inf,,\n"
    );
    assert_eq!(
        read(&dir.path().join("epochs.csv")),
        "epoch,step,loss,val_loss,val_accuracy\n\
         1,2,0.4,,\n\
         2,4,0.3,0.35,0.875\n"
    );

    let history = History::from_csv(dir.path()).expect("history from the directory");
    assert_eq!(history.len(), 2);
    assert_eq!(history.names(), ["loss", "val_loss", "val_accuracy"]);
    assert_eq!(history.series("loss"), [(1, 0.4), (2, 0.3)]);
    assert_eq!(history.series("val_loss"), [(2, 0.35)]);
    assert_eq!(history.get(1, "val_loss"), None);
    let same = History::from_csv(dir.path().join("epochs.csv")).expect("history from the file");
    assert_eq!(same, history);
}

#[test]
fn resume_drops_rows_after_the_checkpoint_and_appends() {
    let dir = kiln_testkit::TempDir::new("csv-resume");
    let mut sink = CsvSink::new(dir.path()).expect("sink");
    for epoch in 1..=3u64 {
        for i in 1..=4u64 {
            let step = (epoch - 1) * 4 + i;
            sink.log_step(step, &v(&[("loss", step as f64 / 8.0)]))
                .expect("step");
        }
        sink.log_epoch(
            epoch,
            &v(&[("loss", epoch as f64), ("val_loss", epoch as f64 + 0.5)]),
        )
        .expect("epoch");
    }
    sink.flush().expect("flush");
    drop(sink);
    // A crash in the middle of writing a row leaves half a line.
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(dir.path().join("steps.csv"))
        .expect("open");
    f.write_all(b"13,0.12").expect("partial row");
    drop(f);

    // The checkpoint was taken at step 6, in epoch 2: epoch 1 is kept, epoch 2 is redone.
    let mut sink = CsvSink::resume(dir.path(), 6).expect("resume");
    for step in 7..=8u64 {
        sink.log_step(step, &v(&[("loss", 0.0), ("lr", 0.01)]))
            .expect("step");
    }
    sink.log_epoch(2, &v(&[("loss", 2.25)])).expect("epoch");
    sink.finish().expect("finish");

    assert_eq!(
        read(&dir.path().join("steps.csv")),
        "step,loss,lr\n1,0.125,\n2,0.25,\n3,0.375,\n4,0.5,\n5,0.625,\n6,0.75,\n7,0.0,0.01\n8,0.0,0.01\n"
    );
    assert_eq!(
        read(&dir.path().join("epochs.csv")),
        "epoch,step,loss,val_loss\n1,4,1.0,1.5\n2,8,2.25,\n"
    );
    let history = History::from_csv(dir.path()).expect("history");
    assert_eq!(history.series("loss"), [(1, 1.0), (2, 2.25)]);

    // Resuming where no files exist starts them fresh.
    let fresh = kiln_testkit::TempDir::new("csv-resume-fresh");
    let mut sink = CsvSink::resume(fresh.path(), 100).expect("resume without files");
    sink.log_step(101, &v(&[("loss", 1.5)])).expect("step");
    sink.finish().expect("finish");
    assert_eq!(
        read(&fresh.path().join("steps.csv")),
        "step,loss\n101,1.5\n"
    );
    assert_eq!(read(&fresh.path().join("epochs.csv")), "");
}

#[test]
fn bad_names_and_bad_files_are_typed_errors() {
    let dir = kiln_testkit::TempDir::new("csv-errors");
    let mut sink = CsvSink::new(dir.path()).expect("sink");
    for bad in ["a,b", "say \"hi\"", "two\nlines", "step"] {
        let err = sink.log_step(1, &v(&[(bad, 1.0)])).expect_err(bad);
        assert!(matches!(err, Error::InvalidArgument { .. }), "{bad}: {err}");
    }
    let err = sink
        .log_step(1, &v(&[("a", 1.0), ("a", 2.0)]))
        .expect_err("duplicate");
    assert!(err.to_string().contains("appears twice"), "{err}");
    sink.finish().expect("finish");
    // Nothing was written by the rejected calls.
    assert_eq!(read(&dir.path().join("steps.csv")), "");

    fs::write(dir.path().join("steps.csv"), "step,loss\n1,0.5\nx,0.25\n").expect("write");
    let err = CsvSink::resume(dir.path(), 5).expect_err("malformed step");
    match &err {
        Error::Data { path, reason, .. } => {
            assert_eq!(path, &dir.path().join("steps.csv"));
            assert!(reason.starts_with("line 3:"), "{reason}");
        }
        other => panic!("unexpected error {other}"),
    }
    fs::write(dir.path().join("steps.csv"), "time,loss\n1,0.5\n").expect("write");
    let err = CsvSink::resume(dir.path(), 5).expect_err("foreign header");
    assert!(err.to_string().contains("`step`"), "{err}");

    fs::write(dir.path().join("epochs.csv"), "epoch,step,loss\n1,3,abc\n").expect("write");
    let err = History::from_csv(dir.path()).expect_err("not a number");
    assert!(err.to_string().contains("`abc`"), "{err}");
    let missing = dir.path().join("nope.csv");
    assert!(matches!(History::from_csv(&missing), Err(Error::Io { path, .. }) if path == missing));
}
