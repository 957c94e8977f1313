"""References for tests/lora.rs: text data tokenized by transformers, and LoRA
fine-tuning by PEFT.

`make OUT` writes, under OUT:
- base/: a tiny LLaMA (random weights, `save_pretrained`) with a byte-level BPE
  tokenizer trained here (BOS added by its post-processor);
- other_base/: a LLaMA of another width (an adapter for `base` does not fit it);
- train.jsonl (question/answer pairs; the same as train.parquet, written by
  `datasets`' `to_parquet`) and corpus.jsonl (texts with Unicode,
  whitespace runs and special tokens written in the text);
- tokens.json: what `transformers`' tokenizer gives for them (instruction rows
  as prompt ids + response ids + EOS with the prompt's labels -100, corpus rows
  with EOS), checked here against the `tokenizers` library too;
- init_adapter/: PEFT's LoRA adapters (r 4, alpha 8, on q_proj, v_proj and
  down_proj, random A and B) before training, as `save_pretrained` writes them;
- peft_trained/: the same after 20 AdamW steps on train.jsonl (batches of 4 in
  order, padded to the longest on the right, with attention masks);
- cases.json: the 20 training losses and the settings; io.safetensors: probe
  token ids and the trained PEFT model's logits for them.

`check OUT ADAPTER MERGED IO` loads Kiln's adapter directory ADAPTER with
`PeftModel.from_pretrained` on base/ and Kiln's merged model directory MERGED
with `from_pretrained`, and writes both models' logits for the probe to IO.
"""

import json
import os
import random
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PROMPT = "### Question:\n{question}\n\n### Answer:\n"
TARGETS = ["q_proj", "v_proj", "down_proj"]
STEPS = 20
BATCH = 4
LR = 1e-2

ANIMALS = ["cat", "dog", "fox", "owl", "horse", "duck", "mouse", "bear"]
PLACES = ["garden", "river", "forest", "barn", "hill", "market"]


def instruction_rows():
    rng = random.Random(0)
    rows = []
    for i in range(24):
        animal, place = rng.choice(ANIMALS), rng.choice(PLACES)
        question = f"Where does the {animal} sleep?"
        if i % 5 == 0:
            question += "  (answer   briefly)\t"
        if i % 7 == 0:
            question = "Café naïve — 東京 🦊: " + question
        rows.append({"question": question, "answer": f"The {animal} sleeps by the {place}."})
    return rows


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "   leading spaces,   runs of   spaces\tand\ttabs\n\nand blank lines  ",
    "Unicode: naïve café, Ærøskøbing, 東京, Москва, emoji 🦊🐻 and combining é.",
    "Special tokens in the text: <s> begins, </s> ends, <pad> pads.",
    "",
    "Numbers 1234567890 and symbols !@#$%^&*() ~`|\\ {braces}",
]


def make_tokenizer(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def save_llama(path, tok, hidden, seed):
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)


def examples(tok, rows):
    eos = tok.eos_token_id
    out = []
    for row in rows:
        prompt = tok(PROMPT.format(**row))["input_ids"]
        response = tok(row["answer"], add_special_tokens=False)["input_ids"] + [eos]
        out.append({"ids": prompt + response, "labels": [-100] * len(prompt) + response})
    return out


def padded(batch):
    longest = max(len(e["ids"]) for e in batch)
    ids = torch.tensor([e["ids"] + [0] * (longest - len(e["ids"])) for e in batch])
    labels = torch.tensor([e["labels"] + [-100] * (longest - len(e["labels"])) for e in batch])
    mask = torch.tensor([[1] * len(e["ids"]) + [0] * (longest - len(e["ids"])) for e in batch])
    return ids, labels, mask


def make(out):
    os.makedirs(out, exist_ok=True)
    rows = instruction_rows()
    texts = CORPUS + [PROMPT.format(**r) + r["answer"] for r in rows]
    raw = make_tokenizer(texts)
    base = os.path.join(out, "base")
    save_llama(base, raw, 32, 0)
    save_llama(os.path.join(out, "other_base"), raw, 48, 1)
    with open(os.path.join(out, "train.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(os.path.join(out, "train.parquet"))
    with open(os.path.join(out, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for t in CORPUS:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")

    tok = AutoTokenizer.from_pretrained(base)
    plain = Tokenizer.from_file(os.path.join(base, "tokenizer.json"))
    corpus = []
    for t in CORPUS:
        ids = tok(t)["input_ids"]
        assert ids == plain.encode(t).ids, t
        corpus.append(ids + [tok.eos_token_id])
    train = examples(tok, rows)
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump({"instruction": train, "corpus": corpus}, f)

    model = LlamaForCausalLM.from_pretrained(base)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                        init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(1)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(os.path.join(out, "init_adapter"))
    peft_model.train()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR)
    batches = [train[i:i + BATCH] for i in range(0, len(train), BATCH)]
    losses = []
    for step in range(STEPS):
        ids, labels, mask = padded(batches[step % len(batches)])
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    peft_model.save_pretrained(os.path.join(out, "peft_trained"))
    peft_model.eval()
    gen = torch.Generator().manual_seed(2)
    probe = torch.randint(3, raw.get_vocab_size(), (2, 11), generator=gen)
    with torch.no_grad():
        logits = peft_model(input_ids=probe).logits
    save_file({"probe": probe, "peft_logits": logits.contiguous()},
              os.path.join(out, "io.safetensors"))
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"losses": losses, "steps": STEPS, "batch": BATCH, "lr": LR,
                   "prompt": PROMPT, "targets": TARGETS}, f)


def check(out, adapter, merged, io_path):
    probe = load_file(os.path.join(out, "io.safetensors"))["probe"]
    base = LlamaForCausalLM.from_pretrained(os.path.join(out, "base"))
    peft_model = PeftModel.from_pretrained(base, adapter)
    peft_model.eval()
    tuned = LlamaForCausalLM.from_pretrained(merged)
    tuned.eval()
    with torch.no_grad():
        result = {"peft_logits": peft_model(input_ids=probe).logits.contiguous(),
                  "merged_logits": tuned(input_ids=probe).logits.contiguous()}
    save_file(result, io_path)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        check(*sys.argv[2:6])
