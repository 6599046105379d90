"""Bad input and faults across the CLIs, as a new user makes them.

Every case must end with status 2 and exactly one ``error:`` line naming the problem, no traceback, no
usage dump, and no file of the user's lost. Each case is (name, setup, argv, expected text); ``setup``
writes whatever bad file the case needs into the case's own folder and returns the paths the argv uses.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from draftheads.cli import main
from draftheads.heads import save_head
from draftheads.testing import random_heads, save_tiny_llama


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_target, tiny_llama_dir):
    root = tmp_path_factory.mktemp("bad-input")
    heads = random_heads(tiny_target.model)
    for name in ("eagle3", "medusa", "dflash", "dspark"):
        save_head(heads[name], root / name)
    prompts = [{"id": f"p{i}", "domain": "math", "turns": [f"What is {i} plus 1?"]} for i in range(3)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    chat = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat * 4))
    save_tiny_llama(root / "no-template", chat_template=False)
    return {"target": str(tiny_llama_dir), "root": root, "eagle3": root / "eagle3", "medusa": root / "medusa",
            "dflash": root / "dflash", "dspark": root / "dspark",
            "prompts": root / "prompts.jsonl", "chat": root / "chat.jsonl", "no_template": root / "no-template"}


def _user_dir(d: Path) -> Path:
    """A folder holding the user's own files, which no command may delete."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "notes.txt").write_text("mine")
    return d


def _head_copy(env, d: Path, kind: str = "eagle3", edit=None, weights=None) -> Path:
    """A copy of a saved head, its config changed by ``edit(cfg)``, its weights by ``weights(bytes)``."""
    src = env[kind]
    d.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if edit:
        edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    data = (src / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights(data) if weights else data)
    return d


def _not_json(head: Path) -> Path:
    (head / "config.json").write_text("{not json")
    return head


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _check_one_error_line(rc, err: list[str], expected: str, before: dict[Path, bytes]) -> None:
    """Status 2, exactly one ``error:`` line holding ``expected``, and every file of ``before`` unchanged."""
    assert rc == 2, f"exit status {rc}: {err[-5:]}"
    assert len(err) == 1 and err[0].startswith("error: "), err[-8:]
    assert expected in err[0], err[0]
    lost = [str(p) for p, data in before.items() if not p.is_file() or p.read_bytes() != data]
    assert not lost, f"files lost or changed: {lost}"


def _flip_header(data: bytes) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    return data[:8] + data[8: 8 + n].replace(b'"shape"', b'"shqpe"', 1) + data[8 + n:]


def _reshape_tensor(env, d: Path) -> Path:
    from safetensors.torch import load_file, save_file

    d = _head_copy(env, d)
    w = load_file(str(d / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"][:, :-1].contiguous()
    save_file(w, str(d / "model.safetensors"), metadata={"head_type": "eagle3"})
    return d


def _set(path: str, value):
    def edit(cfg):
        *parents, leaf = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        if value is KeyError:
            del node[leaf]
        else:
            node[leaf] = value
    return edit


def _medusa_tree(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "tree.json").write_text(json.dumps([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]))
    return d / "tree.json"


def _export(env, d: Path, kind: str, fmt: str, drop: str | None = None) -> Path:
    """An export of the saved ``kind`` head in ``fmt``, without the weights starting with ``drop``."""
    from safetensors.torch import load_file, save_file

    from draftheads.export.vllm import export_head
    from draftheads.heads import load_head

    out, _ = export_head(load_head(env[kind])[0], fmt, d / "export", verifier="t", k=2)
    if drop:
        w = load_file(str(out / "model.safetensors"))
        save_file({k: v for k, v in w.items() if not k.startswith(drop)}, str(out / "model.safetensors"))
    return out


GEN = ["generate", "--prompt", "hi", "--max-new-tokens", "4"]
EVAL = ["eval", "--proposer", "ngram", "--max-new-tokens", "4", "--limit-per-domain", "1"]

# (id, setup(env, dir) -> dict of extra names, argv template, expected fragment of the error line)
CASES = [
    # outputs never destroy what they did not write
    ("export-into-user-folder", lambda e, d: {"out": _user_dir(d / "out")},
     ["export", "--head", "{eagle3}", "--format", "vllm-eagle3", "--out", "{out}"], "--overwrite"),
    ("export-over-own-head", lambda e, d: {"h": _head_copy(e, d / "h")},
     ["export", "--head", "{h}", "--format", "vllm-eagle3", "--out", "{h}"], "is an input"),
    ("export-onto-a-file", lambda e, d: {"out": (d.mkdir() or d / "f.txt", (d / "f.txt").write_text("x"))[0]},
     ["export", "--head", "{eagle3}", "--format", "vllm-eagle3", "--out", "{out}"], "is a file"),
    ("import-into-user-folder", lambda e, d: {"out": _user_dir(d / "out")},
     ["import", "--from", "eagle3", "{eagle3}", "--out", "{out}"], "--overwrite"),
    ("cache-features-into-user-folder", lambda e, d: {"out": _user_dir(d / "out")},
     ["cache-features", "--data", "{chat}", "--layers", "1,2", "--out", "{out}"], "--overwrite"),
    ("eval-out-is-a-file", lambda e, d: {"out": (d.mkdir() or d / "f.txt", (d / "f.txt").write_text("x"))[0]},
     EVAL + ["--out", "{out}"], "is a file"),
    ("eval-out-under-a-file", lambda e, d: {"out": (d.mkdir() or d / "f.txt", (d / "f.txt").write_text("x"))[0] / "sub"},
     EVAL + ["--out", "{out}"], "not a folder"),
    ("bench-out-is-a-file", lambda e, d: {"out": (d.mkdir() or d / "f.txt", (d / "f.txt").write_text("x"))[0]},
     ["bench", "--only", "proposers", "--out", "{out}"], "is a file"),
    # head directories checked against their typed config before anything is allocated
    ("head-missing", lambda e, d: {}, GEN + ["--head", "/nonexistent/head"], "lacks config.json"),
    ("head-truncated-weights", lambda e, d: {"h": _head_copy(e, d / "h", weights=lambda b: b[: len(b) // 2])},
     GEN + ["--head", "{h}"], "model.safetensors"),
    ("head-flipped-header", lambda e, d: {"h": _head_copy(e, d / "h", weights=_flip_header)},
     GEN + ["--head", "{h}"], "model.safetensors"),
    ("head-empty-weights", lambda e, d: {"h": _head_copy(e, d / "h", weights=lambda b: b"")},
     GEN + ["--head", "{h}"], "model.safetensors"),
    ("head-config-not-json", lambda e, d: {"h": _not_json(_head_copy(e, d / "h"))},
     GEN + ["--head", "{h}"], "config.json"),
    ("head-missing-field", lambda e, d: {"h": _head_copy(e, d / "h", edit=_set("config.draft_vocab_size", KeyError))},
     GEN + ["--head", "{h}"], "draft_vocab_size"),
    ("head-missing-nested-field",
     lambda e, d: {"h": _head_copy(e, d / "h", edit=_set("config.layer.num_attention_heads", KeyError))},
     GEN + ["--head", "{h}"], "num_attention_heads"),
    ("head-mistyped-field", lambda e, d: {"h": _head_copy(e, d / "h", edit=_set("config.draft_vocab_size", "many"))},
     GEN + ["--head", "{h}"], "draft_vocab_size"),
    ("head-mistyped-nested-field",
     lambda e, d: {"h": _head_copy(e, d / "h", edit=_set("config.layer.hidden_size", [64]))},
     GEN + ["--head", "{h}"], "hidden_size"),
    ("head-extra-nested-field", lambda e, d: {"h": _head_copy(e, d / "h", edit=_set("config.layer.colour", 3))},
     GEN + ["--head", "{h}"], "colour"),
    ("head-huge-config",
     lambda e, d: {"h": _head_copy(e, d / "h", edit=_set("config.layer.intermediate_size", 10_000_000))},
     GEN + ["--head", "{h}"], "makes it [10000000, 64]"),
    ("head-shape-mismatch", lambda e, d: {"h": _reshape_tensor(e, d / "h")}, GEN + ["--head", "{h}"], "fc.weight"),
    ("head-unknown-type", lambda e, d: {"h": _head_copy(e, d / "h", edit=_set("head_type", "hydra"))},
     GEN + ["--head", "{h}"], "hydra"),
    # block drafters
    ("dspark-block-too-large", lambda e, d: {"h": _head_copy(e, d / "h", "dspark", edit=_set("config.block_size", 200))},
     GEN + ["--head", "{h}"], "block_size=200 must be in 2..128"),
    ("dflash-layers-outside-target",
     lambda e, d: {"h": _head_copy(e, d / "h", "dflash", edit=_set("config.target_layer_ids", [1, 40]))},
     GEN + ["--head", "{h}"], "fall outside"),
    ("dspark-mask-outside-vocab",
     lambda e, d: {"h": _head_copy(e, d / "h", "dspark", edit=_set("config.mask_token_id", 10**6))},
     GEN + ["--head", "{h}"], "mask_token_id=1000000"),
    ("dspark-tree-deeper-than-block", lambda e, d: {}, GEN + ["--head", "{dspark}", "--tree", "chain9"],
     "drafts 4 positions per block"),
    ("dflash-export-wrong-format", lambda e, d: {"out": d / "o"},
     ["export", "--head", "{dflash}", "--format", "vllm-eagle3", "--out", "{out}"], "exports eagle3 heads"),
    ("dspark-import-of-a-dflash-checkpoint", lambda e, d: {"x": _export(e, d, "dflash", "vllm-dflash"), "out": d / "o"},
     ["import", "--from", "dspark", "{x}", "--out", "{out}"], "import it --from dflash"),
    ("dspark-confidence-head-without-weights",
     lambda e, d: {"x": _export(e, d, "dspark", "vllm-dspark", drop="confidence_head."), "out": d / "o"},
     ["import", "--from", "dspark", "{x}", "--out", "{out}"], "enable_confidence_head is true"),
    # sampling and tree arguments
    ("temperature-nan", lambda e, d: {}, GEN + ["--temperature", "nan"], "temperature"),
    ("temperature-inf", lambda e, d: {}, GEN + ["--temperature", "inf"], "temperature"),
    ("temperature-negative", lambda e, d: {}, GEN + ["--temperature", "-1"], "temperature"),
    ("top-p-zero", lambda e, d: {}, GEN + ["--top-p", "0"], "top_p"),
    ("top-k-negative", lambda e, d: {}, GEN + ["--top-k", "-3"], "top_k"),
    ("max-new-tokens-zero", lambda e, d: {}, ["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("tree-too-large", lambda e, d: {}, GEN + ["--proposer", "ngram", "--tree", "chain100000"], "128"),
    ("tree-ngram-branching", lambda e, d: {}, GEN + ["--proposer", "ngram", "--tree", "small"], "chains"),
    ("tree-medusa-too-deep", lambda e, d: {"t": _medusa_tree(d)}, GEN + ["--head", "{medusa}", "--tree", "{t}"],
     "deep but the head drafts 3"),
    ("tree-file-broken", lambda e, d: {"t": (d.mkdir() or d / "t.json", (d / "t.json").write_text("[[0], [0,"))[0]},
     GEN + ["--head", "{medusa}", "--tree", "{t}"], "t.json"),
    ("proposer-unknown", lambda e, d: {}, GEN + ["--proposer", "lookahead"], "lookahead"),
    ("head-and-proposer", lambda e, d: {}, GEN + ["--head", "{eagle3}", "--proposer", "ngram"], "--proposer"),
    ("dtype-unknown", lambda e, d: {}, GEN + ["--dtype", "float8"], "float8"),
    ("device-unknown", lambda e, d: {}, GEN + ["--device", "tpu"], "--device 'tpu' is not a device"),
    ("device-index-unparsable", lambda e, d: {}, GEN + ["--device", "cuda:x"], "not a device"),
    *([("device-cuda-absent", lambda e, d: {}, GEN + ["--device", "cuda"], "no CUDA device")]
      if not torch.cuda.is_available() else []),
    ("flag-unknown", lambda e, d: {}, GEN + ["--temprature", "0.5"], "--temprature"),
    ("flag-not-a-number", lambda e, d: {}, GEN + ["--max-new-tokens", "ten"], "--max-new-tokens"),
    # eval, profile, bench
    ("eval-limit-zero", lambda e, d: {}, ["eval", "--proposer", "ngram", "--limit-per-domain", "0", "--out", "x"],
     "--limit-per-domain"),
    ("eval-no-head", lambda e, d: {}, ["eval", "--out", "x"], "--head"),
    ("walk-no-head", lambda e, d: {}, ["walk", "--out", "x"], "--head"),
    ("walk-auto", lambda e, d: {}, ["walk", "--proposer", "ngram", "--tree", "auto,chain3", "--out", "x"],
     "--tree auto cannot be walked"),
    ("eval-empty-tree", lambda e, d: {}, EVAL + ["--tree", ",", "--out", "x"], "--tree"),
    ("eval-batch-zero", lambda e, d: {}, EVAL + ["--batch-size", "0", "--out", "x"], "--batch-size"),
    ("eval-prompts-not-utf8", lambda e, d: {"p": (d.mkdir() or d / "p.jsonl", (d / "p.jsonl").write_bytes(b"\xff\xfe{"))[0]},
     EVAL + ["--prompts", "{p}", "--out", "x"], "UTF-8"),
    ("eval-prompts-twice", lambda e, d: {}, EVAL + ["--prompts", "{prompts}", "{prompts}", "--out", "x"], "more than once"),
    ("eval-prompts-mixed-forms", lambda e, d: {"p": (d.mkdir() or d / "m.jsonl", (d / "m.jsonl").write_text(
        '{"id": "a", "domain": "qa", "turns": ["hi"]}\n{"question": "2+2?", "answer": "4"}\n'))[0]},
     EVAL + ["--prompts", "{p}", "--out", "x"], "one form per file"),
    ("eval-prompts-missing", lambda e, d: {}, EVAL + ["--prompts", "/nonexistent.jsonl", "--out", "x"], "nonexistent"),
    ("profile-ks-zero", lambda e, d: {}, ["profile", "--ks", "0"], "--ks"),
    ("profile-ks-words", lambda e, d: {}, ["profile", "--ks", "a,b"], "--ks"),
    ("profile-repeats-zero", lambda e, d: {}, ["profile", "--repeats", "0"], "--repeats"),
    ("profile-prefix-zero", lambda e, d: {}, ["profile", "--prefix", "0"], "--prefix"),
    ("bench-only-empty", lambda e, d: {}, ["bench", "--only", "", "--out", "x"], "--only"),
    ("bench-only-unknown", lambda e, d: {}, ["bench", "--only", "speed", "--out", "x"], "--only"),
    ("bench-batches-zero", lambda e, d: {}, ["bench", "--only", "batch", "--batches", "0", "--out", "x"], "--batches"),
    # data commands
    ("distill-domain-matches-nothing", lambda e, d: {},
     ["distill", "--prompts", "{prompts}", "--domains", "poetry", "--out", "x.jsonl"], "poetry"),
    ("distill-layers-outside-target", lambda e, d: {},
     ["distill", "--prompts", "{prompts}", "--features", "1,99", "--feature-dir", "f", "--out", "x.jsonl"], "99"),
    ("distill-features-without-dir", lambda e, d: {},
     ["distill", "--prompts", "{prompts}", "--features", "eagle3", "--out", "x.jsonl"], "--feature-dir"),
    ("distill-batch-zero", lambda e, d: {}, ["distill", "--prompts", "{prompts}", "--batch-size", "0", "--out", "x.jsonl"],
     "--batch-size"),
    ("distill-temperature-inf", lambda e, d: {},
     ["distill", "--prompts", "{prompts}", "--temperature", "inf", "--out", "x.jsonl"], "temperature"),
    ("distill-out-exists", lambda e, d: {"out": (d.mkdir() or d / "o.jsonl", (d / "o.jsonl").write_text("{}\n"))[0]},
     ["distill", "--prompts", "{prompts}", "--out", "{out}"], "already exists"),
    ("distill-out-is-prompts", lambda e, d: {}, ["distill", "--prompts", "{prompts}", "--out", "{prompts}"],
     "already exists"),
    ("synthesize-no-chat-template", lambda e, d: {},
     ["synthesize", "--target", "{no_template}", "--num-prompts", "4", "--out", "x.jsonl"], "chat template"),
    ("synthesize-zero-prompts", lambda e, d: {}, ["synthesize", "--num-prompts", "0", "--out", "x.jsonl"],
     "--num-prompts"),
    ("synthesize-unknown-domain", lambda e, d: {}, ["synthesize", "--domains", "poetry", "--out", "x.jsonl"], "poetry"),
    ("cache-features-no-layers", lambda e, d: {}, ["cache-features", "--data", "{chat}", "--layers", ",", "--out", "o"],
     "--layers"),
    ("cache-features-layer-outside", lambda e, d: {},
     ["cache-features", "--data", "{chat}", "--layers", "1,42", "--out", "o"], "42"),
    ("cache-features-empty-data", lambda e, d: {"p": (d.mkdir() or d / "e.jsonl", (d / "e.jsonl").write_text(""))[0]},
     ["cache-features", "--data", "{p}", "--out", "o"], "empty"),
    ("import-pickle", lambda e, d: {"p": (d.mkdir() or d / "w.bin", torch.save({"x": object()}, d / "w.bin"))[0]},
     ["import", "--from", "medusa", "{p}", "--out", "o"], "w.bin"),
    ("import-missing", lambda e, d: {}, ["import", "--from", "eagle3", "/nonexistent", "--out", "o"], "nonexistent"),
]
# these need a target: the tiny one, unless the case names its own
_NO_TARGET = {"export", "import"}


@pytest.mark.parametrize("name,setup,argv,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line(env, tmp_path, monkeypatch, capsys, name, setup, argv, expected):
    monkeypatch.chdir(tmp_path)
    case = tmp_path / "case"
    names = {k: str(v) for k, v in env.items()} | {k: str(v) for k, v in setup(env, case).items()}
    args = [a.format(**names) for a in argv]
    if args[0] not in _NO_TARGET and "--target" not in args:
        args[1:1] = ["--target", names["target"]]
    before = _files(tmp_path)
    try:
        rc = main(args)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    _check_one_error_line(rc, err, expected, before)
    assert "Traceback" not in err[0] and "usage:" not in err[0]


# ----------------------------------------------------------------------------- train-head

@pytest.fixture(scope="module")
def train_env(env, tmp_path_factory):
    """A train-head config for the tiny target, and a feature cache written for it."""
    import yaml

    root = tmp_path_factory.mktemp("train-bad")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                          {"role": "assistant", "content": f"It is {i + 1}. The quick brown fox."}]} for i in range(12)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["cache-features", "--target", env["target"], "--data", str(root / "data.jsonl"), "--layers",
                 "1,2,3,4", "--max-length", "48", "--val-fraction", "0.2", "--out", str(root / "feats")]) == 0
    cfg = {"seed_everything": 0,
           "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False,
                       "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False},
           "model": {"class_path": "draftheads.training.Eagle3Module",
                     "init_args": {"target": env["target"], "lr": 3e-3, "ttt_steps": 2, "aux_layer_ids": [1, 2, 3]}},
           "data": {"train_files": [str(root / "data.jsonl")], "max_length": 48, "batch_size": 4, "val_fraction": 0.2}}
    (root / "train.yaml").write_text(yaml.safe_dump(cfg))
    return {"config": root / "train.yaml", "feats": root / "feats", "data": root / "data.jsonl"}


def _feats_copy(train_env, d: Path, edit) -> Path:
    import shutil

    out = d / "feats"
    shutil.copytree(train_env["feats"], out)
    edit(out)
    return out


def _retarget(out: Path):
    idx = json.loads((out / "index.json").read_text())
    idx["target"] = "another/model"
    (out / "index.json").write_text(json.dumps(idx))


def _drop_shard(out: Path):
    next(out.glob("train-*.safetensors")).unlink()


def _truncate_shard(out: Path):
    f = next(out.glob("train-*.safetensors"))
    f.write_bytes(f.read_bytes()[:100])


def _file(d: Path, name: str, data: bytes = b"x") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)
    return d / name


TRAIN_CASES = [
    ("lr-negative", lambda t, d: ["--model.init_args.lr", "-1"], "model.lr=-1.0 must be > 0"),
    ("warmup-ratio-one", lambda t, d: ["--model.init_args.warmup_ratio", "1"], "warmup_ratio"),
    ("flag-unknown", lambda t, d: ["--trainer.max_epochz", "1"], "max_epochz"),
    ("flag-mistyped", lambda t, d: ["--data.batch_size", "x"], "data.batch_size"),
    ("ckpt-truncated", lambda t, d: ["--ckpt_path", str(_file(d, "last.ckpt", b"PK\x03\x04 torn"))], "--ckpt_path"),
    ("ckpt-missing", lambda t, d: ["--ckpt_path", str(d / "none.ckpt")], "does not exist"),
    ("head-dir-under-a-file", lambda t, d: ["--model.init_args.head_dir", str(_file(d, "f.txt") / "head")],
     "model.head_dir"),
    ("head-dir-holds-user-files", lambda t, d: ["--model.init_args.head_dir", str(_user_dir(d / "head"))],
     "model.head_dir"),
    ("data-missing", lambda t, d: ["--data.train_files", "[/nonexistent.jsonl]"], "does not exist"),
    ("data-empty", lambda t, d: ["--data.train_files", f"[{_file(d, 'e.jsonl', b'')}]"], "is empty"),
    ("data-all-val", lambda t, d: ["--data.val_fraction", "1"], "no training rows"),
    ("cache-other-target", lambda t, d: ["--data.feature_dir", str(_feats_copy(t, d, _retarget))], "another/model"),
    ("cache-missing-shard", lambda t, d: ["--data.feature_dir", str(_feats_copy(t, d, _drop_shard))], "lacks shard"),
    ("cache-truncated-shard", lambda t, d: ["--data.feature_dir", str(_feats_copy(t, d, _truncate_shard))],
     "safetensors"),
    ("cache-missing", lambda t, d: ["--data.feature_dir", str(d / "nothing")], "no index.json"),
    ("cache-lacks-a-layer", lambda t, d: ["--data.feature_dir", str(t["feats"]), "--model.init_args.aux_layer_ids",
                                          "[1, 2, 0]"], "holds layers [1, 2, 3, 4] but this head reads [0, 1, 2]"),
]


@pytest.mark.parametrize("name,extra,expected", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_head_bad_input_is_one_error_line(train_env, tmp_path, monkeypatch, capsys, name, extra, expected):
    from draftheads.training.cli import main as train_main

    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(train_env["config"]), *extra(train_env, tmp_path / "case")]
    before = _files(tmp_path)
    rc = train_main(args)
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    _check_one_error_line(rc, err, expected, before)
