//! The one strategy wrapper answers every method of `Module` and `Trainable`
//! under every libtorch strategy (DDP, ZeRO-1/2, FSDP, post-local SGD) as the
//! model alone does.

use super::*;

/// Asserts that `wrapped` (trained under `strategy` over `world` ranks, built
/// from another seed on the other ranks) answers every method of `Module`
/// and `Trainable` as `bare`, the same model alone on one process, does:
/// the wrapper is written once for every strategy, and this is what keeps a
/// strategy from drifting. Every rank trains on the same batch, so one step's
/// mean gradient is the single process's.
fn answers_as_alone<M: Trainable<TorchBackend>>(
    strategy: &str,
    wrapped: &mut M,
    bare: &mut TorchModel,
    world: usize,
) -> Result<()> {
    use kiln_core::backend::UpdatePlan;
    use kiln_core::objective::{ObjectiveBatch, Supervised};
    let kind = wrapped.kind();
    assert!(
        kind.starts_with(strategy) && kind.contains(&bare.kind()),
        "{strategy}: {kind}"
    );
    let names = |v: Vec<(String, Tensor)>| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
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
    assert_eq!(wrapped.graph_def()?, bare.graph_def()?, "{strategy}");
    assert_eq!(
        wrapped.num_parameters()?,
        bare.num_parameters()?,
        "{strategy}"
    );
    assert_eq!(
        wrapped.num_trainable_parameters()?,
        bare.num_trainable_parameters()?,
        "{strategy}"
    );
    assert_eq!(
        wrapped.frozen_parameters()?,
        bare.frozen_parameters()?,
        "{strategy}"
    );
    assert_eq!(wrapped.frozen_parameters()?, ["0.weight", "0.bias"]);
    assert_eq!(wrapped.precision(), bare.precision(), "{strategy}");
    assert_eq!(wrapped.runs_any_objective(), bare.runs_any_objective());
    assert_eq!(
        wrapped.shards_parameters(),
        strategy == "FSDP",
        "{strategy}"
    );
    assert_eq!(
        wrapped.shard_state_tensors()?.is_some(),
        strategy == "FSDP",
        "{strategy}"
    );
    let ranks = wrapped.collectives().map(|c| c.world_size());
    assert_eq!(ranks, Some(world), "{strategy}");
    assert_eq!(bare.collectives().map(|c| c.world_size()), None);
    assert_eq!(state_diff(&wrapped.state_dict()?, &bare.state_dict()?), 0.0);
    let tensors = wrapped.state_tensors()?.to_state_dict()?;
    assert_eq!(state_diff(&tensors, &bare.state_dict()?), 0.0, "{strategy}");

    let (x, y) = &data(Inputs::Images)[0];
    let loss = Loss::cross_entropy();
    let close = |a: &Tensor, b: &Tensor| {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d < 1e-6, "{strategy}: outputs differ by {d}");
    };
    for mode in [
        kiln_core::backend::Mode::Eval,
        kiln_core::backend::Mode::Train,
    ] {
        wrapped.set_mode(mode);
        bare.set_mode(mode);
        assert_eq!(wrapped.mode(), mode);
        wrapped.sync_buffers()?;
        close(&wrapped.forward(x)?, &bare.forward(x)?);
        let many = wrapped.forward_many(std::slice::from_ref(x))?;
        close(&many[0], &bare.forward_many(std::slice::from_ref(x))?[0]);
    }
    wrapped.eval();
    bare.eval();
    let (a, out_a) = wrapped.eval_step(&loss, x, y)?;
    let (b, out_b) = bare.eval_step(&loss, x, y)?;
    assert!(
        (a - b).abs() < 1e-6 && out_a == out_b,
        "{strategy}: eval_step"
    );
    assert_eq!(
        wrapped.predict_step(x)?,
        bare.predict_step(x)?,
        "{strategy}"
    );
    let supervised = Supervised::new(loss.clone());
    let batch = ObjectiveBatch {
        inputs: x,
        targets: y,
    };
    let a = wrapped.eval_objective(&supervised, &batch)?;
    let b = bare.eval_objective(&supervised, &batch)?;
    assert!((a.loss - b.loss).abs() < 1e-6, "{strategy}: eval_objective");

    // The three steps, each one SGD update of the same batch.
    wrapped.train();
    bare.train();
    wrapped.start_at_step(0)?;
    bare.start_at_step(0)?;
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
                wrapped.train_step(&mut wrapped_opt, x, y, &plan)?,
                bare.train_step(&mut bare_opt, x, y, &plan)?,
            ),
            "train_step_deferred" => (
                wrapped
                    .train_step_deferred(&mut wrapped_opt, x, y, &plan)?
                    .value::<TorchBackend>()?,
                bare.train_step_deferred(&mut bare_opt, x, y, &plan)?
                    .value::<TorchBackend>()?,
            ),
            _ => (
                wrapped
                    .train_objective_step(&mut wrapped_opt, &supervised, &batch, &update, false)?
                    .loss
                    .value::<TorchBackend>()?,
                bare.train_objective_step(&mut bare_opt, &supervised, &batch, &update, false)?
                    .loss
                    .value::<TorchBackend>()?,
            ),
        };
        assert!(
            (a - b).abs() < 1e-6,
            "{strategy} {step}: loss {a} against {b}"
        );
        let diff = state_diff(&wrapped.state_dict()?, &bare.state_dict()?);
        assert!(diff < 1e-6, "{strategy} {step}: weights differ by {diff}");
    }

    // A whole state loads as it loads alone.
    let fresh = cnn_frozen(3)?.state_dict()?;
    wrapped.load_state_dict(&fresh)?;
    bare.load_state_dict(&fresh)?;
    assert_eq!(
        state_diff(&wrapped.state_dict()?, &fresh),
        0.0,
        "{strategy}"
    );
    Ok(())
}

/// The CNN with its convolution frozen, from `seed`.
fn cnn_frozen(seed: u64) -> Result<TorchModel> {
    TorchBackend::manual_seed(seed);
    let mut model = TorchModel::new(&cnn(), Device::Cpu)?;
    kiln_torch::Freeze::freeze(&mut model, &["0.*"])?;
    Ok(model)
}

/// DDP, ZeRO-1, ZeRO-2, FSDP and post-local SGD, each through the one strategy wrapper,
/// answer every method of `Module` and `Trainable` as the model alone does.
#[test]
fn every_strategy_answers_every_wrapper_method() -> Result<()> {
    if driven(
        "wrapper_methods::every_strategy_answers_every_wrapper_method",
        2,
    ) {
        return Ok(());
    }
    let group = join()?;
    let (rank, world) = (group.rank() as u64, group.world_size());
    let options = DistributedOptions::default();
    let mut ddp = data_parallel(cnn_frozen(7 + rank)?, group.clone(), &options)?;
    answers_as_alone("DataParallel", &mut ddp, &mut cnn_frozen(7)?, world)?;
    for stage in [kiln_c10d::ZeroStage::One, kiln_c10d::ZeroStage::Two] {
        let mut zero =
            kiln_c10d::zero_data_parallel(cnn_frozen(7 + rank)?, group.clone(), stage, &options)?;
        answers_as_alone(stage.name(), &mut zero, &mut cnn_frozen(7)?, world)?;
    }
    let shard = FullShardOptions {
        units: vec!["5".into()],
        ..FullShardOptions::default()
    };
    let mut sharded = fully_shard(cnn_frozen(7 + rank)?, group.clone(), &shard, &options)?;
    answers_as_alone("FSDP", &mut sharded, &mut cnn_frozen(7)?, world)?;
    // Warm-up 1, period 2: the three steps are synchronised, local then
    // averaged, and local alone; each rank's batch is the same, so each
    // answers as the model alone.
    let local = kiln_c10d::PostLocalSgdOptions {
        warmup_steps: 1,
        period: 2,
    };
    let mut post =
        kiln_c10d::post_local_sgd(cnn_frozen(7 + rank)?, group.clone(), &local, &options)?;
    answers_as_alone("PostLocalSGD", &mut post, &mut cnn_frozen(7)?, world)?;
    assert_eq!(
        post.strategy().step(),
        3,
        "post-local SGD counts the optimizer steps"
    );
    Collectives::barrier(group.as_ref())?;
    Ok(())
}
