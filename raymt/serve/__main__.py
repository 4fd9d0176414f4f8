"""`raymt serve` / `python -m raymt.serve`: serve a checkpoint over HTTP on Ray Serve (docs/serving.md)."""

from __future__ import annotations

import importlib.util
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from raymt.command import flag, group, main_of
from raymt.config import ServeConfig
from raymt.config.serve import DEFAULT_MODEL
from raymt.engines import check_device, load_model_info, resolve_engine
from raymt.errors import check, first_line


@dataclass
class ServeCommand:
    """`raymt serve`'s command line: the served `ServeConfig` (its fields' flags, a serve option's
    one home) and what only the command uses."""

    # Flag only: `from_flag_paths` makes it the one model of serve.models (then it is None).
    checkpoint: Optional[str] = flag(
        None, f"raymt checkpoint or export directory, or its URI (the same as --model {DEFAULT_MODEL}=CKPT)"
    )
    serve: ServeConfig = group(ServeConfig)
    # Read where the command runs (`serve_config`) into serve.api_key_hashes.
    api_keys: Optional[str] = flag(
        None,
        "require an API key: FILE lists the SHA-256 hex digest of each key, one a line (sha256sum)",
        metavar="FILE",
    )
    status_every_s: float = flag(60.0, "seconds between status lines", name="--status-every")
    print_config: bool = flag(False, "print the Serve config file for `serve deploy` and exit")

    def __post_init__(self) -> None:
        check(self.status_every_s > 0, f"--status-every {self.status_every_s:g} must be > 0 seconds")

    @classmethod
    def from_flag_paths(cls, values: dict[tuple[str, ...], Any]) -> dict[tuple[str, ...], Any]:
        """`--checkpoint CKPT` is `--model default=CKPT`; a one-line error for both."""
        checkpoint = values.pop(("checkpoint",), None)
        if checkpoint is None:
            return values
        check(
            not values.get(("serve", "models")),
            f"--checkpoint and --model: give one of them (--checkpoint CKPT = --model {DEFAULT_MODEL}=CKPT)",
        )
        return {**values, ("serve", "models"): {DEFAULT_MODEL: checkpoint}}


def serve_config(cmd: ServeCommand) -> ServeConfig:
    """The ServeConfig served: the command's, with the digests of its --api-keys file."""
    return replace(cmd.serve, api_key_hashes=read_key_hashes(cmd.api_keys)) if cmd.api_keys else cmd.serve


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


def print_config(cfg: ServeConfig) -> None:
    """Print the `serve deploy` config file of cfg (YAML) after checking every model."""
    import yaml

    from raymt.serve.app import deploy_config

    check_models(cfg)
    print(yaml.safe_dump(deploy_config(cfg), sort_keys=False), end="")


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


def run(cmd: ServeCommand) -> None:
    """Serve the models until Ctrl-C or SIGTERM, a status line every --status-every seconds, or
    with --print-config print the `serve deploy` file; a ValueError (one line) before Ray starts."""
    cfg = serve_config(cmd)
    if cmd.print_config:  # for another cluster: checked here without the port
        print_config(cfg)
        return
    engine = check_before_ray(cfg)
    from ray import serve

    from raymt.cluster import init_ray
    from raymt.serve.app import start

    init_ray()
    signal.signal(signal.SIGTERM, stop)  # as Ctrl-C: Serve is shut down before exiting
    try:
        handle = start(cfg)
        served = ", ".join(f"{name}={path}" for name, path in cfg.models.items())
        print(f"raymt serve: {served} ({engine}) on http://{cfg.host}:{cfg.port}/ ; Ctrl-C stops it", flush=True)
        block(handle, cmd.status_every_s)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    return main_of("raymt serve", ServeCommand, run, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
