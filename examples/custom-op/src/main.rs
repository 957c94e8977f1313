//! Trains an MLP whose activation is the custom op (squared ReLU) on the UCI
//! handwritten digits, with Kiln's data loader, on libtorch (the default) or on
//! TensorFlow:
//!
//! ```sh
//! cargo xtask run --release -p kiln-example-custom-op
//! cargo xtask run --release -p kiln-example-custom-op -- --backend tensorflow
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use kiln_core::{
    load_digits, train_test_split, AdamConfig, Backend, DataLoader, Device, HostTensor,
    InMemoryDataset, Loss, Module, Optimizer, OptimizerConfig, SequentialLoader,
};
use kiln_example_custom_op::squared_relu;
use kiln_torch::{compute_loss, to_tch, TchModule, TorchBackend, TorchOptimizer};
use tch::nn;

const EPOCHS: u64 = 30;
const BATCH_SIZE: usize = 64;
const LEARNING_RATE: f32 = 1e-3;

/// Features `[N, 64]` (float32 in `[0, 1]`) and labels `[N]` (int64).
type Split = (HostTensor, HostTensor);

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] | ["--backend", "torch"] => "torch",
        ["--backend", "tensorflow"] => "tensorflow",
        _ => bail!("usage: kiln-example-custom-op [--backend torch|tensorflow]"),
    };

    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.kiln/data/digits.csv.gz");
    let (pixels, labels) = load_digits(&data)
        .context("the digits come with the project virtualenv: run `cargo xtask setup`")?;
    let pixels = pixels.to_dtype(kiln_core::DType::F32);
    let scaled: Vec<f32> = pixels.as_slice::<f32>()?.iter().map(|v| v / 16.0).collect();
    let pixels = HostTensor::new(scaled, pixels.shape().clone())?;
    let (train, test) = train_test_split(&pixels, &labels, 0.2, 0)?;

    let accuracy = match backend {
        "torch" => train_torch(train, &test)?,
        _ => train_tensorflow(train, &test)?,
    };
    println!(
        "held-out accuracy with the squared-ReLU op ({backend}): {:.2}%",
        100.0 * accuracy
    );
    Ok(())
}

/// A model written in tch, with the custom op as its activation, trained with
/// Kiln's Adam. Returns the held-out accuracy.
fn train_torch((train_x, train_y): Split, (test_x, test_y): &Split) -> Result<f64> {
    TorchBackend::manual_seed(0);
    let model = TchModule::new(Device::Cpu, |p| {
        let hidden = nn::linear(p / "0", 64, 128, Default::default());
        let out = nn::linear(p / "2", 128, 10, Default::default());
        move |x: &tch::Tensor, _train: bool| {
            let h =
                squared_relu(&x.apply(&hidden)).map_err(|e| tch::TchError::Kind(e.to_string()))?;
            Ok(h.apply(&out))
        }
    })?;
    let mut optimizer = TorchOptimizer::new(
        OptimizerConfig::Adam(AdamConfig::new(f64::from(LEARNING_RATE))),
        model.named_parameters(),
        &[],
    )?;
    let loader =
        SequentialLoader::new(InMemoryDataset::new(train_x, train_y)?, BATCH_SIZE)?.shuffle(0);
    let loss_fn = Loss::cross_entropy();
    for epoch in 0..EPOCHS {
        let (mut total, mut seen) = (0.0, 0usize);
        for batch in loader.batches(epoch) {
            let batch = batch?;
            let x = to_tch(&batch.inputs, Device::Cpu)?;
            let y = to_tch(&batch.targets, Device::Cpu)?;
            optimizer.zero_grad()?;
            let loss = compute_loss(&loss_fn, &model.forward(&x)?, &y)?;
            TorchBackend::backward(&loss)?;
            optimizer.step()?;
            total += loss.double_value(&[]) * batch.targets.dims()[0] as f64;
            seen += batch.targets.dims()[0];
        }
        if epoch % 10 == 9 {
            println!("epoch {epoch}: training loss {:.4}", total / seen as f64);
        }
    }
    let logits = tch::no_grad(|| model.forward(&to_tch(test_x, Device::Cpu)?))?;
    let predicted = logits.argmax(-1, false);
    let correct = predicted
        .eq_tensor(&to_tch(test_y, Device::Cpu)?)
        .sum(tch::Kind::Int64)
        .int64_value(&[]);
    Ok(correct as f64 / test_y.dims()[0] as f64)
}

/// The same MLP as a TensorFlow graph built with the `tensorflow` crate: variables,
/// the custom op, the loss, its gradients from `Graph::add_gradients` (which calls
/// the op's C++ gradient), and an Adam update per parameter, all run by one session
/// call per step. Returns the held-out accuracy.
fn train_tensorflow((train_x, train_y): Split, (test_x, test_y): &Split) -> Result<f64> {
    use tensorflow::{ops, DataType, Output, Scope, Session, SessionOptions, SessionRunArgs};

    let mut scope = Scope::new_root_scope();
    let s = &mut scope;
    let x = ops::Placeholder::new()
        .dtype(DataType::Float)
        .shape([-1i64, 64])
        .build(&mut s.with_op_name("x"))?;
    let labels = ops::Placeholder::new()
        .dtype(DataType::Int64)
        .shape([-1i64])
        .build(&mut s.with_op_name("labels"))?;

    // The model: logits = squared_relu(x w1 + b1) w2 + b2.
    let shapes: [&[u64]; 4] = [&[64, 128], &[128], &[128, 10], &[10]];
    let params = [
        weight(s, shapes[0], 1)?,
        zeros(s, shapes[1])?,
        weight(s, shapes[2], 2)?,
        zeros(s, shapes[3])?,
    ];
    let [w1, b1, w2, b2] = &params;
    let hidden = ops::bias_add(
        ops::mat_mul(x.clone(), w1.output().clone(), s)?,
        b1.output().clone(),
        s,
    )?;
    let activation = kiln_example_custom_op::tf::squared_relu(&mut s.graph_mut(), hidden.into())?;
    let logits = ops::bias_add(
        ops::mat_mul(activation, w2.output().clone(), s)?,
        b2.output().clone(),
        s,
    )?;
    // SoftmaxCrossEntropyWithLogits, not the Sparse one: only the dense one has a
    // gradient in TensorFlow's C++ registry, which `add_gradients` uses.
    let one_hot = ops::OneHot::new().build(
        labels.clone(),
        ops::constant(10i32, s)?,
        ops::constant(1f32, s)?,
        ops::constant(0f32, s)?,
        s,
    )?;
    let per_example =
        ops::SoftmaxCrossEntropyWithLogits::new().build(logits.clone(), one_hot, s)?;
    let loss = ops::mean(per_example, ops::constant(0i32, s)?, s)?;
    let predicted = ops::arg_max(logits, ops::constant(1i32, s)?, s)?;

    // d loss / d parameter, through the custom op's registered gradient.
    let outputs: Vec<Output> = params.iter().map(|p| p.output().clone()).collect();
    let grads = s
        .graph_mut()
        .add_gradients(None, &[loss.clone().into()], &outputs, None)?;
    let grads: Vec<Output> = grads
        .into_iter()
        .map(|g| g.context("every parameter has a gradient"))
        .collect::<Result<_>>()?;

    // Adam: one ApplyAdam per parameter, with its two moment variables. Each waits
    // for every gradient, so no update overwrites a weight another gradient still
    // reads. The bias corrections beta^t are fed per step.
    let (beta1, beta2) = (0.9f32, 0.999f32);
    let beta1_power = ops::Placeholder::new().dtype(DataType::Float).build(s)?;
    let beta2_power = ops::Placeholder::new().dtype(DataType::Float).build(s)?;
    let (lr, b1c, b2c, eps) = (
        ops::constant(LEARNING_RATE, s)?,
        ops::constant(beta1, s)?,
        ops::constant(beta2, s)?,
        ops::constant(1e-8f32, s)?,
    );
    let mut initializers: Vec<_> = params.iter().map(|p| p.initializer().clone()).collect();
    let mut updates = Vec::new();
    for ((param, grad), dims) in params.iter().zip(&grads).zip(shapes) {
        let (m, v) = (zeros(s, dims)?, zeros(s, dims)?);
        initializers.extend([m.initializer().clone(), v.initializer().clone()]);
        let mut adam = ops::ApplyAdam::new();
        for g in &grads {
            adam = adam.add_control_input(g.operation.clone());
        }
        updates.push(adam.build(
            param.output().clone(),
            m.output().clone(),
            v.output().clone(),
            beta1_power.clone(),
            beta2_power.clone(),
            lr.clone(),
            b1c.clone(),
            b2c.clone(),
            eps.clone(),
            grad.clone(),
            s,
        )?);
    }

    let session = Session::new(&SessionOptions::new(), &scope.graph())?;
    let mut init = SessionRunArgs::new();
    for op in &initializers {
        init.add_target(op);
    }
    session.run(&mut init)?;

    let loader =
        SequentialLoader::new(InMemoryDataset::new(train_x, train_y)?, BATCH_SIZE)?.shuffle(0);
    let mut step = 0;
    for epoch in 0..EPOCHS {
        let (mut total, mut seen) = (0.0, 0usize);
        for batch in loader.batches(epoch) {
            let batch = batch?;
            step += 1;
            let xs = kiln_tf::to_tf::<f32>(&batch.inputs)?;
            let ys = kiln_tf::to_tf::<i64>(&batch.targets)?;
            let powers = [beta1.powi(step), beta2.powi(step)].map(tensorflow::Tensor::from);
            let mut args = SessionRunArgs::new();
            args.add_feed(&x, 0, &xs);
            args.add_feed(&labels, 0, &ys);
            args.add_feed(&beta1_power, 0, &powers[0]);
            args.add_feed(&beta2_power, 0, &powers[1]);
            for update in &updates {
                args.add_target(update);
            }
            let loss_token = args.request_fetch(&loss, 0);
            session.run(&mut args)?;
            let n = batch.targets.dims()[0];
            total += f64::from(args.fetch::<f32>(loss_token)?[0]) * n as f64;
            seen += n;
        }
        if epoch % 10 == 9 {
            println!("epoch {epoch}: training loss {:.4}", total / seen as f64);
        }
    }

    let xs = kiln_tf::to_tf::<f32>(test_x)?;
    let mut args = SessionRunArgs::new();
    args.add_feed(&x, 0, &xs);
    let token = args.request_fetch(&predicted, 0);
    session.run(&mut args)?;
    let predicted = args.fetch::<i64>(token)?;
    let correct = predicted
        .iter()
        .zip(test_y.as_slice::<i64>()?)
        .filter(|(p, y)| p == y)
        .count();
    Ok(correct as f64 / test_y.dims()[0] as f64)
}

/// A float variable of `dims` (`[fan_in, fan_out]`) initialised from
/// N(0, 1/fan_in) (LeCun normal), with a fixed seed.
fn weight(scope: &mut tensorflow::Scope, dims: &[u64], seed: i64) -> Result<tensorflow::Variable> {
    use tensorflow::ops;
    let shape: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
    let normal = ops::RandomStandardNormal::new()
        .dtype(tensorflow::DataType::Float)
        .seed(0)
        .seed2(seed)
        .build(ops::constant(&shape[..], scope)?, scope)?;
    let std = ops::constant(1.0 / (dims[0] as f32).sqrt(), scope)?;
    Ok(tensorflow::Variable::builder()
        .initial_value(ops::mul(normal, std, scope)?)
        .data_type(tensorflow::DataType::Float)
        .shape(dims)
        .build(scope)?)
}

/// A float variable of `dims` initialised to zeros.
fn zeros(scope: &mut tensorflow::Scope, dims: &[u64]) -> Result<tensorflow::Variable> {
    Ok(tensorflow::Variable::builder()
        .const_initial_value(tensorflow::Tensor::<f32>::new(dims))
        .build(scope)?)
}
