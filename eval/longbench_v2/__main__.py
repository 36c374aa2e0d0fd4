"""python -m eval.longbench_v2: predict and score LongBench v2 with a model and a compressor (Hydra app)."""
from __future__ import annotations

from omegaconf import DictConfig

from .. import engine
from ..hydra_app import run_guarded, task_main
from .predict import LongBenchV2Task


def run(cfg: DictConfig) -> dict:
    return engine.run(LongBenchV2Task(), cfg)


@task_main("longbench_v2")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
