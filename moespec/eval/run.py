"""Running an evaluation: every arm on the same items of every task, on one loaded model.

Arms run one after the other (``use_arm`` switches the runner); each item starts from an empty
expert cache (``cold_start``), so its score depends only on the item and the arm. The KV cache keeps
prefilled positions between items (a few-shot prompt shared by every GSM8K item is prefilled once):
those are exact in every mode, so reusing them changes nothing but float rounding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from moespec.config import ExecuteMode, OnMiss, SamplingConfig
from moespec.errors import DataError
from moespec.eval.arms import Arm, cold_start, gated, use_arm
from moespec.eval.data import ChoiceItem, GenerateItem, TaskData
from moespec.eval.drafted import drafted_greedy
from moespec.eval.metrics import choice_metrics, generate_metrics
from moespec.eval.results import ArmResults
from moespec.eval.score import DecodeScorer, PrefillScorer, decode_prefix, encode, encode_pair, leave_two
from moespec.eval.shared_prefix import scorer_for
from moespec.runtime.engine import common_prefix

# lm-eval's default generation limit (HFLM max_gen_toks); a task's own smaller limit wins.
DEFAULT_MAX_GEN_TOKS = 256


@dataclass(frozen=True)
class Limits:
    """``--limit``: the first N items of every task (None: all), except the tasks given their own N."""

    default: Optional[int] = None
    per_task: tuple[tuple[str, int], ...] = ()

    def of(self, task: str) -> Optional[int]:
        """The limit of ``task``."""
        return dict(self.per_task).get(task, self.default)


@dataclass(frozen=True)
class EvalConfig:
    """What an evaluation runs and where it keeps its results.

    Attributes:
        out_dir: folder of the per-arm result files (created).
        limit: how many items of each task (the first ones).
        max_gen_toks: most generated tokens per generation item.
        fresh: ignore (and overwrite) the saved results.
        exact_path: how the exact arm scores choices: "prefill" (each choice in one forward, score.PrefillScorer)
            or "decode" (one token per step, as every other arm); equal within 1e-4 in float32 (tested).
        item_major: every arm scores an item before the next item starts, sharing its tokenisation and
            context prefill (``run_arms``); False: one arm after the other (``run_arm``, the reference).
    """

    out_dir: Path
    limit: Limits = Limits()
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    fresh: bool = False
    exact_path: str = "prefill"
    item_major: bool = True


# progress(arm, task, total items, items already done) at a task's start; the returned callable is
# called after each item.
ProgressFn = Callable[[Arm, TaskData, int, int], Callable[[], None]]


def limited(task: TaskData, limits: Limits) -> TaskData:
    """``task`` with only its first ``limits.of(task)`` items."""
    n = limits.of(task.name)
    return task if n is None else TaskData(task.name, task.kind, task.items[:n], task.source, task.sha256)


def generate_text(engine, tokenizer, context: str, stops: tuple[str, ...], max_gen_toks: int,
                  stop_ids: set[int]) -> tuple[str, int]:
    """Greedy text after ``context`` up to the first stop string (not included), an end id or
    ``max_gen_toks`` tokens, as lm-eval's generate_until returns it; (text, tokens generated).

    Afterwards the KV cache holds only the prompt (prefilled, exact in every mode).
    """
    text, out = generate_ids(engine, tokenizer, context, stops, max_gen_toks, stop_ids)
    return text, len(out)


def generate_ids(engine, tokenizer, context: str, stops: tuple[str, ...], max_gen_toks: int, stop_ids: set[int],
                 drafts: Sequence[Sequence[int]] | None = None) -> tuple[str, list[int]]:
    """``generate_text``'s (text, generated token ids); with ``drafts`` (exact mode only) the tokens come
    from ``drafted.drafted_greedy`` checking them, else from ``Engine.generate``: the same greedy text."""
    ids = encode(tokenizer, context)
    leave_two(engine, ids)  # the prompt's last positions from an exact prefill, not a decode step
    # A stop string that appears ends in the newest token and spans at most 4 bytes (tokens) per
    # character: decoding that tail each step finds it without decoding the whole text again.
    tail = 4 * max((len(s) for s in stops), default=0) + 2
    out: list[int] = []
    tokens = (engine.generate(ids, SamplingConfig(max_new_tokens=max_gen_toks), stop_ids) if drafts is None
              else drafted_greedy(engine, ids, max_gen_toks, stop_ids, drafts))
    for tok in tokens:
        out.append(tok)
        if stops and any(s in tokenizer.decode(out[-tail:], skip_special_tokens=True) for s in stops):
            break
    text = tokenizer.decode(out, skip_special_tokens=True)
    for s in stops:  # lm-eval cuts at each stop string in turn
        text = text.split(s)[0]
    engine.truncate(len(ids))
    return text, out


def choice_pairs(tokenizer, item: ChoiceItem, task: TaskData, limit: int) -> list[tuple[list[int], list[int]]]:
    """The (context ids, continuation ids) of each choice of ``item``, tokenised as lm-eval does.

    Raises:
        DataError: a choice longer than ``limit`` tokens (the model's context), or whose continuation
            encodes to no token.
    """
    try:
        pairs = [encode_pair(tokenizer, c, t) for c, t in zip(item.contexts, item.continuations)]
    except ValueError as exc:
        raise DataError(f"{task.name} doc_id {item.doc_id}: {exc}", "fix or drop that request line") from None
    if max(len(c) + len(t) for c, t in pairs) > limit:
        raise DataError(f"{task.name} doc_id {item.doc_id} is longer than the model's context of {limit} tokens",
                        "drop that document, or use --limit to stop before it")
    return pairs


def choice_record(scorer: DecodeScorer, pairs, item: ChoiceItem) -> dict:
    """One multiple-choice item's record: log-likelihoods, greedy flags, acc and acc_norm."""
    scores = scorer.score(pairs)
    lps = [s.logprob for s in scores]
    return {"logprobs": lps, "greedy": [s.greedy for s in scores], "gold": item.gold,
            **choice_metrics(lps, item.continuations, item.gold)}


def generate_record(engine, tokenizer, item: GenerateItem, max_gen_toks: int, stop_ids: set[int],
                    pool: list[list[int]] | None = None, drafted: bool = False) -> dict:
    """One generation item's record: the text, its token count and the exact matches.

    ``pool``: the token ids the item's arms generated so far; this arm's are added. ``drafted`` (the
    exact arm only): generate by checking the pool's texts in prefills (drafted.py), the same text.

    Raises:
        PromptError: a prompt beyond the model's context.
    """
    most = min(max_gen_toks, item.max_gen_toks or max_gen_toks)
    text, out = generate_ids(engine, tokenizer, item.context, item.stops, most, stop_ids,
                             list(pool or ()) if drafted else None)
    if pool is not None:
        pool.append(out)
    return {"text": text, "tokens": len(out), "answer": item.answer, **generate_metrics(text, item.answer)}


def score_item(scorer: DecodeScorer, tokenizer, item, task: TaskData, max_gen_toks: int, stop_ids: set[int]) -> dict:
    """One item's record under the arm ``scorer``'s engine runs now (choice_record / generate_record).

    Raises:
        DataError: a choice longer than the model's context, or whose continuation encodes to no token.
        PromptError: a generation prompt beyond the model's context.
    """
    engine = scorer.engine
    if isinstance(item, ChoiceItem):
        return choice_record(scorer, choice_pairs(tokenizer, item, task, engine.om.max_context()), item)
    assert isinstance(item, GenerateItem)
    return generate_record(engine, tokenizer, item, max_gen_toks, stop_ids)


def residency_matters(arm: Arm, on_miss: OnMiss) -> bool:
    """Whether an arm's outputs depend on which experts are resident: guarded (what a light miss runs),
    and every arm whose misses may run on the host (``--on-miss host|auto``: a timed choice). Exact and
    speculative with ``--on-miss fetch`` fetch every expert they run, so residency changes only time."""
    return arm.execute == ExecuteMode.GUARDED or on_miss != OnMiss.FETCH


@dataclass
class _ArmRun:
    """One arm's part of an item-major run: its predictor, scorer and results."""

    arm: Arm
    predictor: object
    scorer: DecodeScorer
    results: ArmResults
    gate: bool = True  # the loaded prediction-gate setting (arms.gated decides per arm)


def run_item(opened, runs: list[_ArmRun], item, task: TaskData, cfg: EvalConfig, stop_ids: set[int],
             steps: dict[str, Callable[[], None]]) -> None:
    """Score ``item`` under every arm of ``runs`` (those that lack it), sharing what is exact in every mode.

    A multiple-choice item is tokenised once and its context prefilled once (from an empty expert
    cache, ``cold_start``) for every decode-path arm: the first arm prefills it, the next find those
    keys/values cached (DecodeScorer._context). The first arm is one whose outputs depend on residency
    (``residency_matters``) if any, so it sees the cache exactly as an arm run alone would; any later
    such arm starts again from an empty cache and the same cached prefix. The exact prefill-path arm
    goes last and prefills only the context's last two tokens (score.prefill_exact: its logits come
    from a prefill, as alone; equal within float rounding). A generation item's prompt is
    prefilled likewise once (the next arms re-run only its last two tokens, leave_two: its last
    logits come from a prefill, as alone), and each arm generates from there; the exact prefill-path
    arm, last, checks the texts the arms before it generated in prefills (drafted.py: the same text).
    Each arm's record goes to its results; ``steps[arm name]`` advances its progress.
    """
    om, engine, tokenizer = opened.engine.om, opened.engine, opened.tokenizer
    on_miss = om.policy.on_miss
    runs = sorted(runs, key=lambda r: (not residency_matters(r.arm, on_miss), isinstance(r.scorer, PrefillScorer)))
    if isinstance(item, ChoiceItem):
        pairs = choice_pairs(tokenizer, item, task, om.max_context())
        prefix = decode_prefix(pairs)
    else:
        pairs, prefix = None, encode(tokenizer, item.context)
    pool: list[list[int]] = []  # the generated ids of the arms before (the exact prefill-path arm checks them)
    keep = common_prefix(engine.cached_ids, prefix)  # what the item before left that this one reuses
    for i, run in enumerate(runs):
        t0 = time.perf_counter()
        use_arm(om, run.arm, run.predictor, run.gate)
        alone = i == 0 or residency_matters(run.arm, on_miss)  # the cache as if it ran alone
        if alone:
            cold_start(om)
        if alone and i > 0:
            engine.truncate(keep)  # its own prefill, from the prefix an arm alone would find cached
        if pairs is None:
            record = generate_record(engine, tokenizer, item, cfg.max_gen_toks, stop_ids, pool,
                                     drafted=isinstance(run.scorer, PrefillScorer))
        else:
            record = choice_record(run.scorer, pairs, item)
        run.results.add(task.name, item.doc_id, record, time.perf_counter() - t0)
        step = steps.get(run.arm.name)
        if step is not None:
            step()


def run_arms(opened, runs: list[_ArmRun], tasks: list[TaskData], cfg: EvalConfig, stop_ids: set[int],
             progress: Optional[ProgressFn] = None) -> None:
    """Score every item of ``tasks`` that some arm of ``runs`` lacks, item by item (``run_item``);
    saves every arm's results at the end (also when interrupted)."""
    om = opened.engine.om
    try:
        for task in tasks:
            done = {r.arm.name: r.results.records(task.name, task.sha256) for r in runs}
            steps = {}
            for r in runs:
                left = sum(str(it.doc_id) not in done[r.arm.name] for it in task.items)
                if progress is not None:
                    steps[r.arm.name] = progress(r.arm, task, len(task.items), len(task.items) - left)
            for item in task.items:
                todo = [r for r in runs if str(item.doc_id) not in done[r.arm.name]]
                if todo:
                    run_item(opened, todo, item, task, cfg, stop_ids, steps)
    finally:
        om.reset_step()
        for r in runs:
            r.results.save()


def run_arm(opened, arm: Arm, predictor, tasks: list[TaskData], results: ArmResults, cfg: EvalConfig,
            stop_ids: set[int], progress: Optional[ProgressFn] = None, gate: bool = True) -> None:
    """Score every item of ``tasks`` that ``results`` lacks, as ``arm`` alone (the arm-by-arm reference
    of ``run_arms``); saves ``results`` at the end (also when interrupted)."""
    om = opened.engine.om
    use_arm(om, arm, predictor, gate)
    scorer = scorer_for(opened.engine, arm.execute, cfg.exact_path)
    try:
        for task in tasks:
            done = results.records(task.name, task.sha256)
            todo = [it for it in task.items if str(it.doc_id) not in done]
            step = progress(arm, task, len(task.items), len(task.items) - len(todo)) if progress else None
            for item in todo:
                cold_start(om)
                t0 = time.perf_counter()
                record = score_item(scorer, opened.tokenizer, item, task, cfg.max_gen_toks, stop_ids)
                results.add(task.name, item.doc_id, record, time.perf_counter() - t0)
                if step is not None:
                    step()
    finally:
        om.reset_step()
        results.save()


def arm_key(arm: Arm, opened, rcfg, cfg: EvalConfig) -> dict:
    """What an arm's records depend on (ArmResults refuses a file made with another key).

    Exact records depend only on the model, its dtypes, the scoring path and the generation limit; the other arms also
    on the predictor, τ, the guard rule and the cache (what is resident decides what a guarded token
    skips), and on ``contexts``: "exact" since no cached context position comes from a one-token
    forward (score.prefill_exact; files made before lack it and are refused).
    """
    from moespec.artifacts import model_key
    from moespec.predict.calibration_file import config_hash

    om = opened.engine.om
    key = {"model": model_key(opened.path), "config": config_hash(om.config), "dtype": str(om.dtype),
           "expert_dtype": rcfg.expert_dtype, "group_size": rcfg.group_size, "execute": arm.execute.value,
           "max_gen_toks": cfg.max_gen_toks}
    if arm.execute == ExecuteMode.EXACT:
        key["path"] = cfg.exact_path
    else:
        key.update(predictor=arm.predictor.value, fetch_threshold=arm.threshold, guard_rule=rcfg.guard_rule.value,
                   cache_slots=om.cache.num_slots, cache_policy=om.cache.policy.value,
                   calibration=rcfg.calibration_path, estimator=rcfg.estimator_path, contexts="exact",
                   prediction_gate=gated(arm, rcfg.prediction_gate))
    return key


def evaluate(opened, rcfg, tasks: list[TaskData], arms: list[Arm], cfg: EvalConfig,
             progress: Optional[ProgressFn] = None) -> dict[str, ArmResults]:
    """Run ``arms`` (exact first) on the first ``cfg.limit`` items of each task; arm name -> its results.

    Every arm's file is opened (and a stale one refused) before the first item runs.

    Raises:
        OutputError: a result file that is unreadable or was made with other settings or data.
        DataError, PromptError: an item that cannot be scored (score_item).
        OptionError, CalibrationError: a predictor that cannot be built.
    """
    import dataclasses

    from moespec.chat.render import stop_ids
    from moespec.predict.factory import make_predictor

    om = opened.engine.om
    tasks = [limited(t, cfg.limit) for t in tasks]
    files = {a.name: ArmResults.open(cfg.out_dir / f"{a.name}.json", arm_key(a, opened, rcfg, cfg), cfg.fresh)
             for a in arms}
    for a in arms:  # a task whose data changed is refused now, not after the arms before it ran
        for t in tasks:
            files[a.name].records(t.name, t.sha256)
    refs = om.layer_refs()
    made = {}
    for p in dict.fromkeys(a.predictor for a in arms):
        made[p] = make_predictor(p, om.adapter, refs, dataclasses.replace(rcfg, predictor=p), opened.path)
    stops = stop_ids(opened.path, om.config, opened.tokenizer)
    if cfg.item_major:
        runs = [_ArmRun(a, made[a.predictor], scorer_for(opened.engine, a.execute, cfg.exact_path), files[a.name],
                        rcfg.prediction_gate) for a in arms]
        run_arms(opened, runs, tasks, cfg, stops, progress)
    else:
        for a in arms:
            run_arm(opened, a, made[a.predictor], tasks, files[a.name], cfg, stops, progress, rcfg.prediction_gate)
    return files
