//! c10d through Kiln's bridge, in real separate processes on localhost: each
//! test re-runs this test binary as its ranks (with `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, ... set as a launcher sets them) and checks what they report.
//! This is the guard that Kiln's Gloo declarations (include/gloo-api) and the
//! torch wheel agree.

use std::process::Child;
use std::time::{Duration, Instant};

use kiln_testkit::ranks::{assert_all_passed, wait_all};

use kiln_c10d::{data_parallel, ProcessGroup};
use kiln_core::distributed::{DistributedOptions, ReduceOp, Rendezvous};
use kiln_core::export::ExportOptions;
use kiln_core::{HostTensor, Result};
use tch::Tensor;

/// The variable that makes this binary a rank instead of a test driver.
const ROLE: &str = "KILN_DIST_TEST_ROLE";

/// Starts `world` ranks of test `test` (ranks listed in `ranks`), with `extra`
/// variables.
fn spawn_ranks(test: &str, world: usize, ranks: &[usize], extra: &[(&str, String)]) -> Vec<Child> {
    kiln_testkit::ranks::spawn_ranks(ROLE, test, world, ranks, extra)
}

fn is_rank() -> bool {
    std::env::var_os(ROLE).is_some()
}

fn join(timeout: Duration) -> Result<ProcessGroup> {
    let rendezvous = Rendezvous::from_env()?.expect("a rank's environment");
    let options = DistributedOptions {
        timeout,
        ..DistributedOptions::default()
    };
    ProcessGroup::join(&rendezvous, &options)
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(tch::Kind::Double).flatten(0, -1)).expect("values")
}

#[test]
fn collectives_over_two_ranks() -> Result<()> {
    if !is_rank() {
        let results = wait_all(
            spawn_ranks("collectives_over_two_ranks", 2, &[0, 1], &[]),
            Duration::from_secs(120),
        );
        assert_all_passed(&results);
        return Ok(());
    }
    let group = join(Duration::from_secs(60))?;
    let r = group.rank() as f64;
    assert_eq!(group.world_size(), 2);

    // Rank r holds [r+1, 10(r+1)]: sum [3, 30], mean [1.5, 15], max [2, 20].
    let make = || Tensor::from_slice(&[(r + 1.0) as f32, (10.0 * (r + 1.0)) as f32]);
    for (op, expected) in [
        (ReduceOp::Sum, [3.0, 30.0]),
        (ReduceOp::Mean, [1.5, 15.0]),
        (ReduceOp::Max, [2.0, 20.0]),
        (ReduceOp::Min, [1.0, 10.0]),
        (ReduceOp::Product, [2.0, 200.0]),
    ] {
        let t = make();
        group.all_reduce(&t, op)?;
        assert_eq!(values(&t), expected, "{op:?}");
    }

    // Broadcast from rank 1 of a 2x3 tensor.
    let t = Tensor::full([2, 3], r + 5.0, (tch::Kind::Float, tch::Device::Cpu));
    group.broadcast(&t, 1)?;
    assert_eq!(values(&t), vec![6.0; 6]);

    // All-gather stacks every rank's tensor.
    let gathered = group.all_gather(&Tensor::from_slice(&[r as i64, 7]))?;
    assert_eq!(gathered.size(), vec![2, 2]);
    assert_eq!(values(&gathered), vec![0.0, 7.0, 1.0, 7.0]);

    // Host memory in place (TensorFlow's route) and a HostTensor of int64.
    let mut host = vec![r as f32 + 0.5; 1000];
    group.all_reduce_f32(&mut host, ReduceOp::Sum)?;
    assert!(host.iter().all(|&x| x == 2.0));
    let mut counts = HostTensor::new(vec![r as i64 + 1, 4], [2])?;
    group.all_reduce_host(&mut counts, ReduceOp::Sum)?;
    assert_eq!(counts.as_slice::<i64>()?, &[3, 8]);

    // The store, shared by the ranks of this attempt.
    if group.rank() == 0 {
        group.store_set("greeting", b"from rank 0")?;
    }
    assert_eq!(group.store_get("greeting")?, b"from rank 0");

    // Bad arguments are errors, not crashes.
    let err = group.broadcast(&make(), 2).err().map(|e| e.to_string());
    assert!(err.is_some_and(|m| m.contains("rank 2 is not below the world size 2")));

    // Coalesced broadcast (DDP's model sync) of tensors of several dtypes.
    let a = Tensor::full([3], r, (tch::Kind::Float, tch::Device::Cpu));
    let b = Tensor::full([2, 2], r * 2.0, (tch::Kind::Double, tch::Device::Cpu));
    group.broadcast_coalesced(&[&a, &b], 1 << 20, 0)?;
    assert_eq!(values(&a), vec![0.0; 3]);
    assert_eq!(values(&b), vec![0.0; 4]);

    // Reduce-scatter (ZeRO's gradients): rank r holds [10r, 10r+1, 10r+2, 10r+3];
    // the sums are [10, 12, 14, 16], rank 0 keeps the first half, rank 1 the second.
    let input = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0]) + 10.0 * r;
    let mine = Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu));
    group.reduce_scatter(&mine, &input, ReduceOp::Sum)?;
    let expected = if r == 0.0 { [10.0, 12.0] } else { [14.0, 16.0] };
    assert_eq!(values(&mine), expected);
    group.reduce_scatter(&mine, &input, ReduceOp::Mean)?;
    assert_eq!(values(&mine), expected.map(|v| v / 2.0));
    // The same from a buffer given up (an all-reduce in place on Gloo), into a
    // two-dimensional share of a two-dimensional buffer.
    let mine_2d = Tensor::zeros([1, 2], (tch::Kind::Float, tch::Device::Cpu));
    group.reduce_scatter_owned(&mine_2d, input.view([2, 2]).copy(), ReduceOp::Sum)?;
    assert_eq!(values(&mine_2d), expected);
    group.reduce_scatter_owned(&mine, input.copy(), ReduceOp::Mean)?;
    assert_eq!(values(&mine), expected.map(|v| v / 2.0));
    group.reduce_scatter_owned(&mine, input.copy(), ReduceOp::Max)?;
    assert_eq!(
        values(&mine),
        if r == 0.0 { [10.0, 11.0] } else { [12.0, 13.0] }
    );
    // All-gather into one buffer (ZeRO's parameters), rank after rank.
    let whole = Tensor::zeros([4], (tch::Kind::Float, tch::Device::Cpu));
    group.all_gather_into(&whole, &Tensor::from_slice(&[r as f32, r as f32 + 0.5]))?;
    assert_eq!(values(&whole), vec![0.0, 0.5, 1.0, 1.5]);
    // Buffers whose sizes do not fit are refused before any collective.
    let err = group
        .reduce_scatter(
            &mine,
            &Tensor::zeros([5], (tch::Kind::Float, tch::Device::Cpu)),
            ReduceOp::Sum,
        )
        .err()
        .map(|e| e.to_string());
    assert!(
        err.is_some_and(|m| m.contains("2 x 2 elements")),
        "reduce_scatter sizes"
    );

    group.barrier()?;
    Ok(())
}

#[test]
fn file_store_rendezvous() -> Result<()> {
    if !is_rank() {
        let dir = kiln_testkit::TempDir::new("file-store");
        let path = dir.path().join("store");
        let results = wait_all(
            spawn_ranks(
                "file_store_rendezvous",
                2,
                &[0, 1],
                &[("KILN_INIT_METHOD", format!("file://{}", path.display()))],
            ),
            Duration::from_secs(120),
        );
        assert_all_passed(&results);
        return Ok(());
    }
    let group = join(Duration::from_secs(60))?;
    let t = Tensor::from_slice(&[group.rank() as f32]);
    group.all_reduce(&t, ReduceOp::Sum)?;
    assert_eq!(values(&t), vec![1.0]);
    Ok(())
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout_naming_the_count() -> Result<()> {
    if !is_rank() {
        // Only rank 0 of 2 starts.
        let results = wait_all(
            spawn_ranks(
                "a_rank_that_never_arrives_is_a_timeout_naming_the_count",
                2,
                &[0],
                &[],
            ),
            Duration::from_secs(60),
        );
        assert_all_passed(&results);
        return Ok(());
    }
    let start = Instant::now();
    let err = join(Duration::from_secs(2)).err().map(|e| e.to_string());
    let message = err.unwrap_or_default();
    assert!(
        message.contains("rendezvous timed out after 2 s: 1 of 2 ranks joined"),
        "{message}"
    );
    assert!(start.elapsed() < Duration::from_secs(30));
    Ok(())
}

#[test]
fn a_dead_rank_fails_the_next_collective() -> Result<()> {
    if !is_rank() {
        let results = wait_all(
            spawn_ranks("a_dead_rank_fails_the_next_collective", 2, &[0, 1], &[]),
            Duration::from_secs(60),
        );
        // Rank 1 dies on purpose; rank 0's test passes by seeing the error.
        assert_eq!(results[1].0, Some(17), "{}", results[1].1);
        assert_eq!(results[0].0, Some(0), "rank 0:\n{}", results[0].1);
        return Ok(());
    }
    let group = join(Duration::from_secs(10))?;
    let t = Tensor::from_slice(&[1.0f32]);
    group.all_reduce(&t, ReduceOp::Sum)?;
    if group.rank() == 1 {
        std::process::exit(17);
    }
    let start = Instant::now();
    let err = group
        .all_reduce(&t, ReduceOp::Sum)
        .err()
        .map(|e| e.to_string());
    let message = err.expect("an all-reduce with a dead peer succeeded");
    assert!(
        message.contains("rank 1 of 2 stopped responding"),
        "the error does not name the dead rank: {message}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    Ok(())
}

mod ddp {
    use super::*;
    use kiln_core::backend::{Backend, StepPlan, TrainBackend, Trainable};
    use kiln_core::distributed::Collectives;
    use kiln_core::loss::Loss;
    use kiln_core::model::{BatchNormConfig, Conv2dConfig, Layer, LinearConfig, Pool2dConfig};
    use kiln_core::module::Module;
    use kiln_core::optim::{AdamConfig, GradClip, Optimizer, OptimizerConfig};
    use kiln_core::Device;
    use kiln_torch::{Chain, ScriptModule, TchModule, TorchBackend, TorchModel, TorchOptimizer};
    use std::sync::Arc;
    use tch::nn::Module as _;

    pub(super) const B: i64 = 8;
    const STEPS: i64 = 20;
    const ACCUMULATE: i64 = 2;

    pub(super) fn mlp() -> Layer {
        Layer::sequential([
            LinearConfig::new(12, 32).into(),
            Layer::Relu,
            LinearConfig::new(32, 5).into(),
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

    /// Every micro-batch of the global run: `2B` rows each.
    pub(super) fn data(image: bool) -> Vec<(Tensor, Tensor)> {
        tch::manual_seed(99);
        (0..STEPS * ACCUMULATE)
            .map(|_| {
                let x = if image {
                    Tensor::randn([2 * B, 1, 6, 6], (tch::Kind::Float, tch::Device::Cpu))
                } else {
                    Tensor::randn([2 * B, 12], (tch::Kind::Float, tch::Device::Cpu))
                };
                (
                    x,
                    Tensor::randint(5, [2 * B], (tch::Kind::Int64, tch::Device::Cpu)),
                )
            })
            .collect()
    }

    /// Trains `spec`; `shard` picks this rank's rows of each global batch.
    /// Returns the per-micro-batch losses and the final parameters, flattened.
    fn train(
        spec: &Layer,
        seed: i64,
        group: Option<Arc<ProcessGroup>>,
        batches: &[(Tensor, Tensor)],
    ) -> Result<(Vec<f64>, Vec<f64>, TorchModel)> {
        train_with(
            spec,
            seed,
            group,
            batches,
            &DistributedOptions::default(),
            &[],
        )
    }

    fn train_with(
        spec: &Layer,
        seed: i64,
        group: Option<Arc<ProcessGroup>>,
        batches: &[(Tensor, Tensor)],
        options: &DistributedOptions,
        freeze: &[&str],
    ) -> Result<(Vec<f64>, Vec<f64>, TorchModel)> {
        TorchBackend::manual_seed(seed as u64);
        let mut model = TorchModel::new(spec, Device::Cpu)?;
        if !freeze.is_empty() {
            TorchBackend::freeze(&mut model, freeze, false)?;
        }
        let (losses, model) = match group {
            Some(g) => {
                let shard = (g.rank() as i64, g.world_size() as i64);
                let mut model = data_parallel(model, g, options)?;
                let losses = fit(&mut model, Some(shard), batches)?;
                (losses, model.into_inner())
            }
            None => {
                let losses = fit(&mut model, None, batches)?;
                (losses, model)
            }
        };
        let flat: Vec<f64> = model
            .named_parameters()?
            .iter()
            .chain(&model.named_buffers()?)
            .flat_map(|(_, t)| values(t))
            .collect();
        Ok((losses, flat, model))
    }

    /// Adam with clipping and gradient accumulation over `batches`; `shard`
    /// (rank, world size) picks this rank's rows of each global batch.
    fn fit<M: Trainable<TorchBackend>>(
        model: &mut M,
        shard: Option<(i64, i64)>,
        batches: &[(Tensor, Tensor)],
    ) -> Result<Vec<f64>> {
        let adam = OptimizerConfig::Adam(AdamConfig::new(1e-2));
        let clip = GradClip::Norm {
            max_norm: 0.5,
            norm_type: 2.0,
        };
        let mut opt = model.build_optimizer(&adam, &[])?;
        fit_with(model, &mut opt, &clip, shard, batches)
    }

    /// [`fit`] with optimizer `opt` and clipping `clip`.
    pub(super) fn fit_with<M: Trainable<TorchBackend>>(
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

    pub(super) fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// Two ranks with `B` rows each against one process with `2B` rows: the
    /// same losses and weights (an MLP: no batch statistics), with Adam,
    /// clipping by norm and gradient accumulation; the ranks start from
    /// different weights and DDP makes them rank 0's.
    #[test]
    fn two_ranks_of_b_equal_one_process_of_2b() -> Result<()> {
        if !is_rank() {
            let results = wait_all(
                spawn_ranks(
                    "ddp::two_ranks_of_b_equal_one_process_of_2b",
                    2,
                    &[0, 1],
                    &[],
                ),
                Duration::from_secs(180),
            );
            assert_all_passed(&results);
            return Ok(());
        }
        let group = Arc::new(join(Duration::from_secs(60))?);
        let batches = data(false);
        let seed = 7 + group.rank() as i64; // rank 1 starts elsewhere
        let (single_losses, single_weights, _) = train(&mlp(), 7, None, &batches)?;
        // DDP's defaults; tiny buckets (one per parameter after the first step's
        // rebuild) with the unused-parameter search; no buffer broadcasts.
        let variants = [
            DistributedOptions::default(),
            DistributedOptions {
                bucket_cap_mb: 0.0001,
                find_unused_parameters: true,
                ..DistributedOptions::default()
            },
            DistributedOptions {
                broadcast_buffers: false,
                ..DistributedOptions::default()
            },
        ];
        for options in &variants {
            let (losses, weights, _) =
                train_with(&mlp(), seed, Some(group.clone()), &batches, options, &[])?;
            // Every rank ends with the same weights, bit for bit.
            let gathered = group.all_gather(&Tensor::from_slice(&weights))?;
            let rows: Vec<Vec<f64>> = (0..2).map(|r| values(&gathered.get(r))).collect();
            assert_eq!(rows[0], rows[1], "the ranks' weights differ ({options:?})");
            let loss_diff = max_diff(&losses, &single_losses);
            let weight_diff = max_diff(&weights, &single_weights);
            assert!(
                loss_diff < 1e-6,
                "{options:?}: losses differ by {loss_diff}: {losses:?} vs {single_losses:?}"
            );
            assert!(
                weight_diff < 1e-6,
                "{options:?}: weights differ by {weight_diff}"
            );
        }
        // A frozen first layer: only the rest is reduced, and the frozen
        // weights are rank 0's on every rank (broadcast once, at the start).
        let frozen = ["0.*"];
        let opts = DistributedOptions::default();
        let (single_losses, single_weights, single) =
            train_with(&mlp(), 7, None, &batches, &opts, &frozen)?;
        let (losses, weights, _) =
            train_with(&mlp(), seed, Some(group.clone()), &batches, &opts, &frozen)?;
        assert!(max_diff(&losses, &single_losses) < 1e-6, "frozen: losses");
        assert!(
            max_diff(&weights, &single_weights) < 1e-6,
            "frozen: weights"
        );
        TorchBackend::manual_seed(7);
        let initial = TorchModel::new(&mlp(), Device::Cpu)?;
        let first = |m: &TorchModel| -> Result<Vec<f64>> {
            Ok(m.named_parameters()?
                .iter()
                .filter(|(n, _)| n.starts_with("0."))
                .flat_map(|(_, t)| values(t))
                .collect())
        };
        assert_eq!(
            first(&single)?,
            first(&initial)?,
            "the frozen layer did not train"
        );
        assert_eq!(
            weights[..first(&initial)?.len()],
            first(&initial)?[..],
            "rank 0's frozen layer"
        );

        // A bucket cap that is not a positive size is refused, naming the option.
        let model = TorchModel::new(&mlp(), Device::Cpu)?;
        let bad = DistributedOptions {
            bucket_cap_mb: 0.0,
            ..DistributedOptions::default()
        };
        let err = data_parallel(model, group.clone(), &bad)
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|m| m.contains("bucket_cap_mb")));
        Collectives::barrier(group.as_ref())?;
        Ok(())
    }

    /// The weights of a trained module, parameters then buffers, flattened.
    pub(super) fn weights(model: &impl Module<TorchBackend>) -> Result<Vec<f64>> {
        Ok(model
            .named_parameters()?
            .iter()
            .chain(&model.named_buffers()?)
            .flat_map(|(_, t)| values(t))
            .collect())
    }

    /// Two ranks of `B` train module `make` builds (rank 1 from other
    /// weights) as one process of `2B` does, under `DataParallel` (Adam,
    /// clipping, gradient accumulation); returns the largest loss and weight
    /// differences.
    fn as_one_process<M>(
        group: &Arc<ProcessGroup>,
        make: impl Fn(i64, &str) -> Result<M>,
    ) -> Result<(f64, f64)>
    where
        M: Trainable<TorchBackend, Optim = TorchOptimizer> + Module<TorchBackend>,
    {
        let batches = data(false);
        let mut single = make(7, "single")?;
        let single_losses = fit(&mut single, None, &batches)?;
        let (rank, world) = (group.rank() as i64, group.world_size() as i64);
        let module = make(7 + rank, &format!("rank{rank}"))?;
        let mut model = data_parallel(module, group.clone(), &DistributedOptions::default())?;
        let losses = fit(&mut model, Some((rank, world)), &batches)?;
        Ok((
            max_diff(&losses, &single_losses),
            max_diff(&weights(&model)?, &weights(&single)?),
        ))
    }

    /// Every kind of torch module trains under `DataParallel`, two ranks of
    /// `B` giving what one process of `2B` gives: a built model, a TorchScript
    /// module, `tch` code, a chain of them, and a boxed module.
    #[test]
    fn every_torch_module_kind_trains_under_data_parallel() -> Result<()> {
        if !is_rank() {
            let results = wait_all(
                spawn_ranks(
                    "ddp::every_torch_module_kind_trains_under_data_parallel",
                    2,
                    &[0, 1],
                    &[],
                ),
                Duration::from_secs(300),
            );
            assert_all_passed(&results);
            let (_, rank0) = &results[0];
            rank0
                .lines()
                .filter(|l| l.starts_with("measured:"))
                .for_each(|l| println!("{l}"));
            return Ok(());
        }
        let group = Arc::new(join(Duration::from_secs(60))?);
        let dir = kiln_testkit::TempDir::new("every-kind");
        let built = |seed: i64| -> Result<TorchModel> {
            TorchBackend::manual_seed(seed as u64);
            TorchModel::new(&mlp(), Device::Cpu)
        };
        // `tch` code: two linear layers with a tanh between them.
        let tch_code = |seed: i64| -> Result<TchModule> {
            tch::manual_seed(seed);
            TchModule::new(Device::Cpu, |p| {
                let hidden = tch::nn::linear(p / "hidden", 12, 16, Default::default());
                let out = tch::nn::linear(p / "out", 16, 5, Default::default());
                move |x: &Tensor, _train: bool| Ok(out.forward(&hidden.forward(x).f_tanh()?))
            })
        };
        let mut measured = Vec::new();
        measured.push(("TorchModel", as_one_process(&group, |seed, _| built(seed))?));
        measured.push((
            "ScriptModule",
            as_one_process(&group, |seed, tag| {
                let path = dir.path().join(format!("{tag}.pt"));
                kiln_torch::export_torchscript(&built(seed)?, &path, &ExportOptions::default())?;
                ScriptModule::load(&path, Device::Cpu)
            })?,
        ));
        measured.push((
            "TchModule",
            as_one_process(&group, |seed, _| tch_code(seed))?,
        ));
        measured.push((
            "Chain",
            as_one_process(&group, |seed, _| {
                TorchBackend::manual_seed(seed as u64);
                let body = TorchModel::new(
                    &Layer::sequential([LinearConfig::new(12, 16).into(), Layer::Tanh]),
                    Device::Cpu,
                )?;
                tch::manual_seed(seed);
                let head = TchModule::new(Device::Cpu, |p| {
                    let out = tch::nn::linear(p / "out", 16, 5, Default::default());
                    move |x: &Tensor, _train: bool| Ok(out.forward(x))
                })?;
                Chain::new().push("body", body)?.push("head", head)
            })?,
        ));
        measured.push((
            "Box<dyn Module>",
            as_one_process(&group, |seed, _| {
                Ok(Box::new(built(seed)?) as Box<dyn Module<TorchBackend> + Send>)
            })?,
        ));
        for (kind, (loss_diff, weight_diff)) in measured {
            println!(
                "measured: {kind}: losses within {loss_diff:e}, weights within {weight_diff:e}"
            );
            assert!(loss_diff < 1e-6, "{kind}: losses differ by {loss_diff}");
            assert!(
                weight_diff < 1e-6,
                "{kind}: weights differ by {weight_diff}"
            );
        }
        Collectives::barrier(group.as_ref())?;
        Ok(())
    }

    /// A CNN with batch norm: the weights stay identical across ranks, and the
    /// running statistics, which each rank updates from its own rows in its
    /// forward pass (as PyTorch's DDP without SyncBatchNorm), are rank 0's
    /// again before every forward pass (DDP's `broadcast_buffers`).
    #[test]
    fn batch_norm_buffers_follow_rank_zero() -> Result<()> {
        if !is_rank() {
            let results = wait_all(
                spawn_ranks("ddp::batch_norm_buffers_follow_rank_zero", 2, &[0, 1], &[]),
                Duration::from_secs(180),
            );
            assert_all_passed(&results);
            return Ok(());
        }
        let group = Arc::new(join(Duration::from_secs(60))?);
        let batches = data(true);
        let (losses, _, model) = train(
            &cnn(),
            3 + group.rank() as i64,
            Some(group.clone()),
            &batches,
        )?;
        assert!(losses.iter().all(|l| l.is_finite()));
        let flat = |entries: Vec<(String, Tensor)>| -> Vec<f64> {
            entries.iter().flat_map(|(_, t)| values(t)).collect()
        };
        let same_on_every_rank = |v: Vec<f64>| -> Result<bool> {
            let gathered = group.all_gather(&Tensor::from_slice(&v))?;
            Ok(values(&gathered.get(0)) == values(&gathered.get(1)))
        };
        assert!(same_on_every_rank(flat(model.named_parameters()?))?);
        let buffers = flat(model.named_buffers()?);
        let local_stats_differ = !same_on_every_rank(buffers)?;
        assert!(
            local_stats_differ,
            "each rank's last forward pass used its own rows"
        );
        // What DDP does before every training forward pass (`broadcast_buffers`).
        let mut model = data_parallel(model, group.clone(), &DistributedOptions::default())?;
        model.sync_buffers()?;
        assert!(same_on_every_rank(flat(model.named_buffers()?))?);
        Ok(())
    }
}

/// ZeRO-1 and ZeRO-2 against one process.
mod zero {
    use super::ddp::{data, fit_with, max_diff, mlp, weights};
    use super::*;
    use kiln_c10d::{data_parallel, zero_data_parallel, ZeroStage};
    use kiln_core::backend::{Backend, TrainBackend, Trainable};
    use kiln_core::distributed::Collectives;
    use kiln_core::optim::{
        AdamConfig, GradClip, Optimizer, OptimizerConfig, ParamGroup, ParamSelector, SgdConfig,
    };
    use kiln_core::state_dict::StateDict;
    use kiln_core::Device;
    use kiln_torch::{TorchBackend, TorchModel, TorchOptimizer};
    use std::sync::Arc;

    /// One training of [`stages_equal_one_process`]: its name, optimizer,
    /// parameter groups, clipping and frozen parameters.
    type Case<'a> = (
        &'a str,
        &'a OptimizerConfig,
        &'a [ParamGroup],
        &'a GradClip,
        &'a [&'a str],
    );

    fn model(seed: u64, freeze: &[&str]) -> Result<TorchModel> {
        TorchBackend::manual_seed(seed);
        let mut model = TorchModel::new(&mlp(), Device::Cpu)?;
        if !freeze.is_empty() {
            TorchBackend::freeze(&mut model, freeze, false)?;
        }
        Ok(model)
    }

    /// A rank that dies during ZeRO-2 training: the survivor's next step fails
    /// at once, naming it.
    #[test]
    fn a_dead_rank_fails_the_next_sharded_step_naming_it() -> Result<()> {
        if !is_rank() {
            let results = wait_all(
                spawn_ranks(
                    "zero::a_dead_rank_fails_the_next_sharded_step_naming_it",
                    2,
                    &[0, 1],
                    &[],
                ),
                Duration::from_secs(120),
            );
            // Rank 1 dies on purpose; rank 0's test passes by seeing the error.
            assert_eq!(results[1].0, Some(17), "{}", results[1].1);
            assert_eq!(results[0].0, Some(0), "rank 0:\n{}", results[0].1);
            return Ok(());
        }
        let group = Arc::new(join(Duration::from_secs(20))?);
        let (rank, world) = (group.rank() as i64, group.world_size() as i64);
        let batches = data(false);
        let adam = OptimizerConfig::Adam(AdamConfig::new(1e-2));
        let module = model(7, &[])?;
        let mut sharded = zero_data_parallel(
            module,
            group.clone(),
            ZeroStage::Two,
            &DistributedOptions::default(),
        )?;
        let mut opt = sharded.build_optimizer(&adam, &[])?;
        fit_with(
            &mut sharded,
            &mut opt,
            &GradClip::norm(1.0),
            Some((rank, world)),
            &batches[..2],
        )?;
        if rank == 1 {
            std::process::exit(17);
        }
        let start = Instant::now();
        let err = fit_with(
            &mut sharded,
            &mut opt,
            &GradClip::norm(1.0),
            Some((rank, world)),
            &batches[..2],
        )
        .err()
        .map(|e| e.to_string())
        .expect("a sharded step with a dead peer succeeded");
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

    /// Both stages with every layer's activations checkpointed train what one
    /// process does without, with the default windows and with windows of a
    /// few floats.
    #[test]
    fn stages_with_activation_checkpointing() -> Result<()> {
        if !is_rank() {
            let results = wait_all(
                spawn_ranks(
                    "zero::stages_with_activation_checkpointing",
                    2,
                    &[0, 1],
                    &[],
                ),
                Duration::from_secs(300),
            );
            assert_all_passed(&results);
            return Ok(());
        }
        let group = Arc::new(join(Duration::from_secs(60))?);
        let (rank, world) = (group.rank() as i64, group.world_size() as i64);
        let batches = data(false);
        let adam = OptimizerConfig::Adam(AdamConfig::new(1e-2));
        let clip = GradClip::norm(0.5);
        let mut single = model(7, &[])?;
        let mut single_opt = single.build_optimizer(&adam, &[])?;
        let single_losses = fit_with(&mut single, &mut single_opt, &clip, None, &batches)?;
        // Windows of 13 floats per rank: every parameter moves in several
        // reduce-scatters and all-gathers, most of them across two parameters.
        let tiny = DistributedOptions {
            bucket_cap_mb: 104.0 / (1024.0 * 1024.0),
            ..DistributedOptions::default()
        };
        for (stage, options) in [
            (ZeroStage::One, DistributedOptions::default()),
            (ZeroStage::Two, DistributedOptions::default()),
            (ZeroStage::One, tiny.clone()),
            (ZeroStage::Two, tiny),
        ] {
            let mut module = model(7 + rank as u64, &[])?;
            module.checkpoint_activations(&["*"])?;
            let mut sharded = zero_data_parallel(module, group.clone(), stage, &options)?;
            let mut opt = sharded.build_optimizer(&adam, &[])?;
            let losses = fit_with(&mut sharded, &mut opt, &clip, Some((rank, world)), &batches)?;
            let loss_diff = max_diff(&losses, &single_losses);
            let weight_diff = max_diff(&weights(&sharded)?, &weights(&single)?);
            assert!(
                loss_diff < 1e-6,
                "{}: losses differ by {loss_diff}",
                stage.name()
            );
            assert!(
                weight_diff < 1e-6,
                "{}: weights differ by {weight_diff}",
                stage.name()
            );
        }
        let mut module = model(7 + rank as u64, &[])?;
        module.checkpoint_activations(&["*"])?;
        let mut ddp = data_parallel(module, group.clone(), &DistributedOptions::default())?;
        let mut opt = ddp.build_optimizer(&adam, &[])?;
        let losses = fit_with(&mut ddp, &mut opt, &clip, Some((rank, world)), &batches)?;
        assert!(max_diff(&losses, &single_losses) < 1e-6, "DDP: losses");
        assert!(
            max_diff(&weights(&ddp)?, &weights(&single)?) < 1e-6,
            "DDP: weights"
        );
        Collectives::barrier(group.as_ref())?;
        Ok(())
    }

    /// The largest difference between two optimizer states with the same keys.
    fn state_diff(a: &StateDict, b: &StateDict) -> f64 {
        let keys = |s: &StateDict| s.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
        assert_eq!(keys(a), keys(b), "the states' entries differ");
        a.iter()
            .map(|(k, x)| {
                let y = b.get(k).expect("the same keys");
                max_diff(&x.to_f64_vec(), &y.to_f64_vec())
            })
            .fold(0.0, f64::max)
    }

    /// Each stage, two ranks of `B` rows against one process of `2B`: Adam
    /// with clipping by the 2-norm, SGD with momentum, two parameter groups
    /// and clipping by the infinity norm, a frozen first layer; gradient
    /// accumulation throughout. Losses and weights agree within 1e-6, the
    /// ranks' weights bit for bit; each rank's optimizer holds only its share
    /// of the state, and the gathered state is one process's, which loads back
    /// into either.
    #[test]
    fn stages_equal_one_process() -> Result<()> {
        stages_on_ranks("zero::stages_equal_one_process", 2)
    }

    /// As [`stages_equal_one_process`], on four ranks of `B / 2`.
    #[test]
    fn stages_on_four_ranks_equal_one_process() -> Result<()> {
        stages_on_ranks("zero::stages_on_four_ranks_equal_one_process", 4)
    }

    /// On the driver, runs `test` as `world` ranks; on a rank, its part.
    #[allow(clippy::unwrap_used)] // the body of the tests above: a failure should be loud
    fn stages_on_ranks(test: &str, world: usize) -> Result<()> {
        if !is_rank() {
            let ranks: Vec<usize> = (0..world).collect();
            let results = wait_all(
                spawn_ranks(test, world, &ranks, &[]),
                Duration::from_secs(300),
            );
            assert_all_passed(&results);
            let (_, rank0) = &results[0];
            rank0
                .lines()
                .filter(|l| l.starts_with("measured:"))
                .for_each(|l| println!("{l}"));
            return Ok(());
        }
        let group = Arc::new(join(Duration::from_secs(60))?);
        let (rank, world) = (group.rank() as i64, group.world_size() as i64);
        let batches = data(false);
        let adam = OptimizerConfig::Adam(AdamConfig::new(1e-2));
        let mut sgd = SgdConfig::new(0.05);
        sgd.momentum = 0.9;
        let sgd = OptimizerConfig::Sgd(sgd);
        let two_groups =
            [ParamGroup::new("biases", ParamSelector::Suffix("bias".into())).with_lr(0.01)];
        let norm2 = GradClip::norm(0.5);
        let inf = GradClip::Norm {
            max_norm: 0.05,
            norm_type: f64::INFINITY,
        };
        let cases: [Case<'_>; 3] = [
            ("adam", &adam, &[], &norm2, &[]),
            ("sgd, groups, inf-norm", &sgd, &two_groups, &inf, &[]),
            ("adam, frozen", &adam, &[], &norm2, &["0.*"]),
        ];
        for stage in [ZeroStage::One, ZeroStage::Two] {
            for (name, config, groups, clip, freeze) in cases {
                let what = format!("{}, {name}", stage.name());
                let mut single = model(7, freeze)?;
                let mut single_opt = single.build_optimizer(config, groups)?;
                let single_losses = fit_with(&mut single, &mut single_opt, clip, None, &batches)?;

                // Rank 1 starts from other weights: the strategy makes them rank 0's.
                let module = model(7 + rank as u64, freeze)?;
                let mut sharded = zero_data_parallel(
                    module,
                    group.clone(),
                    stage,
                    &DistributedOptions::default(),
                )?;
                let mut opt = sharded.build_optimizer(config, groups)?;
                let losses = fit_with(&mut sharded, &mut opt, clip, Some((rank, world)), &batches)?;
                let ours = weights(&sharded)?;
                let loss_diff = max_diff(&losses, &single_losses);
                let weight_diff = max_diff(&ours, &weights(&single)?);
                println!(
                    "measured: {what}: losses within {loss_diff:e}, weights within {weight_diff:e}"
                );
                assert!(loss_diff < 1e-6, "{what}: losses differ by {loss_diff}");
                assert!(
                    weight_diff < 1e-6,
                    "{what}: weights differ by {weight_diff}"
                );
                let gathered = group.all_gather(&Tensor::from_slice(&ours))?;
                assert_eq!(
                    values(&gathered.get(0)),
                    values(&gathered.get(1)),
                    "{what}: the ranks' weights differ"
                );

                // This rank's optimizer: its share only.
                let owned = sharded.strategy().shards().owned_names();
                let share = opt.shard().state_dict()?;
                for (key, _) in share.iter() {
                    if let Some(rest) = key.strip_prefix("state.") {
                        let param = rest.rsplit_once('.').unwrap().0;
                        assert!(owned.contains(param), "{what}: rank {rank} holds {key}");
                    }
                }
                assert!(
                    share.len() < single_opt.state_dict()?.len(),
                    "{what}: rank {rank}'s state is not a share"
                );
                // The gathered state is one process's, and loads both ways.
                let whole = opt.state_dict()?;
                let diff = state_diff(&whole, &single_opt.state_dict()?);
                assert!(diff < 1e-6, "{what}: gathered state differs by {diff}");
                let mut fresh: TorchOptimizer =
                    model(7, freeze)?.build_optimizer(config, groups)?;
                fresh.load_state_dict(&whole)?;
                assert_eq!(fresh.state_dict()?, whole, "{what}: into one process");
                opt.load_state_dict(&single_opt.state_dict()?)?;
                assert_eq!(
                    state_diff(&opt.state_dict()?, &single_opt.state_dict()?),
                    0.0,
                    "{what}: from one process"
                );
            }
        }
        // Loss scaling is refused, naming the stage and the way out.
        let mut module = model(7, &[])?;
        module.set_precision(kiln_core::precision::FloatPrecision::F16Mixed)?;
        let sharded = zero_data_parallel(
            module,
            group.clone(),
            ZeroStage::Two,
            &DistributedOptions::default(),
        )?;
        let err = sharded.build_optimizer(&adam, &[]).unwrap_err().to_string();
        assert!(
            err.contains("ZeRO-2") && err.contains("bf16-mixed"),
            "{err}"
        );
        Collectives::barrier(group.as_ref())?;
        Ok(())
    }
}

/// NCCL on a GPU: one rank per device; with one GPU, world size 1, the
/// CUDA-tensor collectives and a DDP step. Skips without the `cuda` feature or a
/// CUDA device.
#[test]
fn nccl_collectives_on_cuda_tensors() -> Result<()> {
    use kiln_core::backend::{Backend, StepPlan, Trainable};
    use kiln_core::distributed::CommBackend;
    use kiln_core::loss::Loss;
    use kiln_core::model::{Layer, LinearConfig};
    use kiln_core::optim::{Optimizer, OptimizerConfig, SgdConfig};
    use kiln_core::Device;
    use kiln_torch::{TorchBackend, TorchModel};
    use std::sync::Arc;

    if !cfg!(feature = "cuda") {
        kiln_testkit::skip_without_gpu(
            "nccl_collectives_on_cuda_tensors",
            "kiln-c10d was built without its `cuda` feature \
             (cargo test -p kiln-c10d --features cuda --test distributed)",
        );
        return Ok(());
    }
    if !kiln_torch::cuda_is_available() {
        kiln_testkit::skip_without_gpu("nccl_collectives_on_cuda_tensors", "no CUDA device");
        return Ok(());
    }
    let dir = kiln_testkit::TempDir::new("nccl");
    let rendezvous = Rendezvous::with_file_store(0, 1, dir.path().join("store"))?;
    let options = DistributedOptions {
        backend: CommBackend::Nccl,
        timeout: Duration::from_secs(60),
        ..DistributedOptions::default()
    };
    let group = Arc::new(ProcessGroup::join(&rendezvous, &options)?);
    assert!(group.has_nccl());
    let cuda = tch::Device::Cuda(0);
    let t = Tensor::from_slice(&[1.0f32, 2.0]).to_device(cuda);
    group.all_reduce(&t, ReduceOp::Sum)?;
    group.broadcast(&t, 0)?;
    assert_eq!(values(&t), vec![1.0, 2.0]);
    assert_eq!(group.all_gather(&t)?.size(), vec![1, 2]);

    let spec = Layer::sequential([LinearConfig::new(4, 3).into()]);
    TorchBackend::manual_seed(1);
    let model = TorchModel::new(&spec, Device::Cuda(0))?;
    let mut model = data_parallel(model, group.clone(), &options)?;
    let mut opt = model.build_optimizer(&OptimizerConfig::Sgd(SgdConfig::new(0.1)), &[])?;
    let loss = Loss::cross_entropy();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let x = Tensor::randn([8, 4], (tch::Kind::Float, cuda));
    let y = Tensor::randint(3, [8], (tch::Kind::Int64, cuda));
    opt.zero_grad()?;
    let value = model.train_step(&mut opt, &x, &y, &plan)?;
    assert!(value.is_finite());
    Ok(())
}
