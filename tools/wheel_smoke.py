"""Smoke test of an installed package, run by tools/wheel_check.sh with a fresh environment's
Python from a folder outside the source tree (RF_BACKEND=host, no GPU needed), for the wheel
(``--objects all``) and for a fresh clone's `pip install .` (``--objects none``).

Checks: the package comes from site-packages; `rocmforge-raw info --json` lists every prebuilt
code object (the wheel) or none and says how to get them (a source install), and names the
``hip`` extra that brings hip-python (installed without it); a host buffer round-trips; a
small KV cache's write and decode attention match ``rocmforge_raw.kernels.reference``; the packaged
sources compile at run time with NVRTC (the ``cuda`` extra). Exits non-zero, naming the check,
on the first failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import rocmforge_raw as rf
from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.kernels import jit, module, reference

TARGETS = ("sm_80.cubin", "sm_90.cubin", "compute_90.ptx", "gfx90a.hsaco", "gfx942.hsaco",
           "gfx1100.hsaco")
STEMS = ("basic", "cache_ops", "paged_attention")


def check_installed() -> None:
    assert "site-packages" in rf.__file__, f"imported from {rf.__file__}, not the wheel"


def _info() -> dict[str, Any]:
    cli = Path(sys.executable).with_name("rocmforge-raw")
    return json.loads(subprocess.run([str(cli), "info", "--json"], check=True,
                                     capture_output=True, text=True).stdout)


def check_info_lists_every_code_object() -> None:
    info = _info()
    want = {f"{stem}.{target}" for stem in STEMS for target in TARGETS}
    missing = want - set(info["code_objects"])
    assert not missing, f"rocmforge-raw info lacks {sorted(missing)}"
    assert info["code_objects_note"] is None, info["code_objects_note"]


def check_info_says_how_to_get_code_objects() -> None:
    info = _info()
    assert info["code_objects"] == [], f"a fresh clone built {info['code_objects']}"
    assert "`make kernels`" in (info["code_objects_note"] or ""), info["code_objects_note"]


def check_info_names_the_hip_extra() -> None:
    hip = _info()["backends"]["hip"]
    assert "pip install 'rocmforge_raw[hip]'" in hip, hip


def check_buffer_round_trip() -> None:
    data = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    with rf.HipBuffer.from_numpy(data) as buf:
        assert np.array_equal(buf.to_numpy(np.float32), data), "host round trip differs"


def check_cache_attention() -> None:
    rng = np.random.default_rng(2)
    config = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16,
                         num_blocks=16, dtype="float32")
    with KvCache(config) as cache:
        slots = cache.add_sequence("s", num_tokens=37).slot_mapping
        key, value = (rng.standard_normal((37, 2, 64)).astype(np.float32) for _ in range(2))
        cache.write(0, rf.DeviceArray.from_numpy(key), rf.DeviceArray.from_numpy(value), slots)
        query = rng.standard_normal((1, 4, 64)).astype(np.float32)
        out = rf.DeviceArray.empty(query.shape, query.dtype)
        batch = cache.batch(["s"])
        cache.attention(0, out, rf.DeviceArray.from_numpy(query), batch)
        k_cache, v_cache = (np.zeros((16, 2, 16, 64), np.float32) for _ in range(2))
        reference.reshape_and_cache(key, value, k_cache, v_cache, slots)
        want = reference.paged_attention(query, k_cache, v_cache, batch.block_tables,
                                         batch.seq_lens, 1 / 8)
        np.testing.assert_allclose(out.to_numpy(), want, rtol=1e-5, atol=1e-5)


def check_runtime_compilation() -> None:
    compiler = jit.compiler_for("cuda")
    with tempfile.TemporaryDirectory() as root:
        compiled = jit.compile_cached(compiler, module.SOURCE_DIR / "cache_ops.cu", "sm_90",
                                      Path(root))
    assert compiled.image[:4] == b"\x7fELF", "NVRTC returned no ELF cubin"
    print(f"  cache_ops.cu compiled for sm_90 by {compiled.compiler} in "
          f"{compiled.seconds:.2f} s")


def main() -> int:
    objects = (check_info_lists_every_code_object if "--objects=all" in sys.argv[1:] else
               check_info_says_how_to_get_code_objects)
    checks = [check_installed, objects, check_info_names_the_hip_extra, check_buffer_round_trip,
              check_cache_attention, check_runtime_compilation]
    for check in checks:
        try:
            check()
        except Exception as exc:
            print(f"wheel smoke test FAILED in {check.__name__}: {exc!r}")
            return 1
        print(f"  ok {check.__name__}")
    print(f"wheel smoke test passed ({len(checks)} checks, rocmforge_raw from {rf.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
