"""``distill --engine vllm`` through its runner protocol, with a fake runner (no vLLM needed): the same
conversations, answers and truncation marks as the project's engine."""

import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from draftheads.datagen.distill import distill
from draftheads.errors import DraftheadsError
from draftheads.inference.engine import Engine
from draftheads.inference.sampling import SamplingParams
from draftheads.prompts import Prompt, encode_chat
from draftheads.targets import load_target

FAKE = Path(__file__).with_name("_fake_vllm_runner.py")
PROMPTS = [Prompt(f"p{i}", "chat", (f"question number {i}?",)) for i in range(5)] + [
    Prompt("multi", "chat", ("first question?", "and a follow-up?", "one more?")),
    Prompt("multi2", "chat", ("tell me more?", "why?")),
]


@pytest.fixture(scope="module")
def target_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny target with a second end-of-turn id its greedy answers actually emit, so answers end
    early and later turns follow (both engines read it from generation_config.json)."""
    d = tmp_path_factory.mktemp("eos") / "tiny"
    shutil.copytree(tiny_llama_dir, d)
    t = load_target(str(d))
    im_end = t.tokenizer.convert_tokens_to_ids("<|im_end|>")
    seen = Counter()
    for p in PROMPTS[5:]:  # the token the multi-turn prompts' greedy answers emit most, early
        ids = encode_chat(t.tokenizer, [{"role": "user", "content": p.turns[0]}], name="tiny")
        (out,) = Engine(t.model).generate([ids], SamplingParams(max_new_tokens=4, stop_at_eos=False))
        seen.update(out.token_ids)
    frequent = next(tok for tok, _ in seen.most_common() if tok != im_end)
    cfg = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    cfg["eos_token_id"] = [im_end, frequent]
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


def _records(path):
    return {r["id"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


@pytest.mark.parametrize("max_new_tokens,max_seq_len", [(6, 64), (16, 36)])
def test_fake_runner_gives_the_engines_conversations(target_dir, tmp_path, max_new_tokens, max_seq_len):
    kw = {"max_new_tokens": max_new_tokens, "batch_size": 3, "max_seq_len": max_seq_len, "progress": lambda m: None}
    ours = distill(load_target(str(target_dir)), PROMPTS, tmp_path / "ours.jsonl", **kw)
    theirs = distill(str(target_dir), PROMPTS, tmp_path / "vllm.jsonl", engine="vllm",
                     vllm={"python": sys.executable, "runner": str(FAKE)}, **kw)
    a, b = _records(ours), _records(theirs)
    assert a == b
    assert not (tmp_path / "vllm.jsonl.partial").exists()
    assert any(any(r["truncated"]) for r in a.values()) and any(not all(r["truncated"]) for r in a.values())
    if max_seq_len == 64:
        assert any(len(r["answers"]) > 1 for r in a.values())  # later turns followed an end-of-turn
    else:  # some answer was cut by the sequence length before its token budget
        tok = load_target(str(target_dir)).tokenizer
        assert any(t and len(tok(ans, add_special_tokens=False).input_ids) < max_new_tokens
                   for r in a.values() for ans, t in zip(r["answers"], r["truncated"]))


def test_top_k_reaches_both_engines(target_dir, tmp_path):
    """T = 1 with top_k = 1 samples the argmax: the greedy records, through either engine; without top_k the
    same seed samples other answers (so a dropped top_k cannot pass)."""
    kw = {"max_new_tokens": 6, "batch_size": 3, "progress": lambda m: None}
    vllm = {"python": sys.executable, "runner": str(FAKE)}
    target = load_target(str(target_dir))
    greedy = _records(distill(target, PROMPTS, tmp_path / "greedy.jsonl", **kw))
    ours = _records(distill(target, PROMPTS, tmp_path / "ours.jsonl", temperature=1.0, top_k=1, **kw))
    theirs = _records(distill(str(target_dir), PROMPTS, tmp_path / "vllm.jsonl", temperature=1.0, top_k=1,
                              engine="vllm", vllm=vllm, **kw))
    sampled = _records(distill(target, PROMPTS, tmp_path / "t1.jsonl", temperature=1.0, **kw))
    answers = lambda recs: {k: r["answers"] for k, r in recs.items()}  # noqa: E731
    assert answers(ours) == answers(greedy) == answers(theirs)
    assert answers(sampled) != answers(greedy)


def test_features_through_vllm_equal_the_engines_cache(target_dir, tmp_path):
    """``--engine vllm --features``: the runner's hidden-states files (vLLM's layout, the last id before the
    final norm) become the same feature cache the project's engine writes in its generation pass."""
    from draftheads.training.features import FeatureDataset, collate_features

    target = load_target(str(target_dir))
    layers = (0, 1, target.info.num_layers)
    kw = {"max_new_tokens": 6, "batch_size": 3, "features": layers, "val_fraction": 0.3,
          "feature_dtype": torch.float32, "progress": lambda m: None}
    distill(target, PROMPTS, tmp_path / "ours.jsonl", feature_dir=tmp_path / "f-ours", **kw)
    distill(str(target_dir), PROMPTS, tmp_path / "vllm.jsonl", feature_dir=tmp_path / "f-vllm", engine="vllm",
            vllm={"python": sys.executable, "runner": str(FAKE)}, **kw)
    assert _records(tmp_path / "ours.jsonl") == _records(tmp_path / "vllm.jsonl")
    assert not list(tmp_path.glob(".vllm.jsonl.hidden-states/*"))  # every file read and removed
    for split in ("train", "val"):
        a, b = (FeatureDataset(tmp_path / d, split, target=target.info.name) for d in ("f-ours", "f-vllm"))
        assert [sh["keys"] for sh in a.shards] == [sh["keys"] for sh in b.shards] and len(a) == len(b) > 0
        for i in range(len(a)):
            ra, rb = collate_features([a[i]]), collate_features([b[i]])
            assert torch.equal(ra["input_ids"], rb["input_ids"]) and torch.equal(ra["loss_mask"], rb["loss_mask"])
            for layer in layers:
                torch.testing.assert_close(rb[f"feat_{layer}"], ra[f"feat_{layer}"], atol=1e-4, rtol=1e-4)
            assert torch.equal(ra["target_argmax"], rb["target_argmax"])


def test_a_resume_keeps_its_engine(target_dir, tmp_path):
    out = tmp_path / "d.jsonl"
    (tmp_path / "d.jsonl.partial").write_text("")
    meta = {"target": str(target_dir), "engine": "vllm"}
    (tmp_path / "d.jsonl.partial.json").write_text(json.dumps(meta))
    with pytest.raises(DraftheadsError, match="engine"):
        distill(load_target(str(target_dir)), PROMPTS, out, max_new_tokens=4, progress=lambda m: None)
    with pytest.raises(DraftheadsError, match="make vllm-check"):
        distill(str(target_dir), PROMPTS, tmp_path / "g.jsonl", engine="vllm", vllm={"python": "/nonexistent/python"})


def test_the_root_cause_of_a_failed_vllm_run_is_quoted():
    from draftheads.datagen.backends import last_error

    log = "\n".join([
        "(VllmWorker-0 pid=10) ERROR 12-01 20:16:28 [multiproc_executor.py:953]     raise ValueError(",
        "(VllmWorker-0 pid=10) ERROR 12-01 20:16:28 [multiproc_executor.py:953] ValueError: Available memory on "
        "node 0 (13.42/23.54 GiB) is less than desired",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert last_error(log) == "ValueError: Available memory on node 0 (13.42/23.54 GiB) is less than desired"
    pydantic = "x\npydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n" \
               "  Value error, Model Runner V1 does not support: dspark speculative decoding\n"
    assert last_error(pydantic).endswith("Model Runner V1 does not support: dspark speculative decoding")
    assert last_error("all fine") is None


def test_synthesize_through_the_fake_runner_writes_the_engines_prompts(tiny_llama_dir, tmp_path, monkeypatch):
    from draftheads.datagen.synthesize import SynthConfig, synthesize

    d = tmp_path / "tiny"
    shutil.copytree(tiny_llama_dir, d)
    vocab = load_target(str(d)).info.vocab_size
    # a random model rarely ends a turn: let a third of its vocabulary end one (on disk: both engines read it)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(2, vocab, 3))}))
    monkeypatch.setattr("draftheads.datagen.synthesize.is_request", lambda t: True)
    cfg = SynthConfig(num_prompts=4, domains=("chat", "summarization"), round_size=6, max_prompt_tokens=12,
                      passage_tokens=16, answer_tokens=8, min_words=1, multi_turn=0.5, batch_size=4)
    ours = synthesize(load_target(str(d)), tmp_path / "ours.jsonl", cfg, progress=lambda m: None)
    theirs = synthesize(str(d), tmp_path / "vllm.jsonl", cfg, progress=lambda m: None, engine="vllm",
                        vllm={"python": sys.executable, "runner": str(FAKE)})
    assert ours.read_text() == theirs.read_text() and len(ours.read_text().splitlines()) == 4


def test_runner_gives_vllm_the_parallelism_and_capture_asked_for(monkeypatch):
    """The runner's LLM arguments (no vLLM needed): parallelism only when set, Ray for multi-node, and the
    hidden-states extraction with the stock connector on CUDA and the host-copy one without."""
    import importlib.util

    from draftheads.datagen import vllm_runner
    from draftheads.datagen.vllm_runner import llm_kwargs, parse_args

    monkeypatch.setattr(sys, "path", list(sys.path))  # the host connector puts the runner's folder on both
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))

    plain = llm_kwargs(parse_args(["--model", "m", "--max-model-len", "64"]), cuda=False)
    assert plain == {"model": "m", "tokenizer": "m", "dtype": "float32", "max_model_len": 64, "seed": 0}
    kw = llm_kwargs(parse_args(["--model", "m", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
                                "--distributed-executor-backend", "ray", "--capture", "2,15,30",
                                "--capture-dir", "/x"]), cuda=True)
    assert kw["tensor_parallel_size"] == 8 and kw["pipeline_parallel_size"] == 2 and "data_parallel_size" not in kw
    assert kw["distributed_executor_backend"] == "ray"
    assert kw["speculative_config"]["method"] == "extract_hidden_states"
    assert kw["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 30]
    assert kw["kv_transfer_config"]["kv_connector"] == "ExampleHiddenStatesConnector"
    assert kw["kv_transfer_config"]["kv_connector_extra_config"] == {"shared_storage_path": "/x"}
    host = llm_kwargs(parse_args(["--model", "m", "--capture", "2", "--capture-dir", "/x"]), cuda=False)
    assert host["kv_transfer_config"]["kv_connector"] == "HostHiddenStatesConnector"
    spec = importlib.util.find_spec(host["kv_transfer_config"]["kv_connector_module_path"])
    assert spec is not None and Path(spec.origin) == Path(vllm_runner.__file__).with_name("vllm_hidden_states.py")


def test_the_cli_passes_vllm_options_to_the_runner(target_dir, tmp_path, monkeypatch):
    """--pipeline-parallel-size and --vllm-executor reach the runner's command line."""
    import subprocess

    from draftheads.cli import main

    seen = []

    class Stop(Exception):
        pass

    def fake_popen(cmd, **kw):
        seen.append(cmd)
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    with pytest.raises(Stop):
        main(["distill", "--prompts", "bundled:eval", "--out", str(tmp_path / "d.jsonl"), "--target", str(target_dir),
              "--engine", "vllm", "--vllm-python", sys.executable, "--pipeline-parallel-size", "2",
              "--vllm-executor", "ray"])
    cmd = seen[0]
    assert cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "ray"
