"""``hydra/sweeper=shared_prefill``: one job per group of settings that share a prefill.

The jobs of a multirun that differ only in their compressor are one group: every method compresses
after the prefill, so the group runs as one job that prefills each prompt once and decodes each
setting from its own cache (``eval.engine``). The sweeper composes every job's config, drops the
compressor fields a method does not use (``full`` under three budgets is one setting), merges the
settings that land in the same folder, writes each group's settings to
``<sweep dir>/.shared_prefill/group-N.json`` and launches one job per group through the configured
launcher (the basic one, or ``hydra/launcher=slurm``: one SLURM job per group). A group of one
setting is launched as the plain job it is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf


class SharedPrefillSweeper(BasicSweeper):
    """The basic sweeper's jobs, grouped so that each group shares one prefill per prompt."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[dict] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)

    def sweep(self, arguments: list[str]) -> Any:
        params = self._parse_config() + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        jobs = self.split_arguments(parser.parse_overrides(params), None)[0]
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        def compose(overrides):
            return self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))

        from eval.sweep_groups import group_jobs, write_group
        batch = []
        for members in group_jobs(jobs, compose):
            if len(members) == 1:
                batch.append(members[0].overrides)
            else:
                path = write_group(sweep_dir, members)
                batch.append(members[0].overrides + [f"shared_prefill.group={path}"])
        print(f"shared_prefill: {len(jobs)} jobs -> {len(batch)} job(s), one prefill per prompt each")
        self.overrides = list(self.split_overrides_to_chunks(batch, self.max_batch_size))
        returns, initial = [], 0
        while not self.is_done():
            chunk = self.get_job_batch()
            results = self.launcher.launch(chunk, initial_job_idx=initial)
            for result in results:
                _ = result.return_value
            initial += len(chunk)
            returns.append(results)
        return returns
