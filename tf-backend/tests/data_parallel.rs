//! Data-parallel training over a one-rank group that records its collectives:
//! the step's programs (flat gradients fetched, averaged, fed back, clipped and
//! applied) give what the single-process step gives, and the step makes the
//! collectives it says it makes. The two-process tests against kiln-torch's
//! Gloo group are the workspace's `tests/distributed_tf.rs`.

use std::sync::{Arc, Mutex};

use kiln_core::{
    backend::{Backend, StepPlan, TrainBackend, Trainable},
    distributed::{Collectives, CommBackend, DistributedOptions, ReduceOp},
    loss::Loss,
    model::{BatchNormConfig, Layer, LinearConfig},
    module::Module,
    optim::{AdamConfig, GradClip, Optimizer, OptimizerConfig},
    strategy::{DataParallel, NoHooks, StepHooks},
    Device, HostTensor, Result,
};
use kiln_tf::{GradientAllReduce, TfBackend, TfModel, TfTensor};

/// The model of these tests: inside `DataParallel`, with the TensorFlow engine
/// over a recording group, or with no hooks (which trains as the bare model).
type Wrapped = DataParallel<TfModel, Box<dyn StepHooks<TfBackend>>>;

/// The models of this binary draw from one global generator.
static SERIAL: Mutex<()> = Mutex::new(());

/// A group of one rank that records the length of every collective.
#[derive(Default)]
struct Solo {
    calls: Mutex<Vec<(&'static str, usize)>>,
}

impl Solo {
    fn record(&self, what: &'static str, len: usize) {
        if let Ok(mut calls) = self.calls.lock() {
            calls.push((what, len));
        }
    }

    fn take(&self) -> Vec<(&'static str, usize)> {
        self.calls
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default()
    }
}

impl Collectives for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_f32(&self, data: &mut [f32], _op: ReduceOp) -> Result<()> {
        self.record("all_reduce", data.len());
        Ok(())
    }
    fn all_reduce_f64(&self, data: &mut [f64], _op: ReduceOp) -> Result<()> {
        self.record("all_reduce_f64", data.len());
        Ok(())
    }
    fn broadcast_f32(&self, data: &mut [f32], _root: usize) -> Result<()> {
        self.record("broadcast", data.len());
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

fn spec(batch_norm: bool) -> Layer {
    let mut layers = vec![LinearConfig::new(6, 16).into()];
    if batch_norm {
        layers.push(Layer::BatchNorm1d(BatchNormConfig::new(16)));
    }
    layers.extend([Layer::Tanh, LinearConfig::new(16, 3).into()]);
    Layer::sequential(layers)
}

fn batch(i: usize) -> Result<(TfTensor, TfTensor)> {
    let x: Vec<f32> = (0..24)
        .map(|j| ((i * 31 + j * 7) % 17) as f32 / 8.0 - 1.0)
        .collect();
    let y: Vec<i64> = (0..4).map(|j| ((i + j) % 3) as i64).collect();
    Ok((
        TfTensor::from_host(&HostTensor::new(x, [4, 6])?)?,
        TfTensor::from_host(&HostTensor::new(y, [4])?)?,
    ))
}

/// Trains 3 steps of 2 micro-batches; returns the losses and the state.
fn train(model: &mut Wrapped) -> Result<(Vec<f64>, Vec<HostTensor>)> {
    let mut opt = model.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-2)), &[])?;
    let loss = Loss::cross_entropy();
    let clip = GradClip::Norm {
        max_norm: 0.1,
        norm_type: 2.0,
    };
    let mut losses = Vec::new();
    for i in 0..6 {
        if i % 2 == 0 {
            opt.zero_grad()?;
        }
        let plan = StepPlan {
            loss: &loss,
            scale: 0.5,
            apply: i % 2 == 1,
            clip: Some(&clip),
        };
        let (x, y) = batch(i)?;
        losses.push(model.train_step(&mut opt, &x, &y, &plan)?);
    }
    let state = Module::<TfBackend>::state_dict(model)?;
    Ok((losses, state.iter().map(|(_, v)| v.clone()).collect()))
}

fn build(batch_norm: bool, group: Option<Arc<Solo>>) -> Result<Wrapped> {
    TfBackend::manual_seed(5);
    let model = TfBackend::build_model(&spec(batch_norm), Device::Cpu)?;
    let hooks: Box<dyn StepHooks<TfBackend>> = match group {
        Some(group) => Box::new(GradientAllReduce::new(
            &model,
            group,
            &DistributedOptions::default(),
        )?),
        None => Box::new(NoHooks),
    };
    DataParallel::new(model, hooks)
}

/// One rank is the single-process run, bit for bit, and a step of two
/// micro-batches makes two all-reduces: the first micro-batch's loss (one
/// float), then all the gradients and the second loss in one buffer.
#[test]
fn one_rank_is_the_single_process_run() -> Result<()> {
    let _serial = SERIAL.lock();
    let (single_losses, single_state) = train(&mut build(false, None)?)?;
    let group = Arc::new(Solo::default());
    let mut model = build(false, Some(group.clone()))?;
    // Wrapping: the fingerprint, who differs, then the 6*16+16+16*3+3 values.
    assert_eq!(
        group.take(),
        [("broadcast", 4), ("all_reduce", 1), ("broadcast", 163)]
    );
    let (losses, state) = train(&mut model)?;
    assert_eq!(losses, single_losses);
    assert_eq!(state, single_state);
    let step = [("all_reduce", 1), ("all_reduce", 163 + 1)];
    assert_eq!(group.take(), step.repeat(3));
    Ok(())
}

/// With batch norm, rank 0's buffers are broadcast before every training
/// forward pass (one buffer: the float statistics, and the int64 step count as
/// four two-byte words), and the run is still the single-process one.
#[test]
fn buffers_are_broadcast_before_each_forward_pass() -> Result<()> {
    let _serial = SERIAL.lock();
    let (single_losses, single_state) = train(&mut build(true, None)?)?;
    let group = Arc::new(Solo::default());
    let mut model = build(true, Some(group.clone()))?;
    group.take();
    let (losses, state) = train(&mut model)?;
    assert_eq!(losses, single_losses);
    assert_eq!(state, single_state);
    let buffers = 16 + 16 + 4;
    let params = 6 * 16 + 16 + 16 + 16 + 16 * 3 + 3;
    let step = [
        ("broadcast", buffers),
        ("all_reduce", 1),
        ("broadcast", buffers),
        ("all_reduce", params + 1),
    ];
    assert_eq!(group.take(), step.repeat(3));
    model.sync_buffers()?;
    assert_eq!(group.take(), [("broadcast", buffers)]);
    Ok(())
}

/// NCCL is refused: TensorFlow trains on the CPU here.
#[test]
fn nccl_is_refused() -> Result<()> {
    let _serial = SERIAL.lock();
    TfBackend::manual_seed(5);
    let model = TfBackend::build_model(&spec(false), Device::Cpu)?;
    let options = DistributedOptions {
        backend: CommBackend::Nccl,
        ..DistributedOptions::default()
    };
    let err = kiln_tf::data_parallel(model, Arc::new(Solo::default()), &options)
        .err()
        .map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(|m| m.contains("gloo")),
        "{err:?}"
    );
    Ok(())
}
