"""Prefix parity: packed rows that share a prefix give every token what the stock model gives it alone.

Three checks of the compatibility sweep (its ``prefix``, ``groups`` and ``tree`` columns,
:mod:`slipstream.compat.columns`), each on a copy of a tiny stock model under
``optimize(**options)``:

* :func:`check_prefix_sharing`: preference pairs (:data:`PAIR_LENGTHS`) packed
  ``prompt | chosen | rejected`` by ``collate_pairs`` (the rejected answer attends to its prompt,
  never the chosen answer), against each ``prompt + answer`` run alone through the stock model;
* :func:`check_prefix_groups`: prefix groups (:data:`GROUP_SHAPES`: a prefix and N = 4
  continuations, a prefix and 2) packed by ``collate_groups`` (each continuation attends to its
  group's prefix and itself, never a sibling), against each ``prefix + continuation`` run alone;
* :func:`check_prefix_tree`: a prefix tree of depth 4 (:data:`TREE_ROWS`, labelled shared spans)
  packed by ``collate_trees`` (each node attends to its ancestors and itself, never a sibling or a
  cousin), against each row run alone.

Each function's docstring says what is compared, and within which bound.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate, pairwise
from typing import Any

import torch

from ..modes import eval_mode
from ..optimize import optimize, state_of
from ..parity import SEED, Step, compare, copy_model, documents, grads_of, policies_of, problems
from .arm import ArmResult, failed

# Preference pairs of the prefix-sharing column, (prompt, chosen, rejected) tokens: answers
# shorter and longer than the windows (8) so a rejected answer's window reaches into its prompt
# or past it; prompt + answer below, at and above the position thresholds (16); every prompt +
# answer below the dynamic-RoPE model's max_position_embeddings (32), the packed row (49) above.
PAIR_LENGTHS = ((11, 7, 5), (6, 8, 12))
# Bounds of the prefix-sharing check in fp32: each answer token's log-prob (absolute), each
# answer's summed log-prob through the chunked loss (relative).
PAIR_TOLERANCE = {"token_logprob": 1e-5, "summed_logprob": 1e-4}

# Prefix groups of the prefix-groups column, (prefix, [continuations]) tokens: N = 4 continuations
# after a prefix longer than the windows (8), prefix + continuation on both sides of the position
# thresholds (16) and below the dynamic-RoPE model's max_position_embeddings (32); a second group of
# two; the packed row (50) above it.
GROUP_SHAPES = ((11, (3, 7, 9, 5)), (5, (4, 6)))
GROUP_TOLERANCE = {"token_logprob": 1e-5}

# The prefix tree of the tree column: spans (tokens) A 9, B 4, C 3, D1 5, D2 2, E 3, F 7 and rows
# A+B+C+D1, A+B+C+D2, A+B+E, A+F and A+B (a row that ends where a shared span ends): depth 4, A longer
# than the windows (8), rows on both sides of the position thresholds (16) and below the dynamic-RoPE
# model's max_position_embeddings (32), the packed row (33) above it; A's second half and B labelled.
TREE_SPANS = {"A": 9, "B": 4, "C": 3, "D1": 5, "D2": 2, "E": 3, "F": 7}
TREE_ROWS = (("A", "B", "C", "D1"), ("A", "B", "C", "D2"), ("A", "B", "E"), ("A", "F"), ("A", "B"))


ANSWER_KEYS = ("chosen_ids", "rejected_ids")


def preference_pairs(
    model: torch.nn.Module, lengths=PAIR_LENGTHS, seed: int = SEED
) -> list[dict[str, list[int]]]:
    """Random preference pairs (``{"prompt_ids", "chosen_ids", "rejected_ids"}``) of ``lengths``,
    from the same random documents as the sweep's (:func:`documents`)."""
    flat = documents(model, lengths=[n for pair in lengths for n in pair], seed=seed)
    return [
        {"prompt_ids": flat[3 * i], "chosen_ids": flat[3 * i + 1], "rejected_ids": flat[3 * i + 2]}
        for i in range(len(lengths))
    ]


def pair_reference(stock: torch.nn.Module, pairs: list[dict[str, list[int]]]) -> list[torch.Tensor]:
    """Per answer (pair i: chosen 2i, rejected 2i + 1), the stock log-prob [A] (fp32) of each of
    its tokens, ``prompt + answer`` run alone through the stock model (eval, no grad)."""
    expected = []
    with eval_mode(stock), torch.no_grad():
        for pair in pairs:
            prompt = pair["prompt_ids"]
            for key in ANSWER_KEYS:
                answer = pair[key]
                logits = stock(input_ids=torch.tensor([prompt + answer])).logits[0].float()
                rows = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1]
                targets = torch.tensor(answer).unsqueeze(1)
                expected.append(rows.log_softmax(-1).gather(1, targets).squeeze(1))
    return expected


def _token_logprobs(logits_1TV: torch.Tensor, answers) -> torch.Tensor:
    """[N] fp32: the log-prob of every answer token, read from full logits at ``answers.positions``."""
    rows = logits_1TV[0].index_select(0, answers.positions).float()
    return rows.log_softmax(-1).gather(1, answers.targets.unsqueeze(1)).squeeze(1)


def check_prefix_sharing(
    stock: torch.nn.Module,
    pairs: list[dict[str, list[int]]],
    expected: list[torch.Tensor],
    options: dict[str, Any],
) -> ArmResult:
    """``pairs`` packed with their prompts shared (``collate_pairs(prefix_sharing=True)``) through a
    copy of ``stock`` under ``optimize(**options)``, against ``expected`` (:func:`pair_reference`):

    * with the chunked loss off, a forward without labels: every answer token's log-prob from
      the logits, within ``PAIR_TOLERANCE["token_logprob"]`` (absolute) of the stock one;
    * with the chunked loss as ``options`` set it, a forward with labels: the summed log-prob of
      every answer it leaves on the batch (``answer_logprobs_of``), within
      ``PAIR_TOLERANCE["summed_logprob"]`` (relative) of the stock sum. Where the chunked loss is
      off (advised off, or refused for this model), the sums are read from the logits
      (``answer_logprobs_from_logits``) instead, and the detail says so.

    Eval mode (no dropout, no training-only routing) on both sides. A slipstream refusal is
    ``refused``, any other exception ``CRASH``, a difference ``WRONG``."""
    from slipstream.loss import answer_logprobs_from_logits, answer_logprobs_of
    from slipstream.packing.pairs import collate_pairs

    model = stock
    try:
        want_tokens = torch.cat(expected)
        want_sums = torch.stack([e.double().sum() for e in expected])
        model = copy_model(stock)
        optimize(model, **{**options, "chunked_loss": False})
        model.eval()
        batch = collate_pairs(pairs, prefix_sharing=True)
        answers = batch.answers
        with torch.no_grad():
            out = model(**{k: v for k, v in batch.model_inputs().items() if k != "labels"})
        got_tokens = _token_logprobs(out.logits, answers)
        result = ArmResult("pass")
        result.logits_error = (got_tokens - want_tokens).abs().max().item()
        found = []
        if not result.logits_error <= PAIR_TOLERANCE["token_logprob"]:
            worst = int((got_tokens - want_tokens).abs().argmax())
            answer = int(answers.index[worst])
            first = sum(answers.lengths[:answer])
            found.append(
                f"answer token log-probs off by {result.logits_error:.2g} (worst: token {worst - first} of "
                f"pair {answer // 2}'s {'chosen' if answer % 2 == 0 else 'rejected'} answer; per answer: "
                + ", ".join(
                    f"{(got_tokens[a:b] - want_tokens[a:b]).abs().max().item():.1g}"
                    for a, b in pairwise([0, *accumulate(answers.lengths)])
                )
                + ")"
            )
        from_logits = answer_logprobs_from_logits(
            out.logits, answers.positions, answers.targets, answers.index, answers.num_answers
        )
        del out

        chunked = copy_model(stock)
        optimize(chunked, **options)
        chunked.eval()
        model = chunked
        batch = collate_pairs(pairs, prefix_sharing=True)
        with torch.no_grad():
            chunked(**batch.model_inputs())
        sums = answer_logprobs_of(batch)
        if sums is None:
            sums = from_logits
            result.detail = "summed log-probs from the logits: the chunked loss is off"
        result.loss_error = (
            ((sums.double() - want_sums).abs() / want_sums.abs().clamp_min(1e-12)).max().item()
        )
        if not result.loss_error <= PAIR_TOLERANCE["summed_logprob"]:
            found.append(
                f"summed answer log-probs off by {result.loss_error:.2g} (relative; "
                f"got {[round(v, 4) for v in sums.tolist()]}, stock {[round(v, 4) for v in want_sums.tolist()]})"
            )
        if found:
            result.status, result.detail = "WRONG", "; ".join(found)
    except Exception as error:  # noqa: BLE001 - every failure is an outcome here
        result = failed(error)
    result.policies = policies_of(model)
    return result


# --------------------------------------------------------------------------- prefix groups


def prefix_groups(model: torch.nn.Module, shapes=GROUP_SHAPES, seed: int = SEED) -> list[dict[str, Any]]:
    """Random prefix groups (``collate_groups``' input) of ``shapes``, from the sweep's random
    documents; the second half of every prefix labelled, so shared labels are counted."""
    lengths = [n for prefix, continuations in shapes for n in (prefix, *continuations)]
    flat = iter(documents(model, lengths=lengths, seed=seed + 1))
    groups = []
    for prefix_len, continuations in shapes:
        prefix = next(flat)
        labels = [-100 if i < prefix_len // 2 else t for i, t in enumerate(prefix)]
        groups.append(
            {
                "prefix_ids": prefix,
                "prefix_labels": labels,
                "continuations": [{"input_ids": next(flat)} for _ in continuations],
            }
        )
    return groups


def _rows_loss(model: torch.nn.Module, rows: list[dict[str, list[int]]]) -> torch.Tensor:
    """The unshared rows, each alone: summed cross-entropy over their labels / the label count."""
    total, count = 0.0, 0
    for row in rows:
        logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1].float()
        targets = torch.tensor(row["labels"][1:])
        keep = targets != -100
        total = total + torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
        count += int(keep.sum())
    return total / count


def check_prefix_groups(
    stock: torch.nn.Module, groups: list[dict[str, Any]], options: dict[str, Any]
) -> ArmResult:
    """``groups`` packed with their prefixes shared (``collate_groups``) through copies of ``stock``
    under ``optimize(**options)``, against every ``prefix + continuation`` run alone through the stock
    model (:func:`_check_shared_layout`)."""
    from slipstream.packing.groups import collate_groups, unshared_documents

    return _check_shared_layout(
        stock, unshared_documents(groups), lambda: collate_groups(groups), _shared_rows(groups), options
    )


def prefix_tree(model: torch.nn.Module, seed: int = SEED) -> list[dict[str, Any]]:
    """The tree column's rows (:data:`TREE_ROWS`) as one prefix tree (``collate_trees``' input), from the
    sweep's random documents; every shared span is a level of its own."""
    from slipstream.data.prefix_tree import tree_items

    spans = dict(
        zip(TREE_SPANS, documents(model, lengths=list(TREE_SPANS.values()), seed=seed + 2), strict=True)
    )
    labels = {name: list(ids) for name, ids in spans.items()}
    labels["A"] = [-100 if i < len(spans["A"]) // 2 else t for i, t in enumerate(spans["A"])]
    labels["C"] = [-100] * len(spans["C"])  # a shared span with no label between two labelled ones
    rows = [
        {"input_ids": [t for n in row for t in spans[n]], "labels": [t for n in row for t in labels[n]]}
        for row in TREE_ROWS
    ]
    trees, _ = tree_items(rows, sum(TREE_SPANS.values()), min_shared=1)
    return trees


def check_prefix_tree(
    stock: torch.nn.Module, trees: list[dict[str, Any]], options: dict[str, Any]
) -> ArmResult:
    """``trees`` packed as prefix trees (``collate_trees``: every node attends to its ancestors) through
    copies of ``stock`` under ``optimize(**options)``, against every row run alone through the stock
    model (:func:`_check_shared_layout`)."""
    from slipstream.packing.trees import collate_trees, unshared_tree_rows

    return _check_shared_layout(
        stock, unshared_tree_rows(trees), lambda: collate_trees(trees), _tree_rows(trees), options
    )


def _check_shared_layout(
    stock: torch.nn.Module,
    rows: list[dict[str, list[int]]],
    collate: Callable[[], Any],
    positions: list[list[int]],
    options: dict[str, Any],
) -> ArmResult:
    """A shared layout of ``rows`` (``collate()``'s batch; ``positions``: each row's tokens in it)
    through copies of ``stock`` under ``optimize(**options)``, against every row run alone through the
    stock model: log-probs at every position (chunked loss off, eval, no grad, absolute
    ``GROUP_TOLERANCE["token_logprob"]``), then the SFT loss and every gradient (training mode, the
    chunked loss as ``options`` set it; where it is off, the loss from the logits with
    ``packed_loss_from_logits``) within :data:`slipstream.parity.TOLERANCE`."""
    from slipstream.loss import packed_loss_from_logits

    model = stock
    try:
        with eval_mode(stock), torch.no_grad():
            expected = [
                stock(input_ids=torch.tensor([row["input_ids"]])).logits[0].float().log_softmax(-1)
                for row in rows
            ]
        model = copy_model(stock)
        optimize(model, **{**options, "chunked_loss": False})
        model.eval()
        batch = collate()
        with torch.no_grad():
            logprobs = model(**{k: v for k, v in batch.model_inputs().items() if k != "labels"}).logits[0]
        logprobs = logprobs.float().log_softmax(-1)
        errors = [
            (logprobs[where] - want).abs().max().item()
            for where, want in zip(positions, expected, strict=True)
        ]
        result = ArmResult("pass")
        result.logits_error = max(errors)
        found = []
        if not result.logits_error <= GROUP_TOLERANCE["token_logprob"]:
            found.append(
                f"log-probs off by {result.logits_error:.2g} (per row: "
                + ", ".join(f"{e:.1g}" for e in errors)
                + ")"
            )

        reference_model = copy_model(stock).train()
        reference_model.zero_grad(set_to_none=True)
        want_loss = _rows_loss(reference_model, rows)
        want_loss.backward()
        want = Step(want_loss.item(), grads_of(reference_model))
        del reference_model
        model = copy_model(stock)
        model.zero_grad(set_to_none=True)
        optimize(model, **options)
        model.train()
        batch = collate()
        if getattr(state_of(model), "chunked_loss", None) is not None:
            loss = model(**batch.model_inputs()).loss
        else:
            out = model(**{k: v for k, v in batch.model_inputs().items() if k != "labels"})
            loss = packed_loss_from_logits(out.logits, batch)
            result.detail = "the loss from the logits (packed_loss_from_logits): the chunked loss is off"
        loss.backward()
        errors = compare(Step(loss.item(), grads_of(model)), want)
        result.loss_error, result.grad_error = errors.loss, errors.grad
        result.worst_param = errors.worst_param
        found += problems(errors)
        if found:
            result.status, result.detail = "WRONG", "; ".join(found)
    except Exception as error:  # noqa: BLE001 - every failure is an outcome here
        result = failed(error)
    result.policies = policies_of(model)
    return result


def _tree_rows(trees: list[dict[str, Any]]) -> list[list[int]]:
    """Per row of ``trees``, the positions of its tokens in the packed row, from the trees alone (the
    nodes in their order, one after another; a row: its path's nodes), not from the batch's metadata."""
    rows, start = [], 0
    for tree in trees:
        nodes = tree["tree_nodes"]
        starts = list(accumulate((len(node["input_ids"]) for node in nodes), initial=start))
        start = starts[-1]
        for end in tree["tree_rows"]:
            path = [end]
            while nodes[path[-1]]["parent"] >= 0:
                path.append(nodes[path[-1]]["parent"])
            rows.append([p for i in reversed(path) for p in range(starts[i], starts[i + 1])])
    return rows


def _shared_rows(groups: list[dict[str, Any]]) -> list[list[int]]:
    """Per ``prefix + continuation``, the positions of its tokens in the shared row, from the groups
    alone (not from the batch's metadata, which is what is checked): a group's first document holds
    the prefix and continuation 0, each further continuation follows in its own document."""
    rows, start = [], 0
    for group in groups:
        P = len(group["prefix_ids"])
        prefix = list(range(start, start + P))
        start += P
        for continuation in group["continuations"]:
            C = len(continuation["input_ids"])
            rows.append(prefix + list(range(start, start + C)))
            start += C
    return rows
