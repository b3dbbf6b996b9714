"""The short convolution of transformers' GDN layers routed to fla's ``causal_conv1d`` inside gdnviz runs on CUDA
(``gdnviz.models.transformers_family.fla_conv_on``).

CPU: the dispatcher is installed and passes CPU calls through; when the route is taken; the plumbing (the
``[B, T, D]`` layout handed over, the output transposed back) with fla's function replaced by a float64 reference of
the same causal convolution, which keeps a run's logits. CUDA: fla's kernel against transformers' fallback on the
demo model's convolution, and a bf16 truncated run with it against the float32 model's run, no further from it than
the bf16 run with transformers' fallback (forced).
"""
import pytest
import torch

import tiny_models
from gdnviz import runner
from gdnviz.models import from_model, load, transformers_family
from test_qk_norm import truncated_logits


def causal_conv_btd(x, weight, bias=None, activation=None):
    """y_t = Σ_w weight[:, w] x_{t − (W−1) + w} (+ bias), SiLU: the causal convolution on ``x [B, T, D]``, float64."""
    B, T, D = x.shape
    W = weight.shape[-1]
    xp = torch.cat([x.new_zeros(B, W - 1, D), x], 1).double()
    y = sum(weight[:, w].double() * xp[:, w:w + T] for w in range(W))
    if bias is not None:
        y = y + bias.double()
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype), None


def test_dispatcher_installed_and_off_on_cpu():
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    lm = from_model(tiny_models.qwen3_5(), "tiny")
    assert hasattr(mod.causal_conv1d_fn, "__gdnviz_original__")
    x = torch.randn(1, 8, 5)
    assert not transformers_family.fla_conv_on(x)  # CPU: never
    with runner.run_context(runner.RunContext(segment_len=4)):
        assert not transformers_family.fla_conv_on(x)
    assert lm.info.gdn_layers


def test_route_inside_runs_on_cuda_with_fla(monkeypatch):
    class OnCuda:
        is_cuda = True

    monkeypatch.setattr(transformers_family, "_fla_causal_conv1d", lambda: causal_conv_btd)
    x = OnCuda()
    with runner.run_context(runner.RunContext(segment_len=4)):
        assert transformers_family.fla_conv_on(x)
        monkeypatch.setattr(transformers_family, "_fla_causal_conv1d", lambda: None)  # fla absent
        assert not transformers_family.fla_conv_on(x)
    monkeypatch.setattr(transformers_family, "_fla_causal_conv1d", lambda: causal_conv_btd)
    assert not transformers_family.fla_conv_on(x)  # outside a run


def test_forced_route_keeps_a_run(monkeypatch):
    """The tiny Qwen3.5 on the CPU, every head at rank 2: with the route forced and fla's function replaced by the
    float64 reference above, the logits equal the default run's to float32 rounding; the function got the
    projection's contiguous [B, T, D] tensor."""
    lm = from_model(tiny_models.qwen3_5(), "tiny")
    x = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = truncated_logits(lm, x, 2, 8)
    seen = []

    def recording(xb, weight, bias=None, activation=None):
        seen.append((tuple(xb.shape), xb.is_contiguous(), activation))
        return causal_conv_btd(xb, weight, bias, activation)

    monkeypatch.setattr(transformers_family, "fla_conv_on", lambda t: True)
    monkeypatch.setattr(transformers_family, "_fla_causal_conv1d", lambda: recording)
    got = truncated_logits(lm, x, 2, 8)
    gdn = len(lm.info.gdn_layers)
    assert len(seen) == gdn and all(s[0][:2] == (1, 40) and s[1] and s[2] == "silu" for s in seen), seen
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_conv_kernel_equals_the_fallback_on_gpu():
    """fla's causal_conv1d equals transformers' fallback on the demo model's first GDN convolution (bf16 inputs,
    to bf16 rounding)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    if transformers_family._fla_causal_conv1d() is None:
        pytest.skip("fla not importable")
    lm = load("demo", device="cuda", dtype="bfloat16")
    conv = lm.model.model.layers[lm.info.gdn_layers[0]].linear_attn.conv1d
    D = conv.weight.shape[0]
    h = torch.randn(2, 700, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    h = h.to(torch.bfloat16).transpose(1, 2)  # [B, D, T] as the layer passes it
    fallback = getattr(mod.causal_conv1d_fn, "__gdnviz_original__", mod.causal_conv1d_fn)
    want = fallback(h, conv.weight.squeeze(1), conv.bias, activation="silu")
    got, _ = transformers_family._fla_causal_conv1d()(h.transpose(1, 2), weight=conv.weight.squeeze(1),
                                                      bias=conv.bias, activation="silu")
    assert got.shape == (2, 700, D)
    torch.testing.assert_close(got.transpose(1, 2).float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.timeout(300)  # 99 s on a warm H200, > 100 s on a fresh one: fla autotunes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_conv_run_on_gpu(monkeypatch):
    """A bf16 truncated run with fla's convolution is as close to the float32 model's as with transformers' fallback
    (its deviation printed)."""
    from test_qk_norm import assert_within_bf16_noise, bf16_deviation

    if transformers_family._fla_causal_conv1d() is None:
        pytest.skip("fla not importable")
    dev = bf16_deviation(lambda m: m.setattr(transformers_family, "fla_conv_on", lambda t: False), monkeypatch)
    print("bf16 deviation from float32, fla conv:", dev)
    assert_within_bf16_noise(dev)
