"""Capture: recorded spectra, gates and keys against the plain cache loop and the layer's own projections."""
import numpy as np
import pytest
import torch

import tiny_models
from gdnviz import runner, summary
from gdnviz.capture import CaptureCallback, CaptureResult, capture_document
from gdnviz.models import from_model
from gdnviz.models.info import ModelInfo


@pytest.fixture(scope="module")
def lm():
    return from_model(tiny_models.qwen3_5(), "tiny")


def doc(T, seed=0):
    return torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(seed))


def test_capture_matches_cache_loop(lm):
    x = doc(64 * 5 + 17)
    cap = capture_document(lm, x, 64)
    assert list(cap.positions) == [64, 128, 192, 256, 320, 337]
    NL, H, n = len(lm.info.gdn_layers), lm.info.num_heads, min(lm.info.d_k, lm.info.d_v)
    assert cap.sv.shape == (6, NL, H, n) and cap.g.shape == (NL, H, 337) and cap.beta.shape == (NL, H, 337)
    seen = {}

    def look(layer, pos, state):
        seen[(layer, pos)] = state[0].double()

    _, finals, _ = runner.cache_loop(lm, x[None], segment_len=64, on_boundary=look, logits=False)
    for li, layer in enumerate(lm.info.gdn_layers):
        for b, pos in enumerate(cap.positions[:-1]):
            ref = torch.linalg.svdvals(seen[(layer, int(pos))]).numpy()
            np.testing.assert_allclose(cap.sv[b, li], ref, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(cap.final_state[li], finals[layer][0].numpy(), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(cap.sv[-1, li], torch.linalg.svdvals(finals[layer][0].double()).numpy(),
                                   rtol=1e-4, atol=1e-7)


def test_captured_gates_and_keys_match_layer_projections(lm):
    """g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b): recomputed from the layer's own projections."""
    x = doc(150, seed=1)
    grabbed = {}
    hooks = []
    for layer, mod in lm.adapter.gdn_modules(lm.model).items():
        hooks.append(mod.in_proj_a.register_forward_hook(lambda m, i, o, l=layer: grabbed.__setitem__(("a", l), o)))
        hooks.append(mod.in_proj_b.register_forward_hook(lambda m, i, o, l=layer: grabbed.__setitem__(("b", l), o)))
    try:
        cap = capture_document(lm, x, 64)
    finally:
        for h in hooks:
            h.remove()
    for li, (layer, mod) in enumerate(lm.adapter.gdn_modules(lm.model).items()):
        a, b = grabbed[("a", layer)][0].detach().float(), grabbed[("b", layer)][0].detach().float()
        g = (-mod.A_log.float().exp() * torch.nn.functional.softplus(a + mod.dt_bias.float())).detach()
        np.testing.assert_allclose(cap.g[li], g.T.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cap.beta[li].astype(np.float32), torch.sigmoid(b).T.numpy(), atol=1e-3)
    # keys as the kernel writes them: x * rsqrt(|x|^2 + 1e-6), so |k| <= 1 (slightly below 1 for tiny raw keys)
    norms = np.linalg.norm(cap.key_sample.astype(np.float32), axis=-1)
    assert (norms <= 1 + 2e-3).all() and (norms > 0.5).all()
    assert cap.key_sample.shape[2] == len(cap.key_sample_pos) == 150


@pytest.mark.parametrize("dims", [None, (16, 8), (8, 16)])
def test_captured_key_statistics_match_the_keys_the_layer_writes(lm, dims):
    """key_mean, key_sample and every key cone statistic against the unit keys and log-decays the GDN core receives
    (grabbed by a second callback in the same run): float32 mean over the document, float16 samples at
    key_sample_pos, and the key cone of keycone_summary — with d_k = d_v and d_k < d_v the capture solves the key
    cone's d_k × d_k matrices with the states' spectra, with d_k > d_v on their own; the spectra of the rectangular
    states are svdvals'."""
    from gdnviz.analysis.keycone import keycone_summary, mean_key_norm
    from gdnviz.capture import CaptureCallback

    if dims is not None:
        lm = from_model(tiny_models.qwen3_5(dk=dims[0], dv=dims[1]), "tiny")
        assert (lm.info.d_k, lm.info.d_v) == dims
    x = torch.as_tensor(doc(150, seed=3))[None]
    keys = {}
    finals = {}

    class Grab:
        modifies_state = False

        def on_layer_input(self, layer, offset, k, g, beta):
            keys[layer] = (k[0].detach().clone(), g[0].detach().clone())

        def on_layer_end(self, layer, position, state):
            finals[layer] = state[0].detach().clone()

    cb = CaptureCallback(lm.info, x.shape[1], 64)
    runner.forward(lm, x, segment_len=64, callbacks=[cb, Grab()], keep_hidden=False)
    cap = cb.result({})
    for li, layer in enumerate(lm.info.gdn_layers):
        k, g = (t.double() for t in keys[layer])  # [T, H, K], [T, H]
        ref = keycone_summary(k, g)  # the key cone on its own (its matrices' eigenvalues solved alone)
        for name, val in ref.items():
            np.testing.assert_allclose(cap.keycone[name][li], val, rtol=1e-9, err_msg=name)
        np.testing.assert_allclose(cap.key_mean[li], k.mean(0).numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cap.key_sample[li].astype(np.float32),
                                   k[cap.key_sample_pos].transpose(0, 1).numpy(), atol=2e-3)
        np.testing.assert_allclose(cap.keycone["mean_key_norm"][li], mean_key_norm(k), rtol=1e-9)
        np.testing.assert_allclose(cap.sv[-1, li], torch.linalg.svdvals(finals[layer].double()).numpy(),
                                   rtol=1e-4, atol=1e-7)


def test_save_load_roundtrip(lm, tmp_path):
    cap = capture_document(lm, doc(100, seed=2), 64, name="d")
    p = cap.save(tmp_path / "c.npz")
    back = CaptureResult.load(p)
    assert back.meta == cap.meta
    for f in ("positions", "sv", "final_state", "g", "beta", "key_mean", "key_sample", "key_sample_pos"):
        assert np.array_equal(getattr(back, f), getattr(cap, f)), f
    assert back.keycone.keys() == cap.keycone.keys()


def test_document_set_table_median_and_spread(lm):
    caps = [capture_document(lm, doc(200, seed=s), 64) for s in range(3)]
    tables = [summary.head_table(c) for c in caps]
    ds = summary.document_set_table(caps)
    er = np.stack([t["erank"].to_numpy() for t in tables])
    np.testing.assert_allclose(ds["erank"], np.median(er, 0))
    np.testing.assert_allclose(ds["erank_min"], er.min(0))
    np.testing.assert_allclose(ds["erank_max"], er.max(0))
    assert (ds["n_docs"] == 3).all() and len(ds) == len(lm.info.gdn_layers) * lm.info.num_heads


def test_storage_budget_for_16k_qwen35_08b():
    """What a 16K-token capture of a Qwen3.5-0.8B-sized model stores (the arrays the capture allocates)."""
    info = ModelInfo(name="x", path="", family="qwen3_5", model_type="qwen3_5_text", num_layers=24,
                     gdn_layers=tuple(i for i in range(24) if (i + 1) % 4), attn_layers=tuple(range(3, 24, 4)),
                     num_heads=16, num_key_heads=16, d_k=128, d_v=128, conv_kernel=4, hidden_size=1024,
                     vocab_size=248320, attn_kv_heads=2, attn_head_dim=256, dtype="bfloat16", device="cuda",
                     kernel_path="fla", fingerprint="0")
    cb = CaptureCallback(info, 16384, 256)
    cb.keycone = {k: np.zeros((18, 16)) for k in ("mean_key_norm", "key_cov_erank", "decayed_P_erank_sqrt",
                                                   "decayed_P_erank_eig", "horizon")}
    size = len(cb.result({"n": 1}).to_bytes())
    assert size <= 150 * 2**20, size / 2**20


def test_empty_document(lm):
    from gdnviz.errors import EmptyDocument

    with pytest.raises(EmptyDocument):
        capture_document(lm, [], 64)


def test_batched_svdvals_cpu_matches_svd_reference():
    """The Gram-eigenvalue route used by capture on CPU against float64 torch.linalg.svdvals."""
    from gdnviz.analysis import spectra
    from gdnviz.statistics import batched_svdvals

    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(20, 64, 64, generator=g, dtype=torch.float64))[0]
    s = torch.exp(-torch.arange(64, dtype=torch.float64) * torch.linspace(0.05, 0.5, 20, dtype=torch.float64)[:, None])
    S = ((U * s[:, None, :]) @ U.transpose(-1, -2)).float()
    ours = batched_svdvals(S.reshape(4, 5, 64, 64)).reshape(20, 64)
    ref = torch.linalg.svdvals(S.double())
    assert ((ours - ref).abs() / ref[:, :1]).max() < 1e-7
    np.testing.assert_array_equal(spectra.numerical_rank(ours.numpy()), spectra.numerical_rank(ref.numpy()))
    np.testing.assert_allclose(spectra.effective_rank(ours.numpy()), spectra.effective_rank(ref.numpy()), rtol=1e-6)


def test_batched_svdvals_of_states_with_nan_or_inf():
    """A state with a NaN or an inf gets NaN singular values (LAPACK raised on it; the GPU kernels gave finite
    numbers); the other states of the batch are untouched."""
    from gdnviz.statistics import batched_svdvals

    g = torch.Generator().manual_seed(1)
    S = torch.randn(4, 16, 16, generator=g)
    S[1, 2, 3] = float("nan")
    S[3, 0, 0] = float("inf")
    ours = batched_svdvals(S)
    assert torch.isnan(ours[[1, 3]]).all() and torch.isfinite(ours[[0, 2]]).all()
    ref = torch.linalg.svdvals(S[[0, 2]].double())
    assert ((ours[[0, 2]] - ref).abs() / ref[:, :1]).max() < 1e-7


def test_batched_svdvals_solves_extra_symmetric_matrices_in_the_same_call():
    """``extra`` (a capture's key cone matrices): ascending eigenvalues of each symmetrised matrix, NaN rows for a
    matrix with NaN/inf, while the states' singular values stay what they are without it; a wrong size is refused."""
    from gdnviz.statistics import batched_svdvals, symmetric_eigvals

    g = torch.Generator().manual_seed(3)
    S = torch.randn(2, 3, 16, 16, generator=g)
    A = torch.randn(5, 16, 16, generator=g, dtype=torch.float64)
    A[2, 1, 4] = float("inf")
    sv, lam = batched_svdvals(S, extra=A)
    assert torch.equal(sv, batched_svdvals(S))
    assert torch.isnan(lam[2]).all() and torch.isfinite(lam[[0, 1, 3, 4]]).all()
    ok = [0, 1, 3, 4]
    np.testing.assert_allclose(lam[ok].numpy(), np.linalg.eigvalsh(0.5 * (A[ok] + A[ok].mT).numpy()), atol=1e-12)
    assert torch.equal(lam[ok], symmetric_eigvals(A)[ok])
    with pytest.raises(ValueError, match="extra"):
        batched_svdvals(S, extra=A[:, :8, :8])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_svdvals_of_states_with_nan_or_inf_on_gpu():
    from gdnviz.statistics import batched_svdvals

    g = torch.Generator().manual_seed(2)
    S = torch.randn(4, 128, 128, generator=g)
    S[1, 2, 3] = float("nan")
    S[3, 0, 0] = float("inf")
    ours = batched_svdvals(S.cuda()).cpu()
    assert torch.isnan(ours[[1, 3]]).all() and torch.isfinite(ours[[0, 2]]).all()
    ref = torch.linalg.svdvals(S[[0, 2]].double())
    assert ((ours[[0, 2]] - ref).abs() / ref[:, :1]).max() < 1e-7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_svdvals_fallback_on_gpu():
    """A size the CUDA kernels do not take (n = 32) runs the fallback (float64 torch.linalg.eigvalsh on the GPU): the
    same NaN rows and bounds as the kernels, extra matrices included."""
    from gdnviz.gpu import symeig
    from gdnviz.statistics import batched_svdvals

    g = torch.Generator().manual_seed(5)
    S = torch.randn(4, 32, 32, generator=g)
    S[1, 2, 3] = float("nan")
    A = torch.randn(3, 32, 32, generator=g, dtype=torch.float64)
    A[2, 0, 1] = float("inf")
    assert not symeig.uses_kernels(symeig.gram(S.cuda()))
    sv, lam = batched_svdvals(S.cuda(), extra=A.cuda())
    sv, lam = sv.cpu(), lam.cpu()
    assert torch.isnan(sv[1]).all() and torch.isfinite(sv[[0, 2, 3]]).all()
    ref = torch.linalg.svdvals(S[[0, 2, 3]].double())
    assert ((sv[[0, 2, 3]] - ref).abs() / ref[:, :1]).max() < 1e-7
    assert torch.isnan(lam[2]).all()
    np.testing.assert_allclose(lam[:2].numpy(), np.linalg.eigvalsh(0.5 * (A[:2] + A[:2].mT).numpy()), atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_svdvals_extra_matrices_on_gpu_equal_cpu():
    """The capture's merged solve on CUDA (one launch of the tridiagonalisation and bisection kernels for 1,024
    states and 32 key-cone matrices, with one NaN matrix) against LAPACK on the CPU."""
    from gdnviz.gpu import symeig
    from gdnviz.statistics import batched_svdvals

    g = torch.Generator().manual_seed(4)
    S = torch.randn(64, 16, 128, 128, generator=g) / 128
    X = torch.randn(32, 128, 128, generator=g, dtype=torch.float64)
    A = X @ X.mT / 128
    A[7, 3, 3] = float("nan")
    assert symeig.uses_kernels(A.cuda())
    sv, lam = batched_svdvals(S.cuda(), extra=A.cuda())
    sv_c, lam_c = batched_svdvals(S, extra=A)
    assert ((sv.cpu() - sv_c).abs() / sv_c[..., :1]).max() < 1e-7
    ok = torch.arange(32) != 7
    assert torch.isnan(lam[7].cpu()).all() and torch.isnan(lam_c[7]).all()
    assert ((lam.cpu()[ok] - lam_c[ok]).abs() / lam_c[ok][:, -1:]).max() < 1e-12


def _same_capture(a: CaptureResult, b: CaptureResult) -> None:
    for f in ("positions", "sv", "final_state", "g", "beta", "key_mean", "key_sample", "key_sample_pos"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert a.keycone.keys() == b.keycone.keys()
    for k in a.keycone:
        np.testing.assert_array_equal(a.keycone[k], b.keycone[k], err_msg=k)


def test_statistics_on_cpu_run_inline_and_report_their_time(lm):
    """On CPU the statistics run inline whatever ``pipeline`` says (the side stream is a CUDA thing): the same
    capture bit for bit, progress once per GDN layer in order, and the host seconds of both job kinds."""
    ids = doc(300, seed=3)
    seen = []
    inline = capture_document(lm, ids, 64, pipeline=False)
    asked = capture_document(lm, ids, 64, pipeline=True, progress=lambda d, n: seen.append((d, n)))
    assert inline.meta["pipelined"] is False and asked.meta["pipelined"] is False
    _same_capture(inline, asked)
    n = len(lm.info.gdn_layers)
    assert seen == [(i, n) for i in range(1, n + 1)]
    for m in (inline.meta, asked.meta):
        secs = m["statistics_seconds"]
        assert set(secs) == {"layer_input", "layer_end", "results"}
        assert all(v >= 0 for v in secs.values()) and secs["layer_input"] + secs["layer_end"] > 0
        assert sum(secs.values()) <= m["seconds"] + 1e-3


def test_statistics_errors_reach_the_caller(lm):
    """An error during the capture (here the progress callback, called after each layer's statistics are launched)
    surfaces from capture_document."""
    def boom(done, total):
        if done == 2:
            raise RuntimeError("stats failed at layer 2")

    ids = doc(200, seed=4)
    with pytest.raises(RuntimeError, match="stats failed at layer 2"):
        capture_document(lm, ids, 64, pipeline=True, progress=boom)
