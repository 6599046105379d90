import json

import pytest
import torch

from draftheads.datagen.distill import distill, turn_segments
from draftheads.errors import DraftheadsError
from draftheads.prompts import Prompt
from draftheads.training.data import build_dataset, split_of
from draftheads.training.features import FeatureDataset, collate_features

PROMPTS = [Prompt(f"p{i}", "chat", (f"question number {i}?",)) for i in range(7)] + [
    Prompt("multi", "chat", ("first question?", "and a follow-up?")),
]


def _kw(tmp_path, **kw):
    return {"max_new_tokens": 12, "batch_size": 3, "features": (1, 4), "feature_dir": tmp_path / "feats",
            "val_fraction": 0.3, "shard_rows": 1, "max_seq_len": 48, "feature_dtype": torch.float32,
            "progress": lambda m: None, **kw}


def _run(target, tmp_path, **kw):
    return distill(target, PROMPTS, tmp_path / "d.jsonl", **_kw(tmp_path, **kw))


def test_distill_writes_records_and_features_of_the_same_pass(tiny_target, tmp_path):
    out = _run(tiny_target, tmp_path)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == sorted(p.id for p in PROMPTS)
    assert not (tmp_path / "d.jsonl.partial").exists() and not (tmp_path / "d.jsonl.partial.json").exists()
    for r in recs:
        assert len(r["answers"]) == len(r["truncated"]) == len(r["turns"]) >= 1
    ds = {s: FeatureDataset(tmp_path / "feats", s, target=tiny_target.info.name) for s in ("train", "val")}
    keys = {s: [k for sh in d.shards for k in sh["keys"]] for s, d in ds.items()}
    assert sorted(keys["train"] + keys["val"]) == sorted(p.id for p in PROMPTS)
    for s, ks in keys.items():
        assert all(split_of(k, 0.3, 0) == s for k in ks)
    from draftheads.targets import hidden_states

    row = collate_features([ds["train"][0]])
    doc0 = row["doc_ids"][0] == 0
    ids = row["input_ids"][0][doc0][None]
    hs, logits = hidden_states(tiny_target.model, ids, [1, 4], return_logits=True)
    torch.testing.assert_close(row["feat_4"][0][doc0], hs[4][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(row["feat_1"][0][doc0], hs[1][0], atol=1e-4, rtol=1e-4)
    assert torch.equal(row["target_argmax"][0][doc0], logits[0].argmax(-1))
    # the text records train too, with the truncation mark respected
    train, val, stats = build_dataset(tiny_target.tokenizer, [str(out)], max_length=256, val_fraction=0.0, cache=False)
    assert stats["train"]["samples"] == len(PROMPTS)
    # and split as the same pass split its features: by prompt id
    train, val, stats = build_dataset(tiny_target.tokenizer, [str(out)], max_length=256, val_fraction=0.3, cache=False)
    assert (stats["train"]["samples"], stats["val"]["samples"]) == (len(keys["train"]), len(keys["val"]))


def test_truncated_answers_get_no_end_of_turn_token(tiny_target, tmp_path):
    out = _run(tiny_target, tmp_path, max_new_tokens=3)
    recs = {json.loads(line)["id"]: json.loads(line) for line in out.read_text().splitlines()}
    eos = tiny_target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ds = FeatureDataset(tmp_path / "feats", "train")
    for i in range(len(ds)):
        row = ds[i]
        for d in range(int(row["doc_ids"].max()) + 1):
            key = ds.shards[i]["keys"][d] if len(ds.shards) == len(ds) else None
            sel = row["doc_ids"] == d
            toks, mask = row["input_ids"][sel], row["loss_mask"][sel]
            if key is not None and recs[key]["truncated"][-1]:
                assert toks[-1].item() != eos and mask[-1].item() == 1
    from draftheads.training.data import record_to_messages, tokenize_conversation

    cut = next(r for r in recs.values() if r["truncated"][-1])
    ids, mask = tokenize_conversation(tiny_target.tokenizer, record_to_messages(cut, "x"))
    assert ids[-1] != eos and mask[-1] == 1


def test_resume_after_a_kill_has_no_duplicates_or_gaps(tiny_target, tmp_path):
    whole = tmp_path / "whole"
    whole.mkdir()
    ref = _run(tiny_target, whole)
    ref_recs = sorted(ref.read_text().splitlines())

    calls = {"n": 0}
    from draftheads.datagen.batching import ContinuousBatcher

    real = ContinuousBatcher.run

    def run_then_die(self, convs, *a, **k):
        for n, fin in enumerate(real(self, convs, *a, **k)):
            if calls["n"] == 0 and n == 4:
                calls["n"] = 1
                raise KeyboardInterrupt
            yield fin

    ContinuousBatcher.run = run_then_die
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(tiny_target, tmp_path)
    finally:
        ContinuousBatcher.run = real
    index = json.loads((tmp_path / "feats" / "index.json").read_text())
    committed = [k for shards in index["splits"].values() for sh in shards for k in sh["keys"]]
    assert 0 < len(committed) < len(PROMPTS) and not index["complete"]
    partial = (tmp_path / "d.jsonl.partial").read_text()
    assert sorted(json.loads(x)["id"] for x in partial.splitlines()) == sorted(committed)
    (tmp_path / "d.jsonl.partial").write_text(partial + '{"id": "torn')  # a crash mid-write
    with pytest.raises(DraftheadsError, match="other settings"):
        _run(tiny_target, tmp_path, max_new_tokens=13)
    with pytest.raises(DraftheadsError, match="incomplete"):
        FeatureDataset(tmp_path / "feats", "train")
    out = _run(tiny_target, tmp_path)
    assert sorted(out.read_text().splitlines()) == ref_recs
    keys = [k for s in ("train", "val") for sh in FeatureDataset(tmp_path / "feats", s).shards for k in sh["keys"]]
    assert sorted(keys) == sorted(p.id for p in PROMPTS)


def _docs(feature_dir) -> dict:
    """key -> (token ids, features of layer 4) of every conversation in a cache of one-row shards."""
    out = {}
    for split in ("train", "val"):
        ds = FeatureDataset(feature_dir, split)
        for i, sh in enumerate(ds.shards):
            row = ds[i]
            for d, key in enumerate(sh["keys"]):
                sel = row["doc_ids"] == d
                out[key] = (row["input_ids"][sel], row["feat_4"][sel])
    return out


def test_extend_answers_only_the_new_prompts(tiny_target, tmp_path):
    whole = tmp_path / "whole"
    whole.mkdir()
    ref = _run(tiny_target, whole)
    out = distill(tiny_target, PROMPTS[:4], tmp_path / "d.jsonl", **_kw(tmp_path))
    first = out.read_text().splitlines()
    with pytest.raises(DraftheadsError, match="--extend"):
        distill(tiny_target, PROMPTS, out, **_kw(tmp_path))
    with pytest.raises(DraftheadsError, match="other settings.*to extend it, or write a new --out"):
        distill(tiny_target, PROMPTS, out, **_kw(tmp_path, max_new_tokens=13), extend=True)
    with pytest.raises(DraftheadsError, match="lacks"):
        distill(tiny_target, PROMPTS[1:], out, **_kw(tmp_path), extend=True)
    assert out.read_text().splitlines() == first  # refused extensions leave the file as it was
    distill(tiny_target, PROMPTS[:6], out, **_kw(tmp_path), extend=True)
    (tmp_path / "d.jsonl.settings.json").unlink()  # as written before settings were kept: the cache's are read
    distill(tiny_target, PROMPTS, out, **_kw(tmp_path), extend=True)
    lines = out.read_text().splitlines()
    assert lines[: len(first)] == first and sorted(lines) == sorted(ref.read_text().splitlines())
    grown, direct = _docs(tmp_path / "feats"), _docs(whole / "feats")
    assert sorted(grown) == sorted(direct) == sorted(p.id for p in PROMPTS)
    for key, (ids, feat) in direct.items():
        assert torch.equal(grown[key][0], ids)
        torch.testing.assert_close(grown[key][1], feat, atol=1e-4, rtol=1e-4)  # other batch neighbours
    assert json.loads((tmp_path / "feats" / "index.json").read_text())["complete"]


def test_multi_turn_segments_follow_the_template(tiny_target):
    tok = tiny_target.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    segs = turn_segments(tok, ["hi?", "more?"], [eos])
    assert tok.decode(segs[1]) == "\n<|im_start|>user\nmore?<|im_end|>\n<|im_start|>assistant\n"


def test_bad_input(tiny_target, tmp_path):
    with pytest.raises(DraftheadsError, match="outside"):
        _run(tiny_target, tmp_path, features=(1, 99))
    with pytest.raises(DraftheadsError, match="go together"):
        _run(tiny_target, tmp_path, feature_dir=None)
    with pytest.raises(DraftheadsError, match="more than once"):
        distill(tiny_target, PROMPTS + PROMPTS[:1], tmp_path / "x.jsonl", progress=lambda m: None)
    feats = _run(tiny_target, tmp_path / "ok").parent / "feats"
    with pytest.raises(DraftheadsError, match="not 'other'"):
        FeatureDataset(feats, "train", target="other")
    next(feats.glob("train-*.safetensors")).unlink()
    with pytest.raises(DraftheadsError, match="lacks shard"):
        FeatureDataset(feats, "train")


def test_a_killed_run_resumes_and_a_second_run_is_refused(tiny_llama_dir, tmp_path):
    """Real processes: while a first distill holds --out (stopped with SIGSTOP part-way, so the timing
    cannot race), a second one stops with one line; the first is then killed (SIGKILL, no cleanup), and
    a rerun finishes with exactly the rows of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    n = 96
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "domain": "chat", "turns": [f"question {i}?"]}) + "\n"
                               for i in range(n)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def cmd(out):
        return [sys.executable, "-m", "draftheads.cli", "distill", "--target", str(tiny_llama_dir), "--prompts",
                str(prompts), "--max-new-tokens", "16", "--batch-size", "4", "--threads", "1", "--out", str(out)]

    assert subprocess.run(cmd(tmp_path / "ref.jsonl"), env=env, capture_output=True).returncode == 0
    out = tmp_path / "d.jsonl"
    partial = tmp_path / "d.jsonl.partial"
    first = subprocess.Popen(cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while (not partial.is_file() or partial.read_text().count("\n") < 4) and first.poll() is None \
                and time.time() < deadline:
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)
        assert first.poll() is None and not out.exists(), "the first run ended before it could be interrupted"
        second = subprocess.run(cmd(out), env=env, capture_output=True, text=True)
        assert second.returncode == 2 and "being written by another run" in second.stderr, second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert not out.exists() and partial.is_file()
    assert 0 < len(partial.read_text().splitlines()) < n
    rerun = subprocess.run(cmd(out), env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    rows = out.read_text().splitlines()
    assert len({json.loads(r)["id"] for r in rows}) == len(rows) == n
    assert sorted(rows) == sorted((tmp_path / "ref.jsonl").read_text().splitlines())
