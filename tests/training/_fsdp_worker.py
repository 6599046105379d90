"""Worker for the two-process FSDP test: shard a toy model over gloo on CPU, gather its state dict and
clip its gradients through draftheads.training.fsdp, and write what each rank saw."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


class ToyDecoderLayer(nn.Linear):
    pass


def model():
    torch.manual_seed(0)
    return nn.Sequential(ToyDecoderLayer(6, 5), nn.ReLU(), ToyDecoderLayer(5, 3))


def main(rank: int, world: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from draftheads.training.fsdp import (
        DecoderLayerFSDP,
        clip_grad_norm,
        decoder_layer_policy,
        full_state_dict,
    )

    strategy = DecoderLayerFSDP()
    strategy._model = FSDP(model(), device_id=torch.device("cpu"), auto_wrap_policy=decoder_layer_policy,
                           use_orig_params=True)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    strategy._model(x).square().sum().backward()
    norm = float(clip_grad_norm(strategy, 0.01) or 0.0)
    local = {n: list(p.shape) for n, p in strategy._model.named_parameters()}
    state = full_state_dict(strategy)
    grads = {n: p.grad.abs().sum().item() if p.grad is not None else None for n, p in strategy._model.named_parameters()}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"state": {k: v.tolist() for k, v in state.items()}, "local_shapes": local, "norm": norm,
                   "grads": grads}, f)
    dist.barrier()  # neither rank tears gloo down while the other still talks to it (an abort at exit)
    dist.destroy_process_group()
    # torch's own teardown at interpreter exit sometimes aborts ("terminate called without an active
    # exception") after everything above has finished; leave without it, the result is already on disk
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
