//! The registry of custom layer ops that each backend keeps: functions by op
//! name (`namespace::name`), looked up when a model with
//! [`Layer::Custom`](crate::model::Layer::Custom) layers is built.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use crate::error::{Error, Result};

/// A backend's custom layer functions (`F`, its function type) by op name.
/// Meant for a `static`: [`new`](Self::new) is `const`.
///
/// ```
/// use std::sync::Arc;
/// use kiln_core::model::CustomLayerRegistry;
///
/// static DOUBLERS: CustomLayerRegistry<dyn Fn(f64) -> f64 + Send + Sync> =
///     CustomLayerRegistry::new("demo", "register_doubler");
/// DOUBLERS.register("demo::double", Arc::new(|x| 2.0 * x));
/// assert_eq!(DOUBLERS.lookup("0.op", "demo::double")?(3.0), 6.0);
/// assert!(DOUBLERS
///     .lookup("0.op", "demo::triple")
///     .is_err_and(|e| e.to_string().contains("demo::triple")));
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub struct CustomLayerRegistry<F: ?Sized> {
    ops: OnceLock<RwLock<HashMap<String, Arc<F>>>>,
    backend: &'static str,
    register_fn: &'static str,
}

impl<F: ?Sized> std::fmt::Debug for CustomLayerRegistry<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CustomLayerRegistry")
            .field("backend", &self.backend)
            .field("ops", &self.names())
            .finish()
    }
}

impl<F: ?Sized> CustomLayerRegistry<F> {
    /// An empty registry of the backend called `backend` in messages, whose
    /// users register with the function `register_fn` (named in messages too).
    pub const fn new(backend: &'static str, register_fn: &'static str) -> Self {
        Self {
            ops: OnceLock::new(),
            backend,
            register_fn,
        }
    }

    fn ops(&self) -> &RwLock<HashMap<String, Arc<F>>> {
        self.ops.get_or_init(Default::default)
    }

    /// Registers `f` for `op`. Registering a name again replaces its function
    /// (so registering at start-up is idempotent); models built before keep the
    /// function they were built with.
    pub fn register(&self, op: &str, f: Arc<F>) {
        let previous = self
            .ops()
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(op.to_owned(), f);
        if previous.is_some() {
            log::debug!(
                "custom layer op {op} registered again on the {} backend; the new function \
                 replaces the old",
                self.backend
            );
        }
    }

    /// Whether `op` is registered.
    pub fn contains(&self, op: &str) -> bool {
        self.ops()
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(op)
    }

    /// The registered op names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .ops()
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        names.sort_unstable();
        names
    }

    /// The function for `op`, if one is registered.
    pub fn get(&self, op: &str) -> Option<Arc<F>> {
        self.ops()
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(op)
            .map(Arc::clone)
    }

    /// The function for `op`, of the layer whose `op` key is at `field` (for the
    /// message); an unregistered op is [`Error::InvalidArgument`] listing the
    /// registered ones and how to register.
    pub fn lookup(&self, field: &str, op: &str) -> Result<Arc<F>> {
        if let Some(f) = self.get(op) {
            return Ok(f);
        }
        Err(Error::invalid_argument(
            field,
            format!(
                "custom op `{op}` is not registered with the {} backend (registered: [{}]); \
                 call kiln_fused_ops::register_layers() for Kiln's fused ops, or {} for your own",
                self.backend,
                self.names().join(", "),
                self.register_fn
            ),
        ))
    }
}
