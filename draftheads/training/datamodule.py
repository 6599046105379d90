"""LightningDataModule over conversation files (or an offline feature cache)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from draftheads.errors import DraftheadsError
from draftheads.heads.vocab import token_counts
from draftheads.targets import load_tokenizer
from draftheads.training.data import build_dataset, collate
from draftheads.training.features import FeatureDataset, collate_features


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can begin an epoch part-way through its order.

    A run resumed from a mid-epoch checkpoint goes on with the rows it had not reached, in the
    same order, instead of starting the epoch's order again (which would train twice on its
    first rows and never on its last).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.resume_at: tuple[int, int] | None = None  # (epoch, indices of that epoch already trained on)

    def __iter__(self):
        indices = list(super().__iter__())
        if self.resume_at is not None and self.resume_at[0] == self.epoch:
            indices = indices[self.resume_at[1]:]
        self.resume_at = None  # later epochs start from their beginning
        return iter(indices)


class ChatDataModule(L.LightningDataModule):
    def __init__(
        self,
        train_files: list[str] | None = None,
        target: str = "smollm2-135m",
        max_length: int = 1024,
        batch_size: int = 4,
        val_fraction: float = 0.05,
        packed: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        feature_dir: str | None = None,
        trust_remote_code: bool = False,
        train_fraction: float = 1.0,
    ):
        """
        Args:
            train_files: jsonl files (OpenAI ``messages``, ShareGPT ``conversations``, distilled
                ``turns``+``answers``, or ``text``).
            target: target spec, whose tokenizer and chat template render the data.
            max_length: tokens per packed row (longer conversations are truncated and counted).
            batch_size: rows per batch and device.
            val_fraction: fraction of conversations held out for validation.
            packed: pack several conversations per row (with document masks) or one per row.
            seed: split and shuffle seed (the order per epoch is a function of seed and epoch).
            num_workers: DataLoader workers.
            feature_dir: read rows and target features from a ``draftheads cache-features`` output.
            trust_remote_code: allow custom tokenizer code for hub targets.
            train_fraction: train on this fraction of the training rows (a fixed random subset; data
                scaling curves); validation is unchanged.
        """
        super().__init__()
        self.save_hyperparameters()
        if batch_size < 1:
            raise DraftheadsError(f"data.batch_size={batch_size} must be >= 1")
        if max_length < 8:
            raise DraftheadsError(f"data.max_length={max_length} must be >= 8")
        if not 0 < train_fraction <= 1:
            raise DraftheadsError(f"data.train_fraction={train_fraction} must be in (0, 1]")
        if not train_files and not feature_dir:
            raise DraftheadsError("data.train_files is empty: give jsonl files or data.feature_dir")
        self.train_set = self.val_set = None
        self.stats: dict = {}
        self._collate = collate
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches) read from a checkpoint

    def _build(self):
        tok = load_tokenizer(self.hparams.target, self.hparams.trust_remote_code)
        return build_dataset(tok, list(self.hparams.train_files), self.hparams.max_length, self.hparams.packed,
                             self.hparams.val_fraction, self.hparams.seed, tokenizer_key=self.hparams.target)

    def prepare_data(self):
        if not self.hparams.feature_dir:
            self._build()  # fills the Arrow cache once, on rank 0

    def setup(self, stage=None):
        if self.train_set is None:
            self._load()
        if stage == "fit" and len(self.train_set) == 0:
            where = f"data.feature_dir {self.hparams.feature_dir}" if self.hparams.feature_dir else "data.train_files"
            raise DraftheadsError(f"{where} has no training rows (all of it is the val split): train on data with "
                                  "a train split (data.val_fraction below 1), or use it with `train-head validate`")

    def _load(self):
        if self.hparams.feature_dir:
            self.train_set = FeatureDataset(self.hparams.feature_dir, "train", target=self.hparams.target)
            self.val_set = FeatureDataset(self.hparams.feature_dir, "val", target=self.hparams.target)
            self._collate = collate_features
        else:
            train, val, self.stats = self._build()
            self.train_set, self.val_set = train, val
            self._collate = collate
        if self.hparams.train_fraction < 1 and len(self.train_set):
            n = len(self.train_set)
            keep = max(1, int(round(n * self.hparams.train_fraction)))
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.hparams.seed)).tolist()
            self.train_set = torch.utils.data.Subset(self.train_set, sorted(order[:keep]))

    def token_counts(self, vocab_size: int, split: str = "train", masked: bool = True) -> torch.Tensor:
        """Counts of the target tokens of ``split`` (loss-masked ones, or all with ``masked=False``),
        for draft vocabularies."""
        self.setup()
        ds = self.train_set if split == "train" else self.val_set
        key = "loss_mask" if masked else "doc_ids"

        def counted(ids, marks):  # loss-masked tokens, or every real (non-padding) token
            return ids[marks.bool() if masked else marks >= 0]

        rows = None
        if isinstance(ds, torch.utils.data.Subset) and isinstance(ds.dataset, FeatureDataset):
            rows = torch.tensor(ds.indices)
            ds = ds.dataset
        if isinstance(ds, FeatureDataset):
            if len(ds) == 0:  # a cache without this split (distill --val-fraction 0)
                return token_counts([], vocab_size)
            ids, marks = torch.cat(list(ds.column("input_ids"))), torch.cat(list(ds.column(key)))
            if rows is not None:
                ids, marks = ids[rows], marks[rows]
            return token_counts([counted(ids, marks)], vocab_size)
        return token_counts((counted(torch.as_tensor(r["input_ids"]), torch.as_tensor(r[key])) for r in ds), vocab_size)

    def state_dict(self) -> dict:
        """Where training is in its epoch, saved in every checkpoint (Lightning calls this)."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        return {"epoch": trainer.current_epoch,
                "batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state: dict) -> None:
        if "epoch" in state:
            self._resume_at = (int(state["epoch"]), int(state["batches"]))

    def _loader(self, ds, shuffle: bool):
        trainer = self.trainer
        world = trainer.world_size if trainer is not None else 1
        rank = trainer.global_rank if trainer is not None else 0
        sampler = ResumableSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle,
                                   seed=self.hparams.seed, drop_last=False)
        return DataLoader(ds, batch_size=self.hparams.batch_size, sampler=sampler, collate_fn=self._collate,
                          num_workers=self.hparams.num_workers)

    def train_dataloader(self):
        loader = self._loader(self.train_set, shuffle=True)
        if self._resume_at is not None:  # resumed mid-epoch: skip the batches that epoch already trained on
            epoch, batches = self._resume_at
            loader.sampler.resume_at = (epoch, batches * self.hparams.batch_size)
            self._resume_at = None
        return loader

    def val_dataloader(self):
        return self._loader(self.val_set, shuffle=False) if len(self.val_set) else []

