"""A torchrun restart hands its new workers the failed attempt's store, where the dead workers'
process group left their addresses. common.process_group_store starts every attempt's group
under keys of its own; a group formed on the old keys dials dead workers instead.

The test plays torchrun's agent: it hosts the store, runs a first attempt that forms a group
and dies, then starts the next attempt in the environment torchrun gives restarted workers.
Under torchrun, timing and port numbers decide whether old keys do harm; here two things fix
them. Rank 0 of the new attempt creates its group late, so rank 1 looks up rank 0's address
before rank 0 has written a new one. And every dead address is moved to port 0: of a pair,
gloo lets the higher address dial and the lower one wait, so a worker that reads a dead
address always dials it (instead of waiting for its live peer, which would work). A group
formed on old keys thus fails every time: rank 1 gives up within its 10 s timeout, while
rank 0 may wait for it forever (gloo's wait to be dialed has no timeout) until killed at 40 s.
"""

import datetime
import re
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from conftest import clean_env, free_port, popen

# The test moves the dead attempt's addresses through TCPStore.list_keys (PyTorch 2.10 on).
pytestmark = pytest.mark.skipif(
    not hasattr(dist.TCPStore, "list_keys"), reason="needs TCPStore.list_keys (PyTorch 2.10)"
)

# One attempt's worker: joins the group as every script does, all-reduces rank + 1 and prints
# the sum. "die": the attempt ends like a killed worker, its group never destroyed. "late":
# rank 0 creates its group 2 s after it agreed on the attempt's keys, like a slow rank.
WORKER = """
import os, signal, sys, time
import torch
import torch.distributed as dist
import common

if sys.argv[1] == "late" and os.environ["RANK"] == "0":
    start = dist.init_process_group
    dist.init_process_group = lambda *a, **k: (time.sleep(2), start(*a, **k))[1]
info = common.init_distributed_mode(device="cpu", timeout_s=10)
total = torch.tensor([info.rank + 1.0])
dist.all_reduce(total)
print("sum", total.item(), flush=True)
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
common.cleanup()
"""
# A worker's address in the key its gloo group writes: a sockaddr_in (family, port, 127.0.0.1).
# Port 0 (no one listens there) is all zero bytes: below any other port in any byte order.
ADDRESS = re.compile(rb"(\x02\x00|\x00\x02)..(\x7f\x00\x00\x01)", re.DOTALL)


def attempt(port, restart, mode):
    """Both workers of one attempt, in the environment torchrun gives them (node 0 of 1)."""
    launcher = dict(
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(restart),
        TORCHELASTIC_MAX_RESTARTS="1",
        TORCHELASTIC_RUN_ID="restart-store-test",
        GLOO_SOCKET_IFNAME="lo",  # every address 127.0.0.1, so the ports decide who dials
    )
    envs = [clean_env(**launcher, RANK=str(r), LOCAL_RANK=str(r)) for r in range(2)]
    cmd = [sys.executable, "-c", WORKER, mode]
    procs = [popen(cmd, env=env) for env in envs]  # forked: torch imported once, not 4 times
    deadline, results = time.monotonic() + 40, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # a hang
            p.kill()
            out, err = p.communicate()
            err += "\n(hung: killed after 40 s)"
        results.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    return results


@pytest.mark.slow
def test_restarted_workers_form_a_new_group_in_the_failed_attempts_store():
    port = free_port()
    # The agent's store, which outlives every attempt's workers.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(0, 30))
    first = attempt(port, 0, "die")
    dead = 0
    for key in store.list_keys():
        value = store.get(key)
        moved = ADDRESS.sub(lambda m: m[1] + b"\0\0" + m[2], value)
        if moved != value:
            store.set(key, moved)
            dead += 1
    errors = [p.stderr[-1500:] for p in first]
    assert dead >= 2, f"no worker's address among the keys {store.list_keys()}: {errors}"

    second = attempt(port, 1, "late")
    report = "\n".join(
        f"rank {r}: exit {p.returncode}\n{p.stderr[-1500:]}" for r, p in enumerate(second)
    )
    assert [p.returncode for p in second] == [0, 0], report
    assert [p.stdout.split() for p in second] == [["sum", "3.0"]] * 2, report
