"""Where an arm's memory goes in one training step: live tensor bytes by kind at the step's peak,
against the process's resident peak (what ``slipstream ab`` reports as "cpu peak RSS").

Each arm runs in a fresh process, as in ``slipstream ab``: its warm-up steps, then one step under
``torch.profiler`` (``profile_memory=True``), whose memory timeline (PyTorch's own categories:
parameters, optimizer state, activations, gradients, temporaries, autograd detail) gives the live
bytes at the step's peak. The gap between that and the resident peak is what the allocator holds
beyond the live tensors (freed memory not returned to the system).

    python benchmarks/memory_profile.py --model DIR --data FILE --response-only --lora-rank 16 \\
        --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --dtype float32 \\
        --arms stock-packed,slipstream

Takes ``slipstream ab``'s workload options (``--steps`` is the warm-up steps run before the profiled one).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json

import torch

from slipstream.bench.ab_config import ABConfig
from slipstream.bench.arm_result import peak_memory_mb
from slipstream.bench.arm_run import RowsArmSession
from slipstream.bench.ceiling import proc_status_kib
from slipstream.bench.command import ab_config_from_args, add_ab_arguments
from slipstream.bench.lockstep import run_in_fresh_process
from slipstream.bench.runner import prepare_bins

MB = 2**20


def profile_arm(config_dict: dict, arm: str, plan: list, vocab_size: int) -> dict:
    """The arm's warm-up steps, then one more step profiled: live bytes by category at its peak."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    config = ABConfig.from_dict(config_dict)
    session = RowsArmSession(config, arm, plan, vocab_size)
    warm = len(plan) - 1
    for step in range(warm):
        session.step(step)
    rss_before = proc_status_kib("VmRSS") / 1024
    hwm_before = peak_memory_mb("cpu")
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        session.step(warm)
    timeline = MemoryProfileTimeline(prof._memory_profile())
    times, sizes = timeline._coalesce_timeline(torch.device("cpu"))
    # sizes[i]: bytes per category at time i (categories in the timeline's order; the last is "unknown")
    totals = [sum(row) for row in sizes]
    peak_index = max(range(len(totals)), key=totals.__getitem__)
    names = [
        "parameter",
        "optimizer state",
        "input",
        "temporary",
        "activation",
        "gradient",
        "autograd detail",
        "unknown",
    ]
    at_peak = dict(zip(names, (value / MB for value in sizes[peak_index]), strict=False))
    by_op = collections.Counter()
    for event in prof.events():
        if event.cpu_memory_usage > 0:
            by_op[event.name] += event.cpu_memory_usage
    return {
        "arm": arm,
        "live_peak_mb": totals[peak_index] / MB,
        "live_at_peak_mb": at_peak,
        "rss_before_mb": rss_before,
        "hwm_before_mb": hwm_before,
        "hwm_after_mb": peak_memory_mb("cpu"),
        "allocated_by_op_mb": {name: size / MB for name, size in by_op.most_common(12)},
        "policies": session.state.policies if session.state else [],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_ab_arguments(parser, {"steps": 3, "warmup": 1, "arms": ("stock-packed", "slipstream")})
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    config = ab_config_from_args(args)
    plan, vocab_size, _ = prepare_bins(config)
    found = []
    for arm in config.ab.arms:
        result = run_in_fresh_process(profile_arm, dataclasses.asdict(config), arm, plan, vocab_size)
        found.append(result)
        live = ", ".join(f"{k} {v:.0f}" for k, v in result["live_at_peak_mb"].items() if v >= 1)
        print(
            f"{arm}: live tensors at the step's peak {result['live_peak_mb']:.0f} MB ({live}); resident peak "
            f"{result['hwm_after_mb']:.0f} MB (before the profiled step: {result['hwm_before_mb']:.0f} MB, "
            f"resident then {result['rss_before_mb']:.0f} MB)"
        )
        top = ", ".join(f"{k} {v:.0f}" for k, v in result["allocated_by_op_mb"].items())
        print(f"  allocated in the step, by op (MB, summed over calls): {top}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(found, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
