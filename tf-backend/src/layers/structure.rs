//! Structure as TensorFlow graph ops: `Flatten`, and the containers
//! `Sequential` (with its plan around max pools), `Residual` and `Parallel`.

use kiln_core::{model::Layer, Error, Result};
use tensorflow::DataType;

use super::{batched, i32s, join, Built, Ctx, Padding, Val};

/// How the graph computes one child (or a run of children) of a
/// [`Layer::Sequential`]; see [`plan`].
#[derive(Debug, PartialEq)]
enum Step {
    /// Child `i`, as written.
    Layer(usize),
    /// A [`Layer::Conv2d`] with a bias, an optional [`Layer::Relu`], then a
    /// [`Layer::MaxPool2d`]: the convolution without its bias, the pool, the bias,
    /// then the ReLU.
    ConvPool {
        conv: usize,
        relu: Option<usize>,
        pool: usize,
    },
}

/// How the graph computes the children of a [`Layer::Sequential`]: as written,
/// except around a max pool, where the per-channel work moves after the pool.
///
/// - A [`Layer::Relu`] directly before a [`Layer::MaxPool2d`] runs after it. ReLU
///   is monotone, so `relu(max(window)) == max(relu(window))` exactly, and the
///   gradients agree too: both orders send a window's gradient to its first
///   maximum when that maximum is positive, and nothing otherwise.
/// - The bias of a [`Layer::Conv2d`] whose output goes (through that ReLU or
///   directly) into a max pool is added after the pool: `max(x + b) == max(x) + b`
///   exactly for a per-channel `b` (rounding is monotone too), and its gradient,
///   the sum of the pooled gradient, is the sum of what the pool's gradient
///   scatters. A window whose two largest values round to a tie only once the bias
///   is added may send its gradient to the other one of the two, which is a
///   rounding-level difference, as between any two convolution algorithms.
///
/// The ReLU, the bias and their gradients then run on the pooled activations (a
/// quarter of them for a 2x2 pool), and the filter gradient no longer carries the
/// bias gradient over the full-size activations. The torch backend keeps the
/// written order: libtorch's `NCHW` max pool is a branchy scalar loop that runs
/// slower on raw activations than on ReLU's (`BENCHMARKS.md`). Children keep their
/// names (`"{index}"`), so state dicts do not change.
fn plan(layers: &[Layer]) -> Vec<Step> {
    let is_pool = |i: usize| matches!(layers.get(i), Some(Layer::MaxPool2d(_)));
    let is_relu = |i: usize| matches!(layers.get(i), Some(Layer::Relu));
    let mut steps = Vec::with_capacity(layers.len());
    let mut i = 0;
    while i < layers.len() {
        match &layers[i] {
            Layer::Conv2d(c) if c.bias && is_relu(i + 1) && is_pool(i + 2) => {
                steps.push(Step::ConvPool {
                    conv: i,
                    relu: Some(i + 1),
                    pool: i + 2,
                });
                i += 3;
            }
            Layer::Conv2d(c) if c.bias && is_pool(i + 1) => {
                steps.push(Step::ConvPool {
                    conv: i,
                    relu: None,
                    pool: i + 1,
                });
                i += 2;
            }
            Layer::Relu if is_pool(i + 1) => {
                steps.extend([Step::Layer(i + 1), Step::Layer(i)]);
                i += 2;
            }
            _ => {
                steps.push(Step::Layer(i));
                i += 1;
            }
        }
    }
    steps
}

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let y = match layer {
        Layer::Flatten { start_dim, end_dim } => {
            let x = ctx.nchw(x)?;
            let rank = x.dims.len() as isize + 1;
            let norm = |d: isize| if d < 0 { d + rank } else { d } as usize;
            let (start, end) = (norm(*start_dim), norm(*end_dim));
            let mut full = vec![-1i64];
            full.extend(&x.dims);
            let merged: i64 = full[start..=end].iter().product();
            let mut shape: Vec<i64> = full[..start].to_vec();
            shape.push(if start == 0 { -1 } else { merged });
            shape.extend(&full[end + 1..]);
            let y = ctx.b.reshape(&x.out, &i32s(&shape), DataType::Float)?;
            // With start_dim 0 the batch merges into the first dimension.
            let dims = shape[1..].to_vec();
            Ok(Val {
                out: y,
                dims,
                nhwc: false,
            })
        }
        Layer::Transpose { dim0, dim1 } => {
            let x = ctx.nchw(x)?;
            let rank = x.dims.len() as isize + 1;
            let norm = |d: isize| (if d < 0 { d + rank } else { d }) as usize;
            let (a, b) = (norm(*dim0), norm(*dim1));
            let mut perm: Vec<i32> = (0..rank as i32).collect();
            perm.swap(a, b);
            let out = ctx.b.transpose(&x.out, &perm)?;
            let mut dims = x.dims.clone();
            dims.swap(a - 1, b - 1);
            Ok(Val {
                out,
                dims,
                nhwc: false,
            })
        }
        Layer::Select { dim, index } => {
            let x = ctx.nchw(x)?;
            let rank = x.dims.len() as isize + 1;
            let d = (if *dim < 0 { dim + rank } else { *dim }) as usize;
            let size = x.dims[d - 1];
            if let (Some(padding), 1, true) = (ctx.padding.clone(), d, *index < 0) {
                if padding.seq == size {
                    return ctx
                        .select_last_tokens(x, &padding, *index as i64)
                        .map(Built::Out);
                }
            }
            let i = if *index < 0 {
                *index as i64 + size
            } else {
                *index as i64
            };
            let mut begin = vec![0i32; rank as usize];
            begin[d] = i as i32;
            let mut extent = vec![-1i32; rank as usize];
            extent[d] = 1;
            let sliced = ctx.b.slice(&x.out, &begin, &extent)?;
            let mut dims = x.dims.clone();
            dims.remove(d - 1);
            let y = ctx.b.reshape(&sliced, &batched(&dims), DataType::Float)?;
            Ok(Val {
                out: y,
                dims,
                nhwc: false,
            })
        }
        Layer::Sequential { layers } => {
            let name = |i: usize| join(prefix, &i.to_string());
            let mut v = x;
            for step in plan(layers) {
                v = match step {
                    Step::Layer(i) => ctx.layer(&layers[i], &name(i), v)?,
                    Step::ConvPool { conv, relu, pool } => {
                        let Layer::Conv2d(c) = &layers[conv] else {
                            return Err(Error::invalid_argument(
                                name(conv),
                                "expected a Conv2d (internal plan error)",
                            ));
                        };
                        let at = name(conv);
                        let v = ctx.in_scope(&at, |ctx| ctx.conv2d(c, &at, v, false))?;
                        let v = ctx.layer(&layers[pool], &name(pool), v)?;
                        let v = ctx.in_scope(&at, |ctx| ctx.conv2d_bias(&at, v))?;
                        match relu {
                            Some(r) => ctx.layer(&layers[r], &name(r), v)?,
                            None => v,
                        }
                    }
                };
            }
            Ok(v)
        }
        Layer::Residual { block } => {
            let y = ctx.layer(block, &join(prefix, "block"), x.clone())?;
            let (x, y) = if x.nhwc == y.nhwc {
                (x, y)
            } else {
                (ctx.nchw(x)?, ctx.nchw(y)?)
            };
            let out = ctx.b.add(&x.out, &y.out)?;
            Ok(Val {
                out,
                dims: x.dims,
                nhwc: x.nhwc,
            })
        }
        Layer::Parallel { branches } => {
            let mut sum: Option<Val> = None;
            for (i, branch) in branches.iter().enumerate() {
                let y = ctx.layer(branch, &join(prefix, &i.to_string()), x.clone())?;
                sum = Some(match sum {
                    None => y,
                    Some(s) => {
                        let (s, y) = if s.nhwc == y.nhwc {
                            (s, y)
                        } else {
                            (ctx.nchw(s)?, ctx.nchw(y)?)
                        };
                        let out = ctx.b.add(&s.out, &y.out)?;
                        Val {
                            out,
                            dims: s.dims,
                            nhwc: s.nhwc,
                        }
                    }
                });
            }
            sum.ok_or_else(|| Error::invalid_argument(join(prefix, "branches"), "no branch"))
        }
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

impl Ctx<'_> {
    /// `x[:, index]` (`index` negative) over a padded batch's sequence,
    /// counted back from each row's last token (`transformers`'
    /// `last_non_pad_token`: the argmax of the positions times the mask), as
    /// on libtorch.
    fn select_last_tokens(&mut self, x: Val, padding: &Padding, index: i64) -> Result<Val> {
        let seq = padding.seq;
        let positions: Vec<f32> = (0..seq).map(|p| p as f32).collect();
        let positions = self.b.constant(&positions, &[seq as u64])?;
        let scored = self.b.mul(&padding.mask, &positions)?;
        let axis = self.b.constant(&[1i32], &[])?;
        let last = self.b.op("ArgMax", &[&scored, &axis], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_type("Tidx", DataType::Int32)?;
            nd.set_attr_type("output_type", DataType::Int32)?;
            Ok(())
        })?;
        let shift = self.b.constant(&[(index + 1) as i32], &[])?;
        let at = self.b.op("AddV2", &[&last, &shift], &|nd| {
            nd.set_attr_type("T", DataType::Int32)?;
            Ok(())
        })?;
        let zero = self.b.constant(&[0i32], &[])?;
        let at = self.b.op("Maximum", &[&at, &zero], &|nd| {
            nd.set_attr_type("T", DataType::Int32)?;
            Ok(())
        })?;
        let y = self.b.op("GatherV2", &[&x.out, &at, &axis], &|nd| {
            nd.set_attr_type("Tparams", DataType::Float)?;
            nd.set_attr_type("Tindices", DataType::Int32)?;
            nd.set_attr_type("Taxis", DataType::Int32)?;
            nd.set_attr_int("batch_dims", 1)?;
            Ok(())
        })?;
        let mut dims = x.dims;
        dims.remove(0);
        Ok(Val {
            out: y,
            dims,
            nhwc: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use kiln_core::model::{Conv2dConfig, GeluApproximation, Layer, Pool2dConfig};

    use super::{plan, Step};

    #[test]
    fn per_channel_work_moves_after_a_max_pool() {
        use Step::{ConvPool, Layer as L};
        let pool = || Layer::MaxPool2d(Pool2dConfig::new([2, 2]));
        let conv = |bias: bool| Layer::from(Conv2dConfig::new(1, 4, [3, 3]).with_bias(bias));
        assert_eq!(plan(&[]), vec![]);
        assert_eq!(plan(&[Layer::Relu]), vec![L(0)]);
        assert_eq!(plan(&[Layer::Relu, pool()]), vec![L(1), L(0)]);
        // Each ReLU moves past the pool right after it, and only that one.
        assert_eq!(
            plan(&[
                Layer::Relu,
                Layer::Relu,
                pool(),
                Layer::Relu,
                pool(),
                pool()
            ]),
            vec![L(0), L(2), L(1), L(4), L(3), L(5)]
        );
        // A convolution's bias moves past the pool, through a ReLU or directly.
        assert_eq!(
            plan(&[
                conv(true),
                Layer::Relu,
                pool(),
                conv(true),
                pool(),
                Layer::Relu
            ]),
            vec![
                ConvPool {
                    conv: 0,
                    relu: Some(1),
                    pool: 2
                },
                ConvPool {
                    conv: 3,
                    relu: None,
                    pool: 4
                },
                L(5)
            ]
        );
        // Without a bias only the ReLU moves; anything else in between stops both.
        assert_eq!(
            plan(&[conv(false), Layer::Relu, pool()]),
            vec![L(0), L(2), L(1)]
        );
        let avg = Layer::AvgPool2d(Pool2dConfig::new([2, 2]));
        assert_eq!(
            plan(&[conv(true), Layer::Relu, avg]),
            vec![L(0), L(1), L(2)]
        );
        let gelu = Layer::Gelu {
            approximate: GeluApproximation::None,
        };
        assert_eq!(plan(&[conv(true), gelu, pool()]), vec![L(0), L(1), L(2)]);
    }
}
