//! Kiln [`Layer`] definitions as TensorFlow graph ops, with PyTorch's semantics,
//! one file per layer family; [`Ctx::layer`] asks each family in turn, so adding
//! a layer to a family touches only that family's file.
//!
//! Activations keep PyTorch's logical layout (`NCHW` for images). TensorFlow's
//! CPU convolutions and pools want `NHWC`, so 4-d values carry their physical
//! layout and are transposed only where a layer needs the other one: a stack of
//! convolutions, norms, activations and pools stays in `NHWC`.

mod activation;
mod attention;
mod conv;
mod custom;
mod dropout;
mod embedding;
mod linear;
mod moe;
pub(crate) use moe::{router_losses, RouterTerms};
mod norm;
mod pool;
mod saved_model;
mod structure;
mod transformer;

use std::collections::HashMap;

use kiln_core::{model::Layer, Error, Result};
use tensorflow::{DataType, Operation, Output};

use crate::custom_layer::CustomOps;
use crate::graph::Builder;
use crate::saved_model::SavedModelLayers;

/// A value flowing through the graph: the tensor, its logical per-sample
/// dimensions (PyTorch order, batch excluded) and whether a 4-d tensor is
/// physically `NHWC`.
#[derive(Clone, Debug)]
pub(crate) struct Val {
    pub(crate) out: Output,
    pub(crate) dims: Vec<i64>,
    pub(crate) nhwc: bool,
}

/// What a forward graph needs while it is built.
pub(crate) struct Ctx<'a> {
    pub(crate) b: &'a mut Builder,
    /// The model's custom-layer functions.
    pub(crate) custom_ops: &'a CustomOps,
    /// The model's `saved_model` layers.
    pub(crate) saved_models: &'a SavedModelLayers,
    /// Reads of each variable by state-dict name, created once per forward graph.
    pub(crate) reads: HashMap<String, Output>,
    /// Variable handles by state-dict name, with their dtype.
    pub(crate) handles: &'a HashMap<String, (Output, DataType)>,
    /// Training behaviour (dropout, batch statistics).
    pub(crate) train: bool,
    /// The int64 `[2]` seed placeholder, created on the first random op.
    pub(crate) seed: Option<Output>,
    /// Number of random ops so far (each gets its own stream).
    pub(crate) random_ops: i64,
    /// State updates this forward makes in training (batch-norm running
    /// statistics), created by the caller with the control dependencies it needs.
    pub(crate) updates: Vec<Update>,
    /// What each mixture-of-experts layer contributes to the router losses,
    /// in the order they were built.
    pub(crate) routers: Vec<RouterTerms>,
    /// `[batch, seq]` float32, 1 on the tokens and 0 on the padding, when the
    /// input is token ids stacked with their attention mask (`transformers`'
    /// `attention_mask`): the attention layers hide the padding keys, a
    /// `select` over the sequence reads each row's last token, and the
    /// router losses leave the padding out.
    pub(crate) padding: Option<Padding>,
}

/// Which tokens of a padded batch are padding ([`Ctx::padding`]).
#[derive(Clone, Debug)]
pub(crate) struct Padding {
    /// `[batch, seq]` float32, 1 on the tokens and 0 on the padding.
    pub(crate) mask: Output,
    /// `seq`.
    pub(crate) seq: i64,
}

/// A variable update a forward pass makes, not yet added as an op.
#[derive(Clone, Debug)]
pub(crate) struct Update {
    pub(crate) handle: Output,
    pub(crate) value: Output,
    pub(crate) dtype: DataType,
    /// `AssignAddVariableOp` instead of `AssignVariableOp`.
    pub(crate) add: bool,
}

/// Adds the ops of `updates`, each running after `after`.
pub(crate) fn add_updates(
    b: &mut Builder,
    updates: &[Update],
    after: &[&Operation],
) -> Result<Vec<Operation>> {
    updates
        .iter()
        .map(|u| {
            let ty = if u.add {
                "AssignAddVariableOp"
            } else {
                "AssignVariableOp"
            };
            let dtype = u.dtype;
            b.op_with(ty, &[&u.handle, &u.value], after, &|nd| {
                nd.set_attr_type("dtype", dtype)?;
                Ok(())
            })
        })
        .collect()
}

/// What one family's `build` made of a layer.
enum Built {
    /// The layer's output.
    Out(Val),
    /// The layer belongs to another family: its input, handed back.
    Pass(Val),
}

/// Builds one family's layers (see [`Built`]).
type Build = fn(&mut Ctx<'_>, &Layer, &str, Val) -> Result<Built>;

/// Every family's [`Build`].
const FAMILIES: [Build; 13] = [
    linear::build,
    conv::build,
    pool::build,
    norm::build,
    dropout::build,
    embedding::build,
    structure::build,
    activation::build,
    attention::build,
    custom::build,
    saved_model::build,
    transformer::build,
    moe::build,
];

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

fn i32s(dims: &[i64]) -> Vec<i32> {
    dims.iter().map(|&d| d as i32).collect()
}

/// `[-1, dims...]`: a shape with the run-time batch size.
fn batched(dims: &[i64]) -> Vec<i32> {
    let mut out = vec![-1];
    out.extend(i32s(dims));
    out
}

impl Ctx<'_> {
    /// The value of variable `name` (read once per forward graph).
    pub(crate) fn param(&mut self, name: &str) -> Result<Output> {
        if let Some(read) = self.reads.get(name) {
            return Ok(read.clone());
        }
        let (handle, dtype) = self
            .handles
            .get(name)
            .ok_or_else(|| {
                Error::backend(
                    "tensorflow",
                    "building the model",
                    format!("no variable `{name}`"),
                )
            })?
            .clone();
        let read = self.b.read(&handle, dtype)?;
        self.reads.insert(name.to_owned(), read.clone());
        Ok(read)
    }

    fn opt_param(&mut self, name: &str) -> Result<Option<Output>> {
        if self.handles.contains_key(name) {
            self.param(name).map(Some)
        } else {
            Ok(None)
        }
    }

    fn seed(&mut self) -> Result<Output> {
        if let Some(seed) = &self.seed {
            return Ok(seed.clone());
        }
        let seed = self.b.placeholder(DataType::Int64, Some(&[2]))?;
        self.seed = Some(seed.clone());
        Ok(seed)
    }

    /// The value in logical (`NCHW`) layout.
    pub(crate) fn nchw(&mut self, v: Val) -> Result<Val> {
        if !v.nhwc {
            return Ok(v);
        }
        Ok(Val {
            out: self.b.transpose(&v.out, &[0, 3, 1, 2])?,
            dims: v.dims,
            nhwc: false,
        })
    }

    /// A 4-d value in `NHWC` layout.
    fn nhwc(&mut self, v: Val) -> Result<Val> {
        if v.nhwc {
            return Ok(v);
        }
        Ok(Val {
            out: self.b.transpose(&v.out, &[0, 2, 3, 1])?,
            dims: v.dims,
            nhwc: true,
        })
    }

    /// Pads (or crops, for negative amounts) the spatial dims of an `NHWC` value.
    fn pad_spatial(
        &mut self,
        x: &Output,
        h: i64,
        w: i64,
        pads: [[i64; 2]; 2],
        value: f32,
    ) -> Result<(Output, i64, i64)> {
        let pos = |p: i64| p.max(0) as i32;
        let mut out = x.clone();
        if pads.iter().flatten().any(|&p| p > 0) {
            out = self.b.pad(
                &out,
                &[
                    [0, 0],
                    [pos(pads[0][0]), pos(pads[0][1])],
                    [pos(pads[1][0]), pos(pads[1][1])],
                    [0, 0],
                ],
                value,
            )?;
        }
        let (mut nh, mut nw) = (
            h + pads[0][0].max(0) + pads[0][1].max(0),
            w + pads[1][0].max(0) + pads[1][1].max(0),
        );
        if pads.iter().flatten().any(|&p| p < 0) {
            let crop = |p: i64| (-p).max(0);
            let begin = [0, crop(pads[0][0]) as i32, crop(pads[1][0]) as i32, 0];
            nh -= crop(pads[0][0]) + crop(pads[0][1]);
            nw -= crop(pads[1][0]) + crop(pads[1][1]);
            out = self
                .b
                .slice(&out, &begin, &[-1, nh as i32, nw as i32, -1])?;
        }
        Ok((out, nh, nw))
    }

    /// Runs `f` with the graph's name scope set to `prefix`, then restores it.
    fn in_scope<T>(&mut self, prefix: &str, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let saved = self.b.set_scope(prefix);
        let result = f(self);
        self.b.set_scope(&saved);
        result
    }

    /// Builds `layer` on `x`; `prefix` is its state-dict path.
    pub(crate) fn layer(&mut self, layer: &Layer, prefix: &str, x: Val) -> Result<Val> {
        self.in_scope(prefix, |ctx| ctx.layer_inner(layer, prefix, x))
    }

    fn layer_inner(&mut self, layer: &Layer, prefix: &str, x: Val) -> Result<Val> {
        let mut x = x;
        for build in FAMILIES {
            match build(self, layer, prefix, x)? {
                Built::Out(y) => return Ok(y),
                Built::Pass(input) => x = input,
            }
        }
        Err(Error::unsupported(format!(
            "layer {} on TensorFlow",
            layer.kind()
        )))
    }

    fn elementwise(
        &mut self,
        x: Val,
        f: impl FnOnce(&mut Builder, &Output) -> Result<Output>,
    ) -> Result<Val> {
        let out = f(self.b, &x.out)?;
        Ok(Val { out, ..x })
    }

    /// Applies a last-axis op along logical dimension `dim`.
    fn along(
        &mut self,
        x: Val,
        dim: isize,
        f: impl FnOnce(&mut Builder, &Output) -> Result<Output>,
    ) -> Result<Val> {
        let x = self.nchw(x)?;
        let rank = x.dims.len() as isize + 1;
        let d = if dim < 0 { dim + rank } else { dim };
        if d == rank - 1 {
            return self.elementwise(x, f);
        }
        let mut perm: Vec<i32> = (0..rank as i32).collect();
        perm.swap(d as usize, rank as usize - 1);
        let moved = self.b.transpose(&x.out, &perm)?;
        let y = f(self.b, &moved)?;
        let out = self.b.transpose(&y, &perm)?;
        Ok(Val {
            out,
            dims: x.dims,
            nhwc: false,
        })
    }
}

/// Dimensions as `a, b, c`.
fn dims_text(dims: &[i64]) -> String {
    dims.iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
