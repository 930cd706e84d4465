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
    # --no-compile: no bytecode for torch's thousands of modules (a third of the install time);
    # this suite's pip installs into the fresh venv (--python), which then needs no pip of its
    # own (ensurepip took 3.5 s)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-compile",
                           "-c", str(ROOT / "constraints.txt"), target],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _run(py: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def _output(py: pathlib.Path, *lines: str) -> list[str]:
    """The lines a program of `lines` prints in the venv of `py` (it must succeed)."""
    out = _run(py, "-c", "\n".join(lines))
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_pip_install_without_frameworks_then_with_the_torch_extra_alone(tmp_path):
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    _pip_install(py, str(ROOT))
    printed = _output(
        py,
        "import importlib.util, sys, numpy as np, mixedpolicy as mp",
        "missing = [m for m in ('torch','jax','tensorflow','keras') if importlib.util.find_spec(m)]",
        "assert not missing, missing",
        "p = mp.Policy('bf16-mixed'); mp.set_global_policy(p)",
        "m = mp.PolicyMap(p, {'head': 'float32'})",
        "s = mp.DynamicLossScale().adjust(False)",
        "print(mp.global_policy().name, float(s.loss_scale), m.overrides[0][1].name)")
    assert printed == ["mixed_bfloat16 16384.0 float32"]

    # `.[torch]` brings torch (the CPU build the constraints pin) and nothing of the others
    _pip_install(py, f"{ROOT}[torch]")
    lines = _output(
        py,
        "import importlib.util, torch, mixedpolicy as mp",
        "assert [m for m in ('jax','tensorflow','keras','sklearn') if importlib.util.find_spec(m)] == []",
        "torch.manual_seed(0)",
        "net = mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),"
        " 'mixed_float16')",
        "opt = mp.LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))",
        # |output| <= 7.4 under any default init: / 100 keeps 32768x its float16 gradients finite
        "loss = net(torch.ones(3, 4)).float().square().mean() / 100",
        "opt.scale_loss(loss).backward(); opt.step()",
        "print(opt.num_skipped_steps, float(opt.loss_scale))",
        "try:",
        "    mp.jax",
        "except ImportError as err:",
        "    print(err)")
    assert lines[0] == "0 32768.0"
    assert 'pip install "mixedpolicy[jax]"' in lines[1], lines
    # the example's data set ships inside scikit-learn, which [torch] does not bring: it says which extra does
    example = _run(py, "examples/torch_mlp.py")
    assert example.returncode == 1 and "pip install 'mixedpolicy[bench]'" in example.stderr, example.stderr
