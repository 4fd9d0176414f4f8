"""The Ray Serve side of `raymt serve`: one deployment, `Replica` (the `translator`), that is both
the HTTP ingress and the engine: Serve's proxy sends each request straight to a replica, which
checks it, picks its model (`Router`), and batches and decodes it (its models through Serve
multiplexing, an engine, a `Service` and a `Batcher` each): one hop a request. Only when a replica
holds fewer models than the server serves (`--models-per-replica`) does a request whose model it
was not routed by go on to a replica holding it (`Forwarder`: Serve multiplexing, one retry when
that replica dies). Their deployment options from a `ServeConfig` (`application`), the start on a
running Ray cluster (`start`) and the config file of `serve deploy` (`deploy_config`, `build`).
`raymt.serve.api` answers the translations, `raymt.serve.routing` picks the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from raymt.config import DecodeOptions, ServeConfig
from raymt.errors import first_line
from raymt.serve.routing import Refused, Reply, Router, parse_body

APP_NAME = "raymt"
DEPLOYMENT = "translator"
# Serve's logs: warnings and errors only, no access line per request (request text is never logged).
LOGGING = {"log_level": "WARNING", "enable_access_log": False}
# A body declared over --max-body-bytes is read and dropped up to this many times the limit
# before the 413 (memory stays flat: it is not kept), so that the client reads the answer.
DISCARD_BODIES = 4
# How often a stopping replica looks whether its requests are done (Serve's default: 2 s).
SHUTDOWN_POLL_S = 0.25


def config_from_dict(d: dict) -> ServeConfig:
    """A ServeConfig from `dataclasses.asdict` (how it crosses to the replicas)."""
    return ServeConfig(**{**d, "decode": DecodeOptions(**d["decode"])})


def on_gpu(cfg: ServeConfig) -> bool:
    """Whether each replica takes a GPU (--device cuda or cuda:N)."""
    return cfg.device.startswith("cuda")


class Replica:
    """One Serve replica, the application's ingress: every HTTP request from Serve's proxy is
    routed, checked and answered here (`__call__`); its models are loaded on demand through Serve
    multiplexing (at most `cfg.models_held()` at once, the first ones at start), each an engine and
    its `Service`, decoding one batch at a time on one shared thread. `routes`: every served
    model's (source, target) pairs by name."""

    async def __init__(self, cfg: dict, routes: dict):  # async: Serve awaits it, so the first models load here
        import torch
        from ray import serve

        from raymt.serve.batcher import decoding_thread

        self.cfg = config_from_dict(cfg)
        self.router = Router(routes, self.cfg.max_body_bytes, self.cfg.max_text_chars)
        self.threads = max(1, int(self.cfg.cpus_per_replica))
        torch.set_num_threads(self.threads)
        self.thread = decoding_thread()
        self.stats_of: dict = {}  # every model's counters, kept after it is unloaded
        # When every replica may hold every model, a request is answered where it lands; else
        # only when Serve's proxy routed it by its model (Serve's header), or it is forwarded.
        self.holds_all = self.cfg.models_held() >= len(self.cfg.models)
        self.forwarder = Forwarder(lambda: serve.get_deployment_handle(DEPLOYMENT), self.cfg.retry_after_s)

        async def load(name: str) -> Any:
            # On the decoding thread: the engine's own threads (CTranslate2's workers, OpenMP's)
            # inherit its OS name, so that a profile can tell the engine's CPU from Serve's.
            return await asyncio.get_running_loop().run_in_executor(self.thread, self.service, name)

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

    async def __call__(self, request: Any) -> Any:
        """One HTTP request (a Starlette Request) from Serve's proxy, answered as a Starlette Response."""
        from ray import serve
        from starlette.responses import Response

        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.cfg.max_body_bytes:
            await discard(request, DISCARD_BODIES * self.cfg.max_body_bytes)
            message = f"a body of {declared} bytes; the limit is {self.cfg.max_body_bytes}"
            reply = Refused(413, message, "max_body_bytes").reply()
        else:
            args = (request.method, request.url.path, request.headers.get("content-type", ""), await request.body())
            routed = serve.get_multiplexed_model_id()  # Serve's header named it: the proxy chose by it
            reply = await self.route(*args, request.headers.get("authorization", ""), routed)
        return Response(reply.content(), reply.status, reply.headers, media_type=reply.media_type)

    async def route(
        self, method: str, path: str, content_type: str, body: bytes, authorization: str, routed: str = ""
    ) -> Reply:
        """The reply to one request: the routes of every model's pairs, this replica's health and
        counters, or a translation by the request's model, here when this replica may hold it
        (every replica holds every model, or Serve routed the request by that model), else on a
        replica holding it (`routed`: the model Serve's proxy routed the request by, if any)."""
        from raymt.serve.api import replica_reply

        try:
            reply = self.router.local(method, path)
            if reply is not None:
                return reply
            if method == "GET":
                return replica_reply(path, self.stats(), list(self.stats_of))
            fields = parse_body(content_type, body, self.cfg.max_body_bytes)
            name = self.router.pick(fields)
            if self.holds_all or name == routed:
                return await (await self.load(name)).respond(path, fields, authorization)
            return await self.forwarder.call((method, path, content_type, body, authorization), name)
        except Refused as refused:
            return refused.reply()

    async def answer(self, method: str, path: str, content_type: str, body: bytes, authorization: str) -> Reply:
        """A request another replica forwarded, by its multiplexed model: answered here."""
        from ray import serve

        return await (await self.load(serve.get_multiplexed_model_id())).handle(
            method, path, content_type, body, authorization
        )

    def stats(self) -> dict:
        """This replica's counters, all its models' summed, and its forwarded requests (the status line)."""
        from raymt.serve.batcher import Stats

        forwarded = {"forwarded": self.forwarder.forwarded, "retried": self.forwarder.retried}
        return Stats.merged(list(self.stats_of.values())).as_dict() | forwarded


async def discard(request: Any, limit: int) -> None:
    """Read a refused body and drop it, up to `limit` bytes: a client that sends its whole body
    before reading (urllib, requests) then gets the 413 instead of a broken pipe; beyond the
    limit the answer goes out at once and the connection closes under the rest."""
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            return


class Forwarder:
    """Passes a request to a replica holding its model (Serve multiplexing, through `handle()`, the
    translator deployment's handle), once more on another when that replica dies; Serve's back
    pressure (`max_queued_requests`) or a second death is a JSON 503 with Retry-After."""

    def __init__(self, handle: Callable[[], Any], retry_after_s: int):
        self.handle, self.retry_after_s = handle, retry_after_s
        self.handles: dict[str, Any] = {}  # the deployment's handle for each model
        self.forwarded = self.retried = 0

    async def call(self, args: tuple, model: str) -> Reply:
        """The answer of a replica holding `model` to the request `args` (Replica.answer's)."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        if model not in self.handles:
            self.handles[model] = self.handle().options(multiplexed_model_id=model)
        self.forwarded += 1
        retry = {"Retry-After": str(self.retry_after_s)}
        for attempt in (1, 2):
            try:
                return await self.handles[model].answer.remote(*args)
            except BackPressureError as err:
                return Refused(503, f"the server is busy: {first_line(err)}", "max_queued_requests", retry).reply()
            except (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError) as err:
                if attempt == 2:
                    message = f"the server is busy: a translator replica failed twice ({type(err).__name__})"
                    return Refused(503, message, None, retry).reply()
                self.retried += 1
        raise AssertionError("unreachable")  # for the type checker: the loop returns or raises


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
    translator = serve.deployment(Replica, name=DEPLOYMENT).options(
        **replicas,
        # Requests must reach the replica's own queue to share its batches: Serve's default of
        # 5 ongoing requests a replica would cap a batch at 5 requests.
        max_ongoing_requests=cfg.max_queue_sentences,
        max_queued_requests=cfg.max_queued_requests,
        # Serve's proxy answers its own back pressure (no replica can take a request): a 503
        # with the Retry-After of the replicas' own 503s.
        backpressure_config={"status_code": 503, "retry_after_s": cfg.retry_after_s},
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        ray_actor_options={"num_cpus": cfg.cpus_per_replica} | ({"num_gpus": 1} if on_gpu(cfg) else {}),
    )
    return translator.bind(dataclasses.asdict(cfg), model_pairs(cfg))


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
