import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftheads.errors import DraftheadsError
from draftheads.export.imports import import_checkpoint, load_weights
from draftheads.export.vllm import export_head, validate_export
from draftheads.heads import load_head
from draftheads.testing import random_heads


@pytest.fixture(scope="module")
def heads(tiny_target):
    hs = random_heads(tiny_target.model, seed=3)
    from draftheads.heads import MedusaConfig, MedusaHeads

    hs["medusa_vocab"] = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=tiny_target.info.vocab_size, num_heads=2,
                                                  num_layers=2, draft_vocab_size=50))
    for p in hs["medusa_vocab"].parameters():
        torch.nn.init.normal_(p, std=0.1)
    hs["medusa_vocab"].token_map.copy_(torch.arange(50) * 3)
    hs["medusa_shared"] = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=tiny_target.info.vocab_size, num_heads=3,
                                                   num_layers=1, share_lm_head=True, draft_vocab_size=40))
    for p in hs["medusa_shared"].parameters():
        torch.nn.init.normal_(p, std=0.1)
    hs["medusa_shared"].token_map.copy_(torch.arange(40) * 5 + 1)
    hs["eagle3"].aux_scale.copy_(torch.tensor([2.0, 30.0, 700.0]))  # exports must fold it into fc
    from dataclasses import replace

    from draftheads.heads import Eagle3Head

    hs["eagle3_deep"] = Eagle3Head(replace(hs["eagle3"].config, num_layers=2))  # layers as vLLM's EAGLE-3 stacks them
    for p in hs["eagle3_deep"].parameters():
        torch.nn.init.normal_(p, std=0.1)
    hs["eagle3_deep"].d2t.copy_(hs["eagle3"].d2t)
    hs["eagle3_deep"].t2d.copy_(hs["eagle3"].t2d)

    from draftheads.heads import DFlashHead

    hs["dflash_vocab"] = DFlashHead(replace(hs["dflash"].config, draft_vocab_size=50, causal=True))
    for p in hs["dflash_vocab"].parameters():
        torch.nn.init.normal_(p, std=0.1)
    hs["dflash_vocab"].d2t.copy_(torch.arange(50) * 2)  # target id = i + d2t[i] = 3i
    from draftheads.heads import DSparkHead

    hs["dspark_vocab"] = DSparkHead(replace(hs["dspark"].config, draft_vocab_size=50, confidence_with_markov=False,
                                            sample_from_anchor=False))
    for p in hs["dspark_vocab"].parameters():
        torch.nn.init.normal_(p, std=0.1)
    hs["dspark_vocab"].d2t.copy_(torch.arange(50) * 2)
    return hs


def _logits(head, model, seed=0):
    """Logits of one draft step on fixed random inputs (what vLLM would compute)."""
    g = torch.Generator().manual_seed(seed)
    h = model.config.hidden_size
    w = model.get_output_embeddings().weight
    if head.head_type == "medusa":
        return head.logits(torch.randn(1, 3, h, generator=g), w)
    if head.head_type in ("dflash", "dspark"):
        from draftheads.heads.dflash import block_attention_mask

        c = head.config
        if head.head_type == "dspark":  # the mask slots are the target's row (not saved with the head)
            head.use_target_mask(model.get_input_embeddings().weight)
        with torch.no_grad():
            feats = torch.randn(1, 7, len(c.target_layer_ids) * h, generator=g)
            kv = head.context_kv(head.context(feats), torch.arange(7)[None])
            block = head.block_inputs(torch.randn(1, 1, h, generator=g))
            mask = block_attention_mask(torch.tensor([[6]]), torch.zeros(1, 7, dtype=torch.long), c.block_size,
                                        c.causal)
            out = head(block, torch.arange(6, 6 + c.block_size)[None], kv, mask)
            if head.head_type == "dflash":
                return out @ head.projection(w).T
            prev = torch.randint(c.vocab_size, out.shape[:2], generator=g)
            logits = head.markov_inputs(out, prev) @ head.markov_projection(w).T
            conf = head.confidence_logit(out, prev) if c.confidence_head else logits.new_zeros(0)
            return torch.cat([logits.flatten(), conf.flatten()])
    emb, feat = torch.randn(1, 3, h, generator=g), torch.randn(1, 3, h, generator=g)
    pos = torch.arange(3)[None]
    with torch.no_grad():
        if head.head_type == "eagle":
            out, _ = head(emb, feat, pos)
            return out @ head.projection(w).T
        out, _ = head(emb, head.fuse(torch.randn(1, 3, 3 * h, generator=g)), pos)
        return head.lm_head(head.normed(out))


@pytest.mark.parametrize("name,fmt,source", [
    ("eagle3", "vllm-eagle3", "eagle3"),
    ("eagle3", "speculators", "speculators"),
    ("eagle3_deep", "vllm-eagle3", "eagle3"),
    ("eagle3_deep", "speculators", "speculators"),
    ("eagle", "vllm-eagle", "eagle"),
    ("medusa", "vllm-medusa", "medusa"),
    ("medusa_shared", "vllm-medusa", "medusa"),
    ("dflash", "vllm-dflash", "dflash"),
    ("dflash_vocab", "vllm-dflash", "dflash"),
    ("dspark", "vllm-dspark", "dspark"),
    ("dspark_vocab", "vllm-dspark", "dspark"),
])
def test_export_import_round_trip_identical_logits(heads, tiny_target, tiny_llama_dir, tmp_path, name, fmt, source):
    head = heads[name]
    out, cmd = export_head(head, fmt, tmp_path / "export", verifier=str(tiny_llama_dir), k=3, target=tiny_target)
    assert '"num_speculative_tokens": 3' in cmd and '"method"' in cmd
    import_checkpoint(source, out, tmp_path / "back", target_layers=tiny_target.info.num_layers)
    back, meta = load_head(tmp_path / "back")
    assert meta["imported_from"]["source"] == source
    # bitwise equal except the EAGLE-3 fc, where folding aux_scale into the weight rounds differently
    torch.testing.assert_close(_logits(back, tiny_target.model), _logits(head, tiny_target.model), rtol=1e-5, atol=1e-6)


def test_eagle3_export_fields(heads, tmp_path):
    out, _ = export_head(heads["eagle3"], "vllm-eagle3", tmp_path / "e3", verifier="t")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert isinstance(cfg[flag], bool)
    w = load_file(str(out / "model.safetensors"))
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    ids = torch.arange(64) + w["d2t"]
    assert torch.equal(w["t2d"].nonzero().flatten(), ids)  # offsets, not absolute ids
    assert w["layers.0.self_attn.q_proj.weight"].shape[1] == 128  # 2H inputs


@pytest.mark.parametrize("fmt", ["vllm-eagle3", "speculators"])
def test_exported_rope_theta_readable_by_older_transformers(heads, tiny_target, tmp_path, fmt):
    heads["eagle3"].config.layer.rope_theta = 123456.0  # not a default any reader could fall back to
    try:
        out, _ = export_head(heads["eagle3"], fmt, tmp_path / fmt, verifier="t", target=tiny_target)
    finally:
        heads["eagle3"].config.layer.rope_theta = tiny_target.model.config.rope_parameters["rope_theta"]
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    assert layer["rope_theta"] == 123456.0 and layer["rope_parameters"]["rope_theta"] == 123456.0


def test_medusa_export_matches_what_vllm_032_loads(heads, tiny_target, tmp_path):
    out, cmd = export_head(heads["medusa_shared"], "vllm-medusa", tmp_path / "shared", target=tiny_target)
    assert """--model-loader-extra-config '{"enable_weights_track": false}'""" in cmd  # vLLM 0.32 token_map load
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    assert cfg["original_lm_head"] is True and cfg["truncated_vocab_size"] == 40
    assert [k for k in w if k.startswith("lm_heads.")] == ["lm_heads.0.weight"]  # one lm_head, the target's rows
    assert torch.equal(w["lm_heads.0.weight"], tiny_target.model.get_output_embeddings().weight[torch.arange(40) * 5 + 1])
    with pytest.raises(DraftheadsError, match="share_lm_head"):  # per-head lm_heads over a draft vocab
        export_head(heads["medusa_vocab"], "vllm-medusa", tmp_path / "vocab", target=tiny_target)


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_validation_rejects_missing_or_extra_weight(heads, tmp_path, change):
    out, _ = export_head(heads["eagle3"], "vllm-eagle3", tmp_path / "e3", verifier="t")
    w = load_file(str(out / "model.safetensors"))
    if change == "missing":
        del w["layers.0.hidden_norm.weight"]
    else:
        w["fc.bias"] = torch.zeros(64)
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(DraftheadsError, match="missing \\['layers.0.hidden_norm.weight'\\]" if change == "missing"
                       else "unexpected \\['fc.bias'\\]"):
        validate_export(out, "vllm-eagle3")


def _public_medusa(tmp_path, heads, ext):
    """FasterDecoding layout, built from the documented key names."""
    h = heads["medusa"]
    w = {}
    for i, blocks in enumerate(h.blocks):
        for j, layer in enumerate(blocks.layers):
            w[f"{i}.{j}.linear.weight"] = layer.linear.weight.detach().clone()
            w[f"{i}.{j}.linear.bias"] = layer.linear.bias.detach().clone()
        w[f"{i}.{len(blocks.layers)}.weight"] = h.lm_heads[i].weight.detach().clone()
    d = tmp_path / "fd-medusa"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "x"}))
    if ext == "pt":
        torch.save(w, d / "medusa_lm_head.pt")
    else:
        save_file(w, str(d / "medusa_lm_head.safetensors"))
    return d


@pytest.mark.parametrize("ext", ["pt", "safetensors"])
def test_public_medusa_layout_imports(heads, tiny_target, tmp_path, ext):
    d = _public_medusa(tmp_path, heads, ext)
    head = import_checkpoint("medusa", d, tmp_path / "out")
    torch.testing.assert_close(_logits(head, tiny_target.model), _logits(heads["medusa"], tiny_target.model))


def test_public_eagle1_layout_with_bias_imports(heads, tiny_target, tiny_llama_dir, tmp_path):
    src = heads["eagle"]
    w = {k: v.clone() for k, v in src.state_dict().items() if not k.startswith("rotary")}
    w["fc.bias"] = torch.zeros(64)
    w["embed_tokens.weight"] = torch.zeros(10, 64)  # public checkpoints sometimes carry it
    d = tmp_path / "eagle1"
    d.mkdir()
    torch.save(w, d / "pytorch_model.bin")
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg))
    head = import_checkpoint("eagle", d, tmp_path / "out")
    assert head.config.fc_bias
    torch.testing.assert_close(_logits(head, tiny_target.model), _logits(src, tiny_target.model))
    with pytest.raises(DraftheadsError, match="fc.bias"):
        export_head(head, "vllm-eagle", tmp_path / "x")


def test_public_eagle3_midlayer_layout_imports(heads, tiny_target, tiny_llama_dir, tmp_path):
    src = heads["eagle3"]
    w = {k.replace("layers.0.", "midlayer."): v.clone() for k, v in src.state_dict().items()
         if not k.startswith(("rotary", "aux_scale"))}
    w["fc.weight"] = src.folded_fc_weight().detach().clone()  # public checkpoints act on unscaled states
    d = tmp_path / "eagle3"
    d.mkdir()
    save_file(w, str(d / "model.safetensors"))
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg.update({"draft_vocab_size": 64, "eagle_aux_hidden_state_layer_ids": list(src.config.aux_layer_ids)})
    (d / "config.json").write_text(json.dumps(cfg))
    head = import_checkpoint("eagle3", d, tmp_path / "out")
    torch.testing.assert_close(_logits(head, tiny_target.model), _logits(src, tiny_target.model))
    cfg["norm_output"] = True  # a variant whose next step reads the normed state: refused, not misread
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftheadsError, match="norm_output"):
        import_checkpoint("eagle3", d, tmp_path / "out2")


def test_eagle3_export_declares_pre_norm_recurrence(heads, tmp_path):
    out, _ = export_head(heads["eagle3"], "vllm-eagle3", tmp_path / "e3", verifier="t")
    cfg = json.loads((out / "config.json").read_text())
    # Eagle3Head.forward hands the pre-norm state to the next step; vLLM does that only with norm_output false
    assert cfg["norm_output"] is False and cfg["norm_before_fc"] is False and cfg["fc_norm"] is False


class _Evil:
    def __reduce__(self):
        return (print, ("this would run code",))


def test_legacy_pickle_needing_code_is_refused(tmp_path):
    f = tmp_path / "medusa_lm_head.pt"
    with open(f, "wb") as fh:
        pickle.dump({"0.0.linear.weight": _Evil()}, fh)
    with pytest.raises(DraftheadsError, match="refused"):
        load_weights(f)


def test_imported_head_runs_in_engine(heads, tiny_target, tmp_path):
    from draftheads.inference.build import make_proposer
    from draftheads.inference.engine import Engine
    from draftheads.inference.sampling import SamplingParams

    out, _ = export_head(heads["eagle3"], "vllm-eagle3", tmp_path / "e3", verifier="t")
    import_checkpoint("eagle3", out, tmp_path / "head")
    proposer = make_proposer(tiny_target, str(tmp_path / "head"))
    spec = Engine(tiny_target.model, proposer=proposer, tree="small").generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, stop_at_eos=False))
    plain = Engine(tiny_target.model).generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, stop_at_eos=False))
    assert spec[0].token_ids == plain[0].token_ids and spec[0].metrics.drafts > 0


def test_dflash_layer_ids_name_the_same_states_as_vllm(heads, tiny_target, tmp_path):
    """Ours: HF hidden-state id i (the residual stream after i decoder layers). vLLM's
    dflash_config.target_layer_ids: the output of decoder layer j (0-based), captured as aux id j + 1.
    The export writes j = i - 1, and the state vLLM reads there is the one our engine reads."""
    from draftheads.targets import decoder_parts, hidden_states

    head = heads["dflash"]
    out, _ = export_head(head, "vllm-dflash", tmp_path / "d", verifier="t", k=2)
    cfg = json.loads((out / "config.json").read_text())
    ids = list(head.config.target_layer_ids)
    assert cfg["dflash_config"]["target_layer_ids"] == [i - 1 for i in ids]
    model = tiny_target.model
    _, layers, _ = decoder_parts(model)
    seen = {}
    hooks = [layers[j].register_forward_hook(lambda m, a, o, j=j: seen.__setitem__(j, o[0] if isinstance(o, tuple) else o))
             for j in cfg["dflash_config"]["target_layer_ids"]]
    x = torch.tensor([[5, 6, 7, 8, 9]])
    try:
        ours, _ = hidden_states(model, x, ids)
    finally:
        for h in hooks:
            h.remove()
    for i, j in zip(ids, cfg["dflash_config"]["target_layer_ids"]):
        torch.testing.assert_close(ours[i], seen[j].reshape(ours[i].shape))


def test_dflash_export_refuses_what_vllm_cannot_serve(heads, tmp_path):
    with pytest.raises(DraftheadsError, match="at most block_size - 1"):
        export_head(heads["dflash"], "vllm-dflash", tmp_path / "a", verifier="t", k=heads["dflash"].config.block_size)
    from dataclasses import replace

    from draftheads.heads import DFlashHead

    windowed = DFlashHead(replace(heads["dflash"].config, sliding_window=4))
    with pytest.raises(DraftheadsError, match="sliding-window"):
        export_head(windowed, "vllm-dflash", tmp_path / "b", verifier="t", k=2)


def test_dspark_export_fields_and_refusals(heads, tmp_path):
    head = heads["dspark"]
    c = head.config
    out, cmd = export_head(head, "vllm-dspark", tmp_path / "s", verifier="t", k=c.block_size)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and '"method": "dspark"' in cmd
    assert cfg["markov_rank"] == c.markov_rank and cfg["sample_from_anchor"] is True
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    # the top-level and dflash_config copies name the same 0-based layers (vLLM reads either)
    assert cfg["dflash_config"]["target_layer_ids"] == [i - 1 for i in c.target_layer_ids]
    assert cfg["mask_token_id"] == cfg["dflash_config"]["mask_token_id"] == c.mask_token_id
    w = load_file(str(out / "model.safetensors"))
    assert w["markov_head.markov_w1.weight"].shape == (c.vocab_size, c.markov_rank)
    assert w["confidence_head.proj.weight"].shape == (1, c.hidden_size + c.markov_rank)
    assert "mask_embedding" not in w  # vLLM's DSpark embeds the mask token with the target's row
    with pytest.raises(DraftheadsError, match="more than this dspark head drafts"):  # anchor mode drafts block_size
        export_head(head, "vllm-dspark", tmp_path / "k", verifier="t", k=c.block_size + 1)
    from dataclasses import replace

    from draftheads.heads import DSparkHead

    with pytest.raises(DraftheadsError, match="markov_rank 0"):
        export_head(DSparkHead(replace(c, markov_rank=0, confidence_with_markov=False)), "vllm-dspark",
                    tmp_path / "r", verifier="t", k=2)


def test_dspark_import_refuses_a_dflash_checkpoint_or_missing_confidence_weights(heads, tmp_path):
    out, _ = export_head(heads["dflash"], "vllm-dflash", tmp_path / "d", verifier="t", k=2)
    with pytest.raises(DraftheadsError, match="no markov_rank: a DFlash checkpoint"):
        import_checkpoint("dspark", out, tmp_path / "x")
    out, _ = export_head(heads["dspark"], "vllm-dspark", tmp_path / "s", verifier="t", k=2)
    with pytest.raises(DraftheadsError, match="import it --from dspark"):
        import_checkpoint("dflash", out, tmp_path / "y")
    w = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in w.items() if not k.startswith("confidence_head.")}, str(out / "model.safetensors"))
    with pytest.raises(DraftheadsError, match="enable_confidence_head is true but"):
        import_checkpoint("dspark", out, tmp_path / "z")
