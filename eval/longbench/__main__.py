"""python -m eval.longbench: predict and score LongBench with a model and a compressor (Hydra app)."""
from __future__ import annotations

from omegaconf import DictConfig

from .. import engine
from ..hydra_app import run_guarded, task_main
from .predict import LongBenchTask


def run(cfg: DictConfig) -> dict:
    return engine.run(LongBenchTask(), cfg)


@task_main("longbench")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
