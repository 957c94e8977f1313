//! The profiler on TensorFlow: while a [`TfProfiler`] records, every session run
//! of the recording thread asks for a full trace (`RunOptions.trace_level =
//! FULL_TRACE`) and its `RunMetadata.step_stats` become the window's events, one
//! per executed node, named by op type as TensorFlow's timeline names them. The
//! ranges the trainer marks are timed here, on the same clock (the wall clock,
//! TensorFlow's `EnvTime`), and the Chrome trace is written from the events.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use kiln_core::profile::{EventDevice, ProfileEvent, StepProfiler};
use kiln_core::{Error, Result};
use tensorflow::{Session, SessionRunArgs};

use crate::error::tf_error;

/// `RunOptions { trace_level: FULL_TRACE }`, serialised (field 1, varint 3).
const FULL_TRACE: [u8; 2] = [0x08, 0x03];

/// The thread id the marked ranges carry in the trace (TensorFlow's are small).
const RANGE_THREAD: u64 = u64::MAX;

thread_local! {
    /// The events of the recording on this thread, if one is recording.
    static RECORDING: RefCell<Option<Vec<ProfileEvent>>> = const { RefCell::new(None) };
}

/// `session.run(args)`, traced when a profiler records on this thread.
pub(crate) fn run_traced(
    session: &Session,
    args: &mut SessionRunArgs<'_>,
    context: &str,
) -> Result<()> {
    let traced = RECORDING.with(|r| r.borrow().is_some());
    if traced {
        args.set_run_options(&FULL_TRACE);
        args.set_request_metadata(true);
    }
    session.run(args).map_err(|s| tf_error(context, s))?;
    if traced {
        if let Some(metadata) = args.get_metadata() {
            let events = step_events(metadata)?;
            RECORDING.with(|r| {
                if let Some(recorded) = r.borrow_mut().as_mut() {
                    recorded.extend(events);
                }
            });
        }
    }
    Ok(())
}

/// The protocol buffers of `RunMetadata` Kiln reads
/// (tensorflow/core/protobuf/config.proto, tensorflow/core/framework/step_stats.proto).
mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct RunMetadata {
        #[prost(message, optional, tag = "1")]
        pub step_stats: Option<StepStats>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct StepStats {
        #[prost(message, repeated, tag = "1")]
        pub dev_stats: Vec<DeviceStepStats>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct DeviceStepStats {
        #[prost(string, tag = "1")]
        pub device: String,
        #[prost(message, repeated, tag = "2")]
        pub node_stats: Vec<NodeExecStats>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct NodeExecStats {
        #[prost(string, tag = "1")]
        pub node_name: String,
        #[prost(int64, tag = "2")]
        pub all_start_micros: i64,
        #[prost(int64, tag = "3")]
        pub op_start_rel_micros: i64,
        #[prost(int64, tag = "4")]
        pub op_end_rel_micros: i64,
        #[prost(string, tag = "8")]
        pub timeline_label: String,
        #[prost(uint32, tag = "10")]
        pub thread_id: u32,
        #[prost(int64, tag = "13")]
        pub all_start_nanos: i64,
        #[prost(int64, tag = "14")]
        pub op_start_rel_nanos: i64,
        #[prost(int64, tag = "15")]
        pub op_end_rel_nanos: i64,
    }
}

/// One event per executed node of a serialised `RunMetadata`.
fn step_events(metadata: &[u8]) -> Result<Vec<ProfileEvent>> {
    use prost::Message;
    let metadata = proto::RunMetadata::decode(metadata).map_err(|e| {
        Error::backend_with_source("tensorflow", "reading a session run's RunMetadata", e)
    })?;
    let mut events = Vec::new();
    for device in metadata.step_stats.map(|s| s.dev_stats).unwrap_or_default() {
        let on = if device.device.contains("CPU") {
            EventDevice::Cpu
        } else {
            EventDevice::Accelerator
        };
        for node in device.node_stats {
            // The kernel's compute (op start to op end), as tfprof counts an op's
            // time: the node's whole span also covers handing its outputs on, in
            // which the executor may run the next node inline.
            let (start_ns, duration_ns) = if node.all_start_nanos > 0 {
                (
                    node.all_start_nanos + node.op_start_rel_nanos,
                    node.op_end_rel_nanos - node.op_start_rel_nanos,
                )
            } else {
                (
                    (node.all_start_micros + node.op_start_rel_micros) * 1000,
                    (node.op_end_rel_micros - node.op_start_rel_micros) * 1000,
                )
            };
            events.push(ProfileEvent {
                name: op_type(&node.timeline_label)
                    .unwrap_or(&node.node_name)
                    .to_owned(),
                thread: u64::from(node.thread_id),
                start_ns: u64::try_from(start_ns).unwrap_or(0),
                duration_ns: u64::try_from(duration_ns).unwrap_or(0),
                device: on,
                nests: false,
            });
        }
    }
    Ok(events)
}

/// The op type of a timeline label, `node = OpType(inputs)`, as TensorFlow's
/// timeline reads it.
fn op_type(label: &str) -> Option<&str> {
    let (_, call) = label.split_once(" = ")?;
    let op = call.split('(').next()?.trim();
    (!op.is_empty()).then_some(op)
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The profiler of TensorFlow's session runs on the calling thread (see the
/// module's documentation and [`kiln_core::profile::StepProfiler`]). Not `Send`:
/// it records the thread that started it.
#[derive(Debug, Default)]
pub struct TfProfiler {
    ranges: Vec<(String, u64)>,
    recording: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl TfProfiler {
    /// A profiler that is not recording yet.
    pub fn new() -> Self {
        Self::default()
    }
}

impl StepProfiler for TfProfiler {
    fn start(&mut self) -> Result<()> {
        RECORDING.with(|r| {
            let mut r = r.borrow_mut();
            if r.is_some() {
                return Err(Error::invalid_argument(
                    "profiler",
                    "another profiler is already recording on this thread",
                ));
            }
            *r = Some(Vec::new());
            Ok(())
        })?;
        self.recording = true;
        Ok(())
    }

    fn begin_range(&mut self, name: &str) -> Result<()> {
        self.ranges.push((name.to_owned(), now_ns()));
        Ok(())
    }

    fn end_range(&mut self) -> Result<()> {
        let (name, start_ns) = self
            .ranges
            .pop()
            .ok_or_else(|| Error::invalid_argument("profiler range", "no range is open"))?;
        let event = ProfileEvent {
            name,
            thread: RANGE_THREAD,
            start_ns,
            duration_ns: now_ns().saturating_sub(start_ns),
            device: EventDevice::Cpu,
            nests: true,
        };
        RECORDING.with(|r| {
            if let Some(recorded) = r.borrow_mut().as_mut() {
                recorded.push(event);
            }
        });
        Ok(())
    }

    fn stop(&mut self, trace: &Path) -> Result<Vec<ProfileEvent>> {
        while !self.ranges.is_empty() {
            self.end_range()?;
        }
        if !self.recording {
            return Err(Error::invalid_argument("profiler", "it is not recording"));
        }
        self.recording = false;
        let events = RECORDING
            .with(|r| r.borrow_mut().take())
            .unwrap_or_default();
        std::fs::write(trace, chrome_trace(&events)).map_err(|e| Error::io(trace, e))?;
        Ok(events)
    }
}

impl Drop for TfProfiler {
    fn drop(&mut self) {
        if self.recording {
            RECORDING.with(|r| r.borrow_mut().take());
        }
    }
}

/// The events as a Chrome trace (`chrome://tracing`, Perfetto): complete events
/// in microseconds from the first, ops (category `op`) on TensorFlow's threads,
/// the marked ranges (category `range`) on a thread of their own.
fn chrome_trace(events: &[ProfileEvent]) -> String {
    let origin = events.iter().map(|e| e.start_ns).min().unwrap_or(0);
    let trace_events: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            let (category, pid) = match (e.thread, e.device) {
                (RANGE_THREAD, _) => ("range", 0),
                (_, EventDevice::Cpu) => ("op", 0),
                (_, EventDevice::Accelerator) => ("op", 1),
            };
            serde_json::json!({
                "ph": "X",
                "cat": category,
                "name": e.name,
                "pid": pid,
                "tid": if e.thread == RANGE_THREAD { 0 } else { e.thread + 1 },
                "ts": (e.start_ns - origin) as f64 / 1e3,
                "dur": e.duration_ns as f64 / 1e3,
            })
        })
        .chain([
            serde_json::json!({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "host"}}),
            serde_json::json!({"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "kiln"}}),
        ])
        .collect();
    serde_json::json!({ "traceEvents": trace_events, "displayTimeUnit": "ms" }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_types_from_timeline_labels() {
        assert_eq!(
            op_type("dense/MatMul = MatMul(x, dense/kernel)"),
            Some("MatMul")
        );
        assert_eq!(op_type("_SOURCE = NoOp()"), Some("NoOp"));
        assert_eq!(op_type("no label"), None);
    }
}
