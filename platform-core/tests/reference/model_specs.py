"""Reference for kiln_core::Layer: builds the equivalent torch.nn modules.

Usage: python model_specs.py REQUEST.json

REQUEST.json holds Kiln layers and initialisers as Kiln serializes them:

    {"models": [{"name": ..., "layer": <Layer>, "input": [dims], "input_dtype": "float32"|"int64"}],
     "shapes": [{"name": ..., "layer": <Layer>, "input": [dims], "input_dtype": ...}],
     "inits":  [{"name": ..., "init": <Init>, "shape": [dims]}]}

Prints one JSON object:

    {"models": {name: {"state": [{"name", "shape", "dtype", "init", "zero_rows"}],
                       "output": [dims] | null, "error": str | null,
                       "summary": {"shapes": {module: [dims]}, "params": {module: n},
                                   "flops": n}}},
     "shapes": {name: {"output": [dims] | null, "error": str | null}},
     "inits":  {name: {"init": <distribution> | null, "error": str | null}}}

`state` is `model.state_dict()` in order. `summary` is what a model summary
reports for one sample (the input's first row), from torch itself: each named
module's output shape (forward hooks), its parameter elements, and the FLOPs
torch.utils.flop_counter.FlopCounterMode counts for the forward pass (two per
multiply-accumulate). `init` is the distribution torch itself drew
each entry from, recorded by intercepting the in-place Tensor methods that torch.nn.init
and the modules' reset_parameters() call (uniform_, normal_, fill_, zero_); the last
call on a tensor wins, as it does for the values.
"""

import json
import sys

import torch
from torch import nn

RECORDED = {}


def _record(method, describe):
    original = getattr(torch.Tensor, method)

    def wrapper(self, *args, **kwargs):
        # Views (such as an embedding's padding row) do not replace the whole
        # tensor's distribution; zero rows are detected from the values instead.
        if self._base is None:
            RECORDED[self.data_ptr()] = describe(*args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, method, wrapper)


_record("uniform_", lambda a=0.0, b=1.0, **_: {"type": "uniform", "low": float(a), "high": float(b)})
_record("normal_", lambda mean=0.0, std=1.0, **_: {"type": "normal", "mean": float(mean), "std": float(std)})
_record("fill_", lambda value, **_: {"type": "constant", "value": float(value)})
_record("zero_", lambda **_: {"type": "constant", "value": 0.0})


def apply_init(tensor, init):
    kind = init["type"]
    if kind == "zeros":
        nn.init.zeros_(tensor)
    elif kind == "ones":
        nn.init.ones_(tensor)
    elif kind == "constant":
        nn.init.constant_(tensor, init["value"])
    elif kind == "uniform":
        nn.init.uniform_(tensor, init["low"], init["high"])
    elif kind == "normal":
        nn.init.normal_(tensor, init["mean"], init["std"])
    elif kind == "xavier_uniform":
        nn.init.xavier_uniform_(tensor, gain=init["gain"])
    elif kind == "xavier_normal":
        nn.init.xavier_normal_(tensor, gain=init["gain"])
    elif kind == "kaiming_uniform":
        nn.init.kaiming_uniform_(tensor, a=init["a"], mode=init["mode"], nonlinearity=init["nonlinearity"])
    elif kind == "kaiming_normal":
        nn.init.kaiming_normal_(tensor, a=init["a"], mode=init["mode"], nonlinearity=init["nonlinearity"])
    else:
        raise ValueError(f"unknown init {kind}")


class Residual(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return x + self.block(x)


class Parallel(nn.Module):
    """Kiln's Parallel: every branch on the same input, the outputs summed."""

    def __init__(self, branches):
        super().__init__()
        for i, branch in enumerate(branches):
            self.add_module(str(i), branch)

    def forward(self, x):
        out = None
        for branch in self.children():
            y = branch(x)
            out = y if out is None else out + y
        return out


class SelfAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention (same parameters) called with query = key = value."""

    def __init__(self, embed_dim, num_heads, dropout, bias, causal):
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, batch_first=True)
        self.causal = causal

    def forward(self, x):
        mask = None
        if self.causal:
            seq = x.shape[1]
            mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), diagonal=1)
        # is_causal, as a PyTorch user writes it: SDPA then runs its causal kernel, as
        # Kiln's call does, instead of a masked one (on CUDA they round differently).
        out, _ = super().forward(
            x, x, x, attn_mask=mask, need_weights=False, is_causal=self.causal
        )
        return out


def scaled_rope(rope, head_dim, seq_len):
    """The inverse frequencies and cos/sin factor of Kiln's scaled `rope` for `seq_len`
    positions, from transformers' own ROPE_INIT_FUNCTIONS (Kiln's fields mapped back
    to a config's `rope_parameters`)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope["scaling"])
    kind = scaling.pop("type")
    rot = rope.get("rotary_dim") or head_dim
    names = {"original_max_positions": "original_max_position_embeddings", "fraction": "partial_rotary_factor",
             "max_positions": None}
    params = {"rope_type": {"long_rope": "longrope"}.get(kind, kind), "rope_theta": rope["theta"]}
    for key, value in scaling.items():
        if names.get(key, key) is not None:
            params[names.get(key, key)] = value
    max_positions = scaling.get("max_positions", 1 << 20)
    extra = {} if rot == head_dim or kind == "proportional" else {"partial_rotary_factor": rot / head_dim}
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                         max_position_embeddings=max_positions, rope_parameters=params, **extra)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len)
    return inv_freq, factor


class Scale(nn.Module):
    """Kiln's scale: `x * factor` (Granite's multipliers)."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class GroupedQueryAttention(nn.Module):
    """Kiln's self_attention: the Hugging Face attention (LlamaAttention's projections,
    transformers' own rotate_half and RMSNorm for RoPE and QK-norm, as Qwen3 has them),
    with partial rotary dimensions as GPT-NeoX and Phi split them, through SDPA."""

    def __init__(self, spec):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        e, h = spec["embed_dim"], spec["num_heads"]
        self.heads = h
        self.kv_heads = spec.get("num_kv_heads") or h
        self.head_dim = spec.get("head_dim") or e // h
        self.causal = spec["causal"]
        self.dropout = spec["dropout"]
        self.rope = spec.get("rope")
        self.window = spec.get("sliding_window")
        qkv_bias, out_bias = spec["qkv_bias"], spec["out_bias"]
        self.q_proj = nn.Linear(e, h * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(e, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(e, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(h * self.head_dim, e, bias=out_bias)
        self.scale = spec.get("scale")
        self.across_heads = bool(spec.get("qk_norm_across_heads"))
        self.softcap = spec.get("softcap")
        self.num_key_value_groups = self.heads // self.kv_heads
        if spec.get("qk_norm_eps") is not None and spec.get("qk_norm_offset", 0.0) == 1.0:
            # Gemma 3's `1 + weight` norms.
            from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

            self.q_norm = Gemma3RMSNorm(self.head_dim, eps=spec["qk_norm_eps"])
            self.k_norm = Gemma3RMSNorm(self.head_dim, eps=spec["qk_norm_eps"])
        elif spec.get("qk_norm_eps") is not None and spec.get("qk_norm_across_heads"):
            # OLMoE's and OLMo 2's norms over each whole projection, as their attention has
            # them (OLMo 2's scaling before the cast back).
            from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
            from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

            assert spec.get("qk_norm_offset", 0.0) == 0.0, "OLMo's norms have no offset"
            norm = Olmo2RMSNorm if spec.get("qk_norm_scale_in_float32") else OlmoeRMSNorm
            self.q_norm = norm(h * self.head_dim, eps=spec["qk_norm_eps"])
            self.k_norm = norm(self.kv_heads * self.head_dim, eps=spec["qk_norm_eps"])
        elif spec.get("qk_norm_eps") is not None:
            assert spec.get("qk_norm_offset", 0.0) == 0.0, "the reference has offsets 0 and 1"
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=spec["qk_norm_eps"])
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=spec["qk_norm_eps"])
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x):
        from transformers.models.llama.modeling_llama import rotate_half

        b, s, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None and self.across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and not self.across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.rope is not None:
            rot = self.rope.get("rotary_dim") or self.head_dim
            if self.rope.get("scaling") is None:
                inv_freq = 1.0 / (self.rope["theta"] ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
                factor = 1.0
            else:
                inv_freq, factor = scaled_rope(self.rope, self.head_dim, s)
            pos = torch.arange(s, device=x.device)[None, :]
            freqs = pos[..., None].float() * inv_freq.to(x.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * factor).to(x.dtype)[:, None]
            sin = (emb.sin() * factor).to(x.dtype)[:, None]

            def apply(t):
                r, rest = t[..., :rot], t[..., rot:]
                return torch.cat((r * cos + rotate_half(r) * sin, rest), dim=-1)

            q, k = apply(q), apply(k)
        # Grouped heads as transformers' SDPA path passes them (enable_gqa, torch >= 2.5).
        mask, causal = None, self.causal
        if self.window is not None:
            # transformers' sliding_window_overlay on the causal mask.
            qi, kj = torch.arange(s)[:, None], torch.arange(s)[None, :]
            mask, causal = (kj <= qi) & (kj > qi - self.window), False
        if self.softcap is not None:
            # Gemma 2's own eager attention (SDPA cannot softcap), with its additive mask.
            from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

            if mask is None and causal:
                mask = torch.ones(s, s, dtype=torch.bool).tril()
            additive = None if mask is None else torch.zeros(s, s, dtype=x.dtype).masked_fill(
                ~mask, torch.finfo(x.dtype).min)[None, None]
            out, _ = eager_attention_forward(self, q, k, v, additive, dropout=self.dropout,
                                             scaling=self.scale or self.head_dim ** -0.5, softcap=self.softcap)
            return self.o_proj(out.reshape(b, s, -1))
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal,
            scale=self.scale, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class GatedMlp(nn.Module):
    """Kiln's gated_mlp: transformers' LlamaMLP with the activation Kiln names."""

    def __new__(cls, spec):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[spec["activation"]]
        config = LlamaConfig(hidden_size=spec["dim"], intermediate_size=spec["hidden_dim"],
                             hidden_act=act, mlp_bias=spec["bias"],
                             num_attention_heads=1, num_key_value_heads=1)
        return LlamaMLP(config)


class SparseMoe(nn.Module):
    """Kiln's sparse_moe: transformers' own MoE block (Qwen2-MoE's, with its shared expert
    when the spec has one; Qwen3-MoE's otherwise) run on Kiln's per-expert tensors, which
    are stacked into the block's 3-d expert weights on each forward (gradients flow back
    through the stacking)."""

    def __init__(self, spec):
        super().__init__()
        from transformers import Qwen2MoeConfig, Qwen3MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        d, h, e = spec["dim"], spec["hidden_dim"], spec["num_experts"]
        act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[spec.get("activation", "silu")]
        self.gate = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList([
            nn.ModuleDict({"gate_proj": nn.Linear(d, h, bias=False), "up_proj": nn.Linear(d, h, bias=False),
                           "down_proj": nn.Linear(h, d, bias=False)}) for _ in range(e)])
        shared = spec.get("shared_expert_dim")
        common = dict(hidden_size=d, moe_intermediate_size=h, num_experts=e, num_experts_per_tok=spec["top_k"],
                      norm_topk_prob=spec.get("norm_topk_prob", False), hidden_act=act)
        if shared:
            self.shared_expert = nn.ModuleDict({
                "gate_proj": nn.Linear(d, shared, bias=False), "up_proj": nn.Linear(d, shared, bias=False),
                "down_proj": nn.Linear(shared, d, bias=False)})
            self.shared_expert_gate = nn.Linear(d, 1, bias=False)
            block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(shared_expert_intermediate_size=shared, **common))
        else:
            block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**common))
        self.block = [block]  # a list: not a submodule, so not in the state dict

    def forward(self, x):
        block = self.block[0]
        params = {
            "gate.weight": self.gate.weight,
            "experts.gate_up_proj": torch.stack(
                [torch.cat([ex["gate_proj"].weight, ex["up_proj"].weight]) for ex in self.experts]),
            "experts.down_proj": torch.stack([ex["down_proj"].weight for ex in self.experts]),
        }
        if hasattr(self, "shared_expert"):
            for name in ("gate_proj", "up_proj", "down_proj"):
                params[f"shared_expert.{name}.weight"] = self.shared_expert[name].weight
            params["shared_expert_gate.weight"] = self.shared_expert_gate.weight
        block.train(self.training)
        return torch.func.functional_call(block, params, (x,))


class PositionEmbedding(nn.Module):
    def __init__(self, spec):
        super().__init__()
        m, d = spec["max_positions"], spec["dim"]
        self.learned = spec["encoding"] == "learned"
        if self.learned:
            self.weight = nn.Parameter(torch.randn(m, d))
        else:
            # "Attention Is All You Need", as the PyTorch tutorial writes it.
            pe = torch.zeros(m, d, dtype=torch.float64)
            pos = torch.arange(m, dtype=torch.float64)[:, None]
            div = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-torch.log(torch.tensor(10000.0, dtype=torch.float64)) / d))
            pe[:, 0::2] = torch.sin(pos * div)
            pe[:, 1::2] = torch.cos(pos * div)[:, : d // 2]
            self.register_buffer("table", pe.float(), persistent=False)

    def forward(self, x):
        table = self.weight if self.learned else self.table
        return x + table[: x.shape[1]].to(x.dtype)


class Select(nn.Module):
    def __init__(self, dim, index):
        super().__init__()
        self.dim, self.index = dim, index

    def forward(self, x):
        return torch.select(x, self.dim, self.index)


class Transpose(nn.Module):
    def __init__(self, dim0, dim1):
        super().__init__()
        self.dims = (dim0, dim1)

    def forward(self, x):
        return x.transpose(*self.dims)


class TokenTypeEmbedding(nn.Module):
    """BERT's token_type_embeddings for one segment: row 0 added."""

    def __init__(self, num_types, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_types, dim))

    def forward(self, x):
        return x + self.weight[0]


class ClassToken(nn.Module):
    """ViT's cls_token, prepended."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, 1, dim))

    def forward(self, x):
        return torch.cat([self.weight.expand(x.shape[0], -1, -1), x], dim=1)


class TiedLinear(nn.Module):
    """y = x W^T with W another module's parameter, found by name on the root model."""

    def __init__(self, spec):
        super().__init__()
        self.name = spec["weight"]
        self.root = []  # set by tie(); a list, so that the root is not a submodule

    def forward(self, x):
        return nn.functional.linear(x, self.root[0].get_parameter(self.name))


def tie(root):
    for m in root.modules():
        if isinstance(m, TiedLinear):
            m.root[:] = [root]
    return root


def with_inits(module, spec):
    with torch.no_grad():
        if spec.get("weight_init") is not None:
            apply_init(module.weight, spec["weight_init"])
        if spec.get("bias_init") is not None and module.bias is not None:
            apply_init(module.bias, spec["bias_init"])
    return module


def pool_args(spec):
    stride = spec.get("stride")
    return dict(
        kernel_size=tuple(spec["kernel_size"]),
        stride=None if stride is None else tuple(stride),
        padding=tuple(spec.get("padding", [0, 0])),
    )


def build(spec):
    return tie(build_layer(spec))


def build_layer(spec):
    kind = spec["type"]
    if kind == "linear":
        return with_inits(nn.Linear(spec["in_features"], spec["out_features"], bias=spec["bias"]), spec)
    if kind == "conv1d":
        m = nn.Conv1d(spec["in_channels"], spec["out_channels"], spec["kernel_size"], stride=spec["stride"],
                      padding=spec["padding"], dilation=spec["dilation"], groups=spec["groups"], bias=spec["bias"])
        return with_inits(m, spec)
    if kind == "conv2d":
        m = nn.Conv2d(spec["in_channels"], spec["out_channels"], tuple(spec["kernel_size"]),
                      stride=tuple(spec["stride"]), padding=tuple(spec["padding"]),
                      dilation=tuple(spec["dilation"]), groups=spec["groups"], bias=spec["bias"])
        return with_inits(m, spec)
    if kind == "conv_transpose2d":
        m = nn.ConvTranspose2d(spec["in_channels"], spec["out_channels"], tuple(spec["kernel_size"]),
                               stride=tuple(spec["stride"]), padding=tuple(spec["padding"]),
                               output_padding=tuple(spec["output_padding"]), groups=spec["groups"],
                               bias=spec["bias"], dilation=tuple(spec["dilation"]))
        return with_inits(m, spec)
    if kind == "max_pool2d":
        return nn.MaxPool2d(**pool_args(spec))
    if kind == "avg_pool2d":
        return nn.AvgPool2d(**pool_args(spec))
    if kind == "adaptive_avg_pool2d":
        return nn.AdaptiveAvgPool2d(tuple(spec["output_size"]))
    if kind in ("batch_norm1d", "batch_norm2d"):
        cls = nn.BatchNorm1d if kind == "batch_norm1d" else nn.BatchNorm2d
        return cls(spec["num_features"], eps=spec["eps"], momentum=spec["momentum"], affine=spec["affine"],
                   track_running_stats=spec["track_running_stats"])
    if kind == "layer_norm":
        return nn.LayerNorm(spec["normalized_shape"], eps=spec["eps"],
                            elementwise_affine=spec["elementwise_affine"], bias=spec["bias"])
    if kind == "group_norm":
        return nn.GroupNorm(spec["num_groups"], spec["num_channels"], eps=spec["eps"], affine=spec["affine"])
    if kind == "dropout":
        return nn.Dropout(spec["p"])
    if kind == "embedding":
        if spec.get("scale") is not None:
            # Gemma 3's scaled embedding: the factor in the weight's dtype.
            from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

            m = Gemma3TextScaledWordEmbedding(spec["num_embeddings"], spec["embedding_dim"],
                                              spec.get("padding_idx"), embed_scale=spec["scale"])
        else:
            m = nn.Embedding(spec["num_embeddings"], spec["embedding_dim"], padding_idx=spec.get("padding_idx"))
        if spec.get("weight_init") is not None:
            with torch.no_grad():
                apply_init(m.weight, spec["weight_init"])
                if m.padding_idx is not None:
                    m.weight[m.padding_idx].fill_(0)
        return m
    if kind == "flatten":
        return nn.Flatten(spec["start_dim"], spec["end_dim"])
    if kind == "select":
        return Select(spec["dim"], spec["index"])
    if kind == "transpose":
        return Transpose(spec["dim0"], spec["dim1"])
    if kind == "token_type_embedding":
        return TokenTypeEmbedding(spec["num_types"], spec["dim"])
    if kind == "class_token":
        return ClassToken(spec["dim"])
    if kind == "relu":
        return nn.ReLU()
    if kind == "leaky_relu":
        return nn.LeakyReLU(spec["negative_slope"])
    if kind == "gelu":
        return nn.GELU(approximate=spec["approximate"])
    if kind == "silu":
        return nn.SiLU()
    if kind == "tanh":
        return nn.Tanh()
    if kind == "scale":
        return Scale(spec["factor"])
    if kind == "sigmoid":
        return nn.Sigmoid()
    if kind == "softmax":
        return nn.Softmax(dim=spec["dim"])
    if kind == "log_softmax":
        return nn.LogSoftmax(dim=spec["dim"])
    if kind == "multi_head_self_attention":
        return SelfAttention(spec["embed_dim"], spec["num_heads"], spec["dropout"], spec["bias"], spec["causal"])
    if kind == "rms_norm":
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        # Their weights start as torch.ones / torch.zeros, which the recorder
        # does not see: the same values, set through torch.nn.init.
        offset = spec["weight_offset"]
        if offset == 0 and spec.get("scale_in_float32"):
            from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

            norm = Olmo2RMSNorm(spec["dim"], eps=spec["eps"])
            nn.init.ones_(norm.weight)
            return norm
        if offset == 0:
            norm = LlamaRMSNorm(spec["dim"], eps=spec["eps"])
            nn.init.ones_(norm.weight)
            return norm
        if offset == 1:
            norm = GemmaRMSNorm(spec["dim"], eps=spec["eps"])
            nn.init.zeros_(norm.weight)
            return norm
        raise ValueError(f"no reference RMSNorm with weight_offset {offset}")
    if kind == "self_attention":
        return GroupedQueryAttention(spec)
    if kind == "gated_mlp":
        return GatedMlp(spec)
    if kind == "sparse_moe":
        return SparseMoe(spec)
    if kind == "position_embedding":
        return PositionEmbedding(spec)
    if kind == "tied_linear":
        return TiedLinear(spec)
    if kind == "sequential":
        return nn.Sequential(*[build_layer(child) for child in spec["layers"]])
    if kind == "residual":
        return Residual(build_layer(spec["block"]))
    if kind == "parallel":
        return Parallel([build_layer(child) for child in spec["branches"]])
    raise ValueError(f"unknown layer type {kind}")


def run_forward(model, case):
    dtype = torch.int64 if case.get("input_dtype") == "int64" else torch.float32
    x = torch.zeros(case["input"], dtype=dtype)
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
        return {"output": list(out.shape), "error": None}
    except Exception as e:  # torch reports bad shapes with several exception types
        return {"output": None, "error": f"{type(e).__name__}: {e}"}


def summarize(model, case):
    from torch.utils.flop_counter import FlopCounterMode

    dtype = torch.int64 if case.get("input_dtype") == "int64" else torch.float32
    # Two samples (batch norm without running statistics needs more than one
    # value per channel), reported per sample.
    x = torch.zeros([2] + case["input"][1:], dtype=dtype)
    shapes = {}

    def hook(name):
        def record(_module, _inputs, out):
            if torch.is_tensor(out):
                shapes[name] = [1] + list(out.shape)[1:]

        return record

    hooks = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
    model.eval()
    # With gradients on, and attention in its math form: nn.MultiheadAttention's
    # no-grad fast path and the CPU flash-attention kernel are fused ops
    # FlopCounterMode does not count.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x)
    for h in hooks:
        h.remove()
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_modules()}
    return {"shapes": shapes, "params": params, "flops": counter.get_total_flops() // 2}


def describe_state(model):
    state = []
    for name, t in model.state_dict(keep_vars=True).items():
        dist = RECORDED.get(t.data_ptr())
        zero_rows = []
        if t.dim() == 2 and dist is not None and dist["type"] != "constant":
            zero_rows = [i for i in range(t.shape[0]) if bool((t[i] == 0).all())]
        state.append({
            "name": name,
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "init": dist,
            "zero_rows": zero_rows,
        })
    return state


def main():
    with open(sys.argv[1]) as f:
        request = json.load(f)
    torch.manual_seed(0)
    result = {"models": {}, "shapes": {}, "inits": {}}
    for case in request.get("models", []):
        RECORDED.clear()
        model = build(case["layer"])
        entry = {"state": describe_state(model)}
        entry.update(run_forward(model, case))
        entry["summary"] = summarize(model, case)
        result["models"][case["name"]] = entry
    for case in request.get("shapes", []):
        try:
            model = build(case["layer"])
        except Exception as e:
            result["shapes"][case["name"]] = {"output": None, "error": f"{type(e).__name__}: {e}"}
            continue
        result["shapes"][case["name"]] = run_forward(model, case)
    for case in request.get("inits", []):
        t = torch.empty(case["shape"])
        RECORDED.pop(t.data_ptr(), None)
        try:
            apply_init(t, case["init"])
            result["inits"][case["name"]] = {"init": RECORDED.get(t.data_ptr()), "error": None}
        except Exception as e:
            result["inits"][case["name"]] = {"init": None, "error": f"{type(e).__name__}: {e}"}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
