//! Preference training as an objective beside the supervised loss: SimPO
//! (`kiln::torch::Simpo`, TRL's `CPOTrainer` with `loss_type="simpo"`)
//! trained by the same Trainer, against the same computation in PyTorch step
//! for step (weights, the epochs' losses and TRL's metrics, validation); a
//! batch that is not pairs and a config out of range are errors naming them.

use super::serial;
use kiln::core::{
    backend::TrainBackend,
    model::{EmbeddingConfig, Layer, LinearConfig},
    objective::{Objective, ObjectiveBatch},
    optim::{OptimizerConfig, SgdConfig},
    Error,
};
use kiln::data::{InMemoryDataset, SequentialLoader};
use kiln::prelude::*;
use kiln::torch::{Simpo, SimpoConfig, TorchBackend as B};
use kiln::train::{Trainer, TrainerConfig, TrainingState};

const VOCAB: usize = 11;
const LENGTH: usize = 7;
const BATCH: usize = 4;

/// A bigram language model: `[rows, length]` ids to `[rows, length, vocab]` logits.
fn bigram() -> Layer {
    Layer::sequential([
        EmbeddingConfig::new(VOCAB, 6).into(),
        LinearConfig::new(6, VOCAB).into(),
    ])
}

/// `pairs` preference pairs: a 2- or 3-token prompt shared by both
/// completions (not trained), then each completion's tokens, some rows ending
/// in padding (not trained). The chosen completions count up by one token,
/// the rejected ones by three.
fn pairs(pairs: usize, seed: u64) -> (HostTensor, HostTensor) {
    let noise = kiln_testkit::noise(pairs * 2, seed);
    let (mut ids, mut labels) = (Vec::new(), Vec::new());
    for p in 0..pairs {
        let prompt = 2 + p % 2;
        let padding = p % 3;
        let start = (noise[2 * p].abs() * 97.0) as usize;
        for (c, stride) in [(0, 1), (1, 3)] {
            for t in 0..LENGTH {
                let token = ((start + (c + 1) * t * stride + p) % VOCAB) as i64;
                let pad = t >= LENGTH - padding;
                ids.push(if pad { 0 } else { token });
                labels.push(if pad || t < prompt { -100 } else { token });
            }
        }
    }
    (
        HostTensor::new(ids, [pairs, 2, LENGTH]).unwrap(),
        HostTensor::new(labels, [pairs, 2, LENGTH]).unwrap(),
    )
}

fn loader((x, y): (HostTensor, HostTensor)) -> SequentialLoader {
    SequentialLoader::new(InMemoryDataset::new(x, y).unwrap(), BATCH).unwrap()
}

fn config() -> SimpoConfig {
    SimpoConfig {
        beta: 2.0,
        gamma: 0.8,
        cpo_alpha: 0.5,
        label_smoothing: 0.1,
    }
}

#[test]
fn simpo_trains_as_trls_loss_in_pytorch() {
    let _serial = serial();
    let Some(python) = kiln_testkit::python("SimPO parity") else {
        return;
    };
    let dir = kiln_testkit::TempDir::new("simpo");
    let (train, val) = (pairs(16, 3), pairs(8, 4));
    for (name, (x, y)) in [("train", &train), ("val", &val)] {
        let mut io = StateDict::new();
        io.insert("x", x.clone());
        io.insert("y", y.clone());
        io.save_safetensors(
            dir.path().join(format!("{name}.safetensors")),
            &Default::default(),
        )
        .unwrap();
    }
    B::manual_seed(5);
    let model = B::build_model(&bigram(), Device::Cpu).unwrap();
    model
        .state_dict()
        .unwrap()
        .save_safetensors(dir.path().join("model.safetensors"), &Default::default())
        .unwrap();
    let opt = model
        .build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(0.5)), &[])
        .unwrap();
    let mut state = TrainingState::new(model, opt, None);
    let (epochs, accumulate) = (3, 2);
    let trainer_config = TrainerConfig {
        epochs,
        accumulate,
        log_every: 0,
        ..TrainerConfig::default()
    };
    let objective = Simpo::new(config()).unwrap();
    let history = Trainer::<B>::with_objective(trainer_config, objective)
        .unwrap()
        .fit(&mut state, &loader(train), Some(&loader(val)))
        .unwrap();
    let c = config();
    let args = [
        dir.path().to_str().unwrap().to_owned(),
        c.beta.to_string(),
        c.gamma.to_string(),
        c.cpo_alpha.to_string(),
        c.label_smoothing.to_string(),
        epochs.to_string(),
        BATCH.to_string(),
        accumulate.to_string(),
    ];
    kiln_testkit::run_reference_script!(&python, "simpo.py", &args);
    let (reference, _) = StateDict::load_safetensors(dir.path().join("out.safetensors")).unwrap();
    for (name, t) in state.model.state_dict().unwrap().iter() {
        let want = reference.get(&format!("model.{name}")).unwrap();
        assert!(
            t.allclose(want, 1e-5, 1e-6),
            "{name}: {:?} vs PyTorch {:?}",
            &t.to_f64_vec()[..3],
            &want.to_f64_vec()[..3]
        );
    }
    let metrics = Objective::<B>::metric_names(&Simpo::new(config()).unwrap(), &state.model);
    for epoch in 0..epochs {
        for name in std::iter::once("loss").chain(metrics.iter().map(String::as_str)) {
            for name in [name.to_owned(), format!("val_{name}")] {
                let got = history.get(epoch, &name).unwrap_or_else(|| {
                    panic!("epoch {epoch} has no `{name}`: {:?}", history.names())
                });
                let want = reference
                    .get(&format!("{epoch}.{name}"))
                    .unwrap()
                    .to_f64_vec()[0];
                assert!(
                    kiln_testkit::close(got, want, 1e-5),
                    "epoch {epoch} {name}: {got} vs PyTorch {want}"
                );
            }
        }
    }
    // Training widened the margin between chosen and rejected.
    let margin = |e| history.get(e, "rewards_margins").unwrap();
    assert!(
        margin(epochs - 1) > margin(0),
        "{} -> {}",
        margin(0),
        margin(epochs - 1)
    );
}

#[test]
fn simpo_names_a_batch_that_is_not_pairs_and_a_config_out_of_range() {
    let model = B::build_model(&bigram(), Device::Cpu).unwrap();
    let simpo = Simpo::new(SimpoConfig::default()).unwrap();
    let flat = B::from_host(
        &HostTensor::new(vec![1i64; 14], [2, 7]).unwrap(),
        Device::Cpu,
    )
    .unwrap();
    let batch = ObjectiveBatch {
        inputs: &flat,
        targets: &flat,
    };
    let error = simpo.compute(&model, &batch).unwrap_err().to_string();
    assert!(
        error.contains("SimPO: the batch's inputs") && error.contains("[pairs, 2, length]"),
        "{error}"
    );
    // Every target of a rejected completion ignored.
    let (x, mut y) = pairs(2, 1);
    let mut labels: Vec<i64> = y.to_f64_vec().iter().map(|&v| v as i64).collect();
    for v in &mut labels[LENGTH..2 * LENGTH] {
        *v = -100;
    }
    y = HostTensor::new(labels, [2, 2, LENGTH]).unwrap();
    let (x, y) = (
        B::from_host(&x, Device::Cpu).unwrap(),
        B::from_host(&y, Device::Cpu).unwrap(),
    );
    let batch = ObjectiveBatch {
        inputs: &x,
        targets: &y,
    };
    let error = simpo.compute(&model, &batch).unwrap_err();
    assert!(matches!(error, Error::InvalidArgument { .. }), "{error}");
    assert!(error.to_string().contains("no token to train"), "{error}");
    for (config, field) in [
        (
            SimpoConfig {
                beta: 0.0,
                ..SimpoConfig::default()
            },
            "simpo.beta",
        ),
        (
            SimpoConfig {
                cpo_alpha: -1.0,
                ..SimpoConfig::default()
            },
            "simpo.cpo_alpha",
        ),
        (
            SimpoConfig {
                label_smoothing: 0.5,
                ..SimpoConfig::default()
            },
            "simpo.label_smoothing",
        ),
    ] {
        let error = Simpo::new(config).unwrap_err().to_string();
        assert!(error.contains(field), "{error}");
    }
}
