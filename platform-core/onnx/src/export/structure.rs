//! `Dropout` (`Identity` at inference), `Embedding` (`Gather` on the table;
//! `padding_idx` only matters to training) and `Flatten` (`Flatten` for
//! `start_dim=1, end_dim=-1`, otherwise `Reshape`). `Sequential`, `Residual`
//! and `Parallel` (`Add`) are walked by `Emitter::layer`.

use kiln_core::model::Layer;

use super::graph::attr;
use super::Result;
use super::{flatten_start, wrong_family, Emitter, Value};

impl Emitter<'_> {
    pub(crate) fn structure(
        &mut self,
        path: &str,
        layer: &Layer,
        x: &Value,
        out: &[usize],
    ) -> Result<String> {
        match layer {
            Layer::Dropout { .. } => Ok(self.g.op(path, "Identity", &[&x.name], vec![])),
            Layer::Embedding(c) => {
                let table = self.param(path, layer, "weight")?;
                let rows = self.g.op(
                    path,
                    "Gather",
                    &[&table, &x.name],
                    vec![attr::int("axis", 0)],
                );
                Ok(match c.scale {
                    Some(scale) => {
                        let factor = self
                            .g
                            .scalar(path, "embed_scale", f64::from(scale as f32))?;
                        self.g.op(path, "Mul", &[&rows, &factor], vec![])
                    }
                    None => rows,
                })
            }
            Layer::Flatten { start_dim, .. } => {
                let rank = x.shape.len();
                let start = flatten_start(*start_dim, rank);
                if start == 1 && rank >= 2 && out.len() == 2 {
                    Ok(self
                        .g
                        .op(path, "Flatten", &[&x.name], vec![attr::int("axis", 1)]))
                } else {
                    self.reshape(path, x, out, start > 0)
                }
            }
            Layer::Transpose { dim0, dim1 } => {
                let rank = x.shape.len() as isize;
                let norm = |d: isize| if d < 0 { d + rank } else { d };
                let mut perm: Vec<i64> = (0..rank as i64).collect();
                perm.swap(norm(*dim0) as usize, norm(*dim1) as usize);
                Ok(self.g.op(
                    path,
                    "Transpose",
                    &[&x.name],
                    vec![attr::ints("perm", &perm)],
                ))
            }
            Layer::Select { dim, index }
                if *dim == 1
                    && *index < 0
                    && x.shape.len() >= 2
                    && self.padding.as_ref().is_some_and(|p| p.seq == x.shape[1]) =>
            {
                // Over a padded batch's sequence, a negative index counts
                // back from each row's last token: the argmax of the
                // positions times the mask, as Kiln's forward pass does.
                let seq = x.shape[1];
                let tokens = self
                    .padding
                    .as_ref()
                    .map(|p| p.tokens.clone())
                    .unwrap_or_default();
                let positions: Vec<f64> = (0..seq).map(|i| i as f64).collect();
                let positions = self.g.floats(path, "positions", &positions, &[1, seq])?;
                let tokens = self
                    .g
                    .op(path, "Cast", &[&tokens], vec![attr::int("to", 1)]);
                let positions = self
                    .g
                    .op(path, "Cast", &[&positions], vec![attr::int("to", 1)]);
                let scored = self.g.op(path, "Mul", &[&positions, &tokens], vec![]);
                let last = self.g.op(
                    path,
                    "ArgMax",
                    &[&scored],
                    vec![attr::int("axis", 1), attr::int("keepdims", 1)],
                );
                let offset = self.g.ints(path, "offset", &[*index as i64 + 1])?;
                let zero = self.g.ints(path, "zero", &[0])?;
                let at = self.g.op(path, "Add", &[&last, &offset], vec![]);
                let at = self.g.op(path, "Max", &[&at, &zero], vec![]);
                Ok(self.g.op(
                    path,
                    "GatherND",
                    &[&x.name, &at],
                    vec![attr::int("batch_dims", 1)],
                ))
            }
            Layer::Select { dim, index } => {
                // A scalar index removes the axis, as torch.select does.
                let index = self.g.constant(
                    path,
                    "index",
                    &kiln_core::HostTensor::scalar(*index as i64),
                )?;
                Ok(self.g.op(
                    path,
                    "Gather",
                    &[&x.name, &index],
                    vec![attr::int("axis", *dim as i64)],
                ))
            }
            _ => Err(wrong_family(path, layer)),
        }
    }
}
