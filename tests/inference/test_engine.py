import pytest
import torch
from _proposers import RandomTreeProposer

from draftheads.errors import DraftheadsError
from draftheads.inference.engine import Engine
from draftheads.inference.proposers.dflash import DFlashProposer
from draftheads.inference.proposers.dspark import DSparkProposer
from draftheads.inference.proposers.eagle import EagleProposer
from draftheads.inference.proposers.eagle3 import Eagle3Proposer
from draftheads.inference.proposers.medusa import MedusaProposer
from draftheads.inference.proposers.ngram import NGramProposer
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import TreeSpec
from draftheads.testing import OracleProposer, random_heads

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 5, 6, 7],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 30, 31, 32],
    [100, 101, 102, 103, 104, 100, 101],
]
NEW = 24


@pytest.fixture(scope="module")
def model(tiny_target):
    return tiny_target.model


@pytest.fixture(scope="module")
def reference(model):
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def _proposer(name, model):
    vocab = model.config.vocab_size
    heads = random_heads(model)
    return {
        "plain": lambda: None,
        "ngram": lambda: NGramProposer(),
        "random": lambda: RandomTreeProposer(vocab),
        "oracle": lambda: OracleProposer(model, 3, siblings=2, vocab=vocab),
        "medusa": lambda: MedusaProposer(heads["medusa"], model),
        "eagle": lambda: EagleProposer(heads["eagle"], model),
        "eagle3": lambda: Eagle3Proposer(heads["eagle3"], model),
        "eagle3-deep": lambda: Eagle3Proposer(heads["eagle3_deep"], model),
        "dflash": lambda: DFlashProposer(heads["dflash"], model),
        "dflash-tree": lambda: DFlashProposer(heads["dflash"], model),
        "dspark": lambda: DSparkProposer(heads["dspark"], model, min_survival=0.0),
        "dspark-tree": lambda: DSparkProposer(heads["dspark"], model, min_survival=0.0),
        "dspark-cut": lambda: DSparkProposer(heads["dspark"], model, min_survival=0.3),
        "dflash-vocab": lambda: DFlashProposer(heads["dflash_vocab"], model),
        "dspark-vocab": lambda: DSparkProposer(heads["dspark_vocab"], model, min_survival=0.0),
    }[name]()


PARAMS = SamplingParams(max_new_tokens=NEW, stop_at_eos=False)
SPEC = TreeSpec(depth=4, top_k=3, total_tokens=12)
TREES = {"plain": None, "ngram": "chain3", "random": SPEC, "oracle": SPEC, "medusa": "small", "eagle": SPEC,
         "eagle3": SPEC, "eagle3-deep": SPEC, "dflash": "chain4", "dflash-tree": SPEC,
         "dspark": "chain4", "dspark-tree": SPEC, "dspark-cut": SPEC, "dflash-vocab": "chain4", "dspark-vocab": SPEC}


@pytest.mark.parametrize("name", ["plain", "ngram", "random", "oracle", "medusa", "eagle", "eagle3", "eagle3-deep", "dflash",
                                  "dflash-tree", "dspark", "dspark-tree", "dspark-cut", "dflash-vocab", "dspark-vocab"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity(model, reference, name, batch):
    engine = Engine(model, proposer=_proposer(name, model), tree=TREES[name])
    prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[2:3]
    want = reference[:batch] if batch > 1 else reference[2:3]
    outs = engine.generate(prompts, PARAMS)
    for o, ref in zip(outs, want):
        assert o.token_ids == ref, (name, o.rid)
    if name == "oracle":
        for o in outs:  # every drafted token of the oracle chain is accepted
            assert o.metrics.tau == pytest.approx(4.0)
            assert o.metrics.alpha == [1.0, 1.0, 1.0]


def test_sampling_same_seed_same_output(model):
    engine = Engine(model, proposer=_proposer("eagle3", model), tree=TREES["eagle3"])
    a = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_new_tokens=16, stop_at_eos=False))
    b = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_new_tokens=16, stop_at_eos=False))
    c = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=0.9, seed=4, max_new_tokens=16, stop_at_eos=False))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_eos_stops_and_bad_input(model, reference):
    eos = reference[0][5]
    engine = Engine(model, eos_token_ids=[eos])
    (out,) = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=NEW))
    assert out.token_ids == reference[0][: reference[0].index(eos) + 1] and out.finish_reason == "stop"
    with pytest.raises(DraftheadsError, match="exceeds the target's context"):
        engine.generate([[1] * 600], SamplingParams(max_new_tokens=8))
    with pytest.raises(DraftheadsError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(DraftheadsError, match="top_p"):
        SamplingParams(top_p=0)


def test_kv_exhaustion_is_clear(model):
    from draftheads.inference.engine import EngineConfig
    from draftheads.inference.kv_cache import BlocksExhausted

    engine = Engine(model, config=EngineConfig(kv_blocks=2, block_size=4))
    with pytest.raises(BlocksExhausted, match="KV cache exhausted"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))


def test_paged_attention_equals_dense():
    from draftheads.inference.attention import PagedStep, torch_paged_tree_attention
    from draftheads.inference.kv_cache import PagedKVCache
    from draftheads.inference.tree import ancestor_mask

    torch.manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_blocks=12, kv_heads=2, head_dim=8, block_size=4)
    rows = [(5, [-1, 0, 0, 1]), (0, [-1, 0, 1]), (9, [-1])]  # (prefix length, tree parents)
    qs, starts, write, row_slots, masks = [], [0], [], [], []
    dense = []
    for rid, (prefix, parents) in enumerate(rows):
        cache.add(rid)
        k, v = torch.randn(prefix + len(parents), 2, 8), torch.randn(prefix + len(parents), 2, 8)
        cache.reserve(rid, prefix)
        cache.write(0, cache.slots(rid, 0, prefix), k[:prefix], v[:prefix])
        cache.truncate(rid, prefix)  # committed prefix
        cache.reserve(rid, len(parents))
        slots = cache.slots(rid, 0, prefix + len(parents))
        cache.write(0, slots[prefix:], k[prefix:], v[prefix:])  # the tree's own K/V
        q = torch.randn(4, len(parents), 8)
        qs.append(q)
        starts.append(starts[-1] + len(parents))
        write.append(slots[prefix:])
        row_slots.append(slots)
        masks.append(ancestor_mask(parents))
        allowed = torch.cat([torch.ones(len(parents), prefix, dtype=torch.bool), ancestor_mask(parents)], 1)
        att = torch.einsum("hqd,khd->hqk", q, k.repeat_interleave(2, 1)) / 8**0.5
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        dense.append(torch.einsum("hqk,khd->qhd", att, v.repeat_interleave(2, 1)))
    step = PagedStep(cache, starts, [r[0] for r in rows], torch.cat(write), row_slots, masks)
    out = torch_paged_tree_attention(torch.cat(qs, 1)[None], step, 0, 8**-0.5)
    torch.testing.assert_close(out, torch.cat(dense), atol=1e-5, rtol=1e-5)


def test_request_generators_live_on_the_target_device(model, monkeypatch):
    """A draw beside CUDA probabilities takes its uniform from a CUDA generator: each request's random stream is
    created on the target's device (here a pretend CUDA device; the GPU test below samples for real)."""
    seen = []

    class Recorder:
        def __init__(self, device="cpu"):
            self.device = torch.device(device)
            seen.append(self.device)

        def manual_seed(self, seed):
            return self

    engine = Engine(model)
    engine.device = torch.device("cuda")
    monkeypatch.setattr(torch, "Generator", Recorder)
    engine.request_state(0, [1, 2, 3], SamplingParams(seed=5))
    assert seen == [torch.device("cuda")]


@pytest.mark.gpu
def test_sampling_on_cuda_is_seeded_and_runs(model):
    cuda = model.to("cuda")
    try:
        engine = Engine(cuda, proposer=NGramProposer(), tree="chain3")
        params = SamplingParams(temperature=0.7, seed=3, max_new_tokens=16, stop_at_eos=False)
        a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    finally:
        model.to("cpu")


def test_a_bf16_target_on_the_cpu_keeps_float32_kv(model):
    """The CPU torch path stores K/V in float32 for a bf16 target (its SDPA is several times faster on
    float32 K/V); attention then runs in float32 and returns the query's dtype, and the logits stay within
    the bf16 target's own error of the float32 ones. ``kv_dtype`` overrides the choice."""
    import copy

    from draftheads.inference.engine import EngineConfig
    from draftheads.inference.tree import Tree

    m16 = copy.deepcopy(model).to(torch.bfloat16)
    assert Engine(m16).kv_dtype == torch.float32 and Engine(model).kv_dtype == torch.float32
    assert Engine(m16, config=EngineConfig(kv_dtype="bfloat16")).kv_dtype == torch.bfloat16
    with pytest.raises(DraftheadsError, match="kv_dtype 'int8' is not a float dtype"):
        Engine(m16, config=EngineConfig(kv_dtype="int8"))
    prompt = PROMPTS[0] * 3
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].float()  # float32 everywhere
        own = (m16(torch.tensor([prompt])).logits[0].float() - want).abs().max().item()  # HF's bf16 forward
    errs = {}
    for kv in (None, "bfloat16"):
        engine = Engine(m16, config=EngineConfig(kv_dtype=kv))
        cache = engine.new_cache(8)
        st = engine.request_state(0, prompt, SamplingParams())
        cache.add(0)
        logits, _ = engine.forward(cache, [st], [Tree(prompt, [-1] + list(range(len(prompt) - 1)))], ())
        errs[kv] = (logits.all().float() - want).abs().max().item()
    assert 0 < errs[None] <= 2 * own and errs["bfloat16"] <= 2 * own, (errs, own)


@pytest.mark.parametrize("name", ["medusa", "eagle", "eagle3", "dflash", "dspark"])
def test_a_head_drafts_in_the_target_dtype(tiny_target, name):
    """``make_proposer`` casts a float32 head to a bf16 target's dtype; the engine then drafts and verifies
    in bf16 and emits the tokens asked for."""
    import copy
    import dataclasses

    from draftheads.inference.build import make_engine, make_proposer

    m16 = copy.deepcopy(tiny_target.model).to(torch.bfloat16)
    target = dataclasses.replace(tiny_target, model=m16)
    head = random_heads(tiny_target.model)[name]
    assert next(head.parameters()).dtype == torch.float32
    proposer = make_proposer(target, head=head)
    floats = {p.dtype for p in proposer.head.parameters() if p.is_floating_point()}
    assert floats == {torch.bfloat16}, floats
    (out,) = make_engine(target, proposer, tree="chain3").generate([PROMPTS[2]], PARAMS)
    assert len(out.token_ids) == NEW and out.metrics.drafts > 0


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_greedy_identity_on_other_families(arch, tmp_path):
    """Qwen3 (q/k norms) and Gemma-3 (sliding-window layers, tied scaled embeddings): plain decoding and a
    tree of random drafts give HF's greedy text, also past the sliding window (16 tokens here)."""
    from draftheads.targets import load_target
    from draftheads.testing import save_tiny_llama

    target = load_target(str(save_tiny_llama(tmp_path / arch, arch=arch)))
    model, prompt = target.model, PROMPTS[2]
    assert len(prompt) + NEW > 2 * 16
    want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    for proposer, tree in ((None, None), (RandomTreeProposer(300), SPEC), (OracleProposer(model, 3, 2, 300), SPEC)):
        for batch in (1, 3):
            outs = Engine(model, target.tokenizer, proposer, tree=tree).generate([prompt] * batch, PARAMS)
            assert all(o.token_ids == want for o in outs), (arch, type(proposer).__name__, batch)
