"""Reference for Kiln's chat templates (tests/pretrained/chat.rs).

Usage: python chat_templates.py OUT_DIR

For each real template of tests/fixtures/chat_templates (see SOURCES.md there), a tokenizer
directory OUT_DIR/<template> as `save_pretrained` writes it: a small byte-level BPE with the
template's special tokens added, its bos/eos as the checkpoint's tokenizer_config.json names
them, and the template in chat_template.jinja (or, for every other template, inside
tokenizer_config.json, the older place). OUT_DIR/cases.json lists, for each template and
conversation, what `apply_chat_template` gives (`strftime_now` at 2024-07-26 12:30):

    {"template", "case", "messages", "tools", "variables", "add_generation_prompt",
     "text", "ids", "assistant_masks"}   (assistant_masks for templates with generation blocks)
    or {"template", "case", ..., "error"} when the template raises for the conversation.
"""

import datetime
import json
import os
import re
import shutil
import sys

from transformers import PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(__file__))
from pretrained import tokenizer  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "chat_templates")
# The checkpoints' named special tokens (SOURCES.md); Qwen3's and SmolLM3's as Qwen2.5's and
# SmolLM2's files have them, Phi-3.5's as Phi-3's.
SPECIAL = {
    "llama3_2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen2_5": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "phi": {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "smollm": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
               "unk_token": "<|endoftext|>"},
    "smollm3": {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
}
# Written literally by the templates: special tokens of their tokenizers.
LITERAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>",
           "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
           "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, as \"Paris\" or \"Zürich\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
CALL = {"id": "call0abc1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}


def cases():
    system = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
    user = {"role": "user", "content": "What is a kiln?  "}
    answer = {"role": "assistant", "content": "A kiln is an oven that fires clay — slowly."}
    # A null key is dropped, as apply_chat_template drops it.
    again = {"role": "user", "content": "And its temperature, in °C?", "name": None}
    return [
        ("system_multi_turn", [system, user, answer, again], None, {}, True),
        ("first_turn", [user], None, {}, True),
        ("finished_dialogue", [user, answer, again, {"role": "assistant", "content": "About 1000 to 1300."}],
         None, {}, False),
        ("tools", [user, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                   {"role": "tool", "name": "get_weather", "tool_call_id": "call0abc1",
                    "content": "{\"temperature\": 21}"}], [WEATHER], {}, True),
        ("thinking_off", [user, {"role": "assistant", "content": "A furnace.", "reasoning_content": "Clay, heat."},
                          again], None, {"enable_thinking": False}, True),
    ]


class FixedNow(datetime.datetime):
    """`strftime_now`'s clock at a fixed time, which Kiln's test gives as `ChatOptions::now`."""

    @classmethod
    def now(cls, tz=None):
        return cls(2024, 7, 26, 12, 30, 0)


def make(out):
    import transformers.utils.chat_template_utils as chat_utils

    chat_utils.datetime = FixedNow
    os.makedirs(out, exist_ok=True)
    rows = []
    names = sorted(f[:-len(".jinja")] for f in os.listdir(ROOT) if f.endswith(".jinja"))
    for n, name in enumerate(names):
        with open(os.path.join(ROOT, f"{name}.jinja")) as f:
            source = f.read()
        special = SPECIAL[name]
        literal = [t for t in LITERAL if t in source]
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer(300), **special)
        fast.add_special_tokens({"additional_special_tokens": literal})
        fast.chat_template = source
        d = os.path.join(out, name)
        shutil.rmtree(d, ignore_errors=True)
        fast.save_pretrained(d)
        if n % 2 == 1:
            # The older place: tokenizer_config.json's chat_template.
            jinja = os.path.join(d, "chat_template.jinja")
            config_path = os.path.join(d, "tokenizer_config.json")
            with open(config_path) as f:
                config = json.load(f)
            config["chat_template"] = source
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2, ensure_ascii=False)
            os.remove(jinja)
        generation = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None
        for case, messages, tools, variables, prompt in cases():
            variables = dict(variables, date_string="26 Jul 2024")
            row = {"template": name, "case": case, "messages": messages, "tools": tools,
                   "variables": variables, "add_generation_prompt": prompt}
            try:
                row["text"] = fast.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       add_generation_prompt=prompt, **variables)
                encoded = fast.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                   add_generation_prompt=prompt,
                                                   return_assistant_tokens_mask=generation, **variables)
                row["ids"] = list(encoded["input_ids"])
                if generation:
                    row["assistant_masks"] = list(encoded["assistant_masks"])
            except Exception as e:  # the template's raise_exception, as Kiln must fail too
                row["error"] = str(e)
            rows.append(row)
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(rows, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    make(sys.argv[1])
