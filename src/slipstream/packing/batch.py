"""PackedBatch: several documents in one row, with their metadata built once on the host.

The collator knows every document length as a Python int, so it derives everything the
attention needs (position_ids, cu_seqlens, max_seqlen) here, before the batch reaches the
device. No layer ever has to recover these from a device tensor, so no layer syncs.
Anything derived later (a sliding-window mask, a flex BlockMask) is memoised on the batch
object itself: when the batch goes away so does the memo, and nothing can go stale.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..data.labels import IGNORE_INDEX  # noqa: F401 - re-exported with the batch
from ..refusal import Refusal

# The keyword under which the batch travels through transformers' **kwargs to the attention.
PACKED_BATCH_KWARG = "slipstream_packed_batch"


class UnsupportedSharedPrefix(Refusal, NotImplementedError):
    """Rows that share a prompt or prefix which packed training cannot keep exact for this model.

    No speedup avoids it (``avoid`` None): the data's prefix sharing must go
    (``preference.prefix_sharing: false``, ``data.share_prefixes``, ``collate_groups(...,
    prefix_sharing=False)``)."""

    avoid = None


# PackedBatch's own tensor fields (its answers hold more), in the order they are moved or pinned.
TENSOR_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "loss_positions", "loss_targets")


@dataclass(eq=False)
class PackedBatch:
    """Documents concatenated into one row of T tokens, plus host-built metadata.

    Tensors are ``[1, T]`` (``input_ids``, ``labels``, ``position_ids``), ``[N+1]``
    (``cu_seqlens``, int32) and ``[num_label_tokens]`` (``loss_positions``: the positions t
    whose next-token label ``labels[t + 1]`` counts, which the chunked loss projects through
    the LM head; nothing else is; with ``loss_targets``, the position of every counted
    prediction and ``loss_targets`` its token, a position repeated where it counts more than
    once). ``seq_lens``, ``max_seqlen`` and ``num_label_tokens`` are plain Python values, so
    reading them never touches the device. The metadata describes the labels as collated:
    change labels after collating and collate again.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: tuple[int, ...]
    max_seqlen: int
    num_label_tokens: int
    loss_positions: torch.Tensor | None = None
    # Per document: how many tokens at the start of another document (its *source*) it also
    # attends to, before its own, its positions continuing from them (a preference pair's
    # rejected answer sees the prompt its chosen answer follows, :mod:`.pairs`; a group's
    # continuations see the group's shared prefix, :mod:`.groups`). None: every document attends
    # to itself only.
    prefix_lens: tuple[int, ...] | None = None
    answers: AnswerSpans | None = None  # the answers whose summed log-probs a preference loss reads
    # Per document with a prefix: the document whose first ``prefix_lens[i]`` tokens it attends to
    # (an earlier one, itself without a prefix). None: the previous document (i - 1), as for pairs.
    prefix_sources: tuple[int, ...] | None = None
    # [num_label_tokens]: the token each of ``loss_positions`` predicts, where that is not simply
    # the next token of the row (a group's continuation is predicted from its prefix's last
    # token; a labelled prefix token counts once per continuation). None: ``labels[t + 1]``.
    loss_targets: torch.Tensor | None = None
    # Per document of a prefix tree (:mod:`.trees`): the document it continues (its parent node), or
    # -1 for a tree's first node. A node attends to every ancestor's tokens, whole, then causally to
    # its own, its positions continuing from its parent's end; documents in depth-first pre-order, so
    # a node's subtree is the documents right after it. None: no tree (``prefix_lens`` may be set).
    parents: tuple[int, ...] | None = None
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def has_prefixes(self) -> bool:
        """Whether some document attends to tokens outside itself (a shared prefix or tree ancestors)."""
        if self.parents is not None:
            return any(parent >= 0 for parent in self.parents)
        return self.prefix_lens is not None and any(self.prefix_lens)

    def context_sources(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per document, what it attends to before its own tokens, in order: ``((document, tokens at
        its start), ...)`` (a group's continuation: its prefix's source; a tree node: every ancestor,
        root first, whole). Host ints, memoised; every consumer of shared context reads this."""

        def build() -> tuple[tuple[tuple[int, int], ...], ...]:
            if self.parents is None:
                sources = self.prefix_sources or tuple(i - 1 for i in range(self.num_docs))
                return tuple(
                    () if span is None else ((source, span[1] - span[0]),)
                    for span, source in zip(self.prefix_spans(), sources, strict=True)
                )
            if self.prefix_lens is not None and any(self.prefix_lens):
                raise ValueError("a batch holds prefix groups or a prefix tree, not both")
            found: list[tuple[tuple[int, int], ...]] = []
            subtree_end = self.subtree_ends()
            for number, parent in enumerate(self.parents):
                if parent < 0:
                    found.append(())
                    continue
                if not parent < number < subtree_end[parent]:
                    raise ValueError(f"document {number}'s parent {parent} must be an earlier document")
                found.append((*found[parent], (parent, self.seq_lens[parent])))
            return tuple(found)

        return self.memo("context_sources", build)

    def subtree_ends(self) -> tuple[int, ...]:
        """Per document of a tree, one past the last document of its subtree (pre-order: a node's
        subtree is the documents from it up to there), memoised. Checks the pre-order."""

        def build() -> tuple[int, ...]:
            parents = self.parents or (-1,) * self.num_docs
            open_path: list[int] = []  # the ancestors of the next document in pre-order
            for number, parent in enumerate(parents):
                while open_path and open_path[-1] != parent:
                    open_path.pop()
                if parent >= 0 and not open_path:
                    raise ValueError(
                        f"document {number}'s parent {parent} is not an open ancestor: documents of a tree "
                        "must come in pre-order (a node right after its parent's earlier subtrees)"
                    )
                open_path.append(number)
            ends = list(range(1, self.num_docs + 1))
            for number in range(self.num_docs - 1, 0, -1):
                if parents[number] >= 0:
                    ends[parents[number]] = max(ends[parents[number]], ends[number])
            return tuple(ends)

        return self.memo("subtree_ends", build)

    def context_spans(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per document, the ``(start, end)`` row ranges it attends to before its own tokens, in the
        order its row run alone holds them (memoised; Python ints)."""

        def build() -> tuple[tuple[tuple[int, int], ...], ...]:
            bounds = self.doc_bounds()
            return tuple(
                tuple((bounds[source][0], bounds[source][0] + n) for source, n in sources)
                for sources in self.context_sources()
            )

        return self.memo("context_spans", build)

    def prefix_spans(self) -> tuple[tuple[int, int] | None, ...]:
        """Per document, the ``(start, end)`` row range of the group prefix it attends to before its own
        tokens, or None (memoised; Python ints); a tree's several spans: :meth:`context_spans`."""

        def build() -> tuple[tuple[int, int] | None, ...]:
            if self.prefix_lens is None:
                return (None,) * self.num_docs
            bounds = self.doc_bounds()
            sources = self.prefix_sources or tuple(i - 1 for i in range(self.num_docs))
            spans: list[tuple[int, int] | None] = []
            for number, (prefix, source) in enumerate(zip(self.prefix_lens, sources, strict=True)):
                if not prefix:
                    spans.append(None)
                    continue
                if not 0 <= source < number or self.prefix_lens[source]:
                    raise ValueError(
                        f"document {number}'s prefix source {source} must be an earlier document without a prefix"
                    )
                start, end = bounds[source]
                if prefix > end - start:
                    raise ValueError(
                        f"document {number}'s prefix of {prefix} tokens is longer than document {source}"
                    )
                spans.append((start, start + prefix))
            return tuple(spans)

        return self.memo("prefix_spans", build)

    @property
    def alone_lengths(self) -> tuple[int, ...]:
        """Each document's length as it would run alone: its own tokens plus the prefix it attends to."""
        if not self.has_prefixes:
            return self.seq_lens
        return tuple(
            n + sum(k for _, k in sources)
            for n, sources in zip(self.seq_lens, self.context_sources(), strict=True)
        )

    @property
    def num_tokens(self) -> int:
        """Real tokens in the batch (T); a packed batch has no padding."""
        return sum(self.seq_lens)

    @property
    def num_docs(self) -> int:
        return len(self.seq_lens)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def doc_bounds(self) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` of every document, as Python ints (memoised)."""

        def build() -> list[tuple[int, int]]:
            ends = cumulative(self.seq_lens)
            return list(zip(ends[:-1], ends[1:], strict=True))

        return self.memo("doc_bounds", build)

    def split_every(self, chunk: int) -> PackedBatch:
        """The same row with every document cut into pieces of ``chunk`` tokens from its start.

        Chunked attention (Llama 4: a token attends only within its ``attention_chunk_size``
        block) is causal attention within each piece, so the packed backends run it as if each
        piece were a document. Built once per batch and chunk size, from the host lengths.
        """

        if self.has_prefixes:
            raise UnsupportedSharedPrefix(
                "chunked attention (attention_chunk_size) with shared prompts or prefixes: not supported; "
                "set preference.prefix_sharing false (pairs) or data.share_prefixes off (SFT rows; "
                "collate_groups(..., prefix_sharing=False))",
                refused="chunked attention with shared prompts or prefixes",
            )

        def build() -> PackedBatch:
            lengths: list[int] = []
            for length in self.seq_lens:
                lengths += [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
            cu_seqlens = host_tensor(cumulative(lengths), self.cu_seqlens.device, torch.int32)
            return replace(
                self, cu_seqlens=cu_seqlens, seq_lens=tuple(lengths), max_seqlen=max(lengths), _memo={}
            )

        return self.memo(("split_every", chunk), build)

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """Return ``build()``, computed once per batch and kept on this object."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> PackedBatch:
        """Move the tensors once. From CUDA-bound host tensors this pins and copies without blocking."""
        device = torch.device(device)
        if device == self.device:
            return self
        pin = device.type == "cuda" and torch.cuda.is_available()
        if non_blocking is None:
            non_blocking = pin

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if pin and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)

        moved = {name: move(getattr(self, name)) for name in TENSOR_FIELDS}
        answers = None if self.answers is None else self.answers.to(move)
        return replace(self, **moved, answers=answers, _memo={})  # a fresh memo: its tensors are elsewhere

    def model_inputs(self, num_items_in_batch: int | torch.Tensor | None = None) -> dict[str, Any]:
        """Keyword arguments for ``model(**...)``.

        Besides input_ids / labels / position_ids it passes the batch itself (read by
        slipstream's packed attention) and the varlen kwargs transformers' flash-attention
        path understands (so even stock flash attention stops re-deriving cu_seqlens per layer).
        ``use_cache=False``: with a cache, stock transformers lets packed documents see each other.

        ``num_items_in_batch``: for gradient accumulation, the label-token count of the whole
        accumulated batch, so every token weighs the same whichever micro-batch it sits in.
        """
        inputs: dict[str, Any] = {
            **self.stock_inputs(),
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
            PACKED_BATCH_KWARG: self,
        }
        if num_items_in_batch is not None:
            inputs["num_items_in_batch"] = num_items_in_batch
        return inputs

    def stock_inputs(self) -> dict[str, Any]:
        """The same batch as stock transformers sees it: ids, labels and position_ids only."""
        return {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "position_ids": self.position_ids,
            "use_cache": False,
        }


@dataclass(eq=False)
class AnswerSpans:
    """The answers of a packed row whose summed log-probs a preference loss reads.

    ``positions`` [N]: row positions whose next-token log-prob counts; ``targets`` [N]: the
    token each predicts (explicit, since a shared prompt's rejected answer is predicted from
    the prompt's last token, not from the token before it in the row); ``index`` [N]: which
    answer each belongs to (pair i: chosen 2i, rejected 2i + 1). ``lengths``: the token count of
    every answer, as Python ints (for length-normalised losses, read without a sync).
    """

    positions: torch.Tensor
    targets: torch.Tensor
    index: torch.Tensor
    lengths: tuple[int, ...]
    token_counts: torch.Tensor  # ``lengths`` as an fp32 [answers] tensor, moved with the batch
    # the log-probs of the distribution logits / temperature (online RL reads the one it sampled from)
    temperature: float = 1.0
    # [answers]: the row position of each answer's last token, where a sequence classifier (a reward
    # model) reads prompt + answer's score; None where the layout does not say (pair trees)
    ends: torch.Tensor | None = None

    @classmethod
    def of(
        cls, positions, targets, lengths: Sequence[int], temperature: float = 1.0, ends=None
    ) -> AnswerSpans:
        """Answers of ``lengths`` tokens each, in order, their tokens (``targets``) read at ``positions``."""
        return cls(
            positions=torch.as_tensor(positions, dtype=torch.long),
            targets=torch.as_tensor(targets, dtype=torch.long),
            index=owners(lengths),
            lengths=tuple(lengths),
            token_counts=torch.tensor(lengths, dtype=torch.float32),
            temperature=float(temperature),
            ends=None if ends is None else torch.as_tensor(ends, dtype=torch.long),
        )

    @property
    def num_answers(self) -> int:
        return len(self.lengths)

    @property
    def num_pairs(self) -> int:
        return len(self.lengths) // 2

    def to(self, move: Callable[[torch.Tensor], torch.Tensor]) -> AnswerSpans:
        tensors = ("positions", "targets", "index", "token_counts")
        moved = {name: move(getattr(self, name)) for name in tensors}
        return replace(self, **moved, ends=None if self.ends is None else move(self.ends))


def host_tensor(values: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host ints as a tensor on ``device``: pinned and copied without blocking off the CPU."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cpu":
        pinned = tensor.pin_memory() if torch.cuda.is_available() else tensor
        tensor = pinned.to(device, non_blocking=True)
    return tensor


def cumulative(lengths) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: cu_seqlens from the host lengths."""
    return [0, *itertools.accumulate(lengths)]


def owners(lengths: Sequence[int]) -> torch.Tensor:
    """Each token's answer, for answers of ``lengths`` tokens in order: ``[0] * l0 + [1] * l1 + ...``."""
    # one vectorised call (GRPO's completions: an answer per token, thousands a micro-batch); its size
    # from the host lengths, so nothing is read back
    counts = torch.as_tensor(lengths, dtype=torch.long)
    return torch.arange(len(counts)).repeat_interleave(counts, output_size=sum(lengths))


def cut(values: Sequence, sizes) -> list:
    """``values`` cut in order into consecutive runs of ``sizes`` items each."""
    ends = cumulative(sizes)
    return [values[start:end] for start, end in zip(ends, ends[1:], strict=False)]


def int_list(values: Any, where: str) -> list[int]:
    """``values`` (a tensor or an iterable) as a list of ints, or TypeError naming ``where``."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    values = list(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{where} must contain only ints")
    return values


def _as_int_list(values: Any, name: str, index: int) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        raise TypeError(f"sample {index}: {name!r} must be a list of ints, got {type(values).__name__}")
    return int_list(values, f"sample {index}: {name!r}")


def collate_packed(
    samples: Sequence[dict[str, Any]],
    device: torch.device | str | None = None,
    pad_to_multiple_of: int | None = None,
) -> PackedBatch:
    """Pack ``samples`` (``{"input_ids": [...], "labels": [...]}``; labels optional) into one row.

    position_ids restart at 0 for every document; cu_seqlens and max_seqlen come from the
    Python lengths. The label of each document's first token is set to -100, so no document
    is trained to predict its first token from the previous document's last one.
    ``pad_to_multiple_of`` appends one padding document (label -100) so T is a multiple of it,
    which keeps kernel shapes stable. ``device``: where the tensors go (once, pinned and
    non-blocking on CUDA).
    """
    if len(samples) == 0:
        raise ValueError("collate_packed needs at least one sample")
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    seq_lens: list[int] = []
    for index, sample in enumerate(samples):
        if "input_ids" not in sample:
            raise KeyError(f"sample {index} has no 'input_ids'")
        ids = _as_int_list(sample["input_ids"], "input_ids", index)
        if not ids:
            raise ValueError(f"sample {index} is empty")
        labs = _as_int_list(sample.get("labels", ids), "labels", index)
        if len(labs) != len(ids):
            raise ValueError(f"sample {index}: {len(labs)} labels for {len(ids)} input_ids")
        labs = [IGNORE_INDEX, *labs[1:]]
        input_ids += ids
        labels += labs
        position_ids += range(len(ids))
        seq_lens.append(len(ids))
    if pad_to_multiple_of:
        pad = -len(input_ids) % pad_to_multiple_of
        if pad:
            input_ids += [0] * pad
            labels += [IGNORE_INDEX] * pad
            position_ids += range(pad)
            seq_lens.append(pad)
    cu_seqlens = cumulative(seq_lens)
    # Position t predicts labels[t + 1]; the first label of every document is -100, so these
    # are exactly the num_label_tokens positions the loss counts.
    loss_positions = [t for t in range(len(labels) - 1) if labels[t + 1] != IGNORE_INDEX]
    batch = PackedBatch(
        input_ids=torch.tensor([input_ids], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        position_ids=torch.tensor([position_ids], dtype=torch.long),
        cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32),
        seq_lens=tuple(seq_lens),
        max_seqlen=max(seq_lens),
        num_label_tokens=len(loss_positions),
        loss_positions=torch.tensor(loss_positions, dtype=torch.long),
    )
    return batch.to(device) if device is not None else batch


def collate_padded(samples: Sequence[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """The stock layout of the same samples: one right-padded row each, with an attention mask.

    Used by the A/B benchmark and the parity tests as the reference arm.
    """
    longest = max(len(s["input_ids"]) for s in samples)
    ids, labs, mask = [], [], []
    for sample in samples:
        row = list(sample["input_ids"])
        lab = list(sample.get("labels", row))
        pad = longest - len(row)
        ids.append(row + [pad_token_id] * pad)
        labs.append(lab + [IGNORE_INDEX] * pad)
        mask.append([1] * len(row) + [0] * pad)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "labels": torch.tensor(labs, dtype=torch.long),
        "attention_mask": torch.tensor(mask, dtype=torch.long),
        "use_cache": False,
    }
