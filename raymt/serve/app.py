"""The Ray Serve side of `raymt serve`: a thin HTTP front (`Front`: body size, one retry when a
translator replica dies, back pressure as a JSON 503) before the translator replicas (`Replica`:
one engine, one `Service`, one `Batcher` each); their deployment options from a `ServeConfig`
(`application`), the start on a running Ray cluster (`start`) and the config file of `serve
deploy` (`deploy_config`, `build`). `raymt.serve.api` answers the requests.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from raymt.config import DecodeOptions, ServeConfig
from raymt.errors import first_line

APP_NAME = "raymt"
# How often a stopping replica looks whether its requests are done (Serve's default: 2 s).
SHUTDOWN_POLL_S = 0.25


def config_from_dict(d: dict) -> ServeConfig:
    """A ServeConfig from `dataclasses.asdict` (how it crosses to the replicas)."""
    return ServeConfig(**{**d, "decode": DecodeOptions(**d["decode"])})


def on_gpu(cfg: ServeConfig) -> bool:
    """Whether each replica takes a GPU (--device cuda or cuda:N)."""
    return cfg.device.startswith("cuda")


class Replica:
    """One Serve replica: the model loaded once into an engine, its API and its batching loop."""

    def __init__(self, cfg: dict):
        import torch

        from raymt.engines import load_engine
        from raymt.serve.api import Service

        self.cfg = config_from_dict(cfg)
        threads = max(1, int(self.cfg.cpus_per_replica))
        torch.set_num_threads(threads)
        device = "cuda" if on_gpu(self.cfg) else self.cfg.device  # Ray shows the replica its one GPU
        engine = load_engine(self.cfg.checkpoint, self.cfg.engine, device, threads)
        self.service = Service(engine, self.cfg)

    async def answer(self, method: str, path: str, content_type: str, body: bytes, authorization: str) -> tuple:
        """One HTTP request's (status, body bytes, headers, media type), from the front."""
        reply = await self.service.handle(method, path, content_type, body, authorization)
        return reply.status, reply.content(), reply.headers, reply.media_type

    def stats(self) -> dict:
        """This replica's counters (the status line)."""
        return self.service.batcher.stats.as_dict()


def error(status: int, message: str, limit: str = "", retry_after_s: int = 0) -> Any:
    """A JSON error response as raymt.serve.api's (the front does not import the model's modules)."""
    from starlette.responses import Response

    body = json.dumps({"error": message} | ({"limit": limit} if limit else {}))
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else {}
    return Response(body, status, headers, media_type="application/json")


class Front:
    """The HTTP ingress, thin: checks a body's declared size, passes each request to a translator
    replica, retries it once on another when that replica dies, and turns Serve's back pressure
    (`max_queued_requests`) into a JSON 503 with Retry-After."""

    def __init__(self, translator: Any, max_body_bytes: int, retry_after_s: int):
        self.translator, self.max_body_bytes, self.retry_after_s = translator, max_body_bytes, retry_after_s
        self.retried = 0

    async def __call__(self, request: Any) -> Any:
        """One HTTP request (a Starlette Request), answered as a Starlette Response."""
        from starlette.responses import Response

        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            message = f"a body of {declared} bytes; the limit is {self.max_body_bytes}"
            return error(413, message, "max_body_bytes")
        args = (
            request.method,
            request.url.path,
            request.headers.get("content-type", ""),
            await request.body(),
            request.headers.get("authorization", ""),
        )
        try:
            status, content, headers, media_type = await self.call(args)
        except Busy as busy:
            return error(503, f"the server is busy: {busy}", busy.limit, self.retry_after_s)
        return Response(content, status, headers, media_type=media_type)

    async def call(self, args: tuple) -> tuple:
        """The translator's answer; once more on another replica when the first one died."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        for attempt in (1, 2):
            try:
                return await self.translator.answer.remote(*args)
            except BackPressureError as err:
                raise Busy(first_line(err), "max_queued_requests") from None
            except (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError) as err:
                if attempt == 2:
                    raise Busy(f"a translator replica failed twice ({type(err).__name__})") from None
                self.retried += 1

    async def stats(self) -> dict:
        """A translator replica's counters and this front's retries (the status line, GET /stats)."""
        return await self.translator.stats.remote() | {"retried": self.retried}


class Busy(Exception):
    """No translator replica can take the request now: 503 (naming the limit, if one was hit)."""

    def __init__(self, message: str, limit: str = ""):
        super().__init__(message)
        self.limit = limit


def application(cfg: ServeConfig) -> Any:
    """The bound Serve application of a ServeConfig: `cfg.replicas` replicas of `Replica`, or
    as many as Serve's autoscaler keeps within `cfg.autoscale`."""
    from ray import serve

    scale = cfg.autoscale_range()
    replicas = (
        {"num_replicas": cfg.replicas}
        if scale is None
        else {
            "autoscaling_config": {
                "min_replicas": scale[0],
                "max_replicas": scale[1],
                "target_ongoing_requests": cfg.target_ongoing_requests,
            }
        }
    )
    translator = serve.deployment(Replica, name="translator").options(
        **replicas,
        # Requests must reach the replica's own queue to share its batches: Serve's default of
        # 5 ongoing requests a replica would cap a batch at 5 requests.
        max_ongoing_requests=cfg.max_queue_sentences,
        max_queued_requests=cfg.max_queued_requests,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        ray_actor_options={"num_cpus": cfg.cpus_per_replica} | ({"num_gpus": 1} if on_gpu(cfg) else {}),
    )
    front = serve.deployment(Front, name="front").options(
        num_replicas=1,
        max_ongoing_requests=cfg.max_queue_sentences,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
    )
    return front.bind(translator.bind(dataclasses.asdict(cfg)), cfg.max_body_bytes, cfg.retry_after_s)


def build(args: dict) -> Any:
    """The application of a `serve deploy` config's `args` (a ServeConfig as a dict): its
    `import_path` is raymt.serve.app:build."""
    return application(config_from_dict(args))


def deploy_config(cfg: ServeConfig) -> dict:
    """The Serve config file of `serve deploy` (`--print-config`): Serve's HTTP options, its
    logging, and one application built by `build` from the ServeConfig."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.host, "port": cfg.port},
        "logging_config": {"log_level": "WARNING"},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": "raymt.serve.app:build",
                "args": dataclasses.asdict(cfg),
            }
        ],
    }


def start(cfg: ServeConfig) -> Any:
    """Serve started on the connected Ray cluster on cfg.host:cfg.port and the application
    deployed (blocks until its replicas are up); returns its handle."""
    from ray import serve
    from ray.serve.config import HTTPOptions

    # WARNING: no access line per request in Serve's logs (request text is never logged anyway)
    serve.start(http_options=HTTPOptions(host=cfg.host, port=cfg.port), logging_config={"log_level": "WARNING"})
    return serve.run(application(cfg), name=APP_NAME, route_prefix="/")
