//! The TensorBoard views of a run (`StepViews`): the gradient norms per group
//! and in total, as the step applied them (clipped), against PyTorch step by
//! step; each group's learning rate; weight and gradient histograms of the
//! step's tensors.

use std::sync::{Arc, Mutex};

use super::serial;
use super::weight_averaging::{classes, spec};
use kiln::core::{
    backend::TrainBackend,
    loss::Loss,
    optim::{GradClip, OptimizerConfig, ParamGroup, ParamSelector, SgdConfig},
    Result,
};
use kiln::data::{InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::TorchBackend as B;
use kiln::train::{MetricSink, StepViews, Trainer, TrainerConfig, TrainingState};

const BATCH: usize = 8;

/// What the trainer gave its sinks.
#[derive(Default)]
struct Seen {
    steps: Vec<(u64, Vec<(String, f64)>)>,
    histograms: Vec<(u64, Vec<(String, HostTensor)>)>,
}

struct Recorder(Arc<Mutex<Seen>>);

impl MetricSink for Recorder {
    fn log_step(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        self.0.lock().unwrap().steps.push((step, values.to_vec()));
        Ok(())
    }
    fn log_epoch(&mut self, _epoch: u64, _values: &[(String, f64)]) -> Result<()> {
        Ok(())
    }
    fn log_histograms(&mut self, step: u64, tensors: &[(String, HostTensor)]) -> Result<()> {
        self.0
            .lock()
            .unwrap()
            .histograms
            .push((step, tensors.to_vec()));
        Ok(())
    }
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

#[test]
fn gradient_norms_and_rates_per_group_match_pytorch_and_histograms_hold_the_step() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("TensorBoard views") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("step-views");
    let (x, y) = classes(13);
    let rows = x.dims()[0];
    let mut io = StateDict::new();
    io.insert("x", x.clone());
    io.insert("y", y.clone());
    io.save_safetensors(dir.path().join("data.safetensors"), &Default::default())
        .unwrap();
    B::manual_seed(9);
    let model = B::build_model(&spec(), Device::Cpu).unwrap();
    model
        .state_dict()
        .unwrap()
        .save_safetensors(dir.path().join("init.safetensors"), &Default::default())
        .unwrap();
    let groups = [ParamGroup::new("first", ParamSelector::Prefix("0.".to_owned())).with_lr(0.05)];
    let opt = model
        .build_optimizer(
            &OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9)),
            &groups,
        )
        .unwrap();
    let mut state = TrainingState::<B>::new(model, opt, None);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let epochs = 2;
    let steps = epochs * (rows / BATCH) as u64;
    let mut trainer = Trainer::<B>::new(
        TrainerConfig {
            epochs,
            log_every: 1,
            clip: Some(GradClip::norm(0.5)),
            ..TrainerConfig::default()
        },
        Loss::cross_entropy(),
    )
    .unwrap()
    .with_sink(Recorder(Arc::clone(&seen)))
    .with_step_views(StepViews {
        lr_per_group: true,
        grad_norms: true,
        histograms_every: steps / 2,
        graph: false,
    });
    let loader = SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), BATCH).unwrap();
    trainer.fit(&mut state, &loader, None).unwrap();

    let args = [
        dir.path().to_str().unwrap().to_owned(),
        steps.to_string(),
        BATCH.to_string(),
        "0.5".to_owned(),
    ];
    kiln_testkit::run_reference_script!(&python, "grad_norms.py", &args);
    let (reference, _) = StateDict::load_safetensors(dir.path().join("out.safetensors")).unwrap();
    let norms = reference.get("norms").unwrap().to_f64_vec();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.steps.len() as u64, steps);
    let mut clipped = 0;
    for ((step, row), want) in seen.steps.iter().zip(norms.chunks(2)) {
        let get = |name: &str| {
            row.iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("step {step}: no {name} in {row:?}"))
                .1
        };
        for (i, want) in want.iter().enumerate() {
            let got = get(&format!("grad_norm/group_{i}"));
            assert!(
                (got - want).abs() <= 1e-5 * want.max(1e-3),
                "step {step} group {i}: {got} vs PyTorch {want}"
            );
        }
        let total = (want[0] * want[0] + want[1] * want[1]).sqrt();
        assert!((get("grad_norm/total") - total).abs() <= 1e-5 * total);
        clipped += usize::from((total - 0.5).abs() < 1e-5);
        assert_eq!((get("lr/group_0"), get("lr/group_1")), (0.05, 0.1));
    }
    assert!(clipped > 0, "some steps were clipped to 0.5");

    // The histograms of the last step are of the trained weights and the last gradients.
    let (step, tensors) = seen.histograms.last().expect("histograms");
    assert_eq!(*step, steps);
    assert_eq!(seen.histograms.len(), 2);
    let trained = state.model.state_dict().unwrap();
    for name in ["0.weight", "0.bias", "1.weight", "3.weight"] {
        let (_, t) = tensors
            .iter()
            .find(|(n, _)| *n == format!("weights/{name}"))
            .unwrap();
        assert_eq!(Some(t), trained.get(name), "{name}");
        let want = reference.get(&format!("weights.{name}")).unwrap();
        assert!(t.allclose(want, 1e-5, 1e-6), "{name} trained as in PyTorch");
        assert!(tensors
            .iter()
            .any(|(n, _)| *n == format!("gradients/{name}")));
    }
    assert!(
        !tensors.iter().any(|(n, _)| n.contains("running_")),
        "buffers are not parameters"
    );
}
