"""Target feature caches: packed rows with the target's hidden states, in safetensors shards plus
``index.json``, read by training through ``data.feature_dir``.

Two writers fill the same format: ``draftheads cache-features`` runs the target over packed training
rows (:func:`write_feature_cache`), and ``draftheads distill --features`` keeps the hidden states of the
generation pass itself (:class:`FeatureShardWriter`, fed one conversation at a time). Both resume a killed
run at its last committed shard: ``cache-features`` writes into a hidden ``.<out>.partial`` folder beside
``--out`` (each shard recorded with a digest of its rows, so a rerun reuses exactly the shards it would
write again) and puts it in place of ``--out`` in one rename when every shard is written.

Each shard ``{split}-{n:05d}.safetensors`` holds ``input_ids``, ``loss_mask``, ``position_ids``,
``doc_ids`` [rows, T], ``feat_{id}`` [rows, T, H] and ``target_argmax`` [rows, T] (the target's greedy
next token at each position). ``index.json`` lists the shards, the target, the layer ids and, for a
cache still being written, ``"complete": false``; shards are committed one at a time, so an
interrupted writer resumes after its last committed shard.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftheads.errors import DraftheadsError
from draftheads.targets import check_layer_ids, hidden_states
from draftheads.training.data import collate, doc_causal_mask
from draftheads.utils import atomic_write_json, check_output_dir, exclusive, publish_dir, safetensors_shapes

log = logging.getLogger(__name__)

ROW_KEYS = ("input_ids", "loss_mask", "position_ids", "doc_ids")
INDEX_VERSION = 2


def _save_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


CACHE_FILES = ("index.json", "train-*.safetensors", "val-*.safetensors")
"""What a feature cache folder holds."""


@torch.no_grad()
def write_feature_cache(
    model, rows_by_split: dict, layer_ids, out: str | os.PathLike, target_name: str,
    batch_size: int = 4, shard_rows: int = 256, dtype=torch.bfloat16, progress=None, overwrite: bool = False,
    inputs=(),
) -> Path:
    """Run the target over packed rows and write their features (the offline path), resuming the shards an
    interrupted run with the same settings committed (:func:`partial_dir`)."""
    from draftheads.kernels.linear_argmax import linear_argmax

    lm_head = model.get_output_embeddings().weight
    last = model.config.get_text_config().num_hidden_layers
    layer_ids = check_layer_ids(layer_ids, last, "feature layers")
    wanted = sorted(set(layer_ids) | {last})
    out = Path(out)
    check_output_dir(out, "cache-features", overwrite=overwrite, inputs=inputs)
    work = partial_dir(out)
    with exclusive(out):
        index = _resumed_index(work, new_index(target_name, layer_ids, dtype, shard_rows=shard_rows))
        for split, rows in rows_by_split.items():
            done, shards = index["splits"].get(split, []), []
            index["splits"][split] = shards
            for n, s in enumerate(range(0, len(rows), shard_rows)):
                chunk = rows[s : s + shard_rows]
                tensors = collate(chunk)
                name, digest = f"{split}-{n:05d}.safetensors", rows_digest(tensors)
                if n < len(done) and done[n] == {"file": name, "rows": len(chunk), "digest": digest}:
                    shards.append(done[n])  # committed by an earlier run, from the same rows
                    if progress:
                        progress(len(chunk))
                    continue
                done = []  # the rows differ from here on: every later shard is written anew
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
                _save_shard(work / name, tensors)
                shards.append({"file": name, "rows": len(chunk), "digest": digest})
                atomic_write_json(work / "index.json", index)
        index["complete"] = True
        atomic_write_json(work / "index.json", index)
        listed = {sh["file"] for shards in index["splits"].values() for sh in shards}
        for f in work.glob("*.safetensors"):  # shards of an earlier run past where this one's rows end
            if f.name not in listed:
                f.unlink()
        publish_dir(work, out, "cache-features", overwrite=overwrite, inputs=inputs)
    return out


def partial_dir(out: Path) -> Path:
    """Where ``cache-features`` keeps the committed shards of an unfinished ``out``: ``.<name>.partial`` beside it."""
    return out.with_name(f".{out.name}.partial")


def rows_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of a shard's packed rows (``ROW_KEYS``): equal digests, equal rows."""
    h = hashlib.sha256()
    for k in ROW_KEYS:
        h.update(k.encode())
        h.update(tensors[k].numpy().tobytes())
    return h.hexdigest()[:32]


def _resumed_index(work: Path, fresh: dict) -> dict:
    """The index of the unfinished cache in ``work`` when it was written with ``fresh``'s settings; otherwise
    ``work`` emptied and ``fresh``."""
    idx = work / "index.json"
    if idx.is_file():
        old = json.loads(idx.read_text())
        if all(old.get(k) == fresh[k] for k in ("version", "target", "layer_ids", "dtype", "shard_rows")):
            kept = sum(len(v) for v in old["splits"].values())
            log.info("cache-features: resuming %s, %d shard(s) written by an earlier run", work, kept)
            return old
        log.info("cache-features: %s was written with other settings; starting over", work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return fresh


def new_index(target_name: str, layer_ids, dtype, **extra) -> dict:
    return {"version": INDEX_VERSION, "target": target_name, "layer_ids": list(layer_ids),
            "dtype": str(dtype).replace("torch.", ""), "splits": {}, "complete": False, **extra}


class FeatureShardWriter:
    """Packs conversations (ids, loss mask, features, argmax) into rows of ``max_length`` tokens and
    commits shards of ``shard_rows`` rows per split. :meth:`commit` returns the keys a commit made
    durable, so the caller writes its own records at the same boundary. An existing ``index.json``
    with the same settings is resumed; its committed keys are in :attr:`done_keys`."""

    def __init__(self, out: str | os.PathLike, target_name: str, layer_ids, hidden_size: int, max_length: int,
                 shard_rows: int = 64, dtype=torch.bfloat16, settings: dict | None = None):
        self.root = Path(out)
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        self.max_length = max_length
        self.shard_rows = shard_rows
        self.dtype = dtype
        self.index = new_index(target_name, layer_ids, dtype, max_length=max_length, settings=settings or {})
        idx = self.root / "index.json"
        if idx.is_file():
            old = json.loads(idx.read_text())
            for k in ("target", "layer_ids", "dtype", "max_length", "settings"):
                if old.get(k) != self.index[k]:
                    raise DraftheadsError(
                        f"feature cache {str(self.root)!r} was written with {k}={old.get(k)!r}, not "
                        f"{self.index[k]!r}: resume with the same settings, or choose a new --feature-dir"
                    )
            self.index = old
        self.root.mkdir(parents=True, exist_ok=True)
        self._open: dict[str, list[dict]] = {}  # split -> packed rows being filled (the last one is open)

    @property
    def done_keys(self) -> set:
        return {k for shards in self.index["splits"].values() for sh in shards for k in sh["keys"]}

    def add(self, split: str, key, ids: list[int], loss_mask: list[int], features: dict[int, torch.Tensor],
            target_argmax: torch.Tensor) -> None:
        """Pack one conversation (cut at ``max_length``) into ``split``."""
        n = min(len(ids), self.max_length)
        rows = self._open.setdefault(split, [])
        if not rows or rows[-1]["used"] + n > self.max_length:
            rows.append(self._empty_row())
        row = rows[-1]
        s = row["used"]
        t = row["tensors"]
        t["input_ids"][s: s + n] = torch.tensor(ids[:n])
        t["loss_mask"][s: s + n] = torch.tensor(loss_mask[:n])
        t["position_ids"][s: s + n] = torch.arange(n)
        t["doc_ids"][s: s + n] = len(row["keys"])
        for i in self.layer_ids:
            t[f"feat_{i}"][s: s + n] = features[i][:n].to(self.dtype)
        t["target_argmax"][s: s + n] = target_argmax[:n]
        row["used"] = s + n
        row["keys"].append(key)

    def _empty_row(self) -> dict:
        t = self.max_length
        tensors = {"input_ids": torch.zeros(t, dtype=torch.long), "loss_mask": torch.zeros(t, dtype=torch.long),
                   "position_ids": torch.zeros(t, dtype=torch.long), "doc_ids": torch.full((t,), -1, dtype=torch.long),
                   "target_argmax": torch.zeros(t, dtype=torch.long)}
        for i in self.layer_ids:
            tensors[f"feat_{i}"] = torch.zeros(t, self.hidden_size, dtype=self.dtype)
        return {"used": 0, "keys": [], "tensors": tensors}

    def commit(self, final: bool = False, before_index=None) -> list:
        """Write every full shard (and, when ``final``, the rest), then the index; returns the keys written.
        ``before_index(keys)`` runs between the two, so records the caller writes there are on disk before
        the index counts their conversations as done."""
        committed = []
        for split, rows in self._open.items():
            while len(rows) > self.shard_rows or (final and rows):
                ready, rows = rows[: self.shard_rows], rows[self.shard_rows:]
                shards = self.index["splits"].setdefault(split, [])
                name = f"{split}-{len(shards):05d}.safetensors"
                _save_shard(self.root / name, {k: torch.stack([r["tensors"][k] for r in ready])
                                               for k in ready[0]["tensors"]})
                keys = [k for r in ready for k in r["keys"]]
                shards.append({"file": name, "rows": len(ready), "keys": keys})
                committed += keys
            self._open[split] = rows
        if committed or final:
            if before_index is not None:
                before_index(committed)
            self.index["complete"] = final
            atomic_write_json(self.root / "index.json", self.index)
        return committed


class FeatureDataset(torch.utils.data.Dataset):
    """Rows of one split of a feature cache, each a dict of tensors (read lazily, one row at a time)."""

    def __init__(self, root: str | os.PathLike, split: str, target: str | None = None):
        self.root = Path(root)
        idx_file = self.root / "index.json"
        if not idx_file.is_file():
            raise DraftheadsError(
                f"feature cache {str(self.root)!r} has no index.json: write it with `draftheads cache-features` "
                "or `draftheads distill --features`"
            )
        self.index = json.loads(idx_file.read_text())
        if self.index.get("complete") is False:
            raise DraftheadsError(
                f"feature cache {str(self.root)!r} is incomplete (its writer was interrupted): rerun the same "
                "`draftheads distill` command to finish it"
            )
        if target is not None and self.index.get("target") != target:
            raise DraftheadsError(
                f"feature cache {str(self.root)!r} holds features of target {self.index.get('target')!r}, not "
                f"{target!r}: set data.target to match, or write a cache for this target"
            )
        self.shards = self.index["splits"].get(split, [])
        missing = [sh["file"] for sh in self.shards if not (self.root / sh["file"]).is_file()]
        if missing:
            raise DraftheadsError(
                f"feature cache {str(self.root)!r} lacks shard(s) {missing[:3]}: the cache is damaged; write it again"
            )
        want = {"input_ids", *(f"feat_{i}" for i in self.index.get("layer_ids", []))}
        for sh in self.shards:  # headers only: a damaged shard stops here, not mid-epoch
            shapes = safetensors_shapes(self.root / sh["file"])
            if not want <= shapes.keys() or shapes["input_ids"][0] != sh["rows"]:
                raise DraftheadsError(f"feature cache {str(self.root)!r}: shard {sh['file']} does not match index.json "
                                      "(tensors or row count): the cache is damaged; write it again")
        self.offsets = []
        n = 0
        for sh in self.shards:
            self.offsets.append(n)
            n += sh["rows"]
        self.n = n
        self._handles: dict[int, object] = {}

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

    def _shard(self, s: int):
        if s not in self._handles:
            if len(self._handles) > 8:
                self._handles.clear()
            self._handles[s] = safe_open(str(self.root / self.shards[s]["file"]), framework="pt")
        return self._handles[s]

    def __getitem__(self, i):
        s = bisect.bisect_right(self.offsets, i) - 1
        r = i - self.offsets[s]
        f = self._shard(s)
        return {k: f.get_slice(k)[r] for k in f.keys()}

    def __getstate__(self):  # DataLoader workers open their own handles
        d = dict(self.__dict__)
        d["_handles"] = {}
        return d


def collate_features(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
