"""Verify-cost curve: time of one target forward with K query tokens (a chain) after a prefix, with the
logits of all K, on this machine, through the engine's own paged-attention path."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from draftheads.inference.engine import Engine
from draftheads.inference.proposers.base import RequestState
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import Tree, chain_parents
from draftheads.utils import atomic_write_json, cache_dir

DEFAULT_KS = (1, 2, 4, 8, 16, 32, 64)


@torch.no_grad()
def verify_curve(model, ks=DEFAULT_KS, prefix: int = 256, repeats: int = 5, batch: int = 1) -> dict[int, float]:
    """Median milliseconds of one forward over ``batch`` rows of ``k`` query tokens each."""
    engine = Engine(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    blocks = batch * (-(-(prefix + max(ks)) // engine.config.block_size) + 1)
    out = {}
    for k in ks:
        cache = engine.new_cache(blocks)
        states, pre_trees = [], []
        for r in range(batch):
            toks = torch.randint(vocab, (prefix + 1,), generator=gen).tolist()
            st = RequestState(r, prefix, toks, SamplingParams(), gen)
            states.append(st)
            cache.add(r)
            pre_trees.append(Tree(toks[:-1], chain_parents(prefix - 1)))
        engine.forward(cache, states, pre_trees, ())
        for st in states:
            cache.truncate(st.rid, prefix)
        times = []
        for rep in range(repeats + 1):
            trees = [Tree([st.root] + torch.randint(vocab, (k - 1,), generator=gen).tolist(), chain_parents(k - 1))
                     for st in states]
            t0 = time.perf_counter()
            logits, _ = engine.forward(cache, states, trees, ())
            logits.all()  # every query token's logits, as a full verification of a K-node tree reads
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            if rep:  # the first repeat warms up
                times.append((time.perf_counter() - t0) * 1000)
            for st in states:
                cache.truncate(st.rid, prefix)
        out[k] = statistics.median(times)
    return out


def profile_key(model) -> tuple[str, str]:
    """The device type and dtype a verify curve holds for: a bf16 forward's K-token cost differs from a
    float32 one's (on a CPU with native bf16 its matmuls cost about the same at K = 1 and K = 4)."""
    p = next(model.parameters())
    return p.device.type, str(p.dtype).removeprefix("torch.")


def profile_path(target_name: str, device: str, dtype: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in target_name)
    return cache_dir() / "profiles" / f"{safe}-{device}-{dtype}.json"


def save_profile(target_name: str, model, curve: dict[int, float], prefix: int) -> Path:
    device, dtype = profile_key(model)
    path = profile_path(target_name, device, dtype)
    atomic_write_json(path, {"target": target_name, "device": device, "dtype": dtype, "prefix": prefix,
                             "ms": {str(k): v for k, v in curve.items()}})
    return path


def load_profile(target_name: str, model) -> dict[int, float] | None:
    """The verify curve ``draftheads profile`` measured for this target on ``model``'s device and dtype."""
    path = profile_path(target_name, *profile_key(model))
    if not path.is_file():
        return None
    return {int(k): v for k, v in json.loads(path.read_text())["ms"].items()}
