"""The layout of raymt/ (issue 43), read with ast (nothing is imported): no import cycle among
raymt's modules, no private name imported across modules, no command module importing another
(issue 56), no module over 700 lines and no function over 80; the worker's contracts typed (issue
56): no `loop_config["` and the train state's keys named only in raymt/checkpoint.py; settings read
by attribute, not by string key, and no import running up the floors (issue 66: `FLOORS`). Run with
-s to see the largest modules and functions."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Collection, Iterator, Optional

import raymt

ROOT = Path(raymt.__file__).resolve().parent
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80

# Offenders still being split, as "raymt/x.py" (lines of a module) or "raymt/x.py:Class.method"
# (lines of a function, nested functions included), each with its size when listed. An entry
# may only shrink: the test fails when one grows, when a module or function not listed goes
# over its limit, and when a listed one fits (then delete its entry). Empty since issue 43
# split config.py, train.py, data/prepare.py, data/stream.py, backtranslate.py and
# WorkerLoop.__init__ (852 to 1,580 lines; 110): keep it so.
STILL_TOO_LARGE: dict[str, int] = {}

# Import cycles still being broken, each as the set of modules that import one another (a
# strongly connected component). A cycle found must lie inside a listed set; a listed set with
# no cycle left inside it must be deleted (or narrowed). Empty since issue 43 broke
# raymt.config -> raymt.data.inputs -> raymt.config.
KNOWN_CYCLES: list[frozenset[str]] = []

# The only imports of one command module (`raymt COMMAND`'s: raymt/COMMAND.py or
# raymt/COMMAND/__main__.py) by another (issue 56): a sweep runs training, a run scores its
# test sets, a distillation checks its teachers' pair as back-translation does and reads a training
# worker's error as training does (its steps are the pipeline's). What two commands share lives
# in a module that is no command's.
COMMAND_IMPORTS = {
    ("raymt.tune", "raymt.train"),
    ("raymt.train", "raymt.evaluate"),
    ("raymt.distill", "raymt.backtranslate"),
    ("raymt.distill", "raymt.train"),
}


# The modules that may handle the one-pair names (`one_pair_names`), at most 3 (issue 56): where
# the reader lives (raymt.config.corpus: ONE_PAIR_FIELDS, with_one_pair, read_one_pair), where
# build_config assembles the flat map of config file, flags and --set (raymt.flags), and
# Config.from_dict, which reads stored configs (raymt.config.sections).
ONE_PAIR_HOMES = {"raymt.config.corpus", "raymt.config.sections", "raymt.flags"}


# The train state's one home (issue 56): `TrainState` and its `from_dict`, which reads every
# older checkpoint. "step" and "epoch" are its fields too, but also metrics.csv's columns, Ray's
# reported metrics and a data Position's fields, so a key of that name says nothing.
TRAIN_STATE_HOME = "raymt/checkpoint.py"
TRAIN_STATE_CLASS = "TrainState"
KEYS_NAMED_ELSEWHERE_TOO = {"step", "epoch"}


# The floors of raymt (issue 66): a module imports modules of its own floor or below, never above
# (module-level and function-level imports alike), so that each floor can be read, tested and
# reused without the ones above it. A module's floor is that of the longest entry naming it or a
# package above it ("raymt.data" holds raymt.data.*, "raymt.data.__main__" is a command's); the
# entry "raymt" is the package's own __init__ only. A module on no floor fails until it is placed,
# an entry naming no module fails until deleted. UPWARD_IMPORTS lists any import still
# running up, and why: it may only go.
FLOORS: dict[str, int] = {
    # 0, the ground every module stands on: user errors, language tags, typed configs, storage.
    "raymt": 0,
    "raymt.errors": 0,
    "raymt.command": 0,
    "raymt.tags": 0,
    "raymt.config": 0,
    "raymt.storage": 0,
    # 1, one model and the machinery under a run: tokenizer, model, batching, decoding, the
    # training step and its precision, checkpoints, the inference engines, metrics, language ID;
    # Ray's start-up and the shard-job actor pool, which the data floor's jobs run on.
    "raymt.tokenizer": 1,
    "raymt.model": 1,
    "raymt.ensemble": 1,
    "raymt.batching": 1,
    "raymt.decoding": 1,
    "raymt.optim": 1,
    "raymt.trainer": 1,
    "raymt.precision": 1,
    "raymt.profiling": 1,
    "raymt.checkpoint": 1,
    "raymt.provenance": 1,
    "raymt.engines": 1,
    "raymt.exporting": 1,
    "raymt.argos": 1,
    "raymt.metrics": 1,
    "raymt.langid": 1,
    "raymt.autoscale": 1,
    "raymt.ray_console": 1,
    "raymt.cluster": 1,
    "raymt.shard_job": 1,
    # 2, corpora: reading, cleaning, preparing, mixing, streaming and scoring them.
    "raymt.data": 2,
    # 3, runs and commands: the run directory and a run's data plan, the workers, the command line,
    # every other command's module, serving, plots and sweep reports.
    "raymt.data.__main__": 3,
    "raymt.__main__": 3,
    "raymt.flags": 3,
    "raymt.rundir": 3,
    "raymt.rundata": 3,
    "raymt.shared_dir": 3,
    "raymt.distributed": 3,
    "raymt.worker": 3,
    "raymt.worker_env": 3,
    "raymt.worker_state": 3,
    "raymt.worker_data": 3,
    "raymt.worker_logs": 3,
    "raymt.train": 3,
    "raymt.tune": 3,
    "raymt.sweep_report": 3,
    "raymt.evaluate": 3,
    "raymt.translate": 3,
    "raymt.backtranslate": 3,
    "raymt.bt_job": 3,
    "raymt.distill": 3,
    "raymt.pipeline": 3,
    "raymt.average": 3,
    "raymt.export": 3,
    "raymt.hf_import": 3,
    "raymt.hf_model": 3,
    "raymt.hf_marian": 3,
    "raymt.hf_m2m": 3,
    "raymt.compare": 3,
    "raymt.curves": 3,
    "raymt.plot": 3,
    "raymt.serve": 3,
}

# Imports that still run up the floors, (importer, imported) -> why; one that no longer runs up
# must be deleted.
UPWARD_IMPORTS: dict[tuple[str, str], str] = {}


# ---------------------------------------------------------------- the command layer (issue 66)


def parse_function(name: str) -> bool:
    """A function that turns a command line into a config: parse_args, parse_*, *_parser."""
    return name.startswith("parse") or name.endswith("parser")


def namespace_nodes(node: ast.AST, names: set[str], inside: bool = False) -> Iterator[int]:
    """The lines naming argparse.Namespace (`names`: what it is imported as) outside parse functions."""
    for child in ast.iter_child_nodes(node):
        here = inside or (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and parse_function(child.name))
        attr = isinstance(child, ast.Attribute) and child.attr == "Namespace"
        hit = attr and isinstance(child.value, ast.Name) and child.value.id == "argparse"
        if not here and (hit or (isinstance(child, ast.Name) and child.id in names)):
            yield child.lineno
        yield from namespace_nodes(child, names, here)


def namespace_uses(root: Path = ROOT) -> list[str]:
    """Each `argparse.Namespace` (or a `Namespace` imported from argparse) named outside a parse
    function: arguments stop at `main`; everything after it takes a typed config."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) == Path("command.py"):
            continue  # the command layer itself: parsed flags into configs (`from_args`)
        tree = parse(path)
        imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "argparse"]
        names = {a.asname or a.name for n in imports for a in n.names if a.name == "Namespace"}
        where = path.relative_to(root.parent)
        bad += [f"{where}:{line} names argparse.Namespace" for line in namespace_nodes(tree, names)]
    return bad


def main_calls(root: Path = ROOT) -> list[str]:
    """Each call of a command module's `main` from another raymt module: commands compose by
    calling each other's `run(config)`, never `main` (an argv built and parsed again)."""
    commands = set(command_modules(root))
    known = set(modules(root))
    bad = []
    for module, path in modules(root).items():
        tree = parse(path)
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known:
                        bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = import_base(node, module, path)
                for a in node.names:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            target = dotted(node.func, bound)
            owner = target.rsplit(".", 1)[0] if target and target.endswith(".main") else None
            for command in (owner, f"{owner}.__main__"):
                if command in commands and command != module:
                    bad.append(f"{path.relative_to(root.parent)}:{node.lineno} calls {command}.main")
    return bad


# ---------------------------------------------------------------- reading raymt/


def module_name(path: Path, root: Path) -> str:
    """raymt.data.mixing of raymt/data/mixing.py; raymt.config of raymt/config/__init__.py."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package at `root` (raymt/) by its dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def parse(path: Path) -> ast.Module:
    """The ast of a module; a syntax error names its file."""
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as err:
        raise AssertionError(f"{path} does not parse: {err}") from None


def private(name: str) -> bool:
    """`_x`, not `__x__`."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def import_base(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute module a `from ... import` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def read_imports(module: str, path: Path, known: set[str]) -> tuple[set[str], list[str]]:
    """The raymt modules that `module` imports anywhere (in functions too), and its uses of a
    private name of another raymt module ("raymt.a imports raymt.b._x")."""
    tree = parse(path)
    edges: set[str] = set()
    bad: list[str] = []
    bound: dict[str, str] = {}  # local name -> the raymt module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    edges.add(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, module, path)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known:
                    edges.add(target)
                    bound[alias.asname or alias.name] = target
                elif base in known:
                    edges.add(base)
                    if private(alias.name) and base != module:
                        bad.append(f"{module} imports {base}.{alias.name} (line {node.lineno})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = dotted(node.value, bound)
            if owner in known and owner != module:
                bad.append(f"{module} uses {owner}.{node.attr} (line {node.lineno})")
    edges.discard(module)
    return edges, bad


def dotted(node: ast.AST, bound: dict[str, str]) -> Optional[str]:
    """raymt.a.b of `x.b` where the name x is bound to the raymt module raymt.a; else None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = dotted(node.value, bound)
        return f"{owner}.{node.attr}" if owner else None
    return None


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """Each raymt module's imported raymt modules, and every private name used across modules.

    Importing raymt.a.b runs raymt/a/__init__.py first, but that edge is not counted: a
    package's __init__ that re-exports its own submodules makes no cycle with them.
    """
    found = modules(root)
    known = set(found)
    graph, bad = {}, []
    for name, path in found.items():
        graph[name], uses = read_imports(name, path, known)
        bad += uses
    return graph, bad


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def chain(graph: dict[str, set[str]], component: set[str]) -> str:
    """The shortest cycle through the first module of `component`: "raymt.a -> raymt.b -> raymt.a"."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return " -> ".join(paths[node] + [start])
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def command_modules(root: Path = ROOT) -> list[str]:
    """The module each command of raymt/__main__.py's COMMANDS runs: raymt.train, raymt.data.__main__."""
    tables = {
        target.id: ast.literal_eval(node.value)
        for node in parse(root / "__main__.py").body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if getattr(target, "id", None) in ("COMMANDS", "MODULES")
    }
    package, named = root.name, [tables.get("MODULES", {}).get(c, c) for c in tables["COMMANDS"]]
    return [f"{package}.{c}" if (root / f"{c}.py").is_file() else f"{package}.{c}.__main__" for c in named]


def command_import_problems(
    graph: dict[str, set[str]], commands: list[str], allowed: set[tuple[str, str]]
) -> list[str]:
    """Each import of a command module by another that `allowed` does not list."""
    return [
        f"{module} imports {other}, another command: move what both need into a module that is no command's"
        for module in sorted(commands)
        for other in sorted(graph[module] & set(commands))
        if (module, other) not in allowed
    ]


def floor_of(module: str, floors: dict[str, int]) -> Optional[int]:
    """The floor of `module`: that of the longest entry naming it or a package above it (the
    root package's entry names its __init__ only); None when none does."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in floors:
            return floors[".".join(parts[:n])]
    return floors.get(module)


def floor_problems(
    graph: dict[str, set[str]], floors: dict[str, int], allowed: Collection[tuple[str, str]] = ()
) -> list[str]:
    """Modules on no floor, entries naming no module, each import of a module on a higher floor
    that `allowed` does not list, and each listed one that no longer runs up."""
    problems = [f"{m} is on no floor: add it to FLOORS" for m in sorted(graph) if floor_of(m, floors) is None]
    problems += [
        f"FLOORS names {name}, which is no module: delete it"
        for name in sorted(floors)
        if not any(m == name or m.startswith(name + ".") for m in graph)
    ]

    def rises(module: str, other: str) -> bool:
        here, there = floor_of(module, floors), floor_of(other, floors)
        return here is not None and there is not None and here < there

    upward = {(module, other) for module in graph for other in graph[module] if rises(module, other)}
    problems += [
        f"{module} (floor {floor_of(module, floors)}) imports {other} (floor {floor_of(other, floors)}): an import "
        "runs up the floors; move what it takes down to its floor or below"
        for module, other in sorted(upward - set(allowed))
    ]
    problems += [
        f"UPWARD_IMPORTS lists {edge}, which no longer runs up: delete it" for edge in sorted(set(allowed) - upward)
    ]
    return problems


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualname, lines) of each function and method; a nested function counts inside its parent."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child.end_lineno - child.lineno + 1
        elif isinstance(child, ast.ClassDef):
            yield from functions(child, f"{prefix}{child.name}.")
        else:
            yield from functions(child, prefix)


def sizes(root: Path = ROOT) -> tuple[dict[str, int], dict[str, int]]:
    """Lines of every module ("raymt/x.py") and every function ("raymt/x.py:Class.method")."""
    by_module, by_function = {}, {}
    for path in modules(root).values():
        key = path.relative_to(root.parent).as_posix()
        by_module[key] = len(path.read_text().splitlines())
        for name, lines in functions(parse(path)):
            qualname = f"{key}:{name}"
            by_function[qualname] = max(lines, by_function.get(qualname, 0))
    return by_module, by_function


def cycle_problems(graph: dict[str, set[str]], known: list[frozenset[str]]) -> list[str]:
    """Cycles outside `known`, and entries of `known` with no cycle left inside them."""
    found = components(graph)
    problems = [f"import cycle {chain(graph, c)}" for c in found if not any(c <= k for k in known)]
    for k in known:
        if not any(c <= k for c in found):
            problems.append(f"KNOWN_CYCLES lists {sorted(k)}, no longer a cycle: delete it")
    return problems


def size_problems(table: dict[str, int], limit: int, allowed: dict[str, int]) -> list[str]:
    """Sizes over `limit` not in `allowed`, allowed ones that grew, and allowed ones that fit."""
    problems = []
    for key, lines in sorted(table.items()):
        most = allowed.get(key)
        if most is None and lines > limit:
            problems.append(f"{key} has {lines} lines, over {limit}: split it")
        elif most is not None and lines > most:
            problems.append(f"{key} grew to {lines} lines (STILL_TOO_LARGE allows {most}, limit {limit})")
        elif most is not None and lines <= limit:
            problems.append(f"{key} fits now ({lines} <= {limit} lines): delete it from STILL_TOO_LARGE")
    return problems


# Older configs' one-pair keys in a flat map; the flags that set the one corpus's languages.
OLD_ONE_PAIR_KEYS = {f"data.{name}" for name in ("src_lang", "tgt_lang", "train", "valid", "test")}
ONE_PAIR_FLAGS = {"--src-lang", "--tgt-lang"}


def identifiers(node: ast.AST) -> list[str]:
    """The names a node binds or reads: a name, an attribute, an import, a definition, an argument."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.alias):
        return [node.name.split(".")[-1]] + ([node.asname] if node.asname else [])
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.arg, ast.keyword)) and node.arg:
        return [node.arg]
    return []


def one_pair_names(path: Path) -> list[str]:
    """Where a module handles the one-pair names, as "name (line N)": an identifier holding
    "one_pair" (the reader's ONE_PAIR_FIELDS, with_one_pair, read_one_pair, ... and whatever wraps
    them) or check_beside_corpora; a string that is an older config's key (OLD_ONE_PAIR_KEYS); and
    --src-lang/--tgt-lang in a module that calls add_input_flags (a parser of corpora). Not
    ONE_PAIR_FORMAT, a prepared corpus's older format (raymt-corpus/1)."""
    tree = parse(path)
    calls = {node.func for node in ast.walk(tree) if isinstance(node, ast.Call)}
    strings = OLD_ONE_PAIR_KEYS | (ONE_PAIR_FLAGS if any("add_input_flags" in identifiers(f) for f in calls) else set())
    found = []
    for node in ast.walk(tree):
        names = [node.value] if isinstance(node, ast.Constant) and node.value in strings else identifiers(node)
        found += [
            f"{name} (line {getattr(node, 'lineno', '?')})"
            for name in names
            if name in strings
            or name == "check_beside_corpora"
            or ("one_pair" in name.lower() and name != "ONE_PAIR_FORMAT")
        ]
    return found


def class_fields(tree: ast.AST, name: str) -> list[str]:
    """The annotated fields of the class `name` defined in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    raise AssertionError(f"no class {name}")


def string_keys(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(string, line) of every string used as a key: `x["k"]`, `x.get("k")` (pop, setdefault),
    `{"k": ...}`, `dict(k=...)` and `"k" in x`."""
    for node in ast.walk(tree):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            keys = [node.args[0]] if node.func.attr in ("get", "pop", "setdefault") else []
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            yield from ((k.arg, node.lineno) for k in node.keywords if k.arg)
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            keys = [node.left]
        yield from ((k.value, k.lineno) for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str))


def keys_named_outside(root: Path, home: str, names: set[str]) -> list[str]:
    """ "raymt/x.py:12 names 'data_mix'" for each of `names` used as a string key outside `home`."""
    found = []
    for path in modules(root).values():
        key = path.relative_to(root.parent).as_posix()
        if key != home:
            found += [f"{key}:{line} names {k!r}" for k, line in string_keys(parse(path)) if k in names]
    return sorted(found)


def text_uses(root: Path, needles: tuple[str, ...]) -> list[str]:
    """ "raymt/x.py:12" for each line of raymt/ holding one of `needles`."""
    found = []
    for path in modules(root).values():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(root.parent).as_posix()}:{n}: {line.strip()}" for x in needles if x in line]
    return found


# ---------------------------------------------------------------- the tests


def test_no_import_cycle():
    graph, _ = import_graph()
    problems = cycle_problems(graph, KNOWN_CYCLES)
    assert not problems, "\n".join(problems)


def test_no_private_name_imported_across_modules():
    _, bad = import_graph()
    assert not bad, "private names used across modules (make them public):\n" + "\n".join(bad)


def test_no_command_imports_another():
    """tune -> train and train -> evaluate only: decoding flags, the actor plan, a checkpoint's
    description and the learning curves each live in a module that is no command's."""
    graph, _ = import_graph()
    commands = command_modules()
    assert {"raymt.train", "raymt.data.__main__", "raymt.serve.__main__", "raymt.plot"} <= set(commands)
    problems = command_import_problems(graph, commands, COMMAND_IMPORTS)
    assert not problems, "\n".join(problems)


def test_no_module_over_700_lines_and_no_function_over_80():
    by_module, by_function = sizes()
    for what, table in (("modules", by_module), ("functions", by_function)):
        print(f"\nlargest {what}:")
        for key, lines in sorted(table.items(), key=lambda kv: -kv[1])[:5]:
            print(f"  {lines:5d}  {key}")
    problems = size_problems(by_module, MAX_MODULE_LINES, STILL_TOO_LARGE)
    problems += size_problems(by_function, MAX_FUNCTION_LINES, STILL_TOO_LARGE)
    gone = sorted(set(STILL_TOO_LARGE) - set(by_module) - set(by_function))
    problems += [f"STILL_TOO_LARGE lists {key}, which is gone: delete it" for key in gone]
    assert not problems, "\n".join(problems)


def test_no_import_runs_up_the_floors():
    """Ground (errors, tags, config, storage) < one model and its machinery < corpora < runs and
    commands (FLOORS): checkpoint.py no longer reaches into raymt.data for a saved batching
    record, nor engines.py for the tags, nor anything below for what a floor above holds."""
    graph, _ = import_graph()
    problems = floor_problems(graph, FLOORS, UPWARD_IMPORTS)
    assert not problems, "\n".join(problems)


def test_the_floor_check_finds_what_it_looks_for(tmp_path):
    """On a made-up package: an import up a floor inside a function, a module on no floor, an
    entry naming no module, a listed upward import that is none; a package's entry holds its
    modules, the root's only its __init__; a listed upward import passes."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg import top\n    return top\n",
        "low/b.py": "from pkg.low import a\n",
        "top.py": "from pkg.low import b\nimport pkg\n",
        "mid.py": "from pkg import top\n",
        "loose.py": "",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    floors = {"pkg": 0, "pkg.low": 1, "pkg.mid": 1, "pkg.top": 2, "pkg.gone": 1}
    graph, _ = import_graph(pkg)
    assert floor_of("pkg.low.a", floors) == 1 and floor_of("pkg", floors) == 0 and floor_of("pkg.loose", floors) is None
    allowed = {("pkg.mid", "pkg.top"), ("pkg.top", "pkg.low.b")}
    assert [p.split(":")[0] for p in floor_problems(graph, floors, allowed)] == [
        "pkg.loose is on no floor",
        "FLOORS names pkg.gone, which is no module",
        "pkg.low.a (floor 1) imports pkg.top (floor 2)",
        "UPWARD_IMPORTS lists ('pkg.top', 'pkg.low.b'), which no longer runs up",
    ]
    assert "pkg.mid (floor 1) imports pkg.top (floor 2)" in floor_problems(graph, floors)[-1]


def test_the_loop_config_is_typed():
    """The driver hands the workers a `LoopConfig` (raymt.worker_env), read by attribute: a field
    renamed fails on the driver, where it is built, not inside a worker after Ray started."""
    bad = text_uses(ROOT, ('loop_config["', "loop_config['", "loop_config.get("))
    assert not bad, "the loop config read by string key (use raymt.worker_env.LoopConfig):\n" + "\n".join(bad)


def test_the_run_directory_takes_no_flags():
    """Continuing a run has one door (issue 56): `train.run` checks its resume_dir with
    raymt.rundir, which takes plain values; the command line's flags are read in raymt.train."""
    graph, _ = import_graph()
    tree = parse(ROOT / "rundir.py")
    stdlib = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "argparse" not in stdlib and "raymt.flags" not in graph["raymt.rundir"], graph["raymt.rundir"]


def test_the_train_state_keys_are_named_only_in_checkpoint_py():
    """train_state.pt's keys are read and written by `TrainState` alone (its `from_dict` reads
    every older checkpoint); elsewhere its fields are attributes."""
    home = ROOT.parent / TRAIN_STATE_HOME
    names = set(class_fields(parse(home), TRAIN_STATE_CLASS)) - KEYS_NAMED_ELSEWHERE_TOO
    assert {"optimizer", "data_positions", "data_mix", "precision"} <= names, names
    bad = keys_named_outside(ROOT, TRAIN_STATE_HOME, names)
    assert not bad, f"train state keys named outside {TRAIN_STATE_HOME} (use TrainState):\n" + "\n".join(bad)


# A prepared corpus is opened once (issue 56): `open_corpus` gives a `PreparedCorpus`, the one
# reader of its manifest and of the older one-pair format; run data, the run directory and
# training hold that object and never a manifest.
CORPUS_HOME = "raymt/data/format.py"
CORPUS_USERS = ("raymt/rundata.py", "raymt/rundir.py", "raymt/train.py")
ONE_PAIR_FORMAT_NAMES = {"ONE_PAIR_FORMAT", "raymt-corpus/1"}


def free_functions_taking(path: Path, param: str) -> list[str]:
    """The module-level public functions of `path` that take a parameter named `param`."""
    return [
        f"{node.name} (line {node.lineno})"
        for node in parse(path).body
        if isinstance(node, ast.FunctionDef)
        and not private(node.name)
        and any(a.arg == param for a in node.args.args + node.args.kwonlyargs)
    ]


def corpus_reads(path: Path) -> list[str]:
    """Where `path` handles a manifest itself (a name or attribute `manifest`) or the one-pair
    format (ONE_PAIR_FORMAT, "raymt-corpus/1")."""
    found = []
    for node in ast.walk(parse(path)):
        names = [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else identifiers(node)
        found += [
            f"{name} (line {getattr(node, 'lineno', '?')})"
            for name in names
            if name == "manifest" or name in ONE_PAIR_FORMAT_NAMES
        ]
    return found


def test_a_prepared_corpus_is_read_through_its_object():
    """raymt.data.format has no free function taking a manifest (`PreparedCorpus` reads it); no
    module outside it names the one-pair format, and run data, the run directory and training
    hold no manifest."""
    home = ROOT.parent / CORPUS_HOME
    assert not free_functions_taking(home, "manifest"), free_functions_taking(home, "manifest")
    bad = [
        f"{name}: {', '.join(refs)}"
        for name, path in modules().items()
        if path != home and (refs := [r for r in corpus_reads(path) if not r.startswith("manifest ")])
    ]
    bad += [f"{user}: {', '.join(refs)}" for user in CORPUS_USERS if (refs := corpus_reads(ROOT.parent / user))]
    assert not bad, "a prepared corpus read beside open_corpus (use its PreparedCorpus):\n" + "\n".join(bad)


# A run directory is opened once (issue 66): `RunDir` holds its location and what was read there
# (its saved config, Ray Train's snapshot), with a method for each check and file; no free function
# of raymt/rundir.py takes a run directory.
RUN_DIR_FUNCTIONS_LEFT: set[str] = set()


def test_a_run_directory_is_read_through_its_object():
    """raymt/rundir.py has no free function taking a `run_dir` (`RunDir` holds it), but those left."""
    found = free_functions_taking(ROOT / "rundir.py", "run_dir")
    bad = [f for f in found if f.split()[0] not in RUN_DIR_FUNCTIONS_LEFT]
    assert not bad, "free functions taking a run directory (make them methods of raymt.rundir.RunDir): " + ", ".join(
        bad
    )


def test_the_corpus_checks_find_what_they_look_for(tmp_path):
    """On made-up modules: a free function taking a manifest or a run directory, a manifest read
    by key and the one-pair format are found; a method taking one and MANIFEST_FILE are not."""
    (tmp_path / "a.py").write_text(
        "def pairs(manifest):\n    return manifest['corpora']\n\n\n"
        "class C:\n    def f(self, manifest):\n        return MANIFEST_FILE\n\n\n"
        "def resumable(run_dir):\n    pass\n"
    )
    (tmp_path / "b.py").write_text("X = 'raymt-corpus/1'\nY = ONE_PAIR_FORMAT\n")
    assert free_functions_taking(tmp_path / "a.py", "manifest") == ["pairs (line 1)"]
    assert free_functions_taking(tmp_path / "a.py", "run_dir") == ["resumable (line 10)"]
    assert corpus_reads(tmp_path / "b.py") == ["raymt-corpus/1 (line 1)", "ONE_PAIR_FORMAT (line 2)"]
    assert [r for r in corpus_reads(tmp_path / "a.py") if "MANIFEST" in r] == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """On a made-up package: a cycle hidden in a function, private names imported or reached
    as attributes, long modules and functions; a package's __init__ re-exporting is no cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "sub/__init__.py": "from pkg.sub.a import A\nfrom pkg.sub import b as _b\n",
        "sub/a.py": "from pkg.sub.b import B\nA = 1\n",
        "sub/b.py": "B = 2\n",
        "x.py": "import pkg.y as why\n\ndef f():\n    from pkg import z\n    return why._h, z\n",
        "y.py": "def _h():\n    pass\n",
        "z.py": "from pkg.x import f\nfrom pkg.y import _h\nfrom pkg import sub\nsub._b\n" + "\n" * 700,
        "w.py": "class C:\n    def m(self):\n        def inner():\n" + "            pass\n" * 80,
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph, bad = import_graph(pkg)
    assert [chain(graph, c) for c in components(graph)] == ["pkg.x -> pkg.z -> pkg.x"]
    assert sorted(line.split(" (line")[0] for line in bad) == [
        "pkg.x uses pkg.y._h",
        "pkg.z imports pkg.y._h",
        "pkg.z uses pkg.sub._b",
    ]
    (pkg / "__main__.py").write_text('COMMANDS = {"x": "", "sub": "", "y": ""}\n')
    (pkg / "sub" / "__main__.py").write_text("from pkg import x\n")
    graph, _ = import_graph(pkg)
    commands = command_modules(pkg)
    assert commands == ["pkg.x", "pkg.sub.__main__", "pkg.y"]
    assert [p.split(",")[0] for p in command_import_problems(graph, commands, {("pkg.x", "pkg.y")})] == [
        "pkg.sub.__main__ imports pkg.x"
    ]
    by_module, by_function = sizes(pkg)
    assert by_module["pkg/z.py"] == 704 and by_function == {"pkg/w.py:C.m": 82, "pkg/y.py:_h": 2, "pkg/x.py:f": 3}


def test_the_key_checks_find_what_they_look_for(tmp_path):
    """On a made-up package: each way of naming a key, outside the home module only; the
    fields of a dataclass; a loop config read by key."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "home.py": "class S:\n    a: int = 0\n    b: dict\n    C = 1\n\ndef f(d):\n    return d['a']\n",
        "x.py": "def f(d, loop_config):\n    return d['a'], d.get('b'), {'a': 1}, dict(b=2), 'a' in d, d['c']\n",
        "y.py": "def g(loop_config):\n    return loop_config['x'], loop_config.get('y'), loop_config.x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert class_fields(parse(pkg / "home.py"), "S") == ["a", "b"]
    assert keys_named_outside(pkg, "pkg/home.py", {"a", "b"}) == [
        "pkg/x.py:2 names 'a'",
        "pkg/x.py:2 names 'a'",
        "pkg/x.py:2 names 'a'",
        "pkg/x.py:2 names 'b'",
        "pkg/x.py:2 names 'b'",
    ]
    assert [u.split(":")[1] for u in text_uses(pkg, ('loop_config["', "loop_config['", "loop_config.get("))] == [
        "2",
        "2",
    ]


# Settings are typed (issue 66): the dataclasses of raymt/config/ are read by attribute, inside Ray
# tasks and actors too (a dataclass pickles), and become a dict only on their way to JSON. A settings
# field read by string key (`x["max_len"]`, `x.get("dedup")`, `x.pop(...)`) outside raymt/config/
# (whose from_dict readers read stored configs) is a dict standing in for its dataclass. A field that
# some module also writes as a key (`{"seed": ...}`, `dict(seed=...)`, `x["seed"] = ...`) names an
# entry of a manifest, record or report too (src_lang, seed, temperature, beam, ...): reading it says
# nothing, so the rule judges the other fields (max_len, dedup, skip_invalid, noise_swap, ...: most).
SETTINGS_HOME = "config"  # under raymt/

# The places that still read a settings field by key, as "raymt/x.py:function", each with why. A
# listed place that reads none must be deleted.
SETTINGS_READ_BY_KEY: set[str] = set()

# Fields the rule must keep judging: prepare's options that data/clean.py read by key until issue 66.
PREPARE_FIELDS = {"max_chars", "max_len", "max_ratio", "ratio_min_len", "dedup", "near_dedup", "skip_invalid"}


def is_dataclass(node: ast.ClassDef) -> bool:
    """Whether a class is decorated with `dataclass` (`@dataclass`, `@dataclasses.dataclass(...)`)."""
    return any("dataclass" in identifiers(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list)


def scoped(tree: ast.AST, scope: str = "<module>") -> Iterator[tuple[str, ast.AST]]:
    """Every node under `tree` with the function or class it is in ("C.m"; "<module>" outside any)."""
    for child in ast.iter_child_nodes(tree):
        yield scope, child
        inner = scope
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
        yield from scoped(child, inner)


def key_written(node: ast.AST) -> list[str]:
    """The strings a node writes as keys: `{"k": ...}`, `dict(k=...)`, `x["k"] = ...` (`+=` too),
    `x.setdefault("k")`."""
    keys: list = []
    if isinstance(node, ast.Dict):
        keys = node.keys
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return [k.arg for k in node.keywords if k.arg]
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
        keys = [node.slice]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault":
        keys = node.args[:1]
    return [k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def key_read(node: ast.AST) -> list[str]:
    """The string a node reads as a key: `x["k"]`, `x.get("k")`, `x.pop("k")`."""
    keys: list = []
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        keys = [node.slice]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop"):
        keys = node.args[:1]
    return [k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def settings_fields(root: Path = ROOT) -> set[str]:
    """The fields of the dataclasses in root/config/ that no module of `root` writes as a key."""
    trees = [parse(path) for path in modules(root).values()]
    fields = {
        s.target.id
        for path in (root / SETTINGS_HOME).rglob("*.py")
        for node in ast.walk(parse(path))
        if isinstance(node, ast.ClassDef) and is_dataclass(node)
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }
    return fields - {key for tree in trees for node in ast.walk(tree) for key in key_written(node)}


def settings_read_by_key(root: Path, fields: set[str]) -> dict[str, list[str]]:
    """ "raymt/x.py:function" -> ["'max_len' (line 12)", ...]: where a module outside root/config/
    reads one of `fields` by string key."""
    found: dict[str, list[str]] = {}
    for path in modules(root).values():
        if (root / SETTINGS_HOME) in path.parents:
            continue
        rel = path.relative_to(root.parent).as_posix()
        for scope, node in scoped(parse(path)):
            for key in key_read(node):
                if key in fields:
                    found.setdefault(f"{rel}:{scope}", []).append(f"{key!r} (line {node.lineno})")
    return found


def settings_key_problems(found: dict[str, list[str]], allowed: set[str]) -> list[str]:
    """A settings key read outside `allowed` (SETTINGS_READ_BY_KEY), and an allowed place that reads none."""
    problems = [f"{place} reads {', '.join(reads)}" for place, reads in sorted(found.items()) if place not in allowed]
    problems += [
        f"SETTINGS_READ_BY_KEY lists {place}, which reads no settings field by key: delete it"
        for place in sorted(allowed - set(found))
    ]
    return problems


def test_settings_are_read_by_attribute():
    """No raymt module reads a settings dict by string key where a dataclass exists (issue 66):
    prepare hands its Ray Data tasks and actors its PrepareConfig, not `dataclasses.asdict` of it."""
    fields = settings_fields()
    assert PREPARE_FIELDS <= fields, f"no longer judged (written as a key somewhere): {PREPARE_FIELDS - fields}"
    problems = settings_key_problems(settings_read_by_key(ROOT, fields), SETTINGS_READ_BY_KEY)
    assert not problems, "settings read by string key (read the dataclass's attribute):\n" + "\n".join(problems)


def test_the_settings_check_finds_what_it_looks_for(tmp_path):
    """On a made-up package: the fields of its config/ dataclasses read by key are found, in a
    method too; a field also written as a key, a plain class's, an attribute and config/'s own
    reads are not; an allowed place is not reported, and one that reads nothing is."""
    pkg = tmp_path / "pkg"
    (pkg / "config").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/s.py": (
            "import dataclasses\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass S:\n"
            "    max_len: int = 1\n    seed: int = 1\n    dedup: bool = False\n\n\n"
            "@dataclasses.dataclass(frozen=True)\nclass T:\n    skip_invalid: bool = False\n\n\n"
            "class Plain:\n    window: int = 1\n\n\ndef from_dict(d):\n    return S(max_len=d['max_len'])\n"
        ),
        "x.py": (
            "def f(options, cfg):\n"
            "    return options['max_len'], options.get('skip_invalid'), cfg.dedup, options['window']\n\n\n"
            "class C:\n    def m(self, options):\n        return options.pop('dedup')\n\n\n"
            "def record(cfg):\n    return {'seed': cfg.seed}\n"
        ),
        "y.py": "def g(manifest):\n    return manifest['seed']\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    fields = settings_fields(pkg)
    assert fields == {"max_len", "dedup", "skip_invalid"}
    found = settings_read_by_key(pkg, fields)
    assert found == {
        "pkg/x.py:f": ["'max_len' (line 2)", "'skip_invalid' (line 2)"],
        "pkg/x.py:C.m": ["'dedup' (line 7)"],
    }
    assert settings_key_problems(found, {"pkg/x.py:C.m", "pkg/y.py:g"}) == [
        "pkg/x.py:f reads 'max_len' (line 2), 'skip_invalid' (line 2)",
        "SETTINGS_READ_BY_KEY lists pkg/y.py:g, which reads no settings field by key: delete it",
    ]


def test_allowlists_may_only_shrink():
    """An allowlisted offender may shrink; it fails when it grows or fits, as does a new one."""
    table = {"a.py": 750, "b.py": 900, "c.py": 600, "d.py": 710}
    assert size_problems(table, 700, {"a.py": 800, "b.py": 850, "c.py": 650}) == [
        "b.py grew to 900 lines (STILL_TOO_LARGE allows 850, limit 700)",
        "c.py fits now (600 <= 700 lines): delete it from STILL_TOO_LARGE",
        "d.py has 710 lines, over 700: split it",
    ]
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}, "e": set()}
    assert cycle_problems(graph, [frozenset("abx"), frozenset("ef")]) == [
        "import cycle c -> d -> c",
        "KNOWN_CYCLES lists ['e', 'f'], no longer a cycle: delete it",
    ]


def test_the_one_pair_names_are_read_in_at_most_three_modules():
    """The one-pair names describe a run's one pair of corpora the way raymt did before
    data.corpora described every run: older configs' data.src_lang, data.tgt_lang, data.train,
    data.valid and data.test (ONE_PAIR_FIELDS: a config file's [data] keys, --set keys, a stored
    run_config.json's or checkpoint's), and `raymt train`/`raymt tune`'s --src-lang/--tgt-lang and
    a bare --valid/--test (no SRC-TGT:, no --train/--bt/--pairs), which set the languages and sets
    of the config's one corpus. build_config reads them into data.corpora where it assembles the
    flat map, Config.from_dict where it reads a stored config: nowhere else (issue 56).

    Not one-pair names: a model's languages (translate, evaluate and backtranslate's
    --src-lang/--tgt-lang pick a checkpoint's direction or its target tag), CorpusSpec's
    src_lang/tgt_lang and the keys of [[data.corpora]] tables, `raymt data prepare`'s --src/--tgt
    (PrepareConfig.src_lang/tgt_lang: the pair of a SPEC without SRC-TGT:, read by the same
    `raymt.flags.InputFlags.corpora` as train's), and a prepared corpus's older format
    raymt-corpus/1 (ONE_PAIR_FORMAT). `one_pair_names` finds them by the names the code gives them.
    """
    found = {name: refs for name, path in modules().items() if (refs := one_pair_names(path))}
    for name, refs in sorted(found.items()):
        print(f"{name}: {len(refs)} ({', '.join(refs)})")
    outside = [f"{name}: {', '.join(refs)}" for name, refs in sorted(found.items()) if name not in ONE_PAIR_HOMES]
    assert len(ONE_PAIR_HOMES) <= 3 and not outside, (
        "the one-pair names are read outside raymt.flags.build_config and Config.from_dict:\n" + "\n".join(outside)
    )


def test_the_one_pair_check_finds_what_it_looks_for(tmp_path):
    """On made-up modules: the reader's names, older keys and a corpus parser's --src-lang are
    found; a translate-like --tgt-lang, a docstring and ONE_PAIR_FORMAT are not."""
    files = {
        "reader.py": "from raymt.config.corpus import with_one_pair as w\n",
        "keys.py": "KEYS = ['data.valid']\n",
        "parser.py": "def f(p):\n    add_input_flags(p)\n    p.add_argument('--src-lang')\n",
        "translate.py": '"""Reads data.src_lang."""\n\ndef f(p, ONE_PAIR_FORMAT):\n    p.add_argument("--tgt-lang")\n',
        "beside.py": "def f(check_beside_corpora):\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert {name: one_pair_names(tmp_path / name) for name in files} == {
        "reader.py": ["with_one_pair (line 1)"],
        "keys.py": ["data.valid (line 1)"],
        "parser.py": ["--src-lang (line 3)"],
        "translate.py": [],
        "beside.py": ["check_beside_corpora (line 1)"],
    }


def test_no_test_imports_benchmark_code():
    """Tests run a benchmark as a process and read what it writes; what both need lives in raymt/
    or a tests/ helper (issue 43)."""
    bad = []
    for path in sorted((ROOT.parent / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not bad, "tests import benchmark code:\n" + "\n".join(bad)


def test_arguments_stop_at_main():
    """issue 66: `argparse.Namespace` only in parse functions; no command calls another's main."""
    problems = namespace_uses() + main_calls()
    assert not problems, "\n".join(problems)


def test_the_command_checks_find_what_they_look_for(tmp_path):
    """On a made-up package: a Namespace taken outside a parse function (annotation, import from
    argparse), and a command's main called by another module, by attribute or by name."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "__main__.py": 'COMMANDS = {"a": "", "b": "", "sub": ""}\n',
        "a.py": "import argparse\n\ndef parse_args(argv) -> argparse.Namespace:\n    return argparse.Namespace()\n\n"
        "def main(argv=None):\n    return 0\n\ndef f(args: argparse.Namespace):\n    return args\n",
        "b.py": "from argparse import Namespace\nfrom pkg import a\nfrom pkg.sub.__main__ import main as sub_main\n\n"
        "def g():\n    return a.main([]), sub_main([]), Namespace()\n\ndef main(argv=None):\n    return g()\n",
        "sub/__init__.py": "",
        "sub/__main__.py": "def main(argv=None):\n    return 0\n",
        "c.py": "import pkg.a\n\ndef h():\n    return pkg.a.main(), pkg.a.run()\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert namespace_uses(pkg) == ["pkg/a.py:9 names argparse.Namespace", "pkg/b.py:6 names argparse.Namespace"]
    assert main_calls(pkg) == [
        "pkg/b.py:6 calls pkg.a.main",
        "pkg/b.py:6 calls pkg.sub.__main__.main",
        "pkg/c.py:4 calls pkg.a.main",
    ]
