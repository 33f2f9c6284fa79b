"""Regional ``torch.compile`` of the decoder layers (``slipstream.compile.regional``)."""

from .regional import (
    BREAK_EVEN_STEPS,
    UNKNOWN_STEPS,
    CompileMode,
    cold_start_pays_back,
    compile_layers,
    compiled_layers,
    decoder_layers,
    graph_counts,
    inductor_available,
    should_compile,
    uncompile_layers,
)

__all__ = [
    "BREAK_EVEN_STEPS",
    "UNKNOWN_STEPS",
    "CompileMode",
    "cold_start_pays_back",
    "compile_layers",
    "compiled_layers",
    "decoder_layers",
    "graph_counts",
    "inductor_available",
    "should_compile",
    "uncompile_layers",
]
