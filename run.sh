#!/usr/bin/env bash
# Set up everything from nothing (a .venv beside this file), then run one command:
#   ./run.sh train [raymt.train flags]   train on the built-in corpus with 2 Ray workers
#   ./run.sh test  [pytest flags]        run the test suite (also installs the [test] extra)
#   ./run.sh test --hosts [pytest flags] the tests marked `hosts` under each other host's kernels
#                                        (HOST_LIMITS; docs/architecture.md#tests)
#   ./run.sh lint                        ruff: lint and format check (CI runs it first)
#   ./run.sh shell                       just set up; then: source .venv/bin/activate
#   ./run.sh libretranslate [its flags]  LibreTranslate 1.9.6 in a venv of its own,
#                                        .venv-libretranslate (its argos-translate-lt fork and the
#                                        test extra's argostranslate are one module); no flags:
#                                        just set up (docs/serving.md "Deploying to LibreTranslate")
# train and shell install only what training needs; test adds pytest and the peers it compares
# to; lint adds only ruff.
set -euo pipefail
cd "$(dirname "$0")"

cmd=${1:-train}
shift || true
case "$cmd" in
  train | test | lint | shell | libretranslate) ;;
  *) echo "run.sh: unknown command '$cmd' (use train, test, lint, shell or libretranslate)" >&2; exit 2 ;;
esac

python_bin=${PYTHON:-}
if [[ -z "$python_bin" ]]; then
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null; then python_bin=$candidate; break; fi
  done
fi
[[ -n "$python_bin" ]] || { echo "run.sh: no python3 found; install Python 3.11" >&2; exit 2; }

# A venv in $1 (made if missing), activated, with torch in it.
venv_with_torch() {
  if [[ ! -x "$1/bin/python" ]]; then
    "$python_bin" -m venv "$1"
  fi
  # shellcheck disable=SC1091
  source "$1/bin/activate"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  # torch first, so that the project's `torch>=2.4` (and LibreTranslate's) finds it installed:
  # - with an NVIDIA GPU: the default wheel from the package index (CUDA build);
  # - without one: the CPU-only wheel (~200 MB instead of several GB of CUDA libraries),
  #   from PyTorch's CPU wheel index, or from a local wheel cache when pip has one.
  if ! python -c "import torch" 2>/dev/null; then
    local torch_spec=${RAYMT_TORCH:-torch==2.13.0}
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
      pip install "$torch_spec"
    else
      pip install --retries 1 "$torch_spec" \
        --extra-index-url "${RAYMT_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
    fi
  fi
}

# LibreTranslate apart from the project (tests/test_libretranslate.py and
# benchmarks/serve_load.py find it here); the project is not installed into it. spaCy: the
# sentence splitter of raymt's packages offline (ARGOS_CHUNK_TYPE=SPACY), which LibreTranslate lacks.
if [[ "$cmd" == libretranslate ]]; then
  venv_with_torch .venv-libretranslate
  libre_specs="libretranslate==1.9.6 spacy==3.8.18"
  if [[ "$(cat .venv-libretranslate/.installed 2>/dev/null)" != "$libre_specs" ]]; then
    # shellcheck disable=SC2086  # the specs are words
    pip install $libre_specs
    echo "$libre_specs" >.venv-libretranslate/.installed
  fi
  if [[ $# == 0 ]]; then echo "ready: .venv-libretranslate/bin/libretranslate"; exit 0; fi
  exec libretranslate "$@"
fi

venv_with_torch .venv

# Install the project with only the extras the command needs (train: none; test: [test]),
# each recorded by a marker file, redone when pyproject.toml is newer than its marker.
install_project() {  # install_project [EXTRA]
  local spec=. marker=.venv/.raymt-installed
  if [[ -n "${1:-}" ]]; then spec=".[$1]"; marker=".venv/.raymt-installed-$1"; fi
  if [[ ! -f "$marker" ]] || [[ pyproject.toml -nt "$marker" ]]; then
    pip install -e "$spec"
    touch "$marker"
  fi
}
install_project
if [[ "$cmd" == test || "$cmd" == lint ]]; then install_project "$cmd"; fi

# The kernels of the other hosts CI and sessions land on (an AVX2-only AMD EPYC; no SIMD at all
# for ATen and CTranslate2), forced on this one: MKL, ATen, oneDNN and CTranslate2 round as they
# would there (tests/test_host_limits.py checks that each limit took effect).
HOST_LIMITS=(
  "MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 CT2_FORCE_CPU_ISA=AVX2"
  "ATEN_CPU_CAPABILITY=default CT2_FORCE_CPU_ISA=GENERIC"
)
if [[ "$cmd" == test && "${1:-}" == --hosts ]]; then
  shift
  for limits in "${HOST_LIMITS[@]}"; do
    echo "run.sh: tests marked hosts, under $limits" >&2
    # shellcheck disable=SC2086  # the limits are words: NAME=VALUE pairs for env
    env $limits python -m pytest -m hosts "$@"
  done
  exit 0
fi

case "$cmd" in
  train) exec python -m raymt.train "$@" ;;
  test) exec python -m pytest "$@" ;;
  lint) ruff check . && exec ruff format --check . ;;
  shell) echo "ready: source .venv/bin/activate" ;;
esac
