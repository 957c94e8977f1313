"""Reference for `kiln generate --chat` (tests/cli_pretrained.rs).

Usage: python chat_generate.py MODELS OUT_DIR

Copies MODELS/llama (tests/reference/pretrained.py's tiny LLaMA) to OUT_DIR/llama_chat with a
chat template in chat_template.jinja that ends each turn with `<pad>` (a special token of the
tiny tokenizer other than its EOS) and reads a variable `terse`, the head's row of `<pad>` made
to win where token 101 would (so that generation meets the end of a turn), writes OUT_DIR/conversation.json
(a multi-turn conversation), and OUT_DIR/expected.json: for each case, the reply that
`generate(apply_chat_template(..., add_generation_prompt=True), do_sample=False)` decodes
(special tokens skipped), stopping at the EOS or the end of a turn.
"""

import json
import os
import shutil
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content | trim }}"
    "{% if terse is defined and terse and m.role == 'system' %} Be terse.{% endif %}<pad>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
NEW = 8


def main(models, out):
    d = os.path.join(out, "llama_chat")
    shutil.copytree(os.path.join(models, "llama"), d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    # The end of a turn wins wherever token 101 would: so generation meets it and stops.
    end_of_turn = tok.convert_tokens_to_ids("<pad>")
    with torch.no_grad():
        model.lm_head.weight[end_of_turn] = 1.05 * model.lm_head.weight[101]
    model.save_pretrained(d)
    # Short: the tiny model has 64 positions.
    conversation = [
        {"role": "system", "content": "clay"},
        {"role": "user", "content": "a kiln?"},
        {"role": "assistant", "content": "oven"},
        {"role": "user", "content": "heat?"},
    ]
    with open(os.path.join(out, "conversation.json"), "w") as f:
        json.dump(conversation, f, indent=1)
    cases = {
        "prompt": ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}],
                   {}),
        "conversation": (conversation, {}),
        "terse": ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}],
                  {"terse": True}),
    }
    expected = {}
    for name, (messages, variables) in cases.items():
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                      return_tensors="pt", **variables)["input_ids"]
        with torch.no_grad():
            out_ids = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NEW, eos_token_id=[tok.eos_token_id, end_of_turn],
                                     pad_token_id=end_of_turn)
        new = out_ids[0, ids.shape[1]:].tolist()
        expected[name] = {"reply": tok.decode(new, skip_special_tokens=True), "new_tokens": new,
                          "prompt_ids": ids[0].tolist()}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
