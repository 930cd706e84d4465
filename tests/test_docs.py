"""Every Python block in README.md and docs/*.md runs as written.

A block may lean on a preamble written just above it in the markdown source, in an
HTML comment that readers of the rendered page do not see::

    <!-- doc-setup
    x = np.ones((4, 64), np.float32)
    -->

and be exercised by a comment just below it (``<!-- doc-after ... -->``), for
example calling the step function the block defines. Blocks of docs/keras.md run
under every Keras backend. A page's blocks run in order in a fresh process of their own
(Keras picks its backend per process, JAX and TensorFlow their devices), each in a
fresh namespace with the global policies set back (tests/docs_runner.py): one process
per page, not per block, since starting one and importing the frameworks is most of a
block's time (so the pages that need no Keras backend of their own share two processes).
"""

import json
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


def blocks(name: str) -> list:
    """The page's blocks, each with its preamble and after-comment, named ``page#i``."""
    text = (ROOT / name).read_text()
    return [(f"{name}#{i}", (m["setup"] or "") + m["code"] + (m["after"] or ""))
            for i, m in enumerate(_BLOCK.finditer(text))]


#: Pages that run under the default Keras backend share a process, in two groups (one per CI
#: core): starting a process and importing the frameworks was half of a page's time.
GROUPS = 2


def pages():
    shared = [name for name in FILES if blocks(name) and name != "docs/keras.md"]
    for i in range(GROUPS):
        group = shared[i::GROUPS]
        yield pytest.param(group, None, id="+".join(group))
    for backend in KERAS_BACKENDS:
        yield pytest.param(["docs/keras.md"], backend, id=f"docs/keras.md-{backend}")


def test_there_are_blocks_to_run():
    assert sum(len(blocks(name)) for name in FILES) >= 10


@pytest.mark.parametrize("group, backend", list(pages()))
def test_the_pages_blocks_run_as_written(group, backend, tmp_path):
    # as a user runs them: JAX's default (standard) promotion, not the suite's strict one
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu",
               JAX_NUMPY_DTYPE_PROMOTION="standard")
    if backend:
        env["KERAS_BACKEND"] = backend
    runner = str(Path(__file__).with_name("docs_runner.py"))
    programs = [block for page in group for block in blocks(page)]
    proc = subprocess.run([sys.executable, runner], input=json.dumps(programs), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]


def test_a_failing_block_is_named_and_stops_the_run(tmp_path):
    """The runner's own contract: the global policy is back to float32 for each block, and a
    failure names its block."""
    programs = [("a.md#0", "import mixedpolicy as mp\nmp.set_global_policy('mixed_bfloat16')"),
                ("a.md#1", "import mixedpolicy as mp\nassert str(mp.global_policy()) == 'float32'\n1 / 0"),
                ("a.md#2", "raise SystemExit('never reached')")]
    runner = str(Path(__file__).with_name("docs_runner.py"))
    proc = subprocess.run([sys.executable, runner], input=json.dumps(programs), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "--- a.md#1 failed" in proc.stderr and "ZeroDivisionError" in proc.stderr
    assert "never reached" not in proc.stderr
