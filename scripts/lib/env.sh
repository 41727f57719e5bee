# Shared set-up for scripts/demo and scripts/test: a virtualenv with swarmloco installed.
#
#   SWARMLOCO_VENV        where the virtualenv lives (default: .venv in the repository)
#   SWARMLOCO_TORCH_SPEC  the torch requirement to install first when the virtualenv has no
#                         torch yet (default: torch==2.13.0, the CPU build); set it to pick
#                         another build, e.g. "torch==2.5.1 --index-url https://..."
#   SWARMLOCO_PYTHON      the interpreter that creates the virtualenv (default: python3)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${SWARMLOCO_VENV:-$repo_root/.venv}"

ensure_env() {
    local extras="$1"
    if [ ! -x "$venv/bin/python" ]; then
        echo "==> creating virtualenv $venv"
        "${SWARMLOCO_PYTHON:-python3}" -m venv "$venv"
    fi
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    if ! python -c "import torch" >/dev/null 2>&1; then
        local spec="${SWARMLOCO_TORCH_SPEC:-torch==2.13.0}"
        echo "==> installing $spec"
        # shellcheck disable=SC2086
        python -m pip install --disable-pip-version-check -q $spec
    fi
    # Reinstall only when the package metadata changed since the last install.
    local stamp="$venv/.swarmloco-$extras.stamp"
    local want
    want="$(cat "$repo_root/pyproject.toml" | python -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! python -c "import swarmloco" >/dev/null 2>&1; then
        echo "==> installing swarmloco[$extras] into $venv"
        python -m pip install --disable-pip-version-check -q -e "$repo_root[$extras]"
        echo "$want" >"$stamp"
    fi
}
