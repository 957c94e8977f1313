//! Sharded units: the part of a model that fully sharded data parallelism
//! (PyTorch's FSDP) gathers, runs and frees as one. Between steps each rank
//! holds a shard of the unit's parameters; a unit's forward pass gathers the
//! whole parameters, runs the part and, with `reshard_after_forward`, frees
//! them at once; its backward pass gathers them again, computes the part's
//! gradients and hands the full parameter gradients to the strategy, which
//! reduce-scatters them into the shards, and frees the parameters. Only one
//! unit's full parameters need exist at a time.
//!
//! The collectives are the strategy's ([`UnitCollectives`], kiln-c10d's); the
//! graph node is C++ (`src/sharded_unit.cc`, a `torch::autograd::Function`
//! that runs the part's own graph inside it), and frees a gathered parameter's
//! memory while keeping the tensor, so that the part's saved references stay
//! valid and the second gather fills the same memory.

use std::pin::Pin;
use std::sync::Arc;

use kiln_core::{Error, Result};
use tch::Tensor;

use crate::cxx_tensor::{as_at, from_at, AtTensor};

#[allow(unsafe_code)]
mod bridge {
    use super::{unit_gather, unit_reduce, unit_run, UnitPart};

    #[cxx::bridge(namespace = "kiln::torch")]
    pub(super) mod ffi {
        extern "Rust" {
            type UnitPart;
            fn unit_gather(part: &UnitPart, out: Pin<&mut UnitTensors>) -> Result<()>;
            fn unit_run(
                part: &UnitPart,
                x: &Tensor,
                params: &UnitTensors,
                out: Pin<&mut UnitOutput>,
            ) -> Result<()>;
            fn unit_reduce(part: &UnitPart, grads: &UnitTensors) -> Result<()>;
        }

        // SAFETY: the declarations match include/sharded_unit.h (cxx checks the
        // signatures at compile time); `sharded_unit` returns `Result`, so a C++
        // exception (or the part's error, thrown back through it) comes back as
        // an error instead of unwinding into Rust.
        unsafe extern "C++" {
            include!("kiln-torch/include/sharded_unit.h");

            #[namespace = "at"]
            type Tensor = crate::cxx_tensor::AtTensor;

            type UnitTensors;
            fn push(self: Pin<&mut UnitTensors>, tensor: &Tensor);
            fn len(self: &UnitTensors) -> usize;
            fn defined(self: &UnitTensors, i: usize) -> bool;
            fn get(self: &UnitTensors, i: usize) -> &Tensor;

            type UnitOutput;
            fn set(self: Pin<&mut UnitOutput>, tensor: &Tensor);

            fn sharded_unit(
                x: &Tensor,
                reshard_after_forward: bool,
                part: Box<UnitPart>,
            ) -> Result<UniquePtr<Tensor>>;
            fn sharded_unit_bytes_held() -> i64;
            fn accumulate_grad(param: &Tensor, grad: &Tensor) -> Result<()>;
        }
    }
}

use bridge::ffi;

/// How a sharded unit's parameters are gathered and its gradients reduced:
/// the strategy's side (kiln-c10d's full sharding), called by the unit's
/// forward and backward passes on every rank in the same order.
pub trait UnitCollectives: Send + Sync {
    /// The unit's whole parameters, gathered from every rank's shard, in the
    /// unit's order. Each should own its memory (a view into a shared buffer
    /// is copied once more, so that freeing it frees it).
    fn gather(&self) -> Result<Vec<Tensor>>;

    /// The gradients of the whole parameters after the unit's backward pass,
    /// in the unit's order (`None`: the pass did not reach that parameter), to
    /// reduce into this rank's shards.
    fn reduce(&self, grads: Vec<Option<Tensor>>) -> Result<()>;
}

/// What a sharded unit computes from its input and its whole parameters.
type Part = Box<dyn Fn(&Tensor, &[Tensor]) -> Result<Tensor> + Send>;

/// A sharded unit's part and collectives, owned by its graph node.
pub struct UnitPart {
    run: Part,
    collectives: Arc<dyn UnitCollectives>,
}

/// A second handle to a tensor C++ lends for the call.
fn borrowed(t: &AtTensor) -> Tensor {
    // SAFETY: `t` is a live `at::Tensor` C++ lends for this call; the new tch
    // tensor is a second handle to it (its reference count raised), owned and
    // dropped by the caller.
    #[allow(unsafe_code)]
    unsafe {
        Tensor::clone_from_ptr(std::ptr::from_ref(t).cast_mut().cast())
    }
}

/// Called by the graph node: the gather.
fn unit_gather(part: &UnitPart, mut out: Pin<&mut ffi::UnitTensors>) -> Result<()> {
    for t in part.collectives.gather()? {
        out.as_mut().push(as_at(&t));
    }
    Ok(())
}

/// Called by the graph node: the part, on the gathered parameters.
fn unit_run(
    part: &UnitPart,
    x: &AtTensor,
    params: &ffi::UnitTensors,
    out: Pin<&mut ffi::UnitOutput>,
) -> Result<()> {
    let params: Vec<Tensor> = (0..params.len()).map(|i| borrowed(params.get(i))).collect();
    let y = (part.run)(&borrowed(x), &params)?;
    out.set(as_at(&y));
    Ok(())
}

/// Called by the graph node: the reduction of the gradients.
fn unit_reduce(part: &UnitPart, grads: &ffi::UnitTensors) -> Result<()> {
    let grads = (0..grads.len())
        .map(|i| grads.defined(i).then(|| borrowed(grads.get(i))))
        .collect();
    part.collectives.reduce(grads)
}

/// `run(x, params)` as one sharded unit: `params` are gathered by
/// `collectives` for the call. When autograd records, the result's backward
/// pass gathers them again (when `reshard_after_forward` freed them after the
/// forward pass), computes the gradients of `x` and of the whole parameters,
/// and passes the latter to [`UnitCollectives::reduce`]. Without autograd:
/// gather, run, and drop the parameters.
///
/// `run` must read its trainable tensors from `params` only: a tensor it
/// captures gets no gradient here.
pub fn sharded_unit(
    x: &Tensor,
    collectives: Arc<dyn UnitCollectives>,
    reshard_after_forward: bool,
    run: impl Fn(&Tensor, &[Tensor]) -> Result<Tensor> + Send + 'static,
) -> Result<Tensor> {
    let part = Box::new(UnitPart {
        run: Box::new(run),
        collectives,
    });
    let out = ffi::sharded_unit(as_at(x), reshard_after_forward, part)
        .map_err(|e| Error::backend("torch", "a sharded unit of the model", e.what()))?;
    from_at(out)
}

/// Bytes of whole (gathered) parameters this process's sharded units hold
/// now: between a unit's gather and its release.
pub fn sharded_unit_bytes_held() -> i64 {
    ffi::sharded_unit_bytes_held()
}

/// Adds `grad` into `param`'s `.grad`, or sets it to a copy of `grad` when it
/// has none, as autograd accumulates into a leaf: how a strategy hands a
/// parameter shard its reduced gradient (tch cannot set `.grad`). A shape,
/// dtype or device that is not `param`'s is an error, and nothing changes.
pub fn accumulate_grad(param: &Tensor, grad: &Tensor) -> Result<()> {
    ffi::accumulate_grad(as_at(param), as_at(grad))
        .map_err(|e| Error::backend("torch", "accumulating a gradient", e.what()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tch::{Device, Kind};

    /// One rank's collectives: the "shards" are the whole parameters; every
    /// gather copies them, every reduction is kept.
    struct Local {
        params: Mutex<Vec<Tensor>>,
        gathers: Mutex<usize>,
        reduced: Mutex<Vec<Vec<Option<Tensor>>>>,
        fail_reduce: bool,
    }

    impl UnitCollectives for Local {
        fn gather(&self) -> Result<Vec<Tensor>> {
            *self.gathers.lock().unwrap() += 1;
            Ok(self
                .params
                .lock()
                .unwrap()
                .iter()
                .map(Tensor::copy)
                .collect())
        }
        fn reduce(&self, grads: Vec<Option<Tensor>>) -> Result<()> {
            if self.fail_reduce {
                return Err(Error::invalid_argument("reduce", "refused"));
            }
            self.reduced.lock().unwrap().push(grads);
            Ok(())
        }
    }

    fn local(params: &[Tensor], fail_reduce: bool) -> Arc<Local> {
        Arc::new(Local {
            params: Mutex::new(params.iter().map(Tensor::copy).collect()),
            gathers: Mutex::new(0),
            reduced: Mutex::new(Vec::new()),
            fail_reduce,
        })
    }

    /// The tests read the process's count of bytes held: one at a time.
    static TURN: Mutex<()> = Mutex::new(());

    fn turn() -> std::sync::MutexGuard<'static, ()> {
        TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Two linear layers with a nonlinearity between them; the third
    /// parameter is unused.
    fn part(x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
        Ok(x.matmul(&p[0]).tanh().matmul(&p[1]))
    }

    /// The gradients a sharded unit reduces equal an ordinary run's parameter
    /// gradients, bit for bit, with and without resharding after the forward
    /// pass; the input's gradient too; the gathered parameters are released
    /// after the backward pass (and after the forward pass when resharding).
    #[test]
    fn gradients_equal_an_ordinary_run() -> Result<()> {
        let _turn = turn();
        let opts = (Kind::Float, Device::Cpu);
        let params = [
            Tensor::randn([5, 7], opts),
            Tensor::randn([7, 3], opts),
            Tensor::randn([2], opts),
        ];
        let x0 = Tensor::randn([4, 5], opts);

        let plain: Vec<Tensor> = params
            .iter()
            .map(|p| p.copy().set_requires_grad(true))
            .collect();
        let x = x0.copy().set_requires_grad(true);
        part(&x, &plain)?.sin().sum(Kind::Float).backward();
        let (gx, gp) = (x.grad(), [plain[0].grad(), plain[1].grad()]);

        for reshard in [true, false] {
            let held_before = sharded_unit_bytes_held();
            let c = local(&params, false);
            let x = x0.copy().set_requires_grad(true);
            let y = sharded_unit(&x, c.clone(), reshard, part)?;
            let held = sharded_unit_bytes_held() - held_before;
            assert_eq!(
                held,
                if reshard { 0 } else { 4 * (35 + 21 + 2) },
                "held after forward"
            );
            y.sin().sum(Kind::Float).backward();
            assert_eq!(
                sharded_unit_bytes_held(),
                held_before,
                "held after backward"
            );
            assert_eq!(*c.gathers.lock().unwrap(), if reshard { 2 } else { 1 });
            let reduced = c.reduced.lock().unwrap();
            assert_eq!(reduced.len(), 1, "one reduction per backward pass");
            let g = &reduced[0];
            assert!(
                g[0].as_ref().is_some_and(|g| g.equal(&gp[0])),
                "first weight"
            );
            assert!(
                g[1].as_ref().is_some_and(|g| g.equal(&gp[1])),
                "second weight"
            );
            assert!(g[2].is_none(), "the unused parameter gets no gradient");
            assert!(x.grad().equal(&gx), "input gradient");
        }
        Ok(())
    }

    /// A unit whose part is also checkpointed (FSDP with activation
    /// checkpointing): the recomputation in the backward pass reads the
    /// parameters gathered again, and the gradients are an ordinary run's.
    #[test]
    fn a_checkpointed_part_inside_a_unit() -> Result<()> {
        let _turn = turn();
        let opts = (Kind::Float, Device::Cpu);
        let params = [Tensor::randn([5, 7], opts), Tensor::randn([7, 3], opts)];
        let x0 = Tensor::randn([4, 5], opts);
        let plain: Vec<Tensor> = params
            .iter()
            .map(|p| p.copy().set_requires_grad(true))
            .collect();
        part(&x0, &plain)?.sin().sum(Kind::Float).backward();

        let held_before = sharded_unit_bytes_held();
        let c = local(&params, false);
        let y = sharded_unit(&x0, c.clone(), true, |x, p| {
            let p: Vec<Tensor> = p.iter().map(Tensor::shallow_clone).collect();
            let inner: Vec<Tensor> = p.iter().map(Tensor::shallow_clone).collect();
            crate::checkpoint::checkpoint(x, &p, move |x| part(x, &inner))
        })?;
        y.sin().sum(Kind::Float).backward();
        assert_eq!(sharded_unit_bytes_held(), held_before);
        let reduced = c.reduced.lock().unwrap();
        for (i, p) in plain.iter().enumerate() {
            assert!(
                reduced[0][i].as_ref().is_some_and(|g| g.equal(&p.grad())),
                "parameter {i}"
            );
        }
        Ok(())
    }

    /// The first unit of a model sees an input that needs no gradient: its
    /// parameters get theirs all the same; integer inputs (token ids) work.
    #[test]
    fn parameters_get_gradients_when_the_input_needs_none() -> Result<()> {
        let _turn = turn();
        let opts = (Kind::Float, Device::Cpu);
        let table = Tensor::randn([10, 4], opts);
        let c = local(&[table.shallow_clone()], false);
        let ids = Tensor::from_slice(&[1i64, 3, 3, 9]);
        let y = sharded_unit(&ids, c.clone(), true, |ids, p| {
            Ok(Tensor::embedding(&p[0], ids, -1, false, false))
        })?;
        y.sum(Kind::Float).backward();
        let reduced = c.reduced.lock().unwrap();
        let g = reduced[0][0].as_ref().expect("the table's gradient");
        let counts: Vec<f32> = Vec::try_from(g.sum_dim_intlist(1, false, Kind::Float)).unwrap();
        assert_eq!(counts, [0., 4., 0., 8., 0., 0., 0., 0., 0., 4.]);
        Ok(())
    }

    /// Errors of the part, of the gather and of the reduction are errors;
    /// nothing stays held. Without autograd the unit is a plain call.
    #[test]
    fn failures_are_errors_and_no_grad_is_a_plain_call() -> Result<()> {
        let _turn = turn();
        let opts = (Kind::Float, Device::Cpu);
        let params = [Tensor::randn([3, 3], opts), Tensor::randn([3, 3], opts)];
        let x = Tensor::randn([2, 3], opts);
        let held_before = sharded_unit_bytes_held();

        let err = sharded_unit(&x, local(&params, false), true, |_, _| {
            Err(Error::invalid_argument("part", "refused"))
        })
        .err()
        .map(|e| e.display_chain().to_string());
        assert!(
            err.as_ref().is_some_and(|m| m.contains("refused")),
            "the part's error: {err:?}"
        );
        assert_eq!(sharded_unit_bytes_held(), held_before);

        let y = sharded_unit(&x, local(&params, true), true, part)?;
        let err = y.sum(Kind::Float).f_backward().err().map(|e| e.to_string());
        assert!(
            err.is_some_and(|m| m.contains("refused")),
            "the reduction's error"
        );
        assert_eq!(sharded_unit_bytes_held(), held_before);

        let c = local(&params, false);
        let y = tch::no_grad(|| sharded_unit(&x, c.clone(), true, part))?;
        assert!(!y.requires_grad());
        assert!(y.equal(&part(&x, &params)?));
        assert_eq!(*c.gathers.lock().unwrap(), 1);
        assert_eq!(sharded_unit_bytes_held(), held_before);
        Ok(())
    }

    #[test]
    fn accumulate_grad_sets_then_adds_and_checks_the_shape() -> Result<()> {
        let p = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let g = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([2, 3]);
        accumulate_grad(&p, &g)?;
        assert!(p.grad().equal(&g));
        // A copy: changing `g` leaves `.grad` as it was.
        let _ = g.shallow_clone().f_mul_scalar_(10.0);
        accumulate_grad(&p, &Tensor::ones([2, 3], (Kind::Float, Device::Cpu)))?;
        let want = Tensor::from_slice(&[2.0f32, 3.0, 4.0, 5.0, 6.0, 7.0]).view([2, 3]);
        assert!(p.grad().equal(&want));
        let err = accumulate_grad(&p, &Tensor::ones([3, 2], (Kind::Float, Device::Cpu)))
            .err()
            .map(|e| e.display_chain().to_string());
        assert!(
            err.as_ref()
                .is_some_and(|m| m.contains("[3, 2]") && m.contains("[2, 3]")),
            "{err:?}"
        );
        assert!(p.grad().equal(&want));
        Ok(())
    }
}
