"""A soak of multi-turn requests through a real vLLM, with or without kvkit's connector: one run, one JSON line.

``--requests`` requests (``--turns`` turns of ``requests / turns``
conversations; each turn sends every conversation's whole history, as
``examples/vllm_multiturn.py`` does, with its engine settings but a KV pool of
``--gpu-blocks`` blocks: too few for every conversation, so later turns find
their prefix on kvkit's CPU tier or recompute it).
The engine runs in this process. Printed: ``serve_s`` (wall seconds of the
requests, the engine's start excluded), the prompt tokens computed and
loaded, a digest of every generated token (equal digests: identical tokens),
and with kvkit ``worker_s``: the wall seconds the worker thread spent inside
the connector's ``start_load_kv`` and ``wait_for_save`` (where copies are
submitted, and waited for when they run in the call).

    python benchmarks/bench_vllm_soak.py --model PATH                 # kvkit, the connector's defaults
    python benchmarks/bench_vllm_soak.py --model PATH --no-kvkit      # the same requests without it
    python benchmarks/bench_vllm_soak.py --model PATH --async-load --host-thread off   # copies inside the calls

Run the two alternately (``A B A B ...``) and compare medians pair by pair: the
machine's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vllm_multiturn.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_multiturn", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _time_worker_calls(llm: Any, spent: list[float]) -> None:
    """Add the wall seconds of every ``start_load_kv`` and ``wait_for_save`` of the worker connector to ``spent``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    for name in ("start_load_kv", "wait_for_save"):
        call = getattr(worker, name)

        def timed(*args: Any, _call: Any = call, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(worker, name, timed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a local checkpoint (e.g. the tests' tiny Llama)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--words", type=int, default=6, help="words per user message")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=64, help="vLLM's KV pool, in 32-token blocks")
    ap.add_argument("--no-kvkit", action="store_true", help="run without the connector")
    ap.add_argument("--async-load", action="store_true", help="kvkit's async_load")
    ap.add_argument("--host-thread", choices=("on", "off"), default="on",
                    help="the torch copy backend's host_thread (the connector's default on CPU: on)")
    args = ap.parse_args(argv)
    if args.requests % args.turns:
        ap.error(f"--requests={args.requests} is not a multiple of --turns={args.turns}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    ex = _example()
    extra = None if args.no_kvkit else {
        "cpu_bytes": "16MiB", "copy": "torch", "async_load": args.async_load,
        "options": {"copy": {"host_thread": args.host_thread == "on"}}}
    llm = ex.make_llm(args.model, kvkit=not args.no_kvkit, extra_config=extra, gpu_blocks=args.gpu_blocks)
    spent = [0.0]
    try:
        if not args.no_kvkit:
            _time_worker_calls(llm, spent)
        messages = ex.user_messages(llm.get_tokenizer(), args.requests // args.turns, args.turns, args.words)
        start = time.perf_counter()
        turns = ex.serve(llm, messages, args.max_tokens)
        serve_s = time.perf_counter() - start
    finally:
        llm.llm_engine.engine_core.shutdown()
    digest = hashlib.sha256(json.dumps([t.outputs for t in turns]).encode()).hexdigest()[:16]
    print(json.dumps({
        "kvkit": not args.no_kvkit, "async_load": args.async_load, "host_thread": args.host_thread,
        "requests": sum(len(t.outputs) for t in turns), "serve_s": round(serve_s, 3),
        "worker_s": None if args.no_kvkit else round(spent[0], 3),
        "computed_tokens": sum(t.computed_tokens for t in turns),
        "kvkit_loaded_tokens": sum(t.kvkit_loaded_tokens for t in turns), "tokens_digest": digest}))


if __name__ == "__main__":
    main()
