//! The TensorFlow backend trains data-parallel on kiln-torch's c10d Gloo group,
//! which kiln-tf sees only as `Arc<dyn Collectives>`: real ranks in separate
//! processes on localhost. Each test re-runs this test binary as its ranks
//! (with `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ... set as a launcher sets them)
//! and checks that they pass.
//!
//! - Two ranks with `B` rows each equal one process with `2B` rows (MLP, Adam,
//!   clipping by norm, gradient accumulation 2), and end bit for bit alike.
//! - `kiln::tf::data_parallel` gives every rank rank 0's parameters and buffers.
//! - Batch-norm buffers follow rank 0 (`broadcast_buffers`).
//! - A loss that is not finite on one rank is skipped by every rank, and
//!   changes nothing.
//! - ZeRO-1 and ZeRO-2 (`kiln::tf::zero_data_parallel`) on 2 and 4 ranks equal
//!   one process over 20 steps with every optimizer, gradient accumulation and
//!   clipping (the norm over every rank's share), a small transformer and the
//!   CNN with batch norm (against DDP) included; their whole optimizer state is one process's, each rank holds
//!   only its share, and a whole state loads back into shares.
//! - DDP, ZeRO-1 and ZeRO-2 through the one strategy wrapper answer every
//!   method of `Module` and `Trainable` as the model alone does.

use std::sync::Arc;
use std::time::Duration;

use kiln_testkit::ranks::{assert_all_passed, spawn_ranks, wait_all};

use kiln::c10d::ProcessGroup;
use kiln::core::backend::Trainable;
use kiln::core::backend::{Backend, StepPlan, TrainBackend};
use kiln::core::distributed::{Collectives, DistributedOptions, Rendezvous};
use kiln::core::loss::Loss;
use kiln::core::model::{
    BatchNormConfig, Conv2dConfig, EmbeddingConfig, GatedMlpConfig, Layer, LinearConfig,
    Pool2dConfig, RmsNormConfig, SelfAttentionConfig, TiedLinearConfig,
};
use kiln::core::module::Module;
use kiln::core::optim::{
    AdagradConfig, AdamConfig, AdamWConfig, GradClip, Optimizer, OptimizerConfig, RmsPropConfig,
    SgdConfig,
};
use kiln::core::strategy::{DataParallel, NoHooks, StepHooks, ZeroStage};
use kiln::core::{DType, Device, HostTensor, Result};
use kiln::tf::{TfBackend, TfModel, TfTensor};

/// The variable that makes this binary a rank instead of a test driver.
const ROLE: &str = "KILN_DIST_TF_TEST_ROLE";

const B: usize = 8;
const STEPS: usize = 8;
const ACCUMULATE: usize = 2;

/// Runs test `test` as two ranks and checks that both passed.
fn run_as_two_ranks(test: &str) {
    run_as_ranks(test, 2);
}

/// Runs test `test` as `world` ranks and checks that all passed.
fn run_as_ranks(test: &str, world: usize) {
    let ranks: Vec<usize> = (0..world).collect();
    let children = spawn_ranks(ROLE, test, world, &ranks, &[]);
    let results = wait_all(children, Duration::from_secs(300));
    assert_all_passed(&results);
    for (rank, (_, out)) in results.iter().enumerate() {
        // What a rank measured, for the driver's output.
        for line in out.lines() {
            if let Some(at) = line.find("measured:") {
                eprintln!("rank {rank} {}", &line[at..]);
            }
        }
    }
}

fn is_rank() -> bool {
    std::env::var_os(ROLE).is_some()
}

fn join() -> Result<Arc<ProcessGroup>> {
    let rendezvous = Rendezvous::from_env()?.expect("a rank's environment");
    let options = DistributedOptions {
        timeout: Duration::from_secs(60),
        ..DistributedOptions::default()
    };
    Ok(Arc::new(ProcessGroup::join(&rendezvous, &options)?))
}

fn mlp() -> Layer {
    mlp_with(Layer::Relu)
}

/// 12 -> 32 -> 5 with `activation` between.
fn mlp_with(activation: Layer) -> Layer {
    Layer::sequential([
        LinearConfig::new(12, 32).into(),
        activation,
        LinearConfig::new(32, 5).into(),
    ])
}

fn cnn() -> Layer {
    cnn_with(true)
}

/// [`cnn`], its convolution with or without a bias (batch norm follows it).
fn cnn_with(bias: bool) -> Layer {
    let mut conv = Conv2dConfig::new(1, 4, [3, 3]).with_padding([1, 1]);
    conv.bias = bias;
    Layer::sequential([
        conv.into(),
        Layer::BatchNorm2d(BatchNormConfig::new(4)),
        Layer::Relu,
        Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
        Layer::Flatten {
            start_dim: 1,
            end_dim: -1,
        },
        LinearConfig::new(36, 5).into(),
    ])
}

/// Token embedding, two pre-norm blocks (causal attention, gated MLP), a
/// head tied to the embedding, and a classifier over the flattened logits.
fn transformer() -> Layer {
    let block = Layer::sequential([
        Layer::residual(Layer::sequential([
            RmsNormConfig::new(8).into(),
            SelfAttentionConfig::new(8, 2).with_causal(true).into(),
        ])),
        Layer::residual(Layer::sequential([
            RmsNormConfig::new(8).into(),
            GatedMlpConfig::new(8, 12).into(),
        ])),
    ]);
    Layer::sequential([
        EmbeddingConfig::new(11, 8).into(),
        block.clone(),
        block,
        RmsNormConfig::new(8).into(),
        TiedLinearConfig::new("0.weight", 8, 11).into(),
        Layer::Flatten {
            start_dim: 1,
            end_dim: -1,
        },
        LinearConfig::new(6 * 11, 5).into(),
    ])
}

/// Batch norm without a ReLU or pooling after it, which would turn a NaN into
/// a number (TensorFlow's `Relu` gives 0 for NaN).
fn cnn_tanh() -> Layer {
    Layer::sequential([
        Conv2dConfig::new(1, 4, [3, 3]).with_padding([1, 1]).into(),
        Layer::BatchNorm2d(BatchNormConfig::new(4)),
        Layer::Tanh,
        Layer::Flatten {
            start_dim: 1,
            end_dim: -1,
        },
        LinearConfig::new(144, 5).into(),
    ])
}

/// Deterministic pseudo-random floats in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Every micro-batch of the global run: `2B` rows each, the same on every rank.
fn data(image: bool) -> Result<Vec<(HostTensor, HostTensor)>> {
    data_of(
        STEPS,
        if image {
            Inputs::Images
        } else {
            Inputs::Features
        },
    )
}

/// What a model of these tests reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Inputs {
    /// 12 features.
    Features,
    /// One 6x6 channel.
    Images,
    /// 6 tokens of a vocabulary of 11.
    Tokens,
}

/// `steps` steps' micro-batches of `2B` rows each, the same on every rank.
fn data_of(steps: usize, inputs: Inputs) -> Result<Vec<(HostTensor, HostTensor)>> {
    (0..steps * ACCUMULATE)
        .map(|i| {
            let seed = 1000 + i as u64;
            let x = match inputs {
                Inputs::Images => HostTensor::new(noise(2 * B * 36, seed), [2 * B, 1, 6, 6])?,
                Inputs::Features => HostTensor::new(noise(2 * B * 12, seed), [2 * B, 12])?,
                Inputs::Tokens => {
                    let tokens: Vec<i64> = noise(2 * B * 6, seed)
                        .iter()
                        .map(|v| ((v + 1.0) * 5.5) as i64 % 11)
                        .collect();
                    HostTensor::new(tokens, [2 * B, 6])?
                }
            };
            let y: Vec<i64> = noise(2 * B, seed + 7)
                .iter()
                .map(|v| ((v + 1.0) * 2.5) as i64 % 5)
                .collect();
            Ok((x, HostTensor::new(y, [2 * B])?))
        })
        .collect()
}

/// Rank `rank` of `world`'s rows of a global batch.
fn shard(t: &HostTensor, rank: usize, world: usize) -> Result<HostTensor> {
    let n = t.dims()[0] / world;
    let rows: Vec<usize> = (rank * n..(rank + 1) * n).collect();
    t.select_rows(&rows)
}

/// Every parameter and float buffer, flattened, in state-dict order.
fn weights(model: &impl Module<TfBackend>) -> Result<Vec<f32>> {
    let state = Module::<TfBackend>::state_dict(model)?;
    let mut out = Vec::new();
    for (_, value) in state.iter() {
        out.extend_from_slice(value.to_dtype(DType::F32).as_slice::<f32>()?);
    }
    Ok(out)
}

/// Every parameter, flattened.
fn parameters(model: &impl Module<TfBackend>) -> Result<Vec<f32>> {
    Ok(Module::<TfBackend>::named_parameters(model)?
        .iter()
        .map(|(_, t)| Ok(t.to_host()?.as_slice::<f32>()?.to_vec()))
        .collect::<Result<Vec<_>>>()?
        .concat())
}

/// Whether `values` are bit for bit rank 0's (checked on every rank).
fn same_as_rank_zero(group: &dyn Collectives, values: &[f32]) -> Result<bool> {
    let mut rank0 = values.to_vec();
    group.broadcast_f32(&mut rank0, 0)?;
    Ok(rank0
        .iter()
        .zip(values)
        .all(|(a, b)| a.to_bits() == b.to_bits()))
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// A model trained by these tests: inside `DataParallel` with the TensorFlow
/// engine when distributed, or with no hooks (which trains as the bare model).
type Wrapped = DataParallel<TfModel, Box<dyn StepHooks<TfBackend>>>;

/// A model of `spec` with weights from `seed`, distributed over `group` if given.
fn build(spec: &Layer, seed: u64, group: Option<Arc<ProcessGroup>>) -> Result<Wrapped> {
    TfBackend::manual_seed(seed);
    let model = TfBackend::build_model(spec, Device::Cpu)?;
    let hooks: Box<dyn StepHooks<TfBackend>> = match group {
        Some(group) => Box::new(kiln::tf::GradientAllReduce::new(
            &model,
            group,
            &DistributedOptions::default(),
        )?),
        None => Box::new(NoHooks),
    };
    DataParallel::new(model, hooks)
}

/// This process's rank and the world size when `model` trains across ranks.
fn rank_of(model: &Wrapped) -> Option<(usize, usize)> {
    model.collectives().map(|g| (g.rank(), g.world_size()))
}

/// Trains `model` on `batches` (this rank's shard of each when distributed),
/// returning the per-micro-batch losses. At micro-batch `poison` (if any),
/// rank 1's inputs are NaN.
fn train(
    model: &mut Wrapped,
    batches: &[(HostTensor, HostTensor)],
    poison: Option<usize>,
) -> Result<Vec<f64>> {
    let mut opt = model.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-2)), &[])?;
    let loss = Loss::cross_entropy();
    let clip = GradClip::Norm {
        max_norm: 0.5,
        norm_type: 2.0,
    };
    let mut losses = Vec::new();
    for (i, (x, y)) in batches.iter().enumerate() {
        let (x, y) = match rank_of(model) {
            Some((rank, world)) => (shard(x, rank, world)?, shard(y, rank, world)?),
            None => (x.clone(), y.clone()),
        };
        let micro = i % ACCUMULATE;
        if micro == 0 {
            opt.zero_grad()?;
        }
        let plan = StepPlan {
            loss: &loss,
            scale: 1.0 / ACCUMULATE as f64,
            apply: micro + 1 == ACCUMULATE,
            clip: Some(&clip),
        };
        let y = TfTensor::from_host(&y)?;
        if poison == Some(i) {
            let nan_on_rank_1 = rank_of(model).is_some_and(|(r, _)| r == 1);
            let x_bad = if nan_on_rank_1 {
                HostTensor::new(vec![f32::NAN; x.numel()], x.dims().to_vec())?
            } else {
                x.clone()
            };
            // Buffers are rank 0's after any training step's broadcast, so the
            // parameters are what is compared here; the buffers are compared
            // with a run without the NaN by the caller.
            let before = parameters(model)?;
            let value = model.train_step(&mut opt, &TfTensor::from_host(&x_bad)?, &y, &plan)?;
            assert!(value.is_nan(), "every rank sees the NaN: {value}");
            assert_eq!(
                parameters(model)?,
                before,
                "a skipped micro-batch changed the parameters"
            );
        }
        let x = TfTensor::from_host(&x)?;
        losses.push(model.train_step(&mut opt, &x, &y, &plan)?);
    }
    Ok(losses)
}

/// Two ranks with `B` rows each against one process with `2B` rows: the same
/// losses and weights, with Adam, clipping by norm and gradient accumulation;
/// rank 1 starts from other weights, which `data_parallel` replaces by rank 0's.
#[test]
fn two_ranks_of_b_equal_one_process_of_2b() -> Result<()> {
    if !is_rank() {
        run_as_two_ranks("two_ranks_of_b_equal_one_process_of_2b");
        return Ok(());
    }
    let group = join()?;
    let batches = data(false)?;
    let mut model = build(&mlp(), 7 + group.rank() as u64, Some(group.clone()))?;
    let runs = model.module().session_runs()?;
    let losses = train(&mut model, &batches, None)?;
    // One session run to initialise the optimizer, then per step one per
    // micro-batch (its gradients) and one to apply their average.
    assert_eq!(
        model.module().session_runs()? - runs,
        (1 + STEPS * (ACCUMULATE + 1)) as u64
    );
    let trained = weights(&model)?;
    assert!(
        same_as_rank_zero(group.as_ref(), &trained)?,
        "the ranks' weights differ"
    );

    let mut single = build(&mlp(), 7, None)?;
    let single_losses = train(&mut single, &batches, None)?;
    let single_trained = weights(&single)?;
    let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    let loss_diff = max_diff(&losses, &single_losses);
    let weight_diff = max_diff(&wide(&trained), &wide(&single_trained));
    println!("measured: loss difference {loss_diff:e}, weight difference {weight_diff:e}");
    assert!(
        loss_diff < 1e-6,
        "losses differ by {loss_diff}: {losses:?} vs {single_losses:?}"
    );
    assert!(weight_diff < 1e-6, "weights differ by {weight_diff}");
    Collectives::barrier(group.as_ref())?;
    Ok(())
}

/// Ranks built from different seeds, with different buffers (batch norm's
/// float statistics and int64 step count), hold rank 0's after `data_parallel`,
/// bit for bit.
#[test]
fn distribute_gives_every_rank_rank_zeros_variables() -> Result<()> {
    if !is_rank() {
        run_as_two_ranks("distribute_gives_every_rank_rank_zeros_variables");
        return Ok(());
    }
    let group = join()?;
    let rank = group.rank();
    let rank0_model = build(&cnn(), 11, None)?;
    let mut rank0_state = Module::<TfBackend>::state_dict(&rank0_model)?;
    rank0_state.insert(
        "1.running_mean".to_owned(),
        HostTensor::new(vec![0.5f32, -1.0, 2.0, 1e-3], [4])?,
    );
    rank0_state.insert(
        "1.num_batches_tracked".to_owned(),
        HostTensor::scalar(123_456_789_012i64),
    );

    TfBackend::manual_seed(11 + rank as u64);
    let mut model = TfBackend::build_model(&cnn(), Device::Cpu)?;
    if rank == 0 {
        Module::<TfBackend>::load_state_dict(&mut model, &rank0_state)?;
    } else {
        assert_ne!(
            Module::<TfBackend>::state_dict(&model)?.get("0.weight"),
            rank0_state.get("0.weight"),
            "rank 1 starts from other weights"
        );
    }
    let model = kiln::tf::data_parallel(model, group.clone(), &DistributedOptions::default())?;
    assert_eq!(
        model.collectives().map(|g| (g.rank(), g.world_size())),
        Some((rank, 2))
    );
    let state = Module::<TfBackend>::state_dict(&model)?;
    assert_eq!(state.len(), rank0_state.len());
    for (name, value) in rank0_state.iter() {
        let got = state.get(name).expect("every entry");
        assert_eq!(got.dtype(), value.dtype(), "{name}");
        assert_eq!(got.as_bytes(), value.as_bytes(), "{name}");
    }
    Ok(())
}

/// A CNN with batch norm trained on two ranks: the parameters stay identical;
/// the running statistics, which each rank's forward pass updates from its own
/// rows (as PyTorch's DDP without SyncBatchNorm), differ after training until
/// `sync_buffers` gives every rank rank 0's.
#[test]
fn batch_norm_buffers_follow_rank_zero() -> Result<()> {
    if !is_rank() {
        run_as_two_ranks("batch_norm_buffers_follow_rank_zero");
        return Ok(());
    }
    let group = join()?;
    let batches = data(true)?;
    let mut model = build(&cnn(), 3 + group.rank() as u64, Some(group.clone()))?;
    let losses = train(&mut model, &batches, None)?;
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!(same_as_rank_zero(group.as_ref(), &parameters(&model)?)?);
    let buffers = |model: &Wrapped| -> Result<Vec<f32>> {
        Ok(Module::<TfBackend>::named_buffers(model)?
            .iter()
            .map(|(_, t)| {
                Ok(t.to_host()?
                    .to_dtype(DType::F32)
                    .as_slice::<f32>()?
                    .to_vec())
            })
            .collect::<Result<Vec<_>>>()?
            .concat())
    };
    let local = !same_as_rank_zero(group.as_ref(), &buffers(&model)?)?;
    if group.rank() == 1 {
        assert!(local, "rank 1's last forward pass used its own rows");
    }
    model.sync_buffers()?;
    assert!(same_as_rank_zero(group.as_ref(), &buffers(&model)?)?);
    Ok(())
}

/// Rank 1's loss is NaN on a micro-batch that applies: both ranks get the NaN,
/// and nothing changes (weights, optimizer state, the gradients accumulated by
/// the step's first micro-batch, batch-norm statistics): retrying the
/// micro-batch ends exactly where a run without the NaN ends.
#[test]
fn a_non_finite_loss_on_one_rank_is_skipped_by_all() -> Result<()> {
    if !is_rank() {
        run_as_two_ranks("a_non_finite_loss_on_one_rank_is_skipped_by_all");
        return Ok(());
    }
    let group = join()?;
    let batches = data(true)?;
    let mut clean = build(&cnn_tanh(), 5, Some(group.clone()))?;
    let clean_losses = train(&mut clean, &batches[..6], None)?;
    let mut poisoned = build(&cnn_tanh(), 5, Some(group.clone()))?;
    let poisoned_losses = train(&mut poisoned, &batches[..6], Some(3))?;
    assert_eq!(clean_losses, poisoned_losses);
    let (a, b) = (weights(&clean)?, weights(&poisoned)?);
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "the skipped micro-batch left a trace"
    );
    Ok(())
}

/// Trains `model` with `optimizer` on `batches` (this rank's rows of each when
/// distributed), accumulating `ACCUMULATE` micro-batches per step, clipped as
/// `clip` says: the per-micro-batch losses.
fn fit<M: Trainable<TfBackend>>(
    model: &mut M,
    optimizer: &mut M::Optim,
    batches: &[(HostTensor, HostTensor)],
    clip: &GradClip,
) -> Result<Vec<f64>> {
    let loss = Loss::cross_entropy();
    let mut losses = Vec::new();
    for (i, (x, y)) in batches.iter().enumerate() {
        let (x, y) = match model.collectives() {
            Some(g) => (
                shard(x, g.rank(), g.world_size())?,
                shard(y, g.rank(), g.world_size())?,
            ),
            None => (x.clone(), y.clone()),
        };
        let micro = i % ACCUMULATE;
        if micro == 0 {
            optimizer.zero_grad()?;
        }
        let plan = StepPlan {
            loss: &loss,
            scale: 1.0 / ACCUMULATE as f64,
            apply: micro + 1 == ACCUMULATE,
            clip: Some(clip),
        };
        let (x, y) = (TfTensor::from_host(&x)?, TfTensor::from_host(&y)?);
        losses.push(model.train_step(optimizer, &x, &y, &plan)?);
    }
    Ok(losses)
}

/// The largest difference between two state dicts' entries, relative to the
/// reference's magnitude where that exceeds 1 (RMSprop's momentum buffer sums
/// normalised steps of ~10), which must have the same keys and shapes.
fn state_diff(
    a: &kiln::core::state_dict::StateDict,
    b: &kiln::core::state_dict::StateDict,
    what: &str,
) -> f64 {
    let keys = |s: &kiln::core::state_dict::StateDict| {
        s.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>()
    };
    assert_eq!(keys(a), keys(b), "{what}: the keys");
    a.iter()
        .map(|(k, v)| {
            let w = b.get(k).expect("the same keys");
            assert_eq!(v.dims(), w.dims(), "{what}: {k}");
            v.to_f64_vec()
                .iter()
                .zip(w.to_f64_vec())
                .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

/// ZeRO-1 and ZeRO-2 on TensorFlow over 2 or 4 ranks of `2B / world` rows
/// against one process of `2B` rows, 20 steps of 2 micro-batches: the MLP
/// with every optimizer and clipping by norm (by value for one), a small
/// transformer under AdamW; the CNN with batch norm under Adam against DDP on
/// the same ranks (batch norm uses each rank's own rows). Losses, weights and the whole optimizer state agree
/// within 1e-6; each rank holds the state of its own parameters only; the
/// whole state loads into another stage's shares and gathers back unchanged.
fn zero_equals_one_process() -> Result<()> {
    let group = join()?;
    let (rank, world) = (group.rank(), group.world_size());
    let norm = GradClip::Norm {
        max_norm: 0.5,
        norm_type: 2.0,
    };
    let runs: Vec<(&str, Layer, OptimizerConfig, GradClip)> = vec![
        (
            "sgd",
            mlp(),
            OptimizerConfig::Sgd(
                SgdConfig::new(5e-2)
                    .with_momentum(0.9)
                    .with_weight_decay(1e-2)
                    .with_nesterov(true),
            ),
            norm,
        ),
        (
            "adam",
            mlp(),
            OptimizerConfig::Adam(AdamConfig::new(1e-2).with_amsgrad(true)),
            GradClip::Value { clip_value: 0.05 },
        ),
        (
            "adamw",
            mlp(),
            OptimizerConfig::AdamW(AdamWConfig::new(1e-2).with_weight_decay(0.1)),
            norm,
        ),
        (
            "rmsprop",
            // RMSprop divides each gradient by its own running RMS, which
            // turns the rounding of a gradient near zero (a ReLU unit almost
            // dead) into a whole step: tanh keeps every gradient alive. (On
            // the ReLU MLP, ZeRO-1 equals DDP bit for bit.)
            mlp_with(Layer::Tanh),
            OptimizerConfig::RmsProp(RmsPropConfig::new(1e-3).with_momentum(0.5)),
            norm,
        ),
        (
            "adagrad",
            mlp(),
            OptimizerConfig::Adagrad(AdagradConfig::new(5e-2).with_lr_decay(1e-3)),
            GradClip::Norm {
                max_norm: 0.3,
                norm_type: f64::INFINITY,
            },
        ),
        (
            "transformer",
            transformer(),
            OptimizerConfig::AdamW(AdamWConfig::new(1e-2)),
            norm,
        ),
        (
            "cnn",
            // Without the convolution's bias, whose gradient batch norm makes
            // zero, and which Adam would turn from rounding into whole steps.
            cnn_with(false),
            OptimizerConfig::Adam(AdamConfig::new(1e-2)),
            norm,
        ),
    ];
    for (name, spec, config, clip) in &runs {
        let image = *name == "cnn";
        let inputs = match *name {
            "cnn" => Inputs::Images,
            "transformer" => Inputs::Tokens,
            _ => Inputs::Features,
        };
        let batches = data_of(20, inputs)?;
        // Batch norm normalises each rank's rows by their own statistics (as
        // DDP without SyncBatchNorm does), so the CNN's reference is DDP on
        // the same ranks; the MLP's is one process on the global batch.
        let mut reference = build(spec, 7, image.then(|| group.clone()))?;
        let mut reference_opt = reference.build_optimizer(config, &[])?;
        let single_losses = fit(&mut reference, &mut reference_opt, &batches, clip)?;
        let single_state = reference_opt.state_dict()?;
        let single_weights = weights(&reference)?;
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let what = format!("{name}, {} on {world} ranks", stage.name());
            TfBackend::manual_seed(7 + rank as u64);
            let model = TfBackend::build_model(spec, Device::Cpu)?;
            let options = DistributedOptions::default();
            let mut model = kiln::tf::zero_data_parallel(model, group.clone(), stage, &options)?;
            let mut opt = model.build_optimizer(config, &[])?;
            let losses = fit(&mut model, &mut opt, &batches, clip)?;
            let trained = weights(&model)?;
            assert!(
                same_as_rank_zero(group.as_ref(), &parameters(&model)?)?,
                "{what}: the ranks' parameters differ"
            );
            let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
            let loss_diff = max_diff(&losses, &single_losses);
            let weight_diff = max_diff(&wide(&trained), &wide(&single_weights));
            let state = opt.state_dict()?;
            let optimizer_diff = state_diff(&state, &single_state, &what);
            println!(
                "measured: {what}: loss difference {loss_diff:e}, weight difference \
                 {weight_diff:e}, optimizer state difference {optimizer_diff:e}"
            );
            assert!(loss_diff < 1e-6, "{what}: losses differ by {loss_diff}");
            assert!(
                weight_diff < 1e-6,
                "{what}: weights differ by {weight_diff}"
            );
            // RMSprop's momentum buffer sums gradients divided by their RMS,
            // so a gradient's rounding (1e-9) over a small RMS (1e-3) shows
            // as 1e-6 there, and as 1e-9 in the weights (lr 1e-3).
            let bound = if *name == "rmsprop" { 1e-5 } else { 1e-6 };
            assert!(
                optimizer_diff < bound,
                "{what}: optimizer states differ by {optimizer_diff}"
            );

            // This rank's share: the state of its own parameters only.
            let share = opt
                .shard_state_tensors()?
                .expect("a share")
                .tensors
                .to_state_dict()?;
            let names: Vec<String> = Module::<TfBackend>::named_parameters(&model)?
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            let mine: Vec<&String> = names
                .iter()
                .zip(opt.owners())
                .filter(|(_, &owner)| owner == rank)
                .map(|(name, _)| name)
                .collect();
            for (key, _) in share.iter() {
                if let Some(rest) = key.strip_prefix("state.") {
                    assert!(
                        mine.iter().any(|p| rest.starts_with(&format!("{p}."))),
                        "{what}: rank {rank}'s share holds {key}"
                    );
                } else {
                    assert_eq!(rank, 0, "{what}: rank {rank}'s share holds {key}");
                }
            }
            let per_param = 1 + config.state_buffers().len();
            let held = share
                .iter()
                .filter(|(k, _)| k.starts_with("state."))
                .count();
            assert_eq!(held, mine.len() * per_param, "{what}: rank {rank}'s share");
            // The shares' buffer elements add up to the whole state's, once.
            let elements = |state: &kiln::core::state_dict::StateDict| -> usize {
                state
                    .iter()
                    .filter(|(k, _)| k.starts_with("state.") && !k.ends_with(".step"))
                    .map(|(_, t)| t.numel())
                    .sum()
            };
            let mut shares = [elements(&share) as f64];
            group.all_reduce_f64(&mut shares, kiln::core::distributed::ReduceOp::Sum)?;
            let whole = elements(&single_state);
            assert_eq!(
                shares[0], whole as f64,
                "{what}: the shares' state elements"
            );
            if rank == 0 {
                println!(
                    "measured: {what}: rank 0 holds {} of {whole} optimizer-state elements",
                    elements(&share)
                );
            }

            // The whole state into the other stage's shares, and back.
            let other = match stage {
                ZeroStage::One => ZeroStage::Two,
                ZeroStage::Two => ZeroStage::One,
            };
            TfBackend::manual_seed(7);
            let fresh = TfBackend::build_model(spec, Device::Cpu)?;
            let fresh = kiln::tf::zero_data_parallel(fresh, group.clone(), other, &options)?;
            let mut loaded = fresh.build_optimizer(config, &[])?;
            // A state of another model is refused on every rank alike, even
            // where the misfit is in another rank's share, and changes nothing.
            let mut misfit = single_state.clone();
            let last = names.last().expect("parameters");
            misfit.insert(format!("state.{last}.step"), HostTensor::scalar(-1i64));
            let before = loaded.state_dict()?;
            let err = loaded.load_state_dict(&misfit).err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|m| m.contains("negative step")),
                "{what}: {err:?}"
            );
            assert_eq!(
                loaded.state_dict()?,
                before,
                "{what}: a refused state changed it"
            );
            loaded.load_state_dict(&single_state)?;
            assert_eq!(
                state_diff(&loaded.state_dict()?, &single_state, &what),
                0.0,
                "{what}: a whole state loaded into shares gathers back unchanged"
            );
        }
    }
    Collectives::barrier(group.as_ref())?;
    Ok(())
}

#[test]
fn zero_on_two_ranks_equals_one_process() -> Result<()> {
    if !is_rank() {
        run_as_ranks("zero_on_two_ranks_equals_one_process", 2);
        return Ok(());
    }
    zero_equals_one_process()
}

#[test]
fn zero_on_four_ranks_equals_one_process() -> Result<()> {
    if !is_rank() {
        run_as_ranks("zero_on_four_ranks_equals_one_process", 4);
        return Ok(());
    }
    zero_equals_one_process()
}

/// Asserts that `wrapped` (under `strategy` over `world` ranks, built from
/// another seed on the other ranks) answers every method of `Module` and
/// `Trainable` as `bare`, the same model alone, does: the one strategy
/// wrapper over TensorFlow's strategies. Every rank trains on the same
/// batch, so one step's mean gradient is the single process's.
fn answers_as_alone<M: Trainable<TfBackend>>(
    strategy: &str,
    wrapped: &mut M,
    bare: &mut TfModel,
    world: usize,
) -> Result<()> {
    use kiln::core::backend::{Mode, UpdatePlan};
    use kiln::core::objective::{ObjectiveBatch, Supervised};
    let kind = wrapped.kind();
    assert!(
        kind.starts_with(strategy) && kind.contains(&bare.kind()),
        "{strategy}: {kind}"
    );
    let names = |v: Vec<(String, TfTensor)>| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert_eq!(
        names(wrapped.named_parameters()?),
        names(bare.named_parameters()?)
    );
    assert_eq!(
        names(wrapped.named_buffers()?),
        names(bare.named_buffers()?)
    );
    assert_eq!(
        wrapped.running_stats()?,
        bare.running_stats()?,
        "{strategy}"
    );
    // The same graph, serialised by each model's own session (attribute
    // order differs): both have one.
    let graph = |g: Option<Vec<u8>>| g.is_some_and(|g| !g.is_empty());
    assert!(
        graph(wrapped.graph_def()?) && graph(bare.graph_def()?),
        "{strategy}"
    );
    assert_eq!(wrapped.num_parameters()?, bare.num_parameters()?);
    assert_eq!(
        wrapped.num_trainable_parameters()?,
        bare.num_trainable_parameters()?
    );
    assert_eq!(wrapped.frozen_parameters()?, bare.frozen_parameters()?);
    assert_eq!(wrapped.precision(), bare.precision(), "{strategy}");
    assert_eq!(wrapped.runs_any_objective(), bare.runs_any_objective());
    assert!(!wrapped.shards_parameters() && wrapped.shard_state_tensors()?.is_none());
    assert_eq!(wrapped.collectives().map(|c| c.world_size()), Some(world));
    let reference = bare.state_dict()?;
    assert_eq!(
        state_diff(&wrapped.state_dict()?, &reference, strategy),
        0.0
    );
    let tensors = wrapped.state_tensors()?.to_state_dict()?;
    assert_eq!(state_diff(&tensors, &reference, strategy), 0.0);

    let (x, y) = &data(true)?[0];
    let (x, y) = (TfTensor::from_host(x)?, TfTensor::from_host(y)?);
    let loss = Loss::cross_entropy();
    for mode in [Mode::Eval, Mode::Train] {
        wrapped.set_mode(mode);
        Module::<TfBackend>::set_mode(bare, mode);
        assert_eq!(wrapped.mode(), mode);
        wrapped.sync_buffers()?;
        assert_eq!(
            wrapped.forward(&x)?.to_host()?,
            bare.forward(&x)?.to_host()?
        );
        let many = wrapped.forward_many(std::slice::from_ref(&x))?;
        let alone = bare.forward_many(std::slice::from_ref(&x))?;
        assert_eq!(many[0].to_host()?, alone[0].to_host()?, "{strategy}");
    }
    wrapped.set_mode(Mode::Eval);
    Module::<TfBackend>::set_mode(bare, Mode::Eval);
    assert_eq!(
        wrapped.eval_step(&loss, &x, &y)?,
        bare.eval_step(&loss, &x, &y)?
    );
    assert_eq!(
        wrapped.predict_step(&x)?,
        bare.predict_step(&x)?,
        "{strategy}"
    );
    let supervised = Supervised::new(loss.clone());
    let batch = ObjectiveBatch {
        inputs: &x,
        targets: &y,
    };
    let a = wrapped.eval_objective(&supervised, &batch)?;
    let b = bare.eval_objective(&supervised, &batch)?;
    assert!((a.loss - b.loss).abs() < 1e-6, "{strategy}: eval_objective");

    wrapped.set_mode(Mode::Train);
    Module::<TfBackend>::set_mode(bare, Mode::Train);
    let sgd = OptimizerConfig::Sgd(SgdConfig::new(0.1));
    let mut wrapped_opt = wrapped.build_optimizer(&sgd, &[])?;
    let mut bare_opt = bare.build_optimizer(&sgd, &[])?;
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let update = UpdatePlan {
        scale: 1.0,
        apply: true,
        clip: None,
    };
    for step in ["train_step", "train_step_deferred", "train_objective_step"] {
        wrapped_opt.zero_grad()?;
        bare_opt.zero_grad()?;
        let (a, b) = match step {
            "train_step" => (
                wrapped.train_step(&mut wrapped_opt, &x, &y, &plan)?,
                bare.train_step(&mut bare_opt, &x, &y, &plan)?,
            ),
            "train_step_deferred" => (
                wrapped
                    .train_step_deferred(&mut wrapped_opt, &x, &y, &plan)?
                    .value::<TfBackend>()?,
                bare.train_step_deferred(&mut bare_opt, &x, &y, &plan)?
                    .value::<TfBackend>()?,
            ),
            _ => (
                wrapped
                    .train_objective_step(&mut wrapped_opt, &supervised, &batch, &update, false)?
                    .loss
                    .value::<TfBackend>()?,
                bare.train_objective_step(&mut bare_opt, &supervised, &batch, &update, false)?
                    .loss
                    .value::<TfBackend>()?,
            ),
        };
        assert!(
            (a - b).abs() < 1e-6,
            "{strategy} {step}: loss {a} against {b}"
        );
        let diff = state_diff(&wrapped.state_dict()?, &bare.state_dict()?, strategy);
        assert!(diff < 1e-6, "{strategy} {step}: weights differ by {diff}");
    }

    TfBackend::manual_seed(3);
    let fresh = Module::<TfBackend>::state_dict(&TfBackend::build_model(&cnn(), Device::Cpu)?)?;
    wrapped.load_state_dict(&fresh)?;
    assert_eq!(state_diff(&wrapped.state_dict()?, &fresh, strategy), 0.0);
    Ok(())
}

/// DDP, ZeRO-1 and ZeRO-2 on TensorFlow, each through the one strategy
/// wrapper, answer every method of `Module` and `Trainable` as the model
/// alone does.
#[test]
fn every_strategy_answers_every_wrapper_method() -> Result<()> {
    if !is_rank() {
        run_as_two_ranks("every_strategy_answers_every_wrapper_method");
        return Ok(());
    }
    let group = join()?;
    let (rank, world) = (group.rank() as u64, group.world_size());
    let model = |seed: u64| {
        TfBackend::manual_seed(seed);
        TfBackend::build_model(&cnn(), Device::Cpu)
    };
    let options = DistributedOptions::default();
    let mut ddp = kiln::tf::data_parallel(model(7 + rank)?, group.clone(), &options)?;
    answers_as_alone("DataParallel", &mut ddp, &mut model(7)?, world)?;
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let mut zero =
            kiln::tf::zero_data_parallel(model(7 + rank)?, group.clone(), stage, &options)?;
        answers_as_alone(stage.name(), &mut zero, &mut model(7)?, world)?;
    }
    group.barrier()?;
    Ok(())
}
