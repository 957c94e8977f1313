//! `SparseMoe` in standard operators: the router's `Softmax` and `TopK`
//! (renormalised when the config says so), the chosen weights scattered into
//! a dense `[tokens, experts]` table (`ScatterElements`), and every expert's
//! gated MLP on every token, weighted by its column and summed in expert
//! order, so that an unchosen expert adds an exact zero; then the shared
//! expert, gated. ONNX has no data-dependent gather per expert short of a
//! `Loop`, so the graph does `num_experts / top_k` times the experts' work
//! of Kiln's forward pass.

use kiln_core::model::{GatedActivation, Layer, SparseMoeConfig};

use super::graph::attr;
use super::{join, Emitter, Result, Value};

impl Emitter<'_> {
    /// A gated MLP on `x`: `down(act(gate(x)) * up(x))`, its projections the
    /// layer's `{prefix}gate_proj`, `{prefix}up_proj` and `{prefix}down_proj`.
    pub(crate) fn gated_mlp(
        &mut self,
        path: &str,
        layer: &Layer,
        x: &str,
        prefix: &str,
        activation: GatedActivation,
        bias: bool,
    ) -> Result<String> {
        let key = |name: &str| format!("{prefix}{name}");
        let project = |e: &mut Self, input: &str, name: &str| -> Result<String> {
            let bias = bias.then(|| key(&format!("{name}.bias")));
            e.project(
                path,
                layer,
                input,
                &key(&format!("{name}.weight")),
                bias.as_deref(),
            )
        };
        let gate = project(self, x, "gate_proj")?;
        let act = match activation {
            GatedActivation::Silu => {
                let s = self.g.op(path, "Sigmoid", &[&gate], vec![]);
                self.g.op(path, "Mul", &[&gate, &s], vec![])
            }
            GatedActivation::Gelu => self.g.op(
                path,
                "Gelu",
                &[&gate],
                vec![attr::string("approximate", "none")],
            ),
            GatedActivation::GeluTanh => self.g.op(
                path,
                "Gelu",
                &[&gate],
                vec![attr::string("approximate", "tanh")],
            ),
        };
        let up = project(self, x, "up_proj")?;
        let hidden = self.g.op(path, "Mul", &[&act, &up], vec![]);
        project(self, &hidden, "down_proj")
    }

    pub(crate) fn sparse_moe(
        &mut self,
        path: &str,
        layer: &Layer,
        c: &SparseMoeConfig,
        x: &Value,
    ) -> Result<String> {
        let flat = self.g.ints(path, "tokens_shape", &[-1, c.dim as i64])?;
        let tokens = self.g.op(path, "Reshape", &[&x.name, &flat], vec![]);
        let logits = self.project(path, layer, &tokens, "gate.weight", None)?;
        let probs = self
            .g
            .op(path, "Softmax", &[&logits], vec![attr::int("axis", -1)]);
        let k = self.g.ints(path, "top_k", &[c.top_k as i64])?;
        let top = self.g.op_n(
            path,
            "TopK",
            &[&probs, &k],
            vec![
                attr::int("axis", -1),
                attr::int("largest", 1),
                attr::int("sorted", 1),
            ],
            2,
        );
        let (mut weights, chosen) = (top[0].clone(), top[1].clone());
        if c.norm_topk_prob {
            let axes = self.g.ints(path, "sum_axes", &[-1])?;
            let sum = self.g.op(
                path,
                "ReduceSum",
                &[&weights, &axes],
                vec![attr::int("keepdims", 1)],
            );
            weights = self.g.op(path, "Div", &[&weights, &sum], vec![]);
        }
        let zero = self.g.scalar(path, "zero", 0.0)?;
        let zeros = self.g.op(path, "Mul", &[&probs, &zero], vec![]);
        let dense = self.g.op(
            path,
            "ScatterElements",
            &[&zeros, &chosen, &weights],
            vec![attr::int("axis", 1)],
        );
        let axis = self.g.ints(path, "expert_axis", &[1])?;
        let mut out: Option<String> = None;
        for j in 0..c.num_experts {
            let y = self.gated_mlp(
                path,
                layer,
                &tokens,
                &format!("{}.", join("experts", &j.to_string())),
                c.activation,
                false,
            )?;
            let starts = self.g.ints(path, "expert", &[j as i64])?;
            let ends = self.g.ints(path, "expert_end", &[j as i64 + 1])?;
            let column = self
                .g
                .op(path, "Slice", &[&dense, &starts, &ends, &axis], vec![]);
            let weighted = self.g.op(path, "Mul", &[&y, &column], vec![]);
            out = Some(match out {
                Some(sum) => self.g.op(path, "Add", &[&sum, &weighted], vec![]),
                None => weighted,
            });
        }
        let mut out = out.unwrap_or(zeros);
        if c.shared_expert_dim.is_some() {
            let shared =
                self.gated_mlp(path, layer, &tokens, "shared_expert.", c.activation, false)?;
            let gate = self.project(path, layer, &tokens, "shared_expert_gate.weight", None)?;
            let gate = self.g.op(path, "Sigmoid", &[&gate], vec![]);
            let gated = self.g.op(path, "Mul", &[&gate, &shared], vec![]);
            out = self.g.op(path, "Add", &[&out, &gated], vec![]);
        }
        let shape = self.g.op(path, "Shape", &[&x.name], vec![]);
        Ok(self.g.op(path, "Reshape", &[&out, &shape], vec![]))
    }
}
