"""Session fixtures shared by several test files."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def four_deepspeed_ranks(request) -> dict[str, list[Any]]:
    """The per-rank results of every rank body (tests/four_ranks.py) that the session's selected tests
    using this fixture need, all from one spawn of 4 DeepSpeed ranks: {test file: [result of rank r]}."""
    from ds_upipe.tools.ranks import run_ranks
    from tests.four_ranks import PARTS, run_parts

    files = {
        item.path.name for item in request.session.items if "four_deepspeed_ranks" in getattr(item, "fixturenames", ())
    }
    wanted = [name for name in PARTS if name in files]
    results = run_ranks(run_parts, 4, [PARTS[name] for name in wanted], use_deepspeed=True)
    return {name: [r[PARTS[name]] for r in results] for name in wanted}
