//! Full sharding's layout: each parameter cut along its first dimension into
//! one equal, zero-padded shard per rank (PyTorch's `fully_shard`), and each
//! unit's collectives over its parameters' shards.

use std::sync::{Arc, OnceLock, Weak};

use kiln_core::distributed::ReduceOp;
use kiln_core::state_tensors::RowSlice;
use kiln_core::{Error, HostTensor, Result};
use kiln_torch::sharded_unit::{accumulate_grad, UnitCollectives};
use kiln_torch::{from_tch, to_tch, torch_error};
use tch::{Kind, Tensor};

use super::prefetch::GatherSchedule;
use crate::group::PendingAllGather;
use crate::step_shared::StepShared;
use crate::ProcessGroup;

/// One parameter and where its rows live: rank `r` holds rows
/// `[r * shard_rows, (r + 1) * shard_rows)` of the whole, the ones past the
/// end as zeros. A 0-dimensional parameter is one row.
#[derive(Debug)]
pub(crate) struct ParamShard {
    pub(crate) name: String,
    /// The model's parameter tensor: this rank's shard, once sharded.
    pub(crate) param: StepShared<Tensor>,
    /// The whole parameter's shape.
    pub(crate) full_shape: Vec<i64>,
    /// The whole parameter's rows (its first dimension; 1 when it has none).
    pub(crate) rows: i64,
    /// Rows of every rank's shard.
    pub(crate) shard_rows: i64,
    /// Elements of one row.
    pub(crate) row_numel: i64,
    /// Whether it trains (requires gradients).
    pub(crate) trained: bool,
}

impl ParamShard {
    /// The layout of the whole parameter `param` over `world` ranks.
    pub(crate) fn plan(name: &str, param: &Tensor, world: usize) -> Self {
        let full_shape = param.size();
        let rows = full_shape.first().copied().unwrap_or(1);
        let numel = param.numel() as i64;
        let row_numel = if rows == 0 { 0 } else { numel / rows };
        let world = world as i64;
        ParamShard {
            name: name.to_owned(),
            param: StepShared::new(param.shallow_clone()),
            full_shape,
            rows,
            shard_rows: (rows + world - 1) / world,
            row_numel,
            trained: param.requires_grad(),
        }
    }

    /// The shape of every rank's shard.
    pub(crate) fn shard_shape(&self) -> Vec<i64> {
        let mut shape = self.full_shape.clone();
        match shape.first_mut() {
            Some(d0) => *d0 = self.shard_rows,
            None => shape.push(self.shard_rows),
        }
        shape
    }

    /// Elements of every rank's shard.
    pub(crate) fn shard_numel(&self) -> i64 {
        self.shard_rows * self.row_numel
    }

    /// The rows of the whole that rank `rank` holds (the rest of its shard is
    /// padding).
    pub(crate) fn rows_of(&self, rank: usize) -> i64 {
        let start = rank as i64 * self.shard_rows;
        (self.rows - start).clamp(0, self.shard_rows)
    }

    /// Rank `rank`'s shard of `whole` (a tensor of the whole parameter's
    /// shape): a new tensor, zero-padded.
    pub(crate) fn cut(&self, whole: &Tensor, rank: usize) -> Result<Tensor> {
        let fail = |e| torch_error("cutting a parameter's shard", e);
        let shard = Tensor::f_zeros(
            self.shard_shape().as_slice(),
            (whole.kind(), whole.device()),
        )
        .map_err(fail)?;
        let n = self.rows_of(rank);
        if n > 0 {
            let rows = whole
                .f_reshape([self.rows, self.row_numel])
                .map_err(fail)?
                .narrow(0, rank as i64 * self.shard_rows, n);
            tch::no_grad(|| {
                shard
                    .f_view([self.shard_rows, self.row_numel])
                    .and_then(|v| v.narrow(0, 0, n).f_copy_(&rows))
            })
            .map_err(fail)?;
        }
        Ok(shard)
    }

    /// The whole parameter from `gathered`, every rank's flat buffer of
    /// `stride` elements one after the other, in which this parameter's
    /// shard starts at `offset`: a new tensor of the whole shape.
    pub(crate) fn assemble(
        &self,
        gathered: &Tensor,
        world: usize,
        stride: i64,
        offset: i64,
    ) -> Result<Tensor> {
        let fail = |e| torch_error("assembling a gathered parameter", e);
        let whole = Tensor::f_empty(
            self.full_shape.as_slice(),
            (gathered.kind(), gathered.device()),
        )
        .map_err(fail)?;
        let rows = whole.f_view([self.rows, self.row_numel]).map_err(fail)?;
        for rank in 0..world {
            let n = self.rows_of(rank);
            if n == 0 {
                continue;
            }
            let from = gathered.narrow(0, rank as i64 * stride + offset, n * self.row_numel);
            rows.narrow(0, rank as i64 * self.shard_rows, n)
                .f_copy_(&from.f_view([n, self.row_numel]).map_err(fail)?)
                .map_err(fail)?;
        }
        Ok(whole)
    }
}

impl ParamShard {
    /// The whole tensor of which `shard` (of the shard's shape: the
    /// parameter itself, or a per-element optimizer buffer) is this rank's
    /// part, all-gathered from every rank (a collective).
    pub(crate) fn gather_whole(&self, group: &ProcessGroup, shard: &Tensor) -> Result<Tensor> {
        let fail = |e| torch_error("gathering a sharded tensor", e);
        let world = group.world_size();
        tch::no_grad(|| {
            let mine = shard
                .f_contiguous()
                .and_then(|t| t.f_view([-1]))
                .map_err(fail)?;
            let all = Tensor::f_empty(
                [self.shard_numel() * world as i64],
                (mine.kind(), mine.device()),
            )
            .map_err(fail)?;
            group.all_gather_into(&all, &mine)?;
            self.assemble(&all, world, self.shard_numel(), 0)
        })
    }

    /// This rank's rows of the whole, from `shard` (of the shard's shape:
    /// the parameter itself, or a per-element optimizer buffer), for a
    /// sharded checkpoint: the padding left out, with where the rows go
    /// (`None` for a 0-dimensional parameter, which rank 0 holds whole).
    /// Nothing when this rank holds padding only.
    pub(crate) fn local_rows(
        &self,
        shard: &Tensor,
        rank: usize,
    ) -> Result<Option<(Tensor, Option<RowSlice>)>> {
        let n = self.rows_of(rank);
        if n == 0 {
            return Ok(None);
        }
        let fail = |e| torch_error("reading a shard's rows", e);
        if self.full_shape.is_empty() {
            let scalar = shard.f_reshape([] as [i64; 0]).map_err(fail)?;
            return Ok(Some((scalar, None)));
        }
        let rows = shard.narrow(0, 0, n).f_contiguous().map_err(fail)?;
        let slice = RowSlice {
            start: (rank as i64 * self.shard_rows) as u64,
            total: self.rows as u64,
        };
        Ok(Some((rows, Some(slice))))
    }

    /// Rank `rank`'s shard of `value`, the whole tensor saved under `key`
    /// (the parameter, or one of its per-element optimizer buffers); another
    /// shape than the whole parameter's is an error naming `key`.
    pub(crate) fn cut_host(
        &self,
        key: &str,
        value: &HostTensor,
        rank: usize,
    ) -> Result<HostTensor> {
        let dims: Vec<i64> = value.dims().iter().map(|&d| d as i64).collect();
        if dims != self.full_shape {
            return Err(Error::invalid_argument(
                key,
                format!(
                    "has shape {dims:?}, but the parameter `{}` is {:?}",
                    self.name, self.full_shape
                ),
            ));
        }
        from_tch(&self.cut(&to_tch(value, kiln_core::Device::Cpu)?, rank)?)
    }
}

/// A unit's parameters, laid out in its flat buffers: each parameter's shard
/// at its offset, for the all-gather of every parameter and the
/// reduce-scatter of the trained ones' gradients.
pub(crate) struct UnitShards {
    group: Arc<ProcessGroup>,
    params: Vec<Arc<ParamShard>>,
    /// Each parameter's offset in the gather buffer of one rank.
    gather_offsets: Vec<i64>,
    gather_len: i64,
    /// Each trained parameter's offset in the reduction buffer of one rank.
    reduce_offsets: Vec<Option<i64>>,
    reduce_len: i64,
    /// The dtype the parameters are gathered (and the unit computes) in.
    gather_kind: Kind,
    /// The dtype the gradients are reduce-scattered in.
    reduce_kind: Kind,
    device: tch::Device,
    /// This unit's place in the model's units, and the schedule that
    /// prefetches the next unit's gather (set once the units exist).
    pub(crate) index: usize,
    pub(crate) schedule: OnceLock<Weak<GatherSchedule>>,
}

/// A unit's all-gather under way: [`UnitShards::finish_gather`] waits for it
/// and assembles the whole parameters.
pub(crate) struct PendingUnitGather(PendingAllGather);

impl PendingUnitGather {
    /// Waits for the gather; the flat buffer of every rank's shards.
    pub(crate) fn wait(self) -> Result<Tensor> {
        self.0.wait()
    }
}

impl std::fmt::Debug for UnitShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitShards")
            .field(
                "params",
                &self.params.iter().map(|p| &p.name).collect::<Vec<_>>(),
            )
            .field("gather_len", &self.gather_len)
            .field("reduce_len", &self.reduce_len)
            .finish_non_exhaustive()
    }
}

impl UnitShards {
    /// The collectives of a unit over `params` (in the unit's order): they
    /// must share one dtype and one device, since one flat buffer moves them.
    pub(crate) fn new(
        group: Arc<ProcessGroup>,
        index: usize,
        path: &str,
        params: Vec<Arc<ParamShard>>,
        (gather_kind, reduce_kind): (Option<Kind>, Option<Kind>),
    ) -> Result<Self> {
        let first = params.first().ok_or_else(|| {
            Error::invalid_argument("units", format!("the unit `{path}` holds no parameter"))
        })?;
        let (kind, device) = (first.param.kind(), first.param.device());
        for p in &params {
            if p.param.kind() != kind || p.param.device() != device {
                return Err(Error::unsupported(format!(
                    "full sharding of a unit (`{path}`) whose parameters have more than one \
                     dtype or device: `{}` is {:?} on {:?}, `{}` is {kind:?} on {device:?}",
                    p.name,
                    p.param.kind(),
                    p.param.device(),
                    first.name
                )));
            }
        }
        let mut gather_offsets = Vec::with_capacity(params.len());
        let mut reduce_offsets = Vec::with_capacity(params.len());
        let (mut gather_len, mut reduce_len) = (0, 0);
        for p in &params {
            gather_offsets.push(gather_len);
            gather_len += p.shard_numel();
            reduce_offsets.push(p.trained.then_some(reduce_len));
            if p.trained {
                reduce_len += p.shard_numel();
            }
        }
        Ok(UnitShards {
            group,
            params,
            gather_offsets,
            gather_len,
            reduce_offsets,
            reduce_len,
            gather_kind: gather_kind.unwrap_or(kind),
            reduce_kind: reduce_kind.unwrap_or(kind),
            device,
            index,
            schedule: OnceLock::new(),
        })
    }

    /// Starts the all-gather of the unit's shards (cast to the gather
    /// dtype) and returns at once.
    pub(crate) fn start_gather(&self) -> Result<PendingUnitGather> {
        let fail = |e| torch_error("full sharding's parameter all-gather", e);
        let world = self.group.world_size();
        tch::no_grad(|| {
            // Every shard fills its span (its padding rows included).
            let mine = self.flat_uninit(self.gather_len, self.gather_kind)?;
            for (p, &at) in self.params.iter().zip(&self.gather_offsets) {
                mine.narrow(0, at, p.shard_numel())
                    .f_copy_(&p.param.f_reshape([-1]).map_err(fail)?)
                    .map_err(fail)?;
            }
            let whole = self.flat_uninit(self.gather_len * world as i64, self.gather_kind)?;
            Ok(PendingUnitGather(self.group.all_gather_start(whole, mine)?))
        })
    }

    /// Waits for `pending` (this unit's gather) and assembles each whole
    /// parameter into its own memory.
    pub(crate) fn finish_gather(&self, pending: PendingUnitGather) -> Result<Vec<Tensor>> {
        let world = self.group.world_size();
        let whole = pending.0.wait()?;
        tch::no_grad(|| {
            self.params
                .iter()
                .zip(&self.gather_offsets)
                .map(|(p, &at)| p.assemble(&whole, world, self.gather_len, at))
                .collect()
        })
    }

    /// A flat buffer of zeros (the reduction's: gradients not reached and
    /// padding rows count as zeros).
    fn flat(&self, elements: i64, kind: Kind) -> Result<Tensor> {
        Tensor::f_zeros([elements], (kind, self.device))
            .map_err(|e| torch_error("full sharding's flat buffer", e))
    }

    /// A flat buffer that the caller writes whole (the gather's), not zeroed.
    fn flat_uninit(&self, elements: i64, kind: Kind) -> Result<Tensor> {
        Tensor::f_empty([elements], (kind, self.device))
            .map_err(|e| torch_error("full sharding's flat buffer", e))
    }
}

impl UnitCollectives for UnitShards {
    /// One all-gather of the unit's shards (cast to the gather dtype), then
    /// each whole parameter assembled into its own memory. With a schedule,
    /// the gather it prefetched when it is this unit's, and the next unit's
    /// started before returning.
    fn gather(&self) -> Result<Vec<Tensor>> {
        match self.schedule.get().and_then(Weak::upgrade) {
            Some(schedule) => schedule.gather(self.index),
            None => self.finish_gather(self.start_gather()?),
        }
    }

    /// The trained parameters' gradients reduce-scattered (averaged over the
    /// ranks, in the reduce dtype) in one collective, each rank's part added
    /// into its shards' `.grad` (in the shards' dtype). A gradient this rank's pass did not reach counts as zeros in
    /// the average and sets no `.grad` here.
    fn reduce(&self, grads: Vec<Option<Tensor>>) -> Result<()> {
        if self.reduce_len == 0 {
            return Ok(());
        }
        let fail = |e| torch_error("full sharding's gradient reduce-scatter", e);
        let world = self.group.world_size();
        tch::no_grad(|| {
            let whole = self.flat(self.reduce_len * world as i64, self.reduce_kind)?;
            for ((p, grad), at) in self.params.iter().zip(&grads).zip(&self.reduce_offsets) {
                let (Some(grad), Some(at)) = (grad, at) else {
                    continue;
                };
                let rows = grad.f_reshape([p.rows, p.row_numel]).map_err(fail)?;
                for rank in 0..world {
                    let n = p.rows_of(rank);
                    if n == 0 {
                        continue;
                    }
                    let start = rank as i64 * self.reduce_len + at;
                    whole
                        .narrow(0, start, n * p.row_numel)
                        .f_copy_(
                            &rows
                                .narrow(0, rank as i64 * p.shard_rows, n)
                                .f_reshape([-1])
                                .map_err(fail)?,
                        )
                        .map_err(fail)?;
                }
            }
            let mine = self.flat_uninit(self.reduce_len, self.reduce_kind)?;
            self.group
                .reduce_scatter_owned(&mine, whole, ReduceOp::Mean)?;
            for ((p, grad), at) in self.params.iter().zip(&grads).zip(&self.reduce_offsets) {
                if let (Some(_), Some(at)) = (grad, at) {
                    let part = mine
                        .narrow(0, *at, p.shard_numel())
                        .f_view(p.shard_shape().as_slice())
                        .and_then(|t| t.f_to_kind(p.param.kind()))
                        .map_err(fail)?;
                    accumulate_grad(&p.param, &part)?;
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cut_pad_and_assemble() -> Result<()> {
        // 5 rows over 2 ranks: 3 and 2 (+1 padding row).
        let w = Tensor::arange(10, (Kind::Float, tch::Device::Cpu)).view([5, 2]);
        let p = ParamShard::plan("w", &w, 2);
        assert_eq!((p.rows, p.shard_rows, p.row_numel), (5, 3, 2));
        assert_eq!(p.shard_shape(), vec![3, 2]);
        assert_eq!((p.rows_of(0), p.rows_of(1)), (3, 2));
        let a = p.cut(&w, 0)?;
        let b = p.cut(&w, 1)?;
        assert!(a.equal(&w.narrow(0, 0, 3)));
        assert!(b.narrow(0, 0, 2).equal(&w.narrow(0, 3, 2)));
        assert!(b
            .narrow(0, 2, 1)
            .equal(&Tensor::zeros([1, 2], (Kind::Float, tch::Device::Cpu))));
        // Two ranks' buffers of 7 elements, the shard at offset 1 in each.
        let gathered = Tensor::zeros([14], (Kind::Float, tch::Device::Cpu));
        gathered.narrow(0, 1, 6).copy_(&a.reshape([-1]));
        gathered.narrow(0, 8, 6).copy_(&b.reshape([-1]));
        assert!(p.assemble(&gathered, 2, 7, 1)?.equal(&w));

        // More ranks than rows: the last ranks hold padding only; a scalar is one row.
        let s = Tensor::from(2.5f32);
        let p = ParamShard::plan("s", &s, 3);
        assert_eq!((p.rows, p.shard_rows, p.shard_shape()), (1, 1, vec![1]));
        assert_eq!((p.rows_of(0), p.rows_of(1), p.rows_of(2)), (1, 0, 0));
        let gathered = Tensor::zeros([3], (Kind::Float, tch::Device::Cpu));
        gathered.narrow(0, 0, 1).copy_(&p.cut(&s, 0)?);
        let whole = p.assemble(&gathered, 3, 1, 0)?;
        assert_eq!(whole.size(), Vec::<i64>::new());
        assert_eq!(whole.double_value(&[]), 2.5);
        Ok(())
    }
}
