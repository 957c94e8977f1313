//! Workers: one variant of one workload, timed in this process (the harness
//! starts one process per variant, so each has its own peak RSS).

use super::*;
use kiln::train::{EmaConfig, WeightAveraging};

pub(crate) struct WorkerArgs {
    variant: String,
    workload: Workload,
    data: PathBuf,
    steps: usize,
    warmup: usize,
    repeats: usize,
    threads: usize,
    device: Device,
}

/// `VARIANT --key value ...` as the variant and a map of keys to values.
pub(crate) fn parse_flags(args: &[String]) -> Result<(String, BTreeMap<String, String>)> {
    let variant = args.first().context("--worker needs a variant")?.clone();
    let mut flags = BTreeMap::new();
    for pair in args[1..].chunks(2) {
        let [k, v] = pair else {
            bail!("flag {} needs a value", pair[0])
        };
        flags.insert(k.trim_start_matches("--").to_owned(), v.clone());
    }
    Ok((variant, flags))
}

pub(crate) fn parse_worker(args: &[String]) -> Result<WorkerArgs> {
    let (variant, flags) = parse_flags(args)?;
    let get = |k: &str| flags.get(k).with_context(|| format!("--{k} is required"));
    Ok(WorkerArgs {
        variant,
        workload: Workload::parse(get("workload")?)?,
        data: PathBuf::from(get("data")?),
        steps: get("steps")?.parse()?,
        warmup: get("warmup")?.parse()?,
        repeats: get("repeats")?.parse()?,
        threads: get("threads")?.parse()?,
        device: device_flag(&flags)?,
    })
}

/// Kiln's variants keep freed host memory for reuse, as `Trainer::fit` does
/// (`--host-memory retain`, the default), or leave glibc's default
/// (`--host-memory release`, for the before/after in BENCHMARKS.md).
pub(crate) fn apply_host_memory(args: &[String]) -> Result<()> {
    let (variant, flags) = parse_flags(args)?;
    let retain = match flags.get("host-memory").map(String::as_str) {
        None | Some("retain") => true,
        Some("release") => false,
        Some(other) => bail!("--host-memory {other}: expected retain or release"),
    };
    if retain && variant.starts_with("kiln-") {
        kiln::core::host_memory::retain_freed_memory();
    }
    Ok(())
}

/// The `--device` of a worker's flags; the CPU when absent.
pub(crate) fn device_flag(flags: &BTreeMap<String, String>) -> Result<Device> {
    Ok(flags.get("device").map_or(Ok(Device::Cpu), |d| d.parse())?)
}

/// The data directory's batches as host tensors.
pub(crate) fn read_batches(
    dir: &Path,
    workload: Workload,
) -> Result<Vec<(HostTensor, HostTensor)>> {
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json"))?)?;
    let batches = meta["num_batches"]
        .as_u64()
        .context("meta.json: num_batches")? as usize;
    let x_bytes = std::fs::read(dir.join("x.f32"))?;
    let y_bytes = std::fs::read(dir.join("y.i64"))?;
    let x: Vec<f32> = x_bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let y: Vec<i64> = y_bytes
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
        .collect();
    let batch = workload.batch();
    let per_sample: usize = workload.input_shape().iter().product();
    ensure!(
        x.len() == batches * batch * per_sample,
        "x.f32 has {} values",
        x.len()
    );
    let mut dims = vec![batch];
    dims.extend(workload.input_shape());
    (0..batches)
        .map(|i| {
            let xs = x[i * batch * per_sample..(i + 1) * batch * per_sample].to_vec();
            let ys = y[i * batch..(i + 1) * batch].to_vec();
            Ok((
                HostTensor::new(xs, dims.clone())?,
                HostTensor::new(ys, [batch])?,
            ))
        })
        .collect()
}

/// The process's peak resident set, in MiB (`VmHWM`).
pub(crate) fn peak_rss_mb() -> f64 {
    status_mb("VmHWM:")
}

/// This process's resident set size now, in MiB.
pub(crate) fn rss_mb() -> f64 {
    status_mb("VmRSS:")
}

/// A `kB` line of `/proc/self/status`, in MiB.
fn status_mb(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `warmup` untimed runs of `f`, then the seconds of each of `repeats` timed runs.
pub(crate) fn timed(
    warmup: usize,
    repeats: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f()?;
            Ok(start.elapsed().as_secs_f64())
        })
        .collect()
}

/// `a.warmup` steps, then `a.repeats` timed runs of `a.steps` steps; `step(i)`
/// runs step `i` (counted from the first warm-up step) and returns its loss.
pub(crate) fn time_steps(
    a: &WorkerArgs,
    mut step: impl FnMut(usize) -> Result<f64>,
) -> Result<(Vec<f64>, f64)> {
    let (mut next, mut loss) = (0, f64::NAN);
    let mut run = |n: usize| -> Result<()> {
        for _ in 0..n {
            loss = step(next)?;
            next += 1;
        }
        Ok(())
    };
    run(a.warmup)?;
    let times = timed(0, a.repeats, || run(a.steps))?;
    Ok((times, loss))
}

pub(crate) fn worker(args: &[String]) -> Result<()> {
    apply_host_memory(args)?;
    if let Some(i) = args.iter().position(|a| a == "--task") {
        let task = args
            .get(i + 1)
            .and_then(|name| Task::parse(name))
            .context("--task needs data, script, ops, checkpoint or ddp")?;
        let (variant, flags) = parse_flags(args)?;
        if task == Task::Ddp || task == Task::Zero {
            // One rank of two; rank 0 prints the result.
            let result = if task == Task::Ddp {
                ddp::rank(&variant, &flags)?
            } else {
                crate::zero::rank(&variant, &flags)?
            };
            if let Some(result) = result {
                println!("{result}");
            }
            return Ok(());
        }
        let result = tasks::worker(task, &variant, &TaskArgs::parse(&flags)?)?;
        println!("{result}");
        return Ok(());
    }
    let a = parse_worker(args)?;
    ensure!(
        a.workload.runs(&a.variant),
        "{} has no {} variant",
        a.workload.name(),
        a.variant
    );
    let dtype = a.workload.dtype();
    let host: Vec<(HostTensor, HostTensor)> = read_batches(&a.data, a.workload)?
        .into_iter()
        .map(|(x, y)| (x.to_dtype(dtype), y))
        .collect();
    let (times, loss) = match a.variant.as_str() {
        "kiln-torch" | "kiln-torch-ema" | "kiln-torch-views" | "kiln-torch-profile" => {
            tch::set_num_threads(a.threads as i32);
            let precision = a.workload.precision();
            // The same step with an exponential moving average of the weights
            // updated after it (`[training] ema`, decay 0.999, every step), or
            // with the TensorBoard views read after it (`[logging] grad_norms`
            // and `lr_per_group` with `log_every = 1`), or recorded by the profiler
            // (`--profile`, every step in the window).
            let extra = match a.variant.as_str() {
                "kiln-torch-ema" => AfterStep::Ema(EmaConfig::new(0.999)),
                "kiln-torch-views" => AfterStep::Views,
                "kiln-torch-profile" => AfterStep::Profile,
                _ => AfterStep::Nothing,
            };
            kiln_step::<TorchBackend>(&a, &host, extra, |m| match precision {
                FloatPrecision::F32 => m.to_dtype(dtype),
                mixed => m.set_precision(mixed),
            })?
        }
        #[cfg(feature = "cuda")]
        "kiln-torch-graph" => graphed_step(&a, &host)?,
        #[cfg(feature = "tf")]
        "kiln-tf" | "kiln-tf-profile" => {
            // As the Python worker's `tf.config.threading`.
            kiln::tf::set_thread_counts(a.threads, a.threads)?;
            let extra = if a.variant == "kiln-tf-profile" {
                AfterStep::Profile
            } else {
                AfterStep::Nothing
            };
            kiln_step::<TfBackend>(&a, &host, extra, |_| Ok(()))?
        }
        "raw-tch" => {
            tch::set_num_threads(a.threads as i32);
            raw_tch::run(&a, &host)?
        }
        other => bail!("unknown worker variant {other}"),
    };
    let m = median(times.clone());
    let batch = a.workload.batch();
    let result = json!({
        "variant": a.variant,
        "workload": a.workload.name(),
        "batch": batch,
        "steps": a.steps,
        "repeats_s": times,
        "median_s": m,
        "steps_per_s": a.steps as f64 / m,
        "samples_per_s": (a.steps * batch) as f64 / m,
        "peak_rss_mb": peak_rss_mb(),
        "final_loss": loss,
        "threads": a.threads,
        "device": a.device.to_string(),
    });
    println!("{result}");
    Ok(())
}

/// The batches as backend tensors on `device`, made once before timing.
pub(crate) fn to_device<B: TrainBackend>(
    host: &[(HostTensor, HostTensor)],
    device: Device,
) -> Result<Vec<(B::Tensor, B::Tensor)>> {
    host.iter()
        .map(|(x, y)| Ok((B::from_host(x, device)?, B::from_host(y, device)?)))
        .collect()
}

/// What a timed step does after Kiln's training step, as the `Trainer` would.
pub(crate) enum AfterStep {
    /// Nothing.
    Nothing,
    /// The weight average's update.
    Ema(EmaConfig),
    /// The gradient norms (total and per group) and each group's rate read,
    /// as `[logging]` views log them on every step.
    Views,
    /// Every step recorded by the backend's profiler inside a `ProfilerStep#N`
    /// range, as `--profile` records its window (the trace is written after
    /// the timing).
    Profile,
}

/// Kiln's training step (`Trainable::train_step`: forward, loss, backward,
/// optimizer step; one session run on TensorFlow) on batches already on the
/// device, and `after` it what a tool adds to each step.
pub(crate) fn kiln_step<B: TrainBackend>(
    a: &WorkerArgs,
    host: &[(HostTensor, HostTensor)],
    after: AfterStep,
    prepare: impl FnOnce(&mut B::Model) -> kiln::core::Result<()>,
) -> Result<(Vec<f64>, f64)> {
    B::manual_seed(0);
    let mut model = B::build_model(&a.workload.spec(), a.device)?;
    prepare(&mut model)?;
    let mut optimizer =
        model.build_optimizer(&OptimizerConfig::Adam(AdamConfig::new(1e-3)), &[])?;
    let batches = to_device::<B>(host, a.device)?;
    let loss = Loss::cross_entropy();
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let views = matches!(after, AfterStep::Views);
    let mut profiler = match after {
        AfterStep::Profile => {
            let mut profiler = B::profiler(a.device)?;
            profiler.prepare()?;
            profiler.start()?;
            Some(profiler)
        }
        _ => None,
    };
    let mut average = match after {
        AfterStep::Ema(config) => Some(WeightAveraging::<B>::new(config, &model)?),
        _ => None,
    };
    let timed = time_steps(a, |i| {
        let (x, y) = &batches[i % batches.len()];
        if let Some(profiler) = profiler.as_mut() {
            profiler.begin_range(&format!("ProfilerStep#{}", i + 1))?;
        }
        optimizer.zero_grad()?;
        let loss = model.train_step(&mut optimizer, x, y, &plan)?;
        if let Some(profiler) = profiler.as_mut() {
            profiler.end_range()?;
        }
        if let Some(average) = average.as_mut() {
            average.update(&model)?;
        }
        if views {
            let norms = optimizer.gradient_norms()?;
            std::hint::black_box((norms, optimizer.learning_rates()));
        }
        Ok(loss)
    })?;
    if let Some(mut profiler) = profiler {
        let trace =
            std::env::temp_dir().join(format!("kiln-bench-trace-{}.json", std::process::id()));
        let events = profiler.stop(&trace)?;
        std::fs::remove_file(&trace).ok();
        std::hint::black_box(events);
    }
    Ok(timed)
}

/// Kiln's training step captured in a CUDA graph (`kiln::torch::graph::GraphedTrainStep`),
/// replayed on each batch; the loss is read (a synchronisation) only for the last step.
#[cfg(feature = "cuda")]
pub(crate) fn graphed_step(
    a: &WorkerArgs,
    host: &[(HostTensor, HostTensor)],
) -> Result<(Vec<f64>, f64)> {
    use kiln::core::backend::EagerBackend;
    use kiln::torch::graph::GraphedTrainStep;
    use kiln::torch::{TorchModel, TorchOptimizer};

    TorchBackend::manual_seed(0);
    let mut model = TorchModel::new(&a.workload.spec(), a.device)?;
    model.to_dtype(a.workload.dtype())?;
    let optimizer = TorchOptimizer::new(
        OptimizerConfig::Adam(AdamConfig::new(1e-3)),
        model.named_parameters()?,
        &[],
    )?;
    let batches = to_device::<TorchBackend>(host, a.device)?;
    let (x0, y0) = &batches[0];
    let mut step = GraphedTrainStep::new(model, optimizer, &Loss::cross_entropy(), None, x0, y0)?;
    let (warmup, steps) = (a.warmup, a.steps);
    time_steps(a, |i| {
        let (x, y) = &batches[i % batches.len()];
        let loss = step.step(x, y)?;
        // Read the loss (and so wait for the device) at the end of the warm-up and
        // of each timed run only, as the Python loops do.
        let done = i + 1;
        Ok(if done >= warmup && (done - warmup) % steps == 0 {
            TorchBackend::item(loss)?
        } else {
            f64::NAN
        })
    })
}

/// The same models written directly against `tch` (its `nn` layers and its
/// libtorch Adam), with no Kiln code in the step.
pub(crate) mod raw_tch {
    use super::*;
    use tch::nn::{self, Module as _, OptimizerConfig as _};
    use tch::{Kind, Tensor};

    pub(super) fn run(
        a: &WorkerArgs,
        host: &[(HostTensor, HostTensor)],
    ) -> Result<(Vec<f64>, f64)> {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(kiln::torch::device_to_tch(a.device)?);
        let root = vs.root();
        let model: Box<dyn Fn(&Tensor) -> Tensor> = match a.workload {
            Workload::Mlp => {
                let net = nn::seq()
                    .add(nn::linear(&root / "0", 784, 256, Default::default()))
                    .add_fn(|x| x.relu())
                    .add(nn::linear(&root / "2", 256, 10, Default::default()));
                Box::new(move |x| net.forward(x))
            }
            Workload::Cnn => {
                let conv = nn::ConvConfig {
                    padding: 1,
                    ..Default::default()
                };
                let net = nn::seq()
                    .add(nn::conv2d(&root / "0", 1, 32, 3, conv))
                    .add_fn(|x| x.relu().max_pool2d_default(2))
                    .add(nn::conv2d(&root / "3", 32, 64, 3, conv))
                    .add_fn(|x| x.relu().max_pool2d_default(2).flatten(1, -1))
                    .add(nn::linear(&root / "7", 64 * 7 * 7, 128, Default::default()))
                    .add_fn(|x| x.relu())
                    .add(nn::linear(&root / "9", 128, 10, Default::default()));
                Box::new(move |x| net.forward(x))
            }
            Workload::Transformer => Box::new(transformer(&root)),
            Workload::TransformerBf16 | Workload::TransformerBf16Mixed => {
                bail!("raw-tch has no bf16 transformer")
            }
        };
        let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
        let batches: Vec<(Tensor, Tensor)> = host
            .iter()
            .map(|(x, y)| {
                Ok((
                    kiln::torch::to_tch(x, a.device)?,
                    kiln::torch::to_tch(y, a.device)?,
                ))
            })
            .collect::<Result<_>>()?;
        time_steps(a, |i| {
            let (x, y) = &batches[i % batches.len()];
            let loss = model(x).cross_entropy_for_logits(y);
            opt.backward_step(&loss);
            Ok(loss.double_value(&[]))
        })
    }

    /// Pre-norm encoder block (8 heads, ff 1024, exact GELU), flatten, linear.
    fn transformer(root: &nn::Path<'_>) -> impl Fn(&Tensor) -> Tensor {
        let (e, heads, ff, seq) = (256i64, 8i64, 1024i64, 128i64);
        let ln = |p: nn::Path<'_>| nn::layer_norm(p, vec![e], Default::default());
        let ln1 = ln(root / "ln1");
        let in_proj = nn::linear(root / "in_proj", e, 3 * e, Default::default());
        let out_proj = nn::linear(root / "out_proj", e, e, Default::default());
        let ln2 = ln(root / "ln2");
        let fc1 = nn::linear(root / "fc1", e, ff, Default::default());
        let fc2 = nn::linear(root / "fc2", ff, e, Default::default());
        let head = nn::linear(root / "head", seq * e, 10, Default::default());
        move |x: &Tensor| {
            let b = x.size()[0];
            let qkv = in_proj.forward(&ln1.forward(x));
            let split = |t: Tensor| t.reshape([b, seq, heads, e / heads]).transpose(1, 2);
            let parts = qkv.chunk(3, -1);
            let (q, k, v) = (
                split(parts[0].shallow_clone()),
                split(parts[1].shallow_clone()),
                split(parts[2].shallow_clone()),
            );
            let att = Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                None::<Tensor>,
                0.0,
                false,
                None,
                false,
            );
            let att = att.transpose(1, 2).reshape([b, seq, e]);
            let h = x + out_proj.forward(&att);
            let f = fc2.forward(&fc1.forward(&ln2.forward(&h)).gelu("none"));
            let h = &h + f;
            head.forward(&h.flatten(1, -1)).to_kind(Kind::Float)
        }
    }
}
