"""The parts of `moespec eval` that need no model: vendored task files, line-numbered data errors, the
per-item metrics (and, when lm-eval is installed, its own filters and exact_match on the same texts),
bootstrap intervals and the McNemar test."""

from __future__ import annotations

import json
import math

import pytest

from moespec.errors import DataError, OptionError
from moespec.eval.data import ChoiceItem, GenerateItem, load_task
from moespec.eval.metrics import FLEXIBLE, STRICT, choice_metrics, extract, generate_metrics, normalise
from moespec.eval.stats import mcnemar_p, mean_interval, paired
from moespec.eval.tasks import DEFAULT_TASKS, known_tasks, resolve_tasks

TEXTS = ["So the answer is 18.", "He pays $1,200 in total. The answer is 1200.", "no number here",
         "She has 3 apples and 4.5 pears, so 7.5", "#### 42", "-3 degrees", "answer is 5. Then 6 and 7",
         "The answer is 18.\n\nQuestion: x is 3"]


def test_vendored_tasks_load_with_200_items_each():
    for name in DEFAULT_TASKS:
        task = load_task(name, known_tasks()[name].path)
        assert len(task.items) == 200, name
        kind = GenerateItem if name == "gsm8k" else ChoiceItem
        assert all(isinstance(it, kind) for it in task.items)
    wino = load_task("winogrande", known_tasks()["winogrande"].path).items[0]
    assert wino.contexts[0] != wino.contexts[1] and wino.continuations[0] == wino.continuations[1]
    gsm = load_task("gsm8k", known_tasks()["gsm8k"].path).items[0]
    assert gsm.answer == "18" and "\n\n" in gsm.stops and gsm.context.count("Question:") == 9


def _write(tmp_path, *lines):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _req(**over):
    rec = {"request_type": "loglikelihood", "doc_id": 0, "idx": 0, "label": 0,
           "request": {"context": "Q:", "continuation": " a"}}
    rec.update(over)
    return json.dumps(rec)


@pytest.mark.parametrize("lines, message", [
    ([_req(), "{oops"], "t.jsonl line 2: not JSON"),
    ([_req(), _req(idx=1, request={"context": "Q:"})], "t.jsonl line 2: 'continuation' is missing"),
    ([_req(), _req(idx=2)], "choice idx [0, 2], expected 0..1"),
    ([_req(), _req(idx=1, label=5)], "label [0, 5]"),
    ([_req(), _req(doc_id=1, request_type="generate_until")], "t.jsonl line 2: a generate_until request in a file"),
    ([_req(request_type="rank")], "neither loglikelihood nor generate_until"),
    ([_req(doc_id="0")], "'doc_id' is missing or not int"),
])
def test_malformed_lines_are_named(tmp_path, lines, message):
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_task("t", _write(tmp_path, *lines))


def test_unknown_task_lists_the_known_ones(tmp_path):
    with pytest.raises(OptionError, match="unknown task 'mmlu'; known tasks: arc_easy, boolq, gsm8k, sciq, winogrande"):
        resolve_tasks("arc_easy,mmlu")
    (tmp_path / "mine.jsonl").write_text(_req() + "\n")
    assert [t.name for t in resolve_tasks("mine,boolq,mine", tmp_path)] == ["mine", "boolq"]


def test_choice_metrics_normalise_by_characters_without_the_delimiter():
    # raw: choice 0 wins; per character (" ab" = 2, " abcdef" = 6): choice 1 wins
    m = choice_metrics([-2.0, -3.0], [" ab", " abcdef"], gold=1)
    assert m == {"acc": 0.0, "acc_norm": 1.0}
    assert choice_metrics([-1.0, -1.0], [" a", " b"], gold=0)["acc"] == 1.0  # ties: the first, as numpy


def test_generate_metrics():
    assert generate_metrics("So the answer is 18.", "18")["exact_match,strict-match"] == 1.0
    m = generate_metrics("He pays $1,200 in total. The answer is 1200.", "1200")
    assert m["exact_match,flexible-extract"] == 1.0 and m["exact_match,strict-match"] == 1.0
    assert generate_metrics("no number here", "3")["extracted"] == "[invalid]"
    assert normalise("$1,200.") == "1200"


def test_extraction_equals_lm_evals_filters_and_exact_match():
    pytest.importorskip("lm_eval")
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    for pattern, last in ((FLEXIBLE, True), (STRICT, False)):
        theirs = RegexFilter(pattern.pattern, group_select=-1 if last else 0).apply([[t] for t in TEXTS], None)
        assert [r[0] for r in theirs] == [extract(t, pattern, last) for t in TEXTS]
    refs = ["18", "1,200", "3", "7.5", "42", "-3", "5", "18"]
    for text, ref in zip(TEXTS, refs):
        want = exact_match_hf_evaluate([extract(text, FLEXIBLE, True)], [ref], ignore_case=True,
                                       regexes_to_ignore=[",", "\\$", "(?s).*#### ", "\\.$"])["exact_match"]
        assert generate_metrics(text, ref)["exact_match,flexible-extract"] == want, text


def test_mcnemar_and_intervals():
    assert mcnemar_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_p(3, 3) == 1.0 and mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(10, 2) == pytest.approx(2 * sum(math.comb(12, i) for i in range(3)) / 2**12)
    iv = mean_interval([1, 0] * 50)
    assert iv.value == 0.5 and 0.39 < iv.low < 0.41 and 0.59 < iv.high < 0.61  # ~ ±1.96·0.05
    assert mean_interval([1, 0] * 50) == iv  # a fixed seed: the same interval every time
    exact, arm = [1] * 20 + [0] * 20, [1] * 14 + [0] * 6 + [1] * 2 + [0] * 18
    d = paired(arm, exact)
    assert (d.gained, d.lost) == (2, 6) and d.delta.value == pytest.approx(-0.1)
    assert d.p_value == pytest.approx(mcnemar_p(2, 6)) and d.delta.low < -0.1 < d.delta.high  # p 0.29: the CI holds 0
    assert d.delta.high > 0
    assert paired([0.5, 0.25], [0.5, 0.5]).p_value > 0  # non-binary scores: the sign-flip test
