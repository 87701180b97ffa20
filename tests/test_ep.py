"""expert_parallel.py: EP 2, EP 4 and 2 x EP 2 against one process holding every expert on
the same global batch (routing, logits, losses, gradients, weights), what each rank holds,
the all-to-all sizes, resume at another degree, exact evaluation, the export, the metrics,
bad input, and the benchmark in a small form. All on CPU with gloo."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DIST_TIMEOUT,
    METRIC_KEYS,
    ROOT,
    SYNTHETIC,
    last_json,
    moe_vit,
    one_line_errors,
    read_metrics,
    run_python,
    torchrun_workers,
)
from torch.utils.data import DistributedSampler

import common
import data
import expert_parallel
import models
import training

GLOBAL_BATCH = 12  # 1 x 12; EP 2: 2 x 6; EP 4 and 2 x EP 2: 4 x 3
STEPS = 4
BLOCKS, EXPERTS, K, TOKENS = 4, 8, 2, 16  # the defaults; 16 tokens an image (28 px, 7 x 7)
# AdamW steps that move the weights far beyond the tolerances, with clipping at work (the
# gradient norms are above 0.5) so that the global norm is checked as well; a capacity
# factor of 1 drops some choices in every block; a balancing loss large enough to matter.
FAST = [*SYNTHETIC, "--warmup", "0", "--lr", "0.2", "--clip-grad", "0.05", *DIST_TIMEOUT]
FAST += ["--capacity-factor", "1", "--aux-loss-weight", "0.1"]


def probe(nproc, reports, *flags):
    """tests/ep_probe.py on nproc processes (one: a plain `python`, every expert): every
    rank's report, and the output directory."""
    out = Path(reports) / "out"
    argv = ["tests/ep_probe.py", reports, "--", *FAST, "--max-steps", str(STEPS)]
    argv += ["--batch-size", str(GLOBAL_BATCH // nproc), "--output-dir", out, *flags]
    run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    reports = [torch.load(Path(reports, f"rank{r}.pt"), weights_only=False) for r in range(nproc)]
    return reports, out


def whole(out):
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


def initial():
    models.seed_everything(0)  # what expert_parallel.py builds first
    return moe_vit(EXPERTS, K, 1.0).state_dict()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, every expert, batch 12, STEPS steps."""
    return probe(1, tmp_path_factory.mktemp("ep_reference"))


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """EP 2 (2 processes of 6 samples, 4 experts each): a checkpoint in two ranks' pieces."""
    tmp = tmp_path_factory.mktemp("ep2")
    return probe(2, tmp, "--export", tmp / "exported.pt")


def by_image(t):  # a routing tensor (tokens, k) as (images, tokens, k)
    return t.view(-1, TOKENS, K)


def assert_same_steps(got, reference):
    """Step by step: each rank's routing, logits and losses for its samples (rank r of W holds
    the global batch's samples r, r + W, ...); the mean of the ranks' losses (cross-entropy and
    balancing) is the one process's; every parameter's whole gradient, router and experts
    included, the same on every rank; then the weights saved at the end. Gradients and weights
    as whole tensors: the difference at most 1e-4 of the norm (as in tests/test_tp.py)."""
    (ranks, out), ([ref], ref_out) = got, reference
    world = len(ranks)
    assert len(ref["losses"]) == STEPS and len(ref["routes"]) == STEPS * BLOCKS
    for step in range(STEPS):
        for r, seen in enumerate(ranks):
            logits, labels = ref["logits"][step][r::world], ref["labels"][step][r::world]
            assert torch.equal(seen["labels"][step], labels), step  # the same samples
            torch.testing.assert_close(seen["logits"][step], logits, atol=1e-5, rtol=1e-4)
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1).item()
            assert seen["losses"][step] == pytest.approx(loss, abs=1e-5), step
            for block in range(BLOCKS):
                (expert, kept), at = ref["routes"][step * BLOCKS + block], step * BLOCKS + block
                assert torch.equal(by_image(seen["routes"][at][0]), by_image(expert)[r::world])
                assert torch.equal(by_image(seen["routes"][at][1]), by_image(kept)[r::world])
        aux = torch.tensor([seen["aux"][step] for seen in ranks]).mean(0)
        torch.testing.assert_close(aux, torch.tensor(ref["aux"][step]), atol=1e-6, rtol=1e-5)
        ref_grads = ref["grads"][step]
        for seen in ranks:
            grads = seen["grads"][step]
            assert grads.keys() == ref_grads.keys()
            for name, g in ref_grads.items():
                assert g.norm() > 0, name  # the test can fail: every tensor has a gradient
                assert (grads[name] - g).norm() <= 1e-4 * g.norm(), (step, name)
        norms = [s["norms"][step] for s in ranks]
        assert norms == pytest.approx([ref["norms"][step]] * world, rel=1e-5)
    assert min(ref["norms"]) > 0.5  # above --clip-grad: clipping scaled every step
    kept = torch.stack([k for _, k in ref["routes"]])
    assert 0 < (~kept).sum() < kept.numel() / 2  # some choices dropped, most kept
    last, ref_last = read_metrics(out)[-1], read_metrics(ref_out)[-1]
    assert last["test_loss"] == pytest.approx(ref_last["test_loss"], abs=1e-4)
    assert last["test_acc"] == pytest.approx(ref_last["test_acc"], abs=1.1 / 499)
    # metrics.jsonl: per block, the choices each expert took and those dropped, over all ranks
    routes = ref["routes"]
    for block in range(BLOCKS):
        expert = torch.cat([routes[s * BLOCKS + block][0] for s in range(STEPS)])
        kept = torch.cat([routes[s * BLOCKS + block][1] for s in range(STEPS)])
        took = torch.bincount(expert[kept], minlength=EXPERTS).tolist()
        assert last["expert_tokens"][block] == ref_last["expert_tokens"][block] == took
        assert last["dropped_tokens"][block] == (~kept).sum().item()
    a, b, start = whole(out), whole(ref_out), initial()
    assert a.keys() == b.keys() == start.keys()
    for key in b:
        update = (b[key] - start[key]).norm()
        assert update > 1e-3, key  # the steps moved every tensor, well beyond the tolerance
        assert (a[key] - b[key]).norm() < 1e-3 * update, key


def assert_sizes_match_routing(got, reference, ep):
    """Each all-to-all of rows sends, to each rank of the EP group, as many rows as this
    rank's tokens chose (and kept) experts there, and receives as many as the group's other
    ranks' tokens chose experts here; the second returns them (sizes swapped)."""
    (ranks, _), ([ref], _) = got, reference
    world, mine = len(ranks), EXPERTS // ep
    for r, seen in enumerate(ranks):
        group = [r // ep * ep + i for i in range(ep)]  # its EP group: consecutive ranks
        assert len(seen["sizes"]) >= 2 * STEPS * BLOCKS
        for at in range(STEPS * BLOCKS):
            expert, kept = (by_image(t) for t in ref["routes"][at])

            def rows(src, dst, expert=expert, kept=kept):  # src tokens to dst experts
                e, k = expert[src::world], kept[src::world]
                return (k & (e // mine == dst % ep)).sum().item()

            send, recv = seen["sizes"][2 * at]
            assert send == [rows(r, d) for d in group], at
            assert recv == [rows(s, r) for s in group], at
            assert seen["sizes"][2 * at + 1] == (recv, send)


def assert_each_rank_holds_its_experts(got, ep):
    """Rank r holds experts (r mod ep) x E/ep onwards, of every block: those experts' weights
    as in model.pt, and AdamW state of their shape; every other tensor whole. No process
    built the whole model in memory: both builds on the meta device (the model trained, and
    the shapes its initial tensors are drawn from, one at a time)."""
    ranks, out = got
    full, mine = whole(out), EXPERTS // ep
    for r, seen in enumerate(ranks):
        assert seen["builds"] == ["meta", "meta"], (r, seen["builds"])
        first = r % ep * mine
        assert len(seen["pieces"]) == len(full)
        for name, shape, piece, state in seen["pieces"]:
            assert list(full[name].shape) == shape
            expected = full[name]
            if name.split(".")[-1] in ("w1", "b1", "w2", "b2"):
                assert shape[0] == EXPERTS
                expected = expected[first : first + mine]
            assert torch.equal(piece, expected), (r, name)
            assert state == [list(piece.shape)] * 2, (r, name)


def test_ep2_takes_the_steps_of_one_process(ep2, reference):
    assert_same_steps(ep2, reference)
    assert_sizes_match_routing(ep2, reference, 2)
    assert_each_rank_holds_its_experts(ep2, 2)
    _, out = ep2
    assert read_metrics(out)[-1].keys() >= METRIC_KEYS | {"step", "world_size", "ep"}
    exported = torch.load(out.parent / "exported.pt", weights_only=True)
    assert exported.keys() == whole(out).keys()
    assert all(torch.equal(exported[k], whole(out)[k]) for k in exported)  # --export: the same


@pytest.mark.slow
def test_ep4_takes_the_steps_of_one_process(tmp_path, reference):
    run = probe(4, tmp_path)
    assert_same_steps(run, reference)
    assert_sizes_match_routing(run, reference, 4)
    assert_each_rank_holds_its_experts(run, 4)


@pytest.mark.slow
def test_two_replicas_of_ep2_take_the_steps_of_one_process(tmp_path, reference):
    """4 processes, --ep 2: ranks 0 and 2 hold experts 0-3, ranks 1 and 3 experts 4-7; each
    expert's gradient averaged over its two holders too."""
    run = probe(4, tmp_path, "--ep", "2")
    assert_same_steps(run, reference)
    assert_sizes_match_routing(run, reference, 2)
    assert_each_rank_holds_its_experts(run, 2)


@pytest.mark.slow
def test_resume_at_another_degree_ends_where_one_run_ends(tmp_path, reference):
    """EP 2 stops after 2 of 4 steps; EP 4 goes on from its pieces (the experts re-placed),
    mid-epoch, and ends with the weights of the uninterrupted single process."""
    out = tmp_path / "run"
    argv = ["expert_parallel.py", *FAST, "--output-dir", out, "--max-steps", str(STEPS)]
    torchrun_workers(2, [*argv, "--batch-size", "6", "--max-steps", "2"])
    proc = torchrun_workers(4, [*argv, "--batch-size", "3"])
    assert "at epoch 0, step 2 of" in proc.stdout, proc.stdout
    a, b = whole(out), whole(reference[1])
    for key, start in initial().items():
        assert (a[key] - b[key]).norm() < 1e-3 * (b[key] - start).norm(), key


def eval_only(nproc, checkpoint, *flags):
    # Test batches of 2 x 62: at 4 processes the ranks hold 125, 125, 125 and 124 of the 499
    # test samples, in 2, 2, 2 and 1 batches: rank 3 runs an empty one (forward exchanges rows)
    argv = ["expert_parallel.py", *SYNTHETIC, "--batch-size", "62", *flags]
    argv += ["--eval-only", "--resume", checkpoint, "--capacity-factor", "1"]
    proc = run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval ")]
    loss, acc = line.split("test_loss ")[1].split(" test_acc ")
    return float(loss), float(acc.split()[0])


@pytest.mark.slow
def test_evaluation_is_exact_at_every_degree_and_the_export_loads_alone(ep2):
    """model.pt in one process with every expert, at a batch of 256: the accuracy of
    metrics.jsonl; --eval-only of the checkpoint at 1 and 2 processes (EP 1, 2), and at 4 as
    2 x EP 2 (the ranks' numbers of batches uneven), the same. (EP 4's evaluation: the test
    loss and accuracy that test_ep4_... compares with one process's.)"""
    _, out = ep2
    model = moe_vit(EXPERTS, K, 1.0)
    model.load_state_dict(whole(out))
    _, test_set, _, _ = data.load_datasets("synthetic", "data")
    loader = torch.utils.data.DataLoader(test_set, 256, collate_fn=data.collate)
    loss, acc = training.evaluate(model, loader, torch.device("cpu"))
    assert read_metrics(out)[-1]["test_acc"] == acc
    assert read_metrics(out)[-1]["test_loss"] == pytest.approx(loss, abs=1e-6)
    expected = pytest.approx((round(loss, 4), round(acc, 4)), abs=1.1e-4)
    for nproc, flags in [(1, []), (2, []), (4, ["--ep", "2"])]:
        assert eval_only(nproc, out / "checkpoint", *flags) == expected, (nproc, flags)


@pytest.mark.parametrize(
    "flags, world, expected",
    [
        (["--experts", "6"], 4, "EP degree 4 does not divide the 6 experts"),
        (["--ep", "2"], 3, "EP degree 2 does not divide the 3 processes"),
        (["--ep", "2"], 1, "EP degree 2 does not divide the 1 processes"),
    ],
)
def test_impossible_ep_degree_is_refused_before_any_collective(no_launcher, flags, world, expected):
    """Checked by every rank alike before the mesh is made, so one pretended rank shows it."""
    info = common.DistInfo(world > 1, 0, 0, world, world, torch.device("cpu"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_parallel, "init_distributed_mode", lambda **_: info)
        patch.setattr(expert_parallel, "init_device_mesh", None)  # reached: a TypeError
        with pytest.raises(SystemExit, match=expected):
            expert_parallel.main([*FAST, *flags])


@pytest.mark.slow
def test_ep_degree_that_does_not_divide_the_experts_is_one_line_on_every_rank():
    errors = one_line_errors("expert_parallel.py", [*FAST, "--experts", "3"])
    assert all("EP degree 2 does not divide the 3 experts" in e for e in errors), errors


def test_refusals(no_launcher):
    for flags, expected in [
        (["--top-k", "3", "--experts", "2"], "--top-k 3 is more than the 2 experts"),
        (["--capacity-factor", "0"], "--capacity-factor must be positive"),
        (["--ep", "0"], "--ep must be at least 1"),
        (["--aux-loss-weight", "-1"], "--aux-loss-weight cannot be negative"),
    ]:
        with pytest.raises(SystemExit, match=expected):
            expert_parallel.get_args(flags)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_line_on_every_rank(tmp_path, ep2):
    """Asked of a checkpoint it does not fit. (A single-file checkpoint and a missing piece are
    checkpoint.find_checkpoint's checks, the same for the sharded scripts: test_fsdp.py.)"""
    out = tmp_path / "out"
    argv = [*FAST, "--experts", "4", "--resume", ep2[1] / "checkpoint", "--output-dir", out]
    argv += ["--batch-size", "6", "--dist-timeout", "100"]
    errors = one_line_errors("expert_parallel.py", argv)
    shape = "'blocks.0.mlp.b1' is (8, 192) in the file, (4, 192) in the model"
    assert shape in errors[0] and len(set(errors)) == 1, errors
    assert not out.exists() or not any(out.iterdir())  # nothing written


EMPTY = """
import json, sys, types, torch, torch.distributed as dist
import common, expert_parallel as ep
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
x = torch.randn(2 * world, 4, 8).abs()  # 2 images a rank, 4 tokens, 8 features: all positive


def build():  # 4 experts, top 2, room for every choice; the router picks experts 0 and 1 only
    torch.manual_seed(1)
    moe = ep.MoE(8, 4, 2, 4.0).eval()  # eval: no balancing loss, routing alone
    with torch.no_grad():
        ep.init_weights(moe)  # the experts are drawn by name (with_experts does it in a model)
        w = moe.router.weight.abs_()
        w[2:] *= -1
    return moe


ref = build()
(ref(x) ** 2).sum().backward()  # one process, every expert, every image
moe, mesh = build(), init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
ep.shard_experts(types.SimpleNamespace(blocks=[types.SimpleNamespace(mlp=moe)]), mesh)
sizes = []
real = ep.all_to_all_single_autograd
ep.all_to_all_single_autograd = lambda h, recv, send, g: sizes.append((send, recv)) or real(
    h, recv, send, g
)
y = moe(x[2 * rank : 2 * rank + 2])
(y**2).sum().backward()  # this rank's part of the same sum
ep.average_gradients(moe, mesh, world)  # the mean over the ranks: world x it is the sum
diff = {"output": (y - ref(x)[2 * rank : 2 * rank + 2]).abs().max().item()}
for name, p in moe.named_parameters():
    mine = ep.local(p.grad) * world
    full = ref.get_parameter(name).grad
    full = full.chunk(world)[rank] if name in ("w1", "b1", "w2", "b2") else full
    diff[name] = [(mine - full).abs().max().item(), mine.abs().sum().item()]
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:  # not stdout: the ranks' lines mix
    json.dump(dict(rank=rank, diff=diff, sizes=sizes), f)
common.cleanup()
"""


@pytest.mark.slow
def test_experts_that_receive_no_token_match_one_process(tmp_path):
    """Every token picks experts 0 and 1 (rank 0's): rank 1 sends all its rows, receives none,
    runs its experts on nothing. The outputs and every gradient equal one process's; the idle
    experts' gradients are zeros (stacked with the busy ones: never None)."""
    torchrun_workers(2, ["-c", EMPTY, tmp_path])  # torchrun's 2 workers, forked
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        diff, rows = r["diff"], 2 * 4 * 2  # each rank: 2 images x 4 tokens x 2 choices
        assert diff.pop("output") < 1e-6
        for name, (d, size) in diff.items():
            assert d < 1e-5, (r["rank"], name)
            idle = r["rank"] == 1 and name in ("w1", "b1", "w2", "b2")
            assert (size == 0) == idle, (r["rank"], name)
        sent = [[rows, 0], [rows, rows]] if r["rank"] == 0 else [[rows, 0], [0, 0]]
        assert r["sizes"] == [sent, sent[::-1]], r  # (sent, received) per rank, twice


@pytest.mark.slow
def test_benchmark_counts_the_bytes_each_process_sends():
    """benchmarks/expert_parallel.py at 2 processes, 4 samples each, one step: EP all-reduces
    only the whole tensors (its experts are half of them, each on one process); DDP all of
    the MoE's; the all-to-alls send at most every choice's row out and back, forward and
    backward, in every block."""
    argv = ["benchmarks/expert_parallel.py", "--worlds", "2", "--steps", "1", "--batch-size", "4"]
    rows = {}
    for line in run_python(argv).stdout.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[1]] = [float(c) for c in cells[2:7]]  # params, a2a, all-reduce, sent, ms
    ep, moe, dense = rows["moe ep"], rows["moe ddp"], rows["dense ddp"]
    model = moe_vit(EXPERTS, K, 1.25)
    mb = lambda n: pytest.approx(n * 4 / 2**20, abs=0.002)  # noqa: E731 - printed to 0.001
    experts = sum(
        p.numel() for n, p in model.named_parameters() if n[-2:] in ("w1", "b1", "w2", "b2")
    )
    everything = sum(p.numel() for p in model.parameters())
    assert ep[0] == mb(everything - experts / 2) and moe[0] == mb(everything)
    assert ep[2] == mb(everything - experts) and moe[2] == mb(everything)  # ring, 2 processes
    assert dense[2] == mb(sum(p.numel() for p in models.ViT(1, 10, 28).parameters()))
    bound = BLOCKS * 2 * 2 * (4 * TOKENS * K) * 96  # rows of 96 numbers, at most all sent
    assert 0 < ep[1] <= bound * 4 / 2**20 and moe[1] == dense[1] == 0
    # Seeded, so the same each run: 0.43 of the bound (some choices dropped, about half of the
    # rest to the other process); forward alone, without backward, counted 0.22.
    assert ep[1] > 0.3 * bound * 4 / 2**20
    assert ep[3] == pytest.approx(ep[1] + ep[2], abs=0.002) and min(r[4] for r in rows.values()) > 0


@pytest.mark.slow
def test_each_epoch_takes_a_new_order(tmp_path):
    """EP 2 over 2 epochs of 2 steps (500 images a rank): each step's labels are those of
    DistributedSampler's order for that step's epoch on that rank, and epoch 1's differ from
    epoch 0's (without set_epoch every epoch would repeat epoch 0's)."""
    out = tmp_path / "out"
    argv = ["tests/ep_probe.py", tmp_path, "--", *FAST, "--epochs", "2", "--max-steps", "0"]
    torchrun_workers(2, [*argv, "--batch-size", "500", "--output-dir", out])
    labels = data.load_datasets("synthetic", "data")[0].labels
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["labels"]
        assert len(seen) == 4 and not torch.equal(seen[2], seen[0])
        sampler = DistributedSampler(range(len(labels)), 2, rank, seed=0, drop_last=True)
        for step, got in enumerate(seen):
            sampler.set_epoch(step // 2)
            order = list(sampler)[(step % 2) * 500 : (step % 2 + 1) * 500]
            assert torch.equal(got, labels[order]), (rank, step)


@pytest.mark.parametrize("samples, tokens", [(3, 16), (2, 32)], ids=["images", "text"])
def test_an_expert_takes_at_most_c_of_a_samples_choices_first_choices_first(samples, tokens):
    """The capacity rule itself, against the rule written out here choice by choice: an expert
    takes at most C = ceil(capacity factor x k x tokens / E) of a sample's choices (an image's
    16 patches, a sequence's 32 bytes), every first choice before any second, in token order;
    the rest are dropped. One process and N share route(), so the parity tests cannot see
    the rule itself (C + 1 passes them all)."""
    torch.manual_seed(0)
    moe = expert_parallel.MoE(96, EXPERTS, K, 1.0)
    _, expert, _, kept = moe.route(torch.randn(samples, tokens, 96))
    expert, kept = expert.view(samples, tokens, K), kept.view(samples, tokens, K)
    capacity = math.ceil(1.0 * K * tokens / EXPERTS)
    for s in range(samples):
        want, taken = torch.zeros(tokens, K, dtype=torch.bool), [0] * EXPERTS
        for choice in range(K):  # every first choice, in token order, then every second
            for t in range(tokens):
                e = expert[s, t, choice].item()
                want[t, choice], taken[e] = taken[e] < capacity, taken[e] + (taken[e] < capacity)
        assert torch.equal(kept[s], want), s
    assert kept.any() and not kept.all()  # the rule binds: some choices dropped, most kept


SYNCS = """
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.device_mesh import init_device_mesh
import expert_parallel as ep, models
aten = torch.ops.aten
# What makes the host wait for a GPU: a value read (item, tolist), a size only the device
# knows (nonzero and boolean indexing, bincount, repeat_interleave without output_size).
WAITS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.bincount.default,
         aten.masked_select.default, aten.unique_consecutive.default}
class Waits(TorchDispatchMode):
    count = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func is aten.index.Tensor and any(
            getattr(i, "dtype", None) is torch.bool for i in args[1])
        unsized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        Waits.count += func in WAITS or bool_index or unsized
        return func(*args, **kwargs)
real_tolist = torch.Tensor.tolist
def tolist(self):  # on CUDA one copy to the host and a wait (not dispatched on a CPU)
    Waits.count += 1
    return real_tolist(self)
torch.Tensor.tolist = tolist
sent = []  # the dtype of every row exchanged
real_a2a = ep.all_to_all_single_autograd
ep.all_to_all_single_autograd = lambda h, *a: sent.append(h.element_size()) or real_a2a(h, *a)
counted = []  # the exchanges of counts (plain all_to_all_single: no autograd)
real_counts = dist.all_to_all_single
dist.all_to_all_single = lambda *a, **k: counted.append(1) or real_counts(*a, **k)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "ep"))
report = {}
for name, amp in (("fp32", False), ("bf16", True)):
    torch.manual_seed(0)
    model = ep.with_experts(models.GPT(256, 32, 96, depth=2, heads=4), 8, 2, 1.25)
    ep.shard_experts(model, mesh)
    tokens = torch.randint(0, 256, (4, 32))
    moes = [block.mlp for block in model.blocks]
    sent[:], counted[:] = [], []
    with Waits():
        Waits.count = 0
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = model(tokens).float().square().mean() + ep.balance_loss(moes)
        loss.backward()
    report[name] = dict(waits=Waits.count, blocks=len(moes), sent=list(sent), counts=len(counted))
if dist.get_rank() == 0:
    print(json.dumps(report))
dist.destroy_process_group()
"""


def test_one_host_sync_per_layer_and_bf16_rows_under_amp(tmp_path):
    """EP 2, a 2-block MoE GPT, one forward and backward: at most one wait for the device per
    layer (the all-to-all's sizes), counted from the operations that make a GPU's host wait;
    under --amp bf16 the rows travel in bf16 both ways (half the bytes), else in fp32; three
    all-to-alls a layer forward (the docstring's): the counts, the rows, the outputs."""
    (tmp_path / "syncs.py").write_text(SYNCS)
    proc = torchrun_workers(2, [tmp_path / "syncs.py", ROOT])
    report = last_json(proc.stdout)
    for name, size in (("fp32", 4), ("bf16", 2)):
        got = report[name]
        assert got["waits"] <= got["blocks"], got
        assert got["sent"] == [size] * 2 * got["blocks"], got  # out and back, each block
        assert got["counts"] == got["blocks"], got  # and the counts first: three all-to-alls
