//! Decoding image files into `[C, H, W]` u8 tensors, pixel for pixel as
//! Pillow decodes them (`Image.open(path).convert(mode)`, what torchvision's
//! `ImageFolder` loader does).
//!
//! JPEG goes through libjpeg-turbo's decoder, the one Pillow and torchvision
//! ship, built from source by `mozjpeg-sys` (mozjpeg changes only the
//! encoder) and called with Pillow's settings by `csrc/jpeg_decode.c`. PNG
//! goes through the `png` crate; WebP, BMP, TIFF and GIF through the crates
//! in [`formats`](super::formats).

use std::io::Cursor;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;

use std::ffi::{c_char, c_int, c_uint, CStr};

// The libjpeg-turbo that `csrc/jpeg_decode.c` calls.
use mozjpeg_sys as _;

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

use super::formats;
use super::pixels::{cmyk_to_rgb, Pixels};

/// Most bytes the PNG decoder may allocate for one image (a decompression bomb guard).
const PNG_MEMORY_LIMIT: usize = 1 << 30;

/// The channels [`decode_image`] returns (`"rgb"`, `"gray"`, `"rgba"` in a config).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ColorMode {
    /// Three channels, what torchvision's `ImageFolder` gives (Pillow's
    /// `convert("RGB")`): grayscale replicated, alpha dropped (not blended),
    /// palettes looked up.
    #[default]
    Rgb,
    /// One channel, Pillow's `convert("L")`: from colour,
    /// `L = (19595 R + 38470 G + 7471 B + 32768) >> 16`, i.e.
    /// `R*299/1000 + G*587/1000 + B*114/1000` rounded.
    Gray,
    /// Four channels, Pillow's `convert("RGBA")`: alpha 255 where the file
    /// has none (a PNG `tRNS` colour key becomes alpha 0).
    Rgba,
    /// The channels as stored: 1 (gray), 2 (gray + alpha), 3 (RGB) or 4
    /// (RGBA); palettes expanded to RGB (RGBA with transparency), JPEG
    /// CMYK converted to RGB.
    Unchanged,
}

/// Decodes the JPEG, PNG, WebP, BMP, TIFF, GIF, PGM or PPM image in `bytes` into a
/// `[C, H, W]` u8 tensor whose channels `mode` chooses, equal to Pillow's
/// `Image.open(path).convert(mode)`; `name` (the file, or
/// `shard.tar:key.jpg`) only names the image in errors.
///
/// The format is sniffed from the magic bytes, not from the name's
/// extension. A GIF or an animated WebP gives its first frame. 16-bit PNG
/// and TIFF samples keep their high byte (`v >> 8`, as Pillow does for
/// 16-bit colour and torchvision's `to_dtype(uint8, scale=True)` does for
/// all; Pillow clips 16-bit grayscale at 255 instead). EXIF orientation is
/// not applied (neither Pillow's `open` nor torchvision's `decode_image`
/// apply it by default).
///
/// # Errors
///
/// [`Error::Data`] naming `name` when the data is not an image of these
/// formats, is corrupt, is truncated (a JPEG without its end-of-image
/// marker, as Pillow's "image file is truncated"), or has more than about
/// 179 million pixels (Pillow's decompression bomb guard).
///
/// ```
/// use kiln_vision::{decode_image, ColorMode};
/// use std::path::Path;
///
/// // Not an image: the error names the file.
/// let err = decode_image(b"hello", ColorMode::Rgb, Path::new("a.jpg")).unwrap_err();
/// assert!(err.to_string().contains("a.jpg"));
/// ```
pub fn decode_image(bytes: &[u8], mode: ColorMode, name: &Path) -> Result<HostTensor> {
    let decoded = panic::catch_unwind(AssertUnwindSafe(|| {
        if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
            decode_jpeg(bytes, name)
        } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
            decode_png(bytes, name)
        } else if is_webp(bytes) {
            formats::decode_webp(bytes, name)
        } else if bytes.starts_with(b"BM") {
            formats::decode_bmp(bytes, name)
        } else if bytes.starts_with(b"II*\0") || bytes.starts_with(b"MM\0*") {
            formats::decode_tiff(bytes, name)
        } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
            formats::decode_gif(bytes, name)
        } else if bytes.starts_with(b"P5") || bytes.starts_with(b"P6") {
            formats::decode_pnm(bytes, name)
        } else {
            Err(Error::data(name, Some(0), unknown_format(bytes)))
        }
    }))
    .unwrap_or_else(|_| {
        Err(Error::data(
            name,
            None,
            "the image decoder panicked on this data (corrupt image)",
        ))
    })?;
    decoded.convert(mode).into_tensor()
}

fn is_webp(bytes: &[u8]) -> bool {
    bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP"
}

/// Why `bytes` is not decoded: what it looks like instead.
fn unknown_format(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "the file is empty; expected an image".to_string();
    }
    let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!(
        "not an image Kiln decodes (JPEG, PNG, WebP, BMP, TIFF, GIF, PGM or PPM): it starts with bytes {}",
        head.join(" ")
    )
}

impl Pixels {
    /// The pixels in `mode`'s channels, converted as Pillow's `convert` does.
    fn convert(self, mode: ColorMode) -> Pixels {
        let target = match mode {
            ColorMode::Rgb => 3,
            ColorMode::Gray => 1,
            ColorMode::Rgba => 4,
            ColorMode::Unchanged => return self,
        };
        if target == self.channels {
            return self;
        }
        let c = self.channels;
        let mut out = Vec::with_capacity(self.width * self.height * target);
        for px in self.data.chunks_exact(c) {
            // Gray and gray + alpha read as RGB(A) with equal channels.
            let (r, g, b) = if c >= 3 {
                (px[0], px[1], px[2])
            } else {
                (px[0], px[0], px[0])
            };
            let alpha = match c {
                2 => px[1],
                4 => px[3],
                _ => 255,
            };
            match target {
                1 if c <= 2 => out.push(px[0]),
                1 => out.push(luma(r, g, b)),
                3 => out.extend_from_slice(&[r, g, b]),
                _ => out.extend_from_slice(&[r, g, b, alpha]),
            }
        }
        Pixels {
            data: out,
            width: self.width,
            height: self.height,
            channels: target,
        }
    }

    /// `[C, H, W]`, planar.
    fn into_tensor(self) -> Result<HostTensor> {
        let Pixels {
            data,
            width,
            height,
            channels,
        } = self;
        let plane = width * height;
        let planar = if channels == 1 {
            data
        } else {
            let mut planar = vec![0u8; data.len()];
            for (i, px) in data.chunks_exact(channels).enumerate() {
                for (ch, &v) in px.iter().enumerate() {
                    planar[ch * plane + i] = v;
                }
            }
            planar
        };
        HostTensor::new(planar, [channels, height, width])
    }
}

/// Pillow's `L` from `RGB` (ITU-R 601-2 luma in 16-bit fixed point).
fn luma(r: u8, g: u8, b: u8) -> u8 {
    let l = u32::from(r) * 19595 + u32::from(g) * 38470 + u32::from(b) * 7471 + 0x8000;
    // At most (255 * 65536 + 32768) >> 16 = 255.
    (l >> 16) as u8
}

/// What `kiln_jpeg_read_header` reports (`csrc/jpeg_decode.c`).
#[repr(C)]
#[derive(Default)]
struct JpegHeader {
    width: c_uint,
    height: c_uint,
    components: c_int,
    color_space: c_int,
    progressive: c_int,
}

// libjpeg's `J_COLOR_SPACE` values for the output colour spaces Pillow asks for.
const JCS_GRAYSCALE: c_int = 1;
const JCS_RGB: c_int = 2;
const JCS_CMYK: c_int = 4;

// `csrc/jpeg_decode.c`'s return codes.
const KILN_JPEG_OK: c_int = 0;
const KILN_JPEG_TRUNCATED: c_int = 2;

extern "C" {
    fn kiln_jpeg_read_header(
        data: *const u8,
        len: usize,
        header: *mut JpegHeader,
        message: *mut c_char,
        message_len: usize,
    ) -> c_int;
    fn kiln_jpeg_decode(
        data: *const u8,
        len: usize,
        out_color_space: c_int,
        out: *mut u8,
        out_len: usize,
        message: *mut c_char,
        message_len: usize,
    ) -> c_int;
}

/// A libjpeg return code and message as Kiln's error.
fn jpeg_failure(code: c_int, message: &[c_char], name: &Path) -> Error {
    // SAFETY: the shim writes a NUL-terminated string of at most
    // `message.len()` bytes (or leaves the first byte NUL).
    let text = unsafe { CStr::from_ptr(message.as_ptr()) }.to_string_lossy();
    if code == KILN_JPEG_TRUNCATED {
        Error::data(
            name,
            None,
            format!("truncated JPEG: the data ends inside the image ({text})"),
        )
    } else {
        Error::data(name, None, format!("corrupt JPEG: {text}"))
    }
}

/// Decodes a JPEG as Pillow does (`Image.open`): libjpeg-turbo's decoder
/// with its ISLOW IDCT and fancy upsampling; 1 component as `L`, 3 as
/// `RGB` (libjpeg's YCbCr conversion, or none for an RGB file), 4 as
/// inverted CMYK (Adobe's convention, which Pillow assumes for every CMYK
/// file) converted to RGB as Pillow's `convert("RGB")` does.
fn decode_jpeg(bytes: &[u8], name: &Path) -> Result<Pixels> {
    check_jpeg_complete(bytes, name)?;
    let mut message: [c_char; 200] = [0; 200];
    let mut header = JpegHeader::default();
    // SAFETY: `bytes` and `header` outlive the call; the shim reads at most
    // `bytes.len()` bytes and writes at most `message.len()` bytes.
    let code = unsafe {
        kiln_jpeg_read_header(
            bytes.as_ptr(),
            bytes.len(),
            &mut header,
            message.as_mut_ptr(),
            message.len(),
        )
    };
    if code != KILN_JPEG_OK {
        return Err(jpeg_failure(code, &message, name));
    }
    let (width, height) = (header.width as usize, header.height as usize);
    let (out_space, channels) = match header.components {
        1 => (JCS_GRAYSCALE, 1),
        3 => (JCS_RGB, 3),
        4 => (JCS_CMYK, 4),
        n => {
            return Err(Error::data(
                name,
                None,
                format!(
                "a JPEG of {n} components, which is not supported (expected 1, 3 or 4, as Pillow)"
            ),
            ))
        }
    };
    formats::check_pixels(width, height, "JPEG", name)?;
    let mut data = vec![0u8; width * height * channels];
    // SAFETY: `data` is exactly the `width * height * channels` bytes the
    // shim checks it writes; `bytes` and `message` as above.
    let code = unsafe {
        kiln_jpeg_decode(
            bytes.as_ptr(),
            bytes.len(),
            out_space,
            data.as_mut_ptr(),
            data.len(),
            message.as_mut_ptr(),
            message.len(),
        )
    };
    if code != KILN_JPEG_OK {
        return Err(jpeg_failure(code, &message, name));
    }
    if channels == 4 {
        return Ok(Pixels {
            data: cmyk_to_rgb(&data, true),
            width,
            height,
            channels: 3,
        });
    }
    Ok(Pixels {
        data,
        width,
        height,
        channels,
    })
}

/// Fails unless an end-of-image marker follows the first scan. `zune-jpeg`
/// fills a truncated scan with gray; Pillow (libjpeg) refuses it with "image
/// file is truncated", and so does Kiln: a partial download must not train
/// as a gray image.
fn check_jpeg_complete(bytes: &[u8], name: &Path) -> Result<()> {
    let truncated = |at: usize, what: &str| {
        Err(Error::data(
            name,
            Some(at as u64),
            format!("truncated JPEG: the data ends {what}"),
        ))
    };
    // Walk the marker segments up to the first start-of-scan.
    let mut pos = 2;
    loop {
        if pos >= bytes.len() {
            return truncated(bytes.len(), "before the first scan");
        }
        if bytes[pos] != 0xFF {
            // Garbage between segments: leave the diagnosis to the decoder.
            return Ok(());
        }
        while pos < bytes.len() && bytes[pos] == 0xFF {
            pos += 1;
        }
        let Some(&marker) = bytes.get(pos) else {
            return truncated(bytes.len(), "before the first scan");
        };
        pos += 1;
        match marker {
            0xDA => break,
            0x01 | 0xD0..=0xD7 => continue,
            0xD9 => return Ok(()),
            _ => {
                let Some(len) = bytes.get(pos..pos + 2) else {
                    return truncated(bytes.len(), "inside a marker segment");
                };
                pos += usize::from(u16::from_be_bytes([len[0], len[1]]));
            }
        }
    }
    // Entropy-coded data stuffs every 0xFF with 0x00, so the only 0xFF 0xD9
    // after the first scan is the end-of-image marker.
    if bytes[pos..].windows(2).any(|w| w == [0xFF, 0xD9]) {
        Ok(())
    } else {
        truncated(bytes.len(), "before the end-of-image marker")
    }
}

fn decode_png(bytes: &[u8], name: &Path) -> Result<Pixels> {
    let png_error = |e: png::DecodingError| match e {
        png::DecodingError::IoError(ref io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            Error::data(name, None, "truncated PNG: the data ends inside the image")
        }
        other => Error::data_caused_by(name, None, "corrupt PNG", other),
    };
    let mut decoder = png::Decoder::new_with_limits(
        Cursor::new(bytes),
        png::Limits {
            bytes: PNG_MEMORY_LIMIT,
        },
    );
    // Palettes and tRNS expanded, 1/2/4-bit samples scaled to 8 bits, 16-bit
    // samples cut to their high byte.
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(png_error)?;
    // Before a byte of pixels is allocated: a few hundred KB of zlib can
    // claim 30000x30000.
    let (width, height) = reader.info().size();
    formats::check_pixels(width as usize, height as usize, "PNG", name)?;
    let size = reader
        .output_buffer_size()
        .ok_or_else(|| Error::data(name, None, "the PNG image is too large to decode in memory"))?;
    let mut data = vec![0u8; size];
    let frame = reader.next_frame(&mut data).map_err(png_error)?;
    let channels = match frame.color_type {
        png::ColorType::Grayscale => 1,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::Indexed => {
            return Err(Error::data(
                name,
                None,
                "corrupt PNG: the palette could not be expanded",
            ))
        }
    };
    let (width, height) = (frame.width as usize, frame.height as usize);
    if frame.bit_depth != png::BitDepth::Eight || frame.line_size != width * channels {
        return Err(Error::data(
            name,
            None,
            format!(
                "unexpected PNG layout after expansion: {:?} at {:?} bits, {} bytes per row",
                frame.color_type, frame.bit_depth, frame.line_size
            ),
        ));
    }
    data.truncate(width * height * channels);
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
    fn luma_is_pillows_fixed_point_formula() {
        // L = R*299/1000 + G*587/1000 + B*114/1000, rounded.
        for (r, g, b) in [(255, 255, 255), (0, 0, 0), (255, 0, 0), (10, 200, 30)] {
            let exact =
                (f64::from(r) * 0.299 + f64::from(g) * 0.587 + f64::from(b) * 0.114).round();
            assert!((f64::from(luma(r, g, b)) - exact).abs() <= 1.0);
        }
        assert_eq!(luma(255, 255, 255), 255);
        assert_eq!(luma(255, 0, 0), 76);
    }

    #[test]
    fn conversions_replicate_and_drop_channels() -> Result<()> {
        let la = Pixels {
            data: vec![10, 200, 20, 100],
            width: 2,
            height: 1,
            channels: 2,
        };
        let rgba = la.convert(ColorMode::Rgba).into_tensor()?;
        assert_eq!(rgba.dims(), &[4, 1, 2]);
        assert_eq!(rgba.as_slice::<u8>()?, &[10, 20, 10, 20, 10, 20, 200, 100]);
        let rgb = Pixels {
            data: vec![1, 2, 3, 4, 5, 6],
            width: 1,
            height: 2,
            channels: 3,
        };
        let t = rgb.convert(ColorMode::Rgb).into_tensor()?;
        assert_eq!(t.as_slice::<u8>()?, &[1, 4, 2, 5, 3, 6]);
        Ok(())
    }

    #[test]
    fn unknown_formats_and_truncation_are_data_errors() {
        let name = Path::new("x.jpg");
        for (bytes, needle) in [
            (&b""[..], "empty"),
            (b"BM\0\0\0\0", "BMP"),
            (b"RIFF\0\0\0\0WEBPVP8 ", "WebP"),
            (b"II*\0\x08\0", "TIFF"),
            (b"GIF89a\x01", "GIF"),
            (b"P3\n1 1\n255\n", "JPEG, PNG"),
            (b"P6\n1 1\n255\n", "truncated PNM"),
            (b"P5 2 1 15\n\x01\x02", "maxval 15"),
            (b"\xFF\xD8\xFF\xE0\x00\x10JFIF", "truncated JPEG"),
        ] {
            let err = decode_image(bytes, ColorMode::Rgb, name).expect_err(needle);
            assert!(matches!(err, Error::Data { .. }), "{err:?}");
            let text = err.to_string();
            assert!(text.contains("x.jpg") && text.contains(needle), "{text}");
        }
    }
}
