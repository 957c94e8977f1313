//! CUDA graphs (kiln-torch's `cuda` feature, `kiln_torch::graph`): a captured training
//! step against Kiln's eager step on the same model, batches and learning-rate
//! change (SGD, Adam, AdamW with AMSGrad; clipping by norm), and failures as errors
//! with the device still usable afterwards.
//!
//! Without a CUDA device, or built without the feature, the GPU tests skip
//! through `kiln_testkit::skip_without_gpu` (a `kiln-testkit: SKIPPED` line that
//! `.ci/run` counts as skipped).

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_graphs() {
    kiln_testkit::skip_without_gpu(
        "cuda_graphs",
        "kiln-torch was built without its `cuda` feature \
         (cargo test -p kiln-torch --features cuda --test cuda_graph)",
    );
}

#[cfg(feature = "cuda")]
mod gpu {
    use kiln_core::{
        backend::{Backend, StepPlan, Trainable},
        loss::Loss,
        model::{Layer, LinearConfig},
        module::Module,
        optim::{AdamConfig, AdamWConfig, GradClip, Optimizer, OptimizerConfig, SgdConfig},
        Device, Error,
    };
    use kiln_torch::graph::{CudaGraph, GraphedTrainStep};
    use kiln_torch::{TchModule, TorchBackend, TorchModel, TorchOptimizer};
    use tch::{Kind, Tensor};

    /// The GPU tests one at a time: each compares numbers drawn from libtorch's
    /// global generator, which the other tests' threads would draw from too.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        LOCK.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn cuda(test: &str) -> Option<Device> {
        if tch::Cuda::is_available() {
            Some(Device::Cuda(0))
        } else {
            kiln_testkit::skip_without_gpu(
                test,
                "no CUDA device (tch::Cuda::is_available() is false); \
                 the CUDA graph code was compiled but not run",
            );
            None
        }
    }

    fn spec() -> Layer {
        Layer::sequential([
            LinearConfig::new(32, 64).into(),
            Layer::Relu,
            LinearConfig::new(64, 10).into(),
        ])
    }

    fn batch(seed: i64, device: tch::Device) -> (Tensor, Tensor) {
        tch::manual_seed(seed);
        (
            Tensor::randn([16, 32], (Kind::Float, device)),
            Tensor::randint(10, [16], (Kind::Int64, device)),
        )
    }

    fn max_param_diff(a: &impl Module<TorchBackend>, b: &impl Module<TorchBackend>) -> f64 {
        a.named_parameters()
            .unwrap()
            .iter()
            .zip(b.named_parameters().unwrap())
            .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
            .fold(0.0, f64::max)
    }

    #[test]
    fn without_a_cuda_device_a_graph_is_an_error() {
        let err = CudaGraph::new(Device::Cpu).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        assert!(err.to_string().contains("CUDA device"), "{err}");
    }

    /// Runs the C++ side of the bridge on any machine: without a device, creating a
    /// graph on `cuda:0` is libtorch's error, not a crash.
    #[test]
    fn without_a_gpu_the_cpp_side_refuses_a_cuda_graph() {
        if tch::Cuda::is_available() {
            let graph = CudaGraph::new(Device::Cuda(0)).unwrap();
            assert!(!graph.is_captured());
            return;
        }
        let err = CudaGraph::new(Device::Cuda(0)).unwrap_err();
        let text = err.display_chain().to_string();
        assert!(matches!(err, Error::Backend { .. }), "{text}");
        assert!(text.contains("CUDA device 0 does not exist"), "{text}");
    }

    #[test]
    fn a_captured_step_follows_the_eager_step() {
        let _serial = serial();
        let Some(device) = cuda("a_captured_step_follows_the_eager_step") else {
            return;
        };
        let configs = [
            OptimizerConfig::Sgd(SgdConfig {
                momentum: 0.9,
                nesterov: true,
                ..SgdConfig::new(0.05)
            }),
            OptimizerConfig::Adam(AdamConfig::new(1e-2)),
            OptimizerConfig::AdamW(AdamWConfig {
                amsgrad: true,
                weight_decay: 0.1,
                ..AdamWConfig::new(1e-2)
            }),
        ];
        let loss = Loss::cross_entropy();
        let clip = GradClip::Norm {
            max_norm: 1.0,
            norm_type: 2.0,
        };
        let tch_device = kiln_torch::device_to_tch(device).unwrap();
        let batches: Vec<_> = (0..4).map(|i| batch(100 + i, tch_device)).collect();
        for config in configs {
            TorchBackend::manual_seed(7);
            let mut eager = TorchModel::new(&spec(), device).unwrap();
            let mut graphed = TorchModel::new(&spec(), device).unwrap();
            graphed
                .load_state_dict(&eager.state_dict().unwrap())
                .unwrap();
            let mut eager_opt =
                TorchOptimizer::new(config.clone(), eager.named_parameters().unwrap(), &[])
                    .unwrap();
            let graphed_opt =
                TorchOptimizer::new(config.clone(), graphed.named_parameters().unwrap(), &[])
                    .unwrap();
            let (x0, y0) = &batches[0];
            let mut step =
                GraphedTrainStep::new(graphed, graphed_opt, &loss, Some(clip), x0, y0).unwrap();
            // The warm-up steps were undone: nothing has trained yet.
            assert_eq!(max_param_diff(&eager, step.model()), 0.0, "{config:?}");

            let plan = StepPlan {
                loss: &loss,
                scale: 1.0,
                apply: true,
                clip: Some(&clip),
            };
            for i in 0..12 {
                if i == 6 {
                    let lr = eager_opt.learning_rate() / 4.0;
                    eager_opt.set_learning_rate(lr).unwrap();
                    step.set_learning_rate(lr).unwrap();
                }
                let (x, y) = &batches[i % batches.len()];
                eager_opt.zero_grad().unwrap();
                let eager_loss = eager.train_step(&mut eager_opt, x, y, &plan).unwrap();
                let graphed_loss = step.step(x, y).unwrap().double_value(&[]);
                assert!(
                    (eager_loss - graphed_loss).abs() < 1e-5,
                    "{config:?} step {i}: eager loss {eager_loss}, graphed {graphed_loss}"
                );
            }
            let diff = max_param_diff(&eager, step.model());
            assert!(diff < 1e-5, "{config:?}: parameters differ by {diff}");
            assert!(diff.is_finite());
            // The device step count advanced with the replays (12), not the warm-up.
            let state = step.optimizer().state_dict().unwrap();
            let steps = state.get("state.0.weight.step").unwrap();
            assert_eq!(steps.as_slice::<i64>().unwrap(), [12], "{config:?}");
            let (model, optimizer) = step.into_parts();
            assert!(optimizer.is_capturable());
            assert_eq!(model.named_parameters().unwrap().len(), 4);
        }
    }

    #[test]
    fn capture_failures_are_errors_and_the_device_stays_usable() {
        let _serial = serial();
        let Some(device) = cuda("capture_failures_are_errors_and_the_device_stays_usable") else {
            return;
        };
        let tch_device = kiln_torch::device_to_tch(device).unwrap();
        let loss = Loss::cross_entropy();
        let (x, y) = batch(1, tch_device);
        let model = || TorchModel::new(&spec(), device).unwrap();
        let adam = |m: &TorchModel| {
            TorchOptimizer::new(
                OptimizerConfig::Adam(AdamConfig::new(1e-3)),
                m.named_parameters().unwrap(),
                &[],
            )
            .unwrap()
        };

        // Inputs on the CPU: named, before anything runs.
        let m = model();
        let o = adam(&m);
        let err =
            GraphedTrainStep::new(m, o, &loss, None, &x.to(tch::Device::Cpu), &y).unwrap_err();
        assert!(err.to_string().contains("CUDA device"), "{err}");

        // A batch of another shape or dtype than the captured one.
        let m = model();
        let o = adam(&m);
        let mut step = GraphedTrainStep::new(m, o, &loss, None, &x, &y).unwrap();
        let err = step
            .step(&x.narrow(0, 0, 8), &y.narrow(0, 0, 8))
            .unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
        let err = step.step(&x.to_kind(Kind::Double), &y).unwrap_err();
        assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
        assert!(step.step(&x, &y).unwrap().double_value(&[]).is_finite());

        // A forward that reads a value back to the host cannot be captured.
        let syncing = TchModule::new(device, |root| {
            let w = root.var("w", &[32, 10], tch::nn::Init::Const(0.01));
            move |x: &Tensor, _train: bool| {
                let _ = x.f_double_value(&[0, 0]);
                x.f_matmul(&w)
            }
        })
        .unwrap();
        let o = TorchOptimizer::new(
            OptimizerConfig::Adam(AdamConfig::new(1e-3)),
            syncing.named_parameters().unwrap(),
            &[],
        )
        .unwrap();
        let err = GraphedTrainStep::new(syncing, o, &loss, None, &x, &y).unwrap_err();
        eprintln!("capture of a synchronising forward: {err}");
        assert!(err.to_string().contains("CUDA graph"), "{err}");

        // RMSprop has no capturable mode.
        let m = model();
        let o = TorchOptimizer::new(
            OptimizerConfig::RmsProp(kiln_core::optim::RmsPropConfig::new(1e-3)),
            m.named_parameters().unwrap(),
            &[],
        )
        .unwrap();
        let err = GraphedTrainStep::new(m, o, &loss, None, &x, &y).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");

        // The device still works, and so does a new capture.
        let sum = Tensor::ones([4], (Kind::Float, tch_device)).sum(Kind::Float);
        assert_eq!(sum.double_value(&[]), 4.0);
        let m = model();
        let o = adam(&m);
        let mut step = GraphedTrainStep::new(m, o, &loss, None, &x, &y).unwrap();
        assert!(step.step(&x, &y).unwrap().double_value(&[]).is_finite());
    }
}
