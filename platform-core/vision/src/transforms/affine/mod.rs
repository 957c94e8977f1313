//! Affine, rotation and perspective warps with torchvision v2's tensor
//! arithmetic: an inverse map from output to input pixels, evaluated as a
//! `float32` sampling grid and sampled like `grid_sample(align_corners=False,
//! padding_mode="zeros")`; `uint8` images are sampled as `float32` and
//! rounded half to even.

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;
use serde::{Deserialize, Serialize};

use super::image::{with_pixels, Layout};
use super::pixel::{check_fill, each_image, fill_of, Px};

/// How a warp samples the input (torchvision's `InterpolationMode`, the
/// two that tensors support for warps).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Interpolation {
    /// The nearest pixel (ties to even).
    #[default]
    Nearest,
    /// Bilinear between the four nearest pixels.
    Bilinear,
}

/// The inverse of the affine map "rotate by `angle` degrees (clockwise on
/// screen), scale, shear by `shear` degrees (x, y) about `center`, then
/// translate", as torchvision's `_get_inverse_affine_matrix`: the row-major
/// `[a, b, c, d, e, f]` mapping an output point `(x, y)` (relative to
/// `center`) to the input point `(a x + b y + c, d x + e y + f)`.
pub fn inverse_affine_matrix(
    center: (f64, f64),
    angle: f64,
    translate: (f64, f64),
    scale: f64,
    shear: (f64, f64),
) -> [f64; 6] {
    let rot = angle.to_radians();
    let (sx, sy) = (shear.0.to_radians(), shear.1.to_radians());
    let (cx, cy) = center;
    let (tx, ty) = translate;
    let cos_sy = sy.cos();
    let tan_sx = sx.tan();
    let a = (rot - sy).cos() / cos_sy;
    let b = -(a * tan_sx + rot.sin());
    let c = (rot - sy).sin() / cos_sy;
    let d = rot.cos() - c * tan_sx;
    let mut m = [d / scale, -b / scale, 0.0, -c / scale, a / scale, 0.0];
    m[2] += cx - m[0] * (cx + tx) - m[1] * (cy + ty);
    m[5] += cy - m[3] * (cx + tx) - m[4] * (cy + ty);
    m
}

/// The sampling grid of one output pixel: normalised input coordinates in
/// `[-1, 1]` across the image (pixel centres at `(2 i + 1) / n - 1`).
type GridFn<'a> = dyn Fn(usize, usize) -> (f32, f32) + 'a;

/// Samples every plane of `img` at `grid(x, y)` for each output pixel,
/// torchvision's `_apply_grid_transform`: with a fill (`Some`), a mask
/// plane of ones is sampled alongside and blends the fill in.
fn grid_transform(
    img: &HostTensor,
    oh: usize,
    ow: usize,
    grid: &GridFn<'_>,
    mode: Interpolation,
    fill: Option<&[f64]>,
) -> Result<HostTensor> {
    let l = Layout::of(img, "grid transform")?;
    let dims = l.dims_with(oh, ow);
    if l.count * l.channels == 0 || oh * ow == 0 {
        return HostTensor::zeros(img.dtype(), dims);
    }
    let (h, w) = (l.height, l.width);
    // For each output pixel: the four (or one) input indices and weights.
    let (half_w, half_h) = (w as f32 / 2.0, h as f32 / 2.0);
    let mut taps: Vec<[(Option<usize>, f32); 4]> = Vec::with_capacity(oh * ow);
    for y in 0..oh {
        for x in 0..ow {
            let (gx, gy) = grid(x, y);
            // PyTorch's vectorised kernel, as compiled: fused multiply-adds.
            let ix = (gx + 1.0).mul_add(half_w, -0.5);
            let iy = (gy + 1.0).mul_add(half_h, -0.5);
            let at = |xx: f32, yy: f32| -> Option<usize> {
                (xx >= 0.0 && yy >= 0.0 && xx < w as f32 && yy < h as f32)
                    .then(|| yy as usize * w + xx as usize)
            };
            taps.push(match mode {
                Interpolation::Nearest => {
                    let (rx, ry) = (ix.round_ties_even(), iy.round_ties_even());
                    [(at(rx, ry), 1.0), (None, 0.0), (None, 0.0), (None, 0.0)]
                }
                Interpolation::Bilinear => {
                    let (x0, y0) = (ix.floor(), iy.floor());
                    let (wx, ny) = (ix - x0, iy - y0);
                    let (ex, sy) = (1.0 - wx, 1.0 - ny);
                    [
                        (at(x0, y0), sy * ex),
                        (at(x0 + 1.0, y0), sy * wx),
                        (at(x0, y0 + 1.0), ny * ex),
                        (at(x0 + 1.0, y0 + 1.0), ny * wx),
                    ]
                }
            });
        }
    }
    let sample = |plane: &dyn Fn(usize) -> f32, t: &[(Option<usize>, f32); 4]| -> f32 {
        match mode {
            Interpolation::Nearest => t[0].0.map_or(0.0, plane),
            Interpolation::Bilinear => {
                let v = |k: usize| t[k].0.map_or(0.0, plane);
                let acc = v(0) * t[0].1;
                let acc = v(1).mul_add(t[1].1, acc);
                let acc = v(2).mul_add(t[2].1, acc);
                v(3).mul_add(t[3].1, acc)
            }
        }
    };
    let masks: Option<Vec<f32>> = fill.map(|_| taps.iter().map(|t| sample(&|_| 1.0, t)).collect());
    with_pixels!(img, T => {
        let src = img.as_slice::<T>()?;
        let mut out = Vec::with_capacity(l.count * l.channels * oh * ow);
        for (p, plane) in src.chunks_exact(l.plane()).enumerate() {
            let get = |i: usize| plane[i].f32();
            let f = fill.map(|f| fill_of(f, p % l.channels) as f32);
            for (k, t) in taps.iter().enumerate() {
                let mut v = sample(&get, t);
                if let (Some(f), Some(m)) = (f, &masks) {
                    let m = m[k];
                    v = match mode {
                        Interpolation::Nearest => if m < 0.5 { f } else { v },
                        Interpolation::Bilinear => (v - f) * m + f,
                    };
                }
                out.push(T::from_rounded(v));
            }
        }
        HostTensor::new(out, dims)
    })
}

/// The affine grid of torchvision's `_affine_grid`: output pixel centres
/// relative to the output's centre, mapped by `matrix` (as `float32`, divided
/// by the input's half sides).
fn affine_grid(
    matrix: &[f64; 6],
    w: usize,
    h: usize,
    ow: usize,
    oh: usize,
) -> impl Fn(usize, usize) -> (f32, f32) {
    let (hw, hh) = ((0.5 * w as f64) as f32, (0.5 * h as f64) as f32);
    let t: Vec<f32> = matrix.iter().map(|&v| v as f32).collect();
    let (a, b, c) = (t[0] / hw, t[1] / hw, t[2] / hw);
    let (d, e, f) = (t[3] / hh, t[4] / hh, t[5] / hh);
    let (x0, y0) = ((1.0 - ow as f64) * 0.5, (1.0 - oh as f64) * 0.5);
    move |x, y| {
        let px = (x0 + x as f64) as f32;
        let py = (y0 + y as f64) as f32;
        ((px * a + py * b) + c, (px * d + py * e) + f)
    }
}

fn check_warp_fill(fill: Option<&[f64]>, channels: usize, op: &str) -> Result<()> {
    match fill {
        Some(f) => check_fill("fill", op, f, Some(channels)),
        None => Ok(()),
    }
}

/// An affine warp of every image, keeping its size, as
/// `v2.functional.affine(img, angle, translate, scale, shear,
/// interpolation, fill, center)`: `angle` and `shear` in degrees,
/// `translate` in pixels, `center` in pixels from the top-left corner
/// (default the image's centre). Pixels from outside the image are zeros
/// with `fill = None`; with `Some(fill)` they are blended with `fill` (one
/// value, or one per channel) like torchvision.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{affine, Interpolation};
///
/// let img = HostTensor::new(vec![1u8, 2, 3, 4], [1, 1, 4])?;
/// let y = affine(&img, 0.0, (1.0, 0.0), 1.0, (0.0, 0.0), Interpolation::Nearest, None, None)?;
/// assert_eq!(y.as_slice::<u8>()?, &[0, 1, 2, 3]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn affine(
    img: &HostTensor,
    angle: f64,
    translate: (f64, f64),
    scale: f64,
    shear: (f64, f64),
    interpolation: Interpolation,
    fill: Option<&[f64]>,
    center: Option<(f64, f64)>,
) -> Result<HostTensor> {
    if !(scale > 0.0 && scale.is_finite()) {
        return Err(Error::invalid_argument(
            "scale",
            format!("affine scale must be positive and finite, got {scale}"),
        ));
    }
    for (name, v) in [
        ("angle", angle),
        ("translate", translate.0),
        ("translate", translate.1),
        ("shear", shear.0),
        ("shear", shear.1),
    ] {
        if !v.is_finite() {
            return Err(Error::invalid_argument(
                name,
                format!("affine {name} must be finite, got {v}"),
            ));
        }
    }
    let l = Layout::of(img, "affine")?;
    check_warp_fill(fill, l.channels, "affine")?;
    let (h, w) = (l.height, l.width);
    let center_f = center.map_or((0.0, 0.0), |(cx, cy)| {
        (cx - w as f64 * 0.5, cy - h as f64 * 0.5)
    });
    let m = inverse_affine_matrix(center_f, angle, translate, scale, shear);
    let grid = affine_grid(&m, w, h, w, h);
    grid_transform(img, h, w, &grid, interpolation, fill)
}

/// Rotates every image by a quarter turn `k` times counter-clockwise
/// (`torch.rot90(img, k, dims=(-2, -1))`).
fn rot90(img: &HostTensor, k: usize) -> Result<HostTensor> {
    let l = Layout::of(img, "rotate")?;
    let (h, w) = (l.height, l.width);
    let (oh, ow) = if k % 2 == 1 { (w, h) } else { (h, w) };
    let dims = l.dims_with(oh, ow);
    with_pixels!(img, T => {
        let src = img.as_slice::<T>()?;
        let mut out = Vec::with_capacity(src.len());
        if l.plane() > 0 {
            for plane in src.chunks_exact(l.plane()) {
                for i in 0..oh {
                    for j in 0..ow {
                        let (y, x) = match k % 4 {
                            1 => (j, w - 1 - i),
                            2 => (h - 1 - i, w - 1 - j),
                            3 => (h - 1 - j, i),
                            _ => (i, j),
                        };
                        out.push(plane[y * w + x]);
                    }
                }
            }
        }
        HostTensor::new(out, dims)
    })
}

/// torchvision's `_compute_affine_output_size` (the tensor version, in
/// `float32`): the bounding box of the image's corners under `matrix`,
/// rounded outwards after truncating to 1e-4.
fn expanded_size(matrix: &[f64; 6], w: usize, h: usize) -> (usize, usize) {
    let (hw, hh) = ((0.5 * w as f64) as f32, (0.5 * h as f64) as f32);
    let t: Vec<f32> = matrix.iter().map(|&v| v as f32).collect();
    let (mut min, mut max) = ([f32::INFINITY; 2], [f32::NEG_INFINITY; 2]);
    for (x, y) in [(-hw, -hh), (-hw, hh), (hw, hh), (hw, -hh)] {
        let p = [(x * t[0] + y * t[1]) + t[2], (x * t[3] + y * t[4]) + t[5]];
        for k in 0..2 {
            min[k] = min[k].min(p[k]);
            max[k] = max[k].max(p[k]);
        }
    }
    let halfs = [hw, hh];
    let (tol, inv_tol) = (1e-4f64 as f32, (1.0 / 1e-4f64) as f32);
    let side = |k: usize| {
        let hi = (((max[k] + halfs[k]) * inv_tol).trunc() * tol).ceil();
        let lo = (((min[k] + halfs[k]) * inv_tol).trunc() * tol).floor();
        (hi - lo).max(0.0) as usize
    };
    (side(0), side(1))
}

/// Rotates every image by `angle` degrees counter-clockwise about `center`
/// (default the image's centre), as `v2.functional.rotate(img, angle,
/// interpolation, expand, center, fill)`; `expand` grows the output to hold
/// the whole rotated image. Multiples of 90 degrees about the centre are
/// exact transpositions, as in torchvision.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{rotate, Interpolation};
///
/// let img = HostTensor::new(vec![1u8, 2, 3, 4, 5, 6], [1, 2, 3])?;
/// let y = rotate(&img, 90.0, Interpolation::Nearest, true, None, None)?;
/// assert_eq!(y.dims(), &[1, 3, 2]);
/// assert_eq!(y.as_slice::<u8>()?, &[3, 6, 2, 5, 1, 4]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn rotate(
    img: &HostTensor,
    angle: f64,
    interpolation: Interpolation,
    expand: bool,
    center: Option<(f64, f64)>,
    fill: Option<&[f64]>,
) -> Result<HostTensor> {
    if !angle.is_finite() {
        return Err(Error::invalid_argument(
            "angle",
            format!("rotate angle must be finite, got {angle}"),
        ));
    }
    let l = Layout::of(img, "rotate")?;
    check_warp_fill(fill, l.channels, "rotate")?;
    let angle = angle.rem_euclid(360.0);
    if center.is_none() {
        if angle == 0.0 {
            return Ok(img.clone());
        }
        if angle == 180.0 {
            return rot90(img, 2);
        }
        if expand || l.height == l.width {
            if angle == 90.0 {
                return rot90(img, 1);
            }
            if angle == 270.0 {
                return rot90(img, 3);
            }
        }
    }
    let (h, w) = (l.height, l.width);
    let center_f = center.map_or((0.0, 0.0), |(cx, cy)| {
        (cx - w as f64 * 0.5, cy - h as f64 * 0.5)
    });
    let m = inverse_affine_matrix(center_f, -angle, (0.0, 0.0), 1.0, (0.0, 0.0));
    let (ow, oh) = if expand {
        expanded_size(&m, w, h)
    } else {
        (w, h)
    };
    let grid = affine_grid(&m, w, h, ow, oh);
    grid_transform(img, oh, ow, &grid, interpolation, fill)
}

/// The eight coefficients `(a, b, c, d, e, f, g, h)` of the perspective map
/// taking `endpoints` to `startpoints` (four corners each, `[x, y]`):
/// `(x, y) -> ((a x + b y + c) / (g x + h y + 1), (d x + e y + f) / (g x +
/// h y + 1))`, solved in `f64` and rounded to `f32` as torchvision's
/// `_get_perspective_coeffs`. An error when the points are degenerate.
pub fn perspective_coefficients(
    startpoints: &[[i64; 2]; 4],
    endpoints: &[[i64; 2]; 4],
) -> Result<[f64; 8]> {
    let mut a = [[0f64; 9]; 8];
    for i in 0..4 {
        let [ex, ey] = endpoints[i].map(|v| v as f64);
        let [sx, sy] = startpoints[i].map(|v| v as f64);
        a[2 * i] = [ex, ey, 1.0, 0.0, 0.0, 0.0, -sx * ex, -sx * ey, sx];
        a[2 * i + 1] = [0.0, 0.0, 0.0, ex, ey, 1.0, -sy * ex, -sy * ey, sy];
    }
    // Gaussian elimination with partial pivoting on the augmented matrix.
    for col in 0..8 {
        let pivot = (col..8)
            .max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))
            .unwrap_or(col);
        if a[pivot][col].abs() < 1e-12 {
            return Err(Error::invalid_argument(
                "endpoints",
                "perspective: the four points are degenerate (three on a line)",
            ));
        }
        a.swap(col, pivot);
        let pivot_row = a[col];
        for (row, r) in a.iter_mut().enumerate() {
            if row != col {
                let factor = r[col] / pivot_row[col];
                if factor != 0.0 {
                    for (dst, &src) in r[col..].iter_mut().zip(&pivot_row[col..]) {
                        *dst -= factor * src;
                    }
                }
            }
        }
    }
    let mut out = [0f64; 8];
    for (i, o) in out.iter_mut().enumerate() {
        *o = f64::from((a[i][8] / a[i][i]) as f32);
    }
    Ok(out)
}

/// Warps every image by the perspective map with `coefficients` (see
/// [`perspective_coefficients`]), keeping its size, as
/// `v2.functional.perspective(img, None, None, interpolation, fill,
/// coefficients)`.
///
/// ```
/// use kiln_core::HostTensor;
/// use kiln_vision::transforms::{perspective, perspective_coefficients, Interpolation};
///
/// let corners = [[0, 0], [3, 0], [3, 2], [0, 2]];
/// let identity = perspective_coefficients(&corners, &corners)?;
/// let img = HostTensor::new((0..12).collect::<Vec<u8>>(), [1, 3, 4])?;
/// let y = perspective(&img, &identity, Interpolation::Bilinear, None)?;
/// assert_eq!(y.as_slice::<u8>()?, img.as_slice::<u8>()?);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn perspective(
    img: &HostTensor,
    coefficients: &[f64; 8],
    interpolation: Interpolation,
    fill: Option<&[f64]>,
) -> Result<HostTensor> {
    if let Some(v) = coefficients.iter().find(|v| !v.is_finite()) {
        return Err(Error::invalid_argument(
            "coefficients",
            format!("perspective coefficients must be finite, got {v}"),
        ));
    }
    let l = Layout::of(img, "perspective")?;
    check_warp_fill(fill, l.channels, "perspective")?;
    let (oh, ow) = (l.height, l.width);
    let c: Vec<f32> = coefficients.iter().map(|&v| v as f32).collect();
    let (hw, hh) = ((0.5 * ow as f64) as f32, (0.5 * oh as f64) as f32);
    let (a, b, cc) = (c[0] / hw, c[1] / hw, c[2] / hw);
    let (d, e, f) = (c[3] / hh, c[4] / hh, c[5] / hh);
    let (g, hcoef) = (c[6], c[7]);
    let grid = move |x: usize, y: usize| {
        let px = (0.5 + x as f64) as f32;
        let py = (0.5 + y as f64) as f32;
        let den = (px * g + py * hcoef) + 1.0;
        let gx = ((px * a + py * b) + cc) / den - 1.0;
        let gy = ((px * d + py * e) + f) / den - 1.0;
        (gx, gy)
    };
    grid_transform(img, oh, ow, &grid, interpolation, fill)
}

mod random;
pub use random::{AffineParams, RandomAffine, RandomPerspective, RandomRotation, ShearRange};

#[cfg(test)]
mod tests;
