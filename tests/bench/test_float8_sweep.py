"""`python -m mixedpolicy.bench.float8_sweep`: fp8 against bf16 by layer size and on gpt2 (its
figures come from a GPU; on a CPU fp8 is emulated, so this checks what it runs, never speed)."""

import json

import pytest

from conftest import require_module

require_module("torch")
require_module("torchao", "torch")

from mixedpolicy.bench import float8_sweep  # noqa: E402


def test_each_size_times_the_same_weights_and_data_on_every_side(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert float8_sweep.main(["--device", "cpu", "--sizes", "32,64", "--layers", "1", "--tokens", "64",
                              "--compile", "off", "--repeats", "2", "--warmup", "0", "--min-block-time", "0",
                              "--auto-filter", "on", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["d_model"] for r in rows] == [32, 64]
    for row in rows:
        first = row["first_loss"]
        assert first["fp8"] == first["torchao"] and first["fp8 auto"] == first["torchao auto"]
        assert set(row) >= {"fp8 / bf16", "fp8 / torchao", "fp8 auto / bf16", "fp8 auto / torchao auto"}
        assert row["fp8 / torchao"]["q1"] <= row["fp8 / torchao"]["median"] <= row["fp8 / torchao"]["q3"]
    assert "fp8 auto / torchao auto" in capsys.readouterr().out


def test_gpt2_compares_the_built_in_rules_and_the_auto_filter():
    row = float8_sweep.measure_gpt2(2, "tensorwise", "cpu", compile_on=False, repeats=2, warmup=0,
                                    min_block_time=0.0)
    assert row["model"] == "gpt2" and row["first_loss"]["fp8"] == pytest.approx(row["first_loss"]["torchao"])
    assert row["first_loss"]["fp8 auto"] == pytest.approx(row["first_loss"]["torchao auto"])


@pytest.mark.parametrize("argv, says", [
    (["--sizes", "100"], "positive multiples of 16"),
    (["--sizes", "a,b"], "positive multiples of 16"),
    (["--recipe", "delayed"], "tensorwise, rowwise or rowwise_with_gw_hp"),
    (["--recipe", "nope"], "nope"),
    (["--model", "linear", "--shapes", "768x100"], "in_features x out_features"),
    (["--model", "linear", "--shapes", "768"], "in_features x out_features"),
    (["--model", "linear", "--shapes", "16x16x16"], "in_features x out_features"),
    (["--repeats", "0"], "--repeats 0: expected a whole number >= 1"),
    (["--model", "linear", "--tokens", "0"], "--tokens 0: expected a whole number >= 1"),
    (["--model", "gpt2", "--batch-size", "0"], "--batch-size 0: expected a whole number >= 1"),
    (["--warmup", "-1"], "--warmup -1: expected a whole number >= 0"),
    (["--min-block-time", "-1"], "--min-block-time -1.0: expected seconds from 0 to 60"),
    # an option the chosen model does not read would do nothing: refused
    (["--shapes", "16x16"], "--shapes is for --model linear; --model blocks does not read it"),
    (["--model", "linear", "--sizes", "64"], "--sizes is for --model blocks"),
    (["--model", "gpt2", "--layers", "3"], "--layers is for --model blocks"),
    (["--model", "linear", "--auto-filter", "on"], "--auto-filter is for --model blocks or gpt2"),
    (["--model", "gpt2", "--tokens", "64"], "--tokens is for --model blocks or linear"),
    # refused before the sweep, not when its rows are written
    (["--out", "/"], "which is a folder; expected a file name"),
    (["--out", "/no/such/folder/rows.json"], "cannot be written"),
])
def test_bad_arguments_are_refused_with_the_fix(argv, says, capsys):
    assert float8_sweep.main(["--device", "cpu", *argv]) == 2
    assert says in capsys.readouterr().err


def test_linear_times_each_shape_and_says_what_the_auto_filter_does_with_it(tmp_path, capsys):
    out = tmp_path / "linear.json"
    assert float8_sweep.main(["--device", "cpu", "--model", "linear", "--shapes", "32x64,4096x2048",
                              "--tokens", "16", "--compile", "off", "--repeats", "2", "--warmup", "0",
                              "--min-block-time", "0", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == [[32, 64], [4096, 2048]]
    assert [r["too_small_to_gain"] for r in rows] == [True, False]
    for row in rows:  # the layer itself is in fp8 on that side: its first loss is not bf16's
        assert set(row["ms"]) == {"bf16", "fp8"} and row["first_loss"]["fp8"] != row["first_loss"]["bf16"]
    printed = capsys.readouterr().out
    assert "32 -> 64 (auto filter: keeps it out)" in printed and "4096 -> 2048 (auto filter: fp8)" in printed
