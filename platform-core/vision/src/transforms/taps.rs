//! The antialiased (triangle-filter) taps of a resize along one axis, as
//! PyTorch computes them for `interpolate(..., antialias=True)`: in `f64` for
//! `uint8` images (then as int16 fixed point), in `f32` for `float32` ones.
//! `geometry.rs` (float resizes) and `resize_u8.rs` (the `uint8` kernels)
//! both read them.

/// The taps of one output pixel along one axis: `weights[k]` multiplies input
/// `start + k`.
pub(super) struct Taps<W> {
    pub(super) starts: Vec<usize>,
    pub(super) lens: Vec<usize>,
    /// `out * stride` weights, zero past `lens[i]`.
    pub(super) weights: Vec<W>,
    pub(super) stride: usize,
}

impl<W: Copy> Taps<W> {
    pub(super) fn get(&self, i: usize) -> (usize, &[W]) {
        let w = &self.weights[i * self.stride..i * self.stride + self.lens[i]];
        (self.starts[i], w)
    }
}

/// Antialiased triangle-filter taps computed in `f64`, as PyTorch's
/// `_compute_indices_min_size_weights_aa<double>` (the `uint8` path); returns
/// the taps and the largest weight.
pub(super) fn taps_f64(input: usize, output: usize) -> (Taps<f64>, f64) {
    let scale = input as f64 / output as f64;
    let support = if scale >= 1.0 { scale } else { 1.0 };
    let stride = support.ceil() as usize * 2 + 1;
    let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let mut taps = Taps {
        starts: Vec::with_capacity(output),
        lens: Vec::with_capacity(output),
        weights: vec![0.0; output * stride],
        stride,
    };
    let mut wt_max = 0.0f64;
    for i in 0..output {
        let center = scale * (i as f64 + 0.5);
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xsize = ((center + support + 0.5) as i64)
            .min(input as i64)
            .saturating_sub(xmin)
            .clamp(0, stride as i64) as usize;
        let xmin = xmin as usize;
        let w = &mut taps.weights[i * stride..(i + 1) * stride];
        let mut total = 0.0;
        for (j, wj) in w.iter_mut().take(xsize).enumerate() {
            let x = (((j + xmin) as f64 - center + 0.5) * invscale).abs();
            *wj = if x < 1.0 { 1.0 - x } else { 0.0 };
            total += *wj;
        }
        if total != 0.0 {
            for wj in w.iter_mut().take(xsize) {
                *wj /= total;
                wt_max = wt_max.max(*wj);
            }
        }
        taps.starts.push(xmin);
        taps.lens.push(xsize);
    }
    (taps, wt_max)
}

/// The same taps computed in `f32` with PyTorch's mixed float/double
/// expressions (`_compute_indices_min_size_weights_aa<float>`, the `float32`
/// path).
pub(super) fn taps_f32(input: usize, output: usize) -> Taps<f32> {
    let scale = input as f32 / output as f32;
    let support: f32 = if scale >= 1.0 { scale } else { 1.0 };
    let stride = support.ceil() as usize * 2 + 1;
    let invscale: f32 = if scale >= 1.0 {
        (1.0 / f64::from(scale)) as f32
    } else {
        1.0
    };
    let mut taps = Taps {
        starts: Vec::with_capacity(output),
        lens: Vec::with_capacity(output),
        weights: vec![0.0; output * stride],
        stride,
    };
    for i in 0..output {
        let center = (f64::from(scale) * (i as f64 + 0.5)) as f32;
        let xmin = ((f64::from(center - support) + 0.5) as i64).max(0);
        let xsize = ((f64::from(center + support) + 0.5) as i64)
            .min(input as i64)
            .saturating_sub(xmin)
            .clamp(0, stride as i64) as usize;
        let xmin = xmin as usize;
        let w = &mut taps.weights[i * stride..(i + 1) * stride];
        let mut total = 0.0f32;
        for (j, wj) in w.iter_mut().take(xsize).enumerate() {
            let arg = ((f64::from((j + xmin) as f32 - center) + 0.5) * f64::from(invscale)) as f32;
            let x = arg.abs();
            *wj = if x < 1.0 {
                (1.0 - f64::from(x)) as f32
            } else {
                0.0
            };
            total += *wj;
        }
        if total != 0.0 {
            for wj in w.iter_mut().take(xsize) {
                *wj /= total;
            }
        }
        taps.starts.push(xmin);
        taps.lens.push(xsize);
    }
    taps
}

/// `f64` taps scaled to int16 fixed point (PyTorch's
/// `_compute_index_ranges_int16_weights`); returns the taps and the number of
/// fractional bits.
pub(super) fn taps_i16(input: usize, output: usize) -> (Taps<i32>, u32) {
    let (taps, wt_max) = taps_f64(input, output);
    let mut precision = 0u32;
    while precision < 22 {
        let next = (0.5 + wt_max * f64::from(1u32 << (precision + 1))) as i64;
        if next >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let scale = f64::from(1u32 << precision);
    let weights = taps
        .weights
        .iter()
        .map(|&w| {
            let v = w * scale;
            // Truncated to int16 as PyTorch stores it.
            (if v < 0.0 {
                (-0.5 + v) as i32
            } else {
                (0.5 + v) as i32
            }) as i16 as i32
        })
        .collect();
    (
        Taps {
            starts: taps.starts,
            lens: taps.lens,
            weights,
            stride: taps.stride,
        },
        precision.max(1),
    )
}
