//! WebP, BMP, TIFF, GIF, PGM and PPM, the other formats torchvision's `ImageFolder`
//! lists, decoded to the pixels Pillow's `Image.open(path)` gives before
//! `convert(mode)` (which [`Pixels::convert`] then applies).
//!
//! * WebP through `image-webp` (lossy with libwebp's fancy upsampling, and
//!   lossless; the first frame of an animation);
//! * BMP through `zune-bmp` (1 to 32 bits, palettes, RLE);
//! * TIFF through `tiff` (uncompressed, LZW, Deflate, PackBits, CCITT fax;
//!   gray, RGB, RGBA and CMYK; 16-bit samples keep their high byte as PNG's;
//!   palette, YCbCr and JPEG-compressed TIFFs are refused);
//! * binary PGM and PPM (8-bit) read directly;
//! * GIF through `gif`: the first frame on the logical screen, as Pillow
//!   loads it (outside the frame the transparent index, or index 0).

use std::io::Cursor;
use std::path::Path;

use kiln_core::error::{Error, Result};

use super::pixels::{cmyk_to_rgb, Pixels};
use zune_bmp::zune_core::bytestream::ZCursor;

/// Most pixels an image may have: Pillow's `MAX_IMAGE_PIXELS` guard, which
/// refuses twice its 89 million pixel warning threshold.
pub(super) const MAX_PIXELS: usize = 2 * 89_478_485;

/// Fails when `width * height` exceeds [`MAX_PIXELS`].
pub(super) fn check_pixels(width: usize, height: usize, what: &str, name: &Path) -> Result<()> {
    if width.saturating_mul(height) > MAX_PIXELS {
        return Err(Error::data(
            name,
            None,
            format!(
                "the {what} image is {width}x{height}, more than {MAX_PIXELS} pixels (Pillow's decompression bomb guard)"
            ),
        ));
    }
    Ok(())
}

pub(super) fn decode_webp(bytes: &[u8], name: &Path) -> Result<Pixels> {
    let webp_error = |e: image_webp::DecodingError| {
        Error::data(name, None, format!("corrupt or truncated WebP: {e}"))
    };
    // The RIFF header gives the file's size: a shorter file is a partial
    // download, which libwebp's demuxer (Pillow's) refuses and `image-webp`
    // would decode with the missing part filled in.
    let riff = le_u32(bytes, 4).map_or(0, |n| n as usize + 8);
    if bytes.len() < riff {
        return Err(Error::data(
            name,
            Some(bytes.len() as u64),
            format!(
                "truncated WebP: the data ends after {} of its {riff} bytes",
                bytes.len()
            ),
        ));
    }
    let mut decoder = image_webp::WebPDecoder::new(Cursor::new(bytes)).map_err(webp_error)?;
    let (width, height) = decoder.dimensions();
    let (width, height) = (width as usize, height as usize);
    check_pixels(width, height, "WebP", name)?;
    let channels = if decoder.has_alpha() { 4 } else { 3 };
    let mut data = vec![0u8; width * height * channels];
    decoder.read_image(&mut data).map_err(webp_error)?;
    Ok(Pixels {
        data,
        width,
        height,
        channels,
    })
}

pub(super) fn decode_bmp(bytes: &[u8], name: &Path) -> Result<Pixels> {
    use zune_bmp::zune_core::colorspace::ColorSpace;
    if let Some(pixels) = decode_low_depth_bmp(bytes, name)? {
        return Ok(pixels);
    }
    let bmp_error =
        |e: zune_bmp::BmpDecoderErrors| Error::data(name, None, format!("corrupt BMP: {e:?}"));
    let mut decoder = zune_bmp::BmpDecoder::new(ZCursor::new(bytes));
    decoder.decode_headers().map_err(bmp_error)?;
    let (width, height) = decoder
        .dimensions()
        .ok_or_else(|| Error::data(name, None, "corrupt BMP: no dimensions"))?;
    check_pixels(width, height, "BMP", name)?;
    let channels = match decoder.colorspace() {
        Some(ColorSpace::Luma) => 1,
        Some(ColorSpace::RGB) => 3,
        Some(ColorSpace::RGBA) => 4,
        other => {
            return Err(Error::data(
                name,
                None,
                format!("a BMP in colour space {other:?}, which is not supported"),
            ))
        }
    };
    let data = decoder.decode().map_err(bmp_error)?;
    if data.len() != width * height * channels {
        return Err(Error::data(
            name,
            None,
            format!(
                "corrupt BMP: decoded {} bytes for {width}x{height} pixels of {channels} channels",
                data.len()
            ),
        ));
    }
    Ok(Pixels {
        data,
        width,
        height,
        channels,
    })
}

/// Little-endian integers of a BMP header; `None` past the end.
fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    b.get(at..at + 2).map(|s| u16::from_le_bytes([s[0], s[1]]))
}
fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// Uncompressed 1, 2 and 4-bit palette BMPs (`zune-bmp` does not step over
/// the padding of their rows to 4 bytes); `None` for every other kind.
fn decode_low_depth_bmp(bytes: &[u8], name: &Path) -> Result<Option<Pixels>> {
    let corrupt = |what: &str| Error::data(name, None, format!("corrupt BMP: {what}"));
    let (Some(offset), Some(dib)) = (le_u32(bytes, 10), le_u32(bytes, 14)) else {
        return Ok(None);
    };
    // BITMAPINFOHEADER and its successors (not the 12-byte OS/2 header).
    if dib < 40 {
        return Ok(None);
    }
    let depth = le_u16(bytes, 28).ok_or_else(|| corrupt("the header is cut short"))?;
    let compression = le_u32(bytes, 30).ok_or_else(|| corrupt("the header is cut short"))?;
    if !matches!(depth, 1 | 2 | 4) || compression != 0 {
        return Ok(None);
    }
    let width = le_u32(bytes, 18).ok_or_else(|| corrupt("no width"))? as i32;
    let height = le_u32(bytes, 22).ok_or_else(|| corrupt("no height"))? as i32;
    if width <= 0 || height == 0 {
        return Err(corrupt(&format!("a size of {width}x{height}")));
    }
    let (width, top_down, height) = (width as usize, height < 0, height.unsigned_abs() as usize);
    check_pixels(width, height, "BMP", name)?;
    let used = le_u32(bytes, 46).unwrap_or(0) as usize;
    let entries = if used == 0 {
        1 << depth
    } else {
        used.min(1 << depth)
    };
    let palette_at = 14 + dib as usize;
    let palette: Vec<[u8; 3]> = (0..entries)
        .map(|i| {
            bytes
                .get(palette_at + 4 * i..palette_at + 4 * i + 3)
                .map(|bgr| [bgr[2], bgr[1], bgr[0]])
                .ok_or_else(|| corrupt("the palette is cut short"))
        })
        .collect::<Result<_>>()?;
    let stride = (width * usize::from(depth)).div_ceil(32) * 4;
    let start = offset as usize;
    let needed = stride * height;
    let rows = bytes
        .get(start..start.saturating_add(needed))
        .ok_or_else(|| {
            Error::data(
                name,
                None,
                format!(
                    "truncated BMP: {needed} bytes of pixels expected from offset {start}, the file has {}",
                    bytes.len()
                ),
            )
        })?;
    let per_byte = 8 / usize::from(depth);
    let mask = (1u8 << depth) - 1;
    let mut data = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        let stored = if top_down { y } else { height - 1 - y };
        let row = &rows[stored * stride..(stored + 1) * stride];
        for x in 0..width {
            let shift = 8 - usize::from(depth) * (x % per_byte + 1);
            let index = usize::from((row[x / per_byte] >> shift) & mask);
            // An index past a short palette reads black, as Pillow's padding.
            data.extend_from_slice(palette.get(index).unwrap_or(&[0, 0, 0]));
        }
    }
    Ok(Some(Pixels {
        data,
        width,
        height,
        channels: 3,
    }))
}

/// Binary PGM (`P5`) and PPM (`P6`) files of 8-bit samples (`maxval` 255),
/// the `.pgm` and `.ppm` of torchvision's extensions.
pub(super) fn decode_pnm(bytes: &[u8], name: &Path) -> Result<Pixels> {
    let corrupt = |what: String| Error::data(name, None, format!("corrupt PNM: {what}"));
    let channels = match bytes.get(..2) {
        Some(b"P5") => 1,
        Some(b"P6") => 3,
        _ => {
            return Err(corrupt(
                "only binary PGM (P5) and PPM (P6) files are decoded".to_string(),
            ))
        }
    };
    // Three numbers (width, height, maxval) separated by whitespace and
    // comments, then one whitespace byte before the samples.
    let mut at = 2;
    let mut numbers = [0usize; 3];
    for number in &mut numbers {
        loop {
            match bytes.get(at) {
                Some(b) if b.is_ascii_whitespace() => at += 1,
                Some(b'#') => {
                    while bytes.get(at).is_some_and(|&b| b != b'\n') {
                        at += 1;
                    }
                }
                _ => break,
            }
        }
        let start = at;
        while bytes.get(at).is_some_and(u8::is_ascii_digit) {
            at += 1;
        }
        *number = std::str::from_utf8(&bytes[start..at])
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| corrupt(format!("expected a number in the header at byte {start}")))?;
    }
    let [width, height, maxval] = numbers;
    if maxval != 255 {
        return Err(Error::data(
            name,
            None,
            format!(
                "a PNM of maxval {maxval}, which Kiln does not decode (only 255, 8-bit samples)"
            ),
        ));
    }
    check_pixels(width, height, "PNM", name)?;
    let start = at + 1;
    let needed = width * height * channels;
    let data = bytes
        .get(start..start + needed)
        .ok_or_else(|| {
            Error::data(
                name,
                Some(bytes.len() as u64),
                format!("truncated PNM: {needed} bytes of samples expected from byte {start}"),
            )
        })?
        .to_vec();
    Ok(Pixels {
        data,
        width,
        height,
        channels,
    })
}

pub(super) fn decode_tiff(bytes: &[u8], name: &Path) -> Result<Pixels> {
    use tiff::decoder::{Decoder, DecodingResult, Limits};
    use tiff::ColorType;
    let tiff_error = |e: tiff::TiffError| {
        match e {
        tiff::TiffError::UnsupportedError(e) => Error::data(
            name,
            None,
            format!("a TIFF Kiln does not decode: {e} (palette, YCbCr, Lab and JPEG-compressed TIFFs are not supported)"),
        ),
        e => Error::data(name, None, format!("corrupt TIFF: {e}")),
    }
    };
    let mut limits = Limits::default();
    limits.decoding_buffer_size = MAX_PIXELS * 4;
    let mut decoder = Decoder::new(Cursor::new(bytes))
        .map_err(tiff_error)?
        .with_limits(limits);
    let (width, height) = decoder.dimensions().map_err(tiff_error)?;
    let (width, height) = (width as usize, height as usize);
    check_pixels(width, height, "TIFF", name)?;
    let color = decoder.colortype().map_err(tiff_error)?;
    let unsupported = || {
        Error::data(
            name,
            None,
            format!("a TIFF of colour type {color:?}, which Kiln does not decode (expected 8 or 16-bit gray, gray + alpha, RGB or RGBA, 8-bit CMYK, or 1-bit gray)"),
        )
    };
    let samples = match color {
        ColorType::Gray(8 | 16) => 1,
        ColorType::Gray(1) => 1,
        ColorType::GrayA(8 | 16) => 2,
        ColorType::RGB(8 | 16) => 3,
        ColorType::RGBA(8 | 16) | ColorType::CMYK(8) => 4,
        _ => return Err(unsupported()),
    };
    let image = decoder.read_image().map_err(tiff_error)?;
    let mut data = match image {
        // 16-bit samples keep their high byte, as 16-bit PNGs do.
        DecodingResult::U16(v) => v.iter().map(|s| (s >> 8) as u8).collect(),
        DecodingResult::U8(v) => v,
        _ => return Err(unsupported()),
    };
    if color == ColorType::Gray(1) {
        data = unpack_bits(&data, width, height);
    }
    if data.len() != width * height * samples {
        return Err(Error::data(
            name,
            None,
            format!(
                "corrupt TIFF: decoded {} samples for {width}x{height} pixels of {samples} samples",
                data.len()
            ),
        ));
    }
    let pixels = |data, channels| Pixels {
        data,
        width,
        height,
        channels,
    };
    match color {
        ColorType::CMYK(_) => Ok(pixels(cmyk_to_rgb(&data, false), 3)),
        _ => Ok(pixels(data, samples)),
    }
}

/// 1-bit rows, each padded to a byte, as 0 and 255.
fn unpack_bits(packed: &[u8], width: usize, height: usize) -> Vec<u8> {
    let row_bytes = width.div_ceil(8);
    let mut out = Vec::with_capacity(width * height);
    for row in packed.chunks(row_bytes).take(height) {
        for x in 0..width {
            let bit = row.get(x / 8).is_some_and(|b| b & (0x80 >> (x % 8)) != 0);
            out.push(if bit { 255 } else { 0 });
        }
    }
    out
}

pub(super) fn decode_gif(bytes: &[u8], name: &Path) -> Result<Pixels> {
    let gif_error = |e: gif::DecodingError| Error::data(name, None, format!("corrupt GIF: {e}"));
    let mut options = gif::DecodeOptions::new();
    options.set_color_output(gif::ColorOutput::Indexed);
    options.set_memory_limit(gif::MemoryLimit::Bytes(
        std::num::NonZeroU64::new(MAX_PIXELS as u64).unwrap_or(std::num::NonZeroU64::MIN),
    ));
    let mut decoder = options.read_info(Cursor::new(bytes)).map_err(gif_error)?;
    let (width, height) = (usize::from(decoder.width()), usize::from(decoder.height()));
    check_pixels(width, height, "GIF", name)?;
    let global = decoder.global_palette().map(<[u8]>::to_vec);
    let frame = decoder
        .read_next_frame()
        .map_err(gif_error)?
        .ok_or_else(|| Error::data(name, None, "corrupt GIF: no image in the file"))?;
    let palette = frame.palette.clone().or(global);
    let transparent = frame.transparent;
    // The logical screen holds the transparent index, or 0, outside the frame.
    let mut indices = vec![transparent.unwrap_or(0); width * height];
    let (left, top) = (usize::from(frame.left), usize::from(frame.top));
    let (fw, fh) = (usize::from(frame.width), usize::from(frame.height));
    // The part of the frame on the screen (a frame may reach past it).
    let visible = fw.min(width.saturating_sub(left));
    let rows = if visible == 0 {
        0
    } else {
        fh.min(height.saturating_sub(top))
    };
    for y in 0..rows {
        let Some(src) = frame.buffer.get(y * fw..y * fw + visible) else {
            return Err(Error::data(
                name,
                None,
                "corrupt GIF: a frame shorter than its size",
            ));
        };
        indices[(top + y) * width + left..][..visible].copy_from_slice(src);
    }
    let Some(palette) = palette else {
        // No palette: Pillow reads the indices as gray levels (mode `L`).
        return Ok(Pixels {
            data: indices,
            width,
            height,
            channels: 1,
        });
    };
    let colour = |i: u8| -> [u8; 3] {
        let at = usize::from(i) * 3;
        palette
            .get(at..at + 3)
            .map_or([0, 0, 0], |c| [c[0], c[1], c[2]])
    };
    let (data, channels) = match transparent {
        Some(t) => (
            indices
                .iter()
                .flat_map(|&i| {
                    let [r, g, b] = colour(i);
                    [r, g, b, if i == t { 0 } else { 255 }]
                })
                .collect(),
            4,
        ),
        None => (indices.iter().flat_map(|&i| colour(i)).collect(), 3),
    };
    Ok(Pixels {
        data,
        width,
        height,
        channels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bit_rows_are_padded_to_bytes() {
        // Width 10: two bytes a row.
        let packed = [0b1010_0000, 0b0100_0000, 0b0000_0000, 0b1100_0000];
        let px = unpack_bits(&packed, 10, 2);
        assert_eq!(&px[..10], &[255, 0, 255, 0, 0, 0, 0, 0, 0, 255]);
        assert_eq!(&px[10..], &[0, 0, 0, 0, 0, 0, 0, 0, 255, 255]);
    }
}
