"""Ray's console kept to what matters: its INFO lines and internal chatter left in its log files
(`quiet_console`, `quiet_env`, `filter_worker_output`, `train_logging`), a worker's one-line error
without Ray Train's traceback (`quiet_user_errors`)."""

from __future__ import annotations

import logging
import re
import sys

# Ray's own loggers: on the console only their warnings and errors, minus known chatter.
RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune")
# Lines of Ray's internals that say nothing a raymt user can act on; they stay in Ray's logs.
RAY_CHATTER = (
    "gcs_actor_scheduler.cc",
    "Failed to kill actor",
    "worker processes have been started",
    "maximum expected startup concurrency",
    "PreemptionWatcher",
    "Progress bars disabled",
    "Token authentication is enabled",
    "Tip: For detailed progress reporting",
    # Ray Train's start-up of every worker group
    "Setting up process group for",
    "Started training worker group of size",
    "world_rank=",
    "Moving model to device",
    "Wrapping provided model in DistributedDataParallel",
    "Reporting training result",  # a Train logger outside ray.train: its LoggingConfig misses it
    # Ray Data's check at the start of a read while other groups hold their CPUs; raymt's
    # planner leaves Ray Data a CPU (plan), and the read goes ahead
    "Cluster resources are not enough to run any task from TaskPoolMapOperator[ReadFiles",
)
# A line that one of Ray's Python loggers wrote in a worker process: "DATE TIME\tINFO file.py:12 -- ...".
RAY_INFO_LINE = re.compile(r"^\S+ \S+\s+(DEBUG|INFO) [\w./]+\.py:\d+ -- ")
# Ray Train's helper actor whose console output is Ray's own (its failures to reach the state
# API where several Ray instances share a machine, with tracebacks).
RAY_PROCESSES = ("PlacementGroupCleaner",)


def is_chatter(line: str, source: object = None) -> bool:
    """True for a console line of Ray's internals: kept in Ray's log files, not shown."""
    return (
        source in RAY_PROCESSES
        or RAY_INFO_LINE.match(line) is not None
        or any(pattern in line for pattern in RAY_CHATTER)
    )


class _QuietFilter(logging.Filter):
    """Lets Ray's warnings and errors through to the console, not its INFO lines or chatter."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not is_chatter(record.getMessage())


# The logger through which Ray Train (2.60) prints, in the worker, the traceback of an exception
# its training function raised ("Error in training function:", ray.train.v2._internal.util).
RAY_TRAIN_ERROR_LOGGER = "ray.train.v2._internal.util"


class _UserErrorFilter(logging.Filter):
    """Drops Ray Train's print of a training worker's one-line ValueError (a CUDA out-of-memory's
    hint): the driver prints that line alone (raymt.train.main). Ray logs it while the exception
    is being handled, so it is `sys.exc_info()` here; other errors keep their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(sys.exc_info()[1], ValueError) and record.getMessage().startswith("Error in training"))


def quiet_user_errors() -> None:
    """In a Ray Train worker: its one-line errors reach the console only through the driver."""
    logger = logging.getLogger(RAY_TRAIN_ERROR_LOGGER)
    if not any(isinstance(f, _UserErrorFilter) for f in logger.filters):
        logger.addFilter(_UserErrorFilter())


def quiet_console() -> None:
    """Filter the console handlers of Ray's loggers in this process (files keep everything)."""
    for name in RAY_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                if not any(isinstance(f, _QuietFilter) for f in handler.filters):
                    handler.addFilter(_QuietFilter())


def filter_worker_output() -> None:
    """Drop Ray's chatter from the worker output and raylet messages Ray prints on the console.

    Worker prints (raymt's progress lines) arrive through the same function as the raylet's
    warnings (`print_to_stdstream`, fed by the log subscriber and the error listener); Ray has
    no public filter, so that function is wrapped. Should Ray's private names change, the
    console is only louder.
    """
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        ignore_prefix = ray_worker._should_ignore_worker_log_prefix(ray_worker.global_worker)
        print_to_stdstream = ray_worker.print_to_stdstream
    except (ImportError, AttributeError):
        return
    if getattr(print_to_stdstream, "raymt_filter", False):
        return

    def filtered(data: dict, ignore_prefix: bool) -> None:
        source = data.get("actor_name") or data.get("pid")
        lines = [line for line in data.get("lines", []) if not is_chatter(line, source)]
        if lines:
            print_to_stdstream({**data, "lines": lines}, ignore_prefix=ignore_prefix)

    filtered.raymt_filter = True
    ray_worker.print_to_stdstream = filtered  # the error listener looks it up at every call
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", lambda data: filtered(data, ignore_prefix))


def quiet_env() -> dict[str, str]:
    """Environment of Ray's processes that keeps their console output to what matters."""
    return {
        "RAY_DATA_LOG_LEVEL": "WARNING",  # Ray Data's per-execution lines
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    }  # worker prints appear once


def train_logging(verbose: bool = False):
    """Ray Train's `RunConfig.logging_config`: its INFO lines (worker group start, reports,
    checkpoints) stay in its log files unless `verbose`."""
    from ray.train import LoggingConfig

    return LoggingConfig(log_level="INFO" if verbose else "WARNING")
