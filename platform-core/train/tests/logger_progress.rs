//! `ProgressSink` without a terminal and `LogSink`: the `log` lines they write.

use std::sync::{Mutex, OnceLock};

use kiln_train::{LogSink, MetricSink, ProgressSink};

/// Every `log` record of this test binary, with the name of the thread that wrote it.
struct Capture(Mutex<Vec<(String, String)>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        let thread = std::thread::current().name().unwrap_or("").to_string();
        if let Ok(mut lines) = self.0.lock() {
            lines.push((thread, format!("{} {}", record.level(), record.args())));
        }
    }
    fn flush(&self) {}
}

fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let c: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        log::set_logger(c).expect("no other logger in this test binary");
        log::set_max_level(log::LevelFilter::Info);
        c
    })
}

/// The lines this thread logged, with the samples/s figures (timings) cut out.
fn my_lines() -> Vec<String> {
    let me = std::thread::current().name().unwrap_or("").to_string();
    capture()
        .0
        .lock()
        .expect("lock")
        .iter()
        .filter(|(t, _)| *t == me)
        .map(|(_, line)| match line.find(" (") {
            Some(i) if line.ends_with("samples/s)") => line[..i].to_string(),
            _ => line.clone(),
        })
        .collect()
}

#[test]
fn progress_without_a_terminal_logs_every_n_batches() {
    capture();
    let mut p = ProgressSink::plain(2).expect("interval");
    assert!(ProgressSink::plain(0).is_err());
    p.set_total(5);
    // Batch sizes 10, 10, 10, 10, 4 with losses 1, 0.5, 0.25, 0.125, 2.
    for (size, loss) in [(10, 1.0), (10, 0.5), (10, 0.25), (10, 0.125), (4, 2.0)] {
        p.inc(size, loss);
    }
    assert_eq!(p.batches(), 5);
    let mean = (10.0 * (1.0 + 0.5 + 0.25 + 0.125) + 4.0 * 2.0) / 44.0;
    assert_eq!(p.mean_loss(), Some(mean));
    p.log_step(5, &[("loss".into(), 2.0)]).expect("log_step");
    p.log_epoch(1, &[("loss".into(), mean), ("val_loss".into(), 0.6)])
        .expect("log_epoch");
    assert_eq!(p.mean_loss(), None);

    // The next epoch is numbered 2, and an epoch of unknown length works too.
    for _ in 0..3 {
        p.inc(8, 0.5);
    }
    p.log_epoch(2, &[("loss".into(), 0.5)]).expect("log_epoch");
    p.finish().expect("finish");

    assert_eq!(
        my_lines(),
        [
            "INFO epoch 1 batch 2/5: loss 0.7500",
            "INFO epoch 1 batch 4/5: loss 0.4688",
            // (10 * 1.875 + 4 * 2) / 44 = 0.60795...
            "INFO epoch 1 batch 5/5: loss 0.6080",
            "INFO epoch 1: loss 0.6080, val_loss 0.6000",
            "INFO epoch 2 batch 2: loss 0.5000",
            "INFO epoch 2: loss 0.5000",
        ]
    );
}

#[test]
fn progress_through_the_sink_trait_uses_the_trainers_epoch_numbers() {
    capture();
    let mut sinks: Vec<Box<dyn MetricSink>> = vec![
        Box::new(ProgressSink::plain(3).expect("interval")),
        // Sinks without progress ignore the epoch and batch calls.
        Box::new(LogSink::every(1000).expect("interval")),
    ];
    for epoch in [0, 1] {
        for sink in &mut sinks {
            sink.start_epoch(epoch, Some(3)).expect("start_epoch");
        }
        for loss in [0.25, 0.5, 0.75] {
            for sink in &mut sinks {
                sink.log_batch(2, loss).expect("log_batch");
            }
        }
        for sink in &mut sinks {
            sink.log_epoch(epoch, &[("loss".into(), 0.5)])
                .expect("log_epoch");
        }
    }
    assert_eq!(
        my_lines(),
        [
            "INFO epoch 0 batch 3/3: loss 0.5000",
            "INFO epoch 0: loss 0.5000",
            "INFO epoch 0: loss 0.5000",
            "INFO epoch 1 batch 3/3: loss 0.5000",
            "INFO epoch 1: loss 0.5000",
            "INFO epoch 1: loss 0.5000",
        ]
    );
}

#[test]
fn progress_detects_the_terminal_without_failing() {
    // Under `cargo test` stderr may or may not be a terminal; either way the
    // sink must accept a whole epoch.
    let mut p = ProgressSink::new().with_interval(1).expect("interval");
    p.set_total(3);
    for _ in 0..3 {
        p.inc(16, 0.25);
    }
    p.log_epoch(1, &[("loss".into(), 0.25)]).expect("log_epoch");
    p.set_total(2);
    p.inc(16, 0.5);
    p.finish().expect("finish an interrupted epoch");
    assert_eq!(p.mean_loss(), Some(0.5));
}

#[test]
fn log_sink_writes_info_lines() {
    capture();
    let mut sink = LogSink::every(10).expect("interval");
    assert!(LogSink::every(0).is_err());
    for step in [5, 10, 20, 25] {
        sink.log_step(
            step,
            &[("loss".into(), 1.0 / step as f64), ("lr".into(), 3e-4)],
        )
        .expect("log_step");
    }
    sink.log_epoch(1, &[("val_accuracy".into(), 0.98765)])
        .expect("log_epoch");
    sink.finish().expect("finish");
    assert_eq!(
        my_lines(),
        [
            "INFO step 10: loss 0.1000, lr 3.000e-4",
            "INFO step 20: loss 0.0500, lr 3.000e-4",
            "INFO epoch 1: val_accuracy 0.9877",
        ]
    );
    let mut every = LogSink::new();
    assert!(every
        .log_step(1, &[("a".into(), 1.0), ("a".into(), 1.0)])
        .is_err());
}
