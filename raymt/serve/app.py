"""The Ray Serve side of `raymt serve`: a thin HTTP front (`Front`: body size, the model of each
request, one retry when a translator replica dies, back pressure as a JSON 503) before the
translator replicas (`Replica`: its models through Serve multiplexing, an engine, a `Service` and
a `Batcher` each); their deployment options from a `ServeConfig` (`application`), the start on a
running Ray cluster (`start`) and the config file of `serve deploy` (`deploy_config`, `build`).
`raymt.serve.api` answers the translations, `raymt.serve.routing` picks the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from raymt.config import DecodeOptions, ServeConfig
from raymt.errors import first_line
from raymt.serve.routing import Refused, Router, parse_body

APP_NAME = "raymt"
# Serve's logs: warnings and errors only, no access line per request (request text is never logged).
LOGGING = {"log_level": "WARNING", "enable_access_log": False}
# How often a stopping replica looks whether its requests are done (Serve's default: 2 s).
SHUTDOWN_POLL_S = 0.25


def config_from_dict(d: dict) -> ServeConfig:
    """A ServeConfig from `dataclasses.asdict` (how it crosses to the replicas)."""
    return ServeConfig(**{**d, "decode": DecodeOptions(**d["decode"])})


def on_gpu(cfg: ServeConfig) -> bool:
    """Whether each replica takes a GPU (--device cuda or cuda:N)."""
    return cfg.device.startswith("cuda")


class Replica:
    """One Serve replica: its models loaded on demand through Serve multiplexing (at most
    `cfg.models_held()` at once, the first ones at start), each an engine and its `Service`,
    decoding one batch at a time on one shared thread."""

    async def __init__(self, cfg: dict):  # async: Serve awaits it, so the first models load through the multiplexer
        import torch
        from ray import serve

        from raymt.serve.batcher import decoding_thread

        self.cfg = config_from_dict(cfg)
        self.threads = max(1, int(self.cfg.cpus_per_replica))
        torch.set_num_threads(self.threads)
        self.thread = decoding_thread()
        self.stats_of: dict = {}  # every model's counters, kept after it is unloaded

        async def load(name: str) -> Any:
            return await asyncio.to_thread(self.service, name)

        # Serve's multiplexer routes each model's requests to the replicas holding it and unloads
        # the least recently used beyond the limit (applied here: it is a ServeConfig option).
        self.load = serve.multiplexed(max_num_models_per_replica=self.cfg.models_held())(load)
        for name in list(self.cfg.models)[: self.cfg.models_held()]:
            await self.load(name)

    def service(self, name: str) -> Any:
        """Model `name` loaded into an engine behind its Service."""
        from raymt.engines import load_engine
        from raymt.serve.api import Service

        device = "cuda" if on_gpu(self.cfg) else self.cfg.device  # Ray shows the replica its one GPU
        engine = load_engine(self.cfg.models[name], self.cfg.engine, device, self.threads)
        service = Service(engine, self.cfg, name, self.thread)
        self.stats_of[name] = service.batcher.stats
        return service

    async def answer(self, method: str, path: str, content_type: str, body: bytes, authorization: str) -> tuple:
        """One HTTP request's (status, body bytes, headers, media type), from the front: a
        translation by the request's multiplexed model, else this replica's health or counters."""
        from ray import serve

        from raymt.serve.api import replica_reply

        name = serve.get_multiplexed_model_id()
        if name:
            reply = await (await self.load(name)).handle(method, path, content_type, body, authorization)
        else:
            reply = replica_reply(path, list(self.stats_of.values()), list(self.stats_of))
        return reply.status, reply.content(), reply.headers, reply.media_type

    def stats(self) -> dict:
        """This replica's counters, all its models' summed (the status line)."""
        from raymt.serve.batcher import Stats

        return Stats.merged(list(self.stats_of.values())).as_dict()


def error(status: int, message: str, limit: str = "", retry_after_s: int = 0) -> Any:
    """A JSON error response as raymt.serve.api's (the front does not import the model's modules)."""
    from starlette.responses import Response

    body = json.dumps({"error": message} | ({"limit": limit} if limit else {}))
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else {}
    return Response(body, status, headers, media_type="application/json")


class Front:
    """The HTTP ingress, thin: checks a body's declared size, answers the page, `/languages` and
    `/v1/models` itself, picks the model of a translation request (`Router.pick`), passes the
    request to a translator replica holding that model (Serve multiplexing), retries it once on
    another when that replica dies, and turns Serve's back pressure (`max_queued_requests`) into
    a JSON 503 with Retry-After. `models`: every model's (source, target) pairs by name."""

    def __init__(self, translator: Any, models: dict, max_body_bytes: int, retry_after_s: int):
        self.translator, self.max_body_bytes, self.retry_after_s = translator, max_body_bytes, retry_after_s
        self.router = Router(models, max_body_bytes)
        self.handles: dict[str, Any] = {}  # the translator's handle for each model
        self.retried = 0

    async def __call__(self, request: Any) -> Any:
        """One HTTP request (a Starlette Request), answered as a Starlette Response."""
        from starlette.responses import Response

        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            message = f"a body of {declared} bytes; the limit is {self.max_body_bytes}"
            return error(413, message, "max_body_bytes")
        method, path, content_type = request.method, request.url.path, request.headers.get("content-type", "")
        body = await request.body()
        try:
            reply = self.router.local(method, path)
            if reply is not None:
                return Response(reply.content(), reply.status, reply.headers, media_type=reply.media_type)
            model = self.router.pick(parse_body(content_type, body, self.max_body_bytes)) if method == "POST" else ""
            args = (method, path, content_type, body, request.headers.get("authorization", ""))
            status, content, headers, media_type = await self.call(args, model)
        except Refused as refused:
            reply = refused.reply()
            return Response(reply.content(), reply.status, reply.headers, media_type=reply.media_type)
        except Busy as busy:
            return error(503, f"the server is busy: {busy}", busy.limit, self.retry_after_s)
        return Response(content, status, headers, media_type=media_type)

    def handle(self, model: str) -> Any:
        """The translator's handle for requests of `model` ("": any replica, e.g. GET /stats)."""
        if model and model not in self.handles:
            self.handles[model] = self.translator.options(multiplexed_model_id=model)
        return self.handles[model] if model else self.translator

    async def call(self, args: tuple, model: str = "") -> tuple:
        """The translator's answer; once more on another replica when the first one died."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        for attempt in (1, 2):
            try:
                return await self.handle(model).answer.remote(*args)
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
    routes = model_pairs(cfg)
    return front.bind(translator.bind(dataclasses.asdict(cfg)), routes, cfg.max_body_bytes, cfg.retry_after_s)


def model_pairs(cfg: ServeConfig) -> dict[str, list[list[str]]]:
    """Every served model's (source, target) pairs by name, read from its checkpoint's config
    where the application is built (a URI's checkpoint is fetched into raymt's cache once)."""
    from raymt.engines import load_model_info

    return {name: [list(p) for p in load_model_info(ckpt).pairs] for name, ckpt in cfg.models.items()}


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
        "logging_config": dict(LOGGING),
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "logging_config": dict(LOGGING),  # a copy: no YAML anchor in the file
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

    serve.start(http_options=HTTPOptions(host=cfg.host, port=cfg.port), logging_config=LOGGING)
    return serve.run(application(cfg), name=APP_NAME, route_prefix="/", logging_config=LOGGING)
