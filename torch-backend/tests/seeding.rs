//! Seeded reproducibility. Its own test binary: libtorch's generator is global, and
//! tests running in parallel threads of one binary would draw from it in between.

#![allow(clippy::unwrap_used)]

use kiln_core::{
    backend::Backend,
    loss::Loss,
    model::{Layer, LinearConfig},
    module::Module,
    optim::{Optimizer, OptimizerConfig, SgdConfig},
    state_dict::StateDict,
    Device,
};
use kiln_torch::{compute_loss, TorchBackend, TorchModel, TorchOptimizer};

/// Same seed, same data: bitwise-identical weights after training on the CPU,
/// dropout and shuffling included.
#[test]
fn same_seed_gives_bitwise_identical_training() {
    let spec = Layer::sequential([
        LinearConfig::new(6, 16).into(),
        Layer::Relu,
        Layer::Dropout { p: 0.2 },
        LinearConfig::new(16, 2).into(),
    ]);
    let run = |seed: u64| -> StateDict {
        TorchBackend::manual_seed(seed);
        let model = TorchModel::new(&spec, Device::Cpu).unwrap();
        let mut opt = TorchOptimizer::new(
            OptimizerConfig::Sgd(SgdConfig::new(0.1)),
            model.named_parameters().unwrap(),
            &[],
        )
        .unwrap();
        for _ in 0..20 {
            let x = tch::Tensor::randn([8, 6], (tch::Kind::Float, tch::Device::Cpu));
            let y = tch::Tensor::randint(2, [8], (tch::Kind::Int64, tch::Device::Cpu));
            opt.zero_grad().unwrap();
            compute_loss(&Loss::cross_entropy(), &model.forward(&x).unwrap(), &y)
                .unwrap()
                .backward();
            opt.step().unwrap();
        }
        model.state_dict().unwrap()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}
