"""A small OpenAI-compatible server for the tests of ``prepare --server``, which injects faults.

It speaks the part of vLLM's protocol that ``prepare`` uses, written from vLLM's
documented request and response fields (the "OpenAI-Compatible Server" page of
docs.vllm.ai and the field list of its completion request and response), not from its
code: ``GET /health``; ``GET /v1/models``, ``{"object": "list", "data": [{"id": ...}]}``;
``POST /v1/completions`` taking ``model``, ``prompt`` (a string, or a list of token
ids), ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and vLLM's
``return_token_ids``, and answering ``choices[0]`` with ``text`` (special tokens
skipped), ``finish_reason`` (``"stop"`` or ``"length"``) and, when asked,
``token_ids`` (the generated ids, the stop token included) and ``prompt_token_ids``,
plus ``usage`` (``prompt_tokens``, ``completion_tokens``). ``strict=True`` plays a server
without token ids (``transformers serve``): a field it does not know gets HTTP 422.

Faults are taken one per completion request from ``faults`` (rows: ``max_tokens`` > 1)
or ``probe_faults`` (``prepare``'s one-token probes): ``"500"``, ``"503"``, ``"429"``
(with ``Retry-After: 0``), ``"400"``, ``"drop"`` (the connection closed with no answer),
``"slow"`` (the answer only after ``slow_s``), or None (a normal answer). ``requests``
keeps every completion request's body.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

KNOWN_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "n", "stop", "stream",
                "frequency_penalty", "presence_penalty", "logprobs", "echo", "best_of", "user", "suffix"}
"""OpenAI's completion request fields: all a strict server takes."""


def hashed_model(eos: int, vocab: range, mean_len: int = 8):
    """A stand-in for a model: ids drawn from a hash of (prompt, seed if sampling, position),
    ending with ``eos`` after a length that depends on the prompt."""
    def generate(prompt: list[int], max_tokens: int, temperature: float, top_p: float, seed: int | None) -> list[int]:
        key = json.dumps([prompt, seed if temperature > 0 else None])
        h = int(hashlib.sha256(key.encode()).hexdigest(), 16)
        n = 1 + h % (2 * mean_len)
        ids = [vocab[int(hashlib.sha256(f"{key}/{i}".encode()).hexdigest(), 16) % len(vocab)] for i in range(n)]
        return (ids + [eos])[:max_tokens]
    return generate


class StubServer:
    """``with StubServer(generate, tokenizer) as url: ...``; ``generate(prompt ids,
    max_tokens, temperature, top_p, seed)`` returns the generated ids."""

    def __init__(self, generate, tokenizer, *, stops: tuple[int, ...] = (), models: tuple[str, ...] = ("stub",),
                 strict: bool = False, slow_s: float = 2.0):
        self.generate, self.tokenizer, self.stops = generate, tokenizer, set(stops)
        self.models, self.strict, self.slow_s = list(models), strict, slow_s
        self.faults: list[str | None] = []
        self.probe_faults: list[str | None] = []
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> "StubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()

    def row_requests(self) -> list[dict]:
        """The completion requests of rows (not the one-token probes), in arrival order."""
        with self._lock:
            return [r for r in self.requests if r.get("max_tokens", 16) > 1]

    def answer(self, body: dict) -> tuple[int, dict]:
        if self.strict and set(body) - KNOWN_FIELDS:
            return 422, {"detail": f"Unexpected fields in the request: {sorted(set(body) - KNOWN_FIELDS)}"}
        if body.get("model") not in self.models:
            return 404, {"object": "error", "message": f"The model `{body.get('model')}` does not exist.", "code": 404}
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        out = self.generate(ids, body.get("max_tokens", 16), body.get("temperature", 1.0), body.get("top_p", 1.0),
                            body.get("seed"))
        choice = {"index": 0, "text": self.tokenizer.decode(out, skip_special_tokens=True),
                  "finish_reason": "stop" if out and out[-1] in self.stops else "length"}
        if body.get("return_token_ids"):
            choice |= {"token_ids": out, "prompt_token_ids": ids}
        return 200, {"id": "cmpl-stub", "object": "text_completion", "model": body["model"], "choices": [choice],
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                               "total_tokens": len(ids) + len(out)}}

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"       # keep-alive, as real servers

            def log_message(self, *args):
                pass

            def _send(self, status: int, obj: dict, headers: dict | None = None) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:         # the client gave up (a "slow" answer)
                    self.close_connection = True

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, {"status": "ok"})
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in stub.models]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self._send(404, {"detail": "Not Found"})
                    return
                with stub._lock:
                    stub.requests.append(body)
                    faults = stub.faults if body.get("max_tokens", 16) > 1 else stub.probe_faults
                    fault = faults.pop(0) if faults else None
                if fault == "drop":
                    self.close_connection = True
                    return
                if fault == "slow":
                    time.sleep(stub.slow_s)
                if fault in ("500", "503", "400"):
                    self._send(int(fault), {"detail": f"injected {fault}"})
                elif fault == "429":
                    self._send(429, {"detail": "injected 429"}, {"Retry-After": "0"})
                else:
                    self._send(*stub.answer(body))

        return Handler


def full_vocab_chat_target(out: Path, model_dir: Path | None = None, vocab_size: int = 256) -> Path:
    """A chat target whose tokenizer has one single-character token per model row (the
    tiny chat target's maps half its rows to nothing), so generated text decodes and
    re-tokenizes to the same ids unless a special token was generated, as with a real
    model's tokenizer. The template is the tiny chat target's; the generation config
    stops at ``<|im_end|>``, as a real model's does. Weights from ``model_dir`` if given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from tests.support.chat import SPECIALS, TEMPLATE

    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if model_dir is not None:
        for f in ("config.json", "model.safetensors"):
            shutil.copy(model_dir / f, out / f)
    printable = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    chars = printable + [chr(0x100 + i) for i in range(vocab_size - len(SPECIALS) - len(printable))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + chars)}, unk_token="<|unused|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|unused|>", pad_token="<|pad|>",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIALS[1:],
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    GenerationConfig(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id).save_pretrained(out)
    return out


PROMPTS = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"}]} for i in range(8)]
"""The chat prompts the serving tests regenerate."""


def served_chat(cache_dir: Path, out: Path, prompts_list: list[dict] = PROMPTS) -> tuple[Path, Path]:
    """``(target dir, prompts file)``: the tiny target with a tokenizer covering its
    vocabulary, and ``prompts_list`` as JSONL, under ``out``."""
    from dflash_actors.config import load_config
    from dflash_actors.models.target import ensure_target
    from tests.support.pipeline import HEADS_16, ROOT, SMALL

    cfg = load_config(ROOT / "configs/default.yaml", SMALL + HEADS_16 + [f"data.cache_dir={cache_dir}"])
    target = full_vocab_chat_target(out / "target", ensure_target(cfg))
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in prompts_list))
    return target, prompts
