"""Greedy identity on the embedded SmolLM2-135M-Instruct target (make test-all)."""

import pytest
import torch

from draftheads.inference.engine import Engine
from draftheads.inference.proposers.eagle3 import Eagle3Proposer
from draftheads.inference.proposers.medusa import MedusaProposer
from draftheads.inference.proposers.ngram import NGramProposer
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import TreeSpec
from draftheads.prompts import load_prompts, render_chat
from draftheads.testing import random_heads

pytestmark = pytest.mark.integration
NEW = 32


@pytest.fixture(scope="module")
def smol():
    from draftheads.targets import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def prompts(smol):
    tok = smol.tokenizer
    ps = load_prompts("bundled:eval", domains=["code", "translation"], limit_per_domain=1)
    return [tok(render_chat(tok, [{"role": "user", "content": p.turns[0]}]), add_special_tokens=False).input_ids for p in ps]


def test_plain_engine_matches_hf_greedy(smol, prompts):
    outs = Engine(smol.model, smol.tokenizer).generate(prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False))
    for ids, o in zip(prompts, outs):
        x = torch.tensor([ids])
        ref = smol.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert o.token_ids == ref


@pytest.mark.parametrize("name", ["ngram", "medusa", "eagle3"])
def test_speculative_equals_plain_batch_of_unequal_prompts(smol, prompts, name):
    heads = random_heads(smol.model, draft_vocab_size=512)
    proposer = {
        "ngram": lambda: NGramProposer(),
        "medusa": lambda: MedusaProposer(heads["medusa"], smol.model),
        "eagle3": lambda: Eagle3Proposer(heads["eagle3"], smol.model),
    }[name]()
    params = SamplingParams(max_new_tokens=NEW, stop_at_eos=False)
    assert len(prompts[0]) != len(prompts[1])
    plain = Engine(smol.model, smol.tokenizer).generate(prompts, params)
    tree = "chain4" if name == "ngram" else TreeSpec(depth=4, top_k=3, total_tokens=12)
    spec = Engine(smol.model, smol.tokenizer, proposer, tree=tree).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
