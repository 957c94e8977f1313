//! libtorch's profiler (Kineto, through its C++ API) over a window of training
//! steps, as Python's `torch.profiler.profile` records one: operators, the ranges
//! Kiln marks, and with CUDA the kernels and copies; a Chrome/Perfetto trace
//! (`ProfilerResult::save`) and the events for [`kiln_core::profile::OpTable`].

mod bridge;

use std::path::Path;

use cxx::UniquePtr;
use kiln_core::profile::{EventDevice, ProfileEvent, StepProfiler};
use kiln_core::{Device, Error, Result};

use bridge::ffi;

/// Kineto's activity code for a CPU operator and for a `record_function` range.
const CPU_OP: u8 = 0;
const USER_ANNOTATION: u8 = 1;

/// libtorch's profiler over a window of steps on one device (see
/// [`kiln_core::profile::StepProfiler`]). One records at a time in a process.
///
/// ```no_run
/// use kiln_core::profile::{OpTable, StepProfiler};
/// use kiln_torch::TorchProfiler;
///
/// let mut profiler = TorchProfiler::new(kiln_core::Device::Cpu);
/// profiler.start()?;
/// profiler.begin_range("my_step")?;
/// let _ = tch::Tensor::ones([64, 64], (tch::Kind::Float, tch::Device::Cpu)).matmul(
///     &tch::Tensor::ones([64, 64], (tch::Kind::Float, tch::Device::Cpu)),
/// );
/// profiler.end_range()?;
/// let events = profiler.stop(std::path::Path::new("trace.json"))?;
/// print!("{}", OpTable::from_events(&events).render(10));
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub struct TorchProfiler {
    cuda: bool,
    recording: bool,
    ranges: Vec<UniquePtr<ffi::UserRange>>,
}

impl std::fmt::Debug for TorchProfiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchProfiler")
            .field("cuda", &self.cuda)
            .field("recording", &self.recording)
            .field("open_ranges", &self.ranges.len())
            .finish()
    }
}

impl TorchProfiler {
    /// A profiler of the host's operators and, on a CUDA device, of its kernels.
    pub fn new(device: Device) -> Self {
        TorchProfiler {
            cuda: matches!(device, Device::Cuda(_)),
            recording: false,
            ranges: Vec::new(),
        }
    }

    fn error(context: &str, e: cxx::Exception) -> Error {
        Error::backend_with_source("torch", context, e)
    }
}

impl StepProfiler for TorchProfiler {
    fn prepare(&mut self) -> Result<()> {
        ffi::profiler_prepare(self.cuda).map_err(|e| Self::error("preparing the profiler", e))
    }

    fn start(&mut self) -> Result<()> {
        if self.recording || ffi::profiler_recording() {
            return Err(Error::invalid_argument(
                "profiler",
                "another profiler is already recording in this process (libtorch runs one at a time)",
            ));
        }
        ffi::profiler_start(self.cuda).map_err(|e| Self::error("starting the profiler", e))?;
        self.recording = true;
        Ok(())
    }

    fn begin_range(&mut self, name: &str) -> Result<()> {
        let range = ffi::user_range_begin(name).map_err(|e| Self::error("beginning a range", e))?;
        self.ranges.push(range);
        Ok(())
    }

    fn end_range(&mut self) -> Result<()> {
        // Dropping the range ends it (`RecordFunction`'s destructor).
        match self.ranges.pop() {
            Some(_) => Ok(()),
            None => Err(Error::invalid_argument(
                "profiler range",
                "no range is open",
            )),
        }
    }

    fn stop(&mut self, trace: &Path) -> Result<Vec<ProfileEvent>> {
        if !self.recording {
            return Err(Error::invalid_argument("profiler", "it is not recording"));
        }
        while self.ranges.pop().is_some() {}
        let path = trace.to_str().ok_or_else(|| {
            Error::invalid_argument("trace path", format!("{} is not UTF-8", trace.display()))
        })?;
        self.recording = false;
        let events =
            ffi::profiler_stop(path).map_err(|e| Self::error("stopping the profiler", e))?;
        if !trace.is_file() {
            return Err(Error::backend(
                "torch",
                "saving the profiler's trace",
                format!("libtorch wrote no trace at {}", trace.display()),
            ));
        }
        Ok(events
            .into_iter()
            .filter(|e| !e.is_async)
            .filter_map(|e| {
                let device = if e.device_type == 0 {
                    // Host events: operators and ranges (not CUDA runtime calls,
                    // which `torch.profiler`'s table leaves out too).
                    if e.activity != CPU_OP && e.activity != USER_ANNOTATION {
                        return None;
                    }
                    EventDevice::Cpu
                } else {
                    EventDevice::Accelerator
                };
                Some(ProfileEvent {
                    name: e.name,
                    thread: e.thread,
                    start_ns: e.start_ns,
                    duration_ns: e.duration_ns,
                    device,
                    nests: true,
                })
            })
            .collect())
    }
}

impl Drop for TorchProfiler {
    fn drop(&mut self) {
        while self.ranges.pop().is_some() {}
        if self.recording {
            // A run that failed inside the window: stop libtorch's profiler (it is
            // process-wide) and drop what it recorded.
            let _ = ffi::profiler_discard();
        }
    }
}
