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
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
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


def read_torch_file(path, what="checkpoint", mmap=False):
    """torch.load onto the CPU (tensors saved on GPUs do not all land on GPU 0), weights only
    (a file from elsewhere cannot run code), or a one-line error naming the file. mmap: each
    tensor read from the file when it is used, not all of them now."""
    if not Path(path).is_file():
        fail(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
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


def read_weights(path, what="weights file", mmap=False):
    """A whole model's weights, read on this rank: a plain state_dict (model.pt of the sharded
    scripts, a pretrained network's) or the 'model' of a checkpoint of these scripts; and the
    flags that checkpoint recorded ({} for a plain state_dict)."""
    state, flags = read_torch_file(path, what, mmap), {}
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


def fill_initial(model, draw, init_from=None):
    """Fill this rank's pieces of `model` (sharded, allocated) one whole tensor at a time (all
    ranks participate): draw(name), the tensor one process starts from, or --init-from's,
    read from the file as it is needed (mmap; checked first: a bad file stops every rank).
    No rank holds more than its pieces and one whole tensor (distribute_tensor cuts it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if init_from:  # every rank reads the file's index, not its tensors
        state, _ = together(lambda: read_weights(init_from, "--init-from", mmap=True))
        together(lambda: check_weights(state, model, init_from))
        draw = state.__getitem__
    # Not strict: one tensor at a time (and a pipeline stage holds only its own names).
    each = StateDictOptions(full_state_dict=True, strict=False)
    for name in list(model.state_dict()):
        set_model_state_dict(model, {name: draw(name)}, options=each)


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


def lay_out(path, layout):
    """torch.save's file of a state_dict of `layout` (names, shapes, dtypes) without the
    tensors' bytes (skip_data, of fake tensors: no memory); returns where each tensor's bytes
    go: its record's offset in the zip (stored uncompressed, so they can be written later)."""
    with FakeTensorMode():
        fake = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in layout}
    try:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fake, path)
    except (OSError, RuntimeError) as e:  # no such directory, a full disk
        fail(f"could not write {path.parent} ({first_line(e)})")
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        # torch.save numbers the storages 0, 1, ... in the order it meets them: the dict's
        records = {i.filename.split("/", 1)[1]: i for i in archive.infolist()}
        offsets = []
        for info in (records[f"data/{k}"] for k in range(len(fake))):
            f.seek(info.header_offset + 26)  # the local header: 30 bytes, the name, an extra
            name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
            offsets.append(info.header_offset + 30 + name_len + extra_len)
    return offsets


def export_whole(model, paths, pp_group=None):
    """Write the whole model's state_dict to each of `paths` (a file plain torch.load reads)
    without gathering the model into one process (all ranks participate): rank 0 lays the
    file out, then for each tensor in turn the ranks that hold its pieces gather it whole,
    rank 0 writes its bytes in place and frees it; with pp_group (nd_parallel.py), a later
    stage's from its process in rank 0's pipeline. Returns the first path written or None."""
    paths = list(paths)
    if not paths:
        return None
    stages = range(dist.get_world_size(pp_group) if pp_group else 0)
    pipeline = [dist.get_global_rank(pp_group, s) for s in stages]  # rank 0's is [0, ...]
    in_rank0s = len(pipeline) > 1 and 0 in pipeline  # later stages' tensors come from them
    own = [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]
    layouts = [own]
    if in_rank0s:  # every stage's names, shapes and dtypes, in order
        layouts = [None] * len(pipeline) if is_main_process() else None
        dist.gather_object(own, layouts, dst=0, group=pp_group)
    tmp = Path(paths[0]).with_name(f".{Path(paths[0]).name}.export{os.getpid()}")
    offsets = together(lambda: lay_out(tmp, sum(layouts, [])), run=is_main_process())
    errors = []

    def write(tensor, at):  # rank 0; a full disk is reported after the loop, on every rank
        try:
            with open(tmp, "r+b") as f:
                f.seek(at)
                f.write(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        except OSError as e:
            errors.append(f"could not write {paths[0]} ({e.strerror or e})")

    for value in model.state_dict().values():  # this rank's stage's, gathered by its ranks
        with torch.no_grad():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
        if is_main_process():
            write(whole, offsets.pop(0))
        elif in_rank0s:  # a later stage's process in rank 0's pipeline
            dist.send(whole.detach().cpu().contiguous(), dst=0, group=pp_group)
        del whole
    for sender, layout in zip(pipeline[1:], (layouts or [])[1:], strict=False):
        for _, shape, dtype in layout:  # rank 0: the later stages', in the order they send
            dist.recv(whole := torch.empty(shape, dtype=dtype), src=sender, group=pp_group)
            write(whole, offsets.pop(0))
            del whole

    def publish():  # rank 0: the file whole under each name, or none
        try:
            if errors:
                fail(errors[0])
            for path in paths:
                atomic_write(path, lambda dst: shutil.copyfile(tmp, dst))
        finally:
            tmp.unlink(missing_ok=True)

    together(publish, run=is_main_process())
    return paths[0]


SAMPLE_BYTES = 64 * 2**20  # a model larger than this is not read back whole for a sample


def weights_for_sample(path):
    """model.pt's weights (`path`, just written) on rank 0 for its sample of text, if at most
    SAMPLE_BYTES: no process reads a larger model back whole. None elsewhere, and why."""
    if path is None:
        return print0("no sample: no model.pt written (no --output-dir or --export)")
    size = Path(path).stat().st_size if is_main_process() else 0
    if size > SAMPLE_BYTES:
        return print0(f"no sample: {path} is {size / 2**20:.0f} MiB, above {SAMPLE_BYTES >> 20}")
    return read_torch_file(path, "model.pt") if is_main_process() else None


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
