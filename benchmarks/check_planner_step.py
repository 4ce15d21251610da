"""The planner's GPU prediction against an independent fake-tensor measurement of the same step.

The planner (``ds_upipe.tools.planner.predict``) measures a two-layer step with its own driver
(``fake_run.model_step``: its PeakTracker, its phase bookkeeping) and adds, per phase, what the other
``layers - 2`` layers keep (``planner.other_layers``), the model states, ZeRO buffers and the reserve.
This script measures the same step independently, as a user of the public API would build it:

- a transformers ``*ForCausalLM`` of ``--layers`` decoder layers (default 4, so the planner's
  extrapolation from two layers is checked too) with the preset's sizes, fake weights;
- ``hf_patches.apply_upipe`` (or DeepSpeed ALST's ``register_with_transformers``) and
  ``hf_patches.apply_long_context_stack`` with the ds_config's settings;
- activation checkpointing exactly as the run installs it
  (``sp_setup.configure_activation_checkpointing``: DeepSpeed's checkpoint, the replay's outputs released);
- the decoder layers called in order, the final norm, ``hf_patches.tiled_sequence_parallel_loss``
  (or ``sequence_parallel_loss`` on the logits), ``loss.backward()``; each gradient dropped once
  accumulated, as ZeRO moves it into its bucket;
- torch's MemTracker (``ds_upipe.tools.memory.measure_peak``) as rank 0 of a fake process group.

Measured = the tracked peak minus the parameters' bytes; predicted = the planner's total minus model
states, ZeRO buffers and reserve, for the same model with ``--layers`` layers.  Both without the CUDA
kernel workspace (a separate analytic term) and with the checkpoints on the device (this fake CPU run
cannot offload: the planner's offload case differs only by its named "other layers" term).

    python benchmarks/check_planner_step.py                      # llama3-8b, 1M and 2M tokens, 8 ranks
    python benchmarks/check_planner_step.py --config ds_configs/ulysses_alst_long_context.json
    python benchmarks/check_planner_step.py --out benchmarks/results/planner_step_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30


def measure(model_name: str, config_path: str, layers: int, seq_len: int) -> dict[str, Any]:
    """The independent measurement of one step (module docstring), in this process (no process group)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    import hf_patches
    from ds_upipe.integration.config import parse_config
    from ds_upipe.integration.sp_setup import configure_activation_checkpointing, prepare_for_run
    from ds_upipe.tools import planner
    from ds_upipe.tools.memory import measure_peak, tensor_bytes

    ds_config = json.loads(Path(config_path).read_text())
    settings = parse_config(ds_config)
    setup, scheme, _ = planner.from_ds_config(ds_config)
    dims = planner.model_dims(model_name)
    group_size = setup.gpus
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[setup.dtype]
    config = dims.shape().config(layers)
    s = seq_len // group_size

    dist.init_process_group("fake", rank=0, world_size=group_size, store=FakeStore())
    group = dist.group.WORLD
    try:
        import deepspeed.comm

        # deepspeed.comm over the fake group: ALST's registration and DeepSpeed's checkpointing use it
        deepspeed.comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False, verbose=False)
        with FakeTensorMode():
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                model = AutoModelForCausalLM.from_config(config)
            finally:
                torch.set_default_dtype(previous)
            if scheme.kind != "upipe":
                from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

                UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", group_size, setup.batch)
            # as ds_upipe.initialize prepares it (the engine route), at the U the plan is for
            prepare_for_run(
                model,
                settings,
                sequence_group=group if scheme.kind == "upipe" else None,
                head_chunk_size=scheme.options.head_chunk_size,
                forward_loss="sequence_parallel",
                loss_group=group,
            )
            model.train()
            configure_activation_checkpointing(model, ds_config, settings, mpu=None)
            for p in model.parameters():  # ZeRO takes each gradient into its bucket once accumulated
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            base = model.model
            x = torch.empty(setup.batch, s, dims.hidden_size, dtype=dtype).requires_grad_(True)
            pos = torch.arange(s).expand(setup.batch, s)
            labels = torch.zeros(setup.batch, s, dtype=torch.long)
            with torch.no_grad():
                cos, sin = base.rotary_emb(x, pos)

            def forward() -> torch.Tensor:  # returns the loss only, as a model's forward hands it on
                h = x
                for layer in base.layers:
                    h = layer(h, position_embeddings=(cos, sin), position_ids=pos)
                h = base.norm(h)
                if setup.tiled_loss:
                    return hf_patches.tiled_sequence_parallel_loss(
                        model, h, labels, group, tile_tokens=setup.loss_tile_tokens
                    )
                return hf_patches.sequence_parallel_loss(model.lm_head(h), labels, group)

            def step() -> None:
                forward().backward()

            peak = measure_peak(step, [model, x, cos, sin, pos, labels], torch.device("cpu"))
            weights = tensor_bytes(*model.parameters())
    finally:
        from ds_upipe.integration.fake_run import _release_deepspeed_sp_groups

        _release_deepspeed_sp_groups()
        dist.destroy_process_group()
        comm = sys.modules.get("deepspeed.comm.comm")
        if comm is not None:
            comm.cdb = None
    return {"measured_bytes": peak - weights}


def predicted(model_name: str, config_path: str, layers: int, seq_len: int) -> dict[str, Any]:
    """The planner's activation prediction for the same step (total minus states, ZeRO buffers, reserve)."""
    from ds_upipe.tools import planner

    setup, scheme, _ = planner.from_ds_config(json.loads(Path(config_path).read_text()))
    dims = replace(planner.model_dims(model_name), num_layers=layers)
    setup = replace(setup, kernel="none", offload_checkpoints=False)
    p = planner.predict(dims, setup, scheme, seq_len)
    act = p.total_gib - p.model_states_gib - p.zero_buffers_gib - p.reserve_gib
    return {"predicted_bytes": int(round(act * GiB)), "phase": p.peak_phase, "method": p.method}


def check(model_name: str, config_path: str, layers: int, seq_len: int) -> dict[str, Any]:
    """One row: the independent measurement (in a child process: the planner's fake runs and this one
    each open their own fake process group) and the planner's prediction."""
    import subprocess

    code = (
        "import json,sys; sys.path.insert(0, 'benchmarks'); import check_planner_step as c; "
        f"print(json.dumps(c.measure({model_name!r}, {config_path!r}, {layers}, {seq_len})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(predicted(model_name, config_path, layers, seq_len))
    row.update(model=model_name, config=config_path, layers=layers, seq_len=seq_len)
    row["error"] = row["predicted_bytes"] / row["measured_bytes"] - 1
    return row


def main() -> int:
    from ds_upipe.tools.cli import parse_token_list

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--config", action="append", help="ds_config(s); default: UPipe's and ALST's long-context configs")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=parse_token_list, default=[2**20, 2**21])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    configs = args.config or ["ds_configs/upipe_long_context.json", "ds_configs/ulysses_alst_long_context.json"]
    rows = []
    print(f"{'config':<42}{'tokens':>9}{'measured GiB':>14}{'planner GiB':>13}{'error':>9}  phase")
    for config in configs:
        for seq in args.seq:
            r = check(args.model, config, args.layers, seq)
            rows.append(r)
            print(
                f"{config:<42}{seq:>9}{r['measured_bytes'] / GiB:>14.3f}{r['predicted_bytes'] / GiB:>13.3f}"
                f"{100 * r['error']:>8.2f}%  {r['phase']}"
            )
    worst = max(abs(r["error"]) for r in rows)
    print(f"largest error {100 * worst:.2f}% (target: within 3%)")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "largest_error": worst}, indent=2) + "\n")
    return 0 if worst <= 0.03 else 1


if __name__ == "__main__":
    raise SystemExit(main())
