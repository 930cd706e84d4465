"""Every Python block in README.md and docs/*.md runs as written.

A block may lean on a preamble written just above it in the markdown source, in an
HTML comment that readers of the rendered page do not see::

    <!-- doc-setup
    x = np.ones((4, 64), np.float32)
    -->

and be exercised by a comment just below it (``<!-- doc-after ... -->``), for
example calling the step function the block defines. Blocks of docs/keras.md run
under every Keras backend; every block runs in a fresh process (Keras picks its
backend per process, JAX and TensorFlow their devices).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keras_helper import KERAS_BACKENDS

pytestmark = pytest.mark.slow  # starts processes of its own (see docs/contributing.md)

ROOT = Path(__file__).resolve().parent.parent
FILES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"(?:<!-- doc-setup\n(?P<setup>.*?)-->\n)?```python\n(?P<code>.*?)```\n"
                    r"(?:<!-- doc-after\n(?P<after>.*?)-->\n)?", re.S)


def blocks():
    for name in FILES:
        text = (ROOT / name).read_text()
        for i, m in enumerate(_BLOCK.finditer(text)):
            program = (m["setup"] or "") + m["code"] + (m["after"] or "")
            backends = KERAS_BACKENDS if name == "docs/keras.md" else (None,)
            for backend in backends:
                suffix = f"-{backend}" if backend else ""
                yield pytest.param(program, backend, id=f"{name}#{i}{suffix}")


def test_there_are_blocks_to_run():
    assert len(list(blocks())) >= 10


@pytest.mark.parametrize("program, backend", list(blocks()))
def test_the_block_runs_as_written(program, backend, tmp_path):
    # as a user runs them: JAX's default (standard) promotion, not the suite's strict one
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu",
               JAX_NUMPY_DTYPE_PROMOTION="standard")
    if backend:
        env["KERAS_BACKEND"] = backend
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"--- program\n{program}\n--- stderr\n{proc.stderr[-4000:]}"
