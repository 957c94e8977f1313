//! The report: one table per workload, and the whole of `BENCHMARKS.md`.

use super::*;

/// One workload's table: steps/s, samples/s, peak RSS and the ratio against
/// Python PyTorch eager.
pub(crate) fn table(
    workload: Workload,
    steps: usize,
    s: &Settings,
    rows: &[(String, std::result::Result<Value, String>)],
) -> String {
    let baseline = rows
        .iter()
        .find(|(v, _)| v == "pytorch-eager")
        .and_then(|(_, r)| r.as_ref().ok())
        .map(|r| num(r, "steps_per_s"));
    let raw = rows
        .iter()
        .find(|(v, _)| v == "raw-tch")
        .and_then(|(_, r)| r.as_ref().ok())
        .map(|r| num(r, "steps_per_s"));
    // Model FLOPs utilisation, for the bf16 workload: against the GPU's
    // published peak when known, else the best bf16 matrix product that the
    // PyTorch process measured on the same device.
    let mfu = workload
        .is_bf16()
        .then(|| workload.flops_per_step().zip(peak_tflops(rows)))
        .flatten();
    let mut t = format!(
        "### {}\n\n{steps} timed steps per repeat, median of {} repeats after {} warm-up steps, {} threads, \
         on {}; the median of {} rounds.\n\n",
        workload.describe(),
        s.repeats,
        s.warmup,
        s.threads,
        s.device,
        s.rounds
    );
    if let Some((flops, (peak, source))) = &mfu {
        t += &format!(
            "Model FLOPs per step: {:.3} TFLOP (3x the forward's matrix products); \
             MFU against {} TFLOP/s, {source}.\n\n",
            flops / 1e12,
            if *peak < 10.0 {
                format!("{peak:.2}")
            } else {
                format!("{peak:.1}")
            }
        );
    }
    let (extra_head, extra_rule) = if mfu.is_some() {
        (" TFLOP/s | MFU |", " ---: | ---: |")
    } else {
        ("", "")
    };
    t += &format!(
        "| variant | steps/s | samples/s |{extra_head} peak RSS (MiB) | vs PyTorch eager | final loss |\n\
         | --- | ---: | ---: |{extra_rule} ---: | ---: | ---: |\n"
    );
    for (variant, result) in rows {
        match result {
            Ok(r) => {
                let sps = num(r, "steps_per_s");
                let ratio = baseline.map_or("-".to_owned(), |b| format!("{:.2}x", sps / b));
                // Two significant digits at least (the bf16 transformer runs < 1 step/s on a CPU).
                let sps_text = if sps < 10.0 {
                    format!("{sps:.2}")
                } else {
                    format!("{sps:.1}")
                };
                let extra = mfu.as_ref().map_or(String::new(), |(flops, (peak, _))| {
                    let tflops = flops * sps / 1e12;
                    format!(" {tflops:.2} | {:.1}% |", 100.0 * tflops / peak)
                });
                t += &format!(
                    "| {variant} | {sps_text} | {:.0} |{extra} {:.0} | {ratio} | {:.4} |\n",
                    num(r, "samples_per_s"),
                    num(r, "peak_rss_mb"),
                    num(r, "final_loss"),
                );
            }
            Err(e) => t += &format!("| {variant} | failed: {} | | | | |\n", e.replace('|', "/")),
        }
    }
    if let (Some(raw), Some(kiln)) = (
        raw,
        rows.iter()
            .find(|(v, _)| v == "kiln-torch")
            .and_then(|(_, r)| r.as_ref().ok())
            .map(|r| num(r, "steps_per_s")),
    ) {
        t += &format!(
            "\nKiln's overhead over raw `tch`: {:+.1}% time per step.\n",
            100.0 * (raw / kiln - 1.0)
        );
    }
    let rate = |name: &str| {
        rows.iter()
            .find(|(v, _)| v == name)
            .and_then(|(_, r)| r.as_ref().ok())
            .map(|r| num(r, "steps_per_s"))
    };
    if let (Some(plain), Some(ema)) = (rate("kiln-torch"), rate("kiln-torch-ema")) {
        t += &format!(
            "\nThe weight average (`[training] ema`, updated after every step): {:+.1}% time \
             per step.\n",
            100.0 * (plain / ema - 1.0)
        );
    }
    if let (Some(plain), Some(views)) = (rate("kiln-torch"), rate("kiln-torch-views")) {
        t += &format!(
            "\nThe TensorBoard views (`[logging] grad_norms` and `lr_per_group`, read after \
             every step): {:+.1}% time per step.\n",
            100.0 * (plain / views - 1.0)
        );
    }
    if let (Some(plain), Some(profiled)) = (rate("kiln-torch"), rate("kiln-torch-profile")) {
        t += &format!(
            "\nThe profiler (`--profile`, inside its window): {:+.1}% time per step.\n",
            100.0 * (plain / profiled - 1.0)
        );
    }
    if let (Some(plain), Some(profiled)) = (rate("kiln-tf"), rate("kiln-tf-profile")) {
        t += &format!(
            "\nThe profiler on TensorFlow (every session run fully traced): {:+.1}% time \
             per step.\n",
            100.0 * (plain / profiled - 1.0)
        );
    }
    t
}

/// The bf16 peak that MFU is measured against, with where it comes from: the
/// published dense bf16 rate of a known GPU (named by the PyTorch process),
/// else the best bf16 matrix product that process measured.
pub(crate) fn peak_tflops(
    rows: &[(String, std::result::Result<Value, String>)],
) -> Option<(f64, String)> {
    let r = rows
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .find(|r| r.get("matmul_tflops").is_some())?;
    let name = r["device_name"].as_str().unwrap_or("unknown device");
    // NVIDIA's data sheets, dense (no sparsity) bf16 tensor-core rates.
    let published = [
        ("H100 PCIe", 756.0),
        ("H100", 989.4),
        ("H200", 989.4),
        ("A100", 312.0),
    ];
    Some(
        match published.iter().find(|(model, _)| name.contains(model)) {
            Some((_, peak)) => (*peak, format!("the published dense bf16 peak of the {name}")),
            None => (
                num(r, "matmul_tflops"),
                format!(
                    "the best rate of a bf16 square matrix product (n = 4096 on a CPU, 8192 on a GPU) \
                     that PyTorch measured on this {name}, for want of a published peak"
                ),
            ),
        },
    )
}

/// The whole report: machine, versions, command, then one table per workload.
pub(crate) fn report(sections: &[String], s: &Settings) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let accelerator = if s.device.is_cuda() {
        let gpu = Command::new("nvidia-smi")
            .args(["--query-gpu=name", "--format=csv,noheader"])
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|names| names.lines().next().map(|l| l.trim().to_owned()))
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| "a CUDA GPU".to_owned());
        format!(
            "{gpu} ({}; TensorFlow variants are CPU-only and left out)",
            s.device
        )
    } else {
        "CPU only".to_owned()
    };
    let rustc = Command::new("rustc")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "built on another machine (no rustc here)".to_owned());
    #[cfg(feature = "tf")]
    let tensorflow = format!(
        "TensorFlow {} (C API and Python)",
        kiln::tf::TENSORFLOW_VERSION
    );
    #[cfg(not(feature = "tf"))]
    let tensorflow = "built without TensorFlow (feature `tf` off)";
    format!(
        "# Benchmarks\n\n\
         Kiln against Python on the same work, in one run (`benches/compare/`, Python side in\n\
         `benches/python/`). Every variant runs in its own process with the same model, data,\n\
         batch size, dtype (float32; bfloat16 where the title says so) and {} threads; peak RSS\n\
         is the process's high-water mark. Each\n\
         variant ran {} times, taking turns with the others, and the table keeps its median\n\
         round: the machine is a shared VM whose speed drifts by up to 2x for minutes at a time,\n\
         so compare ratios within one table, not across runs.\n\n\
         - Machine: {cpu}, {cores} cores, {accelerator}.\n\
         - Versions: libtorch {} (tch 0.24) and Python torch {}; {tensorflow}; {rustc}.\n\
         - Reproduce: `cargo xtask cargo bench --bench compare{} -- --rounds {}{} --write`\n\n{}",
        s.threads,
        s.rounds,
        kiln::torch::LIBTORCH_VERSION,
        kiln::torch::LIBTORCH_VERSION,
        if s.device.is_cuda() {
            " --features cuda"
        } else {
            ""
        },
        s.rounds,
        if s.device.is_cuda() {
            format!(" --device {}", s.device)
        } else {
            String::new()
        },
        sections.join("\n")
    )
}
