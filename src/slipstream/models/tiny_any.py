"""A tiny, randomly initialised version of any causal LM in transformers' registry.

``tiny_config(model_type)`` starts from ``AutoConfig.for_model(model_type)`` (the family's
defaults, i.e. a full-size model) and shrinks it: width 64, 2 layers (or as many as it takes
to have one of each layer kind a hybrid mixes), 4 heads / 2 kv heads where the family has
GQA, small MLPs, vocabulary 256, 8 experts top-2, small state and conv sizes for recurrent
mixers. A generic shrinker handles the attributes most configs share (the sizes and attribute
names it reads are :mod:`.tiny_sizes`); ``OVERRIDES`` (:mod:`.tiny_overrides`) holds what a few
families need on top. Special features are turned ON where a config has them, so
the tiny model exercises them at a few dozen tokens: sliding windows of 8, chunked attention
of 8, small linear-attention / SSM chunks, attention sinks given non-zero values, soft-capping
kept at its default. Dropout (and router jitter) is set to 0 and ``use_cache`` off, so a
training-mode forward is deterministic.

Composite (multimodal) configs are shrunk level by level: the text config and the vision /
audio towers alike (the towers are built but never fed). ``tiny_model`` builds the class the
causal-LM registry names for ``model_type``, handing it the text config when that class takes
a text config rather than the composite one.

The generic shrinker passes only a config's own fields, so what ``__post_init__`` derives
(an MLA head dim, layer types from a window-layer count, ...) is derived again from the tiny
values. Per-layer lists are cut to the layers kept, lists of layer indices (``moe_layers``,
``cross_attention_layers``) renumbered, and a heterogeneous config's ``per_layer_config`` kept
for those layers, each layer shrunk in proportion to the global (a global-attention layer with
twice the head dim keeps twice it).

Nothing is downloaded; the weights come from the model's own initialisation under ``seed``.
Known limits (transformers 5.24): ``gemma3n``'s vision tower is a timm model, so it builds only
where timm is installed; ``musicgen`` / ``musicgen_melody`` take one id row per codebook and
labels shaped ``[batch, length, codebooks]``, and the Gemma 4 drafters
(``gemma4_assistant``, ``gemma4_unified_assistant``) take their target's embeddings and KV
states rather than ids, so those build but do not train on plain ``input_ids`` / ``labels``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch

from . import tiny_sizes as sizes
from .tiny_overrides import DEFAULT_KWARGS, OVERRIDES

# Re-exported: the sweep chooses its documents around these (slipstream.compat reads them here).
from .tiny_sizes import DYNAMIC_ROPE_POSITIONS, POSITION_THRESHOLD, RESERVED_HIGH, RESERVED_LOW, WINDOW

# --------------------------------------------------------------------------- generic shrinker


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink(attrs: dict[str, Any], key: str, target: int, out: dict[str, Any]) -> None:
    value = attrs.get(key)
    if _is_int(value) and value > target:
        out[key] = target


def _read_attrs(config) -> dict[str, Any]:
    """The config's attributes; per-layer attributes of a heterogeneous config read as their global value."""
    attrs: dict[str, Any] = {}
    for key in config.to_dict():
        if key == "per_layer_config":
            continue
        with contextlib.suppress(AttributeError):
            attrs[key] = config._getattr_without_heterogeneous_validation(key)
    return attrs


def _is_index_list(value: Any, n_layers: int) -> bool:
    """A list of distinct layer indices (``moe_layers``, ``full_attn_idxs``, ...), not one entry per layer."""
    return (
        isinstance(value, list)
        and len(value) > 1
        and all(_is_int(v) and 0 <= v < n_layers for v in value)
        and value == sorted(set(value))
        and (len(value) < n_layers or value == list(range(n_layers)))
    )


def _per_layer_lists(attrs: dict[str, Any], n_layers: int) -> dict[str, list]:
    """Attributes that list one entry per layer (layer_types, mlp_layer_types, ...)."""
    return {
        key: value
        for key, value in attrs.items()
        if isinstance(value, list)
        and len(value) == n_layers
        and n_layers > 1
        and not key.startswith("_")
        and not _is_index_list(value, n_layers)
    }


def _choose_layers(kinds: list[list], n_layers: int, minimum: int) -> list[int]:
    """Original layer indices to keep: the first of every distinct value of every per-layer list.

    A hybrid's tiny version so keeps one layer of each kind (sliding and full attention,
    mamba and attention, dense and sparse MLP), in the original order.
    """
    keep: set[int] = set()
    for values in kinds:
        seen: set[str] = set()
        for index, value in enumerate(values):
            if repr(value) not in seen:
                seen.add(repr(value))
                keep.add(index)
    index = 0
    while len(keep) < min(minimum, n_layers):
        keep.add(index)
        index += 1
    return sorted(keep)


def _shrink_values(attrs: dict[str, Any]) -> dict[str, Any]:
    """Width, heads, MLP, expert, state and vocabulary sizes of one (flat) set of attributes."""
    out: dict[str, Any] = {}
    for key in sizes.WIDTH_KEYS:
        _shrink(attrs, key, sizes.WIDTH, out)
    for key in sizes.FFN_KEYS:
        _shrink(attrs, key, sizes.FFN, out)
    for key in sizes.EXPERT_FFN_KEYS:
        _shrink(attrs, key, sizes.EXPERT_FFN, out)
    for key in sizes.HEAD_DIM_KEYS:
        _shrink(attrs, key, sizes.HEAD_DIM, out)
    for key, target in sizes.SMALL.items():
        _shrink(attrs, key, target, out)
    for key in sizes.HEAD_KEYS:
        _shrink(attrs, key, sizes.HEADS, out)
    for key, head_key in sizes.KV_HEAD_KEYS.items():
        kv, heads = attrs.get(key), attrs.get(head_key)
        if kv is None and key in attrs and _is_int(heads):  # unset: MHA
            out[key] = out.get(head_key, heads)
        if not _is_int(kv):
            continue
        if _is_int(heads) and kv >= heads:  # MHA stays MHA
            out[key] = out.get(head_key, heads)
        elif kv > 1:  # GQA stays GQA; MQA (1) stays MQA
            out[key] = min(kv, sizes.KV_HEADS)

    def tiny(key: str) -> Any:
        return out.get(key, attrs.get(key))

    # A head dim left to default (None: width / heads) is spelled out; an MLA config's head dim
    # that is its rotary part stays so.
    if "head_dim" in attrs and attrs["head_dim"] is None and _is_int(tiny("hidden_size")):
        heads = tiny("num_attention_heads")
        if _is_int(heads) and heads > 0:
            out["head_dim"] = tiny("hidden_size") // heads
    if _is_int(attrs.get("qk_rope_head_dim")) and attrs.get("head_dim") == attrs["qk_rope_head_dim"]:
        out["head_dim"] = tiny("qk_rope_head_dim")
    # A router top-k left unset next to a routed-expert count gets TOP_K.
    if any(_is_int(attrs.get(key)) and attrs[key] > 1 for key in sizes.EXPERT_COUNT_KEYS):
        for key in sizes.TOP_K_KEYS:
            if key in attrs and attrs[key] is None:
                out[key] = sizes.TOP_K
    return out


def _shrink_layer_overrides(
    attrs: dict[str, Any], tiny: dict[str, Any], overrides: dict[str, Any]
) -> dict[str, Any]:
    """One layer's attribute overrides, shrunk so the layer differs from the tiny global the way it
    differed from the full-size one (a full-attention layer with twice the head dim keeps twice it)."""
    shrunk = _shrink_values({**attrs, **overrides})
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        full, small = attrs.get(key), tiny.get(key, attrs.get(key))
        if _is_int(value) and _is_int(full) and _is_int(small) and full > 0:
            scaled = small * value / full
            if scaled >= 1 and scaled == int(scaled):
                out[key] = int(scaled)
                continue
        out[key] = shrunk.get(key, value)
    return out


def shrink_kwargs(config, layers: int = 2) -> dict[str, Any]:
    """The keyword arguments that make ``config`` (one level, no sub-configs) tiny."""
    attrs = _read_attrs(config)
    out = _shrink_values(attrs)

    # Layers: keep one of each kind the per-layer lists (and per-layer overrides) tell apart,
    # at least ``layers``.
    key, n_layers = next(
        ((name, attrs[name]) for name in sizes.LAYER_KEYS if _is_int(attrs.get(name))), (None, None)
    )
    # A heterogeneous config's per-layer attribute overrides (layer index -> attribute -> value).
    spec = config.__dict__.get("_heterogeneity_spec")
    overrides = copy.deepcopy(spec.per_layer_overrides) if spec is not None else {}
    if key is not None and n_layers is not None:
        per_layer = _per_layer_lists(attrs, n_layers)
        index_lists = {
            name: value
            for name, value in attrs.items()
            if "layer" in name and name not in per_layer and _is_index_list(value, n_layers)
        }
        # A layer with overrides is of another kind than one without (the attributes overridden
        # tell kinds apart, not their values: a pyramid of expert counts is one kind).
        kinds = [*per_layer.values(), [sorted(overrides.get(i, {})) for i in range(n_layers)]]
        kinds += [[i in value for i in range(n_layers)] for value in index_lists.values()]
        keep = _choose_layers(kinds, n_layers, layers)
        out[key] = len(keep)
        for name, values in per_layer.items():
            out[name] = [values[i] for i in keep]
        for name, values in index_lists.items():
            out[name] = [new for new, old in enumerate(keep) if old in values]
        if overrides:
            out["per_layer_config"] = {
                new: _shrink_layer_overrides(attrs, out, overrides[old])
                for new, old in enumerate(keep)
                if old in overrides
            }
        # KV sharing across all layers (a drafter reusing its target's cache) stays all layers.
        shared = attrs.get("num_kv_shared_layers")
        if _is_int(shared) and shared >= n_layers:
            out["num_kv_shared_layers"] = len(keep)
        # Sliding windows from a layer index on (Qwen2-style ``max_window_layers``): from the
        # second layer on, so the tiny model has both kinds; the layer types are derived again.
        if _is_int(attrs.get("max_window_layers")) and "sliding_window" in attrs:
            out["max_window_layers"] = 1
            out.pop("layer_types", None)
    for key in sizes.SECONDARY_LAYER_KEYS:
        _shrink(attrs, key, layers, out)

    # Features on: a small window wherever the config has one.
    for key in sizes.WINDOW_KEYS:
        if key in attrs and (attrs[key] is None or _is_int(attrs[key])):
            out[key] = sizes.WINDOW
    if "use_sliding_window" in attrs:
        out["use_sliding_window"] = True
    # Determinism: no dropout, no router noise, no stochastic depth.
    for key, value in attrs.items():
        noisy = any(word in key.lower() for word in ("dropout", "pdrop", "layerdrop", "drop_path", "jitter"))
        if noisy and isinstance(value, float) and value != 0.0:
            out[key] = 0.0
    if "use_cache" in attrs:
        out["use_cache"] = False
    if attrs.get("output_router_logits"):
        out["output_router_logits"] = False  # the aux loss is a batch statistic, not per document
    # Special token ids inside the tiny vocabulary.
    vocab = out.get("vocab_size", attrs.get("vocab_size"))
    if _is_int(vocab):
        high = iter(range(vocab - 1, vocab - sizes.RESERVED_HIGH - 1, -1))
        for key, value in attrs.items():
            if not (key.endswith("_token_id") or key.endswith("_token_index")):
                continue
            if isinstance(value, list):
                out[key] = [sizes.LOW_IDS.get(key, 2)] if value else value
            elif _is_int(value):
                out[key] = sizes.LOW_IDS[key] if key in sizes.LOW_IDS else next(high, vocab - 1)
    # Attributes the config derives in ``__post_init__`` (``head_dim`` from ``qk_rope_head_dim``,
    # ...) are left to be derived again from the shrunk fields: passed as keywords they would
    # override the derivation. An attribute the config stores under an ``attribute_map`` alias
    # is passed under the alias's field name.
    if dataclasses.is_dataclass(config):
        fields = {field.name for field in dataclasses.fields(config) if field.init} | {"per_layer_config"}
        aliases = {target: alias for alias, target in config.attribute_map.items() if alias in fields}
        out = {aliases.get(key, key): value for key, value in out.items() if key in fields or key in aliases}
    return out


# --------------------------------------------------------------------------- building


def _sub_config_keys(config) -> list[str]:
    subs = getattr(config, "sub_configs", None) or {}
    return [key for key in subs if getattr(config, key, None) is not None]


def _tiny_level(config, names: list[str], layers: int) -> dict[str, Any]:
    """Shrink one level, then apply the override registered under the last of ``names`` that has one."""
    kwargs = shrink_kwargs(config, layers=layers)
    for name in reversed(names):
        if name in OVERRIDES:
            return OVERRIDES[name](config, kwargs)
    return kwargs


def _rebuild(config, kwargs: dict[str, Any]):
    """The same config class rebuilt with ``kwargs`` (so derived fields are derived again).

    A sub-config keeps the values its composite's defaults gave it where they differ from its
    own class's (a drafter's text config without per-layer inputs); fields that default to None
    are left out, as those are the ones ``__post_init__`` derives.
    """
    base: dict[str, Any] = {}
    if dataclasses.is_dataclass(config):
        read = config._getattr_without_heterogeneous_validation
        for field in dataclasses.fields(config):
            if not field.init or field.default is dataclasses.MISSING or field.default is None:
                continue
            value = read(field.name, None)
            if value != field.default and not isinstance(value, dict | list):
                base[field.name] = value
    return type(config)(**{**base, **kwargs})


class ArchitectureNotInstalled(KeyError):
    """``model_type`` is not in the installed transformers' causal-LM registry (an older version, or
    not a causal LM). A KeyError, as the registry lookup it replaces raised."""

    def __str__(self) -> str:
        return str(self.args[0])


def require_installed(model_type: str) -> str:
    """The causal-LM class name of ``model_type``; :class:`ArchitectureNotInstalled`, naming the
    version, where the installed transformers lacks it."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ArchitectureNotInstalled(
            f"{model_type}: not a causal LM of the installed transformers {transformers.__version__}"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def tiny_config(model_type: str, layers: int = 2):
    """A tiny ``PreTrainedConfig`` of ``model_type`` with its special features on (see module doc).

    Overrides apply by model type at every level; one registered as ``"<model_type>.<key>"``
    takes precedence for that sub-config (DBRX's ``attn_config`` has no model type of its own, a
    Gemma 4 drafter's text config is not shaped like Gemma 4's own).
    """
    from transformers import AutoConfig

    require_installed(model_type)
    # The family's default config (``DEFAULT_KWARGS`` for the few whose bare defaults don't validate).
    default = AutoConfig.for_model(model_type, **DEFAULT_KWARGS.get(model_type, {}))
    return AutoConfig.for_model(model_type, **_tiny_kwargs(default, model_type, layers))


def _tiny_kwargs(config, model_type: str, layers: int) -> dict[str, Any]:
    """The keyword arguments of a tiny ``config``: every level shrunk, sub-configs rebuilt."""
    kwargs = _tiny_level(config, [model_type], layers)
    if "is_decoder" in config.to_dict() and not config.is_decoder:
        # An encoder family's *ForCausalLM is a causal LM only as a decoder (transformers warns
        # otherwise and attends both ways): build it the way it is trained.
        kwargs["is_decoder"] = True
    for key in _sub_config_keys(config):
        sub = getattr(config, key)
        names = [getattr(sub, "model_type", None) or "", f"{model_type}.{key}"]
        kwargs[key] = _rebuild(sub, _tiny_level(sub, names, layers))
    return kwargs


def shrink_config(config, layers: int = 2):
    """A tiny copy of a real model's ``config`` (e.g. read from its config.json): its family and the
    values it sets, shrunk and with its special features on as ``tiny_config`` does for a family's
    defaults (overrides by model type at every level included)."""
    return _rebuild(config, _tiny_kwargs(config, config.model_type, layers))


def causal_lm_class(model_type: str):
    """The class transformers' causal-LM registry names for ``model_type``."""
    import transformers

    return getattr(transformers, require_installed(model_type))


def config_for_class(cls, config):
    """``config`` or the sub-config ``cls`` takes (a text config for a text-only CausalLM class)."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    subs = [getattr(config, key) for key in _sub_config_keys(config)]
    return next((sub for sub in subs if isinstance(sub, wanted)), config)


def _perturb_zero_features(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give feature parameters that initialise to zero (attention sinks) random values.

    With zero sinks a bug that drops them would still show, but a bug that mixes them up
    between heads would not; random values make every head's sink distinct.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("sinks", "sink", "attention_sinks") and param.abs().max() == 0:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def tiny_model(model_type: str, seed: int = 0, attn_implementation: str = "eager", layers: int = 2):
    """A tiny randomly initialised model of the registry's causal-LM class for ``model_type`` (fp32)."""
    return random_model(tiny_config(model_type, layers=layers), seed, attn_implementation, model_type)


def random_model(config, seed: int = 0, attn_implementation: str = "eager", model_type: str | None = None):
    """A randomly initialised model of the registry's causal-LM class for ``config`` (fp32), with
    zero-initialised features (attention sinks) given values; ``config`` is best a tiny one."""
    cls = causal_lm_class(model_type or config.model_type)
    config = config_for_class(cls, config)
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    _perturb_zero_features(model, torch.Generator().manual_seed(seed + 1))
    with contextlib.suppress(AttributeError):
        model.config.use_cache = False
    return model


__all__ = [
    "DYNAMIC_ROPE_POSITIONS",
    "OVERRIDES",
    "POSITION_THRESHOLD",
    "RESERVED_HIGH",
    "RESERVED_LOW",
    "WINDOW",
    "ArchitectureNotInstalled",
    "causal_lm_class",
    "config_for_class",
    "random_model",
    "require_installed",
    "shrink_config",
    "shrink_kwargs",
    "tiny_config",
    "tiny_model",
]
