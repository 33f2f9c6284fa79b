"""``data.share_prefixes`` on a run's steps: whether a step's rows run with what they share once.

Which rows each optimizer step trains is fixed before any layout is chosen (``data.steps``: the rows
packed whole, a seeded order of their bins). Sharing only regroups one step's rows into micro-batches
that hold each shared part once: fewer or shorter micro-batches, the same rows, the same loss and
gradient. Two layouts: **groups**, one shared start per group of rows
(:func:`slipstream.data.prefix_groups.share_rows`), and **trees**, every shared history once at every
level (:func:`slipstream.data.prefix_tree.share_rows_as_trees`: multi-turn rows, reasoning chats whose
earlier reasoning is dropped, agent steps). ``auto`` never changes what a run trains, only how fast a
step runs, and ``train`` and ``slipstream ab`` both take their micro-batches from
:class:`PrefixSharing`.

The modes: ``off``; ``groups`` / ``tree`` (that layout, forced); ``on`` (sharing forced, the layout the
cost model, or the token count, finds faster); ``auto`` (the faster layout where it is modelled at least
``AUTO_MIN_SAVING`` faster than the rows whole; the policy line says what each layout saves).

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

from ..data.pair_trees import share_pairs_as_trees
from ..data.prefix_groups import SharingReport, combined, group_rows, share_rows
from ..data.prefix_tree import TreeSharingReport, combined_tree_reports, share_rows_as_trees, tree_tokens
from ..packing.groups import group_documents
from ..packing.trees import is_tree, unshared_tree_rows

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

    def pairs(self, own: int, prefix: int) -> int:
        """(query, key) pairs one document's attention computes: causal over its own tokens, plus every
        query over the shared context it reads. On a CPU a document with context is one masked SDPA call,
        which computes its whole rectangle (measured: the masked call is no slower than the causal and
        dense calls apart, and skips no block)."""
        if prefix and self.call_per_document:
            return own * (own + prefix)
        return own * (own + 1) // 2 + own * prefix

    def seconds(self, micro_batches: Sequence[Sequence[Sample]]) -> float:
        """Modelled time of micro-batches of documents or of prefix groups."""
        total = 0.0
        for items in micro_batches:
            shapes = list(document_shapes(items))
            tokens = sum(own for own, _ in shapes)
            pairs = sum(self.pairs(own, prefix) for own, prefix in shapes)
            # CPU: a call per document; CUDA varlen: one a micro-batch, a second where documents have a prefix
            calls = len(shapes) if self.call_per_document else 1 + any(prefix for _, prefix in shapes)
            total += tokens * self.token_seconds + self.layers * (
                calls * self.call_seconds + pairs * self.pair_seconds
            )
        return total


def document_shapes(items: Sequence[Sample]):
    """``(own tokens, shared context it attends to)`` per document of a micro-batch's documents, groups
    or trees."""
    for item in items:
        if is_tree(item):
            nodes = item["tree_nodes"]
            context: list[int] = []
            for node in nodes:
                parent = node["parent"]
                context.append(0 if parent < 0 else context[parent] + len(nodes[parent]["input_ids"]))
                yield len(node["input_ids"]), context[-1]
            continue
        if "completions" in item:  # GRPO's G completions of a prompt as they pack today (the prompt once)
            prompt = len(item["prompt_ids"])
            first, *rest = (len(c) for c in item["completions"])
            yield prompt + first, 0
            for own in rest:
                yield own, prompt
            continue
        if "prompt_ids" in item:  # a preference pair as it packs today: prompt + chosen, then rejected
            prompt = len(item["prompt_ids"])
            yield prompt + len(item["chosen_ids"]), 0
            yield len(item["rejected_ids"]), prompt
            continue
        if "continuations" not in item:
            yield len(item["input_ids"]), 0
            continue
        prefix = len(item.get("prefix_ids", ()))
        first, *rest = (len(c["input_ids"]) for c in item["continuations"])
        yield prefix + first, 0
        for own in rest:
            yield own, prefix


def layout_documents(items: Sequence[Sample]) -> list[Sample]:
    """A micro-batch's items as its packed row runs them (a group: its start once; a tree: every node
    once), for a model-FLOP count (the attention to shared context is not counted)."""
    docs: list[Sample] = []
    for item in items:
        if is_tree(item):
            docs += [{"input_ids": n["input_ids"], "labels": n["labels"]} for n in item["tree_nodes"]]
        elif "continuations" in item:
            docs += group_documents([item])
        else:
            docs.append(item)
    return docs


def whole_rows(items: Sequence[Sample]) -> list[Sample]:
    """The rows a micro-batch's items hold, each whole."""
    rows: list[Sample] = []
    for item in items:
        if is_tree(item):
            rows += unshared_tree_rows([item])
        elif "continuations" in item:
            rows += group_rows(item)
        else:
            rows.append(item)
    return rows


def item_tokens(items: Sequence[Sample]) -> int:
    """The tokens of the rows in ``items`` counted whole (tokens/s counts the same in every layout)."""
    total = 0
    for item in items:
        if is_tree(item):
            total += tree_tokens(item, shared=False)
        else:
            total += sum(len(row["input_ids"]) for row in whole_rows([item]))
    return total


LAYOUTS = ("groups", "tree")


class PrefixSharing:
    """A run's ``data.share_prefixes``: its decision (``decide``), and each step's micro-batches.

    ``pairs``: the items are preference pairs (each already runs its prompt once); the one layout is
    trees across pairs (:func:`slipstream.data.pair_trees.share_pairs_as_trees`), against today's pairs."""

    def __init__(
        self, mode: str, max_seq_len: int, seed: int, unable: str | None = None, pairs: bool = False
    ):
        self.mode, self.max_seq_len, self.seed, self.unable = mode, max_seq_len, seed, unable
        self.pairs = pairs
        self.on = False
        self.layout: str | None = None  # "groups" or "tree" once on
        self.report: SharingReport | None = None
        self.tree_report: TreeSharingReport | None = None
        self.policy = "shared prefixes off (data.share_prefixes: off): every row runs whole"
        self.modelled: dict[str, float] | None = None

    def _layout_of(self, rows: list[Sample], step: int, layout: str):
        if self.pairs:
            return share_pairs_as_trees(rows, self.max_seq_len, seed=self.seed + step)
        if layout == "tree":
            return share_rows_as_trees(rows, self.max_seq_len, seed=self.seed + step)
        return share_rows(rows, self.max_seq_len, seed=self.seed + step)

    def share(self, bins: Sequence[Sequence[Sample]], step: int = 0) -> list[list[Sample]]:
        """One rank's bins of one step (whole rows) as micro-batches of groups or trees: the same rows,
        in the decided layout (before a decision: the mode's own, groups unless it is ``tree``)."""
        rows = [row for rows_of_bin in bins for row in rows_of_bin]
        layout = self.layout or ("tree" if self.mode == "tree" else "groups")
        return self._layout_of(rows, step, layout)[0]

    def decide(
        self, steps: Sequence[Sequence[Sequence[Sample]]], cost: Callable[[], LayoutCost] | None
    ) -> bool:
        """Decide on the first epoch's steps (``steps[i]``: step i's bins, whole rows, one rank's);
        ``cost`` builds the device's cost model (``auto`` / ``on``). Sets ``on``, ``layout``, the
        reports, ``policy``."""
        if self.mode == "off":
            return False
        steps = list(steps)[:AUTO_MODELLED_STEPS]
        candidates = ["tree"] if self.pairs else [self.mode] if self.mode in LAYOUTS else list(LAYOUTS)
        shared_steps: dict[str, list] = {}
        summaries: list[str] = []
        saved: dict[str, int] = {}  # per layout, the tokens it saves
        for layout in candidates:
            reports, micro = [], []
            for number, bins in enumerate(steps):
                rows = [row for rows_of_bin in bins for row in rows_of_bin]
                shared, report = self._layout_of(rows, number, layout)
                reports.append(report)
                micro.append(shared)
            shared_steps[layout] = micro
            if layout == "tree":
                report = self.tree_report = combined_tree_reports(reports)
            else:
                report = self.report = combined(reports)
            summaries.append(report.summary())
            saved[layout] = report.saved_tokens
        summary = "; ".join(summaries) + f" (over {len(steps)} steps, each step's own rows)"
        if self.mode in LAYOUTS or (self.pairs and self.mode == "on"):
            self.on, self.layout = True, candidates[0]
            self.policy = f"shared prefixes on as {self._name(self.layout)} (data.share_prefixes: {self.mode}): {summary}"
            return True
        if self.unable and self.mode == "auto":
            self.policy = f"shared prefixes off (auto: {self.unable}): {summary}"
            return False
        if max(saved.values()) <= 0 and self.mode == "auto":
            self.policy = f"shared prefixes off (auto): {summary}"
            return False
        by_tokens = max(candidates, key=lambda layout: (saved[layout], layout == "groups"))
        model = cost() if cost is not None and self.mode == "auto" else None
        if model is None or not (model.token_seconds or model.pair_seconds):
            self.on = self.mode == "on" or saved[by_tokens] > 0
            self.layout = by_tokens if self.on else None
            self.policy = (
                f"shared prefixes {'on as ' + self._name(by_tokens) if self.on else 'off'} ({self.mode}"
                f"{'' if self.mode == 'on' else ', no cost model'}: the layout that runs fewer tokens): {summary}"
            )
            return self.on
        whole = sum(model.seconds(bins) for bins in steps)
        modelled = {
            layout: sum(model.seconds(micro) for micro in shared_steps[layout]) for layout in candidates
        }
        best = min(candidates, key=lambda layout: modelled[layout])
        self.modelled = {"whole_s": whole, "shared_s": modelled[best]}
        self.modelled.update({f"{layout}_s": seconds for layout, seconds in modelled.items()})
        ratio = modelled[best] / whole if whole else 1.0
        self.on = ratio <= 1 - AUTO_MIN_SAVING
        self.layout = best if self.on else None
        each = ", ".join(
            f"{self._name(layout)} {modelled[layout] / whole if whole else 1.0:.2f}x" for layout in candidates
        )
        self.policy = (
            f"shared prefixes {'on as ' + self._name(best) if self.on else 'off'} (auto: modelled {ratio:.2f}x "
            f"{'the pairs as they pack alone' if self.pairs else 'the whole rows'}' time on this device, {'at most' if self.on else 'above'} {1 - AUTO_MIN_SAVING:.2f}x; "
            f"{each}): {summary}"
        )
        return self.on

    def probe(self, context: Any, first_step: Sequence[Sequence[Sample]], collate: Callable) -> None:
        """Run the first shared micro-batch forward once, no grad, before step 0 (every rank the same one,
        so a sharded model's collectives match): a model that cannot hold the layout exactly refuses it
        here (chunked attention, LongRoPE across its threshold). ``auto`` then runs the rows whole and
        says why; a forced layout stops with the refusal, before any step. ``collate``: a micro-batch's
        items -> its host ``PackedBatch``."""
        from ..errors import TrainError
        from ..packing.batch import UnsupportedSharedPrefix

        for micro in self.share(first_step, 0):
            batch = collate(micro)
            if not batch.has_prefixes:
                continue
            inputs = {**batch.to(context.device).model_inputs(), "labels": None}
            cuda = [context.device] if context.device.type == "cuda" else []
            try:  # its dropout draws from a forked generator: the run's draws stay the unshared run's
                with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                    context.model(**inputs)
            except UnsupportedSharedPrefix as error:
                if self.mode != "auto":
                    raise TrainError(f"data.share_prefixes {self.mode}: {error}") from error
                self.on, self.layout = False, None
                self.policy = f"shared prefixes off (auto: the model refuses them: {error})"
            return

    def _name(self, layout: str) -> str:
        if self.pairs:
            return "prefix trees across pairs"
        return "prefix trees" if layout == "tree" else "one shared start a group"

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"policy": self.policy, "on": self.on, "layout": self.layout}
        if self.report is not None:
            found.update(self.report.as_dict())
        if self.tree_report is not None:
            found["tree"] = self.tree_report.as_dict()
        if self.modelled is not None:
            found["modelled_seconds"] = {k: round(v, 6) for k, v in self.modelled.items()}
        return found
