//! The TorchScript of `SelfAttention`, `GatedMlp`, `PositionEmbedding`,
//! `TiedLinear`, `TokenTypeEmbedding` and `ClassToken`: the steps of their
//! libtorch nodes (`transformer.rs`) as TorchScript source, so that an
//! exported model computes what the Kiln model computes.

use kiln_core::model::{
    GatedActivation, Layer, PositionEncoding, RopeConfig, RopeScaling, SelfAttentionConfig,
};
use kiln_core::Result;

use super::script::{boolean, float, ScriptChild, ScriptLeaf, Scripted};

/// `self.<name>.forward(x)` for a projection child.
fn call(child: &str, x: &str) -> String {
    format!("self.{child}.forward({x})")
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    Ok(Some(match layer {
        Layer::SelfAttention(c) => attention_script(c),
        Layer::GatedMlp(c) => {
            let act = match c.activation {
                GatedActivation::Silu => "torch.silu(g)",
                GatedActivation::Gelu => "torch.gelu(g)",
                GatedActivation::GeluTanh => "torch.gelu(g, approximate=\"tanh\")",
            };
            Scripted {
                class: "GatedMlp".to_owned(),
                body: format!(
                    "    g = {}\n    h = {act} * {}\n    return {}\n",
                    call("gate_proj", "x"),
                    call("up_proj", "x"),
                    call("down_proj", "h")
                ),
                children: Vec::new(),
            }
        }
        Layer::PositionEmbedding(c) => {
            let table = match c.encoding {
                PositionEncoding::Learned => "self.weight".to_owned(),
                PositionEncoding::Sinusoidal => format!(
                    "torch.stack([torch.sin(angles), torch.cos(angles)], -1).reshape([{m}, -1])[:, :{d}].to(x.dtype)",
                    m = c.max_positions,
                    d = c.dim
                ),
            };
            let angles = match c.encoding {
                PositionEncoding::Learned => String::new(),
                PositionEncoding::Sinusoidal => format!(
                    "    half = torch.arange(0, {d}, 2, device=x.device).double()\n    \
                     angles = torch.outer(torch.arange({m}, device=x.device).double(), \
                     torch.pow(10000.0, -half / {d}))\n",
                    d = c.dim,
                    m = c.max_positions
                ),
            };
            Scripted {
                class: "PositionEmbedding".to_owned(),
                body: format!(
                    "{angles}    table = {table}\n    \
                     return x + table[:x.size(1)].to(x.dtype)\n"
                ),
                children: Vec::new(),
            }
        }
        Layer::TiedLinear(_) => Scripted::returning(
            "TiedLinear",
            "torch.linear(x, self.weight, None)".to_owned(),
        ),
        Layer::TokenTypeEmbedding(_) => {
            Scripted::returning("TokenTypeEmbedding", "x + self.weight[0]".to_owned())
        }
        Layer::ClassToken(_) => Scripted::returning(
            "ClassToken",
            "torch.cat([self.weight.expand([x.size(0), 1, x.size(2)]), x], 1)".to_owned(),
        ),
        _ => return Ok(None),
    }))
}

/// `SelfAttention`'s TorchScript: the steps of [`Attention::forward`].
fn attention_script(c: &SelfAttentionConfig) -> Scripted {
    let (h, kv, d) = (c.num_heads, c.kv_heads(), c.head_dim());
    let mut body = format!(
        "    b = x.size(0)\n    s = x.size(1)\n    \
         q = torch.reshape({}, [b, s, {h}, {d}])\n    \
         k = torch.reshape({}, [b, s, {kv}, {d}])\n    \
         v = torch.transpose(torch.reshape({}, [b, s, {kv}, {d}]), 1, 2)\n",
        call("q_proj", "x"),
        call("k_proj", "x"),
        call("v_proj", "x"),
    );
    let mut children = Vec::new();
    if let Some(eps) = c.qk_norm_eps {
        if c.qk_norm_across_heads {
            // Over each whole projection: the heads flattened back.
            body.push_str(&format!(
                "    q = torch.reshape({}, [b, s, {h}, {d}])\n    \
                 k = torch.reshape({}, [b, s, {kv}, {d}])\n",
                call("q_norm", &format!("torch.reshape(q, [b, s, {}])", h * d)),
                call("k_norm", &format!("torch.reshape(k, [b, s, {}])", kv * d)),
            ));
        } else {
            body.push_str(&format!(
                "    q = {}\n    k = {}\n",
                call("q_norm", "q"),
                call("k_norm", "k")
            ));
        }
        for name in ["q_norm", "k_norm"] {
            children.push(ScriptChild {
                name: name.to_owned(),
                class: "RMSNorm".to_owned(),
                body: rms_norm_script(eps, c.qk_norm_offset, c.qk_norm_scale_in_float32),
            });
        }
    }
    body.push_str("    q = torch.transpose(q, 1, 2)\n    k = torch.transpose(k, 1, 2)\n");
    if let Some(rope) = &c.rope {
        let rot = rope.rotary_dim(d);
        let half = rot / 2;
        body.push_str(&rope_script(rope, d));
        for t in ["q", "k"] {
            body.push_str(&format!(
                "    r = {t}[:, :, :, :{rot}]\n    \
                 r = r * cos + torch.cat([-r[:, :, :, {half}:], r[:, :, :, :{half}]], -1) * sin\n    \
                 {t} = torch.cat([r, {t}[:, :, :, {rot}:]], -1)\n"
            ));
        }
    }
    // A sliding window is a boolean band in place of the causal flag.
    let causal = match c.sliding_window {
        Some(w) => {
            body.push_str(&format!(
                "    qi = torch.unsqueeze(torch.arange(s, device=x.device), 1)\n    \
                 kj = torch.unsqueeze(torch.arange(s, device=x.device), 0)\n    \
                 band = torch.logical_and(kj <= qi, kj > qi - {w})\n"
            ));
            false
        }
        None => c.causal,
    };
    let scale = c.scale.map_or_else(|| "None".to_owned(), float);
    body.push_str(&format!(
        "    p = 0.0\n    if self.training:\n        p = {}\n",
        float(c.dropout)
    ));
    // `m`: the boolean mask, `c`: the causal flag of the fused kernel. A
    // padded batch's mask (the module's `attention_mask`) hides the padding
    // keys within the band, and always shows each query itself, as
    // `Attention::forward_pass` does.
    let causal_band = "torch.tril(torch.ones([s, s], device=x.device)) > 0";
    let band = match (c.sliding_window, c.causal, c.softcap) {
        (Some(_), _, _) => Some("band".to_owned()),
        (None, true, Some(_)) => {
            body.push_str(&format!("    band = {causal_band}\n"));
            Some("band".to_owned())
        }
        (None, true, None) => None,
        (None, false, _) => None,
    };
    let fused_causal = causal && c.softcap.is_none();
    body.push_str(&format!(
        "    m: Optional[Tensor] = {}\n    c = {}\n    \
         if attention_mask is not None:\n        \
         seen = torch.reshape(attention_mask != 0, [b, 1, 1, s])\n",
        band.as_deref().unwrap_or("None"),
        boolean(fused_causal),
    ));
    match (&band, fused_causal) {
        (Some(band), _) => {
            body.push_str(&format!("        seen = torch.logical_and(seen, {band})\n"))
        }
        (None, true) => body.push_str(&format!(
            "        seen = torch.logical_and(seen, {causal_band})\n"
        )),
        (None, false) => {}
    }
    body.push_str(
        "        m = torch.logical_or(seen, torch.eye(s, device=x.device) > 0)\n        \
         c = False\n",
    );
    match c.softcap {
        // transformers' eager attention: the fused kernel cannot softcap.
        Some(cap) => {
            if kv != h {
                body.push_str(&format!(
                    "    k = torch.repeat_interleave(k, {g}, 1)\n    \
                     v = torch.repeat_interleave(v, {g}, 1)\n",
                    g = h / kv
                ));
            }
            body.push_str(&format!(
                "    w = torch.matmul(q, torch.transpose(k, 2, 3)) * {}\n    \
                 w = torch.tanh(w / {cap}) * {cap}\n",
                float(c.score_scale()),
                cap = float(cap)
            ));
            // -inf (TorchScript has no finfo): the diagonal is always
            // visible, so no row is empty.
            body.push_str(
                "    if m is not None:\n        \
                 w = torch.masked_fill(w, torch.logical_not(m), float(\"-inf\"))\n    \
                 w = torch.softmax(w.float(), -1).to(q.dtype)\n    \
                 w = torch.dropout(w, p, self.training)\n    \
                 a = torch.matmul(w, v)\n",
            );
        }
        None => body.push_str(&format!(
            "    a = torch.scaled_dot_product_attention(q, k, v, m, p, c, scale={scale}, enable_gqa={})\n",
            boolean(kv != h),
        )),
    }
    body.push_str(&format!(
        "    a = torch.reshape(torch.transpose(a, 1, 2), [b, s, {}])\n    \
         return {}\n",
        h * d,
        call("o_proj", "a"),
    ));
    Scripted {
        class: "SelfAttention".to_owned(),
        body,
        children,
    }
}

/// A TorchScript list literal of `values`, each printed exactly.
fn float_list(values: &[f32]) -> String {
    let items: Vec<String> = values.iter().map(|v| float(f64::from(*v))).collect();
    format!("[{}]", items.join(", "))
}

/// The script lines that set `cos` and `sin` (`[s, rotary_dim]`, in `x`'s
/// dtype) for positions `0..s`: plain RoPE computed as the layer computes it,
/// a scaled one from [`RopeConfig::frequencies`] as constants, switched on the
/// length `s` where they depend on it (LongRoPE) or recomputed (dynamic NTK).
fn rope_script(rope: &RopeConfig, head_dim: usize) -> String {
    let rot = rope.rotary_dim(head_dim);
    let constant = |len: usize| {
        let f = rope.frequencies(head_dim, len);
        (
            format!("torch.tensor({}, device=x.device)", float_list(&f.inverse)),
            f.attention_factor,
        )
    };
    let plain = format!(
        "torch.reciprocal(torch.pow({theta}, torch.arange(0, {rot}, 2, device=x.device).float() / {rot}))",
        theta = float(rope.theta),
    );
    let mut out = String::new();
    let factor = match &rope.scaling {
        None => {
            out.push_str(&format!("    inv = {plain}\n"));
            1.0
        }
        Some(RopeScaling::Dynamic {
            factor,
            max_positions,
        }) => {
            out.push_str(&format!(
                "    inv = {plain}\n    \
                 if s > {max_positions}:\n        \
                 base = {theta} * ({f} * s / {max_positions} - {f1}) ** {exponent}\n        \
                 inv = torch.reciprocal(torch.pow(base, torch.arange(0, {rot}, 2, device=x.device).float() / {rot}))\n",
                theta = float(rope.theta),
                f = float(*factor),
                f1 = float(*factor - 1.0),
                exponent = float(rot as f64 / (rot as f64 - 2.0)),
            ));
            1.0
        }
        Some(RopeScaling::LongRope {
            original_max_positions,
            ..
        }) => {
            let (short, factor) = constant(*original_max_positions);
            let (long, _) = constant(original_max_positions + 1);
            out.push_str(&format!(
                "    inv = {short}\n    if s > {original_max_positions}:\n        inv = {long}\n"
            ));
            factor
        }
        Some(_) => {
            let (inv, factor) = constant(0);
            out.push_str(&format!("    inv = {inv}\n"));
            factor
        }
    };
    let scale = if factor == 1.0 {
        String::new()
    } else {
        format!(" * {}", float(f64::from(factor)))
    };
    out.push_str(&format!(
        "    freqs = torch.outer(torch.arange(s, device=x.device).float(), inv)\n    \
         emb = torch.cat([freqs, freqs], -1)\n    \
         cos = (torch.cos(emb){scale}).to(x.dtype)\n    \
         sin = (torch.sin(emb){scale}).to(x.dtype)\n"
    ));
    out
}

/// The body of an RMSNorm module's forward (also `RmsNorm`'s, in `norm.rs`).
pub(super) fn rms_norm_script(eps: f64, offset: f64, in_float32: bool) -> String {
    // LLaMA scales after the cast, Gemma (an offset) and OLMo 2 before it.
    let scaled = if offset == 0.0 && !in_float32 {
        "self.weight * h.to(dtype)".to_owned()
    } else {
        format!("(h * (self.weight.float() + {})).to(dtype)", float(offset))
    };
    format!(
        "    dtype = x.dtype\n    h = x.float()\n    \
         h = h * torch.rsqrt(torch.mean(torch.pow(h, 2), [-1], True) + {})\n    \
         return {scaled}\n",
        float(eps)
    )
}
