"""Recipes end to end on tiny random targets of the families real ones differ in: Llama, Qwen3 (q/k norms),
Gemma-3 style (sliding windows, tied scaled embeddings, a vocabulary over 200 k), and a base model with no
chat template (raw text). Every stage runs the project's own command, as for a real target."""

import json

import pytest
import yaml

import draftheads.recipe.run as recipe_run
from draftheads.recipe.run import run_recipe
from draftheads.testing import save_tiny_llama

PROMPTS = [("chat", "Tell me about the quick brown fox."), ("chat", "Summarize the passage in one sentence."),
           ("qa", "What is 12 plus 30?"), ("qa", "Why do targets verify drafts in one forward pass?")]


def _recipe(tmp_path, arch: str, chat: bool) -> tuple:
    target = save_tiny_llama(tmp_path / "target", arch=arch, chat_template=chat)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": d, "turns": [t]}) + "\n"
                               for i, (d, t) in enumerate(PROMPTS)))
    config = tmp_path / "eagle3.yaml"
    config.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False, "enable_progress_bar": False,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": "x", "save_last": True}}]},
        "model": {"class_path": "draftheads.training.Eagle3Module",
                  "init_args": {"target": "x", "ttt_steps": 2, "draft_vocab_size": 64, "lr": 1e-3, "head_dir": "x"}},
        "data": {"feature_dir": "x", "batch_size": 2}}))
    recipe = {
        "name": f"tiny-{arch}", "target": str(target), "device": "cpu", "run_dir": str(tmp_path / "run"),
        "data": {"prompts": [str(prompts)], "synthesize": 2 if chat else 0, "max_new_tokens": 12, "max_seq_len": 96,
                 "batch_size": 8, "val_fraction": 0.25,
                 "synthesize_options": {"max_prompt_tokens": 16, "multi_turn": 0.0, "domains": ["chat", "qa"],
                                        "top_k": 100}},  # Gemma-3's 262 k ids lie mostly past the tokenizer's
        "heads": [{"family": "eagle3", "config": str(config)}],
        "eval": {"prompts": str(prompts), "limit_per_domain": 1, "max_new_tokens": 8, "modes": ["chain3"]},
        "package": {"dir": str(tmp_path / "packaged"), "mode": "chain3"},
        "serve": {"python": str(tmp_path / "no-vllm/bin/python")},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, tmp_path / "run"


@pytest.mark.parametrize("arch,chat", [("llama", True), ("qwen3", True), ("gemma3", True), ("llama", False)],
                         ids=["llama", "qwen3", "gemma3", "base-model"])
def test_a_tiny_target_goes_from_its_data_to_a_packaged_head(arch, chat, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(recipe_run, "plain_decode_rate", lambda: None)  # the default target's yardstick
    path, run = _recipe(tmp_path, arch, chat)
    assert run_recipe(str(path), cwd=tmp_path) == 0
    log = (run / "log.txt").read_text()
    stages = ["distill", "train", "export", "eval", "package"] + (["synthesize"] if chat else [])
    for stage in stages:
        assert f"=== {stage}: done in" in log, stage
    assert "=== features: reusing" in log  # distill captured them in its own pass
    assert "=== serve: skipped: vLLM not installed" in log  # reported, never passed
    answers = [json.loads(line) for line in (run / "data/train.jsonl").read_text().splitlines()]
    assert len(answers) == len(PROMPTS) + (2 if chat else 0) and all(a["answers"][0] for a in answers)
    res = json.loads((run / "eval/results.json").read_text())["modes"]["chain3"]["overall"]
    assert res["greedy_mismatches"] == 0 and res["tau"] >= 1.0
    card = json.loads((tmp_path / "packaged/card.json").read_text())
    assert card["eval"]["chain3"]["tau"] == res["tau"] and card["data"]["train"]["answer_tokens"] > 0
    assert (run / "export/vllm-eagle3/config.json").is_file()
    # a second run reuses every finished stage and runs nothing
    assert run_recipe(str(path), cwd=tmp_path) == 0
    again = (run / "log.txt").read_text()[len(log):]
    assert "=== train: reusing" in again and "done in" not in again


def test_synthesize_refuses_a_base_model_with_one_line(tmp_path, monkeypatch):
    from draftheads.errors import DraftheadsError
    from draftheads.targets import load_target

    target = load_target(str(save_tiny_llama(tmp_path / "base", chat_template=False)))
    from draftheads.datagen.synthesize import SynthConfig, synthesize

    with pytest.raises(DraftheadsError, match="has no chat template \\(a base model\\)") as e:
        synthesize(target, tmp_path / "p.jsonl", SynthConfig(num_prompts=2), progress=lambda m: None)
    assert "\n" not in str(e.value)


GPU = {"llama31-8b-eagle3.yaml": ("llama", {"draft_vocab_size": 64, "ttt_steps": 2}, ["chain3"]),
       "qwen3-8b-eagle3.yaml": ("qwen3", {"draft_vocab_size": 64, "ttt_steps": 2}, ["chain3"]),
       "qwen3-8b-dflash.yaml": ("qwen3", {"num_layers": 1, "block_size": 4, "anchors_per_row": 8}, ["chain3"])}


@pytest.mark.parametrize("name", sorted(GPU))
def test_a_gpu_recipe_runs_on_cpu_with_its_target_swapped_for_a_tiny_one(name, tmp_path, monkeypatch):
    """The GPU recipe file itself (online training: the target runs inside the fit), its target a tiny random
    one of the same family and its sizes shrunk; vLLM, the GPUs and FSDP swapped for this engine and a CPU."""
    from pathlib import Path

    monkeypatch.setattr(recipe_run, "plain_decode_rate", lambda: None)
    arch, model, modes = GPU[name]
    _recipe(tmp_path, arch, True)  # writes the tiny target and the prompt file
    target, prompts = tmp_path / "target", tmp_path / "prompts.jsonl"
    recipe = Path(__file__).resolve().parents[2] / "recipes" / name
    sets = [f"target={target}", f"run_dir={tmp_path / 'gpu-run'}", "device=cpu", "data.engine=draftheads",
            "data.data_parallel_size=1", f"data.prompts=[{prompts}]", "data.synthesize=2",
            "data.synthesize_options={max_prompt_tokens: 16, multi_turn: 0.0, domains: [chat, qa], top_k: 100}",
            "data.max_new_tokens=12", "data.max_seq_len=96", "data.batch_size=8", "data.dtype=float32",
            "data.val_fraction=0.25", f"heads.0.model={json.dumps({'target_dtype': 'float32', **model})}",
            "heads.0.trainer={accelerator: cpu, devices: 1, num_nodes: 1, strategy: auto, precision: '32', "
            "max_epochs: 1, val_check_interval: 1.0, logger: false, enable_progress_bar: false}",
            "heads.0.data={batch_size: 2, num_workers: 0}", f"eval.prompts={prompts}", "eval.limit_per_domain=1",
            "eval.max_new_tokens=8", f"eval.modes={modes}", "bench=null", f"package.dir={tmp_path / 'packaged'}",
            f"package.mode={modes[0]}", f"serve.python={tmp_path / 'no-vllm/bin/python'}"]
    assert run_recipe(str(recipe), sets, cwd=Path(__file__).resolve().parents[2]) == 0
    log = (tmp_path / "gpu-run/log.txt").read_text()
    for stage in ("synthesize", "distill", "train", "export", "eval", "package"):
        assert f"=== {stage}: done in" in log, stage
    assert "=== features:" not in log  # online: no feature cache
    cfg = yaml.safe_load((tmp_path / "gpu-run/main/train.yaml").read_text())
    assert cfg["data"]["feature_dir"] is None and cfg["data"]["train_files"][0].endswith("data/train.jsonl")
    assert json.loads((tmp_path / "gpu-run/eval/results.json").read_text())["modes"][modes[0]]["overall"][
        "greedy_mismatches"] == 0
