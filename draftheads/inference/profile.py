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


def profile_path(target_name: str, device: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in target_name)
    return cache_dir() / "profiles" / f"{safe}-{device}.json"


def save_profile(target_name: str, device: str, curve: dict[int, float], prefix: int) -> Path:
    path = profile_path(target_name, device)
    atomic_write_json(path, {"target": target_name, "device": device, "prefix": prefix,
                             "ms": {str(k): v for k, v in curve.items()}})
    return path


def load_profile(target_name: str, device: str) -> dict[int, float] | None:
    path = profile_path(target_name, device)
    if not path.is_file():
        return None
    return {int(k): v for k, v in json.loads(path.read_text())["ms"].items()}
