"""`raymt serve` / `python -m raymt.serve`: serve a checkpoint over HTTP on Ray Serve (docs/serving.md)."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from raymt.config import SERVE_ENGINES, ServeConfig
from raymt.config.serve import DEFAULT_MODEL
from raymt.engines import check_device, load_model_info, resolve_engine
from raymt.errors import cli_error, first_line
from raymt.flags import add_decode_flags, decode_options


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line flags."""
    s = ServeConfig(models={DEFAULT_MODEL: "-"})
    p = argparse.ArgumentParser(prog="raymt serve", description=__doc__)
    p.add_argument(
        "--checkpoint",
        help=f"raymt checkpoint or export directory, or its URI (the same as --model {DEFAULT_MODEL}=CKPT)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=CKPT",
        help="serve several models (repeat it): a request picks one by its model field or by its language pair",
    )
    p.add_argument(
        "--models-per-replica", type=int, default=s.models_per_replica, help="models a replica holds at once; 0: all"
    )
    p.add_argument("--engine", default=s.engine, help=f"decoding engine: {', '.join(SERVE_ENGINES)}")
    p.add_argument("--device", default=s.device, help="cpu, cuda or cuda:N")
    p.add_argument("--host", default=s.host, help="address to listen on")
    p.add_argument("--port", type=int, default=s.port)
    p.add_argument("--replicas", type=int, default=s.replicas, help="Serve replicas, one engine each")
    p.add_argument("--autoscale", default="", metavar="MIN:MAX", help="replicas scaled by Serve (not --replicas)")
    p.add_argument(
        "--target-ongoing-requests", type=int, default=s.target_ongoing_requests, help="--autoscale's aim a replica"
    )
    p.add_argument("--cpus-per-replica", type=float, default=s.cpus_per_replica, help="also its threads")
    p.add_argument("--max-batch-tokens", type=int, default=s.max_batch_tokens, help="padded source tokens a batch")
    p.add_argument("--max-queue-sentences", type=int, default=s.max_queue_sentences, help="beyond: 503")
    p.add_argument("--max-queued-requests", type=int, default=s.max_queued_requests, help="Serve's; beyond: 503")
    p.add_argument("--request-timeout", type=float, default=s.request_timeout_s, help="seconds; beyond: 504")
    p.add_argument("--max-body-bytes", type=int, default=s.max_body_bytes)
    p.add_argument("--max-text-chars", type=int, default=s.max_text_chars, help="characters in one text")
    p.add_argument("--max-texts", type=int, default=s.max_texts, help="texts in one request")
    p.add_argument("--max-beam", type=int, default=s.max_beam, help="the largest beam a request may ask for")
    p.add_argument("--max-alternatives", type=int, default=s.max_alternatives)
    p.add_argument(
        "--api-keys",
        metavar="FILE",
        help="require an API key: FILE lists the SHA-256 hex digest of each key, one a line (sha256sum)",
    )
    p.add_argument("--status-every", type=float, default=60.0, help="seconds between status lines")
    p.add_argument(
        "--print-config", action="store_true", help="print the Serve config file for `serve deploy` and exit"
    )
    add_decode_flags(p, sample=False)  # as raymt translate's
    return p.parse_args(argv)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The validated ServeConfig of the flags (one-line ValueErrors)."""
    if args.status_every <= 0:
        raise ValueError(f"--status-every {args.status_every:g} must be > 0 seconds")
    decode = decode_options(args)
    return ServeConfig(
        models=model_flags(args.checkpoint, args.model),
        models_per_replica=args.models_per_replica,
        engine=args.engine,
        device=args.device,
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        autoscale=args.autoscale,
        target_ongoing_requests=args.target_ongoing_requests,
        cpus_per_replica=args.cpus_per_replica,
        max_batch_tokens=args.max_batch_tokens,
        max_queue_sentences=args.max_queue_sentences,
        max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_text_chars=args.max_text_chars,
        max_texts=args.max_texts,
        max_beam=args.max_beam,
        max_alternatives=args.max_alternatives,
        decode=decode,
        api_key_hashes=read_key_hashes(args.api_keys) if args.api_keys else [],
    )


def model_flags(checkpoint: Optional[str], models: list[str]) -> dict[str, str]:
    """The served models by name: `--checkpoint CKPT` is one model named default, each `--model
    NAME=CKPT` one more; one-line errors for a mix of both, a bad form or a name given twice."""
    if checkpoint is not None and models:
        raise ValueError(
            f"--checkpoint and --model: give one of them (--checkpoint CKPT = --model {DEFAULT_MODEL}=CKPT)"
        )
    if checkpoint is not None:
        return {DEFAULT_MODEL: checkpoint}
    out: dict[str, str] = {}
    for flag in models:
        name, sep, path = flag.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--model {flag}: give NAME=CKPT, e.g. --model en-de=runs/en-de/best")
        if name in out:
            raise ValueError(f"--model {name}=... is given twice: one checkpoint a name")
        out[name] = path
    return out


def read_key_hashes(path: str) -> list[str]:
    """The digests of an --api-keys file (`sha256sum` lines: the digest first; blank lines and # skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"--api-keys {path}: {first_line(err)}") from None
    hashes = [line.split()[0].lower() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not hashes:
        raise ValueError(f"--api-keys {path} lists no key digest")
    return hashes


def check_before_ray(cfg: ServeConfig) -> str:
    """Everything checked before Ray starts: the serve extra, the device, the model and its
    engine, the port; returns the engine's name."""
    for package in ("starlette", "uvicorn", "fastapi"):
        if importlib.util.find_spec(package) is None:
            raise ValueError(
                f"raymt serve needs Ray Serve's packages ({package} is missing): pip install 'raymt[serve]'"
            )
    check_device(cfg.device)
    engine = check_models(cfg)
    check_port(cfg.host, cfg.port)
    return engine


def check_port(host: str, port: int) -> None:
    """A one-line error when host:port cannot be listened on (another server holds it)."""
    with socket.socket() as probe:
        # As the server's own socket (uvicorn, asyncio): a port left in TIME_WAIT by a server
        # stopped a moment ago is free to listen on; only a listening socket makes it busy.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({first_line(err)})") from None


def check_models(cfg: ServeConfig) -> str:
    """Each model's checkpoint and engine checked (a one-line error naming the model when there are
    several); returns the engine's name."""
    engines = []
    for name, checkpoint in cfg.models.items():
        try:
            engines.append(resolve_engine(cfg.engine, load_model_info(checkpoint)))
        except ValueError as err:
            raise ValueError(f"--model {name}={checkpoint}: {err}" if len(cfg.models) > 1 else str(err)) from None
    return ", ".join(sorted(set(engines)))


def print_config(cfg: ServeConfig) -> int:
    """Print the `serve deploy` config file of cfg (YAML) after checking the model; exit status 0."""
    import yaml

    from raymt.serve.app import deploy_config

    check_models(cfg)
    print(yaml.safe_dump(deploy_config(cfg), sort_keys=False), end="")
    return 0


def status_line(stats: dict, previous: dict, seconds: float) -> str:
    """A replica since the last line: requests, sentences/s, sentences a batch, refusals."""
    sentences = stats["sentences"] - previous.get("sentences", 0)
    batches = max(1, stats["batches"] - previous.get("batches", 0))
    return (
        f"serve: {stats['requests'] - previous.get('requests', 0)} requests, {sentences / seconds:.1f} sentences/s, "
        f"{sentences / batches:.1f} sentences a batch, {stats['rejected'] - previous.get('rejected', 0)} rejected, "
        f"{stats['timed_out'] - previous.get('timed_out', 0)} timed out"
    )


def block(handle, every_s: float) -> None:
    """Print a status line every `every_s` seconds until Ctrl-C."""
    previous, last = {}, time.time()
    while True:
        time.sleep(every_s)
        stats = handle.stats.remote().result()
        now = time.time()
        print(status_line(stats, previous, now - last), flush=True)
        previous, last = stats, now


def stop(signum: int, frame: object) -> None:
    """SIGTERM handler: stop as Ctrl-C does."""
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        cfg = serve_config(args)
        if args.print_config:  # for another cluster: checked here without the port
            return print_config(cfg)
        engine = check_before_ray(cfg)
    except ValueError as err:
        return cli_error("raymt serve", err)
    from ray import serve

    from raymt.cluster import init_ray
    from raymt.serve.app import start

    init_ray()
    signal.signal(signal.SIGTERM, stop)  # as Ctrl-C: Serve is shut down before exiting
    try:
        handle = start(cfg)
        served = ", ".join(f"{name}={path}" for name, path in cfg.models.items())
        print(f"raymt serve: {served} ({engine}) on http://{cfg.host}:{cfg.port}/ ; Ctrl-C stops it", flush=True)
        block(handle, args.status_every)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
