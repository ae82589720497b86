"""The lm-evaluation-harness model ``moespec`` against lm-eval's own ``hf`` model, offline, on local tasks.

A multiple-choice task (per document: the same log-likelihoods within 1e-4, the same acc/acc_norm) and
a greedy generation task (the same text) on a tiny model in exact mode; in speculative mode the scores
move. Skipped without lm-eval (`pip install "moespec[eval]"`): see pyproject.toml's eval extra.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from lm_eval_tasks import per_doc, run_lm_eval, write_choice_task, write_generate_task  # noqa: E402

from moespec.eval.data import ChoiceItem  # noqa: E402

ITEMS = [ChoiceItem(0, ("Question: 2+2?\nAnswer:",) * 3, (" 5", " 4", " four"), 1),
         ChoiceItem(1, ("Is the sky blue?\nAnswer:",) * 2, (" yes", " no"), 0),
         ChoiceItem(2, ("Pick a letter:",) * 4, (" a", " bb", " ccc", " d"), 3)]
DOCS = [{"context": "Q: 1+1?\nA:", "answer": "2"}, {"context": "Once upon", "answer": "x"}]


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    write_choice_task(folder, "tiny_mc", ITEMS)
    return write_generate_task(folder, "tiny_gen", DOCS, until=["\n\n"], max_gen_toks=8)


def test_moespec_model_equals_hf_model(tiny_models, local_tasks, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tiny_models["qwen3_moe"]
    tasks = ["tiny_mc", "tiny_gen"]
    hf = run_lm_eval("hf", f"pretrained={folder},dtype=float32", local_tasks, tasks)
    theirs_mc = per_doc(hf, "tiny_mc")
    for path in ("prefill",):  # decode: equal to it and to transformers (test_eval_score.py)
        ours = run_lm_eval("moespec", f"pretrained={folder},execute=exact,predictor=router,cache_experts=5,"
                           f"exact_path={path}", local_tasks, tasks)
        ours_mc = per_doc(ours, "tiny_mc")
        assert sorted(ours_mc) == [0, 1, 2]
        for doc_id, want in theirs_mc.items():
            got = ours_mc[doc_id]
            for (lp_want, greedy_want), (lp_got, greedy_got) in zip(
                    [r[0] for r in want["resps"]], [r[0] for r in got["resps"]]):
                assert abs(float(lp_got) - float(lp_want)) < 1e-4 and greedy_got == greedy_want
            assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"])
        assert [s["resps"] for s in per_doc(ours, "tiny_gen").values()] == \
            [s["resps"] for s in per_doc(hf, "tiny_gen").values()]

    spec = run_lm_eval("moespec", f"pretrained={folder},execute=speculative,predictor=router",
                       local_tasks, ["tiny_mc"])
    moved = [abs(float(a[0][0]) - float(b[0][0])) for d in theirs_mc
             for a, b in zip(per_doc(spec, "tiny_mc")[d]["resps"], theirs_mc[d]["resps"])]
    assert max(moved) > 1e-3  # speculative execution acts on the scored tokens


def test_unknown_model_arg_is_refused(tiny_models):
    from moespec.errors import OptionError
    from moespec.harness.model import MoespecLM

    with pytest.raises(OptionError, match="unknown argument 'cache_expert'"):
        MoespecLM(pretrained=str(tiny_models["qwen3_moe"]), cache_expert=4)
