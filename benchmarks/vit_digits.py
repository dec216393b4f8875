"""Train the `vit-digits` preset on scikit-learn's 8 x 8 digits (80/20 split) and report
test accuracy and wall time. Target: >= 97% in under 3 minutes on a 2-core CPU.

    python benchmarks/vit_digits.py [--steps 1500] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import torch

from attnlab.data.images import accuracy, classification_step, digits, image_batches
from attnlab.models import build_model
from attnlab.models.vit import vit_digits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = digits(seed=args.seed)
    model = build_model(vit_digits())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
    )
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
        ),
    )
    batches = image_batches(data.train_x, data.train_y, args.batch, seed=args.seed)
    start = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        loss = classification_step(model, next(batches)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == args.steps:
            acc = accuracy(model, data.test_x, data.test_y)
            print(
                f"step {step:5d}  loss {loss.item():.4f}  test acc {acc:.4f}  "
                f"{time.perf_counter() - start:.1f} s",
                flush=True,
            )
    seconds = time.perf_counter() - start
    acc = accuracy(model, data.test_x, data.test_y)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} threads")
    print("| preset | params | steps | test images | test accuracy | train time |")
    print(
        f"| vit-digits | {model.num_parameters()} | {args.steps} | {len(data.test_y)} "
        f"| {acc:.4f} | {seconds:.1f} s |"
    )


if __name__ == "__main__":
    main()
