import json

import pytest

from draftheads.errors import DraftheadsError
from draftheads.prompts import DOMAINS, load_prompts, read_prompts


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bundled_sets_cover_domains_and_never_overlap():
    train, ev = load_prompts("bundled:train"), load_prompts("bundled:eval")
    for split in (train, ev):
        assert len({p.id for p in split}) == len(split)
    assert not {p.id for p in train} & {p.id for p in ev}
    norm = lambda p: " ".join(" ".join(p.turns).lower().split())  # noqa: E731
    assert not {norm(p) for p in train} & {norm(p) for p in ev}
    for d in ("chat", "code", "math", "summarization", "translation", "qa"):
        n_train = sum(p.domain == d for p in train)
        n_eval = sum(p.domain == d for p in ev)
        assert n_train + n_eval >= 40 and n_eval >= 10, (d, n_train, n_eval)


def test_project_form(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"id": "a", "domain": "code", "turns": ["write x", "now y"]}])
    (p,) = read_prompts(f)
    assert (p.id, p.domain, p.turns, p.source) == ("a", "code", ("write x", "now y"), "project")


def test_spec_bench_form(tmp_path):
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["t1", "t2"]},
        {"question_id": 2, "category": "translation", "turns": ["tr"]},
        {"question_id": 3, "category": "math_reasoning", "turns": ["m"]},
        {"question_id": 4, "category": "rag", "turns": ["r"], "reference": ["x"]},
        {"question_id": 5, "category": "summarization", "turns": ["s"]},
        {"question_id": 6, "category": "qa", "turns": ["q"]},
    ]
    got = read_prompts(_write(tmp_path / "q.jsonl", rows))
    assert [p.domain for p in got] == ["chat", "translation", "math", "rag", "summarization", "qa"]
    assert got[0].turns == ("t1", "t2") and got[0].source == "spec_bench"
    assert set(p.domain for p in got) <= set(DOMAINS)


def test_gsm8k_form(tmp_path):
    f = _write(tmp_path / "gsm.jsonl", [{"question": "2+2?", "answer": "4\n#### 4"}])
    (p,) = read_prompts(f)
    assert (p.domain, p.turns, p.reference, p.id) == ("math", ("2+2?",), ("4\n#### 4",), "gsm-1")


def test_humaneval_form(tmp_path):
    row = {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "  return x", "test": "", "entry_point": "f"}
    (p,) = read_prompts(_write(tmp_path / "he.jsonl", [row]))
    assert p.domain == "code" and p.id == "HumanEval/0" and "def f(x):" in p.turns[0]


def test_unknown_field_is_named(tmp_path):
    f = _write(tmp_path / "bad.jsonl", [{"id": "a", "domain": "code", "turns": ["x"], "colour": "red"}])
    with pytest.raises(DraftheadsError, match=r"bad.jsonl:1: unknown field\(s\) \['colour'\]"):
        read_prompts(f)


def test_unrecognised_form_and_bad_domain(tmp_path):
    with pytest.raises(DraftheadsError, match="match no prompt form"):
        read_prompts(_write(tmp_path / "a.jsonl", [{"text": "hello"}]))
    with pytest.raises(DraftheadsError, match="domain 'poetry' is unknown"):
        read_prompts(_write(tmp_path / "b.jsonl", [{"id": "a", "domain": "poetry", "turns": ["x"]}]))


def test_limit_and_domains():
    got = load_prompts("bundled:eval", domains=["math", "code"], limit_per_domain=2)
    assert [p.domain for p in got].count("math") == 2 and len(got) == 4
