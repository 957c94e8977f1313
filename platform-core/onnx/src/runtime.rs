//! ONNX models run with ONNX Runtime.
//!
//! ONNX Runtime is not linked: it is loaded once per process, at the first
//! [`OnnxModel::load`], from the library named by the `ORT_DYLIB_PATH`
//! environment variable or else from the `onnxruntime` wheel's
//! `libonnxruntime.so` that the build found ([`DEFAULT_LIBRARY`]).
//!
//! ```no_run
//! use kiln_core::HostTensor;
//! use kiln_onnx::OnnxModel;
//!
//! let model = OnnxModel::load("mlp.onnx")?;
//! println!("{:?}", model.inputs()); // x: float32 [batch, 4]
//! let x = HostTensor::new(vec![0.5f32; 8], [2, 4])?;
//! let y = model.predict(&x)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Before ONNX Runtime sees an input, [`OnnxModel::run`] checks it against what
//! the file declares (name, dtype, rank, fixed dimensions, symbolic dimensions
//! shared between inputs) and reports a mismatch as [`Error::Input`]. Inputs
//! are passed to ONNX Runtime without copying; each output is copied once into
//! a [`HostTensor`].

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use half::{bf16, f16};
use kiln_core::{DType, HostTensor};
use ort::environment::Environment;
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};
use ort::session::{Session, SessionInputValue, SessionOutputs};
use ort::value::{DynValue, TensorElementType, TensorRef, ValueType};

use crate::error::{Error, Result};
use crate::inspect::{Dim, ModelInfo, TensorInfo};

/// The environment variable that names the ONNX Runtime library to load.
pub const LIBRARY_VARIABLE: &str = "ORT_DYLIB_PATH";

/// The ONNX Runtime library loaded when [`LIBRARY_VARIABLE`] is not set: the
/// `onnxruntime` wheel's `libonnxruntime.so` in the project's virtualenv, found
/// at build time (`KILN_ONNXRUNTIME_LIB` overrides it when building).
pub const DEFAULT_LIBRARY: &str = env!("KILN_ONNXRUNTIME_LIB");

/// The process's ONNX Runtime environment, once made.
static ENVIRONMENT: OnceLock<Environment> = OnceLock::new();
/// Serialises the first loads, so one library is loaded and one environment made.
static LOADING: Mutex<()> = Mutex::new(());

/// The library [`environment`] loads, and where its path came from.
fn library_path() -> (PathBuf, String) {
    match std::env::var_os(LIBRARY_VARIABLE) {
        Some(p) if !p.is_empty() => {
            let p = PathBuf::from(p);
            // ort resolves a relative path against the executable's directory;
            // a user means the working directory.
            let p = if p.is_relative() {
                std::env::current_dir().map_or(p.clone(), |d| d.join(&p))
            } else {
                p
            };
            (p, format!("from {LIBRARY_VARIABLE}"))
        }
        _ => (
            PathBuf::from(DEFAULT_LIBRARY),
            format!("the build's default; set {LIBRARY_VARIABLE} to use another"),
        ),
    }
}

/// Loads ONNX Runtime (once per process) and returns its environment.
///
/// Fails with [`Error::Runtime`] naming the library and [`LIBRARY_VARIABLE`]
/// when the library is missing or is not a usable ONNX Runtime. A failure is
/// not remembered: a later call (with [`LIBRARY_VARIABLE`] fixed) tries again.
/// Once a library has loaded, it stays for the life of the process.
pub fn environment() -> Result<&'static Environment> {
    if let Some(env) = ENVIRONMENT.get() {
        return Ok(env);
    }
    let _loading = LOADING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(env) = ENVIRONMENT.get() {
        return Ok(env);
    }
    let (path, origin) = library_path();
    let hint = format!(
        "set {LIBRARY_VARIABLE} to the path of libonnxruntime.so (ONNX Runtime 1.22 or newer; \
         the onnxruntime wheel ships it as onnxruntime/capi/libonnxruntime.so.*)"
    );
    if !path.is_file() {
        return Err(Error::Runtime(format!(
            "the ONNX Runtime library {} ({origin}) does not exist; {hint}",
            path.display()
        )));
    }
    let builder = ort::init_from(&path).map_err(|e| {
        Error::Runtime(format!(
            "cannot load the ONNX Runtime library {} ({origin}): {e}; {hint}",
            path.display()
        ))
    })?;
    let env = builder
        .with_name("kiln")
        .with_telemetry(false)
        .build()
        .map_err(|e| {
            Error::Runtime(format!(
                "the ONNX Runtime library {} ({origin}) loaded but cannot make an \
                 environment: {e}",
                path.display()
            ))
        })?;
    log::info!("loaded ONNX Runtime from {} ({origin})", path.display());
    Ok(ENVIRONMENT.get_or_init(|| env))
}

/// How much ONNX Runtime rewrites the graph before running it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimizationLevel {
    /// No graph optimizations.
    Disable,
    /// Semantics-preserving rewrites (constant folding, redundant node removal).
    Basic,
    /// Also complex node fusions (Gelu, LayerNorm, attention).
    Extended,
    /// Also layout optimizations (NCHWc).
    Layout,
    /// Everything (ONNX Runtime's default, and Python onnxruntime's).
    #[default]
    All,
}

impl From<OptimizationLevel> for GraphOptimizationLevel {
    fn from(level: OptimizationLevel) -> Self {
        match level {
            OptimizationLevel::Disable => GraphOptimizationLevel::Disable,
            OptimizationLevel::Basic => GraphOptimizationLevel::Level1,
            OptimizationLevel::Extended => GraphOptimizationLevel::Level2,
            OptimizationLevel::Layout => GraphOptimizationLevel::Level3,
            OptimizationLevel::All => GraphOptimizationLevel::All,
        }
    }
}

/// Session options for [`OnnxModel`]; [`OnnxModel::builder`] makes one.
///
/// ```no_run
/// use kiln_onnx::{OnnxModel, OptimizationLevel};
///
/// let model = OnnxModel::builder()
///     .intra_threads(4)
///     .optimization_level(OptimizationLevel::Basic)
///     .load("model.onnx")?;
/// # Ok::<(), kiln_onnx::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct OnnxModelBuilder {
    intra_threads: Option<usize>,
    inter_threads: Option<usize>,
    optimization_level: Option<OptimizationLevel>,
}

/// Maps an ort error to [`Error::Runtime`], saying what was being done.
fn runtime<R>(what: impl std::fmt::Display) -> impl FnOnce(ort::Error<R>) -> Error {
    move |e| Error::Runtime(format!("{what}: {e}"))
}

impl OnnxModelBuilder {
    /// Threads used within one operator (ONNX Runtime's default: one per physical core).
    pub fn intra_threads(mut self, n: usize) -> Self {
        self.intra_threads = Some(n);
        self
    }

    /// Threads used to run independent operators in parallel (only used by
    /// graphs with parallel branches).
    pub fn inter_threads(mut self, n: usize) -> Self {
        self.inter_threads = Some(n);
        self
    }

    /// How much ONNX Runtime optimizes the graph (default: [`OptimizationLevel::All`]).
    pub fn optimization_level(mut self, level: OptimizationLevel) -> Self {
        self.optimization_level = Some(level);
        self
    }

    /// Reads and checks the model with [`ModelInfo`], loads ONNX Runtime if
    /// needed and makes a session.
    ///
    /// Fails with [`Error::Io`] or [`Error::InvalidModel`] for an unreadable or
    /// invalid file and with [`Error::Runtime`] when ONNX Runtime cannot be
    /// loaded or refuses the model (an IR version it does not read, an unknown
    /// operator).
    pub fn load(self, path: impl AsRef<Path>) -> Result<OnnxModel> {
        let path = path.as_ref();
        let info = ModelInfo::read(path)?;
        let env = environment()?;
        let what = format!("loading {}", path.display());
        let mut builder: SessionBuilder = Session::builder(env).map_err(runtime(&what))?;
        if let Some(n) = self.intra_threads {
            builder = builder.with_intra_threads(n).map_err(runtime(&what))?;
        }
        if let Some(n) = self.inter_threads {
            builder = builder
                .with_parallel_execution(n > 1)
                .map_err(runtime(&what))?
                .with_inter_threads(n)
                .map_err(runtime(&what))?;
        }
        if let Some(level) = self.optimization_level {
            builder = builder
                .with_optimization_level(level.into())
                .map_err(runtime(&what))?;
        }
        let session = builder.commit_from_file(path).map_err(|e| {
            let hint = if info.ir_version > 13 {
                format!(
                    " (the file has IR version {}; ONNX Runtime 1.31 reads 13 at most)",
                    info.ir_version
                )
            } else {
                String::new()
            };
            Error::Runtime(format!("{what}: {}{hint}", e.to_string().trim_end()))
        })?;
        let session_inputs: Vec<&str> = session.inputs().iter().map(|o| o.name()).collect();
        let declared: Vec<&str> = info.inputs.iter().map(|t| t.name.as_str()).collect();
        if session_inputs != declared {
            log::warn!(
                "{}: ONNX Runtime's inputs {session_inputs:?} differ from the file's {declared:?}",
                path.display()
            );
        }
        log::debug!(
            "loaded {} ({} inputs, {} outputs, {} nodes)",
            path.display(),
            info.inputs.len(),
            info.outputs.len(),
            info.node_count
        );
        Ok(OnnxModel {
            path: path.to_path_buf(),
            info,
            session: Mutex::new(session),
        })
    }
}

/// An ONNX model loaded into ONNX Runtime, run on Kiln's [`HostTensor`]s.
///
/// `run` takes `&self`: the session sits behind a mutex (ONNX Runtime's `Run`
/// is not safe to call concurrently on one session), so an `OnnxModel` can be
/// shared between threads, which take turns.
#[derive(Debug)]
pub struct OnnxModel {
    path: PathBuf,
    info: ModelInfo,
    session: Mutex<Session>,
}

/// Evaluates `$body` with the type alias `$t` set to the Rust element type of
/// `$dtype`, or `$other` for a dtype added to Kiln later.
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            _ => $other,
        }
    };
}

impl OnnxModel {
    /// Loads the model at `path` with default session options (see
    /// [`OnnxModelBuilder::load`] for the checks and errors).
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::builder().load(path)
    }

    /// Session options: threads and graph optimization level.
    pub fn builder() -> OnnxModelBuilder {
        OnnxModelBuilder::default()
    }

    /// The file the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the file declares (opsets, producer, operators, parameters).
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The inputs to feed, in the model's order.
    pub fn inputs(&self) -> &[TensorInfo] {
        &self.info.inputs
    }

    /// The outputs [`run`](Self::run) returns, in the model's order.
    pub fn outputs(&self) -> &[TensorInfo] {
        &self.info.outputs
    }

    /// Runs the model on named inputs and returns every output, in the
    /// model's order.
    ///
    /// Fails with [`Error::Input`] when an input is unknown, given twice or
    /// missing, or has the wrong dtype, rank or a fixed dimension of another
    /// size (checked before ONNX Runtime is called); with [`Error::Output`]
    /// when an output is not a tensor of a Kiln dtype; and with
    /// [`Error::Runtime`] when ONNX Runtime fails.
    pub fn run(&self, inputs: &[(&str, &HostTensor)]) -> Result<Vec<(String, HostTensor)>> {
        self.run_session(inputs, |outputs| {
            self.info
                .outputs
                .iter()
                .map(|o| Ok((o.name.clone(), self.output(outputs, &o.name)?)))
                .collect()
        })
    }

    /// Checks `inputs`, runs the session on them (borrowed, not copied) and
    /// hands ONNX Runtime's outputs to `read`, which copies what it needs out.
    fn run_session<R>(
        &self,
        inputs: &[(&str, &HostTensor)],
        read: impl FnOnce(&SessionOutputs<'_>) -> Result<R>,
    ) -> Result<R> {
        let order = check_inputs(&self.info.inputs, inputs)?;
        let mut values: Vec<(&str, SessionInputValue<'_>)> = Vec::with_capacity(order.len());
        for (declared, &i) in self.info.inputs.iter().zip(&order) {
            let tensor = inputs[i].1;
            values.push((
                declared.name.as_str(),
                self.tensor_ref(&declared.name, tensor)?,
            ));
        }
        // A panic while the lock was held cannot leave the session half-updated
        // (`Run` is one C call), so a poisoned lock is still usable.
        let mut session = self
            .session
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let outputs = session
            .run(values)
            .map_err(|e| Error::Runtime(format!("running {}: {e}", self.path.display())))?;
        read(&outputs)
    }

    /// The output `name` of a run, copied into a [`HostTensor`].
    fn output(&self, outputs: &SessionOutputs<'_>, name: &str) -> Result<HostTensor> {
        let value = outputs.get(name).ok_or_else(|| {
            Error::Runtime(format!(
                "running {}: ONNX Runtime returned no output '{name}'",
                self.path.display(),
            ))
        })?;
        to_host(name, value)
    }

    /// Runs a model of exactly one input on `input` and returns its first output.
    ///
    /// Fails with [`Error::Input`] when the model has more than one input, and
    /// otherwise as [`run`](Self::run) does.
    pub fn predict(&self, input: &HostTensor) -> Result<HostTensor> {
        let [only] = self.info.inputs.as_slice() else {
            let names: Vec<&str> = self.info.inputs.iter().map(|t| t.name.as_str()).collect();
            return Err(Error::Input {
                name: names.join(", "),
                reason: format!(
                    "predict needs a model of exactly one input, and {} has {} ({}); use run with named inputs",
                    self.path.display(),
                    names.len(),
                    names.join(", ")
                ),
            });
        };
        let first = self.info.outputs.first().ok_or_else(|| {
            Error::Runtime(format!("{} declares no outputs", self.path.display()))
        })?;
        // Only the output returned is copied out of ONNX Runtime.
        self.run_session(&[(only.name.as_str(), input)], |outputs| {
            self.output(outputs, &first.name)
        })
    }

    /// A borrowed ONNX Runtime tensor over `tensor`'s buffer (no copy).
    fn tensor_ref<'t>(&self, name: &str, tensor: &'t HostTensor) -> Result<SessionInputValue<'t>> {
        let fail = |e: ort::Error| Error::Input {
            name: name.to_string(),
            reason: format!("ONNX Runtime cannot take it: {e}"),
        };
        with_element!(tensor.dtype(), T => {
            let data = tensor.as_slice::<T>()?;
            let value = TensorRef::<T>::from_array_view((tensor.dims(), data)).map_err(fail)?;
            Ok(value.into())
        }, _ => Err(Error::Input {
            name: name.to_string(),
            reason: format!("Kiln cannot pass {} tensors to ONNX Runtime", tensor.dtype()),
        }))
    }
}

/// Timings of [`OnnxModel::predict`] on one input, from
/// [`OnnxModel::time_predict`]: batch-1 latency and large-batch throughput
/// are two calls with inputs of those batch sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct PredictTiming {
    /// The input's leading dimension (1 for a rank-0 input).
    pub batch: usize,
    /// Untimed calls made first.
    pub warmup: usize,
    /// Timed calls.
    pub runs: usize,
    /// Median seconds per call.
    pub median_s: f64,
    /// Fastest call, in seconds.
    pub min_s: f64,
    /// 90th-percentile seconds per call.
    pub p90_s: f64,
    /// Samples per second at the median: `batch / median_s`.
    pub samples_per_s: f64,
}

impl OnnxModel {
    /// Times [`predict`](Self::predict) on `input`: `warmup` untimed calls,
    /// then `runs` timed calls (each timed alone, including the output copy).
    ///
    /// Fails as `predict` does, and with [`Error::Input`] when `runs` is 0.
    pub fn time_predict(
        &self,
        input: &HostTensor,
        warmup: usize,
        runs: usize,
    ) -> Result<PredictTiming> {
        if runs == 0 {
            return Err(Error::Input {
                name: "runs".to_string(),
                reason: "time_predict needs at least one timed run".to_string(),
            });
        }
        for _ in 0..warmup {
            self.predict(input)?;
        }
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let start = std::time::Instant::now();
            let out = self.predict(input)?;
            times.push(start.elapsed().as_secs_f64());
            drop(out);
        }
        times.sort_by(f64::total_cmp);
        let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
        let batch = input.dims().first().copied().unwrap_or(1);
        let median_s = if runs % 2 == 1 {
            times[runs / 2]
        } else {
            (times[runs / 2 - 1] + times[runs / 2]) / 2.0
        };
        Ok(PredictTiming {
            batch,
            warmup,
            runs,
            median_s,
            min_s: times[0],
            p90_s: at(0.9),
            samples_per_s: batch as f64 / median_s,
        })
    }
}

/// The Kiln dtype of an ONNX Runtime element type.
fn dtype_of(ty: TensorElementType) -> Option<DType> {
    match ty {
        TensorElementType::Float32 => Some(DType::F32),
        TensorElementType::Float64 => Some(DType::F64),
        TensorElementType::Int32 => Some(DType::I32),
        TensorElementType::Int64 => Some(DType::I64),
        TensorElementType::Uint8 => Some(DType::U8),
        TensorElementType::Float16 => Some(DType::F16),
        TensorElementType::Bfloat16 => Some(DType::BF16),
        _ => None,
    }
}

/// Copies an output value into a [`HostTensor`].
fn to_host(name: &str, value: &DynValue) -> Result<HostTensor> {
    let unsupported = |what: String| Error::Output {
        name: name.to_string(),
        reason: format!(
            "it is {what}; OnnxModel returns tensors of uint8, int32, int64, float16, \
             bfloat16, float32 or float64"
        ),
    };
    let ty = match value.dtype() {
        ValueType::Tensor { ty, .. } => *ty,
        other => return Err(unsupported(format!("{other:?}"))),
    };
    let dtype = dtype_of(ty).ok_or_else(|| unsupported(format!("a tensor of {ty:?}")))?;
    let fail = |e: ort::Error| Error::Output {
        name: name.to_string(),
        reason: format!("cannot read it: {e}"),
    };
    with_element!(dtype, T => {
        let (shape, data) = value.try_extract_tensor::<T>().map_err(fail)?;
        let dims = shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| Error::Output {
                name: name.to_string(),
                reason: format!("ONNX Runtime gave it the shape {shape:?}"),
            })?;
        Ok(HostTensor::from_slice(data, dims)?)
    }, _ => Err(unsupported(format!("a tensor of {dtype}"))))
}

/// Checks `given` against the `declared` inputs and returns, for each
/// declared input in order, the index of the tensor given for it.
///
/// Names must match exactly once each; dtypes must be equal; where the file
/// declares a shape the rank must match, fixed dimensions must be equal and a
/// symbolic dimension (`batch`) must have one size across all inputs.
pub fn check_inputs(declared: &[TensorInfo], given: &[(&str, &HostTensor)]) -> Result<Vec<usize>> {
    let expected_names = || {
        declared
            .iter()
            .map(|t| format!("'{}' ({} {})", t.name, t.type_name, t.shape_string()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut order: Vec<Option<usize>> = vec![None; declared.len()];
    for (i, (name, _)) in given.iter().enumerate() {
        let Some(d) = declared.iter().position(|t| t.name == *name) else {
            return Err(Error::Input {
                name: name.to_string(),
                reason: format!(
                    "the model has no such input; its inputs are {}",
                    expected_names()
                ),
            });
        };
        if order[d].is_some() {
            return Err(Error::Input {
                name: name.to_string(),
                reason: "given twice".to_string(),
            });
        }
        order[d] = Some(i);
    }
    let mut out = Vec::with_capacity(declared.len());
    for (info, slot) in declared.iter().zip(&order) {
        let err = |reason: String| Error::Input {
            name: info.name.clone(),
            reason,
        };
        let Some(i) = *slot else {
            return Err(err(format!(
                "missing; the model needs {} {} (its inputs are {})",
                info.type_name,
                info.shape_string(),
                expected_names()
            )));
        };
        let tensor = given[i].1;
        match info.dtype {
            None => {
                return Err(err(format!(
                    "the model expects {}, which Kiln's tensors cannot hold",
                    info.type_name
                )))
            }
            Some(d) if d != tensor.dtype() => {
                return Err(err(format!(
                    "dtype is {}, the model expects {}",
                    tensor.dtype(),
                    d
                )))
            }
            Some(_) => {}
        }
        if !info.ranked {
            out.push(i);
            continue;
        }
        let dims = tensor.dims();
        if dims.len() != info.shape.len() {
            return Err(err(format!(
                "rank is {} (shape {:?}), the model expects rank {} {}",
                dims.len(),
                dims,
                info.shape.len(),
                info.shape_string()
            )));
        }
        for (axis, (&n, dim)) in dims.iter().zip(&info.shape).enumerate() {
            match dim {
                Dim::Fixed(m) if *m != n => {
                    return Err(err(format!(
                        "dimension {axis} is {n}, the model expects {m} (shape {:?}, expected {})",
                        dims,
                        info.shape_string()
                    )))
                }
                Dim::Symbolic(s) => {
                    // The first size given to `s`, by an earlier input or an
                    // earlier axis of this one (found by looking back: models have
                    // few inputs, and this keeps a call free of allocations).
                    let earlier = declared
                        .iter()
                        .zip(&out)
                        .map(|(d, &j)| (d, given[j].1.dims()))
                        .chain(std::iter::once((info, &dims[..axis])));
                    let first = earlier.filter(|(d, _)| d.ranked).find_map(|(d, ds)| {
                        d.shape
                            .iter()
                            .zip(ds)
                            .find(|(e, _)| matches!(e, Dim::Symbolic(t) if t == s))
                            .map(|(_, &m)| (m, d.name.as_str()))
                    });
                    if let Some((m, first)) = first.filter(|&(m, _)| m != n) {
                        return Err(err(format!(
                            "dimension {axis} ('{s}') is {n}, but input '{first}' set '{s}' to {m}"
                        )));
                    }
                }
                _ => {}
            }
        }
        out.push(i);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, dtype: DType, shape: Vec<Dim>) -> TensorInfo {
        TensorInfo {
            name: name.to_string(),
            dtype: Some(dtype),
            type_name: dtype.name().to_string(),
            shape,
            ranked: true,
        }
    }

    fn declared() -> Vec<TensorInfo> {
        vec![
            info(
                "x",
                DType::F32,
                vec![Dim::Symbolic("batch".into()), Dim::Fixed(8)],
            ),
            info(
                "ids",
                DType::I64,
                vec![Dim::Symbolic("batch".into()), Dim::Unknown],
            ),
        ]
    }

    fn reason(r: Result<Vec<usize>>) -> (String, String) {
        match r {
            Err(Error::Input { name, reason }) => (name, reason),
            other => panic!("expected Error::Input, got {other:?}"),
        }
    }

    #[test]
    fn accepts_and_orders_inputs() {
        let x = HostTensor::zeros(DType::F32, [3, 8]).unwrap();
        let ids = HostTensor::zeros(DType::I64, [3, 5]).unwrap();
        let order = check_inputs(&declared(), &[("ids", &ids), ("x", &x)]).unwrap();
        assert_eq!(order, vec![1, 0]);
    }

    #[test]
    fn names_what_is_wrong() {
        let d = declared();
        let x = HostTensor::zeros(DType::F32, [3, 8]).unwrap();
        let ids = HostTensor::zeros(DType::I64, [3, 5]).unwrap();

        let (name, r) = reason(check_inputs(&d, &[("x", &x), ("idz", &ids)]));
        assert_eq!(name, "idz");
        assert!(r.contains("'x'") && r.contains("'ids'"), "{r}");

        let (name, r) = reason(check_inputs(&d, &[("x", &x)]));
        assert_eq!(name, "ids");
        assert!(r.starts_with("missing"), "{r}");

        let (_, r) = reason(check_inputs(&d, &[("x", &x), ("x", &x)]));
        assert!(r.contains("twice"), "{r}");

        let (name, r) = reason(check_inputs(&d, &[("x", &ids), ("ids", &ids)]));
        assert_eq!(name, "x");
        assert!(
            r.contains("dtype is int64, the model expects float32"),
            "{r}"
        );

        let x7 = HostTensor::zeros(DType::F32, [3, 7]).unwrap();
        let (_, r) = reason(check_inputs(&d, &[("x", &x7), ("ids", &ids)]));
        assert!(r.contains("dimension 1 is 7, the model expects 8"), "{r}");

        let x3 = HostTensor::zeros(DType::F32, [3, 8, 1]).unwrap();
        let (_, r) = reason(check_inputs(&d, &[("x", &x3), ("ids", &ids)]));
        assert!(r.contains("rank is 3"), "{r}");

        let ids4 = HostTensor::zeros(DType::I64, [4, 5]).unwrap();
        let (name, r) = reason(check_inputs(&d, &[("x", &x), ("ids", &ids4)]));
        assert_eq!(name, "ids");
        assert!(
            r.contains("'batch'") && r.contains("'x' set 'batch' to 3"),
            "{r}"
        );
    }

    #[test]
    fn a_symbol_repeated_within_one_input() {
        let n = || Dim::Symbolic("n".into());
        let d = vec![info("sq", DType::F32, vec![n(), n()])];
        let ok = HostTensor::zeros(DType::F32, [3, 3]).unwrap();
        assert_eq!(check_inputs(&d, &[("sq", &ok)]).unwrap(), vec![0]);
        let bad = HostTensor::zeros(DType::F32, [3, 4]).unwrap();
        let (name, r) = reason(check_inputs(&d, &[("sq", &bad)]));
        assert_eq!(name, "sq");
        assert!(
            r.contains("dimension 1 ('n') is 4, but input 'sq' set 'n' to 3"),
            "{r}"
        );
    }

    #[test]
    fn unranked_and_unsupported_inputs() {
        let mut d = declared();
        d[0].ranked = false;
        d[0].shape.clear();
        let x = HostTensor::zeros(DType::F32, [2, 2, 2]).unwrap();
        let ids = HostTensor::zeros(DType::I64, [3, 5]).unwrap();
        assert!(check_inputs(&d, &[("x", &x), ("ids", &ids)]).is_ok());
        d[1].dtype = None;
        d[1].type_name = "bool".into();
        let (_, r) = reason(check_inputs(&d, &[("x", &x), ("ids", &ids)]));
        assert!(r.contains("bool"), "{r}");
    }
}
