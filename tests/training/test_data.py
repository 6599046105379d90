import json

import pytest
import torch

from draftheads.errors import DraftheadsError
from draftheads.testing import tiny_tokenizer
from draftheads.training.data import (
    answer_window,
    build_dataset,
    collate,
    doc_causal_mask,
    pack,
    record_key,
    record_to_messages,
    split_of,
    tokenize_conversation,
)

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": "The answer is 42."},
    {"role": "user", "content": "Translate good morning."},
    {"role": "assistant", "content": "Bonjour."},
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _spans(ids, mask, tok):
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def test_generation_tags_and_prefix_fallback_agree(tok):
    ids_a, mask_a = tokenize_conversation(tok, CONV, use_generation_tags=True)
    ids_b, mask_b = tokenize_conversation(tok, CONV, use_generation_tags=False)
    assert ids_a == ids_b
    assert mask_a == mask_b
    assert _spans(ids_a, mask_a, tok) == ["The answer is 42.<|im_end|>", "Bonjour.<|im_end|>"]


@pytest.mark.parametrize("tags", [True, False])
def test_assistant_boundary_tokens(tok, tags):
    ids, mask = tokenize_conversation(tok, CONV, use_generation_tags=tags)
    first = mask.index(1)
    # the token before the boundary is the header's newline, the first inside starts the answer
    assert tok.decode(ids[first - 1]).endswith("\n") and mask[first - 1] == 0
    assert tok.decode(ids[first:first + 3]).startswith("The")
    end = first + mask[first:].index(0)
    assert tok.decode([ids[end - 1]]) == "<|im_end|>" and mask[end] == 0  # end-of-turn token included


def test_plain_text_trains_on_everything(tok):
    ids, mask = tokenize_conversation(tok, "The quick brown fox.")
    assert len(ids) > 3 and all(mask)


def test_pack_positions_docs_and_truncation():
    samples = [([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1]), ([6] * 9, [1] * 9), ([7, 8], [0, 0])]
    rows, stats = pack(samples, max_length=6, pad_id=0)
    assert stats.truncated == 1 and stats.dropped_no_assistant == 1 and stats.rows == 2
    assert rows[0]["input_ids"] == [1, 2, 3, 4, 5, 0]
    assert rows[0]["position_ids"] == [0, 1, 2, 0, 1, 0]
    assert rows[0]["doc_ids"] == [0, 0, 0, 1, 1, -1]
    assert rows[1]["input_ids"] == [6] * 6
    batch = collate(rows)
    assert batch["input_ids"].shape == (2, 6)


def test_doc_mask_blocks_cross_document_attention():
    m = doc_causal_mask(torch.tensor([[0, 0, 1, -1]]))
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


def test_answer_window_keeps_the_first_tokens_of_every_answer():
    # doc 0: a 3-token answer, a user turn, a 4-token answer; doc 1 starts mid-run of ones; then padding
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0]])
    docs = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1]])
    assert answer_window(mask, docs, 2).tolist() == [[0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0]]
    assert answer_window(mask, docs, 1).tolist() == [[0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0]]
    assert torch.equal(answer_window(mask, docs, 13), mask)


def test_packed_target_features_equal_separate_forwards(tiny_target):
    from draftheads.targets import hidden_states

    model = tiny_target.model
    a, b = torch.randint(3, 300, (1, 5)), torch.randint(3, 300, (1, 4))
    ids = torch.cat([a, b], 1)
    docs = torch.tensor([[0] * 5 + [1] * 4])
    pos = torch.tensor([list(range(5)) + list(range(4))])
    packed, _ = hidden_states(model, ids, [2, 4], attention_mask=doc_causal_mask(docs), position_ids=pos)
    sep_a, _ = hidden_states(model, a, [2, 4])
    sep_b, _ = hidden_states(model, b, [2, 4])
    for i in (2, 4):
        torch.testing.assert_close(packed[i], torch.cat([sep_a[i], sep_b[i]], 1), atol=1e-5, rtol=1e-5)


def test_build_dataset_forms_split_and_cache(tok, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(10)
    ] + [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"id": "x", "domain": "chat", "turns": ["hey"], "answers": ["hey you"]},
        {"text": "The quick brown fox."},
    ]
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, val, stats = build_dataset(tok, [str(f)], max_length=64, val_fraction=0.2)
    held = sum(split_of(record_key(r, record_to_messages(r, "")), 0.2, 0) == "val" for r in rows)
    assert stats["train"]["samples"] + stats["val"]["samples"] == 13 and stats["val"]["samples"] == max(held, 1)
    assert stats["masking"] == "generation tags"
    again = build_dataset(tok, [str(f)], max_length=64, val_fraction=0.2)
    assert again[2] == stats and len(again[0]) == len(train)


def _answers(rows, tok) -> set[str]:
    return {span for r in rows for span in _spans(r["input_ids"], r["loss_mask"], tok)}


def test_the_split_holds_each_conversation_where_it_was_as_the_data_grows(tok, tmp_path):
    def conv(i, **extra):
        return {"messages": [{"role": "user", "content": f"question {i}"},
                             {"role": "assistant", "content": f"reply {i}"}], **extra}

    def split(rows, name):
        f = tmp_path / name
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        train, val, _ = build_dataset(tok, [str(f)], 128, False, 0.25, 0, cache=False)
        return _answers(train, tok), _answers(val, tok)

    small = [conv(i) for i in range(40)]
    train, val = split(small, "small.jsonl")
    assert len(val) >= 4 and len(train) >= 20 and not train & val
    grown_train, grown_val = split(small + [conv(i) for i in range(40, 120)], "grown.jsonl")
    assert train <= grown_train and val <= grown_val  # what trained a head before stays out of validation
    assert len(grown_val) > len(val)
    # a conversation's key is its id where it has one (distill's prompt id), else its prompt, never its answer
    assert record_key({"id": "math-7"}, []) == "math-7"
    again = conv(3)
    again["messages"][1]["content"] = "another reply"
    assert record_key(again, again["messages"]) == record_key(conv(3), conv(3)["messages"])


@pytest.mark.parametrize("val_fraction", [0.0, 1.0])
def test_a_split_of_no_rows_comes_back_from_the_cache(tok, tmp_path, val_fraction):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                  {"role": "assistant", "content": f"a {i}"}]}) + "\n" for i in range(5)))
    made = build_dataset(tok, [str(f)], 64, True, val_fraction, 0)
    again = build_dataset(tok, [str(f)], 64, True, val_fraction, 0)  # from the cache
    assert [len(s) for s in again[:2]] == [len(s) for s in made[:2]]
    assert (len(made[0]) == 0) == (val_fraction == 1.0) and (len(made[1]) == 0) == (val_fraction == 0.0)
    assert list(again[1 if val_fraction == 1.0 else 0][0]) == list(made[1 if val_fraction == 1.0 else 0][0])


def test_zero_assistant_tokens_and_missing_answers(tok, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "only a question"}]}) + "\n")
    with pytest.raises(DraftheadsError, match="zero assistant tokens"):
        build_dataset(tok, [str(f)], max_length=64, val_fraction=0.0, cache=False)
    f.write_text(json.dumps({"id": "a", "domain": "chat", "turns": ["q"]}) + "\n")
    with pytest.raises(DraftheadsError, match="draftheads distill"):
        build_dataset(tok, [str(f)], max_length=64, cache=False)


def _cache_features(target_dir, tmp_path, conversations: int, layers: str, val_fraction: str):
    """``cache-features`` over short Q/A conversations; returns the cache directory."""
    from draftheads.cli import main as cli

    rows = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"answer number {i}"}]}
            for i in range(conversations)]
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "feats"
    assert cli(["cache-features", "--target", str(target_dir), "--data", str(f), "--layers", layers,
                "--max-length", "32", "--val-fraction", val_fraction, "--out", str(out)]) == 0
    return out


def test_cache_features_of_a_held_out_set_is_all_val(tiny_llama_dir, tmp_path):
    from draftheads.training.features import FeatureDataset

    out = _cache_features(tiny_llama_dir, tmp_path, 6, "1,2", "1")
    assert len(FeatureDataset(out, "train")) == 0
    val = FeatureDataset(out, "val")
    assert sum(int(val[i]["loss_mask"].sum()) for i in range(len(val))) > 0


def test_offline_features_equal_online(tiny_llama_dir, tmp_path):
    from draftheads.targets import hidden_states, load_target
    from draftheads.training.features import FeatureDataset, collate_features

    out = _cache_features(tiny_llama_dir, tmp_path, 6, "1,2,4", "0.2")
    ds = FeatureDataset(out, "train")
    assert ds.layer_ids == [1, 2, 4] and len(ds) >= 1
    batch = collate_features([ds[0]])
    model = load_target(str(tiny_llama_dir)).model
    online, logits = hidden_states(model, batch["input_ids"], [1, 4], attention_mask=doc_causal_mask(batch["doc_ids"]),
                                   position_ids=batch["position_ids"], return_logits=True)
    torch.testing.assert_close(batch["feat_4"], online[4])
    torch.testing.assert_close(batch["feat_1"], online[1])
    assert torch.equal(batch["target_argmax"], logits.argmax(-1))


def test_cache_features_resumes_a_killed_run_at_its_last_committed_shard(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file

    from draftheads.targets import load_target
    from draftheads.training.data import build_dataset
    from draftheads.training.features import partial_dir, write_feature_cache

    target = load_target(str(tiny_llama_dir))
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                                  {"role": "assistant", "content": f"answer number {i}"}]}) + "\n"
                         for i in range(10)))
    train, val, _ = build_dataset(target.tokenizer, [str(f)], 32, False, 0.2, 0, cache=False)
    rows = {"train": list(train), "val": list(val)}
    forwards = [0]
    target.model.get_input_embeddings().register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))

    def write(out, layers=(1, 2), stop_after=None, data=rows):
        def progress(n):
            if stop_after is not None and forwards[0] >= stop_after:
                raise KeyboardInterrupt
        forwards[0] = 0
        write_feature_cache(target.model, data, list(layers), tmp_path / out, "tiny", batch_size=1, shard_rows=3,
                            progress=progress)
        return forwards[0]

    assert write("whole") == 10  # 8 train rows in shards of 3, 3, 2; 2 val rows
    with pytest.raises(KeyboardInterrupt):
        write("feats", stop_after=4)  # killed in the second shard: only the first is committed
    assert not (tmp_path / "feats").exists()
    assert [sh["file"] for sh in json.loads((partial_dir(tmp_path / "feats") / "index.json").read_text())["splits"]["train"]] \
        == ["train-00000.safetensors"]
    assert write("feats") == 7  # the rows of the uncommitted shards only
    assert not partial_dir(tmp_path / "feats").exists()
    for name in ("train-00000", "train-00001", "train-00002", "val-00000"):
        got, want = (load_file(tmp_path / d / f"{name}.safetensors") for d in ("feats", "whole"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "feats/index.json").read_text())["complete"] is True

    with pytest.raises(KeyboardInterrupt):
        write("other", stop_after=4)
    assert write("other", layers=(1, 3)) == 10  # other layers: the partial shards are not reused
    assert "feat_3" in load_file(tmp_path / "other/train-00000.safetensors")
    with pytest.raises(KeyboardInterrupt):
        write("moved", stop_after=7)  # two train shards committed
    moved = {"train": rows["train"][:3] + rows["train"][4:], "val": rows["val"]}
    assert write("moved", data=moved) == 6  # shard 0 holds the same rows; from shard 1 on they differ


def test_a_feature_cache_without_a_validation_split_counts_no_val_tokens(tiny_llama_dir, tmp_path):
    """distill/cache-features --val-fraction 0: the draft vocabulary's held-out counts are empty (sized on
    the training targets), not a crash."""
    from draftheads.heads.vocab import build_draft_vocab
    from draftheads.training.datamodule import ChatDataModule

    out = _cache_features(tiny_llama_dir, tmp_path, 4, "1,2", "0")
    dm = ChatDataModule(target=str(tiny_llama_dir), feature_dir=str(out), batch_size=2)
    train, val = dm.token_counts(384), dm.token_counts(384, split="val")
    assert int(train.sum()) > 0 and int(val.sum()) == 0
    assert build_draft_vocab(train, coverage=0.9, held_out=val).held_out_coverage is None
