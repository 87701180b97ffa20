"""The classic recipe that users start from, kept as the benchmark's baseline (benchmark-only,
not an example to copy: ddp_train.py is what this project recommends).

What makes it the classic recipe, kept on purpose:
- a LeNet-style CNN with dropout (conv 6 and 16 channels of 5x5, fully connected 120-84-10);
- plain SGD, lr 0.01, no momentum, no schedule, no learning-rate scaling with world size;
- torchvision's FashionMNIST data set: every sample is turned into a PIL image and through
  transforms.ToTensor() + Normalize each time it is read (ddp_train.py decodes once into
  tensors instead);
- batch 64 per process, DistributedSampler with set_epoch, DDP under torchrun (gloo on CPU).

    torchrun --standalone --nproc_per_node=2 benchmarks/baseline_recipe.py \\
        --output-dir runs/baseline

OUTPUT_DIR/metrics.jsonl has ddp_train.py's fields (epoch, step, train_loss, test_loss,
test_acc, epoch_seconds, samples_per_second), so benchmarks/run_all.py reads both the same
way. Evaluation uses training.evaluate (every test sample counted once) and is not timed.
The data must be torchvision's unzipped files in DATA_DIR/FashionMNIST/raw (or --download).
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import ArgumentParser, cleanup, fail, init_distributed_mode, print0, reduce_value
from data import eval_shard
from training import evaluate


class LeNet(nn.Module):
    """LeNet-5 for 28x28 inputs, with dropout on the fully connected layers."""

    def __init__(self, num_classes=10, dropout=0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)  # 28 -> 24, pooled to 12
        self.conv2 = nn.Conv2d(6, 16, 5)  # 12 -> 8, pooled to 4
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = self.dropout(F.relu(self.fc1(x)))
        x = self.dropout(F.relu(self.fc2(x)))
        return self.fc3(x)


def load_data(data_dir, download):
    from torchvision import datasets, transforms

    # The per-sample PIL route: uint8 array -> PIL image -> float tensor, for every sample
    # of every epoch. This is the cost the benchmark measures against.
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    try:
        return [
            datasets.FashionMNIST(data_dir, train=train, download=download, transform=transform)
            for train in (True, False)
        ]
    except RuntimeError as e:
        fail(
            f"Fashion-MNIST not found in {Path(data_dir) / 'FashionMNIST' / 'raw'} "
            f"({str(e).splitlines()[0]}); "
            "pass --download, or gunzip the four IDX files there"
        )


def train(args, info):
    device = info.device
    out = Path(args.output_dir) if args.output_dir and info.rank == 0 else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("")  # a fresh run: no resume in the baseline
    torch.manual_seed(args.seed)  # same initial weights on every rank
    train_set, test_set = load_data(args.data_dir, args.download)

    sampler = DistributedSampler(
        train_set, num_replicas=info.world_size, rank=info.rank, seed=args.seed
    )
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers
    )
    # Evaluation (not timed) counts every test sample once, so accuracies compare exactly.
    test_loader = DataLoader(
        eval_shard(test_set, info.rank, info.world_size), batch_size=1000, num_workers=args.workers
    )

    raw_model = LeNet().to(device)
    model = DDP(raw_model) if info.distributed else raw_model
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()

    step = 0
    for epoch in range(args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        t0 = time.perf_counter()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * labels.numel()
            count += labels.numel()
            step += 1
            if args.max_steps and step >= args.max_steps:
                break  # every rank has the same number of batches, so all stop together
        totals = reduce_value(torch.stack([loss_sum, count]))  # all ranks participate
        epoch_seconds = time.perf_counter() - t0
        test_loss, test_acc = evaluate(raw_model, test_loader, device)
        record = dict(
            epoch=epoch,
            step=step,
            train_loss=(totals[0] / totals[1]).item(),
            test_loss=test_loss,
            test_acc=test_acc,
            epoch_seconds=epoch_seconds,
            samples_per_second=totals[1].item() / epoch_seconds,
            world_size=info.world_size,
        )
        print0(
            f"epoch {epoch}: train_loss {record['train_loss']:.4f} test_loss {test_loss:.4f} "
            f"test_acc {test_acc:.4f} {epoch_seconds:.1f}s {record['samples_per_second']:.0f} "
            f"samples/s"
        )
        if out:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")


def main():
    p = ArgumentParser(description="the classic DDP recipe (benchmark baseline)")
    p.add_argument("--data-dir", default="data", help="torchvision root holding FashionMNIST/raw")
    p.add_argument("--download", action="store_true", help="download Fashion-MNIST if missing")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=64, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (no momentum)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, dropout and shuffling")
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many steps (smoke runs); 0: no limit",
    )
    p.add_argument(
        "--output-dir", default=None, help="where metrics.jsonl goes; none: write nothing"
    )
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present"
    )
    args = p.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.max_steps < 0 or args.workers < 0:
        fail(
            "--epochs and --batch-size must be at least 1; --max-steps and --workers cannot be "
            "negative"
        )

    info = init_distributed_mode(device=args.device)
    try:
        train(args, info)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
