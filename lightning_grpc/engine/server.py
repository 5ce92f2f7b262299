"""The engine's HTTP server: OpenAI-compatible endpoints in vLLM's dialect, over ``aiohttp.web``.

Endpoints::

    POST /v1/chat/completions   the model's chat template with add_generation_prompt=True
    POST /v1/completions        prompt: text, token ids, or a list of either
    GET  /v1/models             the served model, with its max_model_len and policy_version
    GET  /health                200 {"status": "ok", ...} while the scheduler runs, else 503
    GET  /metrics               Prometheus text, under vLLM's metric names (see ``metrics``)
    POST /admin/load_weights    {"path": DIR, "policy_version": N?} -> {"policy_version": N, ...}

vLLM's fields: with ``"return_token_ids": true`` a chat response has a top-level ``prompt_token_ids``
and ``token_ids`` per choice (streaming: ``prompt_token_ids`` on the first chunk only, each chunk's
choice carrying the ids of its new tokens); a completion has both per choice (streaming: the prompt's on
the first chunk of each choice). Every response and chunk has a top-level ``policy_version`` (the
weights that produced it) and responses an ``x-policy-version`` header.

Tools, as vLLM's hermes parser: with ``tools`` (``tool_choice`` "auto" by default) complete
``<tool_call>`` blocks of the output become ``message.tool_calls`` (``content``: the text before them, or
null) and ``finish_reason`` "tool_calls"; streamed, content deltas until a block starts, then one
``tool_calls`` delta per completed block, every chunk still carrying its ``token_ids``. "required" or a
named function constrains sampling with llguidance to one such call (see ``tools`` and ``guided``).
Such a constrained choice also has ``forced_token_positions`` next to its ``token_ids`` (with
``return_token_ids`` only; streaming: per chunk, indices into that chunk's ``token_ids``): the indices of
the tokens the grammar forced, i.e. the only token it allowed at that step. They were not the policy's
choice, so a trainer leaves them out of the loss (their log-probs are still the model's own). A request
without a grammar has no such field: its answer is exactly as before.
Errors are
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request, 404 for an unknown model
or path, 401 for a wrong key when ``api_key`` is set, 500 if generation itself fails.

The model runs in the scheduler's thread (see ``scheduler``); the event loop only validates, tokenizes,
and turns the scheduler's per-iteration events into JSON or server-sent events as they arrive. Weight
reloads read the checkpoint in a worker thread and are applied between iterations once in-flight
requests have finished (requests that arrive meanwhile wait, then run on the new weights).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import os
import secrets
import socket
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_grpc._extras import extra_imports

with extra_imports("engine"):
    from aiohttp import web
    from prometheus_client import CollectorRegistry

from lightning_grpc import logs
from lightning_grpc.engine import metrics, tools
from lightning_grpc.engine import protocol as p
from lightning_grpc.engine.errors import EngineError, bad_request
from lightning_grpc.engine.guided import GrammarError, Grammars
from lightning_grpc.engine.inbox import LoopInbox
from lightning_grpc.engine.scheduler import Scheduler, SequenceUpdate, StepEvent, Submission, TokenLogprob
from lightning_grpc.engine.text import TokenTexts
from lightning_grpc.processes import freeze_startup_heap

log = logs.get_logger(__name__)

MIN_LOGPROB = -9999.0
#: Below this many parameters a forward pass is per-op overhead: the scheduler thread runs torch
#: single-threaded, as more threads only add synchronisation (and, on a busy machine, waits).
SMALL_MODEL_PARAMS = 20_000_000
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Paths served without the API key (as vLLM serves them): a liveness probe and a metrics scraper hold none.
UNGUARDED_PATHS = frozenset({"/health", "/metrics"})
POLICY_HEADER = "x-policy-version"
CLIENT_CHECK_SECONDS = 0.5
CLIENT_GONE = "client disconnected"
#: Chat prompts whose rendered token ids the engine remembers (least recently used go first).
RENDERED_PROMPTS = 4096


class _ClientGone(Exception):
    """The client closed the connection before its response was complete."""


@dataclass
class EngineConfig:
    model: str | Path
    host: str = "127.0.0.1"
    port: int = 0
    served_model_name: str | None = None
    max_batch_size: int = 64
    max_prefill_tokens: int = 16384
    policy_version: int = 0
    #: Required on the inference routes when set (without one they are open, for loopback use).
    api_key: str | None = field(default=None, repr=False)
    #: Required on the admin routes (/admin/*), always. None: ``api_key`` when set, else one is generated at
    #: start and written to ``admin_key_file`` (mode 0600), whose path is logged.
    admin_key: str | None = field(default=None, repr=False)
    #: Where a generated admin key is written (default: lightning-grpc-engine-PORT.admin-key in the temp dir,
    #: removed again when the engine stops; a file named here is left in place).
    admin_key_file: Path | None = None
    dtype: str = "float32"
    #: torch intra-op threads of the scheduler thread (None: 1 for a small model, else torch's default).
    threads: int | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or str(self.model)


# ---------------------------------------------------------------- loading
def _quiet_transformers() -> None:
    """No progress bars: the engine logs one line per event."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_model(path: str | Path, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype=getattr(torch, dtype)
    )
    return model.eval()


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS and the generation config's, which chat models often extend."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: Per token, whether a grammar forced it (None: no grammar).
    forced: list[bool] | None = None

    def add(self, update: SequenceUpdate) -> None:
        if update.forced is not None:
            self.forced = [*(self.forced or []), *update.forced]
        self.token_ids += update.token_ids
        self.text.append(update.text)
        self.logprobs += update.logprobs
        self.offsets += update.offsets
        self.finish_reason = update.finish_reason or self.finish_reason
        self.stop_reason = update.stop_reason if update.stop_reason is not None else self.stop_reason


@dataclass
class _Job:
    """One request on its way through the scheduler."""

    kind: str  # "chat" | "completion"
    request: p.ParsedRequest
    prompts: list[list[int]]
    request_id: str
    created: int
    model: str
    queue: asyncio.Queue[StepEvent]
    sub: Submission | None = None
    policy_version: int = -1
    outcome: str = "ok"
    started: float = field(default_factory=time.monotonic)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.request.n

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


class EngineServer:
    """The engine: ``await EngineServer(config).start()``, then ``base_url``; ``await stop()``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.host = config.host
        self.port = config.port
        self.scheduler: Scheduler | None = None
        self._metrics_registry: CollectorRegistry | None = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.vocab_size = 0
        self._texts: TokenTexts | None = None
        #: llguidance's view of the tokenizer, for forced tool calls (built at start).
        self.grammars: Grammars | None = None
        self._runner: web.AppRunner | None = None
        self._weights_lock = asyncio.Lock()
        self._started_at = int(time.time())
        self._inbox: LoopInbox | None = None
        self._model_class: Any = None
        #: The key /admin/* requires (set at start; see EngineConfig.admin_key).
        self.admin_key = config.admin_key or config.api_key or ""
        #: Where a generated admin key was written, if one was.
        self.admin_key_file: Path | None = None
        #: The key file is the engine's own (the default path in the temp directory): removed at stop.
        self._remove_admin_key_file = False

    # ------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://HOST:PORT/v1``."""
        return f"{self.url}/v1"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def policy_version(self) -> int:
        return self.scheduler.policy_version if self.scheduler else self.config.policy_version

    async def start(self) -> EngineServer:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        model, tokenizer, scheduler_tokenizer = await loop.run_in_executor(None, self._load)
        self.tokenizer = tokenizer
        self._texts = TokenTexts(tokenizer)
        self._rendered: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._model_class = type(model)
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        params = sum(t.numel() for t in model.parameters())
        self.scheduler = Scheduler(
            model,
            scheduler_tokenizer,
            eos_ids=stop_token_ids(model, tokenizer),
            max_batch_size=self.config.max_batch_size,
            max_prefill_tokens=self.config.max_prefill_tokens,
            policy_version=self.config.policy_version,
            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            threads=self.config.threads or (1 if params < SMALL_MODEL_PARAMS else None),
        )
        self.vocab_size = self.scheduler.vocab_size
        self._metrics_registry = metrics.registry(
            metrics.EngineCollector(
                self.model_name, self.scheduler.counters, self.scheduler.load, lambda: self.policy_version
            )
        )
        self.scheduler.grammars = self.grammars = await loop.run_in_executor(
            None, Grammars, tokenizer, self.vocab_size
        )
        self.scheduler.start()
        try:
            await self._listen()
            if not self.admin_key:
                self.admin_key, self.admin_key_file = self._generate_admin_key()
                self._remove_admin_key_file = self.config.admin_key_file is None
        except BaseException:
            await loop.run_in_executor(None, self.scheduler.close)
            raise
        if self.admin_key_file is not None:
            log.info("event=engine_admin_key_written file=%s", self.admin_key_file)
        log.info(
            "event=engine_started address=%s:%d model=%s served_model_name=%s policy_version=%d "
            "max_batch_size=%d max_model_len=%d params=%d seconds=%.2f",
            self.host,
            self.port,
            self.config.model,
            self.model_name,
            self.policy_version,
            self.config.max_batch_size,
            self.max_model_len,
            params,
            time.monotonic() - started,
        )
        return self

    def _load(self) -> tuple[Any, Any, Any]:
        path: str | Path = self.config.model
        if isinstance(path, Path) or path.startswith(("/", ".", "~")):  # a directory, not a cached hub id
            path = Path(path).expanduser()
            if not path.is_dir():
                raise ValueError(f"no model directory at {path}")
        # Two tokenizers: the event loop encodes while the scheduler thread decodes, and a fast
        # tokenizer must not be used from two threads at once.
        return load_model(path, self.config.dtype), load_tokenizer(path), load_tokenizer(path)

    def _generate_admin_key(self) -> tuple[str, Path]:
        """A fresh admin key, written where only this user can read it."""
        key = secrets.token_urlsafe(32)
        path = (
            self.config.admin_key_file
            or Path(tempfile.gettempdir()) / f"lightning-grpc-engine-{self.port}.admin-key"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)  # also when the file was there before with wider permissions
            out.write(key + "\n")
        return key, path

    def _drop_admin_key_file(self) -> None:
        """Remove the key file the engine made in the temp directory (never one ``--admin-key-file`` named)."""
        if not self._remove_admin_key_file or self.admin_key_file is None:
            return
        self._remove_admin_key_file = False
        try:
            self.admin_key_file.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("event=engine_admin_key_file_left file=%s error=%s", self.admin_key_file, exc)

    async def _listen(self) -> None:
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/admin/load_weights", self._load_weights)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.config.port), family=family)
        self.port = int(sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        self._drop_admin_key_file()  # first, while the port (and so the file's name) is still this engine's
        if self.scheduler is not None:
            await loop.run_in_executor(None, self.scheduler.close)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        log.info("event=engine_stopped address=%s:%d", self.host, self.port)

    async def __aenter__(self) -> EngineServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------ weights
    async def load_weights(self, path: str | Path, policy_version: int | None = None) -> int:
        """Load a ``save_pretrained`` checkpoint of the same architecture; returns the new version."""
        loop = asyncio.get_running_loop()
        async with self._weights_lock:
            started = time.monotonic()
            state = await loop.run_in_executor(None, self._read_checkpoint, Path(path))
            version = await self.load_state_dict(state, policy_version)
        log.info(
            "event=weights_loaded path=%s policy_version=%d seconds=%.2f",
            path,
            version,
            time.monotonic() - started,
        )
        return version

    async def load_state_dict(self, state: Mapping[str, Any], policy_version: int | None = None) -> int:
        """Copy ``state`` (same keys and shapes) into the model; returns the new policy version.

        Running requests finish on the old weights first; requests arriving meanwhile wait and then run
        on the new ones. The tensors are read when the copy happens: leave them alone until this returns.
        """
        scheduler = self._running_scheduler()
        self._check_state(state)
        model = scheduler.model

        def apply() -> None:
            model.load_state_dict(dict(state), strict=True)

        return await asyncio.wrap_future(scheduler.update_weights(apply, policy_version))

    def _read_checkpoint(self, path: Path) -> dict[str, Any]:
        if not (path / "config.json").is_file():
            raise bad_request(f"{path} is not a save_pretrained checkpoint (no config.json)", "path")
        try:
            model = load_model(path, self.config.dtype)
        except Exception as exc:
            raise bad_request(f"cannot load {path}: {exc}", "path") from None
        if type(model) is not self._model_class:
            served = getattr(self._model_class, "__name__", "?")
            raise bad_request(f"{path} holds a {type(model).__name__}, the engine serves a {served}", "path")
        return dict(model.state_dict())

    def _check_state(self, state: Mapping[str, Any]) -> None:
        current = self._running_scheduler().model.state_dict()
        missing = sorted(set(current) - set(state))
        unknown = sorted(set(state) - set(current))
        if missing or unknown:
            raise bad_request(
                f"weights do not match the model: missing {missing[:5]}, unexpected {unknown[:5]}"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(current[name].shape):
                raise bad_request(
                    f"weight {name} has shape {tuple(tensor.shape)}, the model's is {tuple(current[name].shape)}"
                )

    def _running_scheduler(self) -> Scheduler:
        if self.scheduler is None or not self.scheduler.alive:
            raise EngineError("the engine is not running", status=503)
        return self.scheduler

    def _inbox_of(self, loop: asyncio.AbstractEventLoop) -> LoopInbox:
        """The one inbox through which the scheduler's events reach this loop's requests."""
        if self._inbox is None or self._inbox.loop is not loop:
            self._inbox = LoopInbox(loop)
        return self._inbox

    # ------------------------------------------------------------ middleware and small endpoints
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            self._authorize(request)
            response: web.StreamResponse = await handler(request)
            return response
        except EngineError as exc:
            log.info(
                "event=request_rejected path=%s status=%d param=%s error=%s",
                request.path,
                exc.status,
                exc.param,
                json.dumps(exc.message),
            )
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = EngineError(exc.reason or "error", status=exc.status)
            if exc.status == 404:
                error = EngineError(f"no route {request.method} {request.path}", status=404)
            return web.json_response(error.body(), status=exc.status)
        except Exception as exc:
            log.exception("event=request_failed path=%s error=%s", request.path, exc)
            error = EngineError(f"internal error: {type(exc).__name__}", status=500)
            return web.json_response(error.body(), status=500)

    def _authorize(self, request: web.Request) -> None:
        supplied = request.headers.get("Authorization", "").encode()
        if request.path.startswith("/admin/"):
            if not hmac.compare_digest(supplied, f"Bearer {self.admin_key}".encode()):
                raise EngineError(
                    "the admin routes need the engine's admin key as 'Authorization: Bearer KEY' "
                    "(--admin-key, or the file the engine logged at start)",
                    status=401,
                )
            return
        key = self.config.api_key
        if (
            key
            and request.path not in UNGUARDED_PATHS
            and not hmac.compare_digest(supplied, f"Bearer {key}".encode())
        ):
            raise EngineError("invalid or missing API key", status=401)

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self._started_at,
            "owned_by": "lightning-grpc",
            "root": str(self.config.model),
            "parent": None,
            "max_model_len": self.max_model_len,
            "policy_version": self.policy_version,
        }
        return web.json_response({"object": "list", "data": [card]}, headers=self._version_header())

    async def _health(self, request: web.Request) -> web.Response:
        alive = self.scheduler is not None and self.scheduler.alive
        body: dict[str, Any] = {
            "status": "ok" if alive else "unavailable",
            "policy_version": self.policy_version,
        }
        if self.scheduler is not None:
            body.update(self.scheduler.load())
        return web.json_response(body, status=200 if alive else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._metrics_registry is None:
            raise EngineError("the engine has not started", status=503)
        body = metrics.exposition(self._metrics_registry)
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    async def _load_weights(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise bad_request("path must be a checkpoint directory", "path")
        version = body.get("policy_version")
        if version is not None and (not p.is_int(version) or version < 0):
            raise bad_request("policy_version must be a non-negative integer", "policy_version")
        started = time.monotonic()
        new_version = await self.load_weights(path, version)
        return web.json_response(
            {"policy_version": new_version, "path": path, "seconds": round(time.monotonic() - started, 3)},
            headers=self._version_header(),
        )

    def _version_header(self, version: int | None = None) -> dict[str, str]:
        return {POLICY_HEADER: str(self.policy_version if version is None else version)}

    # ------------------------------------------------------------ generation endpoints
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        parsed = p.parse_chat(await _json_body(request))
        self._check_model(parsed.model)
        prompt = self._chat_prompt(parsed)
        if parsed.params.grammar is not None:
            await self._check_grammar(parsed.params.grammar)
        return await self._generate(request, "chat", parsed, [prompt])

    async def _check_grammar(self, grammar: str) -> None:
        """A forced tool call's grammar compiles (else 400 naming ``tools``); compiled off the event loop."""
        if self.grammars is None:
            raise EngineError("the engine is not running", status=503)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.grammars.check, grammar)
        except GrammarError as exc:
            raise bad_request(f"the tools' parameters cannot constrain generation: {exc}", "tools") from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        parsed = p.parse_completion(await _json_body(request))
        self._check_model(parsed.model)
        prompts = [self._completion_prompt(prompt, parsed.add_special_tokens) for prompt in parsed.prompts]
        return await self._generate(request, "completion", parsed, prompts)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise EngineError(f"The model `{model}` does not exist.", status=404, param="model")

    def _chat_prompt(self, parsed: p.ChatRequest) -> list[int]:
        """The prompt's token ids, rendered by the model's chat template.

        Rendered prompts are remembered: the samples of a GRPO group, and the turns agents replay,
        send the same messages many times, and the template costs more than the rest of a request.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("the model has no chat template: use /v1/completions", "messages")
        try:
            key = json.dumps([parsed.messages, parsed.tools, parsed.template_kwargs], sort_keys=True)
        except (TypeError, ValueError):  # not JSON (cannot happen for a parsed request body)
            return self._render_chat(parsed)
        found = self._rendered.get(key)
        if found is not None:
            self._rendered.move_to_end(key)
            return list(found)
        ids = self._render_chat(parsed)
        self._rendered[key] = tuple(ids)
        while len(self._rendered) > RENDERED_PROMPTS:
            self._rendered.popitem(last=False)
        return ids

    def _render_chat(self, parsed: p.ChatRequest) -> list[int]:
        kwargs = dict(parsed.template_kwargs)
        try:
            text = self.tokenizer.apply_chat_template(
                parsed.messages,
                tools=parsed.tools,
                tokenize=False,
                add_generation_prompt=kwargs.pop("add_generation_prompt"),
                continue_final_message=kwargs.pop("continue_final_message"),
                **kwargs,
            )
        except Exception as exc:
            raise bad_request(f"the chat template failed: {exc}", "messages") from None
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise bad_request("the chat template produced an empty prompt", "messages")
        return ids

    def _completion_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            p.check_token_ids(prompt, self.vocab_size, "prompt")
            return prompt
        ids = list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        return ids

    async def _generate(
        self, request: web.Request, kind: str, parsed: p.ParsedRequest, prompts: list[list[int]]
    ) -> web.StreamResponse:
        scheduler = self._running_scheduler()
        params = [p.resolve_max_tokens(parsed, len(ids), self.max_model_len) for ids in prompts]
        for sampling in params:
            p.check_token_ids(sampling.stop_token_ids, self.vocab_size, "stop_token_ids")
            p.check_token_ids([t for t, _ in sampling.logit_bias], self.vocab_size, "logit_bias")
        loop = asyncio.get_running_loop()
        job = _Job(
            kind=kind,
            request=parsed,
            prompts=prompts,
            request_id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_name,
            queue=asyncio.Queue(),
        )

        inbox = self._inbox_of(loop)
        # the sink holds the queue, not the job: a job holding its own sink would be a reference cycle, left to
        # the cyclic garbage collector (a pause of 40-170 ms every few seconds under load) instead of freed
        job.sub = Submission(
            job.request_id, prompts, params, parsed.n, functools.partial(inbox.put, job.queue)
        )
        try:
            scheduler.submit(job.sub)
        except RuntimeError as exc:
            raise EngineError(str(exc), status=503) from None
        watcher = asyncio.create_task(self._watch_client(request, job))
        finish: list[str] = []
        completion_tokens = 0
        try:
            if parsed.stream:
                response, finish, completion_tokens = await self._stream(request, job)
                return response
            body, finish, completion_tokens = await self._collect(job)
            return web.json_response(
                body, headers={**self._version_header(job.policy_version), "x-request-id": job.request_id}
            )
        except _ClientGone:
            job.outcome = "disconnected"
            return web.Response(status=499)
        except EngineError:
            job.outcome = "error"
            raise
        finally:
            watcher.cancel()
            job.sub.cancel()
            log.debug(  # one line per request: an access log, shown with --log-level DEBUG
                "event=request_finished request_id=%s endpoint=%s stream=%s choices=%d prompt_tokens=%d "
                "completion_tokens=%d finish=%s outcome=%s policy_version=%d seconds=%.3f",
                job.request_id,
                kind,
                parsed.stream,
                job.choices,
                sum(len(x) for x in prompts),
                completion_tokens,
                ",".join(finish) or "-",
                job.outcome,
                job.policy_version,
                time.monotonic() - job.started,
            )

    async def _watch_client(self, request: web.Request, job: _Job) -> None:
        """A client that hung up stops its sequences, even while nothing is being written to it."""
        while True:
            await asyncio.sleep(CLIENT_CHECK_SECONDS)
            transport = request.transport
            if transport is None or transport.is_closing():
                if job.sub is not None:
                    job.sub.cancel()
                job.queue.put_nowait(StepEvent(job.policy_version, [], error=CLIENT_GONE))
                return

    async def _events(self, job: _Job) -> AsyncIterator[StepEvent]:
        remaining = job.choices
        while remaining:
            event = await job.queue.get()
            if event.error == CLIENT_GONE:
                raise _ClientGone
            if event.error is not None:
                raise EngineError(event.error, status=503 if "shutting down" in event.error else 500)
            job.policy_version = event.policy_version
            remaining -= sum(u.finish_reason is not None for u in event.updates)
            yield event

    # ------------------------------------------------------------ non-streaming
    async def _collect(self, job: _Job) -> tuple[dict[str, Any], list[str], int]:
        choices = {i: _Choice(i) for i in range(job.choices)}
        async for event in self._events(job):
            for update in event.updates:
                choices[update.index].add(update)
        ordered = [choices[i] for i in range(job.choices)]
        body: dict[str, Any] = {
            "id": job.request_id,
            "object": job.object,
            "created": job.created,
            "model": job.model,
            "choices": [self._final_choice(job, c) for c in ordered],
            "usage": _usage(job, sum(len(c.token_ids) for c in ordered)),
            "policy_version": job.policy_version,
        }
        if job.kind == "chat" and job.request.return_token_ids:
            body["prompt_token_ids"] = job.prompts[0]
        finish = [c.finish_reason or "-" for c in ordered]
        return body, finish, sum(len(c.token_ids) for c in ordered)

    def _final_choice(self, job: _Job, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        out: dict[str, Any] = {"index": choice.index}
        finish_reason = choice.finish_reason
        if job.kind == "chat":
            out["message"] = {"role": "assistant", "content": text}
            if _parses_tools(job):
                parsed = tools.parse_tool_calls(text)
                if parsed.calls:
                    out["message"]["content"] = parsed.content
                    out["message"]["tool_calls"] = [call.as_dict() for call in parsed.calls]
                    finish_reason = "tool_calls"
            out["logprobs"] = self._chat_logprobs(job, choice.logprobs)
        else:
            out["text"] = text
            out["logprobs"] = self._completion_logprobs(job, choice.logprobs, choice.offsets, len(text))
        out["finish_reason"] = finish_reason
        out["stop_reason"] = choice.stop_reason
        if job.request.return_token_ids:
            if job.kind == "completion":
                out["prompt_token_ids"] = job.prompts[choice.index // job.request.n]
            out["token_ids"] = choice.token_ids
            if choice.forced is not None:
                out["forced_token_positions"] = _positions(choice.forced)
        return out

    # ------------------------------------------------------------ streaming
    async def _stream(self, request: web.Request, job: _Job) -> tuple[web.StreamResponse, list[str], int]:
        events = self._events(job)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        finish: dict[int, str] = {}
        completion_tokens = 0
        try:
            first = await anext(events)
            response.headers.update(self._version_header(job.policy_version))
            response.headers["x-request-id"] = job.request_id
            await response.prepare(request)
            writer = _ChunkWriter(self, job, response)
            await writer.start()
            event: StepEvent | None = first
            while event is not None:
                for update in event.updates:
                    completion_tokens += len(update.token_ids)
                    if update.finish_reason is not None:
                        finish[update.index] = update.finish_reason
                    await writer.update(update)
                event = await anext(events, None)
            if job.request.include_usage:
                await writer.usage(completion_tokens)
            await writer.done()
        except EngineError as exc:
            if not response.prepared:
                raise
            await _send(response, exc.body())
            await _send_done(response)
        except (_ClientGone, ConnectionError):
            job.outcome = "disconnected"
        return response, [finish.get(i, "-") for i in range(job.choices)], completion_tokens

    def chunk(self, job: _Job, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": job.request_id,
            "object": f"{job.object}.chunk" if job.kind == "chat" else job.object,
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "policy_version": job.policy_version,
        }
        if job.request.include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    def delta_choice(
        self, job: _Job, update: SequenceUpdate, first: bool, calls: tools.ToolCallStream | None = None
    ) -> dict[str, Any]:
        """One choice's chunk; with ``calls`` (tools parsed), content until a call starts, then whole calls."""
        out: dict[str, Any] = {"index": update.index}
        finish_reason = update.finish_reason
        if job.kind == "chat":
            out["delta"] = {"content": update.text}
            if calls is not None:
                out["delta"], finish_reason = _tool_delta(calls, update)
            out["logprobs"] = self._chat_logprobs(job, update.logprobs)
        else:
            out["text"] = update.text
            out["logprobs"] = self._completion_logprobs(job, update.logprobs, update.offsets, None)
        out["finish_reason"] = finish_reason
        out["stop_reason"] = update.stop_reason
        if job.request.return_token_ids:
            if job.kind == "completion" and first:
                out["prompt_token_ids"] = job.prompts[update.index // job.request.n]
            out["token_ids"] = update.token_ids
            if update.forced is not None:
                out["forced_token_positions"] = _positions(update.forced)
        return out

    # ------------------------------------------------------------ logprobs
    def _chat_logprobs(self, job: _Job, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if job.request.params.logprobs is None:
            return None
        return {"content": [self._chat_entry(lp) for lp in logprobs]}

    def _chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        assert self._texts is not None
        text, raw = self._texts.get(lp.token_id)
        top = []
        for token_id, value in lp.top:
            top_text, top_raw = self._texts.get(token_id)
            top.append({"token": top_text, "logprob": _finite(value), "bytes": top_raw})
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": raw, "top_logprobs": top}

    def _completion_logprobs(
        self, job: _Job, logprobs: list[TokenLogprob], offsets: list[int], text_len: int | None
    ) -> dict[str, Any] | None:
        if job.request.params.logprobs is None:
            return None
        assert self._texts is not None
        tokens, values, tops = [], [], []
        for lp in logprobs:
            tokens.append(self._texts.get(lp.token_id)[0])
            values.append(_finite(lp.logprob))
            top = {self._texts.get(t)[0]: _finite(v) for t, v in lp.top}
            top.setdefault(tokens[-1], _finite(lp.logprob))
            tops.append(top)
        # Non-streaming: a stop string may have cut the text short of the last tokens' offsets.
        text_offset = offsets if text_len is None else [min(o, text_len) for o in offsets]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": text_offset}


class _ChunkWriter:
    """Server-sent events of one streaming response."""

    def __init__(self, server: EngineServer, job: _Job, response: web.StreamResponse) -> None:
        self.server = server
        self.job = job
        self.response = response
        self.seen: set[int] = set()
        self.sent_prompt = False
        #: Per choice, the parser of its tool calls (when the request parses them).
        self.calls = {i: tools.ToolCallStream() for i in range(job.choices)} if _parses_tools(job) else {}

    async def start(self) -> None:
        """Chat: one role chunk per choice, the first carrying the prompt's token ids."""
        if self.job.kind != "chat":
            return
        for index in range(self.job.choices):
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if self.job.request.return_token_ids:
                choice["token_ids"] = []
                if self.job.request.params.grammar is not None:
                    choice["forced_token_positions"] = []
            await self._send([choice])

    async def update(self, update: SequenceUpdate) -> None:
        first = update.index not in self.seen
        self.seen.add(update.index)
        calls = self.calls.get(update.index)
        await self._send([self.server.delta_choice(self.job, update, first, calls)])

    async def usage(self, completion_tokens: int) -> None:
        body = self.server.chunk(self.job, [])
        body["usage"] = _usage(self.job, completion_tokens)
        await _send(self.response, body)

    async def done(self) -> None:
        await _send_done(self.response)

    async def _send(self, choices: list[dict[str, Any]]) -> None:
        extra: dict[str, Any] = {}
        if self.job.kind == "chat" and self.job.request.return_token_ids and not self.sent_prompt:
            extra["prompt_token_ids"] = self.job.prompts[0]
        self.sent_prompt = True
        await _send(self.response, self.server.chunk(self.job, choices, **extra))


# ---------------------------------------------------------------- helpers
async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


async def _send(response: web.StreamResponse, body: Mapping[str, Any]) -> None:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    await response.write(f"data: {data}\n\n".encode())


async def _send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


def _usage(job: _Job, completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(x) for x in job.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _parses_tools(job: _Job) -> bool:
    request = job.request
    return (
        isinstance(request, p.ChatRequest) and request.tool_choice is not None and request.tool_choice.parses
    )


def _tool_delta(calls: tools.ToolCallStream, update: SequenceUpdate) -> tuple[dict[str, Any], str | None]:
    """The chat delta of an update whose text goes through the tool-call parser, and its finish reason.

    The chunk is sent whatever it holds (its token ids must reach the client): an empty content while a
    call's block is being buffered.
    """
    content, new_calls = calls.feed(update.text)
    finish_reason = update.finish_reason
    if finish_reason is not None:
        content += calls.finish()
        if calls.calls:
            finish_reason = "tool_calls"
    delta: dict[str, Any] = {}
    if content or not new_calls:
        delta["content"] = content
    if new_calls:
        delta["tool_calls"] = new_calls
    return delta, finish_reason


def _positions(forced: list[bool]) -> list[int]:
    """The indices of the forced tokens: few ints on the wire rather than a flag per token."""
    return [i for i, one in enumerate(forced) if one]


def _finite(value: float) -> float:
    return max(value, MIN_LOGPROB)


async def start_engine(
    model: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    served_model_name: str | None = None,
    max_batch_size: int = 64,
    policy_version: int = 0,
    **options: Any,
) -> EngineServer:
    """Start an engine in this process's event loop (port 0 picks a free port); ``await stop()`` it."""
    config = EngineConfig(
        model=model,
        host=host,
        port=port,
        served_model_name=served_model_name,
        max_batch_size=max_batch_size,
        policy_version=policy_version,
        **options,
    )
    return await EngineServer(config).start()


async def serve_forever(config: EngineConfig) -> None:
    """Run until SIGINT or SIGTERM (the CLI)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = await EngineServer(config).start()
    freeze_startup_heap()  # the model's modules and tensors included
    try:
        await stop.wait()
    finally:
        await server.stop()
