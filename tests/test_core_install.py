"""`pip install .` with no framework gives a working core (a fresh venv, numpy only)."""

import pathlib
import subprocess
import sys
import venv

import pytest

pytestmark = pytest.mark.slow  # starts processes of its own (see docs/contributing.md)


ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_pip_install_without_frameworks(tmp_path):
    env_dir = tmp_path / "core-only"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    constraints = ROOT / "constraints.txt"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "-c", str(constraints), str(ROOT)],
                   check=True, capture_output=True, text=True)
    code = (
        "import importlib.util, sys, numpy as np, mixedpolicy as mp\n"
        "missing = [m for m in ('torch','jax','tensorflow','keras') if importlib.util.find_spec(m)]\n"
        "assert not missing, missing\n"
        "p = mp.Policy('bf16-mixed'); mp.set_global_policy(p)\n"
        "m = mp.PolicyMap(p, {'head': 'float32'})\n"
        "s = mp.DynamicLossScale().adjust(False)\n"
        "print(mp.global_policy().name, float(s.loss_scale), m.overrides[0][1].name)\n"
    )
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["mixed_bfloat16", "16384.0", "float32"]
