#!/usr/bin/env bash
# Wheels the GPU image lacks and ../shared/tools/gpu/prepare does not fetch: the KV-event transport
# (pyzmq, msgspec), structured outputs (xgrammar and apache-tvm-ffi) and jsonschema with its
# dependencies. Without them 60-odd tests fail to import on the GPU machine. Run from the project root,
# after the prepare script, on the CPU machine (needs the package registry); versions are the ones
# .venv has. They land in .gpu/whl, which the device calls carry.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 24 26 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64)
for pkg in pyzmq msgspec xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py; do
  version=$(.venv/bin/python -m pip show "$pkg" 2>/dev/null | sed -n 's/^Version: //p')
  python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/whl "$pkg==${version:?$pkg not in .venv}" 2>&1 \
    | grep -v '^WARNING: Location' || true
done
du -sh .gpu/whl
