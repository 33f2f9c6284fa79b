"""The A/B arms: what each one changes, and the model and batches it trains with.

- ``stock-padded``: stock transformers (sdpa), one right-padded row per document.
- ``stock-packed``: stock transformers (sdpa), the packed row with restarting position_ids
  (transformers detects packing and builds a dense [1, 1, T, T] mask).
- ``slipstream``: ``slipstream.optimize`` and the PackedBatch.
- peers (``bench/peers``): ``trl`` (one optimizer step as TRL's SFTTrainer takes it),
  ``stock-offload`` (transformers' own offloaded checkpointing, CUDA only), ``unsloth`` and
  ``unsloth-same-settings`` (Unsloth in its own virtualenv: its defaults, then ours) and
  ``liger`` (Liger-Kernel's patched model, CUDA only). A peer that cannot run here is skipped
  with the reason in the record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .. import speedups as speedups_module  # read at call time: a plug-in's rebuilt Speedups counts
from ..data.labels import count_label_tokens
from ..optimize import optimize, state_of
from ..packing import collate_packed, collate_padded
from ..speedups import Speedups, registry
from ..speedups.base import AblationRun
from ..speedups.registry import ablation_arms
from ..train.config import TrainConfig
from .peers import Peer, prepare_base_model


@dataclass(frozen=True)
class Arm:
    """An A/B arm: a batch layout plus the ``Speedups`` it runs.

    ``stock``: the model as users run it today (transformers' own attention, experts and loss);
    it keeps stock settings whatever speedup options the run sets, and recomputes when the run
    checkpoints. ``peer_loss``: a peer's loss in place of ours ("trl-fused": TRL 1.16's fused
    LM head, as its SFTTrainer computes the loss). ``peer``: the tool users would pick instead,
    run as that tool runs it (``bench/peers``); peer arms are baselines like the stock ones, so
    every slipstream arm gets a speedup against each. A ``checkpointing`` of None takes the run's.
    """

    layout: Literal["packed", "padded"]
    speedups: Speedups
    stock: bool = False
    peer_loss: Literal["trl-fused"] | None = None
    peer: Peer | None = None
    # a preference arm: its pairs packed with the prompt once ("shared"), as two documents
    # ("unshared"), or as its peer collates them ("peer")
    pairs: Literal["shared", "unshared", "peer"] | None = None
    # rows that share a start (--share-prefixes): "unshared" packs every step's rows whole even where
    # this arm could share (the leave-one-out of the sharing); "groups" / "tree" share in that layout
    # (one shared start a group, or every shared history once); "off": data.share_prefixes off whatever
    # --share-prefixes says (GRPO: each group's prompt once, nothing more); None shares as --share-prefixes says
    prefixes: Literal["unshared", "groups", "tree", "off"] | None = None
    # the objective the arm trains (training.objective): a run's arms all train the run's own
    objective: str = "sft"
    # the engine an online-RL arm samples its own rollouts with (grpo.engine); None: it samples
    # nothing, it trains the run's recorded rows or pairs
    engine: Literal["hf", "vllm"] | None = None


# Stock arms are the model as users run it today; "trl-fused-head" is the peer users would pick
# for memory; "slipstream-no-*" are leave-one-out ablations, so every optimization's share shows.
STOCK = Speedups.stock()
SLIPSTREAM = Speedups()
_FIXED_ARMS: dict[str, Arm] = {
    "stock-padded": Arm("padded", STOCK, stock=True),
    "stock-packed": Arm("packed", STOCK, stock=True),
    "trl-fused-head": Arm("packed", STOCK, stock=True, peer_loss="trl-fused"),
    "slipstream": Arm("packed", SLIPSTREAM),
    # the same speedups as "slipstream" in a process of its own: the run's process-to-process noise
    # (an A/A pair), against which the ablation arms are judged (runner.ablation_verdicts)
    "slipstream-again": Arm("packed", SLIPSTREAM),
    "slipstream-offload": Arm("packed", SLIPSTREAM.replace(checkpointing="auto")),
    "slipstream-no-offload": Arm("packed", SLIPSTREAM.replace(checkpointing="recompute")),
    "slipstream-no-prefix-sharing": Arm("packed", SLIPSTREAM, prefixes="unshared"),
    "slipstream-prefix-groups": Arm("packed", SLIPSTREAM, prefixes="groups"),
    "slipstream-prefix-tree": Arm("packed", SLIPSTREAM, prefixes="tree"),
    # The tools users would pick instead (bench/peers): each as that tool runs it, on our bins.
    "trl": Arm("packed", STOCK, stock=True, peer="trl"),
    "stock-offload": Arm(
        "packed", STOCK.replace(checkpointing="off"), stock=True, peer="transformers-offload"
    ),
    "unsloth": Arm("padded", STOCK, stock=True, peer="unsloth"),
    "unsloth-same-settings": Arm("padded", STOCK, stock=True, peer="unsloth-same-settings"),
    "liger": Arm("packed", STOCK, stock=True, peer="liger"),
    # DPO on preference pairs (--objective dpo): TRL's DPOTrainer as users run it (padded pairs, the
    # prompt twice, a reference forward per step), Unsloth's patched one, and slipstream's packed
    # pairs without and with the prompt shared (the reference computed once before step 0)
    "trl-dpo": Arm("padded", STOCK, stock=True, peer="trl", pairs="peer", objective="dpo"),
    "unsloth-dpo": Arm("padded", STOCK, stock=True, peer="unsloth-dpo", pairs="peer", objective="dpo"),
    "slipstream-dpo-no-prefix-sharing": Arm("packed", SLIPSTREAM, pairs="unshared", objective="dpo"),
    "slipstream-dpo": Arm("packed", SLIPSTREAM, pairs="shared", objective="dpo"),
    # pairs whose prompts share history (a preference at every turn of a chat): every history once
    "slipstream-dpo-tree": Arm("packed", SLIPSTREAM, pairs="shared", prefixes="tree", objective="dpo"),
    # KTO on unpaired rows (--objective kto): TRL's KTOTrainer as users run it (padded rows, the prompt again
    # in its no-grad KL forward, the reference every step), slipstream's rows packed with the KL completion
    # as a second document and with it after the prompt once (the reference computed once before step 0)
    "trl-kto": Arm("padded", STOCK, stock=True, peer="trl", pairs="peer", objective="kto"),
    "slipstream-kto-no-prefix-sharing": Arm("packed", SLIPSTREAM, pairs="unshared", objective="kto"),
    "slipstream-kto": Arm("packed", SLIPSTREAM, pairs="shared", objective="kto"),
    # GRPO (--objective grpo; bench/grpo_arms.py): TRL's GRPOTrainer as users run it (no vLLM: its
    # transformers generate with every prompt repeated G times, the padded update), slipstream's
    # update with each completion packed after its own copy of the prompt, and slipstream's (the prompt
    # once per group); every arm samples with its own engine and updates on the same rollouts
    "trl-grpo": Arm("padded", STOCK, stock=True, peer="trl", objective="grpo", engine="hf"),
    "slipstream-grpo-no-prefix-sharing": Arm(
        "packed", SLIPSTREAM, prefixes="unshared", objective="grpo", engine="hf"
    ),
    "slipstream-grpo": Arm("packed", SLIPSTREAM, objective="grpo", engine="hf"),
    # the prompt once a group whatever --share-prefixes says (data.share_prefixes off: today's layout), and
    # a micro-batch's prompts and completions as prefix trees (data.share_prefixes tree)
    "slipstream-grpo-groups": Arm("packed", SLIPSTREAM, prefixes="off", objective="grpo", engine="hf"),
    "slipstream-grpo-tree": Arm("packed", SLIPSTREAM, prefixes="tree", objective="grpo", engine="hf"),
    # the same update, its rollouts sampled by vLLM in its own process (grpo.engine vllm), and TRL's
    # GRPOTrainer with use_vllm (its best configuration; skipped where it cannot run, with the reason)
    "slipstream-grpo-vllm": Arm("packed", SLIPSTREAM, objective="grpo", engine="vllm"),
    "trl-grpo-vllm": Arm("padded", STOCK, stock=True, peer="trl-vllm", objective="grpo", engine="hf"),
    # the reward model (--objective reward): TRL's RewardTrainer as users run it (padded pairs, the prompt
    # twice), and slipstream's packed pairs without and with the prompt shared
    "trl-reward": Arm("padded", STOCK, stock=True, peer="trl", pairs="peer", objective="reward"),
    "slipstream-reward-no-prefix-sharing": Arm("packed", SLIPSTREAM, pairs="unshared", objective="reward"),
    "slipstream-reward": Arm("packed", SLIPSTREAM, pairs="shared", objective="reward"),
    # ORPO (--objective orpo): slipstream's packed pairs without and with the prompt shared
    "slipstream-orpo-no-prefix-sharing": Arm("packed", SLIPSTREAM, pairs="unshared", objective="orpo"),
    "slipstream-orpo": Arm("packed", SLIPSTREAM, pairs="shared", objective="orpo"),
}
_FIXED_PRESETS: dict[str, tuple[str, ...]] = {
    "default": ("stock-padded", "stock-packed", "slipstream"),
    # --objective dpo: preference pairs, the peers' DPO and slipstream's, with and without the prompt shared
    "dpo": ("trl-dpo", "unsloth-dpo", "slipstream-dpo-no-prefix-sharing", "slipstream-dpo"),
    # --objective kto: TRL's KTOTrainer and slipstream's packed rows, without and with the prompt once
    "kto": ("trl-kto", "slipstream-kto-no-prefix-sharing", "slipstream-kto"),
    # --objective grpo: TRL's GRPOTrainer without and with vLLM, slipstream without and with each
    # group's prompt run once, and with vLLM sampling (the vLLM arms skipped, saying why, where it
    # is not installed: `ab` does not install it)
    "grpo": (
        "trl-grpo",
        "trl-grpo-vllm",
        "slipstream-grpo-no-prefix-sharing",
        "slipstream-grpo",
        "slipstream-grpo-vllm",
    ),
    # --objective grpo on prompts that share a system prompt or tool schemas, or trajectories that share
    # turns: TRL's GRPOTrainer, slipstream with one prompt per group, and as prefix trees
    "grpo-trees": ("trl-grpo", "slipstream-grpo-groups", "slipstream-grpo-tree"),
    # rows that repeat a start (a system prompt, a prompt's N answers): TRL's SFTTrainer packing them
    # whole (bfd), slipstream without and with the start run once
    "shared-prefixes": ("trl", "slipstream-no-prefix-sharing", "slipstream"),
    # multi-turn rows that share histories at several levels: TRL's SFTTrainer (bfd packing), slipstream
    # with the rows whole, with one shared start per group (today's sharing) and as prefix trees
    "prefix-trees": (
        "trl",
        "slipstream-no-prefix-sharing",
        "slipstream-prefix-groups",
        "slipstream-prefix-tree",
    ),
    # --objective dpo on pairs whose prompts share history (--step-order histories): TRL's DPOTrainer,
    # slipstream's pairs each packed with its prompt once, and as prefix trees across pairs
    "dpo-trees": ("trl-dpo", "slipstream-dpo", "slipstream-dpo-tree"),
    # --objective reward: TRL's RewardTrainer, slipstream's packed pairs without and with the prompt shared
    "reward": ("trl-reward", "slipstream-reward-no-prefix-sharing", "slipstream-reward"),
    # --objective orpo: slipstream's packed pairs, with and without the prompt shared
    "orpo": ("slipstream-orpo-no-prefix-sharing", "slipstream-orpo"),
    # --max-tokens-within: the memory ceiling of stock, TRL's fused head and slipstream (+ offload)
    "ceiling": ("stock-packed", "trl-fused-head", "slipstream", "slipstream-offload"),
    # the tools users would pick instead, each on the same bins, weights, LoRA and seed
    "peers": (
        "trl",
        "stock-packed",
        "stock-offload",
        "unsloth",
        "unsloth-same-settings",
        "liger",
        "slipstream",
    ),
}


# slipstream-again is the A/A control: how far two processes of the same arm differ
ABLATION_CONTROLS = ("stock-packed", "slipstream", "slipstream-again")


_BUILT: dict[str, object] = {}


def _tables() -> dict[str, object]:
    """The arms and the presets: the fixed ones, one leave-one-out arm per registered speedup with an
    ablation (``slipstream`` with it off) and the ``ablation`` preset of them; built again only when
    the registry or the ``Speedups`` class changed (a speedup registered after import has its arm)."""
    key = (registry.registered(), speedups_module.Speedups)
    if _BUILT.get("key") != key:
        slipstream = speedups_module.Speedups()
        leave_one_out = {arm: speedup.ablation for arm, speedup in ablation_arms().items()}
        specs = {
            **_FIXED_ARMS,
            **{arm: Arm("packed", slipstream.replace(**off)) for arm, off in leave_one_out.items()},
        }
        presets = {"default": _FIXED_PRESETS["default"], "ablation": (*ABLATION_CONTROLS, *leave_one_out)}
        presets |= {name: arms for name, arms in _FIXED_PRESETS.items() if name != "default"}
        _BUILT.update(key=key, specs=specs, presets=presets, names=tuple(specs))
    return _BUILT


class _Live(Mapping):
    """``ARM_SPECS`` / ``ARM_PRESETS``: a view of :func:`_tables`' ``which``."""

    def __init__(self, which: str) -> None:
        self._which = which

    def __getitem__(self, key: str):
        return _tables()[self._which][key]

    def __iter__(self) -> Iterator[str]:
        return iter(_tables()[self._which])

    def __len__(self) -> int:
        return len(_tables()[self._which])


class _ArmNames(Sequence):
    """``ARMS``: every arm's name, live like ``ARM_SPECS``."""

    def __getitem__(self, index):
        return _tables()["names"][index]

    def __len__(self) -> int:
        return len(_tables()["names"])

    def __repr__(self) -> str:  # what an error message that lists them shows
        return repr(tuple(self))


ARM_SPECS: Mapping[str, Arm] = _Live("specs")
ARM_PRESETS: Mapping[str, tuple[str, ...]] = _Live("presets")
ARMS: Sequence[str] = _ArmNames()


def preset_arms(preset: str, config, device: str) -> tuple[str, ...]:
    """The arms of ``--preset``, less a leave-one-out whose lever the run's ``slipstream`` arm would
    not pull on ``device`` (it would run the same thing twice), as each speedup's
    ``Speedup.ablation_applies`` says (what only the built model shows, such as a model type Liger
    lacks, is found when the arm's model is built, and logged)."""
    arms = ARM_PRESETS[preset]
    slipstream = arm_speedups(config, "slipstream")
    leave_one_out = ablation_arms()
    if not any(arm in leave_one_out for arm in arms):
        return tuple(arms)
    run = AblationRun(config, device, slipstream, _model_config(config))
    dropped = {arm for arm in arms if arm in leave_one_out and not leave_one_out[arm].ablation_applies(run)}
    return tuple(arm for arm in arms if arm not in dropped)


def _model_config(config):
    """The A/B model's transformers config, read without building the model."""
    from ..models import build_config, model_names

    if config.model in model_names():
        return build_config(config.model)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config.model)


def shares_prefixes(arm: str) -> bool:
    """Whether ``arm`` regroups each step's rows with their shared start once (where sharing is on): a
    slipstream arm with its packed attention (which honours the groups) and its chunked loss (which
    reads a continuation's first target across the shared start); every other arm gets the rows whole."""
    spec = ARM_SPECS[arm]
    return (
        not spec.stock
        and spec.peer is None
        and spec.pairs is None
        and spec.prefixes != "unshared"
        and spec.layout == "packed"
        and spec.speedups.packed_attention
        and spec.speedups.chunked_loss is not False  # None: on where the model supports it
    )


def micro_batch_inputs(arm: str, docs: list[dict], device: str):
    """The model kwargs of one micro-batch in ``arm``'s layout, and its label-token count. ``docs``:
    documents, or groups of rows sharing a start (``data.prefix_groups``) for an arm that shares them."""
    spec = ARM_SPECS[arm]
    if docs and "continuations" in docs[0]:
        from ..packing.groups import collate_groups

        batch = collate_groups(docs, device=device)
        return batch.model_inputs(), batch.num_label_tokens
    if spec.layout == "padded":
        inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in collate_padded(docs).items()}
        return inputs, count_label_tokens(docs)  # the same count the packed layouts carry
    batch = collate_packed(docs, device=device)
    inputs = batch.model_inputs() if spec.speedups.packed_attention else batch.stock_inputs()
    if spec.peer_loss == "trl-fused":
        inputs["fused_lm_head"] = True  # TRL's fused LM head computes the loss (see build_arm_model)
    return inputs, batch.num_label_tokens


def arm_speedups(config, arm: str) -> Speedups:
    """What an arm runs: its own Speedups, the run's checkpointing where it sets none, and the
    run's speedup options on the fields it leaves at their default (slipstream arms only)."""
    spec = ARM_SPECS[arm]
    run = config.train.speedups
    checkpointing = spec.speedups.checkpointing or run.checkpointing or "off"
    if spec.stock:
        return spec.speedups.replace(checkpointing="recompute" if checkpointing != "off" else "off")
    default = speedups_module.Speedups()
    options = {  # the run's changes, on the fields the arm leaves at their default (an ablation stays)
        f.name: getattr(run, f.name)
        for f in dataclasses.fields(run)
        if f.name != "checkpointing" and getattr(spec.speedups, f.name) == getattr(default, f.name)
    }
    return spec.speedups.replace(checkpointing=checkpointing, **options)


def drives(arm: str) -> bool:
    """Whether ``arm`` runs slipstream's own step (the step driver ``slipstream train`` runs); the stock
    arms and the peers get each step's rows whole and step as they would."""
    spec = ARM_SPECS[arm]
    return not spec.stock and spec.peer is None


def train_config_of(config, arm: str) -> TrainConfig:
    """``slipstream train``'s config of ``arm``: the run's own train config (an ``ABConfig``'s) with what
    makes it that arm (:func:`arm_overrides` lists it, key by key), its schedule over the run's steps.
    Every slipstream arm builds the one step driver (``train/driver.py``) from it, so what the arm times
    is what ``train`` runs; a stock arm or a peer loads its model and adapter from it
    (:func:`build_arm_model`), and every arm but a peer steps the file's optimizer as written."""
    spec, train = ARM_SPECS[arm], config.train
    replace = dataclasses.replace
    return replace(
        train,
        data=replace(
            train.data,
            # the arms read nothing (they replay the recorded steps); what a pass before step 0 would
            # cache (DPO's reference log-probs) is computed in every arm's process, so its time is its own
            cache=False,
            share_prefixes=(
                spec.prefixes
                if spec.prefixes in ("groups", "tree", "off")
                else train.data.share_prefixes
                if shares_prefixes(arm)
                else "off"
            ),
        ),
        lora=replace(train.lora, dropout=0.0),  # each arm would draw its own masks: no dropout in an A/B
        preference=replace(train.preference, prefix_sharing=spec.pairs != "unshared"),
        grpo=replace(
            train.grpo, prefix_sharing=spec.prefixes != "unshared", engine=spec.engine or train.grpo.engine
        ),
        speedups=arm_speedups(config, arm),
    )


def run_steps(config) -> int:
    """The run's optimizer steps, which its schedule runs over (the A/B replays its first ``ab.steps``)."""
    return config.train.training.steps or config.ab.steps


def _flat(section, prefix: str = "") -> dict[str, object]:
    """A config as ``{dotted key: value}``, the way ``--set`` names its keys."""
    found = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            found |= _flat(value, f"{prefix}{f.name}.")
        else:
            found[f"{prefix}{f.name}"] = value
    return found


def arm_overrides(config, arm: str) -> dict[str, object]:
    """What ``arm`` changes of the run's train config, ``{dotted key: value}`` as ``--set`` writes them
    (the record and ``ab.md`` list them: nothing an arm runs differs from the file unsaid)."""
    run, own = _flat(config.train), _flat(train_config_of(config, arm))
    return {key: value for key, value in own.items() if run.get(key) != value}


def build_arm_model(config, arm: str, vocab_size: int, device: str):
    """The model a stock arm or a peer trains, set up as the arm says, by ``slipstream train``'s own
    loader and adapter (``train/driver.py``) on the arm's ``TrainConfig``: every arm starts from the
    same weights (the model directory's, or a preset's seeded by ``config.train.seed``) and the same
    adapter initialisation. The peer's own set-up goes between the two (TRL's fused head before PEFT)."""
    from ..train.driver import apply_lora, load_model
    from .inputs import quiet_progress_bars

    if config.ab.threads:
        torch.set_num_threads(config.ab.threads)
    train = train_config_of(config, arm)
    with quiet_progress_bars():
        model = load_model(train, vocab_size, getattr(torch, train.model.dtype))
    model.to(device).train()
    spec = ARM_SPECS[arm]
    optimize(model, train.speedups, expected_steps=config.ab.steps)
    state = state_of(model)
    if spec.peer_loss == "trl-fused":
        # TRL is optional and heavy: only this arm imports it
        from trl.trainer.utils import add_fused_lm_head  # what SFTTrainer 1.16 installs (before PEFT)

        add_fused_lm_head(model)
        state.policies.append("loss: TRL's fused LM head (trl.trainer.utils.add_fused_lm_head)")
    if spec.peer:
        state.policies.extend(prepare_base_model(spec.peer, model))
    return apply_lora(model, train)
