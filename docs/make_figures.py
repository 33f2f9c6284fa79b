"""Draw the README's pictures: python docs/make_figures.py (writes docs/*.png)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).parent


def packed_attention() -> None:
    lengths = [5, 9, 3, 7]
    T = sum(lengths)
    doc = np.repeat(np.arange(len(lengths)), lengths)
    causal = np.tril(np.ones((T, T), dtype=bool))
    same_doc = doc[:, None] == doc[None, :]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.2))
    # 1. stock packed: a dense T x T mask, every pair visited, most masked out
    axes[0].imshow(np.where(causal & same_doc, 1.0, 0.25), cmap="Greys", vmin=0, vmax=1)
    axes[0].set_title("stock packed: dense T×T mask\n(all T² pairs computed, most masked)")
    # 2. padded: one row per document, padded to the longest
    longest = max(lengths)
    grid = np.zeros((len(lengths), longest))
    for i, n in enumerate(lengths):
        grid[i, :n] = 1
    axes[1].imshow(grid, cmap="Greys", vmin=0, vmax=1.2, aspect="auto")
    axes[1].set_title("stock padded: one row per document\n(white = padding, computed and thrown away)")
    axes[1].set_xlabel("token")
    axes[1].set_ylabel("document")
    axes[1].set_yticks(range(len(lengths)))
    # 3. slipstream: only the per-document causal blocks are computed
    blocks = np.full((T, T), np.nan)
    start = 0
    for i, n in enumerate(lengths):
        blocks[start : start + n, start : start + n] = np.where(np.tril(np.ones((n, n))), i + 1, np.nan)
        start += n
    axes[2].imshow(blocks, cmap="tab10", vmin=0.5, vmax=10.5)
    axes[2].set_title("slipstream: per-document causal blocks\n(Σ Lᵢ² work, boundaries read from the batch)")
    for ax in (axes[0], axes[2]):
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    fig.tight_layout()
    fig.savefig(HERE / "packed-attention.png", dpi=80)


if __name__ == "__main__":
    packed_attention()
