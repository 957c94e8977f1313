//! The learning-rate range test (`kiln_train::find_lr`) against Lightning's
//! algorithm written out in PyTorch (`reference/lr_finder.py`), and the model
//! put back afterwards.

use kiln::core::{
    backend::TrainBackend,
    loss::Loss,
    optim::{OptimizerConfig, SgdConfig},
};
use kiln::data::{InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::TorchBackend as B;
use kiln::train::{find_lr, LrFinderConfig, LrSweep};

use super::serial;
use super::weight_averaging::{classes, spec};

#[test]
fn the_range_test_equals_lightnings_and_restores_the_model() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("learning-rate finder parity") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("lr-finder");
    let (x, y) = classes(11);
    let mut io = StateDict::new();
    io.insert("x", x.clone());
    io.insert("y", y.clone());
    io.save_safetensors(dir.path().join("data.safetensors"), &Default::default())
        .unwrap();
    let loader = SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), 8).unwrap();
    // 40 steps over 6 batches an epoch: the loader is gone through again. The
    // exponential sweep diverges before its end; the linear one to 0.5 does not.
    let cases = [
        (LrSweep::Exponential, 1e-4, 50.0, 40, true),
        (LrSweep::Linear, 1e-3, 0.5, 30, false),
    ];
    for (mode, min_lr, max_lr, num, diverges) in cases {
        B::manual_seed(5);
        let mut model = B::build_model(&spec(), Device::Cpu).unwrap();
        let weights = model.state_dict().unwrap();
        weights
            .save_safetensors(dir.path().join("init.safetensors"), &Default::default())
            .unwrap();
        let config = LrFinderConfig {
            min_lr,
            max_lr,
            num_training: num,
            mode,
            ..LrFinderConfig::default()
        };
        let sgd = OptimizerConfig::Sgd(SgdConfig::new(0.01).with_momentum(0.9));
        let result = find_lr(
            &mut model,
            &sgd,
            &[],
            &Loss::cross_entropy(),
            &loader,
            Device::Cpu,
            &config,
        )
        .unwrap();
        let mode_name = match mode {
            LrSweep::Exponential => "exponential",
            LrSweep::Linear => "linear",
        };
        let args = [
            dir.path().to_str().unwrap().to_owned(),
            min_lr.to_string(),
            max_lr.to_string(),
            num.to_string(),
            mode_name.to_owned(),
            "4".to_owned(),
            "8".to_owned(),
        ];
        let out = kiln_testkit::run_reference_script!(&python, "lr_finder.py", &args);
        let reference: serde_json::Value = serde_json::from_str(&out).unwrap();
        let list = |key: &str| -> Vec<f64> {
            reference[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        };
        let (lrs, losses) = (list("lrs"), list("losses"));
        assert_eq!(
            result.lrs.len(),
            lrs.len(),
            "{mode:?}: steps before the stop"
        );
        assert_eq!(result.stopped_early, diverges, "{mode:?}");
        assert_eq!(result.stopped_early, lrs.len() < num, "{mode:?}");
        kiln_testkit::assert_close("learning rates", &result.lrs, &lrs, 1e-12, "lr_finder.py");
        kiln_testkit::assert_close(
            "smoothed losses",
            &result.losses,
            &losses,
            1e-5,
            "lr_finder.py",
        );
        let suggestion = result.suggestion().expect("a suggestion");
        let expected = reference["suggestion"].as_f64().unwrap();
        assert!(
            (suggestion - expected).abs() <= 1e-12 * expected,
            "{mode:?}: suggested {suggestion}, Lightning's rule {expected}"
        );
        let on_log = result.suggestion_log().expect("a suggestion");
        let expected = reference["suggestion_log"].as_f64().unwrap();
        assert!(
            (on_log - expected).abs() <= 1e-12 * expected,
            "{mode:?}: suggested {on_log} on the log scale, PyTorch {expected}"
        );
        // The model is as it was, batch norm's statistics included.
        assert_eq!(model.state_dict().unwrap(), weights, "{mode:?}");
    }
}

#[test]
fn too_few_points_give_no_suggestion_and_bad_settings_are_refused() {
    let result = kiln::train::LrFinderResult {
        lrs: (0..12).map(|i| f64::from(i) * 0.1).collect(),
        losses: vec![1.0; 12],
        stopped_early: false,
    };
    assert_eq!(
        result.suggestion(),
        None,
        "one point after skipping 10 and 1"
    );
    let bad = LrFinderConfig {
        min_lr: 1.0,
        max_lr: 0.1,
        ..LrFinderConfig::default()
    };
    assert!(bad.validate().unwrap_err().to_string().contains("min_lr"));
}
