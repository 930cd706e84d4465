"""`pip install .` in a fresh venv: the core alone works (numpy only), then `.[torch]` alone
trains a torch model and names the extra for what it lacks."""

import pathlib
import subprocess
import sys
import venv

import pytest

pytestmark = pytest.mark.slow  # starts processes of its own (see docs/contributing.md)


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pip_install(py: pathlib.Path, target: str) -> None:
    # --no-compile: no bytecode for torch's thousands of modules (a third of the install time)
    proc = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-compile", "-c",
                           str(ROOT / "constraints.txt"), target],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _run(py: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_pip_install_without_frameworks_then_with_the_torch_extra_alone(tmp_path):
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _pip_install(py, str(ROOT))
    code = (
        "import importlib.util, sys, numpy as np, mixedpolicy as mp\n"
        "missing = [m for m in ('torch','jax','tensorflow','keras') if importlib.util.find_spec(m)]\n"
        "assert not missing, missing\n"
        "p = mp.Policy('bf16-mixed'); mp.set_global_policy(p)\n"
        "m = mp.PolicyMap(p, {'head': 'float32'})\n"
        "s = mp.DynamicLossScale().adjust(False)\n"
        "print(mp.global_policy().name, float(s.loss_scale), m.overrides[0][1].name)\n"
    )
    out = _run(py, "-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mixed_bfloat16", "16384.0", "float32"]

    # `.[torch]` brings torch (the CPU build the constraints pin) and nothing of the others
    _pip_install(py, f"{ROOT}[torch]")
    code = (
        "import importlib.util, torch, mixedpolicy as mp\n"
        "assert [m for m in ('jax','tensorflow','keras','sklearn') if importlib.util.find_spec(m)] == []\n"
        "net = mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),"
        " 'mixed_float16')\n"
        "opt = mp.LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))\n"
        "loss = net(torch.ones(3, 4)).float().square().mean()\n"
        "opt.scale_loss(loss).backward(); opt.step()\n"
        "print(opt.num_skipped_steps, float(opt.loss_scale))\n"
        "try:\n"
        "    mp.jax\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    out = _run(py, "-c", code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "0 32768.0"
    assert 'pip install "mixedpolicy[jax]"' in lines[1], lines
    # the example's data set ships inside scikit-learn, which [torch] does not bring: it says which extra does
    example = _run(py, "examples/torch_mlp.py")
    assert example.returncode == 1 and "pip install 'mixedpolicy[bench]'" in example.stderr, example.stderr
