"""A head family that lives only here: a one-head Medusa variant with its own head type, registered with
the package's registries from outside it (as a user's own family would be)."""

from dataclasses import replace

from draftheads.export.imports import import_medusa, register_source
from draftheads.export.vllm import EXPORTS, register_format
from draftheads.heads import HeadFamily, MedusaConfig, MedusaHeads, register_family
from draftheads.inference.proposers import register
from draftheads.inference.proposers.medusa import MedusaProposer
from draftheads.training.medusa import MedusaModule


class ToyHeads(MedusaHeads):
    head_type = "toy"


class ToyModule(MedusaModule):
    head_type = "toy"

    def build_head(self, info, datamodule):
        medusa = super().build_head(info, datamodule)
        head = ToyHeads(medusa.config)
        head.load_state_dict(medusa.state_dict())
        return head


class ToyProposer(MedusaProposer):
    name = "toy"


def register_toy_family() -> None:
    """The family's record, its proposer and its export format, each with its registry."""
    register_family("toy", HeadFamily(MedusaConfig, ToyHeads, lambda num_layers: [num_layers]))
    register("toy")(ToyProposer)
    register_format(replace(EXPORTS["vllm-medusa"], name="toy-medusa", head_type="toy"))
    register_source("toy", import_toy)


def import_toy(src, target_layers):
    """A toy checkpoint is a Medusa one (a vLLM-medusa export) read back as the toy family's heads."""
    medusa = import_medusa(src)
    head = ToyHeads(medusa.config)
    head.load_state_dict(medusa.state_dict())
    return head
