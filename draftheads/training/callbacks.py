"""Training callbacks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import lightning as L
import torch


class WeightDigest(L.Callback):
    """Writes ``digest-rank{r}.txt`` (sha256 of the head's weights) per rank at the end of fit,
    so multi-process runs can be checked for replicas that drifted apart."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module):
        h = hashlib.sha256()
        for name, t in sorted(pl_module.head.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"digest-rank{trainer.global_rank}.txt").write_text(h.hexdigest() + "\n")
