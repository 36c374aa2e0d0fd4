"""python -m eval.math: AIME25 or MATH-500 (``math.dataset``) with a model and a compressor (Hydra app)."""
from __future__ import annotations

from omegaconf import DictConfig

from .. import engine
from ..hydra_app import run_guarded, task_main
from .predict import MathTask


def run(cfg: DictConfig) -> dict:
    return engine.run(MathTask(), cfg)


@task_main("math")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
