"""`posttrain serve MODEL_DIR`: an exported model behind the gateway's session-less OpenAI-compatible endpoint,
for evaluation and debugging outside training (docs/gateway.md).

Everything a user can get wrong is refused before any weights load (a ConfigError, exit 2): MODEL_DIR missing or
without config.json, a tokenizer without a chat template (chat completions, the endpoint agents use, render
with it; a base model without one is refused rather than served half-working), a port outside 0..65535, a key
file that cannot be read or is empty, a non-positive --max-request-bytes. The port is bound before the model
loads too, so a port in use is refused at once.

The engine is the run config's (``rollout.name``: native by default, vllm), built by
:func:`posttrain.rl.build.build_engine` with ``model.dtype`` and the ``rollout.*`` knobs. The context length
(``max_model_len``: prompt + completion) is ``rollout.max_model_len`` when set, else the model's own
(``max_position_embeddings`` of config.json): ``data.max_prompt_length + data.max_response_length`` are a
training run's lengths, far shorter than what a served model is asked. A request without ``max_tokens`` may
generate up to the rest of the context. Default sampling (a request's own settings win): ``rollout.temperature``,
``top_p``, ``top_k``, seeded by ``trainer.seed``.

SIGINT and SIGTERM stop the server (calls still waiting get 503, threads are joined, the engine is closed) and
the command exits 0: stopping is how a server ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from posttrain.agents.driver import Generation, engine_generate
from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.config.load import apply_values
from posttrain.config.schema import PostTrainConfig
from posttrain.gateway import Gateway
from posttrain.gateway.prompt_scores import PromptScorer, PromptScores
from posttrain.gateway.protocol import ProtocolError
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.parallel.runtime import select_device
from posttrain.rl.build import build_engine
from posttrain.rollout.base import RolloutEngine, SamplingParams, TurnRequest
from posttrain.sandbox.server import is_loopback
from posttrain.train.integrity import check_model_dir
from posttrain.utils.signals import Terminated


@dataclass(frozen=True)
class ServeSettings:
    """`posttrain serve`'s flags, checked; ``key_file``: where the key came from (None: made at start)."""

    model_dir: Path
    host: str
    port: int
    api_key: str | None
    key_file: str | None
    model_name: str
    max_request_bytes: int
    tokenizer: object


def read_api_key(path: str) -> str:
    """The key in the file ``path`` (surrounding whitespace dropped); a ConfigError when it cannot serve."""
    fix = f"write one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}"
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc}); {fix}") from None
    if not key:
        raise ConfigError(f"--api-key-file {path}: the file is empty; {fix}")
    if not key.isascii() or not key.isprintable() or " " in key:
        raise ConfigError(f"--api-key-file {path}: the key must be printable ASCII without spaces; {fix}")
    return key


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """The flags checked, and the tokenizer read, before any weights load."""
    model_dir = Path(args.model_dir)
    if not model_dir.is_dir():
        raise MissingPathError(f"MODEL_DIR {model_dir} does not exist or is not a directory")
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"MODEL_DIR {model_dir} is not a model directory: it has no config.json; pass a Hugging Face "
            "model directory (a run's final_model/ or sft_model/; a training checkpoint: serve its export)"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is 0 to 65535 (0: any free port; default 8000)")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes {args.max_request_bytes}: must be at least 1 (default 4 MiB)")
    key = read_api_key(args.api_key_file) if args.api_key_file else None
    if (model_dir / "tokenizer_config.json").is_file():
        tokenizer = load_tokenizer(model_dir)
    else:
        tokenizer = None
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"MODEL_DIR {model_dir} has no tokenizer with a chat template, and chat completions render "
            'with it; save the tokenizer of a chat model there, or set "chat_template" in its '
            "tokenizer_config.json"
        )
    name = args.model_name or model_dir.resolve().name
    return ServeSettings(
        model_dir, args.host, args.port, key, args.api_key_file, name, args.max_request_bytes, tokenizer
    )


def context_length(cfg: PostTrainConfig, model_dir: Path) -> int:
    """rollout.max_model_len when set, else the model's max_position_embeddings (else the data lengths)."""
    if cfg.rollout.max_model_len:
        return cfg.rollout.max_model_len
    config = json.loads((model_dir / "config.json").read_text())
    own = config.get("max_position_embeddings")
    if isinstance(own, int) and own > 0:
        return own
    return cfg.data.max_prompt_length + cfg.data.max_response_length


class _EngineBackend:
    """The gateway's backend over an engine that is set once the model has loaded (the port is bound first)."""

    def __init__(self) -> None:
        self.engine: RolloutEngine | None = None
        self.scorer: PromptScorer | None = None  # the native engine's model: echo=true prompt scoring

    def __call__(self, requests: list[TurnRequest], params: SamplingParams) -> list[Generation]:
        if self.engine is None:
            raise RuntimeError("the model is still loading")
        return engine_generate(self.engine, params)(requests)

    def score(self, ids: list[int], temperature: float, k: int) -> PromptScores:
        """The prompt's log-probs (echo=true): 500 while loading (clients retry), 400 with the vLLM engine."""
        if self.engine is None:
            raise RuntimeError("the model is still loading")
        if self.scorer is None:
            raise ProtocolError(
                400, "echo=true needs the native engine (rollout.name=native); send echo=false"
            )
        return self.scorer(ids, temperature, k)


def banner(gw: Gateway, s: ServeSettings, engine: str, max_model_len: int) -> str:
    """The block printed at start: where to point an OpenAI client."""
    key = f"$(cat {s.key_file})" if s.key_file else gw.api_key
    lines = [
        f"posttrain serve: {s.model_dir} as model {s.model_name!r} ({engine} engine, context {max_model_len})",
        f"  base URL: {gw.base_url}",
        f"  model:    {s.model_name}",
        f"  export OPENAI_BASE_URL={gw.base_url}",
        f"  export OPENAI_API_KEY={key}",
        "Serving until Ctrl-C or SIGTERM.",
    ]
    return "\n".join(lines)


def run_serve(cfg: PostTrainConfig, s: ServeSettings) -> None:
    """Bind the port, load the model and its engine, serve until SIGINT/SIGTERM, close."""
    if not is_loopback(s.host):
        print(
            f"posttrain serve: warning: --host {s.host} is not a loopback address: the endpoint is reachable "
            "from the network (anyone who has the key can use the model)",
            file=sys.stderr,
        )
    max_model_len = context_length(cfg, s.model_dir)
    cfg = apply_values(cfg, {"rollout.max_model_len": max_model_len})  # the vLLM engine's length too
    defaults = SamplingParams(
        max_tokens=max_model_len,
        temperature=cfg.rollout.temperature or 1.0,
        greedy=cfg.rollout.temperature == 0,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        seed=cfg.trainer.seed,
    )
    backend = _EngineBackend()
    try:
        gw = Gateway(
            backend,
            s.tokenizer,
            model_name=s.model_name,
            host=s.host,
            port=s.port,
            api_key=s.api_key,
            max_request_bytes=s.max_request_bytes,
            max_model_len=max_model_len,
            default_params=defaults,
            prompt_scorer=backend.score,
        )
    except OSError as exc:  # the port is taken, the host is not this machine's
        raise ConfigError(
            f"cannot listen on --host {s.host} --port {s.port}: {exc.strerror or exc}; choose a free --port "
            "(0: any) or an address of this machine"
        ) from None
    engine, model = _load_engine(cfg, s)
    backend.scorer = PromptScorer(model, model.device) if model is not None else None
    backend.engine = engine
    try:
        with gw:
            print(banner(gw, s, cfg.rollout.name, max_model_len), flush=True)
            _wait_for_signal()
    finally:
        engine.close()
    print("posttrain serve: stopped; the server is closed", file=sys.stderr, flush=True)


def _load_engine(cfg: PostTrainConfig, s: ServeSettings) -> tuple[RolloutEngine, nn.Module | None]:
    device = select_device(cfg)
    check_model_dir(s.model_dir)  # a truncated weights file is named here, not deep in the loader
    # vLLM reads the directory itself: the Hugging Face model is loaded for the native engine only.
    model = (
        None if cfg.rollout.name == "vllm" else load_causal_lm(s.model_dir, cfg.model.dtype, device).eval()
    )
    return build_engine(cfg, model, s.tokenizer, device, s.model_dir), model


def _wait_for_signal() -> None:
    """Sleep in the main thread until SIGINT (KeyboardInterrupt) or SIGTERM (Terminated, see the CLI)."""
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, Terminated):
        return
