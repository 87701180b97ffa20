"""Int8 quantization of a trained model: size, speed and accuracy against fp32 in one table.

Int8 stores each weight as an 8-bit integer with a float scale (per output channel here) and
runs int8 kernels: a quarter of the memory per weight and, on CPUs with int8 dot-product
instructions, more arithmetic per cycle. Three ways, from least to most effort:

    dynamic int8  Linear weights int8 ahead of time, activations quantized on the fly per batch.
                  Needs no data; for Linear-heavy models (MLPs, LSTMs, transformers).
    static int8   weights and activations int8, activation ranges measured beforehand on a few
                  training batches (calibration): for CNNs. Best at large batches: per call it
                  adds fixed costs (quantizing the input) that a single image feels most.
    QAT int8      (--qat-steps N) a short fine-tune with the rounding simulated in the forward
                  pass, so the weights adapt to it: for when static int8 loses too much accuracy.

One CPU process (these int8 kernels run on CPUs), after any training script:
    python ddp_train.py --output-dir runs/ddp                # or torchrun ...
    python quantize.py --checkpoint runs/ddp/checkpoint.pt  # with the --model it trained
    python quantize.py --checkpoint runs/ddp/checkpoint.pt --qat-steps 200 --threads 1 \\
        --json runs/q/results.json --output-dir runs/q     # reload: quantize.load_int8(path)
    python fsdp_train.py --model mlp --output-dir runs/fsdp  # or torchrun ...
    python quantize.py --checkpoint runs/fsdp/model.pt --model mlp   # a state_dict: its --model
    python quantize.py                          # no checkpoint: trains a float model first

--checkpoint: a DDP-family checkpoint.pt (its --model recorded) or a plain state_dict. FX graph
mode (torch.ao.quantization, used here) is deprecated for torchao's PT2E flow: the same steps.
"""

import copy
import io
import itertools
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import get_default_qat_qconfig_mapping as qat_qconfig
from torch.ao.quantization import get_default_qconfig_mapping as static_qconfig
from torch.ao.quantization import quantize_dynamic
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx, prepare_qat_fx
from torch.utils.data import DataLoader
from tqdm import tqdm

from checkpoint import (
    atomic_write,
    check_output_dir,
    load_checkpoint,
    load_model_state,
    read_weights,
    save_checkpoint,
)
from common import ArgumentParser, check_flags, fail
from data import DATASETS, collate, load_datasets
from models import MODELS, build_model, seed_everything

# torch.ao.quantization warns on every call that it is deprecated, and so do the quantized
# tensor types (also when torch.load rebuilds them); its x86 defaults warn about reduce_range,
# kept on purpose (it avoids int16 overflow on CPUs without VNNI). Only these are silenced.
warnings.filterwarnings("ignore", "torch.ao.quantization is deprecated", DeprecationWarning)
warnings.filterwarnings("ignore", "torch.quantize_per_tensor, torch.quantize_per_channel")
warnings.filterwarnings("ignore", "Please use quant_min and quant_max", UserWarning)
warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    arg = p.add_argument
    arg("--checkpoint", help="checkpoint.pt or model.pt of a training script; none: train here")
    # ImageFolder is left out: its images live on disk at their own size (not the MLP's 28x28).
    in_memory = [d for d in DATASETS if d != "imagefolder"]
    arg("--data", default="fashion-mnist", choices=in_memory, help="data set")
    arg("--data-dir", default="data", help="root holding the data set (torchvision layout)")
    arg("--download", action="store_true", help="download the data set if missing")
    arg("--model", default="cnn", choices=sorted(MODELS), help="network; as in the checkpoint")
    arg("--epochs", type=int, default=2, help="without --checkpoint: epochs of float training")
    arg("--lr", type=float, default=0.1, help="without --checkpoint: peak rate per 256 samples")
    arg("--batch-size", type=int, default=256, help="training, calibration, evaluation, speed")
    arg("--calib-batches", type=int, default=2, help="training batches that calibrate static int8")
    arg("--qat-steps", type=int, default=0, help="quantization-aware fine-tuning steps; 0: no QAT")
    arg("--qat-lr", type=float, default=1e-3, help="QAT's rate (small: the weights are trained)")
    arg("--runs", type=int, default=50, help="timed calls per model and batch size, after warm-up")
    arg("--threads", type=int, help="CPU threads for everything (default: torch's)")
    arg("--seed", type=int, default=0, help="seed for training and the calibration images")
    arg("--json", help="also write the results to this JSON file")
    arg("--output-dir", help="where model_int8.pt (static int8) goes; none: save nothing")
    args = p.parse_args(argv)
    at_least_1 = ("epochs", "batch_size", "calib_batches", "runs", "threads")
    check_flags(args, at_least_1, not_negative=("qat_steps",), positive=("lr", "qat_lr"))
    return args


def train(model, loader, steps, lr):
    """Plain SGD for `steps` batches with a linearly decaying rate: the float model when no
    checkpoint is given (ddp_train.py is the real recipe), and the QAT fine-tune."""
    model.train()
    sgd = dict(lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    optimizer = torch.optim.SGD(model.parameters(), **sgd)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    # Epochs back to back, `steps` batches in all.
    batches = itertools.islice((b for _ in itertools.count() for b in loader), steps)
    for images, labels in tqdm(batches, total=steps, mininterval=1.0, leave=False):
        loss = F.cross_entropy(model(images.contiguous(memory_format=torch.channels_last)), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
    return model.eval()


def static_int8(model, calib_batches, engine):
    """Post-training static quantization in FX graph mode. prepare_fx traces the model into a
    graph, fuses conv-bn-relu (BatchNorm folds into the conv's weights) and puts an observer on
    every activation; the calibration batches record each activation's range; convert_fx swaps
    in int8 modules with those scales. Tracing is why the same call works for every model here
    (a ResNet's residual adds too) without QuantStub/DeQuantStub edits to the model code."""
    # The engine's defaults: int8 weights per output channel (one scale per filter keeps small
    # filters precise), activations calibrated with a histogram that ignores rare outliers.
    example = (calib_batches[0],)
    prepared = prepare_fx(copy.deepcopy(model).eval(), static_qconfig(engine), example)
    with torch.no_grad():
        for images in calib_batches:
            prepared(images)
    return convert_fx(prepared)


def qat_int8(model, loader, steps, lr, engine):
    """Quantization-aware training: the graph gets fake-quantize ops (round to the int8 grid and
    back to float) on weights and activations, so a short fine-tune lets the weights settle
    where rounding costs least; then the same convert_fx as static quantization."""
    example = (next(iter(loader))[0],)
    prepared = prepare_qat_fx(copy.deepcopy(model).train(), qat_qconfig(engine), example)
    return convert_fx(train(prepared, loader, steps, lr))


def load_int8(path):
    """Rebuild the static int8 model that --output-dir saved: the same FX graph (calibrated on a
    placeholder batch), then the saved int8 weights, scales and zero points over it."""
    ckpt = load_checkpoint(path)
    if "engine" not in ckpt:
        fail(f"{path} is not an int8 model saved by quantize.py --output-dir")
    torch.backends.quantized.engine = ckpt["engine"]
    shape = ckpt["input_shape"]
    model = build_model(ckpt["model_name"], shape[1], ckpt["num_classes"], image_size=shape[-1])
    qmodel = static_int8(model, [torch.zeros(shape)], ckpt["engine"])
    load_model_state(qmodel, ckpt["model"], path)
    return qmodel


def size_mb(model):
    """Bytes of the serialized state_dict, what a checkpoint of it takes on disk (1 MB = 10^6)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell() / 1e6


@torch.inference_mode()
def predictions(model, loader):
    """The argmax of every test image (accuracy, and agreement with fp32, come from these)."""
    nhwc = torch.channels_last
    return torch.cat([model(x.contiguous(memory_format=nhwc)).argmax(1) for x, _ in loader])


@torch.inference_mode()
def time_models(models, shapes, runs):
    """Median seconds per call of every model at every input shape. The models take turns,
    call by call, so a slow moment of the machine (another process, a clock change) hits all
    alike and the ratios stay fair; the order rotates every round, so no model always runs
    right after the same other one. One shape at a time: large batches in between would
    evict the weights that back-to-back batch-1 calls keep in the caches."""
    seconds = {}
    names = list(models)
    for i, shape in enumerate(shapes):
        x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        for model in models.values():
            for _ in range(3):  # warm-up: the first calls choose kernels and allocate buffers
                model(x)
        for r in range(runs):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                models[name](x)
                seconds.setdefault((name, i), []).append(time.perf_counter() - start)
    return {key: statistics.median(times) for key, times in seconds.items()}


def main(argv=None):
    args = get_args(argv)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # each would quantize and write the same files
        fail("quantize.py runs as one process: start it with python, not torchrun")
    if args.threads:
        torch.set_num_threads(args.threads)
    # x86 (fbgemm + oneDNN) on Intel/AMD, qnnpack on ARM. The engine is chosen before
    # quantizing: the qconfig (e.g. reduce_range) and the packed weight layout depend on it.
    engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "qnnpack"
    torch.backends.quantized.engine = engine
    seed_everything(args.seed)

    data = load_datasets(args.data, args.data_dir, args.download)
    train_set, test_set, num_classes, channels = data
    kw = dict(batch_size=args.batch_size, collate_fn=collate)
    shuffle = dict(shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    train_loader = DataLoader(train_set, drop_last=True, **shuffle, **kw)
    test_loader = DataLoader(test_set, **kw)
    model = build_model(args.model, channels, num_classes, image_size=test_set.images.shape[-1])
    if args.checkpoint:
        state, flags = read_weights(args.checkpoint, "checkpoint")  # weights_only, on the CPU
        if (trained := flags.get("model")) and trained != args.model:  # the scripts record it
            fail(f"{args.checkpoint} holds a {trained!r} model; pass --model {trained}")
        load_model_state(model, state, args.checkpoint)
    # Inputs good: only now are folders made (and proven writable) and anything written.
    out = check_output_dir(args.output_dir) if args.output_dir else None
    if args.json:
        check_output_dir(Path(args.json).absolute().parent)

    # channels_last as in ddp_train.py: oneDNN's fastest fp32 convolutions, and the NHWC layout
    # that the int8 convolutions use inside anyway.
    model = model.to(memory_format=torch.channels_last).eval()
    if not args.checkpoint:
        print(f"no --checkpoint: training a float {args.model} for {args.epochs} epoch(s) first")
        lr = args.lr * args.batch_size / 256  # the rate scales with the batch, as elsewhere
        model = train(model, train_loader, args.epochs * len(train_loader), lr)

    models = {"fp32": model}
    # Dynamic: only Linear layers have dynamic int8 kernels. A CNN spends its time in the
    # convolutions, which stay fp32, so there it saves little; an MLP is almost all Linear.
    models["dynamic int8"] = quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    calib = [images for images, _ in itertools.islice(train_loader, args.calib_batches)]
    models["static int8"] = static_int8(model, calib, engine)
    if args.qat_steps:
        print(f"QAT: {args.qat_steps} fine-tuning steps with fake quantization")
        models["QAT int8"] = qat_int8(model, train_loader, args.qat_steps, args.qat_lr, engine)

    labels = torch.cat([y for _, y in test_loader])
    preds = {name: predictions(m, test_loader) for name, m in models.items()}
    big = (args.batch_size, *test_set.images.shape[1:])
    timing = time_models(models, [(1, *big[1:]), big], args.runs)
    rows = []
    for name, m in models.items():
        row = dict(method=name, size_mb=size_mb(m), latency_ms=timing[name, 0] * 1e3)
        row.update(throughput=args.batch_size / timing[name, 1])
        row.update(accuracy=(preds[name] == labels).double().mean().item())
        row.update(agreement=(preds[name] == preds["fp32"]).double().mean().item())
        fp32 = rows[0] if rows else row  # ratios against fp32, measured here side by side
        row.update(size_ratio=row["size_mb"] / fp32["size_mb"])
        row.update(latency_speedup=fp32["latency_ms"] / row["latency_ms"])
        row.update(throughput_speedup=row["throughput"] / fp32["throughput"])
        row.update(accuracy_delta=row["accuracy"] - fp32["accuracy"])
        rows.append(row)
    print(
        f"\n{args.model} on {args.data}, {torch.get_num_threads()} thread(s), engine {engine}, "
        f"static int8 calibrated on {len(calib) * args.batch_size} training images, accuracy "
        f"on all {len(labels)} test images\n"
    )
    print(
        f"| method | size MB | size vs fp32 | batch-1 latency ms | speed-up "
        f"| batch-{args.batch_size} images/s | speed-up | test acc % | vs fp32 (points) "
        "| same prediction as fp32 % |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(
            f"| {r['method']} | {r['size_mb']:.3f} | {r['size_ratio']:.2f}x "
            f"| {r['latency_ms']:.3f} | {r['latency_speedup']:.2f}x | {r['throughput']:.0f} "
            f"| {r['throughput_speedup']:.2f}x | {100 * r['accuracy']:.2f} "
            f"| {100 * r['accuracy_delta']:+.2f} | {100 * r['agreement']:.2f} |"
        )

    if args.json:
        report = dict(model=args.model, data=args.data, checkpoint=args.checkpoint)
        report.update(threads=torch.get_num_threads(), engine=engine, batch_size=args.batch_size)
        report.update(calib_images=len(calib) * args.batch_size, test_images=len(labels))
        report.update(torch=torch.__version__, results=rows)
        atomic_write(args.json, lambda tmp: tmp.write_text(json.dumps(report, indent=2) + "\n"))
    if out:
        # The state_dict of the converted graph, plus what rebuilding that graph needs (see
        # load_int8). Plain tensors and strings: it loads with weights_only=True.
        state = dict(model=models["static int8"].state_dict(), model_name=args.model)
        state.update(num_classes=num_classes, input_shape=[1, *big[1:]], engine=engine)
        save_checkpoint(state, out / "model_int8.pt")
        print(f"\nsaved {out / 'model_int8.pt'} (static int8; reload with quantize.load_int8)")


if __name__ == "__main__":
    main()
