//! `kiln train --profile`: the trace and the operators by self time, against
//! the trace read by Python.

use std::path::Path;

use super::common::{config, digits_available, kiln_fails, kiln_stdout, losses, scratch, serial};

/// A profile's table, `ops.csv`: name -> (calls, self µs, total µs).
fn profile_rows(dir: &Path) -> std::collections::BTreeMap<String, (u64, f64, f64)> {
    let text = std::fs::read_to_string(dir.join("ops.csv")).unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("name,calls,self_cpu_us,cpu_total_us,self_device_us")
    );
    lines
        .map(|l| {
            // Operator names hold no comma here (a quoted one would).
            let cells: Vec<&str> = l.split(',').collect();
            let number = |i: usize| cells[i].parse::<f64>().unwrap();
            (
                cells[0].to_owned(),
                (cells[1].parse().unwrap(), number(2), number(3)),
            )
        })
        .collect()
}

/// What every profile holds, on either engine: `steps` steps, each waiting once
/// for its batch; rows by self time, which never exceeds the total; and the
/// same sums from the trace file, read by an independent script.
fn check_profile(python: &Path, profile: &Path, steps: u64) {
    let rows = profile_rows(profile);
    let calls = |name: &str| rows.get(name).map_or(0, |r| r.0);
    assert_eq!(calls("ProfilerStep*"), steps, "{rows:?}");
    assert_eq!(calls("kiln::data_loader_wait"), steps);
    let table = std::fs::read_to_string(profile.join("ops.txt")).unwrap();
    assert!(table.starts_with(&format!("{steps} steps, ")), "{table}");
    assert!(table.contains("Self CPU %") && table.contains("Self CPU time total"));
    let csv = std::fs::read_to_string(profile.join("ops.csv")).unwrap();
    let selfs: Vec<f64> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(2).unwrap().parse().unwrap())
        .collect();
    assert!(selfs.windows(2).all(|w| w[0] >= w[1]), "{csv}");
    assert!(rows.values().all(|r| r.1 <= r.2 + 1e-9));

    let stdout = kiln_testkit::run_reference_script!(
        python,
        "profile_trace.py",
        &[profile.join("trace.json").as_os_str()]
    );
    let reference: std::collections::BTreeMap<String, (u64, f64, f64)> =
        serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        rows.keys().collect::<Vec<_>>()
    );
    for (name, (calls, self_us, total_us)) in &reference {
        let row = rows[name];
        // The trace's times are whole nanoseconds, as the events', but a self
        // time is a total less its children's, each rounded in the trace: a
        // row with many children (ProfilerStep*) gathers their roundings.
        let tolerance = 0.002 * *calls as f64 + 1e-3 + 1e-6 * self_us.abs().max(*total_us);
        assert_eq!(row.0, *calls, "{name}");
        assert!(
            (row.1 - self_us).abs() <= tolerance,
            "{name}: {row:?} vs {self_us}"
        );
        assert!(
            (row.2 - total_us).abs() <= tolerance,
            "{name}: {row:?} vs {total_us}"
        );
    }
}

/// `kiln train --profile steps=3..7`: libtorch's profiler records steps 3 to 6;
/// the trace, read back by an independent script, sums to the table's numbers;
/// the operators' counts are the model's; windows the run cannot record and
/// files in the way are refused before anything is written.
#[test]
fn profile_writes_the_trace_and_the_operators_by_self_time() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let Some(python) = kiln_testkit::python("the profiler's trace") else {
        return;
    };
    let dir = scratch("profile");
    let cfg = config(&dir, 0);
    let cfg = cfg.to_str().unwrap();
    let run = dir.join("run");
    let out = run.to_str().unwrap();
    let args = |profile: &'static str| {
        vec![
            "train",
            "--config",
            cfg,
            "--output",
            out,
            "--epochs",
            "1",
            "--profile",
            profile,
        ]
    };
    // 1,438 training examples in batches of 32: 45 steps.
    let err = kiln_fails(&args("steps=40..47"));
    assert!(err.contains("ends after step 45, the run's last"), "{err}");
    assert!(!run.exists(), "nothing written");
    let err = kiln_fails(&args("steps=7..3"));
    assert!(err.contains("START < END"), "{err}");

    let stdout = kiln_stdout(&args("steps=3..7"));
    assert!(!stdout.is_empty());
    let profile = run.join("profile");
    check_profile(&python, &profile, 4);
    let rows = profile_rows(&profile);
    let calls = |name: &str| rows.get(name).map_or(0, |r| r.0);
    // Per step: two linear layers, a dropout and Adam's (fused) update.
    assert_eq!(calls("aten::linear"), 8, "{rows:?}");
    assert_eq!(calls("aten::dropout"), 4);
    assert_eq!(calls("aten::_fused_adam_"), 4);
    // A resumed run profiling into the same directory: refused, the profile kept.
    let trace = std::fs::read(profile.join("trace.json")).unwrap();
    let err = kiln_fails(&[
        "train",
        "--config",
        cfg,
        "--output",
        out,
        "--epochs",
        "2",
        "--resume",
        "auto",
        "--profile",
        "steps=50..52",
    ]);
    assert!(err.contains("trace.json exists"), "{err}");
    assert_eq!(std::fs::read(profile.join("trace.json")).unwrap(), trace);
    assert_eq!(losses(&run).len(), 45, "the run was not resumed");

    // On TensorFlow: the session runs' step stats, TensorFlow's op types.
    let tf = dir.join("tf");
    kiln_stdout(&[
        "train",
        "--config",
        cfg,
        "--output",
        tf.to_str().unwrap(),
        "--epochs",
        "1",
        "--backend",
        "tensorflow",
        "--profile",
        "steps=3..7",
    ]);
    check_profile(&python, &tf.join("profile"), 4);
    let rows = profile_rows(&tf.join("profile"));
    assert!(rows.keys().any(|name| name.contains("MatMul")), "{rows:?}");
}
