"""Import public draft-head checkpoints into head directories.

Sources (``--from``):

* ``medusa``: FasterDecoding Medusa (``medusa_lm_head.safetensors|.pt``; keys ``{h}.{l}.linear.weight/bias``
  and ``{h}.{L}.weight`` for the projection; config ``medusa_num_heads``, ``medusa_num_layers``), or a
  vLLM Medusa export (``blocks.{h}.layers.{l}.*``, ``lm_heads.{h}.weight``).
* ``eagle``: SafeAILab EAGLE-1 (``fc.weight[/bias]``, ``layers.0.*``; Llama config).
* ``eagle3``: SafeAILab EAGLE-3 (``midlayer.*`` or ``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``,
  ``t2d``; Llama config with ``draft_vocab_size``).
* ``speculators``: vllm-project/speculators eagle3 (``transformer_layer_config``).
* ``dflash``: the HF layout of vLLM's ``DFlashDraftModel`` (z-lab's), optional ``mask_embedding.pt``.
* ``dspark``: vLLM's ``Qwen3DSparkModel`` layout (the DFlash one plus ``markov_head.*`` and
  ``confidence_head.*``).

Weights load from safetensors, or from legacy ``.pt``/``.bin`` only through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import torch

from draftheads.errors import DraftheadsError
from draftheads.heads import (
    DFlashConfig,
    DFlashHead,
    DSparkConfig,
    DSparkHead,
    Eagle3Config,
    Eagle3Head,
    EagleConfig,
    EagleHead,
    LayerSpec,
    MedusaConfig,
    MedusaHeads,
    save_head,
)
from draftheads.utils import load_safetensors

_WEIGHT_FILES = ("model.safetensors", "medusa_lm_head.safetensors", "pytorch_model.bin", "medusa_lm_head.pt",
                 "model.pt", "pytorch_model.pt")


def load_weights(src: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Weights of a checkpoint file or directory (safetensors, or weights-only legacy pickles)."""
    src = Path(src)
    files = [src] if src.is_file() else [src / f for f in _WEIGHT_FILES if (src / f).is_file()]
    if not files:
        shards = sorted(src.glob("*.safetensors")) if src.is_dir() else []
        if not shards:
            raise DraftheadsError(f"{src}: no weights found (looked for {', '.join(_WEIGHT_FILES)} and *.safetensors)")
        out = {}
        for s in shards:
            out.update(load_safetensors(s))
        return out
    f = files[0]
    if f.suffix == ".safetensors":
        return load_safetensors(f)
    if f.suffix not in (".pt", ".bin", ".pth"):
        raise DraftheadsError(f"{f}: unsupported weight file: use safetensors, or .pt/.bin tensors-only checkpoints")
    try:
        obj = torch.load(str(f), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, ValueError) as e:
        raise DraftheadsError(
            f"{f}: refused: this pickle needs more than tensors to load ({str(e).splitlines()[0][:120]}); "
            "only weights-only checkpoints are loaded: convert it to safetensors where you trust it"
        ) from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise DraftheadsError(f"{f}: not a dictionary of tensors")
    return obj


class _Fields(dict):
    """A checkpoint's config: a missing field is one error naming the file, not a KeyError."""

    where = ""

    def __missing__(self, key):
        raise DraftheadsError(f"{self.where}: field {key!r} is missing: this is not a checkpoint of the kind "
                              "--from names (or it is damaged)")


def _config(src: Path) -> dict:
    f = src / "config.json" if src.is_dir() else src.parent / "config.json"
    if not f.is_file():
        raise DraftheadsError(f"{src}: config.json not found next to the weights")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DraftheadsError(f"{f} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise DraftheadsError(f"{f} must hold a JSON object")
    fields = _Fields(cfg)
    fields.where = str(f)
    for k, v in cfg.items():
        if isinstance(v, dict):
            sub = _Fields(v)
            sub.where = f"{f} ({k})"
            fields[k] = sub
    return fields


def _layer_spec(cfg: dict) -> LayerSpec:
    from transformers import LlamaConfig

    allowed = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "auto_map")}
    return LayerSpec.from_hf_config(LlamaConfig(**allowed))


def _load_strict(head, weights: dict[str, torch.Tensor], src) -> None:
    try:
        missing, unexpected = head.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shapes
        raise DraftheadsError(f"{src}: weights do not fit the config: {' '.join(str(e).split())[:300]}") from None
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise DraftheadsError(f"{src}: weights do not match (missing {missing[:5]}, unexpected {unexpected[:5]})")


def import_medusa(src: Path) -> MedusaHeads:
    w = load_weights(src)
    if any(k.startswith("blocks.") for k in w):  # vLLM layout
        w = {re.sub(r"^blocks\.(\d+)\.layers\.(\d+)\.", r"\1.\2.linear.", k): v for k, v in w.items()}
        w = {re.sub(r"^lm_heads\.(\d+)\.weight$", r"\1.LM.weight", k): v for k, v in w.items()}
    heads = sorted({int(k.split(".")[0]) for k in w if k.split(".")[0].isdigit()})
    if not heads:
        raise DraftheadsError(f"{src}: no Medusa keys like '0.0.linear.weight' found")
    layers = sorted({int(k.split(".")[1]) for k in w if k.endswith(".linear.weight") and k.startswith("0.")})
    n_layers = len(layers)
    proj_key = "0.LM.weight" if "0.LM.weight" in w else f"0.{n_layers}.weight"
    if proj_key not in w:
        raise DraftheadsError(f"{src}: Medusa head 0 has no projection '{proj_key}'")
    vocab, hidden = w[proj_key].shape
    token_map = w.get("token_map")
    cfg = {}
    try:
        cfg = _config(src)
    except DraftheadsError:
        pass
    shared = bool(cfg.get("original_lm_head"))  # one lm_head: the target's own rows
    n_heads = cfg.get("medusa_num_heads", cfg.get("num_heads", len(heads)))
    if n_heads != len(heads):
        raise DraftheadsError(f"{src}: config says {n_heads} heads but the weights hold {len(heads)}")
    full_vocab = cfg.get("vocab_size", vocab) if token_map is not None else vocab
    head = MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=full_vocab, num_heads=len(heads),
                                    num_layers=n_layers, share_lm_head=shared,
                                    draft_vocab_size=vocab if token_map is not None else None))
    state = {}
    for h in heads:
        for i in range(n_layers):
            state[f"blocks.{h}.layers.{i}.linear.weight"] = w[f"{h}.{i}.linear.weight"]
            state[f"blocks.{h}.layers.{i}.linear.bias"] = w[f"{h}.{i}.linear.bias"]
        if not shared:
            state[f"lm_heads.{h}.weight"] = w[f"{h}.LM.weight" if f"{h}.LM.weight" in w else f"{h}.{n_layers}.weight"]
    if token_map is not None:
        state["token_map"] = token_map.to(torch.int64)
    _load_strict(head, state, src)
    return head


def import_eagle(src: Path) -> EagleHead:
    w = load_weights(src)
    cfg = _config(src)
    if "fc.weight" not in w:
        raise DraftheadsError(f"{src}: no fc.weight: not an EAGLE-1 checkpoint")
    has_bias = "fc.bias" in w
    head = EagleHead(EagleConfig(layer=_layer_spec(cfg), vocab_size=cfg["vocab_size"], fc_bias=has_bias))
    state = {k: v for k, v in w.items() if k.startswith(("fc.", "layers.0."))}
    state = {k: v for k, v in state.items() if "input_layernorm" not in k and "rotary" not in k}
    _load_strict(head, state, src)
    return head


def _eagle3_from(w: dict, layer: LayerSpec, vocab: int, draft_vocab: int, aux, target_hidden, norm_before_residual,
                 src) -> Eagle3Head:
    w = {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in w.items()}
    # as many decoder layers as the weights hold (a config may carry its target's num_hidden_layers)
    num_layers = 1 + max((int(m[1]) for k in w if (m := re.match(r"^layers\.(\d+)\.", k))), default=0)
    # the later layers' hidden_norm, which vLLM's model holds and only the first layer reads
    unread = re.compile(r"^layers\.[1-9]\d*\.hidden_norm\.")
    w = {k: v for k, v in w.items() if not k.startswith("embed_tokens.") and "rotary" not in k and not unread.match(k)}
    head = Eagle3Head(Eagle3Config(layer=layer, vocab_size=vocab, draft_vocab_size=draft_vocab, aux_layer_ids=aux,
                                   target_hidden_size=target_hidden, norm_before_residual=norm_before_residual,
                                   num_layers=num_layers))
    d2t = w.get("d2t")
    if d2t is not None and int((torch.arange(d2t.numel()) + d2t).max()) >= vocab:
        raise DraftheadsError(f"{src}: d2t does not hold offsets into a vocabulary of {vocab}")
    w["t2d"] = w["t2d"].to(torch.bool) if "t2d" in w else torch.zeros(vocab, dtype=torch.bool).index_fill_(
        0, torch.arange(draft_vocab) + d2t, True)
    w["d2t"] = d2t.to(torch.int64)
    w["aux_scale"] = torch.ones(3)  # public checkpoints apply fc to unscaled states
    _load_strict(head, w, src)
    return head


def _aux_ids(cfg: dict, num_layers: int | None):
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(ids)
    if num_layers is None:
        raise DraftheadsError(
            "the checkpoint does not name its target layers (eagle_aux_hidden_state_layer_ids): "
            "pass --target-layers N so the default (2, N//2, N-3) can be used"
        )
    from draftheads.heads import default_aux_layer_ids

    return default_aux_layer_ids(num_layers)


def _check_eagle3_variant(cfg: dict, src) -> None:
    """Our EAGLE-3 layer feeds the pre-norm output to the next step and has no fc norms."""
    flags = {k: cfg[k] for k in ("norm_before_fc", "fc_norm", "norm_output") if cfg.get(k)}
    if flags:
        raise DraftheadsError(f"{src}: EAGLE-3 variant with {flags} is not supported: only checkpoints with "
                              "norm_before_fc, fc_norm and norm_output false (the SafeAILab layout) import")


def import_eagle3(src: Path, target_layers: int | None = None) -> Eagle3Head:
    w, cfg = load_weights(src), _config(src)
    _check_eagle3_variant(cfg, src)
    return _eagle3_from(w, _layer_spec(cfg), cfg["vocab_size"], cfg["draft_vocab_size"], _aux_ids(cfg, target_layers),
                        cfg.get("target_hidden_size") or cfg["hidden_size"], cfg.get("norm_before_residual", False), src)


def import_speculators(src: Path, target_layers: int | None = None) -> Eagle3Head:
    w, cfg = load_weights(src), _config(src)
    if cfg.get("speculators_model_type") != "eagle3":
        raise DraftheadsError(f"{src}: speculators_model_type {cfg.get('speculators_model_type')!r}: only eagle3 is supported")
    _check_eagle3_variant(cfg, src)
    layer = cfg["transformer_layer_config"]
    return _eagle3_from(w, _layer_spec(layer), layer["vocab_size"], cfg["draft_vocab_size"],
                        _aux_ids(cfg, target_layers), cfg.get("target_hidden_size") or layer["hidden_size"],
                        cfg.get("norm_before_residual", False), src)


def _block_config(cfg: dict, w: dict, src: Path) -> dict:
    """DFlashConfig fields of a DFlash-layout config (DSpark's too)."""
    dcfg = cfg.get("dflash_config") or {}
    if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
        raise DraftheadsError(f"{src}: sliding-window block-drafter layers are not supported: import a full-attention head")
    ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if ids is None or mask is None:
        raise DraftheadsError(f"{src}/config.json lacks target_layer_ids or mask_token_id (in dflash_config or at "
                              "the top level)")
    return dict(
        layer=_layer_spec(cfg), vocab_size=cfg["vocab_size"], target_layer_ids=tuple(i + 1 for i in ids),
        mask_token_id=mask, num_layers=cfg["num_hidden_layers"], block_size=int(cfg.get("block_size") or 16),
        target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") if "lm_head.weight" in w else None,
        causal=bool(cfg.get("is_causal", dcfg.get("causal", False))),
    )


def _block_state(head, w: dict) -> dict:
    state = {k: v for k, v in w.items() if not k.startswith(("embed_tokens.", "t2d"))}
    if "lm_head.weight" in state and head.config.draft_vocab_size is None:
        state.pop("lm_head.weight")  # a full-vocabulary copy of the target's lm_head: the target's is used
    return state


def import_dflash(src: Path) -> DFlashHead:
    """The HF layout vLLM's ``DFlashDraftModel`` loads (z-lab's): ``dflash_config.target_layer_ids`` count
    decoder-layer outputs from 0 (HF hidden-state id = id + 1); a ``mask_embedding.pt`` beside the weights
    (a tensor, or ``{"embedding": ...}``) is the learned mask, else the target's row of the mask token is
    used when the head runs (it starts as zeros here: import with the target's embedding row to match)."""
    w, cfg = load_weights(src), _config(src)
    if "markov_rank" in cfg:
        raise DraftheadsError(f"{src} is a DSpark checkpoint (markov_rank {cfg['markov_rank']}): import it --from dspark")
    head = DFlashHead(DFlashConfig(**_block_config(cfg, w, src)))
    state = _block_state(head, w)
    folder = src if src.is_dir() else src.parent
    mask = folder / "mask_embedding.pt"
    if mask.is_file():
        obj = torch.load(str(mask), map_location="cpu", weights_only=True)
        state["mask_embedding"] = obj["embedding"] if isinstance(obj, dict) else obj
    else:
        state["mask_embedding"] = torch.zeros(head.config.hidden_size)
    _load_strict(head, state, src)
    return head


def import_dspark(src: Path) -> DSparkHead:
    """vLLM's ``Qwen3DSparkModel`` layout: target layers and the mask token in ``dflash_config`` or at the top
    level (0-based, as for DFlash); ``enable_confidence_head`` needs the ``confidence_head.*`` weights."""
    w, cfg = load_weights(src), _config(src)
    if "markov_rank" not in cfg:
        raise DraftheadsError(f"{src}/config.json has no markov_rank: a DFlash checkpoint has no Markov or confidence "
                              "head; import it --from dflash")
    conf = bool(cfg.get("enable_confidence_head", False))
    if conf and "confidence_head.proj.weight" not in w:
        raise DraftheadsError(f"{src}: enable_confidence_head is true but the checkpoint has no confidence_head "
                              "weights: set it false in config.json, or use a checkpoint trained with one")
    with_markov = bool(cfg.get("confidence_head_with_markov", False))
    head = DSparkHead(DSparkConfig(
        **_block_config(cfg, w, src), markov_rank=int(cfg["markov_rank"]), confidence_head=conf,
        confidence_with_markov=conf and with_markov, sample_from_anchor=bool(cfg.get("sample_from_anchor", True)),
    ))
    _load_strict(head, _block_state(head, w), src)
    return head


SOURCES: dict[str, Callable] = {
    "medusa": lambda src, layers: import_medusa(src),
    "eagle": lambda src, layers: import_eagle(src),
    "eagle3": import_eagle3,
    "speculators": import_speculators,
    "dflash": lambda src, layers: import_dflash(src),
    "dspark": lambda src, layers: import_dspark(src),
}
"""Public checkpoint format (``--from``) -> (path, target layers or None) -> the head; a new family's
importer joins with :func:`register_source`."""


def register_source(name: str, importer: Callable) -> Callable:
    """Add a public checkpoint format: ``importer(path, target_layers)`` returns the head module."""
    SOURCES[name] = importer
    return importer


def import_checkpoint(source: str, src: str | os.PathLike, out: str | os.PathLike, target_layers: int | None = None,
                      overwrite: bool = False):
    if source not in SOURCES:
        raise DraftheadsError(f"--from {source!r} is unknown: use one of {', '.join(SOURCES)}")
    src = Path(src)
    if not src.exists():
        raise DraftheadsError(f"{src} does not exist: point at the checkpoint directory or weight file")
    head = SOURCES[source](src, target_layers)
    save_head(head, out, {"imported_from": {"source": source, "path": str(src)}}, overwrite=overwrite, inputs=(src,))
    return head
