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
        /// The list of a fused step that a tensor joins.
        #[repr(u8)]
        enum FusedAdamList {
            Params,
            Grads,
            ExpAvgs,
            ExpAvgSqs,
            /// Empty unless AMSGrad.
            MaxExpAvgSqs,
            /// 0-dim float32 step counts, one per parameter; the call adds one.
            Steps,
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

        // SAFETY: the declarations match include/fused_adam.h exactly (cxx checks
        // the signatures at compile time); the step returns `Result`, so a C++
        // exception comes back as an error instead of unwinding into Rust. Tensors
        // cross as `const at::Tensor&` (kiln-torch's `cxx_tensor`), which the
        // C++ side copies (a reference count, not the data) into its lists.
        unsafe extern "C++" {
            include!("kiln-torch/include/fused_adam.h");

            #[namespace = "at"]
            type Tensor = crate::cxx_tensor::AtTensor;

            /// The tensor lists of one fused step, filled one tensor at a time
            /// (cxx passes no slice or vector of opaque C++ values from Rust).
            type FusedAdamTensors;

            fn new_fused_adam_tensors() -> UniquePtr<FusedAdamTensors>;
            fn push(self: Pin<&mut FusedAdamTensors>, list: FusedAdamList, tensor: &Tensor);
            /// A 0-dim float32 learning rate, read on the device, instead of
            /// `FusedAdamHypers::lr`.
            fn set_lr_tensor(self: Pin<&mut FusedAdamTensors>, lr: &Tensor);
            /// A 1-element float32 flag: non-zero skips the update on the device.
            fn set_found_inf(self: Pin<&mut FusedAdamTensors>, found_inf: &Tensor);

            fn fused_adam_step(tensors: &FusedAdamTensors, hypers: &FusedAdamHypers) -> Result<()>;

            /// Unscales the `Grads` list by `inv_scale` and flags inf/NaN in `found_inf`.
            fn non_finite_check_and_unscale(
                tensors: &FusedAdamTensors,
                found_inf: &Tensor,
                inv_scale: &Tensor,
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
    /// When set, a non-zero value skips the update on the device (and the step
    /// counts are not advanced), as `torch.optim.Adam(fused=True)` under a
    /// `GradScaler` does.
    pub(crate) found_inf: Option<&'a Tensor>,
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
    use crate::cxx_tensor::as_at;
    use bridge::ffi::FusedAdamList;

    let mut tensors = bridge::ffi::new_fused_adam_tensors();
    let lists = [
        (FusedAdamList::Params, &batch.params),
        (FusedAdamList::Grads, &batch.grads),
        (FusedAdamList::ExpAvgs, &batch.exp_avgs),
        (FusedAdamList::ExpAvgSqs, &batch.exp_avg_sqs),
        (FusedAdamList::MaxExpAvgSqs, &batch.max_exp_avg_sqs),
        (FusedAdamList::Steps, &batch.steps),
    ];
    for (list, members) in lists {
        for tensor in members {
            tensors.pin_mut().push(list, as_at(tensor));
        }
    }
    if let Some(lr) = lr_tensor {
        tensors.pin_mut().set_lr_tensor(as_at(lr));
    }
    if let Some(flag) = batch.found_inf {
        tensors.pin_mut().set_found_inf(as_at(flag));
    }
    bridge::ffi::fused_adam_step(&tensors, hypers)
}

/// `torch._amp_foreach_non_finite_check_and_unscale_`: multiplies every gradient
/// in `grads` by `inv_scale` (a 1-element float32 tensor on their device) in
/// place and sets `found_inf` (likewise) to 1 when any element is inf or NaN, all
/// on the device.
pub(crate) fn non_finite_check_and_unscale(
    grads: &[&Tensor],
    found_inf: &Tensor,
    inv_scale: &Tensor,
) -> Result<(), cxx::Exception> {
    use crate::cxx_tensor::as_at;
    let mut tensors = bridge::ffi::new_fused_adam_tensors();
    for grad in grads {
        tensors
            .pin_mut()
            .push(bridge::ffi::FusedAdamList::Grads, as_at(grad));
    }
    bridge::ffi::non_finite_check_and_unscale(&tensors, as_at(found_inf), as_at(inv_scale))
}
