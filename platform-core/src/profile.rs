//! Profiling a window of training steps: the events a backend's profiler records
//! ([`StepProfiler`]) and the table of operators by self time that
//! `torch.profiler`'s `key_averages().table(sort_by="self_cpu_time_total")` prints
//! ([`OpTable`]).
//!
//! The trainer marks each profiled step with a `ProfilerStep#N` range and each wait
//! for the data loader with a [`DATA_LOADER_WAIT`] range, so both are rows of the
//! table beside the engine's operators, and an input-bound run shows at once.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::Result;

/// The range around each wait for the next batch of the data loader.
pub const DATA_LOADER_WAIT: &str = "kiln::data_loader_wait";

/// The prefix of the range around each profiled step (`ProfilerStep#12`), as
/// `torch.profiler.profile.step()` names it.
pub const STEP_PREFIX: &str = "ProfilerStep#";

/// Where a recorded event ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventDevice {
    /// On a host thread: an operator, or a range the program marked.
    Cpu,
    /// On an accelerator: a kernel or a copy (its time is the device's).
    Accelerator,
}

/// One recorded event: an operator, a marked range, or a device kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileEvent {
    /// The operator's or range's name (`aten::addmm`, `MatMul`, `ProfilerStep#3`).
    pub name: String,
    /// The host thread it ran on (events nest within a thread), or the stream of a
    /// device event.
    pub thread: u64,
    /// Its start, in nanoseconds from any fixed origin shared by the window's events.
    pub start_ns: u64,
    /// How long it ran, in nanoseconds.
    pub duration_ns: u64,
    /// Where it ran.
    pub device: EventDevice,
    /// Whether the host events of its thread that start inside it are nested in
    /// it (libtorch's operators, which call one another, and the marked ranges).
    /// A graph engine's nodes (TensorFlow's) never contain one another: their
    /// self time is their duration.
    pub nests: bool,
}

/// A backend's profiler over a window of training steps, driven by the trainer:
/// [`prepare`](Self::prepare) a step before the window, [`start`](Self::start),
/// ranges around each step and data loader wait, then [`stop`](Self::stop).
///
/// Dropping a profiler that is recording stops it and discards what it recorded.
pub trait StepProfiler {
    /// Warms the profiler up, a step before [`start`](Self::start), so the first
    /// recorded step does not pay for its start-up. The default does nothing.
    fn prepare(&mut self) -> Result<()> {
        Ok(())
    }

    /// Starts recording.
    fn start(&mut self) -> Result<()>;

    /// Begins a range named `name` on the calling thread; ranges nest, and end in
    /// the reverse order.
    fn begin_range(&mut self, name: &str) -> Result<()>;

    /// Ends the innermost open range.
    fn end_range(&mut self) -> Result<()>;

    /// Stops recording, writes a Chrome/Perfetto trace (JSON, for
    /// `chrome://tracing`, <https://ui.perfetto.dev> or TensorBoard's profile
    /// plugin) to `trace`, and returns every event recorded.
    fn stop(&mut self, trace: &Path) -> Result<Vec<ProfileEvent>>;
}

/// One row of an [`OpTable`]: every event of one name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpStats {
    /// The operator's or range's name; every `ProfilerStep#N` is one row,
    /// `ProfilerStep*`, as in `torch.profiler`'s table.
    pub name: String,
    /// How many times it ran.
    pub calls: u64,
    /// Host time inside it but not inside an event nested in it, in nanoseconds.
    pub self_cpu_ns: u64,
    /// Host time inside it, nested events included, in nanoseconds.
    pub cpu_total_ns: u64,
    /// Accelerator time of its kernels or copies, in nanoseconds.
    pub self_device_ns: u64,
}

impl OpStats {
    /// Mean host time per call, nested events included, in nanoseconds.
    pub fn cpu_mean_ns(&self) -> u64 {
        self.cpu_total_ns.checked_div(self.calls).unwrap_or(0)
    }
}

/// The events of a profiled window summed per name, sorted by self time:
/// `torch.profiler`'s `key_averages()` table.
///
/// A host event's self time is its duration less its direct children's (events
/// of the same thread that start and end inside it), where it
/// [nests](ProfileEvent::nests) events.
///
/// ```
/// use kiln_core::profile::{EventDevice, OpTable, ProfileEvent};
///
/// let event = |name: &str, start_ns, duration_ns| ProfileEvent {
///     name: name.into(), thread: 1, start_ns, duration_ns, device: EventDevice::Cpu, nests: true,
/// };
/// // aten::linear (10 µs) calls aten::addmm (7 µs).
/// let table = OpTable::from_events(&[event("aten::linear", 0, 10_000), event("aten::addmm", 2_000, 7_000)]);
/// assert_eq!(table.rows[0].name, "aten::addmm");
/// assert_eq!(table.rows[1].self_cpu_ns, 3_000);
/// assert_eq!(table.rows[1].cpu_total_ns, 10_000);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpTable {
    /// One row per name, by self time (host, then device), longest first.
    pub rows: Vec<OpStats>,
    /// The profiled steps (`ProfilerStep#N` ranges).
    pub steps: u64,
    /// The steps' host time in all, in nanoseconds.
    pub window_ns: u64,
    /// Time spent waiting for the data loader ([`DATA_LOADER_WAIT`]), in nanoseconds.
    pub data_wait_ns: u64,
}

impl OpTable {
    /// Sums `events` per name (see the type's documentation).
    pub fn from_events(events: &[ProfileEvent]) -> Self {
        let mut self_ns = vec![0u64; events.len()];
        // Per host thread: events by start (the longer first on a tie, so a parent
        // comes before a child that starts with it), nested with a stack of the
        // open events' ends.
        let mut by_thread: HashMap<u64, Vec<usize>> = HashMap::new();
        for (i, e) in events.iter().enumerate() {
            match e.device {
                EventDevice::Cpu if e.nests => by_thread.entry(e.thread).or_default().push(i),
                _ => self_ns[i] = e.duration_ns,
            }
        }
        for order in by_thread.values_mut() {
            order.sort_by_key(|&i| (events[i].start_ns, std::cmp::Reverse(events[i].duration_ns)));
            let mut open: Vec<usize> = Vec::new();
            for &i in order.iter() {
                let e = &events[i];
                let end = |j: usize| events[j].start_ns.saturating_add(events[j].duration_ns);
                while open.last().is_some_and(|&p| end(p) <= e.start_ns) {
                    open.pop();
                }
                self_ns[i] = e.duration_ns;
                if let Some(&parent) = open.last() {
                    // A child that outlasts its parent (clock rounding) is counted
                    // up to the parent's end.
                    let inside = end(i).min(end(parent)) - e.start_ns;
                    self_ns[parent] = self_ns[parent].saturating_sub(inside);
                }
                open.push(i);
            }
        }
        let mut rows: Vec<OpStats> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut table = OpTable::default();
        for (e, &own) in events.iter().zip(&self_ns) {
            let name = if e.name.starts_with(STEP_PREFIX) {
                table.steps += 1;
                table.window_ns += e.duration_ns;
                "ProfilerStep*"
            } else {
                e.name.as_str()
            };
            if e.name == DATA_LOADER_WAIT {
                table.data_wait_ns += e.duration_ns;
            }
            let row = *index.entry(name).or_insert_with(|| {
                rows.push(OpStats {
                    name: name.to_owned(),
                    ..OpStats::default()
                });
                rows.len() - 1
            });
            let row = &mut rows[row];
            row.calls += 1;
            match e.device {
                EventDevice::Cpu => {
                    row.self_cpu_ns += own;
                    row.cpu_total_ns += e.duration_ns;
                }
                EventDevice::Accelerator => row.self_device_ns += own,
            }
        }
        rows.sort_by(|a, b| {
            (b.self_cpu_ns, b.self_device_ns, &a.name).cmp(&(
                a.self_cpu_ns,
                a.self_device_ns,
                &b.name,
            ))
        });
        table.rows = rows;
        table
    }

    /// Host self time of every row, the 100% of the table's percentages.
    pub fn self_cpu_total_ns(&self) -> u64 {
        self.rows.iter().map(|r| r.self_cpu_ns).sum()
    }

    /// Accelerator time of every row.
    pub fn self_device_total_ns(&self) -> u64 {
        self.rows.iter().map(|r| r.self_device_ns).sum()
    }

    /// The table as `torch.profiler` prints it, its `top` longest rows, under a
    /// line on the window and the data loader's share of it.
    pub fn render(&self, top: usize) -> String {
        let mut out = String::new();
        let per_step = |ns: u64| ns.checked_div(self.steps).unwrap_or(0);
        let _ = writeln!(
            out,
            "{} steps, {} ({} per step); waiting for the data loader: {} per step, {:.1}% of the steps' time",
            self.steps,
            format_ns(self.window_ns),
            format_ns(per_step(self.window_ns)),
            format_ns(per_step(self.data_wait_ns)),
            percent(self.data_wait_ns, self.window_ns),
        );
        let device = self.self_device_total_ns() > 0;
        let cpu_total = self.self_cpu_total_ns();
        let device_total = self.self_device_total_ns();
        let shown: Vec<&OpStats> = self.rows.iter().take(top).collect();
        let width = shown
            .iter()
            .map(|r| r.name.chars().count())
            .max()
            .unwrap_or(4)
            .clamp(4, 60);
        let mut header = format!(
            "{:<width$}  {:>10}  {:>10}  {:>10}  {:>10}",
            "Name", "Self CPU %", "Self CPU", "CPU total", "CPU avg"
        );
        if device {
            let _ = write!(header, "  {:>11}  {:>11}", "Self device", "Self dev. %");
        }
        let _ = write!(header, "  {:>8}", "Calls");
        let rule = "-".repeat(header.len());
        let _ = writeln!(out, "{rule}\n{header}\n{rule}");
        for r in shown {
            let name: String = if r.name.chars().count() > width {
                let mut cut: String = r.name.chars().take(width - 3).collect();
                cut.push_str("...");
                cut
            } else {
                r.name.clone()
            };
            let _ = write!(
                out,
                "{name:<width$}  {:>9.2}%  {:>10}  {:>10}  {:>10}",
                percent(r.self_cpu_ns, cpu_total),
                format_ns(r.self_cpu_ns),
                format_ns(r.cpu_total_ns),
                format_ns(r.cpu_mean_ns()),
            );
            if device {
                let _ = write!(
                    out,
                    "  {:>11}  {:>10.2}%",
                    format_ns(r.self_device_ns),
                    percent(r.self_device_ns, device_total)
                );
            }
            let _ = writeln!(out, "  {:>8}", r.calls);
        }
        let _ = writeln!(out, "{rule}\nSelf CPU time total: {}", format_ns(cpu_total));
        if device {
            let _ = writeln!(out, "Self device time total: {}", format_ns(device_total));
        }
        out
    }

    /// Every row as CSV: `name,calls,self_cpu_us,cpu_total_us,self_device_us`.
    pub fn to_csv(&self) -> String {
        let mut out = String::from("name,calls,self_cpu_us,cpu_total_us,self_device_us\n");
        for r in &self.rows {
            let name = if r.name.contains([',', '"', '\n']) {
                format!("\"{}\"", r.name.replace('"', "\"\""))
            } else {
                r.name.clone()
            };
            let us = |ns: u64| ns as f64 / 1e3;
            let _ = writeln!(
                out,
                "{name},{},{:.3},{:.3},{:.3}",
                r.calls,
                us(r.self_cpu_ns),
                us(r.cpu_total_ns),
                us(r.self_device_ns)
            );
        }
        out
    }
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// A duration as `torch.profiler` shows one: `812.000us`, `3.204ms`, `1.250s`.
fn format_ns(ns: u64) -> String {
    let us = ns as f64 / 1e3;
    if us >= 1e6 {
        format!("{:.3}s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.3}ms", us / 1e3)
    } else {
        format!("{us:.3}us")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(name: &str, thread: u64, start_ns: u64, duration_ns: u64) -> ProfileEvent {
        ProfileEvent {
            name: name.into(),
            thread,
            start_ns,
            duration_ns,
            device: EventDevice::Cpu,
            nests: true,
        }
    }

    #[test]
    fn self_time_excludes_direct_children_only() {
        // step [0, 100): wait [0, 20), linear [30, 60) > addmm [35, 55) > copy [40, 45);
        // another thread's event overlapping the step is not its child.
        let events = [
            cpu("ProfilerStep#1", 1, 0, 100),
            cpu(DATA_LOADER_WAIT, 1, 0, 20),
            cpu("aten::linear", 1, 30, 30),
            cpu("aten::addmm", 1, 35, 20),
            cpu("aten::copy_", 1, 40, 5),
            cpu("aten::copy_", 2, 10, 50),
        ];
        let table = OpTable::from_events(&events);
        let row = |n: &str| table.rows.iter().find(|r| r.name == n).unwrap().clone();
        assert_eq!(row("ProfilerStep*").self_cpu_ns, 100 - 20 - 30);
        assert_eq!(row(DATA_LOADER_WAIT).self_cpu_ns, 20);
        assert_eq!(row("aten::linear").self_cpu_ns, 10);
        assert_eq!(row("aten::addmm").self_cpu_ns, 15);
        let copy = row("aten::copy_");
        assert_eq!(
            (copy.calls, copy.self_cpu_ns, copy.cpu_total_ns),
            (2, 55, 55)
        );
        // Self times add up to the host time covered, per thread.
        assert_eq!(table.self_cpu_total_ns(), 100 + 50);
        assert_eq!(
            (table.steps, table.window_ns, table.data_wait_ns),
            (1, 100, 20)
        );
        assert_eq!(table.rows[0].name, "aten::copy_");
    }

    #[test]
    fn device_events_count_device_time_only() {
        let mut kernel = cpu("gemm_kernel", 7, 5, 40);
        kernel.device = EventDevice::Accelerator;
        let table = OpTable::from_events(&[cpu("aten::mm", 1, 0, 10), kernel]);
        let k = table.rows.iter().find(|r| r.name == "gemm_kernel").unwrap();
        assert_eq!((k.self_cpu_ns, k.self_device_ns), (0, 40));
        assert!(table.render(10).contains("Self device"));
        assert!(table.to_csv().contains("gemm_kernel,1,0.000,0.000,0.040"));
    }

    #[test]
    fn graph_nodes_never_contain_one_another() {
        let mut mul = cpu("Mul", 1, 0, 50);
        mul.nests = false;
        let mut add = cpu("AddV2", 1, 10, 20);
        add.nests = false;
        let table = OpTable::from_events(&[mul, add]);
        assert_eq!(table.self_cpu_total_ns(), 70);
    }

    #[test]
    fn render_and_csv() {
        let table = OpTable::from_events(&[
            cpu("ProfilerStep#1", 1, 0, 2_000_000),
            cpu(DATA_LOADER_WAIT, 1, 0, 500_000),
            cpu("a,b", 1, 600_000, 1_000),
        ]);
        let text = table.render(2);
        assert!(text.starts_with("1 steps, 2.000ms (2.000ms per step); waiting for the data loader: 500.000us per step, 25.0%"), "{text}");
        assert!(!text.contains("a,b"), "only the top two rows: {text}");
        assert!(text.contains("Self CPU time total: 2.000ms"));
        assert!(table.to_csv().contains("\"a,b\",1,1.000,1.000,0.000\n"));
        assert_eq!(format_ns(1_250_000_000), "1.250s");
    }
}
