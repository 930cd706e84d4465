"""mp.inspect_gradients: exact range counts, a loss scale that trains, the layer to keep in float32."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mixedpolicy as mp
from mixedpolicy import ranges
from conftest import require_module

# values +-2^k: where each lands in float16 and bfloat16 is known exactly
_EXPONENTS = st.integers(-126, 127)  # float32 normals (XLA on CPU flushes its subnormals)


def _expected(exponents, scale_exp):
    """(hist, [(overflow, subnormal, flushed) for float16, bfloat16]) for values 2^k scaled by 2^scale_exp."""
    hist = np.zeros(ranges.BINS, np.int64)
    for k in exponents:
        hist[k - ranges.EMIN] += 1
    out = []
    for top, low in ((15, -14), (127, -126)):  # largest exponent, smallest normal exponent
        smallest = low - (10 if top == 15 else 7)  # the smallest subnormal's exponent
        ks = [k + scale_exp for k in exponents]
        out.append((sum(k > top for k in ks), sum(smallest <= k < low for k in ks), sum(k < smallest for k in ks)))
    return hist, out


def _check(vector, exponents, scales, n_zeros=0, n_inf=0):
    stats = ranges.RangeStats.from_vector("x", "weight_grad", np.asarray(vector, np.float64), scales)
    assert stats.size == len(exponents) + n_zeros + n_inf and stats.zeros == n_zeros and stats.nonfinite == n_inf
    hist, _ = _expected(exponents, 0)
    assert (stats.hist == hist).all()
    assert stats.amax == (2.0 ** max(exponents) if exponents else 0.0)
    for s in scales:
        _, per_format = _expected(exponents, int(math.log2(s)))
        for fmt, counts in zip(ranges.FORMATS, per_format):
            n = stats.size
            assert stats.fractions[(fmt, s)] == tuple(c / n for c in counts), (fmt, s)


@settings(max_examples=40, deadline=None)
@given(st.lists(_EXPONENTS, min_size=1, max_size=60), st.lists(st.booleans(), min_size=60, max_size=60),
       st.integers(0, 3), st.integers(0, 2), st.sampled_from([2.0**8, 2.0**15, 2.0**24]))
def test_the_counts_are_exact_on_values_of_known_magnitude(exponents, signs, zeros, infs, scale):
    values = [(-1.0 if sg else 1.0) * 2.0**k for k, sg in zip(exponents, signs)] + [0.0] * zeros + [np.inf] * infs
    x = np.asarray(values, np.float32)
    scales = (1.0, scale)
    _check(ranges.numpy_stats(x, scales), exponents, scales, zeros, infs)
    torch = pytest.importorskip("torch")
    from mixedpolicy.backends.torch.ranges import stats as torch_stats

    _check(torch_stats(torch.from_numpy(x), scales).numpy(), exponents, scales, zeros, infs)
    jnp = pytest.importorskip("jax.numpy")
    from mixedpolicy.backends.jax.ranges import stats as jax_stats

    _check(np.asarray(jax_stats(jnp.asarray(x), scales)), exponents, scales, zeros, infs)


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y


def test_the_recommended_scale_trains_under_float16_and_the_hot_layer_stays_float32():
    torch = require_module("torch")
    x, y = _digits()
    x, y = torch.from_numpy(x), torch.from_numpy(y)

    class Hot(torch.nn.Module):
        """A layer forced out of float16's range: the output is its input, but its weight's
        gradient is 1e8 times the output's."""

        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(32))

        def forward(self, h):
            return h + (self.gain - self.gain.detach()) * 1e8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), Hot(), torch.nn.Linear(32, 10))
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 256, 64)]

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]).float(), b[1])

    before = [p.detach().clone() for p in model.parameters()]
    report = mp.inspect_gradients(model, loss_fn, batches, loss_scale=2.0**15)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing trained
    assert all(p.grad is None for p in model.parameters())  # the user's gradients as they were
    assert {r.kind for r in report} == {"weight", "activation", "activation_grad", "weight_grad"}
    assert report.row("0", "weight").size == 64 * 32 + 32  # its weight and bias, once
    assert report.row("2").amax > 65504
    advice = report.recommend()
    assert advice.overrides == {"2": "float32"}, advice.reasons
    assert advice.loss_scale >= 2.0**10 and math.log2(advice.loss_scale).is_integer()
    assert "2" in str(report) and "weight_grad" in str(report)
    # the advice, pasted: float16 with that static scale, the hot layer in float32
    mp.apply_policy(model, "mixed_float16", advice.overrides)
    assert mp.describe(model)[3].policy.compute_dtype == "float32"
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                loss_scale=mp.StaticLossScale(advice.loss_scale))
    for step in range(40):
        b = batches[step % len(batches)]
        opt.scale_loss(loss_fn(model, b)).backward()
        opt.step()
        opt.zero_grad()
    assert opt.num_skipped_steps == 0
    assert loss_fn(model, batches[0]) < 1.0


def test_jax_nnx_and_pytrees_report_by_layer_path():
    jax = require_module("jax")
    require_module("flax", "jax")
    import jax.numpy as jnp
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self):
            self.hidden = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
            self.out = nnx.Linear(16, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32)
    report = mp.inspect_gradients(MLP(), lambda m, b: jnp.mean(m(b) ** 2), [x, x], loss_scale=1024)
    assert [(r.path, r.kind) for r in report] == [("hidden", "weight"), ("hidden", "weight_grad"),
                                                  ("out", "weight"), ("out", "weight_grad")]
    assert report.row("hidden", "weight").size == 8 * 16 + 16  # once, however many batches
    assert report.row("hidden").size == 2 * (8 * 16 + 16)  # two batches
    params = {"dense": {"kernel": jnp.full((8, 4), 1e-3), "bias": jnp.zeros(4)}}
    tree = mp.inspect_gradients(params, lambda p, b: jnp.sum(b @ p["dense"]["kernel"] + p["dense"]["bias"]), x)
    assert [(r.path, r.kind) for r in tree] == [("dense", "weight"), ("dense", "weight_grad")]
    assert tree.row("dense").size == 36 and tree.row("dense", "weight").amax == pytest.approx(1e-3)


def test_bad_input_says_what_was_expected():
    with pytest.raises(ValueError, match="loss_scale=-1; expected a finite number > 0"):
        mp.inspect_gradients(object(), None, [1], loss_scale=-1)
    with pytest.raises(ValueError, match="Received no batches"):
        mp.inspect_gradients(object(), None, [])
    with pytest.raises(TypeError, match=r"loss_fn of type NoneType; expected a function loss_fn\(model, batch\)"):
        mp.inspect_gradients({"w": np.ones(2)}, None, [1])  # before any framework runs it
    with pytest.raises(ValueError, match="margin=0.5"):
        mp.GradientReport([], (1.0,), "numpy", 1).recommend(margin=0.5)
    torch = require_module("torch")
    with pytest.raises(KeyError, match="No weight_grad row for 'nope'; the report has: 0"):
        mp.inspect_gradients(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                             lambda m, b: m(b).sum(), torch.ones(1, 2)).row("nope")


def test_the_cli_inspects_a_bench_model_and_writes_the_figure(tmp_path, capsys):
    require_module("torch")
    pytest.importorskip("sklearn")
    from mixedpolicy.__main__ import main

    assert main(["inspect", "--model", "mlp", "--framework", "torch", "--batches", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "recommended static loss scale" in out and "weight_grad" in out
    if __import__("importlib").util.find_spec("matplotlib"):
        assert (tmp_path / "inspect_mlp_torch.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["inspect", "--batches", "0"]) == 2
    # said, not a traceback
    for bad in (["--loss-scale", "-1"], ["--loss-scale", "nan"], ["--loss-scale", "1e40"], ["--seed", "-5"],
                ["--batch-size", "0"], ["--batch-size", "5000"]):
        capsys.readouterr()
        assert main(["inspect", *bad, "--out", str(tmp_path)]) == 2
        assert f"Received {bad[0]}" in capsys.readouterr().err
    # a user's own model, its framework inferred as the bench infers it
    users = f"{__import__('pathlib').Path(__file__).parent / 'bench' / 'user_models.py'}"
    capsys.readouterr()
    assert main(["inspect", "--model", f"{users}:torch_mlp", "--framework", "jax", "--out", str(tmp_path)]) == 2
    assert "--framework jax for --model" in capsys.readouterr().err
    if __import__("importlib").util.find_spec("transformers"):  # a factory with its own batches and loss
        assert main(["inspect", "--model", f"{users}:hf_gpt2", "--batches", "1", "--out", str(tmp_path)]) == 0
        out = capsys.readouterr().out  # its layers' gradients on its token batches (no digits)
        assert "transformer.h.0.attn.c_attn" in out and "lm_head" in out and "recommended static loss scale" in out
        assert main(["inspect", "--model", f"{users}:hf_gpt2", "--batch-size", "8", "--out", str(tmp_path)]) == 2
        assert "brings its own batches (their size is the batch size); drop --batch-size" in capsys.readouterr().err
    if __import__("importlib").util.find_spec("flax"):  # a Flax NNX model with float targets and its own loss
        assert main(["inspect", "--model", f"{users}:nnx_regression", "--batches", "2", "--out", str(tmp_path)]) == 0
        assert "weight_grad" in capsys.readouterr().out
        # a kind inspect --model does not read: said as inspect's, with where the API reads it
        assert main(["inspect", "--model", f"{users}:linen_mlp", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "inspect --model reads" in err and "mp.inspect_gradients also reads" in err and "the bench runs" not in err
    assert main(["inspect", "--model", f"{users}:torch_mlp", "--batches", "1", "--out", str(tmp_path)]) == 0
    assert "recommended static loss scale" in capsys.readouterr().out
    if __import__("importlib").util.find_spec("matplotlib"):
        assert (tmp_path / "inspect_torch_mlp_torch.png").exists()


def test_fp8_what_if_counts_what_per_tensor_scaling_loses_and_names_the_layers():
    """Per-tensor current scaling maps the largest |x| to the format's top, so what is lost is
    what lands below the smallest normal (subnormal) or half the smallest subnormal (zero)."""
    from mixedpolicy.float8_ranges import table
    from mixedpolicy.gradient_report import GradientReport
    from mixedpolicy.ranges import RangeStats, numpy_stats

    values = np.array([1.0] * 80 + [2.0**-31] * 10 + [2.0**-40] * 10, np.float32)
    rows = [RangeStats.from_vector("body", "activation_grad", numpy_stats(values, (1.0,)), (1.0,)),
            RangeStats.from_vector("head", "activation_grad", numpy_stats(np.ones(8, np.float32), (1.0,)), (1.0,)),
            RangeStats.from_vector("body", "activation", numpy_stats(values, (1.0,)), (1.0,)),
            RangeStats.from_vector("body", "weight", numpy_stats(values[:90], (1.0,)), (1.0,))]
    report = GradientReport(rows, (1.0,), "numpy", 1)
    body, head, out, weight = report.float8()
    # the weights, e4m3 like the outputs: 2^-31 * 448 lands below half e4m3's smallest subnormal
    assert (weight.kind, weight.format, weight.flushed) == ("weight", "float8_e4m3fn", 10 / 90)
    assert (body.format, body.subnormal, body.flushed) == ("float8_e5m2", 0.1, 0.1)  # 2^-31 * 57344 < 2^-14
    assert (head.subnormal, head.flushed) == (0.0, 0.0)
    assert out.format == "float8_e4m3fn" and out.flushed == 0.2  # e4m3's range is narrower
    advice = report.recommend_float8("mixed_bfloat16", max_flushed=0.05)
    assert advice.overrides == {"body": "mixed_bfloat16"} and "flush to zero in float8_e5m2" in advice.reasons["body"]
    assert report.recommend_float8(max_flushed=0.2).overrides == {}
    assert "float8_e5m2" in table(report.float8())
    with pytest.raises(ValueError, match="max_flushed=2"):
        report.recommend_float8(max_flushed=2)


def test_fp8_what_if_under_per_row_scaling_sees_each_row_by_its_own_max():
    """A row of small values next to a row of large ones: per-tensor scaling flushes the small
    row in e4m3, per-row scaling (the rowwise recipes) keeps it; within a row what lies far
    below the row's max is lost either way."""
    from mixedpolicy.float8_ranges import table, what_if
    from mixedpolicy.ranges import EMIN, RangeStats, numpy_stats

    x = np.array([[1.0] * 8, [2.0**-31] * 7 + [2.0**-52]], np.float32)
    (loss,) = what_if([RangeStats.from_vector("body", "activation", numpy_stats(x, (1.0,)), (1.0,))], EMIN)
    assert loss.flushed == 8 / 16  # 2^-31 * 448 is below half e4m3's smallest subnormal (2^-10)
    assert loss.row_flushed == 1 / 16 and loss.row_subnormal == 0.0  # 2^-21 of its row's max
    assert "row zero" in table([loss]) and "6.25%" in table([loss])


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 5), st.integers(0, 7), st.integers(0, 2**31 - 1))
def test_the_per_row_counts_are_the_same_on_every_backend(n_rows, width, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_rows, width)) * 2.0 ** rng.integers(-30, 30, (n_rows, 1))).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = 0.0
    x[rng.random(x.shape) < 0.05] = np.inf
    want = ranges.numpy_stats(x, (1.0,))
    assert want[-ranges.ROW_BINS:].sum() == np.sum(np.isfinite(x) & (x != 0))
    torch = pytest.importorskip("torch")
    from mixedpolicy.backends.torch.ranges import stats as torch_stats

    np.testing.assert_array_equal(torch_stats(torch.from_numpy(x), (1.0,)).numpy(), want)
    jnp = pytest.importorskip("jax.numpy")
    from mixedpolicy.backends.jax.ranges import stats as jax_stats

    np.testing.assert_array_equal(np.asarray(jax_stats(jnp.asarray(x), (1.0,))), want)


def test_a_weights_rows_are_what_each_output_multiplies_on_torch_and_jax():
    """A layer with one output's weights 2^-30 times the others': per-tensor scaling flushes
    them in e4m3, per-row scaling (each output's own max) keeps them, on both layouts."""
    torch = require_module("torch")
    from mixedpolicy.backends.jax.ranges import by_output as jax_by_output, merged
    from mixedpolicy.backends.torch.ranges import by_output, stats
    from mixedpolicy.float8_ranges import what_if
    from mixedpolicy.ranges import EMIN, RangeStats

    w = np.ones((4, 8), np.float32)  # torch's (out, in)
    w[3] *= 2.0**-30
    for vector in (stats(by_output(torch.from_numpy(w)), (1.0,)).numpy(),
                   merged([jax_by_output(require_module("jax").numpy.asarray(w.T))], (1.0,))):  # kernel (in, out)
        (loss,) = what_if([RangeStats.from_vector("dense", "weight", vector, (1.0,))], EMIN)
        assert (loss.flushed, loss.row_flushed) == (0.25, 0.0)
