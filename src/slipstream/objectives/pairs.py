"""What every preference objective shares (DPO, IPO, SimPO, ORPO): pairs read, packed and collated
with the prompt once, the reference pass, the step's loss through ``pair_terms``, evaluation.

A subclass says its ``name``, its ``pair_terms`` (:mod:`slipstream.loss.preference`), whether it
needs the reference log-probs (``reference_free``) and, where it reports more than the reward
metrics, ``metrics``. The settings (:class:`PairSettings`) are the config's ``preference`` section
(``beta``, ``simpo_gamma``, ``prefix_sharing``, ``reference``); a reference-free objective ignores
``reference``. Pairs are read by :mod:`slipstream.data.pairs` and packed by
:mod:`slipstream.packing.pairs`; the log-prob forward is :mod:`.answers`, the reference cache :mod:`.reference`.

The reference (for DPO and IPO) is the base model: with LoRA the same model with the adapter off.
``precomputed`` (the default): one ``no_grad`` pass over every bin before step 0
(:func:`.answers.reference_pass`), with the policy as it starts (a LoRA adapter starts
at zero, so this is the base), kept per bin and cached; ``per_step``: each micro-batch's reference
forward runs in the step, under ``disable_adapter()``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
from tqdm import tqdm

from ..data import PackingReport
from ..data.cache import cache_root
from ..data.pair_trees import pair_history_key
from ..data.pairs import load_pairs
from ..data.prompts import split_prompts
from ..data.steps import history_steps
from ..fields import Range
from ..loss.preference import METRICS, PairTerms
from ..optimize import state_of
from ..packing.batch import cut
from ..packing.pairs import (
    collate_pair_trees,
    collate_pairs,
    counted_tokens,
    pack_pairs,
    pair_documents,
    pair_tokens,
)
from ..packing.trees import is_tree
from . import answers as pair_forward
from .answers import evaluate_pairs
from .base import Objective, ObjectiveContext, ObjectiveData, StepPlan, split_held_out, tokenizer_refusals
from .evaluation import HeldOut, rank_share
from .pair_sharing import PairTrees
from .reference import cache_key, precomputed_reference, reference_cached, weights_fingerprint
from .sharing import PrefixSharing, layout_documents

logger = logging.getLogger("slipstream")


@dataclass(frozen=True)
class PairSettings:
    """The preference objectives' settings: the config's ``preference:`` section (``training.objective``
    dpo / ipo / simpo / orpo), or an A/B arm's. Each field's rule is declared here, where it is read."""

    # how far from the reference the policy may move (orpo: the odds-ratio term's weight, lambda)
    beta: Annotated[float, Range(gt=0)] = 0.1
    simpo_gamma: Annotated[float, Range(ge=0)] = 1.0  # SimPO's target reward margin
    # a pair packed as prompt | chosen | rejected, the prompt run once (else prompt+chosen, prompt+rejected)
    prefix_sharing: bool = True
    # the reference log-probs: one pass before step 0, cached (the base model: the adapter starts at
    # zero); or per_step, in every step with the adapter off (LoRA only)
    reference: Literal["precomputed", "per_step"] = "precomputed"


class PairObjective(Objective):
    """The base of the preference objectives (see the module docstring)."""

    reads = "pairs"
    metrics: ClassVar[tuple[str, ...]] = METRICS
    reference_free: ClassVar[bool] = False
    # a pair past data.max_seq_len has its longer answer cut (else it is a bad row: the reward model)
    cuts_answers: ClassVar[bool] = True
    # what shares one prompt in its packed row (said where prefix trees across them are refused); None:
    # prefix trees across pairs are supported (data.share_prefixes tree / on)
    prompt_shared_by: ClassVar[str | None] = None

    def __init__(self, config: Any = None, settings: PairSettings | None = None) -> None:
        super().__init__(config)
        self.settings = settings if settings is not None else config.preference
        self.chunked = True  # the model's chunked loss gives the answer sums; set by before_training
        self.reference: list[torch.Tensor] | None = None
        self.eval_reference: list[torch.Tensor] | None = None
        self.per_step_reference = False
        self.pair_trees: PairTrees | None = None  # data.share_prefixes' decision on pairs (before_training)
        self.tree_reference: dict[tuple[int, ...], list[torch.Tensor]] | None = None

    @property
    def trees(self) -> PairTrees | None:
        """The run's pair trees where they are on (else None: each pair packed alone)."""
        return self.pair_trees if self.pair_trees is not None and self.pair_trees.on else None

    def pair_terms(
        self, policy: torch.Tensor, reference: torch.Tensor | None, lengths: torch.Tensor
    ) -> PairTerms:
        raise NotImplementedError

    @classmethod
    def validate(cls, config, fail) -> None:
        """What the preference objectives cannot do yet is refused by name."""
        objective = f"training.objective {config.training.objective!r}"
        if config.data.path is None:
            fail(
                "data.path",
                f"{objective} needs preference pairs: set data.path (there is no built-in demo of pairs)",
            )
        if config.speedups.packed_attention is False:
            fail(
                "speedups.packed_attention",
                f"{objective} trains packed pairs: speedups.packed_attention false is not supported",
            )
        if config.data.overflow == "split":
            fail("data.overflow", f"{objective}: a pair cannot be split; data.overflow must be 'truncate'")
        if config.data.batching != "bfd":
            fail(
                "data.batching",
                f"{objective}: pairs are packed best-fit by their shared length; data.batching "
                f"{config.data.batching} is for SFT rows (set bfd)",
            )
        shares = config.data.share_prefixes
        if shares in ("tree", "on") and cls.prompt_shared_by is not None:
            fail(
                "data.share_prefixes",
                f"{objective} runs each prompt once for {cls.prompt_shared_by} (preference.prefix_sharing); "
                f"data.share_prefixes {shares} (prompts shared across them, as prefix trees) is not supported "
                "for it yet: set data.share_prefixes off or auto",
            )
        if shares == "groups":
            fail(
                "data.share_prefixes",
                f"data.share_prefixes groups is for SFT rows; {objective} runs each pair's prompt once already "
                "(preference.prefix_sharing): set data.share_prefixes tree to share the histories pairs' "
                "prompts share, or off",
            )
        if shares in ("tree", "on") and not config.preference.prefix_sharing:
            fail(
                "data.share_prefixes",
                f"data.share_prefixes {shares} runs every shared prompt once; preference.prefix_sharing false "
                "runs each pair's prompt twice: set one of them the other way",
            )
        if shares in ("tree", "on") and config.speedups.chunked_loss is False:
            fail(
                "data.share_prefixes",
                f"data.share_prefixes {shares} on pairs reads each answer's first log-prob across the shared "
                "history (the chunked loss): set speedups.chunked_loss true (or leave it out), or "
                "data.share_prefixes off",
            )
        if config.preference.reference == "per_step" and not cls.reference_free:
            if not config.lora.enabled:
                fail(
                    "preference.reference",
                    "preference.reference 'per_step' is the base with the adapter off: it needs lora.enabled "
                    "(a full fine-tune's reference is 'precomputed')",
                )
            if config.lora.experts:
                fail(
                    "preference.reference",
                    "preference.reference 'per_step' cannot switch lora.experts adapters off: use 'precomputed'",
                )

    # ------------------------------------------------------------------ rows and bins
    def read(self, tokenizer, info) -> ObjectiveData:
        """The pairs, their bins and the held-out pairs; what was skipped or cut is said."""
        config, sharing = self.config, self.settings.prefix_sharing

        max_seq_len, on_bad_row = config.data.max_seq_len, "skip" if config.data.skip_bad_rows else "error"
        load = tokenizer_refusals(
            config,
            lambda path: load_pairs(
                path, tokenizer, max_seq_len=max_seq_len, on_bad_row=on_bad_row, cut=self.cuts_answers
            ),
        )

        pairs, report = load(config.data.path)
        pairs, evals = split_held_out(
            config,
            info,
            pairs,
            load=load,
            split=functools.partial(split_prompts, noun="pairs"),
            eval_set=lambda held_out, source: HeldOut(
                pack_pairs(held_out, config.data.max_seq_len, config.seed), source, len(held_out), "pairs"
            ),
            what="pairs",
            said=lambda eval_report: eval_report.data.skipped or eval_report.truncated,
        )
        bins, blocks = pack_pairs(pairs, config.data.max_seq_len, config.seed), None
        if config.data.step_order == "histories":  # pairs that share a history in one step (data.steps)
            per_step = config.training.grad_accum * info.world_size
            bins, blocks = history_steps(
                pairs, config.data.max_seq_len, per_step, pair_tokens, pair_history_key
            )
        if info.is_main:
            tqdm.write(f"slipstream train: {report.summary()}")  # skipped rows and cut pairs are always said
        real = sum(pair_tokens(pair, sharing) for pair in pairs)
        # bins are filled by the shared length whichever layout runs (the same pairs per step either way);
        # unshared, a row runs each prompt twice and may pass max_seq_len: its slots are then its length
        capacity = sum(max(config.data.max_seq_len, sum(pair_tokens(p, sharing) for p in b)) for b in bins)
        packing = PackingReport(
            num_samples=len(pairs),
            num_bins=len(bins),
            real_tokens=real,
            capacity=capacity,
            efficiency=real / capacity,
        )
        logger.info("%s (pairs)", packing.summary())
        return ObjectiveData(pairs, bins, packing, report, evals, blocks)

    def documents(self, rows: Sequence[dict]) -> list[dict]:
        """A micro-batch's documents as its packed row runs them (pairs, or pair trees: every node once)."""
        return layout_documents(rows) if rows and is_tree(rows[0]) else pair_documents(rows)

    def weight(self, rows: Sequence[dict]) -> int:
        return len(rows)  # every pair weighs the same

    def tokens(self, rows: Sequence[dict]) -> int:
        return counted_tokens(rows)

    def pairs(self, rows: Sequence[dict]) -> int:
        return len(rows)

    # ------------------------------------------------------------------ before step 0
    def before_training(self, context: ObjectiveContext) -> str | None:
        """``data.share_prefixes``' decision (pair trees, :mod:`.pair_sharing`), then, for
        ``preference.reference: precomputed``, every bin's reference sums (train and eval), or with
        trees every distinct step layout's, once, cached (its ranks, base model, device, dtype, bins and
        evals read from ``context``)."""
        state = state_of(context.base_model)
        self.chunked = state is not None and state.chunked_loss is not None
        self.pair_trees, sharing = None, None
        mode = self.config.data.share_prefixes
        if mode != "off" and self.settings.prefix_sharing and self.chunked:
            precomputed = not self.reference_free and self.settings.reference == "precomputed"
            self.pair_trees = PairTrees(self.config, reference_pass=precomputed)
            sharing = self.pair_trees.decide(context)
        if self.reference_free:
            line = f"reference: none ({self.name} is reference-free)"
        elif self.settings.reference != "precomputed":
            self.per_step_reference = True
            line = "reference: per_step (a no_grad forward with the adapter off in every step)"
        else:
            line = self._precompute(context)
        return line if sharing is None else f"{line}; {sharing}"

    def _precompute(self, context: ObjectiveContext) -> str:
        config, info = self.config, context.ranks
        model, chunked, sharing = context.base_model, self.chunked, self.settings.prefix_sharing
        preset = None
        if config.model.path is None:
            preset = {"preset": config.model.preset, "layers": config.model.layers, "seed": config.seed}
        weights = weights_fingerprint(config.model.path, preset)
        base = {
            "dtype": str(context.dtype),
            "device": context.device.type,
            "four_bit": config.quantization.four_bit,
            "double_quant": config.quantization.double_quant,
            "prefix_sharing": sharing,
            "chunked": chunked,
            "torch": torch.__version__,
        }

        def compute(items):
            if items and is_tree(items[0]):  # a pair-tree micro-batch: the reference in the policy's layout
                batch = collate_pair_trees(items, context.device)
                return pair_forward.reference_sums(model, batch, chunked, adapter=False)
            return self.reference_log_probs(model, [items], context.device)[0]

        started = time.perf_counter()
        steps: list[tuple[tuple[int, ...], int]] = []
        if self.trees is not None:
            steps, micro = self.trees.reference_items(context)
            sets = [("train-trees", micro)]
        else:
            sets = [("train", context.bins)]
        sets += [("eval", context.evals.bins)] if context.evals is not None else []
        computed = False
        cache = config.data.cache
        for part, bins in sets:
            key = cache_key(weights, {**base, "set": part}, bins)
            if part == "train-trees":  # each rank its own trees: every rank reads, or every rank computes
                # (FSDP2: every forward is a collective, so every rank reads only where every rank can)
                everywhere = info.sum(float(cache and reference_cached(key))) >= info.world_size
                read = everywhere or info.strategy != "fsdp2"
                sums, how = precomputed_reference(key, bins, compute, cache=cache, read=read)
                self.tree_reference = self._by_step(steps, sums)
                computed = computed or "computed" in how
                continue
            if info.enabled and cache and info.strategy != "fsdp2":
                # DDP: rank 0 computes and writes, the others read it
                if info.is_main:
                    precomputed_reference(key, bins, compute, cache=True)
                info.barrier()
            if info.strategy == "fsdp2":
                # every forward is a collective (the parameters are gathered): every rank reads, or every
                # rank computes (and rank 0 writes), as the cache says before any of them writes
                cached = cache and reference_cached(key)
                info.barrier()
                sums, how = precomputed_reference(
                    key, bins, compute, cache=cached or (cache and info.is_main)
                )
                info.barrier()
            else:
                sums, how = precomputed_reference(key, bins, compute, cache=cache)
            computed = computed or "computed" in how
            if part == "train":
                self.reference = sums
            else:
                self.eval_reference = sums
        seconds = time.perf_counter() - started
        count = sum(len(bins) for _, bins in sets)
        where = cache_root() / "reference"
        what = f"{count} bins" + (f", the trees of {len(steps)} step layouts" if steps else "")
        if computed:
            return (
                f"reference log-probs computed once in {seconds:.1f} s before step 0 ({what}, "
                + ("train and eval" if len(sets) > 1 else "train")
                + (f"; cached under {where})" if cache else ")")
            )
        return f"reference log-probs read from the cache ({where}; {what})"

    @staticmethod
    def _by_step(steps, sums) -> dict[tuple[int, ...], list[torch.Tensor]]:
        """The tree reference sums, in ``reference_items``' order, per step (its bins) as its micro-batches."""
        return dict(zip((key for key, _ in steps), cut(sums, [count for _, count in steps]), strict=True))

    def reference_log_probs(self, model, bins, device) -> list[torch.Tensor] | None:
        """Every bin's reference sums (the one reference pass, :func:`.answers.reference_pass`), as this
        objective packs them; None for a reference-free objective."""
        if self.reference_free:
            return None
        return pair_forward.reference_pass(
            model, bins, prefix_sharing=self.settings.prefix_sharing, device=device, chunked=self.chunked
        )

    def prepared(self, part: str, index: int):
        found = self.reference if part == "train" else self.eval_reference
        return None if found is None else found[index]

    # ------------------------------------------------------------------ the step
    def plan_step(self, context: ObjectiveContext, step: int, step_bins) -> StepPlan:
        """The step's bins as they are, or, where pair trees are on, this rank's pairs regrouped into
        trees (the same pairs), each micro-batch with its reference sums in that layout."""
        if self.trees is None:
            return super().plan_step(context, step, step_bins)
        layout = self.trees.layout(context, step_bins)
        micro = [trees for parts, _ in layout for trees in parts]
        reference = self.tree_reference.get(tuple(step_bins)) if self.tree_reference is not None else None
        if reference is None and self.tree_reference is not None:
            raise RuntimeError(
                f"pair trees: no reference sums were computed for the step of bins {step_bins}"
            )
        return StepPlan(
            micro=[
                self.collate(trees, context.device, None if reference is None else reference[number])
                for number, trees in enumerate(micro)
            ],
            total=sum(context.weights[index] for index in step_bins),
            tokens=sum(self.tokens(context.bins[index]) for index in step_bins),
            documents=[self.documents(trees) for trees in micro],
            pairs=sum(self.pairs(context.bins[index]) for index in step_bins),
            record={"micro_batches": len(micro)},
        )

    def collate(self, rows, device, prepared=None):
        if rows and is_tree(rows[0]):
            return collate_pair_trees(rows, device=device), prepared
        return collate_pairs(rows, self.settings.prefix_sharing, device=device), prepared

    def micro_weight(self, micro) -> int:
        return micro[0].answers.num_pairs

    def model_device(self, micro) -> torch.device:
        return micro[0].input_ids.device

    def ready(self, model, micro):
        batch, reference = micro
        if reference is None and self.per_step_reference:
            reference = pair_forward.reference_sums(model, batch, self.chunked, adapter=True)
        return batch, reference

    def micro_batch(self, model, micro, weight):
        batch, reference = micro
        return pair_forward.pair_loss(model, batch, reference, self.pair_terms, self.chunked, weight)

    def divisor(self, total: int) -> float:
        return float(total)

    def evaluate(self, model, evals, info, device) -> dict[str, float]:
        batches = []
        # every rank as many forwards (FSDP2 gathers in each), the last ones repeated and not counted
        for index, counts in rank_share(len(evals.bins), info.rank, info.world_size):
            micro = self.ready(model, self.collate(evals.bins[index], device, self.prepared("eval", index)))
            batches.append((*micro, counts))
        return evaluate_pairs(
            model,
            batches,
            step=lambda model, micro: self.micro_batch(model, micro, 1)[1],
            metrics=self.metrics,
            reduce=info.sum_tensor,
        )

    def summary(self, bins, last) -> dict:
        settings = self.settings
        decided = self.pair_trees
        sharing = decided.sharing if decided is not None else PrefixSharing("off", 0, 0, pairs=True)
        return {
            "shared_prefixes": sharing.as_dict(),
            "preference": {
                "objective": self.name,
                "beta": settings.beta,
                "prefix_sharing": settings.prefix_sharing,
                "reference": "none" if self.reference_free else settings.reference,
                "pairs": sum(len(b) for b in bins),
                "last_step": None if last is None else {k: last[k] for k in self.metrics},
            },
        }
