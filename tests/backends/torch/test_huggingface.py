"""A transformers model in the Hugging Face Trainer under a mixedpolicy policy, against the
Trainer's own bf16=True / fp16=True on the same seeded model and data."""

import logging
import warnings

import pytest

from conftest import require_module

torch = require_module("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import mixedpolicy as mp  # noqa: E402
from mixedpolicy.huggingface import Trainer  # noqa: E402

POISON = 2  # the optimizer step whose loss is made infinite


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def _data():
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(32)]
    return [dict(r, labels=r["input_ids"]) for r in rows]


def _args(tmp_path, **kw):
    return transformers.TrainingArguments(
        **{"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "max_steps": 6, "use_cpu": True,
           "report_to": [], "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True, "learning_rate": 1e-3,
           "seed": 0, **kw})


def _poisoned(base):
    class Poisoned(base):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss * float("inf") if self.state.global_step == POISON else loss
    return Poisoned


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("policy, native", [("bf16-mixed", "bf16"), ("16-mixed", "fp16")])
def test_the_trainer_under_a_policy_matches_its_own_mixed_precision(tmp_path, policy, native):
    theirs = transformers.Trainer(model=_model(), args=_args(tmp_path, **{native: True}), train_dataset=_data())
    theirs.train()
    ours = Trainer(model=_model(), args=_args(tmp_path), train_dataset=_data(), policy=policy)
    ours.train()
    # (on a CPU the Trainer's fp16=True is an autocast without a GradScaler: nothing overflows here)
    assert ours.loss_scale_optimizer.num_skipped_steps == 0
    assert ours.loss_scale_optimizer.loss_scaling.startswith("dynamic" if native == "fp16" else "no scaling")
    a, b = _losses(ours), _losses(theirs)
    assert len(a) == len(b) == 6
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arguments", [dict(torch_compile=True, torch_compile_backend="eager"),
                                       dict(gradient_checkpointing=True, gradient_accumulation_steps=2)],
                         ids=["torch_compile", "checkpointing-and-accumulation"])
def test_the_trainers_compile_checkpointing_and_accumulation_train_as_its_own_bf16(tmp_path, arguments):
    # torch_compile: GPT-2's forward breaks dynamo's graph, which made every region recurse (the
    # eager backend computes as eager PyTorch: theirs runs uncompiled)
    plain = {k: v for k, v in arguments.items() if not k.startswith("torch_compile")}
    theirs = transformers.Trainer(model=_model(), args=_args(tmp_path, bf16=True, **plain), train_dataset=_data())
    theirs.train()
    ours = Trainer(model=_model(), args=_args(tmp_path, **arguments), train_dataset=_data(), policy="bf16-mixed")
    ours.train()
    torch.testing.assert_close(torch.tensor(_losses(ours)), torch.tensor(_losses(theirs)), rtol=2e-2, atol=2e-2)


def test_a_non_finite_step_is_skipped_the_scheduler_waits_and_overrides_reach_their_layers(tmp_path):
    overrides = {"transformer.h.1.mlp": "float32"}
    trainer = _poisoned(Trainer)(model=_model(), args=_args(tmp_path, max_grad_norm=1.0), train_dataset=_data(),
                                 policy="mixed_float16", overrides=overrides)
    trainer.train()
    opt = trainer.loss_scale_optimizer
    assert opt.num_skipped_steps == 1 and float(opt.loss_scale) == 2.0**14
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    rows = {row.path: row for row in mp.describe(trainer.model)}
    assert rows["transformer.h.1.mlp.c_fc"].compute_dtype == "float32"
    assert rows["transformer.h.0.mlp.c_fc"].compute_dtype == "float16"
    # the linear schedule moved five times in six steps: the skipped step did not count
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs[POISON] == lrs[POISON + 1]
    # Accelerate's scaler is ours: the Trainer's own bookkeeping saw the skip
    assert trainer.accelerator.scaler.get_scale() == 2.0**14


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="fp16=True.*Set fp16=False and bf16=False"):
        Trainer(model=_model(), args=_args(tmp_path, fp16=True), train_dataset=_data(), policy="mixed_float16")
    with pytest.raises(ValueError, match="ambiguous"):
        Trainer(model=_model(), args=_args(tmp_path), train_dataset=_data(), policy="bf16")
    with pytest.raises(TypeError, match="scale_settings of type"):
        Trainer(model=_model(), args=_args(tmp_path), train_dataset=_data(), scale_settings=2.0)


def test_without_a_policy_the_global_one_decides(tmp_path):
    with mp.policy_scope("mixed_float16"):
        trainer = Trainer(model=_model(), args=_args(tmp_path, max_steps=2), train_dataset=_data(),
                          overrides={"lm_head": "float32"})
        trainer.train()
    assert trainer.loss_scale_optimizer.loss_scaling.startswith("dynamic")


def test_an_update_recipe_rounds_the_trainers_own_optimizer(tmp_path):
    trainer = Trainer(model=_model(), args=_args(tmp_path, max_steps=3), train_dataset=_data(),
                      policy="bfloat16_stochastic")
    trainer.train()
    inner = trainer.loss_scale_optimizer.inner_optimizer  # the Trainer's own AdamW, under the rule
    assert inner.param_groups[0]["stochastic_rounding_step"] == 3
    assert trainer.model.lm_head.weight.dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("policy, half", [("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")])
def test_the_base_model_called_directly_computes_as_under_autocast(policy, half):
    # model.transformer(...) (a Hugging Face model's body, as feature extraction calls it)
    # computes in the policy describe shows for it, as under hand-written autocast.
    plain, ids = _model().eval(), _data()[0]["input_ids"][None]
    ours = mp.apply_policy(_model().eval(), policy)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=getattr(torch, half)):
            expected = plain.transformer(ids).last_hidden_state
        got = ours.transformer(ids).last_hidden_state
    assert {r.path: r.compute_dtype for r in mp.describe(ours)}["transformer.h.0.attn.c_attn"] == half
    assert torch.equal(got, expected)
