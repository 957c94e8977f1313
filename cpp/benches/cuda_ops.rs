//! The fused ops' CUDA kernels against the equivalent compositions of built-in
//! torch ops, forward and forward + backward, on `cuda:0`: a table of medians and
//! ratios (above 1: the fused kernel is faster), printed, never asserted.
//!
//! ```sh
//! cargo xtask cargo bench -p kiln-fused-ops --features cuda --bench cuda_ops
//! benches/gpu/run.sh ops      # on a GPU machine, from benches/gpu/pack.sh's build
//! ```
//!
//! Without a CUDA device it says so and exits successfully.

#![allow(clippy::unwrap_used)] // a benchmark whose op fails should stop loudly

use std::time::Instant;

use tch::{Device, Kind, Reduction, Tensor};

/// An infallible form of an op, for the timing loops.
type Forward = Box<dyn Fn(&[Tensor]) -> Tensor>;

/// Milliseconds per call of `f`: the median of 7 rounds of `iters` calls,
/// each round between two device synchronisations, after a warm-up.
fn time_ms(iters: usize, f: &dyn Fn()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut rounds: Vec<f64> = (0..7)
        .map(|_| {
            tch::Cuda::synchronize(0);
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            tch::Cuda::synchronize(0);
            start.elapsed().as_secs_f64() * 1e3 / iters as f64
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[rounds.len() / 2]
}

struct Case {
    name: &'static str,
    shape: String,
    inputs: Vec<Tensor>,
    differentiable: Vec<usize>,
    fused: Forward,
    composed: Forward,
}

/// One forward and one backward of `sum(f(inputs))` into fresh gradients.
fn step(f: &dyn Fn(&[Tensor]) -> Tensor, leaves: &[Tensor], differentiable: &[usize]) {
    let out = f(leaves);
    let wrt: Vec<&Tensor> = differentiable.iter().map(|&i| &leaves[i]).collect();
    let _grads = Tensor::run_backward(&[out.sum(out.kind())], &wrt, false, false);
}

fn main() {
    if !tch::Cuda::is_available() {
        eprintln!("cuda_ops: no CUDA device (tch::Cuda::is_available() is false); nothing to time");
        return;
    }
    let device = Device::Cuda(0);
    tch::manual_seed(3);
    let f32 = (Kind::Float, device);
    let xent = |n: i64, c: i64, eps: f64| Case {
        name: "softmax_xent",
        shape: format!("[{n}, {c}] eps {eps}"),
        inputs: vec![
            Tensor::randn([n, c], f32),
            Tensor::randint_low(0, c, [n], (Kind::Int64, device)),
        ],
        differentiable: vec![0],
        fused: Box::new(move |t| kiln_fused_ops::softmax_cross_entropy(&t[0], &t[1], eps).unwrap()),
        composed: Box::new(move |t| {
            t[0].cross_entropy_loss::<Tensor>(&t[1], None, Reduction::None, -100, eps)
        }),
    };
    let cases = vec![
        Case {
            name: "bias_gelu",
            shape: "[8192, 4096]".into(),
            inputs: vec![Tensor::randn([8192, 4096], f32), Tensor::randn([4096], f32)],
            differentiable: vec![0, 1],
            fused: Box::new(|t| kiln_fused_ops::bias_gelu(&t[0], &t[1]).unwrap()),
            composed: Box::new(|t| (&t[0] + &t[1]).gelu("none")),
        },
        xent(8192, 1000, 0.1),
        xent(2048, 32000, 0.1),
        Case {
            name: "swish",
            shape: "[16777216]".into(),
            inputs: vec![
                Tensor::randn([1 << 24], f32),
                Tensor::from_slice(&[1.3f32]).to_device(device),
            ],
            differentiable: vec![0, 1],
            fused: Box::new(|t| kiln_fused_ops::swish(&t[0], &t[1]).unwrap()),
            composed: Box::new(|t| &t[0] * (&t[1] * &t[0]).sigmoid()),
        },
    ];

    let mut table = vec![format!(
        "{:<13} {:<22} {:>10} {:>10} {:>6} {:>12} {:>12} {:>6} {:>9}",
        "op (float32)",
        "shape",
        "kiln fwd",
        "torch fwd",
        "ratio",
        "kiln f+b",
        "torch f+b",
        "ratio",
        "max diff"
    )];
    for case in &cases {
        let diff = ((case.fused)(&case.inputs) - (case.composed)(&case.inputs))
            .abs()
            .max()
            .double_value(&[]);
        let fwd_fused = time_ms(20, &|| drop((case.fused)(&case.inputs)));
        let fwd_torch = time_ms(20, &|| drop((case.composed)(&case.inputs)));
        let leaves: Vec<Tensor> = case
            .inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if case.differentiable.contains(&i) {
                    t.detach().set_requires_grad(true)
                } else {
                    t.detach()
                }
            })
            .collect();
        let both_fused = time_ms(20, &|| step(&*case.fused, &leaves, &case.differentiable));
        let both_torch = time_ms(20, &|| step(&*case.composed, &leaves, &case.differentiable));
        table.push(format!(
            "{:<13} {:<22} {:>8.3}ms {:>8.3}ms {:>6.2} {:>10.3}ms {:>10.3}ms {:>6.2} {:>9.1e}",
            case.name,
            case.shape,
            fwd_fused,
            fwd_torch,
            fwd_torch / fwd_fused,
            both_fused,
            both_torch,
            both_torch / both_fused,
            diff
        ));
    }
    eprintln!(
        "CUDA timings on {device:?} (median of 7 rounds of 20 calls; ratio = torch / kiln, \
         above 1 means the fused kernel is faster; softmax_xent's forward includes the \
         synchronisation that validates targets):\n{}",
        table.join("\n")
    );
}
