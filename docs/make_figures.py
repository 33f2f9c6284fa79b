"""Draw the pictures of docs/speedups.md: python docs/make_figures.py (writes docs/*.png)."""

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


def moe_routing() -> None:
    """Eager: a where() + host sync per expert; sorted: one argsort, contiguous slices."""
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 8, size=24)
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    axes[0].scatter(range(len(experts)), experts, c=experts, cmap="tab10", vmin=0, vmax=9, s=60)
    for e in range(8):
        axes[0].axhline(e, color="lightgrey", lw=0.5, zorder=0)
    axes[0].set(title="stock eager: one where() per expert over all tokens\n(a host sync each, ~2 per expert per layer)",
                xlabel="token x top-k pair (in token order)", ylabel="expert", yticks=range(8))
    order = np.argsort(experts, kind="stable")
    axes[1].bar(range(len(experts)), np.ones(len(experts)), color=plt.cm.tab10(experts[order] / 9), width=1.0)
    counts = np.bincount(experts, minlength=8)
    for boundary in np.cumsum(counts)[:-1]:
        axes[1].axvline(boundary - 0.5, color="black", lw=1)
    axes[1].set(title="slipstream sorted: one stable argsort + counts\n(each expert a contiguous slice, one grouped matmul)",
                xlabel="pairs sorted by expert", yticks=[])
    fig.tight_layout()
    fig.savefig(HERE / "moe-routing.png", dpi=80)


def offload_timeline() -> None:
    """Backward with one reload buffer vs two: the copy hides behind the previous layer's compute."""
    fig, axes = plt.subplots(2, 1, figsize=(11, 3.6), sharex=True)
    compute, copy, layers = 3.0, 1.6, 4
    for ax, double in ((axes[0], False), (axes[1], True)):
        t = 0.0
        for i, layer in enumerate(range(layers - 1, -1, -1)):
            if double:  # the last layer's input never left the device
                ax.broken_barh([(t, compute)], (1, 0.8), color="tab:blue")
                if layer > 0:
                    ax.broken_barh([(t, copy)], (0, 0.8), color="tab:orange")
                ax.text(t + compute / 2, 1.4, f"layer {layer}", ha="center", va="center", color="white")
                t += compute
            else:
                if i > 0:  # the last layer's input never left the device
                    ax.broken_barh([(t, copy)], (0, 0.8), color="tab:orange")
                    t += copy
                ax.broken_barh([(t, compute)], (1, 0.8), color="tab:blue")
                ax.text(t + compute / 2, 1.4, f"layer {layer}", ha="center", va="center", color="white")
                t += compute
        ax.set_yticks([0.4, 1.4], ["copy stream\n(reload)", "compute\n(recompute+bwd)"])
        ax.set_title("offload-double: reload of layer i-1 overlaps layer i" if double
                     else "offload (one buffer): every reload waits, then compute waits for it", fontsize=10)
    axes[1].set_xlabel("time in backward")
    fig.tight_layout()
    fig.savefig(HERE / "offload-double.png", dpi=80)


def chunked_loss() -> None:
    """Stock: every position's [T, V] logits at once (four copies); chunked: labelled rows, one chunk alive."""
    rng = np.random.default_rng(1)
    lengths = [9, 6, 11, 8]
    labelled = np.concatenate([np.arange(n) >= n // 2 for n in lengths])  # response-only: prompts masked
    labelled[np.cumsum(lengths) - 1] = False  # each document's last position has no next label
    T, V = len(labelled), 48
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    axes[0].imshow(np.full((T, V), 0.55) + 0.1 * rng.random((T, V)), cmap="Greys", vmin=0, vmax=1, aspect="auto")
    axes[0].set(title="stock: [T, V] logits of every position, alive at once\n"
                "(logits, fp32 copy, log-softmax, gradient: ~4 x T x V)", xlabel="vocabulary", ylabel="position")
    grid = np.full((T, V), np.nan)
    rows = np.flatnonzero(labelled)
    chunk = 5
    for i, start in enumerate(range(0, len(rows), chunk)):
        value = 3.0 if i == 1 else 1.0  # the chunk being computed now; the others come and go
        grid[rows[start : start + chunk]] = value
    axes[1].imshow(grid, cmap="Blues", vmin=0, vmax=3.5, aspect="auto")
    axes[1].set(title="slipstream: labelled rows only, a chunk at a time\n"
                "(its loss and gradient while alive; white = prompt rows, no FLOPs)", xlabel="vocabulary")
    fig.tight_layout()
    fig.savefig(HERE / "chunked-loss.png", dpi=80)


if __name__ == "__main__":
    packed_attention()
    moe_routing()
    offload_timeline()
    chunked_loss()
