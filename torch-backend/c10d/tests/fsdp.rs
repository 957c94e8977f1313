//! Full sharding (`kiln_c10d::fully_shard`) over two ranks, each a separate
//! process on localhost (this test binary run again, as a launcher starts
//! ranks), against one process on the global batch: an MLP whose layers split
//! unevenly over the ranks (padding rows), a small transformer with a tied head
//! and checkpointed activations, and, against DDP, a CNN with batch norm. And
//! every strategy through the one wrapper against the model alone.

use std::sync::Arc;
use std::time::Duration;

use kiln_c10d::{data_parallel, fully_shard, FullShardOptions, ProcessGroup};
use kiln_core::backend::{Backend, StepPlan, TrainBackend, Trainable};
use kiln_core::distributed::{Collectives, DistributedOptions, Rendezvous};
use kiln_core::loss::Loss;
use kiln_core::model::{
    BatchNormConfig, Conv2dConfig, EmbeddingConfig, GatedMlpConfig, Layer, LinearConfig,
    Pool2dConfig, RmsNormConfig, SelfAttentionConfig, TiedLinearConfig,
};
use kiln_core::module::Module;
use kiln_core::optim::{
    AdagradConfig, AdamConfig, AdamWConfig, GradClip, Optimizer, OptimizerConfig, ParamGroup,
    ParamSelector, RmsPropConfig, SgdConfig,
};
use kiln_core::state_dict::StateDict;
use kiln_core::{Device, Result};
use kiln_data::{InMemoryDataset, SequentialLoader};
use kiln_testkit::ranks::{assert_all_passed, wait_all};
use kiln_torch::{TorchBackend, TorchModel, TorchOptimizer};
use kiln_train::{Trainer, TrainerConfig};
use tch::{Kind, Tensor};

/// The variable that makes this binary a rank instead of a test driver.
const ROLE: &str = "KILN_FSDP_TEST_ROLE";

/// Rows of each rank's micro-batch (the single process takes twice as many).
const B: i64 = 8;
const STEPS: i64 = 20;
const ACCUMULATE: i64 = 2;

#[path = "fsdp/wrapper_methods.rs"]
mod wrapper_methods;

/// On the driver: runs `test` as `world` ranks and checks they passed
/// (`true`); on a rank, `false`.
fn driven(test: &str, world: usize) -> bool {
    if std::env::var_os(ROLE).is_some() {
        return false;
    }
    let ranks: Vec<usize> = (0..world).collect();
    let children = kiln_testkit::ranks::spawn_ranks(ROLE, test, world, &ranks, &[]);
    let results = wait_all(children, Duration::from_secs(300));
    assert_all_passed(&results);
    for line in results[0].1.lines().filter(|l| l.starts_with("measured:")) {
        println!("{line}");
    }
    true
}

fn join() -> Result<Arc<ProcessGroup>> {
    let rendezvous = Rendezvous::from_env()?.expect("a rank's environment");
    let options = DistributedOptions {
        timeout: Duration::from_secs(60),
        ..DistributedOptions::default()
    };
    Ok(Arc::new(ProcessGroup::join(&rendezvous, &options)?))
}

/// 12 -> 33 -> 5: 33 and 5 rows split 17/16 and 3/2 (one padding row each).
fn mlp() -> Layer {
    Layer::sequential([
        LinearConfig::new(12, 33).into(),
        Layer::Relu,
        LinearConfig::new(33, 5).into(),
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

fn cnn() -> Layer {
    Layer::sequential([
        Conv2dConfig::new(1, 4, [3, 3]).with_padding([1, 1]).into(),
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

/// What the model reads: features, tokens or images.
#[derive(Clone, Copy)]
enum Inputs {
    Features,
    Tokens,
    Images,
}

/// Every micro-batch of the global run: `2B` rows each, 5 classes.
fn data(inputs: Inputs) -> Vec<(Tensor, Tensor)> {
    tch::manual_seed(99);
    let opts = (Kind::Float, tch::Device::Cpu);
    (0..STEPS * ACCUMULATE)
        .map(|_| {
            let x = match inputs {
                Inputs::Features => Tensor::randn([2 * B, 12], opts),
                Inputs::Tokens => Tensor::randint(11, [2 * B, 6], (Kind::Int64, tch::Device::Cpu)),
                Inputs::Images => Tensor::randn([2 * B, 1, 6, 6], opts),
            };
            (
                x,
                Tensor::randint(5, [2 * B], (Kind::Int64, tch::Device::Cpu)),
            )
        })
        .collect()
}

/// Trains over `batches` with gradient accumulation; `shard` (rank, world
/// size) picks this rank's rows of each global batch. Returns the losses.
fn fit<M: Trainable<TorchBackend>>(
    model: &mut M,
    opt: &mut M::Optim,
    clip: &GradClip,
    shard: Option<(i64, i64)>,
    batches: &[(Tensor, Tensor)],
) -> Result<Vec<f64>> {
    let loss = Loss::cross_entropy();
    let mut losses = Vec::new();
    for (i, (x, y)) in batches.iter().enumerate() {
        let (x, y) = match shard {
            Some((rank, world)) => {
                let n = x.size()[0] / world;
                (x.narrow(0, rank * n, n), y.narrow(0, rank * n, n))
            }
            None => (x.shallow_clone(), y.shallow_clone()),
        };
        let micro = i as i64 % ACCUMULATE;
        if micro == 0 {
            opt.zero_grad()?;
        }
        let plan = StepPlan {
            loss: &loss,
            scale: 1.0 / ACCUMULATE as f64,
            apply: micro + 1 == ACCUMULATE,
            clip: Some(clip),
        };
        losses.push(model.train_step(opt, &x, &y, &plan)?);
    }
    Ok(losses)
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The largest difference between two states with the same keys and shapes.
fn state_diff(a: &StateDict, b: &StateDict) -> f64 {
    let keys = |s: &StateDict| s.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
    assert_eq!(keys(a), keys(b), "the states' entries differ");
    a.iter()
        .map(|(k, x)| {
            let y = b.get(k).expect("the same keys");
            assert_eq!(x.dims(), y.dims(), "{k}: shapes");
            max_diff(&x.to_f64_vec(), &y.to_f64_vec())
        })
        .fold(0.0, f64::max)
}

/// One training of [`fsdp_equals_one_process`].
struct Case<'a> {
    name: &'a str,
    spec: Layer,
    inputs: Inputs,
    units: &'a [&'a str],
    reshard_after_forward: bool,
    optimizer: &'a OptimizerConfig,
    groups: &'a [ParamGroup],
    clip: GradClip,
    freeze: &'a [&'a str],
    checkpoint: &'a [&'a str],
}

fn build(case: &Case<'_>, seed: u64) -> Result<TorchModel> {
    TorchBackend::manual_seed(seed);
    let mut model = TorchModel::new(&case.spec, Device::Cpu)?;
    if !case.freeze.is_empty() {
        TorchBackend::freeze(&mut model, case.freeze, false)?;
    }
    if !case.checkpoint.is_empty() {
        model.checkpoint_activations(case.checkpoint)?;
    }
    Ok(model)
}

/// Trains `case` on this rank of `group` and alone on the global batch, and
/// compares: losses within 1e-6, weights within 5e-6; each rank's parameters and
/// optimizer state a shard; the gathered model and optimizer state one
/// process's (within 2e-5), loading back either way.
fn check(group: &Arc<ProcessGroup>, case: &Case<'_>) -> Result<()> {
    let (rank, world) = (group.rank() as i64, group.world_size() as i64);
    let what = case.name;
    let batches = data(case.inputs);
    let mut single = build(case, 7)?;
    let mut single_opt = single.build_optimizer(case.optimizer, case.groups)?;
    let single_losses = fit(&mut single, &mut single_opt, &case.clip, None, &batches)?;

    let shard = FullShardOptions {
        units: case.units.iter().map(|u| u.to_string()).collect(),
        reshard_after_forward: case.reshard_after_forward,
        ..FullShardOptions::default()
    };
    let module = build(case, 7 + rank as u64)?;
    let mut sharded = fully_shard(
        module,
        group.clone(),
        &shard,
        &DistributedOptions::default(),
    )?;
    let whole = sharded.num_parameters()?;
    assert_eq!(whole, single.num_parameters()?, "{what}: whole size");
    assert!(
        (sharded.strategy().shard_elements() as usize) < whole * 3 / 5,
        "{what}: rank {rank} holds {} of {whole} elements",
        sharded.strategy().shard_elements()
    );
    let mut opt = sharded.build_optimizer(case.optimizer, case.groups)?;
    let losses = fit(
        &mut sharded,
        &mut opt,
        &case.clip,
        Some((rank, world)),
        &batches,
    )?;
    let stats = sharded.strategy().prefetch_stats();
    println!(
        "measured: {what}: prefetched gathers used {}, dropped {}",
        stats.used, stats.dropped
    );
    if !case.units.is_empty() {
        // Every pass after the first follows the one before it.
        assert!(
            stats.used > 0,
            "{what}: no gather was prefetched: {stats:?}"
        );
        // Gathered ahead or on demand, the parameters are the same bits.
        let module = build(case, 7 + rank as u64)?;
        let on_demand = FullShardOptions {
            prefetch: false,
            ..shard.clone()
        };
        let mut plain = fully_shard(
            module,
            group.clone(),
            &on_demand,
            &DistributedOptions::default(),
        )?;
        let mut plain_opt = plain.build_optimizer(case.optimizer, case.groups)?;
        let plain_losses = fit(
            &mut plain,
            &mut plain_opt,
            &case.clip,
            Some((rank, world)),
            &batches,
        )?;
        assert_eq!(
            plain.strategy().prefetch_stats(),
            Default::default(),
            "{what}: prefetch off"
        );
        assert_eq!(
            plain_losses, losses,
            "{what}: losses with and without prefetch"
        );
        assert_eq!(
            plain.state_dict()?,
            sharded.state_dict()?,
            "{what}: weights with and without prefetch"
        );
    }
    let ours = sharded.state_dict()?;
    let loss_diff = max_diff(&losses, &single_losses);
    let weight_diff = state_diff(&ours, &single.state_dict()?);
    println!("measured: {what}: losses within {loss_diff:e}, weights within {weight_diff:e}");
    // Adam scales a gradient of rounding noise up to a full step: the small
    // transformer's weights on four ranks are 1.8e-6 apart, its losses 5e-7.
    assert!(loss_diff < 1e-6, "{what}: losses differ by {loss_diff}");
    assert!(
        weight_diff < 5e-6,
        "{what}: weights differ by {weight_diff}"
    );

    // The optimizer's state is this rank's shards; gathered, one process's.
    for (key, t) in opt.shard().state_dict()?.iter() {
        let full = single_opt.state_dict()?;
        let theirs = full.get(key).expect("the same entries");
        if key.ends_with(".exp_avg") || key.ends_with(".momentum_buffer") {
            assert!(
                t.dims()[0] < theirs.dims()[0] || theirs.dims()[0] == 1,
                "{what}: {key} is whole on rank {rank}"
            );
        }
    }
    // RMSprop's momentum divides by the root of a running square: 6e-6 apart
    // on four ranks where the weights are within 2e-7.
    let gathered = opt.state_dict()?;
    let diff = state_diff(&gathered, &single_opt.state_dict()?);
    assert!(
        diff < 2e-5,
        "{what}: gathered optimizer state differs by {diff}"
    );
    let mut fresh: TorchOptimizer = build(case, 7)?.build_optimizer(case.optimizer, case.groups)?;
    fresh.load_state_dict(&gathered)?;
    assert_eq!(fresh.state_dict()?, gathered, "{what}: into one process");
    opt.load_state_dict(&single_opt.state_dict()?)?;
    assert_eq!(
        state_diff(&opt.state_dict()?, &single_opt.state_dict()?),
        0.0,
        "{what}: optimizer state from one process"
    );
    sharded.load_state_dict(&single.state_dict()?)?;
    assert_eq!(
        state_diff(&sharded.state_dict()?, &single.state_dict()?),
        0.0,
        "{what}: model from one process"
    );
    Ok(())
}

/// Two ranks of `B` rows against one process of `2B`: losses and weights
/// agree within 1e-6 (the ranks start from other weights: FSDP makes them
/// rank 0's). Each rank holds about half of every parameter; the gathered
/// model and optimizer state are one process's, and load back either way.
#[test]
fn fsdp_equals_one_process() -> Result<()> {
    if driven("fsdp_equals_one_process", 2) {
        return Ok(());
    }
    let group = join()?;
    let (rank, world) = (group.rank() as i64, group.world_size() as i64);
    let adam = OptimizerConfig::Adam(AdamConfig::new(1e-2));
    let mut sgd = SgdConfig::new(0.05);
    sgd.momentum = 0.9;
    let sgd = OptimizerConfig::Sgd(sgd);
    let biases = [ParamGroup::new("biases", ParamSelector::Suffix("bias".into())).with_lr(0.01)];
    let inf = GradClip::Norm {
        max_norm: 0.05,
        norm_type: f64::INFINITY,
    };
    let cases = [
        Case {
            name: "mlp, a unit per layer",
            spec: mlp(),
            inputs: Inputs::Features,
            units: &["0", "2"],
            reshard_after_forward: true,
            optimizer: &adam,
            groups: &[],
            clip: GradClip::norm(0.5),
            freeze: &[],
            checkpoint: &[],
        },
        Case {
            name: "mlp, the root unit only, kept after forward, sgd, groups, inf-norm",
            spec: mlp(),
            inputs: Inputs::Features,
            units: &[],
            reshard_after_forward: false,
            optimizer: &sgd,
            groups: &biases,
            clip: inf,
            freeze: &[],
            checkpoint: &[],
        },
        Case {
            name: "mlp, a frozen unit",
            spec: mlp(),
            inputs: Inputs::Features,
            units: &["0"],
            reshard_after_forward: true,
            optimizer: &adam,
            groups: &[],
            clip: GradClip::norm(0.5),
            freeze: &["0.*"],
            checkpoint: &[],
        },
        Case {
            name: "transformer, blocks as units, checkpointed, tied head",
            spec: transformer(),
            inputs: Inputs::Tokens,
            units: &["1", "2"],
            reshard_after_forward: true,
            optimizer: &adam,
            groups: &[],
            clip: GradClip::norm(0.5),
            freeze: &[],
            checkpoint: &["1.*", "2.*"],
        },
    ];
    for case in &cases {
        check(&group, case)?;
    }

    // bf16-mixed with the units gathering bf16 (float32 shards, Adam state and
    // reduction): autocast casts the same weights to bf16 for the matmuls, so
    // only the gradients' rounding to bf16 differs from one process. Five
    // steps: Adam turns that rounding into weights that drift apart step by
    // step (4e-3 after twenty), which says nothing more about the gathers.
    let mut batches = data(Inputs::Features);
    batches.truncate((5 * ACCUMULATE) as usize);
    let bf16 = |seed: u64| -> Result<TorchModel> {
        TorchBackend::manual_seed(seed);
        let mut model = TorchModel::new(&mlp(), Device::Cpu)?;
        model.set_precision(kiln_core::precision::FloatPrecision::Bf16Mixed)?;
        Ok(model)
    };
    let mut single = bf16(7)?;
    let mut single_opt = single.build_optimizer(&adam, &[])?;
    let clip = GradClip::norm(0.5);
    let single_losses = fit(&mut single, &mut single_opt, &clip, None, &batches)?;
    let shard = FullShardOptions {
        units: vec!["0".into(), "2".into()],
        param_dtype: Some(kiln_core::DType::BF16),
        reduce_dtype: Some(kiln_core::DType::F32),
        ..FullShardOptions::default()
    };
    let mut sharded = fully_shard(
        bf16(7 + rank as u64)?,
        group.clone(),
        &shard,
        &DistributedOptions::default(),
    )?;
    let mut opt = sharded.build_optimizer(&adam, &[])?;
    let losses = fit(&mut sharded, &mut opt, &clip, Some((rank, world)), &batches)?;
    let loss_diff = max_diff(&losses, &single_losses);
    let weight_diff = state_diff(&sharded.state_dict()?, &single.state_dict()?);
    println!("measured: bf16 gathers: losses within {loss_diff:e}, weights within {weight_diff:e}");
    assert!(
        loss_diff < 2e-3,
        "bf16 gathers: losses differ by {loss_diff}"
    );
    assert!(
        weight_diff < 2e-3,
        "bf16 gathers: weights differ by {weight_diff}"
    );
    for (name, p) in sharded.named_parameters()? {
        assert_eq!(p.kind(), Kind::Float, "{name}: the shard stays float32");
    }
    // Without autocast, a bf16 gather would meet float32 inputs: refused.
    let err = fully_shard(
        TorchModel::new(&mlp(), Device::Cpu)?,
        group.clone(),
        &shard,
        &DistributedOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("param_dtype") && err.contains("bf16-mixed"),
        "{err}"
    );
    Collectives::barrier(group.as_ref())?;
    Ok(())
}

/// Four ranks of `B / 2` rows against one process of `2B`, with the other
/// optimizers (AdamW's decoupled decay, RMSprop with momentum, Adagrad: the
/// padding rows stay zero under each) and the transformer.
#[test]
fn fsdp_on_four_ranks_equals_one_process() -> Result<()> {
    if driven("fsdp_on_four_ranks_equals_one_process", 4) {
        return Ok(());
    }
    let group = join()?;
    let adamw = OptimizerConfig::AdamW(AdamWConfig::new(1e-2));
    let mut rmsprop = RmsPropConfig::new(1e-2);
    rmsprop.momentum = 0.5;
    let rmsprop = OptimizerConfig::RmsProp(rmsprop);
    let adagrad = OptimizerConfig::Adagrad(AdagradConfig::new(5e-2));
    let adam = OptimizerConfig::Adam(AdamConfig::new(1e-2));
    let mlp_with = |name, optimizer| Case {
        name,
        spec: mlp(),
        inputs: Inputs::Features,
        units: &["0", "2"],
        reshard_after_forward: true,
        optimizer,
        groups: &[],
        clip: GradClip::norm(0.5),
        freeze: &[],
        checkpoint: &[],
    };
    let cases = [
        mlp_with("4 ranks, mlp, adamw", &adamw),
        mlp_with("4 ranks, mlp, rmsprop", &rmsprop),
        mlp_with("4 ranks, mlp, adagrad", &adagrad),
        Case {
            name: "4 ranks, transformer",
            spec: transformer(),
            inputs: Inputs::Tokens,
            units: &["1", "2"],
            reshard_after_forward: false,
            optimizer: &adam,
            groups: &[],
            clip: GradClip::norm(0.5),
            freeze: &[],
            checkpoint: &[],
        },
    ];
    for case in &cases {
        check(&group, case)?;
    }
    Collectives::barrier(group.as_ref())?;
    Ok(())
}

/// A CNN with batch norm under FSDP (its first layer a unit inside the root
/// unit) trains what it trains under DDP (both take rank 0's running
/// statistics before each forward pass), and evaluates through the Trainer
/// with another number of batches on each rank; a state of
/// another shape, loss scaling and a unit pattern that matches nothing are
/// refused, alike on both ranks and before any collective.
#[test]
fn fsdp_equals_ddp_and_refuses_what_cannot_work() -> Result<()> {
    if driven("fsdp_equals_ddp_and_refuses_what_cannot_work", 2) {
        return Ok(());
    }
    let group = join()?;
    let (rank, world) = (group.rank() as i64, group.world_size() as i64);
    let batches = data(Inputs::Images);
    // SGD: the convolution's bias, which the batch norm after it cancels, has
    // gradients of rounding noise only, which Adam would scale up to full steps.
    let mut sgd = SgdConfig::new(0.05);
    sgd.momentum = 0.9;
    let sgd = OptimizerConfig::Sgd(sgd);
    let clip = GradClip::norm(0.5);
    let model = |seed: u64| {
        TorchBackend::manual_seed(seed);
        TorchModel::new(&cnn(), Device::Cpu)
    };
    let options = DistributedOptions::default();
    let mut ddp = data_parallel(model(7)?, group.clone(), &options)?;
    let mut ddp_opt = ddp.build_optimizer(&sgd, &[])?;
    let ddp_losses = fit(&mut ddp, &mut ddp_opt, &clip, Some((rank, world)), &batches)?;
    let shard = FullShardOptions {
        units: vec!["0".into(), "5".into()],
        ..FullShardOptions::default()
    };
    let mut sharded = fully_shard(model(7 + rank as u64)?, group.clone(), &shard, &options)?;
    let units: Vec<&str> = sharded
        .strategy()
        .units()
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(units, ["0", "5", ""]);
    let mut opt = sharded.build_optimizer(&sgd, &[])?;
    let losses = fit(&mut sharded, &mut opt, &clip, Some((rank, world)), &batches)?;
    let loss_diff = max_diff(&losses, &ddp_losses);
    let weight_diff = state_diff(&sharded.state_dict()?, &ddp.state_dict()?);
    println!(
        "measured: cnn against DDP: losses within {loss_diff:e}, weights within {weight_diff:e}"
    );
    assert!(loss_diff < 1e-6, "losses differ by {loss_diff}");
    assert!(weight_diff < 1e-6, "weights differ by {weight_diff}");
    // The wrapper tells what the model it wraps would: its batch norms (SWA's
    // statistics pass needs them) and, frozen, the whole model's names.
    let stats = sharded.running_stats()?;
    assert_eq!(stats, ddp.running_stats()?);
    assert_eq!(stats.len(), 1, "{stats:?}");
    assert_eq!(sharded.frozen_parameters()?, Vec::<String>::new());
    let mut frozen = model(7)?;
    kiln_torch::Freeze::freeze(&mut frozen, &["0.*"])?;
    let frozen = fully_shard(frozen, group.clone(), &shard, &options)?;
    assert_eq!(frozen.frozen_parameters()?, ["0.weight", "0.bias"]);

    // Evaluation through the Trainer, rank 0 on 3 batches and rank 1 on 2:
    // every forward pass is a collective, so rank 1 runs its last batch once
    // more, uncounted; the metrics over both ranks are one process's on all 5.
    let (images, labels) = &batches[0];
    let rows = |from: i64, n: i64| -> Result<SequentialLoader> {
        let x = kiln_torch::from_tch(&images.narrow(0, from, n))?;
        let y = kiln_torch::from_tch(&labels.narrow(0, from, n))?;
        SequentialLoader::new(InMemoryDataset::new(x, y)?, 3)
    };
    let mine = if rank == 0 { rows(0, 9)? } else { rows(9, 6)? };
    let trainer = Trainer::<TorchBackend, _>::new(TrainerConfig::default(), Loss::cross_entropy())?;
    let ours = trainer.evaluate(&mut sharded, &mine)?;
    let mut alone = model(1)?;
    alone.load_state_dict(&sharded.state_dict()?)?;
    let reference =
        Trainer::<TorchBackend, TorchModel>::new(TrainerConfig::default(), Loss::cross_entropy())?
            .evaluate(&mut alone, &rows(0, 15)?)?;
    println!("measured: evaluation on 3 + 2 batches: {ours:?}, one process: {reference:?}");
    assert_eq!(ours.len(), reference.len());
    for ((name, a), (_, b)) in ours.iter().zip(&reference) {
        assert!((a - b).abs() < 1e-6, "{name}: {a} on the ranks, {b} alone");
    }

    // A whole state of the wrong shape: refused, naming it, nothing changed.
    let before = sharded.state_dict()?;
    let mut wrong = before.clone();
    wrong.insert(
        "5.weight".to_owned(),
        kiln_core::HostTensor::zeros(kiln_core::DType::F32, vec![5usize, 35])?,
    );
    let err = sharded.load_state_dict(&wrong).unwrap_err().to_string();
    assert!(err.contains("5.weight") && err.contains("[5, 35]"), "{err}");
    assert_eq!(state_diff(&sharded.state_dict()?, &before), 0.0);

    let err = fully_shard(
        model(7)?,
        group.clone(),
        &FullShardOptions {
            units: vec!["9".into()],
            ..FullShardOptions::default()
        },
        &options,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("`9` matches no layer"), "{err}");
    let mut half = model(7)?;
    half.set_precision(kiln_core::precision::FloatPrecision::F16Mixed)?;
    let sharded = fully_shard(half, group.clone(), &FullShardOptions::default(), &options)?;
    let err = sharded.build_optimizer(&sgd, &[]).unwrap_err().to_string();
    assert!(err.contains("FSDP") && err.contains("bf16-mixed"), "{err}");
    Collectives::barrier(group.as_ref())?;
    Ok(())
}

/// A rank that dies during FSDP training: the survivor's next step fails at
/// once (in its first unit's all-gather), naming it.
#[test]
fn a_dead_rank_fails_the_next_fsdp_step_naming_it() -> Result<()> {
    if std::env::var_os(ROLE).is_none() {
        let children = kiln_testkit::ranks::spawn_ranks(
            ROLE,
            "a_dead_rank_fails_the_next_fsdp_step_naming_it",
            2,
            &[0, 1],
            &[],
        );
        let results = wait_all(children, Duration::from_secs(120));
        // Rank 1 dies on purpose; rank 0's test passes by seeing the error.
        assert_eq!(results[1].0, Some(17), "{}", results[1].1);
        assert_eq!(results[0].0, Some(0), "rank 0:\n{}", results[0].1);
        return Ok(());
    }
    let group = join()?;
    let (rank, world) = (group.rank() as i64, group.world_size() as i64);
    let batches = data(Inputs::Features);
    let adam = OptimizerConfig::Adam(AdamConfig::new(1e-2));
    TorchBackend::manual_seed(7);
    let module = TorchModel::new(&mlp(), Device::Cpu)?;
    let shard = FullShardOptions {
        units: vec!["0".into(), "2".into()],
        ..FullShardOptions::default()
    };
    let mut sharded = fully_shard(
        module,
        group.clone(),
        &shard,
        &DistributedOptions::default(),
    )?;
    let mut opt = sharded.build_optimizer(&adam, &[])?;
    let clip = GradClip::norm(1.0);
    fit(
        &mut sharded,
        &mut opt,
        &clip,
        Some((rank, world)),
        &batches[..2],
    )?;
    if rank == 1 {
        std::process::exit(17);
    }
    let start = std::time::Instant::now();
    let err = fit(
        &mut sharded,
        &mut opt,
        &clip,
        Some((rank, world)),
        &batches[..2],
    )
    .err()
    .map(|e| e.display_chain().to_string())
    .expect("an FSDP step with a dead peer succeeded");
    assert!(
        err.contains("rank 1 of 2 stopped responding"),
        "the error does not name the dead rank: {err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
    Ok(())
}
