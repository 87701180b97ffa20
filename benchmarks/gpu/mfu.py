"""The GPT at GPT-2-small size on one GPU: what each speed lever is worth, one at a time.

    python benchmarks/gpu/mfu.py                         # every configuration, one GPU
    python benchmarks/gpu/mfu.py --only baseline,fused-adamw,batch-64
    python benchmarks/gpu/mfu.py --cpu                   # a tiny GPT, 2 steps: a dry run

The baseline is what fsdp_train.py does at one process (`--data text --model gpt --amp bf16
--depth 12 --dim 768 --heads 12 --seq-len 1024 --batch-size 16`): autocast to bf16 over fp32
weights, PyTorch's default attention kernel, AdamW not fused, gradients clipped at 1, eager.
Each other row changes ONE thing from it: fused AdamW; the attention kernel (flash, efficient,
cudnn through torch.nn.attention.sdpa_kernel); bf16 parameters (FSDP2's
MixedPrecisionPolicy(param_dtype=bfloat16) over a process group of one) in place of autocast;
a batch of 32 or 64 sequences; torch.compile of each block, or of the whole model. The last
row, "best", takes every change that beat the baseline (the fastest of each kind) together.

The tokens are on the device before the clock starts (no loader, no copy). Each row: a few
untimed steps (compilation, cuDNN's and the allocator's warm-up), then --steps timed ones
between two CUDA events; tokens/s, TFLOP/s (profiling.step_flops's count, which equals
6 N + 12 L H Q T per token, nanoGPT's and torchtitan's: N the weights of the matrix products,
L blocks, H heads of Q dimensions, T tokens of context), MFU against the device's bf16 peak
(profiling.PEAK_TFLOPS: 989 on an H100 SXM or H200) and the peak memory allocated. A row that
runs out of memory, or whose kernel the device lacks, says so and the next one runs. The
loss of the first step (before any update) and of the last: every row of a batch size starts
from the same weights and tokens, so a kernel that computes wrongly stands out there. On the
CPU (--cpu) wall-clock time stands in for the events, and there is no peak to divide by.
Prints each row as it is measured, then the table; --json FILE holds the rows so far.
"""

import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import ArgumentParser  # noqa: E402
from models import GPT  # noqa: E402
from profiling import peak_flops, step_flops  # noqa: E402

GPT2_SMALL = dict(depth=12, dim=768, heads=12, seq_len=1024)
TINY = dict(depth=2, dim=32, heads=2, seq_len=32)  # the dry run's
BASELINE = dict(batch=16, fused=False, sdpa="default", params="autocast", compile="none")
# name: the one change from the baseline (batch as a multiple of --batch-size)
CHANGES = {
    "baseline": {},
    "fused-adamw": dict(fused=True),
    "sdpa-flash": dict(sdpa="flash"),
    "sdpa-efficient": dict(sdpa="efficient"),
    "sdpa-cudnn": dict(sdpa="cudnn"),
    "bf16-params": dict(params="bf16"),
    "batch-32": dict(batch=2),
    "batch-64": dict(batch=4),
    "compile-blocks": dict(compile="blocks"),
    "compile-model": dict(compile="model"),
}
BACKENDS = dict(flash="FLASH_ATTENTION", efficient="EFFICIENT_ATTENTION", cudnn="CUDNN_ATTENTION")


def flops_per_token(depth, dim, heads, seq_len, vocab=256):
    """nanoGPT's and torchtitan's count (PaLM's appendix B): 6 FLOPs per weight of a matrix
    product and token (2 forward, 4 backward), and attention's scores and mixing, 12 L H Q T
    (H Q = dim), which no weight counts. The embedding and the positions are looked up, not
    multiplied: not counted."""
    weights = depth * (4 * dim * dim + 2 * 4 * dim * dim) + dim * vocab  # q k v proj, mlp, head
    return 6 * weights + 12 * depth * dim * seq_len


def configure(name, base_batch):
    """The configuration of row `name`: the baseline with its one change."""
    config = dict(BASELINE, batch=base_batch, name=name)
    change = CHANGES[name]
    config.update(change)
    if "batch" in change:
        config["batch"] = base_batch * change["batch"]
    return config


def sdpa_context(backend):
    """sdpa_kernel with that one backend (no fallback: a row measures the kernel it names)."""
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, BACKENDS[backend])])


def bf16_parameters(model, device):
    """FSDP2 over a process group of one: the gathered weights (so the compute, the residual
    stream and the norms) in bf16, the fp32 weights kept for AdamW, gradients reduced in fp32;
    what fsdp_train.py --amp bf16 does at more than one process."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    policy = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def measure(config, shape, device, steps, warmup, peak):
    """One row: the model built and set up as `config` says, warmed up, then timed."""
    torch.manual_seed(0)
    batch, seq_len = config["batch"], shape["seq_len"]
    with torch.device("meta"):  # the count, on shapes only
        flops = step_flops(
            GPT(256, seq_len, shape["dim"], shape["depth"], shape["heads"]),
            torch.zeros(batch, seq_len, dtype=torch.long),
        )
    model = GPT(256, seq_len, shape["dim"], shape["depth"], shape["heads"]).to(device)
    if config["params"] == "bf16":
        model = bf16_parameters(model, device)
    if config["compile"] == "blocks":
        for block in model.blocks:
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), 1e-4, fused=config["fused"] or None)
    step_model = torch.compile(model) if config["compile"] == "model" else model
    tokens = torch.randint(0, 256, (batch, seq_len + 1), device=device)  # on the device
    x, y = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, torch.bfloat16, config["params"] == "autocast")

    def step():
        with autocast, sdpa_context(config["sdpa"]):
            logits = step_model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # fsdp_train.py's text default
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    cuda = device.type == "cuda"
    # The first step's loss, before any update: the same model and tokens in every row of a
    # batch size, so a kernel that computes wrongly shows here (and in the last loss).
    first_loss = step().item()
    for _ in range(warmup - 1):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000 / steps
    else:
        seconds = (time.perf_counter() - t0) / steps
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    row = dict(ms_per_step=1000 * seconds, tokens_per_second=batch * seq_len / seconds)
    row.update(first_loss=first_loss, last_loss=loss.item())
    row.update(tflops=flops / seconds / 1e12, flops_per_token=flops / (batch * seq_len))
    row["mfu"] = flops / seconds / peak if peak else None
    row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return row


def run_row(config, shape, device, steps, warmup, peak):
    """measure(), with an out-of-memory or a missing kernel said in the row's status."""
    error = None
    try:
        row = dict(status="ok", **measure(config, shape, device, steps, warmup, peak))
    except torch.OutOfMemoryError:
        error = "out of memory"
    except Exception as e:  # noqa: BLE001  (a kernel the device lacks, a compile error)
        error = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    if error:  # out of the except block: its traceback no longer holds the step's tensors
        row = dict(status=error)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # each compiled row compiles afresh
    return dict(config, **row)


def best_config(rows, base_batch):
    """The baseline with every change that beat it, the fastest of each kind (attention
    kernel, batch, compile), or None if none did."""
    ok = {r["name"]: r for r in rows if r["status"] == "ok"}
    if "baseline" not in ok:
        return None
    base = ok["baseline"]["tokens_per_second"]
    config, better = dict(BASELINE, batch=base_batch, name="best"), False
    for key in ("fused", "sdpa", "params", "batch", "compile"):
        faster = [r for r in ok.values() if key in changed(r) and r["tokens_per_second"] > base]
        if faster:
            config[key] = max(faster, key=lambda r: r["tokens_per_second"])[key]
            better = True
    return config if better else None


def changed(row):
    return set(CHANGES.get(row["name"], {}))


def table(rows):
    def cell(value, spec):
        return "" if value is None else format(value, spec)

    lines = ["| configuration | batch | tokens/s | TFLOP/s | MFU | peak GiB | loss | status |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = cell(r.get("mfu") and 100 * r["mfu"], ".1f") + "%" * bool(r.get("mfu"))
        cells = [cell(r.get("tokens_per_second"), ",.0f"), cell(r.get("tflops"), ".3g"), mfu]
        cells += [cell(r.get("peak_memory_gib"), ".1f")]
        loss = r.get("first_loss") is not None and f"{r['first_loss']:.3f} to {r['last_loss']:.3f}"
        cells.append(loss or "")
        lines.append(f"| {r['name']} | {r['batch']} | " + " | ".join(cells) + f" | {r['status']} |")
    return "\n".join(lines)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--cpu", action="store_true", help="the dry run: a tiny GPT on the CPU, 2 timed steps")
    add("--only", help=f"comma-separated rows, of {','.join(CHANGES)},best (default: all)")
    add("--steps", type=int, help="timed steps per row (default 20; --cpu: 2)")
    add("--warmup", type=int, help="untimed steps first, at least 1 (default 5; --cpu: 1)")
    add("--batch-size", type=int, help="the baseline's sequences (default 16; --cpu: 2)")
    add("--peak-tflops", type=float, help="the device's peak TFLOP/s (default: a table)")
    add("--json", help="also write every row to this file")
    args = p.parse_args(argv)
    names = [*CHANGES, "best"]
    args.only = args.only.split(",") if args.only else names
    if unknown := [n for n in args.only if n not in names]:
        p.error(f"--only: no row {', '.join(unknown)}; rows: {','.join(names)}")
    for name, default in (("steps", (20, 2)), ("warmup", (5, 1)), ("batch_size", (16, 2))):
        if getattr(args, name) is None:
            setattr(args, name, default[args.cpu])
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None):
    args = get_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("error: no GPU; --cpu runs the dry run")
    device = torch.device("cpu" if args.cpu else "cuda")
    shape = TINY if args.cpu else GPT2_SMALL
    peak = peak_flops(device, torch.bfloat16, args.peak_tflops)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"GPT {shape} on {name}, torch {torch.__version__}", flush=True)
    rows = []

    def add(row):  # each row printed, and the file rewritten, as soon as it is measured
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        if args.json:
            result = dict(device=name, torch=torch.__version__, shape=shape, rows=rows)
            result["table"] = table(rows).splitlines()
            Path(args.json).write_text(json.dumps(result, indent=1))

    for row_name in [n for n in CHANGES if n in args.only]:
        config = configure(row_name, args.batch_size)
        if config["compile"] != "none" and args.cpu:  # minutes of compilation on a CPU
            add(dict(config, status="skipped: no compile in the dry run"))
        else:
            add(run_row(config, shape, device, args.steps, args.warmup, peak))
    if "best" in args.only:
        config = best_config(rows, args.batch_size)
        if config:
            add(run_row(config, shape, device, args.steps, args.warmup, peak))
        else:
            why = "none: no change beat the baseline"
            add(dict(BASELINE, name="best", batch=args.batch_size, status=why))
    print("\n" + table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
