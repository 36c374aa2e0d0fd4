"""python -m eval.ruler: RULER's 13 synthetic tasks with a model and a compressor (Hydra app);
``ruler.export=DIR`` writes the samples in RULER's layout instead and loads no weights."""
from __future__ import annotations

from omegaconf import DictConfig

from .. import engine
from ..hydra_app import run_guarded, task_main
from .predict import RulerTask, check_section, export


def run(cfg: DictConfig):
    if cfg.ruler.get("export"):
        from ..runner import load_tokenizer
        check_section(cfg.ruler)
        paths = export(cfg.ruler, load_tokenizer(cfg.model), str(cfg.ruler.export))
        print(f"ruler: {len(paths)} files in RULER's layout under {cfg.ruler.export}")
        return paths
    return engine.run(RulerTask(), cfg)


@task_main("ruler")
def main(cfg: DictConfig):
    return run_guarded(run, cfg)


if __name__ == "__main__":
    main()
