"""Reference for tests/trainer/preference.rs: SimPO (CPO-SimPO) trained in
PyTorch as TRL's CPOTrainer computes it with loss_type="simpo", and as Kiln's
Trainer trains the `Simpo` objective.

Usage: simpo.py DIR BETA GAMMA CPO_ALPHA LABEL_SMOOTHING EPOCHS BATCH ACCUMULATE

DIR holds model.safetensors (the initial state, Kiln's names: `0.weight` an
Embedding(V, D), `1.weight`/`1.bias` a Linear(D, V)), train.safetensors and
val.safetensors (`x`, `y` int64 [pairs, 2, length]: chosen then rejected; `y`
is -100 where a token does not train). Per micro-batch, TRL's
concatenated_forward and get_batch_logps(average_log_prob=True), cpo_loss
with "simpo", and cross_entropy_loss on the chosen half; the gradient divided
by ACCUMULATE and accumulated over ACCUMULATE micro-batches before each SGD
step (lr 0.5). Writes DIR/out.safetensors: `model.NAME` (the trained model)
and, for each epoch E, `E.NAME` for the loss and every metric (the epoch's
pair-weighted means) and `E.val_NAME` on the validation set after the epoch.
"""

import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

NAMES = ["loss", "rewards_chosen", "rewards_rejected", "rewards_accuracies", "rewards_margins",
         "logps_chosen", "logps_rejected", "nll_loss"]


def batch_logps(logits, labels):
    """TRL's get_batch_logps with average_log_prob=True."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    mask = labels != -100
    labels[labels == -100] = 0
    per_token = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token * mask).sum(-1) / mask.sum(-1)


def main():
    d, beta, gamma, cpo_alpha, smoothing, epochs, batch, accumulate = sys.argv[1:]
    beta, gamma, cpo_alpha, smoothing = float(beta), float(gamma), float(cpo_alpha), float(smoothing)
    epochs, batch, accumulate = int(epochs), int(batch), int(accumulate)
    state = load_file(f"{d}/model.safetensors")
    vocab, dim = state["0.weight"].shape
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab))
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def terms(x, y):
        pairs = x.shape[0]
        ids = torch.cat([x[:, 0], x[:, 1]], 0)
        labels = torch.cat([y[:, 0], y[:, 1]], 0)
        logits = model(ids)
        logps = batch_logps(logits, labels)
        chosen, rejected = logps[:pairs], logps[pairs:]
        z = beta * (chosen - rejected - gamma / beta)
        losses = -F.logsigmoid(z) * (1 - smoothing) - F.logsigmoid(-z) * smoothing
        # TRL's cross_entropy_loss on the chosen half: shifted, mean over trained tokens.
        nll = F.cross_entropy(logits[:pairs, :-1, :].reshape(-1, vocab), labels[:pairs, 1:].reshape(-1),
                              ignore_index=-100)
        loss = losses.mean() + cpo_alpha * nll
        rc, rr = beta * chosen.detach(), beta * rejected.detach()
        metrics = [rc.mean(), rr.mean(), (rc > rr).float().mean(), (rc - rr).mean(),
                   chosen.detach().mean(), rejected.detach().mean(), nll.detach()]
        return loss, metrics

    out = {}
    train, val = load_file(f"{d}/train.safetensors"), load_file(f"{d}/val.safetensors")
    x, y = train["x"], train["y"]
    for epoch in range(epochs):
        sums, rows = torch.zeros(len(NAMES), dtype=torch.float64), 0
        for i, start in enumerate(range(0, x.shape[0], batch)):
            xb, yb = x[start:start + batch], y[start:start + batch]
            if i % accumulate == 0:
                opt.zero_grad()
            loss, metrics = terms(xb, yb)
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0:
                opt.step()
            sums += torch.tensor([loss.item()] + [m.item() for m in metrics], dtype=torch.float64) * xb.shape[0]
            rows += xb.shape[0]
        for name, v in zip(NAMES, sums / rows):
            out[f"{epoch}.{name}"] = v.reshape(1)
        with torch.no_grad():
            sums, rows = torch.zeros(len(NAMES), dtype=torch.float64), 0
            vx, vy = val["x"], val["y"]
            for start in range(0, vx.shape[0], batch):
                xb, yb = vx[start:start + batch], vy[start:start + batch]
                loss, metrics = terms(xb, yb)
                sums += torch.tensor([loss.item()] + [m.item() for m in metrics], dtype=torch.float64) * xb.shape[0]
                rows += xb.shape[0]
        for name, v in zip(NAMES, sums / rows):
            out[f"{epoch}.val_{name}"] = v.reshape(1)
    for name, p in model.state_dict().items():
        out[f"model.{name}"] = p.detach().clone().contiguous()
    save_file(out, f"{d}/out.safetensors")


if __name__ == "__main__":
    main()
