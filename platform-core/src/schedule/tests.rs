//! Hand-derived schedules, configuration parsing and state handling.
//! (`tests/scheduler_parity.rs` compares every schedule with PyTorch.)

use super::*;

fn steps(s: &mut dyn LrScheduler, n: usize) -> Result<Vec<Vec<f64>>> {
    (0..n).map(|_| s.step()).collect()
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-12 * x.abs().max(y.abs()).max(1e-300))
}

fn parse(json: &str) -> Result<SchedulerConfig> {
    serde_json::from_str(json).map_err(|e| Error::invalid_argument("json", e.to_string()))
}

#[test]
fn step_multi_step_and_exponential() -> Result<()> {
    let mut s = StepLr::new(
        StepLrConfig {
            step_size: 3,
            gamma: 0.1,
        },
        &[1.0, 2.0],
    )?;
    assert_eq!(s.lrs(), [1.0, 2.0]);
    let got = steps(&mut s, 4)?;
    assert_eq!(got[0], [1.0, 2.0]);
    assert_eq!(got[1], [1.0, 2.0]);
    assert!(close(&got[2], &[0.1, 0.2]), "{got:?}");
    assert!(close(&got[3], &[0.1, 0.2]), "{got:?}");
    assert_eq!(s.last_epoch(), 4);
    assert_eq!(s.base_lrs(), [1.0, 2.0]);
    assert_eq!(s.name(), "step_lr");

    let mut s = MultiStepLr::new(
        MultiStepLrConfig {
            milestones: vec![2, 2, 1],
            gamma: 0.5,
        },
        &[1.0],
    )?;
    let got: Vec<f64> = steps(&mut s, 3)?.into_iter().map(|l| l[0]).collect();
    // Unsorted milestones; 2 appears twice.
    assert_eq!(got, [0.5, 0.125, 0.125]);

    let mut s = ExponentialLr::new(ExponentialLrConfig { gamma: 0.9 }, &[1.0])?;
    let got = steps(&mut s, 3)?;
    assert!(close(&got[2], &[0.729]), "{got:?}");
    Ok(())
}

#[test]
fn cosine_schedules() -> Result<()> {
    let mut s = CosineAnnealingLr::new(
        CosineAnnealingLrConfig {
            t_max: 4,
            eta_min: 0.1,
        },
        &[1.1],
    )?;
    let got: Vec<f64> = steps(&mut s, 8)?.into_iter().map(|l| l[0]).collect();
    let expected: Vec<f64> = (1..=8)
        .map(|t| 0.1 + 0.5 * (1.0 + (std::f64::consts::PI * t as f64 / 4.0).cos()))
        .collect();
    assert!(close(&got, &expected), "{got:?}");
    assert!((got[3] - 0.1).abs() < 1e-15 && (got[7] - 1.1).abs() < 1e-15);

    // Periods 2, 4, 8: restarts after epochs 2 and 6.
    let mut s = CosineAnnealingWarmRestarts::new(
        CosineAnnealingWarmRestartsConfig {
            t_0: 2,
            t_mult: 2,
            eta_min: 0.0,
        },
        &[1.0],
    )?;
    let mut seen = Vec::new();
    for _ in 0..7 {
        s.step()?;
        seen.push((s.t_cur(), s.t_i()));
    }
    assert_eq!(
        seen,
        [(1, 2), (0, 4), (1, 4), (2, 4), (3, 4), (0, 8), (1, 8)]
    );
    assert_eq!(s.lrs(), [(1.0 + (std::f64::consts::PI / 8.0).cos()) / 2.0]);
    Ok(())
}

#[test]
fn linear_warmup_and_decay() -> Result<()> {
    let mut s = LinearLr::new(LinearLrConfig::default(), &[0.3])?;
    assert!(close(s.lrs(), &[0.1]));
    let got: Vec<f64> = steps(&mut s, 6)?.into_iter().map(|l| l[0]).collect();
    let expected = [
        0.3 * (1.0 / 3.0 + (2.0 / 3.0) / 5.0),
        0.3 * (1.0 / 3.0 + (2.0 / 3.0) * 2.0 / 5.0),
        0.3 * (1.0 / 3.0 + (2.0 / 3.0) * 3.0 / 5.0),
        0.3 * (1.0 / 3.0 + (2.0 / 3.0) * 4.0 / 5.0),
        0.3,
        0.3,
    ];
    assert!(close(&got, &expected), "{got:?}");

    let mut s = LinearLr::new(
        LinearLrConfig {
            start_factor: 1.0,
            end_factor: 0.0,
            total_iters: 2,
        },
        &[1.0],
    )?;
    assert_eq!(steps(&mut s, 3)?, [[0.5], [0.0], [0.0]]);

    let mut s = LinearLr::new(
        LinearLrConfig {
            start_factor: 0.5,
            end_factor: 1.0,
            total_iters: 0,
        },
        &[1.0],
    )?;
    assert_eq!(steps(&mut s, 2)?, [[0.5], [0.5]]);
    Ok(())
}

#[test]
fn one_cycle_phases_and_momentum() -> Result<()> {
    // total 10, pct 0.3: phase ends at steps 2 and 9.
    let config = OneCycleLrConfig::new(vec![1.0, 2.0], 10)
        .with_anneal_strategy(AnnealStrategy::Linear)
        .with_div_factors(10.0, 100.0);
    let mut s = OneCycleLr::new(config, &[0.5, 0.5])?;
    assert_eq!(s.base_lrs(), [0.1, 0.2]);
    assert_eq!(s.lrs(), [0.1, 0.2]);
    assert_eq!(s.momentums(), Some(&[0.95, 0.95][..]));
    let got = steps(&mut s, 10)?;
    assert!(close(&got[0], &[0.55, 1.1]), "{got:?}");
    assert_eq!(got[1], [1.0, 2.0]);
    // Momentum goes back up from 0.85 to 0.95 over steps 2..9, and past it at 10.
    let m = 0.85 + (0.95 - 0.85) * 8.0 / 7.0;
    assert!(
        close(s.momentums().unwrap_or_default(), &[m, m]),
        "{:?}",
        s.momentums()
    );
    // Step 10 is one past the last phase's end (pct > 1), as PyTorch allows.
    let last = 1.0 + (0.001 - 1.0) * (10.0 - 2.0) / 7.0;
    assert!(close(&[got[9][0]], &[last]), "{got:?}");
    let err = s.step().expect_err("past the cycle");
    assert!(err.to_string().contains("tried to step 11 times"), "{err}");
    assert_eq!(s.last_epoch(), 10);

    let config = OneCycleLrConfig::new(1.0, 10).with_momentum(false, 0.8, 0.9);
    let s = OneCycleLr::new(config, &[0.1])?;
    assert_eq!(s.momentums(), None);

    // pct_start * total_steps == 1 puts step 0 in a zero-length phase.
    let config = OneCycleLrConfig::new(1.0, 10).with_pct_start(0.1);
    let err = OneCycleLr::new(config, &[0.1]).expect_err("zero-length phase");
    assert!(err.to_string().contains("zero length"), "{err}");

    let config = OneCycleLrConfig::new(vec![1.0, 2.0], 10);
    let err = OneCycleLr::new(config, &[0.1]).expect_err("two max_lr, one group");
    assert_eq!(
        err.to_string(),
        "invalid argument `max_lr`: expected one value per parameter group (1), got 2"
    );
    Ok(())
}

#[test]
fn plateau_patience_cooldown_and_min_lr() -> Result<()> {
    let config = ReduceLrOnPlateauConfig {
        patience: 1,
        factor: 0.5,
        cooldown: 2,
        min_lr: PerGroup::Each(vec![0.0, 0.3]),
        ..Default::default()
    };
    let mut s = ReduceLrOnPlateau::new(config, &[1.0, 0.5])?;
    assert!(s.best().is_infinite());
    let metrics = [5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 3.0];
    let mut got = Vec::new();
    for m in metrics {
        got.push(s.step_with_metric(m)?);
    }
    // Epoch 4: 2 bad epochs > patience 1 -> halve (group 1 stops at its min_lr 0.3).
    // Epochs 5-6: cooldown. Epoch 7: bad 1. Epoch 8: bad 2 -> halve again;
    // group 1 would go 0.3 -> 0.3, a change below eps, so it stays.
    assert_eq!(
        got,
        [
            [1.0, 0.5],
            [1.0, 0.5],
            [1.0, 0.5],
            [0.5, 0.3],
            [0.5, 0.3],
            [0.5, 0.3],
            [0.5, 0.3],
            [0.25, 0.3],
            [0.25, 0.3],
        ]
    );
    assert_eq!(s.best(), 3.0);
    assert_eq!(s.cooldown_counter(), 1);
    assert_eq!(s.num_bad_epochs(), 0);
    let err = s.step().expect_err("needs a metric");
    assert!(err.to_string().contains("step_with_metric"), "{err}");
    // NaN never improves.
    s.step_with_metric(f64::NAN)?;
    s.step_with_metric(f64::NAN)?;
    assert_eq!(s.num_bad_epochs(), 1);

    let max = ReduceLrOnPlateauConfig {
        mode: PlateauMode::Max,
        threshold_mode: ThresholdMode::Abs,
        threshold: 0.5,
        patience: 0,
        ..Default::default()
    };
    let mut s = ReduceLrOnPlateau::new(max, &[1.0])?;
    assert_eq!(s.step_with_metric(1.0)?, [1.0]);
    assert_eq!(s.step_with_metric(1.4)?, [0.1]); // not 0.5 better
    Ok(())
}

#[test]
fn other_schedules_ignore_the_metric() -> Result<()> {
    let mut s = SchedulerConfig::from(ExponentialLrConfig { gamma: 0.5 }).build(&[1.0])?;
    assert_eq!(s.step_with_metric(123.0)?, [0.5]);
    assert_eq!(s.momentums(), None);
    Ok(())
}

fn all_configs() -> Vec<SchedulerConfig> {
    vec![
        StepLrConfig {
            step_size: 3,
            gamma: 0.5,
        }
        .into(),
        MultiStepLrConfig {
            milestones: vec![2, 5],
            gamma: 0.1,
        }
        .into(),
        ExponentialLrConfig { gamma: 0.9 }.into(),
        CosineAnnealingLrConfig {
            t_max: 5,
            eta_min: 0.01,
        }
        .into(),
        CosineAnnealingWarmRestartsConfig {
            t_0: 3,
            t_mult: 2,
            eta_min: 0.0,
        }
        .into(),
        LinearLrConfig::default().into(),
        OneCycleLrConfig::new(0.5, 12).with_three_phase(true).into(),
        ReduceLrOnPlateauConfig {
            patience: 1,
            cooldown: 1,
            ..Default::default()
        }
        .into(),
    ]
}

#[test]
fn state_round_trip_resumes_exactly() -> Result<()> {
    let metrics = [3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5];
    for config in all_configs() {
        let base = [0.1, 0.02];
        let mut full = config.build(&base)?;
        let mut reference = Vec::new();
        for m in metrics {
            reference.push(full.step_with_metric(m)?);
        }
        let mut first = config.build(&base)?;
        for m in &metrics[..5] {
            first.step_with_metric(*m)?;
        }
        let text = first.state()?.to_string();
        let state: Value = serde_json::from_str(&text)
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        let mut resumed = config.build(&base)?;
        resumed.load_state(&state)?;
        assert_eq!(resumed.last_epoch(), 5);
        assert_eq!(resumed.lrs(), first.lrs(), "{config:?}");
        for (i, m) in metrics.iter().enumerate().skip(5) {
            assert_eq!(
                resumed.step_with_metric(*m)?,
                reference[i],
                "{config:?} step {i}"
            );
        }
        assert_eq!(resumed.momentums(), full.momentums());
    }
    Ok(())
}

#[test]
fn load_state_rejects_foreign_states_and_leaves_scheduler_unchanged() -> Result<()> {
    let configs = all_configs();
    for (i, config) in configs.iter().enumerate() {
        let mut s = config.build(&[0.1, 0.2])?;
        s.step_with_metric(1.0)?;
        let before = (s.lrs().to_vec(), s.last_epoch());

        let other = configs[(i + 1) % configs.len()].build(&[0.1, 0.2])?;
        let err = s.load_state(&other.state()?).expect_err("other type");
        assert!(
            err.to_string()
                .contains(&format!("the state is of a `{}` scheduler", other.name())),
            "{err}"
        );
        let one_group = config.build(&[0.1])?;
        let err = s.load_state(&one_group.state()?).expect_err("group count");
        assert!(
            err.to_string()
                .contains("the state has 1 parameter groups, this scheduler 2"),
            "{err}"
        );
        let err = s
            .load_state(&serde_json::json!({"last_epoch": 3}))
            .expect_err("no name");
        assert!(err.to_string().contains("not a scheduler state"), "{err}");
        let mut broken = s.state()?;
        broken["last_epoch"] = Value::from("three");
        assert!(s.load_state(&broken).is_err());
        assert_eq!((s.lrs().to_vec(), s.last_epoch()), before);
    }
    Ok(())
}

#[test]
fn plateau_state_keeps_an_infinite_best() -> Result<()> {
    let mut s = ReduceLrOnPlateau::new(ReduceLrOnPlateauConfig::default(), &[0.1])?;
    let state = s.state()?;
    assert_eq!(state["best"], "inf");
    s.step_with_metric(2.0)?;
    let mut fresh = ReduceLrOnPlateau::new(ReduceLrOnPlateauConfig::default(), &[0.1])?;
    fresh.load_state(&state)?;
    assert_eq!(fresh.best(), f64::INFINITY);
    fresh.load_state(&s.state()?)?;
    assert_eq!(fresh.best(), 2.0);
    Ok(())
}

#[test]
fn configs_parse_with_torch_defaults() -> Result<()> {
    assert_eq!(
        parse(r#"{"type": "step_lr", "step_size": 30}"#)?,
        StepLrConfig {
            step_size: 30,
            gamma: 0.1
        }
        .into()
    );
    assert_eq!(
        parse(r#"{"type": "multi_step_lr", "milestones": [30, 80]}"#)?,
        MultiStepLrConfig {
            milestones: vec![30, 80],
            gamma: 0.1
        }
        .into()
    );
    assert_eq!(
        parse(r#"{"type": "exponential_lr", "gamma": 0.95}"#)?,
        ExponentialLrConfig { gamma: 0.95 }.into()
    );
    assert_eq!(
        parse(r#"{"type": "cosine_annealing_lr", "t_max": 100}"#)?,
        CosineAnnealingLrConfig {
            t_max: 100,
            eta_min: 0.0
        }
        .into()
    );
    assert_eq!(
        parse(r#"{"type": "cosine_annealing_warm_restarts", "t_0": 10}"#)?,
        CosineAnnealingWarmRestartsConfig {
            t_0: 10,
            t_mult: 1,
            eta_min: 0.0
        }
        .into()
    );
    assert_eq!(
        parse(r#"{"type": "linear_lr"}"#)?,
        LinearLrConfig::default().into()
    );
    assert_eq!(
        parse(r#"{"type": "one_cycle_lr", "max_lr": 0.1, "total_steps": 1000}"#)?,
        OneCycleLrConfig::new(0.1, 1000).into()
    );
    assert_eq!(
        parse(
            r#"{"type": "one_cycle_lr", "max_lr": [0.1, 0.01], "total_steps": 100,
                "anneal_strategy": "linear", "three_phase": true}"#
        )?,
        OneCycleLrConfig::new(vec![0.1, 0.01], 100)
            .with_anneal_strategy(AnnealStrategy::Linear)
            .with_three_phase(true)
            .into()
    );
    assert_eq!(
        parse(r#"{"type": "reduce_lr_on_plateau"}"#)?,
        ReduceLrOnPlateauConfig::default().into()
    );
    assert_eq!(
        parse(
            r#"{"type": "reduce_lr_on_plateau", "mode": "max", "threshold_mode": "abs",
                "min_lr": [0.001, 0.0001], "patience": 3}"#
        )?,
        ReduceLrOnPlateauConfig {
            mode: PlateauMode::Max,
            threshold_mode: ThresholdMode::Abs,
            min_lr: PerGroup::Each(vec![0.001, 0.0001]),
            patience: 3,
            ..Default::default()
        }
        .into()
    );
    let err = parse(r#"{"type": "step_lr", "step": 3}"#).expect_err("unknown field");
    assert!(err.to_string().contains("step"), "{err}");
    for config in all_configs() {
        let json = serde_json::to_string(&config)
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(parse(&json)?, config, "{json}");
    }
    Ok(())
}

#[test]
fn invalid_configs_and_base_lrs_are_rejected() {
    let cases: Vec<(SchedulerConfig, &str)> = vec![
        (
            StepLrConfig {
                step_size: 0,
                gamma: 0.1,
            }
            .into(),
            "invalid argument `step_size`: must be at least 1, got 0",
        ),
        (
            ExponentialLrConfig { gamma: f64::NAN }.into(),
            "invalid argument `gamma`: must be finite and >= 0, got NaN",
        ),
        (
            CosineAnnealingLrConfig {
                t_max: 0,
                eta_min: 0.0,
            }
            .into(),
            "invalid argument `t_max`: must be at least 1, got 0",
        ),
        (
            CosineAnnealingWarmRestartsConfig {
                t_0: 1,
                t_mult: 0,
                eta_min: 0.0,
            }
            .into(),
            "invalid argument `t_mult`: must be at least 1, got 0",
        ),
        (
            LinearLrConfig {
                start_factor: 0.0,
                ..Default::default()
            }
            .into(),
            "invalid argument `start_factor`: must be in (0, 1], got 0",
        ),
        (
            LinearLrConfig {
                end_factor: 1.5,
                ..Default::default()
            }
            .into(),
            "invalid argument `end_factor`: must be in [0, 1], got 1.5",
        ),
        (
            OneCycleLrConfig::new(0.1, 10).with_pct_start(1.5).into(),
            "invalid argument `pct_start`: must be in [0, 1], got 1.5",
        ),
        (
            OneCycleLrConfig::new(0.1, 0).into(),
            "invalid argument `total_steps`: must be at least 1, got 0",
        ),
        (
            ReduceLrOnPlateauConfig {
                factor: 1.0,
                ..Default::default()
            }
            .into(),
            "invalid argument `factor`: must be in [0, 1), got 1",
        ),
    ];
    for (config, message) in cases {
        assert_eq!(config.validate().expect_err(message).to_string(), message);
        assert_eq!(
            config.build(&[0.1]).expect_err(message).to_string(),
            message
        );
    }
    let config = SchedulerConfig::from(ExponentialLrConfig { gamma: 0.5 });
    assert_eq!(
        config.build(&[]).expect_err("no groups").to_string(),
        "invalid argument `base_lrs`: need the learning rate of at least one parameter group"
    );
    assert_eq!(
        config
            .build(&[0.1, -1.0])
            .expect_err("negative")
            .to_string(),
        "invalid argument `base_lrs`: group 1: learning rate must be finite and >= 0, got -1"
    );
    let plateau = SchedulerConfig::from(ReduceLrOnPlateauConfig {
        min_lr: PerGroup::Each(vec![0.0; 3]),
        ..Default::default()
    });
    assert!(plateau.build(&[0.1, 0.2]).is_err());
}
