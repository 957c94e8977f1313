//! The CUDA kernels of the fused ops (kiln-fused-ops' `cuda` feature): forward and
//! backward against the CPU kernels on the same data (float32 1e-5, float64 1e-10),
//! mixed devices and bad targets as `Err` (with the CUDA context still usable
//! afterwards). Their speed against the equivalent compositions of built-in torch
//! ops is a benchmark, `cpp/benches/cuda_ops.rs`.
//!
//! Without a CUDA device, or built without the feature, every GPU test skips
//! through `kiln_testkit::skip_without_gpu` (a `kiln-testkit: SKIPPED` line that
//! `.ci/run` counts as skipped), so the suite runs the same on every machine.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_kernels() {
    kiln_testkit::skip_without_gpu(
        "cuda_kernels",
        "kiln-fused-ops was built without its `cuda` feature (cargo test -p kiln-fused-ops --features cuda)",
    );
}

#[cfg(feature = "cuda")]
mod gpu {
    use tch::{Device, Kind, Tensor};

    type Op = dyn Fn(&[Tensor]) -> kiln_core::Result<Tensor>;

    /// The first CUDA device, or `None` after skipping `test`.
    fn cuda_device(test: &str) -> Option<Device> {
        if tch::Cuda::is_available() {
            Some(Device::Cuda(0))
        } else {
            kiln_testkit::skip_without_gpu(
                test,
                "no CUDA device (tch::Cuda::is_available() is false); \
                 the CUDA kernels were compiled but not run",
            );
            None
        }
    }

    /// Runs without a GPU: the shared library Python loads registers a CUDA kernel
    /// for each of the six ops (next to the CPU one), so the CUDA objects and the
    /// CUDA runtime were linked in and their static registrations kept.
    #[test]
    fn shared_library_registers_cuda_kernels() {
        let Some(python) = kiln_testkit::python("shared_library_registers_cuda_kernels") else {
            return;
        };
        let script = format!(
            "import torch\n\
             torch.ops.load_library({library:?})\n\
             for op in ['bias_gelu', 'bias_gelu_backward', 'softmax_xent',\n\
                        'softmax_xent_backward', 'swish', 'swish_backward']:\n\
             \x20   for key in ['CPU', 'CUDA']:\n\
             \x20       print(op, key, torch._C._dispatch_has_kernel_for_dispatch_key('kiln::' + op, key))\n",
            library = kiln_fused_ops::TORCH_LIBRARY
        );
        let out = std::process::Command::new(&python)
            .args(["-c", &script])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "python: {}\n{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 12, "{stdout}");
        for line in lines {
            assert!(line.ends_with(" True"), "no kernel: {line}");
        }
    }

    fn tolerance(kind: Kind) -> f64 {
        match kind {
            Kind::Float => 1e-5,
            _ => 1e-10,
        }
    }

    /// The largest difference from the reference, relative to the reference's
    /// largest magnitude (absolute where that is below 1). NaN compares as failure.
    fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
        assert_eq!(got.size(), want.size());
        if want.numel() == 0 {
            return 0.0;
        }
        let got = got.to_device(Device::Cpu).to_kind(Kind::Double);
        let want = want.to_device(Device::Cpu).to_kind(Kind::Double);
        let diff = (&got - &want).abs().max().double_value(&[]);
        diff / want.abs().max().double_value(&[]).max(1.0)
    }

    /// The op's output and the gradients of `sum(output * upstream)`, on `device`,
    /// brought back to the CPU.
    fn forward_backward(
        op: &Op,
        inputs: &[Tensor],
        differentiable: &[usize],
        upstream: &Tensor,
        device: Device,
    ) -> (Tensor, Vec<Tensor>) {
        let leaves: Vec<Tensor> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let t = t.to_device(device).detach();
                if differentiable.contains(&i) {
                    t.set_requires_grad(true)
                } else {
                    t
                }
            })
            .collect();
        let out = op(&leaves).unwrap();
        (&out * upstream.to_device(device))
            .sum(out.kind())
            .backward();
        let grads = differentiable
            .iter()
            .map(|&i| leaves[i].grad().to_device(Device::Cpu))
            .collect();
        (out.detach().to_device(Device::Cpu), grads)
    }

    /// CUDA against CPU, forward and backward. `summed[k]` is how many terms the
    /// k-th gradient sums per element (1 for an elementwise gradient): a sum's
    /// rounding grows with its length and the two devices add in different orders,
    /// so its tolerance is scaled by the square root of that count.
    fn compare(
        name: &str,
        device: Device,
        inputs: &[Tensor],
        differentiable: &[usize],
        summed: &[i64],
        op: &Op,
    ) {
        let kind = inputs[0].kind();
        let tol = tolerance(kind);
        let probe = op(inputs).unwrap();
        // Positive upstream gradients: a reduced gradient then has no cancellation
        // that would make a relative comparison meaningless.
        let upstream = probe.rand_like() + 0.5;
        let (cpu_out, cpu_grads) =
            forward_backward(op, inputs, differentiable, &upstream, Device::Cpu);
        let (gpu_out, gpu_grads) = forward_backward(op, inputs, differentiable, &upstream, device);
        let err = rel_err(&gpu_out, &cpu_out);
        eprintln!(
            "{name} {kind:?} {:?}: forward {err:.1e} (tolerance {tol:.0e})",
            inputs[0].size()
        );
        assert!(
            err <= tol,
            "{name} {kind:?}: CUDA forward differs from CPU by {err:e}"
        );
        for (k, (gpu, cpu)) in gpu_grads.iter().zip(&cpu_grads).enumerate() {
            let tol = tol * (summed[k].max(1) as f64).sqrt();
            let err = rel_err(gpu, cpu);
            eprintln!(
                "{name} {kind:?}: gradient of input {} {err:.1e} (tolerance {tol:.1e})",
                differentiable[k]
            );
            assert!(
                err <= tol,
                "{name} {kind:?}: CUDA gradient of input {} differs from CPU by {err:e}",
                differentiable[k]
            );
        }
    }

    #[test]
    fn forward_and_backward_match_cpu() {
        let Some(device) = cuda_device("forward_and_backward_match_cpu") else {
            return;
        };
        tch::manual_seed(7);
        for kind in [Kind::Float, Kind::Double] {
            let cpu = (kind, Device::Cpu);
            // Columns not a multiple of the 32-column tile; rows over several chunks.
            for shape in [
                vec![513i64, 257],
                vec![2, 3, 1031],
                vec![1, 5],
                vec![4099, 64],
            ] {
                let cols = *shape.last().unwrap();
                let rows: i64 = shape.iter().product::<i64>() / cols;
                compare(
                    "bias_gelu",
                    device,
                    &[
                        Tensor::randn(shape.as_slice(), cpu),
                        Tensor::randn([cols], cpu),
                    ],
                    &[0, 1],
                    &[1, rows],
                    &|t| kiln_fused_ops::bias_gelu(&t[0], &t[1]),
                );
            }
            // A warp per row up to 1024 classes, a block of 256 or 512 threads beyond.
            for (n, c) in [(1000i64, 10i64), (64, 1000), (33, 1025), (8, 10000)] {
                for eps in [0.0, 0.1] {
                    let target = Tensor::randint_low(0, c, [n], (Kind::Int64, Device::Cpu));
                    compare(
                        &format!("softmax_xent(eps={eps})"),
                        device,
                        &[Tensor::randn([n, c], cpu) * 3.0, target],
                        &[0],
                        &[1],
                        &move |t| kiln_fused_ops::softmax_cross_entropy(&t[0], &t[1], eps),
                    );
                }
            }
            for shape in [vec![65_537i64], vec![32, 3, 7], vec![1]] {
                let n: i64 = shape.iter().product();
                compare(
                    "swish",
                    device,
                    &[
                        Tensor::randn(shape.as_slice(), cpu) * 2.0,
                        Tensor::from_slice(&[1.3f64]).to_kind(kind),
                    ],
                    &[0, 1],
                    &[1, n],
                    &|t| kiln_fused_ops::swish(&t[0], &t[1]),
                );
            }
        }
    }

    #[test]
    fn empty_inputs_give_empty_outputs_and_zero_parameter_gradients() {
        let Some(device) =
            cuda_device("empty_inputs_give_empty_outputs_and_zero_parameter_gradients")
        else {
            return;
        };
        let opts = (Kind::Float, device);
        let x = Tensor::zeros([0, 6], opts).set_requires_grad(true);
        let b = Tensor::ones([6], opts).set_requires_grad(true);
        let y = kiln_fused_ops::bias_gelu(&x, &b).unwrap();
        assert_eq!(y.size(), [0, 6]);
        y.sum(Kind::Float).backward();
        assert_eq!(b.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);

        let x = Tensor::zeros([0], opts).set_requires_grad(true);
        let beta = Tensor::ones([1], opts).set_requires_grad(true);
        let y = kiln_fused_ops::swish(&x, &beta).unwrap();
        y.sum(Kind::Float).backward();
        assert_eq!(beta.grad().double_value(&[0]), 0.0);

        let logits = Tensor::zeros([0, 4], opts);
        let target = Tensor::zeros([0], (Kind::Int64, device));
        let loss = kiln_fused_ops::softmax_cross_entropy(&logits, &target, 0.1).unwrap();
        assert_eq!(loss.size(), [0]);
    }

    #[test]
    fn mixed_devices_and_bad_arguments_are_errors() {
        let Some(cuda) = cuda_device("mixed_devices_and_bad_arguments_are_errors") else {
            return;
        };
        let on = |device| (Kind::Float, device);
        let expect_err = |what: &str, result: kiln_core::Result<Tensor>, needles: &[&str]| {
            let err = match result {
                Ok(t) => panic!(
                    "{what}: expected an error, got a tensor of shape {:?}",
                    t.size()
                ),
                Err(e) => e,
            };
            // The C++ exception is the error's source: read the chain, as a user sees it.
            let text = err.display_chain().to_string();
            assert!(
                matches!(err, kiln_core::Error::Backend { .. }),
                "{what}: {text}"
            );
            for needle in needles {
                assert!(text.contains(needle), "{what}: {needle:?} not in {text}");
            }
            eprintln!("{what}: {}", text.lines().next().unwrap_or(""));
        };

        let x_gpu = Tensor::randn([4, 8], on(cuda));
        let x_cpu = Tensor::randn([4, 8], on(Device::Cpu));
        let b_gpu = Tensor::randn([8], on(cuda));
        let b_cpu = Tensor::randn([8], on(Device::Cpu));
        expect_err(
            "bias_gelu(cuda x, cpu bias)",
            kiln_fused_ops::bias_gelu(&x_gpu, &b_cpu),
            &["x is on cuda", "bias is on cpu"],
        );
        expect_err(
            "bias_gelu(cpu x, cuda bias)",
            kiln_fused_ops::bias_gelu(&x_cpu, &b_gpu),
            &["x is on cpu", "bias is on cuda"],
        );
        expect_err(
            "swish(cuda x, cpu beta)",
            kiln_fused_ops::swish(&x_gpu, &Tensor::ones([1], on(Device::Cpu))),
            &["beta is on cpu"],
        );
        let target_cpu = Tensor::zeros([4], (Kind::Int64, Device::Cpu));
        let target_gpu = Tensor::from_slice(&[0i64, 3, 8, 1]).to_device(cuda);
        expect_err(
            "softmax_xent(cuda logits, cpu target)",
            kiln_fused_ops::softmax_cross_entropy(&x_gpu, &target_cpu, 0.0),
            &["target is on cpu", "logits are on cuda"],
        );
        expect_err(
            "bias_gelu(int64 x on cuda)",
            kiln_fused_ops::bias_gelu(&Tensor::zeros([4, 8], (Kind::Int64, cuda)), &b_gpu),
            &["must be float32 or float64"],
        );
        expect_err(
            "bias_gelu(wrong bias shape on cuda)",
            kiln_fused_ops::bias_gelu(&x_gpu, &Tensor::zeros([7], on(cuda))),
            &["bias must have shape [8]"],
        );
        // Row 2's target 8 is outside [0, 8): the same error as on the CPU, found
        // on the device without a device-side assert...
        expect_err(
            "softmax_xent(target out of range on cuda)",
            kiln_fused_ops::softmax_cross_entropy(&x_gpu, &target_gpu, 0.1),
            &["target 8 at row 2 is outside [0, 8)"],
        );
        // ...so the CUDA context is still usable afterwards.
        let good = Tensor::from_slice(&[0i64, 3, 7, 1]).to_device(cuda);
        let loss = kiln_fused_ops::softmax_cross_entropy(&x_gpu, &good, 0.1).unwrap();
        let want = kiln_fused_ops::softmax_cross_entropy(
            &x_gpu.to_device(Device::Cpu),
            &good.to_device(Device::Cpu),
            0.1,
        )
        .unwrap();
        assert!(rel_err(&loss, &want) <= 1e-5);
    }
}
