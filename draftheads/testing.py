"""Tiny, seeded, offline targets for tests, dry runs and examples (no downloads)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from draftheads.inference.proposers.base import Proposer
from draftheads.inference.tree import Tree, chain_parents

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "What is 12 plus 30? The answer is 42.",
    "Translate into French: good morning, my friend.",
    "Summarize the following passage in one sentence.",
    "Speculative decoding drafts tokens and the target verifies them in one forward pass.",
]


def tiny_tokenizer(chat_template: bool = True, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )
    if chat_template:
        fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_qwen3_config(vocab_size: int, **overrides):
    """Qwen3's shape in small: RMS norms on q and k, an explicit head dimension."""
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_gemma3_config(vocab_size: int, **overrides):
    """Gemma-3's shape in small: sliding-window layers between full ones, tied embeddings scaled by
    sqrt(hidden), q/k norms, a vocabulary over 200 k (see :func:`save_tiny_llama` for the ids past the
    tokenizer's)."""
    from transformers import Gemma3TextConfig

    kw = dict(
        vocab_size=max(vocab_size, 262_208), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


TINY_CONFIGS = {"llama": tiny_llama_config, "qwen3": tiny_qwen3_config, "gemma3": tiny_gemma3_config}
"""Tiny random targets by architecture family: what real families differ in, at test size."""


def save_tiny_llama(out: str | Path, seed: int = 0, chat_template: bool = True, dtype=torch.float32,
                    arch: str = "llama", **config_overrides) -> Path:
    """Write a random tiny model + tokenizer as a HF model directory: a Llama, or ``arch`` qwen3 / gemma3
    (weights in ``dtype``; config overrides give other shapes, e.g. Llama-3-8B's layers for a GPU smoke run).
    ``chat_template`` False: a base model, whose tokenizer has none."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    tok = tiny_tokenizer(chat_template=chat_template)
    torch.manual_seed(seed)
    # ids past the tokenizer's are fine
    cfg = TINY_CONFIGS[arch](config_overrides.pop("vocab_size", len(tok)), **config_overrides)
    model = AutoModelForCausalLM.from_config(cfg)
    # larger-than-default weights make the random model's argmax depend on context
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
        # ids past the tokenizer's (a vocabulary larger than it) score 0, below the likeliest real tokens:
        # greedy and top-k text stays within the tokenizer
        model.get_output_embeddings().weight[len(tok):] = 0.0
    model.to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def random_heads(model, seed: int = 0, draft_vocab_size: int = 64) -> dict:
    """Randomly initialised Medusa, EAGLE-1, EAGLE-3 (one and two decoder layers), DFlash and DSpark heads shaped
    for ``model``."""
    from draftheads.heads import (
        DFlashConfig,
        DFlashHead,
        DSparkConfig,
        DSparkHead,
        Eagle3Config,
        Eagle3Head,
        EagleConfig,
        EagleHead,
        LayerSpec,
        MedusaConfig,
        MedusaHeads,
    )
    from draftheads.heads.vocab import DraftVocab

    cfg = model.config.get_text_config()
    spec = LayerSpec.from_hf_config(cfg)
    vocab = model.get_output_embeddings().weight.shape[0]
    n = cfg.num_hidden_layers
    torch.manual_seed(seed)
    heads = {
        "medusa": MedusaHeads(MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=vocab, num_heads=3, num_layers=1)),
        "eagle": EagleHead(EagleConfig(layer=spec, vocab_size=vocab)),
        "eagle3": Eagle3Head(Eagle3Config(layer=spec, vocab_size=vocab, draft_vocab_size=draft_vocab_size,
                                          aux_layer_ids=(1, n // 2, n - 1), target_hidden_size=cfg.hidden_size)),
        "dflash": DFlashHead(DFlashConfig(layer=spec, vocab_size=vocab, target_layer_ids=(1, n - 1), mask_token_id=0,
                                          block_size=5, num_layers=2)),
        "dspark": DSparkHead(DSparkConfig(layer=spec, vocab_size=vocab, target_layer_ids=(1, n - 1), mask_token_id=0,
                                          block_size=4, num_layers=1, markov_rank=8)),
    }
    for head in heads.values():
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.1)
    heads["eagle3_deep"] = Eagle3Head(replace(heads["eagle3"].config, num_layers=2))  # vLLM's stacked layers
    for p in heads["eagle3_deep"].parameters():
        torch.nn.init.normal_(p, std=0.1)
    for name in ("dflash", "dspark"):  # the same over the draft vocabulary, with its own lm_head
        heads[f"{name}_vocab"] = head = type(heads[name])(replace(heads[name].config, draft_vocab_size=draft_vocab_size))
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.sort(torch.randperm(vocab)[:draft_vocab_size]).values
    dv = DraftVocab(ids, vocab, 1.0)
    with torch.no_grad():
        heads["eagle3"].d2t.copy_(dv.d2t)
        heads["eagle3"].t2d.copy_(dv.t2d)
        heads["eagle3_deep"].d2t.copy_(dv.d2t)
        heads["eagle3_deep"].t2d.copy_(dv.t2d)
        heads["dflash_vocab"].d2t.copy_(dv.d2t)
        heads["dspark_vocab"].d2t.copy_(dv.d2t)
    return {k: h.eval() for k, h in heads.items()}


class OracleProposer(Proposer):
    """Drafts the target's own greedy continuation (every drafted token accepted at T = 0), optionally with
    wrong random siblings beside each node: the accept and commit paths of a tree, exercised in full."""

    name = "oracle"

    def check_tree(self, tree):
        pass  # drafts its own shape

    def __init__(self, model, depth, siblings=0, vocab=None, seed=0):
        self.model, self.depth, self.siblings, self.vocab = model, depth, siblings, vocab
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def propose(self, st, tree=None):
        ids = torch.tensor([st.tokens], device=self.model.device)
        chain = []
        for _ in range(self.depth):  # run the target ahead, greedily, without a cache
            nxt = int(self.model(ids).logits[0, -1].argmax())
            chain.append(nxt)
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], 1)
        tokens, parents = [st.root, *chain], chain_parents(len(chain))
        for node in range(len(chain)):  # optional wrong siblings beside every correct node
            for _ in range(self.siblings):
                tokens.append(int(torch.randint(self.vocab, (1,), generator=self.gen)))
                parents.append(node)
        return Tree(tokens, parents)
