//! `MultiHeadSelfAttention` on libtorch.

use kiln_core::{model::Layer, Result};
use tch::Tensor;

use super::script::{boolean, float, ScriptLeaf, Scripted};
use super::{DecodeStep, Failure, Forward, ForwardResult, Lookup, Tensors};

/// A built [`Layer::MultiHeadSelfAttention`].
#[derive(Debug)]
struct Attention {
    in_proj_weight: usize,
    in_proj_bias: Option<usize>,
    out_weight: usize,
    out_bias: Option<usize>,
    heads: i64,
    causal: bool,
    dropout: f64,
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::MultiHeadSelfAttention(c) => Attention {
            in_proj_weight: at.need("in_proj_weight")?,
            in_proj_bias: at.find("in_proj_bias"),
            out_weight: at.need("out_proj.weight")?,
            out_bias: at.find("out_proj.bias"),
            heads: c.num_heads as i64,
            causal: c.causal,
            dropout: c.dropout,
        },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's: this node's
/// computation step by step, with the output projection as the `out_proj`
/// submodule `nn.MultiheadAttention` has (which the exporter adds).
pub(super) fn script(layer: &Layer, leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    let Layer::MultiHeadSelfAttention(c) = layer else {
        return Ok(None);
    };
    let heads = c.num_heads;
    let body = format!(
        "    batch = x.size(0)\n    seq = x.size(1)\n    embed = x.size(2)\n    \
         head_dim = embed // {heads}\n    \
         qkv = torch.linear(x, self.in_proj_weight, {})\n    \
         parts = torch.chunk(qkv, 3, -1)\n    \
         q = torch.transpose(torch.reshape(parts[0], [batch, seq, {heads}, head_dim]), 1, 2)\n    \
         k = torch.transpose(torch.reshape(parts[1], [batch, seq, {heads}, head_dim]), 1, 2)\n    \
         v = torch.transpose(torch.reshape(parts[2], [batch, seq, {heads}, head_dim]), 1, 2)\n    \
         p = 0.0\n    \
         if self.training:\n        p = {}\n    \
         attended = torch.scaled_dot_product_attention(q, k, v, None, p, {})\n    \
         merged = torch.reshape(torch.transpose(attended, 1, 2), [batch, seq, embed])\n    \
         return self.out_proj.forward(merged)\n",
        leaf.opt("in_proj_bias"),
        float(c.dropout),
        boolean(c.causal)
    );
    Ok(Some(Scripted {
        class: "MultiheadAttention".to_owned(),
        body,
        children: Vec::new(),
    }))
}

impl Forward for Attention {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult {
        let Attention {
            in_proj_weight,
            in_proj_bias,
            out_weight,
            out_bias,
            heads,
            causal,
            dropout,
        } = self;
        let size = x.size();
        let (batch, seq, embed) = (size[0], size[1], size[2]);
        let head_dim = embed / heads;
        let qkv = x.f_linear(tensors.tensor(*in_proj_weight), tensors.opt(*in_proj_bias))?;
        let parts = qkv.f_chunk(3, -1)?;
        let split = |t: &Tensor| {
            t.f_reshape([batch, seq, *heads, head_dim])?
                .f_transpose(1, 2)
        };
        let (q, k, v) = (split(&parts[0])?, split(&parts[1])?, split(&parts[2])?);
        let p = if train { *dropout } else { 0.0 };
        let attended = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<Tensor>,
            p,
            *causal,
            None,
            false,
        )?;
        let merged = attended.f_transpose(1, 2)?.f_reshape([batch, seq, embed])?;
        Ok(merged.f_linear(tensors.tensor(*out_weight), tensors.opt(*out_bias))?)
    }

    fn decode(&self, _tensors: &dyn Tensors, _x: &Tensor, _step: &mut DecodeStep) -> ForwardResult {
        Err(Failure::Layer(kiln_core::Error::unsupported(
            "cached decoding through MultiHeadSelfAttention (nn.MultiheadAttention keeps no \
             key/value cache); build the model with SelfAttention layers to generate",
        )))
    }
}
