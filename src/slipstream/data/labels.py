"""The label convention every layer shares, defined once at the bottom (data)."""

from __future__ import annotations

# A label that takes no part in the loss (prompts, the first token of each document,
# padding): transformers' and torch's cross-entropy ignore_index.
IGNORE_INDEX = -100
