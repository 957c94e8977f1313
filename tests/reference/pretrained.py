"""Reference for Kiln's Hugging Face checkpoints and generation (tests/pretrained.rs).

Usage: python pretrained.py make OUT_DIR
       python pretrained.py check MODEL_DIR IO.safetensors

`make` writes tiny models with random weights through `save_pretrained` (nothing is
downloaded), one directory per case under OUT_DIR, each with a byte-level BPE
`tokenizer.json` trained here on a few sentences, and OUT_DIR/<case>.io.safetensors:

    input_ids         [2, 7] int64 token ids
    logits            transformers' logits for them, float32
    prompt_ids        [3, 5] int64 prompts, left-padded with pad_id (attention_mask says where)
    attention_mask    [3, 5] int64, 0 on the padding
    greedy            [3, 5 + NEW] transformers' `generate(do_sample=False)` (prompt included)

OUT_DIR/<case>.grads.safetensors (decoders) holds `loss` and `grad.<name>`, one training step of
`model(input_ids, labels=input_ids)` from the saved weights (a mixture of experts' named as its
checkpoint names them, one tensor per expert; a mixture of experts' also `aux_loss`, transformers'
load-balancing loss, and `router_z_loss`, both whether or not its loss includes them); and OUT_DIR/cases.json lists {"name", "family", "sharded", "decoder", "pad_id", "new_tokens",
"length_dependent_rope"}. The decoders include one model per scaled rope_type (linear, dynamic,
yarn, llama3, proportional; longrope is Phi-3's, whose generate recomputes the cache when the
sequence outgrows the original context) and sliding windows; dynamic NTK's frequencies follow
the sequence's length, so only cached generation (transformers' own) is compared for it.
Two encoders, BERT (`BertForSequenceClassification`, 3 labels) and ViT
(`ViTForImageClassification`, 16x16 images, 5 labels), have only `input_ids` (`pixel_values`
for ViT) and `logits`.

`check` loads MODEL_DIR (a directory Kiln saved) with `from_pretrained` and prints
the largest difference between its logits for `input_ids` and IO's `kiln_logits`.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

NEW = 12
TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a kiln fires clay into stone, slowly and evenly",
    "rust engineers train neural networks from rust",
    "hello there, general kenobi",
]


def tokenizer(vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    return tok


def configs():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, **common)
    return [
        ("llama", LlamaConfig(**llama, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), False),
        ("llama_tied_sharded", LlamaConfig(**llama, tie_word_embeddings=True), True),
        ("mistral", MistralConfig(**llama, sliding_window=None), False),
        ("qwen2", Qwen2Config(**llama, use_sliding_window=False), False),
        ("qwen3", Qwen3Config(**llama, head_dim=12, use_sliding_window=False), False),
        ("gpt2", GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common), False),
        # Sliding windows shorter than the prompts: Mistral v0.1's on every layer, Qwen2's
        # from max_window_layers on.
        ("mistral_sliding", MistralConfig(**llama, sliding_window=3), False),
        ("qwen2_sliding", Qwen2Config(**llama, use_sliding_window=True, sliding_window=4, max_window_layers=1),
         False),
    ] + scaled_ropes(llama)


# Every rope_type of transformers' ROPE_INIT_FUNCTIONS, each with the real checkpoint's
# fields but its context lengths shrunk below the prompts' (7 tokens for the logits,
# 5 + NEW when generating), so that ignoring the scaling changes the result.
LENGTH_DEPENDENT = {"llama_dynamic"}
# Written back in the Hub's older form (top-level rope_theta and rope_scaling), as
# Llama 3.x's config.json files are.
# Gemma's as google/gemma-2b has it (the legacy hidden_act "gelu", which transformers reads as
# the tanh approximation), Gemma 2's as gemma-2-2b has it (no layer_types: they alternate).
OLD_FORM = {"llama3_2", "gemma3_1b", "gemma", "gemma2", "gpt_neox"}


def scaled_ropes(llama):
    from transformers import (CohereConfig, Gemma2Config, Gemma3TextConfig, GemmaConfig, GPTNeoXConfig,
                              GraniteConfig, LlamaConfig, MixtralConfig, Olmo2Config, OlmoeConfig, Phi3Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig, SmolLM3Config, StableLmConfig)

    # Llama 3.2 1B's rope_scaling (factor 32, 8192 tokens shrunk to 16).
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    # Qwen3's documented YaRN setting (factor 4 over 32768 tokens, shrunk to 8).
    yarn = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8}
    dynamic = dict(llama, max_position_embeddings=6)
    # Phi-3.5-mini's config (LongRoPE with its context at the top level, a window on
    # every layer) and Phi-4-mini's (partial rotary over 3/4 of each head, tied), shrunk.
    phi = dict(llama, max_position_embeddings=64, original_max_position_embeddings=6)
    phi3_5 = Phi3Config(**phi, sliding_window=5, resid_pdrop=0.0, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.5, 3.0, 6.0, 12.0]})
    phi4 = Phi3Config(**phi, partial_rotary_factor=0.75, tie_word_embeddings=True, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3], "long_factor": [2.0, 5.0, 9.0]})
    # Gemma 3: local layers (window 3) with their own RoPE base beside a global one with
    # Gemma 3 4B's linear scaling, query_pre_attn_scalar apart from head_dim; and Gemma 3
    # 1B's older config form (rope_local_base_freq, sliding_window_pattern).
    gemma = dict(llama, head_dim=8, sliding_window=3, query_pre_attn_scalar=24)
    gemma3 = Gemma3TextConfig(**gemma, layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    gemma3_1b = Gemma3TextConfig(**gemma, layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    # Gemma 2: its softcaps (50 and 30 in gemma-2-2b) shrunk to where the scores and logits
    # reach them, local layers alternating with global ones.
    gemma2 = Gemma2Config(**gemma, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    gemma1 = GemmaConfig(**llama, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # Granite 3's multipliers (its attention_multiplier moved off 1/sqrt(head_dim)).
    granite = GraniteConfig(**llama, embedding_multiplier=12.0, attention_multiplier=0.25,
                            residual_multiplier=0.22, logits_scaling=8.0)
    # SmolLM3: a NoPE layer every no_rope_layer_interval-th, here the second of two, which
    # also slides (its default layer_types with use_sliding_window).
    smollm3 = SmolLM3Config(**llama, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=3,
                            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0})
    # Mixtures of experts, each with its published checkpoint's routing (Mixtral 8x7B's
    # renormalised top-2 of 8, Qwen3-30B-A3B's norm_topk_prob, OLMoE's un-normalised top-k and
    # whole-projection QK-norm, Qwen1.5-MoE's gated shared expert beside a dense first layer),
    # fewer and smaller experts. Qwen2-MoE and OLMoE train with their load-balancing loss
    # (output_router_logits, as fine-tuning turns it on), weighed heavily so that leaving it
    # out changes the loss and every router's gradient.
    moe = dict(llama, num_experts_per_tok=2)
    mixtral = MixtralConfig(**moe, num_local_experts=4, sliding_window=None)
    qwen2_moe = Qwen2MoeConfig(**moe, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                               mlp_only_layers=[0], use_sliding_window=False, output_router_logits=True,
                               router_aux_loss_coef=0.3)
    qwen3_moe = Qwen3MoeConfig(**dict(moe, num_experts_per_tok=3), head_dim=12, num_experts=6,
                               moe_intermediate_size=16, norm_topk_prob=True)
    olmoe = OlmoeConfig(**moe, num_experts=4, output_router_logits=True, router_aux_loss_coef=0.5)
    olmo2 = Olmo2Config(**llama, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    # StableLM 2 1.6B's block: LayerNorms, biases on q, k and v, a quarter of each head rotated
    # (transformers' default partial_rotary_factor).
    stablelm = StableLmConfig(**llama, use_qkv_bias=True)
    # Pythia's block (written back with its rotary_pct and rotary_emb_base, as its config.json
    # has them): the parallel residual, a fused query_key_value laid out head by head, a
    # quarter of each head rotated, GELU, an untied embed_out; and the sequential residual
    # with half of each head rotated and a tied head.
    neox = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    gpt_neox = GPTNeoXConfig(**neox, rotary_pct=0.25, rotary_emb_base=10000)
    gpt_neox_sequential = GPTNeoXConfig(**neox, use_parallel_residual=False, rotary_pct=0.5,
                                        tie_word_embeddings=True)
    # Command R's block: one LayerNorm without a bias before the attention and the MLP side by
    # side, interleaved RoPE, grouped-query heads, a tied head scaled by logit_scale.
    cohere = CohereConfig(**llama)
    return [
        ("gpt_neox", gpt_neox, False),
        ("gpt_neox_sequential", gpt_neox_sequential, False),
        ("cohere", cohere, False),
        ("olmo2", olmo2, False),
        ("stablelm", stablelm, False),
        ("mixtral", mixtral, False),
        ("qwen2_moe", qwen2_moe, False),
        ("qwen3_moe", qwen3_moe, False),
        ("olmoe", olmoe, False),
        ("gemma", gemma1, False),
        ("gemma2", gemma2, False),
        ("smollm3", smollm3, False),
        ("granite", granite, False),
        ("gemma3_text", gemma3, False),
        ("gemma3_1b", gemma3_1b, False),
        ("phi3_5_mini", phi3_5, False),
        ("phi4_mini", phi4, False),
        ("llama3_2", LlamaConfig(**llama, rope_parameters=llama3, tie_word_embeddings=True), False),
        ("qwen3_yarn", Qwen3Config(**llama, head_dim=12, use_sliding_window=False, rope_parameters=yarn), False),
        ("llama_linear", LlamaConfig(**llama, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                "factor": 4.0}), False),
        ("llama_dynamic", LlamaConfig(**dynamic, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                   "factor": 4.0}), False),
        ("llama_proportional", LlamaConfig(**llama, rope_parameters={
            "rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 2.0}), False),
    ]


def old_form(d):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        config = json.load(f)
    params = config.pop("rope_parameters")
    if config["model_type"] == "gpt_neox":
        config["rotary_pct"] = params["partial_rotary_factor"]
        config["rotary_emb_base"] = params["rope_theta"]
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
        return
    if config["model_type"] in ("gemma", "gemma2"):
        config["rope_theta"] = params["rope_theta"]
        if config["model_type"] == "gemma":
            config["hidden_act"] = "gelu"
            config["hidden_activation"] = None
        else:
            types = config.pop("layer_types")
            assert types == ["sliding_attention", "full_attention"] * (len(types) // 2), types
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
        return
    if "sliding_attention" in params:
        # Gemma 3's: the global base, the local one, and the layers' pattern.
        config["rope_theta"] = params["full_attention"]["rope_theta"]
        config["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        config["rope_scaling"] = None
        assert config.pop("layer_types") == ["sliding_attention", "full_attention"]
        config["sliding_window_pattern"] = 2
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
        return
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def padded(ids):
    """`ids` with row 0 padded (id 0) on its last 2 positions and row 1 on its first 3, and the mask."""
    ids = ids.clone()
    mask = torch.ones_like(ids)
    ids[0, -2:] = 0
    mask[0, -2:] = 0
    ids[1, :3] = 0
    mask[1, :3] = 0
    return ids, mask


def encoders():
    from transformers import BertConfig, ViTConfig

    bert = BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48, max_position_embeddings=64, num_labels=3, pad_token_id=0)
    bert.architectures = ["BertForSequenceClassification"]
    vit = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=48, num_labels=5)
    vit.architectures = ["ViTForImageClassification"]
    return [("bert", bert), ("vit", vit)]


def make_encoders(out, cases):
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    for name, config in encoders():
        torch.manual_seed(0)
        auto = AutoModelForImageClassification if name == "vit" else AutoModelForSequenceClassification
        model = auto.from_config(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        d = os.path.join(out, name)
        model.save_pretrained(d)
        g = torch.Generator().manual_seed(1)
        if name == "vit":
            x = torch.randn(2, 3, 16, 16, generator=g)
            with torch.no_grad():
                logits = model(pixel_values=x).logits.float()
            save_file({"pixel_values": x, "logits": logits.contiguous()}, os.path.join(out, f"{name}.io.safetensors"))
        else:
            ids = torch.randint(3, config.vocab_size, (2, 7), generator=g)
            pad_ids, pad_mask = padded(ids)
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()
                padded_logits = model(input_ids=pad_ids, attention_mask=pad_mask).logits.float()
            save_file({"input_ids": ids, "logits": logits.contiguous(), "padded_ids": pad_ids,
                       "padded_mask": pad_mask, "padded_logits": padded_logits.contiguous()},
                      os.path.join(out, f"{name}.io.safetensors"))
        cases.append({"name": name, "family": name, "sharded": False, "decoder": False})


def make(out):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cases = []
    for name, config, sharded in configs():
        config.architectures = None
        model = AutoModelForCausalLM.from_config(config).eval()
        # Random, not the init's small normal: logits then span a useful range.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        d = os.path.join(out, name)
        model.save_pretrained(d, max_shard_size="40KB" if sharded else "5GB")
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer(config.vocab_size), bos_token="<s>",
                                       eos_token="</s>", pad_token="<pad>")
        fast.save_pretrained(d)
        if name in OLD_FORM:
            old_form(d)
            model = AutoModelForCausalLM.from_pretrained(d).eval()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, config.vocab_size, (2, 7), generator=g)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        prompts = torch.randint(3, config.vocab_size, (3, 5), generator=g)
        mask = torch.ones_like(prompts)
        prompts[1, :2] = 0
        mask[1, :2] = 0
        prompts[2, :1] = 0
        mask[2, :1] = 0
        # A fresh copy: dynamic NTK keeps the longest length it has seen.
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            # (without the router losses: transformers' load_balancing_loss_func fails on
            # a cached step, its router logits being the new token's only.)
            extra = {"output_router_logits": False} if getattr(config, "output_router_logits", False) else {}
            greedy = model.generate(input_ids=prompts, attention_mask=mask, do_sample=False,
                                    max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                                    **extra)
        # One training step: the next-token loss and every parameter's gradient.
        # (in evaluation mode: GPT-2's dropout would draw masks).
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        step = model(input_ids=ids, labels=ids)
        step.loss.backward()
        grads = {f"grad.{n}": p.grad.contiguous() for n, p in model.named_parameters()}
        if config.model_type == "gpt_neox" and "grad.lm_head.weight" in grads:
            # transformers 5's lm_head is the checkpoint's embed_out (its conversion mapping).
            grads["grad.embed_out.weight"] = grads.pop("grad.lm_head.weight")
        router = {}
        if "experts" in "".join(grads):
            # The router losses, weighed in or not: transformers' load-balancing loss, and the
            # z-loss (ST-MoE's mean squared logsumexp) over the same router logits.
            with torch.no_grad():
                r = model(input_ids=ids, output_router_logits=True)
                logits_all = torch.cat([l.float() for l in r.router_logits])
                router = {"aux_loss": r.aux_loss.float().reshape(1),
                          "router_z_loss": logits_all.logsumexp(-1).pow(2).mean().reshape(1)}
            # transformers 5 holds each layer's experts as 3-d tensors and saves them one
            # tensor per expert: the gradients, named as the checkpoint names them.
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
            grad_dir = os.path.join(out, f"{name}.grads")
            model.save_pretrained(grad_dir)
            grads = {f"grad.{n}": t for n, t in load_file(os.path.join(grad_dir, "model.safetensors")).items()}
        save_file({"loss": step.loss.detach().reshape(1), **router, **grads},
                  os.path.join(out, f"{name}.grads.safetensors"))
        # A padded batch with its attention mask: row 0 padded on the right, row 1 on the left.
        pad_ids, pad_mask = padded(ids)
        padded_out = {"padded_ids": pad_ids, "padded_mask": pad_mask}
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            padded_out["padded_logits"] = model(input_ids=pad_ids, attention_mask=pad_mask).logits.float().contiguous()
            if router:
                # transformers' load-balancing loss given the mask (its attention_mask
                # branch), and the z-loss over the same logits' tokens.
                r = model(input_ids=pad_ids, attention_mask=pad_mask, output_router_logits=True)
                lse = torch.cat([l.float() for l in r.router_logits]).logsumexp(-1)
                kept = pad_mask.reshape(-1).bool().repeat(len(r.router_logits))
                padded_out["padded_aux_loss"] = r.aux_loss.float().reshape(1)
                padded_out["padded_router_z_loss"] = lse[kept].pow(2).mean().reshape(1)
        if name == "llama":
            # The sequence classifier over the same batch: its last non-padding token.
            from transformers import AutoModelForSequenceClassification
            torch.manual_seed(2)
            cls = AutoModelForSequenceClassification.from_pretrained(d, num_labels=3).eval()
            with torch.no_grad():
                padded_out["classifier_logits"] = cls(input_ids=pad_ids, attention_mask=pad_mask).logits.float().contiguous()
            padded_out["score.weight"] = cls.score.weight.detach().contiguous()
        save_file({"input_ids": ids, "logits": logits.contiguous(), "prompt_ids": prompts,
                   "attention_mask": mask, "greedy": greedy.contiguous(), **padded_out},
                  os.path.join(out, f"{name}.io.safetensors"))
        text = "the quick brown fox, slowly: a kiln!"
        cases.append({"name": name, "family": config.model_type, "sharded": sharded, "pad_id": 0,
                      "new_tokens": NEW, "text": text, "text_ids": fast(text)["input_ids"], "decoder": True,
                      "length_dependent_rope": name in LENGTH_DEPENDENT})
    make_encoders(out, cases)
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f)


def check(model_dir, io_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    io = load_file(io_path)
    arch = AutoConfig.from_pretrained(model_dir).architectures[0]
    auto = AutoModelForSequenceClassification if "Sequence" in arch else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=io["input_ids"]).logits.float()
    print(json.dumps({"max_abs_diff": float((logits - io["kiln_logits"]).abs().max())}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        check(sys.argv[2], sys.argv[3])
