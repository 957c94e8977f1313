"""PyTorch eager-mode baseline ("pytorch-eager") for Kiln's benchmark harness, and
its CUDA-graph form ("pytorch-graph").

Usage:
    python bench_torch.py --workload mlp|cnn|transformer|transformer-bf16|transformer-bf16-mixed --data DIR
        --steps N --warmup W --repeats R --threads T [--device cpu|cuda[:N]]
        [--variant pytorch-eager|pytorch-graph]

Trains the workload's model on the device (CPU by default) with the classic eager loop
(``zero_grad(set_to_none=True)``, ``F.cross_entropy``, ``backward``,
``torch.optim.Adam(lr=1e-3)`` with its default foreach behaviour), following
the protocol described in ``common.py``: all batches become tensors before
timing, W warm-up steps, then R timed repeats of N steps, each ending with
``loss.item()`` so that the work is finished when the clock stops. Prints one
JSON line on stdout.

``pytorch-graph`` (CUDA only) is PyTorch's whole-network capture as its CUDA-graphs
documentation writes it, with its fastest graph-safe Adam:
``Adam(capturable=True, fused=True)`` (the multi-tensor kernel Kiln's captured step
also runs), three warm-up steps on a side stream, one step captured with
``torch.cuda.graph``, then per step a copy of the batch into the static inputs and
``graph.replay()``.

``transformer-bf16`` is the transformer at width 1024 (seq 256, 16 heads, ff 4096)
with the model and inputs in bfloat16 (``model.to(torch.bfloat16)``); its result
also names the device and the best rate of a bfloat16 square matrix product
measured in the same process (``matmul_tflops``), the peaks its model FLOPs
utilisation is reported against. ``transformer-bf16-mixed`` is the same model in
float32 with the forward pass under ``torch.autocast(device, dtype=torch.bfloat16)``
and its output cast back to float32 before the loss (what Kiln's ``bf16-mixed`` does);
eager only.
"""

import time

import common

RESULT_STREAM = common.reserve_stdout()

import torch  # noqa: E402  (imported after stdout is reserved)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

VARIANTS = ["pytorch-eager", "pytorch-graph"]


class EncoderClassifier(nn.Module):
    """Pre-norm transformer encoder block followed by a linear classifier."""

    def __init__(self, seq=128, width=256, heads=8, hidden=1024, classes=10):
        super().__init__()
        self.ln1 = nn.LayerNorm(width, eps=1e-5)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width, eps=1e-5)
        self.ff = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.head = nn.Linear(seq * width, classes)

    def forward(self, x):
        a = self.ln1(x)
        h = x + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.ff(self.ln2(h))
        return self.head(h.flatten(1))


def build_model(workload, classes):
    """The workload's model; call after seeding."""
    if workload in ("transformer-bf16", "transformer-bf16-mixed"):
        return EncoderClassifier(seq=256, width=1024, heads=16, hidden=4096, classes=classes)
    if workload == "mlp":
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, classes))
    if workload == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
            nn.Linear(128, classes),
        )
    return EncoderClassifier(classes=classes)


def matmul_tflops(device):
    """The best rate of a bfloat16 square matrix product here, in TFLOP/s."""
    n, calls, tries = (8192, 10, 10) if device.type == "cuda" else (4096, 1, 3)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b
    sync()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(calls):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * n**3 / best / 1e12


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def set_threads(threads):
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError as err:  # only allowed once, before any parallel work
        print(f"warning: could not set inter-op threads: {err}", flush=True)


def main():
    args = common.parse_args(__doc__.splitlines()[0], VARIANTS, default_variant="pytorch-eager")
    set_threads(args.threads)
    meta, x_np, y_np = common.load_data(args.data, args.workload)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.workload == "transformer-bf16" else torch.float32
    # One tensor per batch, on the device, built once so the timed loop does no conversion.
    xs = [torch.from_numpy(b.copy()).to(device=device, dtype=dtype) for b in x_np]
    ys = [torch.from_numpy(b.copy()).to(device) for b in y_np]

    torch.manual_seed(0)
    model = build_model(args.workload, meta["classes"]).to(device=device, dtype=dtype)
    model.train()
    graphed = args.variant == "pytorch-graph"
    if graphed and device.type != "cuda":
        raise SystemExit("pytorch-graph needs --device cuda")
    mixed = args.workload == "transformer-bf16-mixed"
    if graphed and mixed:
        raise SystemExit("transformer-bf16-mixed has no pytorch-graph variant")

    def forward(x):
        if mixed:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(x)
            return out.float()
        return model(x)
    opt = torch.optim.Adam(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        capturable=graphed,
        fused=graphed or None,
    )

    counter = common.StepCounter()

    def run_steps(n):
        for i in counter.take(n):
            j = i % len(xs)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(forward(xs[j]), ys[j])
            loss.backward()
            opt.step()
        return loss.item()

    if graphed:
        static_x, static_y = xs[0].clone(), ys[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(static_x), static_y).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = F.cross_entropy(model(static_x), static_y)
            static_loss.backward()
            opt.step()

        def run_steps(n):  # noqa: F811  (the graphed loop replaces the eager one)
            for i in counter.take(n):
                j = i % len(xs)
                static_x.copy_(xs[j])
                static_y.copy_(ys[j])
                graph.replay()
            return static_loss.item()

    seconds, final_loss = common.run_protocol(run_steps, args.steps, args.warmup, args.repeats)
    extra = None
    if dtype == torch.bfloat16 or mixed:
        extra = {"device_name": device_name(device), "matmul_tflops": matmul_tflops(device)}
    common.emit_result(
        RESULT_STREAM,
        variant=args.variant,
        args=args,
        batch=meta["batch"],
        seconds=seconds,
        final_loss=final_loss,
        versions={"torch": torch.__version__},
        extra=extra,
    )


if __name__ == "__main__":
    main()
