"""Makes a tiny LLaMA-style model directory, as `save_pretrained` writes one, for
examples/pretrained_lm.rs: random weights (transformers' own initialisation: nothing
is downloaded), a byte-level BPE tokenizer trained here on a small text, and that
text as train.txt; and classify.csv, for examples/configs/pretrained-llama.toml: one
sentence of the text per row as 12 token ids (left-padded with <pad>) and a label, 1 for
"The ... by the ..." sentences and 0 for "... sees the ..." ones; and instructions.jsonl
and instructions_val.jsonl, for examples/configs/lora-llama.toml: question/answer pairs
(each animal always sleeps at its own place), which a LoRA fine-tune learns; the same pairs
as conversations (conversations.jsonl, conversations_val.jsonl: a `messages` column) and a
chat template (chat_template.jinja), for examples/configs/chat-llama.toml.

Usage: .kiln/venv/bin/python examples/pretrained/make_tiny_llama.py OUT_DIR
"""

import json
import os
import random
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

NAMES = ["anna", "ben", "clara", "david", "emma", "felix"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "duck", "mouse", "bear"]
ADJECTIVES = ["little", "old", "brown", "quiet", "happy", "sleepy", "clever", "big"]
PLACES = ["garden", "river", "forest", "barn", "hill", "market"]
RESTS = ["sleeps", "sings", "runs", "waits", "dances", "rests"]


# A turn is `<s>role\ncontent</s>\n`; the assistant's content is a {% generation %} block, so
# that assistant-only loss (TRL's assistant_only_loss) finds it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</s>{% endgeneration %}"
    "{% else %}{{ m.content }}</s>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def story(seed, sentences):
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        if rng.random() < 0.5:
            out.append(f"The {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} {rng.choice(RESTS)} "
                       f"by the {rng.choice(PLACES)}.")
        else:
            out.append(f"{rng.choice(NAMES).title()} sees the {rng.choice(ADJECTIVES)} "
                       f"{rng.choice(ANIMALS)}.")
    return " ".join(out) + "\n"


def main():
    out = sys.argv[1]
    if os.path.exists(out) and os.listdir(out):
        sys.exit(f"{out} is not empty: choose a new directory")
    text = story(0, 600)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=172,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)
    with open(os.path.join(out, "train.txt"), "w") as f:
        f.write(text)
    rows = []
    for sentence in story(1, 400).strip().split(". "):
        sentence = sentence.rstrip(".") + "."
        ids = tok.encode(sentence).ids[-12:]
        rows.append(",".join(map(str, [0] * (12 - len(ids)) + ids)) + f",{int(sentence.startswith('The '))}")
    with open(os.path.join(out, "classify.csv"), "w") as f:
        f.write("\n".join(rows) + "\n")
    # Instruction pairs: each animal has its place; the questions vary.
    home = {animal: PLACES[i % len(PLACES)] for i, animal in enumerate(ANIMALS)}
    asks = ["Where does the {a} sleep?", "Where can I find the {a} at night?",
            "Tell me where the {a} sleeps.", "Which place does the {a} sleep at?"]
    rng = random.Random(2)
    pairs = []
    for _ in range(240):
        a = rng.choice(ANIMALS)
        question = rng.choice(asks).format(a=f"{rng.choice(ADJECTIVES)} {a}")
        pairs.append({"question": question, "answer": f"The {a} sleeps by the {home[a]}."})
    for name, part in [("instructions.jsonl", pairs[:200]), ("instructions_val.jsonl", pairs[200:])]:
        with open(os.path.join(out, name), "w") as f:
            for pair in part:
                f.write(json.dumps(pair) + "\n")
    # The same pairs as conversations, rendered by the directory's chat template.
    for name, part in [("conversations.jsonl", pairs[:200]), ("conversations_val.jsonl", pairs[200:])]:
        with open(os.path.join(out, name), "w") as f:
            for pair in part:
                messages = [{"role": "user", "content": pair["question"]},
                            {"role": "assistant", "content": pair["answer"]}]
                f.write(json.dumps({"messages": messages}) + "\n")
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    print(f"wrote a {sum(p.numel() for p in LlamaForCausalLM(config).parameters())}-parameter "
          f"LLaMA, its tokenizer and train.txt to {out}")


if __name__ == "__main__":
    main()
