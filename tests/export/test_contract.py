"""The serving contract: each field that has broken served acceptance in the field, written wrong into an
otherwise valid export, is caught with one line naming it; the exports this project writes pass."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftheads.errors import DraftheadsError
from draftheads.export.contract import TargetShape, check_contract
from draftheads.export.vllm import EXPORTS, export_head
from draftheads.testing import random_heads


@pytest.fixture(scope="module")
def heads(tiny_target):
    return random_heads(tiny_target.model)


@pytest.fixture(scope="module")
def shape(tiny_target):
    return TargetShape.of(tiny_target.model)


def _export(tmp_path, heads, tiny_target, fmt, head, k=3):
    out, _ = export_head(heads[head], fmt, tmp_path / fmt, k=k, target=tiny_target,
                         verifier=str(tiny_target.info.name) if fmt == "speculators" else None)
    return out


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        node = cfg
        *parents, last = key.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fmt,head", [("vllm-eagle3", "eagle3"), ("speculators", "eagle3"), ("vllm-dflash", "dflash"),
                                      ("vllm-dspark", "dspark"), ("vllm-eagle", "eagle"), ("vllm-medusa", "medusa")])
def test_the_exports_written_here_keep_the_contract(fmt, head, tmp_path, heads, tiny_target, shape):
    out = _export(tmp_path, heads, tiny_target, fmt, head)
    check_contract(out, EXPORTS[fmt], shape, k=3, head_config=heads[head].config)


CASES = [
    # (format, head, config edits, field named): layer ids counted in the other format's convention ...
    ("vllm-eagle3", "eagle3", {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}, "eagle_aux_hidden_state_layer_ids"),
    ("vllm-dflash", "dflash", {"dflash_config__target_layer_ids": [1, 3]}, "dflash_config.target_layer_ids"),
    ("vllm-dflash", "dflash", {"dflash_config__target_layer_ids": [1, 4]}, "dflash_config.target_layer_ids"),
    # ... the block size against the K it is served with, the mask token ...
    ("vllm-dflash", "dflash", {"block_size": 3}, "block_size"),
    ("vllm-dspark", "dspark", {"dflash_config__mask_token_id": 10**6}, "dflash_config.mask_token_id"),
    ("vllm-dspark", "dspark", {"mask_token_id": 5}, "mask_token_id"),
    # ... the fc input's normalisation, and the sizes against the target
    ("vllm-eagle3", "eagle3", {"norm_before_fc": True}, "norm_before_fc"),
    ("vllm-eagle3", "eagle3", {"vocab_size": 32000}, "vocab_size"),
    ("vllm-eagle3", "eagle3", {"target_hidden_size": 4096}, "target_hidden_size"),
    ("speculators", "eagle3", {"transformer_layer_config__vocab_size": 50000}, "vocab_size"),
    ("vllm-dflash", "dflash", {"target_hidden_size": 128}, "target_hidden_size"),
]


@pytest.mark.parametrize("fmt,head,edits,field", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_a_broken_field_is_one_line_naming_it(fmt, head, edits, field, tmp_path, heads, tiny_target, shape):
    out = _export(tmp_path, heads, tiny_target, fmt, head)
    check_contract(out, EXPORTS[fmt], shape, k=3, head_config=heads[head].config)  # as written: kept
    _edit(out, **edits)
    with pytest.raises(DraftheadsError) as e:
        check_contract(out, EXPORTS[fmt], shape, k=3, head_config=heads[head].config)
    msg = str(e.value)
    assert f"({fmt}): {field} " in msg and "\n" not in msg, msg


def test_the_draft_vocabulary_maps_must_agree(tmp_path, heads, tiny_target, shape):
    out = _export(tmp_path, heads, tiny_target, "vllm-eagle3", "eagle3")
    weights = load_file(str(out / "model.safetensors"))
    for name, broken, said in [
        ("t2d", lambda w: torch.roll(w["t2d"], 1), "t2d does not mark exactly"),
        ("d2t", lambda w: -torch.arange(w["d2t"].numel()), "d2t maps two draft ids to one target id"),
        ("d2t", lambda w: w["d2t"] + shape.vocab_size, "d2t maps draft ids outside"),
    ]:
        save_file({**weights, name: broken(weights)}, str(out / "model.safetensors"))
        with pytest.raises(DraftheadsError, match=said):
            check_contract(out, EXPORTS["vllm-eagle3"], shape)
    save_file(weights, str(out / "model.safetensors"))
    check_contract(out, EXPORTS["vllm-eagle3"], shape)


def test_an_export_for_another_target_is_refused_before_it_is_written(tmp_path, heads, tiny_target):
    """export_head checks the contract against the target it is given, and writes nothing when it breaks."""
    import dataclasses

    head = heads["dflash"]
    wrong = type(head)(dataclasses.replace(head.config, target_layer_ids=(1, 5)))  # past the 4 layers
    with pytest.raises(DraftheadsError, match="dflash_config.target_layer_ids"):
        export_head(wrong, "vllm-dflash", tmp_path / "x", k=3, target=tiny_target)
    assert not (tmp_path / "x").exists()
