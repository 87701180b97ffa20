"""AdamW's three implementations on the CPU, side by side: the default per-tensor loop,
foreach and fused, each stepping the same small GPT in turn (the text defaults' width 128 and
2 blocks, a batch of 8 x 64 bytes, one thread): the median time of the optimizer's step and
of the whole step (forward, backward, step) over 35 steps after 5.

    python benchmarks/adamw_cpu.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: E402

KINDS = dict(default={}, foreach=dict(foreach=True), fused=dict(fused=True))


def main(steps=40, warmup=5):
    torch.set_num_threads(1)
    models.seed_everything(0)
    gpt = models.GPT(256, 64, 128, depth=2, heads=2)
    x = torch.randint(0, 256, (8, 64))
    # Groups of their own for each (AdamW writes its settings into the group dicts it gets).
    optimizers = {
        k: torch.optim.AdamW(models.param_groups(gpt, 0.05), 1e-3, **kw) for k, kw in KINDS.items()
    }
    step_times, whole_times = ({k: [] for k in KINDS} for _ in range(2))
    for i in range(steps):
        for kind, optimizer in optimizers.items():  # in turn: the same load on each
            t0 = time.perf_counter()
            F.cross_entropy(gpt(x).flatten(0, 1), x.flatten()).backward()
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            if i >= warmup:
                step_times[kind].append(time.perf_counter() - t1)
                whole_times[kind].append(time.perf_counter() - t0)
    base = {k: statistics.median(v) for k, v in step_times.items()}
    whole = {k: statistics.median(v) for k, v in whole_times.items()}
    print(f"GPT of {sum(p.numel() for p in gpt.parameters()) / 1e6:.2f} M parameters")
    for kind in KINDS:
        print(
            f"{kind:8s} step {base[kind] * 1e3:.2f} ms ({base[kind] / base['foreach']:.2f} x "
            f"foreach's)  whole step {whole[kind] * 1e3:.1f} ms "
            f"({whole[kind] / whole['foreach']:.2f} x)"
        )


if __name__ == "__main__":
    main()
