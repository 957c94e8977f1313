//! Data-parallel training on the TensorFlow backend, over any
//! [`Collectives`] group (in practice kiln-c10d's Gloo group, which this
//! crate only sees as `Arc<dyn Collectives>`): [`GradientAllReduce`], the
//! [`StepHooks`] of [`DataParallel`](kiln_core::strategy::DataParallel) around a
//! [`TfModel`], and how a model's variables travel between ranks. The model
//! itself knows nothing of ranks.
//!
//! The training step itself is [`TfOptimizer`](crate::TfOptimizer)'s
//! (`optim/data_parallel.rs`): its program fetches the gradients of every
//! parameter and the loss as **one** flat float32 vector; that vector is
//! all-reduced in place, in the memory TensorFlow allocated for it, and fed
//! back, the same tensor, to the program that clips and applies it.
//!
//! Variables travel as one flat `f32` buffer per broadcast: float32 values as
//! they are, other dtypes (batch norm's int64 `num_batches_tracked`) as their
//! bytes, two per element, each element an integer in `0..=65535`. Those are
//! exact in `f32`, so every dtype arrives bit for bit without relying on how
//! any layer treats float bit patterns.

use std::fmt;
use std::sync::{Arc, Mutex};

use kiln_core::{
    distributed::{Collectives, CommBackend, DistributedOptions, ReduceOp},
    model::ParamKind,
    strategy::{DataParallel, StepHooks},
    DType, Error, HostTensor, Result,
};

use crate::backend::TfBackend;
use crate::engine::Var;
use crate::model::{lock, TfModel};
use crate::step::CompiledGraph;

/// The context of the errors raised here.
const CONTEXT: &str = "data-parallel TensorFlow training";

/// A [`TfModel`] kept identical across the ranks of a group, with
/// `DistributedDataParallel`'s semantics:
///
/// - at construction every rank checks that it has rank 0's variables (names,
///   dtypes, shapes), then takes rank 0's parameters and buffers;
/// - before each training forward pass (with `broadcast_buffers`, the
///   default) the buffers (batch-norm running statistics) are rank 0's again,
///   so that every rank's statistics are rank 0's updated by its own rows.
/// - every micro-batch's gradients (flat, with the loss) are averaged over the
///   ranks in place before the update, and only the loss on the micro-batches
///   gradient accumulation does not apply.
pub struct GradientAllReduce {
    group: Arc<dyn Collectives>,
    broadcast_buffers: bool,
    /// The model's buffers, in state-dict order.
    buffers: Vec<Var>,
    /// The model's session, where the buffers are read and written.
    graph: Arc<Mutex<CompiledGraph>>,
    /// The buffers' values before this micro-batch's forward pass, when it
    /// broadcast them: what a skipped micro-batch restores.
    snapshot: Option<Vec<HostTensor>>,
}

impl fmt::Debug for GradientAllReduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GradientAllReduce")
            .field("rank", &self.group.rank())
            .field("world_size", &self.group.world_size())
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("buffers", &self.buffers.len())
            .finish_non_exhaustive()
    }
}

impl GradientAllReduce {
    /// Checks that every rank has rank 0's variables, then gives every rank
    /// rank 0's parameters and buffers (one session run on rank 0 to read
    /// them, one broadcast, one run on the others to write them). Call it on
    /// every rank, before building the optimizer.
    ///
    /// Errors on every rank alike when some rank's variables differ, when the
    /// options ask for NCCL (TensorFlow trains on the CPU here), or when a
    /// parameter is not float32 (gradients are averaged as float32).
    pub fn new(
        model: &TfModel,
        group: Arc<dyn Collectives>,
        options: &DistributedOptions,
    ) -> Result<Self> {
        if options.backend == CommBackend::Nccl {
            return Err(Error::invalid_argument(
                "distributed.backend",
                "nccl reduces CUDA tensors, and the TensorFlow backend trains on the CPU: use \
                 \"gloo\" (or \"auto\")",
            ));
        }
        if group.rank() >= group.world_size() {
            return Err(Error::distributed(
                CONTEXT,
                format!(
                    "the group's rank {} is not below its world size {}",
                    group.rank(),
                    group.world_size()
                ),
            ));
        }
        if let Some(var) = model
            .vars
            .iter()
            .find(|v| v.kind == ParamKind::Parameter && v.dtype != DType::F32)
        {
            return Err(Error::DTypeMismatch {
                context: format!(
                    "parameter `{}` of a data-parallel TensorFlow model (gradients are \
                     averaged over the ranks as float32)",
                    var.name
                ),
                expected: DType::F32,
                actual: var.dtype,
            });
        }
        check_same_variables(group.as_ref(), &model.vars)?;
        let all: Vec<&Var> = model.vars.iter().collect();
        broadcast_vars(group.as_ref(), &model.graph, &all, 0)?;
        let buffers: Vec<Var> = model
            .vars
            .iter()
            .filter(|v| v.kind == ParamKind::Buffer)
            .cloned()
            .collect();
        log::info!(
            "data-parallel TensorFlow model: rank {} of {}, {} variables ({} buffers) from rank 0",
            group.rank(),
            group.world_size(),
            model.vars.len(),
            buffers.len()
        );
        Ok(GradientAllReduce {
            group,
            broadcast_buffers: options.broadcast_buffers,
            buffers,
            graph: Arc::clone(&model.graph),
            snapshot: None,
        })
    }

    /// Rank 0's buffers to every rank now (nothing when the model has none),
    /// returning the values every rank now holds.
    fn broadcast_buffers_now(&self) -> Result<Vec<HostTensor>> {
        if self.buffers.is_empty() {
            return Ok(Vec::new());
        }
        let buffers: Vec<&Var> = self.buffers.iter().collect();
        broadcast_vars(self.group.as_ref(), &self.graph, &buffers, 0)
    }
}

/// `model` wrapped to train data-parallel over `group` ([`GradientAllReduce::new`],
/// then [`DataParallel::new`]): rank 0's variables on every rank now, the
/// gradients averaged over the ranks in every step. Call it on every rank,
/// before building the optimizer.
///
/// With `broadcast_buffers` off, a micro-batch skipped because the loss of
/// another rank was not finite still updated the batch-norm statistics of the
/// ranks whose own loss was finite (as PyTorch's forward pass always does);
/// with it on, they are restored. `bucket_cap_mb` does not apply (the gradients
/// of a step travel as one buffer, after the session run that computes them),
/// nor does `find_unused_parameters` (the graph says which parameters have a
/// gradient, the same on every rank).
pub fn data_parallel(
    model: TfModel,
    group: Arc<dyn Collectives>,
    options: &DistributedOptions,
) -> Result<DataParallel<TfModel, GradientAllReduce>> {
    let sync = GradientAllReduce::new(&model, group, options)?;
    DataParallel::new(model, sync)
}

impl StepHooks<TfBackend> for GradientAllReduce {
    fn name(&self) -> &str {
        "DataParallel"
    }

    fn needs_gradients(&self) -> bool {
        true
    }

    fn agrees_on_loss(&self) -> bool {
        true
    }

    /// With `broadcast_buffers`, rank 0's buffers to every rank, kept as the
    /// values the pass starts from.
    fn before_forward(&mut self, _sync: bool) -> Result<()> {
        self.snapshot = None;
        if self.broadcast_buffers && !self.buffers.is_empty() {
            self.snapshot = Some(self.broadcast_buffers_now()?);
        }
        Ok(())
    }

    fn reduce_flat(&mut self, flat: &mut [f32], sync: bool) -> Result<()> {
        if sync {
            self.group.all_reduce_f32(flat, ReduceOp::Mean)
        } else {
            let last = flat.len().saturating_sub(1);
            self.group.all_reduce_f32(&mut flat[last..], ReduceOp::Mean)
        }
    }

    /// The buffers back to what [`before_forward`](StepHooks::before_forward)
    /// broadcast, undoing the statistics update of a rank whose own loss was
    /// finite. Without a snapshot (no buffers, or `broadcast_buffers` off)
    /// nothing is done.
    fn skipped(&mut self) -> Result<()> {
        let Some(values) = self.snapshot.take() else {
            return Ok(());
        };
        let vars: Vec<&Var> = self.buffers.iter().collect();
        let refs: Vec<&HostTensor> = values.iter().collect();
        lock(&self.graph)?.engine.write_vars(&vars, &refs)
    }

    /// Rank 0's buffers (batch-norm running statistics) to every rank now, in
    /// one broadcast: what makes every rank's evaluation identical.
    fn sync_buffers(&mut self) -> Result<()> {
        self.broadcast_buffers_now().map(|_| ())
    }

    fn collectives(&self) -> Option<Arc<dyn Collectives>> {
        Some(Arc::clone(&self.group))
    }
}

/// Rank `root`'s values of `vars` to every rank, in one broadcast: `root`
/// reads them (one session run) and the others write them (one run). Returns
/// the values every rank now holds.
pub(crate) fn broadcast_vars(
    group: &dyn Collectives,
    graph: &Mutex<CompiledGraph>,
    vars: &[&Var],
    root: usize,
) -> Result<Vec<HostTensor>> {
    let from = root;
    let root = group.rank() == from;
    let total: usize = vars.iter().map(|v| words(v)).sum();
    let mut buffer = Vec::with_capacity(total);
    let mine = if root {
        let owned: Vec<Var> = vars.iter().map(|v| (*v).clone()).collect();
        let values = lock(graph)?.engine.read_vars(&owned)?;
        pack(&values, &mut buffer)?;
        Some(values)
    } else {
        buffer.resize(total, 0.0);
        None
    };
    if buffer.len() != total {
        return Err(Error::distributed(
            CONTEXT,
            format!("packed {} words for variables of {total}", buffer.len()),
        ));
    }
    // The lock is not held here: a collective may wait for the other ranks.
    group.broadcast_f32(&mut buffer, from)?;
    if let Some(values) = mine {
        return Ok(values);
    }
    let values = unpack(&buffer, vars)?;
    let refs: Vec<&HostTensor> = values.iter().collect();
    lock(graph)?.engine.write_vars(vars, &refs)?;
    Ok(values)
}

/// The `f32` words a variable takes in a broadcast buffer (see the module docs).
fn words(var: &Var) -> usize {
    let numel: usize = var.dims.iter().product();
    if var.dtype == DType::F32 {
        numel
    } else {
        (numel * var.dtype.size_in_bytes()).div_ceil(2)
    }
}

/// Appends `values` to `out` as broadcast words.
fn pack(values: &[HostTensor], out: &mut Vec<f32>) -> Result<()> {
    for value in values {
        if value.dtype() == DType::F32 {
            out.extend_from_slice(value.as_slice::<f32>()?);
        } else {
            out.extend(value.as_bytes().chunks(2).map(|pair| {
                let lo = pair.first().copied().unwrap_or(0);
                let hi = pair.get(1).copied().unwrap_or(0);
                f32::from(u16::from_le_bytes([lo, hi]))
            }));
        }
    }
    Ok(())
}

/// The values of `vars` from broadcast words.
fn unpack(words_in: &[f32], vars: &[&Var]) -> Result<Vec<HostTensor>> {
    let mut at = 0usize;
    let mut values = Vec::with_capacity(vars.len());
    for var in vars {
        let n = words(var);
        let chunk = words_in.get(at..at + n).ok_or_else(|| {
            Error::distributed(
                CONTEXT,
                format!(
                    "the broadcast buffer ends before variable `{}` ({} words)",
                    var.name,
                    words_in.len()
                ),
            )
        })?;
        at += n;
        let value = if var.dtype == DType::F32 {
            HostTensor::from_slice(chunk, var.dims.clone())?
        } else {
            let mut bytes = Vec::with_capacity(2 * n);
            for &w in chunk {
                let half = w as u16;
                if f32::from(half) != w {
                    return Err(Error::distributed(
                        CONTEXT,
                        format!(
                            "variable `{}` arrived with {w} where two bytes were expected",
                            var.name
                        ),
                    ));
                }
                bytes.extend_from_slice(&half.to_le_bytes());
            }
            let numel: usize = var.dims.iter().product();
            bytes.truncate(numel * var.dtype.size_in_bytes());
            HostTensor::from_bytes(var.dtype, var.dims.clone(), &bytes)?
        };
        values.push(value);
    }
    Ok(values)
}

/// A 64-bit FNV-1a hash of the variables' names, kinds, dtypes and shapes.
fn fingerprint(vars: &[Var]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for var in vars {
        eat(var.name.as_bytes());
        eat(&[0, u8::from(var.kind == ParamKind::Buffer)]);
        eat(var.dtype.name().as_bytes());
        for &d in &var.dims {
            eat(&(d as u64).to_le_bytes());
        }
        eat(&[0xff]);
    }
    hash
}

/// Every rank compares its variables with rank 0's (one broadcast of a
/// fingerprint, one all-reduce of who differs), so that all ranks fail
/// together, naming the ranks that differ, before any state moves.
fn check_same_variables(group: &dyn Collectives, vars: &[Var]) -> Result<()> {
    let encode =
        |x: u64| -> [f32; 4] { [0, 16, 32, 48].map(|shift| f32::from((x >> shift) as u16)) };
    let mine = encode(fingerprint(vars));
    let mut rank0 = mine;
    group.broadcast_f32(&mut rank0, 0)?;
    let mut differs = vec![0f32; group.world_size()];
    if let Some(flag) = differs.get_mut(group.rank()) {
        *flag = if rank0 == mine { 0.0 } else { 1.0 };
    }
    group.all_reduce_f32(&mut differs, ReduceOp::Sum)?;
    let ranks: Vec<usize> = differs
        .iter()
        .enumerate()
        .filter(|(_, &flag)| flag != 0.0)
        .map(|(rank, _)| rank)
        .collect();
    if ranks.is_empty() {
        return Ok(());
    }
    Err(Error::distributed(
        CONTEXT,
        format!(
            "rank(s) {ranks:?} do not have rank 0's variables (names, dtypes or shapes); \
             every rank must build the same model (this is rank {}, with {} variables)",
            group.rank(),
            vars.len()
        ),
    ))
}

#[cfg(test)]
mod tests {
    //! Packing: every dtype survives the trip through `f32` words bit for bit.

    use super::*;

    #[test]
    fn words_round_trip_every_dtype() -> Result<()> {
        let mut engine = crate::engine::Engine::new();
        let f = engine.add_var("t", "f", DType::F32, &[3], ParamKind::Parameter)?;
        let i = engine.add_var("t", "i", DType::I64, &[], ParamKind::Buffer)?;
        let u = engine.add_var("t", "u", DType::U8, &[3], ParamKind::Buffer)?;
        let values = [
            HostTensor::new(vec![f32::NAN, -0.0, 1e-40], [3])?,
            HostTensor::scalar(-123_456_789_012_345i64),
            HostTensor::new(vec![1u8, 255, 7], [3])?,
        ];
        let mut buffer = Vec::new();
        pack(&values, &mut buffer)?;
        assert_eq!(buffer.len(), 3 + 4 + 2);
        assert_eq!(buffer.len(), words(&f) + words(&i) + words(&u));
        let back = unpack(&buffer, &[&f, &i, &u])?;
        for (a, b) in values.iter().zip(&back) {
            assert_eq!(a.dtype(), b.dtype());
            assert_eq!(a.dims(), b.dims());
            assert_eq!(a.as_bytes(), b.as_bytes());
        }
        // A word that is not two bytes is an error naming the variable.
        buffer[3] = 0.5;
        let err = unpack(&buffer, &[&f, &i, &u]).err().map(|e| e.to_string());
        assert!(err.is_some_and(|m| m.contains("`i`")));
        Ok(())
    }

    #[test]
    fn fingerprints_see_names_and_shapes() -> Result<()> {
        let mut engine = crate::engine::Engine::new();
        let a = engine.add_var("t", "w", DType::F32, &[2, 3], ParamKind::Parameter)?;
        let b = engine.add_var("t", "w2", DType::F32, &[3, 2], ParamKind::Parameter)?;
        let c = engine.add_var("t", "w3", DType::F32, &[2, 3], ParamKind::Parameter)?;
        let mut renamed = c.clone();
        renamed.name = "w".to_owned();
        let mut reshaped = b.clone();
        reshaped.name = "w".to_owned();
        let one = fingerprint(std::slice::from_ref(&a));
        assert_eq!(one, fingerprint(&[renamed]));
        assert_ne!(one, fingerprint(&[reshaped]));
        assert_ne!(one, fingerprint(&[a.clone(), a]));
        Ok(())
    }
}
