//! Decoded pixels as every decoder returns them (`decode.rs` and the
//! formats in `formats.rs`), and the one colour conversion the decoders share.

/// Interleaved 8-bit pixels, `channels` per pixel.
pub(super) struct Pixels {
    pub(super) data: Vec<u8>,
    pub(super) width: usize,
    pub(super) height: usize,
    pub(super) channels: usize,
}

/// Pillow's `CMYK` to `RGB` conversion, `v = (255 - k) - c * (255 - k) / 255`
/// with Pillow's rounded division by 255; `inverted` CMYK (Adobe's JPEG
/// convention, Pillow's `CMYK;I`) has every channel stored as `255 - v`.
pub(super) fn cmyk_to_rgb(cmyk: &[u8], inverted: bool) -> Vec<u8> {
    let flip = if inverted { 255 } else { 0 };
    let mut out = Vec::with_capacity(cmyk.len() / 4 * 3);
    for px in cmyk.chunks_exact(4) {
        let nk = 255 - u32::from(px[3] ^ flip);
        for &stored in &px[..3] {
            let t = u32::from(stored ^ flip) * nk + 128;
            // At most nk, since the channel is at most 255.
            out.push((nk - (((t >> 8) + t) >> 8)) as u8);
        }
    }
    out
}
