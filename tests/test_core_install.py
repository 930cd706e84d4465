"""`pip install .` in a fresh venv: the core alone works (numpy only), then `.[torch]` alone
trains a torch model and names the extra for what it lacks."""

import importlib.metadata
import json
import pathlib
import subprocess
import sys
import venv

import pytest

pytestmark = pytest.mark.slow  # starts processes of its own (see docs/contributing.md)


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pip_install(py: pathlib.Path, target: str, *options: str) -> subprocess.CompletedProcess:
    # --no-compile: no bytecode for torch's thousands of modules (a third of the install time);
    # this suite's pip installs into the fresh venv (--python), which then needs no pip of its
    # own (ensurepip took 3.5 s)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-compile",
                           "-c", str(ROOT / "constraints.txt"), *options, target],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _install_as_resolved(py: pathlib.Path, target: str, tmp_path: pathlib.Path) -> list[str]:
    """`target` installed into the venv of `py` as pip resolves it there: pip's own report of
    what it would install (names and versions), then each of those the suite's venv holds at
    that very version linked in from there (unpacking torch's wheel again was 40 of this test's
    50 s), the others installed by pip. Returns the names pip resolved."""
    report = tmp_path / "report.json"
    _pip_install(py, target, "--dry-run", "--report", str(report))
    resolved = {item["metadata"]["name"]: item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    linked = tmp_path / "linked"
    linked.mkdir()
    rest = []
    for name, version in resolved.items():
        if name == "mixedpolicy":  # installed from the checkout below
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            dist = None
        if dist is None or dist.version != version or not dist.files:
            rest.append(f"{name}=={version}")
            continue
        site = pathlib.Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files if f.parts and f.parts[0] != ".."}:
            if not (linked / top).exists() and (site / top).exists():
                (linked / top).symlink_to(site / top)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (pathlib.Path(purelib) / "linked-from-the-suite.pth").write_text(f"{linked}\n")
    for requirement in rest:
        _pip_install(py, requirement, "--no-deps")
    _pip_install(py, target, "--no-deps")  # the project itself, as pip installs it
    return sorted(resolved)


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
    resolved = _install_as_resolved(py, f"{ROOT}[torch]", tmp_path)
    assert "torch" in resolved and not {"jax", "tensorflow", "tensorflow-cpu", "keras", "scikit-learn"} & set(resolved)
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
