"""Reference for Kiln's conversational data (tests/pretrained/chat.rs, tests/cli_pretrained.rs):
what TRL's `SFTTrainer` makes of conversations.

Usage: python sft_conversations.py MODELS OUT_DIR

Copies MODELS/llama (tests/reference/pretrained.py's tiny LLaMA) to OUT_DIR/llama_chat with a
chat template whose assistant turns are `{% generation %}` blocks (TRL's assistant_only_loss),
writes OUT_DIR/conversations.jsonl (a `messages` column; also as `datasets` writes it to
OUT_DIR/conversations.parquet, and with a `tools` column to OUT_DIR/conversations_tools.jsonl) and OUT_DIR/prompt_completion.jsonl
(`prompt` and `completion` columns of messages), and OUT_DIR/expected.json: for each setting,
the `input_ids` and `labels` of every row of `SFTTrainer(...).train_dataset` (TRL 1.16, no
packing, no truncation), and the first row's loss `model(input_ids, labels=labels).loss` with
the copied weights. Settings: conversations with and without `assistant_only_loss`, with a
`system_prompt`-like system message added and `chat_template_kwargs`; prompt-completion with
`completion_only_loss` true and false.
"""

import json
import os
import shutil
import sys
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

TEMPLATE = (
    "{% if tools %}<s>tools\n{{ tools | tojson }}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</s>{% endgeneration %}"
    "{% else %}{{ m.content }}{% if shout is defined and shout %}!{% endif %}</s>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
SYSTEM = "be kind"
TOOL = {"type": "function", "function": {"name": "fire", "description": "Fires the kiln.",
                                         "parameters": {"type": "object", "properties": {
                                             "hours": {"type": "integer"}}, "required": ["hours"]}}}


def rows():
    conversations = [
        [{"role": "user", "content": "a kiln?"}, {"role": "assistant", "content": "an oven"}],
        [{"role": "system", "content": "clay"}, {"role": "user", "content": "heat?"},
         {"role": "assistant", "content": "hot"}, {"role": "user", "content": "how?"},
         {"role": "assistant", "content": "wood fire"}],
        [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps"}],
    ]
    completions = [
        ([{"role": "user", "content": "a kiln?"}], [{"role": "assistant", "content": "an oven"}]),
        ([{"role": "system", "content": "clay"}, {"role": "user", "content": "heat?"}],
         [{"role": "assistant", "content": "very hot"}]),
    ]
    return conversations, completions


def with_system(messages):
    if messages and messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": SYSTEM}] + messages


def prepared(model_dir, data, **config):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(output_dir=tmp, report_to=[], max_length=None, packing=False, bf16=False, use_cpu=True,
                         **config)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(data), processing_class=tok)
        ds = trainer.train_dataset
        out = {"input_ids": [list(r["input_ids"]) for r in ds], "labels": [list(r["labels"]) for r in ds]}
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([out["input_ids"][0]])
        labels = torch.tensor([out["labels"][0]])
        out["first_loss"] = model(input_ids=ids, labels=labels).loss.item()
    return out


def main(models, out):
    d = os.path.join(out, "llama_chat")
    shutil.copytree(os.path.join(models, "llama"), d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    conversations, completions = rows()
    with open(os.path.join(out, "conversations.jsonl"), "w") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}) + "\n")
    with open(os.path.join(out, "prompt_completion.jsonl"), "w") as f:
        for prompt, completion in completions:
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    # A `tools` column: a schema list on the first row, null on the others.
    with open(os.path.join(out, "conversations_tools.jsonl"), "w") as f:
        for i, messages in enumerate(conversations):
            f.write(json.dumps({"messages": messages, "tools": [TOOL] if i == 0 else None}) + "\n")
    # The same conversations as `datasets` writes them to Parquet (a list of structs).
    Dataset.from_list([{"messages": m} for m in conversations]).to_parquet(
        os.path.join(out, "conversations.parquet"))
    shout = {"shout": True}
    expected = {
        "conversation_all": prepared(d, [{"messages": m} for m in conversations]),
        "conversation_assistant": prepared(d, [{"messages": m} for m in conversations], assistant_only_loss=True),
        # Kiln's system_prompt and chat_template_kwargs, as the rows and TRL's kwargs give them.
        "conversation_system_kwargs": prepared(
            d, [{"messages": with_system(m), "chat_template_kwargs": shout} for m in conversations],
            assistant_only_loss=True),
        "conversation_tools": prepared(
            d, [{"messages": m, "tools": [TOOL] if i == 0 else None} for i, m in enumerate(conversations)],
            assistant_only_loss=True),
        "completion_only": prepared(d, [{"prompt": p, "completion": c} for p, c in completions]),
        "completion_all": prepared(d, [{"prompt": p, "completion": c} for p, c in completions],
                                   completion_only_loss=False),
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
