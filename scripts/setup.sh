#!/usr/bin/env bash
# Create .venv with Python 3.12 and install deepinfer-jax from this checkout.
#   bash scripts/setup.sh          runtime only (CPU jax; add the cuda12/cuda13 extra on a GPU machine)
#   bash scripts/setup.sh --test   plus the test extra (pytest, torch, transformers, openai) and Chromium
#                                  (apt-get) for the dashboard's browser test
# Idempotent: a second run only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
case "$#:${1:-}" in
  0:) ;;
  1:--test) extras="[test]" ;;
  *) echo "setup: unknown arguments: $* (usage: bash scripts/setup.sh [--test])" >&2; exit 2 ;;
esac

want="$(cat .python-version)"
py=""
if command -v pyenv >/dev/null 2>&1 && pyenv prefix "$want" >/dev/null 2>&1; then
  py="$(pyenv prefix "$want")/bin/python"
elif command -v "python${want%.*}" >/dev/null 2>&1; then
  py="$(command -v "python${want%.*}")"
elif command -v python3.12 >/dev/null 2>&1; then
  py="$(command -v python3.12)"
else
  echo "setup: Python 3.12 is required (pyenv install $want, or a python3.12 on PATH)" >&2
  exit 1
fi

if [[ ! -x .venv/bin/python ]]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extras}"
if [[ -n "$extras" ]] && ! command -v chromium >/dev/null 2>&1; then
  # the dashboard's browser test (tests/e2e/test_dashboard.py) drives a headless Chromium
  if command -v apt-get >/dev/null 2>&1 && { [[ $EUID -eq 0 ]] || sudo -n true 2>/dev/null; }; then
    sudo_=""; [[ $EUID -eq 0 ]] || sudo_="sudo -n"
    $sudo_ apt-get install -y -q chromium >/dev/null 2>&1 || { $sudo_ apt-get update -q >/dev/null 2>&1 &&
      $sudo_ apt-get install -y -q chromium >/dev/null 2>&1; } ||
      echo "setup: could not install chromium: the dashboard's browser test will be skipped" >&2
  else
    echo "setup: chromium is not installed and cannot be installed here (no apt-get or no root): the dashboard's browser test will be skipped" >&2
  fi
fi
echo "setup: ready ($(.venv/bin/python --version), extras: ${extras:-none})"
