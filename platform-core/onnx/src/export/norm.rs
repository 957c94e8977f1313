//! Normalisation: `BatchNormalization` with the running statistics, the
//! batch statistics composed from `ReduceMean` where a batch norm keeps none
//! (as PyTorch does), `LayerNormalization`, and `GroupNorm` composed from
//! `Reshape` and `ReduceMean` per group.

use kiln_core::model::Layer;

use super::graph::attr;
use super::Result;
use super::{wrong_family, Emitter, Value};

impl Emitter<'_> {
    pub(crate) fn norm(&mut self, path: &str, layer: &Layer, x: &Value) -> Result<String> {
        match layer {
            Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) => {
                let channels = c.num_features;
                if c.track_running_stats {
                    let (scale, bias) = if c.affine {
                        (
                            self.param(path, layer, "weight")?,
                            self.param(path, layer, "bias")?,
                        )
                    } else {
                        (
                            self.g
                                .floats(path, "ones", &vec![1.0; channels], &[channels])?,
                            self.g
                                .floats(path, "zeros", &vec![0.0; channels], &[channels])?,
                        )
                    };
                    let mean = self.param(path, layer, "running_mean")?;
                    let var = self.param(path, layer, "running_var")?;
                    Ok(self.g.op(
                        path,
                        "BatchNormalization",
                        &[&x.name, &scale, &bias, &mean, &var],
                        vec![attr::float("epsilon", c.eps)],
                    ))
                } else {
                    // Statistics over every axis but the channels (1).
                    let mut axes = vec![0i64];
                    axes.extend(2..x.shape.len() as i64);
                    let normalized = self.standardize(path, &x.name, &axes, c.eps)?;
                    if c.affine {
                        self.channel_affine(path, layer, &normalized, channels, x.shape.len())
                    } else {
                        Ok(normalized)
                    }
                }
            }
            Layer::LayerNorm(c) => {
                let n: usize = c.normalized_shape.iter().product();
                let scale = if c.elementwise_affine {
                    self.param(path, layer, "weight")?
                } else {
                    self.g
                        .floats(path, "ones", &vec![1.0; n], &c.normalized_shape)?
                };
                let mut inputs = vec![x.name.as_str(), scale.as_str()];
                let bias = if c.elementwise_affine && c.bias {
                    Some(self.param(path, layer, "bias")?)
                } else {
                    None
                };
                if let Some(b) = &bias {
                    inputs.push(b);
                }
                Ok(self.g.op(
                    path,
                    "LayerNormalization",
                    &inputs,
                    vec![
                        attr::int("axis", -(c.normalized_shape.len() as i64)),
                        attr::float("epsilon", c.eps),
                    ],
                ))
            }
            Layer::GroupNorm(c) => {
                // [N, C, *] -> [N, G, C/G * prod(*)], standardized per group.
                let grouped = self
                    .g
                    .ints(path, "grouped", &[0, c.num_groups as i64, -1])?;
                let r = self.g.op(path, "Reshape", &[&x.name, &grouped], vec![]);
                let normalized = self.standardize(path, &r, &[2], c.eps)?;
                let mut back: Vec<i64> = x.shape.iter().map(|&d| d as i64).collect();
                back[0] = 0;
                let back = self.g.ints(path, "shape", &back)?;
                let y = self.g.op(path, "Reshape", &[&normalized, &back], vec![]);
                if c.affine {
                    self.channel_affine(path, layer, &y, c.num_channels, x.shape.len())
                } else {
                    Ok(y)
                }
            }
            _ => Err(wrong_family(path, layer)),
        }
    }

    /// `(x - mean) / sqrt(var + eps)` with the mean and the biased variance
    /// over `axes`, as PyTorch's batch and group norms compute them.
    fn standardize(&mut self, path: &str, x: &str, axes: &[i64], eps: f64) -> Result<String> {
        let axes = self.g.ints(path, "axes", axes)?;
        let keep = || vec![attr::int("keepdims", 1)];
        let mean = self.g.op(path, "ReduceMean", &[x, &axes], keep());
        let centered = self.g.op(path, "Sub", &[x, &mean], vec![]);
        let squared = self.g.op(path, "Mul", &[&centered, &centered], vec![]);
        let var = self.g.op(path, "ReduceMean", &[&squared, &axes], keep());
        let eps = self.g.scalar(path, "eps", eps)?;
        let shifted = self.g.op(path, "Add", &[&var, &eps], vec![]);
        let std = self.g.op(path, "Sqrt", &[&shifted], vec![]);
        Ok(self.g.op(path, "Div", &[&centered, &std], vec![]))
    }

    /// `y * weight + bias` with per-channel (axis 1) parameters of a rank-`rank`
    /// value.
    fn channel_affine(
        &mut self,
        path: &str,
        layer: &Layer,
        y: &str,
        channels: usize,
        rank: usize,
    ) -> Result<String> {
        let weight = self.param(path, layer, "weight")?;
        let bias = self.param(path, layer, "bias")?;
        let mut dims = vec![channels as i64];
        dims.extend(std::iter::repeat_n(1, rank.saturating_sub(2)));
        let shape = self.g.ints(path, "channel_shape", &dims)?;
        let w = self.g.op(path, "Reshape", &[&weight, &shape], vec![]);
        let b = self.g.op(path, "Reshape", &[&bias, &shape], vec![]);
        let scaled = self.g.op(path, "Mul", &[y, &w], vec![]);
        Ok(self.g.op(path, "Add", &[&scaled, &b], vec![]))
    }
}
