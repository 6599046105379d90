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


class Toy(nn.Module):
    """A frozen bf16 target and a float32 head, each with a decoder layer and a loose linear beside it."""

    def __init__(self):
        super().__init__()
        self.target = nn.Sequential(ToyDecoderLayer(6, 6), nn.Linear(6, 6)).to(torch.bfloat16).requires_grad_(False)
        self.head = nn.Sequential(ToyDecoderLayer(6, 5), nn.Linear(5, 3))

    def forward(self, x):
        return self.head(self.target(x.bfloat16()).float())

    def state_dict(self, *args, **kwargs):
        from draftheads.training.module import state_dict_without

        return state_dict_without(self, "target", super().state_dict, *args, **kwargs)


def mixed(port: str, out: str) -> None:
    """One process: the toy wrapped with the layer policy alone, then with the draft-head policy, whose
    full state dict is then gathered (recording whether the target's unit took part)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from draftheads.training.fsdp import (
        DecoderLayerFSDP,
        decoder_layer_policy,
        draft_head_policy,
        full_state_dict,
    )

    seen = {}
    for name in ("layers", "draft_head"):
        torch.manual_seed(0)
        toy = Toy()
        policy = decoder_layer_policy if name == "layers" else draft_head_policy(toy)
        try:
            wrapped = FSDP(toy, device_id=torch.device("cpu"), auto_wrap_policy=policy, use_orig_params=True)
            wrapped(torch.randn(4, 6)).square().sum().backward()
            seen[name] = {"grads": sum(p.grad is not None for p in wrapped.parameters())}
            target_visits = []
            toy.target.register_state_dict_pre_hook(lambda *a, visits=target_visits: visits.append(1))
            strategy = DecoderLayerFSDP()
            strategy._model = wrapped
            state = full_state_dict(strategy)
            seen[name].update(state={k: list(v.shape) for k, v in state.items()}, target_visits=len(target_visits))
        except ValueError as e:
            seen[name] = {"error": str(e)}
    with open(f"{out}/mixed.json", "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "mixed":
        mixed(sys.argv[2], sys.argv[3])
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
