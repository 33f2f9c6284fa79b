"""``data.share_prefixes`` on a run's steps: whether a step's rows run with their shared start once.

Which rows each optimizer step trains is fixed before any layout is chosen (``data.steps``: the rows
packed whole, a seeded order of their bins). Sharing only regroups one step's rows
(:func:`slipstream.data.prefix_groups.share_rows`) into micro-batches that hold each shared start
once: fewer or shorter micro-batches, the same rows, the same loss and gradient. So ``auto`` never
changes what a run trains, only how fast a step runs, and ``train`` and ``slipstream ab`` both take
their micro-batches from :class:`PrefixSharing`.

``auto`` decides by a cost model of this device, not by a token count (:class:`LayoutCost`): a step's
modelled time is its tokens at the linear layers' FLOPs over the measured matmul peak, plus, per
layer, each attention call's fixed cost and its (query, key) pairs at the calibrated score cost
(:mod:`slipstream.packing.costs`). It shares when the regrouped micro-batches of the first epoch's
steps are modelled at least ``AUTO_MIN_SAVING`` faster than the rows packed whole; the policy line
says both figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..data.prefix_groups import SharingReport, combined, share_rows

# ``auto`` shares when the model says the shared micro-batches take at most this much less time.
AUTO_MIN_SAVING = 0.02
# ``auto`` models at most this many steps of the first epoch (host work before step 0).
AUTO_MODELLED_STEPS = 256

Sample = dict[str, Any]


@dataclass(frozen=True)
class LayoutCost:
    """The modelled seconds of a micro-batch layout on one device (forward + backward)."""

    token_seconds: float  # every layer's linears, per token
    call_seconds: float  # one attention call, per layer
    pair_seconds: float  # one (query, key) pair of one layer, every head
    layers: int  # attention layers
    # CPU: one call per document; CUDA varlen: one per micro-batch (two with prefixes)
    call_per_document: bool

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> LayoutCost:
        """The model's FLOP profile at the measured matmul peak, with the attention costs ``optimize``
        handed its attention modules (calibrated on this CPU, or the built-in ones)."""
        from ..packing.costs import ATTENTION_COSTS, BUILTIN
        from ..utilisation import flop_profile, matmul_peak

        profile = flop_profile(model)
        peak = (matmul_peak(device, dtype) or {}).get("flops_per_s") or 0.0
        costs = next((ATTENTION_COSTS[m] for m in model.modules() if m in ATTENTION_COSTS), BUILTIN)
        layers = sum(group[0] for group in profile.attention)
        per_pair = max((group[1] for group in profile.attention), default=0)  # 12 x heads x head_dim
        on_cpu = torch.device(device).type == "cpu"
        return cls(
            token_seconds=profile.token_flops / peak if peak else 0.0,
            call_seconds=costs.call_seconds if on_cpu else 0.0,
            # the calibrated cost of a score element per head and head dimension (CPU), or its FLOPs at the peak
            pair_seconds=(
                costs.score_seconds * per_pair / 12 if on_cpu else (per_pair / peak if peak else 0.0)
            ),
            layers=layers,
            call_per_document=on_cpu,
        )

    def seconds(self, micro_batches: Sequence[Sequence[Sample]]) -> float:
        """Modelled time of micro-batches of documents or of prefix groups."""
        total = 0.0
        for items in micro_batches:
            shapes = list(document_shapes(items))
            tokens = sum(own for own, _ in shapes)
            pairs = sum(own * (own + 1) // 2 + own * prefix for own, prefix in shapes)
            # CPU: a call per document; CUDA varlen: one a micro-batch, a second where documents have a prefix
            calls = len(shapes) if self.call_per_document else 1 + any(prefix for _, prefix in shapes)
            total += tokens * self.token_seconds + self.layers * (
                calls * self.call_seconds + pairs * self.pair_seconds
            )
        return total


def document_shapes(items: Sequence[Sample]):
    """``(own tokens, shared prefix it attends to)`` per document of a micro-batch's documents or groups."""
    for item in items:
        if "continuations" not in item:
            yield len(item["input_ids"]), 0
            continue
        prefix = len(item.get("prefix_ids", ()))
        first, *rest = (len(c["input_ids"]) for c in item["continuations"])
        yield prefix + first, 0
        for own in rest:
            yield own, prefix


class PrefixSharing:
    """A run's ``data.share_prefixes``: its decision (``decide``), and each step's micro-batches."""

    def __init__(self, mode: str, max_seq_len: int, seed: int, unable: str | None = None):
        self.mode, self.max_seq_len, self.seed, self.unable = mode, max_seq_len, seed, unable
        self.on = False
        self.report: SharingReport | None = None
        self.policy = "shared prefixes off (data.share_prefixes: off): every row runs whole"
        self.modelled: dict[str, float] | None = None

    def share(self, bins: Sequence[Sequence[Sample]], step: int = 0) -> list[list[Sample]]:
        """One rank's bins of one step (whole rows) as micro-batches of groups: the same rows."""
        rows = [row for rows_of_bin in bins for row in rows_of_bin]
        return share_rows(rows, self.max_seq_len, seed=self.seed + step)[0]

    def decide(
        self, steps: Sequence[Sequence[Sequence[Sample]]], cost: Callable[[], LayoutCost] | None
    ) -> bool:
        """Decide on the first epoch's steps (``steps[i]``: step i's bins, whole rows, one rank's);
        ``cost`` builds the device's cost model (``auto`` only). Sets ``on``, ``report``, ``policy``."""
        if self.mode == "off":
            return False
        steps = list(steps)[:AUTO_MODELLED_STEPS]
        reports, shared_steps = [], []
        for number, bins in enumerate(steps):
            rows = [row for rows_of_bin in bins for row in rows_of_bin]
            shared, report = share_rows(rows, self.max_seq_len, seed=self.seed + number)
            reports.append(report)
            shared_steps.append(shared)
        self.report = combined(reports)
        summary = self.report.summary() + f" (over {len(steps)} steps, each step's own rows)"
        if self.mode == "on":
            self.on, self.policy = True, f"shared prefixes on (data.share_prefixes: on): {summary}"
            return True
        if self.unable:
            self.policy = f"shared prefixes off (auto: {self.unable}): {summary}"
            return False
        if not self.report.groups:
            self.policy = f"shared prefixes off (auto): {summary}"
            return False
        model = cost() if cost is not None else None
        if model is None or not (model.token_seconds or model.pair_seconds):
            self.on = self.report.saved_tokens > 0
            self.policy = (
                f"shared prefixes {'on' if self.on else 'off'} (auto, no cost model: by tokens): {summary}"
            )
            return self.on
        whole = sum(model.seconds(bins) for bins in steps)
        shared = sum(model.seconds(micro) for micro in shared_steps)
        self.modelled = {"whole_s": whole, "shared_s": shared}
        ratio = shared / whole if whole else 1.0
        self.on = ratio <= 1 - AUTO_MIN_SAVING
        verdict = "on" if self.on else "off"
        self.policy = (
            f"shared prefixes {verdict} (auto: modelled {ratio:.2f}x the whole rows' time on this device, "
            f"{'at most' if self.on else 'above'} {1 - AUTO_MIN_SAVING:.2f}x): {summary}"
        )
        return self.on

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"policy": self.policy, "on": self.on}
        if self.report is not None:
            found.update(self.report.as_dict())
        if self.modelled is not None:
            found["modelled_seconds"] = {k: round(v, 6) for k, v in self.modelled.items()}
        return found
