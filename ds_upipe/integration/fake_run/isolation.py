"""A measurement in this process, or in a child Python process where this one already has a process group
(a training job's ranks: the fake group cannot coexist with theirs)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import torch.distributed as dist

from . import steps


def isolated(function: str, **kwargs: Any) -> dict[str, Any]:
    """``function(**kwargs).as_dict()`` of ``steps``, in this process when it has no process group,
    else in a child Python process (a training job's ranks: the fake group cannot coexist with theirs)."""
    if not dist.is_initialized():
        return _as_dict(getattr(steps, function)(**kwargs))
    code = "import json,sys; from ds_upipe.integration import fake_run; fake_run._child()"
    payload = json.dumps({"function": function, "kwargs": kwargs})
    done = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fake-tensor measurement {function}({kwargs}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child() -> None:
    request = json.loads(sys.stdin.read())
    result = _as_dict(getattr(steps, request["function"])(**request["kwargs"]))
    print(json.dumps(result))


def _as_dict(result: Any) -> dict[str, Any]:
    return result if isinstance(result, dict) else result.as_dict()
