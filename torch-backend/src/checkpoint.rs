//! Activation checkpointing: a part of a model runs in the forward pass without
//! keeping its activations, and again in the backward pass to compute its
//! gradients (PyTorch's `torch.utils.checkpoint`), trading compute for memory.
//! Only the part's input is kept. The random generators (CPU, and the input's
//! CUDA device) are put back as they were for the second run, so dropout draws
//! the same mask, and the gradients equal an ordinary run's.
//!
//! The graph node is C++ (`src/checkpoint.cc`, a `torch::autograd::Function`);
//! the part it runs twice is a Rust closure, which it owns until the graph is
//! freed.

use std::pin::Pin;

use kiln_core::{Error, Result};
use tch::Tensor;

use crate::cxx_tensor::{as_at, from_at, AtTensor};

#[allow(unsafe_code)]
mod bridge {
    use super::{recompute, Recompute};

    #[cxx::bridge(namespace = "kiln::torch")]
    pub(super) mod ffi {
        extern "Rust" {
            type Recompute;
            fn recompute(part: &Recompute, x: &Tensor, out: Pin<&mut TensorSink>) -> Result<()>;
        }

        // SAFETY: the declarations match include/activation_checkpoint.h (cxx checks
        // the signatures at compile time); `checkpointed` returns `Result`, so a C++
        // exception (or the part's error, thrown back through it) comes back as an
        // error instead of unwinding into Rust.
        unsafe extern "C++" {
            include!("kiln-torch/include/activation_checkpoint.h");

            #[namespace = "at"]
            type Tensor = crate::cxx_tensor::AtTensor;

            type TensorSink;
            fn set(self: Pin<&mut TensorSink>, tensor: &Tensor);

            type ParamList;
            fn new_param_list() -> UniquePtr<ParamList>;
            fn push(self: Pin<&mut ParamList>, tensor: &Tensor);

            fn checkpointed(
                x: &Tensor,
                params: &ParamList,
                part: Box<Recompute>,
            ) -> Result<UniquePtr<Tensor>>;
        }
    }
}

use bridge::ffi;

/// What a checkpointed part computes from its input.
type Part = Box<dyn Fn(&Tensor) -> Result<Tensor> + Send>;

/// The part of a model a checkpoint runs: once in the forward pass, again in
/// the backward pass.
pub struct Recompute {
    run: Part,
}

/// Called by the graph node (both runs).
fn recompute(part: &Recompute, x: &AtTensor, out: Pin<&mut ffi::TensorSink>) -> Result<()> {
    // SAFETY: `x` is a live `at::Tensor` C++ lends for this call; the new tch
    // tensor is a second handle to it (its reference count raised), owned and
    // dropped here.
    #[allow(unsafe_code)]
    let x = unsafe { Tensor::clone_from_ptr(std::ptr::from_ref(x).cast_mut().cast()) };
    let y = (part.run)(&x)?;
    out.set(as_at(&y));
    Ok(())
}

/// `run(x)` as one checkpointed part whose parameters are `params`: when
/// autograd records, its activations are not kept, and the backward pass runs
/// it again (with the random generators as they were) to compute the gradients
/// of `x` and of `params`. `params` must be every tensor requiring gradients
/// that `run` reads, else they get none. Without autograd recording, a plain
/// call.
pub fn checkpoint(
    x: &Tensor,
    params: &[Tensor],
    run: impl Fn(&Tensor) -> Result<Tensor> + Send + 'static,
) -> Result<Tensor> {
    let mut list = ffi::new_param_list();
    for p in params {
        list.pin_mut().push(as_at(p));
    }
    let part = Box::new(Recompute { run: Box::new(run) });
    let out = ffi::checkpointed(as_at(x), &list, part)
        .map_err(|e| Error::backend("torch", "a checkpointed part of the model", e.what()))?;
    from_at(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn part(w: &Tensor, x: &Tensor) -> Result<Tensor> {
        Ok(x.matmul(w)
            .tanh()
            .dropout(0.5, true)
            .matmul(w)
            .sum(Kind::Float))
    }

    /// The gradients of a checkpointed part equal an ordinary run's, bit for
    /// bit, dropout included; an error of the part in either run is an error.
    #[test]
    fn gradients_equal_an_ordinary_run() -> Result<()> {
        let w = Tensor::randn([6, 6], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x0 = Tensor::randn([4, 6], (Kind::Float, Device::Cpu));
        let grads = |checkpointed: bool| -> Result<(Tensor, Tensor, Tensor)> {
            let x = x0.copy().set_requires_grad(true);
            tch::manual_seed(3);
            let y = if checkpointed {
                let wc = w.shallow_clone();
                checkpoint(&x, &[w.shallow_clone()], move |x| part(&wc, x))?
            } else {
                part(&w, &x)?
            };
            // Draws after the part: the second run must not change them.
            let after = Tensor::rand([3], (Kind::Float, Device::Cpu));
            w.shallow_clone().zero_grad();
            y.backward();
            Ok((x.grad(), w.grad().copy(), after))
        };
        let (gx, gw, r) = grads(false)?;
        let (cx, cw, cr) = grads(true)?;
        assert!(gx.equal(&cx), "input gradient");
        assert!(gw.equal(&cw), "weight gradient");
        assert!(r.equal(&cr), "the generator after the part");

        // Without autograd, a plain call.
        let y = tch::no_grad(|| {
            let wc = w.shallow_clone();
            checkpoint(&x0, &[w.shallow_clone()], move |x| part(&wc, x))
        })?;
        assert!(!y.requires_grad());

        // A part that fails, in the forward pass.
        let err = checkpoint(&x0, &[w.shallow_clone()], |_| {
            Err(Error::invalid_argument("part", "refused"))
        })
        .unwrap_err();
        assert!(err.display_chain().to_string().contains("refused"), "{err}");
        Ok(())
    }
}
