"""``objectives.sharing``: what ``auto`` decides by (the device's cost model), and a step's micro-batches."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from slipstream.data import pack_samples
from slipstream.data.labels import IGNORE_INDEX
from slipstream.data.prefix_groups import group_rows
from slipstream.objectives.sft import SFT
from slipstream.objectives.sharing import AUTO_MIN_SAVING, LayoutCost, PrefixSharing, document_shapes


def rows(n: int = 8, system: int = 300, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prompt = [rng.randrange(5, 1000) for _ in range(system)]
    out = []
    for _ in range(n):
        own = [rng.randrange(5, 1000) for _ in range(rng.randint(20, 60))]
        out.append({"input_ids": prompt + own, "labels": [IGNORE_INDEX] * system + own})
    return out


def cpu_cost(**overrides) -> LayoutCost:
    figures = dict(token_seconds=1e-6, call_seconds=1e-4, pair_seconds=1e-9, layers=4, call_per_document=True)
    return LayoutCost(**(figures | overrides))


def one_step(n: int = 8, max_seq_len: int = 512):
    bins, _ = pack_samples(rows(n), max_seq_len, seed=0)
    return [bins]  # one step: every bin, whole rows


def test_a_groups_documents_are_its_start_with_the_first_row_then_each_continuation():
    found = PrefixSharing("on", 512, 0).share(one_step(n=4)[0])  # 300 + 4 x 20-60 tokens: one bin
    assert len(found) == 1 and len(found[0]) == 1
    shapes = list(document_shapes(found[0]))
    assert shapes[0][1] == 0 and shapes[0][0] > 300  # start + the first continuation, plain causal
    assert all(prefix == 300 for _, prefix in shapes[1:]) and len(shapes) == 4


def test_auto_shares_where_the_model_says_the_shared_step_is_faster():
    sharing = PrefixSharing("auto", 512, 0)
    assert sharing.decide(one_step(), lambda: cpu_cost())
    whole, shared = sharing.modelled["whole_s"], sharing.modelled["shared_s"]
    assert shared < whole * (1 - AUTO_MIN_SAVING)
    assert f"modelled {shared / whole:.2f}x the whole rows' time" in sharing.policy
    assert sharing.as_dict()["saved_fraction"] > 0.5


def test_auto_stays_off_where_sharing_would_not_save_time():
    # a CUDA-like model whose second varlen call costs more than the tokens sharing saves
    sharing = PrefixSharing("auto", 4096, 0)
    slow_second_call = cpu_cost(
        token_seconds=1e-12, pair_seconds=1e-15, call_seconds=1.0, call_per_document=False
    )
    steps = [pack_samples(rows(4, system=20), 4096, seed=0)[0]]
    assert not sharing.decide(steps, lambda: slow_second_call)
    assert sharing.policy.startswith("shared prefixes off (auto: modelled ") and not sharing.on
    # the same rows on the CPU's model (a call per document either way): the saved tokens win
    assert PrefixSharing("auto", 4096, 0).decide(steps, lambda: cpu_cost())


def test_on_off_and_what_auto_cannot_do_need_no_cost_model():
    def no_model():
        raise AssertionError("the cost model was built")

    assert PrefixSharing("on", 512, 0).decide(one_step(), no_model)
    off = PrefixSharing("off", 512, 0)
    assert not off.decide(one_step(), no_model) and "off (data.share_prefixes: off)" in off.policy
    unable = PrefixSharing("auto", 512, 0, unable="speedups.chunked_loss is off")
    assert not unable.decide(one_step(), no_model) and "speedups.chunked_loss is off" in unable.policy
    nothing = PrefixSharing("auto", 512, 0)
    assert not nothing.decide([pack_samples(rows(4, system=4, seed=s), 512)[0] for s in range(2)], no_model)


def _run(bins, world_size: int, rank: int):
    objective = SFT(None)  # what plan_step reads of its context: the bins, weights, device and ranks
    objective.sharing = PrefixSharing("on", 512, 0)
    objective.sharing.on = True
    run = SimpleNamespace(
        bins=bins,
        weights=[objective.weight(b) for b in bins],
        device=torch.device("cpu"),
        ranks=SimpleNamespace(rank=rank, world_size=world_size),
    )
    return objective, run


def test_a_step_runs_its_own_rows_regrouped_and_every_rank_as_many_micro_batches():
    bins = one_step(8)[0] + [[r] for r in rows(3, system=40, seed=7)]  # 8 rows sharing a start, 3 others
    objective, run = _run(bins, world_size=1, rank=0)
    plan = objective.plan_step(run, 0, list(range(len(bins))))
    assert len(plan.micro) < len(bins) and plan.record["micro_batches"] == len(plan.micro)
    assert plan.total == sum(run.weights) and plan.tokens == sum(len(r["input_ids"]) for b in bins for r in b)
    # two ranks whose regrouped rows would need different counts (rank 0: 4 rows sharing a start, one
    # micro-batch; rank 1: 4 unrelated rows, four): each shares within its own bins, as many as it has
    sharing_bins = one_step(4)[0]
    unrelated = [[r] for seed in range(4) for r in rows(1, system=300, seed=10 + seed)]
    interleaved = [b for pair in zip(sharing_bins, unrelated, strict=True) for b in pair]
    alone = [len(PrefixSharing("on", 512, 0).share(interleaved[rank::2])) for rank in range(2)]
    assert alone == [1, 4]
    counts = []
    for rank in range(2):
        objective, run = _run(interleaved, world_size=2, rank=rank)
        plan = objective.plan_step(run, 0, list(range(len(interleaved))))
        counts.append(len(plan.micro))
        assert len(plan.documents) == 8  # every rank's micro-batches, for the step's model FLOPs
    assert counts == [4, 4]


def test_regrouped_micro_batches_hold_exactly_the_steps_rows():
    step = one_step(8)[0]
    shared = PrefixSharing("on", 512, 0).share(step, 3)
    regrouped = sorted(tuple(r["input_ids"]) for micro in shared for g in micro for r in group_rows(g))
    assert regrouped == sorted(tuple(r["input_ids"]) for b in step for r in b)
