"""A real client of the attention variants (issue 47, item 3): tiny random Hugging Face
transformers models of Mistral (a sliding window on every layer), Gemma 2 (sliding and full
layers alternating, scores soft-capped, a scale of its own) and gpt-oss (sliding and full
layers alternating, a sink logit per head) decode through a ``KvCache`` whose config carries
their windows and cap, teacher-forced, and every logits row matches the model's own run.

How: the model's OWN attention modules call the cache. A function registered with
transformers' ``AttentionInterface`` as "rocmforge" is what each layer's attention calls
(``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``, then
``(module, query, key, value, attention_mask, dropout=, scaling=, sliding_window=, softcap=
(Gemma 2), s_aux= (gpt-oss's sinks), position_ids=, ...)``). Each decode step runs the model on
each sequence's next token (``use_cache=False``, explicit ``position_ids``): a layer's
attention then gets that token's q/k/v only (``[B, H, 1, D]``, ``[B, Hkv, 1, D]``); the
function writes k/v into the cache (``KvCache.write``), attends over the cache
(``KvCache.attention`` with the module's ``scaling`` and the sinks from ``s_aux``) in the
cache's dtype, and returns ``[B, 1, H, D]``. No mask reaches it: masks are made only for the
implementations ``AttentionMaskInterface`` knows (``masking_utils._preprocess_mask_arguments``
exits early otherwise); the window and the cap come from the cache's config, and the function
asserts that the kwargs the model passes (``sliding_window``, ``softcap``) are the config's
values for that layer, so a mismatch fails loudly. The model's own run is the same model with
``_attn_implementation = "eager"`` over each whole sequence in one forward, float32.

Two sequences decode in lockstep, the second starting 5 steps later (rows at different
positions in one step, windows not aligned to blocks). Each variant is checked to change the
model's own logits by far more than the tolerance (``test_the_variants_bite``), so a cache
that ignored it would fail. Tolerances as tests/test_real_client.py."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.memory.array import DeviceArray

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
#: How much each variant must change the model's own logits (relative norm past the window):
#: far above either tolerance.
BITES = 0.1
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 128, 128, 4, 2, 64
START = (0, 5)  # the step each sequence starts at
IMPLEMENTATION = "rocmforge"


@dataclass(frozen=True)
class Variant:
    """A model family's tiny config and what the cache must do for it: ``windows`` per
    layer (None: global), ``window_arg`` as given to ``CacheConfig``, the cap, sinks."""

    name: str
    windows: tuple[int | None, ...]
    window_arg: Any
    softcap: float | None
    sinks: bool
    block_size: int
    tokens: int  # of the longer sequence
    init: float  # initializer_range: as large as bfloat16's tolerance allows (peaky scores
    # amplify the rounding of q and k), for the variants to change the logits

    @property
    def layers(self) -> int:
        return len(self.windows)


VARIANTS = {
    "mistral": Variant("mistral", (24, 24), 24, None, False, block_size=8, tokens=80,
                       init=0.08),
    "gemma2": Variant("gemma2", (16, None, 16, None), [16, None, 16, None], 4.0, False,
                      block_size=16, tokens=64, init=0.1),
    "gpt_oss": Variant("gpt_oss", (20, None), [20, None], None, True, block_size=8, tokens=64,
                       init=0.07),
}


def build(variant: Variant) -> Any:
    """The float32 eager model of ``variant``, seeded, its weights drawn at ``variant.init``
    (above transformers' 0.02, so that the window, the cap and the sinks change the logits)."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=variant.layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=512, initializer_range=variant.init,
                  attention_dropout=0.0)
    window = max(w for w in variant.windows if w)
    types = ["sliding_attention" if w else "full_attention" for w in variant.windows]
    if variant.name == "mistral":
        config = transformers.MistralConfig(intermediate_size=192, sliding_window=window,
                                            tie_word_embeddings=False, **common)
    elif variant.name == "gemma2":
        config = transformers.Gemma2Config(
            intermediate_size=192, layer_types=types, sliding_window=window,
            attn_logit_softcapping=variant.softcap, final_logit_softcapping=30.0,
            query_pre_attn_scalar=48, **common)  # scaling 48**-0.5, not head_dim's
    else:
        # its own positions (YaRN's factor 32 over 4096); every expert taken, so that the
        # routing is continuous: a top-k flip on bfloat16's rounding would move the logits
        # whatever the cache did
        common["max_position_embeddings"] = 131072
        config = transformers.GptOssConfig(intermediate_size=64, num_local_experts=4,
                                           num_experts_per_tok=4, layer_types=types,
                                           sliding_window=window, **common)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.config._attn_implementation = "eager"
    if variant.sinks:  # initialised at std 0.02 they are nearly zeros; about log(keys) here,
        # they take a good share of each softmax
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in model.model.layers:
                sinks = layer.self_attn.sinks
                sinks.copy_(torch.randn(sinks.shape, generator=generator) + 3.0)
    return model


def own_run(model: Any, tokens: np.ndarray) -> np.ndarray:
    """The model's own logits ``[len(tokens), vocab]`` (eager, one forward), float64."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens)[None], use_cache=False)
    logits: np.ndarray = out.logits[0].double().numpy()
    return logits


class CacheAttention:
    """Every layer's attention of ``model`` through ``cache`` for the step planned in
    ``meta`` (rows: the step's sequences, at ``positions``)."""

    def __init__(self, model: Any, variant: Variant, cache: KvCache) -> None:
        self.model, self.variant, self.cache = model, variant, cache
        windows = cache.config.windows  # as the config holds them: None, an int, per layer
        self.windows = (tuple(windows) if isinstance(windows, (list, tuple))
                        else (windows,) * variant.layers)
        self.softcap = cache.config.logit_softcap
        assert (self.windows, self.softcap) == (variant.windows, variant.softcap), (
            "the cache's config holds other windows or another cap", self.windows, self.softcap)
        self.dtype = cache.config.dtype
        self.backend, self.device = cache.slab.backend, cache.slab.device
        self.meta: Any = None
        self.positions: list[int] = []
        self.layers_called: list[int] = []

    def step(self, seq_ids: list[int], tokens: list[int], positions: list[int]) -> np.ndarray:
        """Logits ``[len(seq_ids), vocab]`` of the sequences' next tokens (their slots
        already reserved), every layer attending through the cache."""
        self.meta = self.cache.batch(seq_ids)
        self.positions, self.layers_called = positions, []
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor(tokens)[:, None],
                             position_ids=torch.tensor(positions)[:, None], use_cache=False)
        assert self.layers_called == list(range(self.variant.layers)), self.layers_called
        logits: np.ndarray = out.logits[:, 0].double().numpy()
        return logits

    def __call__(self, module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                 scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, softcap: float | None = None,
                 s_aux: Any = None, **kwargs: Any) -> tuple[Any, None]:
        layer = module.layer_idx
        variant, rows = self.variant, len(self.positions)
        self.layers_called.append(layer)
        # what the model asks for is what the cache's config does for this layer
        assert sliding_window == self.windows[layer], (layer, sliding_window, self.windows)
        assert softcap == self.softcap, (layer, softcap, self.softcap)
        assert (s_aux is not None) == variant.sinks, (layer, s_aux)
        assert scaling is not None and dropout == 0.0, (scaling, dropout)
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            assert position_ids[:, 0].tolist() == self.positions, position_ids
        assert tuple(query.shape) == (rows, HEADS, 1, HEAD_DIM), query.shape
        assert tuple(key.shape) == tuple(value.shape) == (rows, KV_HEADS, 1, HEAD_DIM)
        host = [np.ascontiguousarray(t[:, :, 0].detach().float().numpy(), dtype=self.dtype)
                for t in (query, key, value)]
        if s_aux is not None:
            host.append(np.ascontiguousarray(s_aux.detach().float().numpy(), np.float32))
        q, k, v, *sinks = (DeviceArray.from_numpy(a, self.device, self.backend) for a in host)
        out = DeviceArray.empty(q.shape, self.dtype, self.device, self.backend)
        try:
            self.cache.write(layer, k, v, self.meta)
            self.cache.attention(layer, out, q, self.meta, scale=float(scaling),
                                 sinks=sinks[0] if sinks else None)
            attended = out.to_numpy().astype(np.float32)
        finally:
            for array in (q, k, v, out, *sinks):
                array.buffer.root.close()
        return torch.from_numpy(attended).to(query.dtype)[:, None], None  # [B, 1, H, D]


_ACTIVE: list[CacheAttention] = []


def _rocmforge_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                         **kwargs: Any) -> tuple[Any, None]:
    assert _ACTIVE, "the rocmforge attention ran outside a cache step"
    return _ACTIVE[-1](module, query, key, value, attention_mask, **kwargs)


transformers.AttentionInterface.register(IMPLEMENTATION, _rocmforge_attention)


@contextmanager
def through(client: CacheAttention):
    """The model's attention goes through ``client`` inside; eager again after."""
    config = client.model.config
    _ACTIVE.append(client)
    config._attn_implementation = IMPLEMENTATION
    try:
        yield client
    finally:
        config._attn_implementation = "eager"
        _ACTIVE.pop()


def sequences(variant: Variant) -> list[np.ndarray]:
    rng = np.random.default_rng(sum(map(ord, variant.name)))
    return [rng.integers(0, VOCAB, variant.tokens - start) for start in START]


def decode(model: Any, variant: Variant, cache: KvCache, seqs: list[np.ndarray]
           ) -> list[np.ndarray]:
    """Teacher-forced decode of ``seqs`` through ``cache`` in lockstep (sequence ``i``
    from step ``START[i]``): each sequence's logits ``[len, vocab]``."""
    logits: list[list[np.ndarray]] = [[] for _ in seqs]
    with through(CacheAttention(model, variant, cache)) as client:
        for step in range(variant.tokens):
            ids = [i for i, start in enumerate(START) if step >= start]
            new = [i for i in ids if step == START[i]]
            for i in new:
                cache.add_sequence(i, 1)
            if old := [i for i in ids if i not in new]:
                cache.append(old)
            positions = [step - START[i] for i in ids]
            rows = client.step(ids, [int(seqs[i][p]) for i, p in zip(ids, positions)],
                               positions)
            for i, row in zip(ids, rows):
                logits[i].append(row)
    return [np.stack(rows) for rows in logits]


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_variant_model_decodes_on_the_cache_as_in_its_own_run(backend, name, dtype):
    variant = VARIANTS[name]
    model = build(variant)
    seqs = sequences(variant)
    blocks = sum(math.ceil(len(s) / variant.block_size) for s in seqs) + 4
    config = CacheConfig(variant.layers, KV_HEADS, HEAD_DIM, variant.block_size, blocks,
                         getattr(ml_dtypes, dtype, dtype), num_q_heads=HEADS,
                         windows=variant.window_arg, logit_softcap=variant.softcap)
    with KvCache(config, backend=backend) as cache:
        got = decode(model, variant, cache, seqs)
        cache.check_invariants()
        dropped = cache.stats()["window_dropped_blocks"]
    # a model whose every layer has a window (Mistral) gives back the blocks that left it
    assert (dropped > 0) == (None not in config.windows), (name, dropped)
    for i, (seq, rows) in enumerate(zip(seqs, got)):
        want = own_run(model, seq)
        assert rows.shape == want.shape
        errors = [relative(rows[p], want[p]) for p in range(len(seq))]
        worst = int(np.argmax(errors))
        assert errors[worst] < TOLERANCE[dtype], (name, dtype, i, worst, errors[worst])


@contextmanager
def without(model: Any, what: str):
    """``model`` without one variant (its own eager run): the window longer than any
    sequence (the eager masks read it from the config), no cap, or sinks of -inf (exp(-inf)
    = 0 in the denominator)."""
    attentions = [layer.self_attn for layer in model.model.layers]
    if what == "sinks":
        saved = [a.sinks.detach().clone() for a in attentions]
        with torch.no_grad():
            for a in attentions:
                a.sinks.fill_(-math.inf)
        try:
            yield model
        finally:
            with torch.no_grad():
                for a, old in zip(attentions, saved):
                    a.sinks.copy_(old)
        return
    owners, name, value = (([model.config], "sliding_window", 1 << 20) if what == "window"
                           else (attentions, "attn_logit_softcapping", None))
    saved = [getattr(owner, name) for owner in owners]
    for owner in owners:
        setattr(owner, name, value)
    try:
        yield model
    finally:
        for owner, old in zip(owners, saved):
            setattr(owner, name, old)


@pytest.mark.parametrize("name, what", [("mistral", "window"), ("gemma2", "window"),
                                        ("gemma2", "softcap"), ("gpt_oss", "window"),
                                        ("gpt_oss", "sinks")])
def test_the_variants_bite(name, what):
    """Each variant changes the model's own logits (past the window) by far more than the
    tolerances: a cache that ignored it would fail the decode test."""
    variant = VARIANTS[name]
    model = build(variant)
    seq = sequences(variant)[0]
    want = own_run(model, seq)
    with without(model, what):
        plain = own_run(model, seq)
    assert np.array_equal(own_run(model, seq), want), "the variant was not restored"
    past = max(w for w in variant.windows if w)
    assert relative(plain[past:], want[past:]) > BITES, (name, what)
