"""`python -m mixedpolicy.bench.skip_sweep`: the optax wrapper's skip (selects, a cond) timed
against the bare AdamW step, donated and not. Behaviour only: no speed is asserted."""

import json

import pytest

from conftest import require_module

require_module("jax")
require_module("optax", "jax")

from mixedpolicy.bench import skip_sweep  # noqa: E402


def test_the_sweep_times_every_side_on_the_same_steps(tmp_path, capsys):
    out = tmp_path / "skip.json"
    assert skip_sweep.main(["--d-model", "4,8", "--repeats", "2", "--calls", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["d_model"], r["donated"]) for r in rows] == [(4, True), (4, False), (8, True), (8, False)]
    for row in rows:
        assert row["parameters"] == 208 * row["d_model"] ** 2 + 109 * row["d_model"]
        assert row["same_parameters"] and row["bare_s"] > 0
        for side in ("selects/bare", "cond/bare"):
            median, low, high = row[side]
            assert 0 < low <= median <= high
    assert "selects/bare" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--d-model", "wide"], "expected whole numbers separated by commas"),
    (["--d-model", "0"], "at least 1"),
    (["--donate", "maybe"], "invalid choice"),
    # refused before minutes of timing, not when the rows are written
    (["--out", "/"], "which is a folder; expected a file name"),
    (["--out", "/no/such/folder/rows.json"], "cannot be written"),
])
def test_bad_options_are_refused_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        skip_sweep.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
