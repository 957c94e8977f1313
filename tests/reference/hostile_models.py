"""Tiny Hugging Face models and text data for tests/cli_hostile.rs (the CLI
against hostile or careless input), and what `transformers` computes of them.

`make OUT` writes, under OUT:
- llama/: a tiny LLaMA (random weights, `save_pretrained`, two layers) with a
  byte-level BPE tokenizer trained here (BOS added by its post-processor, EOS
  `</s>`);
- gpt2/: a tiny GPT-2 (`GPT2LMHeadModel`, two layers) with the same tokenizer;
- long.jsonl: short documents and one far longer than a block of 32 tokens;
- bomb.png: a PNG whose header says 30000x30000 (RGB, 8 bits) over a few
  rows of data: a decompression bomb, which Pillow refuses at its
  178,956,970-pixel guard before decoding;
- lists.parquet: a `text` column and a `question` column of string lists
  (`datasets`' `to_parquet` of a list feature), whose leaf pyarrow names
  `question.list.element`;
- cases.json: for long.jsonl, each document's token count as `transformers`'
  tokenizer gives it plus the EOS Kiln appends, and the number of blocks of
  32 that `group_texts` (the documents joined, the stream cut into blocks, the
  tail dropped) makes of them.
"""

import json
import os
import random
import struct
import sys
import zlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

BLOCK = 32
WORDS = ["the", "fox", "sleeps", "by", "river", "owl", "sings", "on", "hill", "a", "quiet", "barn"]


def documents():
    rng = random.Random(7)
    short = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(6)]
    long = " ".join(rng.choice(WORDS) for _ in range(400))
    return short[:3] + [long] + short[3:]


def make_tokenizer(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def save_tokenizer(path, tok):
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


def chunk(kind, data):
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def bomb_png(side):
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * (1 + 3 * side) * 4, 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows)
            + chunk(b"IEND", b""))


def make(out):
    os.makedirs(out, exist_ok=True)
    docs = documents()
    tok = make_tokenizer(docs)
    vocab = tok.get_vocab_size()

    llama = os.path.join(out, "llama")
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(llama)
    fast = save_tokenizer(llama, tok)

    gpt2 = os.path.join(out, "gpt2")
    config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    save_tokenizer(gpt2, tok)

    with open(os.path.join(out, "bomb.png"), "wb") as f:
        f.write(bomb_png(30000))
    from PIL import Image
    try:
        Image.open(os.path.join(out, "bomb.png")).load()
        raise AssertionError("Pillow decoded the bomb")
    except Image.DecompressionBombError:
        pass

    with open(os.path.join(out, "long.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.table({"text": docs[:3], "question": [[d, d] for d in docs[:3]]})
    pq.write_table(table, os.path.join(out, "lists.parquet"))
    # group_texts over the tokenized documents, each with EOS appended.
    lengths = [len(fast(d)["input_ids"]) + 1 for d in docs]
    cases = {"block": BLOCK, "lengths": lengths, "blocks": sum(lengths) // BLOCK,
             "longest": max(lengths)}
    assert cases["longest"] > 4 * BLOCK, cases
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f)


if __name__ == "__main__":
    make(sys.argv[2])
