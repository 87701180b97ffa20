"""What a layout costs before it runs: memory per GPU and a step's time for a decoder-only
transformer on a cluster, for one layout or for every layout that fits (the best few, fastest
first). The standard library only: it runs where torch is not installed.

    python plan.py --model llama3-70b --gpu h100 --gpus 256 --global-batch 512 --microbatch 1
    python plan.py --model llama3-70b --gpu h100 --gpus 256 --global-batch 512 --microbatch 1 \\
        --tp 8 --dp 32 --shard 3 --recompute full --precision fp8 --json

The formulas, as the papers name them:
- Parameters and FLOPs (Narayanan et al. 2021, eq. 3): a step's matmul work 6N per token
  (8N under full recomputation: the forward twice), plus attention's 12 L H Q T (Q the
  sequence, T the tokens): MFU as nanoGPT and torchtitan count it, 6N + 12 L H Q T a token.
- Tensor parallelism (Narayanan et al. 2021, section 3.3): per block and micro-batch two
  all-reduces of the block's input forward, two backward (two more in a full recompute);
  with sequence parallelism each becomes a reduce-scatter and an all-gather: the same bytes.
- Pipeline bubble (Narayanan et al. 2021, section 2.2): (P-1)/(VM + P-1) of a step idle, P
  stages a micro-batch crosses, V per process (interleaved), M micro-batches; zero-bubble
  schedules (Qi et al. 2023) fill two thirds of it with weight gradients (ZB-H1).
- Micro-batches alive on the first pipeline rank, as model_parallel.py measures them
  (benchmarks/results.md, "Pipeline schedules"): gpipe M, 1f1b min(M, P), interleaved
  (V+1)P chunks of 1/V, zero bubble in a V (zbv, dualpipev) 2P+1 chunks of 1/2.
- Activations (Korthikanti et al. 2022, section 4): per block and micro-batch, s b h 2-byte
  words of what backward needs; the s^2 scores are never kept (a fused attention: what
  their selective recomputation removes); full recomputation keeps each block's input and
  one block's whole set; sequence parallelism divides all of it by t.
- Model states (Rajbhandari et al. 2020): 2 bytes of 16-bit weights, gradients (2 in fp16,
  as the paper; 4 in bf16: an fp32 gradient, as Megatron and FSDP keep) and 12 of fp32
  master weights, momentum and variance; ZeRO stage 1 shards the 12 over data parallelism,
  2 the gradients too, 3 (FSDP) everything: 16 bytes a parameter over the shards.
Communication: each collective's bytes as a ring sends them (all-reduce 2(n-1)/n of the
tensor, all-gather and reduce-scatter (n-1)/n), over the link its group crosses, the mesh
laid out tp, cp, dp, pp from the inside out (consecutive GPUs share a node), plus a latency
a call. The efficiency constants (GPUS) say how much of a data sheet's figure is reached.
"""

import argparse
import itertools
import json
import math
import sys

GiB = 2**30
# name: layers, dim, heads, kv heads, ffn, vocab, seq_len, mlp (the models' own configs)
PRESETS = {
    "gpt2-small": (12, 768, 12, 12, 3072, 50257, 1024, "gelu"),
    "gpt2-xl": (48, 1600, 25, 25, 6400, 50257, 1024, "gelu"),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 8192, "swiglu"),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, "swiglu"),
    "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 8192, "swiglu"),
    "gpt": (8, 256, 4, 4, 1024, 256, 256, "gelu"),  # nd_costs.py's GPT of models.py (bytes)
}
# Data sheets (dense TFLOP/s by precision, GiB, GB/s one way per GPU: NVLink, network) and
# the efficiency constants, one set per GPU type: matmul, the fraction of the peak a
# training step's matmuls reach (by precision: fp8 runs beside bf16 attention and casts);
# link, the fraction of a link's bandwidth a ring collective reaches (NCCL's bus bandwidth
# tests: about 80%); overlap, the share of the step's compute that FSDP's gathers and the
# data-parallel gradient reduction (without a pipeline) can hide behind; latency a call.
# a100 and h100's matmul fractions are fitted (tests/plan_published.json says on which rows).
GPUS = {
    "a100": dict(peak=dict(bf16=312, fp16=312), mem=80, nvlink=300, net=25,
                 matmul=dict(bf16=0.639, fp16=0.639), link=0.8, overlap=0.8, latency=2e-5),
    "h100": dict(peak=dict(bf16=989, fp16=989, fp8=1979), mem=80, nvlink=450, net=50,
                 matmul=dict(bf16=0.362, fp16=0.362, fp8=0.359), link=0.8, overlap=0.8,
                 latency=2e-5),
    "h200": dict(peak=dict(bf16=989, fp16=989, fp8=1979), mem=141, nvlink=450, net=50,
                 matmul=dict(bf16=0.362, fp16=0.362, fp8=0.359), link=0.8, overlap=0.8,
                 latency=2e-5),
    "cpu": dict(peak=dict(fp32=1, bf16=1), mem=24, nvlink=5, net=1, matmul=dict(fp32=0.5,
                bf16=0.5), link=0.5, overlap=0.0, latency=1e-4),
}  # fmt: skip
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")


class PlanError(ValueError):
    """A layout or model that cannot run: the message names what to change."""


def block_params(m):
    """One block's parameters (weights and biases): attention's q, k, v and output, the MLP
    (GELU: fc1, fc2; SwiGLU: gate, up, down), two norms."""
    h, kv = m["dim"], m["dim"] * m["kv_heads"] // m["heads"]
    attn = h * (h + 2 * kv) + h * h
    mlp = (3 if m["mlp"] == "swiglu" else 2) * h * m["ffn"]
    return attn + mlp + 4 * h


def total_params(m):
    return m["layers"] * block_params(m) + 2 * m["vocab"] * m["dim"]  # untied embedding, head


def flops_per_token(m, recompute="none"):
    """Model FLOPs a token (6N + 12 L H Q T: N the matmul weights, Narayanan's and PaLM's
    count), and the hardware's, with what recomputation runs again."""
    n = m["layers"] * block_params(m) + m["vocab"] * m["dim"]  # the embedding: no matmul
    attn = 12 * m["layers"] * m["dim"] * m["seq_len"]
    model = 6 * n + attn
    again = {"none": 0, "selective": attn / 3, "full": (2 * n + attn) / 3}[recompute]
    return model, model + again


def stage_blocks(layers, stages):
    """Blocks of each stage: the ceiling for the first layers % stages, the floor after."""
    return [layers // stages + (s < layers % stages) for s in range(stages)]


def rank_stages(schedule, rank, pp, per_rank):  # training.pipeline_stage_ids
    if schedule in ("zbv", "dualpipev"):
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


def in_flight(schedule, micro, pp, per_rank):
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of
    one micro-batch through all of its blocks (model_parallel.py's measured counts)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return micro
    if schedule == "1f1b":
        return min(micro, pp)
    if schedule in ("zbv", "dualpipev"):
        return min(micro * 2, 2 * pp + 1) / 2
    return min(micro * per_rank, (per_rank + 1) * pp) / per_rank


def bubble(schedule, micro, pp, per_rank):
    """The share of a step each pipeline rank idles: (P-1)/(VM+P-1); zero bubble: a third."""
    if pp == 1:
        return 0.0
    idle = (pp - 1) / (per_rank * micro + pp - 1)
    return idle / 3 if schedule in ("interleaved-zb", "zbv", "dualpipev") else idle


def model_state_bytes(params, stage, n, precision):
    """ZeRO's model states a GPU holds for `params` parameters over n data-parallel shards:
    (weights, gradients, optimizer) in bytes."""
    # fp32 (this project's CPU runs), FSDP in bf16: fp32 weights (the master), gradients, AdamW
    if precision == "fp32" or (stage == 3 and precision != "fp16"):
        w, g, o = 4, 4, 8
    else:
        w, g, o = 2, 2 if precision == "fp16" else 4, 12
    return (
        params * w / (n if stage >= 3 else 1),
        params * g / (n if stage >= 2 else 1),
        params * o / (n if stage >= 1 else 1),
    )


def gpt_stage_shapes(layout, args):
    """{name: shape} of stage 0 of models.py's GPT (256 bytes, learned positions, GELU MLP of
    4 dim) on a tensor-parallel rank, before FSDP cuts them, without torch: q, k, v and fc1
    cut by rows, proj's and fc2's weights by columns (nd_costs.stage_shapes' answer)."""
    pp, _, _, tp = layout
    d, blocks = args.dim, args.depth // pp
    shapes = {"embed.weight": (256, d), "pos": (1, args.seq_len, d)}
    for i in range(blocks):
        cut = {
            "norm1.weight": (d,), "norm1.bias": (d,),
            "attn.q.weight": (d // tp, d), "attn.q.bias": (d // tp,),
            "attn.v.weight": (d // tp, d), "attn.v.bias": (d // tp,),
            "attn.proj.weight": (d, d // tp), "attn.proj.bias": (d,),
            "attn.k.weight": (d // tp, d),
            "norm2.weight": (d,), "norm2.bias": (d,),
            "mlp.fc1.weight": (4 * d // tp, d), "mlp.fc1.bias": (4 * d // tp,),
            "mlp.fc2.weight": (d, 4 * d // tp), "mlp.fc2.bias": (d,),
        }  # fmt: skip
        shapes |= {f"blocks.{i}.{k}": s for k, s in cut.items()}
    if pp == 1:  # the last stage's too
        shapes |= {"norm.weight": (d,), "norm.bias": (d,)}
        shapes |= {"head.weight": (256, d), "head.bias": (256,)}
    return shapes


def formulas(layout, args, policy="reshard"):
    """The bytes rank 0 (stage 0) sends per step in each mesh dimension of nd_parallel.py
    (pp, dp x cp flattened for FSDP, cp, tp), for models.py's GPT in fp32: nd_costs.py's
    formulas, its inputs and answer. policy: FSDP under a pipeline, "reshard" (each block
    resharded after forward: gathered in each of the M micro-batches' forwards and once for
    the backwards; the embedding and the head in the root, gathered once) or "keep"
    (torchtitan's: while pp > 1 no block is resharded, one gather each a step, and the
    embedding and the final norm with the head are units of their own)."""
    pp, dp, cp, tp = layout
    b, t, d = args.global_batch // dp, args.seq_len // cp, args.dim
    a, blocks, n = b * t * d * 4, args.depth // pp, dp * cp
    out = {"pp": a if pp > 1 else 0}  # stage 0 sends each micro-batch's output on
    # Per block 2 all-reduces of a forward (attn.proj's, mlp.fc2's partial sums), 2 backward.
    out["tp"] = blocks * 4 * 2 * (tp - 1) / tp * a
    # Per block, K and V (2 a / tp) all-gathered forward, their gradients reduce-scattered.
    out["cp"] = blocks * 2 * (cp - 1) * 2 * a / tp
    micro = pp if pp > 1 else 1  # nd_parallel.py's default --microbatches
    # Each tensor padded to n equal shards of rows (positions, one row: n rows).
    w = {
        k: 4 * -(-s[0] // n) * n * math.prod(s[1:])
        for k, s in gpt_stage_shapes(layout, args).items()
    }
    root = sum(v for k, v in w.items() if not k.startswith("blocks."))
    whole = sum(w.values())
    gathers = 1 if policy == "keep" and pp > 1 else micro + 1
    out["dp_cp"] = (n - 1) / n * (gathers * (whole - root) + root + whole)
    return out


def check(m, hw, lay, global_batch, microbatch):
    """One line naming what to change, where the layout cannot run."""
    tp, pp, cp, dp = (lay[k] for k in ("tp", "pp", "cp", "dp"))
    if tp * pp * cp * dp != hw["gpus"]:
        raise PlanError(
            f"--tp {tp} x --pp {pp} x --cp {cp} x --dp {dp} is {tp * pp * cp * dp} GPUs, "
            f"not --gpus {hw['gpus']}: change a degree or --gpus"
        )
    for name in ("heads", "kv_heads"):
        if m[name] % tp:
            raise PlanError(f"--tp {tp} must divide the {m[name]} {name.replace('_', ' ')}")
    if m["seq_len"] % cp:
        raise PlanError(f"--cp {cp} must divide --seq-len {m['seq_len']}")
    if global_batch % dp or (global_batch // dp) % microbatch:
        raise PlanError(
            f"--microbatch {microbatch} must divide a data-parallel rank's batch: "
            f"--global-batch {global_batch} / --dp {dp} sequences"
        )
    if lay["precision"] not in hw["peak"]:
        raise PlanError(f"--gpu {hw['name']} has no {lay['precision']}: choose another --precision")
    schedule, per_rank, micro = lay["schedule"], lay["per_rank"], global_batch // dp // microbatch
    if pp > 1 and (schedule in ("gpipe", "1f1b")) != (per_rank == 1):
        raise PlanError(
            f"--pipeline-schedule {schedule} takes --stages-per-rank {per_rank}? "
            "gpipe and 1f1b take 1, the others 2 or more"
        )
    if pp > 1 and schedule in ("zbv", "dualpipev") and per_rank != 2:
        raise PlanError(f"--pipeline-schedule {schedule} places 2 stages per rank (a V)")
    if pp * per_rank > m["layers"]:
        raise PlanError(f"{pp * per_rank} stages exceed the {m['layers']} layers: lower --pp")
    if pp > 1 and schedule in ("1f1b", "dualpipev") and micro < pp * per_rank:
        raise PlanError(
            f"{schedule} needs micro-batches >= stages ({pp * per_rank}), got "
            f"{micro}: lower --microbatch or raise --global-batch"
        )


def link(hw, span):
    """GB/s one way and latency of a group whose members are `span` GPUs apart at most."""
    inside = span <= hw["gpus_per_node"]
    return (hw["nvlink"] if inside else hw["net"]) * 1e9 * hw["link"], hw["latency"]


def evaluate(m, hw, lay, global_batch, microbatch, policy="keep"):
    """Memory per GPU and a step's time of one layout: a dict of the parts."""
    check(m, hw, lay, global_batch, microbatch)
    tp, pp, cp, dp = (lay[k] for k in ("tp", "pp", "cp", "dp"))
    shard, rec, prec, sp = lay["shard"], lay["recompute"], lay["precision"], lay["sp"] or tp == 1
    schedule, v = lay["schedule"], lay["per_rank"] if pp > 1 else 1
    h, s, vocab, n = m["dim"], m["seq_len"], m["vocab"], dp * cp
    word = 4 if prec == "fp32" else 2  # bytes of an activation, of a 16-bit weight
    micro = global_batch // dp // microbatch
    tokens = microbatch * s // cp  # a micro-batch's on one GPU
    bp = block_params(m)
    blocks = stage_blocks(m["layers"], pp * v)
    # Korthikanti's per-block words over s b h: attention (norm input, q k v input, q, k, v,
    # output), MLP (norm input, fc1 input, 2 or 3 ffn-wide tensors).
    kv = m["kv_heads"] / m["heads"]
    c = 4 + 2 * kv + 2 + (3 if m["mlp"] == "swiglu" else 2) * m["ffn"] / h
    per_block = c / tp if sp else 4 + (c - 4) / tp
    if rec == "full":
        per_block = 1 / tp if sp else 1
    peak = hw["peak"][prec] * 1e12 * hw["matmul"][prec]
    flops_block = 6 * (bp - 4 * h) + 12 * h * s
    flops_block += {"none": 0, "selective": 4 * h * s, "full": 2 * (bp - 4 * h) + 4 * h * s}[rec]
    t_block = tokens * flops_block / tp / peak
    bw, lat = link(hw, tp)
    ar = 2 * (tp - 1) / tp * tokens * h * word
    t_tp = (4 + 2 * (rec == "full")) * (ar / bw + lat) if tp > 1 else 0.0
    bw, lat = link(hw, tp * cp)
    kv_bytes = (cp - 1) * 2 * tokens * h * kv / tp * word
    t_cp = (2 + (rec == "full")) * (kv_bytes / bw + lat) if cp > 1 else 0.0
    bw, lat = link(hw, tp * cp * dp * pp)
    t_p2p = 2 * (tokens * h * word / (tp if sp else 1) / bw + lat) if pp > 1 else 0.0
    ranks = {}
    for r in sorted({0, pp - 1}):  # the first and the last pipeline rank: embedding, head
        ids = rank_stages(schedule, r, pp, v)
        nb = sum(blocks[i] for i in ids)
        head = pp * v - 1 in ids
        params = (
            nb * bp / tp + (vocab * h / tp if 0 in ids else 0) + (vocab * h / tp if head else 0)
        )
        parts = dict(
            compute=nb * t_block + (tokens * 6 * vocab * h / tp / peak if head else 0),
            tp=nb * t_tp,
            cp=nb * t_cp,
            pp=v * t_p2p,
        )
        t = sum(parts.values())
        w, g, o = model_state_bytes(params, shard, n, prec)
        alive = in_flight(schedule, micro, pp, v) if r == 0 else 1
        act = per_block * nb * alive * tokens * h * word
        act += c / tp * tokens * h * word if rec == "full" else 0
        act += tokens * vocab / tp * (word + 4) if head else 0  # logits, fp32 log-probabilities
        keep = shard == 3 and policy == "keep" and pp > 1
        buf = (nb if keep else 2) * bp / tp * (word if shard == 3 else 4)
        ranks[r] = dict(
            params=params, t=t, parts=parts, weights=w, grads=g, optimizer=o, act=act, buf=buf
        )
    worst = max(
        ranks.values(),
        key=lambda x: x["weights"] + x["grads"] + x["optimizer"] + x["act"] + x["buf"],
    )
    slow = max(ranks.values(), key=lambda x: x["t"])
    idle = bubble(schedule, micro, pp, v)
    compute = micro * slow["t"]
    pipe = compute / (1 - idle)
    # Data parallelism over dp x cp: ZeRO 0 all-reduces the gradients; 1 and 2
    # reduce-scatter them and all-gather the updated 16-bit weights; 3 (FSDP) gathers the
    # weights before use (per micro-batch forward and backward, or once a step where kept)
    # and reduce-scatters the gradients once.
    p, gbytes = ranks[0]["params"], (2 if prec == "fp16" else 4)
    if shard == 0:
        dp_bytes = 2 * (n - 1) / n * p * gbytes
    elif shard < 3:
        dp_bytes = (n - 1) / n * p * (gbytes + word)
    else:
        gathers = 1 if policy == "keep" and pp > 1 else (micro + 1 if pp > 1 else 2 * micro)
        dp_bytes = (n - 1) / n * p * (gathers * word + gbytes)
    bw, lat = link(hw, tp * cp * dp)
    t_dp = dp_bytes / bw + lat * sum(blocks) if n > 1 else 0.0
    # Under a pipeline ZeRO's reduction waits for the flush (Megatron, DeepSpeed); FSDP's
    # gathers and a pipeline-free reduction hide behind the step's compute.
    hidden = 0.0 if pp > 1 and shard < 3 else hw["overlap"] * compute
    exposed_dp = max(0.0, t_dp - hidden)
    step = pipe + exposed_dp
    model_flops, _ = flops_per_token(m, rec)
    tps = global_batch * s / step / hw["gpus"]
    mem = {k: worst[k] / GiB for k in ("weights", "grads", "optimizer", "act", "buf")}
    return dict(
        layout=dict(tp=tp, pp=pp, cp=cp, dp=dp, shard=shard, schedule=schedule,
                    stages_per_rank=v, recompute=rec, precision=prec, microbatch=microbatch),
        memory_gib=sum(mem.values()), memory=dict(zip(
            ("weights", "gradients", "optimizer", "activations", "buffer"), mem.values(),
            strict=True)),
        step_seconds=step, tokens_per_second_per_gpu=tps,
        mfu=model_flops * tps / (hw["peak"][prec] * 1e12),
        time=dict({k: micro * x for k, x in slow["parts"].items()}, bubble=pipe - compute,
                  dp=exposed_dp, dp_total=t_dp),
        fits=sum(mem.values()) <= hw["mem"],
    )  # fmt: skip


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def search(m, hw, global_batch, microbatch, fixed, policy="keep"):
    """Every layout of hw["gpus"] that fits, fastest first (flags given stay fixed)."""
    rows = []
    gpus = hw["gpus"]
    for tp, pp, cp in itertools.product(divisors(gpus), repeat=3):
        if gpus % (tp * pp * cp) or tp > hw["gpus_per_node"] or cp > 16:
            continue
        layout = dict(tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp))
        if any(fixed.get(k) not in (None, layout[k]) for k in layout):
            continue
        scheds = [("1f1b", 1), ("interleaved-1f1b", 2)] if pp > 1 else [("1f1b", 1)]
        if fixed.get("schedule"):
            scheds = [(fixed["schedule"], fixed.get("per_rank") or 1)] if pp > 1 else scheds
        for shard, rec, (schedule, v) in itertools.product(
            [fixed["shard"]] if fixed.get("shard") is not None else [1, 3],
            [fixed["recompute"]] if fixed.get("recompute") else ["none", "selective", "full"],
            scheds,
        ):
            lay = dict(layout, shard=shard, recompute=rec, schedule=schedule, per_rank=v,
                       precision=fixed["precision"], sp=fixed["sp"])  # fmt: skip
            try:
                row = evaluate(m, hw, lay, global_batch, microbatch, policy)
            except PlanError:
                continue
            if row["fits"]:
                rows.append(row)
    if not rows:
        raise PlanError(
            f"no layout of {gpus} GPUs fits {hw['mem']} GiB each: add --gpus, lower "
            "--microbatch or --seq-len, or choose a --gpu with more memory"
        )
    return sorted(rows, key=lambda r: r["step_seconds"])


def describe(r):
    lay = r["layout"]
    name = f"tp {lay['tp']} pp {lay['pp']} cp {lay['cp']} dp {lay['dp']} zero {lay['shard']}"
    if lay["pp"] > 1:
        name += f" {lay['schedule']}" + (
            f" v{lay['stages_per_rank']}" if lay["stages_per_rank"] > 1 else ""
        )
    name += f" recompute {lay['recompute']}"
    mem = " + ".join(f"{v:.1f}" for v in r["memory"].values())
    t = r["time"]
    parts = " + ".join(f"{k} {t[k]:.2f}" for k in ("compute", "tp", "cp", "pp", "bubble", "dp"))
    return (
        f"{name}\n  memory {r['memory_gib']:.1f} GiB a GPU (weights + gradients + optimizer"
        f" + activations + buffer: {mem})\n  step {r['step_seconds']:.2f} s ({parts}),"
        f" {r['tokens_per_second_per_gpu']:,.0f} tokens/s a GPU, MFU {r['mfu']:.1%}"
    )


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--model", default="gpt", help=f"a preset ({', '.join(PRESETS)}); flags override it")
    for flag, kind, what in [
        ("--layers", int, "blocks"), ("--dim", int, "width"), ("--heads", int, "attention heads"),
        ("--kv-heads", int, "key/value heads (GQA)"), ("--ffn", int, "MLP hidden width"),
        ("--vocab", int, "vocabulary"), ("--seq-len", int, "tokens a sequence"),
    ]:  # fmt: skip
        add(flag, type=kind, help=f"the model's {what} (default: the preset's)")
    add("--mlp", choices=["gelu", "swiglu"], help="the MLP (default: the preset's)")
    add("--global-batch", type=int, default=8, help="sequences a step, all data-parallel ranks")
    add("--microbatch", type=int, default=1, help="sequences a micro-batch")
    add("--gpu", default="h100", help=f"one of {', '.join(GPUS)} (data sheet, constants)")
    add("--gpus", type=int, default=8, help="GPUs in all")
    add("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink")
    add("--memory-gib", type=float, help="GiB a GPU (default: the data sheet's)")
    add("--nvlink-gbs", type=float, help="GB/s one way per GPU inside a node")
    add("--network-gbs", type=float, help="GB/s one way per GPU between nodes")
    for flag in ("--tp", "--pp", "--cp", "--dp"):
        add(flag, type=int, help="the degree (all four: that layout; else a search)")
    add("--shard", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (3: FSDP; default: searched)")
    add("--pipeline-schedule", choices=SCHEDULES, help="model_parallel.py's (default 1f1b)")
    add("--stages-per-rank", type=int, help="stages a pipeline rank holds (interleaved: 2)")
    add("--recompute", choices=["none", "selective", "full"], help="(default: searched)")
    add("--precision", choices=["bf16", "fp16", "fp8", "fp32"], default="bf16", help="matmuls'")
    add(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="norms and residuals cut over tp too (Korthikanti et al. 2022)",
    )
    add(
        "--fsdp-policy",
        choices=["keep", "reshard"],
        default="keep",
        help="under a pipeline, blocks kept gathered for the step (torchtitan's) or not",
    )
    add("--top", type=int, default=5, help="layouts shown by the search")
    add("--json", action="store_true", help="one JSON object a layout")
    return p.parse_args(argv)


def model_of(args):
    if args.model not in PRESETS:
        raise PlanError(f"--model {args.model} is no preset: choose one of {', '.join(PRESETS)}")
    keys = ("layers", "dim", "heads", "kv_heads", "ffn", "vocab", "seq_len", "mlp")
    m = dict(zip(keys, PRESETS[args.model], strict=True))
    m |= {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.heads is not None and args.kv_heads is None and args.model != "gpt":
        m["kv_heads"] = min(m["kv_heads"], m["heads"])
    if m["dim"] % m["heads"] or m["heads"] % m["kv_heads"]:
        raise PlanError(
            f"--heads {m['heads']} must divide --dim {m['dim']} and be a multiple "
            f"of --kv-heads {m['kv_heads']}"
        )
    return m


def hardware(args):
    if args.gpu not in GPUS:
        raise PlanError(f"--gpu {args.gpu} is unknown: choose one of {', '.join(GPUS)}")
    hw = dict(GPUS[args.gpu], name=args.gpu, gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    for key, flag in (("mem", "memory_gib"), ("nvlink", "nvlink_gbs"), ("net", "network_gbs")):
        hw[key] = getattr(args, flag) or hw[key]
    return hw


def run(argv):
    """plan.py's answer for a command line (a list of flags): the layouts, fastest first."""
    args = get_args(argv)
    m, hw = model_of(args), hardware(args)
    fixed = dict(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, shard=args.shard,
                 recompute=args.recompute, schedule=args.pipeline_schedule,
                 per_rank=args.stages_per_rank, precision=args.precision,
                 sp=args.sequence_parallel)  # fmt: skip
    if None in (args.tp, args.pp, args.cp, args.dp):
        return (
            args,
            m,
            hw,
            search(m, hw, args.global_batch, args.microbatch, fixed, args.fsdp_policy),
        )
    sched = args.pipeline_schedule or "1f1b"
    v = args.stages_per_rank or (1 if sched in ("gpipe", "1f1b") else 2)
    lay = dict(fixed, schedule=sched, per_rank=v, shard=args.shard or 0,
               recompute=args.recompute or "none")  # fmt: skip
    return args, m, hw, [evaluate(m, hw, lay, args.global_batch, args.microbatch, args.fsdp_policy)]


def main(argv=None):
    try:
        args, m, hw, rows = run(argv)
    except PlanError as e:
        sys.exit(f"error: {e}")
    shown = rows[: args.top]
    if args.json:
        for r in shown:
            print(json.dumps(r))
        return rows
    n = sum(block_params(m) for _ in range(m["layers"])) + 2 * m["vocab"] * m["dim"]
    print(
        f"{args.model}: {n / 1e9:.2f} B parameters; {hw['gpus']} x {args.gpu}, "
        f"{args.global_batch} sequences of {m['seq_len']} a step"
    )
    if len(rows) > 1:
        print(f"{len(rows)} layouts fit; the fastest {len(shown)}:")
    for r in shown:
        print(("" if r["fits"] else "DOES NOT FIT: ") + describe(r))
    return rows


if __name__ == "__main__":
    main()
