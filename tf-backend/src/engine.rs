//! One TensorFlow graph and session holding a model's variables (the programs
//! compiled on it are [`crate::step`]'s).

use std::sync::atomic::{AtomicU64, Ordering};

use kiln_core::{model::ParamKind, DType, Error, HostTensor, Result};
use tensorflow::{DataType, Operation, Output, Session, SessionRunArgs};

use crate::convert::TfTensor;
use crate::custom_layer::CustomOps;
use crate::error::tf_error;
use crate::graph::Builder;

/// The seed [`crate::TfBackend::manual_seed`] set, and how many random draws followed it.
static SEED: AtomicU64 = AtomicU64::new(0x5eed);
static DRAWS: AtomicU64 = AtomicU64::new(0);

/// Seeds the backend's generators (initial weights, dropout streams).
pub(crate) fn manual_seed(seed: u64) {
    SEED.store(seed, Ordering::SeqCst);
    DRAWS.store(0, Ordering::SeqCst);
}

/// The next random stream key: `(seed, draw)`.
pub(crate) fn next_stream() -> (u64, u64) {
    (
        SEED.load(Ordering::SeqCst),
        DRAWS.fetch_add(1, Ordering::SeqCst),
    )
}

/// The int64 `[2]` seed fed to the stateless random ops of one run.
pub(crate) fn seed_tensor() -> Result<TfTensor> {
    let (seed, draw) = next_stream();
    let host = HostTensor::new(vec![seed as i64, draw as i64], [2])?;
    TfTensor::from_host(&host)
}

/// The TensorFlow dtype of a Kiln dtype the graphs use.
pub(crate) fn tf_dtype(dtype: DType) -> Result<DataType> {
    Ok(match dtype {
        DType::F32 => DataType::Float,
        DType::F64 => DataType::Double,
        DType::I64 => DataType::Int64,
        DType::I32 => DataType::Int32,
        DType::U8 => DataType::UInt8,
        other => {
            return Err(Error::unsupported(format!(
                "{other} variables on TensorFlow"
            )))
        }
    })
}

/// A resource variable with the ops that read it and load it from the host.
#[derive(Debug, Clone)]
pub(crate) struct Var {
    /// State-dict name.
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) dims: Vec<usize>,
    pub(crate) kind: ParamKind,
    pub(crate) handle: Output,
    /// Placeholder fed by `load`.
    feed: Output,
    /// `variable = feed`.
    pub(crate) load: Operation,
    /// The current value (for state dicts).
    pub(crate) read: Output,
}

/// A graph, its session, and the variables in it.
#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) b: Builder,
    session: Option<Session>,
    /// Session runs so far (for tests and benchmarks: one per training step).
    pub(crate) runs: u64,
    /// The model's custom-layer functions, resolved when it was built.
    pub(crate) custom_ops: CustomOps,
}

impl Engine {
    pub(crate) fn new() -> Self {
        Engine {
            b: Builder::new(),
            session: None,
            runs: 0,
            custom_ops: CustomOps::default(),
        }
    }

    /// Adds a variable named `name` (its shared name is `scope/name`).
    pub(crate) fn add_var(
        &mut self,
        scope: &str,
        name: &str,
        dtype: DType,
        dims: &[usize],
        kind: ParamKind,
    ) -> Result<Var> {
        let tf = tf_dtype(dtype)?;
        let udims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        let saved = self.b.set_scope(&format!("{scope}/{name}"));
        let result = (|| -> Result<Var> {
            let handle = self.b.var_handle(&format!("{scope}/{name}"), tf, &udims)?;
            let idims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
            let feed = self.b.placeholder(tf, Some(&idims))?;
            let load = self.b.assign(&handle, &feed, tf, &[])?;
            let read = self.b.read(&handle, tf)?;
            Ok(Var {
                name: name.to_owned(),
                dtype,
                dims: dims.to_vec(),
                kind,
                handle,
                feed,
                load,
                read,
            })
        })();
        self.b.set_scope(&saved);
        result
    }

    fn session(&mut self) -> Result<&Session> {
        if self.session.is_none() {
            let session = Session::new(&crate::runtime::session_options()?, &self.b.graph)
                .map_err(|s| tf_error("creating a TensorFlow session", s))?;
            self.session = Some(session);
        }
        self.session
            .as_ref()
            .ok_or_else(|| Error::backend("tensorflow", "creating a session", "no session"))
    }

    /// One session run: feeds, then fetches (with their dtypes), running `targets` too.
    pub(crate) fn run(
        &mut self,
        feeds: &[(&Output, &TfTensor)],
        fetches: &[(&Output, DataType)],
        targets: &[&Operation],
        context: &str,
    ) -> Result<Vec<TfTensor>> {
        self.runs += 1;
        let session = self.session()?;
        run_session(session, feeds, fetches, targets, context)
    }

    /// One session run feeding the string `value` to `feed` (a checkpoint
    /// path), running `targets`.
    pub(crate) fn run_with_string(
        &mut self,
        feed: &Output,
        value: &str,
        targets: &[&Operation],
        context: &str,
    ) -> Result<()> {
        self.runs += 1;
        let session = self.session()?;
        let value = tensorflow::Tensor::from(value.to_owned());
        let mut args = SessionRunArgs::new();
        args.add_feed(&feed.operation, feed.index, &value);
        for op in targets {
            args.add_target(op);
        }
        crate::profile::run_traced(session, &mut args, context)
    }

    /// Host copies of `vars`, in one run.
    pub(crate) fn read_vars(&mut self, vars: &[Var]) -> Result<Vec<HostTensor>> {
        if vars.is_empty() {
            return Ok(Vec::new());
        }
        let fetches: Vec<(&Output, DataType)> = vars
            .iter()
            .map(|v| Ok((&v.read, tf_dtype(v.dtype)?)))
            .collect::<Result<_>>()?;
        let values = self.run(&[], &fetches, &[], "reading variables")?;
        values.iter().map(TfTensor::to_host).collect()
    }

    /// Writes `values` into `vars`, in one run; the caller has checked shapes and dtypes.
    pub(crate) fn write_vars(&mut self, vars: &[&Var], values: &[&HostTensor]) -> Result<()> {
        if vars.is_empty() {
            return Ok(());
        }
        let tensors = values
            .iter()
            .map(|h| TfTensor::from_host(h))
            .collect::<Result<Vec<_>>>()?;
        let feeds: Vec<(&Output, &TfTensor)> =
            vars.iter().map(|v| &v.feed).zip(tensors.iter()).collect();
        let targets: Vec<&Operation> = vars.iter().map(|v| &v.load).collect();
        self.run(&feeds, &[], &targets, "writing variables")?;
        Ok(())
    }
}

/// One run of `session`: feeds, then fetches (with their dtypes), running `targets` too.
pub(crate) fn run_session(
    session: &Session,
    feeds: &[(&Output, &TfTensor)],
    fetches: &[(&Output, DataType)],
    targets: &[&Operation],
    context: &str,
) -> Result<Vec<TfTensor>> {
    let mut args = SessionRunArgs::new();
    for (output, tensor) in feeds {
        let (op, index) = (&output.operation, output.index);
        match tensor {
            TfTensor::U8(t) => args.add_feed(op, index, t),
            TfTensor::I32(t) => args.add_feed(op, index, t),
            TfTensor::I64(t) => args.add_feed(op, index, t),
            TfTensor::F32(t) => args.add_feed(op, index, t),
            TfTensor::F64(t) => args.add_feed(op, index, t),
        }
    }
    let tokens: Vec<_> = fetches
        .iter()
        .map(|(o, dtype)| (args.request_fetch(&o.operation, o.index), *dtype))
        .collect();
    for op in targets {
        args.add_target(op);
    }
    crate::profile::run_traced(session, &mut args, context)?;
    tokens
        .into_iter()
        .map(|(token, dtype)| {
            let fail = |s| tf_error(context, s);
            Ok(match dtype {
                DataType::Float => TfTensor::F32(args.fetch(token).map_err(fail)?),
                DataType::Double => TfTensor::F64(args.fetch(token).map_err(fail)?),
                DataType::Int64 => TfTensor::I64(args.fetch(token).map_err(fail)?),
                DataType::Int32 => TfTensor::I32(args.fetch(token).map_err(fail)?),
                DataType::UInt8 => TfTensor::U8(args.fetch(token).map_err(fail)?),
                other => return Err(Error::unsupported(format!("fetching {other} tensors"))),
            })
        })
        .collect()
}
