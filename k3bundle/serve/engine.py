"""The built-in executor behind ``k3bundle serve``: render, prefill, greedy decode, one request at a time.

One ``Engine`` holds one model (a checkpoint or a bundle, ``open_weights``) and its tokenizer. A
request is rendered with the chat renderer (docs/chat.md §4.2), checked against the context
length, then run as one prefill and a decode loop on the executor (``Executor.prefill`` /
``decode``, the calls ``k3bundle run`` makes through ``generate``). A lock lets one request run
at a time: the executor keeps no batch, and a second request waits for the first to finish.

Planted faults (``FAULTS``) exist so that the checks run against a server (``k3bundle parsers``)
can be shown to catch them; a clean server has ``fault=None``. Each is chosen by
``serve --fault NAME`` or the ``K3BUNDLE_SERVE_FAULT`` environment variable, a test hook only.
"""

from __future__ import annotations

import codecs
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from k3bundle import tokenizer_specials as ts
from k3bundle.bundle.open_weights import open_weights, weights_kind
from k3bundle.chat import ChatError, Delta, ParsedMessage, StreamParser, render_ids
from k3bundle.executor import Executor
from k3bundle.io.strict_json import read_json
from k3bundle.serve.errors import ServeError
from k3bundle.tokenizer import load_tiktoken

#: planted faults: the parser bypassed (raw markup in ``content``), ``<|end_of_msg|>`` rendered
#: as the next special id, tie-break noise on the logits (greedy decode no longer repeatable), and
#: every ``HANG_EVERY``-th request stalled after its first token until its client goes away (a
#: stuck engine, for the soak's watchdog), and ``LEAK_BYTES`` of host memory kept per request
FAULTS = ("markup-in-content", "wrong-special-id", "nondeterministic", "hang", "leak")
HANG_EVERY = 3
#: host memory the planted leak keeps per request (written, so resident)
LEAK_BYTES = 32 << 20
FAULT_ENV = "K3BUNDLE_SERVE_FAULT"
#: scale of the planted noise, in logits: large enough to move the argmax within a few tokens
NOISE = 2.0


def _tokenizer_dir(path: Path) -> Path:
    """A bundle keeps its tokenizer in ``tokenizer/``; a checkpoint beside its config."""
    return path / "tokenizer" if weights_kind(path) == "bundle" else path


def _stop_ids(tok_dir: Path, encoding) -> set[int]:
    """``<|end_of_msg|>`` (the chat format's stop token, §4.1) and the ``eos_token_id`` of
    ``generation_config.json`` where there is one."""
    stops = {encoding.encode_single_token(ts.END_OF_MSG)}
    gen = tok_dir / "generation_config.json"
    eos = read_json(gen).get("eos_token_id") if gen.is_file() else None
    stops |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return {int(i) for i in stops}


class Engine:
    """One model served greedily; ``generate`` yields one token at a time under the lock."""

    def __init__(self, path: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 max_model_len: int | None = None, fault: str | None = None, name: str | None = None):
        if fault is not None and fault not in FAULTS:
            raise ServeError(f"fault {fault!r} is not one of {', '.join(FAULTS)}")
        path = Path(path)
        self.path, self.fault = path, fault
        self.name = name or path.resolve().name
        self.weights = open_weights(path, dtype, device, resident=True)
        self.executor = Executor(self.weights, all_logits=False)  # greedy reads only the last row
        tok_dir = _tokenizer_dir(path)
        self.encoding = load_tiktoken(tok_dir)
        self.stop_ids = _stop_ids(tok_dir, self.encoding)
        context = (self.weights.config.raw.get("text_config") or {}).get("max_position_embeddings")
        self.max_model_len = int(max_model_len or context or 0) or None
        self.lock = threading.Lock()
        self.served = 0  # requests decoded so far (the planted hang counts them)
        self.leaked: list[bytearray] = []  # the planted leak's memory
        self._noise = torch.Generator().manual_seed(torch.seed())  # the planted fault's only randomness

    # ---- prompts
    def render(self, messages: Sequence[dict], **render_kwargs) -> list[int]:
        """The prompt ids of a chat request (docs/chat.md §4.2); a bad conversation is a 400."""
        try:
            ids = render_ids(messages, self.encoding, **render_kwargs)
        except ChatError as e:
            raise ServeError(str(e), param="messages") from None
        if self.fault == "wrong-special-id":  # planted: the stop token's id off by one
            eom = self.encoding.encode_single_token(ts.END_OF_MSG)
            ids = [eom + 1 if i == eom else i for i in ids]
        return ids

    def encode(self, text: str) -> list[int]:
        """A completions prompt given as text: special-token strings become their ids, as a
        rendered prompt's markers must."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        n = self.encoding.n_vocab - ts.NUM_SPECIAL
        return self.encoding.decode([i for i in ids if not (skip_special and i >= n)])

    def check(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Ids in the vocabulary, and prompt + completion within the context (400 otherwise)."""
        if not prompt:
            raise ServeError("the prompt is empty", param="prompt")
        vocab = self.encoding.n_vocab
        bad = next((i for i in prompt if not 0 <= int(i) < vocab), None)
        if bad is not None:
            raise ServeError(f"token id {bad} is out of range 0..{vocab - 1}", param="prompt")
        if self.max_model_len is not None and len(prompt) + max_tokens > self.max_model_len:
            raise ServeError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                             f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                             "of the completion.", param="max_tokens")

    # ---- decoding
    def _choose(self, row: torch.Tensor) -> int:
        if self.fault == "nondeterministic":  # planted: random noise breaks greedy's repeatability
            row = row.float() + NOISE * torch.randn(row.shape, generator=self._noise).to(row.device)
        return int(torch.argmax(row))

    def generate(self, prompt: Sequence[int], max_tokens: int) -> TokenStream:
        """Greedy tokens after ``prompt``, each with its finish reason (None, "stop" on a stop
        token, "length" at ``max_tokens``), as a ``TokenStream``. A worker thread decodes under the
        lock and hands tokens over a queue, so the lock never waits on a reader: a client that
        goes away (``TokenStream.close``) stops the decode at the next token, and one that is never
        closed still ends at ``max_tokens``."""
        self.check(prompt, max_tokens)
        stream = TokenStream()
        threading.Thread(target=self._decode, args=(list(prompt), max_tokens, stream), daemon=True).start()
        return stream

    def _decode(self, prompt: list[int], max_tokens: int, stream: TokenStream) -> None:
        try:
            with self.lock:
                if stream.cancelled.is_set():
                    return
                self.served += 1
                if self.fault == "leak":  # planted: memory kept per request, never freed
                    self.leaked.append(bytearray(b"\x01") * LEAK_BYTES)
                hang = self.fault == "hang" and self.served % HANG_EVERY == 0
                logits, cache = self.executor.prefill(prompt)
                row = logits[-1]
                for n in range(1, max_tokens + 1):
                    token = self._choose(row)
                    finish = "stop" if token in self.stop_ids else "length" if n == max_tokens else None
                    stream.queue.put((token, finish))
                    if finish or stream.cancelled.is_set():
                        return
                    if hang:  # planted: stalled, holding the lock, until the client leaves
                        stream.cancelled.wait()
                        return
                    row = self.executor.decode(token, cache)
        except BaseException as e:  # handed to the reader, raised there
            stream.queue.put(e)
        finally:
            stream.queue.put(None)

    # ---- parsing
    def parser(self, thinking: bool) -> StreamParser | _Passthrough:
        """The XTML stream parser (docs/chat.md §4.3) over token ids; with the planted
        ``markup-in-content`` fault, a passthrough that puts the raw text in ``content``."""
        if self.fault == "markup-in-content":
            return _Passthrough(self.encoding)
        return StreamParser(thinking=thinking, encoding=self.encoding)


class TokenStream:
    """The tokens of one request as a worker thread decodes them: iterate for (token, finish)
    pairs; ``close`` asks the worker to stop."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[tuple[int, str | None]]:
        while (item := self.queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.cancelled.set()


class _Passthrough:
    """The parser bypassed (a planted fault): every token's text is content, markup and all."""

    def __init__(self, encoding):
        self.encoding, self.utf8, self.text = encoding, codecs.getincrementaldecoder("utf-8")("replace"), []

    def feed(self, ids: Sequence[int]) -> list[Delta]:
        text = self.utf8.decode(b"".join(self.encoding.decode_single_token_bytes(int(i)) for i in ids))
        self.text.append(text)
        return [Delta("content", text)] if text else []

    def flush(self) -> list[Delta]:
        text = self.utf8.decode(b"", final=True)
        self.text.append(text)
        return [Delta("content", text)] if text else []

    def finish(self) -> ParsedMessage:
        self.flush()
        return ParsedMessage(content="".join(self.text), finished=True)
