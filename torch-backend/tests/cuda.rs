//! CUDA through libtorch. On a machine without a GPU these report what libtorch
//! sees and skip the on-device parts with a message; on a GPU machine they run.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_core::{
    backend::{Backend, EagerBackend},
    Device, Error, HostTensor,
};
use kiln_torch::{cuda_device_count, cuda_is_available, TorchBackend};

fn cuda_count_or_skip(test: &str) -> Option<usize> {
    let count = cuda_device_count();
    println!(
        "libtorch: Cuda::is_available() = {}, Cuda::device_count() = {count}",
        cuda_is_available()
    );
    if count == 0 {
        kiln_testkit::skip_without_gpu(test, "no CUDA device on this machine");
        return None;
    }
    Some(count)
}

/// The known trap: the linker drops `libtorch_cuda` as unneeded, and CUDA then
/// silently reports unavailable. With a CUDA build of libtorch it must be loaded
/// into every binary, GPU or not.
#[test]
fn libtorch_cuda_is_linked() {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(maps.contains("libtorch_cpu.so"));
    if env!("KILN_LIBTORCH_CUDA") == "1" {
        assert!(
            maps.contains("libtorch_cuda.so"),
            "libtorch is a CUDA build but libtorch_cuda.so is not loaded: the binary was linked without it"
        );
    } else {
        println!("libtorch is a CPU-only build: nothing to check");
    }
}

#[test]
fn cuda_reports_consistently() {
    let count = cuda_device_count();
    assert_eq!(cuda_is_available(), count > 0);
    assert_eq!(TorchBackend::cuda_device_count(), count);
    assert!(TorchBackend::is_available(Device::Cpu));
    assert_eq!(TorchBackend::is_available(Device::Cuda(0)), count > 0);
    assert!(!TorchBackend::is_available(Device::Cuda(count)));
    let host = HostTensor::new(vec![1.0f32], [1]).unwrap();
    let err = TorchBackend::from_host(&host, Device::Cuda(count)).unwrap_err();
    assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");
}

#[test]
fn every_dtype_round_trips_through_the_gpu() {
    let Some(_) = cuda_count_or_skip("every_dtype_round_trips_through_the_gpu") else {
        return;
    };
    let samples = [
        HostTensor::new(vec![0u8, 255, 7], [3]).unwrap(),
        HostTensor::new(vec![i32::MIN, 0, i32::MAX, 5], [2, 2]).unwrap(),
        HostTensor::new(vec![i64::MIN, 1 << 40, i64::MAX], [3, 1]).unwrap(),
        HostTensor::new(vec![-1.5f32, 0.0, f32::MAX, 3.25], [1, 4]).unwrap(),
        HostTensor::new(vec![std::f64::consts::PI, 1e-300, -0.0], [3]).unwrap(),
    ];
    for host in samples {
        let on_gpu = TorchBackend::from_host(&host, Device::Cuda(0)).unwrap();
        assert_eq!(TorchBackend::device(&on_gpu), Device::Cuda(0));
        assert_eq!(TorchBackend::to_host(&on_gpu).unwrap(), host);
        let back_on_cpu = TorchBackend::to_device(&on_gpu, Device::Cpu).unwrap();
        assert_eq!(TorchBackend::device(&back_on_cpu), Device::Cpu);
        // What a checkpoint writer reads of a GPU tensor: a host copy of its bytes.
        let bytes = TorchBackend::with_host_bytes(&on_gpu, <[u8]>::to_vec).unwrap();
        assert_eq!(bytes, host.as_bytes());
    }
}

#[test]
fn matmul_and_backward_on_the_gpu_match_hand_values() {
    let Some(_) = cuda_count_or_skip("matmul_and_backward_on_the_gpu_match_hand_values") else {
        return;
    };
    let a = HostTensor::new(vec![1.0f64, 2.0, 3.0, 4.0], [2, 2]).unwrap();
    let x = TorchBackend::from_host(&a, Device::Cuda(0))
        .unwrap()
        .set_requires_grad(true);
    // sum(x @ x) for x = [[1, 2], [3, 4]]: x @ x = [[7, 10], [15, 22]], sum = 54.
    let loss = x.matmul(&x).sum(tch::Kind::Double);
    assert_eq!(loss.double_value(&[]), 54.0);
    TorchBackend::backward(&loss).unwrap();
    // d/dx sum(x @ x) = 1 @ x^T + x^T @ 1 = [[7, 11], [9, 13]].
    let grad = TorchBackend::to_host(&x.grad()).unwrap();
    assert_eq!(grad.as_slice::<f64>().unwrap(), &[7.0, 11.0, 9.0, 13.0]);
}

/// bf16 autocast on the GPU: a matrix product inside the region runs in bf16 and
/// float32 after it; a `bf16-mixed` model computes in bf16, keeps float32
/// parameters, returns float32 and gets float32 gradients close to float32's.
#[test]
fn bf16_autocast_and_mixed_precision_on_the_gpu() {
    use kiln_core::{
        model::{Layer, LinearConfig},
        module::Module,
        precision::FloatPrecision,
        DType,
    };
    let Some(_) = cuda_count_or_skip("bf16_autocast_and_mixed_precision_on_the_gpu") else {
        return;
    };
    let gpu = (tch::Kind::Float, tch::Device::Cuda(0));
    let (a, b) = (
        tch::Tensor::randn([64, 32], gpu),
        tch::Tensor::randn([32, 16], gpu),
    );
    let inside = kiln_torch::autocast(Device::Cuda(0), DType::BF16, || a.matmul(&b)).unwrap();
    assert_eq!(inside.kind(), tch::Kind::BFloat16);
    assert_eq!(a.matmul(&b).kind(), tch::Kind::Float);

    let spec = Layer::sequential([
        LinearConfig::new(32, 64).into(),
        Layer::Relu,
        LinearConfig::new(64, 10).into(),
    ]);
    let mut model = kiln_torch::TorchModel::new(&spec, Device::Cuda(0)).unwrap();
    let reference = model.forward(&a).unwrap();
    model.set_precision(FloatPrecision::Bf16Mixed).unwrap();
    let y = model.forward(&a).unwrap();
    assert_eq!(y.kind(), tch::Kind::Float);
    let diff = (&y - &reference).abs().max().double_value(&[]);
    assert!(diff > 0.0 && diff < 0.1, "bf16 rounding on the GPU: {diff}");
    y.sum(tch::Kind::Float).backward();
    for (name, p) in model.named_parameters().unwrap() {
        assert_eq!(p.grad().kind(), tch::Kind::Float, "{name}");
    }
}
