//! The TensorBoard views of a run (`StepViews`): the gradient norms per group
//! and in total, as the step applied them (clipped), against PyTorch step by
//! step; each group's learning rate; weight and gradient histograms of the
//! step's tensors; the misclassified validation images
//! (`MisclassifiedImages`).

use std::sync::{Arc, Mutex};

use super::serial;
use super::weight_averaging::{classes, spec};
use kiln::core::model::{Layer, LinearConfig};
use kiln::core::{
    backend::TrainBackend,
    loss::Loss,
    optim::{GradClip, OptimizerConfig, ParamGroup, ParamSelector, SgdConfig},
    Result,
};
use kiln::data::{InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::TorchBackend as B;
use kiln::train::{
    LoggedImage, MetricSink, MisclassifiedImages, StepViews, Trainer, TrainerConfig, TrainingState,
    MISCLASSIFIED_TAG,
};

const BATCH: usize = 8;

/// What the trainer gave its sinks.
#[derive(Default)]
struct Seen {
    steps: Vec<(u64, Vec<(String, f64)>)>,
    histograms: Vec<(u64, Vec<(String, HostTensor)>)>,
    images: Vec<(u64, Vec<LoggedImage>)>,
    texts: Vec<(u64, String, String)>,
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
    fn log_images(&mut self, step: u64, images: &[LoggedImage]) -> Result<()> {
        self.0.lock().unwrap().images.push((step, images.to_vec()));
        Ok(())
    }
    fn log_text(&mut self, step: u64, tag: &str, markdown: &str) -> Result<()> {
        let text = (step, tag.to_owned(), markdown.to_owned());
        self.0.lock().unwrap().texts.push(text);
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

/// `Trainer::with_misclassified_images`: after each validation the sinks get
/// one grid and one table, at the epoch's number; the table's samples are the
/// first ones the trained model gets wrong (by `predict`), with the classes'
/// names; a loss without class indices, or no validation data, is refused
/// before the first step.
#[test]
fn misclassified_images_are_the_first_the_model_gets_wrong() {
    let _serial = serial();
    let (x, y) = classes(21);
    let rows = x.dims()[0];
    // The 4 features of a row as a 2x2 grey image.
    let images = x.reshape([rows, 1, 2, 2]).unwrap();
    let model = |seed| {
        B::manual_seed(seed);
        let spec = Layer::sequential([
            Layer::Flatten {
                start_dim: 1,
                end_dim: -1,
            },
            LinearConfig::new(4, 3).into(),
        ]);
        let model = B::build_model(&spec, Device::Cpu).unwrap();
        let opt = model
            .build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(0.05)), &[])
            .unwrap();
        TrainingState::<B>::new(model, opt, None)
    };
    let loader = || {
        SequentialLoader::new(
            InMemoryDataset::new(images.clone(), y.clone()).unwrap(),
            BATCH,
        )
        .unwrap()
    };
    let view =
        MisclassifiedImages::new(5).with_class_names(vec!["a".into(), "b".into(), "c".into()]);
    let trainer = |loss: Loss| {
        let config = TrainerConfig {
            epochs: 2,
            ..TrainerConfig::default()
        };
        Trainer::<B>::new(config, loss)
            .unwrap()
            .with_misclassified_images(view.clone())
    };
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut state = model(4);
    let mut fit = trainer(Loss::cross_entropy()).with_sink(Recorder(Arc::clone(&seen)));
    fit.fit(&mut state, &loader(), Some(&loader())).unwrap();

    // The trained model's own mistakes, in order.
    let outputs = fit.predict(&mut state.model, &loader()).unwrap();
    let scores: Vec<f64> = outputs.iter().flat_map(HostTensor::to_f64_vec).collect();
    let labels = y.as_slice::<i64>().unwrap();
    let wrong: Vec<(usize, usize)> = scores
        .chunks(3)
        .enumerate()
        .filter_map(|(i, row)| {
            let best = (0..3).fold(0, |b, c| if row[c] > row[b] { c } else { b });
            (best as i64 != labels[i]).then_some((i, best))
        })
        .collect();
    assert!(wrong.len() > 5, "the test needs mistakes: {}", wrong.len());
    let seen = seen.lock().unwrap();
    assert_eq!(seen.texts.len(), 2);
    assert_eq!(
        seen.images
            .iter()
            .map(|(s, i)| (*s, i.len()))
            .collect::<Vec<_>>(),
        [(0, 1), (1, 1)]
    );
    let (step, tag, table) = seen.texts.last().unwrap();
    assert_eq!((*step, tag.as_str()), (1, MISCLASSIFIED_TAG));
    assert!(
        table.starts_with(&format!(
            "Epoch 1: {} of {rows} validation samples misclassified; the first 5 shown",
            wrong.len()
        )),
        "{table}"
    );
    let names = ["a", "b", "c"];
    for (k, (sample, predicted)) in wrong.iter().take(5).enumerate() {
        let class = labels[*sample] as usize;
        let row = format!(
            "| {} | {sample} | {} ({class}) | {} ({predicted}) |",
            k + 1,
            names[class],
            names[*predicted]
        );
        assert!(table.contains(&row), "{row} not in\n{table}");
    }
    // Five 2x2 images in one row of make_grid: 5 * (2 + 2) + 2 by 2 + 2 + 2.
    let image = &seen.images[1].1[0];
    assert_eq!(
        (
            image.tag.as_str(),
            image.width,
            image.height,
            image.channels
        ),
        (MISCLASSIFIED_TAG, 22, 6, 1)
    );
    assert!(image.png.starts_with(b"\x89PNG"));

    // Refused before the first step: regression targets, no validation data.
    for (loss, val, expected) in [
        (Loss::mse(), true, "MSELoss"),
        (Loss::cross_entropy(), false, "there is none"),
    ] {
        let mut state = model(4);
        let val_loader = loader();
        let err = trainer(loss)
            .fit(&mut state, &loader(), val.then_some(&val_loader as _))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("misclassified_images") && err.contains(expected),
            "{err}"
        );
        assert_eq!(state.step, 0, "no step taken");
    }
}
