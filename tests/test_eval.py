import json

import pytest
import torch

from draftheads.cli import main


def test_eval_on_spec_bench_and_gsm8k_fixtures(tiny_llama_dir, tmp_path, capsys):
    sb = tmp_path / "question.jsonl"
    sb.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question_id": 1, "category": "writing", "turns": ["Write a line about foxes.", "Now shorter."]},
        {"question_id": 2, "category": "translation", "turns": ["Translate into French: good morning"]},
        {"question_id": 3, "category": "qa", "turns": ["What is 12 plus 30?"]},
    ]))
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "What is 2 plus 2?", "answer": "4\n#### 4"}) + "\n")
    out = tmp_path / "eval"
    assert main(["eval", "--target", str(tiny_llama_dir), "--proposer", "ngram", "--prompts", str(sb), str(gsm),
                 "--max-new-tokens", "12", "--tree", "chain3,chain5", "--out", str(out)]) == 0
    full = json.loads((out / "results.json").read_text())
    assert list(full["modes"]) == ["chain3", "chain5"] and full["tree"] == ["chain3", "chain5"]
    assert full["modes"]["chain3"]["overall"]["tokens_per_s_plain"] > 0
    res = {**full, **full["modes"]["chain5"]}
    assert set(res["domains"]) == {"chat", "translation", "qa", "math"}
    assert res["domains"]["chat"]["n_prompts"] == 1
    assert res["overall"]["greedy_mismatches"] == 0
    for key in ("tau", "speedup", "greedy_mismatches"):
        assert key in res["overall"]
    for d in res["domains"].values():
        assert {"tau", "alpha", "speedup", "n_prompts"} <= set(d)
    assert res["command"].startswith("draftheads eval") and res["machine"]["torch"]
    for png in ("alpha_by_position.png", "tau_by_domain.png", "speedup_by_domain.png"):
        assert (out / png).stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "| chain3 | **overall** |" in md and "| chain5 | **overall** |" in md


def test_walk_on_tiny_target_counts_what_eval_counts(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "domain": "chat", "turns": ["Say hi to the fox.", "Again."]},
        {"id": "b", "domain": "qa", "turns": ["What is 1 plus 1?"]}]))
    common = ["--target", str(tiny_llama_dir), "--proposer", "ngram", "--prompts", str(prompts),
              "--max-new-tokens", "10", "--tree", "chain3,chain5"]
    assert main(["walk", *common, "--batch-size", "2", "--out", str(tmp_path / "walk")]) == 0
    assert main(["eval", *common, "--out", str(tmp_path / "eval")]) == 0
    walk = json.loads((tmp_path / "walk" / "results.json").read_text())
    ev = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert walk["kind"] == "walk" and walk["command"].startswith("draftheads walk")
    for mode in ("chain3", "chain5"):
        w, e = walk["modes"][mode], ev["modes"][mode]
        assert w["overall"]["drafts"] == e["overall"]["drafts"] and w["overall"]["tau"] == e["overall"]["tau"]
        assert {d: v["tau"] for d, v in w["domains"].items()} == {d: v["tau"] for d, v in e["domains"].items()}
    assert "| chain5 |" in (tmp_path / "walk" / "results.md").read_text()


def test_bench_parts_on_tiny_target(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "domain": "chat", "turns": ["Say hi to the fox."]}) + "\n")
    assert main(["bench", "--target", str(tiny_llama_dir), "--prompts", str(prompts), "--only", "verify,proposers,batch",
                 "--max-new-tokens", "6",
                 "--batch-tokens", "4", "--batches", "1,2", "--repeats", "1", "--limit-per-domain", "1",
                 "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["verify_curve"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert {"plain", "hf_generate", "hf_prompt_lookup", "ngram (auto)"} <= set(res["proposers"])
    assert res["proposers"]["plain"]["ratio_vs_plain"] == 1.0
    assert set(res["batch_sweep"]["ngram (auto)"]) == {"1", "2"}
    for m in ("plain (again)", "ngram (auto)"):  # float32: speculation decodes plain decoding's text
        assert (res["proposers"][m]["same_text"], res["proposers"][m]["shared_prefix"]) == (1, 1.0)
        assert res["proposers"][m]["flips"] == 0  # every engine followed plain's text, which is its own here
    assert all(cell["flips"] == 0 for cell in res["batch_sweep"]["ngram (auto)"].values())
    assert all(cell["auto"]["steps"] >= 1 for cell in res["batch_sweep"]["ngram (auto)"].values())  # auto's report
    md = (out / "results.md").read_text()
    assert "ngram (auto), steps of batch 2:" in md
    # a drafted step's seconds against a plain one's, in the same engine and in the plain engine
    assert all(cell["auto"]["plain_engine_seconds_per_step"] > 0 for cell in res["batch_sweep"]["ngram (auto)"].values())
    assert "ms in the plain engine" in md and "predicted)" in md and "as the cost model held it" in md
    assert res["dtype"] == "float32" and "threads, float32)" in (out / "results.md").read_text()
    assert (out / "verify_curve.png").is_file() and (out / "batch_sweep.png").is_file()


def test_bench_times_each_head_in_every_mode_and_chain3(tiny_llama_dir, tiny_target, tmp_path):
    from draftheads.heads import save_head
    from draftheads.testing import random_heads

    save_head(random_heads(tiny_target.model)["eagle3"], tmp_path / "head")
    out, prompts = tmp_path / "bench", tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "domain": "chat", "turns": ["Say hi to the fox."]}) + "\n")
    assert main(["bench", "--target", str(tiny_llama_dir), "--eagle3", str(tmp_path / "head"), "--tree", "auto,small",
                 "--prompts", str(prompts), "--only", "proposers", "--max-new-tokens", "4", "--out", str(out)]) == 0
    got = json.loads((out / "results.json").read_text())["proposers"]
    assert {"eagle3 (auto)", "eagle3 (small)", "eagle3 (chain3)"} <= set(got) and got["eagle3 (small)"]["steps"] > 0


def test_bench_reports_how_far_each_methods_text_agrees_with_plain():
    from types import SimpleNamespace

    from draftheads.bench.speed import same_text
    from draftheads.inference.timing import Run

    def runs(*texts):
        return [Run(1.0, len(t), outputs=[SimpleNamespace(token_ids=t)]) for t in texts]

    got = same_text(runs([1, 2, 3, 4], [5, 6]), runs([1, 2, 9, 9], [5, 6]))
    assert got == {"same_text": 1, "prompts": 2, "shared_prefix": pytest.approx((0.5 + 1.0) / 2)}


def test_bench_ceiling_part(tiny_llama_dir, tmp_path):
    """A free drafter accepted with p = 0.8: τ near its expectation, and the step cost is what the speedup
    leaves of the tokens per forward."""
    out = tmp_path / "bench"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "domain": "chat", "turns": ["Say hi to the fox."]}) + "\n")
    assert main(["bench", "--target", str(tiny_llama_dir), "--prompts", str(prompts), "--only", "ceiling",
                 "--max-new-tokens", "40", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["ceiling"]
    assert res["p"] == 0.8 and set(res) == {"p", "chain3", "chain5"}
    expected = {3: 1 + 0.8 + 0.8**2 + 0.8**3, 5: sum(0.8**i for i in range(6))}  # 2.95, 3.69
    for k, want in expected.items():
        v = res[f"chain{k}"]
        assert abs(v["tau"] - want) < 1.0 and v["speedup"] > 0 and v["step_cost"] > 0, v
    assert "| chain5 |" in (out / "results.md").read_text()


def test_loss_memory_measurement_sees_the_logits():
    from draftheads.bench.loss_memory import run

    tokens, vocab = 4096, 8192  # four chunks of the fused path
    res = run(tokens=tokens, device="cpu", progress=lambda m: None, cases={vocab: 64})["vocab"][str(vocab)]
    logits_mb = tokens * vocab * 4 / 2**20  # 128 MB of fp32 logits, which the plain loss must hold at least once
    for loss in ("ce", "kl"):
        assert res[f"{loss}_plain"]["peak_mb"] >= logits_mb, res
        for kind in ("fused", "compiled"):
            assert res[f"{loss}_{kind}"]["peak_mb"] < 0.5 * res[f"{loss}_plain"]["peak_mb"], (kind, res)
            assert abs(res[f"{loss}_plain"]["loss"] - res[f"{loss}_{kind}"]["loss"]) < 1e-3


def test_bench_datagen_part(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(tiny_llama_dir), "--only", "datagen", "--max-new-tokens", "5",
                 "--datagen-batch", "3", "--out", str(out)]) == 0
    d = json.loads((out / "results.json").read_text())["datagen"]
    assert d["prompts"] == 6 and d["batch"] == 3
    for k in ("static", "continuous", "continuous_features"):
        assert d[k]["tokens"] > 0 and d[k]["ratio_vs_batch1"] > 0
    assert d["static"]["tokens"] == d["continuous"]["tokens"]  # same answers, greedy
    assert "continuous batch 3 + features" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # argparse: one error line naming --only
        main(["bench", "--target", str(tiny_llama_dir), "--only", "", "--out", str(out)])
    assert e.value.code == 2 and "--only" in capsys.readouterr().err


class _FixedLogits:
    """A model whose next-token logits are ``row`` at every position (dtype as given)."""

    device = torch.device("cpu")

    def __init__(self, row):
        self.row = row

    def __call__(self, ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.row.expand(1, ids.shape[1], -1))


def test_mismatches_are_classified_as_near_ties_or_real_divergences():
    from draftheads.evaluation import classify_divergence

    row = torch.tensor([0.0, 20.0, 20.0 + 0.125, 3.0], dtype=torch.bfloat16)  # 1 ulp apart at 20 in bf16
    tie = classify_divergence(_FixedLogits(row), [0, 3], [3, 2, 1], [3, 1, 1])
    assert tie["at"] == 1 and tie["near_tie"] and tie["margin"] == pytest.approx(0.125)
    real = classify_divergence(_FixedLogits(row), [0], [2, 2], [3, 2])  # 20.125 vs 3: a real divergence
    assert real["at"] == 0 and not real["near_tie"]
    fp32 = classify_divergence(_FixedLogits(row.float()), [0], [2], [1])  # the same gap is far apart in fp32
    assert not fp32["near_tie"]
    assert not classify_divergence(_FixedLogits(row), [0], [2, 2], [2])["near_tie"]  # stopped early: real
