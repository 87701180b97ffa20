"""Parity: 2 processes with per-process batch 16 take the same steps as 1 process with
batch 32, so after several steps they hold the same parameters.

This holds only if gradients are averaged over ranks, every rank sees its own half of the
global batch, and the learning rate is scaled by the global batch (not the per-process one).
The MLP has no BatchNorm, whose statistics would legitimately differ per rank.
"""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import (
    MLP_ARGS,
    ROOT,
    assert_state_close,
    clean_env,
    free_port,
    load_ckpt,
    max_abs_diff,
    read_metrics,
    run_ranks,
    single_process_eval,
    torchrun_workers,
)

import models

ATOL = 1e-5


def initial_weights():
    # What ddp_train.py starts from: the seed (0) is set just before the model is built.
    models.seed_everything(0)
    return models.build_model("mlp", 1, 10).state_dict()


def check_parity(out_dir, reference_dir):
    reference = load_ckpt(reference_dir)
    ckpt = load_ckpt(out_dir)
    assert (ckpt["world_size"], ckpt["step"]) == (2, 5)
    # The test can fail: the steps moved the weights by far more than the tolerance, so
    # half the learning rate or one rank's gradients alone would show.
    assert max_abs_diff(reference["model"], initial_weights()) > 1000 * ATOL
    assert_state_close(ckpt["model"], reference["model"], atol=ATOL)
    # Same global batch and per-256 rate: the same peak rate, at the same point of the schedule.
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == pytest.approx(
        reference["optimizer"]["param_groups"][0]["lr"], rel=1e-12
    )
    # Exact evaluation, at full precision: the 2 processes' figures are one process's on the
    # same weights.
    [metrics] = read_metrics(out_dir)
    loss, acc = single_process_eval(out_dir / "checkpoint.pt", MLP_ARGS)
    assert (metrics["world_size"], metrics["epoch"], metrics["step"]) == (2, 0, 5)
    assert metrics["test_loss"] == pytest.approx(loss, abs=1e-6)
    assert metrics["test_acc"] == acc


@pytest.mark.parametrize(
    "flags",
    [
        ["--batch-size", "16"],
        # 2 micro-batches of 8 per step: no_sync() keeps the first one's gradient local
        ["--batch-size", "8", "--accum-steps", "2"],
        # 2 loader worker processes per rank: the same batches in the same order
        ["--batch-size", "16", "--workers", "2"],
    ],
    ids=["plain", "accum-steps", "workers"],
)
@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path, mlp_reference, flags):
    torchrun_workers(2, ["ddp_train.py", *MLP_ARGS, *flags, "--output-dir", tmp_path])
    check_parity(tmp_path, mlp_reference)


# Two plain `python ddp_train.py` processes that find their ranks in the variables srun or
# mpirun would set: the launcher detection works in real processes and they train together.
def slurm_env(rank, port):
    # No MASTER_ADDR/MASTER_PORT: the address comes from the node list and the port from
    # the job id (20000 + id % 20000), as on a real cluster.
    return dict(
        SLURM_PROCID=str(rank),
        SLURM_STEP_ID="0",
        SLURM_NTASKS="2",
        SLURM_LOCALID=str(rank),
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_ID=str(port - 20000),
    )


def openmpi_env(rank, port):
    return dict(
        OMPI_COMM_WORLD_RANK=str(rank),
        OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


@pytest.mark.slow
@pytest.mark.parametrize("launcher_env", [slurm_env, openmpi_env], ids=["slurm", "openmpi"])
def test_fake_launcher_matches_single_process(tmp_path, mlp_reference, launcher_env):
    port = free_port(20000, 40000)
    envs = [clean_env(**launcher_env(rank, port)) for rank in range(2)]
    ranks = run_ranks(
        ["ddp_train.py", *MLP_ARGS, "--batch-size", "16", "--output-dir", tmp_path], envs
    )
    assert "2 process(es)" in ranks[0].stdout
    # Rank 1 prints nothing (PyTorch 2.9's Gloo prints a "[Gloo] Rank 1 is connected" line).
    assert [ln for ln in ranks[1].stdout.splitlines() if not ln.startswith("[Gloo]")] == []
    check_parity(tmp_path, mlp_reference)


# The real thing: Open MPI's mpirun starts the two processes. CI installs openmpi-bin and sets
# REQUIRE_MPIRUN=1, so there a missing mpirun fails instead of skipping.
@pytest.mark.slow
def test_real_mpirun_matches_single_process(tmp_path, mlp_reference):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        if os.environ.get("REQUIRE_MPIRUN") == "1":
            pytest.fail("mpirun not found, but REQUIRE_MPIRUN=1 (apt-get install openmpi-bin)")
        pytest.skip("mpirun not installed (apt-get install openmpi-bin)")
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port(20000, 40000)))
    # --allow-run-as-root: CI runs as root; --oversubscribe: 2 processes even on 1 core.
    # -x passes the rendezvous variables to both processes.
    cmd = [
        mpirun,
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        "-x",
        "MASTER_ADDR",
        "-x",
        "MASTER_PORT",
    ]
    cmd += [
        "-x",
        "OMP_NUM_THREADS",
        sys.executable,
        "ddp_train.py",
        *MLP_ARGS,
        "--batch-size",
        "16",
    ]
    cmd += ["--output-dir", str(tmp_path)]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("2 process(es)") == 1  # rank 0 alone prints
    check_parity(tmp_path, mlp_reference)
