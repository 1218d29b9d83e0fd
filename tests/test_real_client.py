"""A real client of the cache: a small Llama (random weights, fixed seed) served through the
Scheduler with chunked prefill and prefix caching, every layer's attention through
``KvCache.attention`` over mixed steps. A prompt that shares a prefix with an earlier one is
prefilled only past its hit, in chunks; requests decode while others prefill. Each step's
logits (teacher-forced) match the model's own dense run, and float32's greedy tokens are the
dense run's. With transformers installed (the GPU machine), the dense run is
LlamaForCausalLM's own; else the NumPy model of the same math (``llama_np``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from llama_np import Llama, LlamaShape, random_weights, weights_of

from rocmforge_raw.cache import CacheConfig, KvCache, Request, Scheduler

SHAPE = LlamaShape()
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def serve(model, cache, scheduler, arrivals, max_new):
    """Run requests to the end: ``arrivals[k]`` lists the prompts submitted before step k.
    Returns per request: (prompt, generated ids, {position: logits row}, [prefill tokens,
    chunks]), and the steps that mixed decodes with chunks."""
    results, mixed = {}, 0
    step = 0
    while step < len(arrivals) or not scheduler.idle:
        for name, prompt in arrivals[step] if step < len(arrivals) else []:
            scheduler.submit(Request(name, tokens=prompt, max_new_tokens=max_new))
            results[name] = (prompt, [], {}, [0, 0])
        step += 1
        plan = scheduler.step()
        if not plan.seq_ids:
            scheduler.advance(plan, [])
            continue
        meta = cache.batch(plan.seq_ids, query_lens=plan.query_lens)
        mixed += bool(plan.decode and plan.chunks)
        tokens, positions, last_row, row = [], [], {}, 0
        for request in plan.decode:
            context = request.context_ids()
            tokens.append(context[-1])
            positions.append(request.context - 1)
            last_row[request.request_id] = row
            row += 1
        for chunk in plan.chunks:
            context = chunk.request.context_ids()
            tokens.extend(context[chunk.start: chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            results[chunk.request.request_id][3][0] += chunk.end - chunk.start
            results[chunk.request.request_id][3][1] += 1
            row += chunk.end - chunk.start
            last_row[chunk.request.request_id] = row - 1
        logits = model.step(cache, meta, np.asarray(tokens), np.asarray(positions))
        ids = []
        for request in plan.generating:
            line = logits[last_row[request.request_id]]
            results[request.request_id][2][request.context - 1] = line
            ids.append(int(np.argmax(line)))
        for request, token in zip(plan.generating, ids):
            results[request.request_id][1].append(token)
        scheduler.advance(plan, ids)
    return results, mixed


def dense_greedy(model, prompt, max_new):
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(int(np.argmax(model.dense(np.asarray(tokens))[-1])))
    return tokens[len(prompt):]


def relative(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_served_llama_matches_its_own_run(backend, dtype):
    rng = np.random.default_rng(3)
    model, reference = _models()
    first = rng.integers(0, SHAPE.vocab, 50)
    second = np.concatenate([first[:40], rng.integers(0, SHAPE.vocab, 30)])  # shares 40
    third = rng.integers(0, SHAPE.vocab, 21)
    config = CacheConfig(SHAPE.layers, SHAPE.kv_heads, SHAPE.head_dim, 16, 64,
                         getattr(ml_dtypes, dtype, dtype), num_q_heads=SHAPE.heads)
    with KvCache(config, backend=backend) as cache:
        scheduler = Scheduler(cache, max_batched_tokens=24)
        # "first" alone, then "second" (a prefix hit: 32 tokens, two blocks) while "third"
        # decodes
        arrivals = [[("first", first)]] + [[]] * 8 + [[("third", third)], [("second", second)]]
        results, mixed = serve(model, cache, scheduler, arrivals, max_new=6)
        cache.check_invariants()
    prompt, generated, rows, (prefilled, chunks) = results["second"]
    assert prefilled == len(second) - 32, "the prefix hit's 32 tokens were computed again"
    assert chunks >= 2 and results["first"][3][1] >= 3 and mixed >= 1, (chunks, mixed)
    for name, (prompt, generated, rows, _) in results.items():
        sequence = np.concatenate([prompt, generated[:-1]]).astype(np.int64)
        want = reference(sequence)
        for position, line in rows.items():
            assert relative(line, want[position]) < TOLERANCE[dtype], (name, position)
        if dtype == "float32":
            assert generated == dense_greedy(model, prompt, 6), name


def test_the_numpy_llama_is_the_transformers_llama():
    """Where transformers is installed: its LlamaForCausalLM and llama_np agree."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = _hf_model(transformers, torch)
    tokens = np.random.default_rng(5).integers(0, SHAPE.vocab, 37)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)[None]).logits[0].double().numpy()
    ours = Llama(SHAPE, weights_of(hf)).dense(tokens)
    assert relative(ours, theirs) < 1e-5


def _hf_model(transformers, torch):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=SHAPE.vocab, hidden_size=SHAPE.hidden, intermediate_size=SHAPE.intermediate,
        num_hidden_layers=SHAPE.layers, num_attention_heads=SHAPE.heads,
        num_key_value_heads=SHAPE.kv_heads, head_dim=SHAPE.head_dim, rms_norm_eps=SHAPE.eps,
        rope_theta=SHAPE.rope_theta, max_position_embeddings=512, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config).float().eval()


def _models():
    """(the model served through the cache, the dense run its logits are checked against):
    transformers' Llama and its own logits where installed, else llama_np's dense run."""
    try:
        import torch
        import transformers
    except ImportError:
        model = Llama(SHAPE, random_weights(SHAPE, seed=0))
        return model, model.dense
    hf = _hf_model(transformers, torch)
    model = Llama(SHAPE, weights_of(hf))

    def theirs(tokens):
        with torch.no_grad():
            return hf(torch.from_numpy(tokens)[None]).logits[0].double().numpy()

    return model, theirs
