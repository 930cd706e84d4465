"""DDP reduces gradients in the policy's reduce dtype, FSDP2 takes Policy.to_fsdp(), delayed fp8
reduces its amaxes across ranks (two gloo ranks on CPU: ddp_worker.py, fsdp_worker.py,
float8_ddp_worker.py)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import require_module

import mixedpolicy as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(worker_name: str, timeout: float = 300, teardown_grace: float = 30) -> dict:
    """Runs a two-rank worker script of this folder; rank 0's last line, a JSON report, once
    both ranks passed every check (rank 0 prints after a collective that needs rank 1 past
    its own checks). On a loaded 2-core machine gloo can abort or hang while tearing down
    after that ("terminate called without an active exception", a barrier that never
    returns): the report decides, the teardown gets `teardown_grace` seconds and is then
    stopped, and the exit status decides only when the report is missing."""
    worker = Path(__file__).with_name(worker_name)
    proc = subprocess.Popen([sys.executable, str(worker), str(_free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=worker.parent, start_new_session=True)
    out: list = []
    err: list = []
    readers = [threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
               for s, into in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if out and out[-1].startswith("{"):
            deadline = min(deadline, time.monotonic() + teardown_grace)
        time.sleep(0.2)
    if proc.poll() is None:  # the whole group: torch.multiprocessing's ranks too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    lines = "".join(out).strip().splitlines()
    assert lines and lines[-1].startswith("{"), (f"{worker_name} gave no report (exit {proc.returncode}):\n"
                                                 + "".join(out)[-2000:] + "".join(err)[-4000:])
    return json.loads(lines[-1])


@pytest.mark.slow
def test_adaprec_around_a_ddp_loop_on_two_gloo_ranks():
    """mp.AdaPrec with live state (snapshot/restore of state dicts): float32 alone is bit for bit
    the plain DDP run; with three candidates on a slow link both ranks decide alike, the
    replicas stay equal, the digits MLP learns, and it sends a fraction of float32's bytes
    (asserts in adaprec_worker.py)."""
    require_module("torch")
    require_module("sklearn")
    report = _report("adaprec_worker.py")
    assert report["decisions"][0][0] == 0 and report["accuracy"] > 0.85
    assert report["bytes_vs_float32"] < 0.6


@pytest.mark.slow
def test_every_reduce_dtype_on_two_gloo_ranks():
    """float32 is plain DDP bit for bit, bf16/fp16 torch's own compress hooks bit for bit,
    8-bit close to the float32 mean; per-layer dtypes; bytes 4 : 2 : 1 (+ the scale); an
    overflow on one rank makes both skip in every reduce dtype, with the same scale and
    equal replicas after (asserts in ddp_worker.py)."""
    require_module("torch")
    figures = _report("ddp_worker.py")
    n = figures["float32"] // 4  # the model's parameter count
    assert (figures["bfloat16"], figures["float16"]) == (2 * n, 2 * n)
    assert figures["float8_e5m2"] == figures["float8_e4m3fn"] == n + 4  # one bucket, one scale
    assert n < figures["per_layer"] < figures["float32"]
    assert figures["table-1"] == -(-n // 8) + 4 and figures["table-8"] == n + 4 * 128  # and decode as numpy's


@pytest.mark.slow
def test_delayed_fp8_amaxes_are_reduced_across_ddp_ranks():
    """A delayed-fp8 layer under DDP, each rank on its own data, DDP's buffer sync off: both
    ranks keep the same scales and histories, the inputs' history holding the largest amax
    over the ranks (asserts in float8_ddp_worker.py)."""
    require_module("torch")
    assert _report("float8_ddp_worker.py")["ranks_agree"]


@pytest.mark.slow
def test_fsdp2_under_to_fsdp_trains_as_by_hand_and_ranks_skip_together():
    """to_fsdp() equals the MixedPrecisionPolicy one writes by hand and trains bit for bit
    the same; an overflow in one rank's shard makes both ranks skip; apply_policy on a sharded
    model computes a mixed policy (overrides too) as on the unsharded one and refuses one that
    would store parameters in another dtype. Under FSDP (FullyShardedDataParallel, flat or
    original parameters) an overflow in one rank's shard makes both skip, bit for bit as torch's
    ShardedGradScaler, and a policy that would change what FSDP flattened is refused up front
    (fsdp_worker.py)."""
    require_module("torch")
    assert _report("fsdp_worker.py") == {"ok": True}


def test_to_fsdp_refuses_8_bit_gradients_and_says_where_they_go():
    require_module("torch")
    with pytest.raises(ValueError, match=r"in float8_e5m2, which mixedpolicy cannot carry through FSDP2 \(it "
                                         r"carries float32, bfloat16, float16, float64; it reduce-scatters .*"
                                         r"PyTorch DDP \(mp.torch.register\)"):
        mp.Policy("mixed_bfloat16", reduce_dtype="e5m2").to_fsdp()
    fsdp = mp.Policy("p=f32,c=bf16,o=f32").to_fsdp()
    import torch

    assert (fsdp.param_dtype, fsdp.reduce_dtype, fsdp.output_dtype) == (torch.bfloat16, torch.float32, torch.float32)


def test_register_refuses_what_is_not_ddp():
    torch = require_module("torch")
    with pytest.raises(TypeError, match=r"torch.nn.modules.linear.Linear; expected a torch.nn.parallel.DistributedDataParallel"):
        mp.distributed.register(torch.nn.Linear(2, 2), "mixed_float16")
    with pytest.raises(TypeError, match="mixedpolicy.jax.all_reduce"):
        mp.distributed.register(object())


def test_the_torch_front_door_is_the_ddp_hook_of_mp_distributed():
    """mp.torch.register beside mp.jax.all_reduce and mp.tensorflow.all_reduce; the older
    name stays an alias of the same function."""
    torch = require_module("torch")
    assert mp.torch.register is mp.distributed.register
    with pytest.raises(TypeError, match="expected a torch.nn.parallel.DistributedDataParallel module"):
        mp.torch.register(torch.nn.Linear(2, 2))
