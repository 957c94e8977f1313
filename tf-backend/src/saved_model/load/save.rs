//! Writing a loaded SavedModel's variables back: [`SavedModel::save_variables`]
//! in place, [`SavedModel::save_variables_to`] as a new SavedModel, through the
//! saver its MetaGraph carries.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::path::Path;

use kiln_core::{Error, Result};
use tensorflow::{Graph, Operation, SessionRunArgs, Tensor};

use super::saver_def::SaverDef;
use super::{files, port, Port, SavedModel};
use crate::error::tf_error;

/// A SavedModel's saver: its `SaverDef` resolved in the graph.
#[derive(Debug)]
pub(crate) struct Saver {
    pub(crate) def: SaverDef,
    pub(crate) filename: Port,
    pub(crate) save: Port,
    /// Initializers of Keras mirror variables, run before every save (see
    /// [`keras_mirrors`]).
    pub(crate) mirrors: Vec<Operation>,
}

impl Saver {
    /// The saver `def` names, found in `graph` (of the SavedModel in `dir`).
    pub(super) fn find(graph: &Graph, def: SaverDef, dir: &Path) -> Result<Self> {
        let save = port(graph, "the SaverDef", &def.save_tensor)?;
        let mirrors = keras_mirrors(graph, &save.operation);
        if !mirrors.is_empty() {
            log::debug!(
                "SavedModel {}: {} mirror variables are synced before each save",
                dir.display(),
                mirrors.len()
            );
        }
        Ok(Self {
            filename: port(graph, "the SaverDef", &def.filename_tensor)?,
            save,
            mirrors,
            def,
        })
    }
}

impl SavedModel {
    /// checkpoint (`<dir>/variables/variables.*`), so that Python's
    /// `tf.saved_model.load(dir)` and every signature see them.
    ///
    /// TensorFlow writes the checkpoint under a temporary prefix in `variables/`;
    /// the files are synced, then renamed into place, the index last. A SavedModel
    /// without a saver is [`Error::Unsupported`].
    pub fn save_variables(&self) -> Result<()> {
        let saver = self.saver()?;
        self.write_checkpoint(saver, &self.dir.join("variables"))
    }

    /// Writes a new SavedModel at `dir`: a copy of this one's files (`saved_model.pb`,
    /// `fingerprint.pb`, `assets/`, ...) with the session's current variable values
    /// as its checkpoint. The original directory is left as it is.
    ///
    /// `dir` must not exist or be an empty directory, and must lie outside the
    /// SavedModel's own directory. The copy is assembled in a temporary sibling
    /// directory and renamed to `dir` when complete.
    pub fn save_variables_to(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dest = dir.as_ref();
        let saver = self.saver()?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let Some(dest_name) = dest.file_name() else {
            return Err(Error::invalid_argument(
                "dir",
                format!("{} does not name a directory to create", dest.display()),
            ));
        };
        self.check_destination(dest, parent, dest_name)?;

        let staging = parent.join(format!(
            "{}-{}",
            files::temp_name("export"),
            dest_name.to_string_lossy()
        ));
        let result = (|| {
            files::copy_tree(&self.dir, &staging, &["variables"])?;
            self.write_checkpoint(saver, &staging.join("variables"))?;
            files::sync_dir(&staging)?;
            // rename(2) replaces an empty directory.
            fs::rename(&staging, dest).map_err(|e| Error::io(dest, e))?;
            files::sync_dir(parent)
        })();
        if result.is_err() && staging.exists() {
            if let Err(e) = fs::remove_dir_all(&staging) {
                log::warn!("cannot remove the temporary {}: {e}", staging.display());
            }
        }
        result?;
        log::info!(
            "wrote the SavedModel {} with the variables of {}",
            dest.display(),
            self.dir.display()
        );
        Ok(())
    }

    /// Refuses a destination inside (or equal to) the SavedModel's own directory, a
    /// file, or a non-empty directory; creates the parent directory.
    fn check_destination(&self, dest: &Path, parent: &Path, dest_name: &OsStr) -> Result<()> {
        fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let source = fs::canonicalize(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let parent = fs::canonicalize(parent).map_err(|e| Error::io(parent, e))?;
        if parent.starts_with(&source) || source.starts_with(parent.join(dest_name)) {
            return Err(Error::invalid_argument(
                "dir",
                format!(
                    "{} is inside (or is) the SavedModel directory {}; give a directory \
                     outside it, or use save_variables to write in place",
                    dest.display(),
                    self.dir.display()
                ),
            ));
        }
        match fs::read_dir(dest) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    return Err(Error::invalid_argument(
                        "dir",
                        format!(
                            "{} already exists and is not empty; give a new or empty directory",
                            dest.display()
                        ),
                    ));
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(_) if dest.exists() => Err(Error::invalid_argument(
                "dir",
                format!("{} exists and is not a directory", dest.display()),
            )),
            Err(e) => Err(Error::io(dest, e)),
        }
    }

    /// The saver; a SavedModel without one is [`Error::Unsupported`].
    pub(crate) fn saver(&self) -> Result<&Saver> {
        self.saver.as_ref().ok_or_else(|| {
            Error::unsupported(format!(
                "saving the variables of the SavedModel {}: it has no saver (its MetaGraphDef \
                 has no SaverDef with a save tensor); re-export it with TensorFlow 2 \
                 (`tf.saved_model.save`, Keras's `model.export` or \
                 `keras.export.ExportArchive`), which always adds one",
                self.dir.display()
            ))
        })
    }

    /// Runs the saver into a temporary prefix in `variables_dir` and installs the
    /// result as `variables_dir/variables.*`.
    fn write_checkpoint(&self, saver: &Saver, variables_dir: &Path) -> Result<()> {
        fs::create_dir_all(variables_dir).map_err(|e| Error::io(variables_dir, e))?;
        let stem = files::temp_name("save");
        let prefix = variables_dir.join(&stem);
        let Some(prefix_text) = prefix.to_str() else {
            return Err(Error::invalid_argument(
                "dir",
                format!(
                    "{} is not valid UTF-8, which TensorFlow needs for a checkpoint path",
                    prefix.display()
                ),
            ));
        };
        let result = (|| {
            if !saver.mirrors.is_empty() {
                let mut args = SessionRunArgs::new();
                for op in &saver.mirrors {
                    args.add_target(op);
                }
                self.session.run(&mut args).map_err(|status| {
                    tf_error(
                        "copying variables into their Keras mirrors before saving",
                        status,
                    )
                })?;
            }
            let filename = Tensor::from(prefix_text.to_owned());
            let mut args = SessionRunArgs::new();
            args.add_feed(&saver.filename.operation, saver.filename.index, &filename);
            let token = args.request_fetch(&saver.save.operation, saver.save.index);
            let context = format!("saving variables to {}", variables_dir.display());
            self.session
                .run(&mut args)
                .map_err(|status| tf_error(&context, status))?;
            if let Ok(written) = args.fetch::<String>(token) {
                log::debug!("TensorFlow's saver wrote {:?}", written.first());
            }
            files::install_checkpoint(variables_dir, &stem)
        })();
        if result.is_err() {
            files::remove_temp(variables_dir, &stem);
        }
        result
    }
}

/// The initializers of the *mirror variables* among the variables `save_op` writes.
///
/// Keras 3 exports each `keras.Variable` twice: its inner `tf.Variable` as an
/// uninitialized handle that the graph's functions use (`mlp/hidden/kernel_1`), and
/// the Keras variable itself as a second handle initialized from the first
/// (`Variable_13`, with `Variable_13/Assign` = `AssignVariableOp(Variable_13,
/// ReadVariableOp(mlp/hidden/kernel_1))`). Both are checkpointed under their own keys
/// (`_all_variables/0/...` and `variables/0/...`), and Python's
/// `tf.saved_model.load` binds the functions to the *second* object. A session that
/// trains updates only the first, so saving as is would leave Python the old
/// weights. Running these initializers before saving copies the trained values into
/// the mirrors. TensorFlow's own variable export (`copy_to_graph_uninitialized`)
/// writes no initializers, so only such mirrors match.
fn keras_mirrors(graph: &Graph, save_op: &Operation) -> Vec<Operation> {
    let is = |op: &Operation, ty: &str| op.op_type().is_ok_and(|t| t == ty);
    let saved: BTreeSet<String> = (0..save_op.num_inputs())
        .map(|i| save_op.input(i).0)
        .filter(|op| is(op, "VarHandleOp"))
        .filter_map(|op| op.name().ok())
        .collect();
    let saved_handle =
        |op: &Operation| is(op, "VarHandleOp") && op.name().is_ok_and(|name| saved.contains(&name));
    graph
        .operation_iter()
        .filter(|op| is(op, "AssignVariableOp") && op.num_inputs() == 2)
        .filter(|assign| {
            let (target, read) = (assign.input(0).0, assign.input(1).0);
            if !saved_handle(&target) || !is(&read, "ReadVariableOp") || read.num_inputs() != 1 {
                return false;
            }
            let source = read.input(0).0;
            saved_handle(&source) && source.name().ok() != target.name().ok()
        })
        .collect()
}
