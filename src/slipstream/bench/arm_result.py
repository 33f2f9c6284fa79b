"""What one A/B arm measured (``ArmResult``), and what every kind of arm session opens with: its
model or step driver, its peak memory and the one-ulp perturbation of its weights (the run's sensitivity)."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Any

import torch

from .ceiling import proc_status_kib


@dataclass
class ArmResult:
    arm: str
    step_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    host_syncs_per_step: int | None = None  # None: not counted (a peer run outside our counter)
    host_syncs_by_op: dict[str, int] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    memory_kind: str = ""
    attn_implementation: str = ""
    policies: list[str] = field(default_factory=list)
    # kept on the device at the end of forward (hardware-independent); None: not measured
    activation_bytes: int | None = 0
    dtype: str = ""  # the parameters' dtype the arm trained (a peer on its defaults may pick its own)
    # model FLOPs of each step (forward + backward, utilisation.flops), from this arm's model; None: not counted
    model_flops: list[int] | None = None
    # the untimed forward that measures activation_bytes (a compiled arm compiles its forward there)
    probe_forward_s: float = 0.0
    # batches and attention calls its packed SDPA ran grouped / per document over all its steps
    # (packing.grouping.GroupingCounts.to_dict); None: no packed attention in this arm
    attention_grouping_counts: dict[str, int] | None = None
    # --profile-step: one more step under torch.profiler (utilisation.step_profile); None: not profiled
    step_profile: dict[str, Any] | None = None
    # the learning rate each step ran with (the run's schedule); None: the peer keeps its own
    lr: list[float] | None = None
    # weights moved by one ulp before step 0 (a sensitivity run, ``perturb``); 0: none
    perturbed_weights: int = 0
    # a reduced-precision run's step 0 against fp32 (bench/truth.py): where this arm's step-0 gradient
    # was written (step_gradient.HeldGradient.save: file, names, sizes); None where not kept. The runner
    # reads the file, removes it, and keeps only its size here ({"parameters", "values"}) in ab.json
    step0_gradient: dict[str, Any] | None = None
    # a preference objective (--objective dpo, orpo): pairs per step, the reward margin and accuracy of each step, and the
    # untimed reference pass run before step 0 (slipstream's arms; a peer's reference is in its steps)
    pairs: list[int] | None = None
    reward_margin: list[float] | None = None
    reward_accuracy: list[float] | None = None
    reference_pass_s: float = 0.0
    # a compiled arm: dynamo's frames, graphs and recompiles after its first step and after its last
    # (compile.graph_counts; equal when no batch made it build again); None: not compiled
    compile_graphs: dict[str, dict[str, int]] | None = None
    # per step: the process's page faults inside the timed step (ru_minflt, every thread)
    page_faults: list[int] = field(default_factory=list)
    # per step: the process's CPU seconds in the kernel (ru_stime: page faults, zeroing pages, ...)
    system_s: list[float] = field(default_factory=list)
    # per step: the cores other work took while it ran (hardware.OtherLoad: other processes, the
    # kernel's own threads, the hypervisor's steal; 0 on a quiet machine); None where unknown
    other_cores: list[float | None] = field(default_factory=list)
    # per step: the memory held warm after it until the next (bench/host_pages.py: bytes and seconds;
    # 0 where --no-keep-pages-warm or not on a CPU)
    held_bytes: list[int] = field(default_factory=list)
    hold_s: list[float] = field(default_factory=list)
    # --objective grpo (bench/grpo_arms.py), per step: the arm's own sampling of the step's prompts
    # (generate) and scoring (rewards, advantages), the update on the shared rollouts, the completions
    # it sampled and their tokens; None for any other objective
    generation_s: list[float] | None = None
    scoring_s: list[float] | None = None
    update_s: list[float] | None = None
    completions: list[int] | None = None
    generated_tokens: list[int] | None = None
    # with tools: the tool calls per trajectory of the arm's own sampling (None where no tools)
    tool_calls: list[float | None] | None = None
    # the tokens the arm's update ran a step (its packed rows; None for a peer's padded batches)
    update_tokens: list[int | None] | None = None


def peak_memory_mb(device: str) -> float:
    """CUDA: max allocated. CPU: this process's peak RSS (VmHWM where Linux has it: ru_maxrss
    carries a big parent's figure across fork + exec)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        return proc_status_kib("VmHWM") / 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def perturb_by_one_ulp(model: torch.nn.Module, seed: int) -> int:
    """Move every floating-point weight of ``model`` one ulp up or down (random signs from ``seed``),
    in place: the smallest change its dtype can make. Returns the number of values moved."""
    generator = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            up = torch.rand(param.shape, generator=generator) < 0.5
            toward = torch.where(up, float("inf"), float("-inf")).to(param.device, param.dtype)
            param.copy_(torch.nextafter(param, toward))
            moved += param.numel()
    return moved


def open_arm_model(config, arm: str, plan: list, vocab_size: int, perturb: bool, fp32: bool = False):
    """What every arm session starts from: the device; for a slipstream arm, the step driver
    ``slipstream train`` runs (``train/driver.py``) built from the arm's ``TrainConfig``
    (``arms.train_config_of``) on the run's planned rows, not yet prepared (the caller times the
    reference pass); for a stock arm or a peer, its model as the arm says (``arms.build_arm_model``).
    ``fp32``: the very same weights and adapter, built in the run's dtype, then cast up to fp32
    (exactly: every reduced-precision value is an fp32 value), for the fp32 step 0 a reduced-precision
    run is judged against (``bench/truth.py``); ``perturb``: the weights moved by one ulp, the run's
    sensitivity. Returns ``(device, driver or None, model, weights moved)``."""
    from ..train.driver import driver_for
    from ..train.inputs import DriverInputs, objective_of
    from .ab_config import resolve_device
    from .arms import build_arm_model, drives, train_config_of
    from .inputs import ab_tokenizer, quiet_progress_bars

    if config.ab.threads:
        torch.set_num_threads(config.ab.threads)
    device, driver = resolve_device(config.ab.device), None
    if drives(arm):
        with quiet_progress_bars():
            train = train_config_of(config, arm)
            objective = objective_of(train)
            inputs = DriverInputs(
                tokenizer=ab_tokenizer(config),
                objective=objective,
                device=torch.device(device),
                dtype=getattr(torch, config.train.model.dtype),
                plan=[objective.replayed_bins(step) for step in plan],  # the run's recorded steps
                vocab_size=vocab_size,
            )
            driver = driver_for(train, inputs=inputs)
        model = driver.model
    else:
        model = build_arm_model(config, arm, vocab_size, device)
    if fp32:
        model.float()
    moved = perturb_by_one_ulp(model, config.train.seed + 1) if perturb else 0
    return device, driver, model, moved
