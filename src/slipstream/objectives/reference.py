"""The reference log-probs computed once, before step 0, and cached.

Every pair's reference sums come from one ``no_grad`` pass over the run's bins (packed exactly as
training packs them), with the policy as it starts: a LoRA adapter starts at zero, so that is the
base model; a full fine-tune starts at the base. The result is cached under
``$SLIPSTREAM_CACHE/reference/`` keyed by the base weights' fingerprint (the weight files' names,
sizes, headers and first and last MiB, or the preset's name, layers and seed), the dtype, the
device type, 4-bit or not, the pair layout and every bin's token ids, so a resumed run, or a second
run on the same pairs and base, reads it back instead of running the pass again; anything that
changes the log-probs makes a new key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..atomic import atomic_file
from ..data.cache import cache_root

FORMAT = 1
_SAMPLE = 1 << 20


def weights_fingerprint(model_path: str | None, preset: dict | None) -> str:
    """A cheap fingerprint of the base weights: the preset's identity, or the weight files' names,
    sizes, headers and first and last MiB (a full hash of 100+ GB would cost minutes)."""
    digest = hashlib.sha256()
    if model_path is None:
        digest.update(json.dumps(preset, sort_keys=True).encode())
        return digest.hexdigest()
    folder = Path(model_path)
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(_SAMPLE))
            if size > _SAMPLE:
                handle.seek(max(size - _SAMPLE, _SAMPLE))
                digest.update(handle.read())
    if (folder / "config.json").exists():
        digest.update((folder / "config.json").read_bytes())
    return digest.hexdigest()


def cache_key(weights: str, settings: dict, bins: Sequence[Sequence[dict]]) -> str:
    digest = hashlib.sha256(
        json.dumps({"format": FORMAT, "weights": weights, **settings}, sort_keys=True).encode()
    )
    for pairs in bins:
        for pair in pairs:
            if "tree_nodes" in pair:  # a pair tree (data.pair_trees): its nodes, their parents and rows
                nodes = [(node["input_ids"], node["parent"]) for node in pair["tree_nodes"]]
                digest.update(json.dumps([nodes, pair["tree_rows"], pair["tree_pairs"]]).encode())
            else:
                for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
                    digest.update(json.dumps(pair[name]).encode())
            digest.update(b"|")
        digest.update(b"#")
    return digest.hexdigest()[:32]


def reference_cached(key: str) -> bool:
    """Whether the cache holds an entry for ``key`` (FSDP2's ranks agree on this before any computes)."""
    return (cache_root() / "reference" / f"{key}.pt").exists()


def precomputed_reference(
    key: str,
    bins: Sequence[Sequence[dict]],
    compute: Callable[[Sequence[dict]], torch.Tensor],
    cache: bool = True,
    read: bool = True,
) -> tuple[list[torch.Tensor], str]:
    """Per bin, its [answers] reference sums (CPU, fp32): read from the cache, or computed by
    ``compute(pairs)`` bin by bin and written (atomically). Returns them and what was done. ``read``
    False: computed and written whatever the cache holds (ranks that must all run the forwards)."""
    path = cache_root() / "reference" / f"{key}.pt"
    if cache and read and path.exists():
        try:
            found = torch.load(path, weights_only=True)
            if isinstance(found, list) and len(found) == len(bins):
                return found, f"reference log-probs read from the cache ({path})"
        except (OSError, RuntimeError, EOFError):
            pass  # a damaged entry: computed again and replaced
    sums = [compute(pairs).float().cpu() for pairs in bins]
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as temporary:
            torch.save(sums, temporary)
    return sums, f"reference log-probs computed once before step 0 ({len(bins)} bins)"
