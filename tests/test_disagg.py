"""``rocmforge-raw demo --disaggregated``: a spawned process prefills a small Llama's prompts
and hands each sequence to the CLI's process, which decodes it; the logits equal a run in
one process, the report gives transfer time beside prefill time, a corrupted transfer fails
the verdict, the flags are checked and nothing stays live on either side."""

from __future__ import annotations

import json
import multiprocessing as mp
import re

import numpy as np
import pytest

from rocmforge_raw.cache import KvCache
from rocmforge_raw.cache.transfer.transport import Transport
from rocmforge_raw.cli.main import main
from rocmforge_raw.demo import disagg, handoff
from rocmforge_raw.demo.disagg import DisaggConfig, failures
from rocmforge_raw.demo.handoff import HandoffError, cache_config, prefill, receive
from rocmforge_raw.demo.llama import Llama, LlamaShape, random_weights
from rocmforge_raw.errors import BackendUnavailableError

#: Three requests: the first and the third share a system prompt.
DEMO = ["demo", "--disaggregated", "--backend", "host", "--scale", "0.5", "--seed", "7"]
HANDOFF = (r"demo: handoff over {}: 3 requests, prefill \d+\.\d ms/request, transfer "
           r"\d+\.\d\d ms/request \(the first \d+\.\d ms: it {}\), \d+\.\d\d MiB moved "
           r"\([\d.e+-]+ GB/s\), [1-9]\d* blocks shared, decode \d+\.\d ms/token, ")


def mooncake_or_skip():
    """Skip, saying why, where Mooncake's engine cannot move host memory here."""
    try:
        disagg.check_transport("mooncake", _host())
    except BackendUnavailableError as exc:
        pytest.skip(f"no Mooncake here: {exc}")


def _host():
    from rocmforge_raw.runtime import get_backend

    return get_backend("host")


def test_over_ipc_the_decode_process_gets_the_one_process_logits(capsys):
    assert main([*DEMO, "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert "seed 7 (rerun with --seed 7)" in err.splitlines()
    assert result["verdict"] == "OK" and result["failures"] == [] and result["mismatches"] == []
    assert result["transport"] == "ipc" and result["requests"] == 3
    assert result["logits_rows_compared"] == 3 * result["new_tokens"]
    assert result["max_logits_relative_difference"] <= disagg.TOLERANCE
    rows = result["per_request"]
    assert [r["request"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["prefill_ms"] > 0 and row["transfer_ms"] > 0 and row["decode_ms"] > 0
        assert 0 < row["read_ms"] <= row["transfer_ms"]
        assert row["chunks"] >= 2, "every prompt is longer than one chunk"
        assert row["bytes"] == row["blocks_moved"] * cache_bytes_per_block()
        assert len(row["tokens"]) == result["new_tokens"]
    # the third prompt opens with the first's system prompt: 3 full blocks on both sides
    assert rows[2]["cached_tokens"] == 48 and rows[2]["blocks_shared"] == 3
    assert rows[0]["cached_tokens"] == rows[1]["cached_tokens"] == 0
    assert result["bytes_moved"] == sum(r["bytes"] for r in rows)
    assert re.match(HANDOFF.format("ipc", "maps the slab"), result["handoff"]), result["handoff"]
    assert result["handoff"].endswith("logits equal to one process")
    assert result["prefill_exit_code"] == 0 and result["prefill_used_blocks_after"] == 0
    assert result["prefill_live_buffers_after"] == 0
    assert result["live_buffers_after_teardown"] == 0


@pytest.mark.foreign_writes  # (IPC: the sender's process writes what this reads)
def test_on_a_gpu_too(gpu, capsys):
    """The same run with both caches, the transfer and the attention on a GPU backend."""
    assert main([*DEMO, "--backend", gpu.name, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "OK" and result["backend"] == gpu.name, result["failures"]
    assert result["max_logits_relative_difference"] <= disagg.TOLERANCE
    assert result["per_request"][2]["blocks_shared"] == 3


def cache_bytes_per_block():
    shape = LlamaShape()
    return 2 * shape.layers * shape.kv_heads * 16 * shape.head_dim * 4  # float32 K and V


def test_over_mooncake_the_text_report_ends_with_the_handoff_and_the_verdict(capsys):
    mooncake_or_skip()
    assert main([*DEMO, "--transport", "mooncake"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "seed 7 (rerun with --seed 7)"
    assert lines[1].startswith("disaggregated prefill -> decode over mooncake: Llama 2 layers")
    assert lines[2].split() == ["request", "prompt", "cached", "chunks", "prefill", "ms",
                                "transfer", "ms", "read", "ms", "handoff", "ms", "KiB", "moved",
                                "shared", "decode", "ms"]
    assert [line.split()[0] for line in lines[3:6]] == ["0", "1", "2"]
    assert re.match(HANDOFF.format("mooncake", "connects"), lines[-2]), lines[-2]
    assert lines[-2].endswith("logits equal to one process")
    assert re.fullmatch(
        r"demo: OK \(3/3 requests prefilled in one process and decoded in another over "
        r"mooncake, 24 logits rows and every token equal to one process \(largest relative "
        r"difference 0\.0e\+00\), the prefill process exited 0 with every block back, no "
        r"buffer live after teardown\)", lines[-1]), lines[-1]


class Flipping(Transport):
    """The real transport, but one byte of what each read brings is changed (xor ``mask``):
    byte ``at`` of the first float32 K value of the first block it moves."""

    at, mask = 3, 0xFF  # the high byte: sign and exponent

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def _publish(self, buffer):
        return self.inner._publish(buffer)

    def endpoint_nbytes(self, endpoint):
        return self.inner.endpoint_nbytes(endpoint)

    def read(self, endpoint, dst, spans, stream=None, *, timeout=None):
        self.inner.read(endpoint, dst, spans, stream, timeout=timeout)
        byte = dst.view(int(spans[0, 1]) + self.at, 1)
        byte.copy_from_host(byte.to_numpy(np.uint8) ^ np.uint8(self.mask))

    def close(self):
        super().close()
        self.inner.close()


def corrupt(monkeypatch, at, mask):
    """The decode side's transport flips bits (the prefill process's is the real one)."""
    real = handoff.open_transport
    flipping = type("Flipped", (Flipping,), {"at": at, "mask": mask})
    monkeypatch.setattr(handoff, "open_transport", lambda name: flipping(real(name)))


def test_a_corrupted_transfer_fails_the_verdict_naming_each_mismatch(capsys, monkeypatch):
    corrupt(monkeypatch, 3, 0xFF)
    assert main(DEMO) == 1
    lines = capsys.readouterr().out.splitlines()
    assert re.search(r", logits differ from one process \(largest relative difference "
                     r"\d\.\de-\d\d\)$", lines[-2]), lines[-2]
    verdict = lines[-1]
    assert verdict.startswith("demo: FAILED: request 0's logits at decode step 1 differ from "
                              "the one-process run: relative difference "), verdict
    for request in (1, 2):  # every transfer was corrupted: every request says so
        assert f"; request {request}'s logits at decode step 1 differ" in verdict, verdict


def test_one_flipped_mantissa_bit_fails_the_verdict_too(capsys, monkeypatch):
    """The lowest bit of one K value: the float32 attention may round it away for a row
    (then that row is right), but where it shows it is far above the tolerance (3e-8)."""
    corrupt(monkeypatch, 0, 0x01)
    assert main([*DEMO, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "FAILED" and result["failures"] == result["mismatches"]
    assert result["max_logits_relative_difference"] > 1e3 * disagg.TOLERANCE
    assert all(re.fullmatch(r"request \d's logits at decode step \d differ from the "
                            r"one-process run: relative difference \d\.\d\de-\d\d > 1e-12",
                            found) for found in result["failures"]), result["failures"]


def test_the_prefill_in_chunks_past_a_prefix_hit_is_the_models_own_run():
    """What both runs share, checked against the model without a cache (float64 attention,
    float32 K/V in the cache): a prompt in chunks, then one sharing its first 48 tokens."""
    shape = LlamaShape()
    model = Llama(shape, random_weights(shape, 3))
    rng = np.random.default_rng(3)
    first = rng.integers(0, shape.vocab, 70)
    second = np.concatenate([first[:50], rng.integers(0, shape.vocab, 30)])
    with KvCache(cache_config(shape, [first, second], 1, 16), strict=True) as cache:
        results = [prefill(model, cache, i, p, 32) for i, p in enumerate((first, second))]
    (logits, cached, chunks), (logits2, cached2, chunks2) = results
    assert (cached, chunks, cached2, chunks2) == (0, 3, 48, 1)
    for got, prompt in ((logits, first), (logits2, second)):
        want = model.dense(prompt)[-1]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


# --- the flags -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--transport", "ipc"], "--transport goes with --disaggregated, which was not given"),
    (["--disaggregated", "--transport", "tcp"],
     "argument --transport: invalid choice: 'tcp' (choose from 'ipc', 'mooncake')"),
    (["--disaggregated", "--scale", "0"], "argument --scale: 0 is not above 0"),
], ids=["transport-alone", "unknown-transport", "zero-scale"])
def test_a_bad_flag_is_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["demo", "--backend", "host", *argv])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert err == f"rocmforge-raw demo: error: {message}\n"


def test_mooncake_that_cannot_reach_the_backend_is_one_line_before_anything_runs(
        capsys, monkeypatch):
    from rocmforge_raw.transport import mooncake

    monkeypatch.setattr(mooncake, "engine_class", lambda: object)
    monkeypatch.setattr(mooncake.MooncakeTransport, "reaches", staticmethod(lambda name: False))
    with pytest.raises(SystemExit) as stop:
        main(["demo", "--backend", "host", "--disaggregated", "--transport", "mooncake"])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""  # not even the seed: nothing ran
    assert err == ("rocmforge-raw demo: error: the installed Mooncake cannot reach host memory: "
                   "install mooncake-transfer-engine-cuda13 (NVIDIA) or -rocm (AMD), or use "
                   "--transport ipc\n")


# --- the exchange and the verdict ------------------------------------------------------------
def test_a_failed_prefill_process_is_its_last_line_and_a_silent_one_a_timeout():
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    theirs.send(("error", "Traceback (most recent call last):\n  ...\nValueError: bad prompt\n"))
    with pytest.raises(HandoffError, match=r"^the prefill process failed: ValueError: bad "
                                           r"prompt$"):
        receive(ours, None)
    with pytest.raises(HandoffError, match=re.escape("the prefill process sent nothing in 0.01 s")):
        receive(ours, None, timeout=0.01)
    ours.close()
    theirs.close()


def test_a_handoff_that_breaks_off_is_a_failed_verdict_with_its_reason(capsys, monkeypatch):
    def broken(*args):
        raise HandoffError("the prefill process failed: ValueError: bad prompt")

    monkeypatch.setattr(disagg, "run_disaggregated", broken)
    assert main(DEMO) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["seed 7 (rerun with --seed 7)",
                     "demo: FAILED: the prefill process failed: ValueError: bad prompt"]


GOOD = {"mismatches": [], "blocks_shared": 3, "prefill_used_blocks_after": 0,
        "prefill_live_buffers_after": 0, "prefill_exit_code": 0,
        "live_buffers_after_teardown": 0}


@pytest.mark.parametrize("change, why", [
    ({"mismatches": ["request 1's tokens differ from the one-process run from token 2 on"]},
     "request 1's tokens differ"),
    ({"blocks_shared": 0}, "the decode side shared no prefix block"),
    ({"prefill_used_blocks_after": 4}, "the prefill process still used 4 blocks"),
    ({"prefill_live_buffers_after": 1}, "1 buffers were still live in the prefill process"),
    ({"prefill_exit_code": 1}, "the prefill process exited with status 1"),
    ({"live_buffers_after_teardown": 2}, "2 buffers were still live after teardown"),
], ids=["mismatch", "no-sharing", "blocks-held", "worker-live", "worker-status", "live"])
def test_the_verdict_fails_on_each_thing_it_requires(change, why):
    assert failures(GOOD) == []
    assert any(why in found for found in failures({**GOOD, **change}))


def test_a_run_has_three_requests_at_least_so_that_two_share_a_prefix():
    assert DisaggConfig.scaled(0.01).requests == 3 and DisaggConfig.scaled(2).requests == 12
    prompts = disagg.prompts_of(np.random.default_rng(0), DisaggConfig.scaled(0.5))
    assert np.array_equal(prompts[0][:48], prompts[2][:48])
    assert not np.array_equal(prompts[0][:48], prompts[1][:48])
