"""flashqla inside other libraries (flashqla/integrations/): FLA's
gated_delta_rule backend registry, and transformers' Qwen3-Next / Qwen3.5
GatedDeltaNet layers (a tiny random model: loss, every parameter gradient and
generate() tokens against transformers' own torch path). Also FLA's
fused_recurrent_gated_delta_rule signature (flashqla's function of that
name) against the reference. Tests of a library that is not installed skip
with the reason; the test extras install both."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashqla  # noqa: E402
from flashqla import reference  # noqa: E402
from gdn_testing import (assert_close, cast_inputs_torch, make_inputs, reference_of,  # noqa: E402
                         tolerance)

TOL32 = tolerance("float32", "o")


# ------------------------------------- fused_recurrent_gated_delta_rule ----

@pytest.mark.parametrize("with_h0,varlen", [(True, False), (False, True)])
def test_fused_recurrent_gated_delta_rule_is_fla_shaped(with_h0, varlen):
    inp = make_inputs(1 if varlen else 2, 9 if varlen else 5, 2, 4, 32, 32, seed=1,
                      seqlens=[4, 5] if varlen else None, h0=with_h0, normalize_qk=False)
    t = cast_inputs_torch(inp, "float32")
    h0 = None if t["h0"] is None else t["h0"].clone()
    o, ht = flashqla.fused_recurrent_gated_delta_rule(
        t["q"], t["k"], t["v"], t["g"], beta=t["beta"], initial_state=h0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=t["cu_seqlens"],
        use_cache=True)  # a keyword that is not FLA's: ignored, as FLA does
    if h0 is not None:
        assert torch.equal(h0, t["h0"])  # functional, like FLA's: the input state is kept
    ref = reference_of(t, use_qk_l2norm=True, grads=False)
    assert_close("o", o, ref["o"], TOL32)
    assert_close("final_state", ht, ref["ht"], TOL32)
    # FLA's positional order: q, k, v, g, gk, gv, beta, scale, initial_state, ...
    o2, none = flashqla.fused_recurrent_gated_delta_rule(
        t["q"], t["k"], t["v"], t["g"], None, None, t["beta"], None, h0,
        use_qk_l2norm_in_kernel=True, cu_seqlens=t["cu_seqlens"])
    assert none is None and torch.equal(o2, o)


def test_fused_recurrent_defaults_and_refusals():
    inp = make_inputs(2, 3, 1, 2, 16, 16, seed=2, h0=False)
    t = cast_inputs_torch(inp, "float32")
    # g None: no decay; beta None: 1 (FLA's defaults)
    o, ht = flashqla.fused_recurrent_gated_delta_rule(t["q"], t["k"], t["v"],
                                                      output_final_state=True)
    ones, zeros = np.ones(inp["g"].shape), np.zeros(inp["g"].shape)
    o_ref, ht_ref = reference.forward(inp["q"], inp["k"], inp["v"], zeros, ones)
    assert_close("o", o, o_ref, TOL32)
    assert_close("final_state", ht, ht_ref, TOL32)
    base = (t["q"], t["k"], t["v"], t["g"])
    for name, value in (("gk", torch.zeros(2, 3, 2, 16)), ("gv", torch.zeros(2, 3, 2, 16)),
                        ("allow_neg_eigval", True)):
        with pytest.raises(ValueError, match=f"^{name}: {name}=.* fused_recurrent_gated_delta_rule"):
            flashqla.fused_recurrent_gated_delta_rule(*base, beta=t["beta"], **{name: value})
    with pytest.raises(ValueError, match="^beta: "):
        flashqla.fused_recurrent_gated_delta_rule(*base, beta=torch.rand(2, 3, 2, 16))


def test_fused_recurrent_on_numpy_and_jax():
    inp = make_inputs(2, 4, 1, 2, 16, 16, seed=3)
    a = {n: None if x is None else x.astype(np.float32) for n, x in inp.items()}
    o, ht = flashqla.fused_recurrent_gated_delta_rule(a["q"], a["k"], a["v"], a["g"],
                                                      beta=a["beta"], initial_state=a["h0"],
                                                      output_final_state=True)
    ref = reference_of(a, grads=False)
    assert_close("o (numpy)", o, ref["o"], TOL32)
    assert_close("final_state (numpy)", ht, ref["ht"], TOL32)
    jnp = pytest.importorskip("jax.numpy")
    j = {n: None if x is None else jnp.asarray(x) for n, x in a.items()}
    o, ht = flashqla.fused_recurrent_gated_delta_rule(j["q"], j["k"], j["v"], j["g"],
                                                      beta=j["beta"], initial_state=j["h0"],
                                                      output_final_state=True)
    assert_close("o (jax)", o, ref["o"], TOL32)
    assert_close("final_state (jax)", ht, ref["ht"], TOL32)


# ------------------------------------------------------------------ FLA ----

def _fla():
    try:
        import fla  # noqa: F401
        from fla.backends import BaseBackend  # noqa: F401  (0.6.0's backend registry)
    except ImportError as e:
        pytest.skip(f"fla-core >= 0.6.0 is not installed ({e})")
    import flashqla.integrations.fla as fq_fla
    return fq_fla


def test_fla_signatures_match_flashqla():
    fq_fla = _fla()
    assert fq_fla.signature_matches_fla()
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_rec
    ours = [p.name for p in inspect.signature(flashqla.fused_recurrent_gated_delta_rule)
            .parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    theirs = [p.name for p in inspect.signature(inspect.unwrap(fla_rec)).parameters.values()
              if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert ours == theirs


def test_fla_backend_registry_runs_flashqla(monkeypatch):
    fq_fla = _fla()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    backend = fq_fla.register()
    assert backend.backend_type == "flashqla" and backend.can_use()
    calls = []
    real = flashqla.chunk_gated_delta_rule

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(flashqla, "chunk_gated_delta_rule", spy)
    inp = make_inputs(1, 130, 2, 4, 32, 32, seed=4, seqlens=[65, 65], dht=True,
                      normalize_qk=False)
    t = cast_inputs_torch(inp, "float32")
    leaves = [t[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")]
    o, ht = fla_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=t["cu_seqlens"])
    assert len(calls) == 1  # FLA's dispatch picked flashqla (its Triton cannot run on a CPU)
    ((o * t["do"]).sum() + (ht * t["dht"]).sum()).backward()
    ref = reference_of(t, use_qk_l2norm=True)
    assert_close("o", o, ref["o"], TOL32)
    for name, leaf in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves):
        assert_close(name, leaf.grad, ref[name], TOL32)


def test_fla_verifier_passes_on_what_flashqla_cannot_do():
    fq_fla = _fla()
    backend = fq_fla.register()
    t = cast_inputs_torch(make_inputs(1, 8, 1, 2, 16, 16, seed=5), "float32")
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    assert backend.verify("chunk_gated_delta_rule", *args) == (True, None)
    ok, why = backend.verify("chunk_gated_delta_rule", *args, allow_neg_eigval=True,
                             use_beta_sigmoid_in_kernel=True)
    assert not ok and "not supported by flashqla" in why
    ok, why = backend.verify("chunk_gated_delta_rule", *args, cp_context=object())
    assert not ok and "cp_context" in why
    meta = [x.to("meta") for x in args]
    ok, why = backend.verify("chunk_gated_delta_rule", *meta)
    assert not ok and "meta" in why


# --------------------------------------------------------- transformers ----

def _tiny_config(family):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  max_position_embeddings=256)
    if family == "qwen3_next":
        if not hasattr(transformers, "Qwen3NextForCausalLM"):
            pytest.skip(f"transformers {transformers.__version__} has no Qwen3-Next")
        cfg = transformers.Qwen3NextConfig(moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, num_experts=4,
                                           num_experts_per_tok=2, **common)
        return cfg, transformers.Qwen3NextForCausalLM
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    return transformers.Qwen3_5TextConfig(**common), transformers.Qwen3_5ForCausalLM


def _torch_path(module):
    """transformers' own torch functions (under any FLA/hub-kernel wrapper)."""
    return {n: inspect.unwrap(getattr(module, n))
            for n in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    with torch.no_grad():
        tokens = model.generate(ids[:, :12], max_new_tokens=10, do_sample=False,
                                min_new_tokens=10)
    return loss.detach(), grads, tokens


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_transformers_model_loss_gradients_and_generate(family):
    import importlib

    import flashqla.integrations.transformers as fq_tf
    cfg, model_cls = _tiny_config(family)
    module = importlib.import_module(fq_tf.MODULES[family][0])
    torch_fns = _torch_path(module)
    before = {n: getattr(module, n) for n in torch_fns}
    torch.manual_seed(0)
    model = model_cls(cfg).float().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    try:
        for n, fn in torch_fns.items():
            setattr(module, n, fn)
        ref_loss, ref_grads, ref_tokens = _run(model, ids)
        apply = fq_tf.apply_to_qwen3_next if family == "qwen3_next" else fq_tf.apply_to_qwen3_5
        assert module.__name__ in apply()
        assert module.torch_chunk_gated_delta_rule is flashqla.chunk_gated_delta_rule
        assert module.torch_recurrent_gated_delta_rule is flashqla.fused_recurrent_gated_delta_rule
        loss, grads, tokens = _run(model, ids)
    finally:
        (fq_tf.revert_qwen3_next if family == "qwen3_next" else fq_tf.revert_qwen3_5)()
        for n, fn in before.items():
            setattr(module, n, fn)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert grads.keys() == ref_grads.keys() and len(grads) > 20
    largest = max(float(g.norm()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        err = float((grads[name] - ref).norm())
        # fp32 on both sides: 1e-4 of the gradient, and a floor of 1e-6 of the
        # largest gradient for the tiny ones (A_log, dt_bias under strong decay)
        assert err <= 1e-4 * float(ref.norm()) + 1e-6 * largest, \
            f"{name}: |d grad| {err:.2e}, |grad| {float(ref.norm()):.2e}"
    assert torch.equal(tokens, ref_tokens), (tokens, ref_tokens)


def test_transformers_apply_is_idempotent_and_reverts():
    pytest.importorskip("transformers")
    import flashqla.integrations.transformers as fq_tf
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    original = m.torch_chunk_gated_delta_rule
    fq_tf.apply_to_qwen3_next()
    fq_tf.apply_to_qwen3_next(recurrent=False)
    assert m.torch_chunk_gated_delta_rule is flashqla.chunk_gated_delta_rule
    fq_tf.revert_qwen3_next()
    assert m.torch_chunk_gated_delta_rule is original
