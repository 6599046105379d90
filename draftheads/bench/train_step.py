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
4. scored: a whole step as in 3 (chunked loss) with the training-time test run at every position against
   only where the loss scores some step (``Eagle3Head.ttt(keep=...)``; step 0's keys and values still
   everywhere), each document's first --prompt-share of tokens a prompt (not scored);
5. blocks: a DFlash training step of a 2-layer head (block 8, draft vocabulary 8k), forward and backward
   through the draft cross-entropy, at each number of anchors per row in --anchors (what
   ``model.anchors_per_row`` costs), with the blocks masked for one SDPA (``model.attention: sdpa``)
   against tiles of whole blocks (``model.attention: tiles``).

Rows of --tokens tokens packed with documents of 200-500 tokens, cut at other places in each row, all
answer tokens (but in part 4). Prints seconds per call and the largest differences, and writes JSON to
--out (``draftheads report`` renders it: :func:`markdown`).

    python scripts/bench_train_step.py [--dtype bfloat16] [--parts attention,ttt,loss,scored,blocks] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from draftheads.heads import DFlashConfig, DFlashHead, Eagle3Config, Eagle3Head, LayerSpec, layers
from draftheads.heads.dflash import BLOCK_MASKS
from draftheads.heads.layers import masked_own_attention, prefix_and_own_attention
from draftheads.training.data import doc_causal_mask
from draftheads.training.dflash import sample_anchors
from draftheads.training.losses import eagle3_loss, linear_cross_entropy, ttt_scored_positions
from draftheads.utils import atomic_write_json

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

    def __init__(self, dtype, b, t, steps, prompt_share=0.0):
        g = torch.Generator().manual_seed(1)
        self.head = smollm2_head(steps)
        self.autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        self.aux, self.emb = torch.randn(b, t, 3 * HIDDEN, generator=g), torch.randn(b, t, HIDDEN, generator=g)
        self.pos = torch.arange(t).expand(b, t)
        self.doc = packed_docs(b, t)
        self.last = torch.randn(b, t, HIDDEN, generator=g)
        self.teacher = torch.randn(DRAFT_VOCAB, HIDDEN, generator=g) * 0.05
        self.argmax = torch.randint(0, DRAFT_VOCAB, (b, t), generator=g)
        # each document's first prompt_share of its tokens is a prompt (as packed rows cut documents, a
        # document's tokens are counted from where it starts in the row)
        start = torch.cat([torch.ones(b, 1, dtype=torch.bool), self.doc[:, 1:] != self.doc[:, :-1]], 1)
        idx = torch.arange(t).expand(b, t)
        first = torch.cummax(torch.where(start, idx, 0), 1).values
        length = torch.zeros(b, t, dtype=torch.long).scatter_add_(1, self.doc, torch.ones(b, t, dtype=torch.long))
        self.answer = (idx - first) >= (prompt_share * length.gather(1, self.doc)).long()
        self.keep = ttt_scored_positions(self.answer, self.doc, self.argmax, steps)

    def grads(self, loss_impl: str | None = None, answer: bool = False, kept: bool = False):
        """Gradients of the training-time test's outputs (``loss_impl`` None: a sum of squares) or of the
        EAGLE-3 loss computed with ``loss_impl`` (over the answer tokens alone with ``answer``, steps >= 1
        then run only where the loss scores some step with ``kept``); with a loss, the loss is returned last."""
        self.head.zero_grad()
        with torch.autocast(**self.autocast):
            outs = self.head.ttt(self.aux, lambda j: self.emb, self.pos, doc_causal_mask(self.doc),
                                 keep=self.keep if kept else None)
            if loss_impl is None:
                loss = sum(o.float().pow(2).mean() for o in outs)
            else:
                mask = self.answer if answer else torch.ones_like(self.doc, dtype=torch.bool)
                loss = eagle3_loss(outs, self.last, mask, self.doc, self.head.lm_head.weight, self.teacher,
                                   self.argmax, impl=loss_impl)[0]
        loss.backward()
        out = [p.grad.clone() for p in self.head.parameters() if p.grad is not None]
        return out if loss_impl is None else [*out, loss.detach()]


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


def scored_steps(step: Step, tokens: int, repeats: int) -> dict:
    """A whole training step with the training-time test at every position against only at the scored ones."""
    opt = torch.optim.AdamW(step.head.parameters(), lr=0.0)  # its work, the weights unchanged
    out, results, times = {}, {}, {"everywhere": [], "scored": []}
    for _ in range(repeats + 1):  # the two interleaved, so that a slow spell of the machine hits both
        for name in times:
            t0 = time.perf_counter()
            results[name] = step.grads("chunked", answer=True, kept=name == "scored")
            opt.step()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        seconds = statistics.median(ts[1:])
        out[name] = {"seconds": seconds, "tokens_per_s": tokens / seconds, "all_seconds": ts}
    (*ga, la), (*gb, lb) = results["everywhere"], results["scored"]
    out["speedup"] = out["everywhere"]["seconds"] / out["scored"]["seconds"]
    out["loss"] = {"everywhere": la.item(), "scored": lb.item(), "abs_diff": (la - lb).abs().item()}
    out["max_rel_grad_diff"] = max(((x - y).abs().max() / x.abs().max().clamp(min=1e-30)).item() for x, y in zip(ga, gb))
    share = step.answer.float().mean().item()
    out["answer_share"], out["kept_share"] = share, step.keep.float().mean().item()
    out["kept_width_share"] = step.keep.sum(1).max().item() / step.keep.shape[1]
    print(f"training step, training-time test everywhere {out['everywhere']['seconds']:.2f} s "
          f"({out['everywhere']['tokens_per_s']:.0f} tok/s), at the scored positions {out['scored']['seconds']:.2f} s "
          f"({out['scored']['tokens_per_s']:.0f} tok/s): {out['speedup']:.2f}x; answers {share:.0%} of tokens, "
          f"it runs at {out['kept_width_share']:.0%} of a row; loss {la.item():.6f} against {lb.item():.6f}, "
          f"largest gradient difference {out['max_rel_grad_diff']:.1e} of the largest gradient")
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


def run(dtype: str = "bfloat16", rows: int = 4, tokens: int = 1024, repeats: int = 3, ttt_steps: int = 5,
        parts: str = "attention,ttt,loss,scored,blocks", anchors: str = "128,512", prompt_share: float = 0.26) -> dict:
    """Every part asked for, side by side; the JSON ``markdown`` renders."""
    from draftheads.evaluation import machine

    torch_dtype, b, t = getattr(torch, dtype), rows, tokens
    asked = set(parts.split(","))
    res = {"kind": "train_step", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
           "machine": machine(), "dtype": dtype, "rows": rows, "tokens": tokens, "repeats": repeats,
           "ttt_steps": ttt_steps, "parts": parts, "anchors": anchors, "prompt_share": prompt_share,
           "threads": torch.get_num_threads()}
    if "attention" in asked:
        mask = doc_causal_mask(packed_docs(b, t), dtype=torch_dtype)
        res["attention"] = attention(mask, torch_dtype, b, t, repeats)
    step = Step(torch_dtype, b, t, ttt_steps, prompt_share) if asked & {"ttt", "loss", "scored"} else None
    if "ttt" in asked:
        res["ttt"] = whole_ttt(step, ttt_steps, repeats)
    if "loss" in asked:
        res["loss"] = loss_impls(step, b * t, repeats)
    if "scored" in asked:
        res["scored"] = scored_steps(step, b * t, repeats)
    if "blocks" in asked:
        res["blocks"] = block_steps(torch_dtype, b, t, [int(n) for n in anchors.split(",")], repeats)
    return res


def markdown(res: dict) -> str:
    """The tables of a run's JSON: seconds of each pair side by side, and how far apart their results are."""
    x = lambda v: f"{v:.2f}x"  # noqa: E731
    lines = [f"`{res['command']}` ({res['date']}, {res['machine']['platform']}, {res['threads']} threads, "
             f"{res['dtype']}; {res['rows']} rows of {res['tokens']} tokens, {res['ttt_steps']} TTT steps, draft "
             f"vocabulary {DRAFT_VOCAB}; each pair side by side in one run)", "",
             "| part | before | after | speedup | results apart by |", "|---|---|---|---|---|"]
    for a in res.get("attention", []):
        lines.append(f"| TTT attention, step {a['step']}, forward and backward (masked → `prefix_and_own_attention`) | "
                     f"{a['masked']:.2f} s | {a['prefix_and_own']:.2f} s | {x(a['speedup'])} | {a['max_diff']:.1e} (output) |")
    if "ttt" in res:
        a = res["ttt"]
        lines.append(f"| whole training-time test, forward and backward, with either attention | {a['masked']:.2f} s | "
                     f"{a['prefix_and_own']:.2f} s | {x(a['speedup'])} | {a['max_grad_diff']:.1e} (gradients) |")
    if "loss" in res:
        a = res["loss"]
        lines.append(f"| whole step with the EAGLE-3 loss and AdamW (`loss_impl` chunked → compiled; its first call, "
                     f"with the compile, {a['compiled']['first_call_seconds']:.1f} s) | {a['chunked']['seconds']:.2f} s "
                     f"({a['chunked']['tokens_per_s']:.0f} tok/s) | {a['compiled']['seconds']:.2f} s "
                     f"({a['compiled']['tokens_per_s']:.0f} tok/s) | {x(a['speedup'])} | {a['max_grad_diff']:.1e} (gradients) |")
    if "scored" in res:
        a = res["scored"]
        lines.append(f"| whole step, {a['answer_share']:.0%} of tokens answers: the training-time test at every position → "
                     f"where the loss scores ({a['kept_width_share']:.0%} of a row) | {a['everywhere']['seconds']:.2f} s "
                     f"({a['everywhere']['tokens_per_s']:.0f} tok/s) | {a['scored']['seconds']:.2f} s "
                     f"({a['scored']['tokens_per_s']:.0f} tok/s) | {x(a['speedup'])} | loss {a['loss']['abs_diff']:.1e}, "
                     f"gradients {a['max_rel_grad_diff']:.1e} of the largest |")
    for a in res.get("blocks", []):
        lines.append(f"| DFlash step, {a['anchors']} blocks per row (`attention` sdpa → tiles) | {a['sdpa']:.2f} s | "
                     f"{a['tiles']:.2f} s | {x(a['speedup'])} | {a['max_rel_grad_diff']:.1e} (gradients, of the largest) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="bfloat16: attention in bf16, the step under bf16 autocast (precision bf16-mixed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--parts", default="attention,ttt,loss,scored,blocks")
    ap.add_argument("--anchors", default="128,512", help="blocks per row in the blocks part (comma list)")
    ap.add_argument("--prompt-share", type=float, default=0.26,
                    help="share of each document's tokens that is its prompt, in the scored part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = run(args.dtype, args.rows, args.tokens, args.repeats, args.ttt_steps, args.parts, args.anchors,
              args.prompt_share)
    res["command"] = "python scripts/bench_train_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(markdown(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, res)
