"""Python PyTorch baselines of the non-training workloads of Kiln's benchmark harness.

Usage:
    python bench_tasks.py --task data|images|resize|script|ops|checkpoint|serve --variant V --dir DIR
        [--warmup W] [--repeats R] [--threads T] [--device cpu|cuda[:N]]

Each task mirrors a Kiln worker in ``benches/compare/tasks.rs`` (same sizes, same
protocol: W untimed runs, then the median of R timed runs; script and ops run on
``--device``, and a run on a GPU ends with ``torch.cuda.synchronize()``) and
prints one JSON line on stdout:

- data, ``pytorch-dataloader``: the IDX images of DIR as a map-style Dataset whose
  ``__getitem__`` scales a uint8 image to [0, 1] and normalises it (mean 0.1307,
  std 0.3081), in ``DataLoader(batch_size=256, shuffle=True, num_workers=2)``;
  one run is one epoch.
- images, ``pytorch-folder-S`` (S = 64, 224, 224-png or 224-webp; the crop size is the
  number): ``torchvision.datasets.ImageFolder`` on
  DIR/images-S/train (PIL decoding, RGB) with ``transforms.v2.Compose([ToImage(),
  RandomResizedCrop(S, antialias=True), RandomHorizontalFlip(), ToDtype(float32,
  scale=True), Normalize(ImageNet mean, std)])`` in ``DataLoader(batch_size=64,
  shuffle=True, num_workers=2)``; one run is one epoch. Its memory is the peak, sampled
  every 20 ms, of the summed proportional set size (PSS, which splits the pages forked
  workers share) of this process and its workers, and that sum before the loader is made.
  ``encode-png`` and ``encode-webp`` write DIR/images-224-png/train and
  DIR/images-224-webp/train: every image of DIR/images-224/train re-encoded with Pillow, as
  PNG (lossless, default compression) or as lossy WebP at quality 90, same class and key.
- resize, ``torchvision-resize``: ``v2.functional.resize(img, [256], antialias=True)`` on
  the uint8 [3, 375, 500] tensor of DIR/input.u8 (raw bytes), on one thread
  (``torch.set_num_threads(1)``), 200 calls per run; the result carries the largest
  difference from DIR/expected.u8. ``prepare`` writes DIR/expected.u8, that resize's
  output, which Kiln's variant is compared with (``benches/compare/resize.rs``).
- script, ``export``: scripts the CNN of workload (b) in eval mode and saves it to
  DIR/cnn.pt for both sides. ``pytorch-script`` runs that file with
  ``torch.jit.load``, ``pytorch-eager`` the ``nn.Module``, both at batch 1 under
  ``torch.no_grad()``, 2000 calls per run.
- ops, ``pytorch-fused``: Kiln's ops through ``torch.ops.load_library`` (the
  library's path is ``KILN_FUSED_OPS_LIBRARY``), and PyTorch's own ``F.rms_norm``;
  ``pytorch-composed``: the same maths in built-in ops. Forward and backward, 50 calls per run.
- checkpoint, ``pytorch-save``: ten 3162x3162 linear layers (100M parameters);
  save is ``torch.save(state_dict)`` into a file that is then fsynced, load is
  ``torch.load`` + ``load_state_dict``.
- serve, ``pytorch-eager``: each model of DIR (``NAME.json``, Kiln's definition,
  rebuilt as an ``nn.Module`` by ``platform-core/tests/reference/model_specs.py``,
  with Kiln's weights ``NAME.safetensors``) under ``torch.no_grad()`` in eval
  mode; ``python-onnxruntime``: the ONNX file Kiln exported (``NAME.onnx``) in an
  ``onnxruntime.InferenceSession`` on the CPU provider with ``--threads``
  intra-op threads. Latency at batch 1 and samples/s at batch 64 on the inputs
  of ``NAME-inputs.safetensors`` (calls per run as in ``serve.rs``).
"""

import argparse
import json
import os
import statistics
import struct
import sys
import time

import common

RESULT_STREAM = common.reserve_stdout()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import bench_torch  # noqa: E402  (the workloads' model definitions)

SCRIPT_CALLS = 2000
# Workload (i): per model, calls per timed run at batch 1 and at batch 64 (serve.rs).
SERVE_MODELS = {"cnn": (500, 40), "transformer": (50, 4)}
SERVE_BATCH = 64
OPS_CALLS = 50
OPS_ROWS, OPS_FEATURES, OPS_CLASSES, OPS_SMOOTHING = 512, 1024, 1000, 0.1
OPS_RMS_EPS = 1e-6
CKPT_LAYERS, CKPT_WIDTH = 10, 3162


def timed(args, f):
    for _ in range(args.warmup):
        f()
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        f()
        seconds.append(time.perf_counter() - start)
    return seconds


def read_idx(path):
    with open(path, "rb") as fh:
        data = fh.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise SystemExit(f"{path} is not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


class IdxImages(torch.utils.data.Dataset):
    def __init__(self, images, labels):
        self.images = torch.from_numpy(images.copy())
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i].unsqueeze(0).float().div_(255.0).sub_(0.1307).div_(0.3081)
        return x, self.labels[i]


def data(args):
    images = read_idx(os.path.join(args.dir, "train-images-idx3-ubyte"))
    labels = read_idx(os.path.join(args.dir, "train-labels-idx1-ubyte"))
    dataset = IdxImages(images, labels)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=256, shuffle=True, num_workers=2,
        generator=torch.Generator().manual_seed(0),
    )
    n = len(dataset)

    def epoch():
        seen = 0
        for x, _ in loader:
            seen += x.shape[0]
        if seen != n:
            raise SystemExit(f"an epoch gave {seen} samples, not {n}")

    seconds = timed(args, epoch)
    m = statistics.median(seconds)
    return {"repeats_s": seconds, "median_s": m, "samples_per_s": n / m}


IMAGE_MEAN, IMAGE_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def tree_pss_mb():
    """Summed PSS (MiB) of this process and its descendants, from /proc."""
    total_kb, stack = 0, [os.getpid()]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Pss:"):
                        total_kb += int(line.split()[1])
                        break
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                stack.extend(int(c) for c in fh.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total_kb / 1024


def encode_images(args, fmt):
    from PIL import Image

    source = os.path.join(args.dir, "images-224", "train")
    final = os.path.join(args.dir, f"images-224-{fmt}")
    out = final + ".partial"
    if os.path.exists(out):
        import shutil

        shutil.rmtree(out)
    count, total = 0, 0
    for cls in sorted(os.listdir(source)):
        os.makedirs(os.path.join(out, "train", cls))
        for name in sorted(os.listdir(os.path.join(source, cls))):
            key = os.path.splitext(name)[0]
            path = os.path.join(out, "train", cls, f"{key}.{fmt}")
            with Image.open(os.path.join(source, cls, name)) as image:
                image.load()
                if fmt == "png":
                    image.save(path, "PNG")
                else:
                    image.save(path, "WEBP", quality=90)
            count += 1
            total += os.path.getsize(path)
    os.rename(out, final)
    return {"images": count, "bytes": total, "format": fmt}


RESIZE_SOURCE, RESIZE_SHORTER, RESIZE_CALLS = (3, 375, 500), 256, 200


def resize(args, variant):
    import torchvision
    from torchvision.transforms.v2 import functional as TF

    torch.set_num_threads(1)
    pixels = np.fromfile(os.path.join(args.dir, "input.u8"), dtype=np.uint8)
    img = torch.from_numpy(pixels.reshape(RESIZE_SOURCE))
    out = TF.resize(img, [RESIZE_SHORTER], antialias=True)
    expected_path = os.path.join(args.dir, "expected.u8")
    if variant == "prepare":
        out.contiguous().numpy().tofile(expected_path)
        return {"output_shape": list(out.shape)}
    expected = torch.from_numpy(np.fromfile(expected_path, dtype=np.uint8))
    if expected.numel() != out.numel():
        raise SystemExit(f"{out.numel()} values against expected.u8's {expected.numel()}")

    def run():
        for _ in range(RESIZE_CALLS):
            TF.resize(img, [RESIZE_SHORTER], antialias=True)

    seconds = timed(args, run)
    out = TF.resize(img, [RESIZE_SHORTER], antialias=True)
    diff = (out.reshape(-1).int() - expected.int()).abs().max().item()
    m = statistics.median(seconds)
    return {"repeats_s": seconds, "median_s": m, "calls": RESIZE_CALLS,
            "images_per_s": RESIZE_CALLS / m, "us_per_image": m / RESIZE_CALLS * 1e6,
            "max_abs_diff": diff, "input_shape": list(RESIZE_SOURCE),
            "output_shape": list(out.shape), "torch_threads": torch.get_num_threads(),
            "torchvision_version": torchvision.__version__}


def images(args, image_set):
    import threading

    import torchvision
    from torchvision.transforms import v2

    size = int(image_set.split("-")[0])
    transform = v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(size, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGE_MEAN, IMAGE_STD),
    ])
    start = tree_pss_mb()
    root = os.path.join(args.dir, f"images-{image_set}", "train")
    dataset = torchvision.datasets.ImageFolder(root, transform=transform)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=64, shuffle=True, num_workers=2,
        generator=torch.Generator().manual_seed(0),
    )
    n = len(dataset)
    peak = [0.0]
    done = threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], tree_pss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def epoch():
        seen = 0
        for x, _ in loader:
            if x.shape[1:] != (3, size, size):
                raise SystemExit(f"a batch of shape {tuple(x.shape)}")
            seen += x.shape[0]
        if seen != n:
            raise SystemExit(f"an epoch gave {seen} samples, not {n}")

    seconds = timed(args, epoch)
    done.set()
    sampler.join()
    m = statistics.median(seconds)
    return {"repeats_s": seconds, "median_s": m, "samples_per_s": n / m, "images": n,
            "peak_memory_mb": peak[0], "start_memory_mb": start}


def export(args):
    torch.manual_seed(0)
    model = bench_torch.build_model("cnn", 10).eval()
    torch.jit.script(model).save(os.path.join(args.dir, "cnn.pt"))
    return {"saved": os.path.join(args.dir, "cnn.pt")}


def synchronize(device):
    """Wait for the GPU's queued work, so that a timed run ends when its work does."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def script(args, scripted):
    device = torch.device(args.device)
    if scripted:
        model = torch.jit.load(os.path.join(args.dir, "cnn.pt"), map_location=device)
    else:
        torch.manual_seed(0)
        model = bench_torch.build_model("cnn", 10).to(device)
    model.eval()
    x = torch.randn(1, 1, 28, 28, device=device)

    def run():
        for _ in range(SCRIPT_CALLS):
            y = model(x)
        synchronize(device)
        if tuple(y.shape) != (1, 10):
            raise SystemExit(f"the model returned {tuple(y.shape)}")

    with torch.no_grad():
        seconds = timed(args, run)
    m = statistics.median(seconds)
    return {"repeats_s": seconds, "median_s": m, "latency_us": m / SCRIPT_CALLS * 1e6}


def ops(args, fused):
    if fused:
        torch.ops.load_library(os.environ["KILN_FUSED_OPS_LIBRARY"])
        kiln = torch.ops.kiln
        calls = {
            "bias_gelu": lambda: kiln.bias_gelu(x, bias),
            "softmax_xent": lambda: kiln.softmax_xent(logits, target, OPS_SMOOTHING),
            "swish": lambda: kiln.swish(x, beta),
            # No C++ kernel of Kiln's: PyTorch's own single op.
            "rms_norm": lambda: F.rms_norm(x, (OPS_FEATURES,), weight, OPS_RMS_EPS),
        }
    else:
        calls = {
            "bias_gelu": lambda: F.gelu(x + bias),
            "softmax_xent": lambda: F.cross_entropy(
                logits, target, reduction="none", label_smoothing=OPS_SMOOTHING
            ),
            "swish": lambda: x * torch.sigmoid(beta * x),
            "squared_relu": lambda: torch.relu(x).square(),
            "rms_norm": lambda: x * torch.rsqrt(x.square().mean(-1, keepdim=True) + OPS_RMS_EPS) * weight,
        }
    device = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(OPS_ROWS, OPS_FEATURES, device=device, requires_grad=True)
    bias = torch.randn(OPS_FEATURES, device=device, requires_grad=True)
    weight = torch.randn(OPS_FEATURES, device=device, requires_grad=True)
    beta = torch.ones(1, device=device, requires_grad=True)
    logits = torch.randn(OPS_ROWS, OPS_CLASSES, device=device, requires_grad=True)
    target = torch.randint(OPS_CLASSES, (OPS_ROWS,), device=device)
    out = {}
    for name, call in calls.items():
        def run():
            for _ in range(OPS_CALLS):
                call().sum().backward()
            synchronize(device)

        out[name] = statistics.median(timed(args, run)) / OPS_CALLS * 1e6
    return {"ops_us": out}


def checkpoint(args):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(CKPT_WIDTH, CKPT_WIDTH) for _ in range(CKPT_LAYERS)])
    params = sum(p.numel() for p in model.parameters())
    path = os.path.join(args.dir, "pytorch.pt")

    def save():
        with open(path, "wb") as fh:
            torch.save(model.state_dict(), fh)
            fh.flush()
            os.fsync(fh.fileno())

    def load():
        model.load_state_dict(torch.load(path))

    save_s = timed(args, save)
    file_bytes = os.path.getsize(path)
    load_s = timed(args, load)
    os.remove(path)
    return {
        "parameters": params,
        "bytes": params * 4,
        "file_bytes": file_bytes,
        "save_repeats_s": save_s,
        "load_repeats_s": load_s,
        "save_s": statistics.median(save_s),
        "load_s": statistics.median(load_s),
    }


def serve(args, variant):
    from safetensors.numpy import load_file

    out = {}
    for name, (calls_1, calls_64) in SERVE_MODELS.items():
        inputs = load_file(os.path.join(args.dir, f"{name}-inputs.safetensors"))
        if variant == "pytorch-eager":
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                            "platform-core", "tests", "reference"))
            import model_specs

            with open(os.path.join(args.dir, f"{name}.json")) as f:
                model = model_specs.build(json.load(f))
            state = load_file(os.path.join(args.dir, f"{name}.safetensors"))
            model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
            model.eval()
            xs = {b: torch.from_numpy(inputs[f"x{b}"]) for b in (1, SERVE_BATCH)}

            def call(batch):
                with torch.no_grad():
                    return float(model(xs[batch]).sum())
        else:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = args.threads
            options.inter_op_num_threads = 1
            session = ort.InferenceSession(
                os.path.join(args.dir, f"{name}.onnx"), options, providers=["CPUExecutionProvider"])
            input_name = session.get_inputs()[0].name
            xs = {b: inputs[f"x{b}"] for b in (1, SERVE_BATCH)}

            def call(batch):
                return float(session.run(None, {input_name: xs[batch]})[0].sum())

        def run(batch, calls):
            def f():
                for _ in range(calls):
                    f.checksum = call(batch)
            return f

        at_1 = run(1, calls_1)
        at_64 = run(SERVE_BATCH, calls_64)
        t1 = statistics.median(timed(args, at_1)) / calls_1
        t64 = statistics.median(timed(args, at_64)) / calls_64
        out[name] = {
            "latency_us": t1 * 1e6,
            "samples_per_s": SERVE_BATCH / t64,
            "checksum": at_64.checksum,
        }
    return out


LLM_BATCH, LLM_SEQ, LLM_NEW = 2, 256, 128


def llm_config(task):
    """(k)'s LLaMA, (k, MoE)'s Qwen3-MoE shape (Qwen3-30B-A3B's routing, smaller), or Qwen3-0.6B's
    config.json (random weights)."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    if task == "qwen3":
        return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                           max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)

    if task == "moe":
        return Qwen3MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32,
                              num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
                              max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0)
    return LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                       max_position_embeddings=1024, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def llm(args, variant):
    """(k): the LLaMA-style model of benches/compare/llm.rs, in transformers; (k, MoE) with
    `--task moe`."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model_dir = os.path.join(args.dir, "model")
    if variant == "prepare":
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(llm_config(args.task)).save_pretrained(model_dir)
            g = torch.Generator().manual_seed(1)
            vocab = llm_config(args.task).vocab_size
            seq = 512 if args.task == "qwen3" else LLM_SEQ
            save_file({"train": torch.randint(3, vocab, (LLM_BATCH, seq + 1), generator=g),
                       "prompts": torch.randint(3, vocab, (8, 16), generator=g)},
                      os.path.join(args.dir, "tokens.safetensors"))
        return {}
    tokens = load_file(os.path.join(args.dir, "tokens.safetensors"))
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    if variant == "transformers-generate":
        model.eval()
        out = {}
        for batch in (1, 8):
            prompts = tokens["prompts"][:batch].to(device)
            result = {}

            def run():
                with torch.no_grad():
                    result["ids"] = model.generate(
                        input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                        max_new_tokens=LLM_NEW, min_new_tokens=LLM_NEW, pad_token_id=0)
                synchronize(device)

            times = timed(argparse.Namespace(warmup=min(args.warmup, 1), repeats=min(args.repeats, 3)), run)
            m = statistics.median(times)
            out[f"b{batch}"] = {"repeats_s": times, "tokens_per_s": batch * LLM_NEW / m,
                                "first_row": result["ids"][0, prompts.shape[1]:].tolist()}
        return out
    if variant.endswith("bf16"):
        model = model.to(torch.bfloat16)
    return train_steps(args, model, tokens, device)


def train_steps(args, model, tokens, device):
    """AdamW steps (lr 1e-4) of `model`'s trainable parameters on (k)'s tokens, timed."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = tokens["train"].to(device)
    x, y = ids[:, :-1], ids[:, 1:].reshape(-1)
    losses = []

    def step():
        opt.zero_grad()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y)
        loss.backward()
        opt.step()
        synchronize(device)
        losses.append(float(loss))

    times = timed(argparse.Namespace(warmup=min(args.warmup, 1), repeats=min(args.repeats, 3)), step)
    m = statistics.median(times)
    return {"repeats_s": times, "steps_per_s": 1.0 / m, "tokens_per_s": x.numel() / m,
            "batch": x.shape[0], "seq": x.shape[1], "losses": losses,
            "trainable": sum(p.numel() for p in params)}


FT_BLOCK, FT_TEXT_BATCH = 256, 8
FT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def finetune(args, variant):
    """(l): LoRA and full fine-tuning of (k)'s model (transformers, PEFT), and text to batches
    with datasets.map and a PyTorch DataLoader."""
    from safetensors.torch import load_file

    if variant == "prepare":
        llm(args, "prepare")
        text_dir = os.path.join(args.dir, "text")
        if not os.path.exists(os.path.join(text_dir, "tokenizer.json")):
            import random

            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
            from transformers import PreTrainedTokenizerFast

            os.makedirs(text_dir, exist_ok=True)
            rng = random.Random(0)
            words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                     for _ in range(3000)] + ["café", "naïve", "東京", "🦊"]
            lines = []
            for _ in range(20000):
                n = rng.randint(10, 120)
                lines.append(" ".join(rng.choice(words) for _ in range(n)).capitalize() + ".")
            with open(os.path.join(text_dir, "corpus.jsonl"), "w", encoding="utf-8") as f:
                for line in lines:
                    f.write(json.dumps({"text": line}, ensure_ascii=False) + "\n")
            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            tok.train_from_iterator(lines[:4000], trainers.BpeTrainer(
                vocab_size=8000, special_tokens=["<pad>", "<s>", "</s>"],
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
            PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                    pad_token="<pad>").save_pretrained(text_dir)
        return {}
    if variant == "python-text":
        import datasets
        from itertools import chain
        from transformers import AutoTokenizer

        datasets.disable_caching()
        datasets.disable_progress_bars()
        text_dir = os.path.join(args.dir, "text")
        tok = AutoTokenizer.from_pretrained(text_dir)
        eos = tok.eos_token_id
        counts = {}

        def run():
            ds = datasets.load_dataset("json", data_files=os.path.join(text_dir, "corpus.jsonl"),
                                       split="train", cache_dir=os.path.join(args.dir, "hf-cache"))
            ds = ds.map(lambda b: {"input_ids": [ids + [eos] for ids in tok(b["text"])["input_ids"]]},
                        batched=True, remove_columns=["text"])

            def group(b):
                joined = list(chain(*b["input_ids"]))
                total = len(joined) // FT_BLOCK * FT_BLOCK
                blocks = [joined[i:i + FT_BLOCK] for i in range(0, total, FT_BLOCK)]
                return {"input_ids": blocks, "labels": [list(x) for x in blocks]}

            ds = ds.map(group, batched=True, batch_size=len(ds)).with_format("torch")
            loader = torch.utils.data.DataLoader(ds, batch_size=FT_TEXT_BATCH, shuffle=True,
                                                 num_workers=2,
                                                 generator=torch.Generator().manual_seed(0))
            counts["tokens"], counts["batches"] = 0, 0
            for batch in loader:
                counts["tokens"] += batch["input_ids"].numel()
                counts["batches"] += 1

        times = timed(argparse.Namespace(warmup=0, repeats=min(args.repeats, 3)), run)
        m = statistics.median(times)
        return {"repeats_s": times, "tokens_per_s": counts["tokens"] / m, **counts}

    from transformers import LlamaForCausalLM

    tokens = load_file(os.path.join(args.dir, "tokens.safetensors"))
    device = torch.device(args.device)
    model = LlamaForCausalLM.from_pretrained(os.path.join(args.dir, "model"),
                                             dtype=torch.float32).to(device)
    if variant == "peft-lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=FT_TARGETS, task_type="CAUSAL_LM"))
    return train_steps(args, model, tokens, device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=["data", "images", "resize", "script", "ops", "checkpoint", "serve", "llm", "moe",
                                                               "qwen3", "finetune"])
    parser.add_argument("--variant", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (script and ops)")
    args = parser.parse_args()
    bench_torch.set_threads(args.threads)
    runs = {
        ("data", "pytorch-dataloader"): lambda: data(args),
        ("images", "pytorch-folder-64"): lambda: images(args, "64"),
        ("images", "pytorch-folder-224"): lambda: images(args, "224"),
        ("images", "pytorch-folder-224-png"): lambda: images(args, "224-png"),
        ("images", "pytorch-folder-224-webp"): lambda: images(args, "224-webp"),
        ("images", "encode-png"): lambda: encode_images(args, "png"),
        ("images", "encode-webp"): lambda: encode_images(args, "webp"),
        ("resize", "prepare"): lambda: resize(args, "prepare"),
        ("resize", "torchvision-resize"): lambda: resize(args, "torchvision-resize"),
        ("script", "export"): lambda: export(args),
        ("script", "pytorch-script"): lambda: script(args, True),
        ("script", "pytorch-eager"): lambda: script(args, False),
        ("ops", "pytorch-fused"): lambda: ops(args, True),
        ("ops", "pytorch-composed"): lambda: ops(args, False),
        ("checkpoint", "pytorch-save"): lambda: checkpoint(args),
        ("serve", "pytorch-eager"): lambda: serve(args, "pytorch-eager"),
        ("serve", "python-onnxruntime"): lambda: serve(args, "python-onnxruntime"),
        ("llm", "prepare"): lambda: llm(args, "prepare"),
        ("llm", "pytorch-train-f32"): lambda: llm(args, "pytorch-train-f32"),
        ("llm", "pytorch-train-bf16"): lambda: llm(args, "pytorch-train-bf16"),
        ("llm", "transformers-generate"): lambda: llm(args, "transformers-generate"),
        ("moe", "prepare"): lambda: llm(args, "prepare"),
        ("qwen3", "prepare"): lambda: llm(args, "prepare"),
        ("qwen3", "pytorch-train-f32"): lambda: llm(args, "pytorch-train-f32"),
        ("qwen3", "pytorch-train-bf16"): lambda: llm(args, "pytorch-train-bf16"),
        ("qwen3", "transformers-generate"): lambda: llm(args, "transformers-generate"),
        ("moe", "pytorch-train-f32"): lambda: llm(args, "pytorch-train-f32"),
        ("moe", "pytorch-train-bf16"): lambda: llm(args, "pytorch-train-bf16"),
        ("moe", "transformers-generate"): lambda: llm(args, "transformers-generate"),
        ("finetune", "prepare"): lambda: finetune(args, "prepare"),
        ("finetune", "pytorch-full"): lambda: finetune(args, "pytorch-full"),
        ("finetune", "peft-lora"): lambda: finetune(args, "peft-lora"),
        ("finetune", "python-text"): lambda: finetune(args, "python-text"),
    }
    run = runs.get((args.task, args.variant))
    if run is None:
        raise SystemExit(f"no variant {args.variant!r} for task {args.task!r}")
    result = run()
    result.update(
        variant=args.variant, task=args.task, threads=args.threads, device=args.device,
        peak_rss_mb=common.peak_rss_mb(), versions={"torch": torch.__version__},
    )
    RESULT_STREAM.write(json.dumps(result) + "\n")
    RESULT_STREAM.flush()


if __name__ == "__main__":
    sys.exit(main())
