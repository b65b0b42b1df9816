"""dpipe's Hydra launchers: how `dpipe-train -m ...` runs the points of a sweep.

- `basic` (the default): one point after another on this machine.
- `submitit_local`: points in parallel on this machine, each with GPUs of its own (a point
  waits until enough GPUs are free); on a machine without GPUs, `max_parallel` points at once.
- `submitit_slurm`: one SLURM job per point, submitted as a job array. A point is a
  `nodes x tasks_per_node` task job, one process per GPU (`tasks_per_node` defaults to
  `gpus_per_node`), each task one rank of the pipeline-parallel run (see launch/env.py).

They replace the launchers of the same names from hydra-core and hydra-submitit-launcher (whose
config lacks srun_args, python and a derived tasks_per_node, and which runs SLURM tasks with every
rank writing Hydra's files and waits on failed jobs for long). All three end by writing and
printing the sweep summary, and fail (exit 1) when a point did not complete.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.experimental.callback import Callback
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dpipe.config.default_pipeline import fit_default_pipeline
from dpipe.config.run_name import register_resolver as register_run_name
from dpipe.launch.dirnames import exclude_fixed_keys, register_resolver
from dpipe.errors import ConfigError
from dpipe.launch import env as dist_env
from dpipe.launch import jobs
from dpipe.launch.summary import PointResult, write_summary

log = logging.getLogger("dpipe")
PLUGIN_PREFIX = "hydra_plugins.dpipe."  # see register_launchers


# ------------------------------------------------------------------------------------------------
# Config schemas (hydra.launcher.*); an unknown key fails when Hydra composes the config.


@dataclass
class BasicLauncherConf:
    _target_: str = PLUGIN_PREFIX + "BasicLauncher"


@dataclass
class SubmititLocalConf:
    _target_: str = PLUGIN_PREFIX + "LocalLauncher"
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    # GPUs per point; null: pipeline.stages x pipeline.data_parallel (null counts as 1) of each
    # point. Points wait until that many GPUs are free: no two points share a GPU.
    gpus_per_node: Optional[int] = None
    # Points running at once on a machine without GPUs; null: as many as CPUs / processes allow.
    max_parallel: Optional[int] = None
    timeout_min: int = 7 * 24 * 60
    name: str = "${hydra.job.name}"
    stderr_to_stdout: bool = False
    poll_interval_s: float = 1.0


@dataclass
class SubmititSlurmConf:
    _target_: str = PLUGIN_PREFIX + "SlurmLauncher"
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    timeout_min: int = 60
    nodes: int = 1
    gpus_per_node: Optional[int] = None
    # One task per GPU. null: gpus_per_node, or on CPU-only nodes the point's
    # pipeline.stages x pipeline.data_parallel / nodes.
    tasks_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    mem_per_gpu: Optional[str] = None
    mem_per_cpu: Optional[str] = None
    gres: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    comment: Optional[str] = None
    name: str = "${hydra.job.name}"
    stderr_to_stdout: bool = False
    # SLURM sends USR2 this long before the time limit: dpipe checkpoints and requeues.
    signal_delay_s: int = 90
    # How many times a point may be requeued at its time limit (preemptions do not count).
    max_num_timeout: int = 100
    array_parallelism: int = 256
    # Shell lines run in the job before srun (module load, conda activate, exports).
    setup: Optional[list[str]] = None
    # The network interface the ranks talk over (e.g. ib0, eth1): exported to every task as
    # GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, except where the job's environment already sets
    # them. null: the libraries' choice (gloo: the address of the host name; NCCL: its own pick).
    socket_ifname: Optional[str] = None
    # Submit with --requeue: SLURM requeues a job that lost a node (NODE_FAIL) and dpipe's
    # time-limit requeue needs it; the job resumes from its newest complete checkpoint.
    requeue: bool = True
    # Extra srun arguments; dpipe always adds --kill-on-bad-exit=1 (one failed rank ends the job).
    srun_args: list[str] = field(default_factory=list)
    # The python that runs the tasks (default: the one submitting), e.g. a container wrapper.
    python: Optional[str] = None
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    poll_interval_s: float = 2.0


# conf/config.yaml names runs and sweep folders through these resolvers; registered on import, so
# that the processes that run sweep points (submitit's jobs unpickle this module) resolve them too.
register_resolver()
register_run_name()


def register_launchers() -> None:
    """Stores dpipe's launchers under Hydra's names, after Hydra's plugin scan (which would
    otherwise store hydra-submitit-launcher's own configs over them).

    Hydra instantiates launchers only from the `hydra_plugins` package, by the names its plugin
    registry knows: each class is entered there under a `hydra_plugins.dpipe.*` name (its
    module stays dpipe.launch.sweep, where submitit's jobs unpickle it from).
    """
    from hydra.core.plugins import Plugins

    plugins = Plugins.instance()
    for cls in (BasicLauncher, LocalLauncher, SlurmLauncher):
        plugins.class_name_to_class[f"{PLUGIN_PREFIX}{cls.__name__}"] = cls
    cs = ConfigStore.instance()
    cs.store(group="hydra/launcher", name="basic", node=BasicLauncherConf, provider="dpipe")
    cs.store(group="hydra/launcher", name="submitit_local", node=SubmititLocalConf, provider="dpipe")
    cs.store(group="hydra/launcher", name="submitit_slurm", node=SubmititSlurmConf, provider="dpipe")


class SweepSetup(Callback):
    """Readies a sweep's config before Hydra's sweeper and dpipe's launcher read it (conf/config.yaml
    names it in hydra.callbacks)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # The launcher's keys (its submitit folder) and the sweep dir interpolate `${name}`, which
        # reads the model and dataset choices from the Hydra config: Hydra sets it for a run, but
        # for a sweep only once a point runs, after it has read them.
        HydraConfig.instance().set_config(config)
        with read_write(config.hydra):
            # One sweep dir for every point: each point's config is composed again with its own
            # overrides, where `${name}` (a swept model or dataset) and `${now:}` could differ.
            config.hydra.sweep.dir = str(config.hydra.sweep.dir)
            # The points' folders name what is swept. Each point is composed from these
            # overrides (Hydra's load_sweep_config), so they carry the setting to every point.
            excluded = exclude_fixed_keys(
                list(config.hydra.overrides.task),
                list(config.hydra.job.config.override_dirname.exclude_keys))
            if excluded is not None:
                config.hydra.overrides.hydra.append(
                    f"hydra.job.config.override_dirname.exclude_keys=[{','.join(excluded)}]")


# ------------------------------------------------------------------------------------------------


@dataclass
class Point:
    num: int
    overrides: list[str]
    run_dir: Path
    processes: int  # stages x data_parallel (None counted as 1)
    tasks_per_node: int = 1


class _SweepLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        self.params = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                       for k, v in params.items()}
        self.config: Optional[DictConfig] = None
        self.task_function = None
        self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def _point_config(self, overrides: Sequence[str]) -> DictConfig:
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.sweep.dir = str(self.config.hydra.sweep.dir)
        return cfg

    @property
    def sweep_dir(self) -> Path:
        return Path(str(self.config.hydra.sweep.dir))

    def _points(self, job_overrides: Sequence[Sequence[str]], first: int) -> list[Point]:
        """Composes every point before anything runs: a bad point fails the sweep up front."""
        from dpipe.config.checks import validate

        points = []
        saved = HydraConfig.instance().cfg
        try:
            for i, overrides in enumerate(job_overrides):
                cfg = self._point_config(overrides)
                with open_dict(cfg):
                    cfg.hydra.job.num = first + i
                HydraConfig.instance().set_config(cfg)
                run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
                try:
                    self._fit_pipeline(cfg)
                    run = validate(cfg)
                    point = Point(first + i, list(overrides), run_dir.absolute(),
                                  run.pipeline.stages * (run.pipeline.data_parallel or 1))
                    self._check_point(point, cfg)
                except ConfigError as err:
                    # before anything runs or is queued; no traceback: the message says it all
                    print(f"error: sweep point #{first + i} ({' '.join(overrides)}): {err}",
                          file=sys.stderr)
                    sys.exit(2)
                points.append(point)
        finally:
            HydraConfig.instance().cfg = saved
        return points

    def _fit_pipeline(self, cfg: DictConfig) -> None:
        """The default pipeline fitted to the GPUs a point gets, as the point will fit it."""

    def _check_point(self, point: Point, cfg: DictConfig) -> None:
        pass

    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: dict, cuda_devices: str | None = None) -> JobReturn:
        """Runs one point inside a submitit job (every task of it, for SLURM)."""
        import submitit

        if cuda_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
        ifname = self.params.get("socket_ifname")
        if ifname:  # the job's own environment (exported by the user) wins
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
        Singleton.set_state(singleton_state)
        setup_globals()
        cfg = self._point_config(sweep_overrides)
        with open_dict(cfg.hydra):
            cfg.hydra.job.id = submitit.JobEnvironment().job_id
            cfg.hydra.job.num = job_num
            if dist_env.process_rank() != 0:
                # Rank 0 alone writes the run dir's .hydra/ files and its log file; the other
                # ranks log to their own task's output file only.
                cfg.hydra.output_subdir = None
                cfg.hydra.job_logging = {"version": 1, "root": None, "disable_existing_loggers": False}
        return run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                       config=cfg, job_dir_key=job_dir_key, job_subdir_key="hydra.sweep.subdir")

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit calls this at the time limit: the same point again (it resumes by itself)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def _finish(self, results: list[PointResult], returns: list[JobReturn]) -> list[JobReturn]:
        md = write_summary(self.sweep_dir, results)
        print("\n" + md, flush=True)
        failed = [r for r in results if not r.ok]
        if failed:
            print(f"error: {len(failed)} of {len(results)} sweep points did not complete "
                  f"(see {self.sweep_dir / 'sweep_summary.md'})", file=sys.stderr, flush=True)
            sys.exit(1)
        return returns

    def _track_results(self, tracked: list[jobs.Tracked], points: dict[int, Point]):
        results, returns = [], []
        for t in sorted(tracked, key=lambda t: t.num):
            p = points[t.num]
            results.append(PointResult(p.num, p.overrides, str(p.run_dir), t.status or "failed",
                                       t.message, t.job.job_id))
            returns.append(t.job_return if t.job_return is not None else
                           _failed_return(p, RuntimeError(t.message or t.status)))
        return results, returns


def _failed_return(point: Point, error: BaseException) -> JobReturn:
    ret = JobReturn(overrides=point.overrides, status=JobStatus.FAILED)
    ret.return_value = error
    return ret


class BasicLauncher(_SweepLauncher):
    """One point after another, in this process (dpipe starts each point's workers)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        points = {p.num: p for p in self._points(job_overrides, initial_job_idx)}
        log.info("sweep of %d points, one after another; sweep dir %s", len(points), self.sweep_dir)
        results, returns = [], []
        for p in points.values():
            log.info("sweep point #%d: %s", p.num, " ".join(filter_overrides(p.overrides)))
            cfg = self._point_config(p.overrides)
            with open_dict(cfg):
                cfg.hydra.job.id = p.num
                cfg.hydra.job.num = p.num
            ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                          config=cfg, job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            ok = ret.status == JobStatus.COMPLETED
            results.append(PointResult(p.num, p.overrides, str(p.run_dir),
                                       "completed" if ok else "failed",
                                       "" if ok else str(ret._return_value)))
            returns.append(ret)
        return self._finish(results, returns)


class LocalLauncher(_SweepLauncher):
    """Points in parallel on this machine, each in a submitit job with GPUs of its own."""

    def _fit_pipeline(self, cfg: DictConfig) -> None:
        fit_default_pipeline(cfg, cfg.hydra, len(_visible_gpus()))

    def _check_point(self, point: Point, cfg: DictConfig) -> None:
        gpus = _visible_gpus()
        need = self.params.get("gpus_per_node") or point.processes
        if gpus and need > len(gpus):
            raise ConfigError(f"needs {need} GPUs, but this machine shows {len(gpus)}")

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        points = {p.num: p for p in self._points(job_overrides, initial_job_idx)}
        gpus = _visible_gpus()
        executor = submitit.AutoExecutor(folder=self.params["submitit_folder"], cluster="local")
        executor.update_parameters(timeout_min=self.params["timeout_min"], tasks_per_node=1,
                                   name=self.params["name"],
                                   stderr_to_stdout=self.params["stderr_to_stdout"])
        if gpus:
            slots = None
            log.info("sweep of %d points on this machine's %d GPUs, no GPU shared; sweep dir %s",
                     len(points), len(gpus), self.sweep_dir)
        else:
            per_point = max(p.processes for p in points.values())
            slots = self.params.get("max_parallel") or max(1, (os.cpu_count() or 1) // per_point)
            log.info("sweep of %d points, %d at a time on CPU; sweep dir %s", len(points), slots,
                     self.sweep_dir)
        queue, running, done = deque(points.values()), {}, []
        free = list(gpus)
        try:
            while queue or running:
                while queue:
                    p = queue[0]
                    need = (self.params.get("gpus_per_node") or p.processes) if gpus else 0
                    if (gpus and need > len(free)) or (not gpus and len(running) >= slots):
                        break
                    queue.popleft()
                    devices, free = free[:need], free[need:]
                    job = executor.submit(self, p.overrides, "hydra.sweep.dir", p.num,
                                          f"job_id_for_{p.num}", Singleton.get_state(),
                                          ",".join(devices) if gpus else None)
                    log.info("sweep point #%d (job %s%s): %s", p.num, job.job_id,
                             f", GPUs {','.join(devices)}" if gpus else "",
                             " ".join(filter_overrides(p.overrides)))
                    running[p.num] = (jobs.Tracked(p.num, job, p.run_dir), devices)
                for num, (t, devices) in list(running.items()):
                    if jobs.check(t):
                        done.append(t)
                        free += devices
                        del running[num]
                if running:
                    time.sleep(self.params["poll_interval_s"])
        except BaseException:
            for t, _ in running.values():
                t.job.cancel(check=False)
            raise
        return self._finish(*self._track_results(done, points))


class SlurmLauncher(_SweepLauncher):
    """One SLURM job per point (a job array per distinct task count)."""

    def _tasks_per_node(self, point: Point) -> int:
        p = self.params
        if p.get("tasks_per_node"):
            return p["tasks_per_node"]
        if p.get("gpus_per_node"):
            return p["gpus_per_node"]
        nodes = p["nodes"]
        if point.processes % nodes:
            raise ConfigError(f"{point.processes} processes (pipeline.stages x "
                              f"pipeline.data_parallel) do not split over {nodes} nodes; set "
                              "hydra.launcher.tasks_per_node")
        return point.processes // nodes

    def _check_point(self, point: Point, cfg: DictConfig) -> None:
        from dpipe.config.checks import validate

        point.tasks_per_node = self._tasks_per_node(point)
        validate(cfg, world_size=self.params["nodes"] * point.tasks_per_node)

    def _executor(self, tasks_per_node: int):
        import submitit

        p = dict(self.params)
        executor = submitit.AutoExecutor(folder=p.pop("submitit_folder"), cluster="slurm",
                                         slurm_max_num_timeout=p.pop("max_num_timeout"),
                                         slurm_python=p.pop("python"))
        for key in ("poll_interval_s", "tasks_per_node", "socket_ifname"):
            p.pop(key)
        if p.pop("requeue"):
            p["additional_parameters"] = {"requeue": True, **p["additional_parameters"]}
        generic = {"timeout_min", "nodes", "gpus_per_node", "cpus_per_task", "mem_gb", "name",
                   "stderr_to_stdout"}
        params = {k if k in generic else f"slurm_{k}": v for k, v in p.items() if v is not None}
        params["slurm_srun_args"] = ["--kill-on-bad-exit=1", *p["srun_args"]]
        executor.update_parameters(tasks_per_node=tasks_per_node, **params)
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        points = {p.num: p for p in self._points(job_overrides, initial_job_idx)}
        groups: dict[int, list[Point]] = {}
        for p in points.values():
            groups.setdefault(p.tasks_per_node, []).append(p)
        tracked = []
        for tasks, group in groups.items():
            executor = self._executor(tasks)
            submitted = executor.map_array(
                self, [p.overrides for p in group], ["hydra.sweep.dir"] * len(group),
                [p.num for p in group], [f"job_id_for_{p.num}" for p in group],
                [Singleton.get_state()] * len(group))
            array = submitted[0].job_id.split("_")[0]
            log.info("submitted SLURM job array %s: %d points x %d nodes x %d tasks "
                     "(partition %s); logs in %s", array, len(group), self.params["nodes"], tasks,
                     self.params.get("partition") or "default",
                     Path(str(executor.folder)).parent)
            for p, job in zip(group, submitted):
                log.info("  #%d -> job %s: %s", p.num, job.job_id,
                         " ".join(filter_overrides(p.overrides)))
                tracked.append(jobs.Tracked(p.num, job, p.run_dir))
        try:
            jobs.wait(tracked, self.params["poll_interval_s"])
        except KeyboardInterrupt:
            ids = " ".join(sorted({t.job.job_id.split("_")[0] for t in tracked}))
            print(f"\nstopped waiting; the jobs keep running (cancel them with: scancel {ids})",
                  file=sys.stderr)
            raise
        return self._finish(*self._track_results(tracked, points))


def _visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES entries (ids or UUIDs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
