"""DistributedDataParallel started by torch.multiprocessing.spawn instead of torchrun.

The training is ddp_train.py's, imported rather than copied; only the launch differs. One
parent process starts --nprocs children on this node, each calling ddp_train.main() with
its rank. Use it where torchrun is not available or a notebook/IDE must start the job; use
torchrun for several nodes and for restarts after a failure (mp.spawn does neither: when
one process dies it stops the others and exits; a rerun with the same --output-dir resumes).

Launch:
    python ddp_mp_spawn.py --nprocs 2                     # 2 processes (CPU: gloo)
    python ddp_mp_spawn.py --nprocs 4 --epochs 10         # any ddp_train.py flag passes through
    MASTER_PORT=29600 python ddp_mp_spawn.py --nprocs 2   # a fixed port instead of a free one

mp.spawn gives every child all the cores; init_distributed_mode() divides them
(cores / nprocs threads each), or N processes would run N x cores threads and thrash.
"""

import os
import socket
import sys

import torch
import torch.multiprocessing as mp

import ddp_train
from common import ArgumentParser, detect_launcher, fail


def free_port():
    """A port that is free now. Another program could take it before rank 0 binds it (a
    small race); set MASTER_PORT to choose one yourself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def check_port_free(addr, port):
    with socket.socket() as s:
        try:
            s.bind((addr, int(port)))
        except OSError as e:
            fail(f"MASTER_PORT {port} on {addr} is busy ({e.strerror}); choose another or unset it")


def worker(rank, world_size, argv):
    # Runs in each child. spawn re-imports this file there, hence the __main__ guard below.
    ddp_train.main(argv, rank=rank, world_size=world_size)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    default_nprocs = torch.cuda.device_count() or 2
    p.add_argument("--nprocs", type=int, default=default_nprocs, help="processes to start (default: GPUs, or 2)")
    p.add_argument("-h", "--help", action="store_true", help="show this help and ddp_train.py's flags")
    args, rest = p.parse_known_args(argv)
    if args.help:
        p.print_help()
        print("\nevery other flag goes to ddp_train.py:\n")
        ddp_train.get_args(["--help"])
    if args.nprocs < 1:
        fail(f"--nprocs must be at least 1, got {args.nprocs}")
    train_args = ddp_train.get_args(rest)  # fail on bad flags here, before starting children
    if train_args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but this machine has no usable CUDA device")
    use_cuda = train_args.device == "cuda" or (train_args.device == "auto" and torch.cuda.is_available())
    if use_cuda and args.nprocs > torch.cuda.device_count():
        fail(f"--nprocs {args.nprocs} is more than the {torch.cuda.device_count()} GPU(s) here")

    # torchrun (even with one worker: its store holds MASTER_PORT) or several srun/mpirun tasks
    # would each spawn a group of their own; one srun or mpirun task per node is fine.
    launched = detect_launcher()
    if launched and (launched["launcher"] == "torchrun" or launched["world_size"] > 1):
        fail(
            f"ddp_mp_spawn.py starts its own processes; run it with plain python, not under {launched['launcher']} "
            "(that launches ddp_train.py directly)"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # one node: the children meet here
    if "MASTER_PORT" in os.environ:
        check_port_free(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    else:
        os.environ["MASTER_PORT"] = free_port()
    try:
        # join=True: wait for all; if one child fails, spawn terminates the others.
        mp.spawn(worker, args=(args.nprocs, rest), nprocs=args.nprocs, join=True)
    except mp.ProcessExitedException as e:
        if not e.signal_name:  # the child said why itself (its "error: ..." line is above)
            fail(f"process {e.error_index} of {args.nprocs} exited with code {e.exit_code}; the others were stopped")
        # Killed (out of memory, pre-empted): mp.spawn never restarts a process (torchrun
        # --max-restarts does), but a rerun picks up the last checkpoint.
        again = f"; rerun to resume from {train_args.output_dir}" if train_args.output_dir else ""
        fail(f"process {e.error_index} of {args.nprocs} was killed by {e.signal_name}; the others were stopped{again}")
    except mp.ProcessRaisedException as e:
        last = str(e).strip().splitlines()[-1]
        fail(f"process {e.error_index} of {args.nprocs} raised {last}; the others were stopped")


if __name__ == "__main__":
    main()
