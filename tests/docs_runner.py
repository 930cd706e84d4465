"""Runs a page's Python blocks (tests/test_docs.py) in order in this process, as a reader runs
them one after another: each as a script of its own (a file in the working directory, run as
``__main__``: tf.function reads its source, a bench factory is found in ``__main__``), with
mixedpolicy's global policy (and with it Keras's) set back to float32, torch's default dtype
to float32 and JAX's 64-bit mode off before it, so no block leans on what another left behind.
The blocks come as a JSON list of ``[name, program]`` on stdin; a failure names its block and
stops the run with exit status 1."""

import json
import os
import runpy
import sys
import traceback


def _reset() -> None:
    if "mixedpolicy" in sys.modules:
        sys.modules["mixedpolicy"].set_global_policy(None)
    if "torch" in sys.modules:
        sys.modules["torch"].set_default_dtype(sys.modules["torch"].float32)
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_enable_x64", False)


def main() -> int:
    sys.path[0] = os.getcwd()  # as `python -c`: the working directory, not this folder
    for i, (name, program) in enumerate(json.load(sys.stdin)):
        path = os.path.abspath(f"block_{i}.py")
        with open(path, "w") as f:
            f.write(program)
        _reset()
        try:
            runpy.run_path(path, run_name="__main__")
        except BaseException:  # noqa: BLE001 (SystemExit of a block too)
            sys.stderr.write(f"--- {name} failed\n--- program\n{program}\n--- traceback\n{traceback.format_exc()}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
