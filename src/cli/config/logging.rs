//! `[logging]` (where metrics go); `[early_stopping]` is
//! [`kiln_train::EarlyStoppingConfig`].

use serde::{Deserialize, Serialize};

use super::yes;

/// Where metrics go, besides the log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoggingConfig {
    /// `steps.csv` and `epochs.csv` in the output directory.
    #[serde(default = "yes")]
    pub csv: bool,
    /// TensorBoard event files in `<output_dir>/tensorboard`.
    #[serde(default = "yes")]
    pub tensorboard: bool,
    /// A progress bar per epoch (plain lines when not on a terminal).
    #[serde(default = "yes")]
    pub progress: bool,
    /// PNG plots of the training and validation curves at the end.
    #[serde(default = "yes")]
    pub plots: bool,
    /// Extra metrics on validation: `accuracy`, `top5_accuracy`, `precision`,
    /// `recall`, `f1`, `mae`.
    #[serde(default = "accuracy")]
    pub metrics: Vec<String>,
    /// The model summary printed when a run starts, as Lightning's
    /// `ModelSummary(max_depth)`: layers down to this depth (1 by default: the
    /// model's own layers; 0: no summary; -1: every layer).
    #[serde(default = "one")]
    pub summary_depth: i64,
    /// Each parameter group's learning rate (`lr/group_<i>`) at every logged step.
    #[serde(default)]
    pub lr_per_group: bool,
    /// The gradients' L2 norm, in total and per group, at every logged step
    /// (libtorch only: TensorFlow keeps no gradients after its step).
    #[serde(default)]
    pub grad_norms: bool,
    /// Weight and gradient histograms in TensorBoard every this many
    /// optimizer steps (0, the default: none).
    #[serde(default)]
    pub histograms_every_n_steps: u64,
    /// The model's dataflow graph in TensorBoard's Graphs view, after the first
    /// step (TensorFlow only: libtorch runs eagerly and keeps no graph).
    #[serde(default)]
    pub graph: bool,
    /// After each validation, the first this many misclassified validation
    /// images in TensorBoard's Images view, as one grid, with a table of their
    /// classes in its Text view (0, the default: none). Image classifiers only.
    #[serde(default)]
    pub misclassified_images: usize,
}

fn one() -> i64 {
    1
}

fn accuracy() -> Vec<String> {
    vec!["accuracy".to_owned()]
}

impl Default for LoggingConfig {
    fn default() -> Self {
        Self {
            csv: true,
            tensorboard: true,
            progress: true,
            plots: true,
            metrics: accuracy(),
            summary_depth: 1,
            lr_per_group: false,
            grad_norms: false,
            histograms_every_n_steps: 0,
            graph: false,
            misclassified_images: 0,
        }
    }
}

impl LoggingConfig {
    /// The views the trainer logs beside each step's loss.
    pub fn step_views(&self) -> kiln_train::StepViews {
        kiln_train::StepViews {
            lr_per_group: self.lr_per_group,
            grad_norms: self.grad_norms,
            histograms_every: self.histograms_every_n_steps,
            graph: self.graph,
        }
    }

    /// The misclassified-images view of a run with this data (its one
    /// example `probe`, whether it has a validation split, its class names)
    /// and `loss`, checked before anything is written; `None` when it is off.
    pub fn misclassified_view(
        &self,
        probe: &[usize],
        has_validation: bool,
        loss: &kiln_core::loss::Loss,
        class_names: Option<&[String]>,
    ) -> anyhow::Result<Option<kiln_train::MisclassifiedImages>> {
        let count = self.misclassified_images;
        if count == 0 {
            return Ok(None);
        }
        let refuse = |why: String| {
            anyhow::anyhow!("config key `logging.misclassified_images` = {count}: {why}")
        };
        if !self.tensorboard {
            return Err(refuse(
                "the images go to TensorBoard, which `logging.tensorboard = false` turns off"
                    .into(),
            ));
        }
        if !has_validation {
            return Err(refuse(
                "the images are drawn from the validation split, and this run has none \
                 (set data.val_fraction or data.val_path)"
                    .into(),
            ));
        }
        let image = match probe {
            [1, c, h, w] => (*c == 1 || *c == 3) && *h > 0 && *w > 0,
            [1, h, w] => *h > 0 && *w > 0,
            _ => false,
        };
        if !image {
            return Err(refuse(format!(
                "it needs image inputs [C, H, W] with 1 or 3 channels (or [H, W]), and one \
                 example of this data is {:?} (give tabular data an image shape with \
                 data.input_shape)",
                probe.get(1..).unwrap_or_default()
            )));
        }
        if !matches!(
            loss,
            kiln_core::loss::Loss::CrossEntropy(_) | kiln_core::loss::Loss::Nll(_)
        ) {
            return Err(refuse(format!(
                "it needs a classifier trained on class indices (loss cross_entropy or nll), \
                 and this run's loss is {}",
                loss.torch_name()
            )));
        }
        let view = kiln_train::MisclassifiedImages::new(count);
        Ok(Some(match class_names {
            Some(names) => view.with_class_names(names.to_vec()),
            None => view,
        }))
    }

    /// Whether a run prints its model summary, and to which depth (`None`
    /// inside: every layer).
    pub fn summary_depth(&self) -> Option<Option<usize>> {
        match self.summary_depth {
            0 => None,
            d => Some(usize::try_from(d).ok()),
        }
    }
}
