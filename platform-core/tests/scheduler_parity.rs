//! Every scheduler against `torch.optim.lr_scheduler`, step by step, and
//! save/restore in the middle of each sequence.
//!
//! `tests/reference/schedulers.py` defines the cases (as Kiln configs) and
//! prints PyTorch's learning rates for two parameter groups.

use kiln_core::schedule::{LrScheduler, SchedulerConfig};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    base_lrs: Vec<f64>,
    steps: usize,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    config: serde_json::Value,
    metrics: Option<Vec<f64>>,
    lrs: Vec<Vec<f64>>,
    momentums: Option<Vec<Vec<f64>>>,
}

const REL: f64 = 1e-10;

fn assert_close(case: &str, what: &str, step: usize, ours: &[f64], torch: &[f64]) {
    assert_eq!(ours.len(), torch.len(), "{case}: {what} at step {step}");
    for (group, (a, b)) in ours.iter().zip(torch).enumerate() {
        assert!(
            kiln_testkit::close(*a, *b, REL),
            "{case}: {what} of group {group} after {step} steps: Kiln {a}, PyTorch {b}"
        );
    }
}

fn advance(sched: &mut dyn LrScheduler, case: &Case, step: usize) -> Vec<f64> {
    let result = match &case.metrics {
        Some(metrics) => sched.step_with_metric(metrics[step - 1]),
        None => sched.step(),
    };
    result.unwrap_or_else(|e| panic!("{}: step {step}: {e}", case.name))
}

fn check_momentum(sched: &dyn LrScheduler, case: &Case, step: usize) {
    match &case.momentums {
        Some(momentums) => {
            let ours = sched
                .momentums()
                .unwrap_or_else(|| panic!("{}: no momentum", case.name));
            assert_close(&case.name, "momentum", step, ours, &momentums[step]);
        }
        None => assert!(sched.momentums().is_none(), "{}", case.name),
    }
}

#[test]
fn schedulers_match_pytorch() {
    let Some(python) = kiln_testkit::python("schedulers_match_pytorch") else {
        return;
    };
    let stdout = kiln_testkit::run_reference_script!(&python, "schedulers.py", &[] as &[&str]);
    let reference: Reference = serde_json::from_str(&stdout).expect("script prints JSON");
    assert!(reference.cases.len() >= 8 && reference.steps >= 40);
    assert_eq!(reference.base_lrs.len(), 2);
    let mut reductions = 0;

    for case in &reference.cases {
        let config: SchedulerConfig = serde_json::from_value(case.config.clone())
            .unwrap_or_else(|e| panic!("{}: config {}: {e}", case.name, case.config));
        assert_eq!(case.lrs.len(), reference.steps + 1, "{}", case.name);

        let mut sched = config
            .build(&reference.base_lrs)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_close(&case.name, "lr", 0, sched.lrs(), &case.lrs[0]);
        check_momentum(sched.as_ref(), case, 0);
        for step in 1..=reference.steps {
            let lrs = advance(sched.as_mut(), case, step);
            assert_close(&case.name, "lr", step, &lrs, &case.lrs[step]);
            assert_eq!(lrs, sched.lrs(), "{}", case.name);
            assert_eq!(sched.last_epoch(), step as u64);
            check_momentum(sched.as_ref(), case, step);
        }
        if case.metrics.is_some() {
            reductions += case.lrs.windows(2).filter(|w| w[1][0] < w[0][0]).count();
        }

        // Save in the middle, restore into a fresh scheduler, continue.
        for split in [1, reference.steps / 3, reference.steps - 1] {
            let mut first = config.build(&reference.base_lrs).expect("valid");
            for step in 1..=split {
                advance(first.as_mut(), case, step);
            }
            let saved = first.state().expect("state").to_string();
            let state: serde_json::Value = serde_json::from_str(&saved).expect("JSON");
            let mut resumed = config.build(&reference.base_lrs).expect("valid");
            resumed
                .load_state(&state)
                .unwrap_or_else(|e| panic!("{}: load_state: {e}", case.name));
            assert_eq!(
                resumed.lrs(),
                first.lrs(),
                "{}: resumed at {split}",
                case.name
            );
            check_momentum(resumed.as_ref(), case, split);
            for step in split + 1..=reference.steps {
                let lrs = advance(resumed.as_mut(), case, step);
                let uninterrupted = advance(first.as_mut(), case, step);
                assert_eq!(
                    lrs, uninterrupted,
                    "{}: resumed at {split}, step {step}",
                    case.name
                );
                assert_close(&case.name, "resumed lr", step, &lrs, &case.lrs[step]);
            }
        }
    }
    // The plateau cases must exercise reductions (and with them the cooldowns).
    assert!(reductions >= 4, "only {reductions} plateau reductions");
}
