"""A transformers model in the Hugging Face Trainer under a mixedpolicy policy, against the
Trainer's own bf16=True / fp16=True on the same seeded model and data."""

import copy
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
    # the logits the Trainer's evaluation reads come back in float32 under both
    batch = {"input_ids": _data()[0]["input_ids"][None]}
    assert ours.model(**batch).logits.dtype == theirs.model(**batch).logits.dtype == torch.float32


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
    assert opt.num_skipped_steps == 1 and float(opt.loss_scale) == 2.0**15  # from GradScaler's 2**16
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    rows = {row.path: row for row in mp.describe(trainer.model)}
    assert rows["transformer.h.1.mlp.c_fc"].compute_dtype == "float32"
    assert rows["transformer.h.0.mlp.c_fc"].compute_dtype == "float16"
    # the linear schedule moved five times in six steps: the skipped step did not count
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs[POISON] == lrs[POISON + 1]
    # Accelerate's scaler is ours: the Trainer's own bookkeeping saw the skip
    assert trainer.accelerator.scaler.get_scale() == 2.0**15


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="fp16=True.*Set fp16=False and bf16=False"):
        Trainer(model=_model(), args=_args(tmp_path, fp16=True), train_dataset=_data(), policy="mixed_float16")
    with pytest.raises(ValueError, match="ambiguous"):
        Trainer(model=_model(), args=_args(tmp_path), train_dataset=_data(), policy="bf16")
    # evaluate() would cast the whole model (the policy's float32 layers too) and leave it cast
    for flag in ("bf16_full_eval", "fp16_full_eval"):
        model = _model()
        with pytest.raises(ValueError, match=f"{flag}=True.*leave the model so for training. Set {flag}=False"):
            Trainer(model=model, args=_args(tmp_path, **{flag: True}), train_dataset=_data(), policy="mixed_bfloat16")
        assert {row.source for row in mp.describe(model)} == {"no policy applied"}
    with pytest.raises(TypeError, match="scale_settings of type"):
        Trainer(model=_model(), args=_args(tmp_path), train_dataset=_data(), scale_settings=2.0)
    # the settings are checked when the Trainer is made, not at the first step of train()
    model = _model()
    with pytest.raises(TypeError, match=r"scale_settings with \['initial_scal'\]; expected only initial_scale"):
        Trainer(model=model, args=_args(tmp_path), train_dataset=_data(), scale_settings={"initial_scal": 2.0})
    with pytest.raises(ValueError, match="initial_scale=-1.0"):
        Trainer(model=model, args=_args(tmp_path), train_dataset=_data(), scale_settings={"initial_scale": -1})
    with pytest.raises(TypeError, match="skip_nonfinite='no'"):
        Trainer(model=model, args=_args(tmp_path), train_dataset=_data(), scale_settings={"skip_nonfinite": "no"})
    with pytest.raises(TypeError, match="Received policy=3 of type int"):
        Trainer(model=model, args=_args(tmp_path), train_dataset=_data(), policy=3)
    assert {row.source for row in mp.describe(model)} == {"no policy applied"}  # the model untouched


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


def _declaring_models():
    """Tiny transformers models that declare layers kept in float32, with rotary buffers."""
    t = transformers
    yield "t5", t.T5ForConditionalGeneration, t.T5Config(  # _keep_in_fp32_modules = ["wo"]: float16 only
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    yield "deepseek_v3", t.DeepseekV3ForCausalLM, t.DeepseekV3Config(  # its router: strict, bfloat16 too
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32)


def _saved(tmp_path, cls, config):
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "saved")
    return str(tmp_path / "saved")


def _floating_dtypes(model):
    return {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()}


@pytest.mark.parametrize("name, cls, config", list(_declaring_models()), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("policy", ["float16", "bfloat16"])
def test_a_pure_policy_keeps_what_the_model_keeps_in_float32_as_its_own_half_precision_load(
        tmp_path, name, cls, config, policy):
    saved = _saved(tmp_path, cls, config)
    theirs = cls.from_pretrained(saved, dtype=getattr(torch, policy))
    ours = mp.apply_policy(cls.from_pretrained(saved), policy)
    expected = _floating_dtypes(theirs)
    assert _floating_dtypes(ours) == expected
    kept = {n for n, dtype in expected.items() if dtype == torch.float32}
    assert any("inv_freq" in n for n in kept) or name == "t5"  # rotary frequencies: never stored in half
    declared = {"t5": ".wo.", "deepseek_v3": ".mlp.gate."}[name]
    held = policy == "float16" or name == "deepseek_v3"  # T5 keeps its wo in float32 under float16 only
    assert any(declared in n for n in kept) == held
    layer = next(n.rsplit(".", 1)[0] for n in sorted(expected) if declared in n)
    row = {row.path: row for row in mp.describe(ours)}[layer]
    assert row.variable_dtype == row.compute_dtype == ("float32" if held else policy)
    assert row.source.startswith("built-in rule: keep_float32") == held
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same math, and the loss in the dtype the model computes it in
        mine, expected = ours(input_ids=ids, labels=ids), theirs(input_ids=ids, labels=ids)
        assert mine.loss.dtype == expected.loss.dtype  # (float32 but T5's, in its half dtype)
        torch.testing.assert_close(mine.loss, expected.loss, rtol=1e-2, atol=0)
        assert mine.logits.dtype == getattr(torch, policy)  # the rest in the policy's output dtype
    # a mixed policy stores every weight in float32 and the rule has nothing to keep; a key wins
    mixed = mp.apply_policy(cls.from_pretrained(saved), f"mixed_{policy}", overrides={layer: policy})
    assert {row.path: row for row in mp.describe(mixed)}[layer].source == f"map key {layer!r}"
    assert all(dtype == torch.float32 for n, dtype in _floating_dtypes(mixed).items() if not n.startswith(layer))


def test_pure_bfloat16_in_the_trainer_trains_as_the_models_own_bfloat16_load_bit_for_bit(tmp_path):
    _, cls, config = list(_declaring_models())[1]
    saved = _saved(tmp_path, cls, config)
    theirs = transformers.Trainer(model=cls.from_pretrained(saved, dtype=torch.bfloat16), args=_args(tmp_path),
                                  train_dataset=_data())
    theirs.train()
    ours = Trainer(model=cls.from_pretrained(saved), args=_args(tmp_path), train_dataset=_data(), policy="bfloat16")
    ours.train()
    expected = dict(theirs.model.named_parameters())
    for n, p in ours.model.named_parameters():
        assert p.dtype == expected[n].dtype and torch.equal(p, expected[n]), n
    assert _losses(ours) == _losses(theirs)  # logged as the model computed them (float32)


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


def _architectures():
    """Tiny models of the families users fine-tune, each with inputs of its own: (name, build,
    inputs)."""
    t, g = transformers, torch.Generator().manual_seed(0)
    ids = torch.randint(2, 64, (2, 12), generator=g)
    short = ids[:, :6].contiguous()
    yield "llama", lambda: t.LlamaForCausalLM(t.LlamaConfig(  # grouped-query attention, rotary, RMSNorm
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32)), dict(input_ids=ids, labels=ids)
    yield "t5", lambda: t.T5ForConditionalGeneration(t.T5Config(  # relative attention, encoder-decoder
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        dropout_rate=0.0)), dict(input_ids=ids, labels=short)
    yield "whisper", lambda: t.WhisperForConditionalGeneration(t.WhisperConfig(  # convolutions on features
        vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=16, decoder_start_token_id=1, pad_token_id=0)), dict(
        input_features=torch.randn(2, 8, 16, generator=g), labels=short)
    yield "clip", lambda: t.CLIPModel(t.CLIPConfig(  # two towers and a learned logit scale
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=1),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2), projection_dim=16)), dict(
        input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g), return_loss=True)
    yield "mixtral", lambda: t.MixtralForCausalLM(t.MixtralConfig(  # a routed mixture of experts
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)), dict(
        input_ids=ids, labels=ids)
    yield "mamba", lambda: t.MambaForCausalLM(t.MambaConfig(  # a selective state-space scan, no attention
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)), dict(
        input_ids=ids, labels=ids)


@pytest.mark.parametrize("policy, half", [("mixed_bfloat16", torch.bfloat16), ("mixed_float16", torch.float16)],
                         ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, build, inputs", list(_architectures()), ids=lambda v: v if isinstance(v, str) else "")
def test_transformers_families_train_as_autocast_and_grad_scaler_do(name, build, inputs, policy, half):
    # decoder, encoder-decoder, speech, two-tower, mixture-of-experts and state-space models: the
    # policy's loss, skipped steps, scale and weights after two AdamW steps are hand-written
    # autocast + GradScaler's, bit for bit (CLIP's float16 steps overflow at 2**15 and 2**14 on both sides)
    torch.manual_seed(0)
    theirs = build().train()
    ours = mp.apply_policy(copy.deepcopy(theirs), policy)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 15, enabled=half == torch.float16)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(ours.parameters(), lr=1e-3), policy=policy)
    skipped = 0
    for _ in range(2):
        torch.manual_seed(1)  # the same dropout masks
        with torch.autocast("cpu", dtype=half):
            expected = theirs(**inputs).loss
        torch.manual_seed(1)
        got = ours(**inputs).loss
        assert torch.equal(got, expected), name
        their_opt.zero_grad()
        scaler.scale(expected).backward()
        scaler.step(their_opt)
        before = scaler.get_scale()
        scaler.update()
        skipped += scaler.get_scale() < before
        opt.zero_grad()
        opt.scale_loss(got).backward()
        opt.step()
    if scaler.is_enabled():
        assert opt.loss_scale == scaler.get_scale()
    assert opt.num_skipped_steps == skipped == (2 if (name, half) == ("clip", torch.float16) else 0)
    for (n, mine), theirs_p in zip(ours.named_parameters(), theirs.parameters()):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs_p), n


# -- a loop written with Accelerate: mixedpolicy.huggingface.Accelerator -------------------------
@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps one process-wide state; each test starts from none and leaves none."""
    import accelerate

    accelerate.state.AcceleratorState._reset_state(True)
    yield accelerate
    accelerate.state.AcceleratorState._reset_state(True)


def _accelerate_loop(accelerator, steps=6, poison=POISON, state=None, start=0):
    """A user's Accelerate loop (prepare, backward, clip_grad_norm_, step, scheduler, zero_grad)
    on a seeded MLP; the loss at step `poison` is made infinite. Returns (losses, skipped,
    learning rates, gradient norms, the prepared optimizer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]
    model, opt, sched = accelerator.prepare(model, opt, sched)
    if state is not None:
        accelerator.load_state(state)
    out = ([], [], [], [])
    for i, (x, y) in enumerate(data[start:], start):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        accelerator.backward(loss * float("inf") if i == poison else loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        for seq, value in zip(out, (float(loss), opt.step_was_skipped, sched.get_last_lr()[0], float(norm))):
            seq.append(value)
    return (*out, opt)


def test_an_accelerate_loop_under_a_policy_trains_as_accelerates_bf16_and_skips_what_it_applies(fresh_accelerate):
    from mixedpolicy.huggingface import Accelerator

    ours = _accelerate_loop(Accelerator(cpu=True, policy="mixed_bfloat16"))
    fresh_accelerate.state.AcceleratorState._reset_state(True)
    native = _accelerate_loop(fresh_accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    # the same autocast-level numerics up to the poisoned step (bfloat16 rounding apart)
    assert ours[0][:POISON] == pytest.approx(native[0][:POISON], rel=2e-2)
    # Accelerate's bf16 applies the infinite step and never recovers; ours skips it, and the
    # prepared scheduler waits a step as Accelerate makes it wait for GradScaler's skips
    assert ours[1] == [i == POISON for i in range(6)] and not any(native[1])
    assert all(map(lambda v: v == v and abs(v) < 1e9, ours[0][POISON + 1:]))
    assert ours[2][POISON] == ours[2][POISON - 1] and native[2][POISON] < native[2][POISON - 1]


def test_a_prepared_models_outputs_come_back_in_float32_as_under_accelerates_own(fresh_accelerate):
    # a loss computed outside the model then runs in float32, as under Accelerate's fp16/bf16
    import mixedpolicy as mp
    from mixedpolicy.huggingface import Accelerator

    models = {}
    for name, make in (("ours", lambda: Accelerator(cpu=True, policy="mixed_float16", overrides={"1": "float32"})),
                       ("accelerate's", lambda: fresh_accelerate.Accelerator(cpu=True, mixed_precision="bf16"))):
        fresh_accelerate.state.AcceleratorState._reset_state(True)
        torch.manual_seed(0)
        models[name] = make().prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                                          torch.nn.Linear(8, 2)))
    assert {name: m(torch.randn(3, 4)).dtype for name, m in models.items()} == {
        "ours": torch.float32, "accelerate's": torch.float32}
    # inside, the layers still compute as describe says
    computes = {r.path: r.compute_dtype for r in mp.describe(models["ours"])}
    assert computes["0"] == computes["2"] == "float16" and computes["1"] == "float32"


def test_an_accelerate_loop_under_mixed_float16_clips_true_gradients_and_resumes_its_scale(fresh_accelerate, tmp_path):
    from mixedpolicy.huggingface import Accelerator

    reference = _accelerate_loop(Accelerator(cpu=True, policy="float32"))
    fresh_accelerate.state.AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, policy="mixed_float16", overrides={"3": "float32"})
    losses, skipped, _, norms, opt = _accelerate_loop(accelerator)
    # clip_grad_norm_ saw the unscaled gradients (scaled ones are 2**16 larger)
    assert norms[0] == pytest.approx(reference[3][0], rel=2e-2)
    assert skipped == [i == POISON for i in range(6)] and accelerator.scaler.get_scale() == 2.0**15
    layers = {row.path: row for row in mp.describe(accelerator._models[0])}
    assert layers["3"].compute_dtype == "float32" and layers["0"].compute_dtype == "float16"  # the override reached it
    # save_state after step 3, load into a fresh run: the scale and skip count come back, and
    # the run goes on as the uninterrupted one
    fresh_accelerate.state.AcceleratorState._reset_state(True)
    first = Accelerator(cpu=True, policy="mixed_float16", overrides={"3": "float32"})
    _accelerate_loop(first, steps=4)
    first.save_state(str(tmp_path / "ckpt"))
    fresh_accelerate.state.AcceleratorState._reset_state(True)
    resumed = Accelerator(cpu=True, policy="mixed_float16", overrides={"3": "float32"})
    after = _accelerate_loop(resumed, state=str(tmp_path / "ckpt"), start=4)
    assert after[4].optimizer.num_skipped_steps == 1 and resumed.scaler.get_scale() == 2.0**15
    assert after[0] == pytest.approx(losses[4:], rel=1e-6)


def test_the_accelerator_refuses_what_would_undo_the_policy(fresh_accelerate, monkeypatch):
    from mixedpolicy.huggingface import Accelerator

    with pytest.raises(ValueError, match="mixed_precision='fp16'.*Leave mixed_precision at 'no'"):
        Accelerator(cpu=True, mixed_precision="fp16", policy="mixed_float16")
    assert not fresh_accelerate.state.AcceleratorState._shared_state  # refused before Accelerate set its state
    with monkeypatch.context() as env:  # what accelerate launch's configuration sets
        env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
        with pytest.raises(ValueError, match="mixed_precision='bf16'.*ACCELERATE_MIXED_PRECISION"):
            Accelerator(cpu=True, policy="mixed_bfloat16")
    fresh_accelerate.state.AcceleratorState._reset_state(True)
    fresh_accelerate.state.AcceleratorState._reset_state(True)
    with pytest.raises(TypeError, match="scale_settings of type"):
        Accelerator(cpu=True, scale_settings=2.0)
    fresh_accelerate.state.AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, policy="mixed_float16")
    generator, critic = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    accelerator.prepare(torch.optim.SGD(generator.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="second optimizer.*already scales the loss.*scale_loss"):
        accelerator.prepare(torch.optim.SGD(critic.parameters(), lr=0.1))


def test_two_optimizers_under_a_bfloat16_policy_each_skip_their_own_step(fresh_accelerate):
    from mixedpolicy.huggingface import Accelerator

    accelerator = Accelerator(cpu=True, policy="mixed_bfloat16")
    torch.manual_seed(0)
    generator, critic = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    generator, critic, g_opt, c_opt = accelerator.prepare(
        generator, critic, torch.optim.SGD(generator.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    c_before = critic.weight.detach().clone()
    accelerator.backward(critic(generator(x).detach()).float().mean() * float("inf"))
    c_opt.step()
    accelerator.backward(critic(generator(x)).float().mean())
    g_opt.step()
    assert c_opt.step_was_skipped and torch.equal(critic.weight.detach(), c_before)
    assert not g_opt.step_was_skipped and torch.isfinite(generator.weight).all()


@pytest.mark.parametrize("version", [1, 2])
def test_under_accelerates_fsdp_plugin_fsdp_reduces_in_the_policys_reduce_dtype(fresh_accelerate, version):
    """Accelerate builds FSDP's MixedPrecision from mixed_precision, which the policy replaces:
    the plugin is given the one the policy says (parameters gathered as stored, the reduce dtype
    the policy's), and what FSDP cannot carry is refused before Accelerate wraps, the model given
    back as it was. Accelerate runs FSDP only on GPUs: here its plugin is put on the state by hand
    (prepare_model then goes on without wrapping)."""
    from accelerate import FullyShardedDataParallelPlugin
    from mixedpolicy.huggingface import Accelerator

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))

    def prepared(policy, overrides=None, model=None, **plugin_kw):
        fresh_accelerate.state.AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True, policy=policy, overrides=overrides)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version, **plugin_kw)
        accelerator.state.fsdp_plugin = plugin
        accelerator.prepare_model(net() if model is None else model)
        return plugin.mixed_precision_policy

    kind = "MixedPrecisionPolicy" if version == 2 else "MixedPrecision"
    got = prepared(mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16"))
    assert type(got).__name__ == kind and got.param_dtype is None and got.reduce_dtype == torch.bfloat16
    got = prepared("mixed_float16")  # float32 weights reduced in float32: no cast
    assert got.param_dtype is None and got.reduce_dtype is None
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    said = (MixedPrecisionPolicy if version == 2 else MixedPrecision)(reduce_dtype=torch.float32)
    got = prepared("mixed_float16", mixed_precision_policy=said)
    assert got.param_dtype is None and got.reduce_dtype is None  # the same said outright: taken
    # a pure policy keeps its norms in float32: each gradient in its own dtype, in units of their own
    got = prepared("bfloat16", auto_wrap_policy="size_based_wrap")
    assert got.param_dtype is None and got.reduce_dtype is None
    for policy, overrides, kw, message in [
        ("bfloat16", None, {}, r"\['bfloat16', 'float32'\].*no auto_wrap_policy.*auto_wrap_policy="),
        (mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16"), {"2": "mixed_bfloat16"}, {},
         r"reduce gradients in \['bfloat16', 'float32'\].*one reduce dtype"),
        (mp.Policy("mixed_bfloat16", reduce_dtype="float8_e5m2"), None, {}, r"reduce gradients in \['float8_e5m2'\]"),
        ("mixed_bfloat16", None, {"mixed_precision_policy": "bf16"}, r"mixed_precision_policy=.*Leave .* unset"),
    ]:
        model = net()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=message):
            prepared(policy, overrides, model=model, **kw)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert all(row.source == "no policy applied" for row in mp.describe(model))
    # frozen half-precision weights kept beside trained float32 ones (LoRA on a half base): one
    # unit would hold two dtypes
    lora = net()
    lora[0].to(torch.bfloat16).requires_grad_(False)
    with pytest.raises(ValueError, match=r"\['bfloat16', 'float32'\].*frozen half-precision weights"):
        prepared("mixed_bfloat16", model=lora)
    assert lora[0].weight.dtype == torch.bfloat16 and lora[2].weight.dtype == torch.float32
    # a model that carries a policy and is given none keeps it, refused or not
    carried = mp.apply_policy(net(), "bfloat16")
    with pytest.raises(ValueError, match="no auto_wrap_policy"):
        prepared(None, model=carried)
    assert carried[0].weight.dtype == torch.bfloat16
    # no FSDP plugin: nothing set (the DDP and single-device paths above)
    fresh_accelerate.state.AcceleratorState._reset_state(True)
    Accelerator(cpu=True, policy="mixed_bfloat16").prepare_model(net())


_FSDP_ON_CUDA = """
import os, torch
import mixedpolicy as mp
from accelerate import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import FullyShardedDataParallel
from mixedpolicy.huggingface import Accelerator

plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
accelerator = Accelerator(fsdp_plugin=plugin, policy=mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16"))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
assert isinstance(model, FullyShardedDataParallel), type(model)
assert model.mixed_precision.reduce_dtype == torch.bfloat16 and model.mixed_precision.param_dtype is None
x = torch.randn(4, 8, device=accelerator.device)
accelerator.backward(model(x).float().square().mean())
opt.step()
assert not opt.step_was_skipped
print("ok")
"""


@pytest.mark.gpu
def test_on_cuda_accelerates_fsdp_reduces_in_the_policys_reduce_dtype(tmp_path):
    # one rank of Accelerate's FSDP (it runs FSDP only on GPUs), in a process of its own
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import os
    import subprocess
    import sys

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", _FSDP_ON_CUDA], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.slow
def test_the_accelerator_under_ddp_on_two_gloo_ranks_skips_together():
    """Accelerate wraps the policy's model in DDP (two gloo ranks on CPU): the per-layer override
    is found by the bare model's path, an infinite loss on one rank makes both skip with the
    same scale, and the replicas stay equal (asserts in accelerate_ddp_worker.py)."""
    from test_torch_distributed import _report

    report = _report("accelerate_ddp_worker.py")
    assert report["skipped"] == [i == POISON for i in range(5)] and report["scale"] == 2.0**15
    assert report["distributed_type"].endswith("MULTI_CPU")


def test_a_model_that_carries_a_policy_keeps_it_when_none_is_given(fresh_accelerate, tmp_path):
    """A model the user put under a policy (mp.apply_policy) before handing it over keeps that
    policy and its overrides when neither the Accelerator nor the Trainer is given one, and the
    wrapper follows what the parameters carry: it scales for a float16 model under a float32
    global policy (before, the global float32 replaced the model's policy)."""
    from mixedpolicy.huggingface import Accelerator

    net = mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
                          "mixed_float16", overrides={"2": "float32"})
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    layers = {row.path: row.compute_dtype for row in mp.describe(model)}
    assert layers["0"] == "float16" and layers["2"] == "float32"
    assert accelerator.scaler.is_enabled() and accelerator.scaler.get_scale() == 2.0**16

    gpt = mp.apply_policy(_model(), "mixed_float16", overrides={"lm_head": "float32"})
    trainer = Trainer(model=gpt, args=_args(tmp_path, max_steps=1), train_dataset=_data())
    trainer.train()
    assert {r.path: r.compute_dtype for r in mp.describe(trainer.model)}["lm_head"] == "float32"
    assert trainer.loss_scale_optimizer.loss_scaling.startswith("dynamic")


@pytest.mark.gpu
def test_on_cuda_the_trainer_under_mixed_float16_skips_and_scales_as_its_own_fp16(tmp_path):
    # on a GPU the Trainer's fp16=True is autocast with Accelerate's GradScaler: a step made
    # infinite is skipped by both, the scale halves alike, the schedule waits alike. (With the
    # Trainer's default fused AdamW, Accelerate cannot see GradScaler's skip, since the fused
    # kernel is always called, and its schedule moves on: accelerate issue #4242, seen on an
    # H100 on 2026-11-27; ours waits either way. The non-fused AdamW here, where it sees the skip.)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = dict(use_cpu=False, max_grad_norm=1.0, optim="adamw_torch")
    theirs = _poisoned(transformers.Trainer)(model=_model(), args=_args(tmp_path, fp16=True, **args),
                                             train_dataset=_data())
    theirs.train()
    ours = _poisoned(Trainer)(model=_model(), args=_args(tmp_path, **args), train_dataset=_data(),
                              policy="16-mixed")
    ours.train()
    opt = ours.loss_scale_optimizer
    assert opt.num_skipped_steps == 1 and next(ours.model.parameters()).is_cuda
    assert float(opt.loss_scale) == theirs.accelerator.scaler.get_scale() == 2.0**15
    a, b = _losses(ours), _losses(theirs)
    assert len(a) == len(b) == 6
    finite = [i for i in range(6) if i != POISON]
    torch.testing.assert_close(torch.tensor(a)[finite], torch.tensor(b)[finite], rtol=2e-2, atol=2e-2)
    lrs = [[h["learning_rate"] for h in t.state.log_history if "learning_rate" in h] for t in (ours, theirs)]
    assert lrs[0] == lrs[1] and lrs[0][POISON] == lrs[0][POISON + 1]
    assert all(torch.isfinite(p).all() for p in ours.model.parameters())


def test_resume_from_checkpoint_brings_the_scale_and_skips_back_bit_for_bit(tmp_path):
    # the Trainer's own checkpoint (optimizer.pt, scaler.pt) carries the wrapper's scale and
    # counters: a run resumed half way ends where the uninterrupted run ends
    def run(resume=None):
        args = _args(tmp_path, max_steps=8, save_strategy="steps", save_steps=4)
        trainer = _poisoned(Trainer)(model=_model(), args=args, train_dataset=_data(), policy="mixed_float16",
                                     scale_settings={"dynamic_growth_steps": 3})
        trainer.train(resume_from_checkpoint=resume)
        return trainer
    whole = run()
    resumed = run(str(tmp_path / "checkpoint-4"))
    for trainer in (whole, resumed):
        opt = trainer.loss_scale_optimizer
        assert (opt.num_skipped_steps, float(opt.loss_scale)) == (1, 2.0**16)  # halved at the skip, grown once
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("half, policy, native", [(torch.bfloat16, "bf16-mixed", "bf16"),
                                                  (torch.float16, "16-mixed", "fp16")])
def test_a_lora_model_on_half_base_weights_trains_as_under_the_trainers_own_mixed_precision(
        tmp_path, half, policy, native):
    """peft's LoRA on a base model loaded in half precision (the usual recipe): the frozen base
    weights are no master weights, so the policy keeps them half (no float32 copy) and trains the
    float32 adapters as the Trainer's own mixed precision does."""
    peft = pytest.importorskip("peft")

    def model():
        base = _model().to(half)
        config = peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights="gaussian")
        return peft.get_peft_model(base, config)

    theirs = transformers.Trainer(model=model(), args=_args(tmp_path, **{native: True}), train_dataset=_data())
    theirs.train()
    ours = Trainer(model=model(), args=_args(tmp_path), train_dataset=_data(), policy=policy)
    ours.train()
    torch.testing.assert_close(torch.tensor(_losses(ours)), torch.tensor(_losses(theirs)), rtol=1e-3, atol=0)
    params = dict(ours.model.named_parameters())
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert all(p.dtype == half for n, p in params.items() if "base_layer.weight" in n)
    assert ours.loss_scale_optimizer.num_skipped_steps == 0


def test_seq2seq_and_any_trainer_subclass_train_under_a_policy_as_under_their_own_bf16(tmp_path):
    """Seq2SeqTrainer (a T5) and a Trainer subclass of one's own (trainer_class, as for TRL's
    SFTTrainer) take the policy and train as they do under their own bf16=True."""
    from mixedpolicy.huggingface import Seq2SeqTrainer, trainer_class

    _, cls, config = next(iter(_declaring_models()))
    saved = _saved(tmp_path, cls, config)
    args = dict(predict_with_generate=False, **{k: v for k, v in _args(tmp_path).to_dict().items()
                                                 if k in ("output_dir", "per_device_train_batch_size", "max_steps",
                                                          "use_cpu", "report_to", "logging_steps", "save_strategy",
                                                          "disable_tqdm", "learning_rate", "seed")})
    theirs = transformers.Seq2SeqTrainer(model=cls.from_pretrained(saved), train_dataset=_data(),
                                         args=transformers.Seq2SeqTrainingArguments(bf16=True, **args))
    theirs.train()
    ours = Seq2SeqTrainer(model=cls.from_pretrained(saved), train_dataset=_data(),
                          args=transformers.Seq2SeqTrainingArguments(**args), policy="bf16-mixed")
    ours.train()
    assert isinstance(ours, transformers.Seq2SeqTrainer) and ours.loss_scale_optimizer is not None
    torch.testing.assert_close(torch.tensor(_losses(ours)), torch.tensor(_losses(theirs)), rtol=2e-2, atol=0)

    class Halved(transformers.Trainer):  # a Trainer of one's own: its compute_loss runs as written
        def compute_loss(self, model, inputs, *rest, **kwargs):
            return super().compute_loss(model, inputs, *rest, **kwargs) / 2

    mine = trainer_class(Halved)(model=_model(), args=_args(tmp_path), train_dataset=_data(), policy="16-mixed",
                                  overrides={"lm_head": "float32"})
    mine.train()
    assert isinstance(mine, Halved) and trainer_class(type(mine)) is type(mine)
    assert mine.loss_scale_optimizer.loss_scaling.startswith("dynamic") and len(_losses(mine)) == 6
    with pytest.raises(TypeError, match="subclass of it"):
        trainer_class(transformers.TrainingArguments)


class _ModeSwitching(torch.optim.AdamW):
    """An optimizer with schedule-free's train()/eval() (the weights it steps are not the ones
    to evaluate: the Trainer and Accelerate call these where an optimizer has them)."""

    calls: list = []

    def train(self):
        self.calls.append("train")

    def eval(self):
        self.calls.append("eval")


def test_the_trainer_switches_a_schedule_free_optimizers_mode_through_the_wrapper(tmp_path):
    # the Trainer asks its (accelerated) optimizer for train()/eval(), which asks ours: the
    # wrapper answers for the inner optimizer's public methods, so the switch reaches it
    model = _model()
    _ModeSwitching.calls = []
    optimizer = _ModeSwitching(model.parameters(), lr=1e-3)
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=_data(), eval_dataset=_data()[:4],
                      optimizers=(optimizer, None), policy="mixed_bfloat16")
    trainer.train()
    trainer.evaluate()
    assert _ModeSwitching.calls[:1] == ["train"] and "eval" in _ModeSwitching.calls
    assert trainer.loss_scale_optimizer.inner_optimizer is optimizer


def test_lora_layers_added_after_the_policy_are_described_as_they_compute():
    """peft's LoRA put on a model already under a policy: its new layers have no policy of their
    own and run under the autocast of the layer they wrap; `describe` says so (it read them as
    float32, "no policy applied"), and the LoRA matmuls do compute in bfloat16."""
    peft = pytest.importorskip("peft")
    model = mp.apply_policy(_model(), "mixed_bfloat16")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0))
    rows = {r.path: r for r in mp.describe(lora)}
    added = [p for p in rows if p.endswith("lora_A.default")]
    assert added and all(rows[p].compute_dtype == "bfloat16" and rows[p].variable_dtype == "float32"
                         and "added after apply_policy" in rows[p].source for p in added), [rows[p] for p in added]
    seen = []
    layer = dict(lora.named_modules())[added[0]]
    layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    lora(input_ids=torch.randint(0, 64, (2, 16)))
    assert seen == [torch.bfloat16]
