"""Engines that write the target's answers for ``distill`` (``--engine``), one interface for both.

* ``draftheads``: the project's engine (continuous batching over the paged KV cache), hidden states of
  the generation pass captured on the way.
* ``vllm``: vLLM's offline ``LLM`` in its own environment (``.venv-vllm``), driven over JSON lines by
  ``draftheads/datagen/vllm_runner.py``; features through vLLM's ``extract_hidden_states`` (see :class:`VLLMBackend`).

Both follow the same conversation rules (:class:`~draftheads.datagen.batching.ContinuousBatcher`): an
answer ends at an end-of-turn token or at its budget, min(max_new_tokens, max_seq_len - tokens so far);
an answer cut at its budget is marked truncated and ends the conversation; after an end-of-turn token
the next user turn's template tokens are appended when they fit below max_seq_len.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from draftheads.datagen.batching import Conversation, Finished, check_first_prompt
from draftheads.errors import DraftheadsError

RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"


_LOG_PREFIX = re.compile(r"^(\(\S+ pid=\d+\) )?(\w+ \d\d-\d\d [\d:]+ \[[^\]]*\] )?")
_EXCEPTION = re.compile(r"^([\w.]+(Error|Exception)|NotImplementedError|AssertionError)\b")


def last_error(output: str) -> str | None:
    """The root exception of a failed vLLM run, to quote in one line: the last ``SomeError: ...`` line
    (log prefixes of vLLM's worker processes stripped) that is not a "see root cause above" wrapper,
    with pydantic's indented detail line appended."""
    lines = [_LOG_PREFIX.sub("", ln) for ln in output.splitlines()]
    hits = [i for i, ln in enumerate(lines) if _EXCEPTION.match(ln.strip())]
    if not hits:
        return None
    roots = [i for i in hits if "root cause" not in lines[i]]
    i = (roots or hits)[-1]
    msg = lines[i].strip()
    if i + 1 < len(lines) and lines[i + 1].startswith((" ", "\t")) and lines[i + 1].strip():
        msg += ": " + lines[i + 1].strip()
    return msg[:400]


@dataclass
class EngineBackend:
    """The project's engine: ``target`` a loaded Target."""

    target: object
    batch_size: int
    max_seq_len: int | None = None
    capture: tuple[int, ...] = ()
    feature_dtype: object = None
    captures_features = True

    def __post_init__(self):
        import torch

        from draftheads.datagen.batching import ContinuousBatcher
        from draftheads.inference.engine import Engine

        self.engine = Engine(self.target.model, self.target.tokenizer)
        self.batcher = ContinuousBatcher(self.engine, self.batch_size, self.max_seq_len, capture=self.capture,
                                         feature_dtype=self.feature_dtype or torch.bfloat16)
        self.max_seq_len = self.batcher.max_seq_len

    @property
    def eos(self) -> set[int]:
        return self.engine.eos

    @property
    def hidden_size(self) -> int:
        return self.target.info.hidden_size

    @property
    def tokens_generated(self) -> int:
        return self.batcher.tokens_generated

    def run(self, conversations: Iterable[Conversation]) -> Iterator[Finished]:
        return self.batcher.run(conversations)

    def close(self) -> None:
        pass


class VLLMBackend:
    """vLLM in its own environment: ``python`` runs :data:`RUNNER` on ``model_dir`` (an HF directory vLLM
    reads). Conversations advance in rounds, one vLLM ``generate`` per turn index, all rows together.

    With ``capture`` (HF hidden-state ids) vLLM also extracts hidden states: each finished conversation
    is prefilled once more as a whole, and its features and the target's greedy next tokens come back
    from vLLM (the last layer through the target's final norm, as the project's id ``num_layers`` is)."""

    def __init__(self, model_dir: str | os.PathLike, eos: set[int], max_seq_len: int, python: str = DEFAULT_VLLM_PYTHON,
                 dtype: str = "float32", tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, executor: str | None = None, seed: int = 0,
                 log: str | os.PathLike | None = None, runner: str | os.PathLike = RUNNER, chunk_size: int = 2048,
                 capture: tuple[int, ...] = (), capture_dir: str | os.PathLike | None = None, num_layers: int = 0,
                 hidden_size: int = 0, feature_dtype=None):
        """``chunk_size``: conversations taken from the queue at a time; each chunk runs all its turns
        before the next starts, so a killed run loses at most one chunk."""
        if not Path(python).is_file():
            raise DraftheadsError(f"--vllm-python {python!r} does not exist: build vLLM's environment with "
                                  "`make vllm-check` (it creates .venv-vllm), or point at a python that has vLLM")
        self.eos, self.max_seq_len, self.chunk_size = set(eos), max_seq_len, chunk_size
        self.tokens_generated = 0
        self.capture, self.hidden_size, self.num_layers = tuple(capture), hidden_size, num_layers
        self.feature_dtype = feature_dtype
        # a whole conversation is prefilled for its features, plus the one token vLLM then samples
        cmd = [str(python), str(runner), "--model", str(model_dir), "--dtype", dtype,
               "--max-model-len", str(max_seq_len + bool(capture)), "--tensor-parallel-size",
               str(tensor_parallel_size), "--data-parallel-size", str(data_parallel_size),
               "--pipeline-parallel-size", str(pipeline_parallel_size), "--seed", str(seed)]
        if executor:
            cmd += ["--distributed-executor-backend", executor]
        self.norm = None
        if capture:
            from draftheads.targets import final_norm

            self.norm = final_norm(model_dir) if num_layers in capture else None
            Path(capture_dir).mkdir(parents=True, exist_ok=True)
            cmd += ["--capture", ",".join(map(str, capture)), "--capture-dir", str(capture_dir)]
        self._log = open(log, "a") if log else None  # noqa: SIM115 (lives as long as the runner)
        # vLLM's CPU build reserves a fraction of host memory unless given a KV-cache size (ignored on GPUs)
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     stderr=self._log or sys.stderr)
        hello = self._read()
        self.vllm_version = hello.get("vllm_version")
        self.round = 0

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            why = ""
            if self._log:
                self._log.flush()
                why = f": {last_error(Path(self._log.name).read_text(errors='replace')) or 'no exception line'}; " \
                      f"its log: {self._log.name}"
            raise DraftheadsError(f"the vLLM runner stopped (exit status {rc}){why}")
        return json.loads(line)

    def generate(self, requests: list[dict]) -> dict:
        """One round: ``{key: {"token_ids", "finish_reason", "stop_reason"}}``."""
        self.round += 1
        self.proc.stdin.write(json.dumps({"round": self.round, "requests": requests}) + "\n")
        self.proc.stdin.flush()
        out = {}
        while True:
            msg = self._read()
            if "round_done" in msg:
                return out
            out[msg["key"]] = msg

    def run(self, conversations: Iterable[Conversation]) -> Iterator[Finished]:
        chunk = []
        for conv in conversations:
            chunk.append(conv)
            if len(chunk) == self.chunk_size:
                yield from self._run_chunk(chunk)
                chunk = []
        if chunk:
            yield from self._run_chunk(chunk)

    def _run_chunk(self, conversations: list[Conversation]) -> Iterator[Finished]:
        live = []
        for conv in conversations:
            first = check_first_prompt(conv, self.max_seq_len)
            live.append({"conv": conv, "tokens": list(first), "mask": [0] * len(first), "turn": 0,
                         "answers": [], "truncated": []})
        stop = sorted(self.eos)
        while live:
            reqs, done = [], []
            for row in live:
                sp = row["conv"].params
                budget = min(sp.max_new_tokens, self.max_seq_len - len(row["tokens"]))
                reqs.append({"key": str(row["conv"].key), "prompt_token_ids": row["tokens"], "max_tokens": budget,
                             "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.seed,
                             "stop_token_ids": stop})
            results = self.generate(reqs)
            still = []
            for row in live:
                res = results[str(row["conv"].key)]
                answer = list(res["token_ids"])
                ended = res["finish_reason"] == "stop"
                if ended and (not answer or answer[-1] not in self.eos):
                    if not isinstance(res.get("stop_reason"), int):
                        raise DraftheadsError(f"vLLM stopped {row['conv'].key!r} on {res.get('stop_reason')!r}, "
                                              "not on an end-of-turn token")
                    answer.append(res["stop_reason"])  # vLLM leaves a stop token out of the ids
                self.tokens_generated += len(answer)
                row["tokens"] += answer
                row["mask"] += [1] * len(answer)
                row["answers"].append(answer)
                row["truncated"].append(not ended)
                row["turn"] += 1
                segs = row["conv"].segments
                nxt = segs[row["turn"]] if ended and row["turn"] < len(segs) else None
                if nxt is not None and len(row["tokens"]) + len(nxt) < self.max_seq_len:
                    row["tokens"] += nxt
                    row["mask"] += [0] * len(nxt)
                    still.append(row)
                else:
                    done.append(row)
            live = still
            yield from self._finish(done)

    @property
    def captures_features(self) -> bool:
        return bool(self.capture)

    def _finish(self, rows: list[dict]) -> Iterator[Finished]:
        """Finished conversations, with their features when capturing (one prefill round for all rows)."""
        results = {}
        if self.capture and rows:
            results = self.generate([{"key": str(r["conv"].key), "prompt_token_ids": r["tokens"], "max_tokens": 1,
                                      "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "stop_token_ids": [],
                                      "features": True} for r in rows])
        for row in rows:
            key = row["conv"].key
            features, argmax = {}, None
            if self.capture:
                res = results[str(key)]
                features = self._features(res["hidden_states_path"], row["tokens"], key)
                argmax = torch.tensor(res["argmax"], dtype=torch.long)
            yield Finished(key, row["tokens"], row["answers"], row["truncated"], row["mask"], features, argmax)

    def _features(self, path: str, tokens: list[int], key) -> dict:
        """``{id: [T, hidden]}`` from one of vLLM's hidden-states files (removed once read)."""
        hidden, ids = read_hidden_states(path)
        if ids.tolist() != tokens or tuple(hidden.shape[1:]) != (len(self.capture), self.hidden_size):
            raise DraftheadsError(f"vLLM's hidden states for {key!r} are {tuple(hidden.shape)} over other tokens, "
                                  f"not [{len(tokens)}, {len(self.capture)}, {self.hidden_size}]: the vLLM "
                                  "version's extract_hidden_states layout differs")
        out = {}
        for j, layer in enumerate(self.capture):
            h = hidden[:, j].float()
            out[layer] = (self.norm(h) if layer == self.num_layers else h).to(self.feature_dtype or torch.bfloat16)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._log:
            self._log.close()


def read_hidden_states(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_states [T, layers, hidden], token_ids [T]) of a file vLLM's hidden-states connector wrote,
    once its writer has released the file's lock; the file and its lock are removed."""
    from safetensors.torch import load_file

    from draftheads.datagen.vllm_runner import wait_for_writer

    wait_for_writer(str(path))
    data = load_file(str(path))
    os.remove(path)
    return data["hidden_states"], data["token_ids"]


ENGINES = ("draftheads", "vllm")
VLLM_EXECUTORS = ("mp", "ray")


def check_engine(engine: str) -> None:
    """``--engine``: one of :data:`ENGINES`."""
    if engine not in ENGINES:
        raise DraftheadsError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")


def make_backend(engine: str, target, out: Path, batch_size: int, max_seq_len: int | None = None, seed: int = 0,
                 vllm: dict | None = None, capture: tuple[int, ...] = (), feature_dtype=None):
    """(backend, tokenizer, target name, dtype name) for a command writing ``out``. ``target``: a loaded
    Target (``draftheads``) or the target spec (``vllm``: only its tokenizer and config load here, vLLM loads
    the weights in its own environment; ``vllm`` holds :class:`VLLMBackend` options)."""
    check_engine(engine)
    if engine == "draftheads":
        backend = EngineBackend(target, batch_size, max_seq_len, capture=capture, feature_dtype=feature_dtype)
        return backend, target.tokenizer, target.info.name, str(target.info.dtype).replace("torch.", "")
    from draftheads.targets import (
        load_tokenizer,
        resolve_target,
        target_eos_ids,
        text_config,
        vllm_target_dir,
    )

    spec, opts = str(target), dict(vllm or {})
    path = Path(resolve_target(spec))
    tok = load_tokenizer(spec)
    cfg = text_config(spec)
    positions = getattr(cfg, "max_position_embeddings", 2048)
    max_seq_len = min(2048, positions) if max_seq_len is None else max_seq_len
    if not 2 <= max_seq_len <= positions:
        raise DraftheadsError(f"max sequence length {max_seq_len} must be in [2, {positions}] (the target's context)")
    model_dir = vllm_target_dir(path, out.with_name(f".{out.name}.vllm-target"))
    known = ("python", "dtype", "tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size", "executor",
             "runner")
    backend = VLLMBackend(model_dir, set(target_eos_ids(path, tok)), max_seq_len, seed=seed,
                          log=out.with_name(out.name + ".vllm.log"), chunk_size=max(batch_size, 1) * 32,
                          capture=capture, capture_dir=out.with_name(f".{out.name}.hidden-states"),
                          num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, feature_dtype=feature_dtype,
                          **{k: v for k, v in opts.items() if k in known})
    return backend, tok, spec, opts.get("dtype", "float32")


def engines_markdown(res: dict) -> str:
    """The table of ``scripts/vllm_distill_check.py``'s ``results.json``: the two engines on the same prompts
    (text, speed, and vLLM's captured features against the project's forward)."""
    t, s, f = res["text"], res["speed"], res["features"]
    head = f"`{res['command']}` ({res['date']}, {res['machine']['cpu_count']} CPUs)\n\n" if "command" in res else ""
    lines = [f"{head}{t['prompts']} prompts (`bundled:train`, {res['per_domain']} per domain), {res['max_new_tokens']} new "
             f"tokens at most, T = 0, batch {res['batch_size']}, fp32", "",
             "| | draftheads engine | vLLM |", "|---|---|---|",
             f"| conversations identical | {t['identical']}/{t['prompts']} | |",
             f"| new tokens/s (text only) | {s['draftheads']['tok_s']:.1f} | {s['vllm']['tok_s']:.1f} |",
             f"| new tokens/s with eagle3 features | {s['draftheads_features']['tok_s']:.1f} | "
             f"{s['vllm_features']['tok_s']:.1f} |",
             f"| text with features = text without | {t['identical_with_capture_ours']}/{t['prompts']} | "
             f"{t['identical_with_capture']}/{t['prompts']} |", "",
             "| layer | vLLM vs our forward: max abs diff / max abs | bf16 rounding of our own |", "|---|---|---|"]
    for layer in f["layers"]:
        lines.append(f"| {layer} | {f['max_rel_err'][str(layer)]:.2e} | {f['bf16_floor'][str(layer)]:.2e} |")
    lines.append(f"\ntarget greedy next token (`target_argmax`) equal on {f['argmax_agreement']:.4%} of "
                 f"{f['tokens']} tokens")
    for d in t["divergences"]:
        lines.append(f"- {d['id']} turn {d['turn']}, token {d['token']}: top-2 logit gap {d['top2_gap']:.2e} "
                     f"(ours {d['ours']!r}, vLLM {d['vllm']!r})")
    return "\n".join(lines) + "\n"
