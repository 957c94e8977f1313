//! `Linear` (`Gemm` with `transB=1` on 2-d input, `MatMul` + `Add` otherwise)
//! and the convolutions (`Conv`, `ConvTranspose`).

use kiln_core::model::Layer;

use super::graph::attr;
use super::Result;
use super::{wrong_family, Emitter, Value};

fn i64s(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&d| d as i64).collect()
}

/// ONNX `pads`: the same padding at the beginning and the end of each axis.
pub(crate) fn pads(padding: &[usize]) -> Vec<i64> {
    let mut p = i64s(padding);
    p.extend(i64s(padding));
    p
}

impl Emitter<'_> {
    pub(crate) fn conv(&mut self, path: &str, layer: &Layer, x: &Value) -> Result<String> {
        let weight = self.param(path, layer, "weight")?;
        let has_bias = match layer {
            Layer::Linear(c) => c.bias,
            Layer::Conv1d(c) => c.bias,
            Layer::Conv2d(c) => c.bias,
            Layer::ConvTranspose2d(c) => c.bias,
            _ => false,
        };
        let bias = if has_bias {
            Some(self.param(path, layer, "bias")?)
        } else {
            None
        };
        let mut inputs: Vec<&str> = vec![&x.name, &weight];
        if let Some(b) = &bias {
            inputs.push(b);
        }
        Ok(match layer {
            Layer::Linear(_) if x.shape.len() == 2 => {
                self.g
                    .op(path, "Gemm", &inputs, vec![attr::int("transB", 1)])
            }
            Layer::Linear(_) => {
                let wt = self.g.op(
                    path,
                    "Transpose",
                    &[&weight],
                    vec![attr::ints("perm", &[1, 0])],
                );
                let y = self.g.op(path, "MatMul", &[&x.name, &wt], vec![]);
                match &bias {
                    Some(b) => self.g.op(path, "Add", &[&y, b], vec![]),
                    None => y,
                }
            }
            Layer::Conv1d(c) => self.g.op(
                path,
                "Conv",
                &inputs,
                vec![
                    attr::ints("kernel_shape", &i64s(&[c.kernel_size])),
                    attr::ints("strides", &i64s(&[c.stride])),
                    attr::ints("pads", &pads(&[c.padding])),
                    attr::ints("dilations", &i64s(&[c.dilation])),
                    attr::int("group", c.groups as i64),
                ],
            ),
            Layer::Conv2d(c) => self.g.op(
                path,
                "Conv",
                &inputs,
                vec![
                    attr::ints("kernel_shape", &i64s(&c.kernel_size)),
                    attr::ints("strides", &i64s(&c.stride)),
                    attr::ints("pads", &pads(&c.padding)),
                    attr::ints("dilations", &i64s(&c.dilation)),
                    attr::int("group", c.groups as i64),
                ],
            ),
            Layer::ConvTranspose2d(c) => self.g.op(
                path,
                "ConvTranspose",
                &inputs,
                vec![
                    attr::ints("kernel_shape", &i64s(&c.kernel_size)),
                    attr::ints("strides", &i64s(&c.stride)),
                    attr::ints("pads", &pads(&c.padding)),
                    attr::ints("output_padding", &i64s(&c.output_padding)),
                    attr::ints("dilations", &i64s(&c.dilation)),
                    attr::int("group", c.groups as i64),
                ],
            ),
            _ => return Err(wrong_family(path, layer)),
        })
    }
}
