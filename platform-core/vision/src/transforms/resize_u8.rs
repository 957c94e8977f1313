//! The `uint8` antialiased bilinear resize, PyTorch's fixed-point kernel
//! (`UpSampleKernelAVXAntialias.h`, what torchvision runs on x86-64): int16
//! weights, a horizontal pass rounded to `uint8`, then a vertical pass.
//!
//! As PyTorch does, images of 2 to 4 channels are resampled with their
//! channels packed in 4 bytes a pixel, so that one pixel's channels are one
//! vector of `i32` sums; every output pixel's taps are a window of the same
//! width (zero weights pad the short ones), so the loops have no bounds to
//! check. The sums are PyTorch's, term for term: the result is bit-exact.

use super::taps::{taps_i16, Taps};

/// The packed pixels' buffers, kept by each thread (a loader worker resizes
/// image after image): allocating them anew took a page fault per 4 KiB.
#[derive(Default)]
struct Scratch(Vec<[u8; 4]>);

impl Scratch {
    /// At least `len` pixels (stale contents: every one is written before read).
    fn sized(&mut self, len: usize) -> &mut [[u8; 4]] {
        if self.0.len() < len {
            self.0.resize(len, [0; 4]);
        }
        &mut self.0[..len]
    }
}

/// The most pixels (4 bytes each) a thread keeps between resizes: 16 MiB,
/// the buffers of an image of about two million pixels.
const SCRATCH_KEPT_PIXELS: usize = 4 << 20;

thread_local! {
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

/// Every output's taps as a window of `width` inputs starting at
/// `starts[i]`, inside the input (`starts[i] + width <= input`).
struct Windows {
    starts: Vec<usize>,
    weights: Vec<i32>,
    width: usize,
}

impl Windows {
    fn new(taps: &Taps<i32>, input: usize) -> Windows {
        // An even width (a zero weight past the odd one) when the input
        // allows it, for the vector kernel's taps in pairs.
        let width = (taps.stride + taps.stride % 2).min(input);
        let outputs = taps.starts.len();
        let mut starts = Vec::with_capacity(outputs);
        let mut weights = vec![0i32; outputs * width];
        for i in 0..outputs {
            let (start, k) = taps.get(i);
            // Shift the window left where it would pass the input's end.
            let window = start.min(input - width);
            let offset = start - window;
            weights[i * width + offset..i * width + offset + k.len()].copy_from_slice(k);
            starts.push(window);
        }
        Windows {
            starts,
            weights,
            width,
        }
    }
}

/// Resizes `planes` planes of `h` x `w` (planes `channels` at a time, one
/// image's channels) to `oh` x `ow`.
pub(super) fn resize_u8(
    src: &[u8],
    planes: usize,
    channels: usize,
    input: (usize, usize),
    output: (usize, usize),
) -> Vec<u8> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above; the function is the
        // same safe code compiled for it.
        return unsafe { resize_u8_avx2(src, planes, channels, input, output) };
    }
    resize_u8_portable(src, planes, channels, input, output)
}

/// [`resize_u8_portable`] compiled with AVX2, where the channel sums and the
/// vertical pass vectorise 8 and 32 lanes wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn resize_u8_avx2(
    src: &[u8],
    planes: usize,
    channels: usize,
    input: (usize, usize),
    output: (usize, usize),
) -> Vec<u8> {
    resize_u8_with(src, planes, channels, input, output, true)
}

#[inline(always)]
fn resize_u8_portable(
    src: &[u8],
    planes: usize,
    channels: usize,
    input: (usize, usize),
    output: (usize, usize),
) -> Vec<u8> {
    resize_u8_with(src, planes, channels, input, output, false)
}

#[inline(always)]
fn resize_u8_with(
    src: &[u8],
    planes: usize,
    channels: usize,
    (h, w): (usize, usize),
    (oh, ow): (usize, usize),
    simd: bool,
) -> Vec<u8> {
    let mut out = vec![0u8; planes * oh * ow];
    let horizontal = (ow != w).then(|| taps_i16(w, ow));
    let vertical = (oh != h).then(|| taps_i16(h, oh));
    let hwin = horizontal.as_ref().map(|(t, p)| (Windows::new(t, w), *p));
    let vwin = vertical.as_ref().map(|(t, p)| (Windows::new(t, h), *p));
    if (2..=4).contains(&channels) {
        let mut scratch = SCRATCH.take();
        let (packed, rest) = scratch.sized(h * w + h * ow + oh * ow).split_at_mut(h * w);
        let (mid, done) = rest.split_at_mut(h * ow);
        for (image_in, image_out) in src
            .chunks_exact(channels * h * w)
            .zip(out.chunks_exact_mut(channels * oh * ow))
        {
            pack(image_in, channels, packed);
            let rows = match &hwin {
                Some((win, precision)) => {
                    horizontal_packed(packed, w, ow, win, *precision, mid, simd);
                    &*mid
                }
                None => &*packed,
            };
            let result = match &vwin {
                Some((win, precision)) => {
                    vertical_packed(rows, ow, win, *precision, done);
                    &*done
                }
                None => rows,
            };
            unpack(result, channels, image_out);
        }
        // A huge image's buffers are not kept.
        if scratch.0.len() <= SCRATCH_KEPT_PIXELS {
            SCRATCH.set(scratch);
        }
        return out;
    }
    let mut mid = vec![0u8; h * ow];
    for (plane_in, plane_out) in src.chunks_exact(h * w).zip(out.chunks_exact_mut(oh * ow)) {
        let rows = match &hwin {
            Some((win, precision)) => {
                horizontal_plane(plane_in, w, ow, win, *precision, &mut mid);
                &mid[..]
            }
            None => plane_in,
        };
        match &vwin {
            Some((win, precision)) => vertical_plane(rows, ow, win, *precision, plane_out),
            None => plane_out.copy_from_slice(rows),
        }
    }
    out
}

/// One image's `channels` planes as 4-byte pixels (the 4th byte 0 for 3
/// channels, and the 3rd too for 2).
#[inline(always)]
fn pack(planes: &[u8], channels: usize, out: &mut [[u8; 4]]) {
    let n = out.len();
    let plane = |c: usize| &planes[c * n..(c + 1) * n];
    match channels {
        4 => {
            for ((((px, &r), &g), &b), &a) in out
                .iter_mut()
                .zip(plane(0))
                .zip(plane(1))
                .zip(plane(2))
                .zip(plane(3))
            {
                *px = [r, g, b, a];
            }
        }
        3 => {
            for (((px, &r), &g), &b) in out.iter_mut().zip(plane(0)).zip(plane(1)).zip(plane(2)) {
                *px = [r, g, b, 0];
            }
        }
        _ => {
            for ((px, &r), &g) in out.iter_mut().zip(plane(0)).zip(plane(1)) {
                *px = [r, g, 0, 0];
            }
        }
    }
}

/// The inverse of [`pack`].
#[inline(always)]
fn unpack(pixels: &[[u8; 4]], channels: usize, planes: &mut [u8]) {
    let n = pixels.len();
    let (first, rest) = planes.split_at_mut(n);
    let (second, rest) = rest.split_at_mut(n);
    match channels {
        4 | 3 => {
            let (third, fourth) = rest.split_at_mut(n);
            for (((px, r), g), b) in pixels.iter().zip(first).zip(second).zip(third) {
                (*r, *g, *b) = (px[0], px[1], px[2]);
            }
            if channels == 4 {
                for (px, a) in pixels.iter().zip(fourth) {
                    *a = px[3];
                }
            }
        }
        _ => {
            for ((px, r), g) in pixels.iter().zip(first).zip(second) {
                (*r, *g) = (px[0], px[1]);
            }
        }
    }
}

/// Fixed-point rounding of an accumulated sum back to `uint8`.
#[inline(always)]
fn to_u8(sum: i32, precision: u32) -> u8 {
    (sum >> precision).clamp(0, 255) as u8
}

#[inline(always)]
fn horizontal_packed(
    src: &[[u8; 4]],
    w: usize,
    ow: usize,
    win: &Windows,
    precision: u32,
    out: &mut [[u8; 4]],
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd && win.width.is_multiple_of(2) {
        // SAFETY: `simd` is set only by `resize_u8_avx2`, on a CPU with AVX2
        // (so SSSE3 and SSE4.1); the windows lie inside the rows.
        unsafe { x86::horizontal_packed(src, w, ow, win, precision, out) };
        return;
    }
    let _ = simd;
    let round = 1i32 << (precision - 1);
    let width = win.width;
    for (row_in, row_out) in src.chunks_exact(w).zip(out.chunks_exact_mut(ow)) {
        for ((o, &start), k) in row_out
            .iter_mut()
            .zip(&win.starts)
            .zip(win.weights.chunks_exact(width))
        {
            let mut acc = [round; 4];
            for (p, &kk) in row_in[start..start + width].iter().zip(k) {
                for c in 0..4 {
                    acc[c] += i32::from(p[c]) * kk;
                }
            }
            *o = acc.map(|a| to_u8(a, precision));
        }
    }
}

#[inline(always)]
fn vertical_packed(src: &[[u8; 4]], ow: usize, win: &Windows, precision: u32, out: &mut [[u8; 4]]) {
    let flat_src = src.as_flattened();
    let flat_out = out.as_flattened_mut();
    vertical_plane(flat_src, ow * 4, win, precision, flat_out);
}

#[inline(always)]
fn horizontal_plane(
    src: &[u8],
    w: usize,
    ow: usize,
    win: &Windows,
    precision: u32,
    out: &mut [u8],
) {
    let round = 1i32 << (precision - 1);
    let width = win.width;
    for (row_in, row_out) in src.chunks_exact(w).zip(out.chunks_exact_mut(ow)) {
        for ((o, &start), k) in row_out
            .iter_mut()
            .zip(&win.starts)
            .zip(win.weights.chunks_exact(width))
        {
            let mut acc = round;
            for (&p, &kk) in row_in[start..start + width].iter().zip(k) {
                acc += i32::from(p) * kk;
            }
            *o = to_u8(acc, precision);
        }
    }
}

/// The vertical pass over rows of `row` values, in chunks of 64 columns
/// whose sums stay in registers across the taps.
#[inline(always)]
fn vertical_plane(src: &[u8], row: usize, win: &Windows, precision: u32, out: &mut [u8]) {
    const CHUNK: usize = 64;
    let round = 1i32 << (precision - 1);
    let width = win.width;
    for ((row_out, &start), k) in out
        .chunks_exact_mut(row)
        .zip(&win.starts)
        .zip(win.weights.chunks_exact(width))
    {
        let taps = &src[start * row..(start + width) * row];
        let mut x = 0;
        while x + CHUNK <= row {
            let mut acc = [round; CHUNK];
            for (j, &kk) in k.iter().enumerate() {
                let line: &[u8; CHUNK] = taps[j * row + x..j * row + x + CHUNK]
                    .try_into()
                    .unwrap_or(&[0; CHUNK]);
                for (a, &p) in acc.iter_mut().zip(line) {
                    *a += i32::from(p) * kk;
                }
            }
            for (o, &a) in row_out[x..x + CHUNK].iter_mut().zip(&acc) {
                *o = to_u8(a, precision);
            }
            x += CHUNK;
        }
        for (i, o) in row_out.iter_mut().enumerate().skip(x) {
            let mut acc = round;
            for (j, &kk) in k.iter().enumerate() {
                acc += i32::from(taps[j * row + i]) * kk;
            }
            *o = to_u8(acc, precision);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Windows;

    /// The horizontal pass on 4-byte pixels, two taps a step: the two
    /// pixels' bytes interleaved as 16-bit pairs, multiplied by the two
    /// weights and summed per channel (`pmaddwd`), which is PyTorch's
    /// sum term for term (the products and their sums fit in `i32`).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn horizontal_packed(
        src: &[[u8; 4]],
        w: usize,
        ow: usize,
        win: &Windows,
        precision: u32,
        out: &mut [[u8; 4]],
    ) {
        let width = win.width;
        let round = _mm_set1_epi32(1 << (precision - 1));
        let shift = _mm_cvtsi32_si128(precision as i32);
        // Bytes a0 a1 a2 a3 b0 b1 b2 b3 to the 16-bit pairs (a0, b0) ... (a3, b3).
        let interleave = _mm_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1);
        // Two taps' weights, as 16-bit pairs repeated over the 4 channels.
        let pairs: Vec<__m128i> = win
            .weights
            .chunks_exact(2)
            .map(|k| {
                let pair = (k[0] as u16 as u32) | ((k[1] as u16 as u32) << 16);
                _mm_set1_epi32(pair as i32)
            })
            .collect();
        for (row_in, row_out) in src.chunks_exact(w).zip(out.chunks_exact_mut(ow)) {
            let base = row_in.as_ptr().cast::<u8>();
            for ((o, &start), k) in row_out
                .iter_mut()
                .zip(&win.starts)
                .zip(pairs.chunks_exact(width / 2))
            {
                let mut acc = round;
                for (j, &weights) in k.iter().enumerate() {
                    // SAFETY: pixels start + 2j and start + 2j + 1 lie in the
                    // row: start + width <= w.
                    let two = unsafe { _mm_loadl_epi64(base.add((start + 2 * j) * 4).cast()) };
                    let pixels = _mm_shuffle_epi8(two, interleave);
                    acc = _mm_add_epi32(acc, _mm_madd_epi16(pixels, weights));
                }
                let shifted = _mm_sra_epi32(acc, shift);
                let bytes = _mm_packus_epi16(_mm_packs_epi32(shifted, shifted), shifted);
                *o = (_mm_cvtsi128_si32(bytes) as u32).to_le_bytes();
            }
        }
    }
}
