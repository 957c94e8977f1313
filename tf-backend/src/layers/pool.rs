//! Pooling as TensorFlow graph ops: `MaxPool2d`, `AvgPool2d`, `AdaptiveAvgPool2d`.

use kiln_core::{model::Layer, Result};
use tensorflow::{DataType, Output};

use super::{Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, _prefix: &str, x: Val) -> Result<Built> {
    let y = match layer {
        Layer::MaxPool2d(c) | Layer::AvgPool2d(c) => {
            let max = matches!(layer, Layer::MaxPool2d(_));
            let x = ctx.nhwc(x)?;
            let (ch, h, w) = (x.dims[0], x.dims[1], x.dims[2]);
            let kernel = c.kernel_size.map(|v| v as i64);
            let stride = c.stride.unwrap_or(c.kernel_size).map(|v| v as i64);
            let pad = c.padding.map(|v| v as i64);
            let fill = if max { f32::NEG_INFINITY } else { 0.0 };
            let (padded, h, w) = ctx.pad_spatial(&x.out, h, w, [[pad[0]; 2], [pad[1]; 2]], fill)?;
            let y = ctx.b.pool(
                if max { "MaxPool" } else { "AvgPool" },
                &padded,
                kernel,
                stride,
            )?;
            let oh = (h - kernel[0]) / stride[0] + 1;
            let ow = (w - kernel[1]) / stride[1] + 1;
            Ok(Val {
                out: y,
                dims: vec![ch, oh, ow],
                nhwc: true,
            })
        }
        Layer::AdaptiveAvgPool2d { output_size } => {
            // y = P_h x P_w^T with PyTorch's bins [floor(i*H/o), ceil((i+1)*H/o)).
            let x = ctx.nchw(x)?;
            let (ch, h, w) = (x.dims[0], x.dims[1], x.dims[2]);
            let (oh, ow) = (output_size[0] as i64, output_size[1] as i64);
            let pw = ctx.pool_matrix(w, ow)?; // [ow, w]
            let ph = ctx.pool_matrix(h, oh)?; // [oh, h]
            let rows = ctx.b.reshape(&x.out, &[-1, w as i32], DataType::Float)?;
            let a = ctx.b.matmul(&rows, &pw, false, true)?; // [N*C*H, ow]
            let a = ctx
                .b
                .reshape(&a, &[-1, h as i32, ow as i32], DataType::Float)?;
            let a = ctx.b.transpose(&a, &[0, 2, 1])?; // [N*C, ow, H]
            let a = ctx.b.reshape(&a, &[-1, h as i32], DataType::Float)?;
            let y = ctx.b.matmul(&a, &ph, false, true)?; // [N*C*ow, oh]
            let y = ctx
                .b
                .reshape(&y, &[-1, ow as i32, oh as i32], DataType::Float)?;
            let y = ctx.b.transpose(&y, &[0, 2, 1])?;
            let y = ctx
                .b
                .reshape(&y, &[-1, ch as i32, oh as i32, ow as i32], DataType::Float)?;
            Ok(Val {
                out: y,
                dims: vec![ch, oh, ow],
                nhwc: false,
            })
        }
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

impl Ctx<'_> {
    /// `[out, size]` averaging matrix of adaptive pooling.
    fn pool_matrix(&mut self, size: i64, out: i64) -> Result<Output> {
        let mut m = vec![0f32; (out * size) as usize];
        for i in 0..out {
            let start = (i * size) / out;
            let end = ((i + 1) * size + out - 1) / out;
            for j in start..end {
                m[(i * size + j) as usize] = 1.0 / (end - start) as f32;
            }
        }
        self.b.constant(&m, &[out as u64, size as u64])
    }
}
