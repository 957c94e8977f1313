//! Convolutions as TensorFlow graph ops: `Conv1d`, `Conv2d`, `ConvTranspose2d`
//! (channels last, with PyTorch's weights).

use kiln_core::{
    model::{Conv1dConfig, ConvTranspose2dConfig, Layer},
    Result,
};
use tensorflow::{DataType, Output};

use super::{join, Built, Ctx, Val};

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    let y = match layer {
        Layer::Conv2d(c) => ctx.conv2d(c, prefix, x, true),
        Layer::Conv1d(c) => conv1d(ctx, c, prefix, x),
        Layer::ConvTranspose2d(c) => conv_transpose2d(ctx, c, prefix, x),
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

/// `Conv1d` as a 2-d convolution: `[N, C, L]` as `[N, C, 1, L]`, the `[k]`
/// kernel as `[1, k]`.
fn conv1d(ctx: &mut Ctx<'_>, c: &Conv1dConfig, prefix: &str, x: Val) -> Result<Val> {
    let p = |name: &str| join(prefix, name);
    // [N, C, L] -> [N, C, 1, L], a convolution with a [k] -> [1, k] kernel.
    let x = ctx.nchw(x)?;
    let (ch, len) = (x.dims[0], x.dims[1]);
    let as2d = ctx
        .b
        .reshape(&x.out, &[-1, ch as i32, 1, len as i32], DataType::Float)?;
    let weight = ctx.param(&p("weight"))?;
    let w4 = ctx.b.reshape(
        &weight,
        &[
            c.out_channels as i32,
            (c.in_channels / c.groups) as i32,
            1,
            c.kernel_size as i32,
        ],
        DataType::Float,
    )?;
    let filter = ctx.b.transpose(&w4, &[2, 3, 1, 0])?;
    let nhwc = ctx.b.transpose(&as2d, &[0, 2, 3, 1])?;
    let filter_dims = [
        1,
        c.kernel_size as i64,
        (c.in_channels / c.groups) as i64,
        c.out_channels as i64,
    ];
    let mut y = ctx.grouped_conv(
        &nhwc,
        &filter,
        filter_dims,
        c.groups,
        [1, c.stride as i64],
        [0, c.padding as i64],
        [1, c.dilation as i64],
    )?;
    if let Some(bias) = ctx.opt_param(&p("bias"))? {
        y = ctx.b.bias_add(&y, &bias)?;
    }
    let out_len = (len + 2 * c.padding as i64 - c.dilation as i64 * (c.kernel_size as i64 - 1) - 1)
        / c.stride as i64
        + 1;
    // [N, 1, L', O] -> [N, O, L']
    let y = ctx.b.reshape(
        &y,
        &[-1, out_len as i32, c.out_channels as i32],
        DataType::Float,
    )?;
    let y = ctx.b.transpose(&y, &[0, 2, 1])?;
    Ok(Val {
        out: y,
        dims: vec![c.out_channels as i64, out_len],
        nhwc: false,
    })
}

/// `ConvTranspose2d` as a convolution of the input with `stride - 1` zeros
/// between its pixels, padded, with the kernel flipped.
fn conv_transpose2d(
    ctx: &mut Ctx<'_>,
    c: &ConvTranspose2dConfig,
    prefix: &str,
    x: Val,
) -> Result<Val> {
    let p = |name: &str| join(prefix, name);
    let x = ctx.nhwc(x)?;
    let (cin, h, w) = (x.dims[0], x.dims[1], x.dims[2]);
    let [sh, sw] = c.stride.map(|v| v as i64);
    let [kh, kw] = c.kernel_size.map(|v| v as i64);
    let [dh, dw] = c.dilation.map(|v| v as i64);
    let [ph, pw] = c.padding.map(|v| v as i64);
    let [oph, opw] = c.output_padding.map(|v| v as i64);
    // Insert stride - 1 zeros between input pixels.
    let mut z = x.out.clone();
    let (mut zh, mut zw) = (h, w);
    if sh > 1 || sw > 1 {
        let r = ctx.b.reshape(
            &z,
            &[-1, h as i32, 1, w as i32, 1, cin as i32],
            DataType::Float,
        )?;
        let padded = ctx.b.pad(
            &r,
            &[
                [0, 0],
                [0, 0],
                [0, sh as i32 - 1],
                [0, 0],
                [0, sw as i32 - 1],
                [0, 0],
            ],
            0.0,
        )?;
        let flat = ctx.b.reshape(
            &padded,
            &[-1, (h * sh) as i32, (w * sw) as i32, cin as i32],
            DataType::Float,
        )?;
        zh = (h - 1) * sh + 1;
        zw = (w - 1) * sw + 1;
        z = ctx
            .b
            .slice(&flat, &[0, 0, 0, 0], &[-1, zh as i32, zw as i32, -1])?;
    }
    let lo_h = dh * (kh - 1) - ph;
    let lo_w = dw * (kw - 1) - pw;
    let (padded, _, _) =
        ctx.pad_spatial(&z, zh, zw, [[lo_h, lo_h + oph], [lo_w, lo_w + opw]], 0.0)?;
    // weight [in, out/g, kh, kw]: flip spatially -> [kh, kw, in, out/g]
    let weight = ctx.param(&p("weight"))?;
    let flipped = ctx.b.reverse(&weight, &[2, 3])?;
    let filter = ctx.b.transpose(&flipped, &[2, 3, 0, 1])?;
    // Per group the filter maps in/g channels to out/g: [kh, kw, in, out/g]
    // splits along "in" (axis 2) into [kh, kw, in/g, out/g] per group.
    let out_per_group = c.out_channels as i64 / c.groups as i64;
    let in_per_group = cin / c.groups as i64;
    let mut y = if c.groups == 1 {
        ctx.grouped_conv(
            &padded,
            &filter,
            [kh, kw, cin, out_per_group],
            1,
            [1, 1],
            [0, 0],
            [dh, dw],
        )?
    } else {
        let xs = ctx.b.split(&padded, 3, c.groups)?;
        let fs = ctx.b.split(&filter, 2, c.groups)?;
        let parts = xs
            .iter()
            .zip(&fs)
            .map(|(x, f)| {
                ctx.grouped_conv(
                    x,
                    f,
                    [kh, kw, in_per_group, out_per_group],
                    1,
                    [1, 1],
                    [0, 0],
                    [dh, dw],
                )
            })
            .collect::<Result<Vec<_>>>()?;
        ctx.b.concat(&parts, 3)?
    };
    if let Some(bias) = ctx.opt_param(&p("bias"))? {
        y = ctx.b.add(&y, &bias)?;
    }
    let oh = (h - 1) * sh - 2 * ph + dh * (kh - 1) + oph + 1;
    let ow = (w - 1) * sw - 2 * pw + dw * (kw - 1) + opw + 1;
    Ok(Val {
        out: y,
        dims: vec![c.out_channels as i64, oh, ow],
        nhwc: true,
    })
}

impl Ctx<'_> {
    /// A 2-d convolution of an `NHWC` value with a `[kh, kw, in/groups, out]`
    /// filter, zero-padded by `padding` (`[height, width]`, both sides), split
    /// into `groups` convolutions where needed. Where the padding is what
    /// `SAME` gives (stride 1, `2 * padding` = the dilated kernel's size - 1) the
    /// convolution pads inside; otherwise a `Pad` op comes first.
    ///
    /// Dilation is applied by inserting zeros into the filter: TensorFlow's
    /// oneDNN filter-gradient kernel rejects dilated convolutions on the CPU.
    #[allow(clippy::too_many_arguments)]
    fn grouped_conv(
        &mut self,
        x: &Output,
        filter: &Output,
        filter_dims: [i64; 4],
        groups: usize,
        strides: [i64; 2],
        padding: [i64; 2],
        dilations: [i64; 2],
    ) -> Result<Output> {
        let filter = if dilations == [1, 1] {
            filter.clone()
        } else {
            let [kh, kw, ci, co] = filter_dims.map(|d| d as i32);
            let [dh, dw] = dilations.map(|d| d as i32);
            let spread = self
                .b
                .reshape(filter, &[kh, 1, kw, 1, ci, co], DataType::Float)?;
            let padded = self.b.pad(
                &spread,
                &[[0, 0], [0, dh - 1], [0, 0], [0, dw - 1], [0, 0], [0, 0]],
                0.0,
            )?;
            let flat = self
                .b
                .reshape(&padded, &[kh * dh, kw * dw, ci, co], DataType::Float)?;
            self.b.slice(
                &flat,
                &[0, 0, 0, 0],
                &[(kh - 1) * dh + 1, (kw - 1) * dw + 1, ci, co],
            )?
        };
        let span = |i: usize| dilations[i] * (filter_dims[i] - 1) + 1;
        let same =
            padding != [0, 0] && strides == [1, 1] && (0..2).all(|i| 2 * padding[i] == span(i) - 1);
        let x = if same || padding == [0, 0] {
            x.clone()
        } else {
            let [ph, pw] = padding.map(|p| p as i32);
            self.b.pad(x, &[[0, 0], [ph, ph], [pw, pw], [0, 0]], 0.0)?
        };
        if groups == 1 {
            return self.b.conv2d(&x, &filter, strides, same);
        }
        let xs = self.b.split(&x, 3, groups)?;
        let fs = self.b.split(&filter, 3, groups)?;
        let parts = xs
            .iter()
            .zip(&fs)
            .map(|(x, f)| self.b.conv2d(x, f, strides, same))
            .collect::<Result<Vec<_>>>()?;
        self.b.concat(&parts, 3)
    }

    /// The [`Layer::Conv2d`] at `prefix`, with its bias added, or (`with_bias`
    /// false) left for [`Self::conv2d_bias`] after a max pool.
    pub(super) fn conv2d(
        &mut self,
        c: &kiln_core::model::Conv2dConfig,
        prefix: &str,
        x: Val,
        with_bias: bool,
    ) -> Result<Val> {
        let [kernel, stride, padding, dilation] =
            [c.kernel_size, c.stride, c.padding, c.dilation].map(|pair| pair.map(|v| v as i64));
        let out_channels = c.out_channels as i64;
        let x = self.nhwc(x)?;
        let (h, w) = (x.dims[1] + 2 * padding[0], x.dims[2] + 2 * padding[1]);
        let weight = self.param(&join(prefix, "weight"))?;
        // [out, in/g, kh, kw] -> [kh, kw, in/g, out]
        let filter = self.b.transpose(&weight, &[2, 3, 1, 0])?;
        let in_per_group = x.dims[0] / c.groups as i64;
        let filter_dims = [kernel[0], kernel[1], in_per_group, out_channels];
        let y = self.grouped_conv(
            &x.out,
            &filter,
            filter_dims,
            c.groups,
            stride,
            padding,
            dilation,
        )?;
        let oh = (h - dilation[0] * (kernel[0] - 1) - 1) / stride[0] + 1;
        let ow = (w - dilation[1] * (kernel[1] - 1) - 1) / stride[1] + 1;
        let y = Val {
            out: y,
            dims: vec![out_channels, oh, ow],
            nhwc: true,
        };
        if with_bias {
            self.conv2d_bias(prefix, y)
        } else {
            Ok(y)
        }
    }

    /// Adds the bias of the `Conv2d` at `prefix` (if it has one) to `x`, channels last.
    pub(super) fn conv2d_bias(&mut self, prefix: &str, x: Val) -> Result<Val> {
        let x = self.nhwc(x)?;
        let out = match self.opt_param(&join(prefix, "bias"))? {
            Some(bias) => self.b.bias_add(&x.out, &bias)?,
            None => x.out,
        };
        Ok(Val { out, ..x })
    }
}
