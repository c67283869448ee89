"""Malformed payloads: seeded fuzzing of real payloads, allocation bounds, and which errors loads converts.

``nox -s fuzz -- CASES [SEED]`` runs the fuzz test with more cases (``PC_PICKLE_FUZZ_CASES``,
``PC_PICKLE_FUZZ_SEED``); the default here is sized to stay well under 20 s on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import struct
import sys
import tracemalloc
import types
from collections.abc import Iterator

import pytest
import torch

import pc_pickle

pytestmark = pytest.mark.filterwarnings("error")

FUZZ_CASES = int(os.environ.get("PC_PICKLE_FUZZ_CASES", "20000"))
FUZZ_SEED = int(os.environ.get("PC_PICKLE_FUZZ_SEED", "16"))


def _real_payloads() -> list[bytes]:
    """Copy payloads of what pc_pickle carries: tensors (one large enough to be a raw region), lambdas,
    closures, modules, Parameters, nested containers, a module's state_dict."""
    weight = torch.arange(6.0).view(2, 3)

    def closure(x: torch.Tensor) -> torch.Tensor:
        return x @ weight.t()

    nested = {
        "t": weight,
        "view": weight.t(),
        "big": torch.linspace(0, 1, 40_000),  # 160 KB: written as its own piece, outside the checksum
        "p": torch.nn.Parameter(torch.ones(3)),
        "f": lambda x: x + 1,
        "closure": closure,
        "mod": math,
        "data": [1, 2.5, "text", b"bytes", (None, True), {"k": [weight[0]]}],
    }
    return [
        pc_pickle.dumps(nested),
        pc_pickle.dumps(torch.nn.Linear(4, 3).state_dict()),
        pc_pickle.dumps([types, lambda: math.pi, {"deep": [[[1, 2], (3,)], "s" * 300]}]),
        pc_pickle.dumps(torch.arange(10, dtype=torch.bfloat16)),
    ]


def _raw_regions(data: bytes) -> list[range]:
    """The byte ranges the header lists as raw tensor bytes (outside the checksum), in payload offsets."""
    (head_size,) = struct.unpack_from("<I", data, 3)
    count = struct.unpack_from("<I", data, 7 + 4 + 2 + 8 + 4)[0]
    body = 7 + head_size + 1
    regions = []
    for i in range(count):
        start, size = struct.unpack_from("<QQ", data, 7 + 22 + 16 * i)
        regions.append(range(body + start, body + start + size))
    return regions


def _mutations(payloads: list[bytes], cases: int, seed: int) -> Iterator[tuple[str, bytes, bool]]:
    """(description, mutated bytes, may_load): single-byte changes, insertions, deletions, truncations."""
    rng = random.Random(seed)
    for _ in range(cases):
        index = rng.randrange(len(payloads))
        data = payloads[index]
        kind = rng.random()
        pos = rng.randrange(len(data))
        if kind < 0.7:
            value = (data[pos] + rng.randrange(1, 256)) % 256
            mutated = data[:pos] + bytes([value]) + data[pos + 1 :]
            in_region = any(pos in region for region in _raw_regions(data))
            yield f"payload {index}: byte {pos} {data[pos]:#04x} -> {value:#04x}", mutated, in_region
        elif kind < 0.8:
            yield f"payload {index}: insert at {pos}", data[:pos] + b"\x00" + data[pos:], False
        elif kind < 0.9:
            yield f"payload {index}: delete byte {pos}", data[:pos] + data[pos + 1 :], False
        else:
            yield f"payload {index}: truncated to {pos} bytes", data[:pos], False


def test_fuzz_single_byte_mutations_and_truncations_raise_payloaderror() -> None:
    payloads = _real_payloads()
    for data in payloads:
        pc_pickle.loads(data)  # the originals load
    bad: list[str] = []
    loaded_in_region = 0
    for what, mutated, may_load in _mutations(payloads, FUZZ_CASES, FUZZ_SEED):
        try:
            pc_pickle.loads(mutated)
        except pc_pickle.PayloadError:
            continue
        except Exception as exc:  # anything else is the bug this test exists for
            bad.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        if may_load:
            loaded_in_region += 1  # a changed tensor value: data, not structure
        else:
            bad.append(f"{what}: loaded without an error")
    assert not bad, f"{len(bad)} of {FUZZ_CASES} cases (seed {FUZZ_SEED}):\n" + "\n".join(bad[:20])
    assert loaded_in_region > 0  # the sample did reach the raw tensor bytes


def _peak_bytes_of_loads(data: bytes) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with contextlib.suppress(pc_pickle.PayloadError):
            pc_pickle.loads(data)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memo_index_bomb_allocates_nothing_beyond_the_input() -> None:
    # PROTO 5, the old payload marker, LONG_BINPUT 2**26, STOP: the unpickler would zero-fill a 1 GB memo.
    bomb = b"\x80\x05\x8c\x12pc_pickle._payload\x94r" + struct.pack("<I", 2**26) + b"."
    assert len(bomb) == 29
    with pytest.raises(pc_pickle.PayloadError, match="not a pc_pickle payload"):
        pc_pickle.loads(bomb)
    assert _peak_bytes_of_loads(bomb) < 64 * 1024


def test_declared_sizes_and_corrupt_payloads_allocate_at_most_about_the_input() -> None:
    good = pc_pickle.dumps({"s": "x" * 1000, "t": torch.ones(100)})
    # BYTEARRAY8 declaring 2**40 bytes right after a copy of a real header.
    declared = good[:60] + b"\x96" + struct.pack("<Q", 2**40) + b"."
    for data in [declared, *(m for _, m, _ in _mutations([good], 200, FUZZ_SEED))]:
        assert _peak_bytes_of_loads(data) < 64 * 1024 + 2 * len(data), data[:80]


class _Fragile:
    """An object whose own ``__setstate__`` refuses to load (a user error, not a payload error)."""

    def __init__(self) -> None:
        self.state = 1

    def __setstate__(self, state: object) -> None:
        raise ValueError("the object's own __setstate__ refused")


def test_error_raised_by_an_objects_own_setstate_propagates_unchanged() -> None:
    data = pc_pickle.dumps([1, _Fragile()])
    with pytest.raises(ValueError, match="own __setstate__ refused") as info:
        pc_pickle.loads(data)
    assert not isinstance(info.value, pc_pickle.PayloadError)


def test_a_class_that_cannot_be_imported_here_is_a_payloaderror_naming_it() -> None:
    module = types.ModuleType("pc_pickle_test_vanishing")
    exec("class Thing:\n    pass\n", module.__dict__)
    module.Thing.__module__ = module.__name__
    sys.modules[module.__name__] = module
    try:
        data = pc_pickle.dumps([module.Thing()])
    finally:
        del sys.modules[module.__name__]
    with pytest.raises(pc_pickle.PayloadError, match=r"pc_pickle_test_vanishing\.Thing") as info:
        pc_pickle.loads(data)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
