import json

import pytest

from draftheads.datagen.synthesize import (
    Deduper,
    SynthConfig,
    distinct_n,
    is_request,
    markdown,
    synthesize,
    user_prefix,
)
from draftheads.errors import DraftheadsError
from draftheads.prompts import read_prompts


def test_user_prefix_is_the_template_up_to_the_user_text(tiny_target):
    tok = tiny_target.tokenizer
    assert user_prefix(tok, []) == "<|im_start|>user\n"
    hist = [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "b."}]
    assert user_prefix(tok, hist).endswith("b.<|im_end|>\n<|im_start|>user\n")


def test_request_filter_and_diversity():
    assert is_request("Write a Python function that sorts a list.")
    assert is_request("my cat keeps sneezing, is that normal?")
    assert not is_request("Sure! Here is the function you asked for.")
    assert not is_request("The weather was nice and we walked home.")
    assert distinct_n(["a b c", "a b d"], 1) == 4 / 6
    assert distinct_n(["a b c", "a b c"], 3) == 0.5


def test_the_stats_table_names_every_domain_with_its_rejections_most_first():
    row = {"kept": 3, "candidates": 9, "rejected": {"unfinished": 1, "quota_full": 5}, "near_dup_rate": 0.25,
           "distinct_1": 0.5, "distinct_2": 0.75, "distinct_3": 1.0, "mean_words": 12.0, "multi_turn": 1,
           "sample": ["Is a | b the same as\nb | a? " + "x" * 200]}
    table = markdown({"total": 3, "settings": {"target": "t", "seed": 0}, "domains": {"qa": row}})
    lines = table.splitlines()
    assert lines[0] == "3 prompts kept (target t, seed 0)" and len(lines) == 5
    cells = lines[4].split(" | ")
    assert cells[:3] == ["| qa", "3 / 9", "quota_full 5, unfinished 1"]
    assert cells[3:8] == ["0.250", "0.500", "0.750", "1.000", "12.0"]
    assert lines[4].startswith("| qa |") and "a \\| b the same as b \\| a?" in lines[4]
    assert lines[4].endswith('…" |') and len(lines[4].split('"')[1]) == 117 + 1 + 2  # cut, the ellipsis, two escapes


def test_deduper_catches_exact_and_near_duplicates():
    d = Deduper(threshold=0.7)
    base = "Write a Python function that takes a list of strings and returns the frequency of each unique string"
    assert d.check(base) is None
    assert d.check(base.upper() + "  ") == "exact_dup"
    assert d.check(base + " in the list") == "near_dup"
    assert d.check("What is the capital city of France and why is it famous?") is None


def test_synthesize_on_the_tiny_target_and_resume(tiny_llama_dir, tmp_path, monkeypatch):
    from draftheads.targets import load_target

    tiny_target = load_target(str(tiny_llama_dir))
    # a random model rarely ends a turn: let a third of its vocabulary end one, so turns finish
    tiny_target.model.generation_config.eos_token_id = list(range(2, tiny_target.info.vocab_size, 3))
    cfg = SynthConfig(num_prompts=6, domains=("chat", "summarization"), round_size=8, max_prompt_tokens=12,
                      passage_tokens=16, answer_tokens=8, min_words=1, multi_turn=0.5, batch_size=4)
    # a random target writes no real requests; the filter must be what decides, so accept everything here
    monkeypatch.setattr("draftheads.datagen.synthesize.is_request", lambda t: True)
    out = synthesize(tiny_target, tmp_path / "p.jsonl", cfg, progress=lambda m: None)
    prompts = read_prompts(out)
    assert len(prompts) == 6 and {p.domain for p in prompts} == {"chat", "summarization"}
    assert len({p.id for p in prompts}) == 6 and len({p.turns[0].lower() for p in prompts}) == 6
    assert all(len(p.turns[0].split()) >= 1 for p in prompts)
    assert any(p.turns[0].startswith(("Summarize", "Give a one-sentence", "What is the main")) or
               "Summarize" in p.turns[0] or "summary" in p.turns[0] for p in prompts if p.domain == "summarization")
    stats = json.loads((tmp_path / "p.jsonl.stats.json").read_text())
    assert stats["total"] == 6 and set(stats["domains"]) == {"chat", "summarization"}
    for s in stats["domains"].values():
        assert s["kept"] == 3 and s["candidates"] >= 3 and 0 <= s["distinct_1"] <= 1
    assert [r.split(" | ")[:2] for r in markdown(stats).splitlines()[4:]] == [
        ["| chat", f"3 / {stats['domains']['chat']['candidates']}"],
        ["| summarization", f"3 / {stats['domains']['summarization']['candidates']}"]]
    # resume: a rerun of an interrupted run continues after its last finished round
    out2 = tmp_path / "q.jsonl"
    from draftheads.datagen import synthesize as mod

    real = mod.Synthesizer.round
    calls = {"n": 0}

    def die_on_second(self, r, wanted):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, r, wanted)

    monkeypatch.setattr(mod.Synthesizer, "round", die_on_second)
    cfg2 = SynthConfig(**{**cfg.__dict__, "num_prompts": 12})
    with pytest.raises(KeyboardInterrupt):
        synthesize(tiny_target, out2, cfg2, progress=lambda m: None)
    first = (tmp_path / "q.jsonl.partial").read_text().splitlines()
    assert first
    monkeypatch.setattr(mod.Synthesizer, "round", real)
    synthesize(tiny_target, out2, cfg2, progress=lambda m: None)
    lines = out2.read_text().splitlines()
    assert lines[: len(first)] == first and len(lines) == 12
    assert len({json.loads(x)["id"] for x in lines}) == 12


def test_extend_grows_a_finished_file_with_new_rounds(tiny_llama_dir, tmp_path, monkeypatch):
    from draftheads.targets import load_target

    target = load_target(str(tiny_llama_dir))
    target.model.generation_config.eos_token_id = list(range(2, target.info.vocab_size, 3))
    monkeypatch.setattr("draftheads.datagen.synthesize.is_request", lambda t: True)
    cfg = SynthConfig(num_prompts=4, domains=("chat", "qa"), round_size=4, max_prompt_tokens=12, min_words=1,
                      multi_turn=0.0, batch_size=4)
    out = synthesize(target, tmp_path / "p.jsonl", cfg, progress=lambda m: None)
    first = out.read_text().splitlines()
    rounds = json.loads((tmp_path / "p.jsonl.stats.json").read_text())["rounds"]
    bigger = SynthConfig(**{**cfg.__dict__, "num_prompts": 8})
    with pytest.raises(DraftheadsError, match="--extend"):
        synthesize(target, out, bigger, progress=lambda m: None)
    with pytest.raises(DraftheadsError, match="other settings.*to extend it"):
        synthesize(target, out, SynthConfig(**{**bigger.__dict__, "max_prompt_tokens": 13}), progress=lambda m: None,
                   extend=True)
    with pytest.raises(DraftheadsError, match="only grows"):
        synthesize(target, out, SynthConfig(**{**cfg.__dict__, "num_prompts": 2}), progress=lambda m: None,
                   extend=True)
    assert out.read_text().splitlines() == first
    seen = []
    real = synthesize.__globals__["Synthesizer"].round
    monkeypatch.setattr(synthesize.__globals__["Synthesizer"], "round",
                        lambda self, r, wanted: seen.append(r) or real(self, r, wanted))
    synthesize(target, out, bigger, progress=lambda m: None, extend=True)
    lines = out.read_text().splitlines()
    prompts = read_prompts(out)
    assert lines[: len(first)] == first and len(prompts) == 8
    assert len({p.id for p in prompts}) == 8 and len({p.turns[0].lower() for p in prompts}) == 8
    assert seen and min(seen) == rounds  # new rounds, not a replay of the first file's
    stats = json.loads((tmp_path / "p.jsonl.stats.json").read_text())
    assert stats["total"] == 8 and {d: s["kept"] for d, s in stats["domains"].items()} == {"chat": 4, "qa": 4}
    assert not list(tmp_path.glob("p.jsonl.partial*"))


def test_synthesize_needs_a_chat_template(tmp_path):
    from draftheads.targets import load_target
    from draftheads.testing import save_tiny_llama

    target = load_target(str(save_tiny_llama(tmp_path / "m", chat_template=False)))
    with pytest.raises(DraftheadsError, match="no chat template"):
        synthesize(target, tmp_path / "p.jsonl", SynthConfig(num_prompts=2), progress=lambda m: None)
    assert not list(tmp_path.glob("p.jsonl*"))
    with pytest.raises(DraftheadsError, match="--domains"):
        SynthConfig(domains=("poetry",))


def test_cut_passages_end_at_a_sentence():
    from draftheads.datagen.synthesize import _whole_sentences

    assert _whole_sentences("One. Two three! Four fi") == "One. Two three!"
    assert _whole_sentences("Pi is 3.14 here. And then") == "Pi is 3.14 here."
    assert _whole_sentences("no end at all") == ""
