"""Regional ``torch.compile`` of the decoder layers (``slipstream.compile.regional``)."""

from .regional import (
    BREAK_EVEN_STEPS,
    CompileMode,
    compile_layers,
    compiled_layers,
    decoder_layers,
    inductor_available,
    should_compile,
    uncompile_layers,
)

__all__ = [
    "BREAK_EVEN_STEPS",
    "CompileMode",
    "compile_layers",
    "compiled_layers",
    "decoder_layers",
    "inductor_available",
    "should_compile",
    "uncompile_layers",
]
