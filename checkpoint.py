"""Checkpoints and the files a run writes: whole-model checkpoints written atomically and read
safely (weights only, onto the CPU, one-line errors), the RNG and optimizer state to resume
exactly, the plumbing around torch.distributed.checkpoint for the sharded scripts (finding,
checking, publishing: the DCP calls themselves are in each script), metrics.jsonl."""

import contextlib
import glob
import json
import os
import random
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from common import broadcast_object, fail, first_line, is_main_process, print0, together

# One process (no process group): DCP reads and writes the checkpoint as one process, which is
# what the sharded scripts mean there, and says so at every call (even given no_dist=True).
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")


def rng_state(device):
    """The RNG states to resume with; CUDA's only on CUDA (else: a context on GPU 0 per rank)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())  # RNG states must be CPU tensors
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def load_optimizer_state(optimizer, state):
    """A checkpoint's optimizer state (the momentum) with this run's settings (--lr,
    --momentum, --weight-decay): make the scheduler after it, for this run's peak rate."""
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        params = group["params"]  # and nothing saved: a scheduler would keep its initial_lr
        group.clear()
        group.update(settings, params=params)


def atomic_write(path, write):
    """write(tmp) then rename it to `path`: a crash mid-write leaves the previous file whole."""
    path = Path(path)
    for stale in path.parent.glob(glob.escape(f".{path.name}.tmp") + "*"):
        stale.unlink(missing_ok=True)  # left by a writer that was killed
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except OSError as e:  # a full disk, say
        fail(f"could not write {path} ({e.strerror or e}); the previous one is kept")
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(state, path):  # on global rank 0 only
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def read_torch_file(path, what="checkpoint"):
    """torch.load onto the CPU (tensors saved on GPUs do not all land on GPU 0), weights only
    (a file from elsewhere cannot run code), or a one-line error naming the file."""
    if not Path(path).is_file():
        fail(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is reported the same way
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        if any("Unsupported global" in ln for ln in lines):  # it would have to call a class
            fail(f"refused to load {what} {path}: it holds pickled objects other than tensors")
        reason = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0])
        fail(f"cannot read {what} {path} (truncated or not a PyTorch file): {reason}")


def load_checkpoint(path):
    ckpt = read_torch_file(path)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        fail(f"{path} is not a checkpoint of these scripts (no 'model' state dict in it)")
    return ckpt


def load_model_state(model, state_dict, path):
    """load_state_dict with an error that says which checkpoint does not fit."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        detail = [ln.strip() for ln in str(e).splitlines() if ln.strip()][1:2] or [first_line(e)]
        fail(f"checkpoint {path} does not fit this model (another --model?): {detail[0]}")


def read_weights(path, what="weights file"):
    """A whole model's weights, read on this rank: a plain state_dict (model.pt of the sharded
    scripts, a pretrained network's) or the 'model' of a checkpoint of these scripts; and the
    flags that checkpoint recorded ({} for a plain state_dict)."""
    state, flags = read_torch_file(path, what), {}
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state, flags = state["model"], state.get("args", {})
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        why = "neither a checkpoint of these scripts nor a state_dict (names to tensors)"
        fail(f"{what} {path} is {why}")
    return state, flags


def shapes(model):  # the model's parameter and buffer names and whole shapes (DTensors too)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_weights(state, model, path):
    """Stop naming the first name or shape in `state` (a state_dict, or names to shapes) that
    does not fit `model` (which may be on the meta device, sharded: only its shapes are read)."""
    have, want = {k: tuple(getattr(v, "shape", v)) for k, v in state.items()}, shapes(model)
    for key in sorted(want.keys() | have.keys()):
        if key not in have or key not in want:
            where = "the model has no" if key in have else "the file has no"
            fail(f"{path} does not fit this model: {where} {key!r}")
        if have[key] != want[key]:
            got = f"{have[key]} in the file, {want[key]} in the model"
            fail(f"{path} does not fit this model: {key!r} is {got}")


def initial_state(build, seed, init_from=None, model=None):
    """Rank 0's whole model, in its CPU memory, to fill every rank's pieces of a sharded build
    (all ranks participate; a bad file stops every rank): built and seeded as one process
    builds it, so every layout starts from the same weights, or read from init_from (checked
    against `model`, which may be on the meta device). None on the other ranks."""

    def whole():
        if init_from:
            state, _ = read_weights(init_from, "--init-from")
            check_weights(state, model, init_from)
            return state
        random.seed(seed)  # as models.seed_everything: a copy may bring its own models.py
        torch.manual_seed(seed)
        return build().state_dict()

    return together(whole, run=is_main_process())


# Sharded checkpoints (the five sharded scripts): a torch.distributed.checkpoint directory of
# every rank's pieces, plus meta.pt (step, RNG, flags) from rank 0. The scripts call DCP's save
# and load; what is around them (finding, checking, publishing) is here.
def find_sharded(output_dir):
    """OUTPUT_DIR's checkpoint, or checkpoint.old (a save that died between its renames)."""
    found = [Path(output_dir or "", n) for n in ("checkpoint", "checkpoint.old")]
    return next((p for p in found if output_dir and (p / "meta.pt").is_file()), None)


def read_sharded_meta(path):
    if Path(path).is_file():
        why = "this script resumes from a directory of torch.distributed.checkpoint"
        fail(f"{path} is a single-file checkpoint (ddp_train.py's?); {why}")
    return read_torch_file(Path(path, "meta.pt"))  # "does not exist" for another directory


def find_checkpoint(args, model):
    """(--resume or OUTPUT_DIR's checkpoint, its meta.pt) on every rank, or (None, None): rank 0
    finds it, reads meta.pt and checks that the model saved there has the names and shapes of
    `model` (all ranks participate). Rank 0 also removes a crashed save's checkpoint.tmp."""
    if is_main_process() and args.output_dir:
        shutil.rmtree(Path(args.output_dir, "checkpoint.tmp"), ignore_errors=True)
    path = broadcast_object(args.resume or find_sharded(args.output_dir))
    if not path:
        return None, None

    def check():
        meta = read_sharded_meta(path)
        for flag in ("model", "heads", "depth"):  # not seen in the weights' shapes, or first
            if (saved := meta["args"].get(flag)) != (this := getattr(args, flag, saved)):
                fail(f"checkpoint {path} holds a --{flag} {saved}, not {this}")
        check_weights(meta["shapes"], model, path)  # --dim, --heads, --seq-len, ...
        return meta

    return path, broadcast_object(together(check, run=is_main_process()))


def sharded_meta(model, step, steps_per_epoch, global_batch, args, device):
    """meta.pt: where the run is (the step, the RNG: rank 0's, as nothing in a step draws per
    rank), what the batches were, the flags, and the model's names and shapes."""
    meta = dict(step=step, steps_per_epoch=steps_per_epoch, global_batch=global_batch)
    return dict(meta, rng=rng_state(device), args=vars(args), shapes=shapes(model))


@contextlib.contextmanager
def reading(path):
    """A shard that is missing, truncated or does not fit: one line, on every rank (DCP's load
    gathers every rank's failures and raises them on all)."""
    import torch.distributed.checkpoint as dcp

    try:
        yield
    except dcp.CheckpointException as e:
        cause = first_line(next(iter(e.failures.values()))[0])
        fail(f"cannot read checkpoint {path} (a missing or truncated shard?): {cause}")
    except Exception as e:  # noqa: BLE001 - a shape or key that does not fit, say
        fail(f"cannot read checkpoint {path}: {first_line(e)}")


class TrainState(Stateful):
    """The model and its optimizer as torch.distributed.checkpoint saves and loads them: each
    rank's own pieces (get_state_dict), and after a load, whatever the layout that saved them,
    the parts that make up this rank's pieces put in place (set_state_dict)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return dict(model=model, optimizer=optimizer)

    def load_state_dict(self, state):
        # The saved moments, with this run's settings (--lr, --weight-decay) group by group:
        # each group's own (param_groups: no decay on biases, norms, embeddings).
        groups = self.optimizer.param_groups
        own = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        pieces = dict(model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        set_state_dict(self.model, self.optimizer, **pieces)
        for group, settings in zip(self.optimizer.param_groups, own, strict=True):
            group.update(settings)


def resume_step(args, optimizer, meta, path, batches, device):
    """After the pieces are loaded (if any: else 0): check that the schedule can go on, keep
    this run's optimizer settings (--lr, ...) beside the saved moments, and return the step to
    go on after. `batches`: this run's (global batch, steps per epoch)."""
    if path is None or getattr(args, "eval_only", False):
        return 0
    saved = meta["args"]
    changed = [k for k in ("epochs", "warmup", "decay") if saved.get(k) != getattr(args, k)]
    if changed:  # the schedule is a function of these: it cannot go on where it was
        was = ", ".join(f"--{k} {saved[k]}" for k in changed)
        fail(f"{path} was trained with {was}; resume with the same, or start anew")
    for group in optimizer.param_groups:  # the schedule's peak: this run's --lr (TrainState)
        group["initial_lr"] = group["lr"]
    # The same global batch and seed make the same global batches at any layout (rank r takes
    # every world-th sample): go on after the last step saved.
    steps_per_epoch = batches[1]
    if (meta["global_batch"], meta["steps_per_epoch"], saved["seed"]) == (*batches, args.seed):
        step = meta["step"]
        set_rng_state(meta["rng"], device)
    else:  # other batches: a half-done epoch starts again, the schedule goes on
        step = meta["step"] // meta["steps_per_epoch"] * steps_per_epoch
    epoch, at = divmod(step, steps_per_epoch)
    print0(f"resumed from {path} at epoch {epoch}, step {at} of {steps_per_epoch}")
    return step


def publish_sharded(out, meta):
    """Once every rank's pieces are in OUT/checkpoint.tmp: rank 0 adds meta.pt and renames it
    to checkpoint; a crash at any point leaves the previous one whole (and the next run's
    find_checkpoint removes the half-written checkpoint.tmp)."""
    tmp, final, old = (Path(out, n) for n in ("checkpoint.tmp", "checkpoint", "checkpoint.old"))
    if is_main_process():
        atomic_write(tmp / "meta.pt", lambda path: torch.save(meta, path))
        if final.exists():  # then `old` is stale: a save killed while removing it
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)


def export_whole(model, paths, pp_group=None):
    """The whole model's state_dict, gathered into rank 0's CPU memory (all ranks participate),
    written to each path there: a file that loads without FSDP or DTensor. Returns it on rank 0
    (None elsewhere). With pp_group (nd_parallel.py's pipeline: each process holds its stages'
    pieces), each stage's gathered whole on its processes, then joined over rank 0's pipeline."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload: on rank 0 alone, which would leave a later stage's processes nothing
    options = StateDictOptions(full_state_dict=True, cpu_offload=pp_group is None)
    whole = get_model_state_dict(model, options=options)
    if pp_group is not None:
        stage = {k: v.cpu() for k, v in whole.items()}
        parts = [None] * dist.get_world_size(pp_group) if is_main_process() else None
        if dist.get_global_rank(pp_group, 0) == 0:  # the pipeline of rank 0 (the others: none)
            dist.gather_object(stage, parts, dst=0, group=pp_group)
        whole = {k: v for part in parts or [] for k, v in part.items()}

    def write():  # a bad path stops every rank
        for path in paths:
            atomic_write(path, lambda tmp: torch.save(whole, tmp))

    together(write, run=is_main_process())
    return whole if is_main_process() else None


def check_output_dir(path):
    """Create the output directory and prove it writable now, not after hours of training."""
    # A name no other process can hold: ranks on different nodes (or in containers) writing
    # one shared folder can have the same process id, and would delete each other's probe.
    probe = Path(path, f".write-test-{uuid.uuid4().hex}")
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        fail(f"output directory {path} is not writable: {e.strerror or e}")
    return probe.parent


def sharded_output(path):
    """OUTPUT_DIR (a Path, or None without one), created and proven writable by every rank, as
    each writes its own pieces there: one line on every rank if one cannot (all participate)."""
    return together(lambda: path and check_output_dir(path))


def append_metrics(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def trim_metrics(path, start_epoch):
    """On resume, drop the lines of epochs that will run again: every epoch appears once."""
    if Path(path).exists():
        lines = Path(path).read_text().splitlines()
        keep = "".join(ln + "\n" for ln in lines if json.loads(ln)["epoch"] < start_epoch)
        atomic_write(path, lambda tmp: tmp.write_text(keep))
