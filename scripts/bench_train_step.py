"""What an EAGLE-3 training step of SmolLM2's shapes costs, each choice side by side in one run.

1. attention: the training-time test's step j, forward and backward, as one SDPA over (j + 1) x T keys
   with diagonal own-position blocks in its mask (``layers.masked_own_attention``) against
   ``layers.prefix_and_own_attention`` (blocks of query rows, each reading the prefix keys its rows can
   see and its own rows of the earlier steps): 9 query heads, 3 K/V heads, head size 64;
2. ttt: the whole training-time test (--ttt-steps steps) of a head with an 8k draft vocabulary,
   forward and backward, with either attention in its layer;
3. loss: a whole step (training-time test, EAGLE-3 loss, backward, AdamW) with the loss's per-chunk
   arithmetic run eagerly (``loss_impl: chunked``) or compiled (``loss_impl: compiled``; its compile is
   timed apart);
4. blocks: a DFlash training step of a 2-layer head (block 8, draft vocabulary 8k), forward and backward
   through the draft cross-entropy, at each number of anchors per row in --anchors (what
   ``model.anchors_per_row`` costs), with the blocks masked for one SDPA (``model.attention: sdpa``)
   against tiles of whole blocks (``model.attention: tiles``).

Rows of --tokens tokens packed with documents of 200-500 tokens, cut at other places in each row, all
answer tokens. Prints seconds per call and the
largest differences, and writes JSON to --out."""

import argparse
import json
import statistics
import time

import torch

from draftheads.heads import DFlashConfig, DFlashHead, Eagle3Config, Eagle3Head, LayerSpec, layers
from draftheads.heads.dflash import BLOCK_MASKS
from draftheads.heads.layers import masked_own_attention, prefix_and_own_attention
from draftheads.training.data import doc_causal_mask
from draftheads.training.dflash import sample_anchors
from draftheads.training.losses import eagle3_loss, linear_cross_entropy

HIDDEN, DRAFT_VOCAB = 576, 8192


def packed_docs(b: int, t: int) -> torch.Tensor:
    """[B, T] document ids of rows packed with documents of 200-500 tokens, cut at other places in each
    row (as packed conversations are)."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(200, 501, (b, t // 200 + 1), generator=g)
    ends = lengths.cumsum(1)
    return torch.searchsorted(ends, torch.arange(t).expand(b, t).contiguous(), right=True)


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """(median seconds of ``repeats`` calls after a first one, seconds of the first, the last result)."""
    times, out = [], None
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), times[0], out


def backward(out: torch.Tensor) -> torch.Tensor:
    out.float().sum().backward()
    return out


SPEC = LayerSpec(hidden_size=HIDDEN, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                 head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0)


def smollm2_head(steps: int) -> Eagle3Head:
    torch.manual_seed(0)
    return Eagle3Head(Eagle3Config(layer=SPEC, vocab_size=49152, draft_vocab_size=DRAFT_VOCAB,
                                   aux_layer_ids=(2, 15, 27), target_hidden_size=HIDDEN, ttt_steps=steps))


def attention(mask, dtype, b, t, repeats) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    leaf = lambda heads: torch.randn(b, heads, t, 64, generator=g).to(dtype).requires_grad_()  # noqa: E731
    out = []
    for j in range(1, 5):
        q, prefix = leaf(9), (leaf(3), leaf(3))
        own = ([leaf(3) for _ in range(j)], [leaf(3) for _ in range(j)])
        seconds, results = {}, {}
        for name, fn in (("masked", masked_own_attention), ("prefix_and_own", prefix_and_own_attention)):
            seconds[name], _, results[name] = timed(lambda fn=fn, a=(q, prefix, own, mask): backward(fn(*a)), repeats)
        diff = (results["masked"].float() - results["prefix_and_own"].float()).abs().max().item()
        out.append({"step": j, **seconds, "speedup": seconds["masked"] / seconds["prefix_and_own"], "max_diff": diff})
        print(f"attention, step {j}: masked {seconds['masked']:.2f} s, prefix_and_own {seconds['prefix_and_own']:.2f} s "
              f"({out[-1]['speedup']:.2f}x), max difference {diff:.1e}")
    return out


class Step:
    """Random inputs of one training batch and a head of SmolLM2's shapes."""

    def __init__(self, dtype, b, t, steps):
        g = torch.Generator().manual_seed(1)
        self.head = smollm2_head(steps)
        self.autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        self.aux, self.emb = torch.randn(b, t, 3 * HIDDEN, generator=g), torch.randn(b, t, HIDDEN, generator=g)
        self.pos = torch.arange(t).expand(b, t)
        self.doc = packed_docs(b, t)
        self.last = torch.randn(b, t, HIDDEN, generator=g)
        self.teacher = torch.randn(DRAFT_VOCAB, HIDDEN, generator=g) * 0.05
        self.argmax = torch.randint(0, DRAFT_VOCAB, (b, t), generator=g)

    def grads(self, loss_impl: str | None = None) -> list[torch.Tensor]:
        """Gradients of the training-time test's outputs (``loss_impl`` None: a sum of squares) or of the
        EAGLE-3 loss computed with ``loss_impl``."""
        self.head.zero_grad()
        with torch.autocast(**self.autocast):
            outs = self.head.ttt(self.aux, lambda j: self.emb, self.pos, doc_causal_mask(self.doc))
            if loss_impl is None:
                loss = sum(o.float().pow(2).mean() for o in outs)
            else:
                loss = eagle3_loss(outs, self.last, torch.ones_like(self.doc, dtype=torch.bool), self.doc,
                                   self.head.lm_head.weight, self.teacher, self.argmax, impl=loss_impl)[0]
        loss.backward()
        return [p.grad.clone() for p in self.head.parameters() if p.grad is not None]


def whole_ttt(step: Step, steps: int, repeats: int) -> dict:
    seconds, grads = {}, {}
    for name, fn in (("masked", masked_own_attention), ("prefix_and_own", prefix_and_own_attention)):
        layers.prefix_and_own_attention = fn  # the name DraftAttention calls
        seconds[name], _, grads[name] = timed(step.grads, repeats)
    layers.prefix_and_own_attention = prefix_and_own_attention
    diff = max((a - b).abs().max().item() for a, b in zip(grads["masked"], grads["prefix_and_own"]))
    out = {**seconds, "speedup": seconds["masked"] / seconds["prefix_and_own"], "max_grad_diff": diff}
    print(f"training-time test, {steps} steps: masked {out['masked']:.2f} s, prefix_and_own "
          f"{out['prefix_and_own']:.2f} s ({out['speedup']:.2f}x), max gradient difference {diff:.1e}")
    return out


def loss_impls(step: Step, tokens: int, repeats: int) -> dict:
    opt = torch.optim.AdamW(step.head.parameters(), lr=0.0)  # its work, the weights unchanged
    out, grads = {}, {}
    for impl in ("chunked", "compiled"):
        def call(impl=impl):
            g = step.grads(impl)
            opt.step()
            return g
        seconds, first, grads[impl] = timed(call, repeats)
        out[impl] = {"seconds": seconds, "first_call_seconds": first, "tokens_per_s": tokens / seconds}
    out["speedup"] = out["chunked"]["seconds"] / out["compiled"]["seconds"]
    out["max_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(grads["chunked"], grads["compiled"]))
    print(f"training step: loss chunked {out['chunked']['seconds']:.2f} s ({out['chunked']['tokens_per_s']:.0f} tok/s), "
          f"compiled {out['compiled']['seconds']:.2f} s ({out['compiled']['tokens_per_s']:.0f} tok/s; first call "
          f"{out['compiled']['first_call_seconds']:.1f} s with its compile): {out['speedup']:.2f}x")
    return out


class BlockStep:
    """Random inputs of one DFlash training batch and a 2-layer head of SmolLM2's shapes."""

    def __init__(self, dtype, b: int, t: int):
        torch.manual_seed(0)
        self.head = DFlashHead(DFlashConfig(layer=SPEC, vocab_size=49152, target_layer_ids=(2, 15, 27), mask_token_id=0,
                                            num_layers=2, block_size=8, target_hidden_size=HIDDEN,
                                            draft_vocab_size=DRAFT_VOCAB))
        g = torch.Generator().manual_seed(3)
        self.feats, self.emb = torch.randn(b, t, 3 * HIDDEN, generator=g), torch.randn(b, t, HIDDEN, generator=g)
        self.doc, self.pos = packed_docs(b, t), torch.arange(t).expand(b, t)
        self.labels = torch.randint(0, DRAFT_VOCAB, (b, t), generator=g)
        self.autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    def grads(self, anchors: torch.Tensor, attention: str) -> list[torch.Tensor]:
        """Gradients of the draft cross-entropy of the blocks at ``anchors`` [B, N], masked by ``attention``
        (a name in ``BLOCK_MASKS``)."""
        (b, t), blk = self.doc.shape, self.head.config.block_size
        a = anchors.clamp(min=0)
        qpos = (a[:, :, None] + torch.arange(blk)).reshape(b, -1)
        want = self.labels.gather(1, (a[:, :, None] + torch.arange(1, blk + 1)).clamp(max=t - 1).reshape(b, -1))
        self.head.zero_grad()
        with torch.autocast(**self.autocast):
            kv = self.head.context_kv(self.head.context(self.feats), self.pos)
            block = self.head.block_inputs(self.emb.gather(1, a[:, :, None].expand(-1, -1, HIDDEN)))
            hs = self.head(block, qpos, kv, BLOCK_MASKS[attention](anchors, self.doc, blk))
            loss = linear_cross_entropy(hs.flatten(0, 1), self.head.lm_head.weight, want.flatten(), impl="chunked")
        loss.backward()
        return [p.grad.clone() for p in self.head.parameters() if p.grad is not None]


def block_steps(dtype, b: int, t: int, anchors: list[int], repeats: int) -> list[dict]:
    """Seconds of a DFlash training step at each number of anchors per row, with either SDPA mask."""
    step, out = BlockStep(dtype, b, t), []
    for n in anchors:
        drawn = sample_anchors(torch.ones(b, t, dtype=torch.bool), step.doc, n, torch.Generator().manual_seed(4))
        seconds, grads = {}, {}
        for name in ("sdpa", "tiles"):
            seconds[name], _, grads[name] = timed(lambda drawn=drawn, name=name: step.grads(drawn, name), repeats)
        diff = max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(grads["sdpa"], grads["tiles"], strict=True))
        out.append({"anchors": n, **seconds, "seconds_per_block": {k: v / (b * n) for k, v in seconds.items()},
                    "speedup": seconds["sdpa"] / seconds["tiles"], "max_rel_grad_diff": diff})
        print(f"dflash step, {n} anchors per row: sdpa {seconds['sdpa']:.2f} s, tiles {seconds['tiles']:.2f} s "
              f"({out[-1]['speedup']:.2f}x; {1000 * seconds['tiles'] / (b * n):.2f} ms per block), "
              f"largest gradient difference {diff:.1e} of the largest gradient")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="bfloat16: attention in bf16, the step under bf16 autocast (precision bf16-mixed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--parts", default="attention,ttt,loss,blocks")
    ap.add_argument("--anchors", default="128,512", help="blocks per row in the blocks part (comma list)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype, b, t = getattr(torch, args.dtype), args.rows, args.tokens
    parts = set(args.parts.split(","))
    res = {**vars(args), "threads": torch.get_num_threads()}
    if "attention" in parts:
        mask = doc_causal_mask(packed_docs(b, t), dtype=dtype)
        res["attention"] = attention(mask, dtype, b, t, args.repeats)
    step = Step(dtype, b, t, args.ttt_steps) if parts & {"ttt", "loss"} else None
    if "ttt" in parts:
        res["ttt"] = whole_ttt(step, args.ttt_steps, args.repeats)
    if "loss" in parts:
        res["loss"] = loss_impls(step, b * t, args.repeats)
    if "blocks" in parts:
        res["blocks"] = block_steps(dtype, b, t, [int(n) for n in args.anchors.split(",")], args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
