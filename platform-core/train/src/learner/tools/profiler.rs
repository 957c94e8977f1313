//! The profiler as a callback: a window of steps recorded by the backend's
//! profiler (`kiln train --profile steps=10..20`,
//! [`Trainer::with_profiler`](crate::Trainer::with_profiler)).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::device::Device;
use kiln_core::error::{Error, Result};
use kiln_core::profile::{OpTable, StepProfiler, DATA_LOADER_WAIT, STEP_PREFIX};

use crate::learner::callback::{Callback, Context, FitInfo, Flow};

/// The files a profile writes in its directory.
pub(crate) const TRACE_FILE: &str = "trace.json";
const TABLE_FILE: &str = "ops.txt";
const CSV_FILE: &str = "ops.csv";

/// Which steps to profile and where the results go.
///
/// The steps are optimizer steps, numbered as the logs number them (the first is
/// step 1), in a half-open range: `10..20` records steps 10 to 19. The trainer
/// warms the profiler up during the step before the window, marks each step with a
/// `ProfilerStep#N` range and each wait for the data loader with a
/// `kiln::data_loader_wait` range, and after the window writes to `dir`:
/// - `trace.json`: the Chrome/Perfetto trace (open it in <https://ui.perfetto.dev>
///   or `chrome://tracing`);
/// - `ops.txt`: the top operators by self time, as `torch.profiler` prints them,
///   under a line with the data loader's share of the steps' time;
/// - `ops.csv`: every row of that table.
///
/// ```
/// use kiln_train::ProfileConfig;
///
/// let profile: ProfileConfig = "steps=10..20".parse()?;
/// assert_eq!(profile.steps, 10..20);
/// let profile = profile.in_dir("runs/mnist/profile");
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileConfig {
    /// The steps to record (the first step is 1).
    pub steps: Range<u64>,
    /// Where the trace and the tables are written (created if absent).
    pub dir: PathBuf,
    /// How many rows `ops.txt` (and the log) shows.
    pub top: usize,
}

impl ProfileConfig {
    /// Records `steps`, writing into `profile/` (see [`in_dir`](Self::in_dir)).
    pub fn new(steps: Range<u64>) -> Self {
        ProfileConfig {
            steps,
            dir: PathBuf::from("profile"),
            top: 20,
        }
    }

    /// The same window, written into `dir`.
    pub fn in_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = dir.into();
        self
    }

    /// The files this profile will write.
    pub fn files(&self) -> [PathBuf; 3] {
        [TRACE_FILE, TABLE_FILE, CSV_FILE].map(|f| self.dir.join(f))
    }

    /// Checks the window, and that none of the files exists (a profile is never
    /// written over another file).
    pub fn validate(&self) -> Result<()> {
        self.check_steps()?;
        for file in self.files() {
            if file.exists() {
                return Err(Error::invalid_argument(
                    "profile",
                    format!(
                        "{} exists; a profile never writes over a file (move it, or profile \
                         into another directory)",
                        file.display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Checks the window: `1 <= start < end`.
    fn check_steps(&self) -> Result<()> {
        if self.steps.start == 0 || self.steps.end <= self.steps.start {
            return Err(Error::invalid_argument(
                "profile steps",
                format!(
                    "{}..{} is not a window of steps: expected START..END with 1 <= START < END \
                     (steps are numbered from 1; END is not included)",
                    self.steps.start, self.steps.end
                ),
            ));
        }
        Ok(())
    }
}

impl FromStr for ProfileConfig {
    type Err = Error;

    /// `steps=START..END`, as `kiln train --profile` takes it.
    fn from_str(text: &str) -> Result<Self> {
        let bad = || {
            Error::invalid_argument(
                "profile",
                format!("`{text}`: expected `steps=START..END`, such as `steps=10..20`"),
            )
        };
        let range = text.trim().strip_prefix("steps=").ok_or_else(bad)?;
        let (start, end) = range.split_once("..").ok_or_else(bad)?;
        let number = |s: &str| s.trim().parse::<u64>().map_err(|_| bad());
        let config = ProfileConfig::new(number(start)?..number(end)?);
        config.check_steps()?;
        Ok(config)
    }
}

/// A profile in progress during `fit`.
pub(crate) struct ProfileRun {
    config: ProfileConfig,
    profiler: Box<dyn StepProfiler>,
    prepared: bool,
    recording: bool,
    in_step: bool,
    /// Inside a wait for the data loader.
    waiting: bool,
    done: bool,
}

impl ProfileRun {
    /// The backend's profiler for `config`, checked before the first step:
    /// the window against the run's first and last steps, and the files.
    pub(crate) fn new<B: TrainBackend>(
        config: &ProfileConfig,
        device: Device,
        next_step: u64,
        last_step: u64,
    ) -> Result<Self> {
        config.validate()?;
        if config.steps.start < next_step {
            return Err(Error::invalid_argument(
                "profile steps",
                format!(
                    "{}..{} starts before step {next_step}, where this run starts (it resumes \
                     at that step): profile later steps",
                    config.steps.start, config.steps.end
                ),
            ));
        }
        if config.steps.end - 1 > last_step {
            return Err(Error::invalid_argument(
                "profile steps",
                format!(
                    "{}..{} ends after step {last_step}, the run's last: profile steps up to \
                     {last_step} (END is not included)",
                    config.steps.start, config.steps.end
                ),
            ));
        }
        Ok(ProfileRun {
            config: config.clone(),
            profiler: B::profiler(device)?,
            prepared: false,
            recording: false,
            in_step: false,
            waiting: false,
            done: false,
        })
    }

    /// Before step `step`'s first batch is asked for: warms up, starts, and opens
    /// the step's range.
    pub(crate) fn before_step(&mut self, step: u64) -> Result<()> {
        if self.done {
            return Ok(());
        }
        // Called again for a step whose first batch comes after an epoch's end
        // (gradient accumulation's leftover micro-batches): each call does its
        // part once.
        let start = self.config.steps.start;
        if (step + 1 == start || step == start) && !self.prepared {
            self.profiler.prepare()?;
            self.prepared = true;
        }
        if step == start && !self.recording {
            self.profiler.start()?;
            self.recording = true;
        }
        if self.recording && !self.in_step {
            self.profiler.begin_range(&format!("{STEP_PREFIX}{step}"))?;
            self.in_step = true;
        }
        Ok(())
    }

    /// Opens the range of a wait for the data loader, while recording.
    pub(crate) fn begin_wait(&mut self) -> Result<()> {
        if self.recording {
            self.profiler.begin_range(DATA_LOADER_WAIT)?;
            self.waiting = true;
        }
        Ok(())
    }

    /// Closes it.
    pub(crate) fn end_wait(&mut self) -> Result<()> {
        if self.waiting {
            self.waiting = false;
            self.profiler.end_range()?;
        }
        Ok(())
    }

    /// After step `step`: closes its range, and after the window's last step writes
    /// the profile.
    pub(crate) fn after_step(&mut self, step: u64) -> Result<()> {
        if self.in_step {
            self.profiler.end_range()?;
            self.in_step = false;
        }
        if self.recording && step + 1 >= self.config.steps.end {
            self.finish(step)?;
        }
        Ok(())
    }

    /// At the end of `fit`: a window the run ended inside (early stopping, a
    /// callback) is written as far as it went, with a warning.
    pub(crate) fn end_of_run(&mut self, last_step: u64) -> Result<()> {
        if self.in_step {
            self.profiler.end_range()?;
            self.in_step = false;
        }
        if self.recording {
            log::warn!(
                "the run stopped at step {last_step}, inside the profile window {}..{}: \
                 the profile covers the steps up to {last_step}",
                self.config.steps.start,
                self.config.steps.end
            );
            self.finish(last_step)?;
        } else if !self.done {
            log::warn!(
                "the run stopped at step {last_step}, before the profile window {}..{}: \
                 nothing was profiled",
                self.config.steps.start,
                self.config.steps.end
            );
        }
        Ok(())
    }

    fn finish(&mut self, last_step: u64) -> Result<()> {
        self.recording = false;
        self.done = true;
        let dir = &self.config.dir;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        // The trace goes to a new name first, then takes its own.
        let [trace, table_file, csv_file] = self.config.files();
        let partial = dir.join(format!("{TRACE_FILE}.partial"));
        let events = self.profiler.stop(&partial)?;
        let table = OpTable::from_events(&events);
        let text = table.render(self.config.top);
        write_new(&table_file, text.as_bytes())?;
        write_new(&csv_file, table.to_csv().as_bytes())?;
        rename_new(&partial, &trace)?;
        log::info!(
            "profile of steps {}..{} written to {}:\n{text}",
            self.config.steps.start,
            last_step + 1,
            dir.display()
        );
        Ok(())
    }
}

/// Writes `bytes` to `path`, which must not exist.
fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    file.write_all(bytes).map_err(|e| Error::io(path, e))
}

/// Moves `from` to `to`, which must not exist (a link fails if it does).
fn rename_new(from: &Path, to: &Path) -> Result<()> {
    std::fs::hard_link(from, to).map_err(|e| Error::io(to, e))?;
    std::fs::remove_file(from).map_err(|e| Error::io(from, e))
}

/// The callback that records a [`ProfileConfig`]'s window
/// ([`Trainer::with_profiler`](crate::Trainer::with_profiler) registers it).
pub struct Profiler {
    config: ProfileConfig,
    run: Option<ProfileRun>,
}

impl std::fmt::Debug for Profiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profiler")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Profiler {
    /// Records `config`'s window.
    pub fn new(config: ProfileConfig) -> Self {
        Self { config, run: None }
    }
}

impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for Profiler {
    /// Checks the window against the run and starts the backend's profiler
    /// (one that cannot profile fails here).
    fn on_fit_start(&mut self, cx: &mut Context<'_, B, M>, run: &FitInfo<'_>) -> Result<()> {
        self.run = Some(ProfileRun::new::<B>(
            &self.config,
            run.device,
            cx.state.step + 1,
            run.last_step,
        )?);
        Ok(())
    }

    /// The step's range opens before its first micro-batch is fetched; each
    /// wait for the loader is a range of its own.
    fn on_train_batch_start(&mut self, step: u64, micro: u64) -> Result<()> {
        let Some(run) = self.run.as_mut() else {
            return Ok(());
        };
        if micro == 0 {
            run.before_step(step)?;
        }
        run.begin_wait()
    }

    fn on_train_batch_fetched(&mut self, _step: u64) -> Result<()> {
        self.run.as_mut().map_or(Ok(()), ProfileRun::end_wait)
    }

    fn on_step_end(&mut self, cx: &mut Context<'_, B, M>, _loss: f64) -> Result<Flow> {
        if let Some(run) = self.run.as_mut() {
            run.after_step(cx.state.step)?;
        }
        Ok(Flow::Continue)
    }

    fn on_fit_end(&mut self, cx: &mut Context<'_, B, M>) -> Result<()> {
        match self.run.as_mut() {
            Some(run) => run.end_of_run(cx.state.step),
            None => Ok(()),
        }
    }

    fn needs_step_loss(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_cli_form() {
        assert_eq!("steps=3..5".parse::<ProfileConfig>().unwrap().steps, 3..5);
        for bad in [
            "3..5",
            "steps=5..3",
            "steps=0..2",
            "steps=2..2",
            "steps=a..b",
            "steps=4",
        ] {
            let error = bad.parse::<ProfileConfig>().unwrap_err().to_string();
            assert!(
                error.contains("steps=START..END") || error.contains("START < END"),
                "{bad}: {error}"
            );
        }
    }
}
