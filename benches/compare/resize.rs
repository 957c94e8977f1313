//! Beside (j): the resize its augmentations rest on, alone. One uint8 image of
//! [3, 375, 500] (deterministic noise on a gradient, written once to the task's
//! directory) resized with antialiased bilinear interpolation so that its shorter
//! side becomes 256 ([3, 256, 341]), on one thread: Kiln's `vision::resize`
//! against torchvision's `v2.functional.resize(t, [256], antialias=True)` on the
//! same tensor. Both sides compare their output with the one torchvision wrote at
//! preparation (`expected.u8`): Kiln's resize claims to be bit-exact, so a Kiln
//! variant whose maximum difference is not 0 fails.

use std::path::Path;

use anyhow::{bail, ensure, Result};
use kiln::core::HostTensor;
use kiln::vision::transforms::{resize, ResizeTo};
use serde_json::{json, Value};

use crate::tasks::TaskArgs;
use crate::worker::{median, timed};
use crate::xorshift;

pub const DESCRIBE: &str = "(j, resize) uint8 [3, 375, 500] to shorter side 256 ([3, 256, 341]), \
     bilinear with antialias, one image at a time on one thread: Kiln's `vision::resize` against \
     torchvision's `v2.functional.resize(img, [256], antialias=True)`";

pub const VARIANTS: [&str; 2] = ["kiln-resize", "torchvision-resize"];

/// The source image `[channels, height, width]`, the shorter side it is resized
/// to, and the output's shape.
pub const SOURCE: [usize; 3] = [3, 375, 500];
pub const SHORTER: usize = 256;
pub const OUTPUT: [usize; 3] = [3, 256, 341];
/// Resizes per timed repeat (`bench_tasks.py` uses the same number).
pub const CALLS: usize = 200;

/// Writes the source image (`input.u8`, raw bytes in [C, H, W] order) and has
/// torchvision write its resize of it (`expected.u8`).
pub fn prepare(dir: &Path, mut python: std::process::Command) -> Result<()> {
    let [c, h, w] = SOURCE;
    let mut next = xorshift(0x6a09_e667_f3bc_c908);
    // A gradient per channel with noise of +-32 on it: smooth enough to look
    // like an image, rough enough that every rounding of the kernel shows.
    let pixels: Vec<u8> = (0..c * h * w)
        .map(|i| {
            let (ch, y, x) = (i / (h * w), i / w % h, i % w);
            let base = (x * 255 / w + y * 255 / h + ch * 85) as i64 / 2;
            let noise = (next() >> 58) as i64 - 32;
            (base + noise).clamp(0, 255) as u8
        })
        .collect();
    std::fs::write(dir.join("input.u8"), pixels)?;
    python
        .args(["--task", "resize", "--variant", "prepare", "--dir"])
        .arg(dir);
    crate::run_json(python, "torchvision's reference resize").map(drop)
}

/// Runs the Kiln variant: `CALLS` resizes per repeat.
pub fn worker(variant: &str, a: &TaskArgs) -> Result<Value> {
    if variant != "kiln-resize" {
        bail!("{variant} is not a Kiln variant of the resize workload");
    }
    let img = HostTensor::new(std::fs::read(a.dir.join("input.u8"))?, SOURCE)?;
    let expected = std::fs::read(a.dir.join("expected.u8"))?;
    let size = ResizeTo::shorter(SHORTER);
    let times = timed(a.warmup, a.repeats, || {
        for _ in 0..CALLS {
            let y = std::hint::black_box(resize(std::hint::black_box(&img), size)?);
            ensure!(y.dims() == OUTPUT, "resized to {:?}", y.dims());
        }
        Ok(())
    })?;
    let out = resize(&img, size)?;
    let max_diff = max_abs_diff(out.as_slice::<u8>()?, &expected)?;
    let m = median(times.clone());
    let images_per_s = CALLS as f64 / m;
    ensure!(
        max_diff == 0,
        "Kiln's resize is not bit-exact: it differs from torchvision's by up to {max_diff} \
         ({images_per_s:.0} images/s)"
    );
    Ok(json!({
        "repeats_s": times, "median_s": m, "calls": CALLS, "images_per_s": images_per_s,
        "us_per_image": m / CALLS as f64 * 1e6, "max_abs_diff": max_diff,
        "input_shape": SOURCE, "output_shape": OUTPUT,
    }))
}

/// The largest difference between two images of the same size.
fn max_abs_diff(a: &[u8], b: &[u8]) -> Result<u8> {
    ensure!(
        a.len() == b.len(),
        "{} bytes against torchvision's {}",
        a.len(),
        b.len()
    );
    Ok(a.iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0))
}

/// One line of progress.
pub fn summary(r: &Value) -> String {
    format!(
        "{:>9.0} images/s  {:.1} us/image  max difference {}",
        crate::num(r, "images_per_s"),
        crate::num(r, "us_per_image"),
        r["max_abs_diff"]
    )
}

/// The table's body.
pub fn table<'a>(ok: impl Fn(&str) -> Option<&'a Value>) -> String {
    let num = crate::num;
    let base = ok("torchvision-resize").map(|r| num(r, "images_per_s"));
    let mut t = format!(
        "{CALLS} resizes per repeat. The maximum difference is against torchvision's output \
         for the same input (0: bit-exact).\n\n\
         | variant | images/s | us per image | max difference | vs torchvision |\n\
         | --- | ---: | ---: | ---: | ---: |\n"
    );
    for v in VARIANTS {
        if let Some(r) = ok(v) {
            let ips = num(r, "images_per_s");
            t += &format!(
                "| {v} | {ips:.0} | {:.1} | {} | {} |\n",
                num(r, "us_per_image"),
                r["max_abs_diff"],
                base.map_or("-".to_owned(), |b| format!("{:.2}x", ips / b))
            );
        }
    }
    t
}
