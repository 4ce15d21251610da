"""One spawn of 4 DeepSpeed ranks (``run_ranks(..., use_deepspeed=True)``) for the test files whose cases
need one: each file's rank body runs in it, one after the other (the session fixture
``four_deepspeed_ranks`` of tests/conftest.py).  A spawn's start, 4 ranks importing torch, DeepSpeed and
transformers, costs about 24 s of CPU, 12 s of the 2-core test machine's wall time."""

from __future__ import annotations

import importlib
from typing import Any

#: test file -> its rank body (``fn(rank, world)`` of a tests/*_cases.py module); the memory
#: measurements first, as each ran in a fresh process before, then the float64 parity cases
PARTS = {
    "test_core_memory.py": "core_cases.memory_by_head_chunk",
    "test_hf_memory.py": "hf_cases.memory_case",
    "test_core_vs_deepspeed.py": "core_cases.deepspeed_parity",
    "test_hybrid_engine.py": "hybrid_engine_cases.spawn_body",
    "test_vlm.py": "vlm_cases.spawn_body",
}


def run_parts(rank: int, world: int, parts: list[str]) -> dict[str, Any]:
    """Inside a rank: each body of ``parts`` (values of PARTS) in order; their results by part."""
    results = {}
    for part in parts:
        module, name = part.split(".")
        results[part] = getattr(importlib.import_module(f"tests.{module}"), name)(rank, world)
    return results
