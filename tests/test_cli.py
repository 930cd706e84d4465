"""The command line: subcommands, --version, `describe MODULE:FACTORY` on a user's model."""

import pytest

from conftest import require_module
from mixedpolicy import __version__
from mixedpolicy.__main__ import main


def _describe(capsys, *argv):
    """(exit status, stdout, stderr) of `mixedpolicy describe ARGV`."""
    rc = main(["describe", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_version_help_and_unknown_commands(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mixedpolicy {__version__}"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("bench", "inspect", "describe"))
    assert main([]) == 2
    assert main(["benchmark"]) == 2
    assert "unknown command 'benchmark'; expected one of: bench, inspect, describe" in capsys.readouterr().err


def test_describe_a_users_model_from_a_file_with_a_policy(tmp_path, capsys):
    require_module("torch")
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))\n"
        "def make_wide(width, depth=2):\n"
        "    return torch.nn.Linear(width, width)\n")
    target = f"{tmp_path / 'my_models.py'}:make"
    assert main(["describe", target, "--policy", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    assert "Linear" in out and "bfloat16" in out and "LayerNorm" in out
    assert main(["describe", target.replace(":make", ":nope")]) == 2
    assert "has no callable 'nope'; its callables: make" in capsys.readouterr().err
    assert main(["describe", "no_such_module_here:make"]) == 2
    assert "'no_such_module_here' cannot be imported" in capsys.readouterr().err
    assert main(["describe", "justaname"]) == 2
    assert "expected MODULE:FACTORY" in capsys.readouterr().err
    # a factory that needs arguments is named with them before it is called
    assert main(["describe", target.replace(":make", ":make_wide")]) == 2
    assert "make_wide requires the arguments width; expected a factory that takes no arguments" in \
        capsys.readouterr().err


def test_describe_takes_a_bench_factory_that_returns_its_model_with_batches(tmp_path, capsys):
    """The MODULE:FACTORY `mixedpolicy bench --model` and `inspect --model` take (a dict with the
    model, its batches and loss) describes its model; a dict that breaks the contract says how."""
    require_module("torch")
    (tmp_path / "zoo.py").write_text(
        "import torch\n"
        "def own():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))\n"
        "    return {'model': model, 'batches': [(torch.ones(2, 4), torch.zeros(2, dtype=torch.long))]}\n"
        "def odd():\n"
        "    return {'model': torch.nn.Linear(2, 2), 'optimizer': None}\n")
    target = f"{tmp_path / 'zoo.py'}:own"
    rc, out, _ = _describe(capsys, target, "--policy", "mixed_float16")
    assert rc == 0 and "Sequential" in out and "LayerNorm" in out and "float16" in out and "built-in rule" in out
    rc, _, err = _describe(capsys, target.replace(":own", ":odd"))
    assert rc == 2 and f"Received {tmp_path / 'zoo.py'}:odd, whose factory returns a dict with the keys 'optimizer'" in err


def test_describe_inits_a_linen_module_on_its_factorys_batch(tmp_path, capsys):
    """linen builds its layers at its first call: describe runs one init on the inputs of the
    factory's first batch; a bare module (no inputs to call it on), or one without --policy
    (a linen module is read through the policy put on it), is refused with the way to give them."""
    require_module("flax.linen", "jax")
    (tmp_path / "lin.py").write_text(
        "import numpy as np\n"
        "import flax.linen as nn\n"
        "def bare():\n"
        "    return nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])\n"
        "def with_batch():\n"
        "    return {'model': bare(), 'batch': (np.ones((2, 4), 'float32'), np.zeros((2,), 'int32'))}\n")
    target = f"{tmp_path / 'lin.py'}:with_batch"
    rc, out, _ = _describe(capsys, target, "--policy", "mixed_bfloat16")
    assert rc == 0 and "layers_0" in out and "LayerNorm" in out and "built-in rule" in out and "bfloat16" in out
    rc, _, err = _describe(capsys, target.replace(":with_batch", ":bare"), "--policy", "mixed_bfloat16")
    assert rc == 2 and "Return {'model': module, 'batch': (inputs, targets)}" in err
    rc, _, err = _describe(capsys, target)
    assert rc == 2 and "give one: --policy" in err
