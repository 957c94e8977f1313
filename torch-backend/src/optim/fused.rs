//! Adam and AdamW as libtorch's multi-tensor kernels (`at::_fused_adam_`,
//! `at::_fused_adamw_`, what `torch.optim.Adam(fused=True)` runs), which tch does not
//! expose: one call updates every parameter of a batch in one pass over each. In
//! capturable mode they read the step counts and the learning rate from device
//! tensors.

use tch::Tensor;

#[allow(unsafe_code)]
mod bridge {
    #[cxx::bridge(namespace = "kiln::torch")]
    pub(super) mod ffi {
        /// The tensors of one fused step, as the addresses of live `at::Tensor`s
        /// (what tch's `Tensor::as_ptr` points at), list by list, in the same order.
        struct FusedAdamTensors {
            params: Vec<usize>,
            grads: Vec<usize>,
            exp_avgs: Vec<usize>,
            exp_avg_sqs: Vec<usize>,
            /// Empty unless AMSGrad.
            max_exp_avg_sqs: Vec<usize>,
            /// 0-dim float32 step counts, one per parameter; the call adds one.
            steps: Vec<usize>,
            /// A 0-dim float32 learning rate on the parameters' device, or 0 for
            /// `FusedAdamHypers::lr`.
            lr_tensor: usize,
        }

        /// The scalar hyperparameters of one fused step.
        struct FusedAdamHypers {
            /// The learning rate, unless the tensors carry one.
            lr: f64,
            beta1: f64,
            beta2: f64,
            weight_decay: f64,
            eps: f64,
            amsgrad: bool,
            /// AdamW's decoupled weight decay instead of Adam's L2 penalty.
            decoupled: bool,
        }

        // SAFETY: the declaration matches include/fused_adam.h exactly (cxx checks
        // the signature at compile time) and returns `Result`, so a C++ exception
        // comes back as an error instead of unwinding into Rust. It is `unsafe`
        // because the addresses must point at live `at::Tensor`s for the call.
        unsafe extern "C++" {
            include!("kiln-torch/include/fused_adam.h");

            unsafe fn fused_adam_step(
                tensors: &FusedAdamTensors,
                hypers: &FusedAdamHypers,
            ) -> Result<()>;
        }
    }
}

pub(crate) use bridge::ffi::FusedAdamHypers;

/// The tensors of one fused step, borrowed for the call.
#[derive(Default)]
pub(crate) struct FusedAdamBatch<'a> {
    pub(crate) params: Vec<&'a Tensor>,
    pub(crate) grads: Vec<&'a Tensor>,
    pub(crate) exp_avgs: Vec<&'a Tensor>,
    pub(crate) exp_avg_sqs: Vec<&'a Tensor>,
    pub(crate) max_exp_avg_sqs: Vec<&'a Tensor>,
    pub(crate) steps: Vec<&'a Tensor>,
}

/// Adds one to every step count of `batch`, then updates its parameters and
/// moments in place with `lr_tensor` (a 0-dim float32 tensor on the parameters'
/// device, or on the CPU), else with `hypers.lr`. On error the step counts are put
/// back. libtorch checks that the lists share a device, dtype and layout before it
/// updates anything; the optimizer has already checked each gradient's shape, dtype
/// and device. The C++ side's exception (libtorch's message without its stack
/// trace) is the error.
pub(crate) fn fused_adam_step(
    batch: &FusedAdamBatch<'_>,
    lr_tensor: Option<&Tensor>,
    hypers: &FusedAdamHypers,
) -> Result<(), cxx::Exception> {
    let addresses =
        |list: &[&Tensor]| -> Vec<usize> { list.iter().map(|t| t.as_ptr() as usize).collect() };
    let tensors = bridge::ffi::FusedAdamTensors {
        params: addresses(&batch.params),
        grads: addresses(&batch.grads),
        exp_avgs: addresses(&batch.exp_avgs),
        exp_avg_sqs: addresses(&batch.exp_avg_sqs),
        max_exp_avg_sqs: addresses(&batch.max_exp_avg_sqs),
        steps: addresses(&batch.steps),
        lr_tensor: lr_tensor.map_or(0, |t| t.as_ptr() as usize),
    };
    // SAFETY: every address is that of a tensor borrowed by `batch` or `lr_tensor`,
    // alive for the whole call; the C++ side only reads them as `const at::Tensor&`
    // and copies the handles it keeps.
    #[allow(unsafe_code)]
    let result = unsafe { bridge::ffi::fused_adam_step(&tensors, hypers) };
    result
}
