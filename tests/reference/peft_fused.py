"""PEFT adapters of fused modules (tests/lora.rs): Phi-3's qkv_proj and
gate_up_proj, GPT-2's c_attn (a Conv1D, fan_in_fan_out), GPT-NeoX's query_key_value
(its rows head by head); and of Cohere's q_proj and k_proj, whose rows Kiln reorders.

Usage:
  python peft_fused.py make MODELS OUT
      For each of phi3_5_mini, gpt2, gpt_neox and cohere in MODELS (tests/reference/pretrained.py's tiny
      models): a PEFT LoRA adapter with random lora_A and lora_B (PEFT's own
      layout: one rank-2 adapter per fused module) in OUT/<family>-peft, and
      OUT/<family>.io.safetensors with a probe of token ids and PEFT's logits.
  python peft_fused.py check MODELS FAMILY ADAPTER IO
      PeftModel.from_pretrained(base, ADAPTER) (an adapter Kiln wrote) on the
      probe of OUT/<family>.io.safetensors; its logits to IO.
"""

import os
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

TARGETS = {
    "phi3_5_mini": ["qkv_proj", "gate_up_proj", "o_proj"],
    "gpt2": ["c_attn", "c_proj"],
    "gpt_neox": ["query_key_value", "dense_h_to_4h"],
    "cohere": ["q_proj", "k_proj", "v_proj"],
}


def make(models, out):
    os.makedirs(out, exist_ok=True)
    for family, targets in TARGETS.items():
        torch.manual_seed(7)
        base = AutoModelForCausalLM.from_pretrained(os.path.join(models, family))
        config = LoraConfig(r=2, lora_alpha=6, lora_dropout=0.0, target_modules=targets,
                            init_lora_weights=False, fan_in_fan_out=family == "gpt2")
        model = get_peft_model(base, config)
        model.eval()
        gen = torch.Generator().manual_seed(3)
        probe = torch.randint(3, base.config.vocab_size, (2, 9), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=probe).logits
        model.save_pretrained(os.path.join(out, f"{family}-peft"))
        save_file({"probe": probe, "peft_logits": logits.contiguous()},
                  os.path.join(out, f"{family}.io.safetensors"))


def check(models, family, adapter, io_path):
    out = os.path.dirname(adapter)
    probe = load_file(os.path.join(out, f"{family}.io.safetensors"))["probe"]
    base = AutoModelForCausalLM.from_pretrained(os.path.join(models, family))
    model = PeftModel.from_pretrained(base, adapter)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    save_file({"peft_logits": logits.contiguous()}, io_path)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    else:
        check(*sys.argv[2:6])
