"""``hydra/sweeper=shared_prefill``: one job per group of settings that share a prefill.

The jobs of a multirun that differ only in their compressor are one group: every method compresses
after the prefill, so the group runs as one job that prefills each prompt once and decodes each
setting from its own cache (``eval.engine``). The sweeper composes every job's config, drops the
compressor fields a method does not use (``full`` under three budgets is one setting), merges the
settings that land in the same folder, writes each group's settings to
``<sweep dir>/.shared_prefill/group-N.json`` and launches one job per group through the configured
launcher (the basic one, or ``hydra/launcher=slurm``: one SLURM job per group). A group of one
setting is launched as the plain job it is. On SLURM each job's memory request follows the memory
planner (``eval.job_memory``): one line per job says what was planned. Each setting keeps the
overrides of the job it stands for (in the group file): a group job that fails records each
setting's failure under them (``eval.hydra_app.job_settings``), and the summary at the end of the
sweep lists each setting that failed; the sweep then exits 1.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf


class SharedPrefillSweeper(BasicSweeper):
    """The basic sweeper's jobs, grouped so that each group shares one prefill per prompt."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[dict] = None,
                 gpu_memory_gib: Optional[float] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.gpu_memory_gib = gpu_memory_gib

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
        batch, groups = [], group_jobs(jobs, compose)
        for members in groups:
            if len(members) == 1:
                batch.append(members[0].overrides)
            else:
                path = write_group(sweep_dir, members)
                batch.append(members[0].overrides + [f"shared_prefill.group={path}"])
        print(f"shared_prefill: {len(jobs)} jobs -> {len(batch)} job(s), one prefill per prompt each")
        requests = self._memory_requests(groups, compose)
        self.overrides = list(self.split_overrides_to_chunks(batch, self.max_batch_size))
        returns, initial = [], 0
        while not self.is_done():
            chunk = self.get_job_batch()
            if requests:
                self._request_memory(requests[initial:initial + len(chunk)])
            results = self.launcher.launch(chunk, initial_job_idx=initial)
            for result in results:
                _ = result.return_value
            initial += len(chunk)
            returns.append(results)
        return returns

    def _memory_requests(self, groups, compose) -> Optional[list]:
        """With ``hydra/launcher=slurm``: each job's planned memory request (``eval.job_memory``)."""
        if not str(self.config.hydra.launcher.get("_target_", "")).endswith(".SlurmLauncher"):
            return None
        from eval.job_memory import group_request
        self._configured_mem_gb = self.launcher.params.get("mem_gb")
        requests = []
        for i, members in enumerate(groups):
            requests.append(group_request(members, compose, self.launcher.params, self.gpu_memory_gib))
            print(f"shared_prefill: job {i}: {requests[-1].line}")
        return requests

    def _request_memory(self, requests) -> None:
        """One SLURM array takes one request: the largest of its jobs'."""
        from eval.job_memory import array_mem_gb
        mem_gb = array_mem_gb(requests, self._configured_mem_gb)
        if mem_gb != self.launcher.params.get("mem_gb"):
            print(f"shared_prefill: SLURM array of {len(requests)} job(s): mem_gb={mem_gb} "
                  f"(configured {self._configured_mem_gb})")
        self.launcher.params["mem_gb"] = mem_gb
