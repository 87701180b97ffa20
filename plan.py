"""What a layout costs before it runs: memory per GPU and a step's time for a decoder-only
transformer on a cluster, for one layout or for every layout that fits (the best few, fastest
first). The standard library only: it runs where torch is not installed.

    python plan.py --model llama3-70b --gpus 256 --global-batch 512 --microbatch 2  # a search
    python plan.py --model llama3-70b --gpus 256 --global-batch 512 --tp 8 --dp 32 --json

The formulas, as the papers name them:
- FLOPs (Narayanan et al. 2021, eq. 3): 6N a token for the matmuls (8N under full
  recomputation) and 12 L H Q T for attention; MFU as nanoGPT and torchtitan count it.
- Tensor parallelism (Narayanan et al. 2021, section 3.3): per block and micro-batch two
  all-reduces of the block's input forward, two backward (two more in a full recompute);
  with sequence parallelism each becomes a reduce-scatter and an all-gather: the same bytes.
- Pipeline bubble (Narayanan et al. 2021, section 2.2): (P-1)/(VM + P-1) of a step idle, P
  stages a micro-batch crosses, V per process (interleaved), M micro-batches; zero-bubble
  schedules (Qi et al. 2023) fill two thirds of it with weight gradients (ZB-H1).
- Activations (Korthikanti et al. 2022, section 4): per block and micro-batch, s b h words
  of what backward needs, never the s^2 scores (a fused attention: what their selective
  recomputation removes); full recomputation keeps each block's input and one block's set.
- Model states (Rajbhandari et al. 2020): 2 bytes of 16-bit weights, gradients (2 in fp16;
  4 in bf16: fp32, as Megatron and FSDP keep) and 12 of fp32 master weights, momentum and
  variance; ZeRO 1 shards the 12 over data parallelism, 2 the gradients too, 3 (FSDP) all.
Communication: a collective's bytes as a ring sends them, over the link its group crosses
(the mesh tp, cp, dp, pp from the inside out: consecutive GPUs share a node), and a latency.
"""

import argparse
import itertools
import json
import math
import sys

# name: layers, dim, heads, kv heads, ffn, vocab, seq_len, mlp (the models' published configs)
PRESETS = {
    "gpt2-small": (12, 768, 12, 12, 3072, 50257, 1024, "gelu"),
    "gpt2-xl": (48, 1600, 25, 25, 6400, 50257, 1024, "gelu"),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 8192, "swiglu"),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, "swiglu"),
    "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 8192, "swiglu"),
    "gpt": (8, 256, 4, 4, 1024, 256, 256, "gelu"),  # nd_costs.py's GPT of models.py (bytes)
}
# Data sheets: dense TFLOP/s, GiB, GB/s one way a GPU (NVLink, network) and HBM's. Efficiency
# constants, one set a GPU type (docs/plan.md: each, the rows that fitted it): matmul, small
# (matmul_rate's x0), reserve (beyond the tensors counted), link, overlap, latency (a call).
H100 = dict(peak=dict(bf16=989, fp16=989, fp8=1979), nvlink=450, net=50, hbm=3350, link=0.8,
            matmul=dict(bf16=0.367, fp16=0.367, fp8=0.359), latency=2e-5, small=0,
            overlap=0.8, reserve=0.154)  # fmt: skip
GPUS = {
    "a100": dict(peak=dict(bf16=312, fp16=312), mem=80, nvlink=300, net=25, hbm=2039,
                 matmul=dict(bf16=0.656, fp16=0.656), link=0.8, overlap=0.8, latency=2e-5,
                 small=1.7e6, reserve=0.31),
    "h100": dict(H100, mem=80),
    "h200": dict(H100, mem=141, hbm=4800),
    "cpu": dict(peak=dict(fp32=1, bf16=1), mem=24, nvlink=5, net=5, hbm=50, matmul=dict(fp32=0.5,
                bf16=0.5), link=0.5, overlap=0.0, latency=1e-4, small=0, reserve=0),  # a guess
}  # fmt: skip
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
SPLIT = ("weights", "gradients", "optimizer", "activations", "buffer")


class PlanError(ValueError):
    """A layout or model that cannot run: the message names what to change."""


def block_params(m):
    """One block's parameters: attention's q, k, v and output, the MLP (GELU: fc1, fc2, with
    biases, as GPT-2; SwiGLU: gate, up, down, none, as Llama), two norms."""
    h, kv = m["dim"], m["dim"] * m["kv_heads"] // m["heads"]
    if m["mlp"] == "swiglu":
        return h * (h + 2 * kv) + h * h + 3 * h * m["ffn"] + 2 * h
    return h * (h + 2 * kv) + h * h + 2 * h * m["ffn"] + (3 * h + 2 * kv + m["ffn"]) + 4 * h


def model_flops_per_token(m):
    """6N + 12 L H Q T (N: the weights a matmul uses; nanoGPT's, torchtitan's count)."""
    n = m["layers"] * block_params(m) + m["vocab"] * m["dim"]  # the embedding: a lookup
    return 6 * n + 12 * m["layers"] * m["dim"] * m["seq_len"]


def matmul_rate(hw, prec, h, tp):
    """FLOP/s a GPU's matmuls reach: the peak x the fraction big ones reach x x / (x + x0),
    x = h^2 / tp, an h x h matrix on a GPU: small ones fill fewer of its units."""
    x = h * h / tp
    return hw["peak"][prec] * 1e12 * hw["matmul"][prec] * x / (x + hw["small"])


def stage_blocks(layers, stages):
    """Blocks of each stage: the ceiling for the first layers % stages, the floor after."""
    return [layers // stages + (s < layers % stages) for s in range(stages)]


def rank_stages(schedule, rank, pp, per_rank):  # training.pipeline_stage_ids
    v_shaped = schedule in ("zbv", "dualpipev")
    return [rank, 2 * pp - 1 - rank] if v_shaped else [rank + k * pp for k in range(per_rank)]


def in_flight(schedule, micro, pp, per_rank):
    """Micro-batches the first pipeline rank holds at its peak, in micro-batches through all its
    blocks, as model_parallel.py measures them (benchmarks/results.md): gpipe M, 1f1b
    min(M, P), interleaved (V+1)P chunks of 1/V, in a V (zbv, dualpipev) 2P+1 chunks of 1/2."""
    if pp == 1:
        return 1
    if schedule in ("gpipe", "1f1b"):
        return micro if schedule == "gpipe" else min(micro, pp)
    chunks = 2 * pp + 1 if schedule in ("zbv", "dualpipev") else (per_rank + 1) * pp
    return min(micro * per_rank, chunks) / per_rank


def bubble(schedule, micro, pp, per_rank):
    """The share of a step each pipeline rank idles: (P-1)/(VM+P-1); zero bubble: a third."""
    idle = (pp - 1) / (per_rank * micro + pp - 1)
    return idle / 3 if schedule in ("interleaved-zb", "zbv", "dualpipev") else idle


def model_state_bytes(params, stage, n, precision):
    """ZeRO's (weights, gradients, optimizer) bytes a GPU holds of `params` over n shards."""
    # fp32 (this project's CPU runs), FSDP in bf16: fp32 weights (the master), gradients, AdamW
    if precision == "fp32" or (stage == 3 and precision != "fp16"):
        w, g, o = 4, 4, 8
    else:
        w, g, o = 2, 2 if precision == "fp16" else 4, 12
    return tuple(params * b / (n if stage >= k else 1) for b, k in ((w, 3), (g, 2), (o, 1)))


def gpt_stage_shapes(layout, args):
    """{name: shape} of stage 0 of models.py's GPT on a tensor-parallel rank, without torch: q,
    k, v and fc1 cut by rows, proj's and fc2's weights by columns (nd_costs.stage_shapes')."""
    pp, _, _, tp = layout
    d, c = args.dim, args.dim // tp
    shapes = {"embed.weight": (256, d), "pos": (1, args.seq_len, d)}
    block = {
        "norm1.weight": (d,), "norm1.bias": (d,), "attn.q.weight": (c, d), "attn.q.bias": (c,),
        "attn.v.weight": (c, d), "attn.v.bias": (c,), "attn.proj.weight": (d, c),
        "attn.proj.bias": (d,), "attn.k.weight": (c, d), "norm2.weight": (d,),
        "norm2.bias": (d,), "mlp.fc1.weight": (4 * c, d), "mlp.fc1.bias": (4 * c,),
        "mlp.fc2.weight": (d, 4 * c), "mlp.fc2.bias": (d,),
    }  # fmt: skip
    for i in range(args.depth // pp):
        shapes |= {f"blocks.{i}.{k}": s for k, s in block.items()}
    if pp == 1:  # the last stage's too
        shapes |= {"norm.weight": (d,), "norm.bias": (d,), "head.weight": (256, d)}
        shapes |= {"head.bias": (256,)}
    return shapes


def formulas(layout, args, policy="keep"):
    """The bytes rank 0 sends a step in each mesh dimension of nd_parallel.py (pp, dp x cp:
    FSDP's, cp, tp) for models.py's GPT in fp32, as benchmarks/nd_costs.py counts them. FSDP
    under a pipeline: "reshard" (a block gathered in each micro-batch's forward and once for
    the backwards, the embedding and head in the root) or "keep" (torchtitan's: one gather a
    step; the embedding and the final norm with the head units of their own)."""
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
    shapes = gpt_stage_shapes(layout, args).items()
    w = {k: 4 * -(-s[0] // n) * n * math.prod(s[1:]) for k, s in shapes}
    whole, blocks_w = sum(w.values()), sum(v for k, v in w.items() if k.startswith("blocks."))
    if policy == "keep":  # the embedding a unit of its own, resharded (without a pipeline)
        gathered = whole + (blocks_w + w["embed.weight"] if pp == 1 else 0)
    else:  # (M + 1) W_blocks + W_root
        gathered = whole + micro * blocks_w
    out["dp_shard_cp"] = (n - 1) / n * (gathered + whole)  # and every gradient reduce-scattered
    return out


def check(m, hw, lay, batch, microbatch):
    """One line naming what to change, where the layout cannot run."""
    tp, pp, cp, dp, sched, v = (lay[k] for k in ("tp", "pp", "cp", "dp", "schedule", "per_rank"))
    micro = batch // dp // microbatch
    wrong = [
        (tp * pp * cp * dp != hw["gpus"], f"--tp {tp} x --pp {pp} x --cp {cp} x --dp {dp} is "
         f"{tp * pp * cp * dp} GPUs, not --gpus {hw['gpus']}: change a degree or --gpus"),
        (m["heads"] % tp, f"--tp {tp} must divide the {m['heads']} heads (--heads)"),
        (m["kv_heads"] % tp, f"--tp {tp} must divide the {m['kv_heads']} KV heads (--kv-heads)"),
        (m["seq_len"] % cp, f"--cp {cp} must divide --seq-len {m['seq_len']}"),
        (batch % dp or batch // dp % microbatch, f"--microbatch {microbatch} must divide a "
         f"data-parallel rank's batch, --global-batch {batch} / --dp {dp} sequences"),
        (lay["precision"] not in hw["peak"],
         f"--gpu {hw['name']} has no {lay['precision']}: choose another --precision"),
        (pp > 1 and v != {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2}.get(sched, max(v, 2)),
         f"--pipeline-schedule {sched} takes 1 stage a rank (gpipe, 1f1b), 2 (zbv, dualpipev: a "
         f"V) or 2 or more (interleaved), not --stages-per-rank {v}"),
        (pp * v > m["layers"], f"{pp * v} stages for {m['layers']} layers: lower --pp"),
        (pp > 1 and sched in ("1f1b", "dualpipev") and micro < pp * v, f"{sched} needs as many "
         f"micro-batches as stages ({pp * v}), not {micro}: lower --microbatch"),
    ]  # fmt: skip
    for bad, line in wrong:
        if bad:
            raise PlanError(line)


def evaluate(m, hw, lay, batch, microbatch, policy="keep"):
    """Memory per GPU (the fuller of the first, last pipeline rank), step time (the slower's)."""
    check(m, hw, lay, batch, microbatch)
    tp, pp, cp, dp, shard, rec, prec = (lay[k] for k in ("tp", "pp", "cp", "dp", "shard",
                                                        "recompute", "precision"))  # fmt: skip
    sched, v, sp = lay["schedule"], lay["per_rank"] if pp > 1 else 1, lay["sp"] or tp == 1
    h, s, vocab, n, lat = m["dim"], m["seq_len"], m["vocab"], dp * cp, hw["latency"]

    def link(stride, size):  # bytes/s one way a ring of `size` GPUs `stride` apart reaches
        k = hw["gpus_per_node"] // stride  # its members a node: across nodes, k GPUs' network
        bw = hw["nvlink"] if stride * size <= hw["gpus_per_node"] else hw["net"] * max(1, k)
        return min(bw, hw["nvlink"]) * 1e9 * hw["link"]

    word = 4 if prec == "fp32" else 2  # bytes of an activation, of a gathered weight
    micro, tokens = batch // dp // microbatch, microbatch * s // cp  # a micro-batch's, a GPU's
    bp, blocks = block_params(m), stage_blocks(m["layers"], pp * v)
    # Korthikanti's words a block keeps, over s b h: attention's norm input, q k v input, q,
    # k, v, output; the MLP's norm input, fc1 input, 2 (GELU) or 3 (SwiGLU) ffn-wide tensors.
    # "op", torchtitan's op-level selective recomputation: input, q, v, attention, fc1/gate, down
    kv, swiglu, f = m["kv_heads"] / m["heads"], m["mlp"] == "swiglu", m["ffn"] / h
    c, op = 6 + 2 * kv + (2 + swiglu) * f, 3 + kv + f + swiglu
    kept = {"full": 1, "op": op}.get(rec, c)
    kept = kept / tp if sp else {"full": 1, "op": 2 + (op - 2) / tp}.get(rec, 4 + (c - 4) / tp)
    kept += (rec != "full") * 2 * kv * (cp - 1) / tp  # context parallelism's gathered K, V
    rate = matmul_rate(hw, prec, h, tp)
    mm, attn = 2 * (bp - 4 * h), 4 * h * s  # a token's forward FLOPs in a block; recomputed:
    again = {"none": 0, "selective": attn, "op": 2 * h * h * (1 + kv + f), "full": mm + attn}[rec]
    t_block = tokens * (3 * (mm + attn) + again) / tp / rate
    # Without sequence parallelism each TP rank repeats norms and residual adds (docs/plan.md)
    elementwise = (1 - 1 / tp) * tokens * 12 * h * word * (3 + (rec == "full")) / hw["hbm"]
    t_block += (not sp) * elementwise / 1e9 / hw["link"]
    ar = 2 * (tp - 1) / tp * tokens * h * word / link(1, tp) + lat  # one all-reduce
    t_tp = (4 + 2 * (rec == "full")) * ar if tp > 1 else 0.0
    gather = (cp - 1) * 2 * tokens * h * kv / tp * word / link(tp, cp) + lat
    t_cp = (2 + (rec == "full")) * gather if cp > 1 else 0.0
    send = tokens * h * word / (tp if sp else 1) / link(tp * cp * dp, pp) + lat
    ranks = []
    for r in sorted({0, pp - 1}):  # the first and the last pipeline rank: embedding, head
        ids = rank_stages(sched, r, pp, v)
        nb, ends = sum(blocks[i] for i in ids), (0 in ids) + (pp * v - 1 in ids)
        head = pp * v - 1 in ids
        params = (nb * bp + ends * vocab * h) / tp
        parts = dict(compute=nb * t_block + head * tokens * 6 * vocab * h / tp / rate,
                     tp=nb * t_tp, cp=nb * t_cp, pp=2 * v * send * (pp > 1))  # fmt: skip
        states = model_state_bytes(params, shard, n, prec)
        act = kept * nb * in_flight(sched, micro, pp, v) ** (r == 0) * tokens * h * word
        act += {"full": c, "op": c - op}.get(rec, 0) / tp * tokens * h * word  # one recomputed
        act += head * tokens * vocab / tp * 12  # fp32 log-probabilities, theirs, logits' grads
        # FSDP gathers a block and prefetches the next (torchtitan's under a pipeline: all, their
        # fp32 gradients unreduced to the last micro-batch); ZeRO 0-2: buckets of 2 blocks' fp32.
        keep = shard == 3 and policy == "keep" and pp > 1
        buf = (nb * (word + 4) if keep else 2 * (word if shard == 3 else 4)) * bp / tp
        mem = dict(zip(SPLIT, (*states, act, buf), strict=True))
        ranks.append(dict(params=params, parts=parts, mem=mem))
    worst = max(ranks, key=lambda x: sum(x["mem"].values()))["mem"]
    slow = max(ranks, key=lambda x: sum(x["parts"].values()))
    compute = micro * sum(slow["parts"].values())
    pipe = compute / (1 - bubble(sched, micro, pp, v))
    # Over dp x cp ZeRO 0 all-reduces gradients; 1, 2 reduce-scatter them, gather 16-bit weights;
    # 3 (FSDP) gathers weights before each use (or once a step where kept), reduce-scatters.
    p, grad = ranks[0]["params"], 2 if prec == "fp16" else 4
    gathers = 1 if policy == "keep" and pp > 1 else (micro + 1 if pp > 1 else 2 * micro)
    dp_bytes = {0: 2 * p * grad, 3: p * (gathers * word + grad)}.get(shard, p * (grad + word))
    t_dp = ((n - 1) / n * dp_bytes / link(tp * cp, dp) + lat * sum(blocks)) * (n > 1)
    # Under a pipeline ZeRO's reduction waits for the flush (Megatron, DeepSpeed); FSDP's
    # gathers and a pipeline-free reduction hide behind the step's compute.
    exposed = max(0.0, t_dp - (0 if pp > 1 and shard < 3 else hw["overlap"] * compute))
    step = pipe + exposed
    tps = batch * s / step / hw["gpus"]
    mem = {k: x / 2**30 for k, x in worst.items()}  # GiB
    mem["overhead"] = hw["reserve"] * sum(mem.values())  # GPUS: reserve
    return dict(
        layout=dict(tp=tp, pp=pp, cp=cp, dp=dp, shard=shard, schedule=sched, stages_per_rank=v,
                    recompute=rec, precision=prec, microbatch=microbatch),
        memory_gib=sum(mem.values()), memory=mem, step_seconds=step,
        tokens_per_second_per_gpu=tps, mfu=model_flops_per_token(m) * tps / hw["peak"][prec] / 1e12,
        time=dict({k: micro * x for k, x in slow["parts"].items()}, bubble=pipe - compute,
                  dp=exposed, dp_total=t_dp),
        fits=sum(mem.values()) <= hw["mem"],
    )  # fmt: skip


def search(m, hw, batch, microbatch, fixed, policy="keep"):
    """Every layout of hw["gpus"] that fits, fastest first (the flags given stay fixed)."""
    rows, errors, gpus = [], [], hw["gpus"]
    degrees = [d for d in range(1, gpus + 1) if gpus % d == 0]
    given = [fixed[k] for k in ("tp", "pp", "cp", "dp")]  # all four: that layout, whatever
    for tp, pp, cp in itertools.product(degrees, repeat=3) if None in given else [given[:3]]:
        layout = dict(tp=tp, pp=pp, cp=cp, dp=fixed["dp"] or gpus // (tp * pp * cp))
        far = gpus % (tp * pp * cp) or tp > hw["gpus_per_node"] or cp > 16
        if (None in given and far) or any(fixed[k] not in (None, layout[k]) for k in layout):
            continue
        scheds = [("1f1b", 1), ("interleaved-1f1b", 2)] if pp > 1 else [("1f1b", 1)]
        if fixed["schedule"] and pp > 1:
            one = fixed["schedule"] in ("gpipe", "1f1b")
            scheds = [(fixed["schedule"], fixed["per_rank"] or 2 - one)]
        shards = [1, 3] if fixed["shard"] is None else [fixed["shard"]]
        recs = [fixed["recompute"]] if fixed["recompute"] else ["none", "selective", "full"]
        for shard, rec, (sched, v) in itertools.product(shards, recs, scheds):
            lay = dict(fixed, **layout, shard=shard, recompute=rec, schedule=sched, per_rank=v)
            try:
                rows.append(evaluate(m, hw, lay, batch, microbatch, policy))
            except PlanError as e:
                errors.append(e)
    if not rows and errors:
        raise errors[0]  # no layout can run: the first reason
    return sorted(rows, key=lambda r: (not r["fits"], r["step_seconds"]))


def describe(r):
    lay, t = r["layout"], r["time"]
    name = " ".join(f"{k} {lay[k]}" for k in ("tp", "pp", "cp", "dp")) + f" zero {lay['shard']}"
    name += f" {lay['schedule']} (V {lay['stages_per_rank']})" if lay["pp"] > 1 else ""
    mem = " + ".join(f"{k} {x:.1f}" for k, x in r["memory"].items())
    t = " + ".join(f"{k} {t[k]:.2f}" for k in ("compute", "tp", "cp", "pp", "bubble", "dp"))
    tps = f"{r['tokens_per_second_per_gpu']:,.0f} tokens/s a GPU, MFU {r['mfu']:.1%}"
    name += f", recompute {lay['recompute']}\n  memory {r['memory_gib']:.1f} GiB a GPU ({mem})"
    return name + f"\n  step {r['step_seconds']:.2f} s ({t} exposed), {tps}"


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--model", default="gpt", help=f"a preset ({', '.join(PRESETS)}); flags override it")
    for flag, what in [("--layers", "blocks"), ("--dim", "width"), ("--heads", "attention heads"),
                       ("--kv-heads", "key/value heads"), ("--ffn", "MLP hidden width"),
                       ("--vocab", "vocabulary"), ("--seq-len", "tokens a sequence")]:  # fmt: skip
        add(flag, type=int, help=f"the model's {what} (default: the preset's)")
    add("--mlp", choices=["gelu", "swiglu"], help="the MLP (default: the preset's)")
    add("--global-batch", type=int, default=8, help="sequences a step, all data-parallel ranks")
    add("--microbatch", type=int, default=1, help="sequences a micro-batch")
    add("--gpu", default="h100", help=f"one of {', '.join(GPUS)} (data sheet, constants)")
    add("--gpus", type=int, default=8, help="GPUs in all")
    add("--gpus-per-node", type=int, default=8, help="GPUs that share NVLink")
    add("--memory-gib", type=float, help="GiB a GPU (default: the data sheet's)")
    add("--nvlink-gbs", type=float, help="GB/s one way a GPU inside a node (data sheet's)")
    add("--network-gbs", type=float, help="GB/s one way a GPU between nodes (data sheet's)")
    for flag in ("--tp", "--pp", "--cp", "--dp"):
        add(flag, type=int, help="the degree (default: searched)")
    add("--shard", type=int, choices=[0, 1, 2, 3], help="ZeRO stage, 3 FSDP (default: searched)")
    add("--pipeline-schedule", choices=SCHEDULES, help="model_parallel.py's (default: searched)")
    add("--stages-per-rank", type=int, help="stages a pipeline rank holds (interleaved: 2)")
    add("--recompute", choices=["none", "selective", "op", "full"], help="op: torchtitan's policy")
    add("--precision", choices=["bf16", "fp16", "fp8", "fp32"], default="bf16", help="matmuls'")
    sp = "norms and residuals cut over tp too (Korthikanti et al. 2022)"
    add("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True, help=sp)
    keep = "FSDP under a pipeline: blocks gathered for the step (torchtitan's) or resharded"
    add("--fsdp-policy", choices=["keep", "reshard"], default="keep", help=keep)
    add("--top", type=int, default=5, help="layouts shown")
    add("--json", action="store_true", help="one JSON object a layout shown")
    return p.parse_args(argv)  # fmt: skip


def run(argv):
    """plan.py's answer to a list of flags: args, model, hardware, layouts (fitting, fastest)."""
    args = get_args(argv)
    if args.model not in PRESETS:
        raise PlanError(f"--model {args.model} is no preset: choose one of {', '.join(PRESETS)}")
    if args.gpu not in GPUS:
        raise PlanError(f"--gpu {args.gpu} is unknown: choose one of {', '.join(GPUS)}")
    keys = ("layers", "dim", "heads", "kv_heads", "ffn", "vocab", "seq_len", "mlp")
    m = dict(zip(keys, PRESETS[args.model], strict=True))
    m |= {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if m["dim"] % m["heads"] or m["heads"] % m["kv_heads"]:
        raise PlanError(f"--heads {m['heads']} must divide --dim {m['dim']} and be a multiple "
                        f"of --kv-heads {m['kv_heads']}")  # fmt: skip
    hw = dict(GPUS[args.gpu], name=args.gpu, gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    for key, flag in (("mem", "memory_gib"), ("nvlink", "nvlink_gbs"), ("net", "network_gbs")):
        hw[key] = getattr(args, flag) or hw[key]
    fixed = dict(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, shard=args.shard,
                 recompute=args.recompute, schedule=args.pipeline_schedule,
                 per_rank=args.stages_per_rank, precision=args.precision,
                 sp=args.sequence_parallel)  # fmt: skip
    if args.pp == 1 and not args.pipeline_schedule:
        fixed["schedule"] = "1f1b"  # no pipeline: nothing to search
    rows = search(m, hw, args.global_batch, args.microbatch, fixed, args.fsdp_policy)
    one = None not in [fixed[k] for k in ("tp", "pp", "cp", "dp", "shard", "recompute")]
    if not rows or not (rows[0]["fits"] or one):  # one layout asked for: shown, fit or not
        fit = f"no layout of {args.gpus} x {args.gpu} fits {hw['mem']:.0f} GiB a GPU"
        raise PlanError(f"{fit}: add --gpus, lower --microbatch or --seq-len, or a bigger --gpu")
    return args, m, hw, rows


def main(argv=None):
    try:
        args, m, hw, rows = run(argv)
    except PlanError as e:
        sys.exit(f"error: {e}")
    shown = rows[: args.top]
    if args.json:
        return print("\n".join(json.dumps(r) for r in shown))
    n = m["layers"] * block_params(m) + 2 * m["vocab"] * m["dim"]  # embedding and head
    print(f"{args.model}: {n / 1e9:.2f} B parameters; {hw['gpus']} x {args.gpu}; "
          f"{args.global_batch} sequences of {m['seq_len']} a step")  # fmt: skip
    if len(rows) > 1:
        print(f"{sum(r['fits'] for r in rows)} layouts fit; the fastest {len(shown)}:")
    for r in shown:
        print(("" if r["fits"] else "DOES NOT FIT: ") + describe(r))


if __name__ == "__main__":
    main()
