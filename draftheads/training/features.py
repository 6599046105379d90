"""Offline target features: ``draftheads cache-features`` runs the target once over the packed
training rows and writes the requested hidden states to safetensors shards plus ``index.json``;
:class:`FeatureDataset` serves them to training (``data.feature_dir``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftheads.errors import DraftheadsError
from draftheads.targets import check_layer_ids, hidden_states
from draftheads.training.data import collate, doc_causal_mask
from draftheads.utils import atomic_dir

ROW_KEYS = ("input_ids", "loss_mask", "position_ids", "doc_ids")


@torch.no_grad()
def write_feature_cache(
    model, rows_by_split: dict, layer_ids, out: str | os.PathLike, target_name: str,
    batch_size: int = 4, shard_rows: int = 256, dtype=torch.bfloat16, progress=None,
) -> Path:
    """Write ``{split}-{shard:05d}.safetensors`` with the row tensors, ``feat_{id}`` [rows, T, H] and
    ``target_argmax`` [rows, T] (the target's greedy next token at each position)."""
    from draftheads.training.losses import linear_argmax

    lm_head = model.get_output_embeddings().weight
    last = model.config.get_text_config().num_hidden_layers
    layer_ids = check_layer_ids(layer_ids, last, "feature layers")
    wanted = sorted(set(layer_ids) | {last})
    index = {"target": target_name, "layer_ids": list(layer_ids), "dtype": str(dtype).replace("torch.", ""),
             "splits": {}}
    with atomic_dir(out) as tmp:
        for split, rows in rows_by_split.items():
            shards = []
            for s in range(0, len(rows), shard_rows):
                chunk = rows[s : s + shard_rows]
                tensors = collate(chunk)
                feats = {i: [] for i in layer_ids}
                argmax = []
                for b in range(0, len(chunk), batch_size):
                    part = {k: v[b : b + batch_size] for k, v in tensors.items()}
                    mask = doc_causal_mask(part["doc_ids"], dtype=next(model.parameters()).dtype)
                    hs, _ = hidden_states(model, part["input_ids"], wanted, attention_mask=mask,
                                          position_ids=part["position_ids"])
                    for i in layer_ids:
                        feats[i].append(hs[i].to(dtype).cpu())
                    h = hs[last]
                    argmax.append(linear_argmax(h.reshape(-1, h.shape[-1]), lm_head).view(h.shape[:2]).cpu())
                    if progress:
                        progress(len(part["input_ids"]))
                tensors.update({f"feat_{i}": torch.cat(v) for i, v in feats.items()})
                tensors["target_argmax"] = torch.cat(argmax)
                name = f"{split}-{len(shards):05d}.safetensors"
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / name))
                shards.append({"file": name, "rows": len(chunk)})
            index["splits"][split] = shards
        (tmp / "index.json").write_text(json.dumps(index, indent=2))
    return Path(out)


class FeatureDataset(torch.utils.data.Dataset):
    """Rows of one split of a feature cache, each a dict of tensors (loaded lazily per row)."""

    def __init__(self, root: str | os.PathLike, split: str):
        self.root = Path(root)
        idx_file = self.root / "index.json"
        if not idx_file.is_file():
            raise DraftheadsError(
                f"feature cache {str(self.root)!r} has no index.json: write it with `draftheads cache-features`"
            )
        self.index = json.loads(idx_file.read_text())
        self.shards = self.index["splits"].get(split, [])
        self.offsets = []
        n = 0
        for sh in self.shards:
            self.offsets.append(n)
            n += sh["rows"]
        self.n = n

    @property
    def layer_ids(self) -> list[int]:
        return self.index["layer_ids"]

    def __len__(self):
        return self.n

    def column(self, key: str):
        """Yield ``key`` [rows, ...] shard by shard (without loading the features)."""
        for sh in self.shards:
            with safe_open(str(self.root / sh["file"]), framework="pt") as f:
                yield f.get_tensor(key)

    def __getitem__(self, i):
        s = max(k for k, off in enumerate(self.offsets) if off <= i)
        r = i - self.offsets[s]
        with safe_open(str(self.root / self.shards[s]["file"]), framework="pt") as f:
            return {k: f.get_slice(k)[r] for k in f.keys()}


def collate_features(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
