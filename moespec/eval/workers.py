"""``--workers N``: one evaluation split over N processes by item, the records merged into the same files.

Every item's records depend only on the item and the arm: each item starts from an empty expert cache
(arms.cold_start) and guarded runs without the timed prediction gate (arms.gated). So any split of the
items gives the records one process gives (within float rounding: the KV prefix an item reuses from
the item before it is exact in every mode, but is computed from another item's forward). Each task's
items that some arm still lacks are dealt round-robin: worker k takes the k-th, (k+N)-th, ... so every
worker gets a like share of every task (a GSM8K item costs ~30 multiple-choice items).

The calling process is worker 0: it scores its share on the model it has loaded, into the arm files
in OUT itself. Workers 1..N-1 are spawned processes (``multiprocessing`` "spawn": no torch state is
forked) that load the model again (the default model: ~1.4 GB of RAM each), score their share into
``OUT/.worker-K/ARM.json`` and report each finished item on a queue, which drives the one progress bar.
When all have stopped (also after Ctrl-C or an error) the parts are merged into ``OUT/ARM.json`` and
removed; a part a killed run left behind is merged at the next start (``merge_parts``), so resuming
works as with one process.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from moespec.errors import MoespecError
from moespec.eval.arms import Arm
from moespec.eval.data import TaskData
from moespec.eval.results import ArmResults
from moespec.eval.run import EvalConfig, Limits, ProgressFn, arm_key, evaluate, limited

PART_PREFIX = ".worker-"
JOIN_S = 30.0  # how long the parent waits for a worker to save after Ctrl-C or an error before it stops it


@dataclass(frozen=True)
class WorkerJob:
    """What one spawned worker runs (picklable).

    Attributes:
        model: MODEL as the command got it (None: the default model).
        rcfg: the runtime config (RuntimeConfig).
        tasks: this worker's share of every task (TaskData with a subset of the items).
        arms: the arms, exact first.
        ecfg: the evaluation config, ``out_dir`` this worker's part folder, no limit.
        threads: torch threads of this worker.
    """

    model: str | None
    rcfg: object
    tasks: list
    arms: list
    ecfg: EvalConfig
    threads: int


def shares(tasks: list[TaskData], done: dict[str, dict[str, set[str]]], n: int) -> list[list[TaskData]]:
    """``n`` shares of the items some arm lacks: share k holds, of each task, the k-th, (k+n)-th, ... of them.

    ``done``: arm name -> task -> doc_ids (as saved) that arm has.
    """
    out: list[list[TaskData]] = [[] for _ in range(n)]
    for task in tasks:
        todo = [it for it in task.items if any(str(it.doc_id) not in d.get(task.name, set()) for d in done.values())]
        for k in range(n):
            out[k].append(TaskData(task.name, task.kind, tuple(todo[k::n]), task.source, task.sha256))
    return out


def part_dirs(out_dir: Path) -> list[Path]:
    """The worker part folders under ``out_dir``, in name order."""
    return sorted(p for p in out_dir.glob(f"{PART_PREFIX}*") if p.is_dir()) if out_dir.is_dir() else []


def merge_parts(files: dict[str, ArmResults]) -> int:
    """Move every record of the part folders beside ``files`` (arm name -> the arm's main results) into
    them, save them and remove the parts; returns the records moved.

    Raises:
        OutputError: a part file made with other settings or data (ArmResults.open / records).
    """
    out_dir = next(iter(files.values())).path.parent
    moved = 0
    for part in part_dirs(out_dir):
        for main in files.values():
            path = part / main.path.name
            if not path.exists():
                continue
            got = ArmResults.open(path, main.key)
            for task, entry in got.tasks.items():
                items = main.records(task, entry["sha256"])
                new = {k: v for k, v in entry["items"].items() if k not in items}
                items.update(new)
                main.tasks[task]["seconds"] += entry.get("seconds", 0.0) if new else 0.0
                moved += len(new)
        for main in files.values():
            main.save()
        shutil.rmtree(part)
    return moved


def _worker_main(job: WorkerJob, queue) -> None:
    """A spawned worker: load the model, score ``job``'s share, report each item as (arm name, task name)
    on ``queue``, then ("done", "") or ("error", one-line message)."""
    import os

    os.environ["OMP_NUM_THREADS"] = str(job.threads)
    try:
        import torch

        torch.set_num_threads(job.threads)
        from moespec.chat.open_model import open_model

        opened = open_model(job.model, job.rcfg)
        try:
            def progress(arm, task, total, done):
                return lambda: queue.put((arm.name, task.name))

            evaluate(opened, job.rcfg, job.tasks, job.arms, job.ecfg, progress)
        finally:
            opened.close()
        queue.put(("done", ""))
    except KeyboardInterrupt:
        queue.put(("error", "interrupted"))
    except BaseException as exc:  # the parent reports it as the worker's failure
        queue.put(("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
        raise


def evaluate_split(opened, model: str | None, rcfg, tasks: list[TaskData], arms: list[Arm], cfg: EvalConfig,
                   workers: int, threads: int, progress: ProgressFn | None = None) -> dict[str, ArmResults]:
    """``run.evaluate`` over ``workers`` processes (module docstring); arm name -> its merged results.

    Raises:
        OutputError: a result file (or a part) made with other settings or data.
        MoespecError: a worker that failed (its one-line message), after the others' records were merged.
        and what ``run.evaluate`` raises in this process.
    """
    import multiprocessing

    tasks = [limited(t, cfg.limit) for t in tasks]
    files = {a.name: ArmResults.open(cfg.out_dir / f"{a.name}.json", arm_key(a, opened, rcfg, cfg), cfg.fresh)
             for a in arms}
    if cfg.fresh:
        for part in part_dirs(cfg.out_dir):
            shutil.rmtree(part)
    merge_parts(files)  # saves every file: also a fresh one, so the workers below resume, not restart
    done = {n: {t.name: set(f.records(t.name, t.sha256)) for t in tasks} for n, f in files.items()}
    steps = {}
    if progress is not None:
        for a in arms:
            for t in tasks:
                have = sum(str(it.doc_id) in done[a.name][t.name] for it in t.items)
                steps[(a.name, t.name)] = progress(a, t, len(t.items), have)
    parts = shares(tasks, done, workers)
    base = dataclasses.replace(cfg, limit=Limits(), fresh=False)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs, failures = [], []
    for k in range(1, workers):
        if not any(t.items for t in parts[k]):
            continue
        job = WorkerJob(model, rcfg, parts[k], arms, dataclasses.replace(base, out_dir=cfg.out_dir / f"{PART_PREFIX}{k}",
                                                                          fresh=True), threads)
        p = ctx.Process(target=_worker_main, args=(job, queue), name=f"moespec-eval-worker-{k}", daemon=True)
        p.start()
        procs.append(p)
    listening = threading.Event()

    def listen() -> None:  # the workers' items advance the bar; their last word is kept
        finished = 0
        while finished < len(procs):
            what, task = queue.get()
            if what == "done":
                finished += 1
            elif what == "error":
                finished += 1
                failures.append(task)
            elif (what, task) in steps:
                steps[(what, task)]()
        listening.set()

    listener = threading.Thread(target=listen, name="moespec-eval-workers", daemon=True)
    listener.start()
    done_here = False
    try:
        evaluate(opened, rcfg, parts[0], arms, base, (lambda a, t, total, have: steps.get((a.name, t.name)))
                 if progress is not None else None)
        done_here = True
    finally:
        for p in procs:
            # a worker with more of its share left than the parent runs to its end (on a loaded machine
            # it can take minutes longer: CI killed one after 30 s); JOIN_S bounds only the wait after
            # Ctrl-C or an error here
            p.join(None if done_here else JOIN_S)
            if p.is_alive():
                p.terminate()
                p.join()
        listening.wait(1.0 if procs else 0.0)
        files = {a.name: ArmResults.open(cfg.out_dir / f"{a.name}.json", files[a.name].key) for a in arms}
        merge_parts(files)
    if failures or any(p.exitcode for p in procs):
        why = failures[0] if failures else f"exit code {next(p.exitcode for p in procs if p.exitcode)}"
        raise MoespecError(f"--workers: a worker failed ({why})", "run with --workers 1 to see its error in full")
    return files

