"""`posttrain serve`'s command line: MODEL_DIR, YAML files / key=value overrides, and its flags. Apart from
``serve_command`` (which loads torch and the engines) so that `posttrain --help` answers without them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

DEFAULT_PORT = 8000
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


def add_serve_parser(sub: argparse._SubParsersAction, fn: Callable[[argparse.Namespace], int]) -> None:
    """The `serve` subcommand: MODEL_DIR, then YAML files / key=value overrides, and its flags."""
    text = "Serve an exported model over an OpenAI-compatible HTTP API (docs/gateway.md)."
    p = sub.add_parser("serve", help=text, description=text)
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="A Hugging Face model directory (e.g. final_model/)"
    )
    p.add_argument("config", nargs="*", help="YAML files and key=value overrides (model.dtype, rollout.*)")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="Port (default 8000; 0: a free one)")
    p.add_argument("--api-key-file", default=None, help="File holding the API key (default: a random key)")
    p.add_argument(
        "--model-name", default=None, help="The model's name in the API (default: MODEL_DIR's name)"
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="Largest request body"
    )
    p.set_defaults(fn=fn)
